/* Skinny matmul for decode and small batches (n <= 16 tokens): each warp
 * owns one weight row, reads it once straight from its stored (quantized)
 * form with coalesced loads, dequantizes in registers and accumulates the
 * dot products of all n tokens in F32.  Decode is memory-bound, so the
 * measure here is the fraction of DRAM bandwidth reached. */
#include "common.cuh"

#define MV_WARPS 4

/* acc[t] += w[0..L) . x[t, off .. off + L) for the n (<= NT) tokens. */
template <int NT, int L>
__device__ __forceinline__ void mv_dot(float (&acc)[NT], const float *w, const float *x, int64_t cols, int64_t off,
                                       int n) {
#pragma unroll
    for (int t = 0; t < NT; t++) {
        if (t < n) {
            const float4 *xp = (const float4 *)(x + t * cols + off);
            float a = 0.0f;
#pragma unroll
            for (int k = 0; k < L / 4; k++) {
                float4 v = __ldg(xp + k);
                a += w[4 * k] * v.x + w[4 * k + 1] * v.y + w[4 * k + 2] * v.z + w[4 * k + 3] * v.w;
            }
            acc[t] += a;
        }
    }
}

/* 2*N bytes from a 2-byte aligned address, as N 16-bit loads. */
template <int N> __device__ __forceinline__ void ld_u16(uint8_t *b, const uint8_t *p) {
    const uint16_t *q = (const uint16_t *)p;
#pragma unroll
    for (int k = 0; k < N; k++) {
        uint16_t v = __ldg(q + k);
        b[2 * k] = (uint8_t)(v & 0xff);
        b[2 * k + 1] = (uint8_t)(v >> 8);
    }
}

/* The 32 values of a 32-element block with 4-bit codes (Q4_0/Q4_1) or
 * 5-bit codes (Q5_0/Q5_1): w = d * q + m. */
__device__ __forceinline__ void mv_block32(float *w, const uint8_t *qs, uint32_t qh, float d, float m, int bias) {
#pragma unroll
    for (int j = 0; j < 16; j++) {
        int lo = (qs[j] & 0xF) | (int)(((qh >> j) & 1u) << 4);
        int hi = (qs[j] >> 4) | (int)(((qh >> (j + 16)) & 1u) << 4);
        w[j] = d * (float)(lo - bias) + m;
        w[j + 16] = d * (float)(hi - bias) + m;
    }
}

/* Work unit of one lane: F32 4 values, F16 8, the 32-element types one
 * block, the K-quants an eighth of a 256-element super-block. */
template <int T> __host__ __device__ constexpr int64_t mv_units(int64_t cols) {
    return T == DTYPE_F32 ? cols / 4 : T == DTYPE_F16 ? cols / 8 : cols / 32;
}

template <int T, int NT>
__global__ void __launch_bounds__(MV_WARPS * 32)
matmul_vec_kernel(float *out, const uint8_t *w, size_t row_bytes, int64_t rows, int64_t cols, const float *x, int n) {
    int64_t row = (int64_t)blockIdx.x * MV_WARPS + threadIdx.x / 32;
    int lane = threadIdx.x % 32;
    if (row >= rows) return;
    const uint8_t *wr = w + (size_t)row * row_bytes;
    float acc[NT];
#pragma unroll
    for (int t = 0; t < NT; t++) acc[t] = 0.0f;
    int64_t units = mv_units<T>(cols);
    for (int64_t u = lane; u < units; u += 32) {
        if constexpr (T == DTYPE_F32) {
            float4 v = __ldg((const float4 *)wr + u);
            float wv[4] = {v.x, v.y, v.z, v.w};
            mv_dot<NT, 4>(acc, wv, x, cols, u * 4, n);
        } else if constexpr (T == DTYPE_F16) {
            uint4 raw = __ldg((const uint4 *)wr + u);
            const __half2 *h = (const __half2 *)&raw;
            float wv[8];
#pragma unroll
            for (int k = 0; k < 4; k++) {
                float2 f = __half22float2(h[k]);
                wv[2 * k] = f.x;
                wv[2 * k + 1] = f.y;
            }
            mv_dot<NT, 8>(acc, wv, x, cols, u * 8, n);
        } else if constexpr (T == DTYPE_Q8_0) {
            const block_q8_0 *b = (const block_q8_0 *)wr + u;
            float d = h2f(__ldg(&b->d));
            uint8_t q[32];
            ld_u16<16>(q, (const uint8_t *)b->qs);
            float wv[32];
#pragma unroll
            for (int j = 0; j < 32; j++) wv[j] = d * (float)(int8_t)q[j];
            mv_dot<NT, 32>(acc, wv, x, cols, u * 32, n);
        } else if constexpr (T == DTYPE_Q4_0) {
            const block_q4_0 *b = (const block_q4_0 *)wr + u;
            uint8_t q[16];
            ld_u16<8>(q, b->qs);
            float wv[32];
            mv_block32(wv, q, 0, h2f(__ldg(&b->d)), 0.0f, 8);
            mv_dot<NT, 32>(acc, wv, x, cols, u * 32, n);
        } else if constexpr (T == DTYPE_Q4_1) {
            const block_q4_1 *b = (const block_q4_1 *)wr + u;
            uint8_t q[16];
            ld_u16<8>(q, b->qs);
            float wv[32];
            mv_block32(wv, q, 0, h2f(__ldg(&b->d)), h2f(__ldg(&b->m)), 0);
            mv_dot<NT, 32>(acc, wv, x, cols, u * 32, n);
        } else if constexpr (T == DTYPE_Q5_0) {
            const block_q5_0 *b = (const block_q5_0 *)wr + u;
            uint8_t q[16], h[4];
            ld_u16<8>(q, b->qs);
            ld_u16<2>(h, b->qh);
            uint32_t qh = (uint32_t)h[0] | (uint32_t)h[1] << 8 | (uint32_t)h[2] << 16 | (uint32_t)h[3] << 24;
            float wv[32];
            mv_block32(wv, q, qh, h2f(__ldg(&b->d)), 0.0f, 16);
            mv_dot<NT, 32>(acc, wv, x, cols, u * 32, n);
        } else if constexpr (T == DTYPE_Q5_1) {
            const block_q5_1 *b = (const block_q5_1 *)wr + u;
            uint8_t q[16], h[4];
            ld_u16<8>(q, b->qs);
            ld_u16<2>(h, b->qh);
            uint32_t qh = (uint32_t)h[0] | (uint32_t)h[1] << 8 | (uint32_t)h[2] << 16 | (uint32_t)h[3] << 24;
            float wv[32];
            mv_block32(wv, q, qh, h2f(__ldg(&b->d)), h2f(__ldg(&b->m)), 0);
            mv_dot<NT, 32>(acc, wv, x, cols, u * 32, n);
        } else if constexpr (T == DTYPE_Q4_K || T == DTYPE_Q5_K) {
            /* Lane (p, half): bytes 16*half .. +16 of the 32 code bytes of
             * sub-block pair p; low nibbles belong to sub-block 2p, high
             * ones to 2p + 1.  Super-blocks are 144/176 bytes, so the
             * 16-byte loads stay aligned. */
            int64_t sb = u / 8;
            int p = (int)(u % 8) / 2, half = (int)(u % 2);
            const uint8_t *bb = wr + (size_t)sb * (T == DTYPE_Q4_K ? sizeof(block_q4_k) : sizeof(block_q5_k));
            const block_q4_k *b4 = (const block_q4_k *)bb;
            const block_q5_k *b5 = (const block_q5_k *)bb;
            float d = h2f(__ldg(&b4->d)), dmin = h2f(__ldg(&b4->dmin)); /* same offsets in both */
            float sc1, m1, sc2, m2;
            kq_scale_min(2 * p, b4->scales, &sc1, &m1);
            kq_scale_min(2 * p + 1, b4->scales, &sc2, &m2);
            float d1 = d * sc1, d2 = d * sc2, o1 = dmin * m1, o2 = dmin * m2;
            const uint8_t *qs = T == DTYPE_Q4_K ? b4->qs : b5->qs;
            uint4 raw = __ldg((const uint4 *)(qs + 32 * p + 16 * half));
            const uint8_t *q = (const uint8_t *)&raw;
            uint4 rawh = make_uint4(0, 0, 0, 0);
            if constexpr (T == DTYPE_Q5_K) rawh = __ldg((const uint4 *)(b5->qh + 16 * half));
            const uint8_t *qh = (const uint8_t *)&rawh;
            float wlo[16], whi[16];
#pragma unroll
            for (int i = 0; i < 16; i++) {
                int lo = q[i] & 0xF, hi = q[i] >> 4;
                if constexpr (T == DTYPE_Q5_K) {
                    lo |= ((qh[i] >> (2 * p)) & 1) << 4;
                    hi |= ((qh[i] >> (2 * p + 1)) & 1) << 4;
                }
                wlo[i] = d1 * (float)lo - o1;
                whi[i] = d2 * (float)hi - o2;
            }
            int64_t base = sb * 256 + 64 * p + 16 * half;
            mv_dot<NT, 16>(acc, wlo, x, cols, base, n);
            mv_dot<NT, 16>(acc, whi, x, cols, base + 32, n);
        } else if constexpr (T == DTYPE_Q6_K) {
            /* Lane (h, g): elements 128h + 8g + i + 32k, i < 8, k < 4; the
             * 210-byte blocks are only 2-byte aligned. */
            int64_t sb = u / 8;
            int h = (int)(u % 8) / 4, g = (int)(u % 4), l0 = 8 * g;
            const block_q6_k *b = (const block_q6_k *)wr + sb;
            float d = h2f(__ldg(&b->d));
            uint8_t la[8], lb[8], hh[8];
            ld_u16<4>(la, b->ql + 64 * h + l0);
            ld_u16<4>(lb, b->ql + 64 * h + 32 + l0);
            ld_u16<4>(hh, b->qh + 32 * h + l0);
            const int8_t *sc = b->scales + 8 * h + g / 2;
            float s0 = d * (float)sc[0], s1 = d * (float)sc[2], s2 = d * (float)sc[4], s3 = d * (float)sc[6];
            float w0[8], w1[8], w2[8], w3[8];
#pragma unroll
            for (int i = 0; i < 8; i++) {
                w0[i] = s0 * (float)(((la[i] & 0xF) | ((hh[i] & 3) << 4)) - 32);
                w1[i] = s1 * (float)(((lb[i] & 0xF) | (((hh[i] >> 2) & 3) << 4)) - 32);
                w2[i] = s2 * (float)(((la[i] >> 4) | (((hh[i] >> 4) & 3) << 4)) - 32);
                w3[i] = s3 * (float)(((lb[i] >> 4) | (((hh[i] >> 6) & 3) << 4)) - 32);
            }
            int64_t base = sb * 256 + 128 * h + l0;
            mv_dot<NT, 8>(acc, w0, x, cols, base, n);
            mv_dot<NT, 8>(acc, w1, x, cols, base + 32, n);
            mv_dot<NT, 8>(acc, w2, x, cols, base + 64, n);
            mv_dot<NT, 8>(acc, w3, x, cols, base + 96, n);
        }
    }
#pragma unroll
    for (int t = 0; t < NT; t++) {
        if (t < n) {
            float v = acc[t];
#pragma unroll
            for (int o = 16; o > 0; o >>= 1) v += __shfl_xor_sync(0xffffffffu, v, o);
            if (lane == 0) out[(int64_t)t * rows + row] = v;
        }
    }
}

template <int T, int NT>
static int mv_launch_nt(struct cuda_ctx *ctx, float *out, const void *w, int64_t rows, int64_t cols, const float *x,
                        int n) {
    unsigned grid = (unsigned)((rows + MV_WARPS - 1) / MV_WARPS);
    matmul_vec_kernel<T, NT><<<grid, MV_WARPS * 32, 0, CUDA_STREAM(ctx)>>>(
        out, (const uint8_t *)w, cuda_row_bytes((enum dtype)T, cols), rows, cols, x, n);
    CUDA_CHECK(ctx, cudaGetLastError());
    return STATUS_OK;
}

template <int T>
static int mv_launch(struct cuda_ctx *ctx, float *out, const void *w, int64_t rows, int64_t cols, const float *x,
                     int n) {
    if (n == 1) return mv_launch_nt<T, 1>(ctx, out, w, rows, cols, x, n);
    if (n <= 4) return mv_launch_nt<T, 4>(ctx, out, w, rows, cols, x, n);
    if (n <= 8) return mv_launch_nt<T, 8>(ctx, out, w, rows, cols, x, n);
    return mv_launch_nt<T, 16>(ctx, out, w, rows, cols, x, n);
}

extern "C" int cuda_matmul_vec_supports(enum dtype type, int64_t cols) {
    switch (type) {
    case DTYPE_F32: return cols % 4 == 0;
    case DTYPE_F16: return cols % 8 == 0;
    case DTYPE_Q8_0: case DTYPE_Q4_0: case DTYPE_Q4_1: case DTYPE_Q5_0: case DTYPE_Q5_1:
        return cols % 32 == 0;
    case DTYPE_Q4_K: case DTYPE_Q5_K: case DTYPE_Q6_K: return cols % 256 == 0;
    default: return 0;
    }
}

extern "C" int cuda_matmul_vec(struct cuda_ctx *ctx, float *out, const void *w, enum dtype type, int64_t rows,
                               int64_t cols, const float *x, int32_t n) {
    if (n < 1 || n > CUDA_MATMUL_VEC_MAX || rows <= 0 || !cuda_matmul_vec_supports(type, cols))
        return cuda_fail(ctx, STATUS_BAD_INPUT, "matmul_vec: %d tokens x %s [%lld x %lld] is not a skinny shape", n,
                         dtype_name(type), (long long)rows, (long long)cols);
    if ((uintptr_t)x % 16 != 0 || (uintptr_t)w % 16 != 0)
        return cuda_fail(ctx, STATUS_BAD_INPUT, "matmul_vec: x %p or weight %p is not 16-byte aligned", (const void *)x,
                         w);
    switch (type) {
    case DTYPE_F32: return mv_launch<DTYPE_F32>(ctx, out, w, rows, cols, x, n);
    case DTYPE_F16: return mv_launch<DTYPE_F16>(ctx, out, w, rows, cols, x, n);
    case DTYPE_Q8_0: return mv_launch<DTYPE_Q8_0>(ctx, out, w, rows, cols, x, n);
    case DTYPE_Q4_0: return mv_launch<DTYPE_Q4_0>(ctx, out, w, rows, cols, x, n);
    case DTYPE_Q4_1: return mv_launch<DTYPE_Q4_1>(ctx, out, w, rows, cols, x, n);
    case DTYPE_Q5_0: return mv_launch<DTYPE_Q5_0>(ctx, out, w, rows, cols, x, n);
    case DTYPE_Q5_1: return mv_launch<DTYPE_Q5_1>(ctx, out, w, rows, cols, x, n);
    case DTYPE_Q4_K: return mv_launch<DTYPE_Q4_K>(ctx, out, w, rows, cols, x, n);
    case DTYPE_Q5_K: return mv_launch<DTYPE_Q5_K>(ctx, out, w, rows, cols, x, n);
    case DTYPE_Q6_K: return mv_launch<DTYPE_Q6_K>(ctx, out, w, rows, cols, x, n);
    default: break;
    }
    return cuda_fail(ctx, STATUS_UNSUPPORTED, "matmul_vec: weight type %s", dtype_name(type));
}
