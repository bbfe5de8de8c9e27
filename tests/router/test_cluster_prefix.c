/* Automatic prefix caching and prefix-aware routing through real processes
 * (docs/router.md, "Prefix caching"): one workload of shared prefixes (a
 * system prompt before distinct questions, conversations whose turns extend
 * their own history with the tokens generated, identical prompts), greedy
 * and seeded-sampled with a repetition penalty, runs on two CPU pipelines
 * with --no-prefix-cache and again with the cache on.  Every token must be
 * the same; with the cache the router reports hits, sends a request to the
 * pipeline holding its prefix, and every KV block comes back (blocks left
 * are idle cached ones). */
#include "tests/router/cluster_harness.h"

#define MODEL "stories260K-f32.gguf"
#define BS 8          /* --kv-block-size of the workers */
#define GEN 12        /* tokens generated per request */
#define SYS_LEN 37    /* system prompt: 4 full blocks and a part */
#define Q_LEN 6
#define N_QUESTIONS 5
#define N_CONV 2
#define N_TURNS 3
#define N_SAME 3
#define N_LATE 3      /* questions after a third system prompt, phase 7 */
#define MAX_TOK 256

/* The workload's token ids: deterministic, inside the vocabulary (512). */
static int32_t tok(uint32_t seed, int i) { return (int32_t)(3 + (seed * 2654435761u + (uint32_t)i * 40503u) % 490u); }

struct pgen {
    struct cluster *cl;
    int32_t prompt[MAX_TOK];
    int n_prompt;
    int sampled;
    uint64_t seed;
    /* out */
    int rc;
    char err[640];
    int32_t ids[64];
    int n;
};

static int pgen_chunk(void *ud, const struct llm_chunk *ch) {
    struct pgen *g = ud;
    for (size_t i = 0; i < ch->n_tokens; i++)
        if (g->n < 64) g->ids[g->n++] = ch->token_ids[i];
    return 0;
}

static void pgen_run(struct pgen *g) {
    llm_client *c = h_client(g->cl, 5000, 10000, 60000);
    struct llm_generate_params p;
    llm_generate_params_default(&p);
    p.prompt_tokens = g->prompt;
    p.n_prompt_tokens = (size_t)g->n_prompt;
    p.max_tokens = GEN;
    p.sampling.ignore_eos = 1;
    if (g->sampled) {
        p.sampling.temperature = 0.9f;
        p.sampling.top_k = 40;
        p.sampling.seed = g->seed;
        /* The penalty sees the whole history: a sequence that starts on a
         * cached prefix must still see the tokens before it. */
        p.sampling.repetition_penalty = 1.3f;
    }
    p.wait_ms = 90000;
    struct llm_generate_result r;
    memset(&r, 0, sizeof r);
    g->n = 0;
    g->rc = llm_client_generate(c, &p, pgen_chunk, g, &r);
    if (g->rc != 0) snprintf(g->err, sizeof g->err, "%s", llm_client_errstr(c));
    else if (r.finish_reason != LLM__GENERATE_DONE__FINISH_REASON__LENGTH)
        snprintf(g->err, sizeof g->err, "finish %s: %s", llm_finish_reason_name(r.finish_reason),
                 r.error_message);
    llm_generate_result_free(&r);
    llm_client_close(c);
}

static void *pgen_thread(void *arg) {
    pgen_run(arg);
    return NULL;
}

static void pgen_all(struct pgen **gs, int n) {
    pthread_t th[32];
    for (int i = 0; i < n; i++) pthread_create(&th[i], NULL, pgen_thread, gs[i]);
    for (int i = 0; i < n; i++) pthread_join(th[i], NULL);
}

/* What one run of the workload produced, in a fixed order. */
struct outcome {
    int32_t ids[64][GEN];
    int sampled[64];
    int n;
};

static void keep(struct cluster *cl, struct outcome *o, const struct pgen *g) {
    H_ASSERT(cl, g->rc == 0 && !g->err[0], "request %d (%d prompt tokens): %s", o->n, g->n_prompt, g->err);
    H_ASSERT(cl, g->n == GEN, "request %d: %d tokens, expected %d", o->n, g->n, GEN);
    o->sampled[o->n] = g->sampled;
    memcpy(o->ids[o->n++], g->ids, sizeof o->ids[0]);
}

static Llm__StatusReply *status(struct cluster *cl, Llm__ClientEnvelope **env) {
    llm_client *c = h_client(cl, 5000, 10000, 10000);
    int rc = llm_client_status(c, env);
    llm_client_close(c);
    H_ASSERT(cl, rc == 0, "status: %d", rc);
    return (*env)->status_reply;
}

/* Prompt hit tokens of each pipeline, by pipeline id (0 and 1). */
static void hits_by_pipeline(struct cluster *cl, uint64_t hits[2]) {
    Llm__ClientEnvelope *env;
    Llm__StatusReply *st = status(cl, &env);
    hits[0] = hits[1] = 0;
    for (size_t i = 0; i < st->n_pipelines; i++)
        if (st->pipelines[i]->pipeline_id < 2) hits[st->pipelines[i]->pipeline_id] = st->pipelines[i]->prefix_hit_tokens;
    proto_client_free(env);
}

/* The pipeline (0 or 1) holding cached blocks, or -1 if none or both do. */
static int pipeline_with_cache(struct cluster *cl) {
    Llm__ClientEnvelope *env;
    Llm__StatusReply *st = status(cl, &env);
    int found = -1, n = 0;
    for (size_t i = 0; i < st->n_pipelines; i++)
        if (st->pipelines[i]->prefix_cached_blocks > 0) found = (int)st->pipelines[i]->pipeline_id, n++;
    proto_client_free(env);
    return n == 1 ? found : -1;
}

/* Prompt tokens found cached and computed, over all pipelines. */
static void prefix_totals(struct cluster *cl, uint64_t *hit, uint64_t *miss) {
    Llm__ClientEnvelope *env;
    Llm__StatusReply *st = status(cl, &env);
    *hit = st->prefix_hit_tokens;
    *miss = st->prefix_miss_tokens;
    proto_client_free(env);
}

/* Requests accepted so far, and sequences the pipelines hold (running or
 * waiting for admission). */
static void held(struct cluster *cl, uint64_t *accepted, uint32_t *seqs) {
    Llm__ClientEnvelope *env;
    Llm__StatusReply *st = status(cl, &env);
    *accepted = st->requests_total;
    *seqs = 0;
    for (size_t i = 0; i < st->n_pipelines; i++) *seqs += st->pipelines[i]->running + st->pipelines[i]->waiting;
    proto_client_free(env);
}

static uint32_t running_on(struct cluster *cl, int pipeline) {
    Llm__ClientEnvelope *env;
    Llm__StatusReply *st = status(cl, &env);
    uint32_t r = 0;
    for (size_t i = 0; i < st->n_pipelines; i++)
        if ((int)st->pipelines[i]->pipeline_id == pipeline) r = st->pipelines[i]->running;
    proto_client_free(env);
    return r;
}

/* The workload, in phases so that what is cached where is known:
 *   1. system prompt 0 with a question, alone: it lands on pipeline A;
 *   2. an unrelated request X on A while A's worker is stopped (so A stays
 *      loaded), and system prompt 1 with a question: by load, to B;
 *   3. a new question after each system prompt, one at a time, loads equal:
 *      each must go to the pipeline holding its system prompt (by load
 *      alone both would go to the same one);
 *   4. the other questions after system prompt 0 and the first turns of
 *      the conversations, at once;
 *   5. the conversations' later turns (history + answer + question), the
 *      conversations at once;
 *   6. identical prompts at once, twice;
 *   7. a system prompt no pipeline holds, with distinct questions, all at
 *      the router while every worker is stopped: on each pipeline the first
 *      computes the system prompt's blocks (two steps: --step-tokens 16),
 *      and the others wait for them to be published and map them rather
 *      than computing them alongside.
 * Each request runs greedy and seeded-sampled.  Without the cache (cached
 * 0) the same requests run in the same order, without the stops. */
static void workload(struct cluster *cl, struct outcome *o, int cached) {
    static struct pgen gs[64];
    struct pgen *batch[32];
    int ng = 0;
    memset(gs, 0, sizeof gs);
    o->n = 0;
    int32_t sys[3][SYS_LEN];
    for (int s = 0; s < 3; s++)
        for (int i = 0; i < SYS_LEN; i++) sys[s][i] = tok(100 + (uint32_t)s, i);
#define NEW(sysi, q, mode)                                                     \
    do {                                                                       \
        struct pgen *g_ = &gs[ng++];                                           \
        g_->cl = cl;                                                           \
        memcpy(g_->prompt, sys[sysi], sizeof sys[sysi]);                       \
        for (int i_ = 0; i_ < Q_LEN; i_++) g_->prompt[SYS_LEN + i_] = tok(q, i_); \
        g_->n_prompt = SYS_LEN + Q_LEN;                                        \
        g_->sampled = (mode);                                                  \
        g_->seed = 7000u + (uint64_t)(q);                                      \
    } while (0)

    /* 1 */
    for (int m = 0; m < 2; m++) {
        NEW(0, 1, m);
        pgen_run(&gs[ng - 1]);
        keep(cl, o, &gs[ng - 1]);
    }
    int a = cached ? pipeline_with_cache(cl) : -1;
    if (cached) H_ASSERT(cl, a >= 0, "after one system prompt, not exactly one pipeline holds cached blocks");

    /* 2 */
    struct pgen *x = &gs[ng++];
    x->cl = cl;
    x->n_prompt = 9;
    for (int i = 0; i < x->n_prompt; i++) x->prompt[i] = tok(5, i);
    pthread_t xt;
    int slot = -1;
    if (cached) {
        slot = h_worker_slot(cl, a, 0);
        H_ASSERT(cl, slot >= 0, "no worker of pipeline %d", a);
        kill(cl->workers[slot].pid, SIGSTOP);
        pthread_create(&xt, NULL, pgen_thread, x);
        int64_t end = h_now_ms() + 5000;
        while (running_on(cl, a) == 0 && h_now_ms() < end) h_sleep_ms(10);
        H_ASSERT(cl, running_on(cl, a) == 1, "the request on the stopped pipeline %d is not running there", a);
    } else {
        pgen_run(x);
    }
    for (int m = 0; m < 2; m++) {
        NEW(1, 2, m);
        pgen_run(&gs[ng - 1]);
        keep(cl, o, &gs[ng - 1]);
    }
    if (cached) {
        kill(cl->workers[slot].pid, SIGCONT);
        pthread_join(xt, NULL);
    }
    keep(cl, o, x);

    /* 3 */
    uint64_t before[2], after[2];
    if (cached) hits_by_pipeline(cl, before);
    for (int s = 0; s < 2; s++) {
        for (int m = 0; m < 2; m++) {
            NEW(s, 10 + s, m);
            pgen_run(&gs[ng - 1]);
            keep(cl, o, &gs[ng - 1]);
        }
    }
    if (cached) {
        hits_by_pipeline(cl, after);
        for (int p = 0; p < 2; p++)
            H_ASSERT(cl, after[p] - before[p] >= 2 * (SYS_LEN / BS) * BS,
                     "pipeline %d found %llu prompt tokens cached in phase 3, expected at least %d", p,
                     (unsigned long long)(after[p] - before[p]), 2 * (SYS_LEN / BS) * BS);
    }

    /* 4: questions, and the conversations' first turns. */
    int nb = 0;
    for (int q = 0; q < N_QUESTIONS; q++)
        for (int m = 0; m < 2; m++) {
            NEW(0, 20 + q, m);
            batch[nb++] = &gs[ng - 1];
        }
    struct pgen *conv[N_CONV][2];
    for (int c = 0; c < N_CONV; c++)
        for (int m = 0; m < 2; m++) {
            NEW(c, 40 + c, m);
            conv[c][m] = &gs[ng - 1];
            batch[nb++] = conv[c][m];
        }
    pgen_all(batch, nb);
    for (int k = 0; k < nb; k++) keep(cl, o, batch[k]);

    /* 5: each turn extends the conversation's own history (the same mode's
     * answer) with a new question. */
    for (int t = 1; t < N_TURNS; t++) {
        nb = 0;
        for (int c = 0; c < N_CONV; c++)
            for (int m = 0; m < 2; m++) {
                struct pgen *prev = conv[c][m], *g = &gs[ng++];
                g->cl = cl;
                g->sampled = m;
                g->seed = 9000u + (uint64_t)(c * 10 + t);
                memcpy(g->prompt, prev->prompt, (size_t)prev->n_prompt * sizeof *g->prompt);
                g->n_prompt = prev->n_prompt;
                memcpy(g->prompt + g->n_prompt, prev->ids, GEN * sizeof *g->prompt);
                g->n_prompt += GEN;
                for (int i = 0; i < Q_LEN; i++) g->prompt[g->n_prompt++] = tok(60u + (uint32_t)(c * 10 + t), i);
                conv[c][m] = g;
                batch[nb++] = g;
            }
        pgen_all(batch, nb);
        for (int k = 0; k < nb; k++) keep(cl, o, batch[k]);
    }

    /* 6: identical prompts, at once, twice over. */
    for (int r = 0; r < 2; r++) {
        nb = 0;
        for (int k = 0; k < N_SAME; k++)
            for (int m = 0; m < 2; m++) {
                NEW(1, 80, m);
                batch[nb++] = &gs[ng - 1];
            }
        pgen_all(batch, nb);
        for (int k = 0; k < nb; k++) keep(cl, o, batch[k]);
    }

    /* 7 */
    nb = 0;
    for (int q = 0; q < N_LATE; q++)
        for (int m = 0; m < 2; m++) {
            NEW(2, 90 + q, m);
            batch[nb++] = &gs[ng - 1];
        }
    if (cached) {
        uint64_t hit0, miss0, hit1, miss1, acc0, acc;
        uint32_t seqs;
        prefix_totals(cl, &hit0, &miss0);
        held(cl, &acc0, &seqs);
        int slots[2];
        for (int p = 0; p < 2; p++) {
            slots[p] = h_worker_slot(cl, p, 0);
            H_ASSERT(cl, slots[p] >= 0, "no worker of pipeline %d", p);
            kill(cl->workers[slots[p]].pid, SIGSTOP);
        }
        pthread_t th[2 * N_LATE];
        for (int k = 0; k < nb; k++) pthread_create(&th[k], NULL, pgen_thread, batch[k]);
        int64_t end = h_now_ms() + 3000;
        do {
            h_sleep_ms(10);
            held(cl, &acc, &seqs);
        } while ((acc - acc0 < (uint64_t)nb || seqs < (uint32_t)nb) && h_now_ms() < end);
        H_ASSERT(cl, acc - acc0 == (uint64_t)nb && seqs == (uint32_t)nb,
                 "phase 7: %llu requests accepted and %u held by the pipelines while the workers are stopped, "
                 "expected %d", (unsigned long long)(acc - acc0), seqs, nb);
        for (int p = 0; p < 2; p++) kill(cl->workers[slots[p]].pid, SIGCONT);
        for (int k = 0; k < nb; k++) pthread_join(th[k], NULL);
        prefix_totals(cl, &hit1, &miss1);
        /* At most one request per pipeline computes the system prompt's
         * full blocks; every other maps them (and the other mode's twin
         * also its question's first block). */
        int full = SYS_LEN / BS * BS;
        H_ASSERT(cl, hit1 - hit0 >= (uint64_t)((nb - 2) * full),
                 "phase 7: %llu prompt tokens found cached, expected at least %d: the system prompt "
                 "was computed by more than one request per pipeline (%llu computed)",
                 (unsigned long long)(hit1 - hit0), (nb - 2) * full, (unsigned long long)(miss1 - miss0));
        H_ASSERT(cl, miss1 - miss0 <= (uint64_t)(2 * SYS_LEN + nb * Q_LEN + (nb - 2) * (SYS_LEN - full)),
                 "phase 7: %llu prompt tokens computed", (unsigned long long)(miss1 - miss0));
    } else {
        pgen_all(batch, nb);
    }
    for (int k = 0; k < nb; k++) keep(cl, o, batch[k]);
#undef NEW
}

/* Waits until no sequence holds a KV block; returns the final status. */
static Llm__StatusReply *settled(struct cluster *cl, Llm__ClientEnvelope **env) {
    int64_t end = h_now_ms() + 10000;
    for (;;) {
        Llm__StatusReply *st = status(cl, env);
        if ((st->kv_blocks_used == 0 && st->running == 0) || h_now_ms() > end) return st;
        proto_client_free(*env);
        h_sleep_ms(50);
    }
}

TEST(cluster_prefix_cache_changes_no_token) {
    /* A small pool (48 blocks of 8 positions per pipeline) so that idle
     * cached blocks get evicted and sequences preempted along the way. */
    const char *workers = "--kv-block-size 8 --kv-blocks 48";
    /* Prompts of several steps, so that phase 7's system prompt is still
     * being computed when the other requests are admitted. */
    const char *router = "--step-tokens 16";
    static struct outcome off, on;

    struct cluster *cl = h_cluster_start(test_model_path(MODEL), 2, 1, "--step-tokens 16 --no-prefix-cache", workers);
    workload(cl, &off, 0);
    Llm__ClientEnvelope *env;
    Llm__StatusReply *st = settled(cl, &env);
    H_ASSERT(cl, !st->prefix_cache, "status says the prefix cache is on under --no-prefix-cache");
    H_ASSERT(cl, st->prefix_deferred == 0, "--no-prefix-cache: %llu admissions waited for blocks being computed",
             (unsigned long long)st->prefix_deferred);
    H_ASSERT(cl, st->prefix_hit_tokens == 0 && st->prefix_cached_blocks == 0,
             "--no-prefix-cache: %llu hit tokens, %llu cached blocks", (unsigned long long)st->prefix_hit_tokens,
             (unsigned long long)st->prefix_cached_blocks);
    H_ASSERT(cl, st->kv_blocks_used == 0, "%llu KV blocks still used", (unsigned long long)st->kv_blocks_used);
    proto_client_free(env);
    h_cluster_stop(cl);

    cl = h_cluster_start(test_model_path(MODEL), 2, 1, router, workers);
    workload(cl, &on, 1);
    st = settled(cl, &env);
    H_ASSERT(cl, st->prefix_cache, "status says the prefix cache is off by default");
    H_ASSERT(cl, st->kv_blocks_used == 0, "%llu KV blocks still held after every request ended",
             (unsigned long long)st->kv_blocks_used);
    H_ASSERT(cl, st->prefix_cached_blocks == st->prefix_idle_blocks,
             "%llu cached blocks, only %llu of them idle after every request ended",
             (unsigned long long)st->prefix_cached_blocks, (unsigned long long)st->prefix_idle_blocks);
    H_ASSERT(cl, st->prefix_hit_tokens > 0 && st->prefix_hit_blocks > 0 && st->prefix_miss_tokens > 0,
             "hits %llu tokens / %llu blocks, misses %llu tokens", (unsigned long long)st->prefix_hit_tokens,
             (unsigned long long)st->prefix_hit_blocks, (unsigned long long)st->prefix_miss_tokens);
    uint64_t sum_hits = 0;
    for (size_t i = 0; i < st->n_pipelines; i++) {
        Llm__PipelineStatus *p = st->pipelines[i];
        H_ASSERT(cl, p->kv_blocks_used == 0, "pipeline %u: %u KV blocks still held", p->pipeline_id,
                 p->kv_blocks_used);
        sum_hits += p->prefix_hit_tokens;
    }
    H_ASSERT(cl, sum_hits == st->prefix_hit_tokens, "pipelines' hit tokens sum to %llu, the total says %llu",
             (unsigned long long)sum_hits, (unsigned long long)st->prefix_hit_tokens);
    /* Phase 7's requests reach the router together: all but the first of
     * each pipeline waited for the system prompt's blocks. */
    uint64_t sum_deferred = 0;
    for (size_t i = 0; i < st->n_pipelines; i++) sum_deferred += st->pipelines[i]->prefix_deferred;
    H_ASSERT(cl, st->prefix_deferred >= (uint64_t)(2 * N_LATE - 2) && sum_deferred == st->prefix_deferred,
             "status: %llu admissions waited for blocks being computed (pipelines sum to %llu), expected at "
             "least %d", (unsigned long long)st->prefix_deferred, (unsigned long long)sum_deferred, 2 * N_LATE - 2);
    fprintf(stderr, "prefix cache: %llu prompt tokens found cached, %llu computed; %llu blocks cached; "
            "%llu preemptions\n", (unsigned long long)st->prefix_hit_tokens,
            (unsigned long long)st->prefix_miss_tokens, (unsigned long long)st->prefix_cached_blocks,
            (unsigned long long)st->preemptions_total);
    proto_client_free(env);

    /* The same tokens, request for request. */
    H_ASSERT(cl, on.n == off.n, "%d requests with the cache, %d without", on.n, off.n);
    for (int r = 0; r < on.n; r++)
        for (int i = 0; i < GEN; i++)
            H_ASSERT(cl, on.ids[r][i] == off.ids[r][i],
                     "request %d (%s): token %d is %d with the prefix cache, %d without", r,
                     on.sampled[r] ? "seeded sampling" : "greedy", i, on.ids[r][i], off.ids[r][i]);
    h_cluster_stop(cl);
}

TEST_MAIN(cluster_prefix_cache_changes_no_token)
