/* The F16 matmul's kernel for two weight rows at once, on CPUs with
 * AVX-512VL: the AVX2 kernels' 256-bit operations in their order, with the
 * 32 vector registers that AVX-512VL gives 256-bit code.
 *
 * A row's dot keeps two accumulators a token (quant_avx2.c), so two rows
 * against nt tokens hold 4 * nt of them: 20 at five tokens, more than
 * AVX2's 16 registers.  With 32, each activation vector is loaded once for
 * both rows, which halves the loads a multiply-add, and the several-token
 * F16 kernels are bound by those loads (docs/cpu-backend.md).  Every
 * output is bit for bit what dot_f16_avx2 gives its row and token
 * (test_cpu_ops_matmul), so a token's result still does not depend on how many
 * tokens or rows share its pass. */
#include "cpu.h"

#if defined(__x86_64__) && defined(__GNUC__)
#include "avx2.h"

#define VL_FN __attribute__((target("avx2,fma,f16c,avx512f,avx512vl")))
#define VL_INLINE __attribute__((target("avx2,fma,f16c,avx512f,avx512vl"), always_inline)) inline

int cpu_has_avx512vl(void) {
    __builtin_cpu_init();
    return cpu_has_avx2() && __builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512vl");
}

VL_INLINE static void dot2n_f16_rows(const uint16_t *a0, const uint16_t *a1, const void *x, size_t stride,
                                     int64_t n, float *o0, float *o1, const int nt) {
    __m256 c00[5], c01[5], c10[5], c11[5];
    const float *b[5];
#pragma GCC unroll 5
    for (int t = 0; t < nt; t++) {
        c00[t] = c01[t] = c10[t] = c11[t] = _mm256_setzero_ps();
        b[t] = (const float *)((const uint8_t *)x + (size_t)t * stride);
    }
    int64_t i = 0;
    for (; i + 16 <= n; i += 16) {
        _mm_prefetch((const char *)(a0 + i + F16_PREFETCH), _MM_HINT_T0);
        _mm_prefetch((const char *)(a1 + i + F16_PREFETCH), _MM_HINT_T0);
        __m256 w00 = _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)(a0 + i)));
        __m256 w01 = _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)(a0 + i + 8)));
        __m256 w10 = _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)(a1 + i)));
        __m256 w11 = _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)(a1 + i + 8)));
#pragma GCC unroll 5
        for (int t = 0; t < nt; t++) {
            __m256 xa = _mm256_loadu_ps(b[t] + i), xb = _mm256_loadu_ps(b[t] + i + 8);
            /* one load each for both rows (the compiler would fold a load
             * into each multiply-add) */
            __asm__("" : "+v"(xa), "+v"(xb));
            c00[t] = _mm256_fmadd_ps(w00, xa, c00[t]);
            c10[t] = _mm256_fmadd_ps(w10, xa, c10[t]);
            c01[t] = _mm256_fmadd_ps(w01, xb, c01[t]);
            c11[t] = _mm256_fmadd_ps(w11, xb, c11[t]);
        }
    }
#pragma GCC unroll 5
    for (int t = 0; t < nt; t++) {
        o0[t] = hsum256(_mm256_add_ps(c00[t], c01[t]));
        o1[t] = hsum256(_mm256_add_ps(c10[t], c11[t]));
    }
    for (; i < n; i++) {
        float w0 = cpu_fp16_to_f32(a0[i]), w1 = cpu_fp16_to_f32(a1[i]);
#pragma GCC unroll 5
        for (int t = 0; t < nt; t++) {
            o0[t] += w0 * b[t][i];
            o1[t] += w1 * b[t][i];
        }
    }
}

VL_FN static void dot2n_f16_avx512vl(const void *w0, const void *w1, const void *x, size_t stride, int64_t n,
                                     int nt, float *o0, float *o1) {
    switch (nt) {
    case 1: dot2n_f16_rows(w0, w1, x, stride, n, o0, o1, 1); break;
    case 2: dot2n_f16_rows(w0, w1, x, stride, n, o0, o1, 2); break;
    case 3: dot2n_f16_rows(w0, w1, x, stride, n, o0, o1, 3); break;
    case 4: dot2n_f16_rows(w0, w1, x, stride, n, o0, o1, 4); break;
    default: dot2n_f16_rows(w0, w1, x, stride, n, o0, o1, 5); break;
    }
}

cpu_dot2n_fn cpu_dot2n_avx512vl(enum dtype t) { return t == DTYPE_F16 ? dot2n_f16_avx512vl : NULL; }

#else

int cpu_has_avx512vl(void) { return 0; }
cpu_dot2n_fn cpu_dot2n_avx512vl(enum dtype t) {
    (void)t;
    return NULL;
}

#endif
