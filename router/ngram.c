/* Prompt-lookup drafting: the longest recent suffix match in a sequence's
 * own tokens proposes the tokens that followed it. */
#include "router/ngram.h"

#include <stdbool.h>
#include <string.h>

int32_t ngram_propose(const int32_t *tokens, int32_t n_tokens, int32_t n_max, int32_t n_min,
                      int32_t k, int32_t *out) {
    if (k < 1 || n_min < 1 || n_max < n_min || n_tokens < n_min + 1) return 0;
    for (int32_t g = n_max < n_tokens - 1 ? n_max : n_tokens - 1; g >= n_min; g--) {
        const int32_t *suf = tokens + n_tokens - g;
        /* Latest occurrence first: the most recent context predicts best.
         * An occurrence starting at i is followed by tokens[i + g ..], at
         * least one of which lies before the suffix (i + g < n_tokens). */
        for (int32_t i = n_tokens - g - 1; i >= 0; i--) {
            if (tokens[i + g - 1] != suf[g - 1] || memcmp(tokens + i, suf, (size_t)g * sizeof *suf) != 0)
                continue;
            /* At most g + 1 tokens after a match of g: a short match is a
             * weak guess, and each drafted token past what is accepted
             * costs a row of the verifying step. */
            int32_t from = i + g, n = n_tokens - from;
            if (n > k) n = k;
            if (n > g + 1) n = g + 1;
            memcpy(out, tokens + from, (size_t)n * sizeof *out);
            return n;
        }
    }
    return 0;
}

/* Token i of the sequence (prompt, then output) and of the lookup text
 * (prompt, then prediction). */
static int32_t seq_at(const int32_t *prompt, int32_t n_prompt, const int32_t *out, int32_t i) {
    return i < n_prompt ? prompt[i] : out[i - n_prompt];
}

/* Whether the g tokens of the lookup text ending before position e equal
 * the sequence's last g tokens (n tokens in all). */
static bool pred_match(const int32_t *prompt, int32_t n_prompt, const int32_t *pred, const int32_t *out,
                       int32_t n, int32_t e, int32_t g) {
    for (int32_t t = 1; t <= g; t++) {
        int32_t want = seq_at(prompt, n_prompt, out, n - t);
        int32_t i = e - t;
        int32_t have = i < n_prompt ? prompt[i] : pred[i - n_prompt];
        if (have != want) return false;
    }
    return true;
}

int32_t ngram_propose_pred(const int32_t *prompt, int32_t n_prompt, const int32_t *pred, int32_t n_pred,
                           const int32_t *out, int32_t n_out, int32_t n_max, int32_t n_min, int32_t k,
                           int32_t *offset, int32_t *out_draft, bool *from_pred) {
    if (from_pred) *from_pred = false;
    if (k < 1 || n_min < 1 || n_max < n_min || n_out < 1 || n_prompt < 0 || n_pred < 0) return 0;
    int32_t n = n_prompt + n_out;
    int32_t want = n_out + *offset;
    for (int32_t g = n_max < n ? n_max : n; g >= n_min; g--) {
        /* j: where the next token would be in the prediction (position
         * n_prompt + j of the lookup text), from jlo (g tokens before it)
         * to n_pred - 1.  The match nearest to want wins, the earlier of
         * two as near: searched outward from want, so that a prediction
         * the output follows is found at once, whatever its length. */
        int32_t best = -1;
        const int32_t jlo = (n_prompt > g ? n_prompt : g) - n_prompt, jhi = n_pred - 1;
        int32_t dist = want > jhi ? want - jhi : want < jlo ? jlo - want : 0;
        for (; jlo <= jhi && (want - dist >= jlo || want + dist <= jhi); dist++) {
            const int32_t a = want - dist, b = want + dist;
            if (a >= jlo && a <= jhi && pred_match(prompt, n_prompt, pred, out, n, n_prompt + a, g)) {
                best = a;
                break;
            }
            if (dist > 0 && b >= jlo && b <= jhi && pred_match(prompt, n_prompt, pred, out, n, n_prompt + b, g)) {
                best = b;
                break;
            }
        }
        if (best >= 0) {
            int32_t m = n_pred - best < k ? n_pred - best : k;
            memcpy(out_draft, pred + best, (size_t)m * sizeof *out_draft);
            *offset = best - n_out;
            if (from_pred) *from_pred = true;
            return m;
        }
    }
    /* No prediction match: the sequence's own lookup, as ngram_propose
     * (latest earlier occurrence of the longest suffix). */
    for (int32_t g = n_max < n - 1 ? n_max : n - 1; g >= n_min; g--) {
        for (int32_t i = n - g - 1; i >= 0; i--) {
            int32_t t = 0;
            while (t < g && seq_at(prompt, n_prompt, out, i + t) == seq_at(prompt, n_prompt, out, n - g + t)) t++;
            if (t < g) continue;
            int32_t from = i + g, m = n - from < k ? n - from : k;
            for (int32_t x = 0; x < m; x++) out_draft[x] = seq_at(prompt, n_prompt, out, from + x);
            return m;
        }
    }
    return 0;
}
