/* The router's batching policies on a real cluster.  --batch-wait-us: a
 * pipeline with nothing running holds its first step until the wait
 * passes with no new prompt, so that prompts arriving apart start in one
 * step (the router counts its steps), and plans at once when the prompts
 * fill its batch.  --prefill-hold-tokens: a prompt that arrives while
 * another sequence decodes waits for more prompts, until nothing decodes
 * or --prefill-hold-ms passes.  Outputs stay llm-run's. */
#include "tests/router/cluster_harness.h"

#define MODEL "stories260K-f32.gguf"
#define MAX_TOKENS 8
#define WAIT_US 1000000
#define LATE_MS 200
#define HOLD_A_TOKENS 100

static const char *const prompts[2] = {"Once upon a time", "The little dog"};

static uint64_t router_steps(struct cluster *cl) {
    llm_client *c = h_client(cl, 2000, 5000, 5000);
    Llm__ClientEnvelope *env;
    H_ASSERT(cl, llm_client_status(c, &env) == 0, "no Status reply");
    uint64_t steps = env->status_reply->steps_total;
    proto_client_free(env);
    llm_client_close(c);
    return steps;
}

/* Sends prompts[0] and, LATE_MS later, prompts[1]; returns the first
 * request's time to its first token, in ms. */
static int64_t run_pair(struct cluster *cl, struct h_gen *g, const char *tag) {
    memset(g, 0, 2 * sizeof *g);
    for (int i = 0; i < 2; i++) {
        g[i].cl = cl;
        g[i].prompt = prompts[i];
        g[i].max_tokens = MAX_TOKENS;
        g[i].ignore_eos = 1;
        snprintf(g[i].request_id, sizeof g[i].request_id, "%s-%d", tag, i);
    }
    struct h_batch first, second;
    int64_t t0 = h_now_ms();
    h_batch_start(&first, &g[0], 1);
    h_sleep_ms(LATE_MS);
    h_batch_start(&second, &g[1], 1);
    h_batch_join(&first);
    h_batch_join(&second);
    return g[0].first_token_ms - t0;
}

/* A 1x1 cluster with the router's args runs the pair (checked against
 * llm-run); its steps and the first request's time to first token. */
static struct cluster *run_case(const char *router_args, const char *tag, uint64_t *steps, int64_t *ttft) {
    const char *model = test_model_path(MODEL);
    static struct h_ref ref[2];
    for (int i = 0; i < 2; i++) h_reference(model, prompts[i], MAX_TOKENS, 0, &ref[i]);
    struct cluster *cl = h_cluster_start(model, 1, 1, router_args, "");
    struct h_gen g[2];
    *ttft = run_pair(cl, g, tag);
    for (int i = 0; i < 2; i++) {
        h_check(cl, &g[i], &ref[i]);
        llm_generate_result_free(&g[i].res);
    }
    *steps = router_steps(cl);
    return cl;
}

TEST(cluster_batch_wait_one_step) {
    char args[128];
    snprintf(args, sizeof args, "--batch-wait-us %d --metrics-listen 127.0.0.1:0", WAIT_US);
    uint64_t steps;
    int64_t ttft;
    struct cluster *cl = run_case(args, "wait", &steps, &ttft);
    /* Both prompts in the first step, then a decode step per further token:
     * without the wait the first runs alone and the second starts later. */
    printf("  two prompts %d ms apart: %llu steps for %d tokens each, first token of the first after %lld ms\n",
           LATE_MS, (unsigned long long)steps, MAX_TOKENS, (long long)ttft);
    H_ASSERT(cl, steps == MAX_TOKENS, "%llu steps, expected %d (both prompts in the first)",
             (unsigned long long)steps, MAX_TOKENS);
    /* The wait starts over at the second prompt. */
    H_ASSERT(cl, ttft >= LATE_MS + WAIT_US / 1000 - 50,
             "the first token came %lld ms after the request, within the wait that the second prompt started",
             (long long)ttft);
    /* One held step, of about that long, in the router's histogram. */
    int port = h_logged_port(&cl->router);
    H_ASSERT(cl, port > 0, "the router logged no metrics port");
    static char body[1 << 20];
    H_ASSERT(cl, h_http_get(port, "/metrics", body, sizeof body) == 200, "no /metrics");
    double n = h_sample(body, "llm_router_batch_wait_seconds_count");
    double sum = h_sample(body, "llm_router_batch_wait_seconds_sum");
    H_ASSERT(cl, n == 1 && sum >= (LATE_MS + WAIT_US / 1000 - 50) / 1000.0 && sum < 8.0 * WAIT_US / 1e6,
             "llm_router_batch_wait_seconds: count %g, sum %g s", n, sum);
    h_cluster_stop(cl);
}

/* A batch that is full ends the wait: with --max-batch 2 the second prompt
 * starts the step. */
TEST(cluster_batch_wait_full_batch_plans) {
    char args[128];
    snprintf(args, sizeof args, "--batch-wait-us %d --max-batch 2", WAIT_US);
    uint64_t steps;
    int64_t ttft;
    struct cluster *cl = run_case(args, "full", &steps, &ttft);
    printf("  --max-batch 2: %llu steps, first token of the first after %lld ms\n", (unsigned long long)steps,
           (long long)ttft);
    H_ASSERT(cl, steps == MAX_TOKENS, "%llu steps, expected %d", (unsigned long long)steps, MAX_TOKENS);
    H_ASSERT(cl, ttft >= LATE_MS && ttft < WAIT_US / 1000 - 100,
             "the first token came %lld ms after the request: expected when the second prompt filled the batch "
             "(%d ms), well before the wait's end", (long long)ttft, LATE_MS);
    h_cluster_stop(cl);
}

/* B arrives while A decodes; with a hold of more tokens than B brings it
 * starts only once A has ended (nothing decodes), and with the hold's
 * longest wait at 1 ms while A still decodes.  Returns B's first token
 * minus A's last, in ms. */
static int64_t hold_case(const char *router_args, const char *tag) {
    const char *model = test_model_path(MODEL);
    static struct h_ref ref[2];
    h_reference(model, prompts[0], HOLD_A_TOKENS, 0, &ref[0]);
    h_reference(model, prompts[1], MAX_TOKENS, 0, &ref[1]);
    /* Two stages: each of A's steps takes two hops, which leaves B time. */
    struct cluster *cl = h_cluster_start(model, 1, 2, router_args, "");
    struct h_gen g[2];
    memset(g, 0, sizeof g);
    for (int i = 0; i < 2; i++) {
        g[i].cl = cl;
        g[i].prompt = prompts[i];
        g[i].max_tokens = i == 0 ? HOLD_A_TOKENS : MAX_TOKENS;
        g[i].ignore_eos = 1;
        snprintf(g[i].request_id, sizeof g[i].request_id, "%s-%d", tag, i);
    }
    struct h_batch a, b;
    h_batch_start(&a, &g[0], 1);
    int64_t end = h_now_ms() + 30000;
    while (!__atomic_load_n(&g[0].first_token_ms, __ATOMIC_ACQUIRE) && h_now_ms() < end) h_sleep_ms(1);
    h_batch_start(&b, &g[1], 1);
    h_batch_join(&a);
    h_batch_join(&b);
    for (int i = 0; i < 2; i++) {
        h_check(cl, &g[i], &ref[i]);
        llm_generate_result_free(&g[i].res);
    }
    int64_t d = g[1].first_token_ms - g[0].last_token_ms;
    printf("  %s: B's first token %lld ms after A's last\n", router_args, (long long)d);
    h_cluster_stop(cl);
    return d;
}

TEST(cluster_prefill_hold) {
    ASSERT_TRUE(hold_case("--prefill-hold-tokens 1000 --prefill-hold-ms 600000", "hold") >= 0);
    /* A decodes for HOLD_A_TOKENS steps: a 1 ms hold lets B start long before. */
    ASSERT_TRUE(hold_case("--prefill-hold-tokens 1000 --prefill-hold-ms 1", "short") < 0);
}

TEST_MAIN(cluster_batch_wait_one_step, cluster_batch_wait_full_batch_plans, cluster_prefill_hold)
