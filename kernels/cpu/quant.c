/* Portable row kernels of the CPU backend: fp16/bf16 conversion, weight
 * dequantization for every dtype, activation quantization to 8-bit blocks,
 * and the scalar dot products that matmul falls back to without AVX2.
 * Written as plain loops over small fixed-size arrays so that GCC can
 * vectorize the inner ones at -O2/-O3 on any x86-64. */
#include "cpu.h"

#include <math.h>
#include <pthread.h>
#include <string.h>

float cpu_fp16_table[65536];

static float fp16_bits_to_f32(uint16_t h) {
    uint32_t sign = (uint32_t)(h & 0x8000u) << 16;
    uint32_t exp = (h >> 10) & 0x1fu, man = h & 0x3ffu;
    union { uint32_t u; float f; } v;
    if (exp == 0) {
        v.f = (float)man * 0x1p-24f; /* zero or subnormal */
        v.u |= sign;
    } else if (exp == 31) {
        v.u = sign | 0x7f800000u | (man << 13);
    } else {
        v.u = sign | ((exp + 112) << 23) | (man << 13);
    }
    return v.f;
}

uint16_t cpu_f32_to_fp16(float f) {
    union { float f; uint32_t u; } v = {f};
    uint32_t sign = (v.u >> 16) & 0x8000u, ax = v.u & 0x7fffffffu;
    if (ax >= 0x7f800000u) return (uint16_t)(sign | 0x7c00u | (ax > 0x7f800000u ? 0x200u : 0));
    if (ax >= 0x477ff000u) return (uint16_t)(sign | 0x7c00u); /* rounds to infinity */
    if (ax < 0x38800000u) {
        /* Below the smallest normal half: a multiple of 2^-24.  The product
         * is exact; rintf rounds to nearest even in the default mode. */
        union { uint32_t u; float f; } a = {ax};
        return (uint16_t)(sign | (uint32_t)rintf(a.f * 0x1p24f));
    }
    uint32_t r = ax - 0x38000000u; /* rebias the exponent from 127 to 15 */
    r += 0xfffu + ((r >> 13) & 1u);
    return (uint16_t)(sign | (r >> 13));
}

uint16_t cpu_f32_to_bf16(float f) {
    union { float f; uint32_t u; } v = {f};
    if ((v.u & 0x7fffffffu) > 0x7f800000u) return (uint16_t)((v.u >> 16) | 0x40u); /* quiet NaN */
    return (uint16_t)((v.u + 0x7fffu + ((v.u >> 16) & 1u)) >> 16);
}

/* ---- Dequantization, one block at a time ---- */

static void get_scale_min_k4(int j, const uint8_t *q, uint8_t *sc, uint8_t *m) {
    if (j < 4) {
        *sc = q[j] & 63;
        *m = q[j + 4] & 63;
    } else {
        *sc = (uint8_t)((q[j + 4] & 0xF) | ((q[j - 4] >> 6) << 4));
        *m = (uint8_t)((q[j + 4] >> 4) | ((q[j] >> 6) << 4));
    }
}

static uint32_t load_u32(const uint8_t *p) {
    uint32_t v;
    memcpy(&v, p, 4);
    return v;
}

void cpu_dequant_row(enum dtype t, const void *src, float *y, int64_t n) {
    switch (t) {
    case DTYPE_F32:
        memcpy(y, src, (size_t)n * sizeof(float));
        return;
    case DTYPE_F16: {
        const uint16_t *s = src;
        for (int64_t i = 0; i < n; i++) y[i] = cpu_fp16_to_f32(s[i]);
        return;
    }
    case DTYPE_BF16: {
        const uint16_t *s = src;
        for (int64_t i = 0; i < n; i++) y[i] = cpu_bf16_to_f32(s[i]);
        return;
    }
    case DTYPE_Q4_0:
        for (const block_q4_0 *b = src; n > 0; b++, n -= 32, y += 32) {
            float d = cpu_fp16_to_f32(b->d);
            for (int j = 0; j < 16; j++) {
                y[j] = d * ((b->qs[j] & 0xF) - 8);
                y[j + 16] = d * ((b->qs[j] >> 4) - 8);
            }
        }
        return;
    case DTYPE_Q4_1:
        for (const block_q4_1 *b = src; n > 0; b++, n -= 32, y += 32) {
            float d = cpu_fp16_to_f32(b->d), m = cpu_fp16_to_f32(b->m);
            for (int j = 0; j < 16; j++) {
                y[j] = d * (b->qs[j] & 0xF) + m;
                y[j + 16] = d * (b->qs[j] >> 4) + m;
            }
        }
        return;
    case DTYPE_Q5_0:
        for (const block_q5_0 *b = src; n > 0; b++, n -= 32, y += 32) {
            float d = cpu_fp16_to_f32(b->d);
            uint32_t qh = load_u32(b->qh);
            for (int j = 0; j < 16; j++) {
                int lo = (b->qs[j] & 0xF) | (int)(((qh >> j) & 1u) << 4);
                int hi = (b->qs[j] >> 4) | (int)(((qh >> (j + 16)) & 1u) << 4);
                y[j] = d * (lo - 16);
                y[j + 16] = d * (hi - 16);
            }
        }
        return;
    case DTYPE_Q5_1:
        for (const block_q5_1 *b = src; n > 0; b++, n -= 32, y += 32) {
            float d = cpu_fp16_to_f32(b->d), m = cpu_fp16_to_f32(b->m);
            uint32_t qh = load_u32(b->qh);
            for (int j = 0; j < 16; j++) {
                int lo = (b->qs[j] & 0xF) | (int)(((qh >> j) & 1u) << 4);
                int hi = (b->qs[j] >> 4) | (int)(((qh >> (j + 16)) & 1u) << 4);
                y[j] = d * lo + m;
                y[j + 16] = d * hi + m;
            }
        }
        return;
    case DTYPE_Q8_0:
        for (const block_q8_0 *b = src; n > 0; b++, n -= 32, y += 32) {
            float d = cpu_fp16_to_f32(b->d);
            for (int j = 0; j < 32; j++) y[j] = d * b->qs[j];
        }
        return;
    case DTYPE_Q4_K:
        for (const block_q4_k *b = src; n > 0; b++, n -= 256) {
            float d = cpu_fp16_to_f32(b->d), dmin = cpu_fp16_to_f32(b->dmin);
            const uint8_t *q = b->qs;
            for (int j = 0; j < 4; j++, q += 32, y += 64) {
                uint8_t sc0, m0, sc1, m1;
                get_scale_min_k4(2 * j, b->scales, &sc0, &m0);
                get_scale_min_k4(2 * j + 1, b->scales, &sc1, &m1);
                float d0 = d * sc0, mm0 = dmin * m0, d1 = d * sc1, mm1 = dmin * m1;
                for (int l = 0; l < 32; l++) {
                    y[l] = d0 * (q[l] & 0xF) - mm0;
                    y[l + 32] = d1 * (q[l] >> 4) - mm1;
                }
            }
        }
        return;
    case DTYPE_Q5_K:
        for (const block_q5_k *b = src; n > 0; b++, n -= 256) {
            float d = cpu_fp16_to_f32(b->d), dmin = cpu_fp16_to_f32(b->dmin);
            const uint8_t *q = b->qs;
            for (int j = 0; j < 4; j++, q += 32, y += 64) {
                uint8_t sc0, m0, sc1, m1;
                get_scale_min_k4(2 * j, b->scales, &sc0, &m0);
                get_scale_min_k4(2 * j + 1, b->scales, &sc1, &m1);
                float d0 = d * sc0, mm0 = dmin * m0, d1 = d * sc1, mm1 = dmin * m1;
                for (int l = 0; l < 32; l++) {
                    int lo = (q[l] & 0xF) | (((b->qh[l] >> (2 * j)) & 1) << 4);
                    int hi = (q[l] >> 4) | (((b->qh[l] >> (2 * j + 1)) & 1) << 4);
                    y[l] = d0 * lo - mm0;
                    y[l + 32] = d1 * hi - mm1;
                }
            }
        }
        return;
    case DTYPE_Q6_K:
        for (const block_q6_k *b = src; n > 0; b++, n -= 256) {
            float d = cpu_fp16_to_f32(b->d);
            const uint8_t *ql = b->ql, *qh = b->qh;
            const int8_t *sc = b->scales;
            for (int h = 0; h < 2; h++, ql += 64, qh += 32, sc += 8, y += 128) {
                for (int l = 0; l < 32; l++) {
                    int is = l / 16;
                    int q1 = ((ql[l] & 0xF) | (((qh[l] >> 0) & 3) << 4)) - 32;
                    int q2 = ((ql[l + 32] & 0xF) | (((qh[l] >> 2) & 3) << 4)) - 32;
                    int q3 = ((ql[l] >> 4) | (((qh[l] >> 4) & 3) << 4)) - 32;
                    int q4 = ((ql[l + 32] >> 4) | (((qh[l] >> 6) & 3) << 4)) - 32;
                    y[l] = d * sc[is] * q1;
                    y[l + 32] = d * sc[is + 2] * q2;
                    y[l + 64] = d * sc[is + 4] * q3;
                    y[l + 96] = d * sc[is + 6] * q4;
                }
            }
        }
        return;
    }
}

/* ---- Activation quantization ---- */

static int8_t q8_round(float v) { return (int8_t)(v >= 0 ? (int)(v + 0.5f) : -(int)(0.5f - v)); }

size_t cpu_act_row_bytes(enum cpu_act act, int64_t n) {
    switch (act) {
    case CPU_ACT_Q8: return (size_t)(n / 32) * sizeof(struct cpu_q8);
    case CPU_ACT_Q8K: return (size_t)(n / 256) * sizeof(struct cpu_q8k);
    case CPU_ACT_F32: break;
    }
    return (size_t)n * sizeof(float);
}

void cpu_act_quant_row_scalar(enum cpu_act act, const float *x, void *dst, int64_t n) {
    if (act == CPU_ACT_Q8) {
        struct cpu_q8 *q = dst;
        for (int64_t b = 0; b < n / 32; b++, x += 32, q++) {
            float amax = 0;
            for (int j = 0; j < 32; j++) amax = fmaxf(amax, fabsf(x[j]));
            float d = amax / 127.0f, id = amax > 0 ? 127.0f / amax : 0.0f;
            int sum = 0;
            for (int j = 0; j < 32; j++) {
                q->qs[j] = q8_round(x[j] * id);
                sum += q->qs[j];
            }
            q->d = d;
            q->s = d * (float)sum;
        }
    } else if (act == CPU_ACT_Q8K) {
        struct cpu_q8k *q = dst;
        for (int64_t b = 0; b < n / 256; b++, x += 256, q++) {
            float amax = 0;
            for (int j = 0; j < 256; j++) amax = fmaxf(amax, fabsf(x[j]));
            float id = amax > 0 ? 127.0f / amax : 0.0f;
            q->d = amax / 127.0f;
            for (int j = 0; j < 256; j++) q->qs[j] = q8_round(x[j] * id);
            for (int g = 0; g < 16; g++) {
                int s = 0;
                for (int j = 0; j < 16; j++) s += q->qs[16 * g + j];
                q->bsums[g] = (int16_t)s;
            }
        }
    } else {
        memcpy(dst, x, (size_t)n * sizeof(float));
    }
}

static cpu_act_quant_fn act_quant = cpu_act_quant_row_scalar;

void cpu_act_quant_row(enum cpu_act act, const float *x, void *dst, int64_t n) { act_quant(act, x, dst, n); }

/* ---- Float dot products and axpy ----
 * Eight independent partial sums: GCC vectorizes these without reassociating
 * a single accumulator (which it may not do without -ffast-math). */

static float dot_f32_f32(const float *a, const float *b, int64_t n) {
    float acc[8] = {0};
    int64_t i = 0;
    for (; i + 8 <= n; i += 8)
        for (int j = 0; j < 8; j++) acc[j] += a[i + j] * b[i + j];
    float s = 0;
    for (; i < n; i++) s += a[i] * b[i];
    for (int j = 0; j < 8; j++) s += acc[j];
    return s;
}

static float dot_f16_f32(const uint16_t *a, const float *b, int64_t n) {
    float acc[8] = {0};
    int64_t i = 0;
    for (; i + 8 <= n; i += 8)
        for (int j = 0; j < 8; j++) acc[j] += cpu_fp16_to_f32(a[i + j]) * b[i + j];
    float s = 0;
    for (; i < n; i++) s += cpu_fp16_to_f32(a[i]) * b[i];
    for (int j = 0; j < 8; j++) s += acc[j];
    return s;
}

static float dot_bf16_f32(const uint16_t *a, const float *b, int64_t n) {
    float acc[8] = {0};
    int64_t i = 0;
    for (; i + 8 <= n; i += 8)
        for (int j = 0; j < 8; j++) acc[j] += cpu_bf16_to_f32(a[i + j]) * b[i + j];
    float s = 0;
    for (; i < n; i++) s += cpu_bf16_to_f32(a[i]) * b[i];
    for (int j = 0; j < 8; j++) s += acc[j];
    return s;
}

static void axpy_f32(float *y, float a, const void *x_, int64_t n) {
    const float *x = x_;
    for (int64_t i = 0; i < n; i++) y[i] += a * x[i];
}

static void axpy_f16(float *y, float a, const void *x_, int64_t n) {
    const uint16_t *x = x_;
    for (int64_t i = 0; i < n; i++) y[i] += a * cpu_fp16_to_f32(x[i]);
}

cpu_axpy_fn cpu_axpy_scalar(enum dtype t) {
    return t == DTYPE_F32 ? axpy_f32 : t == DTYPE_F16 ? axpy_f16 : NULL;
}

/* ---- Scalar dot kernels, weight row x activation row ---- */

static float dot_f32(const void *w, const void *x, int64_t n) { return dot_f32_f32(w, x, n); }
static float dot_f16(const void *w, const void *x, int64_t n) { return dot_f16_f32(w, x, n); }
static float dot_bf16(const void *w, const void *x, int64_t n) { return dot_bf16_f32(w, x, n); }

static float dot_q4_0(const void *w, const void *x, int64_t n) {
    const block_q4_0 *b = w;
    const struct cpu_q8 *y = x;
    float s = 0;
    for (int64_t k = 0; k < n / 32; k++) {
        int si = 0;
        for (int j = 0; j < 16; j++)
            si += ((b[k].qs[j] & 0xF) - 8) * y[k].qs[j] + ((b[k].qs[j] >> 4) - 8) * y[k].qs[j + 16];
        s += cpu_fp16_to_f32(b[k].d) * y[k].d * (float)si;
    }
    return s;
}

static float dot_q4_1(const void *w, const void *x, int64_t n) {
    const block_q4_1 *b = w;
    const struct cpu_q8 *y = x;
    float s = 0;
    for (int64_t k = 0; k < n / 32; k++) {
        int si = 0;
        for (int j = 0; j < 16; j++)
            si += (b[k].qs[j] & 0xF) * y[k].qs[j] + (b[k].qs[j] >> 4) * y[k].qs[j + 16];
        s += cpu_fp16_to_f32(b[k].d) * y[k].d * (float)si + cpu_fp16_to_f32(b[k].m) * y[k].s;
    }
    return s;
}

static float dot_q5_0(const void *w, const void *x, int64_t n) {
    const block_q5_0 *b = w;
    const struct cpu_q8 *y = x;
    float s = 0;
    for (int64_t k = 0; k < n / 32; k++) {
        uint32_t qh = load_u32(b[k].qh);
        int si = 0;
        for (int j = 0; j < 16; j++) {
            int lo = ((b[k].qs[j] & 0xF) | (int)(((qh >> j) & 1u) << 4)) - 16;
            int hi = ((b[k].qs[j] >> 4) | (int)(((qh >> (j + 16)) & 1u) << 4)) - 16;
            si += lo * y[k].qs[j] + hi * y[k].qs[j + 16];
        }
        s += cpu_fp16_to_f32(b[k].d) * y[k].d * (float)si;
    }
    return s;
}

static float dot_q5_1(const void *w, const void *x, int64_t n) {
    const block_q5_1 *b = w;
    const struct cpu_q8 *y = x;
    float s = 0;
    for (int64_t k = 0; k < n / 32; k++) {
        uint32_t qh = load_u32(b[k].qh);
        int si = 0;
        for (int j = 0; j < 16; j++) {
            int lo = (b[k].qs[j] & 0xF) | (int)(((qh >> j) & 1u) << 4);
            int hi = (b[k].qs[j] >> 4) | (int)(((qh >> (j + 16)) & 1u) << 4);
            si += lo * y[k].qs[j] + hi * y[k].qs[j + 16];
        }
        s += cpu_fp16_to_f32(b[k].d) * y[k].d * (float)si + cpu_fp16_to_f32(b[k].m) * y[k].s;
    }
    return s;
}

static float dot_q8_0(const void *w, const void *x, int64_t n) {
    const block_q8_0 *b = w;
    const struct cpu_q8 *y = x;
    float s = 0;
    for (int64_t k = 0; k < n / 32; k++) {
        int si = 0;
        for (int j = 0; j < 32; j++) si += b[k].qs[j] * y[k].qs[j];
        s += cpu_fp16_to_f32(b[k].d) * y[k].d * (float)si;
    }
    return s;
}

/* K-quants: the 8 sub-blocks of 32 each carry a 6-bit scale and min; the
 * min term folds into the activation group sums (bsums). */
static float dot_q4_k(const void *w, const void *x, int64_t n) {
    const block_q4_k *b = w;
    const struct cpu_q8k *y = x;
    float s = 0;
    for (int64_t k = 0; k < n / 256; k++) {
        int sumi = 0, summ = 0;
        const uint8_t *q = b[k].qs;
        const int8_t *a = y[k].qs;
        for (int j = 0; j < 4; j++, q += 32, a += 64) {
            uint8_t sc0, m0, sc1, m1;
            get_scale_min_k4(2 * j, b[k].scales, &sc0, &m0);
            get_scale_min_k4(2 * j + 1, b[k].scales, &sc1, &m1);
            int s0 = 0, s1 = 0;
            for (int l = 0; l < 32; l++) {
                s0 += (q[l] & 0xF) * a[l];
                s1 += (q[l] >> 4) * a[l + 32];
            }
            sumi += sc0 * s0 + sc1 * s1;
            summ += m0 * (y[k].bsums[4 * j] + y[k].bsums[4 * j + 1]) +
                    m1 * (y[k].bsums[4 * j + 2] + y[k].bsums[4 * j + 3]);
        }
        s += y[k].d * (cpu_fp16_to_f32(b[k].d) * (float)sumi - cpu_fp16_to_f32(b[k].dmin) * (float)summ);
    }
    return s;
}

static float dot_q5_k(const void *w, const void *x, int64_t n) {
    const block_q5_k *b = w;
    const struct cpu_q8k *y = x;
    float s = 0;
    for (int64_t k = 0; k < n / 256; k++) {
        int sumi = 0, summ = 0;
        const uint8_t *q = b[k].qs, *qh = b[k].qh;
        const int8_t *a = y[k].qs;
        for (int j = 0; j < 4; j++, q += 32, a += 64) {
            uint8_t sc0, m0, sc1, m1;
            get_scale_min_k4(2 * j, b[k].scales, &sc0, &m0);
            get_scale_min_k4(2 * j + 1, b[k].scales, &sc1, &m1);
            int s0 = 0, s1 = 0;
            for (int l = 0; l < 32; l++) {
                s0 += ((q[l] & 0xF) | (((qh[l] >> (2 * j)) & 1) << 4)) * a[l];
                s1 += ((q[l] >> 4) | (((qh[l] >> (2 * j + 1)) & 1) << 4)) * a[l + 32];
            }
            sumi += sc0 * s0 + sc1 * s1;
            summ += m0 * (y[k].bsums[4 * j] + y[k].bsums[4 * j + 1]) +
                    m1 * (y[k].bsums[4 * j + 2] + y[k].bsums[4 * j + 3]);
        }
        s += y[k].d * (cpu_fp16_to_f32(b[k].d) * (float)sumi - cpu_fp16_to_f32(b[k].dmin) * (float)summ);
    }
    return s;
}

static float dot_q6_k(const void *w, const void *x, int64_t n) {
    const block_q6_k *b = w;
    const struct cpu_q8k *y = x;
    float s = 0;
    for (int64_t k = 0; k < n / 256; k++) {
        const uint8_t *ql = b[k].ql, *qh = b[k].qh;
        const int8_t *sc = b[k].scales, *a = y[k].qs;
        int sumi = 0;
        for (int h = 0; h < 2; h++, ql += 64, qh += 32, sc += 8, a += 128) {
            int g[8] = {0}; /* sums per group of 16 */
            for (int l = 0; l < 32; l++) {
                int is = l / 16;
                int q1 = ((ql[l] & 0xF) | (((qh[l] >> 0) & 3) << 4)) - 32;
                int q2 = ((ql[l + 32] & 0xF) | (((qh[l] >> 2) & 3) << 4)) - 32;
                int q3 = ((ql[l] >> 4) | (((qh[l] >> 4) & 3) << 4)) - 32;
                int q4 = ((ql[l + 32] >> 4) | (((qh[l] >> 6) & 3) << 4)) - 32;
                g[is] += q1 * a[l];
                g[is + 2] += q2 * a[l + 32];
                g[is + 4] += q3 * a[l + 64];
                g[is + 6] += q4 * a[l + 96];
            }
            for (int i = 0; i < 8; i++) sumi += sc[i] * g[i];
        }
        s += y[k].d * cpu_fp16_to_f32(b[k].d) * (float)sumi;
    }
    return s;
}

cpu_dot_fn cpu_dot_scalar(enum dtype t) {
    switch (t) {
    case DTYPE_F32: return dot_f32;
    case DTYPE_F16: return dot_f16;
    case DTYPE_BF16: return dot_bf16;
    case DTYPE_Q4_0: return dot_q4_0;
    case DTYPE_Q4_1: return dot_q4_1;
    case DTYPE_Q5_0: return dot_q5_0;
    case DTYPE_Q5_1: return dot_q5_1;
    case DTYPE_Q8_0: return dot_q8_0;
    case DTYPE_Q4_K: return dot_q4_k;
    case DTYPE_Q5_K: return dot_q5_k;
    case DTYPE_Q6_K: return dot_q6_k;
    }
    return NULL;
}

/* ---- Type table ---- */

static struct cpu_type_traits traits[DTYPE_ID_MAX];
static pthread_once_t kernels_once = PTHREAD_ONCE_INIT;

static void set_traits(enum dtype t, int64_t elems, size_t bytes, enum cpu_act act) {
    cpu_dot_fn fast = cpu_has_avx2() ? cpu_dot_avx2(t) : NULL;
    cpu_dot4_fn fast4 = cpu_has_avx2() ? cpu_dot4_avx2(t) : NULL;
    cpu_dotn_fn fastn = cpu_has_avx2() ? cpu_dotn_avx2(t) : NULL;
    cpu_axpy_fn axpy = cpu_has_avx2() ? cpu_axpy_avx2(t) : NULL;
    traits[t] = (struct cpu_type_traits){elems, bytes, act, fast ? fast : cpu_dot_scalar(t), fast4, fastn,
                                         cpu_has_avx512vl() ? cpu_dot2n_avx512vl(t) : NULL,
                                         axpy ? axpy : cpu_axpy_scalar(t),
                                         cpu_has_avx2() ? cpu_attn_qk_avx2(t) : NULL,
                                         cpu_has_avx2() ? cpu_attn_v_avx2(t) : NULL};
}

static void kernels_init_once(void) {
    for (uint32_t h = 0; h < 65536; h++) cpu_fp16_table[h] = fp16_bits_to_f32((uint16_t)h);
    if (cpu_has_avx2()) act_quant = cpu_act_quant_row_avx2;
    set_traits(DTYPE_F32, 1, 4, CPU_ACT_F32);
    set_traits(DTYPE_F16, 1, 2, CPU_ACT_F32);
    set_traits(DTYPE_BF16, 1, 2, CPU_ACT_F32);
    set_traits(DTYPE_Q4_0, 32, sizeof(block_q4_0), CPU_ACT_Q8);
    set_traits(DTYPE_Q4_1, 32, sizeof(block_q4_1), CPU_ACT_Q8);
    set_traits(DTYPE_Q5_0, 32, sizeof(block_q5_0), CPU_ACT_Q8);
    set_traits(DTYPE_Q5_1, 32, sizeof(block_q5_1), CPU_ACT_Q8);
    set_traits(DTYPE_Q8_0, 32, sizeof(block_q8_0), CPU_ACT_Q8);
    set_traits(DTYPE_Q4_K, 256, sizeof(block_q4_k), CPU_ACT_Q8K);
    set_traits(DTYPE_Q5_K, 256, sizeof(block_q5_k), CPU_ACT_Q8K);
    set_traits(DTYPE_Q6_K, 256, sizeof(block_q6_k), CPU_ACT_Q8K);
}

void cpu_kernels_init(void) { pthread_once(&kernels_once, kernels_init_once); }

const struct cpu_type_traits *cpu_type_traits(enum dtype t) {
    if ((unsigned)t >= DTYPE_ID_MAX || !traits[t].dot) return NULL;
    return &traits[t];
}
