/* Mask time per constrained sequence per step (common/grammar), on
 * synthetic vocabularies of 32k and 128k tokens, for a JSON schema and for
 * "any JSON object".  Sequences pick a random allowed token each step until
 * EOS or a step limit.  Two regimes:
 *   shared: one compiled grammar serves every sequence (as a worker does
 *           for requests with the same schema): states seen before are
 *           cached masks;
 *   cold:   every sequence compiles its own grammar: each state's first
 *           mask walks the trie.
 * Usage: bench_grammar [--seqs N] [--steps N] [--vocab 32000,128000] */
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#include "common/grammar.h"
#include "common/json_schema.h"
#include "common/tokenizer.h"

static uint64_t rs = 0x2545F4914F6CDD1Dull;
static uint32_t rnd(uint32_t n) {
    rs ^= rs << 13, rs ^= rs >> 7, rs ^= rs << 17;
    return (uint32_t)(rs % n);
}

static double now_us(void) {
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (double)ts.tv_sec * 1e6 + (double)ts.tv_nsec / 1e3;
}

/* Token i < 256 is byte i; the rest look like a BPE vocabulary: words with
 * and without a leading space, digits, punctuation runs, JSON pieces, some
 * non-ASCII; the last token is EOS. */
static grammar_vocab *synth_vocab(int32_t n, char ***bytes_out, int32_t **lens_out) {
    static const char *punct[] = {"{", "}", "[", "]", "\"", ":", ",", "\":", "\",", "{\"",
                                  "\"}", "\n", "  ", "    ", "\n  ", ".", "(", ")", "=", "-",
                                  "_", "'", "\\", "\\n", "é", "中", "ü", "→"};
    int np = (int)(sizeof punct / sizeof punct[0]);
    char **bytes = calloc((size_t)n, sizeof *bytes);
    int32_t *lens = calloc((size_t)n, sizeof *lens);
    for (int32_t i = 0; i < n - 1; i++) {
        char buf[48];
        int len = 0;
        if (i < 256) {
            buf[len++] = (char)i;
        } else {
            /* proportions like a BPE vocabulary of English and code: mostly
             * words, some numbers, a tenth punctuation runs */
            int kind = (int)rnd(10);
            if (kind < 8) { /* word */
                if (rnd(2)) buf[len++] = ' ';
                int wl = 1 + (int)rnd(9);
                if (rnd(4) == 0) buf[len++] = (char)('A' + rnd(26));
                for (int k = 0; k < wl; k++) buf[len++] = (char)('a' + rnd(26));
            } else if (kind < 9) { /* digits */
                int dl = 1 + (int)rnd(3);
                for (int k = 0; k < dl; k++) buf[len++] = (char)('0' + rnd(10));
            } else { /* punctuation and mixed */
                int pl = 1 + (int)rnd(3);
                for (int k = 0; k < pl; k++) {
                    const char *p = punct[rnd((uint32_t)np)];
                    size_t l = strlen(p);
                    if (len + (int)l > 40) break;
                    memcpy(buf + len, p, l);
                    len += (int)l;
                }
                if (rnd(3) == 0)
                    for (int k = 0; k < 3; k++) buf[len++] = (char)('a' + rnd(26));
            }
        }
        bytes[i] = malloc((size_t)len);
        memcpy(bytes[i], buf, (size_t)len);
        lens[i] = len;
    }
    int32_t eog = n - 1;
    grammar_vocab *v = NULL;
    char err[256];
    if (grammar_vocab_from_bytes(&v, n, (const char *const *)bytes, lens, &eog, 1, err,
                                 sizeof err)) {
        fprintf(stderr, "vocab: %s\n", err);
        exit(1);
    }
    *bytes_out = bytes;
    *lens_out = lens;
    return v;
}

static int dcmp(const void *a, const void *b) {
    double x = *(const double *)a, y = *(const double *)b;
    return x < y ? -1 : x > y;
}

static grammar *compile(const char *gbnf) {
    grammar *g = NULL;
    char err[256];
    if (grammar_parse(&g, gbnf, strlen(gbnf), err, sizeof err)) {
        fprintf(stderr, "grammar: %s\n", err);
        exit(1);
    }
    return g;
}

static void run(const char *label, const char *gbnf, grammar_vocab *v, char **bytes,
                const int32_t *lens, int32_t n, int seqs, int steps, int shared) {
    size_t words = grammar_vocab_mask_words(v);
    uint64_t *m = malloc(words * 8);
    int32_t *allowed = malloc(sizeof *allowed * (size_t)n);
    double *t = malloc(sizeof *t * (size_t)seqs * (size_t)steps);
    size_t nt = 0;
    grammar *g = shared ? compile(gbnf) : NULL;
    int64_t computed = 0, cached = 0;
    double t_accept = 0;
    int64_t n_accept = 0;
    for (int s = 0; s < seqs; s++) {
        if (!shared) g = compile(gbnf);
        int32_t st;
        grammar_state_start(g, &st);
        char text[8192];
        size_t tl = 0;
        for (int k = 0; k < steps; k++) {
            struct grammar_stats b0, b1;
            if (getenv("BENCH_TRACE")) grammar_get_stats(g, &b0);
            double t0 = now_us();
            if (grammar_mask(g, v, st, m)) {
                fprintf(stderr, "grammar_mask failed\n");
                exit(1);
            }
            t[nt++] = now_us() - t0;
            if (getenv("BENCH_TRACE") && t[nt - 1] > 100) {
                grammar_get_stats(g, &b1);
                int32_t na_ = 0;
                for (size_t w = 0; w < words; w++) na_ += __builtin_popcountll(m[w]);
                fprintf(stderr, "slow %.0f us: state %d, %d allowed, %lld trie visits, %lld new "
                        "states, text so far: %.*s\n", t[nt - 1], st, na_,
                        (long long)(b1.n_trie_visits - b0.n_trie_visits),
                        (long long)(b1.n_states - b0.n_states), (int)tl, text);
            }
            int32_t na = 0;
            for (int32_t i = 0; i < n; i++)
                if (m[i >> 6] >> (i & 63) & 1) allowed[na++] = i;
            if (na == 0) {
                fprintf(stderr, "%s: empty mask at step %d\n", label, k);
                exit(1);
            }
            int32_t tok = allowed[rnd((uint32_t)na)];
            if (grammar_vocab_is_eog(v, allowed[na - 1])) tok = allowed[na - 1];
            for (int32_t i = 0; i < na && !grammar_vocab_is_eog(v, tok); i++)
                if (grammar_vocab_is_eog(v, allowed[i])) tok = allowed[i];
            if (grammar_vocab_is_eog(v, tok)) break; /* end as soon as allowed */
            if (tl + (size_t)lens[tok] < sizeof text) {
                memcpy(text + tl, bytes[tok], (size_t)lens[tok]);
                tl += (size_t)lens[tok];
            }
            t0 = now_us();
            grammar_state_accept_token(g, v, st, tok, &st);
            t_accept += now_us() - t0;
            n_accept++;
        }
        if (!shared) {
            struct grammar_stats gs;
            grammar_get_stats(g, &gs);
            computed += gs.n_masks_computed;
            cached += gs.n_masks_cached;
            grammar_free(g);
        }
    }
    if (shared) {
        struct grammar_stats gs;
        grammar_get_stats(g, &gs);
        computed = gs.n_masks_computed;
        cached = gs.n_masks_cached;
        grammar_free(g);
    }
    qsort(t, nt, sizeof *t, dcmp);
    printf("%-26s vocab %6d %-6s steps %6zu  mask us: p50 %7.1f  p99 %7.1f  max %8.1f  "
           "(walks %lld, cached %lld)  accept us mean %.2f\n",
           label, n, shared ? "shared" : "cold", nt, t[nt / 2], t[(size_t)((double)nt * 0.99)],
           t[nt - 1], (long long)computed, (long long)cached,
           n_accept ? t_accept / (double)n_accept : 0.0);
    free(m), free(allowed), free(t);
}

static void run_all(const char *gbnf, grammar_vocab *v, char **bytes, const int32_t *lens,
                    int32_t n, int seqs, int steps) {
    int cold = seqs / 4 ? seqs / 4 : 1;
    run("json_schema", gbnf, v, bytes, lens, n, seqs, steps, 1);
    run("json_schema", gbnf, v, bytes, lens, n, cold, steps, 0);
    run("json_object", json_schema_any_object_gbnf(), v, bytes, lens, n, seqs, steps, 1);
    run("json_object", json_schema_any_object_gbnf(), v, bytes, lens, n, cold, steps, 0);
}

int main(int argc, char **argv) {
    int seqs = 64, steps = 200;
    int32_t sizes[4] = {32000, 128000};
    int n_sizes = 2;
    const char *real = NULL;
    for (int i = 1; i < argc; i++) {
        if (!strcmp(argv[i], "--seqs") && i + 1 < argc) seqs = atoi(argv[++i]);
        else if (!strcmp(argv[i], "--steps") && i + 1 < argc) steps = atoi(argv[++i]);
        else if (!strcmp(argv[i], "--vocab") && i + 1 < argc) {
            n_sizes = sscanf(argv[++i], "%d,%d,%d,%d", &sizes[0], &sizes[1], &sizes[2], &sizes[3]);
        } else if (!strcmp(argv[i], "--real") && i + 1 < argc) {
            real = argv[++i];
        } else {
            fprintf(stderr, "usage: %s [--seqs N] [--steps N] [--vocab 32000,128000] "
                    "[--real MODEL.gguf]\n", argv[0]);
            return 2;
        }
    }
    const char *schema =
        "{\"type\":\"object\",\"properties\":{"
        "\"name\":{\"type\":\"string\",\"maxLength\":40},"
        "\"age\":{\"type\":\"integer\"},"
        "\"email\":{\"type\":\"string\"},"
        "\"tags\":{\"type\":\"array\",\"items\":{\"type\":\"string\",\"maxLength\":12},"
        "\"maxItems\":5},"
        "\"address\":{\"type\":\"object\",\"properties\":{\"city\":{\"type\":\"string\"},"
        "\"zip\":{\"type\":\"string\",\"maxLength\":10}},\"required\":[\"city\"]},"
        "\"role\":{\"enum\":[\"admin\",\"user\",\"guest\"]},"
        "\"score\":{\"type\":\"number\"},\"active\":{\"type\":\"boolean\"}},"
        "\"required\":[\"name\",\"age\",\"role\"],\"additionalProperties\":false}";
    char *gbnf = NULL;
    char err[256];
    if (json_schema_to_gbnf(schema, strlen(schema), &gbnf, err, sizeof err)) {
        fprintf(stderr, "%s\n", err);
        return 1;
    }
    if (real) {
        /* a real tokenizer's vocabulary instead of the synthetic ones */
        tokenizer *tk = NULL;
        grammar_vocab *v = NULL;
        if (tokenizer_load(&tk, real, err, sizeof err) ||
            grammar_vocab_from_tokenizer(&v, tk, err, sizeof err)) {
            fprintf(stderr, "%s\n", err);
            return 1;
        }
        int32_t n = tokenizer_n_vocab(tk);
        char **bytes = calloc((size_t)n, sizeof *bytes);
        int32_t *lens = calloc((size_t)n, sizeof *lens);
        for (int32_t k = 0; k < n; k++) {
            char b[256];
            int l = tokenizer_token_bytes(tk, k, b, sizeof b);
            l = l < 0 ? 0 : l > 255 ? 255 : l;
            bytes[k] = malloc((size_t)l + 1);
            memcpy(bytes[k], b, (size_t)l);
            lens[k] = l;
        }
        printf("%s: %d tokens\n", real, n);
        run_all(gbnf, v, bytes, lens, n, seqs, steps);
        for (int32_t k = 0; k < n; k++) free(bytes[k]);
        free(bytes), free(lens);
        grammar_vocab_free(v);
        tokenizer_free(tk);
        n_sizes = 0;
    }
    for (int i = 0; i < n_sizes; i++) {
        char **bytes;
        int32_t *lens;
        double t0 = now_us();
        grammar_vocab *v = synth_vocab(sizes[i], &bytes, &lens);
        printf("vocab %d: trie built in %.1f ms\n", sizes[i], (now_us() - t0) / 1e3);
        run_all(gbnf, v, bytes, lens, sizes[i], seqs, steps);
        for (int32_t k = 0; k < sizes[i]; k++) free(bytes[k]);
        free(bytes), free(lens);
        grammar_vocab_free(v);
    }
    free(gbnf);
    return 0;
}
