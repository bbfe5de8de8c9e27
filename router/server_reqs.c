/* Requests in memory: the maps by id and by sequence, a request's life
 * from its stored form to its end (tokens recorded, stop conditions,
 * detokenized text streamed to its client, the end stored in Redis). */
#include "router/server-impl.h"
#include "router/server_metrics.h"

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
#include "router/ngram.h"

/* Longest suffix a prediction lookup tries (3, 2, then 1 tokens), as the
 * scheduler's own prompt lookup. */
#define SERVER_PRED_NGRAM_MAX 3

static int req_spec_mode(const server *s, const struct req *q);

static uint32_t hash_str(const char *s) {
    uint32_t h = 2166136261u;
    for (; *s; s++) h = (h ^ (uint8_t)*s) * 16777619u;
    return h % SERVER_BUCKETS;
}

static uint32_t hash_u64(uint64_t x) {
    x ^= x >> 33;
    x *= 0xff51afd7ed558ccdull;
    x ^= x >> 33;
    return (uint32_t)(x % SERVER_BUCKETS);
}

struct req *req_find(server *s, const char *owner, const char *id) {
    for (struct req *q = s->by_id[hash_str(id)]; q; q = q->hnext)
        if (strcmp(q->id, id) == 0 && strcmp(q->owner, owner) == 0) return q;
    return NULL;
}

bool req_find_other(server *s, const char *owner, const char *id) {
    for (struct req *q = s->by_id[hash_str(id)]; q; q = q->hnext)
        if (strcmp(q->id, id) == 0 && strcmp(q->owner, owner) != 0) return true;
    return false;
}

struct req *req_by_seq(server *s, uint64_t seq_id) {
    for (struct req *q = s->by_seq[hash_u64(seq_id)]; q; q = q->snext)
        if (q->seq_id == seq_id && q->seq) return q;
    return NULL;
}

void req_seq_put(server *s, struct req *q) {
    uint32_t h = hash_u64(q->seq_id);
    q->snext = s->by_seq[h];
    s->by_seq[h] = q;
}

void req_seq_del(server *s, struct req *q) {
    for (struct req **pp = &s->by_seq[hash_u64(q->seq_id)]; *pp; pp = &(*pp)->snext)
        if (*pp == q) {
            *pp = q->snext;
            break;
        }
    q->snext = NULL;
}

static void req_text_append(struct req *q, const char *t, size_t n) {
    if (n == 0) return;
    if (server_grow((void **)&q->text, &q->text_cap, q->text_len + n + 1, 1) < 0) return;
    memcpy(q->text + q->text_len, t, n);
    q->text_len += n;
    q->text[q->text_len] = '\0';
}

void req_free(struct req *q) {
    free(q->params);
    if (q->gen) llm__generate_request__free_unpacked(q->gen, NULL);
    free(q->prompt);
    free(q->pred);
    free(q->out);
    free(q->lps);
    free(q->text);
    free(q->stop_string);
    free(q->error_message);
    free(q);
}

void req_unlink(server *s, struct req *q) {
    for (struct req **pp = &s->by_id[hash_str(q->id)]; *pp; pp = &(*pp)->hnext)
        if (*pp == q) {
            *pp = q->hnext;
            break;
        }
    if (q->prev) q->prev->next = q->next;
    else s->all = q->next;
    if (q->next) q->next->prev = q->prev;
    s->n_reqs--;
    if (q->state == REQ_DONE) s->n_done--;
}

/* q's prediction as tokens: a continuation, so no BOS, and where the
 * tokenizer puts a space before a text (SentencePiece) the prediction's
 * own leading space stands for it (" there" is "▁there", as the model
 * makes it after a prompt). */
static int req_pred_tokenize(server *s, struct req *q, char *err, size_t errlen) {
    const char *text = q->gen->prediction;
    size_t len = strlen(text);
    if (tokenizer_adds_space_prefix(s->tok) && text[0] == ' ') {
        text++;
        len--;
    }
    int32_t cap = (int32_t)len + 8, n = 0;
    for (;;) {
        q->pred = malloc((size_t)cap * sizeof *q->pred);
        if (!q->pred) {
            snprintf(err, errlen, "request %s: out of memory for its prediction", q->id);
            return STATUS_NO_MEMORY;
        }
        n = tokenizer_encode(s->tok, text, len, 0, 0, q->pred, cap);
        if (n < 0) {
            snprintf(err, errlen, "request %s: prediction (%zu bytes) cannot be tokenized (%s)", q->id,
                     strlen(q->gen->prediction), status_str(n));
            return n;
        }
        if (n <= cap) break;
        free(q->pred);
        q->pred = NULL;
        cap = n;
    }
    q->n_pred = n;
    return 0;
}

/* A request from its stored form (new, re-attached after a restart, or
 * recovered); takes nothing from r (copies). */
struct req *req_new(server *s, const struct reqrec *r, char *err, size_t errlen) {
    struct req *q = calloc(1, sizeof *q);
    if (!q) goto oom;
    snprintf(q->id, sizeof q->id, "%s", r->id);
    const char *sp = strchr(q->id, ' ');
    snprintf(q->cid, sizeof q->cid, "%.*s", sp ? (int)(sp - q->id) : (int)strlen(q->id), q->id);
    q->choice = sp ? (uint32_t)strtoul(sp + 1, NULL, 10) : 0;
    q->params = malloc(r->params_len + 1);
    q->prompt = malloc((size_t)r->n_prompt * sizeof *q->prompt);
    q->cap_out = r->n_gen + 64;
    q->out = malloc((size_t)q->cap_out * sizeof *q->out);
    if (!q->params || !q->prompt || !q->out) goto oom;
    memcpy(q->params, r->params, r->params_len);
    q->params_len = r->params_len;
    q->gen = llm__generate_request__unpack(NULL, r->params_len, r->params);
    if (!q->gen) {
        snprintf(err, errlen, "request %s: stored parameters (%zu bytes) do not decode", r->id,
                 r->params_len);
        req_free(q);
        return NULL;
    }
    if (q->gen->n_prediction_tokens > 0) {
        q->pred = malloc(q->gen->n_prediction_tokens * sizeof *q->pred);
        if (!q->pred) goto oom;
        memcpy(q->pred, q->gen->prediction_tokens, q->gen->n_prediction_tokens * sizeof *q->pred);
        q->n_pred = (int32_t)q->gen->n_prediction_tokens;
    } else if (q->gen->prediction && q->gen->prediction[0] && req_pred_tokenize(s, q, err, errlen) < 0) {
        req_free(q);
        return NULL;
    }
    if (proto_sampling_from_msg(q->gen->sampling, &q->sp, err, errlen) < 0) {
        req_free(q);
        return NULL;
    }
    q->sp.seed = r->seed;
    proto_sampling_to_msg(&q->sp, &q->spm);
    /* The constraint travels to the last stage as the client sent it (the
     * strings live in q->gen). */
    if (q->gen->sampling) {
        const Llm__SamplingParams *g = q->gen->sampling;
        q->spm.constraint_case = g->constraint_case;
        if (g->constraint_case == LLM__SAMPLING_PARAMS__CONSTRAINT_JSON_SCHEMA) q->spm.json_schema = g->json_schema;
        else if (g->constraint_case == LLM__SAMPLING_PARAMS__CONSTRAINT_GRAMMAR) q->spm.grammar = g->grammar;
        else if (g->constraint_case == LLM__SAMPLING_PARAMS__CONSTRAINT_JSON_OBJECT) q->spm.json_object = g->json_object;
    }
    memcpy(q->prompt, r->prompt, (size_t)r->n_prompt * sizeof *q->prompt);
    q->n_prompt = r->n_prompt;
    if (r->n_gen > 0) memcpy(q->out, r->gen, (size_t)r->n_gen * sizeof *q->out);
    q->n_out = q->n_persisted = r->n_gen;
    if (q->sp.logprobs || q->sp.top_logprobs > 0) {
        q->lps = calloc((size_t)q->cap_out, sizeof *q->lps);
        if (!q->lps) goto oom;
        for (int32_t i = 0; i < q->n_out; i++) q->lps[i].token = q->out[i];
    }
    q->seed = r->seed;
    snprintf(q->owner, sizeof q->owner, "%s", r->owner);
    q->created_ms = r->created_ms;
    q->deadline_ms = r->deadline_ms;
    q->priority = q->gen->priority;
    q->n_choices = q->gen->n > 1 ? q->gen->n : 1;
    int64_t limit = q->gen->max_tokens ? (int64_t)q->n_prompt + q->gen->max_tokens : s->mi.n_ctx;
    q->limit = (int32_t)(limit < s->mi.n_ctx ? limit : s->mi.n_ctx);
    q->pred_only = q->pred && req_spec_mode(s, q) == SERVER_SPEC_NGRAM;
    q->order = ++s->next_order;
    q->stream = q->gen->stream;
    snprintf(q->entry, sizeof q->entry, "%s", r->entry);
    tokenizer_detok_init(&q->dt, 0); /* a continuation keeps its leading space */
    for (int32_t i = 0; i < q->n_out; i++) {
        int n = tokenizer_detok_push(s->tok, &q->dt, q->out[i], s->detok_buf, s->detok_size);
        if (n > 0) req_text_append(q, s->detok_buf, (size_t)n);
    }
    q->text_checked = q->text_len;
    if (r->state == REQREC_DONE) {
        q->state = REQ_DONE;
        q->finish = r->finish;
        q->stop_token = r->stop_token;
        q->error_code = r->error_code;
        q->stop_string = r->stop_string ? strdup(r->stop_string) : NULL;
        q->error_message = r->error_message ? strdup(r->error_message) : NULL;
        q->finish_stored = true;
        q->done_ms = server_now_ms();
        /* Text of a finished request: its stop string was cut off. */
        if (q->stop_string) {
            char *m = q->text ? memmem(q->text, q->text_len, q->stop_string, strlen(q->stop_string)) : NULL;
            if (m) q->text_len = (size_t)(m - q->text);
        }
    }
    /* Link. */
    uint32_t h = hash_str(q->id);
    q->hnext = s->by_id[h];
    s->by_id[h] = q;
    q->next = s->all;
    if (s->all) s->all->prev = q;
    s->all = q;
    s->n_reqs++;
    if (q->state == REQ_DONE) s->n_done++;
    return q;
oom:
    snprintf(err, errlen, "request %s: out of memory", r->id);
    if (q) req_free(q);
    return NULL;
}

int req_queue_push(server *s, struct req *q) {
    if (server_grow((void **)&s->queue, &s->cap_queue, s->n_queue + 1, sizeof *s->queue) < 0)
        return STATUS_NO_MEMORY;
    s->queue[s->n_queue++] = q;
    q->state = REQ_QUEUED;
    return 0;
}

static void queue_remove(server *s, struct req *q) {
    for (size_t i = 0; i < s->n_queue; i++)
        if (s->queue[i] == q) {
            memmove(&s->queue[i], &s->queue[i + 1], (s->n_queue - i - 1) * sizeof *s->queue);
            s->n_queue--;
            return;
        }
}

void req_touch(server *s, struct req *q) {
    if (q->touched) return;
    if (server_grow((void **)&s->touched, &s->cap_touched, s->n_touched + 1, sizeof *s->touched) < 0) return;
    q->touched = true;
    s->touched[s->n_touched++] = q;
}

/* Bytes of text held back because they may start a stop string. */
size_t req_stop_hold(const struct req *q) {
    size_t hold = 0;
    for (size_t i = 0; i < q->gen->n_stop; i++) {
        const char *st = q->gen->stop[i];
        size_t L = strlen(st);
        size_t k = L - 1 < q->text_len ? L - 1 : q->text_len;
        for (; k > hold; k--)
            if (memcmp(q->text + q->text_len - k, st, k) == 0) {
                hold = k;
                break;
            }
    }
    return hold;
}

/* Text bytes of the first n tokens (what a fresh detokenizer makes of them). */
size_t req_text_offset(server *s, const struct req *q, int32_t n) {
    struct detok d;
    tokenizer_detok_init(&d, 0);
    size_t off = 0;
    for (int32_t i = 0; i < n && i < q->n_out; i++) {
        int k = tokenizer_detok_push(s->tok, &d, q->out[i], s->detok_buf, s->detok_size);
        if (k > 0) off += (size_t)k;
    }
    return off < q->text_len ? off : q->text_len;
}

/* The bytes token adds to the output text (TokenLogprob.text): what the
 * router's detokenizer takes from it, before it joins bytes into whole
 * characters: none for a control token.  Writes at most size bytes to buf
 * and returns how many. */
static size_t req_token_text(server *s, int32_t token, char *buf, size_t size) {
    if (tokenizer_token_type(s->tok, token) == 3 /* control */) return 0;
    int n = tokenizer_token_bytes(s->tok, token, buf, size);
    if (n <= 0) return 0;
    return (size_t)n < size ? (size_t)n : size;
}

/* One chunk: tokens [from, to) with text bytes [t0, t1). */
void req_send_chunk(server *s, struct req *q, int32_t from, int32_t to, size_t t0, size_t t1) {
    if (to <= from && t1 <= t0) return;
    Llm__GenerateChunk c = LLM__GENERATE_CHUNK__INIT;
    c.request_id = q->cid;
    c.choice = q->choice;
    c.index = (uint32_t)from;
    c.n_token_ids = (size_t)(to > from ? to - from : 0);
    c.token_ids = q->out + from;
    char *text = malloc(t1 > t0 ? t1 - t0 + 1 : 1);
    if (!text) return;
    if (t1 > t0) memcpy(text, q->text + t0, t1 - t0);
    text[t1 > t0 ? t1 - t0 : 0] = '\0';
    c.text = text;
    Llm__TokenLogprob *lp = NULL, **lpp = NULL;
    Llm__TopLogprob *tops = NULL, **topp = NULL;
    uint8_t *texts = NULL;
    if (q->lps && c.n_token_ids > 0) {
        size_t n = c.n_token_ids;
        /* Room for the text of every token and alternative: no token's
         * bytes are longer than its stored text. */
        size_t tlen = (size_t)tokenizer_token_len_max(s->tok) + 1, used = 0;
        lp = calloc(n, sizeof *lp);
        lpp = calloc(n, sizeof *lpp);
        tops = calloc(n * SAMPLING_TOP_LOGPROBS_MAX + 1, sizeof *tops);
        topp = calloc(n * SAMPLING_TOP_LOGPROBS_MAX + 1, sizeof *topp);
        texts = malloc(n * (SAMPLING_TOP_LOGPROBS_MAX + 1) * tlen);
        if (lp && lpp && tops && topp && texts) {
            for (size_t i = 0; i < n; i++) {
                const struct lp *l = &q->lps[from + (int32_t)i];
                llm__token_logprob__init(&lp[i]);
                lp[i].token = l->token;
                lp[i].logprob = l->logprob;
                lp[i].text.data = texts + used;
                lp[i].text.len = req_token_text(s, l->token, (char *)texts + used, tlen);
                used += lp[i].text.len;
                lp[i].n_top = (size_t)l->n_top;
                lp[i].top = topp + i * SAMPLING_TOP_LOGPROBS_MAX;
                for (int32_t k = 0; k < l->n_top; k++) {
                    Llm__TopLogprob *t = &tops[i * SAMPLING_TOP_LOGPROBS_MAX + (size_t)k];
                    llm__top_logprob__init(t);
                    t->token = l->top_token[k];
                    t->logprob = l->top_logprob[k];
                    t->text.data = texts + used;
                    t->text.len = req_token_text(s, t->token, (char *)texts + used, tlen);
                    used += t->text.len;
                    lp[i].top[k] = t;
                }
                lpp[i] = &lp[i];
            }
            c.n_logprobs = n;
            c.logprobs = lpp;
        }
    }
    Llm__ClientEnvelope env = LLM__CLIENT_ENVELOPE__INIT;
    env.body_case = LLM__CLIENT_ENVELOPE__BODY_CHUNK;
    env.chunk = &c;
    server_send_client(s, q->ident, q->ident_len, &env);
    free(text);
    free(lp);
    free(lpp);
    free(tops);
    free(topp);
    free(texts);
}

void req_send_done(server *s, struct req *q, const uint8_t *ident, size_t ident_len) {
    Llm__GenerateDone d = LLM__GENERATE_DONE__INIT;
    Llm__GenerateDone__Usage u = LLM__GENERATE_DONE__USAGE__INIT;
    Llm__Error e;
    d.request_id = q->cid;
    d.choice = q->choice;
    d.finish_reason = (Llm__GenerateDone__FinishReason)q->finish;
    u.prompt_tokens = (uint32_t)q->n_prompt;
    u.completion_tokens = (uint32_t)q->n_out;
    u.accepted_prediction_tokens = q->pred_accepted;
    u.rejected_prediction_tokens = q->pred_rejected;
    d.usage = &u;
    d.stop_token = q->stop_token;
    d.stop_string = q->stop_string ? q->stop_string : "";
    if (q->error_code != LLM__ERROR__CODE__OK) {
        proto_error_init(&e, (Llm__Error__Code)q->error_code, q->cid, q->error_message, 0);
        d.error = &e;
    }
    Llm__ClientEnvelope env = LLM__CLIENT_ENVELOPE__INIT;
    env.body_case = LLM__CLIENT_ENVELOPE__BODY_DONE;
    env.done = &d;
    server_send_client(s, ident, ident_len, &env);
}

/* A request run again from its prompt after its state was lost (see
 * on_generate) streams to a client that already has its first resume_from
 * tokens: those are not sent again, so that no chunk straddles them.
 * Returns false while the request has not caught up with the client. */
static bool req_skip_had(server *s, struct req *q) {
    if (q->n_sent >= (int32_t)q->resume_from) return true;
    if (q->n_out < (int32_t)q->resume_from) return false;
    q->n_sent = (int32_t)q->resume_from;
    q->text_sent = req_text_offset(s, q, q->n_sent);
    return true;
}

/* Streams what the client has not seen yet (streaming requests). */
static void req_stream(server *s, struct req *q) {
    if (!q->stream || !req_skip_had(s, q)) return;
    size_t sendable = q->text_len - req_stop_hold(q);
    if (sendable < q->text_sent) sendable = q->text_sent;
    if (q->n_out > q->n_sent || sendable > q->text_sent) {
        req_send_chunk(s, q, q->n_sent, q->n_out, q->text_sent, sendable);
        q->n_sent = q->n_out;
        q->text_sent = sendable;
    }
}

/* Stores the tokens not yet in Redis for every touched request, in one
 * round trip.  On failure they stay pending and go with the next batch. */
static void persist_touched(server *s) {
    if (!s->rs || s->n_touched == 0) return;
    struct reqstore_append *a = calloc(s->n_touched, sizeof *a);
    if (!a) return;
    size_t n = 0;
    for (size_t i = 0; i < s->n_touched; i++) {
        struct req *q = s->touched[i];
        if (q->n_out > q->n_persisted)
            a[n++] = (struct reqstore_append){q->id, q->out + q->n_persisted, q->n_out - q->n_persisted, q->owner};
    }
    if (n > 0) {
        if (reqstore_append(s->rs, a, n) == 0) {
            for (size_t i = 0; i < s->n_touched; i++) s->touched[i]->n_persisted = s->touched[i]->n_out;
        } else {
            LOG(LL_WARN, "persisting tokens of %zu requests: %s", n, reqstore_errstr(s->rs));
        }
    }
    free(a);
}

void req_store_finish(server *s, struct req *q) {
    if (q->finish_stored || !s->rs) return;
    if (q->n_out > q->n_persisted) {
        struct reqstore_append a = {q->id, q->out + q->n_persisted, q->n_out - q->n_persisted, q->owner};
        if (reqstore_append(s->rs, &a, 1) < 0) {
            LOG(LL_WARN, "request %s: storing its last tokens: %s", q->id, reqstore_errstr(s->rs));
            return;
        }
        q->n_persisted = q->n_out;
    }
    struct reqrec r;
    memset(&r, 0, sizeof r);
    snprintf(r.id, sizeof r.id, "%s", q->id);
    snprintf(r.owner, sizeof r.owner, "%s", q->owner);
    snprintf(r.entry, sizeof r.entry, "%s", q->entry);
    r.finish = q->finish;
    r.stop_token = q->stop_token;
    r.stop_string = q->stop_string;
    r.error_code = q->error_code;
    r.error_message = q->error_message;
    if (reqstore_finish(s->rs, &r) == 0) q->finish_stored = true;
    else LOG(LL_WARN, "request %s: storing its end: %s", q->id, reqstore_errstr(s->rs));
}

/* Takes q off its pipeline (its blocks return; the workers free it with
 * the next step). */
static void req_unassign(server *s, struct req *q) {
    if (q->seq && q->pipe && q->pipe->sched) sched_remove(q->pipe->sched, q->seq);
    if (q->seq) req_seq_del(s, q);
    q->seq = NULL;
    q->pipe = NULL;
    q->step = 0;
}

/* Marks q finished (the stream ends in req_finalize). */
void req_end(server *s, struct req *q, int32_t finish, int32_t stop_token, const char *stop_string,
                    Llm__Error__Code code, const char *msg) {
    if (q->state == REQ_DONE || q->finishing) return;
    if (q->pipe) q->ended_on = q->pipe->p->id + 1;
    req_unassign(s, q);
    if (q->state == REQ_QUEUED) queue_remove(s, q);
    q->finish = finish;
    q->stop_token = stop_token;
    q->stop_string = stop_string ? strdup(stop_string) : NULL;
    q->error_code = code;
    q->error_message = msg ? strdup(msg) : NULL;
    q->finishing = true;
    req_touch(s, q);
}

/* The end of a finishing request: flushed text, stored end, last chunk and
 * GenerateDone. */
static void req_finalize(server *s, struct req *q) {
    if (!q->stop_string) {
        char tail[8];
        int n = tokenizer_detok_flush(&q->dt, tail, sizeof tail);
        if (n > 0) req_text_append(q, tail, (size_t)n);
    }
    q->finishing = false;
    q->state = REQ_DONE;
    q->done_ms = server_now_ms();
    s->n_done++;
    server_metrics_finished(s->cfg.metrics, q->finish, q->created_ms, q->done_ms);
    req_store_finish(s, q);
    if (q->stream) {
        req_skip_had(s, q);
        if (q->n_out > q->n_sent || q->text_len > q->text_sent)
            req_send_chunk(s, q, q->n_sent, q->n_out, q->text_sent, q->text_len);
    } else {
        int32_t from = (int32_t)q->resume_from < q->n_out ? (int32_t)q->resume_from : q->n_out;
        req_send_chunk(s, q, from, q->n_out, req_text_offset(s, q, from), q->text_len);
    }
    q->n_sent = q->n_out;
    q->text_sent = q->text_len;
    req_send_done(s, q, q->ident, q->ident_len);
    /* Its client may send the next request now (--batch-wait-us). */
    struct pipeline *ended =
        s->cfg.batch_wait_us > 0 && q->ended_on ? registry_pipeline_find(s->reg, q->ended_on - 1) : NULL;
    if (ended && ended->ud) ((struct pipe *)ended->ud)->last_end_us = server_mono_us();
    LOG(LL_INFO, "request %s: done (%s%s%s), %d prompt + %d completion tokens", q->id,
        protobuf_c_enum_descriptor_get_value(&llm__generate_done__finish_reason__descriptor, q->finish)
            ? protobuf_c_enum_descriptor_get_value(&llm__generate_done__finish_reason__descriptor, q->finish)->name
            : "?",
        q->error_message ? ": " : "", q->error_message ? q->error_message : "", q->n_prompt, q->n_out);
}

/* After a batch of events: store tokens, stream, end what finished. */
void req_flush_touched(server *s) {
    persist_touched(s);
    for (size_t i = 0; i < s->n_touched; i++) {
        struct req *q = s->touched[i];
        q->touched = false;
        if (q->finishing) req_finalize(s, q);
        else if (q->state != REQ_DONE) req_stream(s, q);
    }
    s->n_touched = 0;
}

/* q's speculation mode: its own, else the router's --spec. */
static int req_spec_mode(const server *s, const struct req *q) {
    switch (q->gen->spec) {
    case LLM__GENERATE_REQUEST__SPEC__SPEC_OFF: return SERVER_SPEC_OFF;
    case LLM__GENERATE_REQUEST__SPEC__SPEC_NGRAM: return SERVER_SPEC_NGRAM;
    case LLM__GENERATE_REQUEST__SPEC__SPEC_DRAFT: return SERVER_SPEC_DRAFT;
    case LLM__GENERATE_REQUEST__SPEC__SPEC_AUTO: return SERVER_SPEC_AUTO;
    default: break;
    }
    /* A prediction is there to be drafted from: it asks for prompt lookup
     * unless the request itself says off. */
    if (q->pred && s->cfg.spec == SERVER_SPEC_OFF) return SERVER_SPEC_NGRAM;
    return s->cfg.spec;
}

void req_spec(const server *s, const struct req *q, int32_t *k, bool *auto_only, unsigned *sources) {
    *k = 0;
    *auto_only = false;
    *sources = SCHED_SPEC_NGRAM;
    int mode = req_spec_mode(s, q);
    if (mode == SERVER_SPEC_OFF) return;
    /* draft: the last stage's draft model only; auto: prompt lookup first
     * (free), the draft model when it finds nothing.  A last stage without
     * a draft model answers no drafts: plain decoding. */
    *sources = mode == SERVER_SPEC_NGRAM   ? SCHED_SPEC_NGRAM
               : mode == SERVER_SPEC_DRAFT ? SCHED_SPEC_MODEL
                                           : SCHED_SPEC_NGRAM | SCHED_SPEC_MODEL;
    /* The grammar's masks follow one parse state per sequence, and a step
     * would need one per drafted position: constrained requests decode one
     * token a step (for now). */
    const Llm__SamplingParams *m = q->gen->sampling;
    if (m && m->constraint_case != LLM__SAMPLING_PARAMS__CONSTRAINT__NOT_SET &&
        !(m->constraint_case == LLM__SAMPLING_PARAMS__CONSTRAINT_JSON_OBJECT && !m->json_object))
        return;
    *k = q->gen->spec_tokens > 0 ? (int32_t)q->gen->spec_tokens : s->cfg.spec_tokens;
    if (*k > SERVER_SPEC_TOKENS_MAX) *k = SERVER_SPEC_TOKENS_MAX;
    *auto_only = mode == SERVER_SPEC_AUTO;
    /* With a prediction the lookup runs here (req_pred_drafts: it sees the
     * prediction, the scheduler's does not) and hands its drafts to the
     * scheduler as the model's source does; the draft model, where the
     * mode has it, fills in when the lookup finds nothing. */
    if (q->pred) *sources = SCHED_SPEC_MODEL;
}

void req_pred_drafts(server *s, struct req *q) {
    if (!q->pred || !q->seq || q->n_out < 1) return;
    int32_t k = 0;
    bool auto_only = false;
    unsigned sources = 0;
    req_spec(s, q, &k, &auto_only, &sources);
    q->pred_drafts = false;
    q->pred_matched = false;
    if (k <= 0) return;
    int32_t d[SCHED_SPEC_TOKENS_MAX];
    if (k > SCHED_SPEC_TOKENS_MAX) k = SCHED_SPEC_TOKENS_MAX;
    int32_t n = ngram_propose_pred(q->prompt, q->n_prompt, q->pred, q->n_pred, q->out, q->n_out,
                                   SERVER_PRED_NGRAM_MAX, 1, k, &q->pred_off, d, &q->pred_matched);
    if (n <= 0) return;
    sched_seq_set_model_drafts(q->seq, d, n);
    q->pred_drafts = true;
}

/* A sampled token for q: record it, check the stop conditions, and give
 * the sequence its next decode input or end it. */
void req_token(server *s, struct req *q, int32_t token, const Llm__TokenLogprob *lp) {
    if (q->n_out == q->cap_out) {
        int32_t cap = q->cap_out * 2;
        int32_t *o = realloc(q->out, (size_t)cap * sizeof *o);
        struct lp *l = q->lps ? realloc(q->lps, (size_t)cap * sizeof *l) : NULL;
        if (!o || (q->lps && !l)) {
            if (o) q->out = o;
            if (l) q->lps = l;
            req_end(s, q, LLM__GENERATE_DONE__FINISH_REASON__ERROR, -1, NULL,
                    LLM__ERROR__CODE__RESOURCE_EXHAUSTED, "router out of memory");
            return;
        }
        q->out = o;
        q->lps = l;
        q->cap_out = cap;
    }
    if (q->lps) {
        struct lp *l = &q->lps[q->n_out];
        memset(l, 0, sizeof *l);
        l->token = token;
        if (lp) {
            l->logprob = lp->logprob;
            l->n_top = (int32_t)(lp->n_top < SAMPLING_TOP_LOGPROBS_MAX ? lp->n_top : SAMPLING_TOP_LOGPROBS_MAX);
            for (int32_t k = 0; k < l->n_top; k++) {
                l->top_token[k] = lp->top[k] ? lp->top[k]->token : -1;
                l->top_logprob[k] = lp->top[k] ? lp->top[k]->logprob : 0.0f;
            }
        }
    }
    int64_t now_us = server_mono_us();
    if (q->n_out == 0) server_metrics_first_token(s->cfg.metrics, q->created_ms, server_now_ms());
    else if (q->last_token_us) server_metrics_token_gap(s->cfg.metrics, (double)(now_us - q->last_token_us) / 1e6);
    q->last_token_us = now_us;
    q->out[q->n_out++] = token;
    s->gen_total++;
    if (q->pipe) q->pipe->gen_tokens++;
    req_touch(s, q);
    int n = tokenizer_detok_push(s->tok, &q->dt, token, s->detok_buf, s->detok_size);
    if (n > 0) req_text_append(q, s->detok_buf, (size_t)n);

    /* Stop strings: search the new text (and what could straddle it). */
    size_t maxl = 0;
    for (size_t i = 0; i < q->gen->n_stop; i++)
        if (strlen(q->gen->stop[i]) > maxl) maxl = strlen(q->gen->stop[i]);
    if (maxl > 0 && q->text_len > q->text_checked) {
        size_t from = q->text_checked > maxl ? q->text_checked - maxl : 0;
        if (from < q->text_sent) from = q->text_sent;
        size_t best = SIZE_MAX;
        const char *which = NULL;
        for (size_t i = 0; i < q->gen->n_stop; i++) {
            const char *m = memmem(q->text + from, q->text_len - from, q->gen->stop[i], strlen(q->gen->stop[i]));
            if (m && (size_t)(m - q->text) < best) {
                best = (size_t)(m - q->text);
                which = q->gen->stop[i];
            }
        }
        q->text_checked = q->text_len;
        if (which) {
            q->text_len = best;
            req_end(s, q, LLM__GENERATE_DONE__FINISH_REASON__STOP, -1, which, LLM__ERROR__CODE__OK, NULL);
            return;
        }
    }
    if ((!q->sp.ignore_eos && tokenizer_is_eog(s->tok, token)) || sampling_is_stop(&q->sp, token)) {
        req_end(s, q, LLM__GENERATE_DONE__FINISH_REASON__STOP, token, NULL, LLM__ERROR__CODE__OK, NULL);
        return;
    }
    if ((q->gen->max_tokens && (uint32_t)q->n_out >= q->gen->max_tokens) || q->n_prompt + q->n_out >= q->limit) {
        req_end(s, q, LLM__GENERATE_DONE__FINISH_REASON__LENGTH, -1, NULL, LLM__ERROR__CODE__OK, NULL);
        return;
    }
    if (q->seq && sched_append(q->pipe->sched, q->seq, token) < 0) {
        /* The scheduler did not expect a token: start the sequence over. */
        sched_restart(q->pipe->sched, q->seq);
    }
}
