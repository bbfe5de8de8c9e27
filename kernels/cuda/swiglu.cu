/* The gated activation of the feed-forward block: out = silu(gate) * up;
 * at prefill sizes also out's F16 form for the down matmul's cuBLAS call
 * (cuda_gemm_act), which then skips its own conversion pass. */
#include "common.cuh"

__global__ void swiglu_f32_kernel(float *out, const float *gate, const float *up, int64_t n) {
    pdl_begin();
    for (int64_t i = blockIdx.x * (int64_t)blockDim.x + threadIdx.x; i < n; i += (int64_t)gridDim.x * blockDim.x) {
        float g = gate[i];
        out[i] = g / (1.0f + expf(-g)) * up[i];
    }
}

static int swiglu_launch(struct cuda_ctx *ctx, float *out, const float *gate, const float *up, int64_t n) {
    CUDA_CHECK(ctx, cuda_launch(ctx, swiglu_f32_kernel, dim3(cuda_blocks(n, 256)), dim3(256), 0, out, gate, up, n));
    CUDA_CHECK(ctx, cudaGetLastError());
    return STATUS_OK;
}

extern "C" int cuda_swiglu(struct cuda_ctx *ctx, float *out, const float *gate, const float *up, int64_t n) {
    if (n < 0) return cuda_fail(ctx, STATUS_BAD_INPUT, "swiglu: %lld elements", (long long)n);
    if (n == 0) return STATUS_OK;
    return swiglu_launch(ctx, out, gate, up, n);
}

__global__ void swiglu_act_kernel(float *__restrict__ out, fp16_t *__restrict__ out16, const float *__restrict__ gate,
                                  const float *__restrict__ up, int64_t n) {
    pdl_begin();
    for (int64_t i = blockIdx.x * (int64_t)blockDim.x + threadIdx.x; i < n; i += (int64_t)gridDim.x * blockDim.x) {
        float g = gate[i], v = g / (1.0f + expf(-g)) * up[i];
        out[i] = v;
        out16[i] = f2h(v);
    }
}

extern "C" int cuda_swiglu_act(struct cuda_ctx *ctx, float *out, const float *gate, const float *up, int32_t rows,
                               int64_t width) {
    if (rows < 0 || width <= 0)
        return cuda_fail(ctx, STATUS_BAD_INPUT, "swiglu: %d rows of %lld", rows, (long long)width);
    if (rows == 0) return STATUS_OK;
    uint16_t *x16 = NULL;
    int fresh = 0;
    int rc = cuda_gemm_act(ctx, out, rows, width, &x16, &fresh);
    if (rc != STATUS_OK) return rc;
    const int64_t n = (int64_t)rows * width;
    CUDA_CHECK(ctx, cuda_launch(ctx, swiglu_act_kernel, dim3(cuda_blocks(n, 256)), dim3(256), 0, out, (fp16_t *)x16,
                                gate, up, n));
    CUDA_CHECK(ctx, cudaGetLastError());
    return STATUS_OK;
}
