/* Prefill matmul on quantized weights with the dequantization fused into
 * the GEMM, on Hopper's warpgroup tensor cores (wgmma, sm_90a code):
 * out[n, rows] = x[n, cols] . w^T for one weight or a group of weights on
 * one input (q, k, v; gate, up), above the decode kernels' batches.
 *
 * The path it replaces (matmul.cu: dequantize the weight into an F16 tile
 * in scratch, then cuBLAS) writes two bytes a weight to DRAM and reads
 * them back: 6.8 ms of a 7B Q8_0 prefill of 21.8.  Two fused kernels
 * before this one lost to it (docs/cuda-backend.md, tenth pass): their
 * warps decoded the weights in between their own multiplies, and 16-byte
 * copies of the activations swamped L2 with requests.  Here the work is
 * split by warpgroup, as cuBLAS's own Hopper kernels do:
 *
 * - warpgroup 0 produces.  Each of its threads copies one weight row's
 *   chunk (256 columns, in its stored form) into shared memory with bulk
 *   copies (cp.async.bulk, completion counted on an mbarrier), MP_RAW
 *   chunks ahead; the threads then decode each 64-column slice to F16
 *   (mq_frag.cuh's mq_decode) into a stage in wgmma's layout, and one of
 *   them brings the slice's activations in with a single 16 KB bulk copy:
 *   they were laid out in that layout once per input (mp_tile_x_kernel).
 * - warpgroups 1 and 2 consume: 64 rows each, m64n128k16 wgmma with both
 *   operands in shared memory, F32 sums in registers, stored at the end.
 *   A stage is handed back (an mbarrier) once the wgmma reading it are done.
 *
 * Both operands lie as wgmma's unswizzled K-major "core matrices": 8 rows
 * (weight rows or tokens) x 8 columns, 16 bytes a row, 128 bytes in all;
 * in a stage, row group r and column group q at r * 1024 + q * 128.  A
 * k16 step is two core matrices along K (leading offset 128), the next
 * 8 rows 1024 bytes on (stride offset).
 *
 * Block: 128 rows x 128 tokens; the blocks of one row block are
 * consecutive, so the weight is read from DRAM about once and the token
 * blocks after the first find it in L2.  Widths must be whole 256-column
 * chunks (every Llama shape is); other shapes keep the tile path. */
#include "matmul_group.cuh"
#include "mq_frag.cuh"

#define MP_ROWS 128                  /* weight rows a block: two consumer warpgroups of 64 */
#define MP_NT 128                    /* tokens a block */
#define MP_K 64                      /* columns a stage: 4 wgmma k16 steps */
#define MP_TILE (MP_ROWS * MP_K * 2) /* bytes of one operand's stage (16 KB; as many tokens as rows) */
#define MP_THREADS 384
#define MP_RAW 3                     /* weight chunks in flight */
#define MP_SMEM_MAX (227 * 1024)

/* wgmma exists in sm_90a code only; elsewhere the kernel is a trap and
 * the host never launches it (cuda_matmul_prefill_built). */
#if defined(__CUDA_ARCH__) && defined(__CUDA_ARCH_FEAT_SM90_ALL)
#define MP_WG 1
#else
#define MP_WG 0
#endif
__device__ const int mp_built_flag = MP_WG;

/* cb: bytes of one row's 256-column chunk as copied (Q8_0: 256 codes and
 * the 16-byte word of their 8 scales; Q6_K: ql, qh, scales and the
 * 16-byte word holding d, as mq_decode reads them); ws: the row stride in
 * shared memory, an odd number of 16-byte units so that the 8 rows a warp
 * decodes at once start in different banks. */
template <int T> struct mp_geom {
    static constexpr int cb = T == DTYPE_Q6_K ? 224 : mq_geom<T>::cb;
    static constexpr int ws = (cb / 16 | 1) * 16;
    static constexpr int raw = MP_ROWS * ws;
    static constexpr int fit = (MP_SMEM_MAX - 1024 - MP_RAW * raw) / (2 * MP_TILE);
    static constexpr int stages = fit > 4 ? 4 : fit;
    static constexpr int smem = MP_RAW * raw + stages * 2 * MP_TILE;
    static_assert(cb % 16 == 0 && stages >= 2, "bulk copies of whole 16-byte units, two stages at least");
};

/* ---- mbarriers, bulk copies and wgmma (PTX, sm_90a) ---- */
__device__ __forceinline__ uint32_t mp_sa(const void *p) { return (uint32_t)__cvta_generic_to_shared(p); }
__device__ __forceinline__ void mp_bar_init(uint64_t *bar, uint32_t count) {
#if MP_WG
    asm volatile("mbarrier.init.shared::cta.b64 [%0], %1;" ::"r"(mp_sa(bar)), "r"(count) : "memory");
#endif
}
__device__ __forceinline__ void mp_arrive(uint64_t *bar) {
#if MP_WG
    asm volatile("mbarrier.arrive.shared::cta.b64 _, [%0];" ::"r"(mp_sa(bar)) : "memory");
#endif
}
/* An arrival that also announces `bytes` of bulk copies to come. */
__device__ __forceinline__ void mp_arrive_tx(uint64_t *bar, uint32_t bytes) {
#if MP_WG
    asm volatile("mbarrier.arrive.expect_tx.shared::cta.b64 _, [%0], %1;" ::"r"(mp_sa(bar)), "r"(bytes) : "memory");
#endif
}
/* Announces bytes without arriving. */
__device__ __forceinline__ void mp_expect_tx(uint64_t *bar, uint32_t bytes) {
#if MP_WG
    asm volatile("mbarrier.expect_tx.relaxed.cta.shared::cta.b64 [%0], %1;" ::"r"(mp_sa(bar)), "r"(bytes) : "memory");
#endif
}
__device__ __forceinline__ void mp_wait(uint64_t *bar, uint32_t parity) {
#if MP_WG
    uint32_t done = 0;
    while (!done)
        asm volatile("{\n .reg .pred p;\n mbarrier.try_wait.parity.shared::cta.b64 p, [%1], %2;\n"
                     " selp.u32 %0, 1, 0, p;\n}\n"
                     : "=r"(done)
                     : "r"(mp_sa(bar)), "r"(parity)
                     : "memory");
#endif
}
__device__ __forceinline__ void mp_copy(void *dst, const void *src, uint32_t bytes, uint64_t *bar) {
#if MP_WG
    asm volatile("cp.async.bulk.shared::cluster.global.mbarrier::complete_tx::bytes [%0], [%1], %2, [%3];" ::"r"(
                     mp_sa(dst)),
                 "l"(src), "r"(bytes), "r"(mp_sa(bar))
                 : "memory");
#endif
}
/* The 128 threads of the producing warpgroup, and no one else. */
__device__ __forceinline__ void mp_producers_sync() { asm volatile("bar.sync 1, 128;" ::: "memory"); }

/* Descriptor of a K-major unswizzled operand at shared address addr. */
__device__ __forceinline__ uint64_t mp_desc(uint32_t addr) {
    return (uint64_t)((addr & 0x3FFFF) >> 4) | (uint64_t)(128 >> 4) << 16 | (uint64_t)(1024 >> 4) << 32;
}

/* d (the m64n128 accumulator: n tile j's four values at 4j) += A . B, both
 * from shared memory. */
__device__ __forceinline__ void mp_wgmma(float (&d)[64], uint64_t da, uint64_t db) {
#if MP_WG
    asm volatile(
        "{\n.reg .pred p;\nsetp.ne.b32 p, 1, 0;\n"
        "wgmma.mma_async.sync.aligned.m64n128k16.f32.f16.f16 "
        "{%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15, "
        "%16, %17, %18, %19, %20, %21, %22, %23, %24, %25, %26, %27, %28, %29, %30, %31, "
        "%32, %33, %34, %35, %36, %37, %38, %39, %40, %41, %42, %43, %44, %45, %46, %47, "
        "%48, %49, %50, %51, %52, %53, %54, %55, %56, %57, %58, %59, %60, %61, %62, %63}, "
        "%64, %65, p, 1, 1, 0, 0;\n}\n"
        : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3]), "+f"(d[4]), "+f"(d[5]), "+f"(d[6]), "+f"(d[7]),
          "+f"(d[8]), "+f"(d[9]), "+f"(d[10]), "+f"(d[11]), "+f"(d[12]), "+f"(d[13]), "+f"(d[14]), "+f"(d[15]),
          "+f"(d[16]), "+f"(d[17]), "+f"(d[18]), "+f"(d[19]), "+f"(d[20]), "+f"(d[21]), "+f"(d[22]), "+f"(d[23]),
          "+f"(d[24]), "+f"(d[25]), "+f"(d[26]), "+f"(d[27]), "+f"(d[28]), "+f"(d[29]), "+f"(d[30]), "+f"(d[31]),
          "+f"(d[32]), "+f"(d[33]), "+f"(d[34]), "+f"(d[35]), "+f"(d[36]), "+f"(d[37]), "+f"(d[38]), "+f"(d[39]),
          "+f"(d[40]), "+f"(d[41]), "+f"(d[42]), "+f"(d[43]), "+f"(d[44]), "+f"(d[45]), "+f"(d[46]), "+f"(d[47]),
          "+f"(d[48]), "+f"(d[49]), "+f"(d[50]), "+f"(d[51]), "+f"(d[52]), "+f"(d[53]), "+f"(d[54]), "+f"(d[55]),
          "+f"(d[56]), "+f"(d[57]), "+f"(d[58]), "+f"(d[59]), "+f"(d[60]), "+f"(d[61]), "+f"(d[62]), "+f"(d[63])
        : "l"(da), "l"(db));
#endif
}

/* Row rp's chunk ch into dst, completion counted on bar. */
template <int T>
__device__ __forceinline__ void mp_fetch_row(uint8_t *dst, const uint8_t *rp, int cols, int ch, uint64_t *bar) {
    if constexpr (T == DTYPE_Q8_0) {
        mp_copy(dst, rp + 256 * (size_t)ch, 256, bar);
        mp_copy(dst + 256, rp + q8s_d_off(cols) + 16 * (size_t)ch, 16, bar);
    } else if constexpr (T == DTYPE_Q6_K) {
        mp_copy(dst, rp + 128 * (size_t)ch, 128, bar);
        mp_copy(dst + 128, rp + q6s_qh_off(cols) + 64 * (size_t)ch, 64, bar);
        mp_copy(dst + 192, rp + q6s_sc_off(cols) + 16 * (size_t)ch, 16, bar);
        mp_copy(dst + 208, rp + ((q6s_d_off(cols) + 2 * (size_t)ch) & ~(size_t)15), 16, bar);
    } else {
        mp_copy(dst, rp + (size_t)mp_geom<T>::cb * ch, mp_geom<T>::cb, bar);
    }
}

/* Warpgroup 0: rows row0 .. row0 + 127 of segment sg, every chunk. */
template <int T>
__device__ __forceinline__ void mp_produce(uint8_t *smem, uint64_t *rawb, uint64_t *full, uint64_t *empty,
                                           const mg_seg &sg, int row0, size_t row_bytes, int cols,
                                           const uint8_t *xb) {
    using P = mp_geom<T>;
    constexpr int S = P::stages, SUB = 256 / MP_K;
    const int tid = threadIdx.x, warp = tid / 32, lane = tid % 32, g = lane >> 2, t = lane & 3;
    const int nc = cols / 256, live = min(MP_ROWS, sg.rows - row0);
    const uint8_t *rp = sg.w + (size_t)(row0 + tid) * row_bytes;
    uint8_t *raw0 = smem, *a0 = smem + MP_RAW * P::raw, *b0 = a0 + S * MP_TILE;

    /* Chunks 0 .. MP_RAW - 2 queued; chunk ch + MP_RAW - 1 once every
     * thread has decoded chunk ch - 1, whose stage it takes. */
    if (tid == 0)
        for (int c = 0; c < MP_RAW - 1 && c < nc; c++) mp_arrive_tx(&rawb[c], (uint32_t)(live * P::cb));
    mp_producers_sync();
    if (tid < live)
        for (int c = 0; c < MP_RAW - 1 && c < nc; c++) mp_fetch_row<T>(raw0 + c * P::raw + tid * P::ws, rp, cols, c, &rawb[c]);
    for (int ch = 0; ch < nc; ch++) {
        const int nx = ch + MP_RAW - 1;
        if (tid == 0 && nx < nc) mp_arrive_tx(&rawb[nx % MP_RAW], (uint32_t)(live * P::cb));
        mp_producers_sync();
        if (tid < live && nx < nc)
            mp_fetch_row<T>(raw0 + nx % MP_RAW * P::raw + tid * P::ws, rp, cols, nx, &rawb[nx % MP_RAW]);
        mp_wait(&rawb[ch % MP_RAW], (uint32_t)(ch / MP_RAW) & 1);
        const uint8_t *raw = raw0 + ch % MP_RAW * P::raw;
#pragma unroll 1
        for (int p = 0; p < SUB; p++) {
            const int kk = ch * SUB + p, s = kk % S;
            mp_wait(&empty[s], ((uint32_t)(kk / S) & 1) ^ 1);
            if (tid == 0) {
                mp_expect_tx(&full[s], MP_TILE);
                mp_copy(b0 + s * MP_TILE, xb + (size_t)kk * MP_TILE, MP_TILE, &full[s]);
            }
            uint8_t *a = a0 + s * MP_TILE;
            /* Unit i: row group 4 warp + i / 2, 32-column block i % 2 of
             * the slice; the warp's 32 lanes write 4 whole core matrices. */
#pragma unroll
            for (int i = 0; i < 8; i++) {
                const int rg = warp * 4 + (i >> 1), b = i & 1;
                uint32_t v[4];
                mq_decode<T>(raw + (rg * 8 + g) * P::ws, 2 * p + b, t, ch, v);
                *(uint4 *)(a + rg * 1024 + (4 * b + t) * 128 + g * 16) = make_uint4(v[0], v[1], v[2], v[3]);
            }
            asm volatile("fence.proxy.async.shared::cta;" ::: "memory"); /* visible to wgmma */
            mp_arrive(&full[s]);
        }
    }
}

/* Warpgroups 1 and 2: rows 64 (warpgroup - 1) .. + 63 of the block. */
template <int T>
__device__ __forceinline__ void mp_consume(uint8_t *smem, uint64_t *full, uint64_t *empty, const mg_seg &sg,
                                           int row0, int cols, int tok0, int n) {
    using P = mp_geom<T>;
    constexpr int S = P::stages;
    const int warp = threadIdx.x / 32, lane = threadIdx.x % 32, g = lane >> 2, t = lane & 3;
    const int cw = warp / 4 - 1, nk = cols / MP_K;
    const uint32_t a0 = mp_sa(smem + MP_RAW * P::raw) + cw * 8 * 1024, b0 = mp_sa(smem + MP_RAW * P::raw) + S * MP_TILE;
    float acc[64];
#pragma unroll
    for (int i = 0; i < 64; i++) acc[i] = 0.0f;
    for (int kk = 0; kk < nk; kk++) {
        const int s = kk % S;
        mp_wait(&full[s], (uint32_t)(kk / S) & 1);
        asm volatile("wgmma.fence.sync.aligned;" ::: "memory");
#pragma unroll
        for (int j = 0; j < 4; j++)
            mp_wgmma(acc, mp_desc(a0 + s * MP_TILE + j * 256), mp_desc(b0 + s * MP_TILE + j * 256));
        asm volatile("wgmma.commit_group.sync.aligned;" ::: "memory");
        /* Slice kk - 1's multiplies are done: its stage goes back. */
        asm volatile("wgmma.wait_group.sync.aligned 1;" ::: "memory");
        if (kk > 0 && lane == 0) mp_arrive(&empty[(kk - 1) % S]);
    }
    asm volatile("wgmma.wait_group.sync.aligned 0;" ::: "memory");
    /* acc[4j + e]: row g (+ 8 for e >= 2) of the warp's 16, token 8j + 2t
     * + (e & 1). */
#pragma unroll
    for (int j = 0; j < 16; j++)
#pragma unroll
        for (int e = 0; e < 4; e++) {
            const int row = row0 + cw * 64 + (warp % 4) * 16 + g + 8 * (e >> 1), tok = tok0 + 8 * j + 2 * t + (e & 1);
            if (row < sg.rows && tok < n) sg.out[(size_t)tok * sg.rows + row] = acc[4 * j + e];
        }
}

/* xt: the activations laid out by mp_tile_x_kernel; n_tb token blocks. */
template <int T>
__global__ void __launch_bounds__(MP_THREADS, 1)
matmul_prefill_kernel(const mm_group g, size_t row_bytes, int cols, const uint8_t *__restrict__ xt, int n, int n_tb) {
#if !MP_WG
    __trap(); /* never launched: cuda_matmul_prefill_built */
#else
    using P = mp_geom<T>;
    __shared__ __align__(8) uint64_t bars[MP_RAW + 2 * P::stages];
    extern __shared__ __align__(128) uint8_t mp_smem[];
    uint64_t *rawb = bars, *full = bars + MP_RAW, *empty = full + P::stages;
    if (threadIdx.x == 0) {
        for (int i = 0; i < MP_RAW; i++) mp_bar_init(&rawb[i], 1);
        for (int i = 0; i < P::stages; i++) {
            mp_bar_init(&full[i], 128); /* every producer thread, after its stores */
            mp_bar_init(&empty[i], 8);  /* one lane of each consumer warp */
        }
        asm volatile("fence.mbarrier_init.release.cluster;" ::: "memory");
    }
    __syncthreads();
    pdl_begin();
    const int rb = (int)blockIdx.x / n_tb, tb = (int)blockIdx.x % n_tb;
    const mg_seg sg = mg_segment(g, rb);
    const int row0 = (rb - sg.rb0) * MP_ROWS;
    if (threadIdx.x < 128)
        mp_produce<T>(mp_smem, rawb, full, empty, sg, row0, row_bytes, cols,
                      xt + (size_t)tb * (cols / MP_K) * MP_TILE);
    else
        mp_consume<T>(mp_smem, full, empty, sg, row0, cols, tb * MP_NT, n);
#endif
}

/* x [n, cols] (F32) -> F16 in the kernel's layout: token block tb, slice
 * kk (64 columns) at (tb * (cols / 64) + kk) * 16 KB, core matrices as
 * above; zeros past n.  One thread per 8 columns of a token (16 bytes). */
__global__ void mp_tile_x_kernel(const float *__restrict__ x, uint4 *__restrict__ xt, int n, int cols,
                                 int64_t units) {
    pdl_begin();
    const int nk = cols / MP_K;
    for (int64_t i = blockIdx.x * (int64_t)blockDim.x + threadIdx.x; i < units; i += (int64_t)gridDim.x * blockDim.x) {
        const int u = (int)(i & 1023), kk = (int)((i >> 10) % nk), tb = (int)((i >> 10) / nk);
        const int tok = tb * MP_NT + (u >> 6) * 8 + (u & 7), col = kk * MP_K + ((u >> 3) & 7) * 8;
        uint4 v = make_uint4(0, 0, 0, 0);
        if (tok < n) {
            const float4 *p = (const float4 *)(x + (size_t)tok * cols + col);
            const float4 lo = p[0], hi = p[1];
            v = make_uint4(mq_u32(__floats2half2_rn(lo.x, lo.y)), mq_u32(__floats2half2_rn(lo.z, lo.w)),
                           mq_u32(__floats2half2_rn(hi.x, hi.y)), mq_u32(__floats2half2_rn(hi.z, hi.w)));
        }
        xt[i] = v;
    }
}

template <int T>
static int mp_launch(struct cuda_ctx *ctx, mm_group &g, int64_t cols, const float *x, int n) {
    using P = mp_geom<T>;
    static int ready[64];
    const int dev = ctx->device >= 0 && ctx->device < 64 ? ctx->device : 0;
    if (!ready[dev]) {
        int smem_max = 0;
        CUDA_CHECK(ctx, cudaDeviceGetAttribute(&smem_max, cudaDevAttrMaxSharedMemoryPerBlockOptin, ctx->device));
        ready[dev] = P::smem + 1024 <= smem_max ? 1 : -1;
        if (ready[dev] > 0)
            CUDA_CHECK(ctx, cudaFuncSetAttribute(matmul_prefill_kernel<T>, cudaFuncAttributeMaxDynamicSharedMemorySize,
                                                 P::smem));
    }
    const size_t row_bytes = cuda_row_bytes((enum dtype)T, cols);
    if (ready[dev] < 0 || row_bytes % 16 != 0) return CUDA_NOT_FUSED;
    int rbs = 0;
    for (int s = 0; s < g.n; s++) {
        g.blk0[s] = rbs;
        rbs += (g.rows[s] + MP_ROWS - 1) / MP_ROWS;
    }
    g.blk0[g.n] = rbs;
    const int n_tb = (n + MP_NT - 1) / MP_NT;
    const int64_t blocks = (int64_t)rbs * n_tb;
    if (blocks > INT32_MAX) return CUDA_NOT_FUSED;
    /* Scratch: x in the kernel's layout, kept for the next matmul on x. */
    const size_t xt_bytes = (size_t)n_tb * MP_NT * cols * 2;
    uint8_t *xt = (uint8_t *)cuda_scratch(ctx, xt_bytes);
    if (!xt) return STATUS_NO_MEMORY;
    if (!cuda_act_reuse(ctx, MATMUL_ACT_TILED, x, n, cols, xt)) {
        const int64_t units = (int64_t)xt_bytes / 16;
        cudaError_t e = cuda_launch(ctx, mp_tile_x_kernel, dim3(cuda_blocks(units, 256)), dim3(256), 0, x,
                                    (uint4 *)xt, n, (int)cols, units);
        if (e != cudaSuccess) {
            cuda_act_forget(ctx);
            return cuda_fail(ctx, STATUS_INTERNAL, "cuda:%d: matmul prefill: %s", ctx->device, cudaGetErrorString(e));
        }
    }
    CUDA_CHECK(ctx, cuda_launch(ctx, matmul_prefill_kernel<T>, dim3((unsigned)blocks), dim3(MP_THREADS), P::smem, g,
                                row_bytes, (int)cols, (const uint8_t *)xt, n, n_tb));
    CUDA_CHECK(ctx, cudaGetLastError());
    return STATUS_OK;
}

extern "C" int cuda_matmul_prefill_built(struct cuda_ctx *ctx) {
    int v = 0;
    return ctx->cc == 90 && cudaMemcpyFromSymbol(&v, mp_built_flag, sizeof v) == cudaSuccess && v;
}

extern "C" int cuda_matmul_prefill(struct cuda_ctx *ctx, struct mm_group *g, enum dtype type, int64_t cols,
                                   const float *x, int32_t n) {
    if (!ctx->prefill_wg || n <= 0 || g->swiglu || cols % 256 != 0 || cols > INT32_MAX || (uintptr_t)x % 16 != 0)
        return CUDA_NOT_FUSED;
    for (int s = 0; s < g->n; s++)
        if ((uintptr_t)g->w[s] % 16 != 0) return CUDA_NOT_FUSED;
    switch (type) {
    case DTYPE_Q8_0: return mp_launch<DTYPE_Q8_0>(ctx, *g, cols, x, n);
    case DTYPE_Q4_0: return mp_launch<DTYPE_Q4_0>(ctx, *g, cols, x, n);
    case DTYPE_Q4_1: return mp_launch<DTYPE_Q4_1>(ctx, *g, cols, x, n);
    case DTYPE_Q5_0: return mp_launch<DTYPE_Q5_0>(ctx, *g, cols, x, n);
    case DTYPE_Q5_1: return mp_launch<DTYPE_Q5_1>(ctx, *g, cols, x, n);
    case DTYPE_Q4_K: return mp_launch<DTYPE_Q4_K>(ctx, *g, cols, x, n);
    case DTYPE_Q5_K: return mp_launch<DTYPE_Q5_K>(ctx, *g, cols, x, n);
    case DTYPE_Q6_K: return mp_launch<DTYPE_Q6_K>(ctx, *g, cols, x, n);
    default: return CUDA_NOT_FUSED;
    }
}
