/* Gather rows of an F32 matrix (the last stage picks the rows it samples
 * from): out[i, :] = x[idx[i], :]. */
#include "common.cuh"

/* One block per output row; a negative index (a caller bug the host cannot
 * see, the indices being in device memory) yields a row of NaN. */
__global__ void get_rows_f32_kernel(float *out, const float *x, const int32_t *idx, int32_t dim) {
    int64_t r = blockIdx.x;
    int32_t src = idx[r];
    float *o = out + r * dim;
    for (int32_t i = threadIdx.x; i < dim; i += blockDim.x)
        o[i] = src >= 0 ? x[(int64_t)src * dim + i] : __int_as_float(0x7fc00000);
}

static int get_rows_launch(struct cuda_ctx *ctx, float *out, const float *x, const int32_t *idx, int32_t n,
                           int32_t dim) {
    get_rows_f32_kernel<<<n, 256, 0, CUDA_STREAM(ctx)>>>(out, x, idx, dim);
    CUDA_CHECK(ctx, cudaGetLastError());
    return STATUS_OK;
}

extern "C" int cuda_get_rows(struct cuda_ctx *ctx, float *out, const float *x, const int32_t *idx, int32_t n,
                             int32_t dim) {
    if (n < 0 || dim <= 0) return cuda_fail(ctx, STATUS_BAD_INPUT, "get_rows: %d rows of %d", n, dim);
    if (n == 0) return STATUS_OK;
    return get_rows_launch(ctx, out, x, idx, n, dim);
}
