/* Matrix multiplication out[n, rows] = x[n, cols] . w^T for every weight
 * type.  Up to ctx->vec_max_quant / vec_max_float tokens (decode batches)
 * it is the weight-reading kernels of matmul_vec.cu, which read the weight
 * once in its stored form, and at 1-4 tokens on most quantized types the
 * warp-per-row dp4a kernel of matmul_gemv.cu.  Above (prefill), cuBLAS
 * does the work on tensor cores: activations become F16, F16 weights are
 * used as they are, quantized weights are dequantized tile by tile into
 * scratch (never a second full copy), F32 accumulation throughout.  F32
 * weights go through cublasSgemm. */
#include "common.cuh"
#include "knobs.h"
#include "matmul_group.cuh"

/* Most tokens for F32 weights on the warp-per-row kernel: it beat cuBLAS
 * up to 2 tokens for F16 weights on an H100, and F32 weights (tests, tiny
 * models) are not worth a measurement of their own. */
#define MATMUL_F32_VEC_MAX 2

static size_t align256(size_t n) { return (n + 255) & ~(size_t)255; }

/* Bytes of one dequantized F16 weight tile (reused scratch, never a second
 * full copy of the weights): LLM_CUDA_DEQUANT_TILE_MB, 96 MiB by default
 * (knobs.c).  At prefill sizes the tile's row count is cuBLAS's
 * parallelism: 512 tokens x 2048 rows (a 16 MiB tile of a 4096 wide
 * weight) is about 64 output tiles of 128 x 128 for 132 SMs, so small tiles
 * leave the GPU half idle.  96 MiB holds a whole 11008 x 4096 matrix (86
 * MiB); lm_head (250 MiB) takes 3 tiles.  Read on every call, so that a
 * benchmark or a test can compare sizes on one backend. */
static int matmul_tile_bytes(struct cuda_ctx *ctx, size_t *bytes) {
    struct cuda_knobs k;
    int rc = cuda_knobs_read_one(&k, "LLM_CUDA_DEQUANT_TILE_MB", ctx->err, ctx->errlen);
    if (rc != STATUS_OK) return rc;
    *bytes = (size_t)k.dequant_tile_mb << 20;
    return STATUS_OK;
}

/* out[:, r0 .. r0 + m) = x16 . w16^T for a tile w16 [m, cols] (F16). */
static int matmul_gemm_f16(struct cuda_ctx *ctx, float *out, const void *w16, int64_t r0, int64_t m, int64_t rows,
                           int64_t cols, const void *x16, int32_t n) {
    const float one = 1.0f, zero = 0.0f;
    /* Column-major view: C (rows x n, ld rows) = W^T' (m x cols) . X (cols x n). */
    CUDA_CHECK(ctx, cublasGemmEx((cublasHandle_t)ctx->cublas, CUBLAS_OP_T, CUBLAS_OP_N, (int)m, n, (int)cols, &one,
                                 w16, CUDA_R_16F, (int)cols, x16, CUDA_R_16F, (int)cols, &zero, out + r0, CUDA_R_32F,
                                 (int)rows, CUBLAS_COMPUTE_32F, CUBLAS_GEMM_DEFAULT));
    return STATUS_OK;
}

extern "C" int cuda_gemm_act(struct cuda_ctx *ctx, const float *x, int32_t n, int64_t cols, uint16_t **x16,
                              int *fresh) {
    uint8_t *scratch = (uint8_t *)cuda_scratch(ctx, align256((size_t)n * cols * 2));
    if (!scratch) return STATUS_NO_MEMORY;
    *x16 = (uint16_t *)scratch;
    *fresh = !cuda_act_reuse(ctx, MATMUL_ACT_F16, x, n, cols, scratch);
    return STATUS_OK;
}

extern "C" int cuda_gemm_act_f16(struct cuda_ctx *ctx, const float *x, int32_t n, int64_t cols, uint16_t **x16) {
    int fresh = 0;
    int rc = cuda_gemm_act(ctx, x, n, cols, x16, &fresh);
    if (rc == STATUS_OK && fresh) rc = cuda_convert(ctx, *x16, DTYPE_F16, x, DTYPE_F32, (int64_t)n * cols);
    if (rc != STATUS_OK) cuda_act_forget(ctx);
    return rc;
}

static int matmul_gemm(struct cuda_ctx *ctx, float *out, const void *w, enum dtype type, int64_t rows, int64_t cols,
                       const float *x, int32_t n) {
    if (type == DTYPE_F32) {
        const float one = 1.0f, zero = 0.0f;
        CUDA_CHECK(ctx, cublasSgemm((cublasHandle_t)ctx->cublas, CUBLAS_OP_T, CUBLAS_OP_N, (int)rows, n, (int)cols,
                                    &one, (const float *)w, (int)cols, x, (int)cols, &zero, out, (int)rows));
        return STATUS_OK;
    }
    size_t x_bytes = align256((size_t)n * cols * 2);
    size_t tile_bytes = 0;
    int rc = matmul_tile_bytes(ctx, &tile_bytes);
    if (rc != STATUS_OK) return rc;
    int64_t tile_rows = type == DTYPE_F16 ? 0 : cuda_tile_rows(tile_bytes, rows, cols);
    /* Quantized weights: tiles made ahead on the side stream
     * (dequant_ahead.cu), else in the scratch.  The scratch keeps room for
     * a tile either way: a graph recorded later at this size takes the
     * scratch tile, and a recording must not allocate. */
    const uint16_t *first = NULL;
    int slot = 0;
    if (tile_rows) rc = cuda_ahead_tile(ctx, w, type, rows, cols, 0, tile_rows, &first, &slot);
    if (rc != STATUS_OK) return rc;
    uint8_t *scratch = (uint8_t *)cuda_scratch(ctx, x_bytes + (size_t)tile_rows * cols * 2);
    if (!scratch) {
        if (first) cuda_ahead_queued(ctx, slot, 0);
        return STATUS_NO_MEMORY;
    }
    uint16_t *x16 = (uint16_t *)scratch, *w16 = (uint16_t *)(scratch + x_bytes);
    if (!cuda_act_reuse(ctx, MATMUL_ACT_F16, x, n, cols, scratch))
        rc = cuda_convert(ctx, x16, DTYPE_F16, x, DTYPE_F32, (int64_t)n * cols);
    if (rc != STATUS_OK) {
        cuda_act_forget(ctx);
        if (first) cuda_ahead_queued(ctx, slot, 0);
        return rc;
    }
    if (type == DTYPE_F16) return matmul_gemm_f16(ctx, out, w, 0, rows, rows, cols, x16, n);
    for (int64_t r0 = 0; r0 < rows; r0 += tile_rows) {
        int64_t m = rows - r0 < tile_rows ? rows - r0 : tile_rows;
        const uint16_t *t = first;
        if (r0 > 0 && first) rc = cuda_ahead_tile(ctx, w, type, rows, cols, r0, m, &t, &slot);
        if (rc == STATUS_OK && !t && first) /* a later tile is never larger: cannot happen */
            return cuda_fail(ctx, STATUS_INTERNAL, "matmul: no tile buffer for rows %lld", (long long)r0);
        if (rc == STATUS_OK && !t) {
            rc = cuda_dequant_f16(ctx, w16, w, type, r0, m, cols);
            t = w16;
        }
        /* A GEMM after a tile made ahead that would fill every
         * multiprocessor (more output tiles of 128 x 256, cuBLAS's on an
         * H100, than SMs: 7B gate, up, down at 512 tokens) leaves
         * ctx->ahead_sms of them to the next tile's dequantization, which
         * measured faster on the 7B's prefill.  Smaller GEMMs leave SMs
         * idle anyway, and capping them made TinyLlama's prefill slower. */
        const bool spare = t != w16 && ctx->ahead_sms > 0 && ctx->ahead_sms < ctx->n_sms &&
                           (m + 127) / 128 * ((n + 255) / 256) > ctx->n_sms;
        /* (A failure to set it only leaves the GEMM every multiprocessor.) */
        if (spare) cublasSetSmCountTarget((cublasHandle_t)ctx->cublas, ctx->n_sms - ctx->ahead_sms);
        if (rc == STATUS_OK) rc = matmul_gemm_f16(ctx, out, t, r0, m, rows, cols, x16, n);
        if (spare) cublasSetSmCountTarget((cublasHandle_t)ctx->cublas, 0);
        /* Even after a failure: orders the tile's next writer after its readers. */
        if (t != w16) cuda_ahead_queued(ctx, slot, rc == STATUS_OK ? tile_bytes : 0);
        if (rc != STATUS_OK) return rc;
    }
    return STATUS_OK;
}

/* Most tokens for the weight-reading kernels.  They read each weight
 * once for all n tokens; up to 64 tokens that beats dequantizing F16 tiles
 * for cuBLAS (which writes and reads back 2 bytes per weight).  F32 weights
 * have no tensor-core path there: one warp per row, whose F32 activation
 * reads grow with n, so only a few tokens.  Measured in docs/cuda-backend.md. */
static int32_t matmul_vec_max(const struct cuda_ctx *ctx, enum dtype type) {
    if (type == DTYPE_F32) return ctx->vec_max_float < MATMUL_F32_VEC_MAX ? ctx->vec_max_float : MATMUL_F32_VEC_MAX;
    return type == DTYPE_F16 ? ctx->vec_max_float : ctx->vec_max_quant;
}

/* The warp-per-row dp4a kernel of matmul_gemv.cu on quantized weights:
 * up to 4 tokens (its widest tile), where it beats mq; but where
 * matmul_mr.cu takes the type, only up to 2 tokens for the K-quants and 3
 * for Q8_0, above which matmul_mr.cu measured faster on an H100 (7B steps,
 * docs/cuda-backend.md).  LLM_CUDA_GEMV_MAX=k sets one limit for all
 * types. */
static int matmul_gemv_takes(const struct cuda_ctx *ctx, enum dtype type, int64_t cols, int32_t n) {
    if (ctx->gemv_max >= 0) return n <= ctx->gemv_max;
    if (!cuda_matmul_mr_supports(ctx, type, cols, n)) return n <= CUDA_MATMUL_GEMV_MAX;
    return n <= (type == DTYPE_Q8_0 ? 3 : 2);
}

/* Kept activations are of an input this call's output must not overlap. */
static void matmul_act_check(struct cuda_ctx *ctx, const float *out, int64_t rows, int32_t n) {
    if (ctx->act_kind != MATMUL_ACT_NONE && out < ctx->act_x + (int64_t)ctx->act_n * ctx->act_cols &&
        ctx->act_x < out + (int64_t)n * rows)
        cuda_act_forget(ctx);
}

extern "C" int cuda_matmul(struct cuda_ctx *ctx, float *out, const void *w, enum dtype type, int64_t rows,
                           int64_t cols, const float *x, int32_t n) {
    if (n < 0 || rows <= 0 || cols <= 0 || rows > INT32_MAX || cols > INT32_MAX)
        return cuda_fail(ctx, STATUS_BAD_INPUT, "matmul: %d tokens x %s [%lld x %lld]", n, dtype_name(type),
                         (long long)rows, (long long)cols);
    if (cuda_row_bytes(type, cols) == 0)
        return cuda_fail(ctx, STATUS_UNSUPPORTED, "matmul: weight type %d is not supported", (int)type);
    if (n == 0) return STATUS_OK;
    int32_t vec_max = matmul_vec_max(ctx, type);
    int gemv = matmul_gemv_takes(ctx, type, cols, n);
    matmul_act_check(ctx, out, rows, n);
    int rc = CUDA_NOT_FUSED;
    if (gemv && n <= vec_max && cuda_matmul_gemv_supports(type, cols, n) && (uintptr_t)w % 16 == 0) {
        rc = cuda_matmul_gemv(ctx, out, w, type, rows, cols, x, n);
    } else if (n <= vec_max) {
        /* matmul_mmq.cu (K-quants from ctx->mmq_min), matmul_mr.cu (K-quants
         * to 16 tokens, Q8_0 to 8), from 17
         * matmul_wide.cu, then mq. */
        struct mm_group g = mg_single(w, out, rows);
        rc = cuda_matmul_mmq(ctx, &g, type, cols, x, n);
        if (rc == CUDA_NOT_FUSED) rc = cuda_matmul_mr(ctx, out, w, type, rows, cols, x, n);
        if (rc == CUDA_NOT_FUSED) rc = cuda_matmul_wide(ctx, &g, type, cols, x, n);
        if (rc == CUDA_NOT_FUSED && cuda_matmul_vec_supports(ctx, type, cols, n) && (uintptr_t)x % 16 == 0 &&
            (uintptr_t)w % 16 == 0)
            rc = cuda_matmul_vec(ctx, out, w, type, rows, cols, x, n); /* keeps or forgets the kept form itself */
    }
    if (rc == CUDA_NOT_FUSED) rc = matmul_gemm(ctx, out, w, type, rows, cols, x, n);
    if (rc != STATUS_OK) cuda_act_forget(ctx);
    return rc;
}

/* Pointer arrays of a batched GEMM, written on the stream (a graph records
 * the kernel with its arguments; a host copy could not be recorded). */
struct gemm_ptrs {
    const void *a[MG_MAX], *b;
    void *c[MG_MAX];
    int n;
};
__global__ void gemm_ptrs_kernel(const gemm_ptrs p, const void **dst) {
    pdl_begin(); /* the batched call before may still read the arrays */
    for (int i = 0; i < p.n; i++) {
        dst[i] = p.a[i];
        dst[MG_MAX + i] = p.b;
        dst[2 * MG_MAX + i] = p.c[i];
    }
}

/* F16 weights of one input with equal row counts at prefill sizes: one
 * batched cuBLAS call instead of one per weight.  A 4096-row weight at
 * 512 tokens is about half a wave of cuBLAS's output tiles on an H100, so
 * q, k and v (gate and up) in one launch fill the machine where three
 * (two) could not.  Quantized weights keep a dequantized tile and a call
 * each: side by side in one tile and one batched call they measured 1-2%
 * slower. */
static int matmul_gemm_group(struct cuda_ctx *ctx, int n_w, float *const outs[], const void *const ws[], int64_t m,
                             int64_t cols, const float *x, int32_t n) {
    const size_t x_bytes = align256((size_t)n * cols * 2);
    uint8_t *scratch = (uint8_t *)cuda_scratch(ctx, x_bytes + 3 * MG_MAX * sizeof(void *));
    if (!scratch) return STATUS_NO_MEMORY;
    uint16_t *x16 = (uint16_t *)scratch;
    const void **ptrs = (const void **)(scratch + x_bytes);
    if (!cuda_act_reuse(ctx, MATMUL_ACT_F16, x, n, cols, scratch)) {
        int rc = cuda_convert(ctx, x16, DTYPE_F16, x, DTYPE_F32, (int64_t)n * cols);
        if (rc != STATUS_OK) return rc;
    }
    gemm_ptrs p = {};
    p.n = n_w;
    p.b = x16;
    for (int j = 0; j < n_w; j++) {
        p.a[j] = ws[j];
        p.c[j] = outs[j];
    }
    CUDA_CHECK(ctx, cuda_launch(ctx, gemm_ptrs_kernel, dim3(1), dim3(1), 0, p, ptrs));
    CUDA_CHECK(ctx, cudaGetLastError());
    const float one = 1.0f, zero = 0.0f;
    /* Column-major view, per weight: C (m x n, ld m) = W^T' (m x cols) . X (cols x n). */
    CUDA_CHECK(ctx, cublasGemmBatchedEx((cublasHandle_t)ctx->cublas, CUBLAS_OP_T, CUBLAS_OP_N, (int)m, n, (int)cols,
                                        &one, ptrs, CUDA_R_16F, (int)cols, ptrs + MG_MAX, CUDA_R_16F, (int)cols, &zero,
                                        (void *const *)(ptrs + 2 * MG_MAX), CUDA_R_32F, (int)m, n_w,
                                        CUBLAS_COMPUTE_32F, CUBLAS_GEMM_DEFAULT));
    return STATUS_OK;
}

/* Where cuda_matmul would take a warp-per-row kernel for every weight
 * (1-4 tokens quantized, 1-2 F16/F32), or matmul_wide.cu's kernel (17-64
 * tokens quantized, no swiglu): there a launch per weight costs as much as
 * several microseconds of reading, and one grid over all of them saves it.
 * At prefill sizes F16 weights of equal rows are one batched cuBLAS call
 * (matmul_gemm_group).  Other batches keep their per-weight kernels
 * (CUDA_NOT_FUSED). */
extern "C" int cuda_matmul_group(struct cuda_ctx *ctx, int n_w, float *const outs[], const void *const ws[],
                                 const int64_t rows[], enum dtype type, int64_t cols, const float *x, int32_t n,
                                 int swiglu) {
    if (n_w < 1 || n_w > MG_MAX || (swiglu && (n_w != 2 || rows[0] != rows[1])) || n < 1 || cols <= 0 ||
        cols > INT32_MAX || cuda_row_bytes(type, cols) == 0)
        return CUDA_NOT_FUSED;
    if (n > matmul_vec_max(ctx, type)) {
        if (swiglu || n_w < 2 || type != DTYPE_F16 || !ctx->gemm_group) return CUDA_NOT_FUSED;
        for (int j = 0; j < n_w; j++) {
            if (rows[j] <= 0 || rows[j] > INT32_MAX) return CUDA_NOT_FUSED;
            matmul_act_check(ctx, outs[j], rows[j], n);
        }
        /* F16: runs of equal row counts (GQA's k and v apart from q)
         * batched, any other weight on its own. */
        int done[MG_MAX] = {0};
        for (int j = 0; j < n_w; j++) {
            if (done[j]) continue;
            float *go[MG_MAX];
            const void *gw[MG_MAX];
            int64_t gr[MG_MAX];
            int g = 0;
            for (int k = j; k < n_w; k++)
                if (!done[k] && rows[k] == rows[j]) {
                    done[k] = 1;
                    go[g] = outs[k];
                    gw[g] = ws[k];
                    gr[g++] = rows[k];
                }
            int rc = g > 1 ? matmul_gemm_group(ctx, g, go, gw, gr[0], cols, x, n)
                           : matmul_gemm(ctx, go[0], gw[0], type, gr[0], cols, x, n);
            if (rc != STATUS_OK) {
                cuda_act_forget(ctx);
                return rc;
            }
        }
        return STATUS_OK;
    }
    struct mm_group g = {};
    for (int j = 0; j < n_w; j++) {
        if (rows[j] <= 0 || rows[j] > INT32_MAX || (uintptr_t)ws[j] % 16 != 0) return CUDA_NOT_FUSED;
        g.w[j] = (const uint8_t *)ws[j];
        g.out[j] = outs[j];
        g.rows[j] = (int)rows[j];
    }
    g.n = n_w;
    g.swiglu = swiglu;
    if (type == DTYPE_F16 || type == DTYPE_F32) {
        int rc = cuda_matmul_vec_group(ctx, &g, type, cols, x, n);
        if (rc == STATUS_OK) cuda_act_forget(ctx); /* as cuda_matmul after matmul_vec */
        return rc;
    }
    int rc;
    if (!matmul_gemv_takes(ctx, type, cols, n) || !cuda_matmul_gemv_supports(type, cols, n)) {
        /* matmul_mr.cu (swiglu too; K-quants to 16 tokens, Q8_0 to 8), from
         * 17 matmul_wide.cu. */
        for (int j = 0; j < (swiglu ? 1 : n_w); j++) matmul_act_check(ctx, outs[j], rows[j], n);
        /* matmul_mmq.cu has no swiglu: where it takes gate and up as a
         * plain group, the caller's plain group runs it and then the
         * swiglu (measured faster than matmul_mr.cu's fused kernel). */
        if (swiglu && cuda_matmul_mmq_group_takes(ctx, &g, type, cols, x, n)) return CUDA_NOT_FUSED;
        rc = cuda_matmul_mmq(ctx, &g, type, cols, x, n);
        if (rc == CUDA_NOT_FUSED) rc = cuda_matmul_mr_group(ctx, &g, type, cols, x, n);
        if (rc == CUDA_NOT_FUSED && !swiglu) rc = cuda_matmul_wide(ctx, &g, type, cols, x, n);
        if (rc < 0) cuda_act_forget(ctx);
        return rc;
    }
    for (int j = 0; j < (swiglu ? 1 : n_w); j++) matmul_act_check(ctx, outs[j], rows[j], n);
    rc = cuda_matmul_gemv_group(ctx, &g, type, cols, x, n);
    if (rc != STATUS_OK) cuda_act_forget(ctx);
    return rc;
}

extern "C" int cuda_matmul_group_mixed(struct cuda_ctx *ctx, int n_w, float *const outs[], const void *const ws[],
                                       const int64_t rows[], const enum dtype types[], int64_t cols, const float *x,
                                       int32_t n) {
    if (n_w < 2 || n_w > MG_MAX || n < 1 || cols <= 0 || cols > INT32_MAX) return CUDA_NOT_FUSED;
    int seg1 = 0;
    while (seg1 < n_w && types[seg1] == types[0]) seg1++;
    if (seg1 == n_w) return CUDA_NOT_FUSED;
    const enum dtype t0 = types[0], t1 = types[seg1];
    const int gemv = matmul_gemv_takes(ctx, t0, cols, n);
    if (gemv != matmul_gemv_takes(ctx, t1, cols, n) || (gemv && !cuda_matmul_gemv_pair(t0, t1))) return CUDA_NOT_FUSED;
    struct mm_group g = {}, g0 = {}, g1 = {};
    for (int j = 0; j < n_w; j++) {
        const enum dtype t = j < seg1 ? t0 : t1;
        if (types[j] != t || rows[j] <= 0 || rows[j] > INT32_MAX || (uintptr_t)ws[j] % 16 != 0 ||
            (gemv && (!cuda_matmul_gemv_supports(t, cols, n) || n > matmul_vec_max(ctx, t))))
            return CUDA_NOT_FUSED;
        g.w[j] = (const uint8_t *)ws[j];
        g.out[j] = outs[j];
        g.rows[j] = (int)rows[j];
        struct mm_group *h = j < seg1 ? &g0 : &g1;
        h->w[h->n] = g.w[j];
        h->out[h->n] = outs[j];
        h->rows[h->n++] = (int)rows[j];
    }
    g.n = n_w;
    /* Past the dp4a kernel's tokens, matmul_mr.cu's mixed launch where
     * matmul_mmq.cu takes neither type's weights (an 8B's q and k, 5120
     * rows, with its Q6_K v of 1024: that v alone filled 64 blocks). */
    if (!gemv && (cuda_matmul_mmq_group_takes(ctx, &g0, t0, cols, x, n) ||
                  cuda_matmul_mmq_group_takes(ctx, &g1, t1, cols, x, n)))
        return CUDA_NOT_FUSED;
    for (int j = 0; j < n_w; j++) matmul_act_check(ctx, outs[j], rows[j], n);
    int rc = gemv ? cuda_matmul_gemv_group2(ctx, &g, t0, t1, seg1, cols, x, n)
                  : cuda_matmul_mr_group2(ctx, &g, t0, t1, seg1, cols, x, n);
    if (rc != STATUS_OK) cuda_act_forget(ctx);
    return rc;
}
