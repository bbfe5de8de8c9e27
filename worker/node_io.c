/* The worker's messages to and from the router and Redis (io thread):
 * Register, heartbeats, the registry key, and each message from the router
 * checked and handed to the compute thread. */
#include "node-impl.h"

#include "common/log.h"
#include "common/rconn.h"
#include "common/status.h"

#include <errno.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>
#include <zmq.h>

/* Packs this worker's Register (placement read under the lock). */
static int node_register_pack(node *n, uint8_t **buf, size_t *len) {
    Llm__Register r = LLM__REGISTER__INIT;
    char model[256], device[192], draft_name[256] = "";
    const char *path = n->s_model, *slash = strrchr(path, '/');
    snprintf(model, sizeof model, "%s", slash && slash[1] ? slash + 1 : path);
    if (n->s_draft) {
        /* its name, as the model's: a path on this host means little to
         * whoever reads llm status */
        slash = strrchr(n->s_draft, '/');
        snprintf(draft_name, sizeof draft_name, "%s", slash && slash[1] ? slash + 1 : n->s_draft);
    }
    snprintf(device, sizeof device, "%s", backend_name(n->b));
    pthread_mutex_lock(&n->lock);
    r.worker_id = n->s_worker_id;
    r.incarnation = n->incarnation;
    r.pipeline_id = n->pipeline_id;
    r.stage_index = (uint32_t)n->stage_index;
    r.stage_count = (uint32_t)n->stage_count;
    r.layer_first = (uint32_t)n->layer_first;
    r.layer_end = (uint32_t)n->layer_end;
    r.model = model;
    r.backend = backend_is_gpu(n->b) ? "cuda" : "cpu";
    r.device = device;
    r.device_memory_bytes = n->mem_total;
    r.kv_block_count = atomic_load(&n->kv_blocks_total);
    r.kv_block_size = atomic_load(&n->kv_block_size);
    r.stage_endpoint = n->stage_endpoint;
    r.host = n->host;
    r.pid = (uint32_t)getpid();
    r.max_step_tokens = (uint32_t)n->n_tokens_max;
    r.max_step_seqs = (uint32_t)n->n_seqs_max;
    r.target_ctx = (uint32_t)n->target_ctx;
    r.kv_seqs = (uint32_t)n->kv_seqs;
    r.sized_auto = n->sized_auto;
    r.session = n->router_session;
    r.draft_model = draft_name;
    Llm__WorkerEnvelope env = LLM__WORKER_ENVELOPE__INIT;
    env.body_case = LLM__WORKER_ENVELOPE__BODY_REGISTER;
    env.register_ = &r;
    char err[256];
    int rc = proto_worker_pack(&env, buf, len, err, sizeof err);
    pthread_mutex_unlock(&n->lock);
    if (rc < 0) LOG(LL_ERROR, "cannot pack Register: %s", err);
    return rc;
}

int node_routers_parse(node *n, const char *list, char *err, size_t errlen) {
    size_t cap = 1;
    for (const char *p = list; *p; p++)
        if (*p == ',') cap++;
    n->routers = calloc(cap, sizeof *n->routers);
    if (!n->routers) {
        snprintf(err, errlen, "out of memory");
        return STATUS_NO_MEMORY;
    }
    const char *p = list;
    for (size_t i = 0; i < cap; i++) {
        const char *end = strchr(p, ',');
        size_t len = end ? (size_t)(end - p) : strlen(p);
        while (len && (*p == ' ' || *p == '\t')) p++, len--;
        while (len && (p[len - 1] == ' ' || p[len - 1] == '\t')) len--;
        char *e = strndup(p, len);
        if (!e) {
            snprintf(err, errlen, "out of memory");
            return STATUS_NO_MEMORY;
        }
        n->routers[n->n_routers++] = e;
        const char *sep = strstr(e, "://");
        if (!sep || sep == e || !sep[3]) {
            snprintf(err, errlen, "--router \"%s\": entry %zu \"%s\" is not a ZeroMQ endpoint "
                     "(tcp://host:port; several separated by commas)", list, i + 1, e);
            return STATUS_BAD_INPUT;
        }
        if (end) p = end + 1;
    }
    n->router_cur = 0;
    n->s_router = n->routers[0];
    return STATUS_OK;
}

void node_router_close(node *n) {
    if (n->router) zmq_socket_monitor(zio_sock_raw(n->router), NULL, 0);
    zio_sock_close(n->router_mon);
    zio_sock_close(n->router);
    n->router_mon = NULL;
    n->router = NULL;
}

int node_router_open(node *n, char *err, size_t errlen) {
    n->s_router = n->routers[n->router_cur];
    int rc = zio_sock_open(n->zctx, ZMQ_DEALER, &n->router, err, errlen);
    if (rc < 0) return rc;
    zio_set_spin(n->router, n->cfg.spin_us);
    /* The plans come through this context's I/O thread: keep it awake
     * while the io thread spins (a first stage idles most of a step). */
    if (n->cfg.spin_us > 0 && zio_set_warm(n->router, n->zctx) < 0)
        LOG(LL_WARN, "--spin-us %d without warm ticks: %s", n->cfg.spin_us, zio_errstr(n->router));
    /* The routing id names this process's connection: the worker id on a
     * plain router (which hands an id over to a restarted worker), the id
     * and this start's incarnation with keys, where the router refuses a
     * second connection under a live routing id and so a restarted or a
     * second process must not reuse one. */
    char rid[256];
    if (n->secure) snprintf(rid, sizeof rid, "%.200s#%llx", n->s_worker_id, (unsigned long long)n->incarnation);
    else snprintf(rid, sizeof rid, "%s", n->s_worker_id);
    rc = zio_set_bytes(n->router, ZMQ_ROUTING_ID, rid, strlen(rid));
    /* What was queued for a router we leave is not for the next one. */
    if (rc == 0) rc = zio_set_int(n->router, ZMQ_LINGER, 0);
    /* ZMTP heartbeats: a router that is stopped or cut off (no TCP reset)
     * still ends the connection, and so shows in the monitor. */
    if (rc == 0) rc = zio_set_int(n->router, ZMQ_HEARTBEAT_IVL, NODE_HEARTBEAT_DEFAULT_MS);
    if (rc == 0) rc = zio_set_int(n->router, ZMQ_HEARTBEAT_TIMEOUT, 3 * NODE_HEARTBEAT_DEFAULT_MS);
    if (rc == 0 && n->secure) rc = zio_curve_client(n->router, &n->kp, n->router_key);
    if (rc < 0) {
        snprintf(err, errlen, "%s", zio_errstr(n->router));
        node_router_close(n);
        return rc;
    }
    char mon_ep[96];
    snprintf(mon_ep, sizeof mon_ep, "inproc://worker-router-mon-%u", n->router_seq++);
    if (zmq_socket_monitor(zio_sock_raw(n->router), mon_ep,
                           ZMQ_EVENT_HANDSHAKE_SUCCEEDED | ZMQ_EVENT_DISCONNECTED |
                               ZMQ_EVENT_HANDSHAKE_FAILED_AUTH | ZMQ_EVENT_HANDSHAKE_FAILED_PROTOCOL |
                               ZMQ_EVENT_HANDSHAKE_FAILED_NO_DETAIL) != 0) {
        snprintf(err, errlen, "router socket monitor: %s", zmq_strerror(errno));
        node_router_close(n);
        return STATUS_IO;
    }
    rc = zio_sock_open(n->zctx, ZMQ_PAIR, &n->router_mon, err, errlen);
    if (rc == 0 && (rc = zio_connect(n->router_mon, mon_ep)) < 0)
        snprintf(err, errlen, "%s", zio_errstr(n->router_mon));
    if (rc == 0 && (rc = zio_connect(n->router, n->s_router)) < 0)
        snprintf(err, errlen, "%s", zio_errstr(n->router));
    if (rc < 0) {
        node_router_close(n);
        return rc;
    }
    n->router_down_since = node_now_ms();
    n->router_retry_at = 0;
    n->router_session++; /* nothing of an earlier socket's session reaches this one */
    return STATUS_OK;
}

/* The router's handshake refused this worker: says so, naming what the
 * operator must fix, and schedules a new connection (ZeroMQ makes none
 * after a refused handshake). */
static void node_router_refused(node *n, int64_t now, uint16_t event, uint32_t value) {
    if (n->router_retry_at) return; /* this connection's refusal is already handled */
    n->router_refusals++;
    atomic_store(&n->router_refused, 1);
    n->router_refused_ms = n->router_refused_ms <= 0 ? NODE_REFUSED_RETRY_MS
                           : n->router_refused_ms >= NODE_REFUSED_RETRY_MAX_MS / 2 ? NODE_REFUSED_RETRY_MAX_MS
                                                                                  : n->router_refused_ms * 2;
    n->router_retry_at = now + n->router_refused_ms;
    const char *key_file = n->cfg.curve_key_file ? n->cfg.curve_key_file : "";
    const char *router_key = n->cfg.router_key ? n->cfg.router_key : "";
    if (event == ZMQ_EVENT_HANDSHAKE_FAILED_AUTH)
        LOG(LL_ERROR, "worker %s: the router %s refused this worker's key %s (--curve-key-file %s; ZAP "
            "status %u): add its public key to the router's --worker-keys (docs/security.md); "
            "connecting again in %d s (refused %llu times)", n->s_worker_id, n->s_router, n->kp.pub,
            key_file, value, n->router_refused_ms / 1000, (unsigned long long)n->router_refusals);
    else
        LOG(LL_ERROR, "worker %s: the CURVE handshake with the router %s failed (%s 0x%x): is "
            "--router-key %s the public key of the router at that endpoint, and does the router run "
            "with keys? This worker's key is %s (--curve-key-file %s); connecting again in %d s "
            "(failed %llu times)", n->s_worker_id, n->s_router,
            event == ZMQ_EVENT_HANDSHAKE_FAILED_PROTOCOL ? "protocol error" : "no detail", value,
            router_key, n->kp.pub, key_file, n->router_refused_ms / 1000,
            (unsigned long long)n->router_refusals);
}

void node_router_events(node *n, int64_t now) {
    struct zio_parts p = {0};
    while (n->router_mon && zio_recv(n->router_mon, &p, 0) == 0) {
        if (zio_parts_size(&p, 0) < 6) continue;
        uint16_t e;
        uint32_t value;
        memcpy(&e, zio_parts_data(&p, 0), 2);
        memcpy(&value, (const uint8_t *)zio_parts_data(&p, 0) + 2, 4);
        if (e & ZMQ_EVENT_HANDSHAKE_SUCCEEDED) {
            n->router_down_since = 0;
            if (atomic_load(&n->router_refused))
                LOG(LL_INFO, "worker %s: the router %s admitted this worker's key after %llu refusals",
                    n->s_worker_id, n->s_router, (unsigned long long)n->router_refusals);
            atomic_store(&n->router_refused, 0);
            n->router_refusals = 0;
            n->router_refused_ms = 0;
        } else if (e & (ZMQ_EVENT_HANDSHAKE_FAILED_AUTH | ZMQ_EVENT_HANDSHAKE_FAILED_PROTOCOL |
                        ZMQ_EVENT_HANDSHAKE_FAILED_NO_DETAIL)) {
            node_router_refused(n, now, e, value);
        } else if (e & ZMQ_EVENT_DISCONNECTED) {
            /* ZeroMQ connects again by itself, but what was in flight on
             * the old connection (a plan, a result) may be gone. */
            n->router_session++;
            n->router_broke = 1;
            if (n->router_down_since == 0) {
                n->router_down_since = now;
                LOG(LL_WARN, "worker %s: connection to the router %s lost", n->s_worker_id, n->s_router);
            }
        }
    }
    zio_parts_free(&p);
}

int node_router_retry(node *n, int64_t now, char *err, size_t errlen) {
    if (!n->router_retry_at || now < n->router_retry_at) return STATUS_OK;
    /* A fresh socket: the refused one never connects again.  The time
     * without a router keeps counting (fail-over to the next endpoint). */
    int64_t down = n->router_down_since;
    node_router_close(n);
    int rc = node_router_open(n, err, errlen);
    if (rc < 0) return rc;
    if (down) n->router_down_since = down;
    LOG(LL_INFO, "worker %s: connecting to the router %s again", n->s_worker_id, n->s_router);
    return STATUS_OK;
}

/* Sends one packed frame to the router without blocking: a router that is
 * down must not stop the worker (heartbeats are simply lost). */
void node_router_send(node *n, uint8_t *buf, size_t len, const char *what) {
    struct zio_frame f = {buf, len, proto_buf_free, NULL};
    if (zio_send(n->router, &f, 1, ZMQ_DONTWAIT) < 0)
        LOG(LL_WARN, "%s to the router %s not sent: %s", what, n->s_router, zio_errstr(n->router));
}

int node_redis_ttl_ms(node *n, uint32_t hb_ms) {
    (void)n;
    int64_t t = (int64_t)hb_ms * 3;
    return t < 3000 ? 3000 : (int)t;
}

/* Writes (or rewrites) the registry key with the current Register. */
void node_redis_register(node *n, uint32_t hb_ms) {
    if (!n->redis) return;
    uint8_t *buf;
    size_t len;
    if (node_register_pack(n, &buf, &len) < 0) return;
    if (rconn_set(n->redis, n->redis_key, buf, len, node_redis_ttl_ms(n, hb_ms)) < 0)
        LOG(LL_WARN, "registry key %s: %s", n->redis_key, rconn_errstr(n->redis));
    free(buf);
}

void node_heartbeat(node *n, uint32_t hb_ms) {
    Llm__Heartbeat h = LLM__HEARTBEAT__INIT;
    h.worker_id = n->s_worker_id;
    h.incarnation = n->incarnation;
    h.state = (Llm__Heartbeat__State)atomic_load(&n->state);
    h.time_ms = node_unix_ms();
    h.last_step_id = atomic_load(&n->last_step_id);
    h.kv_blocks_used = atomic_load(&n->kv_blocks_used);
    h.kv_blocks_total = atomic_load(&n->kv_blocks_total);
    h.steps_total = atomic_load(&n->steps_total);
    h.tokens_total = atomic_load(&n->tokens_total);
    Llm__Error e;
    char why[512];
    if (h.state == LLM__HEARTBEAT__STATE__FAILED) {
        pthread_mutex_lock(&n->lock);
        snprintf(why, sizeof why, "%s", n->links_err);
        pthread_mutex_unlock(&n->lock);
        proto_error_init(&e, LLM__ERROR__CODE__UNAVAILABLE, "", why, 0);
        h.error = &e;
    }
    Llm__WorkerEnvelope env = LLM__WORKER_ENVELOPE__INIT;
    env.body_case = LLM__WORKER_ENVELOPE__BODY_HEARTBEAT;
    env.heartbeat = &h;
    uint8_t *buf;
    size_t len;
    char err[256];
    if (proto_worker_pack(&env, &buf, &len, err, sizeof err) == 0)
        node_router_send(n, buf, len, "heartbeat");
    if (n->redis) {
        int rc = rconn_expire(n->redis, n->redis_key, node_redis_ttl_ms(n, hb_ms));
        if (rc == 0) node_redis_register(n, hb_ms); /* expired or flushed: write it again */
        else if (rc < 0) LOG(LL_WARN, "registry key %s: %s", n->redis_key, rconn_errstr(n->redis));
    }
}

void node_send_register(node *n) {
    uint8_t *buf;
    size_t len;
    if (node_register_pack(n, &buf, &len) == 0) node_router_send(n, buf, len, "Register");
}

/* The Error reply to a frame that could not be read or is not for a worker. */
static void node_reply_error(node *n, Llm__Error__Code code, const char *msg) {
    uint8_t *buf;
    size_t len;
    if (proto_worker_error_pack(code, "", msg, 0, &buf, &len) == 0)
        node_router_send(n, buf, len, "Error reply");
}

/* A plan, with the time this thread took it from the router (a third
 * frame, the monotonic clock in us) for the compute thread's timeline line. */
static void node_pipe_forward_plan(node *n, const void *data, size_t len, int64_t received_us) {
    const char type = NODE_MSG_PLAN;
    struct zio_frame f[3] = {{&type, 1, NULL, NULL}, {data, len, NULL, NULL},
                             {&received_us, sizeof received_us, NULL, NULL}};
    if (zio_send(n->pipe_io, f, 3, 0) < 0)
        LOG(LL_ERROR, "handing a message to the compute thread: %s", zio_errstr(n->pipe_io));
}

/* A RegisterReply, with the router session it came in (a third frame):
 * node_placement_apply starts the stage's view afresh on a reply of a new
 * session even when its epoch is the one it has. */
static void node_pipe_forward_placement(node *n, const void *data, size_t len) {
    const char type = NODE_MSG_PLACEMENT;
    const uint32_t session = n->router_session;
    struct zio_frame f[3] = {{&type, 1, NULL, NULL}, {data, len, NULL, NULL}, {&session, sizeof session, NULL, NULL}};
    if (zio_send(n->pipe_io, f, 3, 0) < 0)
        LOG(LL_ERROR, "handing a placement to the compute thread: %s", zio_errstr(n->pipe_io));
}


/* One message from the router: checks it, answers bad frames, forwards
 * plans (when running) and placements.  *hb_ms and *retry_ms are updated
 * from a RegisterReply. */
int node_router_message(node *n, const struct zio_parts *in, int running, int draining,
                               uint32_t *hb_ms, int *retry_ms, char *err, size_t errlen) {
    const int64_t received_us = node_now_us();
    if (in->n != 1) {
        char msg[128];
        snprintf(msg, sizeof msg, "a message to a worker is one frame, this one has %zu", in->n);
        LOG(LL_WARN, "router %s: %s", n->s_router, msg);
        node_reply_error(n, LLM__ERROR__CODE__INVALID_ARGUMENT, msg);
        return NODE_EV_NONE;
    }
    const void *data = zio_parts_data(in, 0);
    size_t len = zio_parts_size(in, 0);
    Llm__WorkerEnvelope *env = NULL;
    char why[256];
    int rc = proto_worker_unpack(data, len, &env, why, sizeof why);
    if (rc < 0) {
        LOG(LL_WARN, "router %s: frame refused (%llu so far): %s", n->s_router,
            (unsigned long long)proto_frames_rejected(), why);
        node_reply_error(n, proto_code_from_status(rc), why);
        return NODE_EV_NONE;
    }
    int ev = NODE_EV_NONE;
    switch (env->body_case) {
    case LLM__WORKER_ENVELOPE__BODY_PLAN:
        if (!running)
            LOG(LL_INFO, "step %llu (epoch %llu) arrived while this worker is not registered "
                "(registering, or again after a broken connection): dropped",
                (unsigned long long)env->plan->step_id, (unsigned long long)env->plan->epoch);
        else if (draining)
            LOG(LL_INFO, "step %llu arrived while draining: dropped",
                (unsigned long long)env->plan->step_id);
        else {
            node_pipe_forward_plan(n, data, len, received_us);
            ev = NODE_EV_PLAN;
        }
        break;
    case LLM__WORKER_ENVELOPE__BODY_REGISTER_REPLY: {
        const Llm__RegisterReply *r = env->register_reply;
        if (r->accepted) {
            *hb_ms = r->heartbeat_interval_ms ? r->heartbeat_interval_ms : NODE_HEARTBEAT_DEFAULT_MS;
            /* Counted before it is handed on: a send or a receive of the
             * compute thread waiting for a stage that is gone gives up on
             * it, and plans of an older epoch queued before it are dropped. */
            atomic_store(&n->placement_epoch, r->epoch);
            atomic_fetch_add(&n->placements_sent, 1);
            node_pipe_forward_placement(n, data, len);
            ev = NODE_EV_ACCEPTED;
        } else {
            const char *msg = r->error && r->error->message[0] ? r->error->message : "no reason given";
            uint32_t retry = r->error ? r->error->retry_after_ms : 0;
            if (retry > 0) {
                LOG(LL_WARN, "router %s refused the registration (%s): again in %u ms",
                    n->s_router, msg, retry);
                *retry_ms = (int)retry;
                ev = NODE_EV_RETRY;
            } else {
                snprintf(err, errlen, "router %s refused worker %s: %s", n->s_router,
                         n->s_worker_id, msg);
                ev = NODE_EV_REFUSED;
            }
        }
        break;
    }
    case LLM__WORKER_ENVELOPE__BODY_ERROR:
        LOG(LL_WARN, "router %s: error %s: %s", n->s_router, proto_code_name(env->error->code),
            env->error->message);
        break;
    default: {
        char msg[128];
        snprintf(msg, sizeof msg, "a worker does not take envelope body %d from the router",
                 (int)env->body_case);
        LOG(LL_WARN, "router %s: %s", n->s_router, msg);
        node_reply_error(n, LLM__ERROR__CODE__UNIMPLEMENTED, msg);
        break;
    }
    }
    proto_worker_free(env);
    return ev;
}
