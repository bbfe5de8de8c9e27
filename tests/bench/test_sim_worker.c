/* bench/sim_worker against a real llm-router: its simulated workers
 * register and form the pipelines they claim, requests run to their
 * max_tokens on them, and its SIGUSR1 figures count what it answered; its
 * command line refuses what it cannot do.  No timing is asserted: speed is
 * bench_router's business, never a test's. */
#include "tests/router/cluster_harness.h"

#define MODEL "stories260K-f32.gguf"
#define SIM_BIN LLM_BINARY_DIR "/bench/sim_worker"

/* Runs sim_worker with argv[1..] and returns its exit status (-1 when it
 * did not exit within 10 s, after killing it). */
static int run_sim(const char *const *args) {
    const char *argv[32] = {SIM_BIN};
    int n = 1;
    for (; args[n - 1] && n < 31; n++) argv[n] = args[n - 1];
    argv[n] = NULL;
    struct h_proc p = {0};
    snprintf(p.name, sizeof p.name, "sim_worker");
    snprintf(p.log, sizeof p.log, "/dev/null");
    h_proc_setargs(&p, argv);
    h_proc_start(NULL, &p);
    for (int i = 0; i < 1000; i++) {
        int st;
        if (h_proc_exited(&p, &st)) return WIFEXITED(st) ? WEXITSTATUS(st) : -1;
        h_sleep_ms(10);
    }
    h_proc_kill(&p, SIGKILL);
    return -1;
}

TEST(sim_worker_refuses_what_it_cannot_do) {
    const char *model = test_model_path(MODEL);
    /* No --insecure: without CURVE keys a process must say it wants plain sockets. */
    ASSERT_EQ(2, run_sim((const char *[]){"--model", model, NULL}));
    ASSERT_EQ(2, run_sim((const char *[]){"--insecure", NULL}));                         /* no model */
    ASSERT_EQ(2, run_sim((const char *[]){"--insecure", "--model", "/nonexistent.gguf", NULL}));
    ASSERT_EQ(2, run_sim((const char *[]){"--insecure", "--model", model, "--stages", "6", NULL})); /* 5 layers */
    ASSERT_EQ(2, run_sim((const char *[]){"--insecure", "--model", model, "--pipelines", "0", NULL}));
    /* --step-ms: two points at least, tokens increasing, times above 0. */
    const char *bad_tables[] = {"1:2", "64:8,1:2", "1:0,64:8", "1:2,64", "x", "1:2;64:8"};
    for (size_t i = 0; i < sizeof bad_tables / sizeof bad_tables[0]; i++)
        ASSERT_EQ(2, run_sim((const char *[]){"--insecure", "--model", model, "--step-ms", bad_tables[i], NULL}));
}

static long stats_num(const char *buf, const char *key) {
    char k[64];
    snprintf(k, sizeof k, "\"%s\":", key);
    const char *p = strstr(buf, k);
    return p ? strtol(p + strlen(k), NULL, 10) : -1;
}

TEST(sim_worker_pipelines_serve_requests) {
    const char *model = test_model_path(MODEL);
    /* Plain sockets for the router, the client library and sim_worker
     * (each reads LLM_INSECURE where it has CURVE keys to leave out). */
    setenv("LLM_INSECURE", "true", 1);
    /* sim_worker runs --insecure below: so does the router. */
    struct cluster *cl = h_cluster_start(model, 0, 2, "--insecure", "");
    char stats[320];
    snprintf(stats, sizeof stats, "%s/sim-stats.json", cl->dir);
    struct h_proc *p = &cl->workers[cl->n_workers++];
    snprintf(p->name, sizeof p->name, "sim_worker");
    snprintf(p->log, sizeof p->log, "%s/sim_worker.log", cl->dir);
    const char *argv[] = {SIM_BIN, "--router", cl->worker_ep, "--model", model, "--pipelines", "2", "--stages", "2",
                          "--first-pipeline", "7", "--stats-file", stats, "--insecure", NULL};
    h_proc_setargs(p, argv);
    h_proc_start(cl, p);
    h_wait_ready(cl, 2, 1, 30000);

    /* The router sees four workers in pipelines 7 and 8, two stages each. */
    llm_client *c = h_client(cl, 2000, 5000, 5000);
    Llm__ClientEnvelope *env = NULL;
    ASSERT_OK(llm_client_status(c, &env));
    const Llm__StatusReply *s = env->status_reply;
    ASSERT_EQ((size_t)2, s->n_pipelines);
    for (size_t i = 0; i < s->n_pipelines; i++) {
        H_ASSERT(cl, s->pipelines[i]->pipeline_id == 7 || s->pipelines[i]->pipeline_id == 8, "pipeline id %u",
                 s->pipelines[i]->pipeline_id);
        ASSERT_EQ((size_t)2, s->pipelines[i]->n_stages);
    }
    ASSERT_EQ((size_t)4, s->n_workers);
    proto_client_free(env);

    /* Requests at once, so that both pipelines take some. */
    enum { N = 6, MAX_TOKENS = 20 };
    struct h_gen gs[N];
    memset(gs, 0, sizeof gs);
    for (int i = 0; i < N; i++) {
        gs[i].cl = cl;
        gs[i].prompt = "Once upon a time";
        gs[i].max_tokens = MAX_TOKENS;
        gs[i].ignore_eos = 1;
        snprintf(gs[i].request_id, sizeof gs[i].request_id, "sim-%d", i);
    }
    h_generate_all(gs, N);
    for (int i = 0; i < N; i++) {
        H_ASSERT(cl, gs[i].rc == 0, "request %d: %s", i, gs[i].err);
        H_ASSERT(cl, gs[i].res.finish_reason == LLM__GENERATE_DONE__FINISH_REASON__LENGTH, "request %d ended %s", i,
                 llm_finish_reason_name(gs[i].res.finish_reason));
        ASSERT_EQ(MAX_TOKENS, gs[i].n);
        ASSERT_EQ(0, gs[i].out_of_order);
        llm_generate_result_free(&gs[i].res);
    }
    ASSERT_OK(llm_client_status(c, &env));
    H_ASSERT(cl, env->status_reply->steps_total >= MAX_TOKENS, "%llu steps for %d tokens per request",
             (unsigned long long)env->status_reply->steps_total, MAX_TOKENS);
    proto_client_free(env);
    llm_client_close(c);

    /* Its figures: every sampled token went out in a result. */
    unlink(stats);
    kill(p->pid, SIGUSR1);
    char buf[2048] = "";
    for (int i = 0; i < 500 && !buf[0]; i++) {
        FILE *f = fopen(stats, "r");
        if (f) {
            size_t n = fread(buf, 1, sizeof buf - 1, f);
            buf[n] = 0;
            fclose(f);
        }
        if (!buf[0]) h_sleep_ms(10);
    }
    H_ASSERT(cl, buf[0], "no %s after SIGUSR1", stats);
    ASSERT_EQ(4L, stats_num(buf, "workers"));
    ASSERT_EQ(4L, stats_num(buf, "registered"));
    H_ASSERT(cl, stats_num(buf, "tokens") >= (long)N * MAX_TOKENS, "stats %s", buf);
    H_ASSERT(cl, stats_num(buf, "results") >= MAX_TOKENS, "stats %s", buf);
    H_ASSERT(cl, stats_num(buf, "plans") >= 2 * stats_num(buf, "results"), "two stages see every plan: %s", buf);
    h_cluster_stop(cl);
}

TEST_MAIN(sim_worker_refuses_what_it_cannot_do, sim_worker_pipelines_serve_requests)
