/* Tests of the worker's sizing from its memory budget (worker/sizing.h) on
 * made-up cards: a 16 GB T4 with a 7B Q4_K_M shape in one and in two
 * stages, with F16 and 8-bit KV, with a draft model, an 80 GB H100, flags that override, the
 * CPU's small defaults, and a model that does not fit.  The expected
 * numbers are worked out by hand in the comments. */
#include "../test.h"

#include "common/status.h"
#include "worker/kvcache.h"
#include "worker/sizing.h"

#define MIB ((size_t)1 << 20)

/* Llama-2-7B: 32 layers, dim 4096, FFN 11008, 32 KV heads of 128,
 * vocabulary 32000.  Q4_K_M weights 3891 MiB in all, 1990 MiB for stage 0
 * of 2 (16 layers and the embedding).  A T4 reports about 14930 MiB free
 * with a CUDA context, an H100 80GB about 80600 MiB. */
static struct sizing_input shape_7b(size_t mem_free, size_t weights, int32_t layers, enum dtype kv) {
    struct sizing_input in = {0};
    in.gpu = 1;
    in.mem_free = mem_free;
    in.mem_fraction = 0.9;
    in.weight_bytes = weights;
    in.kv_block_bytes = (size_t)layers * kvcache_block_bytes(kv, 16, 32, 128);
    in.block_size = 16;
    in.dim = 4096;
    in.ffn_dim = 11008;
    in.n_vocab = 32000;
    in.n_ctx = 4096;
    in.target_ctx = 2048;
    in.stage_count = 1;
    return in;
}

TEST(sizing_t4_7b_q4km_one_stage) {
    struct sizing_input in = shape_7b(14930 * MIB, 3891 * MIB, 32, DTYPE_F16);
    /* An F16 block is 2 (K, V) x 32 heads x 16 positions x 128 x 2 bytes
     * = 256 KiB a layer, 8 MiB for 32 layers (512 KiB a position). */
    ASSERT_EQ((size_t)8 * MIB, in.kv_block_bytes);
    struct sizing sz;
    char err[512];
    ASSERT_OK(sizing_choose(&sz, &in, err, sizeof err));
    /* Budget 0.9 x 14930 MiB = 13437 MiB.  First the workspace of the
     * largest step (256 sequences, 768 tokens): 768 x 4 x (8 x 4096 + 3 x
     * 11008) + 256 x 32000 x 4 + 352 MiB = 576 MiB, leaving 8970 MiB =
     * 1121 blocks = 17936 positions = 8 sequences of 2048 (128 blocks
     * each): 8 sequences, 8 + 512 = 520 -> 576 tokens per step.  Their
     * workspace, 576 x 263168 + 8 x 128000 + 352 MiB = 497.5 MiB, gives
     * 9048.5 MiB to the KV: 1131 blocks, still 8 sequences of 2048. */
    ASSERT_EQ(1131, sz.kv_blocks);
    ASSERT_EQ(8, sz.kv_seqs);
    ASSERT_EQ(8, sz.max_seqs);
    ASSERT_EQ(576, sz.max_tokens);
    ASSERT_EQ((size_t)521707520, sz.work_bytes);
    ASSERT_EQ((size_t)1131 * 8 * MIB, sz.kv_bytes);
    ASSERT_EQ(2048, sz.target_ctx);
    ASSERT_EQ((unsigned)(SIZING_AUTO_KV_BLOCKS | SIZING_AUTO_TOKENS | SIZING_AUTO_SEQS), sz.auto_mask);
    ASSERT_TRUE(strstr(sz.why, "1131 blocks x 16 = 18096 positions = 8 sequences of 2048") != NULL);
    ASSERT_TRUE(strstr(sz.why, "max-seqs 8 (8 / 1 stage,") != NULL);
    ASSERT_TRUE(strstr(sz.why, "max-batch-tokens 576 (8 + 512") != NULL);
}

/* A draft model beside the stage (--draft-model) shares the budget: its
 * fixed bytes come off first and every block of the stage's has the
 * draft's beside it.  A made-up draft of 1024 MiB fixed and 1 MiB a block:
 * 13437 - 3891 - 576 - 1024 = 7946 MiB / 9 MiB = 882 blocks, 6 sequences
 * of 2048, 576 tokens; their workspace, 576 x 263168 + 6 x 128000 + 352
 * MiB = 521451520 bytes, leaves 8414513152 bytes = 891 blocks of 9 MiB. */
TEST(sizing_t4_7b_q4km_with_draft) {
    struct sizing_input in = shape_7b(14930 * MIB, 3891 * MIB, 32, DTYPE_F16);
    in.draft_bytes = 1024 * MIB;
    in.draft_block_bytes = MIB;
    struct sizing sz;
    char err[512];
    ASSERT_OK(sizing_choose(&sz, &in, err, sizeof err));
    ASSERT_EQ(891, sz.kv_blocks);
    ASSERT_EQ(6, sz.kv_seqs);
    ASSERT_EQ(6, sz.max_seqs);
    ASSERT_EQ(576, sz.max_tokens);
    ASSERT_EQ((size_t)891 * 8 * MIB, sz.kv_bytes);
    ASSERT_TRUE(strstr(sz.why, "- draft 1.00 GiB") != NULL);
    ASSERT_TRUE(strstr(sz.why, "(8.000 + the draft's 1.000) MiB a block = 891 blocks") != NULL);
    /* A draft that leaves no room for a block is refused, naming it. */
    in.draft_bytes = 9000 * MIB;
    ASSERT_EQ(STATUS_NO_MEMORY, sizing_choose(&sz, &in, err, sizeof err));
    ASSERT_TRUE(strstr(err, "the draft model 8.79 GiB") != NULL);
}

TEST(sizing_t4_7b_q4km_two_stages) {
    /* Stage 0 of 2: 16 layers, 4 MiB a block, 1990 MiB of weights.  The
     * budget leaves 13437 - 1990 - 576 = 10871 MiB = 2717 blocks = 21
     * sequences of 2048; two micro-batches in flight share them: 10 a
     * step (below 16, not rounded), 576 tokens.  The smaller workspace
     * (10 x 128000 bytes of logits more than at 8) gives 2737 blocks. */
    struct sizing_input in = shape_7b(14930 * MIB, 1990 * MIB, 16, DTYPE_F16);
    in.stage_count = 2;
    struct sizing sz;
    char err[512];
    ASSERT_OK(sizing_choose(&sz, &in, err, sizeof err));
    ASSERT_EQ(2737, sz.kv_blocks);
    ASSERT_EQ(21, sz.kv_seqs);
    ASSERT_EQ(10, sz.max_seqs);
    ASSERT_EQ(576, sz.max_tokens);
    ASSERT_TRUE(strstr(sz.why, "21 / 2 stages") != NULL);
}

TEST(sizing_t4_7b_q4km_q8_kv) {
    /* Q8_0 KV: 66 bytes a group of 64, 132 bytes a row of 128, 135168
     * bytes a block a layer (4.125 MiB for 32 layers): 1.94x the F16
     * blocks in the same memory.  8970 MiB after the largest step's
     * workspace = 2174 blocks = 16 sequences of 2048, steps of 16; their
     * workspace leaves 9047.5 MiB = 2193 blocks = 17 sequences. */
    struct sizing_input in = shape_7b(14930 * MIB, 3891 * MIB, 32, DTYPE_Q8_0);
    ASSERT_EQ((size_t)32 * 135168, in.kv_block_bytes);
    struct sizing sz;
    char err[512];
    ASSERT_OK(sizing_choose(&sz, &in, err, sizeof err));
    ASSERT_EQ(2193, sz.kv_blocks);
    ASSERT_EQ(17, sz.kv_seqs);
    ASSERT_EQ(16, sz.max_seqs);
}

TEST(sizing_h100_7b_q4km) {
    /* 0.9 x 80600 MiB = 72540 MiB - 3891 - 576 = 68073 MiB = 8509 blocks
     * = 66 sequences of 2048: 64 a step (a multiple of 8), 576 tokens;
     * the smaller workspace gives 8518 blocks. */
    struct sizing_input in = shape_7b(80600 * MIB, 3891 * MIB, 32, DTYPE_F16);
    struct sizing sz;
    char err[512];
    ASSERT_OK(sizing_choose(&sz, &in, err, sizeof err));
    ASSERT_EQ(8518, sz.kv_blocks);
    ASSERT_EQ(66, sz.kv_seqs);
    ASSERT_EQ(64, sz.max_seqs);
    ASSERT_EQ(576, sz.max_tokens);
    /* A shorter typical sequence: 512 positions, 32 blocks each: 265
     * sequences, at most 256 a step, 768 tokens. */
    in.target_ctx = 512;
    ASSERT_OK(sizing_choose(&sz, &in, err, sizeof err));
    ASSERT_EQ(256, sz.max_seqs);
    ASSERT_EQ(768, sz.max_tokens);
    ASSERT_EQ(512, sz.target_ctx);
    ASSERT_EQ(sz.kv_blocks / 32, sz.kv_seqs);
    /* A target above the context is the context. */
    in.target_ctx = 100000;
    ASSERT_OK(sizing_choose(&sz, &in, err, sizeof err));
    ASSERT_EQ(4096, sz.target_ctx);
    ASSERT_EQ(sz.kv_blocks / 256, sz.kv_seqs);
}

TEST(sizing_flags_override) {
    struct sizing_input in = shape_7b(14930 * MIB, 3891 * MIB, 32, DTYPE_F16);
    struct sizing sz;
    char err[512];
    /* --max-seqs 64: the workspace of 64 sequences and 576 tokens (504
     * MiB) leaves 1130 blocks; the step is the flag's. */
    in.max_seqs = 64;
    ASSERT_OK(sizing_choose(&sz, &in, err, sizeof err));
    ASSERT_EQ(64, sz.max_seqs);
    ASSERT_EQ(576, sz.max_tokens);
    ASSERT_EQ(1130, sz.kv_blocks);
    ASSERT_EQ((unsigned)(SIZING_AUTO_KV_BLOCKS | SIZING_AUTO_TOKENS), sz.auto_mask);
    ASSERT_TRUE(strstr(sz.why, "max-seqs 64 (--max-seqs)") != NULL);
    /* --kv-blocks 500: 3 sequences of 2048 fit, so 3 a step. */
    in.max_seqs = 0;
    in.kv_blocks = 500;
    ASSERT_OK(sizing_choose(&sz, &in, err, sizeof err));
    ASSERT_EQ(500, sz.kv_blocks);
    ASSERT_EQ(3, sz.kv_seqs);
    ASSERT_EQ(3, sz.max_seqs);
    ASSERT_TRUE(strstr(sz.why, "500 blocks (--kv-blocks)") != NULL);
    /* All three given: taken as they are. */
    in.max_seqs = 32;
    in.max_tokens = 1024;
    ASSERT_OK(sizing_choose(&sz, &in, err, sizeof err));
    ASSERT_EQ(500, sz.kv_blocks);
    ASSERT_EQ(32, sz.max_seqs);
    ASSERT_EQ(1024, sz.max_tokens);
    ASSERT_EQ(0u, sz.auto_mask);
}

TEST(sizing_cpu_keeps_small_defaults) {
    /* The CPU: 16 sequences, 512 tokens, KV for 16 whole contexts of 512
     * (32 blocks each), whatever the memory. */
    struct sizing_input in = shape_7b((size_t)64 << 30, 0, 5, DTYPE_F32);
    in.gpu = 0;
    in.n_ctx = 512;
    struct sizing sz;
    char err[512];
    ASSERT_OK(sizing_choose(&sz, &in, err, sizeof err));
    ASSERT_EQ(16, sz.max_seqs);
    ASSERT_EQ(512, sz.max_tokens);
    ASSERT_EQ(16 * 32, sz.kv_blocks);
    ASSERT_EQ(512, sz.target_ctx);
    ASSERT_EQ(16, sz.kv_seqs);
    ASSERT_TRUE(strstr(sz.why, "CPU") != NULL);
    in.max_seqs = 4;
    ASSERT_OK(sizing_choose(&sz, &in, err, sizeof err));
    ASSERT_EQ(4 * 32, sz.kv_blocks);
}

TEST(sizing_refuses_what_does_not_fit) {
    /* 13B F16 (24826 MiB of weights) on a T4: no room for one block. */
    struct sizing_input in = shape_7b(14930 * MIB, 24826 * MIB, 40, DTYPE_F16);
    in.dim = 5120;
    in.ffn_dim = 13824;
    struct sizing sz;
    char err[512] = "";
    ASSERT_EQ((int)STATUS_NO_MEMORY, sizing_choose(&sz, &in, err, sizeof err));
    ASSERT_TRUE(strstr(err, "weights 24.24 GiB") != NULL);
    ASSERT_TRUE(strstr(err, "use more stages") != NULL);
    /* A shape that is not positive is bad input, named. */
    in = shape_7b(14930 * MIB, 3891 * MIB, 32, DTYPE_F16);
    in.block_size = 0;
    ASSERT_EQ((int)STATUS_BAD_INPUT, sizing_choose(&sz, &in, err, sizeof err));
    ASSERT_TRUE(strstr(err, "block size 0") != NULL);
}

TEST_MAIN(sizing_t4_7b_q4km_one_stage, sizing_t4_7b_q4km_with_draft, sizing_t4_7b_q4km_two_stages, sizing_t4_7b_q4km_q8_kv,
          sizing_h100_7b_q4km, sizing_flags_override, sizing_cpu_keeps_small_defaults,
          sizing_refuses_what_does_not_fit)
