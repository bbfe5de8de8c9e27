/* Predicted outputs end to end (docs/router.md, "Predicted outputs"): a
 * request's GenerateRequest.prediction is drafted from by the router's
 * prompt lookup on a real 1x1 cluster whose --spec is off.  With the
 * right prediction (the greedy output itself) the output is the same and
 * nearly every draft is accepted (llm_spec_* metrics); a wrong prediction
 * gives the same output too; a request that says spec off gets no drafts;
 * a seeded sampled request equals itself without a prediction.  The same
 * prediction as token ids has every draft accepted.  On
 * pycode (byte-level BPE) and stories260K (SentencePiece, whose space
 * prefix the prediction's leading space stands for).  Each request's
 * GenerateDone.Usage counts the prediction's drafts accepted and rejected
 * (OpenAI's accepted/rejected_prediction_tokens): within the router's
 * llm_spec_* deltas of that request, equal to them for the ids, and as
 * llm generate --json prints them.  KV blocks all come back. */
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

/* The request's usage of its prediction against the router's llm_spec_*
 * deltas over it (the request ran alone): its accepted drafts are among
 * those the router accepted, and its drafts among those it verified
 * (equal when every draft came from the prediction, not from the
 * sequence's own lookup where the prediction has no match). */
static void pred_usage_within(struct cluster *cl, const struct sgen *g, struct counts before, struct counts after,
                              bool exact) {
    double d = after.drafts - before.drafts, a = after.accepted - before.accepted;
    double pa = g->res.accepted_prediction_tokens, pr = g->res.rejected_prediction_tokens;
    printf("  %s: usage accepted_prediction_tokens %g, rejected_prediction_tokens %g; llm_spec_* %g drafts, "
           "%g accepted\n", g->request_id, pa, pr, d, a);
    H_ASSERT(cl, pa <= a && pa + pr <= d && pr <= d - a,
             "request %s: usage says %g accepted and %g rejected prediction tokens, the router's metrics %g "
             "accepted of %g drafts", g->request_id, pa, pr, a, d);
    if (exact)
        H_ASSERT(cl, pa == a && pa + pr == d,
                 "request %s: usage says %g accepted and %g rejected prediction tokens, the router's metrics %g "
                 "accepted of %g drafts", g->request_id, pa, pr, a, d);
}

/* llm generate --prediction-ids FILE --json on the cluster: its ids and
 * its accepted/rejected_prediction_tokens, which must equal want's. */
static void pred_cli(struct cluster *cl, const struct sgen *want) {
    char ids_path[400], cmd[1400];
    snprintf(ids_path, sizeof ids_path, "%s/pred-ids.json", cl->dir);
    FILE *f = fopen(ids_path, "w");
    H_ASSERT(cl, f != NULL, "%s: %s", ids_path, strerror(errno));
    for (int i = 0; i < want->n; i++) fprintf(f, "%s%d", i ? "," : "[", want->ids[i]);
    fprintf(f, "]\n");
    fclose(f);
    snprintf(cmd, sizeof cmd,
             "'%s' generate --router '%s' --prompt '%s' --max-tokens %d --no-stop-at-eos --temperature 0 "
             "--prediction-ids '%s' --json 2>&1",
             LLM_BINARY_DIR "/clients/c/llm", cl->client_ep, want->prompt, want->max_tokens, ids_path);
    FILE *p = popen(cmd, "r");
    H_ASSERT(cl, p != NULL, "popen %s", cmd);
    static char out[1 << 16];
    size_t n = fread(out, 1, sizeof out - 1, p);
    out[n] = 0;
    int st = pclose(p);
    const char *js = strstr(out, "{\"prompt_ids\"");
    cJSON *j = cJSON_Parse(js ? js : "");
    const cJSON *acc = cJSON_GetObjectItemCaseSensitive(j, "accepted_prediction_tokens");
    const cJSON *rej = cJSON_GetObjectItemCaseSensitive(j, "rejected_prediction_tokens");
    const cJSON *ids = cJSON_GetObjectItemCaseSensitive(j, "ids");
    if (st != 0 || !cJSON_IsNumber(acc) || !cJSON_IsNumber(rej)) printf("  %s\n%s", cmd, out);
    H_ASSERT(cl, st == 0, "llm generate --json with --prediction-ids: status 0x%x", st);
    H_ASSERT(cl, cJSON_IsNumber(acc) && cJSON_IsNumber(rej), "llm generate --json has no prediction usage");
    H_ASSERT(cl, cJSON_GetArraySize(ids) == want->n, "llm generate gave %d ids, %d wanted", cJSON_GetArraySize(ids),
             want->n);
    for (int i = 0; i < want->n && i < 512; i++)
        H_ASSERT(cl, cJSON_GetArrayItem(ids, i)->valueint == want->ids[i], "llm generate: token %d is %d, not %d", i,
                 cJSON_GetArrayItem(ids, i)->valueint, want->ids[i]);
    printf("  llm generate --json: accepted_prediction_tokens %d, rejected_prediction_tokens %d\n", acc->valueint,
           rej->valueint);
    H_ASSERT(cl, (uint32_t)acc->valueint == want->res.accepted_prediction_tokens &&
                     (uint32_t)rej->valueint == want->res.rejected_prediction_tokens,
             "llm generate --json: %d accepted, %d rejected; libllmclient's request %u, %u", acc->valueint,
             rej->valueint, want->res.accepted_prediction_tokens, want->res.rejected_prediction_tokens);
    cJSON_Delete(j);
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
    sg_status_draft(cl, NULL); /* llm status: no draft model here */
    static struct sgen base, right, ids, bad, off, s_base, s_pred;
    one(&base, cl, "base", prompt, max_tokens, LLM__GENERATE_REQUEST__SPEC__SPEC_DEFAULT, NULL);
    sg_ok(cl, &base);
    struct counts c0 = counts_get(cl, port);
    H_ASSERT(cl, c0.drafts == 0, "--spec off drafted %g tokens without a prediction", c0.drafts);
    H_ASSERT(cl, base.res.accepted_prediction_tokens == 0 && base.res.rejected_prediction_tokens == 0,
             "no prediction, yet usage says %u accepted and %u rejected prediction tokens",
             base.res.accepted_prediction_tokens, base.res.rejected_prediction_tokens);

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
    pred_usage_within(cl, &right, c0, c1, false);
    H_ASSERT(cl, right.res.accepted_prediction_tokens >= (uint32_t)max_tokens / 2,
             "a right prediction of %d tokens: only %u of its tokens accepted", max_tokens,
             right.res.accepted_prediction_tokens);
    H_ASSERT(cl, right.res.rejected_prediction_tokens * 6 <= right.res.accepted_prediction_tokens,
             "a right prediction: %u of its tokens rejected, %u accepted", right.res.rejected_prediction_tokens,
             right.res.accepted_prediction_tokens);

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
    pred_usage_within(cl, &ids, c1, c1i, true);
    H_ASSERT(cl, ids.res.rejected_prediction_tokens == 0, "the right ids: %u rejected",
             ids.res.rejected_prediction_tokens);
    c1 = c1i;
    /* The same through llm generate --json (stories: a prompt the shell
     * takes as it is). */
    if (strchr(prompt, '\n') == NULL) {
        pred_cli(cl, &ids);
        c1 = counts_get(cl, port);
    }

    /* A wrong prediction: the same output. */
    one(&bad, cl, "wrong", prompt, max_tokens, LLM__GENERATE_REQUEST__SPEC__SPEC_DEFAULT, wrong);
    sg_same(cl, &base, &bad);
    struct counts c2 = counts_get(cl, port);
    printf("  %s wrong prediction: %g drafts, %g accepted\n", model_name, c2.drafts - c1.drafts,
           c2.accepted - c1.accepted);
    pred_usage_within(cl, &bad, c1, c2, false);
    H_ASSERT(cl, bad.res.rejected_prediction_tokens > 0, "a wrong prediction: none of its tokens rejected (%u accepted)",
             bad.res.accepted_prediction_tokens);

    /* Speculation off for the request: the prediction is not used. */
    one(&off, cl, "off", prompt, max_tokens, LLM__GENERATE_REQUEST__SPEC__SPEC_OFF, base.text);
    sg_same(cl, &base, &off);
    struct counts c3 = counts_get(cl, port);
    H_ASSERT(cl, c3.drafts == c2.drafts, "spec off with a prediction drafted %g tokens", c3.drafts - c2.drafts);
    H_ASSERT(cl, off.res.accepted_prediction_tokens == 0 && off.res.rejected_prediction_tokens == 0,
             "spec off: usage says %u accepted and %u rejected prediction tokens", off.res.accepted_prediction_tokens,
             off.res.rejected_prediction_tokens);

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
    struct counts c4 = counts_get(cl, port);
    sg_run(&s_pred);
    sg_same(cl, &s_base, &s_pred);
    pred_usage_within(cl, &s_pred, c4, counts_get(cl, port), false);
    H_ASSERT(cl, s_pred.res.accepted_prediction_tokens > 0, "a seeded request's own text as its prediction: "
             "none of it accepted (%u rejected)", s_pred.res.rejected_prediction_tokens);

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
