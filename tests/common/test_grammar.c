/* Tests for common/grammar: GBNF features, error messages with line and
 * column, the byte-level matcher, and masks checked token by token against
 * a brute-force walk of every token through the matcher. */
#include "common/grammar.h"

#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "common/status.h"
#include "tests/test.h"

/* 1 when s is a whole sentence of g, 0 when it is a prefix, -1 when it
 * leaves the grammar. */
static int match(grammar *g, const char *s) {
    int32_t st;
    if (grammar_state_start(g, &st)) return -2;
    if (grammar_state_accept_bytes(g, st, s, strlen(s), &st)) return -2;
    if (st == GRAMMAR_STATE_DEAD) return -1;
    return grammar_state_is_complete(g, st);
}

static grammar *compile(const char *text) {
    grammar *g = NULL;
    char err[256];
    int rc = grammar_parse(&g, text, strlen(text), err, sizeof err);
    if (rc) TEST_FAIL("grammar_parse: %s\n%s", err, text);
    return g;
}

/* The error text of a grammar that must not compile. */
static const char *parse_err(const char *text) {
    static char err[256];
    grammar *g = NULL;
    err[0] = 0;
    int rc = grammar_parse(&g, text, strlen(text), err, sizeof err);
    if (rc == 0) {
        grammar_free(g);
        TEST_FAIL("expected an error for:\n%s", text);
    }
    if (g != NULL) TEST_FAIL("*out is not NULL on failure");
    return err;
}

TEST(grammar_literals_and_alternation) {
    grammar *g = compile("root ::= \"yes\" | \"no\" | \"maybe\" \" so\"\n");
    ASSERT_EQ(1, match(g, "yes"));
    ASSERT_EQ(1, match(g, "no"));
    ASSERT_EQ(1, match(g, "maybe so"));
    ASSERT_EQ(0, match(g, "mayb"));
    ASSERT_EQ(0, match(g, ""));
    ASSERT_EQ(-1, match(g, "yess"));
    ASSERT_EQ(-1, match(g, "x"));
    grammar_free(g);
}

TEST(grammar_repetition) {
    grammar *g = compile("root ::= \"a\"* \"b\"+ \"c\"? d{2} e{1,} f{0,2} \"!\"\n"
                         "d ::= \"d\"\ne ::= \"e\"\nf ::= \"f\"\n");
    ASSERT_EQ(1, match(g, "bdde!"));
    ASSERT_EQ(1, match(g, "aaabbcddeeeff!"));
    ASSERT_EQ(-1, match(g, "bddde!"));  /* {2} exactly */
    ASSERT_EQ(-1, match(g, "bdd!"));    /* {1,} needs one */
    ASSERT_EQ(-1, match(g, "bddefff!")); /* {0,2} at most two */
    ASSERT_EQ(-1, match(g, "dde!"));    /* + needs one b */
    ASSERT_EQ(-1, match(g, "bccdde!")); /* ? at most one */
    grammar_free(g);
    /* a repeated literal repeats whole; a repeated group too */
    g = compile("root ::= \"ab\"{2} (\"x\" | \"yz\")* \".\"\n");
    ASSERT_EQ(1, match(g, "abab."));
    ASSERT_EQ(1, match(g, "ababyzxyz."));
    ASSERT_EQ(-1, match(g, "aba."));
    ASSERT_EQ(-1, match(g, "ababy."));
    grammar_free(g);
}

TEST(grammar_character_classes) {
    grammar *g = compile("root ::= [a-c0-9_] [^a-z\\n] [\\x41-\\x43] .\n");
    ASSERT_EQ(1, match(g, "b5A!"));
    ASSERT_EQ(1, match(g, "_?Bz"));
    ASSERT_EQ(1, match(g, "9Z\x41\xc3\xa9")); /* . is one whole character: é */
    ASSERT_EQ(0, match(g, "9Z\x41\xc3"));     /* half of é: still a prefix */
    ASSERT_EQ(-1, match(g, "9Z\x41\xc3\x28")); /* not UTF-8 */
    ASSERT_EQ(-1, match(g, "dZA!"));
    ASSERT_EQ(-1, match(g, "aqA!"));
    ASSERT_EQ(-1, match(g, "a\nA!"));
    ASSERT_EQ(-1, match(g, "a.D!"));
    grammar_free(g);
    /* classes beyond ASCII: ranges across UTF-8 lengths, negation */
    g = compile("root ::= [α-ω]+ [^\"\\\\]\n");
    ASSERT_EQ(1, match(g, "αβγx"));
    ASSERT_EQ(1, match(g, "ω\xf0\x9f\x98\x80")); /* an emoji is not " or \ */
    ASSERT_EQ(-1, match(g, "a"));
    ASSERT_EQ(-1, match(g, "α\""));
    ASSERT_EQ(-1, match(g, "\xed\xa0\x80")); /* a surrogate is never a character */
    grammar_free(g);
    g = compile("root ::= [\\u0080-\\U0010FFFF]{3}\n");
    ASSERT_EQ(1, match(g, "\xc2\x80\xf4\x8f\xbf\xbf\xe0\xa0\x80"));
    ASSERT_EQ(-1, match(g, "\xc2\x80\xf4\x90\x80\x80")); /* above U+10FFFF */
    ASSERT_EQ(-1, match(g, "\xe0\x80\x80"));             /* overlong */
    grammar_free(g);
}

TEST(grammar_escapes_and_comments) {
    grammar *g = compile("# a comment\nroot ::= \"\\t\\\"q\\\"\\\\\" \"\\x41\\u00e9\" # trailing\n"
                         "  # more\n");
    ASSERT_EQ(1, match(g, "\t\"q\"\\A\xc3\xa9"));
    grammar_free(g);
}

TEST(grammar_nested_rules_and_multiline) {
    grammar *g = compile("root ::= list\n"
                         "list ::= \"[\" (item (\",\" item)*)? \"]\"\n"
                         "item ::= num | list\n"
                         "num ::= [0-9]+\n"
                         "multi ::= \"a\" |\n"
                         "   \"b\" | (\n"
                         "   \"c\"\n"
                         "   \"d\")\n");
    ASSERT_EQ(1, match(g, "[]"));
    ASSERT_EQ(1, match(g, "[1,[2,[]],33]"));
    ASSERT_EQ(0, match(g, "[1,[2,"));
    ASSERT_EQ(-1, match(g, "[1,]"));
    ASSERT_EQ(-1, match(g, "[[]]]"));
    grammar_free(g);
}

TEST(grammar_errors_name_line_and_column) {
    ASSERT_STREQ("line 2, column 11: undefined rule 'missing'",
                 parse_err("root ::= a\na ::= \"x\" missing\n"));
    ASSERT_STREQ("line 1, column 10: unterminated literal (the line ends first)",
                 parse_err("root ::= \"abc\n"));
    ASSERT_STREQ("line 1, column 10: unterminated literal", parse_err("root ::= \"abc"));
    ASSERT_STREQ("line 1, column 1: no rule named 'root' (the start rule)",
                 parse_err("start ::= \"x\"\n"));
    ASSERT_STREQ("line 1, column 6: expected '::=' after rule name 'root'",
                 parse_err("root = \"x\"\n"));
    ASSERT_STREQ("line 3, column 1: rule 'a' is already defined at line 2",
                 parse_err("root ::= a\na ::= \"x\"\na ::= \"y\"\n"));
    ASSERT_STREQ("line 1, column 10: unterminated character class (the line ends first)",
                 parse_err("root ::= [abc\n"));
    ASSERT_STREQ("line 1, column 11: range end U+0061 is before its start U+007A",
                 parse_err("root ::= [z-a]\n"));
    ASSERT_STREQ("line 1, column 10: '*' follows nothing it could repeat",
                 parse_err("root ::= *\n"));
    ASSERT_STREQ("line 1, column 11: unknown escape '\\q'", parse_err("root ::= \"\\q\"\n"));
    ASSERT_STREQ("line 1, column 14: ')' without a matching '('",
                 parse_err("root ::= \"a\" )\n"));
    ASSERT_STREQ("line 1, column 10: this '(' is not closed",
                 parse_err("root ::= (\"a\"\n"));
    ASSERT_STREQ("line 1, column 17: repetition {3,2}: the maximum is below the minimum",
                 parse_err("root ::= \"a\" \"b\"{3,2}\n"));
    ASSERT_STREQ("line 2, column 1: rule 'expr' is left-recursive (it can reach itself without "
                 "consuming input)",
                 parse_err("root ::= expr\nexpr ::= expr \"+\" term | term\nterm ::= [0-9]\n"));
    /* left recursion through a nullable prefix */
    const char *e = parse_err("root ::= x\nx ::= y? x \"a\" | \"b\"\ny ::= \"c\"\n");
    ASSERT_TRUE(strstr(e, "left-recursive") != NULL);
}

TEST(grammar_eos_only_when_complete) {
    const char *toks[] = {"a", "b", "ab", "", "</s>"};
    int32_t lens[] = {1, 1, 2, 0, 0};
    int32_t eog[] = {4};
    grammar_vocab *v = NULL;
    char err[128];
    ASSERT_OK(grammar_vocab_from_bytes(&v, 5, toks, lens, eog, 1, err, sizeof err));
    grammar *g = compile("root ::= \"a\" \"b\"?\n");
    int32_t st;
    uint64_t m[1];
    ASSERT_OK(grammar_state_start(g, &st));
    ASSERT_OK(grammar_mask(g, v, st, m));
    ASSERT_EQ((uint64_t)0x5, m[0]); /* a, ab; not EOS, not the empty token */
    ASSERT_OK(grammar_state_accept_token(g, v, st, 0, &st));
    ASSERT_OK(grammar_mask(g, v, st, m));
    ASSERT_EQ((uint64_t)0x12, m[0]); /* b or EOS */
    int32_t after_eos;
    ASSERT_OK(grammar_state_accept_token(g, v, st, 4, &after_eos));
    ASSERT_EQ(st, after_eos);
    ASSERT_OK(grammar_state_accept_token(g, v, st, 1, &st));
    ASSERT_OK(grammar_mask(g, v, st, m));
    ASSERT_EQ((uint64_t)0x10, m[0]); /* only EOS */
    ASSERT_OK(grammar_state_start(g, &st));
    ASSERT_OK(grammar_state_accept_token(g, v, st, 4, &st));
    ASSERT_EQ(GRAMMAR_STATE_DEAD, st); /* EOS before the end kills */
    ASSERT_OK(grammar_mask(g, v, st, m));
    ASSERT_EQ((uint64_t)0, m[0]);
    grammar_free(g);
    grammar_vocab_free(v);
}

/* xorshift for reproducible random vocabularies */
static uint64_t rng_state = 88172645463325252ull;
static uint32_t rnd(uint32_t n) {
    rng_state ^= rng_state << 13;
    rng_state ^= rng_state >> 7;
    rng_state ^= rng_state << 17;
    return (uint32_t)(rng_state % n);
}

/* A vocabulary of every single byte plus n - 257 random strings over an
 * alphabet that the grammars below care about (and some UTF-8), token n-1
 * is EOS. */
static grammar_vocab *random_vocab(int32_t n, char ***bytes_out, int32_t **lens_out) {
    static const char *alpha[] = {"{", "}", "[", "]", "\"", ":", ",", " ", "\n", "a", "b", "x",
                                  "1", "0", "9", "-", ".", "e", "true", "null", "\\", "é", "\xe2",
                                  "\x82\xac", "ab", "\"a\"", "\":"};
    int n_alpha = (int)(sizeof alpha / sizeof alpha[0]);
    char **bytes = calloc((size_t)n, sizeof *bytes);
    int32_t *lens = calloc((size_t)n, sizeof *lens);
    for (int32_t i = 0; i < n - 1; i++) {
        char buf[64];
        int len = 0;
        if (i < 256) {
            buf[0] = (char)i;
            len = 1;
        } else {
            int k = 1 + (int)rnd(5);
            for (int j = 0; j < k; j++) {
                const char *a = alpha[rnd((uint32_t)n_alpha)];
                size_t al = strlen(a);
                if (len + (int)al >= (int)sizeof buf) break;
                memcpy(buf + len, a, al);
                len += (int)al;
            }
        }
        bytes[i] = malloc((size_t)len + 1);
        memcpy(bytes[i], buf, (size_t)len);
        lens[i] = len;
    }
    int32_t eog = n - 1;
    grammar_vocab *v = NULL;
    char err[128];
    if (grammar_vocab_from_bytes(&v, n, (const char *const *)bytes, lens, &eog, 1, err, sizeof err))
        TEST_FAIL("vocab: %s", err);
    *bytes_out = bytes;
    *lens_out = lens;
    return v;
}

static void free_bytes(char **bytes, int32_t n) {
    for (int32_t i = 0; i < n; i++) free(bytes[i]);
    free(bytes);
}

/* Walks random allowed tokens; at each step the mask must equal what
 * feeding every token to the matcher says. */
static void check_masks(const char *gbnf, int steps, int runs) {
    int32_t n = 1500;
    char **bytes;
    int32_t *lens;
    grammar_vocab *v = random_vocab(n, &bytes, &lens);
    grammar *g = compile(gbnf);
    size_t words = grammar_vocab_mask_words(v);
    uint64_t *m = malloc(words * 8);
    int32_t *allowed = malloc(sizeof *allowed * (size_t)n);
    for (int r = 0; r < runs; r++) {
        int32_t st;
        ASSERT_OK(grammar_state_start(g, &st));
        for (int s = 0; s < steps; s++) {
            ASSERT_OK(grammar_mask(g, v, st, m));
            int32_t n_allowed = 0;
            for (int32_t t = 0; t < n; t++) {
                int32_t next;
                ASSERT_OK(grammar_state_accept_token(g, v, st, t, &next));
                int want = next != GRAMMAR_STATE_DEAD;
                int got = (int)(m[t >> 6] >> (t & 63) & 1);
                if (want != got)
                    TEST_FAIL("run %d step %d token %d (\"%.*s\"): mask says %d, matcher %d", r, s,
                              t, lens[t], bytes[t], got, want);
                if (got) allowed[n_allowed++] = t;
            }
            ASSERT_TRUE(n_allowed > 0);
            int32_t t = allowed[rnd((uint32_t)n_allowed)];
            if (t == n - 1) break; /* EOS */
            ASSERT_OK(grammar_state_accept_token(g, v, st, t, &st));
        }
    }
    free(m), free(allowed);
    grammar_free(g);
    grammar_vocab_free(v);
    free_bytes(bytes, n);
    free(lens);
}

TEST(grammar_mask_equals_brute_force) {
    check_masks("root ::= value\n"
                "value ::= object | array | string | num | \"true\" | \"null\"\n"
                "object ::= \"{\" ws (string \":\" ws value (\",\" ws string \":\" ws value)*)? \"}\"\n"
                "array ::= \"[\" ws (value (\",\" ws value)*)? \"]\"\n"
                "string ::= \"\\\"\" ([^\"\\\\] | \"\\\\\" [\"\\\\n])* \"\\\"\"\n"
                "num ::= \"-\"? [0-9]+ (\".\" [0-9]+)?\n"
                "ws ::= [ \\n]?\n",
                60, 20);
    check_masks("root ::= (\"ab\" | \"a\" \"b\"{2,3} | [x-z]+)* \"é\"\n", 30, 10);
    /* bounded runs: the trie walk's length-limited skips */
    check_masks("root ::= (\"\\\"\" [^\"\\\\]{0,7} \"\\\"\" [ ]?){1,4}\n", 40, 20);
    check_masks("root ::= \"{\" [a-z0-9 ]{2,30} [,:]{0,2} \"}\"\n", 40, 20);
}

TEST(grammar_replay_gives_the_same_state) {
    grammar *g = compile("root ::= (\"ab\" | \"a\")+ \"c\"\n");
    int32_t a, b, c;
    ASSERT_OK(grammar_state_start(g, &a));
    ASSERT_OK(grammar_state_accept_bytes(g, a, "aab", 3, &a));
    ASSERT_OK(grammar_state_start(g, &b));
    ASSERT_OK(grammar_state_accept_bytes(g, b, "a", 1, &b));
    ASSERT_OK(grammar_state_accept_bytes(g, b, "ab", 2, &b));
    ASSERT_EQ(a, b);
    ASSERT_OK(grammar_state_accept_bytes(g, a, "c", 1, &c));
    ASSERT_EQ(1, grammar_state_is_complete(g, c));
    struct grammar_stats st;
    grammar_get_stats(g, &st);
    ASSERT_TRUE(st.n_states > 0 && st.n_states < 20);
    grammar_free(g);
}

TEST(grammar_limits_end_in_exhausted) {
    /* every nesting level makes new stacks: the node limit is reached */
    grammar *g = compile("root ::= \"(\" root \")\" | \"x\"\n");
    grammar_set_limits(g, &(struct grammar_limits){.n_nodes_max = 50});
    int32_t st;
    ASSERT_OK(grammar_state_start(g, &st));
    int rc = 0;
    for (int i = 0; i < 100 && !rc; i++) rc = grammar_state_accept_bytes(g, st, "(", 1, &st);
    ASSERT_EQ(STATUS_EXHAUSTED, rc);
    ASSERT_EQ(GRAMMAR_STATE_DEAD, st);
    grammar_free(g);

    /* An ambiguous grammar adds parse stacks with every byte (each byte may
     * start a deeper item: two stacks a byte here), and a mask costs about
     * its stacks times the trie: by default a state of more than 256
     * stacks ends it, within 200 bytes, where a state of JSON keeps about a
     * dozen.  With a higher limit the same bytes go on. */
    static const char amb[] = "root ::= item+\nitem ::= [a-z]+ item+\n";
    for (int raised = 0; raised < 2; raised++) {
        g = compile(amb);
        if (raised) grammar_set_limits(g, &(struct grammar_limits){.n_stacks_max = 100000});
        ASSERT_OK(grammar_state_start(g, &st));
        rc = 0;
        int i = 0;
        for (; i < 200 && !rc; i++) rc = grammar_state_accept_bytes(g, st, "a", 1, &st);
        if (raised) {
            ASSERT_OK(rc);
            ASSERT_TRUE(st >= 0);
        } else {
            ASSERT_EQ(STATUS_EXHAUSTED, rc);
            ASSERT_EQ(GRAMMAR_STATE_DEAD, st);
        }
        grammar_free(g);
    }
}

TEST(grammar_vocab_from_stories260k) {
    const char *path = LLM_SOURCE_DIR "/../shared/models/stories260K-f32.gguf";
    tokenizer *t = NULL;
    char err[256];
    if (tokenizer_load(&t, path, err, sizeof err)) TEST_SKIP("%s (test models missing)", err);
    grammar_vocab *v = NULL;
    ASSERT_OK(grammar_vocab_from_tokenizer(&v, t, err, sizeof err));
    grammar *g = compile("root ::= \"{\" [ a-z]* \"}\"\n");
    size_t words = grammar_vocab_mask_words(v);
    uint64_t *m = calloc(words, 8);
    int32_t st;
    ASSERT_OK(grammar_state_start(g, &st));
    ASSERT_OK(grammar_mask(g, v, st, m));
    int32_t n = tokenizer_n_vocab(t), n_allowed = 0;
    for (int32_t i = 0; i < n; i++) {
        if (!(m[i >> 6] >> (i & 63) & 1)) continue;
        n_allowed++;
        char b[64];
        int len = tokenizer_token_bytes(t, i, b, sizeof b);
        ASSERT_TRUE(len >= 1 && b[0] == '{');
    }
    ASSERT_TRUE(n_allowed >= 1); /* the byte token <0x7B> at least */
    ASSERT_EQ(1, grammar_vocab_is_eog(v, tokenizer_eos(t)));
    ASSERT_EQ(0, (int)(m[tokenizer_eos(t) >> 6] >> (tokenizer_eos(t) & 63) & 1));
    free(m);
    grammar_free(g);
    grammar_vocab_free(v);
    tokenizer_free(t);
}

TEST_MAIN(grammar_literals_and_alternation, grammar_repetition, grammar_character_classes,
          grammar_escapes_and_comments, grammar_nested_rules_and_multiline,
          grammar_errors_name_line_and_column, grammar_eos_only_when_complete,
          grammar_mask_equals_brute_force, grammar_replay_gives_the_same_state,
          grammar_limits_end_in_exhausted, grammar_vocab_from_stories260k)
