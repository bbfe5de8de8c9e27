/* The fixture of the CPU backend's op tests (test_cpu_ops_*.c): a backend
 * and the buffers of one test, random inputs, the NMSE of an output against a
 * double reference, and weights of every dtype.  Included by each of those
 * files (one program each): every function is static inline, so that a file
 * may leave some unused.
 *
 * The tests compare each op against scalar references written in double
 * precision, on fresh random inputs, with outputs filled with NaN before
 * each op so that an element the op forgets to write fails.  Errors are
 * normalised: NMSE = sum((out - ref)^2) / sum(ref^2), bounded per op and
 * dtype (the bounds are next to each check, with why). */
#ifndef TESTS_KERNELS_CPU_OPS_FIXTURE_H
#define TESTS_KERNELS_CPU_OPS_FIXTURE_H

#include <stdint.h>

#include "common/dtype.h"
#include "common/status.h"
#include "kernels/backend.h"
#include "tests/test.h"

/* ---- Fixture: a backend and the buffers of one test ----
 * Everything a test allocates goes through fx_alloc and is released by
 * fx_release, which each test calls at its end and at its start (to clean
 * up after a previous test that failed half-way). */

#define FX_MAX_ALLOCS 256
static void *fx_ptrs[FX_MAX_ALLOCS];
static int fx_n;
static backend *fx_be;

static inline void fx_release(void) {
    for (int i = 0; i < fx_n; i++) free(fx_ptrs[i]);
    fx_n = 0;
    backend_free(fx_be);
    fx_be = NULL;
}

/* Frees what was allocated since fx_n was mark, for helpers called in loops. */
static inline void fx_release_to(int mark) {
    while (fx_n > mark) free(fx_ptrs[--fx_n]);
}

static inline void *fx_alloc(size_t bytes) {
    if (fx_n == FX_MAX_ALLOCS) TEST_FAIL("fixture: more than %d allocations", FX_MAX_ALLOCS);
    void *p = malloc(bytes ? bytes : 1);
    if (!p) TEST_FAIL("fixture: cannot allocate %zu bytes", bytes);
    fx_ptrs[fx_n++] = p;
    return p;
}

static inline backend *fx_backend(int n_threads) {
    char err[256];
    backend_free(fx_be);
    fx_be = NULL;
    int st = backend_cpu_init(&fx_be, n_threads, err, sizeof err);
    if (st != 0) TEST_FAIL("backend_cpu_init(%d): %s", n_threads, err);
    return fx_be;
}

/* ---- Random inputs ----
 * One stream for the whole program: a test's inputs depend on the tests
 * that ran before it (run alone by name, it gets others), and every test
 * passes on any of them.  cpu_ops_thread_count_invariance sets rng_state
 * itself where it needs the same case for each thread count. */

static uint64_t rng_state = 0x9e3779b97f4a7c15ull;

static inline uint32_t rng_u32(void) {
    rng_state ^= rng_state << 13;
    rng_state ^= rng_state >> 7;
    rng_state ^= rng_state << 17;
    return (uint32_t)(rng_state >> 16);
}

static inline float rng_uniform(void) { return ((float)rng_u32() + 0.5f) / 4294967296.0f; } /* (0, 1) */

static inline float rng_normal(void) {
    return sqrtf(-2.0f * logf(rng_uniform())) * cosf(6.2831853f * rng_uniform());
}

static inline float *rand_floats(int64_t n, float scale) {
    float *p = fx_alloc((size_t)n * sizeof(float));
    for (int64_t i = 0; i < n; i++) p[i] = scale * rng_normal();
    return p;
}

static inline float *nan_floats(int64_t n) {
    float *p = fx_alloc((size_t)n * sizeof(float));
    for (int64_t i = 0; i < n; i++) p[i] = NAN;
    return p;
}

static inline void poison(float *p, int64_t n) {
    for (int64_t i = 0; i < n; i++) p[i] = NAN;
}

/* NMSE of out against ref; NaN in out makes it NaN, which fails "<=". */
static inline double nmse(const float *out, const double *ref, int64_t n) {
    double num = 0, den = 0;
    for (int64_t i = 0; i < n; i++) {
        double d = (double)out[i] - ref[i];
        num += d * d;
        den += ref[i] * ref[i];
    }
    return den > 0 ? num / den : num;
}

#define ASSERT_NMSE(out, ref, n, bound)                                                         \
    do {                                                                                        \
        double e_ = nmse((out), (ref), (n));                                                    \
        if (!(e_ <= (bound))) TEST_FAIL("%s: NMSE %.3g above %.3g", #out, e_, (double)(bound)); \
    } while (0)

/* ---- Weights of every dtype ---- */

static inline int quantizable(enum dtype t) {
    return t == DTYPE_F32 || t == DTYPE_F16 || t == DTYPE_BF16 || t == DTYPE_Q8_0 || t == DTYPE_Q4_0 ||
           t == DTYPE_Q4_K || t == DTYPE_Q5_K || t == DTYPE_Q6_K;
}

/* rows x cols weights of type t: quantized random normals where dtype_quant_row
 * supports t, otherwise random bytes with small random fp16 scales and mins. */
static inline void *make_weights(enum dtype t, int64_t rows, int64_t cols) {
    size_t row_bytes = dtype_row_bytes(t, cols);
    uint8_t *w = fx_alloc(row_bytes * (size_t)rows);
    if (quantizable(t)) {
        float *src = rand_floats(cols, 1.0f);
        for (int64_t r = 0; r < rows; r++) {
            for (int64_t c = 0; c < cols; c++) src[c] = rng_normal();
            ASSERT_OK(dtype_quant_row(t, src, w + (size_t)r * row_bytes, cols));
        }
        return w;
    }
    for (size_t i = 0; i < row_bytes * (size_t)rows; i++) w[i] = (uint8_t)rng_u32();
    size_t bb = dtype_block_bytes(t);
    for (size_t off = 0; off < row_bytes * (size_t)rows; off += bb) {
        fp16_t d = f32_to_fp16(0.02f + 0.05f * rng_uniform());
        fp16_t m = f32_to_fp16(-0.3f * rng_uniform());
        memcpy(w + off, &d, 2); /* every 32-element block starts with d */
        if (t == DTYPE_Q4_1 || t == DTYPE_Q5_1) memcpy(w + off + 2, &m, 2);
    }
    return w;
}

static inline double *dequant_matrix(enum dtype t, const void *w, int64_t rows, int64_t cols) {
    double *m = fx_alloc((size_t)rows * cols * sizeof(double));
    float *row = fx_alloc((size_t)cols * sizeof(float));
    for (int64_t r = 0; r < rows; r++) {
        dtype_dequant_row(t, (const uint8_t *)w + (size_t)r * dtype_row_bytes(t, cols), row, cols);
        for (int64_t c = 0; c < cols; c++) m[r * cols + c] = row[c];
    }
    return m;
}

static const enum dtype all_types[] = {DTYPE_F32,  DTYPE_F16,  DTYPE_BF16, DTYPE_Q4_0, DTYPE_Q4_1, DTYPE_Q5_0,
                                       DTYPE_Q5_1, DTYPE_Q8_0, DTYPE_Q4_K, DTYPE_Q5_K, DTYPE_Q6_K};
#define N_TYPES ((int)(sizeof all_types / sizeof all_types[0]))

/* Columns per type: not a multiple of 8 where the block size allows it, so
 * the vector kernels' tails run; a few blocks otherwise. */
static inline int64_t test_cols(enum dtype t) {
    int64_t be = dtype_block_elems(t);
    return be == 1 ? 803 : be == 32 ? 32 * 25 : 256 * 5;
}

#endif
