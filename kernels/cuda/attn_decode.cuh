/* The walk over a row's context that the F16 decode kernels share
 * (attention.cu's decode kernel, rope_attention.cu): a sub-warp of lanes,
 * 8 dims each, loads the K and V rows of U positions at once and folds
 * each position into its online softmax. */
#ifndef KERNELS_CUDA_ATTN_DECODE_CUH
#define KERNELS_CUDA_ATTN_DECODE_CUH

#include "common.cuh"

/* K and V rows (dims 8 li ..) of positions j0 .. j0 + U - 1 of KV head
 * kvh of a sequence's block table: zeros from j_end on, NaN where a block
 * id is outside the cache.  j0 is a multiple of U, so where block_size is
 * too the U positions lie in one cache block: one table lookup and one
 * division for all of them instead of one each. */
template <int HD, int U>
__device__ __forceinline__ void att_kv_rows(const fp16_t *kc, const fp16_t *vc, const int32_t *btab,
                                            int32_t max_blocks, int32_t n_blocks, int32_t block_size,
                                            int32_t n_kv_heads, int kvh, int li, int32_t j0, int32_t j_end,
                                            uint4 (&kr)[U], uint4 (&vr)[U]) {
    const bool one_block = block_size % U == 0;
    int32_t blk0 = 0;
    size_t at0 = 0;
    if (one_block && j0 < j_end) {
        const int32_t bi = j0 / block_size;
        blk0 = bi < max_blocks ? btab[bi] : -1;
        at0 = (((size_t)blk0 * n_kv_heads + kvh) * block_size + j0 % block_size) * HD + 8 * li;
    }
#pragma unroll
    for (int u = 0; u < U; u++) {
        const int32_t j = j0 + u;
        kr[u] = vr[u] = make_uint4(0, 0, 0, 0);
        if (j < j_end) {
            int32_t blk = blk0;
            size_t at = at0 + (size_t)u * HD;
            if (!one_block) {
                const int32_t bi = j / block_size;
                blk = bi < max_blocks ? btab[bi] : -1;
                at = (((size_t)blk * n_kv_heads + kvh) * block_size + j % block_size) * HD + 8 * li;
            }
            if (blk < 0 || blk >= n_blocks) {
                kr[u] = vr[u] = make_uint4(0x7e007e00u, 0x7e007e00u, 0x7e007e00u, 0x7e007e00u); /* NaN */
            } else {
                kr[u] = __ldg((const uint4 *)(kc + at));
                vr[u] = __ldg((const uint4 *)(vc + at));
            }
        }
    }
}

/* Position score d and its V dims vf into the running max m, sum l and
 * acc: acc is rescaled only where the max moved (elsewhere the factor is
 * exactly 1, so skipping it changes no bit).  fmaxf drops a NaN score, so
 * a NaN row still reaches acc through pr. */
__device__ __forceinline__ void att_online_add(float &m, float &l, float (&acc)[8], float d, const float (&vf)[8]) {
    const float mn = fmaxf(m, d), pr = __expf(d - mn);
    if (mn != m) {
        const float alpha = __expf(m - mn);
        l *= alpha;
#pragma unroll
        for (int e = 0; e < 8; e++) acc[e] *= alpha;
        m = mn;
    }
    l += pr;
#pragma unroll
    for (int e = 0; e < 8; e++) acc[e] = fmaf(pr, vf[e], acc[e]);
}

#endif
