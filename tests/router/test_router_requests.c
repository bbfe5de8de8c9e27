/* Tests of the router's durable requests (router/requests.c) against a real
 * redis-server: a request is stored with its stream entry pending, tokens
 * append in one round trip, a re-attaching client's missed tokens come back
 * from Redis, finishing acknowledges and expires, and a restarted router
 * (same or another consumer name, also after a Redis restart) recovers every
 * accepted, unfinished request. */
#include "router/requests.h"

#include "common/status.h"
#include "tests/redis_fixture.h"
#include "tests/test.h"

#include <unistd.h>

static reqstore *t_open(const struct redis_fixture *f, const char *consumer, int64_t claim_idle) {
    struct reqstore_config cfg = {f->url, "t:", consumer, 60000, claim_idle, 2000};
    reqstore *rs = NULL;
    char err[512];
    if (reqstore_open(&rs, &cfg, err, sizeof err) != 0) TEST_FAIL("reqstore_open: %s", err);
    return rs;
}

/* A request record as the router makes one; its pointers are the test's. */
static void t_rec(struct reqrec *r, const char *id, int32_t *prompt, int32_t n) {
    memset(r, 0, sizeof *r);
    snprintf(r->id, sizeof r->id, "%s", id);
    static uint8_t params[] = {0x0a, 0x02, 'h', 'i', 0x00, 0x28, 0x05};
    r->params = params;
    r->params_len = sizeof params; /* binary, with a NUL inside */
    r->prompt = prompt;
    r->n_prompt = n;
    r->seed = 0xfedcba9876543210ull;
    r->created_ms = 1700000000123;
    r->deadline_ms = 1700000060000;
}

static int64_t t_pending(reqstore *rs, const char *consumer) {
    struct rconn_pending *p = NULL;
    size_t n = 0;
    if (rconn_xpending(reqstore_conn(rs), "t:requests", "routers", consumer, 100, &p, &n) < 0)
        TEST_FAIL("xpending: %s", rconn_errstr(reqstore_conn(rs)));
    free(p);
    return (int64_t)n;
}

TEST(router_requests_tokens_encoding) {
    int32_t ids[4] = {0, 1, -1, 0x12345678}, back[4];
    uint8_t b[16];
    reqstore_tokens_encode(ids, 4, b);
    ASSERT_EQ(0x78, (int)b[12]);
    ASSERT_EQ(0x12, (int)b[15]);
    ASSERT_EQ(0xff, (int)b[8]);
    reqstore_tokens_decode(b, 4, back);
    for (int i = 0; i < 4; i++) ASSERT_EQ(ids[i], back[i]);
}

TEST(router_requests_persist_and_reattach) {
    struct redis_fixture f;
    fixture_redis_start(&f, 0);
    reqstore *rs = t_open(&f, "r1", 60000);
    int32_t prompt[5] = {1, 400, 401, 402, 13};
    struct reqrec a, b;
    t_rec(&a, "req-a", prompt, 5);
    t_rec(&b, "req-b", prompt, 3);
    ASSERT_OK(reqstore_create(rs, &a));
    ASSERT_OK(reqstore_create(rs, &b));
    ASSERT_TRUE(a.entry[0] != '\0');
    ASSERT_TRUE(strcmp(a.entry, b.entry) != 0);
    ASSERT_EQ((int64_t)2, t_pending(rs, "r1")); /* accepted and unfinished */

    int32_t g1[2] = {7, 8}, g2[1] = {9}, gb[3] = {100, 101, 102};
    struct reqstore_append ap[3] = {{"req-a", g1, 2, NULL}, {"req-b", gb, 3, NULL}, {"req-x", NULL, 0, NULL}};
    ASSERT_OK(reqstore_append(rs, ap, 3));
    struct reqstore_append ap2 = {"req-a", g2, 1, NULL};
    ASSERT_OK(reqstore_append(rs, &ap2, 1));

    /* A client re-attaching to a router that lost its memory gets the
     * request and every token generated so far. */
    struct reqrec l;
    ASSERT_OK(reqstore_load(rs, "", "req-a", &l));
    ASSERT_STREQ("req-a", l.id);
    ASSERT_EQ((size_t)7, l.params_len);
    ASSERT_EQ(0, memcmp(l.params, a.params, 7));
    ASSERT_EQ(5, l.n_prompt);
    ASSERT_EQ(402, l.prompt[3]);
    ASSERT_EQ(3, l.n_gen);
    ASSERT_EQ(7, l.gen[0]);
    ASSERT_EQ(9, l.gen[2]);
    ASSERT_EQ(0xfedcba9876543210ull, l.seed);
    ASSERT_EQ((int64_t)1700000060000, l.deadline_ms);
    ASSERT_EQ((int)REQREC_QUEUED, (int)l.state);
    ASSERT_STREQ(a.entry, l.entry);
    reqrec_free(&l);
    ASSERT_EQ(STATUS_NOT_FOUND, reqstore_load(rs, "", "nobody", &l));
    ASSERT_TRUE(strstr(reqstore_errstr(rs), "t:req:nobody") != NULL);
    reqstore_close(rs);
    ASSERT_OK(fixture_redis_stop(&f));
}

TEST(router_requests_finish_acks_and_expires) {
    struct redis_fixture f;
    fixture_redis_start(&f, 0);
    reqstore *rs = t_open(&f, "r1", 60000);
    int32_t prompt[2] = {1, 2};
    struct reqrec a;
    t_rec(&a, "done-1", prompt, 2);
    ASSERT_OK(reqstore_create(rs, &a));
    int32_t g[1] = {5};
    struct reqstore_append ap = {"done-1", g, 1, NULL};
    ASSERT_OK(reqstore_append(rs, &ap, 1));
    a.finish = 1;
    a.stop_token = -1;
    a.stop_string = "The end";
    ASSERT_OK(reqstore_finish(rs, &a));
    ASSERT_EQ((int64_t)0, t_pending(rs, "r1"));
    int64_t len = -1, ttl = -1;
    ASSERT_OK(rconn_xlen(reqstore_conn(rs), "t:requests", &len));
    ASSERT_EQ((int64_t)0, len);
    ASSERT_OK(rconn_ttl(reqstore_conn(rs), "t:req:done-1", &ttl));
    ASSERT_TRUE(ttl > 0 && ttl <= 60000);
    ASSERT_OK(rconn_ttl(reqstore_conn(rs), "t:req:done-1:gen", &ttl));
    ASSERT_TRUE(ttl > 0 && ttl <= 60000);
    struct reqrec l;
    ASSERT_OK(reqstore_load(rs, "", "done-1", &l));
    ASSERT_EQ((int)REQREC_DONE, (int)l.state);
    ASSERT_EQ(1, l.finish);
    ASSERT_EQ(-1, l.stop_token);
    ASSERT_STREQ("The end", l.stop_string);
    ASSERT_TRUE(l.error_message == NULL);
    ASSERT_EQ(1, l.n_gen);
    reqrec_free(&l);
    reqstore_close(rs);
    ASSERT_OK(fixture_redis_stop(&f));
}

/* Request ids are per owner key: two keys' requests of one id are two
 * requests, each with its own tokens and end, and a restarted router
 * recovers both with their owners. */
TEST(router_requests_ids_are_per_owner) {
    struct redis_fixture f;
    fixture_redis_start(&f, 0);
    reqstore *rs = t_open(&f, "r1", 60000);
    static const char alice[] = "A1ice0000000000000000000000000000000000";
    static const char bob[] = "B0b:{}0000000000000000000000000000000000";
    int32_t pa[2] = {1, 2}, pb[3] = {1, 7, 8};
    struct reqrec a, b, l;
    t_rec(&a, "same", pa, 2);
    snprintf(a.owner, sizeof a.owner, "%s", alice);
    t_rec(&b, "same", pb, 3);
    snprintf(b.owner, sizeof b.owner, "%s", bob);
    ASSERT_OK(reqstore_create(rs, &a));
    ASSERT_OK(reqstore_create(rs, &b)); /* bob's does not replace alice's */
    int32_t ga[1] = {50}, gb[2] = {60, 61};
    struct reqstore_append ap[2] = {{"same", ga, 1, alice}, {"same", gb, 2, bob}};
    ASSERT_OK(reqstore_append(rs, ap, 2));
    ASSERT_OK(reqstore_load(rs, alice, "same", &l));
    ASSERT_EQ(2, l.n_prompt);
    ASSERT_EQ(1, l.n_gen);
    ASSERT_EQ(50, l.gen[0]);
    ASSERT_STREQ(alice, l.owner);
    reqrec_free(&l);
    ASSERT_OK(reqstore_load(rs, bob, "same", &l));
    ASSERT_EQ(3, l.n_prompt);
    ASSERT_EQ(2, l.n_gen);
    ASSERT_STREQ(bob, l.owner);
    reqrec_free(&l);
    /* Neither is the request of no owner, nor of a third key. */
    ASSERT_EQ(STATUS_NOT_FOUND, reqstore_load(rs, "", "same", &l));
    ASSERT_EQ(STATUS_NOT_FOUND, reqstore_load(rs, "C0000000000000000000000000000000000000000", "same", &l));
    /* Bob's end leaves alice's request queued. */
    b.finish = 1;
    ASSERT_OK(reqstore_finish(rs, &b));
    reqstore_close(rs);
    rs = t_open(&f, "r1", 60000);
    struct reqrec *list = NULL;
    size_t n = 0;
    ASSERT_OK(reqstore_recover(rs, &list, &n));
    ASSERT_EQ((size_t)1, n);
    ASSERT_STREQ("same", list[0].id);
    ASSERT_STREQ(alice, list[0].owner);
    ASSERT_EQ(1, list[0].n_gen);
    for (size_t i = 0; i < n; i++) reqrec_free(&list[i]);
    free(list);
    ASSERT_OK(reqstore_load(rs, bob, "same", &l));
    ASSERT_EQ((int)REQREC_DONE, (int)l.state);
    reqrec_free(&l);
    reqstore_close(rs);
    ASSERT_OK(fixture_redis_stop(&f));
}

static const struct reqrec *t_find(const struct reqrec *rs, size_t n, const char *id) {
    for (size_t i = 0; i < n; i++)
        if (strcmp(rs[i].id, id) == 0) return &rs[i];
    return NULL;
}

static void t_free_list(struct reqrec *l, size_t n) {
    for (size_t i = 0; i < n; i++) reqrec_free(&l[i]);
    free(l);
}

TEST(router_requests_recover_after_restart) {
    struct redis_fixture f;
    fixture_redis_start(&f, FIXTURE_REDIS_PERSIST);
    reqstore *rs = t_open(&f, "router-a", 60000);
    int32_t prompt[3] = {1, 2, 3};
    struct reqrec a, b, c;
    t_rec(&a, "live", prompt, 3);
    t_rec(&b, "finished", prompt, 3);
    t_rec(&c, "fresh", prompt, 1);
    ASSERT_OK(reqstore_create(rs, &a));
    ASSERT_OK(reqstore_create(rs, &b));
    int32_t g[3] = {40, 41, 42};
    struct reqstore_append ap = {"live", g, 3, NULL};
    ASSERT_OK(reqstore_append(rs, &ap, 1));
    b.finish = 2;
    ASSERT_OK(reqstore_finish(rs, &b));
    reqstore_close(rs); /* the router dies */

    /* Restart under the same name: its own pending entries come back. */
    rs = t_open(&f, "router-a", 60000);
    struct reqrec *l = NULL;
    size_t n = 0;
    ASSERT_OK(reqstore_recover(rs, &l, &n));
    ASSERT_EQ((size_t)1, n);
    ASSERT_STREQ("live", l[0].id);
    ASSERT_EQ(3, l[0].n_gen);
    ASSERT_EQ(42, l[0].gen[2]);
    ASSERT_STREQ(a.entry, l[0].entry);
    t_free_list(l, n);
    /* A request created here, then Redis restarts (it persists). */
    ASSERT_OK(reqstore_create(rs, &c));
    reqstore_close(rs);
    fixture_redis_restart(&f);

    /* Another router (another name) claims the dead one's idle entries. */
    rs = t_open(&f, "router-b", 0);
    ASSERT_OK(reqstore_recover(rs, &l, &n));
    ASSERT_EQ((size_t)2, n);
    ASSERT_TRUE(t_find(l, n, "live") != NULL);
    ASSERT_TRUE(t_find(l, n, "fresh") != NULL);
    ASSERT_EQ(1, t_find(l, n, "fresh")->n_prompt);
    t_free_list(l, n);
    ASSERT_EQ((int64_t)2, t_pending(rs, "router-b"));
    ASSERT_EQ((int64_t)0, t_pending(rs, "router-a"));
    reqstore_close(rs);
    ASSERT_OK(fixture_redis_stop(&f));
}

/* With claim_idle set, a request whose entry another live router holds is
 * refused naming that router, with a retry hint of the time left until the
 * entry can be claimed; once the holder is silent that long, the load takes
 * the entry. */
TEST(router_requests_load_guards_another_routers_request) {
    struct redis_fixture f;
    fixture_redis_start(&f, 0);
    reqstore *a = t_open(&f, "router-a", 2000), *b = t_open(&f, "router-b", 2000);
    int32_t prompt[3] = {1, 2, 3};
    struct reqrec r, l;
    t_rec(&r, "held", prompt, 3);
    ASSERT_OK(reqstore_create(a, &r));
    ASSERT_EQ(STATUS_UNAVAILABLE, reqstore_load(b, "", "held", &l));
    ASSERT_TRUE(strstr(reqstore_errstr(b), "router-a") != NULL);
    int64_t hint = reqstore_claim_in_ms(b);
    ASSERT_TRUE(hint > 1500 && hint <= 2010);
    usleep(250 * 1000);
    ASSERT_EQ(STATUS_UNAVAILABLE, reqstore_load(b, "", "held", &l));
    int64_t hint2 = reqstore_claim_in_ms(b);
    printf("  claim hints %lld ms, then %lld ms after 250 ms (claim idle 2000 ms)\n", (long long)hint,
           (long long)hint2);
    ASSERT_TRUE(hint2 <= hint - 200 && hint2 > 0);
    /* Its holder touches it: the hint starts over. */
    ASSERT_TRUE(reqstore_touch(a) >= 0);
    ASSERT_EQ(STATUS_UNAVAILABLE, reqstore_load(b, "", "held", &l));
    ASSERT_TRUE(reqstore_claim_in_ms(b) > 1500);
    /* Asked again after the hint, the silent holder's entry is taken. */
    usleep((useconds_t)reqstore_claim_in_ms(b) * 1000);
    ASSERT_OK(reqstore_load(b, "", "held", &l));
    ASSERT_EQ((int64_t)0, reqstore_claim_in_ms(b));
    reqrec_free(&l);
    ASSERT_EQ((int64_t)1, t_pending(b, "router-b"));
    ASSERT_EQ((int64_t)0, t_pending(b, "router-a"));
    reqstore_close(a);
    reqstore_close(b);
    ASSERT_OK(fixture_redis_stop(&f));
}

TEST(router_requests_recover_drops_broken_entries) {
    struct redis_fixture f;
    fixture_redis_start(&f, 0);
    reqstore *rs = t_open(&f, "r1", 60000);
    struct rconn *c = reqstore_conn(rs);
    redisReply *rep;
    /* An entry without a hash, one with a malformed hash, one well-formed
     * written by another producer: only the last is recovered. */
    ASSERT_OK(rconn_command(c, &rep, "XADD t:requests * id ghost"));
    freeReplyObject(rep);
    ASSERT_OK(rconn_command(c, &rep, "HSET t:req:bad params x prompt abc state queued"));
    freeReplyObject(rep);
    ASSERT_OK(rconn_command(c, &rep, "XADD t:requests * id bad"));
    freeReplyObject(rep);
    int32_t prompt[1] = {9};
    uint8_t pb[4];
    reqstore_tokens_encode(prompt, 1, pb);
    ASSERT_OK(rconn_command(c, &rep,
                            "HSET t:req:ext params p prompt %b seed 5 created_ms 1 deadline_ms 0 "
                            "state queued",
                            pb, (size_t)4));
    freeReplyObject(rep);
    ASSERT_OK(rconn_command(c, &rep, "XADD t:requests * id ext"));
    freeReplyObject(rep);
    struct reqrec l;
    ASSERT_EQ(STATUS_PROTOCOL, reqstore_load(rs, "", "bad", &l));
    ASSERT_TRUE(strstr(reqstore_errstr(rs), "t:req:bad: field prompt has 3 bytes") != NULL);
    struct reqrec *list = NULL;
    size_t n = 0;
    ASSERT_OK(reqstore_recover(rs, &list, &n));
    ASSERT_EQ((size_t)1, n);
    ASSERT_STREQ("ext", list[0].id);
    ASSERT_EQ((uint64_t)5, list[0].seed);
    t_free_list(list, n);
    int64_t len = -1;
    ASSERT_OK(rconn_xlen(c, "t:requests", &len));
    ASSERT_EQ((int64_t)1, len);
    reqstore_close(rs);
    ASSERT_OK(fixture_redis_stop(&f));
}

TEST(router_requests_unavailable_redis) {
    struct redis_fixture f;
    fixture_redis_start(&f, 0);
    reqstore *rs = t_open(&f, "r1", 60000);
    fixture_redis_kill(&f);
    int32_t prompt[1] = {1};
    struct reqrec a;
    t_rec(&a, "x", prompt, 1);
    int rc = reqstore_create(rs, &a);
    ASSERT_TRUE(rc == STATUS_UNAVAILABLE || rc == STATUS_TIMEOUT);
    ASSERT_TRUE(strstr(reqstore_errstr(rs), "127.0.0.1") != NULL);
    reqstore_close(rs);
    ASSERT_OK(fixture_redis_stop(&f));
}

/* Redis restarted without its data under a running store: the next
 * request is stored at once (the group made again), with nothing stray in
 * the stream, and pending for this router as usual. */
TEST(router_requests_group_recreated_after_empty_restart) {
    struct redis_fixture f;
    fixture_redis_start(&f, FIXTURE_REDIS_AUTH); /* and through a password */
    struct reqstore_config cfg = {f.url_auth, "t:", "r1", 60000, 60000, 2000};
    reqstore *rs = NULL;
    char err[512];
    if (reqstore_open(&rs, &cfg, err, sizeof err) != 0) TEST_FAIL("reqstore_open: %s", err);
    int32_t prompt[2] = {1, 2};
    struct reqrec a, b;
    t_rec(&a, "before", prompt, 2);
    /* A new Redis counts as one that lost its data, once. */
    ASSERT_EQ((uint64_t)1, reqstore_groups_recreated(rs));
    ASSERT_EQ(1, reqstore_check(rs));
    ASSERT_EQ(0, reqstore_check(rs));
    ASSERT_OK(reqstore_create(rs, &a));
    fixture_redis_restart(&f); /* no persistence: empty */
    ASSERT_EQ((uint64_t)1, reqstore_groups_recreated(rs));
    t_rec(&b, "after", prompt, 2);
    ASSERT_OK(reqstore_create(rs, &b));
    ASSERT_EQ((uint64_t)2, reqstore_groups_recreated(rs));
    ASSERT_EQ(1, reqstore_check(rs)); /* the caller hears of it once */
    ASSERT_EQ(0, reqstore_check(rs));
    ASSERT_EQ((int64_t)1, t_pending(rs, "r1"));
    int64_t len = 0;
    ASSERT_OK(rconn_xlen(reqstore_conn(rs), "t:requests", &len));
    ASSERT_EQ((int64_t)1, len);
    struct reqrec l;
    ASSERT_OK(reqstore_load(rs, "", "after", &l));
    ASSERT_EQ(b.seed, l.seed);
    reqrec_free(&l);
    ASSERT_EQ(STATUS_NOT_FOUND, reqstore_load(rs, "", "before", &l));
    /* Recovery after the group was deleted by hand makes it again too. */
    redisReply *r;
    ASSERT_OK(rconn_command(reqstore_conn(rs), &r, "XGROUP DESTROY t:requests routers"));
    freeReplyObject(r);
    struct reqrec *list = NULL;
    size_t n = 0;
    ASSERT_OK(reqstore_recover(rs, &list, &n));
    ASSERT_EQ((uint64_t)3, reqstore_groups_recreated(rs));
    ASSERT_EQ((size_t)1, n);
    ASSERT_STREQ("after", list[0].id);
    reqrec_free(&list[0]);
    free(list);
    /* reqstore_check notices an empty Redis by itself, and remakes the stream. */
    ASSERT_EQ(1, reqstore_check(rs));
    fixture_redis_restart(&f);
    ASSERT_EQ(1, reqstore_check(rs));
    ASSERT_OK(rconn_xlen(reqstore_conn(rs), "t:requests", &len));
    ASSERT_EQ((int64_t)0, len);
    ASSERT_EQ(0, (int)t_pending(rs, "r1"));
    /* Redis gone: a status naming it. */
    fixture_redis_kill(&f);
    ASSERT_EQ(STATUS_UNAVAILABLE, reqstore_check(rs));
    ASSERT_TRUE(strstr(reqstore_errstr(rs), "127.0.0.1") != NULL);
    fixture_redis_restart(&f);
    reqstore_close(rs);

    /* A wrong password: the error names the server, not the password. */
    char url[200];
    snprintf(url, sizeof url, "redis://:wrong-pw@127.0.0.1:%d", f.port);
    cfg.url = url;
    ASSERT_EQ(STATUS_BAD_INPUT, reqstore_open(&rs, &cfg, err, sizeof err));
    ASSERT_TRUE(strstr(err, "WRONGPASS") != NULL);
    ASSERT_TRUE(strstr(err, "wrong-pw") == NULL);
    ASSERT_OK(fixture_redis_stop(&f));
}

TEST_MAIN(router_requests_tokens_encoding, router_requests_persist_and_reattach,
          router_requests_load_guards_another_routers_request,
          router_requests_finish_acks_and_expires, router_requests_ids_are_per_owner,
          router_requests_recover_after_restart,
          router_requests_recover_drops_broken_entries, router_requests_unavailable_redis,
          router_requests_group_recreated_after_empty_restart)
