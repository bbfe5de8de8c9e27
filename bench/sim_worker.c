/* sim_worker: many simulated workers in one process, for driving one router
 * with hundreds of pipelines on a machine without a GPU (docs/router.md,
 * "Capacity").  Each worker of N pipelines x S stages is a real ZeroMQ
 * DEALER with its worker id as routing id, and speaks to the router as
 * llm-worker does: Register with its placement, Heartbeat READY every
 * interval the router gives, RegisterReply refusals with a retry answered
 * by registering again, plans of an older epoch dropped.  There is no model
 * and no compute: the last stage answers each StepPlan with a StepResult at
 * once (or after --step-us) with a synthetic token for every sequence that
 * asked for one, a pure function of (seq_id, position), so runs repeat.
 * --step-ms gives a step a time that follows its tokens instead, from a
 * table (measured step times of a real model and card), so that the
 * router's scheduling can be judged for latency on a machine without a
 * GPU; a worker then runs its steps one after another, as a GPU does.
 *
 *   sim_worker --router tcp://127.0.0.1:5556 --model m.gguf --pipelines 64 --stages 2 --insecure
 *
 * Measurements for bench_router: on SIGUSR1 it writes what it saw since the
 * previous SIGUSR1 to --stats-file as one JSON object (written to a
 * temporary name, then renamed), then starts counting again: results sent,
 * tokens, steps per pipeline (least and most), the router's turnaround as a
 * last stage sees it (from sending a result to the next plan of that
 * pipeline, counted when the stage had no other plan waiting), and this
 * process's CPU time.
 *
 * One thread: every socket's ZMQ_FD is in one epoll set, so a wakeup costs
 * what is ready, not what is connected (zmq_poll over 512 sockets would
 * cost more than the router's work being measured).  ZMQ_FD only signals
 * edges: a socket is read until ZMQ_EVENTS has no POLLIN, and read again
 * after every send on it, since a send can consume the signal of a message
 * that came meanwhile. */
#include "common/keys.h"
#include "common/log.h"
#include "common/options.h"
#include "common/status.h"
#include "common/zio.h"
#include "proto/wire.h"
#include "router/modelinfo.h"

#include <errno.h>
#include <inttypes.h>
#include <signal.h>
#include <stdbool.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/epoll.h>
#include <sys/resource.h>
#include <time.h>
#include <unistd.h>
#include <zmq.h>

#define SIM_REGISTER_RETRY_MS 2000
#define SIM_HEARTBEAT_DEFAULT_MS 1000

static volatile sig_atomic_t sim_stop, sim_snapshot;
static void sim_on_stop(int sig) {
    (void)sig;
    sim_stop = 1;
}
static void sim_on_usr1(int sig) {
    (void)sig;
    sim_snapshot = 1;
}

static int64_t sim_now_us(void) {
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (int64_t)ts.tv_sec * 1000000 + ts.tv_nsec / 1000;
}

static int64_t sim_unix_ms(void) {
    struct timespec ts;
    clock_gettime(CLOCK_REALTIME, &ts);
    return (int64_t)ts.tv_sec * 1000 + ts.tv_nsec / 1000000;
}

struct sim_worker {
    char id[64];
    uint32_t pipeline, stage;
    uint64_t incarnation;
    struct zio_sock *sock;
    bool registered, dead;
    uint64_t epoch;
    int64_t next_register_us, next_hb_us;
    uint32_t hb_ms;
    bool dirty;                 /* read it before the next wait */
    int64_t busy_until_us;      /* --step-ms: the end of its last step */
    /* Last stage: the router's turnaround. */
    int64_t result_sent_us;     /* 0: a plan came since the last result */
    int32_t plans_waiting;      /* plans received, result not yet sent */
    uint64_t last_step_id, steps_total, tokens_total, steps_window;
    uint32_t kv_used;
};

/* A result held back until its time (--step-us).  The delay is the same for
 * every step, so the order of arrival is the order of sending. */
#define SIM_STEP_POINTS 32

struct sim_delayed {
    int64_t due_us;
    int32_t worker;
    uint8_t *buf;
    size_t len;
};

struct sim {
    /* Options. */
    const char *router, *model, *prefix, *stats_file, *key_file, *router_key;
    int pipelines, stages, first_pipeline, kv_blocks, kv_block_size, max_step_tokens, max_step_seqs;
    int step_us, vocab;
    const char *step_ms;
    bool insecure;
    /* --step-ms: step time (us) against step tokens, n_pts points. */
    double pt_tokens[SIM_STEP_POINTS], pt_us[SIM_STEP_POINTS];
    int n_pts;
    /* State. */
    struct keys_pair kp;       /* with --curve-key-file: every worker's own pair */
    char router_pub[KEYS_Z85_LEN + 1];
    struct modelinfo mi;
    char model_id[128];
    int32_t tok_lo, tok_n;
    void *zctx;
    int ep;
    struct sim_worker *w;
    int n_w;
    struct sim_delayed *q;
    size_t q_n, q_cap;          /* results held until due, in no order */
    /* Result packing buffers. */
    Llm__SeqResult *res;
    Llm__SeqResult **resp;
    size_t res_cap;
    /* Window counters. */
    int64_t window_start_us;
    int64_t next_timer_us;      /* earliest registration or heartbeat due */
    uint64_t w_results, w_tokens, w_plans, w_dropped, snapshots;
    uint32_t *turn;
    size_t n_turn, cap_turn;
};

/* The synthetic token at position pos of sequence seq_id: a hash mapped
 * into [tok_lo, tok_lo + tok_n), away from the low ids where vocabularies
 * keep their special and byte tokens. */
static int32_t sim_token(const struct sim *s, uint64_t seq_id, uint64_t pos) {
    uint64_t x = seq_id * 0x9e3779b97f4a7c15ULL ^ (pos + 1) * 0xbf58476d1ce4e5b9ULL;
    x ^= x >> 31;
    x *= 0x94d049bb133111ebULL;
    x ^= x >> 29;
    return s->tok_lo + (int32_t)(x % (uint64_t)s->tok_n);
}

static void sim_send(struct sim *s, struct sim_worker *w, uint8_t *buf, size_t len, const char *what) {
    struct zio_frame f = {buf, len, proto_buf_free, NULL};
    if (zio_send(w->sock, &f, 1, ZMQ_DONTWAIT) < 0)
        LOG(LL_WARN, "worker %s: %s not sent: %s", w->id, what, zio_errstr(w->sock));
    w->dirty = true;
    (void)s;
}

static void sim_send_env(struct sim *s, struct sim_worker *w, Llm__WorkerEnvelope *env, const char *what) {
    uint8_t *buf = NULL;
    size_t len = 0;
    char err[256];
    if (proto_worker_pack(env, &buf, &len, err, sizeof err) < 0) {
        LOG(LL_ERROR, "worker %s: cannot pack %s: %s", w->id, what, err);
        return;
    }
    sim_send(s, w, buf, len, what);
}

static void sim_register(struct sim *s, struct sim_worker *w) {
    Llm__Register r = LLM__REGISTER__INIT;
    char host[128] = "";
    gethostname(host, sizeof host - 1);
    r.worker_id = w->id;
    r.incarnation = w->incarnation;
    r.pipeline_id = w->pipeline;
    r.stage_index = w->stage;
    r.stage_count = (uint32_t)s->stages;
    r.model = s->model_id;
    r.backend = "sim";
    r.device = "simulated (no compute)";
    r.kv_block_count = (uint32_t)s->kv_blocks;
    r.kv_block_size = (uint32_t)s->kv_block_size;
    r.stage_endpoint = "";
    r.host = host;
    r.pid = (uint32_t)getpid();
    r.max_step_tokens = (uint32_t)s->max_step_tokens;
    r.max_step_seqs = (uint32_t)s->max_step_seqs;
    Llm__WorkerEnvelope env = LLM__WORKER_ENVELOPE__INIT;
    env.body_case = LLM__WORKER_ENVELOPE__BODY_REGISTER;
    env.register_ = &r;
    sim_send_env(s, w, &env, "Register");
}

static void sim_heartbeat(struct sim *s, struct sim_worker *w) {
    Llm__Heartbeat h = LLM__HEARTBEAT__INIT;
    h.worker_id = w->id;
    h.incarnation = w->incarnation;
    h.state = LLM__HEARTBEAT__STATE__READY;
    h.time_ms = sim_unix_ms();
    h.last_step_id = w->last_step_id;
    h.kv_blocks_used = w->kv_used;
    h.kv_blocks_total = (uint32_t)s->kv_blocks;
    h.steps_total = w->steps_total;
    h.tokens_total = w->tokens_total;
    Llm__WorkerEnvelope env = LLM__WORKER_ENVELOPE__INIT;
    env.body_case = LLM__WORKER_ENVELOPE__BODY_HEARTBEAT;
    env.heartbeat = &h;
    sim_send_env(s, w, &env, "heartbeat");
}

static void sim_error_reply(struct sim *s, struct sim_worker *w, Llm__Error__Code code, const char *msg) {
    uint8_t *buf = NULL;
    size_t len = 0;
    if (proto_worker_error_pack(code, "", msg, 0, &buf, &len) == 0) sim_send(s, w, buf, len, "Error reply");
}

static int sim_turn_add(struct sim *s, int64_t us) {
    if (s->n_turn == s->cap_turn) {
        size_t cap = s->cap_turn ? s->cap_turn * 2 : 65536;
        uint32_t *t = realloc(s->turn, cap * sizeof *t);
        if (!t) return STATUS_NO_MEMORY;
        s->turn = t;
        s->cap_turn = cap;
    }
    s->turn[s->n_turn++] = us < 0 ? 0 : us > UINT32_MAX ? UINT32_MAX : (uint32_t)us;
    return 0;
}

static void sim_result_out(struct sim *s, struct sim_worker *w, uint8_t *buf, size_t len) {
    sim_send(s, w, buf, len, "StepResult");
    if (w->plans_waiting > 0) w->plans_waiting--;
    w->result_sent_us = w->plans_waiting == 0 ? sim_now_us() : 0;
}

/* A plan for w: the last stage answers it; the others only count it, as a
 * real middle stage sends nothing to the router on success. */
/* --step-ms "T1:MS1,T2:MS2,...": at least two points, tokens increasing,
 * times positive.  0, or -1 with err naming the flag and the value. */
static int sim_parse_step_ms(struct sim *s, const char *text, char *err, size_t errlen) {
    s->n_pts = 0;
    const char *p = text;
    while (*p) {
        char *end;
        double t = strtod(p, &end);
        double ms = -1;
        if (end != p && *end == ':') {
            p = end + 1;
            ms = strtod(p, &end);
        }
        if (end == p || (*end && *end != ',') || !(t >= 1) || !(ms > 0) || s->n_pts == SIM_STEP_POINTS ||
            (s->n_pts > 0 && t <= s->pt_tokens[s->n_pts - 1])) {
            snprintf(err, errlen,
                     "--step-ms '%s': expected up to %d points TOKENS:MS with tokens >= 1 and increasing and "
                     "times > 0, separated by commas, e.g. 1:2.3,64:8.1,640:25.4",
                     text, SIM_STEP_POINTS);
            return -1;
        }
        s->pt_tokens[s->n_pts] = t;
        s->pt_us[s->n_pts++] = ms * 1000.0;
        p = *end ? end + 1 : end;
    }
    if (s->n_pts < 2) {
        snprintf(err, errlen, "--step-ms '%s': give at least two points TOKENS:MS", text);
        return -1;
    }
    return 0;
}

/* A step's time under --step-ms: linear between the two points around its
 * tokens, and along the first or last two beyond them (never below 0). */
static int64_t sim_step_us(const struct sim *s, double tokens) {
    int i = 1;
    while (i < s->n_pts - 1 && tokens > s->pt_tokens[i]) i++;
    double t0 = s->pt_tokens[i - 1], t1 = s->pt_tokens[i], u0 = s->pt_us[i - 1], u1 = s->pt_us[i];
    double us = u0 + (u1 - u0) * (tokens - t0) / (t1 - t0);
    return us > 0 ? (int64_t)us : 0;
}

static void sim_plan(struct sim *s, struct sim_worker *w, const Llm__StepPlan *p) {
    s->w_plans++;
    if (p->epoch < w->epoch) {
        s->w_dropped++;
        return;
    }
    if (p->epoch > w->epoch) w->epoch = p->epoch; /* the RegisterReply is late: follow the plan */
    if (p->n_seqs == 0) return; /* frees only: a real stage neither computes nor answers */
    bool last = w->stage + 1 == (uint32_t)s->stages;
    w->last_step_id = p->step_id;
    w->steps_total++;
    uint32_t blocks = 0;
    for (size_t i = 0; i < p->n_seqs; i++) blocks += (uint32_t)p->seqs[i]->n_block_table;
    w->kv_used = blocks;
    if (!last) return;
    int64_t now = sim_now_us();
    if (w->result_sent_us > 0) sim_turn_add(s, now - w->result_sent_us);
    w->result_sent_us = 0;
    w->plans_waiting++;

    Llm__StepResult r = LLM__STEP_RESULT__INIT;
    Llm__Error e;
    r.step_id = p->step_id;
    r.pipeline_id = p->pipeline_id;
    r.epoch = p->epoch;
    r.worker_id = w->id;
    r.stage_index = w->stage;
    if (p->pipeline_id != w->pipeline) {
        char msg[160];
        snprintf(msg, sizeof msg, "step %" PRIu64 " is for pipeline %u; this worker serves pipeline %u",
                 p->step_id, p->pipeline_id, w->pipeline);
        proto_error_init(&e, LLM__ERROR__CODE__INVALID_ARGUMENT, "", msg, 0);
        r.error = &e;
    } else {
        if (p->n_seqs > s->res_cap) {
            size_t cap = p->n_seqs * 2;
            Llm__SeqResult *a = realloc(s->res, cap * sizeof *a);
            if (a) s->res = a;
            Llm__SeqResult **b = a ? realloc(s->resp, cap * sizeof *b) : NULL;
            if (b) s->resp = b;
            if (!a || !b) {
                LOG(LL_ERROR, "worker %s: out of memory for a result of %zu sequences", w->id, p->n_seqs);
                return;
            }
            s->res_cap = cap;
        }
        for (size_t i = 0; i < p->n_seqs; i++) {
            const Llm__SeqPlan *sp = p->seqs[i];
            llm__seq_result__init(&s->res[i]);
            s->res[i].seq_id = sp->seq_id;
            s->res[i].token = sp->want_logits ? sim_token(s, sp->seq_id, sp->start_pos + sp->n_tokens) : -1;
            if (sp->want_logits) {
                w->tokens_total++;
                s->w_tokens++;
            }
            s->resp[i] = &s->res[i];
        }
        r.n_seqs = p->n_seqs;
        r.seqs = s->resp;
    }
    Llm__WorkerEnvelope env = LLM__WORKER_ENVELOPE__INIT;
    env.body_case = LLM__WORKER_ENVELOPE__BODY_RESULT;
    env.result = &r;
    uint8_t *buf = NULL;
    size_t len = 0;
    char err[256];
    if (proto_worker_pack(&env, &buf, &len, err, sizeof err) < 0) {
        LOG(LL_ERROR, "worker %s: step %" PRIu64 ": cannot pack the result: %s", w->id, p->step_id, err);
        return;
    }
    s->w_results++;
    w->steps_window++;
    int64_t due = now + s->step_us;
    if (s->n_pts > 0) {
        double tokens = 0;
        for (size_t i = 0; i < p->n_seqs; i++) tokens += (double)p->seqs[i]->n_tokens;
        due = (w->busy_until_us > now ? w->busy_until_us : now) + sim_step_us(s, tokens);
        w->busy_until_us = due;
    } else if (s->step_us <= 0) {
        sim_result_out(s, w, buf, len);
        return;
    }
    if (s->q_n == s->q_cap) {
        size_t cap = s->q_cap ? s->q_cap * 2 : 1024;
        struct sim_delayed *q = realloc(s->q, cap * sizeof *q);
        if (!q) {
            LOG(LL_ERROR, "worker %s: out of memory holding a result: sent now", w->id);
            sim_result_out(s, w, buf, len);
            return;
        }
        s->q = q;
        s->q_cap = cap;
    }
    s->q[s->q_n++] = (struct sim_delayed){due, (int32_t)(w - s->w), buf, len};
}

static void sim_message(struct sim *s, struct sim_worker *w, const struct zio_parts *in) {
    if (in->n != 1) {
        char msg[128];
        snprintf(msg, sizeof msg, "a message to a worker is one frame, this one has %zu", in->n);
        sim_error_reply(s, w, LLM__ERROR__CODE__INVALID_ARGUMENT, msg);
        return;
    }
    Llm__WorkerEnvelope *env = NULL;
    char why[256];
    int rc = proto_worker_unpack(zio_parts_data(in, 0), zio_parts_size(in, 0), &env, why, sizeof why);
    if (rc < 0) {
        LOG(LL_WARN, "worker %s: frame refused: %s", w->id, why);
        sim_error_reply(s, w, proto_code_from_status(rc), why);
        return;
    }
    switch (env->body_case) {
    case LLM__WORKER_ENVELOPE__BODY_PLAN:
        if (w->registered) sim_plan(s, w, env->plan);
        else s->w_dropped++;
        break;
    case LLM__WORKER_ENVELOPE__BODY_REGISTER_REPLY: {
        const Llm__RegisterReply *r = env->register_reply;
        if (r->accepted) {
            if (!w->registered) LOG(LL_DEBUG, "worker %s: registered, epoch %" PRIu64, w->id, r->epoch);
            w->registered = true;
            w->epoch = r->epoch;
            w->hb_ms = r->heartbeat_interval_ms ? r->heartbeat_interval_ms : SIM_HEARTBEAT_DEFAULT_MS;
            w->next_hb_us = sim_now_us(); /* READY at once: nothing to load */
            s->next_timer_us = 0;
        } else {
            const char *msg = r->error && r->error->message[0] ? r->error->message : "no reason given";
            uint32_t retry = r->error ? r->error->retry_after_ms : 0;
            w->registered = false;
            if (retry > 0) {
                LOG(LL_INFO, "worker %s: router asks to register again in %u ms (%s)", w->id, retry, msg);
                w->next_register_us = sim_now_us() + (int64_t)retry * 1000;
                if (w->next_register_us < s->next_timer_us) s->next_timer_us = w->next_register_us;
            } else {
                LOG(LL_ERROR, "router %s refused worker %s: %s", s->router, w->id, msg);
                w->dead = true;
            }
        }
        break;
    }
    case LLM__WORKER_ENVELOPE__BODY_ERROR:
        LOG(LL_WARN, "worker %s: router error %s: %s", w->id, proto_code_name(env->error->code),
            env->error->message);
        break;
    default: {
        char msg[128];
        snprintf(msg, sizeof msg, "a worker does not take envelope body %d from the router", (int)env->body_case);
        sim_error_reply(s, w, LLM__ERROR__CODE__UNIMPLEMENTED, msg);
        break;
    }
    }
    proto_worker_free(env);
}

/* Reads w until no message is left (see the file comment on ZMQ_FD). */
static void sim_drain(struct sim *s, struct sim_worker *w, struct zio_parts *in) {
    while (w->dirty) {
        w->dirty = false;
        int events = 0;
        size_t sz = sizeof events;
        if (zmq_getsockopt(zio_sock_raw(w->sock), ZMQ_EVENTS, &events, &sz) != 0 || !(events & ZMQ_POLLIN))
            return;
        for (int k = 0; k < 64 && zio_recv(w->sock, in, 0) == 0; k++) sim_message(s, w, in);
        w->dirty = true; /* look again: a send may have eaten the signal */
    }
}

static int sim_cmp_u32(const void *a, const void *b) {
    uint32_t x = *(const uint32_t *)a, y = *(const uint32_t *)b;
    return x < y ? -1 : x > y;
}

static uint32_t sim_pct(const uint32_t *v, size_t n, double q) {
    if (n == 0) return 0;
    size_t k = (size_t)(q * (double)n + 0.999999);
    if (k < 1) k = 1;
    if (k > n) k = n;
    return v[k - 1];
}

static double sim_cpu_s(void) {
    struct rusage ru;
    getrusage(RUSAGE_SELF, &ru);
    return (double)ru.ru_utime.tv_sec + (double)ru.ru_utime.tv_usec * 1e-6 + (double)ru.ru_stime.tv_sec +
           (double)ru.ru_stime.tv_usec * 1e-6;
}

/* Writes the window's figures to the stats file and starts a new window. */
static void sim_write_stats(struct sim *s) {
    static double cpu_mark;
    int64_t now = sim_now_us();
    double window = (double)(now - s->window_start_us) * 1e-6, cpu = sim_cpu_s();
    qsort(s->turn, s->n_turn, sizeof *s->turn, sim_cmp_u32);
    uint64_t smin = UINT64_MAX, smax = 0;
    int registered = 0;
    for (int i = 0; i < s->n_w; i++) {
        struct sim_worker *w = &s->w[i];
        registered += w->registered;
        if (w->stage + 1 != (uint32_t)s->stages) continue;
        if (w->steps_window < smin) smin = w->steps_window;
        if (w->steps_window > smax) smax = w->steps_window;
        w->steps_window = 0;
    }
    if (smin == UINT64_MAX) smin = 0;
    s->snapshots++;
    if (s->stats_file && s->stats_file[0]) {
        char tmp[1100];
        snprintf(tmp, sizeof tmp, "%s.tmp", s->stats_file);
        FILE *f = fopen(tmp, "w");
        if (!f) {
            LOG(LL_ERROR, "--stats-file %s: %s", tmp, strerror(errno));
        } else {
            fprintf(f,
                    "{\"snapshot\": %" PRIu64 ", \"window_s\": %.6f, \"workers\": %d, \"registered\": %d, "
                    "\"results\": %" PRIu64 ", \"tokens\": %" PRIu64 ", \"plans\": %" PRIu64
                    ", \"dropped\": %" PRIu64 ", \"pipeline_steps_min\": %" PRIu64 ", \"pipeline_steps_max\": %" PRIu64
                    ", \"turnaround_n\": %zu, \"turnaround_us_p50\": %u, \"turnaround_us_p90\": %u, "
                    "\"turnaround_us_p99\": %u, \"turnaround_us_max\": %u, \"cpu_s\": %.6f}\n",
                    s->snapshots, window, s->n_w, registered, s->w_results, s->w_tokens, s->w_plans, s->w_dropped,
                    smin, smax, s->n_turn, sim_pct(s->turn, s->n_turn, 0.5), sim_pct(s->turn, s->n_turn, 0.9),
                    sim_pct(s->turn, s->n_turn, 0.99), s->n_turn ? s->turn[s->n_turn - 1] : 0, cpu - cpu_mark);
            if (fclose(f) != 0 || rename(tmp, s->stats_file) != 0)
                LOG(LL_ERROR, "--stats-file %s: %s", s->stats_file, strerror(errno));
        }
    }
    cpu_mark = cpu;
    s->window_start_us = now;
    s->w_results = s->w_tokens = s->w_plans = s->w_dropped = 0;
    s->n_turn = 0;
}

static int sim_open(struct sim *s, char *err, size_t errlen) {
    s->n_w = s->pipelines * s->stages;
    s->w = calloc((size_t)s->n_w, sizeof *s->w);
    if (!s->w) {
        snprintf(err, errlen, "out of memory for %d workers", s->n_w);
        return STATUS_NO_MEMORY;
    }
    /* Two descriptors per socket (its signal and its TCP connection). */
    struct rlimit rl;
    if (getrlimit(RLIMIT_NOFILE, &rl) == 0 && rl.rlim_cur < rl.rlim_max) {
        rl.rlim_cur = rl.rlim_max;
        setrlimit(RLIMIT_NOFILE, &rl);
    }
    s->zctx = zmq_ctx_new();
    if (!s->zctx) {
        snprintf(err, errlen, "zmq_ctx_new: %s", zmq_strerror(errno));
        return STATUS_IO;
    }
    zmq_ctx_set(s->zctx, ZMQ_MAX_SOCKETS, s->n_w + 64);
    s->ep = epoll_create1(EPOLL_CLOEXEC);
    if (s->ep < 0) {
        snprintf(err, errlen, "epoll_create1: %s", strerror(errno));
        return STATUS_IO;
    }
    int64_t now = sim_now_us();
    uint64_t base = (uint64_t)sim_unix_ms() * 1000;
    for (int i = 0; i < s->n_w; i++) {
        struct sim_worker *w = &s->w[i];
        w->pipeline = (uint32_t)(s->first_pipeline + i / s->stages);
        w->stage = (uint32_t)(i % s->stages);
        snprintf(w->id, sizeof w->id, "%s-p%u-s%u", s->prefix, w->pipeline, w->stage);
        w->incarnation = base + (uint64_t)i;
        w->hb_ms = SIM_HEARTBEAT_DEFAULT_MS;
        /* Spread the registrations and heartbeats over the first interval
         * instead of a burst every second. */
        w->next_register_us = now + (int64_t)i * 1000000 / s->n_w;
        w->dirty = true;
        int rc = zio_sock_open(s->zctx, ZMQ_DEALER, &w->sock, err, errlen);
        if (rc < 0) return rc;
        zio_set_int(w->sock, ZMQ_SNDHWM, 100000);
        zio_set_int(w->sock, ZMQ_RCVHWM, 100000);
        if (!s->insecure && (rc = zio_curve_client(w->sock, &s->kp, s->router_pub)) < 0) {
            snprintf(err, errlen, "worker %s: CURVE: %s", w->id, zio_errstr(w->sock));
            return rc;
        }
        if ((rc = zio_set_bytes(w->sock, ZMQ_ROUTING_ID, w->id, strlen(w->id))) < 0 ||
            (rc = zio_connect(w->sock, s->router)) < 0) {
            snprintf(err, errlen, "worker %s: %s", w->id, zio_errstr(w->sock));
            return rc;
        }
        int fd = -1;
        size_t sz = sizeof fd;
        if (zmq_getsockopt(zio_sock_raw(w->sock), ZMQ_FD, &fd, &sz) != 0) {
            snprintf(err, errlen, "worker %s: ZMQ_FD: %s", w->id, zmq_strerror(errno));
            return STATUS_IO;
        }
        struct epoll_event ev = {.events = EPOLLIN, .data.u32 = (uint32_t)i};
        if (epoll_ctl(s->ep, EPOLL_CTL_ADD, fd, &ev) != 0) {
            snprintf(err, errlen, "worker %s: epoll_ctl: %s", w->id, strerror(errno));
            return STATUS_IO;
        }
    }
    return 0;
}

static void sim_close(struct sim *s) {
    for (size_t i = 0; i < s->q_n; i++) free(s->q[i].buf);
    free(s->q);
    for (int i = 0; s->w && i < s->n_w; i++) zio_sock_close(s->w[i].sock);
    free(s->w);
    if (s->ep >= 0) close(s->ep);
    if (s->zctx) zmq_ctx_term(s->zctx);
    free(s->res);
    free(s->resp);
    free(s->turn);
    modelinfo_free(&s->mi);
}

static int sim_run(struct sim *s) {
    struct zio_parts in = {0};
    struct epoll_event evs[256];
    s->window_start_us = sim_now_us();
    int64_t next_report = sim_now_us() + 10000000;
    while (!sim_stop) {
        if (sim_snapshot) {
            sim_snapshot = 0;
            sim_write_stats(s);
        }
        int64_t now = sim_now_us();
        int64_t wake = now + 100000;
        /* Registrations and heartbeats: a scan of every worker only when
         * the earliest of their times has come. */
        if (now >= s->next_timer_us) {
            int alive = 0, registered = 0;
            s->next_timer_us = now + 100000;
            for (int i = 0; i < s->n_w; i++) {
                struct sim_worker *w = &s->w[i];
                if (w->dead) continue;
                alive++;
                registered += w->registered;
                if (!w->registered && now >= w->next_register_us) {
                    sim_register(s, w);
                    w->next_register_us = now + SIM_REGISTER_RETRY_MS * 1000;
                }
                if (w->registered && now >= w->next_hb_us) {
                    sim_heartbeat(s, w);
                    w->next_hb_us = now + (int64_t)w->hb_ms * 1000;
                }
                int64_t t = w->registered ? w->next_hb_us : w->next_register_us;
                if (t < s->next_timer_us) s->next_timer_us = t;
                if (w->dirty) sim_drain(s, w, &in);
            }
            if (alive == 0) {
                LOG(LL_ERROR, "every simulated worker was refused by the router: stopping");
                zio_parts_free(&in);
                return 1;
            }
            if (now >= next_report) {
                LOG(LL_INFO, "%d of %d simulated workers registered", registered, s->n_w);
                next_report = now + 10000000;
            }
        }
        if (s->next_timer_us < wake) wake = s->next_timer_us;
        /* Results whose time has come (held ones keep their order). */
        size_t kept = 0, n_held = s->q_n;
        for (size_t i = 0; i < n_held; i++) {
            struct sim_delayed d = s->q[i];
            if (d.due_us > sim_now_us()) {
                if (d.due_us < wake) wake = d.due_us;
                s->q[kept++] = d;
                continue;
            }
            struct sim_worker *w = &s->w[d.worker];
            sim_result_out(s, w, d.buf, d.len);
            sim_drain(s, w, &in);
        }
        /* sim_drain may have held new results behind the old ones. */
        memmove(s->q + kept, s->q + n_held, (s->q_n - n_held) * sizeof *s->q);
        s->q_n = kept + (s->q_n - n_held);
        for (size_t i = kept; i < s->q_n; i++)
            if (s->q[i].due_us < wake) wake = s->q[i].due_us;
        /* Whole milliseconds in epoll, the rest spun: step times of a few
         * ms are what --step-ms models. */
        int64_t wait_us = wake - sim_now_us();
        int timeout = wait_us <= 0 ? 0 : (int)(wait_us / 1000);
        int n = epoll_wait(s->ep, evs, (int)(sizeof evs / sizeof evs[0]), timeout);
        for (int k = 0; k < n; k++) {
            struct sim_worker *w = &s->w[evs[k].data.u32];
            w->dirty = true;
            sim_drain(s, w, &in);
        }
    }
    zio_parts_free(&in);
    return 0;
}

int main(int argc, char **argv) {
    struct sim s;
    memset(&s, 0, sizeof s);
    s.ep = -1;
    int log_level = LL_INFO;
    static const char *const levels[] = {"debug", "info", "warn", "error", "none", NULL};
    const struct option_def defs[] = {
        {"router", "LLM_ROUTER", OPTION_STRING, "tcp://127.0.0.1:5556", "the router's worker endpoint", &s.router, 0,
         0, NULL},
        {"model", "LLM_MODEL", OPTION_STRING, NULL,
         "the router's model file (read for its name, vocabulary and layers; never loaded)", &s.model, 0, 0, NULL},
        {"pipelines", NULL, OPTION_INT, "1", "pipelines to simulate", &s.pipelines, 1, 4096, NULL},
        {"stages", NULL, OPTION_INT, "1", "stages per pipeline (one worker each)", &s.stages, 1, 64, NULL},
        {"first-pipeline", NULL, OPTION_INT, "0", "id of the first pipeline (the others follow)", &s.first_pipeline,
         0, 1000000, NULL},
        {"worker-prefix", NULL, OPTION_STRING, "sim", "worker ids are PREFIX-pP-sS", &s.prefix, 0, 0, NULL},
        {"kv-blocks", NULL, OPTION_INT, "65536", "KV blocks each worker states", &s.kv_blocks, 1, 1 << 30, NULL},
        {"kv-block-size", NULL, OPTION_INT, "16", "tokens per KV block", &s.kv_block_size, 1, 4096, NULL},
        {"max-step-tokens", NULL, OPTION_INT, "0", "tokens per step each worker states (0: no limit)",
         &s.max_step_tokens, 0, 1 << 30, NULL},
        {"max-step-seqs", NULL, OPTION_INT, "0", "sequences per step each worker states (0: no limit)",
         &s.max_step_seqs, 0, 1 << 30, NULL},
        {"step-us", NULL, OPTION_INT, "0", "microseconds the last stage holds each result (0: answer at once)",
         &s.step_us, 0, 60000000, NULL},
        {"step-ms", NULL, OPTION_STRING, "",
         "the last stage holds each result for a time that follows the step's tokens: TOKENS:MS points, "
         "comma-separated, linear between them and beyond the outer ones (e.g. 1:2.3,64:8.1,640:25.4); "
         "a worker's steps then run one after another; replaces --step-us",
         &s.step_ms, 0, 0, NULL},
        {"vocab", NULL, OPTION_INT, "0", "vocabulary size for the synthetic tokens (0: the model's)", &s.vocab, 0,
         1 << 30, NULL},
        {"stats-file", NULL, OPTION_STRING, "", "on SIGUSR1, write the figures since the last SIGUSR1 here (JSON)",
         &s.stats_file, 0, 0, NULL},
        {"curve-key-file", "LLM_CURVE_KEY_FILE", OPTION_STRING, NULL,
         "the workers' CURVE key pair (NAME.key from llm keygen; all simulated workers share it)", &s.key_file, 0,
         0, NULL},
        {"router-key", "LLM_ROUTER_KEY", OPTION_STRING, NULL, "the router's public key file (NAME.pub)",
         &s.router_key, 0, 0, NULL},
        {"insecure", "LLM_INSECURE", OPTION_BOOL, "false", "plain ZeroMQ sockets, no CURVE", &s.insecure, 0, 0,
         NULL},
        {"log-level", "LLM_LOG_LEVEL", OPTION_CHOICE, "info", "log level", &log_level, 0, 0, levels},
    };
    struct options o = {"sim_worker", "[options]",
                        "Simulated workers without a model: pipelines x stages ZeroMQ workers that register with "
                        "a router and answer its step plans with synthetic tokens.",
                        defs, (int)(sizeof defs / sizeof defs[0]), false};
    char err[1024];
    int rc = options_parse(&o, &argc, argv, err, sizeof err);
    if (rc == STATUS_CANCELLED) return 0;
    if (rc < 0) {
        fprintf(stderr, "sim_worker: %s\n", err);
        return 2;
    }
    if (argc > 1) {
        fprintf(stderr, "sim_worker: unexpected argument \"%s\" (see --help)\n", argv[1]);
        return 2;
    }
    if (s.step_ms && s.step_ms[0] && sim_parse_step_ms(&s, s.step_ms, err, sizeof err) < 0) {
        fprintf(stderr, "sim_worker: %s\n", err);
        return 2;
    }
    log_set_process("sim_worker");
    log_set_level(log_level);
    /* As every process of the cluster: CURVE with a key pair, or plain
     * sockets only when asked for by name. */
    if (s.insecure) {
        LOG(LL_WARN, "sim_worker: --insecure: plain ZeroMQ sockets, no authentication or encryption");
    } else if (!s.key_file || !s.key_file[0]) {
        fprintf(stderr, "sim_worker: no --curve-key-file (LLM_CURVE_KEY_FILE) and no --insecure (LLM_INSECURE): "
                        "give the workers' key pair and --router-key, or ask for plain sockets\n");
        return 2;
    } else if (!s.router_key || !s.router_key[0]) {
        fprintf(stderr, "sim_worker: --curve-key-file needs --router-key (LLM_ROUTER_KEY), the router's public key\n");
        return 2;
    } else if (keys_pair_load(s.key_file, &s.kp, err, sizeof err) < 0 ||
               keys_pub_load(s.router_key, s.router_pub, err, sizeof err) < 0) {
        fprintf(stderr, "sim_worker: %s\n", err);
        return 2;
    }
    if (!s.model || !s.model[0]) {
        fprintf(stderr, "sim_worker: --model is required (the router's model file: its name, vocabulary and layers)\n");
        return 2;
    }
    if ((rc = modelinfo_load(&s.mi, s.model, err, sizeof err)) < 0) {
        fprintf(stderr, "sim_worker: --model %s: %s\n", s.model, err);
        return 2;
    }
    modelinfo_basename(s.model, s.model_id, sizeof s.model_id);
    if (s.stages > s.mi.n_layers) {
        fprintf(stderr, "sim_worker: --stages %d: model %s has %d layers\n", s.stages, s.model_id, s.mi.n_layers);
        modelinfo_free(&s.mi);
        return 2;
    }
    int32_t vocab = s.vocab > 0 ? s.vocab : s.mi.n_vocab;
    if (vocab < 8) {
        fprintf(stderr, "sim_worker: vocabulary of %d tokens (give --vocab)\n", vocab);
        modelinfo_free(&s.mi);
        return 2;
    }
    s.tok_lo = vocab > 600 ? 300 : vocab / 2;
    s.tok_n = vocab - s.tok_lo;
    signal(SIGPIPE, SIG_IGN);
    struct sigaction sa;
    memset(&sa, 0, sizeof sa);
    sa.sa_handler = sim_on_stop;
    sigaction(SIGINT, &sa, NULL);
    sigaction(SIGTERM, &sa, NULL);
    sa.sa_handler = sim_on_usr1;
    sigaction(SIGUSR1, &sa, NULL);
    if ((rc = sim_open(&s, err, sizeof err)) < 0) {
        fprintf(stderr, "sim_worker: %s\n", err);
        sim_close(&s);
        return 1;
    }
    LOG(LL_INFO, "sim_worker: %d pipelines x %d stages (ids %s-p%d-s0 ...) registering with %s, model %s, "
        "results %s", s.pipelines, s.stages, s.prefix, s.first_pipeline, s.router, s.model_id,
        s.n_pts > 0 ? "after --step-ms" : s.step_us > 0 ? "after --step-us" : "at once");
    rc = sim_run(&s);
    sim_close(&s);
    return rc;
}
