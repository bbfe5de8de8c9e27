/* llm-gateway's HTTP server: libmicrohttpd with one thread per connection,
 * the routes, API keys and body limits, the pool of router clients,
 * /v1/models, and the metrics port with its /ready probe.  Generations are
 * gw_generate.c's. */
#include "gateway/gateway-impl.h"

#include <errno.h>
#include <netdb.h>
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/socket.h>
#include <time.h>
#include <zmq.h>

#include "common/log.h"
#include "common/status.h"

static const char *const route_names[GW_ROUTES] = {"other", "completions", "chat_completions", "models"};

int64_t gw_now_ms(void) {
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (int64_t)ts.tv_sec * 1000 + ts.tv_nsec / 1000000;
}

int64_t gw_now_us(void) {
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (int64_t)ts.tv_sec * 1000000 + ts.tv_nsec / 1000;
}

void gateway_config_default(struct gateway_config *cfg) {
    memset(cfg, 0, sizeof *cfg);
    cfg->listen = "127.0.0.1:8080";
    cfg->router = "tcp://127.0.0.1:5555";
    cfg->max_body = 1 << 20;
    cfg->max_connections = 256;
    cfg->read_timeout_ms = 10000;
    cfg->router_retry_ms = 5000;
    cfg->router_reply_timeout_ms = 2000;
}

uint16_t gateway_port(const gateway *g) { return g->port; }

uint64_t gateway_responses(const gateway *g, int status) {
    return status >= 0 && status < GW_STATUS_SLOTS ? atomic_load(&g->responses[status]) : 0;
}

/* ---- growable byte buffer ------------------------------------------------ */


int gw_buf_add(struct buf *b, const char *s, size_t n) {
    if (b->len + n + 1 > b->cap) {
        size_t cap = b->cap ? b->cap : 1024;
        while (cap < b->len + n + 1) cap *= 2;
        char *p = realloc(b->p, cap);
        if (!p) return STATUS_NO_MEMORY;
        b->p = p;
        b->cap = cap;
    }
    memcpy(b->p + b->len, s, n);
    b->len += n;
    b->p[b->len] = 0;
    return 0;
}

/* ---- router clients ------------------------------------------------------
 * A libllmclient client is used by one thread at a time; idle ones wait in
 * a pool so that a request does not pay for a new connection. */

llm_client *gw_pool_get(gateway *g, char *err, size_t errlen) {
    pthread_mutex_lock(&g->pool_mu);
    llm_client *c = g->n_pool > 0 ? g->pool[--g->n_pool] : NULL;
    pthread_mutex_unlock(&g->pool_mu);
    if (c) return c;
    struct llm_client_config cc;
    llm_client_config_default(&cc);
    cc.endpoints = (const char *const *)g->endpoints;
    cc.n_endpoints = g->n_endpoints;
    cc.zmq_ctx = g->zctx;
    cc.retry_ms = g->cfg.router_retry_ms;
    cc.reply_timeout_ms = g->cfg.router_reply_timeout_ms;
    if (llm_client_open(&c, &cc, err, errlen) < 0) return NULL;
    return c;
}

/* A client whose last call failed on its own side (no router answered) is
 * closed rather than kept: its socket may hold a stale connection. */
void gw_pool_put(gateway *g, llm_client *c, bool keep) {
    if (!c) return;
    pthread_mutex_lock(&g->pool_mu);
    if (keep && g->n_pool < GW_POOL_MAX) {
        g->pool[g->n_pool++] = c;
        c = NULL;
    }
    pthread_mutex_unlock(&g->pool_mu);
    llm_client_close(c);
}

/* ---- responses -------------------------------------------------------------- */

/* The route of the request this connection thread is answering: every
 * connection has a thread of its own (MHD_USE_THREAD_PER_CONNECTION), so the
 * response counters learn it without passing it through every reply path. */
static _Thread_local enum route tl_route;

/* One more response with this status on the current route. */
void gw_count_response(gateway *g, struct MHD_Connection *conn, int status) {
    (void)conn;
    if (status <= 0 || status >= GW_STATUS_SLOTS) return;
    atomic_fetch_add(&g->responses[status], 1);
    if (!g->f_requests) return;
    enum route rt = tl_route;
    metrics_series *sr = atomic_load(&g->by_status[rt][status]);
    if (!sr) {
        char code[8];
        snprintf(code, sizeof code, "%d", status);
        const char *values[] = {route_names[rt], code};
        sr = metrics_series_get(g->f_requests, values);
        atomic_store(&g->by_status[rt][status], sr);
    }
    if (sr) metrics_counter_inc(sr);
}

static enum MHD_Result send_text(gateway *g, struct MHD_Connection *conn, int status, const char *ctype,
                                 const char *body, int retry_after_s, const char *allow) {
    struct MHD_Response *r = MHD_create_response_from_buffer(strlen(body), (void *)body, MHD_RESPMEM_MUST_COPY);
    if (!r) return MHD_NO;
    MHD_add_response_header(r, "Content-Type", ctype);
    if (retry_after_s > 0) {
        char v[16];
        snprintf(v, sizeof v, "%d", retry_after_s);
        MHD_add_response_header(r, "Retry-After", v);
    }
    if (allow) MHD_add_response_header(r, "Allow", allow);
    if (status == 401) MHD_add_response_header(r, "WWW-Authenticate", "Bearer");
    enum MHD_Result ok = MHD_queue_response(conn, (unsigned)status, r);
    MHD_destroy_response(r);
    if (ok == MHD_YES) gw_count_response(g, conn, status);
    return ok;
}

enum MHD_Result gw_send_json(gateway *g, struct MHD_Connection *conn, int status, cJSON *root) {
    char *s = cJSON_PrintUnformatted(root);
    cJSON_Delete(root);
    if (!s) return MHD_NO;
    enum MHD_Result ok = send_text(g, conn, status, "application/json", s, 0, NULL);
    free(s);
    return ok;
}

enum MHD_Result gw_send_error(gateway *g, struct MHD_Connection *conn, const struct oai_error *e,
                              const char *allow) {
    char *s = oai_error_json(e);
    if (!s) return MHD_NO;
    if (e->status >= 500) LOG(LL_WARN, "gateway: %d: %s", e->status, e->message);
    else LOG(LL_DEBUG, "gateway: %d: %s", e->status, e->message);
    enum MHD_Result ok = send_text(g, conn, e->status, "application/json", s, e->retry_after_s, allow);
    free(s);
    return ok;
}

/* ---- the default model ------------------------------------------------------ */

#define GW_INFO_MAX_AGE_MS 60000

/* Keeps the default model of a Models reply. */
static void info_learn(gateway *g, const Llm__ModelsReply *mr) {
    for (size_t i = 0; mr && i < mr->n_models; i++) {
        const Llm__ModelInfo *mi = mr->models[i];
        if (!mi->is_default && mr->n_models > 1) continue;
        pthread_mutex_lock(&g->info_mu);
        snprintf(g->info_id, sizeof g->info_id, "%s", mi->id ? mi->id : "");
        g->info_n_ctx = mi->n_ctx;
        g->info_at_ms = gw_now_ms();
        pthread_mutex_unlock(&g->info_mu);
        return;
    }
}

/* How long a failed Models call waits before the next. */
#define GW_INFO_RETRY_MS 2000

/* One Models call on info_client (opened here the first time); called by
 * the thread that set info_busy, without info_mu. */
static void info_fetch(gateway *g) {
    char err[256] = "";
    if (!g->info_client) {
        struct llm_client_config cc;
        llm_client_config_default(&cc);
        cc.endpoints = (const char *const *)g->endpoints;
        cc.n_endpoints = g->n_endpoints;
        cc.zmq_ctx = g->zctx;
        cc.retry_ms = 300;
        cc.reply_timeout_ms = 500;
        if (llm_client_open(&g->info_client, &cc, err, sizeof err) < 0) g->info_client = NULL;
    }
    Llm__ClientEnvelope *rep = NULL;
    int rc = g->info_client ? llm_client_models(g->info_client, &rep) : STATUS_UNAVAILABLE;
    if (rc >= 0) info_learn(g, rep->models_reply);
    else LOG(LL_DEBUG, "gateway: the router's models: %s", g->info_client ? llm_client_errstr(g->info_client) : err);
    proto_client_free(rep);
}

void gw_model_info(gateway *g, char *name, size_t size, uint32_t *n_ctx) {
    pthread_mutex_lock(&g->info_mu);
    int64_t now = gw_now_ms();
    bool stale = g->info_at_ms == 0 || now - g->info_at_ms >= GW_INFO_MAX_AGE_MS;
    if (stale && !g->info_busy && now - g->info_try_ms >= GW_INFO_RETRY_MS) {
        g->info_busy = true;
        g->info_try_ms = now;
        pthread_mutex_unlock(&g->info_mu);
        info_fetch(g);
        pthread_mutex_lock(&g->info_mu);
        g->info_busy = false;
        pthread_cond_broadcast(&g->info_cv);
    }
    /* Never learnt and being asked: the answer is a moment away. */
    while (g->info_busy && g->info_at_ms == 0) pthread_cond_wait(&g->info_cv, &g->info_mu);
    if (g->model_name) {
        snprintf(name, size, "%s", g->model_name);
    } else if (g->info_id[0]) {
        snprintf(name, size, "%s", g->info_id);
    } else if (g->model_path) {
        /* What the router calls a model: its file's or folder's name. */
        size_t n = strlen(g->model_path);
        while (n > 1 && g->model_path[n - 1] == '/') n--;
        size_t b = n;
        while (b > 0 && g->model_path[b - 1] != '/') b--;
        snprintf(name, size, "%.*s", (int)(n - b), g->model_path + b);
    } else {
        snprintf(name, size, "default");
    }
    if (n_ctx) *n_ctx = g->info_n_ctx;
    pthread_mutex_unlock(&g->info_mu);
}

static enum MHD_Result handle_models(gateway *g, struct MHD_Connection *conn) {
    char err[512];
    struct oai_error e;
    llm_client *c = gw_pool_get(g, err, sizeof err);
    Llm__ClientEnvelope *rep = NULL;
    int rc = c ? llm_client_models(c, &rep) : STATUS_UNAVAILABLE;
    if (rc < 0) {
        Llm__Error__Code code = c ? llm_client_error_code(c) : LLM__ERROR__CODE__OK;
        gw_error_from_router(&e, OAI_COMPLETIONS, code, c ? llm_client_error_reason(c) : NULL,
                             c ? llm_client_errstr(c) : err, c ? llm_client_retry_after_ms(c) : 0);
        gw_pool_put(g, c, c && code != LLM__ERROR__CODE__OK);
        return gw_send_error(g, conn, &e, NULL);
    }
    gw_pool_put(g, c, true);
    const Llm__ModelsReply *mr = rep->models_reply;
    info_learn(g, mr);
    cJSON *root = cJSON_CreateObject();
    cJSON_AddStringToObject(root, "object", "list");
    cJSON *data = cJSON_AddArrayToObject(root, "data");
    for (size_t i = 0; mr && i < mr->n_models; i++) {
        const Llm__ModelInfo *mi = mr->models[i];
        cJSON *m = cJSON_CreateObject();
        cJSON_AddStringToObject(m, "id", mi->is_default && g->model_name ? g->model_name : mi->id);
        cJSON_AddStringToObject(m, "object", "model");
        cJSON_AddNumberToObject(m, "created", 0);
        cJSON_AddStringToObject(m, "owned_by", "llm-cluster");
        cJSON_AddNumberToObject(m, "max_model_len", mi->n_ctx);
        cJSON_AddItemToArray(data, m);
    }
    proto_client_free(rep);
    return gw_send_json(g, conn, 200, root);
}

static bool authorized(gateway *g, struct MHD_Connection *conn) {
    if (g->cfg.n_api_keys == 0) return true;
    const char *h = MHD_lookup_connection_value(conn, MHD_HEADER_KIND, "Authorization");
    if (!h || strncasecmp(h, "Bearer ", 7) != 0) return false;
    const char *key = h + 7;
    while (*key == ' ') key++;
    size_t kl = strlen(key);
    bool ok = false;
    /* Every key compared in full, so that timing tells nothing of a prefix. */
    for (size_t i = 0; i < g->cfg.n_api_keys; i++) {
        const char *k = g->keys[i];
        size_t n = strlen(k);
        unsigned diff = (unsigned)(n != kl);
        for (size_t b = 0; b < n; b++) diff |= (unsigned)(unsigned char)k[b] ^ (unsigned char)(b < kl ? key[b] : 0);
        ok |= diff == 0;
    }
    return ok;
}

static enum route route_of(const char *url, const char **allow) {
    *allow = NULL;
    if (strcmp(url, "/v1/completions") == 0) { *allow = "POST"; return R_COMPLETIONS; }
    if (strcmp(url, "/v1/chat/completions") == 0) { *allow = "POST"; return R_CHAT; }
    if (strcmp(url, "/v1/models") == 0) { *allow = "GET"; return R_MODELS; }
    return R_NONE;
}

static enum MHD_Result on_request(void *cls, struct MHD_Connection *conn, const char *url, const char *method,
                                  const char *version, const char *upload_data, size_t *upload_data_size,
                                  void **con_cls) {
    gateway *g = cls;
    struct req_ctx *ctx = *con_cls;
    struct oai_error e;
    const char *allow_unused;
    tl_route = route_of(url, &allow_unused);
    if (!ctx) {
        /* First call: headers only.  Everything that can be refused without
         * the body is refused here, before a byte of it is read. */
        ctx = calloc(1, sizeof *ctx);
        if (!ctx) return MHD_NO;
        ctx->t_arrive_us = gw_now_us();
        *con_cls = ctx;
        const char *allow;
        enum route rt = route_of(url, &allow);
        if (rt == R_NONE) {
            oai_error_set(&e, 404, "invalid_request_error", NULL, "unknown_url", "Unknown request URL: %s %.200s",
                          method, url);
            return gw_send_error(g, conn, &e, NULL);
        }
        if (strcmp(method, allow) != 0) {
            oai_error_set(&e, 405, "invalid_request_error", NULL, "method_not_allowed",
                          "%s %.200s is not allowed: use %s", method, url, allow);
            return gw_send_error(g, conn, &e, allow);
        }
        if (!authorized(g, conn)) {
            oai_error_set(&e, 401, "invalid_request_error", NULL, "invalid_api_key",
                          "a valid API key is needed: send it as \"Authorization: Bearer KEY\"");
            return gw_send_error(g, conn, &e, NULL);
        }
        const char *cl = MHD_lookup_connection_value(conn, MHD_HEADER_KIND, "Content-Length");
        if (cl) {
            char *end;
            errno = 0;
            unsigned long long n = strtoull(cl, &end, 10);
            if (errno || end == cl || (long long)n > g->cfg.max_body) {
                oai_error_set(&e, 413, "invalid_request_error", NULL, "request_too_large",
                              "the request body (Content-Length %.40s) is larger than this gateway's limit of %lld "
                              "bytes (--max-body)", cl, (long long)g->cfg.max_body);
                return gw_send_error(g, conn, &e, NULL);
            }
        }
        return MHD_YES;
    }
    if (*upload_data_size > 0) {
        /* A body without Content-Length (chunked) is bounded as it comes:
         * past the limit it is no longer kept, and libmicrohttpd takes a
         * response only once the upload has ended, so the rest is read and
         * dropped, up to 8 times the limit; a client sending more than that
         * loses the connection. */
        ctx->received += *upload_data_size;
        if (!ctx->too_big && (int64_t)ctx->received > g->cfg.max_body) ctx->too_big = true;
        if (!ctx->too_big && gw_buf_add(&ctx->body, upload_data, *upload_data_size) < 0) return MHD_NO;
        *upload_data_size = 0;
        if (ctx->too_big && (int64_t)ctx->received > 8 * g->cfg.max_body) {
            LOG(LL_INFO, "gateway: a chunked body past %lld bytes: closing the connection",
                (long long)(8 * g->cfg.max_body));
            return MHD_NO;
        }
        return MHD_YES;
    }
    /* The request is read: from here to its response's end the guard leaves
     * the connection alone, however long the generation takes. */
    httpd_guard_busy(conn);
    if (ctx->too_big) {
        oai_error_set(&e, 413, "invalid_request_error", NULL, "request_too_large",
                      "the request body is larger than this gateway's limit of %lld bytes (--max-body)",
                      (long long)g->cfg.max_body);
        return gw_send_error(g, conn, &e, NULL);
    }
    const char *allow;
    switch (route_of(url, &allow)) {
    case R_COMPLETIONS: return gw_handle_generate(g, conn, ctx, OAI_COMPLETIONS);
    case R_CHAT: return gw_handle_generate(g, conn, ctx, OAI_CHAT);
    case R_MODELS: return handle_models(g, conn);
    default: return MHD_NO;
    }
}

/* MHD's request-completed callback: a request that ends any other way than
 * a full response (the client hung up, a write failed) cancels its job. */
static void on_completed(void *cls, struct MHD_Connection *conn, void **con_cls,
                         enum MHD_RequestTerminationCode toe) {
    (void)cls;
    httpd_guard_idle(conn);
    struct req_ctx *ctx = *con_cls;
    if (!ctx) return;
    if (ctx->job) {
        if (toe != MHD_REQUEST_TERMINATED_COMPLETED_OK) gw_job_cancel(ctx->job);
        gw_job_release(ctx->job);
    }
    free(ctx->body.p);
    free(ctx);
    *con_cls = NULL;
}

static void mhd_log(void *cls, const char *fmt, va_list ap) {
    char msg[512];
    vsnprintf(msg, sizeof msg, fmt, ap);
    size_t n = strlen(msg);
    while (n > 0 && msg[n - 1] == '\n') msg[--n] = 0;
    LOG(httpd_guard_log_level(msg), "gateway: libmicrohttpd: %s", msg);
}

/* ---- start and stop ----------------------------------------------------------- */

static int load_model(gateway *g, char *err, size_t errlen) {
    enum chat_family chosen = CHAT_FAMILY_NONE;
    if (g->cfg.chat_template) {
        chosen = chat_family_from_name(g->cfg.chat_template);
        if (chosen == CHAT_FAMILY_NONE) {
            snprintf(err, errlen, "--chat-template %s: unknown; expected one of %s", g->cfg.chat_template,
                     chat_family_names());
            return STATUS_BAD_INPUT;
        }
    }
    if (!g->model_path) {
        g->family = chosen;
        snprintf(g->chat_problem, sizeof g->chat_problem, "chat completions need the model's tokenizer: start "
                 "llm-gateway with --model PATH");
        return 0;
    }
    int rc = tokenizer_load(&g->tok, g->model_path, err, errlen);
    if (rc < 0) return rc;
    if (chosen != CHAT_FAMILY_NONE) {
        g->family = chosen;
        LOG(LL_INFO, "gateway: chat template %s (--chat-template)", chat_family_name(chosen));
        return 0;
    }
    char *tmpl = NULL;
    rc = chat_template_from_model(g->model_path, &tmpl, err, errlen);
    if (rc < 0) return rc;
    g->family = chat_template_detect(tmpl);
    if (g->family == CHAT_FAMILY_NONE) {
        /* Said after "model NAME" (the name clients use, known only once
         * the router answers): how to choose a template, whichever way the
         * gateway was started. */
        snprintf(g->chat_problem, sizeof g->chat_problem,
                 "%s: chat completions are refused rather than sent a guessed prompt; choose a template with "
                 "llm-gateway --chat-template NAME (or the environment variable LLM_CHAT_TEMPLATE=NAME; with "
                 "llm-cluster: llm-cluster up --chat-template NAME), NAME one of %s, or use /v1/completions",
                 tmpl ? "has a chat template this gateway does not recognise" : "has no chat template",
                 chat_family_names());
        LOG(LL_WARN, "gateway: model %s %s", g->model_name ? g->model_name : g->model_path, g->chat_problem);
    } else {
        LOG(LL_INFO, "gateway: chat template %s (from %s)", chat_family_name(g->family), g->model_path);
    }
    free(tmpl);
    return 0;
}

static int parse_listen(const char *s, struct sockaddr_storage *ss, socklen_t *sl, char *err, size_t errlen) {
    char host[256], port[16];
    const char *colon = strrchr(s, ':');
    if (!colon || colon == s || strlen(colon + 1) == 0 || strlen(colon + 1) >= sizeof port ||
        (size_t)(colon - s) >= sizeof host) {
        snprintf(err, errlen, "--listen %s: expected HOST:PORT", s);
        return STATUS_BAD_INPUT;
    }
    memcpy(host, s, (size_t)(colon - s));
    host[colon - s] = 0;
    snprintf(port, sizeof port, "%s", colon + 1);
    char *h = host;
    size_t hl = strlen(h);
    if (hl >= 2 && h[0] == '[' && h[hl - 1] == ']') {
        h[hl - 1] = 0;
        h++;
    }
    struct addrinfo hints = {.ai_flags = AI_PASSIVE | AI_NUMERICSERV, .ai_socktype = SOCK_STREAM}, *ai;
    int gr = getaddrinfo(h, port, &hints, &ai);
    if (gr != 0) {
        snprintf(err, errlen, "--listen %s: %s", s, gai_strerror(gr));
        return STATUS_BAD_INPUT;
    }
    memcpy(ss, ai->ai_addr, ai->ai_addrlen);
    *sl = ai->ai_addrlen;
    freeaddrinfo(ai);
    return 0;
}

static char *dup_or_null(const char *s) { return s ? strdup(s) : NULL; }

/* /ready: the gateway is ready when a router answers Health with SERVING.
 * Asked at most once a second, on the metrics thread's own client. */
static const char *gateway_ready(void *ud, char *buf, size_t size) {
    gateway *g = ud;
    pthread_mutex_lock(&g->probe_mu);
    int64_t now = gw_now_ms();
    if (now - g->probe_at_ms >= 1000) {
        g->probe_at_ms = now;
        char err[256];
        if (!g->probe) {
            struct llm_client_config cc;
            llm_client_config_default(&cc);
            cc.endpoints = (const char *const *)g->endpoints;
            cc.n_endpoints = g->n_endpoints;
            cc.zmq_ctx = g->zctx;
            cc.retry_ms = 1000;
            cc.reply_timeout_ms = 500;
            if (llm_client_open(&g->probe, &cc, err, sizeof err) < 0) g->probe = NULL;
        }
        Llm__ClientEnvelope *rep = NULL;
        if (!g->probe) {
            g->probe_ok = false;
            snprintf(g->probe_why, sizeof g->probe_why, "no router client: %.200s", err);
        } else if (llm_client_health(g->probe, &rep) < 0) {
            g->probe_ok = false;
            snprintf(g->probe_why, sizeof g->probe_why, "router %s: %s", g->cfg.router, llm_client_errstr(g->probe));
        } else {
            const Llm__HealthReply *h = rep->health_reply;
            g->probe_ok = h && h->status == LLM__HEALTH_REPLY__SERVING_STATUS__SERVING;
            snprintf(g->probe_why, sizeof g->probe_why, "router %s is up but not serving (no pipeline in service)",
                     llm_client_endpoint(g->probe));
        }
        proto_client_free(rep);
    }
    const char *why = NULL;
    if (!g->probe_ok) {
        snprintf(buf, size, "%s", g->probe_why);
        why = buf;
    }
    pthread_mutex_unlock(&g->probe_mu);
    return why;
}

static const double ttft_bounds[] = {0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30};
/* The gateway's own share: tens of microseconds normally, a millisecond
 * means it is short of CPU or opening router connections. */
static const double added_bounds[] = {0.00002, 0.00005, 0.0001, 0.0002, 0.0005, 0.001, 0.002, 0.005, 0.01, 0.05};
static const double e2e_bounds[] = {0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120, 300};

/* The registry and, when cfg asks for one, the metrics port. */
static int start_metrics(gateway *g, char *err, size_t errlen) {
    if (!g->cfg.metrics_listen || !g->cfg.metrics_listen[0]) return 0;
    if (metrics_init(&g->reg) < 0) {
        snprintf(err, errlen, "out of memory");
        return STATUS_NO_MEMORY;
    }
    static const char *const req_labels[] = {"endpoint", "code", NULL};
    const struct metrics_def defs[] = {
        {METRICS_COUNTER, "llm_http_requests_total", "HTTP responses of the OpenAI API, by endpoint and status code.",
         req_labels, NULL, 0},
        {METRICS_GAUGE, "llm_gateway_requests_running", "Generations this gateway has in flight.", NULL, NULL, 0},
        {METRICS_HISTOGRAM, "llm_gateway_time_to_first_token_seconds",
         "Time from a request's body being read to its first token, seen by the gateway.", NULL, ttft_bounds,
         (int)(sizeof ttft_bounds / sizeof ttft_bounds[0])},
        {METRICS_HISTOGRAM, "llm_gateway_e2e_request_latency_seconds",
         "Time from a request's body being read to its end, seen by the gateway.", NULL, e2e_bounds,
         (int)(sizeof e2e_bounds / sizeof e2e_bounds[0])},
        {METRICS_COUNTER, "llm_gateway_prompt_tokens_total", "Prompt tokens of the generations that ran.", NULL,
         NULL, 0},
        {METRICS_COUNTER, "llm_gateway_generation_tokens_total", "Tokens generated for this gateway's clients.",
         NULL, NULL, 0},
        {METRICS_HISTOGRAM, "llm_gateway_added_latency_seconds",
         "The gateway's own share of a streamed request's time to first token: from its headers being read to "
         "its generation being sent to the router, plus from its first token arriving to that token's event "
         "being handed to the HTTP connection.",
         NULL, added_bounds, (int)(sizeof added_bounds / sizeof added_bounds[0])},
    };
    metrics_family *f[7];
    for (int i = 0; i < 7; i++) {
        int rc = metrics_family_new(g->reg, &defs[i], &f[i], err, errlen);
        if (rc < 0) return rc;
    }
    g->f_requests = f[0];
    /* The statuses the gateway sends, so that they read 0 before the first. */
    static const int codes[] = {200, 400, 401, 404, 405, 413, 429, 500, 503};
    for (int rt = R_COMPLETIONS; rt <= R_MODELS; rt++)
        for (size_t k = 0; k < sizeof codes / sizeof codes[0]; k++) {
            char code[8];
            snprintf(code, sizeof code, "%d", codes[k]);
            const char *values[] = {route_names[rt], code};
            atomic_store(&g->by_status[rt][codes[k]], metrics_series_get(g->f_requests, values));
        }
    g->running = metrics_series_get(f[1], NULL);
    g->ttft = metrics_series_get(f[2], NULL);
    g->e2e = metrics_series_get(f[3], NULL);
    g->prompt_tokens = metrics_series_get(f[4], NULL);
    g->gen_tokens = metrics_series_get(f[5], NULL);
    g->added = metrics_series_get(f[6], NULL);
    struct httpd_config hc = {.listen = g->cfg.metrics_listen, .registry = g->reg, .ready = gateway_ready,
                              .ready_ud = g, .health = g->wd ? watchdog_health : NULL, .health_ud = g->wd};
    int rc = httpd_start(&g->http, &hc, err, errlen);
    if (rc == STATUS_IO && g->cfg.metrics_optional) {
        LOG(LL_WARN, "gateway: no metrics port: %s (give --metrics-listen another port)", err);
        return 0;
    }
    if (rc < 0) return rc;
    /* The address as given, with the port it got (port 0 picks one). */
    const char *colon = strrchr(g->cfg.metrics_listen, ':');
    int hl = colon ? (int)(colon - g->cfg.metrics_listen) : (int)strlen(g->cfg.metrics_listen);
    LOG(LL_INFO, "gateway: metrics on http://%.*s:%d (port %d): /metrics, /health, /ready", hl, g->cfg.metrics_listen,
        httpd_port(g->http), httpd_port(g->http));
    return 0;
}

int gateway_metrics_port(const gateway *g) { return g->http ? httpd_port(g->http) : 0; }

void gateway_tick(gateway *g) {
    pthread_mutex_lock(&g->pool_mu);
    pthread_mutex_unlock(&g->pool_mu);
    pthread_mutex_lock(&g->jobs_mu);
    pthread_mutex_unlock(&g->jobs_mu);
    pthread_mutex_lock(&g->info_mu);
    pthread_mutex_unlock(&g->info_mu);
    watchdog_beat(g->wd, 0);
}

int gateway_start(gateway **out, const struct gateway_config *cfg, char *err, size_t errlen) {
    *out = NULL;
    gateway *g = calloc(1, sizeof *g);
    if (!g) {
        snprintf(err, errlen, "out of memory");
        return STATUS_NO_MEMORY;
    }
    pthread_mutex_init(&g->pool_mu, NULL);
    pthread_mutex_init(&g->probe_mu, NULL);
    pthread_mutex_init(&g->info_mu, NULL);
    pthread_cond_init(&g->info_cv, NULL);
    pthread_mutex_init(&g->jobs_mu, NULL);
    pthread_cond_init(&g->jobs_cv, NULL);
    g->cfg = *cfg;
    g->listen = strdup(cfg->listen);
    g->router = strdup(cfg->router);
    g->model_path = dup_or_null(cfg->model_path && cfg->model_path[0] ? cfg->model_path : NULL);
    g->model_name = dup_or_null(cfg->model_name && cfg->model_name[0] ? cfg->model_name : NULL);
    g->keys = calloc(cfg->n_api_keys + 1, sizeof *g->keys);
    for (size_t i = 0; g->keys && i < cfg->n_api_keys; i++) g->keys[i] = strdup(cfg->api_keys[i]);
    g->cfg.listen = g->listen;
    g->cfg.router = g->router;
    g->cfg.model_path = g->model_path;
    g->cfg.model_name = g->model_name;
    g->cfg.api_keys = (const char *const *)g->keys;
    int rc = STATUS_BAD_INPUT;
    for (char *save = NULL, *t = strtok_r(g->router, ",", &save); t; t = strtok_r(NULL, ",", &save)) {
        if (g->n_endpoints == GW_ENDPOINTS_MAX) {
            snprintf(err, errlen, "--router: more than %d endpoints", GW_ENDPOINTS_MAX);
            goto fail;
        }
        g->endpoints[g->n_endpoints++] = t;
    }
    if (g->n_endpoints == 0) {
        snprintf(err, errlen, "--router \"%s\": no endpoint", cfg->router);
        goto fail;
    }
    g->zctx = zmq_ctx_new();
    if (!g->zctx) {
        snprintf(err, errlen, "zmq_ctx_new: %s", zmq_strerror(zmq_errno()));
        rc = STATUS_INTERNAL;
        goto fail;
    }
    rc = load_model(g, err, errlen);
    if (rc < 0) goto fail;
    static const char *const loops[] = {"supervisor"};
    if (cfg->watchdog_ms > 0 && (rc = watchdog_init(&g->wd, cfg->watchdog_ms, loops, 1, err, errlen)) < 0)
        goto fail;
    if (g->cfg.metrics_listen) g->cfg.metrics_listen = g->metrics_listen = strdup(g->cfg.metrics_listen);
    rc = start_metrics(g, err, errlen);
    if (rc < 0) {
        char m[512];
        snprintf(m, sizeof m, "%s", err);
        snprintf(err, errlen, "--metrics-listen: %s", m);
        goto fail;
    }
    struct sockaddr_storage ss;
    socklen_t sl;
    rc = parse_listen(cfg->listen, &ss, &sl, err, errlen);
    if (rc < 0) goto fail;
    struct httpd_guard_config gc = {.name = "gateway", .max_connections = (unsigned)cfg->max_connections,
                                    .read_timeout_ms = (unsigned)cfg->read_timeout_ms};
    rc = httpd_guard_init(&g->guard, &gc, err, errlen);
    if (rc < 0) goto fail;
    /* poll(), not select(): a busy gateway's descriptors pass FD_SETSIZE. */
    unsigned flags = MHD_USE_THREAD_PER_CONNECTION | MHD_USE_POLL_INTERNAL_THREAD | MHD_USE_ERROR_LOG;
    if (ss.ss_family == AF_INET6) flags |= MHD_USE_IPv6;
    /* libmicrohttpd's own inactivity timeout (60 s) stays for a response
     * nobody reads; the guard bounds the time to send a request. */
    g->mhd = MHD_start_daemon(flags, 0, NULL, NULL, on_request, g, MHD_OPTION_EXTERNAL_LOGGER, mhd_log, g,
                              MHD_OPTION_SOCK_ADDR, (struct sockaddr *)&ss, MHD_OPTION_NOTIFY_COMPLETED, on_completed,
                              g, MHD_OPTION_NOTIFY_CONNECTION, httpd_guard_notify, g->guard,
                              MHD_OPTION_CONNECTION_LIMIT, httpd_guard_mhd_limit(g->guard),
                              MHD_OPTION_PER_IP_CONNECTION_LIMIT, (unsigned)cfg->max_connections_per_ip,
                              MHD_OPTION_CONNECTION_TIMEOUT, (unsigned)60, MHD_OPTION_END);
    if (!g->mhd) {
        snprintf(err, errlen, "--listen %s: cannot listen there (in use, or not an address of this host)",
                 cfg->listen);
        rc = STATUS_IO;
        goto fail;
    }
    httpd_guard_listening(g->guard, g->mhd);
    const union MHD_DaemonInfo *di = MHD_get_daemon_info(g->mhd, MHD_DAEMON_INFO_BIND_PORT);
    g->port = di ? di->port : 0;
    *out = g;
    return 0;
fail:
    gateway_stop(g);
    return rc;
}

void gateway_stop(gateway *g) {
    if (!g) return;
    /* Connections first: each one that ends cancels its job. */
    if (g->mhd) MHD_stop_daemon(g->mhd);
    httpd_guard_free(g->guard);
    gw_runners_stop(g);
    httpd_stop(g->http);
    watchdog_free(g->wd);
    llm_client_close(g->probe);
    llm_client_close(g->info_client);
    metrics_free(g->reg);
    free(g->metrics_listen);
    for (int i = 0; i < g->n_pool; i++) llm_client_close(g->pool[i]);
    if (g->zctx) zmq_ctx_term(g->zctx);
    tokenizer_free(g->tok);
    for (size_t i = 0; g->keys && i < g->cfg.n_api_keys; i++) free(g->keys[i]);
    free(g->keys);
    free(g->listen);
    free(g->router);
    free(g->model_path);
    free(g->model_name);
    pthread_mutex_destroy(&g->pool_mu);
    pthread_mutex_destroy(&g->jobs_mu);
    pthread_mutex_destroy(&g->probe_mu);
    pthread_mutex_destroy(&g->info_mu);
    pthread_cond_destroy(&g->info_cv);
    pthread_cond_destroy(&g->jobs_cv);
    free(g);
}
