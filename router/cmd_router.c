/* llm-router: the cluster's brain.  Accepts client requests, keeps them
 * durable in Redis, forms pipelines from the workers that register, and
 * schedules every step.  Options come from flags or LLM_* environment
 * variables (see --help). */
#include <signal.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "common/httpd.h"
#include "common/log.h"
#include "common/options.h"
#include "common/rconn.h"
#include "common/status.h"
#include "common/watchdog.h"
#include "common/zio.h"
#include "router/server.h"
#include "router/server_metrics.h"

static volatile sig_atomic_t stop_flag, reload_flag;

static void on_signal(int sig) {
    (void)sig;
    stop_flag = 1;
}

/* SIGHUP: reread the key allowlists (llm-cluster scale adds and removes
 * worker keys; docs/security.md). */
static void on_hangup(int sig) {
    (void)sig;
    reload_flag = 1;
}

int main(int argc, char **argv) {
    struct server_config c;
    memset(&c, 0, sizeof c);
    int log_level = LL_INFO;
    const char *metrics_listen = NULL, *redis_password_file = NULL;
    bool prefix_cache = true, spec_adapt = false;
    int64_t max_msg_size = 0;
    int watchdog_ms = 0;
    static const char metrics_default[] = "127.0.0.1:9464";
    static const char *const levels[] = {"debug", "info", "warn", "error", "none", NULL};
    /* In enum server_spec's order. */
    static const char *const spec_modes[] = {"off", "ngram", "draft", "auto", NULL};
    const struct option_def defs[] = {
        {"model", "LLM_MODEL", OPTION_STRING, NULL,
         "model file (.gguf) or Hugging Face directory: its tokenizer and metadata", &c.model_path, 0, 0, NULL},
        {"listen", "LLM_LISTEN", OPTION_STRING, "tcp://127.0.0.1:5555",
         "endpoint for clients (tcp://0.0.0.0:5555 for every interface)", &c.listen, 0, 0, NULL},
        {"worker-listen", "LLM_WORKER_LISTEN", OPTION_STRING, "tcp://127.0.0.1:5556",
         "endpoint for workers (tcp://0.0.0.0:5556 for every interface)", &c.worker_listen, 0, 0, NULL},
        {"curve-key-file", "LLM_CURVE_KEY_FILE", OPTION_STRING, NULL,
         "this router's CURVE key pair (NAME.key from llm keygen)", &c.curve_key_file, 0, 0, NULL},
        {"admin-keys", "LLM_ADMIN_KEYS", OPTION_STRING, NULL,
         "public keys that may also drain pipelines (admin messages): a list file or a directory of *.pub; "
         "admitted as clients too. Unset: admin messages are refused",
         &c.admin_keys, 0, 0, NULL},
        {"client-keys", "LLM_CLIENT_KEYS", OPTION_STRING, NULL,
         "public keys of the admitted clients: a list file or a directory of *.pub", &c.client_keys, 0, 0, NULL},
        {"worker-keys", "LLM_WORKER_KEYS", OPTION_STRING, NULL,
         "public keys of the admitted workers: a list file or a directory of *.pub", &c.worker_keys, 0, 0, NULL},
        {"insecure", "LLM_INSECURE", OPTION_BOOL, "false",
         "plain sockets without keys: anyone who reaches the ports is served", &c.insecure, 0, 0, NULL},
        {"max-msg-size", "LLM_MAX_MSG_SIZE", OPTION_SIZE, "64M",
         "largest frame accepted on any socket; a peer sending more is disconnected", &max_msg_size,
         1024, 4.0 * 1024 * 1024 * 1024, NULL},
        {"redis", "LLM_REDIS", OPTION_STRING, "redis://127.0.0.1:6379", "Redis URL (queue, state, registry)",
         &c.redis_url, 0, 0, NULL},
        {"redis-password-file", "LLM_REDIS_PASSWORD_FILE", OPTION_STRING, NULL,
         "file holding the Redis password, used instead of the URL's (keeps it off the command line)",
         &redis_password_file, 0, 0, NULL},
        {"redis-prefix", "LLM_REDIS_PREFIX", OPTION_STRING, "llm:", "prefix of every Redis key",
         &c.redis_prefix, 0, 0, NULL},
        {"router-id", "LLM_ROUTER_ID", OPTION_STRING, "router",
         "this router's name in the request stream's consumer group (keep it across restarts)",
         &c.router_id, 0, 0, NULL},
        {"max-queue", "LLM_MAX_QUEUE", OPTION_INT, "1024",
         "accepted requests waiting to run, at most (then RESOURCE_EXHAUSTED)", &c.max_queue, 1, 10000000, NULL},
        {"step-tokens", "LLM_STEP_TOKENS", OPTION_INT, "0",
         "tokens per scheduler step: decodes plus prefill chunks (0: as the stages state, 512 if none "
         "does; else at most what they state)", &c.step_tokens, 0, 1048576, NULL},
        {"max-batch", "LLM_MAX_BATCH", OPTION_INT, "0",
         "sequences running per pipeline, at most (0: stages x the sequences a step takes, 64 if no "
         "stage states those)", &c.max_batch, 0, 65536, NULL},
        {"max-step-seqs", "LLM_MAX_STEP_SEQS", OPTION_INT, "0",
         "sequences in one step, at most (0: as the workers state; else the smaller)", &c.max_step_seqs, 0, 65536, NULL},
        {"prefix-cache", "LLM_PREFIX_CACHE", OPTION_BOOL, "true",
         "keep computed KV blocks for later requests that start with the same tokens, and route "
         "requests to the pipeline holding their prefix (--no-prefix-cache: off)", &prefix_cache, 0, 0, NULL},
        {"itl-target-ms", "LLM_ITL_TARGET_MS", OPTION_INT, "50",
         "inter-token latency to keep for running sequences: a step with decodes carries only the "
         "prefill that fits it, by a step-time model learned per pipeline (0: no cap)",
         &c.itl_target_ms, 0, 600000, NULL},
        {"batch-wait-us", "LLM_BATCH_WAIT_US", OPTION_INT, "0",
         "a pipeline with nothing running waits until this long passes without a new prompt (at most "
         "8 times this long) before planning, so that prompts arriving together start in one step (0: plan "
         "at once)",
         &c.batch_wait_us, 0, 1000000, NULL},
        {"spin-us", "LLM_SPIN_US", OPTION_INT, "-1",
         "the loop polls this long before it blocks waiting for workers and clients, while workers' "
         "messages keep coming (one within the last 200 ms): a result that comes within it is taken "
         "without a blocked thread's wake-up, at the cost of a busy core while it polls (docs/router.md); "
         "-1: auto, 3000 while a GPU worker is in a pipeline, else 0; 0: block at once",
         &c.spin_us, -1, 1000000, NULL},
        {"prefill-hold-tokens", "LLM_PREFILL_HOLD_TOKENS", OPTION_INT, "0",
         "while sequences decode, new prompts wait until they bring this many tokens together (at most "
         "what a step takes beside the decodes), so that their prefill goes in one step rather than a "
         "little in each of many (0: each prompt starts at once)",
         &c.prefill_hold_tokens, 0, 1048576, NULL},
        {"prefill-hold-ms", "LLM_PREFILL_HOLD_MS", OPTION_INT, "100",
         "with --prefill-hold-tokens: the longest a prompt waits for others", &c.prefill_hold_ms, 1, 600000,
         NULL},
        {"spec", "LLM_SPEC", OPTION_CHOICE, "off",
         "speculative decoding for requests that do not choose: off; ngram (drafts found by prompt "
         "lookup in the sequence's own tokens, verified by the pipeline: same outputs, fewer steps "
         "when the output repeats its input); draft (the last stage's draft model, llm-worker "
         "--draft-model); auto (while the pipeline runs at most --spec-auto-batch sequences per "
         "stage: prompt lookup, else the draft model where the last stage has one)",
         &c.spec, 0, 0, spec_modes},
        {"spec-tokens", "LLM_SPEC_TOKENS", OPTION_INT, "4",
         "drafted tokens one step verifies for a sequence, at most (k; a request may ask for fewer or more, "
         "up to 16)", &c.spec_tokens, 1, 16, NULL},
        {"spec-auto-batch", "LLM_SPEC_AUTO_BATCH", OPTION_INT, "4",
         "--spec auto: speculate while the pipeline's running sequences per stage are at most this many "
         "(a larger batch makes a decode step compute-bound, where drafts cost more than they gain)",
         &c.spec_auto_batch, 0, 65536, NULL},
        {"spec-adapt", "LLM_SPEC_ADAPT", OPTION_BOOL, "false",
         "a sequence's next step drafts one more token than its last step had accepted (all accepted: one "
         "more than it drafted), up to its k: fewer rejected drafts where verifying costs (the CPU backend); "
         "same outputs", &spec_adapt, 0, 0, NULL},
        {"stages", "LLM_STAGES", OPTION_INT, "1",
         "stages per pipeline for workers that let the router place them", &c.stages, 1, 64, NULL},
        {"heartbeat-ms", "LLM_HEARTBEAT_MS", OPTION_INT, "1000", "heartbeat interval the workers are told",
         &c.heartbeat_ms, 10, 3600000, NULL},
        {"worker-timeout-ms", "LLM_WORKER_TIMEOUT_MS", OPTION_INT, "5000",
         "a worker silent this long is lost (its pipeline leaves service)", &c.worker_timeout_ms, 20, 86400000, NULL},
        {"step-timeout-ms", "LLM_STEP_TIMEOUT_MS", OPTION_INT, "60000",
         "a step without a result this long re-forms its pipeline", &c.step_timeout_ms, 10, 86400000, NULL},
        {"retention-s", "LLM_RETENTION_S", OPTION_INT, "3600",
         "finished requests are remembered (re-attach) this long", &c.retention_s, 1, 100000000, NULL},
        {"client-gone-ms", "LLM_CLIENT_GONE_MS", OPTION_INT, "5000",
         "a request whose client is unreachable this long (its connection closed or stopped reading) "
         "is cancelled and its KV freed; a re-attach within it carries on (0: never)", &c.client_gone_ms,
         0, 86400000, NULL},
        {"claim-idle-ms", "LLM_CLAIM_IDLE_MS", OPTION_INT, "0",
         "take over another router's requests idle this long (at start, and every heartbeat with several routers)",
         &c.claim_idle_ms, 0, 86400000, NULL},
        {"metrics-listen", "LLM_METRICS_LISTEN", OPTION_STRING, metrics_default,
         "HOST:PORT of the metrics port: /metrics (Prometheus), /health, /ready; \"\" for none", &metrics_listen,
         0, 0, NULL},
        {"watchdog-ms", "LLM_WATCHDOG_MS", OPTION_INT, "60000",
         "/health answers 503 once the event loop has not turned for this long, and until it first "
         "turns (0: /health only says the process is up)", &watchdog_ms, 0, 86400000, NULL},
        {"log-level", "LLM_LOG_LEVEL", OPTION_CHOICE, "info", "log level", &log_level, 0, 0, levels},
    };
    struct options o = {"llm-router", "[options]",
                        "Routes and schedules generation requests over the cluster's worker pipelines.",
                        defs, (int)(sizeof defs / sizeof defs[0]), false};
    char err[1024];
    int rc = options_parse(&o, &argc, argv, err, sizeof err);
    if (rc == STATUS_CANCELLED) return 0;
    if (rc < 0) {
        fprintf(stderr, "llm-router: %s\n", err);
        return 2;
    }
    if (argc > 1) {
        fprintf(stderr, "llm-router: unexpected argument \"%s\" (see --help)\n", argv[1]);
        return 2;
    }
    c.no_prefix_cache = !prefix_cache;
    c.spec_adapt = spec_adapt;
    log_set_process("router");
    log_set_level(log_level);
    options_log(&o);
    char *redis_url = NULL;
    if (redis_password_file && redis_password_file[0]) {
        if (rconn_url_password_file_checked(c.redis_url, redis_password_file, &redis_url, err, sizeof err) < 0) {
            fprintf(stderr, "llm-router: %s\n", err);
            return 2;
        }
        c.redis_url = redis_url;
    }
    zio_set_max_msg_size(max_msg_size);
    signal(SIGPIPE, SIG_IGN);
    struct sigaction sa;
    memset(&sa, 0, sizeof sa);
    sa.sa_handler = on_signal;
    sigaction(SIGINT, &sa, NULL);
    sigaction(SIGTERM, &sa, NULL);
    sa.sa_handler = on_hangup;
    sigaction(SIGHUP, &sa, NULL);
    c.reload_keys = &reload_flag;
    server_metrics *sm = NULL;
    if (server_metrics_init(&sm, err, sizeof err) < 0) {
        fprintf(stderr, "llm-router: %s\n", err);
        free(redis_url);
        return 1;
    }
    /* The port comes up before the model loads, so that it answers while it
     * does: /ready "starting", /health 503 until the event loop turns. */
    static const char *const loops[] = {"event"};
    watchdog *wd = NULL;
    if (watchdog_ms > 0 && watchdog_init(&wd, watchdog_ms, loops, 1, err, sizeof err) < 0) {
        fprintf(stderr, "llm-router: %s\n", err);
        server_metrics_free(sm);
        free(redis_url);
        return 1;
    }
    c.watchdog = wd;
    httpd *h = NULL;
    struct httpd_config hc = {.listen = metrics_listen, .registry = server_metrics_registry(sm),
                              .ready = server_metrics_ready, .ready_ud = sm,
                              .health = wd ? watchdog_health : NULL, .health_ud = wd};
    rc = metrics_listen[0] ? httpd_start(&h, &hc, err, sizeof err) : STATUS_OK;
    /* A default port another router on this host holds is not worth
     * refusing to route for; an address the operator gave is. */
    if (rc == STATUS_IO && metrics_listen == metrics_default) {
        LOG(LL_WARN, "router: no metrics port: %s (give --metrics-listen another port)", err);
    } else if (rc < 0) {
        fprintf(stderr, "llm-router: --metrics-listen: %s\n", err);
        watchdog_free(wd);
        server_metrics_free(sm);
        free(redis_url);
        return 2;
    } else if (h) {
        /* The address as given, with the port it got (port 0 picks one). */
        const char *colon = strrchr(metrics_listen, ':');
        int hl = colon ? (int)(colon - metrics_listen) : (int)strlen(metrics_listen);
        LOG(LL_INFO, "router: metrics on http://%.*s:%d (port %d): /metrics, /health, /ready", hl,
            metrics_listen, httpd_port(h), httpd_port(h));
    }
    c.metrics = sm;
    server *s = NULL;
    if (server_init(&s, &c, err, sizeof err) < 0) {
        fprintf(stderr, "llm-router: %s\n", err);
        httpd_stop(h);
        watchdog_free(wd);
        server_metrics_free(sm);
        free(redis_url);
        return 1;
    }
    server_run(s, &stop_flag);
    /* The port stops first: it reads the registry the server updates. */
    httpd_stop(h);
    server_free(s);
    watchdog_free(wd);
    server_metrics_free(sm);
    free(redis_url);
    return 0;
}
