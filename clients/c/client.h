/* libllmclient: the C client of the cluster's router (docs/protocol.md).
 * It talks to one of several router endpoints over a ZeroMQ DEALER socket,
 * streams a generation to a callback, and survives a broken connection or a
 * router restart: it reconnects (to the same or the next endpoint) and
 * re-attaches by request id with resume_from = the tokens it already has, so
 * the callback sees every completion token exactly once.
 *
 *   const char *eps[] = {"tcp://127.0.0.1:5555"};
 *   struct llm_client_config cfg;
 *   llm_client_config_default(&cfg);
 *   cfg.endpoints = eps; cfg.n_endpoints = 1;
 *   cfg.curve_key_file = "keys/client.key";    // or LLM_CURVE_KEY_FILE
 *   cfg.router_key_file = "keys/router.pub";   // or LLM_ROUTER_KEY
 *   llm_client *c;
 *   if (llm_client_open(&c, &cfg, err, sizeof err) < 0) ...;
 *   struct llm_generate_params p;
 *   llm_generate_params_default(&p);
 *   p.prompt = "Once upon a time"; p.max_tokens = 64;
 *   struct llm_generate_result r;
 *   int rc = llm_client_generate(c, &p, on_chunk, ud, &r);
 *   if (rc < 0) fprintf(stderr, "%s\n", llm_client_errstr(c));
 *   else if (r.finish_reason == LLM__GENERATE_DONE__FINISH_REASON__ERROR) ...;
 *   llm_client_close(c);
 *
 * One client is used by one thread at a time (a ZeroMQ socket rule); run
 * requests concurrently with one client per thread, sharing a ZeroMQ
 * context through cfg.zmq_ctx if there are many. */
#ifndef CLIENTS_C_CLIENT_H
#define CLIENTS_C_CLIENT_H

#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>

#include "common/sampling.h"
#include "proto/request.h"
#include "proto/wire.h"

typedef struct llm_client llm_client;

struct llm_client_config {
    /* Router client endpoints ("tcp://host:5555"), tried in this order and
     * then round again.  The strings are copied by llm_client_open. */
    const char *const *endpoints;
    size_t n_endpoints;
    /* ZeroMQ context to open sockets on; NULL: the client makes its own
     * and ends it in llm_client_close.  A shared one must outlive the client. */
    void *zmq_ctx;
    /* How long to wait for the direct reply to a request (Accepted, a
     * HealthReply, ...) before the endpoint counts as unreachable and the
     * client moves on to the next one. */
    int reply_timeout_ms;
    /* During a generation: how long a silent connection is trusted.  After
     * that the client re-sends the request (a re-attach: no work is
     * repeated), which also finds a router that lost the connection. */
    int idle_timeout_ms;
    /* How long a call keeps trying without progress before it gives up:
     * while no router answers (STATUS_UNAVAILABLE), or while routers answer
     * only that they cannot serve the request now (their UNAVAILABLE or
     * retry_after_ms; that error is returned), or when a generation was
     * accepted but made no progress (STATUS_TIMEOUT).  Progress is an
     * acceptance (also a re-attach's) or new tokens.  A router's
     * UNAVAILABLE (no worker, no pipeline, no Redis) sends the call on to
     * the next endpoint at once; the call waits the router's retry_after_ms
     * only when every endpoint said UNAVAILABLE in a row. */
    int retry_ms;
    /* ZMTP heartbeat: a peer that answers no ping for this long counts as
     * gone (finds a dead host whose TCP connection never closed); 0: off. */
    int heartbeat_ms;
    /* CURVE (docs/security.md): this client's key pair file (NAME.key) and
     * the router's public key file (NAME.pub); or insecure, for a router
     * that runs --insecure.  When curve_key_file is NULL or "" and insecure
     * is false, llm_client_open takes all three from the environment:
     * LLM_CURVE_KEY_FILE, LLM_ROUTER_KEY, LLM_INSECURE (true/1/yes/on); with
     * neither keys nor insecure it refuses, naming them. */
    const char *curve_key_file;
    const char *router_key_file;
    bool insecure;
};

/* reply_timeout 5 s, idle_timeout 30 s, retry 60 s, heartbeat 2 s, no
 * endpoints, no keys (the environment's, see above). */
void llm_client_config_default(struct llm_client_config *cfg);

/* On success *out is the caller's, freed with llm_client_close.  No
 * connection is made yet (ZeroMQ connects in the background), so an
 * unreachable router shows up in the first call, not here (a router that
 * refuses the client's key too: the call's error then says so).  On
 * failure (no endpoints, a malformed endpoint, no keys and not insecure, a
 * key file that does not load: STATUS_BAD_INPUT or STATUS_NOT_FOUND;
 * ZeroMQ failures)
 * *out is NULL and err says why. */
int llm_client_open(llm_client **out, const struct llm_client_config *cfg, char *err,
                    size_t errlen);
/* NULL is fine.  A generation still running on the router keeps running
 * (re-attach to it from another client by its id). */
void llm_client_close(llm_client *c);

/* The last failure of a call on c: a message naming the endpoint, the
 * request id and, for a router's Error reply, its code ("INVALID_ARGUMENT:
 * sampling.top_p = 1.5 is outside [0, 1]").  Owned by c, valid until the
 * next call. */
const char *llm_client_errstr(const llm_client *c);
/* The code of the router's Error behind the last failure, or OK when the
 * failure was the client's own (a timeout, ZeroMQ). */
Llm__Error__Code llm_client_error_code(const llm_client *c);
/* The retry_after_ms of the router's Error behind the last failure: how
 * long to wait before trying again (a full queue, no pipeline in service
 * yet); 0 when the router gave none (a request that can never fit, a bad
 * field) or the failure was the client's own. */
uint32_t llm_client_retry_after_ms(const llm_client *c);
/* The reason of the router's Error behind the last failure
 * (proto/types.proto Error.reason: "context_length_exceeded" when the
 * prompt alone fills the model's context), or "" (owned by c). */
const char *llm_client_error_reason(const llm_client *c);
/* The endpoint the client talks to now (owned by c). */
const char *llm_client_endpoint(const llm_client *c);
/* Connections opened after the first one: reconnects, for tests and logs. */
uint32_t llm_client_reconnects(const llm_client *c);

/* --- Generation ----------------------------------------------------------- */

struct llm_generate_params {
    /* 1..PROTO_REQUEST_ID_MAX printable ASCII bytes; NULL or "": the client
     * makes a random UUID (read it from llm_generate_result.request_id). */
    const char *request_id;
    const char *model;              /* NULL or "": the cluster's default */
    /* Exactly one of: text (the router tokenizes it) or token ids. */
    const char *prompt;
    const int32_t *prompt_tokens;
    size_t n_prompt_tokens;
    uint32_t max_tokens;            /* 0: until a stop or the context ends */
    struct sampling_params sampling;
    /* Constrained decoding (docs/grammar.md), at most one; NULL/false: none.
     * json_schema: a JSON Schema's text; json_object: any JSON object;
     * grammar: GBNF text whose start rule is root. */
    const char *json_schema;
    bool json_object;
    const char *grammar;
    const char *const *stop;        /* stop strings */
    size_t n_stop;
    int32_t priority;               /* -100..100 */
    int64_t deadline_ms;            /* absolute Unix ms; 0: none */
    uint32_t timeout_ms;            /* relative to acceptance; 0: none */
    bool stream;                    /* false: one chunk just before done */
    /* Choices (completions) of the prompt: 0 and 1 mean one, at most
     * PROTO_N_MAX.  Choice i samples with proto_choice_seed(seed, i), the
     * choices share the prompt's KV blocks, and the call returns once
     * every choice is done (docs/protocol.md, "Several choices"). */
    uint32_t n;
    /* The client's own bound on the whole call, re-attaches included:
     * after this long it returns STATUS_TIMEOUT (the request itself goes
     * on in the cluster; re-attach or cancel it by id); 0: no bound. */
    int64_t wait_ms;
    /* Speculative decoding for this request (docs/router.md,
     * "Speculation"): a GenerateRequest.Spec value, 0 (LLM__GENERATE_REQUEST__SPEC__SPEC_DEFAULT):
     * the router's --spec; spec_tokens 0: the router's --spec-tokens. */
    int32_t spec;
    uint32_t spec_tokens;
    /* Predicted output (GenerateRequest.prediction; docs/router.md,
     * "Predicted outputs"): text the completion is expected to repeat,
     * drafted from by prompt lookup; NULL or "": none.  At most
     * PROTO_PREDICTION_BYTES_MAX bytes.  Borrowed for the call. */
    const char *prediction;
    /* Or the prediction as token ids (not both): drafted from as given.
     * At most PROTO_PREDICTION_TOKENS_MAX.  Borrowed for the call. */
    const int32_t *prediction_tokens;
    size_t n_prediction_tokens;
};
/* Greedy, streaming, nothing else set. */
void llm_generate_params_default(struct llm_generate_params *p);

/* A token's text (TokenLogprob.text, docs/protocol.md): the bytes it adds
 * to the output text, text_len of them, not NUL-terminated; a token may
 * hold part of a UTF-8 character, the rest coming with the next tokens. */
struct llm_top_logprob {
    int32_t token;
    float logprob;
    const char *text;
    size_t text_len;
};
struct llm_token_logprob {
    int32_t token;
    float logprob;                  /* log-softmax after penalties, before temperature */
    const char *text;
    size_t text_len;
    const struct llm_top_logprob *top; /* most likely first, n_top of them */
    size_t n_top;
};

/* Tokens as they arrive, each exactly once and in order.  Every pointer is
 * valid during the call only. */
struct llm_chunk {
    const char *request_id;
    uint32_t choice;                /* which choice (0 .. n-1) the tokens are */
    uint32_t index;                 /* position of token_ids[0] among the completion tokens */
    const int32_t *token_ids;
    size_t n_tokens;
    const char *text;               /* whole UTF-8 characters, NUL-terminated */
    size_t text_len;
    /* When the request asked for logprobs (sampling.logprobs): one per
     * token_ids entry; otherwise NULL and 0. */
    const struct llm_token_logprob *logprobs;
    size_t n_logprobs;
};
/* Return 0 to go on; anything else cancels the request (the client sends a
 * Cancel and waits for the GenerateDone, which then says CANCELLED unless
 * the request had already finished). */
typedef int (*llm_chunk_fn)(void *ud, const struct llm_chunk *chunk);

struct llm_generate_result {
    char request_id[PROTO_REQUEST_ID_MAX + 1];
    bool reattached;                /* the router already knew the id */
    uint64_t seed;                  /* the seed in use */
    uint32_t queue_position;
    /* The completion tokens the request may make (GenerateAccepted.max_tokens):
     * the params' max_tokens, or less when the router clamped it to the
     * context left after the prompt (also for max_tokens 0); 0 from a router
     * that does not say. */
    uint32_t max_tokens;
    /* The prompt's ids as the router tokenized them (malloc'ed, or NULL
     * when the router did not send them); free with llm_generate_result_free. */
    int32_t *prompt_ids;
    size_t n_prompt_ids;
    /* From GenerateDone: */
    Llm__GenerateDone__FinishReason finish_reason;
    uint32_t prompt_tokens, completion_tokens;
    /* A request with a prediction: the prediction's drafts the cluster
     * accepted and rejected (GenerateDone.Usage; OpenAI's
     * accepted_prediction_tokens / rejected_prediction_tokens); 0 without
     * one or from an older router. */
    uint32_t accepted_prediction_tokens, rejected_prediction_tokens;
    int32_t stop_token;
    char stop_string[PROTO_STOP_STRING_BYTES_MAX + 1];
    Llm__Error__Code error_code;    /* when finish_reason is ERROR (or details of others) */
    char error_message[512];
    /* Bookkeeping of this call: */
    uint32_t tokens_received;       /* tokens passed to the callback */
    uint32_t reattaches;            /* requests re-sent after a broken or silent connection, a gap in
                                     * the stream or an end that came before all its tokens */
    uint32_t duplicates_dropped;    /* replayed tokens the callback did not see again */
    /* When the call failed on the router's refusal: the wait it asked for
     * before a retry (Error.retry_after_ms; 0: retrying will not help, or
     * no refusal).  Also llm_client_retry_after_ms. */
    uint32_t retry_after_ms;
    /* n > 1: each choice's end, n_choices of them (malloc'ed, freed by
     * llm_generate_result_free); the GenerateDone fields above are choice
     * 0's, tokens_received counts every choice.  n <= 1: NULL, n_choices
     * 1, the fields above are the one choice's. */
    struct llm_choice_done *choices;
    uint32_t n_choices;
};
struct llm_choice_done {
    Llm__GenerateDone__FinishReason finish_reason;
    uint32_t completion_tokens;
    uint32_t accepted_prediction_tokens, rejected_prediction_tokens;
    int32_t stop_token;
    char stop_string[PROTO_STOP_STRING_BYTES_MAX + 1];
    Llm__Error__Code error_code;
    char error_message[512];
};
/* Frees prompt_ids and choices; the result can then be reused.  NULL is
 * fine. */
void llm_generate_result_free(struct llm_generate_result *r);

/* Runs one request to its end: sends it, streams its tokens to on_chunk
 * (may be NULL), and returns when its GenerateDone arrives.  *res is
 * overwritten (free it with llm_generate_result_free, also after a
 * failure).  Sending an id the router knows re-attaches to that request.
 * Returns 0 once the GenerateDone arrived: look at res->finish_reason
 * (STOP, LENGTH, CANCELLED, DEADLINE, or ERROR with res->error_code).
 * Returns a negative status when the router refused the request (its Error
 * reply, mapped with proto_status_from_code; llm_client_error_code tells
 * the wire code) — then on_chunk never ran — or when no router could be
 * reached for cfg.retry_ms (STATUS_UNAVAILABLE / STATUS_TIMEOUT) or
 * p->wait_ms passed (STATUS_TIMEOUT), which may happen after some chunks
 * were delivered.  An UNAVAILABLE is retried on the next endpoint at once,
 * and an Error with retry_after_ms set (or UNAVAILABLE from every endpoint
 * in a row) after that wait, within cfg.retry_ms.  A prompt that is not
 * valid UTF-8 fails at once with STATUS_BAD_INPUT (INVALID_ARGUMENT), as
 * does one that fills the whole context (llm_client_error_reason says
 * "context_length_exceeded"); a max_tokens past the context is clamped
 * (res->max_tokens), not refused. */
int llm_client_generate(llm_client *c, const struct llm_generate_params *p,
                        llm_chunk_fn on_chunk, void *ud, struct llm_generate_result *res);

/* Cancels a request by id (from any connection) and waits for its
 * GenerateDone, which fills *res when res is not NULL (res->finish_reason
 * is CANCELLED, or the real reason when it had already finished).
 * STATUS_NOT_FOUND when the router does not know the id. */
int llm_client_cancel(llm_client *c, const char *request_id, struct llm_generate_result *res);

/* --- Health, Status, Models ------------------------------------------------
 * Each sends its request and waits for the reply (trying the endpoints in
 * turn within cfg.retry_ms).  On success *reply is a decoded envelope whose
 * body is the reply ((*reply)->health_reply, ->status_reply,
 * ->models_reply), owned by the caller: free it with proto_client_free.
 * On failure *reply is NULL. */
int llm_client_health(llm_client *c, Llm__ClientEnvelope **reply);
int llm_client_status(llm_client *c, Llm__ClientEnvelope **reply);
int llm_client_models(llm_client *c, Llm__ClientEnvelope **reply);
/* Admin: drains pipelines ids[0..n) (resume false: no new work goes to
 * them, their running sequences finish there) or puts them back (resume
 * true); the same way, (*reply)->drain_reply says per pipeline whether it
 * is idle.  Send it again to follow the drain.  Needs a key in the router's
 * --admin-keys: otherwise the router's PERMISSION_DENIED comes back as
 * STATUS_BAD_INPUT with llm_client_errstr naming the reason. */
int llm_client_drain(llm_client *c, const uint32_t *ids, size_t n, bool resume, Llm__ClientEnvelope **reply);

/* Whether a router answers at all: asks the endpoints for Health, in turn,
 * for at most timeout_ms in all (whatever the config's timeouts).  Returns
 * 0 when one answered (serving or not; the client then stays on it), or
 * STATUS_UNAVAILABLE with llm_client_errstr naming the endpoints tried.
 * For a caller that wants to say "no router here" in seconds rather than
 * after cfg.retry_ms. */
int llm_client_probe(llm_client *c, int timeout_ms);

/* "STOP", "LENGTH", ...; static. */
const char *llm_finish_reason_name(Llm__GenerateDone__FinishReason r);

#endif
