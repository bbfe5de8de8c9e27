/* Tests for common/zio: multipart round trips, zero-copy frames, timeouts,
 * poll, errors that name the endpoint, the free-port helper, CURVE with the
 * ZAP handler's allowlists, and the frame bound. */
#include "common/status.h"
#include "common/zio.h"
#include "tests/test.h"

#include <pthread.h>
#include <stdatomic.h>
#include <time.h>
#include <unistd.h>

/* A pair of sockets connected over loopback TCP: DEALER -> ROUTER. */
struct zpair {
    void *ctx;
    struct zio_sock *router, *dealer;
};

static void zpair_open(struct zpair *p) {
    char err[256];
    memset(p, 0, sizeof *p);
    p->ctx = zmq_ctx_new();
    ASSERT_TRUE(p->ctx != NULL);
    ASSERT_OK(zio_sock_open(p->ctx, ZMQ_ROUTER, &p->router, err, sizeof err));
    ASSERT_OK(zio_sock_open(p->ctx, ZMQ_DEALER, &p->dealer, err, sizeof err));
    ASSERT_OK(zio_bind(p->router, "tcp://127.0.0.1:*"));
    ASSERT_TRUE(strncmp(zio_endpoint(p->router), "tcp://127.0.0.1:", 16) == 0);
    ASSERT_OK(zio_connect(p->dealer, zio_endpoint(p->router)));
}

static void zpair_close(struct zpair *p) {
    zio_sock_close(p->dealer);
    zio_sock_close(p->router);
    if (p->ctx) zmq_ctx_term(p->ctx);
    memset(p, 0, sizeof *p);
}

TEST(zio_multipart_roundtrip) {
    struct zpair p;
    zpair_open(&p);
    const char *hdr = "step", *body = "plan-bytes";
    struct zio_frame out[3] = {{hdr, 4, NULL, NULL}, {"", 0, NULL, NULL}, {body, 10, NULL, NULL}};
    ASSERT_OK(zio_send(p.dealer, out, 3, 0));
    struct zio_parts in = {0};
    ASSERT_OK(zio_recv(p.router, &in, 5000));
    ASSERT_EQ((size_t)4, in.n); /* ROUTER prepends the peer's routing id */
    ASSERT_EQ((size_t)4, zio_parts_size(&in, 1));
    ASSERT_TRUE(memcmp(zio_parts_data(&in, 1), "step", 4) == 0);
    ASSERT_EQ((size_t)0, zio_parts_size(&in, 2));
    ASSERT_EQ((size_t)10, zio_parts_size(&in, 3));
    ASSERT_TRUE(memcmp(zio_parts_data(&in, 3), body, 10) == 0);
    ASSERT_TRUE(zio_parts_data(&in, 4) == NULL);
    /* Reply through the routing id: the dealer gets the frames after it. */
    struct zio_frame back[2] = {{zio_parts_data(&in, 0), zio_parts_size(&in, 0), NULL, NULL},
                                {"ok", 2, NULL, NULL}};
    ASSERT_OK(zio_send(p.router, back, 2, 0));
    ASSERT_OK(zio_recv(p.dealer, &in, 5000));
    ASSERT_EQ((size_t)1, in.n);
    ASSERT_EQ((size_t)2, zio_parts_size(&in, 0));
    ASSERT_TRUE(memcmp(zio_parts_data(&in, 0), "ok", 2) == 0);
    zio_parts_free(&in);
    ASSERT_EQ((size_t)0, in.n);
    zpair_close(&p);
}

static atomic_int zfreed;
static void zfree_counted(void *data, void *hint) {
    ASSERT_TRUE(hint == (void *)&zfreed);
    free(data);
    atomic_fetch_add(&zfreed, 1);
}

TEST(zio_zero_copy_frames) {
    struct zpair p;
    zpair_open(&p);
    atomic_store(&zfreed, 0);
    size_t n = (size_t)8 << 20; /* 8 MiB: a hidden-state batch */
    uint8_t *big = malloc(n);
    ASSERT_TRUE(big != NULL);
    uint32_t x = 12345;
    for (size_t i = 0; i < n; i++) {
        x = x * 1664525u + 1013904223u;
        big[i] = (uint8_t)(x >> 24);
    }
    uint8_t *expect = malloc(n);
    ASSERT_TRUE(expect != NULL);
    memcpy(expect, big, n);
    uint8_t *small = malloc(3);
    memcpy(small, "abc", 3);
    struct zio_frame out[3] = {{"hdr", 3, NULL, NULL},
                               {big, n, zfree_counted, (void *)&zfreed},
                               {small, 3, zfree_counted, (void *)&zfreed}};
    ASSERT_OK(zio_send(p.dealer, out, 3, 0));
    struct zio_parts in = {0};
    ASSERT_OK(zio_recv(p.router, &in, 10000));
    ASSERT_EQ((size_t)4, in.n);
    ASSERT_EQ(n, zio_parts_size(&in, 2));
    ASSERT_TRUE(memcmp(zio_parts_data(&in, 2), expect, n) == 0);
    ASSERT_EQ((size_t)3, zio_parts_size(&in, 3));
    ASSERT_TRUE(memcmp(zio_parts_data(&in, 3), "abc", 3) == 0);
    zio_parts_free(&in);
    free(expect);
    zpair_close(&p); /* ends the context: every frame has been released by now */
    ASSERT_EQ(2, atomic_load(&zfreed));
}

TEST(zio_zero_copy_freed_on_failure) {
    char err[256];
    void *ctx = zmq_ctx_new();
    struct zio_sock *s;
    ASSERT_OK(zio_sock_open(ctx, ZMQ_DEALER, &s, err, sizeof err));
    atomic_store(&zfreed, 0);
    /* A DEALER with no peer cannot queue anything: DONTWAIT fails at once. */
    uint8_t *a = malloc(64), *b = malloc(64);
    struct zio_frame out[2] = {{a, 64, zfree_counted, (void *)&zfreed},
                               {b, 64, zfree_counted, (void *)&zfreed}};
    ASSERT_EQ(STATUS_EXHAUSTED, zio_send(s, out, 2, ZMQ_DONTWAIT));
    ASSERT_EQ(STATUS_EXHAUSTED, zio_err(s));
    ASSERT_TRUE(strstr(zio_errstr(s), "send to socket: frame 0 of 2 (64 bytes)") != NULL);
    ASSERT_EQ(2, atomic_load(&zfreed));
    zio_sock_close(s);
    zmq_ctx_term(ctx);
}

TEST(zio_recv_timeout) {
    struct zpair p;
    zpair_open(&p);
    struct zio_parts in = {0};
    ASSERT_EQ(STATUS_TIMEOUT, zio_recv(p.router, &in, 50));
    ASSERT_EQ((size_t)0, in.n);
    char want[300];
    snprintf(want, sizeof want, "recv from %s: no message within 50 ms", zio_endpoint(p.router));
    ASSERT_STREQ(want, zio_errstr(p.router));
    ASSERT_EQ(STATUS_TIMEOUT, zio_recv(p.router, &in, 0));
    zio_parts_free(&in);
    zpair_close(&p);
}

TEST(zio_poll_ready) {
    struct zpair p;
    zpair_open(&p);
    struct zio_sock *socks[2] = {p.router, p.dealer};
    short ev[2] = {ZMQ_POLLIN, ZMQ_POLLIN}, rev[2];
    ASSERT_EQ(0, zio_poll(socks, ev, rev, 2, 20));
    ASSERT_EQ(0, (int)rev[0]);
    struct zio_frame f = {"x", 1, NULL, NULL};
    ASSERT_OK(zio_send(p.dealer, &f, 1, 0));
    ASSERT_EQ(1, zio_poll(socks, ev, rev, 2, 5000));
    ASSERT_EQ(ZMQ_POLLIN, (int)rev[0]);
    ASSERT_EQ(0, (int)rev[1]);
    zpair_close(&p);
}

/* zio_set_spin: a wait polls first, then blocks; either way the message
 * comes and the timeout holds.  A thread sends on the dealer after a
 * delay; the main thread waits on the router. */
struct zdelayed {
    struct zio_sock *s;
    int delay_ms;
};
static void *zdelayed_send(void *arg) {
    const struct zdelayed *d = arg;
    usleep((useconds_t)d->delay_ms * 1000);
    struct zio_frame f = {"late", 4, NULL, NULL};
    zio_send(d->s, &f, 1, 0);
    return NULL;
}
static int64_t zmono_ms(void) {
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (int64_t)ts.tv_sec * 1000 + ts.tv_nsec / 1000000;
}

/* p.router takes one message from p.dealer: its waits may spin for
 * ZIO_SPIN_RECENT_US from now (zio_set_spin). */
static void zio_spin_wake(struct zpair *p) {
    struct zio_parts in = {0};
    struct zio_frame f = {"wake", 4, NULL, NULL};
    ASSERT_OK(zio_send(p->dealer, &f, 1, 0));
    ASSERT_OK(zio_recv(p->router, &in, 10000));
    ASSERT_EQ((size_t)2, in.n);
    zio_parts_free(&in);
}

/* A pair whose router spins 2 s (zio_set_spin) with warm ticks on, which
 * tell whether a wait spun: they are sent only while it does. */
static void zpair_open_spinning(struct zpair *p) {
    zpair_open(p);
    zio_set_spin(p->router, 2000000);
    ASSERT_OK(zio_set_warm(p->router, p->ctx));
}

/* The waits of p.router as it spins: the timeout still ends a wait longer
 * than the spin (well before the spin would), a zero timeout does not
 * spin, and a message within the spin or after it is taken, on zio_recv
 * and on zio_poll.  A message first, so that the waits spin (on a host
 * slow enough to pass ZIO_SPIN_RECENT_US meanwhile they block instead,
 * and the checks hold all the same). */
static void zio_spin_cases(struct zpair *p) {
    struct zio_parts in = {0};
    struct zio_sock *socks[1] = {p->router};
    short ev[1] = {ZMQ_POLLIN}, rev[1];
    zio_set_spin(p->router, 2000000);
    zio_spin_wake(p);
    int64_t t0 = zmono_ms();
    ASSERT_EQ(STATUS_TIMEOUT, zio_recv(p->router, &in, 30));
    ASSERT_EQ(0, zio_poll(socks, ev, rev, 1, 30));
    ASSERT_EQ(0, zio_poll(socks, ev, rev, 1, 0));
    int64_t took = zmono_ms() - t0;
    if (took < 60 || took > 1500) TEST_FAIL("two 30 ms waits and a zero one took %lld ms", (long long)took);
    /* Delay 5 ms, spin 2 s; delay 80 ms, spin 20 ms. */
    static const int delays[2] = {5, 80}, spins[2] = {2000000, 20000};
    for (int i = 0; i < 2; i++) {
        zio_set_spin(p->router, spins[i]);
        for (int use_poll = 0; use_poll < 2; use_poll++) {
            struct zdelayed d = {p->dealer, delays[i]};
            pthread_t th;
            ASSERT_EQ(0, pthread_create(&th, NULL, zdelayed_send, &d));
            if (use_poll) ASSERT_EQ(1, zio_poll(socks, ev, rev, 1, 10000));
            ASSERT_OK(zio_recv(p->router, &in, 10000));
            pthread_join(th, NULL);
            ASSERT_EQ((size_t)2, in.n); /* routing id, payload */
            ASSERT_EQ((size_t)4, zio_parts_size(&in, 1));
            ASSERT_TRUE(memcmp(zio_parts_data(&in, 1), "late", 4) == 0);
        }
    }
    zio_parts_free(&in);
}

TEST(zio_spin_then_block) {
    struct zpair p;
    zpair_open(&p);
    zio_spin_cases(&p);
    zpair_close(&p);
}

/* zio_set_warm: a spinning wait's ticks go round through the context's
 * I/O thread and come back, and the waits behave as without them.  Each
 * wait follows a message, so that it spins: a spin decides at its start,
 * and lasts its whole 300 ms. */
TEST(zio_spin_warm_ticks) {
    struct zpair p;
    zpair_open_spinning(&p);
    struct zio_parts in = {0};
    struct zio_sock *socks[1] = {p.router};
    short ev[1] = {ZMQ_POLLIN}, rev[1];
    ASSERT_OK(zio_set_warm(p.router, p.ctx)); /* a second call keeps the first pair */
    ASSERT_EQ(0L, zio_warm_ticks(p.router));
    zio_spin_wake(&p);
    ASSERT_EQ(0, zio_poll(socks, ev, rev, 1, 300));
    long after_poll = zio_warm_ticks(p.router);
    if (after_poll < 1) TEST_FAIL("no tick came back in a 300 ms spin");
    zio_spin_wake(&p);
    ASSERT_EQ(STATUS_TIMEOUT, zio_recv(p.router, &in, 300));
    if (zio_warm_ticks(p.router) <= after_poll) TEST_FAIL("no tick came back in the recv's 300 ms spin");
    zio_parts_free(&in);
    zio_spin_cases(&p);
    zpair_close(&p);
}

/* A wait spins only while its socket is busy (zio_set_spin): never before
 * the socket's first message, right after a message, and no longer once
 * ZIO_SPIN_RECENT_US have passed without one (the warm ticks tell). */
TEST(zio_spin_only_while_busy) {
    struct zpair p;
    zpair_open_spinning(&p);
    struct zio_parts in = {0};
    struct zio_sock *socks[1] = {p.router};
    short ev[1] = {ZMQ_POLLIN}, rev[1];
    /* Never received: the waits block at once. */
    ASSERT_EQ(STATUS_TIMEOUT, zio_recv(p.router, &in, 30));
    ASSERT_EQ(0, zio_poll(socks, ev, rev, 1, 30));
    ASSERT_EQ(0L, zio_warm_ticks(p.router));
    /* A message: the next wait spins (its ticks come back while it lasts). */
    zio_spin_wake(&p);
    ASSERT_EQ(STATUS_TIMEOUT, zio_recv(p.router, &in, 300));
    long ticks = zio_warm_ticks(p.router);
    if (ticks < 1) TEST_FAIL("no tick came back in the 300 ms spin after a message");
    /* Quiet past ZIO_SPIN_RECENT_US: the waits block again.  Ticks are
     * sent and counted only inside a spin, so the count stays. */
    usleep((useconds_t)ZIO_SPIN_RECENT_US + 50000);
    ASSERT_EQ(STATUS_TIMEOUT, zio_recv(p.router, &in, 30));
    ASSERT_EQ(0, zio_poll(socks, ev, rev, 1, 30));
    ASSERT_EQ(ticks, zio_warm_ticks(p.router));
    zio_parts_free(&in);
    zpair_close(&p);
}

TEST(zio_bad_endpoint_named) {
    char err[256];
    void *ctx = zmq_ctx_new();
    struct zio_sock *s;
    ASSERT_OK(zio_sock_open(ctx, ZMQ_ROUTER, &s, err, sizeof err));
    ASSERT_EQ(STATUS_BAD_INPUT, zio_bind(s, "tcp://127.0.0.1:99999"));
    ASSERT_STREQ("bind tcp://127.0.0.1:99999: port '99999' is not a number from 0 to 65535",
                 zio_errstr(s));
    ASSERT_EQ(STATUS_BAD_INPUT, zio_connect(s, "tcp://localhost:http"));
    ASSERT_STREQ("connect tcp://localhost:http: port 'http' is not a number from 0 to 65535",
                 zio_errstr(s));
    ASSERT_EQ(STATUS_BAD_INPUT, zio_connect(s, "bogus://nowhere"));
    ASSERT_TRUE(strncmp(zio_errstr(s), "connect bogus://nowhere: ", 25) == 0);
    /* A port already bound by another socket. */
    struct zio_sock *t;
    ASSERT_OK(zio_sock_open(ctx, ZMQ_ROUTER, &t, err, sizeof err));
    ASSERT_OK(zio_bind(t, "tcp://127.0.0.1:*"));
    char ep[256];
    snprintf(ep, sizeof ep, "%s", zio_endpoint(t));
    ASSERT_EQ(STATUS_IO, zio_bind(s, ep));
    char want[300];
    snprintf(want, sizeof want, "bind %s: Address already in use", ep);
    ASSERT_STREQ(want, zio_errstr(s));
    ASSERT_EQ(STATUS_BAD_INPUT, zio_set_int(s, 987654, 1));
    ASSERT_TRUE(strstr(zio_errstr(s), "zmq option 987654 = 1") != NULL);
    zio_sock_close(t);
    zio_sock_close(s);
    zmq_ctx_term(ctx);
    ASSERT_EQ(STATUS_BAD_INPUT, zio_sock_open(NULL, ZMQ_ROUTER, &s, err, sizeof err));
    ASSERT_TRUE(s == NULL);
}

TEST(zio_free_port_bindable) {
    char err[256];
    int port = 0;
    ASSERT_OK(zio_free_port(NULL, &port, err, sizeof err));
    ASSERT_TRUE(port > 0 && port <= 65535);
    void *ctx = zmq_ctx_new();
    struct zio_sock *s;
    ASSERT_OK(zio_sock_open(ctx, ZMQ_PULL, &s, err, sizeof err));
    char ep[64];
    snprintf(ep, sizeof ep, "tcp://127.0.0.1:%d", port);
    ASSERT_OK(zio_bind(s, ep));
    ASSERT_STREQ(ep, zio_endpoint(s));
    zio_sock_close(s);
    zmq_ctx_term(ctx);
}

/* A CURVE ROUTER under a ZAP handler, and DEALER clients with their keys. */
struct zsecure {
    void *ctx;
    zio_zap *zap;
    struct keys_pair server, good, bad;
    struct zio_sock *router;
};

static void zsecure_open(struct zsecure *z) {
    char err[256];
    memset(z, 0, sizeof *z);
    if (!zmq_has("curve")) TEST_SKIP("libzmq without CURVE");
    z->ctx = zmq_ctx_new();
    ASSERT_OK(zio_zap_start(z->ctx, &z->zap, err, sizeof err));
    ASSERT_OK(keys_pair_generate(&z->server, err, sizeof err));
    ASSERT_OK(keys_pair_generate(&z->good, err, sizeof err));
    ASSERT_OK(keys_pair_generate(&z->bad, err, sizeof err));
    /* A list (zio_zap_set) refuses other keys at once. */
    struct keys_entry e;
    memcpy(e.pub, z->good.pub, sizeof e.pub);
    snprintf(e.name, sizeof e.name, "alice");
    struct keys_list l = {1, &e};
    ASSERT_OK(zio_zap_set(z->zap, "clients", &l));
    ASSERT_OK(zio_sock_open(z->ctx, ZMQ_ROUTER, &z->router, err, sizeof err));
    ASSERT_OK(zio_curve_server(z->router, &z->server, "clients"));
    ASSERT_OK(zio_bind(z->router, "tcp://127.0.0.1:*"));
}

static struct zio_sock *zsecure_client(struct zsecure *z, const struct keys_pair *kp) {
    char err[256];
    struct zio_sock *d = NULL;
    ASSERT_OK(zio_sock_open(z->ctx, ZMQ_DEALER, &d, err, sizeof err));
    ASSERT_OK(zio_curve_client(d, kp, z->server.pub));
    ASSERT_OK(zio_connect(d, zio_endpoint(z->router)));
    return d;
}

static void zsecure_close(struct zsecure *z) {
    zio_sock_close(z->router);
    zio_zap_stop(z->zap);
    if (z->ctx) zmq_ctx_term(z->ctx);
}

TEST(zio_curve_admits_listed_keys_only) {
    struct zsecure z;
    zsecure_open(&z);
    struct zio_sock *good = zsecure_client(&z, &z.good), *bad = zsecure_client(&z, &z.bad);
    struct zio_frame f = {"hi", 2, NULL, NULL};
    ASSERT_OK(zio_send(good, &f, 1, ZMQ_DONTWAIT));
    zio_send(bad, &f, 1, ZMQ_DONTWAIT);
    struct zio_parts in = {0};
    ASSERT_OK(zio_recv(z.router, &in, 3000));
    /* The ZAP handler named the sender: "name/<key>". */
    char want[128];
    snprintf(want, sizeof want, "alice/%s", z.good.pub);
    ASSERT_STREQ(want, zio_parts_user_id(&in));
    ASSERT_STREQ(z.good.pub, zio_user_id_key(zio_parts_user_id(&in)));
    /* The unlisted key's message never arrives, and the refusal is counted. */
    ASSERT_EQ(STATUS_TIMEOUT, zio_recv(z.router, &in, 500));
    ASSERT_TRUE(zio_zap_refused(z.zap, "clients") >= 1);
    ASSERT_EQ((uint64_t)1, zio_zap_admitted(z.zap, "clients"));
    /* Changed at run time: now only the other key gets in. */
    ASSERT_OK(zio_zap_set_one(z.zap, "clients", z.bad.pub, NULL));
    struct zio_sock *bad2 = zsecure_client(&z, &z.bad);
    ASSERT_OK(zio_send(bad2, &f, 1, ZMQ_DONTWAIT));
    ASSERT_OK(zio_recv(z.router, &in, 3000));
    ASSERT_STREQ(z.bad.pub, zio_parts_user_id(&in));
    /* A plain (non-CURVE) peer gets nothing either. */
    char err[256];
    struct zio_sock *plain = NULL;
    ASSERT_OK(zio_sock_open(z.ctx, ZMQ_DEALER, &plain, err, sizeof err));
    ASSERT_OK(zio_connect(plain, zio_endpoint(z.router)));
    zio_send(plain, &f, 1, ZMQ_DONTWAIT);
    ASSERT_EQ(STATUS_TIMEOUT, zio_recv(z.router, &in, 300));
    zio_parts_free(&in);
    zio_sock_close(plain);
    zio_sock_close(bad2);
    zio_sock_close(good);
    zio_sock_close(bad);
    zsecure_close(&z);
}

TEST(zio_max_msg_size_drops_oversized_frames) {
    /* Set before the sockets open: the receiver drops the connection at the
     * frame header, so a later small frame on a new connection still comes. */
    zio_set_max_msg_size(4096);
    struct zpair p;
    zpair_open(&p);
    zio_set_max_msg_size(ZIO_MAX_MSG_SIZE_DEFAULT);
    ASSERT_EQ(ZIO_MAX_MSG_SIZE_DEFAULT, zio_max_msg_size());
    char *big = calloc(1, 8192);
    struct zio_frame f = {big, 8192, NULL, NULL};
    ASSERT_OK(zio_send(p.dealer, &f, 1, 0));
    struct zio_parts in = {0};
    ASSERT_EQ(STATUS_TIMEOUT, zio_recv(p.router, &in, 500));
    struct zio_frame small = {big, 100, NULL, NULL};
    ASSERT_OK(zio_send(p.dealer, &small, 1, 0)); /* after the reconnect */
    ASSERT_OK(zio_recv(p.router, &in, 5000));
    ASSERT_EQ((size_t)100, zio_parts_size(&in, 1));
    zio_parts_free(&in);
    free(big);
    zpair_close(&p);
}

TEST_MAIN(zio_multipart_roundtrip, zio_zero_copy_frames, zio_zero_copy_freed_on_failure,
          zio_recv_timeout, zio_poll_ready, zio_spin_then_block, zio_spin_warm_ticks, zio_spin_only_while_busy,
          zio_bad_endpoint_named, zio_free_port_bindable,
          zio_curve_admits_listed_keys_only, zio_max_msg_size_drops_oversized_frames)
