/* The fixture of the tests of llm-worker as a real process (test_node*.c):
 * the worker started with the common flags (its stderr in a log file that
 * failures print), the test playing the router on a ZeroMQ ROUTER socket
 * with the proto envelopes (Register replies, step plans, results), and the
 * llama.cpp goldens of stories260K with greedy generation through plans.
 * Each test starts and stops its own worker, router socket and Redis, so no
 * state passes from one test to the next (t_router_open clears
 * t_states_seen).  Included by each of those files (one program each): every
 * function is static inline, so that a file may leave some unused.  Every
 * wait is bounded. */
#ifndef TESTS_WORKER_NODE_FIXTURE_H
#define TESTS_WORKER_NODE_FIXTURE_H

#include "tests/test.h"

#include "common/status.h"
#include "common/zio.h"
#include "proto/wire.h"

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

static inline int64_t t_now_ms(void) {
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (int64_t)ts.tv_sec * 1000 + ts.tv_nsec / 1000000;
}

/* ---- the worker process ---- */

/* The device the workers of the CPU tests run on: "cpu" unless
 * LLM_TEST_WORKER_DEVICE says otherwise (cuda:0 runs the same tests on a GPU
 * with the ZeroMQ link). */
static inline const char *t_device(void) {
    const char *d = getenv("LLM_TEST_WORKER_DEVICE");
    return d && *d ? d : "cpu";
}

struct t_worker {
    pid_t pid;
    char log[128];
};

/* Starts llm-worker with the common flags plus extra (NULL-terminated);
 * stderr goes to a log file that failures print. */
static inline void t_worker_start(struct t_worker *w, const char *router, const char *redis_url,
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

static inline void t_worker_log_tail(const struct t_worker *w) {
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
static inline int t_worker_wait(struct t_worker *w, int ms) {
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

static inline void t_worker_kill(struct t_worker *w) {
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

static inline void t_router_open(struct t_router *r) {
    char err[256];
    t_states_seen = 0;
    r->ctx = zmq_ctx_new();
    if (zio_sock_open(r->ctx, ZMQ_ROUTER, &r->sock, err, sizeof err) < 0) TEST_FAIL("%s", err);
    zio_set_int(r->sock, ZMQ_ROUTER_MANDATORY, 1);
    if (zio_bind(r->sock, "tcp://127.0.0.1:*") < 0) TEST_FAIL("%s", zio_errstr(r->sock));
    snprintf(r->endpoint, sizeof r->endpoint, "%s", zio_endpoint(r->sock));
}

static inline void t_router_close(struct t_router *r) {
    zio_sock_close(r->sock);
    if (r->ctx) zmq_ctx_term(r->ctx);
    r->sock = NULL;
    r->ctx = NULL;
}

/* The next envelope from any worker whose body is `body` (others are
 * skipped: heartbeats between results), up to ms; NULL on timeout.  The
 * sender's id goes to from (64 bytes) when not NULL. */
static inline Llm__WorkerEnvelope *t_recv(struct t_router *r, int body, int ms, char *from) {
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

static inline void t_send_raw(struct t_router *r, const char *to, const void *buf, size_t len) {
    struct zio_frame f[2] = {{to, strlen(to), NULL, NULL}, {buf, len, NULL, NULL}};
    if (zio_send(r->sock, f, 2, 0) < 0) TEST_FAIL("send to %s: %s", to, zio_errstr(r->sock));
}

static inline void t_send(struct t_router *r, const char *to, Llm__WorkerEnvelope *env) {
    uint8_t *buf;
    size_t len;
    char err[256];
    if (proto_worker_pack(env, &buf, &len, err, sizeof err) < 0) TEST_FAIL("pack: %s", err);
    t_send_raw(r, to, buf, len);
    free(buf);
}

static inline void t_reply(struct t_router *r, const char *to, uint64_t epoch, const char *prev_ep,
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

static inline void t_send_plan(struct t_router *r, const char *to, uint64_t step, uint64_t epoch,
                               const struct t_seq *seqs, size_t n_seqs, const uint64_t *freed,
                               size_t n_freed) {
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
static inline Llm__WorkerEnvelope *t_result(struct t_router *r, uint64_t step, char *from) {
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

static inline void t_golden_load(struct t_golden *g) {
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
static inline uint64_t t_generate(struct t_router *r, const char *const *to, int n_to, uint64_t step,
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
static inline void t_expect_register(struct t_router *r, const char *id, char *stage_ep, size_t ep_size) {
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

#endif
