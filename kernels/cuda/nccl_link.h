/* NCCL point-to-point for the stage-to-stage links (worker/link_nccl.c), as
 * plain C prototypes: only nccl_link.cu includes nccl.h and the CUDA
 * runtime.  A communicator here is a 2-rank one per link; buffers are
 * device memory; sends and receives are queued on the stream given (the
 * backend's compute stream), so nothing synchronizes.  Every function
 * returns 0 or a negative status with the reason in err; STATUS_UNSUPPORTED
 * when the build has no NCCL. */
#ifndef KERNELS_CUDA_NCCL_LINK_H
#define KERNELS_CUDA_NCCL_LINK_H

#include <stddef.h>

#ifdef __cplusplus
extern "C" {
#endif

/* sizeof(ncclUniqueId); checked by a static_assert in nccl_link.cu. */
#define NCCL_LINK_ID_BYTES 128

/* Makes device the calling thread's current CUDA device (a thread that did
 * not create the backend must call this before queueing work on it). */
int nccl_link_set_device(int device, char *err, size_t errlen);
/* A new ncclUniqueId into id (NCCL_LINK_ID_BYTES bytes). */
int nccl_link_get_id(int device, void *id, char *err, size_t errlen);
/* Joins communicator id as rank of n_ranks on device, waiting at most
 * timeout_ms for the other ranks (STATUS_TIMEOUT, the attempt aborted).
 * On success *comm is the caller's, freed with nccl_link_comm_free. */
int nccl_link_comm_init(void **comm, const void *id, int n_ranks, int rank, int device,
                        int timeout_ms, char *err, size_t errlen);
void nccl_link_comm_free(void *comm);
/* Queue a send of bytes from buf to rank peer (or a receive into buf) on
 * stream (a cudaStream_t). */
int nccl_link_send(void *comm, const void *buf, size_t bytes, int peer, void *stream, char *err,
                   size_t errlen);
int nccl_link_recv(void *comm, void *buf, size_t bytes, int peer, void *stream, char *err,
                   size_t errlen);

#ifdef __cplusplus
}
#endif

#endif
