/* What code outside kernels/ needs to put its own GPU work (NCCL sends and
 * receives) in order with a CUDA backend's ops: its stream and device.
 * Plain C; the stream is a cudaStream_t behind void *.  Defined in
 * backend_cuda.c. */
#ifndef KERNELS_CUDA_STREAM_ACCESS_H
#define KERNELS_CUDA_STREAM_ACCESS_H

#include "../backend.h"

/* The backend's one stream, or NULL when b is not a CUDA backend. */
void *backend_cuda_stream(backend *b);
/* Its CUDA device index, or -1 when b is not a CUDA backend. */
int backend_cuda_device(backend *b);

#endif
