/* Several weights on one input in one launch, for the warp-per-row kernels
 * of matmul_gemv.cu and matmul_vec.cu: a decode step's q, k and v (or gate
 * and up) become one grid instead of three (or two) small ones, whose
 * start-up and tail each cost as much as a few microseconds of reading.
 * Block b serves segment s (blk0[s] <= b < blk0[s + 1]); with swiglu the two
 * segments (gate, up) share each block, half the warps on each, and the
 * block writes silu(gate) * up. */
#ifndef KERNELS_CUDA_MATMUL_GROUP_CUH
#define KERNELS_CUDA_MATMUL_GROUP_CUH

#include "common.cuh"

#define MG_MAX 4

struct mm_group {
    const uint8_t *w[MG_MAX];
    float *out[MG_MAX];
    int rows[MG_MAX];
    int blk0[MG_MAX + 1]; /* first block of each segment; blk0[n] = the grid */
    int n;
    int swiglu;
};

/* A group of the one weight w [rows] writing out. */
static inline struct mm_group mg_single(const void *w, float *out, int64_t rows) {
    struct mm_group g = {};
    g.w[0] = (const uint8_t *)w;
    g.out[0] = out;
    g.rows[0] = (int)rows;
    g.n = 1;
    return g;
}

/* Fills blk0 for blocks of `warps` warps (one row each) and returns the
 * grid size. */
static inline unsigned mg_layout(struct mm_group *g, int warps) {
    int b = 0;
    if (g->swiglu) {
        g->blk0[0] = 0;
        b = (g->rows[0] + warps / 2 - 1) / (warps / 2);
        g->blk0[1] = g->blk0[2] = b;
        return (unsigned)b;
    }
    for (int s = 0; s < g->n; s++) {
        g->blk0[s] = b;
        b += (g->rows[s] + warps - 1) / warps;
    }
    g->blk0[g->n] = b;
    return (unsigned)b;
}

/* This warp's row: its weight, output and row count, and its row index
 * (row >= rows: no work).  Every field of g is read at a constant index:
 * indexing a kernel parameter with a run-time value makes the compiler
 * copy the whole parameter to local memory in every thread, which at
 * thousands of blocks is tens of MB of extra traffic per launch. */
struct mm_row {
    const uint8_t *w;
    float *out;
    int rows, row;
};

template <int WARPS>
__device__ __forceinline__ mm_row mg_locate(const mm_group &g, int warp) {
    mm_row r;
    if (WARPS >= 2 && g.swiglu) { /* a swiglu block holds both rows of its outputs */
        constexpr int H = WARPS >= 2 ? WARPS / 2 : 1;
        const bool up = warp >= H;
        r.w = up ? g.w[1] : g.w[0];
        r.out = g.out[0];
        r.rows = g.rows[0];
        r.row = blockIdx.x * H + warp % H;
        return r;
    }
    int blk0 = 0;
    r.w = g.w[0];
    r.out = g.out[0];
    r.rows = g.rows[0];
#pragma unroll
    for (int s = 1; s < MG_MAX; s++) {
        if (s < g.n && (int)blockIdx.x >= g.blk0[s]) {
            blk0 = g.blk0[s];
            r.w = g.w[s];
            r.out = g.out[s];
            r.rows = g.rows[s];
        }
    }
    r.row = ((int)blockIdx.x - blk0) * WARPS + warp;
    return r;
}

/* The weight that unit u (a block, a row block: what blk0 counts) belongs
 * to, with its first unit; the tensor-core kernels' form of mg_locate. */
struct mg_seg {
    const uint8_t *w;
    float *out;
    int rows, u0;
};
__device__ __forceinline__ mg_seg mg_seg_locate(const mm_group &g, int u) {
    mg_seg s = {g.w[0], g.out[0], g.rows[0], 0};
#pragma unroll
    for (int k = 1; k < MG_MAX; k++)
        if (k < g.n && u >= g.blk0[k]) s = {g.w[k], g.out[k], g.rows[k], g.blk0[k]};
    return s;
}

/* Stores a warp's sums acc[t] (already reduced over the warp, t < n) for
 * its row: straight to out; with KS > 1 warps per row (each summed part of
 * the row; no swiglu) the first adds the others' through shared memory;
 * with swiglu the gate warp and the up warp of one row meet there.  The
 * row is located again here rather than kept live through the kernel's
 * main loop, where registers are short.  Every thread of the block calls
 * it (a barrier, except with KS = 1 and no swiglu). */
template <int WARPS, int NT, int KS = 1>
__device__ __forceinline__ void mg_store(const mm_group &g, int warp, int lane, int n, const float (&acc)[NT]) {
    const mm_row r = mg_locate<WARPS / KS>(g, warp / KS);
    if (KS == 1 && !g.swiglu) {
        if (lane == 0 && r.row < r.rows)
#pragma unroll
            for (int t = 0; t < NT; t++)
                if (t < n) r.out[(size_t)t * r.rows + r.row] = acc[t];
        return;
    }
    __shared__ float part[WARPS][NT];
    if (lane == 0)
#pragma unroll
        for (int t = 0; t < NT; t++) part[warp][t] = acc[t];
    __syncthreads();
    if (KS > 1) {
        if (warp % KS == 0 && lane == 0 && r.row < r.rows)
#pragma unroll
            for (int t = 0; t < NT; t++) {
                if (t >= n) break;
                float v = 0.0f;
#pragma unroll
                for (int k = 0; k < KS; k++) v += part[warp + k][t];
                r.out[(size_t)t * r.rows + r.row] = v;
            }
        return;
    }
    const int half = WARPS / 2, i = threadIdx.x;
    if (i < half * NT) {
        int w = i % half, t = i / half, row = blockIdx.x * half + w;
        if (t < n && row < r.rows) {
            float gt = part[w][t], up = part[half + w][t];
            r.out[(size_t)t * r.rows + row] = gt / (1.0f + expf(-gt)) * up;
        }
    }
}

/* The kernels' group entries (matmul_gemv.cu, matmul_vec.cu); the
 * layout is filled by them. */
extern "C" int cuda_matmul_gemv_group(struct cuda_ctx *ctx, struct mm_group *g, enum dtype type, int64_t cols,
                                      const float *x, int32_t n);
/* Segments seg1 .. of g of type1 (a cuda_matmul_gemv_pair with type). */
extern "C" int cuda_matmul_gemv_group2(struct cuda_ctx *ctx, struct mm_group *g, enum dtype type, enum dtype type1,
                                       int seg1, int64_t cols, const float *x, int32_t n);
extern "C" int cuda_matmul_vec_group(struct cuda_ctx *ctx, struct mm_group *g, enum dtype type, int64_t cols,
                                     const float *x, int32_t n);

/* matmul_mr.cu: every weight of g (or gate and up with swiglu) at up to 16
 * tokens in one launch, or CUDA_NOT_FUSED where it does not take the
 * type, width or token count. */
extern "C" int cuda_matmul_mr_group(struct cuda_ctx *ctx, struct mm_group *g, enum dtype type, int64_t cols,
                                    const float *x, int32_t n);
/* The same with segments seg1 .. of g Q6_K where the rest are Q4_K or
 * Q5_K, in one launch. */
extern "C" int cuda_matmul_mr_group2(struct cuda_ctx *ctx, struct mm_group *g, enum dtype type, enum dtype type1,
                                     int seg1, int64_t cols, const float *x, int32_t n);

/* matmul_wide.cu: outs[s][n, rows[s]] = x . ws[s]^T for every weight of g
 * (no swiglu) on the pipelined tensor-core kernel, or CUDA_NOT_FUSED where
 * it does not take the type, width, token count or device. */
extern "C" int cuda_matmul_wide(struct cuda_ctx *ctx, struct mm_group *g, enum dtype type, int64_t cols,
                                 const float *x, int32_t n);

/* matmul_mmq.cu: every weight of g (no swiglu) on int8 tensor cores in
 * one launch, or CUDA_NOT_FUSED where it does not take the type, width or
 * token count (cuda_matmul_mmq_takes). */
extern "C" int cuda_matmul_mmq(struct cuda_ctx *ctx, struct mm_group *g, enum dtype type, int64_t cols,
                               const float *x, int32_t n);

/* 1 where cuda_matmul_mmq takes g's weights on x as a plain group (its
 * swiglu flag aside), else 0. */
extern "C" int cuda_matmul_mmq_group_takes(const struct cuda_ctx *ctx, const struct mm_group *g, enum dtype type,
                                           int64_t cols, const float *x, int32_t n);

#endif
