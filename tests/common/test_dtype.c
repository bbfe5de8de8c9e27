/* Tests for common/dtype: fp16/bf16 conversions at their edges, every
 * dequantizer against an independent element-by-element decoder written
 * here from the GGML layout description, quantize/dequantize error bounds,
 * and the real synth256/stories260K quantizations against their F32 source. */
#include "common/dtype.h"
#include "common/gguf.h"
#include "common/status.h"
#include "tests/test.h"

#include <float.h>
#include <stdint.h>

static uint64_t rng_state = 0x9e3779b97f4a7c15ull;
static uint32_t rnd_u32(void) {
    rng_state ^= rng_state << 13;
    rng_state ^= rng_state >> 7;
    rng_state ^= rng_state << 17;
    return (uint32_t)(rng_state >> 11);
}
static float rnd_unit(void) { return (float)(rnd_u32() & 0xffffff) / 16777216.0f; }
static float rnd_normal(void) {
    float u1 = rnd_unit() + 1e-7f, u2 = rnd_unit();
    return sqrtf(-2.0f * logf(u1)) * cosf(6.2831853f * u2);
}
static void rnd_bytes(void *p, size_t n) {
    uint8_t *b = p;
    for (size_t i = 0; i < n; i++) b[i] = (uint8_t)rnd_u32();
}

/* ---- an independent reference decoder ----
 * Reads element e of a block straight from the layout description: which
 * byte, which bits.  Kept deliberately naive (one element at a time). */

static float ref_h(const uint8_t *p) { /* little-endian fp16 at p, via the compiler's _Float16 */
    uint16_t u = (uint16_t)(p[0] | (p[1] << 8));
    _Float16 h;
    memcpy(&h, &u, 2);
    return (float)h;
}
static int bit(const uint8_t *p, int i) { return (p[i / 8] >> (i % 8)) & 1; }
static int nib(const uint8_t *p, int i) { return (p[i / 2] >> (4 * (i % 2))) & 0xf; }

/* The 6-bit scale and min of sub-block j in the 12-byte K_SCALE field. */
static void ref_k_scale(const uint8_t *s, int j, int *sc, int *mn) {
    if (j < 4) {
        *sc = s[j] & 0x3f;
        *mn = s[4 + j] & 0x3f;
    } else {
        *sc = (s[8 + (j - 4)] & 0x0f) + 16 * ((s[j - 4] >> 6) & 3);
        *mn = ((s[8 + (j - 4)] >> 4) & 0x0f) + 16 * ((s[j] >> 6) & 3);
    }
}

static float ref_elem(enum dtype t, const uint8_t *blk, int e) {
    switch (t) {
    case DTYPE_Q4_0: { /* d | 16 bytes: element e<16 low nibble of byte e, else high nibble of byte e-16 */
        int q = e < 16 ? (blk[2 + e] & 0xf) : (blk[2 + e - 16] >> 4);
        return ref_h(blk) * (float)(q - 8);
    }
    case DTYPE_Q4_1: {
        int q = e < 16 ? (blk[4 + e] & 0xf) : (blk[4 + e - 16] >> 4);
        return ref_h(blk) * (float)q + ref_h(blk + 2);
    }
    case DTYPE_Q5_0: { /* d | qh (32 bits, bit e) | qs */
        int q = (e < 16 ? (blk[6 + e] & 0xf) : (blk[6 + e - 16] >> 4)) + 16 * bit(blk + 2, e);
        return ref_h(blk) * (float)(q - 16);
    }
    case DTYPE_Q5_1: {
        int q = (e < 16 ? (blk[8 + e] & 0xf) : (blk[8 + e - 16] >> 4)) + 16 * bit(blk + 4, e);
        return ref_h(blk) * (float)q + ref_h(blk + 2);
    }
    case DTYPE_Q8_0:
        return ref_h(blk) * (float)(int8_t)blk[2 + e];
    case DTYPE_Q4_K: { /* d dmin | scales[12] | qs[128] */
        int j = e / 32, g = e / 64, p = e % 64;
        int q = p < 32 ? (blk[16 + 32 * g + p] & 0xf) : (blk[16 + 32 * g + p - 32] >> 4);
        int sc, mn;
        ref_k_scale(blk + 4, j, &sc, &mn);
        return ref_h(blk) * (float)sc * (float)q - ref_h(blk + 2) * (float)mn;
    }
    case DTYPE_Q5_K: { /* d dmin | scales[12] | qh[32] | qs[128] */
        int j = e / 32, g = e / 64, p = e % 64;
        int q = p < 32 ? (blk[48 + 32 * g + p] & 0xf) : (blk[48 + 32 * g + p - 32] >> 4);
        q += 16 * ((blk[16 + p % 32] >> j) & 1); /* sub-block j uses bit j of qh[l] */
        int sc, mn;
        ref_k_scale(blk + 4, j, &sc, &mn);
        return ref_h(blk) * (float)sc * (float)q - ref_h(blk + 2) * (float)mn;
    }
    case DTYPE_Q6_K: { /* ql[128] | qh[64] | scales[16] int8 | d */
        int h = e / 128, r = e % 128, k = r / 32, l = r % 32;
        const uint8_t *ql = blk + 64 * h, *qh = blk + 128 + 32 * h;
        int lo = nib(ql, 2 * (l + 32 * (k & 1)) + (k >> 1));
        int hi = (qh[l] >> (2 * k)) & 3;
        int sc = (int8_t)blk[192 + e / 16];
        return ref_h(blk + 208) * (float)sc * (float)(lo + 16 * hi - 32);
    }
    default:
        return NAN;
    }
}

/* Random bytes with the fp16 scale fields replaced by moderate values, so
 * the comparison is not dominated by inf/nan arithmetic. */
static void rnd_block(enum dtype t, uint8_t *blk) {
    size_t bb = dtype_block_bytes(t);
    rnd_bytes(blk, bb);
    fp16_t d1 = f32_to_fp16((rnd_unit() - 0.5f) * 0.02f), d2 = f32_to_fp16(rnd_unit() * 0.01f);
    switch (t) {
    case DTYPE_Q4_1: case DTYPE_Q5_1: case DTYPE_Q4_K: case DTYPE_Q5_K:
        memcpy(blk, &d1, 2);
        memcpy(blk + 2, &d2, 2);
        break;
    case DTYPE_Q6_K:
        memcpy(blk + 208, &d1, 2);
        break;
    default:
        memcpy(blk, &d1, 2);
    }
}

static const enum dtype quant_types[] = {DTYPE_Q4_0, DTYPE_Q4_1, DTYPE_Q5_0, DTYPE_Q5_1,
                                         DTYPE_Q8_0, DTYPE_Q4_K, DTYPE_Q5_K, DTYPE_Q6_K};

TEST(dtype_names_and_sizes) {
    ASSERT_STREQ("Q4_K", dtype_name(DTYPE_Q4_K));
    ASSERT_STREQ("BF16", dtype_name(DTYPE_BF16));
    ASSERT_STREQ("unknown", dtype_name(23));
    ASSERT_EQ(0, dtype_valid(23));
    ASSERT_EQ(0, dtype_valid(-1));
    ASSERT_EQ(1, dtype_valid(DTYPE_Q6_K));
    ASSERT_EQ((int64_t)256, dtype_block_elems(DTYPE_Q5_K));
    ASSERT_EQ((int64_t)32, dtype_block_elems(DTYPE_Q5_1));
    ASSERT_EQ((size_t)2, dtype_block_bytes(DTYPE_BF16));
    ASSERT_EQ((size_t)(4096 / 256 * 210), dtype_row_bytes(DTYPE_Q6_K, 4096));
    ASSERT_EQ((size_t)(64 / 32 * 34), dtype_row_bytes(DTYPE_Q8_0, 64));
    ASSERT_EQ((size_t)(172 * 2), dtype_row_bytes(DTYPE_F16, 172));
}

TEST(dtype_fp16_edges) {
    /* named values */
    ASSERT_EQ(0x0000u, (unsigned)f32_to_fp16(0.0f));
    ASSERT_EQ(0x8000u, (unsigned)f32_to_fp16(-0.0f));
    ASSERT_EQ(0x3c00u, (unsigned)f32_to_fp16(1.0f));
    ASSERT_EQ(0x7bffu, (unsigned)f32_to_fp16(65504.0f));
    ASSERT_EQ(0x7bffu, (unsigned)f32_to_fp16(65519.0f));  /* below the midpoint to 65536 */
    ASSERT_EQ(0x7c00u, (unsigned)f32_to_fp16(65520.0f));  /* the tie rounds to even: inf */
    ASSERT_EQ(0xfc00u, (unsigned)f32_to_fp16(-1e10f));
    ASSERT_EQ(0x7c00u, (unsigned)f32_to_fp16(INFINITY));
    ASSERT_EQ(0x0001u, (unsigned)f32_to_fp16(5.9604645e-8f));      /* 2^-24 */
    ASSERT_EQ(0x0000u, (unsigned)f32_to_fp16(2.98023224e-8f));     /* 2^-25: tie to even 0 */
    ASSERT_EQ(0x0001u, (unsigned)f32_to_fp16(2.9802326e-8f));      /* just above 2^-25 */
    ASSERT_EQ(0x0002u, (unsigned)f32_to_fp16(8.94069672e-8f));     /* 1.5 * 2^-24: tie to 2 */
    ASSERT_EQ(0x0400u, (unsigned)f32_to_fp16(6.1035156e-5f));      /* 2^-14 smallest normal */
    ASSERT_EQ(0x0400u, (unsigned)f32_to_fp16(6.1032176e-5f));      /* max subnormal + half ulp rounds up */
    ASSERT_EQ(0x3c00u, (unsigned)f32_to_fp16(1.00048828125f));     /* 1 + 2^-11: tie to even */
    ASSERT_EQ(0x3c02u, (unsigned)f32_to_fp16(1.00146484375f));     /* 1 + 3*2^-11: tie to even up */
    fp16_t n = f32_to_fp16(NAN);
    ASSERT_TRUE((n & 0x7c00) == 0x7c00 && (n & 0x3ff) != 0);
    ASSERT_TRUE(isnan(fp16_to_f32(0x7e00)));
    ASSERT_TRUE(isinf(fp16_to_f32(0xfc00)) && fp16_to_f32(0xfc00) < 0);
    ASSERT_EQ(5.9604645e-8f, fp16_to_f32(0x0001));
    ASSERT_EQ(-65504.0f, fp16_to_f32(0xfbff));
    /* every half survives the round trip, and decodes as the compiler does */
    for (uint32_t u = 0; u < 65536; u++) {
        _Float16 h;
        uint16_t b = (uint16_t)u;
        memcpy(&h, &b, 2);
        float f = fp16_to_f32(b);
        if (isnan((float)h)) {
            ASSERT_TRUE(isnan(f));
            continue;
        }
        ASSERT_EQ((float)h, f);
        ASSERT_EQ((unsigned)u, (unsigned)f32_to_fp16(f));
    }
    /* random floats over the whole exponent range round as the compiler does */
    for (int i = 0; i < 2000000; i++) {
        uint32_t bits = rnd_u32() ^ (rnd_u32() << 16);
        float f;
        memcpy(&f, &bits, 4);
        if (isnan(f)) continue;
        if (i & 1) f = ldexpf(f, -(int)(bits % 64)) ; /* bias toward the half range */
        _Float16 h = (_Float16)f;
        uint16_t want;
        memcpy(&want, &h, 2);
        if (f32_to_fp16(f) != want) TEST_FAIL("f32_to_fp16(%.9g): expected 0x%04x, got 0x%04x", f, want, f32_to_fp16(f));
    }
}

/* The row conversions (F16C where this CPU has it) against the scalar
 * functions, bit for bit: every half, the floats at and between every pair
 * of neighbouring halves (the ties), NaNs with payloads, denormals,
 * overflow, and random bit patterns; at every tail length and offset. */
static uint32_t f32_bits_of(float f) {
    uint32_t u;
    memcpy(&u, &f, 4);
    return u;
}
static float f32_of_bits(uint32_t u) {
    float f;
    memcpy(&f, &u, 4);
    return f;
}

static void check_encode_row(const float *src, size_t n) {
    static fp16_t got[1024 + 8];
    for (size_t off = 0; off < 2; off++) { /* off: halves not 4-byte aligned */
        dtype_f32_to_fp16_row(src, got + off, n);
        for (size_t i = 0; i < n; i++)
            if (got[off + i] != f32_to_fp16(src[i]))
                TEST_FAIL("dtype_f32_to_fp16_row(0x%08x) at %zu of %zu: expected 0x%04x, got 0x%04x",
                          f32_bits_of(src[i]), i, n, f32_to_fp16(src[i]), got[off + i]);
    }
}

TEST(dtype_fp16_rows_match_scalar) {
    enum { CHUNK = 1024 };
    static float f[CHUNK + 1];
    static fp16_t h[65536 + 1];
    static float out[65536];
    /* decode: every half, from an aligned and an unaligned start */
    for (size_t off = 0; off < 2; off++) {
        for (uint32_t u = 0; u < 65536; u++) h[off + u] = (fp16_t)u;
        dtype_fp16_to_f32_row(h + off, out, 65536);
        for (uint32_t u = 0; u < 65536; u++)
            if (f32_bits_of(out[u]) != f32_bits_of(fp16_to_f32((fp16_t)u)))
                TEST_FAIL("dtype_fp16_to_f32_row(0x%04x): expected 0x%08x, got 0x%08x", u,
                          f32_bits_of(fp16_to_f32((fp16_t)u)), f32_bits_of(out[u]));
    }
    /* every tail length, each group holding a NaN somewhere or not */
    for (size_t n = 0; n <= 40; n++) {
        for (size_t i = 0; i < n; i++) h[i] = (fp16_t)(i == n / 2 && (n & 1) ? 0x7c01 : rnd_u32());
        dtype_fp16_to_f32_row(h, out, n);
        for (size_t i = 0; i < n; i++) ASSERT_EQ(f32_bits_of(fp16_to_f32(h[i])), f32_bits_of(out[i]));
    }
    /* encode: named edges */
    static const uint32_t edges[] = {
        0x00000000, 0x80000000, 0x00000001, 0x807fffff, 0x007fffff, /* zeros, f32 denormals */
        0x33000000, 0x33000001, 0xb3000000, 0x33c00000, 0x337fffff, /* 2^-25 ties, around 2^-24 */
        0x387fc000, 0x387fe000, 0x387fffff, 0x38800000,             /* top of the half denormals */
        0x3f801000, 0x3f803000, 0x3f800fff, 0x3f801001,             /* 1 + ties */
        0x477fe000, 0x477fefff, 0x477ff000, 0xc77ff000, 0x47800000, 0x7f7fffff, 0xff7fffff, /* overflow */
        0x7f800000, 0xff800000,                                     /* inf */
        0x7fc00000, 0xffc00000, 0x7f800001, 0xff800001, 0x7fbfffff, 0x7fffffff, 0x7f802000, 0x7fc01fff, /* NaN */
    };
    size_t n_edges = sizeof edges / sizeof edges[0];
    for (size_t i = 0; i < n_edges; i++) f[i] = f32_of_bits(edges[i]);
    for (size_t n = 0; n <= n_edges; n++) check_encode_row(f, n);
    /* every half's value and the float halfway to the next, both signs */
    size_t k = 0;
    for (uint32_t u = 0; u < 65536; u++) {
        uint32_t b = f32_bits_of(fp16_to_f32((fp16_t)u));
        f[k++] = f32_of_bits(b);
        if ((u & 0x7fff) < 0x7c00) { /* the tie above it, and one ulp either side of the tie */
            float lo = fp16_to_f32((fp16_t)u), hi = (u & 0x7fff) == 0x7bff ? (u & 0x8000 ? -65536.0f : 65536.0f)
                                                                              : fp16_to_f32((fp16_t)(u + 1));
            float mid = (float)(((double)lo + (double)hi) / 2);
            f[k++] = mid;
            f[k++] = f32_of_bits(f32_bits_of(mid) + 1);
            f[k++] = f32_of_bits(f32_bits_of(mid) - 1);
        }
        if (k + 4 > CHUNK) {
            check_encode_row(f, k);
            k = 0;
        }
    }
    check_encode_row(f, k);
    /* random bit patterns (NaNs included), random lengths */
    for (int r = 0; r < 4000; r++) {
        size_t n = rnd_u32() % (CHUNK + 1);
        for (size_t i = 0; i < n; i++) {
            uint32_t bits = rnd_u32() ^ (rnd_u32() << 16);
            f[i] = (i & 1) ? ldexpf(f32_of_bits(bits), -(int)(bits % 64)) : f32_of_bits(bits);
        }
        check_encode_row(f, n);
    }
}

TEST(dtype_bf16_edges) {
    ASSERT_EQ(0x3f80u, (unsigned)f32_to_bf16(1.0f));
    ASSERT_EQ(0x8000u, (unsigned)f32_to_bf16(-0.0f));
    ASSERT_EQ(0x7f80u, (unsigned)f32_to_bf16(INFINITY));
    ASSERT_EQ(0x7f80u, (unsigned)f32_to_bf16(FLT_MAX)); /* rounds past the largest bf16 */
    ASSERT_EQ(0x3f80u, (unsigned)f32_to_bf16(1.00390625f)); /* 1 + 2^-8: tie to even */
    ASSERT_EQ(0x3f82u, (unsigned)f32_to_bf16(1.01171875f)); /* 1 + 3*2^-8: tie up to even */
    uint32_t above_tie = 0x3f808001; /* 1 + 2^-8 + 2^-23: just above the tie */
    float fa;
    memcpy(&fa, &above_tie, 4);
    ASSERT_EQ(0x3f81u, (unsigned)f32_to_bf16(fa));
    ASSERT_EQ(0x0001u, (unsigned)f32_to_bf16(9.1835496e-41f)); /* bf16 subnormal */
    ASSERT_TRUE(isnan(bf16_to_f32(f32_to_bf16(NAN))));
    uint32_t nan_low = 0x7f800001; /* a NaN whose payload sits below bit 16 */
    float fn;
    memcpy(&fn, &nan_low, 4);
    ASSERT_TRUE(isnan(bf16_to_f32(f32_to_bf16(fn))));
    /* random values: the result is the nearer neighbour, ties to even */
    for (int i = 0; i < 1000000; i++) {
        uint32_t bits = rnd_u32() ^ (rnd_u32() << 16);
        float f;
        memcpy(&f, &bits, 4);
        if (isnan(f) || isinf(f)) continue;
        bf16_t r = f32_to_bf16(f);
        uint32_t lo = bits & 0xffff0000u, hi = lo + 0x10000u;
        uint32_t rem = bits & 0xffff;
        uint32_t want = rem < 0x8000 ? lo : rem > 0x8000 ? hi : ((lo >> 16) & 1 ? hi : lo);
        ASSERT_EQ((unsigned)(want >> 16), (unsigned)r);
        ASSERT_EQ((unsigned)r, (unsigned)f32_to_bf16(bf16_to_f32(r)));
    }
}

TEST(dtype_dequant_matches_reference) {
    enum { NB = 64 };
    static uint8_t buf[NB * 210];
    static float out[NB * 256];
    for (size_t ti = 0; ti < sizeof quant_types / sizeof quant_types[0]; ti++) {
        enum dtype t = quant_types[ti];
        int64_t be = dtype_block_elems(t);
        size_t bb = dtype_block_bytes(t);
        for (int rep = 0; rep < 20; rep++) {
            for (int b = 0; b < NB; b++) rnd_block(t, buf + b * bb);
            dtype_dequant_row(t, buf, out, NB * be);
            for (int b = 0; b < NB; b++) {
                for (int e = 0; e < be; e++) {
                    float want = ref_elem(t, buf + b * bb, e), got = out[b * be + e];
                    if (!(fabsf(want - got) <= 1e-6f * fabsf(want) + 1e-12f))
                        TEST_FAIL("%s block %d element %d: expected %.9g, got %.9g", dtype_name(t), b, e, want, got);
                }
            }
        }
    }
    /* F16 and BF16 rows decode element by element */
    uint16_t h[64];
    float f[64];
    rnd_bytes(h, sizeof h);
    dtype_dequant_row(DTYPE_BF16, h, f, 64);
    for (int i = 0; i < 64; i++) {
        uint32_t u = (uint32_t)h[i] << 16;
        float w;
        memcpy(&w, &u, 4);
        if (!isnan(w)) ASSERT_EQ(w, f[i]);
    }
    dtype_dequant_row(DTYPE_F16, h, f, 64);
    for (int i = 0; i < 64; i++)
        if (!isnan(f[i])) ASSERT_EQ(ref_h((const uint8_t *)&h[i]), f[i]);
}

/* Quantize Gaussian rows (with a few outliers), dequantize, and bound the
 * error: per element for the formats with a closed-form bound, normalised
 * RMS error for all. */
TEST(dtype_quant_roundtrip_bounds) {
    enum { N = 256 * 16 };
    static float x[N], y[N];
    static uint8_t q[N * 4];
    struct { enum dtype t; double nrmse_max; } cases[] = {
        {DTYPE_F32, 0}, {DTYPE_F16, 6e-4}, {DTYPE_BF16, 4e-3}, {DTYPE_Q8_0, 8e-3},
        {DTYPE_Q4_0, 0.13}, {DTYPE_Q4_K, 0.11}, {DTYPE_Q5_K, 0.055}, {DTYPE_Q6_K, 0.03},
    };
    for (size_t c = 0; c < sizeof cases / sizeof cases[0]; c++) {
        enum dtype t = cases[c].t;
        double se = 0, sx = 0;
        for (int rep = 0; rep < 8; rep++) {
            float scale = rep == 7 ? 1e-3f : (float)(rep + 1) * 0.5f;
            for (int i = 0; i < N; i++) x[i] = rnd_normal() * scale + (rep == 3 ? 0.5f : 0.0f);
            if (rep == 5) for (int i = 0; i < N; i += 97) x[i] *= 8; /* outliers */
            if (rep == 6) for (int i = 0; i < 512; i++) x[i] = 0;    /* all-zero blocks */
            ASSERT_OK(dtype_quant_row(t, x, q, N));
            dtype_dequant_row(t, q, y, N);
            for (int i = 0; i < N; i++) {
                se += (double)(x[i] - y[i]) * (x[i] - y[i]);
                sx += (double)x[i] * x[i];
            }
            if (rep == 6)
                for (int i = 0; i < 512; i++) ASSERT_EQ(0.0f, y[i]);
            /* closed-form bounds for the symmetric 32-element formats */
            if (t == DTYPE_Q8_0 || t == DTYPE_Q4_0) {
                for (int b = 0; b < N / 32; b++) {
                    float amax = 0;
                    for (int i = 0; i < 32; i++) amax = fmaxf(amax, fabsf(x[32 * b + i]));
                    /* Q8_0: half a step of amax/127; Q4_0: a full step of amax/8
                     * (the positive side tops out at 7 of 8 steps); both plus
                     * the scale's fp16 rounding */
                    float step = t == DTYPE_Q8_0 ? amax / 127 * 0.5f : amax / 8;
                    /* the fp16 scale may be subnormal: 2^-25 absolute rounding, times 127 levels */
                    float bound = step * 1.001f + amax * 1e-3f + 127.0f * 2.9802322e-8f;
                    for (int i = 0; i < 32; i++)
                        if (fabsf(x[32 * b + i] - y[32 * b + i]) > bound)
                            TEST_FAIL("%s element %d: %.6g -> %.6g, bound %.3g", dtype_name(t), 32 * b + i,
                                      x[32 * b + i], y[32 * b + i], bound);
                }
            }
        }
        double nrmse = sqrt(se / sx);
        printf("  %-5s nrmse %.5f (bound %.5f)\n", dtype_name(t), nrmse, cases[c].nrmse_max);
        ASSERT_TRUE(nrmse <= cases[c].nrmse_max);
    }
}

TEST(dtype_quant_row_refuses) {
    float x[64] = {0};
    uint8_t q[256];
    ASSERT_EQ((int)STATUS_UNSUPPORTED, dtype_quant_row(DTYPE_Q4_1, x, q, 32));
    ASSERT_EQ((int)STATUS_UNSUPPORTED, dtype_quant_row(DTYPE_Q5_0, x, q, 32));
    ASSERT_EQ((int)STATUS_BAD_INPUT, dtype_quant_row(DTYPE_Q8_0, x, q, 48));
    ASSERT_EQ((int)STATUS_BAD_INPUT, dtype_quant_row(DTYPE_Q4_K, x, q, 64));
    ASSERT_EQ((int)STATUS_UNSUPPORTED, dtype_quant_row((enum dtype)23, x, q, 32));
}

/* The llama.cpp quantizations of synth256 (Gaussian * 0.02 weights) must
 * decode close to the F32 source: normalised RMS error in the range each
 * format's precision gives, which a wrong bit layout would miss by far. */
static void compare_to_f32(const char *qname, const char *fname, const char *tname, double lo, double hi,
                           enum dtype want_type) {
    char err[512];
    gguf_file *fq = NULL, *ff = NULL;
    float *a = NULL, *b = NULL;
    const char *p = test_model_path(qname);
    char qpath[2048];
    snprintf(qpath, sizeof qpath, "%s", p);
    ASSERT_OK(gguf_open(&fq, qpath, err, sizeof err));
    ASSERT_OK(gguf_open(&ff, test_model_path(fname), err, sizeof err));
    const struct gguf_tensor *tq = gguf_tensor_find(fq, tname), *tf = gguf_tensor_find(ff, tname);
    ASSERT_TRUE(tq && tf);
    ASSERT_EQ((int)want_type, (int)tq->type);
    ASSERT_EQ((int)DTYPE_F32, (int)tf->type);
    ASSERT_EQ(tf->ne[0], tq->ne[0]);
    ASSERT_EQ(tf->ne[1], tq->ne[1]);
    int64_t n = tf->ne[0] * tf->ne[1];
    a = malloc((size_t)n * 4);
    b = malloc((size_t)n * 4);
    ASSERT_TRUE(a && b);
    size_t rb = dtype_row_bytes(tq->type, tq->ne[0]);
    for (int64_t r = 0; r < tq->ne[1]; r++)
        dtype_dequant_row(tq->type, (const uint8_t *)tq->data + r * rb, a + r * tq->ne[0], tq->ne[0]);
    memcpy(b, tf->data, (size_t)n * 4);
    double se = 0, sx = 0;
    for (int64_t i = 0; i < n; i++) {
        se += (double)(a[i] - b[i]) * (a[i] - b[i]);
        sx += (double)b[i] * b[i];
    }
    double nrmse = sqrt(se / sx);
    printf("  %s %s (%s): nrmse %.5f\n", qname, tname, dtype_name(tq->type), nrmse);
    if (!(nrmse >= lo && nrmse <= hi)) TEST_FAIL("%s %s: nrmse %.5f outside [%g, %g]", qname, tname, nrmse, lo, hi);
    /* our own quantizer lands in the same range as llama.cpp's */
    if (want_type != DTYPE_Q5_0) {
        size_t qb = dtype_row_bytes(want_type, tf->ne[0]);
        uint8_t *qq = malloc(qb);
        float *back = malloc((size_t)tf->ne[0] * 4);
        ASSERT_TRUE(qq && back);
        double se2 = 0, sx2 = 0;
        for (int64_t r = 0; r < tf->ne[1]; r++) {
            const float *row = b + r * tf->ne[0];
            dtype_quant_row(want_type, row, qq, tf->ne[0]);
            dtype_dequant_row(want_type, qq, back, tf->ne[0]);
            for (int64_t i = 0; i < tf->ne[0]; i++) {
                se2 += (double)(back[i] - row[i]) * (back[i] - row[i]);
                sx2 += (double)row[i] * row[i];
            }
        }
        free(qq);
        free(back);
        double ours = sqrt(se2 / sx2);
        printf("    our quantizer: nrmse %.5f\n", ours);
        ASSERT_TRUE(ours <= hi * 1.35);
    }
    free(a);
    free(b);
    gguf_close(fq);
    gguf_close(ff);
}

TEST(dtype_dequant_real_files) {
    test_model_path("synth256-f32.gguf"); /* skips when the folder is missing */
    compare_to_f32("synth256-q8_0.gguf", "synth256-f32.gguf", "blk.0.attn_q.weight", 1e-3, 6e-3, DTYPE_Q8_0);
    compare_to_f32("synth256-q6_k.gguf", "synth256-f32.gguf", "blk.0.ffn_down.weight", 4e-3, 2.5e-2, DTYPE_Q6_K);
    compare_to_f32("synth256-q6_k.gguf", "synth256-f32.gguf", "token_embd.weight", 4e-3, 2.5e-2, DTYPE_Q6_K);
    compare_to_f32("synth256-q5_k_m.gguf", "synth256-f32.gguf", "blk.0.ffn_up.weight", 1e-2, 5e-2, DTYPE_Q5_K);
    compare_to_f32("synth256-q4_k_m.gguf", "synth256-f32.gguf", "blk.0.attn_k.weight", 2e-2, 1.1e-1, DTYPE_Q4_K);
    compare_to_f32("synth256-q4_k_m.gguf", "synth256-f32.gguf", "output.weight", 4e-3, 2.5e-2, DTYPE_Q6_K);
    compare_to_f32("stories260K-q8_0.gguf", "stories260K-f32.gguf", "blk.2.attn_v.weight", 1e-3, 6e-3, DTYPE_Q8_0);
    compare_to_f32("stories260K-q4_0.gguf", "stories260K-f32.gguf", "blk.1.ffn_up.weight", 2e-2, 1.3e-1, DTYPE_Q4_0);
}

TEST_MAIN(dtype_names_and_sizes, dtype_fp16_edges, dtype_fp16_rows_match_scalar, dtype_bf16_edges, dtype_dequant_matches_reference,
          dtype_quant_roundtrip_bounds, dtype_quant_row_refuses, dtype_dequant_real_files)
