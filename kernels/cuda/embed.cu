/* Token embedding: out[i, :] = row ids[i] of the embedding table, of any
 * weight type, dequantized to F32. */
#include "common.cuh"

/* One block per token.  An id outside the table (the ids are in device
 * memory, so the host cannot check them) yields a row of NaN. */
template <int T>
__global__ void embed_kernel(float *out, const uint8_t *w, size_t row_bytes, int64_t rows, int64_t cols,
                             const int32_t *ids) {
    int64_t r = blockIdx.x;
    int32_t id = ids[r];
    float *o = out + r * cols;
    if (id < 0 || id >= rows) {
        for (int64_t i = threadIdx.x; i < cols; i += blockDim.x) o[i] = __int_as_float(0x7fc00000);
        return;
    }
    const uint8_t *row = w + (size_t)id * row_bytes;
    for (int64_t i = threadIdx.x; i < cols; i += blockDim.x) o[i] = dq_elem<T>(row, i, cols);
}

template <int T>
static int embed_launch(struct cuda_ctx *ctx, float *out, const void *w, int64_t rows, int64_t cols,
                        const int32_t *ids, int32_t n) {
    embed_kernel<T><<<n, 256, 0, CUDA_STREAM(ctx)>>>(out, (const uint8_t *)w, cuda_row_bytes((enum dtype)T, cols),
                                                     rows, cols, ids);
    CUDA_CHECK(ctx, cudaGetLastError());
    return STATUS_OK;
}

extern "C" int cuda_embed(struct cuda_ctx *ctx, float *out, const void *w, enum dtype type, int64_t rows,
                          int64_t cols, const int32_t *ids, int32_t n) {
    if (n < 0 || rows <= 0 || cols <= 0)
        return cuda_fail(ctx, STATUS_BAD_INPUT, "embed: %d ids into [%lld x %lld]", n, (long long)rows,
                         (long long)cols);
    if (n == 0) return STATUS_OK;
    CUDA_DTYPE_DISPATCH(ctx, type, embed_launch, ctx, out, w, rows, cols, ids, n);
}
