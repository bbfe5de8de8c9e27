/* `llm status`'s view of a router's Status reply (status_view.h). */
#include "status_view.h"

#include <stdio.h>

/* Prompt tokens found in the prefix cache among those admitted; 0 before any. */
static double status_hit_rate(uint64_t hits, uint64_t misses) {
    return hits + misses ? (double)hits / (double)(hits + misses) : 0.0;
}

/* The stages' KV view against the router's (docs/client.md, "llm status"):
 * once a pipeline is idle (ready, nothing running, no step in flight) each
 * stage holds exactly the blocks the router's pipeline holds (prefix-cached
 * ones included).  A stage's view travels in its heartbeat, so a reply
 * just after a load may carry a view from before the last frees: a view
 * counts only when it is newer than the moment the router was first seen
 * idle with nothing run since (fresh). */
static bool status_pipeline_idle(const Llm__PipelineStatus *p) {
    return p->ready && p->running == 0 && p->steps_in_flight == 0;
}

static bool status_stage_kv_differs(const Llm__PipelineStatus *p, const Llm__StageStatus *st) {
    return status_pipeline_idle(p) && st->worker_id && st->worker_id[0] && st->kv_blocks_used != p->kv_blocks_used;
}


/* Whether stage st's view came to the router after the idle moment. */
static bool status_stage_view_fresh(const struct status_kv_read *kv, const Llm__StageStatus *st) {
    return kv->compare_all || (int64_t)st->heartbeat_age_ms < kv->sent_ms - kv->idle_ms;
}

/* Stages of idle pipelines whose view differs: fresh ones when fresh, else
 * those not yet fresh. */
int status_kv_count(const struct status_kv_read *kv, bool fresh) {
    int n = 0;
    for (size_t i = 0; i < kv->s->n_pipelines; i++) {
        const Llm__PipelineStatus *p = kv->s->pipelines[i];
        for (size_t j = 0; j < p->n_stages; j++)
            if (status_stage_kv_differs(p, p->stages[j]) && status_stage_view_fresh(kv, p->stages[j]) == fresh) n++;
    }
    return n;
}

cJSON *status_view_json(const struct status_kv_read *kv) {
    const Llm__StatusReply *s = kv->s;
    cJSON *j = cJSON_CreateObject();
    cJSON_AddNumberToObject(j, "queue_depth", s->queue_depth);
    cJSON_AddNumberToObject(j, "running", s->running);
    cJSON_AddNumberToObject(j, "kv_blocks_used", (double)s->kv_blocks_used);
    cJSON_AddNumberToObject(j, "kv_blocks_total", (double)s->kv_blocks_total);
    cJSON_AddNumberToObject(j, "tokens_per_s", s->tokens_per_s);
    cJSON_AddNumberToObject(j, "prompt_tokens_per_s", s->prompt_tokens_per_s);
    cJSON_AddNumberToObject(j, "requests_total", (double)s->requests_total);
    cJSON_AddNumberToObject(j, "frames_rejected", (double)s->frames_rejected);
    cJSON_AddNumberToObject(j, "uptime_s", (double)s->uptime_s);
    cJSON_AddNumberToObject(j, "steps_total", (double)s->steps_total);
    cJSON_AddNumberToObject(j, "preemptions_total", (double)s->preemptions_total);
    cJSON_AddNumberToObject(j, "plan_us_mean", s->plan_us_mean);
    cJSON_AddNumberToObject(j, "plan_us_max", s->plan_us_max);
    cJSON_AddNumberToObject(j, "turnaround_us_mean", s->turnaround_us_mean);
    cJSON_AddBoolToObject(j, "prefix_cache", s->prefix_cache);
    cJSON_AddNumberToObject(j, "prefix_cached_blocks", (double)s->prefix_cached_blocks);
    cJSON_AddNumberToObject(j, "prefix_idle_blocks", (double)s->prefix_idle_blocks);
    cJSON_AddNumberToObject(j, "prefix_hit_tokens", (double)s->prefix_hit_tokens);
    cJSON_AddNumberToObject(j, "prefix_miss_tokens", (double)s->prefix_miss_tokens);
    cJSON_AddNumberToObject(j, "prefix_hit_blocks", (double)s->prefix_hit_blocks);
    cJSON_AddNumberToObject(j, "prefix_miss_blocks", (double)s->prefix_miss_blocks);
    cJSON_AddNumberToObject(j, "prefix_deferred", (double)s->prefix_deferred);
    cJSON_AddNumberToObject(j, "prefix_hit_rate", status_hit_rate(s->prefix_hit_tokens, s->prefix_miss_tokens));
    cJSON_AddNumberToObject(j, "kv_blocks_shared", (double)s->kv_blocks_shared);
    cJSON_AddNumberToObject(j, "forks", (double)s->forks);
    cJSON_AddNumberToObject(j, "fork_tokens", (double)s->fork_tokens);
    cJSON_AddNumberToObject(j, "stages_kv_differ", status_kv_count(kv, true));
    cJSON *ps = cJSON_AddArrayToObject(j, "pipelines");
    for (size_t i = 0; i < s->n_pipelines; i++) {
        const Llm__PipelineStatus *p = s->pipelines[i];
        cJSON *pj = cJSON_CreateObject();
        cJSON_AddNumberToObject(pj, "pipeline_id", p->pipeline_id);
        cJSON_AddStringToObject(pj, "model", p->model);
        cJSON_AddBoolToObject(pj, "ready", p->ready);
        cJSON_AddBoolToObject(pj, "draining", p->draining);
        cJSON_AddNumberToObject(pj, "running", p->running);
        cJSON_AddNumberToObject(pj, "kv_blocks_used", p->kv_blocks_used);
        cJSON_AddNumberToObject(pj, "kv_blocks_total", p->kv_blocks_total);
        cJSON_AddNumberToObject(pj, "tokens_per_s", p->tokens_per_s);
        cJSON_AddNumberToObject(pj, "prompt_tokens_per_s", p->prompt_tokens_per_s);
        cJSON_AddNumberToObject(pj, "waiting", p->waiting);
        cJSON_AddNumberToObject(pj, "steps_in_flight", p->steps_in_flight);
        cJSON_AddBoolToObject(pj, "idle", status_pipeline_idle(p));
        cJSON_AddNumberToObject(pj, "epoch", (double)p->epoch);
        cJSON_AddStringToObject(pj, "problem", p->problem ? p->problem : "");
        cJSON_AddStringToObject(pj, "draft_model", p->draft_model ? p->draft_model : "");
        cJSON_AddNumberToObject(pj, "prefix_cached_blocks", p->prefix_cached_blocks);
        cJSON_AddNumberToObject(pj, "prefix_idle_blocks", p->prefix_idle_blocks);
        cJSON_AddNumberToObject(pj, "prefix_hit_tokens", (double)p->prefix_hit_tokens);
        cJSON_AddNumberToObject(pj, "prefix_miss_tokens", (double)p->prefix_miss_tokens);
        cJSON_AddNumberToObject(pj, "prefix_hit_blocks", (double)p->prefix_hit_blocks);
        cJSON_AddNumberToObject(pj, "prefix_miss_blocks", (double)p->prefix_miss_blocks);
        cJSON_AddNumberToObject(pj, "prefix_deferred", (double)p->prefix_deferred);
        cJSON_AddNumberToObject(pj, "kv_blocks_shared", p->kv_blocks_shared);
        cJSON_AddNumberToObject(pj, "forks", (double)p->forks);
        cJSON_AddNumberToObject(pj, "fork_tokens", (double)p->fork_tokens);
        cJSON *ss = cJSON_AddArrayToObject(pj, "stages");
        for (size_t k = 0; k < p->n_stages; k++) {
            const Llm__StageStatus *st = p->stages[k];
            cJSON *sj = cJSON_CreateObject();
            cJSON_AddNumberToObject(sj, "stage_index", st->stage_index);
            cJSON_AddStringToObject(sj, "worker_id", st->worker_id);
            cJSON_AddNumberToObject(sj, "layer_first", st->layer_first);
            cJSON_AddNumberToObject(sj, "layer_end", st->layer_end);
            cJSON_AddStringToObject(sj, "backend", st->backend);
            cJSON_AddStringToObject(sj, "device", st->device);
            cJSON_AddNumberToObject(sj, "kv_blocks_used", st->kv_blocks_used);
            cJSON_AddNumberToObject(sj, "kv_blocks_total", st->kv_blocks_total);
            cJSON_AddNumberToObject(sj, "heartbeat_age_ms", st->heartbeat_age_ms);
            cJSON_AddBoolToObject(sj, "kv_differs", status_stage_kv_differs(p, st) && status_stage_view_fresh(kv, st));
            cJSON_AddBoolToObject(sj, "ready", st->ready);
            cJSON_AddItemToArray(ss, sj);
        }
        cJSON_AddItemToArray(ps, pj);
    }
    cJSON *ws = cJSON_AddArrayToObject(j, "workers");
    for (size_t i = 0; i < s->n_workers; i++) {
        const Llm__WorkerStatus *w = s->workers[i];
        cJSON *wj = cJSON_CreateObject();
        cJSON_AddStringToObject(wj, "worker_id", w->worker_id);
        cJSON_AddNumberToObject(wj, "pipeline_id", w->pipeline_id);
        cJSON_AddNumberToObject(wj, "stage_index", w->stage_index);
        cJSON_AddStringToObject(wj, "backend", w->backend);
        cJSON_AddStringToObject(wj, "device", w->device);
        cJSON_AddStringToObject(wj, "state", w->state);
        cJSON_AddNumberToObject(wj, "heartbeat_age_ms", w->heartbeat_age_ms);
        cJSON_AddItemToArray(ws, wj);
    }
    return j;
}

void status_view_print(const char *endpoint, const struct status_kv_read *kv) {
    const Llm__StatusReply *s = kv->s;
    printf("router %s: up %llu s, %llu requests, %llu frames rejected\n", endpoint,
           (unsigned long long)s->uptime_s, (unsigned long long)s->requests_total,
           (unsigned long long)s->frames_rejected);
    printf("queue %u, running %u, KV blocks %llu/%llu (%llu shared), %.1f tokens/s generated, %.1f tokens/s "
           "prefilled\n",
           s->queue_depth, s->running, (unsigned long long)s->kv_blocks_used,
           (unsigned long long)s->kv_blocks_total, (unsigned long long)s->kv_blocks_shared, s->tokens_per_s,
           s->prompt_tokens_per_s);
    if (s->forks)
        printf("forked choices: %llu sequences started on another's KV blocks, %llu prompt positions not "
               "computed again\n", (unsigned long long)s->forks, (unsigned long long)s->fork_tokens);
    if (s->steps_total)
        printf("%llu steps, router cost per step: plan %.0f us (max %.0f), result-to-next-plan %.0f us; "
               "%llu preemptions\n",
               (unsigned long long)s->steps_total, s->plan_us_mean, s->plan_us_max, s->turnaround_us_mean,
               (unsigned long long)s->preemptions_total);
    if (s->prefix_cache)
        printf("prefix cache: %.1f%% of prompt tokens found (%llu found, %llu computed), %llu blocks cached, "
               "%llu idle, %llu admissions waited for blocks being computed\n",
               100.0 * status_hit_rate(s->prefix_hit_tokens, s->prefix_miss_tokens),
               (unsigned long long)s->prefix_hit_tokens, (unsigned long long)s->prefix_miss_tokens,
               (unsigned long long)s->prefix_cached_blocks, (unsigned long long)s->prefix_idle_blocks,
               (unsigned long long)s->prefix_deferred);
    else
        printf("prefix cache: off (--no-prefix-cache)\n");
    for (size_t i = 0; i < s->n_pipelines; i++) {
        const Llm__PipelineStatus *p = s->pipelines[i];
        bool draft = p->draft_model && p->draft_model[0];
        printf("pipeline %u: %s, model %s, %zu stages, running %u, waiting %u, KV blocks %u/%u, %.1f tokens/s, "
               "%s%s%s%s\n",
               p->pipeline_id, p->ready ? "ready" : p->draining ? "draining (no new work)" : "NOT READY", p->model,
               p->n_stages, p->running, p->waiting, p->kv_blocks_used, p->kv_blocks_total, p->tokens_per_s,
               draft ? "draft model " : "no draft model", draft ? p->draft_model : "",
               p->problem && p->problem[0] ? ": " : "", p->problem ? p->problem : "");
        for (size_t k = 0; k < p->n_stages; k++) {
            const Llm__StageStatus *st = p->stages[k];
            bool differs = status_stage_kv_differs(p, st) && status_stage_view_fresh(kv, st);
            printf("  stage %u: worker %s, layers [%u, %u), %s %s, KV blocks %u/%u, heartbeat %u ms ago%s%s\n",
                   st->stage_index, st->worker_id[0] ? st->worker_id : "(none)", st->layer_first,
                   st->layer_end, st->backend, st->device, st->kv_blocks_used, st->kv_blocks_total,
                   st->heartbeat_age_ms, st->ready ? "" : ", not ready",
                   differs ? ", KV DIFFERS from the router's (idle pipeline)" : "");
        }
    }
    for (size_t i = 0; i < s->n_pipelines; i++) {
        const Llm__PipelineStatus *p = s->pipelines[i];
        for (size_t j = 0; j < p->n_stages; j++) {
            const Llm__StageStatus *st = p->stages[j];
            if (status_stage_kv_differs(p, st) && status_stage_view_fresh(kv, st))
                printf("warning: pipeline %u is idle and holds %u KV blocks, but stage %u (worker %s) holds %u\n",
                       p->pipeline_id, p->kv_blocks_used, st->stage_index, st->worker_id, st->kv_blocks_used);
        }
    }
    if (s->n_workers) printf("workers:\n");
    for (size_t i = 0; i < s->n_workers; i++) {
        const Llm__WorkerStatus *w = s->workers[i];
        printf("  %s: pipeline %u stage %u, %s %s, %s, heartbeat %u ms ago\n", w->worker_id, w->pipeline_id,
               w->stage_index, w->backend, w->device, w->state, w->heartbeat_age_ms);
    }
}

