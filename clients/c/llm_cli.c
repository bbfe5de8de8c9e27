/* The llm command's shared parts (llm_cli.h). */
#include "llm_cli.h"

#include "common/log.h"
#include "common/status.h"

#include <assert.h>
#include <stdio.h>
#include <string.h>

void llm_global_defs(struct llm_global *g, struct option_def *d) {
    const struct option_def defs[LLM_N_GLOBAL] = {
        {"router", "LLM_ROUTER", OPTION_STRING, "tcp://127.0.0.1:5555",
         "router client endpoint(s), comma-separated: tried in order after a failure", &g->router, 0, 0, NULL},
        {"connect-timeout-ms", "LLM_CONNECT_TIMEOUT_MS", OPTION_INT, "2000",
         "say that no router answers after this long, and how to start one", &g->connect_timeout_ms, 1,
         1 << 30, NULL},
        {"reply-timeout-ms", "LLM_REPLY_TIMEOUT_MS", OPTION_INT, "5000",
         "wait this long for a reply before trying the next endpoint", &g->reply_timeout_ms, 1, 1 << 30, NULL},
        {"retry-ms", "LLM_RETRY_MS", OPTION_INT, "30000",
         "give up after this long without progress (no answer, or only 'cannot serve now')", &g->retry_ms, 1,
         1 << 30, NULL},
        {"idle-timeout-ms", "LLM_IDLE_TIMEOUT_MS", OPTION_INT, "30000",
         "re-attach after this long without a message during a generation", &g->idle_timeout_ms, 1, 1 << 30, NULL},
        {"log-level", "LLM_LOG_LEVEL", OPTION_STRING, "warn", "debug, info, warn, error or none", &g->log_level,
         0, 0, NULL},
        {"curve-key-file", "LLM_CURVE_KEY_FILE", OPTION_STRING, NULL,
         "this client's CURVE key pair (NAME.key from llm keygen)", &g->curve_key_file, 0, 0, NULL},
        {"router-key", "LLM_ROUTER_KEY", OPTION_STRING, NULL, "the router's public key file (NAME.pub)",
         &g->router_key, 0, 0, NULL},
        {"insecure", "LLM_INSECURE", OPTION_BOOL, "false", "plain socket, for a router that runs --insecure",
         &g->insecure, 0, 0, NULL},
    };
    memcpy(d, defs, sizeof defs);
}

int llm_parse_sub(struct llm_global *g, const char *name, const char *usage, const char *about,
                  const struct option_def *sub, int n_sub, int *argc, char **argv) {
    enum { N_SUB_MAX = 32 };
    struct option_def defs[N_SUB_MAX + LLM_N_GLOBAL];
    static char values[LLM_N_GLOBAL][512];
    /* A subcommand with more options is a bug here, not bad input. */
    assert(n_sub <= N_SUB_MAX);
    memcpy(defs, sub, (size_t)n_sub * sizeof *defs);
    llm_global_defs(g, defs + n_sub);
    for (int i = 0; i < LLM_N_GLOBAL; i++) {
        struct option_def *d = &defs[n_sub + i];
        options_value_str(d, values[i], sizeof values[i]);
        /* An unset string stays unset (its text would be "(none)"). */
        d->def = d->type == OPTION_STRING && !*(const char **)d->target ? NULL : values[i];
        d->env = NULL; /* already applied by main: a flag before the subcommand stays */
    }
    struct options o = {name, usage, about, defs, n_sub + LLM_N_GLOBAL, false};
    char err[512];
    int rc = options_parse(&o, argc, argv, err, sizeof err);
    if (rc == STATUS_CANCELLED) return 0;
    if (rc < 0) {
        fprintf(stderr, "%s: %s\n", name, err);
        return 2;
    }
    int level;
    if (log_level_parse(g->log_level, &level) < 0) {
        fprintf(stderr, "%s: --log-level %s: expected debug, info, warn, error or none\n", name, g->log_level);
        return 2;
    }
    log_set_level(level);
    return -1;
}

/* Splits "tcp://a:1,tcp://b:2" in place into eps (at most max). */
static size_t llm_split_endpoints(char *list, const char **eps, size_t max) {
    size_t n = 0;
    for (char *save = NULL, *t = strtok_r(list, ", ", &save); t && n < max; t = strtok_r(NULL, ", ", &save))
        eps[n++] = t;
    return n;
}

int llm_open(const struct llm_global *g, llm_client **c) {
    *c = NULL;
    static char list[2048];
    snprintf(list, sizeof list, "%s", g->router);
    const char *eps[16];
    struct llm_client_config cfg;
    llm_client_config_default(&cfg);
    cfg.endpoints = eps;
    cfg.n_endpoints = llm_split_endpoints(list, eps, 16);
    cfg.reply_timeout_ms = g->reply_timeout_ms;
    cfg.retry_ms = g->retry_ms;
    cfg.idle_timeout_ms = g->idle_timeout_ms;
    cfg.curve_key_file = g->curve_key_file;
    cfg.router_key_file = g->router_key;
    cfg.insecure = g->insecure;
    if (g->insecure) LOG(LL_WARN, "llm: --insecure: plain socket to %s, without keys", g->router);
    char err[512];
    int rc = llm_client_open(c, &cfg, err, sizeof err);
    if (rc < 0) {
        fprintf(stderr, "llm: --router %s: %s\n", g->router, err);
        return 2;
    }
    /* Seconds, not retry_ms, to learn that nothing listens: the usual cause
     * is a cluster not started, and the user should hear how to start it. */
    if (llm_client_probe(*c, g->connect_timeout_ms) < 0) {
        fprintf(stderr,
                "llm: %s.\n"
                "  Start a cluster with:  llm-cluster up --model MODEL.gguf   (then: . RUN_DIR/env.sh)\n"
                "  or point --router (or LLM_ROUTER) at a running router's client endpoint.\n",
                llm_client_errstr(*c));
        llm_client_close(*c);
        *c = NULL;
        return 1;
    }
    return 0;
}

void llm_print_json(cJSON *j) {
    char *s = cJSON_PrintUnformatted(j);
    if (s) {
        printf("%s\n", s);
        cJSON_free(s);
    }
    fflush(stdout);
}
