/* What the x86 vector kernels (quant_avx2.c, quant_avx512.c) share: the
 * target attributes of AVX2 code and the one horizontal sum every F16 and
 * F32 dot ends with, so that kernels in either file give a row the same
 * bits.  Include only inside `#if defined(__x86_64__) && defined(__GNUC__)`. */
#ifndef KERNELS_CPU_AVX2_H
#define KERNELS_CPU_AVX2_H

#include <immintrin.h>

#define AVX2_FN __attribute__((target("avx2,fma,f16c")))
/* Helpers: inlined so that their vectors stay in registers. */
#define AVX2_INLINE __attribute__((target("avx2,fma,f16c"), always_inline)) inline

/* Weights (F16 elements) the several-row kernels ask for ahead of their
 * loads: with 4-10 FMAs an iteration their loop covers fewer cache lines
 * than the one-row kernel's, too few for the hardware prefetcher alone to
 * keep the weights coming (docs/cpu-backend.md). */
#define F16_PREFETCH 1024

AVX2_INLINE static float hsum256(__m256 v) {
    __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
    s = _mm_add_ps(s, _mm_movehl_ps(s, s));
    s = _mm_add_ss(s, _mm_movehdup_ps(s));
    return _mm_cvtss_f32(s);
}

#endif
