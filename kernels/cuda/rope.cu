/* Rotary position embedding, in place, both pairings: neox pairs (i,
 * i + n_freq), the original GPT-J/Llama layout pairs (2i, 2i + 1).  The
 * angle is formed in double, as the CPU reference does: at positions of
 * 1e5 and more a float product loses the low digits of the phase.  Also
 * the fused rope of q and k with the KV-cache write (one launch per layer). */
#include "common.cuh"

/* One thread per (token, frequency): one sincos shared by every head. */
__global__ void rope_f32_kernel(float *x, const int32_t *pos, int32_t n, int32_t n_heads, int32_t head_dim,
                                const float *inv_freq, int32_t n_freq, int neox) {
    pdl_begin();
    int64_t id = blockIdx.x * (int64_t)blockDim.x + threadIdx.x;
    if (id >= (int64_t)n * n_freq) return;
    int32_t t = (int32_t)(id / n_freq), i = (int32_t)(id % n_freq);
    double s, c;
    sincos((double)pos[t] * (double)inv_freq[i], &s, &c);
    float fs = (float)s, fc = (float)c;
    int32_t j0 = neox ? i : 2 * i, j1 = neox ? i + n_freq : 2 * i + 1;
    float *row = x + (int64_t)t * n_heads * head_dim;
    for (int32_t h = 0; h < n_heads; h++) {
        float *v = row + (int64_t)h * head_dim;
        float x0 = v[j0], x1 = v[j1];
        v[j0] = x0 * fc - x1 * fs;
        v[j1] = x0 * fs + x1 * fc;
    }
}

static int rope_launch(struct cuda_ctx *ctx, float *x, const int32_t *pos, int32_t n, int32_t n_heads,
                       int32_t head_dim, const float *inv_freq, int32_t n_freq, int neox) {
    int64_t threads = (int64_t)n * n_freq;
    CUDA_CHECK(ctx, cuda_launch(ctx, rope_f32_kernel, dim3((unsigned)((threads + 127) / 128)), dim3(128), 0, x, pos,
                                n, n_heads, head_dim, inv_freq, n_freq, neox));
    CUDA_CHECK(ctx, cudaGetLastError());
    return STATUS_OK;
}

extern "C" int cuda_rope(struct cuda_ctx *ctx, float *x, const int32_t *pos, int32_t n, int32_t n_heads,
                         int32_t head_dim, const float *inv_freq, int32_t n_freq, int neox) {
    if (n < 0 || n_heads <= 0 || head_dim <= 0 || n_freq < 0 || 2 * n_freq > head_dim)
        return cuda_fail(ctx, STATUS_BAD_INPUT, "rope: %d tokens x %d heads x %d dims, %d frequencies", n, n_heads,
                         head_dim, n_freq);
    if (n == 0 || n_freq == 0) return STATUS_OK;
    return rope_launch(ctx, x, pos, n, n_heads, head_dim, inv_freq, n_freq, neox);
}

/* rope of q and k and the cache write of k and v.  Block (t, y) of the
 * grid takes token t's units y * RK_UNITS .. + RK_UNITS - 1 of two ranges
 * at once: rotation pairs (q's heads, then k's) and cache row elements
 * (v, and the dims of k that rope leaves alone).  Every load a thread
 * makes (the slot, the position, its pairs and elements, its frequency)
 * is issued before any result is stored (the pointers are __restrict__,
 * the values sit in registers), so a token costs about two memory round
 * trips, and the units of a token spread over several blocks (one block
 * of 1024 threads for a 7B token's 8192 units would loop, each round
 * waiting on the one before: 8.2 us a layer under ncu).  The
 * token's sines and cosines are formed once a block (in double, as rope
 * above) in shared memory.  A slot outside the cache is skipped, as in
 * kv_write.cu. */
template <int KT> __device__ __forceinline__ void rk_put(void *c, size_t at, float x) {
    if (KT == DTYPE_F16) ((fp16_t *)c)[at] = f2h(x);
    else ((float *)c)[at] = x;
}

#define RK_PER_THREAD 4
#define RK_THREADS 256
#define RK_UNITS (RK_PER_THREAD * RK_THREADS)

template <int KT>
__global__ void __launch_bounds__(RK_THREADS)
rope_kv_write_kernel(float *__restrict__ q, float *__restrict__ k, const float *__restrict__ v,
                     void *__restrict__ kc, void *__restrict__ vc, int32_t n_blocks, int32_t block_size,
                     int32_t n_kv_heads, int32_t head_dim, const int32_t *__restrict__ pos,
                     const int32_t *__restrict__ slots, int32_t n_heads, const float *__restrict__ inv_freq,
                     int32_t n_freq, int neox) {
    pdl_begin();
    extern __shared__ float rk_sc[]; /* cos[n_freq], sin[n_freq] */
    const int64_t t = blockIdx.x;
    const int32_t qw = n_heads * head_dim, kw = n_kv_heads * head_dim, n_pairs = (n_heads + n_kv_heads) * n_freq;
    const int32_t u0 = (int32_t)blockIdx.y * RK_UNITS + (int32_t)threadIdx.x;
    const int32_t slot = slots[t], pt = pos[t];
    float2 xv[RK_PER_THREAD];
    float vv[RK_PER_THREAD], kp[RK_PER_THREAD];
#pragma unroll
    for (int u = 0; u < RK_PER_THREAD; u++) {
        const int32_t id = u0 + u * RK_THREADS;
        if (id < n_pairs) {
            const int32_t h = id / n_freq, i = id % n_freq;
            const float *hv = h < n_heads ? q + t * qw + (int64_t)h * head_dim
                                          : k + t * kw + (int64_t)(h - n_heads) * head_dim;
            xv[u] = neox ? make_float2(hv[i], hv[i + n_freq]) : make_float2(hv[2 * i], hv[2 * i + 1]);
        }
        if (id < kw) {
            vv[u] = v[t * kw + id];
            if (id % head_dim >= 2 * n_freq) kp[u] = k[t * kw + id];
        }
    }
    for (int32_t i = threadIdx.x; i < n_freq; i += RK_THREADS) {
        double s, c;
        sincos((double)pt * (double)inv_freq[i], &s, &c);
        rk_sc[i] = (float)c;
        rk_sc[n_freq + i] = (float)s;
    }
    __syncthreads();
    const bool store = slot >= 0 && slot < n_blocks * block_size;
    const int32_t blk = store ? slot / block_size : 0, off = store ? slot % block_size : 0;
#pragma unroll
    for (int u = 0; u < RK_PER_THREAD; u++) {
        const int32_t id = u0 + u * RK_THREADS;
        if (id < kw && store) {
            const int32_t h = id / head_dim, d = id % head_dim;
            const size_t at = (((size_t)blk * n_kv_heads + h) * block_size + off) * head_dim + d;
            rk_put<KT>(vc, at, vv[u]);
            if (d >= 2 * n_freq) rk_put<KT>(kc, at, kp[u]);
        }
        if (id < n_pairs) {
            const int32_t h = id / n_freq, i = id % n_freq, j0 = neox ? i : 2 * i, j1 = neox ? i + n_freq : 2 * i + 1;
            const float fc = rk_sc[i], fs = rk_sc[n_freq + i];
            const float y0 = xv[u].x * fc - xv[u].y * fs, y1 = xv[u].x * fs + xv[u].y * fc;
            float *hv = h < n_heads ? q + t * qw + (int64_t)h * head_dim
                                    : k + t * kw + (int64_t)(h - n_heads) * head_dim;
            hv[j0] = y0;
            hv[j1] = y1;
            if (h >= n_heads && store) {
                const size_t at = (((size_t)blk * n_kv_heads + (h - n_heads)) * block_size + off) * head_dim;
                rk_put<KT>(kc, at + j0, y0);
                rk_put<KT>(kc, at + j1, y1);
            }
        }
    }
}

extern "C" int cuda_rope_kv_write(struct cuda_ctx *ctx, float *q, float *k, const float *v, void *kv_k, void *kv_v,
                                  enum dtype kv_type, int32_t n_blocks, int32_t block_size, int32_t n_kv_heads,
                                  int32_t head_dim, const int32_t *pos, const int32_t *slots, int32_t n,
                                  int32_t n_heads, const float *inv_freq, int32_t n_freq, int neox) {
    if (n < 0 || n_heads <= 0 || n_kv_heads <= 0 || head_dim <= 0 || n_freq < 0 || 2 * n_freq > head_dim ||
        n_blocks <= 0 || block_size <= 0)
        return cuda_fail(ctx, STATUS_BAD_INPUT,
                         "rope_kv_write: %d tokens x %d/%d heads x %d dims, %d frequencies, %d blocks of %d", n,
                         n_heads, n_kv_heads, head_dim, n_freq, n_blocks, block_size);
    if (kv_type == DTYPE_Q8_0) {
        /* The 8-bit cache quantizes whole groups of a row: rope in place,
         * then kv_write.cu's quantizing write (q and k end rotated, which
         * backend_rope_kv_write allows). */
        if (n == 0) return STATUS_OK;
        int rc = n_freq ? rope_launch(ctx, q, pos, n, n_heads, head_dim, inv_freq, n_freq, neox) : STATUS_OK;
        if (rc == STATUS_OK && n_freq) rc = rope_launch(ctx, k, pos, n, n_kv_heads, head_dim, inv_freq, n_freq, neox);
        if (rc == STATUS_OK)
            rc = cuda_kv_write(ctx, kv_k, kv_v, kv_type, n_blocks, block_size, n_kv_heads, head_dim, k, v, slots, n);
        return rc;
    }
    if (kv_type != DTYPE_F16 && kv_type != DTYPE_F32)
        return cuda_fail(ctx, STATUS_UNSUPPORTED, "rope_kv_write: cache type %s (F32, F16 or Q8_0 only)",
                         dtype_name(kv_type));
    if (n == 0) return STATUS_OK;
    /* Blocks of RK_UNITS units per token: enough for every pair and for
     * the cache row. */
    const int64_t pairs = (int64_t)(n_heads + n_kv_heads) * n_freq, kw = (int64_t)n_kv_heads * head_dim;
    const int64_t units = pairs > kw ? pairs : kw, per_token = (units + RK_UNITS - 1) / RK_UNITS;
    if (per_token > 65535)
        return cuda_fail(ctx, STATUS_BAD_INPUT, "rope_kv_write: %d + %d heads x %d dims is too wide", n_heads,
                         n_kv_heads, head_dim);
    const dim3 grid((unsigned)n, (unsigned)(per_token > 0 ? per_token : 1)), threads(RK_THREADS);
    size_t smem = (size_t)2 * n_freq * sizeof(float);
    if (kv_type == DTYPE_F16)
        CUDA_CHECK(ctx, cuda_launch(ctx, (rope_kv_write_kernel<DTYPE_F16>), grid, threads, smem, q, k, v, kv_k,
                                    kv_v, n_blocks, block_size, n_kv_heads, head_dim, pos, slots, n_heads, inv_freq,
                                    n_freq, neox));
    else
        CUDA_CHECK(ctx, cuda_launch(ctx, (rope_kv_write_kernel<DTYPE_F32>), grid, threads, smem, q, k, v, kv_k,
                                    kv_v, n_blocks, block_size, n_kv_heads, head_dim, pos, slots, n_heads, inv_freq,
                                    n_freq, neox));
    CUDA_CHECK(ctx, cudaGetLastError());
    return STATUS_OK;
}
