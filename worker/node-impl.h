/* The body of a node and the functions its files share: node.c (init,
 * free, the io thread's loop), node_io.c (router and Redis messages),
 * node_mem.c (the stage and its memory), node_link.c (stage-to-stage
 * links), node_step.c (the compute thread and one plan).  Only worker/node*.c
 * include this. */
#ifndef WORKER_NODE_IMPL_H
#define WORKER_NODE_IMPL_H

#include "node.h"

#include "constrain.h"
#include "draft.h"
#include "forward.h"
#include "link.h"
#include "stage.h"

#include "common/kvblocks.h"
#include "common/sampling.h"
#include "common/zio.h"
#include "kernels/backend.h"
#include "proto/wire.h"

#include <pthread.h>
#include <stdatomic.h>
#include <stdint.h>
#include <sys/time.h>
#include <time.h>

/* Messages on the inproc pipe: one type byte, then the payload frame (a
 * plan and a placement carry a third: NODE_MSG_PLAN, node_pipe_forward_placement). */
#define NODE_MSG_PLAN 'P'      /* io -> compute: a packed WorkerEnvelope with a plan, the time it came */
#define NODE_MSG_PLACEMENT 'R' /* io -> compute: a packed WorkerEnvelope with a RegisterReply */
#define NODE_MSG_DRAIN 'D'     /* io -> compute: finish what came before, then stop */
#define NODE_MSG_RESULT 'S'    /* compute -> io: a packed WorkerEnvelope with a StepResult */
#define NODE_MSG_DONE 'X'      /* compute -> io: stopped */

#define NODE_PIPE "inproc://node-plans"
#define NODE_HEARTBEAT_DEFAULT_MS 1000
/* Heartbeat intervals without a connection to the router before a worker
 * with several router endpoints registers with the next one: the router's
 * own default worker timeout (5 s at 1 s beats), so that a router restart
 * under a supervisor keeps its workers and a dead one loses them. */
#define NODE_ROUTER_LOST_BEATS 5
#define NODE_DRAIN_MAX_MS 60000
/* A draining worker keeps running the plans that come until none has come
 * for this long (or a heartbeat interval, if longer), and only then tells
 * its compute thread to stop (node.c). */
#define NODE_DRAIN_QUIET_MS 500
/* Most drafts the draft model proposes for a sequence (= PROTO_SPEC_TOKENS_MAX). */
#define NODE_DRAFT_MAX 16
/* A refused handshake (docs/security.md, "A worker whose key is refused"):
 * the first retry after 2 s, then twice as long each time, up to a minute. */
#define NODE_REFUSED_RETRY_MS 2000
#define NODE_REFUSED_RETRY_MAX_MS 60000

/* What the worker knows of one sequence between plans, for the router's
 * current epoch only: a new epoch (a re-formed pipeline, or another router)
 * forgets them all (node_seqs_reset). */
struct node_seq {
    uint64_t id;
    int32_t *table;        /* its latest block table, as the router planned it */
    int32_t n_blocks, cap_table;
    int32_t *hist;         /* last stage: its tokens at positions 0..n_hist-1 */
    int32_t n_hist, cap_hist;
    int hist_whole;        /* hist holds every position from 0 (else some are missing) */
    struct constrain_seq cs; /* last stage: its constraint's parse state */
    struct draft_seq ds;     /* last stage with a draft model: the draft's state of it */
};

struct node {
    struct node_config cfg;
    char *s_model, *s_worker_id, *s_router, *s_redis, *s_listen, *s_advertise;
    char host[128];
    uint64_t incarnation;

    backend *b;
    model_file *m;
    const struct model_hparams *hp;
    stage *s;
    /* The draft model (cfg.draft_model): its file, open from the start
     * (its vocabulary checked then, its sizes read by the stage's sizing),
     * and the model, loaded with a last stage; NULL otherwise.  dreqs
     * [n_seqs_max] and res_draft [n_seqs_max * NODE_DRAFT_MAX] are its
     * requests and the drafts answered. */
    char *s_draft;
    model_file *draft_m;
    float draft_min_prob;
    int32_t draft_type;
    draft *dm;
    struct draft_req *dreqs;
    int32_t *res_draft;
    int32_t n_vocab, dim;
    int device_links; /* links carry device buffers (NCCL) */

    void *zctx;
    /* CURVE, unless cfg.insecure: this worker's keys, the router's public
     * key, and the ZAP handler that admits on the link listener only the
     * predecessor the router placed (LINK_ZAP_DOMAIN). */
    int secure;
    struct keys_pair kp;
    char router_key[KEYS_Z85_LEN + 1];
    char next_key[KEYS_Z85_LEN + 1]; /* the next stage's key the tx link was made for */
    zio_zap *zap;
    struct zio_sock *router; /* DEALER, io thread */
    /* The router endpoints (--router a,b): the worker talks to
     * routers[router_cur] (s_router points at it) and moves to the next
     * when that one has not been connected for NODE_ROUTER_LOST_BEATS
     * heartbeat intervals (docs/worker.md, "Router fail-over").  The
     * monitor reports the connection's handshakes and disconnects. */
    char **routers;
    size_t n_routers, router_cur;
    struct zio_sock *router_mon;
    int64_t router_down_since; /* 0 while connected */
    uint32_t router_seq;       /* sockets opened (names the monitor) */
    /* This incarnation's connections to a router, counted from 1 and
     * stated in Register (its session): a connection that broke may have
     * lost plans, results or a placement either way, so the next one
     * registers again under a new session, and the router re-forms the
     * pipeline (docs/worker.md, "When the connection breaks"). */
    uint32_t router_session;
    int router_broke;          /* a break not yet handled by node_run */
    /* The router refused this worker's handshake (its key is not admitted,
     * or the keys do not match): ZeroMQ does not reconnect after that, so
     * the worker opens the connection again at router_retry_at, backing off
     * from NODE_REFUSED_RETRY_MS to NODE_REFUSED_RETRY_MAX_MS. */
    int64_t router_retry_at;   /* 0: none pending */
    int32_t router_refused_ms; /* the current back-off */
    uint64_t router_refusals;  /* handshakes refused since the last one admitted */
    _Atomic int router_refused; /* 1 while the last handshake was refused (for /ready) */
    struct rconn *redis;     /* io thread only */
    char redis_key[192];
    struct zio_sock *pipe_io, *pipe_compute;
    pthread_t compute;
    int compute_started;

    /* Placement (compute thread; the io thread reads it under lock to build Register). */
    pthread_mutex_t lock;
    uint32_t pipeline_id;
    int32_t stage_index, stage_count, layer_first, layer_end;
    uint64_t epoch;
    uint32_t epoch_session;   /* the router session (router_session) whose RegisterReply set epoch */
    char stage_endpoint[256]; /* where our receiving ZeroMQ link is bound, as others reach it */
    char next_endpoint[256];  /* where our sending ZeroMQ link is connected */
    uint64_t links_epoch;     /* epoch the links were made for (the ZeroMQ one: the sending link) */
    link_conn *rx;            /* from the previous stage */
    link_conn *tx;            /* to the next stage */
    _Atomic uint64_t placements_sent; /* placements the io thread handed on (link_set_abort) */
    _Atomic uint64_t placement_epoch; /* the epoch of the latest one (node_step drops older plans) */
    int links_ok;             /* the links this placement needs exist */
    char links_err[512];

    /* Step scratch (compute thread), sized at stage load. */
    int32_t n_tokens_max, n_seqs_max, max_blocks;
    /* What the sizing assumed (worker/sizing.h), stated in Register. */
    int32_t target_ctx, kv_seqs; /* typical positions per sequence; sequences of it the KV holds */
    unsigned sized_auto;         /* enum sizing_auto: the limits chosen rather than given */
    float *hidden_in_host, *hidden_out_host; /* [n_tokens_max, dim] */
    /* The last stage's sampling, one row per logits row: [max(n_tokens_max,
     * n_seqs_max)] (a speculative sequence has k + 1). */
    struct backend_sample_row *srows;
    struct forward_seq *fseqs;
    int32_t *tables;                         /* [n_seqs_max, max_blocks] */
    struct kvblocks_copy *copies;
    int32_t cap_copies;
    struct sampling_params *params;          /* [n_seqs_max] */
    char (*seq_err)[256];                    /* [n_seqs_max] per-sequence error, "" if none */
    int *seq_status;                         /* [n_seqs_max] its status (0: a bad request) */
    /* Constrained decoding (last stage): the grammars, and this step's
     * masks, one per constrained logits row: [n_seqs_max, mask words],
     * allocated on the first constrained step. */
    constrain *cons;
    uint64_t *masks;
    int32_t *mask_seq;                       /* [n_seqs_max] the plan index of mask row k */
    int32_t n_masks;
    /* The last stage's StepResult, built in place: res, res_ptr, res_err
     * [n_seqs_max]; the per-row ones (logprobs, a speculative sequence's
     * next_tokens) as many as srows. */
    Llm__SeqResult *res;
    Llm__SeqResult **res_ptr;
    Llm__TokenLogprob *res_lp;
    Llm__TokenLogprob **res_lp_ptr;
    int32_t *res_next;
    Llm__Error *res_err;
    Llm__TopLogprob (*res_top)[SAMPLING_TOP_LOGPROBS_MAX];
    Llm__TopLogprob *(*res_top_ptr)[SAMPLING_TOP_LOGPROBS_MAX];

    struct node_seq *seqs;
    int32_t n_seqs, cap_seqs;
    /* The stage's KV view: references the sequences' tables hold on each
     * block (as the router's block tables say) and the blocks with any, so
     * that blocks shared by several sequences count once, as the router
     * counts them.  [kv_blocks_total], compute thread. */
    int32_t *kv_refs;
    int32_t kv_used;
    /* The rx link's drop counters already added to the metrics. */
    uint64_t rx_dropped_mark[LINK_DROP_N];

    /* Shared counters (written by the compute thread, read by heartbeats). */
    _Atomic int state; /* Llm__Heartbeat__State */
    _Atomic uint64_t last_step_id, steps_total, tokens_total;
    _Atomic uint32_t kv_blocks_used;
    _Atomic uint32_t kv_blocks_total, kv_block_size; /* of the stage loaded now */
    uint64_t mem_total;                              /* device (or host) memory, at init */
    struct node_metrics *metrics;                    /* worker/node_metrics.h; NULL: none */
};

static inline int64_t node_now_ms(void) {
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (int64_t)ts.tv_sec * 1000 + ts.tv_nsec / 1000000;
}

static inline int64_t node_now_us(void) {
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (int64_t)ts.tv_sec * 1000000 + ts.tv_nsec / 1000;
}

static inline int64_t node_unix_ms(void) {
    struct timeval tv;
    gettimeofday(&tv, NULL);
    return (int64_t)tv.tv_sec * 1000 + tv.tv_usec / 1000;
}

/* ---- node_mem.c: the stage and its buffers ---- */

/* The layers of stage cfg.stage_index of cfg.stage_count by
 * common/layersplit, from the sizes the router reads too, so that the
 * router's placement finds them loaded.  STATUS_BAD_INPUT (err says why)
 * when the index is out of range or there are more stages than layers. */
int node_layers_default(node *n, int32_t *first, int32_t *end, char *err, size_t errlen);
/* Frees the step buffers (not the stage). */
void node_buffers_free(node *n);
/* Loads layers [first, end): checks that weights, KV cache and workspace
 * fit before allocating, then logs what each takes. */
int node_stage_load(node *n, int32_t first, int32_t end, char *err, size_t errlen);

/* ---- node_link.c: links to the neighbouring stages ---- */

void node_links_close(node *n, int keep_rx_zmq);
/* Applies a RegisterReply that answered the Register of router session
 * `session` (compute thread, or before it starts). */
void node_placement_apply(node *n, const Llm__RegisterReply *r, uint32_t session);
int node_input_recv(node *n, uint64_t step, int32_t T, struct forward_batch *batch, char *err,
                    size_t errlen);
int node_output_send(node *n, uint64_t step, int32_t T, char *err, size_t errlen);
void node_skip_send(node *n, uint64_t step, int32_t T);

/* ---- node_step.c: the compute thread ---- */

void node_seqs_free(node *n);
/* Forgets every sequence (and so every KV block the stage's view holds):
 * the router that planned them, or the epoch they belong to, is gone.  Logs
 * why when there were any. */
void node_seqs_reset(node *n, const char *why);
/* The compute thread's body (arg is the node). */
void *node_compute_main(void *arg);

/* ---- node_io.c: router and Redis (io thread) ---- */

enum node_router_event {
    NODE_EV_NONE = 0,
    NODE_EV_ACCEPTED = 1, /* an accepted RegisterReply (forwarded) */
    NODE_EV_REFUSED = 2,  /* refused, no retry: fatal */
    NODE_EV_RETRY = 3,    /* refused, register again after retry_ms */
    NODE_EV_PLAN = 4,     /* a plan, forwarded to the compute thread */
};

void node_router_send(node *n, uint8_t *buf, size_t len, const char *what);
/* Splits "tcp://a:5556,tcp://b:5556" into n->routers (STATUS_BAD_INPUT
 * naming the entry when one is empty or not an endpoint). */
int node_routers_parse(node *n, const char *list, char *err, size_t errlen);
/* Opens the DEALER (with its monitor) to routers[router_cur]; closes it. */
int node_router_open(node *n, char *err, size_t errlen);
void node_router_close(node *n);
/* Reads the monitor's events and keeps router_down_since up to date; a
 * refused handshake is logged (naming the key file, the public key and the
 * endpoint) and schedules a new connection at router_retry_at.  A
 * connection that ends starts a new session (router_session) and sets
 * router_broke. */
void node_router_events(node *n, int64_t now);
/* Opens the connection again once router_retry_at has come; a negative
 * status (err says why) when no socket could be opened. */
int node_router_retry(node *n, int64_t now, char *err, size_t errlen);
int node_redis_ttl_ms(node *n, uint32_t hb_ms);
void node_redis_register(node *n, uint32_t hb_ms);
void node_heartbeat(node *n, uint32_t hb_ms);
void node_send_register(node *n);
int node_router_message(node *n, const struct zio_parts *in, int running, int draining,
                        uint32_t *hb_ms, int *retry_ms, char *err, size_t errlen);

#endif
