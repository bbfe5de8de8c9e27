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

/* The segment and row of this warp (row may be >= rows[seg]: no work). */
template <int WARPS>
__device__ __forceinline__ void mg_locate(const mm_group &g, int warp, int &seg, int &row) {
    if (g.swiglu) {
        seg = warp / (WARPS / 2);
        row = blockIdx.x * (WARPS / 2) + warp % (WARPS / 2);
        return;
    }
    seg = 0;
#pragma unroll
    for (int s = 1; s < MG_MAX; s++)
        if (s < g.n && (int)blockIdx.x >= g.blk0[s]) seg = s;
    row = ((int)blockIdx.x - g.blk0[seg]) * WARPS + warp;
}

/* Stores a warp's sums acc[t] (already reduced over the warp, t < n) for
 * its row: straight to out, or with swiglu through shared memory so that
 * the gate warp and the up warp of one row meet. */
template <int WARPS, int NT>
__device__ __forceinline__ void mg_store(const mm_group &g, int seg, int row, int warp, int lane, int n,
                                         const float (&acc)[NT]) {
    if (!g.swiglu) {
        if (lane == 0 && row < g.rows[seg])
#pragma unroll
            for (int t = 0; t < NT; t++)
                if (t < n) g.out[seg][(size_t)t * g.rows[seg] + row] = acc[t];
        return;
    }
    __shared__ float part[WARPS][NT];
    if (lane == 0)
#pragma unroll
        for (int t = 0; t < NT; t++) part[warp][t] = acc[t];
    __syncthreads();
    const int half = WARPS / 2, i = threadIdx.x;
    if (i < half * NT) {
        int w = i % half, t = i / half, r = blockIdx.x * half + w;
        if (t < n && r < g.rows[0]) {
            float gt = part[w][t], up = part[half + w][t];
            g.out[0][(size_t)t * g.rows[0] + r] = gt / (1.0f + expf(-gt)) * up;
        }
    }
}

/* The kernels' group entries (matmul_gemv.cu, matmul_vec.cu); the
 * layout is filled by them. */
extern "C" int cuda_matmul_gemv_group(struct cuda_ctx *ctx, struct mm_group *g, enum dtype type, int64_t cols,
                                      const float *x, int32_t n);
extern "C" int cuda_matmul_vec_group(struct cuda_ctx *ctx, struct mm_group *g, enum dtype type, int64_t cols,
                                     const float *x, int32_t n);

#endif
