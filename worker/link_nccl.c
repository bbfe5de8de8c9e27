/* The NCCL link between two GPU stages: a 2-rank communicator of its own
 * (stage k is rank 0, k+1 rank 1), bootstrapped through Redis: stage k
 * publishes the ncclUniqueId and its element type under the link's key,
 * stage k+1 polls for it and answers with its own type, and both check
 * that the types agree (the wire has no header to say).  The encoding,
 * sends, receives and decoding go on the CUDA backend's stream, in order
 * with the stage's kernels, so nothing synchronizes.  The step id is
 * implicit: both stages execute the same plans in the same order, and NCCL
 * keeps order. */
#include "link.h"
#include "link-impl.h"

#include "common/log.h"
#include "common/rconn.h"
#include "common/status.h"

#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

/* The id is needed only while the pair connects; it expires in case the
 * pipeline is re-formed under a new epoch and this key is never read. */
#define LINK_NCCL_ID_TTL_MS (3600 * 1000)

static double ln_now_ms(void) {
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return ts.tv_sec * 1e3 + ts.tv_nsec * 1e-6;
}

static void ln_put32(uint8_t *p, uint32_t v) {
    for (int i = 0; i < 4; i++) p[i] = (uint8_t)(v >> (8 * i));
}
static uint32_t ln_get32(const uint8_t *p) {
    return (uint32_t)p[0] | (uint32_t)p[1] << 8 | (uint32_t)p[2] << 16 | (uint32_t)p[3] << 24;
}

/* Polls key until it holds want bytes (into val) or timeout_ms passes. */
static int ln_wait_key(struct rconn *r, const char *key, uint8_t *val, size_t want, int timeout_ms,
                       const char *who, char *err, size_t errlen) {
    double deadline = ln_now_ms() + timeout_ms;
    for (;;) {
        void *got = NULL;
        size_t len = 0;
        int rc = rconn_get(r, key, &got, &len);
        if (rc == STATUS_OK && len == want) memcpy(val, got, want);
        free(got);
        if (rc == STATUS_OK && len == want) return STATUS_OK;
        if (rc == STATUS_OK) {
            snprintf(err, errlen, "nccl link %s: %s's value in Redis has %zu bytes, want %zu (a worker "
                     "of another version?)", key, who, len, want);
            return STATUS_PROTOCOL;
        }
        if (rc != STATUS_NOT_FOUND) {
            snprintf(err, errlen, "nccl link %s: reading %s's value: %s", key, who, rconn_errstr(r));
            return rc;
        }
        if (ln_now_ms() > deadline) {
            snprintf(err, errlen, "nccl link %s: %s published nothing within %d ms", key, who, timeout_ms);
            return STATUS_TIMEOUT;
        }
        struct timespec ts = {0, 50 * 1000000};
        nanosleep(&ts, NULL);
    }
}

int link_nccl_exchange(void *redis, const char *nccl_key, enum link_dir dir, uint8_t *id,
                       enum link_dtype t, size_t row_elems, int timeout_ms, char *err, size_t errlen) {
    struct rconn *r = redis;
    char rx_key[192];
    snprintf(rx_key, sizeof rx_key, "%s:rx", nccl_key);
    /* The sender's value: the id, its type, its row width; the receiver's
     * answer: its type and width (little-endian u32 each). */
    uint8_t val[LINK_NCCL_ID_BYTES + 8], peer[8];
    int rc;
    if (dir == LINK_SEND) {
        memcpy(val, id, LINK_NCCL_ID_BYTES);
        ln_put32(val + LINK_NCCL_ID_BYTES, (uint32_t)t);
        ln_put32(val + LINK_NCCL_ID_BYTES + 4, (uint32_t)row_elems);
        /* An answer left by an earlier attempt at this epoch is not this one's. */
        rc = rconn_del(r, rx_key);
        if (rc >= 0) rc = rconn_set(r, nccl_key, val, sizeof val, LINK_NCCL_ID_TTL_MS);
        if (rc < 0) {
            snprintf(err, errlen, "nccl link %s: publishing the id: %s", nccl_key, rconn_errstr(r));
            return rc;
        }
        rc = ln_wait_key(r, rx_key, peer, sizeof peer, timeout_ms, "the next stage", err, errlen);
        if (rc < 0) return rc;
    } else {
        rc = ln_wait_key(r, nccl_key, val, sizeof val, timeout_ms, "the previous stage", err, errlen);
        if (rc < 0) return rc;
        memcpy(id, val, LINK_NCCL_ID_BYTES);
        memcpy(peer, val + LINK_NCCL_ID_BYTES, sizeof peer);
        uint8_t mine[8];
        ln_put32(mine, (uint32_t)t);
        ln_put32(mine + 4, (uint32_t)row_elems);
        /* Answered even when the types differ: the sender learns it from this. */
        rc = rconn_set(r, rx_key, mine, sizeof mine, LINK_NCCL_ID_TTL_MS);
        if (rc < 0) {
            snprintf(err, errlen, "nccl link %s: answering with this stage's type: %s", nccl_key,
                     rconn_errstr(r));
            return rc;
        }
    }
    uint32_t pt = ln_get32(peer), prow = ln_get32(peer + 4);
    if (pt != (uint32_t)t || prow != (uint32_t)row_elems) {
        const char *pname = pt < LINK_DTYPE_N ? link_dtype_names[pt] : "an unknown type";
        if (dir == LINK_SEND)
            snprintf(err, errlen, "nccl link %s: this stage sends %s rows of %zu, the next stage expects %s "
                     "rows of %u: every stage of a pipeline needs the same --link-dtype (and model)",
                     nccl_key, link_dtype_names[t], row_elems, pname, (unsigned)prow);
        else
            snprintf(err, errlen, "nccl link %s: the previous stage sends %s rows of %u, this stage expects "
                     "%s rows of %zu: every stage of a pipeline needs the same --link-dtype (and model)",
                     nccl_key, pname, (unsigned)prow, link_dtype_names[t], row_elems);
        return STATUS_BAD_INPUT;
    }
    return STATUS_OK;
}

#if defined(LLM_HAVE_CUDA)
#include "kernels/cuda/nccl_link.h"
#include "kernels/cuda/link_codec.h"
#include "kernels/cuda/stream_access.h"

_Static_assert(LINK_NCCL_ID_BYTES == NCCL_LINK_ID_BYTES, "link.h's id size is NCCL's");
_Static_assert(LINK_CODEC_F32 == (int)LINK_DTYPE_F32 && LINK_CODEC_F16 == (int)LINK_DTYPE_F16 &&
                   LINK_CODEC_BF16 == (int)LINK_DTYPE_BF16 && LINK_CODEC_INT8 == (int)LINK_DTYPE_INT8,
               "link_codec.h numbers its types as enum link_dtype");
_Static_assert(LINK_CODEC_INT8_BLOCK == LINK_INT8_BLOCK, "link_codec.h's INT8 blocks are link.h's");

struct link_nccl {
    struct link_conn base;
    backend *b; /* stage's allocator; outlives the link */
    void *comm;
    void *stream;
    int peer;
    enum link_dtype dtype;
    size_t row, bytes_max;
    void *stage; /* device memory: one message's wire bytes (NULL for F32, sent as is) */
};

/* A send or receive of bytes of F32 rows: at most bytes_max, whole rows
 * for the encoded types. */
static int ln_check(struct link_nccl *n, uint64_t step_id, size_t bytes) {
    if (bytes > n->bytes_max || (n->dtype != LINK_DTYPE_F32 && bytes % (n->row * sizeof(float)) != 0))
        return link_fail(&n->base, STATUS_BAD_INPUT, "nccl link %s: step %llu: %zu bytes are not whole rows "
                         "of %zu floats within the link's %zu", n->base.endpoint, (unsigned long long)step_id,
                         bytes, n->row, n->bytes_max);
    return STATUS_OK;
}

static int ln_send(link_conn *l, uint64_t step_id, const void *buf, size_t bytes) {
    struct link_nccl *n = (struct link_nccl *)l;
    if (!buf) return STATUS_OK; /* nothing to tell: the peer fails the same plan itself */
    int rc = ln_check(n, step_id, bytes);
    if (rc < 0) return rc;
    char err[256];
    const void *wire = buf;
    size_t wire_bytes = link_dtype_wire_bytes(n->dtype, bytes, n->row);
    if (n->stage) {
        rc = link_codec_encode(n->stream, (enum link_codec_type)n->dtype, buf, bytes / sizeof(float), n->row,
                               n->stage, err, sizeof err);
        if (rc < 0)
            return link_fail(l, rc, "nccl link %s: step %llu: encoding as %s: %s", l->endpoint,
                             (unsigned long long)step_id, link_dtype_names[n->dtype], err);
        wire = n->stage;
    }
    rc = nccl_link_send(n->comm, wire, wire_bytes, n->peer, n->stream, err, sizeof err);
    if (rc < 0)
        return link_fail(l, rc, "nccl link %s: step %llu (%zu bytes as %s): %s", l->endpoint,
                         (unsigned long long)step_id, wire_bytes, link_dtype_names[n->dtype], err);
    l->wire_sent += wire_bytes;
    return STATUS_OK;
}

static int ln_recv(link_conn *l, uint64_t step_id, void *buf, size_t bytes) {
    struct link_nccl *n = (struct link_nccl *)l;
    int rc = ln_check(n, step_id, bytes);
    if (rc < 0) return rc;
    char err[256];
    size_t wire_bytes = link_dtype_wire_bytes(n->dtype, bytes, n->row);
    rc = nccl_link_recv(n->comm, n->stage ? n->stage : buf, wire_bytes, n->peer, n->stream, err, sizeof err);
    if (rc < 0)
        return link_fail(l, rc, "nccl link %s: step %llu (%zu bytes as %s): %s", l->endpoint,
                         (unsigned long long)step_id, wire_bytes, link_dtype_names[n->dtype], err);
    if (n->stage) {
        rc = link_codec_decode(n->stream, (enum link_codec_type)n->dtype, n->stage, bytes / sizeof(float),
                               n->row, buf, err, sizeof err);
        if (rc < 0)
            return link_fail(l, rc, "nccl link %s: step %llu: decoding %s: %s", l->endpoint,
                             (unsigned long long)step_id, link_dtype_names[n->dtype], err);
    }
    return STATUS_OK;
}

static void ln_free(link_conn *l) {
    struct link_nccl *n = (struct link_nccl *)l;
    nccl_link_comm_free(n->comm);
    if (n->stage) backend_dealloc(n->b, n->stage);
    free(n);
}

/* The type was agreed with the peer at link_nccl_init: it stays. */
static int ln_set_dtype(link_conn *l, enum link_dtype t, size_t row_elems) {
    struct link_nccl *n = (struct link_nccl *)l;
    if (t == n->dtype && row_elems == n->row) return STATUS_OK;
    return link_fail(l, STATUS_UNSUPPORTED, "nccl link %s: carries %s rows of %zu, agreed with its peer at "
                     "link_nccl_init; not %s rows of %zu", l->endpoint, link_dtype_names[n->dtype], n->row,
                     link_dtype_names[t], row_elems);
}

static const struct link_ops link_nccl_ops = {"nccl", 1, ln_send, ln_recv, ln_free, ln_set_dtype};

int link_nccl_init(link_conn **out, backend *b, enum link_dir dir, void *redis,
                   const char *nccl_key, const struct link_nccl_opts *o, char *err, size_t errlen) {
    *out = NULL;
    void *stream = backend_cuda_stream(b);
    int device = backend_cuda_device(b);
    if (!stream || device < 0) {
        snprintf(err, errlen, "nccl link %s: backend %s is not a CUDA backend", nccl_key,
                 b ? backend_name(b) : "(none)");
        return STATUS_UNSUPPORTED;
    }
    if ((int)o->dtype < 0 || o->dtype >= LINK_DTYPE_N || o->row_elems == 0 ||
        o->row_elems >= ((size_t)1 << 20) || o->bytes_max == 0) {
        snprintf(err, errlen, "nccl link %s: element type %d, rows of %zu, at most %zu bytes: need a type "
                 "of enum link_dtype, rows of 1 to 2^20 - 1 elements and a size", nccl_key, (int)o->dtype,
                 o->row_elems, o->bytes_max);
        return STATUS_BAD_INPUT;
    }
    if (!redis) {
        snprintf(err, errlen, "nccl link %s: needs Redis (--redis) to exchange the NCCL id",
                 nccl_key);
        return STATUS_BAD_INPUT;
    }
    struct link_nccl *n = calloc(1, sizeof *n);
    if (!n) {
        snprintf(err, errlen, "nccl link %s: out of memory", nccl_key);
        return STATUS_NO_MEMORY;
    }
    n->b = b;
    n->dtype = o->dtype;
    n->row = o->row_elems;
    n->bytes_max = o->bytes_max;
    /* Before the exchange: a peer told to go ahead must find this end joining. */
    if (o->dtype != LINK_DTYPE_F32) {
        size_t wire = link_dtype_wire_bytes(o->dtype, o->bytes_max, o->row_elems);
        if (!(n->stage = backend_alloc(b, wire))) {
            snprintf(err, errlen, "nccl link %s: %zu bytes of device memory for %s rows: %s", nccl_key, wire,
                     link_dtype_names[o->dtype], backend_errstr(b));
            free(n);
            return STATUS_NO_MEMORY;
        }
    }
    uint8_t id[NCCL_LINK_ID_BYTES];
    int rc = dir == LINK_SEND ? nccl_link_get_id(device, id, err, errlen) : STATUS_OK;
    if (rc == STATUS_OK)
        rc = link_nccl_exchange(redis, nccl_key, dir, id, o->dtype, o->row_elems, o->timeout_ms, err, errlen);
    int rank = dir == LINK_SEND ? 0 : 1;
    if (rc == STATUS_OK) rc = nccl_link_comm_init(&n->comm, id, 2, rank, device, o->timeout_ms, err, errlen);
    if (rc < 0) {
        if (n->stage) backend_dealloc(b, n->stage);
        free(n);
        return rc;
    }
    n->base.ops = &link_nccl_ops;
    n->base.dir = dir;
    n->stream = stream;
    n->peer = 1 - rank;
    snprintf(n->base.endpoint, sizeof n->base.endpoint, "%s", nccl_key);
    LOG(LL_INFO, "nccl link %s: rank %d of 2 on cuda:%d ready, %s rows of %zu", nccl_key, rank, device,
        link_dtype_names[o->dtype], o->row_elems);
    *out = &n->base;
    return STATUS_OK;
}

#else /* built without CUDA */

int link_nccl_init(link_conn **out, backend *b, enum link_dir dir, void *redis,
                   const char *nccl_key, const struct link_nccl_opts *opts, char *err, size_t errlen) {
    *out = NULL;
    snprintf(err, errlen, "nccl link %s: this build has no CUDA backend; use the ZeroMQ link",
             nccl_key);
    return STATUS_UNSUPPORTED;
}

#endif
