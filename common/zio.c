/* ZeroMQ helpers: sockets that remember their endpoint and last error,
 * multipart messages with copied or zero-copy frames, timed receive and
 * poll, and finding a free loopback port. */
#include "zio.h"

#include "status.h"

#include "log.h"

#include <errno.h>
#include <pthread.h>
#include <stdarg.h>
#include <stdatomic.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/random.h>
#include <time.h>
#include <unistd.h>

struct zio_sock {
    void *sock;
    int err;
    char errstr[320];
    char endpoint[256]; /* last bound endpoint, as ZeroMQ reports it */
    char peer[256];     /* last endpoint bound or connected: names the socket in messages */
    int spin_us;        /* zio_set_spin */
    int64_t recv_last_us; /* monotonic time of the last message received; 0: none yet */
    void *warm_tx, *warm_rx; /* zio_set_warm: a PAIR of the socket's context each way */
    int64_t warm_last_us;
    long warm_back;          /* zio_warm_ticks */
};

static void zio_seterr(struct zio_sock *s, int code, const char *fmt, ...)
    __attribute__((format(printf, 3, 4)));

static void zio_seterr(struct zio_sock *s, int code, const char *fmt, ...) {
    s->err = code;
    va_list ap;
    va_start(ap, fmt);
    vsnprintf(s->errstr, sizeof s->errstr, fmt, ap);
    va_end(ap);
}

static void zio_ok(struct zio_sock *s) {
    s->err = 0;
    s->errstr[0] = '\0';
}

/* The socket's name in messages: its endpoint, or "socket" before bind/connect. */
static const char *zio_name(const struct zio_sock *s) { return s->peer[0] ? s->peer : "socket"; }

int zio_sock_open(void *ctx, int type, struct zio_sock **out, char *err, size_t err_size) {
    *out = NULL;
    struct zio_sock *s = calloc(1, sizeof *s);
    if (!s) {
        snprintf(err, err_size, "zmq socket of type %d: out of memory", type);
        return STATUS_NO_MEMORY;
    }
    s->sock = ctx ? zmq_socket(ctx, type) : NULL;
    if (!s->sock) {
        snprintf(err, err_size, "zmq socket of type %d: %s", type,
                 ctx ? zmq_strerror(errno) : "no context");
        free(s);
        return ctx ? STATUS_IO : STATUS_BAD_INPUT;
    }
    int linger = 1000;
    zmq_setsockopt(s->sock, ZMQ_LINGER, &linger, sizeof linger);
    int64_t max = zio_max_msg_size();
    if (max > 0) zmq_setsockopt(s->sock, ZMQ_MAXMSGSIZE, &max, sizeof max);
    /* A peer cut off without a reset (a pulled cable, a partition, a host
     * that drops packets) leaves TCP half-open for many minutes: ZMTP
     * heartbeats close such a connection within IVL + TIMEOUT on either
     * end, so that ZeroMQ reconnects and the ROUTER side frees the routing
     * id the peer comes back with (docs/protocol.md, "Dead peers").  A
     * connect that gets no answer is given up after CONNECT_TIMEOUT and
     * tried again, instead of waiting out the kernel's SYN retries.  Inproc
     * sockets ignore all of these. */
    if (type != ZMQ_PAIR) {
        int ivl = ZIO_HEARTBEAT_IVL_MS, tmo = ZIO_HEARTBEAT_TIMEOUT_MS, ctmo = ZIO_CONNECT_TIMEOUT_MS;
        zmq_setsockopt(s->sock, ZMQ_HEARTBEAT_IVL, &ivl, sizeof ivl);
        zmq_setsockopt(s->sock, ZMQ_HEARTBEAT_TIMEOUT, &tmo, sizeof tmo);
        zmq_setsockopt(s->sock, ZMQ_HEARTBEAT_TTL, &tmo, sizeof tmo);
        zmq_setsockopt(s->sock, ZMQ_CONNECT_TIMEOUT, &ctmo, sizeof ctmo);
    }
    *out = s;
    return 0;
}

void zio_sock_close(struct zio_sock *s) {
    if (!s) return;
    if (s->sock) zmq_close(s->sock);
    if (s->warm_tx) zmq_close(s->warm_tx);
    if (s->warm_rx) zmq_close(s->warm_rx);
    free(s);
}

static int zio_endpoint_status(int e) {
    switch (e) {
    case EINVAL: case EPROTONOSUPPORT: case ENOCOMPATPROTO: case ENODEV: return STATUS_BAD_INPUT;
    case ETERM: return STATUS_CANCELLED;
    default: return STATUS_IO;
    }
}

/* ZeroMQ 4.3 takes "tcp://host:99999" and binds port 34463 (the number cut
 * to 16 bits): check tcp ports here so that a typo is an error. */
static int zio_check_endpoint(struct zio_sock *s, const char *verb, const char *endpoint) {
    if (strncmp(endpoint, "tcp://", 6) != 0) return 0;
    const char *colon = strrchr(endpoint + 6, ':');
    if (!colon) {
        zio_seterr(s, STATUS_BAD_INPUT, "%s %s: no port (write tcp://host:port)", verb, endpoint);
        return s->err;
    }
    const char *p = colon + 1;
    if (strcmp(p, "*") == 0) return 0;
    char *end;
    errno = 0;
    long port = strtol(p, &end, 10);
    if (end == p || *end != '\0' || errno == ERANGE || port < 0 || port > 65535) {
        zio_seterr(s, STATUS_BAD_INPUT, "%s %s: port '%s' is not a number from 0 to 65535",
                   verb, endpoint, p);
        return s->err;
    }
    return 0;
}

int zio_bind(struct zio_sock *s, const char *endpoint) {
    if (zio_check_endpoint(s, "bind", endpoint) < 0) return s->err;
    if (zmq_bind(s->sock, endpoint) != 0) {
        int e = errno;
        zio_seterr(s, zio_endpoint_status(e), "bind %s: %s", endpoint, zmq_strerror(e));
        return s->err;
    }
    size_t len = sizeof s->endpoint;
    if (zmq_getsockopt(s->sock, ZMQ_LAST_ENDPOINT, s->endpoint, &len) != 0)
        snprintf(s->endpoint, sizeof s->endpoint, "%s", endpoint);
    snprintf(s->peer, sizeof s->peer, "%s", s->endpoint);
    zio_ok(s);
    return 0;
}

int zio_connect(struct zio_sock *s, const char *endpoint) {
    if (zio_check_endpoint(s, "connect", endpoint) < 0) return s->err;
    if (zmq_connect(s->sock, endpoint) != 0) {
        int e = errno;
        zio_seterr(s, zio_endpoint_status(e), "connect %s: %s", endpoint, zmq_strerror(e));
        return s->err;
    }
    snprintf(s->peer, sizeof s->peer, "%s", endpoint);
    zio_ok(s);
    return 0;
}

const char *zio_endpoint(const struct zio_sock *s) { return s->endpoint; }

int zio_set_int(struct zio_sock *s, int option, int value) {
    if (zmq_setsockopt(s->sock, option, &value, sizeof value) != 0) {
        int e = errno;
        zio_seterr(s, e == EINVAL ? STATUS_BAD_INPUT : STATUS_IO,
                   "%s: zmq option %d = %d: %s", zio_name(s), option, value, zmq_strerror(e));
        return s->err;
    }
    zio_ok(s);
    return 0;
}

int zio_set_bytes(struct zio_sock *s, int option, const void *value, size_t size) {
    if (zmq_setsockopt(s->sock, option, value, size) != 0) {
        int e = errno;
        zio_seterr(s, e == EINVAL ? STATUS_BAD_INPUT : STATUS_IO,
                   "%s: zmq option %d (%zu bytes): %s", zio_name(s), option, size,
                   zmq_strerror(e));
        return s->err;
    }
    zio_ok(s);
    return 0;
}

static int zio_io_status(int e, int eagain) {
    switch (e) {
    case EAGAIN: return eagain;
    case ETERM: return STATUS_CANCELLED;
    case EINTR: return STATUS_CANCELLED;
    case EHOSTUNREACH: return STATUS_UNAVAILABLE; /* ROUTER_MANDATORY: no such peer */
    case ENOTSUP: case EFSM: return STATUS_BAD_INPUT;  /* wrong socket type or state */
    default: return STATUS_IO;
    }
}

/* Gives the unsent zero-copy frames back to their owners' free functions. */
static void zio_release_from(const struct zio_frame *frames, size_t from, size_t n) {
    for (size_t i = from; i < n; i++)
        if (frames[i].free_fn) frames[i].free_fn((void *)frames[i].data, frames[i].hint);
}

int zio_send(struct zio_sock *s, const struct zio_frame *frames, size_t n, int flags) {
    if (n == 0) {
        zio_seterr(s, STATUS_BAD_INPUT, "send to %s: a message needs at least one frame",
                   zio_name(s));
        return s->err;
    }
    for (size_t i = 0; i < n; i++) {
        const struct zio_frame *f = &frames[i];
        zmq_msg_t m;
        int rc;
        if (f->free_fn && f->size > 0) {
            rc = zmq_msg_init_data(&m, (void *)f->data, f->size, f->free_fn, f->hint);
        } else {
            rc = zmq_msg_init_size(&m, f->size);
            if (rc == 0 && f->size) memcpy(zmq_msg_data(&m), f->data, f->size);
            /* An empty zero-copy frame has nothing for ZeroMQ to hold: free it now. */
            if (rc == 0 && f->free_fn) f->free_fn((void *)f->data, f->hint);
        }
        if (rc != 0) {
            int e = errno;
            if (f->free_fn) f->free_fn((void *)f->data, f->hint);
            zio_release_from(frames, i + 1, n);
            zio_seterr(s, STATUS_NO_MEMORY, "send to %s: frame %zu of %zu (%zu bytes): %s",
                       zio_name(s), i, n, f->size, zmq_strerror(e));
            return s->err;
        }
        int fl = flags | (i + 1 < n ? ZMQ_SNDMORE : 0);
        for (;;) {
            rc = zmq_msg_send(&m, s->sock, fl);
            if (rc >= 0 || errno != EINTR) break;
        }
        if (rc < 0) {
            int e = errno;
            zmq_msg_close(&m); /* runs the frame's free_fn if it was zero-copy */
            zio_release_from(frames, i + 1, n);
            zio_seterr(s, zio_io_status(e, STATUS_EXHAUSTED),
                       "send to %s: frame %zu of %zu (%zu bytes): %s", zio_name(s), i, n,
                       f->size, zmq_strerror(e));
            return s->err;
        }
    }
    zio_ok(s);
    return 0;
}

static void zio_parts_clear(struct zio_parts *p) {
    for (size_t i = 0; i < p->n; i++) zmq_msg_close(&p->msgs[i]);
    p->n = 0;
}

void zio_parts_free(struct zio_parts *p) {
    if (!p) return;
    zio_parts_clear(p);
    free(p->msgs);
    p->msgs = NULL;
    p->cap = 0;
}

const void *zio_parts_data(const struct zio_parts *p, size_t i) {
    return i < p->n ? zmq_msg_data((zmq_msg_t *)&p->msgs[i]) : NULL;
}

size_t zio_parts_size(const struct zio_parts *p, size_t i) {
    return i < p->n ? zmq_msg_size((zmq_msg_t *)&p->msgs[i]) : 0;
}

static int64_t zio_now_ms(void) {
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (int64_t)ts.tv_sec * 1000 + ts.tv_nsec / 1000000;
}

static int64_t zio_now_us(void) {
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (int64_t)ts.tv_sec * 1000000 + ts.tv_nsec / 1000;
}

void zio_set_spin(struct zio_sock *s, int us) { s->spin_us = us > 0 ? us : 0; }

/* Whether a wait on s may spin now: it has a spin and took a message
 * within ZIO_SPIN_RECENT_US. */
static int zio_spin_busy(const struct zio_sock *s, int64_t now_us) {
    return s->spin_us > 0 && s->recv_last_us > 0 && now_us - s->recv_last_us < ZIO_SPIN_RECENT_US;
}

/* A tick every 50 us: well inside the 200 us a KVM guest's idle vCPU polls
 * before it halts (halt_poll_ns).  Each tick is an empty message through
 * the I/O thread and back, a few microseconds of its time (not measured
 * apart): about a tenth of a core while a wait spins, beside the whole
 * core the spinning thread takes. */
#define ZIO_WARM_TICK_US 50

int zio_set_warm(struct zio_sock *s, void *zctx) {
    if (s->warm_tx) return 0;
    /* An abstract Unix socket (no file) of a name no other process can
     * guess; PAIR admits one peer, ours, and takes no large message. */
    uint64_t r[2] = {0, 0};
    if (getrandom(r, sizeof r, 0) != (ssize_t)sizeof r) {
        zio_seterr(s, STATUS_IO, "warm ticks for %s: getrandom: %s", zio_name(s), strerror(errno));
        return s->err;
    }
    char ep[96];
    snprintf(ep, sizeof ep, "ipc://@llm-warm-%ld-%016llx%016llx", (long)getpid(), (unsigned long long)r[0],
             (unsigned long long)r[1]);
    void *rx = zmq_socket(zctx, ZMQ_PAIR), *tx = rx ? zmq_socket(zctx, ZMQ_PAIR) : NULL;
    int zero = 0, hwm = 4;
    int64_t most = 256; /* the handshake's READY command counts too */
    int ok = rx && tx && zmq_setsockopt(rx, ZMQ_LINGER, &zero, sizeof zero) == 0 &&
             zmq_setsockopt(tx, ZMQ_LINGER, &zero, sizeof zero) == 0 &&
             zmq_setsockopt(rx, ZMQ_MAXMSGSIZE, &most, sizeof most) == 0 &&
             zmq_setsockopt(rx, ZMQ_RCVHWM, &hwm, sizeof hwm) == 0 &&
             zmq_setsockopt(tx, ZMQ_SNDHWM, &hwm, sizeof hwm) == 0 && zmq_bind(rx, ep) == 0 &&
             zmq_connect(tx, ep) == 0;
    if (!ok) {
        int e = errno;
        if (tx) zmq_close(tx);
        if (rx) zmq_close(rx);
        zio_seterr(s, zio_io_status(e, STATUS_IO), "warm ticks for %s on %s: %s", zio_name(s), ep,
                   zmq_strerror(e));
        return s->err;
    }
    s->warm_tx = tx;
    s->warm_rx = rx;
    s->warm_last_us = 0;
    return 0;
}

long zio_warm_ticks(const struct zio_sock *s) { return s->warm_back; }

/* The ticks of one spin: drains the ones that came back, sends the next. */
static void zio_warm_tick(struct zio_sock *w, int64_t now_us) {
    if (!w || now_us - w->warm_last_us < ZIO_WARM_TICK_US) return;
    w->warm_last_us = now_us;
    while (zmq_recv(w->warm_rx, NULL, 0, ZMQ_DONTWAIT) >= 0) w->warm_back++;
    zmq_send(w->warm_tx, NULL, 0, ZMQ_DONTWAIT); /* a full queue (EAGAIN) is a tick skipped */
}

/* zmq_poll, first without blocking for up to spin_us (within the
 * timeout), ticking w's context (zio_set_warm) meanwhile, then blocking
 * for the rest of the timeout. */
static int zio_poll_items(zmq_pollitem_t *items, int n, int timeout_ms, int64_t spin_us, struct zio_sock *w) {
    if (timeout_ms >= 0 && spin_us > (int64_t)timeout_ms * 1000) spin_us = (int64_t)timeout_ms * 1000;
    if (spin_us <= 0) return zmq_poll(items, n, timeout_ms);
    const int64_t t0 = zio_now_us();
    int rc;
    int64_t now;
    while ((rc = zmq_poll(items, n, 0)) == 0 && (now = zio_now_us()) - t0 < spin_us) zio_warm_tick(w, now);
    if (rc != 0 || timeout_ms == 0) return rc;
    if (timeout_ms < 0) return zmq_poll(items, n, -1);
    const int64_t left = (int64_t)timeout_ms - (zio_now_us() - t0) / 1000;
    return left > 0 ? zmq_poll(items, n, (long)left) : 0;
}

int zio_recv(struct zio_sock *s, struct zio_parts *p, int timeout_ms) {
    zio_parts_clear(p);
    int64_t deadline = timeout_ms >= 0 ? zio_now_ms() + timeout_ms : 0;
    for (;;) {
        if (p->n == p->cap) {
            size_t cap = p->cap ? p->cap * 2 : 4;
            zmq_msg_t *m = realloc(p->msgs, cap * sizeof *m);
            if (!m) {
                zio_parts_clear(p);
                zio_seterr(s, STATUS_NO_MEMORY, "recv from %s: out of memory for %zu frames",
                           zio_name(s), cap);
                return s->err;
            }
            p->msgs = m;
            p->cap = cap;
        }
        zmq_msg_t *m = &p->msgs[p->n];
        zmq_msg_init(m);
        int rc;
        if (p->n > 0 || timeout_ms < 0) {
            /* The rest of a message arrives with its first frame: never waits long. */
            rc = zmq_msg_recv(m, s->sock, 0);
        } else {
            rc = zmq_msg_recv(m, s->sock, ZMQ_DONTWAIT);
            while (rc < 0 && errno == EAGAIN) {
                int64_t left = deadline - zio_now_ms();
                if (left <= 0) break;
                zmq_pollitem_t it = {s->sock, 0, ZMQ_POLLIN, 0};
                int spin = zio_spin_busy(s, zio_now_us()) ? s->spin_us : 0;
                int pr = zio_poll_items(&it, 1, (int)left, spin, s->warm_tx ? s : NULL);
                if (pr < 0) break; /* errno tells why */
                rc = zmq_msg_recv(m, s->sock, ZMQ_DONTWAIT);
            }
        }
        if (rc < 0) {
            int e = errno;
            zmq_msg_close(m);
            zio_parts_clear(p);
            if (e == EAGAIN) {
                zio_seterr(s, STATUS_TIMEOUT, "recv from %s: no message within %d ms",
                           zio_name(s), timeout_ms);
            } else {
                zio_seterr(s, zio_io_status(e, STATUS_TIMEOUT), "recv from %s: %s", zio_name(s),
                           zmq_strerror(e));
            }
            return s->err;
        }
        p->n++;
        if (!zmq_msg_more(m)) break;
    }
    s->recv_last_us = zio_now_us();
    zio_ok(s);
    return 0;
}

int zio_poll(struct zio_sock *const *socks, const short *events, short *revents, size_t n,
             int timeout_ms) {
    zmq_pollitem_t items_small[16];
    zmq_pollitem_t *items = n <= 16 ? items_small : malloc(n * sizeof *items);
    if (!items) {
        if (n) zio_seterr(socks[0], STATUS_NO_MEMORY, "poll %zu sockets: out of memory", n);
        return STATUS_NO_MEMORY;
    }
    for (size_t i = 0; i < n; i++) {
        items[i].socket = socks[i]->sock;
        items[i].fd = 0;
        items[i].events = events[i];
        items[i].revents = 0;
    }
    /* The set spins as long as its largest spin if one of its spinning
     * sockets is busy (zio_spin_busy), else blocks at once. */
    int spin = 0, busy = 0;
    struct zio_sock *w = NULL;
    const int64_t now = zio_now_us();
    for (size_t i = 0; i < n; i++) {
        if (socks[i]->spin_us > spin) spin = socks[i]->spin_us;
        if (zio_spin_busy(socks[i], now)) busy = 1;
        if (!w && socks[i]->warm_tx) w = socks[i];
    }
    int rc = zio_poll_items(items, (int)n, timeout_ms, busy ? spin : 0, w);
    int e = errno;
    for (size_t i = 0; i < n; i++) revents[i] = rc > 0 ? items[i].revents : 0;
    if (rc > 0) {
        const int64_t got = zio_now_us();
        for (size_t i = 0; i < n; i++)
            if (revents[i] & ZMQ_POLLIN) socks[i]->recv_last_us = got;
    }
    if (items != items_small) free(items);
    if (rc < 0) {
        if (e == EINTR) return 0;
        if (n) {
            zio_seterr(socks[0], zio_io_status(e, STATUS_TIMEOUT), "poll %zu sockets (first %s): %s",
                       n, zio_name(socks[0]), zmq_strerror(e));
            return socks[0]->err;
        }
        return STATUS_IO;
    }
    return rc;
}

int zio_err(const struct zio_sock *s) { return s->err; }
const char *zio_errstr(const struct zio_sock *s) { return s->errstr; }
void *zio_sock_raw(const struct zio_sock *s) { return s->sock; }

int zio_free_port(void *ctx, int *port, char *err, size_t err_size) {
    *port = 0;
    void *own = NULL;
    if (!ctx) {
        own = zmq_ctx_new();
        if (!own) {
            snprintf(err, err_size, "free port: zmq context: %s", zmq_strerror(errno));
            return STATUS_IO;
        }
        ctx = own;
    }
    struct zio_sock *s;
    int rc = zio_sock_open(ctx, ZMQ_PAIR, &s, err, err_size);
    if (rc == 0) {
        zio_set_int(s, ZMQ_LINGER, 0);
        rc = zio_bind(s, "tcp://127.0.0.1:*");
        if (rc < 0) {
            snprintf(err, err_size, "free port: %s", zio_errstr(s));
        } else {
            const char *colon = strrchr(s->endpoint, ':');
            char *end = NULL;
            long p = colon ? strtol(colon + 1, &end, 10) : 0;
            if (!colon || *end != '\0' || p <= 0 || p > 65535) {
                snprintf(err, err_size, "free port: cannot read a port from endpoint '%s'",
                         s->endpoint);
                rc = STATUS_INTERNAL;
            } else {
                *port = (int)p;
            }
        }
        zio_sock_close(s);
    }
    if (own) zmq_ctx_term(own); /* waits until the listener is really closed */
    return rc;
}

/* ------------------------------------------------------------------------ */
/* Frame bound and CURVE */

static _Atomic int64_t zio_max_msg = ZIO_MAX_MSG_SIZE_DEFAULT;

void zio_set_max_msg_size(int64_t bytes) { zio_max_msg = bytes > 0 ? bytes : -1; }
int64_t zio_max_msg_size(void) { return zio_max_msg; }

int zio_curve_server(struct zio_sock *s, const struct keys_pair *own, const char *zap_domain) {
    int one = 1;
    if (zmq_setsockopt(s->sock, ZMQ_CURVE_SERVER, &one, sizeof one) != 0 ||
        zmq_setsockopt(s->sock, ZMQ_CURVE_SECRETKEY, own->sec, KEYS_Z85_LEN) != 0 ||
        zmq_setsockopt(s->sock, ZMQ_ZAP_DOMAIN, zap_domain, strlen(zap_domain)) != 0) {
        int e = errno;
        zio_seterr(s, e == EINVAL ? STATUS_BAD_INPUT : STATUS_IO,
                   "%s: CURVE server (ZAP domain %s): %s", zio_name(s), zap_domain,
                   zmq_strerror(e));
        return s->err;
    }
    zio_ok(s);
    return 0;
}

int zio_curve_client(struct zio_sock *s, const struct keys_pair *own, const char *server_pub) {
    if (!keys_z85_valid(server_pub)) {
        zio_seterr(s, STATUS_BAD_INPUT, "%s: CURVE client: server key '%.60s' is not a key "
                   "(40 Z85 characters)", zio_name(s), server_pub ? server_pub : "");
        return s->err;
    }
    if (zmq_setsockopt(s->sock, ZMQ_CURVE_SERVERKEY, server_pub, KEYS_Z85_LEN) != 0 ||
        zmq_setsockopt(s->sock, ZMQ_CURVE_PUBLICKEY, own->pub, KEYS_Z85_LEN) != 0 ||
        zmq_setsockopt(s->sock, ZMQ_CURVE_SECRETKEY, own->sec, KEYS_Z85_LEN) != 0) {
        int e = errno;
        zio_seterr(s, e == EINVAL ? STATUS_BAD_INPUT : STATUS_IO, "%s: CURVE client: %s",
                   zio_name(s), zmq_strerror(e));
        return s->err;
    }
    zio_ok(s);
    return 0;
}

const char *zio_parts_user_id(const struct zio_parts *p) {
    if (!p || p->n == 0) return "";
    /* The last frame: every frame of a message carries the connection's
     * metadata, and the payload certainly does (a ROUTER's routing-id frame
     * is made by the socket). */
    const char *u = zmq_msg_gets((zmq_msg_t *)&p->msgs[p->n - 1], "User-Id");
    return u ? u : "";
}

const char *zio_user_id_key(const char *user_id) {
    size_t n = user_id ? strlen(user_id) : 0;
    if (n < KEYS_Z85_LEN) return "";
    const char *k = user_id + n - KEYS_Z85_LEN;
    return keys_z85_valid(k) ? k : "";
}

/* ------------------------------------------------------------------------ */
/* ZAP handler */

#define ZIO_ZAP_DOMAINS 16
#define ZIO_ZAP_HELD_MAX 64
/* How long a domain of one replaceable key (zio_zap_set_one) holds a
 * handshake with another key before refusing it. */
#define ZIO_ZAP_HOLD_MS 5000

struct zio_zap_domain {
    char name[64];
    struct keys_entry *keys;
    size_t n;
    bool hold_others;           /* set by zio_zap_set_one: hold other keys a while */
    uint64_t refused, admitted;
};

/* A handshake waiting for its domain's first key. */
struct zio_zap_held {
    uint8_t peer[256];   /* the ZAP client's routing id on our ROUTER socket */
    size_t peer_len;
    uint8_t req_id[256];
    size_t req_id_len;
    char domain[64], address[64], key[KEYS_Z85_LEN + 1];
    int64_t since_ms;    /* when it came */
};

struct zio_zap {
    void *sock;                 /* ROUTER on inproc://zeromq.zap.01; used by the thread only */
    pthread_t thread;
    atomic_bool stop;
    atomic_uint gen;            /* bumped by every list change */
    pthread_mutex_t mu;         /* guards domains */
    struct zio_zap_domain d[ZIO_ZAP_DOMAINS];
    size_t n_domains;
    struct zio_zap_held held[ZIO_ZAP_HELD_MAX]; /* thread only */
    size_t n_held;
};

/* The domain's slot, made when missing (mu held); NULL when all are taken. */
static struct zio_zap_domain *zio_zap_slot(zio_zap *z, const char *domain, bool make) {
    for (size_t i = 0; i < z->n_domains; i++)
        if (strcmp(z->d[i].name, domain) == 0) return &z->d[i];
    if (!make || z->n_domains == ZIO_ZAP_DOMAINS) return NULL;
    struct zio_zap_domain *d = &z->d[z->n_domains++];
    memset(d, 0, sizeof *d);
    snprintf(d->name, sizeof d->name, "%s", domain);
    return d;
}

/* Sends the ZAP reply (RFC 27) behind the requester's envelope. */
static void zio_zap_reply(void *sock, const struct zio_zap_held *h, const char *code, const char *text,
                          const char *user_id) {
    zmq_send(sock, h->peer, h->peer_len, ZMQ_SNDMORE);
    zmq_send(sock, "", 0, ZMQ_SNDMORE);
    zmq_send(sock, "1.0", 3, ZMQ_SNDMORE);
    zmq_send(sock, h->req_id, h->req_id_len, ZMQ_SNDMORE);
    zmq_send(sock, code, strlen(code), ZMQ_SNDMORE);
    zmq_send(sock, text, strlen(text), ZMQ_SNDMORE);
    zmq_send(sock, user_id, strlen(user_id), ZMQ_SNDMORE);
    zmq_send(sock, "", 0, 0);
}

/* Answers h, or holds it (returns false) while its domain has no key yet:
 * the peer waits in its handshake instead of being refused for good
 * (ZeroMQ never reconnects after a refusal), and is answered as soon as
 * the domain gets its keys. */
static bool zio_zap_decide(zio_zap *z, const struct zio_zap_held *h, bool curve, bool may_hold) {
    char user_id[KEYS_NAME_MAX + KEYS_Z85_LEN + 2] = "";
    const char *why = "key not admitted";
    pthread_mutex_lock(&z->mu);
    struct zio_zap_domain *d = zio_zap_slot(z, h->domain, true);
    if (curve && may_hold && d && d->n == 0) {
        pthread_mutex_unlock(&z->mu);
        return false;
    }
    bool ok = false;
    if (!curve) {
        why = "not a CURVE handshake";
    } else if (d) {
        for (size_t i = 0; i < d->n && !ok; i++) {
            if (strcmp(d->keys[i].pub, h->key) != 0) continue;
            ok = true;
            if (d->keys[i].name[0]) snprintf(user_id, sizeof user_id, "%s/%s", d->keys[i].name, h->key);
            else snprintf(user_id, sizeof user_id, "%s", h->key);
        }
    }
    /* A new predecessor may connect just before this stage hears that the
     * router placed it: give the placement a moment to arrive. */
    if (curve && !ok && may_hold && d && d->hold_others && zio_now_ms() - h->since_ms < ZIO_ZAP_HOLD_MS) {
        pthread_mutex_unlock(&z->mu);
        return false;
    }
    uint64_t refused = 0;
    if (d && ok) d->admitted++;
    if (d && !ok) refused = ++d->refused;
    pthread_mutex_unlock(&z->mu);
    if (!ok && (refused <= 10 || refused % 1000 == 0))
        LOG(LL_WARN, "security: refused %s peer from %s (key %s): %s (%llu refused in domain '%s')",
            curve ? "CURVE" : "a non-CURVE", h->address[0] ? h->address : "?", h->key[0] ? h->key : "-",
            why, (unsigned long long)refused, h->domain);
    zio_zap_reply(z->sock, h, ok ? "200" : "400", ok ? "OK" : why, ok ? user_id : "");
    return true;
}

/* One request: frames routing id, "", version, request id, domain,
 * address, identity, mechanism, credentials. */
static void zio_zap_handle(zio_zap *z, zmq_msg_t *f, int n) {
    if (n < 8 || zmq_msg_size(&f[0]) > 256 || zmq_msg_size(&f[3]) > 256) return;
    struct zio_zap_held h;
    memset(&h, 0, sizeof h);
    h.peer_len = zmq_msg_size(&f[0]);
    memcpy(h.peer, zmq_msg_data(&f[0]), h.peer_len);
    h.req_id_len = zmq_msg_size(&f[3]);
    memcpy(h.req_id, zmq_msg_data(&f[3]), h.req_id_len);
    snprintf(h.domain, sizeof h.domain, "%.*s", (int)zmq_msg_size(&f[4]), (const char *)zmq_msg_data(&f[4]));
    snprintf(h.address, sizeof h.address, "%.*s", (int)zmq_msg_size(&f[5]), (const char *)zmq_msg_data(&f[5]));
    bool curve = zmq_msg_size(&f[7]) == 5 && memcmp(zmq_msg_data(&f[7]), "CURVE", 5) == 0;
    if (curve && n >= 9 && zmq_msg_size(&f[8]) == 32) zmq_z85_encode(h.key, zmq_msg_data(&f[8]), 32);
    h.since_ms = zio_now_ms();
    if (zio_zap_decide(z, &h, curve, true)) return;
    /* Held: the oldest gives way when the list is full (its peer's
     * handshake has most likely timed out and been retried already). */
    if (z->n_held == ZIO_ZAP_HELD_MAX) {
        zio_zap_decide(z, &z->held[0], true, false);
        memmove(&z->held[0], &z->held[1], (ZIO_ZAP_HELD_MAX - 1) * sizeof z->held[0]);
        z->n_held--;
    }
    z->held[z->n_held++] = h;
}

/* After a list change: answers the held requests whose domain has keys now. */
static void zio_zap_release(zio_zap *z) {
    size_t keep = 0;
    for (size_t i = 0; i < z->n_held; i++)
        if (!zio_zap_decide(z, &z->held[i], true, true)) z->held[keep++] = z->held[i];
    z->n_held = keep;
}

static void *zio_zap_main(void *arg) {
    zio_zap *z = arg;
    zmq_msg_t f[10];
    unsigned seen = atomic_load(&z->gen);
    int64_t next_sweep = zio_now_ms() + 100;
    while (!atomic_load(&z->stop)) {
        unsigned gen = atomic_load(&z->gen);
        if (gen != seen || (z->n_held && zio_now_ms() >= next_sweep)) {
            seen = gen;
            next_sweep = zio_now_ms() + 100;
            zio_zap_release(z);
        }
        zmq_pollitem_t it = {z->sock, 0, ZMQ_POLLIN, 0};
        /* A short wait, so that zio_zap_stop and list changes are seen
         * without a wake-up socket. */
        if (zmq_poll(&it, 1, z->n_held ? 20 : 100) <= 0) continue;
        int n = 0;
        bool more = true;
        while (more) {
            zmq_msg_t m;
            zmq_msg_init(&m);
            if (zmq_msg_recv(&m, z->sock, ZMQ_DONTWAIT) < 0) {
                zmq_msg_close(&m);
                break;
            }
            more = zmq_msg_more(&m);
            if (n < 10) f[n++] = m;
            else zmq_msg_close(&m);
        }
        zio_zap_handle(z, f, n);
        for (int i = 0; i < n; i++) zmq_msg_close(&f[i]);
    }
    zmq_close(z->sock);
    return NULL;
}

int zio_zap_start(void *ctx, zio_zap **out, char *err, size_t errlen) {
    *out = NULL;
    zio_zap *z = calloc(1, sizeof *z);
    if (!z) return status_fail(err, errlen, STATUS_NO_MEMORY, "ZAP handler: out of memory");
    pthread_mutex_init(&z->mu, NULL);
    z->sock = zmq_socket(ctx, ZMQ_ROUTER);
    if (!z->sock || zmq_bind(z->sock, "inproc://zeromq.zap.01") != 0) {
        int e = errno;
        if (z->sock) zmq_close(z->sock);
        pthread_mutex_destroy(&z->mu);
        free(z);
        return status_fail(err, errlen, STATUS_IO, "ZAP handler: inproc://zeromq.zap.01: %s%s",
                           zmq_strerror(e),
                           e == EADDRINUSE ? " (one handler per ZeroMQ context)" : "");
    }
    int linger = 0;
    zmq_setsockopt(z->sock, ZMQ_LINGER, &linger, sizeof linger);
    if (pthread_create(&z->thread, NULL, zio_zap_main, z) != 0) {
        zmq_close(z->sock);
        pthread_mutex_destroy(&z->mu);
        free(z);
        return status_fail(err, errlen, STATUS_IO, "ZAP handler: cannot start its thread");
    }
    *out = z;
    return 0;
}

void zio_zap_stop(zio_zap *z) {
    if (!z) return;
    atomic_store(&z->stop, true);
    pthread_join(z->thread, NULL);
    for (size_t i = 0; i < z->n_domains; i++) free(z->d[i].keys);
    pthread_mutex_destroy(&z->mu);
    free(z);
}

static int zio_zap_put(zio_zap *z, const char *domain, const struct keys_entry *e, size_t n,
                       bool hold_others) {
    struct keys_entry *copy = NULL;
    if (n) {
        copy = malloc(n * sizeof *copy);
        if (!copy) return STATUS_NO_MEMORY;
        memcpy(copy, e, n * sizeof *copy);
    }
    pthread_mutex_lock(&z->mu);
    struct zio_zap_domain *d = zio_zap_slot(z, domain, true);
    if (d) {
        free(d->keys);
        d->keys = copy;
        d->n = n;
        d->hold_others = hold_others;
    }
    pthread_mutex_unlock(&z->mu);
    if (!d) {
        free(copy);
        return STATUS_BAD_INPUT;
    }
    atomic_fetch_add(&z->gen, 1);
    return 0;
}

int zio_zap_set(zio_zap *z, const char *domain, const struct keys_list *l) {
    return zio_zap_put(z, domain, l ? l->e : NULL, l ? l->n : 0, false);
}

int zio_zap_set_one(zio_zap *z, const char *domain, const char *pub, const char *name) {
    if (!pub || !pub[0]) return zio_zap_put(z, domain, NULL, 0, true);
    if (!keys_z85_valid(pub)) return STATUS_BAD_INPUT;
    struct keys_entry e;
    memcpy(e.pub, pub, KEYS_Z85_LEN + 1);
    snprintf(e.name, sizeof e.name, "%s", name ? name : "");
    return zio_zap_put(z, domain, &e, 1, true);
}

static uint64_t zio_zap_count(zio_zap *z, const char *domain, bool refused) {
    pthread_mutex_lock(&z->mu);
    struct zio_zap_domain *d = zio_zap_slot(z, domain, false);
    uint64_t v = d ? (refused ? d->refused : d->admitted) : 0;
    pthread_mutex_unlock(&z->mu);
    return v;
}

uint64_t zio_zap_refused(zio_zap *z, const char *domain) { return zio_zap_count(z, domain, true); }
uint64_t zio_zap_admitted(zio_zap *z, const char *domain) { return zio_zap_count(z, domain, false); }
