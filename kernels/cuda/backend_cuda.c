/* The CUDA backend: fills the backend table of kernels/backend-impl.h with
 * the kernels of kernels/cuda, reached through the plain C prototypes of
 * cuda_ops.h (this file includes no CUDA header).  One device, one stream;
 * ops queue on it and only download and sync wait. */
#include "../backend.h"
#include "../backend-impl.h"
#include "../../common/status.h"
#include "cuda_ops.h"
#include "stream_access.h"

#include <stdio.h>
#include <stdlib.h>
#include <string.h>

struct backend_cuda {
    struct backend base; /* first: the handle the public API passes around */
    struct cuda_ctx *ctx;
    void *cublas_ws;     /* cuBLAS workspace, set before the first graph is recorded */
    char name[160];
};

/* Hopper's recommended cuBLAS workspace (4 MiB is enough before sm_90). */
#define BC_CUBLAS_WS_BYTES ((size_t)32 << 20)

static struct cuda_ctx *ctx_of(backend *b) { return ((struct backend_cuda *)b)->ctx; }
/* The context for an op that may write device memory: the activations a
 * matmul kept for the next one (cuda_ops.h, act_*) may be stale after it. */
static struct cuda_ctx *ctx_fresh(backend *b) {
    struct cuda_ctx *ctx = ctx_of(b);
    cuda_act_forget(ctx);
    return ctx;
}

static const char *bc_name(const backend *b) { return ((const struct backend_cuda *)b)->name; }

static void bc_free(backend *b) {
    struct backend_cuda *c = (struct backend_cuda *)b;
    if (c->cublas_ws) {
        cuda_sync(c->ctx);
        cuda_cublas_workspace(c->ctx, NULL, 0);
        cuda_free(c->ctx, c->cublas_ws);
    }
    cuda_ctx_free(c->ctx);
    free(c);
}

static void *bc_alloc(backend *b, size_t bytes) { return cuda_malloc(ctx_fresh(b), bytes); }
static void bc_dealloc(backend *b, void *p) { cuda_free(ctx_fresh(b), p); }
static int bc_mem_info(backend *b, size_t *bytes_free, size_t *bytes_total) {
    return cuda_mem_info(ctx_of(b), bytes_free, bytes_total);
}
static int bc_upload(backend *b, void *dst, const void *src, size_t bytes) {
    return cuda_upload(ctx_fresh(b), dst, src, bytes);
}
static int bc_download(backend *b, void *dst, const void *src, size_t bytes) {
    return cuda_download(ctx_of(b), dst, src, bytes);
}
static int bc_copy(backend *b, void *dst, const void *src, size_t bytes) {
    return cuda_copy(ctx_fresh(b), dst, src, bytes);
}
static int bc_sync(backend *b) { return cuda_sync(ctx_of(b)); }

static int bc_weight_load(backend *b, struct backend_weight *out, enum dtype type, const void *host, int64_t rows,
                          int64_t cols) {
    enum dtype stored = type;
    void *d = NULL;
    int rc = cuda_weight_upload(ctx_fresh(b), &d, &stored, type, host, rows, cols);
    if (rc != STATUS_OK) return rc;
    out->data = d;
    out->type = stored;
    out->rows = rows;
    out->cols = cols;
    out->owned = 1;
    return STATUS_OK;
}
static void bc_weight_free(backend *b, struct backend_weight *w) {
    if (w->owned) cuda_free(ctx_fresh(b), w->data);
}

static int bc_embed(backend *b, float *out, const struct backend_weight *w, const int32_t *ids, int32_t n) {
    return cuda_embed(ctx_fresh(b), out, w->data, w->type, w->rows, w->cols, ids, n);
}
static int bc_rmsnorm(backend *b, float *out, const float *x, const float *w, int32_t n, int32_t dim, float eps) {
    return cuda_rmsnorm(ctx_fresh(b), out, x, w, n, dim, eps);
}
static int bc_add_rmsnorm(backend *b, float *x, const float *delta, float *out, const float *w, int32_t n,
                          int32_t dim, float eps) {
    return cuda_add_rmsnorm(ctx_fresh(b), x, delta, out, w, n, dim, eps);
}
static int bc_add(backend *b, float *x, const float *y, int64_t n) { return cuda_add(ctx_fresh(b), x, y, n); }
static int bc_matmul(backend *b, float *out, const struct backend_weight *w, const float *x, int32_t n) {
    return cuda_matmul(ctx_of(b), out, w->data, w->type, w->rows, w->cols, x, n);
}
static int bc_rope(backend *b, float *x, const int32_t *pos, int32_t n, int32_t n_heads, int32_t head_dim,
                   const float *inv_freq, int32_t n_freq, int neox) {
    return cuda_rope(ctx_fresh(b), x, pos, n, n_heads, head_dim, inv_freq, n_freq, neox);
}
static int bc_swiglu(backend *b, float *out, const float *gate, const float *up, int64_t n) {
    return cuda_swiglu(ctx_fresh(b), out, gate, up, n);
}
static int bc_get_rows(backend *b, float *out, const float *x, const int32_t *idx, int32_t n, int32_t dim) {
    return cuda_get_rows(ctx_fresh(b), out, x, idx, n, dim);
}
static int bc_kv_write(backend *b, struct backend_kv *kv, const float *k, const float *v, const int32_t *slots,
                       int32_t n) {
    return cuda_kv_write(ctx_fresh(b), kv->k, kv->v, kv->type, kv->n_blocks, kv->block_size, kv->n_kv_heads,
                         kv->head_dim, k, v, slots, n);
}
static struct cuda_attn_args bc_attn_args(float *out, const float *q, const struct backend_kv *kv,
                                           const struct backend_attn_batch *batch, int32_t n_heads, float scale) {
    struct cuda_attn_args a = {
        .out = out, .q = q, .k = kv->k, .v = kv->v, .kv_type = kv->type,
        .n_blocks = kv->n_blocks, .block_size = kv->block_size, .n_kv_heads = kv->n_kv_heads,
        .head_dim = kv->head_dim, .n_heads = n_heads,
        .n_seqs = batch->n_seqs, .n_tokens = batch->n_tokens, .max_blocks = batch->max_blocks,
        .max_ctx = batch->max_ctx, .seq_tok0 = batch->seq_tok0, .seq_pos0 = batch->seq_pos0,
        .block_tables = batch->block_tables, .scale = scale,
    };
    return a;
}
static int bc_attention(backend *b, float *out, const float *q, const struct backend_kv *kv,
                        const struct backend_attn_batch *batch, int32_t n_heads, float scale) {
    struct cuda_attn_args a = bc_attn_args(out, q, kv, batch, n_heads, scale);
    return cuda_attention(ctx_fresh(b), &a);
}
/* Decode batches of 1-4 rows (1-8 without groups): rope, the cache write
 * and attention in one launch (rope_attention.cu); batches of sequences of
 * 2-16 rows (verifying steps) on the grouped-heads kernel, else the
 * tensor-core attention, both of which do the rope and cache write
 * themselves; the rest run the two ops. */
static int bc_rope_kv_attention(backend *b, float *out, float *q, float *k, const float *v, struct backend_kv *kv,
                                const int32_t *pos, const int32_t *slots, const float *inv_freq, int32_t n_freq,
                                int neox, const struct backend_attn_batch *batch, int32_t n_heads, float scale) {
    struct cuda_attn_args a = bc_attn_args(out, q, kv, batch, n_heads, scale);
    struct cuda_ctx *ctx = ctx_fresh(b);
    int rc = cuda_rope_attention(ctx, &a, k, v, pos, slots, inv_freq, n_freq, neox);
    if (rc == CUDA_NOT_FUSED)
        rc = cuda_attention_gqa_rope(ctx, &a, k, v, slots, inv_freq, n_freq, neox, batch->rows_min, batch->rows_max);
    if (rc == CUDA_NOT_FUSED)
        rc = cuda_attention_prefill_rope(ctx, &a, k, v, slots, inv_freq, n_freq, neox, batch->rows_min,
                                         batch->rows_max);
    return rc == CUDA_NOT_FUSED ? BACKEND_NOT_FUSED : rc;
}
static int bc_convert(backend *b, void *dst, enum dtype dst_type, const void *src, enum dtype src_type, int64_t n) {
    return cuda_convert(ctx_fresh(b), dst, dst_type, src, src_type, n);
}

/* The weights of one type go to the device as one launch (Q4_K_M mixes
 * types: q and k may be Q4_K with v Q6_K); any the grouped kernels do not
 * take run one by one. */
static int bc_matmul_multi(backend *b, int n_w, float *const outs[], const struct backend_weight *const ws[],
                           const float *x, int32_t n) {
    struct cuda_ctx *ctx = ctx_of(b);
    /* Two types (Q4_K_M's q and k with its Q6_K v) in one launch where
     * the 1-4 token kernel takes them. */
    const void *wd[BACKEND_MATMUL_MULTI_MAX] = {0};
    int64_t wr[BACKEND_MATMUL_MULTI_MAX] = {0};
    enum dtype wt[BACKEND_MATMUL_MULTI_MAX] = {DTYPE_F32};
    int same_cols = 1;
    for (int j = 0; j < n_w; j++) {
        wd[j] = ws[j]->data;
        wr[j] = ws[j]->rows;
        wt[j] = ws[j]->type;
        same_cols &= ws[j]->cols == ws[0]->cols;
    }
    if (same_cols) {
        int rc = cuda_matmul_group_mixed(ctx, n_w, outs, wd, wr, wt, ws[0]->cols, x, n);
        if (rc != CUDA_NOT_FUSED) return rc;
    }
    int done[BACKEND_MATMUL_MULTI_MAX] = {0};
    for (int j = 0; j < n_w; j++) {
        if (done[j]) continue;
        float *go[BACKEND_MATMUL_MULTI_MAX];
        const void *gw[BACKEND_MATMUL_MULTI_MAX];
        int64_t gr[BACKEND_MATMUL_MULTI_MAX];
        int idx[BACKEND_MATMUL_MULTI_MAX], g = 0;
        for (int k = j; k < n_w; k++) {
            if (done[k] || ws[k]->type != ws[j]->type || ws[k]->cols != ws[j]->cols) continue;
            go[g] = outs[k];
            gw[g] = ws[k]->data;
            gr[g] = ws[k]->rows;
            idx[g++] = k;
        }
        int rc = g > 1 ? cuda_matmul_group(ctx, g, go, gw, gr, ws[j]->type, ws[j]->cols, x, n, 0) : CUDA_NOT_FUSED;
        if (rc < 0) return rc;
        for (int k = 0; k < g; k++) {
            done[idx[k]] = 1;
            if (rc == CUDA_NOT_FUSED) {
                const struct backend_weight *w = ws[idx[k]];
                int r = cuda_matmul(ctx, go[k], w->data, w->type, w->rows, w->cols, x, n);
                if (r != STATUS_OK) return r;
            }
        }
    }
    return STATUS_OK;
}
/* 1-4 tokens: gate and up in one grid that writes silu(gate) * up.
 * Otherwise the two matmuls (one grid where the group kernels take them)
 * and a swiglu that also leaves its output in
 * the F16 form the down matmul's cuBLAS call reads. */
static int bc_matmul_swiglu(backend *b, float *out, const struct backend_weight *gate,
                            const struct backend_weight *up, const float *x, int32_t n, float *gate_tmp,
                            float *up_tmp) {
    struct cuda_ctx *ctx = ctx_of(b);
    int rc = CUDA_NOT_FUSED;
    if (gate->type == up->type) {
        float *outs[2] = {out, NULL}, *tmps[2] = {gate_tmp, up_tmp};
        const void *ws[2] = {gate->data, up->data};
        int64_t rows[2] = {gate->rows, up->rows};
        rc = cuda_matmul_group(ctx, 2, outs, ws, rows, gate->type, gate->cols, x, n, 1);
        if (rc != CUDA_NOT_FUSED) return rc;
        rc = cuda_matmul_group(ctx, 2, tmps, ws, rows, gate->type, gate->cols, x, n, 0);
    }
    if (rc == CUDA_NOT_FUSED) {
        rc = cuda_matmul(ctx, gate_tmp, gate->data, gate->type, gate->rows, gate->cols, x, n);
        if (rc == STATUS_OK) rc = cuda_matmul(ctx, up_tmp, up->data, up->type, up->rows, up->cols, x, n);
    }
    if (rc != STATUS_OK) return rc;
    cuda_act_forget(ctx); /* the swiglu overwrites the scratch's activations */
    return cuda_swiglu_act(ctx, out, gate_tmp, up_tmp, n, gate->rows);
}
static int bc_rope_kv_write(backend *b, float *q, float *k, const float *v, struct backend_kv *kv,
                            const int32_t *pos, const int32_t *slots, int32_t n, int32_t n_heads,
                            const float *inv_freq, int32_t n_freq, int neox) {
    return cuda_rope_kv_write(ctx_fresh(b), q, k, v, kv->k, kv->v, kv->type, kv->n_blocks, kv->block_size,
                              kv->n_kv_heads, kv->head_dim, pos, slots, n, n_heads, inv_freq, n_freq, neox);
}
static int bc_sample(backend *b, const float *logits, int32_t n_vocab, struct backend_sample_row *rows,
                     int32_t n_rows) {
    int rc = cuda_sample(ctx_fresh(b), logits, n_vocab, rows, n_rows);
    return rc == CUDA_NOT_FUSED ? BACKEND_NOT_FUSED : rc;
}

static void *bc_host_alloc(backend *b, size_t bytes) { return cuda_host_alloc(ctx_of(b), bytes); }
static void bc_host_free(backend *b, void *p) { cuda_host_free(ctx_of(b), p); }

static int bc_graph_begin(backend *b) {
    struct backend_cuda *c = (struct backend_cuda *)b;
    /* cuBLAS would otherwise pick its own workspace, which a recording
     * must not allocate. */
    if (!c->cublas_ws) {
        c->cublas_ws = cuda_malloc(c->ctx, BC_CUBLAS_WS_BYTES);
        if (!c->cublas_ws) return STATUS_NO_MEMORY;
        int rc = cuda_cublas_workspace(c->ctx, c->cublas_ws, BC_CUBLAS_WS_BYTES);
        if (rc != STATUS_OK) {
            cuda_free(c->ctx, c->cublas_ws);
            c->cublas_ws = NULL;
            return rc;
        }
    }
    cuda_act_forget(c->ctx); /* the recording must convert its own inputs */
    return cuda_graph_begin(c->ctx);
}
static int bc_graph_end(backend *b, backend_graph **out) {
    struct cuda_graph *g = NULL;
    int rc = cuda_graph_end(ctx_fresh(b), &g);
    *out = (backend_graph *)g;
    return rc;
}
static int bc_graph_launch(backend *b, backend_graph *g) {
    return cuda_graph_launch(ctx_fresh(b), (struct cuda_graph *)g);
}
static void bc_graph_free(backend *b, backend_graph *g) { cuda_graph_free(ctx_of(b), (struct cuda_graph *)g); }

static const struct backend_i cuda_iface = {
    .name = bc_name,
    .free = bc_free,
    .is_gpu = 1,
    .alloc = bc_alloc,
    .dealloc = bc_dealloc,
    .mem_info = bc_mem_info,
    .upload = bc_upload,
    .download = bc_download,
    .copy = bc_copy,
    .sync = bc_sync,
    .weight_load = bc_weight_load,
    .weight_free = bc_weight_free,
    .embed = bc_embed,
    .rmsnorm = bc_rmsnorm,
    .add_rmsnorm = bc_add_rmsnorm,
    .add = bc_add,
    .matmul = bc_matmul,
    .rope = bc_rope,
    .swiglu = bc_swiglu,
    .get_rows = bc_get_rows,
    .kv_write = bc_kv_write,
    .attention = bc_attention,
    .convert = bc_convert,
    .host_alloc = bc_host_alloc,
    .host_free = bc_host_free,
    .graph_begin = bc_graph_begin,
    .graph_end = bc_graph_end,
    .graph_launch = bc_graph_launch,
    .graph_free = bc_graph_free,
    .matmul_multi = bc_matmul_multi,
    .matmul_swiglu = bc_matmul_swiglu,
    .rope_kv_write = bc_rope_kv_write,
    .rope_kv_attention = bc_rope_kv_attention,
    .sample = bc_sample,
    .sample_masks = true,
};

int backend_cuda_init(backend **out, int device, char *err, size_t errlen) {
    *out = NULL;
    struct backend_cuda *c = calloc(1, sizeof *c);
    if (!c) {
        snprintf(err, errlen, "cuda:%d: out of host memory", device);
        return STATUS_NO_MEMORY;
    }
    int rc = cuda_ctx_init(&c->ctx, device, err, errlen);
    if (rc != STATUS_OK) {
        free(c);
        return rc;
    }
    c->base.i = &cuda_iface;
    c->ctx->err = c->base.errstr;
    c->ctx->errlen = sizeof c->base.errstr;
    snprintf(c->name, sizeof c->name, "cuda:%d (%s, sm_%d)", device, c->ctx->device_name, c->ctx->cc);
    *out = &c->base;
    return STATUS_OK;
}

/* The identity of the table tells a CUDA backend from any other. */
void *backend_cuda_stream(backend *b) {
    return b && b->i == &cuda_iface ? ctx_of(b)->stream : NULL;
}

int backend_cuda_device(backend *b) {
    return b && b->i == &cuda_iface ? ctx_of(b)->device : -1;
}
