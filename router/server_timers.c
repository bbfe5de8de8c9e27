/* What runs on the clock: the Redis connection (and recovering accepted
 * requests once it is up), worker liveness, step timeouts, deadlines,
 * forgetting finished requests, and the throughput figures. */
#include "router/server-impl.h"

#include <errno.h>
#include <inttypes.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>
#include <unistd.h>
#include <zmq.h>

#include "common/keys.h"
#include "common/log.h"
#include "common/status.h"

/* Queues the loaded requests this router does not hold yet (they resume
 * by recomputation, with their stored seeds) and frees the list. */
static size_t adopt_requests(server *s, struct reqrec *list, size_t n) {
    char err[512];
    size_t adopted = 0;
    for (size_t i = 0; i < n; i++) {
        if (!req_find(s, list[i].owner, list[i].id)) {
            struct req *q = req_new(s, &list[i], err, sizeof err);
            if (q) {
                req_queue_push(s, q);
                adopted++;
            } else {
                LOG(LL_WARN, "recover: %s", err);
            }
        }
        reqrec_free(&list[i]);
    }
    free(list);
    return adopted;
}

void server_redis_connect(server *s) {
    if (s->rs) return;
    char err[512];
    struct reqstore_config c = {s->cfg.redis_url, s->cfg.redis_prefix, s->cfg.router_id,
                                (int64_t)s->cfg.retention_s * 1000, s->cfg.claim_idle_ms, 2000};
    if (reqstore_open(&s->rs, &c, err, sizeof err) < 0) {
        LOG(LL_WARN, "redis: %s (retrying)", err);
        return;
    }
    char shown[512];
    rconn_url_redact(s->cfg.redis_url, shown, sizeof shown);
    LOG(LL_INFO, "redis: connected to %s", shown);
    if (s->recovered) return;
    struct reqrec *list = NULL;
    size_t n = 0;
    if (reqstore_recover(s->rs, &list, &n) < 0) {
        LOG(LL_WARN, "redis: recovering requests: %s (retrying)", reqstore_errstr(s->rs));
        reqstore_close(s->rs);
        s->rs = NULL;
        return;
    }
    s->recovered = true;
    size_t adopted = adopt_requests(s, list, n);
    if (adopted) LOG(LL_INFO, "redis: resumed %zu accepted, unfinished requests", adopted);
}

/* Stores again every unfinished request this router holds in memory, after
 * Redis lost its data: they were accepted, so they must survive a router
 * restart too.  Each gets a new stream entry pending for this router, and
 * all its tokens so far. */
static void restore_requests(server *s) {
    size_t n = 0, failed = 0;
    for (struct req *q = s->all; q; q = q->next) {
        if (q->state == REQ_DONE || q->finishing) continue;
        struct reqrec r;
        memset(&r, 0, sizeof r);
        snprintf(r.id, sizeof r.id, "%s", q->id);
        r.params = q->params;
        r.params_len = q->params_len;
        r.prompt = q->prompt;
        r.n_prompt = q->n_prompt;
        r.seed = q->seed;
        snprintf(r.owner, sizeof r.owner, "%s", q->owner);
        r.created_ms = q->created_ms;
        r.deadline_ms = q->deadline_ms;
        struct reqstore_append a = {q->id, q->out, q->n_out, q->owner};
        if (reqstore_create(s->rs, &r) < 0 || reqstore_append(s->rs, &a, 1) < 0) {
            failed++;
            LOG(LL_WARN, "request %s: storing it again: %s", q->id, reqstore_errstr(s->rs));
            continue;
        }
        snprintf(q->entry, sizeof q->entry, "%s", r.entry);
        q->n_persisted = q->n_out;
        n++;
    }
    if (n || failed)
        LOG(LL_WARN, "redis: stored %zu unfinished requests again%s", n,
            failed ? " (some failed: see above)" : "");
}

/* Is Redis there, with our data?  Health and /ready say NOT_SERVING and new
 * requests get UNAVAILABLE while it is not: the connection is dropped, and
 * the reconnection (every second) makes the stream and group again. */
static void check_redis(server *s) {
    if (!s->rs) return;
    int rc = reqstore_check(s->rs);
    if (rc < 0) {
        LOG(LL_WARN, "redis: %s: not serving until it answers again", reqstore_errstr(s->rs));
        reqstore_close(s->rs);
        s->rs = NULL;
        return;
    }
    if (rc == 1) restore_requests(s);
}

/* Every live worker's Redis key, in one round trip: a key that existed
 * and is gone means the worker is.  One PTTL each in turn would stop the
 * loop for a round trip per worker every heartbeat interval, which with
 * hundreds of workers is milliseconds in which no step is planned. */
static void check_worker_keys(server *s) {
    if (!s->rs) return;
    size_t nw = registry_n_workers(s->reg), n = 0;
    if (nw == 0) return;
    struct rconn_cmd *cmds = calloc(nw, sizeof *cmds);
    const char **argv = calloc(2 * nw, sizeof *argv);
    char (*keys)[256] = calloc(nw, sizeof *keys);
    struct worker **ws = calloc(nw, sizeof *ws);
    redisReply **replies = calloc(nw, sizeof *replies);
    if (!cmds || !argv || !keys || !ws || !replies) goto done; /* heartbeats still tell */
    for (size_t i = 0; i < nw; i++) {
        struct worker *w = registry_worker_at(s->reg, i);
        if (w->state == WORKER_LOST) continue;
        snprintf(keys[n], sizeof keys[n], "%sworker:%s", s->cfg.redis_prefix, w->id);
        argv[2 * n] = "PTTL";
        argv[2 * n + 1] = keys[n];
        cmds[n] = (struct rconn_cmd){2, &argv[2 * n], NULL};
        ws[n++] = w;
    }
    if (n == 0 || rconn_pipeline(reqstore_conn(s->rs), cmds, n, replies) < 0) goto done; /* Redis trouble */
    for (size_t k = 0; k < n; k++) {
        const redisReply *r = replies[k];
        if (!r || r->type != REDIS_REPLY_INTEGER) continue;
        if (r->integer != -2) {
            ws[k]->redis_key_seen = true;
        } else if (ws[k]->redis_key_seen) {
            LOG(LL_WARN, "worker %s: its Redis key %s expired: lost", ws[k]->id, keys[k]);
            registry_mark_lost(s->reg, ws[k]);
        }
    }
done:
    for (size_t k = 0; replies && k < n; k++)
        if (replies[k]) freeReplyObject(replies[k]);
    free(replies);
    free(ws);
    free(keys);
    free(argv);
    free(cmds);
}

/* SIGHUP (server_config.reload_keys): the allowlists again, each whole or
 * not at all, so that a list caught half-written keeps the old keys in
 * force until the next signal.  Connections already admitted stay. */
static void reload_keys(server *s) {
    *s->cfg.reload_keys = 0;
    if (s->cfg.insecure || !s->zap) {
        LOG(LL_INFO, "router: SIGHUP: no keys to reread (--insecure)");
        return;
    }
    char err[512] = "";
    LOG(LL_INFO, "router: SIGHUP: rereading the key lists");
    if (server_load_client_keys(s, err, sizeof err) < 0)
        LOG(LL_ERROR, "router: SIGHUP: client or admin keys: %s; the ones read before stay admitted", err);
    struct keys_list *l = NULL;
    int rc = keys_list_load(s->cfg.worker_keys, &l, err, sizeof err);
    if (rc == 0 && zio_zap_set(s->zap, "workers", l) < 0) {
        rc = STATUS_NO_MEMORY;
        snprintf(err, sizeof err, "out of memory");
    }
    if (rc == 0)
        LOG(LL_INFO, "router: SIGHUP: %zu worker keys from %s", l->n, s->cfg.worker_keys);
    else
        LOG(LL_ERROR, "router: SIGHUP: worker keys %s: %s; the ones read before stay admitted", s->cfg.worker_keys,
            err);
    keys_list_free(l);
}

/* Routers sharing one Redis (docs/router.md, "Fail-over"): this router
 * shows it is alive by touching its pending stream entries, and with
 * --claim-idle-ms takes over the entries of a router silent that long (dead,
 * or cut off from Redis) and resumes those requests.  Their clients
 * re-attach here by id and get what they missed; their workers, having
 * lost that router, register here. */
static void share_stream(server *s) {
    if (!s->rs || !s->recovered) return;
    if (reqstore_touch(s->rs) < 0) {
        LOG(LL_WARN, "redis: touching this router's stream entries: %s", reqstore_errstr(s->rs));
        return;
    }
    if (s->cfg.claim_idle_ms <= 0) return;
    struct reqrec *list = NULL;
    size_t n = 0;
    if (reqstore_claim(s->rs, &list, &n) < 0) {
        LOG(LL_WARN, "redis: claiming idle requests: %s", reqstore_errstr(s->rs));
        return;
    }
    size_t adopted = adopt_requests(s, list, n);
    if (adopted)
        LOG(LL_WARN, "redis: took over %zu requests of a router silent for %d ms or more: resuming them",
            adopted, s->cfg.claim_idle_ms);
}

void server_timers(server *s) {
    /* Before the 50 ms gate: the signal interrupted the poll, and whoever
     * sent it waits for the new keys. */
    if (s->cfg.reload_keys && *s->cfg.reload_keys) reload_keys(s);
    int64_t now = server_now_ms();
    if (now - s->last_timer_ms < 50) return;
    s->last_timer_ms = now;
    if (!s->rs && now - s->last_redis_try_ms >= 1000) {
        s->last_redis_try_ms = now;
        server_redis_connect(s);
    }
    registry_expire(s->reg, now, pipe_on_drop, s);
    server_spin_auto(s);
    if (now - s->last_keys_ms >= s->cfg.heartbeat_ms) {
        s->last_keys_ms = now;
        check_redis(s);
        check_worker_keys(s);
        share_stream(s);
    }
    /* Steps without a result for too long: re-form the pipeline. */
    for (size_t i = 0; i < registry_n_pipelines(s->reg); i++) {
        struct pipeline *p = registry_pipeline_at(s->reg, i);
        struct pipe *pp = p->ud;
        if (!pp || !pp->sched) continue;
        for (int32_t k = 0; k < pp->n_flights; k++)
            if (now - pp->flights[k].sent_ms > s->cfg.step_timeout_ms) {
                LOG(LL_WARN, "pipeline %u: step %llu has no result after %lld ms: re-forming", p->id,
                    (unsigned long long)pp->flights[k].step_id, (long long)(now - pp->flights[k].sent_ms));
                registry_pipeline_bump(s->reg, p);
                break;
            }
    }
    /* Accepted requests with nowhere to run: once the stall has lasted
     * about a heartbeat (a pipeline re-forming is not one), their clients
     * hear why, so that they stop waiting when their bound says so. */
    int32_t cap;
    uint32_t pid;
    if (pipes_taking_work(s, &cap, &pid) > 0) {
        s->idle_since_ms = 0;
    } else if (s->idle_since_ms == 0) {
        s->idle_since_ms = now;
    } else if (now - s->idle_since_ms >= SERVER_RETRY_AFTER_MS) {
        for (size_t i = 0; i < s->n_queue; i++) {
            struct req *q = s->queue[i];
            if (!q->stall_told && !q->finishing) pipes_tell_stalled(s, q, q->ident, q->ident_len, 0);
        }
    }
    /* Deadlines, unfinished stores, forgetting finished requests. */
    for (struct req *q = s->all, *next; q; q = next) {
        next = q->next;
        if (q->state != REQ_DONE && !q->finishing && q->deadline_ms && now >= q->deadline_ms) {
            req_end(s, q, LLM__GENERATE_DONE__FINISH_REASON__DEADLINE, -1, NULL,
                    LLM__ERROR__CODE__DEADLINE_EXCEEDED, "the request's deadline passed");
            continue;
        }
        if (q->state == REQ_DONE && !q->finish_stored && s->rs) req_store_finish(s, q);
        if (q->state == REQ_DONE && q->finish_stored && !q->touched &&
            (now - q->done_ms > (int64_t)s->cfg.retention_s * 1000 || s->n_done > SERVER_DONE_MEMORY_MAX)) {
            req_unlink(s, q);
            req_free(q);
        }
    }
    if (now - s->last_stats_ms >= 60000) {
        if (s->steps_total != s->stats_steps_mark) server_log_stats(s);
        s->stats_steps_mark = s->steps_total;
        s->last_stats_ms = now;
    }
    /* Throughput, once a second. */
    if (now - s->last_rate_ms >= 1000) {
        double dt = (double)(now - s->last_rate_ms) / 1000.0;
        if (s->last_rate_ms) {
            s->tok_s = 0.5 * s->tok_s + 0.5 * (double)(s->gen_total - s->rate_gen_mark) / dt;
            s->prompt_tok_s = 0.5 * s->prompt_tok_s + 0.5 * (double)(s->prompt_total - s->rate_prompt_mark) / dt;
            for (size_t i = 0; i < registry_n_pipelines(s->reg); i++) {
                struct pipe *pp = registry_pipeline_at(s->reg, i)->ud;
                if (!pp) continue;
                pp->tok_s = 0.5 * pp->tok_s + 0.5 * (double)(pp->gen_tokens - pp->gen_mark) / dt;
                pp->prompt_tok_s = 0.5 * pp->prompt_tok_s + 0.5 * (double)(pp->prompt_tokens - pp->prompt_mark) / dt;
                pp->gen_mark = pp->gen_tokens;
                pp->prompt_mark = pp->prompt_tokens;
            }
        }
        s->rate_gen_mark = s->gen_total;
        s->rate_prompt_mark = s->prompt_total;
        s->last_rate_ms = now;
    }
}
