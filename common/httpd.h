/* The metrics port: a small HTTP server (libmicrohttpd, in its own thread)
 * that every long-running process starts beside its real work, for
 * Prometheus and for Kubernetes probes:
 *
 *   GET /metrics  200, the registry in the Prometheus text format
 *   GET /health   200 "ok": the process is alive (and, with a health callback,
 *                 its loops turn: common/watchdog.h), or 503 "unhealthy: <reason>"
 *   GET /ready    200 "ready", or 503 "not ready: <reason>"
 *
 * Any other path gets 404, any method but GET and HEAD 405.  It lives in its
 * own library (llmhttpd) so that only the programs that serve it link
 * libmicrohttpd.
 *
 *   struct httpd_config c = {.listen = "127.0.0.1:9464", .registry = m,
 *                            .ready = my_ready, .ready_ud = state};
 *   httpd *h;
 *   if (httpd_start(&h, &c, err, sizeof err) < 0) { fprintf(stderr, "--metrics-listen: %s\n", err); ... }
 *   ...
 *   httpd_stop(h); */
#ifndef COMMON_HTTPD_H
#define COMMON_HTTPD_H

#include "metrics.h"

#include <stddef.h>

typedef struct httpd httpd;

/* Called before each /metrics render, to set gauges that are read rather
 * than updated (queue lengths, memory in use).  Runs on the server's thread,
 * concurrently with the process's own threads. */
typedef void (*httpd_refresh_fn)(void *ud);

/* Called for each /ready: NULL when the process is serving, else a short
 * reason (written into buf, or a string that outlives the call) that the
 * 503 reply carries.  Runs on the server's thread. */
typedef const char *(*httpd_ready_fn)(void *ud, char *buf, size_t size);

/* Called for each /health, the same way: NULL while the process is alive,
 * else the reason for a 503 (watchdog_health is one).  Runs on the
 * server's thread. */
typedef const char *(*httpd_health_fn)(void *ud, char *buf, size_t size);

struct httpd_config {
    const char *listen;        /* "HOST:PORT": an IPv4 address, a host name, "[IPv6]",
                                  or "*" / empty host for every interface; port 0
                                  picks a free one (see httpd_port) */
    metrics *registry;         /* rendered by /metrics; the caller's, must outlive
                                  the server; NULL: /metrics renders nothing */
    httpd_refresh_fn refresh;  /* may be NULL */
    void *refresh_ud;
    httpd_ready_fn ready;      /* may be NULL: ready whenever alive */
    void *ready_ud;
    httpd_health_fn health;    /* may be NULL: healthy whenever the port answers */
    void *health_ud;
};

/* Binds c->listen and starts serving on a thread of its own.  Returns 0 and
 * *out; STATUS_BAD_INPUT with a message in err naming the address for an
 * address that does not parse or resolve; STATUS_IO (naming the address and
 * the system's reason) when it cannot be bound; STATUS_INTERNAL when
 * libmicrohttpd fails to start; STATUS_NO_MEMORY.  On failure no callback
 * ever runs and nothing is left open. */
int httpd_start(httpd **out, const struct httpd_config *c, char *err, size_t errlen);

/* The port the server listens on (the chosen one when c->listen asked for 0). */
int httpd_port(const httpd *h);

/* Stops the thread (a callback in progress finishes first), closes the port
 * and frees h (NULL is a no-op).  The registry is left to the caller. */
void httpd_stop(httpd *h);

#endif
