/* Elementwise residual add: x[i] += y[i]. */
#include "common.cuh"

__global__ void add_f32_kernel(float *x, const float *y, int64_t n) {
    pdl_begin();
    for (int64_t i = blockIdx.x * (int64_t)blockDim.x + threadIdx.x; i < n; i += (int64_t)gridDim.x * blockDim.x)
        x[i] += y[i];
}

static int add_launch(struct cuda_ctx *ctx, float *x, const float *y, int64_t n) {
    CUDA_CHECK(ctx, cuda_launch(ctx, add_f32_kernel, dim3(cuda_blocks(n, 256)), dim3(256), 0, x, y, n));
    CUDA_CHECK(ctx, cudaGetLastError());
    return STATUS_OK;
}

extern "C" int cuda_add(struct cuda_ctx *ctx, float *x, const float *y, int64_t n) {
    if (n < 0) return cuda_fail(ctx, STATUS_BAD_INPUT, "add: %lld elements", (long long)n);
    if (n == 0) return STATUS_OK;
    return add_launch(ctx, x, y, n);
}
