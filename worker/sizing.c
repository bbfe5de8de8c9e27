/* A worker's step and KV sizes from its memory budget, its model and its
 * stage's layers (see sizing.h): the arithmetic, and the log line that
 * shows it. */
#include "sizing.h"

#include "common/status.h"

#include <stdio.h>
#include <string.h>

static double sizing_gib(double bytes) { return bytes / (1024.0 * 1024.0 * 1024.0); }

size_t sizing_workspace_bytes(int gpu, int32_t max_tokens, int32_t max_seqs, int32_t dim,
                              int32_t ffn_dim, int32_t n_vocab) {
    return (size_t)max_tokens * 4 * (8 * (size_t)dim + 3 * (size_t)ffn_dim) +
           (size_t)max_seqs * (size_t)n_vocab * 4 + (gpu ? (size_t)(64 + 3 * 96) << 20 : 0);
}

/* One decode token per sequence and a prefill chunk, in whole tiles of 64
 * rows (the prefill GEMMs' granularity). */
static int32_t sizing_tokens_for(int32_t seqs) {
    int32_t t = seqs + SIZING_PREFILL_CHUNK;
    return (t + 63) / 64 * 64;
}

/* Sequences per step from the sequences the KV cache holds: a stage keeps
 * the KV of every micro-batch in flight (one per stage), so each step gets
 * its share.  From 16 up the count is a multiple of 8, the token width of
 * the tensor-core tiles that decode matmuls use; below, every sequence
 * counts. */
static int32_t sizing_seqs_for(int32_t kv_seqs, int32_t stages) {
    int32_t s = kv_seqs / (stages > 0 ? stages : 1);
    if (s > SIZING_SEQS_MAX) s = SIZING_SEQS_MAX;
    if (s >= 16) s -= s % 8;
    return s < 1 ? 1 : s;
}

/* KV blocks the budget leaves after weights and a workspace, or -1 when
 * not one fits. */
static int64_t sizing_blocks_for(const struct sizing_input *in, double budget, size_t work) {
    double left = budget - (double)in->weight_bytes - (double)work - (double)in->draft_bytes;
    double per = (double)in->kv_block_bytes + (double)in->draft_block_bytes;
    if (left < per) return -1;
    double nb = left / per;
    return nb > (double)(1 << 24) ? (1 << 24) : (int64_t)nb;
}

int sizing_choose(struct sizing *out, const struct sizing_input *in, char *err, size_t errlen) {
    memset(out, 0, sizeof *out);
    if (in->block_size < 1 || in->kv_block_bytes == 0 || in->n_ctx < 1 || in->dim < 1 ||
        in->n_vocab < 1)
        return status_fail(err, errlen, STATUS_BAD_INPUT,
                           "sizing: block size %d, %zu bytes a KV block, context %d, dim %d, "
                           "vocabulary %d: each must be positive",
                           in->block_size, in->kv_block_bytes, in->n_ctx, in->dim, in->n_vocab);
    int32_t bs = in->block_size, stages = in->stage_count > 0 ? in->stage_count : 1;
    int32_t target = in->target_ctx > 0 ? in->target_ctx : SIZING_TARGET_CTX_DEFAULT;
    if (target > in->n_ctx) target = in->n_ctx;
    int32_t per_seq = (target + bs - 1) / bs; /* blocks one typical sequence fills */
    out->target_ctx = target;
    int given_seqs = in->max_seqs > 0, given_tokens = in->max_tokens > 0;
    int given_blocks = in->kv_blocks > 0;
    int32_t seqs = given_seqs ? in->max_seqs : 0;
    char kv_part[256];

    if (!in->gpu) {
        /* The CPU runs the tests: small fixed steps, and KV for every
         * sequence of a step at the whole context (a few MiB on the test
         * models). */
        if (!given_seqs) seqs = SIZING_CPU_SEQS;
        int32_t blocks = given_blocks ? in->kv_blocks : seqs * ((in->n_ctx + bs - 1) / bs);
        out->kv_blocks = blocks;
        snprintf(kv_part, sizeof kv_part, "KV: %d blocks x %d = %lld positions%s",
                 blocks, bs, (long long)blocks * bs,
                 given_blocks ? " (--kv-blocks)" : " (CPU: max-seqs whole contexts)");
    } else {
        double budget = (double)in->mem_free * in->mem_fraction;
        /* The workspace grows with the step, the step with the KV: size the
         * KV for the largest step first, take the step it allows, then give
         * the workspace that step does not need back to the KV. */
        int32_t seqs_hi = given_seqs ? seqs : SIZING_SEQS_MAX;
        int32_t tokens_hi = given_tokens ? in->max_tokens : sizing_tokens_for(seqs_hi);
        size_t work = sizing_workspace_bytes(1, tokens_hi, seqs_hi, in->dim, in->ffn_dim, in->n_vocab);
        int64_t blocks = given_blocks ? in->kv_blocks : sizing_blocks_for(in, budget, work);
        if (blocks < 1)
            return status_fail(err, errlen, STATUS_NO_MEMORY,
                               "weights %.2f GiB + workspace ~%.2f GiB (%d tokens, %d sequences "
                               "per step)%s%.2f GiB leave no room for a KV block (%.2f MiB) in %.2f of "
                               "%.2f GiB free (--mem-fraction %.2f): use more stages or a "
                               "smaller model",
                               sizing_gib((double)in->weight_bytes), sizing_gib((double)work),
                               tokens_hi, seqs_hi, in->draft_bytes ? " + the draft model " : "",
                               in->draft_bytes ? sizing_gib((double)in->draft_bytes) : 0.0,
                               (in->kv_block_bytes + in->draft_block_bytes) / 1048576.0, in->mem_fraction,
                               sizing_gib((double)in->mem_free), in->mem_fraction);
        if (!given_seqs) {
            seqs = sizing_seqs_for((int32_t)(blocks / per_seq), stages);
            int32_t tokens = given_tokens ? in->max_tokens : sizing_tokens_for(seqs);
            work = sizing_workspace_bytes(1, tokens, seqs, in->dim, in->ffn_dim, in->n_vocab);
            if (!given_blocks) blocks = sizing_blocks_for(in, budget, work);
        }
        out->kv_blocks = (int32_t)blocks;
        if (given_blocks)
            snprintf(kv_part, sizeof kv_part, "KV: %d blocks (--kv-blocks) x %d = %lld positions",
                     out->kv_blocks, bs, (long long)blocks * bs);
        else if (in->draft_bytes || in->draft_block_bytes)
            snprintf(kv_part, sizeof kv_part,
                     "KV: %.2f x %.2f GiB free = %.2f GiB - weights %.2f GiB - workspace %.2f GiB "
                     "- draft %.2f GiB = %.2f GiB / (%.3f + the draft's %.3f) MiB a block = %d blocks x %d = "
                     "%lld positions",
                     in->mem_fraction, sizing_gib((double)in->mem_free), sizing_gib(budget),
                     sizing_gib((double)in->weight_bytes), sizing_gib((double)work),
                     sizing_gib((double)in->draft_bytes),
                     sizing_gib(budget - (double)in->weight_bytes - (double)work - (double)in->draft_bytes),
                     in->kv_block_bytes / 1048576.0, in->draft_block_bytes / 1048576.0, out->kv_blocks, bs,
                     (long long)blocks * bs);
        else
            snprintf(kv_part, sizeof kv_part,
                     "KV: %.2f x %.2f GiB free = %.2f GiB - weights %.2f GiB - workspace %.2f GiB "
                     "= %.2f GiB / %.2f MiB a block = %d blocks x %d = %lld positions",
                     in->mem_fraction, sizing_gib((double)in->mem_free), sizing_gib(budget),
                     sizing_gib((double)in->weight_bytes), sizing_gib((double)work),
                     sizing_gib(budget - (double)in->weight_bytes - (double)work),
                     in->kv_block_bytes / 1048576.0, out->kv_blocks, bs, (long long)blocks * bs);
    }
    out->kv_seqs = out->kv_blocks / per_seq;
    out->max_seqs = seqs;
    out->max_tokens = given_tokens ? in->max_tokens
                      : in->gpu    ? sizing_tokens_for(seqs)
                                   : SIZING_PREFILL_CHUNK;
    out->work_bytes = sizing_workspace_bytes(in->gpu, out->max_tokens, out->max_seqs, in->dim,
                                             in->ffn_dim, in->n_vocab);
    out->kv_bytes = (size_t)out->kv_blocks * in->kv_block_bytes;
    out->auto_mask = (given_blocks ? 0u : SIZING_AUTO_KV_BLOCKS) |
                     (given_tokens ? 0u : SIZING_AUTO_TOKENS) | (given_seqs ? 0u : SIZING_AUTO_SEQS);

    char seqs_part[128], tokens_part[96];
    if (given_seqs) snprintf(seqs_part, sizeof seqs_part, "--max-seqs");
    else if (!in->gpu) snprintf(seqs_part, sizeof seqs_part, "CPU default");
    else
        snprintf(seqs_part, sizeof seqs_part, "%d / %d stage%s, at most %d, a multiple of 8 from 16",
                 out->kv_seqs, stages, stages == 1 ? "" : "s", SIZING_SEQS_MAX);
    if (given_tokens) snprintf(tokens_part, sizeof tokens_part, "--max-batch-tokens");
    else if (!in->gpu) snprintf(tokens_part, sizeof tokens_part, "CPU default");
    else
        snprintf(tokens_part, sizeof tokens_part, "%d + %d, up to a multiple of 64", seqs,
                 SIZING_PREFILL_CHUNK);
    snprintf(out->why, sizeof out->why,
             "%s = %d sequences of %d; max-seqs %d (%s), max-batch-tokens %d (%s)", kv_part,
             out->kv_seqs, target, out->max_seqs, seqs_part, out->max_tokens, tokens_part);
    return STATUS_OK;
}
