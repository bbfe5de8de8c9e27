/* NCCL point-to-point behind the plain C prototypes of nccl_link.h: 2-rank
 * communicators made without blocking (so joining is bounded in time),
 * ncclSend/ncclRecv of raw bytes on the caller's stream.  Built without
 * NCCL, every function says so with STATUS_UNSUPPORTED. */
#include "nccl_link.h"

#include <cuda_runtime.h>
#include <stdio.h>
#include <string.h>
#include <time.h>

extern "C" {
#include "../../common/status.h"
}

extern "C" int nccl_link_set_device(int device, char *err, size_t errlen) {
    cudaError_t e = cudaSetDevice(device);
    if (e != cudaSuccess) {
        snprintf(err, errlen, "cudaSetDevice(%d): %s", device, cudaGetErrorString(e));
        return STATUS_INTERNAL;
    }
    return STATUS_OK;
}

#ifdef LLM_HAVE_NCCL
#include <nccl.h>

static_assert(sizeof(ncclUniqueId) == NCCL_LINK_ID_BYTES, "ncclUniqueId size changed");

/* Wraps every NCCL call: on failure, name the call and NCCL's reason. */
#define NCCL_CHECK(call)                                                                  \
    do {                                                                                  \
        ncclResult_t r_ = (call);                                                         \
        if (r_ != ncclSuccess && r_ != ncclInProgress) {                                  \
            snprintf(err, errlen, "%s (%s:%d): %s", #call, __FILE__, __LINE__,            \
                     ncclGetErrorString(r_));                                             \
            return STATUS_INTERNAL;                                                       \
        }                                                                                 \
    } while (0)

static double nl_now_ms(void) {
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return ts.tv_sec * 1e3 + ts.tv_nsec * 1e-6;
}

/* A non-blocking communicator may answer ncclInProgress: wait until the
 * call has really been taken (or failed), at most timeout_ms.  A send or
 * receive of a step is taken within microseconds and sits on every
 * token's path between two stages, so the wait polls without sleeping for
 * its first NL_SPIN_US: a sleep, however short it is asked to be, lasts
 * the thread's timer slack (50 us by default on Linux) or more, twice a
 * step (a send on one stage, a receive on the next).  Past that it naps,
 * from 20 us doubling to 1 ms, for what takes long, such as a
 * communicator's set-up. */
#define NL_SPIN_US 200
static int nl_wait(ncclComm_t comm, int timeout_ms, const char *what, char *err, size_t errlen) {
    const double start = nl_now_ms(), deadline = start + timeout_ms;
    long nap_ns = 20000;
    for (;;) {
        ncclResult_t st = ncclSuccess;
        ncclResult_t r = ncclCommGetAsyncError(comm, &st);
        if (r != ncclSuccess) st = r;
        if (st == ncclSuccess) return STATUS_OK;
        if (st != ncclInProgress) {
            snprintf(err, errlen, "%s: %s", what, ncclGetErrorString(st));
            return STATUS_INTERNAL;
        }
        const double now = nl_now_ms();
        if (now > deadline) {
            snprintf(err, errlen, "%s: the peer did not join within %d ms", what, timeout_ms);
            return STATUS_TIMEOUT;
        }
        if (now - start < NL_SPIN_US * 1e-3) continue;
        struct timespec ts = {0, nap_ns};
        nanosleep(&ts, NULL);
        if (nap_ns < 1000000) nap_ns = nap_ns * 2 < 1000000 ? nap_ns * 2 : 1000000;
    }
}

extern "C" int nccl_link_get_id(int device, void *id, char *err, size_t errlen) {
    int rc = nccl_link_set_device(device, err, errlen);
    if (rc != STATUS_OK) return rc;
    ncclUniqueId uid;
    NCCL_CHECK(ncclGetUniqueId(&uid));
    memcpy(id, &uid, sizeof uid);
    return STATUS_OK;
}

extern "C" int nccl_link_comm_init(void **out, const void *id, int n_ranks, int rank, int device,
                                   int timeout_ms, char *err, size_t errlen) {
    *out = NULL;
    int rc = nccl_link_set_device(device, err, errlen);
    if (rc != STATUS_OK) return rc;
    ncclUniqueId uid;
    memcpy(&uid, id, sizeof uid);
    ncclConfig_t config = NCCL_CONFIG_INITIALIZER;
    config.blocking = 0;
    ncclComm_t comm = NULL;
    NCCL_CHECK(ncclCommInitRankConfig(&comm, n_ranks, uid, rank, &config));
    char what[96];
    snprintf(what, sizeof what, "ncclCommInitRankConfig(rank %d of %d, cuda:%d)", rank, n_ranks,
             device);
    rc = nl_wait(comm, timeout_ms, what, err, errlen);
    if (rc != STATUS_OK) {
        ncclCommAbort(comm);
        return rc;
    }
    *out = comm;
    return STATUS_OK;
}

extern "C" void nccl_link_comm_free(void *comm) {
    if (!comm) return;
    ncclComm_t c = (ncclComm_t)comm;
    /* Finalize flushes queued operations; a communicator in error is aborted. */
    ncclResult_t st = ncclSuccess;
    if (ncclCommFinalize(c) == ncclSuccess || ncclCommGetAsyncError(c, &st) == ncclSuccess) {
        char err[128];
        if (nl_wait(c, 10000, "ncclCommFinalize", err, sizeof err) == STATUS_OK) {
            ncclCommDestroy(c);
            return;
        }
    }
    ncclCommAbort(c);
}

extern "C" int nccl_link_send(void *comm, const void *buf, size_t bytes, int peer, void *stream,
                              char *err, size_t errlen) {
    ncclComm_t c = (ncclComm_t)comm;
    NCCL_CHECK(ncclSend(buf, bytes, ncclUint8, peer, c, (cudaStream_t)stream));
    return nl_wait(c, 60000, "ncclSend", err, errlen);
}

extern "C" int nccl_link_recv(void *comm, void *buf, size_t bytes, int peer, void *stream,
                              char *err, size_t errlen) {
    ncclComm_t c = (ncclComm_t)comm;
    NCCL_CHECK(ncclRecv(buf, bytes, ncclUint8, peer, c, (cudaStream_t)stream));
    return nl_wait(c, 60000, "ncclRecv", err, errlen);
}

#else /* no NCCL in this build */

static int nl_unsupported(char *err, size_t errlen) {
    snprintf(err, errlen, "this build has no NCCL (nccl.h and libnccl were not found at configure "
             "time): GPU stages cannot link; use the ZeroMQ link");
    return STATUS_UNSUPPORTED;
}
extern "C" int nccl_link_get_id(int device, void *id, char *err, size_t errlen) {
    return nl_unsupported(err, errlen);
}
extern "C" int nccl_link_comm_init(void **out, const void *id, int n_ranks, int rank, int device,
                                   int timeout_ms, char *err, size_t errlen) {
    *out = NULL;
    return nl_unsupported(err, errlen);
}
extern "C" void nccl_link_comm_free(void *comm) {}
extern "C" int nccl_link_send(void *comm, const void *buf, size_t bytes, int peer, void *stream,
                              char *err, size_t errlen) {
    return nl_unsupported(err, errlen);
}
extern "C" int nccl_link_recv(void *comm, void *buf, size_t bytes, int peer, void *stream,
                              char *err, size_t errlen) {
    return nl_unsupported(err, errlen);
}
#endif
