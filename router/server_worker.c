/* Worker messages: registration, heartbeats and step results (sampled
 * tokens back to their requests, failed steps started over). */
#include "router/server-impl.h"

#include <errno.h>
#include <inttypes.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>
#include <unistd.h>
#include <zmq.h>

#include "common/log.h"
#include "common/status.h"
#include "router/server_metrics.h"

/* A worker id's owner across router restarts: the record
 * <prefix>worker-owner:<id> in Redis names the key the worker registered
 * from, and this router renews it from the worker's heartbeats.  A router
 * that restarts knows no worker, and without the record the first admitted
 * key to name a live worker's id would get it.  The worker's own registry
 * key (<prefix>worker:<id>) cannot tell: the worker writes it, so anyone
 * naming the id could keep it alive.  The record outlives its last renewal
 * by this many worker timeouts: a restart of the router, and the worker's
 * registering again, fit well inside. */
#define OWNER_TTL_TIMEOUTS 6

/* For an id this router does not know (it restarted, or another router had
 * the worker): the record is checked and taken in one round trip.  The
 * claim lasts one worker timeout, and the worker's first heartbeat gives it
 * its full lifetime, so that a registration refused afterwards (a wrong
 * model, a taken slot) keeps the id from others no longer than a lost
 * worker does.  When Redis fails the registration goes on as it would
 * without the record: a Redis outage must not keep workers out
 * (docs/security.md). */
static bool owner_record_allows(server *s, const char *worker_id, char *err, size_t errlen) {
    size_t idlen = strlen(worker_id);
    if (idlen == 0 || idlen > REGISTRY_ID_MAX) return true; /* registry_register refuses it */
    if (!s->rs) {
        LOG(LL_WARN, "worker %.128s registers while Redis cannot be reached: the owner record of "
            "its id is not checked", worker_id);
        return true;
    }
    char holder[64];
    int64_t left_ms = 0;
    int rc = reqstore_worker_claim(s->rs, worker_id, s->peer_key, s->cfg.worker_timeout_ms, holder,
                                   sizeof holder, &left_ms);
    if (rc < 0) {
        LOG(LL_WARN, "worker %.128s: the owner record of its id: %s: registering it unchecked",
            worker_id, reqstore_errstr(s->rs));
        return true;
    }
    if (rc == 0) return true;
    s->workers_refused++;
    server_metrics_worker_refused(s->cfg.metrics, SERVER_REFUSED_REGISTER);
    snprintf(err, errlen, "worker %.128s is registered from another key (%.8s...) that this router "
             "has not heard from since it started: the id's owner record %sworker-owner:%.128s "
             "keeps it for that key another %lld ms, or longer once that worker is back: refused "
             "from key %.8s... (%llu refused so far)", worker_id, holder, s->cfg.redis_prefix, worker_id,
             (long long)left_ms, s->peer_key, (unsigned long long)s->workers_refused);
    return false;
}

/* A live worker's id belongs to the key it registered from: another key
 * naming it is refused, so that no admitted peer can take over a running
 * stage.  After the worker is lost, the id is free again.  *claimed: the
 * owner record now names this key (an id this router did not know). */
static bool key_owns_id(server *s, const char *worker_id, bool *claimed, char *err, size_t errlen) {
    *claimed = false;
    struct worker *w = registry_worker_find(s->reg, worker_id);
    if (!w) {
        /* Insecure: no keys, nothing to own. */
        if (!s->peer_key[0]) return true;
        *claimed = true;
        return owner_record_allows(s, worker_id, err, errlen);
    }
    if (w->state == WORKER_LOST || strcmp(w->key, s->peer_key) == 0) return true;
    s->workers_refused++;
    server_metrics_worker_refused(s->cfg.metrics, SERVER_REFUSED_REGISTER);
    snprintf(err, errlen, "worker %.128s is registered from another key (%.8s...) and alive: "
             "refused from key %.8s... (%llu refused so far)", worker_id, w->key,
             s->peer_key[0] ? s->peer_key : "(none)", (unsigned long long)s->workers_refused);
    return false;
}

/* An accepted registration of an id this router knew (the worker
 * reconnecting, or a new worker in a lost one's place): the record names
 * its key from now on.  Heartbeats renew it (owner_renew). */
static void owner_write(server *s, struct worker *w, int64_t ttl_ms) {
    if (!w->key[0] || !s->rs) return;
    if (reqstore_worker_own(s->rs, w->id, w->key, ttl_ms) < 0)
        LOG(LL_WARN, "worker %s: writing the owner record of its id: %s", w->id, reqstore_errstr(s->rs));
}

/* From a heartbeat of the id's owner: at most once per worker timeout, so
 * that hundreds of workers cost Redis little. */
static void owner_renew(server *s, struct worker *w) {
    int64_t now = server_now_ms();
    if (!w->key[0] || (w->owner_written_ms && now - w->owner_written_ms < s->cfg.worker_timeout_ms)) return;
    w->owner_written_ms = now;
    owner_write(s, w, (int64_t)OWNER_TTL_TIMEOUTS * s->cfg.worker_timeout_ms);
}

/* The limits a worker states and how it chose them (Register's sizing
 * fields; an older worker states none), so that the router's log shows
 * what each pipeline's batches are made of. */
static void register_log_sizing(const Llm__Register *m) {
    if (m->target_ctx == 0) return;
    char chosen[96] = "";
    size_t at = 0;
    static const struct {
        uint32_t bit;
        const char *what;
    } parts[] = {{1, "KV blocks"}, {2, "step tokens"}, {4, "step sequences"}};
    for (size_t i = 0; i < sizeof parts / sizeof parts[0]; i++)
        if (m->sized_auto & parts[i].bit && at < sizeof chosen)
            at += (size_t)snprintf(chosen + at, sizeof chosen - at, "%s%s", at ? ", " : "", parts[i].what);
    LOG(LL_INFO, "worker %.128s states %u tokens and %u sequences a step, %u KV blocks = %u "
        "sequences of %u positions; chosen by the worker rather than flags: %s",
        m->worker_id, m->max_step_tokens, m->max_step_seqs, m->kv_block_count, m->kv_seqs,
        m->target_ctx, chosen[0] ? chosen : "none");
}

static void on_register(server *s, const uint8_t *ident, size_t ident_len, const Llm__Register *m) {
    struct worker *w = NULL;
    struct pipeline *p = NULL;
    bool reformed = false;
    Llm__Error__Code code = LLM__ERROR__CODE__ALREADY_EXISTS;
    char err[1024]; /* two worker ids, three keys and the record's name */
    bool claimed = false;
    int rc = key_owns_id(s, m->worker_id, &claimed, err, sizeof err)
                 ? registry_register(s->reg, m, ident, ident_len, server_now_ms(), &w, &p, &reformed,
                                     &code, err, sizeof err)
                 : STATUS_BAD_INPUT;
    if (rc == 0) {
        snprintf(w->key, sizeof w->key, "%s", s->peer_key);
        w->owner_written_ms = 0;
        if (!claimed) owner_write(s, w, s->cfg.worker_timeout_ms);
    }
    s->loop_full = true; /* a pipeline may have formed, or changed */
    if (rc < 0) {
        LOG(LL_WARN, "%s", err);
        Llm__RegisterReply rr = LLM__REGISTER_REPLY__INIT;
        Llm__Error e;
        /* A held stage frees once its holder is lost: the worker tries
         * again every heartbeat interval instead of giving up. */
        proto_error_init(&e, code, "", err, rc == STATUS_EXHAUSTED ? (uint32_t)s->cfg.heartbeat_ms : 0);
        rr.worker_id = m->worker_id;
        rr.accepted = false;
        rr.error = &e;
        Llm__WorkerEnvelope env = LLM__WORKER_ENVELOPE__INIT;
        env.body_case = LLM__WORKER_ENVELOPE__BODY_REGISTER_REPLY;
        env.register_reply = &rr;
        server_send_worker_env(s, ident, ident_len, &env);
        return;
    }
    register_log_sizing(m);
    if (p->announce) return; /* pipes_sync tells every stage, this one included */
    Llm__RegisterReply rr = LLM__REGISTER_REPLY__INIT;
    rr.worker_id = w->id;
    rr.accepted = true;
    rr.heartbeat_interval_ms = (uint32_t)s->cfg.heartbeat_ms;
    rr.pipeline_id = p->id;
    rr.stage_index = w->stage_index;
    rr.stage_count = p->stage_count;
    rr.layer_first = w->layer_first;
    rr.layer_end = w->layer_end;
    uint32_t si = w->stage_index;
    rr.prev_stage_endpoint = si > 0 && p->stage[si - 1] ? p->stage[si - 1]->stage_endpoint : "";
    rr.next_stage_endpoint = si + 1 < p->stage_count && p->stage[si + 1] ? p->stage[si + 1]->stage_endpoint : "";
    rr.prev_stage_key = si > 0 && p->stage[si - 1] ? p->stage[si - 1]->key : "";
    rr.next_stage_key = si + 1 < p->stage_count && p->stage[si + 1] ? p->stage[si + 1]->key : "";
    rr.epoch = p->epoch;
    rr.pipeline_whole = registry_pipeline_whole(s->reg, p);
    Llm__WorkerEnvelope env = LLM__WORKER_ENVELOPE__INIT;
    env.body_case = LLM__WORKER_ENVELOPE__BODY_REGISTER_REPLY;
    env.register_reply = &rr;
    server_send_worker_env(s, ident, ident_len, &env);
}

static void on_heartbeat(server *s, const uint8_t *ident, size_t ident_len, const Llm__Heartbeat *m) {
    struct worker *w = registry_worker_find(s->reg, m->worker_id);
    if (w && strcmp(w->key, s->peer_key) != 0) {
        /* Not its owner: it must not keep the worker alive or move its
         * connection.  The refusal goes to the sender only. */
        s->workers_refused++;
        server_metrics_worker_refused(s->cfg.metrics, SERVER_REFUSED_HEARTBEAT);
        char msg[256];
        snprintf(msg, sizeof msg, "heartbeat for worker %.128s from a key that did not register it",
                 m->worker_id);
        LOG(LL_WARN, "%s (%llu refused so far)", msg, (unsigned long long)s->workers_refused);
        uint8_t *out = NULL;
        size_t olen = 0;
        if (proto_worker_error_pack(LLM__ERROR__CODE__ALREADY_EXISTS, "", msg, 0, &out, &olen) == 0) {
            server_send_worker(s, ident, ident_len, out, olen);
            free(out);
        }
        return;
    }
    enum worker_state was = w ? w->state : WORKER_LOST;
    w = NULL;
    if (registry_heartbeat(s->reg, m, server_now_ms(), &w) == 0) {
        /* A state change (ready, draining, failed) may put a pipeline in
         * or out of service: the loop's next turn walks them all. */
        if (w->state != was) s->loop_full = true;
        owner_renew(s, w);
        if (w->ident_len != ident_len || memcmp(w->ident, ident, ident_len) != 0) {
            memcpy(w->ident, ident, ident_len < sizeof w->ident ? ident_len : sizeof w->ident);
            w->ident_len = ident_len < sizeof w->ident ? ident_len : sizeof w->ident;
        }
        return;
    }
    /* Unknown (the router restarted) or lost meanwhile: ask it to register. */
    char msg[256];
    snprintf(msg, sizeof msg, "worker %.128s (incarnation %llu) is not registered with this router: register again",
             m->worker_id, (unsigned long long)m->incarnation);
    Llm__RegisterReply rr = LLM__REGISTER_REPLY__INIT;
    Llm__Error e;
    /* retry_after_ms > 0: "try again", not a final refusal. */
    proto_error_init(&e, LLM__ERROR__CODE__UNAVAILABLE, "", msg, 100);
    rr.worker_id = m->worker_id;
    rr.accepted = false;
    rr.error = &e;
    rr.heartbeat_interval_ms = (uint32_t)s->cfg.heartbeat_ms;
    Llm__WorkerEnvelope env = LLM__WORKER_ENVELOPE__INIT;
    env.body_case = LLM__WORKER_ENVELOPE__BODY_REGISTER_REPLY;
    env.register_reply = &rr;
    server_send_worker_env(s, ident, ident_len, &env);
}

/* The verdict of the last stage on q's drafts (docs/router.md,
 * "Speculation"): the block table is cut back to the accepted positions
 * (the router's table is the truth: the stages follow it with the next
 * plan).  false, with the sequence started over or ended, when the answer
 * does not fit what was drafted. */
static bool spec_verdict(server *s, struct pipe *pp, struct req *q, const Llm__SeqResult *r,
                         uint32_t stage) {
    int32_t n_draft = sched_seq_n_draft(q->seq);
    /* A prediction's drafts travel as the model's but are prompt lookup's. */
    bool model = sched_seq_draft_source(q->seq) == SCHED_SPEC_MODEL && !q->pred_drafts;
    if (n_draft == 0 && r->n_next_tokens == 0) return true;
    int32_t n_acc = (int32_t)r->n_next_tokens;
    bool ok = n_acc <= n_draft;
    /* Every token but the last one emitted is an accepted draft. */
    const int32_t *drafts = sched_seq_drafts(q->seq);
    for (size_t j = 0; ok && j < r->n_next_tokens; j++)
        ok = r->next_tokens[j] >= 0 && r->next_tokens[j] < s->mi.n_vocab &&
             (j == 0 ? r->token : r->next_tokens[j - 1]) == drafts[j];
    if (ok) ok = sched_spec_accept(pp->sched, q->seq, n_acc) == STATUS_OK;
    if (!ok) {
        LOG(LL_WARN, "request %s: stage %u answered %d tokens for %d drafts (or one outside the "
            "vocabulary): its sequence starts over", q->id, stage, n_acc + 1, n_draft);
        if (++q->failures >= SERVER_FAILURES_MAX)
            req_end(s, q, LLM__GENERATE_DONE__FINISH_REASON__ERROR, -1, NULL, LLM__ERROR__CODE__INTERNAL,
                    "the last stage's answers to drafted tokens do not fit them");
        else
            sched_restart(pp->sched, q->seq);
        return false;
    }
    if (s->cfg.spec_adapt) {
        /* --spec-adapt: as many drafts as the last verdict would have
         * kept, and one more; the request's k bounds it. */
        int32_t k_max = 0;
        bool auto_only = false;
        unsigned src = 0;
        req_spec(s, q, &k_max, &auto_only, &src);
        int32_t k = (n_acc == n_draft ? n_draft : n_acc) + 1;
        if (k > k_max) k = k_max;
        if (k_max > 0 && k < 1) k = 1;
        sched_seq_set_spec(q->seq, k, auto_only, q->limit);
    }
    if (q->pred_drafts && q->pred_matched) {
        q->pred_accepted += (uint32_t)n_acc;
        q->pred_rejected += (uint32_t)(n_draft - n_acc);
    }
    s->spec_steps++;
    s->spec_drafts += (uint64_t)n_draft;
    s->spec_accepted += (uint64_t)n_acc;
    server_metrics_spec(s->cfg.metrics, n_draft, n_acc, model);
    return true;
}

static void on_result(server *s, const Llm__StepResult *m) {
    int64_t t0 = server_mono_us();
    /* A result counts only from the stage worker it names, sent from that
     * worker's key. */
    struct worker *from = registry_worker_find(s->reg, m->worker_id);
    if (!from || strcmp(from->key, s->peer_key) != 0) {
        if (from) {
            s->workers_refused++;
            server_metrics_worker_refused(s->cfg.metrics, SERVER_REFUSED_RESULT);
        }
        s->stale_results++;
        return;
    }
    struct pipeline *p = registry_pipeline_find(s->reg, m->pipeline_id);
    struct pipe *pp = p ? p->ud : NULL;
    if (!pp || !pp->sched || m->epoch != pp->epoch) {
        s->stale_results++;
        return;
    }
    int32_t fi = -1;
    for (int32_t i = 0; i < pp->n_flights; i++)
        if (pp->flights[i].step_id == m->step_id) fi = i;
    if (fi < 0) {
        s->stale_results++;
        return;
    }
    struct flight *f = &pp->flights[fi];
    bool failed = m->error && m->error->code != LLM__ERROR__CODE__OK;
    if (!failed && m->stage_index + 1 != p->stage_count) return; /* only the last stage reports success */
    if (failed) {
        LOG(LL_WARN, "pipeline %u step %llu failed at stage %u (%s): %s: %d sequences start over",
            p->id, (unsigned long long)m->step_id, m->stage_index, m->worker_id,
            m->error->message, f->n);
        for (int32_t k = 0; k < f->n; k++) {
            struct req *q = req_by_seq(s, f->seq_ids[k]);
            if (!q || q->step != m->step_id) continue;
            q->step = 0;
            if (++q->failures >= SERVER_FAILURES_MAX) {
                char msg[512];
                snprintf(msg, sizeof msg, "%d failed steps, the last at stage %u: %s", q->failures,
                         m->stage_index, m->error->message);
                req_end(s, q, LLM__GENERATE_DONE__FINISH_REASON__ERROR, -1, NULL, LLM__ERROR__CODE__ABORTED, msg);
            } else {
                sched_restart(pp->sched, q->seq);
            }
        }
    } else {
        for (size_t k = 0; k < m->n_seqs; k++) {
            const Llm__SeqResult *r = m->seqs[k];
            struct req *q = req_by_seq(s, r->seq_id);
            if (!q || q->step != m->step_id) continue;
            /* Results come in plan order: the same slot, else a search. */
            bool want = false;
            if (k < (size_t)f->n && f->seq_ids[k] == r->seq_id) want = f->want[k];
            else
                for (int32_t j = 0; j < f->n; j++)
                    if (f->seq_ids[j] == r->seq_id) want = f->want[j];
            q->step = 0;
            if (r->error && r->error->code != LLM__ERROR__CODE__OK) {
                if (++q->failures >= SERVER_FAILURES_MAX)
                    req_end(s, q, LLM__GENERATE_DONE__FINISH_REASON__ERROR, -1, NULL,
                            (Llm__Error__Code)r->error->code, r->error->message);
                else
                    sched_restart(pp->sched, q->seq);
                continue;
            }
            if (!want) continue;
            if (r->token < 0 || r->token >= s->mi.n_vocab) {
                char msg[128];
                snprintf(msg, sizeof msg, "stage %u sampled token %d, outside the vocabulary of %d",
                         m->stage_index, r->token, s->mi.n_vocab);
                req_end(s, q, LLM__GENERATE_DONE__FINISH_REASON__ERROR, -1, NULL, LLM__ERROR__CODE__INTERNAL, msg);
                continue;
            }
            if (!spec_verdict(s, pp, q, r, m->stage_index)) continue;
            req_token(s, q, r->token, r->logprob);
            /* The accepted drafts and the token after them, until one ends
             * the request (then the rest are never streamed nor stored). */
            for (size_t j = 0; j < r->n_next_tokens && q->seq; j++)
                req_token(s, q, r->next_tokens[j], j < r->n_next_logprobs ? r->next_logprobs[j] : NULL);
            /* The draft model's guesses of what follows, for the next step:
             * hints only (the last stage verifies them), so one outside the
             * vocabulary just ends the list. */
            if (q->seq && r->n_draft_tokens > 0) {
                size_t nd = 0;
                while (nd < r->n_draft_tokens && r->draft_tokens[nd] >= 0 &&
                       r->draft_tokens[nd] < s->mi.n_vocab)
                    nd++;
                sched_seq_set_model_drafts(q->seq, r->draft_tokens, (int32_t)nd);
            }
            req_pred_drafts(s, q);
        }
        /* Sequences of the step the result did not mention start over. */
        for (int32_t j = 0; j < f->n; j++) {
            struct req *q = req_by_seq(s, f->seq_ids[j]);
            if (q && q->step == m->step_id) {
                q->step = 0;
                if (f->want[j]) sched_restart(pp->sched, q->seq);
            }
        }
    }
    sched_step_done(pp->sched, m->step_id);
    if (!failed) pipe_step_observed(s, pp, f, t0);
    /* Swap whole slots, so that each keeps its own arrays. */
    struct flight tmp = pp->flights[fi];
    pp->flights[fi] = pp->flights[pp->n_flights - 1];
    pp->flights[pp->n_flights - 1] = tmp;
    pp->n_flights--;
    pipe_pump(s, pp);
    /* Again after the turn's writes and sends: a request that ended there
     * may have left room. */
    pipe_touch(s, pp);
    s->turn_us_sum += (double)(server_mono_us() - t0);
    s->turn_n++;
}

void server_on_worker_frame(server *s, const uint8_t *ident, size_t ident_len, const uint8_t *buf, size_t len) {
    Llm__WorkerEnvelope *env = NULL;
    char err[256];
    int rc = proto_worker_unpack(buf, len, &env, err, sizeof err);
    if (rc < 0) {
        LOG(LL_WARN, "worker frame refused: %s", err);
        uint8_t *out = NULL;
        size_t olen = 0;
        if (proto_worker_error_pack(proto_code_from_status(rc), "", err, 0, &out, &olen) == 0) {
            server_send_worker(s, ident, ident_len, out, olen);
            free(out);
        }
        return;
    }
    switch (env->body_case) {
    case LLM__WORKER_ENVELOPE__BODY_REGISTER: on_register(s, ident, ident_len, env->register_); break;
    case LLM__WORKER_ENVELOPE__BODY_HEARTBEAT: on_heartbeat(s, ident, ident_len, env->heartbeat); break;
    case LLM__WORKER_ENVELOPE__BODY_RESULT: on_result(s, env->result); break;
    case LLM__WORKER_ENVELOPE__BODY_ERROR:
        LOG(LL_WARN, "worker error: %s: %s", proto_code_name(env->error->code), env->error->message);
        break;
    default: {
        s->frames_bad++;
        snprintf(err, sizeof err, "worker envelope body %d is not one a worker sends", (int)env->body_case);
        uint8_t *out = NULL;
        size_t olen = 0;
        if (proto_worker_error_pack(LLM__ERROR__CODE__UNIMPLEMENTED, "", err, 0, &out, &olen) == 0) {
            server_send_worker(s, ident, ident_len, out, olen);
            free(out);
        }
    }
    }
    proto_worker_free(env);
}
