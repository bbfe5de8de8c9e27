/* GBNF text from a client (a request's grammar constraint), optionally
 * followed by a NUL and choice bytes: grammar_parse, then a walk the
 * choices steer (fuzz_grammar_walk: each step's mask
 * against the matcher, token by token).  A refusal must say where ("line
 * L, column C: ..."); the output of a walk that ended must replay through
 * grammar_state_accept_bytes to a complete state. */
#include <string.h>

#include "common/grammar.h"
#include "common/status.h"
#include "tests/fuzz/fuzz_util.h"

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size) {
    const uint8_t *part[2];
    size_t len[2];
    int n = fuzz_split(data, size, part, len, 2);
    grammar *g = NULL;
    char err[512] = "";
    int rc = grammar_parse(&g, (const char *)part[0], len[0], err, sizeof err);
    if (rc < 0) {
        if (g || rc != STATUS_BAD_INPUT || strncmp(err, "line ", 5) != 0)
            fuzz_fail("refused grammar: rc %d, g %p, message \"%s\"", rc, (void *)g, err);
        return 0;
    }
    static char out[4096];
    size_t out_len;
    if (fuzz_grammar_walk(g, n > 1 ? part[1] : NULL, n > 1 ? len[1] : 0, out, sizeof out, &out_len)) {
        int32_t st, end;
        if (grammar_state_start(g, &st) == 0 && grammar_state_accept_bytes(g, st, out, out_len, &end) == 0 &&
            !grammar_state_is_complete(g, end))
            fuzz_fail("the walk ended on \"%s\" (%zu bytes), which does not replay to a complete state", out,
                      out_len);
    }
    grammar_free(g);
    return 0;
}
