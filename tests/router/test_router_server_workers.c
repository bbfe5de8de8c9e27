/* Tests of the router (router/server*.c in-process,
 * tests/router/router_server_fixture.h) when its workers are lost or
 * register again: a held stage is retried, a client hears that its request
 * stalled, a request resumes exactly once on a new worker, a new session
 * or a closed stage connection re-forms the pipeline at once, and
 * --spin-us auto spins while a GPU worker is there. */
#include "tests/router/router_server_fixture.h"

/* A worker placed in a stage another live worker holds (a replacement
 * started before the router gave up the old one) is told to try again, not
 * refused for good: it gets the slot once the holder is lost. */
TEST(router_server_held_stage_is_retried) {
    struct fx f;
    fx_start(&f, 2000, 100);
    struct fw a, b;
    fw_open(&f, &a, "holder");
    Llm__WorkerEnvelope *rep = fw_register(&f, &b, "replacement");
    ASSERT_TRUE(!rep->register_reply->accepted);
    ASSERT_TRUE(rep->register_reply->error != NULL);
    ASSERT_TRUE(rep->register_reply->error->retry_after_ms > 0);
    ASSERT_TRUE(strstr(rep->register_reply->error->message, "is held by worker holder") != NULL);
    proto_worker_free(rep);
    fw_close(&b);
    fw_close(&a);
    fx_stop(&f);
}

TEST(router_server_tells_a_stalled_request) {
    struct fx f;
    fx_start(&f, 300, 100);
    struct fw a;
    fw_open(&f, &a, "wa");
    struct zio_sock *c = cl_open(&f);
    cl_generate(c, 1, "st-1", prompt3, 3, 6, 0);
    proto_client_free(cl_expect(c, LLM__CLIENT_ENVELOPE__BODY_ACCEPTED));
    Llm__WorkerEnvelope *pe = fw_plan(&a);
    fw_answer(&a, pe->plan, 500);
    proto_worker_free(pe);
    proto_client_free(cl_expect(c, LLM__CLIENT_ENVELOPE__BODY_CHUNK));
    /* The only worker dies: the request is kept, and its client hears
     * that nothing can run it now (so its own bound on waiting applies). */
    fw_close(&a);
    int64_t t0 = t_ms();
    Llm__ClientEnvelope *e = cl_recv(c, 3000);
    ASSERT_TRUE(e != NULL);
    ASSERT_EQ((int)LLM__CLIENT_ENVELOPE__BODY_ERROR, (int)e->body_case);
    ASSERT_EQ((int)LLM__ERROR__CODE__UNAVAILABLE, (int)e->error->code);
    ASSERT_TRUE(e->error->retry_after_ms > 0);
    ASSERT_STREQ("st-1", e->error->request_id);
    ASSERT_TRUE(strstr(e->error->message, "accepted and kept") != NULL);
    ASSERT_TRUE(t_ms() - t0 < 2500);
    proto_client_free(e);
    /* A re-attach meanwhile gets the same answer, not an Accepted that
     * would keep the client waiting for nothing. */
    cl_generate(c, 2, "st-1", prompt3, 3, 6, 1);
    cl_expect_error(c, LLM__ERROR__CODE__UNAVAILABLE, "no pipeline is in service");
    /* A worker joins: the re-attach is accepted and the request resumes. */
    struct fw b;
    fw_open(&f, &b, "wb");
    cl_generate(c, 3, "st-1", prompt3, 3, 6, 1);
    e = cl_expect(c, LLM__CLIENT_ENVELOPE__BODY_ACCEPTED);
    ASSERT_TRUE(e->accepted->reattached);
    proto_client_free(e);
    pe = fw_plan(&b);
    ASSERT_EQ((size_t)4, pe->plan->seqs[0]->n_tokens);
    proto_worker_free(pe);
    zio_sock_close(c);
    fw_close(&b);
    fx_stop(&f);
}

TEST(router_server_worker_loss_resumes_exactly_once) {
    struct fx f;
    fx_start(&f, 300, 100);
    struct fw a;
    fw_open(&f, &a, "wa");
    struct zio_sock *c = cl_open(&f);
    cl_generate(c, 1, "loss-1", prompt3, 3, 6, 0);
    proto_client_free(cl_expect(c, LLM__CLIENT_ENVELOPE__BODY_ACCEPTED));
    for (int k = 0; k < 3; k++) {
        Llm__WorkerEnvelope *pe = fw_plan(&a);
        fw_answer(&a, pe->plan, 500 + k);
        proto_worker_free(pe);
    }
    /* The fourth plan is never answered: the worker dies. */
    proto_worker_free(fw_plan(&a));
    fw_close(&a);
    usleep(700 * 1000);
    struct fw b;
    fw_open(&f, &b, "wb");
    Llm__WorkerEnvelope *pe = fw_plan(&b);
    const Llm__SeqPlan *sp = pe->plan->seqs[0];
    /* Recomputed from the prompt and the tokens generated so far. */
    ASSERT_EQ(0u, sp->start_pos);
    ASSERT_EQ((size_t)6, sp->n_tokens);
    ASSERT_EQ(502, sp->tokens[5]);
    ASSERT_TRUE(sp->want_logits);
    fw_answer(&b, pe->plan, 503);
    proto_worker_free(pe);
    for (int k = 4; k < 6; k++) {
        pe = fw_plan(&b);
        fw_answer(&b, pe->plan, 500 + k);
        proto_worker_free(pe);
    }
    int32_t got[8];
    for (int i = 0; i < 8; i++) got[i] = -1;
    int count = 0;
    Llm__ClientEnvelope *e = cl_collect(c, got, &count, 8);
    ASSERT_EQ(6, count); /* every token once */
    for (int i = 0; i < 6; i++) ASSERT_EQ(500 + i, got[i]);
    ASSERT_EQ(6u, e->done->usage->completion_tokens);
    proto_client_free(e);
    zio_sock_close(c);
    fw_close(&b);
    fx_stop(&f);
}

/* A worker whose connection broke registers again under a new session
 * (Register.session): a plan or a result on the old connection may be
 * lost, so the router re-forms the pipeline in a new epoch and the
 * sequence starts over there at once, not after --step-timeout-ms (10 s
 * here).  A Register of the same session is a resend: the same epoch. */
TEST(router_server_new_session_reforms) {
    struct fx f;
    fx_start(&f, 2000, 100);
    struct fw w;
    memset(&w, 0, sizeof w);
    fw_connect(&f, &w, "ws");
    Llm__WorkerEnvelope *rep = fw_register_as(&w, 0, 1, 1);
    ASSERT_TRUE(rep->register_reply->accepted);
    uint64_t e1 = rep->register_reply->epoch;
    proto_worker_free(rep);
    rep = fw_register_as(&w, 0, 1, 1);
    ASSERT_TRUE(rep->register_reply->accepted);
    ASSERT_EQ(e1, rep->register_reply->epoch);
    proto_worker_free(rep);
    fw_heartbeat(&w);
    fw_wait_serving(&f, &w);
    struct zio_sock *c = cl_open(&f);
    cl_generate(c, 1, "session-1", prompt3, 3, 4, 0);
    proto_client_free(cl_expect(c, LLM__CLIENT_ENVELOPE__BODY_ACCEPTED));
    Llm__WorkerEnvelope *pe = fw_plan(&w);
    ASSERT_EQ(e1, pe->plan->epoch);
    fw_answer(&w, pe->plan, 440);
    proto_worker_free(pe);
    /* The second plan is lost with the connection. */
    proto_worker_free(fw_plan(&w));
    fw_close(&w);
    int64_t t0 = t_ms();
    fw_connect(&f, &w, "ws");
    rep = fw_register_as(&w, 0, 1, 2);
    ASSERT_TRUE(rep->register_reply->accepted);
    uint64_t e2 = rep->register_reply->epoch;
    ASSERT_TRUE(e2 > e1);
    proto_worker_free(rep);
    pe = fw_plan(&w);
    /* e2, or a later epoch: the socket monitor reports the old
     * connection's close on its own schedule, and when that comes after
     * the Register the pipeline re-forms once more. */
    ASSERT_TRUE(pe->plan->epoch >= e2);
    const Llm__SeqPlan *sp = pe->plan->seqs[0];
    /* From the start: the prompt and the token streamed before. */
    ASSERT_EQ(0u, sp->start_pos);
    ASSERT_EQ((size_t)4, sp->n_tokens);
    ASSERT_EQ(440, sp->tokens[3]);
    fw_answer(&w, pe->plan, 441);
    proto_worker_free(pe);
    for (int k = 2; k < 4; k++) {
        pe = fw_plan(&w);
        fw_answer(&w, pe->plan, 440 + k);
        proto_worker_free(pe);
    }
    int32_t got[8];
    for (int i = 0; i < 8; i++) got[i] = -1;
    int count = 0;
    Llm__ClientEnvelope *e = cl_collect(c, got, &count, 8);
    int64_t took = t_ms() - t0;
    ASSERT_EQ(4, count); /* every token once */
    for (int i = 0; i < 4; i++) ASSERT_EQ(440 + i, got[i]);
    ASSERT_EQ((int)LLM__GENERATE_DONE__FINISH_REASON__LENGTH, (int)e->done->finish_reason);
    proto_client_free(e);
    ASSERT_TRUE(took < 3000);
    zio_sock_close(c);
    fw_close(&w);
    fx_stop(&f);
}

/* A stage whose connection closes while a step runs (a worker killed) must
 * neither hold its pipeline until its Redis key expires nor miss a free
 * (it would keep the sequence's blocks).  Two stages; stage 0's connection
 * closes while the last step of a request runs.  The router's socket
 * monitor reports the close and the pipeline re-forms at once: stage 1
 * hears of a new epoch (in which a stage forgets every sequence of the old
 * one) before it answers, its answer of the old epoch is ignored, and the
 * request resumes from its one token once stage 0 registers on a new
 * connection.  (Before the monitor, stage 1's answer ended the request and
 * the frees-only plan that followed could not be queued for stage 0,
 * ZMQ_ROUTER_MANDATORY, which re-formed the pipeline: that path remains for
 * a connection ZeroMQ dropped before the router saw it close.) */
TEST(router_server_unsent_frees_reform) {
    struct fx f;
    fx_start(&f, 2000, 100);
    struct fw a, b;
    memset(&a, 0, sizeof a);
    memset(&b, 0, sizeof b);
    fw_connect(&f, &a, "fa");
    Llm__WorkerEnvelope *rep = fw_register_as(&a, 0, 2, 1);
    ASSERT_TRUE(rep->register_reply->accepted);
    proto_worker_free(rep);
    fw_connect(&f, &b, "fb");
    rep = fw_register_as(&b, 1, 2, 1);
    ASSERT_TRUE(rep->register_reply->accepted && rep->register_reply->pipeline_whole);
    uint64_t e1 = rep->register_reply->epoch;
    proto_worker_free(rep);
    fw_heartbeat(&a);
    fw_heartbeat(&b);
    fw_wait_serving(&f, &a);
    struct zio_sock *c = cl_open(&f);
    cl_generate(c, 1, "frees-1", prompt3, 3, 2, 0);
    proto_client_free(cl_expect(c, LLM__CLIENT_ENVELOPE__BODY_ACCEPTED));
    Llm__WorkerEnvelope *pa = fw_plan(&a), *pb = fw_plan(&b);
    ASSERT_EQ(pa->plan->step_id, pb->plan->step_id);
    ASSERT_EQ(e1, pb->plan->epoch);
    fw_answer_at(&b, pb->plan, 450, 1);
    proto_worker_free(pa);
    proto_worker_free(pb);
    pa = fw_plan(&a);
    pb = fw_plan(&b);
    proto_worker_free(pa);
    int64_t closed = t_ms();
    fw_close(&a);
    uint64_t e2 = 0;
    for (int i = 0; i < 10 && !e2; i++) {
        Llm__WorkerEnvelope *m = fw_recv(&b, 3000);
        if (!m) break;
        if (m->body_case == LLM__WORKER_ENVELOPE__BODY_REGISTER_REPLY && m->register_reply->accepted &&
            m->register_reply->epoch > e1)
            e2 = m->register_reply->epoch;
        proto_worker_free(m);
    }
    if (!e2) TEST_FAIL("stage 1 heard of no new epoch after stage 0's connection closed");
    int64_t reformed = t_ms() - closed;
    printf("  stage 0's connection closed: stage 1 heard of the new epoch %lld ms later\n", (long long)reformed);
    ASSERT_TRUE(reformed < 1000); /* not the 2 s worker timeout, nor a Redis key's 3 heartbeats */
    fw_answer_at(&b, pb->plan, 451, 1); /* of the old epoch: ignored */
    proto_worker_free(pb);
    /* Stage 0 on a new connection: the pipeline serves in a newer epoch,
     * and the request's last step runs again there. */
    fw_connect(&f, &a, "fa");
    rep = fw_register_as(&a, 0, 2, 2);
    ASSERT_TRUE(rep->register_reply->accepted);
    uint64_t e3 = rep->register_reply->epoch;
    ASSERT_TRUE(e3 > e2);
    proto_worker_free(rep);
    fw_heartbeat(&a);
    fw_heartbeat(&b);
    fw_wait_serving(&f, &a);
    pa = fw_plan(&a);
    pb = fw_plan(&b);
    ASSERT_EQ(e3, pb->plan->epoch);
    fw_answer_at(&b, pb->plan, 451, 1);
    proto_worker_free(pa);
    proto_worker_free(pb);
    /* The client sees 450 and 451 once each (a stall notice between them,
     * UNAVAILABLE, is allowed: the pipeline was out of service). */
    int32_t got[4] = {-1, -1, -1, -1};
    int count = 0;
    Llm__ClientEnvelope *e = NULL;
    for (;;) {
        e = cl_recv(c, 3000);
        if (!e) TEST_FAIL("frees-1: no chunk or done");
        if (e->body_case == LLM__CLIENT_ENVELOPE__BODY_DONE) break;
        if (e->body_case == LLM__CLIENT_ENVELOPE__BODY_ERROR && e->error->code == LLM__ERROR__CODE__UNAVAILABLE) {
            proto_client_free(e);
            continue;
        }
        if (e->body_case != LLM__CLIENT_ENVELOPE__BODY_CHUNK) TEST_FAIL("unexpected body %d", (int)e->body_case);
        for (size_t i = 0; i < e->chunk->n_token_ids; i++) {
            int idx = (int)e->chunk->index + (int)i;
            if (idx < 4) got[idx] = e->chunk->token_ids[i];
            count++;
        }
        proto_client_free(e);
    }
    ASSERT_EQ(2, count);
    ASSERT_EQ(450, got[0]);
    ASSERT_EQ(451, got[1]);
    proto_client_free(e);
    cl_generate(c, 2, "frees-2", prompt3, 3, 1, 0);
    proto_client_free(cl_expect(c, LLM__CLIENT_ENVELOPE__BODY_ACCEPTED));
    pa = fw_plan(&a);
    pb = fw_plan(&b);
    ASSERT_EQ(e3, pa->plan->epoch);
    ASSERT_EQ(e3, pb->plan->epoch);
    fw_answer_at(&b, pb->plan, 452, 1);
    proto_worker_free(pa);
    proto_worker_free(pb);
    got[0] = -1;
    count = 0;
    e = cl_collect(c, got, &count, 4);
    ASSERT_EQ(1, count);
    proto_client_free(e);
    zio_sock_close(c);
    fw_close(&a);
    fw_close(&b);
    fx_stop(&f);
}

/* The router's lines about --spin-us auto, counted from its log. */
static pthread_mutex_t spin_lock = PTHREAD_MUTEX_INITIALIZER;
static int spin_on, spin_off;
static void spin_log(int level, const char *line, void *ud) {
    (void)level;
    (void)ud;
    pthread_mutex_lock(&spin_lock);
    if (strstr(line, "spinning up to 3000 us in waits for workers")) spin_on++;
    if (strstr(line, "waits for workers block at once")) spin_off++;
    pthread_mutex_unlock(&spin_lock);
}
static int spin_count(const int *n) {
    pthread_mutex_lock(&spin_lock);
    int v = *n;
    pthread_mutex_unlock(&spin_lock);
    return v;
}

/* --spin-us auto: the router's waits for workers spin once a GPU worker
 * holds a stage, and block again once it is lost. */
TEST(router_server_spin_auto_follows_gpu_workers) {
    struct fx f;
    fx_start(&f, 2000, 100);
    /* Again with auto, its lines counted (the loop is stopped meanwhile). */
    fx_server_stop(&f);
    spin_on = spin_off = 0;
    log_set_callback(spin_log, NULL);
    log_set_level(LL_INFO);
    f.spin_us = -1;
    fx_server_start(&f, 2000, 100);
    struct fw w;
    memset(&w, 0, sizeof w);
    fw_connect(&f, &w, "gpu-w");
    w.backend = "cuda";
    Llm__WorkerEnvelope *rep = fw_register_as(&w, 0, 1, 0);
    ASSERT_TRUE(rep->register_reply->accepted);
    proto_worker_free(rep);
    int64_t end = t_ms() + 10000;
    while (spin_count(&spin_on) == 0 && t_ms() < end) {
        fw_heartbeat(&w);
        usleep(20 * 1000);
    }
    ASSERT_EQ(1, spin_count(&spin_on));
    /* Silent past --worker-timeout-ms: lost, and the waits block again. */
    end = t_ms() + 20000;
    while (spin_count(&spin_off) == 0 && t_ms() < end) usleep(20 * 1000);
    ASSERT_EQ(1, spin_count(&spin_off));
    fw_close(&w);
    fx_server_stop(&f);
    log_set_callback(NULL, NULL);
    log_set_level(LL_WARN);
    fx_stop(&f);
}

TEST_MAIN(router_server_held_stage_is_retried, router_server_tells_a_stalled_request,
          router_server_worker_loss_resumes_exactly_once, router_server_new_session_reforms,
          router_server_unsent_frees_reform, router_server_spin_auto_follows_gpu_workers)
