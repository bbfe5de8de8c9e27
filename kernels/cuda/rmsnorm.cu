/* RMS normalization, alone and fused with the residual add that precedes
 * it in every layer (x += delta; out = rmsnorm(x) * w), one block per row:
 * a register-held vector kernel for rows a multiple of 4 wide, a plain
 * loop for the rest. */
#include "act_q8.cuh"
#include "common.cuh"

#define RMSNORM_THREADS 256

/* The sum of ss over the block (at most 1024 threads, every thread
 * calls it), returned to every thread. */
__device__ __forceinline__ float rmsnorm_block_sum(float ss) {
    __shared__ float partial[32];
    for (int o = 16; o > 0; o >>= 1) ss += __shfl_xor_sync(0xffffffffu, ss, o);
    if (threadIdx.x % 32 == 0) partial[threadIdx.x / 32] = ss;
    __syncthreads();
    if (threadIdx.x < 32) {
        ss = threadIdx.x < blockDim.x / 32 ? partial[threadIdx.x] : 0.0f;
        for (int o = 16; o > 0; o >>= 1) ss += __shfl_xor_sync(0xffffffffu, ss, o);
        if (threadIdx.x == 0) partial[0] = ss;
    }
    __syncthreads();
    return partial[0];
}

/* With delta != NULL, x is updated in place first (the fused residual). */
__global__ void rmsnorm_f32_kernel(float *out, float *x, const float *delta, const float *w, int32_t dim,
                                   float eps) {
    pdl_begin();
    int64_t row = blockIdx.x;
    float *xr = x + row * dim;
    const float *dr = delta ? delta + row * dim : NULL;
    float ss = 0.0f;
    for (int32_t i = threadIdx.x; i < dim; i += blockDim.x) {
        float v = xr[i];
        if (dr) {
            v += dr[i];
            xr[i] = v;
        }
        ss += v * v;
    }
    float inv = 1.0f / sqrtf(rmsnorm_block_sum(ss) / (float)dim + eps);
    float *orow = out + row * dim;
    for (int32_t i = threadIdx.x; i < dim; i += blockDim.x) orow[i] = xr[i] * inv * w[i];
}

/* The int8 form of the output (matmul_gemv.cu's, for the gemv matmul that
 * reads it next: cuda_gemv_act_q8s) from the float4 i of a row that this
 * thread holds: 8 consecutive threads (lanes) make a block of 32, 4 a half;
 * the same arithmetic as gemv_quant_x_kernel, so the same bits.  Every
 * thread calls it (threads past the row with zeros). */
__device__ __forceinline__ void rmsnorm_q8s(float4 v, float inv, float4 wv, int32_t i, int32_t n4, int64_t row,
                                            int32_t dim, int8_t *xq, float *xd, float *xs) {
    const bool in = i < n4;
    const float o[4] = {in ? v.x * inv * wv.x : 0.0f, in ? v.y * inv * wv.y : 0.0f, in ? v.z * inv * wv.z : 0.0f,
                        in ? v.w * inv * wv.w : 0.0f};
    act_q8_lanes<4>(o, row * dim + 4 * (int64_t)i, 0xffffffffu, xq, xd, xs, in);
}

/* The same op with every load of a row issued before any is used: each
 * thread holds its K float4s of x, delta and w in registers, so a row
 * costs one memory round trip instead of one per loop iteration (the
 * loop above cannot overlap its iterations: x is stored to and the
 * compiler must assume it aliases delta and w).  At batch 1 that is the
 * difference between ~3 and ~16 us per call.  dim % 4 == 0, pointers
 * 16-byte aligned, dim <= 4 * K * blockDim. */
template <int K>
__global__ void rmsnorm_vec_kernel(float *__restrict__ out, float *__restrict__ x, const float *__restrict__ delta,
                                   const float *__restrict__ w, int32_t dim, float eps, fp16_t *__restrict__ out16,
                                   int8_t *__restrict__ xq, float *__restrict__ xd, float *__restrict__ xs,
                                   int8_t *__restrict__ kq, float *__restrict__ kd, int16_t *__restrict__ kb) {
    const int64_t row = blockIdx.x;
    const int32_t n4 = dim / 4;
    float4 *xr = (float4 *)(x + row * dim);
    const float4 *dr = delta ? (const float4 *)(delta + row * dim) : NULL;
    float4 v[K], wv[K];
    /* The norm's weights are no kernel's output: loaded before the wait,
     * while the matmul before ends (by the end of a layer L2 no longer
     * holds them, so after the wait they would cost a DRAM round trip). */
#pragma unroll
    for (int k = 0; k < K; k++) {
        int32_t i = threadIdx.x + k * blockDim.x;
        wv[k] = i < n4 ? __ldg((const float4 *)w + i) : make_float4(0.0f, 0.0f, 0.0f, 0.0f);
    }
    pdl_begin();
#pragma unroll
    for (int k = 0; k < K; k++) {
        int32_t i = threadIdx.x + k * blockDim.x;
        v[k] = i < n4 ? xr[i] : make_float4(0.0f, 0.0f, 0.0f, 0.0f);
        if (dr && i < n4) {
            float4 d = dr[i];
            v[k].x += d.x, v[k].y += d.y, v[k].z += d.z, v[k].w += d.w;
        }
    }
    float ss = 0.0f;
#pragma unroll
    for (int k = 0; k < K; k++) {
        int32_t i = threadIdx.x + k * blockDim.x;
        if (dr && i < n4) xr[i] = v[k];
        ss += v[k].x * v[k].x + v[k].y * v[k].y + v[k].z * v[k].z + v[k].w * v[k].w;
    }
    const float inv = 1.0f / sqrtf(rmsnorm_block_sum(ss) / (float)dim + eps);
    float4 *orow = (float4 *)(out + row * dim);
#pragma unroll
    for (int k = 0; k < K; k++) {
        int32_t i = threadIdx.x + k * blockDim.x;
        if (i < n4) {
            const float4 o = make_float4(v[k].x * inv * wv[k].x, v[k].y * inv * wv[k].y, v[k].z * inv * wv[k].z,
                                         v[k].w * inv * wv[k].w);
            orow[i] = o;
            if (out16) {
                uint2 h;
                h.x = (uint32_t)f2h(o.x) | (uint32_t)f2h(o.y) << 16;
                h.y = (uint32_t)f2h(o.z) | (uint32_t)f2h(o.w) << 16;
                ((uint2 *)(out16 + row * dim))[i] = h;
            }
        }
        if (xq) rmsnorm_q8s(v[k], inv, wv[k], i, n4, row, dim, xq, xd, xs);
    }
    if (kq) {
        /* matmul_mmq.cu's form of the row, a warp a chunk, from the output
         * just written (the barrier makes the block's stores visible to it):
         * the same input to the same arithmetic as its own kernel. */
        __syncthreads();
        for (int s = threadIdx.x / 32; s < dim / 256; s += blockDim.x / 32)
            act_q8k_chunk<true>(out + row * dim + (size_t)s * 256, threadIdx.x % 32, (size_t)s * gridDim.x + row, kq,
                                kd, kb);
    }
}

/* The most threads a block of rmsnorm_vec_kernel<K> takes on ctx's device
 * (its registers bound it: about 105 a thread at K = 8, so rows wider than
 * about 18,000 go to the plain loop), asked once per device and K. */
template <int K> static int rmsnorm_vec_threads(const struct cuda_ctx *ctx) {
    static int most[64];
    const int dev = ctx->device >= 0 && ctx->device < 64 ? ctx->device : 0;
    if (!most[dev]) {
        cudaFuncAttributes at;
        if (cudaFuncGetAttributes(&at, rmsnorm_vec_kernel<K>) == cudaSuccess) {
            most[dev] = at.maxThreadsPerBlock;
        } else {
            cudaGetLastError(); /* not sticky: the plain loop takes every row */
            most[dev] = -1;
        }
    }
    return most[dev];
}

static int rmsnorm_launch(struct cuda_ctx *ctx, float *out, float *x, const float *delta, const float *w,
                          int32_t n, int32_t dim, float eps) {
    const int32_t n4 = dim / 4;
    /* Up to 1024 threads of one float4 each; wider rows take 2, 4 or 8. */
    const int k = n4 <= 1024 ? 1 : n4 <= 2048 ? 2 : n4 <= 4096 ? 4 : 8;
    const int threads = ((n4 + k - 1) / k + 31) / 32 * 32;
    const int most = k == 1 ? rmsnorm_vec_threads<1>(ctx) : k == 2 ? rmsnorm_vec_threads<2>(ctx)
                     : k == 4 ? rmsnorm_vec_threads<4>(ctx) : rmsnorm_vec_threads<8>(ctx);
    const bool vec = dim % 4 == 0 && (uintptr_t)out % 16 == 0 && (uintptr_t)x % 16 == 0 &&
                     (uintptr_t)w % 16 == 0 && (uintptr_t)delta % 16 == 0 && threads <= most;
    if (vec) {
        /* Prefill rows also come out as F16 for the cuBLAS matmuls that
         * read them next (cuda_gemm_act): no conversion pass over them;
         * decode rows (1-2) as int8 blocks for the gemv kernels, which
         * then need no quantizing launch. */
        fp16_t *o16 = NULL;
        int8_t *xq = NULL, *kq = NULL;
        float *xd = NULL, *xs = NULL, *kd = NULL;
        int16_t *kb = NULL;
        if (n > 2) {
            /* And up to 16 rows, once matmul_mmq.cu has run (which
             * quantizes its input itself otherwise, a launch of its own),
             * its Q8K8 form at the top of the scratch (cuda_actq_kept).  At
             * 64 rows the quantizing in the norm's one block a row measured
             * slower than the launch it saves (docs/cuda-backend.md). */
            const bool q8k = ctx->mmq_seen && n <= 16 && dim % 256 == 0;
            const size_t qb = q8k ? cuda_q8k_bytes(n, dim) : 0;
            if (q8k && !cuda_scratch(ctx, cuda_q8k_align((size_t)n * dim * 2) + qb)) return STATUS_NO_MEMORY;
            uint16_t *x16 = NULL;
            int fresh = 0;
            int rc = cuda_gemm_act(ctx, out, n, dim, &x16, &fresh);
            if (rc != STATUS_OK) return rc;
            o16 = (fp16_t *)x16;
            if (q8k) {
                const size_t lo = (ctx->scratch_bytes - qb) & ~(size_t)255;
                cuda_q8k_parts((uint8_t *)ctx->scratch + lo, n, dim, &kq, &kd, &kb);
                ctx->actq_kind = MATMUL_ACT_Q8K8;
                ctx->actq_x = out;
                ctx->actq_n = n;
                ctx->actq_cols = dim;
                ctx->actq_lo = lo;
            }
        } else if (dim % 64 == 0 && cuda_gemv_act_q8s(ctx, out, n, dim, &xq, &xd, &xs) != STATUS_OK) {
            /* No scratch for it: the norm goes on without; the matmul
             * quantizes its input itself (or reports the shortage). */
            xq = NULL;
            xd = xs = NULL;
        }
        void (*kernel)(float *, float *, const float *, const float *, int32_t, float, fp16_t *, int8_t *, float *,
                       float *, int8_t *, float *, int16_t *) =
            k == 1 ? rmsnorm_vec_kernel<1> : k == 2 ? rmsnorm_vec_kernel<2> : k == 4 ? rmsnorm_vec_kernel<4>
                                                                                     : rmsnorm_vec_kernel<8>;
        const cudaError_t launch = cuda_launch(ctx, kernel, dim3(n), dim3(threads), 0, out, x, delta, w, dim, eps, o16,
                                               xq, xd, xs, kq, kd, kb);
        if (launch != cudaSuccess) cuda_act_forget(ctx); /* the forms recorded above were not written */
        CUDA_CHECK(ctx, launch);
    } else {
        CUDA_CHECK(ctx, cuda_launch(ctx, rmsnorm_f32_kernel, dim3(n), dim3(RMSNORM_THREADS), 0, out, x, delta, w, dim,
                                    eps));
    }
    CUDA_CHECK(ctx, cudaGetLastError());
    return STATUS_OK;
}

extern "C" int cuda_rmsnorm(struct cuda_ctx *ctx, float *out, const float *x, const float *w, int32_t n,
                            int32_t dim, float eps) {
    if (n < 0 || dim <= 0) return cuda_fail(ctx, STATUS_BAD_INPUT, "rmsnorm: shape [%d x %d]", n, dim);
    if (n == 0) return STATUS_OK;
    /* Without delta the kernel never writes x. */
    return rmsnorm_launch(ctx, out, (float *)x, NULL, w, n, dim, eps);
}

extern "C" int cuda_add_rmsnorm(struct cuda_ctx *ctx, float *x, const float *delta, float *out, const float *w,
                                int32_t n, int32_t dim, float eps) {
    if (n < 0 || dim <= 0) return cuda_fail(ctx, STATUS_BAD_INPUT, "add_rmsnorm: shape [%d x %d]", n, dim);
    if (n == 0) return STATUS_OK;
    return rmsnorm_launch(ctx, out, x, delta, w, n, dim, eps);
}
