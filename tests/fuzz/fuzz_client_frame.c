/* A ClientEnvelope as the router receives it: proto_client_unpack, then
 * for a GenerateRequest the validation the router runs before accepting it
 * (proto_generate_validate, with and without a vocabulary), and for a
 * Cancel the request id check.  An accepted envelope must pack again, and
 * the packed bytes must unpack and pack to themselves: the router forwards
 * and stores what it accepted. */
#include <stdlib.h>
#include <string.h>

#include "proto/request.h"
#include "proto/wire.h"
#include "tests/fuzz/fuzz_util.h"

/* A fixed "now", 2025-01-01, so that a run is reproducible. */
#define FUZZ_NOW_MS 1735689600000LL

static void repack(Llm__ClientEnvelope *env) {
    uint8_t *a = NULL, *b = NULL;
    size_t na = 0, nb = 0;
    char err[512];
    if (proto_client_pack(env, &a, &na, err, sizeof err) < 0)
        fuzz_fail("an accepted client envelope does not pack: %s", err);
    Llm__ClientEnvelope *again;
    if (proto_client_unpack(a, na, &again, err, sizeof err) < 0)
        fuzz_fail("a packed client envelope does not unpack: %s", err);
    if (again->body_case != env->body_case)
        fuzz_fail("body %u came back as %u", env->body_case, again->body_case);
    if (proto_client_pack(again, &b, &nb, err, sizeof err) < 0)
        fuzz_fail("a repacked client envelope does not pack: %s", err);
    if (na != nb || memcmp(a, b, na) != 0) fuzz_fail("client envelope packs to %zu then %zu bytes", na, nb);
    proto_client_free(again);
    free(a);
    free(b);
}

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size) {
    Llm__ClientEnvelope *env = NULL;
    char err[512] = "";
    int rc = proto_client_unpack(data, size, &env, err, sizeof err);
    if (rc < 0) {
        if (env || !err[0]) fuzz_fail("refused client frame: env %p, message \"%s\"", (void *)env, err);
        return 0;
    }
    if (env->body_case == LLM__CLIENT_ENVELOPE__BODY__NOT_SET || env->version < PROTO_VERSION_MIN ||
        env->version > PROTO_VERSION)
        fuzz_fail("accepted client frame: body %u, version %u", env->body_case, env->version);
    if (env->body_case == LLM__CLIENT_ENVELOPE__BODY_GENERATE && env->generate) {
        int32_t vocabs[] = {0, 1, 260, 32000};
        for (size_t i = 0; i < sizeof vocabs / sizeof vocabs[0]; i++) {
            err[0] = 0;
            rc = proto_generate_validate(env->generate, vocabs[i], FUZZ_NOW_MS, err, sizeof err);
            if (rc < 0 && !err[0]) fuzz_fail("generate refused (%d) without a message", rc);
            if (rc == 0) {
                /* What the router then converts for the scheduler. */
                struct sampling_params sp;
                if (proto_sampling_from_msg(env->generate->sampling, &sp, err, sizeof err) < 0)
                    fuzz_fail("validated sampling parameters do not convert: %s", err);
            }
        }
    } else if (env->body_case == LLM__CLIENT_ENVELOPE__BODY_CANCEL && env->cancel) {
        err[0] = 0;
        if (proto_request_id_check(env->cancel->request_id, err, sizeof err) < 0 && !err[0])
            fuzz_fail("cancel refused without a message");
    }
    repack(env);
    proto_client_free(env);
    return 0;
}
