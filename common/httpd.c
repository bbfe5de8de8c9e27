/* The metrics port's HTTP server: /metrics, /health and /ready on
 * libmicrohttpd's own thread, behind a slow-client guard (httpd_guard.h). */
#include "httpd.h"
#include "httpd_guard.h"
#include "log.h"
#include "status.h"

#include <microhttpd.h>

#include <netdb.h>
#include <netinet/in.h>
#include <pthread.h>
#include <stdarg.h>
#include <stdbool.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/socket.h>

/* Scrapes and probes are small and few.  A request must arrive whole
 * within HTTPD_READ_TIMEOUT_MS of its connection opening (or of the previous
 * response), and when HTTPD_CONNECTIONS_MAX are open a new connection closes
 * the one that has waited longest: idle or trickling clients, however many,
 * cannot keep a liveness probe out (httpd_guard.h).  HTTPD_TIMEOUT_S is
 * libmicrohttpd's own inactivity limit, for a response nobody reads. */
#define HTTPD_CONNECTIONS_MAX 32
#define HTTPD_READ_TIMEOUT_MS 5000
#define HTTPD_TIMEOUT_S 10

struct httpd {
    struct httpd_config c;
    char listen[256];        /* c.listen, copied, for log lines */
    struct MHD_Daemon *d;
    httpd_guard *guard;
    int port;
    /* libmicrohttpd reports why it could not start (a bind that failed) only
     * through its logger; while starting, the first message is kept here. */
    pthread_mutex_t log_lock;
    bool starting;
    char start_err[256];
};

static void httpd_log(void *cls, const char *fmt, va_list ap) {
    struct httpd *h = cls;
    char line[256];
    vsnprintf(line, sizeof line, fmt, ap);
    size_t n = strlen(line);
    while (n && (line[n - 1] == '\n' || line[n - 1] == '\r')) line[--n] = 0;
    pthread_mutex_lock(&h->log_lock);
    bool keep = h->starting && !h->start_err[0];
    if (keep) snprintf(h->start_err, sizeof h->start_err, "%s", line);
    pthread_mutex_unlock(&h->log_lock);
    if (!keep) LOG(httpd_guard_log_level(line), "metrics port %s: %s", h->listen, line);
}

static enum MHD_Result reply(struct MHD_Connection *conn, unsigned code, const char *type,
                             char *body, size_t len, enum MHD_ResponseMemoryMode mode,
                             const char *allow) {
    struct MHD_Response *r = MHD_create_response_from_buffer(len, body, mode);
    if (!r) {
        if (mode == MHD_RESPMEM_MUST_FREE) free(body);
        return MHD_NO;
    }
    MHD_add_response_header(r, MHD_HTTP_HEADER_CONTENT_TYPE, type);
    if (allow) MHD_add_response_header(r, MHD_HTTP_HEADER_ALLOW, allow);
    enum MHD_Result ret = MHD_queue_response(conn, code, r);
    MHD_destroy_response(r);
    return ret;
}

static enum MHD_Result reply_text(struct MHD_Connection *conn, unsigned code, const char *allow,
                                  const char *fmt, ...) __attribute__((format(printf, 4, 5)));

static enum MHD_Result reply_text(struct MHD_Connection *conn, unsigned code, const char *allow,
                                  const char *fmt, ...) {
    char body[512];
    va_list ap;
    va_start(ap, fmt);
    vsnprintf(body, sizeof body, fmt, ap);
    va_end(ap);
    return reply(conn, code, "text/plain; charset=utf-8", body, strlen(body),
                 MHD_RESPMEM_MUST_COPY, allow);
}

/* A request's method and path are the client's: they are printed with %.*s
 * bounds so that a long one cannot crowd out the reply. */
static enum MHD_Result handle(void *cls, struct MHD_Connection *conn, const char *url,
                              const char *method, const char *version, const char *upload,
                              size_t *upload_size, void **con_cls) {
    struct httpd *h = cls;
    /* One reply per request, queued on the first call.  A body (from a
     * method we refuse anyway) is never read: libmicrohttpd closes the
     * connection after the reply instead. */
    if (*con_cls) return MHD_NO;
    *con_cls = h;
    httpd_guard_busy(conn);
    bool get = strcmp(method, MHD_HTTP_METHOD_GET) == 0 || strcmp(method, MHD_HTTP_METHOD_HEAD) == 0;
    bool known = strcmp(url, "/metrics") == 0 || strcmp(url, "/health") == 0 ||
                 strcmp(url, "/ready") == 0;
    if (!known)
        return reply_text(conn, MHD_HTTP_NOT_FOUND, NULL,
                          "not found: %.200s (this port serves /metrics, /health and /ready)\n",
                          url);
    if (!get)
        return reply_text(conn, MHD_HTTP_METHOD_NOT_ALLOWED, "GET, HEAD",
                          "method %.32s not allowed on %s: use GET\n", method, url);
    if (strcmp(url, "/health") == 0) {
        char buf[256] = "";
        const char *why = h->c.health ? h->c.health(h->c.health_ud, buf, sizeof buf) : NULL;
        if (!why) return reply_text(conn, MHD_HTTP_OK, NULL, "ok\n");
        return reply_text(conn, MHD_HTTP_SERVICE_UNAVAILABLE, NULL, "unhealthy: %.255s\n", why);
    }
    if (strcmp(url, "/ready") == 0) {
        char buf[256] = "";
        const char *why = h->c.ready ? h->c.ready(h->c.ready_ud, buf, sizeof buf) : NULL;
        if (!why) return reply_text(conn, MHD_HTTP_OK, NULL, "ready\n");
        return reply_text(conn, MHD_HTTP_SERVICE_UNAVAILABLE, NULL, "not ready: %.255s\n", why);
    }
    if (h->c.refresh) h->c.refresh(h->c.refresh_ud);
    char *text = NULL;
    size_t len = 0;
    if (h->c.registry) {
        if (metrics_render(h->c.registry, &text, &len) < 0)
            return reply_text(conn, MHD_HTTP_INTERNAL_SERVER_ERROR, NULL,
                              "metrics: out of memory while rendering\n");
    } else if (!(text = calloc(1, 1))) {
        return MHD_NO;
    }
    return reply(conn, MHD_HTTP_OK, "text/plain; version=0.0.4; charset=utf-8", text, len,
                 MHD_RESPMEM_MUST_FREE, NULL);
}

/* The response has gone (or the request ended otherwise): the connection's
 * deadline for its next request starts. */
static void completed(void *cls, struct MHD_Connection *conn, void **con_cls,
                      enum MHD_RequestTerminationCode toe) {
    (void)cls;
    (void)con_cls;
    (void)toe;
    httpd_guard_idle(conn);
}

/* "HOST:PORT" into a socket address.  The port is the text after the last
 * colon; a host in brackets is an IPv6 address; "*" or nothing is every
 * IPv4 interface. */
static int parse_listen(const char *listen, struct sockaddr_storage *sa, uint16_t *port_out,
                        char *err, size_t errlen) {
    const char *colon = strrchr(listen, ':');
    if (!colon) {
        snprintf(err, errlen, "listen address '%s': expected HOST:PORT", listen);
        return STATUS_BAD_INPUT;
    }
    const char *p = colon + 1;
    long port = 0;
    if (!*p || strlen(p) > 5) goto bad_port;
    for (; *p; p++) {
        if (*p < '0' || *p > '9') goto bad_port;
        port = port * 10 + (*p - '0');
    }
    if (port > 65535) goto bad_port;

    char host[256];
    size_t n = (size_t)(colon - listen);
    if (n >= sizeof host) {
        snprintf(err, errlen, "listen address '%.64s...': the host is too long", listen);
        return STATUS_BAD_INPUT;
    }
    memcpy(host, listen, n);
    host[n] = 0;
    const char *node = host;
    if (n >= 2 && host[0] == '[' && host[n - 1] == ']') {
        host[n - 1] = 0;
        node = host + 1;
    } else if (n == 0 || strcmp(host, "*") == 0) {
        node = "0.0.0.0";
    } else if (strchr(host, ':')) {
        snprintf(err, errlen, "listen address '%s': write an IPv6 host in brackets, [%s]:%ld",
                 listen, host, port);
        return STATUS_BAD_INPUT;
    }
    struct addrinfo hints = {0}, *res = NULL;
    hints.ai_family = AF_UNSPEC;
    hints.ai_socktype = SOCK_STREAM;
    hints.ai_flags = AI_PASSIVE | AI_NUMERICSERV;
    char service[24];
    snprintf(service, sizeof service, "%ld", port);
    int rc = getaddrinfo(node, service, &hints, &res);
    if (rc != 0 || !res) {
        snprintf(err, errlen, "listen address '%s': host '%s' does not resolve: %s", listen, node,
                 rc ? gai_strerror(rc) : "no address");
        return STATUS_BAD_INPUT;
    }
    memset(sa, 0, sizeof *sa);
    memcpy(sa, res->ai_addr, res->ai_addrlen);
    freeaddrinfo(res);
    *port_out = (uint16_t)port;
    return STATUS_OK;
bad_port:
    snprintf(err, errlen, "listen address '%s': port '%s' is not a number in 0..65535", listen,
             colon + 1);
    return STATUS_BAD_INPUT;
}

int httpd_start(httpd **out, const struct httpd_config *c, char *err, size_t errlen) {
    const char *listen = c->listen ? c->listen : "";
    struct sockaddr_storage sa;
    uint16_t port;
    int rc = parse_listen(listen, &sa, &port, err, errlen);
    if (rc < 0) return rc;
    struct httpd *h = calloc(1, sizeof *h);
    if (!h) {
        snprintf(err, errlen, "listen address '%s': out of memory", listen);
        return STATUS_NO_MEMORY;
    }
    h->c = *c;
    snprintf(h->listen, sizeof h->listen, "%s", listen);
    pthread_mutex_init(&h->log_lock, NULL);
    char gname[300];
    snprintf(gname, sizeof gname, "metrics port %s", listen);
    struct httpd_guard_config gc = {.name = gname, .max_connections = HTTPD_CONNECTIONS_MAX,
                                    .read_timeout_ms = HTTPD_READ_TIMEOUT_MS};
    rc = httpd_guard_init(&h->guard, &gc, err, errlen);
    if (rc < 0) {
        pthread_mutex_destroy(&h->log_lock);
        free(h);
        return rc;
    }
    h->starting = true;
    unsigned flags = MHD_USE_AUTO_INTERNAL_THREAD | MHD_USE_ERROR_LOG;
    if (sa.ss_family == AF_INET6) flags |= MHD_USE_IPv6;
    /* The address (with its port) is the one to bind; the port argument
     * only appears in libmicrohttpd's messages.  The logger comes first so
     * that messages about the options reach it. */
    h->d = MHD_start_daemon(flags, port, NULL, NULL, handle, h,
                            MHD_OPTION_EXTERNAL_LOGGER, httpd_log, h,
                            MHD_OPTION_SOCK_ADDR, (struct sockaddr *)&sa,
                            MHD_OPTION_CONNECTION_LIMIT, httpd_guard_mhd_limit(h->guard),
                            MHD_OPTION_CONNECTION_TIMEOUT, (unsigned)HTTPD_TIMEOUT_S,
                            MHD_OPTION_NOTIFY_CONNECTION, httpd_guard_notify, h->guard,
                            MHD_OPTION_NOTIFY_COMPLETED, completed, h,
                            MHD_OPTION_END);
    pthread_mutex_lock(&h->log_lock);
    h->starting = false;
    pthread_mutex_unlock(&h->log_lock);
    if (!h->d) {
        if (h->start_err[0])
            snprintf(err, errlen, "listen address '%s': cannot serve: %s", listen, h->start_err);
        else
            snprintf(err, errlen, "listen address '%s': libmicrohttpd could not start", listen);
        /* A taken port shows as a failed bind or, where the bind went
         * through, as a failed listen: both are the operating system's
         * refusal, which callers may tell from a bad configuration. */
        bool bind_failed = strstr(h->start_err, "bind") != NULL || strstr(h->start_err, "listen") != NULL ||
                           strstr(h->start_err, "in use") != NULL;
        httpd_guard_free(h->guard);
        pthread_mutex_destroy(&h->log_lock);
        free(h);
        return bind_failed ? STATUS_IO : STATUS_INTERNAL;
    }
    httpd_guard_listening(h->guard, h->d);
    const union MHD_DaemonInfo *info = MHD_get_daemon_info(h->d, MHD_DAEMON_INFO_BIND_PORT);
    h->port = info ? (int)info->port : 0;
    h->c.listen = h->listen;
    *out = h;
    return STATUS_OK;
}

int httpd_port(const httpd *h) { return h->port; }

void httpd_stop(httpd *h) {
    if (!h) return;
    MHD_stop_daemon(h->d);
    httpd_guard_free(h->guard);
    pthread_mutex_destroy(&h->log_lock);
    free(h);
}
