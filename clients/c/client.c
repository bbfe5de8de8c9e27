/* libllmclient: a DEALER socket to a router, request/reply by tag, and a
 * generation loop that re-attaches by request id after a broken or silent
 * connection (docs/protocol.md, "Request ids and re-attaching").  A socket
 * monitor reports the router's disconnect at once, so a router restart
 * costs one reconnect, not an idle timeout, and a refused connection to a
 * router that is down sends the client to the next endpoint at once, not
 * after a reply timeout. */
#include "client.h"
#include "client-impl.h"

#include "common/log.h"
#include "common/status.h"
#include "common/zio.h"

#include <errno.h>
#include <stdint.h>
#include <stdatomic.h>
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/random.h>
#include <time.h>
#include <unistd.h>


int64_t client_now_ms(void) {
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (int64_t)ts.tv_sec * 1000 + ts.tv_nsec / 1000000;
}

void client_seterr(llm_client *c, Llm__Error__Code code, const char *fmt, ...) {
    c->err_code = code;
    c->retry_after_ms = 0;
    c->err_reason[0] = '\0';
    va_list ap;
    va_start(ap, fmt);
    int n = vsnprintf(c->errstr, sizeof c->errstr, fmt, ap);
    va_end(ap);
    /* A refused handshake looks like a router that never answers: say so. */
    if (code == LLM__ERROR__CODE__OK && c->auth_note[0] && n > 0 && (size_t)n < sizeof c->errstr)
        snprintf(c->errstr + n, sizeof c->errstr - (size_t)n, " (%s)", c->auth_note);
}

void llm_client_config_default(struct llm_client_config *cfg) {
    memset(cfg, 0, sizeof *cfg);
    cfg->reply_timeout_ms = 5000;
    cfg->idle_timeout_ms = 30000;
    cfg->retry_ms = 60000;
    cfg->heartbeat_ms = 2000;
}

void llm_generate_params_default(struct llm_generate_params *p) {
    memset(p, 0, sizeof *p);
    sampling_params_default(&p->sampling);
    p->stream = true;
}

void llm_generate_result_free(struct llm_generate_result *r) {
    if (!r) return;
    free(r->prompt_ids);
    r->prompt_ids = NULL;
    r->n_prompt_ids = 0;
    free(r->choices);
    r->choices = NULL;
    r->n_choices = 0;
}

const char *llm_finish_reason_name(Llm__GenerateDone__FinishReason r) {
    switch (r) {
    case LLM__GENERATE_DONE__FINISH_REASON__STOP: return "STOP";
    case LLM__GENERATE_DONE__FINISH_REASON__LENGTH: return "LENGTH";
    case LLM__GENERATE_DONE__FINISH_REASON__CANCELLED: return "CANCELLED";
    case LLM__GENERATE_DONE__FINISH_REASON__ERROR: return "ERROR";
    case LLM__GENERATE_DONE__FINISH_REASON__DEADLINE: return "DEADLINE";
    default: return "UNSPECIFIED";
    }
}

const char *llm_client_errstr(const llm_client *c) { return c->errstr; }
Llm__Error__Code llm_client_error_code(const llm_client *c) { return c->err_code; }
uint32_t llm_client_retry_after_ms(const llm_client *c) { return c->retry_after_ms; }
const char *llm_client_error_reason(const llm_client *c) { return c->err_reason; }
const char *llm_client_endpoint(const llm_client *c) { return c->endpoints[c->cur]; }
uint32_t llm_client_reconnects(const llm_client *c) { return c->n_opened > 0 ? c->n_opened - 1 : 0; }

/* ---- sockets ------------------------------------------------------------ */

static void client_sock_close(llm_client *c) {
    if (c->sock) zmq_socket_monitor(zio_sock_raw(c->sock), NULL, 0);
    zio_sock_close(c->mon);
    zio_sock_close(c->sock);
    c->mon = NULL;
    c->sock = NULL;
}

/* A DEALER to endpoints[cur], with a monitor that reports its connection,
 * its disconnects and connection attempts that failed.  The monitor is
 * attached before connect so that no event is missed. */
static int client_sock_open(llm_client *c) {
    char err[256];
    const char *ep = c->endpoints[c->cur];
    int rc = zio_sock_open(c->ctx, ZMQ_DEALER, &c->sock, err, sizeof err);
    if (rc < 0) {
        client_seterr(c, LLM__ERROR__CODE__OK, "client socket for %s: %s", ep, err);
        return rc;
    }
    /* Unsent requests are re-sent on the next socket: never hold a close. */
    zio_set_int(c->sock, ZMQ_LINGER, 0);
    zio_set_int(c->sock, ZMQ_RECONNECT_IVL, 100);
    zio_set_int(c->sock, ZMQ_RECONNECT_IVL_MAX, 1000);
    if (c->cfg.heartbeat_ms > 0) {
        zio_set_int(c->sock, ZMQ_HEARTBEAT_IVL, c->cfg.heartbeat_ms);
        zio_set_int(c->sock, ZMQ_HEARTBEAT_TIMEOUT, c->cfg.heartbeat_ms * 2);
    }
    if (c->secure && (rc = zio_curve_client(c->sock, &c->kp, c->router_pub)) < 0) {
        client_seterr(c, LLM__ERROR__CODE__OK, "client socket for %s: %s", ep, zio_errstr(c->sock));
        client_sock_close(c);
        return rc;
    }
    /* Unique in the process: a client freed and another allocated at the
     * same address must not meet the old monitor's endpoint, which ZeroMQ
     * releases asynchronously. */
    static atomic_uint_fast64_t mon_seq;
    char mon_ep[96];
    snprintf(mon_ep, sizeof mon_ep, "inproc://llmclient-%d-%llu", (int)getpid(),
             (unsigned long long)atomic_fetch_add(&mon_seq, 1));
    c->connected = c->lost = false;
    if (zmq_socket_monitor(zio_sock_raw(c->sock), mon_ep,
                           ZMQ_EVENT_CONNECTED | ZMQ_EVENT_CONNECT_RETRIED | ZMQ_EVENT_DISCONNECTED |
                               ZMQ_EVENT_HANDSHAKE_FAILED_AUTH | ZMQ_EVENT_HANDSHAKE_FAILED_PROTOCOL) != 0) {
        client_seterr(c, LLM__ERROR__CODE__OK, "client socket for %s: monitor: %s", ep,
                      zmq_strerror(errno));
        client_sock_close(c);
        return STATUS_IO;
    }
    rc = zio_sock_open(c->ctx, ZMQ_PAIR, &c->mon, err, sizeof err);
    if (rc == 0) rc = zio_connect(c->mon, mon_ep);
    if (rc < 0) {
        client_seterr(c, LLM__ERROR__CODE__OK, "client monitor for %s: %s", ep,
                      c->mon ? zio_errstr(c->mon) : err);
        client_sock_close(c);
        return rc;
    }
    rc = zio_connect(c->sock, ep);
    if (rc < 0) {
        client_seterr(c, LLM__ERROR__CODE__OK, "%s", zio_errstr(c->sock));
        client_sock_close(c);
        return rc;
    }
    c->n_opened++;
    return 0;
}

int client_sock_ensure(llm_client *c) { return c->sock ? 0 : client_sock_open(c); }

/* Drops the connection and opens one to the next endpoint (the same one
 * when there is only one): a restarted router comes back on its address. */
int client_reconnect(llm_client *c, const char *why) {
    const char *old = c->endpoints[c->cur];
    client_sock_close(c);
    c->cur = (c->cur + 1) % c->n_endpoints;
    LOG(LL_INFO, "client: %s (%s); connecting to %s", why, old, c->endpoints[c->cur]);
    return client_sock_open(c);
}

/* The key files of the config, else of the environment (a sourced
 * llm-cluster env.sh, or a Kubernetes Secret's paths). */
static int client_keys_load(llm_client *c, const struct llm_client_config *cfg, char *err,
                            size_t errlen) {
    const char *key = cfg->curve_key_file, *router = cfg->router_key_file;
    bool insecure = cfg->insecure;
    if ((!key || !key[0]) && !insecure) {
        key = getenv("LLM_CURVE_KEY_FILE");
        router = router && router[0] ? router : getenv("LLM_ROUTER_KEY");
        const char *ins = getenv("LLM_INSECURE");
        insecure = ins && (!strcmp(ins, "true") || !strcmp(ins, "1") || !strcmp(ins, "yes") ||
                           !strcmp(ins, "on"));
    }
    if (insecure) return 0;
    if (!key || !key[0] || !router || !router[0])
        return status_fail(err, errlen, STATUS_BAD_INPUT,
                           "llm client: no %s: give --curve-key-file (LLM_CURVE_KEY_FILE) and "
                           "--router-key (LLM_ROUTER_KEY), or --insecure (LLM_INSECURE=true) for "
                           "a router without keys", key && key[0] ? "router key" : "key pair");
    int rc = keys_pair_load(key, &c->kp, err, errlen);
    if (rc == 0) rc = keys_pub_load(router, c->router_pub, err, errlen);
    if (rc < 0) return rc;
    c->secure = true;
    return 0;
}

int llm_client_open(llm_client **out, const struct llm_client_config *cfg, char *err,
                    size_t errlen) {
    *out = NULL;
    if (!cfg || cfg->n_endpoints == 0 || !cfg->endpoints) {
        snprintf(err, errlen, "llm client: no router endpoint given");
        return STATUS_BAD_INPUT;
    }
    for (size_t i = 0; i < cfg->n_endpoints; i++) {
        const char *e = cfg->endpoints[i];
        if (!e || !strstr(e, "://") || strlen(e) > 240) {
            snprintf(err, errlen, "llm client: router endpoint %zu \"%s\" is not a ZeroMQ endpoint "
                     "like tcp://host:5555", i, e ? e : "(null)");
            return STATUS_BAD_INPUT;
        }
    }
    llm_client *c = calloc(1, sizeof *c);
    if (!c) goto oom;
    c->cfg = *cfg;
    if (c->cfg.reply_timeout_ms <= 0) c->cfg.reply_timeout_ms = 5000;
    if (c->cfg.idle_timeout_ms <= 0) c->cfg.idle_timeout_ms = 30000;
    if (c->cfg.retry_ms <= 0) c->cfg.retry_ms = 60000;
    c->endpoints = calloc(cfg->n_endpoints, sizeof *c->endpoints);
    if (!c->endpoints) goto oom;
    c->n_endpoints = cfg->n_endpoints;
    for (size_t i = 0; i < cfg->n_endpoints; i++)
        if (!(c->endpoints[i] = strdup(cfg->endpoints[i]))) goto oom;
    c->cfg.endpoints = NULL; /* the copies above are what counts */
    int krc = client_keys_load(c, cfg, err, errlen);
    if (krc < 0) {
        llm_client_close(c);
        return krc;
    }
    if (cfg->zmq_ctx) {
        c->ctx = cfg->zmq_ctx;
    } else {
        c->ctx = zmq_ctx_new();
        if (!c->ctx) {
            snprintf(err, errlen, "llm client: zmq_ctx_new: %s", zmq_strerror(errno));
            llm_client_close(c);
            return STATUS_IO;
        }
        c->own_ctx = true;
    }
    uint64_t r = 0;
    if (getrandom(&r, sizeof r, 0) != sizeof r) r = (uint64_t)client_now_ms() ^ (uint64_t)getpid() << 32;
    c->next_tag = (r >> 16) | 1; /* tags of earlier clients on a reused socket never collide */
    *out = c;
    return 0;
oom:
    llm_client_close(c);
    snprintf(err, errlen, "llm client: out of memory");
    return STATUS_NO_MEMORY;
}

void llm_client_close(llm_client *c) {
    if (!c) return;
    client_sock_close(c);
    if (c->own_ctx) zmq_ctx_term(c->ctx);
    for (size_t i = 0; c->endpoints && i < c->n_endpoints; i++) free(c->endpoints[i]);
    free(c->endpoints);
    memset(&c->kp, 0, sizeof c->kp);
    free(c);
}

/* ---- frames ------------------------------------------------------------- */

int client_send(llm_client *c, Llm__ClientEnvelope *env) {
    uint8_t *buf;
    size_t len;
    char err[256];
    int rc = proto_client_pack(env, &buf, &len, err, sizeof err);
    if (rc < 0) {
        client_seterr(c, LLM__ERROR__CODE__OK, "client: cannot pack the request: %s", err);
        return rc;
    }
    struct zio_frame f = {buf, len, proto_buf_free, NULL};
    /* DONTWAIT: a full queue means the router is not reading; the caller
     * then moves on instead of blocking for ever. */
    rc = zio_send(c->sock, &f, 1, ZMQ_DONTWAIT);
    if (rc < 0)
        client_seterr(c, LLM__ERROR__CODE__OK, "client: send to %s: %s", c->endpoints[c->cur],
                      zio_errstr(c->sock));
    return rc;
}

/* Waits up to timeout_ms for a frame from the router or a disconnect.
 * CLIENT_MSG: *env is a decoded envelope (the caller frees it);
 * CLIENT_IDLE: nothing came; CLIENT_LOST: the connection broke;
 * CLIENT_REFUSED: a connection attempt failed before any was made on this
 * socket (ZeroMQ's CONNECT_RETRIED with no CONNECTED before it: on a
 * connection refused, nothing listens at the address), with another
 * endpoint to go to.  A live router never refuses (the kernel answers a
 * full accept queue by dropping the SYN, not with a reset), so this is not
 * a guess like a reply timeout; with one endpoint the socket keeps trying
 * by itself (ZMQ_RECONNECT_IVL) and the refusal is not reported.  Frames
 * that do not decode are logged and skipped: a router never sends them,
 * and a client must not die of one. */
int client_wait(llm_client *c, int timeout_ms, Llm__ClientEnvelope **env) {
    *env = NULL;
    int64_t end = client_now_ms() + (timeout_ms > 0 ? timeout_ms : 0);
    for (;;) {
        int left = (int)(end - client_now_ms());
        if (left < 0 || c->lost) left = 0; /* broken: only the frames already here */
        struct zio_sock *socks[2] = {c->sock, c->mon};
        short ev[2] = {ZMQ_POLLIN, ZMQ_POLLIN}, rev[2] = {0, 0};
        int n = zio_poll(socks, ev, rev, 2, left);
        if (n < 0) {
            client_seterr(c, LLM__ERROR__CODE__OK, "client: poll: %s", zio_errstr(c->sock));
            return n;
        }
        if (rev[1] & ZMQ_POLLIN) {
            struct zio_parts p = {0};
            bool refused = false;
            while (zio_recv(c->mon, &p, 0) == 0) {
                if (zio_parts_size(&p, 0) >= 2) {
                    uint16_t e;
                    memcpy(&e, zio_parts_data(&p, 0), 2);
                    if (e & ZMQ_EVENT_CONNECTED) c->connected = true;
                    if ((e & ZMQ_EVENT_CONNECT_RETRIED) && !c->connected) refused = true;
                    if (e & ZMQ_EVENT_DISCONNECTED) c->lost = true;
                    if (e & (ZMQ_EVENT_HANDSHAKE_FAILED_AUTH | ZMQ_EVENT_HANDSHAKE_FAILED_PROTOCOL)) {
                        bool first = !c->auth_note[0];
                        snprintf(c->auth_note, sizeof c->auth_note,
                                 (e & ZMQ_EVENT_HANDSHAKE_FAILED_AUTH)
                                     ? "the router at %s refused this client's key: is its public "
                                       "key in the router's --client-keys?"
                                     : "the CURVE handshake with %s failed: is the router key "
                                       "(LLM_ROUTER_KEY) the router's, and does it run with keys?",
                                 c->endpoints[c->cur]);
                        if (first) LOG(LL_WARN, "client: %s", c->auth_note);
                    }
                }
            }
            zio_parts_free(&p);
            /* A refused handshake also ends in a disconnect; the socket
             * tries again by itself (ZMQ_RECONNECT_IVL), and opening a new
             * one at once would only ask to be refused again in a loop. */
            if (c->auth_note[0]) c->lost = refused = false;
            if (refused && c->n_endpoints > 1) return CLIENT_REFUSED;
        }
        /* A frame the router sent before it went is still worth reading;
         * the loss is reported once none is left, in this call or a later
         * one (forgetting it left a client waiting out its idle timeout on
         * a dead router when a chunk came with the disconnect). */
        if (c->lost && !(rev[0] & ZMQ_POLLIN)) {
            c->lost = false;
            return CLIENT_LOST;
        }
        if (rev[0] & ZMQ_POLLIN) {
            struct zio_parts p = {0};
            int rc = zio_recv(c->sock, &p, 0);
            if (rc == 0) {
                char err[256];
                if (p.n != 1) {
                    LOG(LL_WARN, "client: %s sent a message of %zu frames; skipped",
                        c->endpoints[c->cur], p.n);
                } else if (proto_client_unpack(zio_parts_data(&p, 0), zio_parts_size(&p, 0), env,
                                               err, sizeof err) == 0) {
                    zio_parts_free(&p);
                    return CLIENT_MSG;
                } else {
                    LOG(LL_WARN, "client: unreadable frame from %s: %s", c->endpoints[c->cur], err);
                }
            }
            zio_parts_free(&p);
        }
        if (client_now_ms() >= end) return CLIENT_IDLE;
    }
}

const char *client_body_request_id(const Llm__ClientEnvelope *e) {
    switch (e->body_case) {
    case LLM__CLIENT_ENVELOPE__BODY_ACCEPTED: return e->accepted->request_id;
    case LLM__CLIENT_ENVELOPE__BODY_CHUNK: return e->chunk->request_id;
    case LLM__CLIENT_ENVELOPE__BODY_DONE: return e->done->request_id;
    case LLM__CLIENT_ENVELOPE__BODY_ERROR: return e->error->request_id;
    default: return "";
    }
}

/* Records the router's Error and returns the matching status. */
int client_router_error(llm_client *c, const Llm__Error *e, const char *what) {
    client_seterr(c, e->code, "%s: %s: %s%s%s", what, proto_code_name(e->code), e->message,
                  e->request_id[0] ? " (request " : "", e->request_id[0] ? e->request_id : "");
    if (e->request_id[0]) strncat(c->errstr, ")", sizeof c->errstr - strlen(c->errstr) - 1);
    c->retry_after_ms = e->retry_after_ms;
    snprintf(c->err_reason, sizeof c->err_reason, "%s", e->reason ? e->reason : "");
    int st = proto_status_from_code(e->code);
    return st < 0 ? st : STATUS_INTERNAL;
}

void client_sleep_ms(int ms) {
    struct timespec ts = {ms / 1000, (long)(ms % 1000) * 1000000L};
    while (nanosleep(&ts, &ts) != 0 && errno == EINTR) {}
}

bool client_unavailable(llm_client *c, size_t *in_a_row, int pause_ms) {
    if (++*in_a_row < c->n_endpoints) return true;
    *in_a_row = 0;
    client_sleep_ms(pause_ms > 0 ? pause_ms : 200);
    return false;
}

/* ---- request/reply ------------------------------------------------------ */

/* Sends a request envelope (body set by the caller) and waits for the reply
 * with its tag: want (a body case) or an Error.  Tries the endpoints in turn
 * until cfg.retry_ms passes. */
static int client_call(llm_client *c, Llm__ClientEnvelope *req, Llm__ClientEnvelope__BodyCase want,
                       const char *what, Llm__ClientEnvelope **reply) {
    *reply = NULL;
    c->err_code = LLM__ERROR__CODE__OK;
    c->retry_after_ms = 0;
    int64_t give_up = client_now_ms() + c->cfg.retry_ms;
    int rc = client_sock_ensure(c);
    if (rc < 0) return rc;
    size_t unavailable = 0; /* endpoints in a row that answered UNAVAILABLE or refused */
    int pause_ms = 0;       /* the latest UNAVAILABLE's retry_after_ms */
    for (;;) {
        req->tag = c->next_tag++;
        rc = client_send(c, req);
        int64_t sent = client_now_ms();
        bool lost = rc < 0, move_on = false, refused = false;
        while (!lost && !move_on) {
            int64_t until = sent + c->cfg.reply_timeout_ms;
            if (until > give_up) until = give_up;
            int left = (int)(until - client_now_ms());
            if (left <= 0) break;
            Llm__ClientEnvelope *env;
            int ev = client_wait(c, left, &env);
            if (ev < 0) return ev;
            if (ev == CLIENT_LOST) lost = true;
            if (ev == CLIENT_REFUSED) {
                /* Down: the next endpoint now, or after a pause once every
                 * one could not serve (the last UNAVAILABLE's retry_after). */
                client_unavailable(c, &unavailable, pause_ms);
                move_on = refused = true;
            }
            if (ev != CLIENT_MSG) continue;
            if (env->tag == req->tag && env->body_case == want) {
                *reply = env;
                return 0;
            }
            if (env->tag == req->tag && env->body_case == LLM__CLIENT_ENVELOPE__BODY_ERROR) {
                const Llm__Error *e = env->error;
                if ((e->code == LLM__ERROR__CODE__UNAVAILABLE || e->retry_after_ms > 0) &&
                    client_now_ms() + (int64_t)e->retry_after_ms < give_up) {
                    client_router_error(c, e, what);
                    /* Another router may serve it: see client_unavailable. */
                    if (e->code == LLM__ERROR__CODE__UNAVAILABLE) {
                        pause_ms = (int)e->retry_after_ms;
                        move_on = client_unavailable(c, &unavailable, pause_ms);
                    } else {
                        unavailable = 0;
                        client_sleep_ms(e->retry_after_ms > 0 ? (int)e->retry_after_ms : 200);
                    }
                    proto_client_free(env);
                    break;
                }
                rc = client_router_error(c, e, what);
                proto_client_free(env);
                return rc;
            }
            proto_client_free(env); /* a stale reply or a chunk of an earlier request */
        }
        if (client_now_ms() >= give_up) {
            if (c->err_code == LLM__ERROR__CODE__OK)
                client_seterr(c, LLM__ERROR__CODE__OK, "%s: no reply from %s within %d ms", what,
                              c->endpoints[c->cur], c->cfg.retry_ms);
            return c->err_code == LLM__ERROR__CODE__OK ? STATUS_UNAVAILABLE
                                                       : proto_status_from_code(c->err_code);
        }
        if (lost || move_on || client_now_ms() >= sent + c->cfg.reply_timeout_ms) {
            rc = client_reconnect(c, lost      ? "connection lost"
                                     : refused ? "connection refused: no router listens there"
                                     : move_on ? c->errstr
                                               : "no reply");
            if (rc < 0) return rc;
        }
    }
}

static int client_simple(llm_client *c, Llm__ClientEnvelope__BodyCase body,
                         Llm__ClientEnvelope__BodyCase want, const char *what,
                         Llm__ClientEnvelope **reply) {
    Llm__ClientEnvelope env = LLM__CLIENT_ENVELOPE__INIT;
    Llm__HealthRequest h = LLM__HEALTH_REQUEST__INIT;
    Llm__StatusRequest s = LLM__STATUS_REQUEST__INIT;
    Llm__ModelsRequest m = LLM__MODELS_REQUEST__INIT;
    env.body_case = body;
    if (body == LLM__CLIENT_ENVELOPE__BODY_HEALTH) env.health = &h;
    else if (body == LLM__CLIENT_ENVELOPE__BODY_STATUS) env.status = &s;
    else env.models = &m;
    return client_call(c, &env, want, what, reply);
}

int llm_client_health(llm_client *c, Llm__ClientEnvelope **reply) {
    return client_simple(c, LLM__CLIENT_ENVELOPE__BODY_HEALTH, LLM__CLIENT_ENVELOPE__BODY_HEALTH_REPLY,
                         "health", reply);
}

int llm_client_status(llm_client *c, Llm__ClientEnvelope **reply) {
    return client_simple(c, LLM__CLIENT_ENVELOPE__BODY_STATUS, LLM__CLIENT_ENVELOPE__BODY_STATUS_REPLY,
                         "status", reply);
}

int llm_client_models(llm_client *c, Llm__ClientEnvelope **reply) {
    return client_simple(c, LLM__CLIENT_ENVELOPE__BODY_MODELS, LLM__CLIENT_ENVELOPE__BODY_MODELS_REPLY,
                         "models", reply);
}

int llm_client_drain(llm_client *c, const uint32_t *ids, size_t n, bool resume, Llm__ClientEnvelope **reply) {
    Llm__ClientEnvelope env = LLM__CLIENT_ENVELOPE__INIT;
    Llm__DrainRequest d = LLM__DRAIN_REQUEST__INIT;
    d.pipeline_ids = (uint32_t *)ids;
    d.n_pipeline_ids = n;
    d.resume = resume;
    env.body_case = LLM__CLIENT_ENVELOPE__BODY_DRAIN;
    env.drain = &d;
    return client_call(c, &env, LLM__CLIENT_ENVELOPE__BODY_DRAIN_REPLY, "drain", reply);
}

int llm_client_probe(llm_client *c, int timeout_ms) {
    if (timeout_ms <= 0) timeout_ms = 1;
    int reply = c->cfg.reply_timeout_ms, retry = c->cfg.retry_ms;
    /* Every endpoint gets its share of the time before the next is tried. */
    int share = timeout_ms / (int)c->n_endpoints;
    c->cfg.reply_timeout_ms = share > 0 ? share : 1;
    c->cfg.retry_ms = timeout_ms;
    Llm__ClientEnvelope *env = NULL;
    int rc = llm_client_health(c, &env);
    c->cfg.reply_timeout_ms = reply;
    c->cfg.retry_ms = retry;
    proto_client_free(env);
    if (rc == 0 || c->err_code != LLM__ERROR__CODE__OK) return 0; /* an Error is an answer too */
    char eps[512] = "";
    for (size_t i = 0; i < c->n_endpoints; i++)
        snprintf(eps + strlen(eps), sizeof eps - strlen(eps), "%s%s", i ? ", " : "", c->endpoints[i]);
    client_seterr(c, LLM__ERROR__CODE__OK, "no router answers at %s (waited %d ms)", eps, timeout_ms);
    return STATUS_UNAVAILABLE;
}

