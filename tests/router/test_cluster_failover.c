/* Router fail-over: two routers on one Redis with one key pair, CPU
 * workers and clients that know both endpoints.  kill -9 of the router the
 * workers are registered with, under about 200 requests in flight: the
 * workers register with the other router, which takes over the dead one's
 * stream entries after --claim-idle-ms and resumes them; the clients
 * re-attach there by id.  Every request finishes exactly once with llm-run's
 * greedy output, and the fail-over time (the kill to the first token the
 * other router serves) and the time to the last request's end are printed
 * and bounded. */
#include "tests/router/cluster_harness.h"

#include "common/log.h"
#include "common/rconn.h"

#define MODEL "stories260K-f32.gguf"

static const char *const prompts[] = {
    "Once upon a time",
    "The little dog",
    "Lily and Tom went to the park",
    "One day, a big bird",
};
#define N_PROMPTS 4
#define N_TOKENS 40
#define N_REQ 200
#define N_AFTER 8
/* The clients' reply and idle timeouts: long, so that a client that waits
 * for an answer from the dead router (it answered UNAVAILABLE on the
 * survivor, "request runs on router test-router", and went back to the
 * first endpoint), or misses the disconnect, breaks the bounds below
 * instead of hiding in them as the 5 s and 10 s did (fail-over measured
 * 5.1 s against 1-2 s; a run of 10.6 s). */
#define CLIENT_REPLY_MS 15000
#define CLIENT_IDLE_MS 30000
/* What fail-over is made of here (docs/router.md, "Fail-over"): the worker
 * move (5 heartbeats: 1 s), the claim (1.5 s idle), a client's pause
 * between asking the survivor again (its retry_after_ms) and a pipeline
 * forming: measured 1.1-2.2 s to the first token and about 2.5 s to the
 * last request's end on a 2-core VM.  Generous for a busy machine, and
 * under CLIENT_REPLY_MS. */
#define FAILOVER_MAX_MS 6000
#define ALL_DONE_MAX_MS 12000

/* Fast detection (a worker moves after 5 heartbeats without its router:
 * 1 s; the survivor claims entries idle 1.5 s), and a batch small enough
 * that the kill lands with requests finished, running and queued. */
#define ROUTER_ARGS \
    "--heartbeat-ms 200 --worker-timeout-ms 1000 --step-timeout-ms 3000 --claim-idle-ms 1500 --max-batch 16"

static struct h_ref refs[N_PROMPTS];

static void make_requests(struct cluster *cl, struct h_gen *gs, int n, const char *tag) {
    memset(gs, 0, sizeof *gs * (size_t)n);
    for (int i = 0; i < n; i++) {
        gs[i].cl = cl;
        gs[i].prompt = prompts[i % N_PROMPTS];
        gs[i].max_tokens = N_TOKENS;
        gs[i].ignore_eos = 1;
        gs[i].retry_ms = 30000;
        gs[i].reply_ms = CLIENT_REPLY_MS;
        gs[i].idle_ms = CLIENT_IDLE_MS;
        gs[i].wait_ms = 50000; /* a request that never ends fails the test, not ctest's timeout */
        snprintf(gs[i].request_id, sizeof gs[i].request_id, "%s-%03d", tag, i);
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

/* Nothing left in the request stream: each request was finished (XACK and
 * XDEL of its one entry), none is pending for any router. */
static void check_stream_empty(struct cluster *cl) {
    struct rconn *c = NULL;
    char err[256];
    H_ASSERT(cl, rconn_open_url(cl->redis.url, 2000, &c, err, sizeof err) == 0, "redis: %s", err);
    int64_t len = -1;
    H_ASSERT(cl, rconn_xlen(c, "llm:requests", &len) == 0, "XLEN: %s", rconn_errstr(c));
    struct rconn_pending *pend = NULL;
    size_t n_pend = 0;
    H_ASSERT(cl, rconn_xpending(c, "llm:requests", "routers", NULL, 16, &pend, &n_pend) == 0, "XPENDING: %s",
             rconn_errstr(c));
    free(pend);
    rconn_close(c);
    H_ASSERT(cl, len == 0 && n_pend == 0, "request stream after the run: %lld entries, %zu pending", (long long)len,
             n_pend);
}

TEST(cluster_router_failover_kill9) {
    const char *model = test_model_path(MODEL);
    log_set_level(LL_WARN); /* 200 clients each saying it retries is noise */
    for (int p = 0; p < N_PROMPTS; p++) h_reference(model, prompts[p], N_TOKENS, 0, &refs[p]);
    struct cluster *cl = h_cluster_start_routers(model, 2, 1, ROUTER_ARGS, "", 2);
    static struct h_gen gs[N_REQ];
    make_requests(cl, gs, N_REQ, "fo");
    struct h_batch b;
    h_batch_start(&b, gs, N_REQ);
    int64_t end = h_now_ms() + 30000;
    int seen;
    while ((seen = h_tokens_seen(gs, N_REQ)) < 400) {
        if (h_now_ms() > end) H_FAIL(cl, "no tokens within 30 s");
        h_sleep_ms(1);
    }
    H_ASSERT(cl, seen < N_REQ * N_TOKENS / 2, "%d of %d tokens already out before the kill", seen, N_REQ * N_TOKENS);
    int64_t killed = h_now_ms();
    /* Chunks the dead router sent just before the kill may still be on
     * their way through the clients' sockets: what arrives 200 ms later
     * comes from the other router. */
    __atomic_store_n(&h_first_after_mark_ms, 0, __ATOMIC_RELEASE);
    __atomic_store_n(&h_mark_ms, killed + 200, __ATOMIC_RELEASE);
    h_proc_kill(&cl->router, SIGKILL);
    printf("  kill -9 of the router after %d of %d tokens\n", seen, N_REQ * N_TOKENS);
    h_batch_join(&b);
    int64_t all_done = h_now_ms();
    int64_t first = __atomic_load_n(&h_first_after_mark_ms, __ATOMIC_ACQUIRE);
    __atomic_store_n(&h_mark_ms, 0, __ATOMIC_RELEASE);
    H_ASSERT(cl, first > 0, "no token after the kill");
    int slowest = 0;
    for (int i = 1; i < N_REQ; i++)
        if (gs[i].last_token_ms > gs[slowest].last_token_ms) slowest = i;
    printf("  fail-over: first token from the other router %lld ms after the kill; all %d requests done %lld ms "
           "after it (the last token of %s %lld ms after it, %u re-attaches)\n", (long long)(first - killed), N_REQ,
           (long long)(all_done - killed), gs[slowest].request_id, (long long)(gs[slowest].last_token_ms - killed),
           gs[slowest].res.reattaches);
    check_all(cl, gs, N_REQ);
    H_ASSERT(cl, first - killed < FAILOVER_MAX_MS, "fail-over took %lld ms (bound %d ms)", (long long)(first - killed),
             FAILOVER_MAX_MS);
    H_ASSERT(cl, all_done - killed < ALL_DONE_MAX_MS, "the last request ended %lld ms after the kill (bound %d ms)",
             (long long)(all_done - killed), ALL_DONE_MAX_MS);
    check_stream_empty(cl);
    /* The survivor serves new requests with both pipelines. */
    h_wait_ready(cl, 2, 1, 10000);
    make_requests(cl, gs, N_AFTER, "after");
    h_generate_all(gs, N_AFTER);
    check_all(cl, gs, N_AFTER);
    check_stream_empty(cl);
    h_cluster_stop(cl);
}

/* A client of both routers, the second router's endpoint first. */
static llm_client *client_r2_first(struct cluster *cl, int reply_ms, int retry_ms) {
    const char *eps[2] = {cl->client_ep2, cl->client_ep};
    struct llm_client_config cfg;
    llm_client_config_default(&cfg);
    cfg.endpoints = eps;
    cfg.n_endpoints = 2;
    cfg.zmq_ctx = cl->zctx;
    cfg.reply_timeout_ms = reply_ms;
    cfg.retry_ms = retry_ms;
    llm_client *c = NULL;
    char err[256];
    if (llm_client_open(&c, &cfg, err, sizeof err) != 0) H_FAIL(cl, "llm_client_open: %s", err);
    return c;
}

/* One greedy request of N_TOKENS with id on c; returns the ms it took. */
static int64_t generate_on(struct cluster *cl, llm_client *c, const char *id, struct llm_generate_result *res) {
    struct llm_generate_params p;
    llm_generate_params_default(&p);
    p.request_id = id;
    p.prompt = prompts[0];
    p.max_tokens = N_TOKENS;
    p.sampling.ignore_eos = true;
    p.wait_ms = 60000;
    int64_t t0 = h_now_ms();
    int rc = llm_client_generate(c, &p, NULL, NULL, res);
    int64_t took = h_now_ms() - t0;
    H_ASSERT(cl, rc == 0, "request %s: %d after %lld ms: %s", id, rc, (long long)took, llm_client_errstr(c));
    H_ASSERT(cl, res->finish_reason == LLM__GENERATE_DONE__FINISH_REASON__LENGTH &&
                     res->completion_tokens == (uint32_t)refs[0].n,
             "request %s: %s with %u tokens", id, llm_finish_reason_name(res->finish_reason), res->completion_tokens);
    return took;
}

/* Defect 1 of issue 29: a router that answers UNAVAILABLE (here the second
 * one, which no worker registered with: "no worker is registered with this
 * router") sends the client on to the next endpoint at once, instead of
 * re-sending to it until --retry-ms; so does a router that is down (its
 * address refuses the connection), instead of costing a
 * --reply-timeout-ms.  A request re-sent by id still re-attaches. */
TEST(cluster_router_unavailable_moves_on) {
    const char *model = test_model_path(MODEL);
    h_reference(model, prompts[0], N_TOKENS, 0, &refs[0]);
    struct cluster *cl = h_cluster_start_routers(model, 1, 1, ROUTER_ARGS, "", 2);
    h_wait_ready(cl, 1, 1, 20000);
    enum { REPLY_MS = 4000 };
    struct llm_generate_result res;
    llm_client *c = client_r2_first(cl, REPLY_MS, 30000);
    int64_t took = generate_on(cl, c, "moves-on", &res);
    printf("  router 2 has no worker: served by %s in %lld ms\n", llm_client_endpoint(c), (long long)took);
    ASSERT_STREQ(cl->client_ep, llm_client_endpoint(c));
    ASSERT_TRUE(!res.reattached);
    H_ASSERT(cl, took < REPLY_MS, "took %lld ms (--reply-timeout-ms %d)", (long long)took, REPLY_MS);
    llm_generate_result_free(&res);
    llm_client_close(c);

    /* The same id again, from a new client that asks router 2 first: it
     * re-attaches (no second run) and gets every token. */
    c = client_r2_first(cl, REPLY_MS, 30000);
    took = generate_on(cl, c, "moves-on", &res);
    ASSERT_TRUE(res.reattached);
    ASSERT_EQ((uint32_t)refs[0].n, res.tokens_received);
    llm_generate_result_free(&res);
    llm_client_close(c);

    /* Router 2 down: its address refuses the connection, and router 1
     * serves at once (measured 12-22 ms for the 40 tokens; it was one
     * reply timeout and more). */
    h_proc_kill(&cl->router2, SIGKILL);
    c = client_r2_first(cl, REPLY_MS, 30000);
    took = generate_on(cl, c, "after-r2-died", &res);
    printf("  router 2 down: served by %s in %lld ms\n", llm_client_endpoint(c), (long long)took);
    ASSERT_STREQ(cl->client_ep, llm_client_endpoint(c));
    H_ASSERT(cl, took < REPLY_MS / 2, "took %lld ms (--reply-timeout-ms %d): a refused connection should move the "
             "client on at once", (long long)took, REPLY_MS);
    llm_generate_result_free(&res);
    llm_client_close(c);
    h_cluster_stop(cl);
}

TEST_MAIN(cluster_router_failover_kill9, cluster_router_unavailable_moves_on)
