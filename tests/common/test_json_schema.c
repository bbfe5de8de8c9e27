/* Tests for common/json_schema: each supported keyword accepts and refuses
 * the right texts, unsupported keywords are refused by name, and random
 * walks through the masks always end in JSON that meets the schema. */
#include "common/json_schema.h"

#include <cjson/cJSON.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "common/grammar.h"
#include "common/status.h"
#include "tests/test.h"

static grammar *from_schema(const char *schema) {
    char *gbnf = NULL;
    char err[512];
    int rc = json_schema_to_gbnf(schema, strlen(schema), &gbnf, err, sizeof err);
    if (rc) TEST_FAIL("json_schema_to_gbnf(%s): %s", schema, err);
    grammar *g = NULL;
    rc = grammar_parse(&g, gbnf, strlen(gbnf), err, sizeof err);
    if (rc) TEST_FAIL("grammar_parse: %s\n%s", err, gbnf);
    free(gbnf);
    return g;
}

static int match(grammar *g, const char *s) {
    int32_t st;
    if (grammar_state_start(g, &st)) return -2;
    if (grammar_state_accept_bytes(g, st, s, strlen(s), &st)) return -2;
    if (st == GRAMMAR_STATE_DEAD) return -1;
    return grammar_state_is_complete(g, st);
}

static const char *refusal(const char *schema, int want_status) {
    static char err[512];
    char *gbnf = NULL;
    int rc = json_schema_to_gbnf(schema, strlen(schema), &gbnf, err, sizeof err);
    if (rc != want_status) TEST_FAIL("%s: expected status %d, got %d (%s)", schema, want_status, rc,
                                     rc ? err : gbnf);
    if (gbnf) TEST_FAIL("*gbnf not NULL on failure");
    return err;
}

TEST(json_schema_object_required_and_optional) {
    grammar *g = from_schema("{\"type\":\"object\",\"properties\":{\"a\":{\"type\":\"integer\"},"
                             "\"b\":{\"type\":\"string\"},\"c\":{\"type\":\"boolean\"}},"
                             "\"required\":[\"b\"],\"additionalProperties\":false}");
    ASSERT_EQ(1, match(g, "{\"b\":\"x\"}"));
    ASSERT_EQ(1, match(g, "{\"a\":-12,\"b\":\"\"}"));
    ASSERT_EQ(1, match(g, "{ \"a\": 0, \"b\": \"hi\", \"c\": true }"));
    ASSERT_EQ(1, match(g, "{\"b\":\"x\",\"c\":false}\n"));
    ASSERT_EQ(-1, match(g, "{}"));             /* b is required */
    ASSERT_EQ(-1, match(g, "{\"a\":1}"));
    ASSERT_EQ(-1, match(g, "{\"b\":\"x\",}"));  /* no trailing comma */
    ASSERT_EQ(-1, match(g, "{,\"b\":\"x\"}"));
    ASSERT_EQ(-1, match(g, "{\"a\":01,\"b\":\"x\"}"));
    ASSERT_EQ(-1, match(g, "{\"a\":1.5,\"b\":\"x\"}"));
    ASSERT_EQ(-1, match(g, "{\"d\":1,\"b\":\"x\"}"));
    ASSERT_EQ(0, match(g, "{\"b\":\"x\""));
    grammar_free(g);
}

TEST(json_schema_primitives) {
    grammar *g = from_schema("{\"type\":\"array\",\"items\":{\"type\":[\"number\",\"null\"]}}");
    ASSERT_EQ(1, match(g, "[]"));
    ASSERT_EQ(1, match(g, "[1, -0.5, 3e10, null, 2.25E-3]"));
    ASSERT_EQ(-1, match(g, "[1,]"));
    ASSERT_EQ(-1, match(g, "[.5]"));
    ASSERT_EQ(-1, match(g, "[true]"));
    grammar_free(g);
    g = from_schema("{\"type\":\"string\"}");
    ASSERT_EQ(1, match(g, "\"a \\\"q\\\" \\u00e9 \\n é\""));
    ASSERT_EQ(-1, match(g, "\"a\nb\""));       /* raw control characters are not JSON */
    ASSERT_EQ(-1, match(g, "\"\\ud800\""));    /* no surrogate escapes */
    ASSERT_EQ(-1, match(g, "\"\\x\""));
    grammar_free(g);
    g = from_schema("{\"type\":\"boolean\"}");
    ASSERT_EQ(1, match(g, "true"));
    ASSERT_EQ(-1, match(g, "True"));
    grammar_free(g);
}

TEST(json_schema_enum_const_anyof) {
    grammar *g = from_schema("{\"type\":\"object\",\"properties\":{"
                             "\"color\":{\"enum\":[\"red\",\"green\",3,null,{\"k\":[1]}]},"
                             "\"v\":{\"const\":\"a\\\"b\"},"
                             "\"u\":{\"anyOf\":[{\"type\":\"integer\"},{\"type\":\"string\","
                             "\"maxLength\":2}]}},"
                             "\"required\":[\"color\",\"v\",\"u\"]}");
    ASSERT_EQ(1, match(g, "{\"color\":\"red\",\"v\":\"a\\\"b\",\"u\":7}"));
    ASSERT_EQ(1, match(g, "{\"color\":{\"k\":[1]},\"v\":\"a\\\"b\",\"u\":\"ab\"}"));
    ASSERT_EQ(1, match(g, "{\"color\":null,\"v\":\"a\\\"b\",\"u\":\"\"}"));
    ASSERT_EQ(-1, match(g, "{\"color\":\"blue\""));
    ASSERT_EQ(-1, match(g, "{\"color\":3,\"v\":\"ab\""));
    ASSERT_EQ(-1, match(g, "{\"color\":3,\"v\":\"a\\\"b\",\"u\":\"abc\"}"));
    grammar_free(g);
}

TEST(json_schema_array_and_string_bounds) {
    grammar *g = from_schema("{\"type\":\"array\",\"items\":{\"type\":\"string\",\"minLength\":1,"
                             "\"maxLength\":3},\"minItems\":2,\"maxItems\":3}");
    ASSERT_EQ(1, match(g, "[\"a\",\"bcd\"]"));
    ASSERT_EQ(1, match(g, "[\"a\", \"b\", \"\\n\"]"));
    ASSERT_EQ(-1, match(g, "[\"a\"]"));
    ASSERT_EQ(-1, match(g, "[\"a\",\"b\",\"c\",\"d\"]"));
    ASSERT_EQ(-1, match(g, "[\"\",\"b\"]"));
    ASSERT_EQ(-1, match(g, "[\"abcd\",\"b\"]"));
    grammar_free(g);
    g = from_schema("{\"type\":\"array\",\"maxItems\":0}");
    ASSERT_EQ(1, match(g, "[]"));
    ASSERT_EQ(-1, match(g, "[1]"));
    grammar_free(g);
}

TEST(json_schema_nested_refs_and_any) {
    grammar *g = from_schema("{\"$defs\":{\"node\":{\"type\":\"object\",\"properties\":{"
                             "\"v\":{\"type\":\"integer\"},\"kids\":{\"type\":\"array\","
                             "\"items\":{\"$ref\":\"#/$defs/node\"}}},\"required\":[\"v\"],"
                             "\"additionalProperties\":false}},\"$ref\":\"#/$defs/node\"}");
    ASSERT_EQ(1, match(g, "{\"v\":1,\"kids\":[{\"v\":2},{\"v\":3,\"kids\":[]}]}"));
    ASSERT_EQ(-1, match(g, "{\"v\":1,\"kids\":[{}]}"));
    grammar_free(g);
    g = from_schema("{\"type\":\"object\",\"properties\":{\"meta\":{}}}");
    ASSERT_EQ(1, match(g, "{\"meta\":{\"x\":[1,\"y\",{\"z\":null}]}}"));
    ASSERT_EQ(1, match(g, "{}"));
    grammar_free(g);
    g = from_schema("{\"type\":\"object\"}");
    ASSERT_EQ(1, match(g, "{\"anything\":[true,false]}"));
    ASSERT_EQ(-1, match(g, "[]"));
    grammar_free(g);
    g = from_schema("{\"type\":\"object\",\"additionalProperties\":false}");
    ASSERT_EQ(1, match(g, "{ }"));
    ASSERT_EQ(-1, match(g, "{\"a\":1}"));
    grammar_free(g);
    const char *any = json_schema_any_object_gbnf();
    char err[256];
    ASSERT_OK(grammar_parse(&g, any, strlen(any), err, sizeof err));
    ASSERT_EQ(1, match(g, "{\"a\": [1, {\"b\": \"c\"}], \"d\": -1.5e3}"));
    ASSERT_EQ(-1, match(g, "\"just a string\""));
    ASSERT_EQ(-1, match(g, "[1]"));
    grammar_free(g);
}

TEST(json_schema_refuses_by_name) {
    ASSERT_STREQ("json schema /properties/age: keyword 'minimum' is not supported",
                 refusal("{\"type\":\"object\",\"properties\":{\"age\":{\"type\":\"integer\","
                         "\"minimum\":0}}}", STATUS_UNSUPPORTED));
    ASSERT_STREQ("json schema /: keyword 'pattern' is not supported",
                 refusal("{\"type\":\"string\",\"pattern\":\"^a\"}", STATUS_UNSUPPORTED));
    ASSERT_STREQ("json schema /items: keyword 'format' is not supported",
                 refusal("{\"type\":\"array\",\"items\":{\"type\":\"string\",\"format\":\"date\"}}",
                         STATUS_UNSUPPORTED));
    ASSERT_STREQ("json schema /: keyword 'oneOf' is not supported",
                 refusal("{\"oneOf\":[{\"type\":\"string\"}]}", STATUS_UNSUPPORTED));
    ASSERT_STREQ("json schema /: keyword 'additionalProperties' is supported as true or false only",
                 refusal("{\"type\":\"object\",\"additionalProperties\":{\"type\":\"string\"}}",
                         STATUS_UNSUPPORTED));
    ASSERT_STREQ("json schema /: keyword 'uniqueItems' is not supported",
                 refusal("{\"type\":\"array\",\"uniqueItems\":true}", STATUS_UNSUPPORTED));
    ASSERT_STREQ("json schema /: 'type' = \"text\" is not a JSON Schema type",
                 refusal("{\"type\":\"text\"}", STATUS_BAD_INPUT));
    ASSERT_STREQ("json schema /: required property 'x' has no schema in 'properties'",
                 refusal("{\"type\":\"object\",\"required\":[\"x\"]}", STATUS_UNSUPPORTED));
    ASSERT_STREQ("json schema /: 'maxLength' = 20000 is above the supported 10000",
                 refusal("{\"type\":\"string\",\"maxLength\":20000}", STATUS_UNSUPPORTED));
    ASSERT_STREQ("json schema /: '$ref' = \"http://x/y\": only local references (#, "
                 "#/$defs/NAME, #/definitions/NAME) are supported",
                 refusal("{\"$ref\":\"http://x/y\"}", STATUS_UNSUPPORTED));
    /* A refusal inside a branch refuses the whole schema, by name (it was
     * GBNF naming an undefined rule). */
    ASSERT_STREQ("json schema /anyOf/1: keyword 'minimum' is not supported",
                 refusal("{\"anyOf\":[{\"type\":\"string\"},{\"type\":\"integer\",\"minimum\":0}]}",
                         STATUS_UNSUPPORTED));
    ASSERT_STREQ("json schema /: 'type' = \"text\" is not a JSON Schema type",
                 refusal("{\"type\":[\"string\",\"text\"]}", STATUS_BAD_INPUT));
    ASSERT_STREQ("json schema: not valid UTF-8 (byte 13 is not part of a character)",
                 refusal("{\"const\":\"caf\xe9\"}", STATUS_BAD_INPUT));
    ASSERT_TRUE(strstr(refusal("{\"type\":\"string\",\"maxLength\":1e60}", STATUS_UNSUPPORTED),
                       "is above the supported 10000") != NULL);
    const char *e = refusal("{\"type\":", STATUS_BAD_INPUT);
    ASSERT_TRUE(strncmp(e, "json schema: not valid JSON", 27) == 0);
    /* annotations are not constraints: accepted */
    grammar *g = from_schema("{\"title\":\"t\",\"description\":\"d\",\"$schema\":\"x\","
                             "\"type\":\"null\",\"default\":null}");
    ASSERT_EQ(1, match(g, "null"));
    grammar_free(g);
}

/* A vocabulary of all single bytes and some JSON-ish pieces; the last
 * token is EOS. */
static grammar_vocab *json_vocab(int32_t *n_out, char ***bytes_out, int32_t **lens_out) {
    static const char *extra[] = {"{\"", "\":", "\",\"", "\"}", "true", "false", "null", "12",
                                  "0.", "e+", "  ", "\n ", "red", "green", "abc", "[\"", "\"]",
                                  "{}", "[]", ", ", ": "};
    int32_t n_extra = (int32_t)(sizeof extra / sizeof extra[0]);
    int32_t n = 256 + n_extra + 1;
    char **bytes = calloc((size_t)n, sizeof *bytes);
    int32_t *lens = calloc((size_t)n, sizeof *lens);
    for (int32_t i = 0; i < 256; i++) {
        bytes[i] = malloc(1);
        bytes[i][0] = (char)i;
        lens[i] = 1;
    }
    for (int32_t i = 0; i < n_extra; i++) {
        bytes[256 + i] = strdup(extra[i]);
        lens[256 + i] = (int32_t)strlen(extra[i]);
    }
    int32_t eog = n - 1;
    grammar_vocab *v = NULL;
    char err[128];
    if (grammar_vocab_from_bytes(&v, n, (const char *const *)bytes, lens, &eog, 1, err, sizeof err))
        TEST_FAIL("%s", err);
    *n_out = n;
    *bytes_out = bytes;
    *lens_out = lens;
    return v;
}

static uint64_t rs = 0x9E3779B97F4A7C15ull;
static uint32_t rnd(uint32_t n) {
    rs ^= rs << 13, rs ^= rs >> 7, rs ^= rs << 17;
    return (uint32_t)(rs % n);
}

TEST(json_schema_random_walks_give_valid_json) {
    const char *schema = "{\"type\":\"object\",\"properties\":{"
                         "\"name\":{\"type\":\"string\",\"maxLength\":6},"
                         "\"n\":{\"type\":\"integer\"},"
                         "\"tags\":{\"type\":\"array\",\"items\":{\"enum\":[\"red\",\"green\"]},"
                         "\"minItems\":1,\"maxItems\":3},"
                         "\"ok\":{\"type\":\"boolean\"}},"
                         "\"required\":[\"name\",\"tags\"],\"additionalProperties\":false}";
    grammar *g = from_schema(schema);
    int32_t n;
    char **bytes;
    int32_t *lens;
    grammar_vocab *v = json_vocab(&n, &bytes, &lens);
    uint64_t *m = malloc(grammar_vocab_mask_words(v) * 8);
    int32_t *allowed = malloc(sizeof *allowed * (size_t)n);
    for (int run = 0; run < 200; run++) {
        char out[4096];
        size_t len = 0;
        int32_t st;
        ASSERT_OK(grammar_state_start(g, &st));
        int done = 0;
        for (int step = 0; step < 400 && !done; step++) {
            ASSERT_OK(grammar_mask(g, v, st, m));
            int32_t k = 0;
            for (int32_t t = 0; t < n; t++)
                if (m[t >> 6] >> (t & 63) & 1) allowed[k++] = t;
            ASSERT_TRUE(k > 0);
            int32_t t = allowed[rnd((uint32_t)k)];
            /* end as soon as allowed half of the time, so that walks finish */
            if ((m[(n - 1) >> 6] >> ((n - 1) & 63) & 1) && rnd(2)) t = n - 1;
            if (t == n - 1) {
                done = 1;
                break;
            }
            ASSERT_TRUE(len + (size_t)lens[t] < sizeof out);
            memcpy(out + len, bytes[t], (size_t)lens[t]);
            len += (size_t)lens[t];
            ASSERT_OK(grammar_state_accept_token(g, v, st, t, &st));
            ASSERT_NE(GRAMMAR_STATE_DEAD, st);
        }
        out[len] = 0;
        if (!done) TEST_FAIL("run %d: no end after 400 tokens: %s", run, out);
        cJSON *j = cJSON_Parse(out);
        if (!j) TEST_FAIL("run %d: not JSON: %s", run, out);
        const cJSON *name = cJSON_GetObjectItemCaseSensitive(j, "name");
        const cJSON *tags = cJSON_GetObjectItemCaseSensitive(j, "tags");
        ASSERT_TRUE(cJSON_IsString(name));
        ASSERT_TRUE(cJSON_IsArray(tags));
        int nt = cJSON_GetArraySize(tags);
        ASSERT_TRUE(nt >= 1 && nt <= 3);
        for (const cJSON *c = j->child; c; c = c->next)
            ASSERT_TRUE(strcmp(c->string, "name") == 0 || strcmp(c->string, "n") == 0 ||
                        strcmp(c->string, "tags") == 0 || strcmp(c->string, "ok") == 0);
        cJSON_Delete(j);
    }
    free(m), free(allowed);
    for (int32_t i = 0; i < n; i++) free(bytes[i]);
    free(bytes), free(lens);
    grammar_vocab_free(v);
    grammar_free(g);
}

TEST_MAIN(json_schema_object_required_and_optional, json_schema_primitives,
          json_schema_enum_const_anyof, json_schema_array_and_string_bounds,
          json_schema_nested_refs_and_any, json_schema_refuses_by_name,
          json_schema_random_walks_give_valid_json)
