/* Tests of the CPU backend's KV cache and attention (tests/kernels/
 * cpu_ops_fixture.h says how they check): the cache layouts kv_write fills
 * (F32 and the 8-bit rows), attention over F32, F16 and Q8_0 caches against
 * a double reference of the values the cache stores, a row's output the
 * same bits alone or with others of its step, a bad block rejected, and
 * the row kernels (scores, V sums) against the type's dot and axpy. */
#include "tests/kernels/cpu_ops_fixture.h"

#include "kernels/cpu/cpu.h" /* the row kernels, to test them against dot and axpy */

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
    struct backend_attn_batch batch = {S, n_tokens, max_blocks, max_ctx, tok0, pos0, bt, 0, 0};
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
        struct backend_attn_batch batch = {1, R, 4, n, tok0, &pos0, bt, R, R};
        ASSERT_OK(backend_attention(be, all, q, &kv, &batch, nh, 0.125f));
        for (int32_t r = 0; r < R; r++) {
            int32_t t1[2] = {0, 1}, p1 = pos + r;
            struct backend_attn_batch b1 = {1, 1, 4, p1 + 1, t1, &p1, bt, 1, 1};
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
    struct backend_attn_batch batch = {1, 1, 2, 6, tok0, pos0, bt, 1, 1};
    float *q = rand_floats(8, 1.0f), *out = nan_floats(8);
    ASSERT_EQ((int)STATUS_BAD_INPUT, backend_attention(be, out, q, &kv, &batch, 1, 1.0f));
    ASSERT_TRUE(strstr(backend_errstr(be), "block") != NULL);
    backend_kv_free(be, &kv);
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

TEST_MAIN(cpu_ops_attention_rows_invariant, cpu_ops_kv_write_layout, cpu_ops_kv_write_q8_layout,
          cpu_ops_attention_f32_cache, cpu_ops_attention_f16_cache, cpu_ops_attention_q8_0_cache,
          cpu_ops_attention_rejects_bad_block, cpu_ops_attention_row_kernels_match_dot_axpy)
