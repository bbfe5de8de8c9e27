/* The router's metric families, their updates from the event loop, and the
 * ready state behind /ready. */
#include "router/server_metrics.h"
#include "router/server-impl.h"

#include <pthread.h>
#include <stdbool.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "common/status.h"

/* Latency buckets in seconds: from a millisecond (a small model on a fast
 * GPU) to minutes (a long generation, or a queue behind one). */
static const double ttft_bounds[] = {0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25,
                                     0.5,   1,      2.5,   5,    10,    30,   60,  120};
static const double itl_bounds[] = {0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.075,
                                    0.1,    0.15,  0.2,    0.3,   0.5,  1,     2.5};
/* Planning one step: microseconds normally, a millisecond is trouble. */
static const double plan_bounds[] = {0.000001, 0.0000025, 0.000005, 0.00001, 0.000025, 0.00005,
                                     0.0001,   0.00025,   0.0005,   0.001,   0.0025,   0.01};
/* --batch-wait-us holds a step for at most 8 waits of up to a second. */
static const double wait_bounds[] = {0.0001, 0.00025, 0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.1, 1, 8};
/* Drafts accepted in one verification: 0 .. --spec-tokens (at most 16). */
static const double spec_len_bounds[] = {0, 1, 2, 3, 4, 5, 6, 7, 8, 10, 12, 16};
static const double e2e_bounds[] = {0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1,  2.5,  5,
                                    10,   15,    20,   30,  40,   50,  60, 120, 300, 600};

/* GenerateDone's finish reasons, by value, as label values. */
static const char *const finish_names[] = {"unspecified", "stop", "length", "cancelled",
                                           "error", "deadline"};
#define FINISH_N ((int)(sizeof finish_names / sizeof finish_names[0]))

struct server_metrics {
    metrics *reg;
    metrics_series *running, *waiting, *kv_used, *kv_total, *pipelines, *redis;
    metrics_series *prompt_tokens, *gen_tokens, *preemptions;
    metrics_series *prefix_hits, *prefix_misses, *prefix_blocks, *prefix_deferred;
    metrics_series *plan, *capped, *batch_wait;
    metrics_series *spec_steps, *spec_drafts, *spec_accepted, *spec_len;
    metrics_series *spec_m_steps, *spec_m_drafts, *spec_m_accepted; /* the draft model's share */
    metrics_series *kv_shared, *forks, *fork_tokens;
    metrics_series *finished[FINISH_N];
    metrics_series *ttft, *itl, *e2e, *queue;
    metrics_series *hs_refused[2];     /* CURVE handshakes: clients, workers */
    metrics_series *worker_refused[3]; /* register, heartbeat, result */
    metrics_series *access_refused[2]; /* cancel, reattach */
    uint64_t hs_mark[2];               /* the ZAP handler's totals when last added */
    /* The loop's running totals when last added to the counters.  The
     * preemption total is a sum over the live pipelines' schedulers, so it
     * can drop when a pipeline leaves: only rises are added. */
    uint64_t gen_mark, prompt_mark, preempt_mark;
    uint64_t hit_mark, miss_mark, deferred_mark; /* prefix-cache totals, summed like preemptions */
    uint64_t capped_mark;         /* prefill tokens the ITL target held back, likewise */
    uint64_t forks_mark, fork_tokens_mark; /* forked choices, likewise */
    /* /ready: written by the loop when it changes, read by the port. */
    pthread_mutex_t lock;
    char why[256]; /* "" when ready */
    char loop_why[256];
};

static const char *const finish_label[] = {"finished_reason", NULL};
static const char *const domain_label[] = {"domain", NULL};
static const char *const message_label[] = {"message", NULL};
static const char *const operation_label[] = {"operation", NULL};
static const char *const hs_domains[] = {"clients", "workers"};
static const char *const worker_messages[] = {"register", "heartbeat", "result"};
static const char *const operations[] = {"cancel", "reattach"};

/* The refusals (docs/security.md), every label value present from the
 * start so that each reads 0 before its first. */
static int refusal_families(server_metrics *sm, char *err, size_t errlen) {
    static const struct metrics_def defs[] = {
        {.type = METRICS_COUNTER, .name = "llm_refused_handshakes_total",
         .help = "CURVE handshakes refused: a key not in the socket's allowlist.", .labels = domain_label},
        {.type = METRICS_COUNTER, .name = "llm_refused_worker_messages_total",
         .help = "Worker messages naming a live worker id from a key other than the one that registered it.",
         .labels = message_label},
        {.type = METRICS_COUNTER, .name = "llm_refused_request_access_total",
         .help = "Cancels and re-attaches (Generate) naming an id another client's key has a request of: ids are "
                 "per key, so it got what an unknown id gets.",
         .labels = operation_label},
    };
    metrics_family *f[3];
    for (int i = 0; i < 3; i++) {
        int rc = metrics_family_new(sm->reg, &defs[i], &f[i], err, errlen);
        if (rc < 0) return rc == STATUS_NO_MEMORY ? rc : STATUS_INTERNAL;
    }
    bool ok = true;
    for (int i = 0; i < 2; i++) {
        ok &= (sm->hs_refused[i] = metrics_series_get(f[0], (const char *[]){hs_domains[i]})) != NULL;
        ok &= (sm->access_refused[i] = metrics_series_get(f[2], (const char *[]){operations[i]})) != NULL;
    }
    for (int i = 0; i < 3; i++)
        ok &= (sm->worker_refused[i] = metrics_series_get(f[1], (const char *[]){worker_messages[i]})) != NULL;
    if (!ok) {
        snprintf(err, errlen, "router metrics: out of memory");
        return STATUS_NO_MEMORY;
    }
    return STATUS_OK;
}

#define DEF(t, n, h) {.type = (t), .name = (n), .help = (h)}
#define HIST(n, h, b) \
    {.type = METRICS_HISTOGRAM, .name = (n), .help = (h), .bounds = (b), .n_bounds = (int)(sizeof(b) / sizeof((b)[0]))}

int server_metrics_init(server_metrics **out, char *err, size_t errlen) {
    *out = NULL;
    server_metrics *sm = calloc(1, sizeof *sm);
    if (!sm || metrics_init(&sm->reg) < 0) {
        free(sm);
        snprintf(err, errlen, "router metrics: out of memory");
        return STATUS_NO_MEMORY;
    }
    pthread_mutex_init(&sm->lock, NULL);
    snprintf(sm->why, sizeof sm->why, "starting");
    snprintf(sm->loop_why, sizeof sm->loop_why, "starting");
    static const struct metrics_def defs[] = {
        DEF(METRICS_GAUGE, "llm_num_requests_running", "Requests admitted to a pipeline's batch."),
        DEF(METRICS_GAUGE, "llm_num_requests_waiting",
            "Requests accepted and not running: in the router's queue or waiting for KV blocks."),
        {.type = METRICS_COUNTER, .name = "llm_requests_finished_total",
         .help = "Requests finished, by finish reason.", .labels = finish_label},
        DEF(METRICS_COUNTER, "llm_prompt_tokens_total", "Prompt tokens processed (prefill, with recomputation)."),
        DEF(METRICS_COUNTER, "llm_generation_tokens_total", "Tokens generated."),
        HIST("llm_time_to_first_token_seconds", "Time from a request's arrival to its first token.",
             ttft_bounds),
        HIST("llm_inter_token_latency_seconds", "Time between two tokens of one request.", itl_bounds),
        HIST("llm_e2e_request_latency_seconds", "Time from a request's arrival to its end.", e2e_bounds),
        HIST("llm_request_queue_time_seconds",
             "Time from a request's arrival to its first placement on a pipeline.", ttft_bounds),
        DEF(METRICS_GAUGE, "llm_kv_blocks_used", "KV blocks held by sequences, over the pipelines in service."),
        DEF(METRICS_GAUGE, "llm_kv_blocks_capacity", "KV blocks of the pipelines in service, used or free."),
        DEF(METRICS_COUNTER, "llm_num_preemptions_total",
            "Sequences preempted (their KV blocks freed, to be recomputed)."),
        DEF(METRICS_GAUGE, "llm_pipelines_in_service", "Pipelines that take new work."),
        DEF(METRICS_GAUGE, "llm_redis_connected", "1 while the router's Redis connection is up."),
        DEF(METRICS_COUNTER, "llm_prefix_cache_hit_tokens_total",
            "Prompt tokens found in a pipeline's prefix cache when their sequence was admitted (not computed)."),
        DEF(METRICS_COUNTER, "llm_prefix_cache_miss_tokens_total",
            "Prompt tokens computed when their sequence was admitted with the prefix cache on."),
        DEF(METRICS_GAUGE, "llm_prefix_cache_blocks",
            "KV blocks published in the prefix caches of the pipelines in service (held or idle)."),
        HIST("llm_router_step_plan_seconds", "Time the router took to plan one step.", plan_bounds),
        DEF(METRICS_COUNTER, "llm_router_prefill_tokens_capped_total",
            "Prefill tokens held back from steps with decodes to keep the inter-token latency "
            "target (--itl-target-ms); later steps take them."),
        DEF(METRICS_COUNTER, "llm_prefix_cache_deferred_total",
            "Admissions that waited for prompt blocks another running sequence was still computing, "
            "to map them from the prefix cache instead of computing them again."),
        HIST("llm_router_batch_wait_seconds",
             "Time a pipeline with nothing running held its first step for more prompts (--batch-wait-us).",
             wait_bounds),
        DEF(METRICS_COUNTER, "llm_spec_verifications_total",
            "Decode steps of a sequence that carried drafted tokens to verify (speculation)."),
        DEF(METRICS_COUNTER, "llm_spec_draft_tokens_total", "Drafted tokens sent to be verified."),
        DEF(METRICS_COUNTER, "llm_spec_accepted_tokens_total",
            "Drafted tokens the last stage accepted (each one a token gained over a plain decode step)."),
        HIST("llm_spec_accepted_length", "Drafts accepted per verification.", spec_len_bounds),
        DEF(METRICS_COUNTER, "llm_spec_model_verifications_total",
            "Of llm_spec_verifications_total, those whose drafts came from the last stage's draft model."),
        DEF(METRICS_COUNTER, "llm_spec_model_draft_tokens_total",
            "Of llm_spec_draft_tokens_total, the draft model's (the rest are prompt lookup's)."),
        DEF(METRICS_COUNTER, "llm_spec_model_accepted_tokens_total",
            "Of llm_spec_accepted_tokens_total, the draft model's."),
        DEF(METRICS_GAUGE, "llm_kv_blocks_shared",
            "KV blocks held by more than one sequence (forked choices, blocks mapped from the prefix "
            "cache), over the pipelines in service; each counts once in llm_kv_blocks_used."),
        DEF(METRICS_COUNTER, "llm_kv_forks_total",
            "Sequences admitted on a fork of another's KV blocks (the choices of a request of n > 1)."),
        DEF(METRICS_COUNTER, "llm_kv_fork_tokens_total",
            "Prompt positions forked sequences took from another's KV blocks instead of computing."),
    };
    metrics_family *f[sizeof defs / sizeof defs[0]];
    for (size_t i = 0; i < sizeof defs / sizeof defs[0]; i++) {
        int rc = metrics_family_new(sm->reg, &defs[i], &f[i], err, errlen);
        if (rc < 0) {
            server_metrics_free(sm);
            return rc == STATUS_NO_MEMORY ? rc : STATUS_INTERNAL;
        }
    }
    sm->running = metrics_series_get(f[0], NULL);
    sm->waiting = metrics_series_get(f[1], NULL);
    sm->prompt_tokens = metrics_series_get(f[3], NULL);
    sm->gen_tokens = metrics_series_get(f[4], NULL);
    sm->ttft = metrics_series_get(f[5], NULL);
    sm->itl = metrics_series_get(f[6], NULL);
    sm->e2e = metrics_series_get(f[7], NULL);
    sm->queue = metrics_series_get(f[8], NULL);
    sm->kv_used = metrics_series_get(f[9], NULL);
    sm->kv_total = metrics_series_get(f[10], NULL);
    sm->preemptions = metrics_series_get(f[11], NULL);
    sm->pipelines = metrics_series_get(f[12], NULL);
    sm->redis = metrics_series_get(f[13], NULL);
    sm->prefix_hits = metrics_series_get(f[14], NULL);
    sm->prefix_misses = metrics_series_get(f[15], NULL);
    sm->prefix_blocks = metrics_series_get(f[16], NULL);
    sm->plan = metrics_series_get(f[17], NULL);
    sm->capped = metrics_series_get(f[18], NULL);
    sm->prefix_deferred = metrics_series_get(f[19], NULL);
    sm->batch_wait = metrics_series_get(f[20], NULL);
    sm->spec_steps = metrics_series_get(f[21], NULL);
    sm->spec_drafts = metrics_series_get(f[22], NULL);
    sm->spec_accepted = metrics_series_get(f[23], NULL);
    sm->spec_len = metrics_series_get(f[24], NULL);
    sm->spec_m_steps = metrics_series_get(f[25], NULL);
    sm->spec_m_drafts = metrics_series_get(f[26], NULL);
    sm->spec_m_accepted = metrics_series_get(f[27], NULL);
    sm->kv_shared = metrics_series_get(f[28], NULL);
    sm->forks = metrics_series_get(f[29], NULL);
    sm->fork_tokens = metrics_series_get(f[30], NULL);
    bool ok = true;
    /* Every reason from the start, so that each reads 0 before its first. */
    for (int i = 1; i < FINISH_N; i++)
        ok &= (sm->finished[i] = metrics_series_get(f[2], (const char *[]){finish_names[i]})) != NULL;
    if (!ok) {
        server_metrics_free(sm);
        snprintf(err, errlen, "router metrics: out of memory");
        return STATUS_NO_MEMORY;
    }
    int rrc = refusal_families(sm, err, errlen);
    if (rrc < 0) {
        server_metrics_free(sm);
        return rrc;
    }
    *out = sm;
    return STATUS_OK;
}

void server_metrics_free(server_metrics *sm) {
    if (!sm) return;
    metrics_free(sm->reg);
    pthread_mutex_destroy(&sm->lock);
    free(sm);
}

metrics *server_metrics_registry(server_metrics *sm) { return sm->reg; }

const char *server_metrics_ready(void *ud, char *buf, size_t size) {
    server_metrics *sm = ud;
    pthread_mutex_lock(&sm->lock);
    bool ready = !sm->why[0];
    if (!ready) snprintf(buf, size, "%s", sm->why);
    pthread_mutex_unlock(&sm->lock);
    return ready ? NULL : buf;
}

void server_metrics_tick(server *s) {
    server_metrics *sm = s->cfg.metrics;
    if (!sm) return;
    int64_t running = 0, waiting = (int64_t)s->n_queue, used = 0, total = 0, in_service = 0;
    uint64_t preempt = 0, hits = 0, misses = 0, capped = 0, deferred = 0, forks = 0, fork_tokens = 0;
    int64_t cached = 0, shared = 0;
    for (size_t i = 0; i < registry_n_pipelines(s->reg); i++) {
        struct pipeline *p = registry_pipeline_at(s->reg, i);
        struct pipe *pp = p->ud;
        if (!pp || !pp->sched) continue;
        struct sched_stats st;
        sched_get_stats(pp->sched, &st);
        running += st.n_running;
        waiting += st.n_waiting;
        preempt += st.preemptions_total;
        hits += st.prefix_hit_tokens;
        misses += st.prefix_miss_tokens;
        deferred += st.prefix_deferred;
        capped += st.prefill_capped_tokens;
        forks += st.forks;
        fork_tokens += st.fork_tokens;
        if (registry_pipeline_ready(s->reg, p) && !registry_pipeline_draining(s->reg, p)) {
            shared += st.blocks_shared;
            in_service++;
            used += st.blocks_used;
            total += st.blocks_total;
            cached += st.blocks_cached;
        }
    }
    metrics_gauge_set(sm->running, (double)running);
    metrics_gauge_set(sm->waiting, (double)waiting);
    metrics_gauge_set(sm->kv_used, (double)used);
    metrics_gauge_set(sm->kv_total, (double)total);
    metrics_gauge_set(sm->pipelines, (double)in_service);
    metrics_gauge_set(sm->redis, s->rs ? 1 : 0);
    if (s->gen_total > sm->gen_mark) metrics_counter_add(sm->gen_tokens, (double)(s->gen_total - sm->gen_mark));
    if (s->prompt_total > sm->prompt_mark)
        metrics_counter_add(sm->prompt_tokens, (double)(s->prompt_total - sm->prompt_mark));
    if (preempt > sm->preempt_mark) metrics_counter_add(sm->preemptions, (double)(preempt - sm->preempt_mark));
    sm->gen_mark = s->gen_total;
    sm->prompt_mark = s->prompt_total;
    sm->preempt_mark = preempt;
    metrics_gauge_set(sm->prefix_blocks, (double)cached);
    if (hits > sm->hit_mark) metrics_counter_add(sm->prefix_hits, (double)(hits - sm->hit_mark));
    if (misses > sm->miss_mark) metrics_counter_add(sm->prefix_misses, (double)(misses - sm->miss_mark));
    if (deferred > sm->deferred_mark)
        metrics_counter_add(sm->prefix_deferred, (double)(deferred - sm->deferred_mark));
    sm->hit_mark = hits;
    sm->miss_mark = misses;
    sm->deferred_mark = deferred;
    for (int i = 0; i < 2 && s->zap; i++) {
        uint64_t n = zio_zap_refused(s->zap, hs_domains[i]);
        if (n > sm->hs_mark[i]) metrics_counter_add(sm->hs_refused[i], (double)(n - sm->hs_mark[i]));
        sm->hs_mark[i] = n;
    }
    if (capped > sm->capped_mark) metrics_counter_add(sm->capped, (double)(capped - sm->capped_mark));
    sm->capped_mark = capped;
    metrics_gauge_set(sm->kv_shared, (double)shared);
    if (forks > sm->forks_mark) metrics_counter_add(sm->forks, (double)(forks - sm->forks_mark));
    if (fork_tokens > sm->fork_tokens_mark)
        metrics_counter_add(sm->fork_tokens, (double)(fork_tokens - sm->fork_tokens_mark));
    sm->forks_mark = forks;
    sm->fork_tokens_mark = fork_tokens;

    char why[256] = "";
    if (!s->rs) {
        char shown[200]; /* /ready is served to anyone: never the password */
        rconn_url_redact(s->cfg.redis_url ? s->cfg.redis_url : "?", shown, sizeof shown);
        snprintf(why, sizeof why, "Redis at %s is not reachable", shown);
    }
    else if (in_service == 0)
        snprintf(why, sizeof why, "no pipeline in service (%zu formed)", registry_n_pipelines(s->reg));
    /* The port's lock only when the answer changes, not every turn. */
    if (strcmp(why, sm->loop_why) != 0) {
        snprintf(sm->loop_why, sizeof sm->loop_why, "%s", why);
        pthread_mutex_lock(&sm->lock);
        snprintf(sm->why, sizeof sm->why, "%s", why);
        pthread_mutex_unlock(&sm->lock);
    }
}

static double since_s(int64_t from_ms, int64_t to_ms) {
    return to_ms > from_ms ? (double)(to_ms - from_ms) / 1000.0 : 0.0;
}

void server_metrics_first_token(server_metrics *sm, int64_t created_ms, int64_t now_ms) {
    if (sm) metrics_histogram_observe(sm->ttft, since_s(created_ms, now_ms));
}

void server_metrics_token_gap(server_metrics *sm, double seconds) {
    if (sm) metrics_histogram_observe(sm->itl, seconds);
}

void server_metrics_step_plan(server_metrics *sm, double seconds) {
    if (sm) metrics_histogram_observe(sm->plan, seconds);
}

void server_metrics_batch_wait(server_metrics *sm, double seconds) {
    if (sm) metrics_histogram_observe(sm->batch_wait, seconds);
}

void server_metrics_scheduled(server_metrics *sm, int64_t created_ms, int64_t now_ms) {
    if (sm) metrics_histogram_observe(sm->queue, since_s(created_ms, now_ms));
}

void server_metrics_finished(server_metrics *sm, int32_t finish, int64_t created_ms, int64_t done_ms) {
    if (!sm) return;
    if (finish >= 1 && finish < FINISH_N) metrics_counter_inc(sm->finished[finish]);
    metrics_histogram_observe(sm->e2e, since_s(created_ms, done_ms));
}

void server_metrics_spec(server_metrics *sm, int32_t n_draft, int32_t n_accepted, bool model) {
    if (!sm) return;
    metrics_counter_inc(sm->spec_steps);
    metrics_counter_add(sm->spec_drafts, (double)n_draft);
    metrics_counter_add(sm->spec_accepted, (double)n_accepted);
    metrics_histogram_observe(sm->spec_len, (double)n_accepted);
    if (!model) return;
    metrics_counter_inc(sm->spec_m_steps);
    metrics_counter_add(sm->spec_m_drafts, (double)n_draft);
    metrics_counter_add(sm->spec_m_accepted, (double)n_accepted);
}

void server_metrics_request_refused(server_metrics *sm, bool cancel) {
    if (sm) metrics_counter_inc(sm->access_refused[cancel ? 0 : 1]);
}

void server_metrics_worker_refused(server_metrics *sm, enum server_refused_worker what) {
    if (sm && what >= SERVER_REFUSED_REGISTER && what <= SERVER_REFUSED_RESULT)
        metrics_counter_inc(sm->worker_refused[what]);
}
