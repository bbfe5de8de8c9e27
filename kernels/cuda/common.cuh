/* What every .cu file of the CUDA backend shares: the one checking macro
 * for CUDA and cuBLAS calls, half conversions, the backend's own row
 * layouts of Q8_0 and Q6_K, and the per-element dequantization of every
 * weight type (the other block layouts come from common/dtype.h, the same
 * structs the CPU reads). */
#ifndef KERNELS_CUDA_COMMON_CUH
#define KERNELS_CUDA_COMMON_CUH

#include <cublas_v2.h>
#include <cuda_fp16.h>
#include <cuda_runtime.h>
#include <stdint.h>
#include <string.h>

#include "cuda_ops.h"
extern "C" {
#include "../../common/status.h"
}

static inline bool cuda_ok_(cudaError_t e) { return e == cudaSuccess; }
static inline bool cuda_ok_(cublasStatus_t s) { return s == CUBLAS_STATUS_SUCCESS; }
static inline const char *cuda_text_(cudaError_t e) { return cudaGetErrorString(e); }
static inline const char *cuda_text_(cublasStatus_t s) { return cublasGetStatusString(s); }

/* Wraps every CUDA and cuBLAS call: on failure, describe the call, where it
 * was and what the library said in ctx->err, and return STATUS_INTERNAL. */
#define CUDA_CHECK(ctx, call)                                                                   \
    do {                                                                                        \
        auto r_ = (call);                                                                       \
        if (!cuda_ok_(r_))                                                                      \
            return cuda_fail((ctx), STATUS_INTERNAL, "%s (%s:%d): %s", #call, __FILE__, __LINE__, \
                             cuda_text_(r_));                                                   \
    } while (0)

#define CUDA_STREAM(ctx) ((cudaStream_t)(ctx)->stream)

/* Programmatic dependent launch (sm_90 and later).  A kernel launched by
 * cuda_launch may be started while the kernel before it on the stream is
 * still running, so that its launch and block scheduling overlap that
 * kernel's last wave instead of following it (a decode step is hundreds of
 * short kernels).  Such a kernel must call pdl_begin before it touches
 * memory that a kernel writes (loads of what none does, the weights and
 * the step's uploaded metadata, may come first): griddepcontrol.wait
 * returns once the kernel before has finished and its writes are
 * visible; launch_dependents then lets the next kernel launch, no
 * earlier, so at most one grid waits at a time.
 * On older GPUs both are no-ops and cuda_launch is a plain launch. */
__device__ __forceinline__ void pdl_begin() {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
    asm volatile("griddepcontrol.wait;\n" ::: "memory");
    asm volatile("griddepcontrol.launch_dependents;\n" ::: "memory");
#endif
}

/* 16 bytes from global src to shared dst, of which only the first `bytes`
 * are read (the rest zero); a thread's copies since the last commit are
 * one group, and cp_async_wait<N> waits until at most N of its groups are
 * in flight.  These exist on sm_80 and later only: a kernel that uses
 * them is never launched below, and there they do nothing. */
__device__ __forceinline__ void cp_async16(void *dst, const void *src, int bytes = 16) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 800
    asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;\n" ::"r"((unsigned)__cvta_generic_to_shared(dst)),
                 "l"(src), "r"(bytes)
                 : "memory");
#endif
}
__device__ __forceinline__ void cp_async_commit() {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 800
    asm volatile("cp.async.commit_group;\n" ::: "memory");
#endif
}
template <int N> __device__ __forceinline__ void cp_async_wait() {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 800
    asm volatile("cp.async.wait_group %0;\n" ::"n"(N) : "memory");
#endif
}

/* Asks L2 for the line holding p, without waiting and without a register:
 * a kernel that loads one step ahead into registers asks for later steps
 * this way, so that the load finds them in L2.  Only addresses of the
 * buffer being read are passed. */
__device__ __forceinline__ void l2_prefetch(const void *p) {
    asm volatile("prefetch.global.L2 [%0];\n" ::"l"(p));
}

/* *per_sm: the blocks of kernel resident on a multiprocessor at `threads`
 * threads and `smem` bytes of dynamic shared memory (allowed first where
 * that and the kernel's static shared memory pass 48 KB), asked of CUDA
 * once: the caller keeps one entry a variant and device, 0 until asked. */
template <typename... P>
static inline cudaError_t cuda_blocks_per_sm(void (*kernel)(P...), int threads, size_t smem, int *per_sm) {
    if (*per_sm) return cudaSuccess;
    cudaFuncAttributes fa;
    cudaError_t e = cudaFuncGetAttributes(&fa, kernel);
    if (e != cudaSuccess) return e;
    if (fa.sharedSizeBytes + smem > 48 * 1024) {
        e = cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, (int)smem);
        if (e != cudaSuccess) return e;
    }
    int b = 0;
    e = cudaOccupancyMaxActiveBlocksPerMultiprocessor(&b, kernel, threads, smem);
    *per_sm = b > 0 ? b : 1;
    return e;
}

template <typename... P, typename... A>
static inline cudaError_t cuda_launch(const struct cuda_ctx *ctx, void (*kernel)(P...), dim3 grid, dim3 block,
                                      size_t smem, A... args) {
    cudaLaunchConfig_t cfg = {};
    cfg.gridDim = grid;
    cfg.blockDim = block;
    cfg.dynamicSmemBytes = smem;
    cfg.stream = CUDA_STREAM(ctx);
    cudaLaunchAttribute attr[1];
    attr[0].id = cudaLaunchAttributeProgrammaticStreamSerialization;
    attr[0].val.programmaticStreamSerializationAllowed = 1;
    cfg.attrs = attr;
    cfg.numAttrs = ctx->pdl ? 1 : 0;
    return cudaLaunchKernelEx(&cfg, kernel, ((P)args)...);
}

static inline unsigned cuda_blocks(int64_t n, int threads) {
    int64_t b = (n + threads - 1) / threads;
    return (unsigned)(b > 65535LL * 1024 ? 65535LL * 1024 : b);
}

__device__ __forceinline__ float h2f(fp16_t h) { return __half2float(__ushort_as_half(h)); }
__device__ __forceinline__ fp16_t f2h(float f) { return __half_as_ushort(__float2half_rn(f)); }
__device__ __forceinline__ float bf2f(bf16_t h) { return __uint_as_float((uint32_t)h << 16); }
__device__ __forceinline__ bf16_t f2bf(float f) {
    uint32_t u = __float_as_uint(f);
    if ((u & 0x7fffffffu) > 0x7f800000u) return (bf16_t)((u >> 16) | 0x40); /* quiet NaN */
    u += 0x7fffu + ((u >> 16) & 1u);                                        /* nearest even */
    return (bf16_t)(u >> 16);
}
/* BF16 to F16 for T4: out-of-range values saturate instead of becoming inf. */
__device__ __forceinline__ fp16_t bf2h_sat(bf16_t h) {
    float f = bf2f(h);
    if (f > 65504.0f) f = 65504.0f;
    if (f < -65504.0f) f = -65504.0f;
    return f2h(f);
}

/* Scale and min j (0..7) of a Q4_K / Q5_K super-block (6-bit packed). */
__device__ __forceinline__ void kq_scale_min(int j, const uint8_t *q, float *sc, float *mn) {
    if (j < 4) {
        *sc = (float)(q[j] & 63);
        *mn = (float)(q[j + 4] & 63);
    } else {
        *sc = (float)((q[j + 4] & 0xF) | ((q[j - 4] >> 6) << 4));
        *mn = (float)((q[j + 4] >> 4) | ((q[j] >> 6) << 4));
    }
}

/* Q8_0 and Q6_K rows as the CUDA backend stores them (cuda_weight_upload
 * regroups them; repack.cu): GGUF's blocks of 34 and 210 bytes start at
 * even addresses only, so a kernel needed several loads and shifts per 16
 * bytes.  Here each part of a row is an array of its own, every array
 * starts 16-byte aligned and the row is padded to 16 bytes:
 *   Q8_0: codes[cols] int8, then d[cols / 32] F16;
 *   Q6_K: ql[cols / 2], qh[cols / 4], scales[cols / 16] int8, d[cols / 256]
 *         F16.
 * Within an array the blocks keep their GGUF order, so super-block sb's
 * ql is bytes 128 sb .. + 127 of ql, and so on. */
__host__ __device__ static inline size_t q8s_d_off(int64_t cols) { return (size_t)cols; }
__host__ __device__ static inline size_t q6s_qh_off(int64_t cols) { return (size_t)cols / 2; }
__host__ __device__ static inline size_t q6s_sc_off(int64_t cols) { return (size_t)cols / 4 * 3; }
__host__ __device__ static inline size_t q6s_d_off(int64_t cols) { return (size_t)cols / 16 * 13; }

/* Element i of a weight row of type T (any dtype) and width cols, in the
 * backend's layout.  Reads only the block holding i: slow per element,
 * meant for embed and dequantize-to-F16. */
template <int T> __device__ __forceinline__ float dq_elem(const void *row, int64_t i, int64_t cols);

template <> __device__ __forceinline__ float dq_elem<DTYPE_F32>(const void *row, int64_t i, int64_t) {
    return ((const float *)row)[i];
}
template <> __device__ __forceinline__ float dq_elem<DTYPE_F16>(const void *row, int64_t i, int64_t) {
    return h2f(((const fp16_t *)row)[i]);
}
template <> __device__ __forceinline__ float dq_elem<DTYPE_BF16>(const void *row, int64_t i, int64_t) {
    return bf2f(((const bf16_t *)row)[i]);
}
template <> __device__ __forceinline__ float dq_elem<DTYPE_Q8_0>(const void *row, int64_t i, int64_t cols) {
    const uint8_t *r = (const uint8_t *)row;
    return h2f(((const fp16_t *)(r + q8s_d_off(cols)))[i / 32]) * (float)((const int8_t *)r)[i];
}
__device__ __forceinline__ int q4_nibble(const uint8_t *qs, int j) {
    return j < 16 ? (qs[j] & 0xF) : (qs[j - 16] >> 4);
}
template <> __device__ __forceinline__ float dq_elem<DTYPE_Q4_0>(const void *row, int64_t i, int64_t) {
    const block_q4_0 *b = (const block_q4_0 *)row + i / 32;
    return h2f(b->d) * (float)(q4_nibble(b->qs, (int)(i % 32)) - 8);
}
template <> __device__ __forceinline__ float dq_elem<DTYPE_Q4_1>(const void *row, int64_t i, int64_t) {
    const block_q4_1 *b = (const block_q4_1 *)row + i / 32;
    return h2f(b->d) * (float)q4_nibble(b->qs, (int)(i % 32)) + h2f(b->m);
}
__device__ __forceinline__ int q5_value(const uint8_t *qh4, const uint8_t *qs, int j) {
    uint32_t qh = (uint32_t)qh4[0] | (uint32_t)qh4[1] << 8 | (uint32_t)qh4[2] << 16 | (uint32_t)qh4[3] << 24;
    return q4_nibble(qs, j) | (int)(((qh >> j) & 1u) << 4);
}
template <> __device__ __forceinline__ float dq_elem<DTYPE_Q5_0>(const void *row, int64_t i, int64_t) {
    const block_q5_0 *b = (const block_q5_0 *)row + i / 32;
    return h2f(b->d) * (float)(q5_value(b->qh, b->qs, (int)(i % 32)) - 16);
}
template <> __device__ __forceinline__ float dq_elem<DTYPE_Q5_1>(const void *row, int64_t i, int64_t) {
    const block_q5_1 *b = (const block_q5_1 *)row + i / 32;
    return h2f(b->d) * (float)q5_value(b->qh, b->qs, (int)(i % 32)) + h2f(b->m);
}
template <> __device__ __forceinline__ float dq_elem<DTYPE_Q4_K>(const void *row, int64_t i, int64_t) {
    const block_q4_k *b = (const block_q4_k *)row + i / 256;
    int e = (int)(i % 256), p = e / 64, w = e % 64, sub = 2 * p + (w >= 32), l = w % 32;
    float sc, mn;
    kq_scale_min(sub, b->scales, &sc, &mn);
    uint8_t q = b->qs[32 * p + l];
    int nib = w < 32 ? (q & 0xF) : (q >> 4);
    return h2f(b->d) * sc * (float)nib - h2f(b->dmin) * mn;
}
template <> __device__ __forceinline__ float dq_elem<DTYPE_Q5_K>(const void *row, int64_t i, int64_t) {
    const block_q5_k *b = (const block_q5_k *)row + i / 256;
    int e = (int)(i % 256), p = e / 64, w = e % 64, sub = 2 * p + (w >= 32), l = w % 32;
    float sc, mn;
    kq_scale_min(sub, b->scales, &sc, &mn);
    uint8_t q = b->qs[32 * p + l];
    int v = (w < 32 ? (q & 0xF) : (q >> 4)) | (((b->qh[l] >> sub) & 1) << 4);
    return h2f(b->d) * sc * (float)v - h2f(b->dmin) * mn;
}
template <> __device__ __forceinline__ float dq_elem<DTYPE_Q6_K>(const void *row, int64_t i, int64_t cols) {
    const uint8_t *row8 = (const uint8_t *)row;
    const int64_t sb = i / 256;
    const uint8_t *ql = row8 + 128 * sb, *qh = row8 + q6s_qh_off(cols) + 64 * sb;
    const int8_t *sc = (const int8_t *)(row8 + q6s_sc_off(cols)) + 16 * sb;
    float d = h2f(((const fp16_t *)(row8 + q6s_d_off(cols)))[sb]);
    int e = (int)(i % 256), h = e / 128, r = e % 128, quarter = r / 32, l = r % 32;
    uint8_t lo = ql[64 * h + 32 * (quarter & 1) + l];
    int low4 = quarter < 2 ? (lo & 0xF) : (lo >> 4);
    int hi2 = (qh[32 * h + l] >> (2 * quarter)) & 3;
    int q = (low4 | (hi2 << 4)) - 32;
    return d * (float)sc[8 * h + l / 16 + 2 * quarter] * (float)q;
}

/* One switch from a runtime dtype to a template instantiation: calls
 * FN<T>(args...) and yields its status; unknown types fail. */
#define CUDA_DTYPE_DISPATCH(ctx, type, FN, ...)                                                 \
    do {                                                                                        \
        switch (type) {                                                                         \
        case DTYPE_F32: return FN<DTYPE_F32>(__VA_ARGS__);                                      \
        case DTYPE_F16: return FN<DTYPE_F16>(__VA_ARGS__);                                      \
        case DTYPE_BF16: return FN<DTYPE_BF16>(__VA_ARGS__);                                    \
        case DTYPE_Q8_0: return FN<DTYPE_Q8_0>(__VA_ARGS__);                                    \
        case DTYPE_Q4_0: return FN<DTYPE_Q4_0>(__VA_ARGS__);                                    \
        case DTYPE_Q4_1: return FN<DTYPE_Q4_1>(__VA_ARGS__);                                    \
        case DTYPE_Q5_0: return FN<DTYPE_Q5_0>(__VA_ARGS__);                                    \
        case DTYPE_Q5_1: return FN<DTYPE_Q5_1>(__VA_ARGS__);                                    \
        case DTYPE_Q4_K: return FN<DTYPE_Q4_K>(__VA_ARGS__);                                    \
        case DTYPE_Q5_K: return FN<DTYPE_Q5_K>(__VA_ARGS__);                                    \
        case DTYPE_Q6_K: return FN<DTYPE_Q6_K>(__VA_ARGS__);                                    \
        }                                                                                       \
        return cuda_fail((ctx), STATUS_UNSUPPORTED, "weight type %d is not supported", (int)(type)); \
    } while (0)

/* Bytes of one weight row as the backend stores it (dtype_row_bytes for
 * every type but the regrouped Q8_0 and Q6_K, which are padded to 16). */
static inline size_t cuda_row_bytes(enum dtype t, int64_t cols) {
    switch (t) {
    case DTYPE_F32: return (size_t)cols * 4;
    case DTYPE_F16: case DTYPE_BF16: return (size_t)cols * 2;
    case DTYPE_Q8_0: return ((size_t)(cols / 32) * sizeof(block_q8_0) + 15) & ~(size_t)15;
    case DTYPE_Q4_0: return (size_t)(cols / 32) * sizeof(block_q4_0);
    case DTYPE_Q4_1: return (size_t)(cols / 32) * sizeof(block_q4_1);
    case DTYPE_Q5_0: return (size_t)(cols / 32) * sizeof(block_q5_0);
    case DTYPE_Q5_1: return (size_t)(cols / 32) * sizeof(block_q5_1);
    case DTYPE_Q4_K: return (size_t)(cols / 256) * sizeof(block_q4_k);
    case DTYPE_Q5_K: return (size_t)(cols / 256) * sizeof(block_q5_k);
    case DTYPE_Q6_K: return ((size_t)(cols / 256) * sizeof(block_q6_k) + 15) & ~(size_t)15;
    }
    return 0;
}

#endif
