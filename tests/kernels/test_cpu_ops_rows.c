/* Tests of the CPU backend's row and element ops (tests/kernels/
 * cpu_ops_fixture.h says how they check): embed from weights of every
 * dtype and a bad id rejected; rmsnorm, add_rmsnorm, add, swiglu and
 * get_rows; rope in both pairings (and a check that the two differ);
 * convert between F32, F16 and BF16; and the memory calls (mem_info,
 * alloc, upload, download). */
#include "tests/kernels/cpu_ops_fixture.h"

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

TEST_MAIN(cpu_ops_embed_every_dtype, cpu_ops_embed_rejects_bad_id, cpu_ops_rmsnorm, cpu_ops_add_rmsnorm,
          cpu_ops_add_and_swiglu, cpu_ops_get_rows, cpu_ops_rope_both_orders, cpu_ops_rope_orders_differ,
          cpu_ops_convert, cpu_ops_mem_info_and_alloc)
