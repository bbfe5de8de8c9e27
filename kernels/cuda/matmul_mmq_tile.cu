/* Q4_K at 33-64 tokens on int8 tensor cores in 32 x 32 warp tiles, sm_80
 * and later (cp.async); matmul_mmq.cu routes and launches it
 * (LLM_CUDA_MMQ_TILE) and holds the rest of the method: the activations'
 * Q8K form, the permuted k order, the int32 sums a scale and the min term
 * on an F16 mma, which this kernel shares through mmq.cuh.
 *
 * A block of 4 warps takes 64 rows and 64 tokens, each warp 32 rows (two
 * fragments of 16) by 32 tokens (4 tiles), so that every activation
 * fragment it reads serves two weight fragments and every weight fragment
 * four token tiles.  The block copies its 64 rows' chunks into a ring of
 * S stages in shared memory with cp.async (sm_80+), 16 bytes a copy and
 * each row's 144 bytes as they lie, S - 1 chunks ahead of its work; the
 * activations go through registers a chunk ahead, as matmul_mmq.cu's
 * kernels stage them. */
#include "mmq.cuh"

static __device__ unsigned int mmq_tile_counters[MMQ_COUNTERS];

/* The block's shapes: a row's chunk is PC 16-byte pieces, rows SB bytes
 * apart in a stage, which puts the fragment loads of a half-warp (rows
 * g = 0 .. 3, 8-byte pieces 8 t) on distinct banks (SB / 4 mod 32 is 8);
 * S stages of W bytes, then two activation buffers. */
template <int T> struct mmq_tile {
    static_assert(T == DTYPE_Q4_K, "Q4_K only");
    static constexpr int BY = mmq_wk<T>::BYTES, PC = BY / 16, SB = 160, TOK = 64, S = 4;
    static constexpr int NP = (MMQ_ROWS * PC + MMQ_WARPS * 32 - 1) / (MMQ_WARPS * 32); /* pieces a thread */
    static constexpr size_t W = (size_t)MMQ_ROWS * SB, X = (size_t)TOK * MMQ_XS;
    static constexpr size_t SMEM = S * W + 2 * (X + TOK * sizeof(float) + TOK * sizeof(uint4));
};

/* One chunk of a warp's 32 rows (sw: its first row's copy) against its 4
 * tiles of 8 tokens (sxq, sxd, sxm from its first token), as mmq_chunk. */
template <int T>
__device__ __forceinline__ void mmq_tile_chunk(const uint8_t *sw, const int8_t *sxq, const float *sxd,
                                               const uint4 *sxm, int g, int t, float (&acc)[2][4][4]) {
    constexpr int NT = 4, SB = mmq_tile<T>::SB;
    mmq_w<T> w[2][2]; /* [fragment][row g, g + 8] */
#pragma unroll
    for (int f = 0; f < 2; f++)
#pragma unroll
        for (int h = 0; h < 2; h++) w[f][h].h = *(const uint4 *)(sw + (16 * f + 8 * h + g) * SB);
    int isum[2][NT][4];
#pragma unroll
    for (int f = 0; f < 2; f++)
#pragma unroll
        for (int nt = 0; nt < NT; nt++)
#pragma unroll
            for (int e = 0; e < 4; e++) isum[f][nt][e] = 0;
    const int8_t *xs = sxq + t * MMQ_XL;
#pragma unroll
    for (int p = 0; p < 4; p++) {
        uint32_t fa[2][2][4];
        int sc[2][2][2];
#pragma unroll
        for (int f = 0; f < 2; f++) {
#pragma unroll
            for (int h = 0; h < 2; h++) {
                const uint2 v = *(const uint2 *)(sw + (16 * f + 8 * h + g) * SB + mmq_wk<T>::QS + 32 * p + 8 * t);
                w[f][h].lo[p] = v.x;
                w[f][h].hi[p] = v.y;
            }
#pragma unroll
            for (int k = 0; k < 2; k++) {
                w[f][0].codes(p, k, fa[f][k][0], fa[f][k][2]);
                w[f][1].codes(p, k, fa[f][k][1], fa[f][k][3]);
                sc[f][k][0] = w[f][0].sci(2 * p + k);
                sc[f][k][1] = w[f][1].sci(2 * p + k);
            }
        }
#pragma unroll
        for (int nt = 0; nt < NT; nt++) {
            const uint4 b = *(const uint4 *)(xs + (nt * 8 + g) * MMQ_XS + 16 * p);
#pragma unroll
            for (int k = 0; k < 2; k++)
#pragma unroll
                for (int f = 0; f < 2; f++) {
                    int c[4] = {0, 0, 0, 0};
                    mmq_mma_k32(c, fa[f][k], k == 0 ? b.x : b.z, k == 0 ? b.y : b.w);
#pragma unroll
                    for (int e = 0; e < 4; e++) isum[f][nt][e] += sc[f][k][e >> 1] * c[e];
                }
        }
    }
#pragma unroll
    for (int f = 0; f < 2; f++) mmq_scale_add<T, NT>(w[f], isum[f], sxd, sxm, g, t, acc[f]);
}

/* The block's 64 rows by (up to) 64 tokens; warp w takes rows 32 (w & 1)
 * and tokens 32 (w >> 1).  One barrier a chunk: after it, chunk s's
 * weights and activations are in shared memory and every warp is done
 * with chunk s - 1, whose weight stage then takes chunk s + S - 1 and
 * whose activation buffer chunk s + 1's, stored after chunk s. */
template <int T>
__global__ void __launch_bounds__(MMQ_WARPS * 32, 2) matmul_mmq_tile_kernel(const mmq_args a) {
    using TL = mmq_tile<T>;
    extern __shared__ __align__(16) uint8_t mmq_smem[];
    uint8_t *const sw0 = mmq_smem;
    int8_t *const sx0 = (int8_t *)(mmq_smem + TL::S * TL::W);
    float *const sd0 = (float *)(sx0 + 2 * TL::X);
    uint4 *const sm0 = (uint4 *)(sd0 + 2 * TL::TOK);
    const int warp = threadIdx.x / 32, lane = threadIdx.x % 32, g = lane >> 2, t = lane & 3;
    const int wr = warp & 1, wc = warp >> 1, bx = blockIdx.x, n = a.n;
    const mg_seg seg = mg_seg_locate(a.g, bx);
    const int rbase = (bx - seg.u0) * MMQ_ROWS, s0 = blockIdx.y * a.sps, s1 = min(a.n_sb, s0 + a.sps);
    /* This thread's 16-byte pieces of the block's rows (rows past the
     * weight: its last) in chunk 0, and where they go in a stage. */
    const uint8_t *src[TL::NP];
    int dst[TL::NP];
    const bool tail = threadIdx.x + (TL::NP - 1) * MMQ_WARPS * 32 < MMQ_ROWS * TL::PC;
#pragma unroll
    for (int k = 0; k < TL::NP; k++) {
        const int i = min((int)threadIdx.x + k * MMQ_WARPS * 32, MMQ_ROWS * TL::PC - 1), r = i / TL::PC,
                  q = i % TL::PC;
        src[k] = seg.w + (size_t)min(rbase + r, seg.rows - 1) * a.rb + 16 * q;
        dst[k] = r * TL::SB + 16 * q;
    }
    /* Chunk s's copies into its stage, if there is such a chunk; a group
     * either way, so that the groups count chunks. */
    const auto wcopy = [&](int s) {
        if (s < s1) {
            uint8_t *st = sw0 + (s - s0) % TL::S * TL::W;
#pragma unroll
            for (int k = 0; k < TL::NP; k++)
                if (k < TL::NP - 1 || tail) cp_async16(st + dst[k], src[k] + (size_t)s * TL::BY);
        }
        cp_async_commit();
    };
    float acc[2][4][4];
#pragma unroll
    for (int f = 0; f < 2; f++)
#pragma unroll
        for (int nt = 0; nt < 4; nt++)
#pragma unroll
            for (int e = 0; e < 4; e++) acc[f][nt][e] = 0.0f;
    mmq_xsrc<8> xsrc;
    xsrc.init(n, 0);
    uint4 px[8], pb = make_uint4(0, 0, 0, 0);
    float pd = 0.0f;
    /* The weights before the wait, the activations after (the kernel above). */
#pragma unroll
    for (int k = 0; k < TL::S - 1; k++) wcopy(s0 + k);
    pdl_begin();
    if (s0 < s1) {
        xsrc.load(a.a, n, s0, px, pd, pb);
        mmq_x_store<8, true>(sx0, sd0, sm0, px, pd, pb, xsrc.st);
    }
    for (int s = s0; s < s1; s++) {
        const int buf = (s - s0) & 1;
        cp_async_wait<TL::S - 2>(); /* chunk s's copies (this thread's) have landed */
        __syncthreads();
        wcopy(s + TL::S - 1);
        if (s + 1 < s1) xsrc.load(a.a, n, s + 1, px, pd, pb);
        mmq_tile_chunk<T>(sw0 + (s - s0) % TL::S * TL::W + 32 * wr * TL::SB, sx0 + buf * TL::X + 32 * wc * MMQ_XS,
                          sd0 + buf * TL::TOK + 32 * wc, sm0 + buf * TL::TOK + 32 * wc, g, t, acc);
        if (s + 1 < s1)
            mmq_x_store<8, true>(sx0 + (buf ^ 1) * TL::X, sd0 + (buf ^ 1) * TL::TOK, sm0 + (buf ^ 1) * TL::TOK, px,
                                 pd, pb, xsrc.st);
    }
    mmq_finish_rf<4, 2>(a, mmq_tile_counters, seg, bx, rbase + 32 * wr, 32 * wc, 0, TL::TOK, acc);
}

void (*mmq_tile_kernel_q4k(size_t *smem))(const mmq_args) {
    *smem = mmq_tile<DTYPE_Q4_K>::SMEM;
    return matmul_mmq_tile_kernel<DTYPE_Q4_K>;
}
