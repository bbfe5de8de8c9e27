/* Tests of the CUDA backend's row ops and matmuls against the CPU
 * backend (tests/kernels/cuda_ops_fixture.h says how): basics, norms,
 * rope, conversion, embedding and matmul of every dtype on every path the
 * routing can take, fused matmuls; the KV cache and attention are
 * test_cuda_attention.c's. */
#include "cuda_ops_fixture.h"

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
        int rc = backend_rmsnorm(fx.gpu, out.g, x.g, w.g, n, dim, 1e-5f);
        if (rc != STATUS_OK) TEST_FAIL("gpu rmsnorm dim %d: %s", dim, backend_errstr(fx.gpu));
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
        int rc = backend_add_rmsnorm(fx.gpu, x.g, dl.g, out.g, w.g, n, dim, 1e-6f);
        if (rc != STATUS_OK) TEST_FAIL("gpu add_rmsnorm dim %d: %s", dim, backend_errstr(fx.gpu));
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
 * (8, 16, 32, 64 tokens) and one past each edge, then the prefill path's
 * (dequantized tiles and cuBLAS) at 65, 129 and 256; widths of one chunk,
 * of several (split K over blocks, partial sums added by the last block)
 * and, for the 32-element types, a partial last chunk (352 = 256 + 3 x
 * 32). */
static void matmul_type(enum dtype t) {
    static const int32_t ns[] = {1, 5, 8, 9, 16, 17, 32, 33, 64, 65, 129, 256};
    const int n_ns = (int)(sizeof ns / sizeof ns[0]);
    int k_quant = t == DTYPE_Q4_K || t == DTYPE_Q5_K || t == DTYPE_Q6_K;
    for (int m = MM_DEFAULT; m <= MM_SKINNY; m++) {
        mm_set_mode((enum mm_mode)m);
        fx_open();
        matmul_case(t, 100, 512, ns, n_ns);
        matmul_case(t, 35, 768, ns, 4); /* rows not a multiple of the rows per block */
        if (!k_quant) matmul_case(t, 130, 352, ns, n_ns);
        matmul_case(t, 300, 256, ns, n_ns); /* one chunk: no split */
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

/* Once matmul_mmq.cu has run, a norm of 3-16 rows also leaves its Q8K8
 * form at the top of the scratch (rmsnorm.cu) beside the F16 form: q and k
 * (4096 rows each of 2560, Q4_K: one matmul_mmq.cu group by the default
 * routing at every token count here)
 * then read the first and v (1024 rows, Q6_K: matmul_mr.cu to 16 rows,
 * matmul_wide.cu or mq above) the second, the group's partial sums placed
 * between them (40 rows: the group quantizes its input itself).  Against
 * the CPU through add_rmsnorm and rmsnorm (the input changed under the same
 * pointer), and the same bits as matmul_mmq.cu quantizing a copy of the
 * norm's output itself. */
TEST(cuda_ops_rmsnorm_feeds_matmul_mmq) {
    mm_set_mode(MM_DEFAULT);
    fx_open();
    const int64_t dim = 2560, rows[3] = {4096, 4096, 1024};
    const enum dtype types[3] = {DTYPE_Q4_K, DTYPE_Q4_K, DTYPE_Q6_K};
    int wi[3];
    for (int j = 0; j < 3; j++) wi[j] = load_weight(types[j], rand_weight(types[j], rows[j], dim), rows[j], dim);
    const int32_t ns[5] = {3, 5, 12, 16, 40};
    for (int ni = 0; ni < 5; ni++) {
        const int32_t n = ns[ni];
        struct dbuf x = dbuf_from(rand_f32((size_t)n * dim, -2, 2), (size_t)n * dim * 4);
        struct dbuf dl = dbuf_from(rand_f32((size_t)n * dim, -1, 1), (size_t)n * dim * 4);
        struct dbuf w1 = dbuf_from(rand_f32(dim, 0.5f, 1.5f), (size_t)dim * 4);
        struct dbuf w2 = dbuf_from(rand_f32(dim, 0.1f, 3.0f), (size_t)dim * 4);
        struct dbuf xn = dbuf_new((size_t)n * dim * 4), xc = dbuf_new((size_t)n * dim * 4);
        struct dbuf out[3];
        float *co[3], *go[3];
        const struct backend_weight *cw[3], *gw[3];
        for (int j = 0; j < 3; j++) {
            out[j] = dbuf_new((size_t)n * rows[j] * 4);
            co[j] = out[j].c;
            go[j] = out[j].g;
            cw[j] = &fx.cw[wi[j]];
            gw[j] = &fx.gw[wi[j]];
        }
        float *first = fx_host((size_t)n * rows[0] * 4), *again = fx_host((size_t)n * rows[0] * 4);
        for (int round = 0; round < 3; round++) {
            for (int j = 0; j < 3; j++) dbuf_poison(out[j]);
            if (round == 1) {
                ASSERT_OK(backend_rmsnorm(fx.cpu, xn.c, x.c, w2.c, n, (int32_t)dim, 1e-6f));
                ASSERT_OK(backend_rmsnorm(fx.gpu, xn.g, x.g, w2.g, n, (int32_t)dim, 1e-6f));
            } else { /* round 0 runs matmul_mmq.cu for the first time in this backend (n = 3) */
                ASSERT_OK(backend_add_rmsnorm(fx.cpu, x.c, dl.c, xn.c, w1.c, n, (int32_t)dim, 1e-6f));
                ASSERT_OK(backend_add_rmsnorm(fx.gpu, x.g, dl.g, xn.g, w1.g, n, (int32_t)dim, 1e-6f));
            }
            ASSERT_OK(backend_matmul_multi(fx.cpu, 3, co, cw, xn.c, n));
            int rc = backend_matmul_multi(fx.gpu, 3, go, gw, xn.g, n);
            if (rc != STATUS_OK) TEST_FAIL("gpu matmul_multi n=%d: %s", n, backend_errstr(fx.gpu));
            for (int j = 0; j < 3; j++) {
                char what[128];
                snprintf(what, sizeof what, "%s [%lld x %lld] after %s, n=%d, round %d", dtype_name(types[j]),
                         (long long)rows[j], (long long)dim, round == 1 ? "rmsnorm" : "add_rmsnorm", n, round);
                check_f32(out[j], (size_t)n * rows[j], matmul_bound(types[j]), what);
            }
            /* q alone on a copy of the norm's output: quantized by matmul_mmq.cu itself. */
            ASSERT_OK(backend_download(fx.gpu, first, out[0].g, (size_t)n * rows[0] * 4));
            ASSERT_OK(backend_copy(fx.gpu, xc.g, xn.g, (size_t)n * dim * 4));
            const struct backend_weight *qk[2] = {gw[0], gw[1]};
            float *qo[2] = {out[0].g, out[1].g};
            ASSERT_OK(backend_matmul_multi(fx.gpu, 2, qo, qk, xc.g, n));
            ASSERT_OK(backend_download(fx.gpu, again, out[0].g, (size_t)n * rows[0] * 4));
            if (memcmp(first, again, (size_t)n * rows[0] * 4) != 0)
                TEST_FAIL("n=%d round %d: q from the norm's int8 form differs from q quantized by the matmul", n,
                          round);
        }
    }
    fx_close();
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
    multi_case(mixed, qkv, 3, 1024); /* one launch of two types: 1-2 tokens gemv, 3-16 matmul_mr */
    multi_case(mixed5, qkv, 3, 512);
    setenv("LLM_CUDA_MR_MIXED", "false", 1); /* 3-16 tokens: a matmul_mr launch per type */
    multi_case(mixed, qkv, 3, 1024);
    unsetenv("LLM_CUDA_MR_MIXED");
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
static void big_case(enum dtype t, int64_t rows, int64_t cols, const int32_t *ns, int n_ns) {
    fx_open(); /* a fixture per case: the host buffers of a case add up */
    int wi = load_weight(t, rand_weight(t, rows, cols), rows, cols);
    struct dbuf x = dbuf_from(rand_f32((size_t)64 * cols, -1, 1), (size_t)64 * cols * 4);
    struct dbuf out = dbuf_new((size_t)64 * rows * 4);
    for (int i = 0; i < n_ns; i++) {
        const int32_t n = ns[i];
        const size_t elems = (size_t)n * rows;
        dbuf_poison(out);
        ASSERT_OK(backend_matmul(fx.cpu, out.c, &fx.cw[wi], x.c, n));
        int rc = backend_matmul(fx.gpu, out.g, &fx.gw[wi], x.g, n);
        if (rc != STATUS_OK) TEST_FAIL("gpu matmul %s n=%d: %s", dtype_name(t), n, backend_errstr(fx.gpu));
        char what[160];
        snprintf(what, sizeof what,
                 "matmul %s [%lld x %lld] n=%d, LLM_CUDA_WIDE=%s LLM_CUDA_WIDE_ITEMS=%s LLM_CUDA_MMQ_DEPTH=%s",
                 dtype_name(t), (long long)rows, (long long)cols, n, getenv("LLM_CUDA_WIDE") ? "0" : "(unset)",
                 getenv("LLM_CUDA_WIDE_ITEMS") ? "0" : "(unset)",
                 getenv("LLM_CUDA_MMQ_DEPTH") ? getenv("LLM_CUDA_MMQ_DEPTH") : "(unset)");
        check_f32(out, elems, matmul_bound(t), what);
        float *first = fx_host(elems * 4), *again = fx_host(elems * 4);
        ASSERT_OK(backend_download(fx.gpu, first, out.g, elems * 4));
        ASSERT_OK(backend_matmul(fx.gpu, out.g, &fx.gw[wi], x.g, n));
        ASSERT_OK(backend_download(fx.gpu, again, out.g, elems * 4));
        if (memcmp(first, again, elems * 4) != 0) TEST_FAIL("%s: a second run gave other bits", what);
    }
    fx_close();
}

/* 16-64 tokens, where matmul_wide.cu and matmul_mmq.cu split the work. */
static void wide_case(enum dtype t, int64_t rows, int64_t cols) {
    static const int32_t ns[] = {16, 17, 32, 33, 48, 64};
    big_case(t, rows, cols, ns, (int)(sizeof ns / sizeof ns[0]));
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
    setenv("LLM_CUDA_MMQ_TILE", "0", 1); /* Q4_K at 49-64 too on the kernels below, until its own cases */
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
    /* Q4_K and Q5_K at 3-8 tokens load two chunks ahead in three register
     * sets taking turns (LLM_CUDA_MMQ_DEPTH=2, default; 9 and 16 tokens
     * the plain kernel), against one (1): splits of 4, 4 and 2 chunks
     * (8192 x 2560) and of 4 (4096 x 5120), so the loop unrolled by three
     * ends after each of its steps. */
    static const int32_t small[] = {3, 5, 8, 9, 16};
    for (int d = 0; d < 2; d++) {
        if (d) setenv("LLM_CUDA_MMQ_DEPTH", "1", 1);
        big_case(DTYPE_Q4_K, 8192, 2560, small, 5);
        big_case(DTYPE_Q5_K, 4096, 5120, small, 5);
    }
    unsetenv("LLM_CUDA_MMQ_DEPTH");
    /* Other tiles a warp (LLM_CUDA_MMQ_TILES): up to 8 blocks side by
     * side on one row block, or 6 and 8 tiles a warp (33-64 tokens in one
     * block), with and without a K split. */
    static const char *const tiles[] = {"1", "2", "3", "8"};
    for (int k = 0; k < 4; k++) {
        setenv("LLM_CUDA_MMQ_TILES", tiles[k], 1);
        wide_case(DTYPE_Q4_K, 4200, 4096);
        wide_case(DTYPE_Q6_K, 517, 11008);
        big_case(DTYPE_Q5_K, 4096, 5120, small, 5);
    }
    unsetenv("LLM_CUDA_MMQ_TILES");
    /* Q4_K's 32 x 32 warp tiles (LLM_CUDA_MMQ_TILE=1: from one token; on
     * sm_75 the knob is ignored and these run the kernels above): partial
     * last row blocks, one chunk and K split over blocks, groups, gate and
     * up. */
    setenv("LLM_CUDA_MMQ_TILE", "1", 1);
    static const int32_t tile_ns[] = {1, 9, 17, 33, 40, 47, 57, 63, 64};
    fx_open();
    matmul_case(DTYPE_Q4_K, 100, 512, tile_ns, 9);
    matmul_case(DTYPE_Q4_K, 300, 256, tile_ns, 9);
    fx_close();
    wide_case(DTYPE_Q4_K, 4200, 4096);
    multi_case(q4k, qkv, 3, 768);
    multi_case(mixed, qkv, 3, 1024);
    swiglu_case(DTYPE_Q4_K, 299, 768);
    unsetenv("LLM_CUDA_MMQ_TILE");
    unsetenv("LLM_CUDA_MMQ_MIN");
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

TEST_MAIN(cuda_ops_identity_and_memory, cuda_ops_upload_copy_download, cuda_ops_rmsnorm, cuda_ops_add_rmsnorm,
          cuda_ops_add_swiglu, cuda_ops_get_rows, cuda_ops_rope_both_orders, cuda_ops_convert,
          cuda_ops_embed_every_dtype, cuda_ops_matmul_f32, cuda_ops_matmul_f16, cuda_ops_matmul_bf16,
          cuda_ops_matmul_q8_0, cuda_ops_matmul_q4_0, cuda_ops_matmul_q4_1, cuda_ops_matmul_q5_0,
          cuda_ops_matmul_q5_1, cuda_ops_matmul_q4_k, cuda_ops_matmul_q5_k, cuda_ops_matmul_q6_k,
          cuda_ops_matmul_odd_width_and_tiles, cuda_ops_matmul_tiles_made_ahead,
          cuda_ops_out_of_memory_fails_the_op_not_the_backend, cuda_ops_matmul_reuses_input_safely,
          cuda_ops_matmul_gemv_q8_0, cuda_ops_matmul_gemv_q4_0, cuda_ops_matmul_gemv_q4_k,
          cuda_ops_matmul_gemv_q5_k, cuda_ops_matmul_gemv_q6_k, cuda_ops_rmsnorm_feeds_matmul,
          cuda_ops_rmsnorm_feeds_matmul_mmq, cuda_ops_matmul_multi, cuda_ops_matmul_swiglu, cuda_ops_matmul_wide,
          cuda_ops_matmul_mmq,
          cuda_ops_matmul_mq64_sm75)
