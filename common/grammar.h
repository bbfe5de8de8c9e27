/* Constrained decoding: a GBNF grammar (llama.cpp's format) compiled to a
 * byte-level pushdown matcher, a parse state per sequence, and per step the
 * set of tokens that keep the output inside the grammar, as a bitmask over
 * the vocabulary (computed by walking a token trie, cached per state).
 *
 *   grammar *g;  grammar_vocab *v;  int32_t st;
 *   grammar_parse(&g, text, len, err, sizeof err);       // the root rule is "root"
 *   grammar_vocab_from_tokenizer(&v, tok, err, sizeof err);
 *   grammar_state_start(g, &st);
 *   loop: grammar_mask(g, v, st, mask);  ... sample a token t allowed by mask ...
 *         grammar_state_accept_token(g, v, st, t, &st);
 *
 * A state is a small integer naming a set of parse stacks inside g: it costs
 * nothing to copy or store, and replaying a sequence's tokens from
 * grammar_state_start rebuilds it (resume after a crash or preemption).
 * A grammar_vocab is immutable once built and may be shared by threads; a
 * grammar's caches are guarded by a mutex inside it, so one compiled grammar
 * may serve many sequences on many threads. */
#ifndef COMMON_GRAMMAR_H
#define COMMON_GRAMMAR_H

#include <stddef.h>
#include <stdint.h>

#include "tokenizer.h"

typedef struct grammar grammar;
typedef struct grammar_vocab grammar_vocab;

/* The state after a token that broke the grammar, or of a grammar whose
 * tables are full: never allowed anywhere. */
#define GRAMMAR_STATE_DEAD (-1)

/* Compiles GBNF text (len bytes; need not be NUL-terminated) whose start
 * rule is "root".  On success *out is the caller's, freed with
 * grammar_free.  On failure *out is NULL, STATUS_BAD_INPUT is returned and
 * err names the place as "line L, column C: what" (1-based, columns in
 * bytes): a syntax error, an undefined rule, a left-recursive rule, a
 * missing root. */
int grammar_parse(grammar **out, const char *text, size_t len, char *err, size_t errlen);
void grammar_free(grammar *g); /* NULL is fine */

/* Bounds on a grammar's tables (parse stacks, states, cached masks).  A
 * grammar that would pass them makes later calls fail with
 * STATUS_EXHAUSTED instead of growing without end; 0 keeps a default. */
#define GRAMMAR_STACKS_MAX 256
struct grammar_limits {
    int32_t n_nodes_max;       /* stack frames; default 1 << 22 */
    int32_t n_states_max;      /* default 1 << 20 */
    size_t mask_cache_bytes;   /* cached masks; default 64 MiB, then the cache restarts */
    int32_t n_stacks_max;      /* parse stacks in one state; default GRAMMAR_STACKS_MAX.  A mask costs about
                                * this times the trie: an ambiguous grammar ("item ::= [a-z]+
                                * item+") adds stacks with every byte, which would make each
                                * step of a batch slower without end.  JSON schemas' grammars
                                * keep about a dozen. */
};
void grammar_set_limits(grammar *g, const struct grammar_limits *lim);

/* The vocabulary as the matcher sees it: each token's bytes (what the
 * client's text will contain), the end-of-generation tokens (allowed only
 * where the grammar is complete) and the tokens never allowed (control
 * tokens, tokens without bytes).  On success *out is the caller's, freed
 * with grammar_vocab_free; it does not refer to t afterwards. */
int grammar_vocab_from_tokenizer(grammar_vocab **out, const tokenizer *t, char *err,
                                 size_t errlen);
/* The same from plain arrays (tests, benchmarks): token i is bytes[i] of
 * lens[i] bytes (lens[i] 0: never allowed); eog[0..n_eog) are the
 * end-of-generation ids. */
int grammar_vocab_from_bytes(grammar_vocab **out, int32_t n_vocab, const char *const *bytes,
                             const int32_t *lens, const int32_t *eog, int32_t n_eog, char *err,
                             size_t errlen);
void grammar_vocab_free(grammar_vocab *v); /* NULL is fine */
int32_t grammar_vocab_n_vocab(const grammar_vocab *v);
/* Words of a mask over v: (n_vocab + 63) / 64. */
size_t grammar_vocab_mask_words(const grammar_vocab *v);
int grammar_vocab_is_eog(const grammar_vocab *v, int32_t token);

/* The state before any output. 0 or STATUS_EXHAUSTED. */
int grammar_state_start(grammar *g, int32_t *state);
/* 1 when the output so far is a whole sentence of the grammar (EOS is then
 * allowed), 0 otherwise (also for GRAMMAR_STATE_DEAD). */
int grammar_state_is_complete(grammar *g, int32_t state);
/* *next = the state after len more bytes, GRAMMAR_STATE_DEAD when they
 * leave the grammar.  Returns 0, or STATUS_EXHAUSTED (tables full; *next is
 * then DEAD). */
int grammar_state_accept_bytes(grammar *g, int32_t state, const void *bytes, size_t len,
                               int32_t *next);
/* The same for one token: its bytes; an end-of-generation token keeps a
 * complete state and kills an incomplete one; a never-allowed token kills. */
int grammar_state_accept_token(grammar *g, const grammar_vocab *v, int32_t state, int32_t token,
                               int32_t *next);

/* mask[0..grammar_vocab_mask_words(v)) gets bit t (mask[t / 64] >> (t % 64))
 * set exactly for the tokens t after which the output can still be
 * completed inside the grammar, and for the end-of-generation tokens when
 * state is complete.  A DEAD state gives an empty mask.  Returns 0 or
 * STATUS_EXHAUSTED (mask then empty).  Cached per state: the first call for
 * a state walks the token trie, the next ones copy. */
int grammar_mask(grammar *g, const grammar_vocab *v, int32_t state, uint64_t *mask);

/* Counters for metrics and benchmarks. */
struct grammar_stats {
    int64_t n_nodes, n_states, n_masks_computed, n_masks_cached;
    int64_t n_trie_visits; /* trie nodes the mask walks visited */
};
void grammar_get_stats(grammar *g, struct grammar_stats *st);

#endif
