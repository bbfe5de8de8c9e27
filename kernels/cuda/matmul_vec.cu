/* Skinny matmul for decode and small batches (n <= 16 tokens): each warp
 * owns one weight row, reads it once straight from its stored (quantized)
 * form with coalesced loads (the unit layout of quant_units.cuh), dequantizes
 * in registers and accumulates the dot products of all n tokens in F32.  Decode is memory-bound, so the
 * measure here is the fraction of DRAM bandwidth reached. */
#include "quant_units.cuh"

#define MV_WARPS 4

/* acc[t] += w[0..L) . x[t, off .. off + L) for the n (<= NT) tokens. */
template <int NT, int L>
__device__ __forceinline__ void mv_dot(float (&acc)[NT], const float *w, const float *x, int64_t cols, int64_t off,
                                       int n) {
#pragma unroll
    for (int t = 0; t < NT; t++) {
        if (t < n) {
            const float4 *xp = (const float4 *)(x + t * cols + off);
            float a = 0.0f;
#pragma unroll
            for (int k = 0; k < L / 4; k++) {
                float4 v = __ldg(xp + k);
                a += w[4 * k] * v.x + w[4 * k + 1] * v.y + w[4 * k + 2] * v.z + w[4 * k + 3] * v.w;
            }
            acc[t] += a;
        }
    }
}

template <int T, int NT>
__global__ void __launch_bounds__(MV_WARPS * 32)
matmul_vec_kernel(float *out, const uint8_t *w, size_t row_bytes, int64_t rows, int64_t cols, const float *x, int n) {
    constexpr int RUNS = qu_shape<T>::runs, RLEN = qu_shape<T>::rlen;
    int64_t row = (int64_t)blockIdx.x * MV_WARPS + threadIdx.x / 32;
    int lane = threadIdx.x % 32;
    if (row >= rows) return;
    const uint8_t *wr = w + (size_t)row * row_bytes;
    float acc[NT];
#pragma unroll
    for (int t = 0; t < NT; t++) acc[t] = 0.0f;
    int64_t units = qu_units<T>(cols);
    for (int64_t u = lane; u < units; u += 32) {
        float wv[RUNS * RLEN];
        qu_load<T>(wr, u, wv);
#pragma unroll
        for (int k = 0; k < RUNS; k++) mv_dot<NT, RLEN>(acc, wv + k * RLEN, x, cols, qu_off<T>(u, k), n);
    }
#pragma unroll
    for (int t = 0; t < NT; t++) {
        if (t < n) {
            float v = acc[t];
#pragma unroll
            for (int o = 16; o > 0; o >>= 1) v += __shfl_xor_sync(0xffffffffu, v, o);
            if (lane == 0) out[(int64_t)t * rows + row] = v;
        }
    }
}

template <int T, int NT>
static int mv_launch_nt(struct cuda_ctx *ctx, float *out, const void *w, int64_t rows, int64_t cols, const float *x,
                        int n) {
    unsigned grid = (unsigned)((rows + MV_WARPS - 1) / MV_WARPS);
    matmul_vec_kernel<T, NT><<<grid, MV_WARPS * 32, 0, CUDA_STREAM(ctx)>>>(
        out, (const uint8_t *)w, cuda_row_bytes((enum dtype)T, cols), rows, cols, x, n);
    CUDA_CHECK(ctx, cudaGetLastError());
    return STATUS_OK;
}

template <int T>
static int mv_launch(struct cuda_ctx *ctx, float *out, const void *w, int64_t rows, int64_t cols, const float *x,
                     int n) {
    if (n == 1) return mv_launch_nt<T, 1>(ctx, out, w, rows, cols, x, n);
    if (n <= 4) return mv_launch_nt<T, 4>(ctx, out, w, rows, cols, x, n);
    if (n <= 8) return mv_launch_nt<T, 8>(ctx, out, w, rows, cols, x, n);
    return mv_launch_nt<T, 16>(ctx, out, w, rows, cols, x, n);
}

extern "C" int cuda_matmul_vec_supports(enum dtype type, int64_t cols) {
    switch (type) {
    case DTYPE_F32: return cols % 4 == 0;
    case DTYPE_F16: return cols % 8 == 0;
    case DTYPE_Q8_0: case DTYPE_Q4_0: case DTYPE_Q4_1: case DTYPE_Q5_0: case DTYPE_Q5_1:
        return cols % 32 == 0;
    case DTYPE_Q4_K: case DTYPE_Q5_K: case DTYPE_Q6_K: return cols % 256 == 0;
    default: return 0;
    }
}

extern "C" int cuda_matmul_vec(struct cuda_ctx *ctx, float *out, const void *w, enum dtype type, int64_t rows,
                               int64_t cols, const float *x, int32_t n) {
    if (n < 1 || n > CUDA_MATMUL_VEC_MAX || rows <= 0 || !cuda_matmul_vec_supports(type, cols))
        return cuda_fail(ctx, STATUS_BAD_INPUT, "matmul_vec: %d tokens x %s [%lld x %lld] is not a skinny shape", n,
                         dtype_name(type), (long long)rows, (long long)cols);
    if ((uintptr_t)x % 16 != 0 || (uintptr_t)w % 16 != 0)
        return cuda_fail(ctx, STATUS_BAD_INPUT, "matmul_vec: x %p or weight %p is not 16-byte aligned", (const void *)x,
                         w);
    switch (type) {
    case DTYPE_F32: return mv_launch<DTYPE_F32>(ctx, out, w, rows, cols, x, n);
    case DTYPE_F16: return mv_launch<DTYPE_F16>(ctx, out, w, rows, cols, x, n);
    case DTYPE_Q8_0: return mv_launch<DTYPE_Q8_0>(ctx, out, w, rows, cols, x, n);
    case DTYPE_Q4_0: return mv_launch<DTYPE_Q4_0>(ctx, out, w, rows, cols, x, n);
    case DTYPE_Q4_1: return mv_launch<DTYPE_Q4_1>(ctx, out, w, rows, cols, x, n);
    case DTYPE_Q5_0: return mv_launch<DTYPE_Q5_0>(ctx, out, w, rows, cols, x, n);
    case DTYPE_Q5_1: return mv_launch<DTYPE_Q5_1>(ctx, out, w, rows, cols, x, n);
    case DTYPE_Q4_K: return mv_launch<DTYPE_Q4_K>(ctx, out, w, rows, cols, x, n);
    case DTYPE_Q5_K: return mv_launch<DTYPE_Q5_K>(ctx, out, w, rows, cols, x, n);
    case DTYPE_Q6_K: return mv_launch<DTYPE_Q6_K>(ctx, out, w, rows, cols, x, n);
    default: break;
    }
    return cuda_fail(ctx, STATUS_UNSUPPORTED, "matmul_vec: weight type %s", dtype_name(type));
}
