/* Tensor-core matmul for decode batches of 17-64 tokens on quantized
 * weights (sm_80 and later): out[n, rows] = x[n, cols] . w^T for one
 * weight or a group of weights on the same input (q, k, v; gate, up).
 *
 * At 64 tokens a Q4_K weight costs about as much tensor-core time as DRAM
 * time on an H100 (64 multiply-adds per 4.5 bits), so the two must
 * overlap.  matmul_vec.cu's mq loads a chunk, waits for it, then
 * multiplies; here the copies into shared memory are asynchronous
 * (cp.async) into a ring of 2-3 stages, so the next chunks stream in while
 * this one is multiplied.  The fragments and their decoding are mq's
 * (mq_frag.cuh): weights dequantized to F16 in registers, activations in
 * their F16 form (cuda_gemm_act), mma.sync m16n8k16 with F32 sums.
 *
 * Each warp owns 32 rows (two m tiles) and every token: each activation
 * fragment it loads from shared memory feeds two mma instead of one.
 * (16 rows a warp is slower, and so are 16 warps that split the tokens
 * and so decode every row twice: 10-20% on the K-quants, whose decoding
 * is most of the kernel's instructions.)
 *
 * Work is split stream-K style.  An item is one chunk (256 columns) of one
 * row block (256 rows); items are numbered row block by row
 * block over every weight of the group, and the grid (one block per
 * resident slot, one wave) takes them in equal consecutive ranges.  A
 * block whose range holds a whole row block writes its outputs; a row
 * block shared by several blocks gets their partial sums (one slot per
 * block and end of its range), and the last of them to arrive (a counter
 * per row block) adds the slots in block order, so the result does not
 * depend on timing. */
#include "matmul_group.cuh"
#include "mq_frag.cuh"

#define MW_MT 2 /* m tiles (16 rows) per warp */
#define MW_WARPS 8
#define MW_ROWS (MW_WARPS * 16 * MW_MT)
#define MW_THREADS (MW_WARPS * 32)
#define MW_COUNTERS 16384

/* Arrival counters, one per row block of a launch; zero between calls
 * (the last block resets its own).  One stream per device uses them. */
__device__ unsigned int mw_counters[MW_COUNTERS];

/* First item of block b when nb blocks share n items. */
__host__ __device__ static inline int mw_start(int b, int nb, int n) { return (int)((int64_t)b * n / nb); }

/* The block whose range holds item i. */
__device__ inline int mw_owner(int i, int nb, int n) {
    int b = (int)((int64_t)i * nb / n);
    while (b + 1 < nb && mw_start(b + 1, nb, n) <= i) b++;
    while (b > 0 && mw_start(b, nb, n) > i) b--;
    return b;
}

template <int T, int NT> struct mw_geom {
    using G = mq_geom<T>;
    static constexpr int wbytes = MW_ROWS * G::ws;            /* the weight tile of a stage */
    static constexpr int stage = wbytes + NT * G::xs * 2;     /* and the activations after it */
};

/* Queue the copies of item `item` (row block item / nc, chunk item % nc)
 * into stage st: the raw bytes of the 256 rows' chunk (as mq lays them
 * out) and the chunk's activations for NT tokens (zeros past n, cols and
 * the weight's rows).  Four threads share a row (and a token), each with
 * its pointer worked out once: the copies are the kernel's only address
 * arithmetic, and per 16 bytes it must stay a few instructions.  W, X:
 * queue the weights' copies, the activations' (the first stages queue
 * them apart, on either side of the programmatic wait). */
template <int T, int NT, bool W = true, bool X = true>
__device__ __forceinline__ void mw_load(uint8_t *st, const mm_group &g, size_t row_bytes, int cols,
                                        const __half *x16, int n, int nc, int item) {
    using G = mq_geom<T>;
    constexpr int TPR = 4, RPP = MW_THREADS / TPR, JW = (G::nld + TPR - 1) / TPR, JX = G::ck / 8 / TPR;
    static_assert(RPP >= NT, "one pass of the activation copy covers every token");
    const int rb = item / nc, ch = item % nc, sub = threadIdx.x % TPR;
    const mg_seg sg = mg_seg_locate(g, rb);
    const int row0 = (rb - sg.u0) * MW_ROWS, col0 = ch * G::ck, nb = min(G::ck / 32, (cols - col0) / 32);
    const size_t choff = (size_t)(col0 / mq_fmt<T>::eb) * mq_fmt<T>::bb;
    const int cbytes = nb * 32 / mq_fmt<T>::eb * mq_fmt<T>::bb;
#pragma unroll
    for (int p = 0; p < (W ? MW_ROWS / RPP : 0); p++) {
        const int r = p * RPP + threadIdx.x / TPR;
        const bool live = row0 + r < sg.rows;
        const uint8_t *rp = sg.w + (size_t)(row0 + r) * row_bytes, *gp = rp + choff;
        const uint8_t *base = (const uint8_t *)((uintptr_t)gp & ~(uintptr_t)15);
        uint8_t *dst = st + r * G::ws;
#pragma unroll
        for (int j = 0; j < JW; j++) {
            const int c = sub + TPR * j;
            if (G::nld % TPR != 0 && c >= G::nld) break;
            const uint8_t *src = sg.w;
            int bytes = 0;
            if (live) {
                if constexpr (mq_fmt<T>::soa != 0) {
                    const uint8_t *s = mq_soa_src<T>(rp, cols, ch, c, nb);
                    if (s) {
                        src = s;
                        bytes = 16;
                    }
                } else {
                    /* Only the chunk's own bytes (never past the weight's
                     * end): the kernel reads blocks past a partial last
                     * chunk too, and they must be zeros, not the next
                     * row's blocks. */
                    const uint8_t *s = base + 16 * c;
                    if (s < gp + cbytes) {
                        src = s;
                        bytes = gp + cbytes - s < 16 ? (int)(gp + cbytes - s) : 16;
                    }
                }
            }
            cp_async16(dst + 16 * c, src, bytes);
        }
    }
    const int tok = threadIdx.x / TPR;
    if (X && tok < NT) {
        const bool live = tok < n;
        const __half *xp = x16 + (size_t)(live ? tok : 0) * cols + col0;
        __half *xd = (__half *)(st + mw_geom<T, NT>::wbytes) + tok * G::xs;
#pragma unroll
        for (int j = 0; j < JX; j++) {
            const int c = (sub + TPR * j) * 8;
            const bool in = live && col0 + c < cols;
            cp_async16(xd + c, in ? xp + c : x16, in ? 16 : 0);
        }
    }
}

/* acc[m][nt][0, 1]: row 16m + g, tokens 8nt + 2t, + 1; [2, 3]: row 16m +
 * g + 8 (rows from the warp's row0). */
template <int NT>
__device__ __forceinline__ void mw_store(const float (&acc)[MW_MT][NT / 8][4], float *out, int rows, int row0,
                                         int n) {
    const int lane = threadIdx.x % 32, g = lane >> 2, t = lane & 3;
#pragma unroll
    for (int m = 0; m < MW_MT; m++)
#pragma unroll
        for (int nt = 0; nt < NT / 8; nt++)
#pragma unroll
            for (int e = 0; e < 4; e++) {
                int tok = nt * 8 + 2 * t + (e & 1), row = row0 + 16 * m + g + 8 * (e >> 1);
                if (tok < n && row < rows) out[(size_t)tok * rows + row] = acc[m][nt][e];
            }
}

/* part: 2 slots per block of MW_ROWS x NT floats (in the threads' order). */
template <int T, int NT>
__global__ void __launch_bounds__(MW_THREADS, 1)
matmul_wide_kernel(const mm_group g, float *__restrict__ part, size_t row_bytes, int cols,
                   const __half *__restrict__ x16, int n, int n_items, int stages) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ < 800
    __trap(); /* no cp.async: never launched here (ctx->wide needs sm_80) */
#else
    using G = mq_geom<T>;
    constexpr int NB = G::ck / 32, NTL = NT / 8, STAGE = mw_geom<T, NT>::stage;
    extern __shared__ uint4 mw_smem[];
    __shared__ int last;
    uint8_t *smem = (uint8_t *)mw_smem;
    const int tid = threadIdx.x, warp = tid / 32, lane = tid % 32, g8 = lane >> 2, t = lane & 3;
    const int nc = (cols + G::ck - 1) / G::ck, nblk = (int)gridDim.x;
    const int i0 = mw_start(blockIdx.x, nblk, n_items), i1 = mw_start(blockIdx.x + 1, nblk, n_items);

    float acc[MW_MT][NTL][4] = {};

    /* The first stages' weights are no kernel's output: copied before the
     * programmatic wait (in the first commit group, with the first
     * activations), the activations after it. */
    for (int k = 0; k < stages - 1; k++)
        if (i0 + k < i1) mw_load<T, NT, true, false>(smem + k * STAGE, g, row_bytes, cols, x16, n, nc, i0 + k);
    pdl_begin();
    for (int k = 0; k < stages - 1; k++) {
        if (i0 + k < i1) mw_load<T, NT, false, true>(smem + k * STAGE, g, row_bytes, cols, x16, n, nc, i0 + k);
        cp_async_commit();
    }
    for (int i = i0; i < i1; i++) {
        const int k = i - i0;
        stages == 3 ? cp_async_wait<1>() : cp_async_wait<0>(); /* item i's copies (this thread's) have landed */
        __syncthreads();     /* everyone's have; the stage read last round is free */
        if (i + stages - 1 < i1)
            mw_load<T, NT>(smem + (k + stages - 1) % stages * STAGE, g, row_bytes, cols, x16, n, nc, i + stages - 1);
        cp_async_commit();

        const int rb = i / nc, ch = i % nc, col0 = ch * G::ck;
        const mg_seg sg = mg_seg_locate(g, rb);
        const int row0 = (rb - sg.u0) * MW_ROWS + warp * 16 * MW_MT;
        const uint8_t *st = smem + k % stages * STAGE;
        const __half *xs = (const __half *)(st + mw_geom<T, NT>::wbytes);
        /* Where the lane's rows (g and g + 8 of each m tile) start in the
         * stage (their global address modulo 16; 0 in the regrouped
         * layouts). */
        const size_t choff = (size_t)(col0 / mq_fmt<T>::eb) * mq_fmt<T>::bb;
        const uintptr_t m16 = mq_fmt<T>::soa ? 0 : 15;
        const uint8_t *pr[2 * MW_MT];
#pragma unroll
        for (int j = 0; j < 2 * MW_MT; j++) {
            const int r = warp * 16 * MW_MT + 8 * j + g8; /* j = 2m + (row g + 8) */
            pr[j] = st + r * G::ws + ((uintptr_t)(sg.w + (size_t)(row0 + 8 * j + g8) * row_bytes + choff) & m16);
        }
        /* Straight-line code over every block and token tile (no test of
         * nb or n: a branch per tile kept the compiler from overlapping
         * one tile's loads and mma chains with the next one's).  Blocks
         * past a partial last chunk and tokens past n are zeros in shared
         * memory and add nothing. */
#pragma unroll
        for (int b = 0; b < NB; b++) {
            uint32_t a[2 * MW_MT][4];
#pragma unroll
            for (int j = 0; j < 2 * MW_MT; j++) mq_decode<T>(pr[j], b, t, ch, a[j]);
#pragma unroll
            for (int nt = 0; nt < NTL; nt++) {
                const uint4 bx = *(const uint4 *)(xs + (nt * 8 + g8) * G::xs + 32 * b + 8 * t);
#pragma unroll
                for (int m = 0; m < MW_MT; m++) mq_mma32(acc[m][nt], a[2 * m], a[2 * m + 1], bx);
            }
        }

        if (ch != nc - 1 && i != i1 - 1) continue;
        /* The end of this row block in this block's range. */
        const int first = rb * nc, lastit = first + nc - 1;
        if (first >= i0 && lastit < i1) {
            mw_store<NT>(acc, sg.out, sg.rows, row0, n);
        } else {
            float4 *dst = (float4 *)(part + (size_t)(2 * blockIdx.x + (first < i0 ? 0 : 1)) * MW_ROWS * NT);
#pragma unroll
            for (int m = 0; m < MW_MT; m++)
#pragma unroll
                for (int nt = 0; nt < NTL; nt++)
                    __stcg(dst + (m * NTL + nt) * MW_THREADS + tid,
                           make_float4(acc[m][nt][0], acc[m][nt][1], acc[m][nt][2], acc[m][nt][3]));
            __threadfence(); /* the partial sums visible before the arrival counts */
            __syncthreads();
            const int c0 = mw_owner(first, nblk, n_items), c1 = mw_owner(lastit, nblk, n_items);
            if (tid == 0) {
                unsigned int prev = atomicAdd(&mw_counters[rb], 1u);
                last = prev == (unsigned int)(c1 - c0);
                if (last) mw_counters[rb] = 0;
            }
            __syncthreads();
            if (last) {
                __threadfence();
                float s[MW_MT][NTL][4] = {};
                for (int c = c0; c <= c1; c++) { /* block order: the same sum whoever arrives last */
                    const float4 *src = (const float4 *)(part + (size_t)(2 * c + (first < mw_start(c, nblk, n_items)
                                                                                     ? 0 : 1)) * MW_ROWS * NT);
#pragma unroll
                    for (int m = 0; m < MW_MT; m++)
#pragma unroll
                        for (int nt = 0; nt < NTL; nt++) {
                            float4 v = __ldcg(src + (m * NTL + nt) * MW_THREADS + tid);
                            s[m][nt][0] += v.x;
                            s[m][nt][1] += v.y;
                            s[m][nt][2] += v.z;
                            s[m][nt][3] += v.w;
                        }
                }
                mw_store<NT>(s, sg.out, sg.rows, row0, n);
            }
        }
#pragma unroll
        for (int m = 0; m < MW_MT; m++)
#pragma unroll
            for (int nt = 0; nt < NTL; nt++) acc[m][nt][0] = acc[m][nt][1] = acc[m][nt][2] = acc[m][nt][3] = 0.0f;
    }
#endif
}

template <int T, int NT>
static int mw_launch_nt(struct cuda_ctx *ctx, mm_group &g, int64_t cols, const float *x, int n) {
    const size_t stage = mw_geom<T, NT>::stage;
    /* Stages and resident blocks per SM, asked once per device: 3 stages
     * where shared memory allows, else 2 (H100: 213 KB for 64 tokens of
     * Q8_0), else the caller's other kernel. */
    static int stages[64], per_sm[64];
    const int dev = ctx->device >= 0 && ctx->device < 64 ? ctx->device : 0;
    if (!stages[dev]) {
        int smem_max = 0;
        CUDA_CHECK(ctx, cudaDeviceGetAttribute(&smem_max, cudaDevAttrMaxSharedMemoryPerBlockOptin, ctx->device));
        int s = 3 * stage <= (size_t)smem_max - 1024 ? 3 : 2 * stage <= (size_t)smem_max - 1024 ? 2 : -1;
        if (s > 0) CUDA_CHECK(ctx, cuda_blocks_per_sm(matmul_wide_kernel<T, NT>, MW_THREADS, s * stage, &per_sm[dev]));
        stages[dev] = s;
    }
    if (stages[dev] < 0) return CUDA_NOT_FUSED;
    int rbs = 0;
    for (int s = 0; s < g.n; s++) {
        g.blk0[s] = rbs;
        rbs += (g.rows[s] + MW_ROWS - 1) / MW_ROWS;
    }
    g.blk0[g.n] = rbs;
    if (rbs > MW_COUNTERS) return CUDA_NOT_FUSED;
    const int nc = (int)((cols + mq_geom<T>::ck - 1) / mq_geom<T>::ck);
    const int64_t items = (int64_t)rbs * nc;
    /* Too few items a block to keep copies in flight behind the mma:
     * matmul_vec.cu's mq, split over two blocks a multiprocessor, is
     * faster there (4096 x 4096: 16 row blocks of 16 chunks, two items a
     * block), docs/cuda-backend.md. */
    if (items > INT32_MAX || items < (int64_t)ctx->wide_items * ctx->n_sms) return CUDA_NOT_FUSED;
    const int blocks = (int)(items < (int64_t)ctx->n_sms * per_sm[dev] ? items : (int64_t)ctx->n_sms * per_sm[dev]);
    /* Scratch: x's F16 form first (kept for the next matmul on x), then
     * the partial-sum slots. */
    const size_t x_bytes = ((size_t)n * cols * 2 + 255) & ~(size_t)255;
    const size_t part_bytes = (size_t)2 * blocks * MW_ROWS * NT * sizeof(float);
    uint8_t *scr = (uint8_t *)cuda_scratch(ctx, x_bytes + part_bytes);
    if (!scr) return STATUS_NO_MEMORY;
    uint16_t *x16 = NULL;
    int rc = cuda_gemm_act_f16(ctx, x, n, cols, &x16);
    if (rc != STATUS_OK) return rc;
    CUDA_CHECK(ctx, cuda_launch(ctx, (matmul_wide_kernel<T, NT>), dim3((unsigned)blocks), dim3(MW_THREADS),
                                stages[dev] * stage, g, (float *)(scr + x_bytes), cuda_row_bytes((enum dtype)T, cols),
                                (int)cols, (const __half *)x16, n, (int)items, stages[dev]));
    CUDA_CHECK(ctx, cudaGetLastError());
    return STATUS_OK;
}

template <int T>
static int mw_launch(struct cuda_ctx *ctx, mm_group &g, int64_t cols, const float *x, int n) {
    if (n <= 32) return mw_launch_nt<T, 32>(ctx, g, cols, x, n);
    if (n <= 48) return mw_launch_nt<T, 48>(ctx, g, cols, x, n);
    return mw_launch_nt<T, 64>(ctx, g, cols, x, n);
}

extern "C" int cuda_matmul_wide(struct cuda_ctx *ctx, struct mm_group *g, enum dtype type, int64_t cols,
                                 const float *x, int32_t n) {
    if (!ctx->wide || n <= 16 || n > 64 || g->swiglu || cols > INT32_MAX || (uintptr_t)x % 16 != 0)
        return CUDA_NOT_FUSED;
    for (int s = 0; s < g->n; s++)
        if ((uintptr_t)g->w[s] % 16 != 0) return CUDA_NOT_FUSED;
    const int k_quant = type == DTYPE_Q4_K || type == DTYPE_Q5_K || type == DTYPE_Q6_K;
    if (cols % (k_quant ? 256 : 32) != 0) return CUDA_NOT_FUSED;
    switch (type) {
    case DTYPE_Q8_0: return mw_launch<DTYPE_Q8_0>(ctx, *g, cols, x, n);
    case DTYPE_Q4_0: return mw_launch<DTYPE_Q4_0>(ctx, *g, cols, x, n);
    case DTYPE_Q4_1: return mw_launch<DTYPE_Q4_1>(ctx, *g, cols, x, n);
    case DTYPE_Q5_0: return mw_launch<DTYPE_Q5_0>(ctx, *g, cols, x, n);
    case DTYPE_Q5_1: return mw_launch<DTYPE_Q5_1>(ctx, *g, cols, x, n);
    case DTYPE_Q4_K: return mw_launch<DTYPE_Q4_K>(ctx, *g, cols, x, n);
    case DTYPE_Q5_K: return mw_launch<DTYPE_Q5_K>(ctx, *g, cols, x, n);
    case DTYPE_Q6_K: return mw_launch<DTYPE_Q6_K>(ctx, *g, cols, x, n);
    default: return CUDA_NOT_FUSED;
    }
}
