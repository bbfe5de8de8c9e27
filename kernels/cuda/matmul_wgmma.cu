/* Quantized matmul on Hopper's warpgroup tensor cores (wgmma, sm_90a
 * code) with the dequantization in shared memory: out[n, rows] = x[n,
 * cols] . w^T for one weight or a group of weights on one input (q, k, v;
 * gate, up).  It takes decode batches of 17-64 tokens (ctx->wgmma_min ..
 * wgmma_max) from matmul_wide.cu, whose warps decode weights and issue
 * mma.sync themselves and run out of instructions before DRAM runs out of
 * bytes (docs/cuda-backend.md, tenth pass).
 *
 * Work is split by warpgroup, as cuBLAS's own Hopper kernels do:
 *
 * - warpgroups 0 and 1 produce.  Their threads copy the block's weight
 *   rows, chunk (256 columns) by chunk in their stored form, into shared
 *   memory (cp.async, consecutive threads on consecutive bytes), MP_RAW
 *   chunks ahead; then decode each 64-column slice to F16 (mq_frag.cuh's
 *   mq_decode) into a stage in wgmma's layout, and one of them brings the
 *   slice's activations in with a single bulk copy (cp.async.bulk,
 *   completion counted on the stage's mbarrier): they were laid out that
 *   way once per input (mp_tile_x_kernel).  One bulk copy per row and
 *   chunk measured twice as slow as these 16-byte copies: the copy engine
 *   takes small copies one at a time.
 * - warpgroups 2 and 3 consume: 64 rows each, m64nNTk16 wgmma with both
 *   operands in shared memory, F32 sums in registers, stored at the end.
 *   A stage is handed back (an mbarrier) once the wgmma reading it are done.
 *
 * Both operands lie as wgmma's unswizzled K-major "core matrices": 8 rows
 * (weight rows or tokens) x 8 columns, 16 bytes a row, 128 bytes in all;
 * in a stage, row group r and column group q at r * 1024 + q * 128.  A
 * k16 step is two core matrices along K (leading offset 128), the next
 * 8 rows 1024 bytes on (stride offset).
 *
 * Block: 128 rows x NT tokens (64, or 128 above 64 tokens) over a range
 * of chunks: a matmul of fewer row blocks than multiprocessors is split
 * along K (mp_splits) and the partial sums added in order by
 * mp_reduce_kernel, so the result does not depend on timing.  Widths must
 * be whole 256-column chunks (every Llama shape is); other shapes keep the
 * other kernels.
 *
 * At prefill sizes (512 tokens) this kernel is slower than dequantized
 * tiles and cuBLAS: 62.6 against 47.0 us for a 4096 x 4096 Q8_0 weight on
 * an H100, bound by L2 traffic (activations read again by every row
 * block) that cuBLAS's larger, multicast tiles avoid; so by default it
 * stops at 64 tokens. */
#include "matmul_group.cuh"
#include "mq_frag.cuh"

#define MP_ROWS 128                  /* weight rows a block: two consumer warpgroups of 64 */
#define MP_K 64                      /* columns a stage: 4 wgmma k16 steps */
#define MP_ATILE (MP_ROWS * MP_K * 2) /* bytes of the weights' stage (16 KB) */
#define MP_PRODUCERS 256             /* two warpgroups decode */
#define MP_THREADS (MP_PRODUCERS + 256)
#define MP_RAW 3                     /* weight chunks in flight */
#define MP_SMEM_MAX (227 * 1024)
#define MP_SPLITS_MAX 16

/* wgmma exists in sm_90a code only; elsewhere the kernel is a trap and
 * the host never launches it (cuda_matmul_wgmma_built). */
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
 * decodes at once start in different banks.  A stage: the weights' F16
 * tile, then the activations' (NT tokens). */
template <int T, int NT> struct mp_geom {
    static constexpr int cb = T == DTYPE_Q6_K ? 224 : mq_geom<T>::cb;
    static constexpr int ws = (cb / 16 | 1) * 16;
    static constexpr int raw = MP_ROWS * ws;
    static constexpr int btile = NT * MP_K * 2;
    static constexpr int stage = MP_ATILE + btile;
    static constexpr int fit = (MP_SMEM_MAX - 1024 - MP_RAW * raw) / stage;
    static constexpr int stages = fit > 4 ? 4 : fit;
    static constexpr int smem = MP_RAW * raw + stages * stage;
    static_assert(cb % 16 == 0 && stages >= 2, "copies of whole 16-byte units, two stages at least");
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
/* The producing warpgroups' threads, and no one else. */
__device__ __forceinline__ void mp_producers_sync() { asm volatile("bar.sync 1, %0;" ::"n"(MP_PRODUCERS) : "memory"); }

/* Descriptor of a K-major unswizzled operand at shared address addr. */
__device__ __forceinline__ uint64_t mp_desc(uint32_t addr) {
    return (uint64_t)((addr & 0x3FFFF) >> 4) | (uint64_t)(128 >> 4) << 16 | (uint64_t)(1024 >> 4) << 32;
}

/* d (the m64nNT accumulator: n tile j's four values at 4j) += A . B, both
 * from shared memory. */
__device__ __forceinline__ void mp_wgmma(float (&d)[32], uint64_t da, uint64_t db) {
#if MP_WG
    asm volatile(
        "{\n.reg .pred p;\nsetp.ne.b32 p, 1, 0;\n"
        "wgmma.mma_async.sync.aligned.m64n64k16.f32.f16.f16 "
        "{%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15, %16, %17, %18, %19, %20, %21, %22, %23, %24, %25, %26, %27, %28, %29, %30, %31}, %32, %33, p, 1, 1, 0, 0;\n}\n"
        : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3]), "+f"(d[4]), "+f"(d[5]), "+f"(d[6]), "+f"(d[7]), "+f"(d[8]), "+f"(d[9]), "+f"(d[10]), "+f"(d[11]), "+f"(d[12]), "+f"(d[13]), "+f"(d[14]), "+f"(d[15]), "+f"(d[16]), "+f"(d[17]), "+f"(d[18]), "+f"(d[19]), "+f"(d[20]), "+f"(d[21]), "+f"(d[22]), "+f"(d[23]), "+f"(d[24]), "+f"(d[25]), "+f"(d[26]), "+f"(d[27]), "+f"(d[28]), "+f"(d[29]), "+f"(d[30]), "+f"(d[31])
        : "l"(da), "l"(db));
#endif
}
__device__ __forceinline__ void mp_wgmma(float (&d)[64], uint64_t da, uint64_t db) {
#if MP_WG
    asm volatile(
        "{\n.reg .pred p;\nsetp.ne.b32 p, 1, 0;\n"
        "wgmma.mma_async.sync.aligned.m64n128k16.f32.f16.f16 "
        "{%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15, %16, %17, %18, %19, %20, %21, %22, %23, %24, %25, %26, %27, %28, %29, %30, %31, %32, %33, %34, %35, %36, %37, %38, %39, %40, %41, %42, %43, %44, %45, %46, %47, %48, %49, %50, %51, %52, %53, %54, %55, %56, %57, %58, %59, %60, %61, %62, %63}, %64, %65, p, 1, 1, 0, 0;\n}\n"
        : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3]), "+f"(d[4]), "+f"(d[5]), "+f"(d[6]), "+f"(d[7]), "+f"(d[8]), "+f"(d[9]), "+f"(d[10]), "+f"(d[11]), "+f"(d[12]), "+f"(d[13]), "+f"(d[14]), "+f"(d[15]), "+f"(d[16]), "+f"(d[17]), "+f"(d[18]), "+f"(d[19]), "+f"(d[20]), "+f"(d[21]), "+f"(d[22]), "+f"(d[23]), "+f"(d[24]), "+f"(d[25]), "+f"(d[26]), "+f"(d[27]), "+f"(d[28]), "+f"(d[29]), "+f"(d[30]), "+f"(d[31]), "+f"(d[32]), "+f"(d[33]), "+f"(d[34]), "+f"(d[35]), "+f"(d[36]), "+f"(d[37]), "+f"(d[38]), "+f"(d[39]), "+f"(d[40]), "+f"(d[41]), "+f"(d[42]), "+f"(d[43]), "+f"(d[44]), "+f"(d[45]), "+f"(d[46]), "+f"(d[47]), "+f"(d[48]), "+f"(d[49]), "+f"(d[50]), "+f"(d[51]), "+f"(d[52]), "+f"(d[53]), "+f"(d[54]), "+f"(d[55]), "+f"(d[56]), "+f"(d[57]), "+f"(d[58]), "+f"(d[59]), "+f"(d[60]), "+f"(d[61]), "+f"(d[62]), "+f"(d[63])
        : "l"(da), "l"(db));
#endif
}

/* Queue chunk ch of the block's rows (row0 .. + 127 of segment sg) into
 * the raw stage st, zeros for rows past the weight's end: 16-byte copies,
 * consecutive threads on consecutive bytes of a row, so that a warp's
 * requests are whole lines. */
template <int T, int NT>
__device__ __forceinline__ void mp_fetch(uint8_t *st, const mg_seg &sg, int row0, size_t row_bytes, int cols,
                                         int ch) {
    using P = mp_geom<T, NT>;
    constexpr int U = P::cb / 16, ITERS = (MP_ROWS * U + MP_PRODUCERS - 1) / MP_PRODUCERS;
#pragma unroll
    for (int it = 0; it < ITERS; it++) {
        const int i = it * MP_PRODUCERS + (int)threadIdx.x, r = i / U, c = i % U;
        if (MP_ROWS * U % MP_PRODUCERS != 0 && r >= MP_ROWS) break;
        const bool live = row0 + r < sg.rows;
        const uint8_t *rp = sg.w + (size_t)(live ? row0 + r : 0) * row_bytes, *src;
        if constexpr (mq_fmt<T>::soa != 0) src = mq_soa_src<T>(rp, cols, ch, c, 8);
        else src = rp + (size_t)P::cb * ch + 16 * c;
        mq_cp16(st + r * P::ws + 16 * c, src, live ? 16 : 0);
    }
    mq_commit();
}

/* Warpgroups 0 and 1: rows row0 .. row0 + 127 of segment sg, chunks c0 ..
 * c1 - 1; xb: the token block's activations (slice kk at kk x btile). */
template <int T, int NT>
__device__ __forceinline__ void mp_produce(uint8_t *smem, uint64_t *full, uint64_t *empty, const mg_seg &sg,
                                           int row0, size_t row_bytes, int cols, int c0, int c1,
                                           const uint8_t *xb) {
    using P = mp_geom<T, NT>;
    constexpr int S = P::stages, SUB = 256 / MP_K, UNITS = MP_ROWS / 8 * 2 / (MP_PRODUCERS / 32);
    const int tid = threadIdx.x, warp = tid / 32, lane = tid % 32, g = lane >> 2, t = lane & 3;
    uint8_t *raw0 = smem, *st0 = smem + MP_RAW * P::raw;

    /* Chunks c0 .. c0 + MP_RAW - 2 queued; the next one once every thread
     * has decoded the one before this, whose stage it takes (a copy group
     * is committed every round, empty or not, so that the count of groups
     * in flight says which chunk has landed). */
    for (int c = 0; c < MP_RAW - 1; c++) {
        if (c0 + c < c1) mp_fetch<T, NT>(raw0 + c * P::raw, sg, row0, row_bytes, cols, c0 + c);
        else mq_commit();
    }
    for (int i = 0; c0 + i < c1; i++) {
        mq_wait(MP_RAW - 2); /* this thread's copies of chunk c0 + i */
        mp_producers_sync(); /* everyone's; and the chunk before is decoded */
        const int nx = i + MP_RAW - 1;
        if (c0 + nx < c1) mp_fetch<T, NT>(raw0 + nx % MP_RAW * P::raw, sg, row0, row_bytes, cols, c0 + nx);
        else mq_commit();
        const uint8_t *raw = raw0 + i % MP_RAW * P::raw;
#pragma unroll 1
        for (int p = 0; p < SUB; p++) {
            const int kk = i * SUB + p, s = kk % S;
            mp_wait(&empty[s], ((uint32_t)(kk / S) & 1) ^ 1);
            uint8_t *st = st0 + s * P::stage;
            if (tid == 0) {
                mp_expect_tx(&full[s], P::btile);
                mp_copy(st + MP_ATILE, xb + (size_t)((c0 + i) * SUB + p) * P::btile, P::btile, &full[s]);
            }
            /* Unit u: row group UNITS / 2 x warp + u / 2, 32-column block
             * u % 2 of the slice; a warp's 32 lanes write 4 whole core
             * matrices. */
#pragma unroll
            for (int u = 0; u < UNITS; u++) {
                const int rg = warp * (UNITS / 2) + (u >> 1), b = u & 1;
                uint32_t v[4];
                mq_decode<T>(raw + (rg * 8 + g) * P::ws, 2 * p + b, t, c0 + i, v);
                *(uint4 *)(st + rg * 1024 + (4 * b + t) * 128 + g * 16) = make_uint4(v[0], v[1], v[2], v[3]);
            }
            asm volatile("fence.proxy.async.shared::cta;" ::: "memory"); /* visible to wgmma */
            mp_arrive(&full[s]);
        }
    }
}

/* Warpgroups 2 and 3: rows 64 (warpgroup - 2) .. + 63 of the block, nk
 * slices of 64 columns. */
template <int T, int NT>
__device__ __forceinline__ void mp_consume(uint8_t *smem, uint64_t *full, uint64_t *empty, int nk,
                                           float (&acc)[NT / 2]) {
    using P = mp_geom<T, NT>;
    constexpr int S = P::stages;
    const int warp = threadIdx.x / 32, lane = threadIdx.x % 32, cw = warp / 4 - MP_PRODUCERS / 128;
    const uint32_t st0 = mp_sa(smem + MP_RAW * P::raw);
    for (int kk = 0; kk < nk; kk++) {
        const int s = kk % S;
        const uint32_t a = st0 + s * P::stage + cw * 8 * 1024, b = st0 + s * P::stage + MP_ATILE;
        mp_wait(&full[s], (uint32_t)(kk / S) & 1);
        asm volatile("wgmma.fence.sync.aligned;" ::: "memory");
#pragma unroll
        for (int j = 0; j < 4; j++) mp_wgmma(acc, mp_desc(a + j * 256), mp_desc(b + j * 256));
        asm volatile("wgmma.commit_group.sync.aligned;" ::: "memory");
        /* Slice kk - 1's multiplies are done: its stage goes back. */
        asm volatile("wgmma.wait_group.sync.aligned 1;" ::: "memory");
        if (kk > 0 && lane == 0) mp_arrive(&empty[(kk - 1) % S]);
    }
    asm volatile("wgmma.wait_group.sync.aligned 0;" ::: "memory");
}

/* Block b: K split b % ks, token block b / ks % n_tb, row block b / ks /
 * n_tb.  xt: the activations as mp_tile_x_kernel lays them out.  With ks
 * > 1 the sums go to part (mp_reduce_kernel's layout), else to out; rbs:
 * the row blocks of the group (passed, not read as g.blk0[g.n]: a kernel
 * parameter indexed at run time is copied to local memory). */
template <int T, int NT>
__global__ void __launch_bounds__(MP_THREADS, 1)
matmul_wgmma_kernel(const mm_group g, size_t row_bytes, int cols, const uint8_t *__restrict__ xt, int n, int n_tb,
                    int ks, int rbs, float *__restrict__ part) {
#if !MP_WG
    __trap(); /* never launched: cuda_matmul_wgmma_built */
#else
    using P = mp_geom<T, NT>;
    __shared__ __align__(8) uint64_t bars[2 * P::stages];
    extern __shared__ __align__(128) uint8_t mp_smem[];
    uint64_t *full = bars, *empty = full + P::stages;
    if (threadIdx.x == 0) {
        for (int i = 0; i < P::stages; i++) {
            mp_bar_init(&full[i], MP_PRODUCERS); /* every producer thread, after its stores */
            mp_bar_init(&empty[i], 8);           /* one lane of each consumer warp */
        }
        asm volatile("fence.mbarrier_init.release.cluster;" ::: "memory");
    }
    __syncthreads();
    pdl_begin();
    const int kz = (int)blockIdx.x % ks, rest = (int)blockIdx.x / ks, tb = rest % n_tb, rb = rest / n_tb;
    const int nc = cols / 256, c0 = (int)((int64_t)kz * nc / ks), c1 = (int)((int64_t)(kz + 1) * nc / ks);
    const mg_seg sg = mg_segment(g, rb);
    const int row0 = (rb - sg.rb0) * MP_ROWS;
    if (threadIdx.x < MP_PRODUCERS) {
        mp_produce<T, NT>(mp_smem, full, empty, sg, row0, row_bytes, cols, c0, c1,
                          xt + (size_t)tb * (cols / MP_K) * P::btile);
        return;
    }
    float acc[NT / 2];
#pragma unroll
    for (int i = 0; i < NT / 2; i++) acc[i] = 0.0f;
    mp_consume<T, NT>(mp_smem, full, empty, (c1 - c0) * (256 / MP_K), acc);
    /* acc[4j + e]: row g (+ 8 for e >= 2) of the warp's 16, token 8j + 2t
     * + (e & 1). */
    const int warp = threadIdx.x / 32, lane = threadIdx.x % 32, g8 = lane >> 2, t = lane & 3;
    const int r0 = (warp - MP_PRODUCERS / 32) * 16 + g8, ntok = n_tb * NT;
#pragma unroll
    for (int j = 0; j < NT / 8; j++)
#pragma unroll
        for (int e = 0; e < 4; e++) {
            const int r = r0 + 8 * (e >> 1), tok = tb * NT + 8 * j + 2 * t + (e & 1);
            if (ks > 1) part[((size_t)(kz * rbs + rb) * ntok + tok) * MP_ROWS + r] = acc[4 * j + e];
            else if (row0 + r < sg.rows && tok < n) sg.out[(size_t)tok * sg.rows + row0 + r] = acc[4 * j + e];
        }
#endif
}

/* out = the ks partial sums of each output, added in split order. */
__global__ void mp_reduce_kernel(const mm_group g, const float *__restrict__ part, int rbs, int ntok, int n, int ks) {
    pdl_begin();
    const int64_t total = (int64_t)rbs * ntok * MP_ROWS;
    for (int64_t i = blockIdx.x * (int64_t)blockDim.x + threadIdx.x; i < total; i += (int64_t)gridDim.x * blockDim.x) {
        const int r = (int)(i % MP_ROWS), tok = (int)(i / MP_ROWS % ntok), rb = (int)(i / MP_ROWS / ntok);
        const mg_seg sg = mg_segment(g, rb);
        const int row = (rb - sg.rb0) * MP_ROWS + r;
        if (tok >= n || row >= sg.rows) continue;
        float v = 0.0f;
        for (int k = 0; k < ks; k++) v += part[((size_t)(k * rbs + rb) * ntok + tok) * MP_ROWS + r];
        sg.out[(size_t)tok * sg.rows + row] = v;
    }
}

/* x [n, cols] (F32) -> F16 in the kernel's layout: token block tb (nt
 * tokens), slice kk (64 columns) at (tb * (cols / 64) + kk) * nt * 128
 * bytes, core matrices as above; zeros past n.  One thread per 8 columns
 * of a token (16 bytes). */
__global__ void mp_tile_x_kernel(const float *__restrict__ x, uint4 *__restrict__ xt, int n, int cols, int nt,
                                 int64_t units) {
    pdl_begin();
    const int nk = cols / MP_K, per = nt * 8;
    for (int64_t i = blockIdx.x * (int64_t)blockDim.x + threadIdx.x; i < units; i += (int64_t)gridDim.x * blockDim.x) {
        const int u = (int)(i % per), kk = (int)(i / per % nk), tb = (int)(i / per / nk);
        const int tok = tb * nt + (u >> 6) * 8 + (u & 7), col = kk * MP_K + ((u >> 3) & 7) * 8;
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

/* K splits for `base` blocks (row blocks x token blocks, one a
 * multiprocessor at a time) of nc chunks: the fewest that come within 3%
 * of the least waves per split, at least two chunks a split. */
static int mp_splits(int base, int nc, int n_sms) {
    int best = 1;
    double best_t = (double)((base + n_sms - 1) / n_sms);
    for (int ks = 2; ks <= MP_SPLITS_MAX && 2 * ks <= nc; ks++) {
        const double t = (double)(((int64_t)base * ks + n_sms - 1) / n_sms) / ks;
        if (t < 0.97 * best_t) {
            best = ks;
            best_t = t;
        }
    }
    return best;
}

template <int T, int NT>
static int mp_launch(struct cuda_ctx *ctx, mm_group &g, int64_t cols, const float *x, int n) {
    using P = mp_geom<T, NT>;
    static int ready[64];
    const int dev = ctx->device >= 0 && ctx->device < 64 ? ctx->device : 0;
    if (!ready[dev]) {
        int smem_max = 0;
        CUDA_CHECK(ctx, cudaDeviceGetAttribute(&smem_max, cudaDevAttrMaxSharedMemoryPerBlockOptin, ctx->device));
        ready[dev] = P::smem + 1024 <= smem_max ? 1 : -1;
        if (ready[dev] > 0)
            CUDA_CHECK(ctx, cudaFuncSetAttribute(matmul_wgmma_kernel<T, NT>,
                                                 cudaFuncAttributeMaxDynamicSharedMemorySize, P::smem));
    }
    const size_t row_bytes = cuda_row_bytes((enum dtype)T, cols);
    if (ready[dev] < 0 || row_bytes % 16 != 0) return CUDA_NOT_FUSED;
    int rbs = 0;
    for (int s = 0; s < g.n; s++) {
        g.blk0[s] = rbs;
        rbs += (g.rows[s] + MP_ROWS - 1) / MP_ROWS;
    }
    g.blk0[g.n] = rbs;
    const int n_tb = (n + NT - 1) / NT, nc = (int)(cols / 256);
    if ((int64_t)rbs * n_tb > INT32_MAX / MP_SPLITS_MAX) return CUDA_NOT_FUSED;
    const int ks = mp_splits(rbs * n_tb, nc, ctx->n_sms);
    /* Scratch: x in the kernel's layout (kept for the next matmul on x),
     * then the partial sums. */
    const size_t xt_bytes = ((size_t)n_tb * NT * cols * 2 + 255) & ~(size_t)255;
    const size_t part_bytes = ks > 1 ? (size_t)ks * rbs * n_tb * NT * MP_ROWS * sizeof(float) : 0;
    uint8_t *xt = (uint8_t *)cuda_scratch(ctx, xt_bytes + part_bytes);
    if (!xt) return STATUS_NO_MEMORY;
    if (!cuda_act_reuse(ctx, NT == 64 ? MATMUL_ACT_WG64 : MATMUL_ACT_WG128, x, n, cols, xt)) {
        const int64_t units = (int64_t)n_tb * NT * cols / 8;
        cudaError_t e = cuda_launch(ctx, mp_tile_x_kernel, dim3(cuda_blocks(units, 256)), dim3(256), 0, x,
                                    (uint4 *)xt, n, (int)cols, NT, units);
        if (e != cudaSuccess) {
            cuda_act_forget(ctx);
            return cuda_fail(ctx, STATUS_INTERNAL, "cuda:%d: matmul (wgmma): %s", ctx->device, cudaGetErrorString(e));
        }
    }
    float *part = ks > 1 ? (float *)(xt + xt_bytes) : NULL;
    CUDA_CHECK(ctx, cuda_launch(ctx, matmul_wgmma_kernel<T, NT>, dim3((unsigned)(rbs * n_tb * ks)),
                                dim3(MP_THREADS), P::smem, g, row_bytes, (int)cols, (const uint8_t *)xt, n, n_tb, ks,
                                rbs, part));
    if (ks > 1)
        CUDA_CHECK(ctx, cuda_launch(ctx, mp_reduce_kernel, dim3(cuda_blocks((int64_t)rbs * n_tb * NT * MP_ROWS, 256)),
                                    dim3(256), 0, g, (const float *)part, rbs, n_tb * NT, n, ks));
    CUDA_CHECK(ctx, cudaGetLastError());
    return STATUS_OK;
}

template <int T>
static int mp_launch_t(struct cuda_ctx *ctx, mm_group &g, int64_t cols, const float *x, int n) {
    return n <= 64 ? mp_launch<T, 64>(ctx, g, cols, x, n) : mp_launch<T, 128>(ctx, g, cols, x, n);
}

extern "C" int cuda_matmul_wgmma_built(struct cuda_ctx *ctx) {
    int v = 0;
    return ctx->cc == 90 && cudaMemcpyFromSymbol(&v, mp_built_flag, sizeof v) == cudaSuccess && v;
}

extern "C" int cuda_matmul_wgmma(struct cuda_ctx *ctx, struct mm_group *g, enum dtype type, int64_t cols,
                                 const float *x, int32_t n) {
    if (n < ctx->wgmma_min || n > ctx->wgmma_max || g->swiglu || cols % 256 != 0 || cols > INT32_MAX ||
        (uintptr_t)x % 16 != 0)
        return CUDA_NOT_FUSED;
    for (int s = 0; s < g->n; s++)
        if ((uintptr_t)g->w[s] % 16 != 0) return CUDA_NOT_FUSED;
    switch (type) {
    case DTYPE_Q8_0: return mp_launch_t<DTYPE_Q8_0>(ctx, *g, cols, x, n);
    case DTYPE_Q4_0: return mp_launch_t<DTYPE_Q4_0>(ctx, *g, cols, x, n);
    case DTYPE_Q4_1: return mp_launch_t<DTYPE_Q4_1>(ctx, *g, cols, x, n);
    case DTYPE_Q5_0: return mp_launch_t<DTYPE_Q5_0>(ctx, *g, cols, x, n);
    case DTYPE_Q5_1: return mp_launch_t<DTYPE_Q5_1>(ctx, *g, cols, x, n);
    case DTYPE_Q4_K: return mp_launch_t<DTYPE_Q4_K>(ctx, *g, cols, x, n);
    case DTYPE_Q5_K: return mp_launch_t<DTYPE_Q5_K>(ctx, *g, cols, x, n);
    case DTYPE_Q6_K: return mp_launch_t<DTYPE_Q6_K>(ctx, *g, cols, x, n);
    default: return CUDA_NOT_FUSED;
    }
}
