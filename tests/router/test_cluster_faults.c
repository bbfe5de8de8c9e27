/* Failures while requests run: kill -9 of a worker (also noticed at once
 * with slow liveness settings: the router sees its connection close), a router killed and
 * started again, and a pipeline drained away (scale-down) and another one
 * added (scale-up).  In each, every request completes exactly once with
 * llm-run's greedy output, token for token. */
#include "tests/router/cluster_harness.h"

#define MODEL "stories260K-f32.gguf"

static const char *const prompts[] = {
    "Once upon a time",
    "The little dog",
    "Lily and Tom went to the park",
    "One day, a big bird",
};
#define N_PROMPTS 4
#define N_TOKENS 100
#define N_REQ 16

/* Fast failure detection, and a small batch so that requests queue and the
 * fault lands while most of them are still to run. */
#define ROUTER_ARGS "--heartbeat-ms 200 --worker-timeout-ms 1000 --step-timeout-ms 3000 --max-batch 2"

static struct h_ref refs[N_PROMPTS];

static void make_refs(const char *model) {
    for (int p = 0; p < N_PROMPTS; p++) h_reference(model, prompts[p], N_TOKENS, 0, &refs[p]);
}

static void make_requests(struct cluster *cl, struct h_gen *gs, int n, const char *tag) {
    memset(gs, 0, sizeof *gs * (size_t)n);
    for (int i = 0; i < n; i++) {
        gs[i].cl = cl;
        gs[i].prompt = prompts[i % N_PROMPTS];
        gs[i].max_tokens = N_TOKENS;
        gs[i].ignore_eos = 1;
        gs[i].retry_ms = 30000;
        gs[i].wait_ms = 45000; /* a request that never ends fails the test, not ctest's timeout */
        snprintf(gs[i].request_id, sizeof gs[i].request_id, "%s-%02d", tag, i);
    }
}

static void check_all(struct cluster *cl, struct h_gen *gs, int n) {
    int reattached = 0;
    for (int i = 0; i < n; i++) {
        h_check(cl, &gs[i], &refs[i % N_PROMPTS]);
        reattached += gs[i].res.reattaches > 0;
        llm_generate_result_free(&gs[i].res);
    }
    printf("  %d requests complete and correct (%d re-attached)\n", n, reattached);
}

/* Waits until the requests have produced some tokens but not half, so the
 * fault lands with requests finished, running and queued; fails if they
 * got too far first. */
static void wait_mid_generation(struct cluster *cl, struct h_gen *gs, int n) {
    int64_t end = h_now_ms() + 30000;
    int seen;
    while ((seen = h_tokens_seen(gs, n)) < 150) {
        if (h_now_ms() > end) H_FAIL(cl, "no tokens within 30 s");
        h_sleep_ms(1);
    }
    H_ASSERT(cl, seen < n * N_TOKENS / 2, "%d of %d tokens already out before the fault", seen, n * N_TOKENS);
    printf("  fault after %d of %d tokens\n", seen, n * N_TOKENS);
}

TEST(cluster_worker_kill9_mid_generation) {
    const char *model = test_model_path(MODEL);
    make_refs(model);
    struct cluster *cl = h_cluster_start(model, 2, 2, ROUTER_ARGS, "");
    static struct h_gen gs[N_REQ];
    make_requests(cl, gs, N_REQ, "kill9");
    struct h_batch b;
    h_batch_start(&b, gs, N_REQ);
    wait_mid_generation(cl, gs, N_REQ);
    int slot = h_worker_slot(cl, 0, 1);
    ASSERT_TRUE(slot >= 0);
    h_proc_kill(&cl->workers[slot], SIGKILL);
    h_batch_join(&b);
    check_all(cl, gs, N_REQ);
    /* A replacement brings pipeline 0 back, and it serves. */
    h_start_worker(cl, slot, 0, 1);
    h_wait_ready(cl, 2, 1, 30000);
    make_requests(cl, gs, 4, "after-kill9");
    h_generate_all(gs, 4);
    check_all(cl, gs, 4);
    h_cluster_stop(cl);
}

/* The same kill with slow liveness: 5 s heartbeats (the worker's Redis key
 * lives 15 s) and a 30 s worker timeout, so that only the router's monitor
 * of the worker socket (the killed worker's connection closes) can take
 * pipeline 0 out of service soon: measured 1-10 ms on a 2-core VM; its
 * requests move to pipeline 1 and finish there. */
#define SLOW_LIVENESS_ARGS "--heartbeat-ms 5000 --worker-timeout-ms 30000 --step-timeout-ms 60000 --max-batch 2"
#define NOTICED_MAX_MS 2000

TEST(cluster_worker_kill9_noticed_at_once) {
    const char *model = test_model_path(MODEL);
    make_refs(model);
    struct cluster *cl = h_cluster_start(model, 2, 2, SLOW_LIVENESS_ARGS, "");
    static struct h_gen gs[N_REQ];
    make_requests(cl, gs, N_REQ, "kill9-slow");
    struct h_batch b;
    h_batch_start(&b, gs, N_REQ);
    wait_mid_generation(cl, gs, N_REQ);
    int slot = h_worker_slot(cl, 0, 1);
    ASSERT_TRUE(slot >= 0);
    llm_client *c = h_client(cl, 2000, 5000, 5000);
    int64_t killed = h_now_ms();
    h_proc_kill(&cl->workers[slot], SIGKILL);
    int64_t noticed = -1;
    while (h_now_ms() - killed < 20000) {
        if (h_ready_pipelines(cl, c, NULL) == 1) {
            noticed = h_now_ms() - killed;
            break;
        }
        h_sleep_ms(5);
    }
    llm_client_close(c);
    h_batch_join(&b);
    int64_t done = h_now_ms() - killed;
    printf("  pipeline 0 out of service %lld ms after the kill; all %d requests done %lld ms after it\n",
           (long long)noticed, N_REQ, (long long)done);
    check_all(cl, gs, N_REQ);
    H_ASSERT(cl, noticed >= 0 && noticed < NOTICED_MAX_MS,
             "pipeline 0 left service %lld ms after its stage 1 was killed (bound %d ms; its key lives 15 s)",
             (long long)noticed, NOTICED_MAX_MS);
    h_cluster_stop(cl);
}

TEST(cluster_router_restart_mid_generation) {
    const char *model = test_model_path(MODEL);
    make_refs(model);
    struct cluster *cl = h_cluster_start(model, 1, 2, ROUTER_ARGS, "");
    static struct h_gen gs[N_REQ];
    make_requests(cl, gs, N_REQ, "restart");
    struct h_batch b;
    h_batch_start(&b, gs, N_REQ);
    wait_mid_generation(cl, gs, N_REQ);
    h_proc_kill(&cl->router, SIGKILL);
    h_sleep_ms(300);
    h_start_router(cl);
    h_batch_join(&b);
    check_all(cl, gs, N_REQ);
    h_wait_ready(cl, 1, 1, 10000);
    h_cluster_stop(cl);
}

TEST(cluster_scale_down_and_up_while_running) {
    const char *model = test_model_path(MODEL);
    make_refs(model);
    struct cluster *cl = h_cluster_start(model, 2, 2, ROUTER_ARGS, "");
    static struct h_gen gs[N_REQ];
    make_requests(cl, gs, N_REQ, "scale");
    struct h_batch b;
    h_batch_start(&b, gs, N_REQ);
    wait_mid_generation(cl, gs, N_REQ);
    /* Scale down: pipeline 1's workers are asked to stop (SIGTERM drains). */
    for (int s = 0; s < 2; s++) {
        int slot = h_worker_slot(cl, 1, s);
        ASSERT_TRUE(slot >= 0);
        h_proc_kill(&cl->workers[slot], SIGTERM);
    }
    h_wait_ready(cl, 1, 1, 10000);
    /* Scale up: a new pipeline 2 joins while the requests still run. */
    int n = cl->n_workers;
    h_start_worker(cl, n, 2, 0);
    h_start_worker(cl, n + 1, 2, 1);
    h_wait_ready(cl, 2, 1, 30000);
    h_batch_join(&b);
    check_all(cl, gs, N_REQ);
    /* Both pipelines serve a second batch. */
    make_requests(cl, gs, 8, "scaled");
    h_generate_all(gs, 8);
    check_all(cl, gs, 8);
    h_cluster_stop(cl);
}

TEST_MAIN(cluster_worker_kill9_mid_generation, cluster_worker_kill9_noticed_at_once,
          cluster_router_restart_mid_generation,
          cluster_scale_down_and_up_while_running)
