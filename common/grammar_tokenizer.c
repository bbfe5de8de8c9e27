/* grammar_vocab_from_tokenizer: a tokenizer's vocabulary as the grammar
 * matcher sees it.  Apart from grammar_match.c so that code which only
 * compiles grammars (the router's request checks) does not link the
 * tokenizer. */
#include "grammar.h"

#include <stdlib.h>
#include <string.h>

#include "status.h"

int grammar_vocab_from_tokenizer(grammar_vocab **out, const tokenizer *t, char *err,
                                 size_t errlen) {
    *out = NULL;
    int32_t n = tokenizer_n_vocab(t);
    char **bytes = calloc((size_t)n, sizeof *bytes);
    int32_t *lens = calloc((size_t)n, sizeof *lens);
    int32_t *eog = malloc(sizeof *eog * (size_t)n);
    int rc = 0;
    if (!bytes || !lens || !eog) {
        rc = status_fail(err, errlen, STATUS_NO_MEMORY, "grammar vocab: out of memory");
        goto done;
    }
    int32_t n_eog = 0;
    char buf[256];
    for (int32_t i = 0; i < n && !rc; i++) {
        if (tokenizer_is_eog(t, i)) {
            eog[n_eog++] = i;
            continue;
        }
        int type = tokenizer_token_type(t, i);
        /* control and unused tokens carry no text a grammar could match */
        if (type == 3 || type == 5) continue;
        int len = tokenizer_token_bytes(t, i, buf, sizeof buf);
        if (len < 0) {
            rc = status_fail(err, errlen, len, "grammar vocab: token %d has no bytes", i);
            break;
        }
        char *b = malloc((size_t)len + 1);
        if (!b) {
            rc = status_fail(err, errlen, STATUS_NO_MEMORY, "grammar vocab: out of memory");
            break;
        }
        if ((size_t)len > sizeof buf) {
            tokenizer_token_bytes(t, i, b, (size_t)len + 1);
        } else {
            memcpy(b, buf, (size_t)len);
        }
        bytes[i] = b;
        lens[i] = len;
    }
    if (!rc)
        rc = grammar_vocab_from_bytes(out, n, (const char *const *)bytes, lens, eog, n_eog, err,
                                      errlen);
done:
    if (bytes)
        for (int32_t i = 0; i < n; i++) free(bytes[i]);
    free(bytes), free(lens), free(eog);
    return rc;
}
