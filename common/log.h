/* Logging: one macro, LOG(level, fmt, ...), that checks the level before it
 * evaluates its arguments.  Processes set their name and level at start; a
 * process may install a callback to route lines elsewhere (library code in
 * common/ and kernels/ only ever calls LOG). */
#ifndef COMMON_LOG_H
#define COMMON_LOG_H

enum log_level { LL_DEBUG = 0, LL_INFO = 1, LL_WARN = 2, LL_ERROR = 3, LL_NONE = 4 };

/* Called with the fully formatted line (no trailing newline). */
typedef void (*log_callback)(int level, const char *line, void *ud);

extern int log_level_min; /* read by LOG; set through log_set_level */

#define LOG(level, ...)                                                    \
    do {                                                                   \
        if ((level) >= log_level_min) log_write((level), __VA_ARGS__);     \
    } while (0)

void log_set_level(int level);
/* "debug", "info", "warn", "error", "none" -> 0; anything else -> STATUS_BAD_INPUT. */
int log_level_parse(const char *name, int *level);
/* Name printed on every line with the pid ("router", "worker"); copied. */
void log_set_process(const char *name);
/* NULL restores the default: a line on stderr with time, process, pid, level. */
void log_set_callback(log_callback cb, void *ud);
void log_write(int level, const char *fmt, ...) __attribute__((format(printf, 2, 3)));

#endif
