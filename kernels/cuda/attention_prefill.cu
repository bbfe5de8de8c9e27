/* Causal grouped-query attention over the paged F16 KV cache on tensor
 * cores, for attention batches with prefill rows (flash attention: tiled,
 * online softmax in F32, the score matrix never exists).
 *
 * A block owns 64 query vectors -- 64 / G consecutive rows of one sequence
 * times the G query heads of one KV head, so each K/V tile is read once for
 * the whole group -- and its two groups of 4 warps walk the two halves of
 * its slice of the context in tiles of 32 positions, their states merged
 * in shared memory at the end (a causal prefill's last rows see the whole
 * context, the first rows little: halving the longest walk shortens the
 * launch).  Each warp of a group owns 16 query vectors: S = Q.K^T and
 * O += P.V are mma.sync m16n8k8 (F16 in, F32 accumulate; sm_75 has it),
 * or from sm_80 m16n8k16 (half the instructions), Q stays in registers as
 * A fragments, and the S accumulators are already the A fragments of P.V
 * (the m16n8 C layout is the A layout of both), so P never goes through
 * shared memory.  K and V are kept row-major in shared memory (P.V's
 * operand transposed by ldmatrix), rows padded so that every fragment load
 * is free of bank conflicts.  When the blocks cannot fill the GPU, the
 * context is split and a second kernel merges the partial (max, sum, acc),
 * as the general kernel of attention.cu does.
 *
 * An 8-bit (Q8_0) cache takes the same kernel: each thread loads the int8
 * bytes and the scale of its 8 dims of a position instead of 16 bytes of
 * F16, and turns them into the same F16 values as it stores the tile
 * (apf_load_kv_q8, apf_q8_to_f16), so everything after the tile's store is
 * the F16 kernel.
 *
 * With ROPE (cuda_attention_prefill_rope: backend_rope_kv_attention of
 * sequences of 2 .. APF_ROPE_ROWS rows, speculation's verifying steps) the
 * kernel also does the rope and the cache write that rope.cu's launch
 * before it would: q comes unrotated from the matmul and is rotated as its
 * A fragments are formed; a K/V tile's positions from the sequence's first
 * new row on come from the matmul's k (rotated) and v rows, rounded to F16
 * as the cache keeps them, and the sequence's last tile of rows writes
 * them to the cache.  Each row's cosines and sines are formed once a
 * block (att_rope_cs: the angle in double, as rope.cu forms it, reduced to
 * [-pi, pi] in double, its sine and cosine in float). */
#include "attention_prefill.h"
#include "attn_merge.cuh"
#include "common.cuh"
#include "knobs.h"

#include "../backend.h"

#include <math.h>
#include <stdio.h>
#include <stdlib.h>

#define APF_GT 128 /* threads of a group: 4 warps x 16 query vectors */
#define APF_THREADS (2 * APF_GT)
#define APF_BQ 64 /* query vectors per block */
#define APF_BK 32 /* context positions per K/V tile */
#define APF_ROPE_ROWS 16 /* most rows of a sequence the ROPE kernel takes */

struct apf_params {
    struct cuda_attn_args a;
    int32_t G;        /* query heads per KV head */
    int32_t tq;       /* rows per block: APF_BQ / G */
    int32_t n_splits; /* the grid's splits: the most a tile of rows takes */
    int32_t want;     /* splits a tile wants: each tile's split of the context from its own length */
    float *part_acc;  /* (n_splits, n_tokens, n_heads, head_dim) unnormalized sums */
    float *part_ml;   /* (n_splits, n_tokens, n_heads, 2) running max and sum */
    fp16_t *out16;    /* out's F16 form too, unless NULL (cuda_att_scratch) */
    /* ROPE: the rows' k and v as the matmuls left them (n_tokens, n_kv_heads
     * * head_dim; q is a.q, unrotated too), each row's cache slot, and the
     * head_dim / 2 frequencies. */
    const float *k_new, *v_new;
    const int32_t *slots;
    const float *inv_freq;
    int32_t neox;
};

__device__ __forceinline__ uint32_t apf_pack(float lo, float hi) {
    __half2 h = __floats2half2_rn(lo, hi);
    return *(const uint32_t *)&h;
}

/* d += A (16x8, rows a0: g, a1: g + 8) . B (8x8, b0), F16 in, F32 out. */
__device__ __forceinline__ void apf_mma(float d[4], uint32_t a0, uint32_t a1, uint32_t b0) {
    asm volatile("mma.sync.aligned.m16n8k8.row.col.f32.f16.f16.f32 {%0,%1,%2,%3}, {%4,%5}, {%6}, {%0,%1,%2,%3};\n"
                 : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3])
                 : "r"(a0), "r"(a1), "r"(b0));
}

/* The same with k = 16 (sm_80 and later; a0/a2 row g, a1/a3 row g + 8,
 * a2/a3 and b1 the upper 8 of k): half the instructions for the same
 * products.  Never launched below sm_80 (apf_params.k16), a trap there. */
__device__ __forceinline__ void apf_mma16(float d[4], uint32_t a0, uint32_t a1, uint32_t a2, uint32_t a3, uint32_t b0,
                                          uint32_t b1) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 800
    asm volatile("mma.sync.aligned.m16n8k16.row.col.f32.f16.f16.f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, "
                 "{%0,%1,%2,%3};\n"
                 : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3])
                 : "r"(a0), "r"(a1), "r"(a2), "r"(a3), "r"(b0), "r"(b1));
#else
    __trap();
#endif
}

/* Four 8x8 tiles of 2-byte values, transposed: lane l gives the address of
 * row l % 8 of tile l / 8 and gets, of each tile, the B fragment of an
 * mma whose k runs down the tile's rows (ldmatrix, sm_75 and later). */
__device__ __forceinline__ void apf_ldsm_t4(uint32_t (&r)[4], const fp16_t *row) {
    const unsigned addr = (unsigned)__cvta_generic_to_shared(row);
    asm volatile("ldmatrix.sync.aligned.m8n8.x4.trans.shared.b16 {%0,%1,%2,%3}, [%4];\n"
                 : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3])
                 : "r"(addr));
}

/* The barrier of group wg's 128 threads (the groups walk different counts
 * of tiles; barrier 0 is __syncthreads). */
__device__ __forceinline__ void apf_group_sync(int wg) {
    /* Immediate ids: ptxas then reserves 3 barriers, not all 16. */
    if (wg == 0) asm volatile("bar.sync 1, %0;" ::"n"(APF_GT) : "memory");
    else asm volatile("bar.sync 2, %0;" ::"n"(APF_GT) : "memory");
}

/* Dims d .. d + 7 of position j of KV head kvh: zeros from j_end on, NaN
 * for a block id outside the cache (the row then comes out NaN). */
__device__ __forceinline__ uint4 apf_load_kv(const fp16_t *cache, const struct cuda_attn_args &a,
                                             const int32_t *btab, int32_t kvh, int32_t j, int32_t j_end, int d,
                                             int hd) {
    if (j >= j_end) return make_uint4(0, 0, 0, 0);
    int32_t bi = j / a.block_size, blk = bi < a.max_blocks ? btab[bi] : -1;
    if (blk < 0 || blk >= a.n_blocks) return make_uint4(0x7e007e00u, 0x7e007e00u, 0x7e007e00u, 0x7e007e00u);
    size_t at = (((size_t)blk * a.n_kv_heads + kvh) * a.block_size + j % a.block_size) * hd + d;
    return __ldg((const uint4 *)(cache + at));
}

/* The same 8 dims of an 8-bit cache row (kernels/backend.h: head_dim / g
 * groups of an F16 scale and g int8, g = backend_kv_q8_group: 66 bytes a
 * group for heads of 128, 34 for heads of 64, rows 4-byte aligned in
 * both).  Since g + 2 is 2 mod 4, the 8 int8 start 2 bytes into a 4-byte
 * word in even groups and on a word boundary in odd ones, so they come as
 * three aligned words (two in odd groups) and the scale as one 2-byte
 * load: x, y, z the words, w the scale's bits.  The same register count as
 * the F16 piece, so the loads of the next tile stay in flight as they do
 * for F16.  Zeros past the slice (scale 0); a NaN scale for a block id
 * outside the cache. */
__device__ __forceinline__ uint4 apf_load_kv_q8(const uint8_t *cache, const struct cuda_attn_args &a,
                                                const int32_t *btab, int32_t kvh, int32_t j, int32_t j_end, int d,
                                                int hd) {
    if (j >= j_end) return make_uint4(0, 0, 0, 0);
    int32_t bi = j / a.block_size, blk = bi < a.max_blocks ? btab[bi] : -1;
    if (blk < 0 || blk >= a.n_blocks) return make_uint4(0, 0, 0, 0x7e00u);
    const int g = backend_kv_q8_group(hd), rb = hd / g * (g + 2), so = (d / g) * (g + 2), vo = so + 2 + d % g;
    const uint8_t *row = cache + (((size_t)blk * a.n_kv_heads + kvh) * a.block_size + j % a.block_size) * rb;
    const uint32_t *w = (const uint32_t *)(row + (vo & ~3));
    uint4 r;
    r.x = __ldg(w);
    r.y = __ldg(w + 1);
    r.z = (vo & 3) ? __ldg(w + 2) : 0u;
    r.w = __ldg((const unsigned short *)(row + so));
    return r;
}

/* A piece from apf_load_kv_q8 as the 8 F16 values d * q (the shift sh is
 * 16 for dims in even groups, else 0): each int8 + 128 is put in the
 * mantissa of 1024 (0x64xx) by a byte permute and 1152 subtracted, both
 * exact, then one F16 multiply by the scale -- the F32 product rounded
 * once to F16, what an F16 cache would have held of that value. */
__device__ __forceinline__ uint4 apf_q8_to_f16(uint4 r, int sh) {
    const uint32_t lo = __funnelshift_r(r.x, r.y, sh) ^ 0x80808080u, hi = __funnelshift_r(r.y, r.z, sh) ^ 0x80808080u;
    const __half2 off = __half2half2(__ushort_as_half((unsigned short)0x6480)); /* 1152 */
    const __half2 dd = __half2half2(__ushort_as_half((unsigned short)r.w));
    const uint32_t in[4] = {__byte_perm(lo, 0x64646464u, 0x4140), __byte_perm(lo, 0x64646464u, 0x4342),
                            __byte_perm(hi, 0x64646464u, 0x4140), __byte_perm(hi, 0x64646464u, 0x4342)};
    uint4 o;
    uint32_t *op = (uint32_t *)&o;
#pragma unroll
    for (int e = 0; e < 4; e++) {
        const __half2 h = __hmul2(__hsub2(*(const __half2 *)&in[e], off), dd);
        op[e] = *(const uint32_t *)&h;
    }
    return o;
}

/* A thread's piece of a K or V tile in the cache's form (F16 or Q8_0). */
template <bool Q8>
__device__ __forceinline__ uint4 apf_load(const void *cache, const struct cuda_attn_args &a, const int32_t *btab,
                                          int32_t kvh, int32_t j, int32_t j_end, int d, int hd) {
    if constexpr (Q8) return apf_load_kv_q8((const uint8_t *)cache, a, btab, kvh, j, j_end, d, hd);
    else return apf_load_kv((const fp16_t *)cache, a, btab, kvh, j, j_end, d, hd);
}

/* ROPE: dims d .. d + 7 of KV head kvh of row t (cs: its position's
 * (cos, sin) for each of the head_dim / 2 frequencies), k rotated as rope.cu
 * rotates it, both rounded to F16. */
template <int HD>
__device__ __forceinline__ void apf_new_kv(const struct apf_params &p, int64_t t, int32_t kvh, int d,
                                           const float2 *cs, uint4 &ko, uint4 &vo) {
    const int64_t at = t * p.a.n_kv_heads * HD + (int64_t)kvh * HD;
    const float *kr = p.k_new + at, *vr = p.v_new + at;
    float x[8], y[8], w[8];
    *(float4 *)x = *(const float4 *)(kr + d);
    *(float4 *)(x + 4) = *(const float4 *)(kr + d + 4);
    *(float4 *)w = *(const float4 *)(vr + d);
    *(float4 *)(w + 4) = *(const float4 *)(vr + d + 4);
    if (p.neox) {
        /* Pairs (i, i + HD / 2): the partners' 8 dims from the other half. */
        const int dp = d < HD / 2 ? d + HD / 2 : d - HD / 2;
        *(float4 *)y = *(const float4 *)(kr + dp);
        *(float4 *)(y + 4) = *(const float4 *)(kr + dp + 4);
#pragma unroll
        for (int e = 0; e < 8; e++) {
            const float2 c = cs[(d % (HD / 2)) + e];
            x[e] = d < HD / 2 ? x[e] * c.x - y[e] * c.y : y[e] * c.y + x[e] * c.x;
        }
    } else {
        /* Pairs (2i, 2i + 1), four of them in the 8 dims. */
#pragma unroll
        for (int e = 0; e < 8; e += 2) {
            const float2 c = cs[(d + e) / 2];
            const float x0 = x[e], x1 = x[e + 1];
            x[e] = x0 * c.x - x1 * c.y;
            x[e + 1] = x0 * c.y + x1 * c.x;
        }
    }
    ko = make_uint4(apf_pack(x[0], x[1]), apf_pack(x[2], x[3]), apf_pack(x[4], x[5]), apf_pack(x[6], x[7]));
    vo = make_uint4(apf_pack(w[0], w[1]), apf_pack(w[2], w[3]), apf_pack(w[4], w[5]), apf_pack(w[6], w[7]));
}

template <int HD, bool K16, bool Q8, bool ROPE>
__global__ void __launch_bounds__(APF_THREADS) attention_prefill_kernel(struct apf_params p) {
    const struct cuda_attn_args &a = p.a;
    constexpr int KS = HD + 8;     /* K and V tile row stride in halves: the 8 rows of a fragment or
                                    * ldmatrix tile in distinct banks */
    constexpr int NK = HD / 8;     /* k-steps of S over the head; n-tiles of O */
    constexpr int NT = APF_BK / 8; /* n-tiles of S; k-steps of P.V */
    static_assert(APF_BK * (HD / 8) % APF_GT == 0, "the K/V tile loads split evenly over a group's threads");
    static_assert(NK % 4 == 0, "P.V's B fragments come four n-tiles (two with k = 16) an ldmatrix");
    /* Each group's K and V tiles; at the end, group 1's state for group 0
     * (NK x 4 + 4 floats a thread: exactly this size). */
    __shared__ __align__(16) fp16_t skv[2 * 2 * APF_BK * KS];
    static_assert((NK * 4 + 4) * APF_GT * sizeof(float) <= sizeof(skv), "the merge fits the tiles' memory");
    /* ROPE: (cos, sin) of each new row's position and frequency. */
    __shared__ float2 rope_cs[ROPE ? APF_ROPE_ROWS * (HD / 2) : 1];
    static_assert(!(ROPE && Q8), "the ROPE kernel writes an F16 cache");
    const int tid = threadIdx.x % APF_GT, wg = threadIdx.x / APF_GT, lane = tid % 32, warp = tid / 32,
              gq = lane / 4, t4 = lane % 4;
    fp16_t *sk = skv + wg * 2 * APF_BK * KS, *sv = sk + APF_BK * KS;
    const float ninf = -INFINITY;

    /* Which sequence and tile of rows.  The last tiles of a sequence see
     * the longest context: they get the lowest block ids (y), so they
     * start first and the short ones fill in behind them. */
    int32_t s = -1, tile = (int32_t)(gridDim.y - 1 - blockIdx.y);
    for (int32_t i = 0; i < a.n_seqs; i++) {
        int32_t len = a.seq_tok0[i + 1] - a.seq_tok0[i];
        /* CUDA_ATT_MULTI_ROW: one-row sequences are the decode kernel's. */
        int32_t nt = len > (a.rows == CUDA_ATT_MULTI_ROW) ? (len + p.tq - 1) / p.tq : 0;
        if (tile < nt) {
            s = i;
            break;
        }
        tile -= nt;
    }
    if (s < 0) return;
    const int32_t tok0 = a.seq_tok0[s], tok_end = a.seq_tok0[s + 1], pos0 = a.seq_pos0[s];
    const int32_t r0 = tok0 + tile * p.tq, kvh = blockIdx.x, G = p.G;
    const int32_t last_row = min(r0 + p.tq, tok_end) - 1;
    const int32_t ctx_tile = pos0 + (last_row - tok0) + 1;
    /* The split of this tile's context from its own length alone (at
     * least 4 tiles of positions a split), so that a row's result does not
     * depend on the longest context of the launch: a replayed graph is
     * sized for the longest allowed.  Splits past the tile's last write
     * empty slots. */
    const int32_t z = blockIdx.z;
    const int32_t sp = max(1, min(p.want, (ctx_tile + 4 * APF_BK - 1) / (4 * APF_BK)));
    const int32_t ck = ((ctx_tile + sp - 1) / sp + APF_BK - 1) / APF_BK * APF_BK;
    int32_t j_begin = z < sp ? z * ck : ctx_tile;
    int32_t j_end = z < sp - 1 ? min(j_begin + ck, ctx_tile) : ctx_tile;
    /* This group's half of the slice (group 0 the first tiles). */
    {
        const int32_t span = j_end > j_begin ? j_end - j_begin : 0;
        const int32_t half = ((span + 1) / 2 + APF_BK - 1) / APF_BK * APF_BK;
        if (wg == 0) j_end = min(j_end, j_begin + half);
        else j_begin = min(j_end, j_begin + half);
    }
    const int64_t width = (int64_t)a.n_heads * HD;

    const int32_t *btab = a.block_tables + (int64_t)s * a.max_blocks;
    /* K and V tiles: one 16-byte load per 8 dims of a position; zeros past
     * the slice, NaN for a block id outside the cache.  The next tile's
     * loads are issued into registers before the current tile is used, so
     * their latency overlaps the tensor-core work (at 2 blocks per SM
     * there are too few warps to hide it otherwise).  A warp reads
     * consecutive bytes and stores whole rows, V as K (position-major):
     * P.V's B fragments come out of ldmatrix's transposing loads. */
    constexpr int LD = APF_BK * (HD / 8) / APF_GT;
    /* A thread's dims are the same in every piece (APF_GT is a multiple of
     * HD / 8): in an 8-bit cache their bytes sit 2 bytes into a word in
     * even groups. */
    const int q8_sh = ((tid % (HD / 8)) * 8 / backend_kv_q8_group(HD)) % 2 ? 0 : 16;
    uint4 kr[LD], vr[LD];
    /* ROPE: positions from the sequence's first new row on are not read
     * from the cache (their pieces load as zeros): they are taken from the
     * matmul's rows as the tile is stored, below. */
    const int32_t j_cache = ROPE ? min(j_end, pos0) : j_end;
    const auto load_tile = [&](int32_t j0) {
#pragma unroll
        for (int it = 0; it < LD; it++) {
            const int i = tid + it * APF_GT;
            kr[it] = apf_load<Q8>(a.k, a, btab, kvh, j0 + i / (HD / 8), j_cache, (i % (HD / 8)) * 8, HD);
            vr[it] = apf_load<Q8>(a.v, a, btab, kvh, j0 + i / (HD / 8), j_cache, (i % (HD / 8)) * 8, HD);
        }
    };
    /* A first tile of positions before this step's rows is no kernel's
     * output (the rope kernel before writes the rows from pos0 on; the
     * tables and the batch's layout are the step's upload): it is loaded
     * before the programmatic wait, q and everything else after it.  So
     * are ROPE's cosines and sines (positions and frequencies are no
     * kernel's output either). */
    const bool early = j_begin + APF_BK <= pos0;
    if (early) load_tile(j_begin);
    if constexpr (ROPE) {
        att_rope_cs(rope_cs, min(tok_end - tok0, APF_ROPE_ROWS), pos0, p.inv_freq, HD, APF_THREADS);
        __syncthreads();
    }
    pdl_begin();
    if (!early) load_tile(j_begin);

    /* This lane's two query vectors (rows gq and gq + 8 of its warp's 16):
     * qi = r * G + g is row r0 + r, head kvh * G + g; position -1 marks
     * padding past the sequence's rows. */
    int32_t qpos[2], qrow[2], qhead[2];
#pragma unroll
    for (int h = 0; h < 2; h++) {
        int qi = warp * 16 + gq + 8 * h, r = qi / G;
        qrow[h] = r0 + r;
        qhead[h] = kvh * G + qi % G;
        qpos[h] = (r < p.tq && qrow[h] < tok_end) ? pos0 + (qrow[h] - tok0) : -1;
    }
    /* Q as A fragments, pre-scaled: qf[kk][h] holds dims 8kk + 2t, +1. */
    uint32_t qf[NK][2];
#pragma unroll
    for (int h = 0; h < 2; h++) {
        const float *qp = a.q + (qpos[h] >= 0 ? (int64_t)qrow[h] * width + (int64_t)qhead[h] * HD : 0);
        if constexpr (ROPE) {
            /* Rotated as rope.cu rotates q, then scaled.  A lane's dims
             * 8kk + 2t, +1 are a pair (2i, 2i + 1); in the neox pairing
             * their partners are the same lane's dims of k-step
             * kk + NK / 2. */
            const float2 *cs = rope_cs + (qpos[h] >= 0 ? qpos[h] - pos0 : 0) * (HD / 2);
            if (p.neox) {
#pragma unroll
                for (int kk = 0; kk < NK / 2; kk++) {
                    float2 lo = make_float2(0.0f, 0.0f), hi = lo;
                    if (qpos[h] >= 0) {
                        lo = *(const float2 *)(qp + 8 * kk + 2 * t4);
                        hi = *(const float2 *)(qp + HD / 2 + 8 * kk + 2 * t4);
                    }
                    const float2 c0 = cs[8 * kk + 2 * t4], c1 = cs[8 * kk + 2 * t4 + 1];
                    qf[kk][h] = apf_pack((lo.x * c0.x - hi.x * c0.y) * a.scale, (lo.y * c1.x - hi.y * c1.y) * a.scale);
                    qf[kk + NK / 2][h] =
                        apf_pack((lo.x * c0.y + hi.x * c0.x) * a.scale, (lo.y * c1.y + hi.y * c1.x) * a.scale);
                }
            } else {
#pragma unroll
                for (int kk = 0; kk < NK; kk++) {
                    float2 v = qpos[h] >= 0 ? *(const float2 *)(qp + 8 * kk + 2 * t4) : make_float2(0.0f, 0.0f);
                    const float2 c = cs[4 * kk + t4];
                    qf[kk][h] = apf_pack((v.x * c.x - v.y * c.y) * a.scale, (v.x * c.y + v.y * c.x) * a.scale);
                }
            }
        } else {
#pragma unroll
            for (int kk = 0; kk < NK; kk++) {
                float2 v = qpos[h] >= 0 ? *(const float2 *)(qp + 8 * kk + 2 * t4) : make_float2(0.0f, 0.0f);
                qf[kk][h] = apf_pack(v.x * a.scale, v.y * a.scale);
            }
        }
    }
    /* The warp's latest position: tiles wholly after it are skipped. */
    int32_t wmax = max(qpos[0], qpos[1]);
#pragma unroll
    for (int o = 16; o > 0; o >>= 1) wmax = max(wmax, __shfl_xor_sync(0xffffffffu, wmax, o));

    float acc[NK][4], m[2] = {ninf, ninf}, l[2] = {0.0f, 0.0f};
#pragma unroll
    for (int n = 0; n < NK; n++) acc[n][0] = acc[n][1] = acc[n][2] = acc[n][3] = 0.0f;

    for (int32_t j0 = j_begin; j0 < j_end; j0 += APF_BK) {
#pragma unroll
        for (int it = 0; it < LD; it++) {
            int i = tid + it * APF_GT;
            *(uint4 *)(sk + (i / (HD / 8)) * KS + (i % (HD / 8)) * 8) = Q8 ? apf_q8_to_f16(kr[it], q8_sh) : kr[it];
            *(uint4 *)(sv + (i / (HD / 8)) * KS + (i % (HD / 8)) * 8) = Q8 ? apf_q8_to_f16(vr[it], q8_sh) : vr[it];
        }
        if constexpr (ROPE) {
            /* The tile's pieces of new rows: rotated k and v from the
             * matmul, written to the cache by the sequence's last tile of
             * rows (every new position lies in its context, in one split
             * and one group's half of it).  Not unrolled: few tiles have
             * such rows. */
            if (j0 + APF_BK > pos0) {
                const bool writer = last_row == tok_end - 1;
#pragma unroll 1
                for (int it = 0; it < LD; it++) {
                    const int i = tid + it * APF_GT, d = (i % (HD / 8)) * 8;
                    const int32_t j = j0 + i / (HD / 8), r = j - pos0;
                    if (j < pos0 || j >= j_end || r >= APF_ROPE_ROWS) continue;
                    uint4 kn, vn;
                    apf_new_kv<HD>(p, tok0 + r, kvh, d, rope_cs + r * (HD / 2), kn, vn);
                    *(uint4 *)(sk + (i / (HD / 8)) * KS + d) = kn;
                    *(uint4 *)(sv + (i / (HD / 8)) * KS + d) = vn;
                    const int32_t slot = writer ? p.slots[tok0 + r] : -1;
                    if (slot >= 0 && slot < a.n_blocks * a.block_size) {
                        const size_t at = (((size_t)(slot / a.block_size) * a.n_kv_heads + kvh) * a.block_size +
                                           slot % a.block_size) * HD + d;
                        *(uint4 *)((fp16_t *)a.k + at) = kn;
                        *(uint4 *)((fp16_t *)a.v + at) = vn;
                    }
                }
            }
        }
        apf_group_sync(wg);
        if (j0 + APF_BK < j_end) load_tile(j0 + APF_BK);
        if (wmax >= j0) {
            /* S = Q . K^T for 16 queries x 32 positions. */
            float sc[NT][4];
#pragma unroll
            for (int n = 0; n < NT; n++) sc[n][0] = sc[n][1] = sc[n][2] = sc[n][3] = 0.0f;
            if constexpr (K16) {
#pragma unroll
                for (int kk = 0; kk < NK; kk += 2)
#pragma unroll
                    for (int n = 0; n < NT; n++) {
                        const fp16_t *kp = sk + (n * 8 + gq) * KS + kk * 8 + 2 * t4;
                        apf_mma16(sc[n], qf[kk][0], qf[kk][1], qf[kk + 1][0], qf[kk + 1][1], *(const uint32_t *)kp,
                                  *(const uint32_t *)(kp + 8));
                    }
            } else {
#pragma unroll
                for (int kk = 0; kk < NK; kk++)
#pragma unroll
                    for (int n = 0; n < NT; n++) {
                        uint32_t b = *(const uint32_t *)(sk + (n * 8 + gq) * KS + kk * 8 + 2 * t4);
                        apf_mma(sc[n], qf[kk][0], qf[kk][1], b);
                    }
            }
            /* Causal mask and the slice's end: element c of n-tile n is
             * query vector h = c / 2, position j0 + 8n + 2t + c % 2. */
#pragma unroll
            for (int n = 0; n < NT; n++)
#pragma unroll
                for (int c = 0; c < 4; c++) {
                    int32_t j = j0 + n * 8 + 2 * t4 + (c & 1);
                    if (j >= j_end || j > qpos[c / 2]) sc[n][c] = ninf;
                }
            /* Online softmax per query vector; the 4 lanes of a quad share
             * a row, so max is reduced over the quad, the sum at the end. */
#pragma unroll
            for (int h = 0; h < 2; h++) {
                float mt = ninf;
#pragma unroll
                for (int n = 0; n < NT; n++) mt = fmaxf(mt, fmaxf(sc[n][2 * h], sc[n][2 * h + 1]));
                mt = fmaxf(mt, __shfl_xor_sync(0xffffffffu, mt, 1));
                mt = fmaxf(mt, __shfl_xor_sync(0xffffffffu, mt, 2));
                float mn = fmaxf(m[h], mt);
                float alpha = mn == ninf ? 1.0f : __expf(m[h] - mn), sum = 0.0f;
#pragma unroll
                for (int n = 0; n < NT; n++)
#pragma unroll
                    for (int c = 2 * h; c < 2 * h + 2; c++) {
                        float pr = mn == ninf ? 0.0f : __expf(sc[n][c] - mn);
                        sc[n][c] = pr;
                        sum += pr;
                    }
                l[h] = l[h] * alpha + sum;
                m[h] = mn;
#pragma unroll
                for (int n = 0; n < NK; n++) {
                    acc[n][2 * h] *= alpha;
                    acc[n][2 * h + 1] *= alpha;
                }
            }
            /* O += P . V: S's n-tile kk is P's A fragment for positions
             * 8kk .. 8kk + 7; B from V's rows of those positions, dims
             * 8n .. 8n + 7, transposed by ldmatrix: with k = 16 its tiles
             * are (positions low, n), (high, n), (low, n + 1), (high,
             * n + 1); with k = 8, n-tiles n .. n + 3. */
            const int lr = lane % 8, lt = lane / 8;
            if constexpr (K16) {
#pragma unroll
                for (int kk = 0; kk < NT; kk += 2) {
                    uint32_t p0 = apf_pack(sc[kk][0], sc[kk][1]), p1 = apf_pack(sc[kk][2], sc[kk][3]);
                    uint32_t p2 = apf_pack(sc[kk + 1][0], sc[kk + 1][1]), p3 = apf_pack(sc[kk + 1][2], sc[kk + 1][3]);
#pragma unroll
                    for (int n = 0; n < NK; n += 2) {
                        uint32_t b[4];
                        apf_ldsm_t4(b, sv + (kk * 8 + (lt & 1) * 8 + lr) * KS + (n + (lt >> 1)) * 8);
                        apf_mma16(acc[n], p0, p1, p2, p3, b[0], b[1]);
                        apf_mma16(acc[n + 1], p0, p1, p2, p3, b[2], b[3]);
                    }
                }
            } else {
#pragma unroll
                for (int kk = 0; kk < NT; kk++) {
                    uint32_t p0 = apf_pack(sc[kk][0], sc[kk][1]), p1 = apf_pack(sc[kk][2], sc[kk][3]);
#pragma unroll
                    for (int n = 0; n < NK; n += 4) {
                        uint32_t b[4];
                        apf_ldsm_t4(b, sv + (kk * 8 + lr) * KS + (n + lt) * 8);
#pragma unroll
                        for (int q = 0; q < 4; q++) apf_mma(acc[n + q], p0, p1, b[q]);
                    }
                }
            }
        }
        apf_group_sync(wg);
    }

    /* Group 1's state merged into group 0's (the same query vectors in the
     * same lanes), attn_merge.cuh's rule: weights exp(m - max m), a half
     * that saw nothing adds nothing. */
    __syncthreads(); /* both groups are done with their tiles */
    float *mb = (float *)skv;
    if (wg == 1) {
#pragma unroll
        for (int h = 0; h < 2; h++) {
            mb[h * APF_GT + tid] = m[h];
            mb[(2 + h) * APF_GT + tid] = l[h];
        }
#pragma unroll
        for (int n = 0; n < NK; n++)
#pragma unroll
            for (int c = 0; c < 4; c++) mb[(4 + 4 * n + c) * APF_GT + tid] = acc[n][c];
    }
    __syncthreads();
    if (wg == 1) return;
#pragma unroll
    for (int h = 0; h < 2; h++) {
        const float m1 = mb[h * APF_GT + tid], mn = fmaxf(m[h], m1);
        const float w0 = m[h] == ninf ? 0.0f : __expf(m[h] - mn), w1 = m1 == ninf ? 0.0f : __expf(m1 - mn);
        l[h] = l[h] * w0 + mb[(2 + h) * APF_GT + tid] * w1;
#pragma unroll
        for (int n = 0; n < NK; n++)
#pragma unroll
            for (int c = 2 * h; c < 2 * h + 2; c++) acc[n][c] = acc[n][c] * w0 + mb[(4 + 4 * n + c) * APF_GT + tid] * w1;
        m[h] = mn;
    }

    /* The row sums are spread over the quad. */
#pragma unroll
    for (int h = 0; h < 2; h++) {
        l[h] += __shfl_xor_sync(0xffffffffu, l[h], 1);
        l[h] += __shfl_xor_sync(0xffffffffu, l[h], 2);
    }
#pragma unroll
    for (int h = 0; h < 2; h++) {
        if (qpos[h] < 0) continue;
        if (p.n_splits == 1) {
            /* l == 0 only when no position was seen; a NaN sum stays NaN. */
            float inv = l[h] == 0.0f ? 0.0f : 1.0f / l[h];
            float *o = a.out + (int64_t)qrow[h] * width + (int64_t)qhead[h] * HD + 2 * t4;
#pragma unroll
            for (int n = 0; n < NK; n++) *(float2 *)(o + 8 * n) = make_float2(acc[n][2 * h] * inv, acc[n][2 * h + 1] * inv);
            if (p.out16) {
                fp16_t *o16 = p.out16 + (int64_t)qrow[h] * width + (int64_t)qhead[h] * HD + 2 * t4;
#pragma unroll
                for (int n = 0; n < NK; n++)
                    *(uint32_t *)(o16 + 8 * n) = apf_pack(acc[n][2 * h] * inv, acc[n][2 * h + 1] * inv);
            }
        } else {
            int64_t slot = ((int64_t)z * a.n_tokens + qrow[h]) * a.n_heads + qhead[h];
            float *o = p.part_acc + slot * HD + 2 * t4;
#pragma unroll
            for (int n = 0; n < NK; n++) *(float2 *)(o + 8 * n) = make_float2(acc[n][2 * h], acc[n][2 * h + 1]);
            if (t4 == 0) {
                p.part_ml[slot * 2] = m[h];
                p.part_ml[slot * 2 + 1] = l[h];
            }
        }
    }
}

/* Merge the splits of one (row, head) (attn_merge.cuh); a NaN sum makes
 * the row NaN. */
__global__ void attention_prefill_combine_kernel(float *__restrict__ out, fp16_t *__restrict__ out16,
                                                 const float *__restrict__ part_acc,
                                                 const float *__restrict__ part_ml, int32_t n_splits,
                                                 int32_t n_tokens, int32_t n_heads, int32_t hd,
                                                 const int32_t *__restrict__ multi_tok0, int32_t n_seqs) {
    pdl_begin();
    const int32_t row = blockIdx.x, head = blockIdx.y;
    if (multi_tok0) { /* CUDA_ATT_MULTI_ROW: the rows of one-row sequences are not this launch's */
        int32_t lo = 0, hi = n_seqs - 1;
        while (lo < hi) {
            const int32_t mid = (lo + hi + 1) / 2;
            if (multi_tok0[mid] <= row) lo = mid;
            else hi = mid - 1;
        }
        if (multi_tok0[lo + 1] - multi_tok0[lo] == 1) return;
    }
    for (int d = threadIdx.x; d < hd; d += blockDim.x) {
        float l, acc;
        att_merge_dim<false>(part_acc, part_ml, n_splits, n_tokens, n_heads, hd, row, head, d, &l, &acc);
        const float inv = l == 0.0f ? 0.0f : 1.0f / l;
        const int64_t i = ((int64_t)row * n_heads + head) * hd + d;
        const float o = acc * inv;
        out[i] = o;
        if (out16) out16[i] = f2h(o);
    }
}

extern "C" int cuda_attention_tc_fits(const struct cuda_attn_args *a) {
    if (a->n_kv_heads <= 0 || a->n_heads % a->n_kv_heads != 0) return 0;
    int32_t G = a->n_heads / a->n_kv_heads;
    return (a->kv_type == DTYPE_F16 || a->kv_type == DTYPE_Q8_0) && (a->head_dim == 64 || a->head_dim == 128) &&
           G <= APF_BQ &&
           (G & (G - 1)) == 0 && (uintptr_t)a->q % 16 == 0 && (uintptr_t)a->out % 16 == 0 &&
           (uintptr_t)a->k % 16 == 0 && (uintptr_t)a->v % 16 == 0;
}

/* LLM_CUDA_PREFILL_TC (knobs.c) is read on every call, so that a benchmark
 * or a test can compare the kernels on one backend.  cuda_ctx_init has
 * checked it, and only the process itself can change its environment
 * since: a bad value now is a bug of that process, which aborts naming it. */
extern "C" int cuda_attention_prefill_takes(const struct cuda_attn_args *a) {
    struct cuda_knobs k;
    char err[256];
    if (cuda_knobs_read_one(&k, "LLM_CUDA_PREFILL_TC", err, sizeof err) != STATUS_OK) {
        fprintf(stderr, "%s:%d: %s (the process changed it after the CUDA backend started)\n", __FILE__,
                __LINE__, err);
        abort();
    }
    return k.prefill_tc && a->n_tokens > a->n_seqs && cuda_attention_tc_fits(a);
}

/* Blocks of attention_prefill_kernel<HD, K16, Q8, ROPE> resident on one
 * multiprocessor, asked once per device (1 if the runtime cannot say). */
template <int HD, bool K16, bool Q8, bool ROPE> static int64_t apf_per_sm(const struct cuda_ctx *ctx) {
    static int per_sm[64];
    const int dev = ctx->device >= 0 && ctx->device < 64 ? ctx->device : 0;
    if (cuda_blocks_per_sm(attention_prefill_kernel<HD, K16, Q8, ROPE>, APF_THREADS, 0, &per_sm[dev]) != cudaSuccess)
        cudaGetLastError();
    return per_sm[dev] > 0 ? per_sm[dev] : 1;
}

template <bool Q8, bool ROPE> static int64_t apf_per_sm_of(const struct cuda_ctx *ctx, int hd, bool k16) {
    if (hd == 64) return k16 ? apf_per_sm<64, true, Q8, ROPE>(ctx) : apf_per_sm<64, false, Q8, ROPE>(ctx);
    return k16 ? apf_per_sm<128, true, Q8, ROPE>(ctx) : apf_per_sm<128, false, Q8, ROPE>(ctx);
}

template <bool Q8, bool ROPE>
static cudaError_t apf_launch(const struct cuda_ctx *ctx, const struct apf_params &p, dim3 grid, bool k16) {
    void (*kernel)(struct apf_params) = p.a.head_dim == 64
                                            ? (k16 ? attention_prefill_kernel<64, true, Q8, ROPE>
                                                   : attention_prefill_kernel<64, false, Q8, ROPE>)
                                            : (k16 ? attention_prefill_kernel<128, true, Q8, ROPE>
                                                   : attention_prefill_kernel<128, false, Q8, ROPE>);
    return cuda_launch(ctx, kernel, grid, dim3(APF_THREADS), 0, p);
}

/* cuda_attention_prefill's launches; with rope (its k_new .. neox set) the
 * ROPE kernel's. */
static int apf_run(struct cuda_ctx *ctx, const struct cuda_attn_args *a, const struct apf_params *rope) {
    if (!cuda_attention_tc_fits(a))
        return cuda_fail(ctx, STATUS_UNSUPPORTED,
                         "attention_prefill: %s cache, head_dim %d, %d heads over %d KV heads, %d rows of %d sequences",
                         dtype_name(a->kv_type), a->head_dim, a->n_heads, a->n_kv_heads, a->n_tokens, a->n_seqs);
    struct apf_params p;
    if (rope) p = *rope;
    else memset(&p, 0, sizeof p);
    p.a = *a;
    p.G = a->n_heads / a->n_kv_heads;
    p.tq = APF_BQ / p.G;
    /* Every tile holds at least one row, and a sequence wastes at most one
     * partial tile; surplus blocks return at once. */
    int64_t tiles = (a->n_tokens + p.tq - 1) / p.tq + a->n_seqs;
    if (tiles > a->n_tokens) tiles = a->n_tokens;
    /* A sequence of len rows takes at most (len - 1) / tq + 1 tiles, and
     * the rows past each sequence's first number e = n_tokens - n_seqs: at
     * most e / tq tiles and one a sequence, and with CUDA_ATT_MULTI_ROW at
     * most e sequences (each at least one row past its first: a sequence
     * has rows, forward.c refuses one without).  A step of
     * 60 decodes and a 4-row prefill is 3 tiles, not 61 that walk the
     * sequence list to exit. */
    const int64_t e = (int64_t)a->n_tokens - a->n_seqs;
    const int64_t owners = a->rows == CUDA_ATT_MULTI_ROW && e < a->n_seqs ? e : a->n_seqs;
    if (e >= 0 && tiles > e / p.tq + owners) tiles = e / p.tq + owners;
    /* Decode-only batches (one row a sequence) keep every tile busy. */
    int64_t busy = a->n_tokens == a->n_seqs ? tiles : (a->n_tokens + p.tq - 1) / p.tq;
    int64_t blocks = busy * a->n_kv_heads;
    /* Split the context while the blocks still fit the resident slots at
     * once (each split at least 4 tiles of positions): a prefill of 512
     * rows of a 7B model is 256 blocks and stays whole; a short chunk at a
     * long context splits, into one wave (7B, 128 rows at position 3968:
     * 64 blocks of heads of 128, one a multiprocessor, 2 splits; 3 splits,
     * a wave and a half, took 163 µs against 127). */
    const bool k16 = ctx->att_k16, q8 = a->kv_type == DTYPE_Q8_0;
    const int64_t per_sm = q8     ? apf_per_sm_of<true, false>(ctx, a->head_dim, k16)
                           : rope ? apf_per_sm_of<false, true>(ctx, a->head_dim, k16)
                                  : apf_per_sm_of<false, false>(ctx, a->head_dim, k16);
    const int64_t slots = ctx->n_sms * per_sm;
    int64_t want = slots / blocks;
    if (want < 1) want = 1;
    if (want > 32) want = 32;
    /* Each tile splits its own context, in at most `splits`. */
    int64_t by_ctx = ((int64_t)a->max_ctx + 4 * APF_BK - 1) / (4 * APF_BK);
    int64_t splits = want < by_ctx ? want : by_ctx;
    if (splits < 1) splits = 1;
    p.want = (int32_t)want;
    p.n_splits = (int32_t)splits;
    const size_t n_slots = p.n_splits > 1 ? (size_t)p.n_splits * a->n_tokens * a->n_heads : 0;
    uint16_t *out16 = NULL;
    float *scr = NULL;
    if (cuda_att_scratch(ctx, a, n_slots * ((size_t)a->head_dim + 2) * sizeof(float), &out16, &scr) != STATUS_OK)
        return STATUS_NO_MEMORY;
    p.out16 = (fp16_t *)out16;
    if (p.n_splits > 1) {
        p.part_acc = scr;
        p.part_ml = scr + n_slots * a->head_dim;
    }
    /* Heads vary fastest: blocks start in grid order, so every head's
     * longest tile (the last rows, the whole context) starts first and the
     * short tiles fill in behind them. */
    dim3 grid((unsigned)a->n_kv_heads, (unsigned)tiles, (unsigned)p.n_splits);
    /* m16n8k16 where the card has it (sm_80 and later), unless
     * LLM_CUDA_ATT_K8=1 asks for the sm_75 instruction, to compare. */
    const cudaError_t launched = q8     ? apf_launch<true, false>(ctx, p, grid, k16)
                                 : rope ? apf_launch<false, true>(ctx, p, grid, k16)
                                        : apf_launch<false, false>(ctx, p, grid, k16);
    CUDA_CHECK(ctx, launched);
    CUDA_CHECK(ctx, cudaGetLastError());
    if (p.n_splits > 1) {
        CUDA_CHECK(ctx, cuda_launch(ctx, attention_prefill_combine_kernel,
                                    dim3((unsigned)a->n_tokens, (unsigned)a->n_heads), dim3(128), 0, a->out, p.out16,
                                    (const float *)p.part_acc, (const float *)p.part_ml, p.n_splits, a->n_tokens,
                                    a->n_heads, a->head_dim,
                                    a->rows == CUDA_ATT_MULTI_ROW ? (const int32_t *)a->seq_tok0 : NULL, a->n_seqs));
        CUDA_CHECK(ctx, cudaGetLastError());
    }
    return STATUS_OK;
}

extern "C" int cuda_attention_prefill(struct cuda_ctx *ctx, const struct cuda_attn_args *a) {
    return apf_run(ctx, a, NULL);
}

extern "C" int cuda_attention_prefill_rope(struct cuda_ctx *ctx, const struct cuda_attn_args *a, const float *k,
                                           const float *v, const int32_t *slots, const float *inv_freq,
                                           int32_t n_freq, int neox, int32_t rows_min, int32_t rows_max) {
    if (rows_min < 2 || rows_max > ctx->rope_tc || rows_max > APF_ROPE_ROWS || a->kv_type != DTYPE_F16 ||
        2 * n_freq != a->head_dim || (uintptr_t)k % 16 != 0 || (uintptr_t)v % 16 != 0 ||
        !cuda_attention_prefill_takes(a))
        return CUDA_NOT_FUSED;
    struct apf_params r;
    memset(&r, 0, sizeof r);
    r.k_new = k;
    r.v_new = v;
    r.slots = slots;
    r.inv_freq = inv_freq;
    r.neox = neox;
    return apf_run(ctx, a, &r);
}
