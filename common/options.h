/* Program options: one table per program (name, environment variable, type,
 * default, help, target) drives the command-line flags, the environment
 * (Kubernetes passes settings as env vars) and the --help text, so that no
 * program parses an option by hand.  Precedence: flag over environment over
 * default.
 *
 *   static int port; static const char *url; static bool verbose;
 *   static const struct option_def defs[] = {
 *       {"port", "LLM_PORT", OPTION_INT, "5555", "port clients connect to", &port, 1, 65535},
 *       {"redis-url", "LLM_REDIS_URL", OPTION_STRING, "redis://127.0.0.1:6379", "Redis", &url},
 *       {"verbose", NULL, OPTION_BOOL, "false", "log debug lines", &verbose},
 *   };
 *   struct options o = {"llm-router", "[options]", "Routes requests.", defs, 3};
 *   char err[256];
 *   int rc = options_parse(&o, &argc, argv, err, sizeof err);
 *   if (rc == STATUS_CANCELLED) return 0;          // --help was printed
 *   if (rc < 0) { fprintf(stderr, "%s\n", err); return 2; }
 *   // argv[1..argc-1] are now the positional arguments, in order.
 *
 * Subcommands ("llm generate --prompt hi"): parse the global table with
 * stop_at_positional set, then dispatch on argv[1] and parse the subcommand's
 * table with options_parse(&sub, &n, argv + 1, ...), where n = argc - 1:
 * the subcommand word plays the part of argv[0]. */
#ifndef COMMON_OPTIONS_H
#define COMMON_OPTIONS_H

#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>
#include <stdio.h>

enum option_type {
    OPTION_STRING = 0, /* target: const char ** (points into argv, the environment or def; never freed) */
    OPTION_INT = 1,    /* target: int *; decimal; range [min, max], or int's range when both are 0 */
    OPTION_SIZE = 2,   /* target: int64_t *; bytes, with an optional K/M/G/T suffix (powers of 1024) */
    OPTION_FLOAT = 3,  /* target: double *; finite; range [min, max] unless both are 0 */
    OPTION_BOOL = 4,   /* target: bool *; "--name" sets true, "--no-name" false,
                          "--name=V" and the environment take true/false/1/0/yes/no/on/off */
    OPTION_CHOICE = 5, /* target: int *; the index of the value in choices (NULL-terminated) */
};

struct option_def {
    const char *name;    /* flag name without the dashes: "redis-url" */
    const char *env;     /* environment variable ("LLM_REDIS_URL"), or NULL for none */
    enum option_type type;
    const char *def;     /* default, written as a flag value; NULL: NULL, 0, false or choice 0 */
    const char *help;    /* one line for --help */
    void *target;        /* see enum option_type */
    double min, max;     /* OPTION_INT/SIZE/FLOAT: accepted range, inclusive */
    const char *const *choices; /* OPTION_CHOICE: the accepted values, NULL-terminated */
};

struct options {
    const char *program;            /* "llm-router" (the usage line); NULL: argv[0] */
    const char *usage;              /* after the program name: "[options] <prompt>" */
    const char *about;              /* a sentence under the usage line, or NULL */
    const struct option_def *defs;
    int n_defs;
    bool stop_at_positional;        /* stop at the first positional: it and everything
                                       after it are left, unparsed, as positionals */
};

/* Sets every target: its default, then its environment variable if that is
 * set and not empty, then the flags in argv ("--name value", "--name=value",
 * "--flag", "--no-flag"; the last of a repeated flag wins; "--" ends the
 * flags).  On success argv is reordered so that argv[1..*argc-1] are the
 * positional arguments in their order (argv[0] stays) and *argc counts them
 * plus one.
 * Returns 0; STATUS_CANCELLED after writing the help to stdout for --help or
 * -h (the program should exit with 0); STATUS_BAD_INPUT for an unknown flag,
 * a missing value or a bad value, with a message in err naming the flag (or
 * the environment variable) and the value; STATUS_INTERNAL for a bad table
 * (a default that does not parse), naming the option.  On failure targets
 * may be partly set and argv partly reordered. */
int options_parse(const struct options *o, int *argc, char **argv, char *err, size_t err_size);

/* For settings of a library that has no command line of its own (the CUDA
 * backend's LLM_CUDA_* knobs, kernels/cuda/knobs.c): sets every target from
 * its default, then from its environment variable where that is set and not
 * empty; flags play no part, and the names only label options_log's lines.
 * Returns 0; STATUS_BAD_INPUT for a bad value, with a message in err naming
 * the variable and the value ("environment variable LLM_CUDA_WIDE: 'maybe'
 * is not a boolean ..."); STATUS_INTERNAL for a bad table.  On failure
 * targets may be partly set. */
int options_parse_env(const struct options *o, char *err, size_t err_size);

/* Writes the usage line, the about text and one entry per option (flag,
 * value kind or choices, environment variable, default, help) to f. */
void options_help(const struct options *o, FILE *f);

/* Writes the current value of every option as "name=value" lines to the log
 * at LL_INFO, so that a process's start records the settings it runs with. */
void options_log(const struct options *o);

/* Formats the current value of one option's target into buf ("5555",
 * "redis://...", "true", "fp16"; "(none)" for a NULL string). */
void options_value_str(const struct option_def *d, char *buf, size_t size);

#endif
