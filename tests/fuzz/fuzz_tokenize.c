/* Tokenizing and detokenizing untrusted text with real tokenizers: the
 * GGUF vocabularies and stories260K in ../shared/models and the tiny
 * Hugging Face model there when present, and always the tokenizer.json
 * seeds of tests/fuzz/corpus/tokenizer_json (so the harness has work
 * without the models).  The input's first byte picks the tokenizer and the
 * flags (parse_special, add_bos); the rest is the text.  Checks: the count
 * does not depend on the buffer size, every id is in the vocabulary, and for
 * the complete vocabularies of the models folder, valid UTF-8 (but U+2581)
 * comes back byte for byte through the streaming detokenizer. */
#include <dirent.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "common/tokenizer.h"
#include "common/unicode.h"
#include "tests/fuzz/fuzz_util.h"

#define TOK_MAX 16

static struct {
    tokenizer *t;
    int exact; /* text round-trips */
    char name[128];
} toks[TOK_MAX];
static int n_toks;

static void add(const char *path, int exact) {
    if (n_toks == TOK_MAX) return;
    char err[1024];
    tokenizer *t;
    if (tokenizer_load(&t, path, err, sizeof err) < 0) {
        /* The models folder is not ours to check: a file there that does
         * not load is the other tests' business. */
        fprintf(stderr, "fuzz_tokenize: skipping %s\n", err);
        return;
    }
    toks[n_toks].t = t;
    toks[n_toks].exact = exact;
    snprintf(toks[n_toks].name, sizeof toks[n_toks].name, "%s", path);
    n_toks++;
}

static void load_all(void) {
    char p[2048];
    const char *models = fuzz_models_dir();
    if (models) {
        static const char *files[] = {"vocab/ggml-vocab-gpt-2.gguf", "vocab/ggml-vocab-llama-spm.gguf",
                                      "stories260K-f32.gguf", "tiny-llama-hf"};
        for (size_t i = 0; i < sizeof files / sizeof files[0]; i++) {
            snprintf(p, sizeof p, "%s/%s", models, files[i]);
            FILE *fp = fopen(p, "rb");
            if (!fp) continue;
            fclose(fp);
            add(p, 1);
        }
    }
    /* Each seed tokenizer.json goes into a folder of its own. */
    const char *seeds = LLM_SOURCE_DIR "/tests/fuzz/corpus/tokenizer_json";
    DIR *d = opendir(seeds);
    struct dirent *e;
    while (d && (e = readdir(d))) {
        if (e->d_name[0] == '.') continue;
        snprintf(p, sizeof p, "%s/%s", seeds, e->d_name);
        FILE *fp = fopen(p, "rb");
        if (!fp) continue;
        char *buf = malloc(1 << 20);
        size_t n = buf ? fread(buf, 1, 1 << 20, fp) : 0;
        fclose(fp);
        /* Only a seed that is a tokenizer.json alone (no NUL-separated
         * config parts). */
        if (buf && n && !memchr(buf, 0, n)) {
            fuzz_write(0, "tokenizer.json", buf, n);
            add(fuzz_scratch_dir(), 0);
        }
        free(buf);
    }
    if (d) closedir(d);
    if (n_toks == 0) fuzz_fail("no tokenizer loaded (models folder %s, seeds %s)",
                               models ? models : "missing", seeds);
    fprintf(stderr, "fuzz_tokenize: %d tokenizers\n", n_toks);
}

/* Strict UTF-8 without NUL or U+2581 (which SentencePiece vocabularies
 * use for the space and decode as one): the texts whose round trip is
 * exact. */
static int utf8_ok(const uint8_t *s, size_t n) {
    size_t i = 0;
    while (i < n) {
        uint32_t cp;
        int k = unicode_utf8_decode((const char *)s + i, n - i, &cp);
        if (k <= 0 || cp == 0 || cp == 0x2581) return 0;
        i += (size_t)k;
    }
    return 1;
}

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size) {
    if (!n_toks) load_all();
    if (size == 0) return 0;
    int which = data[0] % n_toks, special = (data[0] >> 4) & 1, add_bos = ((data[0] >> 5) % 3) - 1;
    const tokenizer *t = toks[which].t;
    const char *text = (const char *)data + 1;
    size_t len = size - 1;
    int32_t small[4];
    int32_t n = tokenizer_encode(t, text, len, add_bos, special, small, 4);
    if (n < 0) return 0;
    int32_t *ids = malloc((size_t)(n ? n : 1) * sizeof *ids);
    if (!ids) return 0;
    int32_t n2 = tokenizer_encode(t, text, len, add_bos, special, ids, n);
    if (n2 != n) fuzz_fail("%s: %d ids with room for 4, then %d with room for all", toks[which].name, n, n2);
    for (int32_t i = 0; i < n && i < 4; i++)
        if (ids[i] != small[i]) fuzz_fail("%s: id %d is %d, then %d", toks[which].name, i, small[i], ids[i]);
    int32_t nv = tokenizer_n_vocab(t);
    size_t cap = tokenizer_detok_size_max(t);
    char *piece = malloc(cap < 8 ? 8 : cap);
    char *back = malloc(len * 3 + 64 + (size_t)n * cap);
    size_t nb = 0;
    struct detok d;
    tokenizer_detok_init(&d, tokenizer_adds_space_prefix(t));
    for (int32_t i = 0; i < n && piece && back; i++) {
        if (ids[i] < 0 || ids[i] >= nv) fuzz_fail("%s: id %d outside the vocabulary of %d", toks[which].name, ids[i], nv);
        int k = tokenizer_detok_push(t, &d, ids[i], piece, cap);
        if (k < 0) fuzz_fail("%s: detok of id %d failed (%d)", toks[which].name, ids[i], k);
        memcpy(back + nb, piece, (size_t)k);
        nb += (size_t)k;
    }
    if (piece && back) {
        int k = tokenizer_detok_flush(&d, piece, cap < 8 ? 8 : cap);
        if (k > 0) memcpy(back + nb, piece, (size_t)k), nb += (size_t)k;
        if (toks[which].exact && !special && utf8_ok(data + 1, len) &&
            (nb != len || memcmp(back, text, len) != 0))
            fuzz_fail("%s: %zu bytes came back as %zu: \"%.*s\" -> \"%.*s\"", toks[which].name, len, nb,
                      (int)len, text, (int)nb, back);
    }
    free(back);
    free(piece);
    free(ids);
    return 0;
}
