/* The CUDA backend's knob table (knobs.h): every LLM_CUDA_* variable with
 * its type, default, range and the reason it exists, read through
 * common/options, and the rules that turn the knobs into the context's
 * routing for one card.  Most knobs exist to measure a choice the backend
 * makes against its alternative; the defaults are the measured winners
 * (docs/cuda-backend.md has the measurements). */
#include "knobs.h"

#include "../../common/options.h"
#include "../../common/status.h"
#include "cuda_ops.h"

#include <limits.h>
#include <string.h>

/* Where matmul_mmq.cu measured faster than the kernels it replaces (one
 * H200, both builds; docs/cuda-backend.md, "Routing at 17-64 tokens" and
 * "3-16 tokens"): weights of 8192 rows and more from 3 tokens to 16 (at
 * 1-2 the dp4a kernel of matmul_gemv.cu comes first); from 17, every
 * weight of 20M elements and more (not 4096 x 4096, where mq is faster
 * at 17-32 tokens on every card and to 64 on sm_80 and later); on sm_75
 * every K-quant weight from 33, where mq runs F16 products at half the
 * int8 rate; on sm_80 and later Q6_K weights of more than 8192 rows
 * (gate and up, an output head) only to 24 tokens, where matmul_wide.cu
 * takes over; the 4096-row Q6_K down to 64. */
#define CUDA_MMQ_MIN_DEFAULT 3
#define CUDA_MMQ_ROWS_DEFAULT 8192
#define CUDA_MMQ_ELEMS ((int64_t)20 << 20)
#define CUDA_MMQ_MAX_Q6_SM80 24
#define CUDA_MMQ_Q6_ROWS_SM80 8192
#define CUDA_MMQ_TILE_ROWS 16384
#define CUDA_MMQ_TILE_SPARSE 49

static const char *const knobs_mv_split_choices[] = {"1", "2", "4", NULL};
static const char *const knobs_mm_route_choices[] = {"auto", "sm75", "sm80", NULL};
static const int knobs_mv_split_warps[] = {1, 2, 4};
static const char *const knobs_att_ring_choices[] = {"0", "2", "3", NULL};
static const int knobs_att_ring_stages[] = {0, 2, 3};

int cuda_knobs_table(struct cuda_knobs *k, struct option_def *defs) {
    const struct option_def t[CUDA_KNOBS_N] = {
        {"cuda-skinny-max", "LLM_CUDA_SKINNY_MAX", OPTION_INT, "-1",
         "most tokens of every weight type on the weight-reading kernels (0: always cuBLAS; -1: the "
         "measured 64 for quantized, 2 for F16/F32 weights), to re-measure the crossover on another card",
         &k->skinny_max, -1, CUDA_MATMUL_VEC_MAX, NULL},
        {"cuda-gemv-max", "LLM_CUDA_GEMV_MAX", OPTION_INT, "-1",
         "most tokens on matmul_gemv.cu's dp4a kernel for every quantized type (0: never; -1: where "
         "it measured faster, per type and token count), to compare",
         &k->gemv_max, -1, CUDA_MATMUL_GEMV_MAX, NULL},
        {"cuda-gemm-group", "LLM_CUDA_GEMM_GROUP", OPTION_BOOL, "true",
         "prefill-sized F16 weights of one input (q/k/v, gate/up) in one batched cuBLAS call, which "
         "fills the GPU where one call a weight does not (false: a call each, to compare)",
         &k->gemm_group, 0, 0, NULL},
        {"cuda-mv-split", "LLM_CUDA_MV_SPLIT", OPTION_CHOICE, "4",
         "warps sharing a row in matmul_vec.cu's row kernel where one warp a row would be a single "
         "wave; fewer to compare",
         &k->mv_split, 0, 0, knobs_mv_split_choices},
        {"cuda-sm", "LLM_CUDA_SM", OPTION_INT, "0",
         "route every choice as this compute capability where it is below the card's own (75: a T4's "
         "kernels and paths on a newer card, with a compute_75 PTX build); 0: the card's",
         &k->sm, 0, 1000, NULL},
        {"cuda-pdl", "LLM_CUDA_PDL", OPTION_BOOL, "true",
         "launch decode kernels as programmatic dependents on sm_90 and later, so each one's start "
         "overlaps the end of the one before (false: off, to compare)",
         &k->pdl, 0, 0, NULL},
        {"cuda-wide", "LLM_CUDA_WIDE", OPTION_BOOL, "true",
         "matmul_wide.cu's pipelined tensor-core kernel for quantized weights at 17-64 tokens on "
         "sm_80 and later (false: matmul_vec.cu's mq, to compare)",
         &k->wide, 0, 0, NULL},
        {"cuda-wide-items", "LLM_CUDA_WIDE_ITEMS", OPTION_INT, "2",
         "least items (row block x chunk) per multiprocessor for matmul_wide.cu to take a matmul; "
         "smaller ones leave SMs idle and stay on mq (0: every matmul, to compare and to test)",
         &k->wide_items, 0, 1024, NULL},
        {"cuda-mq64", "LLM_CUDA_MQ64", OPTION_BOOL, "true",
         "matmul_vec.cu's mq for quantized weights at 33-64 tokens on sm_75 too, the activations of "
         "each chunk staged in two halves to fit 64 KB of shared memory (false: dequantized tiles and "
         "cuBLAS there, to compare); newer cards always take it",
         &k->mq64, 0, 0, NULL},
        {"cuda-decode-tc-g", "LLM_CUDA_DECODE_TC_G", OPTION_INT, "8",
         "decode attention of groups of at least this many query heads per KV head on the "
         "tensor-core kernel, which measured faster from 8 (0: never, to compare)",
         &k->decode_tc_g, 0, INT_MAX, NULL},
        {"cuda-att-gqa-min", "LLM_CUDA_ATT_GQA_MIN", OPTION_INT, "2",
         "decode attention of groups of at least this many query heads per KV head (up to 16) on "
         "attention_gqa.cu, tensor cores with the group's heads as the mma rows (0: never, to compare)",
         &k->att_gqa_min, 0, 16, NULL},
        {"cuda-att-ring", "LLM_CUDA_ATT_RING", OPTION_CHOICE, "3",
         "attention_gqa.cu on sm_80 and later: each warp's steps copied into "
         "a ring of this many stages in shared memory with cp.async, this many less one ahead "
         "(0: a step ahead in registers, as on sm_75, to compare)",
         &k->att_ring, 0, 0, knobs_att_ring_choices},
        {"cuda-att-ring-rows", "LLM_CUDA_ATT_RING_ROWS", OPTION_INT, "32",
         "fewest decode rows of a launch that take LLM_CUDA_ATT_RING's ring, which measured "
         "slower at 8 rows and no faster at 16-32",
         &k->att_ring_rows, 1, INT_MAX, NULL},
        {"cuda-att-q8-ring-max", "LLM_CUDA_ATT_Q8_RING_MAX", OPTION_INT, "-1",
         "most decode rows of a launch over a Q8_0 cache that take LLM_CUDA_ATT_RING's ring (-1: "
         "as many as fill one wave of the ring's blocks unsplit, and past that where the context "
         "split weighs more splits than fill one wave; 0: never, to compare)",
         &k->att_q8_ring_max, -1, INT_MAX, NULL},
        {"cuda-att-ring-shallow", "LLM_CUDA_ATT_RING_SHALLOW", OPTION_BOOL, "true",
         "over an F16 cache at LLM_CUDA_ATT_RING=3, launches whose rows' blocks fit one wave of the "
         "two-stage ring's blocks but not of the three-stage ring's take the two-stage ring",
         &k->att_ring_shallow, 0, 0, NULL},
        {"cuda-att-k8", "LLM_CUDA_ATT_K8", OPTION_BOOL, "false",
         "sm_75's m16n8k8 mma in the tensor-core attention on sm_80 and later too, whose m16n8k16 "
         "needs half the instructions (true: to compare and to test the T4's kernel)",
         &k->att_k8, 0, 0, NULL},
        {"cuda-att-wide", "LLM_CUDA_ATT_WIDE", OPTION_BOOL, "true",
         "the decode attention kernel's ungrouped heads in blocks of 8 warps where blocks of 4, "
         "one a row and head, would fill at most 4 a multiprocessor (false: always 4, to compare)",
         &k->att_wide, 0, 0, NULL},
        {"cuda-att-steps", "LLM_CUDA_ATT_STEPS", OPTION_INT, "2",
         "least steps of its sub-warps in each context split of the decode attention kernel "
         "(1: twice the splits, to compare)",
         &k->att_steps, 1, 2, NULL},
        {"cuda-rope-att", "LLM_CUDA_ROPE_ATT", OPTION_INT, "-1",
         "most decode rows whose rope, cache write and attention run as one launch, grouped heads or "
         "not (0: never; -1: 4 with groups, 8 without, where it measured faster), to compare",
         &k->rope_att, -1, 64, NULL},
        {"cuda-rope-tc", "LLM_CUDA_ROPE_TC", OPTION_INT, "16",
         "most rows a sequence may have (each sequence of the step 2 or more: speculation's "
         "verifying steps) for the tensor-core attention to do the rope and cache write itself, "
         "saving their launch (0: never, to compare)",
         &k->rope_tc, 0, 16, NULL},
        {"cuda-rope-gqa", "LLM_CUDA_ROPE_GQA", OPTION_BOOL, "true",
         "those steps on attention_gqa.cu, a sequence's rows and a group's query heads the mma's rows, "
         "each K/V row read once for all of them (false: attention_prefill.cu's kernel, to compare)",
         &k->rope_gqa, 0, 0, NULL},
        {"cuda-att-defer", "LLM_CUDA_ATT_DEFER", OPTION_INT, "4",
         "most decode rows whose attention slices a kernel of its own merges, leaving the o "
         "matmul's int8 form as well (0: merged by the attention's last blocks, which then leave "
         "that form at 1-2 rows, to compare)",
         &k->att_defer, 0, 4, NULL},
        {"cuda-att-f16", "LLM_CUDA_ATT_F16", OPTION_BOOL, "true",
         "from 3 rows the attention kernels also write their output's F16 form, so the o matmul "
         "converts nothing (false: the matmul converts, to compare)",
         &k->att_f16, 0, 0, NULL},
        {"cuda-mr", "LLM_CUDA_MR", OPTION_BOOL, "true",
         "matmul_mr.cu, without shared-memory staging, for K-quant weights at 3-16 tokens and Q8_0 "
         "at 4-8 (false: the dp4a kernel and mq, to compare)",
         &k->mr, 0, 0, NULL},
        {"cuda-mr-mixed", "LLM_CUDA_MR_MIXED", OPTION_BOOL, "true",
         "matmul_mr.cu: a Q4_K or Q5_K q and k with a Q6_K v (the \"_M\" files) in one launch "
         "(false: a launch per type, to compare)",
         &k->mr_mixed, 0, 0, NULL},
        {"cuda-mmq-min", "LLM_CUDA_MMQ_MIN", OPTION_INT, "-1",
         "fewest tokens on matmul_mmq.cu, the int8 tensor-core kernel for Q4_K, Q5_K and Q6_K weights, "
         "which then takes every batch up to 64 and every weight (0: never; -1: where it measured faster), "
         "to compare and to test",
         &k->mmq_min, -1, CUDA_MATMUL_VEC_MAX, NULL},
        {"cuda-mmq-q6-max", "LLM_CUDA_MMQ_Q6_MAX", OPTION_INT, "-1",
         "most tokens of every Q6_K weight on matmul_mmq.cu (-1: on sm_80 and later 24 for weights of "
         "more than 8192 rows, where matmul_wide.cu takes over, 64 for the rest; elsewhere 64), "
         "to compare",
         &k->mmq_q6_max, -1, 64, NULL},
        {"cuda-mm-route", "LLM_CUDA_MM_ROUTE", OPTION_CHOICE, "auto",
         "quantized matmuls at 8-64 tokens routed as the card's compute capability sets them (auto), "
         "as on sm_75 (sm75: matmul_mmq.cu for weights or groups of 8192 rows at 3-16 tokens, of 20M "
         "elements at 17-32 and every K-quant weight at 33-64, no matmul_wide.cu) or as on sm_80 and "
         "later (sm80: matmul_mmq.cu for 8192 rows at 3-16 tokens and weights of 20M elements from 17, "
         "Q6_K of more than 8192 rows only to 24 tokens, matmul_wide.cu for the rest where the card has cp.async); the rest of "
         "the routing stays the card's; to compare",
         &k->mm_route, 0, 0, knobs_mm_route_choices},
        {"cuda-dequant-ahead", "LLM_CUDA_DEQUANT_AHEAD", OPTION_BOOL, "true",
         "dequantize a prefill weight's F16 tiles on a side stream while the matmul before runs "
         "(false: one after the other, to compare)",
         &k->dequant_ahead, 0, 0, NULL},
        {"cuda-ahead-sms", "LLM_CUDA_AHEAD_SMS", OPTION_INT, "-1",
         "multiprocessors a large prefill GEMM leaves to the side stream's next tile (0: none; -1: "
         "an eighth of the card's); below the card's count",
         &k->ahead_sms, -1, 1024, NULL},
        {"cuda-dequant-tile-mb", "LLM_CUDA_DEQUANT_TILE_MB", OPTION_INT, "96",
         "MiB of one dequantized F16 weight tile for prefill: the tile's rows are cuBLAS's "
         "parallelism, and 96 holds a whole 11008 x 4096 weight (read on every prefill matmul)",
         &k->dequant_tile_mb, 1, 4096, NULL},
        {"cuda-prefill-tc", "LLM_CUDA_PREFILL_TC", OPTION_BOOL, "true",
         "the tensor-core flash attention for batches with prefill rows (false: the general kernel, "
         "to compare; read on every attention)",
         &k->prefill_tc, 0, 0, NULL},
        {"cuda-mmq-stage", "LLM_CUDA_MMQ_STAGE", OPTION_INT, "2",
         "most tiles of 8 tokens a warp of matmul_mmq.cu whose Q6_K weights come through shared memory "
         "in 16-byte loads, which measured faster up to 16 tokens (0: every weight straight to the "
         "fragments, as Q4_K and Q5_K always are, to compare; read on every launch)",
         &k->mmq_stage, 0, 4, NULL},
        {"cuda-l2-ahead", "LLM_CUDA_L2_AHEAD", OPTION_INT, "1",
         "how far ahead of its own loads a looping decode kernel (attention_gqa.cu's steps, "
         "matmul_mmq.cu's chunks) asks L2 for its next bytes, so that a load one step ahead finds "
         "them there instead of in DRAM (0: never, to compare)",
         &k->l2_ahead, 0, 8, NULL},
        {"cuda-mmq-depth", "LLM_CUDA_MMQ_DEPTH", OPTION_INT, "2",
         "chunks ahead of its work that matmul_mmq.cu loads Q4_K and Q5_K weights and activations "
         "into registers at 3-8 tokens where the row blocks fit one wave (1: one, as elsewhere, to compare)",
         &k->mmq_depth, 1, 2, NULL},
        {"cuda-mmq-tiles", "LLM_CUDA_MMQ_TILES", OPTION_INT, "4",
         "most tiles of 8 tokens a warp of matmul_mmq.cu takes; more tokens go to blocks side by side "
         "on the same rows, each reading the weights again (fewer: more, smaller blocks, to compare)",
         &k->mmq_tiles, 1, 8, NULL},
        {"cuda-mmq-tile", "LLM_CUDA_MMQ_TILE", OPTION_INT, "33",
         "fewest tokens at which matmul_mmq.cu multiplies Q4_K weights of 16384 rows and more (all the "
         "weights of one launch) in 32 x 32 warp tiles, on sm_80 and newer, where their last wave of "
         "blocks is at least half full; the others from 49 at the earliest (0: never, to compare)",
         &k->mmq_tile, 0, 64, NULL},
        {"cuda-att-splits", "LLM_CUDA_ATT_SPLITS", OPTION_INT, "0",
         "context splits a decode row of the attention kernels wants (0: the count whose waves of "
         "blocks take the least time, each block its steps and one more; -1: the fewest that fill one "
         "wave), to compare",
         &k->att_splits, -1, 64, NULL},
    };
    memcpy(defs, t, sizeof t);
    return CUDA_KNOBS_N;
}

/* options_parse_env over defs, then the choice indexes of LLM_CUDA_MV_SPLIT
 * and LLM_CUDA_ATT_RING turned into their counts of warps and stages where
 * defs holds those knobs. */
static int knobs_parse(struct cuda_knobs *k, const struct option_def *defs, int n, char *err,
                       size_t err_size) {
    const struct options o = {"llm-cuda", NULL, NULL, defs, n, false};
    int rc = options_parse_env(&o, err, err_size);
    if (rc < 0) return rc;
    for (int i = 0; i < n; i++) {
        if (defs[i].target == &k->mv_split) k->mv_split = knobs_mv_split_warps[k->mv_split];
        if (defs[i].target == &k->att_ring) k->att_ring = knobs_att_ring_stages[k->att_ring];
    }
    return STATUS_OK;
}

int cuda_knobs_read(struct cuda_knobs *k, char *err, size_t err_size) {
    struct option_def defs[CUDA_KNOBS_N];
    const int n = cuda_knobs_table(k, defs);
    return knobs_parse(k, defs, n, err, err_size);
}

int cuda_knobs_read_one(struct cuda_knobs *k, const char *env, char *err, size_t err_size) {
    struct option_def defs[CUDA_KNOBS_N];
    const int n = cuda_knobs_table(k, defs);
    for (int i = 0; i < n; i++)
        if (strcmp(defs[i].env, env) == 0) return knobs_parse(k, &defs[i], 1, err, err_size);
    return status_fail(err, err_size, STATUS_INTERNAL, "%s is not a knob of the CUDA backend", env);
}

int cuda_knobs_apply(const struct cuda_knobs *k, struct cuda_ctx *ctx, char *err, size_t err_size) {
    if (k->ahead_sms >= ctx->n_sms)
        return status_fail(err, err_size, STATUS_BAD_INPUT,
                           "environment variable LLM_CUDA_AHEAD_SMS: %d is out of range [0, %d] on cuda:%d "
                           "(%d multiprocessors)",
                           k->ahead_sms, ctx->n_sms - 1, ctx->device, ctx->n_sms);
    /* The crossovers of cuda_matmul, from an H100 at 4096 x 4096: on
     * quantized weights the weight-reading kernels beat dequantizing for
     * cuBLAS at every batch up to 64; on F16 weights cuBLAS wins from 8
     * tokens and the warp-per-row kernel below 3. */
    ctx->vec_max_quant = k->skinny_max >= 0 ? k->skinny_max : CUDA_MATMUL_VEC_MAX;
    ctx->vec_max_float = k->skinny_max >= 0 ? k->skinny_max : 2;
    ctx->gemv_max = k->gemv_max; /* -1: matmul.cu's per-type limits */
    ctx->gemm_group = k->gemm_group;
    ctx->mv_split = k->mv_split;
    /* Below the card's own only: a card cannot run a newer one's code. */
    if (k->sm > 0 && k->sm < ctx->cc) ctx->cc = k->sm;
    /* Programmatic dependent launch needs sm_90, cp.async (matmul_wide.cu)
     * and the m16n8k16 mma sm_80. */
    ctx->pdl = ctx->cc >= 90 && k->pdl;
    ctx->wide = ctx->cc >= 80 && k->wide && k->mm_route != 1;
    ctx->wide_items = k->wide_items;
    /* mq at 64 tokens stages a chunk's activations whole, 36 KB, which
     * with the weights' bytes needs up to 70 KB of shared memory a block;
     * sm_75 has 64 KB, so there they come in two halves of the chunk's
     * columns (matmul_vec.cu): each weight is still read once, where the
     * tile path writes and reads back 2 bytes a weight. */
    ctx->mq_nt_max = ctx->cc >= 80 || k->mq64 ? 64 : 32;
    ctx->mq_x_parts = ctx->cc >= 80 ? 1 : 2;
    ctx->att_k16 = ctx->cc >= 80 && !k->att_k8;
    ctx->decode_tc_g = k->decode_tc_g;
    ctx->att_gqa_min = k->att_gqa_min;
    ctx->att_ring = k->att_ring;
    ctx->att_ring_rows = k->att_ring_rows;
    ctx->att_q8_ring_max = k->att_q8_ring_max;
    ctx->att_ring_shallow = k->att_ring_shallow;
    ctx->att_steps = k->att_steps;
    ctx->att_wide = k->att_wide;
    /* One launch for rope, the cache write and attention measured faster
     * up to 4 rows where query heads share a KV head (each query head
     * reads its group's K/V rows, where the tensor-core kernel reads them
     * once), and up to 8 where each has its own (at 16 rows and context
     * 512 the two ops are 0.33 ms a 7B step faster on an H200). */
    ctx->rope_att = k->rope_att >= 0 ? k->rope_att : 4;
    ctx->rope_att_mha = k->rope_att >= 0 ? k->rope_att : 8;
    ctx->rope_tc = k->rope_tc;
    ctx->rope_gqa = k->rope_gqa;
    ctx->att_defer = k->att_defer;
    ctx->att_f16 = k->att_f16;
    ctx->mr = k->mr;
    ctx->mr_mixed = k->mr_mixed;
    ctx->att_splits = k->att_splits;
    /* matmul_mmq.cu's batches as sm_75 or sm_80+ set them (LLM_CUDA_MM_ROUTE). */
    const int mmq80 = k->mm_route == 0 ? ctx->cc >= 80 : k->mm_route == 2;
    const int forced = k->mmq_min >= 0;
    ctx->mmq_min = forced ? k->mmq_min : CUDA_MMQ_MIN_DEFAULT;
    ctx->mmq_max = forced ? CUDA_MATMUL_VEC_MAX : 64;
    ctx->mmq_max_q6 = forced || !mmq80 ? ctx->mmq_max : CUDA_MMQ_MAX_Q6_SM80;
    ctx->mmq_q6_rows = forced || !mmq80 ? 0 : CUDA_MMQ_Q6_ROWS_SM80;
    if (!forced && k->mmq_q6_max >= 0) {
        ctx->mmq_max_q6 = k->mmq_q6_max;
        ctx->mmq_q6_rows = 0;
    }
    ctx->mmq_rows = forced ? 0 : CUDA_MMQ_ROWS_DEFAULT;
    ctx->mmq_elems[0] = forced ? 0 : CUDA_MMQ_ELEMS;
    ctx->mmq_elems[1] = forced || !mmq80 ? 0 : CUDA_MMQ_ELEMS;
    ctx->l2_ahead = k->l2_ahead;
    ctx->mmq_depth = k->mmq_depth;
    ctx->mmq_tiles = k->mmq_tiles;
    ctx->mmq_tile = ctx->cc >= 80 ? k->mmq_tile : 0; /* (cp.async) */
    ctx->mmq_tile_rows = forced ? 0 : CUDA_MMQ_TILE_ROWS;
    ctx->mmq_tile_sparse = forced ? 0 : CUDA_MMQ_TILE_SPARSE;
    ctx->dequant_ahead = k->dequant_ahead;
    ctx->ahead_sms = k->ahead_sms >= 0 ? k->ahead_sms : ctx->n_sms / 8;
    return STATUS_OK;
}

/* The time of `units` split k ways on `slots` resident blocks, each
 * block `steps` long: waves x (steps + 1, its start, whose first loads
 * nothing covers).  The measure both splits below weigh. */
static int64_t knobs_wave_time(int64_t units, int64_t k, int64_t slots, int64_t steps) {
    return (units * k + slots - 1) / slots * (steps + 1);
}

int cuda_mq_split(int n_rb, int n_chunks, int slots, int ks0) {
    if (n_rb < 1 || n_chunks < 1 || slots < 1) return ks0;
    const int64_t c0 = knobs_wave_time(n_rb, ks0, slots, (n_chunks + ks0 - 1) / ks0);
    int best = ks0;
    int64_t best_cost = c0;
    for (int ks = 1; ks <= n_chunks && ks <= CUDA_MQ_SPLIT_MAX; ks++) {
        const int64_t c = knobs_wave_time(n_rb, ks, slots, (n_chunks + ks - 1) / ks);
        if (c < best_cost && c * 16 < c0 * 15) {
            best = ks;
            best_cost = c;
        }
    }
    return best;
}

int64_t cuda_att_split_want(int forced, int64_t max_ctx, int64_t slots, int64_t blocks, int64_t step,
                            int64_t by_ctx, int past_tenths) {
    if (forced > 0) return forced;
    if (blocks < 1) blocks = 1;
    if (slots < 1) slots = 1;
    if (step < 1) step = 1;
    const int64_t fill = (slots + blocks - 1) / blocks; /* the fewest that fill one wave */
    if (forced < 0) return fill;
    int64_t best = 1, best_cost = INT64_MAX, in_fill = INT64_MAX;
    /* Past the fill at most 8 splits: the counts measured there are 2-5,
     * and a grid just past one wave over a long context would weigh up to
     * sqrt(steps) splits, each a partial sum in the scratch and the merge. */
    const int64_t last = past_tenths > 0 && fill < 8 ? 8 : fill;
    for (int64_t s = 1; s <= last && s <= by_ctx; s++) {
        const int64_t len = (max_ctx + s - 1) / s, cost = knobs_wave_time(blocks, s, slots, (len + step - 1) / step);
        if (s > fill && in_fill == INT64_MAX) in_fill = best_cost;
        /* Past the fill only for past_tenths / 10 of the best within it:
         * more, shorter blocks and their merge cost what the waves leave
         * out (llama2-7b's 48 rows at context 512 on attention_q8.cu: 3
         * splits of 28 against 30 unsplit measured 4% slower; llama3-8b's
         * 64 rows at context 512 on the 8-bit ring: 3 splits of 16
         * against 20 measured 3.7% slower). */
        if (cost < best_cost && (s <= fill || cost * 10 < in_fill * past_tenths)) {
            best = s;
            best_cost = cost;
        }
    }
    return best;
}

int cuda_mmq_tile_takes(int from, int sparse_from, int n, int64_t blocks, int64_t slots) {
    if (from <= 0 || n < from) return 0;
    if (n >= sparse_from || slots < 1) return 1;
    const int64_t last = blocks % slots;
    return last == 0 || 2 * last >= slots;
}
