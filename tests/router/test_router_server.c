/* Tests of the router's event loop (router/server*.c) in-process, against a
 * real redis-server, with fake workers and clients on ZeroMQ sockets: the
 * test plays the last stage and picks every token, so it can check plans,
 * streams, re-attach, cancel, a worker lost mid-stream, a router restart,
 * the bounded queue, a request refused while no pipeline serves, and the
 * refusal of malformed frames. */
#include "router/server.h"

#include <pthread.h>
#include <signal.h>
#include <stdbool.h>
#include <time.h>
#include <unistd.h>

#include "common/log.h"
#include "common/rconn.h"
#include "common/status.h"
#include "common/tokenizer.h"
#include "common/zio.h"
#include "proto/wire.h"
#include "tests/redis_fixture.h"
#include "tests/test.h"

struct fx {
    struct redis_fixture r;
    server *s;
    pthread_t th;
    volatile sig_atomic_t stop;
    void *ctx;
    char cep[128], wep[128];
    int running;
};

static void *fx_thread(void *arg) {
    struct fx *f = arg;
    server_run(f->s, &f->stop);
    return NULL;
}

static void fx_server_start(struct fx *f, int worker_timeout_ms, int max_queue) {
    struct server_config c = {0};
    c.model_path = test_model_path("stories260K-f32.gguf");
    c.listen = "tcp://127.0.0.1:*";
    c.worker_listen = "tcp://127.0.0.1:*";
    c.redis_url = f->r.url_auth; /* f->r.url unless the fixture requires a password */
    c.redis_prefix = "llm:";
    c.router_id = "r";
    c.max_queue = max_queue;
    c.step_tokens = 64;
    c.max_batch = 8;
    c.heartbeat_ms = 100;
    c.worker_timeout_ms = worker_timeout_ms;
    c.step_timeout_ms = 10000;
    c.stages = 1;
    c.retention_s = 60;
    c.insecure = true; /* the test's workers and clients are plain sockets */
    char err[512];
    if (server_init(&f->s, &c, err, sizeof err) < 0) TEST_FAIL("server_init: %s", err);
    snprintf(f->cep, sizeof f->cep, "%s", server_client_endpoint(f->s));
    snprintf(f->wep, sizeof f->wep, "%s", server_worker_endpoint(f->s));
    f->stop = 0;
    pthread_create(&f->th, NULL, fx_thread, f);
    f->running = 1;
}

static void fx_server_stop(struct fx *f) {
    if (!f->running) return;
    f->stop = 1;
    pthread_join(f->th, NULL);
    server_free(f->s);
    f->s = NULL;
    f->running = 0;
}

/* redis_flags: FIXTURE_REDIS_* for the private Redis. */
static void fx_start_redis(struct fx *f, int worker_timeout_ms, int max_queue, int redis_flags) {
    memset(f, 0, sizeof *f);
    log_set_level(getenv("TEST_LOG_DEBUG") ? LL_DEBUG : LL_WARN);
    test_model_path("stories260K-f32.gguf"); /* skips before Redis starts */
    fixture_redis_start(&f->r, redis_flags);
    f->ctx = zmq_ctx_new();
    fx_server_start(f, worker_timeout_ms, max_queue);
}

static void fx_start(struct fx *f, int worker_timeout_ms, int max_queue) {
    fx_start_redis(f, worker_timeout_ms, max_queue, 0);
}

static void fx_stop(struct fx *f) {
    fx_server_stop(f);
    zmq_ctx_term(f->ctx);
    ASSERT_OK(fixture_redis_stop(&f->r));
}

static int64_t t_ms(void) {
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (int64_t)ts.tv_sec * 1000 + ts.tv_nsec / 1000000;
}

/* ---- a client ------------------------------------------------------------ */

static struct zio_sock *cl_open(struct fx *f) {
    struct zio_sock *d;
    char err[256];
    if (zio_sock_open(f->ctx, ZMQ_DEALER, &d, err, sizeof err) < 0) TEST_FAIL("%s", err);
    zio_set_int(d, ZMQ_LINGER, 0);
    if (zio_connect(d, f->cep) < 0) TEST_FAIL("%s", zio_errstr(d));
    return d;
}

static void cl_send(struct zio_sock *d, Llm__ClientEnvelope *env) {
    uint8_t *buf;
    size_t len;
    char err[256];
    if (proto_client_pack(env, &buf, &len, err, sizeof err) < 0) TEST_FAIL("pack: %s", err);
    struct zio_frame fr = {buf, len, proto_buf_free, NULL};
    if (zio_send(d, &fr, 1, 0) < 0) TEST_FAIL("send: %s", zio_errstr(d));
}

static Llm__ClientEnvelope *cl_recv(struct zio_sock *d, int timeout_ms) {
    struct zio_parts p = {0};
    if (zio_recv(d, &p, timeout_ms) < 0) {
        zio_parts_free(&p);
        return NULL;
    }
    Llm__ClientEnvelope *env = NULL;
    char err[256];
    int rc = proto_client_unpack(zio_parts_data(&p, 0), zio_parts_size(&p, 0), &env, err, sizeof err);
    zio_parts_free(&p);
    if (rc < 0) TEST_FAIL("client unpack: %s", err);
    return env;
}

/* Sends a generate request; prompt tokens or text. */
static void cl_generate(struct zio_sock *d, uint64_t tag, const char *id, const int32_t *toks, size_t n,
                        uint32_t max_tokens, uint32_t resume_from) {
    Llm__GenerateRequest g = LLM__GENERATE_REQUEST__INIT;
    g.request_id = (char *)id;
    g.prompt_tokens = (int32_t *)toks;
    g.n_prompt_tokens = n;
    g.max_tokens = max_tokens;
    g.stream = true;
    g.resume_from = resume_from;
    Llm__SamplingParams sp = LLM__SAMPLING_PARAMS__INIT;
    sp.seed = 42;
    g.sampling = &sp;
    Llm__ClientEnvelope env = LLM__CLIENT_ENVELOPE__INIT;
    env.tag = tag;
    env.body_case = LLM__CLIENT_ENVELOPE__BODY_GENERATE;
    env.generate = &g;
    cl_send(d, &env);
}

static Llm__ClientEnvelope *cl_expect(struct zio_sock *d, Llm__ClientEnvelope__BodyCase body) {
    Llm__ClientEnvelope *e = cl_recv(d, 3000);
    if (!e) TEST_FAIL("no reply (expected body %d)", (int)body);
    if (e->body_case != body) {
        int got = (int)e->body_case;
        const char *msg = e->body_case == LLM__CLIENT_ENVELOPE__BODY_ERROR ? e->error->message : "";
        TEST_FAIL("expected body %d, got %d %s", (int)body, got, msg);
    }
    return e;
}

static void cl_expect_error(struct zio_sock *d, Llm__Error__Code code, const char *needle) {
    Llm__ClientEnvelope *e = cl_expect(d, LLM__CLIENT_ENVELOPE__BODY_ERROR);
    int c = (int)e->error->code;
    char msg[512];
    snprintf(msg, sizeof msg, "%s", e->error->message);
    proto_client_free(e);
    if (c != (int)code) TEST_FAIL("expected error code %d, got %d: %s", (int)code, c, msg);
    if (needle && !strstr(msg, needle)) TEST_FAIL("error \"%s\" does not name \"%s\"", msg, needle);
}

/* ---- a fake worker (one stage = first and last) --------------------------- */

struct fw {
    struct zio_sock *d;
    char id[32];
    int64_t last_hb;
    int silent;
};

static void fw_send(struct fw *w, Llm__WorkerEnvelope *env) {
    uint8_t *buf;
    size_t len;
    char err[256];
    if (proto_worker_pack(env, &buf, &len, err, sizeof err) < 0) TEST_FAIL("pack: %s", err);
    struct zio_frame fr = {buf, len, proto_buf_free, NULL};
    zio_send(w->d, &fr, 1, 0);
}

static void fw_heartbeat(struct fw *w) {
    Llm__Heartbeat hb = LLM__HEARTBEAT__INIT;
    hb.worker_id = w->id;
    hb.incarnation = 7;
    hb.state = LLM__HEARTBEAT__STATE__READY;
    Llm__WorkerEnvelope env = LLM__WORKER_ENVELOPE__INIT;
    env.body_case = LLM__WORKER_ENVELOPE__BODY_HEARTBEAT;
    env.heartbeat = &hb;
    fw_send(w, &env);
    w->last_hb = t_ms();
}

/* Receives the next envelope, heartbeating meanwhile. */
static Llm__WorkerEnvelope *fw_recv(struct fw *w, int timeout_ms) {
    int64_t end = t_ms() + timeout_ms;
    while (t_ms() < end) {
        if (!w->silent && t_ms() - w->last_hb >= 50) fw_heartbeat(w);
        struct zio_parts p = {0};
        if (zio_recv(w->d, &p, 20) == 0) {
            Llm__WorkerEnvelope *env = NULL;
            char err[256];
            int rc = proto_worker_unpack(zio_parts_data(&p, 0), zio_parts_size(&p, 0), &env, err, sizeof err);
            zio_parts_free(&p);
            if (rc < 0) TEST_FAIL("worker unpack: %s", err);
            return env;
        }
        zio_parts_free(&p);
    }
    return NULL;
}

static Llm__HealthReply__ServingStatus cl_health(struct zio_sock *c) {
    Llm__HealthRequest hr = LLM__HEALTH_REQUEST__INIT;
    Llm__ClientEnvelope h = LLM__CLIENT_ENVELOPE__INIT;
    h.body_case = LLM__CLIENT_ENVELOPE__BODY_HEALTH;
    h.health = &hr;
    cl_send(c, &h);
    Llm__ClientEnvelope *e = cl_expect(c, LLM__CLIENT_ENVELOPE__BODY_HEALTH_REPLY);
    Llm__HealthReply__ServingStatus st = e->health_reply->status;
    proto_client_free(e);
    return st;
}

/* Heartbeats until the router serves (some pipeline is in service): it
 * refuses new requests before that. */
static void fw_wait_serving(struct fx *f, struct fw *w) {
    struct zio_sock *c = cl_open(f);
    int64_t end = t_ms() + 3000;
    while (cl_health(c) != LLM__HEALTH_REPLY__SERVING_STATUS__SERVING) {
        if (t_ms() > end) TEST_FAIL("worker %s: the router does not serve after 3 s", w->id);
        usleep(20 * 1000);
        fw_heartbeat(w);
    }
    zio_sock_close(c);
}

/* Sends w's Register for stage (of stages) of pipeline 0 under session
 * on its socket; returns the router's RegisterReply. */
static Llm__WorkerEnvelope *fw_register_as(struct fw *w, uint32_t stage, uint32_t stages, uint32_t session) {
    Llm__Register r = LLM__REGISTER__INIT;
    r.worker_id = w->id;
    r.incarnation = 7;
    r.pipeline_id = 0;
    r.stage_index = stage;
    r.stage_count = stages;
    r.session = session;
    r.model = "stories260K-f32.gguf";
    r.backend = "fake";
    r.kv_block_count = 64;
    r.kv_block_size = 16;
    r.max_step_seqs = 4;
    Llm__WorkerEnvelope env = LLM__WORKER_ENVELOPE__INIT;
    env.body_case = LLM__WORKER_ENVELOPE__BODY_REGISTER;
    env.register_ = &r;
    fw_send(w, &env);
    w->silent = 1;
    Llm__WorkerEnvelope *rep = fw_recv(w, 3000);
    w->silent = 0;
    if (!rep || rep->body_case != LLM__WORKER_ENVELOPE__BODY_REGISTER_REPLY)
        TEST_FAIL("worker %s: no RegisterReply", w->id);
    return rep;
}

/* Opens w's socket under routing id id (a new connection; w->id kept). */
static void fw_connect(struct fx *f, struct fw *w, const char *id) {
    snprintf(w->id, sizeof w->id, "%s", id);
    char err[256];
    if (zio_sock_open(f->ctx, ZMQ_DEALER, &w->d, err, sizeof err) < 0) TEST_FAIL("%s", err);
    zio_set_int(w->d, ZMQ_LINGER, 0);
    zio_set_bytes(w->d, ZMQ_ROUTING_ID, id, strlen(id));
    if (zio_connect(w->d, f->wep) < 0) TEST_FAIL("%s", zio_errstr(w->d));
}

/* Connects worker id and sends its Register for stage 0 of pipeline 0;
 * returns the router's RegisterReply. */
static Llm__WorkerEnvelope *fw_register(struct fx *f, struct fw *w, const char *id) {
    memset(w, 0, sizeof *w);
    fw_connect(f, w, id);
    return fw_register_as(w, 0, 1, 0);
}

static void fw_open(struct fx *f, struct fw *w, const char *id) {
    Llm__WorkerEnvelope *rep = fw_register(f, w, id);
    if (!rep->register_reply->accepted)
        TEST_FAIL("worker %s refused: %s", id, rep->register_reply->error->message);
    ASSERT_EQ(0u, rep->register_reply->layer_first);
    ASSERT_EQ(5u, rep->register_reply->layer_end);
    proto_worker_free(rep);
    fw_heartbeat(w);
    fw_wait_serving(f, w);
}

static void fw_close(struct fw *w) { zio_sock_close(w->d); }

/* The next plan (register replies in between are skipped). */
static Llm__WorkerEnvelope *fw_plan(struct fw *w) {
    for (int i = 0; i < 10; i++) {
        Llm__WorkerEnvelope *e = fw_recv(w, 3000);
        if (!e) TEST_FAIL("worker %s: no plan", w->id);
        /* A plan of frees only (no sequences) asks for no answer. */
        if (e->body_case == LLM__WORKER_ENVELOPE__BODY_PLAN && e->plan->n_seqs > 0) return e;
        proto_worker_free(e);
    }
    TEST_FAIL("worker %s: no plan among 10 messages", w->id);
    return NULL;
}

/* Answers a plan as stage stage (the router takes the last stage's):
 * every sequence that wants logits samples token. */
static void fw_answer_at(struct fw *w, const Llm__StepPlan *p, int32_t token, uint32_t stage) {
    Llm__StepResult r = LLM__STEP_RESULT__INIT;
    r.stage_index = stage;
    r.step_id = p->step_id;
    r.pipeline_id = p->pipeline_id;
    r.epoch = p->epoch;
    r.worker_id = w->id;
    Llm__SeqResult res[16], *rp[16];
    for (size_t i = 0; i < p->n_seqs && i < 16; i++) {
        llm__seq_result__init(&res[i]);
        res[i].seq_id = p->seqs[i]->seq_id;
        res[i].token = p->seqs[i]->want_logits ? token : -1;
        rp[i] = &res[i];
    }
    r.n_seqs = p->n_seqs;
    r.seqs = rp;
    Llm__WorkerEnvelope env = LLM__WORKER_ENVELOPE__INIT;
    env.body_case = LLM__WORKER_ENVELOPE__BODY_RESULT;
    env.result = &r;
    fw_send(w, &env);
}

static void fw_answer(struct fw *w, const Llm__StepPlan *p, int32_t token) { fw_answer_at(w, p, token, 0); }

/* Collects chunks until done; tokens land in got[index]; returns done. */
static Llm__ClientEnvelope *cl_collect(struct zio_sock *d, int32_t *got, int *count, int max) {
    for (;;) {
        Llm__ClientEnvelope *e = cl_recv(d, 3000);
        if (!e) TEST_FAIL("no chunk or done");
        if (e->body_case == LLM__CLIENT_ENVELOPE__BODY_DONE) return e;
        if (e->body_case != LLM__CLIENT_ENVELOPE__BODY_CHUNK) TEST_FAIL("unexpected body %d", (int)e->body_case);
        for (size_t i = 0; i < e->chunk->n_token_ids; i++) {
            int idx = (int)e->chunk->index + (int)i;
            if (idx >= max) TEST_FAIL("chunk index %d beyond %d", idx, max);
            if (got[idx] != -1) TEST_FAIL("token %d received twice", idx);
            got[idx] = e->chunk->token_ids[i];
            (*count)++;
        }
        proto_client_free(e);
    }
}

static const int32_t prompt3[3] = {1, 403, 407};

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

TEST(router_server_reattach_and_cancel) {
    struct fx f;
    fx_start(&f, 2000, 100);
    struct fw w;
    fw_open(&f, &w, "w1");
    struct zio_sock *c1 = cl_open(&f), *c2 = cl_open(&f);
    cl_generate(c1, 1, "ra-1", prompt3, 3, 10, 0);
    proto_client_free(cl_expect(c1, LLM__CLIENT_ENVELOPE__BODY_ACCEPTED));
    uint64_t seq_id = 0;
    for (int k = 0; k < 2; k++) {
        Llm__WorkerEnvelope *pe = fw_plan(&w);
        seq_id = pe->plan->seqs[0]->seq_id;
        fw_answer(&w, pe->plan, 200 + k);
        proto_worker_free(pe);
    }
    Llm__WorkerEnvelope *held = fw_plan(&w); /* the third step, not answered yet */
    /* Another connection re-attaches, having one token. */
    cl_generate(c2, 2, "ra-1", prompt3, 3, 10, 1);
    Llm__ClientEnvelope *e = cl_expect(c2, LLM__CLIENT_ENVELOPE__BODY_ACCEPTED);
    ASSERT_TRUE(e->accepted->reattached);
    proto_client_free(e);
    e = cl_expect(c2, LLM__CLIENT_ENVELOPE__BODY_CHUNK);
    ASSERT_EQ(1u, e->chunk->index);
    ASSERT_EQ((size_t)1, e->chunk->n_token_ids);
    ASSERT_EQ(201, e->chunk->token_ids[0]);
    proto_client_free(e);
    /* The stream now goes to the new connection. */
    fw_answer(&w, held->plan, 202);
    proto_worker_free(held);
    e = cl_expect(c2, LLM__CLIENT_ENVELOPE__BODY_CHUNK);
    ASSERT_EQ(2u, e->chunk->index);
    proto_client_free(e);
    /* A different body under the same id is refused. */
    cl_generate(c2, 3, "ra-1", prompt3, 3, 11, 0);
    cl_expect_error(c2, LLM__ERROR__CODE__ALREADY_EXISTS, NULL);
    /* Cancel from the first connection: both get the end. */
    Llm__Cancel cc = LLM__CANCEL__INIT;
    cc.request_id = "ra-1";
    Llm__ClientEnvelope cancel = LLM__CLIENT_ENVELOPE__INIT;
    cancel.body_case = LLM__CLIENT_ENVELOPE__BODY_CANCEL;
    cancel.cancel = &cc;
    cl_send(c1, &cancel);
    for (int i = 0; i < 2; i++) {
        struct zio_sock *c = i ? c2 : c1;
        for (;;) {
            e = cl_recv(c, 3000);
            ASSERT_TRUE(e != NULL);
            if (e->body_case == LLM__CLIENT_ENVELOPE__BODY_DONE) break;
            proto_client_free(e);
        }
        ASSERT_EQ((int)LLM__GENERATE_DONE__FINISH_REASON__CANCELLED, (int)e->done->finish_reason);
        proto_client_free(e);
    }
    /* With no step after it, a plan of frees only tells the worker to free
     * the cancelled sequence (docs/worker.md, "KV view"). */
    Llm__WorkerEnvelope *before = fw_plan(&w); /* planned before the cancel */
    fw_answer(&w, before->plan, 203);          /* its result is ignored */
    proto_worker_free(before);
    Llm__WorkerEnvelope *pe = NULL;
    for (int i = 0; i < 10 && !pe; i++) {
        pe = fw_recv(&w, 3000);
        ASSERT_TRUE(pe != NULL);
        if (pe->body_case != LLM__WORKER_ENVELOPE__BODY_PLAN) {
            proto_worker_free(pe);
            pe = NULL;
        }
    }
    ASSERT_TRUE(pe != NULL);
    ASSERT_EQ((size_t)0, pe->plan->n_seqs);
    ASSERT_EQ((size_t)1, pe->plan->n_freed_seqs);
    ASSERT_EQ(seq_id, pe->plan->freed_seqs[0]);
    proto_worker_free(pe);
    cl_generate(c1, 4, "ra-2", prompt3, 3, 2, 0);
    proto_client_free(cl_expect(c1, LLM__CLIENT_ENVELOPE__BODY_ACCEPTED));
    pe = fw_plan(&w);
    ASSERT_EQ((size_t)0, pe->plan->n_freed_seqs);
    proto_worker_free(pe);
    zio_sock_close(c1);
    zio_sock_close(c2);
    fw_close(&w);
    fx_stop(&f);
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

/* ---- Redis that restarts, and seeds that survive lost state ------------------ */

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

/* The text a client builds from a stream as clients/c does: a chunk that
 * ends at or before what it has is a duplicate; one that starts past it is
 * a gap; one that starts before it and ends after it (a replay straddling
 * its count) cannot be split by text, so the client would keep its new
 * tokens and lose their text. */
struct tc_client {
    uint32_t have;
    char text[256];
    size_t len;
};

static void tc_take(struct tc_client *t, const Llm__GenerateChunk *ch) {
    uint32_t end = ch->index + (uint32_t)ch->n_token_ids;
    if (end <= t->have) return;
    if (ch->index > t->have) TEST_FAIL("chunk at token %u, but the client has %u (a gap)", ch->index, t->have);
    if (ch->index < t->have)
        TEST_FAIL("chunk of tokens %u..%u (text \"%s\") straddles the %u tokens the client has: their text "
                  "cannot be split, the client loses that of tokens %u..%u", ch->index, end, ch->text, t->have,
                  t->have, end);
    size_t n = strlen(ch->text);
    if (t->len + n >= sizeof t->text) TEST_FAIL("text longer than %zu bytes", sizeof t->text);
    memcpy(t->text + t->len, ch->text, n + 1);
    t->len += n;
    t->have = end;
}

/* A client that re-attached twice from one position (two gaps came before
 * the first replay) is answered the second time after it got the tokens
 * streamed since: the second replay must not put those and a token not
 * streamed yet in one chunk, or that token's text (here " p" of " the
 * park", SentencePiece pieces whose spaces start the next token) is lost
 * though its id arrives.  Stopping Redis holds the router in its token
 * store for a moment, so that a result and the re-attach are handled in
 * one turn, the result first, as under load. */
TEST(router_server_reattach_replay_keeps_the_text) {
    static const char *const pieces[] = {"\xe2\x96\x81the", "\xe2\x96\x81p", "ar", "k", "."};
    int32_t toks[5];
    tokenizer *tok = NULL;
    char err[256];
    ASSERT_OK(tokenizer_load(&tok, test_model_path("stories260K-f32.gguf"), err, sizeof err));
    for (int i = 0; i < 5; i++) {
        toks[i] = tokenizer_token_find(tok, pieces[i], strlen(pieces[i]));
        if (toks[i] < 0) TEST_FAIL("stories260K has no token \"%s\"", pieces[i]);
    }
    tokenizer_free(tok);
    struct fx f;
    fx_start(&f, 2000, 100);
    struct fw w;
    fw_open(&f, &w, "w1");
    struct zio_sock *c = cl_open(&f);
    struct tc_client t = {0};
    cl_generate(c, 1, "rt-1", prompt3, 3, 5, 0);
    proto_client_free(cl_expect(c, LLM__CLIENT_ENVELOPE__BODY_ACCEPTED));
    Llm__WorkerEnvelope *pe = fw_plan(&w);
    fw_answer(&w, pe->plan, toks[0]);
    proto_worker_free(pe);
    Llm__ClientEnvelope *e = cl_expect(c, LLM__CLIENT_ENVELOPE__BODY_CHUNK);
    tc_take(&t, e->chunk);
    proto_client_free(e);
    ASSERT_EQ(1u, t.have);
    ASSERT_EQ(0, kill(f.r.pid, SIGSTOP));
    /* Token 1: the router plans step 3 and blocks storing the token, so
     * its chunk goes out only once Redis is back. */
    pe = fw_plan(&w);
    fw_answer(&w, pe->plan, toks[1]);
    proto_worker_free(pe);
    pe = fw_plan(&w);
    fw_answer(&w, pe->plan, toks[2]); /* token 2, not streamed before the re-attach is handled */
    proto_worker_free(pe);
    cl_generate(c, 2, "rt-1", prompt3, 3, 5, t.have); /* the client has 1 token: stale once token 1 comes */
    usleep(100 * 1000);
    ASSERT_EQ(0, kill(f.r.pid, SIGCONT));
    int next = 3; /* the next token the worker answers */
    for (;;) {
        e = cl_recv(c, 3000);
        if (!e) TEST_FAIL("no chunk or done (the client has %u tokens, text \"%s\")", t.have, t.text);
        if (e->body_case == LLM__CLIENT_ENVELOPE__BODY_DONE) {
            proto_client_free(e);
            break;
        }
        if (e->body_case == LLM__CLIENT_ENVELOPE__BODY_CHUNK) tc_take(&t, e->chunk);
        else if (e->body_case != LLM__CLIENT_ENVELOPE__BODY_ACCEPTED) TEST_FAIL("unexpected body %d", (int)e->body_case);
        proto_client_free(e);
        if (next < 5 && t.have == (uint32_t)next) {
            pe = fw_plan(&w);
            fw_answer(&w, pe->plan, toks[next++]);
            proto_worker_free(pe);
        }
    }
    ASSERT_EQ(5u, t.have);
    ASSERT_STREQ(" the park.", t.text);
    zio_sock_close(c);
    fw_close(&w);
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

TEST_MAIN(router_server_generates_and_streams, router_server_refuses_without_a_pipeline, router_server_held_stage_is_retried,
          router_server_tells_a_stalled_request,
          router_server_stop_string_and_deadline, router_server_refuses_bad_input_and_keeps_serving,
          router_server_queue_is_bounded, router_server_worker_loss_resumes_exactly_once,
          router_server_reattach_and_cancel, router_server_restart_resumes_requests,
          router_server_redis_restarted_empty, router_server_health_follows_redis,
          router_server_lost_state_keeps_the_seed, router_server_reattach_with_chosen_seed,
          router_server_reattach_replay_keeps_the_text, router_server_new_session_reforms,
          router_server_unsent_frees_reform)
