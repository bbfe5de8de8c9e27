/* Tests of llm-worker as real processes in two pipeline stages, with the
 * test playing the router (tests/worker/node_fixture.h): greedy generation
 * against the llama.cpp goldens through stages chained over the ZeroMQ link
 * on the router's default layer split (stage 0 running ahead of the last),
 * and two GPU stages linked by NCCL through a private Redis (skipped without
 * two GPUs).  Every wait is bounded. */
#include "tests/worker/node_fixture.h"

#include "kernels/backend.h"
#include "router/modelinfo.h"
#include "tests/redis_fixture.h"

TEST(node_two_stages_chain_over_zmq) {
    struct t_golden g;
    t_golden_load(&g);
    struct t_router r = {0};
    t_router_open(&r);
    struct t_worker w0 = {0}, w1 = {0};
    const char *a0[] = {"--stages", "2", "--stage", "0", "--pipeline", "1", NULL};
    const char *a1[] = {"--stages", "2", "--stage", "1", "--pipeline", "1", NULL};
    /* The workers pick the layers the router's default split gives, so a
     * router placing them would not make them reload. */
    struct modelinfo mi;
    char merr[256];
    int32_t cut[2], cut_end[2];
    ASSERT_OK(modelinfo_load(&mi, test_model_path("stories260K-f32.gguf"), merr, sizeof merr));
    ASSERT_OK(modelinfo_split(&mi, 2, cut, cut_end, merr, sizeof merr));
    modelinfo_free(&mi);
    ASSERT_EQ(cut_end[0], cut[1]);
    t_worker_start(&w0, r.endpoint, NULL, "s0", a0);
    t_worker_start(&w1, r.endpoint, NULL, "s1", a1);
    uint32_t cut0_end = 0, cut1_first = 0;
    char ep0[256] = "", ep1[256] = "";
    /* Until both have registered (a slow one sends Register again). */
    int64_t reg_end = t_now_ms() + 4 * T_WAIT_MS;
    while (!ep0[0] || !ep1[0]) {
        if (t_now_ms() > reg_end) {
            t_worker_log_tail(&w0);
            t_worker_log_tail(&w1);
            t_worker_kill(&w0);
            t_worker_kill(&w1);
            TEST_FAIL("not both workers registered within %d ms", 4 * T_WAIT_MS);
        }
        char from[64];
        Llm__WorkerEnvelope *e = t_recv(&r, LLM__WORKER_ENVELOPE__BODY_REGISTER, T_WAIT_MS, from);
        if (!e) TEST_FAIL("not both workers registered (s0: \"%s\", s1: \"%s\")", ep0, ep1);
        Llm__Register *rg = e->register_;
        ASSERT_EQ(2u, rg->stage_count);
        if (strcmp(from, "s0") == 0) {
            ASSERT_EQ(0u, rg->layer_first);
            ASSERT_TRUE(rg->layer_end > 0 && rg->layer_end < 5);
            cut0_end = rg->layer_end;
            snprintf(ep0, sizeof ep0, "%s", rg->stage_endpoint);
        } else {
            ASSERT_STREQ("s1", from);
            ASSERT_EQ(5u, rg->layer_end);
            ASSERT_TRUE(rg->layer_first > 0);
            cut1_first = rg->layer_first;
            snprintf(ep1, sizeof ep1, "%s", rg->stage_endpoint);
        }
        proto_worker_free(e);
    }
    ASSERT_TRUE(ep0[0] && ep1[0]);
    ASSERT_EQ((uint32_t)cut[1], cut0_end);
    ASSERT_EQ((uint32_t)cut[1], cut1_first);
    t_reply(&r, "s0", 1, "", ep1);
    t_reply(&r, "s1", 1, ep0, "");
    int32_t toks[20];
    const char *to[2] = {"s0", "s1"};
    t_generate(&r, to, 2, 1, 3, &g, 20, toks, "s1");
    for (int i = 0; i < 20; i++) ASSERT_EQ(g.gen[i], toks[i]);

    /* Stage 0 runs ahead: three plans of two independent sequences sent at
     * once come back, in order, from the last stage. */
    struct t_seq a = {11, g.prompt, (size_t)g.n_prompt, 0, 20, 1, 0, 0, 0, 0};
    struct t_seq b = {12, g.prompt, 3, 0, 30, 1, 0, 0, 0, 0};
    t_send_plan(&r, "s0", 100, 1, &a, 1, NULL, 0);
    t_send_plan(&r, "s0", 101, 1, &b, 1, NULL, 0);
    t_send_plan(&r, "s1", 100, 1, &a, 1, NULL, 0);
    t_send_plan(&r, "s1", 101, 1, &b, 1, NULL, 0);
    Llm__WorkerEnvelope *e = t_result(&r, 100, NULL);
    ASSERT_TRUE(e != NULL);
    ASSERT_EQ(g.gen[0], e->result->seqs[0]->token);
    proto_worker_free(e);
    e = t_result(&r, 101, NULL);
    ASSERT_TRUE(e != NULL);
    ASSERT_TRUE(e->result->error == NULL);
    proto_worker_free(e);

    kill(w0.pid, SIGTERM);
    kill(w1.pid, SIGTERM);
    int c0 = t_worker_wait(&w0, 10000), c1 = t_worker_wait(&w1, 10000);
    if (c0 != 0) t_worker_log_tail(&w0);
    if (c1 != 0) t_worker_log_tail(&w1);
    t_worker_kill(&w0);
    t_worker_kill(&w1);
    ASSERT_EQ(0, c0);
    ASSERT_EQ(0, c1);
    t_router_close(&r);
    unlink(w0.log);
    unlink(w1.log);
}

/* Two GPU stages linked by NCCL (ids through Redis), when the machine has
 * two GPUs.  Hidden states cross the link in F16, so only the start of the
 * greedy sequence is held to the goldens. */
TEST(node_two_stages_chain_over_nccl) {
    backend *b = NULL;
    char err[512];
    if (backend_cuda_init(&b, 1, err, sizeof err) < 0) TEST_SKIP("needs two GPUs: %s", err);
    backend_free(b);
    struct t_golden g;
    t_golden_load(&g);
    struct redis_fixture f;
    fixture_redis_start(&f, 0);
    struct t_router r = {0};
    t_router_open(&r);
    struct t_worker w0 = {0}, w1 = {0};
    const char *a0[] = {"--stages", "2", "--stage", "0", "--pipeline", "1", "--device", "cuda:0",
                        "--require-gpu", "--transport", "nccl", "--kv-blocks", "64", NULL};
    const char *a1[] = {"--stages", "2", "--stage", "1", "--pipeline", "1", "--device", "cuda:1",
                        "--require-gpu", "--transport", "nccl", "--kv-blocks", "64", NULL};
    t_worker_start(&w0, r.endpoint, f.url, "g0", a0);
    t_worker_start(&w1, r.endpoint, f.url, "g1", a1);
    int seen0 = 0, seen1 = 0;
    int64_t reg_end = t_now_ms() + 60000;
    while ((!seen0 || !seen1) && t_now_ms() < reg_end) {
        char from[64];
        Llm__WorkerEnvelope *e = t_recv(&r, LLM__WORKER_ENVELOPE__BODY_REGISTER, 60000, from);
        if (e) {
            seen0 |= strcmp(from, "g0") == 0;
            seen1 |= strcmp(from, "g1") == 0;
            ASSERT_STREQ("cuda", e->register_->backend);
            ASSERT_STREQ("", e->register_->stage_endpoint);
            proto_worker_free(e);
            continue;
        }
        if (!e) {
            t_worker_log_tail(&w0);
            t_worker_log_tail(&w1);
            t_worker_kill(&w0);
            t_worker_kill(&w1);
            TEST_FAIL("not both GPU workers registered (g0 %d, g1 %d)", seen0, seen1);
        }
    }
    if (!seen0 || !seen1) {
        t_worker_log_tail(&w0);
        t_worker_log_tail(&w1);
        t_worker_kill(&w0);
        t_worker_kill(&w1);
        TEST_FAIL("not both GPU workers registered within 60 s (g0 %d, g1 %d)", seen0, seen1);
    }
    t_reply(&r, "g0", 1, "", "");
    t_reply(&r, "g1", 1, "", "");
    int32_t toks[10];
    const char *to[2] = {"g0", "g1"};
    t_generate(&r, to, 2, 1, 3, &g, 10, toks, "g1");
    for (int i = 0; i < 10; i++) ASSERT_EQ(g.gen[i], toks[i]);
    kill(w0.pid, SIGTERM);
    kill(w1.pid, SIGTERM);
    int c0 = t_worker_wait(&w0, 20000), c1 = t_worker_wait(&w1, 20000);
    if (c0 != 0) t_worker_log_tail(&w0);
    if (c1 != 0) t_worker_log_tail(&w1);
    t_worker_kill(&w0);
    t_worker_kill(&w1);
    ASSERT_EQ(0, c0);
    ASSERT_EQ(0, c1);
    t_router_close(&r);
    ASSERT_OK(fixture_redis_stop(&f));
}

TEST_MAIN(node_two_stages_chain_over_zmq, node_two_stages_chain_over_nccl)
