/* What matmul_mmq.cu (K-quants on int8 tensor cores, up to 64 tokens)
 * and matmul_mmq_tile.cu (its Q4_K kernel of 32 x 32 warp tiles) share:
 * the activations' Q8K layout and how a block stages them, the mma
 * instructions, Q4_K's and Q5_K's weight fragments, the launch arguments,
 * a chunk's epilogue and the write of the sums (with K split, the partial
 * sums added by the last block of a row block). */
#ifndef LLM_KERNELS_CUDA_MMQ_CUH
#define LLM_KERNELS_CUDA_MMQ_CUH

#include "common.cuh"
#include "matmul_group.cuh"
#include "mq_frag.cuh"

#define MMQ_WARPS 4
#define MMQ_ROWS (MMQ_WARPS * 16)
#define MMQ_COUNTERS 16384
#define MMQ_SPLIT_MAX 8
/* A token's staged chunk in shared memory: lane t's 64 bytes at t * MMQ_XL,
 * tokens MMQ_XS apart.  A 16-byte fragment load is served 8 lanes (tokens
 * g, g + 1 of one parity, t = 0 .. 3) at a time, and these strides (20 t
 * + 16 g words, mod 32) put the 8 on distinct banks, where lanes 64 bytes
 * apart (t = 0 and 2) would share them. */
#define MMQ_XL 80
#define MMQ_XS 320

/* ---- Activations: Q8K, a lane's fragments contiguous ----
 * For chunk s (256 columns) and token c, lane t's 64 bytes are
 * xq[(s * n + c) * 256 + t * 64 ..]; its B fragment words of 32-column
 * block j are words 2j and 2j + 1 of them, which hold
 *   Q6_K's order (MATMUL_ACT_Q8K): columns 32 j + 4 t .. and 32 j + 16 +
 *     4 t .. (byte t * 64 + m * 4 + i is column 16 m + 4 t + i);
 *   Q4_K's and Q5_K's (MATMUL_ACT_Q8K8): columns 32 j + 8 t .. 8 t + 7
 *     (byte t * 64 + 8 j + i is column 32 j + 8 t + i);
 * xd[s * n + c] the scale, xb[(s * n + c) * 8 + j] the sum of block j's
 * codes. */
struct mmq_act {
    const int8_t *xq;
    const float *xd;
    const int16_t *xb;
};

/* ---- Tensor-core products: the m16n8 tiles of the PTX ISA, a0/a2 row g,
 * a1/a3 row g + 8, k = 4 t .. (a0, a1, b0) and 16 + 4 t .. (a2, a3, b1) ---- */
/* sm_75's 8 x 8 x 16 tile: c0 c1 row g, columns 2t, 2t + 1. */
__device__ __forceinline__ void mmq_mma_m8(int &c0, int &c1, uint32_t a, uint32_t b) {
    asm volatile("mma.sync.aligned.m8n8k16.row.col.s32.s8.s8.s32 {%0,%1}, {%2}, {%3}, {%0,%1};\n"
                 : "+r"(c0), "+r"(c1)
                 : "r"(a), "r"(b));
}

__device__ __forceinline__ void mmq_mma_k32(int (&c)[4], const uint32_t (&a)[4], uint32_t b0, uint32_t b1) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 800
    asm volatile("mma.sync.aligned.m16n8k32.row.col.s32.s8.s8.s32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, "
                 "{%0,%1,%2,%3};\n"
                 : "+r"(c[0]), "+r"(c[1]), "+r"(c[2]), "+r"(c[3])
                 : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
#else
    mmq_mma_m8(c[0], c[1], a[0], b0);
    mmq_mma_m8(c[0], c[1], a[2], b1);
    mmq_mma_m8(c[2], c[3], a[1], b0);
    mmq_mma_m8(c[2], c[3], a[3], b1);
#endif
}

/* a0 row g, a1 row g + 8, k = 4 t ... */
__device__ __forceinline__ void mmq_mma_k16(int (&c)[4], uint32_t a0, uint32_t a1, uint32_t b) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 800
    asm volatile("mma.sync.aligned.m16n8k16.row.col.s32.s8.s8.s32 {%0,%1,%2,%3}, {%4,%5}, {%6}, {%0,%1,%2,%3};\n"
                 : "+r"(c[0]), "+r"(c[1]), "+r"(c[2]), "+r"(c[3])
                 : "r"(a0), "r"(a1), "r"(b));
#else
    mmq_mma_m8(c[0], c[1], a0, b);
    mmq_mma_m8(c[2], c[3], a1, b);
#endif
}

/* ---- Weights: what one lane holds of its two rows' chunk, and how a
 * pair of 32-column blocks (Q6_K: of 16-column halves, four scales)
 * becomes A fragments and integer scales ---- */
__device__ __forceinline__ uint32_t mmq_ld32(const uint8_t *p) { return __ldg((const unsigned int *)p); }

template <int T> struct mmq_w;

/* Q4_K and Q5_K: the 16-byte head (d, dmin, 12 scale bytes) and, for pair
 * p (columns 64 p ..), qs bytes 32 p + 8 t .. 8 t + 7 (lo: the first 4,
 * hi: the next; in the permuted k order the fragments a0 and a2 of the
 * row): low nibbles are block 2p, high nibbles block 2p + 1; Q5_K's fifth
 * bits from qh bytes 8 t .. 8 t + 7. */
template <int T> struct mmq_wk {
    static constexpr int BYTES = T == DTYPE_Q5_K ? 176 : 144;
    static constexpr int QS = T == DTYPE_Q5_K ? 48 : 16;
    static constexpr bool MIN = true;
    static constexpr int KPP = 2; /* mma per pair */
    uint4 h;
    uint32_t lo[4], hi[4], qa, qb;

    __device__ __forceinline__ void load(const uint8_t *row, int s, int t, int64_t) {
        load_at(row + (size_t)s * BYTES, t);
    }
    /* The same from the chunk's first byte b. */
    __device__ __forceinline__ void load_at(const uint8_t *b, int t) {
        h = __ldg((const uint4 *)b);
#pragma unroll
        for (int p = 0; p < 4; p++) {
            const uint2 v = __ldg((const uint2 *)(b + QS + 32 * p + 8 * t));
            lo[p] = v.x;
            hi[p] = v.y;
        }
        if (T == DTYPE_Q5_K) {
            const uint2 v = __ldg((const uint2 *)(b + 16 + 8 * t));
            qa = v.x;
            qb = v.y;
        }
    }
    /* Block 2p + k's codes: a0 columns 8 t .., a2 columns 8 t + 4 ... */
    __device__ __forceinline__ void codes(int p, int k, uint32_t &c0, uint32_t &c2) const {
        c0 = (lo[p] >> (4 * k)) & 0x0F0F0F0Fu;
        c2 = (hi[p] >> (4 * k)) & 0x0F0F0F0Fu;
        if (T == DTYPE_Q5_K) {
            c0 |= ((qa >> (2 * p + k)) & 0x01010101u) << 4;
            c2 |= ((qb >> (2 * p + k)) & 0x01010101u) << 4;
        }
    }
    __device__ __forceinline__ float d() const { return __half2float(__ushort_as_half((unsigned short)(h.x & 0xFFFF))); }
    __device__ __forceinline__ float dmin() const { return __half2float(__ushort_as_half((unsigned short)(h.x >> 16))); }
    /* Scales 0-3 / 4-7 packed a byte each. */
    __device__ __forceinline__ uint32_t sc(int half) const {
        return half == 0 ? h.y & 0x3F3F3F3Fu : (h.w & 0x0F0F0F0Fu) | ((h.y >> 2) & 0x30303030u);
    }
    /* Scale j (one byte permute). */
    __device__ __forceinline__ int sci(int j) const { return (int)__byte_perm(sc(j >> 2), 0, 0x4440u | (j & 3)); }
    __device__ __forceinline__ uint32_t mins(int half) const {
        return half == 0 ? h.z & 0x3F3F3F3Fu : ((h.w >> 4) & 0x0F0F0F0Fu) | ((h.z >> 2) & 0x30303030u);
    }
    /* Lane t's A fragment of the min term (mmq_chunk): -32 dmin m_j of
     * blocks j = 2 t, 2 t + 1 as F16, the 6-bit m_j exact through the
     * 1024 + m mantissa (mq_cvt) and one rounding of the product. */
    __device__ __forceinline__ uint32_t min_frag(int t) const {
        const uint32_t m = __byte_perm(mins(t >> 1), 0x64646464u, t & 1 ? 0x4342u : 0x4140u);
        const __half2 v = __hsub2(mq_h2(m), mq_hh(1024.0f));
        const __half nd = __hmul(__ushort_as_half((unsigned short)(h.x >> 16)), __float2half(-32.0f));
        return mq_u32(__hmul2(v, __half2half2(nd)));
    }
};
template <> struct mmq_w<DTYPE_Q4_K> : mmq_wk<DTYPE_Q4_K> {};
template <> struct mmq_w<DTYPE_Q5_K> : mmq_wk<DTYPE_Q5_K> {};

struct mmq_args {
    mm_group g;   /* blk0: first row block of each weight */
    mmq_act a;
    float *part;  /* partial sums when gridDim.y > 1 */
    size_t part0[MG_MAX]; /* each weight's first partial sum */
    int n, n_sb, sps; /* tokens, chunks, chunks a split */
    int th;           /* blocks side by side on one row block, each 8 NT tokens */
    int64_t cols;
    size_t rb;        /* bytes a weight row */
    int ahead;        /* ctx->l2_ahead: chunks past the next one asked of L2 */
};

/* A chunk's sums of a warp's two rows g, g + 8 (cw) and NT tiles of 8
 * tokens to acc: the int32 sums (isum) scaled once by the rows' d and the
 * tokens' scales (sxd); then the min term, all 8 blocks of every row and
 * token at once: one F16 mma m16n8k8 a tile of (-32 dmin m_j) against the
 * tokens' (dx x sum_j / 32) (sxm, mmq_x_store). */
template <int T, int NT>
__device__ __forceinline__ void mmq_scale_add(const mmq_w<T> (&cw)[2], const int (&isum)[NT][4], const float *sxd,
                                              const uint4 *sxm, int g, int t, float (&acc)[NT][4]) {
    const float d[2] = {cw[0].d(), cw[1].d()};
#pragma unroll
    for (int nt = 0; nt < NT; nt++)
#pragma unroll
        for (int j = 0; j < 2; j++) {
            const float dx = sxd[nt * 8 + 2 * t + j];
#pragma unroll
            for (int r = 0; r < 2; r++)
                acc[nt][2 * r + j] = fmaf(dx * d[r], (float)isum[nt][2 * r + j], acc[nt][2 * r + j]);
        }
    if constexpr (mmq_w<T>::MIN) {
        const uint32_t a0 = cw[0].min_frag(t), a1 = cw[1].min_frag(t);
#pragma unroll
        for (int nt = 0; nt < NT; nt++) mq_mma(acc[nt], a0, a1, ((const uint32_t *)(sxm + nt * 8 + g))[t]);
    }
}

/* The block's sums to out: straight, or with K split this split's partial
 * sums, and the last block of the row block to arrive adds every split's
 * in order (counters: the kernel's arrival counts, a row block each).
 * A warp's RF fragments of 16 rows from row0 and NT tiles of 8
 * tokens from tok0; the block's tokens are btok .. btok + ntb.  Every
 * thread of the block calls it. */
template <int NT, int RF>
__device__ __forceinline__ void mmq_finish_rf(const mmq_args &a, unsigned int *counters, const mg_seg &seg, int bx,
                                              int row0, int tok0, int btok, int ntb, const float (&acc)[RF][NT][4]) {
    const int lane = threadIdx.x % 32, g = lane >> 2, t = lane & 3, n = a.n, rows = seg.rows;
    float *part = NULL;
    if (gridDim.y > 1) {
        size_t p0 = a.part0[0];
#pragma unroll
        for (int k = 1; k < MG_MAX; k++)
            if (k < a.g.n && bx >= a.g.blk0[k]) p0 = a.part0[k];
        part = a.part + p0 + (size_t)blockIdx.y * n * rows;
    }
    float *const dst = gridDim.y > 1 ? part : seg.out;
#pragma unroll
    for (int f = 0; f < RF; f++)
#pragma unroll
        for (int nt = 0; nt < NT; nt++)
#pragma unroll
            for (int e = 0; e < 4; e++) {
                const int tok = tok0 + nt * 8 + 2 * t + (e & 1), row = row0 + 16 * f + g + 8 * (e >> 1);
                if (tok < n && row < rows) dst[(size_t)tok * rows + row] = acc[f][nt][e];
            }
    if (gridDim.y == 1) return;
    part -= (size_t)blockIdx.y * n * rows;
    __shared__ unsigned int last;
    __threadfence(); /* partials visible before the arrival is counted */
    __syncthreads();
    if (threadIdx.x == 0) {
        const unsigned int prev = atomicAdd(&counters[blockIdx.x], 1u);
        last = prev == gridDim.y - 1;
        if (last) counters[blockIdx.x] = 0;
    }
    __syncthreads();
    if (!last) return;
    __threadfence();
    /* Four sums a thread at a time, all their loads issued before the
     * first add: the L2 trips overlap instead of following each other. */
    const int rbase = (bx - seg.u0) * MMQ_ROWS, ks = (int)gridDim.y, total = min(ntb, n - btok) * MMQ_ROWS;
    const size_t kstep = (size_t)n * rows;
    for (int i0 = threadIdx.x; i0 < total; i0 += 4 * blockDim.x) {
        size_t at[4];
        bool in[4];
#pragma unroll
        for (int u = 0; u < 4; u++) {
            const int i = i0 + u * blockDim.x, tok = btok + i / MMQ_ROWS, row = rbase + i % MMQ_ROWS;
            in[u] = i < total && row < rows;
            at[u] = (size_t)tok * rows + row;
        }
        float l[MMQ_SPLIT_MAX][4];
#pragma unroll
        for (int k = 0; k < MMQ_SPLIT_MAX; k++)
#pragma unroll
            for (int u = 0; u < 4; u++) l[k][u] = k < ks && in[u] ? __ldcg(part + k * kstep + at[u]) : 0.0f;
#pragma unroll
        for (int u = 0; u < 4; u++) {
            float v = 0.0f;
#pragma unroll
            for (int k = 0; k < MMQ_SPLIT_MAX; k++)
                if (k < ks) v += l[k][u];
            if (in[u]) seg.out[at[u]] = v;
        }
    }
}
/* This thread's part of the block's activations of a chunk, tokens tok0 ..
 * tok0 + 8 NT (clamped to n - 1): NT 16-byte pieces of the codes, and for
 * threads below 8 NT one token's scale and sums.  Loaded a chunk ahead into
 * registers, stored to shared memory after the present chunk.  Piece k of
 * thread i is 16-byte piece mmq_x_piece(i) of token mmq_x_tok(i) + 8 k:
 * a warp reads two whole token rows, and each 8 threads in a row store
 * the same 4 pieces of two tokens, 320 bytes apart, on distinct banks.
 * Where they lie in a chunk's n x 256 codes (off), and in the block's
 * staged copy (st: piece k at st + 8 k MMQ_XS), is worked out once. */
__device__ __forceinline__ int mmq_x_tok(int i) { return 2 * (i / 32) + i / 4 % 2; }
__device__ __forceinline__ int mmq_x_piece(int i) { return i / 8 % 4 * 4 + i % 4; }
__device__ __forceinline__ int mmq_x_st(int i) {
    return mmq_x_tok(i) * MMQ_XS + mmq_x_piece(i) / 4 * MMQ_XL + mmq_x_piece(i) % 4 * 16;
}
template <int NT> struct mmq_xsrc {
    int off[NT], st, bd;
    __device__ __forceinline__ void init(int n, int tok0) {
        const int tid = threadIdx.x;
#pragma unroll
        for (int k = 0; k < NT; k++) off[k] = min(tok0 + mmq_x_tok(tid) + 8 * k, n - 1) * 256 + mmq_x_piece(tid) * 16;
        st = mmq_x_st(tid);
        bd = min(tok0 + tid, n - 1);
    }
    __device__ __forceinline__ void load(const mmq_act &x, int n, int s, uint4 (&px)[NT], float &pd,
                                         uint4 &pb) const {
        const int8_t *xs = x.xq + (size_t)s * n * 256;
#pragma unroll
        for (int k = 0; k < NT; k++) px[k] = __ldg((const uint4 *)(xs + off[k]));
        if ((int)threadIdx.x < 8 * NT) {
            const size_t bi = (size_t)s * n + bd;
            pd = __ldg(x.xd + bi);
            pb = __ldg((const uint4 *)(x.xb + bi * 8));
        }
    }
};
/* The min term's B words of a token (mmq_chunk): word t the F16 pair
 * dx x sum_j / 32 of blocks j = 2 t, 2 t + 1 (the mean, which F16 holds
 * wherever the activations themselves fit it). */
__device__ __forceinline__ uint32_t mmq_min_b(float dx, uint32_t sums) {
    const float s = dx * (1.0f / 32.0f);
    return mq_u32(__floats2half2_rn(s * (float)(int16_t)(sums & 0xFFFFu), s * (float)((int)sums >> 16)));
}
template <int NT, bool MIN>
__device__ __forceinline__ void mmq_x_store(int8_t *sxq, float *sxd, uint4 *sxm, const uint4 (&px)[NT], float pd,
                                            uint4 pb, int st) {
#pragma unroll
    for (int k = 0; k < NT; k++) *(uint4 *)(sxq + st + 8 * k * MMQ_XS) = px[k];
    if ((int)threadIdx.x < 8 * NT) {
        sxd[threadIdx.x] = pd;
        if constexpr (MIN)
            sxm[threadIdx.x] = make_uint4(mmq_min_b(pd, pb.x), mmq_min_b(pd, pb.y), mmq_min_b(pd, pb.z),
                                          mmq_min_b(pd, pb.w));
    }
}

/* Q4_K's kernel of 32 x 32 warp tiles (matmul_mmq_tile.cu), with the
 * dynamic shared memory it takes in *smem. */
void (*mmq_tile_kernel_q4k(size_t *smem))(const mmq_args);

#endif
