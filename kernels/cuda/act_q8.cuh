/* The int8 form of activations that matmul_gemv.cu's kernels read: each
 * block of 32 values as int8 codes xq with one scale xd (x ~ xd * xq),
 * and where asked the per-half sums xs (one float4 per 64-element group g
 * and half h: {xd[2g], xd[2g + 1], xd[2g] * sum of block 2g's codes in
 * half h, the same for 2g + 1}).  Shared by the gemv's own quantizing
 * kernel and the kernels that leave their output in this form for it
 * (rope_attention.cu's merge), so that both give the same bits. */
#ifndef KERNELS_CUDA_ACT_Q8_CUH
#define KERNELS_CUDA_ACT_Q8_CUH

#include "common.cuh"

/* Block b of a row: a warp whose lane holds element `lane` (v); every lane
 * of the warp calls it. */
__device__ __forceinline__ void act_q8_block(float v, int lane, int64_t b, int8_t *__restrict__ xq,
                                             float *__restrict__ xd, float *__restrict__ xs) {
    float a = fabsf(v);
#pragma unroll
    for (int o = 16; o > 0; o >>= 1) a = fmaxf(a, __shfl_xor_sync(0xffffffffu, a, o));
    const float d = a / 127.0f;
    const int q = d > 0.0f ? __float2int_rn(v / d) : 0;
    xq[b * 32 + lane] = (int8_t)q;
    if (lane == 0) xd[b] = d;
    if (xs) {
        int s = q;
#pragma unroll
        for (int o = 8; o > 0; o >>= 1) s += __shfl_xor_sync(0xffffffffu, s, o);
        if ((lane & 15) == 0) {
            float *e = xs + ((b >> 1) * 2 + (lane >> 4)) * 4 + (b & 1);
            e[0] = d;
            e[2] = d * (float)s;
        }
    }
}

#endif
