/* A Hugging Face tokenizer as tokenizer_from_hf reads it: tokenizer.json,
 * and optionally tokenizer_config.json, config.json and
 * generation_config.json (the input's parts, in that order, separated by
 * NUL bytes; an absent or empty part is no file).  A tokenizer that loads
 * is then used: a fixed text encoded with and without special tokens, every
 * id detokenized, and every token's bytes read. */
#include <stdlib.h>
#include <string.h>

#include "common/tokenizer.h"
#include "tests/fuzz/fuzz_util.h"

static void use(const tokenizer *t) {
    static const char text[] = "Hello world! <s> </s> 12 345 ab abc \xc3\xa9t\xc3\xa9 \xe2\x96\x81x  \n\n\t"
                               "<|endoftext|> \xf0\x9f\x98\x80";
    int32_t nv = tokenizer_n_vocab(t);
    if (nv <= 0) fuzz_fail("tokenizer with %d tokens", nv);
    int32_t ids[512];
    size_t cap = tokenizer_detok_size_max(t);
    char *out = malloc(cap < 8 ? 8 : cap);
    if (!out) return;
    for (int special = 0; special <= 1; special++) {
        int32_t n = tokenizer_encode(t, text, sizeof text - 1, -1, special, ids, 512);
        if (n < 0) continue;
        if (n > 512) fuzz_fail("%d ids for %zu bytes", n, sizeof text - 1);
        struct detok d;
        tokenizer_detok_init(&d, tokenizer_adds_space_prefix(t));
        for (int32_t i = 0; i < n; i++) {
            if (ids[i] < 0 || ids[i] >= nv) fuzz_fail("id %d outside the vocabulary of %d", ids[i], nv);
            if (tokenizer_detok_push(t, &d, ids[i], out, cap) < 0) fuzz_fail("detok of id %d failed", ids[i]);
        }
        tokenizer_detok_flush(&d, out, cap < 8 ? 8 : cap);
    }
    /* Every token's text, the lookup of it, and its type: a bounded number
     * of them so that a large vocabulary stays quick. */
    char buf[64];
    for (int32_t id = 0; id < nv && id < 4096; id++) {
        if (tokenizer_token_bytes(t, id, buf, sizeof buf) < 0) fuzz_fail("token_bytes of %d failed", id);
        int ty = tokenizer_token_type(t, id);
        if (ty < 0) fuzz_fail("token type of %d failed", id);
    }
    if (tokenizer_token_bytes(t, nv, buf, sizeof buf) >= 0) fuzz_fail("token_bytes past the vocabulary");
    free(out);
}

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size) {
    static const char *names[] = {"tokenizer.json", "tokenizer_config.json", "config.json",
                                  "generation_config.json"};
    const uint8_t *part[4];
    size_t len[4];
    int n = fuzz_split(data, size, part, len, 4);
    for (int i = 0; i < 4; i++) {
        if (i < n && (i == 0 || len[i] > 0)) fuzz_write(0, names[i], part[i], len[i]);
        else fuzz_remove(names[i]);
    }
    tokenizer *t = NULL;
    char err[1024] = "";
    if (tokenizer_from_hf(&t, fuzz_scratch_dir(), err, sizeof err) < 0) {
        if (t || !err[0]) fuzz_fail("refused tokenizer: t %p, message \"%s\"", (void *)t, err);
        return 0;
    }
    use(t);
    tokenizer_free(t);
    return 0;
}
