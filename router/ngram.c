/* Prompt-lookup drafting: the longest recent suffix match in a sequence's
 * own tokens proposes the tokens that followed it. */
#include "router/ngram.h"

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
            int32_t from = i + g, n = n_tokens - from;
            if (n > k) n = k;
            memcpy(out, tokens + from, (size_t)n * sizeof *out);
            return n;
        }
    }
    return 0;
}
