/* CUDA graphs of the backend's stream (record a step once, replay it with
 * one launch instead of hundreds) and the page-locked host memory that
 * step inputs are uploaded from asynchronously. */
#include "common.cuh"

#include <stdlib.h>

struct cuda_graph {
    cudaGraphExec_t exec;
    void *scratch; /* ctx->scratch when recorded: kernels may have it baked in */
};

extern "C" void *cuda_host_alloc(struct cuda_ctx *ctx, size_t bytes) {
    void *p = NULL;
    cudaError_t e = cudaHostAlloc(&p, bytes, cudaHostAllocDefault);
    if (e != cudaSuccess) {
        cudaGetLastError();
        cuda_fail(ctx, STATUS_NO_MEMORY, "cuda:%d: cannot allocate %zu bytes of page-locked host memory: %s",
                  ctx->device, bytes, cudaGetErrorString(e));
        return NULL;
    }
    return p;
}

extern "C" void cuda_host_free(struct cuda_ctx *ctx, void *p) {
    (void)ctx;
    if (p) cudaFreeHost(p);
}

extern "C" int cuda_cublas_workspace(struct cuda_ctx *ctx, void *ws, size_t bytes) {
    CUDA_CHECK(ctx, cublasSetWorkspace((cublasHandle_t)ctx->cublas, ws, ws ? bytes : 0));
    return STATUS_OK;
}

extern "C" int cuda_graph_begin(struct cuda_ctx *ctx) {
    /* Thread-local: another thread's CUDA calls (a transport, say) neither
     * break this recording nor get refused because of it. */
    CUDA_CHECK(ctx, cudaStreamBeginCapture(CUDA_STREAM(ctx), cudaStreamCaptureModeThreadLocal));
    return STATUS_OK;
}

extern "C" int cuda_graph_end(struct cuda_ctx *ctx, struct cuda_graph **out) {
    *out = NULL;
    cudaGraph_t graph = NULL;
    cudaError_t e = cudaStreamEndCapture(CUDA_STREAM(ctx), &graph);
    if (e != cudaSuccess || !graph) {
        cudaGetLastError(); /* an invalidated capture is not sticky */
        if (graph) cudaGraphDestroy(graph);
        return cuda_fail(ctx, STATUS_INTERNAL, "cuda:%d: graph capture failed: %s", ctx->device,
                         cudaGetErrorString(e));
    }
    cudaGraphExec_t exec = NULL;
    e = cudaGraphInstantiate(&exec, graph, 0);
    cudaGraphDestroy(graph);
    if (e != cudaSuccess) {
        cudaGetLastError();
        return cuda_fail(ctx, STATUS_INTERNAL, "cuda:%d: graph instantiate: %s", ctx->device, cudaGetErrorString(e));
    }
    struct cuda_graph *g = (struct cuda_graph *)calloc(1, sizeof *g);
    if (!g) {
        cudaGraphExecDestroy(exec);
        return cuda_fail(ctx, STATUS_NO_MEMORY, "cuda:%d: graph: out of host memory", ctx->device);
    }
    g->exec = exec;
    g->scratch = ctx->scratch;
    *out = g;
    return STATUS_OK;
}

extern "C" int cuda_graph_launch(struct cuda_ctx *ctx, struct cuda_graph *g) {
    /* The scratch buffer only grows; a buffer at the same address is at
     * least as large, so only a move makes the graph stale. */
    if (g->scratch != ctx->scratch)
        return cuda_fail(ctx, STATUS_UNAVAILABLE, "cuda:%d: graph recorded with scratch %p, now %p", ctx->device,
                         g->scratch, ctx->scratch);
    CUDA_CHECK(ctx, cudaGraphLaunch(g->exec, CUDA_STREAM(ctx)));
    return STATUS_OK;
}

extern "C" void cuda_graph_free(struct cuda_ctx *ctx, struct cuda_graph *g) {
    (void)ctx;
    if (!g) return;
    cudaGraphExecDestroy(g->exec);
    free(g);
}
