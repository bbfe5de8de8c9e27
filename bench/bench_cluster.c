/* bench_cluster: the whole cluster's speed as a client sees it, and the
 * router's share of each step (the cluster issue's table).  For each layout
 * (pipelines x stages, optionally with NCCL held to sockets) it starts a
 * private cluster with the built llm-cluster, then at each concurrency level
 * sends N fixed-length greedy requests through libllmclient with that many
 * in flight and measures requests/s, generated tokens/s, time to first
 * token and inter-token latency; the router's Status gives its planning
 * cost per step, the workers' metrics ports each stage's busy fraction.
 * The shared-prefix workload (one system prompt, distinct questions) runs
 * every layout with the router's prefix cache on and off.
 *
 *   bench_cluster --shape tiny --layouts 1x1,1x2,2x1 --concurrency 1,4,16 --threads 1
 *   bench_cluster --model m.gguf --device auto --layouts 1x1,1x2,1x2s,2x1 --concurrency 64,128
 *   bench_cluster --model m.gguf --device auto --layouts 1x1 --shared-prefix 1024 --question-tokens 32 \
 *       --requests 64 --concurrency 16 --max-tokens 64
 *   bench_cluster --model m.gguf --device auto --layouts 1x1 --concurrency 64 --requests 256 --rate 60
 *   bench_cluster --shape llama2-7b --type q4_k_m --device auto --layouts 1x1 --concurrency 64 \
 *       --json-schema bench/schemas/records.json --schema-baseline
 *
 * --json-schema FILE constrains every request by that JSON Schema (the
 * grammar engine's masks on the last stage, docs/grammar.md); with
 * --schema-baseline each level runs first unconstrained, then constrained,
 * on the same cluster, and the table gives their ratio.
 *
 * --rate R makes each level an open loop: its requests arrive as a Poisson
 * process of R per second, drawn from --seed exactly as serve-bench draws
 * its --rate arrivals, and the level's --concurrency threads send them at
 * their times (an arrival that finds every thread busy waits for the first
 * one free, as serve-bench's in-flight cap does). */
#include "clients/c/client.h"

#include "common/log.h"
#include "common/options.h"
#include "common/status.h"
#include "worker/synth.h"

#include <errno.h>
#include <fcntl.h>
#include <ftw.h>
#include <limits.h>
#include <math.h>
#include <pthread.h>
#include <signal.h>
#include <spawn.h>
#include <stdarg.h>
#include <stdatomic.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <sys/wait.h>
#include <time.h>
#include <unistd.h>
#include <zmq.h>

#include <arpa/inet.h>
#include <netinet/in.h>
#include <sys/socket.h>
#include <sys/time.h>

extern char **environ;

#define CB_LIST_MAX 16
#define CB_ROWS_MAX 512
#define CB_CONC_MAX 1024
#define CB_WORKERS_MAX 64

/* Set by SIGTERM/SIGINT (a time limit): requests in flight are cancelled,
 * the cluster is stopped, and the rows measured so far are printed. */
static volatile sig_atomic_t cb_stop;
static void cb_on_signal(int sig) {
    (void)sig;
    cb_stop = 1;
}

/* snprintf through a function, so that paths and messages cut to fit
 * their buffer are not warnings (a cut message is still a message). */
static void cb_fmt(char *out, size_t size, const char *fmt, ...) __attribute__((format(printf, 3, 4)));
static void cb_fmt(char *out, size_t size, const char *fmt, ...) {
    va_list ap;
    va_start(ap, fmt);
    vsnprintf(out, size, fmt, ap);
    va_end(ap);
}

static double cb_now(void) {
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (double)ts.tv_sec + (double)ts.tv_nsec * 1e-9;
}

static void cb_sleep_ms(int ms) {
    struct timespec ts = {ms / 1000, (long)(ms % 1000) * 1000000L};
    nanosleep(&ts, NULL);
}

/* Sleeps until cb_now() reaches at, or a stop signal. */
static void cb_sleep_until(double at) {
    for (double now = cb_now(); now < at && !cb_stop; now = cb_now()) {
        double d = at - now < 0.1 ? at - now : 0.1;
        struct timespec ts = {(time_t)d, (long)((d - (double)(time_t)d) * 1e9)};
        nanosleep(&ts, NULL);
    }
}

static int cb_cmp_double(const void *a, const void *b) {
    double x = *(const double *)a, y = *(const double *)b;
    return x < y ? -1 : x > y;
}

/* Nearest-rank percentile (q in (0, 1]) of n values; sorts v.  0 when n is 0. */
static double cb_percentile(double *v, size_t n, double q) {
    if (n == 0) return 0;
    qsort(v, n, sizeof *v, cb_cmp_double);
    size_t k = (size_t)(q * (double)n + 0.999999);
    if (k < 1) k = 1;
    if (k > n) k = n;
    return v[k - 1];
}

/* ---- Options ---- */

/* One cluster to start: pipelines x stages, the stage links' NCCL limited
 * to sockets (as between hosts without NVLink or a shared /dev/shm), and in
 * the shared-prefix workload the router's prefix cache on or off. */
struct cb_layout {
    int pipelines, stages;
    bool sockets;
    int cache;            /* -1: not the shared-prefix workload; 0: --no-prefix-cache; 1: the cache on */
    char name[24];        /* "1x2", "1x2s" */
};

struct cb_opts {
    const char *model, *shape, *type, *stages, *pipelines, *layouts, *concurrency, *device, *cluster, *tmpdir, *run_root,
        *router_args, *worker_args, *log_level, *json, *no_cache_arg, *json_schema_file;
    /* --json-schema: the file's text (NULL: unconstrained); --schema-baseline. */
    char *json_schema;
    bool schema_baseline;
    int requests, prompt_tokens, max_tokens, threads, kv_blocks, warmup, up_timeout_s, up_tries;
    int shared_prefix, question_tokens;
    /* Open loop: Poisson arrivals of rate per second (0: the closed loop),
     * level k of a layout drawn from seed + k. */
    double rate;
    int seed;
    bool insecure;
    /* Parsed lists. */
    int stage_v[CB_LIST_MAX], n_stages;
    int pipe_v[CB_LIST_MAX], n_pipes;
    /* The clusters to start, in order: --layouts, else pipelines x stages;
     * the shared-prefix workload starts each twice (cache on, then off). */
    struct cb_layout lay[2 * CB_LIST_MAX * CB_LIST_MAX];
    int n_layouts;
    int conc_v[CB_LIST_MAX], n_conc;
    enum synth_type synth_type;
};

/* Tokens of every prompt: the shared prefix and a question, or --prompt-tokens. */
static int cb_prompt_len(const struct cb_opts *o) {
    return o->shared_prefix > 0 ? o->shared_prefix + o->question_tokens : o->prompt_tokens;
}

/* Parses a comma-separated list of integers in [lo, hi] into v.  Returns
 * the count or STATUS_BAD_INPUT with err naming the flag and the item. */
static int cb_parse_ints(const char *flag, const char *s, int lo, int hi, int *v, char *err, size_t errlen) {
    char buf[512];
    if (strlen(s) + 1 > sizeof buf) {
        cb_fmt(err, errlen, "--%s: list of %zu characters is too long", flag, strlen(s));
        return STATUS_BAD_INPUT;
    }
    memcpy(buf, s, strlen(s) + 1);
    int n = 0;
    for (char *save = NULL, *t = strtok_r(buf, ",", &save); t; t = strtok_r(NULL, ",", &save)) {
        if (n == CB_LIST_MAX) {
            cb_fmt(err, errlen, "--%s: more than %d items in \"%s\"", flag, CB_LIST_MAX, s);
            return STATUS_BAD_INPUT;
        }
        char *end = NULL;
        errno = 0;
        long x = strtol(t, &end, 10);
        if (errno || end == t || *end || x < lo || x > hi) {
            cb_fmt(err, errlen, "--%s: \"%s\" is not an integer in [%d, %d]", flag, t, lo, hi);
            return STATUS_BAD_INPUT;
        }
        v[n++] = (int)x;
    }
    if (n == 0) {
        cb_fmt(err, errlen, "--%s: empty list \"%s\"", flag, s);
        return STATUS_BAD_INPUT;
    }
    return n;
}

static int cb_parse_lists(struct cb_opts *o, char *err, size_t errlen) {
    if ((o->n_stages = cb_parse_ints("stages", o->stages, 1, 64, o->stage_v, err, errlen)) < 0) return o->n_stages;
    if ((o->n_pipes = cb_parse_ints("pipelines", o->pipelines, 1, 64, o->pipe_v, err, errlen)) < 0)
        return o->n_pipes;
    int pipes[CB_LIST_MAX * CB_LIST_MAX], stages[CB_LIST_MAX * CB_LIST_MAX];
    bool sockets[CB_LIST_MAX * CB_LIST_MAX];
    int n = 0;
    if (o->layouts && o->layouts[0]) {
        char buf[512];
        if (strlen(o->layouts) + 1 > sizeof buf) {
            cb_fmt(err, errlen, "--layouts: list of %zu characters is too long", strlen(o->layouts));
            return STATUS_BAD_INPUT;
        }
        memcpy(buf, o->layouts, strlen(o->layouts) + 1);
        for (char *save = NULL, *t = strtok_r(buf, ",", &save); t; t = strtok_r(NULL, ",", &save)) {
            int p = 0, st = 0, used = 0;
            bool s = false;
            if (sscanf(t, "%dx%d%n", &p, &st, &used) == 2 && t[used] == 's') {
                s = true;
                used++;
            }
            if (sscanf(t, "%dx%d", &p, &st) != 2 || t[used] || p < 1 || p > 64 || st < 1 || st > 64 ||
                n == CB_LIST_MAX) {
                cb_fmt(err, errlen, "--layouts: \"%s\" is not PIPELINESxSTAGES with both in [1, 64], optionally "
                       "followed by s for NCCL over sockets (at most %d layouts)", t, CB_LIST_MAX);
                return STATUS_BAD_INPUT;
            }
            pipes[n] = p;
            stages[n] = st;
            sockets[n++] = s;
        }
    } else {
        for (int pi = 0; pi < o->n_pipes; pi++)
            for (int si = 0; si < o->n_stages; si++) {
                pipes[n] = o->pipe_v[pi];
                stages[n] = o->stage_v[si];
                sockets[n++] = false;
            }
    }
    o->n_layouts = 0;
    for (int i = 0; i < n; i++)
        for (int c = o->shared_prefix > 0 ? 1 : -1; c >= (o->shared_prefix > 0 ? 0 : -1); c--) {
            struct cb_layout *l = &o->lay[o->n_layouts++];
            l->pipelines = pipes[i];
            l->stages = stages[i];
            l->sockets = sockets[i];
            l->cache = c;
            cb_fmt(l->name, sizeof l->name, "%dx%d%s", pipes[i], stages[i], sockets[i] ? "s" : "");
        }
    if ((o->n_conc = cb_parse_ints("concurrency", o->concurrency, 1, CB_CONC_MAX, o->conc_v, err, errlen)) < 0)
        return o->n_conc;
    if (!o->model) {
        struct synth_shape sh;
        if (synth_shape_preset(o->shape, &sh) != STATUS_OK) {
            cb_fmt(err, errlen, "--shape: unknown shape \"%s\" (worker/synth.h presets: tiny, 100m, "
                     "tinyllama-1.1b, llama2-7b, llama3-8b, llama2-13b)", o->shape);
            return STATUS_BAD_INPUT;
        }
        int k = 0;
        while (synth_type_names[k] && strcmp(synth_type_names[k], o->type) != 0) k++;
        if (!synth_type_names[k]) {
            cb_fmt(err, errlen, "--type: unknown type \"%s\" (f32, f16, bf16, q8_0, q4_0, q4_k_m, q5_k_m, q6_k)",
                     o->type);
            return STATUS_BAD_INPUT;
        }
        o->synth_type = (enum synth_type)k;
    }
    if (strcmp(o->device, "cpu") != 0 && strcmp(o->device, "auto") != 0) {
        cb_fmt(err, errlen, "--device %s: expected cpu or auto (llm-cluster's choices)", o->device);
        return STATUS_BAD_INPUT;
    }
    return STATUS_OK;
}

/* Reads --json-schema's file into o->json_schema (freed at exit).  The
 * router checks the schema itself: one it does not support fails the
 * warm-up request, naming the keyword. */
static int cb_read_schema(struct cb_opts *o, char *err, size_t errlen) {
    FILE *f = fopen(o->json_schema_file, "rb");
    if (!f) {
        cb_fmt(err, errlen, "--json-schema %s: %s", o->json_schema_file, strerror(errno));
        return STATUS_IO;
    }
    size_t cap = 4096, n = 0;
    char *buf = malloc(cap);
    while (buf) {
        n += fread(buf + n, 1, cap - n - 1, f);
        if (n < cap - 1) break;
        char *b = cap < (1u << 24) ? realloc(buf, cap * 2) : NULL;
        if (!b) {
            free(buf);
            buf = NULL;
            break;
        }
        buf = b;
        cap *= 2;
    }
    bool bad = ferror(f);
    fclose(f);
    if (!buf || bad || n == 0) {
        cb_fmt(err, errlen, "--json-schema %s: %s", o->json_schema_file,
               !buf ? "larger than 16 MiB or out of memory" : bad ? "read error" : "empty file");
        free(buf);
        return STATUS_BAD_INPUT;
    }
    buf[n] = 0;
    o->json_schema = buf;
    return STATUS_OK;
}

/* The requests of one level: --requests, else two per stream and at least 8. */
static int cb_level_requests(const struct cb_opts *o, int conc) {
    if (o->requests > 0) return o->requests;
    return 2 * conc > 8 ? 2 * conc : 8;
}

/* ---- Files and child processes ---- */

static int cb_rm_entry(const char *path, const struct stat *st, int flag, struct FTW *ftw) {
    (void)st;
    (void)flag;
    (void)ftw;
    return remove(path) == 0 || errno == ENOENT ? 0 : -1;
}

static void cb_rmtree(const char *dir) {
    nftw(dir, cb_rm_entry, 16, FTW_DEPTH | FTW_PHYS);
}

/* Prints the last n lines of path to stderr, indented. */
static void cb_print_tail(const char *path, int n) {
    FILE *f = fopen(path, "r");
    if (!f) return;
    char ring[8][512];
    int count = 0;
    if (n > 8) n = 8;
    while (fgets(ring[count % n], sizeof ring[0], f)) count++;
    fclose(f);
    fprintf(stderr, "  --- %s (last %d of %d lines)\n", path, count < n ? count : n, count);
    for (int i = count > n ? count - n : 0; i < count; i++) {
        const char *line = ring[i % n];
        fprintf(stderr, "  %s%s", line, line[strlen(line) - 1] == '\n' ? "" : "\n");
    }
}

/* The tails of every *.log of a run dir: what the router and workers said. */
static void cb_print_log_tails(const char *dir) {
    static const char *const names[] = {"cluster-up.log", "router.log", "redis.log", NULL};
    char path[PATH_MAX + 64];
    for (int i = 0; names[i]; i++) {
        cb_fmt(path, sizeof path, "%s/%s", dir, names[i]);
        cb_print_tail(path, 6);
    }
    for (int p = 0; p < 64; p++)
        for (int s = 0; s < 64; s++) {
            cb_fmt(path, sizeof path, "%s/worker-p%d-s%d.log", dir, p, s);
            if (access(path, R_OK) != 0) {
                if (s == 0) return;
                break;
            }
            cb_print_tail(path, 6);
        }
}

/* Runs argv with stdout and stderr appended to log_path and waits for it,
 * at most timeout_s; a signal to this program sends it SIGTERM.  envp: its
 * environment (NULL: this program's).  Returns its exit status (0..255), or
 * a negative status with err saying why. */
static int cb_run(char *const argv[], char *const envp[], const char *log_path, int timeout_s, char *err,
                  size_t errlen) {
    posix_spawn_file_actions_t fa;
    posix_spawn_file_actions_init(&fa);
    posix_spawn_file_actions_addopen(&fa, 0, "/dev/null", O_RDONLY, 0);
    posix_spawn_file_actions_addopen(&fa, 1, log_path, O_WRONLY | O_CREAT | O_APPEND, 0644);
    posix_spawn_file_actions_adddup2(&fa, 1, 2);
    pid_t pid;
    int rc = posix_spawn(&pid, argv[0], &fa, NULL, argv, envp ? envp : environ);
    posix_spawn_file_actions_destroy(&fa);
    if (rc != 0) {
        cb_fmt(err, errlen, "cannot run %s: %s", argv[0], strerror(rc));
        return STATUS_IO;
    }
    double end = cb_now() + timeout_s;
    bool termed = false;
    for (;;) {
        int ws;
        pid_t w = waitpid(pid, &ws, WNOHANG);
        if (w == pid) {
            if (WIFEXITED(ws)) return WEXITSTATUS(ws);
            cb_fmt(err, errlen, "%s %s was killed by signal %d (log: %s)", argv[0], argv[1],
                     WIFSIGNALED(ws) ? WTERMSIG(ws) : 0, log_path);
            return STATUS_INTERNAL;
        }
        if (w < 0 && errno != EINTR) {
            cb_fmt(err, errlen, "waitpid %s: %s", argv[0], strerror(errno));
            return STATUS_IO;
        }
        if (!termed && (cb_stop || cb_now() > end)) {
            kill(pid, SIGTERM);
            termed = true;
            end = cb_now() + 10;
        } else if (termed && cb_now() > end) {
            kill(pid, SIGKILL);
        }
        cb_sleep_ms(50);
    }
}

/* llm-cluster next to this program (an installed bin/) or in the build
 * tree (build/bench/bench_cluster -> build/router/llm-cluster). */
static int cb_find_cluster(char *out, size_t size, char *err, size_t errlen) {
    char self[PATH_MAX];
    ssize_t n = readlink("/proc/self/exe", self, sizeof self - 1);
    if (n <= 0) {
        cb_fmt(err, errlen, "/proc/self/exe: %s", strerror(errno));
        return STATUS_IO;
    }
    self[n] = 0;
    char *slash = strrchr(self, '/');
    if (slash) *slash = 0;
    cb_fmt(out, size, "%s/llm-cluster", self);
    if (access(out, X_OK) == 0) return 0;
    cb_fmt(out, size, "%s/../router/llm-cluster", self);
    if (access(out, X_OK) == 0) return 0;
    cb_fmt(err, errlen, "llm-cluster not found next to %s or in %s/../router (build it, or give --cluster PATH)",
             self, self);
    return STATUS_NOT_FOUND;
}

/* ---- Keys ---- */

/* llm-cluster up makes CURVE keys for the router, one client and every
 * worker in RUN_DIR/keys, or, run with --insecure, leaves the marker
 * RUN_DIR/insecure.  The bench's clients take theirs from the environment
 * as env.sh would set it; the variables this program started with are put
 * back before llm-cluster runs again (llm-cluster up reads LLM_INSECURE). */
static const char *const cb_key_vars[] = {"LLM_CURVE_KEY_FILE", "LLM_ROUTER_KEY", "LLM_INSECURE"};
static char *cb_key_vars_saved[3];
static bool cb_key_vars_had[3];

static void cb_keys_save(void) {
    for (int i = 0; i < 3; i++) {
        const char *v = getenv(cb_key_vars[i]);
        cb_key_vars_had[i] = v != NULL;
        cb_key_vars_saved[i] = v ? strdup(v) : NULL;
    }
}

static void cb_keys_restore(void) {
    for (int i = 0; i < 3; i++) {
        if (cb_key_vars_had[i] && cb_key_vars_saved[i]) setenv(cb_key_vars[i], cb_key_vars_saved[i], 1);
        else unsetenv(cb_key_vars[i]);
    }
}

/* The client settings of the cluster in dir.  Called with no client thread
 * running (setenv is not thread-safe). */
static void cb_keys_use(const char *dir) {
    char path[PATH_MAX + 64];
    cb_fmt(path, sizeof path, "%s/insecure", dir);
    if (access(path, F_OK) == 0) {
        setenv("LLM_INSECURE", "true", 1);
        unsetenv("LLM_CURVE_KEY_FILE");
        unsetenv("LLM_ROUTER_KEY");
        return;
    }
    cb_fmt(path, sizeof path, "%s/keys/clients/client.key", dir);
    setenv("LLM_CURVE_KEY_FILE", path, 1);
    cb_fmt(path, sizeof path, "%s/keys/router.pub", dir);
    setenv("LLM_ROUTER_KEY", path, 1);
    unsetenv("LLM_INSECURE");
}

/* ---- The workers' metrics ports ---- */

/* The port a process logged for its metrics ("metrics on http://HOST:PORT
 * (port N)"): the clusters run with LLM_METRICS_LISTEN=127.0.0.1:0, so
 * that every process picks a free port and says which.  0: none logged. */
static int cb_log_metrics_port(const char *log_path) {
    FILE *f = fopen(log_path, "r");
    if (!f) return 0;
    char line[1024];
    int port = 0;
    while (fgets(line, sizeof line, f)) {
        const char *m = strstr(line, "metrics on http://");
        const char *q = m ? strstr(m, "(port ") : NULL;
        if (q) port = atoi(q + 6);
    }
    fclose(f);
    return port > 0 && port < 65536 ? port : 0;
}

/* The body of GET /metrics from 127.0.0.1:port into buf, NUL-terminated
 * (cut at size).  Returns 0, or -1 when there is no answer or no 200 within
 * 2 s. */
static int cb_http_metrics(int port, char *buf, size_t size) {
    int fd = socket(AF_INET, SOCK_STREAM | SOCK_CLOEXEC, 0);
    if (fd < 0) return -1;
    struct timeval tv = {2, 0};
    setsockopt(fd, SOL_SOCKET, SO_RCVTIMEO, &tv, sizeof tv);
    setsockopt(fd, SOL_SOCKET, SO_SNDTIMEO, &tv, sizeof tv);
    struct sockaddr_in a;
    memset(&a, 0, sizeof a);
    a.sin_family = AF_INET;
    a.sin_port = htons((uint16_t)port);
    a.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
    static const char req[] = "GET /metrics HTTP/1.0\r\nHost: 127.0.0.1\r\n\r\n";
    if (connect(fd, (struct sockaddr *)&a, sizeof a) != 0 || write(fd, req, sizeof req - 1) != (ssize_t)(sizeof req - 1)) {
        close(fd);
        return -1;
    }
    size_t n = 0;
    ssize_t got;
    while (n + 1 < size && (got = read(fd, buf + n, size - 1 - n)) > 0) n += (size_t)got;
    close(fd);
    buf[n] = 0;
    const char *body = strstr(buf, "\r\n\r\n");
    if (strncmp(buf, "HTTP/1.", 7) != 0 || n < 12 || atoi(buf + 9) != 200 || !body) return -1;
    memmove(buf, body + 4, strlen(body + 4) + 1);
    return 0;
}

/* Sum over the series of one metric in Prometheus text (name, or name{...}),
 * or -1 when the text has none. */
static double cb_metric_sum(const char *text, const char *name) {
    size_t len = strlen(name);
    double sum = 0;
    bool found = false;
    for (const char *l = text; l && *l; l = strchr(l, '\n'), l = l ? l + 1 : NULL) {
        if (strncmp(l, name, len) != 0 || (l[len] != ' ' && l[len] != '{')) continue;
        const char *v = l + len;
        if (*v == '{') {
            const char *end = strchr(v, '}'), *nl = strchr(v, '\n');
            if (!end || (nl && end > nl)) continue;
            v = end + 1;
        }
        char *e = NULL;
        double x = strtod(v, &e);
        if (e == v) continue;
        sum += x;
        found = true;
    }
    return found ? sum : -1;
}

/* One worker's counters at one moment: its step time sum and the token
 * rows it computed; < 0 where the scrape failed. */
struct cb_wm {
    double step_s, rows;
};

/* A running cluster: its layout, run dir and each worker's metrics port
 * (worker p*stages+s; 0: unknown). */
struct cb_cluster {
    const struct cb_layout *lay;
    const char *dir;
    int ports[CB_WORKERS_MAX];
    int n_workers;
};

static void cb_cluster_ports(struct cb_cluster *cl) {
    const struct cb_layout *l = cl->lay;
    cl->n_workers = l->pipelines * l->stages <= CB_WORKERS_MAX ? l->pipelines * l->stages : 0;
    int missing = 0;
    for (int w = 0; w < cl->n_workers; w++) {
        char path[PATH_MAX + 64];
        cb_fmt(path, sizeof path, "%s/worker-p%d-s%d.log", cl->dir, w / l->stages, w % l->stages);
        cl->ports[w] = cb_log_metrics_port(path);
        missing += cl->ports[w] == 0;
    }
    if (missing || !cl->n_workers)
        fprintf(stderr, "bench_cluster: %s: %d of %d workers logged no metrics port (--log-level above info, or "
                "more than %d workers): their busy fractions are not measured\n", l->name,
                cl->n_workers ? missing : l->pipelines * l->stages, l->pipelines * l->stages, CB_WORKERS_MAX);
}

static void cb_cluster_scrape(const struct cb_cluster *cl, struct cb_wm *wm) {
    static char buf[1 << 18];
    for (int w = 0; w < cl->n_workers; w++) {
        wm[w].step_s = wm[w].rows = -1;
        if (cl->ports[w] && cb_http_metrics(cl->ports[w], buf, sizeof buf) == 0) {
            wm[w].step_s = cb_metric_sum(buf, "llm_step_time_seconds_sum");
            wm[w].rows = cb_metric_sum(buf, "llm_stage_tokens_total");
        }
    }
}

/* ---- One concurrency level ---- */

/* The router's counters at one moment (StatusReply). */
struct cb_router {
    double plan_us_mean, plan_us_max, turn_us_mean;
    uint64_t steps, requests;
};

static int cb_router_status(llm_client *c, struct cb_router *r) {
    Llm__ClientEnvelope *env = NULL;
    int rc = llm_client_status(c, &env);
    if (rc < 0) return rc;
    const Llm__StatusReply *s = env->status_reply;
    r->plan_us_mean = s->plan_us_mean;
    r->plan_us_max = s->plan_us_max;
    r->turn_us_mean = s->turnaround_us_mean;
    r->steps = s->steps_total;
    r->requests = s->requests_total;
    proto_client_free(env);
    return 0;
}

struct cb_row {
    struct cb_layout lay;
    int conc;
    /* Open loop: the arrival rate (0: closed loop) and seed of this level,
     * the requests that waited for a free stream and their mean wait. */
    double rate;
    int seed;
    int n_capped;
    double cap_wait_ms;
    /* -1: no --json-schema; 1: every request constrained by it; 0: the
     * same level unconstrained (--schema-baseline). */
    int constrained;
    int n_req, n_ok, n_err, n_short;
    double wall_s, req_s, tok_s, ttft50, ttft90, itl50, itl90;
    uint64_t steps, tokens;
    double plan_mean, plan_max, turn_mean;
    /* From the workers' metrics ports: each worker's step time over the
     * level's wall time (worker p*stages+s; < 0: not measured), and the
     * token rows the first stages computed (prefill and decode, all
     * pipelines; < 0: not measured). */
    double busy[CB_WORKERS_MAX];
    double rows0;
    bool failed;          /* the cluster did not start: nothing measured */
    char note[160];
};

struct cb_level {
    const struct cb_opts *o;
    const char *schema;   /* JSON Schema text every request carries, or NULL */
    const char *endpoint;
    void *zmq_ctx;
    int n_req;
    int first_id;         /* prompt id of this level's first request */
    int32_t n_vocab;
    atomic_int next;
    /* Open loop: request k is sent at t0 + due[k] (NULL: closed loop);
     * cap_wait[k] > 0: it waited that long for a free stream. */
    const double *due;
    double t0;
    double *cap_wait;
    double *ttft;         /* [n_req]; < 0 when no token came */
    double *itl;          /* [n_req * max_tokens] */
    int *n_itl;           /* [n_req] */
    atomic_int n_ok, n_err, n_short;
    atomic_llong tokens;
    /* Every stream connects, counts itself ready and waits for go, so
     * that the clock starts with all of them connected. */
    atomic_int ready;
    atomic_bool go;
    pthread_mutex_t mu;
    char first_err[512];
};

struct cb_req {
    struct cb_level *lv;
    int idx;
    double t_send, t_last;
    bool seen;
    char *sample; /* the output text of a constrained level's request 0, else NULL */
    size_t sample_len, sample_cap;
};

static void cb_level_error(struct cb_level *lv, const char *fmt, ...) __attribute__((format(printf, 2, 3)));
static void cb_level_error(struct cb_level *lv, const char *fmt, ...) {
    pthread_mutex_lock(&lv->mu);
    if (!lv->first_err[0]) {
        va_list ap;
        va_start(ap, fmt);
        vsnprintf(lv->first_err, sizeof lv->first_err, fmt, ap);
        va_end(ap);
    }
    pthread_mutex_unlock(&lv->mu);
}

/* Time to the first token, then one inter-token sample per later token
 * (a chunk of k tokens after a gap g counts as k gaps of g/k). */
static int cb_on_chunk(void *ud, const struct llm_chunk *ch) {
    struct cb_req *r = ud;
    struct cb_level *lv = r->lv;
    double now = cb_now();
    if (ch->n_tokens > 0) {
        if (!r->seen) {
            lv->ttft[r->idx] = now - r->t_send;
            r->seen = true;
        } else {
            int max = lv->o->max_tokens;
            double gap = (now - r->t_last) / (double)ch->n_tokens;
            for (size_t k = 0; k < ch->n_tokens && lv->n_itl[r->idx] < max; k++)
                lv->itl[(size_t)r->idx * (size_t)max + (size_t)lv->n_itl[r->idx]++] = gap;
        }
        r->t_last = now;
    }
    size_t tl = ch->text ? strlen(ch->text) : 0;
    if (r->sample && tl > 0 && r->sample_len + tl < r->sample_cap) {
        memcpy(r->sample + r->sample_len, ch->text, tl);
        r->sample_len += tl;
        r->sample[r->sample_len] = 0;
    }
    return cb_stop ? 1 : 0;
}

/* ---- Open-loop arrivals ---- */

/* mulberry32, the generator of serve-bench's makeRng, in uint32 arithmetic
 * (JavaScript's Math.imul and ^ work modulo 2^32 alike): one seed gives the
 * same draws in [0, 1) in both programs. */
static double cb_rng_next(uint32_t *state) {
    uint32_t t = *state += 0x6d2b79f5u;
    t = (t ^ (t >> 15)) * (t | 1u);
    t ^= t + (t ^ (t >> 7)) * (t | 61u);
    return (double)(t ^ (t >> 14)) / 4294967296.0;
}

/* The times of n arrivals in seconds from the level's start: request k is
 * due at the k-th point of a Poisson process of rate per second, its gaps
 * exponential draws from mulberry32 seeded with seed ^ 0x5bd1e995.  That
 * is serve-bench's schedule for --rate rate --seed seed, so the two clients
 * load a cluster with the same arrivals (to rounding of the logarithm). */
static void cb_arrivals(double rate, uint32_t seed, double *due, int n) {
    uint32_t state = seed ^ 0x5bd1e995u;
    double t = 0;
    for (int k = 0; k < n; k++) {
        t += -log(1.0 - cb_rng_next(&state)) / rate;
        due[k] = t;
    }
}

/* Prompt ids of request idx: distinct per request (no shared prefix), away
 * from the low ids where models keep their special tokens. */
static void cb_prompt_ids(int idx, int32_t n_vocab, int32_t *ids, int n) {
    int32_t lo = n_vocab > 400 ? 300 : 3;
    uint64_t x = 0x9e3779b97f4a7c15ULL * (uint64_t)(idx + 1);
    for (int i = 0; i < n; i++) {
        x ^= x >> 12;
        x ^= x << 25;
        x ^= x >> 27;
        ids[i] = lo + (int32_t)((x * 0x2545f4914f6cdd1dULL >> 33) % (uint64_t)(n_vocab - lo));
    }
}

/* The cb_prompt_len(o) ids of request idx: distinct throughout, or in the
 * shared-prefix workload one system prompt common to every request (the
 * same ids in every run, so cache on and off see the same prompts)
 * followed by a question of the request's own. */
#define CB_PREFIX_SEED 7777777
static void cb_prompt(const struct cb_opts *o, int idx, int32_t n_vocab, int32_t *ids) {
    if (o->shared_prefix <= 0) {
        cb_prompt_ids(idx, n_vocab, ids, o->prompt_tokens);
        return;
    }
    cb_prompt_ids(CB_PREFIX_SEED, n_vocab, ids, o->shared_prefix);
    cb_prompt_ids(idx, n_vocab, ids + o->shared_prefix, o->question_tokens);
}

static llm_client *cb_client_open(const char *endpoint, void *zmq_ctx, char *err, size_t errlen) {
    const char *eps[1] = {endpoint};
    struct llm_client_config cfg;
    llm_client_config_default(&cfg);
    cfg.endpoints = eps;
    cfg.n_endpoints = 1;
    cfg.zmq_ctx = zmq_ctx;
    /* A silent stream is re-attached (no work repeated) after 10 s, and a
     * router that stays gone ends the call after 30 s, so a stop signal or
     * a dead cluster never blocks a run for long. */
    cfg.idle_timeout_ms = 10000;
    cfg.retry_ms = 30000;
    llm_client *c = NULL;
    if (llm_client_open(&c, &cfg, err, errlen) < 0) return NULL;
    return c;
}

static void *cb_stream(void *arg) {
    struct cb_level *lv = arg;
    const struct cb_opts *o = lv->o;
    char err[512];
    llm_client *c = cb_client_open(lv->endpoint, lv->zmq_ctx, err, sizeof err);
    int32_t *ids = malloc((size_t)cb_prompt_len(o) * sizeof *ids);
    if (!c || !ids) cb_level_error(lv, "client: %s", c ? "out of memory" : err);
    /* Connect before the clock starts. */
    Llm__ClientEnvelope *env = NULL;
    if (c && llm_client_health(c, &env) == 0) proto_client_free(env);
    atomic_fetch_add(&lv->ready, 1);
    while (!atomic_load(&lv->go)) cb_sleep_ms(1);
    bool sent_one = false;
    while (c && ids && !cb_stop) {
        int idx = atomic_fetch_add(&lv->next, 1);
        if (idx >= lv->n_req) break;
        if (lv->due) {
            /* Open loop: a free stream takes the next arrival at once and
             * sleeps until it is due, so an arrival still untaken when due
             * found every stream with a request in flight: it goes as soon
             * as one ends (this one), first come first served, which is
             * how serve-bench's --concurrency caps its --rate.  Lateness at
             * a stream's first take is its wake-up at the start, not the cap. */
            double at = lv->t0 + lv->due[idx], now = cb_now();
            if (now < at) cb_sleep_until(at);
            else if (sent_one) lv->cap_wait[idx] = now - at;
        }
        sent_one = true;
        cb_prompt(o, lv->first_id + idx, lv->n_vocab, ids);
        struct llm_generate_params p;
        llm_generate_params_default(&p);
        p.prompt_tokens = ids;
        p.n_prompt_tokens = (size_t)cb_prompt_len(o);
        p.max_tokens = (uint32_t)o->max_tokens;
        p.sampling.ignore_eos = 1; /* every request generates exactly max_tokens */
        p.json_schema = lv->schema;
        p.stream = true;
        struct cb_req r = {lv, idx, cb_now(), 0, false, NULL, 0, 0};
        /* The first constrained output is shown: what the masks let through. */
        static char sample[4096];
        if (lv->schema && idx == 0) {
            sample[0] = 0;
            r.sample = sample;
            r.sample_cap = sizeof sample;
        }
        struct llm_generate_result res;
        int rc = llm_client_generate(c, &p, cb_on_chunk, &r, &res);
        if (r.sample)
            fprintf(stderr, "bench_cluster: constrained output of request 0 (%zu bytes, first 240 shown): %.240s\n",
                    r.sample_len, r.sample);
        if (rc < 0) {
            atomic_fetch_add(&lv->n_err, 1);
            cb_level_error(lv, "request %d: %s", idx, llm_client_errstr(c));
        } else if (res.finish_reason == LLM__GENERATE_DONE__FINISH_REASON__ERROR) {
            atomic_fetch_add(&lv->n_err, 1);
            cb_level_error(lv, "request %d (%s): ERROR %d: %s", idx, res.request_id, (int)res.error_code,
                           res.error_message);
        } else if (res.finish_reason != LLM__GENERATE_DONE__FINISH_REASON__LENGTH ||
                   res.tokens_received != (uint32_t)o->max_tokens) {
            atomic_fetch_add(&lv->n_short, 1);
            if (!cb_stop)
                cb_level_error(lv, "request %d (%s): %s after %u tokens, expected LENGTH after %d", idx,
                               res.request_id, llm_finish_reason_name(res.finish_reason), res.tokens_received,
                               o->max_tokens);
        } else {
            atomic_fetch_add(&lv->n_ok, 1);
        }
        atomic_fetch_add(&lv->tokens, (long long)res.tokens_received);
        llm_generate_result_free(&res);
    }
    free(ids);
    llm_client_close(c);
    return NULL;
}

/* Runs one level (conc streams, n_req requests) and fills the row's
 * client-side numbers.  STATUS_NO_MEMORY or a thread failure: err says. */
static int cb_level_run(const struct cb_opts *o, const char *endpoint, int32_t n_vocab, int conc,
                        struct cb_row *row, char *err, size_t errlen) {
    struct cb_level lv;
    memset(&lv, 0, sizeof lv);
    lv.o = o;
    lv.schema = row->constrained == 1 ? o->json_schema : NULL;
    lv.endpoint = endpoint;
    lv.n_req = row->n_req;
    /* No two requests of a run share a prompt (or a question), so that a
     * level finds nothing of the levels before it in a prefix cache. */
    static int next_id;
    lv.first_id = next_id;
    next_id += lv.n_req;
    lv.n_vocab = n_vocab;
    atomic_init(&lv.next, 0);
    atomic_init(&lv.n_ok, 0);
    atomic_init(&lv.n_err, 0);
    atomic_init(&lv.n_short, 0);
    atomic_init(&lv.tokens, 0);
    atomic_init(&lv.ready, 0);
    atomic_init(&lv.go, false);
    size_t n_itl_max = (size_t)lv.n_req * (size_t)o->max_tokens;
    lv.ttft = malloc((size_t)lv.n_req * sizeof *lv.ttft);
    lv.itl = malloc(n_itl_max * sizeof *lv.itl);
    lv.n_itl = calloc((size_t)lv.n_req, sizeof *lv.n_itl);
    double *due = NULL;
    if (row->rate > 0) {
        due = malloc((size_t)lv.n_req * sizeof *due);
        lv.cap_wait = calloc((size_t)lv.n_req, sizeof *lv.cap_wait);
        if (due) cb_arrivals(row->rate, (uint32_t)row->seed, due, lv.n_req);
        lv.due = due;
    }
    pthread_t *th = malloc((size_t)conc * sizeof *th);
    lv.zmq_ctx = zmq_ctx_new();
    int rc = STATUS_OK;
    if (!lv.ttft || !lv.itl || !lv.n_itl || !th || !lv.zmq_ctx || (row->rate > 0 && (!due || !lv.cap_wait))) {
        cb_fmt(err, errlen, "concurrency %d: out of memory for %d requests", conc, lv.n_req);
        rc = STATUS_NO_MEMORY;
        goto done;
    }
    zmq_ctx_set(lv.zmq_ctx, ZMQ_MAX_SOCKETS, 4 * conc + 64);
    for (int i = 0; i < lv.n_req; i++) lv.ttft[i] = -1;
    pthread_mutex_init(&lv.mu, NULL);
    int started = 0;
    for (; started < conc; started++) {
        int e = pthread_create(&th[started], NULL, cb_stream, &lv);
        if (e != 0) {
            cb_fmt(err, errlen, "concurrency %d: thread %d: %s", conc, started, strerror(e));
            rc = STATUS_INTERNAL;
            atomic_store(&lv.next, lv.n_req); /* the started ones send nothing */
            break;
        }
    }
    while (atomic_load(&lv.ready) < started) cb_sleep_ms(1);
    /* The arrivals count from here, as serve-bench's from its start: the
     * first is one gap after it. */
    lv.t0 = cb_now();
    atomic_store(&lv.go, true);
    for (int i = 0; i < started; i++) pthread_join(th[i], NULL);
    row->wall_s = cb_now() - lv.t0;
    pthread_mutex_destroy(&lv.mu);
    if (rc < 0) goto done;

    row->n_ok = atomic_load(&lv.n_ok);
    row->n_err = atomic_load(&lv.n_err);
    row->n_short = atomic_load(&lv.n_short);
    row->tokens = (uint64_t)atomic_load(&lv.tokens);
    row->req_s = row->wall_s > 0 ? (double)row->n_ok / row->wall_s : 0;
    row->tok_s = row->wall_s > 0 ? (double)row->tokens / row->wall_s : 0;
    size_t n_t = 0;
    for (int i = 0; i < lv.n_req; i++)
        if (lv.ttft[i] >= 0) lv.ttft[n_t++] = lv.ttft[i];
    row->ttft50 = cb_percentile(lv.ttft, n_t, 0.5) * 1e3;
    row->ttft90 = cb_percentile(lv.ttft, n_t, 0.9) * 1e3;
    size_t n_i = 0;
    for (int i = 0; i < lv.n_req; i++)
        for (int k = 0; k < lv.n_itl[i]; k++) lv.itl[n_i++] = lv.itl[(size_t)i * (size_t)o->max_tokens + (size_t)k];
    row->itl50 = cb_percentile(lv.itl, n_i, 0.5) * 1e3;
    row->itl90 = cb_percentile(lv.itl, n_i, 0.9) * 1e3;
    if (lv.cap_wait) {
        double sum = 0;
        for (int i = 0; i < lv.n_req; i++)
            if (lv.cap_wait[i] > 0) {
                row->n_capped++;
                sum += lv.cap_wait[i];
            }
        row->cap_wait_ms = row->n_capped ? sum / row->n_capped * 1e3 : 0;
    }
    if (lv.first_err[0]) cb_fmt(row->note, sizeof row->note, "%s", lv.first_err);
done:
    if (lv.zmq_ctx) zmq_ctx_term(lv.zmq_ctx);
    free(th);
    free(lv.ttft);
    free(lv.itl);
    free(lv.n_itl);
    free(due);
    free(lv.cap_wait);
    return rc;
}

/* ---- One cluster layout ---- */

static struct cb_row cb_rows[CB_ROWS_MAX];
static int cb_n_rows;

static struct cb_row *cb_row_add(const struct cb_layout *lay, int conc) {
    if (cb_n_rows == CB_ROWS_MAX) return NULL;
    struct cb_row *r = &cb_rows[cb_n_rows++];
    memset(r, 0, sizeof *r);
    r->lay = *lay;
    r->conc = conc;
    for (int w = 0; w < CB_WORKERS_MAX; w++) r->busy[w] = -1;
    r->rows0 = -1;
    r->constrained = -1;
    return r;
}

/* The model's vocabulary and context from the router (ModelsReply). */
static int cb_model_info(llm_client *c, int32_t *n_vocab, int32_t *n_ctx, char *err, size_t errlen) {
    Llm__ClientEnvelope *env = NULL;
    int rc = llm_client_models(c, &env);
    if (rc < 0) {
        cb_fmt(err, errlen, "models: %s", llm_client_errstr(c));
        return rc;
    }
    const Llm__ModelsReply *m = env->models_reply;
    rc = STATUS_NOT_FOUND;
    for (size_t i = 0; i < m->n_models; i++) {
        if (m->models[i]->is_default || m->n_models == 1) {
            *n_vocab = (int32_t)m->models[i]->n_vocab;
            *n_ctx = (int32_t)m->models[i]->n_ctx;
            rc = STATUS_OK;
            break;
        }
    }
    if (rc < 0) cb_fmt(err, errlen, "models: the router lists %zu models and no default", m->n_models);
    proto_client_free(env);
    return rc;
}

/* A stop signal cancels the warm-up request too. */
static int cb_warm_chunk(void *ud, const struct llm_chunk *ch) {
    (void)ud;
    (void)ch;
    return cb_stop ? 1 : 0;
}

/* One warm-up request (first-use costs: CUDA contexts, page faults; with a
 * schema, the last stage's vocabulary trie and the grammar's compilation). */
static int cb_warmup(llm_client *c, const struct cb_opts *o, int32_t n_vocab, const char *schema, char *err,
                     size_t errlen) {
    int n = cb_prompt_len(o);
    int32_t *ids = malloc((size_t)n * sizeof *ids);
    if (!ids) return STATUS_NO_MEMORY;
    /* Shares no prefix with the measured prompts: the cache starts cold. */
    cb_prompt_ids(1000000, n_vocab, ids, n);
    struct llm_generate_params p;
    llm_generate_params_default(&p);
    p.prompt_tokens = ids;
    p.n_prompt_tokens = (size_t)n;
    p.max_tokens = (uint32_t)o->max_tokens;
    p.sampling.ignore_eos = 1;
    p.json_schema = schema;
    struct llm_generate_result res;
    p.stream = true;
    int rc = llm_client_generate(c, &p, cb_warm_chunk, NULL, &res);
    if (rc < 0) cb_fmt(err, errlen, "warm-up request: %s", llm_client_errstr(c));
    else if (res.finish_reason != LLM__GENERATE_DONE__FINISH_REASON__LENGTH) {
        cb_fmt(err, errlen, "warm-up request %s: %s after %u tokens (%s), expected LENGTH after %d",
                 res.request_id, llm_finish_reason_name(res.finish_reason), res.completion_tokens,
                 res.error_message, o->max_tokens);
        rc = STATUS_INTERNAL;
    }
    llm_generate_result_free(&res);
    free(ids);
    return rc;
}

/* Measures every concurrency level on a running cluster. */
static int cb_levels(const struct cb_opts *o, const struct cb_cluster *cl, const char *endpoint, char *err,
                     size_t errlen) {
    const struct cb_layout *lay = cl->lay;
    llm_client *c = cb_client_open(endpoint, NULL, err, errlen);
    if (!c) return STATUS_UNAVAILABLE;
    int32_t n_vocab = 0, n_ctx = 0;
    int rc = cb_model_info(c, &n_vocab, &n_ctx, err, errlen);
    if (rc == STATUS_OK && cb_prompt_len(o) + o->max_tokens > n_ctx) {
        cb_fmt(err, errlen, "prompts of %d tokens + --max-tokens %d exceed the model's context of %d",
               cb_prompt_len(o), o->max_tokens, n_ctx);
        rc = STATUS_BAD_INPUT;
    }
    for (int i = 0; rc == STATUS_OK && i < o->warmup && !cb_stop; i++) {
        if (!o->json_schema || o->schema_baseline) rc = cb_warmup(c, o, n_vocab, NULL, err, errlen);
        if (rc == STATUS_OK && o->json_schema) rc = cb_warmup(c, o, n_vocab, o->json_schema, err, errlen);
    }
    /* With --schema-baseline, each level twice: unconstrained, then
     * constrained. */
    int passes = o->json_schema && o->schema_baseline ? 2 : 1;
    for (int k = 0; rc == STATUS_OK && k < o->n_conc * passes && !cb_stop; k++) {
        int ci = k / passes, conc = o->conc_v[ci];
        struct cb_row *row = cb_row_add(lay, conc);
        if (!row) break;
        row->constrained = !o->json_schema ? -1 : passes == 2 ? k % passes : 1;
        row->n_req = cb_level_requests(o, conc);
        row->rate = o->rate;
        /* Each level its own arrivals, the same for every layout. */
        row->seed = (int)((unsigned)o->seed + (unsigned)ci);
        struct cb_router before, after;
        struct cb_wm wm0[CB_WORKERS_MAX], wm1[CB_WORKERS_MAX];
        if ((rc = cb_router_status(c, &before)) < 0) {
            cb_fmt(err, errlen, "status before concurrency %d: %s", conc, llm_client_errstr(c));
            break;
        }
        cb_cluster_scrape(cl, wm0);
        char load[96] = "";
        if (row->rate > 0)
            cb_fmt(load, sizeof load, ", Poisson arrivals at %g req/s (seed %d)", row->rate, row->seed);
        fprintf(stderr, "bench_cluster: %s%s: concurrency %d, %d requests%s%s\n", lay->name,
                lay->cache < 0 ? "" : lay->cache ? " cache on" : " cache off", conc, row->n_req, load,
                row->constrained < 0 ? "" : row->constrained ? ", JSON-schema constrained" : ", unconstrained");
        if ((rc = cb_level_run(o, endpoint, n_vocab, conc, row, err, errlen)) < 0) break;
        /* Between levels nothing is in flight, so the deltas belong to this level. */
        if ((rc = cb_router_status(c, &after)) < 0) {
            cb_fmt(err, errlen, "status after concurrency %d: %s", conc, llm_client_errstr(c));
            break;
        }
        cb_cluster_scrape(cl, wm1);
        row->steps = after.steps - before.steps;
        if (row->steps > 0) {
            /* Status reports means since start: recover this level's sums.  The
             * turnaround is counted once per finished step, which between
             * levels is every step sent. */
            row->plan_mean = (after.plan_us_mean * (double)after.steps - before.plan_us_mean * (double)before.steps) /
                             (double)row->steps;
            row->turn_mean = (after.turn_us_mean * (double)after.steps - before.turn_us_mean * (double)before.steps) /
                             (double)row->steps;
        }
        row->plan_max = after.plan_us_max;
        /* Busy: the step time a worker's histogram gained over the level's
         * wall time.  Rows: what the first stages computed, prefill rows a
         * cached prefix saved included. */
        double rows0 = 0;
        for (int w = 0; w < cl->n_workers; w++) {
            if (wm0[w].step_s >= 0 && wm1[w].step_s >= 0 && row->wall_s > 0)
                row->busy[w] = (wm1[w].step_s - wm0[w].step_s) / row->wall_s;
            if (w % lay->stages == 0)
                rows0 = rows0 >= 0 && wm0[w].rows >= 0 && wm1[w].rows >= 0 ? rows0 + wm1[w].rows - wm0[w].rows : -1;
        }
        row->rows0 = cl->n_workers ? rows0 : -1;
        fprintf(stderr,
                "bench_cluster: %s c=%d: %d ok, %d errors, %d short in %.2f s: %.2f req/s, %.1f tok/s, "
                "TTFT p50 %.1f ms, ITL p50 %.2f ms; router: %llu steps, plan %.1f us mean, turnaround %.1f us\n",
                lay->name, conc, row->n_ok, row->n_err, row->n_short, row->wall_s, row->req_s, row->tok_s,
                row->ttft50, row->itl50, (unsigned long long)row->steps, row->plan_mean, row->turn_mean);
        if (row->rate > 0)
            fprintf(stderr, "bench_cluster: %s c=%d: %d of %d arrivals found all %d streams busy and waited "
                    "%.1f ms on average\n", lay->name, conc, row->n_capped, row->n_req, conc, row->cap_wait_ms);
        if (row->note[0]) {
            fprintf(stderr, "bench_cluster: %s c=%d: first problem: %s\n", lay->name, conc, row->note);
            if (row->n_err) cb_print_log_tails(cl->dir);
        }
    }
    llm_client_close(c);
    return rc;
}

/* llm-cluster down on a run dir, to its end even after a stop signal. */
static void cb_down(const char *cluster, const char *dir) {
    char down_log[PATH_MAX + 32], err[256];
    cb_fmt(down_log, sizeof down_log, "%s/cluster-down.log", dir);
    char *down[] = {(char *)cluster, "down", "--run-dir", (char *)dir, NULL};
    sig_atomic_t stop = cb_stop;
    cb_stop = 0;
    cb_keys_restore();
    int rc = cb_run(down, NULL, down_log, 60, err, sizeof err);
    cb_stop = cb_stop || stop;
    if (rc != 0)
        fprintf(stderr, "bench_cluster: llm-cluster down --run-dir %s: %s\n", dir,
                rc < 0 ? err : "non-zero exit status (see cluster-down.log)");
}

/* The environment of llm-cluster up, which its router and workers inherit:
 * this program's, with every metrics port on a free loopback port (the
 * processes log which: cb_log_metrics_port) and, for a sockets layout,
 * NCCL without peer-to-peer and shared-memory transports, as between two
 * hosts.  A NULL-terminated array the caller frees (the strings are
 * environ's or static). */
static char **cb_up_env(const struct cb_layout *lay) {
    static char metrics[] = "LLM_METRICS_LISTEN=127.0.0.1:0";
    static char p2p[] = "NCCL_P2P_DISABLE=1", shm[] = "NCCL_SHM_DISABLE=1";
    char *add[3] = {metrics, lay->sockets ? p2p : NULL, lay->sockets ? shm : NULL};
    size_t n = 0;
    while (environ[n]) n++;
    char **env = malloc((n + 4) * sizeof *env);
    if (!env) return NULL;
    size_t k = 0;
    for (size_t i = 0; i < n; i++) {
        bool replaced = false;
        for (int a = 0; a < 3; a++) {
            if (!add[a]) continue;
            size_t len = (size_t)(strchr(add[a], '=') - add[a]) + 1;
            replaced = replaced || strncmp(environ[i], add[a], len) == 0;
        }
        if (!replaced) env[k++] = environ[i];
    }
    for (int a = 0; a < 3; a++)
        if (add[a]) env[k++] = add[a];
    env[k] = NULL;
    return env;
}

/* Starts a cluster of the layout in run_root/NAME, measures it and stops it. */
static int cb_layout(const struct cb_opts *o, const char *cluster, const char *model, const char *run_root,
                     const struct cb_layout *lay, char *err, size_t errlen) {
    char dir[PATH_MAX], log_path[PATH_MAX + 32];
    cb_fmt(dir, sizeof dir, "%s/%s%s", run_root, lay->name, lay->cache < 0 ? "" : lay->cache ? "-cache" : "-nocache");
    if (mkdir(dir, 0755) != 0 && errno != EEXIST) {
        cb_fmt(err, errlen, "run dir %s: %s", dir, strerror(errno));
        return STATUS_IO;
    }
    cb_fmt(log_path, sizeof log_path, "%s/cluster-up.log", dir);
    char p_s[16], s_s[16], t_s[16], kv_s[16], to_s[16], router_args[1024];
    cb_fmt(p_s, sizeof p_s, "%d", lay->pipelines);
    cb_fmt(s_s, sizeof s_s, "%d", lay->stages);
    cb_fmt(t_s, sizeof t_s, "%d", o->threads);
    cb_fmt(kv_s, sizeof kv_s, "%d", o->kv_blocks);
    cb_fmt(to_s, sizeof to_s, "%d", o->up_timeout_s);
    cb_fmt(router_args, sizeof router_args, "%s%s%s", o->router_args,
           lay->cache == 0 && o->router_args[0] ? " " : "", lay->cache == 0 ? o->no_cache_arg : "");
    char *up[32] = {(char *)cluster, "up", "--model", (char *)model, "--pipelines", p_s, "--stages", s_s,
                    "--run-dir", dir, "--port", "0", "--device", (char *)o->device, "--threads", t_s,
                    "--kv-blocks", kv_s, "--timeout-s", to_s, "--log-level", (char *)o->log_level,
                    "--router-args", router_args, "--worker-args", (char *)o->worker_args};
    int n_up = 26;
    if (o->insecure) up[n_up++] = "--insecure";
    up[n_up] = NULL;
    char **env = cb_up_env(lay);
    if (!env) {
        cb_fmt(err, errlen, "out of memory");
        return STATUS_NO_MEMORY;
    }
    fprintf(stderr, "bench_cluster: starting %d pipeline(s) x %d stage(s)%s%s in %s\n", lay->pipelines,
            lay->stages, lay->sockets ? ", NCCL over sockets" : "",
            lay->cache < 0 ? "" : lay->cache ? ", prefix cache on" : ", prefix cache off", dir);
    double t0 = cb_now();
    int rc;
    for (int attempt = 1;; attempt++) {
        cb_keys_restore();
        rc = cb_run(up, env, log_path, o->up_timeout_s + 30, err, errlen);
        if (rc == 0 || cb_stop || attempt >= o->up_tries) break;
        /* A start can fail for a reason outside this layout (a port taken
         * meanwhile): say why, clean up, and start it once more. */
        fprintf(stderr, "bench_cluster: %s: llm-cluster up failed (attempt %d of %d, status %d):\n", lay->name,
                attempt, o->up_tries, rc);
        cb_print_log_tails(dir);
        cb_down(cluster, dir);
        t0 = cb_now();
    }
    free(env);
    if (rc == 0) {
        char ep_path[PATH_MAX + 32], endpoint[256] = "";
        cb_fmt(ep_path, sizeof ep_path, "%s/endpoint", dir);
        FILE *f = fopen(ep_path, "r");
        if (f) {
            if (!fgets(endpoint, sizeof endpoint, f)) endpoint[0] = 0;
            fclose(f);
            endpoint[strcspn(endpoint, "\r\n")] = 0;
        }
        if (!endpoint[0]) {
            cb_fmt(err, errlen, "llm-cluster up succeeded but wrote no endpoint in %s", ep_path);
            rc = STATUS_INTERNAL;
        } else {
            fprintf(stderr, "bench_cluster: cluster in service at %s after %.1f s\n", endpoint, cb_now() - t0);
            struct cb_cluster cl;
            memset(&cl, 0, sizeof cl);
            cl.lay = lay;
            cl.dir = dir;
            cb_cluster_ports(&cl);
            cb_keys_use(dir);
            rc = cb_levels(o, &cl, endpoint, err, errlen);
            if (rc < 0) cb_print_log_tails(dir);
        }
    } else if (rc > 0) {
        cb_fmt(err, errlen, "llm-cluster up exited with status %d%s (log: %s)", rc,
                 cb_stop ? " after a stop signal" : "", log_path);
        cb_print_log_tails(dir);
        rc = STATUS_UNAVAILABLE;
    }
    /* Always: up may have left processes behind when it failed or was stopped. */
    cb_down(cluster, dir);
    return rc;
}

/* ---- Table and JSON ---- */

/* Mean busy fraction of stage st over the row's pipelines; < 0 when no
 * worker of that stage was measured. */
static double cb_stage_busy(const struct cb_row *r, int st) {
    double sum = 0;
    int n = 0;
    for (int p = 0; p < r->lay.pipelines; p++) {
        int w = p * r->lay.stages + st;
        if (w < CB_WORKERS_MAX && r->busy[w] >= 0) {
            sum += r->busy[w];
            n++;
        }
    }
    return n ? sum / n : -1;
}

static void cb_workload(char *out, size_t size, const struct cb_opts *o) {
    if (o->shared_prefix > 0)
        cb_fmt(out, size, "prompts of a %d-token shared prefix + a distinct %d-token question", o->shared_prefix,
               o->question_tokens);
    else
        cb_fmt(out, size, "distinct prompts of %d tokens", o->prompt_tokens);
    if (o->json_schema) {
        size_t l = strlen(out);
        cb_fmt(out + l, size - l, ", output constrained by the JSON Schema %s%s", o->json_schema_file,
               o->schema_baseline ? " (and unconstrained)" : "");
    }
}

/* The unconstrained row of the same layout, cache and concurrency as a
 * constrained one (--schema-baseline). */
static const struct cb_row *cb_row_baseline(const struct cb_row *r) {
    for (int i = 0; i < cb_n_rows; i++) {
        const struct cb_row *q = &cb_rows[i];
        if (!q->failed && q->constrained == 0 && q->conc == r->conc && q->lay.cache == r->lay.cache &&
            strcmp(q->lay.name, r->lay.name) == 0)
            return q;
    }
    return NULL;
}

/* The row with the same layout and concurrency and the cache as given. */
static const struct cb_row *cb_row_pair(const struct cb_row *r, int cache) {
    for (int i = 0; i < cb_n_rows; i++) {
        const struct cb_row *q = &cb_rows[i];
        if (!q->failed && q->lay.cache == cache && q->conc == r->conc && q->constrained == r->constrained &&
            strcmp(q->lay.name, r->lay.name) == 0)
            return q;
    }
    return NULL;
}

static void cb_print_table(FILE *f, const struct cb_opts *o, const char *model) {
    char wl[PATH_MAX + 256];
    cb_workload(wl, sizeof wl, o);
    bool prefix = o->shared_prefix > 0, open_loop = o->rate > 0;
    char load[160];
    if (open_loop)
        cb_fmt(load, sizeof load, "open loop: Poisson arrivals at %g req/s (seed %d + level), at most conc in flight",
               o->rate, o->seed);
    else
        cb_fmt(load, sizeof load, "closed loop");
    fprintf(f, "\n## bench_cluster: %s, device %s, %s, %d generated (greedy, EOS ignored), %s\n\n", model, o->device,
            wl, o->max_tokens, load);
    bool schema = o->json_schema != NULL;
    fprintf(f, "| layout |%s%s conc |%s requests | req/s | gen tok/s | TTFT p50 ms | TTFT p90 ms | ITL p50 ms | "
               "ITL p90 ms | busy by stage | stage-0 rows/req | steps | tok/step | plan us mean | plan us max | "
               "turnaround us | errors |\n", prefix ? " prefix cache |" : "", schema ? " schema |" : "",
            open_loop ? " rate req/s | capped |" : "");
    fprintf(f, "|---|%s%s---|%s---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|\n", prefix ? "---|" : "",
            schema ? "---|" : "", open_loop ? "---|---|" : "");
    for (int i = 0; i < cb_n_rows; i++) {
        const struct cb_row *r = &cb_rows[i];
        char cache[32] = "";
        if (prefix) cb_fmt(cache, sizeof cache, " %s |", r->lay.cache ? "on" : "off");
        if (schema) {
            size_t l = strlen(cache);
            cb_fmt(cache + l, sizeof cache - l, " %s |", r->failed ? "-" : r->constrained ? "yes" : "no");
        }
        if (r->failed) {
            fprintf(f, "| %s |%s - |%s - | - | - | - | - | - | - | - | - | - | - | - | - | - | did not run: %s |\n",
                    r->lay.name, cache, open_loop ? " - | - |" : "", r->note);
            continue;
        }
        char rate[48] = "";
        if (open_loop) cb_fmt(rate, sizeof rate, " %g | %d |", r->rate, r->n_capped);
        char errs[64], busy[24 * 8] = "", rows[32];
        if (r->n_err || r->n_short)
            cb_fmt(errs, sizeof errs, "%d failed, %d short", r->n_err, r->n_short);
        else
            cb_fmt(errs, sizeof errs, "0");
        for (int st = 0; st < r->lay.stages && st < 8; st++) {
            double b = cb_stage_busy(r, st);
            size_t l = strlen(busy);
            if (b >= 0) cb_fmt(busy + l, sizeof busy - l, "%s%.2f", st ? "/" : "", b);
            else cb_fmt(busy + l, sizeof busy - l, "%s-", st ? "/" : "");
        }
        if (r->lay.stages > 8) cb_fmt(busy + strlen(busy), sizeof busy - strlen(busy), "/...");
        int n_done = r->n_ok + r->n_err + r->n_short;
        if (r->rows0 >= 0 && n_done > 0) cb_fmt(rows, sizeof rows, "%.0f", r->rows0 / n_done);
        else cb_fmt(rows, sizeof rows, "-");
        fprintf(f,
                "| %s |%s %d |%s %d | %.2f | %.1f | %.1f | %.1f | %.2f | %.2f | %s | %s | %llu | %.1f | %.1f | %.1f | "
                "%.1f | %s |\n",
                r->lay.name, cache, r->conc, rate, n_done, r->req_s, r->tok_s, r->ttft50, r->ttft90, r->itl50, r->itl90,
                busy, rows, (unsigned long long)r->steps, r->steps ? (double)r->tokens / (double)r->steps : 0.0,
                r->plan_mean, r->plan_max, r->turn_mean, errs);
    }
    if (open_loop)
        fprintf(f, "\nrate: arrivals per second, level k of a layout drawn from seed %d + k as serve-bench --rate "
                   "--seed draws them; capped: arrivals that found every stream (conc) busy and were sent when one "
                   "ended.  TTFT counts from the send.\n", o->seed);
    fprintf(f, "\nlayout: PIPELINESxSTAGES, s: NCCL over sockets only.  busy by stage: step time over wall time "
               "per stage (mean over pipelines; after the first stage it includes the wait for the previous "
               "stage's hidden states).\nstage-0 rows/req: token rows the first stage computed per request "
               "(prompt not found in a cache + generated).  plan us: the router's time to plan and send one step "
               "(mean over this level; max since the cluster started).\nturnaround us: from a step's result "
               "arriving to the next plans sent.  tok/step: generated tokens per router step.\n");
    if (schema && o->schema_baseline) {
        fprintf(f, "\n### JSON-schema constrained against unconstrained (same cluster)\n\n");
        fprintf(f, "| layout |%s conc | gen tok/s unconstrained | gen tok/s constrained | tok/s constrained/unconstrained | "
                   "ITL p50 ms unconstrained | ITL p50 ms constrained |\n|---|%s---|---|---|---|---|---|\n",
                prefix ? " prefix cache |" : "", prefix ? "---|" : "");
        for (int i = 0; i < cb_n_rows; i++) {
            const struct cb_row *on = &cb_rows[i], *off;
            if (on->failed || on->constrained != 1 || !(off = cb_row_baseline(on))) continue;
            char cache[16] = "";
            if (prefix) cb_fmt(cache, sizeof cache, " %s |", on->lay.cache ? "on" : "off");
            fprintf(f, "| %s |%s %d | %.1f | %.1f | %.3f | %.2f | %.2f |\n", on->lay.name, cache, on->conc, off->tok_s,
                    on->tok_s, off->tok_s > 0 ? on->tok_s / off->tok_s : 0.0, off->itl50, on->itl50);
        }
    }
    if (prefix) {
        fprintf(f, "\n### shared prefix: prefix cache on against off\n\n");
        fprintf(f, "| layout | conc | TTFT p50 ms off | TTFT p50 ms on | TTFT off/on | gen tok/s off | gen tok/s on | "
                   "tok/s on/off |\n|---|---|---|---|---|---|---|---|\n");
        for (int i = 0; i < cb_n_rows; i++) {
            const struct cb_row *on = &cb_rows[i], *off;
            if (on->failed || on->lay.cache != 1 || on->constrained == 0 || !(off = cb_row_pair(on, 0))) continue;
            fprintf(f, "| %s | %d | %.1f | %.1f | %.2f | %.1f | %.1f | %.2f |\n", on->lay.name, on->conc, off->ttft50,
                    on->ttft50, on->ttft50 > 0 ? off->ttft50 / on->ttft50 : 0.0, off->tok_s, on->tok_s,
                    off->tok_s > 0 ? on->tok_s / off->tok_s : 0.0);
        }
    }
    fflush(f);
}

static void cb_json_str(FILE *f, const char *s) {
    fputc('"', f);
    for (const unsigned char *p = (const unsigned char *)s; *p; p++) {
        if (*p == '"' || *p == '\\') fprintf(f, "\\%c", *p);
        else if (*p < 0x20) fprintf(f, "\\u%04x", *p);
        else fputc(*p, f);
    }
    fputc('"', f);
}

/* A number, or null for what was not measured (< 0). */
static void cb_json_num(FILE *f, double v) {
    if (v >= 0) fprintf(f, "%.6g", v);
    else fputs("null", f);
}

static int cb_write_json(const char *path, const struct cb_opts *o, const char *model, char *err, size_t errlen) {
    FILE *f = fopen(path, "w");
    if (!f) {
        cb_fmt(err, errlen, "--json %s: %s", path, strerror(errno));
        return STATUS_IO;
    }
    fputs("{\n  \"model\": ", f);
    cb_json_str(f, model);
    fputs(",\n  \"device\": ", f);
    cb_json_str(f, o->device);
    fputs(",\n  \"json_schema\": ", f);
    if (o->json_schema) cb_json_str(f, o->json_schema_file);
    else fputs("null", f);
    fprintf(f, ",\n  \"workload\": \"%s\",\n  \"prompt_tokens\": %d,\n  \"shared_prefix\": %d,\n  "
               "\"question_tokens\": %d,\n  \"max_tokens\": %d,\n  \"rate\": ",
            o->shared_prefix > 0 ? "shared-prefix" : "distinct", cb_prompt_len(o), o->shared_prefix > 0 ? o->shared_prefix : 0,
            o->shared_prefix > 0 ? o->question_tokens : 0, o->max_tokens);
    /* rate and seed null: the closed loop. */
    if (o->rate > 0) fprintf(f, "%.6g,\n  \"seed\": %d,\n  \"rows\": [", o->rate, o->seed);
    else fputs("null,\n  \"seed\": null,\n  \"rows\": [", f);
    for (int i = 0; i < cb_n_rows; i++) {
        const struct cb_row *r = &cb_rows[i];
        fprintf(f, "%s\n    {\"layout\": ", i ? "," : "");
        cb_json_str(f, r->lay.name);
        fprintf(f, ", \"pipelines\": %d, \"stages\": %d, \"nccl_sockets\": %s, \"prefix_cache\": %s, "
                   "\"constrained\": %s, \"ran\": %s", r->lay.pipelines, r->lay.stages, r->lay.sockets ? "true" : "false",
                r->lay.cache < 0 ? "null" : r->lay.cache ? "true" : "false",
                r->constrained < 0 ? "null" : r->constrained ? "true" : "false", r->failed ? "false" : "true");
        if (r->failed) {
            fputs(", \"error\": ", f);
            cb_json_str(f, r->note);
            fputs("}", f);
            continue;
        }
        fprintf(f, ", \"concurrency\": %d, \"requests\": %d, \"ok\": %d, \"failed\": %d, \"short\": %d, "
                   "\"wall_s\": %.6g, \"req_s\": %.6g, \"tok_s\": %.6g, \"ttft_p50_ms\": %.6g, \"ttft_p90_ms\": "
                   "%.6g, \"itl_p50_ms\": %.6g, \"itl_p90_ms\": %.6g, \"steps\": %llu, \"tokens\": %llu, "
                   "\"plan_us_mean\": %.6g, \"plan_us_max\": %.6g, \"turnaround_us_mean\": %.6g, \"stage0_rows\": ",
                r->conc, r->n_req, r->n_ok, r->n_err, r->n_short, r->wall_s, r->req_s, r->tok_s, r->ttft50,
                r->ttft90, r->itl50, r->itl90, (unsigned long long)r->steps, (unsigned long long)r->tokens,
                r->plan_mean, r->plan_max, r->turn_mean);
        cb_json_num(f, r->rows0);
        if (r->rate > 0)
            fprintf(f, ", \"rate\": %.6g, \"arrival_seed\": %d, \"capped\": %d, \"cap_wait_ms_mean\": %.6g", r->rate,
                    r->seed, r->n_capped, r->cap_wait_ms);
        else
            fputs(", \"rate\": null, \"arrival_seed\": null, \"capped\": null, \"cap_wait_ms_mean\": null", f);
        fputs(", \"busy_by_stage\": [", f);
        for (int st = 0; st < r->lay.stages; st++) {
            if (st) fputs(", ", f);
            cb_json_num(f, cb_stage_busy(r, st));
        }
        fputs("], \"busy_by_worker\": [", f);
        for (int w = 0; w < r->lay.pipelines * r->lay.stages && w < CB_WORKERS_MAX; w++) {
            fprintf(f, "%s{\"pipeline\": %d, \"stage\": %d, \"busy\": ", w ? ", " : "", w / r->lay.stages,
                    w % r->lay.stages);
            cb_json_num(f, r->busy[w]);
            fputs("}", f);
        }
        fputs("]", f);
        if (r->note[0]) {
            fputs(", \"first_problem\": ", f);
            cb_json_str(f, r->note);
        }
        fputs("}", f);
    }
    fputs("\n  ]", f);
    if (o->json_schema && o->schema_baseline) {
        fputs(",\n  \"constrained_vs_unconstrained\": [", f);
        int k = 0;
        for (int i = 0; i < cb_n_rows; i++) {
            const struct cb_row *on = &cb_rows[i], *off;
            if (on->failed || on->constrained != 1 || !(off = cb_row_baseline(on))) continue;
            fprintf(f, "%s\n    {\"layout\": ", k++ ? "," : "");
            cb_json_str(f, on->lay.name);
            fprintf(f, ", \"prefix_cache\": %s, \"concurrency\": %d, \"tok_s_unconstrained\": %.6g, "
                       "\"tok_s_constrained\": %.6g, \"throughput_ratio\": %.6g, \"itl_p50_ms_unconstrained\": %.6g, "
                       "\"itl_p50_ms_constrained\": %.6g}",
                    on->lay.cache < 0 ? "null" : on->lay.cache ? "true" : "false", on->conc, off->tok_s, on->tok_s,
                    off->tok_s > 0 ? on->tok_s / off->tok_s : 0.0, off->itl50, on->itl50);
        }
        fputs("\n  ]", f);
    }
    if (o->shared_prefix > 0) {
        fputs(",\n  \"prefix_cache\": [", f);
        int k = 0;
        for (int i = 0; i < cb_n_rows; i++) {
            const struct cb_row *on = &cb_rows[i], *off;
            if (on->failed || on->lay.cache != 1 || on->constrained == 0 || !(off = cb_row_pair(on, 0))) continue;
            fprintf(f, "%s\n    {\"layout\": ", k++ ? "," : "");
            cb_json_str(f, on->lay.name);
            fprintf(f, ", \"concurrency\": %d, \"ttft_p50_ms_off\": %.6g, \"ttft_p50_ms_on\": %.6g, "
                       "\"ttft_ratio\": %.6g, \"tok_s_off\": %.6g, \"tok_s_on\": %.6g, \"throughput_ratio\": %.6g}",
                    on->conc, off->ttft50, on->ttft50, on->ttft50 > 0 ? off->ttft50 / on->ttft50 : 0.0, off->tok_s,
                    on->tok_s, off->tok_s > 0 ? on->tok_s / off->tok_s : 0.0);
        }
        fputs("\n  ]", f);
    }
    fputs("\n}\n", f);
    if (fclose(f) != 0) {
        cb_fmt(err, errlen, "--json %s: %s", path, strerror(errno));
        return STATUS_IO;
    }
    return STATUS_OK;
}

/* ---- main ---- */

int main(int argc, char **argv) {
    struct cb_opts o;
    memset(&o, 0, sizeof o);
    const struct option_def defs[] = {
        {"model", "LLM_MODEL", OPTION_STRING, NULL, "GGUF file or HF directory; none: a synthetic --shape model",
         &o.model, 0, 0, NULL},
        {"shape", NULL, OPTION_STRING, "100m", "synthetic model shape (worker/synth.h presets)", &o.shape, 0, 0,
         NULL},
        {"type", NULL, OPTION_STRING, "f16", "synthetic model weight types", &o.type, 0, 0, NULL},
        {"stages", NULL, OPTION_STRING, "1,2", "stages per pipeline to measure, comma-separated", &o.stages, 0, 0,
         NULL},
        {"pipelines", NULL, OPTION_STRING, "1", "pipelines to measure, comma-separated", &o.pipelines, 0, 0, NULL},
        {"layouts", NULL, OPTION_STRING, "", "clusters as PIPELINESxSTAGES[s], comma-separated (\"1x1,1x2,1x2s,2x1\"; "
         "s: NCCL over sockets only); replaces --pipelines x --stages", &o.layouts, 0, 0, NULL},
        {"concurrency", NULL, OPTION_STRING, "1,4,16,64", "requests in flight, comma-separated", &o.concurrency, 0,
         0, NULL},
        {"requests", NULL, OPTION_INT, "0", "requests per level (0: two per stream, at least 8)", &o.requests, 0,
         1000000, NULL},
        {"prompt-tokens", NULL, OPTION_INT, "128", "prompt length in tokens", &o.prompt_tokens, 1, 1 << 20, NULL},
        {"shared-prefix", NULL, OPTION_INT, "0", "the shared-prefix workload: every prompt starts with the same "
         "N tokens (a system prompt) and each layout runs with the router's prefix cache on and off", &o.shared_prefix,
         0, 1 << 20, NULL},
        {"question-tokens", NULL, OPTION_INT, "32", "with --shared-prefix: each request's own tokens after the "
         "prefix", &o.question_tokens, 1, 1 << 20, NULL},
        {"no-cache-arg", NULL, OPTION_STRING, "--no-prefix-cache", "with --shared-prefix: the llm-router argument "
         "that turns its prefix cache off", &o.no_cache_arg, 0, 0, NULL},
        {"max-tokens", NULL, OPTION_INT, "64", "tokens generated per request", &o.max_tokens, 1, 1 << 20, NULL},
        {"rate", NULL, OPTION_FLOAT, "0", "open loop: requests arrive as a Poisson process of R per second, sent by "
         "the level's --concurrency streams (an arrival that finds all busy waits for one); 0: closed loop, each "
         "stream sends its next request when the last ends", &o.rate, 0, 1e6, NULL},
        {"seed", NULL, OPTION_INT, "1", "with --rate: level k of each layout draws its arrivals from seed N + k, as "
         "serve-bench --rate --seed N + k does", &o.seed, 0, INT_MAX / 2, NULL},
        {"warmup", NULL, OPTION_INT, "1", "requests sent one by one before the first level", &o.warmup, 0, 1000,
         NULL},
        {"device", NULL, OPTION_STRING, "cpu", "llm-cluster --device: cpu, or auto (one GPU per worker)", &o.device,
         0, 0, NULL},
        {"threads", NULL, OPTION_INT, "0", "CPU threads per worker (0: llm-cluster shares the cores out)",
         &o.threads, 0, 1024, NULL},
        {"kv-blocks", NULL, OPTION_INT, "0", "KV blocks per worker (0: the worker's default)", &o.kv_blocks, 0,
         1 << 24, NULL},
        {"up-timeout-s", NULL, OPTION_INT, "300", "give up on a cluster not in service by then", &o.up_timeout_s, 1,
         86400, NULL},
        {"up-tries", NULL, OPTION_INT, "2", "attempts to start each cluster", &o.up_tries, 1, 100, NULL},
        {"cluster", NULL, OPTION_STRING, NULL, "the llm-cluster program (default: found next to this one)",
         &o.cluster, 0, 0, NULL},
        {"router-args", NULL, OPTION_STRING, "", "extra llm-router arguments, space-separated", &o.router_args, 0,
         0, NULL},
        {"worker-args", NULL, OPTION_STRING, "", "extra llm-worker arguments, space-separated", &o.worker_args, 0,
         0, NULL},
        {"log-level", NULL, OPTION_STRING, "info", "log level of the cluster's processes (info or lower: the "
         "workers' metrics ports are read from their logs)", &o.log_level, 0, 0, NULL},
        {"insecure", NULL, OPTION_BOOL, "false", "llm-cluster up --insecure: no CURVE keys", &o.insecure, 0, 0,
         NULL},
        {"json", NULL, OPTION_STRING, NULL, "also write the results as JSON to this file", &o.json, 0, 0, NULL},
        {"json-schema", NULL, OPTION_STRING, NULL, "constrain every request's output by this JSON Schema file "
         "(docs/grammar.md; the last stage masks each step); EOS is still ignored, so pick a schema whose "
         "output outlasts --max-tokens (bench/schemas/records.json)", &o.json_schema_file, 0, 0, NULL},
        {"schema-baseline", NULL, OPTION_BOOL, "false", "with --json-schema: run each level unconstrained first, "
         "then constrained, on the same cluster, and compare them", &o.schema_baseline, 0, 0, NULL},
        {"tmpdir", "TMPDIR", OPTION_STRING, "/tmp", "where the synthetic model and run dirs go", &o.tmpdir, 0, 0,
         NULL},
        {"run-root", NULL, OPTION_STRING, NULL, "keep each cluster's run dir (logs) under this folder",
         &o.run_root, 0, 0, NULL},
    };
    struct options opts = {"bench_cluster", "[options]",
                           "Starts a cluster per layout with llm-cluster and measures throughput and latency at "
                           "several concurrency levels through libllmclient.",
                           defs, (int)(sizeof defs / sizeof defs[0]), false};
    char err[1024];
    int rc = options_parse(&opts, &argc, argv, err, sizeof err);
    if (rc == STATUS_CANCELLED) return 0;
    if (rc == STATUS_OK && argc > 1) {
        cb_fmt(err, sizeof err, "unexpected argument \"%s\"", argv[1]);
        rc = STATUS_BAD_INPUT;
    }
    if (rc == STATUS_OK) rc = cb_parse_lists(&o, err, sizeof err);
    if (rc == STATUS_OK && o.json_schema_file) rc = cb_read_schema(&o, err, sizeof err);
    if (rc == STATUS_OK && o.schema_baseline && !o.json_schema_file) {
        cb_fmt(err, sizeof err, "--schema-baseline compares with --json-schema FILE, which is not given");
        rc = STATUS_BAD_INPUT;
    }
    char cluster[PATH_MAX];
    if (rc == STATUS_OK) {
        if (o.cluster) {
            cb_fmt(cluster, sizeof cluster, "%s", o.cluster);
            if (access(cluster, X_OK) != 0) {
                cb_fmt(err, sizeof err, "--cluster %s: not an executable: %s", o.cluster, strerror(errno));
                rc = STATUS_NOT_FOUND;
            }
        } else {
            rc = cb_find_cluster(cluster, sizeof cluster, err, sizeof err);
        }
    }
    if (rc != STATUS_OK) {
        fprintf(stderr, "bench_cluster: %s\n", err);
        return 2;
    }
    log_set_level(LL_WARN);
    struct sigaction sa;
    memset(&sa, 0, sizeof sa);
    sa.sa_handler = cb_on_signal;
    sigaction(SIGTERM, &sa, NULL);
    sigaction(SIGINT, &sa, NULL);
    signal(SIGPIPE, SIG_IGN);

    char tmp[PATH_MAX];
    cb_fmt(tmp, sizeof tmp, "%s/bench_cluster_XXXXXX", o.tmpdir);
    if (!mkdtemp(tmp)) {
        fprintf(stderr, "bench_cluster: --tmpdir %s: cannot create a folder: %s\n", o.tmpdir, strerror(errno));
        return 1;
    }
    char model[PATH_MAX + 64], model_name[128];
    if (o.model) {
        if (!realpath(o.model, model)) {
            fprintf(stderr, "bench_cluster: --model %s: %s\n", o.model, strerror(errno));
            rmdir(tmp);
            return 1;
        }
        const char *slash = strrchr(model, '/');
        cb_fmt(model_name, sizeof model_name, "%s", slash ? slash + 1 : model);
    } else {
        struct synth_config sc;
        memset(&sc, 0, sizeof sc);
        synth_shape_preset(o.shape, &sc.shape);
        sc.type = o.synth_type;
        sc.seed = 1;
        cb_fmt(model, sizeof model, "%s/%s-%s.gguf", tmp, o.shape, o.type);
        cb_fmt(model_name, sizeof model_name, "synthetic %s %s", o.shape, o.type);
        double t0 = cb_now();
        if (synth_write(&sc, model, err, sizeof err) != STATUS_OK) {
            fprintf(stderr, "bench_cluster: writing the synthetic model %s: %s\n", model, err);
            cb_rmtree(tmp);
            return 1;
        }
        struct stat st;
        fprintf(stderr, "bench_cluster: wrote %s (%.1f MB) in %.1f s\n", model,
                stat(model, &st) == 0 ? (double)st.st_size / 1e6 : 0.0, cb_now() - t0);
    }
    char run_root[PATH_MAX];
    if (o.run_root) {
        if (mkdir(o.run_root, 0755) != 0 && errno != EEXIST) {
            fprintf(stderr, "bench_cluster: --run-root %s: %s\n", o.run_root, strerror(errno));
            cb_rmtree(tmp);
            return 1;
        }
        if (!realpath(o.run_root, run_root)) {
            fprintf(stderr, "bench_cluster: --run-root %s: %s\n", o.run_root, strerror(errno));
            cb_rmtree(tmp);
            return 1;
        }
    } else {
        cb_fmt(run_root, sizeof run_root, "%s/runs", tmp);
        mkdir(run_root, 0755);
    }

    int failed = 0;
    cb_keys_save();
    for (int li = 0; li < o.n_layouts && !cb_stop; li++) {
        const struct cb_layout *lay = &o.lay[li];
        int n_before = cb_n_rows;
        rc = cb_layout(&o, cluster, model, run_root, lay, err, sizeof err);
        if (rc < 0) {
            fprintf(stderr, "bench_cluster: %s: %s\n", lay->name, err);
            failed = 1;
            if (cb_n_rows == n_before) {
                struct cb_row *r = cb_row_add(lay, 0);
                if (r) {
                    r->failed = true;
                    cb_fmt(r->note, sizeof r->note, "%s", err);
                }
            }
        }
    }
    for (int i = 0; i < cb_n_rows; i++)
        if (cb_rows[i].n_err || cb_rows[i].n_short) failed = 1;
    if (cb_stop) {
        fprintf(stderr, "bench_cluster: stopped by a signal; the table has the rows measured so far\n");
        failed = 1;
    }
    cb_print_table(stdout, &o, model_name);
    if (o.json && cb_write_json(o.json, &o, model_name, err, sizeof err) != STATUS_OK) {
        fprintf(stderr, "bench_cluster: %s\n", err);
        failed = 1;
    }
    if (failed && !o.run_root) {
        /* Keep the logs, not the synthetic model written into tmp; a model
         * the user gave is never touched. */
        if (!o.model) unlink(model);
        fprintf(stderr, "bench_cluster: kept the run dirs (logs) under %s\n", run_root);
    } else {
        cb_rmtree(tmp);
    }
    free(o.json_schema);
    return failed;
}
