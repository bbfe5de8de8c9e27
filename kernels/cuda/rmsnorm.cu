/* RMS normalization, alone and fused with the residual add that precedes
 * it in every layer (x += delta; out = rmsnorm(x) * w), one block per row. */
#include "common.cuh"

#define RMSNORM_THREADS 256

/* With delta != NULL, x is updated in place first (the fused residual). */
__global__ void rmsnorm_f32_kernel(float *out, float *x, const float *delta, const float *w, int32_t dim,
                                   float eps) {
    int64_t row = blockIdx.x;
    float *xr = x + row * dim;
    const float *dr = delta ? delta + row * dim : NULL;
    float ss = 0.0f;
    for (int32_t i = threadIdx.x; i < dim; i += blockDim.x) {
        float v = xr[i];
        if (dr) {
            v += dr[i];
            xr[i] = v;
        }
        ss += v * v;
    }
    __shared__ float partial[RMSNORM_THREADS / 32];
    for (int o = 16; o > 0; o >>= 1) ss += __shfl_xor_sync(0xffffffffu, ss, o);
    if (threadIdx.x % 32 == 0) partial[threadIdx.x / 32] = ss;
    __syncthreads();
    if (threadIdx.x < 32) {
        ss = threadIdx.x < blockDim.x / 32 ? partial[threadIdx.x] : 0.0f;
        for (int o = 16; o > 0; o >>= 1) ss += __shfl_xor_sync(0xffffffffu, ss, o);
        if (threadIdx.x == 0) partial[0] = ss;
    }
    __syncthreads();
    float inv = 1.0f / sqrtf(partial[0] / (float)dim + eps);
    float *orow = out + row * dim;
    for (int32_t i = threadIdx.x; i < dim; i += blockDim.x) orow[i] = xr[i] * inv * w[i];
}

static int rmsnorm_launch(struct cuda_ctx *ctx, float *out, float *x, const float *delta, const float *w,
                          int32_t n, int32_t dim, float eps) {
    rmsnorm_f32_kernel<<<n, RMSNORM_THREADS, 0, CUDA_STREAM(ctx)>>>(out, x, delta, w, dim, eps);
    CUDA_CHECK(ctx, cudaGetLastError());
    return STATUS_OK;
}

extern "C" int cuda_rmsnorm(struct cuda_ctx *ctx, float *out, const float *x, const float *w, int32_t n,
                            int32_t dim, float eps) {
    if (n < 0 || dim <= 0) return cuda_fail(ctx, STATUS_BAD_INPUT, "rmsnorm: shape [%d x %d]", n, dim);
    if (n == 0) return STATUS_OK;
    /* Without delta the kernel never writes x. */
    return rmsnorm_launch(ctx, out, (float *)x, NULL, w, n, dim, eps);
}

extern "C" int cuda_add_rmsnorm(struct cuda_ctx *ctx, float *x, const float *delta, float *out, const float *w,
                                int32_t n, int32_t dim, float eps) {
    if (n < 0 || dim <= 0) return cuda_fail(ctx, STATUS_BAD_INPUT, "add_rmsnorm: shape [%d x %d]", n, dim);
    if (n == 0) return STATUS_OK;
    return rmsnorm_launch(ctx, out, x, delta, w, n, dim, eps);
}
