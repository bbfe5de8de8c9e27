/* Chaos under sampled load (docs/router.md, "Chaos test"): requests at
 * temperature 0.8 with seeds the router chooses run on one pipeline of two
 * CPU stages while a worker is killed with SIGKILL (and replaced), the
 * router is killed with SIGKILL (and started again), and Redis is killed
 * with SIGKILL and started again from its append-only file.  Every request
 * must finish exactly once, and its token stream must equal a clean run: a
 * fresh cluster given the same request with the seed GenerateAccepted
 * returned.  The counts of lost, duplicated and changed tokens are printed
 * and must be 0. */
#include "tests/router/cluster_harness.h"

#define MODEL "stories260K-f32.gguf"
#define N_REQ 300
#define CONC 24
#define MAX_TOKENS 48
#define TEMPERATURE 0.8f

static const char *const prompts[] = {
    "Once upon a time",
    "The little dog",
    "Lily and Tom went to the park",
    "One day, a big bird",
};

/* Fast failure detection: a killed worker is noticed within a second, a
 * step lost with it is given up after 3 s. */
#define ROUTER_ARGS "--heartbeat-ms 200 --worker-timeout-ms 1000 --step-timeout-ms 3000"
/* A stage whose successor died stays in its send to the dead endpoint until
 * the link timeout (30 s by default) before it takes the router's new epoch
 * with the replacement's endpoint; 2 s keeps the test short. */
#define WORKER_ARGS "--link-timeout-ms 2000"

struct chaos_req {
    char id[64];
    const char *prompt;
    uint64_t seed_in;  /* 0: the router chooses */
    /* out */
    int rc;
    char err[300];
    int finish;
    uint64_t seed;
    uint32_t completion_tokens, reattaches;
    int32_t ids[MAX_TOKENS + 8];
    int n, out_of_order, extra;
};

struct chaos_run {
    struct cluster *cl;
    struct chaos_req *reqs;
    int n;
    int next;       /* atomic: the next request to send */
    int finished;   /* atomic: requests returned */
};

static int on_chunk(void *ud, const struct llm_chunk *ch) {
    struct chaos_req *r = ud;
    if ((int)ch->index != r->n) r->out_of_order++;
    for (size_t i = 0; i < ch->n_tokens; i++) {
        if (r->n < MAX_TOKENS + 8) r->ids[r->n] = ch->token_ids[i];
        else r->extra++;
        r->n++;
    }
    return 0;
}

static void *sender(void *arg) {
    struct chaos_run *run = arg;
    llm_client *c = h_client(run->cl, 5000, 10000, 60000);
    for (;;) {
        int i = __atomic_fetch_add(&run->next, 1, __ATOMIC_RELAXED);
        if (i >= run->n) break;
        struct chaos_req *r = &run->reqs[i];
        struct llm_generate_params p;
        llm_generate_params_default(&p);
        p.request_id = r->id;
        p.prompt = r->prompt;
        p.max_tokens = MAX_TOKENS;
        p.sampling.temperature = TEMPERATURE;
        p.sampling.seed = r->seed_in;
        p.sampling.ignore_eos = true;
        p.wait_ms = 120000;
        struct llm_generate_result res;
        r->rc = llm_client_generate(c, &p, on_chunk, r, &res);
        if (r->rc != 0) snprintf(r->err, sizeof r->err, "%s", llm_client_errstr(c));
        r->finish = res.finish_reason;
        r->seed = res.seed;
        r->completion_tokens = res.completion_tokens;
        r->reattaches = res.reattaches;
        llm_generate_result_free(&res);
        __atomic_fetch_add(&run->finished, 1, __ATOMIC_RELAXED);
    }
    llm_client_close(c);
    return NULL;
}

static void run_start(struct chaos_run *run, pthread_t *th) {
    for (int t = 0; t < CONC; t++) pthread_create(&th[t], NULL, sender, run);
}

static void run_join(pthread_t *th) {
    for (int t = 0; t < CONC; t++) pthread_join(th[t], NULL);
}

/* Waits until `count` requests have returned; fails after 60 s. */
static void wait_finished(struct cluster *cl, struct chaos_run *run, int count) {
    int64_t end = h_now_ms() + 60000;
    while (__atomic_load_n(&run->finished, __ATOMIC_RELAXED) < count) {
        H_ASSERT(cl, h_now_ms() < end, "%d of %d requests finished after 60 s",
                 __atomic_load_n(&run->finished, __ATOMIC_RELAXED), count);
        h_sleep_ms(5);
    }
}

TEST(cluster_chaos_sampled_load) {
    const char *model = test_model_path(MODEL);
    int64_t t_start = h_now_ms();
    h_redis_flags = FIXTURE_REDIS_PERSIST;
    struct cluster *cl = h_cluster_start(model, 1, 2, ROUTER_ARGS, WORKER_ARGS);
    h_redis_flags = 0;
    static struct chaos_req reqs[N_REQ], clean[N_REQ];
    for (int i = 0; i < N_REQ; i++) {
        snprintf(reqs[i].id, sizeof reqs[i].id, "chaos-%03d", i);
        reqs[i].prompt = prompts[i % 4];
    }
    struct chaos_run run = {cl, reqs, N_REQ, 0, 0};
    pthread_t th[CONC];
    run_start(&run, th);

    wait_finished(cl, &run, N_REQ * 15 / 100);
    int slot = h_worker_slot(cl, 0, 1);
    H_ASSERT(cl, slot >= 0, "no worker for pipeline 0 stage 1");
    h_proc_kill(&cl->workers[slot], SIGKILL);
    printf("  %.1f s: kill -9 worker of stage 1 after %d requests\n", (double)(h_now_ms() - t_start) / 1000.0,
           __atomic_load_n(&run.finished, __ATOMIC_RELAXED));
    /* The replacement comes once the router has given the dead worker up
     * (--worker-timeout-ms): before that the slot is held, and llm-worker
     * exits when its registration is refused. */
    h_sleep_ms(1500);
    h_start_worker(cl, slot, 0, 1);

    wait_finished(cl, &run, N_REQ * 40 / 100);
    h_proc_kill(&cl->router, SIGKILL);
    printf("  %.1f s: kill -9 router after %d requests\n", (double)(h_now_ms() - t_start) / 1000.0,
           __atomic_load_n(&run.finished, __ATOMIC_RELAXED));
    h_sleep_ms(300);
    h_start_router(cl);

    wait_finished(cl, &run, N_REQ * 65 / 100);
    fixture_redis_kill(&cl->redis);
    printf("  %.1f s: kill -9 Redis after %d requests; restarted from its append-only file\n",
           (double)(h_now_ms() - t_start) / 1000.0, __atomic_load_n(&run.finished, __ATOMIC_RELAXED));
    h_sleep_ms(300);
    fixture_redis_restart(&cl->redis);

    run_join(th);
    int64_t t_chaos = h_now_ms() - t_start;
    int lost = 0, duplicated = 0, reattached = 0;
    for (int i = 0; i < N_REQ; i++) {
        struct chaos_req *r = &reqs[i];
        H_ASSERT(cl, r->rc == 0, "request %s: status %d: %s", r->id, r->rc, r->err);
        H_ASSERT(cl, r->finish == LLM__GENERATE_DONE__FINISH_REASON__LENGTH, "request %s: finish %s", r->id,
                 llm_finish_reason_name(r->finish));
        H_ASSERT(cl, r->seed != 0, "request %s: no seed in its GenerateAccepted", r->id);
        if (r->n < MAX_TOKENS) lost += MAX_TOKENS - r->n;
        if (r->n > MAX_TOKENS) duplicated += r->n - MAX_TOKENS;
        duplicated += r->out_of_order;
        H_ASSERT(cl, (int)r->completion_tokens == r->n, "request %s: the router counts %u tokens, the client got %d",
                 r->id, r->completion_tokens, r->n);
        reattached += r->reattaches > 0;
    }
    h_cluster_stop(cl);

    /* The clean run: a fresh cluster, every request again with its seed. */
    cl = h_cluster_start(model, 1, 2, ROUTER_ARGS, WORKER_ARGS);
    for (int i = 0; i < N_REQ; i++) {
        snprintf(clean[i].id, sizeof clean[i].id, "clean-%03d", i);
        clean[i].prompt = reqs[i].prompt;
        clean[i].seed_in = reqs[i].seed;
    }
    struct chaos_run crun = {cl, clean, N_REQ, 0, 0};
    run_start(&crun, th);
    run_join(th);
    int changed = 0, changed_reqs = 0;
    for (int i = 0; i < N_REQ; i++) {
        struct chaos_req *r = &reqs[i], *c = &clean[i];
        H_ASSERT(cl, c->rc == 0 && c->n == MAX_TOKENS, "clean request %s: status %d, %d tokens: %s", c->id, c->rc,
                 c->n, c->err);
        H_ASSERT(cl, c->seed == r->seed, "clean request %s ran with seed %llu, not %llu", c->id,
                 (unsigned long long)c->seed, (unsigned long long)r->seed);
        int diff = 0;
        for (int k = 0; k < MAX_TOKENS && k < r->n; k++) diff += r->ids[k] != c->ids[k];
        if (diff) {
            if (changed_reqs < 5) {
                int k = 0;
                while (r->ids[k] == c->ids[k]) k++;
                printf("  request %s (seed %llu, %u re-attaches): token %d is %d, the clean run has %d\n", r->id,
                       (unsigned long long)r->seed, r->reattaches, k, r->ids[k], c->ids[k]);
            }
            changed += diff;
            changed_reqs++;
        }
    }
    printf("  %d requests (%d tokens each, temperature %.1f, router-chosen seeds, %d at once), %d re-attached: "
           "%d lost, %d duplicated, %d changed tokens (%d requests); chaos run %.1f s, total %.1f s\n",
           N_REQ, MAX_TOKENS, (double)TEMPERATURE, CONC, reattached, lost, duplicated, changed, changed_reqs,
           (double)t_chaos / 1000.0, (double)(h_now_ms() - t_start) / 1000.0);
    H_ASSERT(cl, lost == 0 && duplicated == 0 && changed == 0, "%d lost, %d duplicated, %d changed tokens", lost,
             duplicated, changed);
    h_cluster_stop(cl);
}

TEST_MAIN(cluster_chaos_sampled_load)
