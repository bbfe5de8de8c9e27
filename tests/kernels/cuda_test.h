/* What the CUDA backend's test programs share (cuda_ops_fixture.h,
 * test_cuda_sample.c, test_cuda_link_codec.c): random inputs from
 * xorshift64*, seeded once a program from the clock and printed
 * (LLM_TEST_SEED repeats a run), and the backend on device 0, the test
 * skipped where there is none (CI).  Static inline: a file may leave some
 * unused. */
#ifndef TESTS_KERNELS_CUDA_TEST_H
#define TESTS_KERNELS_CUDA_TEST_H

#include "../test.h"

#include <stdint.h>
#include <time.h>

#include "common/status.h"
#include "kernels/backend.h"

static uint64_t rng_state;

static inline void rng_seed(void) {
    static int seeded;
    if (seeded) return;
    const char *env = getenv("LLM_TEST_SEED");
    rng_state = env && *env ? strtoull(env, NULL, 0) : (uint64_t)time(NULL) * 2654435761u + 1;
    printf("  random seed %llu (LLM_TEST_SEED repeats it)\n", (unsigned long long)rng_state);
    seeded = 1;
}

static inline uint32_t rng_u32(void) {
    rng_state ^= rng_state >> 12;
    rng_state ^= rng_state << 25;
    rng_state ^= rng_state >> 27;
    return (uint32_t)((rng_state * 2685821657736338717ull) >> 32);
}
static inline float rng_f(float lo, float hi) { return lo + (hi - lo) * (float)(rng_u32() >> 8) / 16777216.0f; }
static inline int32_t rng_int(int32_t n) { return (int32_t)(rng_u32() % (uint32_t)n); }

/* *gpu = the CUDA backend on device 0; skips the test without one. */
static inline void cuda_test_open(backend **gpu) {
    char err[256];
    int rc = backend_cuda_init(gpu, 0, err, sizeof err);
    if (rc == STATUS_UNAVAILABLE || rc == STATUS_UNSUPPORTED) TEST_SKIP("CUDA backend unavailable: %s", err);
    if (rc != STATUS_OK) TEST_FAIL("backend_cuda_init(0): %s", err);
}

#endif
