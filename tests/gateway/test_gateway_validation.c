/* Tests of the requests llm-gateway refuses, with OpenAI's error object
 * (status, param, message, code), in front of a real cluster
 * (tests/gateway/gw_fixture.h): bad JSON, wrong types, values out of
 * range, unknown and unsupported fields (and the extensions it accepts), a
 * field given twice, wrong routes and methods, an unknown model; invalid
 * UTF-8 in any field, a message quoting a long field name in whole
 * characters, bytes after the JSON value, a prompt longer than the context
 * as text, token ids and chat. */
#include "tests/gateway/gw_fixture.h"

#include "common/unicode.h"

TEST(bad_requests) {
    setup();
    struct resp r;
    static const struct {
        const char *body, *param, *needle, *code; /* code: OpenAI's, "null" for none */
    } cases[] = {
        {"{\"prompt\": \"a\", ", "null", "not valid JSON", "null"},
        {"[1, 2]", "null", "must be a JSON object", "null"},
        {"{\"prompt\":\"a\",\"temperature\":\"hot\"}", "temperature", "must be a number", "invalid_type"},
        {"{\"prompt\":\"a\",\"temperature\":2.5}", "temperature", "outside [0, 2]", "decimal_above_max_value"},
        {"{\"prompt\":\"a\",\"max_tokens\":1.5}", "max_tokens", "must be an integer", "invalid_type"},
        {"{\"prompt\":\"a\",\"max_tokens\":0}", "max_tokens", "outside", "integer_below_min_value"},
        {"{\"prompt\":\"a\",\"n\":17}", "n", "outside", "integer_above_max_value"},
        {"{\"prompt\":\"a\",\"best_of\":2}", "best_of", "does not rank completions", "unsupported_value"},
        {"{\"prompt\":\"a\",\"frobnicate\":1}", "frobnicate", "Unrecognized request argument", "unknown_parameter"},
        {"{\"prompt\":\"a\",\"stop\":[\"x\",3]}", "stop[1]", "must be a string", "invalid_type"},
        {"{\"prompt\":\"a\",\"stop\":\"\"}", "stop", "empty", "invalid_value"},
        {"{\"prompt\":\"a\",\"top_p\":-0.1}", "top_p", "outside", "decimal_below_min_value"},
        {"{\"prompt\":\"a\",\"presence_penalty\":3}", "presence_penalty", "outside [-2, 2]", "decimal_above_max_value"},
        {"{\"prompt\":\"a\",\"logprobs\":6}", "logprobs", "outside", "integer_above_max_value"},
        {"{\"prompt\":[\"a\",\"b\"]}", "prompt", "one prompt", "invalid_value"},
        {"{\"max_tokens\":3}", "prompt", "prompt is required", "missing_required_parameter"},
        {"{\"prompt\":\"a\",\"stream_options\":{\"include_usage\":true}}", "stream_options", "stream is true",
         "invalid_value"},
        {"{\"prompt\":\"a\",\"seed\":-1}", "seed", "outside", "integer_below_min_value"},
        {"{\"prompt\":\"a\",\"echo\":true}", "echo", "not supported", "unsupported_value"},
        {"{\"prompt\":\"a\",\"max_tokens\":2,\"max_tokens\":3}", "max_tokens", "appears twice", "invalid_value"},
    };
    for (size_t i = 0; i < sizeof cases / sizeof cases[0]; i++) {
        post(cl_, &gw_keyed, "/v1/completions", GW_KEY, cases[i].body, &r);
        expect_error(cl_, &r, 400, cases[i].param, cases[i].needle, cases[i].body);
        expect_code(cl_, &r, cases[i].code, cases[i].body);
        resp_free(&r);
    }
    post(cl_, &gw_open, "/v1/chat/completions", NULL, "{\"messages\":[{\"role\":\"tool\",\"content\":\"x\"}]}", &r);
    expect_error(cl_, &r, 400, "messages", "messages[0].role", "tool role");
    expect_code(cl_, &r, "invalid_value", "tool role");
    resp_free(&r);
    post(cl_, &gw_open, "/v1/chat/completions", NULL, "{\"messages\":[{\"role\":\"user\",\"content\":7}]}", &r);
    expect_error(cl_, &r, 400, "messages[0].content", "must be a string", "content type");
    expect_code(cl_, &r, "invalid_type", "content type");
    resp_free(&r);
    post(cl_, &gw_open, "/v1/chat/completions", NULL,
         "{\"messages\":[{\"role\":\"user\",\"content\":\"x\"}],\"tools\":[{\"type\":\"function\"}]}", &r);
    expect_error(cl_, &r, 400, "tools", "not supported", "tools");
    expect_code(cl_, &r, "unsupported_parameter", "tools");
    resp_free(&r);
    /* The sampler's extensions and the penalties are accepted. */
    post(cl_, &gw_keyed, "/v1/completions", GW_KEY,
         "{\"prompt\":\"a\",\"max_tokens\":3,\"temperature\":0.8,\"top_k\":40,\"min_p\":0.05,\"top_p\":0.9,"
         "\"repetition_penalty\":1.1,\"presence_penalty\":0.5,\"frequency_penalty\":0.5,\"seed\":7,"
         "\"ignore_eos\":true,\"user\":\"u1\",\"stop\":[\"\\n\"],\"logprobs\":null}", &r);
    H_ASSERT(cl_, r.status == 200, "extensions: status %d: %s", r.status, r.body);
    resp_free(&r);
    /* Speculation per request (docs/gateway.md): named modes only. */
    post(cl_, &gw_keyed, "/v1/completions", GW_KEY,
         "{\"prompt\":\"a b a b a\",\"max_tokens\":4,\"speculation\":\"ngram\",\"num_speculative_tokens\":3}", &r);
    H_ASSERT(cl_, r.status == 200, "speculation: status %d: %s", r.status, r.body);
    resp_free(&r);
    post(cl_, &gw_open, "/v1/completions", NULL, "{\"prompt\":\"a\",\"speculation\":\"bogus\"}", &r);
    expect_error(cl_, &r, 400, "speculation", "one of", "speculation bogus");
    expect_code(cl_, &r, "unsupported_value", "speculation bogus");
    resp_free(&r);
    /* Predicted outputs: only {"type": "content"} with text content. */
    post(cl_, &gw_open, "/v1/completions", NULL,
         "{\"prompt\":\"a\",\"prediction\":{\"type\":\"diff\",\"content\":\"x\"}}", &r);
    expect_error(cl_, &r, 400, "prediction.type", "\"diff\" is not supported", "prediction type");
    expect_code(cl_, &r, "unsupported_value", "prediction type");
    resp_free(&r);
    post(cl_, &gw_open, "/v1/completions", NULL, "{\"prompt\":\"a\",\"prediction\":\"x\"}", &r);
    expect_error(cl_, &r, 400, "prediction", "must be an object", "prediction string");
    expect_code(cl_, &r, "invalid_type", "prediction string");
    resp_free(&r);
    post(cl_, &gw_open, "/v1/completions", NULL, "{\"prompt\":\"a\",\"prediction\":{\"type\":\"content\"}}", &r);
    expect_error(cl_, &r, 400, "prediction.content", "missing", "prediction without content");
    expect_code(cl_, &r, "missing_required_parameter", "prediction without content");
    resp_free(&r);
    post(cl_, &gw_open, "/v1/completions", NULL,
         "{\"prompt\":\"a\",\"prediction\":{\"type\":\"content\",\"content\":[{\"type\":\"image_url\"}]}}", &r);
    expect_error(cl_, &r, 400, "prediction.content", "only text parts", "prediction image part");
    resp_free(&r);
    post(cl_, &gw_open, "/v1/completions", NULL, "{\"prompt\":\"a\",\"num_speculative_tokens\":17}", &r);
    expect_error(cl_, &r, 400, "num_speculative_tokens", NULL, "spec tokens");
    resp_free(&r);
    /* Routes and methods. */
    char url[128];
    snprintf(url, sizeof url, "%s/v1/completions", gw_keyed.url);
    curl(cl_, "GET", url, GW_KEY, NULL, 0, NULL, &r);
    expect_error(cl_, &r, 405, NULL, "use POST", "GET completions");
    ASSERT_TRUE(strstr(r.headers, "Allow: POST") != NULL);
    resp_free(&r);
    snprintf(url, sizeof url, "%s/v1/embeddings", gw_keyed.url);
    curl(cl_, "POST", url, GW_KEY, "{}", 2, NULL, &r);
    expect_error(cl_, &r, 404, NULL, "/v1/embeddings", "unknown path");
    resp_free(&r);
    /* An unknown model: the router's NOT_FOUND. */
    post(cl_, &gw_keyed, "/v1/completions", GW_KEY, "{\"model\":\"gpt-9\",\"prompt\":\"a\",\"max_tokens\":2}", &r);
    expect_error(cl_, &r, 404, "model", NULL, "unknown model");
    resp_free(&r);
    /* "default", the name a response reports when no model is named,
     * names the default model back. */
    post(cl_, &gw_keyed, "/v1/completions", GW_KEY, "{\"model\":\"default\",\"prompt\":\"a\",\"max_tokens\":2}", &r);
    H_ASSERT(cl_, r.status == 200, "model \"default\": status %d: %s", r.status, r.body);
    resp_free(&r);
    /* A prompt longer than the context: the router's refusal, as 400. */
    char *big = malloc(40000);
    strcpy(big, "{\"prompt\":\"");
    for (int i = 0; i < 3000; i++) strcat(big, "dog ");
    strcat(big, "\",\"max_tokens\":10}");
    post(cl_, &gw_keyed, "/v1/completions", GW_KEY, big, &r);
    H_ASSERT(cl_, r.status == 400 || r.status == 413, "long prompt: status %d: %s", r.status, r.body);
    resp_free(&r);
    free(big);
}


/* ---- issue 29: hardening ---------------------------------------------------- */

/* Invalid UTF-8 anywhere in a body is the client's error, named by its
 * field and answered at once (it used to reach the router, whose refusal
 * libllmclient dropped: 503 router_unavailable after --router-retry-ms). */
TEST(invalid_utf8_refused) {
    setup();
    struct resp r;
    static const struct {
        const struct gw *g;
        const char *path, *key, *body, *param;
    } cases[] = {
        {&gw_keyed, "/v1/completions", GW_KEY, "{\"prompt\":\"\xff\xfe\",\"max_tokens\":2}", "prompt"},
        {&gw_keyed, "/v1/completions", GW_KEY, "{\"prompt\":[\"ok \xc3\"],\"max_tokens\":2}", "prompt[0]"},
        {&gw_keyed, "/v1/completions", GW_KEY, "{\"prompt\":\"a\",\"stop\":[\"x\",\"\xe2\x82\"]}", "stop[1]"},
        {&gw_open, "/v1/chat/completions", NULL, "{\"messages\":[{\"role\":\"user\",\"content\":\"caf\xe9\"}]}",
         "messages[0].content"},
        {&gw_open, "/v1/chat/completions", NULL,
         "{\"messages\":[{\"role\":\"user\",\"content\":\"ok\"},{\"role\":\"user\",\"content\":[{\"type\":\"text\","
         "\"text\":\"\xed\xa0\x80\"}]}]}", "messages[1].content[0].text"},
    };
    for (size_t i = 0; i < sizeof cases / sizeof cases[0]; i++) {
        int64_t t0 = h_now_ms();
        post(cl_, cases[i].g, cases[i].path, cases[i].key, cases[i].body, &r);
        int64_t took = h_now_ms() - t0;
        expect_error(cl_, &r, 400, cases[i].param, "not valid UTF-8", cases[i].param);
        ASSERT_STREQ("invalid_request_error", err_field(&r, "type"));
        H_ASSERT(cl_, took < 1000, "%s: the refusal took %lld ms", cases[i].param, (long long)took);
        resp_free(&r);
    }
    /* A message that quotes a field name cut at its length limit keeps
     * whole characters: the 64th byte starts an é. */
    post(cl_, &gw_keyed, "/v1/completions", GW_KEY,
         "{\"prompt\":\"a\",\"xxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxx\xc3\xa9\":1}", &r);
    expect_error(cl_, &r, 400, "xxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxx", "Unrecognized",
                 "a long field name");
    H_ASSERT(cl_, unicode_utf8_valid_prefix(r.body, strlen(r.body)) == strlen(r.body),
             "the error body is not UTF-8: %s", r.body);
    resp_free(&r);
    /* Whole characters pass: é as UTF-8. */
    post(cl_, &gw_keyed, "/v1/completions", GW_KEY, "{\"prompt\":\"caf\xc3\xa9\",\"max_tokens\":2}", &r);
    H_ASSERT(cl_, r.status == 200, "a valid UTF-8 prompt: status %d: %s", r.status, r.body);
    resp_free(&r);
}

/* A body is one JSON value: a second object after it was silently dropped. */
TEST(trailing_bytes_refused) {
    setup();
    struct resp r;
    post(cl_, &gw_keyed, "/v1/completions", GW_KEY, "{\"prompt\":\"a\",\"max_tokens\":2} {\"prompt\":\"b\"}", &r);
    expect_error(cl_, &r, 400, "null", "after its JSON value", "two objects");
    resp_free(&r);
    post(cl_, &gw_keyed, "/v1/completions", GW_KEY, "{\"prompt\":\"a\",\"max_tokens\":2}x", &r);
    expect_error(cl_, &r, 400, "null", "1 more bytes", "one trailing byte");
    resp_free(&r);
    /* Blanks after the object are fine. */
    post(cl_, &gw_keyed, "/v1/completions", GW_KEY, "{\"prompt\":\"a\",\"max_tokens\":2}\r\n \n", &r);
    H_ASSERT(cl_, r.status == 200, "trailing blanks: status %d: %s", r.status, r.body);
    resp_free(&r);
}

/* A prompt longer than the context is OpenAI's 400 context_length_exceeded
 * with the prompt's field as param, and a message without libllmclient's
 * "generate: INVALID_ARGUMENT: ... (request ...)" wrapping: a text prompt
 * through the router's refusal, token ids and chat by the gateway itself. */
TEST(context_length_exceeded) {
    setup();
    struct resp r;
    char *big = malloc(40000);
    strcpy(big, "{\"prompt\":\"");
    for (int i = 0; i < 3000; i++) strcat(big, "dog ");
    strcat(big, "\",\"max_tokens\":10}");
    post(cl_, &gw_keyed, "/v1/completions", GW_KEY, big, &r);
    expect_error(cl_, &r, 400, "prompt", "context", "a 3000-word prompt");
    ASSERT_STREQ("context_length_exceeded", err_field(&r, "code"));
    const char *msg = err_field(&r, "message");
    H_ASSERT(cl_, !strstr(msg, "INVALID_ARGUMENT") && !strstr(msg, "generate:") && !strstr(msg, "(request "),
             "the message carries libllmclient's wrapping: %s", msg);
    resp_free(&r);

    strcpy(big, "{\"prompt\":[1");
    for (int i = 1; i < 200; i++) strcat(big, ",1");
    strcat(big, "],\"max_tokens\":2}");
    post(cl_, &gw_keyed, "/v1/completions", GW_KEY, big, &r);
    expect_error(cl_, &r, 400, "prompt", "maximum context length is 128 tokens", "200 token ids");
    ASSERT_STREQ("context_length_exceeded", err_field(&r, "code"));
    resp_free(&r);

    strcpy(big, "{\"messages\":[{\"role\":\"user\",\"content\":\"");
    for (int i = 0; i < 300; i++) strcat(big, "dog ");
    strcat(big, "\"}]}");
    post(cl_, &gw_open, "/v1/chat/completions", NULL, big, &r);
    expect_error(cl_, &r, 400, "messages", "maximum context length is 128 tokens", "a 300-word chat");
    ASSERT_STREQ("context_length_exceeded", err_field(&r, "code"));
    resp_free(&r);
    free(big);
}

TEST_MAIN(bad_requests, invalid_utf8_refused, trailing_bytes_refused, context_length_exceeded, teardown)
