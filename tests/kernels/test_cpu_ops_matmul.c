/* Tests of the CPU backend's matmul (tests/kernels/cpu_ops_fixture.h says
 * how they check): every weight dtype against a double reference, wide and
 * narrow shapes, a weight loaded in place; the AVX2 dot, axpy and four-row
 * kernels against the portable ones; and the bits that must not depend on
 * how work is split: any thread count (matmul, then attention and a chain
 * of row ops) and a token alone or in a batch.  Attention and the row ops
 * are tested in test_cpu_ops_attention.c and test_cpu_ops_rows.c. */
#include "tests/kernels/cpu_ops_fixture.h"

#include "kernels/cpu/cpu.h" /* the kernel variants, to test the portable ones too */

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
        struct backend_attn_batch batch = {2, ntok, 5, 71, tok0, pos0, bt, 0, 0};
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

TEST_MAIN(cpu_ops_matmul_every_dtype, cpu_ops_matmul_batch_invariant, cpu_ops_vector_kernels_match_scalar,
          cpu_ops_matmul_wide_and_narrow, cpu_ops_weight_load_keeps_host_memory,
          cpu_ops_thread_count_invariance)
