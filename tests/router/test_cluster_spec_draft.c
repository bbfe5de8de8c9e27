/* Draft-model speculation end to end (docs/router.md, "Speculation"): the
 * pycode draft beside the last stage proposes the drafts, real workers
 * verify them.  Greedy outputs equal llm-run's token for token; seeded
 * sampled outputs equal the same requests with speculation off (the draft
 * draws each guess with the target's (seed, position) draw and the last
 * stage keeps only its own samples, so equality holds by design, which is
 * stronger than equal distributions); a last stage killed mid-stream
 * resumes to the same text; a draft whose vocabulary differs is refused at
 * start naming both files.  llm_spec_model_* must show the draft model's
 * drafts accepted, and the router's KV blocks must all come back. */
#include "tests/router/cluster_harness.h"
#include "tests/router/spec_harness.h"

#include <stdio.h>

#define PYCODE "pycode/pycode-target-f16.gguf"
#define PYDRAFT "pycode/pycode-draft-f16.gguf"
#define STORIES "stories260K-f32.gguf"

static const char *const code_prompts[] = {
    "def add(a, b):\n    return a + b\n\n\ndef sub(a, b):\n    return a - b\n\n\ndef mul(a, b):\n",
    "class Point:\n    def __init__(self, x, y):\n        self.x = x\n        self.y = y\n\n"
    "    def __repr__(self):\n",
    "import os\n\n\ndef read_lines(path):\n",
};


struct spec_counts {
    double drafts, accepted, verifications, kv_used, model_drafts, model_accepted;
};

static struct spec_counts spec_metrics(struct cluster *cl, int port) {
    static char body[1 << 18];
    struct spec_counts c = {0};
    H_ASSERT(cl, h_http_get(port, "/metrics", body, sizeof body) == 200, "router /metrics on port %d", port);
    c.drafts = h_sample(body, "llm_spec_draft_tokens_total");
    c.accepted = h_sample(body, "llm_spec_accepted_tokens_total");
    c.verifications = h_sample(body, "llm_spec_verifications_total");
    c.model_drafts = h_sample(body, "llm_spec_model_draft_tokens_total");
    c.model_accepted = h_sample(body, "llm_spec_model_accepted_tokens_total");
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


static char worker_extra[400];

static const char *draft_args(void) {
    snprintf(worker_extra, sizeof worker_extra, "--draft-model %s", test_model_path(PYDRAFT));
    return worker_extra;
}

/* The draft's guesses stopped at its first under min_prob (llm-worker
 * --draft-min-prob; 0: the default, always k), its matrices converted to
 * draft_type as it loads (--draft-type; NULL: as stored). */
static const char *draft_args_min_prob(float min_prob, const char *draft_type) {
    draft_args();
    size_t n = strlen(worker_extra);
    if (min_prob > 0) snprintf(worker_extra + n, sizeof worker_extra - n, " --draft-min-prob %g", min_prob);
    n = strlen(worker_extra);
    if (draft_type) snprintf(worker_extra + n, sizeof worker_extra - n, " --draft-type %s", draft_type);
    return worker_extra;
}

/* Greedy with the draft model's drafts equals llm-run; seeded sampled
 * requests equal themselves with speculation off. */
static void draft_exact_typed(int stages, int max_tokens, float min_prob, const char *router_extra,
                              const char *draft_type) {
    static char model[512]; /* test_model_path's buffer is reused by draft_args */
    snprintf(model, sizeof model, "%s", test_model_path(PYCODE));
    char rargs[256];
    snprintf(rargs, sizeof rargs, "--spec draft --spec-tokens 4 --metrics-listen 127.0.0.1:0 %s", router_extra);
    struct cluster *cl = h_cluster_start(model, 1, stages, rargs, draft_args_min_prob(min_prob, draft_type));
    int port = h_logged_port(&cl->router);
    H_ASSERT(cl, port > 0, "the router logged no metrics port");
    /* llm status names the draft beside the last stage. */
    sg_status_draft(cl, "pycode-draft-f16.gguf");
    enum { NP = 3, NS = 4 };
    static struct sgen greedy[NP], off[NP * NS], on[NP * NS];
    static struct h_ref ref[NP];
    for (int i = 0; i < NP; i++) {
        h_reference(model, code_prompts[i], max_tokens, 0, &ref[i]);
        memset(&greedy[i], 0, sizeof greedy[i]);
        greedy[i].cl = cl;
        snprintf(greedy[i].request_id, sizeof greedy[i].request_id, "greedy-%d", i);
        greedy[i].prompt = code_prompts[i];
        greedy[i].max_tokens = max_tokens;
        for (int s = 0; s < NS; s++) {
            struct sgen *o = &off[i * NS + s];
            *o = greedy[i];
            snprintf(o->request_id, sizeof o->request_id, "off-%d-%d", i, s);
            o->spec = LLM__GENERATE_REQUEST__SPEC__SPEC_OFF;
            o->temperature = s % 2 ? 0.7f : 1.0f;
            o->seed = 500 + (uint64_t)(i * NS + s);
            on[i * NS + s] = *o;
            snprintf(on[i * NS + s].request_id, sizeof o->request_id, "on-%d-%d", i, s);
            on[i * NS + s].spec = LLM__GENERATE_REQUEST__SPEC__SPEC_DEFAULT; /* --spec draft */
        }
    }
    sg_run_all(greedy, NP);
    struct spec_counts after_greedy = spec_metrics(cl, port);
    for (int i = 0; i < NP; i++) {
        sg_ok(cl, &greedy[i]);
        H_ASSERT(cl, ref[i].n == max_tokens, "llm-run gave %d tokens", ref[i].n);
        for (int t = 0; t < max_tokens; t++)
            H_ASSERT(cl, greedy[i].ids[t] == ref[i].ids[t], "\"%.30s\": token %d is %d, llm-run has %d",
                     code_prompts[i], t, greedy[i].ids[t], ref[i].ids[t]);
        ASSERT_STREQ(ref[i].text, greedy[i].text);
    }
    sg_run_all(off, NP * NS);
    struct spec_counts before_on = spec_metrics(cl, port);
    sg_run_all(on, NP * NS);
    for (int i = 0; i < NP * NS; i++) sg_same(cl, &off[i], &on[i]);
    struct spec_counts c = spec_metrics(cl, port);
    printf("  pycode 1x%d, --draft-min-prob %g%s%s%s%s, greedy: %g model drafts, %g accepted in %g verifications (%d tokens)\n",
           stages, min_prob, router_extra[0] ? " " : "", router_extra, draft_type ? " --draft-type " : "",
           draft_type ? draft_type : "", after_greedy.model_drafts, after_greedy.model_accepted,
           after_greedy.verifications, NP * max_tokens);
    printf("  pycode 1x%d sampled: %g model drafts, %g accepted\n", stages,
           c.model_drafts - before_on.model_drafts, c.model_accepted - before_on.model_accepted);
    H_ASSERT(cl, after_greedy.model_drafts > 0 && after_greedy.model_drafts == after_greedy.drafts,
             "draft model: %g drafts of %g", after_greedy.model_drafts, after_greedy.drafts);
    H_ASSERT(cl, after_greedy.model_accepted > 0, "no draft was accepted");
    H_ASSERT(cl, c.model_accepted > after_greedy.model_accepted, "no sampled draft was accepted");
    kv_back(cl, port);
    for (int i = 0; i < NP; i++) llm_generate_result_free(&greedy[i].res);
    for (int i = 0; i < NP * NS; i++) {
        llm_generate_result_free(&off[i].res);
        llm_generate_result_free(&on[i].res);
    }
    h_cluster_stop(cl);
}

static void draft_exact(int stages, int max_tokens, float min_prob, const char *router_extra) {
    draft_exact_typed(stages, max_tokens, min_prob, router_extra, NULL);
}

TEST(cluster_spec_draft_pycode_1x1) { draft_exact(1, 64, 0, ""); }
TEST(cluster_spec_draft_pycode_1x2) { draft_exact(2, 48, 0, ""); }
/* Fewer, likelier guesses, and k set by each verdict: the same outputs. */
TEST(cluster_spec_draft_min_prob_1x1) { draft_exact(1, 48, 0.5f, ""); }
TEST(cluster_spec_draft_adapt_1x1) { draft_exact(1, 48, 0, "--spec-adapt"); }
/* The draft's F16 matrices made Q8_0 as it loads: other guesses, the same
 * outputs. */
TEST(cluster_spec_draft_q8_0_1x1) { draft_exact_typed(1, 48, 0, "", "q8_0"); }

/* The last stage of pipeline 0 dies while requests speculated by the draft
 * model stream: they resume on pipeline 1 and end with the text of a run
 * with speculation off. */
TEST(cluster_spec_draft_worker_killed) {
    static char model[512];
    snprintf(model, sizeof model, "%s", test_model_path(PYCODE));
    sg_worker_killed(model, "--spec draft", draft_args(), code_prompts, 3, 4, 91,
                     LLM__GENERATE_REQUEST__SPEC__SPEC_DRAFT);
}

/* stories260K as a "draft" of pycode: 512 tokens against 4096.  The
 * worker stops at start with both files and both sizes named. */
TEST(cluster_spec_draft_vocab_refused) {
    char model[512], bad[512]; /* test_model_path's buffer is its own */
    snprintf(model, sizeof model, "%s", test_model_path(PYCODE));
    snprintf(bad, sizeof bad, "%s", test_model_path(STORIES));
    if (access(model, R_OK) != 0 || access(bad, R_OK) != 0) TEST_SKIP("%s or %s is missing", model, bad);
    char cmd[2048];
    snprintf(cmd, sizeof cmd, "timeout 60 %s --model %s --draft-model %s --router tcp://127.0.0.1:9 "
             "--insecure --device cpu --threads 1 2>&1", H_WORKER, model, bad);
    FILE *f = popen(cmd, "r");
    ASSERT_TRUE(f != NULL);
    static char out[16384];
    size_t len = fread(out, 1, sizeof out - 1, f);
    out[len] = 0;
    int st = pclose(f);
    printf("  llm-worker: exit %d: %s\n", WIFEXITED(st) ? WEXITSTATUS(st) : -1, len > 400 ? out + len - 400 : out);
    ASSERT_TRUE(WIFEXITED(st) && WEXITSTATUS(st) != 0 && WEXITSTATUS(st) != 124);
    char want[1200];
    snprintf(want, sizeof want, "draft %s has a vocabulary of 512 tokens (512 logits), the target %s "
             "one of 4096 (4096 logits)", bad, model);
    if (!strstr(out, want)) printf("  output:\n%s\n", out);
    ASSERT_TRUE(strstr(out, want) != NULL);
}

TEST_MAIN(cluster_spec_draft_pycode_1x1, cluster_spec_draft_pycode_1x2, cluster_spec_draft_min_prob_1x1,
          cluster_spec_draft_adapt_1x1, cluster_spec_draft_q8_0_1x1, cluster_spec_draft_worker_killed,
          cluster_spec_draft_vocab_refused)
