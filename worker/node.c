/* The worker's life (see node.h): init and free, and node_run, the io
 * thread's loop.  The calling thread owns the router socket and Redis; the
 * compute thread (node_step.c) owns the stage, the links and the
 * per-sequence state.  They talk over an inproc PAIR: plans and placements
 * one way, packed StepResults the other. */
#include "node-impl.h"

#include "common/log.h"
#include "common/rconn.h"
#include "common/status.h"
#include "common/watchdog.h"

#include <errno.h>
#include <signal.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

static char *node_strdup(const char *s) { return s ? strdup(s) : NULL; }

void node_config_default(struct node_config *cfg) {
    memset(cfg, 0, sizeof *cfg);
    cfg->router = "tcp://127.0.0.1:5556";
    cfg->listen = "tcp://*:*";
    cfg->stage_count = 1;
    cfg->mem_fraction = 0.9;
    cfg->kv_block_size = KVBLOCKS_BLOCK_SIZE_DEFAULT;
    cfg->kv_type = -1;
    cfg->max_batch_tokens = 512;
    cfg->max_seqs = 16;
    cfg->link_timeout_ms = 30000;
    cfg->link_dtype = -1;
    cfg->draft_type = -1;
    cfg->register_retry_ms = 2000;
    cfg->spin_us = -1;
}

int node_spin_us(int spin_us, int gpu) {
    if (spin_us >= 0) return spin_us;
    return gpu ? ZIO_SPIN_US_GPU : 0;
}

/* The connection to the router broke (node_router_events): a plan, a
 * result or a placement on it may be lost, and nothing would tell the
 * router.  So the worker registers again at once under its new session
 * and takes no plan until the router answers: a plan arriving meanwhile
 * may follow one that was lost.  The router re-forms the pipeline for the
 * new session (a new epoch): every stage forgets the old formation's
 * sequences and the router plans them again from their tokens. */
static void node_router_broke(node *n, int *registered, int64_t *next_register, int64_t now) {
    if (!n->router_broke) return;
    n->router_broke = 0;
    if (*registered)
        LOG(LL_WARN, "worker %s: registering again with %s (session %u): what the broken connection "
            "carried may be lost; plans are dropped until the router answers", n->s_worker_id, n->s_router,
            n->router_session);
    *registered = 0;
    *next_register = now;
}

int node_run(node *n, volatile sig_atomic_t *stop, char *err, size_t errlen) {
    err[0] = 0;
    uint32_t hb_ms = NODE_HEARTBEAT_DEFAULT_MS;
    int rc = node_router_open(n, err, errlen);
    if (rc < 0) return rc;
    /* The compute thread must not take SIGTERM/SIGINT: they stop this thread's waits. */
    sigset_t block, old;
    sigemptyset(&block);
    sigaddset(&block, SIGTERM);
    sigaddset(&block, SIGINT);
    pthread_sigmask(SIG_BLOCK, &block, &old);
    rc = pthread_create(&n->compute, NULL, node_compute_main, n);
    pthread_sigmask(SIG_SETMASK, &old, NULL);
    if (rc != 0) {
        snprintf(err, errlen, "cannot start the compute thread: %s", strerror(rc));
        return STATUS_INTERNAL;
    }
    n->compute_started = 1;
    atomic_store(&n->state, LLM__HEARTBEAT__STATE__STARTING);
    node_redis_register(n, hb_ms);
    LOG(LL_INFO, "worker %s: registering with %s%s%s%s", n->s_worker_id, n->s_router,
        n->n_routers > 1 ? " (of several routers)" : "",
        n->redis ? ", registry key " : "", n->redis ? n->redis_key : "");

    int registered = 0, draining = 0, drain_sent = 0, compute_done = 0, result = STATUS_OK;
    int retry_ms = n->cfg.register_retry_ms;
    int64_t next_register = node_now_ms(), next_hb = node_now_ms() + hb_ms;
    int64_t drain_deadline = 0, last_plan_ms = 0;
    struct zio_parts in = {0};
    while (!compute_done) {
        watchdog_beat(n->cfg.watchdog, 0); /* each turn waits at most 100 ms */
        int64_t now = node_now_ms();
        node_router_events(n, now);
        node_router_broke(n, &registered, &next_register, now);
        if ((rc = node_router_retry(n, now, err, errlen)) < 0) {
            LOG(LL_ERROR, "worker %s: %s", n->s_worker_id, err);
            result = rc;
            *stop = 1;
            break;
        }
        /* The router has not been connected for a worker timeout: with
         * several endpoints, register with the next.  Plans of the old
         * router still running finish; their results go nowhere useful (the
         * new router knows neither their pipeline nor their epoch). */
        if (n->n_routers > 1 && !draining && n->router_down_since &&
            now - n->router_down_since >= (int64_t)NODE_ROUTER_LOST_BEATS * hb_ms) {
            const char *old = n->s_router;
            node_router_close(n);
            n->router_cur = (n->router_cur + 1) % n->n_routers;
            n->router_refused_ms = 0; /* another router: its refusal, if any, is news */
            LOG(LL_WARN, "worker %s: no connection to the router %s for %lld ms: registering with %s",
                n->s_worker_id, old, (long long)(now - n->router_down_since), n->routers[n->router_cur]);
            if ((rc = node_router_open(n, err, errlen)) < 0) {
                LOG(LL_ERROR, "worker %s: %s", n->s_worker_id, err);
                result = rc;
                *stop = 1;
                break;
            }
            registered = 0;
            next_register = now;
        }
        if (*stop && !draining) {
            /* Plans that reached this process before the signal are in
             * flight: hand them over. */
            while (zio_recv(n->router, &in, 0) == 0)
                node_router_message(n, &in, registered, 0, &hb_ms, &retry_ms, err, errlen);
            draining = 1;
            drain_deadline = now + NODE_DRAIN_MAX_MS;
            last_plan_ms = now;
            atomic_store(&n->state, LLM__HEARTBEAT__STATE__DRAINING);
            LOG(LL_INFO, "worker %s: draining (finishing the plans it holds)", n->s_worker_id);
            node_heartbeat(n, hb_ms);
        }
        /* The router sends plans until this DRAINING reaches it; each went
         * to every stage of the pipeline, and a stage that dropped one
         * would leave the next one waiting for its hidden states for the
         * whole link timeout (the other stages drain too at a scale-in, a
         * moment earlier or later).  So every plan that comes is run until
         * none has come for NODE_DRAIN_QUIET_MS or a heartbeat interval,
         * whichever is longer (the router's own pace), and only then the
         * compute thread gets the drain marker: later plans are dropped. */
        int64_t quiet_ms = hb_ms > NODE_DRAIN_QUIET_MS ? (int64_t)hb_ms : NODE_DRAIN_QUIET_MS;
        if (draining && !drain_sent && now - last_plan_ms >= quiet_ms) {
            drain_sent = 1;
            const char d = NODE_MSG_DRAIN;
            struct zio_frame f = {&d, 1, NULL, NULL};
            zio_send(n->pipe_io, &f, 1, 0);
        }
        if (draining && now > drain_deadline) {
            LOG(LL_ERROR, "worker %s: plans still running after %d ms of draining: leaving",
                n->s_worker_id, NODE_DRAIN_MAX_MS);
            break;
        }
        /* While the connection waits to be opened again after a refused
         * handshake, a Register would only pile up in the socket. */
        if (!registered && !draining && now >= next_register && !n->router_retry_at) {
            node_send_register(n);
            next_register = now + retry_ms;
            retry_ms = n->cfg.register_retry_ms;
        }
        if (now >= next_hb) {
            if (registered || draining) node_heartbeat(n, hb_ms);
            else if (n->redis && rconn_expire(n->redis, n->redis_key, node_redis_ttl_ms(n, hb_ms)) == 0)
                node_redis_register(n, hb_ms);
            next_hb = now + hb_ms;
        }
        int64_t wait = next_hb - now;
        if (!registered && !n->router_retry_at && next_register - now < wait) wait = next_register - now;
        if (n->router_retry_at && n->router_retry_at - now < wait) wait = n->router_retry_at - now;
        if (wait > 100) wait = 100;
        if (wait < 0) wait = 0;
        struct zio_sock *socks[3] = {n->router, n->pipe_io, n->router_mon};
        short ev[3] = {ZMQ_POLLIN, ZMQ_POLLIN, ZMQ_POLLIN}, rev[3] = {0, 0, 0};
        int ready = zio_poll(socks, ev, rev, 3, (int)wait);
        if (ready <= 0) continue;
        if (rev[0] & ZMQ_POLLIN) {
            /* A break the monitor reported during the wait comes first: the
             * message may be the new connection's, after a lost one. */
            node_router_events(n, node_now_ms());
            node_router_broke(n, &registered, &next_register, node_now_ms());
            if (zio_recv(n->router, &in, 0) == 0) {
                int e = node_router_message(n, &in, registered, drain_sent, &hb_ms, &retry_ms, err, errlen);
                if (e == NODE_EV_PLAN) {
                    last_plan_ms = node_now_ms();
                } else if (e == NODE_EV_ACCEPTED) {
                    if (!registered) LOG(LL_INFO, "worker %s: registered", n->s_worker_id);
                    registered = 1;
                    node_redis_register(n, hb_ms);
                    next_hb = node_now_ms();
                } else if (e == NODE_EV_RETRY) {
                    registered = 0;
                    next_register = node_now_ms() + retry_ms;
                } else if (e == NODE_EV_REFUSED) {
                    result = STATUS_UNAVAILABLE;
                    LOG(LL_ERROR, "%s", err);
                    *stop = 1;
                }
            }
        }
        if (rev[1] & ZMQ_POLLIN) {
            if (zio_recv(n->pipe_io, &in, 0) == 0 && in.n >= 1 && zio_parts_size(&in, 0) == 1) {
                char type = *(const char *)zio_parts_data(&in, 0);
                if (type == NODE_MSG_RESULT && in.n == 2) {
                    size_t len = zio_parts_size(&in, 1);
                    uint8_t *copy = malloc(len);
                    if (copy) {
                        memcpy(copy, zio_parts_data(&in, 1), len);
                        node_router_send(n, copy, len, "StepResult");
                    }
                } else if (type == NODE_MSG_DONE) {
                    compute_done = 1;
                }
            }
        }
    }
    zio_parts_free(&in);
    if (compute_done) {
        pthread_join(n->compute, NULL);
        n->compute_started = 0;
    }
    if (n->redis) {
        if (rconn_del(n->redis, n->redis_key) < 0)
            LOG(LL_WARN, "registry key %s: %s", n->redis_key, rconn_errstr(n->redis));
    }
    LOG(LL_INFO, "worker %s: stopped after %llu steps", n->s_worker_id,
        (unsigned long long)atomic_load(&n->steps_total));
    return result;
}

/* ---- init and free ----------------------------------------------------------- */

/* The bound endpoint with a wildcard host replaced by one others can reach. */
static void node_advertise(node *n, const char *bound, char *out, size_t size) {
    const char *host = n->s_advertise && *n->s_advertise ? n->s_advertise : n->host;
    const char *p = strstr(bound, "://");
    const char *h = p ? p + 3 : bound;
    const char *colon = strrchr(h, ':');
    if (p && colon && (strncmp(h, "0.0.0.0:", 8) == 0 || strncmp(h, "*:", 2) == 0 ||
                       strncmp(h, "[::]:", 5) == 0))
        snprintf(out, size, "%.*s%s%s", (int)(h - bound), bound, host, colon);
    else
        snprintf(out, size, "%s", bound);
}

int node_init(node **out, const struct node_config *cfg, char *err, size_t errlen) {
    *out = NULL;
    if (!cfg->model_path || !*cfg->model_path) {
        snprintf(err, errlen, "no model: set --model (or LLM_MODEL)");
        return STATUS_BAD_INPUT;
    }
    if (!cfg->router || !*cfg->router) {
        snprintf(err, errlen, "no router endpoint: set --router (or LLM_ROUTER)");
        return STATUS_BAD_INPUT;
    }
    node *n = calloc(1, sizeof *n);
    if (!n) {
        snprintf(err, errlen, "out of memory");
        return STATUS_NO_MEMORY;
    }
    pthread_mutex_init(&n->lock, NULL);
    n->cfg = *cfg;
    n->s_model = node_strdup(cfg->model_path);
    n->s_redis = node_strdup(cfg->redis_url ? cfg->redis_url : "");
    n->s_listen = node_strdup(cfg->listen ? cfg->listen : "tcp://*:*");
    n->s_advertise = node_strdup(cfg->advertise_host ? cfg->advertise_host : "");
    if (gethostname(n->host, sizeof n->host) != 0) snprintf(n->host, sizeof n->host, "localhost");
    n->host[sizeof n->host - 1] = 0;
    char idbuf[192];
    if (cfg->worker_id && *cfg->worker_id) snprintf(idbuf, sizeof idbuf, "%s", cfg->worker_id);
    else snprintf(idbuf, sizeof idbuf, "%s-%d", n->host, (int)getpid());
    n->s_worker_id = node_strdup(idbuf);
    n->incarnation = (uint64_t)node_unix_ms() * 1000 + (uint64_t)(node_now_us() % 1000);
    n->pipeline_id = cfg->pipeline_id;
    n->stage_index = cfg->stage_index;
    n->stage_count = cfg->stage_count;
    atomic_store(&n->state, LLM__HEARTBEAT__STATE__STARTING);
    int rc;
    if (!n->s_model || !n->s_redis || !n->s_listen ||
        !n->s_advertise || !n->s_worker_id) {
        snprintf(err, errlen, "out of memory");
        rc = STATUS_NO_MEMORY;
        goto fail;
    }
    snprintf(n->redis_key, sizeof n->redis_key, "llm:worker:%s", n->s_worker_id);
    if ((rc = node_routers_parse(n, cfg->router, err, errlen)) < 0) goto fail;
    /* Keys first: a missing one fails in a second, not after the weights load. */
    if (cfg->insecure) {
        LOG(LL_WARN, "worker %s: --insecure: plain sockets to the router and on the stage links",
            n->s_worker_id);
    } else if (!cfg->curve_key_file || !*cfg->curve_key_file || !cfg->router_key || !*cfg->router_key) {
        snprintf(err, errlen, "no keys: give --curve-key-file (this worker's key pair) and --router-key "
                 "(the router's public key), or --insecure for plain sockets");
        rc = STATUS_BAD_INPUT;
        goto fail;
    } else {
        rc = keys_pair_load(cfg->curve_key_file, &n->kp, err, errlen);
        if (rc == 0) rc = keys_pub_load(cfg->router_key, n->router_key, err, errlen);
        if (rc < 0) goto fail;
        n->secure = 1;
    }

    rc = backend_open(&n->b, &cfg->device, cfg->threads, cfg->require_gpu, NULL, 0, err, errlen);
    if (rc < 0) goto fail;
    rc = model_file_open(&n->m, n->s_model, err, errlen);
    if (rc < 0) goto fail;
    n->hp = model_file_hparams(n->m);
    n->n_vocab = n->hp->n_vocab;
    if (cfg->draft_model && cfg->draft_model[0]) {
        /* Checked here whatever the stage (it loads only with the last), so
         * that a draft that does not fit the target stops the start. */
        n->s_draft = strdup(cfg->draft_model);
        n->draft_min_prob = cfg->draft_min_prob;
        n->draft_type = cfg->draft_type;
        rc = n->s_draft ? model_file_open(&n->draft_m, n->s_draft, err, errlen) : STATUS_NO_MEMORY;
        if (rc == STATUS_OK) rc = draft_vocab_check(n->draft_m, n->m, err, errlen);
        if (rc < 0) goto fail;
    }
    n->dim = n->hp->dim;
    rc = constrain_init(&n->cons, n->s_model, n->n_vocab, err, errlen);
    if (rc < 0) goto fail;
    int32_t first = cfg->layer_first, end = cfg->layer_end;
    if (end <= 0) {
        rc = node_layers_default(n, &first, &end, err, errlen);
        if (rc < 0) goto fail;
    }
    size_t mem_free = 0, mem_total = 0;
    backend_mem_info(n->b, &mem_free, &mem_total);
    n->mem_total = mem_total;
    rc = node_stage_load(n, first, end, err, errlen);
    if (rc < 0) goto fail;

    enum node_transport t = cfg->transport;
    int gpu = backend_is_gpu(n->b);
#if defined(LLM_HAVE_NCCL)
    int have_nccl = 1;
#else
    int have_nccl = 0;
#endif
    if (t == NODE_TRANSPORT_NCCL && (!gpu || !have_nccl)) {
        snprintf(err, errlen, "--transport nccl needs a GPU backend and a build with NCCL "
                 "(backend %s, NCCL %s)", backend_name(n->b), have_nccl ? "yes" : "no");
        rc = STATUS_UNSUPPORTED;
        goto fail;
    }
    n->device_links = gpu && have_nccl && t != NODE_TRANSPORT_ZMQ;
    /* Before the pipes and the router socket take it. */
    n->cfg.spin_us = node_spin_us(cfg->spin_us, gpu);
    char spin_why[48];
    if (cfg->spin_us < 0) snprintf(spin_why, sizeof spin_why, "--spin-us auto on a %s backend", gpu ? "GPU" : "CPU");
    else snprintf(spin_why, sizeof spin_why, "--spin-us %d", cfg->spin_us);
    LOG(LL_INFO, "worker %s: spin %d us (%s): %s", n->s_worker_id, n->cfg.spin_us, spin_why,
        n->cfg.spin_us > 0 ? "waits poll that long before they block while messages keep coming"
                           : "waits block at once");

    n->zctx = zmq_ctx_new();
    if (!n->zctx) {
        snprintf(err, errlen, "zmq_ctx_new: %s", zmq_strerror(errno));
        rc = STATUS_IO;
        goto fail;
    }
    rc = zio_sock_open(n->zctx, ZMQ_PAIR, &n->pipe_io, err, errlen);
    if (rc == 0) rc = zio_sock_open(n->zctx, ZMQ_PAIR, &n->pipe_compute, err, errlen);
    if (rc < 0) goto fail;
    /* Unbounded: the router may queue many plans ahead of the compute thread. */
    zio_set_int(n->pipe_io, ZMQ_SNDHWM, 0);
    zio_set_int(n->pipe_io, ZMQ_RCVHWM, 0);
    zio_set_int(n->pipe_compute, ZMQ_SNDHWM, 0);
    zio_set_int(n->pipe_compute, ZMQ_RCVHWM, 0);
    zio_set_spin(n->pipe_io, n->cfg.spin_us);
    zio_set_spin(n->pipe_compute, n->cfg.spin_us);
    char pipe_name[64];
    snprintf(pipe_name, sizeof pipe_name, "%s-%p", NODE_PIPE, (void *)n);
    rc = zio_bind(n->pipe_io, pipe_name);
    if (rc == 0) rc = zio_connect(n->pipe_compute, pipe_name);
    if (rc < 0) {
        snprintf(err, errlen, "%s", zio_errstr(n->pipe_io));
        goto fail;
    }
    if (n->secure) {
        /* Nobody is admitted on the link until the router names the
         * predecessor (node_placement_apply). */
        rc = zio_zap_start(n->zctx, &n->zap, err, errlen);
        if (rc == 0) rc = zio_zap_set_one(n->zap, LINK_ZAP_DOMAIN, NULL, NULL);
        if (rc < 0) goto fail;
    }
    if (!n->device_links) {
        /* Bound even on stage 0: the router may place this worker later in a pipeline. */
        rc = link_zmq_init_curve(&n->rx, n->zctx, LINK_RECV, n->s_listen, cfg->link_timeout_ms,
                                 n->secure ? &n->kp : NULL, NULL, err, errlen);
        if (rc < 0) goto fail;
        link_set_abort(n->rx, &n->placements_sent);
        node_advertise(n, link_endpoint(n->rx), n->stage_endpoint, sizeof n->stage_endpoint);
        LOG(LL_INFO, "stage link endpoint %s (bound %s)", n->stage_endpoint, link_endpoint(n->rx));
    }
    if (*n->s_redis) {
        rc = rconn_open_url(n->s_redis, 2000, &n->redis, err, errlen);
        if (rc < 0) goto fail;
    } else {
        LOG(LL_INFO, "no --redis: not in the Redis worker registry%s",
            n->device_links ? " (and NCCL links cannot start)" : "");
    }
    *out = n;
    return STATUS_OK;
fail:
    node_free(n);
    return rc;
}

void node_free(node *n) {
    if (!n) return;
    if (n->compute_started) {
        /* node_run left without the thread's goodbye (drain timeout): it may
         * be inside a step; tell it to stop and wait. */
        const char d = NODE_MSG_DRAIN;
        struct zio_frame f = {&d, 1, NULL, NULL};
        zio_send(n->pipe_io, &f, 1, 0);
        pthread_join(n->compute, NULL);
    }
    node_links_close(n, 0);
    node_router_close(n);
    zio_sock_close(n->pipe_io);
    zio_sock_close(n->pipe_compute);
    zio_zap_stop(n->zap);
    if (n->zctx) zmq_ctx_term(n->zctx);
    memset(&n->kp, 0, sizeof n->kp);
    rconn_close(n->redis);
    node_buffers_free(n);
    node_seqs_free(n);
    draft_free(n->dm);
    model_file_close(n->draft_m);
    free(n->s_draft);
    constrain_free(n->cons);
    stage_free(n->s);
    model_file_close(n->m);
    backend_free(n->b);
    pthread_mutex_destroy(&n->lock);
    free(n->s_model);
    free(n->s_worker_id);
    for (size_t i = 0; i < n->n_routers; i++) free(n->routers[i]);
    free(n->routers);
    free(n->s_redis);
    free(n->s_listen);
    free(n->s_advertise);
    free(n);
}
