/* Write this step's keys and values into the paged cache (F32, F16, or
 * Q8_0 quantized here), laid out
 * [n_blocks][n_kv_heads][block_size][head_dim], at slot = block *
 * block_size + offset.  A negative slot (a padding row) is skipped; a slot
 * past the cache is skipped too, since the host cannot see device-side
 * slots to reject them. */
#include "common.cuh"

#include "../backend.h"

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

/* The 8-bit cache (kernels/backend.h): each position row of a KV head is
 * head_dim / g groups of an F16 scale and g int8 (g = backend_kv_q8_group:
 * 64, 32, or the whole row).  Each group is rounded as dtype_quant_row
 * does (d = amax / 127 to F16, q = x / d to nearest even, clamped to
 * +-127), so the bytes equal the CPU backend's for the same input.  Here a
 * thread quantizes one group of k and the same group of v: the form for
 * rows narrower than 32 (and k or v not 16-byte aligned); groups of 32 and
 * 64 take kv_write_q8_lanes_kernel below. */
__device__ __forceinline__ void kv_quant_group(const float *__restrict__ x, uint8_t *__restrict__ dst, int g) {
    float amax = 0.0f;
    for (int j = 0; j < g; j++) amax = fmaxf(amax, fabsf(x[j]));
    const fp16_t dh = f2h(amax / 127.0f);
    const float d = h2f(dh), id = d > 0.0f ? 1.0f / d : 0.0f;
    *(fp16_t *)dst = dh;
    int8_t *qs = (int8_t *)(dst + 2);
    for (int j = 0; j < g; j++) qs[j] = (int8_t)max(-127, min(127, __float2int_rn(x[j] * id)));
}

__global__ void kv_write_q8_kernel(uint8_t *kc, uint8_t *vc, int32_t n_blocks, int32_t block_size,
                                   int32_t n_kv_heads, int32_t head_dim, int32_t g, const float *k, const float *v,
                                   const int32_t *slots) {
    int64_t t = blockIdx.x;
    int32_t slot = slots[t];
    if (slot < 0 || slot >= n_blocks * block_size) return;
    int32_t blk = slot / block_size, off = slot % block_size;
    const int32_t per_head = head_dim / g, n_groups = n_kv_heads * per_head, width = n_kv_heads * head_dim;
    const size_t rb = (size_t)per_head * (g + 2);
    for (int32_t i = threadIdx.x; i < n_groups; i += blockDim.x) {
        int32_t h = i / per_head, gi = i % per_head;
        /* Group i covers elements i * g .. i * g + g - 1 of the row's width. */
        size_t at = (((size_t)blk * n_kv_heads + h) * block_size + off) * rb + (size_t)gi * (g + 2);
        kv_quant_group(k + t * width + (int64_t)i * g, kc + at, g);
        kv_quant_group(v + t * width + (int64_t)i * g, vc + at, g);
    }
}

/* The same bytes for rows of groups of 32 or 64 (L = 4 or 8 threads a
 * group), without the thread-per-group kernel's serial chain of g loads
 * and g stores a thread, which a decode step waits for (a 7B row of 32
 * heads of 128 is only 64 groups).  A thread takes 8 consecutive values of
 * k and of v (two 16-byte loads each, consecutive threads on consecutive
 * bytes), the L adjacent lanes of a group find its amax by shuffles (fmaxf
 * is exact, so any order gives the same scale), and each thread stores its
 * 8 int8 as four 2-byte words (a group's values start 2 bytes into a word
 * in even groups).  Every lane of a warp runs the shuffles: the loop's
 * trip count is the block's, and lanes past the row take zeros. */
template <int L>
__global__ void kv_write_q8_lanes_kernel(uint8_t *kc, uint8_t *vc, int32_t n_blocks, int32_t block_size,
                                         int32_t n_kv_heads, int32_t head_dim, const float *k, const float *v,
                                         const int32_t *slots) {
    constexpr int G = 8 * L;
    const int64_t t = blockIdx.x;
    const int32_t slot = slots[t];
    if (slot < 0 || slot >= n_blocks * block_size) return;
    const int32_t blk = slot / block_size, off = slot % block_size;
    const int32_t width = n_kv_heads * head_dim, units = width / 8, per_head = head_dim / G;
    const size_t rb = (size_t)per_head * (G + 2);
    for (int32_t base = 0; base < units; base += blockDim.x) {
        const int32_t u = base + threadIdx.x;
        const bool ok = u < units;
        float x[2][8];
        float amax[2] = {0.0f, 0.0f};
#pragma unroll
        for (int c = 0; c < 2; c++) {
            if (ok) {
                const float4 *src = (const float4 *)((c ? v : k) + t * width + 8 * (int64_t)u);
                const float4 a = __ldg(src), b = __ldg(src + 1);
                x[c][0] = a.x, x[c][1] = a.y, x[c][2] = a.z, x[c][3] = a.w;
                x[c][4] = b.x, x[c][5] = b.y, x[c][6] = b.z, x[c][7] = b.w;
            } else {
#pragma unroll
                for (int e = 0; e < 8; e++) x[c][e] = 0.0f;
            }
#pragma unroll
            for (int e = 0; e < 8; e++) amax[c] = fmaxf(amax[c], fabsf(x[c][e]));
#pragma unroll
            for (int o = L / 2; o > 0; o >>= 1) amax[c] = fmaxf(amax[c], __shfl_xor_sync(0xffffffffu, amax[c], o));
        }
        if (!ok) continue;
        const int32_t gw = u / L, h = gw / per_head, gi = gw % per_head, li = u % L;
        const size_t at = (((size_t)blk * n_kv_heads + h) * block_size + off) * rb + (size_t)gi * (G + 2);
#pragma unroll
        for (int c = 0; c < 2; c++) {
            uint8_t *dst = (c ? vc : kc) + at;
            const fp16_t dh = f2h(amax[c] / 127.0f);
            const float d = h2f(dh), id = d > 0.0f ? 1.0f / d : 0.0f;
            if (li == 0) *(fp16_t *)dst = dh;
            uint16_t *qs = (uint16_t *)(dst + 2 + 8 * li);
#pragma unroll
            for (int e = 0; e < 4; e++) {
                const int q0 = max(-127, min(127, __float2int_rn(x[c][2 * e] * id)));
                const int q1 = max(-127, min(127, __float2int_rn(x[c][2 * e + 1] * id)));
                qs[e] = (uint16_t)((q0 & 0xff) | (q1 & 0xff) << 8);
            }
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
    if (kv_type == DTYPE_Q8_0) {
        const int32_t g = backend_kv_q8_group(head_dim);
        if (head_dim % 2 != 0 || head_dim % g != 0)
            return cuda_fail(ctx, STATUS_UNSUPPORTED, "kv_write: Q8_0 cache with head_dim %d", head_dim);
        if ((g == 32 || g == 64) && (uintptr_t)k % 16 == 0 && (uintptr_t)v % 16 == 0) {
            const int units = n_kv_heads * head_dim / 8;
            const int threads = units < 256 ? (units + 31) / 32 * 32 : 256;
            if (g == 64)
                kv_write_q8_lanes_kernel<8><<<n, threads, 0, CUDA_STREAM(ctx)>>>(
                    (uint8_t *)kv_k, (uint8_t *)kv_v, n_blocks, block_size, n_kv_heads, head_dim, k, v, slots);
            else
                kv_write_q8_lanes_kernel<4><<<n, threads, 0, CUDA_STREAM(ctx)>>>(
                    (uint8_t *)kv_k, (uint8_t *)kv_v, n_blocks, block_size, n_kv_heads, head_dim, k, v, slots);
            CUDA_CHECK(ctx, cudaGetLastError());
            return STATUS_OK;
        }
        const int groups = n_kv_heads * (head_dim / g);
        const int threads = groups < 256 ? (groups + 31) / 32 * 32 : 256;
        kv_write_q8_kernel<<<n, threads, 0, CUDA_STREAM(ctx)>>>((uint8_t *)kv_k, (uint8_t *)kv_v, n_blocks,
                                                                block_size, n_kv_heads, head_dim, g, k, v, slots);
        CUDA_CHECK(ctx, cudaGetLastError());
        return STATUS_OK;
    }
    return cuda_fail(ctx, STATUS_UNSUPPORTED, "kv_write: cache type %s (F32, F16 or Q8_0 only)", dtype_name(kv_type));
}
