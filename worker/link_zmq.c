/* The ZeroMQ link: PUSH (stage k) -> PULL (stage k+1) over TCP, for the
 * CPU backend.  Each message is two frames: a 32-byte header (magic, flags,
 * epoch, step id, payload size, little-endian) and the hidden states, as
 * F32 or the element type the sender chose (link_set_dtype).
 * Timeouts on both ends turn a vanished peer into STATUS_TIMEOUT.  With
 * keys, the listener admits only the predecessor the router placed; what
 * an admitted peer sends that is not a link message is dropped and counted,
 * never failing a step. */
#include "link.h"
#include "link-impl.h"

#include "common/log.h"
#include "common/status.h"
#include "common/zio.h"

#include <stdatomic.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#define LINK_ZMQ_MAGIC 0x314b4c4cu /* "LLK1" */
#define LINK_ZMQ_HEADER 32
#define LINK_ZMQ_SKIPPED 1u
/* The header's flags word: bit 0 skipped, bits 8..11 the element type
 * (enum link_dtype), bits 12..31 the row width (INT8's scales are per block of a row).
 * The size word is the F32 bytes the rows decode to; the body frame holds
 * link_dtype_wire_bytes of them. */
#define LZ_DTYPE_SHIFT 8
#define LZ_ROW_SHIFT 12

struct link_zmq {
    struct link_conn base;
    struct zio_sock *sock;
    int timeout_ms;
    /* A message of a later step, received while waiting for an earlier one. */
    struct zio_parts held;
    int has_held;
    /* A message of a later epoch: its stage may get its new placement first.
     * It waits here, apart, so that it never stands in the way of the
     * current epoch's steps (one slot: a newer one replaces it). */
    struct zio_parts future;
    int has_future;
    int64_t future_at; /* when it came (monotonic ms) */
    struct zio_parts in;
    /* The sender's element type and row width, and its encoding buffer
     * (grown to the largest message once, then reused). */
    enum link_dtype dtype;
    size_t row;
    uint8_t *enc;
    size_t enc_cap;
};

/* Steps of one epoch that can be ahead of the one a stage waits for: the
 * micro-batches in flight are far fewer.  A message further ahead cannot
 * come from the placed predecessor and would hold every later step. */
#define LZ_AHEAD_MAX 4096

/* Once the previous stage has sent a later epoch's message, a step of the
 * current epoch is waited for this much longer at most: the sender dropped
 * this epoch's plans, and what it sent before the later message is already
 * here or in flight.  A stage that fell behind (plans queued while it was
 * cut off from its predecessor) then catches up at once instead of waiting
 * out the link timeout once per stale plan.  A later-epoch message older
 * than LZ_FUTURE_FRESH_TIMEOUTS link timeouts no longer shortens waits, so
 * that a forged one (a plain link admits anyone) cannot do so for long. */
#define LZ_EPOCH_GRACE_MS 100
/* A send waiting for room looks for a new placement this often. */
#define LZ_SEND_SLICE_MS 100
#define LZ_FUTURE_FRESH_TIMEOUTS 10

static void lz_put64(uint8_t *p, uint64_t v) {
    for (int i = 0; i < 8; i++) p[i] = (uint8_t)(v >> (8 * i));
}
static uint64_t lz_get64(const uint8_t *p) {
    uint64_t v = 0;
    for (int i = 0; i < 8; i++) v |= (uint64_t)p[i] << (8 * i);
    return v;
}

static int64_t lz_now_ms(void) {
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (int64_t)ts.tv_sec * 1000 + ts.tv_nsec / 1000000;
}

static int lz_send(link_conn *l, uint64_t step_id, const void *buf, size_t bytes) {
    struct link_zmq *z = (struct link_zmq *)l;
    enum link_dtype t = buf ? z->dtype : LINK_DTYPE_F32;
    const void *body = buf;
    size_t wire = buf ? link_dtype_wire_bytes(t, bytes, z->row) : 0;
    if (t != LINK_DTYPE_F32) {
        if (bytes % (z->row * sizeof(float)) != 0)
            return link_fail(l, STATUS_BAD_INPUT, "zmq link to %s: step %llu: %zu bytes are not whole "
                             "rows of %zu floats", l->endpoint, (unsigned long long)step_id, bytes, z->row);
        if (wire > z->enc_cap) {
            uint8_t *p = realloc(z->enc, wire);
            if (!p)
                return link_fail(l, STATUS_NO_MEMORY, "zmq link to %s: %zu bytes to encode step %llu",
                                 l->endpoint, wire, (unsigned long long)step_id);
            z->enc = p;
            z->enc_cap = wire;
        }
        link_encode(t, buf, bytes / sizeof(float), z->row, z->enc);
        body = z->enc;
    }
    uint8_t hdr[LINK_ZMQ_HEADER];
    uint32_t flags = (buf ? 0 : LINK_ZMQ_SKIPPED) | (uint32_t)t << LZ_DTYPE_SHIFT |
                     (t == LINK_DTYPE_INT8 ? (uint32_t)z->row << LZ_ROW_SHIFT : 0);
    lz_put64(hdr, (uint64_t)LINK_ZMQ_MAGIC | (uint64_t)flags << 32);
    lz_put64(hdr + 8, l->epoch);
    lz_put64(hdr + 16, step_id);
    lz_put64(hdr + 24, bytes);
    struct zio_frame f[2] = {{hdr, sizeof hdr, NULL, NULL}, {body, wire, NULL, NULL}};
    /* Wait for room in slices, so that a new placement (link_set_abort)
     * ends the wait; the frames are copied on each try, the first part
     * taken means the whole message is. */
    const uint64_t gen0 = l->abort_gen ? atomic_load(l->abort_gen) : 0;
    const int64_t deadline = z->timeout_ms < 0 ? -1 : lz_now_ms() + z->timeout_ms;
    int rc;
    for (;;) {
        rc = zio_send(z->sock, f, 2, ZMQ_DONTWAIT);
        if (rc != STATUS_EXHAUSTED) break;
        if (l->abort_gen && atomic_load(l->abort_gen) != gen0)
            return link_fail(l, STATUS_CANCELLED, "zmq link to %s: step %llu: a new placement arrived while "
                             "waiting for the next stage", l->endpoint, (unsigned long long)step_id);
        const int64_t left = deadline < 0 ? LZ_SEND_SLICE_MS : deadline - lz_now_ms();
        if (left <= 0) break;
        struct zio_sock *socks[1] = {z->sock};
        const short ev[1] = {ZMQ_POLLOUT};
        short rev[1] = {0};
        if (zio_poll(socks, ev, rev, 1, left < LZ_SEND_SLICE_MS ? (int)left : LZ_SEND_SLICE_MS) < 0) {
            rc = zio_err(z->sock);
            break;
        }
    }
    if (rc == STATUS_EXHAUSTED)
        return link_fail(l, STATUS_TIMEOUT,
                         "zmq link to %s: step %llu (%zu bytes) not taken within %d ms: is the "
                         "next stage running?",
                         l->endpoint, (unsigned long long)step_id, bytes, z->timeout_ms);
    if (rc < 0) return link_fail(l, rc, "zmq link: %s", zio_errstr(z->sock));
    l->wire_sent += sizeof hdr + wire;
    return STATUS_OK;
}

static int lz_set_dtype(link_conn *l, enum link_dtype t, size_t row_elems) {
    struct link_zmq *z = (struct link_zmq *)l;
    z->dtype = t;
    z->row = row_elems;
    return STATUS_OK;
}

/* Checks a message's framing; fills its epoch, step, flags and size.
 * STATUS_PROTOCOL with why filled when it is not a link message. */
static int lz_parse(const struct zio_parts *p, uint64_t *epoch, uint64_t *step, uint32_t *flags,
                    uint64_t *bytes, char *why, size_t whylen) {
    if (p->n != 2 || zio_parts_size(p, 0) != LINK_ZMQ_HEADER) {
        snprintf(why, whylen, "%zu frames, header %zu bytes; want 2 frames, header %d bytes", p->n,
                 zio_parts_size(p, 0), LINK_ZMQ_HEADER);
        return STATUS_PROTOCOL;
    }
    const uint8_t *h = zio_parts_data(p, 0);
    uint64_t w0 = lz_get64(h);
    if ((uint32_t)w0 != LINK_ZMQ_MAGIC) {
        snprintf(why, whylen, "bad magic 0x%08x", (unsigned)(uint32_t)w0);
        return STATUS_PROTOCOL;
    }
    *flags = (uint32_t)(w0 >> 32);
    *epoch = lz_get64(h + 8);
    *step = lz_get64(h + 16);
    *bytes = lz_get64(h + 24);
    size_t body = zio_parts_size(p, 1);
    unsigned t = (*flags >> LZ_DTYPE_SHIFT) & 15u;
    size_t row = *flags >> LZ_ROW_SHIFT;
    if (t >= LINK_DTYPE_N || (t == LINK_DTYPE_INT8 && row == 0) ||
        (t != LINK_DTYPE_F32 && *bytes % ((t == LINK_DTYPE_INT8 ? row : 1) * sizeof(float)) != 0)) {
        snprintf(why, whylen, "step %llu: element type %u, row %zu for %llu bytes", (unsigned long long)*step,
                 t, row, (unsigned long long)*bytes);
        return STATUS_PROTOCOL;
    }
    size_t want = (*flags & LINK_ZMQ_SKIPPED) ? 0 : link_dtype_wire_bytes((enum link_dtype)t, *bytes, row);
    if (body != want) {
        snprintf(why, whylen, "step %llu: header says %llu bytes as %s (%zu on the wire)%s, frame has %zu",
                 (unsigned long long)*step, (unsigned long long)*bytes, link_dtype_names[t], want,
                 (*flags & LINK_ZMQ_SKIPPED) ? " (a skip marker has none)" : "", body);
        return STATUS_PROTOCOL;
    }
    return STATUS_OK;
}

/* Counts a dropped message; logs the first ten of each reason, then every
 * thousandth, so that a peer sending garbage cannot flood the log. */
static void lz_drop(struct link_zmq *z, enum link_drop reason, const char *what) {
    uint64_t n = ++z->base.dropped[reason];
    if (reason == LINK_DROP_STALE) return; /* normal after a failed or dropped step */
    if (n <= 10 || n % 1000 == 0)
        LOG(LL_WARN, "zmq link %s: dropped %s (%llu %s messages dropped so far)", z->base.endpoint,
            what, (unsigned long long)n, link_drop_name(reason));
}


static int lz_recv(link_conn *l, uint64_t step_id, void *buf, size_t bytes) {
    struct link_zmq *z = (struct link_zmq *)l;
    /* A later epoch's message whose epoch has come: it is next in line. */
    if (z->has_future && !z->has_held) {
        const uint8_t *h = z->future.n == 2 && zio_parts_size(&z->future, 0) == LINK_ZMQ_HEADER
                               ? zio_parts_data(&z->future, 0) : NULL;
        uint64_t fe = h ? lz_get64(h + 8) : 0;
        if (fe == l->epoch) {
            struct zio_parts t = z->held;
            z->held = z->future;
            z->future = t;
            z->has_held = 1;
            z->has_future = 0;
        } else if (fe < l->epoch) {
            z->has_future = 0;
        }
    }
    /* One deadline for the whole call: messages that are dropped (a peer
     * sending garbage) do not extend the wait. */
    int64_t start = lz_now_ms(), deadline = start + z->timeout_ms;
    uint64_t malformed0 = l->dropped[LINK_DROP_MALFORMED];
    const uint64_t gen0 = l->abort_gen ? atomic_load(l->abort_gen) : 0;
    for (;;) {
        struct zio_parts *p;
        if (z->has_future && start - z->future_at < (int64_t)LZ_FUTURE_FRESH_TIMEOUTS * z->timeout_ms) {
            int64_t grace = (z->future_at > start ? z->future_at : start) + LZ_EPOCH_GRACE_MS;
            if (grace < deadline) deadline = grace;
        }
        if (z->has_held) {
            p = &z->held;
        } else {
            /* In slices, so that a new placement (link_set_abort) ends the
             * wait: the step it replaces will never come. */
            int64_t left = deadline - lz_now_ms();
            int slice = left <= 0 ? 0 : l->abort_gen && left > LZ_SEND_SLICE_MS ? LZ_SEND_SLICE_MS : (int)left;
            int rc = zio_recv(z->sock, &z->in, slice);
            if (rc == STATUS_TIMEOUT && lz_now_ms() < deadline) {
                if (l->abort_gen && atomic_load(l->abort_gen) != gen0)
                    return link_fail(l, STATUS_CANCELLED, "zmq link %s: step %llu: a new placement arrived "
                                     "while waiting for the previous stage", l->endpoint,
                                     (unsigned long long)step_id);
                continue;
            }
            if (rc == STATUS_TIMEOUT && z->has_future && deadline < start + z->timeout_ms) {
                const uint8_t *fh = zio_parts_data(&z->future, 0);
                return link_fail(l, STATUS_NOT_FOUND,
                                 "zmq link %s: step %llu (epoch %llu) did not come, and the "
                                 "previous stage is at a later epoch %llu",
                                 l->endpoint, (unsigned long long)step_id,
                                 (unsigned long long)l->epoch, (unsigned long long)lz_get64(fh + 8));
            }
            if (rc == STATUS_TIMEOUT) {
                uint64_t bad = l->dropped[LINK_DROP_MALFORMED] - malformed0;
                char also[96] = "";
                if (bad)
                    snprintf(also, sizeof also, " (%llu malformed messages dropped meanwhile)",
                             (unsigned long long)bad);
                return link_fail(l, STATUS_TIMEOUT,
                                 "zmq link %s: step %llu: nothing from the previous stage within "
                                 "%d ms%s",
                                 l->endpoint, (unsigned long long)step_id, z->timeout_ms, also);
            }
            if (rc < 0) return link_fail(l, rc, "zmq link: %s", zio_errstr(z->sock));
            p = &z->in;
        }
        uint64_t epoch = 0, step = 0, size = 0;
        uint32_t flags = 0;
        char why[160];
        if (lz_parse(p, &epoch, &step, &flags, &size, why, sizeof why) < 0) {
            /* Not from a stage of this build: whoever sent it, the step's
             * own message may still come. */
            if (p == &z->held) z->has_held = 0;
            char what[200];
            snprintf(what, sizeof what, "a malformed message (%s)", why);
            lz_drop(z, LINK_DROP_MALFORMED, what);
            continue;
        }
        /* Stale: a step of an older epoch, or one whose plan we dropped. */
        if (epoch < l->epoch || (epoch == l->epoch && step < step_id)) {
            z->has_held = 0;
            lz_drop(z, LINK_DROP_STALE, "a stale message");
            continue;
        }
        if (epoch > l->epoch) {
            if (z->has_future) {
                char what[160];
                snprintf(what, sizeof what, "a later-epoch message replaced by a newer one (epoch "
                         "%llu, step %llu)", (unsigned long long)epoch, (unsigned long long)step);
                lz_drop(z, LINK_DROP_AHEAD, what);
            }
            if (p == &z->in) {
                struct zio_parts t = z->future;
                z->future = z->in;
                z->in = t;
            } else {
                struct zio_parts t = z->future;
                z->future = z->held;
                z->held = t;
                z->has_held = 0;
            }
            z->has_future = 1;
            z->future_at = lz_now_ms();
            continue;
        }
        if (step - step_id > LZ_AHEAD_MAX) {
            z->has_held = 0;
            char what[160];
            snprintf(what, sizeof what, "a step too far ahead (epoch %llu, step %llu, waiting for "
                     "%llu)", (unsigned long long)epoch, (unsigned long long)step,
                     (unsigned long long)step_id);
            lz_drop(z, LINK_DROP_AHEAD, what);
            continue;
        }
        if (step > step_id) {
            if (p == &z->in) {
                struct zio_parts t = z->held;
                z->held = z->in;
                z->in = t;
                z->has_held = 1;
            }
            return link_fail(l, STATUS_NOT_FOUND,
                             "zmq link %s: waiting for step %llu (epoch %llu), the previous "
                             "stage sent step %llu (epoch %llu)",
                             l->endpoint, (unsigned long long)step_id,
                             (unsigned long long)l->epoch, (unsigned long long)step,
                             (unsigned long long)epoch);
        }
        z->has_held = 0;
        if (flags & LINK_ZMQ_SKIPPED) return LINK_SKIPPED;
        if (size != bytes)
            return link_fail(l, STATUS_PROTOCOL,
                             "zmq link %s: step %llu has %llu bytes, expected %zu", l->endpoint,
                             (unsigned long long)step_id, (unsigned long long)size, bytes);
        unsigned t = (flags >> LZ_DTYPE_SHIFT) & 15u;
        if (bytes && t == LINK_DTYPE_F32) memcpy(buf, zio_parts_data(p, 1), bytes);
        else if (bytes) link_decode((enum link_dtype)t, zio_parts_data(p, 1), bytes / sizeof(float), flags >> LZ_ROW_SHIFT, buf);
        return STATUS_OK;
    }
}

static void lz_free(link_conn *l) {
    struct link_zmq *z = (struct link_zmq *)l;
    zio_parts_free(&z->held);
    zio_parts_free(&z->future);
    zio_parts_free(&z->in);
    zio_sock_close(z->sock);
    free(z->enc);
    free(z);
}

static const struct link_ops link_zmq_ops = {"zmq", 0, lz_send, lz_recv, lz_free, lz_set_dtype};

int link_zmq_init(link_conn **out, void *ctx, enum link_dir dir, const char *endpoint,
                  int timeout_ms, char *err, size_t errlen) {
    return link_zmq_init_curve(out, ctx, dir, endpoint, timeout_ms, NULL, NULL, err, errlen);
}

int link_zmq_init_curve(link_conn **out, void *ctx, enum link_dir dir, const char *endpoint,
                        int timeout_ms, const struct keys_pair *own, const char *peer_key, char *err,
                        size_t errlen) {
    *out = NULL;
    if (!endpoint || !*endpoint || timeout_ms <= 0) {
        snprintf(err, errlen, "zmq link: endpoint \"%s\" and timeout %d ms: need an endpoint and a "
                 "timeout > 0", endpoint ? endpoint : "(null)", timeout_ms);
        return STATUS_BAD_INPUT;
    }
    struct link_zmq *z = calloc(1, sizeof *z);
    if (!z) {
        snprintf(err, errlen, "zmq link %s: out of memory", endpoint);
        return STATUS_NO_MEMORY;
    }
    z->base.ops = &link_zmq_ops;
    z->base.dir = dir;
    z->timeout_ms = timeout_ms;
    int rc = zio_sock_open(ctx, dir == LINK_SEND ? ZMQ_PUSH : ZMQ_PULL, &z->sock, err, errlen);
    if (rc < 0) {
        free(z);
        return rc;
    }
    /* No ZMTP heartbeats on a link (common/zio.h sets them on every other
     * socket): a receiver reads only inside a step and holds 8 messages at
     * most, and a ZeroMQ engine that cannot hand on what it reads stops
     * reading, heartbeats included, so a busy or idle next stage would have
     * its predecessor drop the connection and the messages queued on it.
     * --link-timeout-ms and the router's step timeout bound a dead link. */
    rc = zio_set_int(z->sock, ZMQ_HEARTBEAT_IVL, 0);
    /* Before bind or connect: the security mechanism is fixed then. */
    if (rc < 0) {
        /* reported below */
    } else if (own && dir == LINK_SEND) rc = zio_curve_client(z->sock, own, peer_key);
    if (rc == 0 && own && dir == LINK_RECV) rc = zio_curve_server(z->sock, own, LINK_ZAP_DOMAIN);
    if (rc < 0) {
        /* nothing more to set up: reported below */
    } else if (dir == LINK_SEND) {
        /* IMMEDIATE: queue only to a connected peer, so a stage that is gone
         * makes the send time out (lz_send waits up to the timeout) instead
         * of piling up messages for it.  With CURVE a peer counts as
         * connected only after its handshake, so a listener that does not
         * admit this key looks like one that is gone. */
        rc = zio_set_int(z->sock, ZMQ_IMMEDIATE, 1);
        if (rc == 0) rc = zio_set_int(z->sock, ZMQ_SNDHWM, 8);
        if (rc == 0) rc = zio_connect(z->sock, endpoint);
    } else {
        rc = zio_set_int(z->sock, ZMQ_RCVHWM, 8);
        if (rc == 0) rc = zio_bind(z->sock, endpoint);
    }
    if (rc < 0) {
        snprintf(err, errlen, "zmq link: %s", zio_errstr(z->sock));
        zio_sock_close(z->sock);
        free(z);
        return rc;
    }
    snprintf(z->base.endpoint, sizeof z->base.endpoint, "%s",
             dir == LINK_SEND ? endpoint : zio_endpoint(z->sock));
    *out = &z->base;
    return STATUS_OK;
}
