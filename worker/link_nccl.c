/* The NCCL link between two GPU stages: a 2-rank communicator of its own
 * (stage k is rank 0, k+1 rank 1), bootstrapped through Redis: stage k
 * publishes the ncclUniqueId under the link's key, stage k+1 polls for it.
 * Sends and receives go on the CUDA backend's stream, in order with the
 * stage's kernels, so nothing synchronizes.  The step id is implicit: both
 * stages execute the same plans in the same order, and NCCL keeps order. */
#include "link.h"
#include "link-impl.h"

#include "common/log.h"
#include "common/rconn.h"
#include "common/status.h"

#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#if defined(LLM_HAVE_CUDA)
#include "kernels/cuda/nccl_link.h"
#include "kernels/cuda/stream_access.h"

/* The id is needed only while the pair connects; it expires in case the
 * pipeline is re-formed under a new epoch and this key is never read. */
#define LINK_NCCL_ID_TTL_MS (3600 * 1000)

struct link_nccl {
    struct link_conn base;
    void *comm;
    void *stream;
    int peer;
};

static int ln_send(link_conn *l, uint64_t step_id, const void *buf, size_t bytes) {
    struct link_nccl *n = (struct link_nccl *)l;
    if (!buf) return STATUS_OK; /* nothing to tell: the peer fails the same plan itself */
    char err[256];
    int rc = nccl_link_send(n->comm, buf, bytes, n->peer, n->stream, err, sizeof err);
    if (rc < 0)
        return link_fail(l, rc, "nccl link %s: step %llu (%zu bytes): %s", l->endpoint,
                         (unsigned long long)step_id, bytes, err);
    return STATUS_OK;
}

static int ln_recv(link_conn *l, uint64_t step_id, void *buf, size_t bytes) {
    struct link_nccl *n = (struct link_nccl *)l;
    char err[256];
    int rc = nccl_link_recv(n->comm, buf, bytes, n->peer, n->stream, err, sizeof err);
    if (rc < 0)
        return link_fail(l, rc, "nccl link %s: step %llu (%zu bytes): %s", l->endpoint,
                         (unsigned long long)step_id, bytes, err);
    return STATUS_OK;
}

static void ln_free(link_conn *l) {
    struct link_nccl *n = (struct link_nccl *)l;
    nccl_link_comm_free(n->comm);
    free(n);
}

/* The stages convert to and from F16 on the GPU around the link. */
static int ln_set_dtype(link_conn *l, enum link_dtype t, size_t row_elems) {
    (void)row_elems;
    if (t == LINK_DTYPE_F16) return STATUS_OK;
    return link_fail(l, STATUS_UNSUPPORTED, "nccl link: carries f16 only, not %s", link_dtype_names[t]);
}

static const struct link_ops link_nccl_ops = {"nccl", 1, ln_send, ln_recv, ln_free, ln_set_dtype};

static double ln_now_ms(void) {
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return ts.tv_sec * 1e3 + ts.tv_nsec * 1e-6;
}

int link_nccl_init(link_conn **out, backend *b, enum link_dir dir, void *redis,
                   const char *nccl_key, int timeout_ms, char *err, size_t errlen) {
    *out = NULL;
    void *stream = backend_cuda_stream(b);
    int device = backend_cuda_device(b);
    if (!stream || device < 0) {
        snprintf(err, errlen, "nccl link %s: backend %s is not a CUDA backend", nccl_key,
                 b ? backend_name(b) : "(none)");
        return STATUS_UNSUPPORTED;
    }
    if (!redis) {
        snprintf(err, errlen, "nccl link %s: needs Redis (--redis) to exchange the NCCL id",
                 nccl_key);
        return STATUS_BAD_INPUT;
    }
    struct rconn *rc_conn = redis;
    uint8_t id[NCCL_LINK_ID_BYTES];
    int rc;
    if (dir == LINK_SEND) {
        rc = nccl_link_get_id(device, id, err, errlen);
        if (rc < 0) return rc;
        rc = rconn_set(rc_conn, nccl_key, id, sizeof id, LINK_NCCL_ID_TTL_MS);
        if (rc < 0) {
            snprintf(err, errlen, "nccl link %s: publishing the id: %s", nccl_key,
                     rconn_errstr(rc_conn));
            return rc;
        }
    } else {
        double deadline = ln_now_ms() + timeout_ms;
        for (;;) {
            void *val = NULL;
            size_t len = 0;
            rc = rconn_get(rc_conn, nccl_key, &val, &len);
            if (rc == STATUS_OK && len == sizeof id) {
                memcpy(id, val, sizeof id);
                free(val);
                break;
            }
            free(val);
            if (rc == STATUS_OK) {
                snprintf(err, errlen, "nccl link %s: the id in Redis has %zu bytes, want %zu",
                         nccl_key, len, sizeof id);
                return STATUS_PROTOCOL;
            }
            if (rc != STATUS_NOT_FOUND) {
                snprintf(err, errlen, "nccl link %s: reading the id: %s", nccl_key,
                         rconn_errstr(rc_conn));
                return rc;
            }
            if (ln_now_ms() > deadline) {
                snprintf(err, errlen, "nccl link %s: the previous stage published no id within %d ms",
                         nccl_key, timeout_ms);
                return STATUS_TIMEOUT;
            }
            struct timespec ts = {0, 50 * 1000000};
            nanosleep(&ts, NULL);
        }
    }
    struct link_nccl *n = calloc(1, sizeof *n);
    if (!n) {
        snprintf(err, errlen, "nccl link %s: out of memory", nccl_key);
        return STATUS_NO_MEMORY;
    }
    int rank = dir == LINK_SEND ? 0 : 1;
    rc = nccl_link_comm_init(&n->comm, id, 2, rank, device, timeout_ms, err, errlen);
    if (rc < 0) {
        free(n);
        return rc;
    }
    n->base.ops = &link_nccl_ops;
    n->base.dir = dir;
    n->stream = stream;
    n->peer = 1 - rank;
    snprintf(n->base.endpoint, sizeof n->base.endpoint, "%s", nccl_key);
    LOG(LL_INFO, "nccl link %s: rank %d of 2 on cuda:%d ready", nccl_key, rank, device);
    *out = &n->base;
    return STATUS_OK;
}

#else /* built without CUDA */

int link_nccl_init(link_conn **out, backend *b, enum link_dir dir, void *redis,
                   const char *nccl_key, int timeout_ms, char *err, size_t errlen) {
    *out = NULL;
    snprintf(err, errlen, "nccl link %s: this build has no CUDA backend; use the ZeroMQ link",
             nccl_key);
    return STATUS_UNSUPPORTED;
}

#endif
