/* The fixture of the router's event-loop tests (test_router_server*.c):
 * a router (router/server*.c) run in-process on a thread against a private
 * redis-server, a client and a fake worker on ZeroMQ sockets (one stage, or
 * one of several), and the checks of what the client hears.  Each test starts
 * and stops its own Redis and router (fx_start, fx_stop), so no state passes
 * from one test to the next.  Included by each of those files (one program
 * each): every function is static inline, so that a file may leave some
 * unused. */
#ifndef TESTS_ROUTER_ROUTER_SERVER_FIXTURE_H
#define TESTS_ROUTER_ROUTER_SERVER_FIXTURE_H

#include "router/server.h"

#include <pthread.h>
#include <signal.h>
#include <stdbool.h>
#include <time.h>
#include <unistd.h>

#include "common/log.h"
#include "common/status.h"
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
    int spin_us; /* server_config.spin_us of fx_server_start (0 unless a test sets it) */
};

static inline void *fx_thread(void *arg) {
    struct fx *f = arg;
    server_run(f->s, &f->stop);
    return NULL;
}

static inline void fx_server_start(struct fx *f, int worker_timeout_ms, int max_queue) {
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
    c.spin_us = f->spin_us;
    char err[512];
    if (server_init(&f->s, &c, err, sizeof err) < 0) TEST_FAIL("server_init: %s", err);
    snprintf(f->cep, sizeof f->cep, "%s", server_client_endpoint(f->s));
    snprintf(f->wep, sizeof f->wep, "%s", server_worker_endpoint(f->s));
    f->stop = 0;
    pthread_create(&f->th, NULL, fx_thread, f);
    f->running = 1;
}

static inline void fx_server_stop(struct fx *f) {
    if (!f->running) return;
    f->stop = 1;
    pthread_join(f->th, NULL);
    server_free(f->s);
    f->s = NULL;
    f->running = 0;
}

/* redis_flags: FIXTURE_REDIS_* for the private Redis. */
static inline void fx_start_redis(struct fx *f, int worker_timeout_ms, int max_queue, int redis_flags) {
    memset(f, 0, sizeof *f);
    log_set_level(getenv("TEST_LOG_DEBUG") ? LL_DEBUG : LL_WARN);
    test_model_path("stories260K-f32.gguf"); /* skips before Redis starts */
    fixture_redis_start(&f->r, redis_flags);
    f->ctx = zmq_ctx_new();
    fx_server_start(f, worker_timeout_ms, max_queue);
}

static inline void fx_start(struct fx *f, int worker_timeout_ms, int max_queue) {
    fx_start_redis(f, worker_timeout_ms, max_queue, 0);
}

static inline void fx_stop(struct fx *f) {
    fx_server_stop(f);
    zmq_ctx_term(f->ctx);
    ASSERT_OK(fixture_redis_stop(&f->r));
}

static inline int64_t t_ms(void) {
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (int64_t)ts.tv_sec * 1000 + ts.tv_nsec / 1000000;
}

/* ---- a client ------------------------------------------------------------ */

static inline struct zio_sock *cl_open(struct fx *f) {
    struct zio_sock *d;
    char err[256];
    if (zio_sock_open(f->ctx, ZMQ_DEALER, &d, err, sizeof err) < 0) TEST_FAIL("%s", err);
    zio_set_int(d, ZMQ_LINGER, 0);
    if (zio_connect(d, f->cep) < 0) TEST_FAIL("%s", zio_errstr(d));
    return d;
}

static inline void cl_send(struct zio_sock *d, Llm__ClientEnvelope *env) {
    uint8_t *buf;
    size_t len;
    char err[256];
    if (proto_client_pack(env, &buf, &len, err, sizeof err) < 0) TEST_FAIL("pack: %s", err);
    struct zio_frame fr = {buf, len, proto_buf_free, NULL};
    if (zio_send(d, &fr, 1, 0) < 0) TEST_FAIL("send: %s", zio_errstr(d));
}

static inline Llm__ClientEnvelope *cl_recv(struct zio_sock *d, int timeout_ms) {
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
static inline void cl_generate(struct zio_sock *d, uint64_t tag, const char *id, const int32_t *toks, size_t n,
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

static inline Llm__ClientEnvelope *cl_expect(struct zio_sock *d, Llm__ClientEnvelope__BodyCase body) {
    Llm__ClientEnvelope *e = cl_recv(d, 3000);
    if (!e) TEST_FAIL("no reply (expected body %d)", (int)body);
    if (e->body_case != body) {
        int got = (int)e->body_case;
        const char *msg = e->body_case == LLM__CLIENT_ENVELOPE__BODY_ERROR ? e->error->message : "";
        TEST_FAIL("expected body %d, got %d %s", (int)body, got, msg);
    }
    return e;
}

static inline void cl_expect_error(struct zio_sock *d, Llm__Error__Code code, const char *needle) {
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
    const char *backend; /* Register.backend; NULL: "fake" */
};

static inline void fw_send(struct fw *w, Llm__WorkerEnvelope *env) {
    uint8_t *buf;
    size_t len;
    char err[256];
    if (proto_worker_pack(env, &buf, &len, err, sizeof err) < 0) TEST_FAIL("pack: %s", err);
    struct zio_frame fr = {buf, len, proto_buf_free, NULL};
    zio_send(w->d, &fr, 1, 0);
}

static inline void fw_heartbeat(struct fw *w) {
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
static inline Llm__WorkerEnvelope *fw_recv(struct fw *w, int timeout_ms) {
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

static inline Llm__HealthReply__ServingStatus cl_health(struct zio_sock *c) {
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
static inline void fw_wait_serving(struct fx *f, struct fw *w) {
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
static inline Llm__WorkerEnvelope *fw_register_as(struct fw *w, uint32_t stage, uint32_t stages, uint32_t session) {
    Llm__Register r = LLM__REGISTER__INIT;
    r.worker_id = w->id;
    r.incarnation = 7;
    r.pipeline_id = 0;
    r.stage_index = stage;
    r.stage_count = stages;
    r.session = session;
    r.model = "stories260K-f32.gguf";
    r.backend = (char *)(w->backend ? w->backend : "fake");
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
static inline void fw_connect(struct fx *f, struct fw *w, const char *id) {
    snprintf(w->id, sizeof w->id, "%s", id);
    char err[256];
    if (zio_sock_open(f->ctx, ZMQ_DEALER, &w->d, err, sizeof err) < 0) TEST_FAIL("%s", err);
    zio_set_int(w->d, ZMQ_LINGER, 0);
    zio_set_bytes(w->d, ZMQ_ROUTING_ID, id, strlen(id));
    if (zio_connect(w->d, f->wep) < 0) TEST_FAIL("%s", zio_errstr(w->d));
}

/* Connects worker id and sends its Register for stage 0 of pipeline 0;
 * returns the router's RegisterReply. */
static inline Llm__WorkerEnvelope *fw_register(struct fx *f, struct fw *w, const char *id) {
    memset(w, 0, sizeof *w);
    fw_connect(f, w, id);
    return fw_register_as(w, 0, 1, 0);
}

static inline void fw_open(struct fx *f, struct fw *w, const char *id) {
    Llm__WorkerEnvelope *rep = fw_register(f, w, id);
    if (!rep->register_reply->accepted)
        TEST_FAIL("worker %s refused: %s", id, rep->register_reply->error->message);
    ASSERT_EQ(0u, rep->register_reply->layer_first);
    ASSERT_EQ(5u, rep->register_reply->layer_end);
    proto_worker_free(rep);
    fw_heartbeat(w);
    fw_wait_serving(f, w);
}

static inline void fw_close(struct fw *w) { zio_sock_close(w->d); }

/* The next plan (register replies in between are skipped). */
static inline Llm__WorkerEnvelope *fw_plan(struct fw *w) {
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
static inline void fw_answer_at(struct fw *w, const Llm__StepPlan *p, int32_t token, uint32_t stage) {
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

static inline void fw_answer(struct fw *w, const Llm__StepPlan *p, int32_t token) { fw_answer_at(w, p, token, 0); }

/* Collects chunks until done; tokens land in got[index]; returns done. */
static inline Llm__ClientEnvelope *cl_collect(struct zio_sock *d, int32_t *got, int *count, int max) {
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

/* The prompt most tests send: BOS and two tokens. */
static const int32_t prompt3[3] = {1, 403, 407};

#endif /* TESTS_ROUTER_ROUTER_SERVER_FIXTURE_H */
