/* Predicted outputs end to end (docs/router.md, "Predicted outputs"): a
 * request's GenerateRequest.prediction is drafted from by the router's
 * prompt lookup on a real 1x1 cluster whose --spec is off.  With the
 * right prediction (the greedy output itself) the output is the same and
 * nearly every draft is accepted (llm_spec_* metrics); a wrong prediction
 * gives the same output too; a request that says spec off gets no drafts;
 * a seeded sampled request equals itself without a prediction.  The same
 * prediction as token ids has every draft accepted.  On
 * pycode (byte-level BPE) and stories260K (SentencePiece, whose space
 * prefix the prediction's leading space stands for).  KV blocks all come
 * back. */
#include "tests/router/cluster_harness.h"
#include "tests/router/spec_harness.h"

#define STORIES "stories260K-f32.gguf"
#define PYCODE "pycode/pycode-target-f16.gguf"

struct counts {
    double drafts, accepted, verifications, model_drafts, kv_used;
};

static struct counts counts_get(struct cluster *cl, int port) {
    static char body[1 << 18];
    struct counts c = {0};
    H_ASSERT(cl, h_http_get(port, "/metrics", body, sizeof body) == 200, "router /metrics on port %d", port);
    c.drafts = h_sample(body, "llm_spec_draft_tokens_total");
    c.accepted = h_sample(body, "llm_spec_accepted_tokens_total");
    c.verifications = h_sample(body, "llm_spec_verifications_total");
    c.model_drafts = h_sample(body, "llm_spec_model_draft_tokens_total");
    c.kv_used = h_sample(body, "llm_kv_blocks_used");
    return c;
}

static void one(struct sgen *g, struct cluster *cl, const char *id, const char *prompt, int max_tokens, int spec,
                const char *prediction) {
    memset(g, 0, sizeof *g);
    g->cl = cl;
    snprintf(g->request_id, sizeof g->request_id, "%s", id);
    g->prompt = prompt;
    g->max_tokens = max_tokens;
    g->spec = spec;
    g->prediction = prediction;
    sg_run(g);
}

static void pred_exact(const char *model_name, const char *prompt, const char *wrong, int max_tokens) {
    const char *model = test_model_path(model_name);
    struct cluster *cl = h_cluster_start(model, 1, 1, "--spec off --spec-tokens 4 --metrics-listen 127.0.0.1:0", "");
    int port = h_logged_port(&cl->router);
    H_ASSERT(cl, port > 0, "the router logged no metrics port");
    static struct sgen base, right, ids, bad, off, s_base, s_pred;
    one(&base, cl, "base", prompt, max_tokens, LLM__GENERATE_REQUEST__SPEC__SPEC_DEFAULT, NULL);
    sg_ok(cl, &base);
    struct counts c0 = counts_get(cl, port);
    H_ASSERT(cl, c0.drafts == 0, "--spec off drafted %g tokens without a prediction", c0.drafts);

    /* The right prediction: the output itself. */
    one(&right, cl, "right", prompt, max_tokens, LLM__GENERATE_REQUEST__SPEC__SPEC_DEFAULT, base.text);
    sg_same(cl, &base, &right);
    struct counts c1 = counts_get(cl, port);
    double d = c1.drafts - c0.drafts, a = c1.accepted - c0.accepted, v = c1.verifications - c0.verifications;
    printf("  %s right prediction: %g drafts, %g accepted in %g verifications (%d tokens)\n", model_name, d, a,
           v, max_tokens);
    H_ASSERT(cl, d >= max_tokens / 2, "only %g tokens drafted from a right prediction of %d", d, max_tokens);
    H_ASSERT(cl, a >= 0.85 * d, "%g of %g drafts of a right prediction accepted", a, d);
    H_ASSERT(cl, v <= max_tokens / 3, "%g verifying steps for %d tokens at k = 4", v, max_tokens);
    H_ASSERT(cl, c1.model_drafts == c0.model_drafts, "a prediction's drafts counted as the draft model's");

    /* The right prediction as token ids: every draft accepted, none lost
     * to a tokenization of the text that differs from the model's ids. */
    memset(&ids, 0, sizeof ids);
    ids.cl = cl;
    snprintf(ids.request_id, sizeof ids.request_id, "ids");
    ids.prompt = prompt;
    ids.max_tokens = max_tokens;
    ids.prediction_tokens = base.ids;
    ids.n_prediction_tokens = base.n;
    sg_run(&ids);
    sg_same(cl, &base, &ids);
    struct counts c1i = counts_get(cl, port);
    d = c1i.drafts - c1.drafts;
    a = c1i.accepted - c1.accepted;
    printf("  %s right prediction as ids: %g drafts, %g accepted in %g verifications\n", model_name, d, a,
           c1i.verifications - c1.verifications);
    H_ASSERT(cl, d >= max_tokens / 2 && a == d, "%g of %g drafts of the right prediction's ids accepted", a, d);
    c1 = c1i;

    /* A wrong prediction: the same output. */
    one(&bad, cl, "wrong", prompt, max_tokens, LLM__GENERATE_REQUEST__SPEC__SPEC_DEFAULT, wrong);
    sg_same(cl, &base, &bad);
    struct counts c2 = counts_get(cl, port);
    printf("  %s wrong prediction: %g drafts, %g accepted\n", model_name, c2.drafts - c1.drafts,
           c2.accepted - c1.accepted);

    /* Speculation off for the request: the prediction is not used. */
    one(&off, cl, "off", prompt, max_tokens, LLM__GENERATE_REQUEST__SPEC__SPEC_OFF, base.text);
    sg_same(cl, &base, &off);
    struct counts c3 = counts_get(cl, port);
    H_ASSERT(cl, c3.drafts == c2.drafts, "spec off with a prediction drafted %g tokens", c3.drafts - c2.drafts);

    /* Seeded sampling: the same stream with and without a prediction. */
    s_base = base;
    memset(&s_base, 0, sizeof s_base);
    s_base.cl = cl;
    snprintf(s_base.request_id, sizeof s_base.request_id, "sampled-base");
    s_base.prompt = prompt;
    s_base.max_tokens = max_tokens;
    s_base.temperature = 0.8f;
    s_base.seed = 4242;
    sg_run(&s_base);
    s_pred = s_base;
    memset(&s_pred.res, 0, sizeof s_pred.res);
    snprintf(s_pred.request_id, sizeof s_pred.request_id, "sampled-pred");
    s_pred.prediction = s_base.text;
    sg_run(&s_pred);
    sg_same(cl, &s_base, &s_pred);

    int64_t end = h_now_ms() + 5000;
    struct counts c = counts_get(cl, port);
    while (c.kv_used != 0 && h_now_ms() < end) {
        h_sleep_ms(50);
        c = counts_get(cl, port);
    }
    H_ASSERT(cl, c.kv_used == 0, "llm_kv_blocks_used is %g with nothing running", c.kv_used);
    llm_generate_result_free(&base.res);
    llm_generate_result_free(&right.res);
    llm_generate_result_free(&ids.res);
    llm_generate_result_free(&bad.res);
    llm_generate_result_free(&off.res);
    llm_generate_result_free(&s_base.res);
    llm_generate_result_free(&s_pred.res);
    h_cluster_stop(cl);
}

TEST(cluster_spec_prediction_pycode) {
    pred_exact(PYCODE,
               "import os\n\n\ndef read_lines(path):\n    with open(path) as f:\n        return f.readlines()\n\n\n"
               "def write_lines(path, lines):\n",
               "    for line in reversed(lines):\n        print(line)\n    return None\n", 64);
}

TEST(cluster_spec_prediction_stories) {
    pred_exact(STORIES, "Once upon a time", " there was a big red car that liked to drive fast.", 48);
}

TEST_MAIN(cluster_spec_prediction_pycode, cluster_spec_prediction_stories)
