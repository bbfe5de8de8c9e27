/* A WorkerEnvelope as either side receives it: proto_worker_unpack (the
 * router decoding Register, Heartbeat and StepResult; the worker decoding
 * RegisterReply and StepPlan), then what the worker does with each sequence
 * of a StepPlan that the last stage samples for: convert and validate its
 * SamplingParams and, when they pass, sample with them (the sampler trusts
 * validated parameters, so a gap in the validation shows up here).  An
 * accepted envelope must pack again to bytes that round-trip. */
#include <stdlib.h>
#include <string.h>

#include "common/sampling.h"
#include "proto/request.h"
#include "proto/wire.h"
#include "tests/fuzz/fuzz_util.h"

#define FUZZ_VOCAB 64

static void repack(Llm__WorkerEnvelope *env) {
    uint8_t *a = NULL, *b = NULL;
    size_t na = 0, nb = 0;
    char err[512];
    if (proto_worker_pack(env, &a, &na, err, sizeof err) < 0)
        fuzz_fail("an accepted worker envelope does not pack: %s", err);
    Llm__WorkerEnvelope *again;
    if (proto_worker_unpack(a, na, &again, err, sizeof err) < 0)
        fuzz_fail("a packed worker envelope does not unpack: %s", err);
    if (again->body_case != env->body_case)
        fuzz_fail("body %u came back as %u", env->body_case, again->body_case);
    if (proto_worker_pack(again, &b, &nb, err, sizeof err) < 0)
        fuzz_fail("a repacked worker envelope does not pack: %s", err);
    if (na != nb || memcmp(a, b, na) != 0) fuzz_fail("worker envelope packs to %zu then %zu bytes", na, nb);
    proto_worker_free(again);
    free(a);
    free(b);
}

static void sample_seq(sampler *s, const Llm__SeqPlan *sp) {
    struct sampling_params p;
    char err[512] = "";
    if (proto_sampling_from_msg(sp->sampling, &p, err, sizeof err) < 0) {
        if (!err[0]) fuzz_fail("sampling parameters refused without a message");
        return;
    }
    if (sampling_params_validate(&p, FUZZ_VOCAB, err, sizeof err) < 0) {
        if (!err[0]) fuzz_fail("sampling parameters invalid without a message");
        return;
    }
    /* Logits from the plan's tokens, so that the fuzzer steers them too:
     * finite values, ties and large spreads. */
    float logits[FUZZ_VOCAB];
    for (int i = 0; i < FUZZ_VOCAB; i++) {
        int32_t t = sp->n_tokens ? sp->tokens[(size_t)i % sp->n_tokens] : i;
        logits[i] = (float)(t % 4096) / 16.0f;
    }
    /* The history: penalty context then the step's tokens, as the last stage
     * keeps it. */
    size_t nh = sp->n_penalty_context + sp->n_tokens;
    int32_t *hist = malloc((nh ? nh : 1) * sizeof *hist);
    if (!hist) return;
    if (sp->n_penalty_context) memcpy(hist, sp->penalty_context, sp->n_penalty_context * sizeof *hist);
    if (sp->n_tokens) memcpy(hist + sp->n_penalty_context, sp->tokens, sp->n_tokens * sizeof *hist);
    struct sampling_result r;
    int rc = sampler_sample(s, logits, &p, hist, (int32_t)(nh > INT32_MAX ? INT32_MAX : nh),
                            (int64_t)sp->start_pos + (int64_t)sp->n_tokens, &r);
    if (rc == 0) {
        if (r.token < 0 || r.token >= FUZZ_VOCAB) fuzz_fail("sampled token %d outside [0, %d)", r.token, FUZZ_VOCAB);
        if (r.n_top < 0 || r.n_top > SAMPLING_TOP_LOGPROBS_MAX) fuzz_fail("n_top %d", r.n_top);
        if ((p.logprobs || p.top_logprobs > 0) && !(r.logprob <= 0)) fuzz_fail("logprob %g", r.logprob);
    } else if (r.token != -1) {
        fuzz_fail("failed sample (%d: %s) returned token %d", rc, sampler_errstr(s), r.token);
    }
    free(hist);
}

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size) {
    static sampler *s;
    char err[512] = "";
    if (!s && sampler_init(&s, FUZZ_VOCAB, err, sizeof err) < 0) fuzz_fail("sampler_init: %s", err);
    Llm__WorkerEnvelope *env = NULL;
    int rc = proto_worker_unpack(data, size, &env, err, sizeof err);
    if (rc < 0) {
        if (env || !err[0]) fuzz_fail("refused worker frame: env %p, message \"%s\"", (void *)env, err);
        return 0;
    }
    if (env->body_case == LLM__WORKER_ENVELOPE__BODY__NOT_SET || env->version < PROTO_VERSION_MIN ||
        env->version > PROTO_VERSION)
        fuzz_fail("accepted worker frame: body %u, version %u", env->body_case, env->version);
    if (env->body_case == LLM__WORKER_ENVELOPE__BODY_PLAN && env->plan) {
        const Llm__StepPlan *p = env->plan;
        /* The worker bounds the work per step before it looks at sequences;
         * the same bound keeps one input from running for long here. */
        for (size_t i = 0; i < p->n_seqs && i < 64; i++)
            if (p->seqs[i] && p->seqs[i]->want_logits) sample_seq(s, p->seqs[i]);
    }
    repack(env);
    proto_worker_free(env);
    return 0;
}
