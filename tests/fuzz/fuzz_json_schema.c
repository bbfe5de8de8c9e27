/* A JSON Schema from a client (response_format json_schema, or a request's
 * json_schema constraint), optionally followed by a NUL and choice bytes:
 * json_schema_to_gbnf; a schema it accepts must give GBNF that
 * grammar_parse compiles, and every text a walk through that grammar ends
 * on (fuzz_grammar_walk, steered by the choices) must be JSON: UTF-8, no
 * control character inside a string, and one value that cJSON parses with
 * nothing after it.  A refusal must be STATUS_BAD_INPUT or STATUS_UNSUPPORTED with a
 * message. */
#include <cjson/cJSON.h>
#include <stdlib.h>
#include <string.h>

#include "common/grammar.h"
#include "common/json_schema.h"
#include "common/status.h"
#include "common/unicode.h"
#include "tests/fuzz/fuzz_util.h"

/* NULL, or what makes s[0..n) not JSON text that cJSON would miss. */
static const char *json_bytes_problem(const char *s, size_t n) {
    if (unicode_utf8_valid_prefix(s, n) != n) return "not UTF-8";
    int in_string = 0;
    for (size_t i = 0; i < n; i++) {
        unsigned char c = (unsigned char)s[i];
        if (in_string) {
            if (c < 0x20) return "a control character inside a string";
            if (c == '\\') i++;
            else if (c == '"') in_string = 0;
        } else if (c == '"') {
            in_string = 1;
        } else if (c < 0x20 && c != '\t' && c != '\n' && c != '\r') {
            return "a control character between tokens";
        }
    }
    return NULL;
}

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size) {
    const uint8_t *part[2];
    size_t len[2];
    int n = fuzz_split(data, size, part, len, 2);
    char *gbnf = NULL;
    char err[512] = "";
    int rc = json_schema_to_gbnf((const char *)part[0], len[0], &gbnf, err, sizeof err);
    if (rc < 0) {
        if (gbnf || !err[0] || (rc != STATUS_BAD_INPUT && rc != STATUS_UNSUPPORTED))
            fuzz_fail("refused schema: rc %d, gbnf %p, message \"%s\"", rc, (void *)gbnf, err);
        return 0;
    }
    if (!gbnf) fuzz_fail("accepted schema without GBNF");
    grammar *g = NULL;
    if (grammar_parse(&g, gbnf, strlen(gbnf), err, sizeof err) < 0)
        fuzz_fail("the GBNF of an accepted schema does not compile: %s\n%s", err, gbnf);
    static char out[4096];
    size_t out_len;
    if (fuzz_grammar_walk(g, n > 1 ? part[1] : NULL, n > 1 ? len[1] : 0, out, sizeof out, &out_len)) {
        const char *why = json_bytes_problem(out, out_len);
        /* With the terminating NUL in the length, cJSON refuses anything after the value. */
        cJSON *j = why ? NULL : cJSON_ParseWithLengthOpts(out, out_len + 1, NULL, 1);
        if (!j)
            fuzz_fail("the schema's grammar produced \"%s\" (%zu bytes), which is not JSON (%s)\n%s", out, out_len,
                      why ? why : "cJSON refuses it", gbnf);
        cJSON_Delete(j);
    }
    grammar_free(g);
    free(gbnf);
    return 0;
}
