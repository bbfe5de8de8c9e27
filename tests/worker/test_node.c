/* Tests of llm-worker as a real process, with the test playing the router
 * (tests/worker/node_fixture.h) and a private Redis: the life of one
 * worker: registration (envelope and registry key), heartbeats, greedy
 * generation against the llama.cpp goldens, copy-on-write block copies, and
 * a SIGTERM that finishes the plans in flight and exits clean; a placement
 * from the router that reloads the stage; refusals to start (memory that
 * does not fit, an unknown device, more stages than layers); and what
 * --spin-us auto chooses.  Every wait is bounded. */
#include "tests/worker/node_fixture.h"

#include "common/rconn.h"
#include "tests/redis_fixture.h"
#include "worker/node.h"

/* Waits for a heartbeat in `state`, or one t_recv has seen since the
 * router socket opened (t_states_seen). */
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

/* The kv_blocks_used of r's next heartbeats until one satisfies want
 * (0: none used, 1: some), within ms; returns the last seen (-1: none). */
static int t_kv_used_until(struct t_router *r, int want, int ms) {
    int64_t end = t_now_ms() + ms;
    int used = -1;
    while (t_now_ms() < end) {
        Llm__WorkerEnvelope *hb = t_recv(r, LLM__WORKER_ENVELOPE__BODY_HEARTBEAT, 500, NULL);
        if (!hb) continue;
        used = (int)hb->heartbeat->kv_blocks_used;
        proto_worker_free(hb);
        if ((used > 0) == want) break;
    }
    return used;
}

/* Two routers can give the same epoch: each counts from its start time in
 * milliseconds, so two started together count alike.  A worker that moves
 * to the second router when the first is gone, and gets the epoch it has,
 * must still forget the first router's sequences (the second plans its own
 * from their start and never frees the others' blocks), as it does for any
 * placement of a new session: the heartbeats' KV count falls to 0. */
TEST(node_same_epoch_from_another_router_is_a_new_placement) {
    struct t_golden g;
    t_golden_load(&g);
    struct t_router a = {0}, b = {0};
    t_router_open(&a);
    t_router_open(&b);
    char routers[300];
    snprintf(routers, sizeof routers, "%s,%s", a.endpoint, b.endpoint);
    struct t_worker w = {0};
    t_worker_start(&w, routers, NULL, "w-two", NULL);
    char ep[256];
    t_expect_register(&a, "w-two", ep, sizeof ep);
    t_reply(&a, "w-two", 7, NULL, NULL);
    struct t_seq s = {1, g.prompt, (size_t)g.n_prompt, 0, 0, 1, 0, 0, 0, 0};
    t_send_plan(&a, "w-two", 1, 7, &s, 1, NULL, 0);
    Llm__WorkerEnvelope *e = t_result(&a, 1, NULL);
    if (!e) TEST_FAIL("no result from the first router's plan");
    ASSERT_TRUE(e->result->error == NULL);
    proto_worker_free(e);
    int used = t_kv_used_until(&a, 1, T_WAIT_MS);
    if (used <= 0) TEST_FAIL("the prompt's KV blocks never showed in a heartbeat (last: %d)", used);
    t_router_close(&a);
    t_expect_register(&b, "w-two", ep, sizeof ep);
    t_reply(&b, "w-two", 7, NULL, NULL);
    used = t_kv_used_until(&b, 0, T_WAIT_MS);
    if (used != 0) {
        t_worker_log_tail(&w);
        TEST_FAIL("after the second router's placement at the same epoch the worker still holds %d KV blocks",
                  used);
    }
    kill(w.pid, SIGTERM);
    int code = t_worker_wait(&w, 10000);
    if (code != 0) t_worker_log_tail(&w);
    t_worker_kill(&w);
    ASSERT_EQ(0, code);
    t_router_close(&b);
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

/* --spin-us: auto (the default) blocks at once on the CPU backend, whose
 * step needs every core, and polls ZIO_SPIN_US_GPU on a GPU; an explicit
 * value is kept.  The worker logs what it chose before it registers. */
TEST(node_spin_auto_blocks_on_the_cpu) {
    ASSERT_EQ(0, node_spin_us(-1, 0));
    ASSERT_EQ(ZIO_SPIN_US_GPU, node_spin_us(-1, 1));
    ASSERT_EQ(0, node_spin_us(0, 1));
    ASSERT_EQ(250, node_spin_us(250, 0));
    struct node_config cfg;
    node_config_default(&cfg);
    ASSERT_EQ(-1, cfg.spin_us);

    int cpu = strcmp(t_device(), "cpu") == 0;
    char want_auto[96];
    snprintf(want_auto, sizeof want_auto, "spin %d us (--spin-us auto on a %s backend)",
             cpu ? 0 : ZIO_SPIN_US_GPU, cpu ? "CPU" : "GPU");
    static const char *const extra[2][3] = {{NULL}, {"--spin-us", "250", NULL}};
    const char *const want[2] = {want_auto, "spin 250 us (--spin-us 250)"};
    static char buf[1 << 16];
    for (int i = 0; i < 2; i++) {
        struct t_router r = {0};
        t_router_open(&r);
        struct t_worker w = {0};
        t_worker_start(&w, r.endpoint, NULL, "w-spin", extra[i]);
        char ep[256];
        t_expect_register(&r, "w-spin", ep, sizeof ep);
        t_worker_kill(&w);
        t_worker_log_read(&w, buf, sizeof buf);
        if (!strstr(buf, want[i])) TEST_FAIL("no \"%s\" in the log: %s", want[i], buf);
        t_router_close(&r);
        unlink(w.log);
    }
}

TEST_MAIN(node_registers_generates_and_stops, node_router_placement_reloads,
          node_same_epoch_from_another_router_is_a_new_placement,
          node_refuses_what_does_not_fit, node_refuses_bad_device_and_stage_count,
          node_spin_auto_blocks_on_the_cpu)
