/* The last stage's constrained decoding (docs/grammar.md, "In the
 * cluster"): the vocabulary as the grammar matcher sees it (from the
 * model's tokenizer, built on first use), one compiled grammar per
 * constraint text shared by every sequence that carries it, and each
 * sequence's parse state, advanced by its generated tokens and rebuilt by
 * replaying them when its history changes (a resumed or restarted
 * sequence).  Compute thread only: nothing here locks. */
#ifndef WORKER_CONSTRAIN_H
#define WORKER_CONSTRAIN_H

#include <stddef.h>
#include <stdint.h>

#include "proto/types.pb-c.h"

typedef struct constrain constrain;
struct constrain_grammar; /* one compiled constraint, counted references */

/* A sequence's parse state: g NULL when it has no constraint.  n_done < 0
 * means "replay from the start" (constrain_seq_invalidate). */
struct constrain_seq {
    struct constrain_grammar *g;
    int32_t state;
    int32_t n_done; /* generated tokens the state has taken */
};

/* model_path: where the tokenizer is read from, once, on the first
 * constrained sequence; n_vocab: the model's logits per row (the masks'
 * width).  On success *out is the caller's, freed with constrain_free. */
int constrain_init(constrain **out, const char *model_path, int32_t n_vocab, char *err, size_t errlen);
void constrain_free(constrain *c); /* NULL is fine */

/* Words of one mask: (n_vocab + 63) / 64. */
size_t constrain_mask_words(const constrain *c);

/* Points q at m's constraint (m NULL or without one: q->g becomes NULL),
 * compiling it unless a sequence carried the same text before; keeps q as
 * it is when it already has it.  Returns 0, or a negative status with err
 * naming the constraint ("sampling.grammar: line 1, column 3: ..."; the
 * tokenizer that cannot be read; STATUS_EXHAUSTED: too many distinct
 * constraints in use); q then has none. */
int constrain_seq_set(constrain *c, struct constrain_seq *q, const Llm__SamplingParams *m, char *err,
                      size_t errlen);
/* Drops q's reference (the grammar stays cached for a while). */
void constrain_seq_clear(constrain *c, struct constrain_seq *q);
/* The tokens q took may no longer be the sequence's: replay next time. */
static inline void constrain_seq_invalidate(struct constrain_seq *q) { q->n_done = -1; }

/* Brings q's state over out[0..n_out), the sequence's generated tokens
 * (those already taken are skipped, unless invalidated).  Returns 0, or
 * STATUS_BAD_INPUT when the tokens leave the grammar (err names the
 * token's index), STATUS_EXHAUSTED when its tables are full. */
int constrain_seq_advance(constrain *c, struct constrain_seq *q, const int32_t *out, int32_t n_out,
                          char *err, size_t errlen);

/* mask[0..constrain_mask_words) gets bit t set exactly for the tokens the
 * grammar allows next (end-of-generation only when the output is
 * complete); tokens the tokenizer does not know are never allowed.  0, or
 * STATUS_EXHAUSTED (mask then empty). */
int constrain_seq_mask(constrain *c, const struct constrain_seq *q, uint64_t *mask);

static inline int constrain_mask_allows(const uint64_t *mask, int32_t token) {
    return token >= 0 && (mask[token / 64] >> (token % 64)) & 1;
}

/* Counters for metrics and tests. */
struct constrain_stats {
    int64_t n_compiled;   /* grammars compiled (cache misses) */
    int64_t n_cached;     /* compiled grammars held now */
    int64_t n_replayed;   /* tokens replayed to rebuild a state */
    int64_t n_masks;      /* masks computed */
    int64_t mask_ns;      /* time they took */
};
void constrain_get_stats(const constrain *c, struct constrain_stats *st);

#endif
