/* Element types: names, block geometry, fp16/bf16 conversions and row-wise
 * dequantization/quantization for the GGML block layouts GGUF files use.
 * The quantizers are plain round-to-nearest; they serve the synthetic-model
 * writer and tests, not best-quality model conversion. */
#include "dtype.h"

#include <math.h>
#include <string.h>

#include "status.h"

int dtype_valid(int type) {
    switch (type) {
    case DTYPE_F32: case DTYPE_F16: case DTYPE_BF16:
    case DTYPE_Q4_0: case DTYPE_Q4_1: case DTYPE_Q5_0: case DTYPE_Q5_1: case DTYPE_Q8_0:
    case DTYPE_Q4_K: case DTYPE_Q5_K: case DTYPE_Q6_K:
        return 1;
    default:
        return 0;
    }
}

const char *dtype_name(int type) {
    switch (type) {
    case DTYPE_F32: return "F32";
    case DTYPE_F16: return "F16";
    case DTYPE_BF16: return "BF16";
    case DTYPE_Q4_0: return "Q4_0";
    case DTYPE_Q4_1: return "Q4_1";
    case DTYPE_Q5_0: return "Q5_0";
    case DTYPE_Q5_1: return "Q5_1";
    case DTYPE_Q8_0: return "Q8_0";
    case DTYPE_Q4_K: return "Q4_K";
    case DTYPE_Q5_K: return "Q5_K";
    case DTYPE_Q6_K: return "Q6_K";
    default: return "unknown";
    }
}

int64_t dtype_block_elems(enum dtype t) {
    switch (t) {
    case DTYPE_F32: case DTYPE_F16: case DTYPE_BF16: return 1;
    case DTYPE_Q4_0: case DTYPE_Q4_1: case DTYPE_Q5_0: case DTYPE_Q5_1: case DTYPE_Q8_0: return 32;
    case DTYPE_Q4_K: case DTYPE_Q5_K: case DTYPE_Q6_K: return QK_K;
    }
    return 0;
}

size_t dtype_block_bytes(enum dtype t) {
    switch (t) {
    case DTYPE_F32: return 4;
    case DTYPE_F16: return 2;
    case DTYPE_BF16: return 2;
    case DTYPE_Q4_0: return sizeof(block_q4_0);
    case DTYPE_Q4_1: return sizeof(block_q4_1);
    case DTYPE_Q5_0: return sizeof(block_q5_0);
    case DTYPE_Q5_1: return sizeof(block_q5_1);
    case DTYPE_Q8_0: return sizeof(block_q8_0);
    case DTYPE_Q4_K: return sizeof(block_q4_k);
    case DTYPE_Q5_K: return sizeof(block_q5_k);
    case DTYPE_Q6_K: return sizeof(block_q6_k);
    }
    return 0;
}

size_t dtype_row_bytes(enum dtype t, int64_t n) {
    int64_t be = dtype_block_elems(t);
    if (be <= 0 || n < 0) return 0;
    return (size_t)(n / be) * dtype_block_bytes(t);
}

/* ---- fp16 / bf16 ---- */

static inline uint32_t f32_bits(float f) {
    uint32_t u;
    memcpy(&u, &f, 4);
    return u;
}

static inline float bits_f32(uint32_t u) {
    float f;
    memcpy(&f, &u, 4);
    return f;
}

float fp16_to_f32(fp16_t h) {
    uint32_t sign = (uint32_t)(h & 0x8000) << 16;
    uint32_t exp = (h >> 10) & 0x1f;
    uint32_t mant = h & 0x3ff;
    if (exp == 0) {
        /* zero or subnormal: mant * 2^-24 is exact in float */
        float v = (float)mant * 5.9604644775390625e-8f;
        return sign ? -v : v;
    }
    if (exp == 31) return bits_f32(sign | 0x7f800000u | (mant << 13));
    return bits_f32(sign | ((exp + 112) << 23) | (mant << 13));
}

fp16_t f32_to_fp16(float f) {
    uint32_t x = f32_bits(f);
    uint32_t sign = (x >> 16) & 0x8000;
    int32_t exp = (int32_t)((x >> 23) & 0xff);
    uint32_t mant = x & 0x7fffff;
    if (exp == 0xff) {
        if (mant == 0) return (fp16_t)(sign | 0x7c00);
        /* keep NaN a NaN (quiet) with what payload fits */
        return (fp16_t)(sign | 0x7e00 | (mant >> 13));
    }
    int32_t e = exp - 127 + 15;
    if (e >= 31) return (fp16_t)(sign | 0x7c00);
    if (e <= 0) {
        /* subnormal half (or zero): value = M * 2^(e-38); half unit is 2^-24 */
        if (e < -10) return (fp16_t)sign;
        uint32_t m = mant | 0x800000;
        int shift = 14 - e;
        uint32_t half = 1u << (shift - 1);
        uint32_t rem = m & ((1u << shift) - 1);
        uint32_t q = m >> shift;
        if (rem > half || (rem == half && (q & 1))) q++;
        return (fp16_t)(sign | q); /* q == 0x400 carries into the smallest normal */
    }
    uint32_t h = sign | ((uint32_t)e << 10) | (mant >> 13);
    uint32_t rem = mant & 0x1fff;
    /* a carry out of the mantissa bumps the exponent, up to inf: both correct */
    if (rem > 0x1000 || (rem == 0x1000 && (h & 1))) h++;
    return (fp16_t)h;
}

float bf16_to_f32(bf16_t h) { return bits_f32((uint32_t)h << 16); }

bf16_t f32_to_bf16(float f) {
    uint32_t x = f32_bits(f);
    if ((x & 0x7fffffff) > 0x7f800000) return (bf16_t)((x >> 16) | 0x40); /* quiet NaN */
    x += 0x7fff + ((x >> 16) & 1);
    return (bf16_t)(x >> 16);
}

/* Whole rows.  With F16C (checked at run time, as kernels/cpu checks for
 * AVX2) eight elements convert in one instruction, in the default rounding
 * (to nearest even), and give the scalar functions' bits: vcvtps2ph turns
 * overflow into inf and a NaN into a quiet one keeping the payload's top
 * bits, as f32_to_fp16 does.  vcvtph2ps quiets a signalling half NaN where
 * fp16_to_f32 keeps it signalling, so a group of eight holding a NaN is
 * redone element by element. */
#if (defined(__x86_64__) || defined(__i386__)) && (defined(__GNUC__) || defined(__clang__))
#include <cpuid.h>
#include <immintrin.h>
#define DTYPE_F16C 1

/* Asked per row, not cached: the check reads a flag word and one cpuid
 * leaf, and a cache shared by the link's threads would need an atomic for
 * nothing.  AVX (which includes the OS's saving of the ymm registers)
 * through the compiler; F16C from cpuid leaf 1, ECX bit 29, since not
 * every compiler's __builtin_cpu_supports knows "f16c" (clang 14). */
static int dtype_has_f16c(void) {
    __builtin_cpu_init();
    if (!__builtin_cpu_supports("avx")) return 0;
    unsigned a, b, c, d;
    return __get_cpuid(1, &a, &b, &c, &d) && (c >> 29 & 1u);
}

__attribute__((target("avx,f16c"))) static size_t dtype_f32_to_fp16_f16c(const float *src, fp16_t *dst, size_t n) {
    size_t i = 0;
    for (; i + 8 <= n; i += 8)
        _mm_storeu_si128((__m128i *)(dst + i),
                         _mm256_cvtps_ph(_mm256_loadu_ps(src + i), _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC));
    return i;
}

__attribute__((target("avx,f16c"))) static size_t dtype_fp16_to_f32_f16c(const fp16_t *src, float *dst, size_t n) {
    const __m128i abs_mask = _mm_set1_epi16(0x7fff), inf = _mm_set1_epi16(0x7c00);
    size_t i = 0;
    for (; i + 8 <= n; i += 8) {
        __m128i h = _mm_loadu_si128((const __m128i *)(src + i));
        /* |h| > 0x7c00 as signed 16-bit: |h| <= 0x7fff, so no lane wraps */
        if (_mm_movemask_epi8(_mm_cmpgt_epi16(_mm_and_si128(h, abs_mask), inf))) {
            for (size_t k = i; k < i + 8; k++) dst[k] = fp16_to_f32(src[k]);
            continue;
        }
        _mm256_storeu_ps(dst + i, _mm256_cvtph_ps(h));
    }
    return i;
}
#endif

void dtype_f32_to_fp16_row(const float *src, fp16_t *dst, size_t n) {
    size_t i = 0;
#ifdef DTYPE_F16C
    if (dtype_has_f16c()) i = dtype_f32_to_fp16_f16c(src, dst, n);
#endif
    for (; i < n; i++) dst[i] = f32_to_fp16(src[i]);
}

void dtype_fp16_to_f32_row(const fp16_t *src, float *dst, size_t n) {
    size_t i = 0;
#ifdef DTYPE_F16C
    if (dtype_has_f16c()) i = dtype_fp16_to_f32_f16c(src, dst, n);
#endif
    for (; i < n; i++) dst[i] = fp16_to_f32(src[i]);
}

/* ---- dequantization ---- */

static void dequant_q4_0(const block_q4_0 *b, float *y, int64_t nb) {
    for (int64_t i = 0; i < nb; i++, y += 32) {
        float d = fp16_to_f32(b[i].d);
        for (int j = 0; j < 16; j++) {
            y[j] = d * (float)((b[i].qs[j] & 0xf) - 8);
            y[j + 16] = d * (float)((b[i].qs[j] >> 4) - 8);
        }
    }
}

static void dequant_q4_1(const block_q4_1 *b, float *y, int64_t nb) {
    for (int64_t i = 0; i < nb; i++, y += 32) {
        float d = fp16_to_f32(b[i].d), m = fp16_to_f32(b[i].m);
        for (int j = 0; j < 16; j++) {
            y[j] = d * (float)(b[i].qs[j] & 0xf) + m;
            y[j + 16] = d * (float)(b[i].qs[j] >> 4) + m;
        }
    }
}

/* Q5_0/Q5_1: bit j of the little-endian qh word is the 5th bit of element j. */
static void dequant_q5_0(const block_q5_0 *b, float *y, int64_t nb) {
    for (int64_t i = 0; i < nb; i++, y += 32) {
        float d = fp16_to_f32(b[i].d);
        uint32_t qh;
        memcpy(&qh, b[i].qh, 4);
        for (int j = 0; j < 16; j++) {
            int lo = (b[i].qs[j] & 0xf) | (int)(((qh >> j) & 1) << 4);
            int hi = (b[i].qs[j] >> 4) | (int)(((qh >> (j + 16)) & 1) << 4);
            y[j] = d * (float)(lo - 16);
            y[j + 16] = d * (float)(hi - 16);
        }
    }
}

static void dequant_q5_1(const block_q5_1 *b, float *y, int64_t nb) {
    for (int64_t i = 0; i < nb; i++, y += 32) {
        float d = fp16_to_f32(b[i].d), m = fp16_to_f32(b[i].m);
        uint32_t qh;
        memcpy(&qh, b[i].qh, 4);
        for (int j = 0; j < 16; j++) {
            int lo = (b[i].qs[j] & 0xf) | (int)(((qh >> j) & 1) << 4);
            int hi = (b[i].qs[j] >> 4) | (int)(((qh >> (j + 16)) & 1) << 4);
            y[j] = d * (float)lo + m;
            y[j + 16] = d * (float)hi + m;
        }
    }
}

static void dequant_q8_0(const block_q8_0 *b, float *y, int64_t nb) {
    for (int64_t i = 0; i < nb; i++, y += 32) {
        float d = fp16_to_f32(b[i].d);
        for (int j = 0; j < 32; j++) y[j] = d * (float)b[i].qs[j];
    }
}

/* The 12 scale bytes of Q4_K/Q5_K hold 8 six-bit scales and 8 six-bit mins:
 * sub-blocks 0..3 in the low 6 bits of bytes 0..3 (scales) and 4..7 (mins);
 * sub-blocks 4..7 in the nibbles of bytes 8..11, their top 2 bits in the
 * top 2 bits of bytes 0..3 (scales) and 4..7 (mins). */
static inline void k_scale_min(int j, const uint8_t *q, uint8_t *sc, uint8_t *m) {
    if (j < 4) {
        *sc = q[j] & 63;
        *m = q[j + 4] & 63;
    } else {
        *sc = (uint8_t)((q[j + 4] & 0xf) | ((q[j - 4] >> 6) << 4));
        *m = (uint8_t)((q[j + 4] >> 4) | ((q[j] >> 6) << 4));
    }
}

/* Q4_K: each 64 elements use 32 bytes of qs, low nibbles for the first 32
 * (sub-block 2k), high nibbles for the next 32 (sub-block 2k+1). */
static void dequant_q4_k(const block_q4_k *b, float *y, int64_t nb) {
    for (int64_t i = 0; i < nb; i++) {
        float d = fp16_to_f32(b[i].d), dmin = fp16_to_f32(b[i].dmin);
        const uint8_t *q = b[i].qs;
        for (int g = 0; g < 4; g++, q += 32, y += 64) {
            uint8_t s0, m0, s1, m1;
            k_scale_min(2 * g, b[i].scales, &s0, &m0);
            k_scale_min(2 * g + 1, b[i].scales, &s1, &m1);
            float d0 = d * s0, mm0 = dmin * m0, d1 = d * s1, mm1 = dmin * m1;
            for (int l = 0; l < 32; l++) {
                y[l] = d0 * (float)(q[l] & 0xf) - mm0;
                y[l + 32] = d1 * (float)(q[l] >> 4) - mm1;
            }
        }
    }
}

/* Q5_K: as Q4_K, plus a 5th bit from qh: element l of group g takes bit 2g
 * (first 32) or 2g+1 (next 32) of qh[l]. */
static void dequant_q5_k(const block_q5_k *b, float *y, int64_t nb) {
    for (int64_t i = 0; i < nb; i++) {
        float d = fp16_to_f32(b[i].d), dmin = fp16_to_f32(b[i].dmin);
        const uint8_t *q = b[i].qs;
        const uint8_t *qh = b[i].qh;
        for (int g = 0; g < 4; g++, q += 32, y += 64) {
            uint8_t s0, m0, s1, m1;
            k_scale_min(2 * g, b[i].scales, &s0, &m0);
            k_scale_min(2 * g + 1, b[i].scales, &s1, &m1);
            float d0 = d * s0, mm0 = dmin * m0, d1 = d * s1, mm1 = dmin * m1;
            uint8_t u0 = (uint8_t)(1u << (2 * g)), u1 = (uint8_t)(2u << (2 * g));
            for (int l = 0; l < 32; l++) {
                y[l] = d0 * (float)((q[l] & 0xf) + ((qh[l] & u0) ? 16 : 0)) - mm0;
                y[l + 32] = d1 * (float)((q[l] >> 4) + ((qh[l] & u1) ? 16 : 0)) - mm1;
            }
        }
    }
}

/* Q6_K: two halves of 128 elements, each with 64 bytes of ql and 32 of qh.
 * In a half, element l + 32k (l < 32, k = 0..3) takes its low 4 bits from
 * ql[l + 32(k & 1)] (low nibble for k < 2, high nibble for k >= 2) and its
 * top 2 bits from bits 2k..2k+1 of qh[l]; levels are offset by 32.  Scales
 * are signed, one per 16 elements. */
static void dequant_q6_k(const block_q6_k *b, float *y, int64_t nb) {
    for (int64_t i = 0; i < nb; i++) {
        float d = fp16_to_f32(b[i].d);
        const uint8_t *ql = b[i].ql, *qh = b[i].qh;
        const int8_t *sc = b[i].scales;
        for (int h = 0; h < 2; h++, ql += 64, qh += 32, sc += 8, y += 128) {
            for (int l = 0; l < 32; l++) {
                int is = l / 16;
                int q1 = ((ql[l] & 0xf) | (((qh[l] >> 0) & 3) << 4)) - 32;
                int q2 = ((ql[l + 32] & 0xf) | (((qh[l] >> 2) & 3) << 4)) - 32;
                int q3 = ((ql[l] >> 4) | (((qh[l] >> 4) & 3) << 4)) - 32;
                int q4 = ((ql[l + 32] >> 4) | (((qh[l] >> 6) & 3) << 4)) - 32;
                y[l] = d * (float)sc[is] * (float)q1;
                y[l + 32] = d * (float)sc[is + 2] * (float)q2;
                y[l + 64] = d * (float)sc[is + 4] * (float)q3;
                y[l + 96] = d * (float)sc[is + 6] * (float)q4;
            }
        }
    }
}

void dtype_dequant_row(enum dtype t, const void *src, float *dst, int64_t n) {
    int64_t nb = n / dtype_block_elems(t);
    switch (t) {
    case DTYPE_F32:
        memcpy(dst, src, (size_t)n * 4);
        break;
    case DTYPE_F16: {
        const fp16_t *s = src;
        for (int64_t i = 0; i < n; i++) dst[i] = fp16_to_f32(s[i]);
        break;
    }
    case DTYPE_BF16: {
        const bf16_t *s = src;
        for (int64_t i = 0; i < n; i++) dst[i] = bf16_to_f32(s[i]);
        break;
    }
    case DTYPE_Q4_0: dequant_q4_0(src, dst, nb); break;
    case DTYPE_Q4_1: dequant_q4_1(src, dst, nb); break;
    case DTYPE_Q5_0: dequant_q5_0(src, dst, nb); break;
    case DTYPE_Q5_1: dequant_q5_1(src, dst, nb); break;
    case DTYPE_Q8_0: dequant_q8_0(src, dst, nb); break;
    case DTYPE_Q4_K: dequant_q4_k(src, dst, nb); break;
    case DTYPE_Q5_K: dequant_q5_k(src, dst, nb); break;
    case DTYPE_Q6_K: dequant_q6_k(src, dst, nb); break;
    }
}

/* ---- quantization (round to nearest) ---- */

static inline int clampi(int v, int lo, int hi) { return v < lo ? lo : v > hi ? hi : v; }

static void quant_q8_0(const float *x, block_q8_0 *b, int64_t nb) {
    for (int64_t i = 0; i < nb; i++, x += 32) {
        float amax = 0;
        for (int j = 0; j < 32; j++) amax = fmaxf(amax, fabsf(x[j]));
        /* round against the stored (fp16) scale: for small blocks the fp16
         * scale is subnormal and differs from amax/127 by a visible amount */
        b[i].d = f32_to_fp16(amax / 127.0f);
        float d = fp16_to_f32(b[i].d);
        float id = d > 0 ? 1.0f / d : 0.0f;
        for (int j = 0; j < 32; j++) b[i].qs[j] = (int8_t)clampi((int)lrintf(x[j] * id), -127, 127);
    }
}

/* Q4_0 maps the element of largest magnitude to -8 (the one level that has
 * no positive twin), as ggml does, so that extreme keeps full precision. */
static void quant_q4_0(const float *x, block_q4_0 *b, int64_t nb) {
    for (int64_t i = 0; i < nb; i++, x += 32) {
        float amax = 0, max = 0;
        for (int j = 0; j < 32; j++) {
            if (fabsf(x[j]) > amax) {
                amax = fabsf(x[j]);
                max = x[j];
            }
        }
        float d = max / -8.0f;
        /* quantize against the stored (fp16) scale so rounding is consistent */
        b[i].d = f32_to_fp16(d);
        float ds = fp16_to_f32(b[i].d);
        float id = ds != 0 ? 1.0f / ds : 0.0f;
        for (int j = 0; j < 16; j++) {
            int q0 = clampi((int)lrintf(x[j] * id) + 8, 0, 15);
            int q1 = clampi((int)lrintf(x[j + 16] * id) + 8, 0, 15);
            b[i].qs[j] = (uint8_t)(q0 | (q1 << 4));
        }
    }
}

/* Q4_K/Q5_K: per 32-element sub-block an affine range [min, max] (min
 * clamped to <= 0 so zero is representable), the sub-block scales and mins
 * quantized to 6 bits against the block's d/dmin, then each element rounded
 * against the stored scale and min.  nmax is 15 (Q4_K) or 31 (Q5_K). */
static void quant_k_affine(const float *x, int nmax, fp16_t *d_out, fp16_t *dmin_out,
                           uint8_t *scales, uint8_t *q /* 256 levels out */) {
    float sub_scale[8], sub_min[8];
    float max_scale = 0, max_min = 0;
    for (int j = 0; j < 8; j++) {
        const float *xs = x + 32 * j;
        float mn = xs[0], mx = xs[0];
        for (int l = 1; l < 32; l++) {
            mn = fminf(mn, xs[l]);
            mx = fmaxf(mx, xs[l]);
        }
        if (mn > 0) mn = 0;
        sub_scale[j] = (mx - mn) / (float)nmax;
        sub_min[j] = -mn;
        max_scale = fmaxf(max_scale, sub_scale[j]);
        max_min = fmaxf(max_min, sub_min[j]);
    }
    fp16_t dh = f32_to_fp16(max_scale / 63.0f), mh = f32_to_fp16(max_min / 63.0f);
    float d = fp16_to_f32(dh), dmin = fp16_to_f32(mh);
    uint8_t ls[8], lm[8];
    for (int j = 0; j < 8; j++) {
        lm[j] = (uint8_t)(dmin > 0 ? clampi((int)lrintf(sub_min[j] / dmin), 0, 63) : 0);
        /* the scale must reach the top of the range measured from the stored
         * min, so round it up: rounding down would clip the largest elements */
        float top = sub_scale[j] * (float)nmax - sub_min[j] + dmin * lm[j];
        ls[j] = (uint8_t)(d > 0 ? clampi((int)ceilf(top / ((float)nmax * d) - 1e-4f), 0, 63) : 0);
    }
    memset(scales, 0, K_SCALE_SIZE);
    for (int j = 0; j < 8; j++) {
        if (j < 4) {
            scales[j] |= ls[j] & 63;
            scales[j + 4] |= lm[j] & 63;
        } else {
            scales[j + 4] = (uint8_t)((ls[j] & 0xf) | ((lm[j] & 0xf) << 4));
            scales[j - 4] |= (uint8_t)((ls[j] >> 4) << 6);
            scales[j] |= (uint8_t)((lm[j] >> 4) << 6);
        }
    }
    for (int j = 0; j < 8; j++) {
        float sd = d * ls[j], sm = dmin * lm[j];
        float id = sd > 0 ? 1.0f / sd : 0.0f;
        for (int l = 0; l < 32; l++)
            q[32 * j + l] = (uint8_t)clampi((int)lrintf((x[32 * j + l] + sm) * id), 0, nmax);
    }
    *d_out = dh;
    *dmin_out = mh;
}

static void quant_q4_k(const float *x, block_q4_k *b, int64_t nb) {
    uint8_t q[QK_K];
    for (int64_t i = 0; i < nb; i++, x += QK_K) {
        quant_k_affine(x, 15, &b[i].d, &b[i].dmin, b[i].scales, q);
        for (int g = 0; g < 4; g++)
            for (int l = 0; l < 32; l++)
                b[i].qs[32 * g + l] = (uint8_t)(q[64 * g + l] | (q[64 * g + 32 + l] << 4));
    }
}

static void quant_q5_k(const float *x, block_q5_k *b, int64_t nb) {
    uint8_t q[QK_K];
    for (int64_t i = 0; i < nb; i++, x += QK_K) {
        quant_k_affine(x, 31, &b[i].d, &b[i].dmin, b[i].scales, q);
        memset(b[i].qh, 0, sizeof b[i].qh);
        for (int g = 0; g < 4; g++) {
            for (int l = 0; l < 32; l++) {
                int a = q[64 * g + l], c = q[64 * g + 32 + l];
                b[i].qs[32 * g + l] = (uint8_t)((a & 0xf) | ((c & 0xf) << 4));
                if (a & 16) b[i].qh[l] |= (uint8_t)(1u << (2 * g));
                if (c & 16) b[i].qh[l] |= (uint8_t)(2u << (2 * g));
            }
        }
    }
}

/* Q6_K: a symmetric scale per 16 elements (levels -32..31), the 16 scales
 * quantized to int8 against the block's d. */
static void quant_q6_k(const float *x, block_q6_k *b, int64_t nb) {
    for (int64_t i = 0; i < nb; i++, x += QK_K) {
        float sub[16], max_sub = 0;
        for (int j = 0; j < 16; j++) {
            float amax = 0;
            for (int l = 0; l < 16; l++) amax = fmaxf(amax, fabsf(x[16 * j + l]));
            sub[j] = amax / 31.0f;
            max_sub = fmaxf(max_sub, sub[j]);
        }
        b[i].d = f32_to_fp16(max_sub / 127.0f);
        float d = fp16_to_f32(b[i].d);
        int8_t q[QK_K];
        for (int j = 0; j < 16; j++) {
            int s = d > 0 ? clampi((int)lrintf(sub[j] / d), 0, 127) : 0;
            b[i].scales[j] = (int8_t)s;
            float sd = d * s;
            float id = sd > 0 ? 1.0f / sd : 0.0f;
            for (int l = 0; l < 16; l++)
                q[16 * j + l] = (int8_t)clampi((int)lrintf(x[16 * j + l] * id), -32, 31);
        }
        memset(b[i].qh, 0, sizeof b[i].qh);
        for (int h = 0; h < 2; h++) {
            const int8_t *qq = q + 128 * h;
            uint8_t *ql = b[i].ql + 64 * h, *qh = b[i].qh + 32 * h;
            for (int l = 0; l < 32; l++) {
                int q1 = qq[l] + 32, q2 = qq[l + 32] + 32, q3 = qq[l + 64] + 32, q4 = qq[l + 96] + 32;
                ql[l] = (uint8_t)((q1 & 0xf) | ((q3 & 0xf) << 4));
                ql[l + 32] = (uint8_t)((q2 & 0xf) | ((q4 & 0xf) << 4));
                qh[l] = (uint8_t)((q1 >> 4) | ((q2 >> 4) << 2) | ((q3 >> 4) << 4) | ((q4 >> 4) << 6));
            }
        }
    }
}

int dtype_quant_row(enum dtype t, const float *src, void *dst, int64_t n) {
    int64_t be = dtype_block_elems(t);
    if (be <= 0) return STATUS_UNSUPPORTED;
    if (n < 0 || n % be != 0) return STATUS_BAD_INPUT;
    int64_t nb = n / be;
    switch (t) {
    case DTYPE_F32:
        memcpy(dst, src, (size_t)n * 4);
        return STATUS_OK;
    case DTYPE_F16: {
        fp16_t *d = dst;
        for (int64_t i = 0; i < n; i++) d[i] = f32_to_fp16(src[i]);
        return STATUS_OK;
    }
    case DTYPE_BF16: {
        bf16_t *d = dst;
        for (int64_t i = 0; i < n; i++) d[i] = f32_to_bf16(src[i]);
        return STATUS_OK;
    }
    case DTYPE_Q8_0: quant_q8_0(src, dst, nb); return STATUS_OK;
    case DTYPE_Q4_0: quant_q4_0(src, dst, nb); return STATUS_OK;
    case DTYPE_Q4_K: quant_q4_k(src, dst, nb); return STATUS_OK;
    case DTYPE_Q5_K: quant_q5_k(src, dst, nb); return STATUS_OK;
    case DTYPE_Q6_K: quant_q6_k(src, dst, nb); return STATUS_OK;
    default: return STATUS_UNSUPPORTED;
    }
}
