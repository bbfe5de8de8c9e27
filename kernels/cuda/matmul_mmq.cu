/* Batched K-quant matmul on int8 tensor cores ("mmq"): out[n, rows] =
 * x[n, cols] . w^T for Q4_K, Q5_K and Q6_K weights at up to 64 tokens.
 *
 * The activations are quantized once per input, as the CPU backend does
 * for these types (Q8K: int8 codes with one scale per 256 columns and the
 * sums of each 32 codes), and stored so that a lane's mma B fragments for
 * a 256-column chunk are 64 contiguous bytes.  For Q4_K and Q5_K the k
 * order of every mma is permuted (the same for A and B) so that lane t's
 * A fragments of a row are the 8 contiguous code bytes 8t .. 8t + 7 of
 * each 32 (an 8-byte load, and the 4 lanes of a row read one whole
 * sector); Q6_K's 16-column scales keep the order of the PTX ISA, its
 * rows regrouped for it at load.  The weights are read once;
 * their codes are the int8 operands as stored (Q6_K less 32), so decoding
 * is a mask and a shift per 4 weights.  Each mma covers one scale's
 * columns (k32 for Q4_K/Q5_K's 32, k16 for Q6_K's 16); its int32 sum times
 * the row's integer scale is added up in int32 over the chunk, which is
 * then scaled by d and the activation scale; the K-quants' min term
 * (dmin * m_j times the activations' 32-sums) is one F16 mma m16n8k8 a
 * tile and chunk, over the chunk's 8 blocks.  m16n8k32 /
 * m16n8k16 on sm_80 and later, four / two m8n8k16 on sm_75: the
 * fragments' registers are the same.
 *
 * A block is MMQ_WARPS warps of 16 rows each on one K range, its tokens'
 * activations of a chunk staged in shared memory a chunk ahead, and the
 * next chunk's weights are loaded into registers while the present one
 * multiplies: each lane its fragments straight from memory, except Q6_K's
 * up to LLM_CUDA_MMQ_STAGE tiles of 8 tokens (16 tokens by default),
 * whose 16 rows the warp loads in 16-byte pieces that go through shared
 * memory to the fragments (mmq_stage); when the row blocks cannot fill the GPU, K is split over
 * gridDim.y blocks, each writes partial sums and the last to finish adds
 * them in split order (an arrival counter per row block, reset by that
 * block), so the result is the same bits every run.  Several weights on
 * one input (q, k, v; gate and up) are one launch.  Q4_K from 33 or 49
 * tokens (cuda_mmq_tile_takes) goes to matmul_mmq_tile.cu's 32 x 32 warp
 * tiles on sm_80+; what the two share is in mmq.cuh. */
#include "act_q8.cuh"
#include "knobs.h"
#include "mmq.cuh"

#include <stdio.h>
#include <stdlib.h>

#define MMQ_NT_MAX 64
#define MMQ_MIN_BLOCKS 3
#define MMQ_STAGE_MAX 4 /* tiles a warp with Q6_K's staged copy at most (LLM_CUDA_MMQ_STAGE) */

static __device__ unsigned int mmq_counters[MMQ_COUNTERS];

/* A warp per (chunk, token). */
template <bool K8>
__global__ void mmq_quant_kernel(const float *__restrict__ x, int8_t *__restrict__ xq, float *__restrict__ xd,
                                 int16_t *__restrict__ xb, int n, int cols, int items) {
    pdl_begin();
    const int item = blockIdx.x * (blockDim.x / 32) + threadIdx.x / 32, lane = threadIdx.x % 32;
    if (item >= items) return;
    const int s = item / n, c = item % n;
    act_q8k_chunk<K8>(x + (size_t)c * cols + (size_t)s * 256, lane, (size_t)s * n + c, xq, xd, xb);
}

/* Q6_K in the backend's regrouped rows (common.cuh): for half h of the
 * chunk, ql words 64 h + 16 k + 4 t (k < 4) and qh words 32 h + 16 k + 4 t
 * (k < 2); 16 scale bytes; d.  Pair p is h = p / 2, quarters 2 (p & 1)
 * and 2 (p & 1) + 1; quarter q's 32 columns are 128 h + 32 q .., its
 * halves' scales 8 h + 2 q and 8 h + 2 q + 1. */
template <> struct mmq_w<DTYPE_Q6_K> {
    static constexpr bool MIN = false;
    static constexpr int KPP = 4;
    uint32_t L[8], H[4];
    uint4 scb;
    uint32_t dh;

    __device__ __forceinline__ void load(const uint8_t *row, int s, int t, int64_t cols) {
        const uint8_t *ql = row + (size_t)s * 128, *qh = row + q6s_qh_off(cols) + (size_t)s * 64;
#pragma unroll
        for (int k = 0; k < 8; k++) L[k] = mmq_ld32(ql + 16 * k + 4 * t);
#pragma unroll
        for (int k = 0; k < 4; k++) H[k] = mmq_ld32(qh + 16 * k + 4 * t);
        scb = __ldg((const uint4 *)(row + q6s_sc_off(cols) + (size_t)s * 16));
        dh = __ldg((const unsigned short *)(row + q6s_d_off(cols)) + s);
    }
    /* The same from the warp's staged copy (b: ql's 128 bytes, qh's 64,
     * the 16 scales; mmq_stage), d from the row in memory. */
    __device__ __forceinline__ void load_s(const uint8_t *b, int t) {
#pragma unroll
        for (int k = 0; k < 8; k++) L[k] = *(const uint32_t *)(b + 16 * k + 4 * t);
#pragma unroll
        for (int k = 0; k < 4; k++) H[k] = *(const uint32_t *)(b + 128 + 16 * k + 4 * t);
        scb = *(const uint4 *)(b + 192);
    }
    /* Quarter q of half h, column half e: codes less 32, as int8. */
    __device__ __forceinline__ uint32_t codes(int h, int q, int e) const {
        const uint32_t l = L[4 * h + 2 * (q & 1) + e], hb = H[2 * h + e];
        const uint32_t v = ((l >> (4 * (q >> 1))) & 0x0F0F0F0Fu) | (((hb >> (2 * q)) & 0x03030303u) << 4);
        return __vsub4(v, 0x20202020u);
    }
    __device__ __forceinline__ float d() const { return __half2float(__ushort_as_half((unsigned short)dh)); }
    __device__ __forceinline__ uint32_t scw(int k) const {
        return k == 0 ? scb.x : k == 1 ? scb.y : k == 2 ? scb.z : scb.w;
    }
    /* Signed scale byte k of word p: one prmt, whose selector's sign bit
     * (which __byte_perm masks off) repeats the byte's sign. */
    __device__ __forceinline__ int sci(int p, int k) const {
        int r;
        asm("prmt.b32 %0, %1, 0, %2;" : "=r"(r) : "r"(scw(p)), "r"(k | (8 | k) << 4 | (8 | k) << 8 | (8 | k) << 12));
        return r;
    }
};

/* A warp's Q6_K weights of a chunk staged in shared memory: its 16 rows'
 * ql, qh and scales of the chunk (d stays in the row), copied with 16-byte
 * loads, which read whole sectors in few requests, where the fragments'
 * own 4-byte loads (8 rows a load, half of each sector) kept the L1 pipe
 * 88% busy at a third of the copy rate (7B gate/up, 8 tokens, Nsight
 * Compute).  Up to 16 tokens it measures faster on sm_90 and on the T4's
 * code, from 32 no faster (registers spill there): hence
 * LLM_CUDA_MMQ_STAGE's default (docs/cuda-backend.md).  Row stride WB:
 * the fragment loads of 8 rows fall on distinct banks (WB / 4 mod 32 is
 * 20).  Q4_K and Q5_K need no copy: their permuted order gives each lane
 * whole 8-byte pieces, and the 4 lanes of a row whole sectors. */
template <int T> struct mmq_stage {
    static_assert(T == DTYPE_Q6_K, "only Q6_K's fragments are staged");
    static constexpr int WB = 208;
    static constexpr int P = WB / 16;                 /* 16-byte parts of a row's chunk */
    static constexpr int PER_LANE = (16 * P + 31) / 32;
    /* Part q of a row's chunk 0 (offset in the row) and the step to chunk 1. */
    __device__ static inline void part(int q, int64_t cols, size_t &o0, uint32_t &step) {
        if (q < 8) {
            o0 = (size_t)16 * q;
            step = 128;
        } else if (q < 12) {
            o0 = q6s_qh_off(cols) + (size_t)16 * (q - 8);
            step = 64;
        } else {
            o0 = q6s_sc_off(cols);
            step = 16;
        }
    }
};

/* This lane's parts of the warp's 16 rows (from row0, clamped to the last
 * row): where each starts and its step a chunk; parts past the last are
 * marked by a null pointer. */
template <int T> struct mmq_stager {
    using S = mmq_stage<T>;
    const uint8_t *src[S::PER_LANE];
    uint32_t step[S::PER_LANE];
    uint4 v[S::PER_LANE];

    __device__ __forceinline__ void init(const uint8_t *w, size_t rb, int row0, int rows, int64_t cols, int lane) {
#pragma unroll
        for (int k = 0; k < S::PER_LANE; k++) {
            const int it = lane + 32 * k, i = it / S::P, q = it % S::P;
            size_t o0;
            mmq_stage<T>::part(q, cols, o0, step[k]);
            src[k] = it < 16 * S::P ? w + (size_t)min(row0 + i, rows - 1) * rb + o0 : nullptr;
        }
    }
    __device__ __forceinline__ void load(int s) {
#pragma unroll
        for (int k = 0; k < S::PER_LANE; k++)
            if (src[k]) v[k] = __ldg((const uint4 *)(src[k] + (size_t)s * step[k]));
    }
    /* Into sw (the warp's 16 rows of WB bytes). */
    __device__ __forceinline__ void store(uint8_t *sw, int lane) const {
#pragma unroll
        for (int k = 0; k < S::PER_LANE; k++) {
            const int it = lane + 32 * k;
            if (src[k]) *(uint4 *)(sw + (it / S::P) * S::WB + (it % S::P) * 16) = v[k];
        }
    }
};

/* Asks L2 for chunk s of the warp's 16 rows from row0 (rows past the
 * weight: its last): lanes 0-15 a row's first 128 bytes, 16-31 the next
 * 128 (Q6_K's regrouped rows: its ql, then its qh). */
template <int T>
__device__ __forceinline__ void mmq_prefetch(const uint8_t *w, size_t rb, int row0, int rows, int64_t cols, int s,
                                             int lane) {
    const uint8_t *row = w + (size_t)min(row0 + (lane & 15), rows - 1) * rb;
    if constexpr (T == DTYPE_Q6_K)
        l2_prefetch(lane < 16 ? row + 128 * (size_t)s : row + q6s_qh_off(cols) + 64 * (size_t)s);
    else
        l2_prefetch(row + (size_t)s * mmq_wk<T>::BYTES + (lane < 16 ? 0 : 128));
}

/* What a block's warp works on: the block's row block (bx) and the
 * weight it is in, its tokens from tok0 (tok tokens a block, blocks side by
 * side taking the halves above 32 tokens), the warp's 16 rows from row0 and
 * its two rows' weights (rows g and g + 8 of them, clamped to the
 * weight's last), and its split's chunks s0 .. s1. */
struct mmq_place {
    mg_seg seg;
    const uint8_t *w0, *w1;
    int bx, tok0, row0, s0, s1;
};
__device__ __forceinline__ mmq_place mmq_place_of(const mmq_args &a, int tok) {
    mmq_place p;
    const int warp = threadIdx.x / 32, g = (threadIdx.x % 32) >> 2;
    p.bx = (int)blockIdx.x / a.th;
    p.tok0 = tok * ((int)blockIdx.x % a.th);
    p.seg = mg_seg_locate(a.g, p.bx);
    p.row0 = (p.bx - p.seg.u0) * MMQ_ROWS + warp * 16;
    p.w0 = p.seg.w + (size_t)min(p.row0 + g, p.seg.rows - 1) * a.rb;
    p.w1 = p.seg.w + (size_t)min(p.row0 + g + 8, p.seg.rows - 1) * a.rb;
    p.s0 = blockIdx.y * a.sps;
    p.s1 = min(a.n_sb, p.s0 + a.sps);
    return p;
}

/* One chunk of a warp's two rows (cw) against NT tiles of 8 tokens whose
 * activations sxq (token rows of MMQ_XS bytes), sxd (scales) and sxm (the
 * min term's B words, mmq_x_store) hold.  Each mma's int32 sum is
 * multiplied by its row's integer scale and added up in int32 over the
 * chunk (|sum| < 2^27 for every type), which then is scaled once by d and
 * the token's scale; the min term goes on tensor cores too. */
template <int T, int NT>
__device__ __forceinline__ void mmq_chunk(const mmq_w<T> (&cw)[2], const int8_t *sxq, const float *sxd,
                                          const uint4 *sxm, int g, int t, float (&acc)[NT][4]) {
    int isum[NT][4];
#pragma unroll
    for (int nt = 0; nt < NT; nt++)
#pragma unroll
        for (int e = 0; e < 4; e++) isum[nt][e] = 0;
    const int8_t *xs = sxq + t * MMQ_XL;
#pragma unroll
    for (int p = 0; p < 4; p++) {
        uint32_t fa[mmq_w<T>::KPP][4];
        int sc[mmq_w<T>::KPP][2];
        if constexpr (T == DTYPE_Q6_K) {
            const int h = p >> 1;
#pragma unroll
            for (int k = 0; k < 4; k++) { /* quarter 2 (p & 1) + k / 2, column half k & 1 */
                /* Its scale is 8 h + 2 q + e = 4 p + k, as its activation word. */
                const int q = 2 * (p & 1) + (k >> 1), e = k & 1;
                fa[k][0] = cw[0].codes(h, q, e);
                fa[k][1] = cw[1].codes(h, q, e);
                sc[k][0] = cw[0].sci(p, k);
                sc[k][1] = cw[1].sci(p, k);
            }
        } else {
#pragma unroll
            for (int k = 0; k < 2; k++) {
                cw[0].codes(p, k, fa[k][0], fa[k][2]);
                cw[1].codes(p, k, fa[k][1], fa[k][3]);
                sc[k][0] = cw[0].sci(2 * p + k);
                sc[k][1] = cw[1].sci(2 * p + k);
            }
        }
#pragma unroll
        for (int nt = 0; nt < NT; nt++) {
            const uint4 b = *(const uint4 *)(xs + (nt * 8 + g) * MMQ_XS + 16 * p);
#pragma unroll
            for (int k = 0; k < mmq_w<T>::KPP; k++) {
                int c[4] = {0, 0, 0, 0};
                if constexpr (T == DTYPE_Q6_K) {
                    const uint32_t bw = k == 0 ? b.x : k == 1 ? b.y : k == 2 ? b.z : b.w;
                    mmq_mma_k16(c, fa[k][0], fa[k][1], bw);
                } else {
                    mmq_mma_k32(c, fa[k], k == 0 ? b.x : b.z, k == 0 ? b.y : b.w);
                }
#pragma unroll
                for (int e = 0; e < 4; e++) isum[nt][e] += sc[k][e >> 1] * c[e];
            }
        }
    }
    mmq_scale_add<T, NT>(cw, isum, sxd, sxm, g, t, acc);
}

/* The block's sums to out (mmq_finish_rf): a warp's 16 rows from row0, NT
 * tiles from tok0. */
template <int NT>
__device__ __forceinline__ void mmq_finish(const mmq_args &a, const mg_seg &seg, int bx, int row0, int tok0,
                                           const float (&acc)[NT][4]) {
    mmq_finish_rf<NT, 1>(a, mmq_counters, seg, bx, row0, tok0, tok0, 8 * NT,
                         reinterpret_cast<const float(&)[1][NT][4]>(acc));
}

template <int NT>
__device__ __forceinline__ void mmq_x_load(const mmq_act &x, int n, int s, int tok0, uint4 (&px)[NT], float &pd,
                                           uint4 &pb) {
    mmq_xsrc<NT> src;
    src.init(n, tok0);
    src.load(x, n, s, px, pd, pb);
}
/* NT tiles of 8 tokens a warp, from token tok0 = 8 NT (blockIdx.x % th):
 * above 32 tokens two blocks side by side in the grid take the two
 * halves of the tokens of one row block, so that neither holds 64 sums a
 * lane, and the second reads the weights from L2 as the first brings
 * them in.  The rows' next chunk is loaded into registers while the
 * present one multiplies: with ST (Q6_K only) the warp's 16 rows in
 * 16-byte pieces, stored to its shared-memory copy after the chunk
 * (mmq_stage), else each lane's own fragments, Q4_K's and Q5_K's into two
 * register sets that take turns (Q6_K's, copied, spill less).  Each
 * lane's weight and activation addresses are worked out once and
 * advanced a chunk at a time. */
template <int T, int NT, bool ST>
__global__ void __launch_bounds__(MMQ_WARPS * 32, T != DTYPE_Q6_K && NT <= 2 ? 4 : NT <= 4 ? MMQ_MIN_BLOCKS : 2)
    matmul_mmq_kernel(const mmq_args a) {
    const mmq_place pl = mmq_place_of(a, 8 * NT);
    const int warp = threadIdx.x / 32, lane = threadIdx.x % 32, g = lane >> 2, t = lane & 3;
    const int bx = pl.bx, tok0 = pl.tok0, row0 = pl.row0, n = a.n, s0 = pl.s0, s1 = pl.s1;
    const mg_seg seg = pl.seg;
    const size_t rb = a.rb;
    const uint8_t *w0 = pl.w0, *w1 = pl.w1;

    float acc[NT][4];
#pragma unroll
    for (int nt = 0; nt < NT; nt++)
#pragma unroll
        for (int e = 0; e < 4; e++) acc[nt][e] = 0.0f;

    /* The block's activations of a chunk, staged in shared memory (two
     * buffers): token rows of MMQ_XS bytes (MMQ_XL), scales, the min
     * term's words (mmq_x_store). */
    constexpr int TOK = 8 * NT;
    __shared__ __align__(16) int8_t sxq[2][TOK * MMQ_XS];
    __shared__ float sxd[2][TOK];
    __shared__ __align__(16) uint4 sxm[2][TOK];
    /* ST: each warp's weights of a chunk (mmq_stage). */
    static_assert(!ST || T == DTYPE_Q6_K, "only Q6_K's fragments are staged");
    __shared__ __align__(16) uint8_t sw[ST ? MMQ_WARPS : 1][ST ? 16 * mmq_stage<DTYPE_Q6_K>::WB : 16];
    uint8_t *const mw = sw[ST ? warp : 0];
    mmq_stager<DTYPE_Q6_K> stg;
    uint4 px[NT], pb = make_uint4(0, 0, 0, 0);
    float pd = 0.0f;
    /* Two register sets of the rows' weights taking turns (the loop
     * unrolled by two): chunk s multiplies from one while chunk s + 1
     * loads into the other. */
    mmq_w<T> wa[2], wb[2];
    /* Q4_K and Q5_K: the next chunk's first bytes, a pointer a row. */
    const uint8_t *nx0 = w0, *nx1 = w1;
    if constexpr (T != DTYPE_Q6_K) {
        nx0 += (size_t)(s0 + 1) * mmq_wk<T>::BYTES;
        nx1 += (size_t)(s0 + 1) * mmq_wk<T>::BYTES;
    }
    mmq_xsrc<NT> xsrc;
    xsrc.init(n, tok0);
    /* Q6_K's d of the two rows, which the staged copy leaves out. */
    const auto load_d = [&](int s, mmq_w<T>(&w)[2]) {
        if constexpr (T == DTYPE_Q6_K) {
            w[0].dh = __ldg((const unsigned short *)(w0 + q6s_d_off(a.cols)) + s);
            w[1].dh = __ldg((const unsigned short *)(w1 + q6s_d_off(a.cols)) + s);
        }
    };
    if (s0 < s1) {
        if constexpr (ST) {
            stg.init(seg.w, rb, row0, seg.rows, a.cols, lane);
            stg.load(s0);
            stg.store(mw, lane);
            __syncwarp();
            wa[0].load_s(mw + g * mmq_stage<T>::WB, t);
            wa[1].load_s(mw + (g + 8) * mmq_stage<T>::WB, t);
            load_d(s0, wa);
        } else {
            wa[0].load(w0, s0, t, a.cols);
            wa[1].load(w1, s0, t, a.cols);
        }
        if constexpr (NT <= 2)
            for (int k = 2; k <= a.ahead && s0 + k < s1; k++)
                mmq_prefetch<T>(seg.w, rb, row0, seg.rows, a.cols, s0 + k, lane);
    }
    /* The weights are no kernel's output: their first chunk was asked for
     * before the wait, so that its trip overlaps the end of the kernel
     * before.  The activations are one's, so they are loaded after it. */
    pdl_begin();
    if (s0 < s1) {
        xsrc.load(a.a, n, s0, px, pd, pb);
        mmq_x_store<NT, mmq_w<T>::MIN>(sxq[0], sxd[0], sxm[0], px, pd, pb, xsrc.st);
    }
    __syncthreads();
    /* Chunk s from cur; the next chunk's weights into fill (with ST: its
     * staged copy, into fill after the chunk) and activations into px,
     * stored to the other buffer after the chunk. */
    const auto step = [&](int s, const mmq_w<T>(&cur)[2], mmq_w<T>(&fill)[2]) {
        const int buf = (s - s0) & 1;
        /* The weights' chunk a.ahead past the next one asked of L2, up to
         * 16 tokens: above, the code it adds measured slower (sm_75's
         * 64-token steps) than the latency it hides. */
        if constexpr (NT <= 2)
            if (a.ahead > 0 && s + 1 + a.ahead < s1)
                mmq_prefetch<T>(seg.w, rb, row0, seg.rows, a.cols, s + 1 + a.ahead, lane);
        if (s + 1 < s1) {
            if constexpr (ST) {
                stg.load(s + 1);
                load_d(s + 1, fill);
            } else if constexpr (T == DTYPE_Q6_K) {
                fill[0].load(w0, s + 1, t, a.cols);
                fill[1].load(w1, s + 1, t, a.cols);
            } else {
                fill[0].load_at(nx0, t);
                fill[1].load_at(nx1, t);
                nx0 += mmq_wk<T>::BYTES;
                nx1 += mmq_wk<T>::BYTES;
            }
            xsrc.load(a.a, n, s + 1, px, pd, pb);
        }
        mmq_chunk<T, NT>(cur, sxq[buf], sxd[buf], sxm[buf], g, t, acc);
        if (s + 1 < s1) {
            if constexpr (ST) {
                /* Every lane has its fragments of this chunk in registers. */
                __syncwarp();
                stg.store(mw, lane);
                __syncwarp();
                fill[0].load_s(mw + g * mmq_stage<T>::WB, t);
                fill[1].load_s(mw + (g + 8) * mmq_stage<T>::WB, t);
            }
            /* The other buffer was last read a chunk ago, before the
             * barrier that ended it. */
            mmq_x_store<NT, mmq_w<T>::MIN>(sxq[buf ^ 1], sxd[buf ^ 1], sxm[buf ^ 1], px, pd, pb, xsrc.st);
        }
        __syncthreads();
    };
    if constexpr (T == DTYPE_Q6_K) { /* (its two sets in turn spill) */
        for (int s = s0; s < s1; s++) {
            step(s, wa, wb);
            wa[0] = wb[0];
            wa[1] = wb[1];
        }
    } else {
        for (int s = s0; s < s1; s += 2) {
            step(s, wa, wb);
            if (s + 1 >= s1) break;
            step(s + 1, wb, wa);
        }
    }
    mmq_finish<NT>(a, seg, bx, row0, tok0, acc);
}

/* The same for Q4_K and Q5_K up to 8 tokens with each chunk's weights
 * and activations loaded two chunks ahead, into three register sets that
 * take turns (the loop unrolled by three, so that no set is copied while
 * its loads are in flight): a load then has two chunks' work to arrive in,
 * where the kernel above waits for it at the end of the next chunk.  It
 * takes 162-166 registers, three blocks a multiprocessor where the plain
 * kernel has four: mmq_launch_nt gives it the launches whose row blocks
 * fit one wave of those (LLM_CUDA_MMQ_DEPTH).  It asks L2 for nothing
 * ahead (LLM_CUDA_L2_AHEAD): with two chunks in flight that measured
 * slower. */
template <int T, int NT>
__global__ void __launch_bounds__(MMQ_WARPS * 32, MMQ_MIN_BLOCKS) matmul_mmq_deep_kernel(const mmq_args a) {
    static_assert(T != DTYPE_Q6_K && NT == 1, "Q4_K and Q5_K up to 8 tokens");
    const mmq_place pl = mmq_place_of(a, 8 * NT);
    const int lane = threadIdx.x % 32, t = lane & 3;
    float acc[NT][4] = {};
    /* The activations of two chunks, as the kernel above stages them. */
    __shared__ __align__(16) int8_t sxq[2][8 * NT * MMQ_XS];
    __shared__ float sxd[2][8 * NT];
    __shared__ __align__(16) uint4 sxm[2][8 * NT];
    /* Register sets A, B, C: chunk s0 + 3i + k in set k. */
    mmq_w<T> wa[2], wb[2], wc[2];
    uint4 xa[NT], xb[NT], xc[NT], ba = make_uint4(0, 0, 0, 0), bb = ba, bc = ba;
    float da = 0.0f, db = 0.0f, dc = 0.0f;
    const auto wload = [&](int s, mmq_w<T>(&w)[2]) {
        w[0].load(pl.w0, s, t, a.cols);
        w[1].load(pl.w1, s, t, a.cols);
    };
    const auto load = [&](int s, mmq_w<T>(&w)[2], uint4(&px)[NT], float &pd, uint4 &pb) {
        wload(s, w);
        mmq_x_load<NT>(a.a, a.n, s, pl.tok0, px, pd, pb);
    };
    /* The first two chunks' weights before the wait (the kernel above). */
    if (pl.s0 < pl.s1) wload(pl.s0, wa);
    if (pl.s0 + 1 < pl.s1) wload(pl.s0 + 1, wb);
    pdl_begin();
    if (pl.s0 < pl.s1) {
        mmq_x_load<NT>(a.a, a.n, pl.s0, pl.tok0, xa, da, ba);
        mmq_x_store<NT, mmq_w<T>::MIN>(sxq[0], sxd[0], sxm[0], xa, da, ba, mmq_x_st(threadIdx.x));
        if (pl.s0 + 1 < pl.s1) mmq_x_load<NT>(a.a, a.n, pl.s0 + 1, pl.tok0, xb, db, bb);
    }
    __syncthreads();
    /* Chunk s from set cur into buffer (s - s0) & 1; the loads of s + 2
     * into set fill (free since chunk s - 1); the activations of s + 1
     * (set next, loaded a chunk ago) to the other buffer. */
    const auto step = [&](int s, const mmq_w<T>(&cur)[2], mmq_w<T>(&fill)[2], uint4(&xf)[NT], float &df,
                          uint4 &bf, const uint4(&xn)[NT], float dn, uint4 bn) {
        const int buf = (s - pl.s0) & 1;
        if (s + 2 < pl.s1) load(s + 2, fill, xf, df, bf);
        mmq_chunk<T, NT>(cur, sxq[buf], sxd[buf], sxm[buf], lane >> 2, t, acc);
        /* The other buffer was last read a chunk ago, before the barrier
         * that ended it. */
        if (s + 1 < pl.s1)
            mmq_x_store<NT, mmq_w<T>::MIN>(sxq[buf ^ 1], sxd[buf ^ 1], sxm[buf ^ 1], xn, dn, bn, mmq_x_st(threadIdx.x));
        __syncthreads();
    };
    for (int s = pl.s0; s < pl.s1; s += 3) {
        step(s, wa, wc, xc, dc, bc, xb, db, bb);
        if (s + 1 >= pl.s1) break;
        step(s + 1, wb, wa, xa, da, ba, xc, dc, bc);
        if (s + 2 >= pl.s1) break;
        step(s + 2, wc, wb, xb, db, bb, xa, da, ba);
    }
    mmq_finish<NT>(a, pl.seg, pl.bx, pl.row0, pl.tok0, acc);
}

/* Whether a launch of nt tiles a warp stages its weights (mmq_stage):
 * LLM_CUDA_MMQ_STAGE (knobs.c), read on every launch so that a benchmark
 * or a test can compare the two on one backend.  cuda_ctx_init has checked
 * it, and only the process itself can change its environment since: a bad
 * value now is a bug of that process, which aborts naming it. */
static bool mmq_staged(int nt) {
    struct cuda_knobs k;
    char err[256];
    if (cuda_knobs_read_one(&k, "LLM_CUDA_MMQ_STAGE", err, sizeof err) != STATUS_OK) {
        fprintf(stderr, "%s:%d: %s (the process changed it after the CUDA backend started)\n", __FILE__, __LINE__,
                err);
        abort();
    }
    return nt <= k.mmq_stage;
}

/* The kernel of variant v: 0 the plain one, 1 Q6_K's staged weights, 2
 * Q4_K's and Q5_K's loads two chunks ahead (matmul_mmq_deep_kernel), 3
 * Q4_K's 32 x 32 warp tiles (matmul_mmq_tile.cu, with its shared memory in
 * *smem). */
template <int T, int NT> static void (*mmq_kernel(int v, size_t *smem))(const mmq_args) {
    if (v == 3) return mmq_tile_kernel_q4k(smem);
    if constexpr (T == DTYPE_Q6_K && NT <= MMQ_STAGE_MAX) {
        if (v == 1) return matmul_mmq_kernel<T, NT, true>;
    } else if constexpr (NT == 1) {
        if (v == 2) return matmul_mmq_deep_kernel<T, NT>;
    }
    return matmul_mmq_kernel<T, NT, false>;
}

/* The blocks of each variant v of mmq_kernel<T, NT> resident on a
 * multiprocessor, a device's row, asked once (mmq_occupancy). */
template <int T, int NT> static int mmq_per_sm[64][4];
static int mmq_dev(const struct cuda_ctx *ctx) { return ctx->device >= 0 && ctx->device < 64 ? ctx->device : 0; }

/* *per_sm: the blocks of kernel resident on a multiprocessor, asked once
 * (a device's entry). */
static cudaError_t mmq_occupancy(void (*kernel)(const mmq_args), int *per_sm, size_t smem = 0) {
    return cuda_blocks_per_sm(kernel, MMQ_WARPS * 32, smem, per_sm);
}

template <int T, int NT>
static int mmq_launch_nt(struct cuda_ctx *ctx, mm_group &g, int64_t cols, const float *x, int n, bool tile = false) {
    int(&per_sm)[64][4] = mmq_per_sm<T, NT>;
    const int dev = mmq_dev(ctx);
    int rbs = 0;
    for (int s = 0; s < g.n; s++) {
        g.blk0[s] = rbs;
        rbs += (g.rows[s] + MMQ_ROWS - 1) / MMQ_ROWS;
    }
    g.blk0[g.n] = rbs;
    const int th = tile ? 1 : (n + 8 * NT - 1) / (8 * NT);
    if (rbs * th > MMQ_COUNTERS) return CUDA_NOT_FUSED;
    /* Q4_K and Q5_K at 3-8 tokens load two chunks ahead where the row
     * blocks fit one wave of its fewer resident blocks: where they did
     * not (llama3-8b's gate/up, 896 row blocks) its extra wave measured
     * slower, as did 9-16 tokens, whose registers spill. */
    int v = 0;
    size_t smem = 0;
    if (T == DTYPE_Q4_K && NT == 4 && tile) v = 3;
    if constexpr (T == DTYPE_Q6_K) {
        v = mmq_staged(NT) ? 1 : 0;
    } else if (NT == 1 && ctx->mmq_depth == 2) {
        CUDA_CHECK(ctx, mmq_occupancy(mmq_kernel<T, NT>(2, &smem), &per_sm[dev][2]));
        if (rbs * th <= per_sm[dev][2] * ctx->n_sms) v = 2;
    }
    void (*kernel)(const mmq_args) = mmq_kernel<T, NT>(v, &smem);
    CUDA_CHECK(ctx, mmq_occupancy(kernel, &per_sm[dev][v], smem));
    /* Split K as far as the blocks still fit the resident slots in one
     * wave, at most MMQ_SPLIT_MAX ways and a chunk a split. */
    const int n_sb = (int)(cols / 256), slots = per_sm[dev][v] * ctx->n_sms;
    int ks = rbs * th >= slots ? 1 : slots / (rbs * th);
    if (ks > MMQ_SPLIT_MAX) ks = MMQ_SPLIT_MAX;
    if (ks > n_sb) ks = n_sb;
    const int sps = (n_sb + ks - 1) / ks;
    ks = (n_sb + sps - 1) / sps;

    mmq_args a = {};
    a.g = g;
    a.n = n;
    a.n_sb = n_sb;
    a.sps = sps;
    a.th = th;
    a.cols = cols;
    a.rb = cuda_row_bytes((enum dtype)T, cols);
    a.ahead = ctx->l2_ahead;
    size_t part_floats = 0;
    if (ks > 1)
        for (int s = 0; s < g.n; s++) {
            a.part0[s] = part_floats;
            part_floats += (size_t)ks * n * g.rows[s];
        }
    const size_t act_bytes = cuda_q8k_bytes(n, cols), part_bytes = part_floats * sizeof(float);
    constexpr bool k8 = T != DTYPE_Q6_K;
    ctx->mmq_seen = 1;
    /* A norm's Q8K8 form of x at the top of the scratch (rmsnorm.cu): the
     * partial sums then go after x's F16 form, which a weight on another
     * kernel (v beside q and k) may still read.  Partial sums that would
     * reach the form forget it (cuda_scratch), and x is quantized here. */
    const size_t f16_bytes = cuda_q8k_align((size_t)n * cols * 2);
    uint8_t *scr = NULL, *kept = k8 ? (uint8_t *)cuda_actq_kept(ctx, MATMUL_ACT_Q8K8, x, n, cols) : NULL;
    if (kept) {
        scr = (uint8_t *)cuda_scratch(ctx, f16_bytes + part_bytes);
        if (!scr) return STATUS_NO_MEMORY;
        kept = (uint8_t *)cuda_actq_kept(ctx, MATMUL_ACT_Q8K8, x, n, cols);
    }
    int8_t *xq;
    float *xd;
    int16_t *xb;
    if (kept) {
        cuda_q8k_parts(kept, n, cols, &xq, &xd, &xb);
        a.part = ks > 1 ? (float *)(scr + f16_bytes) : NULL;
    } else {
        scr = (uint8_t *)cuda_scratch(ctx, act_bytes + part_bytes);
        if (!scr) return STATUS_NO_MEMORY;
        cuda_q8k_parts(scr, n, cols, &xq, &xd, &xb);
        a.part = ks > 1 ? (float *)(scr + act_bytes) : NULL;
        if (!cuda_act_reuse(ctx, k8 ? MATMUL_ACT_Q8K8 : MATMUL_ACT_Q8K, x, n, cols, scr)) {
            const int items = n * n_sb, per_block = 8;
            CUDA_CHECK(ctx, cuda_launch(ctx, mmq_quant_kernel<k8>,
                                        dim3((unsigned)((items + per_block - 1) / per_block)), dim3(per_block * 32),
                                        0, x, xq, xd, xb, n, (int)cols, items));
            CUDA_CHECK(ctx, cudaGetLastError());
        }
    }
    a.a.xq = xq;
    a.a.xd = xd;
    a.a.xb = xb;
    CUDA_CHECK(ctx,
               cuda_launch(ctx, kernel, dim3((unsigned)(rbs * th), (unsigned)ks), dim3(MMQ_WARPS * 32), smem, a));
    CUDA_CHECK(ctx, cudaGetLastError());
    return STATUS_OK;
}

template <int T>
static int mmq_launch(struct cuda_ctx *ctx, mm_group &g, int64_t cols, const float *x, int n) {
    /* Tiles a warp: all of them up to ctx->mmq_tiles (4: 32 tokens),
     * else as few blocks side by side as hold them at that. */
    if constexpr (T == DTYPE_Q4_K) {
        int64_t rows = 0, blocks = 0;
        for (int s = 0; s < g.n; s++) {
            rows += g.rows[s];
            blocks += (g.rows[s] + MMQ_ROWS - 1) / MMQ_ROWS;
        }
        if (ctx->mmq_tile > 0 && n >= ctx->mmq_tile && rows >= ctx->mmq_tile_rows) {
            int *const per_sm = &mmq_per_sm<T, 4>[mmq_dev(ctx)][3];
            size_t smem = 0;
            void (*const tk)(const mmq_args) = mmq_kernel<T, 4>(3, &smem); /* (sets smem first) */
            CUDA_CHECK(ctx, mmq_occupancy(tk, per_sm, smem));
            if (cuda_mmq_tile_takes(ctx->mmq_tile, ctx->mmq_tile_sparse, n, blocks, (int64_t)*per_sm * ctx->n_sms))
                return mmq_launch_nt<T, 4>(ctx, g, cols, x, n, true);
        }
    }
    int nt = (n + 7) / 8;
    if (nt > ctx->mmq_tiles) {
        const int th = (nt + ctx->mmq_tiles - 1) / ctx->mmq_tiles;
        nt = (nt + th - 1) / th;
    }
    switch (nt) {
    case 1: return mmq_launch_nt<T, 1>(ctx, g, cols, x, n);
    case 2: return mmq_launch_nt<T, 2>(ctx, g, cols, x, n);
    case 3: return mmq_launch_nt<T, 3>(ctx, g, cols, x, n);
    case 4: return mmq_launch_nt<T, 4>(ctx, g, cols, x, n);
    case 5: case 6: return mmq_launch_nt<T, 6>(ctx, g, cols, x, n);
    default: return mmq_launch_nt<T, 8>(ctx, g, cols, x, n);
    }
}

extern "C" int cuda_matmul_mmq_takes(const struct cuda_ctx *ctx, enum dtype type, int64_t cols, int32_t n) {
    return ctx->mmq_min > 0 && n >= ctx->mmq_min && n <= ctx->mmq_max && n <= MMQ_NT_MAX &&
           (type == DTYPE_Q4_K || type == DTYPE_Q5_K || type == DTYPE_Q6_K) && cols % 256 == 0 && cols <= INT32_MAX;
}

extern "C" int cuda_matmul_mmq_group_takes(const struct cuda_ctx *ctx, const struct mm_group *g, enum dtype type,
                                           int64_t cols, const float *x, int32_t n) {
    if (!cuda_matmul_mmq_takes(ctx, type, cols, n) || (uintptr_t)x % 16 != 0) return 0;
    int64_t rows = 0;
    for (int s = 0; s < g->n; s++) {
        if ((uintptr_t)g->w[s] % 16 != 0) return 0;
        rows += g->rows[s];
    }
    /* Q6_K weights of many rows (gate/up, an output head) go to
     * matmul_wide.cu past mmq_max_q6 tokens on sm_80 and later (knobs.c). */
    if (type == DTYPE_Q6_K && n > ctx->mmq_max_q6 && rows > ctx->mmq_q6_rows) return 0;
    /* Smaller weights than fill the GPU without splitting K far: the
     * other kernels measured faster there (4096 x 4096 at every batch but
     * sm_75's 33-64 tokens; knobs.c). */
    if (n <= 16) return rows >= ctx->mmq_rows;
    return rows * cols >= ctx->mmq_elems[n > 32];
}

extern "C" int cuda_matmul_mmq(struct cuda_ctx *ctx, struct mm_group *g, enum dtype type, int64_t cols,
                               const float *x, int32_t n) {
    if (g->swiglu || !cuda_matmul_mmq_group_takes(ctx, g, type, cols, x, n)) return CUDA_NOT_FUSED;
    switch (type) {
    case DTYPE_Q4_K: return mmq_launch<DTYPE_Q4_K>(ctx, *g, cols, x, n);
    case DTYPE_Q5_K: return mmq_launch<DTYPE_Q5_K>(ctx, *g, cols, x, n);
    case DTYPE_Q6_K: return mmq_launch<DTYPE_Q6_K>(ctx, *g, cols, x, n);
    default: return CUDA_NOT_FUSED;
    }
}
