/* The table of functions a backend fills, behind the opaque handle of
 * backend.h.  Only kernels/ includes this. */
#ifndef KERNELS_BACKEND_IMPL_H
#define KERNELS_BACKEND_IMPL_H

#include "backend.h"

#include <stdbool.h>

struct backend_i {
    const char *(*name)(const backend *b);
    void (*free)(backend *b);
    int is_gpu;
    void *(*alloc)(backend *b, size_t bytes);
    void (*dealloc)(backend *b, void *p);
    int (*mem_info)(backend *b, size_t *bytes_free, size_t *bytes_total);
    int (*upload)(backend *b, void *dst, const void *src, size_t bytes);
    int (*download)(backend *b, void *dst, const void *src, size_t bytes);
    int (*copy)(backend *b, void *dst, const void *src, size_t bytes);
    int (*sync)(backend *b);
    int (*weight_load)(backend *b, struct backend_weight *out, enum dtype type, const void *host,
                       int64_t rows, int64_t cols);
    void (*weight_free)(backend *b, struct backend_weight *w);
    int (*embed)(backend *b, float *out, const struct backend_weight *w, const int32_t *ids, int32_t n);
    int (*rmsnorm)(backend *b, float *out, const float *x, const float *w, int32_t n, int32_t dim, float eps);
    int (*add_rmsnorm)(backend *b, float *x, const float *delta, float *out, const float *w,
                       int32_t n, int32_t dim, float eps);
    int (*add)(backend *b, float *x, const float *y, int64_t n);
    int (*matmul)(backend *b, float *out, const struct backend_weight *w, const float *x, int32_t n);
    int (*rope)(backend *b, float *x, const int32_t *pos, int32_t n, int32_t n_heads,
                int32_t head_dim, const float *inv_freq, int32_t n_freq, int neox);
    int (*swiglu)(backend *b, float *out, const float *gate, const float *up, int64_t n);
    int (*get_rows)(backend *b, float *out, const float *x, const int32_t *idx, int32_t n, int32_t dim);
    int (*kv_write)(backend *b, struct backend_kv *kv, const float *k, const float *v,
                    const int32_t *slots, int32_t n);
    int (*attention)(backend *b, float *out, const float *q, const struct backend_kv *kv,
                     const struct backend_attn_batch *batch, int32_t n_heads, float scale);
    int (*convert)(backend *b, void *dst, enum dtype dst_type, const void *src,
                   enum dtype src_type, int64_t n);
    /* Optional (NULL: host_alloc is malloc, graphs are unsupported, the
     * fused ops run the plain ones, sampling downloads the logits and runs
     * common/sampling.c on the host).  matmul_multi, matmul_swiglu and
     * rope_kv_attention may return BACKEND_NOT_FUSED for a case they do
     * not take: then the plain ops run. */
    int (*matmul_multi)(backend *b, int n_w, float *const outs[], const struct backend_weight *const ws[],
                        const float *x, int32_t n);
    int (*matmul_swiglu)(backend *b, float *out, const struct backend_weight *gate,
                         const struct backend_weight *up, const float *x, int32_t n, float *gate_tmp,
                         float *up_tmp);
    int (*rope_kv_write)(backend *b, float *q, float *k, const float *v, struct backend_kv *kv,
                         const int32_t *pos, const int32_t *slots, int32_t n, int32_t n_heads,
                         const float *inv_freq, int32_t n_freq, int neox);
    int (*rope_kv_attention)(backend *b, float *out, float *q, float *k, const float *v, struct backend_kv *kv,
                             const int32_t *pos, const int32_t *slots, const float *inv_freq, int32_t n_freq,
                             int neox, const struct backend_attn_batch *batch, int32_t n_heads, float scale);
    int (*sample)(backend *b, const float *logits, int32_t n_vocab, struct backend_sample_row *rows,
                  int32_t n_rows);
    /* sample applies backend_sample_row.allow itself (a grammar's mask);
     * false: masked rows go to the host sampler. */
    bool sample_masks;
    void *(*host_alloc)(backend *b, size_t bytes);
    void (*host_free)(backend *b, void *p);
    int (*graph_begin)(backend *b);
    int (*graph_end)(backend *b, backend_graph **out);
    int (*graph_launch)(backend *b, backend_graph *g);
    void (*graph_free)(backend *b, backend_graph *g);
};

/* Every backend struct starts with this header. */
struct backend {
    const struct backend_i *i;
    char errstr[256];
    /* Host sampling (backend.c), made on first use: */
    sampler *smp;
    float *sample_buf; /* one row of logits downloaded from the device */
};

/* What a fused op returns for a case it leaves to the plain ops. */
#define BACKEND_NOT_FUSED 1

/* Record a failure in b->errstr and return code. */
int backend_fail(backend *b, int code, const char *fmt, ...) __attribute__((format(printf, 3, 4)));

#endif
