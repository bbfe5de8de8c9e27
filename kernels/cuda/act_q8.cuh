/* The int8 form of activations that matmul_gemv.cu's kernels read: each
 * block of 32 values as int8 codes xq with one scale xd (x ~ xd * xq),
 * and where asked the per-half sums xs (one float4 per 64-element group g
 * and half h: {xd[2g], xd[2g + 1], xd[2g] * sum of block 2g's codes in
 * half h, the same for 2g + 1}).  Shared by the gemv's own quantizing
 * kernel and the kernels that leave their output in this form for it
 * (rmsnorm.cu's norms, rope_attention.cu's attention and merge), so that all
 * give the same bits. */
#ifndef KERNELS_CUDA_ACT_Q8_CUH
#define KERNELS_CUDA_ACT_Q8_CUH

#include "common.cuh"

/* N consecutive values a lane holds, from element e0 of the matrix (a
 * multiple of N; rows a multiple of 64 wide), the 32 / N lanes of each
 * block of 32 being consecutive lanes of the warp; mask: the lanes that
 * call it (whole blocks); a lane with `in` false (past the row, holding
 * zeros) stores nothing.  Every writer of the form calls it, whatever its
 * N, so all give the same bits. */
template <int N>
__device__ __forceinline__ void act_q8_lanes(const float (&v)[N], int64_t e0, unsigned mask, int8_t *__restrict__ xq,
                                             float *__restrict__ xd, float *__restrict__ xs, bool in = true) {
    static_assert(N == 1 || N == 2 || N == 4 || N == 8, "1, 2, 4 or 8 values a lane");
    constexpr int L = 32 / N; /* lanes a block */
    float a = 0.0f;
#pragma unroll
    for (int i = 0; i < N; i++) a = fmaxf(a, fabsf(v[i]));
#pragma unroll
    for (int o = L / 2; o > 0; o >>= 1) a = fmaxf(a, __shfl_xor_sync(mask, a, o));
    const float d = a / 127.0f;
    int s = 0;
    uint32_t w[(N + 3) / 4] = {};
#pragma unroll
    for (int i = 0; i < N; i++) {
        const int q = d > 0.0f ? __float2int_rn(v[i] / d) : 0;
        s += q;
        w[i / 4] |= (uint32_t)(q & 255) << (8 * (i % 4));
    }
    /* The half's sum: its 16 / N lanes. */
    if (xs)
#pragma unroll
        for (int o = 8 / N; o > 0; o >>= 1) s += __shfl_xor_sync(mask, s, o);
    if (!in) return;
    if constexpr (N == 8) *(uint2 *)(xq + e0) = make_uint2(w[0], w[1]);
    else if constexpr (N == 4) *(uint32_t *)(xq + e0) = w[0];
    else if constexpr (N == 2) *(uint16_t *)(xq + e0) = (uint16_t)w[0];
    else xq[e0] = (int8_t)w[0];
    const int64_t b = e0 / 32;
    const int at = (int)(e0 % 32);
    if (at == 0) xd[b] = d;
    if (xs) {
        if (at % 16 == 0) {
            float *e = xs + ((b >> 1) * 2 + (at >> 4)) * 4 + (b & 1);
            e[0] = d;
            e[2] = d * (float)s;
        }
    }
}

/* matmul_mmq.cu's Q8K form (cuda_q8k_parts) of one 256-column chunk of
 * one token, block b of the form (chunk s, token c of n: s * n + c), from
 * src (the chunk's first column): a warp, lane L holding columns 8L .. 8L
 * + 7.  The rounding is the CPU's (kernels/cpu/quant.c, q8_round of x *
 * 127 / amax).  K8: Q4_K's and Q5_K's k order, else Q6_K's (the layouts:
 * matmul_mmq.cu).  Shared by matmul_mmq.cu's own quantizing kernel and the
 * norms that leave the form (rmsnorm.cu), so that both give the same bits. */
template <bool K8>
__device__ __forceinline__ void act_q8k_chunk(const float *__restrict__ src, int lane, size_t b,
                                              int8_t *__restrict__ xq, float *__restrict__ xd,
                                              int16_t *__restrict__ xb) {
    const float4 v0 = ((const float4 *)(src + lane * 8))[0], v1 = ((const float4 *)(src + lane * 8))[1];
    float v[8] = {v0.x, v0.y, v0.z, v0.w, v1.x, v1.y, v1.z, v1.w};
    float amax = 0.0f;
#pragma unroll
    for (int u = 0; u < 8; u++) amax = fmaxf(amax, fabsf(v[u]));
#pragma unroll
    for (int o = 16; o > 0; o >>= 1) amax = fmaxf(amax, __shfl_xor_sync(0xffffffffu, amax, o));
    const float id = amax > 0.0f ? 127.0f / amax : 0.0f;
    int q[8], sum = 0;
#pragma unroll
    for (int u = 0; u < 8; u++) {
        const float f = __fmul_rn(v[u], id);
        q[u] = f >= 0.0f ? (int)(f + 0.5f) : -(int)(0.5f - f);
        sum += q[u];
    }
    sum += __shfl_xor_sync(0xffffffffu, sum, 1);
    sum += __shfl_xor_sync(0xffffffffu, sum, 2);
    const uint32_t lo = (uint32_t)(q[0] & 255) | (uint32_t)(q[1] & 255) << 8 | (uint32_t)(q[2] & 255) << 16 |
                        (uint32_t)(q[3] & 255) << 24,
                   hi = (uint32_t)(q[4] & 255) | (uint32_t)(q[5] & 255) << 8 | (uint32_t)(q[6] & 255) << 16 |
                        (uint32_t)(q[7] & 255) << 24;
    if (K8) {
        /* Columns 8L + u: block j = L / 4, t = L & 3. */
        *(uint2 *)(xq + b * 256 + (lane & 3) * 64 + (lane >> 2) * 8) = make_uint2(lo, hi);
    } else {
        /* Columns 8L + u: m = L / 2, t = 2 (L & 1) + u / 4. */
        uint32_t *dst = (uint32_t *)(xq + b * 256 + (lane & 1) * 128 + (lane >> 1) * 4);
        dst[0] = lo;
        dst[16] = hi;
    }
    if ((lane & 3) == 0) xb[b * 8 + lane / 4] = (int16_t)sum;
    if (lane == 0) xd[b] = amax / 127.0f;
}

#endif
