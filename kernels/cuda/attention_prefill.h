/* What attention.cu and attention_prefill.cu call of each other, as plain
 * prototypes: the tensor-core flash attention for batches that hold
 * prefill rows (attention_prefill.cu) for attention.cu's dispatch, and the
 * scratch layout both use (attention.cu).  Nothing here allocates beyond
 * the backend's scratch. */
#ifndef KERNELS_CUDA_ATTENTION_PREFILL_H
#define KERNELS_CUDA_ATTENTION_PREFILL_H

#include "cuda_ops.h"

#ifdef __cplusplus
extern "C" {
#endif

/* 1 if cuda_attention_prefill takes this batch: some sequence has more
 * than one row, F16 or Q8_0 cache, head_dim 64 or 128, query heads per KV head a
 * power of two up to 64, 16-byte aligned q, out and cache, and the
 * variable LLM_CUDA_PREFILL_TC is not "0" (it exists to measure the
 * general kernel against this one). */
int cuda_attention_prefill_takes(const struct cuda_attn_args *a);
/* 1 if cuda_attention_prefill can run this batch at all (the conditions
 * above but the prefill rows): attention.cu also gives it decode-only
 * batches of large groups (cuda_ctx.decode_tc_g). */
int cuda_attention_tc_fits(const struct cuda_attn_args *a);
/* The same result as cuda_attention for a batch it takes (Q and the
 * probabilities rounded to F16 for the tensor cores, F32 softmax and
 * accumulation).  Arguments already checked by cuda_attention. */
int cuda_attention_prefill(struct cuda_ctx *ctx, const struct cuda_attn_args *a);
/* The scratch of an attention launch (attention.cu): where the rows want
 * it (ctx->att_f16, more than 2 rows), the F16 form of a->out for the
 * matmul after it at the scratch's start, recorded as that form
 * (cuda_gemm_act; *out16, else NULL), then part_bytes for the split sums
 * (*part, NULL when part_bytes is 0).  STATUS_NO_MEMORY without scratch. */
int cuda_att_scratch(struct cuda_ctx *ctx, const struct cuda_attn_args *a, size_t part_bytes, uint16_t **out16,
                     float **part);
/* The context split of a decode launch of `blocks` (n_idx rows or
 * sequences x n_kv_heads) for `slots` resident blocks: the splits a row
 * wants (cuda_att_split_want, LLM_CUDA_ATT_SPLITS: the waves weighed
 * against the blocks' lengths, up to the fewest that fill one wave or,
 * past_tenths > 0, past them by that margin; capped at max_splits), each at least `least` positions and a multiple of `step`:
 * the grid's splits (enough for the longest context, a->max_ctx; each row
 * cuts its own from its length on the device), and the scratch
 * (cuda_att_scratch) with the partial sums when there are several. */
struct cuda_att_split {
    int32_t want, step, least, n_splits;
    float *part_acc; /* (n_splits, n_idx, n_heads, head_dim), NULL for one split */
    float *part_ml;  /* (n_splits, n_idx, n_heads, 2) */
    uint16_t *out16; /* out's F16 form, or NULL */
};
int cuda_att_split(struct cuda_ctx *ctx, const struct cuda_attn_args *a, int32_t n_idx, int64_t slots, int64_t blocks,
                   int past_tenths, int64_t step, int64_t least, int64_t max_splits, struct cuda_att_split *s);

#ifdef __cplusplus
}
#endif

#endif
