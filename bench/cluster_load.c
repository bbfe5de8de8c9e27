/* bench_cluster's load generator: on a running cluster, the warm-up and
 * every concurrency level, each a closed loop or (--rate) an open loop of
 * Poisson arrivals, with distinct or shared-prefix prompts and optionally
 * --json-schema; the streams' TTFT and inter-token samples, and the router's
 * and workers' counters read around each level, fill the level's row. */
#include "bench/cluster_bench.h"

#include "clients/c/client.h"

#include "common/status.h"

#include <math.h>
#include <pthread.h>
#include <stdarg.h>
#include <stdatomic.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>
#include <zmq.h>

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

/* ---- Every level of one cluster ---- */

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
int cb_levels(const struct cb_opts *o, const struct cb_cluster *cl, const char *endpoint, char *err,
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
