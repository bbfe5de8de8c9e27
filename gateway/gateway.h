/* The OpenAI-compatible HTTP front door: a stateless libmicrohttpd server
 * that turns /v1/completions, /v1/chat/completions and /v1/models into
 * libllmclient calls on the router (one more client of it) and the answers
 * into OpenAI's JSON and Server-Sent Events.  It holds no request state
 * beyond an open HTTP connection: a client that goes away cancels its
 * request, and any number of gateways can stand behind one Service. */
#ifndef GATEWAY_GATEWAY_H
#define GATEWAY_GATEWAY_H

#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>

struct gateway_config {
    const char *listen;             /* "HOST:PORT" ("[::1]:8080"); port 0 picks a free one */
    const char *router;             /* router endpoints, comma-separated */
    /* The model file or Hugging Face directory the cluster serves, for its
     * tokenizer and chat template (chat requests need it); NULL: none. */
    const char *model_path;
    const char *model_name;         /* the name clients use for the default model; NULL: the router's id */
    const char *chat_template;      /* a family name (chat_family_from_name); NULL: the model's own */
    const char *const *api_keys;    /* accepted Bearer keys; none: open */
    size_t n_api_keys;
    int64_t max_body;               /* bytes of a request body, refused with 413 beyond */
    /* HTTP connections kept at once; when all are open, a new one closes
     * the one that has waited longest for its request (common/httpd_guard.h). */
    int max_connections;
    int max_connections_per_ip;     /* 0: no limit per client address */
    /* A request's headers and body must arrive within this many ms of its
     * connection opening or of the previous response on it. */
    int read_timeout_ms;
    int router_retry_ms;            /* libllmclient retry_ms: how long an unreachable router is waited for */
    int router_reply_timeout_ms;
    /* The metrics port (/metrics, /health, /ready; common/httpd.h): "HOST:PORT",
     * or NULL / "" for none.  metrics_optional: a port that cannot be bound
     * is a warning, not a failure to start (for a default address). */
    const char *metrics_listen;
    bool metrics_optional;
    /* /health fails once gateway_tick has not run for this long, and until
     * it first runs (common/watchdog.h); 0: no watchdog. */
    int watchdog_ms;
};

/* 127.0.0.1:8080, max_body 1 MiB, 256 connections (any number per address),
 * read timeout 10 s, retry 5 s, reply 2 s. */
void gateway_config_default(struct gateway_config *cfg);

typedef struct gateway gateway;

/* Loads the tokenizer and chat template (when model_path is set), binds the
 * listening socket and starts serving on libmicrohttpd's threads (one per
 * connection).  Strings in cfg are copied.  On failure (a bad listen
 * address, a port in use, an unreadable model, an unknown chat template
 * name) *out is NULL and err says why. */
int gateway_start(gateway **out, const struct gateway_config *cfg, char *err, size_t errlen);
/* The port it listens on (the chosen one when cfg asked for 0). */
uint16_t gateway_port(const gateway *g);
/* Stops listening, waits for the connection threads and frees g (NULL is
 * fine).  Generations still running are cancelled by their connections. */
void gateway_stop(gateway *g);

/* The supervisor's turn, for the thread that waits for signals to call
 * a few times a second: takes and releases the locks every request takes
 * (the router client pool's, the jobs', the model info's), then beats the
 * watchdog, so that a deadlock or a thread stuck holding one of them makes
 * /health fail.  It does not see one connection's thread hanging on its
 * own (the read deadline and the connection guard bound those). */
void gateway_tick(gateway *g);

/* The metrics port's port, or 0 when there is none. */
int gateway_metrics_port(const gateway *g);

/* HTTP responses sent so far with this status (100..599); 0 otherwise. */
uint64_t gateway_responses(const gateway *g, int status);

#endif
