/* The slow-client guard of a libmicrohttpd server: a list of its open
 * connections with the time each started waiting for its request, a timer
 * thread that closes the ones past the deadline, and the room-for-the-newest
 * rule applied as each connection opens. */
#include "httpd_guard.h"
#include "log.h"
#include "status.h"

#include <errno.h>
#include <netinet/in.h>
#include <netinet/tcp.h>
#include <pthread.h>
#include <stdbool.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/socket.h>
#include <time.h>

/* How often the deadline is looked at, at most: a connection is closed
 * within this much after its deadline. */
#define GUARD_TICK_MS_MAX 250
/* Closings are logged as one summary line at most this often. */
#define GUARD_LOG_MS 10000

struct guard_conn {
    httpd_guard *gd;
    int fd;
    int64_t since_ms;  /* monotonic: opened, or its last response ended */
    bool busy;         /* its request has been read */
    bool closing;      /* shut down by the guard, not yet reported closed */
    struct guard_conn *prev, *next;
};

struct httpd_guard {
    char name[128];
    unsigned max_connections, read_timeout_ms;
    pthread_mutex_t mu;
    pthread_cond_t cv;            /* under mu: stop */
    pthread_t timer;
    bool stop;
    struct guard_conn *head;      /* every open connection */
    unsigned n_open, n_closing;
    uint64_t late, evicted, refused;
    uint64_t logged_late, logged_evicted, logged_refused;
    int64_t logged_ms;
};

static int64_t guard_now_ms(void) {
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (int64_t)ts.tv_sec * 1000 + ts.tv_nsec / 1000000;
}

/* Called with mu held. */
static void guard_shut(httpd_guard *gd, struct guard_conn *c) {
    c->closing = true;
    gd->n_closing++;
    /* The descriptor is still open: libmicrohttpd closes it only after it
     * has told httpd_guard_notify (which waits for mu) that it closed. */
    if (c->fd >= 0) shutdown(c->fd, SHUT_RDWR);
}

/* One summary of the closings since the last one, at most every
 * GUARD_LOG_MS.  Called with mu held. */
static void guard_log(httpd_guard *gd, int64_t now) {
    if (now - gd->logged_ms < GUARD_LOG_MS) return;
    uint64_t late = gd->late - gd->logged_late, evicted = gd->evicted - gd->logged_evicted,
             refused = gd->refused - gd->logged_refused;
    if (late + evicted + refused == 0) return;
    LOG(LL_WARN,
        "%s: closed %llu connection(s) that sent no whole request within %u ms, %llu idle one(s) to make room "
        "for newer ones (at the limit of %u), and refused %llu new one(s) while all %u were busy",
        gd->name, (unsigned long long)late, gd->read_timeout_ms, (unsigned long long)evicted, gd->max_connections,
        (unsigned long long)refused, gd->max_connections);
    gd->logged_late = gd->late;
    gd->logged_evicted = gd->evicted;
    gd->logged_refused = gd->refused;
    gd->logged_ms = now;
}

static void *guard_main(void *arg) {
    httpd_guard *gd = arg;
    unsigned tick = gd->read_timeout_ms / 8;
    if (tick > GUARD_TICK_MS_MAX) tick = GUARD_TICK_MS_MAX;
    if (tick < 10) tick = 10;
    pthread_mutex_lock(&gd->mu);
    while (!gd->stop) {
        int64_t now = guard_now_ms();
        for (struct guard_conn *c = gd->head; c; c = c->next) {
            if (c->busy || c->closing || now - c->since_ms < (int64_t)gd->read_timeout_ms) continue;
            guard_shut(gd, c);
            gd->late++;
        }
        guard_log(gd, now);
        struct timespec ts;
        clock_gettime(CLOCK_MONOTONIC, &ts);
        ts.tv_nsec += (long)tick * 1000000L;
        while (ts.tv_nsec >= 1000000000L) {
            ts.tv_sec++;
            ts.tv_nsec -= 1000000000L;
        }
        while (!gd->stop && pthread_cond_timedwait(&gd->cv, &gd->mu, &ts) != ETIMEDOUT) {
        }
    }
    pthread_mutex_unlock(&gd->mu);
    return NULL;
}

int httpd_guard_init(httpd_guard **out, const struct httpd_guard_config *c, char *err, size_t errlen) {
    *out = NULL;
    if (c->max_connections < 1 || c->read_timeout_ms < 1) {
        snprintf(err, errlen, "%s: max_connections %u and read_timeout_ms %u must both be at least 1",
                 c->name ? c->name : "httpd", c->max_connections, c->read_timeout_ms);
        return STATUS_BAD_INPUT;
    }
    httpd_guard *gd = calloc(1, sizeof *gd);
    if (!gd) {
        snprintf(err, errlen, "%s: out of memory", c->name ? c->name : "httpd");
        return STATUS_NO_MEMORY;
    }
    snprintf(gd->name, sizeof gd->name, "%s", c->name ? c->name : "httpd");
    gd->max_connections = c->max_connections;
    gd->read_timeout_ms = c->read_timeout_ms;
    gd->logged_ms = guard_now_ms();
    pthread_mutex_init(&gd->mu, NULL);
    pthread_condattr_t ca;
    pthread_condattr_init(&ca);
    pthread_condattr_setclock(&ca, CLOCK_MONOTONIC);
    pthread_cond_init(&gd->cv, &ca);
    pthread_condattr_destroy(&ca);
    int rc = pthread_create(&gd->timer, NULL, guard_main, gd);
    if (rc != 0) {
        snprintf(err, errlen, "%s: cannot start the connection guard's thread: %s", gd->name, strerror(rc));
        pthread_cond_destroy(&gd->cv);
        pthread_mutex_destroy(&gd->mu);
        free(gd);
        return STATUS_INTERNAL;
    }
    *out = gd;
    return 0;
}

void httpd_guard_free(httpd_guard *gd) {
    if (!gd) return;
    pthread_mutex_lock(&gd->mu);
    gd->stop = true;
    pthread_cond_broadcast(&gd->cv);
    pthread_mutex_unlock(&gd->mu);
    pthread_join(gd->timer, NULL);
    /* Connections the daemon never reported closed (it always does): their
     * records only. */
    for (struct guard_conn *c = gd->head, *next; c; c = next) {
        next = c->next;
        free(c);
    }
    pthread_cond_destroy(&gd->cv);
    pthread_mutex_destroy(&gd->mu);
    free(gd);
}

/* 1 when the socket holds a whole request head (up to a blank line) not
 * yet read: a peek, which leaves the bytes for the daemon. */
static bool guard_head_waiting(int fd) {
    if (fd < 0) return false;
    char buf[4096];
    ssize_t n = recv(fd, buf, sizeof buf - 1, MSG_PEEK | MSG_DONTWAIT);
    if (n <= 0) return false;
    buf[n] = '\0';
    return strstr(buf, "\r\n\r\n") != NULL;
}

void httpd_guard_listening(httpd_guard *gd, struct MHD_Daemon *d) {
#ifdef TCP_DEFER_ACCEPT
    const union MHD_DaemonInfo *di = MHD_get_daemon_info(d, MHD_DAEMON_INFO_LISTEN_FD);
    int secs = (int)((gd->read_timeout_ms + 999) / 1000);
    if (!di || setsockopt(di->listen_fd, IPPROTO_TCP, TCP_DEFER_ACCEPT, &secs, sizeof secs) != 0)
        LOG(LL_WARN, "%s: cannot defer connections until their first bytes (TCP_DEFER_ACCEPT %d s): %s", gd->name,
            secs, di ? strerror(errno) : "libmicrohttpd does not say its listening socket");
#else
    (void)gd;
    (void)d;
#endif
}

unsigned httpd_guard_mhd_limit(const httpd_guard *gd) { return gd->max_connections * 2 + 16; }

void httpd_guard_notify(void *cls, struct MHD_Connection *conn, void **socket_context,
                        enum MHD_ConnectionNotificationCode code) {
    httpd_guard *gd = cls;
    if (code == MHD_CONNECTION_NOTIFY_CLOSED) {
        struct guard_conn *c = *socket_context;
        if (!c) return;
        pthread_mutex_lock(&gd->mu);
        if (c->prev) c->prev->next = c->next;
        else gd->head = c->next;
        if (c->next) c->next->prev = c->prev;
        gd->n_open--;
        if (c->closing) gd->n_closing--;
        pthread_mutex_unlock(&gd->mu);
        free(c);
        *socket_context = NULL;
        return;
    }
    if (code != MHD_CONNECTION_NOTIFY_STARTED) return;
    const union MHD_ConnectionInfo *ci = MHD_get_connection_info(conn, MHD_CONNECTION_INFO_CONNECTION_FD);
    struct guard_conn *c = calloc(1, sizeof *c);
    if (!c) {
        /* Unguarded rather than refused: out of memory is not the client's doing. */
        *socket_context = NULL;
        return;
    }
    c->gd = gd;
    c->fd = ci ? ci->connect_fd : -1;
    pthread_mutex_lock(&gd->mu);
    int64_t now = guard_now_ms();
    c->since_ms = now;
    if (gd->n_open - gd->n_closing >= gd->max_connections) {
        /* Full: the connection that has waited longest for its request
         * makes room; with none to spare, the new one goes.  One whose
         * whole request head already waits in its socket is about to be
         * served, not waiting: under a flood of reconnecting slow clients
         * a fresh client's connection could otherwise be the oldest idle
         * one by the time 32 more arrive, before the daemon reads it. */
        struct guard_conn *oldest = NULL;
        for (struct guard_conn *o = gd->head; o; o = o->next)
            if (!o->busy && !o->closing && (!oldest || o->since_ms < oldest->since_ms) && !guard_head_waiting(o->fd))
                oldest = o;
        if (oldest) {
            guard_shut(gd, oldest);
            gd->evicted++;
        } else {
            guard_shut(gd, c);
            gd->refused++;
        }
        guard_log(gd, now);
    }
    c->next = gd->head;
    if (gd->head) gd->head->prev = c;
    gd->head = c;
    gd->n_open++;
    pthread_mutex_unlock(&gd->mu);
    *socket_context = c;
}

static struct guard_conn *guard_conn_of(struct MHD_Connection *conn) {
    const union MHD_ConnectionInfo *ci = MHD_get_connection_info(conn, MHD_CONNECTION_INFO_SOCKET_CONTEXT);
    return ci ? ci->socket_context : NULL;
}

void httpd_guard_busy(struct MHD_Connection *conn) {
    struct guard_conn *c = guard_conn_of(conn);
    if (!c) return;
    pthread_mutex_lock(&c->gd->mu);
    c->busy = true;
    pthread_mutex_unlock(&c->gd->mu);
}

void httpd_guard_idle(struct MHD_Connection *conn) {
    struct guard_conn *c = guard_conn_of(conn);
    if (!c) return;
    pthread_mutex_lock(&c->gd->mu);
    c->busy = false;
    c->since_ms = guard_now_ms();
    pthread_mutex_unlock(&c->gd->mu);
}

int httpd_guard_log_level(const char *mhd_message) {
    return strstr(mhd_message, "socket is closed") || strstr(mhd_message, "closed by remote side") ? LL_DEBUG
                                                                                                  : LL_WARN;
}

void httpd_guard_closed(httpd_guard *gd, uint64_t *late, uint64_t *evicted) {
    pthread_mutex_lock(&gd->mu);
    if (late) *late = gd->late;
    if (evicted) *evicted = gd->evicted;
    pthread_mutex_unlock(&gd->mu);
}
