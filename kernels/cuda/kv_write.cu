/* Write this step's keys and values into the paged cache, laid out
 * [n_blocks][n_kv_heads][block_size][head_dim], at slot = block *
 * block_size + offset.  A negative slot (a padding row) is skipped; a slot
 * past the cache is skipped too, since the host cannot see device-side
 * slots to reject them. */
#include "common.cuh"

template <int KT>
__global__ void kv_write_kernel(void *kc, void *vc, int32_t n_blocks, int32_t block_size, int32_t n_kv_heads,
                                int32_t head_dim, const float *k, const float *v, const int32_t *slots) {
    int64_t t = blockIdx.x;
    int32_t slot = slots[t];
    if (slot < 0 || slot >= n_blocks * block_size) return;
    int32_t blk = slot / block_size, off = slot % block_size;
    int32_t width = n_kv_heads * head_dim;
    for (int32_t i = threadIdx.x; i < width; i += blockDim.x) {
        int32_t h = i / head_dim, d = i % head_dim;
        size_t dst = (((size_t)blk * n_kv_heads + h) * block_size + off) * head_dim + d;
        float kx = k[t * width + i], vx = v[t * width + i];
        if (KT == DTYPE_F16) {
            ((fp16_t *)kc)[dst] = f2h(kx);
            ((fp16_t *)vc)[dst] = f2h(vx);
        } else {
            ((float *)kc)[dst] = kx;
            ((float *)vc)[dst] = vx;
        }
    }
}

template <int KT>
static int kv_write_launch(struct cuda_ctx *ctx, void *kc, void *vc, int32_t n_blocks, int32_t block_size,
                           int32_t n_kv_heads, int32_t head_dim, const float *k, const float *v, const int32_t *slots,
                           int32_t n) {
    int width = n_kv_heads * head_dim;
    int threads = width < 256 ? (width + 31) / 32 * 32 : 256;
    kv_write_kernel<KT><<<n, threads, 0, CUDA_STREAM(ctx)>>>(kc, vc, n_blocks, block_size, n_kv_heads, head_dim, k,
                                                            v, slots);
    CUDA_CHECK(ctx, cudaGetLastError());
    return STATUS_OK;
}

extern "C" int cuda_kv_write(struct cuda_ctx *ctx, void *kv_k, void *kv_v, enum dtype kv_type, int32_t n_blocks,
                             int32_t block_size, int32_t n_kv_heads, int32_t head_dim, const float *k, const float *v,
                             const int32_t *slots, int32_t n) {
    if (n < 0 || n_blocks <= 0 || block_size <= 0 || n_kv_heads <= 0 || head_dim <= 0)
        return cuda_fail(ctx, STATUS_BAD_INPUT, "kv_write: %d rows into %d blocks x %d x %d x %d", n, n_blocks,
                         block_size, n_kv_heads, head_dim);
    if (n == 0) return STATUS_OK;
    if (kv_type == DTYPE_F16)
        return kv_write_launch<DTYPE_F16>(ctx, kv_k, kv_v, n_blocks, block_size, n_kv_heads, head_dim, k, v, slots, n);
    if (kv_type == DTYPE_F32)
        return kv_write_launch<DTYPE_F32>(ctx, kv_k, kv_v, n_blocks, block_size, n_kv_heads, head_dim, k, v, slots, n);
    return cuda_fail(ctx, STATUS_UNSUPPORTED, "kv_write: cache type %s (F32 or F16 only)", dtype_name(kv_type));
}
