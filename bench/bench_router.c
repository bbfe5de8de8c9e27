/* bench_router: how many pipelines one router can drive (docs/router.md,
 * "Capacity").  For each pipeline count it starts a private redis-server,
 * a real llm-router and one sim_worker process playing pipelines x stages
 * workers that answer plans at once with synthetic tokens (no model, no
 * compute), then keeps pipelines x --seqs requests in flight from one
 * client socket (each request re-sent as a new one when it ends), so every
 * pipeline always has work.  With --rate R the load is an open loop
 * instead: requests arrive as a Poisson process of R per second (level k
 * of --pipelines drawn from --seed + k, as bench_cluster --rate --seed
 * draws them, so both can be given the same arrivals); each is sent at its
 * arrival while fewer than pipelines x --seqs are in flight, else when one
 * ends, and one that ends is not replaced.  After a warm-up (arrivals run
 * through it and the window alike) it measures a window:
 *
 *   steps/s        results the last stages sent, in all and per pipeline
 *                  (mean, and the slowest pipeline)
 *   plan           the router's planning time per step (Status: the
 *                  window's mean from the running mean and step count, and
 *                  the largest since start)
 *   turnaround     the router's answer time as a last stage sees it: from
 *                  sending a result to the next plan of that pipeline
 *                  (p50, p99; includes the plan, the sockets and whatever
 *                  else the router's loop was doing)
 *   tok/s          generated tokens the client received in the window
 *   req/s          requests that ended in the window; in the open loop
 *                  the JSON's capped counts the window's arrivals that
 *                  found every slot busy
 *   TTFT, ITL      as the client sees them, from the chunks that arrive in
 *                  the window: a request's first chunk gives its time to
 *                  first token (from its send, which may be in the
 *                  warm-up; in the open loop from its arrival, so a wait
 *                  for a free slot counts), each later chunk of k tokens
 *                  after a gap g k inter-token samples of g / k (TTFT p50,
 *                  p90; ITL p50, p90, p99, in ms).  With --sim-args
 *                  "--step-ms ..." the steps take a time that grows with
 *                  their tokens, so these compare the router's scheduling
 *                  choices without a GPU
 *   CPU            router, redis-server, sim_worker and this program, from
 *                  /proc/<pid>/stat, as a fraction of one core
 *   prefix hits    the prompt tokens the router's prefix cache found at
 *                  admissions in the window, as a share of those it found
 *                  and computed (Status; "off" under --no-prefix-cache)
 *
 * Prompts are distinct per request, or with --shared-prefix N all start
 * with the same N ids (a system prompt) and end in --question-tokens ids of
 * their own, so two runs, one with --router-args --no-prefix-cache, show
 * what the cache saves.
 * and prints a table and (--json) the same rows as JSON.  Everything runs on
 * this machine, so the router shares its cores with the simulated workers
 * and the client: the CPU columns say who used what.
 *
 *   bench_router --pipelines 1,2,4,8,16,32,64,128,256 --seqs 4 --json router.json
 *   bench_router --pipelines 1 --seqs 64 --rate 30 --sim-args "--step-ms 1:2.3,640:25.4"
 *   bench_router --pipelines 1 --seqs 16 --shared-prefix 1024 --question-tokens 32 [--router-args --no-prefix-cache] */
#include "clients/c/client.h"
#include "worker/synth.h"

#include "common/log.h"
#include "common/options.h"
#include "common/status.h"
#include "common/zio.h"
#include "proto/wire.h"

#include <errno.h>
#include <fcntl.h>
#include <inttypes.h>
#include <limits.h>
#include <math.h>
#include <signal.h>
#include <spawn.h>
#include <stdarg.h>
#include <stdbool.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <sys/wait.h>
#include <time.h>
#include <unistd.h>
#include <zmq.h>

extern char **environ;

#define BR_LIST_MAX 16

static volatile sig_atomic_t br_stop;
static void br_on_signal(int sig) {
    (void)sig;
    br_stop = 1;
}

static double br_now(void) {
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (double)ts.tv_sec + (double)ts.tv_nsec * 1e-9;
}

static void br_sleep_ms(int ms) {
    struct timespec ts = {ms / 1000, (long)(ms % 1000) * 1000000L};
    while (nanosleep(&ts, &ts) != 0 && errno == EINTR && !br_stop) {}
}

static void br_fmt(char *out, size_t size, const char *fmt, ...) __attribute__((format(printf, 3, 4)));
static void br_fmt(char *out, size_t size, const char *fmt, ...) {
    va_list ap;
    va_start(ap, fmt);
    vsnprintf(out, size, fmt, ap);
    va_end(ap);
}

/* ---- Processes ---- */

struct br_proc {
    const char *name;
    pid_t pid;
    char log[512];
};

/* Starts argv with stdout and stderr in p->log. */
static int br_spawn(struct br_proc *p, char *const argv[], char *err, size_t errlen) {
    posix_spawn_file_actions_t fa;
    posix_spawn_file_actions_init(&fa);
    posix_spawn_file_actions_addopen(&fa, 0, "/dev/null", O_RDONLY, 0);
    posix_spawn_file_actions_addopen(&fa, 1, p->log, O_WRONLY | O_CREAT | O_TRUNC, 0644);
    posix_spawn_file_actions_adddup2(&fa, 1, 2);
    int e = posix_spawn(&p->pid, argv[0], &fa, NULL, argv, environ);
    posix_spawn_file_actions_destroy(&fa);
    if (e != 0) {
        p->pid = 0;
        br_fmt(err, errlen, "cannot start %s: %s", argv[0], strerror(e));
        return STATUS_IO;
    }
    return 0;
}

static bool br_alive(struct br_proc *p) {
    if (p->pid <= 0) return false;
    int st;
    if (waitpid(p->pid, &st, WNOHANG) == p->pid) {
        p->pid = 0;
        return false;
    }
    return true;
}

/* SIGTERM, then SIGKILL after 5 s. */
static void br_stop_proc(struct br_proc *p) {
    if (p->pid <= 0) return;
    kill(p->pid, SIGTERM);
    double end = br_now() + 5;
    for (;;) {
        int st;
        pid_t r = waitpid(p->pid, &st, WNOHANG);
        if (r == p->pid || (r < 0 && errno == ECHILD)) break;
        if (br_now() > end) {
            kill(p->pid, SIGKILL);
            waitpid(p->pid, &st, 0);
            break;
        }
        br_sleep_ms(10);
    }
    p->pid = 0;
}

static void br_tail(const char *path) {
    FILE *f = fopen(path, "r");
    if (!f) return;
    char lines[8][512];
    int n = 0;
    while (fgets(lines[n % 8], sizeof lines[0], f)) n++;
    fclose(f);
    fprintf(stderr, "  ---- %s, last lines:\n", path);
    for (int i = n > 8 ? n - 8 : 0; i < n; i++) fprintf(stderr, "  %s", lines[i % 8]);
}

/* CPU seconds of a process (utime + stime), or -1. */
static double br_cpu_s(pid_t pid) {
    char path[64], buf[2048];
    snprintf(path, sizeof path, "/proc/%d/stat", (int)pid);
    FILE *f = fopen(path, "r");
    if (!f) return -1;
    size_t n = fread(buf, 1, sizeof buf - 1, f);
    fclose(f);
    buf[n] = 0;
    /* Fields after the command, which is in parentheses and may hold spaces. */
    char *p = strrchr(buf, ')');
    if (!p) return -1;
    unsigned long ut = 0, st = 0;
    if (sscanf(p + 2, "%*c %*d %*d %*d %*d %*d %*u %*u %*u %*u %*u %lu %lu", &ut, &st) != 2) return -1;
    return (double)(ut + st) / (double)sysconf(_SC_CLK_TCK);
}

static double br_self_cpu_s(void) {
    struct timespec ts;
    clock_gettime(CLOCK_PROCESS_CPUTIME_ID, &ts);
    return (double)ts.tv_sec + (double)ts.tv_nsec * 1e-9;
}

/* Whether a program's --help mentions flag (the router takes --insecure
 * only where it has CURVE keys to leave out). */
static bool br_knows_flag(const char *bin, const char *flag) {
    char cmd[PATH_MAX + 32];
    br_fmt(cmd, sizeof cmd, "'%s' --help 2>&1", bin);
    FILE *f = popen(cmd, "r");
    if (!f) return false;
    char line[1024];
    bool found = false;
    while (fgets(line, sizeof line, f))
        if (strstr(line, flag)) found = true;
    pclose(f);
    return found;
}

/* ---- Options ---- */

struct br_opts {
    const char *model, *pipelines, *router_bin, *sim_bin, *redis_bin, *router_args, *sim_args, *json, *tmpdir;
    int stages, seqs, prompt_tokens, max_tokens, step_us, warmup_s, seconds, up_timeout_s;
    int shared_prefix, question_tokens; /* the shared-prefix workload when shared_prefix > 0 */
    double rate; /* open loop: Poisson arrivals per second; 0: the closed loop */
    int seed;    /* level k draws its arrivals from seed + k */
    int pipe_v[BR_LIST_MAX], n_pipes;
    bool router_insecure; /* the router has CURVE: run it with --insecure */
};

/* Tokens of every prompt: the shared prefix and a question, or --prompt-tokens. */
static int br_prompt_len(const struct br_opts *o) {
    return o->shared_prefix > 0 ? o->shared_prefix + o->question_tokens : o->prompt_tokens;
}

static int br_parse_list(const char *s, int *v, char *err, size_t errlen) {
    char buf[256];
    br_fmt(buf, sizeof buf, "%s", s);
    int n = 0;
    for (char *save = NULL, *t = strtok_r(buf, ",", &save); t; t = strtok_r(NULL, ",", &save)) {
        char *end = NULL;
        long x = strtol(t, &end, 10);
        if (n == BR_LIST_MAX || end == t || *end || x < 1 || x > 4096) {
            br_fmt(err, errlen, "--pipelines: \"%s\" is not a list of at most %d integers in [1, 4096]", s,
                   BR_LIST_MAX);
            return STATUS_BAD_INPUT;
        }
        v[n++] = (int)x;
    }
    if (n == 0) {
        br_fmt(err, errlen, "--pipelines: empty list");
        return STATUS_BAD_INPUT;
    }
    return n;
}

/* ---- One level ---- */

struct br_row {
    int pipelines, stages, conc;
    double rate;    /* arrivals per second; 0: closed loop */
    uint32_t seed;  /* of the arrivals */
    uint64_t capped; /* arrivals in the window that found every slot busy */
    double window_s;
    double steps_s, steps_s_pipe, steps_s_pipe_min, tok_s, req_s;
    double plan_mean_us, plan_max_us, router_turn_mean_us;
    unsigned turn_p50, turn_p90, turn_p99, turn_max;
    double cpu_router, cpu_redis, cpu_sim, cpu_client;
    double ttft_p50, ttft_p90, itl_p50, itl_p90, itl_p99; /* ms, as the client saw them */
    uint64_t ttft_n, itl_n;                               /* samples behind them */
    uint64_t requests_done, errors;
    bool prefix_cache;                                    /* the router's, as its Status says */
    uint64_t prefix_hit_tokens, prefix_miss_tokens;       /* at admissions in the window */
    char note[256];
};

/* The figures sim_worker wrote (a flat JSON object of numbers). */
struct br_sim_stats {
    double snapshot, window_s, results, tokens, steps_min, steps_max, turn_n, p50, p90, p99, max, cpu_s;
};

static double br_json_num(const char *buf, const char *key) {
    char k[64];
    snprintf(k, sizeof k, "\"%s\":", key);
    const char *p = strstr(buf, k);
    return p ? strtod(p + strlen(k), NULL) : 0;
}

static int br_sim_read(const char *path, struct br_sim_stats *st) {
    FILE *f = fopen(path, "r");
    if (!f) return STATUS_NOT_FOUND;
    char buf[2048];
    size_t n = fread(buf, 1, sizeof buf - 1, f);
    fclose(f);
    buf[n] = 0;
    st->snapshot = br_json_num(buf, "snapshot");
    st->window_s = br_json_num(buf, "window_s");
    st->results = br_json_num(buf, "results");
    st->tokens = br_json_num(buf, "tokens");
    st->steps_min = br_json_num(buf, "pipeline_steps_min");
    st->steps_max = br_json_num(buf, "pipeline_steps_max");
    st->turn_n = br_json_num(buf, "turnaround_n");
    st->p50 = br_json_num(buf, "turnaround_us_p50");
    st->p90 = br_json_num(buf, "turnaround_us_p90");
    st->p99 = br_json_num(buf, "turnaround_us_p99");
    st->max = br_json_num(buf, "turnaround_us_max");
    st->cpu_s = br_json_num(buf, "cpu_s");
    return 0;
}

/* Asks sim_worker for a snapshot and waits for snapshot number want. */
static int br_sim_snapshot(struct br_proc *sim, const char *path, int want, struct br_sim_stats *st) {
    kill(sim->pid, SIGUSR1);
    for (int i = 0; i < 500; i++) {
        if (br_sim_read(path, st) == 0 && (int)st->snapshot == want) return 0;
        br_sleep_ms(10);
    }
    return STATUS_TIMEOUT;
}

struct br_status {
    double plan_mean, plan_max, turn_mean;
    uint64_t steps, prefix_hit_tokens, prefix_miss_tokens;
    bool prefix_cache;
    int ready;
};

static int br_status(llm_client *c, struct br_status *s) {
    Llm__ClientEnvelope *env = NULL;
    int rc = llm_client_status(c, &env);
    if (rc < 0) return rc;
    const Llm__StatusReply *r = env->status_reply;
    s->plan_mean = r->plan_us_mean;
    s->plan_max = r->plan_us_max;
    s->turn_mean = r->turnaround_us_mean;
    s->steps = r->steps_total;
    s->prefix_cache = r->prefix_cache;
    s->prefix_hit_tokens = r->prefix_hit_tokens;
    s->prefix_miss_tokens = r->prefix_miss_tokens;
    s->ready = 0;
    for (size_t i = 0; i < r->n_pipelines; i++) s->ready += r->pipelines[i]->ready;
    proto_client_free(env);
    return 0;
}

/* Latency samples in seconds.  Past BR_SAMPLES_MAX a sample replaces a
 * random one with probability max / seen (reservoir sampling), so a long
 * window at high token rates keeps its memory bounded and its percentiles
 * unbiased. */
#define BR_SAMPLES_MAX (4u << 20)

struct br_samples {
    double *v;
    size_t n, cap;
    uint64_t seen, rng;
};

static void br_sample_add(struct br_samples *s, double x) {
    s->seen++;
    if (s->n < BR_SAMPLES_MAX) {
        if (s->n == s->cap) {
            size_t cap = s->cap ? s->cap * 2 : 4096;
            double *v = realloc(s->v, cap * sizeof *v);
            if (!v) return; /* a sample lost, not the run */
            s->v = v;
            s->cap = cap;
        }
        s->v[s->n++] = x;
        return;
    }
    s->rng ^= s->rng << 13;
    s->rng ^= s->rng >> 7;
    s->rng ^= s->rng << 17;
    uint64_t j = s->rng % s->seen;
    if (j < s->n) s->v[j] = x;
}

static int br_cmp_double(const void *a, const void *b) {
    double x = *(const double *)a, y = *(const double *)b;
    return x < y ? -1 : x > y;
}

/* Nearest-rank percentile (q in (0, 1]) of s in milliseconds; the samples
 * must be sorted.  0 when there are none. */
static double br_pct_ms(const struct br_samples *s, double q) {
    if (s->n == 0) return 0;
    size_t k = (size_t)(q * (double)s->n + 0.999999);
    if (k < 1) k = 1;
    if (k > s->n) k = s->n;
    return s->v[k - 1] * 1e3;
}

/* A request in flight, as the client saw it.  There are conc slots; a
 * request's id and tag name its slot, so replies find it directly. */
struct br_slot {
    uint64_t id;     /* request number + 1; 0: free */
    double t_send;   /* when it was sent (open loop: when it arrived) */
    double t_last;   /* when its last token-bearing chunk came; 0: none yet */
    uint32_t n_tok;  /* completion tokens received */
};

/* The load: conc requests in flight over one DEALER socket; each that ends
 * is replaced by a new one.  In the open loop (rate > 0) requests arrive
 * on their own clock instead and wait in a queue, first come first served,
 * while conc are in flight.  While measuring, each chunk that arrives gives
 * latency samples: its request's first gives a time to first token (from
 * the send, or the arrival in the open loop), a later one of k tokens after
 * a gap g gives k inter-token samples of g / k. */
struct br_load {
    struct zio_sock *sock;
    const struct br_opts *o;
    int level, conc;
    uint64_t next_id, done, errors, tokens;
    int in_flight;
    double rate;            /* arrivals per second; 0: closed loop */
    uint32_t rng;           /* mulberry32 state of the arrival gaps */
    double t_next;          /* the next arrival (monotonic seconds) */
    double *queue;          /* arrival times not yet sent, a ring */
    size_t q_head, q_n, q_cap;
    uint64_t capped;        /* arrivals measured that found every slot busy */
    bool fatal;             /* the router refused a request for good */
    bool measure;           /* take latency samples */
    int32_t *prompt;
    struct br_slot *slots; /* conc of them */
    int32_t *free_slots;   /* a stack of free slot indices */
    int32_t n_free;
    struct br_samples ttft, itl;
    char first_err[200];
};

/* Request number id's slot, or NULL when slot does not hold it. */
static struct br_slot *br_slot_find(struct br_load *L, uint64_t id, uint64_t slot) {
    return slot < (uint64_t)L->conc && L->slots[slot].id == id + 1 ? &L->slots[slot] : NULL;
}

/* A free slot for request number id, or -1 when none is free (a request
 * that ended without the load hearing of it holds its slot: the next goes
 * untimed). */
static int32_t br_slot_take(struct br_load *L, uint64_t id) {
    if (L->n_free == 0) return -1;
    int32_t k = L->free_slots[--L->n_free];
    L->slots[k] = (struct br_slot){id + 1, 0, 0, 0};
    return k;
}

static void br_slot_give(struct br_load *L, uint64_t id, uint64_t slot) {
    struct br_slot *sl = br_slot_find(L, id, slot);
    if (!sl) return;
    sl->id = 0;
    L->free_slots[L->n_free++] = (int32_t)slot;
}

/* A Generate's tag: its slot above its request number (numbers stay far
 * below 2^40). */
#define BR_TAG_SLOT_SHIFT 40

/* The load's request number and slot from a request id it made
 * ("br<level>-<n>-<pid>-<slot>"); false for any other id. */
static bool br_parse_rid(const struct br_load *L, const char *rid, uint64_t *id, uint64_t *slot) {
    unsigned long long n, k;
    int level, pid, used = 0;
    if (!rid || sscanf(rid, "br%d-%llu-%d-%llu%n", &level, &n, &pid, &k, &used) != 4 || rid[used] ||
        level != L->level || pid != (int)getpid())
        return false;
    *id = (uint64_t)n;
    *slot = (uint64_t)k;
    return true;
}

static void br_on_chunk(struct br_load *L, const Llm__GenerateChunk *ch, double now) {
    uint64_t id, slot;
    if (ch->n_token_ids == 0 || !br_parse_rid(L, ch->request_id, &id, &slot)) return;
    struct br_slot *sl = br_slot_find(L, id, slot);
    /* A chunk whose tokens the client has (docs/protocol.md) says nothing new. */
    uint32_t end = ch->index + (uint32_t)ch->n_token_ids;
    if (!sl || end <= sl->n_tok) return;
    uint32_t fresh = end - (ch->index > sl->n_tok ? ch->index : sl->n_tok);
    if (L->measure) {
        if (sl->t_last == 0) br_sample_add(&L->ttft, now - sl->t_send);
        else {
            double gap = (now - sl->t_last) / (double)fresh;
            for (uint32_t k = 0; k < fresh; k++) br_sample_add(&L->itl, gap);
        }
    }
    sl->n_tok = end;
    sl->t_last = now;
}

/* n ids drawn from key into ids, all in 300..399: inside the synthetic
 * model's vocabulary of 512 and any real one's, away from the low ids where
 * models keep their special tokens. */
static void br_prompt_ids(uint64_t key, int32_t *ids, int n) {
    uint64_t x = 0x9e3779b97f4a7c15ULL * (key + 1);
    for (int i = 0; i < n; i++) {
        x ^= x >> 12;
        x ^= x << 25;
        x ^= x >> 27;
        ids[i] = 300 + (int32_t)((x * 0x2545f4914f6cdd1dULL >> 33) % 100);
    }
}

/* The prompt of request id: distinct throughout, or the shared prefix (the
 * same ids in every run and level, so cache on and off see the same
 * prompts) and a question of its own.  A question's first id follows the
 * request number, so consecutive requests differ there and no question's
 * block can be found cached from another's by a chance match of random
 * ids. */
#define BR_PREFIX_KEY 7777777u
static void br_prompt(const struct br_opts *o, uint64_t id, int32_t *ids) {
    if (o->shared_prefix <= 0) {
        br_prompt_ids(id, ids, o->prompt_tokens);
        return;
    }
    br_prompt_ids(BR_PREFIX_KEY, ids, o->shared_prefix);
    int32_t *q = ids + o->shared_prefix;
    q[0] = 300 + (int32_t)(id % 100);
    br_prompt_ids(id, q + 1, o->question_tokens - 1);
}

/* t_arrive: when the request arrived (open loop), 0: now. */
static int br_load_send(struct br_load *L, double t_arrive) {
    uint64_t id = L->next_id++;
    int32_t slot = br_slot_take(L, id); /* -1: untimed, named past the slots */
    uint64_t named = slot < 0 ? (uint64_t)L->conc : (uint64_t)slot;
    char rid[80];
    snprintf(rid, sizeof rid, "br%d-%" PRIu64 "-%d-%" PRIu64, L->level, id, (int)getpid(), named);
    br_prompt(L->o, id, L->prompt);
    Llm__SamplingParams sp = LLM__SAMPLING_PARAMS__INIT;
    sp.ignore_eos = true;
    sp.seed = id + 1;
    Llm__GenerateRequest g = LLM__GENERATE_REQUEST__INIT;
    g.request_id = rid;
    g.n_prompt_tokens = (size_t)br_prompt_len(L->o);
    g.prompt_tokens = L->prompt;
    g.max_tokens = (uint32_t)L->o->max_tokens;
    g.sampling = &sp;
    g.stream = true;
    Llm__ClientEnvelope env = LLM__CLIENT_ENVELOPE__INIT;
    env.tag = named << BR_TAG_SLOT_SHIFT | id;
    env.body_case = LLM__CLIENT_ENVELOPE__BODY_GENERATE;
    env.generate = &g;
    uint8_t *buf = NULL;
    size_t len = 0;
    char err[256];
    if (proto_client_pack(&env, &buf, &len, err, sizeof err) < 0) {
        br_fmt(L->first_err, sizeof L->first_err, "pack: %s", err);
        return STATUS_INTERNAL;
    }
    struct zio_frame f = {buf, len, proto_buf_free, NULL};
    if (zio_send(L->sock, &f, 1, 0) < 0) {
        br_fmt(L->first_err, sizeof L->first_err, "send: %s", zio_errstr(L->sock));
        return STATUS_IO;
    }
    L->in_flight++;
    if (slot >= 0) L->slots[slot].t_send = t_arrive > 0 ? t_arrive : br_now();
    return 0;
}

/* ---- Open-loop arrivals ---- */

/* mulberry32 and the seed's mixing exactly as bench_cluster draws its --rate
 * arrivals (which are serve-bench's): one seed gives the same gaps here,
 * there and in serve-bench. */
static double br_rng_next(uint32_t *state) {
    uint32_t t = *state += 0x6d2b79f5u;
    t = (t ^ (t >> 15)) * (t | 1u);
    t ^= t + (t ^ (t >> 7)) * (t | 61u);
    return (double)(t ^ (t >> 14)) / 4294967296.0;
}

/* Arrivals from t0 (monotonic seconds) on: the k-th at the k-th point of a
 * Poisson process of rate per second. */
static void br_arrivals_start(struct br_load *L, double rate, uint32_t seed, double t0) {
    L->rate = rate;
    L->rng = seed ^ 0x5bd1e995u;
    L->t_next = t0 - log(1.0 - br_rng_next(&L->rng)) / rate;
}

/* Queues the arrivals due by now, then sends the oldest while fewer than
 * conc are in flight.  An arrival that cannot go at once keeps its time:
 * its wait counts in its TTFT. */
static void br_arrivals_run(struct br_load *L, double now) {
    while (L->t_next <= now) {
        if (L->q_n == L->q_cap) {
            size_t cap = L->q_cap ? L->q_cap * 2 : 1024;
            double *q = malloc(cap * sizeof *q);
            if (!q) break; /* late arrivals, not a lost run: retried on the next wake */
            for (size_t i = 0; i < L->q_n; i++) q[i] = L->queue[(L->q_head + i) % L->q_cap];
            free(L->queue);
            L->queue = q;
            L->q_head = 0;
            L->q_cap = cap;
        }
        /* Arrivals queued in this same pass are not waiting yet: only conc
         * ahead of it, sent or not, make this one wait. */
        if (L->measure && (size_t)L->in_flight + L->q_n >= (size_t)L->conc) L->capped++;
        L->queue[(L->q_head + L->q_n++) % L->q_cap] = L->t_next;
        L->t_next -= log(1.0 - br_rng_next(&L->rng)) / L->rate;
    }
    while (L->q_n > 0 && L->in_flight < L->conc) {
        double t = L->queue[L->q_head];
        L->q_head = (L->q_head + 1) % L->q_cap;
        L->q_n--;
        if (br_load_send(L, t) < 0) break;
    }
}

/* Reads what the router sent until deadline (monotonic seconds); in the
 * open loop also sends the arrivals, waking for each. */
static void br_load_pump(struct br_load *L, double deadline) {
    struct zio_parts in = {0};
    while (!br_stop) {
        double t = br_now();
        if (t >= deadline) break;
        double wake = deadline;
        if (L->rate > 0) {
            br_arrivals_run(L, t);
            if (L->t_next < wake) wake = L->t_next;
        }
        /* Whole milliseconds, rounded up: an arrival is sent at most 1 ms
         * late (and counted from its time), never in a busy loop. */
        int ms = (int)ceil((wake - t) * 1000);
        if (ms < 1) ms = 1;
        if (zio_recv(L->sock, &in, ms > 100 ? 100 : ms) != 0) continue;
        double now = br_now();
        Llm__ClientEnvelope *env = NULL;
        char err[256];
        if (in.n != 1 || proto_client_unpack(zio_parts_data(&in, 0), zio_parts_size(&in, 0), &env, err, sizeof err) < 0)
            continue;
        switch (env->body_case) {
        case LLM__CLIENT_ENVELOPE__BODY_CHUNK:
            L->tokens += env->chunk->n_token_ids;
            br_on_chunk(L, env->chunk, now);
            break;
        case LLM__CLIENT_ENVELOPE__BODY_DONE: {
            /* Chunks and Done name the request (their envelope's tag is 0). */
            uint64_t id, slot;
            if (br_parse_rid(L, env->done->request_id, &id, &slot)) br_slot_give(L, id, slot);
            L->done++;
            L->in_flight--;
            if (env->done->finish_reason == LLM__GENERATE_DONE__FINISH_REASON__ERROR) {
                L->errors++;
                if (!L->first_err[0])
                    br_fmt(L->first_err, sizeof L->first_err, "request %s: %s", env->done->request_id,
                             env->done->error ? env->done->error->message : "error");
            }
            if (L->rate == 0) br_load_send(L, 0);
            break;
        }
        case LLM__CLIENT_ENVELOPE__BODY_ERROR:
            /* A refused request: one that retrying can help (queue full,
             * no pipeline yet) is replaced in the closed loop (in the open
             * loop it is an error and the arrivals go on); any other
             * refusal is the bench's mistake and ends the level. */
            L->errors++;
            L->in_flight--;
            /* A refusal answers the Generate's tag. */
            br_slot_give(L, env->tag & ((1ull << BR_TAG_SLOT_SHIFT) - 1), env->tag >> BR_TAG_SLOT_SHIFT);
            if (!L->first_err[0])
                br_fmt(L->first_err, sizeof L->first_err, "%s: %s", proto_code_name(env->error->code),
                       env->error->message);
            if (env->error->code == LLM__ERROR__CODE__UNAVAILABLE ||
                env->error->code == LLM__ERROR__CODE__RESOURCE_EXHAUSTED) {
                if (L->rate == 0) br_load_send(L, 0);
            } else {
                L->fatal = true;
                proto_client_free(env);
                zio_parts_free(&in);
                return;
            }
            break;
        default: break;
        }
        proto_client_free(env);
    }
    zio_parts_free(&in);
}

static int br_free_port(char *err, size_t errlen) {
    int port = 0;
    if (zio_free_port(NULL, &port, err, errlen) < 0) return -1;
    return port;
}

/* One pipeline count; seed: of its arrivals in the open loop. */
static int br_level(const struct br_opts *o, int pipelines, uint32_t seed, struct br_row *row, char *err,
                    size_t errlen) {
    memset(row, 0, sizeof *row);
    row->pipelines = pipelines;
    row->stages = o->stages;
    row->conc = pipelines * o->seqs;
    row->rate = o->rate;
    row->seed = seed;
    char dir[PATH_MAX];
    br_fmt(dir, sizeof dir, "%s/bench-router-XXXXXX", o->tmpdir);
    if (!mkdtemp(dir)) {
        br_fmt(err, errlen, "mkdtemp %s: %s", dir, strerror(errno));
        return STATUS_IO;
    }
    int rport = br_free_port(err, errlen), cport = br_free_port(err, errlen), wport = br_free_port(err, errlen);
    if (rport < 0 || cport < 0 || wport < 0) return STATUS_IO;
    char rport_s[16], cep[64], wep[64], redis_url[64], pipes_s[16], stages_s[16], step_s[16], stats[PATH_MAX];
    snprintf(rport_s, sizeof rport_s, "%d", rport);
    snprintf(cep, sizeof cep, "tcp://127.0.0.1:%d", cport);
    snprintf(wep, sizeof wep, "tcp://127.0.0.1:%d", wport);
    snprintf(redis_url, sizeof redis_url, "redis://127.0.0.1:%d", rport);
    snprintf(pipes_s, sizeof pipes_s, "%d", pipelines);
    snprintf(stages_s, sizeof stages_s, "%d", o->stages);
    snprintf(step_s, sizeof step_s, "%d", o->step_us);
    br_fmt(stats, sizeof stats, "%s/sim-stats.json", dir);

    struct br_proc redis = {"redis-server", 0, ""}, router = {"llm-router", 0, ""}, sim = {"sim_worker", 0, ""};
    br_fmt(redis.log, sizeof redis.log, "%s/redis.log", dir);
    br_fmt(router.log, sizeof router.log, "%s/router.log", dir);
    br_fmt(sim.log, sizeof sim.log, "%s/sim.log", dir);
    int rc = 0;
    llm_client *c = NULL;
    struct br_load L = {0};
    void *zctx = NULL;
    char *redis_argv[] = {(char *)o->redis_bin, "--port", rport_s, "--bind", "127.0.0.1", "--save", "",
                          "--appendonly", "no", "--dir", dir, NULL};
    if ((rc = br_spawn(&redis, redis_argv, err, errlen)) < 0) goto done;
    /* The router's extra words, split on spaces. */
    char rargs[1024];
    br_fmt(rargs, sizeof rargs, "%s", o->router_args);
    char *router_argv[64] = {(char *)o->router_bin, "--model", (char *)o->model, "--listen", cep,
                             "--worker-listen", wep, "--redis", redis_url, "--metrics-listen", "",
                             "--router-id", "bench", "--log-level", "info"};
    int n = 15;
    if (o->router_insecure) router_argv[n++] = "--insecure";
    for (char *save = NULL, *t = strtok_r(rargs, " ", &save); t && n < 62; t = strtok_r(NULL, " ", &save))
        router_argv[n++] = t;
    router_argv[n] = NULL;
    br_sleep_ms(200); /* redis first: the router connects at start (and retries every second) */
    if ((rc = br_spawn(&router, router_argv, err, errlen)) < 0) goto done;
    /* sim_worker's extra words, likewise. */
    char sargs[1024];
    br_fmt(sargs, sizeof sargs, "%s", o->sim_args);
    char *sim_argv[64] = {(char *)o->sim_bin, "--router", wep, "--model", (char *)o->model, "--pipelines", pipes_s,
                          "--stages", stages_s, "--step-us", step_s, "--stats-file", stats, "--insecure",
                          "--log-level", "info"};
    n = 16;
    for (char *save = NULL, *t = strtok_r(sargs, " ", &save); t && n < 62; t = strtok_r(NULL, " ", &save))
        sim_argv[n++] = t;
    sim_argv[n] = NULL;
    if ((rc = br_spawn(&sim, sim_argv, err, errlen)) < 0) goto done;

    const char *eps[1] = {cep};
    struct llm_client_config cc;
    llm_client_config_default(&cc);
    cc.endpoints = eps;
    cc.n_endpoints = 1;
    cc.reply_timeout_ms = 2000;
    cc.retry_ms = 2000;
    if ((rc = llm_client_open(&c, &cc, err, errlen)) < 0) goto done;
    struct br_status st0 = {0}, st1 = {0};
    double up_end = br_now() + o->up_timeout_s;
    for (;;) {
        if (br_status(c, &st0) == 0 && st0.ready >= pipelines) break;
        if (!br_alive(&router) || !br_alive(&sim) || br_now() > up_end || br_stop) {
            br_fmt(err, errlen, "%d pipelines: %d ready after %d s (router %s, sim_worker %s)", pipelines,
                   st0.ready, o->up_timeout_s, br_alive(&router) ? "up" : "exited",
                   br_alive(&sim) ? "up" : "exited");
            br_tail(router.log);
            br_tail(sim.log);
            rc = STATUS_TIMEOUT;
            goto done;
        }
        br_sleep_ms(100);
    }

    zctx = zmq_ctx_new();
    L.o = o;
    L.level = pipelines;
    L.conc = row->conc;
    L.prompt = malloc((size_t)br_prompt_len(o) * sizeof *L.prompt);
    L.slots = calloc((size_t)row->conc, sizeof *L.slots);
    L.free_slots = malloc((size_t)row->conc * sizeof *L.free_slots);
    for (int32_t k = row->conc - 1; L.free_slots && k >= 0; k--) L.free_slots[L.n_free++] = k;
    L.ttft.rng = 0x9e3779b97f4a7c15ULL;
    L.itl.rng = 0xd1b54a32d192ed03ULL;
    if (!zctx || !L.prompt || !L.slots || !L.free_slots || zio_sock_open(zctx, ZMQ_DEALER, &L.sock, err, errlen) < 0) {
        if (!err[0]) br_fmt(err, errlen, "out of memory");
        rc = STATUS_NO_MEMORY;
        goto done;
    }
    zio_set_int(L.sock, ZMQ_SNDHWM, 1000000);
    zio_set_int(L.sock, ZMQ_RCVHWM, 1000000);
    if ((rc = zio_connect(L.sock, cep)) < 0) {
        br_fmt(err, errlen, "%s", zio_errstr(L.sock));
        goto done;
    }
    if (o->rate > 0) br_arrivals_start(&L, o->rate, seed, br_now());
    else
        for (int i = 0; i < row->conc && rc == 0; i++) rc = br_load_send(&L, 0);
    if (rc < 0) {
        br_fmt(err, errlen, "%s", L.first_err);
        goto done;
    }
    br_load_pump(&L, br_now() + o->warmup_s);
    if (L.fatal) {
        br_fmt(err, errlen, "%d pipelines: the router refused a request: %s", pipelines, L.first_err);
        rc = STATUS_BAD_INPUT;
        goto done;
    }

    /* The window. */
    struct br_sim_stats s0, s1;
    if (br_status(c, &st0) < 0 || br_sim_snapshot(&sim, stats, 1, &s0) < 0) {
        br_fmt(err, errlen, "%d pipelines: no router Status or sim_worker snapshot at the window's start",
               pipelines);
        rc = STATUS_TIMEOUT;
        goto done;
    }
    double t0 = br_now(), cr0 = br_cpu_s(router.pid), cd0 = br_cpu_s(redis.pid), cc0 = br_self_cpu_s();
    uint64_t done0 = L.done, err0 = L.errors, tok0 = L.tokens;
    L.capped = 0;
    L.measure = true;
    br_load_pump(&L, t0 + o->seconds);
    L.measure = false;
    double t1 = br_now(), cr1 = br_cpu_s(router.pid), cd1 = br_cpu_s(redis.pid), cc1 = br_self_cpu_s();
    if (br_status(c, &st1) < 0 || br_sim_snapshot(&sim, stats, 2, &s1) < 0) {
        br_fmt(err, errlen, "%d pipelines: no router Status or sim_worker snapshot at the window's end", pipelines);
        rc = STATUS_TIMEOUT;
        goto done;
    }
    double w = t1 - t0;
    row->window_s = w;
    row->steps_s = s1.results / s1.window_s;
    row->steps_s_pipe = row->steps_s / pipelines;
    row->steps_s_pipe_min = s1.steps_min / s1.window_s;
    row->tok_s = (double)(L.tokens - tok0) / w;
    row->req_s = (double)(L.done - done0) / w;
    row->capped = L.capped;
    uint64_t dn = st1.steps - st0.steps;
    row->plan_mean_us = dn ? (st1.plan_mean * (double)st1.steps - st0.plan_mean * (double)st0.steps) / (double)dn : 0;
    row->plan_max_us = st1.plan_max;
    row->router_turn_mean_us = st1.turn_mean;
    row->turn_p50 = (unsigned)s1.p50;
    row->turn_p90 = (unsigned)s1.p90;
    row->turn_p99 = (unsigned)s1.p99;
    row->turn_max = (unsigned)s1.max;
    row->cpu_router = (cr1 - cr0) / w;
    row->cpu_redis = (cd1 - cd0) / w;
    row->cpu_sim = s1.cpu_s / s1.window_s;
    row->cpu_client = (cc1 - cc0) / w;
    qsort(L.ttft.v, L.ttft.n, sizeof *L.ttft.v, br_cmp_double);
    qsort(L.itl.v, L.itl.n, sizeof *L.itl.v, br_cmp_double);
    row->ttft_n = L.ttft.seen;
    row->itl_n = L.itl.seen;
    row->ttft_p50 = br_pct_ms(&L.ttft, 0.5);
    row->ttft_p90 = br_pct_ms(&L.ttft, 0.9);
    row->itl_p50 = br_pct_ms(&L.itl, 0.5);
    row->itl_p90 = br_pct_ms(&L.itl, 0.9);
    row->itl_p99 = br_pct_ms(&L.itl, 0.99);
    row->requests_done = L.done - done0;
    row->errors = L.errors - err0;
    row->prefix_cache = st1.prefix_cache;
    row->prefix_hit_tokens = st1.prefix_hit_tokens - st0.prefix_hit_tokens;
    row->prefix_miss_tokens = st1.prefix_miss_tokens - st0.prefix_miss_tokens;
    if (L.first_err[0]) br_fmt(row->note, sizeof row->note, "%s", L.first_err);
done:
    zio_sock_close(L.sock);
    free(L.prompt);
    free(L.slots);
    free(L.free_slots);
    free(L.queue);
    free(L.ttft.v);
    free(L.itl.v);
    if (zctx) zmq_ctx_term(zctx);
    llm_client_close(c);
    br_stop_proc(&sim);
    br_stop_proc(&router);
    br_stop_proc(&redis);
    if (rc == 0) {
        char cmd[PATH_MAX + 16];
        br_fmt(cmd, sizeof cmd, "rm -rf '%s'", dir);
        if (system(cmd) != 0) fprintf(stderr, "bench_router: could not remove %s\n", dir);
    } else {
        fprintf(stderr, "bench_router: logs kept in %s\n", dir);
    }
    return rc;
}

/* The window's prefix hits as a share of the prompt tokens admitted:
 * "off" without the cache, "-" when nothing was admitted. */
static void br_fmt_hits(char *out, size_t size, const struct br_row *r) {
    uint64_t all = r->prefix_hit_tokens + r->prefix_miss_tokens;
    if (!r->prefix_cache) br_fmt(out, size, "off");
    else if (all == 0) br_fmt(out, size, "-");
    else br_fmt(out, size, "%.1f%%", 100.0 * (double)r->prefix_hit_tokens / (double)all);
}

static void br_print(FILE *f, const struct br_opts *o, const struct br_row *r, int n) {
    char prompts[128];
    if (o->shared_prefix > 0)
        br_fmt(prompts, sizeof prompts, "prompts of a %d-token shared prefix + a distinct %d-token question",
               o->shared_prefix, o->question_tokens);
    else
        br_fmt(prompts, sizeof prompts, "distinct prompts of %d tokens", o->prompt_tokens);
    if (o->rate > 0)
        fprintf(f, "open loop: Poisson arrivals at %g req/s (seed %d + level), at most pipelines x %d in flight, "
                   "TTFT from the arrival; %s, %d tokens generated\n\n", o->rate, o->seed, o->seqs, prompts,
                o->max_tokens);
    else
        fprintf(f, "closed loop: pipelines x %d in flight, each request replaced when it ends, TTFT from the send; "
                   "%s, %d tokens generated\n\n", o->seqs, prompts, o->max_tokens);
    fprintf(f, "| pipelines | in flight | steps/s | steps/s/pipe (min) | tok/s | req/s | plan us mean (max) | "
               "turnaround us p50 / p90 / p99 | TTFT ms p50 / p90 | ITL ms p50 / p90 / p99 | "
               "CPU router / redis / sim / client | prefix hits |\n");
    fprintf(f, "|---|---|---|---|---|---|---|---|---|---|---|---|\n");
    for (int i = 0; i < n; i++) {
        char hits[32];
        br_fmt_hits(hits, sizeof hits, &r[i]);
        fprintf(f, "| %d x %d | %d | %.0f | %.0f (%.0f) | %.0f | %.1f | %.1f (%.0f) | %u / %u / %u | %.1f / %.1f | "
                   "%.2f / %.2f / %.2f | %.2f / %.2f / %.2f / %.2f | %s |\n",
                r[i].pipelines, r[i].stages, r[i].conc, r[i].steps_s, r[i].steps_s_pipe, r[i].steps_s_pipe_min,
                r[i].tok_s, r[i].req_s, r[i].plan_mean_us, r[i].plan_max_us, r[i].turn_p50, r[i].turn_p90, r[i].turn_p99,
                r[i].ttft_p50, r[i].ttft_p90, r[i].itl_p50, r[i].itl_p90, r[i].itl_p99, r[i].cpu_router,
                r[i].cpu_redis, r[i].cpu_sim, r[i].cpu_client, hits);
    }
}

static void br_json(FILE *f, const struct br_opts *o, const struct br_row *r, int n) {
    double load[3] = {0, 0, 0};
    FILE *la = fopen("/proc/loadavg", "r");
    if (la) {
        if (fscanf(la, "%lf %lf %lf", &load[0], &load[1], &load[2]) != 3) load[0] = load[1] = load[2] = 0;
        fclose(la);
    }
    fprintf(f, "{\"model\": \"%s\", \"stages\": %d, \"seqs_per_pipeline\": %d, \"step_us\": %d, \"seconds\": %d, "
               "\"rate\": %.6g, \"seed\": %d, \"workload\": \"%s\", \"prompt_tokens\": %d, \"shared_prefix\": %d, "
               "\"question_tokens\": %d, \"max_tokens\": %d, \"cpus\": %ld, \"loadavg_at_end\": [%.2f, %.2f, %.2f], "
               "\"rows\": [\n",
            o->model, o->stages, o->seqs, o->step_us, o->seconds, o->rate, o->seed,
            o->shared_prefix > 0 ? "shared-prefix" : "distinct", br_prompt_len(o), o->shared_prefix,
            o->shared_prefix > 0 ? o->question_tokens : 0, o->max_tokens, sysconf(_SC_NPROCESSORS_ONLN), load[0],
            load[1], load[2]);
    for (int i = 0; i < n; i++)
        fprintf(f,
                "  {\"pipelines\": %d, \"stages\": %d, \"in_flight\": %d, \"rate\": %.6g, \"arrival_seed\": %u, "
                "\"capped\": %" PRIu64 ", \"window_s\": %.3f, \"steps_per_s\": %.1f, "
                "\"steps_per_s_per_pipeline\": %.1f, \"steps_per_s_slowest_pipeline\": %.1f, \"tokens_per_s\": %.1f, "
                "\"plan_us_mean\": %.2f, \"plan_us_max\": %.1f, \"router_turnaround_us_mean\": %.2f, "
                "\"turnaround_us_p50\": %u, \"turnaround_us_p90\": %u, \"turnaround_us_p99\": %u, "
                "\"turnaround_us_max\": %u, \"gen_tok_s\": %.1f, \"ttft_p50_ms\": %.3f, \"ttft_p90_ms\": %.3f, "
                "\"itl_p50_ms\": %.3f, \"itl_p90_ms\": %.3f, \"itl_p99_ms\": %.3f, \"ttft_samples\": %" PRIu64 ", "
                "\"itl_samples\": %" PRIu64 ", \"cpu_router\": %.3f, \"cpu_redis\": %.3f, \"cpu_sim_worker\": %.3f, "
                "\"cpu_client\": %.3f, \"requests_done\": %" PRIu64 ", \"requests_per_s\": %.2f, "
                "\"errors\": %" PRIu64 ", \"prefix_cache\": %s, \"prefix_hit_tokens\": %" PRIu64 ", "
                "\"prefix_miss_tokens\": %" PRIu64 "}%s\n",
                r[i].pipelines, r[i].stages, r[i].conc, r[i].rate, r[i].seed, r[i].capped, r[i].window_s, r[i].steps_s, r[i].steps_s_pipe,
                r[i].steps_s_pipe_min, r[i].tok_s, r[i].plan_mean_us, r[i].plan_max_us, r[i].router_turn_mean_us,
                r[i].turn_p50, r[i].turn_p90, r[i].turn_p99, r[i].turn_max, r[i].tok_s, r[i].ttft_p50, r[i].ttft_p90,
                r[i].itl_p50, r[i].itl_p90, r[i].itl_p99, r[i].ttft_n, r[i].itl_n, r[i].cpu_router, r[i].cpu_redis,
                r[i].cpu_sim, r[i].cpu_client, r[i].requests_done, r[i].req_s, r[i].errors,
                r[i].prefix_cache ? "true" : "false", r[i].prefix_hit_tokens, r[i].prefix_miss_tokens,
                i + 1 < n ? "," : "");
    fprintf(f, "]}\n");
}

/* bin/bench/bench_router -> bin/<rel> */
static void br_sibling(const char *argv0, const char *rel, char *out, size_t size) {
    char self[PATH_MAX];
    ssize_t n = readlink("/proc/self/exe", self, sizeof self - 1);
    if (n <= 0) br_fmt(self, sizeof self, "%s", argv0);
    else self[n] = 0;
    char *slash = strrchr(self, '/');
    if (slash) *slash = 0;
    br_fmt(out, size, "%s/%s", self, rel);
}

int main(int argc, char **argv) {
    struct br_opts o;
    memset(&o, 0, sizeof o);
    static char router_default[PATH_MAX], sim_default[PATH_MAX];
    br_sibling(argv[0], "../router/llm-router", router_default, sizeof router_default);
    br_sibling(argv[0], "sim_worker", sim_default, sizeof sim_default);
    const struct option_def defs[] = {
        {"model", "LLM_MODEL", OPTION_STRING, NULL,
         "model file the router serves (its tokenizer and metadata); none: a synthetic one is written",
         &o.model, 0, 0, NULL},
        {"pipelines", NULL, OPTION_STRING, "1,2,4,8,16,32,64,128,256", "pipeline counts to measure", &o.pipelines, 0,
         0, NULL},
        {"stages", NULL, OPTION_INT, "1", "stages per pipeline", &o.stages, 1, 64, NULL},
        {"seqs", NULL, OPTION_INT, "4", "requests in flight per pipeline", &o.seqs, 1, 4096, NULL},
        {"prompt-tokens", NULL, OPTION_INT, "16", "prompt tokens per request (not used with --shared-prefix, whose "
         "prompts are N + --question-tokens long)", &o.prompt_tokens, 1, 65536, NULL},
        {"shared-prefix", NULL, OPTION_INT, "0", "the shared-prefix workload: every prompt starts with the same N "
         "tokens (a system prompt) and ends in --question-tokens of its own; 0: distinct prompts of --prompt-tokens. "
         "Run twice, once with --router-args --no-prefix-cache, to compare the router's prefix cache on and off",
         &o.shared_prefix, 0, 1 << 20, NULL},
        {"question-tokens", NULL, OPTION_INT, "32", "with --shared-prefix: each request's own tokens after the prefix",
         &o.question_tokens, 1, 1 << 20, NULL},
        {"max-tokens", NULL, OPTION_INT, "256", "tokens generated per request", &o.max_tokens, 1, 1 << 20, NULL},
        {"step-us", NULL, OPTION_INT, "0", "sim_worker holds each result this long (0: at once)", &o.step_us, 0,
         60000000, NULL},
        {"rate", NULL, OPTION_FLOAT, "0", "open loop: requests arrive as a Poisson process of R per second, each sent "
         "at its arrival while fewer than pipelines x --seqs are in flight (else when one ends); 0: closed loop, "
         "each request replaced when it ends", &o.rate, 0, 1e6, NULL},
        {"seed", NULL, OPTION_INT, "1", "with --rate: level k of --pipelines draws its arrivals from seed N + k, as "
         "bench_cluster --rate --seed N does", &o.seed, 0, INT_MAX / 2, NULL},
        {"warmup-s", NULL, OPTION_INT, "2", "seconds of load before the window", &o.warmup_s, 0, 3600, NULL},
        {"seconds", NULL, OPTION_INT, "5", "seconds measured per pipeline count", &o.seconds, 1, 3600, NULL},
        {"up-timeout-s", NULL, OPTION_INT, "60", "wait this long for every pipeline to be ready", &o.up_timeout_s, 1,
         3600, NULL},
        {"router-bin", NULL, OPTION_STRING, router_default, "llm-router to run", &o.router_bin, 0, 0, NULL},
        {"sim-bin", NULL, OPTION_STRING, sim_default, "sim_worker to run", &o.sim_bin, 0, 0, NULL},
        {"redis-server", "LLM_REDIS_SERVER", OPTION_STRING, "/usr/bin/redis-server", "redis-server to run",
         &o.redis_bin, 0, 0, NULL},
        {"router-args", NULL, OPTION_STRING, "", "extra words for llm-router's command line", &o.router_args, 0, 0,
         NULL},
        {"sim-args", NULL, OPTION_STRING, "", "extra words for sim_worker's command line (e.g. --step-ms ...)",
         &o.sim_args, 0, 0, NULL},
        {"json", NULL, OPTION_STRING, "", "also write the rows as JSON to this file", &o.json, 0, 0, NULL},
        {"tmpdir", "TMPDIR", OPTION_STRING, "/tmp", "where each run's logs go (kept when a run fails)", &o.tmpdir, 0,
         0, NULL},
    };
    struct options op = {"bench_router", "[options]",
                         "One router driven by sim_worker pipelines: steps/s, plan time, turnaround, the client's "
                         "TTFT and ITL, and CPU as the pipelines grow.",
                         defs, (int)(sizeof defs / sizeof defs[0]), false};
    char err[1024] = "";
    int rc = options_parse(&op, &argc, argv, err, sizeof err);
    if (rc == STATUS_CANCELLED) return 0;
    if (rc < 0) {
        fprintf(stderr, "bench_router: %s\n", err);
        return 2;
    }
    if ((o.n_pipes = br_parse_list(o.pipelines, o.pipe_v, err, sizeof err)) < 0) {
        fprintf(stderr, "bench_router: %s\n", err);
        return 2;
    }
    const char *bins[3] = {o.router_bin, o.sim_bin, o.redis_bin};
    for (int i = 0; i < 3; i++)
        if (access(bins[i], X_OK) != 0) {
            fprintf(stderr, "bench_router: %s: %s (build it, or give its path)\n", bins[i], strerror(errno));
            return 2;
        }
    /* Without --model: a small synthetic model (only its tokenizer and
     * metadata are read) whose context holds prompt + max_tokens. */

    static char synth_path[PATH_MAX];
    if (!o.model || !o.model[0]) {
        struct synth_config sc;
        memset(&sc, 0, sizeof sc);
        synth_shape_preset("tiny", &sc.shape);
        sc.shape.ctx_len = br_prompt_len(&o) + o.max_tokens + 64;
        if (sc.shape.n_layers < o.stages) sc.shape.n_layers = o.stages;
        sc.type = SYNTH_F32;
        sc.seed = 1;
        sc.n_threads = 1;
        sc.name = "bench-router";
        br_fmt(synth_path, sizeof synth_path, "%s/bench-router-synth-%d.gguf", o.tmpdir, (int)getpid());
        if (synth_write(&sc, synth_path, err, sizeof err) != STATUS_OK) {
            fprintf(stderr, "bench_router: writing a synthetic model to %s: %s\n", synth_path, err);
            return 1;
        }
        o.model = synth_path;
    }
    /* Plain sockets throughout (CURVE's cost is not what this measures):
     * the client library reads LLM_INSECURE where it has keys. */
    o.router_insecure = br_knows_flag(o.router_bin, "--insecure");
    setenv("LLM_INSECURE", "true", 1);
    log_set_level(LL_WARN);
    signal(SIGPIPE, SIG_IGN);
    struct sigaction sa;
    memset(&sa, 0, sizeof sa);
    sa.sa_handler = br_on_signal;
    sigaction(SIGINT, &sa, NULL);
    sigaction(SIGTERM, &sa, NULL);
    struct br_row rows[BR_LIST_MAX];
    int n_rows = 0, failed = 0;
    for (int i = 0; i < o.n_pipes && !br_stop; i++) {
        err[0] = 0;
        struct br_row r;
        if (br_level(&o, o.pipe_v[i], (uint32_t)o.seed + (uint32_t)i, &r, err, sizeof err) < 0) {
            fprintf(stderr, "bench_router: %d pipelines: %s\n", o.pipe_v[i], err);
            failed = 1;
            continue;
        }
        rows[n_rows++] = r;
        char load[96], hits[32];
        br_fmt_hits(hits, sizeof hits, &r);
        if (r.rate > 0)
            br_fmt(load, sizeof load, "rate %g req/s (seed %u, %" PRIu64 " capped)", r.rate, r.seed, r.capped);
        else
            br_fmt(load, sizeof load, "closed loop");
        fprintf(stderr, "%d x %d, %s: %.1f req/s, %.0f steps/s (%.0f per pipeline, slowest %.0f), plan %.1f us, "
                "turnaround p99 %u us, TTFT p50 %.1f ms, ITL p50 %.2f ms p99 %.2f ms, router CPU %.2f, prefix hits %s"
                "%s%s\n",
                r.pipelines, r.stages, load, r.req_s, r.steps_s, r.steps_s_pipe, r.steps_s_pipe_min, r.plan_mean_us,
                r.turn_p99, r.ttft_p50, r.itl_p50, r.itl_p99, r.cpu_router, hits, r.note[0] ? "; " : "", r.note);
    }
    if (synth_path[0]) unlink(synth_path);
    br_print(stdout, &o, rows, n_rows);
    if (o.json && o.json[0]) {
        FILE *f = fopen(o.json, "w");
        if (!f) {
            fprintf(stderr, "bench_router: --json %s: %s\n", o.json, strerror(errno));
            return 1;
        }
        br_json(f, &o, rows, n_rows);
        fclose(f);
    }
    return failed ? 1 : 0;
}
