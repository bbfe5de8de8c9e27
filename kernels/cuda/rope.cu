/* Rotary position embedding, in place, both pairings: neox pairs (i,
 * i + n_freq), the original GPT-J/Llama layout pairs (2i, 2i + 1).  The
 * angle is formed in double, as the CPU reference does: at positions of
 * 1e5 and more a float product loses the low digits of the phase. */
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
