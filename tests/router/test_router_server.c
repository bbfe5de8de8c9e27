/* Tests of the router's event loop (router/server*.c) in-process, against a
 * real redis-server, with a fake worker and clients on ZeroMQ sockets
 * (tests/router/router_server_fixture.h): a request planned, streamed and
 * stored, the Status reply, the refusal of malformed frames and bad fields,
 * a request refused while no pipeline serves, the bounded queue, a deadline
 * and a stop string.  The other test_router_server_*.c files test re-attach,
 * restarts, and workers lost or registering again. */
#include "tests/router/router_server_fixture.h"

#include "common/rconn.h"

TEST(router_server_generates_and_streams) {
    struct fx f;
    fx_start(&f, 2000, 100);
    struct fw w;
    fw_open(&f, &w, "w1");
    struct zio_sock *c = cl_open(&f);
    cl_generate(c, 11, "g1", prompt3, 3, 5, 0);
    Llm__ClientEnvelope *e = cl_expect(c, LLM__CLIENT_ENVELOPE__BODY_ACCEPTED);
    ASSERT_EQ((uint64_t)11, (uint64_t)e->tag);
    ASSERT_EQ(3u, e->accepted->prompt_tokens);
    ASSERT_EQ((uint64_t)42, e->accepted->seed);
    ASSERT_TRUE(!e->accepted->reattached);
    proto_client_free(e);
    for (int k = 0; k < 5; k++) {
        Llm__WorkerEnvelope *pe = fw_plan(&w);
        const Llm__StepPlan *p = pe->plan;
        ASSERT_EQ((size_t)1, p->n_seqs);
        const Llm__SeqPlan *sp = p->seqs[0];
        ASSERT_TRUE(sp->want_logits);
        ASSERT_EQ((uint64_t)42, sp->sampling->seed);
        if (k == 0) {
            ASSERT_EQ(0u, sp->start_pos);
            ASSERT_EQ((size_t)3, sp->n_tokens);
            ASSERT_EQ(403, sp->tokens[1]);
        } else {
            ASSERT_EQ((uint32_t)(2 + k), sp->start_pos);
            ASSERT_EQ((size_t)1, sp->n_tokens);
            ASSERT_EQ(300 + k - 1, sp->tokens[0]); /* the token sampled before */
        }
        ASSERT_EQ((size_t)1, sp->n_block_table);
        fw_answer(&w, p, 300 + k);
        proto_worker_free(pe);
    }
    int32_t got[8];
    for (int i = 0; i < 8; i++) got[i] = -1;
    int count = 0;
    e = cl_collect(c, got, &count, 8);
    ASSERT_EQ(5, count);
    for (int i = 0; i < 5; i++) ASSERT_EQ(300 + i, got[i]);
    ASSERT_EQ((int)LLM__GENERATE_DONE__FINISH_REASON__LENGTH, (int)e->done->finish_reason);
    ASSERT_EQ(3u, e->done->usage->prompt_tokens);
    ASSERT_EQ(5u, e->done->usage->completion_tokens);
    proto_client_free(e);

    /* Durable: the tokens and the end are in Redis. */
    struct rconn *rc;
    char err[256];
    ASSERT_OK(rconn_open_url(f.r.url, 2000, &rc, err, sizeof err));
    void *v = NULL;
    size_t len = 0;
    ASSERT_OK(rconn_get(rc, "llm:req:g1:gen", &v, &len));
    ASSERT_EQ((size_t)20, len);
    free(v);
    ASSERT_OK(rconn_hget(rc, "llm:req:g1", "state", &v, &len));
    ASSERT_STREQ("done", (char *)v);
    free(v);
    rconn_close(rc);

    /* Status reports the pipeline and the planning overhead. */
    Llm__ClientEnvelope st = LLM__CLIENT_ENVELOPE__INIT;
    Llm__StatusRequest sr = LLM__STATUS_REQUEST__INIT;
    st.tag = 5;
    st.body_case = LLM__CLIENT_ENVELOPE__BODY_STATUS;
    st.status = &sr;
    cl_send(c, &st);
    e = cl_expect(c, LLM__CLIENT_ENVELOPE__BODY_STATUS_REPLY);
    ASSERT_EQ((size_t)1, e->status_reply->n_pipelines);
    ASSERT_TRUE(e->status_reply->pipelines[0]->ready);
    ASSERT_EQ(64u, e->status_reply->pipelines[0]->kv_blocks_total);
    ASSERT_STREQ("w1", e->status_reply->pipelines[0]->stages[0]->worker_id);
    ASSERT_EQ((uint64_t)5, e->status_reply->steps_total);
    ASSERT_TRUE(e->status_reply->plan_us_mean > 0);
    ASSERT_TRUE(e->status_reply->turnaround_us_mean > 0);
    proto_client_free(e);
    zio_sock_close(c);
    fw_close(&w);
    fx_stop(&f);
}

TEST(router_server_refuses_bad_input_and_keeps_serving) {
    struct fx f;
    fx_start(&f, 2000, 100);
    struct fw w;
    fw_open(&f, &w, "w1");
    struct zio_sock *c = cl_open(&f);
    /* Not protobuf. */
    struct zio_frame junk = {"\xff\xff\xff\xff garbage", 12, NULL, NULL};
    zio_send(c, &junk, 1, 0);
    cl_expect_error(c, LLM__ERROR__CODE__INVALID_ARGUMENT, NULL);
    /* A version this router does not speak. */
    Llm__HealthRequest hr = LLM__HEALTH_REQUEST__INIT;
    Llm__ClientEnvelope env = LLM__CLIENT_ENVELOPE__INIT;
    env.version = 99;
    env.body_case = LLM__CLIENT_ENVELOPE__BODY_HEALTH;
    env.health = &hr;
    uint8_t buf[64];
    size_t n = llm__client_envelope__pack(&env, buf);
    struct zio_frame vf = {buf, n, NULL, NULL};
    zio_send(c, &vf, 1, 0);
    cl_expect_error(c, LLM__ERROR__CODE__INVALID_ARGUMENT, "99");
    /* Two frames. */
    struct zio_frame two[2] = {{"a", 1, NULL, NULL}, {"b", 1, NULL, NULL}};
    zio_send(c, two, 2, 0);
    cl_expect_error(c, LLM__ERROR__CODE__INVALID_ARGUMENT, "one frame");
    /* A reply sent as a request. */
    Llm__GenerateChunk ch = LLM__GENERATE_CHUNK__INIT;
    Llm__ClientEnvelope ce = LLM__CLIENT_ENVELOPE__INIT;
    ce.body_case = LLM__CLIENT_ENVELOPE__BODY_CHUNK;
    ce.chunk = &ch;
    cl_send(c, &ce);
    cl_expect_error(c, LLM__ERROR__CODE__UNIMPLEMENTED, NULL);
    /* Bad fields, named with their values. */
    Llm__GenerateRequest g = LLM__GENERATE_REQUEST__INIT;
    Llm__SamplingParams sp = LLM__SAMPLING_PARAMS__INIT;
    sp.top_p = 1.5f;
    g.request_id = "bad-1";
    g.prompt = "Once upon a time";
    g.sampling = &sp;
    Llm__ClientEnvelope ge = LLM__CLIENT_ENVELOPE__INIT;
    ge.body_case = LLM__CLIENT_ENVELOPE__BODY_GENERATE;
    ge.generate = &g;
    cl_send(c, &ge);
    cl_expect_error(c, LLM__ERROR__CODE__INVALID_ARGUMENT, "top_p");
    sp.top_p = 0;
    /* A max_tokens past the context is clamped (docs/protocol.md, "The
     * prompt"); a prompt that fills the context is refused. */
    static char longp[4096];
    for (size_t k = 0; k + 8 < sizeof longp; k += 8) memcpy(longp + k, "cat dog ", 9);
    g.prompt = longp;
    cl_send(c, &ge);
    cl_expect_error(c, LLM__ERROR__CODE__INVALID_ARGUMENT, "fill the context");
    g.prompt = "Once upon a time";
    g.model = "other.gguf";
    cl_send(c, &ge);
    cl_expect_error(c, LLM__ERROR__CODE__NOT_FOUND, "other.gguf");
    /* The refusal quotes 128 bytes of the model's name, which cut its é
     * in two: the reply keeps whole characters (the client's library
     * refuses a reply that is not UTF-8). */
    static char longm[160];
    memset(longm, 'm', 127);
    memcpy(longm + 127, "\xc3\xa9tail", 6);
    g.model = longm;
    cl_send(c, &ge);
    cl_expect_error(c, LLM__ERROR__CODE__NOT_FOUND, "mmmm\" is not served here");
    g.model = "";
    g.request_id = "bad id";
    cl_send(c, &ge);
    cl_expect_error(c, LLM__ERROR__CODE__INVALID_ARGUMENT, NULL);
    Llm__Cancel cc = LLM__CANCEL__INIT;
    cc.request_id = "nobody";
    Llm__ClientEnvelope cancel = LLM__CLIENT_ENVELOPE__INIT;
    cancel.body_case = LLM__CLIENT_ENVELOPE__BODY_CANCEL;
    cancel.cancel = &cc;
    cl_send(c, &cancel);
    cl_expect_error(c, LLM__ERROR__CODE__NOT_FOUND, "nobody");
    /* A worker's garbage too. */
    struct zio_frame wj = {"\x01\x02", 2, NULL, NULL};
    zio_send(w.d, &wj, 1, 0);
    Llm__WorkerEnvelope *we = fw_recv(&w, 3000);
    ASSERT_TRUE(we != NULL);
    ASSERT_EQ((int)LLM__WORKER_ENVELOPE__BODY_ERROR, (int)we->body_case);
    proto_worker_free(we);

    /* Still serving. */
    Llm__ClientEnvelope h = LLM__CLIENT_ENVELOPE__INIT;
    h.tag = 9;
    h.body_case = LLM__CLIENT_ENVELOPE__BODY_HEALTH;
    h.health = &hr;
    cl_send(c, &h);
    Llm__ClientEnvelope *e = cl_expect(c, LLM__CLIENT_ENVELOPE__BODY_HEALTH_REPLY);
    ASSERT_EQ((uint64_t)9, (uint64_t)e->tag);
    ASSERT_EQ((int)LLM__HEALTH_REPLY__SERVING_STATUS__SERVING, (int)e->health_reply->status);
    proto_client_free(e);
    Llm__StatusRequest sr = LLM__STATUS_REQUEST__INIT;
    h.body_case = LLM__CLIENT_ENVELOPE__BODY_STATUS;
    h.status = &sr;
    cl_send(c, &h);
    e = cl_expect(c, LLM__CLIENT_ENVELOPE__BODY_STATUS_REPLY);
    ASSERT_TRUE(e->status_reply->frames_rejected >= 4);
    proto_client_free(e);
    zio_sock_close(c);
    fw_close(&w);
    fx_stop(&f);
}

TEST(router_server_refuses_without_a_pipeline) {
    struct fx f;
    fx_start(&f, 2000, 100);
    struct zio_sock *c = cl_open(&f);
    /* No worker: nothing could run it, so it is not accepted; the client
     * hears why and when to retry. */
    cl_generate(c, 1, "np-1", prompt3, 3, 4, 0);
    Llm__ClientEnvelope *e = cl_expect(c, LLM__CLIENT_ENVELOPE__BODY_ERROR);
    ASSERT_EQ((int)LLM__ERROR__CODE__UNAVAILABLE, (int)e->error->code);
    ASSERT_TRUE(e->error->retry_after_ms > 0);
    ASSERT_STREQ("np-1", e->error->request_id);
    ASSERT_TRUE(strstr(e->error->message, "no pipeline is in service") != NULL);
    ASSERT_TRUE(strstr(e->error->message, "no worker is registered") != NULL);
    proto_client_free(e);
    ASSERT_EQ((int)LLM__HEALTH_REPLY__SERVING_STATUS__NOT_SERVING, (int)cl_health(c));
    /* Nothing was stored: the same id is a new request once a pipeline serves. */
    struct fw w;
    fw_open(&f, &w, "late");
    cl_generate(c, 2, "np-1", prompt3, 3, 4, 0);
    e = cl_expect(c, LLM__CLIENT_ENVELOPE__BODY_ACCEPTED);
    ASSERT_TRUE(!e->accepted->reattached);
    proto_client_free(e);
    Llm__WorkerEnvelope *pe = fw_plan(&w);
    ASSERT_EQ((size_t)1, pe->plan->n_seqs);
    proto_worker_free(pe);
    zio_sock_close(c);
    fw_close(&w);
    fx_stop(&f);
}

TEST(router_server_queue_is_bounded) {
    struct fx f;
    fx_start(&f, 2000, 2);
    struct fw w;
    fw_open(&f, &w, "w1");
    struct zio_sock *c = cl_open(&f);
    /* The first request's step stays in flight (the worker does not
     * answer), so the ones after it wait. */
    cl_generate(c, 1, "q1", prompt3, 3, 4, 0);
    proto_client_free(cl_expect(c, LLM__CLIENT_ENVELOPE__BODY_ACCEPTED));
    Llm__WorkerEnvelope *pe = fw_plan(&w);
    ASSERT_EQ((size_t)1, pe->plan->n_seqs);
    proto_worker_free(pe);
    cl_generate(c, 2, "q2", prompt3, 3, 4, 0);
    proto_client_free(cl_expect(c, LLM__CLIENT_ENVELOPE__BODY_ACCEPTED));
    cl_generate(c, 3, "q3", prompt3, 3, 4, 0);
    Llm__ClientEnvelope *e = cl_expect(c, LLM__CLIENT_ENVELOPE__BODY_ACCEPTED);
    ASSERT_EQ(1u, e->accepted->queue_position);
    proto_client_free(e);
    cl_generate(c, 4, "q4", prompt3, 3, 4, 0);
    e = cl_expect(c, LLM__CLIENT_ENVELOPE__BODY_ERROR);
    ASSERT_EQ((int)LLM__ERROR__CODE__RESOURCE_EXHAUSTED, (int)e->error->code);
    ASSERT_TRUE(e->error->retry_after_ms > 0);
    ASSERT_STREQ("q4", e->error->request_id);
    proto_client_free(e);
    zio_sock_close(c);
    fw_close(&w);
    fx_stop(&f);
}

TEST(router_server_stop_string_and_deadline) {
    struct fx f;
    fx_start(&f, 2000, 100);
    struct fw w;
    fw_open(&f, &w, "w1");
    struct zio_sock *c = cl_open(&f), *c0 = cl_open(&f);
    /* A deadline passes while the request waits for its turn: the
     * pipeline's one step in flight holds another request, unanswered. */
    cl_generate(c0, 1, "dl-0", prompt3, 3, 4, 0);
    proto_client_free(cl_expect(c0, LLM__CLIENT_ENVELOPE__BODY_ACCEPTED));
    Llm__WorkerEnvelope *held = fw_plan(&w);
    Llm__GenerateRequest g = LLM__GENERATE_REQUEST__INIT;
    g.request_id = "dl-1";
    g.prompt = "Once upon a time";
    g.max_tokens = 10;
    g.timeout_ms = 150;
    g.stream = true;
    Llm__ClientEnvelope env = LLM__CLIENT_ENVELOPE__INIT;
    env.body_case = LLM__CLIENT_ENVELOPE__BODY_GENERATE;
    env.generate = &g;
    cl_send(c, &env);
    Llm__ClientEnvelope *e = cl_expect(c, LLM__CLIENT_ENVELOPE__BODY_ACCEPTED);
    ASSERT_EQ(5u, e->accepted->prompt_tokens); /* BOS + 4, as llama.cpp */
    ASSERT_EQ(403, e->accepted->prompt_token_ids[1]);
    proto_client_free(e);
    int64_t t0 = t_ms();
    e = cl_expect(c, LLM__CLIENT_ENVELOPE__BODY_DONE);
    ASSERT_EQ((int)LLM__GENERATE_DONE__FINISH_REASON__DEADLINE, (int)e->done->finish_reason);
    ASSERT_EQ((int)LLM__ERROR__CODE__DEADLINE_EXCEEDED, (int)e->done->error->code);
    ASSERT_TRUE(t_ms() - t0 < 1000);
    proto_client_free(e);
    Llm__Cancel cm = LLM__CANCEL__INIT;
    cm.request_id = "dl-0";
    Llm__ClientEnvelope ce = LLM__CLIENT_ENVELOPE__INIT;
    ce.body_case = LLM__CLIENT_ENVELOPE__BODY_CANCEL;
    ce.cancel = &cm;
    cl_send(c0, &ce);
    proto_client_free(cl_expect(c0, LLM__CLIENT_ENVELOPE__BODY_DONE));
    fw_answer(&w, held->plan, 500);
    proto_worker_free(held);
    zio_sock_close(c0);

    /* A stop string across two tokens: the text stops before it, and the
     * part of it sent early is held back. */
    char *stops[1] = {"a lit"};
    g.request_id = "st-1";
    g.timeout_ms = 0;
    g.n_stop = 1;
    g.stop = stops;
    cl_send(c, &env);
    proto_client_free(cl_expect(c, LLM__CLIENT_ENVELOPE__BODY_ACCEPTED));
    const int32_t pieces[6] = {432, 383, 286, 261, 376, 298}; /* ", there was a little" */
    char text[256] = "";
    int n_tokens = 0;
    for (int k = 0; k < 6; k++) {
        Llm__WorkerEnvelope *pe = fw_plan(&w);
        fw_answer(&w, pe->plan, pieces[k]);
        proto_worker_free(pe);
        /* Everything this token caused (a chunk, perhaps the end). */
        while ((e = cl_recv(c, 300)) != NULL) {
            if (e->body_case == LLM__CLIENT_ENVELOPE__BODY_CHUNK) {
                strncat(text, e->chunk->text, sizeof text - strlen(text) - 1);
                n_tokens += (int)e->chunk->n_token_ids;
            } else if (e->body_case == LLM__CLIENT_ENVELOPE__BODY_DONE) {
                ASSERT_EQ((int)LLM__GENERATE_DONE__FINISH_REASON__STOP, (int)e->done->finish_reason);
                ASSERT_STREQ("a lit", e->done->stop_string);
                ASSERT_EQ(5u, e->done->usage->completion_tokens);
                proto_client_free(e);
                goto finished;
            }
            proto_client_free(e);
        }
        /* Until the stop string is complete, the "a" of " a" is held back. */
        if (k == 3) ASSERT_STREQ(", there was ", text);
    }
    TEST_FAIL("no GenerateDone after the stop string");
finished:
    ASSERT_STREQ(", there was ", text);
    ASSERT_EQ(5, n_tokens);
    zio_sock_close(c);
    fw_close(&w);
    fx_stop(&f);
}

TEST_MAIN(router_server_generates_and_streams, router_server_refuses_without_a_pipeline,
          router_server_stop_string_and_deadline, router_server_refuses_bad_input_and_keeps_serving,
          router_server_queue_is_bounded)
