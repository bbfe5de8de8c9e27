/* llm-gateway's private state, shared by its files: the server, its routes
 * and the router client pool (gateway.c), the generation jobs and their
 * Server-Sent Events (gw_generate.c) and the OpenAI response objects
 * (gw_json.c).  Only gateway/gateway.c and gateway/gw_*.c include this. */
#ifndef GATEWAY_GATEWAY_IMPL_H
#define GATEWAY_GATEWAY_IMPL_H

#include "gateway/gateway.h"

#include <cjson/cJSON.h>
#include <microhttpd.h>
#include <pthread.h>
#include <stdatomic.h>
#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>

#include "clients/c/client.h"
#include "common/chat_template.h"
#include "common/httpd.h"
#include "common/httpd_guard.h"
#include "common/metrics.h"
#include "common/tokenizer.h"
#include "common/watchdog.h"
#include "gateway/oai.h"

#define GW_ENDPOINTS_MAX 16
#define GW_POOL_MAX 64
#define GW_STATUS_SLOTS 600
#define GW_ROUTES 4 /* enum route */

enum route { R_NONE, R_COMPLETIONS, R_CHAT, R_MODELS };

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
    httpd_guard *guard;             /* slow and idle clients (common/httpd_guard.h) */
    uint16_t port;
    /* The router's default model, asked with Models and kept for a minute
     * (gw_model_info): the name responses report and its context.  One
     * thread asks at a time, on info_client (short timeouts, so that a
     * router that is down costs a request little more than its own 503). */
    pthread_mutex_t info_mu;
    pthread_cond_t info_cv;         /* under info_mu: info_busy went false */
    llm_client *info_client;        /* used by the thread that set info_busy */
    bool info_busy;
    int64_t info_at_ms;             /* 0: never learnt */
    int64_t info_try_ms;            /* the last time it was asked */
    char info_id[256];
    uint32_t info_n_ctx;
    _Atomic uint64_t responses[GW_STATUS_SLOTS];
    /* The metrics port (NULL when off) and what it shows. */
    metrics *reg;
    httpd *http;
    metrics_family *f_requests;
    metrics_series *_Atomic by_status[GW_ROUTES][GW_STATUS_SLOTS]; /* looked up once each */
    metrics_series *running, *ttft, *e2e, *prompt_tokens, *gen_tokens, *added;
    llm_client *probe;              /* /ready's own client, used on the metrics thread only */
    pthread_mutex_t probe_mu;
    int64_t probe_at_ms;
    char probe_why[512];
    bool probe_ok;
    /* Generations in flight (jobs) and the detached threads that run them
     * (runners); a runner whose job ended waits on the idle list for the
     * next one.  gateway_stop waits for both to reach 0. */
    pthread_mutex_t jobs_mu;
    pthread_cond_t jobs_cv;
    int jobs;
    int runners;
    struct gw_runner *idle;
    bool stopping;
    watchdog *wd;                   /* /health's (cfg.watchdog_ms), NULL when off */
};

/* A thread that runs generations one after another (gw_generate.c). */
struct gw_runner {
    gateway *g;
    pthread_cond_t cv;              /* under g->jobs_mu: a job was handed over, or the gateway stops */
    struct job *job;
    struct gw_runner *next;         /* on g->idle */
};

struct buf {
    char *p;
    size_t len, cap;
};

struct job {
    gateway *g;
    pthread_mutex_t mu;
    pthread_cond_t cv;
    int refs;                       /* the runner, the connection, the response */
    struct oai_request req;
    int32_t *prompt_ids;            /* chat: the rendered prompt, tokenized here */
    size_t n_prompt_ids;
    char router_model[256];
    char id[64];                    /* "chatcmpl-..." / "cmpl-..."; the part after '-' is the request id */
    const char *request_id;
    char model[256];                /* as the responses name it */
    int64_t created;
    int64_t t0_ms;                  /* monotonic, when the request was read */
    /* The gateway's own share of a streamed request's first token
     * (llm_gateway_added_latency_seconds), monotonic microseconds: the
     * request's first callback, the generate call on the router connection,
     * the first token's arrival (under mu), and whether the first event
     * has gone to the connection (the connection's thread only). */
    int64_t t_arrive_us, t_call_us, t_tok_us;
    bool first_out;
    int fd;                         /* the HTTP connection's socket */
    /* Under mu: */
    struct buf out;                 /* streaming: SSE bytes not yet sent */
    size_t out_off;
    struct buf text[OAI_N_MAX];     /* not streaming: each choice's whole completion */
    bool started, done, cancel;
    bool role_sent[OAI_N_MAX];      /* chat streaming: the choice's opening chunk went out */
    int rc;
    Llm__Error__Code code;
    uint32_t retry_after_ms;        /* of the router's refusal */
    char reason[64];                /* of the router's refusal (Error.reason), or "" */
    char errstr[512];
    struct llm_generate_result res;
    cJSON *lp[OAI_N_MAX];           /* not streaming, logprobs asked: each choice's logprobs so far */
    size_t lp_chars[OAI_N_MAX];     /* characters of the text each choice's tokens make (text_offset) */
};

/* Per HTTP request: the body as it arrives, and the job once there is one. */
struct req_ctx {
    int64_t t_arrive_us; /* monotonic, the request's first callback (headers read) */
    struct buf body;
    size_t received;
    bool too_big;
    struct job *job;
};

/* ---- the server (gateway.c) ------------------------------------------------ */

int64_t gw_now_ms(void);
int64_t gw_now_us(void);
/* Appends n bytes of s and keeps the buffer NUL-terminated; STATUS_NO_MEMORY
 * leaves it as it was. */
int gw_buf_add(struct buf *b, const char *s, size_t n);
/* A router client for this thread (from the pool or new; NULL with err
 * when none can be opened); gw_pool_put gives it back, keep false closing
 * it. */
llm_client *gw_pool_get(gateway *g, char *err, size_t errlen);
void gw_pool_put(gateway *g, llm_client *c, bool keep);
void gw_count_response(gateway *g, struct MHD_Connection *conn, int status);
/* The default model's name as clients see it (--model-name, else the
 * router's id, else the model file's name, else "default") into name, and
 * its context in tokens into *n_ctx (0 when unknown).  Asks the router when
 * its answer is older than a minute (at most every 2 s while it fails);
 * a router that does not answer costs the caller at most about 1 s. */
void gw_model_info(gateway *g, char *name, size_t size, uint32_t *n_ctx);
/* Queue a response on conn; gw_send_json consumes root. */
enum MHD_Result gw_send_json(gateway *g, struct MHD_Connection *conn, int status, cJSON *root);
enum MHD_Result gw_send_error(gateway *g, struct MHD_Connection *conn, const struct oai_error *e, const char *allow);

/* ---- response objects (gw_json.c) ------------------------------------------ */

/* kind names the prompt's field for a prompt that does not fit the context
 * (prompt or messages); reason is the router's Error.reason
 * (llm_client_error_reason; NULL or "": none). */
void gw_error_from_router(struct oai_error *e, enum oai_kind kind, Llm__Error__Code code, const char *reason,
                          const char *msg, uint32_t retry_after_ms);
cJSON *gw_job_object(const struct job *j, bool chunk);
const char *gw_finish_name(Llm__GenerateDone__FinishReason r);
/* OpenAI's usage object of r, every choice summed; predicted (the request
 * had a prediction) adds completion_tokens_details with the prediction's
 * accepted and rejected drafts. */
cJSON *gw_usage_json(const struct llm_generate_result *r, bool predicted);
cJSON *gw_lp_object(const struct job *j);
void gw_lp_append(const struct job *j, cJSON *o, const struct llm_chunk *ch, size_t *chars);
cJSON *gw_stream_choice(const struct job *j, uint32_t index, const char *text, size_t len, const char *finish, bool role,
                        cJSON *lp);

/* ---- generations (gw_generate.c) ------------------------------------------- */

/* Drops one reference; the last frees the job. */
void gw_job_release(struct job *j);
/* Makes idle runners exit and waits until no job and no runner is left
 * (the HTTP server is stopped first, so no job starts meanwhile). */
void gw_runners_stop(gateway *g);
void gw_job_cancel(struct job *j);
/* POST /v1/completions and /v1/chat/completions once ctx holds the body. */
enum MHD_Result gw_handle_generate(gateway *g, struct MHD_Connection *conn, struct req_ctx *ctx, enum oai_kind kind);

#endif
