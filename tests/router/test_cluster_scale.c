/* llm-cluster scale on a cluster that serves without pause: `up` starts one
 * pipeline of two stages, clients keep requests in flight all along,
 * `scale --pipelines 3` adds two pipelines (which take requests once
 * formed) and `scale --pipelines 1` drains them away again.  Every request
 * completes exactly once (greedy ones equal llm-run's, seeded ones the same
 * seeds on the cluster before the scaling), the router's Status,
 * llm_pipelines_in_service, llm-cluster status and the Prometheus targets
 * follow each change, the removed workers' keys are gone, and the stages
 * that stay hold no KV block at the end.  Also: the router's SIGHUP reload
 * of its key lists, which scale relies on, and what scale refuses. */
#include "tests/router/cluster_harness.h"

#include <dirent.h>
#include <sys/file.h>

#define MODEL "stories260K-f32.gguf"
#define CLUSTER_BIN LLM_BINARY_DIR "/router/llm-cluster"

static const char *const prompts[] = {
    "Once upon a time",
    "The little dog",
    "Lily and Tom went to the park",
    "One day, a big bird",
};
#define N_PROMPTS 4
#define N_TOKENS 100
#define N_SEEDS 2
#define N_CLIENTS 4
#define GENS_MAX 600

static char run_base[256], run_dir[300];
static int keep_run_dir;

static void sc_atexit(void) {
    if (!run_base[0]) return;
    char cmd[1024];
    snprintf(cmd, sizeof cmd, "%s down --run-dir '%s' >/dev/null 2>&1", CLUSTER_BIN, run_dir);
    if (system(cmd) != 0) fprintf(stderr, "llm-cluster down --run-dir %s failed\n", run_dir);
    if (keep_run_dir) {
        fprintf(stderr, "  the run dir (logs) is kept: %s\n", run_dir);
        return;
    }
    snprintf(cmd, sizeof cmd, "rm -rf '%s'", run_base);
    if (system(cmd) != 0) fprintf(stderr, "rm -rf %s failed\n", run_base);
}

/* Runs argv, bounded to 180 s; stdout and stderr together into *out
 * (malloc'ed).  Returns the exit status. */
static int sc_run(const char *const *argv, char **out) {
    char path[] = "/tmp/scale-outXXXXXX";
    int fd = mkstemp(path);
    if (fd < 0) TEST_FAIL("mkstemp: %s", strerror(errno));
    unlink(path);
    fflush(stdout);
    pid_t pid = fork();
    if (pid == 0) {
        dup2(fd, 1);
        dup2(fd, 2);
        alarm(180);
        execv(argv[0], (char *const *)argv);
        _exit(127);
    }
    int st;
    waitpid(pid, &st, 0);
    off_t n = lseek(fd, 0, SEEK_END);
    lseek(fd, 0, SEEK_SET);
    *out = calloc(1, (size_t)n + 1);
    ssize_t got = read(fd, *out, (size_t)n);
    (*out)[got > 0 ? got : 0] = 0;
    close(fd);
    return WIFEXITED(st) ? WEXITSTATUS(st) : 128 + WTERMSIG(st);
}

/* What a scale-in printed. */
struct sc_in {
    double stop_s;   /* its workers stopped this long after their SIGTERM ("stopped after S s") */
    int finished;    /* sequences that finished on the drained pipelines ("the N sequences ... finished there") */
};

/* llm-cluster scale --pipelines n (and --drain-timeout-s drain_s when not
 * NULL): exit status 0 and "n/n pipelines ready" in what it printed; a
 * scale-in's figures into *in when not NULL. */
static void sc_scale(struct cluster *cl, int n, const char *drain_s, struct sc_in *in) {
    char ns[16], *out;
    snprintf(ns, sizeof ns, "%d", n);
    const char *argv[] = {CLUSTER_BIN, "scale", "--pipelines", ns, "--run-dir", run_dir, "--timeout-s", "150",
                          drain_s ? "--drain-timeout-s" : NULL, drain_s, NULL};
    int64_t t0 = h_now_ms();
    int rc = sc_run(argv, &out);
    char want[64];
    snprintf(want, sizeof want, "%d/%d pipelines ready", n, n);
    printf("  llm-cluster scale --pipelines %d (%lld ms, status %d):\n%s", n, (long long)(h_now_ms() - t0), rc, out);
    int ok = rc == 0 && strstr(out, want) != NULL;
    const char *at = strstr(out, "stopped after ");
    const char *fin = strstr(out, "sequences they ran finished there");
    if (in) {
        in->stop_s = at ? strtod(at + 14, NULL) : -1;
        in->finished = 0;
        /* "...; the N sequences they ran finished there" */
        while (fin && fin > out && fin[-1] == ' ') fin--;
        while (fin && fin > out && fin[-1] >= '0' && fin[-1] <= '9') fin--;
        if (fin) in->finished = atoi(fin);
    }
    free(out);
    H_ASSERT(cl, ok, "llm-cluster scale --pipelines %d: status %d, or no \"%s\"", n, rc, want);
}

/* llm-cluster status shows "n/n pipelines ready". */
static void sc_cluster_status(struct cluster *cl, int n) {
    char *out, want[64];
    const char *argv[] = {CLUSTER_BIN, "status", "--run-dir", run_dir, NULL};
    int rc = sc_run(argv, &out);
    snprintf(want, sizeof want, "%d/%d pipelines ready", n, n);
    int ok = rc == 0 && strstr(out, want) != NULL;
    if (!ok) printf("  llm-cluster status (%d):\n%s", rc, out);
    free(out);
    H_ASSERT(cl, ok, "llm-cluster status: no \"%s\"", want);
}

/* Whether pid runs (a zombie does not: up's processes are reparented, and
 * whoever reaps them may take its time). */
static bool sc_alive(pid_t pid) {
    char path[64], state = 0;
    snprintf(path, sizeof path, "/proc/%d/stat", (int)pid);
    FILE *f = fopen(path, "r");
    if (!f) return false;
    int r = fscanf(f, "%*d %*s %c", &state);
    fclose(f);
    return r == 1 && state != 'Z';
}

/* The metrics port prometheus-targets.json gives the process name, or -1. */
static int sc_target_port(const char *name) {
    char path[400], needle[96];
    snprintf(path, sizeof path, "%s/prometheus-targets.json", run_dir);
    snprintf(needle, sizeof needle, "\"process\": \"%s\"", name);
    char *text = test_read_file(path, NULL);
    int port = -1;
    for (char *line = text ? strtok(text, "\n") : NULL; line; line = strtok(NULL, "\n")) {
        const char *at = strstr(line, "127.0.0.1:");
        if (strstr(line, needle) && at) port = atoi(at + 10);
    }
    free(text);
    return port;
}

/* Waits (bounded) until the router's llm_pipelines_in_service is n. */
static void sc_wait_metric(struct cluster *cl, int n) {
    int port = sc_target_port("router");
    H_ASSERT(cl, port > 0, "prometheus-targets.json names no router");
    static char body[1 << 20];
    double v = -1;
    for (int64_t end = h_now_ms() + 20000; h_now_ms() < end; h_sleep_ms(100)) {
        if (h_http_get(port, "/metrics", body, sizeof body) == 200 &&
            (v = h_sample(body, "llm_pipelines_in_service")) == n)
            return;
    }
    H_FAIL(cl, "llm_pipelines_in_service is %g, want %d", v, n);
}

/* Pipelines listed in the router's Status and how many are ready. */
static void sc_status_counts(struct cluster *cl, int *listed, int *ready) {
    llm_client *c = h_client(cl, 2000, 5000, 5000);
    Llm__ClientEnvelope *env = NULL;
    H_ASSERT(cl, llm_client_status(c, &env) == 0, "Status: %s", llm_client_errstr(c));
    *listed = (int)env->status_reply->n_pipelines;
    *ready = 0;
    for (size_t i = 0; i < env->status_reply->n_pipelines; i++) *ready += env->status_reply->pipelines[i]->ready;
    proto_client_free(env);
    llm_client_close(c);
}

/* ---- the load: N_CLIENTS clients, each a request after the other --------- */

static struct h_ref refs[N_PROMPTS];
static struct h_gen seeded_before[N_SEEDS];
/* Each request's first and last token (h_now_ms), for the count of those
 * in flight across a scaling. */
struct sc_span {
    int64_t first, last;
};
static struct {
    struct cluster *cl;
    volatile int stop;
    pthread_mutex_t mu;
    struct h_gen *cur[N_CLIENTS]; /* each client's request in progress */
    int n_done, n_seeded, n_bad, reattached;
    long long tokens_done;
    char bad[600];                /* the first request that was wrong, and how */
    struct sc_span *spans;        /* n_done of them */
} load = {.mu = PTHREAD_MUTEX_INITIALIZER};
#define SPANS_MAX 200000

/* One request: greedy (seed 0) or sampled at temperature 0.8 with seed. */
static void sc_generate(struct h_gen *g, uint64_t seed) {
    llm_client *c = h_client(g->cl, 5000, 10000, 60000);
    struct llm_generate_params p;
    llm_generate_params_default(&p);
    p.request_id = g->request_id;
    p.prompt = g->prompt;
    p.max_tokens = (uint32_t)g->max_tokens;
    p.sampling.ignore_eos = true;
    if (seed) {
        p.sampling.temperature = 0.8f;
        p.sampling.seed = seed;
    }
    p.wait_ms = 120000; /* a request that never ends fails the test, not ctest's timeout */
    g->rc = llm_client_generate(c, &p, h_on_chunk, g, &g->res);
    if (g->rc != 0) snprintf(g->err, sizeof g->err, "%s", llm_client_errstr(c));
    llm_client_close(c);
}

static void sc_make(struct h_gen *g, const char *tag, int i, const char *prompt) {
    memset(g, 0, sizeof *g);
    g->cl = load.cl;
    g->prompt = prompt;
    g->max_tokens = N_TOKENS;
    g->ignore_eos = 1;
    snprintf(g->request_id, sizeof g->request_id, "%s-%05d", tag, i);
}

/* A finished request against what it must be: every token exactly once, in
 * order, and llm-run's (greedy) or the same seed's before the scaling.
 * Returns 0, or 1 with why in msg (the client threads cannot fail the test
 * themselves). */
static int sc_wrong(const struct h_gen *g, const int32_t *want, int n_want, const char *want_text, char *msg,
                    size_t size) {
    if (g->rc != 0 || g->res.finish_reason != LLM__GENERATE_DONE__FINISH_REASON__LENGTH) {
        snprintf(msg, size, "request %s: status %d, finish %s: %.200s %.200s", g->request_id, g->rc,
                 llm_finish_reason_name(g->res.finish_reason), g->err, g->res.error_message);
        return 1;
    }
    if (g->out_of_order || g->n != n_want || (int)g->res.completion_tokens != g->n) {
        snprintf(msg, size, "request %s: %d tokens (router counts %u, want %d), %d chunks out of order",
                 g->request_id, g->n, g->res.completion_tokens, n_want, g->out_of_order);
        return 1;
    }
    for (int k = 0; k < n_want; k++)
        if (g->ids[k] != want[k]) {
            snprintf(msg, size, "request %s (\"%s\"): token %d is %d, want %d", g->request_id, g->prompt, k,
                     g->ids[k], want[k]);
            return 1;
        }
    if (want_text && strcmp(g->text, want_text) != 0) {
        snprintf(msg, size, "request %s: text \"%.200s\", llm-run \"%.200s\"", g->request_id, g->text, want_text);
        return 1;
    }
    return 0;
}

/* Every fourth request is seeded (one of N_SEEDS seeds, each with its own
 * prompt), the others greedy; each is checked as it ends. */
static void *sc_client(void *arg) {
    int me = (int)(intptr_t)arg;
    struct h_gen *g = calloc(1, sizeof *g);
    for (int j = 0; !load.stop; j++) {
        int i = j * N_CLIENTS + me, k = (i / 4) % N_SEEDS;
        bool seeded = i % 4 == 3;
        pthread_mutex_lock(&load.mu);
        sc_make(g, "load", i, seeded ? prompts[k] : prompts[i % N_PROMPTS]);
        load.cur[me] = g;
        pthread_mutex_unlock(&load.mu);
        sc_generate(g, seeded ? 1234 + (uint64_t)k : 0);
        char msg[600];
        const int32_t *want = seeded ? seeded_before[k].ids : refs[i % N_PROMPTS].ids;
        int wrong = sc_wrong(g, want, N_TOKENS, seeded ? NULL : refs[i % N_PROMPTS].text, msg, sizeof msg);
        pthread_mutex_lock(&load.mu);
        load.cur[me] = NULL;
        if (wrong && load.n_bad++ == 0) snprintf(load.bad, sizeof load.bad, "%s", msg);
        if (load.n_done < SPANS_MAX) load.spans[load.n_done] = (struct sc_span){g->first_token_ms, g->last_token_ms};
        load.n_done++;
        load.n_seeded += seeded;
        load.reattached += g->res.reattaches > 0;
        load.tokens_done += g->n;
        pthread_mutex_unlock(&load.mu);
        llm_generate_result_free(&g->res);
    }
    free(g);
    return NULL;
}

/* Tokens received so far, the requests in progress' included. */
static long long sc_tokens(void) {
    pthread_mutex_lock(&load.mu);
    long long n = load.tokens_done;
    for (int i = 0; i < N_CLIENTS; i++)
        if (load.cur[i]) n += __atomic_load_n(&load.cur[i]->n, __ATOMIC_RELAXED);
    pthread_mutex_unlock(&load.mu);
    return n;
}

/* Waits (bounded) until `more` tokens past now have arrived. */
static void sc_wait_tokens(struct cluster *cl, int more, const char *when) {
    long long from = sc_tokens();
    int64_t end = h_now_ms() + 60000;
    while (sc_tokens() < from + more) {
        H_ASSERT(cl, h_now_ms() < end, "%s: %lld tokens in 60 s, want %d", when, sc_tokens() - from, more);
        h_sleep_ms(20);
    }
}

/* Requests that streamed tokens while [t0, t1] lasted (a scaling command
 * ran): their first token before t1 and their last after t0. */
static int sc_during(int64_t t0, int64_t t1) {
    int k = 0, n = load.n_done < SPANS_MAX ? load.n_done : SPANS_MAX;
    for (int i = 0; i < n; i++) k += load.spans[i].first && load.spans[i].first <= t1 && load.spans[i].last >= t0;
    return k;
}

/* Sequences the router handed from pipelines taken out of service to the
 * others ("... out of service (...): R running and W waiting sequences
 * re-queued" in its log). */
static int sc_requeued(struct cluster *cl) {
    char *log = test_read_file(cl->router.log, NULL);
    int n = 0;
    for (const char *at = log; at && (at = strstr(at, "out of service (")); at++) {
        const char *colon = strstr(at, "): ");
        int r = 0, w = 0;
        if (colon && sscanf(colon, "): %d running and %d waiting", &r, &w) == 2) n += r + w;
    }
    free(log);
    return n;
}

/* Waits (bounded) until the pipelines listed in `want` have each been seen
 * running a sequence in the router's Status: the new ones take work. */
static void sc_wait_work(struct cluster *cl, const int *want, int n_want) {
    llm_client *c = h_client(cl, 2000, 5000, 5000);
    int seen[8] = {0}, missing = n_want;
    int64_t end = h_now_ms() + 60000;
    while (missing > 0) {
        Llm__ClientEnvelope *env = NULL;
        if (llm_client_status(c, &env) == 0) {
            for (size_t i = 0; i < env->status_reply->n_pipelines; i++) {
                const Llm__PipelineStatus *p = env->status_reply->pipelines[i];
                if (p->pipeline_id < 8 && p->running > 0) seen[p->pipeline_id] = 1;
            }
            proto_client_free(env);
        }
        missing = 0;
        for (int k = 0; k < n_want; k++) missing += !seen[want[k]];
        if (missing > 0 && h_now_ms() > end) {
            llm_client_close(c);
            H_FAIL(cl, "%d of the new pipelines never ran a sequence in 60 s", missing);
        }
        h_sleep_ms(50);
    }
    llm_client_close(c);
}

/* Waits until the router and every stage it lists hold no KV block. */
static void sc_kv_back_to_zero(struct cluster *cl) {
    llm_client *c = h_client(cl, 2000, 5000, 5000);
    int64_t end = h_now_ms() + 20000;
    char what[256] = "";
    for (;;) {
        Llm__ClientEnvelope *env = NULL;
        H_ASSERT(cl, llm_client_status(c, &env) == 0, "Status: %s", llm_client_errstr(c));
        const Llm__StatusReply *r = env->status_reply;
        int held = r->kv_blocks_used != 0, stages = 0;
        snprintf(what, sizeof what, "router: %llu blocks in use", (unsigned long long)r->kv_blocks_used);
        for (size_t i = 0; i < r->n_pipelines; i++)
            for (size_t k = 0; k < r->pipelines[i]->n_stages; k++) {
                const Llm__StageStatus *st = r->pipelines[i]->stages[k];
                stages++;
                if (st->kv_blocks_used == 0) continue;
                held++;
                size_t l = strlen(what);
                snprintf(what + l, sizeof what - l, "; pipeline %u stage %u: %u", r->pipelines[i]->pipeline_id,
                         st->stage_index, st->kv_blocks_used);
            }
        proto_client_free(env);
        if (!held && stages == 2) break;
        if (h_now_ms() > end) {
            llm_client_close(c);
            H_FAIL(cl, "KV blocks still held 20 s after the load ended (%d stages listed): %s", stages, what);
        }
        h_sleep_ms(100);
    }
    llm_client_close(c);
}

/* The worker key files of the run dir, "p0-s0 p0-s1 ..." into out. */
static void sc_worker_keys(char *out, size_t size) {
    char path[400];
    snprintf(path, sizeof path, "%s/keys/workers", run_dir);
    out[0] = 0;
    DIR *d = opendir(path);
    for (struct dirent *e; d && (e = readdir(d));) {
        size_t l = strlen(e->d_name), n = strlen(out);
        if (l > 4 && strcmp(e->d_name + l - 4, ".pub") == 0)
            snprintf(out + n, size - n, "%s%.*s", n ? " " : "", (int)(l - 4), e->d_name);
    }
    if (d) closedir(d);
}

TEST(cluster_scale_1_3_1_under_load) {
    const char *model = test_model_path(MODEL);
    for (int p = 0; p < N_PROMPTS; p++) h_reference(model, prompts[p], N_TOKENS, 0, &refs[p]);
    static int registered;
    if (!registered) {
        atexit(sc_atexit);
        registered = 1;
    }
    snprintf(run_base, sizeof run_base, "/tmp/llm-cluster-scale-XXXXXX");
    if (!mkdtemp(run_base)) TEST_FAIL("mkdtemp: %s", strerror(errno));
    snprintf(run_dir, sizeof run_dir, "%s/run", run_base);
    keep_run_dir = 1; /* until the end: a failure keeps the logs */

    /* Two sequences a pipeline at once: the clients' four requests queue
     * on one pipeline and spread over three. */
    const char *up[] = {CLUSTER_BIN, "up", "--model", model, "--port", "0", "--run-dir", run_dir, "--stages", "2",
                        "--pipelines", "1", "--threads", "1", "--timeout-s", "120", "--router-args",
                        "--max-batch 2", NULL};
    char *out;
    int rc = sc_run(up, &out);
    if (rc != 0 && strstr(out, "redis-server not found")) {
        free(out);
        TEST_SKIP("redis-server is not installed");
    }
    if (rc != 0) printf("  llm-cluster up (%d):\n%s", rc, out);
    ASSERT_EQ(0, rc);

    /* The test's clients use the run dir's client key, as env.sh's do. */
    struct cluster *cl = calloc(1, sizeof *cl);
    ASSERT_TRUE(cl != NULL);
    const char *r = strstr(out, "router: ");
    ASSERT_TRUE(r != NULL);
    sscanf(r + 8, "%63s", cl->client_ep);
    free(out);
    cl->n_routers = 1;
    cl->stages = 2;
    cl->zctx = zmq_ctx_new();
    zmq_ctx_set(cl->zctx, ZMQ_MAX_SOCKETS, 8192);
    snprintf(cl->dir, sizeof cl->dir, "%.200s", run_dir);
    snprintf(cl->router.name, sizeof cl->router.name, "router");
    snprintf(cl->router.log, sizeof cl->router.log, "%s/router.log", run_dir);
    for (int p = 0; p < 3; p++)
        for (int s = 0; s < 2; s++) {
            struct h_proc *w = &cl->workers[cl->n_workers++];
            char name[32];
            snprintf(name, sizeof name, "worker-p%d-s%d", p, s);
            snprintf(w->name, sizeof w->name, "%s", name);
            snprintf(w->log, sizeof w->log, "%.280s/%.20s.log", run_dir, name);
        }
    char path[400];
    snprintf(path, sizeof path, "%s/keys/clients/client.key", run_dir);
    setenv("LLM_CURVE_KEY_FILE", path, 1);
    snprintf(path, sizeof path, "%s/keys/router.pub", run_dir);
    setenv("LLM_ROUTER_KEY", path, 1);
    unsetenv("LLM_INSECURE");
    load.cl = cl;

    /* The seeded samples on the cluster before any scaling, one at a time. */
    for (int k = 0; k < N_SEEDS; k++) {
        sc_make(&seeded_before[k], "before", k, prompts[k]);
        sc_generate(&seeded_before[k], 1234 + (uint64_t)k);
        H_ASSERT(cl, seeded_before[k].rc == 0 && seeded_before[k].n == N_TOKENS, "seeded request %d: status %d, %d "
                 "tokens: %s", k, seeded_before[k].rc, seeded_before[k].n, seeded_before[k].err);
    }

    load.spans = calloc(SPANS_MAX, sizeof *load.spans);
    ASSERT_TRUE(load.spans != NULL);
    pthread_t th[N_CLIENTS];
    for (int i = 0; i < N_CLIENTS; i++) pthread_create(&th[i], NULL, sc_client, (void *)(intptr_t)i);
    sc_wait_tokens(cl, 100, "before scaling out");

    /* 1 -> 3: pipelines 1 and 2 join and take requests. */
    int64_t t_out = h_now_ms();
    sc_scale(cl, 3, NULL, NULL);
    int64_t t_out_end = h_now_ms();
    int listed, ready;
    sc_status_counts(cl, &listed, &ready);
    H_ASSERT(cl, listed == 3 && ready == 3, "Status after scaling out: %d pipelines, %d ready; want 3 and 3", listed,
             ready);
    sc_wait_metric(cl, 3);
    sc_cluster_status(cl, 3);
    H_ASSERT(cl, sc_target_port("worker-p2-s1") > 0, "prometheus-targets.json lacks worker-p2-s1");
    sc_wait_tokens(cl, 200, "on three pipelines");
    /* Just before each scale-in: the pipelines that go run sequences
     * (requests of 100 tokens last longer than the moment until the drain
     * begins). */
    static const int added[] = {1, 2};
    sc_wait_work(cl, added, 2);

    /* 3 -> 2 with --drain-timeout-s 0: pipeline 2's sequences move to the
     * others at once (the workers' DRAINING, as a SIGTERM by hand). */
    int64_t t_in = h_now_ms();
    struct sc_in in2, in1;
    sc_scale(cl, 2, "0", &in2);
    int moved = sc_requeued(cl);
    /* Every stage runs the plans the router sent before it saw DRAINING,
     * so none waits for hidden states its predecessor dropped: the workers
     * stop after about a heartbeat interval, not the 30 s link timeout. */
    H_ASSERT(cl, in2.stop_s >= 0 && in2.stop_s < 25, "the drained workers stopped after %.1f s (a stage waited out "
             "the link timeout?)", in2.stop_s);
    /* How many moved is not asserted: a sequence seen running just before
     * may still end in the moment until the SIGTERM; the count is printed.
     * (test_cluster_faults and test_cluster_net drain running sequences by
     * SIGTERM too.) */
    sc_status_counts(cl, &listed, &ready);
    H_ASSERT(cl, listed == 2 && ready == 2, "Status after 3 -> 2: %d pipelines, %d ready; want 2 and 2", listed, ready);
    sc_wait_metric(cl, 2);
    sc_wait_tokens(cl, 100, "on two pipelines");
    sc_wait_work(cl, added, 1);

    /* 2 -> 1 with the router's drain: pipeline 1 takes no new request and
     * its sequences finish there; then its workers stop with nothing to
     * hand over. */
    sc_scale(cl, 1, NULL, &in1);
    int64_t t_in_end = h_now_ms();
    /* Whatever ran there finished there (the count is printed, not
     * asserted, for the same reason as above): none was handed over. */
    H_ASSERT(cl, sc_requeued(cl) == moved, "pipeline 1 handed %d sequences over after the router's drain",
             sc_requeued(cl) - moved);
    H_ASSERT(cl, in1.stop_s >= 0 && in1.stop_s < 25, "pipeline 1's workers stopped after %.1f s", in1.stop_s);
    sc_status_counts(cl, &listed, &ready);
    H_ASSERT(cl, listed == 1 && ready == 1, "Status after scaling in: %d pipelines, %d ready; want 1 and 1", listed,
             ready);
    sc_wait_metric(cl, 1);
    sc_cluster_status(cl, 1);
    H_ASSERT(cl, sc_target_port("worker-p1-s0") < 0 && sc_target_port("worker-p0-s1") > 0,
             "prometheus-targets.json still lists worker-p1-s0, or lost worker-p0-s1");
    char keys[256];
    sc_worker_keys(keys, sizeof keys);
    H_ASSERT(cl, strcmp(keys, "worker-p0-s0 worker-p0-s1") == 0 || strcmp(keys, "worker-p0-s1 worker-p0-s0") == 0,
             "worker keys after scaling in: %s", keys);
    sc_wait_tokens(cl, 100, "back on one pipeline");

    load.stop = 1;
    for (int i = 0; i < N_CLIENTS; i++) pthread_join(th[i], NULL);
    int during_out = sc_during(t_out, t_out_end), during_in = sc_during(t_in, t_in_end);
    printf("  MEASURED %d requests (%d seeded, %d re-attached), %lld tokens, %d wrong; %d streamed during the "
           "scale-out, %d during the scale-ins; 3 -> 2 (no drain time): %d sequences moved, workers stopped after "
           "%.1f s; 2 -> 1 (the router's drain): %d sequences finished in place, none moved, workers stopped after "
           "%.1f s\n", load.n_done, load.n_seeded, load.reattached, load.tokens_done, load.n_bad, during_out,
           during_in, moved, in2.stop_s, in1.finished, in1.stop_s);
    H_ASSERT(cl, load.n_bad == 0, "%d of %d requests wrong; the first: %s", load.n_bad, load.n_done, load.bad);
    H_ASSERT(cl, during_out > 0 && during_in > 0, "no request streamed during a scaling (%d out, %d in)", during_out,
             during_in);
    for (int k = 0; k < N_SEEDS; k++) llm_generate_result_free(&seeded_before[k].res);
    free(load.spans);
    sc_kv_back_to_zero(cl);

    /* down stops what up and both scales left running: the processes of
     * the pid files, none of the drained workers among them. */
    pid_t pids[16];
    int n_pids = 0;
    DIR *d = opendir(run_dir);
    for (struct dirent *e; d && (e = readdir(d)) && n_pids < 16;) {
        size_t l = strlen(e->d_name);
        if (l < 5 || strcmp(e->d_name + l - 4, ".pid") != 0) continue;
        H_ASSERT(cl, strncmp(e->d_name, "worker-p1", 9) != 0 && strncmp(e->d_name, "worker-p2", 9) != 0,
                 "a drained worker's pid file is left: %s", e->d_name);
        snprintf(path, sizeof path, "%s/%s", run_dir, e->d_name);
        char *text = test_read_file(path, NULL);
        if (text && atoi(text) > 1) pids[n_pids++] = atoi(text);
        free(text);
    }
    if (d) closedir(d);
    H_ASSERT(cl, n_pids == 4, "%d pid files after scaling in, want 4 (redis, router, 2 workers)", n_pids);
    const char *down[] = {CLUSTER_BIN, "down", "--run-dir", run_dir, NULL};
    rc = sc_run(down, &out);
    free(out);
    ASSERT_EQ(0, rc);
    for (int i = 0; i < n_pids; i++) {
        int64_t end = h_now_ms() + 15000;
        while (sc_alive(pids[i]) && h_now_ms() < end) h_sleep_ms(20);
        H_ASSERT(cl, !sc_alive(pids[i]), "pid %d still runs after llm-cluster down", (int)pids[i]);
    }
    zmq_ctx_term(cl->zctx);
    free(cl);
    keep_run_dir = 0;
}

/* Health through a client with keys/clients/NAME.key: 1 answered, 0 not
 * (a refused key gets no answer at all). */
static int sc_health_as(struct cluster *cl, const char *name) {
    char key[400], router[400];
    snprintf(key, sizeof key, "%s/clients/%s.key", cl->keys, name);
    snprintf(router, sizeof router, "%s/router.pub", cl->keys);
    const char *eps[1] = {cl->client_ep};
    struct llm_client_config cfg;
    llm_client_config_default(&cfg);
    cfg.endpoints = eps;
    cfg.n_endpoints = 1;
    cfg.zmq_ctx = cl->zctx;
    cfg.curve_key_file = key;
    cfg.router_key_file = router;
    cfg.reply_timeout_ms = 1500;
    cfg.retry_ms = 1500;
    llm_client *c = NULL;
    char err[256];
    if (llm_client_open(&c, &cfg, err, sizeof err) != 0) H_FAIL(cl, "llm_client_open: %s", err);
    Llm__ClientEnvelope *env = NULL;
    int ok = llm_client_health(c, &env) == 0;
    if (env) proto_client_free(env);
    llm_client_close(c);
    return ok;
}

/* Waits (bounded) until the router's log holds `want` lines with text. */
static void sc_wait_log(struct cluster *cl, const char *text, int want) {
    int got = 0;
    for (int64_t end = h_now_ms() + 10000; h_now_ms() < end; h_sleep_ms(20)) {
        char *log = test_read_file(cl->router.log, NULL);
        got = 0;
        for (const char *at = log; at && (at = strstr(at, text)); at++) got++;
        free(log);
        if (got >= want) return;
    }
    H_FAIL(cl, "%d lines \"%s\" in the router's log after 10 s, want %d", got, text, want);
}

/* SIGHUP makes the router reread its allowlists: a client key added to
 * --client-keys is admitted after it, a list that no longer loads keeps
 * the keys read before (and says why), and a key removed is refused at the
 * next handshake. */
TEST(router_sighup_rereads_keys) {
    struct cluster *cl = h_cluster_start(test_model_path(MODEL), 1, 1, "", "");
    char err[512], sub[400], path[460];
    struct keys_pair kp;
    snprintf(sub, sizeof sub, "%s/clients", cl->keys);
    H_ASSERT(cl,
             keys_pair_generate(&kp, err, sizeof err) == 0 && keys_pair_write(sub, "late", &kp, err, sizeof err) == 0,
             "late key: %s", err);
    H_ASSERT(cl, sc_health_as(cl, "client") == 1, "the client key set at start is not admitted");
    H_ASSERT(cl, sc_health_as(cl, "late") == 0, "a key added after the start is admitted without SIGHUP");
    kill(cl->router.pid, SIGHUP);
    sc_wait_log(cl, "router: 2 client keys", 1);
    H_ASSERT(cl, sc_health_as(cl, "late") == 1, "the added key is not admitted after SIGHUP");
    /* A broken list: the router says which line and keeps the old keys. */
    snprintf(path, sizeof path, "%s/broken.pub", sub);
    FILE *f = fopen(path, "w");
    H_ASSERT(cl, f != NULL, "%s: %s", path, strerror(errno));
    fputs("not-a-key\n", f);
    fclose(f);
    kill(cl->router.pid, SIGHUP);
    sc_wait_log(cl, "the ones read before stay admitted", 1);
    H_ASSERT(cl, sc_health_as(cl, "late") == 1, "a list that failed to load dropped the keys read before");
    /* Removed: refused from the next handshake on. */
    unlink(path);
    snprintf(path, sizeof path, "%s/late.pub", sub);
    unlink(path);
    kill(cl->router.pid, SIGHUP);
    sc_wait_log(cl, "router: 1 client keys", 2); /* the start's, then the reload's */
    H_ASSERT(cl, sc_health_as(cl, "late") == 0, "a key removed is still admitted after SIGHUP");
    H_ASSERT(cl, sc_health_as(cl, "client") == 1, "the client key is refused after the reload");
    h_cluster_stop(cl);
}

/* A client with the key pair in key_file (NULL: the environment's, the
 * cluster's client key). */
static llm_client *sc_client_as(struct cluster *cl, const char *key_file) {
    char router[400];
    snprintf(router, sizeof router, "%s/router.pub", cl->keys);
    const char *eps[1] = {cl->client_ep};
    struct llm_client_config cfg;
    llm_client_config_default(&cfg);
    cfg.endpoints = eps;
    cfg.n_endpoints = 1;
    cfg.zmq_ctx = cl->zctx;
    if (key_file) {
        cfg.curve_key_file = key_file;
        cfg.router_key_file = router;
    }
    cfg.reply_timeout_ms = 3000;
    cfg.retry_ms = 5000;
    llm_client *c = NULL;
    char err[256];
    if (llm_client_open(&c, &cfg, err, sizeof err) != 0) H_FAIL(cl, "llm_client_open: %s", err);
    return c;
}

/* Drain of ids[0..n) (resume as given): the call's status, its error text
 * into err, pipeline 0's reply into *out when it succeeded. */
static int sc_drain(llm_client *c, const uint32_t *ids, size_t n, bool resume, Llm__DrainReply__Pipeline *out,
                    char *err, size_t size) {
    Llm__ClientEnvelope *env = NULL;
    int rc = llm_client_drain(c, ids, n, resume, &env);
    snprintf(err, size, "%s", rc < 0 ? llm_client_errstr(c) : "");
    if (rc == 0 && out && env->drain_reply->n_pipelines > 0) *out = *env->drain_reply->pipelines[0];
    if (env) proto_client_free(env);
    return rc;
}

/* Pipeline 0 in the router's Status: ready and draining. */
static void sc_pipeline0(struct cluster *cl, bool *ready, bool *draining) {
    llm_client *c = h_client(cl, 2000, 5000, 5000);
    Llm__ClientEnvelope *env = NULL;
    H_ASSERT(cl, llm_client_status(c, &env) == 0 && env->status_reply->n_pipelines == 1, "Status: %s",
             llm_client_errstr(c));
    *ready = env->status_reply->pipelines[0]->ready;
    *draining = env->status_reply->pipelines[0]->draining;
    proto_client_free(env);
    llm_client_close(c);
}

/* DrainRequest, the admin message scale sends: only a key of the router's
 * --admin-keys may send it (PERMISSION_DENIED naming the option otherwise,
 * and on a router without the option); an empty list or an unknown
 * pipeline is refused naming it; a drained pipeline is not ready in Status
 * and reports idle when nothing runs; resume puts it back, serving. */
TEST(router_drain_is_for_admins) {
    const char *model = test_model_path(MODEL);
    struct h_ref ref;
    h_reference(model, prompts[0], 20, 0, &ref);
    char admin_dir[] = "/tmp/llm-drain-admin-XXXXXX", err[512], extra[128], key[128];
    if (!mkdtemp(admin_dir)) TEST_FAIL("mkdtemp: %s", strerror(errno));
    struct keys_pair kp;
    if (keys_pair_generate(&kp, err, sizeof err) < 0 || keys_pair_write(admin_dir, "ops", &kp, err, sizeof err) < 0)
        TEST_FAIL("admin key: %s", err);
    snprintf(key, sizeof key, "%s/ops.key", admin_dir);
    snprintf(extra, sizeof extra, "--admin-keys %s", admin_dir);
    struct cluster *cl = h_cluster_start(model, 1, 1, extra, "");
    static const uint32_t zero[] = {0}, seven[] = {7};
    Llm__DrainReply__Pipeline r;
    llm_client *plain = sc_client_as(cl, NULL), *admin = sc_client_as(cl, key);
    H_ASSERT(cl, sc_drain(plain, zero, 1, false, NULL, err, sizeof err) < 0 && strstr(err, "not an admin key") &&
                     strstr(err, "--admin-keys"),
             "a client key's Drain: %s", err);
    printf("  a client key's Drain: %s\n", err);
    H_ASSERT(cl, sc_drain(admin, zero, 0, false, NULL, err, sizeof err) < 0 && strstr(err, "pipeline_ids"),
             "an empty Drain: %s", err);
    H_ASSERT(cl, sc_drain(admin, seven, 1, false, NULL, err, sizeof err) < 0 && strstr(err, "pipeline 7 does not exist"),
             "Drain of pipeline 7: %s", err);
    printf("  Drain of pipeline 7: %s\n", err);
    bool ready, draining;
    sc_pipeline0(cl, &ready, &draining);
    H_ASSERT(cl, ready && !draining, "pipeline 0 before the drain: ready %d, draining %d", ready, draining);
    H_ASSERT(cl, sc_drain(admin, zero, 1, false, &r, err, sizeof err) == 0, "Drain of pipeline 0: %s", err);
    H_ASSERT(cl, r.pipeline_id == 0 && r.draining && r.idle && r.running == 0, "Drain reply: pipeline %u draining "
             "%d idle %d running %u", r.pipeline_id, r.draining, r.idle, r.running);
    sc_pipeline0(cl, &ready, &draining);
    H_ASSERT(cl, !ready && draining, "pipeline 0 drained: ready %d, draining %d", ready, draining);
    /* llm status says so. */
    const char *status[] = {LLM_BINARY_DIR "/clients/c/llm", "--router", cl->client_ep, "status", NULL};
    char *out;
    int rc = sc_run(status, &out);
    bool shown = rc == 0 && strstr(out, "pipeline 0: draining (no new work)") != NULL;
    if (!shown) printf("  llm status (%d):\n%s", rc, out);
    free(out);
    H_ASSERT(cl, shown, "llm status does not show pipeline 0 draining");
    H_ASSERT(cl, sc_drain(admin, zero, 1, true, &r, err, sizeof err) == 0 && !r.draining, "resume: %s", err);
    sc_pipeline0(cl, &ready, &draining);
    H_ASSERT(cl, ready && !draining, "pipeline 0 resumed: ready %d, draining %d", ready, draining);
    llm_client_close(plain);
    llm_client_close(admin);
    struct h_gen g = {0};
    g.cl = cl;
    g.prompt = prompts[0];
    g.max_tokens = 20;
    g.ignore_eos = 1;
    h_generate(&g);
    h_check(cl, &g, &ref);
    llm_generate_result_free(&g.res);
    h_cluster_stop(cl);

    /* A router without --admin-keys takes no admin message. */
    cl = h_cluster_start(model, 1, 1, "", "");
    plain = sc_client_as(cl, NULL);
    H_ASSERT(cl, sc_drain(plain, zero, 1, false, NULL, err, sizeof err) < 0 && strstr(err, "no --admin-keys"),
             "Drain on a router without --admin-keys: %s", err);
    printf("  Drain on a router without --admin-keys: %s\n", err);
    llm_client_close(plain);
    h_cluster_stop(cl);
    char cmd[128];
    snprintf(cmd, sizeof cmd, "rm -rf '%s'", admin_dir);
    ASSERT_EQ(0, system(cmd));
}

/* What scale refuses, each with a message naming the value or the file. */
TEST(cluster_scale_refuses_what_it_cannot_do) {
    char base[] = "/tmp/llm-scale-bad-XXXXXX", conf[128], lock[128], *out;
    if (!mkdtemp(base)) TEST_FAIL("mkdtemp: %s", strerror(errno));
    const char *zero[] = {CLUSTER_BIN, "scale", "--pipelines", "0", "--run-dir", base, NULL};
    ASSERT_EQ(2, sc_run(zero, &out));
    ASSERT_TRUE(strstr(out, "--pipelines") && strstr(out, "0 is out of range"));
    free(out);
    const char *many[] = {CLUSTER_BIN, "scale", "--pipelines", "65", "--run-dir", base, NULL};
    ASSERT_EQ(2, sc_run(many, &out));
    ASSERT_TRUE(strstr(out, "65 is out of range") != NULL);
    free(out);
    const char *none[] = {CLUSTER_BIN, "scale", "--run-dir", base, NULL};
    ASSERT_EQ(2, sc_run(none, &out));
    ASSERT_TRUE(strstr(out, "need --pipelines N") != NULL);
    free(out);
    /* A run dir up never finished in. */
    const char *two[] = {CLUSTER_BIN, "scale", "--pipelines", "2", "--run-dir", base, NULL};
    ASSERT_EQ(1, sc_run(two, &out));
    ASSERT_TRUE(strstr(out, "cluster.conf") && strstr(out, "No such file"));
    free(out);
    snprintf(conf, sizeof conf, "%s/cluster.conf", base);
    FILE *f = fopen(conf, "w");
    ASSERT_TRUE(f != NULL);
    fputs("model=/m.gguf\nstages=zero\n", f);
    fclose(f);
    ASSERT_EQ(1, sc_run(two, &out));
    printf("  %s", out);
    ASSERT_TRUE(strstr(out, "cluster.conf:2: stages=zero") != NULL);
    free(out);
    f = fopen(conf, "w");
    ASSERT_TRUE(f != NULL);
    fputs("model=/m.gguf\nstages=2\nredis=redis://127.0.0.1:1\nworker_endpoints=tcp://127.0.0.1:1\n", f);
    fclose(f);
    /* Nothing runs from it. */
    ASSERT_EQ(1, sc_run(two, &out));
    printf("  %s", out);
    ASSERT_TRUE(strstr(out, "no router runs from") != NULL);
    free(out);
    /* Another scale holds the run dir. */
    snprintf(lock, sizeof lock, "%s/scale.lock", base);
    int fd = open(lock, O_RDWR | O_CREAT, 0600);
    ASSERT_TRUE(fd >= 0 && flock(fd, LOCK_EX) == 0);
    ASSERT_EQ(1, sc_run(two, &out));
    printf("  %s", out);
    ASSERT_TRUE(strstr(out, "another llm-cluster scale is running") != NULL);
    free(out);
    close(fd);
    char cmd[256];
    snprintf(cmd, sizeof cmd, "rm -rf '%s'", base);
    ASSERT_EQ(0, system(cmd));
}

TEST_MAIN(cluster_scale_refuses_what_it_cannot_do, router_sighup_rereads_keys, router_drain_is_for_admins,
          cluster_scale_1_3_1_under_load)
