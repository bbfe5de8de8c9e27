/* Tests of the stage-to-stage links: the ZeroMQ link on loopback (ordered
 * delivery matched by step id, stale and early messages, skip markers,
 * epochs, large buffers, size mismatches, malformed messages dropped and
 * counted without failing the step, a vanished peer giving a bounded
 * error, CURVE admitting only the predecessor's key), the wire's element
 * encoding (link_encode / link_decode), the Redis exchange that makes the
 * two ends of an NCCL link agree on it, and the NCCL link between two GPUs
 * with every element type (skipped without them). */
#include "tests/test.h"

#include "common/rconn.h"
#include "common/status.h"
#include "common/zio.h"
#include "kernels/backend.h"
#include "tests/redis_fixture.h"
#include "worker/link.h"

#include <arpa/inet.h>
#include <netinet/in.h>
#include <pthread.h>
#include <stdatomic.h>
#include <sys/socket.h>
#include <unistd.h>
#include <time.h>
#include <zmq.h>

static int64_t t_now_ms(void) {
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (int64_t)ts.tv_sec * 1000 + ts.tv_nsec / 1000000;
}

struct t_pair {
    void *ctx;
    link_conn *rx, *tx;
};

static void t_pair_open(struct t_pair *p, int timeout_ms) {
    char err[512];
    p->ctx = zmq_ctx_new();
    ASSERT_TRUE(p->ctx != NULL);
    int rc = link_zmq_init(&p->rx, p->ctx, LINK_RECV, "tcp://127.0.0.1:*", timeout_ms, err, sizeof err);
    if (rc < 0) TEST_FAIL("receiver: %s", err);
    ASSERT_TRUE(strncmp(link_endpoint(p->rx), "tcp://127.0.0.1:", 16) == 0);
    rc = link_zmq_init(&p->tx, p->ctx, LINK_SEND, link_endpoint(p->rx), timeout_ms, err, sizeof err);
    if (rc < 0) TEST_FAIL("sender: %s", err);
    ASSERT_STREQ("zmq", link_kind(p->tx));
    ASSERT_EQ(0, link_on_device(p->tx));
}

static void t_pair_close(struct t_pair *p) {
    link_free(p->tx);
    link_free(p->rx);
    p->tx = p->rx = NULL;
    if (p->ctx) zmq_ctx_term(p->ctx);
    p->ctx = NULL;
}

static void t_fill(float *x, size_t n, float base) {
    for (size_t i = 0; i < n; i++) x[i] = base + (float)i * 0.25f;
}

TEST(link_zmq_ordered_by_step) {
    struct t_pair p = {0};
    t_pair_open(&p, 2000);
    float out[64], in[64];
    for (uint64_t step = 10; step < 15; step++) {
        t_fill(out, 64, (float)step);
        ASSERT_OK(link_send(p.tx, step, out, sizeof out));
    }
    for (uint64_t step = 10; step < 15; step++) {
        memset(in, 0, sizeof in);
        ASSERT_OK(link_recv(p.rx, step, in, sizeof in));
        ASSERT_EQ((float)step, in[0]);
        ASSERT_EQ((float)step + 63 * 0.25f, in[63]);
    }
    t_pair_close(&p);
}

TEST(link_zmq_stale_dropped_early_kept) {
    struct t_pair p = {0};
    t_pair_open(&p, 2000);
    float out[8], in[8];
    /* Steps 1 and 2 belong to plans the receiver dropped: it asks for 3. */
    for (uint64_t step = 1; step <= 3; step++) {
        t_fill(out, 8, (float)step);
        ASSERT_OK(link_send(p.tx, step, out, sizeof out));
    }
    ASSERT_OK(link_recv(p.rx, 3, in, sizeof in));
    ASSERT_EQ(3.0f, in[0]);
    /* The sender skipped step 4 (it failed there, say) and sent 5: asking
     * for 4 says so, and 5 is still delivered afterwards. */
    t_fill(out, 8, 5.0f);
    ASSERT_OK(link_send(p.tx, 5, out, sizeof out));
    ASSERT_EQ(STATUS_NOT_FOUND, link_recv(p.rx, 4, in, sizeof in));
    ASSERT_TRUE(strstr(link_errstr(p.rx), "step 4") != NULL);
    ASSERT_OK(link_recv(p.rx, 5, in, sizeof in));
    ASSERT_EQ(5.0f, in[0]);
    t_pair_close(&p);
}

TEST(link_zmq_skip_marker) {
    struct t_pair p = {0};
    t_pair_open(&p, 2000);
    float in[4] = {7, 7, 7, 7};
    ASSERT_OK(link_send(p.tx, 9, NULL, 0));
    ASSERT_EQ(LINK_SKIPPED, link_recv(p.rx, 9, in, sizeof in));
    ASSERT_EQ(7.0f, in[0]); /* untouched */
    t_pair_close(&p);
}

TEST(link_zmq_older_epoch_dropped) {
    struct t_pair p = {0};
    t_pair_open(&p, 2000);
    float out[4] = {1, 2, 3, 4}, in[4] = {0};
    link_set_epoch(p.tx, 1);
    ASSERT_OK(link_send(p.tx, 100, out, sizeof out));
    link_set_epoch(p.tx, 2);
    out[0] = 42;
    ASSERT_OK(link_send(p.tx, 1, out, sizeof out));
    /* After a re-form the step ids may start again lower: the epoch decides. */
    link_set_epoch(p.rx, 2);
    ASSERT_OK(link_recv(p.rx, 1, in, sizeof in));
    ASSERT_EQ(42.0f, in[0]);
    t_pair_close(&p);
}

/* Without keys anyone reaching the port can send: a message of a later
 * epoch, or of a step far ahead, must not stand in the way of the steps the
 * receiver waits for (it used to be held, failing every later step). */
TEST(link_zmq_forged_future_never_blocks) {
    struct t_pair p = {0};
    t_pair_open(&p, 2000);
    float out[4] = {1, 2, 3, 4}, in[4] = {0};
    link_set_epoch(p.tx, 9223372036854775807ULL);
    ASSERT_OK(link_send(p.tx, 1, out, sizeof out));
    link_set_epoch(p.tx, 3);
    ASSERT_OK(link_send(p.tx, 1000000, out, sizeof out)); /* far ahead */
    out[0] = 42;
    ASSERT_OK(link_send(p.tx, 1, out, sizeof out));
    link_set_epoch(p.rx, 3);
    ASSERT_OK(link_recv(p.rx, 1, in, sizeof in));
    ASSERT_EQ(42.0f, in[0]);
    out[0] = 43;
    ASSERT_OK(link_send(p.tx, 2, out, sizeof out));
    ASSERT_OK(link_recv(p.rx, 2, in, sizeof in));
    ASSERT_EQ(43.0f, in[0]);
    t_pair_close(&p);
}

/* A predecessor given its new placement first sends the new epoch's step
 * while the receiver still waits in the old one: it is kept for the new
 * epoch, and the old step still arrives. */
TEST(link_zmq_later_epoch_kept_for_its_turn) {
    struct t_pair p = {0};
    t_pair_open(&p, 2000);
    float out[4] = {5, 0, 0, 0}, in[4] = {0};
    link_set_epoch(p.tx, 2);
    ASSERT_OK(link_send(p.tx, 1, out, sizeof out));
    link_set_epoch(p.tx, 1);
    out[0] = 7;
    ASSERT_OK(link_send(p.tx, 8, out, sizeof out));
    link_set_epoch(p.rx, 1);
    ASSERT_OK(link_recv(p.rx, 8, in, sizeof in));
    ASSERT_EQ(7.0f, in[0]);
    link_set_epoch(p.rx, 2);
    ASSERT_OK(link_recv(p.rx, 1, in, sizeof in));
    ASSERT_EQ(5.0f, in[0]);
    t_pair_close(&p);
}

TEST(link_zmq_large_buffer) {
    struct t_pair p = {0};
    t_pair_open(&p, 5000);
    size_t n = (size_t)4 << 20; /* 16 MiB of floats: a 512-token prefill of a 8192-wide model */
    float *out = malloc(n * sizeof *out), *in = malloc(n * sizeof *in);
    ASSERT_TRUE(out && in);
    t_fill(out, n, -3.0f);
    ASSERT_OK(link_send(p.tx, 1, out, n * sizeof *out));
    ASSERT_OK(link_recv(p.rx, 1, in, n * sizeof *in));
    ASSERT_TRUE(memcmp(out, in, n * sizeof *in) == 0);
    free(out);
    free(in);
    t_pair_close(&p);
}

TEST(link_zmq_size_mismatch) {
    struct t_pair p = {0};
    t_pair_open(&p, 2000);
    float out[10] = {0}, in[20];
    ASSERT_OK(link_send(p.tx, 1, out, sizeof out));
    ASSERT_EQ(STATUS_PROTOCOL, link_recv(p.rx, 1, in, sizeof in));
    ASSERT_TRUE(strstr(link_errstr(p.rx), "40 bytes") != NULL);
    t_pair_close(&p);
}

/* A peer that sends what is not a link message (wrong frame count, header
 * size, magic, or a body its header does not announce) costs the receiver
 * nothing but a count: the step's own message, behind them, is returned. */
TEST(link_zmq_malformed_dropped_and_counted) {
    struct t_pair p = {0};
    t_pair_open(&p, 3000);
    void *raw = zmq_socket(p.ctx, ZMQ_PUSH);
    int linger = 0;
    zmq_setsockopt(raw, ZMQ_LINGER, &linger, sizeof linger);
    ASSERT_EQ(0, zmq_connect(raw, link_endpoint(p.rx)));
    uint8_t junk[64], hdr[32] = {0x4c, 0x4c, 0x4b, 0x31}; /* "LLK1", epoch 0, step 0 */
    memset(junk, 0xa5, sizeof junk);
    hdr[24] = 40; /* announces 40 bytes */
    ASSERT_EQ(5, zmq_send(raw, junk, 5, 0));                   /* one frame */
    ASSERT_EQ(0, zmq_send(raw, junk, 0, 0));                   /* one empty frame */
    ASSERT_EQ(32, zmq_send(raw, junk, 32, ZMQ_SNDMORE));       /* bad magic */
    ASSERT_EQ(4, zmq_send(raw, junk, 4, 0));
    ASSERT_EQ(31, zmq_send(raw, hdr, 31, ZMQ_SNDMORE));        /* short header */
    ASSERT_EQ(4, zmq_send(raw, junk, 4, 0));
    ASSERT_EQ(32, zmq_send(raw, hdr, 32, ZMQ_SNDMORE));        /* three frames */
    ASSERT_EQ(4, zmq_send(raw, junk, 4, ZMQ_SNDMORE));
    ASSERT_EQ(4, zmq_send(raw, junk, 4, 0));
    ASSERT_EQ(32, zmq_send(raw, hdr, 32, ZMQ_SNDMORE));        /* 40 announced, 8 sent */
    ASSERT_EQ(8, zmq_send(raw, junk, 8, 0));
    float out[10], in[10];
    /* The receiver takes turns between its two peers: steps go on being
     * served while it reads every piece of garbage (bounded for a slow
     * connect on a busy machine). */
    uint64_t step = 1;
    for (; step <= 400 && link_dropped(p.rx, LINK_DROP_MALFORMED) < 6; step++) {
        t_fill(out, 10, (float)step);
        ASSERT_OK(link_send(p.tx, step, out, sizeof out));
        ASSERT_OK(link_recv(p.rx, step, in, sizeof in));
        ASSERT_TRUE(memcmp(out, in, sizeof in) == 0);
        struct timespec tick = {0, 5 * 1000000L};
        nanosleep(&tick, NULL);
    }
    ASSERT_EQ(6, (int)link_dropped(p.rx, LINK_DROP_MALFORMED));
    ASSERT_EQ(0, (int)link_dropped(p.rx, LINK_DROP_AHEAD));
    ASSERT_STREQ("malformed", link_drop_name(LINK_DROP_MALFORMED));
    /* Garbage alone never ends a wait early: the timeout does, and says
     * what was dropped meanwhile. */
    ASSERT_EQ(5, zmq_send(raw, junk, 5, 0));
    int64_t t0 = t_now_ms();
    ASSERT_EQ(STATUS_TIMEOUT, link_recv(p.rx, step, in, sizeof in));
    ASSERT_TRUE(t_now_ms() - t0 >= 2500);
    ASSERT_TRUE(strstr(link_errstr(p.rx), "1 malformed messages dropped") != NULL);
    ASSERT_EQ(7, (int)link_dropped(p.rx, LINK_DROP_MALFORMED));
    zmq_close(raw);
    t_pair_close(&p);
}

TEST(link_zmq_wrong_direction) {
    struct t_pair p = {0};
    t_pair_open(&p, 500);
    float x[2] = {0};
    ASSERT_EQ(STATUS_BAD_INPUT, link_send(p.rx, 1, x, sizeof x));
    ASSERT_EQ(STATUS_BAD_INPUT, link_recv(p.tx, 1, x, sizeof x));
    t_pair_close(&p);
}

TEST(link_zmq_peer_gone_times_out) {
    struct t_pair p = {0};
    t_pair_open(&p, 300);
    float buf[256] = {0};
    ASSERT_OK(link_send(p.tx, 1, buf, sizeof buf));
    ASSERT_OK(link_recv(p.rx, 1, buf, sizeof buf));
    /* Nothing sent: the receiver gives up after its timeout. */
    int64_t t0 = t_now_ms();
    ASSERT_EQ(STATUS_TIMEOUT, link_recv(p.rx, 2, buf, sizeof buf));
    int64_t waited = t_now_ms() - t0;
    ASSERT_TRUE(waited >= 250 && waited < 3000);
    ASSERT_TRUE(strstr(link_errstr(p.rx), "step 2") != NULL);
    /* The receiver goes away: sends fail within the timeout instead of
     * queueing for ever.  Until the sender's I/O thread sees the
     * connection drop, sends still go into the socket buffers (hundreds
     * of these 1 KB steps on a loaded machine), so the loop is bounded by
     * time, not by a count. */
    link_free(p.rx);
    p.rx = NULL;
    t0 = t_now_ms();
    int rc = 0;
    for (uint64_t step = 2; rc == 0 && t_now_ms() - t0 < 9000; step++) rc = link_send(p.tx, step, buf, sizeof buf);
    ASSERT_EQ(STATUS_TIMEOUT, rc);
    ASSERT_TRUE(t_now_ms() - t0 < 10000);
    ASSERT_TRUE(strstr(link_errstr(p.tx), "next stage") != NULL);
    t_pair_close(&p);
}

/* A send waiting for a next stage that is not there gives up at the
 * link's timeout, or as soon as the abort generation moves (a new
 * placement), long before that timeout. */
struct t_bump {
    _Atomic uint64_t *gen;
    int after_ms;
};
static void *t_bump_run(void *arg) {
    struct t_bump *b = arg;
    struct timespec ts = {b->after_ms / 1000, (long)(b->after_ms % 1000) * 1000000L};
    nanosleep(&ts, NULL);
    atomic_fetch_add(b->gen, 1);
    return NULL;
}

TEST(link_zmq_send_gives_up_on_new_placement) {
    char err[512], ep[64];
    void *ctx = zmq_ctx_new();
    ASSERT_TRUE(ctx != NULL);
    /* An endpoint nobody listens on: a port held bound without listen()
     * for the whole test, so connecting is refused and nothing else can
     * take it. */
    int hold = socket(AF_INET, SOCK_STREAM, 0);
    ASSERT_TRUE(hold >= 0);
    struct sockaddr_in a = {0};
    a.sin_family = AF_INET;
    a.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
    ASSERT_EQ(0, bind(hold, (struct sockaddr *)&a, sizeof a));
    socklen_t alen = sizeof a;
    ASSERT_EQ(0, getsockname(hold, (struct sockaddr *)&a, &alen));
    snprintf(ep, sizeof ep, "tcp://127.0.0.1:%d", (int)ntohs(a.sin_port));
    link_conn *tx = NULL;
    if (link_zmq_init(&tx, ctx, LINK_SEND, ep, 400, err, sizeof err) < 0) TEST_FAIL("%s", err);
    float buf[64] = {0};
    /* No abort generation: the timeout. */
    int64_t t0 = t_now_ms();
    ASSERT_EQ(STATUS_TIMEOUT, link_send(tx, 1, buf, sizeof buf));
    int64_t waited = t_now_ms() - t0;
    ASSERT_TRUE(waited >= 350 && waited < 5000);
    link_free(tx);
    /* A timeout of 20 s, and the generation bumped after 200 ms. */
    if (link_zmq_init(&tx, ctx, LINK_SEND, ep, 20000, err, sizeof err) < 0) TEST_FAIL("%s", err);
    _Atomic uint64_t gen = 5;
    link_set_abort(tx, &gen);
    struct t_bump b = {&gen, 200};
    pthread_t th;
    ASSERT_EQ(0, pthread_create(&th, NULL, t_bump_run, &b));
    t0 = t_now_ms();
    ASSERT_EQ(STATUS_CANCELLED, link_send(tx, 2, buf, sizeof buf));
    waited = t_now_ms() - t0;
    pthread_join(th, NULL);
    ASSERT_TRUE(waited >= 150 && waited < 5000);
    ASSERT_TRUE(strstr(link_errstr(tx), "new placement") != NULL);
    link_free(tx);
    zmq_ctx_term(ctx);
    close(hold);
}

/* A receive waiting for a step whose sender is stopped (its connection to
 * the router broke; the router re-formed the pipeline) gives up as soon as
 * the new placement arrives, not at the link's timeout: the stage takes
 * the new epoch at once (tests/router/test_cluster_pause.c). */
TEST(link_zmq_recv_gives_up_on_new_placement) {
    struct t_pair p = {0};
    t_pair_open(&p, 20000);
    float buf[64] = {0};
    ASSERT_OK(link_send(p.tx, 1, buf, sizeof buf));
    _Atomic uint64_t gen = 9;
    link_set_abort(p.rx, &gen);
    ASSERT_OK(link_recv(p.rx, 1, buf, sizeof buf));
    /* Step 2 never comes; the generation moves after 200 ms. */
    struct t_bump b = {&gen, 200};
    pthread_t th;
    ASSERT_EQ(0, pthread_create(&th, NULL, t_bump_run, &b));
    int64_t t0 = t_now_ms();
    ASSERT_EQ(STATUS_CANCELLED, link_recv(p.rx, 2, buf, sizeof buf));
    int64_t waited = t_now_ms() - t0;
    pthread_join(th, NULL);
    ASSERT_TRUE(waited >= 150 && waited < 5000);
    ASSERT_TRUE(strstr(link_errstr(p.rx), "new placement") != NULL);
    /* The link still works: the next step comes through. */
    ASSERT_OK(link_send(p.tx, 3, buf, sizeof buf));
    ASSERT_OK(link_recv(p.rx, 3, buf, sizeof buf));
    t_pair_close(&p);
}

TEST(link_zmq_bad_endpoint) {
    void *ctx = zmq_ctx_new();
    link_conn *l = NULL;
    char err[512];
    ASSERT_TRUE(link_zmq_init(&l, ctx, LINK_RECV, "tcp://127.0.0.1:99999", 1000, err, sizeof err) < 0);
    ASSERT_TRUE(l == NULL);
    ASSERT_TRUE(strstr(err, "99999") != NULL);
    ASSERT_EQ(STATUS_BAD_INPUT, link_zmq_init(&l, ctx, LINK_SEND, "", 1000, err, sizeof err));
    zmq_ctx_term(ctx);
}

/* ---- CURVE: the listener admits only the predecessor's key ---- */

TEST(link_zmq_curve_admits_only_the_predecessor) {
    if (!zmq_has("curve")) TEST_SKIP("libzmq without CURVE");
    char err[512];
    struct keys_pair me, prev, forger;
    ASSERT_OK(keys_pair_generate(&me, err, sizeof err));
    ASSERT_OK(keys_pair_generate(&prev, err, sizeof err));
    ASSERT_OK(keys_pair_generate(&forger, err, sizeof err));
    /* One context per "process": the receiver's holds its ZAP handler. */
    void *ctx_rx = zmq_ctx_new(), *ctx_prev = zmq_ctx_new(), *ctx_forger = zmq_ctx_new();
    zio_zap *zap = NULL;
    ASSERT_OK(zio_zap_start(ctx_rx, &zap, err, sizeof err));
    ASSERT_OK(zio_zap_set_one(zap, LINK_ZAP_DOMAIN, prev.pub, "worker-p0-s0"));
    link_conn *rx = NULL, *tx = NULL, *fake = NULL;
    if (link_zmq_init_curve(&rx, ctx_rx, LINK_RECV, "tcp://127.0.0.1:*", 1500, &me, NULL, err,
                            sizeof err) < 0)
        TEST_FAIL("receiver: %s", err);
    /* The forger knows the endpoint and the receiver's public key, and sends
     * first, with a far-future epoch and step. */
    if (link_zmq_init_curve(&fake, ctx_forger, LINK_SEND, link_endpoint(rx), 1500, &forger, me.pub,
                            err, sizeof err) < 0)
        TEST_FAIL("forger: %s", err);
    link_set_epoch(fake, UINT64_C(9223372036854775807));
    float buf[16], got[16];
    t_fill(buf, 16, 7.0f);
    /* Never admitted, so never connected: its sends time out (IMMEDIATE). */
    ASSERT_EQ(STATUS_TIMEOUT, link_send(fake, 1, buf, sizeof buf));
    /* The predecessor may connect before the router has named it to this
     * stage (placements reach the stages in any order): its handshake waits
     * instead of being refused, and goes through once the key is set. */
    ASSERT_OK(zio_zap_set_one(zap, LINK_ZAP_DOMAIN, NULL, NULL));
    if (link_zmq_init_curve(&tx, ctx_prev, LINK_SEND, link_endpoint(rx), 3000, &prev, me.pub, err,
                            sizeof err) < 0)
        TEST_FAIL("predecessor: %s", err);
    struct timespec pause = {0, 300 * 1000000L};
    nanosleep(&pause, NULL);
    ASSERT_OK(zio_zap_set_one(zap, LINK_ZAP_DOMAIN, prev.pub, "worker-p0-s0"));
    t_fill(buf, 16, 1.0f);
    ASSERT_OK(link_send(tx, 1, buf, sizeof buf));
    ASSERT_OK(link_recv(rx, 1, got, sizeof got));
    ASSERT_TRUE(memcmp(buf, got, sizeof buf) == 0);
    /* The forger was held for a while (a new predecessor may connect just
     * before its placement arrives), then refused and counted. */
    int64_t until = t_now_ms() + 8000;
    while (zio_zap_refused(zap, LINK_ZAP_DOMAIN) < 1 && t_now_ms() < until) {
        struct timespec tick = {0, 50 * 1000000L};
        nanosleep(&tick, NULL);
    }
    ASSERT_TRUE(zio_zap_refused(zap, LINK_ZAP_DOMAIN) >= 1);
    /* Nothing else arrived: the forged message is not held anywhere. */
    ASSERT_EQ(STATUS_TIMEOUT, link_recv(rx, 2, got, sizeof got));
    /* A sender with the wrong idea of the receiver's key gets nowhere either. */
    link_conn *wrong = NULL;
    ASSERT_OK(link_zmq_init_curve(&wrong, ctx_prev, LINK_SEND, link_endpoint(rx), 500, &prev,
                                  forger.pub, err, sizeof err));
    ASSERT_EQ(STATUS_TIMEOUT, link_send(wrong, 3, buf, sizeof buf));
    link_free(wrong);
    ASSERT_EQ(STATUS_BAD_INPUT, link_zmq_init_curve(&wrong, ctx_prev, LINK_SEND, link_endpoint(rx),
                                                     500, &prev, "short", err, sizeof err));
    link_free(fake);
    link_free(tx);
    link_free(rx);
    zio_zap_stop(zap);
    zmq_ctx_term(ctx_forger);
    zmq_ctx_term(ctx_prev);
    zmq_ctx_term(ctx_rx);
}

/* ---- NCCL: two GPUs of this machine, one thread per stage ---- */

/* Rows a stage might send: one of zeros, the others of different
 * magnitudes (as hidden states have), the same on both sides for a type
 * and step. */
enum { T_NCCL_ROW = 256, T_NCCL_N = 1024 };
static void t_nccl_rows(float *x, int type, uint64_t step) {
    uint64_t rng = 0x9e3779b97f4a7c15ULL * (step + 1) + (uint64_t)type;
    for (int i = 0; i < T_NCCL_N; i++) {
        rng = rng * 6364136223846793005ULL + 1442695040888963407ULL;
        float u = (float)(rng >> 40) / (float)(1 << 24) - 0.5f;
        x[i] = i / T_NCCL_ROW == 1 ? 0.0f : u * (i / T_NCCL_ROW == 2 ? 3e4f : 1.5f);
    }
}

struct t_nccl_side {
    int device;
    enum link_dir dir;
    const char *redis_url;
    int rc;
    char err[512];
    float result[T_NCCL_N];
};

/* For each element type, a link of its own (link index = type) carrying
 * three steps; the receiver checks each step's rows against the host
 * codec's round trip of the same rows, bit for bit (the GPU codec writes
 * the host's bytes: tests/kernels/test_cuda_link_codec.c). */
static void *t_nccl_main(void *arg) {
    struct t_nccl_side *s = arg;
    backend *b = NULL;
    struct rconn *r = NULL;
    s->rc = backend_cuda_init(&b, s->device, s->err, sizeof s->err);
    if (s->rc == 0) s->rc = rconn_open_url(s->redis_url, 2000, &r, s->err, sizeof s->err);
    size_t bytes = sizeof s->result;
    float *dev = s->rc == 0 ? backend_alloc(b, bytes) : NULL;
    if (s->rc == 0 && !dev) s->rc = STATUS_NO_MEMORY;
    for (int t = 0; s->rc == 0 && t < LINK_DTYPE_N; t++) {
        link_conn *l = NULL;
        char key[96];
        link_nccl_key(key, sizeof key, 7, (uint32_t)t, 3);
        struct link_nccl_opts o = {(enum link_dtype)t, T_NCCL_ROW, bytes, 20000};
        s->rc = link_nccl_init(&l, b, s->dir, r, key, &o, s->err, sizeof s->err);
        for (uint64_t step = 1; s->rc == 0 && step <= 3; step++) {
            float host[T_NCCL_N];
            t_nccl_rows(host, t, step);
            if (s->dir == LINK_SEND) {
                s->rc = backend_upload(b, dev, host, bytes);
                if (s->rc == 0) s->rc = link_send(l, step, dev, bytes);
                if (s->rc == 0) s->rc = backend_sync(b);
                if (s->rc == 0 && link_wire_bytes_sent(l) != step * link_dtype_wire_bytes(t, bytes, T_NCCL_ROW)) {
                    snprintf(s->err, sizeof s->err, "%s: %llu bytes on the wire after step %llu", link_dtype_names[t],
                             (unsigned long long)link_wire_bytes_sent(l), (unsigned long long)step);
                    s->rc = STATUS_INTERNAL;
                }
            } else {
                s->rc = link_recv(l, step, dev, bytes);
                if (s->rc == 0) s->rc = backend_download(b, s->result, dev, bytes);
                uint8_t wire[T_NCCL_N * 4];
                float want[T_NCCL_N];
                link_encode((enum link_dtype)t, host, T_NCCL_N, T_NCCL_ROW, wire);
                link_decode((enum link_dtype)t, wire, T_NCCL_N, T_NCCL_ROW, want);
                for (int i = 0; s->rc == 0 && i < T_NCCL_N; i++)
                    if (memcmp(&want[i], &s->result[i], sizeof want[i]) != 0) {
                        snprintf(s->err, sizeof s->err, "%s step %llu: element %d is %.9g, the host codec's "
                                 "round trip %.9g", link_dtype_names[t], (unsigned long long)step, i,
                                 s->result[i], want[i]);
                        s->rc = STATUS_INTERNAL;
                    }
            }
            if (s->rc < 0 && !s->err[0] && l) snprintf(s->err, sizeof s->err, "%s", link_errstr(l));
        }
        link_free(l);
    }
    if (dev) backend_dealloc(b, dev);
    rconn_close(r);
    backend_free(b);
    return NULL;
}

TEST(link_nccl_two_gpus) {
    backend *b = NULL;
    char err[512];
    if (backend_cuda_init(&b, 1, err, sizeof err) < 0) TEST_SKIP("needs two GPUs: %s", err);
    backend_free(b);
    struct redis_fixture f;
    fixture_redis_start(&f, 0);
    struct t_nccl_side tx = {0, LINK_SEND, f.url, 0, "", {0}};
    struct t_nccl_side rx = {1, LINK_RECV, f.url, 0, "", {0}};
    pthread_t a, c;
    pthread_create(&a, NULL, t_nccl_main, &tx);
    pthread_create(&c, NULL, t_nccl_main, &rx);
    pthread_join(a, NULL);
    pthread_join(c, NULL);
    ASSERT_OK(fixture_redis_stop(&f));
    if (tx.rc < 0) TEST_FAIL("sender: %d %s", tx.rc, tx.err);
    if (rx.rc < 0) TEST_FAIL("receiver: %d %s", rx.rc, rx.err);
}

/* ---- the wire's element encoding (link_encode / link_decode) ---- */

/* Every type round-trips within its precision for rows of several widths,
 * writes exactly link_dtype_wire_bytes (a guard after it stays), gives the
 * same bytes at an odd address (the byte loop) as at an even one (whole
 * rows through F16C where the CPU has it), and INT8 carries each block's
 * scale, its amax / 127 in BF16, with rows of zeros as zeros. */
TEST(link_codec_round_trip) {
    static const size_t widths[] = {1, 3, 33, 64, 1000};
    enum { ROWS = 5, WMAX = 1000 };
    float *x = malloc(sizeof(float) * ROWS * WMAX), *y = malloc(sizeof(float) * ROWS * WMAX);
    float *y2 = malloc(sizeof(float) * ROWS * WMAX);
    uint8_t *w = malloc(ROWS * WMAX * 4 + 16), *w2 = malloc(ROWS * WMAX * 4 + 16);
    ASSERT_TRUE(x && y && y2 && w && w2);
    uint64_t rng = 777;
    for (size_t wi = 0; wi < sizeof widths / sizeof *widths; wi++) {
        size_t row = widths[wi], n = ROWS * row;
        /* row 0 small, 1 zeros, 2 large for F16 (the largest finite F16 is
         * 65504), 3 tiny (1e-3 of F16's smallest normal, 6.1e-5), 4 mixed */
        static const float mag[ROWS] = {1.0f, 0.0f, 6e4f, 6e-8f, 100.0f};
        for (size_t i = 0; i < n; i++) {
            rng = rng * 6364136223846793005ULL + 1442695040888963407ULL;
            float u = (float)(rng >> 40) / (float)(1 << 24) - 0.5f;
            x[i] = u * 2 * mag[i / row] * (i / row == 4 && i % 2 ? 1e-3f : 1.0f);
        }
        for (int t = 0; t < LINK_DTYPE_N; t++) {
            size_t wire = link_dtype_wire_bytes((enum link_dtype)t, n * sizeof(float), row);
            memset(w, 0xa5, wire + 16);
            link_encode((enum link_dtype)t, x, n, row, w);
            for (size_t i = wire; i < wire + 16; i++)
                if (w[i] != 0xa5) TEST_FAIL("%s, rows of %zu: byte %zu past the %zu on the wire written",
                                            link_dtype_names[t], row, i, wire);
            link_encode((enum link_dtype)t, x, n, row, w2 + 1);
            if (memcmp(w, w2 + 1, wire) != 0)
                TEST_FAIL("%s, rows of %zu: other bytes at an odd address", link_dtype_names[t], row);
            link_decode((enum link_dtype)t, w, n, row, y);
            link_decode((enum link_dtype)t, w2 + 1, n, row, y2);
            if (memcmp(y, y2, n * sizeof(float)) != 0)
                TEST_FAIL("%s, rows of %zu: other floats from an odd address", link_dtype_names[t], row);
            for (size_t r = 0; r < ROWS; r++) {
                const uint8_t *blk = w + r * link_int8_row_bytes(row);
                float amax = 0, scale = 0;
                for (size_t i = 0; i < row; i++) {
                    if (i % LINK_INT8_BLOCK == 0) { /* the block's max, its scale as sent */
                        amax = 0;
                        for (size_t k = i; k < row && k < i + LINK_INT8_BLOCK; k++)
                            amax = fmaxf(amax, fabsf(x[r * row + k]));
                        if (t == LINK_DTYPE_INT8) {
                            uint16_t sb = (uint16_t)(blk[0] | blk[1] << 8);
                            ASSERT_EQ(f32_to_bf16(amax / 127.0f), sb);
                            scale = bf16_to_f32(sb);
                            blk += 2 + (row - i < LINK_INT8_BLOCK ? row - i : LINK_INT8_BLOCK);
                        }
                    }
                    float v = x[r * row + i], d = y[r * row + i];
                    /* F16: half an ulp (2^-11 relative) for normals, 2^-25 below;
                     * BF16: 2^-8 relative; INT8: half a step of the block's
                     * scale. */
                    double bound = t == LINK_DTYPE_F32    ? 0
                                   : t == LINK_DTYPE_F16  ? fmax(fabs(v) / 2048, 1.0 / (1 << 25))
                                   : t == LINK_DTYPE_BF16 ? fabs(v) / 256
                                                          : scale * 0.5000001;
                    if (!(fabs((double)d - v) <= bound))
                        TEST_FAIL("%s, rows of %zu, row %zu: %.9g came back %.9g (bound %.3g)",
                                  link_dtype_names[t], row, r, v, d, bound);
                    if (r == 1 && d != 0) TEST_FAIL("%s: a row of zeros came back with %.9g", link_dtype_names[t], d);
                }
            }
        }
    }
    free(x);
    free(y);
    free(y2);
    free(w);
    free(w2);
}

/* ---- the NCCL link's Redis exchange (no GPU needed) ---- */

struct t_exchange {
    const char *url, *key;
    enum link_dir dir;
    enum link_dtype t;
    size_t row;
    uint8_t id[LINK_NCCL_ID_BYTES];
    int rc;
    char err[512];
};

static void *t_exchange_run(void *arg) {
    struct t_exchange *e = arg;
    struct rconn *r = NULL;
    e->rc = rconn_open_url(e->url, 2000, &r, e->err, sizeof e->err);
    if (e->rc == 0)
        e->rc = link_nccl_exchange(r, e->key, e->dir, e->id, e->t, e->row, 3000, e->err, sizeof e->err);
    rconn_close(r);
    return NULL;
}

static void t_exchange_pair(struct t_exchange *tx, struct t_exchange *rx) {
    pthread_t a, b;
    ASSERT_EQ(0, pthread_create(&a, NULL, t_exchange_run, tx));
    ASSERT_EQ(0, pthread_create(&b, NULL, t_exchange_run, rx));
    pthread_join(a, NULL);
    pthread_join(b, NULL);
}

/* The same type: the receiver gets the sender's id, both go on. */
TEST(link_nccl_exchange_agrees) {
    struct redis_fixture f;
    fixture_redis_start(&f, 0);
    struct t_exchange tx = {f.url, "llm:nccl:3:1:9", LINK_SEND, LINK_DTYPE_INT8, 4096, {0}, 0, ""};
    struct t_exchange rx = {f.url, "llm:nccl:3:1:9", LINK_RECV, LINK_DTYPE_INT8, 4096, {0}, 0, ""};
    for (int i = 0; i < LINK_NCCL_ID_BYTES; i++) tx.id[i] = (uint8_t)(i * 7 + 1);
    t_exchange_pair(&tx, &rx);
    ASSERT_OK(fixture_redis_stop(&f));
    if (tx.rc < 0) TEST_FAIL("sender: %d %s", tx.rc, tx.err);
    if (rx.rc < 0) TEST_FAIL("receiver: %d %s", rx.rc, rx.err);
    ASSERT_TRUE(memcmp(tx.id, rx.id, LINK_NCCL_ID_BYTES) == 0);
}

/* Stages given different --link-dtype (or widths): both ends fail at
 * once, each naming both types, instead of one reading the other's bytes
 * as its own type or waiting out its timeout. */
TEST(link_nccl_exchange_type_mismatch) {
    struct redis_fixture f;
    fixture_redis_start(&f, 0);
    struct t_exchange tx = {f.url, "llm:nccl:3:1:9", LINK_SEND, LINK_DTYPE_BF16, 4096, {0}, 0, ""};
    struct t_exchange rx = {f.url, "llm:nccl:3:1:9", LINK_RECV, LINK_DTYPE_INT8, 4096, {0}, 0, ""};
    int64_t t0 = t_now_ms();
    t_exchange_pair(&tx, &rx);
    ASSERT_TRUE(t_now_ms() - t0 < 2500);
    ASSERT_EQ(STATUS_BAD_INPUT, tx.rc);
    ASSERT_EQ(STATUS_BAD_INPUT, rx.rc);
    ASSERT_TRUE(strstr(tx.err, "this stage sends bf16 rows of 4096, the next stage expects int8") != NULL);
    ASSERT_TRUE(strstr(rx.err, "the previous stage sends bf16 rows of 4096, this stage expects int8") != NULL);
    ASSERT_TRUE(strstr(rx.err, "llm:nccl:3:1:9") != NULL);
    /* The same type, other widths (another model): refused too. */
    tx.key = rx.key = "llm:nccl:3:1:10";
    tx.t = rx.t = LINK_DTYPE_F16;
    rx.row = 2048;
    t_exchange_pair(&tx, &rx);
    ASSERT_EQ(STATUS_BAD_INPUT, tx.rc);
    ASSERT_EQ(STATUS_BAD_INPUT, rx.rc);
    ASSERT_TRUE(strstr(rx.err, "sends f16 rows of 4096, this stage expects f16 rows of 2048") != NULL);
    /* No receiver: the sender's wait ends at its timeout, saying so. */
    tx.key = "llm:nccl:3:1:11";
    t0 = t_now_ms();
    t_exchange_run(&tx);
    ASSERT_EQ(STATUS_TIMEOUT, tx.rc);
    ASSERT_TRUE(t_now_ms() - t0 >= 2900);
    ASSERT_TRUE(strstr(tx.err, "the next stage published nothing") != NULL);
    ASSERT_OK(fixture_redis_stop(&f));
}

TEST(link_nccl_needs_cuda_backend) {
    backend *b = NULL;
    char err[512];
    ASSERT_OK(backend_cpu_init(&b, 1, err, sizeof err));
    link_conn *l = NULL;
    struct link_nccl_opts o = {LINK_DTYPE_F16, 64, 64 * 4, 100};
    int rc = link_nccl_init(&l, b, LINK_SEND, NULL, "llm:nccl:0:0:0", &o, err, sizeof err);
    ASSERT_TRUE(rc < 0);
    ASSERT_TRUE(l == NULL);
    ASSERT_TRUE(strstr(err, "llm:nccl:0:0:0") != NULL);
    backend_free(b);
}

/* --link-dtype: each element type round-trips within its precision, the
 * receiver reads the type from the message, and the bytes on the wire
 * shrink as the type says (int8: a quarter of F32's plus a scale a row). */
TEST(link_zmq_dtype_round_trip) {
    enum { ROW = 64, ROWS = 8, N = ROW * ROWS };
    static const double tol[LINK_DTYPE_N] = {0, 1.0 / 1024, 1.0 / 128, 1.0 / 127};
    static const size_t wire[LINK_DTYPE_N] = {N * 4, N * 2, N * 2, N + ROWS * 4};
    struct t_pair p = {0};
    t_pair_open(&p, 2000);
    float out[N], in[N];
    uint64_t rng = 12345;
    for (int i = 0; i < N; i++) {
        rng = rng * 6364136223846793005ULL + 1442695040888963407ULL;
        /* rows of different magnitudes, as hidden states have */
        out[i] = ((float)(rng >> 40) / (float)(1 << 24) - 0.5f) * (float)(1 + i / ROW * 7);
    }
    uint64_t step = 1;
    for (int t = 0; t < LINK_DTYPE_N; t++, step++) {
        ASSERT_OK(link_set_dtype(p.tx, (enum link_dtype)t, ROW));
        uint64_t before = link_wire_bytes_sent(p.tx);
        ASSERT_OK(link_send(p.tx, step, out, sizeof out));
        ASSERT_EQ((uint64_t)(wire[t] + 32), link_wire_bytes_sent(p.tx) - before);
        ASSERT_EQ(wire[t], link_dtype_wire_bytes((enum link_dtype)t, sizeof out, ROW));
        memset(in, 0, sizeof in);
        ASSERT_OK(link_recv(p.rx, step, in, sizeof in));
        /* error relative to each row's largest magnitude */
        double worst = 0;
        for (int r = 0; r < ROWS; r++) {
            double amax = 0;
            for (int i = 0; i < ROW; i++) amax = fmax(amax, fabs(out[r * ROW + i]));
            for (int i = 0; i < ROW; i++) worst = fmax(worst, fabs(in[r * ROW + i] - out[r * ROW + i]) / amax);
        }
        if (!(worst <= tol[t])) TEST_FAIL("%s: worst error %.3g of a row's max, bound %.3g", link_dtype_names[t], worst, tol[t]);
    }
    /* A skip marker stays one whatever the type. */
    float keep[N];
    memcpy(keep, in, sizeof keep);
    ASSERT_OK(link_send(p.tx, step, NULL, 0));
    ASSERT_EQ(LINK_SKIPPED, link_recv(p.rx, step, in, sizeof in));
    ASSERT_TRUE(memcmp(keep, in, sizeof in) == 0);
    /* Not whole rows: refused before anything is sent. */
    ASSERT_EQ(STATUS_BAD_INPUT, link_send(p.tx, step + 1, out, sizeof(float) * (ROW + 1)));
    ASSERT_EQ(STATUS_BAD_INPUT, link_set_dtype(p.tx, LINK_DTYPE_INT8, 0));
    t_pair_close(&p);
}

TEST_MAIN(link_zmq_ordered_by_step, link_zmq_stale_dropped_early_kept, link_zmq_skip_marker,
          link_zmq_forged_future_never_blocks, link_zmq_later_epoch_kept_for_its_turn,
          link_zmq_older_epoch_dropped, link_zmq_large_buffer, link_zmq_size_mismatch,
          link_zmq_malformed_dropped_and_counted,
          link_zmq_wrong_direction, link_zmq_peer_gone_times_out, link_zmq_send_gives_up_on_new_placement,
          link_zmq_recv_gives_up_on_new_placement, link_zmq_bad_endpoint,
          link_nccl_two_gpus, link_nccl_needs_cuda_backend, link_codec_round_trip,
          link_nccl_exchange_agrees, link_nccl_exchange_type_mismatch,
          link_zmq_curve_admits_only_the_predecessor, link_zmq_dtype_round_trip)
