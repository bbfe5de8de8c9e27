/* One batched step of a stage: several sequences, each at its own position
 * with its own block table, each bringing a prefill chunk or one decode
 * token, run through the stage's layers together.  The first stage embeds
 * token ids; later stages take the previous stage's hidden states; the last
 * stage returns logits for the rows that ask for them.  Every argument is
 * checked on the host before anything is launched. */
#ifndef WORKER_FORWARD_H
#define WORKER_FORWARD_H

#include <stddef.h>
#include <stdint.h>

#include "common/kvblocks.h"
#include "kernels/backend.h"
#include "stage.h"

/* Which rows of a sequence get logits on the last stage. */
enum forward_logits {
    FORWARD_LOGITS_LAST = 0, /* the sequence's last row (sampling the next token) */
    FORWARD_LOGITS_ALL = 1,  /* every row (teacher forcing, evaluation) */
    FORWARD_LOGITS_NONE = 2, /* none (a prefill chunk that is not the last) */
};

struct forward_seq {
    const int32_t *tokens;      /* (n_tokens) token ids; read by the first stage only */
    int32_t n_tokens;           /* >= 1 */
    int32_t pos0;               /* position of the first row; KV of 0..pos0-1 is in the cache */
    const int32_t *block_table; /* (n_blocks) block ids covering positions 0..pos0+n_tokens-1 */
    int32_t n_blocks;
    enum forward_logits logits;
};

struct forward_batch {
    const struct forward_seq *seqs; /* (n_seqs); rows are laid out sequence after sequence */
    int32_t n_seqs;
    /* Copy-on-write instructions from kvblocks_reserve, run before the step. */
    const struct kvblocks_copy *copies;
    int32_t n_copies;
    /* Stages after the first: [n_tokens, dim] F32 input rows, in host memory,
     * or in backend memory when hidden_in_backend is 1 (e.g. received from
     * the previous stage over NCCL). */
    const float *hidden_in;
    int hidden_in_backend;
};

struct forward_out {
    /* Last stage: host buffer of forward_logits_rows(batch) * n_vocab floats,
     * the caller's; rows in sequence order.  NULL: logits are not fetched. */
    float *logits;
    int32_t n_logits; /* set by forward_step: rows written (or sampled) */
    /* Other stages: host buffer [n_tokens, dim] for the output hidden states,
     * or NULL (then read forward_hidden()). */
    float *hidden;
    /* Last stage: one sampling request per logits row (rows in sequence
     * order, forward_logits_rows(batch) of them), or NULL.  The tokens are
     * picked on the stage's backend (backend_sample: a GPU samples on the
     * device, downloading only the results); with logits NULL the logits
     * never reach the host. */
    struct backend_sample_row *sample;
};

/* Last stage: fn(arg) is called by each later forward_step that samples,
 * once the step's ops are queued and before its rows are sampled, so that
 * host work the sampling needs (a grammar's masks in sample[r].allow) runs
 * while a GPU computes.  fn NULL: none. */
void forward_set_before_sample(stage *s, void (*fn)(void *arg), void *arg);

/* Rows of logits the batch asks for (on the last stage). */
int32_t forward_logits_rows(const struct forward_batch *batch);

/* Runs one step.  Returns 0, or a negative status with a message in err
 * naming the sequence and the value: STATUS_BAD_INPUT for a token id >=
 * n_vocab, a position past n_ctx_max or past the block table, a block id out
 * of range, too many rows or sequences; a backend failure otherwise.  When
 * it fails before launching, the KV cache is untouched. */
int forward_step(stage *s, const struct forward_batch *batch, struct forward_out *out, char *err,
                 size_t errlen);

/* The part of a step that needs no input rows: checks the batch (but for
 * hidden_in), waits for the stage's previous step where that still reads
 * the metadata buffer, and queues the step's metadata upload and block
 * copies.  A stage after the first calls it before it asks its link for
 * the input, so that none of this comes after the input's arrival on a
 * GPU's stream; forward_step with the same batch (hidden_in set) and out
 * then does the rest.  Without it forward_step does both parts.  Returns
 * as forward_step does; on failure forward_step starts afresh. */
int forward_begin(stage *s, const struct forward_batch *batch, const struct forward_out *out, char *err,
                  size_t errlen);
/* A step begun and then given up before forward_step (its input never
 * came): the next forward_step starts afresh. */
void forward_cancel(stage *s);

/* The stage's output hidden states of the last step, [n_tokens, dim] F32 in
 * backend memory (valid until the next step): what a stage sends on.  When
 * forward_out.hidden was NULL the step was only queued: ops on the stage's
 * backend stream see the result in order; anything else must backend_sync
 * first.  Likewise a host hidden_in must stay valid until the step ends. */
const float *forward_hidden(const stage *s);

/* The backend buffer [n_tokens_max, dim] F32 that a stage after the first
 * reads its input rows from.  A transport may write the received rows here
 * (converting F16 to F32 with backend_convert, say) and pass this pointer as
 * hidden_in with hidden_in_backend = 1: the step then copies nothing.  It is
 * also where the step leaves its output (forward_hidden), so it must be
 * filled after the previous output was sent. */
float *forward_input_buffer(stage *s);

#endif
