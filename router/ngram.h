/* Prompt lookup: drafts for speculative decoding found in a sequence's own
 * tokens (prompt and output), with no model.  Where the output repeats its
 * input (code edits, retrieval, summaries) the tokens that followed the
 * last occurrence of the sequence's current suffix are a good guess of
 * what comes next; the pipeline verifies them (docs/router.md,
 * "Speculation"). */
#ifndef ROUTER_NGRAM_H
#define ROUTER_NGRAM_H

#include <stdint.h>

/* Looks for the longest suffix of tokens[0..n_tokens) of n_max down to
 * n_min tokens that also occurs earlier in tokens (its latest earlier
 * occurrence), and copies the up to k tokens that followed that occurrence
 * into out[0..k).  Returns how many (0: no match, or k < 1, or bad sizes).
 * Cost: O(n_tokens * n_max) compares.  Allocates nothing. */
int32_t ngram_propose(const int32_t *tokens, int32_t n_tokens, int32_t n_max, int32_t n_min,
                      int32_t k, int32_t *out);

#endif
