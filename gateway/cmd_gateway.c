/* llm-gateway: the OpenAI-compatible HTTP front door of the cluster (see
 * docs/gateway.md).  Reads its options, API keys and model, starts the
 * server and serves until SIGINT or SIGTERM. */
#include <errno.h>
#include <signal.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#include "common/keys.h"
#include "common/log.h"
#include "common/options.h"
#include "common/status.h"
#include "gateway/gateway.h"

#define KEYS_MAX 1024

struct keys {
    char *v[KEYS_MAX];
    size_t n;
};

/* Adds the keys of text: separated by commas or newlines, blanks trimmed,
 * lines starting with # skipped. */
static int keys_add(struct keys *k, const char *text, const char *from, char *err, size_t errlen) {
    char *copy = strdup(text);
    if (!copy) return STATUS_NO_MEMORY;
    for (char *save = NULL, *t = strtok_r(copy, ",\n\r", &save); t; t = strtok_r(NULL, ",\n\r", &save)) {
        while (*t == ' ' || *t == '\t') t++;
        size_t n = strlen(t);
        while (n > 0 && (t[n - 1] == ' ' || t[n - 1] == '\t')) t[--n] = 0;
        if (n == 0 || t[0] == '#') continue;
        if (k->n == KEYS_MAX) {
            snprintf(err, errlen, "%s: more than %d API keys", from, KEYS_MAX);
            free(copy);
            return STATUS_BAD_INPUT;
        }
        k->v[k->n++] = strdup(t);
    }
    free(copy);
    return 0;
}

static int keys_from_file(struct keys *k, const char *path, char *err, size_t errlen) {
    FILE *f = fopen(path, "r");
    if (!f) {
        snprintf(err, errlen, "--api-keys-file %s: %s", path, strerror(errno));
        return STATUS_IO;
    }
    char line[4096];
    int rc = 0;
    while (rc == 0 && fgets(line, sizeof line, f)) rc = keys_add(k, line, path, err, errlen);
    fclose(f);
    if (rc == 0 && k->n == 0) {
        snprintf(err, errlen, "--api-keys-file %s: holds no key", path);
        return STATUS_BAD_INPUT;
    }
    return rc;
}

int main(int argc, char **argv) {
    struct gateway_config cfg;
    gateway_config_default(&cfg);
    const char *keys_file = NULL, *keys_env = NULL, *curve_key_file = NULL, *router_key = NULL;
    bool insecure = false;
    int log_level = LL_INFO;
    static const char metrics_default[] = "127.0.0.1:9466";
    static const char *const levels[] = {"debug", "info", "warn", "error", "none", NULL};
    const struct option_def defs[] = {
        {"listen", "LLM_GATEWAY_LISTEN", OPTION_STRING, "127.0.0.1:8080",
         "HOST:PORT the HTTP API listens on (0.0.0.0:8080 for every interface; port 0 picks one)", &cfg.listen, 0, 0,
         NULL},
        {"router", "LLM_ROUTER", OPTION_STRING, "tcp://127.0.0.1:5555",
         "router client endpoint(s), comma-separated: tried in order after a failure", &cfg.router, 0, 0, NULL},
        {"model", "LLM_MODEL", OPTION_STRING, NULL,
         "the model file (.gguf) or Hugging Face directory the cluster serves: its tokenizer and chat template "
         "(needed for chat completions)", &cfg.model_path, 0, 0, NULL},
        {"model-name", "LLM_MODEL_NAME", OPTION_STRING, NULL,
         "the name clients use for the cluster's default model (default: the router's model id)", &cfg.model_name, 0,
         0, NULL},
        {"chat-template", "LLM_CHAT_TEMPLATE", OPTION_STRING, NULL,
         "chat template family: llama2, llama3, chatml, mistral, zephyr, gemma, phi3 or deepseek "
         "(default: recognised from the model)", &cfg.chat_template, 0, 0, NULL},
        {"max-body", "LLM_GATEWAY_MAX_BODY", OPTION_SIZE, "1M", "largest request body (bytes; 413 beyond)",
         &cfg.max_body, 1024, (double)(1LL << 30), NULL},
        {"max-connections", "LLM_GATEWAY_MAX_CONNECTIONS", OPTION_INT, "256",
         "HTTP connections at once (one thread each); when all are open, a new one closes the one that has waited "
         "longest for its request", &cfg.max_connections, 1, 65536, NULL},
        {"max-connections-per-ip", "LLM_GATEWAY_MAX_CONNECTIONS_PER_IP", OPTION_INT, "0",
         "HTTP connections at once from one client address (0: no limit; behind a proxy every client shares its "
         "address)", &cfg.max_connections_per_ip, 0, 65536, NULL},
        {"read-timeout-ms", "LLM_GATEWAY_READ_TIMEOUT_MS", OPTION_INT, "10000",
         "a request's headers and body must arrive within this long of its connection opening (or of the "
         "previous response); slower clients are closed", &cfg.read_timeout_ms, 1, 3600000, NULL},
        {"router-retry-ms", "LLM_GATEWAY_ROUTER_RETRY_MS", OPTION_INT, "5000",
         "how long a request waits for an unreachable or overloaded router before 503/429", &cfg.router_retry_ms, 1,
         1 << 30, NULL},
        {"router-reply-timeout-ms", "LLM_GATEWAY_ROUTER_REPLY_TIMEOUT_MS", OPTION_INT, "2000",
         "wait this long for a router's reply before trying the next endpoint", &cfg.router_reply_timeout_ms, 1,
         1 << 30, NULL},
        {"api-keys-file", "LLM_API_KEYS_FILE", OPTION_STRING, NULL,
         "file of accepted API keys (Authorization: Bearer KEY), one a line; # comments", &keys_file, 0, 0, NULL},
        {"metrics-listen", "LLM_METRICS_LISTEN", OPTION_STRING, metrics_default,
         "HOST:PORT of the metrics port: /metrics (Prometheus), /health, /ready; \"\" for none", &cfg.metrics_listen,
         0, 0, NULL},
        {"watchdog-ms", "LLM_WATCHDOG_MS", OPTION_INT, "60000",
         "/health answers 503 once the supervisor loop (which takes every lock a request takes, 4 times a second) "
         "has not turned for this long (0: /health only says the process is up)", &cfg.watchdog_ms, 0, 86400000,
         NULL},
        {"curve-key-file", "LLM_CURVE_KEY_FILE", OPTION_STRING, NULL,
         "the gateway's CURVE key pair towards the router (NAME.key from llm keygen)", &curve_key_file, 0, 0,
         NULL},
        {"router-key", "LLM_ROUTER_KEY", OPTION_STRING, NULL, "the router's public key file (NAME.pub)",
         &router_key, 0, 0, NULL},
        {"insecure", "LLM_INSECURE", OPTION_BOOL, "false", "plain sockets to a router that runs --insecure",
         &insecure, 0, 0, NULL},
        {"log-level", "LLM_LOG_LEVEL", OPTION_CHOICE, "info", "log level", &log_level, 0, 0, levels},
        /* Last, so that options_log leaves the keys out of the log. */
        {"api-keys", "LLM_API_KEYS", OPTION_STRING, NULL,
         "accepted API keys, comma-separated (prefer the file or the environment: flags show in ps)", &keys_env, 0,
         0, NULL},
    };
    int n_defs = (int)(sizeof defs / sizeof defs[0]);
    struct options o = {"llm-gateway", "[options]",
                        "Serves the OpenAI HTTP API (completions, chat completions, models) in front of the "
                        "cluster's router.",
                        defs, n_defs, false};
    char err[1024];
    int rc = options_parse(&o, &argc, argv, err, sizeof err);
    if (rc == STATUS_CANCELLED) return 0;
    if (rc < 0) {
        fprintf(stderr, "llm-gateway: %s\n", err);
        return 2;
    }
    if (argc > 1) {
        fprintf(stderr, "llm-gateway: unexpected argument \"%s\" (see --help)\n", argv[1]);
        return 2;
    }
    log_set_process("gateway");
    log_set_level(log_level);
    struct options logged = o;
    logged.n_defs = n_defs - 1;
    options_log(&logged);

    /* The router connection's keys: checked here, so that a bad file stops
     * the start with its name instead of failing every request, then handed
     * to libllmclient through the variables it reads (docs/client.md). */
    if (insecure) {
        LOG(LL_WARN, "gateway: --insecure: plain sockets to the router %s, without keys", cfg.router);
        setenv("LLM_INSECURE", "true", 1);
        unsetenv("LLM_CURVE_KEY_FILE");
    } else {
        struct keys_pair kp;
        char pub[KEYS_Z85_LEN + 1];
        if (!curve_key_file || !curve_key_file[0] || !router_key || !router_key[0]) {
            fprintf(stderr, "llm-gateway: no keys for the router connection: give --curve-key-file "
                    "(LLM_CURVE_KEY_FILE) and --router-key (LLM_ROUTER_KEY), or --insecure for a router "
                    "without keys\n");
            return 2;
        }
        if (keys_pair_load(curve_key_file, &kp, err, sizeof err) < 0 ||
            keys_pub_load(router_key, pub, err, sizeof err) < 0) {
            fprintf(stderr, "llm-gateway: %s\n", err);
            return 2;
        }
        memset(&kp, 0, sizeof kp);
        setenv("LLM_CURVE_KEY_FILE", curve_key_file, 1);
        setenv("LLM_ROUTER_KEY", router_key, 1);
        unsetenv("LLM_INSECURE");
    }

    struct keys keys = {0};
    if (keys_file && keys_file[0] && keys_from_file(&keys, keys_file, err, sizeof err) < 0) {
        fprintf(stderr, "llm-gateway: %s\n", err);
        return 2;
    }
    if (keys_env && keys_env[0] && keys_add(&keys, keys_env, "LLM_API_KEYS", err, sizeof err) < 0) {
        fprintf(stderr, "llm-gateway: %s\n", err);
        return 2;
    }
    /* A default port another process on this host holds is not worth
     * refusing to serve for; an address the operator gave is. */
    cfg.metrics_optional = cfg.metrics_listen == metrics_default;
    cfg.api_keys = (const char *const *)keys.v;
    cfg.n_api_keys = keys.n;
    if (keys.n == 0)
        LOG(LL_WARN, "gateway: no API keys configured (--api-keys-file, LLM_API_KEYS): the API is open to anyone "
            "who can reach %s", cfg.listen);
    else
        LOG(LL_INFO, "gateway: %zu API key(s) accepted", keys.n);

    signal(SIGPIPE, SIG_IGN);
    sigset_t set;
    sigemptyset(&set);
    sigaddset(&set, SIGINT);
    sigaddset(&set, SIGTERM);
    /* Blocked before any thread starts, so that only sigwait sees them. */
    pthread_sigmask(SIG_BLOCK, &set, NULL);
    gateway *g;
    if (gateway_start(&g, &cfg, err, sizeof err) < 0) {
        fprintf(stderr, "llm-gateway: %s\n", err);
        return 1;
    }
    LOG(LL_INFO, "gateway: serving the OpenAI API on http://%.*s:%u/v1 (router %s)",
        (int)(strrchr(cfg.listen, ':') - cfg.listen), cfg.listen, gateway_port(g), cfg.router);
    /* The listening line on stdout, for scripts and tests that asked for port 0. */
    printf("llm-gateway: listening on port %u\n", gateway_port(g));
    fflush(stdout);
    int sig = -1;
    /* The supervisor loop: four turns a second (gateway_tick), until a signal. */
    while (sig < 0) {
        gateway_tick(g);
        struct timespec turn = {0, 250 * 1000 * 1000};
        sig = sigtimedwait(&set, NULL, &turn);
    }
    LOG(LL_INFO, "gateway: signal %d: stopping", sig);
    gateway_stop(g);
    for (size_t i = 0; i < keys.n; i++) free(keys.v[i]);
    return 0;
}
