/* A worker's step and KV sizes from its memory budget, its model and its
 * stage's layers: sequences per step, tokens per step and KV blocks, each
 * either given (a flag) or chosen here, with the arithmetic written out for
 * the log.  Pure arithmetic, no device: node_mem.c feeds it the device's
 * numbers, tests feed it made-up cards.
 *
 *   struct sizing_input in = {...};   // 0 in kv_blocks/max_seqs/max_tokens: choose
 *   struct sizing out;
 *   if (sizing_choose(&out, &in, err, sizeof err) < 0) refuse(err);
 *   LOG(LL_INFO, "%s", out.why); */
#ifndef WORKER_SIZING_H
#define WORKER_SIZING_H

#include <stddef.h>
#include <stdint.h>

/* Chosen sequences per step stop here: the router's plans and the step's
 * host buffers grow with it, and a decode step of more sequences than this
 * is bound by compute, not by reading the weights. */
#define SIZING_SEQS_MAX 256
/* Tokens a step has for prefill chunks on top of one decode token per
 * sequence. */
#define SIZING_PREFILL_CHUNK 512
/* Positions a typical sequence reaches (prompt and output), when not given. */
#define SIZING_TARGET_CTX_DEFAULT 2048
/* The CPU's sequences per step when not given (it runs the tests). */
#define SIZING_CPU_SEQS 16

/* Which limits sizing_choose chose (the others were given). */
enum sizing_auto {
    SIZING_AUTO_KV_BLOCKS = 1,
    SIZING_AUTO_TOKENS = 2,
    SIZING_AUTO_SEQS = 4,
};

struct sizing_input {
    int gpu;                /* 0: the CPU's small defaults, KV for max_seqs whole contexts */
    size_t mem_free;        /* bytes free on the device before the stage loads */
    double mem_fraction;    /* share of mem_free for weights, KV and workspace (GPU) */
    size_t weight_bytes;    /* the stage's weights on the device */
    size_t kv_block_bytes;  /* one block of every layer of the stage, K and V
                               (layers x kvcache_block_bytes) */
    int32_t block_size;     /* positions per KV block */
    int32_t dim, ffn_dim, n_vocab;
    int32_t n_ctx;          /* positions per sequence the stage accepts */
    int32_t target_ctx;     /* positions a typical sequence reaches; 0: 2048; capped at n_ctx */
    int32_t stage_count;    /* stages of the pipeline: each stage holds the KV of every
                               micro-batch in flight, one per stage */
    /* Given values; 0 (or less): choose. */
    int32_t kv_blocks, max_seqs, max_tokens;
    /* A draft model beside the stage (--draft-model; 0s without): what it
     * takes whatever the KV (its weights on a GPU, workspace, the blocks
     * of its guesses), and its bytes for each block of the stage's, since
     * its pool mirrors the stage's blocks. */
    size_t draft_bytes, draft_block_bytes;
};

struct sizing {
    int32_t kv_blocks, max_seqs, max_tokens;
    int32_t target_ctx;   /* as used (capped at n_ctx) */
    int32_t kv_seqs;      /* sequences of target_ctx positions the KV blocks hold */
    unsigned auto_mask;   /* enum sizing_auto */
    size_t work_bytes;    /* workspace estimate for max_tokens and max_seqs */
    size_t kv_bytes;      /* kv_blocks x kv_block_bytes */
    char why[768];        /* the arithmetic, one line for the log */
};

/* Upper estimate of a stage's workspace for steps of max_tokens tokens and
 * max_seqs sequences: activations, attention and lm_head scratch, and on a
 * GPU cuBLAS and three dequantized prefill tiles of up to 96 MiB. */
size_t sizing_workspace_bytes(int gpu, int32_t max_tokens, int32_t max_seqs, int32_t dim,
                              int32_t ffn_dim, int32_t n_vocab);

/* Fills *out.  On a GPU the KV blocks are what mem_free x mem_fraction
 * leaves after the weights, the workspace and a draft's fixed bytes, each
 * block with the draft's block beside it; sequences per step are the
 * sequences of target_ctx that those blocks hold, divided by stage_count,
 * at most SIZING_SEQS_MAX, rounded down to a multiple of 8 from 16 up;
 * tokens per step are one per sequence plus SIZING_PREFILL_CHUNK, rounded up
 * to a multiple of 64.  On the CPU: 16 sequences, 512 tokens, and blocks for
 * max_seqs whole contexts of n_ctx.  STATUS_NO_MEMORY with err naming each
 * size when not even one KV block fits; STATUS_BAD_INPUT for a shape that
 * is not positive. */
int sizing_choose(struct sizing *out, const struct sizing_input *in, char *err, size_t errlen);

#endif
