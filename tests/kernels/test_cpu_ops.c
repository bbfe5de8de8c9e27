/* Tests of the CPU backend's ops against scalar references written here in
 * double precision, on fresh random inputs, with outputs filled with NaN
 * before each op so that an element the op forgets to write fails.  Errors
 * are normalised: NMSE = sum((out - ref)^2) / sum(ref^2), bounded per op and
 * dtype (the bounds are next to each check, with why). */
#include "../test.h"

#include <stdint.h>

#include "common/dtype.h"
#include "common/status.h"
#include "kernels/backend.h"
#include "kernels/cpu/cpu.h" /* the kernel variants, to test the portable ones too */

/* ---- Fixture: a backend and the buffers of one test ----
 * Everything a test allocates goes through fx_alloc and is released by
 * fx_release, which each test calls at its end and at its start (to clean
 * up after a previous test that failed half-way). */

#define FX_MAX_ALLOCS 256
static void *fx_ptrs[FX_MAX_ALLOCS];
static int fx_n;
static backend *fx_be;

static void fx_release(void) {
    for (int i = 0; i < fx_n; i++) free(fx_ptrs[i]);
    fx_n = 0;
    backend_free(fx_be);
    fx_be = NULL;
}

/* Frees what was allocated since fx_n was mark, for helpers called in loops. */
static void fx_release_to(int mark) {
    while (fx_n > mark) free(fx_ptrs[--fx_n]);
}

static void *fx_alloc(size_t bytes) {
    if (fx_n == FX_MAX_ALLOCS) TEST_FAIL("fixture: more than %d allocations", FX_MAX_ALLOCS);
    void *p = malloc(bytes ? bytes : 1);
    if (!p) TEST_FAIL("fixture: cannot allocate %zu bytes", bytes);
    fx_ptrs[fx_n++] = p;
    return p;
}

static backend *fx_backend(int n_threads) {
    char err[256];
    backend_free(fx_be);
    fx_be = NULL;
    int st = backend_cpu_init(&fx_be, n_threads, err, sizeof err);
    if (st != 0) TEST_FAIL("backend_cpu_init(%d): %s", n_threads, err);
    return fx_be;
}

/* ---- Random inputs ---- */

static uint64_t rng_state = 0x9e3779b97f4a7c15ull;

static uint32_t rng_u32(void) {
    rng_state ^= rng_state << 13;
    rng_state ^= rng_state >> 7;
    rng_state ^= rng_state << 17;
    return (uint32_t)(rng_state >> 16);
}

static float rng_uniform(void) { return ((float)rng_u32() + 0.5f) / 4294967296.0f; } /* (0, 1) */

static float rng_normal(void) {
    return sqrtf(-2.0f * logf(rng_uniform())) * cosf(6.2831853f * rng_uniform());
}

static float *rand_floats(int64_t n, float scale) {
    float *p = fx_alloc((size_t)n * sizeof(float));
    for (int64_t i = 0; i < n; i++) p[i] = scale * rng_normal();
    return p;
}

static float *nan_floats(int64_t n) {
    float *p = fx_alloc((size_t)n * sizeof(float));
    for (int64_t i = 0; i < n; i++) p[i] = NAN;
    return p;
}

static void poison(float *p, int64_t n) {
    for (int64_t i = 0; i < n; i++) p[i] = NAN;
}

/* NMSE of out against ref; NaN in out makes it NaN, which fails "<=". */
static double nmse(const float *out, const double *ref, int64_t n) {
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

static int quantizable(enum dtype t) {
    return t == DTYPE_F32 || t == DTYPE_F16 || t == DTYPE_BF16 || t == DTYPE_Q8_0 || t == DTYPE_Q4_0 ||
           t == DTYPE_Q4_K || t == DTYPE_Q5_K || t == DTYPE_Q6_K;
}

/* rows x cols weights of type t: quantized random normals where dtype_quant_row
 * supports t, otherwise random bytes with small random fp16 scales and mins. */
static void *make_weights(enum dtype t, int64_t rows, int64_t cols) {
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

static double *dequant_matrix(enum dtype t, const void *w, int64_t rows, int64_t cols) {
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
static int64_t test_cols(enum dtype t) {
    int64_t be = dtype_block_elems(t);
    return be == 1 ? 803 : be == 32 ? 32 * 25 : 256 * 5;
}

/* Matmul bounds.  F32/F16/BF16 weights meet float activations: only float
 * rounding of a ~1000-term sum, NMSE ~1e-14 measured.  The quantized types
 * dot against activations rounded to 8 bits per block of 32 (256 for
 * K-quants): each activation gets an error of variance (amax/127)^2/12,
 * 3e-5 to 5e-5 of its own variance for normal inputs, which is the NMSE of
 * the products (measured 1e-5 to 1.2e-4 over 200-row samples); the bound is
 * llama.cpp test-backend-ops' 5e-4.  A wrong nibble, bit or sub-block scale
 * gives NMSE above 1e-2. */
static double matmul_bound(enum dtype t) { return dtype_block_elems(t) == 1 ? 1e-10 : 5e-4; }

static void check_matmul(backend *be, enum dtype t, int64_t rows, int32_t n) {
    int mark = fx_n;
    int64_t cols = test_cols(t);
    void *w = make_weights(t, rows, cols);
    double *wd = dequant_matrix(t, w, rows, cols);
    float *x = rand_floats((int64_t)n * cols, 1.0f);
    float *out = nan_floats((int64_t)n * rows);
    double *ref = fx_alloc((size_t)n * rows * sizeof(double));
    for (int32_t i = 0; i < n; i++)
        for (int64_t r = 0; r < rows; r++) {
            double s = 0;
            for (int64_t c = 0; c < cols; c++) s += wd[r * cols + c] * x[(int64_t)i * cols + c];
            ref[(int64_t)i * rows + r] = s;
        }
    struct backend_weight bw;
    ASSERT_OK(backend_weight_load(be, &bw, t, w, rows, cols));
    ASSERT_OK(backend_matmul(be, out, &bw, x, n));
    double e = nmse(out, ref, (int64_t)n * rows);
    if (!(e <= matmul_bound(t)))
        TEST_FAIL("matmul %s [%lld x %lld], n = %d: NMSE %.3g above %.3g", dtype_name(t), (long long)rows,
                  (long long)cols, n, e, matmul_bound(t));
    if (getenv("TEST_VERBOSE")) printf("  matmul %-5s n=%-3d NMSE %.3g\n", dtype_name(t), n, e);
    backend_weight_free(be, &bw);
    fx_release_to(mark);
}

TEST(cpu_ops_matmul_every_dtype) {
    fx_release();
    backend *be = fx_backend(3);
    static const int32_t ns[] = {1, 3, 17, 70};
    for (int i = 0; i < N_TYPES; i++)
        for (int j = 0; j < 4; j++) check_matmul(be, all_types[i], 67, ns[j]);
    fx_release();
}

/* The backend runs the AVX2 kernels where the CPU has them; the portable
 * ones run elsewhere.  Both must match: same inputs, NMSE between them only
 * from the order of float additions (integer block sums are exact). */
TEST(cpu_ops_vector_kernels_match_scalar) {
    fx_release();
    cpu_kernels_init();
    if (!cpu_has_avx2()) printf("  note: no AVX2 here; the backend itself runs the scalar kernels\n");
    if (cpu_has_avx2()) {
        /* Activation quantization: the same bytes from both, also for a
         * zero block and values that land on .5 exactly. */
        int64_t n = 1024;
        float *x = rand_floats(n, 3.0f);
        for (int i = 0; i < 32; i++) x[256 + i] = 0.0f;
        for (int i = 0; i < 8; i++) x[512 + i] = (float)(i - 4) * 0.5f;
        x[519] = 127.0f;
        for (int act = CPU_ACT_Q8; act <= CPU_ACT_Q8K; act++) {
            size_t bytes = cpu_act_row_bytes((enum cpu_act)act, n);
            uint8_t *a = fx_alloc(bytes), *b = fx_alloc(bytes);
            memset(a, 0x5a, bytes);
            memset(b, 0xa5, bytes);
            cpu_act_quant_row_scalar((enum cpu_act)act, x, a, n);
            cpu_act_quant_row_avx2((enum cpu_act)act, x, b, n);
            if (memcmp(a, b, bytes) != 0) TEST_FAIL("activation quantization %d: AVX2 bytes differ from scalar", act);
        }
    }
    int64_t rows = 23;
    for (int i = 0; i < N_TYPES; i++) {
        enum dtype t = all_types[i];
        int64_t cols = test_cols(t);
        const struct cpu_type_traits *tr = cpu_type_traits(t);
        ASSERT_TRUE(tr != NULL);
        cpu_dot_fn scalar = cpu_dot_scalar(t), vec = cpu_dot_avx2(t);
        if (!vec || !cpu_has_avx2()) continue;
        uint8_t *w = make_weights(t, rows, cols);
        float *x = rand_floats(cols, 1.0f);
        void *xq = fx_alloc(cpu_act_row_bytes(tr->act, cols));
        cpu_act_quant_row(tr->act, x, xq, cols);
        float *out = nan_floats(rows);
        double *ref = fx_alloc((size_t)rows * sizeof(double));
        for (int64_t r = 0; r < rows; r++) {
            const uint8_t *wr = w + (size_t)r * dtype_row_bytes(t, cols);
            ref[r] = scalar(wr, xq, cols);
            out[r] = vec(wr, xq, cols);
        }
        double e = nmse(out, ref, rows);
        if (!(e <= 1e-11)) TEST_FAIL("%s: AVX2 and scalar dots differ, NMSE %.3g above 1e-11", dtype_name(t), e);
        /* The V sums of attention, for the two cache types. */
        cpu_axpy_fn ax = cpu_axpy_avx2(t), ax_ref = cpu_axpy_scalar(t);
        if (ax) {
            float *acc = rand_floats(cols, 1.0f);
            double *acc_ref = fx_alloc((size_t)cols * sizeof(double));
            float *tmp = fx_alloc((size_t)cols * sizeof(float));
            memcpy(tmp, acc, (size_t)cols * sizeof(float));
            ax(acc, 0.37f, w, cols);
            ax_ref(tmp, 0.37f, w, cols);
            for (int64_t c = 0; c < cols; c++) acc_ref[c] = tmp[c];
            ASSERT_NMSE(acc, acc_ref, cols, 1e-12); /* fused vs separate multiply-add */
        }
        /* The four-row kernel (prefill), where the type has one. */
        cpu_dot4_fn vec4 = cpu_dot4_avx2(t);
        if (!vec4) continue;
        size_t xrb = cpu_act_row_bytes(tr->act, cols);
        uint8_t *x4 = fx_alloc(4 * xrb);
        float *o4 = nan_floats(4 * rows);
        double *r4 = fx_alloc(4 * (size_t)rows * sizeof(double));
        for (int j = 0; j < 4; j++) cpu_act_quant_row(tr->act, rand_floats(cols, 1.0f), x4 + j * xrb, cols);
        for (int64_t r = 0; r < rows; r++) {
            const uint8_t *wr = w + (size_t)r * dtype_row_bytes(t, cols);
            vec4(wr, x4, xrb, cols, o4 + 4 * r);
            for (int j = 0; j < 4; j++) r4[4 * r + j] = scalar(wr, x4 + j * xrb, cols);
        }
        e = nmse(o4, r4, 4 * rows);
        if (!(e <= 1e-11)) TEST_FAIL("%s: AVX2 4-row and scalar dots differ, NMSE %.3g above 1e-11", dtype_name(t), e);
    }
    fx_release();
}

TEST(cpu_ops_matmul_wide_and_narrow) {
    fx_release();
    backend *be = fx_backend(2);
    /* Few rows with many tokens (chunks split over tokens), and one row. */
    check_matmul(be, DTYPE_Q8_0, 5, 100);
    check_matmul(be, DTYPE_Q4_K, 1, 33);
    check_matmul(be, DTYPE_F16, 301, 2);
    fx_release();
}

TEST(cpu_ops_weight_load_keeps_host_memory) {
    fx_release();
    backend *be = fx_backend(1);
    void *w = make_weights(DTYPE_Q4_K, 4, 256);
    struct backend_weight bw;
    ASSERT_OK(backend_weight_load(be, &bw, DTYPE_Q4_K, w, 4, 256));
    ASSERT_TRUE(bw.data == w);
    ASSERT_EQ(0, bw.owned);
    ASSERT_EQ((int64_t)4, bw.rows);
    ASSERT_EQ((int64_t)256, bw.cols);
    backend_weight_free(be, &bw);
    ASSERT_TRUE(bw.data == NULL);
    fx_release();
}

/* ---- embed ---- */

TEST(cpu_ops_embed_every_dtype) {
    fx_release();
    backend *be = fx_backend(2);
    int32_t ids[] = {5, 0, 41, 5, 12, 40};
    int32_t n = 6, vocab = 42;
    for (int i = 0; i < N_TYPES; i++) {
        enum dtype t = all_types[i];
        int64_t cols = test_cols(t);
        void *w = make_weights(t, vocab, cols);
        double *wd = dequant_matrix(t, w, vocab, cols);
        double *ref = fx_alloc((size_t)n * cols * sizeof(double));
        for (int32_t r = 0; r < n; r++)
            for (int64_t c = 0; c < cols; c++) ref[r * cols + c] = wd[ids[r] * cols + c];
        float *out = nan_floats(n * cols);
        struct backend_weight bw;
        ASSERT_OK(backend_weight_load(be, &bw, t, w, vocab, cols));
        ASSERT_OK(backend_embed(be, out, &bw, ids, n));
        /* The same dequantization as dtype_dequant_row, up to the order of
         * float operations on the scales. */
        ASSERT_NMSE(out, ref, n * cols, 1e-12);
        backend_weight_free(be, &bw);
    }
    fx_release();
}

TEST(cpu_ops_embed_rejects_bad_id) {
    fx_release();
    backend *be = fx_backend(1);
    void *w = make_weights(DTYPE_F32, 8, 16);
    float *out = nan_floats(16);
    struct backend_weight bw;
    ASSERT_OK(backend_weight_load(be, &bw, DTYPE_F32, w, 8, 16));
    int32_t id = 8;
    ASSERT_EQ((int)STATUS_BAD_INPUT, backend_embed(be, out, &bw, &id, 1));
    ASSERT_TRUE(strstr(backend_errstr(be), "8") != NULL);
    id = -1;
    ASSERT_EQ((int)STATUS_BAD_INPUT, backend_embed(be, out, &bw, &id, 1));
    backend_weight_free(be, &bw);
    fx_release();
}

/* ---- rmsnorm, add_rmsnorm, add, swiglu, get_rows ---- */

static void rmsnorm_ref(const float *x, const float *w, double *ref, int32_t n, int32_t dim, float eps) {
    for (int32_t r = 0; r < n; r++) {
        double ss = 0;
        for (int32_t i = 0; i < dim; i++) ss += (double)x[r * dim + i] * x[r * dim + i];
        double s = 1.0 / sqrt(ss / dim + eps);
        for (int32_t i = 0; i < dim; i++) ref[r * dim + i] = x[r * dim + i] * s * w[i];
    }
}

/* Float sums of ~1000 squares and one product per element: 1e-12. */
#define NORM_BOUND 1e-12

TEST(cpu_ops_rmsnorm) {
    fx_release();
    backend *be = fx_backend(2);
    int32_t shapes[][2] = {{1, 7}, {5, 803}, {64, 1024}};
    for (int k = 0; k < 3; k++) {
        int32_t n = shapes[k][0], dim = shapes[k][1];
        float *x = rand_floats(n * dim, 3.0f), *w = rand_floats(dim, 1.0f), *out = nan_floats(n * dim);
        double *ref = fx_alloc((size_t)n * dim * sizeof(double));
        rmsnorm_ref(x, w, ref, n, dim, 1e-5f);
        ASSERT_OK(backend_rmsnorm(be, out, x, w, n, dim, 1e-5f));
        ASSERT_NMSE(out, ref, n * dim, NORM_BOUND);
    }
    fx_release();
}

TEST(cpu_ops_add_rmsnorm) {
    fx_release();
    backend *be = fx_backend(2);
    int32_t shapes[][2] = {{1, 9}, {3, 803}, {40, 1024}};
    for (int k = 0; k < 3; k++) {
        int32_t n = shapes[k][0], dim = shapes[k][1];
        float *x = rand_floats(n * dim, 2.0f), *d = rand_floats(n * dim, 1.0f);
        float *w = rand_floats(dim, 1.0f), *out = nan_floats(n * dim);
        double *sum = fx_alloc((size_t)n * dim * sizeof(double)), *ref = fx_alloc((size_t)n * dim * sizeof(double));
        float *xs = fx_alloc((size_t)n * dim * sizeof(float));
        for (int32_t i = 0; i < n * dim; i++) {
            sum[i] = (double)x[i] + d[i];
            xs[i] = x[i] + d[i];
        }
        rmsnorm_ref(xs, w, ref, n, dim, 1e-6f);
        ASSERT_OK(backend_add_rmsnorm(be, x, d, out, w, n, dim, 1e-6f));
        ASSERT_NMSE(x, sum, n * dim, 1e-14); /* one float addition per element */
        ASSERT_NMSE(out, ref, n * dim, NORM_BOUND);
    }
    fx_release();
}

TEST(cpu_ops_add_and_swiglu) {
    fx_release();
    backend *be = fx_backend(3);
    int64_t sizes[] = {1, 13, 100003};
    for (int k = 0; k < 3; k++) {
        int64_t n = sizes[k];
        float *x = rand_floats(n, 1.0f), *y = rand_floats(n, 1.0f), *g = rand_floats(n, 4.0f);
        float *out = nan_floats(n);
        double *ref = fx_alloc((size_t)n * sizeof(double)), *sw = fx_alloc((size_t)n * sizeof(double));
        for (int64_t i = 0; i < n; i++) {
            ref[i] = (double)x[i] + y[i];
            sw[i] = g[i] / (1.0 + exp(-(double)g[i])) * y[i];
        }
        ASSERT_OK(backend_add(be, x, y, n));
        ASSERT_NMSE(x, ref, n, 1e-14);
        ASSERT_OK(backend_swiglu(be, out, g, y, n));
        ASSERT_NMSE(out, sw, n, 1e-12); /* expf and a division: a few ulp */
    }
    fx_release();
}

TEST(cpu_ops_get_rows) {
    fx_release();
    backend *be = fx_backend(2);
    int32_t dim = 37, rows = 11, idx[] = {10, 0, 3, 3, 7};
    float *x = rand_floats(rows * dim, 1.0f), *out = nan_floats(5 * dim);
    ASSERT_OK(backend_get_rows(be, out, x, idx, 5, dim));
    for (int i = 0; i < 5; i++)
        for (int32_t c = 0; c < dim; c++) ASSERT_EQ(x[idx[i] * dim + c], out[i * dim + c]);
    fx_release();
}

/* ---- rope ---- */

static void check_rope(backend *be, int neox, int32_t n, int32_t n_heads, int32_t head_dim, int32_t n_freq) {
    int64_t width = (int64_t)n_heads * head_dim;
    float *x = rand_floats(n * width, 1.0f), *x0 = fx_alloc((size_t)n * width * sizeof(float));
    memcpy(x0, x, (size_t)n * width * sizeof(float));
    int32_t *pos = fx_alloc((size_t)n * sizeof(int32_t));
    for (int32_t t = 0; t < n; t++) pos[t] = t == 0 ? 0 : (int32_t)(rng_u32() % 5000);
    float *inv = fx_alloc((size_t)n_freq * sizeof(float));
    for (int32_t i = 0; i < n_freq; i++) inv[i] = (float)pow(10000.0, -2.0 * i / (2.0 * n_freq));
    double *ref = fx_alloc((size_t)n * width * sizeof(double));
    for (int64_t i = 0; i < n * width; i++) ref[i] = x0[i];
    for (int32_t t = 0; t < n; t++)
        for (int32_t h = 0; h < n_heads; h++)
            for (int32_t i = 0; i < n_freq; i++) {
                double a = (double)pos[t] * inv[i], c = cos(a), s = sin(a);
                int64_t base = t * width + (int64_t)h * head_dim;
                int64_t j0 = base + (neox ? i : 2 * i), j1 = base + (neox ? i + n_freq : 2 * i + 1);
                double v0 = x0[j0], v1 = x0[j1];
                ref[j0] = v0 * c - v1 * s;
                ref[j1] = v0 * s + v1 * c;
            }
    ASSERT_OK(backend_rope(be, x, pos, n, n_heads, head_dim, inv, n_freq, neox));
    ASSERT_NMSE(x, ref, n * width, 1e-12); /* cos/sin rounded to float, two products */
}

TEST(cpu_ops_rope_both_orders) {
    fx_release();
    backend *be = fx_backend(2);
    for (int neox = 0; neox <= 1; neox++) {
        check_rope(be, neox, 1, 4, 16, 8);
        check_rope(be, neox, 9, 6, 64, 32);
        check_rope(be, neox, 300, 8, 64, 32);
        check_rope(be, neox, 5, 3, 32, 8); /* partial rotary: dims 16.. stay as they are */
    }
    fx_release();
}

TEST(cpu_ops_rope_orders_differ) {
    /* Guards the reference itself: the two pairings must give different
     * results, or the test above could not tell them apart. */
    fx_release();
    backend *be = fx_backend(1);
    float *a = rand_floats(64, 1.0f), *b = fx_alloc(64 * sizeof(float)), inv[8];
    memcpy(b, a, 64 * sizeof(float));
    for (int i = 0; i < 8; i++) inv[i] = 1.0f / (float)(i + 1);
    int32_t pos = 7;
    ASSERT_OK(backend_rope(be, a, &pos, 1, 4, 16, inv, 8, 0));
    ASSERT_OK(backend_rope(be, b, &pos, 1, 4, 16, inv, 8, 1));
    double diff = 0;
    for (int i = 0; i < 64; i++) diff += fabs((double)a[i] - b[i]);
    ASSERT_TRUE(diff > 1.0);
    fx_release();
}

/* ---- kv_write and attention ---- */

struct attn_case {
    int32_t n_seqs, n_heads, n_kv_heads, head_dim, block_size, n_blocks;
    int32_t pos0[6], len[6];  /* per sequence: history length and rows this step */
};

/* hd values as an 8-bit cache row holds them (kernels/backend.h): groups of
 * backend_kv_q8_group(hd), each scaled by d = amax / 127 rounded to F16,
 * the values rounded to nearest multiples of d. */
static void q8_round_row(float *x, int32_t hd) {
    int32_t g = backend_kv_q8_group(hd);
    for (int32_t i = 0; i < hd; i += g) {
        float amax = 0;
        for (int32_t j = 0; j < g; j++) amax = fmaxf(amax, fabsf(x[i + j]));
        float d = fp16_to_f32(f32_to_fp16(amax / 127.0f)), id = d > 0 ? 1.0f / d : 0.0f;
        for (int32_t j = 0; j < g; j++) x[i + j] = d * (float)lrintf(x[i + j] * id);
    }
}

/* n rows of hd values as a cache of this type holds them. */
static float *as_cached(const float *x, int64_t n, int32_t hd, enum dtype kv_type) {
    float *r = fx_alloc((size_t)n * hd * sizeof(float));
    memcpy(r, x, (size_t)n * hd * sizeof(float));
    for (int64_t i = 0; i < n; i++) {
        if (kv_type == DTYPE_Q8_0) q8_round_row(r + i * hd, hd);
        else if (kv_type == DTYPE_F16)
            for (int32_t d = 0; d < hd; d++) r[i * hd + d] = fp16_to_f32(f32_to_fp16(r[i * hd + d]));
    }
    return r;
}

/* Runs one attention step and compares with a double reference over the
 * K/V values as the cache stores them (rounded to fp16 for an F16 cache,
 * to each group's 8-bit steps for Q8_0). */
static void check_attention(backend *be, enum dtype kv_type, const struct attn_case *c) {
    int32_t S = c->n_seqs, hd = c->head_dim, nkv = c->n_kv_heads, nh = c->n_heads, bs = c->block_size;
    int64_t kvw = (int64_t)nkv * hd, qw = (int64_t)nh * hd;
    struct backend_kv kv;
    ASSERT_OK(backend_kv_init(be, &kv, kv_type, c->n_blocks, bs, nkv, hd));
    /* NaN in every slot: reading one the step did not write poisons the
     * output.  F16 NaN in every 2-byte word: every element of an F16
     * cache, every scale of an 8-bit one (its groups are an even number
     * of bytes). */
    size_t cache_elems = (size_t)c->n_blocks * bs * kvw;
    if (kv_type == DTYPE_F32) {
        poison(kv.k, (int64_t)cache_elems);
        poison(kv.v, (int64_t)cache_elems);
    } else {
        size_t words = (size_t)c->n_blocks * bs * nkv * backend_kv_row_bytes(kv_type, hd) / 2;
        for (size_t i = 0; i < words; i++) ((uint16_t *)kv.k)[i] = ((uint16_t *)kv.v)[i] = 0x7e00;
    }

    /* Block tables: a random permutation of all blocks, dealt out to the
     * sequences, so that tables are not in order. */
    int32_t *perm = fx_alloc((size_t)c->n_blocks * sizeof(int32_t));
    for (int32_t i = 0; i < c->n_blocks; i++) perm[i] = i;
    for (int32_t i = c->n_blocks - 1; i > 0; i--) {
        int32_t j = (int32_t)(rng_u32() % (uint32_t)(i + 1)), tmp = perm[i];
        perm[i] = perm[j];
        perm[j] = tmp;
    }
    int32_t max_ctx = 0, n_tokens = 0, used = 0;
    for (int32_t s = 0; s < S; s++) {
        if (c->pos0[s] + c->len[s] > max_ctx) max_ctx = c->pos0[s] + c->len[s];
        n_tokens += c->len[s];
    }
    int32_t max_blocks = (max_ctx + bs - 1) / bs + 1; /* one spare column, left at -1 */
    int32_t *bt = fx_alloc((size_t)S * max_blocks * sizeof(int32_t));
    int32_t *tok0 = fx_alloc((size_t)(S + 1) * sizeof(int32_t)), *pos0 = fx_alloc((size_t)S * sizeof(int32_t));
    tok0[0] = 0;
    for (int32_t s = 0; s < S; s++) {
        int32_t nb = (c->pos0[s] + c->len[s] + bs - 1) / bs;
        for (int32_t i = 0; i < max_blocks; i++) bt[s * max_blocks + i] = i < nb ? perm[used + i] : -1;
        used += nb;
        if (used > c->n_blocks) TEST_FAIL("attention case needs %d blocks, has %d", used, c->n_blocks);
        pos0[s] = c->pos0[s];
        tok0[s + 1] = tok0[s] + c->len[s];
    }

    /* K, V of every position of every sequence: history and this step. */
    float *kall[6], *vall[6];
    for (int32_t s = 0; s < S; s++) {
        int32_t ctx = c->pos0[s] + c->len[s];
        kall[s] = rand_floats(ctx * kvw, 1.0f);
        vall[s] = rand_floats(ctx * kvw, 1.0f);
        if (c->pos0[s] > 0) { /* the history, written by earlier steps */
            int32_t *slots = fx_alloc((size_t)c->pos0[s] * sizeof(int32_t));
            for (int32_t p = 0; p < c->pos0[s]; p++) slots[p] = bt[s * max_blocks + p / bs] * bs + p % bs;
            ASSERT_OK(backend_kv_write(be, &kv, kall[s], vall[s], slots, c->pos0[s]));
        }
    }
    /* This step: the rows of all sequences in one batch. */
    float *kstep = fx_alloc((size_t)n_tokens * kvw * sizeof(float)), *vstep = fx_alloc((size_t)n_tokens * kvw * sizeof(float));
    int32_t *slots = fx_alloc((size_t)n_tokens * sizeof(int32_t));
    for (int32_t s = 0; s < S; s++)
        for (int32_t r = 0; r < c->len[s]; r++) {
            int32_t p = c->pos0[s] + r, row = tok0[s] + r;
            memcpy(kstep + row * kvw, kall[s] + p * kvw, (size_t)kvw * sizeof(float));
            memcpy(vstep + row * kvw, vall[s] + p * kvw, (size_t)kvw * sizeof(float));
            slots[row] = bt[s * max_blocks + p / bs] * bs + p % bs;
        }
    ASSERT_OK(backend_kv_write(be, &kv, kstep, vstep, slots, n_tokens));

    float *q = rand_floats(n_tokens * qw, 1.0f), *out = nan_floats(n_tokens * qw);
    float scale = 1.0f / sqrtf((float)hd);
    struct backend_attn_batch batch = {S, n_tokens, max_blocks, max_ctx, tok0, pos0, bt};
    ASSERT_OK(backend_attention(be, out, q, &kv, &batch, nh, scale));

    double *ref = fx_alloc((size_t)n_tokens * qw * sizeof(double));
    double *sc = fx_alloc((size_t)max_ctx * sizeof(double));
    for (int32_t s = 0; s < S; s++) {
        int32_t ctx = c->pos0[s] + c->len[s];
        float *kc = as_cached(kall[s], (int64_t)ctx * nkv, hd, kv_type);
        float *vc = as_cached(vall[s], (int64_t)ctx * nkv, hd, kv_type);
        for (int32_t r = 0; r < c->len[s]; r++) {
            int32_t row = tok0[s] + r, p = c->pos0[s] + r;
            for (int32_t h = 0; h < nh; h++) {
                int32_t g = h / (nh / nkv);
                double mx = -INFINITY, sum = 0;
                for (int32_t j = 0; j <= p; j++) {
                    double d = 0;
                    for (int32_t i = 0; i < hd; i++) d += (double)q[row * qw + h * hd + i] * kc[j * kvw + g * hd + i];
                    sc[j] = d * scale;
                    if (sc[j] > mx) mx = sc[j];
                }
                for (int32_t j = 0; j <= p; j++) sum += (sc[j] = exp(sc[j] - mx));
                for (int32_t i = 0; i < hd; i++) {
                    double o = 0;
                    for (int32_t j = 0; j <= p; j++) o += sc[j] * vc[j * kvw + g * hd + i];
                    ref[row * qw + h * hd + i] = o / sum;
                }
            }
        }
    }
    /* The cache holds exactly the values of the reference; what remains is
     * float rounding in dots of head_dim terms and sums of up to max_ctx. */
    double e = nmse(out, ref, n_tokens * qw);
    if (!(e <= 1e-10))
        TEST_FAIL("attention %s, %d seqs, %d/%d heads, head_dim %d: NMSE %.3g above 1e-10", dtype_name(kv_type), S,
                  nh, nkv, hd, e);
    backend_kv_free(be, &kv);
}

static const struct attn_case attn_mixed = {
    /* a prefill chunk after history, a decode row, a fresh prefill, a first
     * decode row, a prefill crossing several blocks, a long decode */
    .n_seqs = 6, .n_heads = 8, .n_kv_heads = 2, .head_dim = 20, .block_size = 4, .n_blocks = 64,
    .pos0 = {5, 13, 0, 0, 3, 60}, .len = {7, 1, 3, 1, 17, 1},
};
static const struct attn_case attn_wide = {
    .n_seqs = 3, .n_heads = 16, .n_kv_heads = 4, .head_dim = 64, .block_size = 16, .n_blocks = 40,
    .pos0 = {0, 100, 31}, .len = {40, 1, 2},
};
/* Heads of 128: the 8-bit cache's groups of 64. */
static const struct attn_case attn_128 = {
    .n_seqs = 2, .n_heads = 4, .n_kv_heads = 2, .head_dim = 128, .block_size = 16, .n_blocks = 12,
    .pos0 = {0, 70}, .len = {20, 1},
};

TEST(cpu_ops_attention_f32_cache) {
    fx_release();
    backend *be = fx_backend(3);
    check_attention(be, DTYPE_F32, &attn_mixed);
    check_attention(be, DTYPE_F32, &attn_wide);
    fx_release();
}

TEST(cpu_ops_attention_f16_cache) {
    fx_release();
    backend *be = fx_backend(2);
    check_attention(be, DTYPE_F16, &attn_mixed);
    check_attention(be, DTYPE_F16, &attn_wide);
    fx_release();
}

/* The 8-bit cache against a reference over the values it stores, for every
 * group width: the whole row (20), 32 (64), 64 (128). */
TEST(cpu_ops_attention_q8_0_cache) {
    fx_release();
    backend *be = fx_backend(2);
    check_attention(be, DTYPE_Q8_0, &attn_mixed);
    check_attention(be, DTYPE_Q8_0, &attn_wide);
    check_attention(be, DTYPE_Q8_0, &attn_128);
    fx_release();
}

/* A row's attention output is the same bits whether its step has it alone
 * or with others of its sequence (a verifying step's k + 1 rows, groups of
 * up to eight, their positions in tiles of 32): 13 rows at positions
 * 29..41 in one call against each row alone at its position, for every
 * cache type. */
TEST(cpu_ops_attention_rows_invariant) {
    fx_release();
    backend *be = fx_backend(2);
    static const enum dtype kts[] = {DTYPE_F32, DTYPE_F16, DTYPE_Q8_0};
    int32_t nh = 8, nkv = 4, hd = 64, bs = 16, nb = 4, pos = 29, R = 13;
    int32_t kvw = nkv * hd, qw = nh * hd, bt[4] = {2, 0, 3, 1};
    for (int k = 0; k < 3; k++) {
        struct backend_kv kv;
        ASSERT_OK(backend_kv_init(be, &kv, kts[k], nb, bs, nkv, hd));
        int32_t n = pos + R, slots[64];
        float *kk = rand_floats(n * kvw, 1.0f), *vv = rand_floats(n * kvw, 1.0f);
        for (int32_t p = 0; p < n; p++) slots[p] = bt[p / bs] * bs + p % bs;
        ASSERT_OK(backend_kv_write(be, &kv, kk, vv, slots, n));
        float *q = rand_floats(R * qw, 1.0f), *all = nan_floats(R * qw), *one = nan_floats(qw);
        int32_t tok0[2] = {0, R}, pos0 = pos;
        struct backend_attn_batch batch = {1, R, 4, n, tok0, &pos0, bt};
        ASSERT_OK(backend_attention(be, all, q, &kv, &batch, nh, 0.125f));
        for (int32_t r = 0; r < R; r++) {
            int32_t t1[2] = {0, 1}, p1 = pos + r;
            struct backend_attn_batch b1 = {1, 1, 4, p1 + 1, t1, &p1, bt};
            ASSERT_OK(backend_attention(be, one, q + r * qw, &kv, &b1, nh, 0.125f));
            for (int32_t i = 0; i < qw; i++)
                if (memcmp(&one[i], &all[r * qw + i], sizeof(float)) != 0)
                    TEST_FAIL("attention %s: row %d of %d, element %d: %.9g in the step, %.9g alone",
                              dtype_name(kts[k]), r, R, i, all[r * qw + i], one[i]);
        }
        backend_kv_free(be, &kv);
    }
    fx_release();
}

/* The 8-bit row layout of kernels/backend.h, read back byte by byte: a
 * 128-wide row is two groups of [F16 d][64 int8], 132 bytes, group 1's
 * scale at byte 66 and its values from byte 68.  Each group's largest
 * value sits in its second half, so a row cut into groups of 32 puts
 * other scales at bytes 0 and 66. */
TEST(cpu_ops_kv_write_q8_layout) {
    fx_release();
    ASSERT_EQ(132, (int)backend_kv_row_bytes(DTYPE_Q8_0, 128));
    ASSERT_EQ(264, (int)backend_kv_row_bytes(DTYPE_Q8_0, 256));
    ASSERT_EQ(68, (int)backend_kv_row_bytes(DTYPE_Q8_0, 64));
    ASSERT_EQ(102, (int)backend_kv_row_bytes(DTYPE_Q8_0, 96));
    ASSERT_EQ(10, (int)backend_kv_row_bytes(DTYPE_Q8_0, 8));
    backend *be = fx_backend(1);
    struct backend_kv kv;
    int32_t nkv = 2, hd = 128, bs = 4, nb = 3, rb = 132;
    ASSERT_OK(backend_kv_init(be, &kv, DTYPE_Q8_0, nb, bs, nkv, hd));
    float *k = rand_floats(nkv * hd, 1.0f), *v = rand_floats(nkv * hd, 0.25f);
    for (int32_t h = 0; h < nkv; h++) { /* 6 to 12 standard deviations */
        k[h * hd + 40] = 8.0f + h;
        k[h * hd + 100] = -6.0f;
        v[h * hd + 50] = 2.0f;
        v[h * hd + 127] = 3.0f - h;
    }
    int32_t slot = 6; /* block 1, offset 2 */
    ASSERT_OK(backend_kv_write(be, &kv, k, v, &slot, 1));
    const struct { const uint8_t *cache; const float *x; } kvs[2] = {{kv.k, k}, {kv.v, v}};
    for (int c = 0; c < 2; c++)
        for (int32_t h = 0; h < nkv; h++) {
            const uint8_t *row = kvs[c].cache + ((size_t)(slot / bs * nkv + h) * bs + slot % bs) * rb;
            const float *x = kvs[c].x + h * hd;
            for (int grp = 0; grp < 2; grp++) {
                float amax = 0;
                for (int j = 0; j < 64; j++) amax = fmaxf(amax, fabsf(x[64 * grp + j]));
                uint16_t dh;
                memcpy(&dh, row + 66 * grp, 2);
                ASSERT_EQ((unsigned)f32_to_fp16(amax / 127.0f), (unsigned)dh);
                float d = fp16_to_f32(dh);
                for (int j = 0; j < 64; j++) {
                    float got = d * (float)(int8_t)row[66 * grp + 2 + j];
                    if (!(fabsf(got - x[64 * grp + j]) <= 0.5001f * d))
                        TEST_FAIL("%s head %d dim %d: d * q = %g, written %g (d %g)", c ? "V" : "K", h, 64 * grp + j,
                                  got, x[64 * grp + j], d);
                }
            }
        }
    backend_kv_free(be, &kv);
    fx_release();
}

TEST(cpu_ops_kv_write_layout) {
    /* [block][kv head][offset][dim]: element (slot, head, d) lands at
     * ((slot / bs * n_kv + head) * bs + slot % bs) * head_dim + d. */
    fx_release();
    backend *be = fx_backend(1);
    struct backend_kv kv;
    int32_t nkv = 3, hd = 5, bs = 4, nb = 6;
    ASSERT_OK(backend_kv_init(be, &kv, DTYPE_F32, nb, bs, nkv, hd));
    poison(kv.k, (int64_t)nb * bs * nkv * hd);
    float *k = rand_floats(2 * nkv * hd, 1.0f), *v = rand_floats(2 * nkv * hd, 1.0f);
    int32_t slots[2] = {9, 22};
    ASSERT_OK(backend_kv_write(be, &kv, k, v, slots, 2));
    for (int i = 0; i < 2; i++)
        for (int32_t h = 0; h < nkv; h++)
            for (int32_t d = 0; d < hd; d++) {
                int64_t at = ((int64_t)(slots[i] / bs * nkv + h) * bs + slots[i] % bs) * hd + d;
                ASSERT_EQ(k[(i * nkv + h) * hd + d], ((float *)kv.k)[at]);
                ASSERT_EQ(v[(i * nkv + h) * hd + d], ((float *)kv.v)[at]);
            }
    int32_t bad = nb * bs;
    ASSERT_EQ((int)STATUS_BAD_INPUT, backend_kv_write(be, &kv, k, v, &bad, 1));
    backend_kv_free(be, &kv);
    fx_release();
}

TEST(cpu_ops_attention_rejects_bad_block) {
    fx_release();
    backend *be = fx_backend(1);
    struct backend_kv kv;
    ASSERT_OK(backend_kv_init(be, &kv, DTYPE_F32, 4, 4, 1, 8));
    int32_t tok0[2] = {0, 1}, pos0[1] = {5}, bt[2] = {1, 4}; /* block 4 of 4 */
    struct backend_attn_batch batch = {1, 1, 2, 6, tok0, pos0, bt};
    float *q = rand_floats(8, 1.0f), *out = nan_floats(8);
    ASSERT_EQ((int)STATUS_BAD_INPUT, backend_attention(be, out, q, &kv, &batch, 1, 1.0f));
    ASSERT_TRUE(strstr(backend_errstr(be), "block") != NULL);
    backend_kv_free(be, &kv);
    fx_release();
}

/* ---- convert ---- */

TEST(cpu_ops_convert) {
    fx_release();
    backend *be = fx_backend(2);
    int64_t n = 70001;
    float *f = rand_floats(n, 100.0f);
    /* Also values that overflow fp16, its subnormals, zeros and infinities. */
    f[0] = 1e6f, f[1] = -7e4f, f[2] = 3e-6f, f[3] = -1e-7f, f[4] = 0.0f, f[5] = -0.0f, f[6] = INFINITY;
    f[7] = 65504.0f, f[8] = 65519.0f, f[9] = 65520.0f;
    uint16_t *h = fx_alloc((size_t)n * 2), *bf = fx_alloc((size_t)n * 2), *hb = fx_alloc((size_t)n * 2);
    float *back = nan_floats(n);
    memset(h, 0xff, (size_t)n * 2);
    memset(bf, 0xff, (size_t)n * 2);
    ASSERT_OK(backend_convert(be, h, DTYPE_F16, f, DTYPE_F32, n));
    ASSERT_OK(backend_convert(be, bf, DTYPE_BF16, f, DTYPE_F32, n));
    for (int64_t i = 0; i < n; i++) {
        ASSERT_EQ((unsigned)f32_to_fp16(f[i]), (unsigned)h[i]);
        ASSERT_EQ((unsigned)f32_to_bf16(f[i]), (unsigned)bf[i]);
    }
    ASSERT_OK(backend_convert(be, back, DTYPE_F32, h, DTYPE_F16, n));
    for (int64_t i = 0; i < n; i++) ASSERT_EQ(fp16_to_f32(h[i]), back[i]);
    poison(back, n);
    ASSERT_OK(backend_convert(be, back, DTYPE_F32, bf, DTYPE_BF16, n));
    for (int64_t i = 0; i < n; i++) ASSERT_EQ(bf16_to_f32(bf[i]), back[i]);
    memset(hb, 0xff, (size_t)n * 2);
    ASSERT_OK(backend_convert(be, hb, DTYPE_BF16, h, DTYPE_F16, n));
    for (int64_t i = 0; i < n; i++) ASSERT_EQ((unsigned)f32_to_bf16(fp16_to_f32(h[i])), (unsigned)hb[i]);
    memset(hb, 0xff, (size_t)n * 2);
    ASSERT_OK(backend_convert(be, hb, DTYPE_F16, h, DTYPE_F16, n));
    ASSERT_TRUE(memcmp(h, hb, (size_t)n * 2) == 0);
    ASSERT_EQ((int)STATUS_UNSUPPORTED, backend_convert(be, hb, DTYPE_Q8_0, f, DTYPE_F32, 32));
    fx_release();
}

/* ---- thread counts ---- */

/* Each output element is computed by one thread with the same code, so any
 * thread count must give the same result; a bound instead of equality
 * leaves room for a future split of the inner sums. */
TEST(cpu_ops_thread_count_invariance) {
    fx_release();
    static const enum dtype types[] = {DTYPE_F16, DTYPE_Q8_0, DTYPE_Q4_K, DTYPE_Q6_K};
    int64_t rows = 131;
    int32_t n = 19;
    for (int k = 0; k < 4; k++) {
        enum dtype t = types[k];
        int64_t cols = test_cols(t);
        void *w = make_weights(t, rows, cols);
        float *x = rand_floats(n * cols, 1.0f);
        float *outs[3];
        for (int nt = 1; nt <= 3; nt++) {
            backend *be = fx_backend(nt);
            outs[nt - 1] = nan_floats(n * rows);
            struct backend_weight bw;
            ASSERT_OK(backend_weight_load(be, &bw, t, w, rows, cols));
            ASSERT_OK(backend_matmul(be, outs[nt - 1], &bw, x, n));
            backend_weight_free(be, &bw);
        }
        double *ref = fx_alloc((size_t)n * rows * sizeof(double));
        for (int64_t i = 0; i < n * rows; i++) ref[i] = outs[0][i];
        ASSERT_NMSE(outs[1], ref, n * rows, 1e-12);
        ASSERT_NMSE(outs[2], ref, n * rows, 1e-12);
    }
    /* Attention through the same comparison. */
    float *outs[3];
    for (int nt = 1; nt <= 3; nt++) {
        backend *be = fx_backend(nt);
        rng_state = 12345; /* the same case for every thread count */
        struct backend_kv kv;
        ASSERT_OK(backend_kv_init(be, &kv, DTYPE_F16, 10, 16, 2, 32));
        int32_t ntok = 50, tok0[3] = {0, 49, 50}, pos0[2] = {0, 70}, bt[10] = {3, 1, 7, 0, -1, 2, 5, 6, 4, 8};
        float *k = rand_floats(ntok * 64, 1.0f), *v = rand_floats(ntok * 64, 1.0f);
        int32_t *slots = fx_alloc(ntok * sizeof(int32_t));
        for (int32_t i = 0; i < 49; i++) slots[i] = bt[i / 16] * 16 + i % 16;
        slots[49] = bt[5 + 70 / 16] * 16 + 70 % 16;
        ASSERT_OK(backend_kv_write(be, &kv, k, v, slots, ntok));
        /* Sequence 1's history, positions 0..69. */
        float *hist = rand_floats(70 * 64, 1.0f);
        int32_t hslots[70];
        for (int32_t i = 0; i < 70; i++) hslots[i] = bt[5 + i / 16] * 16 + i % 16;
        ASSERT_OK(backend_kv_write(be, &kv, hist, hist, hslots, 70));
        float *q = rand_floats(ntok * 256, 1.0f);
        outs[nt - 1] = nan_floats(ntok * 256);
        struct backend_attn_batch batch = {2, ntok, 5, 71, tok0, pos0, bt};
        ASSERT_OK(backend_attention(be, outs[nt - 1], q, &kv, &batch, 8, 0.17f));
        backend_kv_free(be, &kv);
    }
    double *ref = fx_alloc(50 * 256 * sizeof(double));
    for (int64_t i = 0; i < 50 * 256; i++) ref[i] = outs[0][i];
    ASSERT_NMSE(outs[1], ref, 50 * 256, 1e-12);
    ASSERT_NMSE(outs[2], ref, 50 * 256, 1e-12);

    /* And a chain of row ops on an input large enough to be split. */
    int32_t nr = 96, dim = 1024;
    rng_state = 777;
    float *x0 = rand_floats(nr * dim, 1.0f), *d0 = rand_floats(nr * dim, 1.0f), *w = rand_floats(dim, 1.0f);
    int32_t *pos = fx_alloc((size_t)nr * sizeof(int32_t));
    float inv[32];
    for (int32_t i = 0; i < nr; i++) pos[i] = 3 * i;
    for (int i = 0; i < 32; i++) inv[i] = powf(10000.0f, -(float)i / 32.0f);
    for (int nt = 1; nt <= 3; nt++) {
        backend *be = fx_backend(nt);
        float *x = fx_alloc((size_t)nr * dim * sizeof(float));
        memcpy(x, x0, (size_t)nr * dim * sizeof(float));
        outs[nt - 1] = nan_floats(nr * dim);
        ASSERT_OK(backend_add_rmsnorm(be, x, d0, outs[nt - 1], w, nr, dim, 1e-5f));
        ASSERT_OK(backend_rope(be, outs[nt - 1], pos, nr, 16, 64, inv, 32, 1));
        ASSERT_OK(backend_swiglu(be, outs[nt - 1], outs[nt - 1], x, (int64_t)nr * dim));
    }
    ref = fx_alloc((size_t)nr * dim * sizeof(double));
    for (int64_t i = 0; i < (int64_t)nr * dim; i++) ref[i] = outs[0][i];
    ASSERT_NMSE(outs[1], ref, nr * dim, 1e-12);
    ASSERT_NMSE(outs[2], ref, nr * dim, 1e-12);
    fx_release();
}

/* A token's matmul row is the same bits whether it is alone in a step or
 * one of several (the four-row kernels against the one-row kernel): greedy
 * decoding with speculation, whose steps carry 1 + k tokens, must make the
 * tokens of plain decoding (docs/router.md, "Speculation").  Every type,
 * 9 tokens (two groups of four and one alone) against each token alone. */
TEST(cpu_ops_matmul_batch_invariant) {
    fx_release();
    backend *be = fx_backend(2);
    int64_t rows = 37;
    /* 3, 5: one pass of the several-row kernels (dotn, where a type has
     * one); 7 and 9: fours and then those; with AVX-512VL, F16's rows go
     * in pairs (dot2n) at every count from 2, the pairs' kernel taking 1-5
     * tokens a pass (37 rows: pairs and a row left over in each chunk) */
    static const int32_t ns[] = {2, 3, 5, 7, 9};
    for (int k = 0; k < N_TYPES; k++)
        for (int c = 0; c < (int)(sizeof ns / sizeof ns[0]); c++) {
            enum dtype t = all_types[k];
            int32_t n = ns[c];
            int64_t cols = test_cols(t);
            int mark = fx_n;
            void *w = make_weights(t, rows, cols);
            float *x = rand_floats(n * cols, 1.0f);
            float *all = nan_floats(n * rows), *one = nan_floats(rows);
            struct backend_weight bw;
            ASSERT_OK(backend_weight_load(be, &bw, t, w, rows, cols));
            ASSERT_OK(backend_matmul(be, all, &bw, x, n));
            for (int32_t i = 0; i < n; i++) {
                ASSERT_OK(backend_matmul(be, one, &bw, x + (size_t)i * cols, 1));
                for (int64_t r = 0; r < rows; r++)
                    if (memcmp(&one[r], &all[(size_t)i * rows + r], sizeof(float)) != 0)
                        TEST_FAIL("matmul %s: token %d of %d, row %lld: %.9g in the batch, %.9g alone", dtype_name(t),
                                  i, n, (long long)r, all[(size_t)i * rows + r], one[r]);
            }
            backend_weight_free(be, &bw);
            fx_release_to(mark);
        }
    fx_release();
}

TEST(cpu_ops_mem_info_and_alloc) {
    fx_release();
    backend *be = fx_backend(0);
    size_t fr = 0, tot = 0;
    ASSERT_OK(backend_mem_info(be, &fr, &tot));
    ASSERT_TRUE(tot > 0);
    ASSERT_TRUE(fr <= tot);
    ASSERT_EQ(0, backend_is_gpu(be));
    void *p = backend_alloc(be, 1000);
    ASSERT_TRUE(p != NULL);
    ASSERT_EQ((uintptr_t)0, (uintptr_t)p % 64);
    float src[4] = {1, 2, 3, 4}, dst[4] = {0};
    ASSERT_OK(backend_upload(be, p, src, sizeof src));
    ASSERT_OK(backend_sync(be));
    ASSERT_OK(backend_download(be, dst, p, sizeof dst));
    ASSERT_EQ(3.0f, dst[2]);
    backend_dealloc(be, p);
    fx_release();
}

/* Attention's row kernels (cpu_attn_qk_fn, cpu_attn_v_fn) against their
 * contract: each score bit-equal to the type's dot, the V sum bit-equal to
 * an axpy per position in order; F32 and F16 rows, heads of 40 (a tail
 * past the 8-wide blocks: 5 blocks, no 64), 64, 72 and 128 (two blocks of
 * 64), 1 to 70 positions at scattered addresses. */
TEST(cpu_ops_attention_row_kernels_match_dot_axpy) {
    fx_release();
    cpu_kernels_init();
    const enum dtype types[2] = {DTYPE_F32, DTYPE_F16};
    static const int64_t hds[] = {40, 64, 72, 128};
    static const int32_t ns[] = {1, 7, 70};
    for (int ti = 0; ti < 2; ti++) {
        const struct cpu_type_traits *tr = cpu_type_traits(types[ti]);
        ASSERT_TRUE(tr != NULL);
        if (!tr->attn_qk || !tr->attn_v) {
            printf("  note: %s has no row kernels here (no AVX2)\n", dtype_name(types[ti]));
            continue;
        }
        for (size_t hi = 0; hi < sizeof hds / sizeof hds[0]; hi++)
            for (size_t ni = 0; ni < sizeof ns / sizeof ns[0]; ni++) {
                const int64_t hd = hds[hi];
                const int32_t n = ns[ni];
                const size_t rb = (size_t)hd * (types[ti] == DTYPE_F32 ? 4 : 2);
                /* 2n rows in one buffer, the kernels given every other one in reverse */
                uint8_t *rows = make_weights(types[ti], 2 * n, hd);
                const void **p = fx_alloc((size_t)n * sizeof *p);
                for (int32_t j = 0; j < n; j++) p[j] = rows + (size_t)(2 * (n - 1 - j) + 1) * rb;
                float *q = rand_floats(hd, 1.0f), *s = rand_floats(n, 1.0f);
                float *got = nan_floats(n), *acc = rand_floats(hd, 1.0f), *want = fx_alloc((size_t)hd * 4);
                memcpy(want, acc, (size_t)hd * 4);
                tr->attn_qk(got, p, n, q, hd);
                for (int32_t j = 0; j < n; j++) {
                    float d = tr->dot(p[j], q, hd);
                    if (memcmp(&d, &got[j], 4) != 0)
                        TEST_FAIL("attn_qk %s, head %lld, %d positions: score %d is %.9g, dot gives %.9g",
                                  dtype_name(types[ti]), (long long)hd, n, j, got[j], d);
                }
                tr->attn_v(acc, s, p, n, hd);
                for (int32_t j = 0; j < n; j++) tr->axpy(want, s[j], p[j], hd);
                for (int64_t c = 0; c < hd; c++)
                    if (memcmp(&acc[c], &want[c], 4) != 0)
                        TEST_FAIL("attn_v %s, head %lld, %d positions: element %lld is %.9g, axpy gives %.9g",
                                  dtype_name(types[ti]), (long long)hd, n, (long long)c, acc[c], want[c]);
            }
    }
    fx_release();
}

TEST_MAIN(cpu_ops_matmul_every_dtype, cpu_ops_matmul_batch_invariant, cpu_ops_attention_rows_invariant, cpu_ops_vector_kernels_match_scalar, cpu_ops_matmul_wide_and_narrow, cpu_ops_weight_load_keeps_host_memory,
          cpu_ops_embed_every_dtype, cpu_ops_embed_rejects_bad_id, cpu_ops_rmsnorm, cpu_ops_add_rmsnorm,
          cpu_ops_add_and_swiglu, cpu_ops_get_rows, cpu_ops_rope_both_orders, cpu_ops_rope_orders_differ,
          cpu_ops_kv_write_layout, cpu_ops_kv_write_q8_layout, cpu_ops_attention_f32_cache,
          cpu_ops_attention_f16_cache, cpu_ops_attention_q8_0_cache,
          cpu_ops_attention_rejects_bad_block, cpu_ops_convert, cpu_ops_thread_count_invariance,
          cpu_ops_mem_info_and_alloc, cpu_ops_attention_row_kernels_match_dot_axpy)
