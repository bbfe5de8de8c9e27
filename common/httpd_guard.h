/* A libmicrohttpd server's defence against clients that hold connections
 * without finishing a request (slowloris).  libmicrohttpd's own connection
 * timeout restarts with every byte, so one byte every few seconds keeps a
 * connection forever, and its connection limit then shuts everyone out.
 * The guard adds three rules:
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
 *   - no connection before its first bytes (httpd_guard_listening): the
 *     kernel hands the daemon a connection once data has arrived on it, so
 *     a client that has connected but not yet written its request (its
 *     process descheduled on a busy node) is not the oldest idle connection
 *     when a flood of newer ones arrives, and connections that never send
 *     a byte wait outside the daemon for up to read_timeout_ms.
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
 *   httpd_guard_listening(gd, d);
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

/* Sets TCP_DEFER_ACCEPT on d's listening socket (Linux), for at most
 * read_timeout_ms.  Where the system refuses it, a warning is logged and d
 * serves without it: the other two rules still hold. */
void httpd_guard_listening(httpd_guard *gd, struct MHD_Daemon *d);

/* The MHD_OPTION_NOTIFY_CONNECTION callback; its cls is the guard. */
void httpd_guard_notify(void *cls, struct MHD_Connection *conn, void **socket_context,
                        enum MHD_ConnectionNotificationCode code);

/* conn's request has been read: the guard leaves it alone until
 * httpd_guard_idle.  Either may be called from any thread. */
void httpd_guard_busy(struct MHD_Connection *conn);
/* conn's response has ended: its deadline for the next request starts now. */
void httpd_guard_idle(struct MHD_Connection *conn);

/* The log level (log.h) for a libmicrohttpd message: LL_DEBUG for a client that
 * hung up mid-request or one the guard closed (reported on every
 * occurrence, so that a slowloris cannot flood the log), else LL_WARN. */
int httpd_guard_log_level(const char *mhd_message);

/* Connections the guard has closed so far: past the deadline, and to make
 * room for a newer one.  Either pointer may be NULL. */
void httpd_guard_closed(httpd_guard *gd, uint64_t *late, uint64_t *evicted);

#endif
