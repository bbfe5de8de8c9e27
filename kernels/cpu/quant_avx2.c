/* AVX2 + FMA + F16C dot kernels for matmul, compiled with per-function
 * target attributes so that the library stays portable x86-64: quant.c
 * picks them at run time only when the CPU reports all three features.
 * Each computes exactly what its scalar twin in quant.c computes (integer
 * block sums are exact; only the float accumulation order differs). */
#include "cpu.h"

#include <string.h>

#if defined(__x86_64__) && defined(__GNUC__)
#include <immintrin.h>

#define AVX2_FN __attribute__((target("avx2,fma,f16c")))

int cpu_has_avx2(void) {
    __builtin_cpu_init();
    return __builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma") && __builtin_cpu_supports("f16c");
}

AVX2_FN static float hsum256(__m256 v) {
    __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
    s = _mm_add_ps(s, _mm_movehl_ps(s, s));
    s = _mm_add_ss(s, _mm_movehdup_ps(s));
    return _mm_cvtss_f32(s);
}

/* Sum of signed products of 32 int8 pairs, as 8 int32 lanes. */
AVX2_FN static __m256i dot_i8x32(__m256i a, __m256i b) {
    __m256i p16 = _mm256_maddubs_epi16(_mm256_sign_epi8(a, a), _mm256_sign_epi8(b, a));
    return _mm256_madd_epi16(p16, _mm256_set1_epi16(1));
}

AVX2_FN static float dot_f16_avx2(const void *w, const void *x, int64_t n) {
    const uint16_t *a = w;
    const float *b = x;
    __m256 acc0 = _mm256_setzero_ps(), acc1 = _mm256_setzero_ps();
    __m256 acc2 = _mm256_setzero_ps(), acc3 = _mm256_setzero_ps();
    int64_t i = 0;
    for (; i + 32 <= n; i += 32) {
        acc0 = _mm256_fmadd_ps(_mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)(a + i))), _mm256_loadu_ps(b + i), acc0);
        acc1 = _mm256_fmadd_ps(_mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)(a + i + 8))),
                               _mm256_loadu_ps(b + i + 8), acc1);
        acc2 = _mm256_fmadd_ps(_mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)(a + i + 16))),
                               _mm256_loadu_ps(b + i + 16), acc2);
        acc3 = _mm256_fmadd_ps(_mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)(a + i + 24))),
                               _mm256_loadu_ps(b + i + 24), acc3);
    }
    for (; i + 8 <= n; i += 8)
        acc0 = _mm256_fmadd_ps(_mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)(a + i))), _mm256_loadu_ps(b + i), acc0);
    float s = hsum256(_mm256_add_ps(_mm256_add_ps(acc0, acc1), _mm256_add_ps(acc2, acc3)));
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
AVX2_FN static __m256i unpack_nibbles(const uint8_t *qs) {
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

cpu_dot_fn cpu_dot_avx2(enum dtype t) {
    switch (t) {
    case DTYPE_F32: return dot_f32_avx2;
    case DTYPE_F16: return dot_f16_avx2;
    case DTYPE_BF16: return dot_bf16_avx2;
    case DTYPE_Q8_0: return dot_q8_0_avx2;
    case DTYPE_Q4_0: return dot_q4_0_avx2;
    default: return NULL;
    }
}

#else

int cpu_has_avx2(void) { return 0; }
cpu_dot_fn cpu_dot_avx2(enum dtype t) {
    (void)t;
    return NULL;
}

#endif
