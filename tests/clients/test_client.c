/* libllmclient against a scripted router in a thread of the test: streaming,
 * re-attach with resume_from after the router's socket goes away (a router
 * restart) or goes quiet, replayed tokens dropped, errors with their codes,
 * cancel from the callback, status, an unreachable router timing out within
 * retry_ms, an end that counts tokens that never came (re-attached for, or
 * failed on), and the quick probe. */
#include "tests/test.h"

#include "clients/c/client.h"
#include "common/status.h"
#include "common/zio.h"
#include "proto/wire.h"

#include <pthread.h>
#include <stdatomic.h>
#include <time.h>
#include <unistd.h>

enum fake_mode {
    FAKE_STREAM,  /* accept, N one-token chunks from resume_from, done LENGTH */
    FAKE_RESTART, /* first generate: 5 tokens then the socket closes and binds again;
                     the re-attach gets a replay from 3 (duplicates) and the rest */
    FAKE_SILENT,  /* first generate: accept and say nothing; the re-sent one streams */
    FAKE_ERROR,   /* every generate: Error INVALID_ARGUMENT; later Errors UNAVAILABLE first */
    FAKE_SLOW,    /* a token every 20 ms until a Cancel, then done CANCELLED */
    FAKE_MUTE,    /* accept every generate, then say nothing */
    FAKE_STALL,   /* accept, a token, a stall notice (UNAVAILABLE, retry after 2 s), then the rest 100 ms later */
    FAKE_SHORT,   /* first generate: tokens 0-4 and a done counting 12; re-attaches: the rest and the done */
    FAKE_SHORT_ALWAYS, /* every generate: tokens up to 4 and a done counting 12 */
};

#define FAKE_N_TOKENS 12

struct fake {
    enum fake_mode mode;
    int port;
    char ep[64];
    pthread_t th;
    atomic_int stop;
    /* What the router saw. */
    int n_generates, n_cancels, n_status;
    uint32_t resume_from[8];
    int reattach_flags[8];
};

static int64_t now_ms(void) {
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (int64_t)ts.tv_sec * 1000 + ts.tv_nsec / 1000000;
}

static void fake_send(struct zio_sock *s, const struct zio_parts *from, Llm__ClientEnvelope *env) {
    uint8_t *buf;
    size_t len;
    char err[128];
    if (proto_client_pack(env, &buf, &len, err, sizeof err) != 0) return;
    struct zio_frame f[2] = {{zio_parts_data(from, 0), zio_parts_size(from, 0), NULL, NULL},
                             {buf, len, proto_buf_free, NULL}};
    zio_send(s, f, 2, 0);
}

static void fake_accept(struct zio_sock *s, const struct zio_parts *from, uint64_t tag, const char *id,
                        bool reattached) {
    Llm__ClientEnvelope env = LLM__CLIENT_ENVELOPE__INIT;
    Llm__GenerateAccepted a = LLM__GENERATE_ACCEPTED__INIT;
    int32_t prompt[3] = {1, 400, 401};
    a.request_id = (char *)id;
    a.reattached = reattached;
    a.seed = 77;
    a.prompt_tokens = 3;
    a.prompt_token_ids = prompt;
    a.n_prompt_token_ids = 3;
    env.tag = tag;
    env.body_case = LLM__CLIENT_ENVELOPE__BODY_ACCEPTED;
    env.accepted = &a;
    fake_send(s, from, &env);
}

/* Tokens [first, first+n): token i is 100+i with text "t<i> ". */
static void fake_chunk(struct zio_sock *s, const struct zio_parts *from, const char *id, uint32_t first,
                       uint32_t n) {
    Llm__ClientEnvelope env = LLM__CLIENT_ENVELOPE__INIT;
    Llm__GenerateChunk ch = LLM__GENERATE_CHUNK__INIT;
    int32_t ids[32];
    char text[256] = "";
    for (uint32_t i = 0; i < n && i < 32; i++) {
        ids[i] = (int32_t)(100 + first + i);
        size_t l = strlen(text);
        snprintf(text + l, sizeof text - l, "t%u ", first + i);
    }
    ch.request_id = (char *)id;
    ch.index = first;
    ch.token_ids = ids;
    ch.n_token_ids = n;
    ch.text = text;
    env.body_case = LLM__CLIENT_ENVELOPE__BODY_CHUNK;
    env.chunk = &ch;
    fake_send(s, from, &env);
}

static void fake_done(struct zio_sock *s, const struct zio_parts *from, const char *id,
                      Llm__GenerateDone__FinishReason why, uint32_t n) {
    Llm__ClientEnvelope env = LLM__CLIENT_ENVELOPE__INIT;
    Llm__GenerateDone d = LLM__GENERATE_DONE__INIT;
    Llm__GenerateDone__Usage u = LLM__GENERATE_DONE__USAGE__INIT;
    u.prompt_tokens = 3;
    u.completion_tokens = n;
    d.request_id = (char *)id;
    d.finish_reason = why;
    d.usage = &u;
    d.stop_token = -1;
    env.body_case = LLM__CLIENT_ENVELOPE__BODY_DONE;
    env.done = &d;
    fake_send(s, from, &env);
}

static void fake_error(struct zio_sock *s, const struct zio_parts *from, uint64_t tag, const char *id,
                       Llm__Error__Code code, const char *msg, uint32_t retry_after) {
    uint8_t *buf;
    size_t len;
    if (proto_client_error_pack(tag, code, id, msg, retry_after, &buf, &len) != 0) return;
    struct zio_frame f[2] = {{zio_parts_data(from, 0), zio_parts_size(from, 0), NULL, NULL},
                             {buf, len, proto_buf_free, NULL}};
    zio_send(s, f, 2, 0);
}

static struct zio_sock *fake_bind(void *ctx, const char *ep) {
    struct zio_sock *s = NULL;
    char err[128];
    if (zio_sock_open(ctx, ZMQ_ROUTER, &s, err, sizeof err) != 0) return NULL;
    zio_set_int(s, ZMQ_LINGER, 0);
    /* The old listener closes in ZeroMQ's I/O thread: retry for a while. */
    for (int i = 0; i < 200; i++) {
        if (zio_bind(s, ep) == 0) return s;
        usleep(10000);
    }
    zio_sock_close(s);
    return NULL;
}

static void *fake_main(void *arg) {
    struct fake *f = arg;
    void *ctx = zmq_ctx_new();
    struct zio_sock *s = fake_bind(ctx, f->ep);
    struct zio_parts in = {0};
    bool silent_done = false, restarted = false;
    int errors = 0;
    /* FAKE_SLOW state */
    char slow_id[PROTO_REQUEST_ID_MAX + 1] = "";
    struct zio_parts slow_from = {0};
    uint32_t slow_next = 0;
    int64_t slow_at = 0;
    while (s && !atomic_load(&f->stop)) {
        if (slow_id[0] && now_ms() >= slow_at && slow_next < 1000) {
            fake_chunk(s, &slow_from, slow_id, slow_next++, 1);
            slow_at = now_ms() + 20;
        }
        if (zio_recv(s, &in, 10) != 0) continue;
        if (in.n != 2) continue;
        Llm__ClientEnvelope *env;
        char err[128];
        if (proto_client_unpack(zio_parts_data(&in, 1), zio_parts_size(&in, 1), &env, err, sizeof err) != 0)
            continue;
        if (env->body_case == LLM__CLIENT_ENVELOPE__BODY_STATUS) {
            f->n_status++;
            Llm__ClientEnvelope r = LLM__CLIENT_ENVELOPE__INIT;
            Llm__StatusReply sr = LLM__STATUS_REPLY__INIT;
            sr.queue_depth = 7;
            sr.kv_blocks_total = 64;
            r.tag = env->tag;
            r.body_case = LLM__CLIENT_ENVELOPE__BODY_STATUS_REPLY;
            r.status_reply = &sr;
            fake_send(s, &in, &r);
        } else if (env->body_case == LLM__CLIENT_ENVELOPE__BODY_HEALTH) {
            Llm__ClientEnvelope r = LLM__CLIENT_ENVELOPE__INIT;
            Llm__HealthReply hr = LLM__HEALTH_REPLY__INIT;
            hr.status = LLM__HEALTH_REPLY__SERVING_STATUS__SERVING;
            r.tag = env->tag;
            r.body_case = LLM__CLIENT_ENVELOPE__BODY_HEALTH_REPLY;
            r.health_reply = &hr;
            fake_send(s, &in, &r);
        } else if (env->body_case == LLM__CLIENT_ENVELOPE__BODY_CANCEL) {
            f->n_cancels++;
            if (slow_id[0] && strcmp(slow_id, env->cancel->request_id) == 0) {
                fake_done(s, &slow_from, slow_id, LLM__GENERATE_DONE__FINISH_REASON__CANCELLED, slow_next);
                slow_id[0] = 0;
            } else {
                fake_error(s, &in, env->tag, env->cancel->request_id, LLM__ERROR__CODE__NOT_FOUND,
                           "no such request", 0);
            }
        } else if (env->body_case == LLM__CLIENT_ENVELOPE__BODY_GENERATE) {
            const Llm__GenerateRequest *g = env->generate;
            int k = f->n_generates++;
            if (k < 8) f->resume_from[k] = g->resume_from;
            switch (f->mode) {
            case FAKE_STREAM:
                fake_accept(s, &in, env->tag, g->request_id, false);
                for (uint32_t i = g->resume_from; i < FAKE_N_TOKENS; i++) fake_chunk(s, &in, g->request_id, i, 1);
                fake_done(s, &in, g->request_id, LLM__GENERATE_DONE__FINISH_REASON__LENGTH, FAKE_N_TOKENS);
                break;
            case FAKE_RESTART:
                if (!restarted) {
                    fake_accept(s, &in, env->tag, g->request_id, false);
                    for (uint32_t i = 0; i < 5; i++) fake_chunk(s, &in, g->request_id, i, 1);
                    usleep(100000); /* let the chunks leave before the "crash" */
                    zio_sock_close(s);
                    usleep(200000);
                    s = fake_bind(ctx, f->ep);
                    restarted = true;
                } else {
                    fake_accept(s, &in, env->tag, g->request_id, true);
                    /* A replay that starts earlier than asked: the client drops it. */
                    fake_chunk(s, &in, g->request_id, 3, 2);
                    for (uint32_t i = g->resume_from; i < FAKE_N_TOKENS; i += 3) {
                        uint32_t n = FAKE_N_TOKENS - i < 3 ? FAKE_N_TOKENS - i : 3;
                        fake_chunk(s, &in, g->request_id, i, n);
                    }
                    fake_done(s, &in, g->request_id, LLM__GENERATE_DONE__FINISH_REASON__LENGTH, FAKE_N_TOKENS);
                }
                break;
            case FAKE_SILENT:
                fake_accept(s, &in, env->tag, g->request_id, silent_done);
                if (silent_done) {
                    for (uint32_t i = g->resume_from; i < FAKE_N_TOKENS; i++) fake_chunk(s, &in, g->request_id, i, 1);
                    fake_done(s, &in, g->request_id, LLM__GENERATE_DONE__FINISH_REASON__STOP, FAKE_N_TOKENS);
                }
                silent_done = true;
                break;
            case FAKE_ERROR:
                if (errors++ == 0)
                    fake_error(s, &in, env->tag, g->request_id, LLM__ERROR__CODE__UNAVAILABLE, "no pipeline yet", 50);
                else
                    fake_error(s, &in, env->tag, g->request_id, LLM__ERROR__CODE__INVALID_ARGUMENT,
                               "sampling.top_p = 1.5 is outside [0, 1]", 0);
                break;
            case FAKE_MUTE:
                fake_accept(s, &in, env->tag, g->request_id, k > 0);
                break;
            case FAKE_STALL:
                fake_accept(s, &in, env->tag, g->request_id, k > 0);
                for (uint32_t i = g->resume_from; i < FAKE_N_TOKENS; i++) {
                    fake_chunk(s, &in, g->request_id, i, 1);
                    if (i == 0 && k == 0) {
                        fake_error(s, &in, 0, g->request_id, LLM__ERROR__CODE__UNAVAILABLE,
                                   "no pipeline is in service: the request is kept", 2000);
                        usleep(100 * 1000); /* a pipeline comes back */
                    }
                }
                fake_done(s, &in, g->request_id, LLM__GENERATE_DONE__FINISH_REASON__LENGTH, FAKE_N_TOKENS);
                break;
            case FAKE_SHORT:
            case FAKE_SHORT_ALWAYS: {
                /* A stream that loses its last tokens (the router's replay
                 * skipped them), then ends counting all of them. */
                const uint32_t end = f->mode == FAKE_SHORT && k > 0 ? FAKE_N_TOKENS : 5;
                fake_accept(s, &in, env->tag, g->request_id, k > 0);
                for (uint32_t i = g->resume_from; i < end; i++) fake_chunk(s, &in, g->request_id, i, 1);
                fake_done(s, &in, g->request_id, LLM__GENERATE_DONE__FINISH_REASON__LENGTH, FAKE_N_TOKENS);
                break;
            }
            case FAKE_SLOW:
                fake_accept(s, &in, env->tag, g->request_id, false);
                snprintf(slow_id, sizeof slow_id, "%s", g->request_id);
                zio_parts_free(&slow_from);
                /* keep the routing id of the connection */
                slow_from = in;
                memset(&in, 0, sizeof in);
                slow_at = now_ms();
                break;
            }
        }
        proto_client_free(env);
    }
    zio_parts_free(&in);
    zio_parts_free(&slow_from);
    zio_sock_close(s);
    zmq_ctx_term(ctx);
    return NULL;
}

static void fake_start(struct fake *f, enum fake_mode mode) {
    memset(f, 0, sizeof *f);
    f->mode = mode;
    char err[128];
    ASSERT_OK(zio_free_port(NULL, &f->port, err, sizeof err));
    snprintf(f->ep, sizeof f->ep, "tcp://127.0.0.1:%d", f->port);
    ASSERT_EQ(0, pthread_create(&f->th, NULL, fake_main, f));
}

static void fake_stop(struct fake *f) {
    atomic_store(&f->stop, 1);
    pthread_join(f->th, NULL);
}

static llm_client *open_client(const char *ep, int reply_ms, int idle_ms, int retry_ms) {
    const char *eps[1] = {ep};
    struct llm_client_config cfg;
    llm_client_config_default(&cfg);
    cfg.insecure = true; /* the test's routers are plain sockets */
    cfg.endpoints = eps;
    cfg.n_endpoints = 1;
    cfg.reply_timeout_ms = reply_ms;
    cfg.idle_timeout_ms = idle_ms;
    cfg.retry_ms = retry_ms;
    llm_client *c = NULL;
    char err[256];
    int rc = llm_client_open(&c, &cfg, err, sizeof err);
    if (rc != 0) TEST_FAIL("llm_client_open: %s", err);
    return c;
}

/* Collects what the callback saw. */
struct seen {
    int32_t ids[64];
    int n;
    char text[512];
    int calls, cancel_after;
    int first_sleep_ms; /* the callback takes this long over the first chunk */
};

static int on_chunk(void *ud, const struct llm_chunk *ch) {
    struct seen *s = ud;
    s->calls++;
    if (s->calls == 1 && s->first_sleep_ms > 0) usleep((useconds_t)s->first_sleep_ms * 1000);
    if ((uint32_t)s->n != ch->index) return 0; /* would be a duplicate or a gap: the check below sees it */
    for (size_t i = 0; i < ch->n_tokens && s->n < 64; i++) s->ids[s->n++] = ch->token_ids[i];
    strncat(s->text, ch->text, sizeof s->text - strlen(s->text) - 1);
    return s->cancel_after > 0 && s->n >= s->cancel_after;
}

static void expect_tokens(const struct seen *s, int n) {
    ASSERT_EQ(n, s->n);
    char want[512] = "";
    for (int i = 0; i < n; i++) {
        ASSERT_EQ(100 + i, s->ids[i]);
        size_t l = strlen(want);
        snprintf(want + l, sizeof want - l, "t%d ", i);
    }
    ASSERT_STREQ(want, s->text);
}

/* One generation of "hello" as request id against a scripted router in
 * mode, by a client of the given timeouts: the router stopped before it
 * returns, the client left open for the checks (gen_end closes it). */
struct gen_run {
    struct fake f;
    llm_client *c;
    int rc;
    int64_t took_ms;
    struct llm_generate_result r;
};

static void gen_with_fake(struct gen_run *g, enum fake_mode mode, const char *id, int reply_ms, int idle_ms,
                          int retry_ms, struct seen *s) {
    fake_start(&g->f, mode);
    g->c = open_client(g->f.ep, reply_ms, idle_ms, retry_ms);
    struct llm_generate_params p;
    llm_generate_params_default(&p);
    p.prompt = "hello";
    p.request_id = id;
    int64_t t0 = now_ms();
    g->rc = llm_client_generate(g->c, &p, on_chunk, s, &g->r);
    g->took_ms = now_ms() - t0;
    fake_stop(&g->f);
}

static void gen_end(struct gen_run *g) {
    llm_generate_result_free(&g->r);
    llm_client_close(g->c);
}

TEST(client_generate_streams_tokens) {
    struct seen s = {0};
    struct gen_run g;
    gen_with_fake(&g, FAKE_STREAM, "req-stream-1", 2000, 5000, 5000, &s);
    ASSERT_OK(g.rc);
    expect_tokens(&s, FAKE_N_TOKENS);
    ASSERT_EQ(FAKE_N_TOKENS, s.calls);
    ASSERT_STREQ("req-stream-1", g.r.request_id);
    ASSERT_EQ((int)LLM__GENERATE_DONE__FINISH_REASON__LENGTH, (int)g.r.finish_reason);
    ASSERT_EQ((uint64_t)77, g.r.seed);
    ASSERT_EQ((size_t)3, g.r.n_prompt_ids);
    ASSERT_EQ(400, g.r.prompt_ids[1]);
    ASSERT_EQ((uint32_t)FAKE_N_TOKENS, g.r.completion_tokens);
    ASSERT_EQ((uint32_t)0, g.r.reattaches);
    gen_end(&g);
}

TEST(client_generate_makes_an_id) {
    struct fake f;
    fake_start(&f, FAKE_STREAM);
    llm_client *c = open_client(f.ep, 2000, 5000, 5000);
    struct llm_generate_params p;
    llm_generate_params_default(&p);
    p.prompt = "hello";
    struct llm_generate_result r1, r2;
    int rc1 = llm_client_generate(c, &p, NULL, NULL, &r1);
    int rc2 = llm_client_generate(c, &p, NULL, NULL, &r2);
    fake_stop(&f);
    ASSERT_OK(rc1);
    ASSERT_OK(rc2);
    ASSERT_EQ((size_t)36, strlen(r1.request_id));
    ASSERT_EQ('4', r1.request_id[14]);
    ASSERT_TRUE(strcmp(r1.request_id, r2.request_id) != 0);
    llm_generate_result_free(&r1);
    llm_generate_result_free(&r2);
    llm_client_close(c);
}

TEST(client_reattaches_after_router_restart) {
    struct seen s = {0};
    struct gen_run g;
    gen_with_fake(&g, FAKE_RESTART, "req-restart", 2000, 10000, 10000, &s);
    ASSERT_OK(g.rc);
    expect_tokens(&s, FAKE_N_TOKENS);
    ASSERT_EQ(2, g.f.n_generates);
    ASSERT_EQ((uint32_t)0, g.f.resume_from[0]);
    ASSERT_EQ((uint32_t)5, g.f.resume_from[1]);
    ASSERT_TRUE(g.r.reattaches >= 1);
    ASSERT_EQ((uint32_t)2, g.r.duplicates_dropped);
    ASSERT_EQ(false, g.r.reattached); /* the first Accepted said new */
    /* The monitor saw the disconnect: no idle timeout (10 s) was waited out. */
    ASSERT_TRUE(g.took_ms < 5000);
    gen_end(&g);
}

/* The same restart while the caller is busy with the first chunk: the
 * other chunks and the disconnect are all waiting when the client looks
 * again.  It reads the chunks, then re-attaches at once; it used to forget
 * the disconnect behind the chunks and wait out the idle timeout (10 s). */
TEST(client_reattaches_after_router_restart_behind_chunks) {
    struct seen s = {.first_sleep_ms = 250};
    struct gen_run g;
    gen_with_fake(&g, FAKE_RESTART, "req-restart-busy", 2000, 10000, 20000, &s);
    printf("  restart behind 4 waiting chunks: done in %lld ms (idle timeout 10000 ms)\n", (long long)g.took_ms);
    ASSERT_OK(g.rc);
    expect_tokens(&s, FAKE_N_TOKENS);
    ASSERT_EQ(2, g.f.n_generates);
    ASSERT_EQ((uint32_t)5, g.f.resume_from[1]);
    ASSERT_TRUE(g.took_ms < 5000);
    gen_end(&g);
}

/* A stall notice (UNAVAILABLE with retry_after_ms for a request the router
 * keeps) makes the client send again after the pause, but it reads
 * meanwhile: the tokens the router streams once a pipeline is back are
 * passed on as they come (here 100 ms later), not after the 2 s pause, and
 * then nothing is sent again. */
TEST(client_reads_through_a_stall_notice) {
    struct seen s = {0};
    struct gen_run g;
    gen_with_fake(&g, FAKE_STALL, "req-stall", 2000, 10000, 20000, &s);
    printf("  stall notice (retry after 2000 ms), tokens again 100 ms later: done in %lld ms\n",
           (long long)g.took_ms);
    ASSERT_OK(g.rc);
    expect_tokens(&s, FAKE_N_TOKENS);
    ASSERT_EQ(1, g.f.n_generates);
    ASSERT_TRUE(g.took_ms < 1500);
    gen_end(&g);
}

TEST(client_reattaches_after_silence) {
    struct seen s = {0};
    struct gen_run g;
    gen_with_fake(&g, FAKE_SILENT, "req-silent", 2000, 300, 5000, &s);
    ASSERT_OK(g.rc);
    expect_tokens(&s, FAKE_N_TOKENS);
    ASSERT_EQ(2, g.f.n_generates);
    ASSERT_EQ((int)LLM__GENERATE_DONE__FINISH_REASON__STOP, (int)g.r.finish_reason);
    gen_end(&g);
}

/* A GenerateDone that counts more tokens than arrived: the client asks for
 * the rest (resume_from = what it has) instead of ending short, and fails,
 * naming both counts, when the router never sends them. */
TEST(client_reattaches_after_a_short_end) {
    struct seen s = {0};
    struct gen_run g;
    gen_with_fake(&g, FAKE_SHORT, "req-short-1", 2000, 5000, 5000, &s);
    ASSERT_OK(g.rc);
    expect_tokens(&s, FAKE_N_TOKENS);
    ASSERT_EQ(2, g.f.n_generates);
    ASSERT_EQ((uint32_t)5, g.f.resume_from[1]);
    ASSERT_EQ((uint32_t)1, g.r.reattaches);
    ASSERT_EQ((uint32_t)FAKE_N_TOKENS, g.r.completion_tokens);
    gen_end(&g);

    struct seen s2 = {0};
    gen_with_fake(&g, FAKE_SHORT_ALWAYS, "req-short-2", 2000, 5000, 5000, &s2);
    ASSERT_EQ(STATUS_PROTOCOL, g.rc);
    ASSERT_EQ(4, g.f.n_generates); /* the first and three re-attaches */
    ASSERT_EQ(5, s2.n);
    const char *e = llm_client_errstr(g.c);
    if (!strstr(e, "req-short-2") || !strstr(e, "ended at 12 tokens but 5 arrived"))
        TEST_FAIL("error does not name the request and the counts: %s", e);
    gen_end(&g);
}

TEST(client_error_reply_has_its_code) {
    struct seen s = {0};
    struct gen_run g;
    gen_with_fake(&g, FAKE_ERROR, "req-bad", 2000, 5000, 5000, &s);
    /* UNAVAILABLE with retry_after was retried; INVALID_ARGUMENT was not. */
    ASSERT_EQ(2, g.f.n_generates);
    ASSERT_EQ(STATUS_BAD_INPUT, g.rc);
    ASSERT_EQ((int)LLM__ERROR__CODE__INVALID_ARGUMENT, (int)llm_client_error_code(g.c));
    ASSERT_TRUE(strstr(llm_client_errstr(g.c), "INVALID_ARGUMENT") != NULL);
    ASSERT_TRUE(strstr(llm_client_errstr(g.c), "top_p = 1.5") != NULL);
    ASSERT_TRUE(strstr(llm_client_errstr(g.c), "req-bad") != NULL);
    ASSERT_EQ(0, s.calls);
    gen_end(&g);
}

TEST(client_callback_cancels) {
    struct fake f;
    fake_start(&f, FAKE_SLOW);
    llm_client *c = open_client(f.ep, 2000, 5000, 5000);
    struct llm_generate_params p;
    llm_generate_params_default(&p);
    p.prompt = "hello";
    p.request_id = "req-cancel";
    struct seen s = {0};
    s.cancel_after = 3;
    struct llm_generate_result r;
    int rc = llm_client_generate(c, &p, on_chunk, &s, &r);
    fake_stop(&f);
    ASSERT_OK(rc);
    ASSERT_EQ((int)LLM__GENERATE_DONE__FINISH_REASON__CANCELLED, (int)r.finish_reason);
    ASSERT_EQ(1, f.n_cancels);
    ASSERT_EQ(3, s.calls); /* nothing after the callback asked to stop */
    llm_generate_result_free(&r);
    llm_client_close(c);
}

TEST(client_wait_bounds_the_call) {
    struct fake f;
    fake_start(&f, FAKE_MUTE);
    llm_client *c = open_client(f.ep, 2000, 200, 5000);
    struct llm_generate_params p;
    llm_generate_params_default(&p);
    p.prompt = "hello";
    p.request_id = "req-mute";
    p.wait_ms = 700;
    struct llm_generate_result r;
    int64_t t0 = now_ms();
    int rc = llm_client_generate(c, &p, NULL, NULL, &r);
    int64_t took = now_ms() - t0;
    fake_stop(&f);
    ASSERT_EQ(STATUS_TIMEOUT, rc);
    ASSERT_TRUE(took >= 700 && took < 2000);
    ASSERT_TRUE(f.n_generates >= 2); /* the idle timeout re-attached meanwhile */
    ASSERT_TRUE(strstr(llm_client_errstr(c), "req-mute") != NULL);
    llm_generate_result_free(&r);
    llm_client_close(c);
}

TEST(client_status_and_unknown_cancel) {
    struct fake f;
    fake_start(&f, FAKE_STREAM);
    llm_client *c = open_client(f.ep, 2000, 5000, 5000);
    Llm__ClientEnvelope *env = NULL;
    int rc = llm_client_status(c, &env);
    int rc2 = llm_client_cancel(c, "nobody", NULL);
    fake_stop(&f);
    ASSERT_OK(rc);
    ASSERT_EQ((uint32_t)7, env->status_reply->queue_depth);
    ASSERT_EQ((uint64_t)64, env->status_reply->kv_blocks_total);
    proto_client_free(env);
    ASSERT_EQ(STATUS_NOT_FOUND, rc2);
    ASSERT_EQ((int)LLM__ERROR__CODE__NOT_FOUND, (int)llm_client_error_code(c));
    llm_client_close(c);
}

TEST(client_unreachable_router_times_out) {
    char err[128];
    int port;
    ASSERT_OK(zio_free_port(NULL, &port, err, sizeof err));
    char ep[64];
    snprintf(ep, sizeof ep, "tcp://127.0.0.1:%d", port);
    llm_client *c = open_client(ep, 200, 1000, 700);
    Llm__ClientEnvelope *env = (Llm__ClientEnvelope *)1;
    int64_t t0 = now_ms();
    int rc = llm_client_health(c, &env);
    int64_t took = now_ms() - t0;
    ASSERT_EQ(STATUS_UNAVAILABLE, rc);
    ASSERT_TRUE(env == NULL);
    ASSERT_TRUE(took >= 600 && took < 3000);
    ASSERT_TRUE(strstr(llm_client_errstr(c), ep) != NULL);
    struct llm_generate_params p;
    llm_generate_params_default(&p);
    p.prompt = "x";
    struct llm_generate_result r;
    rc = llm_client_generate(c, &p, NULL, NULL, &r);
    ASSERT_EQ(STATUS_UNAVAILABLE, rc);
    ASSERT_TRUE(llm_client_reconnects(c) >= 1);
    llm_generate_result_free(&r);
    llm_client_close(c);
}

TEST(client_retry_bounds_the_wait) {
    /* retry_ms shorter than reply_timeout_ms: the call ends at retry_ms,
     * not after a whole reply timeout. */
    char err[128];
    int port;
    ASSERT_OK(zio_free_port(NULL, &port, err, sizeof err));
    char ep[64];
    snprintf(ep, sizeof ep, "tcp://127.0.0.1:%d", port);
    llm_client *c = open_client(ep, 3000, 5000, 600);
    struct llm_generate_params p;
    llm_generate_params_default(&p);
    p.prompt = "x";
    struct llm_generate_result r;
    int64_t t0 = now_ms();
    int rc = llm_client_generate(c, &p, NULL, NULL, &r);
    int64_t took = now_ms() - t0;
    ASSERT_EQ(STATUS_UNAVAILABLE, rc);
    ASSERT_TRUE(took >= 550 && took < 1500);
    llm_generate_result_free(&r);
    Llm__ClientEnvelope *env = NULL;
    t0 = now_ms();
    rc = llm_client_status(c, &env);
    took = now_ms() - t0;
    ASSERT_EQ(STATUS_UNAVAILABLE, rc);
    ASSERT_TRUE(took >= 550 && took < 1500);
    /* The probe answers in its own time, whatever retry_ms says. */
    t0 = now_ms();
    ASSERT_EQ(STATUS_UNAVAILABLE, llm_client_probe(c, 300));
    took = now_ms() - t0;
    ASSERT_TRUE(took >= 250 && took < 1000);
    ASSERT_TRUE(strstr(llm_client_errstr(c), ep) != NULL);
    llm_client_close(c);
}

TEST(client_probe_finds_a_router) {
    struct fake f;
    fake_start(&f, FAKE_STREAM);
    llm_client *c = open_client(f.ep, 2000, 5000, 5000);
    int rc = llm_client_probe(c, 2000);
    fake_stop(&f);
    ASSERT_OK(rc);
    llm_client_close(c);
}

TEST(client_moves_to_the_next_endpoint) {
    struct fake f;
    fake_start(&f, FAKE_STREAM);
    char err[128], dead[64];
    int port;
    ASSERT_OK(zio_free_port(NULL, &port, err, sizeof err));
    snprintf(dead, sizeof dead, "tcp://127.0.0.1:%d", port);
    const char *eps[2] = {dead, f.ep};
    struct llm_client_config cfg;
    llm_client_config_default(&cfg);
    cfg.insecure = true; /* the test's routers are plain sockets */
    cfg.endpoints = eps;
    cfg.n_endpoints = 2;
    cfg.reply_timeout_ms = 300;
    cfg.retry_ms = 5000;
    llm_client *c = NULL;
    ASSERT_OK(llm_client_open(&c, &cfg, err, sizeof err));
    struct llm_generate_params p;
    llm_generate_params_default(&p);
    p.prompt = "hello";
    p.request_id = "req-failover";
    struct seen s = {0};
    struct llm_generate_result r;
    int rc = llm_client_generate(c, &p, on_chunk, &s, &r);
    Llm__ClientEnvelope *env = NULL;
    int rc2 = llm_client_status(c, &env); /* stays on the endpoint that answers */
    fake_stop(&f);
    ASSERT_OK(rc);
    expect_tokens(&s, FAKE_N_TOKENS);
    ASSERT_STREQ(f.ep, llm_client_endpoint(c));
    ASSERT_EQ((uint32_t)1, llm_client_reconnects(c));
    ASSERT_OK(rc2);
    proto_client_free(env);
    llm_generate_result_free(&r);
    llm_client_close(c);
}

/* A client of two endpoints whose first refuses the connection (no router
 * listens there: one that is down) moves on at once, not after a reply
 * timeout; with both refusing it pauses between rounds (no busy loop of
 * sockets) and gives up at retry_ms. */
TEST(client_moves_on_from_a_refused_connection) {
    struct fake f;
    fake_start(&f, FAKE_STREAM);
    char err[128], dead[64], dead2[64];
    int port, port2;
    ASSERT_OK(zio_free_port(NULL, &port, err, sizeof err));
    ASSERT_OK(zio_free_port(NULL, &port2, err, sizeof err));
    snprintf(dead, sizeof dead, "tcp://127.0.0.1:%d", port);
    snprintf(dead2, sizeof dead2, "tcp://127.0.0.1:%d", port2);
    const char *eps[2] = {dead, f.ep};
    struct llm_client_config cfg;
    llm_client_config_default(&cfg);
    cfg.insecure = true; /* the test's routers are plain sockets */
    cfg.endpoints = eps;
    cfg.n_endpoints = 2;
    cfg.reply_timeout_ms = 10000;
    cfg.retry_ms = 20000;
    llm_client *c = NULL;
    ASSERT_OK(llm_client_open(&c, &cfg, err, sizeof err));
    struct llm_generate_params p;
    llm_generate_params_default(&p);
    p.prompt = "hello";
    p.request_id = "req-refused";
    struct seen s = {0};
    struct llm_generate_result r;
    int64_t t0 = now_ms();
    int rc = llm_client_generate(c, &p, on_chunk, &s, &r);
    int64_t took = now_ms() - t0;
    llm_generate_result_free(&r);
    llm_client_close(c);
    /* Status the same way, from a new client. */
    ASSERT_OK(llm_client_open(&c, &cfg, err, sizeof err));
    Llm__ClientEnvelope *env = NULL;
    t0 = now_ms();
    int rc2 = llm_client_status(c, &env);
    int64_t took2 = now_ms() - t0;
    fake_stop(&f);
    printf("  first endpoint refused: generate served in %lld ms, status in %lld ms (reply timeout %d ms)\n",
           (long long)took, (long long)took2, cfg.reply_timeout_ms);
    ASSERT_OK(rc);
    expect_tokens(&s, FAKE_N_TOKENS);
    ASSERT_TRUE(took < 2000);
    ASSERT_OK(rc2);
    ASSERT_TRUE(took2 < 2000);
    ASSERT_STREQ(f.ep, llm_client_endpoint(c));
    proto_client_free(env);
    llm_client_close(c);

    /* Both refuse: rounds of two sockets with a 200 ms pause after each,
     * until retry_ms (1500). */
    const char *eps2[2] = {dead, dead2};
    cfg.endpoints = eps2;
    cfg.retry_ms = 1500;
    ASSERT_OK(llm_client_open(&c, &cfg, err, sizeof err));
    t0 = now_ms();
    rc = llm_client_generate(c, &p, NULL, NULL, &r);
    took = now_ms() - t0;
    uint32_t reconnects = llm_client_reconnects(c);
    printf("  both refused: generate gave up after %lld ms, %u reconnects: %s\n", (long long)took, reconnects,
           llm_client_errstr(c));
    ASSERT_EQ(STATUS_UNAVAILABLE, rc);
    ASSERT_TRUE(took >= 1400 && took < 5000);
    ASSERT_TRUE(reconnects >= 2 && reconnects <= 40);
    llm_generate_result_free(&r);
    llm_client_close(c);
}

TEST(client_refuses_bad_config_and_ids) {
    llm_client *c = (llm_client *)1;
    char err[256];
    struct llm_client_config cfg;
    llm_client_config_default(&cfg);
    ASSERT_EQ(STATUS_BAD_INPUT, llm_client_open(&c, &cfg, err, sizeof err));
    ASSERT_TRUE(c == NULL);
    const char *bad[1] = {"localhost:5555"};
    cfg.endpoints = bad;
    cfg.n_endpoints = 1;
    ASSERT_EQ(STATUS_BAD_INPUT, llm_client_open(&c, &cfg, err, sizeof err));
    ASSERT_TRUE(strstr(err, "localhost:5555") != NULL);
    c = open_client("tcp://127.0.0.1:9", 100, 100, 100);
    struct llm_generate_params p;
    llm_generate_params_default(&p);
    p.prompt = "x";
    p.request_id = "has space";
    struct llm_generate_result r;
    ASSERT_EQ(STATUS_BAD_INPUT, llm_client_generate(c, &p, NULL, NULL, &r));
    ASSERT_TRUE(strstr(llm_client_errstr(c), "0x20") != NULL);
    llm_client_close(c);
}

TEST_MAIN(client_generate_streams_tokens, client_generate_makes_an_id, client_reattaches_after_router_restart,
          client_reattaches_after_a_short_end,
          client_reattaches_after_router_restart_behind_chunks, client_reads_through_a_stall_notice,
          client_reattaches_after_silence, client_error_reply_has_its_code, client_callback_cancels,
          client_wait_bounds_the_call, client_status_and_unknown_cancel, client_unreachable_router_times_out, client_retry_bounds_the_wait, client_probe_finds_a_router,
          client_moves_to_the_next_endpoint, client_moves_on_from_a_refused_connection,
          client_refuses_bad_config_and_ids)
