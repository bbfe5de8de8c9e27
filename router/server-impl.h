/* The router's private state, shared by the files of its event loop
 * (server.c, server_reqs.c, server_pipes.c, server_worker.c,
 * server_client.c, server_timers.c).  Only router/server*.c include this.
 * Everything here runs on the loop's one thread. */
#ifndef ROUTER_SERVER_IMPL_H
#define ROUTER_SERVER_IMPL_H

#include "router/server.h"

#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>

#include "common/rconn.h"
#include "common/sampling.h"
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
/* Error.reason of a prompt that fills the model's context (proto/types.proto):
 * what the gateway maps to OpenAI's context_length_exceeded. */
#define SERVER_REASON_CONTEXT "context_length_exceeded"
#define SERVER_RETRY_AFTER_MS 1000 /* UNAVAILABLE: about one worker heartbeat, or a Redis reconnect */

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
    char id[PROTO_REQUEST_KEY_MAX + 1]; /* in memory and Redis: the client's id, " <choice>" for choices 1.. */
    /* A request of n > 1 (docs/protocol.md, "Several choices") is n of
     * these, one per choice, each with its own Redis state, seed
     * (proto_choice_seed) and sequence: cid is the client's id, choice the
     * index its chunks and GenerateDone carry; choice 0 has id == cid and
     * is the one a re-attach or cancel finds first. */
    char cid[PROTO_REQUEST_ID_MAX + 1];
    uint32_t choice, n_choices;
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
    char owner[48];                /* its creator's public key ("": none; docs/security.md) */
    int64_t created_ms, deadline_ms, done_ms;
    int64_t last_token_us;         /* server_mono_us() of its latest token (0: none yet) */
    bool placed_once;              /* its queue time is recorded (router/server_metrics.h) */
    int32_t priority;
    int32_t limit;                 /* prompt + completion tokens, at most */
    uint64_t order;
    enum req_state state;
    struct pipe *pipe;
    uint32_t ended_on;             /* 1 + the id of the pipeline it ended on (0: none; --batch-wait-us) */
    int64_t assigned_us;           /* server_mono_us() when it went to its pipeline (--prefill-hold-ms) */
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
    bool stall_told;               /* its client heard that no pipeline can run it */
    int64_t client_seen_ms;        /* its client's latest Generate for it (0: not yet looked at) */
    /* Predicted output (GenerateRequest.prediction, tokenized without BOS,
     * or prediction_tokens; docs/router.md, "Predicted outputs"); NULL
     * when none.
     * pred_off: ngram_propose_pred's alignment.  pred_drafts: the drafts
     * kept for q's next step came from it (counted as prompt lookup's),
     * not from the draft model.  pred_only: mode ngram, so the last stage
     * is asked for no draft-model guesses.  pred_matched: those drafts are
     * the prediction's tokens, not the fallback lookup in the sequence;
     * their verdicts add up in pred_accepted and pred_rejected (Usage's
     * accepted/rejected_prediction_tokens). */
    int32_t *pred;
    int32_t n_pred, pred_off;
    bool pred_drafts, pred_only, pred_matched;
    uint32_t pred_accepted, pred_rejected;
};

/* A client connection a send failed to (gone, or not reading), since when. */
struct gone {
    uint8_t ident[256];
    size_t ident_len;
    int64_t since_ms;
    struct gone *next;
};
#define SERVER_GONE_BUCKETS 64

struct flight {
    uint64_t step_id;
    int64_t sent_ms;
    int64_t sent_us;               /* server_mono_us(), for the step-time model */
    int32_t n_prefill, n_decode;   /* the step's tokens */
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
    bool spec_auto_on;             /* --spec auto speculates now (pipe_set_spec_auto) */
    /* Plan packing buffers, max_batch entries. */
    Llm__SeqPlan *seqplans;
    Llm__SeqPlan **seqptrs;
    Llm__BlockCopy *copies;
    Llm__BlockCopy **copyptrs;
    /* Throughput. */
    uint64_t gen_tokens, prompt_tokens, gen_mark, prompt_mark;
    double tok_s, prompt_tok_s;
    char last_problem[256];
    /* Step time against prefill tokens, for the ITL target (docs/router.md,
     * "Decode latency"): exponentially weighted sums of the steps with
     * decodes, and the fitted line t = base_us + us_per_token * prefill. */
    double fit_w, fit_p, fit_pp, fit_t, fit_pt;
    double base_us, us_per_token; /* us_per_token 0: no fit yet */
    int64_t last_result_us;
    /* --batch-wait-us: when an idle pipeline got its first prompt (0: none),
     * when the last came, and how many were waiting then. */
    int64_t idle_first_us, idle_last_us;
    int32_t idle_waiting;
    int64_t last_end_us; /* the last GenerateDone sent for a request that ran here */
    bool touched; /* in server.pipes_touched */
};

struct keys_list;

struct server {
    struct server_config cfg;
    struct modelinfo mi;
    tokenizer *tok;
    void *zctx;
    struct zio_sock *cs, *ws; /* clients, workers */
    struct zio_sock *wmon;    /* PAIR fed by the worker socket's monitor: its closed connections */
    /* Each worker connection's file descriptor (ZMQ_SRCFD of its latest
     * message), so that a closed one (the monitor names its fd) is known
     * by routing id: server.c, worker_conn_closed. */
    struct wconn {
        int fd;
        uint8_t ident[256];
        size_t ident_len;
    } *wconns;
    size_t n_wconns, cap_wconns;
    zio_zap *zap;             /* admits the listed keys; NULL when insecure */
    struct keys_list *admins; /* --admin-keys (also admitted as clients); NULL: none */
    /* The sender of the frame being handled: its CURVE key, or "" on an
     * insecure router. */
    const char *peer_key;
    uint64_t workers_refused; /* registrations, heartbeats, results from a key not the id's */
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
    uint64_t spec_steps, spec_drafts, spec_accepted; /* speculation's verdicts (server_worker.c) */
    double tok_s, prompt_tok_s;
    int64_t idle_since_ms;         /* since when no pipeline takes work (0: some does) */
    /* The loop's turns (docs/router.md, "Capacity"): pipelines that need
     * pumping after this turn's results and requests, and whether the
     * turn walks every pipeline (something other than results came). */
    struct pipe **pipes_touched;
    size_t n_pipes_touched, cap_pipes_touched;
    bool loop_full;
    int64_t last_full_ms;
    int spin_us; /* the worker socket's spin now: cfg.spin_us, or what auto chose (server_spin_auto) */
    int64_t batch_wake_us; /* the earliest end of a --batch-wait-us or --prefill-hold-ms; 0: none */
    /* Clients gone (docs/router.md, "Clients that go away"). */
    struct gone *gone[SERVER_GONE_BUCKETS];
    size_t n_gone;
    uint64_t clients_gone;         /* requests cancelled because their client went away */
    int64_t last_gone_ms, last_probe_ms;
};

/* ---- server.c: time, buffers, sending --------------------------------- */

int64_t server_now_ms(void);   /* wall clock (deadlines are Unix ms) */
int64_t server_mono_us(void);  /* for measuring the loop's own cost */
/* Grows *p to hold at least want elements of elem bytes (doubling). */
int server_grow(void **p, size_t *cap, size_t want, size_t elem);
/* Never block: a dropped client send is counted, the client re-attaches.
 * A send that fails because the connection is gone or full starts its
 * client's grace (server_clients_gone); one that goes through ends it. */
void server_send_client(server *s, const uint8_t *ident, size_t ident_len, Llm__ClientEnvelope *env);
void server_send_client_error(server *s, const uint8_t *ident, size_t ident_len, uint64_t tag,
                              Llm__Error__Code code, const char *rid, const char *msg,
                              uint32_t retry_after_ms);
/* The same with Error.reason set (proto/types.proto: a stable name a client
 * branches on, like "context_length_exceeded"; NULL: none). */
void server_send_client_error_reason(server *s, const uint8_t *ident, size_t ident_len, uint64_t tag,
                                     Llm__Error__Code code, const char *reason, const char *rid,
                                     const char *msg, uint32_t retry_after_ms);
/* Queue a message to a worker's connection without waiting: 0, or a
 * negative status when it could not be queued (no connection under that
 * routing id, ZMQ_ROUTER_MANDATORY's EHOSTUNREACH, or its queue full): the
 * worker then misses it, and the caller decides what that costs (logged
 * here at debug level). */
int server_send_worker(server *s, const uint8_t *ident, size_t ident_len, const uint8_t *buf, size_t len);
int server_send_worker_env(server *s, const uint8_t *ident, size_t ident_len, Llm__WorkerEnvelope *env);
void server_log_stats(server *s);
/* --spin-us auto (cfg.spin_us < 0): the worker socket spins
 * ZIO_SPIN_US_GPU while GPU workers serve (registry_n_gpu_stages), else
 * blocks at once; logs each change.  Explicit values are left alone. */
void server_spin_auto(server *s);

/* ---- server_reqs.c: requests in memory --------------------------------- */

/* The request id of the client key owner (docs/security.md, "Request ownership"):
 * ids are per key, so two keys may each have a request "a" ("" on a router
 * without keys). */
struct req *req_find(server *s, const char *owner, const char *id);
/* Whether a key other than owner has a request id in memory. */
bool req_find_other(server *s, const char *owner, const char *id);
struct req *req_by_seq(server *s, uint64_t seq_id);
void req_seq_put(server *s, struct req *q);
void req_seq_del(server *s, struct req *q);
struct req *req_new(server *s, const struct reqrec *r, char *err, size_t errlen);
void req_unlink(server *s, struct req *q);
void req_free(struct req *q);
int req_queue_push(server *s, struct req *q);
void req_touch(server *s, struct req *q);
size_t req_stop_hold(const struct req *q);
size_t req_text_offset(server *s, const struct req *q, int32_t n);
void req_send_chunk(server *s, struct req *q, int32_t from, int32_t to, size_t t0, size_t t1);
void req_send_done(server *s, struct req *q, const uint8_t *ident, size_t ident_len);
void req_store_finish(server *s, struct req *q);
void req_end(server *s, struct req *q, int32_t finish, int32_t stop_token, const char *stop_string,
             Llm__Error__Code code, const char *msg);
void req_flush_touched(server *s);
void req_token(server *s, struct req *q, int32_t token, const Llm__TokenLogprob *lp);
/* q's speculation (docs/router.md, "Speculation"): the drafts a decode
 * step of it may carry (0: none) and whether only under --spec auto's
 * rule.  Its own spec and spec_tokens, else the router's; none for a
 * constrained request.  A prediction makes the router's off (for a request
 * that does not choose) prompt lookup, through req_pred_drafts. */
void req_spec(const server *s, const struct req *q, int32_t *k, bool *auto_only, unsigned *sources);
/* After q's step appended its tokens: drafts for its next step found in
 * its prompt, predicted output and output (a request with a prediction
 * only; the draft model's guesses, if any, stay when none is found). */
void req_pred_drafts(server *s, struct req *q);

/* ---- server_pipes.c: pipelines ----------------------------------------- */

void pipe_free(struct pipe *pp);
void pipe_on_drop(struct pipeline *p, void *ud); /* registry_expire's callback */
int32_t pipe_capacity_tokens(const struct pipe *pp);
void pipe_pump(server *s, struct pipe *pp);
void pipes_sync(server *s);
void pipes_assign(server *s);
void pipes_pump(server *s);
/* pp is pumped again at the end of this loop turn (pipes_pump_touched). */
void pipe_touch(server *s, struct pipe *pp);
void pipes_pump_touched(server *s);
/* A step of pp came back at now_us (server_mono_us): its time feeds the
 * step-time model behind the prefill cap. */
void pipe_step_observed(server *s, struct pipe *pp, const struct flight *f, int64_t now_us);
/* The pipelines that take new work (in service, not draining): how many,
 * and the largest KV capacity among them in tokens (-1 when none) with
 * its pipeline's id. */
int32_t pipes_taking_work(server *s, int32_t *cap_max, uint32_t *cap_pid);
/* Why no pipeline takes work (no worker, a pipeline's problem, stages not
 * ready yet), for the client's UNAVAILABLE. */
void pipes_why_idle(server *s, char *buf, size_t size);
/* Tells a client of q (tag: its request's, or 0) that q is accepted and
 * kept but no pipeline can run it now: UNAVAILABLE with retry_after_ms, so
 * that the client's own bound on waiting applies. */
void pipes_tell_stalled(server *s, struct req *q, const uint8_t *ident, size_t ident_len, uint64_t tag);

/* ---- server_worker.c, server_client.c: one message each ------------------ */

void server_on_worker_frame(server *s, const uint8_t *ident, size_t ident_len, const uint8_t *buf, size_t len);
void server_on_client_frame(server *s, const uint8_t *ident, size_t ident_len, const uint8_t *buf, size_t len);

/* ---- server_timers.c: Redis and everything that runs on the clock -------- */

void server_redis_connect(server *s);
void server_timers(server *s);
/* The client socket's allowlist again: --client-keys and --admin-keys (an
 * admin is a client too) into the ZAP handler, and s->admins.  On failure,
 * with err naming the file (and line), the lists in force stay. */
int server_load_client_keys(server *s, char *err, size_t errlen);
/* An admin's DrainRequest (on) or its resume (off) for p: no new work is
 * placed there while on; its waiting sequences go back to the queue at
 * once (but those waiting to fork a choice running there), its running
 * ones finish there. */
void pipes_drain(server *s, struct pipeline *p, bool on);

#endif
