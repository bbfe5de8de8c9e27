/* Logging to stderr (or a callback) with time, process name, pid and level. */
#include "log.h"
#include "status.h"

#include <stdarg.h>
#include <stdio.h>
#include <string.h>
#include <sys/time.h>
#include <time.h>
#include <unistd.h>

int log_level_min = LL_INFO;
static char log_process[32] = "llm";
static log_callback log_cb;
static void *log_cb_ud;

void log_set_level(int level) { log_level_min = level; }

int log_level_parse(const char *name, int *level) {
    static const char *const names[] = {"debug", "info", "warn", "error", "none"};
    for (int i = 0; i < 5; i++)
        if (strcmp(name, names[i]) == 0) {
            *level = i;
            return STATUS_OK;
        }
    return STATUS_BAD_INPUT;
}

void log_set_process(const char *name) {
    snprintf(log_process, sizeof log_process, "%s", name);
}

void log_set_callback(log_callback cb, void *ud) {
    log_cb = cb;
    log_cb_ud = ud;
}

void log_write(int level, const char *fmt, ...) {
    static const char mark[] = "DIWE";
    char line[2048];
    struct timeval tv;
    struct tm tm;
    gettimeofday(&tv, NULL);
    localtime_r(&tv.tv_sec, &tm);
    int n = snprintf(line, sizeof line, "%02d:%02d:%02d.%03d %s[%d] %c ", tm.tm_hour,
                     tm.tm_min, tm.tm_sec, (int)(tv.tv_usec / 1000), log_process,
                     (int)getpid(), mark[level < 0 ? 0 : level > 3 ? 3 : level]);
    va_list ap;
    va_start(ap, fmt);
    vsnprintf(line + n, sizeof line - (size_t)n, fmt, ap);
    va_end(ap);
    if (log_cb) {
        log_cb(level, line, log_cb_ud);
        return;
    }
    fprintf(stderr, "%s\n", line);
}
