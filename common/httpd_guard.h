/* A libmicrohttpd server's defence against clients that hold connections
 * without finishing a request (slowloris).  libmicrohttpd's own connection
 * timeout restarts with every byte, so one byte every few seconds keeps a
 * connection forever, and its connection limit then shuts everyone out.
 * The guard adds two rules:
 *
 *   - a deadline: a connection must deliver its whole request (headers and
 *     body) within read_timeout_ms of opening, or of its previous response
 *     (an idle keep-alive connection counts the same way); trickled bytes do
 *     not extend it.  Past it the connection is closed.
 *   - room for the newest: when max_connections are open, a new connection
 *     closes the one that has waited longest for its request, so a fresh
 *     client is served at once however many idle ones there are.  A
 *     connection whose request has been read (httpd_guard_busy: a response
 *     is being made or sent) is never closed by the guard; when every open
 *     connection is busy, the new one is closed instead.
 *
 * Closing is shutdown(2) on the socket: libmicrohttpd's thread sees the end
 * of the stream and closes and frees the connection itself, so the
 * descriptor stays libmicrohttpd's.
 *
 *   httpd_guard *gd;
 *   struct httpd_guard_config gc = {.name = "gateway", .max_connections = 256, .read_timeout_ms = 10000};
 *   if (httpd_guard_init(&gd, &gc, err, sizeof err) < 0) ...;
 *   d = MHD_start_daemon(..., MHD_OPTION_NOTIFY_CONNECTION, httpd_guard_notify, gd,
 *                        MHD_OPTION_CONNECTION_LIMIT, httpd_guard_mhd_limit(gd), ...);
 *   // the access handler, once the request is read:  httpd_guard_busy(conn);
 *   // the request-completed callback:                httpd_guard_idle(conn);
 *   MHD_stop_daemon(d);
 *   httpd_guard_free(gd);
 */
#ifndef COMMON_HTTPD_GUARD_H
#define COMMON_HTTPD_GUARD_H

#include <microhttpd.h>

#include <stddef.h>
#include <stdint.h>

typedef struct httpd_guard httpd_guard;

struct httpd_guard_config {
    const char *name;          /* for log lines ("gateway", "metrics port 127.0.0.1:9464"); copied */
    unsigned max_connections;  /* >= 1 */
    unsigned read_timeout_ms;  /* >= 1 */
};

/* Starts the guard's timer thread.  0, or STATUS_BAD_INPUT (a zero limit,
 * named in err) or STATUS_INTERNAL / STATUS_NO_MEMORY. */
int httpd_guard_init(httpd_guard **out, const struct httpd_guard_config *c, char *err, size_t errlen);
/* Stops the thread and frees gd (NULL is fine).  Call it after
 * MHD_stop_daemon, which reports every connection closed first. */
void httpd_guard_free(httpd_guard *gd);

/* The MHD_OPTION_CONNECTION_LIMIT to give the daemon: above
 * max_connections, so that libmicrohttpd accepts the connection that makes
 * the guard close an older one. */
unsigned httpd_guard_mhd_limit(const httpd_guard *gd);

/* The MHD_OPTION_NOTIFY_CONNECTION callback; its cls is the guard. */
void httpd_guard_notify(void *cls, struct MHD_Connection *conn, void **socket_context,
                        enum MHD_ConnectionNotificationCode code);

/* conn's request has been read: the guard leaves it alone until
 * httpd_guard_idle.  Either may be called from any thread. */
void httpd_guard_busy(struct MHD_Connection *conn);
/* conn's response has ended: its deadline for the next request starts now. */
void httpd_guard_idle(struct MHD_Connection *conn);

/* Connections the guard has closed so far: past the deadline, and to make
 * room for a newer one.  Either pointer may be NULL. */
void httpd_guard_closed(httpd_guard *gd, uint64_t *late, uint64_t *evicted);

#endif
