/* The worker's registration, heartbeat and plan-execution loop (see
 * node.h).  The calling thread owns the router socket and Redis; the
 * compute thread owns the stage, the links and the per-sequence state.
 * They talk over an inproc PAIR: plans and placements one way, packed
 * StepResults the other. */
#include "node.h"

#include "forward.h"
#include "link.h"
#include "stage.h"

#include "common/kvblocks.h"
#include "common/log.h"
#include "common/rconn.h"
#include "common/sampling.h"
#include "common/status.h"
#include "common/zio.h"
#include "kernels/backend.h"
#include "proto/wire.h"
#if defined(LLM_HAVE_CUDA)
#include "kernels/cuda/nccl_link.h"
#include "kernels/cuda/stream_access.h"
#endif

#include <errno.h>
#include <pthread.h>
#include <stdatomic.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/time.h>
#include <time.h>
#include <unistd.h>

/* Messages on the inproc pipe: one type byte, then the payload frame. */
#define NODE_MSG_PLAN 'P'      /* io -> compute: a packed WorkerEnvelope with a plan */
#define NODE_MSG_PLACEMENT 'R' /* io -> compute: a packed WorkerEnvelope with a RegisterReply */
#define NODE_MSG_DRAIN 'D'     /* io -> compute: finish what came before, then stop */
#define NODE_MSG_RESULT 'S'    /* compute -> io: a packed WorkerEnvelope with a StepResult */
#define NODE_MSG_DONE 'X'      /* compute -> io: stopped */

#define NODE_PIPE "inproc://node-plans"
#define NODE_HEARTBEAT_DEFAULT_MS 1000
#define NODE_DRAIN_MAX_MS 60000

/* What the worker knows of one sequence between plans. */
struct node_seq {
    uint64_t id;
    int32_t n_blocks;      /* length of its latest block table (for the heartbeat) */
    int32_t *hist;         /* last stage: its tokens at positions 0..n_hist-1 */
    int32_t n_hist, cap_hist;
};

struct node {
    struct node_config cfg;
    char *s_model, *s_worker_id, *s_device, *s_router, *s_redis, *s_listen, *s_advertise;
    char host[128];
    uint64_t incarnation;

    backend *b;
    model_file *m;
    const struct model_hparams *hp;
    stage *s;
    int32_t n_vocab, dim;
    int device_links; /* links carry F16 device buffers (NCCL) */

    void *zctx;
    struct zio_sock *router; /* DEALER, io thread */
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
    char stage_endpoint[256]; /* where our receiving ZeroMQ link is bound, as others reach it */
    char next_endpoint[256];  /* where our sending ZeroMQ link is connected */
    uint64_t links_epoch;     /* epoch the NCCL links were made for */
    link_conn *rx;            /* from the previous stage */
    link_conn *tx;            /* to the next stage */
    int links_ok;             /* the links this placement needs exist */
    char links_err[512];

    /* Step scratch (compute thread), sized at stage load. */
    int32_t n_tokens_max, n_seqs_max, max_blocks;
    float *hidden_in_host, *hidden_out_host; /* [n_tokens_max, dim] */
    void *dev_in_f16, *dev_out_f16;          /* [n_tokens_max, dim] F16, device links */
    float *dev_in_f32;                       /* [n_tokens_max, dim] F32 backend memory */
    struct backend_sample_row *srows;        /* [n_seqs_max] the last stage's sampling */
    struct forward_seq *fseqs;
    int32_t *tables;                         /* [n_seqs_max, max_blocks] */
    struct kvblocks_copy *copies;
    int32_t cap_copies;
    struct sampling_params *params;          /* [n_seqs_max] */
    char (*seq_err)[256];                    /* [n_seqs_max] per-sequence error, "" if none */
    /* The last stage's StepResult, built in place: [n_seqs_max] each. */
    Llm__SeqResult *res;
    Llm__SeqResult **res_ptr;
    Llm__TokenLogprob *res_lp;
    Llm__Error *res_err;
    Llm__TopLogprob (*res_top)[SAMPLING_TOP_LOGPROBS_MAX];
    Llm__TopLogprob *(*res_top_ptr)[SAMPLING_TOP_LOGPROBS_MAX];

    struct node_seq *seqs;
    int32_t n_seqs, cap_seqs;

    /* Shared counters (written by the compute thread, read by heartbeats). */
    _Atomic int state; /* Llm__Heartbeat__State */
    _Atomic uint64_t last_step_id, steps_total, tokens_total;
    _Atomic uint32_t kv_blocks_used;
    _Atomic uint32_t kv_blocks_total, kv_block_size; /* of the stage loaded now */
    uint64_t mem_total;                              /* device (or host) memory, at init */
};

static int64_t node_now_ms(void) {
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (int64_t)ts.tv_sec * 1000 + ts.tv_nsec / 1000000;
}

static int64_t node_now_us(void) {
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (int64_t)ts.tv_sec * 1000000 + ts.tv_nsec / 1000;
}

static int64_t node_unix_ms(void) {
    struct timeval tv;
    gettimeofday(&tv, NULL);
    return (int64_t)tv.tv_sec * 1000 + tv.tv_usec / 1000;
}

static char *node_strdup(const char *s) { return s ? strdup(s) : NULL; }

void node_config_default(struct node_config *cfg) {
    memset(cfg, 0, sizeof *cfg);
    cfg->device = "auto";
    cfg->router = "tcp://127.0.0.1:5556";
    cfg->listen = "tcp://*:*";
    cfg->stage_count = 1;
    cfg->mem_fraction = 0.9;
    cfg->kv_block_size = KVBLOCKS_BLOCK_SIZE_DEFAULT;
    cfg->max_batch_tokens = 512;
    cfg->max_seqs = 16;
    cfg->link_timeout_ms = 30000;
    cfg->register_retry_ms = 2000;
}

/* ---- layer split and memory -------------------------------------------- */

static size_t node_tensor_bytes(const model_file *m, const char *name) {
    struct model_tensor t;
    return model_file_tensor(m, name, &t) == STATUS_OK ? t.nbytes : 0;
}

static size_t node_layer_bytes(const model_file *m, int32_t layer) {
    static const char *const parts[] = {"attn_norm.weight", "attn_q.weight",   "attn_k.weight",
                                        "attn_v.weight",    "attn_output.weight", "ffn_norm.weight",
                                        "ffn_gate.weight",  "ffn_up.weight",   "ffn_down.weight",
                                        "attn_q.bias",      "attn_k.bias",     "attn_v.bias"};
    size_t sum = 0;
    char name[96];
    for (size_t i = 0; i < sizeof parts / sizeof parts[0]; i++) {
        snprintf(name, sizeof name, "blk.%d.%s", layer, parts[i]);
        sum += node_tensor_bytes(m, name);
    }
    return sum;
}

/* Bytes of weights a stage of layers [first, end) holds. */
static size_t node_range_bytes(const model_file *m, int32_t first, int32_t end) {
    const struct model_hparams *hp = model_file_hparams(m);
    size_t sum = 0;
    for (int32_t l = first; l < end; l++) sum += node_layer_bytes(m, l);
    if (first == 0) sum += node_tensor_bytes(m, "token_embd.weight");
    if (end == hp->n_layers) {
        sum += node_tensor_bytes(m, "output_norm.weight");
        sum += hp->tied_embeddings ? node_tensor_bytes(m, "token_embd.weight")
                                   : node_tensor_bytes(m, "output.weight");
    }
    return sum;
}

int node_layer_split(const model_file *m, int32_t n_stages, int32_t index, int32_t *first,
                     int32_t *end, char *err, size_t errlen) {
    const struct model_hparams *hp = model_file_hparams(m);
    int32_t L = hp->n_layers;
    if (n_stages < 1 || index < 0 || index >= n_stages) {
        snprintf(err, errlen, "stage %d of %d: the index must lie in [0, %d)", index, n_stages,
                 n_stages < 1 ? 1 : n_stages);
        return STATUS_BAD_INPUT;
    }
    if (n_stages > L) {
        snprintf(err, errlen, "%d stages for %s: the model has only %d layers", n_stages,
                 model_file_path(m), L);
        return STATUS_BAD_INPUT;
    }
    /* Cumulative bytes with the embedding before layer 0 and the head after
     * the last: cut where the running total crosses k/n of the whole, while
     * leaving at least one layer for every stage on either side. */
    size_t total = node_range_bytes(m, 0, L);
    size_t acc = node_range_bytes(m, 0, 0); /* the embedding alone (end 0 is not the last layer) */
    int32_t cut_prev = 0;
    int32_t cuts[L + 1];
    cuts[0] = 0;
    int32_t k = 1;
    for (int32_t l = 0; l < L && k < n_stages; l++) {
        acc += node_layer_bytes(m, l);
        int32_t next = l + 1;
        int32_t left_needed = n_stages - k; /* stages still to place after this cut */
        int must_cut = L - next == left_needed;
        if (must_cut || (double)acc >= (double)total * k / n_stages) {
            if (next > cut_prev && L - next >= left_needed) {
                cuts[k++] = next;
                cut_prev = next;
            }
        }
    }
    cuts[n_stages] = L;
    *first = cuts[index];
    *end = cuts[index + 1];
    return STATUS_OK;
}

static double node_mib(size_t bytes) { return bytes / (1024.0 * 1024.0); }

/* ---- per-sequence state ------------------------------------------------ */

static struct node_seq *node_seq_find(node *n, uint64_t id) {
    for (int32_t i = 0; i < n->n_seqs; i++)
        if (n->seqs[i].id == id) return &n->seqs[i];
    return NULL;
}

static struct node_seq *node_seq_get(node *n, uint64_t id) {
    struct node_seq *q = node_seq_find(n, id);
    if (q) return q;
    if (n->n_seqs == n->cap_seqs) {
        int32_t cap = n->cap_seqs ? n->cap_seqs * 2 : 64;
        struct node_seq *t = realloc(n->seqs, (size_t)cap * sizeof *t);
        if (!t) return NULL;
        n->seqs = t;
        n->cap_seqs = cap;
    }
    q = &n->seqs[n->n_seqs++];
    memset(q, 0, sizeof *q);
    q->id = id;
    return q;
}

static void node_seq_forget(node *n, uint64_t id) {
    struct node_seq *q = node_seq_find(n, id);
    if (!q) return;
    free(q->hist);
    *q = n->seqs[--n->n_seqs];
}

static void node_seqs_free(node *n) {
    for (int32_t i = 0; i < n->n_seqs; i++) free(n->seqs[i].hist);
    free(n->seqs);
    n->seqs = NULL;
    n->n_seqs = n->cap_seqs = 0;
}

static int node_hist_append(struct node_seq *q, const int32_t *toks, size_t n_toks) {
    if ((size_t)q->n_hist + n_toks > (size_t)INT32_MAX / 2) return STATUS_BAD_INPUT;
    int32_t need = q->n_hist + (int32_t)n_toks;
    if (need > q->cap_hist) {
        int32_t cap = q->cap_hist ? q->cap_hist : 64;
        while (cap < need) cap *= 2;
        int32_t *t = realloc(q->hist, (size_t)cap * sizeof *t);
        if (!t) return STATUS_NO_MEMORY;
        q->hist = t;
        q->cap_hist = cap;
    }
    memcpy(q->hist + q->n_hist, toks, n_toks * sizeof *toks);
    q->n_hist = need;
    return STATUS_OK;
}

/* The last stage's history of a sequence after this step's tokens ran:
 * positions 0..start_pos-1 as known (reset at position 0, rolled back if
 * the router went back, or replaced by penalty_context when the sequence
 * starts on a prefix this worker has not seen), then the step's tokens. */
static int node_hist_update(struct node_seq *q, const Llm__SeqPlan *sp) {
    int32_t pos = (int32_t)sp->start_pos;
    if (pos == 0) {
        q->n_hist = 0;
    } else if (q->n_hist != pos) {
        if (sp->n_penalty_context > 0) {
            q->n_hist = 0;
            int rc = node_hist_append(q, sp->penalty_context, sp->n_penalty_context);
            if (rc != STATUS_OK) return rc;
        } else if (q->n_hist > pos) {
            q->n_hist = pos;
        } else {
            LOG(LL_DEBUG, "seq %llu: history has %d tokens before position %d; penalties see "
                "only those", (unsigned long long)sp->seq_id, q->n_hist, pos);
        }
    }
    return node_hist_append(q, sp->tokens, sp->n_tokens);
}

static void node_kv_used_update(node *n) {
    uint64_t used = 0;
    for (int32_t i = 0; i < n->n_seqs; i++) used += (uint64_t)n->seqs[i].n_blocks;
    uint32_t total = atomic_load(&n->kv_blocks_total);
    atomic_store(&n->kv_blocks_used, used > total ? total : (uint32_t)used);
}

/* ---- the stage and its buffers ------------------------------------------ */

static void node_buffers_free(node *n) {
    if (n->b) {
        if (n->dev_in_f16) backend_dealloc(n->b, n->dev_in_f16);
        if (n->dev_out_f16) backend_dealloc(n->b, n->dev_out_f16);
        if (n->dev_in_f32) backend_dealloc(n->b, n->dev_in_f32);
    }
    n->dev_in_f16 = n->dev_out_f16 = NULL;
    n->dev_in_f32 = NULL;
    free(n->hidden_in_host);
    free(n->hidden_out_host);
    free(n->srows);
    free(n->fseqs);
    free(n->tables);
    free(n->copies);
    free(n->params);
    free(n->seq_err);
    free(n->res);
    free(n->res_ptr);
    free(n->res_lp);
    free(n->res_err);
    free(n->res_top);
    free(n->res_top_ptr);
    n->res = NULL;
    n->res_ptr = NULL;
    n->res_lp = NULL;
    n->res_err = NULL;
    n->res_top = NULL;
    n->res_top_ptr = NULL;
    n->hidden_in_host = n->hidden_out_host = NULL;
    n->srows = NULL;
    n->fseqs = NULL;
    n->tables = NULL;
    n->copies = NULL;
    n->cap_copies = 0;
    n->params = NULL;
    n->seq_err = NULL;
}

static int node_buffers_init(node *n, char *err, size_t errlen) {
    const struct stage_config *c = stage_config_get(n->s);
    n->n_tokens_max = c->n_tokens_max;
    n->n_seqs_max = c->n_seqs_max;
    n->max_blocks = (c->n_ctx_max + c->block_size - 1) / c->block_size;
    size_t rows = (size_t)n->n_tokens_max * n->dim;
    n->hidden_in_host = malloc(rows * sizeof(float));
    n->hidden_out_host = malloc(rows * sizeof(float));
    n->srows = calloc((size_t)n->n_seqs_max, sizeof *n->srows);
    n->fseqs = calloc((size_t)n->n_seqs_max, sizeof *n->fseqs);
    n->tables = calloc((size_t)n->n_seqs_max * n->max_blocks, sizeof *n->tables);
    n->params = calloc((size_t)n->n_seqs_max, sizeof *n->params);
    n->seq_err = calloc((size_t)n->n_seqs_max, sizeof *n->seq_err);
    size_t ns = (size_t)n->n_seqs_max;
    n->res = calloc(ns, sizeof *n->res);
    n->res_ptr = calloc(ns, sizeof *n->res_ptr);
    n->res_lp = calloc(ns, sizeof *n->res_lp);
    n->res_err = calloc(ns, sizeof *n->res_err);
    n->res_top = calloc(ns, sizeof *n->res_top);
    n->res_top_ptr = calloc(ns, sizeof *n->res_top_ptr);
    if (!n->hidden_in_host || !n->hidden_out_host || !n->srows || !n->fseqs || !n->tables ||
        !n->params || !n->seq_err || !n->res || !n->res_ptr || !n->res_lp || !n->res_err ||
        !n->res_top || !n->res_top_ptr) {
        snprintf(err, errlen, "out of host memory for the step buffers (%d rows of %d)",
                 n->n_tokens_max, n->dim);
        return STATUS_NO_MEMORY;
    }
    if (backend_is_gpu(n->b)) {
        n->dev_in_f16 = backend_alloc(n->b, rows * 2);
        n->dev_out_f16 = backend_alloc(n->b, rows * 2);
        n->dev_in_f32 = backend_alloc(n->b, rows * sizeof(float));
        if (!n->dev_in_f16 || !n->dev_out_f16 || !n->dev_in_f32) {
            snprintf(err, errlen, "%s: no device memory for the link buffers: %s",
                     backend_name(n->b), backend_errstr(n->b));
            return STATUS_NO_MEMORY;
        }
    }
    return STATUS_OK;
}

/* Loads layers [first, end): checks that weights, KV cache and workspace
 * fit before allocating, then logs what each takes. */
static int node_stage_load(node *n, int32_t first, int32_t end, char *err, size_t errlen) {
    const struct node_config *cfg = &n->cfg;
    node_buffers_free(n);
    stage_free(n->s);
    n->s = NULL;
    node_seqs_free(n);
    const struct model_hparams *hp = n->hp;
    if (first < 0 || end > hp->n_layers || first >= end) {
        snprintf(err, errlen, "layers %d:%d: %s has layers 0:%d", first, end,
                 model_file_path(n->m), hp->n_layers);
        return STATUS_BAD_INPUT;
    }
    int gpu = backend_is_gpu(n->b);
    struct stage_config sc;
    stage_config_default(&sc);
    sc.layer_first = first;
    sc.layer_last = end;
    sc.n_tokens_max = cfg->max_batch_tokens;
    sc.n_seqs_max = cfg->max_seqs;
    sc.n_ctx_max = cfg->ctx > 0 ? cfg->ctx : hp->ctx_len;
    sc.block_size = cfg->kv_block_size;
    int32_t ctx = sc.n_ctx_max > 0 ? sc.n_ctx_max : 2048;
    size_t weights = node_range_bytes(n->m, first, end);
    size_t kv_elt = gpu ? 2 : 4;
    size_t per_block = (size_t)(end - first) * 2 * hp->n_kv_heads * cfg->kv_block_size *
                       hp->head_dim * kv_elt;
    /* Activations, attention and lm_head scratch, and (GPU) cuBLAS and
     * three dequantized prefill tiles of up to 96 MiB (the scratch's and
     * the two of kernels/cuda/dequant_ahead.cu): an upper estimate; the
     * real figure is logged after the load. */
    size_t work = (size_t)cfg->max_batch_tokens * 4 *
                      (8 * (size_t)hp->dim + 3 * (size_t)hp->ffn_dim) +
                  (size_t)cfg->max_seqs * hp->n_vocab * 4 + (gpu ? (size_t)(64 + 3 * 96) << 20 : 0);
    size_t mem_free = 0, mem_total = 0;
    backend_mem_info(n->b, &mem_free, &mem_total);
    int32_t blocks = cfg->kv_blocks;
    if (blocks <= 0 && gpu) {
        double budget = (double)mem_free * cfg->mem_fraction - (double)weights - (double)work;
        if (budget < (double)per_block) {
            snprintf(err, errlen,
                     "%s: layers %d:%d do not fit: weights %.1f MiB + workspace ~%.1f MiB leave "
                     "no room for a KV block (%.2f MiB) in %.2f of %.1f MiB free "
                     "(--mem-fraction %.2f): use more stages or a smaller model",
                     backend_name(n->b), first, end, node_mib(weights), node_mib(work),
                     node_mib(per_block), cfg->mem_fraction, node_mib(mem_free), cfg->mem_fraction);
            return STATUS_NO_MEMORY;
        }
        double nb = budget / (double)per_block;
        blocks = nb > (double)(1 << 24) ? (1 << 24) : (int32_t)nb;
    } else if (blocks <= 0) {
        blocks = cfg->max_seqs * ((ctx + cfg->kv_block_size - 1) / cfg->kv_block_size);
    }
    sc.n_blocks = blocks;
    size_t kv = per_block * (size_t)blocks;
    /* On the CPU the weights are read in place from the file mapping (page
     * cache), so only KV and workspace need free RAM. */
    size_t need = kv + work + (gpu ? weights : 0);
    if (mem_free > 0 && need > mem_free) {
        snprintf(err, errlen,
                 "%s: layers %d:%d do not fit: %sKV %.1f MiB (%d blocks of %d) + workspace "
                 "~%.1f MiB = %.1f MiB, %.1f MiB free: lower --kv-blocks or --max-batch-tokens, "
                 "or use more stages",
                 backend_name(n->b), first, end, gpu ? "weights + " : "", node_mib(kv), blocks,
                 cfg->kv_block_size, node_mib(work), node_mib(need), node_mib(mem_free));
        return STATUS_NO_MEMORY;
    }
    int rc = stage_init(&n->s, n->m, n->b, &sc, err, errlen);
    if (rc != STATUS_OK) return rc;
    size_t free_after = 0;
    backend_mem_info(n->b, &free_after, &mem_total);
    size_t kv_real = kvcache_bytes(stage_kvcache(n->s));
    if (gpu && mem_free > free_after && mem_free - free_after > weights + kv_real)
        work = mem_free - free_after - weights - kv_real;
    const struct stage_config *c = stage_config_get(n->s);
    LOG(LL_INFO,
        "stage %d/%d: layers %d:%d of %s on %s: weights %.2f MiB%s, KV %.2f MiB (%d blocks of %d "
        "positions, %s), workspace %s%.2f MiB; %d tokens and %d sequences per step",
        n->stage_index, n->stage_count, first, end, model_file_path(n->m), backend_name(n->b),
        node_mib(weights), gpu ? "" : " (mapped from the file)", node_mib(kv_real), c->n_blocks,
        c->block_size, c->kv_type == DTYPE_F16 ? "f16" : "f32", gpu ? "" : "~", node_mib(work),
        c->n_tokens_max, c->n_seqs_max);
    n->layer_first = first;
    n->layer_end = end;
    atomic_store(&n->kv_blocks_total, (uint32_t)c->n_blocks);
    atomic_store(&n->kv_block_size, (uint32_t)c->block_size);
    return node_buffers_init(n, err, errlen);
}

/* ---- links -------------------------------------------------------------- */

static void node_links_close(node *n, int keep_rx_zmq) {
    if (n->tx) link_free(n->tx);
    n->tx = NULL;
    n->next_endpoint[0] = 0;
    if (n->rx && !(keep_rx_zmq && !link_on_device(n->rx))) {
        link_free(n->rx);
        n->rx = NULL;
    }
}

/* Makes the links the current placement needs: a receiving link unless this
 * is the first stage, a sending one unless it is the last.  ZeroMQ: the
 * receiving socket was bound at init; the sending one connects to the
 * next stage's endpoint from the RegisterReply.  NCCL: new communicators
 * for every epoch.  On failure the node keeps serving, failing plans with
 * the reason, until a later RegisterReply makes the links. */
static int node_links_setup(node *n, const char *next_ep, int whole, char *err, size_t errlen) {
    int first = stage_is_first(n->s), last = stage_is_last(n->s);
    if (n->device_links) {
        if (n->links_ok && n->links_epoch == n->epoch) return STATUS_OK;
        node_links_close(n, 0);
        if (first && last) {
            n->links_epoch = n->epoch;
            return STATUS_OK;
        }
        /* NCCL needs both ends at once, at the same epoch: before the
         * pipeline is whole the next registration changes the epoch and a
         * peer would never come. */
        if (!whole) {
            snprintf(err, errlen, "stage %d: waiting for the other stages of pipeline %u",
                     n->stage_index, n->pipeline_id);
            return STATUS_UNAVAILABLE;
        }
        if (!*n->s_redis) {
            snprintf(err, errlen, "stage %d: NCCL links need --redis to exchange their ids",
                     n->stage_index);
            return STATUS_BAD_INPUT;
        }
        /* A connection of this thread's own: the io thread's is in use for heartbeats. */
        struct rconn *redis = NULL;
        int rc = rconn_open_url(n->s_redis, 2000, &redis, err, errlen);
        if (rc < 0) return rc;
        char key[128];
        if (!first) {
            link_nccl_key(key, sizeof key, n->pipeline_id, (uint32_t)(n->stage_index - 1), n->epoch);
            rc = link_nccl_init(&n->rx, n->b, LINK_RECV, redis, key, n->cfg.link_timeout_ms, err,
                                errlen);
        }
        if (rc == STATUS_OK && !last) {
            link_nccl_key(key, sizeof key, n->pipeline_id, (uint32_t)n->stage_index, n->epoch);
            rc = link_nccl_init(&n->tx, n->b, LINK_SEND, redis, key, n->cfg.link_timeout_ms, err,
                                errlen);
        }
        rconn_close(redis);
        if (rc < 0) return rc;
        n->links_epoch = n->epoch;
        return STATUS_OK;
    }
    if (!first && !n->rx) {
        snprintf(err, errlen, "stage %d has no ZeroMQ endpoint bound for the previous stage",
                 n->stage_index);
        return STATUS_INTERNAL;
    }
    if (n->rx) link_set_epoch(n->rx, n->epoch);
    if (last) {
        if (n->tx) link_free(n->tx);
        n->tx = NULL;
        n->next_endpoint[0] = 0;
        return STATUS_OK;
    }
    if (!next_ep || !*next_ep) {
        snprintf(err, errlen, "stage %d of %d: the router gave no next_stage_endpoint yet",
                 n->stage_index, n->stage_count);
        return STATUS_UNAVAILABLE;
    }
    if (!n->tx || strcmp(next_ep, n->next_endpoint) != 0) {
        if (n->tx) link_free(n->tx);
        n->tx = NULL;
        int rc = link_zmq_init(&n->tx, n->zctx, LINK_SEND, next_ep, n->cfg.link_timeout_ms, err,
                               errlen);
        if (rc < 0) return rc;
        snprintf(n->next_endpoint, sizeof n->next_endpoint, "%s", next_ep);
        LOG(LL_INFO, "stage %d: sending hidden states to %s", n->stage_index, next_ep);
    }
    link_set_epoch(n->tx, n->epoch);
    return STATUS_OK;
}

/* Applies a RegisterReply (compute thread, or before it starts). */
static void node_placement_apply(node *n, const Llm__RegisterReply *r) {
    char err[512] = "";
    int rc = STATUS_OK;
    if (!r->accepted) return;
    int32_t first = (int32_t)r->layer_first, end = (int32_t)r->layer_end;
    pthread_mutex_lock(&n->lock);
    n->pipeline_id = r->pipeline_id;
    if (r->stage_count > 0) {
        n->stage_index = (int32_t)r->stage_index;
        n->stage_count = (int32_t)r->stage_count;
    }
    if (r->epoch != n->epoch)
        LOG(LL_INFO, "pipeline %u: epoch %llu -> %llu", r->pipeline_id,
            (unsigned long long)n->epoch, (unsigned long long)r->epoch);
    n->epoch = r->epoch;
    pthread_mutex_unlock(&n->lock);
    if (end > 0 && (first != n->layer_first || end != n->layer_end)) {
        LOG(LL_WARN, "router placed this worker on layers %d:%d (it loaded %d:%d): reloading",
            first, end, n->layer_first, n->layer_end);
        atomic_store(&n->state, LLM__HEARTBEAT__STATE__STARTING);
        node_links_close(n, 1);
        pthread_mutex_lock(&n->lock);
        rc = node_stage_load(n, first, end, err, sizeof err);
        pthread_mutex_unlock(&n->lock);
    }
    if (rc == STATUS_OK) rc = node_links_setup(n, r->next_stage_endpoint, r->pipeline_whole, err, sizeof err);
    n->links_ok = rc == STATUS_OK;
    pthread_mutex_lock(&n->lock); /* the io thread reads links_err for heartbeats */
    snprintf(n->links_err, sizeof n->links_err, "%s", rc == STATUS_OK ? "" : err);
    pthread_mutex_unlock(&n->lock);
    if (rc == STATUS_OK) {
        atomic_store(&n->state, LLM__HEARTBEAT__STATE__READY);
        LOG(LL_INFO, "pipeline %u stage %d/%d (layers %d:%d), epoch %llu: ready", n->pipeline_id,
            n->stage_index, n->stage_count, n->layer_first, n->layer_end,
            (unsigned long long)n->epoch);
    } else {
        /* Waiting for the neighbours is a normal start; anything else failed. */
        atomic_store(&n->state, rc == STATUS_UNAVAILABLE ? LLM__HEARTBEAT__STATE__STARTING
                                                         : LLM__HEARTBEAT__STATE__FAILED);
        LOG(rc == STATUS_UNAVAILABLE ? LL_INFO : LL_ERROR, "pipeline %u stage %d: %s",
            n->pipeline_id, n->stage_index, err);
    }
}

/* ---- one step ----------------------------------------------------------- */

static void node_params_from_wire(const Llm__SamplingParams *w, struct sampling_params *p) {
    sampling_params_default(p);
    if (!w) return;
    p->temperature = w->temperature;
    p->top_k = w->top_k;
    p->top_p = w->top_p;
    p->min_p = w->min_p;
    p->repetition_penalty = w->repetition_penalty;
    p->presence_penalty = w->presence_penalty;
    p->frequency_penalty = w->frequency_penalty;
    p->penalty_last_n = w->penalty_last_n;
    p->seed = w->seed;
    p->n_stop_token_ids = w->n_stop_token_ids > SAMPLING_STOP_IDS_MAX + 1
                              ? SAMPLING_STOP_IDS_MAX + 1
                              : (int32_t)w->n_stop_token_ids;
    for (size_t i = 0; i < w->n_stop_token_ids && i < SAMPLING_STOP_IDS_MAX; i++)
        p->stop_token_ids[i] = w->stop_token_ids[i];
    p->ignore_eos = w->ignore_eos;
    p->logprobs = w->logprobs;
    p->top_logprobs = w->top_logprobs;
}

/* Checks the plan's sequences and lays out the forward batch.  Returns 0,
 * or STATUS_BAD_INPUT with err naming the sequence and the field. */
static int node_batch_build(node *n, const Llm__StepPlan *p, int32_t *n_tokens, char *err,
                            size_t errlen) {
    if (p->n_seqs == 0) {
        snprintf(err, errlen, "step %llu has no sequences", (unsigned long long)p->step_id);
        return STATUS_BAD_INPUT;
    }
    if (p->n_seqs > (size_t)n->n_seqs_max) {
        snprintf(err, errlen, "step %llu: %zu sequences, this stage takes at most %d per step",
                 (unsigned long long)p->step_id, p->n_seqs, n->n_seqs_max);
        return STATUS_BAD_INPUT;
    }
    int64_t total = 0;
    int last = stage_is_last(n->s);
    for (size_t i = 0; i < p->n_seqs; i++) {
        const Llm__SeqPlan *sp = p->seqs[i];
        unsigned long long id = (unsigned long long)sp->seq_id;
        if (sp->n_tokens == 0) {
            snprintf(err, errlen, "step %llu: seq %llu has no tokens", (unsigned long long)p->step_id, id);
            return STATUS_BAD_INPUT;
        }
        if (sp->n_block_table > (size_t)n->max_blocks) {
            snprintf(err, errlen, "step %llu: seq %llu: block table of %zu blocks, more than the "
                     "%d a sequence of this stage can have", (unsigned long long)p->step_id, id,
                     sp->n_block_table, n->max_blocks);
            return STATUS_BAD_INPUT;
        }
        if (sp->start_pos > (uint32_t)INT32_MAX || sp->n_tokens > (size_t)n->n_tokens_max) {
            snprintf(err, errlen, "step %llu: seq %llu: start_pos %u with %zu tokens is out of "
                     "range (at most %d tokens per step)", (unsigned long long)p->step_id, id,
                     sp->start_pos, sp->n_tokens, n->n_tokens_max);
            return STATUS_BAD_INPUT;
        }
        int32_t *table = n->tables + i * (size_t)n->max_blocks;
        for (size_t j = 0; j < sp->n_block_table; j++) {
            if (sp->block_table[j] > (uint32_t)INT32_MAX) {
                snprintf(err, errlen, "step %llu: seq %llu: block_table[%zu] = %u is out of range",
                         (unsigned long long)p->step_id, id, j, sp->block_table[j]);
                return STATUS_BAD_INPUT;
            }
            table[j] = (int32_t)sp->block_table[j];
        }
        struct forward_seq *f = &n->fseqs[i];
        f->tokens = sp->tokens;
        f->n_tokens = (int32_t)sp->n_tokens;
        f->pos0 = (int32_t)sp->start_pos;
        f->block_table = table;
        f->n_blocks = (int32_t)sp->n_block_table;
        f->logits = last && sp->want_logits ? FORWARD_LOGITS_LAST : FORWARD_LOGITS_NONE;
        total += f->n_tokens;
        n->seq_err[i][0] = 0;
        if (last && sp->want_logits) {
            node_params_from_wire(sp->sampling, &n->params[i]);
            char why[200];
            if (sampling_params_validate(&n->params[i], n->n_vocab, why, sizeof why) < 0)
                snprintf(n->seq_err[i], sizeof n->seq_err[i], "seq %llu: sampling.%s", id, why);
        }
    }
    if (total > n->n_tokens_max) {
        snprintf(err, errlen, "step %llu: %lld tokens, this stage takes at most %d per step",
                 (unsigned long long)p->step_id, (long long)total, n->n_tokens_max);
        return STATUS_BAD_INPUT;
    }
    *n_tokens = (int32_t)total;
    return STATUS_OK;
}

static int node_copies_run(node *n, const Llm__StepPlan *p, char *err, size_t errlen) {
    if (p->n_copies == 0) return STATUS_OK;
    if (p->n_copies > (size_t)n->cap_copies) {
        struct kvblocks_copy *c = realloc(n->copies, p->n_copies * sizeof *c);
        if (!c) {
            snprintf(err, errlen, "out of memory for %zu block copies", p->n_copies);
            return STATUS_NO_MEMORY;
        }
        n->copies = c;
        n->cap_copies = (int32_t)p->n_copies;
    }
    for (size_t i = 0; i < p->n_copies; i++) {
        if (p->copies[i]->src > (uint32_t)INT32_MAX || p->copies[i]->dst > (uint32_t)INT32_MAX) {
            snprintf(err, errlen, "copies[%zu]: block %u -> %u is out of range", i,
                     p->copies[i]->src, p->copies[i]->dst);
            return STATUS_BAD_INPUT;
        }
        n->copies[i].src = (int32_t)p->copies[i]->src;
        n->copies[i].dst = (int32_t)p->copies[i]->dst;
    }
    return kvcache_copy_blocks(stage_kvcache(n->s), n->copies, (int32_t)p->n_copies, err, errlen);
}

/* Receives this step's input rows from the previous stage into
 * batch->hidden_in.  Returns 0, LINK_SKIPPED or a negative status. */
static int node_input_recv(node *n, uint64_t step, int32_t T, struct forward_batch *batch,
                           char *err, size_t errlen) {
    size_t rows = (size_t)T * n->dim;
    int rc;
    if (link_on_device(n->rx)) {
        rc = link_recv(n->rx, step, n->dev_in_f16, rows * 2);
        if (rc == STATUS_OK)
            rc = backend_convert(n->b, n->dev_in_f32, DTYPE_F32, n->dev_in_f16, DTYPE_F16,
                                 (int64_t)rows);
        batch->hidden_in = n->dev_in_f32;
        batch->hidden_in_backend = 1;
    } else {
        rc = link_recv(n->rx, step, n->hidden_in_host, rows * sizeof(float));
        batch->hidden_in = n->hidden_in_host;
        batch->hidden_in_backend = 0;
    }
    if (rc < 0)
        snprintf(err, errlen, "%s", link_errstr(n->rx)[0] ? link_errstr(n->rx) : backend_errstr(n->b));
    return rc;
}

/* Sends this step's output rows to the next stage (out->hidden already
 * holds them for a host link). */
static int node_output_send(node *n, uint64_t step, int32_t T, char *err, size_t errlen) {
    size_t rows = (size_t)T * n->dim;
    int rc;
    if (link_on_device(n->tx)) {
        rc = backend_convert(n->b, n->dev_out_f16, DTYPE_F16, forward_hidden(n->s), DTYPE_F32,
                             (int64_t)rows);
        if (rc < 0) {
            snprintf(err, errlen, "hidden states to F16: %s", backend_errstr(n->b));
            return rc;
        }
        rc = link_send(n->tx, step, n->dev_out_f16, rows * 2);
    } else {
        rc = link_send(n->tx, step, n->hidden_out_host, rows * sizeof(float));
    }
    if (rc < 0) snprintf(err, errlen, "%s", link_errstr(n->tx));
    return rc;
}

/* Tells the next stage not to wait for a step that failed here.  ZeroMQ
 * carries a skip marker.  NCCL has no way to say it: when the step's size
 * is known (T > 0) the staging buffer goes out anyway, so that the next
 * stage's receive, already queued on its stream, completes; its result is
 * meaningless and this stage's StepResult tells the router the step failed.
 * With T = 0 the plan was refused before its size was known, and the next
 * stage, checking the same plan, refuses it too. */
static void node_skip_send(node *n, uint64_t step, int32_t T) {
    if (!n->tx || !n->links_ok) return;
    int rc;
    if (!link_on_device(n->tx)) rc = link_send(n->tx, step, NULL, 0);
    else if (T > 0) rc = link_send(n->tx, step, n->dev_out_f16, (size_t)T * n->dim * 2);
    else return;
    if (rc < 0)
        LOG(LL_WARN, "step %llu: telling the next stage it failed here: %s",
            (unsigned long long)step, link_errstr(n->tx));
}

/* Packs and hands a StepResult to the io thread. */
static void node_result_send(node *n, const Llm__StepPlan *p, Llm__SeqResult **seqs, size_t n_seqs,
                             Llm__Error *error, int64_t t0_us) {
    Llm__StepResult r = LLM__STEP_RESULT__INIT;
    r.step_id = p->step_id;
    r.pipeline_id = p->pipeline_id;
    r.epoch = p->epoch;
    r.worker_id = n->s_worker_id;
    r.stage_index = (uint32_t)n->stage_index;
    r.n_seqs = n_seqs;
    r.seqs = seqs;
    r.error = error;
    r.compute_us = (uint64_t)(node_now_us() - t0_us);
    Llm__WorkerEnvelope env = LLM__WORKER_ENVELOPE__INIT;
    env.body_case = LLM__WORKER_ENVELOPE__BODY_RESULT;
    env.result = &r;
    uint8_t *buf;
    size_t len;
    char err[256];
    if (proto_worker_pack(&env, &buf, &len, err, sizeof err) < 0) {
        LOG(LL_ERROR, "step %llu: cannot pack the result: %s", (unsigned long long)p->step_id, err);
        return;
    }
    const char type = NODE_MSG_RESULT;
    struct zio_frame f[2] = {{&type, 1, NULL, NULL}, {buf, len, proto_buf_free, NULL}};
    if (zio_send(n->pipe_compute, f, 2, 0) < 0)
        LOG(LL_ERROR, "step %llu: %s", (unsigned long long)p->step_id, zio_errstr(n->pipe_compute));
}

static void node_step_fail(node *n, const Llm__StepPlan *p, int rc, const char *why, int64_t t0) {
    Llm__Error e;
    Llm__Error__Code code = proto_code_from_status(rc);
    proto_error_init(&e, code, "", why, 0);
    LOG(LL_WARN, "pipeline %u stage %d: step %llu failed (%s): %s", p->pipeline_id, n->stage_index,
        (unsigned long long)p->step_id, proto_code_name(code), why);
    node_result_send(n, p, NULL, 0, &e, t0);
}

/* Last stage, before the forward pass: each sequence's history takes the
 * step's tokens (the penalties see the prompt and every token so far; a
 * step that fails is corrected by the next plan's start_pos) and each
 * logits row gets its sampling request for forward_step.  A sequence with
 * an error still has a row (greedy, its result unused). */
static void node_sample_prepare(node *n, const Llm__StepPlan *p) {
    static const struct sampling_params greedy; /* all zero: argmax */
    int32_t row = 0;
    for (size_t i = 0; i < p->n_seqs; i++) {
        const Llm__SeqPlan *sp = p->seqs[i];
        struct node_seq *q = node_seq_get(n, sp->seq_id);
        if (q && !n->seq_err[i][0] && node_hist_update(q, sp) != STATUS_OK)
            snprintf(n->seq_err[i], sizeof n->seq_err[i], "seq %llu: out of memory for its token history",
                     (unsigned long long)sp->seq_id);
        if (!sp->want_logits) continue;
        struct backend_sample_row *r = &n->srows[row++];
        memset(r, 0, sizeof *r);
        int ok = q && !n->seq_err[i][0];
        r->params = ok ? &n->params[i] : &greedy;
        r->history = ok ? q->hist : NULL;
        r->n_history = ok ? q->n_hist : 0;
        r->pos = (int64_t)sp->start_pos + (int64_t)sp->n_tokens;
    }
}

/* Sends the StepResult: each sequence's token as forward_step sampled it. */
static void node_step_sample(node *n, const Llm__StepPlan *p, int64_t t0) {
    size_t ns = p->n_seqs; /* <= n_seqs_max: node_batch_build checked */
    Llm__SeqResult *res = n->res, **resp = n->res_ptr;
    Llm__TokenLogprob *lp = n->res_lp;
    Llm__Error *errs = n->res_err;
    Llm__TopLogprob(*tops)[SAMPLING_TOP_LOGPROBS_MAX] = n->res_top;
    Llm__TopLogprob *(*topp)[SAMPLING_TOP_LOGPROBS_MAX] = n->res_top_ptr;
    int32_t row = 0;
    for (size_t i = 0; i < ns; i++) {
        const Llm__SeqPlan *sp = p->seqs[i];
        llm__seq_result__init(&res[i]);
        resp[i] = &res[i];
        res[i].seq_id = sp->seq_id;
        res[i].token = -1;
        if (!sp->want_logits) continue;
        const struct backend_sample_row *r = &n->srows[row++];
        if (n->seq_err[i][0]) {
            proto_error_init(&errs[i], LLM__ERROR__CODE__INVALID_ARGUMENT, "", n->seq_err[i], 0);
            res[i].error = &errs[i];
            continue;
        }
        if (r->status < 0) {
            snprintf(n->seq_err[i], sizeof n->seq_err[i], "seq %llu at position %lld: %s",
                     (unsigned long long)sp->seq_id, (long long)r->pos, r->err);
            proto_error_init(&errs[i], proto_code_from_status(r->status), "", n->seq_err[i], 0);
            res[i].error = &errs[i];
            continue;
        }
        const struct sampling_result *sr = &r->result;
        res[i].token = sr->token;
        if (n->params[i].logprobs || n->params[i].top_logprobs > 0) {
            llm__token_logprob__init(&lp[i]);
            lp[i].token = sr->token;
            lp[i].logprob = sr->logprob;
            for (int32_t k = 0; k < sr->n_top; k++) {
                llm__top_logprob__init(&tops[i][k]);
                tops[i][k].token = sr->top_token[k];
                tops[i][k].logprob = sr->top_logprob[k];
                topp[i][k] = &tops[i][k];
            }
            lp[i].n_top = (size_t)sr->n_top;
            lp[i].top = topp[i];
            res[i].logprob = &lp[i];
        }
    }
    node_result_send(n, p, resp, ns, NULL, t0);
}

/* Executes one plan: frees, copies, input, forward, output. */
static void node_step(node *n, const Llm__StepPlan *p) {
    int64_t t0 = node_now_us();
    char err[640] = "";
    if (p->epoch < n->epoch) {
        LOG(LL_DEBUG, "step %llu of epoch %llu dropped: the pipeline is at epoch %llu",
            (unsigned long long)p->step_id, (unsigned long long)p->epoch,
            (unsigned long long)n->epoch);
        return;
    }
    if (p->pipeline_id != n->pipeline_id) {
        snprintf(err, sizeof err, "step %llu is for pipeline %u; this worker serves pipeline %u",
                 (unsigned long long)p->step_id, p->pipeline_id, n->pipeline_id);
        node_step_fail(n, p, STATUS_BAD_INPUT, err, t0);
        return;
    }
    if (p->epoch > n->epoch) {
        /* The router re-formed the pipeline and its RegisterReply has not
         * reached us: follow the plans, which carry the epoch. */
        LOG(LL_WARN, "step %llu carries epoch %llu, newer than %llu: following it",
            (unsigned long long)p->step_id, (unsigned long long)p->epoch,
            (unsigned long long)n->epoch);
        n->epoch = p->epoch;
        if (n->rx) link_set_epoch(n->rx, n->epoch);
        if (n->tx) link_set_epoch(n->tx, n->epoch);
    }
    for (size_t i = 0; i < p->n_freed_seqs; i++) node_seq_forget(n, p->freed_seqs[i]);

    int first = stage_is_first(n->s), last = stage_is_last(n->s);
    int32_t T = 0;
    struct forward_batch batch = {0};
    int rc = STATUS_OK;
    int upstream_failed = 0;
    if (!n->links_ok) {
        snprintf(err, sizeof err, "stage %d is not linked to its neighbours: %s", n->stage_index,
                 n->links_err);
        rc = STATUS_UNAVAILABLE;
    }
    if (rc == STATUS_OK) rc = node_batch_build(n, p, &T, err, sizeof err);
    if (rc == STATUS_OK) rc = node_copies_run(n, p, err, sizeof err);
    if (rc == STATUS_OK && !first) {
        rc = node_input_recv(n, p->step_id, T, &batch, err, sizeof err);
        if (rc == LINK_SKIPPED) upstream_failed = 1;
    }
    if (rc == STATUS_OK) {
        batch.seqs = n->fseqs;
        batch.n_seqs = (int32_t)p->n_seqs;
        if (last) node_sample_prepare(n, p);
        struct forward_out out = {NULL, 0, !last && !link_on_device(n->tx) ? n->hidden_out_host : NULL,
                                  last ? n->srows : NULL};
        rc = forward_step(n->s, &batch, &out, err, sizeof err);
        if (rc == STATUS_OK && !last) rc = node_output_send(n, p->step_id, T, err, sizeof err);
        else if (rc != STATUS_OK && !last) node_skip_send(n, p->step_id, T);
    } else if (!last) {
        node_skip_send(n, p->step_id, T);
    }

    if (rc == STATUS_OK) {
        for (size_t i = 0; i < p->n_seqs; i++) {
            struct node_seq *q = node_seq_get(n, p->seqs[i]->seq_id);
            if (!q) continue;
            q->n_blocks = (int32_t)p->seqs[i]->n_block_table;
        }
        atomic_fetch_add(&n->tokens_total, (uint64_t)T);
    }
    node_kv_used_update(n);
    atomic_fetch_add(&n->steps_total, 1);
    atomic_store(&n->last_step_id, p->step_id);

    if (upstream_failed) {
        if (last) {
            Llm__Error e;
            proto_error_init(&e, LLM__ERROR__CODE__ABORTED, "",
                             "the step failed at an earlier stage of the pipeline", 0);
            node_result_send(n, p, NULL, 0, &e, t0);
        }
        return;
    }
    if (rc != STATUS_OK) {
        node_step_fail(n, p, rc, err, t0);
        return;
    }
    if (last) node_step_sample(n, p, t0);
}

/* ---- the compute thread ---------------------------------------------------- */

static void *node_compute_main(void *arg) {
    node *n = arg;
    struct zio_parts in = {0};
#if defined(LLM_HAVE_CUDA)
    /* CUDA's current device is per thread: this one must use the backend's. */
    if (backend_is_gpu(n->b)) {
        char err[256];
        if (nccl_link_set_device(backend_cuda_device(n->b), err, sizeof err) < 0)
            LOG(LL_ERROR, "compute thread: %s", err);
    }
#endif
    for (;;) {
        int rc = zio_recv(n->pipe_compute, &in, 1000);
        if (rc == STATUS_TIMEOUT || rc == STATUS_CANCELLED) continue;
        if (rc < 0) {
            LOG(LL_ERROR, "compute: %s", zio_errstr(n->pipe_compute));
            break;
        }
        if (in.n < 1 || zio_parts_size(&in, 0) != 1) continue;
        char type = *(const char *)zio_parts_data(&in, 0);
        if (type == NODE_MSG_DRAIN) break;
        if (in.n != 2) continue;
        Llm__WorkerEnvelope *env = NULL;
        char err[256];
        /* The io thread checked the frame already; this cannot fail unless memory runs out. */
        if (proto_worker_unpack(zio_parts_data(&in, 1), zio_parts_size(&in, 1), &env, err,
                                sizeof err) < 0) {
            LOG(LL_ERROR, "compute: %s", err);
            continue;
        }
        if (type == NODE_MSG_PLAN && env->body_case == LLM__WORKER_ENVELOPE__BODY_PLAN)
            node_step(n, env->plan);
        else if (type == NODE_MSG_PLACEMENT &&
                 env->body_case == LLM__WORKER_ENVELOPE__BODY_REGISTER_REPLY)
            node_placement_apply(n, env->register_reply);
        proto_worker_free(env);
    }
    zio_parts_free(&in);
    const char done = NODE_MSG_DONE;
    struct zio_frame f = {&done, 1, NULL, NULL};
    zio_send(n->pipe_compute, &f, 1, 0);
    return NULL;
}

/* ---- router and Redis (io thread) --------------------------------------------- */

/* Packs this worker's Register (placement read under the lock). */
static int node_register_pack(node *n, uint8_t **buf, size_t *len) {
    Llm__Register r = LLM__REGISTER__INIT;
    char model[256], device[192];
    const char *path = n->s_model, *slash = strrchr(path, '/');
    snprintf(model, sizeof model, "%s", slash && slash[1] ? slash + 1 : path);
    snprintf(device, sizeof device, "%s", backend_name(n->b));
    pthread_mutex_lock(&n->lock);
    r.worker_id = n->s_worker_id;
    r.incarnation = n->incarnation;
    r.pipeline_id = n->pipeline_id;
    r.stage_index = (uint32_t)n->stage_index;
    r.stage_count = (uint32_t)n->stage_count;
    r.layer_first = (uint32_t)n->layer_first;
    r.layer_end = (uint32_t)n->layer_end;
    r.model = model;
    r.backend = backend_is_gpu(n->b) ? "cuda" : "cpu";
    r.device = device;
    r.device_memory_bytes = n->mem_total;
    r.kv_block_count = atomic_load(&n->kv_blocks_total);
    r.kv_block_size = atomic_load(&n->kv_block_size);
    r.stage_endpoint = n->stage_endpoint;
    r.host = n->host;
    r.pid = (uint32_t)getpid();
    r.max_step_tokens = (uint32_t)n->n_tokens_max;
    r.max_step_seqs = (uint32_t)n->n_seqs_max;
    Llm__WorkerEnvelope env = LLM__WORKER_ENVELOPE__INIT;
    env.body_case = LLM__WORKER_ENVELOPE__BODY_REGISTER;
    env.register_ = &r;
    char err[256];
    int rc = proto_worker_pack(&env, buf, len, err, sizeof err);
    pthread_mutex_unlock(&n->lock);
    if (rc < 0) LOG(LL_ERROR, "cannot pack Register: %s", err);
    return rc;
}

/* Sends one packed frame to the router without blocking: a router that is
 * down must not stop the worker (heartbeats are simply lost). */
static void node_router_send(node *n, uint8_t *buf, size_t len, const char *what) {
    struct zio_frame f = {buf, len, proto_buf_free, NULL};
    if (zio_send(n->router, &f, 1, ZMQ_DONTWAIT) < 0)
        LOG(LL_WARN, "%s to the router %s not sent: %s", what, n->s_router, zio_errstr(n->router));
}

static int node_redis_ttl_ms(node *n, uint32_t hb_ms) {
    (void)n;
    int64_t t = (int64_t)hb_ms * 3;
    return t < 3000 ? 3000 : (int)t;
}

/* Writes (or rewrites) the registry key with the current Register. */
static void node_redis_register(node *n, uint32_t hb_ms) {
    if (!n->redis) return;
    uint8_t *buf;
    size_t len;
    if (node_register_pack(n, &buf, &len) < 0) return;
    if (rconn_set(n->redis, n->redis_key, buf, len, node_redis_ttl_ms(n, hb_ms)) < 0)
        LOG(LL_WARN, "registry key %s: %s", n->redis_key, rconn_errstr(n->redis));
    free(buf);
}

static void node_heartbeat(node *n, uint32_t hb_ms) {
    Llm__Heartbeat h = LLM__HEARTBEAT__INIT;
    h.worker_id = n->s_worker_id;
    h.incarnation = n->incarnation;
    h.state = (Llm__Heartbeat__State)atomic_load(&n->state);
    h.time_ms = node_unix_ms();
    h.last_step_id = atomic_load(&n->last_step_id);
    h.kv_blocks_used = atomic_load(&n->kv_blocks_used);
    h.kv_blocks_total = atomic_load(&n->kv_blocks_total);
    h.steps_total = atomic_load(&n->steps_total);
    h.tokens_total = atomic_load(&n->tokens_total);
    Llm__Error e;
    char why[512];
    if (h.state == LLM__HEARTBEAT__STATE__FAILED) {
        pthread_mutex_lock(&n->lock);
        snprintf(why, sizeof why, "%s", n->links_err);
        pthread_mutex_unlock(&n->lock);
        proto_error_init(&e, LLM__ERROR__CODE__UNAVAILABLE, "", why, 0);
        h.error = &e;
    }
    Llm__WorkerEnvelope env = LLM__WORKER_ENVELOPE__INIT;
    env.body_case = LLM__WORKER_ENVELOPE__BODY_HEARTBEAT;
    env.heartbeat = &h;
    uint8_t *buf;
    size_t len;
    char err[256];
    if (proto_worker_pack(&env, &buf, &len, err, sizeof err) == 0)
        node_router_send(n, buf, len, "heartbeat");
    if (n->redis) {
        int rc = rconn_expire(n->redis, n->redis_key, node_redis_ttl_ms(n, hb_ms));
        if (rc == 0) node_redis_register(n, hb_ms); /* expired or flushed: write it again */
        else if (rc < 0) LOG(LL_WARN, "registry key %s: %s", n->redis_key, rconn_errstr(n->redis));
    }
}

static void node_send_register(node *n) {
    uint8_t *buf;
    size_t len;
    if (node_register_pack(n, &buf, &len) == 0) node_router_send(n, buf, len, "Register");
}

/* The Error reply to a frame that could not be read or is not for a worker. */
static void node_reply_error(node *n, Llm__Error__Code code, const char *msg) {
    uint8_t *buf;
    size_t len;
    if (proto_worker_error_pack(code, "", msg, 0, &buf, &len) == 0)
        node_router_send(n, buf, len, "Error reply");
}

static void node_pipe_forward(node *n, char type, const void *data, size_t len) {
    struct zio_frame f[2] = {{&type, 1, NULL, NULL}, {data, len, NULL, NULL}};
    if (zio_send(n->pipe_io, f, 2, 0) < 0)
        LOG(LL_ERROR, "handing a message to the compute thread: %s", zio_errstr(n->pipe_io));
}

enum node_router_event {
    NODE_EV_NONE = 0,
    NODE_EV_ACCEPTED = 1, /* an accepted RegisterReply (forwarded) */
    NODE_EV_REFUSED = 2,  /* refused, no retry: fatal */
    NODE_EV_RETRY = 3,    /* refused, register again after retry_ms */
};

/* One message from the router: checks it, answers bad frames, forwards
 * plans (when running) and placements.  *hb_ms and *retry_ms are updated
 * from a RegisterReply. */
static int node_router_message(node *n, const struct zio_parts *in, int running, int draining,
                               uint32_t *hb_ms, int *retry_ms, char *err, size_t errlen) {
    if (in->n != 1) {
        char msg[128];
        snprintf(msg, sizeof msg, "a message to a worker is one frame, this one has %zu", in->n);
        LOG(LL_WARN, "router %s: %s", n->s_router, msg);
        node_reply_error(n, LLM__ERROR__CODE__INVALID_ARGUMENT, msg);
        return NODE_EV_NONE;
    }
    const void *data = zio_parts_data(in, 0);
    size_t len = zio_parts_size(in, 0);
    Llm__WorkerEnvelope *env = NULL;
    char why[256];
    int rc = proto_worker_unpack(data, len, &env, why, sizeof why);
    if (rc < 0) {
        LOG(LL_WARN, "router %s: frame refused (%llu so far): %s", n->s_router,
            (unsigned long long)proto_frames_rejected(), why);
        node_reply_error(n, proto_code_from_status(rc), why);
        return NODE_EV_NONE;
    }
    int ev = NODE_EV_NONE;
    switch (env->body_case) {
    case LLM__WORKER_ENVELOPE__BODY_PLAN:
        if (!running)
            LOG(LL_WARN, "step %llu arrived before registration finished: dropped",
                (unsigned long long)env->plan->step_id);
        else if (draining)
            LOG(LL_INFO, "step %llu arrived while draining: dropped",
                (unsigned long long)env->plan->step_id);
        else
            node_pipe_forward(n, NODE_MSG_PLAN, data, len);
        break;
    case LLM__WORKER_ENVELOPE__BODY_REGISTER_REPLY: {
        const Llm__RegisterReply *r = env->register_reply;
        if (r->accepted) {
            *hb_ms = r->heartbeat_interval_ms ? r->heartbeat_interval_ms : NODE_HEARTBEAT_DEFAULT_MS;
            node_pipe_forward(n, NODE_MSG_PLACEMENT, data, len);
            ev = NODE_EV_ACCEPTED;
        } else {
            const char *msg = r->error && r->error->message[0] ? r->error->message : "no reason given";
            uint32_t retry = r->error ? r->error->retry_after_ms : 0;
            if (retry > 0) {
                LOG(LL_WARN, "router %s refused the registration (%s): again in %u ms",
                    n->s_router, msg, retry);
                *retry_ms = (int)retry;
                ev = NODE_EV_RETRY;
            } else {
                snprintf(err, errlen, "router %s refused worker %s: %s", n->s_router,
                         n->s_worker_id, msg);
                ev = NODE_EV_REFUSED;
            }
        }
        break;
    }
    case LLM__WORKER_ENVELOPE__BODY_ERROR:
        LOG(LL_WARN, "router %s: error %s: %s", n->s_router, proto_code_name(env->error->code),
            env->error->message);
        break;
    default: {
        char msg[128];
        snprintf(msg, sizeof msg, "a worker does not take envelope body %d from the router",
                 (int)env->body_case);
        LOG(LL_WARN, "router %s: %s", n->s_router, msg);
        node_reply_error(n, LLM__ERROR__CODE__UNIMPLEMENTED, msg);
        break;
    }
    }
    proto_worker_free(env);
    return ev;
}

int node_run(node *n, volatile sig_atomic_t *stop, char *err, size_t errlen) {
    err[0] = 0;
    uint32_t hb_ms = NODE_HEARTBEAT_DEFAULT_MS;
    int rc = zio_sock_open(n->zctx, ZMQ_DEALER, &n->router, err, errlen);
    if (rc < 0) return rc;
    rc = zio_set_bytes(n->router, ZMQ_ROUTING_ID, n->s_worker_id, strlen(n->s_worker_id));
    if (rc == 0) rc = zio_connect(n->router, n->s_router);
    if (rc < 0) {
        snprintf(err, errlen, "%s", zio_errstr(n->router));
        return rc;
    }
    /* The compute thread must not take SIGTERM/SIGINT: they stop this thread's waits. */
    sigset_t block, old;
    sigemptyset(&block);
    sigaddset(&block, SIGTERM);
    sigaddset(&block, SIGINT);
    pthread_sigmask(SIG_BLOCK, &block, &old);
    rc = pthread_create(&n->compute, NULL, node_compute_main, n);
    pthread_sigmask(SIG_SETMASK, &old, NULL);
    if (rc != 0) {
        snprintf(err, errlen, "cannot start the compute thread: %s", strerror(rc));
        return STATUS_INTERNAL;
    }
    n->compute_started = 1;
    atomic_store(&n->state, LLM__HEARTBEAT__STATE__STARTING);
    node_redis_register(n, hb_ms);
    LOG(LL_INFO, "worker %s: registering with %s%s%s", n->s_worker_id, n->s_router,
        n->redis ? ", registry key " : "", n->redis ? n->redis_key : "");

    int registered = 0, draining = 0, compute_done = 0, result = STATUS_OK;
    int retry_ms = n->cfg.register_retry_ms;
    int64_t next_register = node_now_ms(), next_hb = node_now_ms() + hb_ms;
    int64_t drain_deadline = 0;
    struct zio_parts in = {0};
    struct zio_sock *socks[2] = {n->router, n->pipe_io};
    while (!compute_done) {
        int64_t now = node_now_ms();
        if (*stop && !draining) {
            /* Plans that reached this process before the signal are in
             * flight: hand them over before the drain marker. */
            while (zio_recv(n->router, &in, 0) == 0)
                node_router_message(n, &in, 1, 0, &hb_ms, &retry_ms, err, errlen);
            draining = 1;
            drain_deadline = now + NODE_DRAIN_MAX_MS;
            atomic_store(&n->state, LLM__HEARTBEAT__STATE__DRAINING);
            LOG(LL_INFO, "worker %s: draining (finishing the plans it holds)", n->s_worker_id);
            node_heartbeat(n, hb_ms);
            const char d = NODE_MSG_DRAIN;
            struct zio_frame f = {&d, 1, NULL, NULL};
            zio_send(n->pipe_io, &f, 1, 0);
        }
        if (draining && now > drain_deadline) {
            LOG(LL_ERROR, "worker %s: plans still running after %d ms of draining: leaving",
                n->s_worker_id, NODE_DRAIN_MAX_MS);
            break;
        }
        if (!registered && !draining && now >= next_register) {
            node_send_register(n);
            next_register = now + retry_ms;
            retry_ms = n->cfg.register_retry_ms;
        }
        if (now >= next_hb) {
            if (registered || draining) node_heartbeat(n, hb_ms);
            else if (n->redis && rconn_expire(n->redis, n->redis_key, node_redis_ttl_ms(n, hb_ms)) == 0)
                node_redis_register(n, hb_ms);
            next_hb = now + hb_ms;
        }
        int64_t wait = next_hb - now;
        if (!registered && next_register - now < wait) wait = next_register - now;
        if (wait > 100) wait = 100;
        if (wait < 0) wait = 0;
        short ev[2] = {ZMQ_POLLIN, ZMQ_POLLIN}, rev[2] = {0, 0};
        int ready = zio_poll(socks, ev, rev, 2, (int)wait);
        if (ready <= 0) continue;
        if (rev[0] & ZMQ_POLLIN) {
            if (zio_recv(n->router, &in, 0) == 0) {
                int e = node_router_message(n, &in, 1, draining, &hb_ms, &retry_ms, err, errlen);
                if (e == NODE_EV_ACCEPTED) {
                    if (!registered) LOG(LL_INFO, "worker %s: registered", n->s_worker_id);
                    registered = 1;
                    node_redis_register(n, hb_ms);
                    next_hb = node_now_ms();
                } else if (e == NODE_EV_RETRY) {
                    registered = 0;
                    next_register = node_now_ms() + retry_ms;
                } else if (e == NODE_EV_REFUSED) {
                    result = STATUS_UNAVAILABLE;
                    LOG(LL_ERROR, "%s", err);
                    *stop = 1;
                }
            }
        }
        if (rev[1] & ZMQ_POLLIN) {
            if (zio_recv(n->pipe_io, &in, 0) == 0 && in.n >= 1 && zio_parts_size(&in, 0) == 1) {
                char type = *(const char *)zio_parts_data(&in, 0);
                if (type == NODE_MSG_RESULT && in.n == 2) {
                    size_t len = zio_parts_size(&in, 1);
                    uint8_t *copy = malloc(len);
                    if (copy) {
                        memcpy(copy, zio_parts_data(&in, 1), len);
                        node_router_send(n, copy, len, "StepResult");
                    }
                } else if (type == NODE_MSG_DONE) {
                    compute_done = 1;
                }
            }
        }
    }
    zio_parts_free(&in);
    if (compute_done) {
        pthread_join(n->compute, NULL);
        n->compute_started = 0;
    }
    if (n->redis) {
        if (rconn_del(n->redis, n->redis_key) < 0)
            LOG(LL_WARN, "registry key %s: %s", n->redis_key, rconn_errstr(n->redis));
    }
    LOG(LL_INFO, "worker %s: stopped after %llu steps", n->s_worker_id,
        (unsigned long long)atomic_load(&n->steps_total));
    return result;
}

/* ---- init and free ----------------------------------------------------------- */

static int node_backend_open(node *n, char *err, size_t errlen) {
    const char *dev = n->s_device;
    if (strcmp(dev, "cpu") == 0) return backend_cpu_init(&n->b, n->cfg.threads, err, errlen);
    int idx = 0;
    if (strcmp(dev, "auto") != 0) {
        char *end;
        long v = -1;
        if (strncmp(dev, "cuda:", 5) == 0) {
            errno = 0;
            v = strtol(dev + 5, &end, 10);
            if (errno || *end || end == dev + 5) v = -1;
        } else if (strcmp(dev, "cuda") == 0) {
            v = 0;
        }
        if (v < 0 || v > 1024) {
            snprintf(err, errlen, "--device %s: expected cpu, cuda:N or auto", dev);
            return STATUS_BAD_INPUT;
        }
        idx = (int)v;
    }
    int rc = backend_cuda_init(&n->b, idx, err, errlen);
    if (rc == STATUS_OK) return rc;
    if (n->cfg.require_gpu) {
        char why[400];
        snprintf(why, sizeof why, "%s", err);
        snprintf(err, errlen, "--require-gpu: no GPU for --device %s: %s", dev, why);
        return rc;
    }
    LOG(LL_WARN, "device %s: no GPU (%s): running on the CPU", dev, err);
    return backend_cpu_init(&n->b, n->cfg.threads, err, errlen);
}

/* The bound endpoint with a wildcard host replaced by one others can reach. */
static void node_advertise(node *n, const char *bound, char *out, size_t size) {
    const char *host = n->s_advertise && *n->s_advertise ? n->s_advertise : n->host;
    const char *p = strstr(bound, "://");
    const char *h = p ? p + 3 : bound;
    const char *colon = strrchr(h, ':');
    if (p && colon && (strncmp(h, "0.0.0.0:", 8) == 0 || strncmp(h, "*:", 2) == 0 ||
                       strncmp(h, "[::]:", 5) == 0))
        snprintf(out, size, "%.*s%s%s", (int)(h - bound), bound, host, colon);
    else
        snprintf(out, size, "%s", bound);
}

int node_init(node **out, const struct node_config *cfg, char *err, size_t errlen) {
    *out = NULL;
    if (!cfg->model_path || !*cfg->model_path) {
        snprintf(err, errlen, "no model: set --model (or LLM_MODEL)");
        return STATUS_BAD_INPUT;
    }
    if (!cfg->router || !*cfg->router) {
        snprintf(err, errlen, "no router endpoint: set --router (or LLM_ROUTER)");
        return STATUS_BAD_INPUT;
    }
    node *n = calloc(1, sizeof *n);
    if (!n) {
        snprintf(err, errlen, "out of memory");
        return STATUS_NO_MEMORY;
    }
    pthread_mutex_init(&n->lock, NULL);
    n->cfg = *cfg;
    n->s_model = node_strdup(cfg->model_path);
    n->s_device = node_strdup(cfg->device ? cfg->device : "auto");
    n->s_router = node_strdup(cfg->router);
    n->s_redis = node_strdup(cfg->redis_url ? cfg->redis_url : "");
    n->s_listen = node_strdup(cfg->listen ? cfg->listen : "tcp://*:*");
    n->s_advertise = node_strdup(cfg->advertise_host ? cfg->advertise_host : "");
    if (gethostname(n->host, sizeof n->host) != 0) snprintf(n->host, sizeof n->host, "localhost");
    n->host[sizeof n->host - 1] = 0;
    char idbuf[192];
    if (cfg->worker_id && *cfg->worker_id) snprintf(idbuf, sizeof idbuf, "%s", cfg->worker_id);
    else snprintf(idbuf, sizeof idbuf, "%s-%d", n->host, (int)getpid());
    n->s_worker_id = node_strdup(idbuf);
    n->incarnation = (uint64_t)node_unix_ms() * 1000 + (uint64_t)(node_now_us() % 1000);
    n->pipeline_id = cfg->pipeline_id;
    n->stage_index = cfg->stage_index;
    n->stage_count = cfg->stage_count;
    atomic_store(&n->state, LLM__HEARTBEAT__STATE__STARTING);
    int rc;
    if (!n->s_model || !n->s_device || !n->s_router || !n->s_redis || !n->s_listen ||
        !n->s_advertise || !n->s_worker_id) {
        snprintf(err, errlen, "out of memory");
        rc = STATUS_NO_MEMORY;
        goto fail;
    }
    snprintf(n->redis_key, sizeof n->redis_key, "llm:worker:%s", n->s_worker_id);

    rc = node_backend_open(n, err, errlen);
    if (rc < 0) goto fail;
    rc = model_file_open(&n->m, n->s_model, err, errlen);
    if (rc < 0) goto fail;
    n->hp = model_file_hparams(n->m);
    n->n_vocab = n->hp->n_vocab;
    n->dim = n->hp->dim;
    int32_t first = cfg->layer_first, end = cfg->layer_end;
    if (end <= 0) {
        rc = node_layer_split(n->m, cfg->stage_count, cfg->stage_index, &first, &end, err, errlen);
        if (rc < 0) goto fail;
    }
    size_t mem_free = 0, mem_total = 0;
    backend_mem_info(n->b, &mem_free, &mem_total);
    n->mem_total = mem_total;
    rc = node_stage_load(n, first, end, err, errlen);
    if (rc < 0) goto fail;

    enum node_transport t = cfg->transport;
    int gpu = backend_is_gpu(n->b);
#if defined(LLM_HAVE_NCCL)
    int have_nccl = 1;
#else
    int have_nccl = 0;
#endif
    if (t == NODE_TRANSPORT_NCCL && (!gpu || !have_nccl)) {
        snprintf(err, errlen, "--transport nccl needs a GPU backend and a build with NCCL "
                 "(backend %s, NCCL %s)", backend_name(n->b), have_nccl ? "yes" : "no");
        rc = STATUS_UNSUPPORTED;
        goto fail;
    }
    n->device_links = gpu && have_nccl && t != NODE_TRANSPORT_ZMQ;

    n->zctx = zmq_ctx_new();
    if (!n->zctx) {
        snprintf(err, errlen, "zmq_ctx_new: %s", zmq_strerror(errno));
        rc = STATUS_IO;
        goto fail;
    }
    rc = zio_sock_open(n->zctx, ZMQ_PAIR, &n->pipe_io, err, errlen);
    if (rc == 0) rc = zio_sock_open(n->zctx, ZMQ_PAIR, &n->pipe_compute, err, errlen);
    if (rc < 0) goto fail;
    /* Unbounded: the router may queue many plans ahead of the compute thread. */
    zio_set_int(n->pipe_io, ZMQ_SNDHWM, 0);
    zio_set_int(n->pipe_io, ZMQ_RCVHWM, 0);
    zio_set_int(n->pipe_compute, ZMQ_SNDHWM, 0);
    zio_set_int(n->pipe_compute, ZMQ_RCVHWM, 0);
    char pipe_name[64];
    snprintf(pipe_name, sizeof pipe_name, "%s-%p", NODE_PIPE, (void *)n);
    rc = zio_bind(n->pipe_io, pipe_name);
    if (rc == 0) rc = zio_connect(n->pipe_compute, pipe_name);
    if (rc < 0) {
        snprintf(err, errlen, "%s", zio_errstr(n->pipe_io));
        goto fail;
    }
    if (!n->device_links) {
        /* Bound even on stage 0: the router may place this worker later in a pipeline. */
        rc = link_zmq_init(&n->rx, n->zctx, LINK_RECV, n->s_listen, cfg->link_timeout_ms, err,
                           errlen);
        if (rc < 0) goto fail;
        node_advertise(n, link_endpoint(n->rx), n->stage_endpoint, sizeof n->stage_endpoint);
        LOG(LL_INFO, "stage link endpoint %s (bound %s)", n->stage_endpoint, link_endpoint(n->rx));
    }
    if (*n->s_redis) {
        rc = rconn_open_url(n->s_redis, 2000, &n->redis, err, errlen);
        if (rc < 0) goto fail;
    } else {
        LOG(LL_INFO, "no --redis: not in the Redis worker registry%s",
            n->device_links ? " (and NCCL links cannot start)" : "");
    }
    *out = n;
    return STATUS_OK;
fail:
    node_free(n);
    return rc;
}

void node_free(node *n) {
    if (!n) return;
    if (n->compute_started) {
        /* node_run left without the thread's goodbye (drain timeout): it may
         * be inside a step; tell it to stop and wait. */
        const char d = NODE_MSG_DRAIN;
        struct zio_frame f = {&d, 1, NULL, NULL};
        zio_send(n->pipe_io, &f, 1, 0);
        pthread_join(n->compute, NULL);
    }
    node_links_close(n, 0);
    zio_sock_close(n->router);
    zio_sock_close(n->pipe_io);
    zio_sock_close(n->pipe_compute);
    if (n->zctx) zmq_ctx_term(n->zctx);
    rconn_close(n->redis);
    node_buffers_free(n);
    node_seqs_free(n);
    stage_free(n->s);
    model_file_close(n->m);
    backend_free(n->b);
    pthread_mutex_destroy(&n->lock);
    free(n->s_model);
    free(n->s_worker_id);
    free(n->s_device);
    free(n->s_router);
    free(n->s_redis);
    free(n->s_listen);
    free(n->s_advertise);
    free(n);
}
