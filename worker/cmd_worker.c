/* llm-worker: one pipeline stage of the cluster.  Loads its layers, registers
 * with the router and in Redis, heartbeats, and executes the router's step
 * plans in order until SIGTERM or SIGINT, then drains and deregisters.  The
 * flags (or LLM_* environment variables) say which stage of which pipeline
 * it is; see docs/worker.md. */
#include "kvcache.h"
#include "node.h"

#include "node_metrics.h"

#include "common/device.h"
#include "common/httpd.h"
#include "common/log.h"
#include "common/options.h"
#include "common/rconn.h"
#include "common/status.h"
#include "common/watchdog.h"
#include "common/zio.h"

#include <errno.h>
#include <signal.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

static volatile sig_atomic_t worker_stop;

static void worker_on_signal(int sig) {
    (void)sig;
    worker_stop = 1;
}

/* --redis-password-file needs a --redis URL to put the password into. */
static int worker_redis_url(const char *url, const char *path, char **out, char *err, size_t errlen) {
    if (!url || !url[0])
        return status_fail(err, errlen, STATUS_BAD_INPUT, "--redis-password-file %s: no --redis URL to use it with",
                           path);
    return rconn_url_password_file_checked(url, path, out, err, errlen);
}

static const char *const worker_transports[] = {"auto", "zmq", "nccl", NULL};
/* "auto", then link_dtype_names in enum link_dtype's order. */
static const char *const worker_link_dtypes[] = {"auto", "f32", "f16", "bf16", "int8", NULL};
/* --draft-type: "stored", then the types a float matrix can be converted
 * to at load (dtype_quant_row), in this order. */
static const char *const worker_draft_types[] = {"stored", "f16", "q8_0", "q4_0", "q4_k", "q5_k", "q6_k", NULL};
static const enum dtype worker_draft_dtypes[] = {DTYPE_F16, DTYPE_Q8_0, DTYPE_Q4_0, DTYPE_Q4_K, DTYPE_Q5_K,
                                                 DTYPE_Q6_K};

int main(int argc, char **argv) {
    struct node_config cfg;
    node_config_default(&cfg);
    const char *draft_model = NULL;
    const char *model = NULL, *layers = NULL, *log_level = NULL, *worker_id = NULL;
    const char *device = NULL, *router = NULL, *redis = NULL, *listen = NULL, *advertise = NULL;
    const char *metrics_listen = NULL, *curve_key_file = NULL, *router_key = NULL;
    const char *redis_password_file = NULL;
    bool insecure = false;
    int64_t max_msg_size = 0;
    int watchdog_ms = 0;
    static const char metrics_default[] = "127.0.0.1:9465";
    int pipeline = 0, stage = 0, stages = 1, kv_blocks = 0, block_size = 0, threads = 0;
    int max_tokens = 0, max_seqs = 0, ctx = 0, target_ctx = 0, transport = 0, link_dtype = 0, link_timeout = 0,
        kv_type = 0, draft_type = 0, spin_us = -1;
    double mem_fraction = 0, draft_min_prob = 0;
    bool require_gpu = false;
    const struct option_def defs[] = {
        {"model", "LLM_MODEL", OPTION_STRING, NULL, "GGUF file or Hugging Face directory", &model, 0, 0, NULL},
        {"draft-model", "LLM_DRAFT_MODEL", OPTION_STRING, NULL,
         "draft model for speculative decoding (same tokenizer as --model; loaded when this worker is "
         "its pipeline's last stage, checked at start)", &draft_model, 0, 0, NULL},
        {"draft-min-prob", "LLM_DRAFT_MIN_PROB", OPTION_FLOAT, "0", "the draft's guesses for a sequence stop "
         "before the first it gives less than this probability (0: always the k asked for); the output is "
         "the same either way", &draft_min_prob, 0, 1, NULL},
        {"draft-type", "LLM_DRAFT_TYPE", OPTION_CHOICE, "stored", "the draft's matrices stored as F32, F16 or BF16 "
         "converted to this type as it loads (stored: as they are): a draft that reads fewer bytes a pass costs "
         "less beside the target; the output is the same either way", &draft_type, 0, 0, worker_draft_types},
        {"pipeline", "LLM_PIPELINE", OPTION_INT, "0", "pipeline id this worker belongs to", &pipeline, 0, 1 << 30, NULL},
        {"stage", "LLM_STAGE", OPTION_INT, "0", "stage index in the pipeline (0 = embeds the tokens)", &stage, 0, 4096, NULL},
        {"stages", "LLM_STAGES", OPTION_INT, "1", "stages in the pipeline; layers split by equal bytes", &stages, 1, 4096, NULL},
        {"layers", "LLM_LAYERS", OPTION_STRING, NULL, "explicit layer range FIRST:END (END exclusive) instead of the split", &layers, 0, 0, NULL},
        {"device", "LLM_DEVICE", OPTION_STRING, "auto", "auto (a GPU when one can be used, else the CPU), cpu, cuda or cuda:N", &device, 0, 0, NULL},
        {"require-gpu", "LLM_REQUIRE_GPU", OPTION_BOOL, "false", "fail instead of running on the CPU when there is no GPU", &require_gpu, 0, 0, NULL},
        {"router", "LLM_ROUTER", OPTION_STRING, "tcp://127.0.0.1:5556",
         "the router's worker endpoint; several separated by commas (fail-over)", &router, 0, 0, NULL},
        {"redis", "LLM_REDIS", OPTION_STRING, "", "Redis URL for the worker registry and NCCL ids (empty: none)", &redis, 0, 0, NULL},
        {"redis-password-file", "LLM_REDIS_PASSWORD_FILE", OPTION_STRING, NULL,
         "file holding the Redis password, used instead of the URL's (keeps it off the command line)",
         &redis_password_file, 0, 0, NULL},
        {"kv-blocks", "LLM_KV_BLOCKS", OPTION_INT, "0", "KV cache blocks (0: auto: what --mem-fraction leaves after weights and workspace on a GPU, max-seqs whole contexts on the CPU)", &kv_blocks, 0, 1 << 24, NULL},
        {"mem-fraction", "LLM_MEM_FRACTION", OPTION_FLOAT, "0.9", "fraction of free GPU memory for weights, KV and workspace", &mem_fraction, 0.01, 1, NULL},
        {"kv-type", "LLM_KV_TYPE", OPTION_CHOICE, "auto", "KV cache elements: auto (f32 on the CPU, f16 on a GPU), f32, f16 or q8_0 (8-bit: about twice f16's positions in the same memory)", &kv_type, 0, 0, kvcache_type_names},
        {"kv-block-size", "LLM_KV_BLOCK_SIZE", OPTION_INT, "16", "positions per KV block (the router must use the same)", &block_size, 1, 4096, NULL},
        {"threads", "LLM_THREADS", OPTION_INT, "0", "CPU backend threads (0: one per core)", &threads, 0, 1024, NULL},
        {"max-batch-tokens", "LLM_MAX_BATCH_TOKENS", OPTION_INT, "0", "tokens per step, all sequences together (0: auto: max-seqs + 512 up to a multiple of 64 on a GPU, 512 on the CPU)", &max_tokens, 0, 1 << 20, NULL},
        {"max-seqs", "LLM_MAX_SEQS", OPTION_INT, "0", "sequences per step (0: auto: on a GPU the --target-ctx sequences the KV holds / --stages, at most 256; 16 on the CPU)", &max_seqs, 0, 4096, NULL},
        {"ctx", "LLM_CTX", OPTION_INT, "0", "positions per sequence (0: the model's context length)", &ctx, 0, 1 << 24, NULL},
        {"target-ctx", "LLM_TARGET_CTX", OPTION_INT, "2048", "positions a typical sequence reaches (prompt and output): the auto sizing fits max-seqs x stages of them in the KV cache", &target_ctx, 1, 1 << 24, NULL},
        {"listen", "LLM_LISTEN", OPTION_STRING, "tcp://*:*", "where the previous stage's ZeroMQ link connects (CPU transport)", &listen, 0, 0, NULL},
        {"advertise-host", "LLM_ADVERTISE_HOST", OPTION_STRING, "", "host name others use for --listen's wildcard (default: hostname)", &advertise, 0, 0, NULL},
        {"transport", "LLM_TRANSPORT", OPTION_CHOICE, "auto", "stage links: auto (NCCL between GPUs), zmq or nccl", &transport, 0, 0, worker_transports},
        {"link-dtype", "LLM_LINK_DTYPE", OPTION_CHOICE, "auto",
         "hidden states this stage sends to the next: auto (f16), f32, f16, bf16 or int8 (a BF16 scale a "
         "block of 32 values), on either transport; NCCL links need the same type on every stage of a "
         "pipeline (a mismatch fails the link, naming both)", &link_dtype, 0, 0, worker_link_dtypes},
        {"link-timeout-ms", "LLM_LINK_TIMEOUT_MS", OPTION_INT, "30000", "longest wait for a neighbouring stage", &link_timeout, 100, 3600000, NULL},
        {"worker-id", "LLM_WORKER_ID", OPTION_STRING, "", "worker id (default: host-pid)", &worker_id, 0, 0, NULL},
        {"curve-key-file", "LLM_CURVE_KEY_FILE", OPTION_STRING, NULL,
         "this worker's CURVE key pair (NAME.key from llm keygen), for the router and the stage links",
         &curve_key_file, 0, 0, NULL},
        {"router-key", "LLM_ROUTER_KEY", OPTION_STRING, NULL, "the router's public key file (NAME.pub)",
         &router_key, 0, 0, NULL},
        {"insecure", "LLM_INSECURE", OPTION_BOOL, "false",
         "plain sockets to the router and on the stage links, without keys", &insecure, 0, 0, NULL},
        {"max-msg-size", "LLM_MAX_MSG_SIZE", OPTION_SIZE, "64M",
         "largest frame accepted on any socket; a peer sending more is disconnected", &max_msg_size, 1024,
         4.0 * 1024 * 1024 * 1024, NULL},
        {"metrics-listen", "LLM_METRICS_LISTEN", OPTION_STRING, metrics_default,
         "HOST:PORT of the metrics port: /metrics (Prometheus), /health, /ready; \"\" for none",
         &metrics_listen, 0, 0, NULL},
        {"spin-us", "LLM_SPIN_US", OPTION_INT, "-1",
         "the io and compute threads poll this long before they block in a wait for the router's plans, "
         "the step's result or the next plan, while messages keep coming (one within the last 200 ms): a "
         "message that comes within it skips a blocked thread's wake-up, at the cost of a busy core while "
         "they poll (one H200 host, 7B at one stream: 8% more tokens/s with 3000 here and on the router; "
         "docs/worker.md); -1: auto, 3000 on a GPU and 0 on the CPU; 0: block at once",
         &spin_us, -1, 1000000, NULL},
        {"watchdog-ms", "LLM_WATCHDOG_MS", OPTION_INT, "60000",
         "/health answers 503 while the model loads, and once the io loop or the compute thread has not "
         "turned for this long (a step or a link that hangs); keep it above --link-timeout-ms "
         "(0: /health only says the process is up)", &watchdog_ms, 0, 86400000, NULL},
        {"log-level", "LLM_LOG_LEVEL", OPTION_STRING, "info", "debug, info, warn, error or none", &log_level, 0, 0, NULL},
    };
    struct options o = {"llm-worker", "[options]",
                        "Runs one pipeline stage: executes the router's step plans in order.", defs,
                        (int)(sizeof defs / sizeof defs[0]), false};
    char err[1024];
    int rc = options_parse(&o, &argc, argv, err, sizeof err);
    if (rc == STATUS_CANCELLED) return 0;
    if (rc < 0) {
        fprintf(stderr, "llm-worker: %s\n", err);
        return 2;
    }
    if (argc > 1) {
        fprintf(stderr, "llm-worker: unexpected argument \"%s\" (see --help)\n", argv[1]);
        return 2;
    }
    int level;
    if (log_level_parse(log_level, &level) < 0) {
        fprintf(stderr, "llm-worker: --log-level %s: expected debug, info, warn, error or none\n",
                log_level);
        return 2;
    }
    log_set_level(level);
    log_set_process("worker");
    options_log(&o);

    zio_set_max_msg_size(max_msg_size);
    cfg.curve_key_file = curve_key_file;
    cfg.router_key = router_key;
    cfg.insecure = insecure;
    cfg.model_path = model;
    cfg.draft_model = draft_model;
    cfg.draft_min_prob = (float)draft_min_prob;
    cfg.draft_type = draft_type > 0 ? (int32_t)worker_draft_dtypes[draft_type - 1] : -1;
    cfg.worker_id = worker_id;
    cfg.require_gpu = require_gpu;
    cfg.router = router;
    cfg.redis_url = redis;
    cfg.listen = listen;
    cfg.advertise_host = advertise;
    cfg.pipeline_id = (uint32_t)pipeline;
    cfg.stage_index = stage;
    cfg.stage_count = stages;
    cfg.kv_blocks = kv_blocks;
    cfg.mem_fraction = mem_fraction;
    cfg.kv_block_size = block_size;
    cfg.kv_type = kvcache_type_of_name(kv_type);
    cfg.threads = threads;
    cfg.max_batch_tokens = max_tokens;
    cfg.spin_us = spin_us;
    cfg.max_seqs = max_seqs;
    cfg.ctx = ctx;
    cfg.target_ctx = target_ctx;
    cfg.transport = (enum node_transport)transport;
    cfg.link_dtype = link_dtype - 1; /* "auto" is -1 */
    cfg.link_timeout_ms = link_timeout;
    if (device_parse("--device", device, &cfg.device, err, sizeof err) < 0) {
        fprintf(stderr, "llm-worker: %s\n", err);
        return 2;
    }
    if (stage >= stages) {
        fprintf(stderr, "llm-worker: --stage %d with --stages %d: the index must be below the count\n",
                stage, stages);
        return 2;
    }
    if (layers) {
        char *end;
        errno = 0;
        long a = strtol(layers, &end, 10), b = -1;
        if (!errno && end != layers && *end == ':') {
            char *end2;
            b = strtol(end + 1, &end2, 10);
            if (errno || *end2 || end2 == end + 1) b = -1;
        }
        if (a < 0 || b <= a || b > 1 << 20) {
            fprintf(stderr, "llm-worker: --layers %s: expected FIRST:END with 0 <= FIRST < END\n",
                    layers);
            return 2;
        }
        cfg.layer_first = (int32_t)a;
        cfg.layer_end = (int32_t)b;
    }

    struct sigaction sa;
    memset(&sa, 0, sizeof sa);
    sa.sa_handler = worker_on_signal;
    sigemptyset(&sa.sa_mask);
    sigaction(SIGTERM, &sa, NULL);
    sigaction(SIGINT, &sa, NULL);

    node_metrics *nm = NULL;
    if (node_metrics_init(&nm, err, sizeof err) < 0) {
        fprintf(stderr, "llm-worker: %s\n", err);
        return 1;
    }
    static const char *const loops[] = {"io", "compute"};
    watchdog *wd = NULL;
    if (watchdog_ms > 0 && watchdog_init(&wd, watchdog_ms, loops, 2, err, sizeof err) < 0) {
        fprintf(stderr, "llm-worker: %s\n", err);
        node_metrics_free(nm);
        return 1;
    }
    cfg.watchdog = wd;
    /* The port comes up before the model loads, so that it answers while it
     * does: /ready "loading the model", /health 503 "starting" until both
     * loops turn (a startup probe, not liveness, bounds the load). */
    httpd *h = NULL;
    struct httpd_config hc = {.listen = metrics_listen, .registry = node_metrics_registry(nm),
                              .refresh = node_metrics_refresh, .refresh_ud = nm,
                              .ready = node_metrics_ready, .ready_ud = nm,
                              .health = wd ? watchdog_health : NULL, .health_ud = wd};
    rc = metrics_listen[0] ? httpd_start(&h, &hc, err, sizeof err) : STATUS_OK;
    /* Several workers share a host (one per GPU, or a local cluster): a
     * taken default port is a warning; an address the operator gave that
     * cannot be served is not. */
    if (rc == STATUS_IO && metrics_listen == metrics_default) {
        LOG(LL_WARN, "worker: no metrics port: %s (give --metrics-listen another port)", err);
    } else if (rc < 0) {
        fprintf(stderr, "llm-worker: --metrics-listen: %s\n", err);
        watchdog_free(wd);
        node_metrics_free(nm);
        return 2;
    } else if (h) {
        /* The address as given, with the port it got (port 0 picks one). */
        const char *colon = strrchr(metrics_listen, ':');
        int hl = colon ? (int)(colon - metrics_listen) : (int)strlen(metrics_listen);
        LOG(LL_INFO, "worker: metrics on http://%.*s:%d (port %d): /metrics, /health, /ready", hl,
            metrics_listen, httpd_port(h), httpd_port(h));
    }
    /* node_init copies the URL, so the one with the password lives only
     * this long. */
    char *redis_url = NULL;
    if (redis_password_file && redis_password_file[0]) {
        if (worker_redis_url(redis, redis_password_file, &redis_url, err, sizeof err) < 0) {
            fprintf(stderr, "llm-worker: %s\n", err);
            httpd_stop(h);
            watchdog_free(wd);
            node_metrics_free(nm);
            return 2;
        }
        cfg.redis_url = redis_url;
    }
    node *n;
    rc = node_init(&n, &cfg, err, sizeof err);
    free(redis_url);
    if (rc < 0) {
        fprintf(stderr, "llm-worker: cannot start: %s\n", err);
        httpd_stop(h);
        watchdog_free(wd);
        node_metrics_free(nm);
        return 1;
    }
    node_metrics_attach(nm, n);
    rc = node_run(n, &worker_stop, err, sizeof err);
    /* The port stops first: it reads the node. */
    httpd_stop(h);
    node_free(n);
    watchdog_free(wd);
    node_metrics_free(nm);
    if (rc < 0) {
        fprintf(stderr, "llm-worker: %s\n", err);
        return 1;
    }
    return 0;
}
