/* Rotary position embedding, in place, both pairings: neox pairs (i,
 * i + n_freq), the original GPT-J/Llama layout pairs (2i, 2i + 1).  The
 * angle is formed in double, as the CPU reference does: at positions of
 * 1e5 and more a float product loses the low digits of the phase.  Also
 * the fused rope of q and k with the KV-cache write (one launch per layer). */
#include "common.cuh"

/* One thread per (token, frequency): one sincos shared by every head. */
__global__ void rope_f32_kernel(float *x, const int32_t *pos, int32_t n, int32_t n_heads, int32_t head_dim,
                                const float *inv_freq, int32_t n_freq, int neox) {
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
    rope_f32_kernel<<<(unsigned)((threads + 127) / 128), 128, 0, CUDA_STREAM(ctx)>>>(x, pos, n, n_heads, head_dim,
                                                                                   inv_freq, n_freq, neox);
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

/* rope of q and k and the cache write of k and v for one token per block:
 * the token's sines and cosines once in shared memory, every head of q
 * and k rotated, then k's and v's rows stored into the token's slot (as
 * kv_write.cu: a slot outside the cache is skipped). */
template <int KT>
__global__ void rope_kv_write_kernel(float *q, float *k, const float *v, void *kc, void *vc, int32_t n_blocks,
                                     int32_t block_size, int32_t n_kv_heads, int32_t head_dim, const int32_t *pos,
                                     const int32_t *slots, int32_t n_heads, const float *inv_freq, int32_t n_freq,
                                     int neox) {
    extern __shared__ float rk_sc[]; /* cos[n_freq], sin[n_freq] */
    const int64_t t = blockIdx.x;
    for (int32_t i = threadIdx.x; i < n_freq; i += blockDim.x) {
        double s, c;
        sincos((double)pos[t] * (double)inv_freq[i], &s, &c);
        rk_sc[i] = (float)c;
        rk_sc[n_freq + i] = (float)s;
    }
    __syncthreads();
    const int32_t qw = n_heads * head_dim, kw = n_kv_heads * head_dim;
    for (int32_t id = threadIdx.x; id < (n_heads + n_kv_heads) * n_freq; id += blockDim.x) {
        int32_t h = id / n_freq, i = id % n_freq;
        float *hv = h < n_heads ? q + t * qw + (int64_t)h * head_dim : k + t * kw + (int64_t)(h - n_heads) * head_dim;
        int32_t j0 = neox ? i : 2 * i, j1 = neox ? i + n_freq : 2 * i + 1;
        float fc = rk_sc[i], fs = rk_sc[n_freq + i], x0 = hv[j0], x1 = hv[j1];
        hv[j0] = x0 * fc - x1 * fs;
        hv[j1] = x0 * fs + x1 * fc;
    }
    __syncthreads();
    const int32_t slot = slots[t];
    if (slot < 0 || slot >= n_blocks * block_size) return;
    const int32_t blk = slot / block_size, off = slot % block_size;
    for (int32_t i = threadIdx.x; i < kw; i += blockDim.x) {
        int32_t h = i / head_dim, d = i % head_dim;
        size_t dst = (((size_t)blk * n_kv_heads + h) * block_size + off) * head_dim + d;
        float kx = k[t * kw + i], vx = v[t * kw + i];
        if (KT == DTYPE_F16) {
            ((fp16_t *)kc)[dst] = f2h(kx);
            ((fp16_t *)vc)[dst] = f2h(vx);
        } else {
            ((float *)kc)[dst] = kx;
            ((float *)vc)[dst] = vx;
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
    if (kv_type != DTYPE_F16 && kv_type != DTYPE_F32)
        return cuda_fail(ctx, STATUS_UNSUPPORTED, "rope_kv_write: cache type %s (F32 or F16 only)",
                         dtype_name(kv_type));
    if (n == 0) return STATUS_OK;
    int work = (n_heads + n_kv_heads) * n_freq, threads = work < 256 ? (work + 31) / 32 * 32 : 256;
    if (threads < 64) threads = 64;
    size_t smem = (size_t)2 * n_freq * sizeof(float);
    if (kv_type == DTYPE_F16)
        rope_kv_write_kernel<DTYPE_F16><<<n, threads, smem, CUDA_STREAM(ctx)>>>(
            q, k, v, kv_k, kv_v, n_blocks, block_size, n_kv_heads, head_dim, pos, slots, n_heads, inv_freq, n_freq,
            neox);
    else
        rope_kv_write_kernel<DTYPE_F32><<<n, threads, smem, CUDA_STREAM(ctx)>>>(
            q, k, v, kv_k, kv_v, n_blocks, block_size, n_kv_heads, head_dim, pos, slots, n_heads, inv_freq, n_freq,
            neox);
    CUDA_CHECK(ctx, cudaGetLastError());
    return STATUS_OK;
}
