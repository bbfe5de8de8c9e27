/* The fragments of the tensor-core matmul kernels (matmul_vec.cu's mq and
 * matmul_wide.cu): how a chunk of each weight type lies in shared memory,
 * and how a lane decodes its mma.sync fragments from there to F16.  In
 * fragment order lane (g = lane / 4, t = lane % 4) holds columns 8t .. 8t
 * + 7 of each 32-column block for rows g and g + 8: 8 consecutive values,
 * which every type stores in a few contiguous bytes. */
#ifndef KERNELS_CUDA_MQ_FRAG_CUH
#define KERNELS_CUDA_MQ_FRAG_CUH

#include "common.cuh"

/* ck: columns per chunk; eb, bb: elements and bytes of one stored block
 * (F16 counts 32 halves as a block of 64 bytes); soa: the 16-byte loads of
 * a chunk of a row in the backend's regrouped Q8_0 / Q6_K layout
 * (common.cuh), 0 for the types copied as one run of bytes. */
template <int T> struct mq_fmt;
template <> struct mq_fmt<DTYPE_F16> { static constexpr int ck = 128, eb = 32, bb = 64, soa = 0; };
/* 256 codes, then the 16-byte word of the chunk's 8 scales. */
template <> struct mq_fmt<DTYPE_Q8_0> { static constexpr int ck = 256, eb = 32, bb = 34, soa = 17; };
template <> struct mq_fmt<DTYPE_Q4_0> { static constexpr int ck = 256, eb = 32, bb = 18, soa = 0; };
template <> struct mq_fmt<DTYPE_Q4_1> { static constexpr int ck = 256, eb = 32, bb = 20, soa = 0; };
template <> struct mq_fmt<DTYPE_Q5_0> { static constexpr int ck = 256, eb = 32, bb = 22, soa = 0; };
template <> struct mq_fmt<DTYPE_Q5_1> { static constexpr int ck = 256, eb = 32, bb = 24, soa = 0; };
template <> struct mq_fmt<DTYPE_Q4_K> { static constexpr int ck = 256, eb = 256, bb = 144, soa = 0; };
template <> struct mq_fmt<DTYPE_Q5_K> { static constexpr int ck = 256, eb = 256, bb = 176, soa = 0; };
/* One super-block: ql (8 loads), qh (4), scales (1), and the aligned
 * 16-byte word holding its d. */
template <> struct mq_fmt<DTYPE_Q6_K> { static constexpr int ck = 256, eb = 256, bb = 210, soa = 14; };

template <int T> struct mq_geom {
    static constexpr int ck = mq_fmt<T>::ck;
    static constexpr int cb = ck / mq_fmt<T>::eb * mq_fmt<T>::bb; /* bytes of a full chunk of one row */
    /* 16-byte loads covering cb bytes that start at any even address, or
     * the regrouped layout's loads. */
    static constexpr int nld = mq_fmt<T>::soa ? mq_fmt<T>::soa : (cb + 14 + 15) / 16;
    /* Shared row stride: an odd number of 16-byte units, so that the 8
     * rows a fragment load touches start in different banks. */
    static constexpr int ws = (nld | 1) * 16;
    static constexpr int iters = (16 * nld + 31) / 32; /* loads per lane */
    static constexpr int xs = ck + 32; /* activation row stride in halves: 64 mod 128 bytes, conflict-free */
};

/* Source of 16-byte load c of chunk ch of row rp (regrouped layout), NULL
 * for code loads past the row's last block (nb blocks of 32 in this chunk). */
template <int T>
__device__ __forceinline__ const uint8_t *mq_soa_src(const uint8_t *rp, int cols, int ch, int c, int nb) {
    if constexpr (T == DTYPE_Q8_0) {
        if (c < 16) return c < 2 * nb ? rp + 256 * (size_t)ch + 16 * c : NULL;
        return rp + q8s_d_off(cols) + 16 * (size_t)ch;
    } else {
        if (c < 8) return rp + 128 * (size_t)ch + 16 * c;
        if (c < 12) return rp + q6s_qh_off(cols) + 64 * (size_t)ch + 16 * (c - 8);
        if (c == 12) return rp + q6s_sc_off(cols) + 16 * (size_t)ch;
        return rp + ((q6s_d_off(cols) + 2 * (size_t)ch) & ~(size_t)15);
    }
}

__device__ __forceinline__ uint32_t mq_ld4(const uint8_t *p) { /* 4 bytes at an even shared address */
    const uint16_t *q = (const uint16_t *)p;
    return (uint32_t)q[0] | (uint32_t)q[1] << 16;
}
__device__ __forceinline__ __half2 mq_h2(uint32_t u) {
    __half2 h;
    memcpy(&h, &u, 4);
    return h;
}
__device__ __forceinline__ uint32_t mq_u32(__half2 h) {
    uint32_t u;
    memcpy(&u, &h, 4);
    return u;
}
__device__ __forceinline__ __half2 mq_hh(float f) { return __float2half2_rn(f); }

/* a[j] = (x_{2j}, x_{2j+1}) as F16 for the 8 code bytes of v0 (x0..x3) and
 * v1 (x4..x7), each byte c < 256 giving (c - bias) * scale + add: the byte
 * becomes the mantissa of 1024 + c (0x64 above it), so no int-to-float
 * conversion is needed and the subtraction is exact. */
__device__ __forceinline__ void mq_cvt(uint32_t (&a)[4], uint32_t v0, uint32_t v1, __half2 bias, __half2 scale,
                                       __half2 add) {
    a[0] = mq_u32(__hfma2(__hsub2(mq_h2(__byte_perm(v0, 0x64646464u, 0x4140)), bias), scale, add));
    a[1] = mq_u32(__hfma2(__hsub2(mq_h2(__byte_perm(v0, 0x64646464u, 0x4342)), bias), scale, add));
    a[2] = mq_u32(__hfma2(__hsub2(mq_h2(__byte_perm(v1, 0x64646464u, 0x4140)), bias), scale, add));
    a[3] = mq_u32(__hfma2(__hsub2(mq_h2(__byte_perm(v1, 0x64646464u, 0x4342)), bias), scale, add));
}

/* Bit i of the low 4 bits of b moved to bit 8i + 4 (a 5th code bit per byte). */
__device__ __forceinline__ uint32_t mq_spread4(uint32_t b) { return (((b & 0xFu) * 0x00204081u) & 0x01010101u) << 4; }

/* The K-quants' block scales as F16 pairs, worked out in half2
 * arithmetic: a 6-bit scale or min (or Q6_K's int8 scale) becomes exact
 * F16 through the 1024 + c mantissa trick of mq_cvt, and one hmul2 by the
 * super-block's F16 factors rounds each product once, as converting the
 * exact F32 product d x sc to F16 does (d has 11 significant bits, sc 8 at
 * most): the same bits as F32 arithmetic, in a handful of instructions.
 *
 * Q4_K / Q5_K: (d x sc, -dmin x mn) of sub-block b (0..7) from the
 * super-block's 16-byte header h (d, dmin, then kq_scale_min's 12 bytes
 * of 6-bit scales and mins in h.y, h.z, h.w). */
__device__ __forceinline__ uint32_t mq_kq_pair(uint4 h, int b) {
    uint32_t v;
    if (b < 4) { /* sc = y[b] & 63, mn = z[b] & 63 */
        v = __byte_perm(h.y, h.z, (uint32_t)(b | (4 + b) << 8)) & 0x003F003Fu;
    } else { /* sc = (w[k] & 15) | (y[k] >> 6) << 4, mn = (w[k] >> 4) | (z[k] >> 6) << 4 */
        const int k = b - 4;
        const uint32_t lo = __byte_perm(h.w, h.w >> 4, (uint32_t)(k | (4 + k) << 8));
        const uint32_t hi = __byte_perm(h.y, h.z, (uint32_t)(k | (4 + k) << 8));
        v = (lo & 0x000F000Fu) | ((hi >> 2) & 0x00300030u);
    }
    const __half2 sm = __hsub2(mq_h2(v | 0x64006400u), mq_hh(1024.0f));
    return mq_u32(__hmul2(sm, mq_h2(h.x ^ 0x80000000u))); /* (d, -dmin) */
}
/* Q6_K (regrouped, one super-block in shared memory at p): d x sc of the
 * two 16-column halves of block b (scale bytes 192 + 8 (b / 4) + 2 (b %
 * 4), + 1; d in the 16-byte word at 208, at 2 ch mod 16 in it). */
__device__ __forceinline__ uint32_t mq_q6_pair(const uint8_t *p, int b, int ch) {
    const uint32_t s2 = *(const uint16_t *)(p + 192 + 8 * (b >> 2) + 2 * (b & 3));
    const uint32_t v = (__byte_perm(s2, 0, 0x4140u) ^ 0x00800080u) | 0x64006400u; /* 1152 + sc */
    const __half d = *(const __half *)(p + 208 + ((2 * ch) & 15));
    return mq_u32(__hmul2(__hsub2(mq_h2(v), mq_hh(1152.0f)), __half2half2(d)));
}

/* mq (matmul_vec.cu) unpacks the scales once per row and chunk into a
 * shared table rather than in each of the 4 lanes of a row for each
 * fragment (mq_scales<T> is 1 for the K-quants); mq_scale_pair gives block
 * b's pair from the row's bytes at p. */
template <int T> struct mq_scales {
    static constexpr int on = T == DTYPE_Q4_K || T == DTYPE_Q5_K || T == DTYPE_Q6_K;
};
template <int T> __device__ __forceinline__ uint32_t mq_scale_pair(const uint8_t *p, int b, int ch) {
    if constexpr (T == DTYPE_Q4_K || T == DTYPE_Q5_K) return mq_kq_pair(*(const uint4 *)p, b);
    else return mq_q6_pair(p, b, ch);
}
/* a[0..3] = the fragment of lane t for 32-column block b of chunk ch whose
 * bytes start at p (one row, in shared memory, even address).  With TAB
 * the K-quants take the block's scales from sc (its mq_scale_pair, which
 * the caller unpacked once for the 4 lanes of the row); without, they
 * unpack them here, as matmul_wide.cu does (a table is 3-5% slower
 * there), Q6_K only the lane's own one of the pair. */
template <int T, bool TAB = false>
__device__ __forceinline__ void mq_decode(const uint8_t *p, int b, int t, int ch, uint32_t (&a)[4], uint32_t sc = 0) {
    const __half2 zero = mq_hh(0.0f);
    if constexpr (T == DTYPE_F16) {
        uint4 v = *(const uint4 *)(p + 64 * b + 16 * t); /* rows of 32k halves: 16-byte aligned */
        a[0] = v.x;
        a[1] = v.y;
        a[2] = v.z;
        a[3] = v.w;
    } else if constexpr (T == DTYPE_Q8_0) {
        /* Regrouped: 256 codes, then 8 scales. */
        uint2 v = *(const uint2 *)(p + 32 * b + 8 * t);
        __half2 d = __half2half2(*(const __half *)(p + 256 + 2 * b));
        mq_cvt(a, v.x ^ 0x80808080u, v.y ^ 0x80808080u, mq_hh(1152.0f), d, zero);
    } else if constexpr (T == DTYPE_Q4_0 || T == DTYPE_Q4_1) {
        const int bb = T == DTYPE_Q4_0 ? 18 : 20, qo = T == DTYPE_Q4_0 ? 2 : 4;
        const uint8_t *blk = p + bb * b, *qs = blk + qo + 8 * (t & 1);
        int sh = 4 * (t >> 1); /* lanes 2, 3: high nibbles = columns 16..31 */
        uint32_t v0 = (mq_ld4(qs) >> sh) & 0x0F0F0F0Fu, v1 = (mq_ld4(qs + 4) >> sh) & 0x0F0F0F0Fu;
        __half2 d = __half2half2(*(const __half *)blk);
        if constexpr (T == DTYPE_Q4_0) mq_cvt(a, v0, v1, mq_hh(1032.0f), d, zero);
        else mq_cvt(a, v0, v1, mq_hh(1024.0f), d, __half2half2(*(const __half *)(blk + 2)));
    } else if constexpr (T == DTYPE_Q5_0 || T == DTYPE_Q5_1) {
        const int bb = T == DTYPE_Q5_0 ? 22 : 24, ho = T == DTYPE_Q5_0 ? 2 : 4;
        const uint8_t *blk = p + bb * b, *qs = blk + ho + 4 + 8 * (t & 1);
        int sh = 4 * (t >> 1);
        uint32_t hb = (mq_ld4(blk + ho) >> (8 * t)) & 0xFFu; /* 5th bits of columns 8t .. 8t + 7 */
        uint32_t v0 = ((mq_ld4(qs) >> sh) & 0x0F0F0F0Fu) | mq_spread4(hb);
        uint32_t v1 = ((mq_ld4(qs + 4) >> sh) & 0x0F0F0F0Fu) | mq_spread4(hb >> 4);
        __half2 d = __half2half2(*(const __half *)blk);
        if constexpr (T == DTYPE_Q5_0) mq_cvt(a, v0, v1, mq_hh(1040.0f), d, zero);
        else mq_cvt(a, v0, v1, mq_hh(1024.0f), d, __half2half2(*(const __half *)(blk + 2)));
    } else if constexpr (T == DTYPE_Q4_K || T == DTYPE_Q5_K) {
        /* One super-block per chunk (144 / 176 bytes: 16-byte aligned). b
         * is the sub-block: low (b even) or high nibbles of code bytes
         * 32 (b / 2) + l. */
        const int qo = T == DTYPE_Q4_K ? 16 : 48;
        const __half2 dm = mq_h2(TAB ? sc : mq_kq_pair(*(const uint4 *)p, b));
        const __half2 dh = __low2half2(dm), mh = __high2half2(dm);
        uint2 q = *(const uint2 *)(p + qo + 32 * (b >> 1) + 8 * t);
        int sh = 4 * (b & 1);
        uint32_t v0 = (q.x >> sh) & 0x0F0F0F0Fu, v1 = (q.y >> sh) & 0x0F0F0F0Fu;
        if constexpr (T == DTYPE_Q5_K) {
            uint2 h = *(const uint2 *)(p + 16 + 8 * t);
            v0 |= ((h.x >> b) & 0x01010101u) << 4;
            v1 |= ((h.y >> b) & 0x01010101u) << 4;
        }
        mq_cvt(a, v0, v1, mq_hh(1024.0f), dh, mh);
    } else if constexpr (T == DTYPE_Q6_K) {
        /* One super-block per chunk, regrouped: ql at 0, qh at 128, scales
         * at 192, d in the 16-byte word at 208 (at 2 ch mod 16 in it).
         * Block b = 4h + q: low 4 bits from ql[64h + 32(q & 1) + l] (nibble
         * q / 2), high 2 from qh[32h + l] bits 2q; 16-column scales. */
        int h = b >> 2, q = b & 3, sh = 4 * (q >> 1);
        uint2 ql = *(const uint2 *)(p + 64 * h + 32 * (q & 1) + 8 * t), qh = *(const uint2 *)(p + 128 + 32 * h + 8 * t);
        uint32_t v0 = ((ql.x >> sh) & 0x0F0F0F0Fu) | (((qh.x >> (2 * q)) & 0x03030303u) << 4);
        uint32_t v1 = ((ql.y >> sh) & 0x0F0F0F0Fu) | (((qh.y >> (2 * q)) & 0x03030303u) << 4);
        __half2 s;
        if constexpr (TAB) {
            const __half2 dd = mq_h2(sc);
            s = t >> 1 ? __high2half2(dd) : __low2half2(dd);
        } else { /* the lane's one scale: 2% cheaper in matmul_wide than mq_q6_pair's two */
            s = mq_hh(__half2float(*(const __half *)(p + 208 + ((2 * ch) & 15))) *
                      (float)(int8_t)p[192 + 8 * h + 2 * q + (t >> 1)]);
        }
        mq_cvt(a, v0, v1, mq_hh(1056.0f), s, zero);
    }
}

/* c += A (16 x 8, rows g / g + 8 in a0 / a1) . B (8 x 8, column g in b). */
__device__ __forceinline__ void mq_mma(float (&c)[4], uint32_t a0, uint32_t a1, uint32_t b) {
    asm("mma.sync.aligned.m16n8k8.row.col.f32.f16.f16.f32 {%0, %1, %2, %3}, {%4, %5}, {%6}, {%0, %1, %2, %3};\n"
        : "+f"(c[0]), "+f"(c[1]), "+f"(c[2]), "+f"(c[3])
        : "r"(a0), "r"(a1), "r"(b));
}

/* The four k-steps of one 32-column block: a[j] / b[j] hold columns
 * 8t + 2j, + 1.  sm_80 and later issue them as two k16 steps (half the
 * instructions; the k order inside a step is the same permutation on both
 * sides, so the sum is unchanged). */
__device__ __forceinline__ void mq_mma32(float (&c)[4], const uint32_t (&alo)[4], const uint32_t (&ahi)[4], uint4 b) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 800
    asm("mma.sync.aligned.m16n8k16.row.col.f32.f16.f16.f32 {%0, %1, %2, %3}, {%4, %5, %6, %7}, {%8, %9}, "
        "{%0, %1, %2, %3};\n"
        : "+f"(c[0]), "+f"(c[1]), "+f"(c[2]), "+f"(c[3])
        : "r"(alo[0]), "r"(ahi[0]), "r"(alo[1]), "r"(ahi[1]), "r"(b.x), "r"(b.y));
    asm("mma.sync.aligned.m16n8k16.row.col.f32.f16.f16.f32 {%0, %1, %2, %3}, {%4, %5, %6, %7}, {%8, %9}, "
        "{%0, %1, %2, %3};\n"
        : "+f"(c[0]), "+f"(c[1]), "+f"(c[2]), "+f"(c[3])
        : "r"(alo[2]), "r"(ahi[2]), "r"(alo[3]), "r"(ahi[3]), "r"(b.z), "r"(b.w));
#else
    mq_mma(c, alo[0], ahi[0], b.x);
    mq_mma(c, alo[1], ahi[1], b.y);
    mq_mma(c, alo[2], ahi[2], b.z);
    mq_mma(c, alo[3], ahi[3], b.w);
#endif
}

#endif
