/* The gated activation of the feed-forward block: out = silu(gate) * up. */
#include "common.cuh"

__global__ void swiglu_f32_kernel(float *out, const float *gate, const float *up, int64_t n) {
    for (int64_t i = blockIdx.x * (int64_t)blockDim.x + threadIdx.x; i < n; i += (int64_t)gridDim.x * blockDim.x) {
        float g = gate[i];
        out[i] = g / (1.0f + expf(-g)) * up[i];
    }
}

static int swiglu_launch(struct cuda_ctx *ctx, float *out, const float *gate, const float *up, int64_t n) {
    swiglu_f32_kernel<<<cuda_blocks(n, 256), 256, 0, CUDA_STREAM(ctx)>>>(out, gate, up, n);
    CUDA_CHECK(ctx, cudaGetLastError());
    return STATUS_OK;
}

extern "C" int cuda_swiglu(struct cuda_ctx *ctx, float *out, const float *gate, const float *up, int64_t n) {
    if (n < 0) return cuda_fail(ctx, STATUS_BAD_INPUT, "swiglu: %lld elements", (long long)n);
    if (n == 0) return STATUS_OK;
    return swiglu_launch(ctx, out, gate, up, n);
}
