/* Tests of llm-worker as a real process, with the test playing the router
 * on a ZeroMQ ROUTER socket with the proto envelopes and a private Redis:
 * registration (envelope and registry key), heartbeats, greedy generation
 * through step plans against the llama.cpp goldens (one stage, and two
 * stages chained over the ZeroMQ link on the router's default layer split),
 * bad frames answered with errors, failing steps reported while the worker
 * keeps serving, plans of an old epoch dropped, seeded sampling reproduced,
 * and a clean SIGTERM.  Every wait is bounded. */
#include "tests/test.h"

#include "common/rconn.h"
#include "common/status.h"
#include "common/zio.h"
#include "kernels/backend.h"
#include "proto/wire.h"
#include "router/modelinfo.h"
#include "tests/redis_fixture.h"

#include <cjson/cJSON.h>
#include <fcntl.h>
#include <signal.h>
#include <sys/prctl.h>
#include <sys/wait.h>
#include <time.h>
#include <unistd.h>

#define WORKER_BINARY LLM_BINARY_DIR "/worker/llm-worker"
/* Generous: the first start of a freshly linked llm-worker may load
 * cuBLAS (hundreds of MB) from a cold page cache. */
#define T_WAIT_MS 60000

static int64_t t_now_ms(void) {
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (int64_t)ts.tv_sec * 1000 + ts.tv_nsec / 1000000;
}

/* ---- the worker process ---- */

/* The device the workers of the CPU tests run on: "cpu" unless
 * LLM_TEST_WORKER_DEVICE says otherwise (cuda:0 runs the same tests on a GPU
 * with the ZeroMQ link). */
static const char *t_device(void) {
    const char *d = getenv("LLM_TEST_WORKER_DEVICE");
    return d && *d ? d : "cpu";
}

struct t_worker {
    pid_t pid;
    char log[128];
};

/* Starts llm-worker with the common flags plus extra (NULL-terminated);
 * stderr goes to a log file that failures print. */
static void t_worker_start(struct t_worker *w, const char *router, const char *redis_url,
                           const char *id, const char *const *extra) {
    if (access(WORKER_BINARY, X_OK) != 0) TEST_FAIL("%s is not built", WORKER_BINARY);
    const char *model = test_model_path("stories260K-f32.gguf");
    snprintf(w->log, sizeof w->log, "/tmp/test_node_%d_%s.log", (int)getpid(), id);
    const char *argv[64];
    int n = 0;
    argv[n++] = WORKER_BINARY;
    argv[n++] = "--model";
    argv[n++] = model;
    argv[n++] = "--device";
    argv[n++] = t_device();
    argv[n++] = "--transport";
    argv[n++] = "zmq";
    argv[n++] = "--threads";
    argv[n++] = "1";
    argv[n++] = "--router";
    argv[n++] = router;
    argv[n++] = "--insecure"; /* the test's router is a plain socket */
    argv[n++] = "--worker-id";
    argv[n++] = id;
    argv[n++] = "--listen";
    argv[n++] = "tcp://127.0.0.1:*";
    argv[n++] = "--kv-blocks"; /* two workers may share one GPU */
    argv[n++] = "64";
    argv[n++] = "--link-timeout-ms";
    argv[n++] = "5000";
    argv[n++] = "--log-level";
    argv[n++] = "debug";
    if (redis_url) {
        argv[n++] = "--redis";
        argv[n++] = redis_url;
    }
    for (int i = 0; extra && extra[i] && n < 62; i++) argv[n++] = extra[i];
    argv[n] = NULL;
    pid_t pid = fork();
    if (pid < 0) TEST_FAIL("fork failed");
    if (pid == 0) {
        prctl(PR_SET_PDEATHSIG, SIGKILL);
        int fd = open(w->log, O_WRONLY | O_CREAT | O_TRUNC, 0644);
        if (fd >= 0) {
            dup2(fd, 2);
            dup2(fd, 1);
        }
        alarm(120); /* a hung worker dies */
        execv(WORKER_BINARY, (char *const *)argv);
        _exit(127);
    }
    w->pid = pid;
}

static void t_worker_log_tail(const struct t_worker *w) {
    FILE *f = fopen(w->log, "r");
    if (!f) return;
    char buf[4096];
    fseek(f, 0, SEEK_END);
    long size = ftell(f);
    fseek(f, size > 3000 ? size - 3000 : 0, SEEK_SET);
    size_t got = fread(buf, 1, sizeof buf - 1, f);
    buf[got] = 0;
    fclose(f);
    printf("---- %s (tail) ----\n%s\n----\n", w->log, buf);
}

/* Waits up to ms for the process to exit; its exit code, 128 + signal, or -1. */
static int t_worker_wait(struct t_worker *w, int ms) {
    int64_t end = t_now_ms() + ms;
    while (w->pid > 0) {
        int st;
        pid_t r = waitpid(w->pid, &st, WNOHANG);
        if (r == w->pid) {
            w->pid = 0;
            return WIFEXITED(st) ? WEXITSTATUS(st) : 128 + WTERMSIG(st);
        }
        if (t_now_ms() > end) return -1;
        usleep(10000);
    }
    return -1;
}

static void t_worker_kill(struct t_worker *w) {
    if (w->pid > 0) {
        kill(w->pid, SIGKILL);
        waitpid(w->pid, NULL, 0);
        w->pid = 0;
    }
}

/* ---- the router's side ---- */

/* Heartbeat states seen by t_recv (bit 1 << state), also in skipped ones. */
static int t_states_seen;

struct t_router {
    void *ctx;
    struct zio_sock *sock;
    char endpoint[128];
};

static void t_router_open(struct t_router *r) {
    char err[256];
    t_states_seen = 0;
    r->ctx = zmq_ctx_new();
    if (zio_sock_open(r->ctx, ZMQ_ROUTER, &r->sock, err, sizeof err) < 0) TEST_FAIL("%s", err);
    zio_set_int(r->sock, ZMQ_ROUTER_MANDATORY, 1);
    if (zio_bind(r->sock, "tcp://127.0.0.1:*") < 0) TEST_FAIL("%s", zio_errstr(r->sock));
    snprintf(r->endpoint, sizeof r->endpoint, "%s", zio_endpoint(r->sock));
}

static void t_router_close(struct t_router *r) {
    zio_sock_close(r->sock);
    if (r->ctx) zmq_ctx_term(r->ctx);
    r->sock = NULL;
    r->ctx = NULL;
}

/* The next envelope from any worker whose body is `body` (others are
 * skipped: heartbeats between results), up to ms; NULL on timeout.  The
 * sender's id goes to from (64 bytes) when not NULL. */
static Llm__WorkerEnvelope *t_recv(struct t_router *r, int body, int ms, char *from) {
    int64_t end = t_now_ms() + ms;
    struct zio_parts in = {0};
    for (;;) {
        int64_t left = end - t_now_ms();
        if (left <= 0) break;
        int rc = zio_recv(r->sock, &in, (int)left);
        if (rc == STATUS_TIMEOUT) break;
        if (rc < 0) continue;
        if (in.n != 2) TEST_FAIL("a worker message has %zu frames (identity + 1 expected)", in.n);
        Llm__WorkerEnvelope *env;
        char err[256];
        if (proto_worker_unpack(zio_parts_data(&in, 1), zio_parts_size(&in, 1), &env, err, sizeof err) < 0)
            TEST_FAIL("the worker sent a bad frame: %s", err);
        if (env->body_case == LLM__WORKER_ENVELOPE__BODY_HEARTBEAT)
            t_states_seen |= 1 << env->heartbeat->state;
        if ((int)env->body_case == body) {
            if (from) {
                size_t n = zio_parts_size(&in, 0) < 63 ? zio_parts_size(&in, 0) : 63;
                memcpy(from, zio_parts_data(&in, 0), n);
                from[n] = 0;
            }
            zio_parts_free(&in);
            return env;
        }
        proto_worker_free(env);
    }
    zio_parts_free(&in);
    return NULL;
}

static void t_send_raw(struct t_router *r, const char *to, const void *buf, size_t len) {
    struct zio_frame f[2] = {{to, strlen(to), NULL, NULL}, {buf, len, NULL, NULL}};
    if (zio_send(r->sock, f, 2, 0) < 0) TEST_FAIL("send to %s: %s", to, zio_errstr(r->sock));
}

static void t_send(struct t_router *r, const char *to, Llm__WorkerEnvelope *env) {
    uint8_t *buf;
    size_t len;
    char err[256];
    if (proto_worker_pack(env, &buf, &len, err, sizeof err) < 0) TEST_FAIL("pack: %s", err);
    t_send_raw(r, to, buf, len);
    free(buf);
}

static void t_reply(struct t_router *r, const char *to, uint64_t epoch, const char *prev_ep,
                    const char *next_ep) {
    Llm__RegisterReply rr = LLM__REGISTER_REPLY__INIT;
    rr.worker_id = (char *)to;
    rr.accepted = 1;
    rr.heartbeat_interval_ms = 200;
    rr.pipeline_id = 1;
    rr.epoch = epoch;
    rr.pipeline_whole = 1;
    rr.prev_stage_endpoint = (char *)(prev_ep ? prev_ep : "");
    rr.next_stage_endpoint = (char *)(next_ep ? next_ep : "");
    Llm__WorkerEnvelope env = LLM__WORKER_ENVELOPE__INIT;
    env.body_case = LLM__WORKER_ENVELOPE__BODY_REGISTER_REPLY;
    env.register_reply = &rr;
    t_send(r, to, &env);
}

/* One sequence of a plan: tokens at start_pos with a block table covering
 * them (block i = base + i, 16 positions each). */
struct t_seq {
    uint64_t id;
    const int32_t *tokens;
    size_t n;
    uint32_t start_pos;
    uint32_t block_base;
    int want_logits;
    float temperature;
    uint64_t seed;
    int top_logprobs;           /* > 0: ask for logprobs and this many alternatives */
    float repetition_penalty;
};

static void t_send_plan(struct t_router *r, const char *to, uint64_t step, uint64_t epoch,
                        const struct t_seq *seqs, size_t n_seqs, const uint64_t *freed, size_t n_freed) {
    Llm__SeqPlan sp[8], *spp[8];
    Llm__SamplingParams sa[8];
    uint32_t tables[8][64];
    for (size_t i = 0; i < n_seqs; i++) {
        llm__seq_plan__init(&sp[i]);
        llm__sampling_params__init(&sa[i]);
        sa[i].temperature = seqs[i].temperature;
        sa[i].seed = seqs[i].seed;
        sa[i].logprobs = seqs[i].top_logprobs > 0;
        sa[i].top_logprobs = seqs[i].top_logprobs;
        sa[i].repetition_penalty = seqs[i].repetition_penalty;
        sp[i].seq_id = seqs[i].id;
        sp[i].tokens = (int32_t *)seqs[i].tokens;
        sp[i].n_tokens = seqs[i].n;
        sp[i].start_pos = seqs[i].start_pos;
        size_t nb = (seqs[i].start_pos + seqs[i].n + 15) / 16;
        for (size_t b = 0; b < nb; b++) tables[i][b] = seqs[i].block_base + (uint32_t)b;
        sp[i].block_table = tables[i];
        sp[i].n_block_table = nb;
        sp[i].want_logits = seqs[i].want_logits;
        sp[i].sampling = &sa[i];
        spp[i] = &sp[i];
    }
    Llm__StepPlan p = LLM__STEP_PLAN__INIT;
    p.step_id = step;
    p.pipeline_id = 1;
    p.epoch = epoch;
    p.seqs = spp;
    p.n_seqs = n_seqs;
    p.freed_seqs = (uint64_t *)freed;
    p.n_freed_seqs = n_freed;
    Llm__WorkerEnvelope env = LLM__WORKER_ENVELOPE__INIT;
    env.body_case = LLM__WORKER_ENVELOPE__BODY_PLAN;
    env.plan = &p;
    t_send(r, to, &env);
}

/* The StepResult of step `step` (older ones are skipped), or a failure. */
static Llm__WorkerEnvelope *t_result(struct t_router *r, uint64_t step, char *from) {
    int64_t end = t_now_ms() + T_WAIT_MS;
    while (t_now_ms() < end) {
        Llm__WorkerEnvelope *e = t_recv(r, LLM__WORKER_ENVELOPE__BODY_RESULT, (int)(end - t_now_ms()), from);
        if (!e) break;
        if (e->result->step_id == step) return e;
        proto_worker_free(e);
    }
    return NULL;
}

/* ---- goldens ---- */

struct t_golden {
    int32_t prompt[32], gen[64];
    int n_prompt, n_gen;
};

static void t_golden_load(struct t_golden *g) {
    const char *path = test_model_path("stories260K-golden.json");
    char *text = test_read_file(path, NULL);
    if (!text) TEST_FAIL("cannot read %s", path);
    cJSON *j = cJSON_Parse(text);
    free(text);
    if (!j) TEST_FAIL("%s is not JSON", path);
    cJSON *pr = cJSON_GetArrayItem(
        cJSON_GetObjectItem(cJSON_GetObjectItem(cJSON_GetObjectItem(j, "models"), "stories260K-f32.gguf"),
                            "prompts"),
        0);
    cJSON *ids = cJSON_GetObjectItem(pr, "prompt_ids"), *gen = cJSON_GetObjectItem(pr, "generated_ids");
    if (!ids || !gen) TEST_FAIL("%s: no prompt_ids/generated_ids", path);
    g->n_prompt = cJSON_GetArraySize(ids);
    g->n_gen = cJSON_GetArraySize(gen);
    if (g->n_prompt > 32) g->n_prompt = 32;
    if (g->n_gen > 64) g->n_gen = 64;
    for (int i = 0; i < g->n_prompt; i++) g->prompt[i] = cJSON_GetArrayItem(ids, i)->valueint;
    for (int i = 0; i < g->n_gen; i++) g->gen[i] = cJSON_GetArrayItem(gen, i)->valueint;
    cJSON_Delete(j);
}

/* Prefill + n-1 greedy decodes of seq id through the workers in `to`
 * (every stage gets every plan); tokens from the last stage.  Returns the
 * next step id. */
static uint64_t t_generate(struct t_router *r, const char *const *to, int n_to, uint64_t step,
                           uint64_t seq, const struct t_golden *g, int n, int32_t *out,
                           const char *last_id) {
    struct t_seq s = {seq, g->prompt, (size_t)g->n_prompt, 0, 0, 1, 0, 0, 0, 0};
    int32_t tok;
    for (int i = 0; i < n; i++) {
        for (int k = 0; k < n_to; k++) t_send_plan(r, to[k], step, 1, &s, 1, NULL, 0);
        char from[64] = "";
        Llm__WorkerEnvelope *e = t_result(r, step, from);
        if (!e) TEST_FAIL("no StepResult for step %llu within %d ms", (unsigned long long)step, T_WAIT_MS);
        if (e->result->error) TEST_FAIL("step %llu failed: %s", (unsigned long long)step, e->result->error->message);
        ASSERT_STREQ(last_id, from);
        ASSERT_EQ((size_t)1, e->result->n_seqs);
        ASSERT_EQ(seq, e->result->seqs[0]->seq_id);
        out[i] = e->result->seqs[0]->token;
        proto_worker_free(e);
        step++;
        s.start_pos += (uint32_t)s.n;
        tok = out[i];
        s.tokens = &tok;
        s.n = 1;
    }
    return step;
}

/* Waits for the worker's Register; checks what it says about itself. */
static void t_expect_register(struct t_router *r, const char *id, char *stage_ep, size_t ep_size) {
    char from[64];
    Llm__WorkerEnvelope *e = t_recv(r, LLM__WORKER_ENVELOPE__BODY_REGISTER, T_WAIT_MS, from);
    if (!e) TEST_FAIL("no Register from %s within %d ms", id, T_WAIT_MS);
    ASSERT_STREQ(id, from);
    ASSERT_STREQ(id, e->register_->worker_id);
    ASSERT_STREQ("stories260K-f32.gguf", e->register_->model);
    ASSERT_STREQ(strcmp(t_device(), "cpu") == 0 ? "cpu" : "cuda", e->register_->backend);
    ASSERT_TRUE(e->register_->kv_block_count > 0);
    ASSERT_EQ(16u, e->register_->kv_block_size);
    ASSERT_TRUE(e->register_->incarnation > 0);
    ASSERT_EQ(512u, e->register_->max_step_tokens);
    ASSERT_EQ(16u, e->register_->max_step_seqs);
    ASSERT_TRUE(strncmp(e->register_->stage_endpoint, "tcp://127.0.0.1:", 16) == 0);
    snprintf(stage_ep, ep_size, "%s", e->register_->stage_endpoint);
    proto_worker_free(e);
}

static void t_expect_state(struct t_router *r, int state) {
    int64_t end = t_now_ms() + T_WAIT_MS;
    while (t_now_ms() < end) {
        if (t_states_seen & (1 << state)) return;
        Llm__WorkerEnvelope *e = t_recv(r, LLM__WORKER_ENVELOPE__BODY_HEARTBEAT, 2000, NULL);
        if (!e) continue;
        int s = e->heartbeat->state;
        proto_worker_free(e);
        if (s == state) return;
    }
    TEST_FAIL("no heartbeat in state %d within %d ms", state, T_WAIT_MS);
}

/* ---- tests ---- */

TEST(node_registers_generates_and_stops) {
    struct t_golden g;
    t_golden_load(&g);
    struct redis_fixture f;
    fixture_redis_start(&f, 0);
    struct t_router r = {0};
    t_router_open(&r);
    struct t_worker w = {0};
    t_worker_start(&w, r.endpoint, f.url, "w-one", NULL);
    char ep[256];
    t_expect_register(&r, "w-one", ep, sizeof ep);

    /* The registry key holds the Register and expires unless refreshed. */
    struct rconn *rc;
    char err[256];
    ASSERT_OK(rconn_open_url(f.url, 2000, &rc, err, sizeof err));
    void *val = NULL;
    size_t len = 0;
    ASSERT_OK(rconn_get(rc, "llm:worker:w-one", &val, &len));
    Llm__WorkerEnvelope *reg;
    ASSERT_OK(proto_worker_unpack(val, len, &reg, err, sizeof err));
    ASSERT_STREQ("w-one", reg->register_->worker_id);
    proto_worker_free(reg);
    free(val);
    int64_t ttl = 0;
    ASSERT_OK(rconn_ttl(rc, "llm:worker:w-one", &ttl));
    ASSERT_TRUE(ttl > 0);

    t_reply(&r, "w-one", 1, "", "");
    t_expect_state(&r, LLM__HEARTBEAT__STATE__READY);

    int32_t toks[24];
    const char *to[1] = {"w-one"};
    uint64_t step = t_generate(&r, to, 1, 1, 7, &g, 24, toks, "w-one");
    for (int i = 0; i < 24; i++) ASSERT_EQ(g.gen[i], toks[i]);

    /* Heartbeats report the work done. */
    Llm__WorkerEnvelope *hb = t_recv(&r, LLM__WORKER_ENVELOPE__BODY_HEARTBEAT, T_WAIT_MS, NULL);
    ASSERT_TRUE(hb != NULL);
    ASSERT_EQ(step - 1, hb->heartbeat->last_step_id);
    ASSERT_EQ((uint64_t)(g.n_prompt + 23), hb->heartbeat->tokens_total);
    ASSERT_TRUE(hb->heartbeat->kv_blocks_used >= 2);
    proto_worker_free(hb);

    /* Copy-on-write: seq 8 shares seq 7's prompt block through a copy of it
     * (block 0 -> block 9) and goes on from the prompt as seq 7 did. */
    int32_t first = g.gen[0];
    Llm__SeqPlan sp = LLM__SEQ_PLAN__INIT;
    uint32_t table[1] = {9};
    Llm__SamplingParams greedy = LLM__SAMPLING_PARAMS__INIT;
    sp.seq_id = 8;
    sp.tokens = &first;
    sp.n_tokens = 1;
    sp.start_pos = (uint32_t)g.n_prompt;
    sp.block_table = table;
    sp.n_block_table = 1;
    sp.want_logits = 1;
    sp.sampling = &greedy;
    Llm__SeqPlan *spp[1] = {&sp};
    Llm__BlockCopy cp = LLM__BLOCK_COPY__INIT;
    cp.src = 0;
    cp.dst = 9;
    Llm__BlockCopy *cpp[1] = {&cp};
    Llm__StepPlan plan = LLM__STEP_PLAN__INIT;
    plan.step_id = step;
    plan.pipeline_id = 1;
    plan.epoch = 1;
    plan.seqs = spp;
    plan.n_seqs = 1;
    plan.copies = cpp;
    plan.n_copies = 1;
    Llm__WorkerEnvelope penv = LLM__WORKER_ENVELOPE__INIT;
    penv.body_case = LLM__WORKER_ENVELOPE__BODY_PLAN;
    penv.plan = &plan;
    t_send(&r, "w-one", &penv);
    Llm__WorkerEnvelope *ce = t_result(&r, step, NULL);
    ASSERT_TRUE(ce != NULL);
    ASSERT_TRUE(ce->result->error == NULL);
    ASSERT_EQ(g.gen[1], ce->result->seqs[0]->token);
    proto_worker_free(ce);
    step++;

    /* SIGTERM with plans in flight: they are finished first. */
    struct t_seq fresh[3] = {{20, g.prompt, (size_t)g.n_prompt, 0, 20, 1, 0, 0, 0, 0},
                             {21, g.prompt, (size_t)g.n_prompt, 0, 30, 1, 0, 0, 0, 0},
                             {22, g.prompt, (size_t)g.n_prompt, 0, 40, 1, 0, 0, 0, 0}};
    for (int k = 0; k < 3; k++) t_send_plan(&r, "w-one", step + (uint64_t)k, 1, &fresh[k], 1, NULL, 0);
    ce = t_result(&r, step, NULL);
    ASSERT_TRUE(ce != NULL);
    proto_worker_free(ce);

    /* SIGTERM: DRAINING, exit 0, registry key gone.  A plan that reaches the
     * worker once its drain stopped taking plans (none came for a quiet
     * period) is dropped by design, and nothing tells the test when the two
     * later plans have been read off the socket; give the worker's io
     * thread time to take them before the signal. */
    usleep(300 * 1000);
    t_states_seen = 0;
    kill(w.pid, SIGTERM);
    for (int k = 1; k < 3; k++) {
        ce = t_result(&r, step + (uint64_t)k, NULL);
        if (!ce) TEST_FAIL("step %d of the drain never came back", k);
        ASSERT_EQ(g.gen[0], ce->result->seqs[0]->token);
        proto_worker_free(ce);
    }
    t_expect_state(&r, LLM__HEARTBEAT__STATE__DRAINING);
    int code = t_worker_wait(&w, 10000);
    if (code != 0) t_worker_log_tail(&w);
    ASSERT_EQ(0, code);
    ASSERT_EQ(STATUS_NOT_FOUND, rconn_get(rc, "llm:worker:w-one", &val, &len));
    rconn_close(rc);
    t_router_close(&r);
    ASSERT_OK(fixture_redis_stop(&f));
    unlink(w.log);
}

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

/* The router's placement wins over the flags: a worker started as stage 0
 * of 2 that is told to hold the whole model (stage 0 of 1, layers 0:5)
 * reloads, registers its new range, and generates the golden tokens. */
TEST(node_router_placement_reloads) {
    struct t_golden g;
    t_golden_load(&g);
    struct t_router r = {0};
    t_router_open(&r);
    struct t_worker w = {0};
    const char *a[] = {"--stages", "2", "--stage", "0", NULL};
    t_worker_start(&w, r.endpoint, NULL, "w-move", a);
    char ep[256];
    t_expect_register(&r, "w-move", ep, sizeof ep);
    Llm__RegisterReply rr = LLM__REGISTER_REPLY__INIT;
    rr.worker_id = "w-move";
    rr.accepted = 1;
    rr.heartbeat_interval_ms = 200;
    rr.pipeline_id = 1;
    rr.stage_index = 0;
    rr.stage_count = 1;
    rr.layer_first = 0;
    rr.layer_end = 5;
    rr.epoch = 2;
    Llm__WorkerEnvelope env = LLM__WORKER_ENVELOPE__INIT;
    env.body_case = LLM__WORKER_ENVELOPE__BODY_REGISTER_REPLY;
    env.register_reply = &rr;
    t_send(&r, "w-move", &env);
    struct t_seq s = {1, g.prompt, (size_t)g.n_prompt, 0, 0, 1, 0, 0, 0, 0};
    t_send_plan(&r, "w-move", 1, 2, &s, 1, NULL, 0);
    Llm__WorkerEnvelope *e = t_result(&r, 1, NULL);
    if (!e) TEST_FAIL("no result after the reload");
    ASSERT_TRUE(e->result->error == NULL);
    ASSERT_EQ(0u, e->result->stage_index);
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

/* Reads a worker's log into buf (NUL-terminated). */
static void t_worker_log_read(const struct t_worker *w, char *buf, size_t size) {
    FILE *f = fopen(w->log, "r");
    ASSERT_TRUE(f != NULL);
    size_t got = fread(buf, 1, size - 1, f);
    buf[got] = 0;
    fclose(f);
}

TEST(node_refuses_what_does_not_fit) {
    struct t_router r = {0};
    t_router_open(&r);
    struct t_worker w = {0};
    const char *a[] = {"--kv-blocks", "16000000", "--max-batch-tokens", "1048576", NULL};
    t_worker_start(&w, r.endpoint, NULL, "w-big", a);
    int code = t_worker_wait(&w, 30000);
    t_worker_kill(&w);
    ASSERT_EQ(1, code);
    char buf[8192];
    t_worker_log_read(&w, buf, sizeof buf);
    if (!strstr(buf, "do not fit")) TEST_FAIL("no clear refusal in the log: %s", buf);
    t_router_close(&r);
    unlink(w.log);
}

/* A device the parser does not know is a bad flag (exit 2, naming it); more
 * stages than the model has layers cannot start (exit 1, saying both). */
TEST(node_refuses_bad_device_and_stage_count) {
    struct t_router r = {0};
    t_router_open(&r);
    struct t_worker w = {0};
    const char *a[] = {"--device", "gpu:0", NULL};
    t_worker_start(&w, r.endpoint, NULL, "w-dev", a);
    int code = t_worker_wait(&w, 30000);
    t_worker_kill(&w);
    ASSERT_EQ(2, code);
    char buf[8192];
    t_worker_log_read(&w, buf, sizeof buf);
    if (!strstr(buf, "--device \"gpu:0\"")) TEST_FAIL("the refusal does not name the flag: %s", buf);
    unlink(w.log);

    const char *b[] = {"--stages", "9", "--stage", "8", NULL};
    t_worker_start(&w, r.endpoint, NULL, "w-stages", b);
    code = t_worker_wait(&w, 30000);
    t_worker_kill(&w);
    ASSERT_EQ(1, code);
    t_worker_log_read(&w, buf, sizeof buf);
    if (!strstr(buf, "9 stages for 5 layers")) TEST_FAIL("no clear refusal in the log: %s", buf);
    t_router_close(&r);
    unlink(w.log);
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

TEST_MAIN(node_registers_generates_and_stops, node_two_stages_chain_over_zmq,
          node_two_stages_chain_over_nccl,
          node_bad_input_keeps_serving, node_seeded_sampling_reproduces, node_logprobs_and_penalties,
          node_router_placement_reloads,
          node_refuses_what_does_not_fit, node_refuses_bad_device_and_stage_count)
