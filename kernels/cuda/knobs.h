/* The CUDA backend's tuning knobs: every LLM_CUDA_* environment variable
 * the backend reads, declared once in one table (variable, type, default,
 * range, the reason it exists) and read through common/options, so that a
 * bad value is an error naming the variable and the value rather than a
 * silent clamp.  Plain C with no CUDA header: the tests check the table on
 * machines without a GPU.  docs/configuration.md lists the knobs. */
#ifndef KERNELS_CUDA_KNOBS_H
#define KERNELS_CUDA_KNOBS_H

#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>
#include <stdio.h>

#ifdef __cplusplus
extern "C" {
#endif

#include "../../common/options.h"

struct cuda_ctx;

/* The knobs as read, before the card is known (cuda_knobs_apply resolves
 * the ones that depend on it).  -1 in a field marked so: the variable is
 * not set, and the measured default applies. */
struct cuda_knobs {
    int skinny_max;      /* LLM_CUDA_SKINNY_MAX: -1, or most tokens on the weight-reading kernels */
    int gemv_max;        /* LLM_CUDA_GEMV_MAX: -1, or most tokens on matmul_gemv.cu */
    bool gemm_group;     /* LLM_CUDA_GEMM_GROUP */
    int mv_split;        /* LLM_CUDA_MV_SPLIT: 1, 2 or 4 warps per row */
    int sm;              /* LLM_CUDA_SM: 0, or the compute capability to route as */
    bool pdl;            /* LLM_CUDA_PDL */
    bool wide;           /* LLM_CUDA_WIDE */
    int wide_items;      /* LLM_CUDA_WIDE_ITEMS */
    bool mq64;           /* LLM_CUDA_MQ64 */
    int decode_tc_g;     /* LLM_CUDA_DECODE_TC_G */
    int att_gqa_min;     /* LLM_CUDA_ATT_GQA_MIN */
    int att_ring;        /* LLM_CUDA_ATT_RING: 0, 2 or 3 */
    int att_ring_rows;   /* LLM_CUDA_ATT_RING_ROWS */
    int att_q8_ring_max; /* LLM_CUDA_ATT_Q8_RING_MAX */
    bool att_ring_shallow; /* LLM_CUDA_ATT_RING_SHALLOW */
    bool att_k8;         /* LLM_CUDA_ATT_K8 */
    int att_steps;       /* LLM_CUDA_ATT_STEPS: 1 or 2 */
    bool att_wide;       /* LLM_CUDA_ATT_WIDE */
    int rope_att;        /* LLM_CUDA_ROPE_ATT: -1, or most rows for both limits */
    int rope_tc;         /* LLM_CUDA_ROPE_TC */
    bool rope_gqa;       /* LLM_CUDA_ROPE_GQA */
    int att_defer;       /* LLM_CUDA_ATT_DEFER */
    bool att_f16;        /* LLM_CUDA_ATT_F16 */
    bool mr;             /* LLM_CUDA_MR */
    bool mr_mixed;       /* LLM_CUDA_MR_MIXED */
    int mmq_min;         /* LLM_CUDA_MMQ_MIN: -1, or fewest tokens on matmul_mmq.cu (0: never) */
    int mmq_q6_max;      /* LLM_CUDA_MMQ_Q6_MAX: -1, or most tokens of a Q6_K weight there */
    int mm_route;        /* LLM_CUDA_MM_ROUTE: 0 auto, 1 sm75, 2 sm80 (quantized matmuls at 8-64 tokens) */
    bool dequant_ahead;  /* LLM_CUDA_DEQUANT_AHEAD */
    int ahead_sms;       /* LLM_CUDA_AHEAD_SMS: -1, or multiprocessors left to the side stream */
    int dequant_tile_mb; /* LLM_CUDA_DEQUANT_TILE_MB (read again on every prefill matmul) */
    bool prefill_tc;     /* LLM_CUDA_PREFILL_TC (read again on every attention) */
    int mmq_stage;       /* LLM_CUDA_MMQ_STAGE (read again on every matmul_mmq.cu launch) */
    int l2_ahead;        /* LLM_CUDA_L2_AHEAD: steps or chunks asked of L2 ahead of their loads */
    int mmq_depth;       /* LLM_CUDA_MMQ_DEPTH: 1 or 2 */
    int mmq_tiles;       /* LLM_CUDA_MMQ_TILES: 1-8 */
    int mmq_tile;        /* LLM_CUDA_MMQ_TILE: fewest tokens for Q4_K's 32 x 32 warp tiles (0: never) */
    int att_splits;      /* LLM_CUDA_ATT_SPLITS: 0 weighed, -1 one wave, or the splits a row wants */
};

/* Number of entries of the table. */
#define CUDA_KNOBS_N 38

/* Fills defs[0 .. CUDA_KNOBS_N) with the table, its targets the fields of
 * k, and returns CUDA_KNOBS_N; for the tests and for reading one knob. */
int cuda_knobs_table(struct cuda_knobs *k, struct option_def *defs);

/* Reads every knob into k: its default, or its variable where that is set
 * and not empty.  Returns 0, or STATUS_BAD_INPUT with a message in err
 * naming the variable and the value ("environment variable
 * LLM_CUDA_MV_SPLIT: '3' is not one of 1, 2, 4"). */
int cuda_knobs_read(struct cuda_knobs *k, char *err, size_t err_size);

/* Reads only the knob of variable env into its field of k (the others are
 * left alone): for the two read on every call, so that a benchmark or a
 * test can change them on a live backend.  Returns 0, STATUS_BAD_INPUT as
 * cuda_knobs_read, or STATUS_INTERNAL when env is not in the table. */
int cuda_knobs_read_one(struct cuda_knobs *k, const char *env, char *err, size_t err_size);

/* Sets ctx's routing fields (cc, vec_max_quant, vec_max_float, gemv_max,
 * gemm_group, mv_split, pdl, wide, wide_items, mq_nt_max, mq_x_parts,
 * mmq_min, att_gqa_min, att_ring, att_ring_rows, att_q8_ring_max,
 * att_ring_shallow, decode_tc_g, att_k16,
 * att_steps, att_wide, rope_att, rope_att_mha, rope_tc, rope_gqa,
 * att_defer, att_f16, mr, dequant_ahead, ahead_sms) from k, for the card
 * that ctx->device, ctx->cc and ctx->n_sms describe.  ctx->cc becomes
 * LLM_CUDA_SM where that is below the card's own.  Returns 0, or
 * STATUS_BAD_INPUT where a knob does not fit the card (LLM_CUDA_AHEAD_SMS
 * of n_sms or more), naming it. */
int cuda_knobs_apply(const struct cuda_knobs *k, struct cuda_ctx *ctx, char *err, size_t err_size);

/* Most K splits cuda_mq_split weighs. */
#define CUDA_MQ_SPLIT_MAX 64

/* The K split of matmul_vec.cu's mq for n_rb row blocks of n_chunks
 * chunks on slots resident blocks: ks0 (one wave, as many splits as fit),
 * or a split into full waves that finishes at least a sixteenth sooner,
 * which pays for the partial sums' traffic and their reduction.  Row
 * blocks that more than half fill the slots leave the rest idle for the
 * whole matmul where one block a row block is all that makes one wave:
 * the 7B's gate and up (86 row blocks) with sm_75's one 64-token block a
 * multiprocessor fill 65% of 132 SMs, and split in three make two full
 * waves of a third of the chunks each.  Rows that fill the slots, or a
 * split into one full wave, keep ks0. */
int cuda_mq_split(int n_rb, int n_chunks, int slots, int ks0);

/* The splits a row wants: of those up to the fewest that fill one wave of
 * `slots` and at most by_ctx, the count whose waves of `blocks` blocks,
 * each as long as its steps of `step` positions over max_ctx and one more
 * (its start: the row, Q, the first loads that nothing covers), take the
 * least time; the fewer on a tie (fewer partial sums to merge).  With
 * past_tenths > 0, more splits than fill one wave too (up to 8), where
 * they take under past_tenths / 10 of that time: more, shorter blocks
 * and their merge cost what the weighing leaves out, so each kernel's
 * margin is the one its steps measured (attention_q8.cu 9: its blocks of 2048
 * positions leave a long last wave, and llama2-7b's 64 rows at context
 * 2048 gained 1.7% with 3 splits in 10 waves of 660 slots against 4
 * unsplit; attention.cu and attention_gqa.cu's 8-bit ring 8).  forced
 * (LLM_CUDA_ATT_SPLITS) > 0 is taken as it is, < 0 gives the fewest that
 * fill one wave.  A grid of 1.45 waves runs its last blocks on half the
 * multiprocessors: llama3-8b's 16 rows over 8 KV heads at context 2048
 * are 128 blocks for 264 slots, where 2 splits measured 5% faster a step
 * than the 3 that fill one wave (docs/cuda-attention.md). */
int64_t cuda_att_split_want(int forced, int64_t max_ctx, int64_t slots, int64_t blocks, int64_t step,
                            int64_t by_ctx, int past_tenths);

/* Whether matmul_mmq.cu multiplies a launch of n tokens whose rows it
 * takes there (16384 and more) on its 32 x 32 warp tiles, `blocks` row
 * blocks over `slots` resident blocks of that kernel: from `from` tokens
 * (LLM_CUDA_MMQ_TILE; 0: never) where its last wave of blocks is at
 * least half full, else from `sparse_from` (0: the same).  On an H200
 * llama3-8b's gate and up (448 blocks, 1.7 waves of 264) measured faster
 * on them from 33 tokens, llama2-7b's (344, 1.3 waves) only from 49. */
int cuda_mmq_tile_takes(int from, int sparse_from, int n, int64_t blocks, int64_t slots);

#ifdef __cplusplus
}
#endif

#endif
