/* Speculative decoding end to end (docs/router.md, "Speculation"): prompt
 * lookup drafts in the router, verified by real workers.  The outputs must
 * be those of plain decoding, token for token: greedy against llm-run on
 * stories260K and the pycode target (whose output repeats code, so drafts
 * are accepted often), seeded sampling against the same request with
 * speculation off, on 1x1 and 1x2 pipelines, and with a last stage killed
 * mid-stream (the request resumes on the other pipeline to the same text).
 * The router's llm_spec_* metrics must show drafts proposed and accepted,
 * and its KV blocks must all come back. */
#include "tests/router/cluster_harness.h"
#include "tests/router/spec_harness.h"

#define STORIES "stories260K-f32.gguf"
#define PYCODE "pycode/pycode-target-f16.gguf"

static const char *const story_prompts[] = {"Once upon a time", "The little dog", "Lily and Tom"};

static const char *const code_prompts[] = {
    "def add(a, b):\n    return a + b\n\n\ndef sub(a, b):\n    return a - b\n\n\ndef mul(a, b):\n",
    "class Point:\n    def __init__(self, x, y):\n        self.x = x\n        self.y = y\n\n"
    "    def __repr__(self):\n",
};


struct spec_counts {
    double drafts, accepted, verifications, kv_used;
};

static struct spec_counts spec_metrics(struct cluster *cl, int port) {
    static char body[1 << 18];
    struct spec_counts c = {0};
    H_ASSERT(cl, h_http_get(port, "/metrics", body, sizeof body) == 200, "router /metrics on port %d", port);
    c.drafts = h_sample(body, "llm_spec_draft_tokens_total");
    c.accepted = h_sample(body, "llm_spec_accepted_tokens_total");
    c.verifications = h_sample(body, "llm_spec_verifications_total");
    c.kv_used = h_sample(body, "llm_kv_blocks_used");
    return c;
}

/* The router's KV blocks all come back once nothing runs (the tick
 * updates the gauge every 50 ms). */
static void kv_back(struct cluster *cl, int port) {
    int64_t end = h_now_ms() + 5000;
    struct spec_counts c = spec_metrics(cl, port);
    while (c.kv_used != 0 && h_now_ms() < end) {
        h_sleep_ms(50);
        c = spec_metrics(cl, port);
    }
    H_ASSERT(cl, c.kv_used == 0, "llm_kv_blocks_used is %g with nothing running", c.kv_used);
}

/* Greedy with drafts (the router's --spec ngram) equals llm-run, and a
 * seeded sampled request equals itself with speculation off. */
static void spec_exact(const char *model_name, const char *const *prompts, int n_prompts, int stages,
                       int max_tokens, bool want_accepts, const char *router_extra) {
    const char *model = test_model_path(model_name);
    char rargs[256];
    snprintf(rargs, sizeof rargs, "--spec ngram --spec-tokens 4 --metrics-listen 127.0.0.1:0 %s", router_extra);
    struct cluster *cl = h_cluster_start(model, 1, stages, rargs, "");
    int port = h_logged_port(&cl->router);
    H_ASSERT(cl, port > 0, "the router logged no metrics port");
    enum { MAXP = 4 };
    static struct sgen greedy[MAXP], off[MAXP], on[MAXP];
    static struct h_ref ref[MAXP];
    for (int i = 0; i < n_prompts; i++) {
        h_reference(model, prompts[i], max_tokens, 0, &ref[i]);
        memset(&greedy[i], 0, sizeof greedy[i]);
        greedy[i].cl = cl;
        snprintf(greedy[i].request_id, sizeof greedy[i].request_id, "greedy-%d", i);
        greedy[i].prompt = prompts[i];
        greedy[i].max_tokens = max_tokens;
        off[i] = greedy[i];
        snprintf(off[i].request_id, sizeof off[i].request_id, "off-%d", i);
        off[i].spec = LLM__GENERATE_REQUEST__SPEC__SPEC_OFF;
        off[i].temperature = 0.9f;
        off[i].seed = 1000 + (uint64_t)i;
        on[i] = off[i];
        snprintf(on[i].request_id, sizeof on[i].request_id, "on-%d", i);
        on[i].spec = LLM__GENERATE_REQUEST__SPEC__SPEC_DEFAULT; /* --spec ngram */
    }
    sg_run_all(greedy, n_prompts);
    struct spec_counts after_greedy = spec_metrics(cl, port);
    for (int i = 0; i < n_prompts; i++) {
        sg_ok(cl, &greedy[i]);
        H_ASSERT(cl, ref[i].n == max_tokens, "llm-run gave %d tokens", ref[i].n);
        for (int t = 0; t < max_tokens; t++)
            H_ASSERT(cl, greedy[i].ids[t] == ref[i].ids[t], "\"%.30s\": token %d is %d, llm-run has %d",
                     prompts[i], t, greedy[i].ids[t], ref[i].ids[t]);
        ASSERT_STREQ(ref[i].text, greedy[i].text);
    }
    sg_run_all(off, n_prompts);
    sg_run_all(on, n_prompts);
    for (int i = 0; i < n_prompts; i++) sg_same(cl, &off[i], &on[i]);
    struct spec_counts c = spec_metrics(cl, port);
    printf("  %s 1x%d%s%s: greedy %g drafts, %g accepted in %g verifications; all %g drafts, %g accepted\n",
           model_name, stages, router_extra[0] ? " " : "", router_extra, after_greedy.drafts, after_greedy.accepted, after_greedy.verifications,
           c.drafts, c.accepted);
    H_ASSERT(cl, after_greedy.drafts > 0 && after_greedy.verifications > 0, "no drafts were verified");
    if (want_accepts) H_ASSERT(cl, after_greedy.accepted > 0, "no draft was accepted");
    kv_back(cl, port);
    for (int i = 0; i < n_prompts; i++) {
        llm_generate_result_free(&greedy[i].res);
        llm_generate_result_free(&off[i].res);
        llm_generate_result_free(&on[i].res);
    }
    h_cluster_stop(cl);
}

TEST(cluster_spec_stories_1x1) { spec_exact(STORIES, story_prompts, 3, 1, 48, false, ""); }
TEST(cluster_spec_stories_1x2) { spec_exact(STORIES, story_prompts, 3, 2, 48, false, ""); }
TEST(cluster_spec_pycode_1x1) { spec_exact(PYCODE, code_prompts, 2, 1, 64, true, ""); }
/* k set by each verdict (--spec-adapt): the same outputs. */
TEST(cluster_spec_pycode_adapt_1x1) { spec_exact(PYCODE, code_prompts, 2, 1, 64, true, "--spec-adapt"); }

/* The last stage of pipeline 0 dies while speculated sampled requests
 * stream: they resume on pipeline 1 (prefilled again with the tokens they
 * had) and end with the text of a run with speculation off. */
TEST(cluster_spec_worker_killed) {
    sg_worker_killed(test_model_path(STORIES), "--spec ngram", "", story_prompts, 3, 6, 77,
                     LLM__GENERATE_REQUEST__SPEC__SPEC_NGRAM);
}

TEST_MAIN(cluster_spec_stories_1x1, cluster_spec_stories_1x2, cluster_spec_pycode_1x1, cluster_spec_pycode_adapt_1x1, cluster_spec_worker_killed)
