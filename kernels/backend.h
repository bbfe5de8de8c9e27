/* The compute backend: one interface over the CPU reference (kernels/cpu)
 * and the GPU (kernels/cuda).  The model code in worker/ calls only these
 * functions, so the same forward pass runs on either.
 *
 * Memory: every pointer passed to an op is backend memory from backend_alloc
 * (on the CPU backend that is host memory).  Activations are always F32,
 * row-major [n_tokens, width].  Integer side arrays (token ids, positions,
 * slots, block tables) are int32 in backend memory, filled with
 * backend_upload.  Ops are queued in order on the backend's one stream;
 * results are visible to the host after backend_sync (backend_download
 * synchronizes itself).  A backend handle is not thread-safe: one thread
 * at a time calls it (a worker's compute thread owns its backend). */
#ifndef KERNELS_BACKEND_H
#define KERNELS_BACKEND_H

#include <stddef.h>
#include <stdint.h>

/* C linkage for CUDA files that include it (kernels/cuda), whichever
 * header of common/ they reach first. */
#ifdef __cplusplus
extern "C" {
#endif

#include "../common/device.h"
#include "../common/dtype.h"
#include "../common/sampling.h"

typedef struct backend backend;

/* A weight matrix held by a backend.  Row r (an output feature) holds cols
 * elements (input features) of `type`, rows stored one after the other. */
struct backend_weight {
    void *data;       /* backend memory, or (CPU) the caller's host memory */
    enum dtype type;  /* as stored: the CUDA backend turns BF16 into F16 (and keeps
                       * Q8_0 and Q6_K rows in a regrouped layout of its own) */
    int64_t rows;     /* output features (GGUF ne[1]) */
    int64_t cols;     /* input features (GGUF ne[0]) */
    int owned;        /* 1 if backend_weight_free must release data */
};

/* One layer's paged KV cache.  k and v are each
 * [n_blocks][n_kv_heads][block_size][head_dim] of `type`: F32, F16, or
 * Q8_0.  A Q8_0 position row (one KV head) is head_dim / g groups of g =
 * backend_kv_q8_group(head_dim) values, each group an F16 scale d followed
 * by g int8 q (value = d * q): 66 bytes per 64 values for heads whose width
 * is a multiple of 128, 34 per 32 (common/dtype.h's block_q8_0) for heads
 * of 32, 64 or 96, one scale per row for heads narrower than 32.  Rows are
 * backend_kv_row_bytes apart, so a KV block stays contiguous.  Writes
 * quantize (d = amax / 127 rounded to F16, q = x / d rounded to nearest, as
 * dtype_quant_row does); attention reads the 8-bit values directly. */
struct backend_kv {
    void *k, *v;
    enum dtype type;
    int32_t n_blocks, block_size, n_kv_heads, head_dim;
};

/* Values per F16 scale in a Q8_0 KV row.  64 where head_dim is a multiple
 * of 128: a 128-wide row is then 132 bytes, so a memory budget holds
 * 256 / 132 = 1.94x the positions of F16 where groups of 32 (136 bytes)
 * hold 1.88x.  The cost is rounding.  A value is rounded to a step of its
 * group's largest magnitude / 127, so where one half of a group of 64
 * holds smaller values than the other (largest a < b), that half takes
 * the step of b instead of a: for one small value the step grows by b / a,
 * but summed over the group the expected squared rounding error (a step
 * squared / 12 a value), 64 b^2 against 32 (a^2 + b^2) for two groups of
 * 32 in units of 1 / (12 x 127^2), is at most twice as large.  32 for
 * heads of 32, 64 or 96, whose rows with groups of 64 would lose the
 * 4-byte alignment the GPU kernels read rows by (a 64-wide row of 66
 * bytes); the whole row for heads narrower than 32.  Q8_0 needs an even
 * head_dim that is below 32 or a multiple of 32.  The CUDA kernels call it
 * too, at compile time where a kernel is built for one head width. */
#ifdef __CUDACC__
__host__ __device__ constexpr
#endif
static inline int32_t backend_kv_q8_group(int32_t head_dim) {
    return head_dim < 32 ? head_dim : head_dim % 128 == 0 ? 64 : 32;
}
/* Bytes of one position of one KV head in a cache of this type. */
static inline size_t backend_kv_row_bytes(enum dtype type, int32_t head_dim) {
    if (type == DTYPE_Q8_0) {
        int32_t g = backend_kv_q8_group(head_dim);
        return (size_t)(head_dim / g) * (size_t)(g + 2);
    }
    return (size_t)head_dim * (type == DTYPE_F32 ? 4 : 2);
}

/* The sequences of one step, for attention.  Every pointer is backend
 * memory; the host-side counts size the launch. */
struct backend_attn_batch {
    int32_t n_seqs;
    int32_t n_tokens;            /* rows of q and out */
    int32_t max_blocks;          /* columns of block_tables */
    int32_t max_ctx;             /* max over sequences of pos0 + n_tokens_seq */
    const int32_t *seq_tok0;     /* (n_seqs + 1) first row of each sequence; [n_seqs] = n_tokens */
    const int32_t *seq_pos0;     /* (n_seqs) position of each sequence's first row */
    const int32_t *block_tables; /* (n_seqs, max_blocks) block ids */
    int32_t rows_min, rows_max;  /* the fewest and the most rows a sequence has, exactly (0: not given;
                                  * the GPU's verifying-step attention relies on them) */
};

/* Creation.  Both return 0 and set *out, or a negative status with a message
 * in err (then *out is NULL).  n_threads <= 0 means one per core. */
int backend_cpu_init(backend **out, int n_threads, char *err, size_t errlen);
/* device: CUDA device index.  Returns STATUS_UNSUPPORTED when built without
 * CUDA and STATUS_UNAVAILABLE when there is no such GPU. */
int backend_cuda_init(backend **out, int device, char *err, size_t errlen);
void backend_free(backend *b);
/* The backend a parsed --device names (common/device.h).  auto: cuda:0
 * when this build has the CUDA backend and that GPU opens, else the CPU.
 * cuda:N: that GPU, else the CPU with a warning, unless require_gpu (then
 * the failure).  cpu: the CPU.  Logs the choice (info for auto, a warning
 * for a named GPU that did not open) and writes it into chosen when not
 * NULL: the backend's name, or "cpu (cuda:0: no usable GPU (no CUDA
 * device))" with why the GPU did not open.  Returns 0 and *out, or a
 * negative status with a message in err (then *out is NULL). */
int backend_open(backend **out, const struct device_spec *dev, int n_threads, int require_gpu, char *chosen,
                 size_t chosen_len, char *err, size_t errlen);

const char *backend_name(const backend *b);     /* "cpu", "cuda:0 (NVIDIA H100 ...)" */
const char *backend_errstr(const backend *b);   /* details of the last failure */
int backend_is_gpu(const backend *b);

/* Memory.  backend_alloc returns NULL when out of memory (errstr says how
 * much was asked).  Bytes free/total are the device's (host RAM on CPU). */
void *backend_alloc(backend *b, size_t bytes);
void backend_dealloc(backend *b, void *p);
int backend_mem_info(backend *b, size_t *bytes_free, size_t *bytes_total);
int backend_upload(backend *b, void *dst, const void *src, size_t bytes);   /* async on GPU; src must stay valid until the next sync */
int backend_download(backend *b, void *dst, const void *src, size_t bytes); /* waits for the stream */
int backend_copy(backend *b, void *dst, const void *src, size_t bytes);     /* backend to backend */
int backend_sync(backend *b);

/* Weights.  host points at rows*cols elements of `type` in host memory.  The
 * CPU backend may keep a reference to host instead of copying (owned = 0):
 * then host must outlive the weight.  Types: every dtype of common/dtype.h. */
int backend_weight_load(backend *b, struct backend_weight *out, enum dtype type,
                        const void *host, int64_t rows, int64_t cols);
void backend_weight_free(backend *b, struct backend_weight *w);
/* A KV cache for one layer, or NULL.  type F32, F16 or Q8_0 (see
 * backend_kv_q8_group for the head widths it takes). */
int backend_kv_init(backend *b, struct backend_kv *out, enum dtype type, int32_t n_blocks,
                    int32_t block_size, int32_t n_kv_heads, int32_t head_dim);
void backend_kv_free(backend *b, struct backend_kv *kv);

/* Ops.  Each returns 0 or a negative status; shapes in comments. */
/* out[n, w.cols] = rows ids[n] of the embedding table w. */
int backend_embed(backend *b, float *out, const struct backend_weight *w, const int32_t *ids, int32_t n);
/* out[n, dim] = x / rms(x) * w[dim]. */
int backend_rmsnorm(backend *b, float *out, const float *x, const float *w, int32_t n, int32_t dim, float eps);
/* x[n, dim] += delta[n, dim]; then out = rmsnorm(x) * w. */
int backend_add_rmsnorm(backend *b, float *x, const float *delta, float *out, const float *w,
                        int32_t n, int32_t dim, float eps);
/* x[i] += y[i], i < n. */
int backend_add(backend *b, float *x, const float *y, int64_t n);
/* out[n, w.rows] = x[n, w.cols] . w^T */
int backend_matmul(backend *b, float *out, const struct backend_weight *w, const float *x, int32_t n);
/* Rotate the first 2*n_freq dims of every head of x[n, n_heads*head_dim] by
 * pos[t] * inv_freq[i].  neox = 1 pairs (i, i + n_freq), 0 pairs (2i, 2i+1). */
int backend_rope(backend *b, float *x, const int32_t *pos, int32_t n, int32_t n_heads,
                 int32_t head_dim, const float *inv_freq, int32_t n_freq, int neox);
/* out[i] = silu(gate[i]) * up[i]. */
int backend_swiglu(backend *b, float *out, const float *gate, const float *up, int64_t n);
/* out[i, :] = x[idx[i], :], i < n, rows of dim floats. */
int backend_get_rows(backend *b, float *out, const float *x, const int32_t *idx, int32_t n, int32_t dim);
/* Write k, v [n, n_kv_heads*head_dim] into the cache at slots[n]
 * (slot = block * block_size + offset). */
int backend_kv_write(backend *b, struct backend_kv *kv, const float *k, const float *v,
                     const int32_t *slots, int32_t n);
/* Causal grouped-query attention over the paged cache (which must already
 * hold this step's k, v).  q, out: [n_tokens, n_heads*head_dim].  Row t of
 * sequence s at position p attends to positions 0..p of s. */
int backend_attention(backend *b, float *out, const float *q, const struct backend_kv *kv,
                      const struct backend_attn_batch *batch, int32_t n_heads, float scale);
/* Fused forms of the ops above, for the steps of one layer.  Each gives
 * the same result as the plain ops it names (the tests compare them); a
 * backend that has no faster way runs exactly those ops.  On the GPU they
 * save kernel launches, which is most of a small decode step's time. */
#define BACKEND_MATMUL_MULTI_MAX 4
/* outs[j][n, ws[j]->rows] = x . ws[j]^T for j < n_w <= BACKEND_MATMUL_MULTI_MAX
 * (q, k and v of one input): n_w backend_matmul calls.  No out may
 * overlap x. */
int backend_matmul_multi(backend *b, int n_w, float *const outs[], const struct backend_weight *const ws[],
                         const float *x, int32_t n);
/* out[n, gate->rows] = silu(x . gate^T) * (x . up^T): backend_matmul of
 * gate into gate_tmp and of up into up_tmp, then backend_swiglu.  gate and
 * up have the same shape; gate_tmp and up_tmp ([n, gate->rows] each) are
 * scratch the backend may leave unused. */
int backend_matmul_swiglu(backend *b, float *out, const struct backend_weight *gate,
                          const struct backend_weight *up, const float *x, int32_t n, float *gate_tmp,
                          float *up_tmp);
/* backend_rope of q [n, n_heads*head_dim] and of k [n, kv->n_kv_heads*head_dim]
 * at pos, then backend_kv_write of the rotated k and of v at slots.  q and
 * k are rotated in place. */
int backend_rope_kv_write(backend *b, float *q, float *k, const float *v, struct backend_kv *kv,
                          const int32_t *pos, const int32_t *slots, int32_t n, int32_t n_heads,
                          const float *inv_freq, int32_t n_freq, int neox);
/* backend_rope_kv_write of q, k (rotated) and v at pos and slots (the
 * batch's rows), then out = backend_attention of the rotated q.  q and k
 * may be left rotated or as given. */
int backend_rope_kv_attention(backend *b, float *out, float *q, float *k, const float *v, struct backend_kv *kv,
                              const int32_t *pos, const int32_t *slots, const float *inv_freq, int32_t n_freq,
                              int neox, const struct backend_attn_batch *batch, int32_t n_heads, float scale);

/* Sampling.  One row of logits to sample: the request's parameters and
 * token history in, the token (or why there is none) out.  Host memory. */
struct backend_sample_row {
    const struct sampling_params *params; /* passed sampling_params_validate */
    const int32_t *history;               /* the sequence's tokens so far (penalties read them) */
    int32_t n_history;
    int64_t pos;                          /* position of the token being picked */
    /* NULL, or the tokens this row may pick: bit t of allow[t / 64] (a
     * grammar's mask, worker/constrain.h).  The others count as -inf
     * logits, before the penalties; a row whose mask allows nothing fails.
     * The CUDA backend applies the mask on the device (the words go up with
     * the row's parameters); a backend whose sampler does not take masks
     * samples masked rows on the host (downloading just them). */
    const uint64_t *allow;
    struct sampling_result result;        /* out: as sampler_sample fills it */
    int status;                           /* out: 0, or why this row has no token (result.token = -1) */
    char err[96];                         /* out: when status < 0, "logit of token 17 is nan" */
};
/* Picks one token for each row r < n_rows of logits[n_rows, n_vocab]
 * (backend memory) under rows[r] by sampler_sample's rules
 * (common/sampling.h): the same tokens for the same inputs, whichever
 * backend runs it (up to float rounding at the edge of a top-p cut or of
 * the draw).  A row's own failure (a NaN logit, a history token outside the
 * vocabulary) is reported in that row and the others are still sampled.
 * Returns 0, or a negative status when the backend itself fails (then no
 * row is valid).  Waits for the stream. */
int backend_sample(backend *b, const float *logits, int32_t n_vocab, struct backend_sample_row *rows,
                   int32_t n_rows);

/* Element conversion between F32, F16 and BF16 buffers (stage transfers). */
int backend_convert(backend *b, void *dst, enum dtype dst_type, const void *src,
                    enum dtype src_type, int64_t n);

/* Host memory for buffers that are uploaded every step: page-locked on the
 * GPU (so backend_upload from it is a true asynchronous copy), plain heap
 * memory on the CPU.  NULL when it cannot be had; free with
 * backend_host_free (NULL is fine). */
void *backend_host_alloc(backend *b, size_t bytes);
void backend_host_free(backend *b, void *p);

/* Graphs: a sequence of ops recorded once and replayed with one launch
 * (CUDA graphs), so a step of hundreds of small kernels costs one host
 * call.  Between backend_graph_begin and backend_graph_end the ops are
 * recorded, not run; their arguments (pointers, sizes) are baked in, so
 * whatever changes between replays must be read by the kernels from
 * backend memory that the caller rewrites before each launch.  No op
 * recorded may need new memory (run the same ops once outside a graph
 * first so every scratch buffer has its size).  The CPU backend has no
 * graphs: begin returns STATUS_UNSUPPORTED. */
typedef struct backend_graph backend_graph;
int backend_has_graphs(const backend *b);
int backend_graph_begin(backend *b);
/* Ends the recording (always, also after a failed op in between) and
 * returns 0 and *out, freed with backend_graph_free, or a negative status
 * (then *out is NULL and the recording is dropped). */
int backend_graph_end(backend *b, backend_graph **out);
/* Queues one replay on the stream.  STATUS_UNAVAILABLE: the graph refers
 * to backend scratch memory that has been replaced since it was recorded
 * (free it and record again). */
int backend_graph_launch(backend *b, backend_graph *g);
void backend_graph_free(backend *b, backend_graph *g);

#ifdef __cplusplus
}
#endif

#endif
