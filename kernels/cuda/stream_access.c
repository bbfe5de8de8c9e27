/* The CUDA backend's stream and device for callers outside kernels/ (the
 * NCCL link).  backend_cuda.c keeps its struct private; this file reads the
 * same leading fields (the backend header, then the context) and checks the
 * guess against an invariant backend_cuda_init sets up (the context writes
 * its errors into the backend's errstr), so a change of that struct shows
 * up as a NULL stream, not as a wild pointer.  Belongs in backend_cuda.c
 * once its owner takes it over. */
#include "stream_access.h"

#include "../backend-impl.h"
#include "cuda_ops.h"

#include <string.h>

/* The leading fields of backend_cuda.c's struct backend_cuda. */
struct stream_access_view {
    struct backend base;
    struct cuda_ctx *ctx;
};

static struct cuda_ctx *stream_access_ctx(backend *b) {
    if (!b || !backend_is_gpu(b) || strncmp(backend_name(b), "cuda:", 5) != 0) return NULL;
    struct cuda_ctx *ctx = ((struct stream_access_view *)b)->ctx;
    if (!ctx || ctx->err != b->errstr) return NULL;
    return ctx;
}

void *backend_cuda_stream(backend *b) {
    struct cuda_ctx *ctx = stream_access_ctx(b);
    return ctx ? ctx->stream : NULL;
}

int backend_cuda_device(backend *b) {
    struct cuda_ctx *ctx = stream_access_ctx(b);
    return ctx ? ctx->device : -1;
}
