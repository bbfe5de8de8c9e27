/* The draft model beside the last stage (docs/router.md, "Speculation"): a
 * whole small model with the target's vocabulary, its own paged KV cache
 * and its own block tables, that proposes the tokens a sequence's next step
 * will verify.  It follows each sequence's accepted tokens as the last stage
 * knows them, computes again only what changed (a rejected draft, a
 * rollback, a sequence resumed elsewhere), and draws each guess with the
 * sampling rule and the (seed, position) draw the target uses at that
 * position, so that a guess is accepted whenever the two models agree there.
 *
 *   draft *d;   (draft_file: model_file_open of "draft.gguf", open while d is)
 *   if (draft_open(&d, draft_file, target_model, backend, &cfg, err, sizeof err) < 0) ...
 *   struct draft_seq ds;  draft_seq_init(&ds);
 *   ... after each step of the sequence:
 *   struct draft_req r = {&ds, hist, n_hist, params, k, out};
 *   draft_propose(d, &r, 1, err, sizeof err);   // r.n_out guesses in out
 *   draft_seq_clear(d, &ds);  draft_free(d); */
#ifndef WORKER_DRAFT_H
#define WORKER_DRAFT_H
#include <stddef.h>
#include <stdint.h>
#include "common/kvblocks.h"
#include "common/model.h"
#include "common/sampling.h"
#include "kernels/backend.h"

typedef struct draft draft;

struct draft_config {
    int32_t n_tokens_max; /* rows per draft pass, all sequences together */
    int32_t n_seqs_max;   /* sequences per pass */
    int32_t n_ctx_max;    /* positions per sequence (the target's) */
    int32_t block_size;   /* KV positions per block */
    int32_t n_blocks;     /* KV blocks of the draft's own pool */
    int32_t kv_type;      /* as stage_config.kv_type */
    /* > 0: a sequence's guesses stop before the first the draft gives less
     * than this probability (its softmax after penalties, before
     * temperature): an unlikely guess is rarely accepted, and each costs a
     * draft pass and a verified position (docs/router.md, "Speculation").
     * 0: always k guesses. */
    float min_prob;
    int32_t weight_type; /* as stage_config.weight_type: < 0 as stored, else its float matrices converted */
};

/* The draft's state of one sequence (the caller's, one per sequence). */
struct draft_seq {
    int32_t *tok;  /* the tokens the draft knows: accepted ones, then its last guesses */
    int32_t n_tok, cap;
    int32_t n_kv;  /* positions 0..n_kv-1 of its cache hold the KV of tok[0..n_kv) */
    struct kvblocks_table table;
};

/* Checks that the draft model file has the target's vocabulary (size and
 * every token's bytes).  STATUS_BAD_INPUT with err naming both files, both
 * sizes or the first differing token id. */
int draft_vocab_check(const model_file *draft_m, const model_file *target, char *err, size_t errlen);
/* Checks the vocabulary of the open model file m against target
 * (draft_vocab_check) and loads the whole model on b with its KV pool.
 * Returns 0 and *out (freed by draft_free; b and m must outlive it, and m
 * stays the caller's to close), or a negative status with err naming the
 * file (then nothing is left allocated). */
int draft_open(draft **out, model_file *m, const model_file *target, backend *b, const struct draft_config *cfg,
               char *err, size_t errlen);
void draft_free(draft *d);
const char *draft_path(const draft *d);

void draft_seq_init(struct draft_seq *ds);
/* Releases the sequence's KV blocks and memory (d may be NULL once the
 * draft is freed: then only the memory). */
void draft_seq_clear(draft *d, struct draft_seq *ds);

/* One sequence to draft for: its accepted tokens (the last one is the token
 * just answered, whose KV nobody has computed yet), its sampling
 * parameters, and up to k guesses to write to out. */
struct draft_req {
    struct draft_seq *ds;
    const int32_t *tokens;
    int32_t n_tokens;
    const struct sampling_params *params;
    int32_t k;
    int32_t *out;
    int32_t n_out; /* out: guesses written (0 when the pool or the context is short) */
    int32_t tag;   /* the caller's (untouched) */
};
/* Runs the draft passes for all reqs together: first what each sequence's
 * cache lacks (its new tokens, in chunks within n_tokens_max), then one
 * token a pass until each has its k guesses (fewer under cfg.min_prob).  A sequence that cannot be
 * drafted (no KV blocks left, the context's end) gets n_out 0 and the others
 * go on.  Returns 0, or a negative status when a pass fails (err says why;
 * every n_out is then 0). */
int draft_propose(draft *d, struct draft_req *reqs, int32_t n_reqs, char *err, size_t errlen);
#endif
