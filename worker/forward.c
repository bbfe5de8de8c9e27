/* One batched step through a stage.  The host checks the batch, lays out
 * its metadata (token ids, positions, KV slots, per-sequence offsets, block
 * tables, rows needing logits) in one int32 array and uploads it at once;
 * then the layers run as backend ops on the preallocated scratch, with no
 * allocation and no synchronisation until the logits (or hidden states)
 * are downloaded at the end.  Decode steps and speculation's verifying
 * steps on a backend with graphs are recorded once per shape (sequences
 * and rows a sequence) and replayed with one launch. */
#include "forward.h"
#include "stage-impl.h"

#include "common/log.h"
#include "common/status.h"

#include <math.h>
#include <stdio.h>
#include <string.h>

int32_t forward_logits_rows(const struct forward_batch *batch) {
    int32_t n = 0;
    for (int32_t i = 0; i < batch->n_seqs; i++) {
        const struct forward_seq *q = &batch->seqs[i];
        if (q->logits == FORWARD_LOGITS_LAST) n += 1;
        else if (q->logits == FORWARD_LOGITS_ALL) n += q->n_tokens;
    }
    return n;
}

void forward_set_before_sample(stage *s, void (*fn)(void *arg), void *arg) {
    s->before_sample = fn;
    s->before_sample_arg = arg;
}

const float *forward_hidden(const stage *s) { return s->x; }
float *forward_input_buffer(stage *s) { return s->x; }

/* A stage after the first runs on the previous stage's rows. */
static int forward_check_input(const stage *s, const struct forward_batch *batch, char *err, size_t errlen) {
    if (!s->first && !batch->hidden_in)
        return status_fail(err, errlen, STATUS_BAD_INPUT,
                           "step: stage [%d, %d) needs the previous stage's hidden states", s->cfg.layer_first,
                           s->cfg.layer_last);
    return STATUS_OK;
}

/* Everything that could make a kernel read or write out of bounds is
 * refused here, before the step touches the cache. */
static int forward_check(const stage *s, const struct forward_batch *batch, int need_input, int32_t *n_tokens_out,
                         char *err, size_t errlen) {
    const struct stage_config *c = &s->cfg;
    if (batch->n_seqs < 1 || batch->n_seqs > c->n_seqs_max)
        return status_fail(err, errlen, STATUS_BAD_INPUT, "step: %d sequences (this stage takes 1 to %d)",
                           batch->n_seqs, c->n_seqs_max);
    if (need_input) {
        int rc = forward_check_input(s, batch, err, errlen);
        if (rc != STATUS_OK) return rc;
    }
    int64_t total = 0;
    for (int32_t i = 0; i < batch->n_seqs; i++) {
        const struct forward_seq *q = &batch->seqs[i];
        if (q->n_tokens < 1 || (s->first && !q->tokens))
            return status_fail(err, errlen, STATUS_BAD_INPUT, "step: sequence %d: %d tokens", i, q->n_tokens);
        if (q->logits < FORWARD_LOGITS_LAST || q->logits > FORWARD_LOGITS_NONE)
            return status_fail(err, errlen, STATUS_BAD_INPUT, "step: sequence %d: logits mode %d", i,
                               (int)q->logits);
        total += q->n_tokens;
        if (total > c->n_tokens_max)
            return status_fail(err, errlen, STATUS_BAD_INPUT,
                               "step: sequence %d brings the step to %lld tokens (this stage takes %d)", i,
                               (long long)total, c->n_tokens_max);
        int64_t end = (int64_t)q->pos0 + q->n_tokens;
        if (q->pos0 < 0 || end > c->n_ctx_max)
            return status_fail(err, errlen, STATUS_BAD_INPUT,
                               "step: sequence %d: positions %d..%lld exceed the context of %d", i,
                               q->pos0, (long long)end - 1, c->n_ctx_max);
        if (q->n_blocks < 0 || q->n_blocks > s->max_blocks_per_seq || (q->n_blocks > 0 && !q->block_table))
            return status_fail(err, errlen, STATUS_BAD_INPUT,
                               "step: sequence %d: block table of %d blocks (at most %d)", i, q->n_blocks,
                               s->max_blocks_per_seq);
        if ((int64_t)q->n_blocks * c->block_size < end)
            return status_fail(err, errlen, STATUS_BAD_INPUT,
                               "step: sequence %d: position %lld is past its %d blocks of %d", i,
                               (long long)end - 1, q->n_blocks, c->block_size);
        for (int32_t j = 0; j < q->n_blocks; j++)
            if (q->block_table[j] < 0 || q->block_table[j] >= c->n_blocks)
                return status_fail(err, errlen, STATUS_BAD_INPUT,
                                   "step: sequence %d: block %d is %d (the cache has %d blocks)", i, j,
                                   q->block_table[j], c->n_blocks);
        if (s->first)
            for (int32_t j = 0; j < q->n_tokens; j++)
                if (q->tokens[j] < 0 || q->tokens[j] >= s->hp.n_vocab)
                    return status_fail(err, errlen, STATUS_BAD_INPUT,
                                       "step: sequence %d: token %d is %d (vocabulary of %d)", i, j,
                                       q->tokens[j], s->hp.n_vocab);
    }
    if (batch->n_copies < 0 || (batch->n_copies > 0 && !batch->copies))
        return status_fail(err, errlen, STATUS_BAD_INPUT, "step: %d block copies", batch->n_copies);
    for (int32_t i = 0; i < batch->n_copies; i++) {
        const struct kvblocks_copy *cp = &batch->copies[i];
        if (cp->src < 0 || cp->src >= c->n_blocks || cp->dst < 0 || cp->dst >= c->n_blocks || cp->src == cp->dst)
            return status_fail(err, errlen, STATUS_BAD_INPUT,
                               "step: copy %d: block %d -> %d (the cache has %d blocks)", i, cp->src,
                               cp->dst, c->n_blocks);
    }
    *n_tokens_out = (int32_t)total;
    return STATUS_OK;
}

/* fixed = 1 (a step replayed from a graph): block tables padded to the
 * stage's capacity and the context bound at n_ctx_max, so that the layout
 * and every size an op is launched with depend on the step's shape only. */
static void forward_layout(stage *s, const struct forward_batch *batch, int32_t T, int fixed,
                           struct forward_meta *mt) {
    int32_t S = batch->n_seqs, bs = s->cfg.block_size;
    int32_t *h = s->meta_host;
    mt->max_blocks = 1;
    mt->max_ctx = 0;
    mt->rows_min = mt->rows_max = batch->seqs[0].n_tokens;
    for (int32_t i = 0; i < S; i++) {
        if (batch->seqs[i].n_blocks > mt->max_blocks) mt->max_blocks = batch->seqs[i].n_blocks;
        if (batch->seqs[i].n_tokens < mt->rows_min) mt->rows_min = batch->seqs[i].n_tokens;
        if (batch->seqs[i].n_tokens > mt->rows_max) mt->rows_max = batch->seqs[i].n_tokens;
        int32_t end = batch->seqs[i].pos0 + batch->seqs[i].n_tokens;
        if (end > mt->max_ctx) mt->max_ctx = end;
    }
    if (fixed) {
        mt->max_blocks = s->max_blocks_per_seq;
        mt->max_ctx = s->cfg.n_ctx_max;
    }
    mt->ids = 0;
    mt->pos = T;
    mt->slots = 2 * T;
    mt->seq_tok0 = 3 * T;
    mt->seq_pos0 = mt->seq_tok0 + S + 1;
    mt->tables = mt->seq_pos0 + S;
    mt->rows = mt->tables + S * mt->max_blocks;
    int32_t t = 0, r = 0;
    for (int32_t i = 0; i < S; i++) {
        const struct forward_seq *q = &batch->seqs[i];
        h[mt->seq_tok0 + i] = t;
        h[mt->seq_pos0 + i] = q->pos0;
        for (int32_t j = 0; j < mt->max_blocks; j++)
            h[mt->tables + i * mt->max_blocks + j] = j < q->n_blocks ? q->block_table[j] : 0;
        for (int32_t j = 0; j < q->n_tokens; j++, t++) {
            int32_t p = q->pos0 + j;
            h[mt->ids + t] = s->first ? q->tokens[j] : 0;
            h[mt->pos + t] = p;
            h[mt->slots + t] = q->block_table[p / bs] * bs + p % bs;
            if (q->logits == FORWARD_LOGITS_ALL || (q->logits == FORWARD_LOGITS_LAST && j == q->n_tokens - 1))
                h[mt->rows + r++] = t;
        }
    }
    h[mt->seq_tok0 + S] = T;
    mt->n_rows = r;
    mt->used = mt->rows + r;
}

#define FORWARD_TRY(call, what)                                                                 \
    do {                                                                                        \
        int rc_ = (call);                                                                       \
        if (rc_ != STATUS_OK)                                                                   \
            return status_fail(err, errlen, rc_, "step: %s (layer %d) on %s: %s", what, layer, \
                               backend_name(b), backend_errstr(b));                            \
    } while (0)

/* The ops of a step from its input rows in s->x (the first stage embeds
 * them here) to the residual stream after the stage's last layer: what a
 * graph records.  Every per-step value is read from the metadata in
 * backend memory; the host values used are the row and sequence counts
 * and mt's bounds. */
static int forward_layers(stage *s, const struct forward_meta *mt, int32_t S, int32_t T, char *err,
                          size_t errlen) {
    backend *b = s->b;
    const struct model_hparams *hp = &s->hp;
    const int32_t *md = s->meta;
    int32_t layer = -1;
    if (s->first) FORWARD_TRY(backend_embed(b, s->x, &s->tok_embd, md + mt->ids, T), "embed");
    struct backend_attn_batch ab = {
        .n_seqs = S,
        .n_tokens = T,
        .max_blocks = mt->max_blocks,
        .max_ctx = mt->max_ctx,
        .seq_tok0 = md + mt->seq_tok0,
        .seq_pos0 = md + mt->seq_pos0,
        .block_tables = md + mt->tables,
        .rows_min = mt->rows_min,
        .rows_max = mt->rows_max,
    };
    const float scale = 1.0f / sqrtf((float)hp->head_dim);
    const int32_t n_freq = hp->head_dim / 2;
    /* The FFN output of layer l is added to the residual stream together
     * with layer l+1's attention norm (one pass instead of two). */
    int pending = 0;
    for (int32_t i = 0; i < s->n_local; i++) {
        const struct stage_layer *l = &s->layers[i];
        struct backend_kv *kv = kvcache_layer(s->kv, i);
        layer = s->cfg.layer_first + i;
        if (pending)
            FORWARD_TRY(backend_add_rmsnorm(b, s->x, s->proj, s->xn, l->attn_norm, T, hp->dim, hp->rms_eps), "add_rmsnorm");
        else
            FORWARD_TRY(backend_rmsnorm(b, s->xn, s->x, l->attn_norm, T, hp->dim, hp->rms_eps), "rmsnorm");
        float *const qkv_out[3] = {s->q, s->k, s->v};
        const struct backend_weight *const qkv_w[3] = {&l->wq, &l->wk, &l->wv};
        FORWARD_TRY(backend_matmul_multi(b, 3, qkv_out, qkv_w, s->xn, T), "matmul q, k, v");
        if (l->bq) {
            /* Biases broadcast over rows: one add per row (qwen2 only). */
            for (int32_t t = 0; t < T; t++) {
                FORWARD_TRY(backend_add(b, s->q + (size_t)t * s->q_dim, l->bq, s->q_dim), "bias q");
                FORWARD_TRY(backend_add(b, s->k + (size_t)t * s->kv_dim, l->bk, s->kv_dim), "bias k");
                FORWARD_TRY(backend_add(b, s->v + (size_t)t * s->kv_dim, l->bv, s->kv_dim), "bias v");
            }
        }
        FORWARD_TRY(backend_rope_kv_attention(b, s->att, s->q, s->k, s->v, kv, md + mt->pos, md + mt->slots,
                                              s->inv_freq, n_freq, hp->rope_neox, &ab, hp->n_heads, scale),
                    "rope, kv_write, attention");
        FORWARD_TRY(backend_matmul(b, s->proj, &l->wo, s->att, T), "matmul attn_output");
        FORWARD_TRY(backend_add_rmsnorm(b, s->x, s->proj, s->xn, l->ffn_norm, T, hp->dim, hp->rms_eps), "add_rmsnorm");
        FORWARD_TRY(backend_matmul_swiglu(b, s->ffn_h, &l->w_gate, &l->w_up, s->xn, T, s->gate, s->up),
                    "matmul ffn_gate, ffn_up, swiglu");
        FORWARD_TRY(backend_matmul(b, s->proj, &l->w_down, s->ffn_h, T), "matmul ffn_down");
        pending = 1;
    }
    layer = -1;
    if (pending) FORWARD_TRY(backend_add(b, s->x, s->proj, (int64_t)T * hp->dim), "residual add");
    return STATUS_OK;
}

/* lm_head over logit rows r0 .. r0 + n (n <= n_logits_max) into s->logits. */
static int forward_lm_head(stage *s, const struct forward_meta *mt, int32_t r0, int32_t n, char *err,
                           size_t errlen) {
    backend *b = s->b;
    const struct model_hparams *hp = &s->hp;
    int32_t layer = -1;
    FORWARD_TRY(backend_get_rows(b, s->xl, s->x, s->meta + mt->rows + r0, n, hp->dim), "get_rows");
    FORWARD_TRY(backend_rmsnorm(b, s->xln, s->xl, s->output_norm, n, hp->dim, hp->rms_eps), "output_norm");
    FORWARD_TRY(backend_matmul(b, s->logits, s->lm_head, s->xln, n), "lm_head");
    return STATUS_OK;
}

/* The graph key of a batch (stage-impl.h, stage_graph_keys), or -1 when
 * it runs op by op.  Graphs take steps whose every sequence has the same
 * row count R: decode steps (R = 1) whose rows all want logits or none
 * (on the last stage), and verifying steps (R = 2 .. STAGE_GRAPH_ROWS, at
 * most STAGE_GRAPH_SEQS sequences, every row wanting logits), at most
 * n_logits_max rows of logits. */
static int forward_graph_key(const stage *s, const struct forward_batch *batch, const struct forward_out *out) {
    if (!s->graphs_on) return -1;
    int32_t S = batch->n_seqs, R = batch->seqs[0].n_tokens, n_want = 0;
    if (R > STAGE_GRAPH_ROWS || (R > 1 && S > STAGE_GRAPH_SEQS)) return -1;
    for (int32_t i = 0; i < S; i++) {
        const struct forward_seq *q = &batch->seqs[i];
        if (q->n_tokens != R || (R > 1 && q->logits != FORWARD_LOGITS_ALL)) return -1;
        n_want += q->logits == FORWARD_LOGITS_NONE ? 0 : q->logits == FORWARD_LOGITS_ALL ? R : 1;
    }
    int logits = 0;
    if (s->last && out && (out->logits || out->sample) && n_want > 0) {
        if (n_want != S * R || S * R > s->cfg.n_logits_max) return -1;
        logits = 1;
    }
    int key = R == 1 ? (S - 1) * 2 + logits
                     : 2 * s->cfg.n_seqs_max + ((R - 2) * STAGE_GRAPH_SEQS + S - 1) * 2 + logits;
    return s->graph_dead[key] ? -1 : key;
}

static int forward_graph_ops(stage *s, const struct forward_meta *mt, int32_t S, int32_t T, int logits, char *err,
                             size_t errlen) {
    int rc = forward_layers(s, mt, S, T, err, errlen);
    if (rc == STATUS_OK && logits) rc = forward_lm_head(s, mt, 0, T, err, errlen);
    return rc;
}

/* Records the ops of key's steps into s->graphs[key] (not running them).
 * A failure is not the step's: the key is marked to run op by op. */
static void forward_graph_record(stage *s, int key, const struct forward_meta *mt, int32_t S, int32_t T,
                                 int logits) {
    backend *b = s->b;
    char why[512] = "";
    int rc = backend_graph_begin(b);
    if (rc == STATUS_OK) {
        int rc_ops = forward_graph_ops(s, mt, S, T, logits, why, sizeof why);
        backend_graph *g = NULL;
        rc = backend_graph_end(b, &g);
        if (rc != STATUS_OK) snprintf(why, sizeof why, "%s", backend_errstr(b));
        else if (rc_ops != STATUS_OK) rc = rc_ops;
        if (rc == STATUS_OK) {
            s->graphs[key] = g;
            LOG(LL_DEBUG, "stage [%d, %d): graph of %d sequences of %d rows%s recorded", s->cfg.layer_first,
                s->cfg.layer_last, S, T / S, logits ? " with logits" : "");
            return;
        }
        backend_graph_free(b, g);
    } else {
        snprintf(why, sizeof why, "%s", backend_errstr(b));
    }
    s->graph_dead[key] = 1;
    LOG(LL_WARN, "stage [%d, %d): steps of %d sequences of %d rows run without a graph: %s (%s)",
        s->cfg.layer_first, s->cfg.layer_last, S, T / S, why, status_str(rc));
}

/* A step of key's shape: replays its graph; the first step of the
 * shape runs op by op (so every scratch buffer gets its size before a
 * recording, which must not allocate) and records the graph for the next. */
static int forward_graph_step(stage *s, int key, const struct forward_meta *mt, int32_t S, int32_t T, int logits,
                              char *err, size_t errlen) {
    backend *b = s->b;
    if (!s->graphs[key]) {
        int rc = forward_graph_ops(s, mt, S, T, logits, err, errlen);
        if (rc == STATUS_OK) forward_graph_record(s, key, mt, S, T, logits);
        return rc;
    }
    int rc = backend_graph_launch(b, s->graphs[key]);
    if (rc == STATUS_UNAVAILABLE) {
        /* Scratch moved (a larger step grew it): the sizes this shape needs
         * fit in the new buffer, so record again and replay. */
        backend_graph_free(b, s->graphs[key]);
        s->graphs[key] = NULL;
        forward_graph_record(s, key, mt, S, T, logits);
        if (!s->graphs[key]) return forward_graph_ops(s, mt, S, T, logits, err, errlen);
        rc = backend_graph_launch(b, s->graphs[key]);
    }
    if (rc != STATUS_OK)
        return status_fail(err, errlen, rc, "step: graph of %d sequences of %d rows on %s: %s", S, T / S,
                           backend_name(b), backend_errstr(b));
    return STATUS_OK;
}

/* The part of a step before its input rows (forward_begin), into s->pend. */
static int forward_begin_part(stage *s, const struct forward_batch *batch, const struct forward_out *out,
                              int need_input, char *err, size_t errlen) {
    backend *b = s->b;
    int32_t T = 0, layer = -1;
    s->pend.on = 0;
    int rc = forward_check(s, batch, need_input, &T, err, errlen);
    if (rc != STATUS_OK) return rc;
    /* The previous step's metadata upload may still read meta_host (an
     * asynchronous copy on a GPU) if that step ended without a download. */
    if (s->unsynced) {
        FORWARD_TRY(backend_sync(b), "sync");
        s->unsynced = 0;
    }
    const int key = forward_graph_key(s, batch, out);
    forward_layout(s, batch, T, key >= 0, &s->pend.mt);
    FORWARD_TRY(backend_upload(b, s->meta, s->meta_host, (size_t)s->pend.mt.used * sizeof(int32_t)),
                "metadata upload");
    if (batch->n_copies > 0) {
        rc = kvcache_copy_blocks(s->kv, batch->copies, batch->n_copies, err, errlen);
        if (rc != STATUS_OK) return rc;
    }
    s->pend.on = 1;
    s->pend.key = key;
    s->pend.T = T;
    s->pend.n_seqs = batch->n_seqs;
    return STATUS_OK;
}

int forward_begin(stage *s, const struct forward_batch *batch, const struct forward_out *out, char *err,
                  size_t errlen) {
    return forward_begin_part(s, batch, out, 0, err, errlen);
}

void forward_cancel(stage *s) { s->pend.on = 0; }

int forward_step(stage *s, const struct forward_batch *batch, struct forward_out *out, char *err,
                 size_t errlen) {
    backend *b = s->b;
    const struct model_hparams *hp = &s->hp;
    int32_t layer = -1;
    if (out) out->n_logits = 0;
    const int begun = s->pend.on && s->pend.n_seqs == batch->n_seqs;
    int rc = begun ? forward_check_input(s, batch, err, errlen) : forward_begin_part(s, batch, out, 1, err, errlen);
    s->pend.on = 0; /* used once, failed or not */
    if (rc != STATUS_OK) return rc;
    const int key = s->pend.key;
    const int32_t T = s->pend.T;
    const struct forward_meta mt = s->pend.mt;

    const size_t dim = (size_t)hp->dim;
    if (!s->first && batch->hidden_in_backend) {
        if (batch->hidden_in != s->x)
            FORWARD_TRY(backend_copy(b, s->x, batch->hidden_in, T * dim * sizeof(float)), "hidden copy");
    } else if (!s->first) {
        FORWARD_TRY(backend_upload(b, s->x, batch->hidden_in, T * dim * sizeof(float)), "hidden upload");
    }

    /* A graph step leaves the logits of all its rows (at most
     * n_logits_max) in s->logits; otherwise the lm_head runs below. */
    int graph_logits = key >= 0 && (key & 1);
    rc = key >= 0 ? forward_graph_step(s, key, &mt, batch->n_seqs, T, graph_logits, err, errlen)
                  : forward_layers(s, &mt, batch->n_seqs, T, err, errlen);
    if (rc != STATUS_OK) return rc;

    if (!s->last) {
        if (out && out->hidden)
            FORWARD_TRY(backend_download(b, out->hidden, s->x, T * dim * sizeof(float)), "hidden download");
        else
            s->unsynced = 1;
        return STATUS_OK;
    }
    if (!out || (!out->logits && !out->sample) || mt.n_rows == 0) {
        FORWARD_TRY(backend_sync(b), "sync");
        return STATUS_OK;
    }
    /* lm_head over the rows that need logits, n_logits_max rows at a time. */
    const int32_t L = s->cfg.n_logits_max;
    for (int32_t r0 = 0; r0 < mt.n_rows; r0 += L) {
        int32_t n = mt.n_rows - r0 < L ? mt.n_rows - r0 : L;
        if (!graph_logits) {
            rc = forward_lm_head(s, &mt, r0, n, err, errlen);
            if (rc != STATUS_OK) return rc;
        }
        if (r0 == 0 && out->sample && s->before_sample) s->before_sample(s->before_sample_arg);
        if (out->logits)
            FORWARD_TRY(backend_download(b, out->logits + (size_t)r0 * hp->n_vocab, s->logits,
                                         (size_t)n * hp->n_vocab * sizeof(float)), "logits download");
        if (out->sample) FORWARD_TRY(backend_sample(b, s->logits, hp->n_vocab, out->sample + r0, n), "sample");
    }
    out->n_logits = mt.n_rows;
    return STATUS_OK;
}
