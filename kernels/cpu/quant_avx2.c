/* AVX2 + FMA + F16C dot kernels for matmul, compiled with per-function
 * target attributes so that the library stays portable x86-64: quant.c
 * picks them at run time only when the CPU reports all three features.
 * Each computes exactly what its scalar twin in quant.c computes (integer
 * block sums are exact; only the float accumulation order differs). */
#include "cpu.h"

#include <string.h>

#if defined(__x86_64__) && defined(__GNUC__)
#include "avx2.h"

int cpu_has_avx2(void) {
    __builtin_cpu_init();
    return __builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma") && __builtin_cpu_supports("f16c");
}

/* Sum of signed products of 32 int8 pairs, as 8 int32 lanes. */
AVX2_INLINE static __m256i dot_i8x32(__m256i a, __m256i b) {
    __m256i p16 = _mm256_maddubs_epi16(_mm256_sign_epi8(a, a), _mm256_sign_epi8(b, a));
    return _mm256_madd_epi16(p16, _mm256_set1_epi16(1));
}

/* The per-row dot products of one token, of four (dot4_*, prefill and
 * verification steps) and of three or five (dotn_*) do the same float
 * operations in the same order, so a token's result never depends on how
 * many tokens share its step: greedy decoding gives the same tokens with
 * and without speculation (docs/router.md, "Speculation"), and whatever
 * the batch. */
AVX2_FN static float dot_f16_avx2(const void *w, const void *x, int64_t n) {
    const uint16_t *a = w;
    const float *b = x;
    /* dot4_f16_avx2's accumulation: two accumulators over 16, then the
     * tail one element at a time after the horizontal sum. */
    __m256 acc0 = _mm256_setzero_ps(), acc1 = _mm256_setzero_ps();
    int64_t i = 0;
    for (; i + 16 <= n; i += 16) {
        acc0 = _mm256_fmadd_ps(_mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)(a + i))), _mm256_loadu_ps(b + i), acc0);
        acc1 = _mm256_fmadd_ps(_mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)(a + i + 8))),
                               _mm256_loadu_ps(b + i + 8), acc1);
    }
    float s = hsum256(_mm256_add_ps(acc0, acc1));
    for (; i < n; i++) s += cpu_fp16_to_f32(a[i]) * b[i];
    return s;
}

AVX2_FN static float dot_bf16_avx2(const void *w, const void *x, int64_t n) {
    const uint16_t *a = w;
    const float *b = x;
    __m256 acc0 = _mm256_setzero_ps(), acc1 = _mm256_setzero_ps();
    int64_t i = 0;
    for (; i + 16 <= n; i += 16) {
        __m256i h0 = _mm256_cvtepu16_epi32(_mm_loadu_si128((const __m128i *)(a + i)));
        __m256i h1 = _mm256_cvtepu16_epi32(_mm_loadu_si128((const __m128i *)(a + i + 8)));
        acc0 = _mm256_fmadd_ps(_mm256_castsi256_ps(_mm256_slli_epi32(h0, 16)), _mm256_loadu_ps(b + i), acc0);
        acc1 = _mm256_fmadd_ps(_mm256_castsi256_ps(_mm256_slli_epi32(h1, 16)), _mm256_loadu_ps(b + i + 8), acc1);
    }
    float s = hsum256(_mm256_add_ps(acc0, acc1));
    for (; i < n; i++) s += cpu_bf16_to_f32(a[i]) * b[i];
    return s;
}

AVX2_FN static float dot_f32_avx2(const void *w, const void *x, int64_t n) {
    const float *a = w, *b = x;
    __m256 acc0 = _mm256_setzero_ps(), acc1 = _mm256_setzero_ps();
    int64_t i = 0;
    for (; i + 16 <= n; i += 16) {
        acc0 = _mm256_fmadd_ps(_mm256_loadu_ps(a + i), _mm256_loadu_ps(b + i), acc0);
        acc1 = _mm256_fmadd_ps(_mm256_loadu_ps(a + i + 8), _mm256_loadu_ps(b + i + 8), acc1);
    }
    float s = hsum256(_mm256_add_ps(acc0, acc1));
    for (; i < n; i++) s += a[i] * b[i];
    return s;
}

AVX2_FN static float dot_q8_0_avx2(const void *w, const void *x, int64_t n) {
    const block_q8_0 *b = w;
    const struct cpu_q8 *y = x;
    __m256 acc = _mm256_setzero_ps();
    for (int64_t k = 0; k < n / 32; k++) {
        __m256i qw = _mm256_loadu_si256((const __m256i *)b[k].qs);
        __m256i qa = _mm256_loadu_si256((const __m256i *)y[k].qs);
        __m256 d = _mm256_set1_ps(cpu_fp16_to_f32(b[k].d) * y[k].d);
        acc = _mm256_fmadd_ps(d, _mm256_cvtepi32_ps(dot_i8x32(qw, qa)), acc);
    }
    return hsum256(acc);
}

/* 32 nibbles of a Q4 block as bytes 0..15: low nibbles first, then high. */
AVX2_INLINE static __m256i unpack_nibbles(const uint8_t *qs) {
    __m128i q = _mm_loadu_si128((const __m128i *)qs);
    __m256i both = _mm256_set_m128i(_mm_srli_epi16(q, 4), q);
    return _mm256_and_si256(both, _mm256_set1_epi8(0x0F));
}

AVX2_FN static float dot_q4_0_avx2(const void *w, const void *x, int64_t n) {
    const block_q4_0 *b = w;
    const struct cpu_q8 *y = x;
    __m256 acc = _mm256_setzero_ps();
    for (int64_t k = 0; k < n / 32; k++) {
        __m256i qw = _mm256_sub_epi8(unpack_nibbles(b[k].qs), _mm256_set1_epi8(8));
        __m256i qa = _mm256_loadu_si256((const __m256i *)y[k].qs);
        __m256 d = _mm256_set1_ps(cpu_fp16_to_f32(b[k].d) * y[k].d);
        acc = _mm256_fmadd_ps(d, _mm256_cvtepi32_ps(dot_i8x32(qw, qa)), acc);
    }
    return hsum256(acc);
}

/* 32 bits as 32 bytes: byte i is 0xFF if bit i of x is set, else 0. */
AVX2_INLINE static __m256i bits_to_bytes(uint32_t x) {
    /* Byte i takes byte i / 8 of x, keeps bit i % 8, and compares. */
    const __m256i pick = _mm256_setr_epi8(0, 0, 0, 0, 0, 0, 0, 0, 1, 1, 1, 1, 1, 1, 1, 1, 2, 2, 2, 2, 2, 2, 2, 2, 3,
                                          3, 3, 3, 3, 3, 3, 3);
    const __m256i bit = _mm256_set1_epi64x(0x8040201008040201LL);
    __m256i v = _mm256_shuffle_epi8(_mm256_set1_epi32((int)x), pick);
    return _mm256_cmpeq_epi8(_mm256_and_si256(v, bit), bit);
}

/* Sum of unsigned (a) times signed (b) products of 32 byte pairs, as 8
 * int32 lanes; a <= 63 keeps the int16 pair sums from saturating. */
AVX2_INLINE static __m256i dot_u8i8x32(__m256i a, __m256i b) {
    return _mm256_madd_epi16(_mm256_maddubs_epi16(a, b), _mm256_set1_epi16(1));
}

AVX2_FN static float dot_q4_1_avx2(const void *w, const void *x, int64_t n) {
    const block_q4_1 *b = w;
    const struct cpu_q8 *y = x;
    __m256 acc = _mm256_setzero_ps();
    float sm = 0;
    for (int64_t k = 0; k < n / 32; k++) {
        __m256i qa = _mm256_loadu_si256((const __m256i *)y[k].qs);
        __m256 d = _mm256_set1_ps(cpu_fp16_to_f32(b[k].d) * y[k].d);
        acc = _mm256_fmadd_ps(d, _mm256_cvtepi32_ps(dot_u8i8x32(unpack_nibbles(b[k].qs), qa)), acc);
        sm += cpu_fp16_to_f32(b[k].m) * y[k].s;
    }
    return hsum256(acc) + sm;
}

AVX2_FN static float dot_q5_0_avx2(const void *w, const void *x, int64_t n) {
    const block_q5_0 *b = w;
    const struct cpu_q8 *y = x;
    __m256 acc = _mm256_setzero_ps();
    for (int64_t k = 0; k < n / 32; k++) {
        uint32_t qh;
        memcpy(&qh, b[k].qh, 4);
        __m256i hi = _mm256_and_si256(bits_to_bytes(qh), _mm256_set1_epi8(0x10));
        __m256i qw = _mm256_sub_epi8(_mm256_or_si256(unpack_nibbles(b[k].qs), hi), _mm256_set1_epi8(16));
        __m256i qa = _mm256_loadu_si256((const __m256i *)y[k].qs);
        __m256 d = _mm256_set1_ps(cpu_fp16_to_f32(b[k].d) * y[k].d);
        acc = _mm256_fmadd_ps(d, _mm256_cvtepi32_ps(dot_i8x32(qw, qa)), acc);
    }
    return hsum256(acc);
}

AVX2_FN static float dot_q5_1_avx2(const void *w, const void *x, int64_t n) {
    const block_q5_1 *b = w;
    const struct cpu_q8 *y = x;
    __m256 acc = _mm256_setzero_ps();
    float sm = 0;
    for (int64_t k = 0; k < n / 32; k++) {
        uint32_t qh;
        memcpy(&qh, b[k].qh, 4);
        __m256i hi = _mm256_and_si256(bits_to_bytes(qh), _mm256_set1_epi8(0x10));
        __m256i qw = _mm256_or_si256(unpack_nibbles(b[k].qs), hi);
        __m256i qa = _mm256_loadu_si256((const __m256i *)y[k].qs);
        __m256 d = _mm256_set1_ps(cpu_fp16_to_f32(b[k].d) * y[k].d);
        acc = _mm256_fmadd_ps(d, _mm256_cvtepi32_ps(dot_u8i8x32(qw, qa)), acc);
        sm += cpu_fp16_to_f32(b[k].m) * y[k].s;
    }
    return hsum256(acc) + sm;
}

/* The 8 6-bit scales and 8 mins of a Q4_K/Q5_K block (layout in quant.c),
 * unpacked a 32-bit word at a time: bytes 0-3 hold scales 0-3 and the top
 * two bits of scales 4-7, bytes 4-7 the same for the mins, bytes 8-11 the
 * low four bits of scales 4-7 (low nibbles) and mins 4-7 (high nibbles).
 * Returns the scales as 8 int16 in the low half of both 128-bit lanes and
 * stores the mins as 8 int16 pairs (m0 m0 m1 m1 ...) in *mins2. */
AVX2_INLINE static __m256i k4_scales(const uint8_t *q, __m256i *mins2) {
    uint32_t w0, w1, w2;
    memcpy(&w0, q, 4);
    memcpy(&w1, q + 4, 4);
    memcpy(&w2, q + 8, 4);
    uint32_t sc_lo = w0 & 0x3f3f3f3fu, m_lo = w1 & 0x3f3f3f3fu;
    uint32_t sc_hi = (w2 & 0x0f0f0f0fu) | (((w0 >> 6) & 0x03030303u) << 4);
    uint32_t m_hi = ((w2 >> 4) & 0x0f0f0f0fu) | (((w1 >> 6) & 0x03030303u) << 4);
    __m128i sc = _mm_cvtepu8_epi16(_mm_set_epi32(0, 0, (int)sc_hi, (int)sc_lo));
    __m128i m = _mm_cvtepu8_epi16(_mm_set_epi32(0, 0, (int)m_hi, (int)m_lo));
    *mins2 = _mm256_set_m128i(_mm_unpackhi_epi16(m, m), _mm_unpacklo_epi16(m, m));
    return _mm256_broadcastsi128_si256(sc);
}

/* Broadcast int16 lane i (0..7) of each 128-bit half to all 16 lanes. */
#define K_SCALE(sc, i) _mm256_shuffle_epi8((sc), _mm256_set1_epi16((short)(((2 * (i) + 1) << 8) | (2 * (i)))))

AVX2_FN static float dot_q4_k_avx2(const void *w, const void *x, int64_t n) {
    const block_q4_k *b = w;
    const struct cpu_q8k *y = x;
    const __m256i low4 = _mm256_set1_epi8(0x0F);
    __m256 acc = _mm256_setzero_ps();
    for (int64_t k = 0; k < n / 256; k++) {
        __m256i mins2;
        __m256i sc = k4_scales(b[k].scales, &mins2);
        /* min_j * (bsum_2j + bsum_2j+1), as 8 int32 lanes */
        __m256i msum = _mm256_madd_epi16(_mm256_loadu_si256((const __m256i *)y[k].bsums), mins2);
        __m256i sumi = _mm256_setzero_si256();
#pragma GCC unroll 4
        for (int j = 0; j < 4; j++) {
            __m256i q4 = _mm256_loadu_si256((const __m256i *)(b[k].qs + 32 * j));
            __m256i a0 = _mm256_loadu_si256((const __m256i *)(y[k].qs + 64 * j));
            __m256i a1 = _mm256_loadu_si256((const __m256i *)(y[k].qs + 64 * j + 32));
            __m256i p0 = _mm256_maddubs_epi16(_mm256_and_si256(q4, low4), a0);
            __m256i p1 = _mm256_maddubs_epi16(_mm256_and_si256(_mm256_srli_epi16(q4, 4), low4), a1);
            sumi = _mm256_add_epi32(sumi, _mm256_madd_epi16(p0, K_SCALE(sc, 2 * j)));
            sumi = _mm256_add_epi32(sumi, _mm256_madd_epi16(p1, K_SCALE(sc, 2 * j + 1)));
        }
        float yd = y[k].d;
        acc = _mm256_fmadd_ps(_mm256_set1_ps(yd * cpu_fp16_to_f32(b[k].d)), _mm256_cvtepi32_ps(sumi), acc);
        /* the mins folded in as dot4 does (same order, same result) */
        acc = _mm256_fnmadd_ps(_mm256_set1_ps(yd * cpu_fp16_to_f32(b[k].dmin)), _mm256_cvtepi32_ps(msum), acc);
    }
    return hsum256(acc);
}

AVX2_FN static float dot_q5_k_avx2(const void *w, const void *x, int64_t n) {
    const block_q5_k *b = w;
    const struct cpu_q8k *y = x;
    const __m256i low4 = _mm256_set1_epi8(0x0F), one = _mm256_set1_epi8(1);
    __m256 acc = _mm256_setzero_ps();
    for (int64_t k = 0; k < n / 256; k++) {
        __m256i mins2;
        __m256i sc = k4_scales(b[k].scales, &mins2);
        __m256i msum = _mm256_madd_epi16(_mm256_loadu_si256((const __m256i *)y[k].bsums), mins2);
        __m256i qh = _mm256_loadu_si256((const __m256i *)b[k].qh);
        __m256i sumi = _mm256_setzero_si256();
#pragma GCC unroll 4
        for (int j = 0; j < 4; j++) {
            __m256i q4 = _mm256_loadu_si256((const __m256i *)(b[k].qs + 32 * j));
            /* Bit 2j of each qh byte is the fifth bit of sub-block 2j. */
            __m256i h0 = _mm256_slli_epi16(_mm256_and_si256(_mm256_srli_epi16(qh, 2 * j), one), 4);
            __m256i h1 = _mm256_slli_epi16(_mm256_and_si256(_mm256_srli_epi16(qh, 2 * j + 1), one), 4);
            __m256i w0 = _mm256_or_si256(_mm256_and_si256(q4, low4), h0);
            __m256i w1 = _mm256_or_si256(_mm256_and_si256(_mm256_srli_epi16(q4, 4), low4), h1);
            __m256i a0 = _mm256_loadu_si256((const __m256i *)(y[k].qs + 64 * j));
            __m256i a1 = _mm256_loadu_si256((const __m256i *)(y[k].qs + 64 * j + 32));
            sumi = _mm256_add_epi32(sumi, _mm256_madd_epi16(_mm256_maddubs_epi16(w0, a0), K_SCALE(sc, 2 * j)));
            sumi = _mm256_add_epi32(sumi, _mm256_madd_epi16(_mm256_maddubs_epi16(w1, a1), K_SCALE(sc, 2 * j + 1)));
        }
        float yd = y[k].d;
        acc = _mm256_fmadd_ps(_mm256_set1_ps(yd * cpu_fp16_to_f32(b[k].d)), _mm256_cvtepi32_ps(sumi), acc);
        /* the mins folded in as dot4 does (same order, same result) */
        acc = _mm256_fnmadd_ps(_mm256_set1_ps(yd * cpu_fp16_to_f32(b[k].dmin)), _mm256_cvtepi32_ps(msum), acc);
    }
    return hsum256(acc);
}

/* Q6_K: weights q - 32 with q in 0..63; sum q * a with unsigned bytes and
 * subtract 32 * (activation group sum) per group of 16. */
AVX2_FN static float dot_q6_k_avx2(const void *w, const void *x, int64_t n) {
    const block_q6_k *b = w;
    const struct cpu_q8k *y = x;
    const __m256i low4 = _mm256_set1_epi8(0x0F), three = _mm256_set1_epi8(3);
    __m256 acc = _mm256_setzero_ps();
    for (int64_t k = 0; k < n / 256; k++) {
        const int8_t *sc = b[k].scales;
        int offs = 0;
        for (int g = 0; g < 16; g++) offs += sc[g] * y[k].bsums[g];
        __m256i sumi = _mm256_setzero_si256();
#pragma GCC unroll 2
        for (int h = 0; h < 2; h++) {
            const uint8_t *ql = b[k].ql + 64 * h, *qhp = b[k].qh + 32 * h;
            const int8_t *a = y[k].qs + 128 * h, *s = sc + 8 * h;
            __m256i l0 = _mm256_loadu_si256((const __m256i *)ql);
            __m256i l1 = _mm256_loadu_si256((const __m256i *)(ql + 32));
            __m256i qh = _mm256_loadu_si256((const __m256i *)qhp);
            __m256i q[4];
            q[0] = _mm256_or_si256(_mm256_and_si256(l0, low4), _mm256_slli_epi16(_mm256_and_si256(qh, three), 4));
            q[1] = _mm256_or_si256(_mm256_and_si256(l1, low4),
                                   _mm256_slli_epi16(_mm256_and_si256(_mm256_srli_epi16(qh, 2), three), 4));
            q[2] = _mm256_or_si256(_mm256_and_si256(_mm256_srli_epi16(l0, 4), low4),
                                   _mm256_slli_epi16(_mm256_and_si256(_mm256_srli_epi16(qh, 4), three), 4));
            q[3] = _mm256_or_si256(_mm256_and_si256(_mm256_srli_epi16(l1, 4), low4),
                                   _mm256_slli_epi16(_mm256_and_si256(_mm256_srli_epi16(qh, 6), three), 4));
#pragma GCC unroll 4
            for (int i = 0; i < 4; i++) {
                __m256i p = _mm256_maddubs_epi16(q[i], _mm256_loadu_si256((const __m256i *)(a + 32 * i)));
                /* Bytes 0..15 of the 32 are group 2i, bytes 16..31 group 2i+1. */
                __m256i scale = _mm256_set_m128i(_mm_set1_epi16(s[2 * i + 1]), _mm_set1_epi16(s[2 * i]));
                sumi = _mm256_add_epi32(sumi, _mm256_madd_epi16(p, scale));
            }
        }
        __m256 d = _mm256_set1_ps(y[k].d * cpu_fp16_to_f32(b[k].d));
        /* The offset joins lane 0 before conversion: integer sums are exact. */
        sumi = _mm256_sub_epi32(sumi, _mm256_setr_epi32(32 * offs, 0, 0, 0, 0, 0, 0, 0));
        acc = _mm256_fmadd_ps(d, _mm256_cvtepi32_ps(sumi), acc);
    }
    return hsum256(acc);
}

/* ---- Four activation rows per weight row (prefill) ---- */

#define ROW(x, j, stride) ((const void *)((const uint8_t *)(x) + (size_t)(j) * (stride)))

AVX2_FN static void dot4_f16_avx2(const void *w, const void *x, size_t stride, int64_t n, float *out) {
    const uint16_t *a = w;
    const float *b0 = ROW(x, 0, stride), *b1 = ROW(x, 1, stride), *b2 = ROW(x, 2, stride), *b3 = ROW(x, 3, stride);
    /* Two accumulators per row, named: GCC keeps arrays of vectors in memory. */
    __m256 c00 = _mm256_setzero_ps(), c01 = c00, c10 = c00, c11 = c00, c20 = c00, c21 = c00, c30 = c00, c31 = c00;
    int64_t i = 0;
    for (; i + 16 <= n; i += 16) {
        _mm_prefetch((const char *)(a + i + F16_PREFETCH), _MM_HINT_T0);
        __m256 w0 = _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)(a + i)));
        __m256 w1 = _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)(a + i + 8)));
        c00 = _mm256_fmadd_ps(w0, _mm256_loadu_ps(b0 + i), c00);
        c01 = _mm256_fmadd_ps(w1, _mm256_loadu_ps(b0 + i + 8), c01);
        c10 = _mm256_fmadd_ps(w0, _mm256_loadu_ps(b1 + i), c10);
        c11 = _mm256_fmadd_ps(w1, _mm256_loadu_ps(b1 + i + 8), c11);
        c20 = _mm256_fmadd_ps(w0, _mm256_loadu_ps(b2 + i), c20);
        c21 = _mm256_fmadd_ps(w1, _mm256_loadu_ps(b2 + i + 8), c21);
        c30 = _mm256_fmadd_ps(w0, _mm256_loadu_ps(b3 + i), c30);
        c31 = _mm256_fmadd_ps(w1, _mm256_loadu_ps(b3 + i + 8), c31);
    }
    out[0] = hsum256(_mm256_add_ps(c00, c01));
    out[1] = hsum256(_mm256_add_ps(c10, c11));
    out[2] = hsum256(_mm256_add_ps(c20, c21));
    out[3] = hsum256(_mm256_add_ps(c30, c31));
    for (; i < n; i++) {
        float wi = cpu_fp16_to_f32(a[i]);
        out[0] += wi * b0[i];
        out[1] += wi * b1[i];
        out[2] += wi * b2[i];
        out[3] += wi * b3[i];
    }
}

/* One weight row against nt (3 or 5) activation rows, for the token counts
 * dot4 leaves where one pass measured faster than dot4 and dot passes (a
 * verifying step of k + 1 = 5 rows, the end of a prefill chunk; 2 and 6
 * rows did not gain): each row's operations are dot_f16_avx2's, in its
 * order, so a token's result stays the same whatever its step holds. */
AVX2_INLINE static void dotn_f16_rows(const uint16_t *a, const void *x, size_t stride, int64_t n, float *out,
                                      const int nt) {
    __m256 c0[5], c1[5];
    const float *b[5];
#pragma GCC unroll 5
    for (int t = 0; t < nt; t++) {
        c0[t] = c1[t] = _mm256_setzero_ps();
        b[t] = ROW(x, t, stride);
    }
    int64_t i = 0;
    for (; i + 16 <= n; i += 16) {
        _mm_prefetch((const char *)(a + i + F16_PREFETCH), _MM_HINT_T0);
        __m256 w0 = _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)(a + i)));
        __m256 w1 = _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)(a + i + 8)));
#pragma GCC unroll 5
        for (int t = 0; t < nt; t++) {
            c0[t] = _mm256_fmadd_ps(w0, _mm256_loadu_ps(b[t] + i), c0[t]);
            c1[t] = _mm256_fmadd_ps(w1, _mm256_loadu_ps(b[t] + i + 8), c1[t]);
        }
    }
#pragma GCC unroll 5
    for (int t = 0; t < nt; t++) out[t] = hsum256(_mm256_add_ps(c0[t], c1[t]));
    for (; i < n; i++) {
        float wi = cpu_fp16_to_f32(a[i]);
#pragma GCC unroll 5
        for (int t = 0; t < nt; t++) out[t] += wi * b[t][i];
    }
}

AVX2_FN static void dotn_f16_avx2(const void *w, const void *x, size_t stride, int64_t n, int nt, float *out) {
    if (nt == 3) dotn_f16_rows(w, x, stride, n, out, 3);
    else dotn_f16_rows(w, x, stride, n, out, 5);
}

/* One row of 32 int8 activations against the sign-split weights (|w|, w). */
#define Q8_TERM(aw, qw, ya, d, acc)                                                                     \
    _mm256_fmadd_ps(_mm256_set1_ps(d),                                                                 \
                    _mm256_cvtepi32_ps(_mm256_madd_epi16(                                              \
                        _mm256_maddubs_epi16((aw), _mm256_sign_epi8(_mm256_loadu_si256((const __m256i *)(ya)), (qw))), \
                        ones)),                                                                        \
                    (acc))

/* dot4 and dotn (3 or 5 tokens) of a type from its rows function: one
 * straight-line instance per token count. */
#define ROWS_KERNELS(name)                                                                                      \
    AVX2_FN static void dot4_##name##_avx2(const void *w, const void *x, size_t stride, int64_t n, float *out) { \
        name##_rows(w, x, stride, n, out, 4);                                                                   \
    }                                                                                                           \
    AVX2_FN static void dotn_##name##_avx2(const void *w, const void *x, size_t stride, int64_t n, int nt,       \
                                           float *out) {                                                        \
        if (nt == 3) name##_rows(w, x, stride, n, out, 3);                                                      \
        else name##_rows(w, x, stride, n, out, 5);                                                              \
    }

/* nt (at most 5) rows of activations against one Q8_0 row, or Q4_0 row
 * (q4): the weights decoded once for all of them. */
AVX2_INLINE static void q8_rows(const void *w, const void *x, size_t stride, int64_t n, float *out, const int nt,
                                const int q4) {
    const block_q8_0 *b8 = w;
    const block_q4_0 *b4 = w;
    const struct cpu_q8 *y[5];
    for (int j = 0; j < nt; j++) y[j] = ROW(x, j, stride);
    const __m256i ones = _mm256_set1_epi16(1);
    __m256 c[5];
    for (int j = 0; j < nt; j++) c[j] = _mm256_setzero_ps();
    for (int64_t k = 0; k < n / 32; k++) {
        __m256i qw = q4 ? _mm256_sub_epi8(unpack_nibbles(b4[k].qs), _mm256_set1_epi8(8))
                        : _mm256_loadu_si256((const __m256i *)b8[k].qs);
        __m256i aw = _mm256_sign_epi8(qw, qw);
        float dw = cpu_fp16_to_f32(q4 ? b4[k].d : b8[k].d);
#pragma GCC unroll 5
        for (int j = 0; j < nt; j++) c[j] = Q8_TERM(aw, qw, y[j][k].qs, dw * y[j][k].d, c[j]);
    }
    for (int j = 0; j < nt; j++) out[j] = hsum256(c[j]);
}
AVX2_INLINE static void q8_0_rows(const void *w, const void *x, size_t stride, int64_t n, float *out, const int nt) {
    q8_rows(w, x, stride, n, out, nt, 0);
}
AVX2_INLINE static void q4_0_rows(const void *w, const void *x, size_t stride, int64_t n, float *out, const int nt) {
    q8_rows(w, x, stride, n, out, nt, 1);
}
ROWS_KERNELS(q8_0)

/* Eight weights of a float-like row as floats. */
AVX2_INLINE static __m256 load8_f32(const void *w, int64_t i) { return _mm256_loadu_ps((const float *)w + i); }
AVX2_INLINE static __m256 load8_bf16(const void *w, int64_t i) {
    __m256i h = _mm256_cvtepu16_epi32(_mm_loadu_si128((const __m128i *)((const uint16_t *)w + i)));
    return _mm256_castsi256_ps(_mm256_slli_epi32(h, 16));
}

/* dot4 for F32 and BF16 rows: the F16 kernel's structure with another
 * loader (the loaders inline, so each instance is straight-line code). */
#define DOT4_FLOAT(name, load, scalar)                                                                          \
    AVX2_FN static void name(const void *w, const void *x, size_t stride, int64_t n, float *out) {              \
        const float *b0 = ROW(x, 0, stride), *b1 = ROW(x, 1, stride), *b2 = ROW(x, 2, stride),                  \
                    *b3 = ROW(x, 3, stride);                                                                    \
        __m256 c00 = _mm256_setzero_ps(), c01 = c00, c10 = c00, c11 = c00, c20 = c00, c21 = c00, c30 = c00,     \
               c31 = c00;                                                                                       \
        int64_t i = 0;                                                                                          \
        for (; i + 16 <= n; i += 16) {                                                                          \
            __m256 w0 = load(w, i), w1 = load(w, i + 8);                                                        \
            c00 = _mm256_fmadd_ps(w0, _mm256_loadu_ps(b0 + i), c00);                                            \
            c01 = _mm256_fmadd_ps(w1, _mm256_loadu_ps(b0 + i + 8), c01);                                        \
            c10 = _mm256_fmadd_ps(w0, _mm256_loadu_ps(b1 + i), c10);                                            \
            c11 = _mm256_fmadd_ps(w1, _mm256_loadu_ps(b1 + i + 8), c11);                                        \
            c20 = _mm256_fmadd_ps(w0, _mm256_loadu_ps(b2 + i), c20);                                            \
            c21 = _mm256_fmadd_ps(w1, _mm256_loadu_ps(b2 + i + 8), c21);                                        \
            c30 = _mm256_fmadd_ps(w0, _mm256_loadu_ps(b3 + i), c30);                                            \
            c31 = _mm256_fmadd_ps(w1, _mm256_loadu_ps(b3 + i + 8), c31);                                        \
        }                                                                                                       \
        out[0] = hsum256(_mm256_add_ps(c00, c01));                                                              \
        out[1] = hsum256(_mm256_add_ps(c10, c11));                                                              \
        out[2] = hsum256(_mm256_add_ps(c20, c21));                                                              \
        out[3] = hsum256(_mm256_add_ps(c30, c31));                                                              \
        for (; i < n; i++) {                                                                                    \
            float wi = scalar;                                                                                  \
            out[0] += wi * b0[i];                                                                               \
            out[1] += wi * b1[i];                                                                               \
            out[2] += wi * b2[i];                                                                               \
            out[3] += wi * b3[i];                                                                               \
        }                                                                                                       \
    }

DOT4_FLOAT(dot4_f32_avx2, load8_f32, ((const float *)w)[i])
DOT4_FLOAT(dot4_bf16_avx2, load8_bf16, cpu_bf16_to_f32(((const uint16_t *)w)[i]))

ROWS_KERNELS(q4_0)

/* nt (at most 5) rows of activations against one Q4_K row: the weights
 * decoded once for all of them. */
AVX2_INLINE static void q4_k_rows(const void *w, const void *x, size_t stride, int64_t n, float *out, const int nt) {
    const block_q4_k *b = w;
    const struct cpu_q8k *y[5];
    for (int j = 0; j < nt; j++) y[j] = ROW(x, j, stride);
    const __m256i low4 = _mm256_set1_epi8(0x0F);
    __m256 acc[5];
    for (int j = 0; j < nt; j++) acc[j] = _mm256_setzero_ps();
    for (int64_t k = 0; k < n / 256; k++) {
        __m256i mins2;
        __m256i sc = k4_scales(b[k].scales, &mins2);
        __m256i sumi[5];
        for (int j = 0; j < nt; j++) sumi[j] = _mm256_setzero_si256();
#pragma GCC unroll 4
        for (int i = 0; i < 4; i++) {
            __m256i q4 = _mm256_loadu_si256((const __m256i *)(b[k].qs + 32 * i));
            __m256i lo = _mm256_and_si256(q4, low4), hi = _mm256_and_si256(_mm256_srli_epi16(q4, 4), low4);
            __m256i s0 = K_SCALE(sc, 2 * i), s1 = K_SCALE(sc, 2 * i + 1);
#pragma GCC unroll 5
            for (int j = 0; j < nt; j++) {
                __m256i a0 = _mm256_loadu_si256((const __m256i *)(y[j][k].qs + 64 * i));
                __m256i a1 = _mm256_loadu_si256((const __m256i *)(y[j][k].qs + 64 * i + 32));
                sumi[j] = _mm256_add_epi32(sumi[j], _mm256_madd_epi16(_mm256_maddubs_epi16(lo, a0), s0));
                sumi[j] = _mm256_add_epi32(sumi[j], _mm256_madd_epi16(_mm256_maddubs_epi16(hi, a1), s1));
            }
        }
        float d = cpu_fp16_to_f32(b[k].d), dmin = cpu_fp16_to_f32(b[k].dmin);
        for (int j = 0; j < nt; j++) {
            __m256i msum = _mm256_madd_epi16(_mm256_loadu_si256((const __m256i *)y[j][k].bsums), mins2);
            acc[j] = _mm256_fmadd_ps(_mm256_set1_ps(y[j][k].d * d), _mm256_cvtepi32_ps(sumi[j]), acc[j]);
            acc[j] = _mm256_fnmadd_ps(_mm256_set1_ps(y[j][k].d * dmin), _mm256_cvtepi32_ps(msum), acc[j]);
        }
    }
    for (int j = 0; j < nt; j++) out[j] = hsum256(acc[j]);
}
ROWS_KERNELS(q4_k)

/* nt (at most 5) rows of activations against one Q5_K row. */
AVX2_INLINE static void q5_k_rows(const void *w, const void *x, size_t stride, int64_t n, float *out, const int nt) {
    const block_q5_k *b = w;
    const struct cpu_q8k *y[5];
    for (int j = 0; j < nt; j++) y[j] = ROW(x, j, stride);
    const __m256i low4 = _mm256_set1_epi8(0x0F), one = _mm256_set1_epi8(1);
    __m256 acc[5];
    for (int j = 0; j < nt; j++) acc[j] = _mm256_setzero_ps();
    for (int64_t k = 0; k < n / 256; k++) {
        __m256i mins2;
        __m256i sc = k4_scales(b[k].scales, &mins2);
        __m256i qh = _mm256_loadu_si256((const __m256i *)b[k].qh);
        __m256i sumi[5];
        for (int j = 0; j < nt; j++) sumi[j] = _mm256_setzero_si256();
#pragma GCC unroll 4
        for (int i = 0; i < 4; i++) {
            __m256i q4 = _mm256_loadu_si256((const __m256i *)(b[k].qs + 32 * i));
            __m256i h0 = _mm256_slli_epi16(_mm256_and_si256(_mm256_srli_epi16(qh, 2 * i), one), 4);
            __m256i h1 = _mm256_slli_epi16(_mm256_and_si256(_mm256_srli_epi16(qh, 2 * i + 1), one), 4);
            __m256i lo = _mm256_or_si256(_mm256_and_si256(q4, low4), h0);
            __m256i hi = _mm256_or_si256(_mm256_and_si256(_mm256_srli_epi16(q4, 4), low4), h1);
            __m256i s0 = K_SCALE(sc, 2 * i), s1 = K_SCALE(sc, 2 * i + 1);
#pragma GCC unroll 5
            for (int j = 0; j < nt; j++) {
                __m256i a0 = _mm256_loadu_si256((const __m256i *)(y[j][k].qs + 64 * i));
                __m256i a1 = _mm256_loadu_si256((const __m256i *)(y[j][k].qs + 64 * i + 32));
                sumi[j] = _mm256_add_epi32(sumi[j], _mm256_madd_epi16(_mm256_maddubs_epi16(lo, a0), s0));
                sumi[j] = _mm256_add_epi32(sumi[j], _mm256_madd_epi16(_mm256_maddubs_epi16(hi, a1), s1));
            }
        }
        float d = cpu_fp16_to_f32(b[k].d), dmin = cpu_fp16_to_f32(b[k].dmin);
        for (int j = 0; j < nt; j++) {
            __m256i msum = _mm256_madd_epi16(_mm256_loadu_si256((const __m256i *)y[j][k].bsums), mins2);
            acc[j] = _mm256_fmadd_ps(_mm256_set1_ps(y[j][k].d * d), _mm256_cvtepi32_ps(sumi[j]), acc[j]);
            acc[j] = _mm256_fnmadd_ps(_mm256_set1_ps(y[j][k].d * dmin), _mm256_cvtepi32_ps(msum), acc[j]);
        }
    }
    for (int j = 0; j < nt; j++) out[j] = hsum256(acc[j]);
}
ROWS_KERNELS(q5_k)

/* nt (at most 5) rows of activations against one Q6_K row. */
AVX2_INLINE static void q6_k_rows(const void *w, const void *x, size_t stride, int64_t n, float *out, const int nt) {
    const block_q6_k *b = w;
    const struct cpu_q8k *y[5];
    for (int j = 0; j < nt; j++) y[j] = ROW(x, j, stride);
    const __m256i low4 = _mm256_set1_epi8(0x0F), three = _mm256_set1_epi8(3);
    __m256 acc[5];
    for (int j = 0; j < nt; j++) acc[j] = _mm256_setzero_ps();
    for (int64_t k = 0; k < n / 256; k++) {
        const int8_t *sc = b[k].scales;
        __m256i sumi[5];
        for (int j = 0; j < nt; j++) {
            int offs = 0;
            for (int g = 0; g < 16; g++) offs += sc[g] * y[j][k].bsums[g];
            sumi[j] = _mm256_setr_epi32(-32 * offs, 0, 0, 0, 0, 0, 0, 0);
        }
#pragma GCC unroll 2
        for (int h = 0; h < 2; h++) {
            const uint8_t *ql = b[k].ql + 64 * h, *qhp = b[k].qh + 32 * h;
            const int8_t *s = sc + 8 * h;
            __m256i l0 = _mm256_loadu_si256((const __m256i *)ql);
            __m256i l1 = _mm256_loadu_si256((const __m256i *)(ql + 32));
            __m256i qh = _mm256_loadu_si256((const __m256i *)qhp);
            __m256i q[4];
            q[0] = _mm256_or_si256(_mm256_and_si256(l0, low4), _mm256_slli_epi16(_mm256_and_si256(qh, three), 4));
            q[1] = _mm256_or_si256(_mm256_and_si256(l1, low4),
                                   _mm256_slli_epi16(_mm256_and_si256(_mm256_srli_epi16(qh, 2), three), 4));
            q[2] = _mm256_or_si256(_mm256_and_si256(_mm256_srli_epi16(l0, 4), low4),
                                   _mm256_slli_epi16(_mm256_and_si256(_mm256_srli_epi16(qh, 4), three), 4));
            q[3] = _mm256_or_si256(_mm256_and_si256(_mm256_srli_epi16(l1, 4), low4),
                                   _mm256_slli_epi16(_mm256_and_si256(_mm256_srli_epi16(qh, 6), three), 4));
#pragma GCC unroll 4
            for (int i = 0; i < 4; i++) {
                __m256i scale = _mm256_set_m128i(_mm_set1_epi16(s[2 * i + 1]), _mm_set1_epi16(s[2 * i]));
#pragma GCC unroll 5
                for (int j = 0; j < nt; j++) {
                    __m256i a = _mm256_loadu_si256((const __m256i *)(y[j][k].qs + 128 * h + 32 * i));
                    sumi[j] = _mm256_add_epi32(sumi[j], _mm256_madd_epi16(_mm256_maddubs_epi16(q[i], a), scale));
                }
            }
        }
        float d = cpu_fp16_to_f32(b[k].d);
        for (int j = 0; j < nt; j++)
            acc[j] = _mm256_fmadd_ps(_mm256_set1_ps(y[j][k].d * d), _mm256_cvtepi32_ps(sumi[j]), acc[j]);
    }
    for (int j = 0; j < nt; j++) out[j] = hsum256(acc[j]);
}
ROWS_KERNELS(q6_k)

AVX2_FN static void axpy_f32_avx2(float *y, float a, const void *x_, int64_t n) {
    const float *x = x_;
    __m256 va = _mm256_set1_ps(a);
    int64_t i = 0;
    for (; i + 8 <= n; i += 8)
        _mm256_storeu_ps(y + i, _mm256_fmadd_ps(va, _mm256_loadu_ps(x + i), _mm256_loadu_ps(y + i)));
    for (; i < n; i++) y[i] += a * x[i];
}

AVX2_FN static void axpy_f16_avx2(float *y, float a, const void *x_, int64_t n) {
    const uint16_t *x = x_;
    __m256 va = _mm256_set1_ps(a);
    int64_t i = 0;
    for (; i + 8 <= n; i += 8)
        _mm256_storeu_ps(y + i, _mm256_fmadd_ps(va, _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)(x + i))),
                                                _mm256_loadu_ps(y + i)));
    for (; i < n; i++) y[i] += a * cpu_fp16_to_f32(x[i]);
}

/* ---- Attention over a row's positions (F32 and F16 caches) ----
 * The scores of one query against its positions' K rows, each the one-row
 * dot's operations (so a score is what dot_*_avx2 gives, whatever the
 * count), and the sum of the scores times the V rows in position order,
 * each element's multiply-adds those of axpy_*_avx2 one position after
 * another, held in registers a block of 64 elements at a time instead of
 * going through memory at every position. */
AVX2_FN static void attn_qk_f32_avx2(float *out, const void *const *krows, int32_t n, const float *q, int64_t hd) {
    for (int32_t j = 0; j < n; j++) out[j] = dot_f32_avx2(krows[j], q, hd);
}

AVX2_FN static void attn_qk_f16_avx2(float *out, const void *const *krows, int32_t n, const float *q, int64_t hd) {
    for (int32_t j = 0; j < n; j++) out[j] = dot_f16_avx2(krows[j], q, hd);
}

/* acc[0 .. 8 nb) += sum over j of s[j] * row j (from element c0), nb <= 8. */
AVX2_INLINE static void attn_v_block(float *acc, const float *s, const void *const *vrows, int32_t n, int64_t c0,
                                     const int nb, const bool f16) {
    __m256 a[8];
#pragma GCC unroll 8
    for (int b = 0; b < nb; b++) a[b] = _mm256_loadu_ps(acc + c0 + 8 * b);
    for (int32_t j = 0; j < n; j++) {
        const __m256 va = _mm256_set1_ps(s[j]);
#pragma GCC unroll 8
        for (int b = 0; b < nb; b++) {
            const int64_t c = c0 + 8 * b;
            const __m256 x = f16 ? _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)((const uint16_t *)vrows[j] + c)))
                                 : _mm256_loadu_ps((const float *)vrows[j] + c);
            a[b] = _mm256_fmadd_ps(va, x, a[b]);
        }
    }
#pragma GCC unroll 8
    for (int b = 0; b < nb; b++) _mm256_storeu_ps(acc + c0 + 8 * b, a[b]);
}

AVX2_INLINE static void attn_v_rows(float *acc, const float *s, const void *const *vrows, int32_t n, int64_t hd,
                                    const bool f16) {
    int64_t c0 = 0;
    for (; c0 + 64 <= hd; c0 += 64) attn_v_block(acc, s, vrows, n, c0, 8, f16);
    for (; c0 + 8 <= hd; c0 += 8) attn_v_block(acc, s, vrows, n, c0, 1, f16);
    if (c0 < hd) /* the tail as axpy does it, position by position */
        for (int32_t j = 0; j < n; j++) {
            if (f16) axpy_f16_avx2(acc + c0, s[j], (const uint16_t *)vrows[j] + c0, hd - c0);
            else axpy_f32_avx2(acc + c0, s[j], (const float *)vrows[j] + c0, hd - c0);
        }
}

AVX2_FN static void attn_v_f32_avx2(float *acc, const float *s, const void *const *vrows, int32_t n, int64_t hd) {
    attn_v_rows(acc, s, vrows, n, hd, false);
}

AVX2_FN static void attn_v_f16_avx2(float *acc, const float *s, const void *const *vrows, int32_t n, int64_t hd) {
    attn_v_rows(acc, s, vrows, n, hd, true);
}

/* ---- Activation quantization ---- */

/* Largest |x| over 8k floats. */
AVX2_INLINE static float amax_avx2(const float *x, int n) {
    const __m256 sign = _mm256_set1_ps(-0.0f);
    __m256 m = _mm256_setzero_ps();
    for (int i = 0; i < n; i += 8) m = _mm256_max_ps(m, _mm256_andnot_ps(sign, _mm256_loadu_ps(x + i)));
    __m128 h = _mm_max_ps(_mm256_castps256_ps128(m), _mm256_extractf128_ps(m, 1));
    h = _mm_max_ps(h, _mm_movehl_ps(h, h));
    h = _mm_max_ss(h, _mm_movehdup_ps(h));
    return _mm_cvtss_f32(h);
}

/* 8 floats times id, rounded half away from zero like quant.c's q8_round:
 * add 0.5 with the sign of the value, then truncate. */
AVX2_INLINE static __m256i round8(const float *x, __m256 id) {
    const __m256 sign = _mm256_set1_ps(-0.0f), half = _mm256_set1_ps(0.5f);
    __m256 v = _mm256_mul_ps(_mm256_loadu_ps(x), id);
    return _mm256_cvttps_epi32(_mm256_add_ps(v, _mm256_or_ps(_mm256_and_ps(v, sign), half)));
}

/* Quantizes 32 floats into dst; returns their 8 int32 partial sums per
 * group of 16 in (*s0: elements 0-15, *s1: 16-31) as vectors. */
AVX2_INLINE static void quant32(const float *x, __m256 id, int8_t *dst, __m256i *s0, __m256i *s1) {
    __m256i r0 = round8(x, id), r1 = round8(x + 8, id), r2 = round8(x + 16, id), r3 = round8(x + 24, id);
    /* packs works within 128-bit lanes: undo the interleave at the end. */
    __m256i p = _mm256_packs_epi16(_mm256_packs_epi32(r0, r1), _mm256_packs_epi32(r2, r3));
    p = _mm256_permutevar8x32_epi32(p, _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7));
    _mm256_storeu_si256((__m256i *)dst, p);
    *s0 = _mm256_add_epi32(r0, r1);
    *s1 = _mm256_add_epi32(r2, r3);
}

AVX2_INLINE static int hsum_i32(__m256i v) {
    __m128i s = _mm_add_epi32(_mm256_castsi256_si128(v), _mm256_extracti128_si256(v, 1));
    s = _mm_add_epi32(s, _mm_shuffle_epi32(s, 0x4e));
    s = _mm_add_epi32(s, _mm_shuffle_epi32(s, 0xb1));
    return _mm_cvtsi128_si32(s);
}

AVX2_FN void cpu_act_quant_row_avx2(enum cpu_act act, const float *x, void *dst, int64_t n) {
    if (act == CPU_ACT_Q8) {
        struct cpu_q8 *q = dst;
        for (int64_t b = 0; b < n / 32; b++, x += 32, q++) {
            float amax = amax_avx2(x, 32);
            float id = amax > 0 ? 127.0f / amax : 0.0f;
            __m256i s0, s1;
            quant32(x, _mm256_set1_ps(id), q->qs, &s0, &s1);
            q->d = amax / 127.0f;
            q->s = q->d * (float)hsum_i32(_mm256_add_epi32(s0, s1));
        }
    } else if (act == CPU_ACT_Q8K) {
        struct cpu_q8k *q = dst;
        for (int64_t b = 0; b < n / 256; b++, x += 256, q++) {
            float amax = amax_avx2(x, 256);
            __m256 id = _mm256_set1_ps(amax > 0 ? 127.0f / amax : 0.0f);
            q->d = amax / 127.0f;
            for (int g = 0; g < 8; g++) {
                __m256i s0, s1;
                quant32(x + 32 * g, id, q->qs + 32 * g, &s0, &s1);
                q->bsums[2 * g] = (int16_t)hsum_i32(s0);
                q->bsums[2 * g + 1] = (int16_t)hsum_i32(s1);
            }
        }
    } else {
        memcpy(dst, x, (size_t)n * sizeof(float));
    }
}

cpu_axpy_fn cpu_axpy_avx2(enum dtype t) {
    return t == DTYPE_F32 ? axpy_f32_avx2 : t == DTYPE_F16 ? axpy_f16_avx2 : NULL;
}

cpu_dotn_fn cpu_dotn_avx2(enum dtype t) {
    switch (t) {
    case DTYPE_F16: return dotn_f16_avx2;
    case DTYPE_Q4_0: return dotn_q4_0_avx2;
    case DTYPE_Q8_0: return dotn_q8_0_avx2;
    case DTYPE_Q4_K: return dotn_q4_k_avx2;
    case DTYPE_Q5_K: return dotn_q5_k_avx2;
    case DTYPE_Q6_K: return dotn_q6_k_avx2;
    default: return NULL;
    }
}

cpu_attn_qk_fn cpu_attn_qk_avx2(enum dtype t) {
    return t == DTYPE_F32 ? attn_qk_f32_avx2 : t == DTYPE_F16 ? attn_qk_f16_avx2 : NULL;
}

cpu_attn_v_fn cpu_attn_v_avx2(enum dtype t) {
    return t == DTYPE_F32 ? attn_v_f32_avx2 : t == DTYPE_F16 ? attn_v_f16_avx2 : NULL;
}

cpu_dot4_fn cpu_dot4_avx2(enum dtype t) {
    switch (t) {
    case DTYPE_F32: return dot4_f32_avx2;
    case DTYPE_F16: return dot4_f16_avx2;
    case DTYPE_BF16: return dot4_bf16_avx2;
    case DTYPE_Q4_0: return dot4_q4_0_avx2;
    case DTYPE_Q8_0: return dot4_q8_0_avx2;
    case DTYPE_Q4_K: return dot4_q4_k_avx2;
    case DTYPE_Q5_K: return dot4_q5_k_avx2;
    case DTYPE_Q6_K: return dot4_q6_k_avx2;
    default: return NULL;
    }
}

cpu_dot_fn cpu_dot_avx2(enum dtype t) {
    switch (t) {
    case DTYPE_F32: return dot_f32_avx2;
    case DTYPE_F16: return dot_f16_avx2;
    case DTYPE_BF16: return dot_bf16_avx2;
    case DTYPE_Q4_0: return dot_q4_0_avx2;
    case DTYPE_Q4_1: return dot_q4_1_avx2;
    case DTYPE_Q5_0: return dot_q5_0_avx2;
    case DTYPE_Q5_1: return dot_q5_1_avx2;
    case DTYPE_Q8_0: return dot_q8_0_avx2;
    case DTYPE_Q4_K: return dot_q4_k_avx2;
    case DTYPE_Q5_K: return dot_q5_k_avx2;
    case DTYPE_Q6_K: return dot_q6_k_avx2;
    }
    return NULL;
}

#else

int cpu_has_avx2(void) { return 0; }
void cpu_act_quant_row_avx2(enum cpu_act act, const float *x, void *dst, int64_t n) {
    cpu_act_quant_row_scalar(act, x, dst, n);
}
cpu_dot_fn cpu_dot_avx2(enum dtype t) {
    (void)t;
    return NULL;
}
cpu_dot4_fn cpu_dot4_avx2(enum dtype t) {
    (void)t;
    return NULL;
}
cpu_dotn_fn cpu_dotn_avx2(enum dtype t) {
    (void)t;
    return NULL;
}
cpu_attn_qk_fn cpu_attn_qk_avx2(enum dtype t) {
    (void)t;
    return NULL;
}
cpu_attn_v_fn cpu_attn_v_avx2(enum dtype t) {
    (void)t;
    return NULL;
}
cpu_axpy_fn cpu_axpy_avx2(enum dtype t) {
    (void)t;
    return NULL;
}

#endif
