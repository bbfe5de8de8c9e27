/* Dequantize weight rows of any type to F16: the tiles that the cuBLAS
 * path of matmul multiplies (one tile at a time, so no second full copy of
 * a weight ever exists). */
#include "common.cuh"

/* One thread per 2 elements of the tile; rows are contiguous in dst. */
template <int T>
__global__ void dequant_f16_kernel(fp16_t *dst, const uint8_t *w, size_t row_bytes, int64_t rows, int64_t cols) {
    int64_t half_cols = cols / 2;
    int64_t total = rows * half_cols;
    for (int64_t id = blockIdx.x * (int64_t)blockDim.x + threadIdx.x; id < total;
         id += (int64_t)gridDim.x * blockDim.x) {
        int64_t r = id / half_cols, c = (id % half_cols) * 2;
        const uint8_t *row = w + (size_t)r * row_bytes;
        __half2 h = __floats2half2_rn(dq_elem<T>(row, c), dq_elem<T>(row, c + 1));
        *(__half2 *)(dst + r * cols + c) = h;
    }
}

/* Odd widths (only F32/F16/BF16 can have them): one element per thread. */
template <int T>
__global__ void dequant_f16_odd_kernel(fp16_t *dst, const uint8_t *w, size_t row_bytes, int64_t rows, int64_t cols) {
    int64_t total = rows * cols;
    for (int64_t id = blockIdx.x * (int64_t)blockDim.x + threadIdx.x; id < total;
         id += (int64_t)gridDim.x * blockDim.x) {
        int64_t r = id / cols, c = id % cols;
        dst[id] = f2h(dq_elem<T>(w + (size_t)r * row_bytes, c));
    }
}

template <int T>
static int dequant_launch(struct cuda_ctx *ctx, uint16_t *dst, const void *w, int64_t r0, int64_t rows,
                          int64_t cols) {
    size_t rb = cuda_row_bytes((enum dtype)T, cols);
    const uint8_t *src = (const uint8_t *)w + (size_t)r0 * rb;
    if (cols % 2 == 0)
        dequant_f16_kernel<T><<<cuda_blocks(rows * cols / 2, 256), 256, 0, CUDA_STREAM(ctx)>>>(dst, src, rb, rows,
                                                                                            cols);
    else
        dequant_f16_odd_kernel<T><<<cuda_blocks(rows * cols, 256), 256, 0, CUDA_STREAM(ctx)>>>(dst, src, rb, rows,
                                                                                             cols);
    CUDA_CHECK(ctx, cudaGetLastError());
    return STATUS_OK;
}

extern "C" int cuda_dequant_f16(struct cuda_ctx *ctx, uint16_t *dst, const void *w, enum dtype type, int64_t r0,
                                int64_t rows, int64_t cols) {
    if (r0 < 0 || rows <= 0 || cols <= 0)
        return cuda_fail(ctx, STATUS_BAD_INPUT, "dequant: rows %lld + %lld of width %lld", (long long)r0,
                         (long long)rows, (long long)cols);
    CUDA_DTYPE_DISPATCH(ctx, type, dequant_launch, ctx, dst, w, r0, rows, cols);
}
