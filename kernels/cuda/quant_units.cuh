/* How one thread reads its share of a weight row, shared by the skinny
 * matmul (matmul_vec.cu) and the dequantizer (dequant.cu).  A row is cut
 * into units; unit u dequantizes to QU_RUNS runs of QU_RLEN consecutive
 * elements starting at qu_off<T>(u, k).  Units are laid out so that 32
 * consecutive units (a warp) read consecutive weight bytes and, run by
 * run, consecutive activations: every load of a warp is coalesced. */
#ifndef KERNELS_CUDA_QUANT_UNITS_CUH
#define KERNELS_CUDA_QUANT_UNITS_CUH

#include "common.cuh"

template <int T> struct qu_shape {
    /* 32-element types: 4 units per block, each 4 code bytes = elements
     * j..j+3 (low nibbles) and j+16..j+19 (high nibbles). */
    static constexpr int runs = 2, rlen = 4;
};
template <> struct qu_shape<DTYPE_F32> { static constexpr int runs = 1, rlen = 4; };
template <> struct qu_shape<DTYPE_F16> { static constexpr int runs = 1, rlen = 8; };
template <> struct qu_shape<DTYPE_BF16> { static constexpr int runs = 1, rlen = 8; };
/* Q8_0: 8 units per block of 4 bytes each. */
template <> struct qu_shape<DTYPE_Q8_0> { static constexpr int runs = 1, rlen = 4; };
/* Q4_K/Q5_K: 32 units per super-block: unit (p, l) = code bytes 32p + l ..
 * + 3, low nibbles elements 64p + l.., high nibbles 64p + 32 + l... */
template <> struct qu_shape<DTYPE_Q4_K> { static constexpr int runs = 2, rlen = 4; };
template <> struct qu_shape<DTYPE_Q5_K> { static constexpr int runs = 2, rlen = 4; };
/* Q6_K: 16 units per super-block: unit (h, l) = elements 128h + l + 32k
 * .. + 3 for k < 4. */
template <> struct qu_shape<DTYPE_Q6_K> { static constexpr int runs = 4, rlen = 4; };

template <int T> __host__ __device__ constexpr int64_t qu_units(int64_t cols) {
    return cols / (qu_shape<T>::runs * qu_shape<T>::rlen);
}

/* First element of run k of unit u. */
template <int T> __device__ __forceinline__ int64_t qu_off(int64_t u, int k) {
    if constexpr (T == DTYPE_F32) return u * 4;
    else if constexpr (T == DTYPE_F16 || T == DTYPE_BF16) return u * 8;
    else if constexpr (T == DTYPE_Q8_0) return u * 4;
    else if constexpr (T == DTYPE_Q4_K || T == DTYPE_Q5_K) {
        int64_t sb = u / 32;
        int i = (int)(u % 32), p = i / 8, l = (i % 8) * 4;
        return sb * 256 + 64 * p + 32 * k + l;
    } else if constexpr (T == DTYPE_Q6_K) {
        int64_t sb = u / 16;
        int i = (int)(u % 16), h = i / 8, l = (i % 8) * 4;
        return sb * 256 + 128 * h + 32 * k + l;
    } else {
        return (u / 4) * 32 + 16 * k + (u % 4) * 4;
    }
}

/* 4 bytes from a 2-byte aligned address. */
__device__ __forceinline__ uint32_t qu_ld4(const uint8_t *p) {
    const uint16_t *q = (const uint16_t *)p;
    return (uint32_t)__ldg(q) | (uint32_t)__ldg(q + 1) << 16;
}
__device__ __forceinline__ int qu_byte(uint32_t v, int i) { return (int)((v >> (8 * i)) & 0xff); }

/* w[0 .. runs * rlen) = the values of unit u of row wr (cols wide, in the
 * backend's layout: common.cuh). */
template <int T> __device__ __forceinline__ void qu_load(const uint8_t *wr, int64_t u, float *w, int64_t cols) {
    if constexpr (T == DTYPE_F32) {
        float4 v = __ldg((const float4 *)wr + u);
        w[0] = v.x;
        w[1] = v.y;
        w[2] = v.z;
        w[3] = v.w;
    } else if constexpr (T == DTYPE_F16) {
        uint4 raw = __ldg((const uint4 *)wr + u);
        const __half2 *h = (const __half2 *)&raw;
#pragma unroll
        for (int k = 0; k < 4; k++) {
            float2 f = __half22float2(h[k]);
            w[2 * k] = f.x;
            w[2 * k + 1] = f.y;
        }
    } else if constexpr (T == DTYPE_BF16) {
        uint4 raw = __ldg((const uint4 *)wr + u);
        const uint32_t *r = (const uint32_t *)&raw;
#pragma unroll
        for (int k = 0; k < 4; k++) {
            w[2 * k] = __uint_as_float(r[k] << 16);
            w[2 * k + 1] = __uint_as_float(r[k] & 0xffff0000u);
        }
    } else if constexpr (T == DTYPE_Q8_0) {
        float d = h2f(__ldg((const fp16_t *)(wr + q8s_d_off(cols)) + u / 8));
        uint32_t q = __ldg((const uint32_t *)wr + u); /* codes of a 16-byte aligned row */
#pragma unroll
        for (int i = 0; i < 4; i++) w[i] = d * (float)(int8_t)qu_byte(q, i);
    } else if constexpr (T == DTYPE_Q4_K || T == DTYPE_Q5_K) {
        int64_t sb = u / 32;
        int i = (int)(u % 32), p = i / 8, l = (i % 8) * 4;
        const block_q4_k *b4 = (const block_q4_k *)(wr + (size_t)sb * (T == DTYPE_Q4_K ? sizeof(block_q4_k)
                                                                                       : sizeof(block_q5_k)));
        const block_q5_k *b5 = (const block_q5_k *)b4;
        float d = h2f(__ldg(&b4->d)), dmin = h2f(__ldg(&b4->dmin)); /* same offsets in both */
        float sc1, m1, sc2, m2;
        kq_scale_min(2 * p, b4->scales, &sc1, &m1);
        kq_scale_min(2 * p + 1, b4->scales, &sc2, &m2);
        float d1 = d * sc1, d2 = d * sc2, o1 = dmin * m1, o2 = dmin * m2;
        const uint8_t *qs = T == DTYPE_Q4_K ? b4->qs : b5->qs;
        uint32_t q = __ldg((const uint32_t *)(qs + 32 * p + l)); /* blocks are 144/176 bytes: 4-aligned */
        uint32_t qh = 0;
        if constexpr (T == DTYPE_Q5_K) qh = __ldg((const uint32_t *)(b5->qh + l));
#pragma unroll
        for (int e = 0; e < 4; e++) {
            int c = qu_byte(q, e), lo = c & 0xF, hi = c >> 4;
            if constexpr (T == DTYPE_Q5_K) {
                int h = qu_byte(qh, e);
                lo |= ((h >> (2 * p)) & 1) << 4;
                hi |= ((h >> (2 * p + 1)) & 1) << 4;
            }
            w[e] = d1 * (float)lo - o1;
            w[4 + e] = d2 * (float)hi - o2;
        }
    } else if constexpr (T == DTYPE_Q6_K) {
        int64_t sb = u / 16;
        int i = (int)(u % 16), h = i / 8, l = (i % 8) * 4;
        const uint8_t *ql = wr + 128 * sb + 64 * h + l; /* every array 4-aligned here */
        float d = h2f(__ldg((const fp16_t *)(wr + q6s_d_off(cols)) + sb));
        uint32_t la = __ldg((const uint32_t *)ql), lb = __ldg((const uint32_t *)(ql + 32));
        uint32_t hh = __ldg((const uint32_t *)(wr + q6s_qh_off(cols) + 64 * sb + 32 * h + l));
        const int8_t *sc = (const int8_t *)(wr + q6s_sc_off(cols)) + 16 * sb + 8 * h + l / 16;
        float s0 = d * (float)sc[0], s1 = d * (float)sc[2], s2 = d * (float)sc[4], s3 = d * (float)sc[6];
#pragma unroll
        for (int e = 0; e < 4; e++) {
            int a = qu_byte(la, e), c = qu_byte(lb, e), x = qu_byte(hh, e);
            w[e] = s0 * (float)(((a & 0xF) | ((x & 3) << 4)) - 32);
            w[4 + e] = s1 * (float)(((c & 0xF) | (((x >> 2) & 3) << 4)) - 32);
            w[8 + e] = s2 * (float)(((a >> 4) | (((x >> 4) & 3) << 4)) - 32);
            w[12 + e] = s3 * (float)(((c >> 4) | (((x >> 6) & 3) << 4)) - 32);
        }
    } else {
        /* Q4_0, Q4_1, Q5_0, Q5_1: unit m of block b holds code bytes 4m..4m+3. */
        int64_t bi = u / 4;
        int j = (int)(u % 4) * 4;
        float d, m = 0.0f;
        uint32_t q, qh = 0;
        int bias;
        if constexpr (T == DTYPE_Q4_0) {
            const block_q4_0 *b = (const block_q4_0 *)wr + bi;
            d = h2f(__ldg(&b->d));
            q = qu_ld4(b->qs + j);
            bias = 8;
        } else if constexpr (T == DTYPE_Q4_1) {
            const block_q4_1 *b = (const block_q4_1 *)wr + bi;
            d = h2f(__ldg(&b->d));
            m = h2f(__ldg(&b->m));
            q = __ldg((const uint32_t *)(b->qs + j)); /* 20-byte blocks: 4-aligned */
            bias = 0;
        } else if constexpr (T == DTYPE_Q5_0) {
            const block_q5_0 *b = (const block_q5_0 *)wr + bi;
            d = h2f(__ldg(&b->d));
            q = qu_ld4(b->qs + j);
            qh = qu_ld4(b->qh);
            bias = 16;
        } else {
            const block_q5_1 *b = (const block_q5_1 *)wr + bi;
            d = h2f(__ldg(&b->d));
            m = h2f(__ldg(&b->m));
            q = __ldg((const uint32_t *)(b->qs + j)); /* 24-byte blocks: 4-aligned */
            qh = __ldg((const uint32_t *)b->qh);
            bias = 0;
        }
#pragma unroll
        for (int e = 0; e < 4; e++) {
            int c = qu_byte(q, e);
            int lo = (c & 0xF) | (int)(((qh >> (j + e)) & 1u) << 4);
            int hi = (c >> 4) | (int)(((qh >> (j + e + 16)) & 1u) << 4);
            w[e] = d * (float)(lo - bias) + m;
            w[4 + e] = d * (float)(hi - bias) + m;
        }
    }
}

#endif
