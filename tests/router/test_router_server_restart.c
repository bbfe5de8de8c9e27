/* Tests of the router (router/server*.c in-process,
 * tests/router/router_server_fixture.h) when it or its Redis restarts: a
 * request resumes on a new router, Redis restarted empty gets the running
 * request stored again, health follows Redis, and a sampled request's seed
 * survives the loss of both (a re-attach that sends it back is the same
 * request). */
#include "tests/router/router_server_fixture.h"

#include "common/rconn.h"

/* A sampled request (temperature 0.8) with the seed left to the router. */
static void cl_generate_sampled(struct zio_sock *d, uint64_t tag, const char *id, uint64_t seed,
                                uint32_t max_tokens, uint32_t resume_from) {
    Llm__GenerateRequest g = LLM__GENERATE_REQUEST__INIT;
    g.request_id = (char *)id;
    g.prompt_tokens = (int32_t *)prompt3;
    g.n_prompt_tokens = 3;
    g.max_tokens = max_tokens;
    g.stream = true;
    g.resume_from = resume_from;
    Llm__SamplingParams sp = LLM__SAMPLING_PARAMS__INIT;
    sp.temperature = 0.8f;
    sp.seed = seed;
    g.sampling = &sp;
    Llm__ClientEnvelope env = LLM__CLIENT_ENVELOPE__INIT;
    env.tag = tag;
    env.body_case = LLM__CLIENT_ENVELOPE__BODY_GENERATE;
    env.generate = &g;
    cl_send(d, &env);
}

TEST(router_server_restart_resumes_requests) {
    struct fx f;
    fx_start(&f, 2000, 100);
    struct fw w;
    fw_open(&f, &w, "w1");
    struct zio_sock *c = cl_open(&f);
    cl_generate(c, 1, "rs-1", prompt3, 3, 5, 0);
    proto_client_free(cl_expect(c, LLM__CLIENT_ENVELOPE__BODY_ACCEPTED));
    for (int k = 0; k < 2; k++) {
        Llm__WorkerEnvelope *pe = fw_plan(&w);
        fw_answer(&w, pe->plan, 100 + k);
        proto_worker_free(pe);
    }
    int32_t got[8];
    for (int i = 0; i < 8; i++) got[i] = -1;
    int count = 0;
    while (count < 2) {
        Llm__ClientEnvelope *e = cl_expect(c, LLM__CLIENT_ENVELOPE__BODY_CHUNK);
        for (size_t i = 0; i < e->chunk->n_token_ids; i++) got[e->chunk->index + i] = e->chunk->token_ids[i], count++;
        proto_client_free(e);
    }
    /* The router dies and a new one starts on the same Redis. */
    zio_sock_close(c);
    fw_close(&w);
    fx_server_stop(&f);
    fx_server_start(&f, 2000, 100);
    fw_open(&f, &w, "w1");
    c = cl_open(&f);
    cl_generate(c, 2, "rs-1", prompt3, 3, 5, (uint32_t)count);
    Llm__ClientEnvelope *e = cl_expect(c, LLM__CLIENT_ENVELOPE__BODY_ACCEPTED);
    ASSERT_TRUE(e->accepted->reattached);
    proto_client_free(e);
    Llm__WorkerEnvelope *pe = fw_plan(&w);
    ASSERT_EQ(0u, pe->plan->seqs[0]->start_pos);
    ASSERT_EQ((size_t)5, pe->plan->seqs[0]->n_tokens);
    ASSERT_EQ(101, pe->plan->seqs[0]->tokens[4]);
    fw_answer(&w, pe->plan, 102);
    proto_worker_free(pe);
    for (int k = 3; k < 5; k++) {
        pe = fw_plan(&w);
        fw_answer(&w, pe->plan, 100 + k);
        proto_worker_free(pe);
    }
    e = cl_collect(c, got, &count, 8);
    ASSERT_EQ(5, count);
    for (int i = 0; i < 5; i++) ASSERT_EQ(100 + i, got[i]);
    ASSERT_EQ((int)LLM__GENERATE_DONE__FINISH_REASON__LENGTH, (int)e->done->finish_reason);
    proto_client_free(e);
    zio_sock_close(c);
    fw_close(&w);
    fx_stop(&f);
}

/* Redis restarted without its data under a running router (reached through
 * a password): the next request is accepted the first time (the consumer
 * group is made again), and a request that was running is stored again. */
TEST(router_server_redis_restarted_empty) {
    struct fx f;
    fx_start_redis(&f, 2000, 100, FIXTURE_REDIS_AUTH);
    struct fw w;
    fw_open(&f, &w, "w1");
    struct zio_sock *c = cl_open(&f);
    cl_generate(c, 1, "before", prompt3, 3, 3, 0);
    proto_client_free(cl_expect(c, LLM__CLIENT_ENVELOPE__BODY_ACCEPTED));
    Llm__WorkerEnvelope *pe = fw_plan(&w);
    fw_answer(&w, pe->plan, 100);
    proto_worker_free(pe);
    proto_client_free(cl_expect(c, LLM__CLIENT_ENVELOPE__BODY_CHUNK));

    fixture_redis_restart(&f.r); /* no persistence: empty */
    cl_generate(c, 2, "after", prompt3, 3, 2, 0);
    Llm__ClientEnvelope *e = cl_recv(c, 3000);
    ASSERT_TRUE(e != NULL);
    if (e->body_case != LLM__CLIENT_ENVELOPE__BODY_ACCEPTED)
        TEST_FAIL("request after an empty Redis restart: body %d %s", (int)e->body_case,
                  e->body_case == LLM__CLIENT_ENVELOPE__BODY_ERROR ? e->error->message : "");
    proto_client_free(e);
    /* The running request is in Redis again, with its token so far. */
    struct rconn *rc;
    char err[512];
    ASSERT_OK(rconn_open_url(f.r.url_auth, 1000, &rc, err, sizeof err));
    int64_t end = t_ms() + 3000;
    void *v = NULL;
    size_t len = 0;
    while (rconn_hget(rc, "llm:req:before", "state", &v, &len) != 0) {
        if (t_ms() > end) TEST_FAIL("request 'before' was not stored again after Redis lost it");
        usleep(20 * 1000);
    }
    ASSERT_STREQ("queued", (char *)v);
    free(v);
    end = t_ms() + 3000;
    while (rconn_get(rc, "llm:req:before:gen", &v, &len) != 0) {
        if (t_ms() > end) TEST_FAIL("the tokens of 'before' were not stored again");
        usleep(20 * 1000);
    }
    ASSERT_EQ((size_t)4, len);
    free(v);
    rconn_close(rc);
    zio_sock_close(c);
    fw_close(&w);
    fx_stop(&f);
}

/* Health says NOT_SERVING while Redis cannot be reached, and SERVING again
 * once it is back; a request meanwhile gets UNAVAILABLE naming Redis. */
TEST(router_server_health_follows_redis) {
    struct fx f;
    fx_start(&f, 5000, 100);
    struct fw w;
    fw_open(&f, &w, "w1");
    struct zio_sock *c = cl_open(&f);
    ASSERT_EQ((int)LLM__HEALTH_REPLY__SERVING_STATUS__SERVING, (int)cl_health(c));
    fixture_redis_kill(&f.r);
    int64_t end = t_ms() + 3000;
    while (cl_health(c) != LLM__HEALTH_REPLY__SERVING_STATUS__NOT_SERVING) {
        if (t_ms() > end) TEST_FAIL("health still SERVING 3 s after Redis died");
        fw_heartbeat(&w);
        usleep(20 * 1000);
    }
    cl_generate(c, 1, "while-down", prompt3, 3, 2, 0);
    cl_expect_error(c, LLM__ERROR__CODE__UNAVAILABLE, "Redis");
    fixture_redis_restart(&f.r);
    end = t_ms() + 5000;
    while (cl_health(c) != LLM__HEALTH_REPLY__SERVING_STATUS__SERVING) {
        if (t_ms() > end) TEST_FAIL("health not SERVING 5 s after Redis came back");
        fw_heartbeat(&w);
        usleep(20 * 1000);
    }
    zio_sock_close(c);
    fw_close(&w);
    fx_stop(&f);
}

/* The lost-state scenario in miniature: a sampled request with a
 * router-chosen seed; the router and Redis both lose it; the client that
 * has 2 tokens re-attaches.  Without the seed: a clear FAILED_PRECONDITION,
 * not a new seed.  With the seed from GenerateAccepted: the request runs
 * again with that seed (every plan carries it), and the client gets exactly
 * the tokens it lacked. */
TEST(router_server_lost_state_keeps_the_seed) {
    struct fx f;
    fx_start(&f, 2000, 100);
    struct fw w;
    fw_open(&f, &w, "w1");
    struct zio_sock *c = cl_open(&f);
    cl_generate_sampled(c, 1, "lost-1", 0, 4, 0);
    Llm__ClientEnvelope *e = cl_expect(c, LLM__CLIENT_ENVELOPE__BODY_ACCEPTED);
    uint64_t seed = e->accepted->seed;
    ASSERT_TRUE(seed != 0);
    proto_client_free(e);
    for (int k = 0; k < 2; k++) {
        Llm__WorkerEnvelope *pe = fw_plan(&w);
        ASSERT_EQ(seed, pe->plan->seqs[0]->sampling->seed);
        fw_answer(&w, pe->plan, 100 + k);
        proto_worker_free(pe);
    }
    int32_t got[8];
    for (int i = 0; i < 8; i++) got[i] = -1;
    int count = 0;
    while (count < 2) {
        e = cl_expect(c, LLM__CLIENT_ENVELOPE__BODY_CHUNK);
        for (size_t i = 0; i < e->chunk->n_token_ids; i++) got[e->chunk->index + i] = e->chunk->token_ids[i], count++;
        proto_client_free(e);
    }
    /* Both lose it: the router restarts and Redis comes back empty. */
    zio_sock_close(c);
    fw_close(&w);
    fx_server_stop(&f);
    fixture_redis_restart(&f.r);
    fx_server_start(&f, 2000, 100);
    fw_open(&f, &w, "w1");
    c = cl_open(&f);
    cl_generate_sampled(c, 2, "lost-1", 0, 4, 2);
    cl_expect_error(c, LLM__ERROR__CODE__FAILED_PRECONDITION, "sampling.seed");
    /* Nothing was started with a new seed. */
    ASSERT_TRUE(fw_recv(&w, 200) == NULL);

    cl_generate_sampled(c, 3, "lost-1", seed, 4, 2);
    e = cl_expect(c, LLM__CLIENT_ENVELOPE__BODY_ACCEPTED);
    ASSERT_EQ(seed, e->accepted->seed);
    proto_client_free(e);
    /* Run from the prompt again; the fake worker, like a real one with the
     * same seed, samples the same tokens. */
    for (int k = 0; k < 4; k++) {
        Llm__WorkerEnvelope *pe = fw_plan(&w);
        ASSERT_EQ(seed, pe->plan->seqs[0]->sampling->seed);
        if (k == 0) ASSERT_EQ(0u, pe->plan->seqs[0]->start_pos);
        fw_answer(&w, pe->plan, 100 + k);
        proto_worker_free(pe);
    }
    e = cl_collect(c, got, &count, 8); /* fails on a token received twice */
    ASSERT_EQ(4, count);
    for (int i = 0; i < 4; i++) ASSERT_EQ(100 + i, got[i]);
    ASSERT_EQ((int)LLM__GENERATE_DONE__FINISH_REASON__LENGTH, (int)e->done->finish_reason);
    proto_client_free(e);
    /* A re-attach that sends the router's seed back is the same request. */
    cl_generate_sampled(c, 4, "lost-1", seed, 4, 4);
    e = cl_expect(c, LLM__CLIENT_ENVELOPE__BODY_ACCEPTED);
    ASSERT_TRUE(e->accepted->reattached);
    proto_client_free(e);
    proto_client_free(cl_expect(c, LLM__CLIENT_ENVELOPE__BODY_DONE));
    zio_sock_close(c);
    fw_close(&w);
    fx_stop(&f);
}

/* While the router still has the request, sending back its chosen seed is
 * a re-attach, not a different request (ALREADY_EXISTS). */
TEST(router_server_reattach_with_chosen_seed) {
    struct fx f;
    fx_start(&f, 2000, 100);
    struct fw w;
    fw_open(&f, &w, "w1");
    struct zio_sock *c = cl_open(&f);
    cl_generate_sampled(c, 1, "seed-back", 0, 3, 0);
    Llm__ClientEnvelope *e = cl_expect(c, LLM__CLIENT_ENVELOPE__BODY_ACCEPTED);
    uint64_t seed = e->accepted->seed;
    proto_client_free(e);
    cl_generate_sampled(c, 2, "seed-back", seed, 3, 0);
    e = cl_expect(c, LLM__CLIENT_ENVELOPE__BODY_ACCEPTED);
    ASSERT_TRUE(e->accepted->reattached);
    proto_client_free(e);
    cl_generate_sampled(c, 3, "seed-back", seed + 1, 3, 0);
    cl_expect_error(c, LLM__ERROR__CODE__ALREADY_EXISTS, "different body");
    zio_sock_close(c);
    fw_close(&w);
    fx_stop(&f);
}

TEST_MAIN(router_server_restart_resumes_requests, router_server_redis_restarted_empty,
          router_server_health_follows_redis, router_server_lost_state_keeps_the_seed,
          router_server_reattach_with_chosen_seed)
