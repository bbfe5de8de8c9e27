/* Client messages: Generate (new or re-attached), Cancel, Health, Models
 * and Status. */
#include "router/server-impl.h"

#include <errno.h>
#include <inttypes.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>
#include <unistd.h>
#include <zmq.h>

#include "common/keys.h"
#include "common/log.h"
#include "common/status.h"
#include "router/server_metrics.h"

/* The request as stored: the client's body without the fields that may
 * differ between a request and its re-sends.  seed_zero: as if the client
 * had left the seed to the router. */
static int canonical_params_as(const Llm__GenerateRequest *g, bool seed_zero, uint8_t **out, size_t *len) {
    Llm__GenerateRequest c = *g;
    Llm__SamplingParams sp;
    c.stream = false;
    c.resume_from = 0;
    c.n_resume_from_choice = 0;
    c.resume_from_choice = NULL;
    c.timeout_ms = 0;
    if (seed_zero && g->sampling) {
        sp = *g->sampling;
        sp.seed = 0;
        c.sampling = &sp;
    }
    size_t n = llm__generate_request__get_packed_size(&c);
    *out = malloc(n + 1);
    if (!*out) return STATUS_NO_MEMORY;
    *len = llm__generate_request__pack(&c, *out);
    return 0;
}

static int canonical_params(const Llm__GenerateRequest *g, uint8_t **out, size_t *len) {
    return canonical_params_as(g, false, out, len);
}

/* Whether a re-sent request is the stored one.  A client may send back the
 * seed the router chose for it (GenerateAccepted.seed): that is the same
 * request, and it is what lets the request resume on the same sample path
 * should its state ever be lost. */
static int same_request(const struct req *q, const Llm__GenerateRequest *g, bool *same) {
    *same = false;
    for (int pass = 0; pass < 2 && !*same; pass++) {
        if (pass == 1 && !(g->sampling && g->sampling->seed != 0 && g->sampling->seed == q->seed)) break;
        uint8_t *cp = NULL;
        size_t clen = 0;
        if (canonical_params_as(g, pass == 1, &cp, &clen) < 0) return STATUS_NO_MEMORY;
        *same = clen == q->params_len && memcmp(cp, q->params, clen) == 0;
        free(cp);
    }
    return 0;
}

static uint32_t queue_depth(server *s) {
    uint32_t n = (uint32_t)s->n_queue;
    for (size_t i = 0; i < registry_n_pipelines(s->reg); i++) {
        struct pipe *pp = registry_pipeline_at(s->reg, i)->ud;
        if (pp && pp->sched) {
            struct sched_stats st;
            sched_get_stats(pp->sched, &st);
            n += (uint32_t)st.n_waiting;
        }
    }
    return n;
}

static void send_accepted(server *s, struct req *q, uint64_t tag, bool reattached, uint32_t position) {
    Llm__GenerateAccepted a = LLM__GENERATE_ACCEPTED__INIT;
    a.request_id = q->id;
    a.reattached = reattached;
    a.prompt_tokens = (uint32_t)q->n_prompt;
    a.seed = q->seed;
    a.queue_position = position;
    a.n_prompt_token_ids = (size_t)q->n_prompt;
    a.prompt_token_ids = q->prompt;
    a.max_tokens = q->limit > q->n_prompt ? (uint32_t)(q->limit - q->n_prompt) : 0;
    Llm__ClientEnvelope env = LLM__CLIENT_ENVELOPE__INIT;
    env.tag = tag;
    env.body_case = LLM__CLIENT_ENVELOPE__BODY_ACCEPTED;
    env.accepted = &a;
    server_send_client(s, q->ident, q->ident_len, &env);
}

/* Request ownership (docs/security.md): on a router with keys a request id
 * is the sending key's, so the owner is part of every lookup and another
 * key's request of the same id is simply not found (nor taken, cancelled or
 * read).  The owner is in the request's Redis keys, which a restarted router
 * reads too. */
static const char *client_owner(const server *s) { return s->zap ? s->peer_key : ""; }

/* A Generate or Cancel naming an id that only another key has in this
 * router's memory: not an error (the id is free for this key), but a sign
 * of someone guessing ids, so it is counted
 * (llm_refused_request_access_total) and logged, the first ten and then
 * every thousandth. */
static void note_foreign_id(server *s, const char *id, bool cancel) {
    if (!s->zap || !s->peer_key[0] || !req_find_other(s, s->peer_key, id)) return;
    static uint64_t seen;
    server_metrics_request_refused(s->cfg.metrics, cancel);
    if (++seen <= 10 || seen % 1000 == 0)
        LOG(LL_WARN, "security: %s of request id %.128s from key %.40s: another client's key has a request "
            "of that id, which this key cannot reach (%llu such)", cancel ? "cancel" : "generate", id,
            s->peer_key, (unsigned long long)seen);
}

/* What a re-attached client missed of q, from token from on: the whole
 * rest and its GenerateDone when q is done, else (streaming) what is
 * sendable now; the rest streams as it comes. */
static void reattach_replay(server *s, struct req *q, int32_t from, const uint8_t *ident, size_t ident_len) {
    if (q->state == REQ_DONE) {
        req_send_chunk(s, q, from, q->n_out, req_text_offset(s, q, from), q->text_len);
        req_send_done(s, q, ident, ident_len);
        return;
    }
    if (q->finishing) {
        /* Its end (the tokens not streamed yet and the GenerateDone) goes
         * out with this turn's flush, from what was streamed on: that much
         * went to the earlier connection, so it is replayed now. */
        if (q->stream && from < q->n_sent) {
            const size_t t0 = req_text_offset(s, q, from);
            req_send_chunk(s, q, from, q->n_sent, t0, q->text_sent < t0 ? t0 : q->text_sent);
        }
        return;
    }
    if (q->stream) {
        size_t sendable = q->text_len - req_stop_hold(q);
        size_t t0 = req_text_offset(s, q, from);
        if (sendable < t0) sendable = t0;
        /* The tokens streamed already end a chunk of their own: a client
         * that re-attached twice from one position (two gaps before the
         * first replay came) has them by the time this replay comes, and
         * a chunk that straddles what a client has cannot be split by
         * text, so the text of the new tokens after them would be lost
         * (clients/c drops it). */
        if (q->n_sent > from && q->n_sent < q->n_out) {
            size_t tm = q->text_sent < t0 ? t0 : q->text_sent > sendable ? sendable : q->text_sent;
            req_send_chunk(s, q, from, q->n_sent, t0, tm);
            from = q->n_sent;
            t0 = tm;
        }
        req_send_chunk(s, q, from, q->n_out, t0, sendable);
        q->n_sent = q->n_out;
        q->text_sent = sendable;
    }
}

/* Choice i (1..n-1) of the request whose choice 0 is first
 * (docs/protocol.md, "Several choices"): in memory, else loaded from
 * Redis, else (create) stored now from first's record with its own seed
 * (a new request, or a router that stopped between storing choice 0 and
 * the others).  Returns it, or NULL with err filled. */
static struct req *choice_get(server *s, struct req *first, uint32_t i, bool create, char *err, size_t errlen) {
    char id[PROTO_REQUEST_KEY_MAX + 1];
    snprintf(id, sizeof id, "%s %u", first->cid, i);
    struct req *q = req_find(s, first->owner, id);
    if (q) return q;
    if (!s->rs) {
        snprintf(err, errlen, "request %s: choice %u: the router cannot reach Redis", first->cid, i);
        return NULL;
    }
    struct reqrec r;
    int rc = reqstore_load(s->rs, first->owner, id, &r);
    if (rc == STATUS_NOT_FOUND && create) {
        memset(&r, 0, sizeof r);
        snprintf(r.id, sizeof r.id, "%s", id);
        snprintf(r.owner, sizeof r.owner, "%s", first->owner);
        r.params = malloc(first->params_len + 1);
        r.prompt = malloc((size_t)first->n_prompt * sizeof *r.prompt);
        if (!r.params || !r.prompt) {
            reqrec_free(&r);
            snprintf(err, errlen, "request %s: choice %u: router out of memory", first->cid, i);
            return NULL;
        }
        memcpy(r.params, first->params, first->params_len);
        r.params_len = first->params_len;
        memcpy(r.prompt, first->prompt, (size_t)first->n_prompt * sizeof *r.prompt);
        r.n_prompt = first->n_prompt;
        r.seed = proto_choice_seed(first->seed, i);
        r.created_ms = first->created_ms;
        r.deadline_ms = first->deadline_ms;
        r.state = REQREC_QUEUED;
        rc = reqstore_create(s->rs, &r);
        if (rc < 0) reqrec_free(&r);
    }
    if (rc < 0) {
        snprintf(err, errlen, "request %s: choice %u: %s", first->cid, i,
                 rc == STATUS_NOT_FOUND ? "not found" : reqstore_errstr(s->rs));
        return NULL;
    }
    q = req_new(s, &r, err, errlen);
    bool queued = r.state == REQREC_QUEUED;
    reqrec_free(&r);
    if (q && queued) req_queue_push(s, q);
    return q;
}

/* Choices 1..n-1 of first's request join the client's connection: made
 * if missing, and (replay: a re-attach) each replays what the client has
 * not got of it, from resume_from_choice[i], as choice 0 does.  Returns 0,
 * or a negative status with err (the choices before stay attached; a
 * retry of the request attaches the rest). */
static int choices_attach(server *s, struct req *first, const Llm__GenerateRequest *g, const uint8_t *ident,
                          size_t ident_len, bool replay, char *err, size_t errlen) {
    for (uint32_t i = 1; i < first->n_choices; i++) {
        struct req *q = choice_get(s, first, i, true, err, errlen);
        if (!q) return STATUS_UNAVAILABLE;
        q->client_seen_ms = server_now_ms();
        memcpy(q->ident, ident, ident_len);
        q->ident_len = ident_len;
        q->stream = g->stream;
        uint32_t have = i < g->n_resume_from_choice ? g->resume_from_choice[i] : 0;
        if (!replay) {
            q->resume_from = have; /* run again for a client that has some (on_generate) */
            continue;
        }
        int32_t from = (int32_t)(have < (uint32_t)q->n_out ? have : (uint32_t)q->n_out);
        q->resume_from = (uint32_t)from;
        reattach_replay(s, q, from, ident, ident_len);
    }
    return 0;
}

static void reattach(server *s, struct req *q, const Llm__GenerateRequest *g, const uint8_t *ident,
                     size_t ident_len, uint64_t tag) {
    bool same = false;
    if (same_request(q, g, &same) < 0) {
        server_send_client_error(s, ident, ident_len, tag, LLM__ERROR__CODE__INTERNAL, g->request_id, "out of memory", 0);
        return;
    }
    if (!same) {
        server_send_client_error(s, ident, ident_len, tag, LLM__ERROR__CODE__ALREADY_EXISTS, g->request_id,
                                 "request_id is in use by a request with a different body (model, prompt, "
                                 "sampling, max_tokens, stop, priority or deadline)",
                                 0);
        return;
    }
    q->client_seen_ms = server_now_ms(); /* its client is there: the grace starts over */
    int32_t cap;
    uint32_t pid;
    if (q->state == REQ_QUEUED && !q->finishing && pipes_taking_work(s, &cap, &pid) == 0) {
        /* The stream stays where it is: this client re-attaches again on
         * retry, and moving it without the replay below would resend
         * from the old position. */
        pipes_tell_stalled(s, q, ident, ident_len, tag);
        return;
    }
    memcpy(q->ident, ident, ident_len);
    q->ident_len = ident_len;
    q->stream = g->stream;
    int32_t from = (int32_t)(g->resume_from < (uint32_t)q->n_out ? g->resume_from : (uint32_t)q->n_out);
    q->resume_from = (uint32_t)from;
    send_accepted(s, q, tag, true, 0);
    LOG(LL_INFO, "request %s: re-attached, %d tokens so far, replay from %d", q->id, q->n_out, from);
    reattach_replay(s, q, from, ident, ident_len);
    char err[256];
    if (choices_attach(s, q, g, ident, ident_len, true, err, sizeof err) < 0)
        server_send_client_error(s, ident, ident_len, tag, LLM__ERROR__CODE__UNAVAILABLE, q->cid, err,
                                 SERVER_RETRY_AFTER_MS);
}

static void on_generate(server *s, const uint8_t *ident, size_t ident_len, uint64_t tag,
                        const Llm__GenerateRequest *g) {
    char err[512];
    const char *rid = g->request_id ? g->request_id : "";
    if (proto_request_id_check(rid, err, sizeof err) < 0) {
        server_send_client_error(s, ident, ident_len, tag, LLM__ERROR__CODE__INVALID_ARGUMENT, "", err, 0);
        return;
    }
    const char *owner = client_owner(s);
    struct req *q = req_find(s, owner, rid);
    if (q) {
        reattach(s, q, g, ident, ident_len, tag);
        return;
    }
    /* Redis may be back before the next try on the clock (a restart takes
     * well under a second): a request does not wait for it.  A burst of
     * requests while it is down costs one connection attempt per 10 ms. */
    if (!s->rs && server_now_ms() - s->last_redis_try_ms >= 10) {
        s->last_redis_try_ms = server_now_ms();
        server_redis_connect(s);
    }
    if (!s->rs) {
        server_send_client_error(s, ident, ident_len, tag, LLM__ERROR__CODE__UNAVAILABLE, rid,
                                 "the router cannot reach Redis, so it cannot make the request durable",
                                 SERVER_RETRY_AFTER_MS);
        return;
    }
    struct reqrec r;
    int rc = reqstore_load(s->rs, owner, rid, &r);
    if (rc == 0) {
        /* Known to Redis but not here: finished before a restart, or
         * recovered state we dropped. */
        q = req_new(s, &r, err, sizeof err);
        bool queued = r.state == REQREC_QUEUED;
        reqrec_free(&r);
        if (!q) {
            server_send_client_error(s, ident, ident_len, tag, LLM__ERROR__CODE__INTERNAL, rid, err, 0);
            return;
        }
        if (queued) req_queue_push(s, q);
        reattach(s, q, g, ident, ident_len, tag);
        return;
    }
    if (rc != STATUS_NOT_FOUND) {
        /* Another router holds it: retry when the entry can be claimed
         * here (its holder silent for --claim-idle-ms), if that is sooner
         * than the usual retry, so that a client of a dead router is
         * served as soon as the claim allows. */
        int64_t claim_in = reqstore_claim_in_ms(s->rs);
        server_send_client_error(s, ident, ident_len, tag, LLM__ERROR__CODE__UNAVAILABLE, rid, reqstore_errstr(s->rs),
                                 claim_in > 0 && claim_in < SERVER_RETRY_AFTER_MS ? (uint32_t)claim_in
                                                                                   : SERVER_RETRY_AFTER_MS);
        return;
    }
    note_foreign_id(s, rid, false);
    int64_t now = server_now_ms();
    rc = proto_generate_validate(g, s->mi.n_vocab, now, err, sizeof err);
    if (rc < 0) {
        server_send_client_error(s, ident, ident_len, tag,
                                 rc == STATUS_TIMEOUT       ? LLM__ERROR__CODE__DEADLINE_EXCEEDED
                                 : rc == STATUS_UNSUPPORTED ? LLM__ERROR__CODE__UNIMPLEMENTED
                                                            : LLM__ERROR__CODE__INVALID_ARGUMENT,
                                 rid, err, 0);
        return;
    }
    if (g->model && g->model[0] && strcmp(g->model, s->mi.id) != 0) {
        snprintf(err, sizeof err, "model \"%.128s\" is not served here; the model is \"%s\"", g->model, s->mi.id);
        server_send_client_error(s, ident, ident_len, tag, LLM__ERROR__CODE__NOT_FOUND, rid, err, 0);
        return;
    }
    /* A client that already has tokens of a request nobody knows any more
     * (Redis lost it, or the retention passed) is re-attaching.  Running it
     * again is right only on the same sample path: with the seed it sends,
     * which for a router-chosen seed is the one GenerateAccepted returned.
     * Without one, a new seed would silently continue the client's text
     * from a different sample (greedy decoding has no seed to lose). */
    bool resumed = g->resume_from > 0;
    bool greedy = !g->sampling || g->sampling->temperature <= 0.0f;
    if (resumed && !greedy && g->sampling->seed == 0) {
        snprintf(err, sizeof err,
                 "request %.128s: its state is gone (Redis lost it, or its retention passed) and it was sampled"
                 " with a seed the router chose; running it again with a new seed "
                 "would continue your %u tokens from a different sample: re-send it with sampling.seed "
                 "set to the seed of its GenerateAccepted, or with resume_from = 0 to start over",
                 rid, g->resume_from);
        server_send_client_error(s, ident, ident_len, tag, LLM__ERROR__CODE__FAILED_PRECONDITION, rid, err, 0);
        LOG(LL_WARN, "request %s: re-attach with %u tokens to a request whose state is gone, without its seed: "
            "refused", rid, g->resume_from);
        return;
    }

    /* Tokens. */
    int32_t *prompt = NULL;
    int32_t n_prompt = 0;
    if (g->n_prompt_tokens > 0) {
        if (g->n_prompt_tokens >= (size_t)s->mi.n_ctx) {
            snprintf(err, sizeof err, "prompt_tokens has %zu tokens and fills the context of %s (%d tokens): "
                     "no completion token fits", g->n_prompt_tokens, s->mi.id, s->mi.n_ctx);
            server_send_client_error_reason(s, ident, ident_len, tag, LLM__ERROR__CODE__INVALID_ARGUMENT,
                                            SERVER_REASON_CONTEXT, rid, err, 0);
            return;
        }
        n_prompt = (int32_t)g->n_prompt_tokens;
        prompt = malloc((size_t)n_prompt * sizeof *prompt);
        if (prompt) memcpy(prompt, g->prompt_tokens, (size_t)n_prompt * sizeof *prompt);
    } else {
        size_t tl = strlen(g->prompt);
        int32_t cap = (int32_t)(tl + 8 < (size_t)s->mi.n_ctx + 8 ? tl + 8 : (size_t)s->mi.n_ctx + 8);
        prompt = malloc((size_t)cap * sizeof *prompt);
        if (prompt) {
            n_prompt = tokenizer_encode(s->tok, g->prompt, tl, -1, 0, prompt, cap);
            if (n_prompt < 0) {
                snprintf(err, sizeof err, "prompt: cannot be tokenized (%s)", status_str(n_prompt));
                free(prompt);
                server_send_client_error(s, ident, ident_len, tag, LLM__ERROR__CODE__INVALID_ARGUMENT, rid, err, 0);
                return;
            }
            if (n_prompt > cap) {
                snprintf(err, sizeof err, "prompt: %zu bytes are %d tokens or more and fill the context of %s "
                         "(%d tokens): no completion token fits", tl, n_prompt, s->mi.id, s->mi.n_ctx);
                free(prompt);
                server_send_client_error_reason(s, ident, ident_len, tag, LLM__ERROR__CODE__INVALID_ARGUMENT,
                                                SERVER_REASON_CONTEXT, rid, err, 0);
                return;
            }
        }
    }
    if (!prompt) {
        server_send_client_error(s, ident, ident_len, tag, LLM__ERROR__CODE__INTERNAL, rid, "router out of memory", 0);
        return;
    }
    if (n_prompt == 0) {
        free(prompt);
        server_send_client_error(s, ident, ident_len, tag, LLM__ERROR__CODE__INVALID_ARGUMENT, rid,
                                 "prompt: is empty (0 tokens) and the model adds no BOS", 0);
        return;
    }
    /* Only a prompt that leaves no room for one completion token is
     * refused.  A max_tokens that runs past the context is clamped to what
     * the context leaves, as llama-server does (req_new's limit): the stored
     * request keeps the client's max_tokens, so a re-send is the same
     * request, and GenerateAccepted.max_tokens tells the client the bound. */
    if (n_prompt >= s->mi.n_ctx) {
        snprintf(err, sizeof err, "prompt: %d tokens fill the context of %s (%d tokens): no completion token fits",
                 n_prompt, s->mi.id, s->mi.n_ctx);
        free(prompt);
        server_send_client_error_reason(s, ident, ident_len, tag, LLM__ERROR__CODE__INVALID_ARGUMENT,
                                        SERVER_REASON_CONTEXT, rid, err, 0);
        return;
    }
    uint32_t room = (uint32_t)(s->mi.n_ctx - n_prompt);
    bool clamped = g->max_tokens > room;
    int64_t total = (int64_t)n_prompt + (g->max_tokens ? (clamped ? room : g->max_tokens) : 1);
    /* Acceptance is a promise to run the request, so it is made only when
     * some pipeline takes work: otherwise the client hears why and retries
     * (a cluster scaling from zero serves it on a retry), and nothing that
     * was accepted ever waits without a pipeline it could run on. */
    int32_t best_cap;
    uint32_t best_pid;
    if (pipes_taking_work(s, &best_cap, &best_pid) == 0) {
        char why[384];
        pipes_why_idle(s, why, sizeof why);
        snprintf(err, sizeof err, "no pipeline is in service to run it: %s", why);
        free(prompt);
        server_send_client_error(s, ident, ident_len, tag, LLM__ERROR__CODE__UNAVAILABLE, rid, err,
                                 SERVER_RETRY_AFTER_MS);
        return;
    }
    /* KV: the largest pipeline in service must be able to hold it. */
    if (total > best_cap) {
        snprintf(err, sizeof err,
                 "prompt (%d tokens) + max_tokens (%u) = %lld tokens do not fit the KV cache of any "
                 "pipeline (the largest, pipeline %u, holds %d tokens)",
                 n_prompt, (uint32_t)(total - n_prompt), (long long)total, best_pid, best_cap);
        free(prompt);
        server_send_client_error(s, ident, ident_len, tag, LLM__ERROR__CODE__RESOURCE_EXHAUSTED, rid, err, 0);
        return;
    }
    if (queue_depth(s) >= (uint32_t)s->cfg.max_queue) {
        snprintf(err, sizeof err, "the queue is full (%d requests waiting); retry later", s->cfg.max_queue);
        free(prompt);
        server_send_client_error(s, ident, ident_len, tag, LLM__ERROR__CODE__RESOURCE_EXHAUSTED, rid, err, 1000);
        return;
    }

    /* Durable, then acknowledged. */
    memset(&r, 0, sizeof r);
    snprintf(r.id, sizeof r.id, "%s", rid);
    snprintf(r.owner, sizeof r.owner, "%s", owner);
    if (canonical_params(g, &r.params, &r.params_len) < 0) {
        free(prompt);
        server_send_client_error(s, ident, ident_len, tag, LLM__ERROR__CODE__INTERNAL, rid, "router out of memory", 0);
        return;
    }
    r.prompt = prompt;
    r.n_prompt = n_prompt;
    r.seed = g->sampling && g->sampling->seed ? g->sampling->seed : 0;
    while (r.seed == 0) {
        uint64_t x = (uint64_t)server_mono_us() ^ ((uint64_t)now << 20) ^ ((uint64_t)getpid() << 40) ^ s->requests_total;
        x ^= x >> 31;
        x *= 0xbf58476d1ce4e5b9ull;
        x ^= x >> 29;
        r.seed = x;
    }
    r.created_ms = now;
    r.deadline_ms = g->deadline_ms;
    if (g->timeout_ms && (r.deadline_ms == 0 || now + g->timeout_ms < r.deadline_ms))
        r.deadline_ms = now + g->timeout_ms;
    r.state = REQREC_QUEUED;
    rc = reqstore_create(s->rs, &r);
    if (rc < 0) {
        snprintf(err, sizeof err, "%s", reqstore_errstr(s->rs));
        reqrec_free(&r);
        server_send_client_error(s, ident, ident_len, tag, LLM__ERROR__CODE__UNAVAILABLE, rid, err, 1000);
        return;
    }
    q = req_new(s, &r, err, sizeof err);
    reqrec_free(&r);
    if (!q) {
        server_send_client_error(s, ident, ident_len, tag, LLM__ERROR__CODE__INTERNAL, rid, err, 0);
        return;
    }
    memcpy(q->ident, ident, ident_len);
    q->ident_len = ident_len;
    q->stream = g->stream;
    /* Run again for a client that has its first resume_from tokens: the
     * same seed makes the same tokens, and those are not sent again. */
    q->resume_from = resumed ? g->resume_from : 0;
    uint32_t position = queue_depth(s);
    req_queue_push(s, q);
    s->requests_total++;
    if (choices_attach(s, q, g, ident, ident_len, false, err, sizeof err) < 0) {
        /* Choice 0 is durable and runs; the retry re-attaches and makes
         * the choices still missing. */
        server_send_client_error(s, ident, ident_len, tag, LLM__ERROR__CODE__UNAVAILABLE, rid, err,
                                 SERVER_RETRY_AFTER_MS);
        return;
    }
    send_accepted(s, q, tag, false, position);
    LOG(LL_INFO, "request %s: accepted%s, %d prompt tokens, max_tokens %u%s, priority %d, seed %llu, %u choice%s",
        q->id, resumed ? " again (its state was gone; the client has some tokens)" : "", q->n_prompt,
        (uint32_t)(q->limit - q->n_prompt), clamped ? " (clamped to the context left)" : "", q->priority,
        (unsigned long long)q->seed, q->n_choices, q->n_choices == 1 ? "" : "s");
}

static void on_cancel(server *s, const uint8_t *ident, size_t ident_len, uint64_t tag, const Llm__Cancel *c) {
    const char *rid = c->request_id ? c->request_id : "";
    const char *owner = client_owner(s);
    struct req *q = req_find(s, owner, rid);
    if (!q && s->rs) {
        struct reqrec r;
        if (reqstore_load(s->rs, owner, rid, &r) == 0) {
            char err[256];
            q = req_new(s, &r, err, sizeof err);
            bool queued = r.state == REQREC_QUEUED;
            reqrec_free(&r);
            if (q && queued) req_queue_push(s, q);
        }
    }
    if (!q) {
        char msg[256];
        note_foreign_id(s, rid, true);
        snprintf(msg, sizeof msg, "no request with id \"%.128s\"", rid);
        server_send_client_error(s, ident, ident_len, tag, LLM__ERROR__CODE__NOT_FOUND, rid, msg, 0);
        return;
    }
    /* Every choice of it (docs/protocol.md, "Several choices"). */
    struct req *first = q;
    for (uint32_t i = 0; i < first->n_choices; i++) {
        char err[256];
        if (i > 0 && !(q = choice_get(s, first, i, false, err, sizeof err))) {
            LOG(LL_WARN, "cancel: %s", err);
            continue;
        }
        if (q->state == REQ_DONE) {
            req_send_done(s, q, ident, ident_len);
            continue;
        }
        req_end(s, q, LLM__GENERATE_DONE__FINISH_REASON__CANCELLED, -1, NULL, LLM__ERROR__CODE__CANCELLED,
                "cancelled by the client");
        if (q->ident_len != ident_len || memcmp(q->ident, ident, ident_len) != 0) {
            /* The canceller gets the GenerateDone too. */
            req_flush_touched(s);
            req_send_done(s, q, ident, ident_len);
        }
        LOG(LL_INFO, "request %s: cancelled", q->id);
    }
}

static void on_health(server *s, const uint8_t *ident, size_t ident_len, uint64_t tag) {
    Llm__HealthReply h = LLM__HEALTH_REPLY__INIT;
    uint32_t ready = 0;
    for (size_t i = 0; i < registry_n_pipelines(s->reg); i++) {
        struct pipe *pp = registry_pipeline_at(s->reg, i)->ud;
        if (pp && pp->sched) ready++;
    }
    h.status = ready > 0 && s->rs ? LLM__HEALTH_REPLY__SERVING_STATUS__SERVING
                                  : LLM__HEALTH_REPLY__SERVING_STATUS__NOT_SERVING;
    h.protocol_version = PROTO_VERSION;
    h.build = SERVER_BUILD;
    h.pipelines_ready = ready;
    Llm__ClientEnvelope env = LLM__CLIENT_ENVELOPE__INIT;
    env.tag = tag;
    env.body_case = LLM__CLIENT_ENVELOPE__BODY_HEALTH_REPLY;
    env.health_reply = &h;
    server_send_client(s, ident, ident_len, &env);
}

static void on_models(server *s, const uint8_t *ident, size_t ident_len, uint64_t tag) {
    Llm__ModelInfo mi = LLM__MODEL_INFO__INIT;
    mi.id = s->mi.id;
    mi.architecture = s->mi.arch;
    mi.n_vocab = (uint32_t)s->mi.n_vocab;
    mi.n_ctx = (uint32_t)s->mi.n_ctx;
    mi.n_layers = (uint32_t)s->mi.n_layers;
    for (size_t i = 0; i < registry_n_pipelines(s->reg); i++) {
        struct pipeline *p = registry_pipeline_at(s->reg, i);
        struct pipe *pp = p->ud;
        if (pp && pp->sched && !registry_pipeline_draining(s->reg, p)) mi.pipelines++;
    }
    mi.is_default = true;
    Llm__ModelInfo *mp = &mi;
    Llm__ModelsReply m = LLM__MODELS_REPLY__INIT;
    m.n_models = 1;
    m.models = &mp;
    Llm__ClientEnvelope env = LLM__CLIENT_ENVELOPE__INIT;
    env.tag = tag;
    env.body_case = LLM__CLIENT_ENVELOPE__BODY_MODELS_REPLY;
    env.models_reply = &m;
    server_send_client(s, ident, ident_len, &env);
}

#define SERVER_DRAIN_IDS_MAX 256

/* DrainRequest (docs/router.md, "Draining a pipeline"): an admin's only.
 * Every id is checked before any pipeline changes; the reply says, per
 * pipeline, whether it is idle (its workers may stop). */
static void on_drain(server *s, const uint8_t *ident, size_t ident_len, uint64_t tag, const Llm__DrainRequest *m) {
    char msg[512];
    if (!s->cfg.insecure && (!s->admins || keys_list_find(s->admins, s->peer_key) < 0)) {
        snprintf(msg, sizeof msg, "DrainRequest: the key %.40s is not an admin key (%s)", s->peer_key,
                 s->admins ? "not in the router's --admin-keys"
                           : "this router has no --admin-keys: admin messages are off");
        LOG(LL_WARN, "%s", msg);
        server_send_client_error(s, ident, ident_len, tag, LLM__ERROR__CODE__PERMISSION_DENIED, "", msg, 0);
        return;
    }
    if (m->n_pipeline_ids == 0 || m->n_pipeline_ids > SERVER_DRAIN_IDS_MAX) {
        snprintf(msg, sizeof msg, "DrainRequest.pipeline_ids: %zu ids; name 1 to %d pipelines", m->n_pipeline_ids,
                 SERVER_DRAIN_IDS_MAX);
        server_send_client_error(s, ident, ident_len, tag, LLM__ERROR__CODE__INVALID_ARGUMENT, "", msg, 0);
        return;
    }
    for (size_t i = 0; i < m->n_pipeline_ids; i++) {
        if (registry_pipeline_find(s->reg, m->pipeline_ids[i])) continue;
        int n = snprintf(msg, sizeof msg, "DrainRequest.pipeline_ids: pipeline %u does not exist (the router has",
                         m->pipeline_ids[i]);
        size_t np = registry_n_pipelines(s->reg);
        for (size_t k = 0; k < np && n > 0 && (size_t)n < sizeof msg - 16; k++)
            n += snprintf(msg + n, sizeof msg - (size_t)n, "%s %u", k ? "," : "", registry_pipeline_at(s->reg, k)->id);
        if (n > 0 && (size_t)n < sizeof msg - 8) snprintf(msg + n, sizeof msg - (size_t)n, "%s)", np ? "" : " none");
        server_send_client_error(s, ident, ident_len, tag, LLM__ERROR__CODE__NOT_FOUND, "", msg, 0);
        return;
    }
    Llm__DrainReply r = LLM__DRAIN_REPLY__INIT;
    Llm__DrainReply__Pipeline *ps = calloc(m->n_pipeline_ids, sizeof *ps);
    Llm__DrainReply__Pipeline **pps = calloc(m->n_pipeline_ids, sizeof *pps);
    if (!ps || !pps) {
        free(ps);
        free(pps);
        server_send_client_error(s, ident, ident_len, tag, LLM__ERROR__CODE__RESOURCE_EXHAUSTED, "",
                                 "router out of memory", 1000);
        return;
    }
    for (size_t i = 0; i < m->n_pipeline_ids; i++) {
        struct pipeline *p = registry_pipeline_find(s->reg, m->pipeline_ids[i]);
        pipes_drain(s, p, !m->resume);
        struct pipe *pp = p->ud;
        struct sched_stats st = {0};
        if (pp && pp->sched) sched_get_stats(pp->sched, &st);
        Llm__DrainReply__Pipeline *x = &ps[i];
        llm__drain_reply__pipeline__init(x);
        x->pipeline_id = p->id;
        x->draining = p->drain;
        x->running = (uint32_t)(st.n_running + st.n_waiting); /* fork waiters run here too */
        x->steps_in_flight = pp && pp->sched ? (uint32_t)pp->n_flights : 0;
        x->idle = p->drain && x->running == 0 && x->steps_in_flight == 0;
        pps[i] = x;
    }
    r.n_pipelines = m->n_pipeline_ids;
    r.pipelines = pps;
    Llm__ClientEnvelope env = LLM__CLIENT_ENVELOPE__INIT;
    env.tag = tag;
    env.body_case = LLM__CLIENT_ENVELOPE__BODY_DRAIN_REPLY;
    env.drain_reply = &r;
    server_send_client(s, ident, ident_len, &env);
    free(pps);
    free(ps);
}

static void on_status(server *s, const uint8_t *ident, size_t ident_len, uint64_t tag) {
    int64_t now = server_now_ms();
    size_t np = registry_n_pipelines(s->reg), nw = registry_n_workers(s->reg);
    size_t n_stages = 0;
    for (size_t i = 0; i < np; i++) n_stages += registry_pipeline_at(s->reg, i)->stage_count;
    Llm__PipelineStatus *ps = calloc(np + 1, sizeof *ps);
    Llm__PipelineStatus **psp = calloc(np + 1, sizeof *psp);
    Llm__StageStatus *ss = calloc(n_stages + 1, sizeof *ss);
    Llm__StageStatus **ssp = calloc(n_stages + 1, sizeof *ssp);
    Llm__WorkerStatus *ws = calloc(nw + 1, sizeof *ws);
    Llm__WorkerStatus **wsp = calloc(nw + 1, sizeof *wsp);
    if (!ps || !psp || !ss || !ssp || !ws || !wsp) {
        server_send_client_error(s, ident, ident_len, tag, LLM__ERROR__CODE__INTERNAL, "", "router out of memory", 0);
        goto done;
    }
    Llm__StatusReply st = LLM__STATUS_REPLY__INIT;
    size_t si = 0;
    for (size_t i = 0; i < np; i++) {
        struct pipeline *p = registry_pipeline_at(s->reg, i);
        struct pipe *pp = p->ud;
        Llm__PipelineStatus *x = &ps[i];
        llm__pipeline_status__init(x);
        x->pipeline_id = p->id;
        x->model = s->mi.id;
        x->ready = pp && pp->sched && !p->drain;
        x->draining = registry_pipeline_draining(s->reg, p);
        x->epoch = p->epoch;
        x->problem = p->problem;
        if (p->stage_count > 0 && p->stage[p->stage_count - 1])
            x->draft_model = p->stage[p->stage_count - 1]->draft_model;
        x->stages = &ssp[si];
        for (uint32_t k = 0; k < p->stage_count; k++) {
            Llm__StageStatus *y = &ss[si];
            llm__stage_status__init(y);
            struct worker *w = p->stage[k];
            y->stage_index = k;
            if (w) {
                y->worker_id = w->id;
                y->layer_first = w->layer_first;
                y->layer_end = w->layer_end;
                y->backend = w->backend;
                y->device = w->device;
                y->kv_blocks_used = w->kv_used;
                y->kv_blocks_total = w->kv_total ? w->kv_total : w->kv_block_count;
                y->heartbeat_age_ms = (uint32_t)(now - w->last_seen_ms);
                y->ready = w->state == WORKER_READY || w->state == WORKER_DRAINING;
            }
            ssp[si++] = y;
            x->n_stages++;
        }
        if (pp && pp->sched) {
            struct sched_stats q;
            sched_get_stats(pp->sched, &q);
            x->running = (uint32_t)q.n_running;
            x->waiting = (uint32_t)q.n_waiting;
            x->kv_blocks_used = (uint32_t)q.blocks_used;
            x->kv_blocks_total = (uint32_t)q.blocks_total;
            x->steps_in_flight = (uint32_t)q.n_inflight;
            st.running += (uint32_t)q.n_running;
            st.kv_blocks_used += (uint64_t)q.blocks_used;
            st.kv_blocks_total += (uint64_t)q.blocks_total;
            st.preemptions_total += q.preemptions_total;
            x->prefix_cached_blocks = (uint32_t)q.blocks_cached;
            x->prefix_idle_blocks = (uint32_t)q.blocks_idle;
            x->prefix_hit_tokens = q.prefix_hit_tokens;
            x->prefix_miss_tokens = q.prefix_miss_tokens;
            x->prefix_hit_blocks = q.prefix_hit_blocks;
            x->prefix_miss_blocks = q.prefix_miss_blocks;
            x->prefix_deferred = q.prefix_deferred;
            st.prefix_cached_blocks += (uint64_t)q.blocks_cached;
            st.prefix_idle_blocks += (uint64_t)q.blocks_idle;
            st.prefix_hit_tokens += q.prefix_hit_tokens;
            st.prefix_miss_tokens += q.prefix_miss_tokens;
            st.prefix_hit_blocks += q.prefix_hit_blocks;
            st.prefix_miss_blocks += q.prefix_miss_blocks;
            st.prefix_deferred += q.prefix_deferred;
            x->kv_blocks_shared = (uint32_t)q.blocks_shared;
            x->forks = q.forks;
            x->fork_tokens = q.fork_tokens;
            st.kv_blocks_shared += (uint64_t)q.blocks_shared;
            st.forks += q.forks;
            st.fork_tokens += q.fork_tokens;
        }
        if (pp) {
            x->tokens_per_s = pp->tok_s;
            x->prompt_tokens_per_s = pp->prompt_tok_s;
        }
        psp[i] = x;
    }
    for (size_t i = 0; i < nw; i++) {
        struct worker *w = registry_worker_at(s->reg, i);
        Llm__WorkerStatus *x = &ws[i];
        llm__worker_status__init(x);
        x->worker_id = w->id;
        x->pipeline_id = w->pipeline_id;
        x->stage_index = w->stage_index;
        x->backend = w->backend;
        x->device = w->device;
        x->state = (char *)worker_state_name(w->state);
        x->heartbeat_age_ms = (uint32_t)(now - w->last_seen_ms);
        wsp[i] = x;
    }
    st.n_pipelines = np;
    st.pipelines = psp;
    st.n_workers = nw;
    st.workers = wsp;
    st.queue_depth = queue_depth(s);
    st.tokens_per_s = s->tok_s;
    st.prompt_tokens_per_s = s->prompt_tok_s;
    st.requests_total = s->requests_total;
    st.frames_rejected = proto_frames_rejected() + s->frames_bad;
    st.uptime_s = (uint64_t)((now - s->start_ms) / 1000);
    st.plan_us_mean = s->plan_n ? s->plan_us_sum / (double)s->plan_n : 0;
    st.plan_us_max = s->plan_us_max;
    st.turnaround_us_mean = s->turn_n ? s->turn_us_sum / (double)s->turn_n : 0;
    st.steps_total = s->steps_total;
    st.prefix_cache = !s->cfg.no_prefix_cache;
    Llm__ClientEnvelope env = LLM__CLIENT_ENVELOPE__INIT;
    env.tag = tag;
    env.body_case = LLM__CLIENT_ENVELOPE__BODY_STATUS_REPLY;
    env.status_reply = &st;
    server_send_client(s, ident, ident_len, &env);
done:
    free(ps);
    free(psp);
    free(ss);
    free(ssp);
    free(ws);
    free(wsp);
}

/* A frame that proto_client_unpack refused may still be a well-formed
 * envelope with a bad field (a prompt that is not UTF-8): its tag and
 * request id then go back with the error, so that the client matches it to
 * its request and reports it at once instead of waiting out its retries.
 * The id is echoed only when it is itself a valid id. */
static void frame_refused_ids(const uint8_t *buf, size_t len, uint64_t *tag, char *rid, size_t size) {
    *tag = 0;
    rid[0] = '\0';
    if (len == 0 || len > PROTO_FRAME_MAX) return;
    Llm__ClientEnvelope *env = llm__client_envelope__unpack(NULL, len, buf);
    if (!env) return;
    *tag = env->tag;
    const char *id = env->body_case == LLM__CLIENT_ENVELOPE__BODY_GENERATE && env->generate ? env->generate->request_id
                     : env->body_case == LLM__CLIENT_ENVELOPE__BODY_CANCEL && env->cancel ? env->cancel->request_id
                                                                                          : NULL;
    char err[64];
    if (id && proto_request_id_check(id, err, sizeof err) == 0) snprintf(rid, size, "%s", id);
    llm__client_envelope__free_unpacked(env, NULL);
}

void server_on_client_frame(server *s, const uint8_t *ident, size_t ident_len, const uint8_t *buf, size_t len) {
    Llm__ClientEnvelope *env = NULL;
    char err[256];
    int rc = proto_client_unpack(buf, len, &env, err, sizeof err);
    if (rc < 0) {
        uint64_t tag;
        char rid[PROTO_REQUEST_ID_MAX + 1];
        frame_refused_ids(buf, len, &tag, rid, sizeof rid);
        server_send_client_error(s, ident, ident_len, tag, proto_code_from_status(rc), rid, err, 0);
        return;
    }
    switch (env->body_case) {
    case LLM__CLIENT_ENVELOPE__BODY_GENERATE: on_generate(s, ident, ident_len, env->tag, env->generate); break;
    case LLM__CLIENT_ENVELOPE__BODY_CANCEL: on_cancel(s, ident, ident_len, env->tag, env->cancel); break;
    case LLM__CLIENT_ENVELOPE__BODY_HEALTH: on_health(s, ident, ident_len, env->tag); break;
    case LLM__CLIENT_ENVELOPE__BODY_STATUS: on_status(s, ident, ident_len, env->tag); break;
    case LLM__CLIENT_ENVELOPE__BODY_MODELS: on_models(s, ident, ident_len, env->tag); break;
    case LLM__CLIENT_ENVELOPE__BODY_DRAIN: on_drain(s, ident, ident_len, env->tag, env->drain); break;
    default:
        s->frames_bad++;
        snprintf(err, sizeof err, "client envelope body %d is a reply, not a request", (int)env->body_case);
        server_send_client_error(s, ident, ident_len, env->tag, LLM__ERROR__CODE__UNIMPLEMENTED, "", err, 0);
    }
    proto_client_free(env);
}
