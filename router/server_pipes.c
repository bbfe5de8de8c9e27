/* Pipelines: each one's scheduler kept in line with the registry (in
 * service, torn down, re-formed), queued requests assigned to the least
 * loaded one, and step plans sent to every stage. */
#include "router/server-impl.h"
#include "router/server_metrics.h"

#include <errno.h>
#include <inttypes.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>
#include <unistd.h>
#include <zmq.h>

#include "common/log.h"
#include "common/status.h"

static void pipe_requeue_all(server *s, struct pipe *pp) {
    for (struct req *q = s->all; q; q = q->next) {
        if (q->pipe != pp || q->state != REQ_ASSIGNED) continue;
        if (q->seq) req_seq_del(s, q);
        q->seq = NULL;
        q->pipe = NULL;
        q->step = 0;
        if (req_queue_push(s, q) < 0)
            req_end(s, q, LLM__GENERATE_DONE__FINISH_REASON__ERROR, -1, NULL, LLM__ERROR__CODE__INTERNAL,
                    "router out of memory re-queueing");
    }
}

static void pipe_teardown(server *s, struct pipe *pp, const char *why) {
    if (!pp->sched) return;
    struct sched_stats st;
    sched_get_stats(pp->sched, &st);
    LOG(LL_WARN, "pipeline %u out of service (%s): %d running and %d waiting sequences re-queued",
        pp->p ? pp->p->id : 0, why, st.n_running, st.n_waiting);
    pipe_requeue_all(s, pp);
    sched_free(pp->sched);
    pp->sched = NULL;
    pp->n_flights = 0;
}

void pipe_free(struct pipe *pp) {
    if (!pp) return;
    for (int32_t i = 0; i < pp->max_flights; i++) {
        free(pp->flights[i].seq_ids);
        free(pp->flights[i].want);
    }
    free(pp->flights);
    free(pp->seqplans);
    free(pp->seqptrs);
    free(pp->copies);
    free(pp->copyptrs);
    free(pp);
}

void pipe_on_drop(struct pipeline *p, void *ud) {
    server *s = ud;
    struct pipe *pp = p->ud;
    if (!pp) return;
    for (size_t i = 0; pp->touched && i < s->n_pipes_touched; i++)
        if (s->pipes_touched[i] == pp) {
            s->pipes_touched[i] = s->pipes_touched[--s->n_pipes_touched];
            pp->touched = false;
        }
    pipe_teardown(s, pp, "all its workers are gone");
    pipe_free(pp);
    p->ud = NULL;
}

static struct pipe *pipe_of(server *s, struct pipeline *p) {
    (void)s;
    if (p->ud) return p->ud;
    struct pipe *pp = calloc(1, sizeof *pp);
    if (!pp) return NULL;
    pp->p = p;
    pp->max_flights = (int32_t)p->stage_count;
    pp->flights = calloc((size_t)pp->max_flights, sizeof *pp->flights);
    if (!pp->flights) {
        pipe_free(pp);
        return NULL;
    }
    p->ud = pp;
    return pp;
}

/* Makes max_batch the pipeline's limit of running sequences, with plan
 * packing buffers for at least that many (a step never carries more): they
 * grow, and are kept when it shrinks.  STATUS_NO_MEMORY leaves the limit
 * as it was. */
static int pipe_size(struct pipe *pp, int32_t max_batch) {
    if (max_batch <= pp->max_batch) {
        pp->max_batch = max_batch;
        return STATUS_OK;
    }
    size_t n = (size_t)max_batch;
    Llm__SeqPlan *sp = realloc(pp->seqplans, n * sizeof *sp);
    if (sp) pp->seqplans = sp;
    Llm__SeqPlan **spp = sp ? realloc(pp->seqptrs, n * sizeof *spp) : NULL;
    if (spp) pp->seqptrs = spp;
    Llm__BlockCopy *cp = spp ? realloc(pp->copies, n * sizeof *cp) : NULL;
    if (cp) pp->copies = cp;
    Llm__BlockCopy **cpp = cp ? realloc(pp->copyptrs, n * sizeof *cpp) : NULL;
    if (cpp) pp->copyptrs = cpp;
    bool ok = cpp != NULL;
    for (int32_t i = 0; ok && i < pp->max_flights; i++) {
        uint64_t *ids = realloc(pp->flights[i].seq_ids, n * sizeof *ids);
        if (ids) pp->flights[i].seq_ids = ids;
        bool *want = ids ? realloc(pp->flights[i].want, n * sizeof *want) : NULL;
        if (want) pp->flights[i].want = want;
        ok = want != NULL;
    }
    if (!ok) return STATUS_NO_MEMORY;
    pp->max_batch = max_batch;
    return STATUS_OK;
}

/* A pipeline's step and batch limits from what its stages state in
 * Register and the router's flags.  A stage refuses a step beyond what it
 * stated, so the flags --step-tokens and --max-step-seqs can only lower
 * those; --max-batch replaces the running-sequence limit, which is
 * otherwise one full step per stage: as many micro-batches in flight as
 * stages, each of the size the stages chose for their memory.  how says
 * where each number came from. */
static void pipe_limits(const server *s, const struct pipeline *p, int32_t *step_tokens,
                        int32_t *step_seqs, int32_t *max_batch, char *how, size_t how_len) {
    uint32_t wt = registry_pipeline_step_tokens(s->reg, p), wsq = registry_pipeline_step_seqs(s->reg, p);
    int32_t ft = s->cfg.step_tokens, fsq = s->cfg.max_step_seqs, fb = s->cfg.max_batch;
    const char *t_how, *sq_how, *b_how;
    if (ft > 0 && (wt == 0 || (uint32_t)ft < wt)) *step_tokens = ft, t_how = "--step-tokens";
    else if (wt > 0) *step_tokens = (int32_t)wt, t_how = "as the stages state";
    else *step_tokens = 512, t_how = "default, no stage states one";
    if (fsq > 0 && (wsq == 0 || (uint32_t)fsq < wsq)) *step_seqs = fsq, sq_how = "--max-step-seqs";
    else if (wsq > 0) *step_seqs = (int32_t)wsq, sq_how = "as the stages state";
    else *step_seqs = 0, sq_how = "no limit";
    if (fb > 0) *max_batch = fb, b_how = "--max-batch";
    else if (*step_seqs > 0) *max_batch = (int32_t)p->stage_count * *step_seqs, b_how = "stages x sequences a step";
    else *max_batch = 64, b_how = "default, no stage states sequences a step";
    snprintf(how, how_len, "steps of %d tokens (%s) and %d sequences (%s), %d running (%s)",
             *step_tokens, t_how, *step_seqs, sq_how, *max_batch, b_how);
}

/* Tells every stage of a whole pipeline its placement, neighbours and the
 * new epoch. */
static void pipe_announce(server *s, struct pipeline *p) {
    for (uint32_t st = 0; st < p->stage_count; st++) {
        struct worker *w = p->stage[st];
        if (!w) continue;
        Llm__RegisterReply rr = LLM__REGISTER_REPLY__INIT;
        rr.worker_id = w->id;
        rr.accepted = true;
        rr.heartbeat_interval_ms = (uint32_t)s->cfg.heartbeat_ms;
        rr.pipeline_id = p->id;
        rr.stage_index = st;
        rr.stage_count = p->stage_count;
        rr.layer_first = w->layer_first;
        rr.layer_end = w->layer_end;
        rr.prev_stage_endpoint = st > 0 && p->stage[st - 1] ? p->stage[st - 1]->stage_endpoint : "";
        rr.next_stage_endpoint = st + 1 < p->stage_count && p->stage[st + 1] ? p->stage[st + 1]->stage_endpoint : "";
        rr.prev_stage_key = st > 0 && p->stage[st - 1] ? p->stage[st - 1]->key : "";
        rr.next_stage_key = st + 1 < p->stage_count && p->stage[st + 1] ? p->stage[st + 1]->key : "";
        rr.epoch = p->epoch;
        rr.pipeline_whole = true;
        Llm__WorkerEnvelope env = LLM__WORKER_ENVELOPE__INIT;
        env.body_case = LLM__WORKER_ENVELOPE__BODY_REGISTER_REPLY;
        env.register_reply = &rr;
        if (server_send_worker_env(s, w->ident, w->ident_len, &env) < 0) {
            /* It learns the epoch from its next Register, or from the
             * plans; until it is heard from, the pipeline does not serve. */
            LOG(LL_WARN, "pipeline %u: epoch %llu not announced to stage %u (worker %s): %s: the "
                "pipeline serves once the worker is heard from again", p->id, (unsigned long long)p->epoch,
                st, w->id, zio_errstr(s->ws));
            registry_worker_unreachable(s->reg, w, false);
        }
    }
    LOG(LL_INFO, "pipeline %u: %u stages whole, epoch %llu announced", p->id, p->stage_count,
        (unsigned long long)p->epoch);
}

/* What the stage k of pp was sent could not be queued (server_send_worker:
 * its connection is gone, or full).  A step it misses never finishes, and
 * a free it misses leaves it holding blocks: the pipeline leaves service
 * and re-forms in a new epoch (every stage forgets the old formation's
 * sequences, and they start over from their tokens), serving again once
 * the worker is heard from (it registers again on its new connection). */
static void pipe_unreachable(server *s, struct pipe *pp, uint32_t k, const char *what) {
    struct pipeline *p = pp->p;
    LOG(LL_WARN, "pipeline %u: %s not sent to stage %u (worker %s): %s: it re-forms and serves again "
        "once the worker is heard from", p->id, what, k, p->stage[k]->id, zio_errstr(s->ws));
    registry_worker_unreachable(s->reg, p->stage[k], true);
    s->loop_full = true;
}

/* Moves sequences waiting on pp (never admitted there, or preempted) back
 * to the queue when another pipeline in service has a free batch slot: a
 * pipeline that joined takes work without anything being restarted. */
static void rebalance(server *s, struct pipe *pp) {
    bool room = false;
    for (size_t i = 0; i < registry_n_pipelines(s->reg) && !room; i++) {
        struct pipe *o = registry_pipeline_at(s->reg, i)->ud;
        if (!o || o == pp || !o->sched) continue;
        struct sched_stats st;
        sched_get_stats(o->sched, &st);
        room = st.n_running + st.n_waiting < o->max_batch;
    }
    if (!room) return;
    uint64_t ids[64];
    int32_t n = sched_take_waiting(pp->sched, ids, 64);
    for (int32_t k = 0; k < n; k++) {
        struct req *q = req_by_seq(s, ids[k]);
        if (!q) continue;
        req_seq_del(s, q);
        q->seq = NULL;
        q->pipe = NULL;
        req_queue_push(s, q);
    }
}

void pipes_drain(server *s, struct pipeline *p, bool on) {
    if (p->drain == on) return;
    p->drain = on;
    s->loop_full = true; /* assignments and the gauges see it at once */
    struct pipe *pp = p->ud;
    struct sched_stats st = {0};
    if (pp && pp->sched) sched_get_stats(pp->sched, &st);
    int32_t moved = 0, n;
    uint64_t ids[64];
    while (on && pp && pp->sched && (n = sched_take_waiting(pp->sched, ids, 64)) > 0)
        for (int32_t k = 0; k < n; k++) {
            struct req *q = req_by_seq(s, ids[k]);
            if (!q) continue;
            req_seq_del(s, q);
            q->seq = NULL;
            q->pipe = NULL;
            req_queue_push(s, q);
            moved++;
        }
    if (on)
        LOG(LL_INFO, "pipeline %u: draining (an admin's Drain): no new work; %d running sequences finish here, "
            "%d waiting ones went back to the queue", p->id, st.n_running, moved);
    else
        LOG(LL_INFO, "pipeline %u: takes work again (an admin's Drain with resume)", p->id);
}

/* Brings each pipeline's scheduler in line with its registry state. */
void pipes_sync(server *s) {
    for (size_t i = 0; i < registry_n_pipelines(s->reg); i++) {
        struct pipeline *p = registry_pipeline_at(s->reg, i);
        struct pipe *pp = pipe_of(s, p);
        if (!pp) continue;
        if (p->announce) {
            p->announce = false;
            pipe_announce(s, p);
        }
        bool ready = registry_pipeline_ready(s->reg, p);
        if (p->problem[0] && strcmp(p->problem, pp->last_problem) != 0)
            LOG(LL_ERROR, "%s: it cannot serve until this is fixed", p->problem);
        snprintf(pp->last_problem, sizeof pp->last_problem, "%s", p->problem);
        if (pp->sched && !ready) pipe_teardown(s, pp, "a stage is not ready");
        else if (pp->sched && pp->epoch != p->epoch) pipe_teardown(s, pp, "re-formed");
        if (!pp->sched && ready) {
            int32_t step_tokens, step_seqs, max_batch;
            char how[320];
            pipe_limits(s, p, &step_tokens, &step_seqs, &max_batch, how, sizeof how);
            struct sched_config c = {(int32_t)registry_pipeline_kv_blocks(s->reg, p),
                                     (int32_t)registry_pipeline_block_size(s->reg, p),
                                     step_tokens, max_batch, (int32_t)p->stage_count,
                                     s->next_step_id, step_seqs};
            char err[256];
            if (pipe_size(pp, max_batch) < 0) {
                LOG(LL_ERROR, "pipeline %u: out of memory for plans of %d sequences", p->id, max_batch);
                continue;
            }
            if (sched_init(&pp->sched, &c, err, sizeof err) < 0) {
                LOG(LL_ERROR, "pipeline %u: %s", p->id, err);
                continue;
            }
            /* A fresh scheduler is a cold cache: what the workers' KV held
             * for another epoch (or another router) is never found. */
            if (!s->cfg.no_prefix_cache && sched_enable_prefix_cache(pp->sched, err, sizeof err) < 0)
                LOG(LL_WARN, "pipeline %u: serving without a prefix cache: %s", p->id, err);
            pp->epoch = p->epoch;
            pp->n_flights = 0;
            LOG(LL_INFO, "pipeline %u in service: %u stages, %d KV blocks of %d tokens, epoch %llu; %s",
                p->id, p->stage_count, c.n_blocks, c.block_size, (unsigned long long)p->epoch, how);
        }
        if (pp->sched) {
            /* Assigned sequences not yet admitted go where there is room. */
            struct sched_stats st;
            sched_get_stats(pp->sched, &st);
            if (st.n_waiting > 0 && s->n_queue == 0) rebalance(s, pp);
        }
    }
}

int32_t pipe_capacity_tokens(const struct pipe *pp) {
    struct sched_stats st;
    sched_get_stats(pp->sched, &st);
    return st.blocks_total * (int32_t)registry_pipeline_block_size(NULL, pp->p);
}

static int queue_cmp(const void *a, const void *b) {
    const struct req *x = *(struct req *const *)a, *y = *(struct req *const *)b;
    if (x->priority != y->priority) return x->priority > y->priority ? -1 : 1;
    return x->order < y->order ? -1 : x->order > y->order;
}

/* How far past the least loaded pipeline's load (running + waiting
 * sequences) a pipeline holding a request's longest cached prefix may be
 * and still get it: a quarter of its batch limit, at least 1. */
static int32_t prefix_slack(const struct pipe *pp) {
    return pp->max_batch / 4 > 1 ? pp->max_batch / 4 : 1;
}

/* The pipeline a choice of a request of n > 1 joins: that of a choice
 * of it already assigned (choice 0 first), so that the choices share the
 * prompt's KV blocks (docs/protocol.md, "Several choices"); NULL when none
 * is on a pipeline that takes work. */
static struct pipe *choice_pipe(server *s, const struct req *q) {
    for (uint32_t i = 0; q->n_choices > 1 && i < q->n_choices; i++) {
        if (i == q->choice) continue;
        char id[PROTO_REQUEST_KEY_MAX + 16]; /* room for any %u the compiler imagines */
        if (i == 0) snprintf(id, sizeof id, "%s", q->cid);
        else snprintf(id, sizeof id, "%s %u", q->cid, i);
        struct req *o = req_find(s, q->owner, id);
        if (o && o->state == REQ_ASSIGNED && o->pipe && o->pipe->sched &&
            !registry_pipeline_draining(s->reg, o->pipe->p))
            return o->pipe;
    }
    return NULL;
}

/* The fork group of a request's choices (sched_seq_set_fork): a hash of
 * its owner and id, the same for every choice.  Two requests whose hashes
 * meet cost the scheduler a token compare, never a wrong fork. */
static uint64_t choice_group(const struct req *q) {
    uint64_t h = UINT64_C(0xcbf29ce484222325);
    for (const char *p = q->owner; *p; p++) h = (h ^ (uint8_t)*p) * UINT64_C(0x100000001b3);
    h = (h ^ 0xff) * UINT64_C(0x100000001b3);
    for (const char *p = q->cid; *p; p++) h = (h ^ (uint8_t)*p) * UINT64_C(0x100000001b3);
    return h ? h : 1;
}

/* Moves queued requests onto pipelines that admit work, highest priority
 * first.  Each goes to the pipeline holding the longest prefix of its
 * tokens in its prefix cache, unless that one is overloaded (its load
 * exceeds the least loaded pipeline's by more than prefix_slack), and
 * otherwise, or when no pipeline holds any of it, to the least loaded. */
void pipes_assign(server *s) {
    if (s->n_queue == 0) return;
    qsort(s->queue, s->n_queue, sizeof *s->queue, queue_cmp);
    size_t kept = 0;
    size_t i = 0;
    for (; i < s->n_queue; i++) {
        struct req *q = s->queue[i];
        int32_t n = q->n_prompt + q->n_out;
        if (server_grow((void **)&s->scratch, &s->cap_scratch, (size_t)n, sizeof *s->scratch) < 0) break;
        memcpy(s->scratch, q->prompt, (size_t)q->n_prompt * sizeof *s->scratch);
        memcpy(s->scratch + q->n_prompt, q->out, (size_t)q->n_out * sizeof *s->scratch);
        struct pipe *best = NULL, *held = NULL;
        int32_t best_load = 0, held_load = 0, held_tokens = 0;
        for (size_t k = 0; k < registry_n_pipelines(s->reg); k++) {
            struct pipeline *p = registry_pipeline_at(s->reg, k);
            struct pipe *pp = p->ud;
            if (!pp || !pp->sched || registry_pipeline_draining(s->reg, p)) continue;
            struct sched_stats st;
            sched_get_stats(pp->sched, &st);
            if (st.n_waiting >= pp->max_batch) continue;
            int32_t load = st.n_running + st.n_waiting;
            if (!best || load < best_load) {
                best = pp;
                best_load = load;
            }
            int32_t hit = sched_prefix_blocks(pp->sched, s->scratch, n) *
                          (int32_t)registry_pipeline_block_size(NULL, p);
            if (hit > held_tokens || (hit > 0 && hit == held_tokens && load < held_load)) {
                held = pp;
                held_load = load;
                held_tokens = hit;
            }
        }
        if (!best) break;
        if (held && held_load - best_load <= prefix_slack(held)) best = held;
        /* The choices of one request go where another went, so that they
         * share its prompt's blocks. */
        struct pipe *with = choice_pipe(s, q);
        if (with) best = with;
        int32_t cap = pipe_capacity_tokens(best);
        if (q->limit > cap) q->limit = cap;
        if (n >= q->limit) {
            s->queue[i] = NULL;
            q->state = REQ_ASSIGNED; /* so that req_end does not search the queue */
            req_end(s, q, LLM__GENERATE_DONE__FINISH_REASON__LENGTH, -1, NULL, LLM__ERROR__CODE__OK, NULL);
            continue;
        }
        uint64_t sid = ++s->next_seq_id;
        struct sched_seq *seq = NULL;
        int rc = sched_add(best->sched, sid, q->priority, q->order, s->scratch, n, &seq);
        if (rc < 0) {
            char msg[256];
            snprintf(msg, sizeof msg, "%d tokens need %d KV blocks; pipeline %u has %d", n,
                     sched_blocks_for(best->sched, n + 1), best->p->id, cap / (int32_t)registry_pipeline_block_size(NULL, best->p));
            s->queue[i] = NULL;
            q->state = REQ_ASSIGNED;
            req_end(s, q, LLM__GENERATE_DONE__FINISH_REASON__ERROR, -1, NULL,
                    rc == STATUS_EXHAUSTED ? LLM__ERROR__CODE__RESOURCE_EXHAUSTED : LLM__ERROR__CODE__INTERNAL, msg);
            continue;
        }
        int32_t spec_k = 0;
        bool spec_auto = false;
        unsigned spec_src = 0;
        req_spec(s, q, &spec_k, &spec_auto, &spec_src);
        sched_seq_set_spec(seq, spec_k, spec_auto, q->limit);
        sched_seq_set_spec_source(seq, spec_src);
        /* The choices fork the prompt's KV from whichever of them computed
         * it (docs/router.md, "Forked choices"): all but its last token,
         * whose logits each samples from with its own seed. */
        if (q->n_choices > 1) sched_seq_set_fork(seq, choice_group(q), q->n_prompt - 1);
        q->seq_id = sid;
        q->seq = seq;
        q->assigned_us = server_mono_us();
        q->stall_told = false;
        q->pipe = best;
        q->step = 0;
        q->state = REQ_ASSIGNED;
        req_seq_put(s, q);
        pipe_touch(s, best);
        s->queue[i] = NULL;
        if (!q->placed_once) server_metrics_scheduled(s->cfg.metrics, q->created_ms, server_now_ms());
        q->placed_once = true;
    }
    for (size_t k = 0; k < s->n_queue; k++)
        if (s->queue[k]) s->queue[kept++] = s->queue[k];
    s->n_queue = kept;
}

/* The step-time model behind --itl-target-ms (docs/router.md, "Decode
 * latency").  A step's time is taken from its result back to the later of
 * its send and the pipeline's previous result: with one stage that is the
 * round trip, and with several stages busy it is the time the step held
 * the slowest stage, which is what the steps of one micro-batch cycle add
 * up to in a sequence's inter-token gap.  Only steps carrying decodes are
 * fitted (those are the steps the cap shapes), by least squares on
 * prefill tokens, with each older step weighing PIPE_FIT_DECAY as much:
 * the fit follows the last hundred or so steps, as batches and contexts
 * drift. */
#define PIPE_FIT_DECAY 0.99
#define PIPE_FIT_MIN_STEPS 8.0

void pipe_step_observed(server *s, struct pipe *pp, const struct flight *f, int64_t now_us) {
    int64_t from = f->sent_us > pp->last_result_us ? f->sent_us : pp->last_result_us;
    pp->last_result_us = now_us;
    /* One line a step at debug level: what the cap is judged by (which
     * steps make the long inter-token gaps, and what the fit makes of them),
     * and when the plan left and the result came (the monotonic clock the
     * workers' timeline lines use: scripts/step-timeline.py). */
    LOG(LL_DEBUG, "pipeline %u step %llu: %d decode + %d prefill tokens, %.2f ms (fit: %.2f ms + %.2f us/token); "
        "sent %lld us, result %lld us",
        pp->p->id, (unsigned long long)f->step_id, f->n_decode, f->n_prefill, (double)(now_us - from) / 1e3,
        pp->base_us / 1e3, pp->us_per_token, (long long)f->sent_us, (long long)now_us);
    if (s->cfg.itl_target_ms <= 0 || f->n_decode == 0 || now_us <= from) return;
    double t = (double)(now_us - from), p = (double)f->n_prefill;
    pp->fit_w = PIPE_FIT_DECAY * pp->fit_w + 1.0;
    pp->fit_p = PIPE_FIT_DECAY * pp->fit_p + p;
    pp->fit_pp = PIPE_FIT_DECAY * pp->fit_pp + p * p;
    pp->fit_t = PIPE_FIT_DECAY * pp->fit_t + t;
    pp->fit_pt = PIPE_FIT_DECAY * pp->fit_pt + p * t;
    if (pp->fit_w < PIPE_FIT_MIN_STEPS) return;
    double mp = pp->fit_p / pp->fit_w, mt = pp->fit_t / pp->fit_w;
    double var = pp->fit_pp / pp->fit_w - mp * mp;
    /* Steps whose prefill hardly differs tell nothing of its cost: the last
     * fit stays. */
    if (var < 1.0) return;
    double slope = (pp->fit_pt / pp->fit_w - mp * mt) / var;
    /* Prefill that costs nothing measurable is never capped. */
    pp->us_per_token = slope > 0 ? slope : 0;
    pp->base_us = mt - slope * mp;
}

/* The prefill a step with decodes may carry and stay under the target's
 * share of one step (the target over the stages: a sequence's gap spans
 * one step per micro-batch); no cap while the target is off or the model
 * has no fit yet. */
static void pipe_set_cap(server *s, struct pipe *pp) {
    int32_t cap = -1;
    if (s->cfg.itl_target_ms > 0 && pp->us_per_token > 0) {
        double bound = s->cfg.itl_target_ms * 1000.0 / (double)pp->p->stage_count;
        double room = (bound - pp->base_us) / pp->us_per_token;
        cap = room <= 0 ? 0 : room >= (double)INT32_MAX ? INT32_MAX : (int32_t)room;
    }
    sched_set_prefill_cap(pp->sched, cap);
}

/* --prefill-hold-tokens (docs/router.md, "Prefill hold"): the scheduler
 * holds new prompts while others decode, until the first in line has
 * waited --prefill-hold-ms on this pipeline; the loop pumps it again then. */
static void pipe_set_hold(server *s, struct pipe *pp) {
    int32_t hold = s->cfg.prefill_hold_tokens;
    if (hold > 0) {
        struct sched_seq *w = sched_first_waiting(pp->sched);
        struct req *q = w ? req_by_seq(s, sched_seq_id(w)) : NULL;
        int64_t end = q ? q->assigned_us + (int64_t)s->cfg.prefill_hold_ms * 1000 : 0;
        if (!q || server_mono_us() >= end) hold = 0;
        else if (!s->batch_wake_us || end < s->batch_wake_us) s->batch_wake_us = end;
    }
    sched_set_prefill_hold(pp->sched, hold);
}

/* --batch-wait-us (docs/router.md, "Batch wait"): true while a pipeline
 * with nothing running or in flight holds its first step for prompts that
 * arrive together: until the wait passes with neither a new prompt nor the
 * end of a request that ran on it sent (whose client may be about to send
 * the next), at most PIPE_BATCH_WAIT_MAX waits from the first, or until
 * the batch is full.  The loop pumps it again when the wait ends. */
#define PIPE_BATCH_WAIT_MAX 8

static bool pipe_batch_waits(server *s, struct pipe *pp) {
    if (s->cfg.batch_wait_us <= 0 || pp->n_flights > 0) {
        pp->idle_first_us = 0;
        return false;
    }
    struct sched_stats st;
    sched_get_stats(pp->sched, &st);
    if (st.n_running > 0 || st.n_waiting == 0 || st.n_waiting >= pp->max_batch) {
        /* A full batch ends a wait early. */
        if (pp->idle_first_us && st.n_waiting >= pp->max_batch)
            server_metrics_batch_wait(s->cfg.metrics, (double)(server_mono_us() - pp->idle_first_us) / 1e6);
        pp->idle_first_us = 0;
        return false;
    }
    int64_t now = server_mono_us(), wait = s->cfg.batch_wait_us;
    if (!pp->idle_first_us) {
        pp->idle_first_us = pp->idle_last_us = now;
        pp->idle_waiting = st.n_waiting;
    } else if (st.n_waiting > pp->idle_waiting) {
        pp->idle_last_us = now;
        pp->idle_waiting = st.n_waiting;
    }
    if (pp->last_end_us > pp->idle_last_us) pp->idle_last_us = pp->last_end_us;
    int64_t end = pp->idle_last_us + wait, cap = pp->idle_first_us + PIPE_BATCH_WAIT_MAX * wait;
    if (end > cap) end = cap;
    if (now >= end) {
        server_metrics_batch_wait(s->cfg.metrics, (double)(now - pp->idle_first_us) / 1e6);
        pp->idle_first_us = 0;
        return false;
    }
    if (!s->batch_wake_us || end < s->batch_wake_us) s->batch_wake_us = end;
    return true;
}

/* Sequences that ended with no step after them to carry their frees: a
 * plan of frees only (step 0, no sequences), which the stages apply without
 * computing or answering, so that their KV view (llm status,
 * llm_stage_kv_blocks_used) comes back to the router's. */
static void pipe_send_frees(server *s, struct pipe *pp) {
    const uint64_t *ids;
    int32_t n = sched_take_freed(pp->sched, &ids);
    if (n == 0) return;
    struct pipeline *p = pp->p;
    Llm__StepPlan plan = LLM__STEP_PLAN__INIT;
    plan.pipeline_id = p->id;
    plan.epoch = pp->epoch;
    plan.n_freed_seqs = (size_t)n;
    plan.freed_seqs = (uint64_t *)ids;
    Llm__WorkerEnvelope env = LLM__WORKER_ENVELOPE__INIT;
    env.body_case = LLM__WORKER_ENVELOPE__BODY_PLAN;
    env.plan = &plan;
    uint8_t *buf = NULL;
    size_t len = 0;
    char err[256];
    if (proto_worker_pack(&env, &buf, &len, err, sizeof err) < 0) {
        LOG(LL_ERROR, "pipeline %u: frees of %d sequences: %s", p->id, n, err);
        return;
    }
    for (uint32_t k = 0; k < p->stage_count; k++)
        if (p->stage[k] && server_send_worker(s, p->stage[k]->ident, p->stage[k]->ident_len, buf, len) < 0) {
            char what[64];
            snprintf(what, sizeof what, "the frees of %d sequences", n);
            pipe_unreachable(s, pp, k, what);
            break;
        }
    free(buf);
}

/* --spec auto (docs/router.md, "Speculation"): drafts only while the
 * pipeline runs at most --spec-auto-batch sequences per stage.  A decode
 * step reads every weight once for all its rows: with few rows it is bound
 * by memory, and the k drafts of each sequence ride almost free; with many
 * it becomes bound by compute, and rejected drafts take time from the
 * other sequences. */
static void pipe_set_spec_auto(server *s, struct pipe *pp) {
    int32_t running = sched_n_running(pp->sched);
    int32_t stages = pp->max_flights > 0 ? pp->max_flights : 1;
    bool on = running <= (int64_t)s->cfg.spec_auto_batch * stages;
    if (on != pp->spec_auto_on) {
        LOG(LL_DEBUG, "pipeline %u: --spec auto %s speculation: %d sequences running over %d stages "
            "(--spec-auto-batch %d)", pp->p->id, on ? "resumes" : "pauses", running, stages,
            s->cfg.spec_auto_batch);
        pp->spec_auto_on = on;
    }
    sched_set_spec_auto(pp->sched, on);
}

/* Plans and sends steps until the pipeline has one in flight per stage or
 * nothing more can run. */
void pipe_pump(server *s, struct pipe *pp) {
    if (!pp->sched) return;
    /* Re-forming (a stage lost or unreachable, a step timed out): nothing
     * more for the old formation; pipes_sync starts the new one. */
    if (pp->epoch != pp->p->epoch) return;
    if (pipe_batch_waits(s, pp)) return;
    struct req *stuck[16];
    int n_stuck = 0;
    for (;;) {
        int64_t t0 = server_mono_us();
        struct sched_step st;
        if (pp->n_flights >= pp->max_flights) break;
        pipe_set_cap(s, pp);
        pipe_set_hold(s, pp);
        pipe_set_spec_auto(s, pp);
        int got = sched_plan(pp->sched, &st);
        for (int32_t k = 0; k < st.n_stuck && n_stuck < 16; k++) {
            struct req *q = req_by_seq(s, sched_seq_id(st.stuck[k]));
            if (q) stuck[n_stuck++] = q;
        }
        if (got != 1) break;
        struct pipeline *p = pp->p;
        Llm__StepPlan plan = LLM__STEP_PLAN__INIT;
        plan.step_id = st.step_id;
        plan.pipeline_id = p->id;
        plan.epoch = pp->epoch;
        struct flight *f = &pp->flights[pp->n_flights];
        f->step_id = st.step_id;
        f->sent_ms = server_now_ms();
        f->n_prefill = st.n_prefill_tokens;
        f->n_decode = st.n_decode_tokens;
        f->n = st.n_seqs;
        for (int32_t k = 0; k < st.n_seqs; k++) {
            const struct sched_step_seq *ss = &st.seqs[k];
            struct req *q = req_by_seq(s, ss->seq_id);
            Llm__SeqPlan *sp = &pp->seqplans[k];
            llm__seq_plan__init(sp);
            sp->seq_id = ss->seq_id;
            sp->n_tokens = (size_t)ss->n_tokens;
            sp->tokens = (int32_t *)ss->tokens;
            sp->start_pos = (uint32_t)ss->start_pos;
            sp->n_block_table = (size_t)ss->n_blocks;
            sp->block_table = (uint32_t *)ss->block_table; /* ids are >= 0 */
            sp->sampling = q ? &q->spm : NULL;
            sp->output_start = q ? (uint32_t)q->n_prompt : 0;
            sp->want_logits = ss->want_logits;
            sp->n_draft = (uint32_t)ss->n_draft;
            /* A prediction under prompt lookup takes no draft-model guesses
             * (its drafts come from req_pred_drafts). */
            sp->draft_k = q && q->pred_only ? 0 : (uint32_t)ss->draft_k;
            /* Started on a cached prefix: the last stage's penalties see
             * the tokens before it, which it never processed. */
            sp->n_penalty_context = (size_t)ss->n_context;
            sp->penalty_context = (int32_t *)ss->context;
            pp->seqptrs[k] = sp;
            f->seq_ids[k] = ss->seq_id;
            f->want[k] = ss->want_logits;
            if (q) q->step = st.step_id;
        }
        plan.n_seqs = (size_t)st.n_seqs;
        plan.seqs = pp->seqptrs;
        plan.n_freed_seqs = (size_t)st.n_freed;
        plan.freed_seqs = (uint64_t *)st.freed;
        for (int32_t k = 0; k < st.n_copies; k++) {
            llm__block_copy__init(&pp->copies[k]);
            pp->copies[k].src = (uint32_t)st.copies[k].src;
            pp->copies[k].dst = (uint32_t)st.copies[k].dst;
            pp->copyptrs[k] = &pp->copies[k];
        }
        plan.n_copies = (size_t)st.n_copies;
        plan.copies = pp->copyptrs;
        Llm__WorkerEnvelope env = LLM__WORKER_ENVELOPE__INIT;
        env.body_case = LLM__WORKER_ENVELOPE__BODY_PLAN;
        env.plan = &plan;
        uint8_t *buf = NULL;
        size_t len = 0;
        char err[256];
        if (proto_worker_pack(&env, &buf, &len, err, sizeof err) < 0) {
            LOG(LL_ERROR, "pipeline %u step %llu: %s", p->id, (unsigned long long)st.step_id, err);
            sched_step_done(pp->sched, st.step_id);
            break;
        }
        f->sent_us = server_mono_us();
        bool unsent = false;
        for (uint32_t k = 0; k < p->stage_count && !unsent; k++)
            if (p->stage[k] && server_send_worker(s, p->stage[k]->ident, p->stage[k]->ident_len, buf, len) < 0) {
                char what[64];
                snprintf(what, sizeof what, "step %llu", (unsigned long long)st.step_id);
                pipe_unreachable(s, pp, k, what);
                unsent = true; /* the later stages would wait for its input in vain */
            }
        free(buf);
        pp->n_flights++;
        pp->prompt_tokens += (uint64_t)st.n_prefill_tokens;
        s->prompt_total += (uint64_t)st.n_prefill_tokens;
        if (s->next_step_id <= st.step_id) s->next_step_id = st.step_id + 1;
        s->steps_total++;
        /* Planning through the sends, as Status's plan_us has always
         * counted it: packing and queueing the plan are its cost too. */
        double us = (double)(server_mono_us() - t0);
        server_metrics_step_plan(s->cfg.metrics, us / 1e6);
        s->plan_us_sum += us;
        s->plan_n++;
        if (us > s->plan_us_max) s->plan_us_max = us;
        if (unsent || pp->n_flights >= pp->max_flights) break;
    }
    for (int k = 0; k < n_stuck; k++)
        req_end(s, stuck[k], LLM__GENERATE_DONE__FINISH_REASON__LENGTH, -1, NULL, LLM__ERROR__CODE__OK,
                NULL);
    if (pp->sched && pp->n_flights == 0) pipe_send_frees(s, pp);
}

void pipes_pump(server *s) {
    for (size_t i = 0; i < registry_n_pipelines(s->reg); i++) {
        struct pipe *pp = registry_pipeline_at(s->reg, i)->ud;
        if (pp) pipe_pump(s, pp);
    }
}

void pipe_touch(server *s, struct pipe *pp) {
    if (pp->touched) return;
    if (server_grow((void **)&s->pipes_touched, &s->cap_pipes_touched, s->n_pipes_touched + 1,
                    sizeof *s->pipes_touched) < 0) {
        s->loop_full = true; /* out of memory: the turn pumps every pipeline instead */
        return;
    }
    pp->touched = true;
    s->pipes_touched[s->n_pipes_touched++] = pp;
}

void pipes_pump_touched(server *s) {
    /* pipe_pump never touches a pipeline, so the list holds still. */
    for (size_t i = 0; i < s->n_pipes_touched; i++) {
        struct pipe *pp = s->pipes_touched[i];
        pp->touched = false;
        pipe_pump(s, pp);
    }
    s->n_pipes_touched = 0;
}

int32_t pipes_taking_work(server *s, int32_t *cap_max, uint32_t *cap_pid) {
    int32_t n = 0;
    *cap_max = -1;
    *cap_pid = 0;
    for (size_t i = 0; i < registry_n_pipelines(s->reg); i++) {
        struct pipeline *p = registry_pipeline_at(s->reg, i);
        struct pipe *pp = p->ud;
        if (!pp || !pp->sched || registry_pipeline_draining(s->reg, p)) continue;
        n++;
        int32_t cap = pipe_capacity_tokens(pp);
        if (cap > *cap_max) {
            *cap_max = cap;
            *cap_pid = p->id;
        }
    }
    return n;
}

void pipes_why_idle(server *s, char *buf, size_t size) {
    size_t alive = 0;
    for (size_t i = 0; i < registry_n_workers(s->reg); i++)
        if (registry_worker_at(s->reg, i)->state != WORKER_LOST) alive++;
    if (alive == 0) {
        snprintf(buf, size, "no worker is registered with this router (workers connect to %s)",
                 zio_endpoint(s->ws));
        return;
    }
    /* The first pipeline that says what is wrong tells the most. */
    for (size_t i = 0; i < registry_n_pipelines(s->reg); i++) {
        struct pipeline *p = registry_pipeline_at(s->reg, i);
        if (p->problem[0]) {
            snprintf(buf, size, "%zu workers registered; %s", alive, p->problem);
            return;
        }
        if (registry_pipeline_draining(s->reg, p)) {
            snprintf(buf, size, "%zu workers registered; pipeline %u is draining", alive, p->id);
            return;
        }
    }
    uint32_t have = 0, want = 0;
    for (size_t i = 0; i < registry_n_pipelines(s->reg); i++) {
        struct pipeline *p = registry_pipeline_at(s->reg, i);
        want += p->stage_count;
        for (uint32_t k = 0; k < p->stage_count; k++)
            if (p->stage[k] && p->stage[k]->state == WORKER_READY) have++;
    }
    snprintf(buf, size, "%zu workers registered, %u of %u stages ready (loading, or waiting for "
             "the other stages of their pipeline)", alive, have, want);
}

void pipes_tell_stalled(server *s, struct req *q, const uint8_t *ident, size_t ident_len, uint64_t tag) {
    char why[384], msg[640];
    pipes_why_idle(s, why, sizeof why);
    snprintf(msg, sizeof msg, "request %s is accepted and kept (%d tokens so far; re-attach by its id), "
             "but no pipeline is in service to run it: %s", q->id, q->n_out, why);
    server_send_client_error(s, ident, ident_len, tag, LLM__ERROR__CODE__UNAVAILABLE, q->id, msg,
                             SERVER_RETRY_AFTER_MS);
    q->stall_told = true;
}
