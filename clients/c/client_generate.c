/* Streamed generation of libllmclient (client.h): a request sent, its
 * chunks passed on as they come, re-attached by id on another endpoint or
 * after a lost connection, cancelled. */
#include "client.h"
#include "client-impl.h"

#include "common/log.h"
#include "common/status.h"

#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/random.h>
#include <unistd.h>

/* ---- generation --------------------------------------------------------- */

static void client_fill_done(struct llm_generate_result *res, const Llm__GenerateDone *d) {
    if (res->choices && d->choice < res->n_choices) {
        struct llm_choice_done *ch = &res->choices[d->choice];
        ch->finish_reason = d->finish_reason;
        ch->completion_tokens = d->usage ? d->usage->completion_tokens : 0;
        ch->accepted_prediction_tokens = d->usage ? d->usage->accepted_prediction_tokens : 0;
        ch->rejected_prediction_tokens = d->usage ? d->usage->rejected_prediction_tokens : 0;
        ch->stop_token = d->stop_token;
        snprintf(ch->stop_string, sizeof ch->stop_string, "%s", d->stop_string ? d->stop_string : "");
        if (d->error) {
            ch->error_code = d->error->code;
            snprintf(ch->error_message, sizeof ch->error_message, "%s", d->error->message);
        }
    }
    if (d->choice != 0) return;
    res->finish_reason = d->finish_reason;
    if (d->usage) {
        res->prompt_tokens = d->usage->prompt_tokens;
        res->completion_tokens = d->usage->completion_tokens;
        res->accepted_prediction_tokens = d->usage->accepted_prediction_tokens;
        res->rejected_prediction_tokens = d->usage->rejected_prediction_tokens;
    }
    res->stop_token = d->stop_token;
    snprintf(res->stop_string, sizeof res->stop_string, "%s", d->stop_string ? d->stop_string : "");
    if (d->error) {
        res->error_code = d->error->code;
        snprintf(res->error_message, sizeof res->error_message, "%s", d->error->message);
    }
}

/* A random UUID (version 4) as the request id. */
static void client_make_id(char *out, size_t size) {
    uint8_t b[16];
    if (getrandom(b, sizeof b, 0) != (ssize_t)sizeof b) {
        uint64_t t = (uint64_t)client_now_ms() ^ ((uint64_t)getpid() << 40);
        for (int i = 0; i < 16; i++) b[i] = (uint8_t)(t >> (8 * (i % 8))) ^ (uint8_t)(i * 37) ^ (uint8_t)rand();
    }
    b[6] = (uint8_t)((b[6] & 0x0f) | 0x40);
    b[8] = (uint8_t)((b[8] & 0x3f) | 0x80);
    snprintf(out, size, "%02x%02x%02x%02x-%02x%02x-%02x%02x-%02x%02x-%02x%02x%02x%02x%02x%02x", b[0],
             b[1], b[2], b[3], b[4], b[5], b[6], b[7], b[8], b[9], b[10], b[11], b[12], b[13], b[14],
             b[15]);
}

static int client_send_cancel(llm_client *c, const char *id) {
    Llm__ClientEnvelope env = LLM__CLIENT_ENVELOPE__INIT;
    Llm__Cancel cm = LLM__CANCEL__INIT;
    cm.request_id = (char *)id;
    env.body_case = LLM__CLIENT_ENVELOPE__BODY_CANCEL;
    env.cancel = &cm;
    env.tag = c->next_tag++;
    return client_send(c, &env);
}

/* State of one llm_client_generate call. */
struct client_gen {
    llm_client *c;
    struct llm_generate_result *res;
    llm_chunk_fn on_chunk;
    void *ud;
    uint32_t have;       /* completion tokens passed on (choice being handled) */
    uint32_t n;          /* choices */
    uint32_t haves[PROTO_N_MAX]; /* completion tokens passed on, per choice */
    bool done[PROTO_N_MAX];
    uint32_t n_done;
    bool accepted;       /* an Accepted came on this connection */
    bool cancel;         /* the callback asked to stop */
    bool cancel_sent;    /* on this connection */
    bool ever_accepted;  /* on any connection: the first Accepted says reattached */
    uint32_t short_dones; /* GenerateDones that came before all their tokens */
};

/* GenerateDones a call takes that count more tokens than arrived before
 * each: every one re-attaches for the rest (the router replays them and
 * ends again); past this many the call fails instead of returning a short
 * result. */
#define CLIENT_SHORT_DONES_MAX 3

/* Passes on the tokens of a chunk the caller does not have yet.  Returns
 * 1 when the chunk leaves a gap (tokens missing before it): the caller
 * re-attaches from what it has. */
static int client_gen_chunk_one(struct client_gen *g, const Llm__GenerateChunk *ch);

/* Tokens of one choice: its own count of tokens had (haves). */
static int client_gen_chunk(struct client_gen *g, const Llm__GenerateChunk *ch) {
    if (ch->choice >= g->n) {
        LOG(LL_WARN, "client: request %s: chunk of choice %u, but %u asked for; dropped", g->res->request_id,
            ch->choice, g->n);
        return 0;
    }
    g->have = g->haves[ch->choice];
    int rc = client_gen_chunk_one(g, ch);
    g->haves[ch->choice] = g->have;
    g->have = g->haves[0];
    return rc;
}

static int client_gen_chunk_one(struct client_gen *g, const Llm__GenerateChunk *ch) {
    uint32_t end = ch->index + (uint32_t)ch->n_token_ids;
    if (end <= g->have) {
        g->res->duplicates_dropped += (uint32_t)ch->n_token_ids;
        return 0;
    }
    if (ch->index > g->have) {
        LOG(LL_WARN, "client: request %s: chunk at token %u but %u received; re-attaching",
            g->res->request_id, ch->index, g->have);
        return 1;
    }
    uint32_t skip = g->have - ch->index;
    struct llm_chunk out = {g->res->request_id, ch->choice, g->have, ch->token_ids + skip,
                            ch->n_token_ids - skip, ch->text, strlen(ch->text), NULL, 0};
    /* Logprobs as plain structs pointing into the decoded frame: one array
     * of tokens and one of their alternatives, for this chunk only. */
    struct llm_token_logprob *lps = NULL;
    struct llm_top_logprob *tops = NULL;
    if (ch->n_logprobs == ch->n_token_ids && ch->n_logprobs > skip) {
        size_t n = ch->n_logprobs - skip, n_top = 0;
        for (size_t i = skip; i < ch->n_logprobs; i++) n_top += ch->logprobs[i]->n_top;
        lps = calloc(n, sizeof *lps);
        tops = calloc(n_top + 1, sizeof *tops);
        if (lps && tops) {
            size_t t = 0;
            for (size_t i = 0; i < n; i++) {
                const Llm__TokenLogprob *l = ch->logprobs[skip + i];
                lps[i].token = l->token;
                lps[i].logprob = l->logprob;
                lps[i].text = l->text.len ? (const char *)l->text.data : "";
                lps[i].text_len = l->text.len;
                lps[i].top = tops + t;
                lps[i].n_top = l->n_top;
                for (size_t k = 0; k < l->n_top; k++, t++) {
                    tops[t].token = l->top[k]->token;
                    tops[t].logprob = l->top[k]->logprob;
                    tops[t].text = l->top[k]->text.len ? (const char *)l->top[k]->text.data : "";
                    tops[t].text_len = l->top[k]->text.len;
                }
            }
            out.logprobs = lps;
            out.n_logprobs = n;
        } else {
            LOG(LL_WARN, "client: request %s: out of memory for the logprobs of tokens %u..%u",
                g->res->request_id, g->have, end);
        }
    }
    if (skip > 0) {
        /* A replay that straddles what we have: the text of the chunk cannot
         * be split by token, so it is not passed on (the router replays from
         * resume_from exactly, so this does not happen with a correct router). */
        LOG(LL_WARN, "client: request %s: replayed chunk %u..%u straddles %u received tokens; "
            "its text is dropped", g->res->request_id, ch->index, end, g->have);
        g->res->duplicates_dropped += skip;
        out.text = "";
        out.text_len = 0;
    }
    g->res->tokens_received += end - g->have;
    g->have = end;
    if (g->on_chunk && !g->cancel && g->on_chunk(g->ud, &out) != 0) g->cancel = true;
    free(lps);
    free(tops);
    return 0;
}

int llm_client_generate(llm_client *c, const struct llm_generate_params *p,
                        llm_chunk_fn on_chunk, void *ud, struct llm_generate_result *res) {
    memset(res, 0, sizeof *res);
    c->err_code = LLM__ERROR__CODE__OK;
    c->retry_after_ms = 0;
    c->errstr[0] = 0;
    if (p->request_id && p->request_id[0]) {
        char err[256];
        if (proto_request_id_check(p->request_id, err, sizeof err) < 0) {
            client_seterr(c, LLM__ERROR__CODE__INVALID_ARGUMENT, "generate: %s", err);
            return STATUS_BAD_INPUT;
        }
        snprintf(res->request_id, sizeof res->request_id, "%s", p->request_id);
    } else {
        client_make_id(res->request_id, sizeof res->request_id);
    }

    Llm__GenerateRequest gr = LLM__GENERATE_REQUEST__INIT;
    Llm__SamplingParams sp = LLM__SAMPLING_PARAMS__INIT;
    proto_sampling_to_msg(&p->sampling, &sp);
    if (p->json_schema) {
        sp.constraint_case = LLM__SAMPLING_PARAMS__CONSTRAINT_JSON_SCHEMA;
        sp.json_schema = (char *)p->json_schema;
    } else if (p->grammar) {
        sp.constraint_case = LLM__SAMPLING_PARAMS__CONSTRAINT_GRAMMAR;
        sp.grammar = (char *)p->grammar;
    } else if (p->json_object) {
        sp.constraint_case = LLM__SAMPLING_PARAMS__CONSTRAINT_JSON_OBJECT;
        sp.json_object = 1;
    }
    gr.request_id = res->request_id;
    gr.model = (char *)(p->model ? p->model : "");
    gr.prompt = (char *)(p->prompt ? p->prompt : "");
    gr.prompt_tokens = (int32_t *)p->prompt_tokens;
    gr.n_prompt_tokens = p->n_prompt_tokens;
    gr.max_tokens = p->max_tokens;
    gr.sampling = &sp;
    gr.stop = (char **)p->stop;
    gr.n_stop = p->n_stop;
    gr.priority = p->priority;
    gr.spec = (Llm__GenerateRequest__Spec)p->spec;
    gr.spec_tokens = p->spec_tokens;
    if (p->prediction) gr.prediction = (char *)p->prediction;
    gr.prediction_tokens = (int32_t *)p->prediction_tokens;
    gr.n_prediction_tokens = p->n_prediction_tokens;
    gr.deadline_ms = p->deadline_ms;
    gr.timeout_ms = p->timeout_ms;
    gr.stream = p->stream;
    Llm__ClientEnvelope env = LLM__CLIENT_ENVELOPE__INIT;
    env.body_case = LLM__CLIENT_ENVELOPE__BODY_GENERATE;
    env.generate = &gr;

    if (p->prediction && strlen(p->prediction) > PROTO_PREDICTION_BYTES_MAX) {
        client_seterr(c, LLM__ERROR__CODE__INVALID_ARGUMENT, "generate: prediction has %zu bytes, at most %d",
                      strlen(p->prediction), PROTO_PREDICTION_BYTES_MAX);
        return STATUS_BAD_INPUT;
    }
    if (p->prediction && p->prediction[0] && p->n_prediction_tokens > 0) {
        client_seterr(c, LLM__ERROR__CODE__INVALID_ARGUMENT, "generate: prediction and prediction_tokens are both "
                      "set; give one");
        return STATUS_BAD_INPUT;
    }
    if (p->n_prediction_tokens > PROTO_PREDICTION_TOKENS_MAX) {
        client_seterr(c, LLM__ERROR__CODE__INVALID_ARGUMENT, "generate: prediction_tokens has %zu ids, at most %d",
                      p->n_prediction_tokens, PROTO_PREDICTION_TOKENS_MAX);
        return STATUS_BAD_INPUT;
    }
    if (p->n > PROTO_N_MAX) {
        client_seterr(c, LLM__ERROR__CODE__INVALID_ARGUMENT, "generate: n = %u is more than %d", p->n, PROTO_N_MAX);
        return STATUS_BAD_INPUT;
    }
    gr.n = p->n;
    struct client_gen g = {.c = c, .res = res, .on_chunk = on_chunk, .ud = ud, .n = p->n > 1 ? p->n : 1};
    res->n_choices = g.n;
    res->choices = g.n > 1 ? calloc(g.n, sizeof *res->choices) : NULL;
    if (g.n > 1 && !res->choices) {
        client_seterr(c, LLM__ERROR__CODE__OK, "generate: out of memory");
        return STATUS_NO_MEMORY;
    }
    int rc = client_sock_ensure(c);
    if (rc < 0) return rc;
    /* Progress (an acceptance, new tokens) bounds the call by cfg.retry_ms;
     * any message about the request shows the connection is alive
     * (cfg.idle_timeout_ms). */
    int64_t last_progress = client_now_ms(), last_heard = last_progress;
    int64_t give_up = p->wait_ms > 0 ? last_progress + p->wait_ms : INT64_MAX;
    bool any_reply = false, need_send = true, move_on = false;
    size_t unavailable = 0; /* endpoints in a row that answered UNAVAILABLE or refused */
    int pause_ms = 0;       /* the latest UNAVAILABLE's retry_after_ms */
    int64_t resend_at = 0;  /* after a refusal worth retrying: send again then, reading meanwhile */
    int64_t sent = 0;
    uint64_t tag = 0;
    const char *lost_why = NULL;
    for (;;) {
        if (resend_at && client_now_ms() >= resend_at) {
            resend_at = 0;
            need_send = true;
        }
        if (need_send) {
            resend_at = 0;
            gr.resume_from = g.haves[0];
            gr.resume_from_choice = g.haves;
            gr.n_resume_from_choice = g.n > 1 ? g.n : 0;
            env.tag = tag = c->next_tag++;
            g.accepted = false;
            g.cancel_sent = false;
            rc = client_send(c, &env);
            sent = client_now_ms();
            need_send = false;
            if (rc < 0) lost_why = "send failed";
        }
        if (g.cancel && !g.cancel_sent && g.accepted && !lost_why) {
            if (client_send_cancel(c, res->request_id) < 0) lost_why = "send failed";
            g.cancel_sent = true;
        }
        int64_t now = client_now_ms();
        if (now >= give_up) {
            client_seterr(c, LLM__ERROR__CODE__OK, "generate: request %s: not done after %lld ms (%u tokens "
                          "received; it may still run: re-attach or cancel it by id)", res->request_id,
                          (long long)p->wait_ms, g.have);
            return STATUS_TIMEOUT;
        }
        if (!lost_why) {
            int64_t until = g.accepted ? last_heard + c->cfg.idle_timeout_ms
                                       : sent + c->cfg.reply_timeout_ms;
            if (until > give_up) until = give_up;
            /* Waiting for an answer: cfg.retry_ms without progress ends the
             * call, whatever reply_timeout_ms says. */
            if (!g.accepted && until > last_progress + c->cfg.retry_ms) until = last_progress + c->cfg.retry_ms;
            if (resend_at && until > resend_at) until = resend_at;
            if (until < now) until = now;
            Llm__ClientEnvelope *in = NULL;
            int ev = client_wait(c, (int)(until - now), &in);
            if (ev < 0) return ev;
            if (ev == CLIENT_LOST) lost_why = "connection lost";
            else if (ev == CLIENT_REFUSED) {
                /* A router that is down: the next endpoint now, not after
                 * reply_timeout_ms; after a pause once every one in a row
                 * could not serve (client_unavailable). */
                client_unavailable(c, &unavailable, pause_ms);
                lost_why = "connection refused: no router listens there";
                move_on = true;
            } else if (ev == CLIENT_IDLE && client_now_ms() >= give_up) continue;
            else if (ev == CLIENT_IDLE && resend_at) {
                resend_at = 0; /* the pause is over (or the idle timeout came first): send again */
                need_send = true;
                continue;
            }
            else if (ev == CLIENT_IDLE) lost_why = g.accepted ? "no message for the idle timeout" : "no reply";
            else {
                const char *rid = client_body_request_id(in);
                bool ours = strcmp(rid, res->request_id) == 0 ||
                            (in->tag == tag && in->body_case == LLM__CLIENT_ENVELOPE__BODY_ERROR);
                if (!ours) {
                    proto_client_free(in);
                    continue;
                }
                any_reply = true;
                last_heard = client_now_ms();
                switch (in->body_case) {
                case LLM__CLIENT_ENVELOPE__BODY_ACCEPTED: {
                    const Llm__GenerateAccepted *a = in->accepted;
                    /* Accepted again after a re-attach: the router has the
                     * request and a pipeline to run it (it answers UNAVAILABLE
                     * otherwise), so a long prefill is not a stall. */
                    last_progress = client_now_ms();
                    g.accepted = true;
                    unavailable = 0;
                    res->max_tokens = a->max_tokens;
                    if (!g.ever_accepted) {
                        res->reattached = a->reattached;
                        res->queue_position = a->queue_position;
                        g.ever_accepted = true;
                    }
                    res->seed = a->seed;
                    if (!res->prompt_ids && a->n_prompt_token_ids > 0) {
                        res->prompt_ids = malloc(a->n_prompt_token_ids * sizeof *res->prompt_ids);
                        if (res->prompt_ids) {
                            memcpy(res->prompt_ids, a->prompt_token_ids,
                                   a->n_prompt_token_ids * sizeof *res->prompt_ids);
                            res->n_prompt_ids = a->n_prompt_token_ids;
                        }
                    }
                    break;
                }
                case LLM__CLIENT_ENVELOPE__BODY_CHUNK:
                    if (in->chunk->choice < g.n &&
                        in->chunk->index + (uint32_t)in->chunk->n_token_ids > g.haves[in->chunk->choice]) {
                        last_progress = client_now_ms();
                        resend_at = 0;
                    }
                    if (client_gen_chunk(&g, in->chunk)) {
                        res->reattaches++;
                        need_send = true;
                    }
                    break;
                case LLM__CLIENT_ENVELOPE__BODY_DONE:
                    if (in->done->choice < g.n && !g.done[in->done->choice] && in->done->usage &&
                        in->done->usage->completion_tokens > g.haves[in->done->choice]) {
                        /* The end of a stream that lost tokens on the way
                         * (a re-attach in the turn the request ended): what
                         * is missing is asked for again, never dropped. */
                        const uint32_t ch = in->done->choice, want = in->done->usage->completion_tokens;
                        if (++g.short_dones > CLIENT_SHORT_DONES_MAX) {
                            client_seterr(c, LLM__ERROR__CODE__OK,
                                          "generate: request %s: choice %u ended at %u tokens but %u arrived, "
                                          "%u times; the router does not replay the rest",
                                          res->request_id, ch, want, g.haves[ch], g.short_dones);
                            proto_client_free(in);
                            return STATUS_PROTOCOL;
                        }
                        LOG(LL_WARN, "client: request %s: choice %u ended at %u tokens but %u arrived; re-attaching",
                            res->request_id, ch, want, g.haves[ch]);
                        res->reattaches++;
                        need_send = true;
                        break;
                    }
                    if (in->done->choice < g.n && !g.done[in->done->choice]) {
                        client_fill_done(res, in->done);
                        g.done[in->done->choice] = true;
                        g.n_done++;
                    }
                    proto_client_free(in);
                    if (g.n_done == g.n) return 0;
                    last_progress = client_now_ms();
                    continue;
                case LLM__CLIENT_ENVELOPE__BODY_ERROR: {
                    const Llm__Error *e = in->error;
                    bool retry = e->code == LLM__ERROR__CODE__UNAVAILABLE || e->retry_after_ms > 0;
                    rc = client_router_error(c, e, "generate");
                    res->retry_after_ms = e->retry_after_ms;
                    if (e->code == LLM__ERROR__CODE__UNAVAILABLE) pause_ms = (int)e->retry_after_ms;
                    if (retry && client_now_ms() + (int64_t)e->retry_after_ms < last_progress + c->cfg.retry_ms) {
                        /* A router that cannot serve now (no worker, no
                         * pipeline, no Redis, or another router holds the
                         * request) says so with UNAVAILABLE: the next
                         * endpoint may serve it at once (docs/router.md,
                         * "Balance"), so the client moves on, and waits
                         * only once every endpoint said it in a row.  A
                         * request it had accepted re-attaches there by id. */
                        if (e->code == LLM__ERROR__CODE__UNAVAILABLE && ++unavailable < c->n_endpoints) {
                            LOG(LL_INFO, "client: request %s: %s; trying the next router", res->request_id,
                                c->errstr);
                            lost_why = "router unavailable";
                            move_on = true;
                            break;
                        }
                        unavailable = 0;
                        LOG(LL_INFO, "client: request %s: %s; retrying", res->request_id, c->errstr);
                        /* Wait reading, not asleep: a request the router
                         * keeps (its pipelines went: the stall notice)
                         * streams on by itself once one is back, and its
                         * tokens are passed on as they come instead of
                         * after the pause; a chunk cancels the re-send. */
                        resend_at = client_now_ms() + (e->retry_after_ms > 0 ? (int64_t)e->retry_after_ms : 200);
                        break;
                    }
                    /* A Cancel the router no longer matches (the request ended
                     * between our chunk and the Cancel) is not the request's
                     * failure: its Done is on the way. */
                    if (g.cancel_sent && e->code == LLM__ERROR__CODE__NOT_FOUND && in->tag != tag) break;
                    proto_client_free(in);
                    return rc;
                }
                default:
                    break;
                }
                proto_client_free(in);
                continue;
            }
        }
        /* The connection broke or went quiet: re-attach (possibly elsewhere). */
        if (client_now_ms() - last_progress >= c->cfg.retry_ms) {
            if (any_reply) {
                client_seterr(c, LLM__ERROR__CODE__OK, "generate: request %s: no progress from %s for %d ms "
                              "(%u tokens received; it may still run: re-attach or cancel it by id)",
                              res->request_id, c->endpoints[c->cur], c->cfg.retry_ms, g.have);
                return STATUS_TIMEOUT;
            }
            client_seterr(c, LLM__ERROR__CODE__OK, "generate: request %s: no router answered at %s "
                          "within %d ms", res->request_id, c->endpoints[c->cur], c->cfg.retry_ms);
            return STATUS_UNAVAILABLE;
        }
        rc = client_reconnect(c, lost_why);
        if (rc < 0) return rc;
        lost_why = NULL;
        if (!move_on) res->reattaches++;
        move_on = false;
        need_send = true;
    }
}

int llm_client_cancel(llm_client *c, const char *request_id, struct llm_generate_result *res) {
    struct llm_generate_result local;
    if (!res) res = &local;
    memset(res, 0, sizeof *res);
    c->err_code = LLM__ERROR__CODE__OK;
    c->retry_after_ms = 0;
    char err[256];
    if (!request_id || proto_request_id_check(request_id, err, sizeof err) < 0) {
        client_seterr(c, LLM__ERROR__CODE__INVALID_ARGUMENT, "cancel: %s",
                      request_id ? err : "no request id");
        return STATUS_BAD_INPUT;
    }
    snprintf(res->request_id, sizeof res->request_id, "%s", request_id);
    int rc = client_sock_ensure(c);
    if (rc < 0) return rc;
    int64_t give_up = client_now_ms() + c->cfg.retry_ms;
    size_t refused = 0; /* endpoints in a row that refused the connection */
    for (;;) {
        uint64_t tag = c->next_tag;
        rc = client_send_cancel(c, request_id);
        int64_t sent = client_now_ms();
        bool lost = rc < 0;
        while (!lost) {
            int left = (int)(sent + c->cfg.reply_timeout_ms - client_now_ms());
            if (left <= 0) break;
            Llm__ClientEnvelope *in;
            int ev = client_wait(c, left, &in);
            if (ev < 0) return ev;
            if (ev == CLIENT_LOST) lost = true;
            if (ev == CLIENT_REFUSED) {
                client_unavailable(c, &refused, 0);
                lost = true;
            }
            if (ev != CLIENT_MSG) continue;
            if (in->body_case == LLM__CLIENT_ENVELOPE__BODY_DONE &&
                strcmp(in->done->request_id, request_id) == 0) {
                client_fill_done(res, in->done);
                proto_client_free(in);
                return 0;
            }
            if (in->body_case == LLM__CLIENT_ENVELOPE__BODY_ERROR && in->tag == tag) {
                rc = client_router_error(c, in->error, "cancel");
                proto_client_free(in);
                return rc;
            }
            proto_client_free(in);
        }
        if (client_now_ms() >= give_up) {
            client_seterr(c, LLM__ERROR__CODE__OK, "cancel: request %s: no reply from %s within %d ms",
                          request_id, c->endpoints[c->cur], c->cfg.retry_ms);
            return STATUS_UNAVAILABLE;
        }
        rc = client_reconnect(c, lost ? "connection lost" : "no reply");
        if (rc < 0) return rc;
    }
}
