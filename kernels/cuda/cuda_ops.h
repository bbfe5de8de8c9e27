/* The CUDA backend's kernels and device plumbing as plain C prototypes, so
 * that backend_cuda.c (and the benchmark) call them without including any
 * CUDA header.  Each op queues its work on ctx->stream and returns 0 or a
 * negative status with the reason in ctx->err; no op synchronizes. */
#ifndef KERNELS_CUDA_CUDA_OPS_H
#define KERNELS_CUDA_CUDA_OPS_H

#include <stddef.h>
#include <stdint.h>

#ifdef __cplusplus
extern "C" {
#endif

#include "../../common/dtype.h"

/* One device, one stream, one cuBLAS handle and one scratch buffer.  Created
 * by cuda_ctx_init, released by cuda_ctx_free (which frees the scratch). */
struct cuda_ctx {
    int device;
    int n_sms;          /* multiprocessors, to size split-K launches */
    int cc;             /* compute capability, major * 10 + minor */
    void *stream;       /* cudaStream_t */
    void *cublas;       /* cublasHandle_t, bound to stream */
    void *scratch;      /* device memory reused by matmul and attention */
    size_t scratch_bytes;
    int vec_max_quant;  /* matmul: most tokens for the skinny kernel, quantized weights */
    int vec_max_float;  /* the same for F16/F32 weights (LLM_CUDA_SKINNY_MAX overrides both) */
    int gemv_max;       /* matmul: -1 (default): matmul_gemv.cu where it measured faster;
                         * else up to this many tokens (LLM_CUDA_GEMV_MAX; 0: never) */
    int gemm_group;     /* matmul: prefill-sized groups of equal F16 weights in one batched
                         * cuBLAS call (default; LLM_CUDA_GEMM_GROUP=0: one call each) */
    int mv_split;       /* matmul_vec.cu row kernel: warps per row on single-wave grids
                         * (4, default; LLM_CUDA_MV_SPLIT=1 or 2) */
    int pdl;            /* decode kernels launched as programmatic dependents (sm_90
                         * and later, default; LLM_CUDA_PDL=0: off): common.cuh */
    int wide;           /* matmul_wide.cu for quantized weights at 17-64 tokens (sm_80
                         * and later, default; LLM_CUDA_WIDE=0: off) */
    int wide_items;     /* least items (row block x chunk) per SM it takes: 2 (default),
                         * or LLM_CUDA_WIDE_ITEMS */
    int mq_nt_max;      /* most tokens on matmul_vec.cu's mq: 64, or 32 on sm_75 with
                         * LLM_CUDA_MQ64=0 (the tile path above) */
    int mq_x_parts;     /* mq at 33-64 tokens stages each chunk's activations in this many
                         * column parts: 2 on sm_75 (64 KB of shared memory a block), else 1 */
    int att_steps;      /* attention decode kernel: each context split at least this many
                         * steps of its sub-warps (2, default; LLM_CUDA_ATT_STEPS=1) */
    int att_wide;       /* attention decode kernel: ungrouped heads in blocks of 8 warps where
                         * blocks of 4 would fill at most 4 a multiprocessor (1; LLM_CUDA_ATT_WIDE) */
    int att_k16;        /* attention_prefill.cu: mma m16n8k16 (sm_80 and later, default;
                         * LLM_CUDA_ATT_K8=1: m16n8k8, sm_75's, to compare) */
    int rope_att;       /* rope, cache write and attention of decode batches of up to this
                         * many rows in one launch (rope_attention.cu; LLM_CUDA_ROPE_ATT=k,
                         * 0: the two ops) */
    int att_f16;        /* from 3 rows the attention kernels also write their output's F16 form for
                         * the matmul after it (default; LLM_CUDA_ATT_F16=0: not) */
    int rope_att_mha;   /* the same where every query head has its own KV head (8; the same
                         * variable sets it) */
    int rope_tc;        /* the tensor-core attention does the rope and cache write of steps whose
                         * every sequence has 2 to this many rows (16, default; 0: never;
                         * LLM_CUDA_ROPE_TC) */
    int rope_gqa;       /* those steps on attention_gqa.cu, a sequence's rows and a group's heads
                         * the mma's rows (default; LLM_CUDA_ROPE_GQA=0: attention_prefill.cu) */
    int att_defer;      /* up to this many rows (4, default; at most 4) rope_attention.cu merges its
                         * slices by a kernel of its own that also writes the o matmul's int8
                         * form (LLM_CUDA_ATT_DEFER=k; 0: merged by the attention's last blocks,
                         * which then write that form at 1-2 rows) */
    unsigned *att_sync; /* CUDA_ATT_SYNC_WORDS counters for it, zeroed at init */
    int att_gqa_min;    /* attention: decode rows of at least this many query heads per KV head
                         * on attention_gqa.cu (2, default; 0: never; LLM_CUDA_ATT_GQA_MIN) */
    int att_ring, att_ring_rows; /* attention_gqa.cu over an F16 cache, sm_80+: the warps' steps through a
                         * cp.async ring of this many stages (2 or 3; 0: in registers;
                         * LLM_CUDA_ATT_RING), from att_ring_rows decode rows (32;
                         * LLM_CUDA_ATT_RING_ROWS) */
    int att_q8_ring_max; /* over a Q8_0 cache: the ring up to this many decode rows
                         * (LLM_CUDA_ATT_Q8_RING_MAX; -1: as many as fill one wave
                         * unsplit, and past it where the split passes the fill;
                         * 0: never) */
    int att_ring_shallow; /* over an F16 cache with 3 stages: 2 where only their blocks fit one
                         * wave (LLM_CUDA_ATT_RING_SHALLOW) */
    int decode_tc_g;    /* attention: decode-only batches with at least this many query
                         * heads per KV head on tensor cores (8, default; 0: never;
                         * LLM_CUDA_DECODE_TC_G) */
    /* Activations the last matmul left at the start of the scratch, so
     * that the next matmul on the same input (q, k and v; gate and up)
     * uses them again instead of converting or quantizing once more:
     * act_x, act_n x act_cols floats, as act_kind (MATMUL_ACT_*) in the
     * scratch at act_scratch.  Every op but matmul forgets them
     * (backend_cuda.c), as does a scratch reallocation: either may have
     * changed the input or the scratch. */
    int mmq_min;        /* matmul_mmq.cu, the int8 tensor-core kernel for K-quant weights, takes
                         * mmq_min .. mmq_max tokens (Q6_K weights of more than mmq_q6_rows rows
                         * to mmq_max_q6) on weights (a group: together) of at least mmq_rows rows
                         * up to 16 tokens, of at least mmq_elems[0] elements (rows x cols) at
                         * 17-32 and mmq_elems[1] above (0: never; LLM_CUDA_MMQ_MIN forces min, 64
                         * and any weight) */
    int mmq_max, mmq_max_q6;
    int64_t mmq_q6_rows;
    int mmq_rows;
    int64_t mmq_elems[2];
    int l2_ahead;       /* attention_gqa.cu's steps and matmul_mmq.cu's chunks asked of L2 this far
                         * ahead of their loads (0: never; LLM_CUDA_L2_AHEAD) */
    int mmq_depth;      /* matmul_mmq.cu: Q4_K/Q5_K chunks at 3-8 tokens loaded this many ahead
                         * (2, default; LLM_CUDA_MMQ_DEPTH=1: one, to compare) */
    int mmq_tiles;      /* matmul_mmq.cu: most tiles of 8 tokens a warp (4; LLM_CUDA_MMQ_TILES) */
    int mmq_tile;       /* matmul_mmq.cu: fewest tokens of Q4_K on its 32 x 32 warp tiles, sm_80+ (33; 0:
                         * never; LLM_CUDA_MMQ_TILE) */
    int64_t mmq_tile_rows; /* and the fewest rows of a launch there (16384; 0 where LLM_CUDA_MMQ_MIN forces) */
    int mmq_tile_sparse;   /* and the fewest tokens where its last wave of blocks is under half full (49; 0
                            * where LLM_CUDA_MMQ_MIN forces: cuda_mmq_tile_takes) */
    int mr;             /* matmul_mr.cu for K-quant weights at 3-16 tokens, Q8_0 at 4-8 (matmul.cu has the
                         * crossover), default; LLM_CUDA_MR=0: the dp4a kernel and mq */
    int mr_mixed;       /* and a Q4_K/Q5_K q and k with a Q6_K v in one launch (1; LLM_CUDA_MR_MIXED) */
    int att_splits;     /* decode attention: the splits a row wants; 0: the waves weighed (default),
                         * -1: the fewest that fill one wave (LLM_CUDA_ATT_SPLITS) */
    int dequant_ahead;  /* prefill: quantized weights' F16 tiles made ahead on a side stream
                         * (dequant_ahead.cu; default; LLM_CUDA_DEQUANT_AHEAD=0: off) */
    int ahead_sms;      /* multiprocessors a GEMM leaves to the tile made ahead of the next
                         * (n_sms / 8, default; LLM_CUDA_AHEAD_SMS=k) */
    struct cuda_ahead *ahead; /* dequant_ahead.cu's side stream and tiles, made on first use */
    const float *act_x;
    int32_t act_n;
    int64_t act_cols;
    int act_kind;
    void *act_scratch;
    /* A second kept form: a norm's output as matmul_mmq.cu's Q8K8
     * (rmsnorm.cu), at the top of the scratch from actq_lo, beside its F16
     * form at the start, so that a matmul_mmq.cu group (q and k; gate and
     * up) and a weight on another kernel (v) on the same input each find
     * theirs.  Forgotten with the other, and when a scratch user asks for
     * bytes past actq_lo.  mmq_seen: matmul_mmq.cu has run, so the norms
     * make it. */
    const float *actq_x;
    int32_t actq_n;
    int64_t actq_cols;
    int actq_kind;
    size_t actq_lo;
    int mmq_seen;
    char *err;          /* where failures are described (the backend's errstr) */
    size_t errlen;
    char device_name[96];
};

/* Q8S: the int8 form with matmul_gemv.cu's per-half sums (xs) too; Q8K:
 * matmul_mmq.cu's int8 form, a scale per 256 columns, in Q6_K's fragment
 * order; Q8K8: the same in Q4_K's and Q5_K's. */
enum {
    MATMUL_ACT_NONE = 0,
    MATMUL_ACT_F16 = 1,
    MATMUL_ACT_Q8 = 2,
    MATMUL_ACT_Q8S = 3,
    MATMUL_ACT_Q8K = 4,
    MATMUL_ACT_Q8K8 = 5
};

/* 1 if the scratch at `scratch` still holds x (n x cols) as kind, else 0;
 * then records that it will (the caller fills it). */
static inline int cuda_act_reuse(struct cuda_ctx *ctx, int kind, const float *x, int32_t n, int64_t cols,
                                 void *scratch) {
    if (ctx->act_kind == kind && ctx->act_x == x && ctx->act_n == n && ctx->act_cols == cols &&
        ctx->act_scratch == scratch)
        return 1;
    ctx->act_kind = kind;
    ctx->act_x = x;
    ctx->act_n = n;
    ctx->act_cols = cols;
    ctx->act_scratch = scratch;
    return 0;
}
static inline void cuda_act_forget(struct cuda_ctx *ctx) {
    ctx->act_kind = MATMUL_ACT_NONE;
    ctx->actq_kind = MATMUL_ACT_NONE;
}
/* Where in the scratch x (n x cols) is kept as kind (its start, or where
 * the op that made the form put it), else NULL; nothing recorded. */
static inline const void *cuda_act_kept(const struct cuda_ctx *ctx, int kind, const float *x, int32_t n,
                                        int64_t cols) {
    return ctx->act_kind == kind && ctx->act_x == x && ctx->act_n == n && ctx->act_cols == cols ? ctx->act_scratch
                                                                                                 : NULL;
}

/* The second kept form (actq_*): where x (n x cols) is kept as kind, else
 * NULL. */
static inline void *cuda_actq_kept(const struct cuda_ctx *ctx, int kind, const float *x, int32_t n, int64_t cols) {
    return ctx->actq_kind == kind && ctx->actq_x == x && ctx->actq_n == n && ctx->actq_cols == cols
               ? (uint8_t *)ctx->scratch + ctx->actq_lo
               : NULL;
}

/* matmul_mmq.cu's Q8K form of n tokens of cols (a multiple of 256): the
 * codes xq, a scale per 256 columns xd and a 16-bit sum per 32 codes xb,
 * each part 256-byte aligned from base; the bytes of all three. */
static inline size_t cuda_q8k_align(size_t b) { return (b + 255) & ~(size_t)255; }
static inline size_t cuda_q8k_bytes(int32_t n, int64_t cols) {
    const size_t blocks = (size_t)n * (size_t)(cols / 256);
    return cuda_q8k_align(blocks * 256) + cuda_q8k_align(blocks * 4) + cuda_q8k_align(blocks * 16);
}
static inline void cuda_q8k_parts(void *base, int32_t n, int64_t cols, int8_t **xq, float **xd, int16_t **xb) {
    const size_t blocks = (size_t)n * (size_t)(cols / 256);
    uint8_t *p = (uint8_t *)base;
    *xq = (int8_t *)p;
    *xd = (float *)(p + cuda_q8k_align(blocks * 256));
    *xb = (int16_t *)(p + cuda_q8k_align(blocks * 256) + cuda_q8k_align(blocks * 4));
}

/* Record a failure in ctx->err and return code. */
int cuda_fail(struct cuda_ctx *ctx, int code, const char *fmt, ...) __attribute__((format(printf, 3, 4)));

/* ---- device.cu: context, memory, transfers ---- */
/* Returns 0 and a new context in *out, STATUS_UNAVAILABLE when there is no
 * such GPU (message in err), STATUS_INTERNAL when CUDA fails.  ctx->err
 * points at err until the caller points it elsewhere. */
int cuda_ctx_init(struct cuda_ctx **out, int device, char *err, size_t errlen);
void cuda_ctx_free(struct cuda_ctx *ctx);
/* Device memory; NULL (with ctx->err saying how much) when it cannot be had. */
void *cuda_malloc(struct cuda_ctx *ctx, size_t bytes);
void cuda_free(struct cuda_ctx *ctx, void *p);
int cuda_mem_info(struct cuda_ctx *ctx, size_t *bytes_free, size_t *bytes_total);
int cuda_upload(struct cuda_ctx *ctx, void *dst, const void *src, size_t bytes);   /* async */
int cuda_download(struct cuda_ctx *ctx, void *dst, const void *src, size_t bytes); /* waits */
int cuda_copy(struct cuda_ctx *ctx, void *dst, const void *src, size_t bytes);     /* async */
int cuda_sync(struct cuda_ctx *ctx);
/* Scratch of at least bytes, valid until the next call; grows (after a
 * stream synchronize) only when a larger size is first asked for. */
void *cuda_scratch(struct cuda_ctx *ctx, size_t bytes);
/* Copy a weight of rows x cols elements of type from host memory into new
 * device memory (*dst, freed with cuda_free).  BF16 is stored as F16 (T4
 * has no BF16 arithmetic; values beyond the F16 range saturate), Q8_0 and
 * Q6_K rows regrouped into the backend's aligned layout (common.cuh), every
 * other type as is; *stored says which type.  Synchronizes before returning. */
int cuda_weight_upload(struct cuda_ctx *ctx, void **dst, enum dtype *stored, enum dtype type,
                       const void *host, int64_t rows, int64_t cols);

/* ---- Ops: shapes as in kernels/backend.h; every pointer is device memory ---- */
int cuda_embed(struct cuda_ctx *ctx, float *out, const void *w, enum dtype type, int64_t rows,
               int64_t cols, const int32_t *ids, int32_t n);
int cuda_rmsnorm(struct cuda_ctx *ctx, float *out, const float *x, const float *w, int32_t n,
                 int32_t dim, float eps);
int cuda_add_rmsnorm(struct cuda_ctx *ctx, float *x, const float *delta, float *out, const float *w,
                     int32_t n, int32_t dim, float eps);
int cuda_add(struct cuda_ctx *ctx, float *x, const float *y, int64_t n);
int cuda_swiglu(struct cuda_ctx *ctx, float *out, const float *gate, const float *up, int64_t n);
int cuda_get_rows(struct cuda_ctx *ctx, float *out, const float *x, const int32_t *idx, int32_t n,
                  int32_t dim);
int cuda_rope(struct cuda_ctx *ctx, float *x, const int32_t *pos, int32_t n, int32_t n_heads,
              int32_t head_dim, const float *inv_freq, int32_t n_freq, int neox);
/* dst[rows] (rows of cuda_row_bytes, Q8_0 or Q6_K, the regrouped layout of
 * common.cuh) = src[rows] (GGUF blocks, device memory). */
int cuda_repack(struct cuda_ctx *ctx, void *dst, const void *src, enum dtype type, int64_t rows, int64_t cols);
/* F32, F16 and BF16 in any direction (BF16 to F16 saturates). */
int cuda_convert(struct cuda_ctx *ctx, void *dst, enum dtype dst_type, const void *src,
                 enum dtype src_type, int64_t n);
/* dst[rows, cols] (F16) = the weight rows r0 .. r0 + rows of w, any type. */
int cuda_dequant_f16(struct cuda_ctx *ctx, uint16_t *dst, const void *w, enum dtype type,
                     int64_t r0, int64_t rows, int64_t cols);
/* Rows of a dequantized F16 tile of at most tile_bytes of a weight
 * [rows, cols] (a multiple of 64, at least 64, at most rows). */
static inline int64_t cuda_tile_rows(size_t tile_bytes, int64_t rows, int64_t cols) {
    int64_t t = (int64_t)(tile_bytes / ((size_t)cols * 2)) / 64 * 64;
    if (t < 64) t = 64;
    return t < rows ? t : rows;
}
/* ---- dequant_ahead.cu: prefill tiles made on a side stream ahead of
 * their matmul ---- */
/* The F16 tile of w's rows r0 .. r0 + m for the GEMM the caller queues
 * next on ctx->stream, in *tile: made ahead (the stream waits for it) or
 * now.  *tile = NULL (and 0) where the path is off (a graph being
 * recorded, LLM_CUDA_DEQUANT_AHEAD=0) or its buffers cannot be had: the
 * caller makes the tile in its scratch. */
int cuda_ahead_tile(struct cuda_ctx *ctx, const void *w, enum dtype type, int64_t rows, int64_t cols,
                    int64_t r0, int64_t m, const uint16_t **tile, int *slot);
/* After the GEMM reading slot's tile was queued (or failed): orders the
 * tile's next writer after it, and starts the next tile ahead of tiles
 * of tile_bytes (0: none). */
void cuda_ahead_queued(struct cuda_ctx *ctx, int slot, size_t tile_bytes);
/* Device memory was freed or weights uploaded: nothing made ahead or
 * learned stays.  cuda_ahead_written: bytes at dst were written, and a
 * tile of a weight there is dropped. */
void cuda_ahead_forget(struct cuda_ctx *ctx);
void cuda_ahead_written(struct cuda_ctx *ctx, const void *dst, size_t bytes);
void cuda_ahead_free(struct cuda_ctx *ctx);
/* out[n, rows] = x[n, cols] . w^T.  Up to ctx->vec_max_* tokens the
 * weight-reading kernels of matmul_vec.cu (weights read once per call, in
 * their stored form) for the shapes cuda_matmul_vec_supports; otherwise
 * cuBLAS on F16 tiles. */
int cuda_matmul(struct cuda_ctx *ctx, float *out, const void *w, enum dtype type, int64_t rows,
                int64_t cols, const float *x, int32_t n);
/* Where the cuBLAS path wants x[n, cols] as F16 (the start of the
 * scratch); records that the scratch will hold that form of x (act_*).
 * *fresh = 0 when it already does, else the caller fills it: an op that
 * produces x and writes its F16 form alongside (rmsnorm and swiglu at
 * prefill sizes) saves the matmul a conversion pass over x. */
int cuda_gemm_act(struct cuda_ctx *ctx, const float *x, int32_t n, int64_t cols, uint16_t **x16, int *fresh);
/* The same, and x converted there unless it already is: *x16 holds x as
 * F16 when it returns 0 (the tensor-core kernels' activations). */
int cuda_gemm_act_f16(struct cuda_ctx *ctx, const float *x, int32_t n, int64_t cols, uint16_t **x16);
/* out[rows, width] = silu(gate) * up, also written as F16 for the matmul
 * that reads out next (cuda_gemm_act). */
int cuda_swiglu_act(struct cuda_ctx *ctx, float *out, const float *gate, const float *up, int32_t rows,
                    int64_t width);
#define CUDA_MATMUL_VEC_MAX 64
/* 1 if the weight-reading kernels take this type, width and token count on
 * ctx's device: F16 and the quantized types on tensor cores up to 64 tokens
 * (ctx->mq_nt_max) for widths a multiple of 32 (256 for the K-quants); any
 * type up to 16 tokens one warp per row otherwise. */
int cuda_matmul_vec_supports(const struct cuda_ctx *ctx, enum dtype type, int64_t cols, int32_t n);
int cuda_matmul_vec(struct cuda_ctx *ctx, float *out, const void *w, enum dtype type, int64_t rows,
                    int64_t cols, const float *x, int32_t n);
/* ---- matmul_gemv.cu: 1..CUDA_MATMUL_GEMV_MAX tokens on quantized weights,
 * a warp per row, activations quantized to int8 per 32 in scratch ---- */
#define CUDA_MATMUL_GEMV_MAX 4
/* 1 if matmul_gemv takes this type, width and token count: Q8_0 and Q4_0
 * for widths a multiple of 32, Q4_K, Q5_K and Q6_K a multiple of 256. */
int cuda_matmul_gemv_supports(enum dtype type, int64_t cols, int32_t n);
/* out[n, rows] = x[n, cols] . w^T; w 16-byte aligned. */
int cuda_matmul_gemv(struct cuda_ctx *ctx, float *out, const void *w, enum dtype type, int64_t rows,
                     int64_t cols, const float *x, int32_t n);
/* Where the kernel before a gemv matmul (the norms) writes x[n, cols]'s
 * int8 form itself, with the sums (cols a multiple of 64, n at most
 * CUDA_MATMUL_GEMV_MAX): the scratch places of xq, xd and xs as
 * matmul_gemv.cu lays them out, recorded as that form of x for the next
 * matmul.  The caller writes them (bit for bit as gemv_quant_x_kernel
 * would) or forgets them on failure. */
int cuda_gemv_act_q8s(struct cuda_ctx *ctx, const float *x, int32_t n, int64_t cols, int8_t **xq, float **xd,
                      float **xs);
/* Bytes of that form at the start of the scratch (a caller that needs
 * scratch of its own beside it takes it past these). */
size_t cuda_gemv_act_bytes(int32_t n, int64_t cols);
/* ---- matmul_mr.cu: up to 16 tokens on Q4_K, Q5_K, Q6_K (8 on Q8_0), tensor
 * cores fed straight from global memory ---- */
/* 1 if it takes this type, width (a multiple of 256) and token count. */
int cuda_matmul_mr_supports(const struct cuda_ctx *ctx, enum dtype type, int64_t cols, int32_t n);
/* out[n, rows] = x[n, cols] . w^T; CUDA_NOT_FUSED where it does not take
 * the case (w and x 16-byte aligned). */
int cuda_matmul_mr(struct cuda_ctx *ctx, float *out, const void *w, enum dtype type, int64_t rows, int64_t cols,
                   const float *x, int32_t n);
/* ---- matmul_mmq.cu: Q4_K, Q5_K, Q6_K on int8 tensor cores, from
 * ctx->mmq_min to 64 tokens ---- */
/* 1 if it takes this type, width (a multiple of 256) and token count. */
int cuda_matmul_mmq_takes(const struct cuda_ctx *ctx, enum dtype type, int64_t cols, int32_t n);
/* What a fused op returns for a case it leaves to the plain ops (the
 * backend's BACKEND_NOT_FUSED). */
#define CUDA_NOT_FUSED 1
/* Several weights of one type and width on one input x[n, cols], in one
 * launch where the decode kernels take them (and, above 64 tokens, F16
 * weights of equal rows in one batched cuBLAS call): outs[j][n, rows[j]] =
 * x . ws[j]^T for j < n_w (at most 4).  With swiglu (n_w = 2, equal rows)
 * outs[0] = silu(x . ws[0]^T) * (x . ws[1]^T) and outs[1] is not written.
 * CUDA_NOT_FUSED when the shape or type is not one it takes. */
int cuda_matmul_group(struct cuda_ctx *ctx, int n_w, float *const outs[], const void *const ws[],
                      const int64_t rows[], enum dtype type, int64_t cols, const float *x, int32_t n,
                      int swiglu);
/* The same for weights of two types, the first type's weights first (q and
 * k Q4_K or Q5_K with v Q6_K, as the K-quant "_M" files mix them): one
 * launch of the 1-4 token kernel where it takes both (matmul_gemv.cu),
 * else CUDA_NOT_FUSED (then the caller groups by type). */
int cuda_matmul_group_mixed(struct cuda_ctx *ctx, int n_w, float *const outs[], const void *const ws[],
                            const int64_t rows[], const enum dtype types[], int64_t cols, const float *x,
                            int32_t n);
/* 1 if one matmul_gemv launch takes weights of type, then of type1. */
int cuda_matmul_gemv_pair(enum dtype type, enum dtype type1);
/* kv_k, kv_v: [n_blocks][n_kv_heads][block_size][head_dim] of kv_type. */
int cuda_kv_write(struct cuda_ctx *ctx, void *kv_k, void *kv_v, enum dtype kv_type, int32_t n_blocks,
                  int32_t block_size, int32_t n_kv_heads, int32_t head_dim, const float *k,
                  const float *v, const int32_t *slots, int32_t n);

/* rope.cu: cuda_rope of q (n_heads) and of k (n_kv_heads), then
 * cuda_kv_write of the rotated k and of v, in one launch. */
int cuda_rope_kv_write(struct cuda_ctx *ctx, float *q, float *k, const float *v, void *kv_k, void *kv_v,
                       enum dtype kv_type, int32_t n_blocks, int32_t block_size, int32_t n_kv_heads,
                       int32_t head_dim, const int32_t *pos, const int32_t *slots, int32_t n,
                       int32_t n_heads, const float *inv_freq, int32_t n_freq, int neox);

/* ---- sample.cu: backend_sample on the device (kernels/backend.h) ---- */
struct backend_sample_row;
/* 0 with every row's result filled, CUDA_NOT_FUSED for a request it leaves
 * to the host sampler, or a negative status.  Waits for the stream. */
int cuda_sample(struct cuda_ctx *ctx, const float *logits, int32_t n_vocab, struct backend_sample_row *rows,
                int32_t n_rows);

/* The attention batch of kernels/backend.h, restated for the .cu side. */
struct cuda_attn_args {
    float *out;                  /* (n_tokens, n_heads * head_dim) */
    const float *q;              /* (n_tokens, n_heads * head_dim) */
    const void *k, *v;           /* the paged cache, as for cuda_kv_write */
    enum dtype kv_type;
    int32_t n_blocks, block_size, n_kv_heads, head_dim, n_heads;
    int32_t n_seqs, n_tokens, max_blocks, max_ctx;
    const int32_t *seq_tok0;     /* (n_seqs + 1) */
    const int32_t *seq_pos0;     /* (n_seqs) */
    const int32_t *block_tables; /* (n_seqs, max_blocks) */
    float scale;
    int32_t rows;                /* enum cuda_att_rows: the sequences this launch serves */
};
/* A batch mixing decode and prefill rows runs as two launches over the one
 * batch (cuda_attention): its one-row sequences on the decode kernels, as
 * a decode-only step would, and the others on the tensor-core prefill
 * kernel, so that no decode row takes a prefill tile of 64 query rows.
 * Each launch skips the other's sequences on the device (the batch's
 * layout is device memory), and writes out and its F16 form for its own
 * rows only. */
enum cuda_att_rows {
    CUDA_ATT_ALL = 0,  /* every sequence (zero: the callers' default) */
    CUDA_ATT_ONE_ROW,  /* sequences of one row */
    CUDA_ATT_MULTI_ROW /* sequences of several rows */
};
int cuda_attention(struct cuda_ctx *ctx, const struct cuda_attn_args *a);
/* attention_q8.cu: decode-only batches on the 8-bit cache, and the
 * one-row sequences of a mixed one (CUDA_ATT_ONE_ROW).  _takes is 1 when
 * every sequence has one row (or a->rows says to take those alone), the
 * cache is Q8_0, heads are 64, 128 or 256 wide, groups of 1, 2, 4 or 8
 * query heads, block_size a power of two of at least 4, and q and the
 * cache 16-byte aligned; cuda_attention then
 * routes the batch to cuda_attention_q8_decode (STATUS_UNSUPPORTED for a
 * batch _takes refuses). */
int cuda_attention_q8_decode_takes(const struct cuda_attn_args *a);
int cuda_attention_q8_decode(struct cuda_ctx *ctx, const struct cuda_attn_args *a);

/* attention_gqa.cu: decode rows (every sequence one row, or the one-row
 * sequences of a mixed batch: CUDA_ATT_ONE_ROW) of 2-16 query heads per KV
 * head on tensor cores, F16 cache, heads of 64 or 128; _takes is 1 for
 * such a batch when ctx->att_gqa_min allows its group (0: never), else
 * cuda_attention_gqa refuses it (STATUS_UNSUPPORTED). */
int cuda_attention_gqa_takes(const struct cuda_ctx *ctx, const struct cuda_attn_args *a);
int cuda_attention_gqa(struct cuda_ctx *ctx, const struct cuda_attn_args *a);

/* ---- rope_attention.cu: backend_rope_kv_attention for decode rows ---- */
/* Counters of ctx->att_sync (one a row and query head; the kernel leaves
 * them at 0). */
#define CUDA_ATT_SYNC_WORDS 1024
/* a->q, k, v: the rows' q, k and v as the matmuls left them (unrotated);
 * rotates row t at pos[t] in registers (q and k stay as given), writes k
 * and v at slots[t] of the F16 cache and a->out = attention of the rows.
 * CUDA_NOT_FUSED unless every sequence has one row and there are at most
 * ctx->rope_att rows (ctx->rope_att_mha without groups), an F16 cache,
 * heads of 64 or 128 and 16-byte aligned buffers. */
int cuda_rope_attention(struct cuda_ctx *ctx, const struct cuda_attn_args *a, const float *k, const float *v,
                        const int32_t *pos, const int32_t *slots, const float *inv_freq, int32_t n_freq, int neox);

/* attention_prefill.cu: backend_rope_kv_attention on the tensor-core
 * attention for steps whose every sequence has rows_min .. rows_max rows,
 * 2 <= rows_min, rows_max <= ctx->rope_tc (speculation's verifying steps):
 * rotates q (left unrotated) and each sequence's new k in registers,
 * writes k and v to the F16 cache at slots, and a->out = attention of the
 * rows.  CUDA_NOT_FUSED unless the tensor-core kernel takes the batch
 * (cuda_attention_prefill_takes) on an F16 cache, every dim is rotated
 * (2 * n_freq == head_dim) and k and v are 16-byte aligned. */
int cuda_attention_prefill_rope(struct cuda_ctx *ctx, const struct cuda_attn_args *a, const float *k, const float *v,
                                const int32_t *slots, const float *inv_freq, int32_t n_freq, int neox,
                                int32_t rows_min, int32_t rows_max);
/* attention_gqa.cu: the same on the grouped-heads decode kernel, a
 * sequence's rows times the G heads of a KV head as the mma's rows (any
 * G), tried first.  CUDA_NOT_FUSED unless ctx->rope_gqa, 2 <= rows_min,
 * rows_max <= ctx->rope_tc, rows_max x G <= 16, an F16 cache, heads of 64
 * or 128, every dim rotated and 16-byte aligned q, k, v and cache. */
int cuda_attention_gqa_rope(struct cuda_ctx *ctx, const struct cuda_attn_args *a, const float *k, const float *v,
                            const int32_t *slots, const float *inv_freq, int32_t n_freq, int neox, int32_t rows_min,
                            int32_t rows_max);

/* ---- graph.cu: CUDA graphs of the stream, page-locked host memory ---- */
struct cuda_graph; /* an instantiated graph and the scratch it was recorded with */
/* Page-locked host memory (cudaHostAlloc); NULL with ctx->err on failure. */
void *cuda_host_alloc(struct cuda_ctx *ctx, size_t bytes);
void cuda_host_free(struct cuda_ctx *ctx, void *p);
/* Gives cuBLAS a workspace of its own (cublasSetWorkspace), so a recorded
 * GEMM never allocates; ws NULL restores cuBLAS's default. */
int cuda_cublas_workspace(struct cuda_ctx *ctx, void *ws, size_t bytes);
/* Starts recording ctx->stream (this thread's calls only). */
int cuda_graph_begin(struct cuda_ctx *ctx);
/* Stops recording and instantiates; *out NULL on failure. */
int cuda_graph_end(struct cuda_ctx *ctx, struct cuda_graph **out);
/* STATUS_UNAVAILABLE when ctx->scratch is no longer the buffer recorded. */
int cuda_graph_launch(struct cuda_ctx *ctx, struct cuda_graph *g);
void cuda_graph_free(struct cuda_ctx *ctx, struct cuda_graph *g);

#ifdef __cplusplus
}
#endif

#endif
