/* Many requests at once: 50 concurrent generations of mixed prompt and
 * output lengths over two pipelines all complete, each with llm-run's
 * greedy output token for token. */
#include "tests/router/cluster_harness.h"

#define MODEL "stories260K-f32.gguf"

static const char *const prompts[] = {
    "Once",
    "The little dog",
    "Lily and Tom went to the park to play",
    "One day, a big bird flew over the house and saw",
    "She was very happy because her mom gave her a big red ball and a small blue car, and",
};
#define N_PROMPTS 5
static const int lengths[] = {3, 24, 70};
#define N_LENGTHS 3
#define N_REQUESTS 50

TEST(cluster_50_concurrent_requests_two_pipelines) {
    const char *model = test_model_path(MODEL);
    static struct h_ref refs[N_PROMPTS][N_LENGTHS];
    for (int p = 0; p < N_PROMPTS; p++)
        for (int l = 0; l < N_LENGTHS; l++) h_reference(model, prompts[p], lengths[l], 0, &refs[p][l]);
    struct cluster *cl = h_cluster_start(model, 2, 2, "", "");
    static struct h_gen gs[N_REQUESTS];
    memset(gs, 0, sizeof gs);
    for (int i = 0; i < N_REQUESTS; i++) {
        gs[i].cl = cl;
        gs[i].prompt = prompts[i % N_PROMPTS];
        gs[i].max_tokens = lengths[(i / N_PROMPTS) % N_LENGTHS];
        gs[i].ignore_eos = 1;
        snprintf(gs[i].request_id, sizeof gs[i].request_id, "load-%02d", i);
    }
    int64_t t0 = h_now_ms();
    h_generate_all(gs, N_REQUESTS);
    int64_t took = h_now_ms() - t0;
    int tokens = 0;
    for (int i = 0; i < N_REQUESTS; i++) {
        h_check(cl, &gs[i], &refs[i % N_PROMPTS][(i / N_PROMPTS) % N_LENGTHS]);
        tokens += gs[i].n;
    }
    printf("  %d requests, %d tokens in %lld ms\n", N_REQUESTS, tokens, (long long)took);
    /* Both pipelines stayed in service and nothing is left running. */
    llm_client *c = h_client(cl, 2000, 5000, 5000);
    Llm__ClientEnvelope *env = NULL;
    ASSERT_OK(llm_client_status(c, &env));
    const Llm__StatusReply *s = env->status_reply;
    int ready = 0;
    for (size_t i = 0; i < s->n_pipelines; i++) ready += s->pipelines[i]->ready;
    H_ASSERT(cl, ready == 2, "%d pipelines ready after the load, expected 2", ready);
    H_ASSERT(cl, s->queue_depth == 0 && s->running == 0, "queue %u, running %u after every request finished",
             s->queue_depth, s->running);
    H_ASSERT(cl, s->requests_total >= N_REQUESTS, "requests_total %llu", (unsigned long long)s->requests_total);
    proto_client_free(env);
    llm_client_close(c);
    for (int i = 0; i < N_REQUESTS; i++) llm_generate_result_free(&gs[i].res);
    h_cluster_stop(cl);
}

TEST_MAIN(cluster_50_concurrent_requests_two_pipelines)
