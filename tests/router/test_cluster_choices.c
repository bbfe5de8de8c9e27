/* Requests of n > 1 choices end to end (docs/protocol.md, "Several
 * choices"): each choice equals a request of n = 1 with the seed
 * proto_choice_seed(seed, i); chunks and ends name their choice; the
 * choices share the prompt's KV blocks by forking them (computed once,
 * held once), with the prefix cache on or off, on 1x1 and 1x2; and a
 * worker or the router killed mid-stream loses and duplicates nothing of
 * any choice. */
#include "tests/router/cluster_harness.h"

#include "proto/request.h"

#define MODEL "stories260K-f32.gguf"
#define N_MAX 8

struct cgen {
    struct cluster *cl;
    char request_id[64];
    const char *prompt;
    uint32_t n;
    uint64_t seed;
    float temperature;
    int max_tokens;
    bool ignore_eos;
    int retry_ms;
    /* out, per choice */
    int rc;
    char err[512];
    struct llm_generate_result res;
    char text[N_MAX][4096];
    int n_tok[N_MAX];
    int out_of_order, bad_choice;
    volatile int seen; /* tokens of every choice */
};

static int cg_on_chunk(void *ud, const struct llm_chunk *ch) {
    struct cgen *g = ud;
    if (ch->choice >= g->n || ch->choice >= N_MAX) {
        g->bad_choice++;
        return 0;
    }
    if ((int)ch->index != g->n_tok[ch->choice]) g->out_of_order++;
    g->n_tok[ch->choice] += (int)ch->n_tokens;
    size_t l = strlen(g->text[ch->choice]);
    snprintf(g->text[ch->choice] + l, sizeof g->text[0] - l, "%s", ch->text);
    __atomic_add_fetch(&g->seen, (int)ch->n_tokens, __ATOMIC_RELAXED);
    return 0;
}

static void cg_run(struct cgen *g) {
    llm_client *c = h_client(g->cl, 5000, 10000, g->retry_ms > 0 ? g->retry_ms : 60000);
    struct llm_generate_params p;
    llm_generate_params_default(&p);
    p.request_id = g->request_id;
    p.prompt = g->prompt;
    p.max_tokens = (uint32_t)g->max_tokens;
    p.sampling.temperature = g->temperature;
    p.sampling.seed = g->seed;
    p.sampling.ignore_eos = g->ignore_eos;
    p.n = g->n;
    p.wait_ms = 90000;
    g->rc = llm_client_generate(c, &p, cg_on_chunk, g, &g->res);
    if (g->rc != 0) snprintf(g->err, sizeof g->err, "%s", llm_client_errstr(c));
    llm_client_close(c);
}

static void *cg_thread(void *arg) {
    cg_run(arg);
    return NULL;
}

static void cg_init(struct cgen *g, struct cluster *cl, const char *id, const char *prompt, uint32_t n,
                    uint64_t seed, int max_tokens, bool ignore_eos) {
    memset(g, 0, sizeof *g);
    g->cl = cl;
    snprintf(g->request_id, sizeof g->request_id, "%s", id);
    g->prompt = prompt;
    g->n = n;
    g->seed = seed;
    g->temperature = 1.0f;
    g->max_tokens = max_tokens;
    g->ignore_eos = ignore_eos;
}

static void cg_ok(struct cluster *cl, const struct cgen *g) {
    H_ASSERT(cl, g->rc == 0, "%s: %s", g->request_id, g->err);
    H_ASSERT(cl, g->out_of_order == 0 && g->bad_choice == 0, "%s: %d chunks out of order, %d of a bad choice",
             g->request_id, g->out_of_order, g->bad_choice);
}

/* Each choice of a sampled n = 4 request equals the request of n = 1 with
 * the choice's seed: its tokens, text and finish. */
TEST(cluster_choices_equal_separate_requests) {
    struct cluster *cl = h_cluster_start(test_model_path(MODEL), 1, 1, "", "");
    static struct cgen all, one[4];
    cg_init(&all, cl, "choices-4", "Once upon a time", 4, 77, 60, false);
    cg_run(&all);
    cg_ok(cl, &all);
    H_ASSERT(cl, all.res.n_choices == 4 && all.res.choices, "n_choices %u", all.res.n_choices);
    ASSERT_EQ((uint64_t)77, all.res.seed);
    pthread_t th[4];
    for (int i = 0; i < 4; i++) {
        char id[32];
        snprintf(id, sizeof id, "choice-alone-%d", i);
        cg_init(&one[i], cl, id, "Once upon a time", 1, proto_choice_seed(77, (uint32_t)i), 60, false);
        pthread_create(&th[i], NULL, cg_thread, &one[i]);
    }
    for (int i = 0; i < 4; i++) pthread_join(th[i], NULL);
    int differ = 0;
    for (int i = 0; i < 4; i++) {
        cg_ok(cl, &one[i]);
        printf("  choice %d: %d tokens, %s: %.60s\n", i, all.n_tok[i],
               llm_finish_reason_name(all.res.choices[i].finish_reason), all.text[i]);
        ASSERT_STREQ(one[i].text[0], all.text[i]);
        ASSERT_EQ(one[i].n_tok[0], all.n_tok[i]);
        ASSERT_EQ((int)one[i].res.finish_reason, (int)all.res.choices[i].finish_reason);
        ASSERT_EQ(one[i].res.completion_tokens, all.res.choices[i].completion_tokens);
        if (i > 0 && strcmp(all.text[i], all.text[0]) != 0) differ++;
        llm_generate_result_free(&one[i].res);
    }
    H_ASSERT(cl, differ > 0, "all four sampled choices are the same text");
    llm_generate_result_free(&all.res);
    /* More than PROTO_N_MAX is refused by name. */
    cg_init(&all, cl, "choices-too-many", "Once upon a time", PROTO_N_MAX + 1, 1, 4, false);
    cg_run(&all);
    H_ASSERT(cl, all.rc != 0 && strstr(all.err, "n = 17"), "rc %d: %s", all.rc, all.err);
    h_cluster_stop(cl);
}

static Llm__ClientEnvelope *status_of(struct cluster *cl, llm_client *c) {
    Llm__ClientEnvelope *env = NULL;
    H_ASSERT(cl, llm_client_status(c, &env) == 0 && env && env->status_reply, "status: %s", llm_client_errstr(c));
    return env;
}

struct poll {
    struct cluster *cl;
    volatile int stop;
    uint64_t max_used, max_shared;
};

static void *poll_thread(void *arg) {
    struct poll *p = arg;
    llm_client *c = h_client(p->cl, 5000, 10000, 10000);
    while (!__atomic_load_n(&p->stop, __ATOMIC_ACQUIRE)) {
        Llm__ClientEnvelope *env = NULL;
        if (llm_client_status(c, &env) == 0 && env && env->status_reply) {
            if (env->status_reply->kv_blocks_used > p->max_used) p->max_used = env->status_reply->kv_blocks_used;
            if (env->status_reply->kv_blocks_shared > p->max_shared)
                p->max_shared = env->status_reply->kv_blocks_shared;
        }
        proto_client_free(env);
        h_sleep_ms(2);
    }
    llm_client_close(c);
    return NULL;
}

/* Waits until the router's pipelines and every stage's own count (its
 * heartbeat) of the pipelines in service hold no KV block: what the
 * choices held came back on every stage. */
static void kv_back_to_zero(struct cluster *cl, llm_client *c) {
    int64_t end = h_now_ms() + 20000;
    char what[256] = "";
    for (;;) {
        Llm__ClientEnvelope *env = status_of(cl, c);
        const Llm__StatusReply *r = env->status_reply;
        int held = 0;
        snprintf(what, sizeof what, "router: %llu blocks in use, %llu shared", (unsigned long long)r->kv_blocks_used,
                 (unsigned long long)r->kv_blocks_shared);
        held += r->kv_blocks_used != 0 || r->kv_blocks_shared != 0;
        for (size_t i = 0; i < r->n_pipelines; i++)
            for (size_t k = 0; r->pipelines[i]->ready && k < r->pipelines[i]->n_stages; k++) {
                const Llm__StageStatus *st = r->pipelines[i]->stages[k];
                if (!st->worker_id || !st->worker_id[0] || !st->ready) continue;
                if (st->kv_blocks_used != 0) {
                    held++;
                    size_t l = strlen(what);
                    snprintf(what + l, sizeof what - l, "; pipeline %u stage %u: %u", r->pipelines[i]->pipeline_id,
                             st->stage_index, st->kv_blocks_used);
                }
            }
        proto_client_free(env);
        if (!held) return;
        H_ASSERT(cl, h_now_ms() < end, "KV blocks still held 20 s after the end: %s", what);
        h_sleep_ms(100);
    }
}

/* n = 4 on a prompt of about 85 tokens (the model's context is 128): the
 * prompt is computed once and its blocks held once.  The first choice
 * computes it; the other three are admitted on a fork of its blocks
 * (copy-on-write), computing only the prompt's last token (their own
 * logits) and their own tokens.  The pipeline's KV blocks in use peak at
 * the shared blocks plus each choice's own, never at four private copies;
 * Status counts the forks and the blocks shared.  This holds with the
 * prefix cache off as well as on (it plays no part).  Each choice equals
 * its request of n = 1, computed on its own; afterwards the KV blocks come
 * back to 0 in the router and on every stage. */
static void choices_fork(int stages, bool no_cache) {
    struct cluster *cl = h_cluster_start(test_model_path(MODEL), 1, stages, no_cache ? "--no-prefix-cache" : "", "");
    static char prompt[4096];
    prompt[0] = 0;
    for (int i = 0; i < 3; i++)
        snprintf(prompt + strlen(prompt), sizeof prompt - strlen(prompt),
                 "Lily saw a big red ball number %d in the park and she ran to it. ", i);
    llm_client *c = h_client(cl, 5000, 10000, 10000);
    Llm__ClientEnvelope *env = status_of(cl, c);
    ASSERT_EQ(!no_cache, (int)env->status_reply->prefix_cache);
    uint64_t hits0 = env->status_reply->prefix_hit_tokens, forks0 = env->status_reply->forks;
    uint64_t ftok0 = env->status_reply->fork_tokens;
    proto_client_free(env);
    struct poll pl = {.cl = cl};
    pthread_t pt;
    pthread_create(&pt, NULL, poll_thread, &pl);
    enum { T = 40 };
    static struct cgen g, one[4];
    cg_init(&g, cl, "choices-shared", prompt, 4, 9, T, true);
    cg_run(&g);
    __atomic_store_n(&pl.stop, 1, __ATOMIC_RELEASE);
    pthread_join(pt, NULL);
    cg_ok(cl, &g);
    int32_t P = (int32_t)g.res.n_prompt_ids, bs = 16;
    for (int i = 0; i < 4; i++) ASSERT_EQ(T, g.n_tok[i]);
    env = status_of(cl, c);
    uint64_t hits = env->status_reply->prefix_hit_tokens - hits0, forks = env->status_reply->forks - forks0;
    uint64_t ftok = env->status_reply->fork_tokens - ftok0;
    proto_client_free(env);
    int32_t shared = (P - 1) / bs;                           /* full blocks before the last prompt token */
    int32_t priv = (P + T + bs - 1) / bs - shared;           /* a choice's own (a partial block's copy included) */
    uint64_t bound = (uint64_t)(shared + 4 * priv);
    uint64_t unshared = (uint64_t)(4 * ((P + T + bs - 1) / bs));
    printf("  1x%d, prefix cache %s: prompt %d tokens: %llu forks of %llu positions, prefix hits %llu tokens; "
           "KV blocks in use at most %llu (bound %llu, four private copies %llu), shared at most %llu\n",
           stages, no_cache ? "off" : "on", P, (unsigned long long)forks, (unsigned long long)ftok,
           (unsigned long long)hits, (unsigned long long)pl.max_used, (unsigned long long)bound,
           (unsigned long long)unshared, (unsigned long long)pl.max_shared);
    ASSERT_EQ((uint64_t)3, forks);
    ASSERT_EQ((uint64_t)(3 * (P - 1)), ftok);
    ASSERT_EQ((uint64_t)0, hits); /* the forks took the prompt, not the cache */
    H_ASSERT(cl, pl.max_used > 0 && pl.max_used <= bound, "KV blocks in use at most %llu, bound %llu",
             (unsigned long long)pl.max_used, (unsigned long long)bound);
    H_ASSERT(cl, pl.max_shared >= (uint64_t)shared, "at most %llu blocks shared, want >= %d",
             (unsigned long long)pl.max_shared, shared);
    /* The same four as requests of n = 1, one after the other (nothing to
     * share): equal, token for token. */
    for (int i = 0; i < 4; i++) {
        char id[32];
        snprintf(id, sizeof id, "shared-alone-%d", i);
        cg_init(&one[i], cl, id, prompt, 1, proto_choice_seed(9, (uint32_t)i), T, true);
        cg_run(&one[i]);
        cg_ok(cl, &one[i]);
        ASSERT_STREQ(one[i].text[0], g.text[i]);
        ASSERT_EQ(one[i].n_tok[0], g.n_tok[i]);
        llm_generate_result_free(&one[i].res);
    }
    kv_back_to_zero(cl, c);
    llm_generate_result_free(&g.res);
    llm_client_close(c);
    h_cluster_stop(cl);
}

TEST(cluster_choices_share_prompt_blocks) { choices_fork(1, false); }
TEST(cluster_choices_fork_without_prefix_cache_1x1) { choices_fork(1, true); }
TEST(cluster_choices_fork_without_prefix_cache_1x2) { choices_fork(2, true); }

/* Two pipelines of 1 or 2 stages, prefix cache off.  The last stage of the
 * pipeline running the three choices of a request is killed mid-stream:
 * they move to the other pipeline, where one recomputes the prompt and its
 * tokens and the others fork its prompt again; every choice ends with
 * exactly the tokens of an uninterrupted run (none lost, none twice), and
 * the KV blocks come back to 0 on every stage left. */
static void choices_fork_worker_killed(int stages) {
    struct cluster *cl = h_cluster_start(test_model_path(MODEL), 2, stages, "--no-prefix-cache", "");
    enum { T = 100 };
    static struct cgen ref, g;
    cg_init(&ref, cl, "fork-ref", "The little dog", 3, 31, T, true);
    cg_run(&ref);
    cg_ok(cl, &ref);
    llm_client *c = h_client(cl, 5000, 10000, 10000);
    Llm__ClientEnvelope *env;
    cg_init(&g, cl, "fork-kill", "The little dog", 3, 31, T, true);
    pthread_t th;
    pthread_create(&th, NULL, cg_thread, &g);
    int64_t end = h_now_ms() + 30000;
    while (__atomic_load_n(&g.seen, __ATOMIC_RELAXED) < 30 && h_now_ms() < end) h_sleep_ms(1);
    /* The pipeline the choices run on, and the other one's forks so far. */
    env = status_of(cl, c);
    int pid = -1;
    uint64_t forks0 = 0;
    for (size_t i = 0; i < env->status_reply->n_pipelines; i++)
        if (env->status_reply->pipelines[i]->running > 0) pid = (int)env->status_reply->pipelines[i]->pipeline_id;
    for (size_t i = 0; i < env->status_reply->n_pipelines; i++)
        if ((int)env->status_reply->pipelines[i]->pipeline_id != pid) forks0 = env->status_reply->pipelines[i]->forks;
    proto_client_free(env);
    int at = __atomic_load_n(&g.seen, __ATOMIC_RELAXED);
    H_ASSERT(cl, pid >= 0, "no pipeline runs the choices (%d tokens out)", at);
    int slot = h_worker_slot(cl, pid, stages - 1);
    H_ASSERT(cl, slot >= 0, "no worker for pipeline %d", pid);
    h_proc_kill(&cl->workers[slot], SIGKILL);
    pthread_join(th, NULL);
    cg_ok(cl, &g);
    env = status_of(cl, c);
    uint64_t forks = 0;
    for (size_t i = 0; i < env->status_reply->n_pipelines; i++)
        if ((int)env->status_reply->pipelines[i]->pipeline_id != pid)
            forks = env->status_reply->pipelines[i]->forks - forks0;
    proto_client_free(env);
    printf("  2x%d: stage %d of pipeline %d killed after %d of %d tokens; forks on the other pipeline since: %llu\n",
           stages, stages - 1, pid, at, 3 * T, (unsigned long long)forks);
    H_ASSERT(cl, at < 3 * T, "all %d tokens were out before the kill", at);
    for (int i = 0; i < 3; i++) {
        ASSERT_EQ(T, g.n_tok[i]);
        ASSERT_STREQ(ref.text[i], g.text[i]);
        ASSERT_EQ((int)LLM__GENERATE_DONE__FINISH_REASON__LENGTH, (int)g.res.choices[i].finish_reason);
    }
    /* On the other pipeline the two choices behind the first forked its
     * prompt again. */
    H_ASSERT(cl, forks >= 2, "%llu forks on the surviving pipeline, want 2", (unsigned long long)forks);
    /* A replacement re-forms the broken pipeline (its other stage forgets
     * what it held then); every stage of both comes back to 0. */
    h_start_worker(cl, slot, pid, stages - 1);
    h_wait_ready(cl, 2, 1, 30000);
    kv_back_to_zero(cl, c);
    llm_generate_result_free(&ref.res);
    llm_generate_result_free(&g.res);
    llm_client_close(c);
    h_cluster_stop(cl);
}

TEST(cluster_choices_fork_worker_killed_2x1) { choices_fork_worker_killed(1); }
TEST(cluster_choices_fork_worker_killed_2x2) { choices_fork_worker_killed(2); }

/* The router is killed while the three choices of a request stream and
 * started again: the client re-attaches by id with each choice's count,
 * and every choice ends with exactly the tokens of an uninterrupted run
 * (none lost, none twice). */
TEST(cluster_choices_survive_router_restart) {
    struct cluster *cl = h_cluster_start(test_model_path(MODEL), 1, 1, "", "");
    enum { T = 100 };
    static struct cgen ref, g;
    cg_init(&ref, cl, "choices-ref", "The little dog", 3, 31, T, true);
    cg_run(&ref);
    cg_ok(cl, &ref);
    cg_init(&g, cl, "choices-kill", "The little dog", 3, 31, T, true);
    pthread_t th;
    pthread_create(&th, NULL, cg_thread, &g);
    int64_t end = h_now_ms() + 30000;
    while (__atomic_load_n(&g.seen, __ATOMIC_RELAXED) < 30 && h_now_ms() < end) h_sleep_ms(1);
    int at = __atomic_load_n(&g.seen, __ATOMIC_RELAXED);
    h_proc_kill(&cl->router, SIGKILL);
    h_sleep_ms(300);
    h_start_router(cl);
    pthread_join(th, NULL);
    cg_ok(cl, &g);
    printf("  router killed after %d of %d tokens; %u re-attaches, %u replayed tokens dropped\n", at, 3 * T,
           g.res.reattaches, g.res.duplicates_dropped);
    H_ASSERT(cl, at < 3 * T, "all %d tokens were out before the kill", at);
    for (int i = 0; i < 3; i++) {
        ASSERT_EQ(T, g.n_tok[i]);
        ASSERT_STREQ(ref.text[i], g.text[i]);
        ASSERT_EQ((int)LLM__GENERATE_DONE__FINISH_REASON__LENGTH, (int)g.res.choices[i].finish_reason);
    }
    /* Re-attaching after the end gets every choice whole again. */
    static struct cgen again;
    cg_init(&again, cl, "choices-kill", "The little dog", 3, 31, T, true);
    cg_run(&again);
    cg_ok(cl, &again);
    H_ASSERT(cl, again.res.reattached, "not a re-attach");
    for (int i = 0; i < 3; i++) ASSERT_STREQ(ref.text[i], again.text[i]);
    llm_generate_result_free(&ref.res);
    llm_generate_result_free(&g.res);
    llm_generate_result_free(&again.res);
    h_cluster_stop(cl);
}

TEST_MAIN(cluster_choices_equal_separate_requests, cluster_choices_share_prompt_blocks,
          cluster_choices_fork_without_prefix_cache_1x1, cluster_choices_fork_without_prefix_cache_1x2,
          cluster_choices_fork_worker_killed_2x1, cluster_choices_fork_worker_killed_2x2,
          cluster_choices_survive_router_restart)
