/* Tests of the CUDA backend's KV cache writes and attention kernels
 * against the CPU backend (tests/kernels/cuda_ops_fixture.h says how):
 * F32, F16 and Q8_0 caches, prefill chunks and decode rows, every kernel
 * the routing can take and the matmuls that read their output. */
#include "cuda_ops_fixture.h"

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
 * (attention.cu, attention_prefill.cu and, from 5 rows, rope_attention.cu,
 * for cuBLAS, matmul_wide and
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
    struct backend_attn_batch cb = {n_seqs, n_tokens, max_blocks, max_ctx, d0.c, dp.c, dt.c, 0, 0};
    struct backend_attn_batch gb = {n_seqs, n_tokens, max_blocks, max_ctx, d0.g, dp.g, dt.g, 0, 0};
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
    /* Ungrouped heads in blocks of 4 warps where they would take 8
     * (LLM_CUDA_ATT_WIDE=0; above, 4 rows of 32 heads took 8 and 40 rows
     * 4). */
    setenv("LLM_CUDA_ATT_WIDE", "0", 1);
    fx_open();
    attention_case(DTYPE_F16, 32, 32, 128, 16, 4, ones, p1);
    attention_case(DTYPE_F16, 8, 8, 64, 16, 3, ones, p3);
    fx_close();
    unsetenv("LLM_CUDA_ATT_WIDE");
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

/* Decode rows, one a sequence, for the grouped-head tests. */
static const int32_t gqa_ones[48] = {1, 1, 1, 1, 1, 1, 1, 1, 1, 1, 1, 1, 1, 1, 1, 1, 1, 1, 1, 1, 1, 1, 1, 1,
                                     1, 1, 1, 1, 1, 1, 1, 1, 1, 1, 1, 1, 1, 1, 1, 1, 1, 1, 1, 1, 1, 1, 1, 1};

/* Groups of 4 on a t cache in a fixture of their own: 48 rows of their
 * own lengths, then a prefill row among decodes. */
static void gqa_many_rows(enum dtype t) {
    fx_open();
    int32_t p4[48];
    for (int i = 0; i < 48; i++) p4[i] = rng_int(700);
    attention_case(t, 32, 8, 128, 16, 48, gqa_ones, p4); /* many rows */
    static const int32_t lens[] = {1, 9, 1, 1};
    static const int32_t p5[] = {40, 0, 300, 7};
    attention_case(t, 32, 8, 128, 16, 4, lens, p5); /* a prefill row among decodes */
    fx_close();
}

/* attention_gqa.cu (decode rows of 2-16 query heads a KV head, tensor
 * cores): groups of 2, 4, 8, 12 and 16 with heads of 64 and 128, rows at
 * position 0 and at block edges, splits of one long row merged, many rows,
 * blocks of 16 and 32; a prefill row beside them (a mixed batch: its
 * one-row sequences here, the other on the prefill kernel); and the T4's
 * mma (two m16n8k8) through LLM_CUDA_ATT_K8's routing is the sm_75 build's
 * own (scripts/gpu-check.sh t4).  Each with the steps in registers and
 * through cp.async rings of 2 and 3 stages from one row
 * (LLM_CUDA_ATT_RING, LLM_CUDA_ATT_RING_ROWS=1; sm_80+, elsewhere the
 * registers again), then the many rows routed by default (on an H200 the
 * two-stage ring for their 384 blocks: LLM_CUDA_ATT_RING_SHALLOW). */
TEST(cuda_ops_attention_gqa) {
    unsetenv("LLM_CUDA_ATT_GQA_MIN");
    static const char *const rings[] = {"0", "2", "3"};
    setenv("LLM_CUDA_ATT_RING_ROWS", "1", 1);
    setenv("LLM_CUDA_ATT_RING_SHALLOW", "false", 1);
    for (int r = 0; r < 3; r++) {
        setenv("LLM_CUDA_ATT_RING", rings[r], 1);
        fx_open(); /* at most 4 KV caches a fixture */
        static const int32_t p1[] = {0, 5, 100, 300, 1023};
        attention_case(DTYPE_F16, 32, 8, 128, 16, 5, gqa_ones, p1);  /* groups of 4 (Llama 3) */
        attention_case(DTYPE_F16, 32, 16, 128, 16, 5, gqa_ones, p1); /* groups of 2 */
        attention_case(DTYPE_F16, 32, 4, 128, 16, 5, gqa_ones, p1);  /* groups of 8 */
        fx_close();
        fx_open();
        attention_case(DTYPE_F16, 48, 4, 64, 16, 5, gqa_ones, p1); /* groups of 12 */
        attention_case(DTYPE_F16, 32, 2, 64, 32, 5, gqa_ones, p1); /* groups of 16, blocks of 32 */
        static const int32_t p2[] = {15, 16, 17, 63, 64, 65};
        attention_case(DTYPE_F16, 28, 4, 128, 16, 6, gqa_ones, p2); /* groups of 7 */
        static const int32_t p3[] = {4000};
        attention_case(DTYPE_F16, 32, 8, 128, 16, 1, gqa_ones, p3); /* one long row: many splits */
        fx_close();
        gqa_many_rows(DTYPE_F16);
    }
    unsetenv("LLM_CUDA_ATT_RING");
    unsetenv("LLM_CUDA_ATT_RING_ROWS");
    unsetenv("LLM_CUDA_ATT_RING_SHALLOW");
    gqa_many_rows(DTYPE_F16);
}

/* The 8-bit cache's grouped-head cases (cuda_ops_attention_gqa_q8_0). */
static void gqa_q8_cases(void) {
    static const int32_t p1[] = {0, 5, 100, 300, 1023};
    fx_open();
    attention_case(DTYPE_Q8_0, 32, 8, 128, 16, 5, gqa_ones, p1);  /* groups of 4 (Llama 3) */
    attention_case(DTYPE_Q8_0, 32, 16, 128, 32, 5, gqa_ones, p1); /* groups of 2, blocks of 32 */
    attention_case(DTYPE_Q8_0, 32, 4, 64, 16, 5, gqa_ones, p1);   /* groups of 8, heads of 64 */
    attention_case(DTYPE_Q8_0, 32, 8, 128, 8, 5, gqa_ones, p1);   /* blocks of 8: attention_q8.cu */
    fx_close();
    fx_open();
    attention_case(DTYPE_Q8_0, 48, 4, 128, 16, 5, gqa_ones, p1); /* groups of 12 */
    static const int32_t p2[] = {15, 16, 17, 63, 64, 65};
    attention_case(DTYPE_Q8_0, 32, 2, 64, 16, 6, gqa_ones, p2); /* groups of 16 */
    static const int32_t p3[] = {4000};
    attention_case(DTYPE_Q8_0, 32, 8, 128, 16, 1, gqa_ones, p3); /* one long row: many splits */
    fx_close();
    gqa_many_rows(DTYPE_Q8_0);
}

/* attention_gqa.cu over an 8-bit cache: groups of 2, 4, 8, 12 and 16,
 * heads of 128 (two groups of 64 a row) and 64 (two of 32), blocks of 16
 * and 32, rows at block edges, one long row split, many rows, a prefill
 * row among decodes; blocks of 8 positions stay on attention_q8.cu (the
 * F32 bound: its arithmetic is the CPU's).  Each with the steps through
 * registers and through cp.async rings of 2 and 3 stages at every row
 * count (LLM_CUDA_ATT_Q8_RING_MAX; sm_80+, elsewhere the registers again),
 * then routed by default. */
TEST(cuda_ops_attention_gqa_q8_0) {
    unsetenv("LLM_CUDA_ATT_GQA_MIN");
    static const char *const rings[] = {"0", "2", "3"};
    setenv("LLM_CUDA_ATT_Q8_RING_MAX", "100000", 1);
    for (int r = 0; r < 3; r++) {
        setenv("LLM_CUDA_ATT_RING", rings[r], 1);
        gqa_q8_cases();
    }
    unsetenv("LLM_CUDA_ATT_RING");
    unsetenv("LLM_CUDA_ATT_Q8_RING_MAX");
    gqa_q8_cases(); /* the default routing: the ring where the rows fit one wave */
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

/* ---- Rope, cache write and attention in one op ----
 * The CPU runs rope_kv_write and attention; the GPU, for decode rows (one
 * a sequence) and an F16 cache with heads of 64 or 128, one launch
 * (rope_attention.cu, up to LLM_CUDA_ROPE_ATT rows: 16 here), and for
 * sequences of 2-16 rows the tensor-core attention with the rope in it
 * (attention_prefill.cu), both of which rotate q and k in registers and
 * leave the buffers as given: so its q must come back unchanged where one
 * of them takes the case (a silent fallback would rotate it), and rotated
 * like the CPU's where neither does. */
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
    /* Sequences of 2-16 rows: the grouped-heads kernel (rows x group at
     * most 16) or the tensor-core attention (groups of a power of two;
     * every group with LLM_CUDA_ROPE_GQA=0) with the rope and the cache
     * write in it (LLM_CUDA_ROPE_TC), where every dim rotates. */
    const char *gqa_env = getenv("LLM_CUDA_ROPE_GQA");
    const int G = c->n_heads / c->n_kv, gqa = (!gqa_env || strcmp(gqa_env, "0") != 0) && R * G <= 16;
    const int fused_tc =
        R >= 2 && R <= 16 && c->kv == DTYPE_F16 && 2 * c->n_freq == hd && (gqa || (G & (G - 1)) == 0);
    struct att_mm mm = {0};
    if (fused || fused_tc) att_mm_prepare(&mm, n, qw); /* the int8 (up to 4 rows) or F16 form it leaves */
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
    struct backend_attn_batch cb = {S, n, max_blocks, max_ctx, d0.c, dp0.c, dt.c, R, R};
    struct backend_attn_batch gb = {S, n, max_blocks, max_ctx, d0.g, dp0.g, dt.g, R, R};
    const float scale = 1.0f / sqrtf((float)hd);
    const int i = fx.n_kv - 1;
    ASSERT_OK(backend_rope_kv_attention(fx.cpu, out.c, q.c, k.c, v.c, &fx.ckv[i], dp.c, ds.c, di.c, c->n_freq,
                                        c->neox, &cb, c->n_heads, scale));
    int rc = backend_rope_kv_attention(fx.gpu, out.g, q.g, k.g, v.g, &fx.gkv[i], dp.g, ds.g, di.g, c->n_freq,
                                       c->neox, &gb, c->n_heads, scale);
    if (rc != STATUS_OK) TEST_FAIL("gpu rope_kv_attention: %s", backend_errstr(fx.gpu));
    char what[200];
    snprintf(what, sizeof what,
             "rope_kv_attention %s cache, %d/%d heads x %d, %d seqs x %d rows from %d, neox %d, %d freqs, "
             "LLM_CUDA_ATT_DEFER=%s LLM_CUDA_ROPE_GQA=%s",
             dtype_name(c->kv), c->n_heads, c->n_kv, hd, S, R, c->pos, c->neox, c->n_freq,
             getenv("LLM_CUDA_ATT_DEFER") ? getenv("LLM_CUDA_ATT_DEFER") : "(unset)", gqa_env ? gqa_env : "(unset)");
    if (mm.n) att_mm_check(&mm, out, n, what);
    float *qg = fx_host((size_t)n * qw * 4);
    ASSERT_OK(backend_download(fx.gpu, qg, q.g, (size_t)n * qw * 4));
    if ((fused || fused_tc) && memcmp(qg, qh, (size_t)n * qw * 4) != 0)
        TEST_FAIL("%s: q was rotated in place: not one launch", what);
    if (!fused && !fused_tc) check_f32(q, (size_t)n * qw, 1e-12, what);
    /* One launch: F32 arithmetic on the same cache values as the CPU, the
     * slices merged in another order, exp off by ulps (~1e-12).  One
     * position too many or too few moves a row by ~1/context of its size:
     * NMSE >= 1e-7 up to 3000 positions.  The two ops: attention's own
     * bounds (cuda_ops_attention_*; tensor cores round to F16). */
    /* Q8_0: a new k a last bit apart after rope may round to the next
     * int8 (kernels: rope_kv_case), which moves a score by ~1e-3 of the
     * value: 1e-6. */
    const double bound = fused_tc || (!fused && attn_on_tensor_cores(c->kv, c->n_heads, c->n_kv, hd, bs, n, S)) ? 1e-4
                         : c->kv == DTYPE_Q8_0                                               ? 1e-6
                                                                                             : 1e-8;
    double e = check_f32(out, (size_t)n * qw, bound, what);
    /* The caches, every slot: the new k rotated as rope rotates it (one F16
     * rounding may differ where the products round differently). */
    const size_t elems = (size_t)n_blocks * bs * c->n_kv * hd;
    const double cache_bound = c->kv == DTYPE_F32 ? 1e-12 : c->kv == DTYPE_Q8_0 ? 1e-6 : 1e-7;
    check_cache(c->kv, fx.ckv[i].k, fx.gkv[i].k, elems, cache_bound, what);
    check_cache(c->kv, fx.ckv[i].v, fx.gkv[i].v, elems, cache_bound, what);
    printf("    %s%s: NMSE %.3g\n", what, fused ? " (one launch)" : fused_tc ? " (tensor cores with the rope)" : "", e);
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
        /* Cases the one launch leaves to the two ops: an F32 cache, more
         * rows than it takes. */
        {DTYPE_F32, 8, 2, 64, 300, 32, 1, 1, 1},
        {DTYPE_F16, 4, 2, 64, 10, 32, 0, 17, 1},
        /* Sequences of several rows (verifying steps), on the tensor-core
         * kernel with the rope: 2 rows; MHA 5 rows (pairs (2i, 2i + 1));
         * 5 rows at 600 positions (split), neox; 3 sequences of 4 rows,
         * groups of 4; groups of 8 (a tile is 8 rows: the sequence's
         * first tile reads its new rows, its last writes them); the first
         * positions. */
        {DTYPE_F16, 8, 2, 64, 300, 32, 0, 1, 2},
        {DTYPE_F16, 4, 4, 128, 37, 64, 0, 1, 5},
        {DTYPE_F16, 8, 8, 128, 600, 64, 1, 1, 5},
        {DTYPE_F16, 8, 2, 128, 513, 64, 1, 3, 4},
        {DTYPE_F16, 16, 2, 64, 200, 32, 0, 2, 16},
        {DTYPE_F16, 4, 4, 64, 0, 32, 1, 1, 3},
        /* ... on the grouped-heads kernel, rows x group at most 16: a 7B's
         * 5 rows (split); groups of 3, 5 rows (mma rows 8-14, neox); 16
         * rows of MHA at 3000 positions; 2 sequences of 8 rows, groups of
         * 2.  Left to the tensor-core kernel: an 8B's 5 rows (groups of
         * 4) at 2040 positions; groups of 16, 3 rows; and groups of 3, 7
         * rows, to the two ops. */
        {DTYPE_F16, 32, 32, 128, 511, 64, 0, 1, 5},
        {DTYPE_F16, 12, 4, 64, 250, 32, 1, 2, 5},
        {DTYPE_F16, 4, 4, 128, 3000, 64, 1, 1, 16},
        {DTYPE_F16, 8, 4, 128, 77, 64, 0, 2, 8},
        {DTYPE_F16, 32, 8, 128, 2040, 64, 0, 1, 5},
        {DTYPE_F16, 16, 1, 64, 40, 32, 0, 2, 3},
        {DTYPE_F16, 12, 4, 64, 250, 32, 1, 1, 7},
        /* ... and those it leaves to the two ops: 17 rows, a partial
         * rotation. */
        {DTYPE_F16, 4, 4, 128, 95, 64, 0, 1, 17},
        {DTYPE_F16, 8, 2, 64, 300, 24, 1, 1, 4},
        /* An 8-bit cache: always the two ops (rope_kv_write, attention). */
        {DTYPE_Q8_0, 8, 2, 64, 300, 32, 1, 1, 1},
        {DTYPE_Q8_0, 4, 4, 128, 130, 64, 0, 4, 1},
    };
    /* The slices merged by a kernel of their own up to 4 rows (the
     * default), and by the attention's last blocks, which then leave the
     * o matmul's int8 form at 1-2 rows. */
    setenv("LLM_CUDA_ROPE_ATT", "16", 1);
    static const char *const defer[] = {"4", "0"};
    for (int d = 0; d < 2; d++) {
        setenv("LLM_CUDA_ATT_DEFER", defer[d], 1);
        for (size_t c = 0; c < sizeof cases / sizeof cases[0]; c++) rope_attention_case(&cases[c]);
    }
    unsetenv("LLM_CUDA_ATT_DEFER");
    /* Sequences of several rows on attention_prefill.cu's kernel. */
    setenv("LLM_CUDA_ROPE_GQA", "0", 1);
    for (size_t c = 0; c < sizeof cases / sizeof cases[0]; c++)
        if (cases[c].rows_per_seq > 1) rope_attention_case(&cases[c]);
    unsetenv("LLM_CUDA_ROPE_GQA");
    unsetenv("LLM_CUDA_ROPE_ATT");
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

TEST_MAIN(cuda_ops_kv_write_f32, cuda_ops_kv_write_f16, cuda_ops_kv_write_q8_0, cuda_ops_rope_kv_write,
          cuda_ops_attention_gqa_f32, cuda_ops_attention_gqa_f16, cuda_ops_attention_q8_0,
          cuda_ops_attention_shapes, cuda_ops_attention_decode, cuda_ops_attention_gqa,
          cuda_ops_attention_gqa_q8_0, cuda_ops_attention_prefill, cuda_ops_attention_mixed,
          cuda_ops_rope_kv_attention, cuda_ops_attention_q8_0_decode, cuda_ops_attention_q8_0_prefill)
