/* The fixture of the CUDA backend's op tests (test_cuda_ops.c: row ops
 * and matmuls; test_cuda_attention.c: the KV cache and attention): both
 * backends and everything one test allocates, random inputs, buffers held
 * by both backends, the NMSE of a GPU output against the CPU's, and
 * weights of every dtype.  Included by each of those files (one program
 * each): every function is static inline, so that a file may leave some
 * unused.
 *
 * Every op runs against the CPU backend (the reference) on the same fresh
 * random inputs, with the GPU outputs filled with NaN before each op so
 * that an element the kernel forgets to write fails.  Errors are
 * normalised, NMSE = sum((gpu - cpu)^2) / sum(cpu^2), with the bound per
 * op and dtype next to each check and why.  Without a GPU (CI) every test
 * skips and ctest reports the program skipped. */
#ifndef TESTS_KERNELS_CUDA_OPS_FIXTURE_H
#define TESTS_KERNELS_CUDA_OPS_FIXTURE_H

#include "cuda_test.h"

#include "common/dtype.h"

/* ---- Fixture: both backends and everything one test allocates ----
 * fx_open releases what a failed previous test left, fx_close releases all
 * of it at the end of a test. */

#define FX_MAX 256
static struct {
    backend *cpu, *gpu;
    void *host[FX_MAX];
    int n_host;
    void *cbuf[FX_MAX], *gbuf[FX_MAX];
    int n_buf;
    struct backend_weight cw[4], gw[4];
    int n_w;
    struct backend_kv ckv[4], gkv[4];
    int n_kv;
} fx;

static inline void fx_close(void) {
    for (int i = 0; i < fx.n_host; i++) free(fx.host[i]);
    for (int i = 0; i < fx.n_buf; i++) {
        backend_dealloc(fx.cpu, fx.cbuf[i]);
        backend_dealloc(fx.gpu, fx.gbuf[i]);
    }
    for (int i = 0; i < fx.n_w; i++) {
        backend_weight_free(fx.cpu, &fx.cw[i]);
        backend_weight_free(fx.gpu, &fx.gw[i]);
    }
    for (int i = 0; i < fx.n_kv; i++) {
        backend_kv_free(fx.cpu, &fx.ckv[i]);
        backend_kv_free(fx.gpu, &fx.gkv[i]);
    }
    backend_free(fx.cpu);
    backend_free(fx.gpu);
    memset(&fx, 0, sizeof fx);
}

static inline void fx_open(void) {
    rng_seed();
    fx_close();
    cuda_test_open(&fx.gpu);
    char err[256];
    int rc = backend_cpu_init(&fx.cpu, 0, err, sizeof err);
    if (rc != STATUS_OK) TEST_FAIL("backend_cpu_init: %s", err);
}

static inline void *fx_host(size_t bytes) {
    if (fx.n_host == FX_MAX) TEST_FAIL("fixture: more than %d host buffers", FX_MAX);
    void *p = malloc(bytes ? bytes : 1);
    if (!p) TEST_FAIL("fixture: cannot allocate %zu host bytes", bytes);
    fx.host[fx.n_host++] = p;
    return p;
}


/* slots[0 .. n) = n distinct random cache slots below n_slots. */
static inline void distinct_slots(int32_t *slots, int n, int32_t n_slots) {
    for (int i = 0; i < n; i++) {
        int again;
        do {
            slots[i] = rng_int(n_slots);
            again = 0;
            for (int j = 0; j < i; j++) again |= slots[j] == slots[i];
        } while (again);
    }
}

static inline float *rand_f32(size_t n, float lo, float hi) {
    float *p = fx_host(n * sizeof(float));
    for (size_t i = 0; i < n; i++) p[i] = rng_f(lo, hi);
    return p;
}

/* ---- A buffer held by both backends ---- */
struct dbuf {
    void *c, *g;
    size_t bytes;
};

static inline struct dbuf dbuf_new(size_t bytes) {
    if (fx.n_buf == FX_MAX) TEST_FAIL("fixture: more than %d backend buffers", FX_MAX);
    struct dbuf d = {backend_alloc(fx.cpu, bytes), backend_alloc(fx.gpu, bytes), bytes};
    fx.cbuf[fx.n_buf] = d.c;
    fx.gbuf[fx.n_buf++] = d.g;
    if (!d.c) TEST_FAIL("cpu alloc %zu: %s", bytes, backend_errstr(fx.cpu));
    if (!d.g) TEST_FAIL("gpu alloc %zu: %s", bytes, backend_errstr(fx.gpu));
    return d;
}
static inline void dbuf_set(struct dbuf d, const void *host) {
    ASSERT_OK(backend_upload(fx.cpu, d.c, host, d.bytes));
    ASSERT_OK(backend_upload(fx.gpu, d.g, host, d.bytes));
}
static inline struct dbuf dbuf_from(const void *host, size_t bytes) {
    struct dbuf d = dbuf_new(bytes);
    dbuf_set(d, host);
    return d;
}
/* Fill both copies with NaN (all-ones bytes are NaN in F32, F16 and BF16). */
static inline void dbuf_poison(struct dbuf d) {
    void *nan = fx_host(d.bytes);
    memset(nan, 0xff, d.bytes);
    dbuf_set(d, nan);
}

static inline double nmse(const float *ref, const float *got, size_t n, size_t *worst) {
    double num = 0.0, den = 0.0, wd = -1.0;
    for (size_t i = 0; i < n; i++) {
        double e = (double)got[i] - (double)ref[i];
        if (got[i] != got[i]) e = INFINITY; /* NaN: an unwritten element */
        num += e * e;
        den += (double)ref[i] * ref[i];
        if (fabs(e) > wd || e != e) {
            wd = fabs(e);
            *worst = i;
        }
    }
    return den > 0.0 ? num / den : num;
}

/* Download n floats from both copies and bound their NMSE; returns it. */
static inline double check_f32(struct dbuf d, size_t n, double bound, const char *what) {
    ASSERT_OK(backend_sync(fx.cpu));
    float *c = fx_host(n * sizeof(float)), *g = fx_host(n * sizeof(float));
    ASSERT_OK(backend_download(fx.cpu, c, d.c, n * sizeof(float)));
    ASSERT_OK(backend_download(fx.gpu, g, d.g, n * sizeof(float)));
    size_t w = 0;
    double e = nmse(c, g, n, &w);
    if (!(e <= bound))
        TEST_FAIL("%s: NMSE %.3g > %.3g (worst element %zu: cpu %.9g, gpu %.9g)", what, e, bound, w, c[w], g[w]);
    return e;
}

/* Download both copies and require identical bytes. */
static inline void check_bytes(struct dbuf d, const char *what) {
    unsigned char *c = fx_host(d.bytes), *g = fx_host(d.bytes);
    ASSERT_OK(backend_download(fx.cpu, c, d.c, d.bytes));
    ASSERT_OK(backend_download(fx.gpu, g, d.g, d.bytes));
    for (size_t i = 0; i < d.bytes; i++)
        if (c[i] != g[i]) TEST_FAIL("%s: byte %zu differs: cpu 0x%02x, gpu 0x%02x", what, i, c[i], g[i]);
}

/* A random weight of type t in host memory.  Types with a quantizer get
 * quantized random floats; the others (Q4_1, Q5_0, Q5_1) get random code
 * bytes with sane scales and mins written over them. */
static inline void *rand_weight(enum dtype t, int64_t rows, int64_t cols) {
    size_t rb = dtype_row_bytes(t, cols);
    uint8_t *w = fx_host(rb * rows);
    if (t == DTYPE_Q4_1 || t == DTYPE_Q5_0 || t == DTYPE_Q5_1) {
        for (size_t i = 0; i < rb * rows; i++) w[i] = (uint8_t)rng_u32();
        size_t bb = dtype_block_bytes(t);
        for (size_t off = 0; off < rb * rows; off += bb) {
            fp16_t d = f32_to_fp16(rng_f(0.005f, 0.02f)), m = f32_to_fp16(rng_f(-0.1f, 0.1f));
            memcpy(w + off, &d, 2);
            if (t != DTYPE_Q5_0) memcpy(w + off + 2, &m, 2);
        }
        return w;
    }
    float *f = rand_f32((size_t)cols, -1, 1);
    for (int64_t r = 0; r < rows; r++) {
        for (int64_t i = 0; i < cols; i++) f[i] = rng_f(-1, 1);
        if (dtype_quant_row(t, f, w + rb * r, cols) != STATUS_OK)
            TEST_FAIL("dtype_quant_row(%s, %lld) failed", dtype_name(t), (long long)cols);
    }
    return w;
}

static inline int load_weight(enum dtype t, const void *host, int64_t rows, int64_t cols) {
    if (fx.n_w == 4) TEST_FAIL("fixture: more than 4 weights");
    int i = fx.n_w++;
    ASSERT_OK(backend_weight_load(fx.cpu, &fx.cw[i], t, host, rows, cols));
    int rc = backend_weight_load(fx.gpu, &fx.gw[i], t, host, rows, cols);
    if (rc != STATUS_OK) TEST_FAIL("gpu weight_load %s: %s", dtype_name(t), backend_errstr(fx.gpu));
    /* T4 has no BF16: the CUDA backend keeps F16. */
    ASSERT_EQ((int)(t == DTYPE_BF16 ? DTYPE_F16 : t), (int)fx.gw[i].type);
    return i;
}

static inline void free_weights(void) {
    for (int i = 0; i < fx.n_w; i++) {
        backend_weight_free(fx.cpu, &fx.cw[i]);
        backend_weight_free(fx.gpu, &fx.gw[i]);
    }
    fx.n_w = 0;
}

/* NMSE bound of matmul against the CPU backend.  The CPU quantizes the
 * activations to 8 bits for the quantized types (llama.cpp's scheme), an
 * error near 1e-5 that the GPU does not make: 2e-3 leaves room and still
 * fails any wrong scale, nibble or index (those give NMSE ~ 1).  F32
 * weights are dotted in F32 on both sides (warp-per-row kernel or
 * cublasSgemm).  F16 weights: both GPU paths round the activations to F16
 * for the tensor cores (~1e-7; the warp-per-row kernel, for odd widths,
 * does not).  BF16 becomes F16 on the GPU: ~1e-5 for values in [-1, 1]. */
static inline double matmul_bound(enum dtype t) {
    if (t == DTYPE_F32) return 1e-10;
    if (t == DTYPE_F16) return 1e-5;
    if (t == DTYPE_BF16) return 1e-4;
    return 2e-3;
}

#endif
