/* The worker's metric families, their updates from the compute thread, and
 * the refresh and /ready answers the metrics port asks for. */
#include "node_metrics.h"
#include "node-impl.h"

#include <stdatomic.h>
#include <stdio.h>
#include <stdlib.h>

#include "common/status.h"

/* Seconds: a step takes from well under a millisecond (a small model) to
 * seconds (a long prefill on a big one); a send is a copy or a network hop. */
static const double step_bounds[] = {0.0005, 0.001, 0.002, 0.005, 0.01, 0.02, 0.05,
                                     0.1,    0.2,   0.5,   1,     2,    5,    10};
static const double send_bounds[] = {0.00005, 0.0001, 0.00025, 0.0005, 0.001, 0.0025, 0.005,
                                     0.01,    0.025,  0.05,    0.1,    0.5,   1};

/* Seconds: one constrained sequence's token mask, tens of microseconds on a
 * 32k vocabulary, a few milliseconds for a cold state of a large grammar. */
static const double mask_bounds[] = {0.00001, 0.000025, 0.00005, 0.0001, 0.00025, 0.0005,
                                     0.001,   0.0025,   0.005,   0.01,   0.05};

static const char *const stage_label[] = {"stage", NULL};
static const char *const reason_label[] = {"reason", NULL};

struct node_metrics {
    metrics *reg;
    metrics_family *step_f, *send_f, *mem_used_f, *mem_cap_f;
    metrics_series *kv_used, *kv_cap, *steps, *tokens;
    metrics_series *link_dropped[LINK_DROP_N]; /* by enum link_drop */
    metrics_series *mask_time, *replays, *replayed_tokens; /* constrained decoding (last stage) */
    /* The compute thread's series for the stage it serves (it can be
     * placed on another stage, which gets series of its own). */
    int32_t stage;
    metrics_series *step, *send, *mem_used, *mem_cap;
    /* The port's thread: the node's totals when last added. */
    uint64_t steps_mark, tokens_mark;
    _Atomic(node *) n;
};

int node_metrics_init(node_metrics **out, char *err, size_t errlen) {
    *out = NULL;
    node_metrics *nm = calloc(1, sizeof *nm);
    if (!nm || metrics_init(&nm->reg) < 0) {
        free(nm);
        snprintf(err, errlen, "worker metrics: out of memory");
        return STATUS_NO_MEMORY;
    }
    nm->stage = -1;
    atomic_init(&nm->n, NULL);
    const struct metrics_def defs[] = {
        {.type = METRICS_HISTOGRAM, .name = "llm_step_time_seconds",
         .help = "Time to execute one step plan on this stage: its inputs, the layers' computation and its output sent.",
         .labels = stage_label, .bounds = step_bounds,
         .n_bounds = (int)(sizeof step_bounds / sizeof step_bounds[0])},
        {.type = METRICS_HISTOGRAM, .name = "llm_link_send_time_seconds",
         .help = "Time to send one step's hidden states to the next stage.", .labels = stage_label,
         .bounds = send_bounds, .n_bounds = (int)(sizeof send_bounds / sizeof send_bounds[0])},
        {.type = METRICS_GAUGE, .name = "llm_device_memory_used_bytes",
         .help = "Memory in use on this worker's device (the GPU, or the host on the CPU backend), "
                 "by every process.",
         .labels = stage_label},
        {.type = METRICS_GAUGE, .name = "llm_device_memory_capacity_bytes",
         .help = "Memory of this worker's device (the GPU, or the host on the CPU backend).",
         .labels = stage_label},
        {.type = METRICS_GAUGE, .name = "llm_stage_kv_blocks_used",
         .help = "KV blocks this stage holds for sequences of the router's current epoch (a shared block once)."},
        {.type = METRICS_GAUGE, .name = "llm_stage_kv_blocks_capacity",
         .help = "KV blocks of this stage's cache."},
        {.type = METRICS_COUNTER, .name = "llm_stage_steps_total", .help = "Step plans executed."},
        {.type = METRICS_COUNTER, .name = "llm_stage_tokens_total",
         .help = "Token rows processed by this stage (prefill and decode)."},
        {.type = METRICS_COUNTER, .name = "llm_stage_link_frames_dropped_total",
         .help = "Messages the link from the previous stage dropped instead of failing a step: "
                 "malformed (not a link message), stale (an older epoch or step), ahead (too far "
                 "ahead, or a later epoch's replaced).",
         .labels = reason_label},
        {.type = METRICS_HISTOGRAM, .name = "llm_constrain_mask_time_seconds",
         .help = "Time the last stage took to compute one constrained sequence's token mask "
                 "(after the step's ops are queued, before its rows are sampled).",
         .bounds = mask_bounds, .n_bounds = (int)(sizeof mask_bounds / sizeof mask_bounds[0])},
        {.type = METRICS_COUNTER, .name = "llm_constrain_replays_total",
         .help = "Parse states of constrained sequences rebuilt from their generated tokens "
                 "(a resumed, restarted or moved sequence)."},
        {.type = METRICS_COUNTER, .name = "llm_constrain_replayed_tokens_total",
         .help = "Generated tokens replayed through a grammar to rebuild those parse states."},
    };
    metrics_family *f[sizeof defs / sizeof defs[0]];
    for (size_t i = 0; i < sizeof defs / sizeof defs[0]; i++) {
        int rc = metrics_family_new(nm->reg, &defs[i], &f[i], err, errlen);
        if (rc < 0) {
            node_metrics_free(nm);
            return rc == STATUS_NO_MEMORY ? rc : STATUS_INTERNAL;
        }
    }
    nm->step_f = f[0];
    nm->send_f = f[1];
    nm->mem_used_f = f[2];
    nm->mem_cap_f = f[3];
    nm->kv_used = metrics_series_get(f[4], NULL);
    nm->kv_cap = metrics_series_get(f[5], NULL);
    nm->steps = metrics_series_get(f[6], NULL);
    nm->tokens = metrics_series_get(f[7], NULL);
    for (int r = 0; r < LINK_DROP_N; r++) {
        const char *values[] = {link_drop_name((enum link_drop)r)};
        nm->link_dropped[r] = metrics_series_get(f[8], values); /* shown at 0 from the start */
    }
    nm->mask_time = metrics_series_get(f[9], NULL);
    nm->replays = metrics_series_get(f[10], NULL);
    nm->replayed_tokens = metrics_series_get(f[11], NULL);
    *out = nm;
    return STATUS_OK;
}

void node_metrics_free(node_metrics *nm) {
    if (!nm) return;
    metrics_free(nm->reg);
    free(nm);
}

metrics *node_metrics_registry(node_metrics *nm) { return nm->reg; }

void node_metrics_attach(node_metrics *nm, node *n) {
    n->metrics = nm;
    size_t mem_free = 0, mem_total = 0;
    if (backend_mem_info(n->b, &mem_free, &mem_total) == 0 && mem_total >= mem_free)
        node_metrics_memory(nm, n->stage_index, mem_total - mem_free, mem_total);
    atomic_store(&nm->n, n);
}

void node_metrics_refresh(void *ud) {
    node_metrics *nm = ud;
    node *n = atomic_load(&nm->n);
    if (!n) return;
    metrics_gauge_set(nm->kv_used, (double)atomic_load(&n->kv_blocks_used));
    metrics_gauge_set(nm->kv_cap, (double)atomic_load(&n->kv_blocks_total));
    uint64_t steps = atomic_load(&n->steps_total), tokens = atomic_load(&n->tokens_total);
    if (steps > nm->steps_mark) metrics_counter_add(nm->steps, (double)(steps - nm->steps_mark));
    if (tokens > nm->tokens_mark) metrics_counter_add(nm->tokens, (double)(tokens - nm->tokens_mark));
    nm->steps_mark = steps;
    nm->tokens_mark = tokens;
}

const char *node_metrics_ready(void *ud, char *buf, size_t size) {
    node_metrics *nm = ud;
    node *n = atomic_load(&nm->n);
    if (!n) return "loading the model";
    switch (atomic_load(&n->state)) {
    case LLM__HEARTBEAT__STATE__READY: return NULL;
    case LLM__HEARTBEAT__STATE__DRAINING: return "draining";
    case LLM__HEARTBEAT__STATE__FAILED:
        snprintf(buf, size, "failed (see the log)");
        return buf;
    default:
        if (atomic_load(&n->router_refused)) {
            snprintf(buf, size, "the router refused this worker's key %s (see the log)", n->kp.pub);
            return buf;
        }
        return "not yet registered and placed in a pipeline with its links up";
    }
}

/* The compute thread's series for stage: looked up again only when the
 * worker serves another stage. */
static int use_stage(node_metrics *nm, int32_t stage) {
    if (stage == nm->stage && nm->step) return 1;
    char v[16];
    snprintf(v, sizeof v, "%d", (int)stage);
    const char *values[] = {v};
    nm->step = metrics_series_get(nm->step_f, values);
    nm->send = metrics_series_get(nm->send_f, values);
    nm->mem_used = metrics_series_get(nm->mem_used_f, values);
    nm->mem_cap = metrics_series_get(nm->mem_cap_f, values);
    nm->stage = stage;
    return nm->step && nm->send && nm->mem_used && nm->mem_cap;
}

void node_metrics_step(node_metrics *nm, int32_t stage_index, double seconds) {
    if (nm && use_stage(nm, stage_index)) metrics_histogram_observe(nm->step, seconds);
}

void node_metrics_link_send(node_metrics *nm, int32_t stage_index, double seconds) {
    if (nm && use_stage(nm, stage_index)) metrics_histogram_observe(nm->send, seconds);
}

void node_metrics_link_dropped(node_metrics *nm, enum link_drop why, uint64_t n) {
    if (nm && (unsigned)why < LINK_DROP_N && nm->link_dropped[why])
        metrics_counter_add(nm->link_dropped[why], (double)n);
}

void node_metrics_memory(node_metrics *nm, int32_t stage_index, uint64_t used, uint64_t total) {
    if (!nm || !use_stage(nm, stage_index)) return;
    metrics_gauge_set(nm->mem_used, (double)used);
    metrics_gauge_set(nm->mem_cap, (double)total);
}

void node_metrics_constrain_mask(node_metrics *nm, double seconds) {
    if (nm && nm->mask_time) metrics_histogram_observe(nm->mask_time, seconds);
}

void node_metrics_constrain_replay(node_metrics *nm, uint64_t n_tokens) {
    if (!nm || !nm->replays) return;
    metrics_counter_inc(nm->replays);
    metrics_counter_add(nm->replayed_tokens, (double)n_tokens);
}
