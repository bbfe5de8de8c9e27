/* What the llm command's subcommands share (clients/c/cmd_llm.c): the
 * global options, a subcommand's parsing, opening a client, printing
 * JSON; `llm generate` lives in llm_generate.c. */
#ifndef LLM_CLI_H
#define LLM_CLI_H

#include "client.h"
#include "common/options.h"

#include <cjson/cJSON.h>
#include <stdbool.h>

struct llm_global {
    const char *router, *log_level, *curve_key_file, *router_key;
    int reply_timeout_ms, retry_ms, idle_timeout_ms, connect_timeout_ms;
    bool insecure;
};

/* The global options, declared once: main parses them before the
 * subcommand, and every subcommand's table takes them again (defaults =
 * the values so far, no environment) so that they work after it too. */
#define LLM_N_GLOBAL 9
void llm_global_defs(struct llm_global *g, struct option_def *d);

/* Parses a subcommand's options followed by the global ones.  Returns -1 to
 * go on, else the exit code (0 after --help, 2 for a bad flag). */
int llm_parse_sub(struct llm_global *g, const char *name, const char *usage, const char *about,
                  const struct option_def *sub, int n_sub, int *argc, char **argv);

/* Opens a client and checks that a router answers; returns 0, or the exit
 * code (2: a bad --router; 1: no router answers, said how to start one). */
int llm_open(const struct llm_global *g, llm_client **c);

/* j on one line of stdout, flushed. */
void llm_print_json(cJSON *j);

/* llm generate (llm_generate.c): returns the exit code. */
int llm_generate(struct llm_global *gl, int argc, char **argv);

#endif
