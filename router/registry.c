/* Workers and pipelines: placement, layer split, liveness.  A pipeline's
 * epoch changes whenever a slot gets a different worker (or incarnation),
 * so that plans of the old formation are dropped by the workers and their
 * results by the router. */
#include "router/registry.h"

#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "common/log.h"
#include "common/status.h"

/* Index buckets (chained through hnext): results are looked up by worker
 * and pipeline id at every step, so a search over hundreds of pipelines
 * would be paid hundreds of thousands of times a second. */
#define REGISTRY_BUCKETS 1024

struct registry {
    struct registry_config cfg;
    struct worker *by_id[REGISTRY_BUCKETS];
    struct pipeline *by_pid[REGISTRY_BUCKETS];
    struct worker **workers;
    size_t n_workers, cap_workers;
    struct pipeline **pipes;
    size_t n_pipes, cap_pipes;
    uint64_t epoch;
};

const char *worker_state_name(enum worker_state s) {
    switch (s) {
    case WORKER_STARTING: return "starting";
    case WORKER_READY: return "ready";
    case WORKER_DRAINING: return "draining";
    case WORKER_FAILED: return "failed";
    case WORKER_LOST: return "lost";
    }
    return "unknown";
}

int registry_init(registry **out, const struct registry_config *cfg) {
    registry *r = calloc(1, sizeof *r);
    if (!r) return STATUS_NO_MEMORY;
    r->cfg = *cfg;
    if (r->cfg.auto_stages < 1) r->cfg.auto_stages = 1;
    r->epoch = cfg->epoch_base;
    *out = r;
    return STATUS_OK;
}

void registry_free(registry *r) {
    if (!r) return;
    for (size_t i = 0; i < r->n_workers; i++) free(r->workers[i]);
    for (size_t i = 0; i < r->n_pipes; i++) free(r->pipes[i]);
    free(r->workers);
    free(r->pipes);
    free(r);
}

size_t registry_n_workers(const registry *r) { return r->n_workers; }
struct worker *registry_worker_at(registry *r, size_t i) { return r->workers[i]; }
size_t registry_n_pipelines(const registry *r) { return r->n_pipes; }
struct pipeline *registry_pipeline_at(registry *r, size_t i) { return r->pipes[i]; }

static uint32_t registry_hash(const char *id) {
    uint32_t h = 2166136261u; /* FNV-1a */
    for (; *id; id++) h = (h ^ (uint8_t)*id) * 16777619u;
    return h % REGISTRY_BUCKETS;
}

struct worker *registry_worker_find(registry *r, const char *id) {
    for (struct worker *w = r->by_id[registry_hash(id)]; w; w = w->hnext)
        if (strcmp(w->id, id) == 0) return w;
    return NULL;
}

struct pipeline *registry_pipeline_find(registry *r, uint32_t id) {
    for (struct pipeline *p = r->by_pid[id % REGISTRY_BUCKETS]; p; p = p->hnext)
        if (p->id == id) return p;
    return NULL;
}

struct worker *registry_stage_worker(registry *r, const struct pipeline *p, uint32_t s) {
    (void)r;
    return s < p->stage_count ? p->stage[s] : NULL;
}

static struct pipeline *registry_pipeline_new(registry *r, uint32_t id, uint32_t stages, bool auto_placed) {
    if (r->n_pipes == r->cap_pipes) {
        size_t cap = r->cap_pipes ? r->cap_pipes * 2 : 8;
        struct pipeline **p = realloc(r->pipes, cap * sizeof *p);
        if (!p) return NULL;
        r->pipes = p;
        r->cap_pipes = cap;
    }
    struct pipeline *p = calloc(1, sizeof *p);
    if (!p) return NULL;
    p->id = id;
    p->stage_count = stages;
    p->auto_placed = auto_placed;
    p->epoch = ++r->epoch;
    r->pipes[r->n_pipes++] = p;
    p->hnext = r->by_pid[id % REGISTRY_BUCKETS];
    r->by_pid[id % REGISTRY_BUCKETS] = p;
    return p;
}

static void registry_pipeline_remove(registry *r, struct pipeline *p) {
    for (struct pipeline **pp = &r->by_pid[p->id % REGISTRY_BUCKETS]; *pp; pp = &(*pp)->hnext)
        if (*pp == p) {
            *pp = p->hnext;
            break;
        }
    for (size_t i = 0; i < r->n_pipes; i++)
        if (r->pipes[i] == p) {
            r->pipes[i] = r->pipes[--r->n_pipes];
            break;
        }
    free(p);
}

/* Takes w out of its pipeline slot (if it holds one). */
static void registry_unslot(registry *r, struct worker *w) {
    struct pipeline *p = registry_pipeline_find(r, w->pipeline_id);
    if (p && w->stage_index < p->stage_count && p->stage[w->stage_index] == w) {
        p->stage[w->stage_index] = NULL;
        p->epoch = ++r->epoch;
    }
}

static void registry_worker_remove(registry *r, struct worker *w) {
    registry_unslot(r, w);
    for (struct worker **pp = &r->by_id[registry_hash(w->id)]; *pp; pp = &(*pp)->hnext)
        if (*pp == w) {
            *pp = w->hnext;
            break;
        }
    for (size_t i = 0; i < r->n_workers; i++)
        if (r->workers[i] == w) {
            r->workers[i] = r->workers[--r->n_workers];
            break;
        }
    free(w);
}

static bool registry_slot_free(const struct pipeline *p, uint32_t s, const struct worker *self) {
    const struct worker *o = p->stage[s];
    return !o || o == self || o->state == WORKER_LOST;
}

static void registry_copy(char *dst, size_t size, const char *src) {
    snprintf(dst, size, "%s", src ? src : "");
}

size_t registry_n_gpu_stages(const registry *r) {
    size_t n = 0;
    for (size_t i = 0; i < r->n_pipes; i++) {
        const struct pipeline *p = r->pipes[i];
        for (uint32_t s = 0; s < p->stage_count; s++) {
            const struct worker *w = p->stage[s];
            if (w && w->state != WORKER_LOST && w->state != WORKER_FAILED && strcmp(w->backend, "cuda") == 0) n++;
        }
    }
    return n;
}

bool registry_pipeline_whole(const registry *r, struct pipeline *p) {
    p->problem[0] = '\0';
    uint32_t bs = 0, next = 0;
    for (uint32_t s = 0; s < p->stage_count; s++) {
        const struct worker *w = p->stage[s];
        if (!w || w->state == WORKER_LOST || w->state == WORKER_FAILED) return false;
    }
    for (uint32_t s = 0; s < p->stage_count; s++) {
        const struct worker *w = p->stage[s];
        if (w->layer_first != next) {
            snprintf(p->problem, sizeof p->problem,
                     "pipeline %u: stage %u (worker %s) starts at layer %u, expected %u", p->id, s,
                     w->id, w->layer_first, next);
            return false;
        }
        next = w->layer_end;
        if (s == 0) bs = w->kv_block_size;
        else if (w->kv_block_size != bs) {
            snprintf(p->problem, sizeof p->problem,
                     "pipeline %u: stage %u (worker %s) has KV blocks of %u tokens, stage 0 of %u",
                     p->id, s, w->id, w->kv_block_size, bs);
            return false;
        }
    }
    if ((int32_t)next != r->cfg.model->n_layers) {
        snprintf(p->problem, sizeof p->problem, "pipeline %u: stages end at layer %u, model %s has %d",
                 p->id, next, r->cfg.model->id, r->cfg.model->n_layers);
        return false;
    }
    return true;
}

bool registry_pipeline_ready(const registry *r, struct pipeline *p) {
    if (!registry_pipeline_whole(r, p)) return false;
    for (uint32_t s = 0; s < p->stage_count; s++)
        if (p->stage[s]->state != WORKER_READY) return false;
    return true;
}

bool registry_pipeline_draining(const registry *r, const struct pipeline *p) {
    (void)r;
    if (p->drain) return true;
    for (uint32_t s = 0; s < p->stage_count; s++)
        if (p->stage[s] && p->stage[s]->state == WORKER_DRAINING) return true;
    return false;
}

uint32_t registry_pipeline_kv_blocks(const registry *r, const struct pipeline *p) {
    (void)r;
    uint32_t n = 0;
    for (uint32_t s = 0; s < p->stage_count; s++) {
        const struct worker *w = p->stage[s];
        if (w && (n == 0 || w->kv_block_count < n)) n = w->kv_block_count;
    }
    return n;
}

static uint32_t registry_min_nonzero(uint32_t a, uint32_t b) {
    return a == 0 ? b : b == 0 ? a : a < b ? a : b;
}

uint32_t registry_pipeline_step_tokens(const registry *r, const struct pipeline *p) {
    (void)r;
    uint32_t n = 0;
    for (uint32_t s = 0; s < p->stage_count; s++)
        if (p->stage[s]) n = registry_min_nonzero(n, p->stage[s]->max_step_tokens);
    return n;
}

uint32_t registry_pipeline_step_seqs(const registry *r, const struct pipeline *p) {
    (void)r;
    uint32_t n = 0;
    for (uint32_t s = 0; s < p->stage_count; s++)
        if (p->stage[s]) n = registry_min_nonzero(n, p->stage[s]->max_step_seqs);
    return n;
}

uint32_t registry_pipeline_block_size(const registry *r, const struct pipeline *p) {
    (void)r;
    return p->stage_count && p->stage[0] ? p->stage[0]->kv_block_size : 0;
}

#define REG_REFUSE(c, ...)                      \
    do {                                        \
        *code = (c);                            \
        snprintf(err, errlen, __VA_ARGS__);     \
        return STATUS_BAD_INPUT;                \
    } while (0)

int registry_register(registry *r, const Llm__Register *m, const void *ident, size_t ident_len,
                      int64_t now_ms, struct worker **wout, struct pipeline **pout, bool *reformed,
                      Llm__Error__Code *code, char *err, size_t errlen) {
    *wout = NULL;
    *pout = NULL;
    *reformed = false;
    *code = LLM__ERROR__CODE__OK;
    const struct modelinfo *mi = r->cfg.model;
    const char *id = m->worker_id ? m->worker_id : "";
    size_t idlen = strlen(id);
    if (idlen == 0 || idlen > REGISTRY_ID_MAX)
        REG_REFUSE(LLM__ERROR__CODE__INVALID_ARGUMENT,
                   "register: worker_id has %zu bytes, must have 1..%d", idlen, REGISTRY_ID_MAX);
    if (ident_len > sizeof((struct worker *)0)->ident)
        REG_REFUSE(LLM__ERROR__CODE__INVALID_ARGUMENT, "register %s: routing id of %zu bytes", id,
                   ident_len);
    if (m->stage_count > REGISTRY_STAGES_MAX)
        REG_REFUSE(LLM__ERROR__CODE__INVALID_ARGUMENT,
                   "register %s: stage_count = %u is above %d", id, m->stage_count,
                   REGISTRY_STAGES_MAX);
    if (m->stage_count > 0 && m->stage_index >= m->stage_count)
        REG_REFUSE(LLM__ERROR__CODE__INVALID_ARGUMENT,
                   "register %s: stage_index = %u is not below stage_count = %u", id,
                   m->stage_index, m->stage_count);
    if (m->stage_count > (uint32_t)mi->n_layers)
        REG_REFUSE(LLM__ERROR__CODE__INVALID_ARGUMENT,
                   "register %s: stage_count = %u is above the model's %d layers", id,
                   m->stage_count, mi->n_layers);
    if (m->kv_block_count < 1 || m->kv_block_size < 1)
        REG_REFUSE(LLM__ERROR__CODE__INVALID_ARGUMENT,
                   "register %s: kv_block_count = %u, kv_block_size = %u: both must be at least 1",
                   id, m->kv_block_count, m->kv_block_size);
    if (m->layer_end > 0 && (m->layer_first >= m->layer_end || m->layer_end > (uint32_t)mi->n_layers))
        REG_REFUSE(LLM__ERROR__CODE__INVALID_ARGUMENT,
                   "register %s: layers [%u, %u) are not a range inside the model's %d layers", id,
                   m->layer_first, m->layer_end, mi->n_layers);
    if (m->model && m->model[0]) {
        char base[128];
        modelinfo_basename(m->model, base, sizeof base);
        if (strcmp(base, mi->id) != 0)
            REG_REFUSE(LLM__ERROR__CODE__FAILED_PRECONDITION,
                       "register %s: model \"%s\" is not the router's model \"%s\"", id, base,
                       mi->id);
    }

    struct worker *w = registry_worker_find(r, id);
    if (w && w->incarnation == m->incarnation && w->state != WORKER_LOST &&
        (m->session == 0 || m->session == w->session)) {
        /* The same process again (a resend): same placement, same epoch. */
        memcpy(w->ident, ident, ident_len);
        w->ident_len = ident_len;
        w->last_seen_ms = now_ms;
        *wout = w;
        *pout = registry_pipeline_find(r, w->pipeline_id);
        return STATUS_OK;
    }

    /* The same live process on a new connection: its old one broke, and
     * a plan or a result on it may be lost (nothing else would tell), so
     * it is placed again like a restarted worker: its pipeline re-forms in
     * a new epoch and its sequences start over. */
    if (w && w->incarnation == m->incarnation && w->state != WORKER_LOST)
        LOG(LL_WARN, "worker %s (stage %u of pipeline %u) registers on a new connection (session %u, "
            "was %u): what the old one carried may be lost: its pipeline re-forms", id, w->stage_index,
            w->pipeline_id, m->session, w->session);

    /* Placement. */
    struct pipeline *p = NULL;
    uint32_t si = 0;
    if (m->stage_count > 0) {
        p = registry_pipeline_find(r, m->pipeline_id);
        if (p && p->stage_count != m->stage_count)
            REG_REFUSE(LLM__ERROR__CODE__FAILED_PRECONDITION,
                       "register %s: pipeline %u has %u stages, the worker says %u", id,
                       m->pipeline_id, p->stage_count, m->stage_count);
        si = m->stage_index;
        if (p && !registry_slot_free(p, si, w)) {
            /* Not final: a replacement may start before the holder is lost. */
            *code = LLM__ERROR__CODE__ALREADY_EXISTS;
            snprintf(err, errlen, "register %s: stage %u of pipeline %u is held by worker %s", id, si,
                     m->pipeline_id, p->stage[si]->id);
            return STATUS_EXHAUSTED;
        }
    } else {
        /* Back into its old slot if it is free, else the first free slot of
         * a self-placed pipeline, else a new pipeline. */
        struct pipeline *old = w ? registry_pipeline_find(r, w->pipeline_id) : NULL;
        if (old && old->auto_placed && w->stage_index < old->stage_count &&
            registry_slot_free(old, w->stage_index, w)) {
            p = old;
            si = w->stage_index;
        }
        for (size_t i = 0; !p && i < r->n_pipes; i++) {
            struct pipeline *q = r->pipes[i];
            if (!q->auto_placed) continue;
            for (uint32_t s = 0; s < q->stage_count; s++)
                if (registry_slot_free(q, s, w)) {
                    p = q;
                    si = s;
                    break;
                }
        }
    }
    uint32_t stage_count = m->stage_count > 0 ? m->stage_count : r->cfg.auto_stages;
    if (stage_count > (uint32_t)mi->n_layers)
        REG_REFUSE(LLM__ERROR__CODE__FAILED_PRECONDITION,
                   "register %s: %u stages per pipeline for a model of %d layers", id, stage_count,
                   mi->n_layers);
    uint32_t first = m->layer_first, end = m->layer_end;
    if (end == 0) {
        int32_t f[REGISTRY_STAGES_MAX], e[REGISTRY_STAGES_MAX];
        char serr[256];
        if (modelinfo_split(mi, (int32_t)stage_count, f, e, serr, sizeof serr) < 0)
            REG_REFUSE(LLM__ERROR__CODE__FAILED_PRECONDITION, "register %s: %s", id, serr);
        first = (uint32_t)f[si];
        end = (uint32_t)e[si];
    }

    if (!w) {
        if (r->n_workers == r->cap_workers) {
            size_t cap = r->cap_workers ? r->cap_workers * 2 : 8;
            struct worker **ws = realloc(r->workers, cap * sizeof *ws);
            if (!ws) REG_REFUSE(LLM__ERROR__CODE__INTERNAL, "register %s: out of memory", id);
            r->workers = ws;
            r->cap_workers = cap;
        }
        w = calloc(1, sizeof *w);
        if (!w) REG_REFUSE(LLM__ERROR__CODE__INTERNAL, "register %s: out of memory", id);
        r->workers[r->n_workers++] = w;
        registry_copy(w->id, sizeof w->id, id);
        uint32_t b = registry_hash(w->id);
        w->hnext = r->by_id[b];
        r->by_id[b] = w;
    } else {
        registry_unslot(r, w);
    }
    if (!p) {
        uint32_t pid = m->pipeline_id;
        if (m->stage_count == 0) {
            pid = 0;
            for (size_t i = 0; i < r->n_pipes; i++)
                if (r->pipes[i]->id >= pid) pid = r->pipes[i]->id + 1;
        }
        p = registry_pipeline_new(r, pid, stage_count, m->stage_count == 0);
        if (!p) {
            registry_worker_remove(r, w);
            REG_REFUSE(LLM__ERROR__CODE__INTERNAL, "register %s: out of memory", id);
        }
    }
    struct worker *o = p->stage[si];
    if (o && o != w) registry_worker_remove(r, o); /* a lost worker's slot */

    w->incarnation = m->incarnation;
    w->session = m->session;
    memcpy(w->ident, ident, ident_len);
    w->ident_len = ident_len;
    w->pipeline_id = p->id;
    w->stage_index = si;
    w->stage_count = p->stage_count;
    w->layer_first = first;
    w->layer_end = end;
    registry_copy(w->model, sizeof w->model, m->model);
    registry_copy(w->backend, sizeof w->backend, m->backend);
    registry_copy(w->device, sizeof w->device, m->device);
    registry_copy(w->host, sizeof w->host, m->host);
    registry_copy(w->stage_endpoint, sizeof w->stage_endpoint, m->stage_endpoint);
    registry_copy(w->draft_model, sizeof w->draft_model, m->draft_model);
    w->pid = m->pid;
    w->kv_block_count = m->kv_block_count;
    w->kv_block_size = m->kv_block_size;
    w->device_memory_bytes = m->device_memory_bytes;
    w->max_step_tokens = m->max_step_tokens;
    w->max_step_seqs = m->max_step_seqs;
    w->state = WORKER_STARTING;
    w->last_seen_ms = now_ms;
    w->error[0] = '\0';
    p->stage[si] = w;
    p->epoch = ++r->epoch;
    p->announce = registry_pipeline_whole(r, p);
    *reformed = true;
    *wout = w;
    *pout = p;
    LOG(LL_INFO, "worker %s (incarnation %llu, %s %s) is stage %u/%u of pipeline %u, layers [%u, %u), %u KV blocks of %u; epoch %llu",
        w->id, (unsigned long long)w->incarnation, w->backend, w->device, si, p->stage_count, p->id,
        first, end, w->kv_block_count, w->kv_block_size, (unsigned long long)p->epoch);
    return STATUS_OK;
}

int registry_heartbeat(registry *r, const Llm__Heartbeat *m, int64_t now_ms, struct worker **wout) {
    *wout = NULL;
    struct worker *w = m->worker_id ? registry_worker_find(r, m->worker_id) : NULL;
    if (!w || w->incarnation != m->incarnation || w->state == WORKER_LOST) return STATUS_NOT_FOUND;
    w->last_seen_ms = now_ms;
    switch (m->state) {
    case LLM__HEARTBEAT__STATE__READY: w->state = WORKER_READY; break;
    case LLM__HEARTBEAT__STATE__DRAINING: w->state = WORKER_DRAINING; break;
    case LLM__HEARTBEAT__STATE__FAILED: w->state = WORKER_FAILED; break;
    default: w->state = WORKER_STARTING; break;
    }
    if (m->error && m->error->message && m->error->message[0])
        registry_copy(w->error, sizeof w->error, m->error->message);
    w->last_step_id = m->last_step_id;
    w->kv_used = m->kv_blocks_used;
    w->kv_total = m->kv_blocks_total;
    w->steps_total = m->steps_total;
    w->tokens_total = m->tokens_total;
    *wout = w;
    return STATUS_OK;
}

void registry_pipeline_bump(registry *r, struct pipeline *p) {
    p->epoch = ++r->epoch;
    p->announce = registry_pipeline_whole(r, p);
}

void registry_mark_lost(registry *r, struct worker *w) {
    if (w->state == WORKER_LOST) return;
    /* A worker that drained and then went (its key deleted on exit, or
     * silent) was removed, not broken: nothing waits for it to come back,
     * so its pipeline leaves Status as soon as its last stage goes. */
    w->left = w->state == WORKER_DRAINING;
    w->state = WORKER_LOST;
    struct pipeline *p = registry_pipeline_find(r, w->pipeline_id);
    if (p) p->epoch = ++r->epoch;
}

void registry_worker_unreachable(registry *r, struct worker *w, bool bump) {
    if (w->state == WORKER_LOST) return;
    if (w->state == WORKER_READY) w->state = WORKER_STARTING;
    struct pipeline *p = registry_pipeline_find(r, w->pipeline_id);
    if (p && bump) registry_pipeline_bump(r, p);
}

int registry_expire(registry *r, int64_t now_ms, void (*drop)(struct pipeline *p, void *ud),
                    void *ud) {
    int n = 0;
    for (size_t i = 0; i < r->n_workers;) {
        struct worker *w = r->workers[i];
        int64_t age = now_ms - w->last_seen_ms;
        if (w->state != WORKER_LOST && age > r->cfg.worker_timeout_ms) {
            LOG(LL_WARN, "worker %s (stage %u of pipeline %u): no heartbeat for %lld ms: lost",
                w->id, w->stage_index, w->pipeline_id, (long long)age);
            registry_mark_lost(r, w);
            n++;
        }
        if (w->state == WORKER_LOST && (w->left || (r->cfg.forget_ms > 0 && age > r->cfg.forget_ms))) {
            registry_worker_remove(r, w); /* moves the last worker into slot i */
            continue;
        }
        i++;
    }
    for (size_t i = 0; i < r->n_pipes;) {
        struct pipeline *p = r->pipes[i];
        bool empty = true;
        for (uint32_t s = 0; s < p->stage_count; s++) empty = empty && !p->stage[s];
        if (empty) {
            if (drop) drop(p, ud);
            registry_pipeline_remove(r, p);
            continue;
        }
        i++;
    }
    return n;
}
