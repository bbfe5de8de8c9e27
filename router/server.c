/* The router's event loop: client requests in (validated, tokenized, made
 * durable in Redis, then acknowledged), step plans out to the pipelines'
 * stages, sampled tokens back (persisted, detokenized, streamed), and the
 * bookkeeping around them: re-attach, cancel, deadlines, worker liveness,
 * pipelines joining, draining and failing.  Single-threaded: every state
 * change happens here, between two zmq_poll calls.  This file holds the
 * loop, init and free, and the sockets' send and receive. */
#include "router/server.h"
#include "router/server-impl.h"
#include "router/server_metrics.h"
#include "common/watchdog.h"

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

int64_t server_now_ms(void) {
    struct timespec ts;
    clock_gettime(CLOCK_REALTIME, &ts);
    return (int64_t)ts.tv_sec * 1000 + ts.tv_nsec / 1000000;
}

int64_t server_mono_us(void) {
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (int64_t)ts.tv_sec * 1000000 + ts.tv_nsec / 1000;
}

int server_grow(void **p, size_t *cap, size_t want, size_t elem) {
    if (want <= *cap) return 0;
    size_t n = *cap ? *cap : 64;
    while (n < want) n *= 2;
    void *q = realloc(*p, n * elem);
    if (!q) return STATUS_NO_MEMORY;
    *p = q;
    *cap = n;
    return 0;
}

/* ------------------------------------------------------------------------ */
/* Clients that go away: the connections a send failed to, by routing id */

static uint32_t gone_hash(const uint8_t *p, size_t n) {
    uint32_t h = 2166136261u;
    for (size_t i = 0; i < n; i++) h = (h ^ p[i]) * 16777619u;
    return h % SERVER_GONE_BUCKETS;
}

static struct gone **gone_find(server *s, const uint8_t *ident, size_t ident_len) {
    struct gone **pp = &s->gone[gone_hash(ident, ident_len)];
    for (; *pp; pp = &(*pp)->next)
        if ((*pp)->ident_len == ident_len && memcmp((*pp)->ident, ident, ident_len) == 0) break;
    return pp;
}

/* The connection took a message, or sent one: it is there. */
static void gone_clear(server *s, const uint8_t *ident, size_t ident_len) {
    if (s->n_gone == 0) return;
    struct gone **pp = gone_find(s, ident, ident_len), *g = *pp;
    if (!g) return;
    *pp = g->next;
    free(g);
    s->n_gone--;
}

/* A send to the connection failed: it closed (ZMQ_ROUTER_MANDATORY says
 * EHOSTUNREACH once ZeroMQ has dropped its routing id) or it stopped
 * reading (its high-water mark is reached: EAGAIN).  The first failure
 * starts the clock. */
static void gone_mark(server *s, const uint8_t *ident, size_t ident_len) {
    if (ident_len > sizeof ((struct gone *)0)->ident) return;
    struct gone **pp = gone_find(s, ident, ident_len);
    if (*pp) return;
    struct gone *g = calloc(1, sizeof *g);
    if (!g) return;
    memcpy(g->ident, ident, ident_len);
    g->ident_len = ident_len;
    g->since_ms = server_now_ms();
    *pp = g;
    s->n_gone++;
}

/* ------------------------------------------------------------------------ */
/* Sending */

void server_send_client(server *s, const uint8_t *ident, size_t ident_len, Llm__ClientEnvelope *env) {
    if (ident_len == 0) return;
    uint8_t *buf = NULL;
    size_t len = 0;
    char err[256];
    if (proto_client_pack(env, &buf, &len, err, sizeof err) < 0) {
        LOG(LL_ERROR, "client reply: %s", err);
        return;
    }
    struct zio_frame f[2] = {{ident, ident_len, NULL, NULL}, {buf, len, proto_buf_free, NULL}};
    /* Never block the loop on a slow client: it re-attaches for what it missed. */
    int rc = zio_send(s->cs, f, 2, ZMQ_DONTWAIT);
    if (rc < 0) {
        s->sends_dropped++;
        LOG(LL_DEBUG, "client send dropped: %s", zio_errstr(s->cs));
        if (rc == STATUS_UNAVAILABLE || rc == STATUS_EXHAUSTED) gone_mark(s, ident, ident_len);
    } else {
        gone_clear(s, ident, ident_len);
    }
}

void server_send_client_error(server *s, const uint8_t *ident, size_t ident_len, uint64_t tag,
                              Llm__Error__Code code, const char *rid, const char *msg,
                              uint32_t retry_after_ms) {
    server_send_client_error_reason(s, ident, ident_len, tag, code, NULL, rid, msg, retry_after_ms);
}

void server_send_client_error_reason(server *s, const uint8_t *ident, size_t ident_len, uint64_t tag,
                                     Llm__Error__Code code, const char *reason, const char *rid,
                                     const char *msg, uint32_t retry_after_ms) {
    char *whole = proto_error_text(msg);
    Llm__Error e;
    proto_error_init(&e, code, rid, whole ? whole : "", retry_after_ms);
    if (reason) e.reason = (char *)reason;
    Llm__ClientEnvelope env = LLM__CLIENT_ENVELOPE__INIT;
    env.tag = tag;
    env.body_case = LLM__CLIENT_ENVELOPE__BODY_ERROR;
    env.error = &e;
    LOG(LL_DEBUG, "request %s: %s: %s", rid && rid[0] ? rid : "-", proto_code_name(code), e.message);
    server_send_client(s, ident, ident_len, &env);
    free(whole);
}

int server_send_worker(server *s, const uint8_t *ident, size_t ident_len, const uint8_t *buf, size_t len) {
    struct zio_frame f[2] = {{ident, ident_len, NULL, NULL}, {buf, len, NULL, NULL}};
    int rc = zio_send(s->ws, f, 2, ZMQ_DONTWAIT);
    if (rc < 0)
        LOG(LL_DEBUG, "worker %.*s: send of %zu bytes not queued: %s", (int)ident_len, (const char *)ident, len,
            zio_errstr(s->ws));
    return rc;
}

int server_send_worker_env(server *s, const uint8_t *ident, size_t ident_len, Llm__WorkerEnvelope *env) {
    uint8_t *buf = NULL;
    size_t len = 0;
    char err[256];
    if (proto_worker_pack(env, &buf, &len, err, sizeof err) < 0) {
        LOG(LL_ERROR, "worker message: %s", err);
        return STATUS_INTERNAL;
    }
    int rc = server_send_worker(s, ident, ident_len, buf, len);
    free(buf);
    return rc;
}

/* ------------------------------------------------------------------------ */

int server_load_client_keys(server *s, char *err, size_t errlen) {
    const struct server_config *c = &s->cfg;
    struct keys_list *clients = NULL, *admins = NULL, *both = NULL;
    int rc = keys_list_load(c->client_keys, &clients, err, errlen);
    if (rc == 0 && c->admin_keys && c->admin_keys[0]) rc = keys_list_load(c->admin_keys, &admins, err, errlen);
    /* An admin is a client too: the socket admits both lists. */
    size_t n = clients ? clients->n : 0, m = admins ? admins->n : 0;
    if (rc == 0 && (!(both = calloc(1, sizeof *both)) || !(both->e = calloc(n + m, sizeof *both->e)))) {
        rc = status_fail(err, errlen, STATUS_NO_MEMORY, "router: out of memory for %zu keys", n + m);
    } else if (rc == 0) {
        memcpy(both->e, clients->e, n * sizeof *both->e);
        if (m) memcpy(both->e + n, admins->e, m * sizeof *both->e);
        both->n = n + m;
        rc = zio_zap_set(s->zap, "clients", both);
        if (rc < 0) snprintf(err, errlen, "router: out of memory for %zu keys", n + m);
    }
    if (rc == 0) {
        keys_list_free(s->admins);
        s->admins = admins;
        admins = NULL;
        LOG(LL_INFO, "router: %zu client keys (%s), %zu admin keys (%s)", n, c->client_keys, m,
            m ? c->admin_keys : "none: admin messages refused");
    }
    keys_list_free(both);
    keys_list_free(admins);
    keys_list_free(clients);
    return rc;
}

/* CURVE on both sockets, each admitting its own list (docs/security.md), or
 * plain sockets with a warning.  Before bind: the mechanism is fixed then. */
static int server_secure(server *s, char *err, size_t errlen) {
    const struct server_config *c = &s->cfg;
    if (c->insecure) {
        LOG(LL_WARN, "router: --insecure: client and worker sockets are plain; anyone who "
            "reaches %s or %s is served", c->listen, c->worker_listen);
        return 0;
    }
    if (!c->curve_key_file || !c->curve_key_file[0] || !c->client_keys || !c->client_keys[0] ||
        !c->worker_keys || !c->worker_keys[0])
        return status_fail(err, errlen, STATUS_BAD_INPUT,
                           "router: no keys: give --curve-key-file, --client-keys and --worker-keys "
                           "(llm keygen writes key pairs), or --insecure for plain sockets");
    struct keys_pair kp;
    struct keys_list *workers = NULL;
    int rc = keys_pair_load(c->curve_key_file, &kp, err, errlen);
    if (rc == 0) rc = keys_list_load(c->worker_keys, &workers, err, errlen);
    if (rc == 0) rc = zio_zap_start(s->zctx, &s->zap, err, errlen);
    if (rc == 0) rc = server_load_client_keys(s, err, errlen);
    if (rc == 0) rc = zio_zap_set(s->zap, "workers", workers);
    if (rc == 0) {
        LOG(LL_INFO, "router: CURVE on, key %s; %zu worker keys (%s)", kp.pub, workers->n, c->worker_keys);
        if ((rc = zio_curve_server(s->cs, &kp, "clients")) < 0 ||
            (rc = zio_curve_server(s->ws, &kp, "workers")) < 0)
            snprintf(err, errlen, "router: %s", zio_errstr(rc == 0 ? s->ws : s->cs));
    }
    keys_list_free(workers);
    memset(&kp, 0, sizeof kp);
    return rc;
}

static int worker_monitor_open(server *s, char *err, size_t errlen);

int server_init(server **out, const struct server_config *cfg, char *err, size_t errlen) {
    *out = NULL;
    server *s = calloc(1, sizeof *s);
    if (!s) {
        snprintf(err, errlen, "router: out of memory");
        return STATUS_NO_MEMORY;
    }
    s->cfg = *cfg;
    s->peer_key = "";
    if (s->cfg.step_timeout_ms <= 0) s->cfg.step_timeout_ms = 30000;
    if (s->cfg.retention_s <= 0) s->cfg.retention_s = 3600;
    if (!s->cfg.redis_prefix) s->cfg.redis_prefix = "llm:";
    if (!s->cfg.router_id) s->cfg.router_id = "router";
    if (s->cfg.spec_tokens <= 0) s->cfg.spec_tokens = 4;
    if (s->cfg.spec_tokens > SERVER_SPEC_TOKENS_MAX) s->cfg.spec_tokens = SERVER_SPEC_TOKENS_MAX;
    int rc;
    if (!cfg->model_path || !cfg->model_path[0]) {
        snprintf(err, errlen, "router: --model is required (a .gguf file or a Hugging Face directory)");
        rc = STATUS_BAD_INPUT;
        goto fail;
    }
    if ((rc = modelinfo_load(&s->mi, cfg->model_path, err, errlen)) < 0) goto fail;
    if ((rc = tokenizer_load(&s->tok, cfg->model_path, err, errlen)) < 0) goto fail;
    if (s->mi.n_vocab <= 0) s->mi.n_vocab = tokenizer_n_vocab(s->tok);
    s->detok_size = tokenizer_detok_size_max(s->tok) + 1;
    s->detok_buf = malloc(s->detok_size);
    if (!s->detok_buf) {
        rc = STATUS_NO_MEMORY;
        snprintf(err, errlen, "router: out of memory");
        goto fail;
    }
    /* Epochs count up from the start time in microseconds: a restarted
     * router's are above its predecessor's, and routers started together (a
     * fail-over pair) count from different bases, so that a worker moving
     * between them is not given an epoch it has had, which its links would
     * take for the old router's (docs/worker.md).  Microseconds stay below
     * 2^53 (for two centuries yet), so an epoch is exact as a JSON number
     * (llm status --json) and as a metric's float. */
    struct timespec now;
    clock_gettime(CLOCK_REALTIME, &now);
    const uint64_t epoch_base = (uint64_t)now.tv_sec * 1000000 + (uint64_t)now.tv_nsec / 1000;
    struct registry_config rc_cfg = {&s->mi, (uint32_t)(cfg->stages > 0 ? cfg->stages : 1),
                                     cfg->worker_timeout_ms, (int64_t)cfg->worker_timeout_ms * 10, epoch_base};
    if ((rc = registry_init(&s->reg, &rc_cfg)) < 0) {
        snprintf(err, errlen, "router: out of memory");
        goto fail;
    }
    s->zctx = zmq_ctx_new();
    if (!s->zctx) {
        snprintf(err, errlen, "router: zmq_ctx_new: %s", zmq_strerror(errno));
        rc = STATUS_IO;
        goto fail;
    }
    if ((rc = zio_sock_open(s->zctx, ZMQ_ROUTER, &s->cs, err, errlen)) < 0) goto fail;
    if ((rc = zio_sock_open(s->zctx, ZMQ_ROUTER, &s->ws, err, errlen)) < 0) goto fail;
    zio_set_int(s->cs, ZMQ_SNDHWM, 100000);
    zio_set_int(s->cs, ZMQ_RCVHWM, 100000);
    zio_set_int(s->ws, ZMQ_SNDHWM, 100000);
    zio_set_int(s->ws, ZMQ_RCVHWM, 100000);
    /* Auto starts blocking: no worker has registered yet. */
    s->spin_us = s->cfg.spin_us > 0 ? s->cfg.spin_us : 0;
    zio_set_spin(s->ws, s->spin_us);
    /* The results come through this context's I/O thread, idle while a
     * pipeline's step runs: keep it awake while the loop spins. */
    if (s->spin_us > 0 && zio_set_warm(s->ws, s->zctx) < 0)
        LOG(LL_WARN, "--spin-us %d without warm ticks: %s", s->spin_us, zio_errstr(s->ws));
    /* A worker that restarts reconnects with the same routing id (its
     * worker_id): hand the id over to the new connection.  Not with keys:
     * any admitted peer could then take a live worker's connection by
     * naming its routing id; a second connection with a live id is refused
     * instead, and the router learns a worker's connection from its
     * authenticated registration and heartbeats. */
    zio_set_int(s->ws, ZMQ_ROUTER_HANDOVER, cfg->insecure ? 1 : 0);
    zio_set_int(s->cs, ZMQ_ROUTER_HANDOVER, 1);
    /* A send to a client connection that has closed fails (EHOSTUNREACH)
     * instead of vanishing, and one to a full connection says EAGAIN: both
     * start the grace after which its requests are cancelled. */
    zio_set_int(s->cs, ZMQ_ROUTER_MANDATORY, 1);
    /* The same on the worker socket: a plan or a free sent while a
     * worker's connection is gone (its ZeroMQ heartbeat timed out, it is
     * reconnecting) is an error instead of vanishing, so that its pipeline
     * leaves service and re-forms at once (pipe_unreachable) rather than
     * waiting on a step that can never finish. */
    zio_set_int(s->ws, ZMQ_ROUTER_MANDATORY, 1);
    if ((rc = worker_monitor_open(s, err, errlen)) < 0) goto fail;
    if ((rc = server_secure(s, err, errlen)) < 0) goto fail;
    if ((rc = zio_bind(s->cs, cfg->listen)) < 0) {
        snprintf(err, errlen, "router: client endpoint: %s", zio_errstr(s->cs));
        goto fail;
    }
    if ((rc = zio_bind(s->ws, cfg->worker_listen)) < 0) {
        snprintf(err, errlen, "router: worker endpoint: %s", zio_errstr(s->ws));
        goto fail;
    }
    s->start_ms = server_now_ms();
    s->next_seq_id = (uint64_t)s->start_ms << 16; /* never reuse ids a worker may still hold */
    s->next_step_id = (uint64_t)s->start_ms << 16;
    LOG(LL_INFO, "router: model %s (%s, %d layers, context %d, vocabulary %d); clients on %s, workers on %s",
        s->mi.id, s->mi.arch, s->mi.n_layers, s->mi.n_ctx, s->mi.n_vocab, zio_endpoint(s->cs),
        zio_endpoint(s->ws));
    s->last_redis_try_ms = server_now_ms();
    server_redis_connect(s);
    *out = s;
    return STATUS_OK;
fail:
    server_free(s);
    return rc;
}

void server_free(server *s) {
    if (!s) return;
    if (s->reg) {
        for (size_t i = 0; i < registry_n_pipelines(s->reg); i++) {
            struct pipeline *p = registry_pipeline_at(s->reg, i);
            struct pipe *pp = p->ud;
            if (pp) {
                sched_free(pp->sched);
                pipe_free(pp);
                p->ud = NULL;
            }
        }
        registry_free(s->reg);
    }
    for (struct req *q = s->all, *next; q; q = next) {
        next = q->next;
        req_free(q);
    }
    for (int i = 0; i < SERVER_GONE_BUCKETS; i++)
        for (struct gone *g = s->gone[i], *next; g; g = next) {
            next = g->next;
            free(g);
        }
    keys_list_free(s->admins);
    free(s->queue);
    free(s->touched);
    free(s->pipes_touched);
    free(s->scratch);
    free(s->detok_buf);
    zio_sock_close(s->cs);
    if (s->wmon) zmq_socket_monitor(zio_sock_raw(s->ws), NULL, 0);
    zio_sock_close(s->wmon);
    free(s->wconns);
    zio_sock_close(s->ws);
    zio_zap_stop(s->zap);
    if (s->zctx) zmq_ctx_term(s->zctx);
    reqstore_close(s->rs);
    tokenizer_free(s->tok);
    modelinfo_free(&s->mi);
    free(s);
}

void server_spin_auto(server *s) {
    if (s->cfg.spin_us >= 0) return;
    size_t gpus = registry_n_gpu_stages(s->reg);
    int want = gpus > 0 ? ZIO_SPIN_US_GPU : 0;
    if (want == s->spin_us) return;
    s->spin_us = want;
    zio_set_spin(s->ws, want);
    if (want > 0) {
        /* As with an explicit --spin-us; a second call keeps the first pair. */
        if (zio_set_warm(s->ws, s->zctx) < 0)
            LOG(LL_WARN, "--spin-us auto without warm ticks: %s", zio_errstr(s->ws));
        LOG(LL_INFO, "router: spinning up to %d us in waits for workers (--spin-us auto: %zu GPU workers "
            "in pipelines)", want, gpus);
    } else {
        LOG(LL_INFO, "router: waits for workers block at once (--spin-us auto: no GPU worker in a pipeline)");
    }
}

const char *server_client_endpoint(const server *s) { return zio_endpoint(s->cs); }
const char *server_worker_endpoint(const server *s) { return zio_endpoint(s->ws); }

void server_log_stats(server *s) {
    LOG(LL_INFO, "router: %llu requests, %llu steps; per step: planning %.1f us mean (%.1f max), "
        "result-to-next-plans %.1f us mean; %llu frames rejected, %llu client sends dropped, %llu stale results; "
        "refused: %llu client and %llu worker handshakes, %llu worker messages from a key not the id's; "
        "%llu requests cancelled because their client went away",
        (unsigned long long)s->requests_total, (unsigned long long)s->steps_total,
        s->plan_n ? s->plan_us_sum / (double)s->plan_n : 0.0, s->plan_us_max,
        s->turn_n ? s->turn_us_sum / (double)s->turn_n : 0.0,
        (unsigned long long)(proto_frames_rejected() + s->frames_bad), (unsigned long long)s->sends_dropped,
        (unsigned long long)s->stale_results,
        (unsigned long long)(s->zap ? zio_zap_refused(s->zap, "clients") : 0),
        (unsigned long long)(s->zap ? zio_zap_refused(s->zap, "workers") : 0),
        (unsigned long long)s->workers_refused, (unsigned long long)s->clients_gone);
}

/* An empty chunk (no tokens, no text, at a position the client has) for a
 * request that has nothing to stream for now: queued, in prefill, or not
 * streaming.  Clients drop a chunk whose tokens they have (docs/protocol.md),
 * so it changes nothing there; its send failing is how the router learns that
 * such a request's client has gone. */
static void probe_client(server *s, struct req *q) {
    Llm__GenerateChunk c = LLM__GENERATE_CHUNK__INIT;
    c.request_id = q->id;
    c.index = q->stream ? (uint32_t)q->n_sent : 0;
    c.text = "";
    Llm__ClientEnvelope env = LLM__CLIENT_ENVELOPE__INIT;
    env.body_case = LLM__CLIENT_ENVELOPE__BODY_CHUNK;
    env.chunk = &c;
    server_send_client(s, q->ident, q->ident_len, &env);
}

/* Cancels the unfinished requests whose client has gone for
 * cfg.client_gone_ms: its connection refused their chunks (or took none)
 * that long, or they have had no connection (recovered after a restart)
 * that long, and no Generate re-attached them meanwhile.  A re-attach from
 * another connection moves the request there, which ends its grace. */
static void server_clients_gone(server *s) {
    int64_t grace = s->cfg.client_gone_ms;
    int64_t now = server_now_ms();
    if (grace <= 0 || now - s->last_gone_ms < 100) return;
    s->last_gone_ms = now;
    int64_t probe_every = grace / 2 < 1000 ? grace / 2 : 1000;
    bool probe = now - s->last_probe_ms >= probe_every;
    if (probe) s->last_probe_ms = now;
    for (struct req *q = s->all; q; q = q->next) {
        if (q->state == REQ_DONE || q->finishing) continue;
        if (q->client_seen_ms == 0) q->client_seen_ms = now;
        int64_t since = q->client_seen_ms; /* the client was known to be there */
        if (q->ident_len > 0) {
            struct gone *g = s->n_gone ? *gone_find(s, q->ident, q->ident_len) : NULL;
            if (probe && (!q->stream || q->n_out == 0)) {
                probe_client(s, q);
                if (!g && s->n_gone) g = *gone_find(s, q->ident, q->ident_len);
            }
            if (!g) continue;
            if (g->since_ms > since) since = g->since_ms;
        }
        if (now - since < grace) continue;
        s->clients_gone++;
        char msg[160];
        snprintf(msg, sizeof msg, "its client went away: unreachable for %lld ms (--client-gone-ms %d)",
                 (long long)(now - since), s->cfg.client_gone_ms);
        LOG(LL_INFO, "request %s: cancelled after %d tokens: %s", q->id, q->n_out, msg);
        req_end(s, q, LLM__GENERATE_DONE__FINISH_REASON__CANCELLED, -1, NULL, LLM__ERROR__CODE__CANCELLED, msg);
    }
    /* Every request of a connection gone this long has been cancelled or
     * moved: its entry is no longer needed. */
    for (int i = 0; i < SERVER_GONE_BUCKETS; i++)
        for (struct gone **pp = &s->gone[i]; *pp;) {
            struct gone *g = *pp;
            if (now - g->since_ms > 2 * grace + 1000) {
                *pp = g->next;
                free(g);
                s->n_gone--;
            } else {
                pp = &g->next;
            }
        }
}

/* ------------------------------------------------------------------------ */
/* Worker connections that close */

/* A monitor on the worker socket reports each closed connection at once
 * (DISCONNECTED, with its file descriptor).  A worker killed mid-step
 * (kill -9, out of memory) never heartbeats again, and no plan to it fails
 * while its pipeline waits on the step it had (plans go out a step
 * ahead): without this its pipeline would stand still until its Redis key
 * expired (3 heartbeat intervals) or --worker-timeout-ms. */
static int worker_monitor_open(server *s, char *err, size_t errlen) {
    char ep[64];
    snprintf(ep, sizeof ep, "inproc://llm-router-workers-%p", (void *)s);
    if (zmq_socket_monitor(zio_sock_raw(s->ws), ep, ZMQ_EVENT_DISCONNECTED) != 0) {
        snprintf(err, errlen, "router: worker socket monitor: %s", zmq_strerror(errno));
        return STATUS_IO;
    }
    int rc = zio_sock_open(s->zctx, ZMQ_PAIR, &s->wmon, err, errlen);
    if (rc == 0 && (rc = zio_connect(s->wmon, ep)) < 0)
        snprintf(err, errlen, "router: worker socket monitor: %s", zio_errstr(s->wmon));
    return rc;
}

/* The message m came from ident's connection: remember its descriptor. */
static void worker_conn_note(server *s, const uint8_t *ident, size_t ident_len, zmq_msg_t *m) {
    int fd = zmq_msg_get(m, ZMQ_SRCFD);
    if (fd < 0 || ident_len > sizeof s->wconns->ident) return;
    for (size_t i = 0; i < s->n_wconns; i++) {
        struct wconn *c = &s->wconns[i];
        if (c->ident_len == ident_len && memcmp(c->ident, ident, ident_len) == 0) {
            c->fd = fd;
            return;
        }
    }
    if (s->n_wconns == s->cap_wconns) {
        size_t cap = s->cap_wconns ? 2 * s->cap_wconns : 16;
        struct wconn *n = realloc(s->wconns, cap * sizeof *n);
        if (!n) return; /* then only the heartbeats and the Redis key tell */
        s->wconns = n;
        s->cap_wconns = cap;
    }
    struct wconn *c = &s->wconns[s->n_wconns++];
    c->fd = fd;
    memcpy(c->ident, ident, ident_len);
    c->ident_len = ident_len;
}

/* The connection on descriptor fd closed.  A READY worker on it leaves its
 * pipeline's service in a new epoch at once, as when a plan cannot be sent
 * to it (registry_worker_unreachable): its sequences move on, and a worker
 * that lives registers again on its new connection (a new session), which
 * re-forms the pipeline anyway.  A draining worker is leaving on purpose. */
static void worker_conn_closed(server *s, int fd) {
    for (size_t i = 0; i < s->n_wconns;) {
        struct wconn *c = &s->wconns[i];
        if (c->fd != fd) {
            i++;
            continue;
        }
        for (size_t k = 0; k < registry_n_workers(s->reg); k++) {
            struct worker *w = registry_worker_at(s->reg, k);
            if (w->ident_len != c->ident_len || memcmp(w->ident, c->ident, c->ident_len) != 0) continue;
            if (w->state == WORKER_READY) {
                LOG(LL_WARN, "worker %s (stage %u of pipeline %u): its connection closed: the pipeline leaves "
                    "service and re-forms once the worker is heard from", w->id, w->stage_index, w->pipeline_id);
                registry_worker_unreachable(s->reg, w, true);
                s->loop_full = true;
            }
        }
        *c = s->wconns[--s->n_wconns];
    }
}

/* Reads the monitor's events. */
static void worker_disconnects(server *s) {
    struct zio_parts p = {0};
    while (zio_recv(s->wmon, &p, 0) == 0) {
        if (zio_parts_size(&p, 0) < 6) continue;
        uint16_t e;
        uint32_t fd;
        memcpy(&e, zio_parts_data(&p, 0), 2);
        memcpy(&fd, (const uint8_t *)zio_parts_data(&p, 0) + 2, 4);
        if (e & ZMQ_EVENT_DISCONNECTED) worker_conn_closed(s, (int)fd);
    }
    zio_parts_free(&p);
}

/* Reads up to max messages from a ROUTER socket without waiting. */
static void drain(server *s, struct zio_sock *sock, bool workers, int max) {
    struct zio_parts in = {0};
    for (int i = 0; i < max; i++) {
        int rc = zio_recv(sock, &in, 0);
        if (rc < 0) break;
        const uint8_t *ident = zio_parts_data(&in, 0);
        size_t ident_len = zio_parts_size(&in, 0);
        s->peer_key = zio_user_id_key(zio_parts_user_id(&in));
        if (in.n != 2) {
            /* One frame after the routing id is the protocol. */
            s->frames_bad++;
            char msg[128];
            snprintf(msg, sizeof msg, "a message must be exactly one frame; got %zu", in.n ? in.n - 1 : 0);
            if (workers) {
                uint8_t *out = NULL;
                size_t olen = 0;
                if (proto_worker_error_pack(LLM__ERROR__CODE__INVALID_ARGUMENT, "", msg, 0, &out, &olen) == 0) {
                    server_send_worker(s, ident, ident_len, out, olen);
                    free(out);
                }
            } else {
                server_send_client_error(s, ident, ident_len, 0, LLM__ERROR__CODE__INVALID_ARGUMENT, "", msg, 0);
            }
            continue;
        }
        if (workers) {
            worker_conn_note(s, ident, ident_len, &in.msgs[1]);
            server_on_worker_frame(s, ident, ident_len, zio_parts_data(&in, 1), zio_parts_size(&in, 1));
        }
        else {
            gone_clear(s, ident, ident_len);
            server_on_client_frame(s, ident, ident_len, zio_parts_data(&in, 1), zio_parts_size(&in, 1));
        }
    }
    s->peer_key = ""; /* it pointed into the frames freed here */
    zio_parts_free(&in);
}

int server_run(server *s, volatile sig_atomic_t *stop) {
    struct zio_sock *socks[3] = {s->ws, s->cs, s->wmon};
    short events[3] = {ZMQ_POLLIN, ZMQ_POLLIN, ZMQ_POLLIN}, revents[3];
    while (!*stop) {
        /* A turn takes at most the 50 ms poll plus its work: /health fails
         * when one takes longer than the watchdog's bound. */
        watchdog_beat(s->cfg.watchdog, 0);
        /* A pipeline's batch wait ends within the poll: the last part of a
         * millisecond spins (zmq_poll counts whole ones). */
        int timeout_ms = 50;
        if (s->batch_wake_us) {
            int64_t left = s->batch_wake_us - server_mono_us();
            timeout_ms = left <= 0 ? 0 : left / 1000 < 50 ? (int)(left / 1000) : 50;
        }
        int rc = zio_poll(socks, events, revents, 3, timeout_ms);
        if (rc < 0) {
            LOG(LL_ERROR, "poll: %s", zio_errstr(s->ws));
            usleep(10000);
        }
        /* Workers first: results free the pipeline for the next step. */
        if (rc > 0 && (revents[0] & ZMQ_POLLIN)) drain(s, s->ws, true, 1024);
        if (rc > 0 && (revents[1] & ZMQ_POLLIN)) drain(s, s->cs, false, 256);
        /* After the workers' messages: a result that came before the
         * connection closed still counts. */
        if (rc > 0 && (revents[2] & ZMQ_POLLIN)) worker_disconnects(s);
        server_timers(s);
        server_clients_gone(s);
        /* Each result has pumped its own pipeline, and new requests touch
         * the pipelines they go to: a turn walks every pipeline only when
         * something else came (a registration, a worker's new state) and
         * every 50 ms (liveness, deadlines, cancels, the gauges), so that
         * a result costs its own pipeline and not all of them. */
        int64_t now_ms = server_mono_us() / 1000;
        bool full = s->loop_full || now_ms - s->last_full_ms >= 50;
        if (full) {
            s->loop_full = false;
            s->last_full_ms = now_ms;
            pipes_sync(s);
        }
        pipes_assign(s);
        /* A batch wait ended: every waiting pipeline plans now, or sets
         * the next wake. */
        bool wake = s->batch_wake_us && server_mono_us() >= s->batch_wake_us;
        if (wake) s->batch_wake_us = 0;
        if (full || wake) pipes_pump(s);
        req_flush_touched(s);
        pipes_pump_touched(s);
        if (full) server_metrics_tick(s);
    }
    server_log_stats(s);
    LOG(LL_INFO, "router: stopping");
    return 0;
}

