/* Tests for kernels/cuda/knobs: the LLM_CUDA_* table's defaults and the
 * routing they give a card, the spellings scripts and tests use, bad values
 * as errors that name the variable and the value, and the table against
 * docs/configuration.md.  No GPU needed: the table is plain C. */
#include "common/status.h"
#include "kernels/cuda/cuda_ops.h"
#include "kernels/cuda/knobs.h"
#include "tests/test.h"

#include <stdio.h>
#include <stdlib.h>
#include <string.h>

static void k_clear_env(void) {
    struct cuda_knobs k;
    struct option_def defs[CUDA_KNOBS_N];
    const int n = cuda_knobs_table(&k, defs);
    for (int i = 0; i < n; i++) unsetenv(defs[i].env);
}

/* The routing for a card of compute capability cc with n_sms
 * multiprocessors under the present environment. */
static struct cuda_ctx k_ctx(int cc, int n_sms) {
    struct cuda_ctx ctx;
    memset(&ctx, 0, sizeof ctx);
    ctx.cc = cc;
    ctx.n_sms = n_sms;
    struct cuda_knobs k;
    char err[256];
    int rc = cuda_knobs_read(&k, err, sizeof err);
    if (rc != STATUS_OK) TEST_FAIL("cuda_knobs_read: %s", err);
    rc = cuda_knobs_apply(&k, &ctx, err, sizeof err);
    if (rc != STATUS_OK) TEST_FAIL("cuda_knobs_apply: %s", err);
    return ctx;
}

/* matmul_mmq.cu's least rows up to 16 tokens and elements (rows x cols)
 * at 17-32 and 33-64. */
#define MMQ_ELEMS ((int64_t)20 << 20)
static int k_mmq_sizes(const struct cuda_ctx *c, int rows, int64_t e_mid, int64_t e_wide) {
    return c->mmq_rows == rows && c->mmq_elems[0] == e_mid && c->mmq_elems[1] == e_wide;
}

/* Nothing set: the measured defaults, as cuda_ctx_init has always set them. */
TEST(cuda_knobs_defaults) {
    k_clear_env();
    struct cuda_knobs k;
    char err[256];
    ASSERT_OK(cuda_knobs_read(&k, err, sizeof err));
    ASSERT_EQ(-1, k.skinny_max);
    ASSERT_EQ(-1, k.gemv_max);
    ASSERT_EQ(4, k.mv_split);
    ASSERT_EQ(0, k.sm);
    ASSERT_EQ(96, k.dequant_tile_mb);
    ASSERT_TRUE(k.prefill_tc && k.gemm_group && k.pdl && k.wide && !k.att_k8);

    struct cuda_ctx h = k_ctx(90, 132); /* an H100 */
    ASSERT_EQ(90, h.cc);
    ASSERT_EQ(CUDA_MATMUL_VEC_MAX, h.vec_max_quant);
    ASSERT_EQ(2, h.vec_max_float);
    ASSERT_EQ(-1, h.gemv_max);
    ASSERT_EQ(1, h.gemm_group);
    ASSERT_EQ(4, h.mv_split);
    ASSERT_EQ(1, h.pdl);
    ASSERT_EQ(1, h.wide);
    ASSERT_EQ(2, h.wide_items);
    ASSERT_EQ(8, h.decode_tc_g);
    ASSERT_EQ(1, h.att_k16);
    ASSERT_EQ(2, h.att_steps);
    ASSERT_EQ(4, h.rope_att);
    ASSERT_EQ(8, h.rope_att_mha);
    ASSERT_EQ(4, h.att_defer);
    ASSERT_EQ(2, h.mmq_depth);
    ASSERT_EQ(4, h.mmq_tiles);
    ASSERT_EQ(33, h.mmq_tile);
    ASSERT_EQ(49, h.mmq_tile_sparse);
    ASSERT_EQ(1, h.att_f16);
    ASSERT_EQ(1, h.mr);
    ASSERT_EQ(1, h.mr_mixed);
    ASSERT_EQ(1, h.dequant_ahead);
    ASSERT_EQ(16, h.ahead_sms); /* 132 / 8 */
    ASSERT_EQ(64, h.mq_nt_max);
    ASSERT_EQ(1, h.mq_x_parts);
    /* matmul_mmq.cu: weights of 8192 rows and more at 3-16 tokens, from
     * 17 weights of 20M elements and more, Q4_K and Q5_K to 64 tokens,
     * Q6_K to 24. */
    ASSERT_EQ(3, h.mmq_min);
    ASSERT_EQ(64, h.mmq_max);
    ASSERT_EQ(24, h.mmq_max_q6);
    ASSERT_EQ(8192, h.mmq_q6_rows); /* Q6_K to 24 tokens only above 8192 rows */
    ASSERT_TRUE(k_mmq_sizes(&h, 8192, MMQ_ELEMS, MMQ_ELEMS));

    struct cuda_ctx t = k_ctx(75, 40); /* a T4: no PDL, cp.async or m16n8k16 */
    ASSERT_EQ(75, t.cc);
    ASSERT_EQ(0, t.pdl);
    ASSERT_EQ(0, t.wide);
    ASSERT_EQ(0, t.att_k16);
    ASSERT_EQ(5, t.ahead_sms);
    ASSERT_EQ(64, t.mq_nt_max); /* up to 64 tokens in two column parts */
    ASSERT_EQ(2, t.mq_x_parts);
    /* sm_75: weights of 8192 rows and more at 3-16 tokens, of 20M elements
     * at 17-32, every K-quant weight above. */
    ASSERT_EQ(3, t.mmq_min);
    ASSERT_EQ(64, t.mmq_max);
    ASSERT_EQ(64, t.mmq_max_q6);
    ASSERT_EQ(0, t.mmq_q6_rows);
    ASSERT_TRUE(k_mmq_sizes(&t, 8192, MMQ_ELEMS, 0));
    struct cuda_ctx a = k_ctx(80, 108); /* an A100: no PDL */
    ASSERT_EQ(0, a.pdl);
    ASSERT_EQ(1, a.wide);
    ASSERT_EQ(1, a.att_k16);

    /* LLM_CUDA_MM_ROUTE: the quantized matmuls at 8-64 tokens as the
     * other kind of card routes them (matmul_wide.cu only where the card
     * has cp.async); the rest stays the card's. */
    setenv("LLM_CUDA_MM_ROUTE", "sm75", 1);
    h = k_ctx(90, 132);
    ASSERT_TRUE(h.mmq_max == 64 && h.mmq_max_q6 == 64 && h.mmq_q6_rows == 0 && k_mmq_sizes(&h, 8192, MMQ_ELEMS, 0));
    ASSERT_TRUE(h.wide == 0 && h.pdl == 1 && h.att_k16 == 1 && h.mq_x_parts == 1);
    setenv("LLM_CUDA_MM_ROUTE", "sm80", 1);
    t = k_ctx(75, 40);
    ASSERT_TRUE(t.mmq_max == 64 && t.mmq_max_q6 == 24 && t.mmq_q6_rows == 8192 &&
                k_mmq_sizes(&t, 8192, MMQ_ELEMS, MMQ_ELEMS));
    ASSERT_TRUE(t.wide == 0 && t.pdl == 0 && t.att_k16 == 0 && t.mq_x_parts == 2);
    a = k_ctx(80, 108);
    ASSERT_TRUE(a.mmq_max_q6 == 24 && a.wide == 1);
    unsetenv("LLM_CUDA_MM_ROUTE");
}

/* The values scripts/gpu-check.sh, bench/ and the GPU tests set keep their
 * meaning; an empty variable counts as unset. */
TEST(cuda_knobs_spellings) {
    k_clear_env();
    setenv("LLM_CUDA_SM", "75", 1);
    struct cuda_ctx c = k_ctx(90, 132);
    ASSERT_EQ(75, c.cc);
    ASSERT_EQ(0, c.pdl);
    ASSERT_EQ(0, c.wide);
    ASSERT_EQ(0, c.att_k16);
    setenv("LLM_CUDA_SM", "100", 1); /* above the card's own: no effect */
    ASSERT_EQ(90, k_ctx(90, 132).cc);
    setenv("LLM_CUDA_SM", "", 1);
    ASSERT_EQ(90, k_ctx(90, 132).cc);
    /* LLM_CUDA_MQ64=0 sends sm_75's 33-64 tokens back to the tile path;
     * newer cards keep mq to 64. */
    setenv("LLM_CUDA_MQ64", "0", 1);
    ASSERT_EQ(32, k_ctx(75, 40).mq_nt_max);
    ASSERT_EQ(64, k_ctx(90, 132).mq_nt_max);
    unsetenv("LLM_CUDA_MQ64");
    /* LLM_CUDA_MMQ_MIN=k: every K-quant weight from k tokens to 64. */
    setenv("LLM_CUDA_MMQ_MIN", "17", 1);
    c = k_ctx(90, 132);
    ASSERT_EQ(17, c.mmq_min);
    ASSERT_EQ(CUDA_MATMUL_VEC_MAX, c.mmq_max);
    ASSERT_EQ(CUDA_MATMUL_VEC_MAX, c.mmq_max_q6);
    ASSERT_TRUE(k_mmq_sizes(&c, 0, 0, 0));
    k_clear_env();
    /* LLM_CUDA_MMQ_Q6_MAX=k: every Q6_K weight to k tokens, whatever its
     * rows; the rest of the routing stays. */
    setenv("LLM_CUDA_MMQ_Q6_MAX", "64", 1);
    c = k_ctx(90, 132);
    ASSERT_TRUE(c.mmq_max_q6 == 64 && c.mmq_q6_rows == 0 && c.mmq_max == 64 && c.mmq_min == 3);
    setenv("LLM_CUDA_MMQ_Q6_MAX", "24", 1);
    c = k_ctx(90, 132);
    ASSERT_TRUE(c.mmq_max_q6 == 24 && c.mmq_q6_rows == 0 && k_mmq_sizes(&c, 8192, MMQ_ELEMS, MMQ_ELEMS));
    k_clear_env();

    setenv("LLM_CUDA_SKINNY_MAX", "0", 1);
    c = k_ctx(90, 132);
    ASSERT_EQ(0, c.vec_max_quant);
    ASSERT_EQ(0, c.vec_max_float);
    setenv("LLM_CUDA_SKINNY_MAX", "16", 1);
    c = k_ctx(90, 132);
    ASSERT_EQ(16, c.vec_max_quant);
    ASSERT_EQ(16, c.vec_max_float);
    setenv("LLM_CUDA_SKINNY_MAX", "64", 1);
    ASSERT_EQ(64, k_ctx(90, 132).vec_max_float);
    k_clear_env();

    setenv("LLM_CUDA_ROPE_ATT", "16", 1);
    c = k_ctx(90, 132);
    ASSERT_EQ(16, c.rope_att);
    ASSERT_EQ(16, c.rope_att_mha);
    setenv("LLM_CUDA_ROPE_ATT", "0", 1);
    c = k_ctx(90, 132);
    ASSERT_EQ(0, c.rope_att);
    ASSERT_EQ(0, c.rope_att_mha);
    k_clear_env();

    setenv("LLM_CUDA_MV_SPLIT", "2", 1);
    ASSERT_EQ(2, k_ctx(90, 132).mv_split);
    setenv("LLM_CUDA_MV_SPLIT", "1", 1);
    ASSERT_EQ(1, k_ctx(90, 132).mv_split);
    setenv("LLM_CUDA_GEMV_MAX", "4", 1);
    setenv("LLM_CUDA_GEMM_GROUP", "0", 1);
    setenv("LLM_CUDA_PDL", "0", 1);
    setenv("LLM_CUDA_WIDE", "0", 1);
    setenv("LLM_CUDA_WIDE_ITEMS", "0", 1);
    setenv("LLM_CUDA_DECODE_TC_G", "1", 1);
    setenv("LLM_CUDA_ATT_K8", "1", 1);
    setenv("LLM_CUDA_ATT_STEPS", "1", 1);
    setenv("LLM_CUDA_ATT_DEFER", "0", 1);
    setenv("LLM_CUDA_ATT_F16", "0", 1);
    setenv("LLM_CUDA_MR", "0", 1);
    setenv("LLM_CUDA_DEQUANT_AHEAD", "0", 1);
    setenv("LLM_CUDA_AHEAD_SMS", "0", 1);
    c = k_ctx(90, 132);
    ASSERT_EQ(4, c.gemv_max);
    ASSERT_EQ(0, c.gemm_group);
    ASSERT_EQ(0, c.pdl);
    ASSERT_EQ(0, c.wide);
    ASSERT_EQ(0, c.wide_items);
    ASSERT_EQ(1, c.decode_tc_g);
    ASSERT_EQ(0, c.att_k16);
    ASSERT_EQ(1, c.att_steps);
    ASSERT_EQ(0, c.att_defer);
    ASSERT_EQ(0, c.att_f16);
    ASSERT_EQ(0, c.mr);
    ASSERT_EQ(0, c.dequant_ahead);
    ASSERT_EQ(0, c.ahead_sms);
    setenv("LLM_CUDA_GEMV_MAX", "0", 1);
    setenv("LLM_CUDA_AHEAD_SMS", "131", 1);
    c = k_ctx(90, 132);
    ASSERT_EQ(0, c.gemv_max);
    ASSERT_EQ(131, c.ahead_sms);
    k_clear_env();

    /* The two read on every call, alone. */
    struct cuda_knobs k;
    char err[256];
    setenv("LLM_CUDA_DEQUANT_TILE_MB", "16", 1);
    setenv("LLM_CUDA_PREFILL_TC", "0", 1);
    ASSERT_OK(cuda_knobs_read_one(&k, "LLM_CUDA_DEQUANT_TILE_MB", err, sizeof err));
    ASSERT_EQ(16, k.dequant_tile_mb);
    ASSERT_OK(cuda_knobs_read_one(&k, "LLM_CUDA_PREFILL_TC", err, sizeof err));
    ASSERT_TRUE(!k.prefill_tc);
    k_clear_env();
    ASSERT_OK(cuda_knobs_read_one(&k, "LLM_CUDA_DEQUANT_TILE_MB", err, sizeof err));
    ASSERT_EQ(96, k.dequant_tile_mb);
    ASSERT_OK(cuda_knobs_read_one(&k, "LLM_CUDA_PREFILL_TC", err, sizeof err));
    ASSERT_TRUE(k.prefill_tc);
    ASSERT_EQ(STATUS_INTERNAL, cuda_knobs_read_one(&k, "LLM_CUDA_NOT_A_KNOB", err, sizeof err));
    ASSERT_STREQ("LLM_CUDA_NOT_A_KNOB is not a knob of the CUDA backend", err);
}

/* var=value must fail cuda_knobs_read with a message naming both. */
static void k_bad(const char *var, const char *value, const char *why) {
    k_clear_env();
    setenv(var, value, 1);
    struct cuda_knobs k;
    char err[256] = "";
    int rc = cuda_knobs_read(&k, err, sizeof err);
    unsetenv(var);
    if (rc != STATUS_BAD_INPUT) TEST_FAIL("%s=%s: expected STATUS_BAD_INPUT, got %d", var, value, rc);
    if (!strstr(err, var) || !strstr(err, value) || !strstr(err, why))
        TEST_FAIL("%s=%s: the message \"%s\" should name the variable, the value and \"%s\"", var, value, err, why);
}

TEST(cuda_knobs_bad_values_name_the_variable) {
    k_bad("LLM_CUDA_SKINNY_MAX", "65", "out of range [-1, 64]");
    k_bad("LLM_CUDA_SKINNY_MAX", "lots", "not an integer");
    k_bad("LLM_CUDA_GEMV_MAX", "5", "out of range [-1, 4]");
    k_bad("LLM_CUDA_GEMM_GROUP", "2", "not a boolean");
    k_bad("LLM_CUDA_MV_SPLIT", "3", "not one of 1, 2, 4");
    k_bad("LLM_CUDA_ATT_RING", "1", "not one of 0, 2, 3");
    k_bad("LLM_CUDA_ATT_RING_ROWS", "0", "out of range [1, 2147483647]");
    k_bad("LLM_CUDA_ATT_Q8_RING_MAX", "-2", "out of range [-1, 2147483647]");
    k_bad("LLM_CUDA_ATT_RING_SHALLOW", "maybe", "not a boolean");
    k_bad("LLM_CUDA_MV_SPLIT", "0", "not one of 1, 2, 4");
    k_bad("LLM_CUDA_SM", "7.5", "not an integer");
    k_bad("LLM_CUDA_SM", "-75", "out of range [0, 1000]");
    k_bad("LLM_CUDA_PDL", "nope", "not a boolean");
    k_bad("LLM_CUDA_ATT_WIDE", "2", "not a boolean");
    k_bad("LLM_CUDA_MR_MIXED", "both", "not a boolean");
    k_bad("LLM_CUDA_MMQ_Q6_MAX", "65", "out of range [-1, 64]");
    k_bad("LLM_CUDA_MMQ_TILE", "65", "out of range [0, 64]");
    k_bad("LLM_CUDA_WIDE", "00", "not a boolean");
    k_bad("LLM_CUDA_WIDE_ITEMS", "1025", "out of range [0, 1024]");
    k_bad("LLM_CUDA_DECODE_TC_G", "-1", "out of range [0, 2147483647]");
    k_bad("LLM_CUDA_ATT_K8", "yes please", "not a boolean");
    k_bad("LLM_CUDA_ATT_STEPS", "3", "out of range [1, 2]");
    k_bad("LLM_CUDA_ROPE_ATT", "65", "out of range [-1, 64]");
    k_bad("LLM_CUDA_MMQ_DEPTH", "3", "out of range [1, 2]");
    k_bad("LLM_CUDA_MMQ_TILES", "9", "out of range [1, 8]");
    k_bad("LLM_CUDA_ATT_SPLITS", "-2", "out of range [-1, 64]");
    k_bad("LLM_CUDA_ATT_SPLITS", "two", "not an integer");
    k_bad("LLM_CUDA_ATT_DEFER", "5", "out of range [0, 4]");
    k_bad("LLM_CUDA_ATT_F16", "f16", "not a boolean");
    k_bad("LLM_CUDA_MR", "disabled", "not a boolean");
    k_bad("LLM_CUDA_DEQUANT_AHEAD", "2", "not a boolean");
    k_bad("LLM_CUDA_AHEAD_SMS", "-2", "out of range [-1, 1024]");
    k_bad("LLM_CUDA_DEQUANT_TILE_MB", "0", "out of range [1, 4096]");
    k_bad("LLM_CUDA_DEQUANT_TILE_MB", "96M", "not an integer");
    k_bad("LLM_CUDA_PREFILL_TC", "tc", "not a boolean");
    k_bad("LLM_CUDA_MQ64", "2", "not a boolean");

    /* The per-call read of the same knob fails the same way. */
    setenv("LLM_CUDA_DEQUANT_TILE_MB", "huge", 1);
    struct cuda_knobs k;
    char err[256];
    ASSERT_EQ(STATUS_BAD_INPUT, cuda_knobs_read_one(&k, "LLM_CUDA_DEQUANT_TILE_MB", err, sizeof err));
    ASSERT_STREQ("environment variable LLM_CUDA_DEQUANT_TILE_MB: 'huge' is not an integer", err);
    k_clear_env();

    /* A knob that does not fit the card: as many SMs as it has. */
    setenv("LLM_CUDA_AHEAD_SMS", "132", 1);
    ASSERT_OK(cuda_knobs_read(&k, err, sizeof err));
    struct cuda_ctx ctx;
    memset(&ctx, 0, sizeof ctx);
    ctx.cc = 90;
    ctx.n_sms = 132;
    ASSERT_EQ(STATUS_BAD_INPUT, cuda_knobs_apply(&k, &ctx, err, sizeof err));
    ASSERT_STREQ("environment variable LLM_CUDA_AHEAD_SMS: 132 is out of range [0, 131] on cuda:0 "
                 "(132 multiprocessors)", err);
    k_clear_env();
}

/* Every knob: a distinct LLM_CUDA_ variable, a reason, and a line in
 * docs/configuration.md. */
TEST(cuda_knobs_table_is_documented) {
    struct cuda_knobs k;
    struct option_def defs[CUDA_KNOBS_N];
    const int n = cuda_knobs_table(&k, defs);
    ASSERT_EQ(CUDA_KNOBS_N, n);
    FILE *f = fopen(LLM_SOURCE_DIR "/docs/configuration.md", "rb");
    ASSERT_TRUE(f != NULL);
    static char doc[1 << 16];
    size_t len = fread(doc, 1, sizeof doc - 1, f);
    fclose(f);
    doc[len] = '\0';
    for (int i = 0; i < n; i++) {
        ASSERT_TRUE(strncmp(defs[i].env, "LLM_CUDA_", 9) == 0);
        ASSERT_TRUE(defs[i].help && strlen(defs[i].help) > 20);
        for (int j = 0; j < i; j++)
            if (strcmp(defs[i].env, defs[j].env) == 0) TEST_FAIL("%s is in the table twice", defs[i].env);
        char row[64];
        snprintf(row, sizeof row, "| `%s` |", defs[i].env);
        if (!strstr(doc, row)) TEST_FAIL("docs/configuration.md has no row \"%s\"", row);
    }
}

/* mq's K split: row blocks that fill between half and all of the slots
 * once become full waves where that is a sixteenth sooner; one wave that
 * the splits fill, rows that fill the slots, and gains too small to pay
 * for the partial sums keep the one-wave split.  Row blocks of 128 rows,
 * chunks of 256 columns (the K-quants). */
TEST(cuda_knobs_mq_split) {
    /* sm_75's 64-token mq, one block a multiprocessor, 132 SMs (the T4's
     * code on an H100 or H200): 7B gate/up 11008 x 4096 from 65% of one
     * wave to two full ones; q/k/v/o (4 splits fill 128 of 132), down
     * and lm_head keep theirs. */
    ASSERT_EQ(3, cuda_mq_split(86, 16, 132, 1));
    ASSERT_EQ(4, cuda_mq_split(32, 16, 132, 4));
    ASSERT_EQ(4, cuda_mq_split(32, 43, 132, 4));
    ASSERT_EQ(1, cuda_mq_split(250, 16, 132, 1));
    /* Two blocks a multiprocessor (264 slots): one wave of 258 stays. */
    ASSERT_EQ(3, cuda_mq_split(86, 16, 264, 3));
    ASSERT_EQ(8, cuda_mq_split(32, 16, 264, 8));
    /* A T4 (40 SMs, one block each): gate/up 86 row blocks in 3 waves
     * (the last of 6) become 5 of 172; lm_head's 7 waves of 250 would
     * gain 2%, less than the partial sums cost. */
    ASSERT_EQ(2, cuda_mq_split(86, 16, 40, 1));
    ASSERT_EQ(1, cuda_mq_split(250, 16, 40, 1));
    ASSERT_EQ(1, cuda_mq_split(32, 16, 40, 1));
    /* Never more splits than chunks; degenerate input keeps ks0. */
    ASSERT_EQ(1, cuda_mq_split(86, 1, 132, 1));
    for (int ch = 1; ch <= 80; ch++)
        for (int rb = 1; rb <= 300; rb += 7) {
            int ks = cuda_mq_split(rb, ch, 132, 1);
            if (ks < 1 || ks > ch || ks > CUDA_MQ_SPLIT_MAX)
                TEST_FAIL("%d row blocks, %d chunks: split %d", rb, ch, ks);
        }
    ASSERT_EQ(5, cuda_mq_split(10, 16, 0, 5));
    ASSERT_EQ(5, cuda_mq_split(0, 16, 132, 5));
}

/* Q4_K's 32 x 32 warp tiles: from 33 tokens where the last wave of their
 * blocks is at least half full, else from 49 (two blocks a multiprocessor
 * of an H200: 264 slots). */
TEST(cuda_knobs_mmq_tile) {
    ASSERT_EQ(1, cuda_mmq_tile_takes(33, 49, 33, 448, 264)); /* llama3-8b's gate/up: 1.7 waves */
    ASSERT_EQ(1, cuda_mmq_tile_takes(33, 49, 48, 448, 264));
    ASSERT_EQ(0, cuda_mmq_tile_takes(33, 49, 48, 344, 264)); /* llama2-7b's: 1.3 waves */
    ASSERT_EQ(1, cuda_mmq_tile_takes(33, 49, 49, 344, 264));
    ASSERT_EQ(1, cuda_mmq_tile_takes(33, 49, 40, 528, 264)); /* whole waves */
    ASSERT_EQ(1, cuda_mmq_tile_takes(33, 49, 40, 132, 264)); /* half of one */
    ASSERT_EQ(0, cuda_mmq_tile_takes(33, 49, 40, 131, 264));
    ASSERT_EQ(0, cuda_mmq_tile_takes(33, 49, 32, 448, 264)); /* below the knob */
    ASSERT_EQ(0, cuda_mmq_tile_takes(0, 49, 64, 448, 264));  /* LLM_CUDA_MMQ_TILE=0: never */
    ASSERT_EQ(1, cuda_mmq_tile_takes(1, 0, 9, 2, 264));      /* LLM_CUDA_MMQ_MIN forcing: any */
    ASSERT_EQ(0, cuda_mmq_tile_takes(60, 49, 55, 448, 264)); /* a later knob holds for every launch */
}

/* Decode attention's splits: waves of blocks against their length. */
TEST(cuda_knobs_att_split) {
    /* llama3-8b, 16 rows over 8 KV heads at context 2048 on an H200 (two
     * blocks of 4 warps of 16 positions a multiprocessor): 2 splits are one
     * wave of 17 steps (18), where 3 would be 1.45 waves (24) and 4 two
     * waves of 9 (20). */
    ASSERT_EQ(2, cuda_att_split_want(0, 2049, 264, 128, 64, 17, 0));
    /* llama2-7b's 16 rows of 32 heads, 4 blocks of 64 positions a
     * multiprocessor: 512 blocks are one wave unsplit. */
    ASSERT_EQ(1, cuda_att_split_want(0, 513, 528, 512, 64, 5, 0));
    /* More blocks than slots: never split. */
    ASSERT_EQ(1, cuda_att_split_want(0, 2049, 264, 512, 64, 17, 0));
    /* One sequence: as many as the context allows within one wave. */
    ASSERT_EQ(5, cuda_att_split_want(0, 513, 528, 32, 64, 5, 0));
    ASSERT_EQ(8, cuda_att_split_want(0, 4096, 264, 32, 64, 32, 0));
    /* A T4's 40 multiprocessors: 16 rows over 8 KV heads stay whole. */
    ASSERT_EQ(1, cuda_att_split_want(0, 2049, 80, 128, 64, 17, 0));
    /* LLM_CUDA_ATT_SPLITS: a count as given, -1 the fewest that fill a wave. */
    ASSERT_EQ(7, cuda_att_split_want(7, 2049, 264, 128, 64, 17, 0));
    ASSERT_EQ(3, cuda_att_split_want(-1, 2049, 264, 128, 64, 17, 0));
    for (int b = 1; b <= 600; b += 13)
        for (int ctx = 1; ctx <= 5000; ctx += 499) {
            const int64_t by_ctx = (ctx + 127) / 128, s = cuda_att_split_want(0, ctx, 264, b, 64, by_ctx, 0);
            if (s < 1 || (s > 1 && (s > by_ctx || s > (264 + b - 1) / b)))
                TEST_FAIL("%d blocks, context %d: %lld splits", b, ctx, (long long)s);
        }
    ASSERT_EQ(1, cuda_att_split_want(0, 100, 0, 0, 0, 1, 0));
    /* The splits measured fastest past the fill, each kernel at its own
     * occupancy and margin on an H200: {context + 1, slots, blocks, step,
     * least positions a split, margin in tenths, splits}.
     *
     * attention_q8.cu, llama2-7b's 32 ungrouped heads (5 blocks of 64
     * positions a multiprocessor, 660 slots, 9/10): at context 2048 8 rows
     * 5, 16 rows 1 (5 splits' 32 are not a tenth under 34), 24-64 rows 3;
     * at context 512 8 rows 2, 24 rows 3, 16, 32 and 48 rows 1 (3 splits'
     * 28 against 30 measured slower).
     *
     * attention.cu's decode kernel, the same heads in blocks of 4 warps (8
     * a multiprocessor: 1056 slots, steps of 32, 8/10): context 2048 40
     * rows 4 (13% off the step against 1), 48 rows 2 (3%), 24, 32, 56 and
     * 64 rows 1; context 512 40 rows 3 (4%), 24, 48 and 64 rows 1.
     *
     * attention_gqa.cu's 8-bit ring, llama3-8b's 8 KV heads (3 blocks a
     * multiprocessor: 396 slots, steps of 64, 8/10 where the blocks pass
     * one wave): 56 and 64 rows take 3 splits at context 2048 and stay
     * whole at 512 (16 against 20 is not under 8/10, and measured 3.7%
     * slower); 48 rows, one wave, stay whole with no margin.
     *
     * Last, a grid one block past a wave over 128k positions, which would
     * weigh 50 splits: past the fill at most 8. */
    static const int64_t rows[][7] = {
        {2049, 660, 256, 64, 128, 9, 5},     {2049, 660, 512, 64, 128, 9, 1},    {2049, 660, 768, 64, 128, 9, 3},
        {2049, 660, 1024, 64, 128, 9, 3},    {2049, 660, 1536, 64, 128, 9, 3},   {2049, 660, 2048, 64, 128, 9, 3},
        {513, 660, 256, 64, 128, 9, 2},      {513, 660, 512, 64, 128, 9, 1},     {513, 660, 768, 64, 128, 9, 3},
        {513, 660, 1024, 64, 128, 9, 1},     {513, 660, 1536, 64, 128, 9, 1},    {513, 660, 2048, 64, 128, 9, 1},
        {2049, 1056, 768, 32, 64, 8, 1},     {2049, 1056, 1024, 32, 64, 8, 1},   {2049, 1056, 1280, 32, 64, 8, 4},
        {2049, 1056, 1536, 32, 64, 8, 2},    {2049, 1056, 1792, 32, 64, 8, 1},   {2049, 1056, 2048, 32, 64, 8, 1},
        {513, 1056, 768, 32, 64, 8, 1},      {513, 1056, 1280, 32, 64, 8, 3},    {513, 1056, 1536, 32, 64, 8, 1},
        {513, 1056, 2048, 32, 64, 8, 1},     {2049, 396, 448, 64, 128, 8, 3},    {2049, 396, 512, 64, 128, 8, 3},
        {513, 396, 448, 64, 128, 8, 1},      {513, 396, 512, 64, 128, 8, 1},     {2049, 396, 384, 64, 128, 0, 1},
        {131073, 1056, 1057, 32, 64, 8, 8},
    };
    for (int i = 0; i < (int)(sizeof rows / sizeof rows[0]); i++) {
        const int64_t *r = rows[i], by_ctx = (r[0] + r[4] - 1) / r[4];
        const int64_t s = cuda_att_split_want(0, r[0], r[1], r[2], r[3], by_ctx, (int)r[5]);
        if (s != r[6])
            TEST_FAIL("context %lld, %lld blocks for %lld slots, margin %lld: %lld splits, want %lld",
                      (long long)r[0] - 1, (long long)r[2], (long long)r[1], (long long)r[5], (long long)s,
                      (long long)r[6]);
        if (cuda_att_split_want(0, r[0], r[1], r[2], r[3], by_ctx, 0) > (r[1] + r[2] - 1) / r[2])
            TEST_FAIL("context %lld, %lld blocks for %lld slots: past the fill without a margin", (long long)r[0] - 1,
                      (long long)r[2], (long long)r[1]);
    }
}

TEST_MAIN(cuda_knobs_defaults, cuda_knobs_spellings, cuda_knobs_bad_values_name_the_variable,
          cuda_knobs_table_is_documented, cuda_knobs_mq_split, cuda_knobs_mmq_tile, cuda_knobs_att_split)
