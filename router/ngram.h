/* Prompt lookup: drafts for speculative decoding found in a sequence's own
 * tokens (prompt and output), with no model.  Where the output repeats its
 * input (code edits, retrieval, summaries) the tokens that followed the
 * last occurrence of the sequence's current suffix are a good guess of
 * what comes next; the pipeline verifies them (docs/router.md,
 * "Speculation"). */
#ifndef ROUTER_NGRAM_H
#define ROUTER_NGRAM_H

#include <stdbool.h>
#include <stdint.h>

/* Looks for the longest suffix of tokens[0..n_tokens) of n_max down to
 * n_min tokens that also occurs earlier in tokens (its latest earlier
 * occurrence), and copies the tokens that followed that occurrence into
 * out: at most k, and at most g + 1 after a match of g tokens (a one-token
 * match drafts two).  Returns how many (0: no match, or k < 1, or bad
 * sizes).
 * Cost: O(n_tokens * n_max) compares.  Allocates nothing. */
int32_t ngram_propose(const int32_t *tokens, int32_t n_tokens, int32_t n_max, int32_t n_min,
                      int32_t k, int32_t *out);

/* Prompt lookup with a predicted output (GenerateRequest.prediction): the
 * sequence is prompt[0..n_prompt) followed by out[0..n_out) (n_out >= 1),
 * and the lookup text is the prompt followed by pred[0..n_pred), so that
 * the n-gram ending the prompt is found right before the prediction.  For
 * g = n_max down to n_min, the sequence's last g tokens are looked up in
 * that text where at least one prediction token follows them; of several
 * occurrences, the one whose next prediction index j is nearest to
 * n_out + *offset (the alignment of the last match: insertions and
 * deletions in the output move it) wins, ties to the earlier.  The up to k
 * prediction tokens from j are copied to out_draft and *offset becomes
 * j - n_out.  When the prediction has no match, ngram_propose's lookup in
 * the sequence itself is tried.  Returns how many drafts (0: none);
 * *from_pred (when not NULL) says whether they are the prediction's
 * tokens (true) or the sequence's own lookup's (the prediction's usage
 * counts only the former).  Cost: O((n_prompt + n_pred + n_out) * n_max)
 * compares.  Allocates nothing. */
int32_t ngram_propose_pred(const int32_t *prompt, int32_t n_prompt, const int32_t *pred, int32_t n_pred,
                           const int32_t *out, int32_t n_out, int32_t n_max, int32_t n_min, int32_t k,
                           int32_t *offset, int32_t *out_draft, bool *from_pred);

#endif
