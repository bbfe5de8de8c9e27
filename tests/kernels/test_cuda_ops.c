/* Tests of the CUDA backend: every op against the CPU backend (the
 * reference) on the same fresh random inputs, with the GPU outputs filled
 * with NaN before each op so that an element the kernel forgets to write
 * fails.  Errors are normalised, NMSE = sum((gpu - cpu)^2) / sum(cpu^2),
 * with the bound per op and dtype next to each check and why.  Without a
 * GPU (CI) every test skips and ctest reports the program skipped. */
#include "../test.h"

#include <stdint.h>
#include <time.h>

#include "common/dtype.h"
#include "common/status.h"
#include "kernels/backend.h"

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

static void fx_close(void) {
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

static uint64_t rng_state;

static void fx_open(void) {
    static int seeded;
    if (!seeded) {
        const char *env = getenv("LLM_TEST_SEED");
        rng_state = env && *env ? strtoull(env, NULL, 0) : (uint64_t)time(NULL) * 2654435761u + 1;
        printf("  random seed %llu (LLM_TEST_SEED repeats it)\n", (unsigned long long)rng_state);
        seeded = 1;
    }
    fx_close();
    char err[256];
    int rc = backend_cuda_init(&fx.gpu, 0, err, sizeof err);
    if (rc == STATUS_UNAVAILABLE || rc == STATUS_UNSUPPORTED) TEST_SKIP("CUDA backend unavailable: %s", err);
    if (rc != STATUS_OK) TEST_FAIL("backend_cuda_init(0): %s", err);
    rc = backend_cpu_init(&fx.cpu, 0, err, sizeof err);
    if (rc != STATUS_OK) TEST_FAIL("backend_cpu_init: %s", err);
}

static void *fx_host(size_t bytes) {
    if (fx.n_host == FX_MAX) TEST_FAIL("fixture: more than %d host buffers", FX_MAX);
    void *p = malloc(bytes ? bytes : 1);
    if (!p) TEST_FAIL("fixture: cannot allocate %zu host bytes", bytes);
    fx.host[fx.n_host++] = p;
    return p;
}

/* ---- Random inputs (xorshift64*) ---- */

static uint32_t rng_u32(void) {
    rng_state ^= rng_state >> 12;
    rng_state ^= rng_state << 25;
    rng_state ^= rng_state >> 27;
    return (uint32_t)((rng_state * 2685821657736338717ull) >> 32);
}
static float rng_f(float lo, float hi) { return lo + (hi - lo) * (float)(rng_u32() >> 8) / 16777216.0f; }
static int32_t rng_int(int32_t n) { return (int32_t)(rng_u32() % (uint32_t)n); }

/* slots[0 .. n) = n distinct random cache slots below n_slots. */
static void distinct_slots(int32_t *slots, int n, int32_t n_slots) {
    for (int i = 0; i < n; i++) {
        int again;
        do {
            slots[i] = rng_int(n_slots);
            again = 0;
            for (int j = 0; j < i; j++) again |= slots[j] == slots[i];
        } while (again);
    }
}

static float *rand_f32(size_t n, float lo, float hi) {
    float *p = fx_host(n * sizeof(float));
    for (size_t i = 0; i < n; i++) p[i] = rng_f(lo, hi);
    return p;
}

/* ---- A buffer held by both backends ---- */
struct dbuf {
    void *c, *g;
    size_t bytes;
};

static struct dbuf dbuf_new(size_t bytes) {
    if (fx.n_buf == FX_MAX) TEST_FAIL("fixture: more than %d backend buffers", FX_MAX);
    struct dbuf d = {backend_alloc(fx.cpu, bytes), backend_alloc(fx.gpu, bytes), bytes};
    fx.cbuf[fx.n_buf] = d.c;
    fx.gbuf[fx.n_buf++] = d.g;
    if (!d.c) TEST_FAIL("cpu alloc %zu: %s", bytes, backend_errstr(fx.cpu));
    if (!d.g) TEST_FAIL("gpu alloc %zu: %s", bytes, backend_errstr(fx.gpu));
    return d;
}
static void dbuf_set(struct dbuf d, const void *host) {
    ASSERT_OK(backend_upload(fx.cpu, d.c, host, d.bytes));
    ASSERT_OK(backend_upload(fx.gpu, d.g, host, d.bytes));
}
static struct dbuf dbuf_from(const void *host, size_t bytes) {
    struct dbuf d = dbuf_new(bytes);
    dbuf_set(d, host);
    return d;
}
/* Fill both copies with NaN (all-ones bytes are NaN in F32, F16 and BF16). */
static void dbuf_poison(struct dbuf d) {
    void *nan = fx_host(d.bytes);
    memset(nan, 0xff, d.bytes);
    dbuf_set(d, nan);
}

static double nmse(const float *ref, const float *got, size_t n, size_t *worst) {
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
static double check_f32(struct dbuf d, size_t n, double bound, const char *what) {
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
static void check_bytes(struct dbuf d, const char *what) {
    unsigned char *c = fx_host(d.bytes), *g = fx_host(d.bytes);
    ASSERT_OK(backend_download(fx.cpu, c, d.c, d.bytes));
    ASSERT_OK(backend_download(fx.gpu, g, d.g, d.bytes));
    for (size_t i = 0; i < d.bytes; i++)
        if (c[i] != g[i]) TEST_FAIL("%s: byte %zu differs: cpu 0x%02x, gpu 0x%02x", what, i, c[i], g[i]);
}

/* ---- Basics ---- */

TEST(cuda_ops_identity_and_memory) {
    fx_open();
    ASSERT_EQ(1, backend_is_gpu(fx.gpu));
    ASSERT_TRUE(strncmp(backend_name(fx.gpu), "cuda:0", 6) == 0);
    printf("  %s\n", backend_name(fx.gpu));
    size_t fr = 0, tot = 0;
    ASSERT_OK(backend_mem_info(fx.gpu, &fr, &tot));
    ASSERT_TRUE(tot > 0 && fr <= tot);
    /* More than any card has: NULL, with the size in the message. */
    ASSERT_TRUE(backend_alloc(fx.gpu, (size_t)1 << 52) == NULL);
    ASSERT_TRUE(strstr(backend_errstr(fx.gpu), "4503599627370496") != NULL);
    /* The failure is not sticky: the next allocation works. */
    void *p = backend_alloc(fx.gpu, 1 << 20);
    ASSERT_TRUE(p != NULL);
    backend_dealloc(fx.gpu, p);
    fx_close();
}

TEST(cuda_ops_upload_copy_download) {
    fx_open();
    size_t n = (3 << 20) + 17;
    unsigned char *src = fx_host(n), *back = fx_host(n);
    for (size_t i = 0; i < n; i++) src[i] = (unsigned char)rng_u32();
    void *a = backend_alloc(fx.gpu, n), *b = backend_alloc(fx.gpu, n);
    fx.gbuf[fx.n_buf++] = a;
    fx.gbuf[fx.n_buf++] = b;
    ASSERT_TRUE(a && b);
    ASSERT_OK(backend_upload(fx.gpu, a, src, n));
    ASSERT_OK(backend_copy(fx.gpu, b, a, n));
    ASSERT_OK(backend_download(fx.gpu, back, b, n));
    ASSERT_EQ(0, memcmp(src, back, n));
    fx_close();
}

/* ---- Row ops ---- */

/* Widths that take the register-held kernel with 1, 2, 4 and 8 float4s
 * per thread, and widths that are not a multiple of 4 (the plain loop). */
static const int32_t norm_dims[] = {1000, 4096, 5120, 8192, 14336, 18000, 999, 2050};

TEST(cuda_ops_rmsnorm) {
    fx_open();
    for (size_t k = 0; k < sizeof norm_dims / sizeof norm_dims[0]; k++) {
        int32_t n = 7, dim = norm_dims[k];
        struct dbuf x = dbuf_from(rand_f32((size_t)n * dim, -2, 2), (size_t)n * dim * 4);
        struct dbuf w = dbuf_from(rand_f32(dim, 0.5f, 1.5f), (size_t)dim * 4);
        struct dbuf out = dbuf_new((size_t)n * dim * 4);
        dbuf_poison(out);
        ASSERT_OK(backend_rmsnorm(fx.cpu, out.c, x.c, w.c, n, dim, 1e-5f));
        ASSERT_OK(backend_rmsnorm(fx.gpu, out.g, x.g, w.g, n, dim, 1e-5f));
        char what[64];
        snprintf(what, sizeof what, "rmsnorm dim %d", dim);
        /* F32 throughout; only the order of the sum of squares differs. */
        check_f32(out, (size_t)n * dim, 1e-11, what);
    }
    fx_close();
}

TEST(cuda_ops_add_rmsnorm) {
    fx_open();
    for (size_t k = 0; k < sizeof norm_dims / sizeof norm_dims[0]; k++) {
        int32_t n = 5, dim = norm_dims[k];
        struct dbuf x = dbuf_from(rand_f32((size_t)n * dim, -2, 2), (size_t)n * dim * 4);
        struct dbuf dl = dbuf_from(rand_f32((size_t)n * dim, -1, 1), (size_t)n * dim * 4);
        struct dbuf w = dbuf_from(rand_f32(dim, 0.5f, 1.5f), (size_t)dim * 4);
        struct dbuf out = dbuf_new((size_t)n * dim * 4);
        dbuf_poison(out);
        ASSERT_OK(backend_add_rmsnorm(fx.cpu, x.c, dl.c, out.c, w.c, n, dim, 1e-6f));
        ASSERT_OK(backend_add_rmsnorm(fx.gpu, x.g, dl.g, out.g, w.g, n, dim, 1e-6f));
        char what[64];
        snprintf(what, sizeof what, "add_rmsnorm dim %d residual", dim);
        check_f32(x, (size_t)n * dim, 0.0, what); /* one F32 add: exact */
        snprintf(what, sizeof what, "add_rmsnorm dim %d out", dim);
        check_f32(out, (size_t)n * dim, 1e-11, what);
    }
    fx_close();
}

TEST(cuda_ops_add_swiglu) {
    fx_open();
    int64_t n = 100003;
    struct dbuf x = dbuf_from(rand_f32(n, -3, 3), n * 4);
    struct dbuf y = dbuf_from(rand_f32(n, -3, 3), n * 4);
    struct dbuf out = dbuf_new(n * 4);
    dbuf_poison(out);
    ASSERT_OK(backend_swiglu(fx.cpu, out.c, x.c, y.c, n));
    ASSERT_OK(backend_swiglu(fx.gpu, out.g, x.g, y.g, n));
    check_f32(out, n, 1e-12, "swiglu"); /* expf of two libraries: a few ulp */
    ASSERT_OK(backend_add(fx.cpu, x.c, y.c, n));
    ASSERT_OK(backend_add(fx.gpu, x.g, y.g, n));
    check_f32(x, n, 0.0, "add");
    fx_close();
}

TEST(cuda_ops_get_rows) {
    fx_open();
    int32_t rows = 50, dim = 300, n = 9;
    struct dbuf x = dbuf_from(rand_f32((size_t)rows * dim, -1, 1), (size_t)rows * dim * 4);
    int32_t idx[9];
    for (int i = 0; i < n; i++) idx[i] = rng_int(rows);
    idx[3] = idx[1]; /* a repeat */
    struct dbuf di = dbuf_from(idx, sizeof idx);
    struct dbuf out = dbuf_new((size_t)n * dim * 4);
    dbuf_poison(out);
    ASSERT_OK(backend_get_rows(fx.cpu, out.c, x.c, di.c, n, dim));
    ASSERT_OK(backend_get_rows(fx.gpu, out.g, x.g, di.g, n, dim));
    check_f32(out, (size_t)n * dim, 0.0, "get_rows");
    fx_close();
}

static void rope_case(int neox, int32_t n_freq) {
    int32_t n = 9, n_heads = 4, hd = 64;
    size_t elems = (size_t)n * n_heads * hd;
    struct dbuf x = dbuf_from(rand_f32(elems, -1, 1), elems * 4);
    int32_t pos[9];
    for (int i = 0; i < n; i++) pos[i] = i < 4 ? i : rng_int(200000);
    struct dbuf dp = dbuf_from(pos, sizeof pos);
    float *inv = fx_host((size_t)n_freq * 4);
    for (int i = 0; i < n_freq; i++) inv[i] = powf(10000.0f, -2.0f * i / (float)hd);
    struct dbuf di = dbuf_from(inv, (size_t)n_freq * 4);
    ASSERT_OK(backend_rope(fx.cpu, x.c, dp.c, n, n_heads, hd, di.c, n_freq, neox));
    ASSERT_OK(backend_rope(fx.gpu, x.g, dp.g, n, n_heads, hd, di.g, n_freq, neox));
    /* Both form the angle in double; sin/cos of two libraries. */
    check_f32(x, elems, 1e-12, neox ? "rope neox" : "rope gptj");
}

TEST(cuda_ops_rope_both_orders) {
    fx_open();
    rope_case(0, 32);
    rope_case(1, 32);
    rope_case(0, 12); /* partial rotation: the rest must stay as is */
    rope_case(1, 12);
    fx_close();
}

TEST(cuda_ops_convert) {
    fx_open();
    int64_t n = 70001;
    enum dtype types[3] = {DTYPE_F32, DTYPE_F16, DTYPE_BF16};
    float *src = rand_f32(n, -1000, 1000);
    for (int s = 0; s < 3; s++)
        for (int d = 0; d < 3; d++) {
            if (s == d) continue;
            /* The source in its own type, made by the CPU backend. */
            struct dbuf f = dbuf_from(src, n * 4);
            struct dbuf in = dbuf_new(n * 4), out = dbuf_new(n * 4);
            ASSERT_OK(backend_convert(fx.cpu, in.c, types[s], f.c, DTYPE_F32, n));
            ASSERT_OK(backend_sync(fx.cpu));
            void *tmp = fx_host(n * 4);
            ASSERT_OK(backend_download(fx.cpu, tmp, in.c, n * 4));
            dbuf_set(in, tmp);
            dbuf_poison(out);
            ASSERT_OK(backend_convert(fx.cpu, out.c, types[d], in.c, types[s], n));
            ASSERT_OK(backend_convert(fx.gpu, out.g, types[d], in.g, types[s], n));
            ASSERT_OK(backend_sync(fx.cpu));
            char what[64];
            snprintf(what, sizeof what, "convert %s to %s", dtype_name(types[s]), dtype_name(types[d]));
            /* Round to nearest even on both sides: identical bits. */
            out.bytes = (size_t)n * (types[d] == DTYPE_F32 ? 4 : 2);
            check_bytes(out, what);
        }
    fx_close();
}

/* ---- Weights: embed and matmul for every dtype ---- */

static const enum dtype all_types[] = {DTYPE_F32, DTYPE_F16, DTYPE_BF16, DTYPE_Q8_0, DTYPE_Q4_0, DTYPE_Q4_1,
                                       DTYPE_Q5_0, DTYPE_Q5_1, DTYPE_Q4_K, DTYPE_Q5_K, DTYPE_Q6_K};

/* A random weight of type t in host memory.  Types with a quantizer get
 * quantized random floats; the others (Q4_1, Q5_0, Q5_1) get random code
 * bytes with sane scales and mins written over them. */
static void *rand_weight(enum dtype t, int64_t rows, int64_t cols) {
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

static int load_weight(enum dtype t, const void *host, int64_t rows, int64_t cols) {
    if (fx.n_w == 4) TEST_FAIL("fixture: more than 4 weights");
    int i = fx.n_w++;
    ASSERT_OK(backend_weight_load(fx.cpu, &fx.cw[i], t, host, rows, cols));
    int rc = backend_weight_load(fx.gpu, &fx.gw[i], t, host, rows, cols);
    if (rc != STATUS_OK) TEST_FAIL("gpu weight_load %s: %s", dtype_name(t), backend_errstr(fx.gpu));
    /* T4 has no BF16: the CUDA backend keeps F16. */
    ASSERT_EQ((int)(t == DTYPE_BF16 ? DTYPE_F16 : t), (int)fx.gw[i].type);
    return i;
}

static void free_weights(void) {
    for (int i = 0; i < fx.n_w; i++) {
        backend_weight_free(fx.cpu, &fx.cw[i]);
        backend_weight_free(fx.gpu, &fx.gw[i]);
    }
    fx.n_w = 0;
}

TEST(cuda_ops_embed_every_dtype) {
    fx_open();
    int64_t rows = 37, cols = 512;
    int32_t n = 6, ids[6];
    for (int i = 0; i < n; i++) ids[i] = rng_int((int32_t)rows);
    ids[5] = (int32_t)rows - 1;
    struct dbuf di = dbuf_from(ids, sizeof ids);
    struct dbuf out = dbuf_new((size_t)n * cols * 4);
    for (size_t k = 0; k < sizeof all_types / sizeof all_types[0]; k++) {
        enum dtype t = all_types[k];
        int wi = load_weight(t, rand_weight(t, rows, cols), rows, cols);
        dbuf_poison(out);
        ASSERT_OK(backend_embed(fx.cpu, out.c, &fx.cw[wi], di.c, n));
        ASSERT_OK(backend_embed(fx.gpu, out.g, &fx.gw[wi], di.g, n));
        char what[64];
        snprintf(what, sizeof what, "embed %s", dtype_name(t));
        /* The same dequantization formula in F32; BF16 stored as F16 loses
         * nothing for values in [-1, 1] beyond F16's 11 bits (NMSE ~1e-7). */
        check_f32(out, (size_t)n * cols, t == DTYPE_BF16 ? 1e-6 : 1e-12, what);
        free_weights();
    }
    fx_close();
}

/* Which matmul path the GPU takes: the backend's own choice, cuBLAS for
 * every n (LLM_CUDA_SKINNY_MAX=0) or the weight-reading kernels up to 16
 * tokens (LLM_CUDA_SKINNY_MAX=16).  Each test runs all three. */
enum mm_mode { MM_DEFAULT, MM_GEMM, MM_SKINNY };
static enum mm_mode mm_mode;

static void mm_set_mode(enum mm_mode m) {
    mm_mode = m;
    if (m == MM_DEFAULT) unsetenv("LLM_CUDA_SKINNY_MAX");
    else setenv("LLM_CUDA_SKINNY_MAX", m == MM_GEMM ? "0" : "16", 1);
}

/* NMSE bound of matmul against the CPU backend.  The CPU quantizes the
 * activations to 8 bits for the quantized types (llama.cpp's scheme), an
 * error near 1e-5 that the GPU does not make: 2e-3 leaves room and still
 * fails any wrong scale, nibble or index (those give NMSE ~ 1).  F32
 * weights are dotted in F32 on both sides (warp-per-row kernel or
 * cublasSgemm).  F16 weights: both GPU paths round the activations to F16
 * for the tensor cores (~1e-7; the warp-per-row kernel, for odd widths,
 * does not).  BF16 becomes F16 on the GPU: ~1e-5 for values in [-1, 1]. */
static double matmul_bound(enum dtype t) {
    if (t == DTYPE_F32) return 1e-10;
    if (t == DTYPE_F16) return 1e-5;
    if (t == DTYPE_BF16) return 1e-4;
    return 2e-3;
}

static void matmul_case(enum dtype t, int64_t rows, int64_t cols, const int32_t *ns, int n_ns) {
    int wi = load_weight(t, rand_weight(t, rows, cols), rows, cols);
    int32_t nmax = 0;
    for (int i = 0; i < n_ns; i++) nmax = ns[i] > nmax ? ns[i] : nmax;
    struct dbuf x = dbuf_from(rand_f32((size_t)nmax * cols, -1, 1), (size_t)nmax * cols * 4);
    struct dbuf out = dbuf_new((size_t)nmax * rows * 4);
    for (int i = 0; i < n_ns; i++) {
        dbuf_poison(out);
        ASSERT_OK(backend_matmul(fx.cpu, out.c, &fx.cw[wi], x.c, ns[i]));
        int rc = backend_matmul(fx.gpu, out.g, &fx.gw[wi], x.g, ns[i]);
        if (rc != STATUS_OK) TEST_FAIL("gpu matmul %s n=%d: %s", dtype_name(t), ns[i], backend_errstr(fx.gpu));
        char what[128];
        static const char *mode_name[3] = {"default path", "cuBLAS path", "skinny path"};
        snprintf(what, sizeof what, "matmul %s [%lld x %lld] n=%d, %s", dtype_name(t), (long long)rows,
                 (long long)cols, ns[i], mode_name[mm_mode]);
        check_f32(out, (size_t)ns[i] * rows, matmul_bound(t), what);
    }
    free_weights();
}

/* Consecutive matmuls on one input (q, k, v; gate, up) reuse the
 * activations the first one converted or quantized (cuda_ops.h, act_*):
 * each result must still match the CPU, also across weight types that
 * share a form (Q8_0, Q4_K and Q6_K all take int8 blocks; Q4_K also the
 * per-half sums, which a form Q8_0 left lacks), and an op that
 * changes the input (add) or an upload into it must be seen by the next
 * matmul. */
TEST(cuda_ops_matmul_reuses_input_safely) {
    mm_set_mode(MM_DEFAULT);
    fx_open();
    static const int32_t ns[] = {1, 2, 17, 80};
    int64_t cols = 512;
    enum { NT = 4 };
    static const enum dtype types[NT] = {DTYPE_Q8_0, DTYPE_Q4_K, DTYPE_Q6_K, DTYPE_F16};
    static const int64_t rows[NT] = {96, 256, 64, 160};
    int wi[NT];
    for (int k = 0; k < NT; k++) wi[k] = load_weight(types[k], rand_weight(types[k], rows[k], cols), rows[k], cols);
    struct dbuf x = dbuf_from(rand_f32((size_t)80 * cols, -1, 1), (size_t)80 * cols * 4);
    struct dbuf y = dbuf_from(rand_f32((size_t)80 * cols, -1, 1), (size_t)80 * cols * 4);
    struct dbuf out[2][NT];
    for (int r = 0; r < 2; r++)
        for (int k = 0; k < NT; k++) out[r][k] = dbuf_new((size_t)80 * rows[k] * 4);
    for (int i = 0; i < 4; i++) {
        int32_t n = ns[i];
        /* Poisoning is an upload, which forgets kept inputs: all first. */
        for (int r = 0; r < 2; r++)
            for (int k = 0; k < NT; k++) dbuf_poison(out[r][k]);
        for (int r = 0; r < 2; r++) {
            if (r == 1) { /* the input changes through an op between two matmuls */
                ASSERT_OK(backend_add(fx.cpu, x.c, y.c, (int64_t)n * cols));
                ASSERT_OK(backend_add(fx.gpu, x.g, y.g, (int64_t)n * cols));
            }
            for (int k = 0; k < NT; k++) {
                ASSERT_OK(backend_matmul(fx.cpu, out[r][k].c, &fx.cw[wi[k]], x.c, n));
                int rc = backend_matmul(fx.gpu, out[r][k].g, &fx.gw[wi[k]], x.g, n);
                if (rc != STATUS_OK)
                    TEST_FAIL("gpu matmul %s n=%d: %s", dtype_name(types[k]), n, backend_errstr(fx.gpu));
            }
        }
        for (int r = 0; r < 2; r++)
            for (int k = 0; k < NT; k++) {
                char what[128];
                snprintf(what, sizeof what, "matmul %s n=%d %s", dtype_name(types[k]), n,
                         r == 0 ? "on one input in a row" : "after an add changed the input");
                check_f32(out[r][k], (size_t)n * rows[k], matmul_bound(types[k]), what);
            }
        dbuf_set(x, rand_f32((size_t)80 * cols, -1, 1)); /* fresh input for the next n */
    }
    free_weights();
    fx_close();
}

/* Every token count the weight-reading kernels pick a different tile for
 * (8, 16, 32, 64 tokens) and one past each edge; widths of one chunk, of
 * several (split K over blocks, partial sums added by the last block) and,
 * for the 32-element types, a partial last chunk (352 = 256 + 3 x 32). */
static void matmul_type(enum dtype t) {
    static const int32_t ns[] = {1, 5, 8, 9, 16, 17, 32, 33, 64};
    int k_quant = t == DTYPE_Q4_K || t == DTYPE_Q5_K || t == DTYPE_Q6_K;
    for (int m = MM_DEFAULT; m <= MM_SKINNY; m++) {
        mm_set_mode((enum mm_mode)m);
        fx_open();
        matmul_case(t, 100, 512, ns, 9);
        matmul_case(t, 35, 768, ns, 4); /* rows not a multiple of the rows per block */
        if (!k_quant) matmul_case(t, 130, 352, ns, 9);
        matmul_case(t, 300, 256, ns, 9); /* one chunk: no split */
        fx_close();
    }
    mm_set_mode(MM_DEFAULT);
}

/* F32 and F16 at 1-2 tokens take the row kernel of matmul_vec.cu, with four
 * warps per row on grids of one wave (every shape here): also two and one
 * (LLM_CUDA_MV_SPLIT=2, 1). */
static void matmul_float_type(enum dtype t) {
    matmul_type(t);
    setenv("LLM_CUDA_MV_SPLIT", "2", 1);
    matmul_type(t);
    setenv("LLM_CUDA_MV_SPLIT", "1", 1);
    matmul_type(t);
    unsetenv("LLM_CUDA_MV_SPLIT");
}

TEST(cuda_ops_matmul_f32) { matmul_float_type(DTYPE_F32); }
TEST(cuda_ops_matmul_f16) { matmul_float_type(DTYPE_F16); }
TEST(cuda_ops_matmul_bf16) { matmul_type(DTYPE_BF16); }
TEST(cuda_ops_matmul_q8_0) { matmul_type(DTYPE_Q8_0); }
TEST(cuda_ops_matmul_q4_0) { matmul_type(DTYPE_Q4_0); }
TEST(cuda_ops_matmul_q4_1) { matmul_type(DTYPE_Q4_1); }
TEST(cuda_ops_matmul_q5_0) { matmul_type(DTYPE_Q5_0); }
TEST(cuda_ops_matmul_q5_1) { matmul_type(DTYPE_Q5_1); }
TEST(cuda_ops_matmul_q4_k) { matmul_type(DTYPE_Q4_K); }
TEST(cuda_ops_matmul_q5_k) { matmul_type(DTYPE_Q5_K); }
TEST(cuda_ops_matmul_q6_k) { matmul_type(DTYPE_Q6_K); }

TEST(cuda_ops_matmul_odd_width_and_tiles) {
    mm_set_mode(MM_DEFAULT);
    fx_open();
    static const int32_t small[] = {1, 3, 20};
    matmul_case(DTYPE_F16, 33, 100, small, 3); /* width the weight-reading kernels cannot take */
    matmul_case(DTYPE_F32, 33, 102, small, 3);
    /* 4200 rows of 4096 on the cuBLAS path (65 tokens): three dequantized
     * tiles of at most 16 MiB (LLM_CUDA_DEQUANT_TILE_MB=16), then one tile
     * of the default size; the tensor-core kernel at 40 tokens, split over
     * blocks, 33 row blocks. */
    static const int32_t big[] = {40, 65};
    setenv("LLM_CUDA_DEQUANT_TILE_MB", "16", 1);
    matmul_case(DTYPE_Q4_K, 4200, 4096, big, 2);
    unsetenv("LLM_CUDA_DEQUANT_TILE_MB");
    matmul_case(DTYPE_Q4_K, 4200, 4096, big, 2);
    static const int32_t dec[] = {1, 16};
    matmul_case(DTYPE_Q6_K, 4200, 4096, dec, 2);
    matmul_case(DTYPE_Q8_0, 1000, 11008, dec, 2);
    /* Many rows at 5-12 tokens (matmul_mr.cu to 8, then mq), a partial
     * last tile of 16 rows. */
    static const int32_t few[] = {5, 8, 12};
    matmul_case(DTYPE_Q4_K, 9000, 512, few, 3);
    matmul_case(DTYPE_Q8_0, 40000, 256, few, 3);
    fx_close();
}

/* Prefill tiles made ahead on a side stream (dequant_ahead.cu): the CUDA
 * backend learns which weight follows which and dequantizes the next tile
 * while the present matmul runs.  Three weights of 1 MiB tiles (3, 2 and
 * 1 tiles of 128 rows) in one order until it is learned, then in another
 * (every guess wrong), then the first again, and then with A's bytes
 * overwritten in place after a tile of A was made ahead from the old ones
 * (the upload must drop it).  Every result against the CPU; the same with
 * LLM_CUDA_DEQUANT_AHEAD=0 (the serial path). */
TEST(cuda_ops_matmul_tiles_made_ahead) {
    mm_set_mode(MM_DEFAULT);
    setenv("LLM_CUDA_DEQUANT_TILE_MB", "1", 1);
    for (int off = 0; off < 2; off++) {
        if (off) setenv("LLM_CUDA_DEQUANT_AHEAD", "0", 1);
        fx_open();
        const int64_t cols = 4096;
        const int32_t n = 80;
        enum { NW = 3 };
        static const enum dtype types[NW] = {DTYPE_Q4_K, DTYPE_Q8_0, DTYPE_Q6_K};
        static const int64_t rows[NW] = {300, 200, 100};
        int wi[NW];
        for (int k = 0; k < NW; k++) wi[k] = load_weight(types[k], rand_weight(types[k], rows[k], cols), rows[k], cols);
        struct dbuf x = dbuf_from(rand_f32((size_t)n * cols, -1, 1), (size_t)n * cols * 4);
        struct dbuf out = dbuf_new((size_t)n * 300 * 4);
        static const int order[] = {0, 1, 2, 0, 1, 2, 0, 1, 2, 2, 1, 0, 1, 0, 2, 0, 1, 2, 0, 1, 2};
        const int n_order = (int)(sizeof order / sizeof order[0]);
        for (int pass = 0; pass < 2; pass++) {
            if (pass == 1) { /* new bytes for A in place, on both sides */
                void *host = rand_weight(DTYPE_Q4_K, rows[0], cols);
                ASSERT_OK(backend_upload(fx.gpu, fx.gw[wi[0]].data, host, dtype_row_bytes(DTYPE_Q4_K, cols) * 300));
                backend_weight_free(fx.cpu, &fx.cw[wi[0]]);
                ASSERT_OK(backend_weight_load(fx.cpu, &fx.cw[wi[0]], DTYPE_Q4_K, host, rows[0], cols));
            }
            for (int i = 0; i < (pass ? 6 : n_order); i++) {
                int k = order[i];
                dbuf_poison(out);
                ASSERT_OK(backend_matmul(fx.cpu, out.c, &fx.cw[wi[k]], x.c, n));
                int rc = backend_matmul(fx.gpu, out.g, &fx.gw[wi[k]], x.g, n);
                if (rc != STATUS_OK) TEST_FAIL("gpu matmul %s: %s", dtype_name(types[k]), backend_errstr(fx.gpu));
                char what[128];
                snprintf(what, sizeof what, "matmul %s [%lld x %lld] n=%d, call %d%s%s", dtype_name(types[k]),
                         (long long)rows[k], (long long)cols, n, i, pass ? " after A was overwritten" : "",
                         off ? " (serial)" : "");
                check_f32(out, (size_t)n * rows[k], matmul_bound(types[k]), what);
            }
        }
        /* A graph of B then C at this size, recorded after the same ops ran
         * outside it (as the worker does): recording takes the scratch
         * tile, which must need no new memory, and the replays, with tiles
         * of B made ahead before them, must still be right. */
        struct dbuf out2 = dbuf_new((size_t)n * 300 * 4);
        for (int rep = 0; rep < 3; rep++) {
            dbuf_poison(out);
            dbuf_poison(out2);
            if (rep == 0) {
                ASSERT_OK(backend_matmul(fx.gpu, out.g, &fx.gw[wi[1]], x.g, n));
                ASSERT_OK(backend_matmul(fx.gpu, out2.g, &fx.gw[wi[2]], x.g, n));
            } else {
                backend_graph *g = NULL;
                ASSERT_OK(backend_graph_begin(fx.gpu));
                int rc1 = backend_matmul(fx.gpu, out.g, &fx.gw[wi[1]], x.g, n);
                int rc2 = backend_matmul(fx.gpu, out2.g, &fx.gw[wi[2]], x.g, n);
                int rc = backend_graph_end(fx.gpu, &g);
                if (rc1 != STATUS_OK || rc2 != STATUS_OK || rc != STATUS_OK)
                    TEST_FAIL("recording matmuls at %d tokens: %d %d %d: %s", n, rc1, rc2, rc,
                              backend_errstr(fx.gpu));
                ASSERT_OK(backend_matmul(fx.gpu, out.g, &fx.gw[wi[0]], x.g, n)); /* learns A -> B, makes B ahead */
                dbuf_poison(out);
                ASSERT_OK(backend_graph_launch(fx.gpu, g));
                backend_graph_free(fx.gpu, g);
            }
            ASSERT_OK(backend_matmul(fx.cpu, out.c, &fx.cw[wi[1]], x.c, n));
            ASSERT_OK(backend_matmul(fx.cpu, out2.c, &fx.cw[wi[2]], x.c, n));
            char what[96];
            snprintf(what, sizeof what, "matmul B at %d tokens, %s%s", n, rep ? "graph" : "ops", off ? " (serial)" : "");
            check_f32(out, (size_t)n * rows[1], matmul_bound(types[1]), what);
            snprintf(what, sizeof what, "matmul C at %d tokens, %s%s", n, rep ? "graph" : "ops", off ? " (serial)" : "");
            check_f32(out2, (size_t)n * rows[2], matmul_bound(types[2]), what);
        }
        fx_close();
    }
    unsetenv("LLM_CUDA_DEQUANT_AHEAD");
    unsetenv("LLM_CUDA_DEQUANT_TILE_MB");
}

/* Out of memory while serving: with the GPU nearly full, a prefill-sized
 * matmul whose scratch (F16 activations and a dequantized tile) cannot be
 * had fails with STATUS_NO_MEMORY and a message saying how much it asked
 * for; once memory is back, the same call works and matches the CPU.  (The
 * worker turns such a failure into the step's error reply and goes on:
 * docs/worker.md.) */
TEST(cuda_ops_out_of_memory_fails_the_op_not_the_backend) {
    mm_set_mode(MM_DEFAULT);
    fx_open();
    const int64_t rows = 1024, cols = 4096;
    const int32_t n = 512;
    int wi = load_weight(DTYPE_Q4_K, rand_weight(DTYPE_Q4_K, rows, cols), rows, cols);
    struct dbuf x = dbuf_from(rand_f32((size_t)n * cols, -1, 1), (size_t)n * cols * 4);
    struct dbuf out = dbuf_new((size_t)n * rows * 4);
    /* Fill the card, leaving less than the scratch this call needs (4 MiB
     * of F16 activations + an 8 MiB tile, with headroom: > 12 MiB). */
    void *hog[256];
    int n_hog = 0;
    size_t fr = 0, tot = 0, chunk = (size_t)4 << 30;
    while (n_hog < 256 && chunk >= ((size_t)1 << 20)) {
        ASSERT_OK(backend_mem_info(fx.gpu, &fr, &tot));
        void *p = fr >= chunk + ((size_t)6 << 20) ? backend_alloc(fx.gpu, chunk) : NULL;
        if (p) hog[n_hog++] = p;
        else chunk /= 2;
    }
    ASSERT_OK(backend_mem_info(fx.gpu, &fr, &tot));
    printf("  %zu MiB left free of %zu\n", fr >> 20, tot >> 20);
    int rc = backend_matmul(fx.gpu, out.g, &fx.gw[wi], x.g, n);
    for (int i = 0; i < n_hog; i++) backend_dealloc(fx.gpu, hog[i]);
    if (fr >= ((size_t)24 << 20)) TEST_SKIP("could not fill the GPU (%zu MiB still free)", fr >> 20);
    ASSERT_EQ(STATUS_NO_MEMORY, rc);
    printf("  failed as it should: %s\n", backend_errstr(fx.gpu));
    ASSERT_TRUE(strstr(backend_errstr(fx.gpu), "bytes") != NULL);
    /* Memory back: the same op works and is right. */
    dbuf_poison(out);
    ASSERT_OK(backend_matmul(fx.cpu, out.c, &fx.cw[wi], x.c, n));
    rc = backend_matmul(fx.gpu, out.g, &fx.gw[wi], x.g, n);
    if (rc != STATUS_OK) TEST_FAIL("gpu matmul after the memory came back: %s", backend_errstr(fx.gpu));
    check_f32(out, (size_t)n * rows, matmul_bound(DTYPE_Q4_K), "matmul after out of memory");
    fx_close();
}

/* The batch-1..4 kernel of matmul_gemv.cu four ways: the default routing
 * (it up to 2-4 tokens by type, matmul_mr.cu above), at every 1-4
 * (LLM_CUDA_GEMV_MAX=4), up to 2 tokens with a tensor-core kernel at 3-4
 * (=2) and off (=0: the tensor-core kernels).  7B widths (4096, 11008: 43 super-blocks, a
 * partial last round of lanes), widths under one round of 32 lanes (768,
 * 1184 = 37 blocks), and row counts that are not a multiple of the 4 rows
 * of a block. */
static void gemv_type(enum dtype t) {
    static const int32_t ns[] = {1, 2, 3, 4};
    static const char *modes[4] = {NULL, "4", "2", "0"};
    int k_quant = t == DTYPE_Q4_K || t == DTYPE_Q5_K || t == DTYPE_Q6_K;
    for (int m = 0; m < 4; m++) {
        if (modes[m]) setenv("LLM_CUDA_GEMV_MAX", modes[m], 1);
        else unsetenv("LLM_CUDA_GEMV_MAX");
        mm_set_mode(MM_DEFAULT);
        fx_open();
        matmul_case(t, 259, 4096, ns, 4);
        matmul_case(t, 37, 11008, ns, 4);
        matmul_case(t, 33, k_quant ? 768 : 1184, ns, 4);
        fx_close();
    }
    unsetenv("LLM_CUDA_GEMV_MAX");
}

TEST(cuda_ops_matmul_gemv_q8_0) { gemv_type(DTYPE_Q8_0); }
TEST(cuda_ops_matmul_gemv_q4_0) { gemv_type(DTYPE_Q4_0); }
TEST(cuda_ops_matmul_gemv_q4_k) { gemv_type(DTYPE_Q4_K); }
TEST(cuda_ops_matmul_gemv_q5_k) { gemv_type(DTYPE_Q5_K); }
TEST(cuda_ops_matmul_gemv_q6_k) { gemv_type(DTYPE_Q6_K); }

/* A norm followed by a matmul: at 1-2 rows the gemv kernels (which keep
 * the int8 form of their input for the next matmul on it), from 3 rows the
 * norm also writes the F16 form that matmul_mr.cu (3-16 tokens), the
 * cuBLAS path and, from 32 tokens, the tensor-core kernel read (rmsnorm.cu,
 * cuda_gemm_act).  The matmul results must match the CPU through
 * add_rmsnorm and rmsnorm, and again after the input changed under the
 * same pointer (a second norm with other weights must not leave the first
 * one's form in use). */
TEST(cuda_ops_rmsnorm_feeds_matmul) {
    mm_set_mode(MM_DEFAULT);
    const enum dtype types[4] = {DTYPE_Q8_0, DTYPE_Q4_K, DTYPE_Q6_K, DTYPE_F16};
    const int32_t ns[6] = {1, 2, 5, 12, 40, 80};
    for (int ti = 0; ti < 4; ti++) {
        fx_open();
        enum dtype t = types[ti];
        int64_t rows = 300, dim = 1024;
        int wi = load_weight(t, rand_weight(t, rows, dim), rows, dim);
        for (int ni = 0; ni < 6; ni++) {
            const int32_t n = ns[ni];
            struct dbuf x = dbuf_from(rand_f32((size_t)n * dim, -2, 2), (size_t)n * dim * 4);
            struct dbuf dl = dbuf_from(rand_f32((size_t)n * dim, -1, 1), (size_t)n * dim * 4);
            struct dbuf w1 = dbuf_from(rand_f32(dim, 0.5f, 1.5f), (size_t)dim * 4);
            struct dbuf w2 = dbuf_from(rand_f32(dim, 0.1f, 3.0f), (size_t)dim * 4);
            struct dbuf xn = dbuf_new((size_t)n * dim * 4), out = dbuf_new((size_t)n * rows * 4);
            for (int round = 0; round < 2; round++) {
                dbuf_poison(out);
                if (round == 0) {
                    ASSERT_OK(backend_add_rmsnorm(fx.cpu, x.c, dl.c, xn.c, w1.c, n, (int32_t)dim, 1e-6f));
                    ASSERT_OK(backend_add_rmsnorm(fx.gpu, x.g, dl.g, xn.g, w1.g, n, (int32_t)dim, 1e-6f));
                } else {
                    ASSERT_OK(backend_rmsnorm(fx.cpu, xn.c, x.c, w2.c, n, (int32_t)dim, 1e-6f));
                    ASSERT_OK(backend_rmsnorm(fx.gpu, xn.g, x.g, w2.g, n, (int32_t)dim, 1e-6f));
                }
                ASSERT_OK(backend_matmul(fx.cpu, out.c, &fx.cw[wi], xn.c, n));
                int rc = backend_matmul(fx.gpu, out.g, &fx.gw[wi], xn.g, n);
                if (rc != STATUS_OK) TEST_FAIL("gpu matmul: %s", backend_errstr(fx.gpu));
                char what[96];
                snprintf(what, sizeof what, "%s matmul after %s, n=%d", dtype_name(t),
                         round ? "rmsnorm" : "add_rmsnorm", n);
                check_f32(out, (size_t)n * rows, matmul_bound(t), what);
            }
        }
        fx_close();
    }
}

/* ---- Fused matmuls: against the CPU's plain ops ---- */

/* q, k and v of one input in one launch at 1-4 tokens on quantized
 * weights (matmul_gemv.cu; 1-2 on F16/F32), at up to 16 (matmul_mr.cu, the
 * K-quants; Q8_0 to 8), at 17-64 (matmul_wide.cu) and from 65 (one batched
 * cuBLAS call for F16 weights of equal rows), also with types mixed
 * (Q4_K_M's v may be Q6_K while q and k are Q4_K) and row counts that
 * leave blocks part-full; Q4_0 at 5-8 tokens takes the per-weight kernels. */
#define MULTI_NMAX 130
static void multi_case(const enum dtype *types, const int64_t *rows, int n_w, int64_t cols) {
    fx_open(); /* a fixture per case: the host buffers of a case add up */
    static const int32_t ns[] = {1, 2, 3, 4, 5, 8, 12, 17, 40, 64, 65, MULTI_NMAX};
    int wi[4];
    for (int j = 0; j < n_w; j++) wi[j] = load_weight(types[j], rand_weight(types[j], rows[j], cols), rows[j], cols);
    struct dbuf x = dbuf_from(rand_f32((size_t)MULTI_NMAX * cols, -1, 1), (size_t)MULTI_NMAX * cols * 4);
    struct dbuf out[4];
    for (int j = 0; j < n_w; j++) out[j] = dbuf_new((size_t)MULTI_NMAX * rows[j] * 4);
    for (size_t i = 0; i < sizeof ns / sizeof ns[0]; i++) {
        const int32_t n = ns[i];
        float *co[4], *go[4];
        const struct backend_weight *cw[4], *gw[4];
        for (int j = 0; j < n_w; j++) {
            dbuf_poison(out[j]);
            co[j] = out[j].c;
            go[j] = out[j].g;
            cw[j] = &fx.cw[wi[j]];
            gw[j] = &fx.gw[wi[j]];
        }
        ASSERT_OK(backend_matmul_multi(fx.cpu, n_w, co, cw, x.c, n));
        int rc = backend_matmul_multi(fx.gpu, n_w, go, gw, x.g, n);
        if (rc != STATUS_OK) TEST_FAIL("gpu matmul_multi n=%d: %s", n, backend_errstr(fx.gpu));
        for (int j = 0; j < n_w; j++) {
            char what[128];
            snprintf(what, sizeof what, "matmul_multi weight %d of %d (%s [%lld x %lld]) n=%d", j, n_w,
                     dtype_name(types[j]), (long long)rows[j], (long long)cols, n);
            check_f32(out[j], (size_t)n * rows[j], matmul_bound(types[j]), what);
        }
    }
    fx_close();
}

TEST(cuda_ops_matmul_multi) {
    mm_set_mode(MM_DEFAULT);
    const int64_t qkv[3] = {301, 99, 99}, four[4] = {64, 5, 130, 7}, two[2] = {33, 17};
    const enum dtype f16[3] = {DTYPE_F16, DTYPE_F16, DTYPE_F16}, q8[3] = {DTYPE_Q8_0, DTYPE_Q8_0, DTYPE_Q8_0};
    const enum dtype q4k[3] = {DTYPE_Q4_K, DTYPE_Q4_K, DTYPE_Q4_K}, mixed[3] = {DTYPE_Q4_K, DTYPE_Q4_K, DTYPE_Q6_K};
    const enum dtype q40[4] = {DTYPE_Q4_0, DTYPE_Q4_0, DTYPE_Q4_0, DTYPE_Q4_0}, f32[2] = {DTYPE_F32, DTYPE_F32};
    const enum dtype q5k[3] = {DTYPE_Q5_K, DTYPE_Q5_K, DTYPE_Q5_K}, q6k_q8[3] = {DTYPE_Q6_K, DTYPE_Q8_0, DTYPE_Q6_K};
    const enum dtype mixed5[3] = {DTYPE_Q5_K, DTYPE_Q5_K, DTYPE_Q6_K};
    const enum dtype mixed_apart[3] = {DTYPE_Q4_K, DTYPE_Q6_K, DTYPE_Q4_K};
    multi_case(f16, qkv, 3, 512);
    multi_case(q8, qkv, 3, 4096);
    multi_case(q4k, qkv, 3, 768);
    multi_case(mixed, qkv, 3, 1024); /* 1-2 tokens: one launch of two types */
    multi_case(mixed5, qkv, 3, 512);
    multi_case(mixed_apart, qkv, 3, 512); /* the second type between: a launch per type */
    multi_case(q5k, qkv, 3, 512);
    multi_case(q6k_q8, qkv, 3, 512);
    multi_case(q40, four, 4, 1184);
    multi_case(f32, two, 2, 256);
    /* From 65 tokens (cuBLAS): F16 weights of equal rows in one batched
     * call (q, k, v here; k and v above), quantized ones a call each; and
     * with LLM_CUDA_GEMM_GROUP=0, one call each. */
    const int64_t eq[3] = {128, 128, 128};
    const enum dtype q6k[3] = {DTYPE_Q6_K, DTYPE_Q6_K, DTYPE_Q6_K};
    multi_case(f16, eq, 3, 512);
    multi_case(q8, eq, 3, 1024);
    multi_case(q6k, eq, 3, 768);
    setenv("LLM_CUDA_GEMM_GROUP", "0", 1);
    multi_case(f16, eq, 3, 512);
    multi_case(q4k, eq, 3, 768);
    unsetenv("LLM_CUDA_GEMM_GROUP");
    /* matmul_wide.cu on groups of any size (one launch over the weights'
     * row blocks; by default it takes only large matmuls). */
    setenv("LLM_CUDA_WIDE_ITEMS", "0", 1);
    multi_case(q4k, qkv, 3, 768);
    multi_case(mixed, qkv, 3, 1024);
    multi_case(q6k_q8, qkv, 3, 512);
    multi_case(q40, four, 4, 1184);
    unsetenv("LLM_CUDA_WIDE_ITEMS");
}

/* gate and up in one launch with silu(gate) * up written by the block
 * (1-4 tokens on quantized weights, 1-2 on F16/F32), and the plain path
 * (two matmuls, or one matmul_wide.cu launch for both at 17-64 tokens,
 * and swiglu) above. */
#define SWIGLU_NMAX 64
static void swiglu_case(enum dtype t, int64_t rows, int64_t cols) {
    fx_open();
    int wg = load_weight(t, rand_weight(t, rows, cols), rows, cols);
    int wu = load_weight(t, rand_weight(t, rows, cols), rows, cols);
    int wd = rows % dtype_block_elems(t) == 0 ? load_weight(t, rand_weight(t, cols, rows), cols, rows) : -1;
    const int32_t ns[9] = {1, 2, 3, 4, 5, 8, 12, 20, SWIGLU_NMAX};
    const size_t nm = SWIGLU_NMAX;
    struct dbuf x = dbuf_from(rand_f32(nm * cols, -1, 1), nm * cols * 4);
    struct dbuf out = dbuf_new(nm * rows * 4), gt = dbuf_new(nm * rows * 4), ut = dbuf_new(nm * rows * 4),
                down = dbuf_new(nm * cols * 4);
    for (int i = 0; i < 9; i++) {
        /* Both poisoned first: a poisoning is an upload, which forgets the
         * kept forms, so one between the swiglu and the down matmul would
         * keep the down matmul off the form the swiglu left. */
        dbuf_poison(out);
        dbuf_poison(down);
        ASSERT_OK(backend_matmul_swiglu(fx.cpu, out.c, &fx.cw[wg], &fx.cw[wu], x.c, ns[i], gt.c, ut.c));
        int rc = backend_matmul_swiglu(fx.gpu, out.g, &fx.gw[wg], &fx.gw[wu], x.g, ns[i], gt.g, ut.g);
        if (rc != STATUS_OK) TEST_FAIL("gpu matmul_swiglu n=%d: %s", ns[i], backend_errstr(fx.gpu));
        char what[128];
        snprintf(what, sizeof what, "matmul_swiglu %s [%lld x %lld] n=%d", dtype_name(t), (long long)rows,
                 (long long)cols, ns[i]);
        /* Two matmul errors meet in a product: twice the matmul bound. */
        check_f32(out, (size_t)ns[i] * rows, 2 * matmul_bound(t), what);
        /* The down matmul on that output (from 3 rows the swiglu also
         * left it as F16 for cuBLAS): three matmul errors.  (Only where
         * the row count is a whole number of the type's blocks.) */
        if (rows % dtype_block_elems(t) != 0) continue;
        ASSERT_OK(backend_matmul(fx.cpu, down.c, &fx.cw[wd], out.c, ns[i]));
        rc = backend_matmul(fx.gpu, down.g, &fx.gw[wd], out.g, ns[i]);
        if (rc != STATUS_OK) TEST_FAIL("gpu matmul down n=%d: %s", ns[i], backend_errstr(fx.gpu));
        snprintf(what, sizeof what, "down after matmul_swiglu %s n=%d", dtype_name(t), ns[i]);
        check_f32(down, (size_t)ns[i] * cols, 3 * matmul_bound(t), what);
    }
    /* The same behind a norm, which keeps x's F16 form at the scratch's
     * start: matmul_mr.cu's fused swiglu (3-16 rows) then reads it
     * there. */
    if (wd >= 0) {
        struct dbuf nw = dbuf_from(rand_f32(cols, 0.5f, 1.5f), (size_t)cols * 4), xn = dbuf_new(nm * cols * 4);
        static const int32_t nn[3] = {3, 5, 12};
        for (int i = 0; i < 3; i++) {
            const int32_t n = nn[i];
            dbuf_poison(out);
            dbuf_poison(down);
            ASSERT_OK(backend_rmsnorm(fx.cpu, xn.c, x.c, nw.c, n, (int32_t)cols, 1e-6f));
            ASSERT_OK(backend_rmsnorm(fx.gpu, xn.g, x.g, nw.g, n, (int32_t)cols, 1e-6f));
            ASSERT_OK(backend_matmul_swiglu(fx.cpu, out.c, &fx.cw[wg], &fx.cw[wu], xn.c, n, gt.c, ut.c));
            int rc = backend_matmul_swiglu(fx.gpu, out.g, &fx.gw[wg], &fx.gw[wu], xn.g, n, gt.g, ut.g);
            if (rc != STATUS_OK) TEST_FAIL("gpu matmul_swiglu after rmsnorm n=%d: %s", n, backend_errstr(fx.gpu));
            char what[128];
            snprintf(what, sizeof what, "matmul_swiglu after rmsnorm %s n=%d", dtype_name(t), n);
            check_f32(out, (size_t)n * rows, 2 * matmul_bound(t), what);
            ASSERT_OK(backend_matmul(fx.cpu, down.c, &fx.cw[wd], out.c, n));
            rc = backend_matmul(fx.gpu, down.g, &fx.gw[wd], out.g, n);
            if (rc != STATUS_OK) TEST_FAIL("gpu matmul down after rmsnorm n=%d: %s", n, backend_errstr(fx.gpu));
            snprintf(what, sizeof what, "down after rmsnorm and matmul_swiglu %s n=%d", dtype_name(t), n);
            check_f32(down, (size_t)n * cols, 3 * matmul_bound(t), what);
        }
    }
    fx_close();
}

TEST(cuda_ops_matmul_swiglu) {
    mm_set_mode(MM_DEFAULT);
    swiglu_case(DTYPE_F16, 173, 512);
    swiglu_case(DTYPE_F32, 66, 256);
    swiglu_case(DTYPE_Q8_0, 320, 1024);
    swiglu_case(DTYPE_Q4_0, 160, 512);
    swiglu_case(DTYPE_Q4_K, 512, 768);
    swiglu_case(DTYPE_Q5_K, 256, 256);
    swiglu_case(DTYPE_Q6_K, 256, 512);
    /* Row counts that leave the last block of rows part-full: no down
     * matmul for these. */
    swiglu_case(DTYPE_Q8_0, 301, 1024);
    swiglu_case(DTYPE_Q4_K, 299, 768);
    setenv("LLM_CUDA_WIDE_ITEMS", "0", 1); /* gate and up in one matmul_wide.cu launch */
    swiglu_case(DTYPE_Q8_0, 320, 1024);
    swiglu_case(DTYPE_Q4_K, 299, 768);
    unsetenv("LLM_CUDA_WIDE_ITEMS");
}

/* matmul_wide.cu (17-64 tokens on quantized weights, sm_80 and later)
 * three ways: the default routing (it where a matmul has 4 items per SM,
 * else mq), off (LLM_CUDA_WIDE=0: mq) and given every shape
 * (LLM_CUDA_WIDE_ITEMS=0).  Shapes whose chunks the
 * grid's consecutive ranges split in every way: one row block over two
 * blocks (100 x 512), 17 row blocks of 16 chunks over ~2 blocks each
 * (4200 x 4096), a partial last chunk of 32-element blocks (1184 = 4 x 256
 * + 160), lm_head-like rows; and the same call twice gives the same bits
 * (partial sums added in block order, not arrival order). */
static void wide_case(enum dtype t, int64_t rows, int64_t cols) {
    static const int32_t ns[] = {16, 17, 32, 33, 48, 64};
    fx_open(); /* a fixture per case: the host buffers of a case add up */
    int wi = load_weight(t, rand_weight(t, rows, cols), rows, cols);
    struct dbuf x = dbuf_from(rand_f32((size_t)64 * cols, -1, 1), (size_t)64 * cols * 4);
    struct dbuf out = dbuf_new((size_t)64 * rows * 4);
    for (size_t i = 0; i < sizeof ns / sizeof ns[0]; i++) {
        const int32_t n = ns[i];
        const size_t elems = (size_t)n * rows;
        dbuf_poison(out);
        ASSERT_OK(backend_matmul(fx.cpu, out.c, &fx.cw[wi], x.c, n));
        int rc = backend_matmul(fx.gpu, out.g, &fx.gw[wi], x.g, n);
        if (rc != STATUS_OK) TEST_FAIL("gpu matmul %s n=%d: %s", dtype_name(t), n, backend_errstr(fx.gpu));
        char what[160];
        snprintf(what, sizeof what, "matmul %s [%lld x %lld] n=%d, LLM_CUDA_WIDE=%s LLM_CUDA_WIDE_ITEMS=%s",
                 dtype_name(t), (long long)rows, (long long)cols, n, getenv("LLM_CUDA_WIDE") ? "0" : "(unset)",
                 getenv("LLM_CUDA_WIDE_ITEMS") ? "0" : "(unset)");
        check_f32(out, elems, matmul_bound(t), what);
        float *first = fx_host(elems * 4), *again = fx_host(elems * 4);
        ASSERT_OK(backend_download(fx.gpu, first, out.g, elems * 4));
        ASSERT_OK(backend_matmul(fx.gpu, out.g, &fx.gw[wi], x.g, n));
        ASSERT_OK(backend_download(fx.gpu, again, out.g, elems * 4));
        if (memcmp(first, again, elems * 4) != 0) TEST_FAIL("%s: a second run gave other bits", what);
    }
    fx_close();
}

TEST(cuda_ops_matmul_wide) {
    mm_set_mode(MM_DEFAULT);
    setenv("LLM_CUDA_MMQ_MIN", "0", 1); /* the K-quants too: matmul_mmq.cu takes them by default */
    for (int m = 0; m < 3; m++) {
        if (m == 1) setenv("LLM_CUDA_WIDE", "0", 1);
        else unsetenv("LLM_CUDA_WIDE");
        if (m == 2) setenv("LLM_CUDA_WIDE_ITEMS", "0", 1); /* every shape, however few its items */
        else unsetenv("LLM_CUDA_WIDE_ITEMS");
        wide_case(DTYPE_Q4_K, 4200, 4096);
        wide_case(DTYPE_Q8_0, 100, 512);
        wide_case(DTYPE_Q8_0, 1000, 1184);
        wide_case(DTYPE_Q6_K, 517, 11008);
        wide_case(DTYPE_Q5_K, 300, 2048);
        wide_case(DTYPE_Q4_0, 259, 4096);
    }
    unsetenv("LLM_CUDA_WIDE");
    unsetenv("LLM_CUDA_WIDE_ITEMS");
    unsetenv("LLM_CUDA_MMQ_MIN");
}

/* matmul_mmq.cu (K-quants on int8 tensor cores) given every token count
 * from 1 (LLM_CUDA_MMQ_MIN=1): odd counts inside and at the edges of its
 * tiles of 8 tokens and of the two blocks a row block above 32; one chunk
 * (no split), K split over blocks with partial rows (4200 x 4096, 517 x
 * 11008), a partial last row block; groups of weights in one launch; the
 * same bits on a second run (wide_case); gate and up (swiglu_case) as its
 * plain group and the swiglu after it. */
TEST(cuda_ops_matmul_mmq) {
    mm_set_mode(MM_DEFAULT);
    setenv("LLM_CUDA_MMQ_MIN", "1", 1);
    static const int32_t ns[] = {1, 2, 3, 7, 8, 9, 15, 24, 31, 33, 40, 47, 57, 63, 64};
    const int n_ns = (int)(sizeof ns / sizeof ns[0]);
    const enum dtype kq[3] = {DTYPE_Q4_K, DTYPE_Q5_K, DTYPE_Q6_K};
    static const int64_t shapes[3][2] = {{100, 512}, {35, 768}, {300, 256}};
    for (int k = 0; k < 3; k++)
        for (int sh = 0; sh < 3; sh++) {
            fx_open(); /* a fixture per case: the host buffers of its token counts add up */
            matmul_case(kq[k], shapes[sh][0], shapes[sh][1], ns, n_ns);
            fx_close();
        }
    wide_case(DTYPE_Q4_K, 4200, 4096);
    wide_case(DTYPE_Q6_K, 517, 11008);
    wide_case(DTYPE_Q5_K, 300, 2048);
    const int64_t qkv[3] = {301, 99, 99};
    const enum dtype q4k[3] = {DTYPE_Q4_K, DTYPE_Q4_K, DTYPE_Q4_K}, q6k[3] = {DTYPE_Q6_K, DTYPE_Q6_K, DTYPE_Q6_K};
    const enum dtype mixed[3] = {DTYPE_Q4_K, DTYPE_Q4_K, DTYPE_Q6_K};
    multi_case(q4k, qkv, 3, 768);
    multi_case(q6k, qkv, 3, 512);
    multi_case(mixed, qkv, 3, 1024);
    swiglu_case(DTYPE_Q4_K, 299, 768);
    swiglu_case(DTYPE_Q6_K, 256, 512);
    unsetenv("LLM_CUDA_MMQ_MIN");
}

/* ---- KV cache and attention ---- */

/* Floats as an 8-bit cache's rows (kernels/backend.h): groups of g values,
 * each an F16 scale amax / 127 and g int8 rounded to nearest. */
static void *q8_rows(const float *f, size_t rows, int32_t hd) {
    int32_t g = backend_kv_q8_group(hd);
    size_t rb = backend_kv_row_bytes(DTYPE_Q8_0, hd);
    unsigned char *out = fx_host(rows * rb);
    for (size_t r = 0; r < rows; r++)
        for (int32_t i = 0; i < hd / g; i++) {
            const float *x = f + r * hd + (size_t)i * g;
            unsigned char *grp = out + r * rb + (size_t)i * (g + 2);
            float amax = 0;
            for (int j = 0; j < g; j++) amax = fmaxf(amax, fabsf(x[j]));
            uint16_t dh = f32_to_fp16(amax / 127.0f);
            float d = fp16_to_f32(dh), id = d > 0 ? 1.0f / d : 0.0f;
            memcpy(grp, &dh, 2);
            for (int j = 0; j < g; j++) grp[2 + j] = (unsigned char)(int8_t)lrintf(x[j] * id);
        }
    return out;
}

static void kv_pair(enum dtype t, int32_t n_blocks, int32_t bs, int32_t n_kv, int32_t hd) {
    if (fx.n_kv == 4) TEST_FAIL("fixture: more than 4 KV caches");
    int i = fx.n_kv++;
    ASSERT_OK(backend_kv_init(fx.cpu, &fx.ckv[i], t, n_blocks, bs, n_kv, hd));
    ASSERT_OK(backend_kv_init(fx.gpu, &fx.gkv[i], t, n_blocks, bs, n_kv, hd));
    /* The same random contents in both (every slot a valid number). */
    size_t elems = (size_t)n_blocks * bs * n_kv * hd, es = t == DTYPE_F32 ? 4 : 2;
    for (int kv = 0; kv < 2; kv++) {
        float *f = rand_f32(elems, -1, 1);
        void *buf = f;
        size_t bytes = elems * es;
        if (t == DTYPE_F16) {
            uint16_t *h = fx_host(elems * 2);
            for (size_t e = 0; e < elems; e++) h[e] = f32_to_fp16(f[e]);
            buf = h;
        } else if (t == DTYPE_Q8_0) {
            buf = q8_rows(f, elems / hd, hd);
            bytes = elems / hd * backend_kv_row_bytes(t, hd);
        }
        ASSERT_OK(backend_upload(fx.cpu, kv ? fx.ckv[i].v : fx.ckv[i].k, buf, bytes));
        ASSERT_OK(backend_upload(fx.gpu, kv ? fx.gkv[i].v : fx.gkv[i].k, buf, bytes));
    }
}

/* k and v start `skew` floats into their buffers: 1 takes the 8-bit
 * write's form for inputs that are not 16-byte aligned. */
static void kv_write_case(enum dtype t, int32_t hd, int skew) {
    fx_open();
    int32_t nb = 12, bs = 16, n_kv = 2, n = 10;
    kv_pair(t, nb, bs, n_kv, hd);
    size_t width = (size_t)n_kv * hd, elems = n * width + (size_t)skew;
    struct dbuf k = dbuf_from(rand_f32(elems, -4, 4), elems * 4);
    struct dbuf v = dbuf_from(rand_f32(elems, -4, 4), elems * 4);
    int32_t slots[10];
    distinct_slots(slots, n, nb * bs);
    struct dbuf ds = dbuf_from(slots, sizeof slots);
    ASSERT_OK(backend_kv_write(fx.cpu, &fx.ckv[0], (float *)k.c + skew, (float *)v.c + skew, ds.c, n));
    ASSERT_OK(backend_kv_write(fx.gpu, &fx.gkv[0], (float *)k.g + skew, (float *)v.g + skew, ds.g, n));
    ASSERT_OK(backend_sync(fx.cpu));
    size_t bytes = (size_t)nb * bs * n_kv * backend_kv_row_bytes(t, hd);
    struct dbuf ck = {fx.ckv[0].k, fx.gkv[0].k, bytes}, cv = {fx.ckv[0].v, fx.gkv[0].v, bytes};
    /* Written slots equal (F16: both round to nearest even; Q8_0: both
     * divide amax by 127 in IEEE single, round the scale to F16 and the
     * values to nearest even), the others untouched. */
    check_bytes(ck, "kv_write K cache");
    check_bytes(cv, "kv_write V cache");
    fx_close();
}

TEST(cuda_ops_kv_write_f32) { kv_write_case(DTYPE_F32, 64, 0); }
TEST(cuda_ops_kv_write_f16) { kv_write_case(DTYPE_F16, 64, 0); }
/* Every group width of the 8-bit rows (backend_kv_q8_group): the whole
 * row (8), 32 (64 and 96), 64 (128 and 256); groups of 32 and 64 also
 * from unaligned inputs (kv_write.cu's thread-per-group form). */
TEST(cuda_ops_kv_write_q8_0) {
    static const int32_t hds[] = {8, 64, 96, 128, 256};
    for (size_t i = 0; i < sizeof hds / sizeof hds[0]; i++) kv_write_case(DTYPE_Q8_0, hds[i], 0);
    kv_write_case(DTYPE_Q8_0, 64, 1);
    kv_write_case(DTYPE_Q8_0, 128, 1);
}

/* Both caches as floats (F16 widened), for an NMSE check. */
static void check_cache(enum dtype t, void *cbuf, void *gbuf, size_t elems, double bound, const char *what) {
    if (t == DTYPE_Q8_0) {
        /* 8-bit rows, dequantized; the cache is the last one kv_pair made. */
        int32_t hd = fx.ckv[fx.n_kv - 1].head_dim, g = backend_kv_q8_group(hd);
        size_t rows = elems / hd, rb = backend_kv_row_bytes(t, hd);
        unsigned char *c = fx_host(rows * rb), *gq = fx_host(rows * rb);
        ASSERT_OK(backend_download(fx.cpu, c, cbuf, rows * rb));
        ASSERT_OK(backend_download(fx.gpu, gq, gbuf, rows * rb));
        float *cf = fx_host(elems * 4), *gf = fx_host(elems * 4);
        for (size_t r = 0; r < rows; r++)
            for (int32_t d = 0; d < hd; d++) {
                size_t at = r * rb + (size_t)(d / g) * (g + 2);
                uint16_t hc, hg;
                memcpy(&hc, c + at, 2);
                memcpy(&hg, gq + at, 2);
                cf[r * hd + d] = fp16_to_f32(hc) * (float)(int8_t)c[at + 2 + d % g];
                gf[r * hd + d] = fp16_to_f32(hg) * (float)(int8_t)gq[at + 2 + d % g];
            }
        size_t w = 0;
        double e = nmse(cf, gf, elems, &w);
        if (!(e <= bound))
            TEST_FAIL("%s: NMSE %.3g > %.3g (element %zu: cpu %.9g, gpu %.9g)", what, e, bound, w, cf[w], gf[w]);
        return;
    }
    size_t es = t == DTYPE_F32 ? 4 : 2;
    unsigned char *c = fx_host(elems * es), *g = fx_host(elems * es);
    ASSERT_OK(backend_download(fx.cpu, c, cbuf, elems * es));
    ASSERT_OK(backend_download(fx.gpu, g, gbuf, elems * es));
    float *cf = fx_host(elems * 4), *gf = fx_host(elems * 4);
    for (size_t i = 0; i < elems; i++) {
        if (t == DTYPE_F32) {
            memcpy(&cf[i], c + 4 * i, 4);
            memcpy(&gf[i], g + 4 * i, 4);
        } else {
            uint16_t hc, hg;
            memcpy(&hc, c + 2 * i, 2);
            memcpy(&hg, g + 2 * i, 2);
            cf[i] = fp16_to_f32(hc);
            gf[i] = fp16_to_f32(hg);
        }
    }
    size_t w = 0;
    double e = nmse(cf, gf, elems, &w);
    if (!(e <= bound)) TEST_FAIL("%s: NMSE %.3g > %.3g (element %zu: cpu %.9g, gpu %.9g)", what, e, bound, w, cf[w], gf[w]);
}

/* rope of q and k and the cache write in one launch, against rope, rope
 * and kv_write on the CPU: GQA (8 heads over 2), both pairings, a partial
 * rotation, slots in no order and positions up to 2e5. */
static void rope_kv_case(enum dtype t, int neox, int32_t n_freq, int32_t hd) {
    fx_open();
    int32_t nb = 12, bs = 16, n_kv = 2, n_heads = 8, n = 9;
    kv_pair(t, nb, bs, n_kv, hd);
    size_t qe = (size_t)n * n_heads * hd, ke = (size_t)n * n_kv * hd;
    struct dbuf q = dbuf_from(rand_f32(qe, -2, 2), qe * 4);
    struct dbuf k = dbuf_from(rand_f32(ke, -2, 2), ke * 4);
    struct dbuf v = dbuf_from(rand_f32(ke, -2, 2), ke * 4);
    int32_t pos[9], slots[9];
    for (int i = 0; i < n; i++) pos[i] = i < 4 ? i : rng_int(200000);
    distinct_slots(slots, n, nb * bs);
    struct dbuf dp = dbuf_from(pos, sizeof pos), ds = dbuf_from(slots, sizeof slots);
    float *inv = fx_host((size_t)n_freq * 4);
    for (int i = 0; i < n_freq; i++) inv[i] = powf(10000.0f, -2.0f * i / (float)hd);
    struct dbuf di = dbuf_from(inv, (size_t)n_freq * 4);
    int i = fx.n_kv - 1;
    ASSERT_OK(backend_rope_kv_write(fx.cpu, q.c, k.c, v.c, &fx.ckv[i], dp.c, ds.c, n, n_heads, di.c, n_freq, neox));
    int rc = backend_rope_kv_write(fx.gpu, q.g, k.g, v.g, &fx.gkv[i], dp.g, ds.g, n, n_heads, di.g, n_freq, neox);
    if (rc != STATUS_OK) TEST_FAIL("gpu rope_kv_write: %s", backend_errstr(fx.gpu));
    ASSERT_OK(backend_sync(fx.cpu));
    char what[96];
    snprintf(what, sizeof what, "rope_kv_write %s head_dim %d neox=%d n_freq=%d", dtype_name(t), hd, neox, n_freq);
    /* As rope: both form the angle in double; sin/cos of two libraries. */
    check_f32(q, qe, 1e-12, what);
    check_f32(k, ke, 1e-12, what);
    /* The caches: every slot (written or not); F16 may round one last bit
     * differently where the rotated values differ in their last bits. */
    size_t elems = (size_t)nb * bs * n_kv * hd;
    /* Q8_0: a rotated value a last bit apart may round to the next int8
     * (1/254 of its group's largest) or move the scale: a few such
     * elements among the cache's 24576 (49152 at head_dim 128) stay far
     * below 1e-6. */
    double bound = t == DTYPE_F32 ? 1e-12 : t == DTYPE_Q8_0 ? 1e-6 : 1e-7;
    check_cache(t, fx.ckv[i].k, fx.gkv[i].k, elems, bound, what);
    check_cache(t, fx.ckv[i].v, fx.gkv[i].v, elems, bound, what);
    fx_close();
}

TEST(cuda_ops_rope_kv_write) {
    rope_kv_case(DTYPE_F16, 0, 32, 64);
    rope_kv_case(DTYPE_F16, 1, 32, 64);
    rope_kv_case(DTYPE_F32, 1, 12, 64);
    rope_kv_case(DTYPE_F32, 0, 32, 64);
    /* 8-bit rows in groups of 32 (heads of 64) and of 64 (heads of 128). */
    rope_kv_case(DTYPE_Q8_0, 1, 32, 64);
    rope_kv_case(DTYPE_Q8_0, 0, 12, 64);
    rope_kv_case(DTYPE_Q8_0, 1, 64, 128);
    rope_kv_case(DTYPE_Q8_0, 0, 20, 128);
}

/* Whether the GPU takes this batch on the tensor-core kernel of
 * attention_prefill.cu (its rule, cuda_attention_prefill_takes): some
 * sequence with more than one row, F16 cache, heads of 64 or 128, groups a
 * power of two up to 64, and LLM_CUDA_PREFILL_TC not "0". */
static int attn_on_tensor_cores(enum dtype t, int32_t n_heads, int32_t n_kv, int32_t hd, int32_t bs,
                                int32_t n_tokens, int n_seqs) {
    const char *env = getenv("LLM_CUDA_PREFILL_TC"), *dg = getenv("LLM_CUDA_DECODE_TC_G");
    int32_t G = n_heads / n_kv;
    int fits = (t == DTYPE_F16 || t == DTYPE_Q8_0) && (hd == 64 || hd == 128) && G <= 64 && (G & (G - 1)) == 0;
    const int min_g = dg ? atoi(dg) : 8; /* the backend's default: groups of 8 and more */
    /* Decode rows of 2-16 query heads a KV head on an F16 cache, or on
     * an 8-bit one in blocks of a multiple of 16 positions: attention_gqa.cu
     * (LLM_CUDA_ATT_GQA_MIN, 2 by default). */
    const char *gq = getenv("LLM_CUDA_ATT_GQA_MIN");
    const int gqa_min = gq ? atoi(gq) : 2;
    const int gqa = (t == DTYPE_F16 || (t == DTYPE_Q8_0 && bs % 16 == 0)) && (hd == 64 || hd == 128) && G >= 2 &&
                    G <= 16 && gqa_min > 0 && G >= gqa_min;
    /* Other decode-only batches over an 8-bit cache stay on attention_q8.cu. */
    if (n_tokens == n_seqs) return gqa || (t == DTYPE_F16 && fits && min_g > 0 && G >= min_g);
    return gqa || (fits && !(env && strcmp(env, "0") == 0));
}

/* The matmul after an attention (o) reads the form of its input that the
 * attention kernels left: the int8 form of the gemv matmul at 1-4 decode
 * rows (rope_attention.cu's merge kernel), the F16 form from 3 rows
 * (attention.cu and attention_prefill.cu, for cuBLAS, matmul_wide and
 * mq).  A Q8_0, a Q4_K and an F16 weight (ATT_MM_ROWS rows) on the
 * attention's output must match the CPU's matmuls.  The weights and
 * outputs are made before the attention (an upload forgets a kept form)
 * and freed after the check. */
#define ATT_MM_ROWS 64
struct att_mm {
    int n, wi[3];
    struct dbuf o[3];
};

static void att_mm_prepare(struct att_mm *m, int32_t n, int32_t qw) {
    static const enum dtype types[3] = {DTYPE_Q8_0, DTYPE_F16, DTYPE_Q4_K};
    m->n = qw % 256 == 0 ? 3 : 2;
    for (int j = 0; j < m->n; j++) {
        m->wi[j] = load_weight(types[j], rand_weight(types[j], ATT_MM_ROWS, qw), ATT_MM_ROWS, qw);
        m->o[j] = dbuf_new((size_t)n * ATT_MM_ROWS * 4);
        dbuf_poison(m->o[j]);
    }
}

static void att_mm_check(const struct att_mm *m, struct dbuf att, int32_t n, const char *what) {
    for (int j = 0; j < m->n; j++) {
        ASSERT_OK(backend_matmul(fx.cpu, m->o[j].c, &fx.cw[m->wi[j]], att.c, n));
        if (backend_matmul(fx.gpu, m->o[j].g, &fx.gw[m->wi[j]], att.g, n) != STATUS_OK)
            TEST_FAIL("%s: gpu matmul after it: %s", what, backend_errstr(fx.gpu));
    }
    for (int j = 0; j < m->n; j++) {
        char mw[200];
        snprintf(mw, sizeof mw, "%s matmul on the output of %s", dtype_name(fx.cw[m->wi[j]].type), what);
        printf("    %s: NMSE %.3g\n", mw, check_f32(m->o[j], (size_t)n * ATT_MM_ROWS, matmul_bound(fx.cw[m->wi[j]].type), mw));
    }
    free_weights();
}

/* Sequences given as (tokens this step, position of the first); block
 * tables are a random permutation of the cache's blocks. */
static void attention_case(enum dtype t, int32_t n_heads, int32_t n_kv, int32_t hd, int32_t bs, int n_seqs,
                           const int32_t *lens, const int32_t *pos0s) {
    int32_t n_tokens = 0, max_ctx = 0, max_blocks = 0, total_blocks = 0;
    for (int s = 0; s < n_seqs; s++) {
        int32_t ctx = pos0s[s] + lens[s], nbk = (ctx + bs - 1) / bs;
        n_tokens += lens[s];
        max_ctx = ctx > max_ctx ? ctx : max_ctx;
        max_blocks = nbk > max_blocks ? nbk : max_blocks;
        total_blocks += nbk;
    }
    int32_t n_blocks = total_blocks + 3;
    kv_pair(t, n_blocks, bs, n_kv, hd);
    int32_t *perm = fx_host((size_t)n_blocks * 4);
    for (int i = 0; i < n_blocks; i++) perm[i] = i;
    for (int i = n_blocks - 1; i > 0; i--) {
        int j = rng_int(i + 1), tmp = perm[i];
        perm[i] = perm[j];
        perm[j] = tmp;
    }
    int32_t *tables = fx_host((size_t)n_seqs * max_blocks * 4), *tok0 = fx_host((size_t)(n_seqs + 1) * 4);
    int32_t used = 0;
    tok0[0] = 0;
    for (int s = 0; s < n_seqs; s++) {
        int32_t nbk = (pos0s[s] + lens[s] + bs - 1) / bs;
        for (int b = 0; b < max_blocks; b++) tables[s * max_blocks + b] = b < nbk ? perm[used++] : perm[n_blocks - 1];
        tok0[s + 1] = tok0[s] + lens[s];
    }
    struct dbuf dt = dbuf_from(tables, (size_t)n_seqs * max_blocks * 4);
    struct dbuf d0 = dbuf_from(tok0, (size_t)(n_seqs + 1) * 4);
    struct dbuf dp = dbuf_from(pos0s, (size_t)n_seqs * 4);
    size_t elems = (size_t)n_tokens * n_heads * hd;
    struct dbuf q = dbuf_from(rand_f32(elems, -2, 2), elems * 4);
    struct dbuf out = dbuf_new(elems * 4);
    dbuf_poison(out);
    struct att_mm mm = {0};
    if (n_tokens > 2) att_mm_prepare(&mm, n_tokens, n_heads * hd);
    struct backend_attn_batch cb = {n_seqs, n_tokens, max_blocks, max_ctx, d0.c, dp.c, dt.c};
    struct backend_attn_batch gb = {n_seqs, n_tokens, max_blocks, max_ctx, d0.g, dp.g, dt.g};
    float scale = 1.0f / sqrtf((float)hd);
    ASSERT_OK(backend_attention(fx.cpu, out.c, q.c, &fx.ckv[fx.n_kv - 1], &cb, n_heads, scale));
    int rc = backend_attention(fx.gpu, out.g, q.g, &fx.gkv[fx.n_kv - 1], &gb, n_heads, scale);
    if (rc != STATUS_OK) TEST_FAIL("gpu attention: %s", backend_errstr(fx.gpu));
    char what[128];
    snprintf(what, sizeof what, "attention %s cache, %d heads / %d KV heads x %d, %d seqs, %d rows, ctx %d",
             dtype_name(t), n_heads, n_kv, hd, n_seqs, n_tokens, max_ctx);
    if (mm.n) att_mm_check(&mm, out, n_tokens, what);
    if (!attn_on_tensor_cores(t, n_heads, n_kv, hd, bs, n_tokens, n_seqs)) {
        /* F32 arithmetic on the same cache values; softmax exp differs by ulps. */
        check_f32(out, elems, 1e-9, what);
        return;
    }
    /* Tensor cores: Q (scaled) and the probabilities are rounded to F16
     * (relative error <= 2^-11 each, F32 accumulation), so each output is
     * off by ~3e-4 of its size: NMSE ~1e-7.  1e-4 leaves a factor of ~100
     * and still fails a position masked wrongly (one position more or less
     * moves a row by ~1/sqrt(context) of its size, NMSE >= 1e-3 on these
     * contexts) or a wrong block, head or row (NMSE ~1). */
    double e = check_f32(out, elems, 1e-4, what);
    printf("    %s (tensor cores): NMSE %.3g\n", what, e);
}

/* Prefill chunks and decode rows together, at different positions. */
static const int32_t mix_lens[] = {7, 1, 20, 1, 1, 33};
static const int32_t mix_pos[] = {0, 37, 50, 300, 0, 64};

TEST(cuda_ops_attention_gqa_f32) {
    fx_open();
    attention_case(DTYPE_F32, 8, 2, 64, 16, 6, mix_lens, mix_pos);
    fx_close();
}

TEST(cuda_ops_attention_gqa_f16) {
    fx_open();
    attention_case(DTYPE_F16, 8, 2, 64, 16, 6, mix_lens, mix_pos);
    fx_close();
}

/* The 8-bit cache: batches with prefill rows and heads of 64 or 128 run
 * the tensor-core kernel (attention_prefill.cu, the tensor cores' bound);
 * the 8-wide heads attention.cu's general kernel, which dequantizes the
 * tiles as it loads them; the decode-only batches here attention_q8.cu.
 * Where the GPU computes in F32 both backends read the same cache bytes
 * (the CPU scales a group's integer dot product once, the GPU each
 * element), so the outputs differ only by float rounding: the F32 bound
 * of 1e-9 holds.  Prefill chunks and decode rows of GQA, MHA heads of
 * 128 at long contexts (split), groups of 8, and every group width of the
 * rows (backend_kv_q8_group): 64 values a scale for heads of 128 and 256
 * (256: attention_q8.cu's four groups a row, and the general kernel for
 * the prefill rows), 32 for heads of 64 and 96 (96: the general kernel
 * only), one scale per row for 8-wide heads. */
TEST(cuda_ops_attention_q8_0) {
    fx_open();
    attention_case(DTYPE_Q8_0, 8, 2, 64, 16, 6, mix_lens, mix_pos);
    static const int32_t l1[] = {1, 1, 40}, p1[] = {1000, 17, 500};
    attention_case(DTYPE_Q8_0, 32, 32, 128, 16, 3, l1, p1);
    static const int32_t l2[] = {1, 1, 1, 1}, p2[] = {2047, 5, 300, 64};
    attention_case(DTYPE_Q8_0, 32, 4, 128, 16, 4, l2, p2);
    static const int32_t l3[] = {12, 1}, p3[] = {0, 100};
    attention_case(DTYPE_Q8_0, 8, 4, 8, 32, 2, l3, p3);
    fx_close(); /* the fixture holds 4 caches */
    fx_open();
    static const int32_t l4[] = {1, 1, 1}, p4[] = {700, 3, 129};
    attention_case(DTYPE_Q8_0, 8, 2, 256, 16, 3, l4, p4);
    static const int32_t l5[] = {9, 1}, p5[] = {0, 90};
    attention_case(DTYPE_Q8_0, 8, 2, 256, 16, 2, l5, p5);
    static const int32_t l6[] = {7, 1}, p6[] = {20, 60};
    attention_case(DTYPE_Q8_0, 4, 2, 96, 16, 2, l6, p6);
    fx_close();
}

TEST(cuda_ops_attention_shapes) {
    fx_open();
    /* Llama-7B heads (MHA, 128), decode at a long context: split-K. */
    static const int32_t l1[] = {1, 1, 40}, p1[] = {1000, 17, 500};
    attention_case(DTYPE_F16, 32, 32, 128, 16, 3, l1, p1);
    /* Wide heads with a large group, small blocks. */
    static const int32_t l2[] = {3, 1}, p2[] = {90, 200};
    attention_case(DTYPE_F32, 16, 2, 256, 8, 2, l2, p2);
    /* Tiny heads (stories260K: 8 heads of 8 over 4 KV heads). */
    static const int32_t l3[] = {12, 1}, p3[] = {0, 100};
    attention_case(DTYPE_F32, 8, 4, 8, 32, 2, l3, p3);
    fx_close();
}

/* Decode-only steps (one row per sequence): the F16 cache takes the
 * decode kernel for heads of 64 / 128 / 256 and groups of 1, 2, 4, 8;
 * split over the context when the rows are few, whole when they are many
 * (40 sequences of MHA); F32 stays on the general kernel. */
TEST(cuda_ops_attention_decode) {
    setenv("LLM_CUDA_ATT_GQA_MIN", "0", 1); /* the decode kernel for groups too (attention_gqa.cu: below) */
    fx_open();
    static const int32_t ones[64] = {1, 1, 1, 1, 1, 1, 1, 1, 1, 1, 1, 1, 1, 1, 1, 1, 1, 1, 1, 1, 1, 1,
                                     1, 1, 1, 1, 1, 1, 1, 1, 1, 1, 1, 1, 1, 1, 1, 1, 1, 1, 1, 1, 1, 1,
                                     1, 1, 1, 1, 1, 1, 1, 1, 1, 1, 1, 1, 1, 1, 1, 1, 1, 1, 1, 1};
    static const int32_t p1[] = {1000, 17, 0, 511};
    attention_case(DTYPE_F16, 32, 32, 128, 16, 4, ones, p1); /* MHA, split */
    static const int32_t p2[] = {0, 5, 100, 300, 1023};
    attention_case(DTYPE_F16, 32, 8, 128, 16, 5, ones, p2); /* groups of 4 */
    static const int32_t p3[] = {63, 64, 200};
    attention_case(DTYPE_F16, 8, 2, 64, 16, 3, ones, p3); /* heads of 64 */
    attention_case(DTYPE_F32, 8, 2, 64, 16, 3, ones, p3); /* general kernel */
    fx_close();
    fx_open();
    static const int32_t p4[] = {90, 200};
    attention_case(DTYPE_F16, 16, 2, 256, 8, 2, ones, p4); /* heads of 256, groups of 8 */
    static const int32_t p5[] = {31, 32, 33, 7};
    attention_case(DTYPE_F16, 16, 8, 128, 32, 4, ones, p5); /* groups of 2, blocks of 32 */
    int32_t p6[40];
    for (int i = 0; i < 40; i++) p6[i] = rng_int(300);
    attention_case(DTYPE_F16, 32, 32, 128, 16, 40, ones, p6); /* many rows: no split */
    static const int32_t p7[] = {4000};
    attention_case(DTYPE_F16, 8, 2, 64, 16, 1, ones, p7); /* one long row: 63 splits, merged 32 at a time */
    fx_close();
    /* Splits of one step of the sub-warps (LLM_CUDA_ATT_STEPS=1): twice
     * as many, up to the most the merge takes. */
    setenv("LLM_CUDA_ATT_STEPS", "1", 1);
    fx_open();
    attention_case(DTYPE_F16, 32, 32, 128, 16, 4, ones, p1);
    attention_case(DTYPE_F16, 8, 2, 64, 16, 1, ones, p7);
    fx_close();
    unsetenv("LLM_CUDA_ATT_STEPS");
    /* The same decode batches on the tensor-core kernel (every group size:
     * LLM_CUDA_DECODE_TC_G=1), and groups of 8 with heads of 64 as
     * TinyLlama has them. */
    setenv("LLM_CUDA_DECODE_TC_G", "1", 1);
    setenv("LLM_CUDA_ATT_K8", "1", 1); /* first with sm_75's mma (m16n8k8) */
    fx_open();
    attention_case(DTYPE_F16, 32, 8, 128, 16, 5, ones, p2);
    attention_case(DTYPE_F16, 32, 4, 64, 16, 40, ones, p6);
    fx_close();
    unsetenv("LLM_CUDA_ATT_K8");
    fx_open();
    attention_case(DTYPE_F16, 32, 32, 128, 16, 4, ones, p1);
    attention_case(DTYPE_F16, 32, 8, 128, 16, 5, ones, p2);
    attention_case(DTYPE_F16, 8, 2, 64, 16, 3, ones, p3);
    fx_close();
    fx_open();
    attention_case(DTYPE_F16, 16, 8, 128, 32, 4, ones, p5);
    attention_case(DTYPE_F16, 32, 4, 64, 16, 40, ones, p6);
    fx_close();
    unsetenv("LLM_CUDA_DECODE_TC_G");
    unsetenv("LLM_CUDA_ATT_GQA_MIN");
}

/* attention_gqa.cu (decode rows of 2-16 query heads a KV head, tensor
 * cores): groups of 2, 4, 8, 12 and 16 with heads of 64 and 128, rows at
 * position 0 and at block edges, splits of one long row merged, many rows,
 * blocks of 16 and 32; a prefill row beside them (a mixed batch: its
 * one-row sequences here, the other on the prefill kernel); and the T4's
 * mma (two m16n8k8) through LLM_CUDA_ATT_K8's routing is the sm_75 build's
 * own (scripts/gpu-check.sh t4). */
TEST(cuda_ops_attention_gqa) {
    unsetenv("LLM_CUDA_ATT_GQA_MIN");
    fx_open(); /* at most 4 KV caches a fixture */
    static const int32_t ones[48] = {1, 1, 1, 1, 1, 1, 1, 1, 1, 1, 1, 1, 1, 1, 1, 1, 1, 1, 1, 1, 1, 1, 1, 1,
                                     1, 1, 1, 1, 1, 1, 1, 1, 1, 1, 1, 1, 1, 1, 1, 1, 1, 1, 1, 1, 1, 1, 1, 1};
    static const int32_t p1[] = {0, 5, 100, 300, 1023};
    attention_case(DTYPE_F16, 32, 8, 128, 16, 5, ones, p1);  /* groups of 4 (Llama 3) */
    attention_case(DTYPE_F16, 32, 16, 128, 16, 5, ones, p1); /* groups of 2 */
    attention_case(DTYPE_F16, 32, 4, 128, 16, 5, ones, p1);  /* groups of 8 */
    fx_close();
    fx_open();
    attention_case(DTYPE_F16, 48, 4, 64, 16, 5, ones, p1);   /* groups of 12 */
    attention_case(DTYPE_F16, 32, 2, 64, 32, 5, ones, p1);   /* groups of 16, blocks of 32 */
    static const int32_t p2[] = {15, 16, 17, 63, 64, 65};
    attention_case(DTYPE_F16, 28, 4, 128, 16, 6, ones, p2); /* groups of 7 */
    static const int32_t p3[] = {4000};
    attention_case(DTYPE_F16, 32, 8, 128, 16, 1, ones, p3); /* one long row: many splits */
    fx_close();
    fx_open();
    int32_t p4[48];
    for (int i = 0; i < 48; i++) p4[i] = rng_int(700);
    attention_case(DTYPE_F16, 32, 8, 128, 16, 48, ones, p4); /* many rows */
    static const int32_t lens[] = {1, 9, 1, 1};
    static const int32_t p5[] = {40, 0, 300, 7};
    attention_case(DTYPE_F16, 32, 8, 128, 16, 4, lens, p5); /* a prefill row among decodes */
    fx_close();
}

/* attention_gqa.cu over an 8-bit cache: groups of 2, 4, 8, 12 and 16,
 * heads of 128 (two groups of 64 a row) and 64 (two of 32), blocks of 16
 * and 32, rows at block edges, one long row split, many rows, a prefill
 * row among decodes; blocks of 8 positions stay on attention_q8.cu (the
 * F32 bound: its arithmetic is the CPU's). */
TEST(cuda_ops_attention_gqa_q8_0) {
    unsetenv("LLM_CUDA_ATT_GQA_MIN");
    static const int32_t ones[48] = {1, 1, 1, 1, 1, 1, 1, 1, 1, 1, 1, 1, 1, 1, 1, 1, 1, 1, 1, 1, 1, 1, 1, 1,
                                     1, 1, 1, 1, 1, 1, 1, 1, 1, 1, 1, 1, 1, 1, 1, 1, 1, 1, 1, 1, 1, 1, 1, 1};
    static const int32_t p1[] = {0, 5, 100, 300, 1023};
    fx_open();
    attention_case(DTYPE_Q8_0, 32, 8, 128, 16, 5, ones, p1);  /* groups of 4 (Llama 3) */
    attention_case(DTYPE_Q8_0, 32, 16, 128, 32, 5, ones, p1); /* groups of 2, blocks of 32 */
    attention_case(DTYPE_Q8_0, 32, 4, 64, 16, 5, ones, p1);   /* groups of 8, heads of 64 */
    attention_case(DTYPE_Q8_0, 32, 8, 128, 8, 5, ones, p1);   /* blocks of 8: attention_q8.cu */
    fx_close();
    fx_open();
    attention_case(DTYPE_Q8_0, 48, 4, 128, 16, 5, ones, p1); /* groups of 12 */
    static const int32_t p2[] = {15, 16, 17, 63, 64, 65};
    attention_case(DTYPE_Q8_0, 32, 2, 64, 16, 6, ones, p2); /* groups of 16 */
    static const int32_t p3[] = {4000};
    attention_case(DTYPE_Q8_0, 32, 8, 128, 16, 1, ones, p3); /* one long row: many splits */
    fx_close();
    fx_open();
    int32_t p4[48];
    for (int i = 0; i < 48; i++) p4[i] = rng_int(700);
    attention_case(DTYPE_Q8_0, 32, 8, 128, 16, 48, ones, p4); /* many rows */
    static const int32_t lens[] = {1, 9, 1, 1};
    static const int32_t p5[] = {40, 0, 300, 7};
    attention_case(DTYPE_Q8_0, 32, 8, 128, 16, 4, lens, p5); /* a prefill row among decodes */
    fx_close();
}

/* Batches with prefill rows: the tensor-core kernel (F16 cache, heads of
 * 64 and 128) and, with LLM_CUDA_PREFILL_TC=0, the general kernel on the
 * same shapes.  Chunks whose lengths are not multiples of 16 start at
 * different positions, decode rows among them, groups of 1, 4, 8 and 32,
 * blocks of 8, 16 and 32 in shuffled tables; the first two batches split
 * the context over blocks (few rows, long context), the 300-row prompt
 * and the 360-row batch do not (>= 132 busy blocks). */
static void attention_prefill_cases(void) {
    fx_open();
    static const int32_t l1[] = {37, 1, 70, 5, 129}, p1[] = {0, 90, 33, 200, 17};
    attention_case(DTYPE_F16, 8, 2, 64, 16, 5, l1, p1);
    static const int32_t l2[] = {45, 200}, p2[] = {1000, 0};
    attention_case(DTYPE_F16, 32, 32, 128, 16, 2, l2, p2);
    static const int32_t l3[] = {100, 3, 257}, p3[] = {7, 500, 64};
    attention_case(DTYPE_F16, 32, 8, 128, 32, 3, l3, p3);
    static const int32_t l4[] = {19, 2}, p4[] = {0, 150};
    attention_case(DTYPE_F16, 16, 2, 64, 8, 2, l4, p4);
    fx_close();
    fx_open();
    static const int32_t l5[] = {300}, p5[] = {0};
    attention_case(DTYPE_F16, 32, 32, 128, 16, 1, l5, p5);
    static const int32_t l6[] = {31, 17}, p6[] = {5, 0};
    attention_case(DTYPE_F16, 4, 4, 64, 16, 2, l6, p6);
    static const int32_t l7[] = {9}, p7[] = {40};
    attention_case(DTYPE_F16, 32, 1, 64, 16, 1, l7, p7);
    fx_close();
}

/* A step of many decodes beside two prefills: the one-row sequences go to
 * the decode kernels (attention.cu, attention_q8.cu) and the others to the
 * tensor-core kernel, two launches over one batch that must each leave the
 * other's rows and F16 output alone (the o matmuls read it). */
TEST(cuda_ops_attention_mixed) {
    fx_open();
    int32_t lens[62], pos[62];
    for (int s = 0; s < 60; s++) {
        lens[s] = 1;
        pos[s] = 99 + (int32_t)((int64_t)s * 1901 / 59); /* contexts 100-2000 */
    }
    lens[60] = 4, pos[60] = 700;
    lens[61] = 64, pos[61] = 1500;
    /* The prefills last, then first and in the middle: the layout the
     * kernels skip by must not matter. */
    for (int o = 0; o < 2; o++) {
        int32_t l[62], p[62];
        memcpy(l, lens, sizeof l);
        memcpy(p, pos, sizeof p);
        if (o == 1) { /* the 4-row sequence first, the 64-row one in the middle */
            int32_t t = l[0]; l[0] = l[60]; l[60] = t;
            t = p[0]; p[0] = p[60]; p[60] = t;
            t = l[30]; l[30] = l[61]; l[61] = t;
            t = p[30]; p[30] = p[61]; p[61] = t;
        }
        attention_case(DTYPE_F16, 8, 8, 128, 16, 62, l, p);
        attention_case(DTYPE_F16, 8, 2, 128, 16, 62, l, p);
        attention_case(DTYPE_Q8_0, 8, 8, 128, 16, 62, l, p);
        attention_case(DTYPE_Q8_0, 8, 2, 128, 16, 62, l, p);
        fx_close();
        fx_open();
    }
    fx_close();
}

TEST(cuda_ops_attention_prefill) {
    unsetenv("LLM_CUDA_PREFILL_TC");
    attention_prefill_cases();
    /* The tensor-core kernel with sm_75's mma (m16n8k8), which sm_80 and
     * later cards replace with m16n8k16; and the general kernel. */
    setenv("LLM_CUDA_ATT_K8", "1", 1);
    attention_prefill_cases();
    unsetenv("LLM_CUDA_ATT_K8");
    setenv("LLM_CUDA_PREFILL_TC", "0", 1);
    attention_prefill_cases();
    unsetenv("LLM_CUDA_PREFILL_TC");
}

/* ---- Rope, cache write and attention of decode rows in one op ----
 * The CPU runs rope_kv_write and attention; the GPU, for decode rows (one
 * a sequence) and an F16 cache with heads of 64 or 128, one launch
 * (rope_attention.cu, up to LLM_CUDA_ROPE_ATT rows: 16 here) that rotates
 * q and k in registers and leaves the buffers as given: so its q must come
 * back unchanged where it takes the case (a silent fallback would rotate
 * it), and rotated like the CPU's where it does not. */
struct ropeatt_case {
    enum dtype kv;
    int32_t n_heads, n_kv, hd, pos, n_freq;
    int neox, n_seqs, rows_per_seq;
};

static void rope_attention_case(const struct ropeatt_case *c) {
    fx_open();
    const int32_t bs = 16, hd = c->hd, S = c->n_seqs, R = c->rows_per_seq, n = S * R;
    const int32_t qw = c->n_heads * hd, kw = c->n_kv * hd;
    const int fused = R == 1 && S <= 16 && c->kv == DTYPE_F16;
    struct att_mm mm = {0};
    if (fused && n <= 4) att_mm_prepare(&mm, n, qw);
    /* Sequence s: rows at positions pos + 37 s .. + R - 1, its own blocks
     * taken in a random order from one cache. */
    const int32_t max_ctx = c->pos + 37 * (S - 1) + R, max_blocks = (max_ctx + bs - 1) / bs;
    const int32_t n_blocks = S * max_blocks + 3;
    kv_pair(c->kv, n_blocks, bs, c->n_kv, hd);
    int32_t *perm = fx_host((size_t)n_blocks * 4), *tables = fx_host((size_t)S * max_blocks * 4);
    for (int i = 0; i < n_blocks; i++) perm[i] = i;
    for (int i = n_blocks - 1; i > 0; i--) {
        int j = rng_int(i + 1), tmp = perm[i];
        perm[i] = perm[j];
        perm[j] = tmp;
    }
    for (int i = 0; i < S * max_blocks; i++) tables[i] = perm[i];
    int32_t *pos = fx_host((size_t)n * 4), *slots = fx_host((size_t)n * 4), *tok0 = fx_host((size_t)(S + 1) * 4);
    int32_t *pos0 = fx_host((size_t)S * 4);
    for (int s = 0; s < S; s++) {
        tok0[s] = s * R;
        pos0[s] = c->pos + 37 * s;
        for (int r = 0; r < R; r++) {
            const int32_t p = pos0[s] + r;
            pos[s * R + r] = p;
            slots[s * R + r] = tables[s * max_blocks + p / bs] * bs + p % bs;
        }
    }
    tok0[S] = n;
    struct dbuf dt = dbuf_from(tables, (size_t)S * max_blocks * 4), d0 = dbuf_from(tok0, (size_t)(S + 1) * 4);
    struct dbuf dp0 = dbuf_from(pos0, (size_t)S * 4);
    struct dbuf dp = dbuf_from(pos, (size_t)n * 4), ds = dbuf_from(slots, (size_t)n * 4);
    float *inv = fx_host((size_t)c->n_freq * 4);
    for (int i = 0; i < c->n_freq; i++) inv[i] = powf(10000.0f, -2.0f * i / (float)hd);
    struct dbuf di = dbuf_from(inv, (size_t)c->n_freq * 4);
    float *qh = rand_f32((size_t)n * qw, -2, 2);
    struct dbuf q = dbuf_from(qh, (size_t)n * qw * 4);
    struct dbuf k = dbuf_from(rand_f32((size_t)n * kw, -2, 2), (size_t)n * kw * 4);
    struct dbuf v = dbuf_from(rand_f32((size_t)n * kw, -2, 2), (size_t)n * kw * 4);
    struct dbuf out = dbuf_new((size_t)n * qw * 4);
    dbuf_poison(out);
    struct backend_attn_batch cb = {S, n, max_blocks, max_ctx, d0.c, dp0.c, dt.c};
    struct backend_attn_batch gb = {S, n, max_blocks, max_ctx, d0.g, dp0.g, dt.g};
    const float scale = 1.0f / sqrtf((float)hd);
    const int i = fx.n_kv - 1;
    ASSERT_OK(backend_rope_kv_attention(fx.cpu, out.c, q.c, k.c, v.c, &fx.ckv[i], dp.c, ds.c, di.c, c->n_freq,
                                        c->neox, &cb, c->n_heads, scale));
    int rc = backend_rope_kv_attention(fx.gpu, out.g, q.g, k.g, v.g, &fx.gkv[i], dp.g, ds.g, di.g, c->n_freq,
                                       c->neox, &gb, c->n_heads, scale);
    if (rc != STATUS_OK) TEST_FAIL("gpu rope_kv_attention: %s", backend_errstr(fx.gpu));
    char what[160];
    snprintf(what, sizeof what, "rope_kv_attention %s cache, %d/%d heads x %d, %d seqs x %d rows from %d, neox %d, %d freqs",
             dtype_name(c->kv), c->n_heads, c->n_kv, hd, S, R, c->pos, c->neox, c->n_freq);
    if (mm.n) att_mm_check(&mm, out, n, what);
    float *qg = fx_host((size_t)n * qw * 4);
    ASSERT_OK(backend_download(fx.gpu, qg, q.g, (size_t)n * qw * 4));
    if (fused && memcmp(qg, qh, (size_t)n * qw * 4) != 0) TEST_FAIL("%s: q was rotated in place: not one launch", what);
    if (!fused) check_f32(q, (size_t)n * qw, 1e-12, what);
    /* One launch: F32 arithmetic on the same cache values as the CPU, the
     * slices merged in another order, exp off by ulps (~1e-12).  One
     * position too many or too few moves a row by ~1/context of its size:
     * NMSE >= 1e-7 up to 3000 positions.  The two ops: attention's own
     * bounds (cuda_ops_attention_*; tensor cores round to F16). */
    /* Q8_0: a new k a last bit apart after rope may round to the next
     * int8 (kernels: rope_kv_case), which moves a score by ~1e-3 of the
     * value: 1e-6. */
    const double bound = !fused && attn_on_tensor_cores(c->kv, c->n_heads, c->n_kv, hd, bs, n, S) ? 1e-4
                         : c->kv == DTYPE_Q8_0                                               ? 1e-6
                                                                                             : 1e-8;
    double e = check_f32(out, (size_t)n * qw, bound, what);
    /* The caches, every slot: the new k rotated as rope rotates it (one F16
     * rounding may differ where the products round differently). */
    const size_t elems = (size_t)n_blocks * bs * c->n_kv * hd;
    const double cache_bound = c->kv == DTYPE_F32 ? 1e-12 : c->kv == DTYPE_Q8_0 ? 1e-6 : 1e-7;
    check_cache(c->kv, fx.ckv[i].k, fx.gkv[i].k, elems, cache_bound, what);
    check_cache(c->kv, fx.ckv[i].v, fx.gkv[i].v, elems, cache_bound, what);
    printf("    %s%s: NMSE %.3g\n", what, fused ? " (one launch)" : "", e);
    fx_close();
}

TEST(cuda_ops_rope_kv_attention) {
    static const struct ropeatt_case cases[] = {
        /* MHA heads of 128 at 38 positions (3 slices), pairs (2i, 2i+1). */
        {DTYPE_F16, 4, 4, 128, 37, 64, 0, 1, 1},
        /* GQA 8 over 2, heads of 64, 701 positions, neox, a partial rotation. */
        {DTYPE_F16, 8, 2, 64, 700, 24, 1, 1, 1},
        /* The first position: one slice. */
        {DTYPE_F16, 4, 4, 64, 0, 32, 0, 1, 1},
        /* 3001 positions: the most slices, 48 positions each. */
        {DTYPE_F16, 2, 1, 128, 3000, 64, 1, 1, 1},
        /* GQA 4 over 1, a block's last position. */
        {DTYPE_F16, 4, 1, 64, 95, 32, 1, 1, 1},
        /* Batches of decode rows: 2, 4, 5 and 16 sequences at different positions. */
        {DTYPE_F16, 8, 8, 128, 520, 64, 0, 2, 1},
        {DTYPE_F16, 4, 4, 128, 130, 64, 1, 4, 1},
        {DTYPE_F16, 8, 2, 64, 3, 32, 1, 5, 1},
        {DTYPE_F16, 4, 4, 128, 200, 64, 0, 16, 1},
        /* Cases the one launch leaves to the two ops: an F32 cache, a
         * sequence of two rows, more rows than it takes. */
        {DTYPE_F32, 8, 2, 64, 300, 32, 1, 1, 1},
        {DTYPE_F16, 8, 2, 64, 300, 32, 0, 1, 2},
        {DTYPE_F16, 4, 2, 64, 10, 32, 0, 17, 1},
        /* An 8-bit cache: always the two ops (rope_kv_write, attention). */
        {DTYPE_Q8_0, 8, 2, 64, 300, 32, 1, 1, 1},
        {DTYPE_Q8_0, 4, 4, 128, 130, 64, 0, 4, 1},
    };
    setenv("LLM_CUDA_ROPE_ATT", "16", 1);
    for (size_t c = 0; c < sizeof cases / sizeof cases[0]; c++) rope_attention_case(&cases[c]);
    unsetenv("LLM_CUDA_ROPE_ATT");
}

/* sm_75's mq at 33-64 tokens (LLM_CUDA_SM=75): the activations of each
 * chunk staged in two halves of its columns, within a T4's 64 KB of shared
 * memory a block, against the CPU on fresh inputs for every quantized type
 * at 33, 48, 63 and 64 tokens: widths of one chunk (no split), of several
 * (split K, partial sums added by the reduction kernel) and, for the
 * 32-element types, a partial last chunk whose second half holds no
 * column (1056 = 4 x 256 + 32) or one block (1184 = 4 x 256 + 160); rows not
 * a multiple of the 128 a block.  With LLM_CUDA_MQ64=0 the same shapes
 * take the tile path.  On a newer card the routing is sm_75's with the
 * card's own code; a build of compute_75 PTX runs sm_75's too. */
static void mq64_sm75_type(enum dtype t) {
    static const int32_t ns[] = {33, 48, 63, 64};
    const int k_quant = t == DTYPE_Q4_K || t == DTYPE_Q5_K || t == DTYPE_Q6_K;
    mm_set_mode(MM_DEFAULT);
    for (int off = 0; off < 2; off++) {
        setenv("LLM_CUDA_SM", "75", 1);
        if (off) setenv("LLM_CUDA_MQ64", "0", 1);
        else unsetenv("LLM_CUDA_MQ64");
        fx_open();
        matmul_case(t, 300, 256, ns, 4);
        matmul_case(t, 131, 4096, ns, 4);
        matmul_case(t, 35, 768, ns, 4);
        if (!k_quant) {
            matmul_case(t, 130, 1056, ns, 4);
            matmul_case(t, 257, 1184, ns, 4);
        }
        fx_close();
    }
    unsetenv("LLM_CUDA_MQ64");
    unsetenv("LLM_CUDA_SM");
}

TEST(cuda_ops_matmul_mq64_sm75) {
    static const enum dtype types[] = {DTYPE_Q8_0, DTYPE_Q4_0, DTYPE_Q4_1, DTYPE_Q5_0, DTYPE_Q5_1,
                                       DTYPE_Q4_K, DTYPE_Q5_K, DTYPE_Q6_K};
    for (size_t k = 0; k < sizeof types / sizeof types[0]; k++) mq64_sm75_type(types[k]);
    /* F16 reaches mq at these sizes only when sent there
     * (LLM_CUDA_SKINNY_MAX=64). */
    setenv("LLM_CUDA_SKINNY_MAX", "64", 1);
    setenv("LLM_CUDA_SM", "75", 1);
    fx_open();
    static const int32_t ns[] = {33, 48, 63, 64};
    matmul_case(DTYPE_F16, 300, 256, ns, 4);
    matmul_case(DTYPE_F16, 131, 4096, ns, 4);
    matmul_case(DTYPE_F16, 130, 1056, ns, 4);
    fx_close();
    unsetenv("LLM_CUDA_SM");
    mm_set_mode(MM_DEFAULT);
}

/* ---- Decode attention on the 8-bit cache (attention_q8.cu) ----
 * Decode-only batches (one row a sequence) on a Q8_0 cache with heads of
 * 64, 128 or 256, groups of 1, 2, 4 or 8 and blocks a power of two take
 * attention_q8.cu, which reads the int8 rows and their scales as stored.
 * Both backends read the same cache bytes and compute in F32 (the CPU
 * scales a group's dot product once, the GPU each lane's 8 values, and
 * sums in another order), so the outputs differ by float rounding only:
 * NMSE ~1e-13, and attention_case's F32 bound of 1e-9 still fails one
 * position masked wrongly (it moves its row by ~1/sqrt(context) of the
 * row's size: NMSE >= 1e-6 even at context 2048 among 64 rows), a wrong
 * scale group, block, head or row (NMSE ~1).  Contexts 1, 31, 33, 500 and 2048
 * (a chunk of one row, chunks ending inside a 4-row piece, one past a
 * chunk, long ones split over blocks); batches of 1 (split the most) and
 * 64 (the rest of the rows at random contexts); tables a random
 * permutation of the cache's blocks; blocks of 8 (a warp's chunk of 16
 * rows spans two), 16 and 32. */
static const int32_t q8d_ones[64] = {1, 1, 1, 1, 1, 1, 1, 1, 1, 1, 1, 1, 1, 1, 1, 1, 1, 1, 1, 1, 1, 1,
                                     1, 1, 1, 1, 1, 1, 1, 1, 1, 1, 1, 1, 1, 1, 1, 1, 1, 1, 1, 1, 1, 1,
                                     1, 1, 1, 1, 1, 1, 1, 1, 1, 1, 1, 1, 1, 1, 1, 1, 1, 1, 1, 1};
static const int32_t q8d_pos[5] = {0, 30, 32, 499, 2047}; /* contexts 1, 31, 33, 500, 2048 */

/* 64 rows: the five contexts, then random ones up to max_pos + 1. */
static void q8d_batch64(int32_t *pos, int32_t max_pos) {
    for (int i = 0; i < 64; i++) pos[i] = i < 5 ? q8d_pos[i] : rng_int(max_pos + 1);
}

static void q8d_cases(void) {
    int32_t pos[64];
    static const int32_t p2048[1] = {2047}, p1[1] = {0};
    fx_open();
    /* Heads of 128 without groups (Llama-7B): one row at 2048 and at 1,
     * the five contexts together, 64 rows. */
    attention_case(DTYPE_Q8_0, 32, 32, 128, 16, 1, q8d_ones, p2048);
    attention_case(DTYPE_Q8_0, 32, 32, 128, 16, 1, q8d_ones, p1);
    attention_case(DTYPE_Q8_0, 32, 32, 128, 16, 5, q8d_ones, q8d_pos);
    q8d_batch64(pos, 150);
    attention_case(DTYPE_Q8_0, 32, 32, 128, 16, 64, q8d_ones, pos);
    fx_close();
    fx_open();
    /* Groups of 4 and 8 with heads of 128. */
    attention_case(DTYPE_Q8_0, 32, 8, 128, 16, 1, q8d_ones, p2048);
    q8d_batch64(pos, 300);
    attention_case(DTYPE_Q8_0, 32, 8, 128, 16, 64, q8d_ones, pos);
    attention_case(DTYPE_Q8_0, 32, 4, 128, 16, 5, q8d_ones, q8d_pos);
    q8d_batch64(pos, 300);
    attention_case(DTYPE_Q8_0, 32, 4, 128, 16, 64, q8d_ones, pos);
    fx_close();
    fx_open();
    /* Heads of 64: groups of 1 in blocks of 8, of 4 and of 8 (TinyLlama). */
    attention_case(DTYPE_Q8_0, 8, 8, 64, 8, 5, q8d_ones, q8d_pos);
    attention_case(DTYPE_Q8_0, 8, 8, 64, 8, 1, q8d_ones, p2048);
    attention_case(DTYPE_Q8_0, 16, 4, 64, 16, 5, q8d_ones, q8d_pos);
    q8d_batch64(pos, 400);
    attention_case(DTYPE_Q8_0, 32, 4, 64, 16, 64, q8d_ones, pos);
    fx_close();
    fx_open();
    /* Groups of 2 in blocks of 32; heads of 256 in groups of 1 and 8. */
    attention_case(DTYPE_Q8_0, 16, 8, 128, 32, 5, q8d_ones, q8d_pos);
    attention_case(DTYPE_Q8_0, 4, 4, 256, 16, 5, q8d_ones, q8d_pos);
    attention_case(DTYPE_Q8_0, 16, 2, 256, 16, 5, q8d_ones, q8d_pos);
    fx_close();
}

TEST(cuda_ops_attention_q8_0_decode) {
    q8d_cases(); /* the groups on attention_gqa.cu's tensor cores */
    /* Every group on attention_q8.cu, and splits of one chunk a warp
     * (LLM_CUDA_ATT_STEPS=1): twice as many, up to the 64 the merge takes. */
    setenv("LLM_CUDA_ATT_GQA_MIN", "0", 1);
    q8d_cases();
    setenv("LLM_CUDA_ATT_STEPS", "1", 1);
    fx_open();
    static const int32_t p4000[1] = {3999};
    attention_case(DTYPE_Q8_0, 8, 2, 64, 16, 1, q8d_ones, p4000);
    attention_case(DTYPE_Q8_0, 32, 32, 128, 16, 5, q8d_ones, q8d_pos);
    fx_close();
    unsetenv("LLM_CUDA_ATT_STEPS");
    unsetenv("LLM_CUDA_ATT_GQA_MIN");
}

/* Batches with prefill rows over the 8-bit cache: the tensor-core kernel
 * (attention_prefill.cu) turns each piece of int8 and its scale into F16
 * as it stores the tile, so the error is the F16 kernel's plus one F16
 * rounding of d * q (relative 2^-11, as an F16 cache would hold it): the
 * tensor cores' bound of 1e-4 (attention_case).  Groups of 1, 4 and 8,
 * heads of 64 and 128, chunks of 1, 17 and 512 rows at position 0 and
 * past it, decode rows (a sequence of one row) in the same batches,
 * shuffled block tables of 8, 16 and 32 positions; the batches of short
 * chunks at long contexts split the context over blocks, the 512-row ones
 * do not.  Each shape with m16n8k16 (sm_80 and later) and sm_75's m16n8k8,
 * then on the general kernel (LLM_CUDA_PREFILL_TC=0) as a check of the
 * cases themselves. */
static void q8p_cases(void) {
    fx_open();
    static const int32_t l1[] = {17, 1, 512}, p1[] = {0, 300, 0};
    attention_case(DTYPE_Q8_0, 8, 8, 128, 16, 3, l1, p1); /* MHA, heads of 128 */
    static const int32_t l2[] = {1, 17, 512, 1}, p2[] = {0, 250, 700, 1000};
    attention_case(DTYPE_Q8_0, 16, 4, 64, 32, 4, l2, p2); /* groups of 4, heads of 64 */
    static const int32_t l3[] = {512, 17, 1}, p3[] = {0, 0, 77};
    attention_case(DTYPE_Q8_0, 32, 4, 128, 16, 3, l3, p3); /* groups of 8, heads of 128 */
    static const int32_t l4[] = {17, 512, 1}, p4[] = {100, 1500, 2047};
    attention_case(DTYPE_Q8_0, 16, 2, 64, 8, 3, l4, p4); /* groups of 8, heads of 64, blocks of 8 */
    fx_close();
    fx_open();
    static const int32_t l5[] = {512, 17}, p5[] = {33, 0};
    attention_case(DTYPE_Q8_0, 4, 4, 64, 16, 2, l5, p5); /* MHA, heads of 64 */
    static const int32_t l6[] = {17, 17, 1, 1}, p6[] = {0, 999, 5, 600};
    attention_case(DTYPE_Q8_0, 16, 4, 128, 16, 4, l6, p6); /* groups of 4, heads of 128, split */
    static const int32_t l7[] = {17}, p7[] = {3000};
    attention_case(DTYPE_Q8_0, 8, 1, 64, 32, 1, l7, p7); /* one chunk at a long context: split */
    static const int32_t l8[] = {1, 2, 1}, p8[] = {40, 63, 0};
    attention_case(DTYPE_Q8_0, 8, 8, 128, 16, 3, l8, p8); /* two rows among decode rows */
    fx_close();
}

TEST(cuda_ops_attention_q8_0_prefill) {
    unsetenv("LLM_CUDA_PREFILL_TC");
    q8p_cases();
    setenv("LLM_CUDA_ATT_K8", "1", 1);
    q8p_cases();
    unsetenv("LLM_CUDA_ATT_K8");
    setenv("LLM_CUDA_PREFILL_TC", "0", 1);
    q8p_cases();
    unsetenv("LLM_CUDA_PREFILL_TC");
}

TEST_MAIN(cuda_ops_identity_and_memory, cuda_ops_upload_copy_download, cuda_ops_rmsnorm, cuda_ops_add_rmsnorm,
          cuda_ops_add_swiglu, cuda_ops_get_rows, cuda_ops_rope_both_orders, cuda_ops_convert,
          cuda_ops_embed_every_dtype, cuda_ops_matmul_f32, cuda_ops_matmul_f16, cuda_ops_matmul_bf16,
          cuda_ops_matmul_q8_0, cuda_ops_matmul_q4_0, cuda_ops_matmul_q4_1, cuda_ops_matmul_q5_0,
          cuda_ops_matmul_q5_1, cuda_ops_matmul_q4_k, cuda_ops_matmul_q5_k, cuda_ops_matmul_q6_k,
          cuda_ops_matmul_odd_width_and_tiles, cuda_ops_matmul_tiles_made_ahead,
          cuda_ops_out_of_memory_fails_the_op_not_the_backend,
          cuda_ops_matmul_reuses_input_safely, cuda_ops_matmul_gemv_q8_0, cuda_ops_matmul_gemv_q4_0,
          cuda_ops_matmul_gemv_q4_k, cuda_ops_matmul_gemv_q5_k, cuda_ops_matmul_gemv_q6_k, cuda_ops_rmsnorm_feeds_matmul, cuda_ops_matmul_multi, cuda_ops_matmul_swiglu,
          cuda_ops_matmul_wide, cuda_ops_matmul_mmq,
          cuda_ops_kv_write_f32, cuda_ops_kv_write_f16, cuda_ops_kv_write_q8_0, cuda_ops_rope_kv_write,
          cuda_ops_attention_gqa_f32, cuda_ops_attention_gqa_f16, cuda_ops_attention_q8_0, cuda_ops_attention_shapes,
          cuda_ops_attention_decode, cuda_ops_attention_gqa, cuda_ops_attention_gqa_q8_0, cuda_ops_attention_prefill,
          cuda_ops_attention_mixed,
          cuda_ops_rope_kv_attention,
          cuda_ops_matmul_mq64_sm75, cuda_ops_attention_q8_0_decode, cuda_ops_attention_q8_0_prefill)
