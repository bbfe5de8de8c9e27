/* llm-gateway's HTTP side.  libmicrohttpd runs one thread per connection,
 * so a handler may block; each generation runs llm_client_generate on a
 * thread of its own (a "job") that writes the OpenAI chunks into a buffer,
 * and the connection's thread turns that buffer into the HTTP response
 * while it watches its socket: a peer that hangs up cancels the request at
 * once instead of when the next token would fail to send. */
#include "gateway/gateway.h"

#include <cjson/cJSON.h>
#include <errno.h>
#include <microhttpd.h>
#include <netdb.h>
#include <poll.h>
#include <pthread.h>
#include <stdarg.h>
#include <stdatomic.h>
#include <stdbool.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/random.h>
#include <sys/socket.h>
#include <time.h>
#include <zmq.h>

#include "common/chat_template.h"
#include "common/httpd.h"
#include "common/log.h"
#include "common/metrics.h"
#include "common/status.h"
#include "common/tokenizer.h"
#include "gateway/oai.h"
#include "router/client.h"

#define GW_ENDPOINTS_MAX 16
#define GW_POOL_MAX 64
#define GW_STATUS_SLOTS 600
#define GW_ROUTES 4 /* enum route */

enum route { R_NONE, R_COMPLETIONS, R_CHAT, R_MODELS };
static const char *const route_names[GW_ROUTES] = {"other", "completions", "chat_completions", "models"};

static int64_t now_ms(void) {
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (int64_t)ts.tv_sec * 1000 + ts.tv_nsec / 1000000;
}

struct gateway {
    struct gateway_config cfg;
    char *listen, *router, *model_path, *model_name, *metrics_listen;
    char **keys;
    char *endpoints[GW_ENDPOINTS_MAX];
    size_t n_endpoints;
    void *zctx;
    pthread_mutex_t pool_mu;
    llm_client *pool[GW_POOL_MAX];
    int n_pool;
    tokenizer *tok;                 /* NULL without --model */
    enum chat_family family;
    char chat_problem[512];         /* why chat is refused, when family is NONE */
    struct MHD_Daemon *mhd;
    uint16_t port;
    _Atomic uint64_t responses[GW_STATUS_SLOTS];
    /* The metrics port (NULL when off) and what it shows. */
    metrics *reg;
    httpd *http;
    metrics_family *f_requests;
    metrics_series *_Atomic by_status[GW_ROUTES][GW_STATUS_SLOTS]; /* looked up once each */
    metrics_series *running, *ttft, *e2e, *prompt_tokens, *gen_tokens;
    llm_client *probe;              /* /ready's own client, used on the metrics thread only */
    pthread_mutex_t probe_mu;
    int64_t probe_at_ms;
    char probe_why[512];
    bool probe_ok;
    /* Job threads are detached; gateway_stop waits for this to reach 0. */
    pthread_mutex_t jobs_mu;
    pthread_cond_t jobs_cv;
    int jobs;
};

void gateway_config_default(struct gateway_config *cfg) {
    memset(cfg, 0, sizeof *cfg);
    cfg->listen = "127.0.0.1:8080";
    cfg->router = "tcp://127.0.0.1:5555";
    cfg->max_body = 1 << 20;
    cfg->max_connections = 256;
    cfg->router_retry_ms = 5000;
    cfg->router_reply_timeout_ms = 2000;
}

uint16_t gateway_port(const gateway *g) { return g->port; }

uint64_t gateway_responses(const gateway *g, int status) {
    return status >= 0 && status < GW_STATUS_SLOTS ? atomic_load(&g->responses[status]) : 0;
}

/* ---- growable byte buffer ------------------------------------------------ */

struct buf {
    char *p;
    size_t len, cap;
};

static int buf_add(struct buf *b, const char *s, size_t n) {
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

static llm_client *pool_get(gateway *g, char *err, size_t errlen) {
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
static void pool_put(gateway *g, llm_client *c, bool keep) {
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
static void count_response(gateway *g, struct MHD_Connection *conn, int status) {
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
    if (ok == MHD_YES) count_response(g, conn, status);
    return ok;
}

static enum MHD_Result send_json(gateway *g, struct MHD_Connection *conn, int status, cJSON *root) {
    char *s = cJSON_PrintUnformatted(root);
    cJSON_Delete(root);
    if (!s) return MHD_NO;
    enum MHD_Result ok = send_text(g, conn, status, "application/json", s, 0, NULL);
    free(s);
    return ok;
}

static enum MHD_Result send_error(gateway *g, struct MHD_Connection *conn, const struct oai_error *e,
                                  const char *allow) {
    char *s = oai_error_json(e);
    if (!s) return MHD_NO;
    if (e->status >= 500) LOG(LL_WARN, "gateway: %d: %s", e->status, e->message);
    else LOG(LL_DEBUG, "gateway: %d: %s", e->status, e->message);
    enum MHD_Result ok = send_text(g, conn, e->status, "application/json", s, e->retry_after_s, allow);
    free(s);
    return ok;
}

/* The router's refusal (llm_client_generate < 0, or a request that ended in
 * ERROR before its first token) as an OpenAI error. */
static void error_from_router(struct oai_error *e, Llm__Error__Code code, const char *msg, uint32_t retry_after_ms) {
    switch (code) {
    case LLM__ERROR__CODE__INVALID_ARGUMENT:
        oai_error_set(e, 400, "invalid_request_error", NULL, NULL, "%s", msg);
        break;
    case LLM__ERROR__CODE__NOT_FOUND:
        oai_error_set(e, 404, "invalid_request_error", "model", "model_not_found", "%s", msg);
        break;
    case LLM__ERROR__CODE__RESOURCE_EXHAUSTED:
        /* Two refusals share this code: a full queue, with the router's
         * retry_after_ms, and a request that can never fit the KV cache,
         * without (retrying cannot help). */
        if (retry_after_ms == 0) {
            oai_error_set(e, 400, "invalid_request_error", "max_tokens", "context_length_exceeded", "%s", msg);
        } else {
            oai_error_set(e, 429, "rate_limit_error", NULL, "rate_limit_exceeded", "%s", msg);
            e->retry_after_s = (int)((retry_after_ms + 999) / 1000);
        }
        break;
    case LLM__ERROR__CODE__FAILED_PRECONDITION:
    case LLM__ERROR__CODE__UNAVAILABLE:
    case LLM__ERROR__CODE__ABORTED:
        oai_error_set(e, 503, "server_error", NULL, "service_unavailable", "%s", msg);
        e->retry_after_s = retry_after_ms > 0 ? (int)((retry_after_ms + 999) / 1000) : 1;
        break;
    case LLM__ERROR__CODE__OK: /* the client's own failure: no router answered */
        oai_error_set(e, 503, "server_error", NULL, "router_unavailable", "the cluster's router cannot be reached: %s",
                      msg);
        e->retry_after_s = 1;
        break;
    default:
        oai_error_set(e, 500, "server_error", NULL, NULL, "%s", msg);
        break;
    }
}

/* ---- generations ---------------------------------------------------------- */

struct job {
    gateway *g;
    pthread_mutex_t mu;
    pthread_cond_t cv;
    int refs;                       /* the job thread, the connection, the response */
    struct oai_request req;
    int32_t *prompt_ids;            /* chat: the rendered prompt, tokenized here */
    size_t n_prompt_ids;
    char router_model[256];
    char id[64];                    /* "chatcmpl-..." / "cmpl-..."; the part after '-' is the request id */
    const char *request_id;
    char model[256];                /* as the responses name it */
    int64_t created;
    int64_t t0_ms;                  /* monotonic, when the request was read */
    int fd;                         /* the HTTP connection's socket */
    /* Under mu: */
    struct buf out;                 /* streaming: SSE bytes not yet sent */
    size_t out_off;
    struct buf text;                /* not streaming: the whole completion */
    bool started, done, cancel, role_sent;
    int rc;
    Llm__Error__Code code;
    uint32_t retry_after_ms;        /* of the router's refusal */
    char errstr[512];
    struct llm_generate_result res;
    cJSON *lp;                      /* not streaming, logprobs asked: the choice's logprobs so far */
    size_t lp_chars;                /* characters of the text the tokens so far make (text_offset) */
};

static void job_release(struct job *j) {
    pthread_mutex_lock(&j->mu);
    int left = --j->refs;
    pthread_mutex_unlock(&j->mu);
    if (left > 0) return;
    oai_request_free(&j->req);
    free(j->prompt_ids);
    free(j->out.p);
    free(j->text.p);
    llm_generate_result_free(&j->res);
    cJSON_Delete(j->lp);
    pthread_cond_destroy(&j->cv);
    pthread_mutex_destroy(&j->mu);
    free(j);
}

/* The skeleton every response object shares. */
static cJSON *job_object(const struct job *j, bool chunk) {
    cJSON *o = cJSON_CreateObject();
    cJSON_AddStringToObject(o, "id", j->id);
    cJSON_AddStringToObject(o, "object", j->req.kind == OAI_CHAT ? (chunk ? "chat.completion.chunk" : "chat.completion")
                                                                : "text_completion");
    cJSON_AddNumberToObject(o, "created", (double)j->created);
    cJSON_AddStringToObject(o, "model", j->model);
    return o;
}

static const char *finish_name(Llm__GenerateDone__FinishReason r) {
    switch (r) {
    case LLM__GENERATE_DONE__FINISH_REASON__LENGTH:
    case LLM__GENERATE_DONE__FINISH_REASON__DEADLINE: return "length";
    default: return "stop";
    }
}

static cJSON *usage_json(const struct llm_generate_result *r) {
    cJSON *u = cJSON_CreateObject();
    cJSON_AddNumberToObject(u, "prompt_tokens", r->prompt_tokens);
    cJSON_AddNumberToObject(u, "completion_tokens", r->completion_tokens);
    cJSON_AddNumberToObject(u, "total_tokens", (double)r->prompt_tokens + r->completion_tokens);
    return u;
}

/* ---- logprobs --------------------------------------------------------------
 * A token's text is its bytes (TokenLogprob.text): whole UTF-8 for most, part
 * of a character for some.  JSON strings must be whole UTF-8, so such a
 * token's string is "bytes:\xNN..." (OpenAI's form) while "bytes" (chat)
 * always has the real bytes. */

static bool utf8_whole(const unsigned char *s, size_t n) {
    for (size_t i = 0; i < n;) {
        unsigned char c = s[i];
        size_t l = c < 0x80 ? 1 : (c & 0xe0) == 0xc0 ? 2 : (c & 0xf0) == 0xe0 ? 3 : (c & 0xf8) == 0xf0 ? 4 : 0;
        if (l == 0 || i + l > n || (l == 2 && c < 0xc2)) return false;
        for (size_t k = 1; k < l; k++)
            if ((s[i + k] & 0xc0) != 0x80) return false;
        i += l;
    }
    return true;
}

static cJSON *token_string(const char *text, size_t len) {
    char stack[256], *b = len * 4 + 8 <= sizeof stack ? stack : malloc(len * 4 + 8);
    if (!b) return cJSON_CreateString("");
    if (utf8_whole((const unsigned char *)text, len)) {
        memcpy(b, text, len);
        b[len] = 0;
    } else {
        size_t n = (size_t)sprintf(b, "bytes:");
        for (size_t i = 0; i < len; i++) n += (size_t)sprintf(b + n, "\\x%02x", (unsigned char)text[i]);
    }
    cJSON *s = cJSON_CreateString(b);
    if (b != stack) free(b);
    return s;
}

static cJSON *token_bytes(const char *text, size_t len) {
    cJSON *a = cJSON_CreateArray();
    for (size_t i = 0; i < len; i++) cJSON_AddItemToArray(a, cJSON_CreateNumber((unsigned char)text[i]));
    return a;
}

/* An empty logprobs object of the request's kind: chat's {"content": []},
 * the legacy completion's four parallel arrays. */
static cJSON *lp_object(const struct job *j) {
    cJSON *o = cJSON_CreateObject();
    if (j->req.kind == OAI_CHAT) {
        cJSON_AddArrayToObject(o, "content");
    } else {
        cJSON_AddArrayToObject(o, "tokens");
        cJSON_AddArrayToObject(o, "token_logprobs");
        cJSON_AddArrayToObject(o, "top_logprobs");
        cJSON_AddArrayToObject(o, "text_offset");
    }
    return o;
}

/* Appends a chunk's tokens to a logprobs object; *chars counts the
 * characters of the text so far (the legacy text_offset). */
static void lp_append(const struct job *j, cJSON *o, const struct llm_chunk *ch, size_t *chars) {
    for (size_t i = 0; i < ch->n_logprobs; i++) {
        const struct llm_token_logprob *l = &ch->logprobs[i];
        if (j->req.kind == OAI_CHAT) {
            cJSON *t = cJSON_CreateObject();
            cJSON_AddItemToObject(t, "token", token_string(l->text, l->text_len));
            cJSON_AddNumberToObject(t, "logprob", l->logprob);
            cJSON_AddItemToObject(t, "bytes", token_bytes(l->text, l->text_len));
            cJSON *tops = cJSON_AddArrayToObject(t, "top_logprobs");
            for (size_t k = 0; k < l->n_top; k++) {
                cJSON *a = cJSON_CreateObject();
                cJSON_AddItemToObject(a, "token", token_string(l->top[k].text, l->top[k].text_len));
                cJSON_AddNumberToObject(a, "logprob", l->top[k].logprob);
                cJSON_AddItemToObject(a, "bytes", token_bytes(l->top[k].text, l->top[k].text_len));
                cJSON_AddItemToArray(tops, a);
            }
            cJSON_AddItemToArray(cJSON_GetObjectItemCaseSensitive(o, "content"), t);
        } else {
            cJSON_AddItemToArray(cJSON_GetObjectItemCaseSensitive(o, "tokens"), token_string(l->text, l->text_len));
            cJSON_AddItemToArray(cJSON_GetObjectItemCaseSensitive(o, "token_logprobs"), cJSON_CreateNumber(l->logprob));
            cJSON *d = cJSON_CreateObject();
            for (size_t k = 0; k < l->n_top; k++) {
                cJSON *key = token_string(l->top[k].text, l->top[k].text_len);
                /* Two alternatives with one text (a token and its byte
                 * form) keep the likelier, which comes first. */
                if (!cJSON_GetObjectItemCaseSensitive(d, key->valuestring))
                    cJSON_AddNumberToObject(d, key->valuestring, l->top[k].logprob);
                cJSON_Delete(key);
            }
            cJSON_AddItemToArray(cJSON_GetObjectItemCaseSensitive(o, "top_logprobs"), d);
            cJSON_AddItemToArray(cJSON_GetObjectItemCaseSensitive(o, "text_offset"), cJSON_CreateNumber((double)*chars));
        }
        /* Characters, counted as their first bytes. */
        for (size_t b = 0; b < l->text_len; b++)
            if (((unsigned char)l->text[b] & 0xc0) != 0x80) (*chars)++;
    }
}

/* One choice of a streamed chunk: text (NULL: none) and finish (NULL: null). */
static cJSON *stream_choice(const struct job *j, const char *text, size_t len, const char *finish, bool role,
                            cJSON *lp) {
    cJSON *c = cJSON_CreateObject();
    cJSON_AddNumberToObject(c, "index", 0);
    char *t = NULL;
    if (text) {
        t = malloc(len + 1);
        if (t) {
            memcpy(t, text, len);
            t[len] = 0;
        }
    }
    if (j->req.kind == OAI_CHAT) {
        cJSON *d = cJSON_AddObjectToObject(c, "delta");
        if (role) cJSON_AddStringToObject(d, "role", "assistant");
        if (t || role) cJSON_AddStringToObject(d, "content", t ? t : "");
    } else {
        cJSON_AddStringToObject(c, "text", t ? t : "");
    }
    free(t);
    if (lp) cJSON_AddItemToObject(c, "logprobs", lp);
    else cJSON_AddNullToObject(c, "logprobs");
    if (finish) cJSON_AddStringToObject(c, "finish_reason", finish);
    else cJSON_AddNullToObject(c, "finish_reason");
    return c;
}

/* Appends "data: JSON\n\n" (o is consumed).  Called with mu held. */
static void sse_event(struct job *j, cJSON *o) {
    char *s = cJSON_PrintUnformatted(o);
    cJSON_Delete(o);
    if (!s) return;
    buf_add(&j->out, "data: ", 6);
    buf_add(&j->out, s, strlen(s));
    buf_add(&j->out, "\n\n", 2);
    free(s);
}

/* lp (consumed; NULL: none) is the chunk's logprobs object. */
static void sse_chunk(struct job *j, const char *text, size_t len, const char *finish, cJSON *lp) {
    bool role = j->req.kind == OAI_CHAT && !j->role_sent;
    j->role_sent = true;
    cJSON *o = job_object(j, true);
    cJSON *cs = cJSON_AddArrayToObject(o, "choices");
    cJSON_AddItemToArray(cs, stream_choice(j, role && text && !len ? NULL : text, len, finish, role, lp));
    if (j->req.include_usage) cJSON_AddNullToObject(o, "usage");
    sse_event(j, o);
}

static int job_on_chunk(void *ud, const struct llm_chunk *ch) {
    struct job *j = ud;
    pthread_mutex_lock(&j->mu);
    if (j->cancel) {
        pthread_mutex_unlock(&j->mu);
        return 1;
    }
    if (j->req.stream) {
        cJSON *lp = NULL;
        if (ch->n_logprobs > 0) {
            lp = lp_object(j);
            lp_append(j, lp, ch, &j->lp_chars);
        }
        if (ch->text_len > 0 || !j->role_sent || lp) sse_chunk(j, ch->text, ch->text_len, NULL, lp);
    } else {
        buf_add(&j->text, ch->text, ch->text_len);
        if (ch->n_logprobs > 0) {
            if (!j->lp) j->lp = lp_object(j);
            lp_append(j, j->lp, ch, &j->lp_chars);
        }
    }
    if (!j->started && j->g->ttft) metrics_histogram_observe(j->g->ttft, (double)(now_ms() - j->t0_ms) / 1000.0);
    j->started = true;
    pthread_cond_broadcast(&j->cv);
    pthread_mutex_unlock(&j->mu);
    return 0;
}

/* The end of a stream that has begun: the finishing chunk, usage and
 * [DONE], or an error event.  Called with mu held. */
static void sse_finish(struct job *j) {
    if (j->rc < 0 || j->res.finish_reason == LLM__GENERATE_DONE__FINISH_REASON__ERROR) {
        struct oai_error e;
        error_from_router(&e, j->rc < 0 ? j->code : j->res.error_code, j->rc < 0 ? j->errstr : j->res.error_message,
                          j->rc < 0 ? j->retry_after_ms : 0);
        char *s = oai_error_json(&e);
        if (s) {
            buf_add(&j->out, "data: ", 6);
            buf_add(&j->out, s, strlen(s));
            buf_add(&j->out, "\n\n", 2);
            free(s);
        }
    } else {
        sse_chunk(j, NULL, 0, finish_name(j->res.finish_reason), NULL);
        if (j->req.include_usage) {
            cJSON *o = job_object(j, true);
            cJSON_AddArrayToObject(o, "choices");
            cJSON_AddItemToObject(o, "usage", usage_json(&j->res));
            sse_event(j, o);
        }
    }
    buf_add(&j->out, "data: [DONE]\n\n", 14);
}

static void *job_thread(void *arg) {
    struct job *j = arg;
    gateway *g = j->g;
    char err[512] = "";
    if (g->running) metrics_gauge_add(g->running, 1);
    llm_client *c = pool_get(g, err, sizeof err);
    int rc;
    Llm__Error__Code code = LLM__ERROR__CODE__OK;
    uint32_t retry_after_ms = 0;
    struct llm_generate_result res;
    memset(&res, 0, sizeof res);
    if (!c) {
        rc = STATUS_UNAVAILABLE;
    } else {
        struct llm_generate_params p;
        llm_generate_params_default(&p);
        p.request_id = j->request_id;
        p.model = j->router_model;
        if (j->prompt_ids) {
            p.prompt_tokens = j->prompt_ids;
            p.n_prompt_tokens = j->n_prompt_ids;
        } else if (j->req.prompt_tokens) {
            p.prompt_tokens = j->req.prompt_tokens;
            p.n_prompt_tokens = j->req.n_prompt_tokens;
        } else {
            p.prompt = j->req.prompt;
        }
        p.max_tokens = j->req.max_tokens;
        p.sampling = j->req.sp;
        p.stop = j->req.stop;
        p.n_stop = j->req.n_stop;
        /* Always streamed from the router: tokens arriving are what lets a
         * non-streaming request notice a client that went away. */
        p.stream = true;
        rc = llm_client_generate(c, &p, job_on_chunk, j, &res);
        if (rc < 0) {
            code = llm_client_error_code(c);
            retry_after_ms = llm_client_retry_after_ms(c);
            snprintf(err, sizeof err, "%s", llm_client_errstr(c));
        }
        pool_put(g, c, rc >= 0 || code != LLM__ERROR__CODE__OK);
    }
    pthread_mutex_lock(&j->mu);
    j->rc = rc;
    j->code = code;
    j->retry_after_ms = retry_after_ms;
    snprintf(j->errstr, sizeof j->errstr, "%s", err);
    j->res = res;
    if (j->req.stream && j->started) sse_finish(j);
    j->done = true;
    pthread_cond_broadcast(&j->cv);
    pthread_mutex_unlock(&j->mu);
    if (rc < 0) LOG(LL_INFO, "gateway: request %s: %s", j->request_id, err);
    if (g->running) {
        metrics_gauge_add(g->running, -1);
        metrics_histogram_observe(g->e2e, (double)(now_ms() - j->t0_ms) / 1000.0);
        if (rc >= 0) {
            metrics_counter_add(g->prompt_tokens, res.prompt_tokens);
            metrics_counter_add(g->gen_tokens, res.completion_tokens);
        }
    }
    job_release(j);
    pthread_mutex_lock(&g->jobs_mu);
    if (--g->jobs == 0) pthread_cond_broadcast(&g->jobs_cv);
    pthread_mutex_unlock(&g->jobs_mu);
    return NULL;
}

/* 1 when the peer closed the connection (or it failed). */
static bool peer_gone(int fd) {
    if (fd < 0) return false;
    struct pollfd p = {.fd = fd, .events = POLLRDHUP};
    if (poll(&p, 1, 0) <= 0) return false;
    return (p.revents & (POLLRDHUP | POLLHUP | POLLERR | POLLNVAL)) != 0;
}

/* The client went away: the job stops at its next token, and a Cancel by id
 * stops it now even while it waits in the router's queue. */
static void job_cancel(struct job *j) {
    pthread_mutex_lock(&j->mu);
    bool already = j->cancel || j->done;
    j->cancel = true;
    pthread_mutex_unlock(&j->mu);
    if (already) return;
    LOG(LL_INFO, "gateway: request %s: the HTTP client went away; cancelling", j->request_id);
    char err[256];
    llm_client *c = pool_get(j->g, err, sizeof err);
    if (!c) return;
    int rc = llm_client_cancel(c, j->request_id, NULL);
    pool_put(j->g, c, rc >= 0 || llm_client_error_code(c) != LLM__ERROR__CODE__OK);
}

/* Waits until cond holds (mu held), checking the socket every 100 ms.
 * Returns false when the peer went away (mu is then released). */
static bool job_wait(struct job *j, bool (*cond)(const struct job *)) {
    while (!cond(j)) {
        struct timespec ts;
        clock_gettime(CLOCK_REALTIME, &ts);
        ts.tv_nsec += 100 * 1000000L;
        if (ts.tv_nsec >= 1000000000L) {
            ts.tv_sec++;
            ts.tv_nsec -= 1000000000L;
        }
        pthread_cond_timedwait(&j->cv, &j->mu, &ts);
        if (!cond(j) && peer_gone(j->fd)) {
            pthread_mutex_unlock(&j->mu);
            job_cancel(j);
            return false;
        }
    }
    return true;
}

static bool cond_started(const struct job *j) { return j->started || j->done; }
static bool cond_done(const struct job *j) { return j->done; }
static bool cond_output(const struct job *j) { return j->out_off < j->out.len || j->done; }

static ssize_t sse_reader(void *cls, uint64_t pos, char *out, size_t max) {
    struct job *j = cls;
    pthread_mutex_lock(&j->mu);
    if (!job_wait(j, cond_output)) return MHD_CONTENT_READER_END_WITH_ERROR;
    size_t avail = j->out.len - j->out_off;
    if (avail == 0) {
        pthread_mutex_unlock(&j->mu);
        return MHD_CONTENT_READER_END_OF_STREAM;
    }
    size_t n = avail < max ? avail : max;
    memcpy(out, j->out.p + j->out_off, n);
    j->out_off += n;
    if (j->out_off == j->out.len) j->out_off = j->out.len = 0;
    pthread_mutex_unlock(&j->mu);
    return (ssize_t)n;
}

static void sse_free(void *cls) {
    struct job *j = cls;
    job_cancel(j); /* no-op once done */
    job_release(j);
}

/* Per HTTP request: the body as it arrives, and the job once there is one. */
struct req_ctx {
    struct buf body;
    size_t received;
    bool too_big;
    struct job *job;
};

/* Chat: the rendered prompt tokenized with the model's tokenizer, and its
 * end-of-turn token as a stop. */
static int chat_prompt(gateway *g, struct job *j, struct oai_error *e) {
    const char *model = g->model_path ? g->model_path : "the served model";
    if (g->family == CHAT_FAMILY_NONE) {
        oai_error_set(e, 400, "invalid_request_error", "messages", "chat_template_not_found", "%s", g->chat_problem);
        return -1;
    }
    char err[512], *text = NULL;
    if (chat_template_render(g->family, j->req.messages, j->req.n_messages, 1, &text, err, sizeof err) < 0) {
        oai_error_set(e, 400, "invalid_request_error", "messages", NULL, "%s", err);
        return -1;
    }
    size_t len = strlen(text);
    int32_t n = tokenizer_encode(g->tok, text, len, -1, 1, NULL, 0);
    if (n >= 0) {
        j->prompt_ids = malloc(((size_t)n + 1) * sizeof *j->prompt_ids);
        n = j->prompt_ids ? tokenizer_encode(g->tok, text, len, -1, 1, j->prompt_ids, n + 1) : STATUS_NO_MEMORY;
    }
    free(text);
    if (n < 0) {
        oai_error_set(e, 400, "invalid_request_error", "messages", NULL, "the messages cannot be tokenized by %s: %s",
                      model, status_str(n));
        return -1;
    }
    j->n_prompt_ids = (size_t)n;
    const char *eot = chat_template_end_of_turn(g->family);
    int32_t id = tokenizer_token_find(g->tok, eot, strlen(eot));
    struct sampling_params *sp = &j->req.sp;
    if (id >= 0) {
        if (!tokenizer_is_eog(g->tok, id) || sp->ignore_eos) {
            if (sp->n_stop_token_ids < SAMPLING_STOP_IDS_MAX) sp->stop_token_ids[sp->n_stop_token_ids++] = id;
        }
    } else if (j->req.n_stop < OAI_STOP_MAX) {
        j->req.stop[j->req.n_stop++] = eot;
    } else {
        oai_error_set(e, 400, "invalid_request_error", "stop",
                      NULL, "stop has %d strings: chat requests on this model keep one for the end of turn %s",
                      OAI_STOP_MAX, eot);
        return -1;
    }
    return 0;
}

static void random_hex(char *out, size_t n_hex) {
    unsigned char b[32];
    size_t nb = (n_hex + 1) / 2;
    if (nb > sizeof b) nb = sizeof b;
    if (getrandom(b, nb, 0) != (ssize_t)nb) {
        struct timespec ts;
        clock_gettime(CLOCK_REALTIME, &ts);
        for (size_t i = 0; i < nb; i++) b[i] = (unsigned char)((uint64_t)ts.tv_nsec >> (i % 8) * 8) ^ (unsigned char)i;
    }
    for (size_t i = 0; i < nb * 2 && i < n_hex; i++) out[i] = "0123456789abcdef"[(b[i / 2] >> (i % 2 ? 0 : 4)) & 15];
    out[n_hex] = 0;
}

static enum MHD_Result handle_generate(gateway *g, struct MHD_Connection *conn, struct req_ctx *ctx,
                                       enum oai_kind kind) {
    struct oai_error e;
    struct job *j = calloc(1, sizeof *j);
    if (!j) return MHD_NO;
    if (oai_parse(kind, ctx->body.p ? ctx->body.p : "", ctx->body.len, &j->req, &e) < 0) {
        free(j);
        return send_error(g, conn, &e, NULL);
    }
    pthread_mutex_init(&j->mu, NULL);
    pthread_cond_init(&j->cv, NULL);
    j->g = g;
    j->refs = 1;
    j->fd = -1;
    const union MHD_ConnectionInfo *ci = MHD_get_connection_info(conn, MHD_CONNECTION_INFO_CONNECTION_FD);
    if (ci) j->fd = ci->connect_fd;
    if (kind == OAI_CHAT && j->req.sp.top_logprobs > 0 && !j->req.sp.logprobs) {
        oai_error_set(&e, 400, "invalid_request_error", "top_logprobs", NULL,
                      "top_logprobs = %d needs logprobs: true", (int)j->req.sp.top_logprobs);
        job_release(j);
        return send_error(g, conn, &e, NULL);
    }
    /* The configured name, "" and "default" (the name a response reports
     * when neither request nor configuration gave one) mean the cluster's
     * default model. */
    const char *m = j->req.model;
    bool is_default = !m[0] || strcmp(m, "default") == 0 || (g->model_name && strcmp(m, g->model_name) == 0);
    snprintf(j->router_model, sizeof j->router_model, "%s", is_default ? "" : m);
    snprintf(j->model, sizeof j->model, "%s", m[0] ? m : g->model_name ? g->model_name : "default");
    char hex[33];
    random_hex(hex, 32);
    snprintf(j->id, sizeof j->id, "%s-%s", kind == OAI_CHAT ? "chatcmpl" : "cmpl", hex);
    j->request_id = strchr(j->id, '-') + 1;
    j->created = (int64_t)time(NULL);
    j->t0_ms = now_ms();
    if (kind == OAI_CHAT) {
        if (!g->tok) {
            oai_error_set(&e, 400, "invalid_request_error", "messages", "chat_template_not_found",
                          "chat completions need the model's tokenizer and chat template: start llm-gateway with "
                          "--model PATH (the model file the cluster serves)%s",
                          g->family != CHAT_FAMILY_NONE ? "" : " and, if its template is not recognised, --chat-template NAME");
            job_release(j);
            return send_error(g, conn, &e, NULL);
        }
        if (chat_prompt(g, j, &e) < 0) {
            job_release(j);
            return send_error(g, conn, &e, NULL);
        }
    }
    LOG(LL_DEBUG, "gateway: request %s: %s, stream %d, max_tokens %u%s%s", j->request_id,
        kind == OAI_CHAT ? "chat" : "completion", j->req.stream, j->req.max_tokens, j->req.user ? ", user " : "",
        j->req.user ? j->req.user : "");

    j->refs = 2; /* this connection and the job thread */
    pthread_t th;
    pthread_attr_t attr;
    pthread_attr_init(&attr);
    pthread_attr_setdetachstate(&attr, PTHREAD_CREATE_DETACHED);
    pthread_mutex_lock(&g->jobs_mu);
    g->jobs++;
    pthread_mutex_unlock(&g->jobs_mu);
    if (pthread_create(&th, &attr, job_thread, j) != 0) {
        pthread_mutex_lock(&g->jobs_mu);
        g->jobs--;
        pthread_mutex_unlock(&g->jobs_mu);
        pthread_attr_destroy(&attr);
        j->refs = 1;
        job_release(j);
        oai_error_set(&e, 503, "server_error", NULL, NULL, "the gateway cannot start a thread for this request");
        return send_error(g, conn, &e, NULL);
    }
    pthread_attr_destroy(&attr);
    ctx->job = j;
    j->refs++; /* ctx's, dropped by the request-completed callback */

    pthread_mutex_lock(&j->mu);
    if (!job_wait(j, j->req.stream ? cond_started : cond_done)) {
        job_release(j);
        return MHD_NO;
    }
    /* Refused before any token: an error response with its status. */
    if (!j->started && (j->rc < 0 || j->res.finish_reason == LLM__GENERATE_DONE__FINISH_REASON__ERROR)) {
        error_from_router(&e, j->rc < 0 ? j->code : j->res.error_code, j->rc < 0 ? j->errstr : j->res.error_message,
                          j->rc < 0 ? j->retry_after_ms : 0);
        pthread_mutex_unlock(&j->mu);
        job_release(j);
        return send_error(g, conn, &e, NULL);
    }
    if (!j->req.stream) {
        if (j->rc < 0 || j->res.finish_reason == LLM__GENERATE_DONE__FINISH_REASON__ERROR) {
            error_from_router(&e, j->rc < 0 ? j->code : j->res.error_code, j->rc < 0 ? j->errstr : j->res.error_message,
                          j->rc < 0 ? j->retry_after_ms : 0);
            pthread_mutex_unlock(&j->mu);
            job_release(j);
            return send_error(g, conn, &e, NULL);
        }
        cJSON *o = job_object(j, false);
        cJSON *cs = cJSON_AddArrayToObject(o, "choices");
        cJSON *c = cJSON_CreateObject();
        cJSON_AddNumberToObject(c, "index", 0);
        if (kind == OAI_CHAT) {
            cJSON *msg = cJSON_AddObjectToObject(c, "message");
            cJSON_AddStringToObject(msg, "role", "assistant");
            cJSON_AddStringToObject(msg, "content", j->text.p ? j->text.p : "");
        } else {
            cJSON_AddStringToObject(c, "text", j->text.p ? j->text.p : "");
        }
        if (j->req.sp.logprobs) {
            cJSON_AddItemToObject(c, "logprobs", j->lp ? j->lp : lp_object(j));
            j->lp = NULL;
        } else {
            cJSON_AddNullToObject(c, "logprobs");
        }
        cJSON_AddStringToObject(c, "finish_reason", finish_name(j->res.finish_reason));
        cJSON_AddItemToArray(cs, c);
        cJSON_AddItemToObject(o, "usage", usage_json(&j->res));
        pthread_mutex_unlock(&j->mu);
        job_release(j);
        return send_json(g, conn, 200, o);
    }
    /* A stream that has begun: when the job was already done, its end is
     * written now (the job thread only writes it once tokens went out). */
    if (j->done && !j->started) sse_finish(j);
    j->started = true;
    pthread_mutex_unlock(&j->mu);
    struct MHD_Response *r = MHD_create_response_from_callback(MHD_SIZE_UNKNOWN, 16384, sse_reader, j, sse_free);
    if (!r) {
        job_cancel(j);
        job_release(j);
        return MHD_NO;
    }
    MHD_add_response_header(r, "Content-Type", "text/event-stream");
    MHD_add_response_header(r, "Cache-Control", "no-cache");
    MHD_add_response_header(r, "X-Accel-Buffering", "no");
    enum MHD_Result ok = MHD_queue_response(conn, 200, r);
    MHD_destroy_response(r);
    if (ok == MHD_YES) count_response(g, conn, 200);
    return ok;
}

static enum MHD_Result handle_models(gateway *g, struct MHD_Connection *conn) {
    char err[512];
    struct oai_error e;
    llm_client *c = pool_get(g, err, sizeof err);
    Llm__ClientEnvelope *rep = NULL;
    int rc = c ? llm_client_models(c, &rep) : STATUS_UNAVAILABLE;
    if (rc < 0) {
        Llm__Error__Code code = c ? llm_client_error_code(c) : LLM__ERROR__CODE__OK;
        error_from_router(&e, code, c ? llm_client_errstr(c) : err, c ? llm_client_retry_after_ms(c) : 0);
        pool_put(g, c, c && code != LLM__ERROR__CODE__OK);
        return send_error(g, conn, &e, NULL);
    }
    pool_put(g, c, true);
    cJSON *root = cJSON_CreateObject();
    cJSON_AddStringToObject(root, "object", "list");
    cJSON *data = cJSON_AddArrayToObject(root, "data");
    const Llm__ModelsReply *mr = rep->models_reply;
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
    return send_json(g, conn, 200, root);
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
        *con_cls = ctx;
        const char *allow;
        enum route rt = route_of(url, &allow);
        if (rt == R_NONE) {
            oai_error_set(&e, 404, "invalid_request_error", NULL, "unknown_url", "Unknown request URL: %s %.200s",
                          method, url);
            return send_error(g, conn, &e, NULL);
        }
        if (strcmp(method, allow) != 0) {
            oai_error_set(&e, 405, "invalid_request_error", NULL, "method_not_allowed",
                          "%s %.200s is not allowed: use %s", method, url, allow);
            return send_error(g, conn, &e, allow);
        }
        if (!authorized(g, conn)) {
            oai_error_set(&e, 401, "invalid_request_error", NULL, "invalid_api_key",
                          "a valid API key is needed: send it as \"Authorization: Bearer KEY\"");
            return send_error(g, conn, &e, NULL);
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
                return send_error(g, conn, &e, NULL);
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
        if (!ctx->too_big && buf_add(&ctx->body, upload_data, *upload_data_size) < 0) return MHD_NO;
        *upload_data_size = 0;
        if (ctx->too_big && (int64_t)ctx->received > 8 * g->cfg.max_body) {
            LOG(LL_INFO, "gateway: a chunked body past %lld bytes: closing the connection",
                (long long)(8 * g->cfg.max_body));
            return MHD_NO;
        }
        return MHD_YES;
    }
    if (ctx->too_big) {
        oai_error_set(&e, 413, "invalid_request_error", NULL, "request_too_large",
                      "the request body is larger than this gateway's limit of %lld bytes (--max-body)",
                      (long long)g->cfg.max_body);
        return send_error(g, conn, &e, NULL);
    }
    const char *allow;
    switch (route_of(url, &allow)) {
    case R_COMPLETIONS: return handle_generate(g, conn, ctx, OAI_COMPLETIONS);
    case R_CHAT: return handle_generate(g, conn, ctx, OAI_CHAT);
    case R_MODELS: return handle_models(g, conn);
    default: return MHD_NO;
    }
}

/* MHD's request-completed callback: a request that ends any other way than
 * a full response (the client hung up, a write failed) cancels its job. */
static void on_completed(void *cls, struct MHD_Connection *conn, void **con_cls,
                         enum MHD_RequestTerminationCode toe) {
    struct req_ctx *ctx = *con_cls;
    if (!ctx) return;
    if (ctx->job) {
        if (toe != MHD_REQUEST_TERMINATED_COMPLETED_OK) job_cancel(ctx->job);
        job_release(ctx->job);
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
    LOG(LL_WARN, "gateway: libmicrohttpd: %s", msg);
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
        snprintf(g->chat_problem, sizeof g->chat_problem,
                 "model %s %s: chat completions are refused rather than sent a guessed prompt; start llm-gateway "
                 "with --chat-template NAME (one of %s) to choose one, or use /v1/completions",
                 g->model_name ? g->model_name : g->model_path,
                 tmpl ? "has a chat template this gateway does not recognise" : "has no chat template",
                 chat_family_names());
        LOG(LL_WARN, "gateway: %s", g->chat_problem);
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
    int64_t now = now_ms();
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
    };
    metrics_family *f[6];
    for (int i = 0; i < 6; i++) {
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
    struct httpd_config hc = {.listen = g->cfg.metrics_listen, .registry = g->reg, .ready = gateway_ready,
                              .ready_ud = g};
    int rc = httpd_start(&g->http, &hc, err, errlen);
    if (rc == STATUS_IO && g->cfg.metrics_optional) {
        LOG(LL_WARN, "gateway: no metrics port: %s (give --metrics-listen another port)", err);
        return 0;
    }
    if (rc < 0) return rc;
    LOG(LL_INFO, "gateway: metrics on http://%s (port %d): /metrics, /health, /ready", g->cfg.metrics_listen,
        httpd_port(g->http));
    return 0;
}

int gateway_metrics_port(const gateway *g) { return g->http ? httpd_port(g->http) : 0; }

int gateway_start(gateway **out, const struct gateway_config *cfg, char *err, size_t errlen) {
    *out = NULL;
    gateway *g = calloc(1, sizeof *g);
    if (!g) {
        snprintf(err, errlen, "out of memory");
        return STATUS_NO_MEMORY;
    }
    pthread_mutex_init(&g->pool_mu, NULL);
    pthread_mutex_init(&g->probe_mu, NULL);
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
    unsigned flags = MHD_USE_THREAD_PER_CONNECTION | MHD_USE_INTERNAL_POLLING_THREAD | MHD_USE_ERROR_LOG;
    if (ss.ss_family == AF_INET6) flags |= MHD_USE_IPv6;
    g->mhd = MHD_start_daemon(flags, 0, NULL, NULL, on_request, g, MHD_OPTION_EXTERNAL_LOGGER, mhd_log, g,
                              MHD_OPTION_SOCK_ADDR, (struct sockaddr *)&ss, MHD_OPTION_NOTIFY_COMPLETED, on_completed,
                              g, MHD_OPTION_CONNECTION_LIMIT, (unsigned)cfg->max_connections,
                              MHD_OPTION_CONNECTION_TIMEOUT, (unsigned)60, MHD_OPTION_END);
    if (!g->mhd) {
        snprintf(err, errlen, "--listen %s: cannot listen there (in use, or not an address of this host)",
                 cfg->listen);
        rc = STATUS_IO;
        goto fail;
    }
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
    pthread_mutex_lock(&g->jobs_mu);
    while (g->jobs > 0) pthread_cond_wait(&g->jobs_cv, &g->jobs_mu);
    pthread_mutex_unlock(&g->jobs_mu);
    httpd_stop(g->http);
    llm_client_close(g->probe);
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
    pthread_cond_destroy(&g->jobs_cv);
    free(g);
}
