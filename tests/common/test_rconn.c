/* Tests for common/rconn against a real redis-server (tests/redis_fixture):
 * keys with TTL, hashes, counters, streams with consumer groups and
 * claiming, SCAN, the generic call, reconnection and error messages. */
#include "common/rconn.h"
#include "common/status.h"
#include "tests/redis_fixture.h"
#include "tests/test.h"

#include <sys/stat.h>
#include <time.h>
#include <unistd.h>

static int64_t t_now_ms(void) {
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (int64_t)ts.tv_sec * 1000 + ts.tv_nsec / 1000000;
}

/* Starts a server and connects to it through its URL. */
static struct rconn *t_open(struct redis_fixture *f, int flags) {
    fixture_redis_start(f, flags);
    struct rconn *c;
    char err[512];
    int rc = rconn_open_url(f->url_auth, 2000, &c, err, sizeof err);
    if (rc < 0) {
        fixture_redis_stop(f);
        TEST_FAIL("rconn_open_url(%s): %s", f->url, err); /* f->url: no password in logs */
    }
    return c;
}

/* Closes, stops the server and checks that its folder is gone. */
static void t_close(struct redis_fixture *f, struct rconn *c) {
    rconn_close(c);
    char dir[256];
    snprintf(dir, sizeof dir, "%s", f->dir);
    ASSERT_OK(fixture_redis_stop(f));
    struct stat st;
    ASSERT_TRUE(stat(dir, &st) != 0);
    ASSERT_EQ(0, (int)f->pid);
}

TEST(rconn_fixture_ping) {
    struct redis_fixture f;
    struct rconn *c = t_open(&f, 0);
    ASSERT_TRUE(f.port > 0);
    char want[64];
    snprintf(want, sizeof want, "redis://127.0.0.1:%d", f.port);
    ASSERT_STREQ(want, f.url);
    ASSERT_OK(rconn_ping(c));
    /* No persistence unless asked: no snapshots, no append-only file. */
    redisReply *r;
    ASSERT_OK(rconn_command(c, &r, "CONFIG GET save"));
    ASSERT_EQ((size_t)2, (size_t)r->elements);
    ASSERT_STREQ("", r->element[1]->str);
    freeReplyObject(r);
    ASSERT_OK(rconn_command(c, &r, "CONFIG GET appendonly"));
    ASSERT_STREQ("no", r->element[1]->str);
    freeReplyObject(r);
    snprintf(want, sizeof want, "127.0.0.1:%d", f.port);
    ASSERT_STREQ(want, rconn_addr(c));
    t_close(&f, c);
    ASSERT_OK(fixture_redis_stop(&f)); /* twice is fine */
}

TEST(rconn_set_get_ttl) {
    struct redis_fixture f;
    struct rconn *c = t_open(&f, 0);
    const uint8_t val[] = {0, 1, 2, 0xff, 0, 'x'}; /* binary, with NULs */
    ASSERT_OK(rconn_set(c, "k:ttl", val, sizeof val, 300));
    ASSERT_OK(rconn_set(c, "k:plain", "v", 1, 0));
    int64_t ttl = 0;
    ASSERT_OK(rconn_ttl(c, "k:ttl", &ttl));
    ASSERT_TRUE(ttl > 0 && ttl <= 300);
    ASSERT_OK(rconn_ttl(c, "k:plain", &ttl));
    ASSERT_EQ((int64_t)-1, ttl);
    void *got;
    size_t len;
    ASSERT_OK(rconn_get(c, "k:ttl", &got, &len));
    ASSERT_EQ(sizeof val, len);
    ASSERT_TRUE(memcmp(got, val, len) == 0);
    ASSERT_EQ(0, (int)((char *)got)[len]);
    free(got);
    ASSERT_EQ(0, rconn_set_nx(c, "k:plain", "w", 1, 0));
    ASSERT_EQ(1, rconn_set_nx(c, "k:new", "w", 1, 1000));
    usleep(400 * 1000);
    ASSERT_EQ(STATUS_NOT_FOUND, rconn_get(c, "k:ttl", &got, &len));
    ASSERT_TRUE(got == NULL);
    char want[128];
    snprintf(want, sizeof want, "redis 127.0.0.1:%d: GET k:ttl: no such key", f.port);
    ASSERT_STREQ(want, rconn_errstr(c));
    ASSERT_EQ(STATUS_NOT_FOUND, rconn_ttl(c, "k:ttl", &ttl));
    ASSERT_EQ(1, rconn_expire(c, "k:plain", 5000));
    ASSERT_EQ(0, rconn_expire(c, "k:none", 5000));
    ASSERT_EQ(1, rconn_del(c, "k:plain"));
    ASSERT_EQ(0, rconn_del(c, "k:plain"));
    t_close(&f, c);
}

TEST(rconn_hash_and_counter) {
    struct redis_fixture f;
    struct rconn *c = t_open(&f, 0);
    struct rconn_field in[2] = {{"state", "running", 7}, {"tokens", "\x01\x00\x02", 3}};
    ASSERT_OK(rconn_hset(c, "req:1", in, 2));
    struct rconn_fields all;
    ASSERT_OK(rconn_hgetall(c, "req:1", &all));
    ASSERT_EQ((size_t)2, all.n);
    int seen = 0;
    for (size_t i = 0; i < all.n; i++) {
        if (strcmp(all.items[i].name, "state") == 0) {
            ASSERT_STREQ("running", (char *)all.items[i].val);
            seen |= 1;
        } else if (strcmp(all.items[i].name, "tokens") == 0) {
            ASSERT_EQ((size_t)3, all.items[i].len);
            ASSERT_TRUE(memcmp(all.items[i].val, "\x01\x00\x02", 3) == 0);
            seen |= 2;
        }
    }
    ASSERT_EQ(3, seen);
    rconn_fields_free(&all);
    ASSERT_EQ((size_t)0, all.n);
    void *v;
    size_t len;
    ASSERT_OK(rconn_hget(c, "req:1", "state", &v, &len));
    ASSERT_STREQ("running", (char *)v);
    free(v);
    ASSERT_EQ(1, rconn_hdel(c, "req:1", "state"));
    ASSERT_EQ(STATUS_NOT_FOUND, rconn_hget(c, "req:1", "state", &v, &len));
    ASSERT_OK(rconn_hgetall(c, "req:missing", &all));
    ASSERT_EQ((size_t)0, all.n);
    int64_t n = 0;
    ASSERT_OK(rconn_incr(c, "ctr", 1, &n));
    ASSERT_EQ((int64_t)1, n);
    ASSERT_OK(rconn_incr(c, "ctr", 41, &n));
    ASSERT_EQ((int64_t)42, n);
    /* A Redis error reply names the command and carries Redis's text. */
    ASSERT_EQ(STATUS_INTERNAL, rconn_incr(c, "req:1", 1, &n));
    char want[160];
    snprintf(want, sizeof want,
             "redis 127.0.0.1:%d: INCRBY req:1: WRONGTYPE Operation against a key holding the "
             "wrong kind of value", f.port);
    ASSERT_STREQ(want, rconn_errstr(c));
    ASSERT_EQ(STATUS_INTERNAL, rconn_err(c));
    ASSERT_OK(rconn_ping(c));
    ASSERT_EQ(0, rconn_err(c));
    t_close(&f, c);
}

TEST(rconn_stream_add_read_ack) {
    struct redis_fixture f;
    struct rconn *c = t_open(&f, 0);
    ASSERT_OK(rconn_xgroup_create(c, "requests", "routers", "$"));
    ASSERT_OK(rconn_xgroup_create(c, "requests", "routers", "$")); /* idempotent */
    char ids[3][RCONN_ID_MAX];
    for (int i = 0; i < 3; i++) {
        char body[16];
        snprintf(body, sizeof body, "req-%d", i);
        struct rconn_field fl[2] = {{"id", body, strlen(body)}, {"pb", "\x08\x00\x10", 3}};
        ASSERT_OK(rconn_xadd(c, "requests", 1000, fl, 2, ids[i]));
        ASSERT_TRUE(strchr(ids[i], '-') != NULL);
    }
    int64_t xl = 0;
    ASSERT_OK(rconn_xlen(c, "requests", &xl));
    ASSERT_EQ((int64_t)3, xl);
    struct rconn_entries e;
    ASSERT_OK(rconn_xreadgroup(c, "requests", "routers", "r1", 10, 100, ">", &e));
    ASSERT_EQ((size_t)3, e.n);
    for (int i = 0; i < 3; i++) {
        ASSERT_STREQ(ids[i], e.items[i].id);
        size_t len;
        char body[16];
        snprintf(body, sizeof body, "req-%d", i);
        ASSERT_STREQ(body, (const char *)rconn_entry_field(&e.items[i], "id", &len));
        const void *pb = rconn_entry_field(&e.items[i], "pb", &len);
        ASSERT_EQ((size_t)3, len);
        ASSERT_TRUE(memcmp(pb, "\x08\x00\x10", 3) == 0);
        ASSERT_TRUE(rconn_entry_field(&e.items[i], "nope", &len) == NULL);
    }
    rconn_entries_free(&e);
    ASSERT_EQ(1, rconn_xack(c, "requests", "routers", ids[0]));
    ASSERT_EQ(0, rconn_xack(c, "requests", "routers", ids[0]));
    /* Nothing new: a bounded block returns no entries after about block_ms. */
    int64_t t0 = t_now_ms();
    ASSERT_OK(rconn_xreadgroup(c, "requests", "routers", "r1", 10, 150, ">", &e));
    int64_t waited = t_now_ms() - t0;
    ASSERT_EQ((size_t)0, e.n);
    ASSERT_TRUE(waited >= 140 && waited < 2000);
    ASSERT_OK(rconn_xreadgroup(c, "requests", "routers", "r1", 10, 0, ">", &e));
    ASSERT_EQ((size_t)0, e.n);
    /* "0" re-reads this consumer's pending entries: the two not acked. */
    ASSERT_OK(rconn_xreadgroup(c, "requests", "routers", "r1", 10, 0, "0", &e));
    ASSERT_EQ((size_t)2, e.n);
    ASSERT_STREQ(ids[1], e.items[0].id);
    rconn_entries_free(&e);
    struct rconn_pending *p;
    size_t np;
    ASSERT_OK(rconn_xpending(c, "requests", "routers", NULL, 10, &p, &np));
    ASSERT_EQ((size_t)2, np);
    ASSERT_STREQ("r1", p[0].consumer);
    ASSERT_STREQ(ids[1], p[0].id);
    ASSERT_EQ((int64_t)2, p[0].deliveries); /* read by ">" and again by "0" */
    free(p);
    /* MAXLEN trims (approximately: ~ keeps whole macro nodes, so use many). */
    for (int i = 0; i < 500; i++) {
        struct rconn_field fl = {"n", "x", 1};
        ASSERT_OK(rconn_xadd(c, "trimmed", 100, &fl, 1, NULL));
    }
    ASSERT_OK(rconn_xlen(c, "trimmed", &xl));
    ASSERT_TRUE(xl >= 100 && xl < 500);
    t_close(&f, c);
}

TEST(rconn_stream_claim_dead_consumer) {
    struct redis_fixture f;
    struct rconn *c = t_open(&f, 0);
    ASSERT_OK(rconn_xgroup_create(c, "q", "g", "0"));
    char id[RCONN_ID_MAX];
    struct rconn_field fl = {"pb", "payload", 7};
    ASSERT_OK(rconn_xadd(c, "q", 0, &fl, 1, id));
    struct rconn_entries e;
    /* "dead" takes the entry and never acknowledges it. */
    ASSERT_OK(rconn_xreadgroup(c, "q", "g", "dead", 1, 0, ">", &e));
    ASSERT_EQ((size_t)1, e.n);
    rconn_entries_free(&e);
    char next[RCONN_ID_MAX];
    /* Not idle long enough yet: nothing is claimed. */
    ASSERT_OK(rconn_xautoclaim(c, "q", "g", "alive", 60000, "0-0", 10, &e, next));
    ASSERT_EQ((size_t)0, e.n);
    usleep(150 * 1000);
    ASSERT_OK(rconn_xautoclaim(c, "q", "g", "alive", 100, "0-0", 10, &e, next));
    ASSERT_EQ((size_t)1, e.n);
    ASSERT_STREQ(id, e.items[0].id);
    size_t len;
    const void *v = rconn_entry_field(&e.items[0], "pb", &len);
    ASSERT_EQ((size_t)7, len);
    ASSERT_TRUE(memcmp(v, "payload", 7) == 0);
    ASSERT_STREQ("0-0", next);
    rconn_entries_free(&e);
    struct rconn_pending *p;
    size_t np;
    ASSERT_OK(rconn_xpending(c, "q", "g", "alive", 10, &p, &np));
    ASSERT_EQ((size_t)1, np);
    ASSERT_STREQ("alive", p[0].consumer);
    ASSERT_EQ((int64_t)2, p[0].deliveries);
    free(p);
    ASSERT_OK(rconn_xpending(c, "q", "g", "dead", 10, &p, &np));
    ASSERT_EQ((size_t)0, np);
    ASSERT_EQ(1, rconn_xack(c, "q", "g", id));
    /* An entry deleted from the stream is not handed out by a claim. */
    ASSERT_OK(rconn_xadd(c, "q", 0, &fl, 1, id));
    ASSERT_OK(rconn_xreadgroup(c, "q", "g", "dead", 1, 0, ">", &e));
    rconn_entries_free(&e);
    ASSERT_EQ(1, rconn_xdel(c, "q", id));
    ASSERT_OK(rconn_xautoclaim(c, "q", "g", "alive", 0, "0-0", 10, &e, next));
    ASSERT_EQ((size_t)0, e.n);
    t_close(&f, c);
}

TEST(rconn_missing_group) {
    struct redis_fixture f;
    struct rconn *c = t_open(&f, 0);
    struct rconn_entries e;
    ASSERT_OK(rconn_xgroup_create(c, "s", "g", "$"));
    ASSERT_EQ(STATUS_NOT_FOUND, rconn_xreadgroup(c, "s", "other", "me", 1, 0, ">", &e));
    char want[80];
    snprintf(want, sizeof want, "redis 127.0.0.1:%d: XREADGROUP s other me: NOGROUP ", f.port);
    ASSERT_TRUE(strncmp(rconn_errstr(c), want, strlen(want)) == 0);
    t_close(&f, c);
}

TEST(rconn_scan_pattern) {
    struct redis_fixture f;
    struct rconn *c = t_open(&f, 0);
    for (int i = 0; i < 1500; i++) {
        char k[32];
        snprintf(k, sizeof k, "%s:%d", i % 3 ? "worker" : "other", i);
        ASSERT_OK(rconn_set(c, k, "1", 1, 0));
    }
    char **keys;
    size_t n;
    ASSERT_OK(rconn_scan(c, "worker:*", &keys, &n));
    ASSERT_EQ((size_t)1000, n);
    for (size_t i = 0; i < n; i++) ASSERT_TRUE(strncmp(keys[i], "worker:", 7) == 0);
    for (size_t i = 1; i < n; i++) ASSERT_TRUE(strcmp(keys[i - 1], keys[i]) < 0); /* no repeats */
    rconn_keys_free(keys, n);
    ASSERT_OK(rconn_scan(c, "none:*", &keys, &n));
    ASSERT_EQ((size_t)0, n);
    rconn_keys_free(keys, n);
    t_close(&f, c);
}

TEST(rconn_generic_command) {
    struct redis_fixture f;
    struct rconn *c = t_open(&f, 0);
    redisReply *r;
    const char bytes[] = {'a', 0, 'b'};
    ASSERT_OK(rconn_command(c, &r, "SET %s %b", "gk", bytes, sizeof bytes));
    ASSERT_EQ(REDIS_REPLY_STATUS, r->type);
    freeReplyObject(r);
    const char *argv[] = {"GET", "gk"};
    ASSERT_OK(rconn_command_argv(c, &r, 2, argv, NULL));
    ASSERT_EQ(REDIS_REPLY_STRING, r->type);
    ASSERT_EQ((size_t)3, (size_t)r->len);
    ASSERT_TRUE(memcmp(r->str, bytes, 3) == 0);
    freeReplyObject(r);
    ASSERT_EQ(STATUS_INTERNAL, rconn_command(c, &r, "INCR %s", "gk"));
    ASSERT_TRUE(r == NULL);
    ASSERT_TRUE(strstr(rconn_errstr(c), ": INCR gk: ERR value is not an integer") != NULL);
    ASSERT_EQ(STATUS_INTERNAL, rconn_command(c, &r, "NOSUCHCOMMAND x"));
    ASSERT_TRUE(strstr(rconn_errstr(c), "NOSUCHCOMMAND x: ERR unknown command") != NULL);
    t_close(&f, c);
}

TEST(rconn_pipeline_replies) {
    struct redis_fixture f;
    struct rconn *c = t_open(&f, 0);
    const char *a0[] = {"MULTI"};
    const char *a1[] = {"HSET", "req:7", "state", "done"};
    const char *a2[] = {"INCRBY", "done", "1"};
    const char *a3[] = {"EXEC"};
    struct rconn_cmd cmds[4] = {{1, a0, NULL}, {4, a1, NULL}, {3, a2, NULL}, {1, a3, NULL}};
    redisReply *r[4];
    ASSERT_OK(rconn_pipeline(c, cmds, 4, r));
    ASSERT_EQ(REDIS_REPLY_STATUS, r[0]->type);
    ASSERT_EQ(REDIS_REPLY_STATUS, r[1]->type); /* QUEUED */
    ASSERT_EQ(REDIS_REPLY_ARRAY, r[3]->type);
    ASSERT_EQ((size_t)2, (size_t)r[3]->elements);
    ASSERT_EQ(1LL, r[3]->element[1]->integer);
    for (int i = 0; i < 4; i++) freeReplyObject(r[i]);
    /* An error reply in the middle: every reply is still handed over. */
    const char *b0[] = {"SET", "p", "1"};
    const char *b1[] = {"HSET", "p", "f", "v"};
    const char *b2[] = {"GET", "p"};
    struct rconn_cmd bad[3] = {{3, b0, NULL}, {4, b1, NULL}, {2, b2, NULL}};
    ASSERT_EQ(STATUS_INTERNAL, rconn_pipeline(c, bad, 3, r));
    ASSERT_EQ(REDIS_REPLY_STATUS, r[0]->type);
    ASSERT_EQ(REDIS_REPLY_ERROR, r[1]->type);
    ASSERT_EQ(REDIS_REPLY_STRING, r[2]->type);
    ASSERT_STREQ("1", r[2]->str);
    ASSERT_TRUE(strstr(rconn_errstr(c), "pipeline of 3 (SET p, ...): command 1 (HSET p): WRONGTYPE") != NULL);
    for (int i = 0; i < 3; i++) freeReplyObject(r[i]);
    t_close(&f, c);
}

TEST(rconn_reconnect_after_restart) {
    struct redis_fixture f;
    struct rconn *c = t_open(&f, FIXTURE_REDIS_PERSIST);
    ASSERT_OK(rconn_set(c, "durable", "yes", 3, 0));
    int port = f.port;
    fixture_redis_restart(&f);
    ASSERT_EQ(port, f.port);
    /* The first command after the restart already works: the dead
     * connection is noticed before sending, not after losing a command. */
    void *v;
    size_t len;
    ASSERT_OK(rconn_get(c, "durable", &v, &len));
    ASSERT_STREQ("yes", (char *)v);
    free(v);
    t_close(&f, c);
}

TEST(rconn_error_when_gone) {
    struct redis_fixture f;
    struct rconn *c = t_open(&f, 0);
    ASSERT_OK(rconn_ping(c));
    fixture_redis_kill(&f);
    ASSERT_EQ(STATUS_UNAVAILABLE, rconn_set(c, "k", "v", 1, 0));
    char want[128];
    snprintf(want, sizeof want, "redis 127.0.0.1:%d: SET k: connect: Connection refused", f.port);
    ASSERT_STREQ(want, rconn_errstr(c));
    ASSERT_EQ(STATUS_UNAVAILABLE, rconn_err(c));
    struct rconn *c2;
    char err[256];
    ASSERT_EQ(STATUS_UNAVAILABLE, rconn_open("127.0.0.1", f.port, 0, 500, &c2, err, sizeof err));
    ASSERT_TRUE(c2 == NULL);
    snprintf(want, sizeof want, "redis 127.0.0.1:%d: connect: Connection refused", f.port);
    ASSERT_STREQ(want, err);
    /* The server comes back: the same connection object recovers. */
    fixture_redis_restart(&f);
    ASSERT_OK(rconn_set(c, "k", "v", 1, 0));
    t_close(&f, c);
}

TEST(rconn_timeout_then_recovers) {
    struct redis_fixture f;
    fixture_redis_start(&f, 0);
    struct rconn *c, *admin;
    char err[256];
    ASSERT_OK(rconn_open(f.host, f.port, 0, 150, &c, err, sizeof err));
    ASSERT_OK(rconn_open(f.host, f.port, 0, 2000, &admin, err, sizeof err));
    redisReply *r;
    /* Pause writers for 600 ms: the SET cannot get its reply in 150 ms. */
    ASSERT_OK(rconn_command(admin, &r, "CLIENT PAUSE 600 WRITE"));
    freeReplyObject(r);
    ASSERT_EQ(STATUS_TIMEOUT, rconn_set(c, "k", "v", 1, 0));
    char want[128];
    snprintf(want, sizeof want, "redis 127.0.0.1:%d: SET k: no reply within 150 ms", f.port);
    ASSERT_STREQ(want, rconn_errstr(c));
    usleep(700 * 1000);
    ASSERT_OK(rconn_set(c, "k2", "v", 1, 0));
    void *v;
    size_t len;
    ASSERT_OK(rconn_get(c, "k2", &v, &len));
    free(v);
    rconn_close(admin);
    t_close(&f, c);
}

TEST(rconn_url_and_db) {
    struct redis_fixture f;
    fixture_redis_start(&f, 0);
    struct rconn *c, *c3;
    char err[256], url[96];
    snprintf(url, sizeof url, "%s/3", f.url);
    ASSERT_OK(rconn_open_url(url, 1000, &c3, err, sizeof err));
    ASSERT_OK(rconn_set(c3, "in3", "x", 1, 0));
    ASSERT_OK(rconn_open_url(f.url, 1000, &c, err, sizeof err));
    void *v;
    size_t len;
    ASSERT_EQ(STATUS_NOT_FOUND, rconn_get(c, "in3", &v, &len)); /* db 0 */
    rconn_close(c3);
    static const char *const bad[][2] = {
        {"http://h:1", "redis URL 'http://h:1': does not start with redis://"},
        {"redis://:6379", "redis URL 'redis://:6379': no host"},
        {"redis://h:0", "redis URL 'redis://h:0': port is not a number from 1 to 65535"},
        {"redis://h:70000", "redis URL 'redis://h:70000': port is not a number from 1 to 65535"},
        {"redis://h:12ab", "redis URL 'redis://h:12ab': port is not a number from 1 to 65535"},
        {"redis://h:1/x", "redis URL 'redis://h:1/x': database 'x' is not a number"},
    };
    for (size_t i = 0; i < sizeof bad / sizeof bad[0]; i++) {
        struct rconn *x;
        ASSERT_EQ(STATUS_BAD_INPUT, rconn_open_url(bad[i][0], 100, &x, err, sizeof err));
        ASSERT_STREQ(bad[i][1], err);
        ASSERT_TRUE(x == NULL);
    }
    t_close(&f, c);
}

/* requirepass: the URL's password (with characters it must escape) opens
 * the connection and every reconnection; a wrong one fails naming the
 * server and the redacted URL, never the password. */
TEST(rconn_auth_password) {
    struct redis_fixture f;
    struct rconn *c = t_open(&f, FIXTURE_REDIS_AUTH);
    ASSERT_TRUE(strchr(f.password, '@') && strchr(f.password, ':') && strchr(f.password, '/'));
    ASSERT_OK(rconn_set(c, "k", "v", 1, 0));
    /* Reconnecting after a restart authenticates again. */
    fixture_redis_restart(&f);
    ASSERT_OK(rconn_ping(c));

    /* No password: connected, but every command is refused. */
    struct rconn *x;
    char err[512], want[256];
    ASSERT_OK(rconn_open_url(f.url, 1000, &x, err, sizeof err));
    ASSERT_EQ(STATUS_INTERNAL, rconn_ping(x));
    ASSERT_TRUE(strstr(rconn_errstr(x), "NOAUTH") != NULL);
    rconn_close(x);

    /* A wrong password. */
    char url[160];
    snprintf(url, sizeof url, "redis://:not-it@127.0.0.1:%d", f.port);
    ASSERT_EQ(STATUS_BAD_INPUT, rconn_open_url(url, 1000, &x, err, sizeof err));
    ASSERT_TRUE(x == NULL);
    snprintf(want, sizeof want, "redis 127.0.0.1:%d: AUTH: WRONGPASS", f.port);
    ASSERT_TRUE(strncmp(err, want, strlen(want)) == 0);
    snprintf(want, sizeof want, "(URL redis://:***@127.0.0.1:%d)", f.port);
    ASSERT_TRUE(strstr(err, want) != NULL);
    ASSERT_TRUE(strstr(err, "not-it") == NULL);
    ASSERT_EQ(STATUS_BAD_INPUT, rconn_open_auth(f.host, f.port, 0, NULL, "not-it", 1000, &x, err, sizeof err));
    ASSERT_TRUE(strstr(err, "not-it") == NULL);
    ASSERT_OK(rconn_open_auth(f.host, f.port, 0, NULL, f.password, 1000, &x, err, sizeof err));
    rconn_close(x);
    t_close(&f, c);
}

/* An ACL user: user and password in the URL, with a database. */
TEST(rconn_auth_acl_user) {
    struct redis_fixture f;
    struct rconn *admin = t_open(&f, FIXTURE_REDIS_AUTH);
    redisReply *r;
    ASSERT_OK(rconn_command(admin, &r, "ACL SETUSER app on >app-pw ~app:* &* +@all"));
    freeReplyObject(r);
    struct rconn *c;
    char err[512], url[160], want[256];
    snprintf(url, sizeof url, "redis://app:app-pw@127.0.0.1:%d/2", f.port);
    ASSERT_OK(rconn_open_url(url, 1000, &c, err, sizeof err));
    ASSERT_OK(rconn_command(c, &r, "ACL WHOAMI"));
    ASSERT_STREQ("app", r->str);
    freeReplyObject(r);
    ASSERT_OK(rconn_set(c, "app:k", "v", 1, 0));
    /* The ACL holds: keys outside app:* are refused. */
    ASSERT_EQ(STATUS_INTERNAL, rconn_set(c, "other", "v", 1, 0));
    /* db 2 was selected after AUTH. */
    void *v;
    size_t len;
    ASSERT_EQ(STATUS_NOT_FOUND, rconn_get(admin, "app:k", &v, &len));
    rconn_close(c);

    struct rconn *x;
    snprintf(url, sizeof url, "redis://app:wrong@127.0.0.1:%d/2", f.port);
    ASSERT_EQ(STATUS_BAD_INPUT, rconn_open_url(url, 1000, &x, err, sizeof err));
    snprintf(want, sizeof want, "redis 127.0.0.1:%d: AUTH as user 'app': WRONGPASS", f.port);
    ASSERT_TRUE(strncmp(err, want, strlen(want)) == 0);
    snprintf(want, sizeof want, "(URL redis://app:***@127.0.0.1:%d/2)", f.port);
    ASSERT_TRUE(strstr(err, want) != NULL);
    ASSERT_TRUE(strstr(err, "wrong") == NULL);
    /* A user without a password cannot authenticate. */
    snprintf(url, sizeof url, "redis://app@127.0.0.1:%d", f.port);
    ASSERT_EQ(STATUS_BAD_INPUT, rconn_open_url(url, 1000, &x, err, sizeof err));
    snprintf(want, sizeof want, "redis 127.0.0.1:%d: user 'app' has no password (give one in the URL or a "
             "password file)", f.port);
    ASSERT_STREQ(want, err);
    t_close(&f, admin);
}

/* --redis-password-file: the file's password replaces the URL's. */
TEST(rconn_url_password_file) {
    char dir[] = "/tmp/llm-rconn-pw-XXXXXX";
    ASSERT_TRUE(mkdtemp(dir) != NULL);
    char path[128], err[512];
    snprintf(path, sizeof path, "%s/pw", dir);
    FILE *fp = fopen(path, "w");
    ASSERT_TRUE(fp != NULL);
    fputs("p@ss:w/rd%\n", fp);
    fclose(fp);
    char *u = NULL;
    ASSERT_OK(rconn_url_password_file("redis://app:old@h:1/2", path, &u, err, sizeof err));
    ASSERT_STREQ("redis://app:p%40ss%3Aw%2Frd%25@h:1/2", u);
    free(u);
    ASSERT_OK(rconn_url_password_file("redis://h", path, &u, err, sizeof err));
    ASSERT_STREQ("redis://:p%40ss%3Aw%2Frd%25@h", u);
    free(u);
    /* Bad files and URLs: errors name the file, and never a password. */
    ASSERT_EQ(STATUS_BAD_INPUT, rconn_url_password_file("http://:old@h", path, &u, err, sizeof err));
    ASSERT_STREQ("redis URL 'http://:***@h': does not start with redis://", err);
    ASSERT_TRUE(u == NULL);
    fp = fopen(path, "w");
    fputs("\n", fp);
    fclose(fp);
    ASSERT_EQ(STATUS_BAD_INPUT, rconn_url_password_file("redis://h", path, &u, err, sizeof err));
    char want[256];
    snprintf(want, sizeof want, "redis password file %s: is empty", path);
    ASSERT_STREQ(want, err);
    fp = fopen(path, "w");
    fputs("alpha\nbeta\n", fp);
    fclose(fp);
    ASSERT_EQ(STATUS_BAD_INPUT, rconn_url_password_file("redis://h", path, &u, err, sizeof err));
    snprintf(want, sizeof want, "redis password file %s: the password must be one line of text", path);
    ASSERT_STREQ(want, err);
    ASSERT_TRUE(strstr(err, "alpha") == NULL);
    unlink(path);
    ASSERT_EQ(STATUS_IO, rconn_url_password_file("redis://h", path, &u, err, sizeof err));
    snprintf(want, sizeof want, "redis password file %s: No such file or directory", path);
    ASSERT_STREQ(want, err);
    rmdir(dir);

    /* Against a server: the URL without a password plus the file. */
    struct redis_fixture f;
    fixture_redis_start(&f, FIXTURE_REDIS_AUTH);
    char d2[] = "/tmp/llm-rconn-pw-XXXXXX";
    ASSERT_TRUE(mkdtemp(d2) != NULL);
    snprintf(path, sizeof path, "%s/pw", d2);
    fp = fopen(path, "w");
    fprintf(fp, "%s\n", f.password);
    fclose(fp);
    ASSERT_OK(rconn_url_password_file(f.url, path, &u, err, sizeof err));
    ASSERT_STREQ(f.url_auth, u);
    struct rconn *c;
    ASSERT_OK(rconn_open_url(u, 1000, &c, err, sizeof err));
    free(u);
    unlink(path);
    rmdir(d2);
    t_close(&f, c);
}

TEST(rconn_url_redact_and_escapes) {
    static const char *const cases[][2] = {
        {"redis://h:1", "redis://h:1"},
        {"redis://:pw@h:1/2", "redis://:***@h:1/2"},
        {"redis://app:p@w@h", "redis://app:***@h"},
        {"redis://app@h", "redis://app@h"},
        {"redis://:@h", "redis://:***@h"},
    };
    char out[128];
    for (size_t i = 0; i < sizeof cases / sizeof cases[0]; i++) {
        rconn_url_redact(cases[i][0], out, sizeof out);
        ASSERT_STREQ(cases[i][1], out);
    }
    struct rconn *x;
    char err[256];
    ASSERT_EQ(STATUS_BAD_INPUT, rconn_open_url("redis://:ab%zz@h:1", 100, &x, err, sizeof err));
    ASSERT_STREQ("redis URL 'redis://:***@h:1': the password has a bad %-escape (write '%' as %25)", err);
    ASSERT_EQ(STATUS_BAD_INPUT, rconn_open_url("redis://:secret@h:99999", 100, &x, err, sizeof err));
    ASSERT_STREQ("redis URL 'redis://:***@h:99999': port is not a number from 1 to 65535", err);
}

TEST_MAIN(rconn_fixture_ping, rconn_set_get_ttl, rconn_hash_and_counter, rconn_stream_add_read_ack,
          rconn_stream_claim_dead_consumer, rconn_missing_group, rconn_scan_pattern,
          rconn_generic_command, rconn_pipeline_replies, rconn_reconnect_after_restart, rconn_error_when_gone,
          rconn_timeout_then_recovers, rconn_url_and_db, rconn_auth_password, rconn_auth_acl_user,
          rconn_url_password_file, rconn_url_redact_and_escapes)
