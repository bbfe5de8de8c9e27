/* Tests of what llm-worker, a real process, does with what the router
 * sends it, the test playing the router (tests/worker/node_fixture.h): bad
 * frames, wrong versions and bodies answered with Error, failing steps and
 * bad sampling parameters reported while it keeps serving, plans of an old
 * epoch dropped; seeded sampling reproduced, freed sequences, logprobs and
 * repetition penalties over the history it keeps from the plans.  Every
 * wait is bounded. */
#include "tests/worker/node_fixture.h"

static void t_expect_error(struct t_router *r, Llm__Error__Code code, const char *needle) {
    Llm__WorkerEnvelope *e = t_recv(r, LLM__WORKER_ENVELOPE__BODY_ERROR, T_WAIT_MS, NULL);
    if (!e) TEST_FAIL("no Error reply (expected %s)", proto_code_name(code));
    ASSERT_STREQ(proto_code_name(code), proto_code_name(e->error->code));
    if (!strstr(e->error->message, needle))
        TEST_FAIL("error message \"%s\" does not mention \"%s\"", e->error->message, needle);
    proto_worker_free(e);
}

TEST(node_bad_input_keeps_serving) {
    struct t_golden g;
    t_golden_load(&g);
    struct t_router r = {0};
    t_router_open(&r);
    struct t_worker w = {0};
    t_worker_start(&w, r.endpoint, NULL, "w-bad", NULL);
    char ep[256];
    t_expect_register(&r, "w-bad", ep, sizeof ep);
    t_reply(&r, "w-bad", 5, "", "");

    /* Garbage. */
    const uint8_t junk[] = {0xff, 0xfe, 0x01, 0x99, 0x42};
    t_send_raw(&r, "w-bad", junk, sizeof junk);
    t_expect_error(&r, LLM__ERROR__CODE__INVALID_ARGUMENT, "");
    /* A well-formed envelope of a protocol version this worker does not speak. */
    Llm__Heartbeat hb = LLM__HEARTBEAT__INIT;
    Llm__WorkerEnvelope env = LLM__WORKER_ENVELOPE__INIT;
    env.version = 99;
    env.body_case = LLM__WORKER_ENVELOPE__BODY_HEARTBEAT;
    env.heartbeat = &hb;
    uint8_t buf[256];
    size_t len = llm__worker_envelope__pack(&env, buf);
    t_send_raw(&r, "w-bad", buf, len);
    t_expect_error(&r, LLM__ERROR__CODE__INVALID_ARGUMENT, "99");
    /* A body that flows the other way. */
    t_send(&r, "w-bad", &env);
    t_expect_error(&r, LLM__ERROR__CODE__UNIMPLEMENTED, "body");

    /* A block id past the pool: that step fails, the next one works. */
    struct t_seq s = {1, g.prompt, (size_t)g.n_prompt, 0, 0x7fffff00u, 1, 0, 0, 0, 0};
    t_send_plan(&r, "w-bad", 1, 5, &s, 1, NULL, 0);
    Llm__WorkerEnvelope *e = t_result(&r, 1, NULL);
    ASSERT_TRUE(e != NULL);
    ASSERT_TRUE(e->result->error != NULL);
    ASSERT_STREQ("w-bad", e->result->worker_id);
    ASSERT_EQ((uint64_t)5, e->result->epoch);
    proto_worker_free(e);
    /* A plan of an older epoch is dropped without a reply. */
    s.block_base = 0;
    t_send_plan(&r, "w-bad", 2, 4, &s, 1, NULL, 0);
    t_send_plan(&r, "w-bad", 3, 5, &s, 1, NULL, 0);
    e = t_recv(&r, LLM__WORKER_ENVELOPE__BODY_RESULT, T_WAIT_MS, NULL);
    ASSERT_TRUE(e != NULL);
    ASSERT_EQ((uint64_t)3, e->result->step_id);
    ASSERT_TRUE(e->result->error == NULL);
    ASSERT_EQ(g.gen[0], e->result->seqs[0]->token);
    proto_worker_free(e);

    /* Bad sampling parameters fail that sequence only. */
    struct t_seq two[2] = {{2, g.prompt, (size_t)g.n_prompt, 0, 10, 1, -1.0f, 0, 0, 0},
                           {3, g.prompt, (size_t)g.n_prompt, 0, 20, 1, 0, 0, 0, 0}};
    t_send_plan(&r, "w-bad", 4, 5, two, 2, NULL, 0);
    e = t_result(&r, 4, NULL);
    ASSERT_TRUE(e != NULL);
    ASSERT_EQ((size_t)2, e->result->n_seqs);
    ASSERT_TRUE(e->result->seqs[0]->error != NULL);
    /* Named as the router names it in a request (proto_sampling_check). */
    if (!strstr(e->result->seqs[0]->error->message, "seq 2: sampling.temperature = -1"))
        TEST_FAIL("error \"%s\" does not name seq 2's sampling.temperature",
                  e->result->seqs[0]->error->message);
    ASSERT_EQ(-1, e->result->seqs[0]->token);
    ASSERT_EQ(g.gen[0], e->result->seqs[1]->token);
    proto_worker_free(e);

    kill(w.pid, SIGTERM);
    int code = t_worker_wait(&w, 10000);
    if (code != 0) t_worker_log_tail(&w);
    t_worker_kill(&w);
    ASSERT_EQ(0, code);
    t_router_close(&r);
    unlink(w.log);
}

TEST(node_seeded_sampling_reproduces) {
    struct t_golden g;
    t_golden_load(&g);
    struct t_router r = {0};
    t_router_open(&r);
    struct t_worker w = {0};
    t_worker_start(&w, r.endpoint, NULL, "w-seed", NULL);
    char ep[256];
    t_expect_register(&r, "w-seed", ep, sizeof ep);
    t_reply(&r, "w-seed", 1, "", "");
    /* The same request twice as two sequences of one step each decode: the
     * draws depend on (seed, position) only, so the tokens agree; a third
     * sequence with another seed is there to show the draws do vary. */
    int32_t out[3][12];
    int32_t last[3];
    struct t_seq s[3];
    for (int k = 0; k < 3; k++) {
        struct t_seq q = {(uint64_t)(50 + k), g.prompt, (size_t)g.n_prompt, 0, (uint32_t)(k * 10), 1,
                          1.5f, k == 2 ? 999u : 1234u, 0, 0};
        s[k] = q;
    }
    uint64_t step = 1;
    for (int i = 0; i < 12; i++, step++) {
        t_send_plan(&r, "w-seed", step, 1, s, 3, NULL, 0);
        Llm__WorkerEnvelope *e = t_result(&r, step, NULL);
        if (!e) TEST_FAIL("no result for step %d", i);
        ASSERT_TRUE(e->result->error == NULL);
        for (int k = 0; k < 3; k++) {
            out[k][i] = e->result->seqs[k]->token;
            last[k] = out[k][i];
            s[k].start_pos += (uint32_t)s[k].n;
            s[k].tokens = &last[k];
            s[k].n = 1;
        }
        proto_worker_free(e);
        /* last[] is read by the next plan's pack: keep it in place. */
        for (int k = 0; k < 3; k++) s[k].tokens = &last[k];
    }
    int differs = 0;
    for (int i = 0; i < 12; i++) {
        ASSERT_EQ(out[0][i], out[1][i]);
        differs |= out[0][i] != out[2][i];
    }
    ASSERT_TRUE(differs);
    /* Freeing the sequences is accepted with the next plan. */
    uint64_t freed[3] = {50, 51, 52};
    struct t_seq q = {60, g.prompt, (size_t)g.n_prompt, 0, 0, 1, 0, 0, 0, 0};
    t_send_plan(&r, "w-seed", step, 1, &q, 1, freed, 3);
    Llm__WorkerEnvelope *e = t_result(&r, step, NULL);
    ASSERT_TRUE(e != NULL);
    ASSERT_EQ(g.gen[0], e->result->seqs[0]->token);
    proto_worker_free(e);
    kill(w.pid, SIGTERM);
    int code = t_worker_wait(&w, 10000);
    if (code != 0) t_worker_log_tail(&w);
    t_worker_kill(&w);
    ASSERT_EQ(0, code);
    t_router_close(&r);
    unlink(w.log);
}

/* Log-probabilities come with the token when asked; a repetition penalty
 * sees the whole history the worker keeps from the plans (prompt and every
 * decoded token), so a strong one never repeats a token, while the same
 * sequence without it follows the goldens, repeats included. */
TEST(node_logprobs_and_penalties) {
    struct t_golden g;
    t_golden_load(&g);
    struct t_router r = {0};
    t_router_open(&r);
    struct t_worker w = {0};
    t_worker_start(&w, r.endpoint, NULL, "w-pen", NULL);
    char ep[256];
    t_expect_register(&r, "w-pen", ep, sizeof ep);
    t_reply(&r, "w-pen", 1, "", "");
    enum { N = 40 };
    struct t_seq s[2] = {{70, g.prompt, (size_t)g.n_prompt, 0, 0, 1, 0, 0, 3, 0},
                         {71, g.prompt, (size_t)g.n_prompt, 0, 10, 1, 0, 0, 0, 50.0f}};
    int32_t out[2][N], last[2];
    for (int i = 0; i < N; i++) {
        t_send_plan(&r, "w-pen", (uint64_t)i + 1, 1, s, 2, NULL, 0);
        Llm__WorkerEnvelope *e = t_result(&r, (uint64_t)i + 1, NULL);
        if (!e) TEST_FAIL("no result for step %d", i + 1);
        ASSERT_TRUE(e->result->error == NULL);
        const Llm__SeqResult *a = e->result->seqs[0], *b = e->result->seqs[1];
        ASSERT_TRUE(a->logprob != NULL);
        ASSERT_EQ(a->token, a->logprob->token);
        ASSERT_EQ((size_t)3, a->logprob->n_top);
        ASSERT_EQ(a->token, a->logprob->top[0]->token); /* greedy: the most likely */
        ASSERT_TRUE(a->logprob->logprob <= 0 && a->logprob->logprob == a->logprob->top[0]->logprob);
        ASSERT_TRUE(a->logprob->top[1]->logprob <= a->logprob->top[0]->logprob);
        ASSERT_TRUE(b->logprob == NULL);
        out[0][i] = last[0] = a->token;
        out[1][i] = last[1] = b->token;
        proto_worker_free(e);
        for (int k = 0; k < 2; k++) {
            s[k].start_pos += (uint32_t)s[k].n;
            s[k].tokens = &last[k];
            s[k].n = 1;
        }
    }
    int repeats_plain = 0, repeats_penalized = 0;
    for (int i = 0; i < N; i++) {
        ASSERT_EQ(g.gen[i], out[0][i]);
        for (int j = 0; j < i; j++) {
            repeats_plain += out[0][j] == out[0][i];
            repeats_penalized += out[1][j] == out[1][i];
        }
        for (int j = 0; j < g.n_prompt; j++) repeats_penalized += g.prompt[j] == out[1][i];
    }
    ASSERT_TRUE(repeats_plain > 0);
    ASSERT_EQ(0, repeats_penalized);
    kill(w.pid, SIGTERM);
    int code = t_worker_wait(&w, 10000);
    if (code != 0) t_worker_log_tail(&w);
    t_worker_kill(&w);
    ASSERT_EQ(0, code);
    t_router_close(&r);
    unlink(w.log);
}

TEST_MAIN(node_bad_input_keeps_serving, node_seeded_sampling_reproduces, node_logprobs_and_penalties)
