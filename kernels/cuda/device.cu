/* The CUDA backend's device plumbing: context (device, stream, cuBLAS
 * handle, scratch), memory, host transfers and weight upload.  Kernels live
 * one op per file beside this. */
#include "common.cuh"

#include <limits.h>
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

/* The LLM_CUDA_* settings, read once when a context is made (each exists
 * to compare a measured choice against its alternative): a variable unset
 * or empty keeps the default. */
static bool env_given(const char *name) {
    const char *e = getenv(name);
    return e && *e;
}
/* name's integer value clamped to [lo, hi], or dflt where not given. */
static int env_int(const char *name, int dflt, int lo, int hi) {
    if (!env_given(name)) return dflt;
    const int v = atoi(getenv(name));
    return v < lo ? lo : v > hi ? hi : v;
}
/* 1 if name is set to exactly value (the switches' "0" or "1"). */
static bool env_is(const char *name, const char *value) {
    const char *e = getenv(name);
    return e && strcmp(e, value) == 0;
}

extern "C" int cuda_ctx_init(struct cuda_ctx **out, int device, char *err, size_t errlen) {
    *out = NULL;
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
    int rc = STATUS_OK;
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
    /* Crossovers measured on an H100 (docs/cuda-backend.md, 4096x4096):
     * quantized weights, the tensor-core kernel beats dequantize + cuBLAS
     * at every batch up to 64 (Q4_K 23.1 against 41.5 us at 64); F16
     * weights, cuBLAS wins from 8 tokens (18.8 against 19.7 us) and the
     * warp-per-row kernel below 3.  The variable exists to re-measure them
     * on another card. */
    ctx->vec_max_quant = CUDA_MATMUL_VEC_MAX;
    ctx->vec_max_float = 2;
    if (env_given("LLM_CUDA_SKINNY_MAX"))
        ctx->vec_max_quant = ctx->vec_max_float = env_int("LLM_CUDA_SKINNY_MAX", 0, 0, CUDA_MATMUL_VEC_MAX);
    /* Batch-1..4 decode on quantized weights: matmul_gemv.cu where it
     * measured faster (per type and token count, in matmul.cu);
     * LLM_CUDA_GEMV_MAX=k forces it up to k tokens (0: never), to compare. */
    ctx->gemv_max = env_int("LLM_CUDA_GEMV_MAX", -1, 0, CUDA_MATMUL_GEMV_MAX);
    /* Prefill-sized F16 q/k/v (gate/up) of equal rows in one batched
     * cuBLAS call (7B prefill 15.3 -> 14.8 ms on an H100);
     * LLM_CUDA_GEMM_GROUP=0 gives one call a weight, to compare. */
    ctx->gemm_group = !env_is("LLM_CUDA_GEMM_GROUP", "0");
    /* Four warps per row in matmul_vec.cu's row kernel where one warp per
     * row would be a single wave (7B F16 batch 1 on an H100: 5.60 ms with
     * two, 5.50 with four); LLM_CUDA_MV_SPLIT=1 or 2 sets it, to compare.
     * (The same split in matmul_gemv.cu measured no gain: tenth pass.) */
    const int split = env_int("LLM_CUDA_MV_SPLIT", 4, 1, 4);
    ctx->mv_split = split >= 4 ? 4 : split >= 2 ? 2 : 1;
    ctx->cc = prop.major * 10 + prop.minor;
    /* LLM_CUDA_SM=k, below the card's own, routes every choice as compute
     * capability k.  With a build whose code for the card is compute_k PTX
     * (LLM_CUDA_ARCHITECTURES=75-virtual: the driver compiles it for the
     * card), a newer card then runs a T4's kernels and paths, so the tests
     * can check them on hardware at hand (docs/cuda-backend.md, "Tests"). */
    const int as_sm = env_int("LLM_CUDA_SM", 0, 0, 1000);
    if (as_sm > 0 && as_sm < ctx->cc) ctx->cc = as_sm;
    /* Programmatic dependent launch needs sm_90; LLM_CUDA_PDL=0 turns it
     * off, to compare. */
    ctx->pdl = ctx->cc >= 90 && !env_is("LLM_CUDA_PDL", "0");
    /* The pipelined tensor-core kernel for 17-64 tokens (cp.async: sm_80)
     * on matmuls of at least 2 items per SM (on an H100: TinyLlama's gate
     * and up together have 2.7, and at 2 rather than 4 its Q8_0 batch 64
     * step measured 3.58 -> 3.26 ms; the 7B's o, 1.9, stays on mq:
     * eleventh pass); LLM_CUDA_WIDE=0 leaves those to matmul_vec.cu's mq,
     * LLM_CUDA_WIDE_ITEMS=k gives it every matmul of k items per SM, to
     * compare and to test. */
    ctx->wide = ctx->cc >= 80 && !env_is("LLM_CUDA_WIDE", "0");
    /* Decode attention of groups of >= 8 query heads on the tensor-core
     * kernel of attention_prefill.cu (H100, 32 heads of 128 at context 512,
     * batch 8 / 64: groups of 8 33.1 / 134.9 us on the decode kernel, 20.4
     * / 61.3 on tensor cores; groups of 4 26.9 / 92.0 against 26.9 /
     * 111.8, so they stay); LLM_CUDA_DECODE_TC_G=k (0: never), to compare. */
    ctx->decode_tc_g = env_int("LLM_CUDA_DECODE_TC_G", 8, 0, INT_MAX);
    /* The tensor-core attention's mma: k = 16 from sm_80 (half the
     * instructions of sm_75's k = 8); LLM_CUDA_ATT_K8=1 keeps k = 8, to
     * compare and to test. */
    ctx->att_k16 = ctx->cc >= 80 && !env_is("LLM_CUDA_ATT_K8", "1");
    /* Context splits of the decode attention kernel of at least two steps
     * of its sub-warps; LLM_CUDA_ATT_STEPS=1 halves them, to compare. */
    ctx->att_steps = env_is("LLM_CUDA_ATT_STEPS", "1") ? 1 : 2;
    ctx->wide_items = env_int("LLM_CUDA_WIDE_ITEMS", 2, 0, 1024);
    /* Rope, the cache write and attention of decode batches of up to
     * rope_att rows in one launch (rope_attention.cu).  On an H100 it
     * measured faster up to 4 rows (TinyLlama, groups of 8: Q4_K_M batch 1
     * 1.00 -> 0.86 ms, 2 1.15 -> 1.04, 4 1.39 -> 1.33) and slower from 8
     * (1.80 -> 1.89: each query head reads its group's K/V rows, where the
     * tensor-core kernel reads them once).  Without groups (every query
     * head its own KV head: nothing to share) it wins to 16 rows (7B on an
     * H100: Q8_0 batch 8 5.38 -> 5.25 ms, 12 6.83 -> 6.66, 16 7.27 ->
     * 7.22; it loses at 24 and 32), so rope_att_mha is 16.
     * LLM_CUDA_ROPE_ATT=k sets both to k (0: rope_kv_write and attention),
     * to compare.  Its counters are zeroed here, once: a graph replays the
     * kernel, never a reset. */
    ctx->rope_att = env_int("LLM_CUDA_ROPE_ATT", 4, 0, 64);
    ctx->rope_att_mha = env_given("LLM_CUDA_ROPE_ATT") ? ctx->rope_att : 16;
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
    /* Up to att_defer rows the attention's slices are merged by a kernel
     * of its own, which leaves the output in the gemv's int8 form as well
     * (7B on an H100: Q8_0 batch 1 -1.0%, 3 -1.1%, 4 -0.5%);
     * LLM_CUDA_ATT_DEFER=k sets k (0: merged in the attention kernel). */
    ctx->att_defer = env_int("LLM_CUDA_ATT_DEFER", 4, 0, 4);
    /* From 3 rows the attention kernels also leave their output's F16
     * form for the matmul after it (no conversion launch before o);
     * LLM_CUDA_ATT_F16=0 leaves it to the matmul, to compare. */
    ctx->att_f16 = !env_is("LLM_CUDA_ATT_F16", "0");
    /* K-quant weights at 3-16 tokens and Q8_0 at 4-8 on matmul_mr.cu (no
     * shared-memory staging: 7B Q4_K_M batch 8 5.19 -> 4.46 ms, batch 4
     * 4.58 -> 3.56, on an H100); LLM_CUDA_MR=0 leaves them to mq and the
     * dp4a kernel, to compare. */
    ctx->mr = !env_is("LLM_CUDA_MR", "0");
    /* Prefill tiles of quantized weights made on a side stream while the
     * matmul before runs (dequant_ahead.cu; 7B Q8_0 prefill on an H100
     * 22.1 -> 20.6 ms), the GEMMs leaving ahead_sms multiprocessors to
     * them; LLM_CUDA_DEQUANT_AHEAD=0 (serial) and LLM_CUDA_AHEAD_SMS=k
     * (0: all to the GEMM), to compare. */
    ctx->dequant_ahead = !env_is("LLM_CUDA_DEQUANT_AHEAD", "0");
    ctx->ahead_sms = env_int("LLM_CUDA_AHEAD_SMS", ctx->n_sms / 8, 0, ctx->n_sms - 1);
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
