/* Q8_0 and Q6_K rows from GGUF's blocks into the backend's regrouped
 * layout (common.cuh), once per weight at load: each part of a block goes
 * to an array of its own so that the kernels read them with aligned 16-byte
 * loads.  Runs on a staging copy of a few rows at a time. */
#include "common.cuh"

/* One thread per block (32 or 256 elements): byte copies, run once. */
template <int T>
__global__ void repack_kernel(uint8_t *__restrict__ dst, const uint8_t *__restrict__ src, size_t dst_rb,
                              int64_t rows, int64_t cols) {
    const int64_t per_row = T == DTYPE_Q8_0 ? cols / 32 : cols / 256;
    const int64_t total = rows * per_row;
    for (int64_t i = blockIdx.x * (int64_t)blockDim.x + threadIdx.x; i < total; i += (int64_t)gridDim.x * blockDim.x) {
        const int64_t r = i / per_row, b = i % per_row;
        uint8_t *row = dst + (size_t)r * dst_rb;
        if constexpr (T == DTYPE_Q8_0) {
            const block_q8_0 *blk = (const block_q8_0 *)(src + (size_t)r * per_row * sizeof(block_q8_0)) + b;
            for (int e = 0; e < 32; e++) row[32 * b + e] = (uint8_t)blk->qs[e];
            ((fp16_t *)(row + q8s_d_off(cols)))[b] = blk->d;
        } else {
            const block_q6_k *blk = (const block_q6_k *)(src + (size_t)r * per_row * sizeof(block_q6_k)) + b;
            for (int e = 0; e < 128; e++) row[128 * b + e] = blk->ql[e];
            for (int e = 0; e < 64; e++) row[q6s_qh_off(cols) + 64 * b + e] = blk->qh[e];
            for (int e = 0; e < 16; e++) row[q6s_sc_off(cols) + 16 * b + e] = (uint8_t)blk->scales[e];
            ((fp16_t *)(row + q6s_d_off(cols)))[b] = blk->d;
        }
    }
}

extern "C" int cuda_repack(struct cuda_ctx *ctx, void *dst, const void *src, enum dtype type, int64_t rows,
                           int64_t cols) {
    if (rows <= 0 || cols <= 0 || (type != DTYPE_Q8_0 && type != DTYPE_Q6_K) ||
        cols % (type == DTYPE_Q8_0 ? 32 : 256) != 0)
        return cuda_fail(ctx, STATUS_BAD_INPUT, "repack: %s [%lld x %lld] has no regrouped layout", dtype_name(type),
                         (long long)rows, (long long)cols);
    const size_t rb = cuda_row_bytes(type, cols);
    /* The padding past the last array is zero, never left uninitialized. */
    CUDA_CHECK(ctx, cudaMemsetAsync(dst, 0, rb * (size_t)rows, CUDA_STREAM(ctx)));
    const int64_t blocks = rows * (type == DTYPE_Q8_0 ? cols / 32 : cols / 256);
    if (type == DTYPE_Q8_0)
        repack_kernel<DTYPE_Q8_0><<<cuda_blocks(blocks, 256), 256, 0, CUDA_STREAM(ctx)>>>(
            (uint8_t *)dst, (const uint8_t *)src, rb, rows, cols);
    else
        repack_kernel<DTYPE_Q6_K><<<cuda_blocks(blocks, 256), 256, 0, CUDA_STREAM(ctx)>>>(
            (uint8_t *)dst, (const uint8_t *)src, rb, rows, cols);
    CUDA_CHECK(ctx, cudaGetLastError());
    return STATUS_OK;
}
