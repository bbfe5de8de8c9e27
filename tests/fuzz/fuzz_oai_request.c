/* An OpenAI API request body as the gateway receives it: the first byte
 * picks the endpoint (even: /v1/completions, odd: /v1/chat/completions),
 * the rest is the body.  oai_parse either refuses it with a 400 whose
 * error object is JSON in UTF-8 naming the problem, or accepts it within
 * the router's limits (choices, stop strings, a prompt or messages). */
#include <cjson/cJSON.h>
#include <stdlib.h>
#include <string.h>

#include "common/unicode.h"
#include "gateway/oai.h"
#include "tests/fuzz/fuzz_util.h"

static void check_error_json(const struct oai_error *e) {
    char *s = oai_error_json(e);
    if (!s) fuzz_fail("oai_error_json: out of memory");
    size_t n = strlen(s);
    if (unicode_utf8_valid_prefix(s, n) != n) fuzz_fail("the error object is not UTF-8: %s", s);
    cJSON *j = cJSON_Parse(s);
    const cJSON *msg = cJSON_GetObjectItemCaseSensitive(cJSON_GetObjectItemCaseSensitive(j, "error"), "message");
    if (!cJSON_IsString(msg) || !msg->valuestring[0]) fuzz_fail("an error object without a message: %s", s);
    cJSON_Delete(j);
    free(s);
}

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size) {
    if (size < 1) return 0;
    enum oai_kind kind = data[0] & 1 ? OAI_CHAT : OAI_COMPLETIONS;
    struct oai_request r;
    struct oai_error e;
    memset(&e, 0, sizeof e);
    if (oai_parse(kind, (const char *)data + 1, size - 1, &r, &e) < 0) {
        if (e.status != 400 || !e.type || !e.message[0])
            fuzz_fail("refused request: status %d, type %s, message \"%s\"", e.status, e.type ? e.type : "(null)",
                      e.message);
        check_error_json(&e);
        return 0;
    }
    if (r.n < 1 || r.n > OAI_N_MAX) fuzz_fail("accepted n = %u", r.n);
    if (r.n_stop > OAI_STOP_MAX) fuzz_fail("accepted %zu stop strings", r.n_stop);
    for (size_t i = 0; i < r.n_stop; i++)
        if (!r.stop[i] || !r.stop[i][0] || strlen(r.stop[i]) > OAI_STOP_BYTES_MAX)
            fuzz_fail("accepted stop string %zu: \"%s\"", i, r.stop[i] ? r.stop[i] : "(null)");
    if (kind == OAI_CHAT && (r.n_messages < 1 || !r.messages || !r.contents))
        fuzz_fail("accepted a chat request with %zu messages", r.n_messages);
    if (kind == OAI_COMPLETIONS && !r.prompt && !r.n_prompt_tokens)
        fuzz_fail("accepted a completion request without a prompt");
    for (size_t i = 0; i < r.n_messages; i++)
        if (!r.contents[i]) fuzz_fail("message %zu has no content string", i);
    if (r.prediction && strlen(r.prediction) > OAI_PREDICTION_BYTES_MAX)
        fuzz_fail("accepted a prediction of %zu bytes", strlen(r.prediction));
    oai_request_free(&r);
    return 0;
}
