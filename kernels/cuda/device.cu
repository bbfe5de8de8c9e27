/* The CUDA backend's device plumbing: context (device, stream, cuBLAS
 * handle, scratch), memory, host transfers and weight upload.  Kernels live
 * one op per file beside this. */
#include "common.cuh"
#include "knobs.h"

#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

extern "C" int cuda_fail(struct cuda_ctx *ctx, int code, const char *fmt, ...) {
    if (ctx->err && ctx->errlen) {
        va_list ap;
        va_start(ap, fmt);
        vsnprintf(ctx->err, ctx->errlen, fmt, ap);
        va_end(ap);
    }
    return code;
}

/* Launched never: its attributes tell which architecture's code the
 * driver loaded for this card (cuda_ctx_init). */
__global__ void cuda_arch_probe(void) {}

extern "C" int cuda_ctx_init(struct cuda_ctx **out, int device, char *err, size_t errlen) {
    *out = NULL;
    /* The LLM_CUDA_* knobs (knobs.c), read once, before the GPU is touched:
     * a bad value fails the backend's start, naming the variable. */
    struct cuda_knobs knobs;
    int rc = cuda_knobs_read(&knobs, err, errlen);
    if (rc != STATUS_OK) return rc;
    int count = 0;
    cudaError_t e = cudaGetDeviceCount(&count);
    if (e != cudaSuccess || count == 0) {
        snprintf(err, errlen, "cuda:%d: no usable GPU (%s)", device,
                 e != cudaSuccess ? cudaGetErrorString(e) : "no CUDA device");
        cudaGetLastError();
        return STATUS_UNAVAILABLE;
    }
    if (device < 0 || device >= count) {
        snprintf(err, errlen, "cuda:%d: no such GPU (this machine has %d)", device, count);
        return STATUS_UNAVAILABLE;
    }
    struct cuda_ctx *ctx = (struct cuda_ctx *)calloc(1, sizeof *ctx);
    if (!ctx) {
        snprintf(err, errlen, "cuda:%d: out of host memory", device);
        return STATUS_NO_MEMORY;
    }
    ctx->device = device;
    ctx->err = err;
    ctx->errlen = errlen;
    cudaDeviceProp prop;
    cudaStream_t stream = NULL;
    cublasHandle_t handle = NULL;
    /* A lambda so CUDA_CHECK's early return lands in one cleanup path. */
    auto setup = [&]() -> int {
        CUDA_CHECK(ctx, cudaSetDevice(device));
        CUDA_CHECK(ctx, cudaGetDeviceProperties(&prop, device));
        /* The greatest priority: dequant_ahead.cu's side stream has the
         * least, so its blocks take only what the step's kernels leave. */
        int least = 0, greatest = 0;
        CUDA_CHECK(ctx, cudaDeviceGetStreamPriorityRange(&least, &greatest));
        CUDA_CHECK(ctx, cudaStreamCreateWithPriority(&stream, cudaStreamNonBlocking, greatest));
        ctx->stream = stream;
        CUDA_CHECK(ctx, cublasCreate(&handle));
        ctx->cublas = handle;
        CUDA_CHECK(ctx, cublasSetStream(handle, stream));
        return STATUS_OK;
    };
    rc = setup();
    if (rc != STATUS_OK) {
        cuda_ctx_free(ctx);
        return rc;
    }
    ctx->n_sms = prop.multiProcessorCount;
    ctx->cc = prop.major * 10 + prop.minor;
    /* A build may hold code for older architectures only (the T4 image is
     * compute_75 alone; on an L4 or an H100 the driver compiles its PTX):
     * the newer paths' instructions are not in that code, so route as the
     * newest architecture the build holds for this card. */
    cudaFuncAttributes fa;
    if (cudaFuncGetAttributes(&fa, cuda_arch_probe) == cudaSuccess && fa.ptxVersion > 0 && fa.ptxVersion < ctx->cc)
        ctx->cc = fa.ptxVersion;
    cudaGetLastError();
    rc = cuda_knobs_apply(&knobs, ctx, err, errlen);
    if (rc != STATUS_OK) {
        cuda_ctx_free(ctx);
        return rc;
    }
    /* rope_attention.cu's counters, zeroed here, once: a graph replays the
     * kernel, never a reset. */
    if (ctx->rope_att || ctx->rope_att_mha) {
        rc = [&]() -> int {
            CUDA_CHECK(ctx, cudaMalloc((void **)&ctx->att_sync, CUDA_ATT_SYNC_WORDS * sizeof(unsigned)));
            CUDA_CHECK(ctx, cudaMemset(ctx->att_sync, 0, CUDA_ATT_SYNC_WORDS * sizeof(unsigned)));
            return STATUS_OK;
        }();
        if (rc != STATUS_OK) {
            cuda_ctx_free(ctx);
            return rc;
        }
    }
    snprintf(ctx->device_name, sizeof ctx->device_name, "%.95s", prop.name);
    *out = ctx;
    return STATUS_OK;
}

extern "C" void cuda_ctx_free(struct cuda_ctx *ctx) {
    if (!ctx) return;
    cudaSetDevice(ctx->device);
    if (ctx->stream) cudaStreamSynchronize((cudaStream_t)ctx->stream);
    cuda_ahead_free(ctx);
    if (ctx->scratch) cudaFree(ctx->scratch);
    if (ctx->att_sync) cudaFree(ctx->att_sync);
    if (ctx->cublas) cublasDestroy((cublasHandle_t)ctx->cublas);
    if (ctx->stream) cudaStreamDestroy((cudaStream_t)ctx->stream);
    free(ctx);
}

extern "C" void *cuda_malloc(struct cuda_ctx *ctx, size_t bytes) {
    void *p = NULL;
    cudaError_t e = cudaMalloc(&p, bytes);
    if (e != cudaSuccess) {
        cudaGetLastError(); /* an allocation failure is not sticky: clear it */
        size_t fr = 0, tot = 0;
        cudaMemGetInfo(&fr, &tot);
        cuda_fail(ctx, STATUS_NO_MEMORY, "cuda:%d: cannot allocate %zu bytes (%zu of %zu free): %s",
                  ctx->device, bytes, fr, tot, cudaGetErrorString(e));
        return NULL;
    }
    return p;
}

extern "C" void cuda_free(struct cuda_ctx *ctx, void *p) {
    cuda_ahead_forget(ctx); /* the memory may come back holding another weight */
    if (p) cudaFree(p);
}

extern "C" int cuda_mem_info(struct cuda_ctx *ctx, size_t *bytes_free, size_t *bytes_total) {
    CUDA_CHECK(ctx, cudaMemGetInfo(bytes_free, bytes_total));
    return STATUS_OK;
}

extern "C" int cuda_upload(struct cuda_ctx *ctx, void *dst, const void *src, size_t bytes) {
    cuda_ahead_written(ctx, dst, bytes);
    CUDA_CHECK(ctx, cudaMemcpyAsync(dst, src, bytes, cudaMemcpyHostToDevice, CUDA_STREAM(ctx)));
    return STATUS_OK;
}

extern "C" int cuda_download(struct cuda_ctx *ctx, void *dst, const void *src, size_t bytes) {
    CUDA_CHECK(ctx, cudaMemcpyAsync(dst, src, bytes, cudaMemcpyDeviceToHost, CUDA_STREAM(ctx)));
    CUDA_CHECK(ctx, cudaStreamSynchronize(CUDA_STREAM(ctx)));
    return STATUS_OK;
}

extern "C" int cuda_copy(struct cuda_ctx *ctx, void *dst, const void *src, size_t bytes) {
    cuda_ahead_written(ctx, dst, bytes);
    CUDA_CHECK(ctx, cudaMemcpyAsync(dst, src, bytes, cudaMemcpyDeviceToDevice, CUDA_STREAM(ctx)));
    return STATUS_OK;
}

extern "C" int cuda_sync(struct cuda_ctx *ctx) {
    CUDA_CHECK(ctx, cudaStreamSynchronize(CUDA_STREAM(ctx)));
    return STATUS_OK;
}

extern "C" void *cuda_scratch(struct cuda_ctx *ctx, size_t bytes) {
    if (bytes > ctx->actq_lo) ctx->actq_kind = MATMUL_ACT_NONE; /* the caller writes over it */
    if (bytes <= ctx->scratch_bytes) return ctx->scratch;
    cuda_act_forget(ctx); /* a new buffer may come back at the same address */
    /* Queued ops may still read the old buffer. */
    cudaError_t e = cudaStreamSynchronize(CUDA_STREAM(ctx));
    if (e != cudaSuccess) {
        cuda_fail(ctx, STATUS_INTERNAL, "cuda:%d: scratch: synchronize: %s", ctx->device,
                  cudaGetErrorString(e));
        return NULL;
    }
    cudaFree(ctx->scratch);
    ctx->scratch = NULL;
    ctx->scratch_bytes = 0;
    size_t want = bytes + bytes / 4; /* headroom, so a slowly growing batch does not realloc each step */
    void *p = cuda_malloc(ctx, want);
    if (!p) return NULL;
    ctx->scratch = p;
    ctx->scratch_bytes = want;
    return p;
}

extern "C" int cuda_weight_upload(struct cuda_ctx *ctx, void **dst, enum dtype *stored, enum dtype type,
                                  const void *host, int64_t rows, int64_t cols) {
    *dst = NULL;
    cuda_ahead_forget(ctx);
    size_t row_bytes = cuda_row_bytes(type, cols);
    if (row_bytes == 0)
        return cuda_fail(ctx, STATUS_UNSUPPORTED, "weight type %d is not supported", (int)type);
    size_t bytes = row_bytes * (size_t)rows;
    void *d = cuda_malloc(ctx, bytes);
    if (!d) return STATUS_NO_MEMORY;
    int rc = STATUS_OK;
    if (type == DTYPE_Q8_0 || type == DTYPE_Q6_K) {
        /* GGUF's blocks go through a bounded staging buffer (32 MiB of rows)
         * and are regrouped on the device (repack.cu). */
        const size_t src_rb = type == DTYPE_Q8_0 ? (size_t)(cols / 32) * sizeof(block_q8_0)
                                                 : (size_t)(cols / 256) * sizeof(block_q6_k);
        int64_t chunk = (int64_t)((32u << 20) / src_rb);
        if (chunk < 1) chunk = 1;
        if (chunk > rows) chunk = rows;
        void *stage = cuda_malloc(ctx, (size_t)chunk * src_rb);
        if (!stage) {
            cuda_free(ctx, d);
            return STATUS_NO_MEMORY;
        }
        for (int64_t r0 = 0; r0 < rows && rc == STATUS_OK; r0 += chunk) {
            int64_t m = rows - r0 < chunk ? rows - r0 : chunk;
            rc = cuda_upload(ctx, stage, (const uint8_t *)host + (size_t)r0 * src_rb, (size_t)m * src_rb);
            if (rc == STATUS_OK) rc = cuda_repack(ctx, (uint8_t *)d + (size_t)r0 * row_bytes, stage, type, m, cols);
            if (rc == STATUS_OK) rc = cuda_sync(ctx); /* the next chunk reuses the staging buffer */
        }
        cuda_free(ctx, stage);
        *stored = type;
    } else if (type != DTYPE_BF16) {
        rc = cuda_upload(ctx, d, host, bytes);
        if (rc == STATUS_OK) rc = cuda_sync(ctx);
        *stored = type;
    } else {
        /* BF16 goes through a bounded staging buffer and becomes F16 on the
         * device: no second full copy of the weight is ever held. */
        const int64_t chunk = 8 << 20; /* elements */
        int64_t n = rows * cols;
        void *stage = cuda_malloc(ctx, (size_t)(n < chunk ? n : chunk) * 2);
        if (!stage) {
            cuda_free(ctx, d);
            return STATUS_NO_MEMORY;
        }
        for (int64_t i = 0; i < n && rc == STATUS_OK; i += chunk) {
            int64_t m = n - i < chunk ? n - i : chunk;
            rc = cuda_upload(ctx, stage, (const uint16_t *)host + i, (size_t)m * 2);
            if (rc == STATUS_OK)
                rc = cuda_convert(ctx, (uint16_t *)d + i, DTYPE_F16, stage, DTYPE_BF16, m);
            /* The next chunk reuses the staging buffer. */
            if (rc == STATUS_OK) rc = cuda_sync(ctx);
        }
        cuda_free(ctx, stage);
        *stored = DTYPE_F16;
    }
    if (rc != STATUS_OK) {
        cuda_free(ctx, d);
        return rc;
    }
    *dst = d;
    return STATUS_OK;
}
