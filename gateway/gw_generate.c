/* llm-gateway's HTTP side.  libmicrohttpd runs one thread per connection,
 * so a handler may block; each generation (a "job") runs llm_client_generate
 * on another thread, a runner, that writes the OpenAI chunks into a buffer,
 * and the connection's thread turns that buffer into the HTTP response
 * while it watches its socket: a peer that hangs up cancels the request at
 * once instead of when the next token would fail to send.  Runners outlive
 * their jobs and wait for the next one, so that a request is handed to a
 * thread that already exists: creating one, and the scheduler placing a new
 * thread behind the busy ones, costs from a fraction of a millisecond to
 * several on a loaded host, all of it time to the first token. */
#include "gateway/gateway-impl.h"

#include <errno.h>
#include <poll.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/random.h>
#include <time.h>

#include "common/log.h"
#include "common/status.h"

/* ---- generations ---------------------------------------------------------- */

void gw_job_release(struct job *j) {
    pthread_mutex_lock(&j->mu);
    int left = --j->refs;
    pthread_mutex_unlock(&j->mu);
    if (left > 0) return;
    oai_request_free(&j->req);
    free(j->prompt_ids);
    free(j->out.p);
    for (int i = 0; i < OAI_N_MAX; i++) free(j->text[i].p);
    llm_generate_result_free(&j->res);
    for (int i = 0; i < OAI_N_MAX; i++) cJSON_Delete(j->lp[i]);
    pthread_cond_destroy(&j->cv);
    pthread_mutex_destroy(&j->mu);
    free(j);
}

/* Appends "data: JSON\n\n" (o is consumed).  Called with mu held. */
static void sse_event(struct job *j, cJSON *o) {
    char *s = cJSON_PrintUnformatted(o);
    cJSON_Delete(o);
    if (!s) return;
    gw_buf_add(&j->out, "data: ", 6);
    gw_buf_add(&j->out, s, strlen(s));
    gw_buf_add(&j->out, "\n\n", 2);
    free(s);
}

/* One chunk with this choice (consumed).  Called with mu held. */
static void sse_choice(struct job *j, cJSON *choice) {
    cJSON *o = gw_job_object(j, true);
    cJSON *cs = cJSON_AddArrayToObject(o, "choices");
    cJSON_AddItemToArray(cs, choice);
    if (j->req.include_usage) cJSON_AddNullToObject(o, "usage");
    sse_event(j, o);
}

/* lp (consumed; NULL: none) is the chunk's logprobs object.  A chat stream
 * opens, as OpenAI's does, with a chunk that carries the role alone
 * (content ""); text follows in chunks of its own. */
static void sse_chunk(struct job *j, uint32_t ci, const char *text, size_t len, const char *finish, cJSON *lp) {
    if (j->req.kind == OAI_CHAT && !j->role_sent[ci]) {
        j->role_sent[ci] = true;
        sse_choice(j, gw_stream_choice(j, ci, NULL, 0, NULL, true, NULL));
        if (len == 0 && !lp && !finish) return;
    }
    j->role_sent[ci] = true;
    sse_choice(j, gw_stream_choice(j, ci, len > 0 ? text : NULL, len, finish, false, lp));
}

static int job_on_chunk(void *ud, const struct llm_chunk *ch) {
    struct job *j = ud;
    pthread_mutex_lock(&j->mu);
    if (j->cancel) {
        pthread_mutex_unlock(&j->mu);
        return 1;
    }
    uint32_t ci = ch->choice < OAI_N_MAX ? ch->choice : 0; /* the client checks it against n */
    if (j->req.stream) {
        cJSON *lp = NULL;
        if (ch->n_logprobs > 0) {
            lp = gw_lp_object(j);
            gw_lp_append(j, lp, ch, &j->lp_chars[ci]);
        }
        if (ch->text_len > 0 || !j->role_sent[ci] || lp) sse_chunk(j, ci, ch->text, ch->text_len, NULL, lp);
    } else {
        gw_buf_add(&j->text[ci], ch->text, ch->text_len);
        if (ch->n_logprobs > 0) {
            if (!j->lp[ci]) j->lp[ci] = gw_lp_object(j);
            gw_lp_append(j, j->lp[ci], ch, &j->lp_chars[ci]);
        }
    }
    if (!j->started) j->t_tok_us = gw_now_us();
    if (!j->started && j->g->ttft) metrics_histogram_observe(j->g->ttft, (double)(gw_now_ms() - j->t0_ms) / 1000.0);
    j->started = true;
    pthread_cond_broadcast(&j->cv);
    pthread_mutex_unlock(&j->mu);
    return 0;
}

/* Whether the request failed: the call (rc < 0), or a choice that ended
 * in ERROR (the first such); *e is then the error to answer. */
static bool job_failed(const struct job *j, struct oai_error *e) {
    if (j->rc < 0) {
        gw_error_from_router(e, j->req.kind, j->code, j->reason, j->errstr, j->retry_after_ms);
        return true;
    }
    for (uint32_t i = 0; i < j->res.n_choices || (i == 0 && !j->res.choices); i++) {
        bool err = j->res.choices ? j->res.choices[i].finish_reason == LLM__GENERATE_DONE__FINISH_REASON__ERROR
                                  : j->res.finish_reason == LLM__GENERATE_DONE__FINISH_REASON__ERROR;
        if (!err) continue;
        gw_error_from_router(e, j->req.kind, j->res.choices ? j->res.choices[i].error_code : j->res.error_code, NULL,
                             j->res.choices ? j->res.choices[i].error_message : j->res.error_message, 0);
        return true;
    }
    return false;
}

/* A choice's finish_reason as OpenAI names it. */
static const char *job_finish_name(const struct job *j, uint32_t i) {
    return gw_finish_name(j->res.choices && i < j->res.n_choices ? j->res.choices[i].finish_reason
                                                                : j->res.finish_reason);
}

/* The end of a stream that has begun: each choice's finishing chunk, usage
 * and [DONE], or an error event.  Called with mu held. */
static void sse_finish(struct job *j) {
    struct oai_error e;
    if (job_failed(j, &e)) {
        char *s = oai_error_json(&e);
        if (s) {
            gw_buf_add(&j->out, "data: ", 6);
            gw_buf_add(&j->out, s, strlen(s));
            gw_buf_add(&j->out, "\n\n", 2);
            free(s);
        }
    } else {
        for (uint32_t i = 0; i < j->req.n; i++) sse_chunk(j, i, NULL, 0, job_finish_name(j, i), NULL);
        if (j->req.include_usage) {
            cJSON *o = gw_job_object(j, true);
            cJSON_AddArrayToObject(o, "choices");
            cJSON_AddItemToObject(o, "usage", gw_usage_json(&j->res, j->req.prediction != NULL));
            sse_event(j, o);
        }
    }
    gw_buf_add(&j->out, "data: [DONE]\n\n", 14);
}

static void job_run(struct job *j) {
    gateway *g = j->g;
    char err[512] = "";
    if (g->running) metrics_gauge_add(g->running, 1);
    llm_client *c = gw_pool_get(g, err, sizeof err);
    int rc;
    Llm__Error__Code code = LLM__ERROR__CODE__OK;
    uint32_t retry_after_ms = 0;
    struct llm_generate_result res;
    memset(&res, 0, sizeof res);
    if (!c) {
        rc = STATUS_UNAVAILABLE;
    } else {
        if (!j->model[0]) {
            /* The request named the default model: the response names it
             * as /v1/models does (asked of the router once a minute). */
            char name[sizeof j->model];
            gw_model_info(g, name, sizeof name, NULL);
            pthread_mutex_lock(&j->mu);
            snprintf(j->model, sizeof j->model, "%s", name);
            pthread_mutex_unlock(&j->mu);
        }
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
        p.json_schema = j->req.json_schema;
        p.json_object = j->req.json_object;
        p.spec = j->req.spec;
        p.spec_tokens = j->req.spec_tokens;
        p.prediction = j->req.prediction;
        p.n = j->req.n;
        /* Always streamed from the router: tokens arriving are what lets a
         * non-streaming request notice a client that went away. */
        p.stream = true;
        j->t_call_us = gw_now_us();
        rc = llm_client_generate(c, &p, job_on_chunk, j, &res);
        if (rc < 0) {
            code = llm_client_error_code(c);
            retry_after_ms = llm_client_retry_after_ms(c);
            snprintf(err, sizeof err, "%s", llm_client_errstr(c));
            snprintf(j->reason, sizeof j->reason, "%s", llm_client_error_reason(c));
        }
        gw_pool_put(g, c, rc >= 0 || code != LLM__ERROR__CODE__OK);
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
        metrics_histogram_observe(g->e2e, (double)(gw_now_ms() - j->t0_ms) / 1000.0);
        if (rc >= 0) {
            metrics_counter_add(g->prompt_tokens, res.prompt_tokens);
            double gen = res.completion_tokens;
            for (uint32_t i = 1; res.choices && i < res.n_choices; i++) gen += res.choices[i].completion_tokens;
            metrics_counter_add(g->gen_tokens, gen);
        }
    }
    gw_job_release(j);
}

/* ---- runners ---------------------------------------------------------------
 * An idle runner waits this long for a job before it exits: long enough to
 * carry a steady load from one request to the next, short enough that the
 * threads of a burst do not stay. */
#define GW_RUNNER_IDLE_MS 30000

static void *runner_main(void *arg) {
    struct gw_runner *w = arg;
    gateway *g = w->g;
    pthread_mutex_lock(&g->jobs_mu);
    for (;;) {
        struct job *j = w->job;
        pthread_mutex_unlock(&g->jobs_mu);
        job_run(j);
        pthread_mutex_lock(&g->jobs_mu);
        w->job = NULL;
        if (--g->jobs == 0) pthread_cond_broadcast(&g->jobs_cv);
        if (g->stopping) break;
        w->next = g->idle;
        g->idle = w;
        struct timespec ts;
        clock_gettime(CLOCK_MONOTONIC, &ts);
        ts.tv_sec += GW_RUNNER_IDLE_MS / 1000;
        while (!w->job && !g->stopping) {
            if (pthread_cond_timedwait(&w->cv, &g->jobs_mu, &ts) == ETIMEDOUT && !w->job) break;
        }
        if (w->job) continue; /* job_start took it off the idle list */
        for (struct gw_runner **p = &g->idle; *p; p = &(*p)->next) {
            if (*p == w) {
                *p = w->next;
                break;
            }
        }
        break;
    }
    g->runners--;
    pthread_cond_broadcast(&g->jobs_cv);
    pthread_mutex_unlock(&g->jobs_mu);
    pthread_cond_destroy(&w->cv);
    free(w);
    return NULL;
}

/* Hands j (holding the runner's reference) to the runner that went idle
 * last, or to a new one.  < 0 when no thread can be started: j is then not
 * run and its reference is the caller's. */
static int job_start(gateway *g, struct job *j) {
    pthread_mutex_lock(&g->jobs_mu);
    g->jobs++;
    struct gw_runner *w = g->idle;
    if (w) {
        g->idle = w->next;
        w->job = j;
        pthread_cond_signal(&w->cv);
        pthread_mutex_unlock(&g->jobs_mu);
        return 0;
    }
    g->runners++;
    pthread_mutex_unlock(&g->jobs_mu);
    int rc = STATUS_NO_MEMORY;
    w = calloc(1, sizeof *w);
    if (w) {
        w->g = g;
        w->job = j;
        pthread_condattr_t ca;
        pthread_condattr_init(&ca);
        pthread_condattr_setclock(&ca, CLOCK_MONOTONIC);
        pthread_cond_init(&w->cv, &ca);
        pthread_condattr_destroy(&ca);
        pthread_t th;
        pthread_attr_t attr;
        pthread_attr_init(&attr);
        pthread_attr_setdetachstate(&attr, PTHREAD_CREATE_DETACHED);
        rc = pthread_create(&th, &attr, runner_main, w) == 0 ? 0 : STATUS_INTERNAL;
        pthread_attr_destroy(&attr);
        if (rc < 0) {
            pthread_cond_destroy(&w->cv);
            free(w);
        }
    }
    if (rc < 0) {
        pthread_mutex_lock(&g->jobs_mu);
        g->jobs--;
        g->runners--;
        pthread_cond_broadcast(&g->jobs_cv);
        pthread_mutex_unlock(&g->jobs_mu);
    }
    return rc;
}

void gw_runners_stop(gateway *g) {
    pthread_mutex_lock(&g->jobs_mu);
    while (g->jobs > 0) pthread_cond_wait(&g->jobs_cv, &g->jobs_mu);
    g->stopping = true;
    for (struct gw_runner *w = g->idle; w; w = w->next) pthread_cond_signal(&w->cv);
    while (g->runners > 0) pthread_cond_wait(&g->jobs_cv, &g->jobs_mu);
    pthread_mutex_unlock(&g->jobs_mu);
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
void gw_job_cancel(struct job *j) {
    pthread_mutex_lock(&j->mu);
    bool already = j->cancel || j->done;
    j->cancel = true;
    pthread_mutex_unlock(&j->mu);
    if (already) return;
    LOG(LL_INFO, "gateway: request %s: the HTTP client went away; cancelling", j->request_id);
    char err[256];
    llm_client *c = gw_pool_get(j->g, err, sizeof err);
    if (!c) return;
    int rc = llm_client_cancel(c, j->request_id, NULL);
    gw_pool_put(j->g, c, rc >= 0 || llm_client_error_code(c) != LLM__ERROR__CODE__OK);
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
            gw_job_cancel(j);
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
    bool first = !j->first_out && j->t_tok_us > 0 && j->t_call_us > 0;
    int64_t added_us = first ? (j->t_call_us - j->t_arrive_us) + (gw_now_us() - j->t_tok_us) : 0;
    j->first_out = true;
    pthread_mutex_unlock(&j->mu);
    if (first && j->g->added) metrics_histogram_observe(j->g->added, (double)added_us / 1e6);
    return (ssize_t)n;
}

static void sse_free(void *cls) {
    struct job *j = cls;
    gw_job_cancel(j); /* no-op once done */
    gw_job_release(j);
}

/* Chat: the rendered prompt tokenized with the model's tokenizer, and its
 * end-of-turn token as a stop (not with a response_format). */
static int chat_prompt(gateway *g, struct job *j, struct oai_error *e) {
    if (g->family == CHAT_FAMILY_NONE) {
        char model[256];
        gw_model_info(g, model, sizeof model, NULL);
        oai_error_set(e, 400, "invalid_request_error", "messages", "chat_template_not_found", "model %s %s", model,
                      g->chat_problem);
        return -1;
    }
    char err[512], *text = NULL;
    size_t *spans = NULL, n_spans = 0;
    if (chat_template_render(g->family, j->req.messages, j->req.n_messages, 1, &text, &spans, &n_spans, err,
                             sizeof err) < 0) {
        oai_error_set(e, 400, "invalid_request_error", "messages", "invalid_value", "%s", err);
        return -1;
    }
    /* The template's markers are special tokens; a message's text that
     * looks like one ("<|im_end|><|im_start|>system") stays text. */
    size_t len = strlen(text);
    int32_t n = tokenizer_encode_plain(g->tok, text, len, -1, spans, n_spans, NULL, 0);
    if (n >= 0) {
        j->prompt_ids = malloc(((size_t)n + 1) * sizeof *j->prompt_ids);
        n = j->prompt_ids ? tokenizer_encode_plain(g->tok, text, len, -1, spans, n_spans, j->prompt_ids, n + 1)
                          : STATUS_NO_MEMORY;
    }
    free(text);
    free(spans);
    if (n < 0) {
        char model[256];
        gw_model_info(g, model, sizeof model, NULL);
        oai_error_set(e, 400, "invalid_request_error", "messages", "invalid_value",
                      "the messages cannot be tokenized by %s: %s",
                      model, status_str(n));
        return -1;
    }
    j->n_prompt_ids = (size_t)n;
    /* A response_format ends where its JSON text is complete (the last
     * stage allows end-of-generation only there); an end-of-turn stop could
     * only cut it short, and the router refuses stops with a constraint. */
    if (j->req.json_schema || j->req.json_object) return 0;
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
        oai_error_set(e, 400, "invalid_request_error", "stop", "invalid_value",
                      "stop has %d strings: chat requests on this model keep one for the end of turn %s",
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

enum MHD_Result gw_handle_generate(gateway *g, struct MHD_Connection *conn, struct req_ctx *ctx,
                                   enum oai_kind kind) {
    struct oai_error e;
    struct job *j = calloc(1, sizeof *j);
    if (!j) return MHD_NO;
    if (oai_parse(kind, ctx->body.p ? ctx->body.p : "", ctx->body.len, &j->req, &e) < 0) {
        free(j);
        return gw_send_error(g, conn, &e, NULL);
    }
    pthread_mutex_init(&j->mu, NULL);
    pthread_cond_init(&j->cv, NULL);
    j->g = g;
    j->refs = 1;
    j->fd = -1;
    const union MHD_ConnectionInfo *ci = MHD_get_connection_info(conn, MHD_CONNECTION_INFO_CONNECTION_FD);
    if (ci) j->fd = ci->connect_fd;
    if (kind == OAI_CHAT && j->req.sp.top_logprobs > 0 && !j->req.sp.logprobs) {
        oai_error_set(&e, 400, "invalid_request_error", "top_logprobs", "invalid_value",
                      "top_logprobs = %d needs logprobs: true", (int)j->req.sp.top_logprobs);
        gw_job_release(j);
        return gw_send_error(g, conn, &e, NULL);
    }
    /* The configured name, "" and "default" (the name a response reports
     * when neither request nor configuration gave one) mean the cluster's
     * default model. */
    const char *m = j->req.model;
    bool is_default = !m[0] || strcmp(m, "default") == 0 || (g->model_name && strcmp(m, g->model_name) == 0);
    snprintf(j->router_model, sizeof j->router_model, "%s", is_default ? "" : m);
    /* The default model is reported by the name /v1/models gives it, set
     * by the runner (gw_model_info); another name as the request gave it. */
    if (!is_default) snprintf(j->model, sizeof j->model, "%s", m);
    char hex[33];
    random_hex(hex, 32);
    snprintf(j->id, sizeof j->id, "%s-%s", kind == OAI_CHAT ? "chatcmpl" : "cmpl", hex);
    j->request_id = strchr(j->id, '-') + 1;
    j->created = (int64_t)time(NULL);
    j->t0_ms = gw_now_ms();
    j->t_arrive_us = ctx->t_arrive_us;
    if (kind == OAI_CHAT) {
        if (!g->tok) {
            oai_error_set(&e, 400, "invalid_request_error", "messages", "chat_template_not_found",
                          "chat completions need the model's tokenizer and chat template: start llm-gateway with "
                          "--model PATH (the model file the cluster serves)%s",
                          g->family != CHAT_FAMILY_NONE ? "" : " and, if its template is not recognised, --chat-template NAME");
            gw_job_release(j);
            return gw_send_error(g, conn, &e, NULL);
        }
        if (chat_prompt(g, j, &e) < 0) {
            gw_job_release(j);
            return gw_send_error(g, conn, &e, NULL);
        }
    }
    /* A prompt of known length that leaves no room for one token is refused
     * here, by the model's context (the router's refusal of a text prompt
     * gets the same code through gw_error_from_router). */
    size_t n_prompt = j->prompt_ids ? j->n_prompt_ids : j->req.prompt_tokens ? j->req.n_prompt_tokens : 0;
    if (n_prompt > 0 && is_default) {
        char name[256];
        uint32_t n_ctx = 0;
        gw_model_info(g, name, sizeof name, &n_ctx);
        if (n_ctx > 0 && n_prompt >= n_ctx) {
            oai_error_set(&e, 400, "invalid_request_error", kind == OAI_CHAT ? "messages" : "prompt",
                          "context_length_exceeded",
                          "This model's maximum context length is %u tokens. However, your %s %zu tokens, which "
                          "leaves no room for the completion. Please reduce the length of the %s.", n_ctx,
                          kind == OAI_CHAT ? "messages resulted in" : "prompt has", n_prompt,
                          kind == OAI_CHAT ? "messages" : "prompt");
            gw_job_release(j);
            return gw_send_error(g, conn, &e, NULL);
        }
    }
    LOG(LL_DEBUG, "gateway: request %s: %s, stream %d, max_tokens %u%s%s", j->request_id,
        kind == OAI_CHAT ? "chat" : "completion", j->req.stream, j->req.max_tokens, j->req.user ? ", user " : "",
        j->req.user ? j->req.user : "");

    /* This connection's, the runner's and ctx's (dropped by the
     * request-completed callback), all taken before the runner may drop its
     * own. */
    j->refs = 3;
    if (job_start(g, j) < 0) {
        j->refs = 1;
        gw_job_release(j);
        oai_error_set(&e, 503, "server_error", NULL, NULL, "the gateway cannot start a thread for this request");
        return gw_send_error(g, conn, &e, NULL);
    }
    ctx->job = j;

    pthread_mutex_lock(&j->mu);
    if (!job_wait(j, j->req.stream ? cond_started : cond_done)) {
        gw_job_release(j);
        return MHD_NO;
    }
    /* Refused before any token: an error response with its status. */
    if (!j->started && job_failed(j, &e)) {
        pthread_mutex_unlock(&j->mu);
        gw_job_release(j);
        return gw_send_error(g, conn, &e, NULL);
    }
    if (!j->req.stream) {
        if (job_failed(j, &e)) {
            pthread_mutex_unlock(&j->mu);
            gw_job_release(j);
            return gw_send_error(g, conn, &e, NULL);
        }
        cJSON *o = gw_job_object(j, false);
        cJSON *cs = cJSON_AddArrayToObject(o, "choices");
        for (uint32_t i = 0; i < j->req.n; i++) {
            cJSON *c = cJSON_CreateObject();
            cJSON_AddNumberToObject(c, "index", i);
            if (kind == OAI_CHAT) {
                cJSON *msg = cJSON_AddObjectToObject(c, "message");
                cJSON_AddStringToObject(msg, "role", "assistant");
                cJSON_AddStringToObject(msg, "content", j->text[i].p ? j->text[i].p : "");
            } else {
                cJSON_AddStringToObject(c, "text", j->text[i].p ? j->text[i].p : "");
            }
            if (j->req.sp.logprobs) {
                cJSON_AddItemToObject(c, "logprobs", j->lp[i] ? j->lp[i] : gw_lp_object(j));
                j->lp[i] = NULL;
            } else {
                cJSON_AddNullToObject(c, "logprobs");
            }
            cJSON_AddStringToObject(c, "finish_reason", job_finish_name(j, i));
            cJSON_AddItemToArray(cs, c);
        }
        cJSON_AddItemToObject(o, "usage", gw_usage_json(&j->res, j->req.prediction != NULL));
        pthread_mutex_unlock(&j->mu);
        gw_job_release(j);
        return gw_send_json(g, conn, 200, o);
    }
    /* A stream that has begun: when the job was already done, its end is
     * written now (the runner only writes it once tokens went out). */
    if (j->done && !j->started) sse_finish(j);
    j->started = true;
    pthread_mutex_unlock(&j->mu);
    struct MHD_Response *r = MHD_create_response_from_callback(MHD_SIZE_UNKNOWN, 16384, sse_reader, j, sse_free);
    if (!r) {
        gw_job_cancel(j);
        gw_job_release(j);
        return MHD_NO;
    }
    MHD_add_response_header(r, "Content-Type", "text/event-stream");
    MHD_add_response_header(r, "Cache-Control", "no-cache");
    MHD_add_response_header(r, "X-Accel-Buffering", "no");
    enum MHD_Result ok = MHD_queue_response(conn, 200, r);
    MHD_destroy_response(r);
    if (ok == MHD_YES) gw_count_response(g, conn, 200);
    return ok;
}
