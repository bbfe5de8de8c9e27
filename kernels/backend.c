/* Dispatch from the public backend functions to a backend's table, with
 * the argument checks every backend shares. */
#include "backend.h"
#include "backend-impl.h"
#include "../common/log.h"
#include "../common/status.h"

#include <math.h>
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

int backend_fail(backend *b, int code, const char *fmt, ...) {
    va_list ap;
    va_start(ap, fmt);
    vsnprintf(b->errstr, sizeof b->errstr, fmt, ap);
    va_end(ap);
    return code;
}

int backend_open(backend **out, const struct device_spec *dev, int n_threads, int require_gpu, char *chosen,
                 size_t chosen_len, char *err, size_t errlen) {
    char asked[32], why[512] = "", none[1];
    device_format(dev, asked, sizeof asked);
    if (!chosen) {
        chosen = none;
        chosen_len = sizeof none;
    }
    *out = NULL;
    if (dev->kind == DEVICE_CPU) {
        snprintf(chosen, chosen_len, "cpu");
        return backend_cpu_init(out, n_threads, err, errlen);
    }
    int rc = backend_cuda_init(out, dev->index, why, sizeof why);
    if (rc == STATUS_OK) {
        snprintf(chosen, chosen_len, "%s", backend_name(*out));
        if (dev->kind == DEVICE_AUTO) LOG(LL_INFO, "device auto: %s", chosen);
        return rc;
    }
    if (require_gpu) {
        snprintf(err, errlen, "--require-gpu: no GPU for device %s: %s", asked, why);
        return rc;
    }
    rc = backend_cpu_init(out, n_threads, err, errlen);
    if (rc != STATUS_OK) return rc;
    snprintf(chosen, chosen_len, "cpu (%s)", why);
    /* Asked for a GPU by name, the CPU is a surprise worth a warning; under
     * auto it is the expected outcome on a machine without one. */
    if (dev->kind == DEVICE_AUTO) LOG(LL_INFO, "device auto: %s", chosen);
    else LOG(LL_WARN, "device %s unavailable (%s): running on the CPU", asked, why);
    return STATUS_OK;
}

void backend_free(backend *b) {
    if (!b) return;
    sampler_free(b->smp);
    free(b->sample_buf);
    b->i->free(b);
}
const char *backend_name(const backend *b) { return b->i->name(b); }
const char *backend_errstr(const backend *b) { return b->errstr; }
int backend_is_gpu(const backend *b) { return b->i->is_gpu; }

void *backend_alloc(backend *b, size_t bytes) { return b->i->alloc(b, bytes ? bytes : 1); }
void backend_dealloc(backend *b, void *p) {
    if (p) b->i->dealloc(b, p);
}
int backend_mem_info(backend *b, size_t *bytes_free, size_t *bytes_total) {
    return b->i->mem_info(b, bytes_free, bytes_total);
}
int backend_upload(backend *b, void *dst, const void *src, size_t bytes) {
    return bytes ? b->i->upload(b, dst, src, bytes) : STATUS_OK;
}
int backend_download(backend *b, void *dst, const void *src, size_t bytes) {
    return b->i->download(b, dst, src, bytes);
}
int backend_copy(backend *b, void *dst, const void *src, size_t bytes) {
    return bytes ? b->i->copy(b, dst, src, bytes) : STATUS_OK;
}
int backend_sync(backend *b) { return b->i->sync(b); }

int backend_weight_load(backend *b, struct backend_weight *out, enum dtype type, const void *host,
                        int64_t rows, int64_t cols) {
    memset(out, 0, sizeof *out);
    if (!dtype_valid(type))
        return backend_fail(b, STATUS_UNSUPPORTED, "weight type %d is not supported", (int)type);
    if (rows <= 0 || cols <= 0 || cols % dtype_block_elems(type) != 0)
        return backend_fail(b, STATUS_BAD_INPUT, "weight %s [%lld x %lld]: bad shape",
                            dtype_name(type), (long long)rows, (long long)cols);
    return b->i->weight_load(b, out, type, host, rows, cols);
}
void backend_weight_free(backend *b, struct backend_weight *w) {
    if (w->data) b->i->weight_free(b, w);
    memset(w, 0, sizeof *w);
}

int backend_kv_init(backend *b, struct backend_kv *out, enum dtype type, int32_t n_blocks,
                    int32_t block_size, int32_t n_kv_heads, int32_t head_dim) {
    memset(out, 0, sizeof *out);
    if (type != DTYPE_F32 && type != DTYPE_F16 && type != DTYPE_Q8_0)
        return backend_fail(b, STATUS_UNSUPPORTED, "KV cache type %s (F32, F16 or Q8_0 only)", dtype_name(type));
    if (n_blocks <= 0 || block_size <= 0 || n_kv_heads <= 0 || head_dim <= 0)
        return backend_fail(b, STATUS_BAD_INPUT, "KV cache shape %d blocks x %d x %d x %d", n_blocks,
                            block_size, n_kv_heads, head_dim);
    if (type == DTYPE_Q8_0 && (head_dim % 2 != 0 || head_dim % backend_kv_q8_group(head_dim) != 0))
        return backend_fail(b, STATUS_UNSUPPORTED,
                            "KV cache type Q8_0 needs an even head_dim below 32 or a multiple of 32, not %d",
                            head_dim);
    size_t bytes = (size_t)n_blocks * block_size * n_kv_heads * backend_kv_row_bytes(type, head_dim);
    out->k = backend_alloc(b, bytes);
    out->v = out->k ? backend_alloc(b, bytes) : NULL;
    if (!out->v) {
        backend_dealloc(b, out->k);
        out->k = NULL;
        return backend_fail(b, STATUS_NO_MEMORY, "KV cache: cannot allocate 2 x %zu bytes", bytes);
    }
    out->type = type;
    out->n_blocks = n_blocks;
    out->block_size = block_size;
    out->n_kv_heads = n_kv_heads;
    out->head_dim = head_dim;
    return STATUS_OK;
}
void backend_kv_free(backend *b, struct backend_kv *kv) {
    backend_dealloc(b, kv->k);
    backend_dealloc(b, kv->v);
    memset(kv, 0, sizeof *kv);
}

int backend_embed(backend *b, float *out, const struct backend_weight *w, const int32_t *ids, int32_t n) {
    return n ? b->i->embed(b, out, w, ids, n) : STATUS_OK;
}
int backend_rmsnorm(backend *b, float *out, const float *x, const float *w, int32_t n, int32_t dim, float eps) {
    return n ? b->i->rmsnorm(b, out, x, w, n, dim, eps) : STATUS_OK;
}
int backend_add_rmsnorm(backend *b, float *x, const float *delta, float *out, const float *w,
                        int32_t n, int32_t dim, float eps) {
    return n ? b->i->add_rmsnorm(b, x, delta, out, w, n, dim, eps) : STATUS_OK;
}
int backend_add(backend *b, float *x, const float *y, int64_t n) {
    return n ? b->i->add(b, x, y, n) : STATUS_OK;
}
int backend_matmul(backend *b, float *out, const struct backend_weight *w, const float *x, int32_t n) {
    return n ? b->i->matmul(b, out, w, x, n) : STATUS_OK;
}
int backend_rope(backend *b, float *x, const int32_t *pos, int32_t n, int32_t n_heads,
                 int32_t head_dim, const float *inv_freq, int32_t n_freq, int neox) {
    if (2 * n_freq > head_dim)
        return backend_fail(b, STATUS_BAD_INPUT, "rope: %d frequencies for head_dim %d", n_freq, head_dim);
    return n ? b->i->rope(b, x, pos, n, n_heads, head_dim, inv_freq, n_freq, neox) : STATUS_OK;
}
int backend_swiglu(backend *b, float *out, const float *gate, const float *up, int64_t n) {
    return n ? b->i->swiglu(b, out, gate, up, n) : STATUS_OK;
}
int backend_get_rows(backend *b, float *out, const float *x, const int32_t *idx, int32_t n, int32_t dim) {
    return n ? b->i->get_rows(b, out, x, idx, n, dim) : STATUS_OK;
}
int backend_kv_write(backend *b, struct backend_kv *kv, const float *k, const float *v,
                     const int32_t *slots, int32_t n) {
    return n ? b->i->kv_write(b, kv, k, v, slots, n) : STATUS_OK;
}
int backend_attention(backend *b, float *out, const float *q, const struct backend_kv *kv,
                      const struct backend_attn_batch *batch, int32_t n_heads, float scale) {
    if (n_heads % kv->n_kv_heads != 0)
        return backend_fail(b, STATUS_BAD_INPUT, "attention: %d heads over %d KV heads", n_heads,
                            kv->n_kv_heads);
    return batch->n_tokens ? b->i->attention(b, out, q, kv, batch, n_heads, scale) : STATUS_OK;
}
int backend_convert(backend *b, void *dst, enum dtype dst_type, const void *src,
                    enum dtype src_type, int64_t n) {
    return n ? b->i->convert(b, dst, dst_type, src, src_type, n) : STATUS_OK;
}

int backend_matmul_multi(backend *b, int n_w, float *const outs[], const struct backend_weight *const ws[],
                         const float *x, int32_t n) {
    if (n_w < 0 || n_w > BACKEND_MATMUL_MULTI_MAX)
        return backend_fail(b, STATUS_BAD_INPUT, "matmul_multi: %d weights (at most %d)", n_w,
                            BACKEND_MATMUL_MULTI_MAX);
    if (n == 0 || n_w == 0) return STATUS_OK;
    if (b->i->matmul_multi) {
        int rc = b->i->matmul_multi(b, n_w, outs, ws, x, n);
        if (rc != BACKEND_NOT_FUSED) return rc;
    }
    for (int j = 0; j < n_w; j++) {
        int rc = b->i->matmul(b, outs[j], ws[j], x, n);
        if (rc != STATUS_OK) return rc;
    }
    return STATUS_OK;
}

int backend_matmul_swiglu(backend *b, float *out, const struct backend_weight *gate,
                          const struct backend_weight *up, const float *x, int32_t n, float *gate_tmp,
                          float *up_tmp) {
    if (gate->rows != up->rows || gate->cols != up->cols)
        return backend_fail(b, STATUS_BAD_INPUT, "matmul_swiglu: gate [%lld x %lld] and up [%lld x %lld] differ",
                            (long long)gate->rows, (long long)gate->cols, (long long)up->rows,
                            (long long)up->cols);
    if (n == 0) return STATUS_OK;
    if (b->i->matmul_swiglu) {
        int rc = b->i->matmul_swiglu(b, out, gate, up, x, n, gate_tmp, up_tmp);
        if (rc != BACKEND_NOT_FUSED) return rc;
    }
    float *outs[2] = {gate_tmp, up_tmp};
    const struct backend_weight *ws[2] = {gate, up};
    int rc = backend_matmul_multi(b, 2, outs, ws, x, n);
    return rc == STATUS_OK ? b->i->swiglu(b, out, gate_tmp, up_tmp, (int64_t)n * gate->rows) : rc;
}

int backend_rope_kv_write(backend *b, float *q, float *k, const float *v, struct backend_kv *kv,
                          const int32_t *pos, const int32_t *slots, int32_t n, int32_t n_heads,
                          const float *inv_freq, int32_t n_freq, int neox) {
    if (2 * n_freq > kv->head_dim)
        return backend_fail(b, STATUS_BAD_INPUT, "rope: %d frequencies for head_dim %d", n_freq, kv->head_dim);
    if (n == 0) return STATUS_OK;
    if (b->i->rope_kv_write)
        return b->i->rope_kv_write(b, q, k, v, kv, pos, slots, n, n_heads, inv_freq, n_freq, neox);
    int rc = b->i->rope(b, q, pos, n, n_heads, kv->head_dim, inv_freq, n_freq, neox);
    if (rc == STATUS_OK) rc = b->i->rope(b, k, pos, n, kv->n_kv_heads, kv->head_dim, inv_freq, n_freq, neox);
    if (rc == STATUS_OK) rc = b->i->kv_write(b, kv, k, v, slots, n);
    return rc;
}

int backend_rope_kv_attention(backend *b, float *out, float *q, float *k, const float *v, struct backend_kv *kv,
                              const int32_t *pos, const int32_t *slots, const float *inv_freq, int32_t n_freq,
                              int neox, const struct backend_attn_batch *batch, int32_t n_heads, float scale) {
    if (2 * n_freq > kv->head_dim)
        return backend_fail(b, STATUS_BAD_INPUT, "rope: %d frequencies for head_dim %d", n_freq, kv->head_dim);
    if (batch->n_tokens == 0) return STATUS_OK;
    if (b->i->rope_kv_attention) {
        int rc = b->i->rope_kv_attention(b, out, q, k, v, kv, pos, slots, inv_freq, n_freq, neox, batch, n_heads,
                                         scale);
        if (rc != BACKEND_NOT_FUSED) return rc;
    }
    int rc = backend_rope_kv_write(b, q, k, v, kv, pos, slots, batch->n_tokens, n_heads, inv_freq, n_freq, neox);
    return rc == STATUS_OK ? backend_attention(b, out, q, kv, batch, n_heads, scale) : rc;
}

/* The host path: each row (downloaded first from a GPU) through
 * common/sampling.c. */
static int backend_sample_host(backend *b, const float *logits, int32_t n_vocab,
                               struct backend_sample_row *rows, int32_t n_rows) {
    if (b->smp && sampler_n_vocab(b->smp) != n_vocab) {
        sampler_free(b->smp);
        b->smp = NULL;
        free(b->sample_buf);
        b->sample_buf = NULL;
    }
    if (!b->smp) {
        char err[160];
        int rc = sampler_init(&b->smp, n_vocab, err, sizeof err);
        if (rc != STATUS_OK) return backend_fail(b, rc, "sample: %s", err);
    }
    int masked = 0;
    for (int32_t r = 0; r < n_rows; r++) masked |= rows[r].allow != NULL;
    if ((b->i->is_gpu || masked) && !b->sample_buf) {
        b->sample_buf = malloc((size_t)n_vocab * sizeof(float));
        if (!b->sample_buf)
            return backend_fail(b, STATUS_NO_MEMORY, "sample: no host memory for %d logits", n_vocab);
    }
    for (int32_t r = 0; r < n_rows; r++) {
        const float *row = logits + (size_t)r * n_vocab;
        if (b->i->is_gpu) {
            int rc = b->i->download(b, b->sample_buf, row, (size_t)n_vocab * sizeof(float));
            if (rc != STATUS_OK) return rc;
            row = b->sample_buf;
        }
        struct backend_sample_row *sr = &rows[r];
        if (sr->allow) {
            if (row != b->sample_buf) memcpy(b->sample_buf, row, (size_t)n_vocab * sizeof(float));
            row = b->sample_buf;
            for (int32_t w = 0; w * 64 < n_vocab; w++) {
                uint64_t m = sr->allow[w];
                if (m == UINT64_MAX) continue;
                int32_t end = w * 64 + 64 < n_vocab ? w * 64 + 64 : n_vocab;
                for (int32_t t = w * 64; t < end; t++)
                    if (!((m >> (t - w * 64)) & 1)) b->sample_buf[t] = -INFINITY;
            }
        }
        sr->err[0] = 0;
        sr->status = sampler_sample(b->smp, row, sr->params, sr->history, sr->n_history, sr->pos, &sr->result);
        if (sr->status < 0) snprintf(sr->err, sizeof sr->err, "%s", sampler_errstr(b->smp));
    }
    return STATUS_OK;
}

int backend_sample(backend *b, const float *logits, int32_t n_vocab, struct backend_sample_row *rows,
                   int32_t n_rows) {
    if (n_vocab < 1 || n_rows < 0)
        return backend_fail(b, STATUS_BAD_INPUT, "sample: %d rows of %d logits", n_rows, n_vocab);
    if (n_rows == 0) return STATUS_OK;
    if (!b->i->sample) return backend_sample_host(b, logits, n_vocab, rows, n_rows);
    /* Masked rows go to the host path unless the backend's sampler applies
     * masks (the CUDA one does); runs of the others in between to the
     * backend's own sampler. */
    const bool masks = b->i->sample_masks;
    for (int32_t r0 = 0; r0 < n_rows;) {
        int host = rows[r0].allow != NULL && !masks;
        int32_t r1 = r0 + 1;
        while (r1 < n_rows && (rows[r1].allow != NULL && !masks) == host) r1++;
        const float *l = logits + (size_t)r0 * n_vocab;
        int rc = BACKEND_NOT_FUSED;
        if (!host) rc = b->i->sample(b, l, n_vocab, rows + r0, r1 - r0);
        if (rc == BACKEND_NOT_FUSED) rc = backend_sample_host(b, l, n_vocab, rows + r0, r1 - r0);
        if (rc != STATUS_OK) return rc;
        r0 = r1;
    }
    return STATUS_OK;
}

void *backend_host_alloc(backend *b, size_t bytes) {
    if (!bytes) bytes = 1;
    if (b->i->host_alloc) return b->i->host_alloc(b, bytes);
    void *p = malloc(bytes);
    if (!p) backend_fail(b, STATUS_NO_MEMORY, "host buffer of %zu bytes: out of memory", bytes);
    return p;
}
void backend_host_free(backend *b, void *p) {
    if (!p) return;
    if (b->i->host_free) b->i->host_free(b, p);
    else free(p);
}

int backend_has_graphs(const backend *b) { return b->i->graph_begin != NULL; }
int backend_graph_begin(backend *b) {
    if (!b->i->graph_begin) return backend_fail(b, STATUS_UNSUPPORTED, "%s has no graphs", backend_name(b));
    return b->i->graph_begin(b);
}
int backend_graph_end(backend *b, backend_graph **out) {
    *out = NULL;
    if (!b->i->graph_end) return backend_fail(b, STATUS_UNSUPPORTED, "%s has no graphs", backend_name(b));
    return b->i->graph_end(b, out);
}
int backend_graph_launch(backend *b, backend_graph *g) {
    if (!b->i->graph_launch) return backend_fail(b, STATUS_UNSUPPORTED, "%s has no graphs", backend_name(b));
    return b->i->graph_launch(b, g);
}
void backend_graph_free(backend *b, backend_graph *g) {
    if (g && b->i->graph_free) b->i->graph_free(b, g);
}

#ifndef LLM_HAVE_CUDA
int backend_cuda_init(backend **out, int device, char *err, size_t errlen) {
    *out = NULL;
    /* The reason configure gave (no nvcc, LLM_CUDA=OFF, or nvcc without a
     * GPU and no architectures), not a guess. */
    snprintf(err, errlen, "cuda:%d: this build has no CUDA backend (at configure time: %s)", device, LLM_CUDA_WHY);
    return STATUS_UNSUPPORTED;
}
#endif
