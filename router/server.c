/* The router's event loop: client requests in (validated, tokenized, made
 * durable in Redis, then acknowledged), step plans out to the pipelines'
 * stages, sampled tokens back (persisted, detokenized, streamed), and the
 * bookkeeping around them: re-attach, cancel, deadlines, worker liveness,
 * pipelines joining, draining and failing.  Single-threaded: every state
 * change happens here, between two zmq_poll calls. */
#include "router/server.h"

#include <errno.h>
#include <inttypes.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>
#include <unistd.h>
#include <zmq.h>

#include "common/log.h"
#include "common/rconn.h"
#include "common/sampling.h"
#include "common/status.h"
#include "common/tokenizer.h"
#include "common/zio.h"
#include "proto/request.h"
#include "proto/wire.h"
#include "router/modelinfo.h"
#include "router/registry.h"
#include "router/requests.h"
#include "router/scheduler.h"

#define SERVER_BUCKETS 4096
#define SERVER_BUILD "llm-router 0.1"
#define SERVER_FAILURES_MAX 4   /* failed steps a request survives before ABORTED */
#define SERVER_DONE_MEMORY_MAX 20000

enum req_state { REQ_QUEUED = 0, REQ_ASSIGNED = 1, REQ_DONE = 2 };

struct lp {
    int32_t token;
    float logprob;
    int32_t n_top;
    int32_t top_token[SAMPLING_TOP_LOGPROBS_MAX];
    float top_logprob[SAMPLING_TOP_LOGPROBS_MAX];
};

struct pipe;

struct req {
    char id[PROTO_REQUEST_ID_MAX + 1];
    struct req *hnext;             /* by id */
    struct req *snext;             /* by seq id, while assigned */
    struct req *prev, *next;       /* every request in memory */
    uint8_t *params;               /* canonical GenerateRequest bytes */
    size_t params_len;
    Llm__GenerateRequest *gen;     /* params unpacked */
    struct sampling_params sp;
    Llm__SamplingParams spm;       /* points into sp */
    int32_t *prompt;
    int32_t n_prompt;
    int32_t *out;                  /* generated tokens */
    int32_t n_out, cap_out;
    int32_t n_persisted;           /* of out, appended to Redis */
    struct lp *lps;                /* one per out token when logprobs were asked */
    uint64_t seed;
    int64_t created_ms, deadline_ms, done_ms;
    int32_t priority;
    int32_t limit;                 /* prompt + completion tokens, at most */
    uint64_t order;
    enum req_state state;
    struct pipe *pipe;
    struct sched_seq *seq;
    uint64_t seq_id, step;         /* step: the step in flight holding it, 0 if none */
    int failures;
    /* The client connection it streams to. */
    uint8_t ident[256];
    size_t ident_len;
    bool stream;
    uint32_t resume_from;          /* non-streaming: first token of the final chunk */
    int32_t n_sent;                /* tokens sent in chunks */
    /* Detokenized output. */
    struct detok dt;
    char *text;
    size_t text_len, text_cap, text_sent, text_checked;
    /* Finish. */
    int32_t finish, stop_token, error_code;
    char *stop_string, *error_message;
    char entry[RCONN_ID_MAX];
    bool finish_stored;            /* reqstore_finish succeeded */
    bool touched, finishing;
};

struct flight {
    uint64_t step_id;
    int64_t sent_ms;
    int32_t n;
    uint64_t *seq_ids;
    bool *want;
};

struct pipe {
    struct pipeline *p;
    sched *sched;
    uint64_t epoch;
    struct flight *flights;
    int32_t n_flights, max_flights;
    int32_t max_batch;
    /* Plan packing buffers, max_batch entries. */
    Llm__SeqPlan *seqplans;
    Llm__SeqPlan **seqptrs;
    Llm__BlockCopy *copies;
    Llm__BlockCopy **copyptrs;
    /* Throughput. */
    uint64_t gen_tokens, prompt_tokens, gen_mark, prompt_mark;
    double tok_s, prompt_tok_s;
    char last_problem[256];
};

struct server {
    struct server_config cfg;
    struct modelinfo mi;
    tokenizer *tok;
    void *zctx;
    struct zio_sock *cs, *ws; /* clients, workers */
    reqstore *rs;
    bool recovered;
    registry *reg;
    struct req *by_id[SERVER_BUCKETS];
    struct req *by_seq[SERVER_BUCKETS];
    struct req *all;
    size_t n_reqs, n_done;
    struct req **queue;
    size_t n_queue, cap_queue;
    struct req **touched;
    size_t n_touched, cap_touched;
    uint64_t next_order, next_seq_id, next_step_id;
    int32_t *scratch;
    size_t cap_scratch;
    char *detok_buf;
    size_t detok_size;
    /* Counters. */
    uint64_t requests_total, frames_bad, steps_total, sends_dropped, stale_results;
    double plan_us_sum, plan_us_max, turn_us_sum;
    uint64_t plan_n, turn_n;
    int64_t start_ms, last_timer_ms, last_keys_ms, last_redis_try_ms, last_rate_ms, last_stats_ms;
    uint64_t stats_steps_mark;
    uint64_t rate_gen_mark, rate_prompt_mark, gen_total, prompt_total;
    double tok_s, prompt_tok_s;
};

/* ------------------------------------------------------------------------ */

static int64_t now_ms(void) {
    struct timespec ts;
    clock_gettime(CLOCK_REALTIME, &ts);
    return (int64_t)ts.tv_sec * 1000 + ts.tv_nsec / 1000000;
}

static int64_t mono_us(void) {
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (int64_t)ts.tv_sec * 1000000 + ts.tv_nsec / 1000;
}

static uint32_t hash_str(const char *s) {
    uint32_t h = 2166136261u;
    for (; *s; s++) h = (h ^ (uint8_t)*s) * 16777619u;
    return h % SERVER_BUCKETS;
}

static uint32_t hash_u64(uint64_t x) {
    x ^= x >> 33;
    x *= 0xff51afd7ed558ccdull;
    x ^= x >> 33;
    return (uint32_t)(x % SERVER_BUCKETS);
}

static struct req *req_find(server *s, const char *id) {
    for (struct req *q = s->by_id[hash_str(id)]; q; q = q->hnext)
        if (strcmp(q->id, id) == 0) return q;
    return NULL;
}

static struct req *req_by_seq(server *s, uint64_t seq_id) {
    for (struct req *q = s->by_seq[hash_u64(seq_id)]; q; q = q->snext)
        if (q->seq_id == seq_id && q->seq) return q;
    return NULL;
}

static void seq_map_put(server *s, struct req *q) {
    uint32_t h = hash_u64(q->seq_id);
    q->snext = s->by_seq[h];
    s->by_seq[h] = q;
}

static void seq_map_del(server *s, struct req *q) {
    for (struct req **pp = &s->by_seq[hash_u64(q->seq_id)]; *pp; pp = &(*pp)->snext)
        if (*pp == q) {
            *pp = q->snext;
            break;
        }
    q->snext = NULL;
}

static int grow(void **p, size_t *cap, size_t want, size_t elem) {
    if (want <= *cap) return 0;
    size_t n = *cap ? *cap : 64;
    while (n < want) n *= 2;
    void *q = realloc(*p, n * elem);
    if (!q) return STATUS_NO_MEMORY;
    *p = q;
    *cap = n;
    return 0;
}

/* ------------------------------------------------------------------------ */
/* Sending */

static void send_client(server *s, const uint8_t *ident, size_t ident_len, Llm__ClientEnvelope *env) {
    if (ident_len == 0) return;
    uint8_t *buf = NULL;
    size_t len = 0;
    char err[256];
    if (proto_client_pack(env, &buf, &len, err, sizeof err) < 0) {
        LOG(LL_ERROR, "client reply: %s", err);
        return;
    }
    struct zio_frame f[2] = {{ident, ident_len, NULL, NULL}, {buf, len, proto_buf_free, NULL}};
    /* Never block the loop on a slow client: it re-attaches for what it missed. */
    if (zio_send(s->cs, f, 2, ZMQ_DONTWAIT) < 0) {
        s->sends_dropped++;
        LOG(LL_DEBUG, "client send dropped: %s", zio_errstr(s->cs));
    }
}

static void send_client_error(server *s, const uint8_t *ident, size_t ident_len, uint64_t tag,
                              Llm__Error__Code code, const char *rid, const char *msg,
                              uint32_t retry_after_ms) {
    Llm__Error e;
    proto_error_init(&e, code, rid, msg, retry_after_ms);
    Llm__ClientEnvelope env = LLM__CLIENT_ENVELOPE__INIT;
    env.tag = tag;
    env.body_case = LLM__CLIENT_ENVELOPE__BODY_ERROR;
    env.error = &e;
    LOG(LL_DEBUG, "request %s: %s: %s", rid && rid[0] ? rid : "-", proto_code_name(code), msg);
    send_client(s, ident, ident_len, &env);
}

static void send_worker(server *s, const uint8_t *ident, size_t ident_len, const uint8_t *buf, size_t len) {
    struct zio_frame f[2] = {{ident, ident_len, NULL, NULL}, {buf, len, NULL, NULL}};
    if (zio_send(s->ws, f, 2, ZMQ_DONTWAIT) < 0)
        LOG(LL_WARN, "worker send of %zu bytes dropped: %s", len, zio_errstr(s->ws));
}

static void send_worker_env(server *s, const uint8_t *ident, size_t ident_len, Llm__WorkerEnvelope *env) {
    uint8_t *buf = NULL;
    size_t len = 0;
    char err[256];
    if (proto_worker_pack(env, &buf, &len, err, sizeof err) < 0) {
        LOG(LL_ERROR, "worker message: %s", err);
        return;
    }
    send_worker(s, ident, ident_len, buf, len);
    free(buf);
}

/* ------------------------------------------------------------------------ */
/* Requests in memory */

static void req_text_append(struct req *q, const char *t, size_t n) {
    if (n == 0) return;
    if (grow((void **)&q->text, &q->text_cap, q->text_len + n + 1, 1) < 0) return;
    memcpy(q->text + q->text_len, t, n);
    q->text_len += n;
    q->text[q->text_len] = '\0';
}

static void req_free(struct req *q) {
    free(q->params);
    if (q->gen) llm__generate_request__free_unpacked(q->gen, NULL);
    free(q->prompt);
    free(q->out);
    free(q->lps);
    free(q->text);
    free(q->stop_string);
    free(q->error_message);
    free(q);
}

static void req_unlink(server *s, struct req *q) {
    for (struct req **pp = &s->by_id[hash_str(q->id)]; *pp; pp = &(*pp)->hnext)
        if (*pp == q) {
            *pp = q->hnext;
            break;
        }
    if (q->prev) q->prev->next = q->next;
    else s->all = q->next;
    if (q->next) q->next->prev = q->prev;
    s->n_reqs--;
    if (q->state == REQ_DONE) s->n_done--;
}

/* A request from its stored form (new, re-attached after a restart, or
 * recovered); takes nothing from r (copies). */
static struct req *req_new(server *s, const struct reqrec *r, char *err, size_t errlen) {
    struct req *q = calloc(1, sizeof *q);
    if (!q) goto oom;
    snprintf(q->id, sizeof q->id, "%s", r->id);
    q->params = malloc(r->params_len + 1);
    q->prompt = malloc((size_t)r->n_prompt * sizeof *q->prompt);
    q->cap_out = r->n_gen + 64;
    q->out = malloc((size_t)q->cap_out * sizeof *q->out);
    if (!q->params || !q->prompt || !q->out) goto oom;
    memcpy(q->params, r->params, r->params_len);
    q->params_len = r->params_len;
    q->gen = llm__generate_request__unpack(NULL, r->params_len, r->params);
    if (!q->gen) {
        snprintf(err, errlen, "request %s: stored parameters (%zu bytes) do not decode", r->id,
                 r->params_len);
        req_free(q);
        return NULL;
    }
    if (proto_sampling_from_msg(q->gen->sampling, &q->sp, err, errlen) < 0) {
        req_free(q);
        return NULL;
    }
    q->sp.seed = r->seed;
    proto_sampling_to_msg(&q->sp, &q->spm);
    memcpy(q->prompt, r->prompt, (size_t)r->n_prompt * sizeof *q->prompt);
    q->n_prompt = r->n_prompt;
    if (r->n_gen > 0) memcpy(q->out, r->gen, (size_t)r->n_gen * sizeof *q->out);
    q->n_out = q->n_persisted = r->n_gen;
    if (q->sp.logprobs || q->sp.top_logprobs > 0) {
        q->lps = calloc((size_t)q->cap_out, sizeof *q->lps);
        if (!q->lps) goto oom;
        for (int32_t i = 0; i < q->n_out; i++) q->lps[i].token = q->out[i];
    }
    q->seed = r->seed;
    q->created_ms = r->created_ms;
    q->deadline_ms = r->deadline_ms;
    q->priority = q->gen->priority;
    int64_t limit = q->gen->max_tokens ? (int64_t)q->n_prompt + q->gen->max_tokens : s->mi.n_ctx;
    q->limit = (int32_t)(limit < s->mi.n_ctx ? limit : s->mi.n_ctx);
    q->order = ++s->next_order;
    q->stream = q->gen->stream;
    snprintf(q->entry, sizeof q->entry, "%s", r->entry);
    tokenizer_detok_init(&q->dt, 0); /* a continuation keeps its leading space */
    for (int32_t i = 0; i < q->n_out; i++) {
        int n = tokenizer_detok_push(s->tok, &q->dt, q->out[i], s->detok_buf, s->detok_size);
        if (n > 0) req_text_append(q, s->detok_buf, (size_t)n);
    }
    q->text_checked = q->text_len;
    if (r->state == REQREC_DONE) {
        q->state = REQ_DONE;
        q->finish = r->finish;
        q->stop_token = r->stop_token;
        q->error_code = r->error_code;
        q->stop_string = r->stop_string ? strdup(r->stop_string) : NULL;
        q->error_message = r->error_message ? strdup(r->error_message) : NULL;
        q->finish_stored = true;
        q->done_ms = now_ms();
        /* Text of a finished request: its stop string was cut off. */
        if (q->stop_string) {
            char *m = q->text ? memmem(q->text, q->text_len, q->stop_string, strlen(q->stop_string)) : NULL;
            if (m) q->text_len = (size_t)(m - q->text);
        }
    }
    /* Link. */
    uint32_t h = hash_str(q->id);
    q->hnext = s->by_id[h];
    s->by_id[h] = q;
    q->next = s->all;
    if (s->all) s->all->prev = q;
    s->all = q;
    s->n_reqs++;
    if (q->state == REQ_DONE) s->n_done++;
    return q;
oom:
    snprintf(err, errlen, "request %s: out of memory", r->id);
    if (q) req_free(q);
    return NULL;
}

static int queue_push(server *s, struct req *q) {
    if (grow((void **)&s->queue, &s->cap_queue, s->n_queue + 1, sizeof *s->queue) < 0)
        return STATUS_NO_MEMORY;
    s->queue[s->n_queue++] = q;
    q->state = REQ_QUEUED;
    return 0;
}

static void queue_remove(server *s, struct req *q) {
    for (size_t i = 0; i < s->n_queue; i++)
        if (s->queue[i] == q) {
            memmove(&s->queue[i], &s->queue[i + 1], (s->n_queue - i - 1) * sizeof *s->queue);
            s->n_queue--;
            return;
        }
}

static void touch(server *s, struct req *q) {
    if (q->touched) return;
    if (grow((void **)&s->touched, &s->cap_touched, s->n_touched + 1, sizeof *s->touched) < 0) return;
    q->touched = true;
    s->touched[s->n_touched++] = q;
}

/* Bytes of text held back because they may start a stop string. */
static size_t req_stop_hold(const struct req *q) {
    size_t hold = 0;
    for (size_t i = 0; i < q->gen->n_stop; i++) {
        const char *st = q->gen->stop[i];
        size_t L = strlen(st);
        size_t k = L - 1 < q->text_len ? L - 1 : q->text_len;
        for (; k > hold; k--)
            if (memcmp(q->text + q->text_len - k, st, k) == 0) {
                hold = k;
                break;
            }
    }
    return hold;
}

/* Text bytes of the first n tokens (what a fresh detokenizer makes of them). */
static size_t req_text_offset(server *s, const struct req *q, int32_t n) {
    struct detok d;
    tokenizer_detok_init(&d, 0);
    size_t off = 0;
    for (int32_t i = 0; i < n && i < q->n_out; i++) {
        int k = tokenizer_detok_push(s->tok, &d, q->out[i], s->detok_buf, s->detok_size);
        if (k > 0) off += (size_t)k;
    }
    return off < q->text_len ? off : q->text_len;
}

/* One chunk: tokens [from, to) with text bytes [t0, t1). */
static void send_chunk(server *s, struct req *q, int32_t from, int32_t to, size_t t0, size_t t1) {
    if (to <= from && t1 <= t0) return;
    Llm__GenerateChunk c = LLM__GENERATE_CHUNK__INIT;
    c.request_id = q->id;
    c.index = (uint32_t)from;
    c.n_token_ids = (size_t)(to > from ? to - from : 0);
    c.token_ids = q->out + from;
    char *text = malloc(t1 > t0 ? t1 - t0 + 1 : 1);
    if (!text) return;
    if (t1 > t0) memcpy(text, q->text + t0, t1 - t0);
    text[t1 > t0 ? t1 - t0 : 0] = '\0';
    c.text = text;
    Llm__TokenLogprob *lp = NULL, **lpp = NULL;
    Llm__TopLogprob *tops = NULL, **topp = NULL;
    if (q->lps && c.n_token_ids > 0) {
        size_t n = c.n_token_ids;
        lp = calloc(n, sizeof *lp);
        lpp = calloc(n, sizeof *lpp);
        tops = calloc(n * SAMPLING_TOP_LOGPROBS_MAX + 1, sizeof *tops);
        topp = calloc(n * SAMPLING_TOP_LOGPROBS_MAX + 1, sizeof *topp);
        if (lp && lpp && tops && topp) {
            for (size_t i = 0; i < n; i++) {
                const struct lp *l = &q->lps[from + (int32_t)i];
                llm__token_logprob__init(&lp[i]);
                lp[i].token = l->token;
                lp[i].logprob = l->logprob;
                lp[i].n_top = (size_t)l->n_top;
                lp[i].top = topp + i * SAMPLING_TOP_LOGPROBS_MAX;
                for (int32_t k = 0; k < l->n_top; k++) {
                    Llm__TopLogprob *t = &tops[i * SAMPLING_TOP_LOGPROBS_MAX + (size_t)k];
                    llm__top_logprob__init(t);
                    t->token = l->top_token[k];
                    t->logprob = l->top_logprob[k];
                    lp[i].top[k] = t;
                }
                lpp[i] = &lp[i];
            }
            c.n_logprobs = n;
            c.logprobs = lpp;
        }
    }
    Llm__ClientEnvelope env = LLM__CLIENT_ENVELOPE__INIT;
    env.body_case = LLM__CLIENT_ENVELOPE__BODY_CHUNK;
    env.chunk = &c;
    send_client(s, q->ident, q->ident_len, &env);
    free(text);
    free(lp);
    free(lpp);
    free(tops);
    free(topp);
}

static void send_done(server *s, struct req *q, const uint8_t *ident, size_t ident_len) {
    Llm__GenerateDone d = LLM__GENERATE_DONE__INIT;
    Llm__GenerateDone__Usage u = LLM__GENERATE_DONE__USAGE__INIT;
    Llm__Error e;
    d.request_id = q->id;
    d.finish_reason = (Llm__GenerateDone__FinishReason)q->finish;
    u.prompt_tokens = (uint32_t)q->n_prompt;
    u.completion_tokens = (uint32_t)q->n_out;
    d.usage = &u;
    d.stop_token = q->stop_token;
    d.stop_string = q->stop_string ? q->stop_string : "";
    if (q->error_code != LLM__ERROR__CODE__OK) {
        proto_error_init(&e, (Llm__Error__Code)q->error_code, q->id, q->error_message, 0);
        d.error = &e;
    }
    Llm__ClientEnvelope env = LLM__CLIENT_ENVELOPE__INIT;
    env.body_case = LLM__CLIENT_ENVELOPE__BODY_DONE;
    env.done = &d;
    send_client(s, ident, ident_len, &env);
}

/* Streams what the client has not seen yet (streaming requests). */
static void req_stream(server *s, struct req *q) {
    if (!q->stream) return;
    size_t sendable = q->text_len - req_stop_hold(q);
    if (sendable < q->text_sent) sendable = q->text_sent;
    if (q->n_out > q->n_sent || sendable > q->text_sent) {
        send_chunk(s, q, q->n_sent, q->n_out, q->text_sent, sendable);
        q->n_sent = q->n_out;
        q->text_sent = sendable;
    }
}

/* Stores the tokens not yet in Redis for every touched request, in one
 * round trip.  On failure they stay pending and go with the next batch. */
static void persist_touched(server *s) {
    if (!s->rs || s->n_touched == 0) return;
    struct reqstore_append *a = calloc(s->n_touched, sizeof *a);
    if (!a) return;
    size_t n = 0;
    for (size_t i = 0; i < s->n_touched; i++) {
        struct req *q = s->touched[i];
        if (q->n_out > q->n_persisted)
            a[n++] = (struct reqstore_append){q->id, q->out + q->n_persisted, q->n_out - q->n_persisted};
    }
    if (n > 0) {
        if (reqstore_append(s->rs, a, n) == 0) {
            for (size_t i = 0; i < s->n_touched; i++) s->touched[i]->n_persisted = s->touched[i]->n_out;
        } else {
            LOG(LL_WARN, "persisting tokens of %zu requests: %s", n, reqstore_errstr(s->rs));
        }
    }
    free(a);
}

static void req_store_finish(server *s, struct req *q) {
    if (q->finish_stored || !s->rs) return;
    if (q->n_out > q->n_persisted) {
        struct reqstore_append a = {q->id, q->out + q->n_persisted, q->n_out - q->n_persisted};
        if (reqstore_append(s->rs, &a, 1) < 0) {
            LOG(LL_WARN, "request %s: storing its last tokens: %s", q->id, reqstore_errstr(s->rs));
            return;
        }
        q->n_persisted = q->n_out;
    }
    struct reqrec r;
    memset(&r, 0, sizeof r);
    snprintf(r.id, sizeof r.id, "%s", q->id);
    snprintf(r.entry, sizeof r.entry, "%s", q->entry);
    r.finish = q->finish;
    r.stop_token = q->stop_token;
    r.stop_string = q->stop_string;
    r.error_code = q->error_code;
    r.error_message = q->error_message;
    if (reqstore_finish(s->rs, &r) == 0) q->finish_stored = true;
    else LOG(LL_WARN, "request %s: storing its end: %s", q->id, reqstore_errstr(s->rs));
}

/* Takes q off its pipeline (its blocks return; the workers free it with
 * the next step). */
static void req_unassign(server *s, struct req *q) {
    if (q->seq && q->pipe && q->pipe->sched) sched_remove(q->pipe->sched, q->seq);
    if (q->seq) seq_map_del(s, q);
    q->seq = NULL;
    q->pipe = NULL;
    q->step = 0;
}

/* Marks q finished (the stream ends in req_finalize). */
static void req_end(server *s, struct req *q, int32_t finish, int32_t stop_token, const char *stop_string,
                    Llm__Error__Code code, const char *msg) {
    if (q->state == REQ_DONE || q->finishing) return;
    req_unassign(s, q);
    if (q->state == REQ_QUEUED) queue_remove(s, q);
    q->finish = finish;
    q->stop_token = stop_token;
    q->stop_string = stop_string ? strdup(stop_string) : NULL;
    q->error_code = code;
    q->error_message = msg ? strdup(msg) : NULL;
    q->finishing = true;
    touch(s, q);
}

/* The end of a finishing request: flushed text, stored end, last chunk and
 * GenerateDone. */
static void req_finalize(server *s, struct req *q) {
    if (!q->stop_string) {
        char tail[8];
        int n = tokenizer_detok_flush(&q->dt, tail, sizeof tail);
        if (n > 0) req_text_append(q, tail, (size_t)n);
    }
    q->finishing = false;
    q->state = REQ_DONE;
    q->done_ms = now_ms();
    s->n_done++;
    req_store_finish(s, q);
    if (q->stream) {
        if (q->n_out > q->n_sent || q->text_len > q->text_sent)
            send_chunk(s, q, q->n_sent, q->n_out, q->text_sent, q->text_len);
    } else {
        int32_t from = (int32_t)q->resume_from < q->n_out ? (int32_t)q->resume_from : q->n_out;
        send_chunk(s, q, from, q->n_out, req_text_offset(s, q, from), q->text_len);
    }
    q->n_sent = q->n_out;
    q->text_sent = q->text_len;
    send_done(s, q, q->ident, q->ident_len);
    LOG(LL_INFO, "request %s: done (%s%s%s), %d prompt + %d completion tokens", q->id,
        protobuf_c_enum_descriptor_get_value(&llm__generate_done__finish_reason__descriptor, q->finish)
            ? protobuf_c_enum_descriptor_get_value(&llm__generate_done__finish_reason__descriptor, q->finish)->name
            : "?",
        q->error_message ? ": " : "", q->error_message ? q->error_message : "", q->n_prompt, q->n_out);
}

/* After a batch of events: store tokens, stream, end what finished. */
static void flush_touched(server *s) {
    persist_touched(s);
    for (size_t i = 0; i < s->n_touched; i++) {
        struct req *q = s->touched[i];
        q->touched = false;
        if (q->finishing) req_finalize(s, q);
        else if (q->state != REQ_DONE) req_stream(s, q);
    }
    s->n_touched = 0;
}

/* A sampled token for q: record it, check the stop conditions, and give
 * the sequence its next decode input or end it. */
static void req_token(server *s, struct req *q, int32_t token, const Llm__TokenLogprob *lp) {
    if (q->n_out == q->cap_out) {
        int32_t cap = q->cap_out * 2;
        int32_t *o = realloc(q->out, (size_t)cap * sizeof *o);
        struct lp *l = q->lps ? realloc(q->lps, (size_t)cap * sizeof *l) : NULL;
        if (!o || (q->lps && !l)) {
            if (o) q->out = o;
            if (l) q->lps = l;
            req_end(s, q, LLM__GENERATE_DONE__FINISH_REASON__ERROR, -1, NULL,
                    LLM__ERROR__CODE__RESOURCE_EXHAUSTED, "router out of memory");
            return;
        }
        q->out = o;
        q->lps = l;
        q->cap_out = cap;
    }
    if (q->lps) {
        struct lp *l = &q->lps[q->n_out];
        memset(l, 0, sizeof *l);
        l->token = token;
        if (lp) {
            l->logprob = lp->logprob;
            l->n_top = (int32_t)(lp->n_top < SAMPLING_TOP_LOGPROBS_MAX ? lp->n_top : SAMPLING_TOP_LOGPROBS_MAX);
            for (int32_t k = 0; k < l->n_top; k++) {
                l->top_token[k] = lp->top[k] ? lp->top[k]->token : -1;
                l->top_logprob[k] = lp->top[k] ? lp->top[k]->logprob : 0.0f;
            }
        }
    }
    q->out[q->n_out++] = token;
    s->gen_total++;
    if (q->pipe) q->pipe->gen_tokens++;
    touch(s, q);
    int n = tokenizer_detok_push(s->tok, &q->dt, token, s->detok_buf, s->detok_size);
    if (n > 0) req_text_append(q, s->detok_buf, (size_t)n);

    /* Stop strings: search the new text (and what could straddle it). */
    size_t maxl = 0;
    for (size_t i = 0; i < q->gen->n_stop; i++)
        if (strlen(q->gen->stop[i]) > maxl) maxl = strlen(q->gen->stop[i]);
    if (maxl > 0 && q->text_len > q->text_checked) {
        size_t from = q->text_checked > maxl ? q->text_checked - maxl : 0;
        if (from < q->text_sent) from = q->text_sent;
        size_t best = SIZE_MAX;
        const char *which = NULL;
        for (size_t i = 0; i < q->gen->n_stop; i++) {
            const char *m = memmem(q->text + from, q->text_len - from, q->gen->stop[i], strlen(q->gen->stop[i]));
            if (m && (size_t)(m - q->text) < best) {
                best = (size_t)(m - q->text);
                which = q->gen->stop[i];
            }
        }
        q->text_checked = q->text_len;
        if (which) {
            q->text_len = best;
            req_end(s, q, LLM__GENERATE_DONE__FINISH_REASON__STOP, -1, which, LLM__ERROR__CODE__OK, NULL);
            return;
        }
    }
    if ((!q->sp.ignore_eos && tokenizer_is_eog(s->tok, token)) || sampling_is_stop(&q->sp, token)) {
        req_end(s, q, LLM__GENERATE_DONE__FINISH_REASON__STOP, token, NULL, LLM__ERROR__CODE__OK, NULL);
        return;
    }
    if ((q->gen->max_tokens && (uint32_t)q->n_out >= q->gen->max_tokens) || q->n_prompt + q->n_out >= q->limit) {
        req_end(s, q, LLM__GENERATE_DONE__FINISH_REASON__LENGTH, -1, NULL, LLM__ERROR__CODE__OK, NULL);
        return;
    }
    if (q->seq && sched_append(q->pipe->sched, q->seq, token) < 0) {
        /* The scheduler did not expect a token: start the sequence over. */
        sched_restart(q->pipe->sched, q->seq);
    }
}

/* ------------------------------------------------------------------------ */
/* Pipelines */

static void pipe_requeue_all(server *s, struct pipe *pp) {
    for (struct req *q = s->all; q; q = q->next) {
        if (q->pipe != pp || q->state != REQ_ASSIGNED) continue;
        if (q->seq) seq_map_del(s, q);
        q->seq = NULL;
        q->pipe = NULL;
        q->step = 0;
        if (queue_push(s, q) < 0)
            req_end(s, q, LLM__GENERATE_DONE__FINISH_REASON__ERROR, -1, NULL, LLM__ERROR__CODE__INTERNAL,
                    "router out of memory re-queueing");
    }
}

static void pipe_teardown(server *s, struct pipe *pp, const char *why) {
    if (!pp->sched) return;
    struct sched_stats st;
    sched_get_stats(pp->sched, &st);
    LOG(LL_WARN, "pipeline %u out of service (%s): %d running and %d waiting sequences re-queued",
        pp->p ? pp->p->id : 0, why, st.n_running, st.n_waiting);
    pipe_requeue_all(s, pp);
    sched_free(pp->sched);
    pp->sched = NULL;
    pp->n_flights = 0;
}

static void pipe_free(struct pipe *pp) {
    if (!pp) return;
    for (int32_t i = 0; i < pp->max_flights; i++) {
        free(pp->flights[i].seq_ids);
        free(pp->flights[i].want);
    }
    free(pp->flights);
    free(pp->seqplans);
    free(pp->seqptrs);
    free(pp->copies);
    free(pp->copyptrs);
    free(pp);
}

static void on_pipeline_drop(struct pipeline *p, void *ud) {
    server *s = ud;
    struct pipe *pp = p->ud;
    if (!pp) return;
    pipe_teardown(s, pp, "all its workers are gone");
    pipe_free(pp);
    p->ud = NULL;
}

static struct pipe *pipe_of(server *s, struct pipeline *p) {
    if (p->ud) return p->ud;
    struct pipe *pp = calloc(1, sizeof *pp);
    if (!pp) return NULL;
    pp->p = p;
    pp->max_batch = s->cfg.max_batch;
    pp->max_flights = (int32_t)p->stage_count;
    pp->flights = calloc((size_t)pp->max_flights, sizeof *pp->flights);
    pp->seqplans = calloc((size_t)pp->max_batch, sizeof *pp->seqplans);
    pp->seqptrs = calloc((size_t)pp->max_batch, sizeof *pp->seqptrs);
    pp->copies = calloc((size_t)pp->max_batch, sizeof *pp->copies);
    pp->copyptrs = calloc((size_t)pp->max_batch, sizeof *pp->copyptrs);
    bool ok = pp->flights && pp->seqplans && pp->seqptrs && pp->copies && pp->copyptrs;
    for (int32_t i = 0; ok && i < pp->max_flights; i++) {
        pp->flights[i].seq_ids = calloc((size_t)pp->max_batch, sizeof(uint64_t));
        pp->flights[i].want = calloc((size_t)pp->max_batch, sizeof(bool));
        ok = pp->flights[i].seq_ids && pp->flights[i].want;
    }
    if (!ok) {
        pipe_free(pp);
        return NULL;
    }
    p->ud = pp;
    return pp;
}

/* Tells every stage of a whole pipeline its placement, neighbours and the
 * new epoch. */
static void pipe_announce(server *s, struct pipeline *p) {
    for (uint32_t st = 0; st < p->stage_count; st++) {
        struct worker *w = p->stage[st];
        if (!w) continue;
        Llm__RegisterReply rr = LLM__REGISTER_REPLY__INIT;
        rr.worker_id = w->id;
        rr.accepted = true;
        rr.heartbeat_interval_ms = (uint32_t)s->cfg.heartbeat_ms;
        rr.pipeline_id = p->id;
        rr.stage_index = st;
        rr.stage_count = p->stage_count;
        rr.layer_first = w->layer_first;
        rr.layer_end = w->layer_end;
        rr.prev_stage_endpoint = st > 0 && p->stage[st - 1] ? p->stage[st - 1]->stage_endpoint : "";
        rr.next_stage_endpoint = st + 1 < p->stage_count && p->stage[st + 1] ? p->stage[st + 1]->stage_endpoint : "";
        rr.epoch = p->epoch;
        rr.pipeline_whole = true;
        Llm__WorkerEnvelope env = LLM__WORKER_ENVELOPE__INIT;
        env.body_case = LLM__WORKER_ENVELOPE__BODY_REGISTER_REPLY;
        env.register_reply = &rr;
        send_worker_env(s, w->ident, w->ident_len, &env);
    }
    LOG(LL_INFO, "pipeline %u: %u stages whole, epoch %llu announced", p->id, p->stage_count,
        (unsigned long long)p->epoch);
}

/* Moves sequences waiting on pp (never admitted there, or preempted) back
 * to the queue when another pipeline in service has a free batch slot: a
 * pipeline that joined takes work without anything being restarted. */
static void rebalance(server *s, struct pipe *pp) {
    bool room = false;
    for (size_t i = 0; i < registry_n_pipelines(s->reg) && !room; i++) {
        struct pipe *o = registry_pipeline_at(s->reg, i)->ud;
        if (!o || o == pp || !o->sched) continue;
        struct sched_stats st;
        sched_get_stats(o->sched, &st);
        room = st.n_running + st.n_waiting < s->cfg.max_batch;
    }
    if (!room) return;
    uint64_t ids[64];
    int32_t n = sched_take_waiting(pp->sched, ids, 64);
    for (int32_t k = 0; k < n; k++) {
        struct req *q = req_by_seq(s, ids[k]);
        if (!q) continue;
        seq_map_del(s, q);
        q->seq = NULL;
        q->pipe = NULL;
        queue_push(s, q);
    }
}

/* Brings each pipeline's scheduler in line with its registry state. */
static void sync_pipelines(server *s) {
    for (size_t i = 0; i < registry_n_pipelines(s->reg); i++) {
        struct pipeline *p = registry_pipeline_at(s->reg, i);
        struct pipe *pp = pipe_of(s, p);
        if (!pp) continue;
        if (p->announce) {
            p->announce = false;
            pipe_announce(s, p);
        }
        bool ready = registry_pipeline_ready(s->reg, p);
        if (p->problem[0] && strcmp(p->problem, pp->last_problem) != 0)
            LOG(LL_ERROR, "%s: it cannot serve until this is fixed", p->problem);
        snprintf(pp->last_problem, sizeof pp->last_problem, "%s", p->problem);
        if (pp->sched && !ready) pipe_teardown(s, pp, "a stage is not ready");
        else if (pp->sched && pp->epoch != p->epoch) pipe_teardown(s, pp, "re-formed");
        if (!pp->sched && ready) {
            int32_t step_tokens = s->cfg.step_tokens, step_seqs = s->cfg.max_step_seqs;
            uint32_t wt = registry_pipeline_step_tokens(s->reg, p), wsq = registry_pipeline_step_seqs(s->reg, p);
            if (wt > 0 && (int32_t)wt < step_tokens) step_tokens = (int32_t)wt;
            if (wsq > 0 && (step_seqs <= 0 || (int32_t)wsq < step_seqs)) step_seqs = (int32_t)wsq;
            struct sched_config c = {(int32_t)registry_pipeline_kv_blocks(s->reg, p),
                                     (int32_t)registry_pipeline_block_size(s->reg, p),
                                     step_tokens, s->cfg.max_batch, (int32_t)p->stage_count,
                                     s->next_step_id, step_seqs};
            char err[256];
            if (sched_init(&pp->sched, &c, err, sizeof err) < 0) {
                LOG(LL_ERROR, "pipeline %u: %s", p->id, err);
                continue;
            }
            pp->epoch = p->epoch;
            pp->n_flights = 0;
            LOG(LL_INFO, "pipeline %u in service: %u stages, %d KV blocks of %d tokens, epoch %llu",
                p->id, p->stage_count, c.n_blocks, c.block_size, (unsigned long long)p->epoch);
        }
        if (pp->sched) {
            /* Assigned sequences not yet admitted go where there is room. */
            struct sched_stats st;
            sched_get_stats(pp->sched, &st);
            if (st.n_waiting > 0 && s->n_queue == 0) rebalance(s, pp);
        }
    }
}

static int32_t pipe_capacity_tokens(const struct pipe *pp) {
    struct sched_stats st;
    sched_get_stats(pp->sched, &st);
    return st.blocks_total * (int32_t)registry_pipeline_block_size(NULL, pp->p);
}

static int queue_cmp(const void *a, const void *b) {
    const struct req *x = *(struct req *const *)a, *y = *(struct req *const *)b;
    if (x->priority != y->priority) return x->priority > y->priority ? -1 : 1;
    return x->order < y->order ? -1 : x->order > y->order;
}

/* Moves queued requests onto pipelines: highest priority first, each to the
 * least loaded pipeline that admits work. */
static void assign_queue(server *s) {
    if (s->n_queue == 0) return;
    qsort(s->queue, s->n_queue, sizeof *s->queue, queue_cmp);
    size_t kept = 0;
    size_t i = 0;
    for (; i < s->n_queue; i++) {
        struct req *q = s->queue[i];
        struct pipe *best = NULL;
        int32_t best_load = 0;
        for (size_t k = 0; k < registry_n_pipelines(s->reg); k++) {
            struct pipeline *p = registry_pipeline_at(s->reg, k);
            struct pipe *pp = p->ud;
            if (!pp || !pp->sched || registry_pipeline_draining(s->reg, p)) continue;
            struct sched_stats st;
            sched_get_stats(pp->sched, &st);
            if (st.n_waiting >= s->cfg.max_batch) continue;
            int32_t load = st.n_running + st.n_waiting;
            if (!best || load < best_load) {
                best = pp;
                best_load = load;
            }
        }
        if (!best) break;
        int32_t n = q->n_prompt + q->n_out;
        if (grow((void **)&s->scratch, &s->cap_scratch, (size_t)n, sizeof *s->scratch) < 0) break;
        memcpy(s->scratch, q->prompt, (size_t)q->n_prompt * sizeof *s->scratch);
        memcpy(s->scratch + q->n_prompt, q->out, (size_t)q->n_out * sizeof *s->scratch);
        int32_t cap = pipe_capacity_tokens(best);
        if (q->limit > cap) q->limit = cap;
        if (n >= q->limit) {
            s->queue[i] = NULL;
            q->state = REQ_ASSIGNED; /* so that req_end does not search the queue */
            req_end(s, q, LLM__GENERATE_DONE__FINISH_REASON__LENGTH, -1, NULL, LLM__ERROR__CODE__OK, NULL);
            continue;
        }
        uint64_t sid = ++s->next_seq_id;
        struct sched_seq *seq = NULL;
        int rc = sched_add(best->sched, sid, q->priority, q->order, s->scratch, n, &seq);
        if (rc < 0) {
            char msg[256];
            snprintf(msg, sizeof msg, "%d tokens need %d KV blocks; pipeline %u has %d", n,
                     sched_blocks_for(best->sched, n + 1), best->p->id, cap / (int32_t)registry_pipeline_block_size(NULL, best->p));
            s->queue[i] = NULL;
            q->state = REQ_ASSIGNED;
            req_end(s, q, LLM__GENERATE_DONE__FINISH_REASON__ERROR, -1, NULL,
                    rc == STATUS_EXHAUSTED ? LLM__ERROR__CODE__RESOURCE_EXHAUSTED : LLM__ERROR__CODE__INTERNAL, msg);
            continue;
        }
        q->seq_id = sid;
        q->seq = seq;
        q->pipe = best;
        q->step = 0;
        q->state = REQ_ASSIGNED;
        seq_map_put(s, q);
        s->queue[i] = NULL;
    }
    for (size_t k = 0; k < s->n_queue; k++)
        if (s->queue[k]) s->queue[kept++] = s->queue[k];
    s->n_queue = kept;
}

/* Plans and sends steps until the pipeline has one in flight per stage or
 * nothing more can run. */
static void pump(server *s, struct pipe *pp) {
    if (!pp->sched) return;
    struct req *stuck[16];
    int n_stuck = 0;
    for (;;) {
        int64_t t0 = mono_us();
        struct sched_step st;
        int got = sched_plan(pp->sched, &st);
        for (int32_t k = 0; k < st.n_stuck && n_stuck < 16; k++) {
            struct req *q = req_by_seq(s, sched_seq_id(st.stuck[k]));
            if (q) stuck[n_stuck++] = q;
        }
        if (got != 1) break;
        struct pipeline *p = pp->p;
        Llm__StepPlan plan = LLM__STEP_PLAN__INIT;
        plan.step_id = st.step_id;
        plan.pipeline_id = p->id;
        plan.epoch = pp->epoch;
        struct flight *f = &pp->flights[pp->n_flights];
        f->step_id = st.step_id;
        f->sent_ms = now_ms();
        f->n = st.n_seqs;
        for (int32_t k = 0; k < st.n_seqs; k++) {
            const struct sched_step_seq *ss = &st.seqs[k];
            struct req *q = req_by_seq(s, ss->seq_id);
            Llm__SeqPlan *sp = &pp->seqplans[k];
            llm__seq_plan__init(sp);
            sp->seq_id = ss->seq_id;
            sp->n_tokens = (size_t)ss->n_tokens;
            sp->tokens = (int32_t *)ss->tokens;
            sp->start_pos = (uint32_t)ss->start_pos;
            sp->n_block_table = (size_t)ss->n_blocks;
            sp->block_table = (uint32_t *)ss->block_table; /* ids are >= 0 */
            sp->sampling = q ? &q->spm : NULL;
            sp->want_logits = ss->want_logits;
            pp->seqptrs[k] = sp;
            f->seq_ids[k] = ss->seq_id;
            f->want[k] = ss->want_logits;
            if (q) q->step = st.step_id;
        }
        plan.n_seqs = (size_t)st.n_seqs;
        plan.seqs = pp->seqptrs;
        plan.n_freed_seqs = (size_t)st.n_freed;
        plan.freed_seqs = (uint64_t *)st.freed;
        for (int32_t k = 0; k < st.n_copies; k++) {
            llm__block_copy__init(&pp->copies[k]);
            pp->copies[k].src = (uint32_t)st.copies[k].src;
            pp->copies[k].dst = (uint32_t)st.copies[k].dst;
            pp->copyptrs[k] = &pp->copies[k];
        }
        plan.n_copies = (size_t)st.n_copies;
        plan.copies = pp->copyptrs;
        Llm__WorkerEnvelope env = LLM__WORKER_ENVELOPE__INIT;
        env.body_case = LLM__WORKER_ENVELOPE__BODY_PLAN;
        env.plan = &plan;
        uint8_t *buf = NULL;
        size_t len = 0;
        char err[256];
        if (proto_worker_pack(&env, &buf, &len, err, sizeof err) < 0) {
            LOG(LL_ERROR, "pipeline %u step %llu: %s", p->id, (unsigned long long)st.step_id, err);
            sched_step_done(pp->sched, st.step_id);
            break;
        }
        for (uint32_t k = 0; k < p->stage_count; k++)
            if (p->stage[k]) send_worker(s, p->stage[k]->ident, p->stage[k]->ident_len, buf, len);
        free(buf);
        pp->n_flights++;
        pp->prompt_tokens += (uint64_t)st.n_prefill_tokens;
        s->prompt_total += (uint64_t)st.n_prefill_tokens;
        if (s->next_step_id <= st.step_id) s->next_step_id = st.step_id + 1;
        s->steps_total++;
        double us = (double)(mono_us() - t0);
        s->plan_us_sum += us;
        s->plan_n++;
        if (us > s->plan_us_max) s->plan_us_max = us;
        if (pp->n_flights >= pp->max_flights) break;
    }
    for (int k = 0; k < n_stuck; k++)
        req_end(s, stuck[k], LLM__GENERATE_DONE__FINISH_REASON__LENGTH, -1, NULL, LLM__ERROR__CODE__OK,
                NULL);
}

static void pump_all(server *s) {
    for (size_t i = 0; i < registry_n_pipelines(s->reg); i++) {
        struct pipe *pp = registry_pipeline_at(s->reg, i)->ud;
        if (pp) pump(s, pp);
    }
}

/* ------------------------------------------------------------------------ */
/* Worker messages */

static void on_register(server *s, const uint8_t *ident, size_t ident_len, const Llm__Register *m) {
    struct worker *w = NULL;
    struct pipeline *p = NULL;
    bool reformed = false;
    Llm__Error__Code code;
    char err[512];
    int rc = registry_register(s->reg, m, ident, ident_len, now_ms(), &w, &p, &reformed, &code, err, sizeof err);
    if (rc < 0) {
        LOG(LL_WARN, "%s", err);
        Llm__RegisterReply rr = LLM__REGISTER_REPLY__INIT;
        Llm__Error e;
        proto_error_init(&e, code, "", err, 0);
        rr.worker_id = m->worker_id;
        rr.accepted = false;
        rr.error = &e;
        Llm__WorkerEnvelope env = LLM__WORKER_ENVELOPE__INIT;
        env.body_case = LLM__WORKER_ENVELOPE__BODY_REGISTER_REPLY;
        env.register_reply = &rr;
        send_worker_env(s, ident, ident_len, &env);
        return;
    }
    (void)reformed;
    if (p->announce) return; /* sync_pipelines tells every stage, this one included */
    Llm__RegisterReply rr = LLM__REGISTER_REPLY__INIT;
    rr.worker_id = w->id;
    rr.accepted = true;
    rr.heartbeat_interval_ms = (uint32_t)s->cfg.heartbeat_ms;
    rr.pipeline_id = p->id;
    rr.stage_index = w->stage_index;
    rr.stage_count = p->stage_count;
    rr.layer_first = w->layer_first;
    rr.layer_end = w->layer_end;
    uint32_t si = w->stage_index;
    rr.prev_stage_endpoint = si > 0 && p->stage[si - 1] ? p->stage[si - 1]->stage_endpoint : "";
    rr.next_stage_endpoint = si + 1 < p->stage_count && p->stage[si + 1] ? p->stage[si + 1]->stage_endpoint : "";
    rr.epoch = p->epoch;
    rr.pipeline_whole = registry_pipeline_whole(s->reg, p);
    Llm__WorkerEnvelope env = LLM__WORKER_ENVELOPE__INIT;
    env.body_case = LLM__WORKER_ENVELOPE__BODY_REGISTER_REPLY;
    env.register_reply = &rr;
    send_worker_env(s, ident, ident_len, &env);
}

static void on_heartbeat(server *s, const uint8_t *ident, size_t ident_len, const Llm__Heartbeat *m) {
    struct worker *w = NULL;
    if (registry_heartbeat(s->reg, m, now_ms(), &w) == 0) {
        if (w->ident_len != ident_len || memcmp(w->ident, ident, ident_len) != 0) {
            memcpy(w->ident, ident, ident_len < sizeof w->ident ? ident_len : sizeof w->ident);
            w->ident_len = ident_len < sizeof w->ident ? ident_len : sizeof w->ident;
        }
        return;
    }
    /* Unknown (the router restarted) or lost meanwhile: ask it to register. */
    char msg[256];
    snprintf(msg, sizeof msg, "worker %.128s (incarnation %llu) is not registered with this router: register again",
             m->worker_id, (unsigned long long)m->incarnation);
    Llm__RegisterReply rr = LLM__REGISTER_REPLY__INIT;
    Llm__Error e;
    /* retry_after_ms > 0: "try again", not a final refusal. */
    proto_error_init(&e, LLM__ERROR__CODE__UNAVAILABLE, "", msg, 100);
    rr.worker_id = m->worker_id;
    rr.accepted = false;
    rr.error = &e;
    rr.heartbeat_interval_ms = (uint32_t)s->cfg.heartbeat_ms;
    Llm__WorkerEnvelope env = LLM__WORKER_ENVELOPE__INIT;
    env.body_case = LLM__WORKER_ENVELOPE__BODY_REGISTER_REPLY;
    env.register_reply = &rr;
    send_worker_env(s, ident, ident_len, &env);
}

static void on_result(server *s, const Llm__StepResult *m) {
    int64_t t0 = mono_us();
    struct pipeline *p = registry_pipeline_find(s->reg, m->pipeline_id);
    struct pipe *pp = p ? p->ud : NULL;
    if (!pp || !pp->sched || m->epoch != pp->epoch) {
        s->stale_results++;
        return;
    }
    int32_t fi = -1;
    for (int32_t i = 0; i < pp->n_flights; i++)
        if (pp->flights[i].step_id == m->step_id) fi = i;
    if (fi < 0) {
        s->stale_results++;
        return;
    }
    struct flight *f = &pp->flights[fi];
    bool failed = m->error && m->error->code != LLM__ERROR__CODE__OK;
    if (!failed && m->stage_index + 1 != p->stage_count) return; /* only the last stage reports success */
    if (failed) {
        LOG(LL_WARN, "pipeline %u step %llu failed at stage %u (%s): %s: %d sequences start over",
            p->id, (unsigned long long)m->step_id, m->stage_index, m->worker_id,
            m->error->message, f->n);
        for (int32_t k = 0; k < f->n; k++) {
            struct req *q = req_by_seq(s, f->seq_ids[k]);
            if (!q || q->step != m->step_id) continue;
            q->step = 0;
            if (++q->failures >= SERVER_FAILURES_MAX) {
                char msg[512];
                snprintf(msg, sizeof msg, "%d failed steps, the last at stage %u: %s", q->failures,
                         m->stage_index, m->error->message);
                req_end(s, q, LLM__GENERATE_DONE__FINISH_REASON__ERROR, -1, NULL, LLM__ERROR__CODE__ABORTED, msg);
            } else {
                sched_restart(pp->sched, q->seq);
            }
        }
    } else {
        for (size_t k = 0; k < m->n_seqs; k++) {
            const Llm__SeqResult *r = m->seqs[k];
            struct req *q = req_by_seq(s, r->seq_id);
            if (!q || q->step != m->step_id) continue;
            bool want = false;
            for (int32_t j = 0; j < f->n; j++)
                if (f->seq_ids[j] == r->seq_id) want = f->want[j];
            q->step = 0;
            if (r->error && r->error->code != LLM__ERROR__CODE__OK) {
                if (++q->failures >= SERVER_FAILURES_MAX)
                    req_end(s, q, LLM__GENERATE_DONE__FINISH_REASON__ERROR, -1, NULL,
                            (Llm__Error__Code)r->error->code, r->error->message);
                else
                    sched_restart(pp->sched, q->seq);
                continue;
            }
            if (!want) continue;
            if (r->token < 0 || r->token >= s->mi.n_vocab) {
                char msg[128];
                snprintf(msg, sizeof msg, "stage %u sampled token %d, outside the vocabulary of %d",
                         m->stage_index, r->token, s->mi.n_vocab);
                req_end(s, q, LLM__GENERATE_DONE__FINISH_REASON__ERROR, -1, NULL, LLM__ERROR__CODE__INTERNAL, msg);
                continue;
            }
            req_token(s, q, r->token, r->logprob);
        }
        /* Sequences of the step the result did not mention start over. */
        for (int32_t j = 0; j < f->n; j++) {
            struct req *q = req_by_seq(s, f->seq_ids[j]);
            if (q && q->step == m->step_id) {
                q->step = 0;
                if (f->want[j]) sched_restart(pp->sched, q->seq);
            }
        }
    }
    sched_step_done(pp->sched, m->step_id);
    /* Swap whole slots, so that each keeps its own arrays. */
    struct flight tmp = pp->flights[fi];
    pp->flights[fi] = pp->flights[pp->n_flights - 1];
    pp->flights[pp->n_flights - 1] = tmp;
    pp->n_flights--;
    pump(s, pp);
    s->turn_us_sum += (double)(mono_us() - t0);
    s->turn_n++;
}

static void on_worker_frame(server *s, const uint8_t *ident, size_t ident_len, const uint8_t *buf, size_t len) {
    Llm__WorkerEnvelope *env = NULL;
    char err[256];
    int rc = proto_worker_unpack(buf, len, &env, err, sizeof err);
    if (rc < 0) {
        LOG(LL_WARN, "worker frame refused: %s", err);
        uint8_t *out = NULL;
        size_t olen = 0;
        if (proto_worker_error_pack(proto_code_from_status(rc), "", err, 0, &out, &olen) == 0) {
            send_worker(s, ident, ident_len, out, olen);
            free(out);
        }
        return;
    }
    switch (env->body_case) {
    case LLM__WORKER_ENVELOPE__BODY_REGISTER: on_register(s, ident, ident_len, env->register_); break;
    case LLM__WORKER_ENVELOPE__BODY_HEARTBEAT: on_heartbeat(s, ident, ident_len, env->heartbeat); break;
    case LLM__WORKER_ENVELOPE__BODY_RESULT: on_result(s, env->result); break;
    case LLM__WORKER_ENVELOPE__BODY_ERROR:
        LOG(LL_WARN, "worker error: %s: %s", proto_code_name(env->error->code), env->error->message);
        break;
    default: {
        s->frames_bad++;
        snprintf(err, sizeof err, "worker envelope body %d is not one a worker sends", (int)env->body_case);
        uint8_t *out = NULL;
        size_t olen = 0;
        if (proto_worker_error_pack(LLM__ERROR__CODE__UNIMPLEMENTED, "", err, 0, &out, &olen) == 0) {
            send_worker(s, ident, ident_len, out, olen);
            free(out);
        }
    }
    }
    proto_worker_free(env);
}

/* ------------------------------------------------------------------------ */
/* Client messages */

/* The request as stored: the client's body without the fields that may
 * differ between a request and its re-sends. */
static int canonical_params(const Llm__GenerateRequest *g, uint8_t **out, size_t *len) {
    Llm__GenerateRequest c = *g;
    c.stream = false;
    c.resume_from = 0;
    c.timeout_ms = 0;
    size_t n = llm__generate_request__get_packed_size(&c);
    *out = malloc(n + 1);
    if (!*out) return STATUS_NO_MEMORY;
    *len = llm__generate_request__pack(&c, *out);
    return 0;
}

static uint32_t queue_depth(server *s) {
    uint32_t n = (uint32_t)s->n_queue;
    for (size_t i = 0; i < registry_n_pipelines(s->reg); i++) {
        struct pipe *pp = registry_pipeline_at(s->reg, i)->ud;
        if (pp && pp->sched) {
            struct sched_stats st;
            sched_get_stats(pp->sched, &st);
            n += (uint32_t)st.n_waiting;
        }
    }
    return n;
}

static void send_accepted(server *s, struct req *q, uint64_t tag, bool reattached, uint32_t position) {
    Llm__GenerateAccepted a = LLM__GENERATE_ACCEPTED__INIT;
    a.request_id = q->id;
    a.reattached = reattached;
    a.prompt_tokens = (uint32_t)q->n_prompt;
    a.seed = q->seed;
    a.queue_position = position;
    a.n_prompt_token_ids = (size_t)q->n_prompt;
    a.prompt_token_ids = q->prompt;
    Llm__ClientEnvelope env = LLM__CLIENT_ENVELOPE__INIT;
    env.tag = tag;
    env.body_case = LLM__CLIENT_ENVELOPE__BODY_ACCEPTED;
    env.accepted = &a;
    send_client(s, q->ident, q->ident_len, &env);
}

static void reattach(server *s, struct req *q, const Llm__GenerateRequest *g, const uint8_t *ident,
                     size_t ident_len, uint64_t tag) {
    uint8_t *cp = NULL;
    size_t clen = 0;
    if (canonical_params(g, &cp, &clen) < 0) {
        send_client_error(s, ident, ident_len, tag, LLM__ERROR__CODE__INTERNAL, g->request_id, "out of memory", 0);
        return;
    }
    bool same = clen == q->params_len && memcmp(cp, q->params, clen) == 0;
    free(cp);
    if (!same) {
        send_client_error(s, ident, ident_len, tag, LLM__ERROR__CODE__ALREADY_EXISTS, g->request_id,
                          "request_id is in use by a request with a different body (model, prompt, "
                          "sampling, max_tokens, stop, priority or deadline)",
                          0);
        return;
    }
    memcpy(q->ident, ident, ident_len);
    q->ident_len = ident_len;
    q->stream = g->stream;
    int32_t from = (int32_t)(g->resume_from < (uint32_t)q->n_out ? g->resume_from : (uint32_t)q->n_out);
    q->resume_from = (uint32_t)from;
    send_accepted(s, q, tag, true, 0);
    LOG(LL_INFO, "request %s: re-attached, %d tokens so far, replay from %d", q->id, q->n_out, from);
    if (q->state == REQ_DONE) {
        send_chunk(s, q, from, q->n_out, req_text_offset(s, q, from), q->text_len);
        send_done(s, q, ident, ident_len);
        return;
    }
    if (q->finishing) return; /* its end goes out with this loop's flush */
    if (q->stream) {
        size_t sendable = q->text_len - req_stop_hold(q);
        size_t t0 = req_text_offset(s, q, from);
        if (sendable < t0) sendable = t0;
        send_chunk(s, q, from, q->n_out, t0, sendable);
        q->n_sent = q->n_out;
        q->text_sent = sendable;
    }
}

static void on_generate(server *s, const uint8_t *ident, size_t ident_len, uint64_t tag,
                        const Llm__GenerateRequest *g) {
    char err[512];
    const char *rid = g->request_id ? g->request_id : "";
    if (proto_request_id_check(rid, err, sizeof err) < 0) {
        send_client_error(s, ident, ident_len, tag, LLM__ERROR__CODE__INVALID_ARGUMENT, "", err, 0);
        return;
    }
    struct req *q = req_find(s, rid);
    if (q) {
        reattach(s, q, g, ident, ident_len, tag);
        return;
    }
    if (!s->rs) {
        send_client_error(s, ident, ident_len, tag, LLM__ERROR__CODE__UNAVAILABLE, rid,
                          "the router cannot reach Redis, so it cannot make the request durable", 1000);
        return;
    }
    struct reqrec r;
    int rc = reqstore_load(s->rs, rid, &r);
    if (rc == 0) {
        /* Known to Redis but not here: finished before a restart, or
         * recovered state we dropped. */
        q = req_new(s, &r, err, sizeof err);
        bool queued = r.state == REQREC_QUEUED;
        reqrec_free(&r);
        if (!q) {
            send_client_error(s, ident, ident_len, tag, LLM__ERROR__CODE__INTERNAL, rid, err, 0);
            return;
        }
        if (queued) queue_push(s, q);
        reattach(s, q, g, ident, ident_len, tag);
        return;
    }
    if (rc != STATUS_NOT_FOUND) {
        send_client_error(s, ident, ident_len, tag, LLM__ERROR__CODE__UNAVAILABLE, rid, reqstore_errstr(s->rs), 1000);
        return;
    }

    int64_t now = now_ms();
    rc = proto_generate_validate(g, s->mi.n_vocab, now, err, sizeof err);
    if (rc < 0) {
        send_client_error(s, ident, ident_len, tag,
                          rc == STATUS_TIMEOUT ? LLM__ERROR__CODE__DEADLINE_EXCEEDED : LLM__ERROR__CODE__INVALID_ARGUMENT,
                          rid, err, 0);
        return;
    }
    if (g->model && g->model[0] && strcmp(g->model, s->mi.id) != 0) {
        snprintf(err, sizeof err, "model \"%.128s\" is not served here; the model is \"%s\"", g->model, s->mi.id);
        send_client_error(s, ident, ident_len, tag, LLM__ERROR__CODE__NOT_FOUND, rid, err, 0);
        return;
    }
    /* Tokens. */
    int32_t *prompt = NULL;
    int32_t n_prompt = 0;
    if (g->n_prompt_tokens > 0) {
        if (g->n_prompt_tokens > (size_t)s->mi.n_ctx) {
            snprintf(err, sizeof err, "prompt_tokens has %zu tokens; the context of %s is %d", g->n_prompt_tokens,
                     s->mi.id, s->mi.n_ctx);
            send_client_error(s, ident, ident_len, tag, LLM__ERROR__CODE__INVALID_ARGUMENT, rid, err, 0);
            return;
        }
        n_prompt = (int32_t)g->n_prompt_tokens;
        prompt = malloc((size_t)n_prompt * sizeof *prompt);
        if (prompt) memcpy(prompt, g->prompt_tokens, (size_t)n_prompt * sizeof *prompt);
    } else {
        size_t tl = strlen(g->prompt);
        int32_t cap = (int32_t)(tl + 8 < (size_t)s->mi.n_ctx + 8 ? tl + 8 : (size_t)s->mi.n_ctx + 8);
        prompt = malloc((size_t)cap * sizeof *prompt);
        if (prompt) {
            n_prompt = tokenizer_encode(s->tok, g->prompt, tl, -1, 0, prompt, cap);
            if (n_prompt < 0) {
                snprintf(err, sizeof err, "prompt: cannot be tokenized (%s)", status_str(n_prompt));
                free(prompt);
                send_client_error(s, ident, ident_len, tag, LLM__ERROR__CODE__INVALID_ARGUMENT, rid, err, 0);
                return;
            }
            if (n_prompt > cap) {
                snprintf(err, sizeof err, "prompt: %zu bytes are %d tokens or more; the context of %s is %d",
                         tl, n_prompt, s->mi.id, s->mi.n_ctx);
                free(prompt);
                send_client_error(s, ident, ident_len, tag, LLM__ERROR__CODE__INVALID_ARGUMENT, rid, err, 0);
                return;
            }
        }
    }
    if (!prompt) {
        send_client_error(s, ident, ident_len, tag, LLM__ERROR__CODE__INTERNAL, rid, "router out of memory", 0);
        return;
    }
    int64_t total = (int64_t)n_prompt + (g->max_tokens ? g->max_tokens : 1);
    if (n_prompt == 0 || total > s->mi.n_ctx) {
        if (n_prompt == 0)
            snprintf(err, sizeof err, "prompt: is empty (0 tokens) and the model adds no BOS");
        else
            snprintf(err, sizeof err,
                     "prompt (%d tokens) + max_tokens (%u) = %lld exceeds the context of %s (%d tokens)",
                     n_prompt, g->max_tokens, (long long)total, s->mi.id, s->mi.n_ctx);
        free(prompt);
        send_client_error(s, ident, ident_len, tag, LLM__ERROR__CODE__INVALID_ARGUMENT, rid, err, 0);
        return;
    }
    /* KV: the largest pipeline in service must be able to hold it. */
    int32_t best_cap = -1;
    uint32_t best_pid = 0;
    for (size_t i = 0; i < registry_n_pipelines(s->reg); i++) {
        struct pipe *pp = registry_pipeline_at(s->reg, i)->ud;
        if (pp && pp->sched && pipe_capacity_tokens(pp) > best_cap) {
            best_cap = pipe_capacity_tokens(pp);
            best_pid = pp->p->id;
        }
    }
    if (best_cap >= 0 && total > best_cap) {
        snprintf(err, sizeof err,
                 "prompt (%d tokens) + max_tokens (%u) = %lld tokens do not fit the KV cache of any "
                 "pipeline (the largest, pipeline %u, holds %d tokens)",
                 n_prompt, g->max_tokens, (long long)total, best_pid, best_cap);
        free(prompt);
        send_client_error(s, ident, ident_len, tag, LLM__ERROR__CODE__RESOURCE_EXHAUSTED, rid, err, 0);
        return;
    }
    if (queue_depth(s) >= (uint32_t)s->cfg.max_queue) {
        snprintf(err, sizeof err, "the queue is full (%d requests waiting); retry later", s->cfg.max_queue);
        free(prompt);
        send_client_error(s, ident, ident_len, tag, LLM__ERROR__CODE__RESOURCE_EXHAUSTED, rid, err, 1000);
        return;
    }

    /* Durable, then acknowledged. */
    memset(&r, 0, sizeof r);
    snprintf(r.id, sizeof r.id, "%s", rid);
    if (canonical_params(g, &r.params, &r.params_len) < 0) {
        free(prompt);
        send_client_error(s, ident, ident_len, tag, LLM__ERROR__CODE__INTERNAL, rid, "router out of memory", 0);
        return;
    }
    r.prompt = prompt;
    r.n_prompt = n_prompt;
    r.seed = g->sampling && g->sampling->seed ? g->sampling->seed : 0;
    while (r.seed == 0) {
        uint64_t x = (uint64_t)mono_us() ^ ((uint64_t)now << 20) ^ ((uint64_t)getpid() << 40) ^ s->requests_total;
        x ^= x >> 31;
        x *= 0xbf58476d1ce4e5b9ull;
        x ^= x >> 29;
        r.seed = x;
    }
    r.created_ms = now;
    r.deadline_ms = g->deadline_ms;
    if (g->timeout_ms && (r.deadline_ms == 0 || now + g->timeout_ms < r.deadline_ms))
        r.deadline_ms = now + g->timeout_ms;
    r.state = REQREC_QUEUED;
    rc = reqstore_create(s->rs, &r);
    if (rc < 0) {
        snprintf(err, sizeof err, "%s", reqstore_errstr(s->rs));
        reqrec_free(&r);
        send_client_error(s, ident, ident_len, tag, LLM__ERROR__CODE__UNAVAILABLE, rid, err, 1000);
        return;
    }
    q = req_new(s, &r, err, sizeof err);
    reqrec_free(&r);
    if (!q) {
        send_client_error(s, ident, ident_len, tag, LLM__ERROR__CODE__INTERNAL, rid, err, 0);
        return;
    }
    memcpy(q->ident, ident, ident_len);
    q->ident_len = ident_len;
    q->stream = g->stream;
    uint32_t position = queue_depth(s);
    queue_push(s, q);
    s->requests_total++;
    send_accepted(s, q, tag, false, position);
    LOG(LL_INFO, "request %s: accepted, %d prompt tokens, max_tokens %u, priority %d, seed %llu", q->id,
        q->n_prompt, q->gen->max_tokens, q->priority, (unsigned long long)q->seed);
}

static void on_cancel(server *s, const uint8_t *ident, size_t ident_len, uint64_t tag, const Llm__Cancel *c) {
    const char *rid = c->request_id ? c->request_id : "";
    struct req *q = req_find(s, rid);
    if (!q && s->rs) {
        struct reqrec r;
        if (reqstore_load(s->rs, rid, &r) == 0) {
            char err[256];
            q = req_new(s, &r, err, sizeof err);
            bool queued = r.state == REQREC_QUEUED;
            reqrec_free(&r);
            if (q && queued) queue_push(s, q);
        }
    }
    if (!q) {
        char msg[256];
        snprintf(msg, sizeof msg, "no request with id \"%.128s\"", rid);
        send_client_error(s, ident, ident_len, tag, LLM__ERROR__CODE__NOT_FOUND, rid, msg, 0);
        return;
    }
    if (q->state == REQ_DONE) {
        send_done(s, q, ident, ident_len);
        return;
    }
    req_end(s, q, LLM__GENERATE_DONE__FINISH_REASON__CANCELLED, -1, NULL, LLM__ERROR__CODE__CANCELLED,
            "cancelled by the client");
    if (q->ident_len != ident_len || memcmp(q->ident, ident, ident_len) != 0) {
        /* The canceller gets the GenerateDone too. */
        flush_touched(s);
        send_done(s, q, ident, ident_len);
    }
    LOG(LL_INFO, "request %s: cancelled", q->id);
}

static void on_health(server *s, const uint8_t *ident, size_t ident_len, uint64_t tag) {
    Llm__HealthReply h = LLM__HEALTH_REPLY__INIT;
    uint32_t ready = 0;
    for (size_t i = 0; i < registry_n_pipelines(s->reg); i++) {
        struct pipe *pp = registry_pipeline_at(s->reg, i)->ud;
        if (pp && pp->sched) ready++;
    }
    h.status = ready > 0 && s->rs ? LLM__HEALTH_REPLY__SERVING_STATUS__SERVING
                                  : LLM__HEALTH_REPLY__SERVING_STATUS__NOT_SERVING;
    h.protocol_version = PROTO_VERSION;
    h.build = SERVER_BUILD;
    h.pipelines_ready = ready;
    Llm__ClientEnvelope env = LLM__CLIENT_ENVELOPE__INIT;
    env.tag = tag;
    env.body_case = LLM__CLIENT_ENVELOPE__BODY_HEALTH_REPLY;
    env.health_reply = &h;
    send_client(s, ident, ident_len, &env);
}

static void on_models(server *s, const uint8_t *ident, size_t ident_len, uint64_t tag) {
    Llm__ModelInfo mi = LLM__MODEL_INFO__INIT;
    mi.id = s->mi.id;
    mi.architecture = s->mi.arch;
    mi.n_vocab = (uint32_t)s->mi.n_vocab;
    mi.n_ctx = (uint32_t)s->mi.n_ctx;
    mi.n_layers = (uint32_t)s->mi.n_layers;
    for (size_t i = 0; i < registry_n_pipelines(s->reg); i++) {
        struct pipe *pp = registry_pipeline_at(s->reg, i)->ud;
        if (pp && pp->sched) mi.pipelines++;
    }
    mi.is_default = true;
    Llm__ModelInfo *mp = &mi;
    Llm__ModelsReply m = LLM__MODELS_REPLY__INIT;
    m.n_models = 1;
    m.models = &mp;
    Llm__ClientEnvelope env = LLM__CLIENT_ENVELOPE__INIT;
    env.tag = tag;
    env.body_case = LLM__CLIENT_ENVELOPE__BODY_MODELS_REPLY;
    env.models_reply = &m;
    send_client(s, ident, ident_len, &env);
}

static void on_status(server *s, const uint8_t *ident, size_t ident_len, uint64_t tag) {
    int64_t now = now_ms();
    size_t np = registry_n_pipelines(s->reg), nw = registry_n_workers(s->reg);
    size_t n_stages = 0;
    for (size_t i = 0; i < np; i++) n_stages += registry_pipeline_at(s->reg, i)->stage_count;
    Llm__PipelineStatus *ps = calloc(np + 1, sizeof *ps);
    Llm__PipelineStatus **psp = calloc(np + 1, sizeof *psp);
    Llm__StageStatus *ss = calloc(n_stages + 1, sizeof *ss);
    Llm__StageStatus **ssp = calloc(n_stages + 1, sizeof *ssp);
    Llm__WorkerStatus *ws = calloc(nw + 1, sizeof *ws);
    Llm__WorkerStatus **wsp = calloc(nw + 1, sizeof *wsp);
    if (!ps || !psp || !ss || !ssp || !ws || !wsp) {
        send_client_error(s, ident, ident_len, tag, LLM__ERROR__CODE__INTERNAL, "", "router out of memory", 0);
        goto done;
    }
    Llm__StatusReply st = LLM__STATUS_REPLY__INIT;
    size_t si = 0;
    for (size_t i = 0; i < np; i++) {
        struct pipeline *p = registry_pipeline_at(s->reg, i);
        struct pipe *pp = p->ud;
        Llm__PipelineStatus *x = &ps[i];
        llm__pipeline_status__init(x);
        x->pipeline_id = p->id;
        x->model = s->mi.id;
        x->ready = pp && pp->sched;
        x->epoch = p->epoch;
        x->problem = p->problem;
        x->stages = &ssp[si];
        for (uint32_t k = 0; k < p->stage_count; k++) {
            Llm__StageStatus *y = &ss[si];
            llm__stage_status__init(y);
            struct worker *w = p->stage[k];
            y->stage_index = k;
            if (w) {
                y->worker_id = w->id;
                y->layer_first = w->layer_first;
                y->layer_end = w->layer_end;
                y->backend = w->backend;
                y->device = w->device;
                y->kv_blocks_used = w->kv_used;
                y->kv_blocks_total = w->kv_total ? w->kv_total : w->kv_block_count;
                y->heartbeat_age_ms = (uint32_t)(now - w->last_seen_ms);
                y->ready = w->state == WORKER_READY || w->state == WORKER_DRAINING;
            }
            ssp[si++] = y;
            x->n_stages++;
        }
        if (pp && pp->sched) {
            struct sched_stats q;
            sched_get_stats(pp->sched, &q);
            x->running = (uint32_t)q.n_running;
            x->waiting = (uint32_t)q.n_waiting;
            x->kv_blocks_used = (uint32_t)q.blocks_used;
            x->kv_blocks_total = (uint32_t)q.blocks_total;
            x->steps_in_flight = (uint32_t)q.n_inflight;
            st.running += (uint32_t)q.n_running;
            st.kv_blocks_used += (uint64_t)q.blocks_used;
            st.kv_blocks_total += (uint64_t)q.blocks_total;
            st.preemptions_total += q.preemptions_total;
        }
        if (pp) {
            x->tokens_per_s = pp->tok_s;
            x->prompt_tokens_per_s = pp->prompt_tok_s;
        }
        psp[i] = x;
    }
    for (size_t i = 0; i < nw; i++) {
        struct worker *w = registry_worker_at(s->reg, i);
        Llm__WorkerStatus *x = &ws[i];
        llm__worker_status__init(x);
        x->worker_id = w->id;
        x->pipeline_id = w->pipeline_id;
        x->stage_index = w->stage_index;
        x->backend = w->backend;
        x->device = w->device;
        x->state = (char *)worker_state_name(w->state);
        x->heartbeat_age_ms = (uint32_t)(now - w->last_seen_ms);
        wsp[i] = x;
    }
    st.n_pipelines = np;
    st.pipelines = psp;
    st.n_workers = nw;
    st.workers = wsp;
    st.queue_depth = queue_depth(s);
    st.tokens_per_s = s->tok_s;
    st.prompt_tokens_per_s = s->prompt_tok_s;
    st.requests_total = s->requests_total;
    st.frames_rejected = proto_frames_rejected() + s->frames_bad;
    st.uptime_s = (uint64_t)((now - s->start_ms) / 1000);
    st.plan_us_mean = s->plan_n ? s->plan_us_sum / (double)s->plan_n : 0;
    st.plan_us_max = s->plan_us_max;
    st.turnaround_us_mean = s->turn_n ? s->turn_us_sum / (double)s->turn_n : 0;
    st.steps_total = s->steps_total;
    Llm__ClientEnvelope env = LLM__CLIENT_ENVELOPE__INIT;
    env.tag = tag;
    env.body_case = LLM__CLIENT_ENVELOPE__BODY_STATUS_REPLY;
    env.status_reply = &st;
    send_client(s, ident, ident_len, &env);
done:
    free(ps);
    free(psp);
    free(ss);
    free(ssp);
    free(ws);
    free(wsp);
}

static void on_client_frame(server *s, const uint8_t *ident, size_t ident_len, const uint8_t *buf, size_t len) {
    Llm__ClientEnvelope *env = NULL;
    char err[256];
    int rc = proto_client_unpack(buf, len, &env, err, sizeof err);
    if (rc < 0) {
        send_client_error(s, ident, ident_len, 0, proto_code_from_status(rc), "", err, 0);
        return;
    }
    switch (env->body_case) {
    case LLM__CLIENT_ENVELOPE__BODY_GENERATE: on_generate(s, ident, ident_len, env->tag, env->generate); break;
    case LLM__CLIENT_ENVELOPE__BODY_CANCEL: on_cancel(s, ident, ident_len, env->tag, env->cancel); break;
    case LLM__CLIENT_ENVELOPE__BODY_HEALTH: on_health(s, ident, ident_len, env->tag); break;
    case LLM__CLIENT_ENVELOPE__BODY_STATUS: on_status(s, ident, ident_len, env->tag); break;
    case LLM__CLIENT_ENVELOPE__BODY_MODELS: on_models(s, ident, ident_len, env->tag); break;
    default:
        s->frames_bad++;
        snprintf(err, sizeof err, "client envelope body %d is a reply, not a request", (int)env->body_case);
        send_client_error(s, ident, ident_len, env->tag, LLM__ERROR__CODE__UNIMPLEMENTED, "", err, 0);
    }
    proto_client_free(env);
}

/* ------------------------------------------------------------------------ */
/* Timers */

static void server_log_stats(server *s);

static void redis_connect(server *s) {
    if (s->rs) return;
    char err[512];
    struct reqstore_config c = {s->cfg.redis_url, s->cfg.redis_prefix, s->cfg.router_id,
                                (int64_t)s->cfg.retention_s * 1000, s->cfg.claim_idle_ms, 2000};
    if (reqstore_open(&s->rs, &c, err, sizeof err) < 0) {
        LOG(LL_WARN, "redis: %s (retrying)", err);
        return;
    }
    LOG(LL_INFO, "redis: connected to %s", s->cfg.redis_url);
    if (s->recovered) return;
    struct reqrec *list = NULL;
    size_t n = 0;
    if (reqstore_recover(s->rs, &list, &n) < 0) {
        LOG(LL_WARN, "redis: recovering requests: %s (retrying)", reqstore_errstr(s->rs));
        reqstore_close(s->rs);
        s->rs = NULL;
        return;
    }
    s->recovered = true;
    size_t adopted = 0;
    for (size_t i = 0; i < n; i++) {
        if (!req_find(s, list[i].id)) {
            struct req *q = req_new(s, &list[i], err, sizeof err);
            if (q) {
                queue_push(s, q);
                adopted++;
            } else {
                LOG(LL_WARN, "recover: %s", err);
            }
        }
        reqrec_free(&list[i]);
    }
    free(list);
    if (adopted) LOG(LL_INFO, "redis: resumed %zu accepted, unfinished requests", adopted);
}

static void check_worker_keys(server *s) {
    if (!s->rs) return;
    struct rconn *c = reqstore_conn(s->rs);
    for (size_t i = 0; i < registry_n_workers(s->reg); i++) {
        struct worker *w = registry_worker_at(s->reg, i);
        if (w->state == WORKER_LOST) continue;
        char key[256];
        snprintf(key, sizeof key, "%sworker:%s", s->cfg.redis_prefix, w->id);
        int64_t ttl = 0;
        int rc = rconn_ttl(c, key, &ttl);
        if (rc == 0) w->redis_key_seen = true;
        else if (rc == STATUS_NOT_FOUND && w->redis_key_seen) {
            LOG(LL_WARN, "worker %s: its Redis key %s expired: lost", w->id, key);
            registry_mark_lost(s->reg, w);
        } else if (rc != STATUS_NOT_FOUND) {
            return; /* Redis trouble: heartbeats still tell */
        }
    }
}

static void timers(server *s) {
    int64_t now = now_ms();
    if (now - s->last_timer_ms < 50) return;
    s->last_timer_ms = now;
    if (!s->rs && now - s->last_redis_try_ms >= 1000) {
        s->last_redis_try_ms = now;
        redis_connect(s);
    }
    registry_expire(s->reg, now, on_pipeline_drop, s);
    if (now - s->last_keys_ms >= s->cfg.heartbeat_ms) {
        s->last_keys_ms = now;
        check_worker_keys(s);
    }
    /* Steps without a result for too long: re-form the pipeline. */
    for (size_t i = 0; i < registry_n_pipelines(s->reg); i++) {
        struct pipeline *p = registry_pipeline_at(s->reg, i);
        struct pipe *pp = p->ud;
        if (!pp || !pp->sched) continue;
        for (int32_t k = 0; k < pp->n_flights; k++)
            if (now - pp->flights[k].sent_ms > s->cfg.step_timeout_ms) {
                LOG(LL_WARN, "pipeline %u: step %llu has no result after %lld ms: re-forming", p->id,
                    (unsigned long long)pp->flights[k].step_id, (long long)(now - pp->flights[k].sent_ms));
                registry_pipeline_bump(s->reg, p);
                break;
            }
    }
    /* Deadlines, unfinished stores, forgetting finished requests. */
    for (struct req *q = s->all, *next; q; q = next) {
        next = q->next;
        if (q->state != REQ_DONE && !q->finishing && q->deadline_ms && now >= q->deadline_ms) {
            req_end(s, q, LLM__GENERATE_DONE__FINISH_REASON__DEADLINE, -1, NULL,
                    LLM__ERROR__CODE__DEADLINE_EXCEEDED, "the request's deadline passed");
            continue;
        }
        if (q->state == REQ_DONE && !q->finish_stored && s->rs) req_store_finish(s, q);
        if (q->state == REQ_DONE && q->finish_stored && !q->touched &&
            (now - q->done_ms > (int64_t)s->cfg.retention_s * 1000 || s->n_done > SERVER_DONE_MEMORY_MAX)) {
            req_unlink(s, q);
            req_free(q);
        }
    }
    if (now - s->last_stats_ms >= 60000) {
        if (s->steps_total != s->stats_steps_mark) server_log_stats(s);
        s->stats_steps_mark = s->steps_total;
        s->last_stats_ms = now;
    }
    /* Throughput, once a second. */
    if (now - s->last_rate_ms >= 1000) {
        double dt = (double)(now - s->last_rate_ms) / 1000.0;
        if (s->last_rate_ms) {
            s->tok_s = 0.5 * s->tok_s + 0.5 * (double)(s->gen_total - s->rate_gen_mark) / dt;
            s->prompt_tok_s = 0.5 * s->prompt_tok_s + 0.5 * (double)(s->prompt_total - s->rate_prompt_mark) / dt;
            for (size_t i = 0; i < registry_n_pipelines(s->reg); i++) {
                struct pipe *pp = registry_pipeline_at(s->reg, i)->ud;
                if (!pp) continue;
                pp->tok_s = 0.5 * pp->tok_s + 0.5 * (double)(pp->gen_tokens - pp->gen_mark) / dt;
                pp->prompt_tok_s = 0.5 * pp->prompt_tok_s + 0.5 * (double)(pp->prompt_tokens - pp->prompt_mark) / dt;
                pp->gen_mark = pp->gen_tokens;
                pp->prompt_mark = pp->prompt_tokens;
            }
        }
        s->rate_gen_mark = s->gen_total;
        s->rate_prompt_mark = s->prompt_total;
        s->last_rate_ms = now;
    }
}

/* ------------------------------------------------------------------------ */

int server_init(server **out, const struct server_config *cfg, char *err, size_t errlen) {
    *out = NULL;
    server *s = calloc(1, sizeof *s);
    if (!s) {
        snprintf(err, errlen, "router: out of memory");
        return STATUS_NO_MEMORY;
    }
    s->cfg = *cfg;
    if (s->cfg.step_timeout_ms <= 0) s->cfg.step_timeout_ms = 30000;
    if (s->cfg.retention_s <= 0) s->cfg.retention_s = 3600;
    if (!s->cfg.redis_prefix) s->cfg.redis_prefix = "llm:";
    if (!s->cfg.router_id) s->cfg.router_id = "router";
    int rc;
    if (!cfg->model_path || !cfg->model_path[0]) {
        snprintf(err, errlen, "router: --model is required (a .gguf file or a Hugging Face directory)");
        rc = STATUS_BAD_INPUT;
        goto fail;
    }
    if ((rc = modelinfo_load(&s->mi, cfg->model_path, err, errlen)) < 0) goto fail;
    if ((rc = tokenizer_load(&s->tok, cfg->model_path, err, errlen)) < 0) goto fail;
    if (s->mi.n_vocab <= 0) s->mi.n_vocab = tokenizer_n_vocab(s->tok);
    s->detok_size = tokenizer_detok_size_max(s->tok) + 1;
    s->detok_buf = malloc(s->detok_size);
    if (!s->detok_buf) {
        rc = STATUS_NO_MEMORY;
        snprintf(err, errlen, "router: out of memory");
        goto fail;
    }
    struct registry_config rc_cfg = {&s->mi, (uint32_t)(cfg->stages > 0 ? cfg->stages : 1),
                                     cfg->worker_timeout_ms, (int64_t)cfg->worker_timeout_ms * 10,
                                     (uint64_t)now_ms() * 1000};
    if ((rc = registry_init(&s->reg, &rc_cfg)) < 0) {
        snprintf(err, errlen, "router: out of memory");
        goto fail;
    }
    s->zctx = zmq_ctx_new();
    if (!s->zctx) {
        snprintf(err, errlen, "router: zmq_ctx_new: %s", zmq_strerror(errno));
        rc = STATUS_IO;
        goto fail;
    }
    if ((rc = zio_sock_open(s->zctx, ZMQ_ROUTER, &s->cs, err, errlen)) < 0) goto fail;
    if ((rc = zio_sock_open(s->zctx, ZMQ_ROUTER, &s->ws, err, errlen)) < 0) goto fail;
    zio_set_int(s->cs, ZMQ_SNDHWM, 100000);
    zio_set_int(s->cs, ZMQ_RCVHWM, 100000);
    zio_set_int(s->ws, ZMQ_SNDHWM, 100000);
    zio_set_int(s->ws, ZMQ_RCVHWM, 100000);
    /* A worker that restarts reconnects with the same routing id (its
     * worker_id): hand the id over to the new connection. */
    zio_set_int(s->ws, ZMQ_ROUTER_HANDOVER, 1);
    zio_set_int(s->cs, ZMQ_ROUTER_HANDOVER, 1);
    if ((rc = zio_bind(s->cs, cfg->listen)) < 0) {
        snprintf(err, errlen, "router: client endpoint: %s", zio_errstr(s->cs));
        goto fail;
    }
    if ((rc = zio_bind(s->ws, cfg->worker_listen)) < 0) {
        snprintf(err, errlen, "router: worker endpoint: %s", zio_errstr(s->ws));
        goto fail;
    }
    s->start_ms = now_ms();
    s->next_seq_id = (uint64_t)s->start_ms << 16; /* never reuse ids a worker may still hold */
    s->next_step_id = (uint64_t)s->start_ms << 16;
    LOG(LL_INFO, "router: model %s (%s, %d layers, context %d, vocabulary %d); clients on %s, workers on %s",
        s->mi.id, s->mi.arch, s->mi.n_layers, s->mi.n_ctx, s->mi.n_vocab, zio_endpoint(s->cs),
        zio_endpoint(s->ws));
    s->last_redis_try_ms = now_ms();
    redis_connect(s);
    *out = s;
    return STATUS_OK;
fail:
    server_free(s);
    return rc;
}

void server_free(server *s) {
    if (!s) return;
    if (s->reg) {
        for (size_t i = 0; i < registry_n_pipelines(s->reg); i++) {
            struct pipeline *p = registry_pipeline_at(s->reg, i);
            struct pipe *pp = p->ud;
            if (pp) {
                sched_free(pp->sched);
                pipe_free(pp);
                p->ud = NULL;
            }
        }
        registry_free(s->reg);
    }
    for (struct req *q = s->all, *next; q; q = next) {
        next = q->next;
        req_free(q);
    }
    free(s->queue);
    free(s->touched);
    free(s->scratch);
    free(s->detok_buf);
    zio_sock_close(s->cs);
    zio_sock_close(s->ws);
    if (s->zctx) zmq_ctx_term(s->zctx);
    reqstore_close(s->rs);
    tokenizer_free(s->tok);
    modelinfo_free(&s->mi);
    free(s);
}

const char *server_client_endpoint(const server *s) { return zio_endpoint(s->cs); }
const char *server_worker_endpoint(const server *s) { return zio_endpoint(s->ws); }

static void server_log_stats(server *s) {
    LOG(LL_INFO, "router: %llu requests, %llu steps; per step: planning %.1f us mean (%.1f max), "
        "result-to-next-plans %.1f us mean; %llu frames rejected, %llu client sends dropped, %llu stale results",
        (unsigned long long)s->requests_total, (unsigned long long)s->steps_total,
        s->plan_n ? s->plan_us_sum / (double)s->plan_n : 0.0, s->plan_us_max,
        s->turn_n ? s->turn_us_sum / (double)s->turn_n : 0.0,
        (unsigned long long)(proto_frames_rejected() + s->frames_bad), (unsigned long long)s->sends_dropped,
        (unsigned long long)s->stale_results);
}

/* Reads up to max messages from a ROUTER socket without waiting. */
static void drain(server *s, struct zio_sock *sock, bool workers, int max) {
    struct zio_parts in = {0};
    for (int i = 0; i < max; i++) {
        int rc = zio_recv(sock, &in, 0);
        if (rc < 0) break;
        const uint8_t *ident = zio_parts_data(&in, 0);
        size_t ident_len = zio_parts_size(&in, 0);
        if (in.n != 2) {
            /* One frame after the routing id is the protocol. */
            s->frames_bad++;
            char msg[128];
            snprintf(msg, sizeof msg, "a message must be exactly one frame; got %zu", in.n ? in.n - 1 : 0);
            if (workers) {
                uint8_t *out = NULL;
                size_t olen = 0;
                if (proto_worker_error_pack(LLM__ERROR__CODE__INVALID_ARGUMENT, "", msg, 0, &out, &olen) == 0) {
                    send_worker(s, ident, ident_len, out, olen);
                    free(out);
                }
            } else {
                send_client_error(s, ident, ident_len, 0, LLM__ERROR__CODE__INVALID_ARGUMENT, "", msg, 0);
            }
            continue;
        }
        if (workers) on_worker_frame(s, ident, ident_len, zio_parts_data(&in, 1), zio_parts_size(&in, 1));
        else on_client_frame(s, ident, ident_len, zio_parts_data(&in, 1), zio_parts_size(&in, 1));
    }
    zio_parts_free(&in);
}

int server_run(server *s, volatile sig_atomic_t *stop) {
    struct zio_sock *socks[2] = {s->ws, s->cs};
    short events[2] = {ZMQ_POLLIN, ZMQ_POLLIN}, revents[2];
    while (!*stop) {
        int rc = zio_poll(socks, events, revents, 2, 50);
        if (rc < 0) {
            LOG(LL_ERROR, "poll: %s", zio_errstr(s->ws));
            usleep(10000);
        }
        /* Workers first: results free the pipeline for the next step. */
        if (rc > 0 && (revents[0] & ZMQ_POLLIN)) drain(s, s->ws, true, 1024);
        if (rc > 0 && (revents[1] & ZMQ_POLLIN)) drain(s, s->cs, false, 256);
        timers(s);
        sync_pipelines(s);
        assign_queue(s);
        pump_all(s);
        flush_touched(s);
    }
    server_log_stats(s);
    LOG(LL_INFO, "router: stopping");
    return 0;
}
