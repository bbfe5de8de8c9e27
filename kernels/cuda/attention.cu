/* Causal grouped-query attention over the paged KV cache, for prefill
 * chunks and decode rows in one launch.
 *
 * A block owns a tile of consecutive rows of one sequence and one KV head
 * with the query heads that share it (GQA: each K/V tile is read once for
 * the whole group and all the tile's rows), and walks its slice of the
 * context in tiles of ATT_T positions with an online softmax, so the score
 * matrix never exists.  The context is split across blocks (flash-decoding)
 * when the rows alone cannot fill the GPU; a second kernel merges the
 * partial results.  Rows are mapped to sequences on the device (the
 * sequence bounds live in device memory): block x counts tiles through the
 * sequences in order.  Decode-only steps with an F16 cache take a kernel
 * of their own (attention_decode_kernel, below): K/V rows in registers,
 * no barrier per tile.  An 8-bit (Q8_0) cache goes, as F16 does, to the
 * tensor-core kernel for steps with prefill rows (attention_prefill.cu,
 * which turns the int8 into F16 as it stores each tile) and decode-only
 * steps to attention_q8.cu, which reads the int8 rows as they are stored;
 * this kernel takes the shapes neither takes (its tiles dequantized into
 * shared memory as they are loaded, att_load_tile_q8). */
#include "attention_prefill.h"
#include "knobs.h"
#include "attn_decode.cuh"
#include "attn_merge.cuh"
#include "common.cuh"

#include <math.h>

#include "../backend.h"

#define ATT_THREADS 128
#define ATT_SMEM_MAX (44 * 1024)
/* Most context splits of one launch (both launchers cap theirs at this). */
#define ATT_COMBINE_MAX_SPLITS 64

struct att_params {
    struct cuda_attn_args a;
    int32_t qv;           /* query vectors per block (rows x heads) */
    int32_t gs;           /* query heads per block */
    int32_t n_hgroups;    /* blocks per KV head */
    int32_t tq;           /* rows per tile */
    int32_t kt;           /* KV positions per tile (<= 32) */
    int32_t chunk;        /* context positions per split */
    int32_t n_splits;
    int32_t split_want;   /* decode kernel: most splits of one sequence (<= n_splits) */
    int32_t split_step;   /* decode kernel: a split's positions are a multiple of this */
    int32_t split_min;    /* decode kernel: and at least this many (ctx->att_steps steps) */
    float *part_acc;      /* (n_splits, n_tokens, n_heads, head_dim) unnormalized sums */
    float *part_ml;       /* (n_splits, n_tokens, n_heads, 2) running max and sum */
    fp16_t *out16;        /* decode kernel: out's F16 form too, unless NULL (cuda_att_scratch) */
};

template <int KT> __device__ __forceinline__ float kv_load(const void *base, size_t i) {
    return KT == DTYPE_F16 ? h2f(((const fp16_t *)base)[i]) : ((const float *)base)[i];
}

/* skv[jj][0 .. hd) (row stride hd + 1) = the cache rows of positions j0 + jj
 * of KV head kvh, zeros past j_end, NaN for a block id outside the cache.
 * 16-byte loads when the head width allows (8 halves or 4 floats). */
/* The tile loader's form for an 8-bit cache: a position row of a KV head
 * is head_dim / g groups of an F16 scale and g int8 (kernels/backend.h),
 * dequantized into the float tile.  A thread per element; the group's
 * scale is read by its g threads, which the cache serves. */
__device__ __forceinline__ void att_load_tile_q8(float *skv, const void *cache, const struct cuda_attn_args &a,
                                                 const int32_t *btab, int32_t kvh, int32_t j0, int32_t j_end,
                                                 int kt) {
    const int hd = a.head_dim, g = backend_kv_q8_group(hd);
    const size_t rb = (size_t)(hd / g) * (g + 2);
    for (int i = threadIdx.x; i < kt * hd; i += ATT_THREADS) {
        int jj = i / hd, d = i % hd;
        int32_t j = j0 + jj;
        float val = 0.0f;
        if (j < j_end) {
            int32_t bi = j / a.block_size, blk = bi < a.max_blocks ? btab[bi] : -1;
            if (blk < 0 || blk >= a.n_blocks) {
                val = __int_as_float(0x7fc00000);
            } else {
                const uint8_t *grp = (const uint8_t *)cache +
                                     (((size_t)blk * a.n_kv_heads + kvh) * a.block_size + j % a.block_size) * rb +
                                     (size_t)(d / g) * (g + 2);
                val = h2f(__ldg((const fp16_t *)grp)) * (float)__ldg((const int8_t *)grp + 2 + d % g);
            }
        }
        skv[jj * (hd + 1) + d] = val;
    }
}

template <int KT>
__device__ __forceinline__ void att_load_tile(float *skv, const void *cache, const struct cuda_attn_args &a,
                                              const int32_t *btab, int32_t kvh, int32_t j0, int32_t j_end, int kt) {
    if (KT == DTYPE_Q8_0) {
        att_load_tile_q8(skv, cache, a, btab, kvh, j0, j_end, kt);
        return;
    }
    const int hd = a.head_dim;
    const int vec = KT == DTYPE_F16 ? 8 : 4;
    if (hd % vec == 0) {
        const int per_row = hd / vec;
        for (int i = threadIdx.x; i < kt * per_row; i += ATT_THREADS) {
            int jj = i / per_row, d = (i % per_row) * vec;
            int32_t j = j0 + jj;
            float *dst = skv + jj * (hd + 1) + d;
            int32_t bi = j / a.block_size, blk = (j < j_end && bi < a.max_blocks) ? btab[bi] : -1;
            if (j >= j_end) {
                for (int e = 0; e < vec; e++) dst[e] = 0.0f;
            } else if (blk < 0 || blk >= a.n_blocks) {
                for (int e = 0; e < vec; e++) dst[e] = __int_as_float(0x7fc00000);
            } else {
                size_t at = (((size_t)blk * a.n_kv_heads + kvh) * a.block_size + j % a.block_size) * hd + d;
                if (KT == DTYPE_F16) {
                    uint4 raw = __ldg((const uint4 *)((const fp16_t *)cache + at));
                    const __half2 *h = (const __half2 *)&raw;
                    for (int e = 0; e < 4; e++) {
                        float2 f = __half22float2(h[e]);
                        dst[2 * e] = f.x;
                        dst[2 * e + 1] = f.y;
                    }
                } else {
                    float4 f = __ldg((const float4 *)((const float *)cache + at));
                    dst[0] = f.x;
                    dst[1] = f.y;
                    dst[2] = f.z;
                    dst[3] = f.w;
                }
            }
        }
        return;
    }
    for (int i = threadIdx.x; i < kt * hd; i += ATT_THREADS) {
        int jj = i / hd, d = i % hd;
        int32_t j = j0 + jj;
        float val = 0.0f;
        if (j < j_end) {
            int32_t bi = j / a.block_size, blk = bi < a.max_blocks ? btab[bi] : -1;
            if (blk < 0 || blk >= a.n_blocks) val = __int_as_float(0x7fc00000);
            else val = kv_load<KT>(cache, (((size_t)blk * a.n_kv_heads + kvh) * a.block_size + j % a.block_size) * hd + d);
        }
        skv[jj * (hd + 1) + d] = val;
    }
}

template <int KT>
__global__ void __launch_bounds__(ATT_THREADS) attention_kernel(struct att_params p) {
    const struct cuda_attn_args &a = p.a;
    const int tid = threadIdx.x, lane = tid % 32, warp = tid / 32;
    const int hd = a.head_dim, qv = p.qv, kt = p.kt;
    const float ninf = -INFINITY;

    /* Which sequence and tile: every thread walks the same sums. */
    int32_t s = -1, tile = blockIdx.x;
    for (int32_t i = 0; i < a.n_seqs; i++) {
        int32_t len = a.seq_tok0[i + 1] - a.seq_tok0[i];
        int32_t nt = len > 0 ? (len + p.tq - 1) / p.tq : 0;
        if (tile < nt) {
            s = i;
            break;
        }
        tile -= nt;
    }
    if (s < 0) return;
    const int32_t tok0 = a.seq_tok0[s], tok_end = a.seq_tok0[s + 1], pos0 = a.seq_pos0[s];
    const int32_t r0 = tok0 + tile * p.tq;
    const int32_t kvh = blockIdx.y / p.n_hgroups, hg = blockIdx.y % p.n_hgroups;
    const int32_t G = a.n_heads / a.n_kv_heads;
    const int32_t last_row = min(r0 + p.tq, tok_end) - 1;
    const int32_t ctx_tile = pos0 + (last_row - tok0) + 1;
    const int32_t j_begin = blockIdx.z * p.chunk;
    const int32_t j_end = min(j_begin + p.chunk, ctx_tile);
    const int32_t width = a.n_heads * hd;
    /* Rows come first in qi = r * gs + g, so the tile's real queries are a
     * prefix: the loops below skip the padding (a decode tile of MHA has one). */
    const int qa = min(qv, (last_row - r0 + 1) * p.gs);

    extern __shared__ float smem[];
    float *sq = smem;                      /* [qv][hd] queries, pre-scaled */
    float *sacc = sq + qv * hd;            /* [qv][hd] running sums of p * v */
    float *sk = sacc + qv * hd;            /* [kt][hd + 1] K tile */
    float *sv = sk + kt * (hd + 1);        /* [kt][hd + 1] V tile */
    float *ssc = sv + kt * (hd + 1);       /* [qv][kt] scores, then probabilities */
    float *sm = ssc + qv * kt;             /* [qv] running max */
    float *sl = sm + qv;                   /* [qv] running sum */
    float *salpha = sl + qv;               /* [qv] rescale of this tile */
    int32_t *spos = (int32_t *)(salpha + qv); /* [qv] query position, -1 if unused */

    /* Query vector qi = r * gs + g: row r0 + r, head kvh * G + hg * gs + g. */
    for (int qi = tid; qi < qv; qi += ATT_THREADS) {
        int r = qi / p.gs, g = hg * p.gs + qi % p.gs;
        int row = r0 + r;
        spos[qi] = (r < p.tq && row < tok_end && g < G) ? pos0 + (row - tok0) : -1;
        sm[qi] = ninf;
        sl[qi] = 0.0f;
    }
    for (int i = tid; i < qv * hd; i += ATT_THREADS) {
        int qi = i / hd, d = i % hd;
        int r = qi / p.gs, g = hg * p.gs + qi % p.gs;
        int row = r0 + r;
        bool ok = r < p.tq && row < tok_end && g < G;
        sq[i] = ok ? a.q[(int64_t)row * width + (int64_t)(kvh * G + g) * hd + d] * a.scale : 0.0f;
        sacc[i] = 0.0f;
    }
    __syncthreads();

    const int32_t *btab = a.block_tables + (int64_t)s * a.max_blocks;
    for (int32_t j0 = j_begin; j0 < j_end; j0 += kt) {
        /* K and V tiles together: one memory latency per tile. */
        att_load_tile<KT>(sk, a.k, a, btab, kvh, j0, j_end, kt);
        att_load_tile<KT>(sv, a.v, a, btab, kvh, j0, j_end, kt);
        __syncthreads();
        /* Scores: four threads per (query, position), interleaved over d. */
        for (int pair = tid / 4; pair < qa * kt; pair += ATT_THREADS / 4) {
            int qi = pair / kt, jj = pair % kt, part = tid % 4;
            const float *qr = sq + qi * hd, *kr = sk + jj * (hd + 1);
            float dot = 0.0f;
            for (int d = part; d < hd; d += 4) dot += qr[d] * kr[d];
            dot += __shfl_xor_sync(0xffffffffu, dot, 1);
            dot += __shfl_xor_sync(0xffffffffu, dot, 2);
            if (part == 0) {
                int32_t j = j0 + jj;
                bool ok = spos[qi] >= 0 && j < j_end && j <= spos[qi];
                ssc[qi * kt + jj] = ok ? dot : ninf;
            }
        }
        __syncthreads();
        /* Online softmax, a warp per query and a lane per position. */
        for (int qi = warp; qi < qa; qi += ATT_THREADS / 32) {
            float sc = lane < kt ? ssc[qi * kt + lane] : ninf;
            float mt = sc;
            for (int o = 16; o > 0; o >>= 1) mt = fmaxf(mt, __shfl_xor_sync(0xffffffffu, mt, o));
            float m_old = sm[qi], m_new = fmaxf(m_old, mt);
            float pr = m_new == ninf ? 0.0f : __expf(sc - m_new);
            float alpha = m_new == ninf ? 1.0f : __expf(m_old - m_new);
            float sum = pr;
            for (int o = 16; o > 0; o >>= 1) sum += __shfl_xor_sync(0xffffffffu, sum, o);
            if (lane < kt) ssc[qi * kt + lane] = pr;
            if (lane == 0) {
                sl[qi] = sl[qi] * alpha + sum;
                sm[qi] = m_new;
                salpha[qi] = alpha;
            }
        }
        __syncthreads();
        /* acc = acc * alpha + P . V */
        for (int i = tid; i < qa * hd; i += ATT_THREADS) {
            int qi = i / hd, d = i % hd;
            const float *pr = ssc + qi * kt;
            float acc = sacc[i] * salpha[qi];
            for (int jj = 0; jj < kt; jj++) acc += pr[jj] * sv[jj * (hd + 1) + d];
            sacc[i] = acc;
        }
        __syncthreads();
    }

    for (int i = tid; i < qv * hd; i += ATT_THREADS) {
        int qi = i / hd, d = i % hd;
        if (spos[qi] < 0) continue;
        int row = r0 + qi / p.gs, head = kvh * G + hg * p.gs + qi % p.gs;
        if (p.n_splits == 1) {
            float l = sl[qi];
            a.out[(int64_t)row * width + (int64_t)head * hd + d] = l > 0.0f ? sacc[i] / l : 0.0f;
        } else {
            int64_t slot = ((int64_t)blockIdx.z * a.n_tokens + row) * a.n_heads + head;
            p.part_acc[slot * hd + d] = sacc[i];
            if (d == 0) {
                p.part_ml[slot * 2] = sm[qi];
                p.part_ml[slot * 2 + 1] = sl[qi];
            }
        }
    }
}

/* Merge the splits of one (row, head) (attn_merge.cuh): a thread per dim
 * loads every split's (max, sum) and its partial sum in one round and
 * merges in registers, so the merge costs one memory round trip and no
 * barrier. */
__global__ void attention_combine_kernel(float *__restrict__ out, fp16_t *__restrict__ out16,
                                         const float *__restrict__ part_acc, const float *__restrict__ part_ml,
                                         int32_t n_splits, int32_t n_tokens, int32_t n_heads, int32_t hd,
                                         const int32_t *__restrict__ one_tok0) {
    pdl_begin();
    /* one_tok0 (CUDA_ATT_ONE_ROW): a block per sequence, whose partial
     * sums sit at its index (n_tokens is then the sequence count). */
    const int32_t idx = blockIdx.x, head = blockIdx.y;
    int32_t row = idx;
    if (one_tok0) {
        row = one_tok0[idx];
        if (one_tok0[idx + 1] - row != 1) return;
    }
    for (int d = threadIdx.x; d < hd; d += blockDim.x) {
        float l, acc;
        att_merge_dim<true>(part_acc, part_ml, n_splits, n_tokens, n_heads, hd, idx, head, d, &l, &acc);
        const int64_t i = ((int64_t)row * n_heads + head) * hd + d;
        const float o = l > 0.0f ? acc / l : 0.0f;
        out[i] = o;
        if (out16) out16[i] = f2h(o);
    }
}

/* ---- Decode-only steps: one query row per sequence, F16 cache ----
 * Flash-decoding with the K/V rows in registers.  A block owns one row
 * (its sequence found by binary search), one KV head with all G query
 * heads that share it (GQA: each K/V row is read once for the group) and
 * one slice of the context.  Its 4 warps (8 where att_decode_launch
 * widens the blocks of ungrouped heads) are cut into sub-warps of LP
 * lanes; a sub-warp owns whole positions, LP lanes x 8 dims = one 16-byte
 * load per lane per K or V row, and keeps its own online softmax (max, sum,
 * P.V in registers), so the loop has no barrier; each sub-warp issues the
 * K and V loads of U positions before using any.  The sub-warp states are
 * merged through shared memory at the end. */
#define ATD_THREADS 128

/* TH threads a block (ATD_THREADS, or twice that: att_decode_launch).
 * Groups of 1 (llama2-7b's heads) held to 64 registers, 32 warps a
 * multiprocessor (eight blocks of 4 warps or four of 8), where 72
 * registers would hold fewer. */
template <int G, int LP, int U, int TH>
__global__ void __launch_bounds__(TH, G == 1 ? 8 * ATD_THREADS / TH : 1) attention_decode_kernel(struct att_params p) {
    pdl_begin();
    const struct cuda_attn_args &a = p.a;
    constexpr int HD = LP * 8, SW = 32 / LP, NS = (TH / 32) * SW;
    const int lane = threadIdx.x % 32, li = lane % LP, warp = threadIdx.x / 32, sw = warp * SW + lane / LP;
    const float ninf = -INFINITY;
    const int32_t kvh = blockIdx.y, z = blockIdx.z;
    const bool one = a.rows == CUDA_ATT_ONE_ROW;
    /* The sequence holding this row: last s with seq_tok0[s] <= row.  Of
     * one-row sequences only: a block a sequence, which skips the others
     * (their partial sums go by sequence). */
    int32_t row, s;
    if (!att_decode_row(a, &row, &s)) return;
    const int32_t pos = a.seq_pos0[s] + (row - a.seq_tok0[s]);
    /* The split of this row's own context, from its length in device
     * memory: the launch (sized for the longest context allowed, say, in a
     * replayed graph) has at least as many splits as any row uses, and the
     * ones past a row's context exit empty.  A row's result depends on its
     * length and split_want only, however large the grid. */
    const int32_t len = pos + 1, step = p.split_step;
    int32_t sp = min(p.split_want, (len + p.split_min - 1) / p.split_min);
    sp = max(sp, 1);
    const int32_t chunk = ((len + sp - 1) / sp + step - 1) / step * step;
    const int32_t j_begin = z * chunk, j_end = min(j_begin + chunk, len);
    const int32_t width = a.n_heads * HD;
    const int32_t *btab = a.block_tables + (int64_t)s * a.max_blocks;
    const fp16_t *kc = (const fp16_t *)a.k, *vc = (const fp16_t *)a.v;

    float q[G][8], acc[G][8], m[G], l[G];
#pragma unroll
    for (int g = 0; g < G; g++) {
        const float4 *qp = (const float4 *)(a.q + (int64_t)row * width + (int64_t)(kvh * G + g) * HD + 8 * li);
        float4 q0 = __ldg(qp), q1 = __ldg(qp + 1);
        q[g][0] = q0.x * a.scale;
        q[g][1] = q0.y * a.scale;
        q[g][2] = q0.z * a.scale;
        q[g][3] = q0.w * a.scale;
        q[g][4] = q1.x * a.scale;
        q[g][5] = q1.y * a.scale;
        q[g][6] = q1.z * a.scale;
        q[g][7] = q1.w * a.scale;
        m[g] = ninf;
        l[g] = 0.0f;
#pragma unroll
        for (int e = 0; e < 8; e++) acc[g][e] = 0.0f;
    }

    /* The loop runs the same trips in every lane of a warp (its shuffles
     * need all 32); positions past the slice are masked. */
    for (int32_t jw = j_begin + warp * SW * U; jw < j_end; jw += NS * U) {
        const int32_t j0 = jw + (lane / LP) * U;
        uint4 kr[U], vr[U];
        att_kv_rows<HD, U>(kc, vc, btab, a.max_blocks, a.n_blocks, a.block_size, a.n_kv_heads, kvh, li, j0, j_end,
                           kr, vr);
#pragma unroll
        for (int u = 0; u < U; u++) {
            const bool ok = j0 + u < j_end;
            float kf[8], vf[8];
            const __half2 *kh = (const __half2 *)&kr[u], *vh = (const __half2 *)&vr[u];
#pragma unroll
            for (int e = 0; e < 4; e++) {
                float2 f = __half22float2(kh[e]);
                kf[2 * e] = f.x;
                kf[2 * e + 1] = f.y;
                f = __half22float2(vh[e]);
                vf[2 * e] = f.x;
                vf[2 * e + 1] = f.y;
            }
#pragma unroll
            for (int g = 0; g < G; g++) {
                float d = 0.0f;
#pragma unroll
                for (int e = 0; e < 8; e++) d += q[g][e] * kf[e];
#pragma unroll
                for (int o = LP / 2; o > 0; o >>= 1) d += __shfl_xor_sync(0xffffffffu, d, o);
                if (ok) att_online_add(m[g], l[g], acc[g], d, vf);
            }
        }
    }

    /* Merge the NS sub-warp states: sm[sw][g] = (m, l), sacc[sw][g][HD]. */
    extern __shared__ float smem[];
    float *sml = smem, *sacc = smem + NS * G * 2;
    if (li == 0)
#pragma unroll
        for (int g = 0; g < G; g++) {
            sml[(sw * G + g) * 2] = m[g];
            sml[(sw * G + g) * 2 + 1] = l[g];
        }
#pragma unroll
    for (int g = 0; g < G; g++)
#pragma unroll
        for (int e = 0; e < 8; e++) sacc[(sw * G + g) * HD + 8 * li + e] = acc[g][e];
    __syncthreads();
    for (int i = threadIdx.x; i < G * HD; i += TH) {
        int g = i / HD, d = i % HD;
        float mx = ninf;
        for (int k = 0; k < NS; k++) mx = fmaxf(mx, sml[(k * G + g) * 2]);
        /* A state that saw a NaN row (a block id outside the cache) has a
         * NaN sum, possibly with max -inf: it still counts, so the row
         * comes out NaN. */
        float ls = 0.0f, as = 0.0f;
        for (int k = 0; k < NS; k++) {
            float mk = sml[(k * G + g) * 2], lk = sml[(k * G + g) * 2 + 1];
            if (mk == ninf && lk == 0.0f) continue; /* saw no position */
            float w = mk == ninf ? 0.0f : __expf(mk - mx);
            ls += lk * w;
            as += sacc[(k * G + g) * HD + d] * w;
        }
        int head = kvh * G + g;
        if (p.n_splits == 1) {
            const float o = ls == 0.0f ? 0.0f : as / ls;
            a.out[(int64_t)row * width + (int64_t)head * HD + d] = o;
            if (p.out16) p.out16[(int64_t)row * width + (int64_t)head * HD + d] = f2h(o);
        } else {
            int64_t slot = one ? ((int64_t)z * a.n_seqs + s) * a.n_heads + head
                               : ((int64_t)z * a.n_tokens + row) * a.n_heads + head;
            p.part_acc[slot * HD + d] = as;
            if (d == 0) {
                p.part_ml[slot * 2] = ls != ls ? ls : mx; /* NaN max: the combine keeps it */
                p.part_ml[slot * 2 + 1] = ls;
            }
        }
    }
}

/* TH threads a block: ungrouped heads take blocks of 8 warps where the
 * row x head blocks of 4 fill at most 4 a multiprocessor (ctx->att_wide):
 * twice the warps each multiprocessor holds there (llama2-7b's 16 rows:
 * 512 blocks for 132 multiprocessors). */
template <int G, int LP, int TH = ATD_THREADS>
static int att_decode_launch(struct cuda_ctx *ctx, struct att_params *p) {
    constexpr int U = G <= 2 ? 4 : 2, NS = (TH / 32) * (32 / LP);
    const struct cuda_attn_args *a = &p->a;
    const bool one = a->rows == CUDA_ATT_ONE_ROW;
    /* One-row sequences of a mixed batch: a block a sequence (those with
     * several rows exit), their count at most n_seqs. */
    const int32_t n_idx = one ? a->n_seqs : a->n_tokens;
    int64_t blocks = (int64_t)n_idx * a->n_kv_heads;
    if constexpr (G == 1 && TH == ATD_THREADS)
        if (ctx->att_wide && blocks <= 4LL * ctx->n_sms) return att_decode_launch<G, LP, 2 * ATD_THREADS>(ctx, p);
    /* Split the context over the blocks the kernel holds a multiprocessor
     * (asked once a device), past the fewest that fill one wave too where
     * that takes under 8/10 of the time (cuda_att_split weighs the waves),
     * each split at least ctx->att_steps steps of all its sub-warps:
     * llama2-7b's 40 rows at context 2048 are 1.2 waves of 1056 slots
     * unsplit, 4 splits measured 13% faster a step (docs/cuda-attention.md,
     * "Splitting the context"). */
    const size_t smem = (size_t)NS * G * (2 + LP * 8) * sizeof(float);
    static int per_sm[64];
    int &bps = per_sm[ctx->device >= 0 && ctx->device < 64 ? ctx->device : 0];
    CUDA_CHECK(ctx, cuda_blocks_per_sm(attention_decode_kernel<G, LP, U, TH>, TH, smem, &bps));
    const int64_t step = (int64_t)NS * U;
    struct cuda_att_split sp;
    if (cuda_att_split(ctx, a, n_idx, (int64_t)bps * ctx->n_sms, blocks, 8, step, step * ctx->att_steps,
                       ATT_COMBINE_MAX_SPLITS, &sp) != STATUS_OK)
        return STATUS_NO_MEMORY;
    p->split_want = sp.want;
    p->split_step = sp.step;
    p->split_min = sp.least;
    p->chunk = 0;
    p->n_splits = sp.n_splits;
    p->out16 = (fp16_t *)sp.out16;
    p->part_acc = sp.part_acc;
    p->part_ml = sp.part_ml;
    dim3 grid((unsigned)n_idx, (unsigned)a->n_kv_heads, (unsigned)p->n_splits);
    CUDA_CHECK(ctx, cuda_launch(ctx, (attention_decode_kernel<G, LP, U, TH>), dim3(grid), dim3(TH), smem, *p));
    CUDA_CHECK(ctx, cudaGetLastError());
    if (p->n_splits > 1) {
        CUDA_CHECK(ctx, cuda_launch(ctx, attention_combine_kernel, dim3(n_idx, a->n_heads), dim3(128), 0,
                                    a->out, p->out16, p->part_acc, p->part_ml, p->n_splits, n_idx,
                                    a->n_heads, a->head_dim, one ? a->seq_tok0 : (const int32_t *)NULL));
        CUDA_CHECK(ctx, cudaGetLastError());
    }
    return STATUS_OK;
}

template <int LP> static int att_decode_g(struct cuda_ctx *ctx, struct att_params *p, int32_t G) {
    switch (G) {
    case 1: return att_decode_launch<1, LP>(ctx, p);
    case 2: return att_decode_launch<2, LP>(ctx, p);
    case 4: return att_decode_launch<4, LP>(ctx, p);
    default: return att_decode_launch<8, LP>(ctx, p);
    }
}

/* 1 if the decode kernel takes this step: one row per sequence (every
 * sequence decoding, or the one-row sequences of a mixed batch), F16
 * cache, heads of 64, 128 or 256, groups of 1, 2, 4 or 8 query heads,
 * 16-byte aligned q and cache. */
static int att_decode_ok(const struct cuda_attn_args *a) {
    int32_t G = a->n_heads / a->n_kv_heads, hd = a->head_dim;
    return (a->n_tokens == a->n_seqs || a->rows == CUDA_ATT_ONE_ROW) && a->kv_type == DTYPE_F16 &&
           (hd == 64 || hd == 128 || hd == 256) && (G == 1 || G == 2 || G == 4 || G == 8) &&
           (uintptr_t)a->q % 16 == 0 && (uintptr_t)a->k % 16 == 0 && (uintptr_t)a->v % 16 == 0;
}

static size_t att_smem(int qv, int kt, int hd) {
    return ((size_t)2 * qv * hd + (size_t)2 * kt * (hd + 1) + (size_t)qv * kt + 4 * (size_t)qv) * sizeof(float);
}

static int attention_launch(struct cuda_ctx *ctx, struct att_params *p, size_t smem, dim3 grid) {
    if (p->a.kv_type == DTYPE_F16)
        attention_kernel<DTYPE_F16><<<grid, ATT_THREADS, smem, CUDA_STREAM(ctx)>>>(*p);
    else if (p->a.kv_type == DTYPE_Q8_0)
        attention_kernel<DTYPE_Q8_0><<<grid, ATT_THREADS, smem, CUDA_STREAM(ctx)>>>(*p);
    else
        attention_kernel<DTYPE_F32><<<grid, ATT_THREADS, smem, CUDA_STREAM(ctx)>>>(*p);
    CUDA_CHECK(ctx, cudaGetLastError());
    if (p->n_splits > 1) {
        CUDA_CHECK(ctx, cuda_launch(ctx, attention_combine_kernel, dim3(p->a.n_tokens, p->a.n_heads), dim3(128), 0,
                                    p->a.out, (fp16_t *)NULL, p->part_acc, p->part_ml, p->n_splits, p->a.n_tokens,
                                    p->a.n_heads, p->a.head_dim, (const int32_t *)NULL));
        CUDA_CHECK(ctx, cudaGetLastError());
    }
    return STATUS_OK;
}

extern "C" int cuda_att_scratch(struct cuda_ctx *ctx, const struct cuda_attn_args *a, size_t part_bytes,
                                uint16_t **out16, float **part) {
    *out16 = NULL;
    *part = NULL;
    const int64_t cols = (int64_t)a->n_heads * a->head_dim;
    const bool want = ctx->att_f16 && a->n_tokens > 2 && (uintptr_t)a->out % 16 == 0;
    const size_t x_bytes = want ? ((size_t)a->n_tokens * cols * 2 + 255) & ~(size_t)255 : 0;
    if (x_bytes + part_bytes == 0) return STATUS_OK;
    uint8_t *scr = (uint8_t *)cuda_scratch(ctx, x_bytes + part_bytes);
    if (!scr) return STATUS_NO_MEMORY;
    if (part_bytes) *part = (float *)(scr + x_bytes);
    int fresh = 0;
    if (want && cuda_gemm_act(ctx, a->out, a->n_tokens, cols, out16, &fresh) != STATUS_OK) *out16 = NULL;
    return STATUS_OK;
}

/* The splits a row wants are weighed by cuda_att_split_want (knobs.h). */
extern "C" int cuda_att_split(struct cuda_ctx *ctx, const struct cuda_attn_args *a, int32_t n_idx, int64_t slots,
                              int64_t blocks, int past_tenths, int64_t step, int64_t least, int64_t max_splits,
                              struct cuda_att_split *s) {
    memset(s, 0, sizeof *s);
    const int64_t by_ctx = (a->max_ctx + least - 1) / least;
    int64_t want = cuda_att_split_want(ctx->att_splits, a->max_ctx, slots, blocks, step, by_ctx, past_tenths);
    if (want > max_splits) want = max_splits;
    int64_t splits = want < by_ctx ? want : by_ctx;
    if (splits < 1) splits = 1;
    s->want = (int32_t)want;
    s->step = (int32_t)step;
    s->least = (int32_t)least;
    s->n_splits = (int32_t)splits;
    const size_t parts = splits > 1 ? (size_t)splits * n_idx * a->n_heads : 0;
    float *scr = NULL;
    if (cuda_att_scratch(ctx, a, parts * ((size_t)a->head_dim + 2) * sizeof(float), &s->out16, &scr) != STATUS_OK)
        return STATUS_NO_MEMORY;
    if (splits > 1) {
        s->part_acc = scr;
        s->part_ml = scr + parts * a->head_dim;
    }
    return STATUS_OK;
}

static int attention_run(struct cuda_ctx *ctx, const struct cuda_attn_args *a);

/* A failed launch leaves no F16 form behind for the matmul after it. */
extern "C" int cuda_attention(struct cuda_ctx *ctx, const struct cuda_attn_args *a) {
    const int rc = attention_run(ctx, a);
    if (rc != STATUS_OK) cuda_act_forget(ctx);
    return rc;
}

static int att_decode(struct cuda_ctx *ctx, const struct cuda_attn_args *a) {
    struct att_params p;
    memset(&p, 0, sizeof p);
    p.a = *a;
    const int32_t G = a->n_heads / a->n_kv_heads;
    if (a->head_dim == 64) return att_decode_g<8>(ctx, &p, G);
    if (a->head_dim == 128) return att_decode_g<16>(ctx, &p, G);
    return att_decode_g<32>(ctx, &p, G);
}

/* The sequences of several rows first, then those of one (d): both write
 * their rows of out and of its F16 form.  Should the second launch grow
 * the scratch (a new buffer, perhaps at the same address), the F16 rows of
 * the first went with the old one, and the o matmul converts out for
 * itself. */
static int attention_mixed(struct cuda_ctx *ctx, const struct cuda_attn_args *a, const struct cuda_attn_args *d) {
    struct cuda_attn_args m = *a;
    m.rows = CUDA_ATT_MULTI_ROW;
    int rc = cuda_attention_prefill(ctx, &m);
    if (rc != STATUS_OK) return rc;
    const size_t scr_bytes = ctx->scratch_bytes;
    rc = cuda_attention_gqa_takes(ctx, d)         ? cuda_attention_gqa(ctx, d)
         : cuda_attention_q8_decode_takes(d) ? cuda_attention_q8_decode(ctx, d)
                                             : att_decode(ctx, d);
    if (rc == STATUS_OK && ctx->scratch_bytes != scr_bytes) cuda_act_forget(ctx);
    return rc;
}

static int attention_run(struct cuda_ctx *ctx, const struct cuda_attn_args *a) {
    if (a->n_seqs <= 0 || a->n_tokens < 0 || a->max_blocks <= 0 || a->max_ctx < 0 || a->head_dim <= 0 ||
        a->n_kv_heads <= 0 || a->n_heads <= 0 || a->n_heads % a->n_kv_heads != 0 || a->block_size <= 0)
        return cuda_fail(ctx, STATUS_BAD_INPUT,
                         "attention: %d sequences, %d tokens, %d heads over %d KV heads of %d, block %d x %d",
                         a->n_seqs, a->n_tokens, a->n_heads, a->n_kv_heads, a->head_dim, a->max_blocks,
                         a->block_size);
    if (a->kv_type != DTYPE_F16 && a->kv_type != DTYPE_F32 && a->kv_type != DTYPE_Q8_0)
        return cuda_fail(ctx, STATUS_UNSUPPORTED, "attention: cache type %s", dtype_name(a->kv_type));
    if (a->kv_type == DTYPE_Q8_0 && (a->head_dim % 2 != 0 || a->head_dim % backend_kv_q8_group(a->head_dim) != 0))
        return cuda_fail(ctx, STATUS_UNSUPPORTED, "attention: Q8_0 cache with head_dim %d", a->head_dim);
    if (a->n_tokens == 0) return STATUS_OK;
    /* Batches with prefill rows: tensor cores (attention_prefill.cu), with
     * their one-row sequences split off to the decode kernels where those
     * take them (cuda_att_rows): a decode row alone in a prefill tile of
     * 64 query rows made a 7B step of 63 decodes and a 6-token prefill
     * cost 2.7 times a decode-only step (docs/router.md).  Groups that
     * decode on tensor cores anyway stay in the one launch. */
    if (cuda_attention_prefill_takes(a)) {
        struct cuda_attn_args d = *a;
        d.rows = CUDA_ATT_ONE_ROW;
        const bool tc_decode = ctx->decode_tc_g > 0 && a->kv_type == DTYPE_F16 &&
                               a->n_heads / a->n_kv_heads >= ctx->decode_tc_g;
        if (a->rows == CUDA_ATT_ALL && a->n_seqs > 1 &&
            (cuda_attention_gqa_takes(ctx, &d) ||
             (!tc_decode && (cuda_attention_q8_decode_takes(&d) || att_decode_ok(&d)))))
            return attention_mixed(ctx, a, &d);
        return cuda_attention_prefill(ctx, a);
    }
    /* Decode-only batches of grouped heads on an F16 cache: attention_gqa.cu. */
    if (cuda_attention_gqa_takes(ctx, a)) return cuda_attention_gqa(ctx, a);
    /* Decode-only batches of large groups on an F16 cache: the tensor-core
     * kernel, whose mma take the group's heads as rows (the decode kernel's
     * per-head dot products and shuffles are instruction-bound there).  An
     * 8-bit cache keeps attention_q8.cu, which reads its rows as stored. */
    if (ctx->decode_tc_g > 0 && a->kv_type == DTYPE_F16 && a->n_tokens == a->n_seqs &&
        a->n_heads / a->n_kv_heads >= ctx->decode_tc_g && cuda_attention_tc_fits(a))
        return cuda_attention_prefill(ctx, a);
    /* Decode-only batches on an 8-bit cache: attention_q8.cu. */
    if (cuda_attention_q8_decode_takes(a)) return cuda_attention_q8_decode(ctx, a);
    if (att_decode_ok(a)) return att_decode(ctx, a);
    struct att_params p;
    memset(&p, 0, sizeof p);
    p.a = *a;
    int hd = a->head_dim;
    /* Short KV tiles for wide heads keep a block small enough for several
     * per multiprocessor (a T4 has 64 KiB of shared memory per SM). */
    p.kt = hd <= 64 ? 32 : 16;
    int32_t G = a->n_heads / a->n_kv_heads;
    /* Query vectors per block: a decode-only step has one row per
     * sequence, so the group of heads is all a block can share. */
    int qv_want = 32;
    if (a->n_tokens == a->n_seqs) {
        qv_want = 1;
        while (qv_want < G && qv_want < 32) qv_want *= 2;
    }
    p.qv = 0;
    for (int qv = qv_want; qv >= 1; qv /= 2)
        if (att_smem(qv, p.kt, hd) <= ATT_SMEM_MAX) {
            p.qv = qv;
            break;
        }
    if (!p.qv)
        return cuda_fail(ctx, STATUS_UNSUPPORTED, "attention: head_dim %d needs more shared memory than %d bytes", hd,
                         ATT_SMEM_MAX);
    p.gs = G < p.qv ? G : p.qv;
    p.n_hgroups = (G + p.gs - 1) / p.gs;
    p.tq = p.qv / p.gs;
    /* Every tile holds at least one row, and a sequence wastes at most one
     * partial tile. */
    int64_t tiles = (a->n_tokens + p.tq - 1) / p.tq + a->n_seqs;
    if (tiles > a->n_tokens) tiles = a->n_tokens;
    int64_t tiles_busy = (a->n_tokens + p.tq - 1) / p.tq;
    if (tiles_busy < a->n_seqs) tiles_busy = a->n_seqs < a->n_tokens ? a->n_seqs : a->n_tokens;
    int64_t blocks = tiles_busy * a->n_kv_heads * p.n_hgroups;
    /* Split the context until there are about 4 blocks per multiprocessor
     * (a split keeps at least one KV tile). */
    int64_t want = (4LL * ctx->n_sms + blocks - 1) / blocks;
    int64_t by_ctx = (a->max_ctx + p.kt - 1) / p.kt;
    int64_t splits = want < by_ctx ? want : by_ctx;
    if (splits > ATT_COMBINE_MAX_SPLITS) splits = ATT_COMBINE_MAX_SPLITS;
    if (splits < 1) splits = 1;
    int64_t per = (a->max_ctx + splits - 1) / splits;
    p.chunk = (int32_t)((per + p.kt - 1) / p.kt * p.kt);
    if (p.chunk < p.kt) p.chunk = p.kt;
    p.n_splits = (int32_t)splits;
    if (p.n_splits > 1) {
        size_t slots = (size_t)p.n_splits * a->n_tokens * a->n_heads;
        float *scr = (float *)cuda_scratch(ctx, slots * ((size_t)hd + 2) * sizeof(float));
        if (!scr) return STATUS_NO_MEMORY;
        p.part_acc = scr;
        p.part_ml = scr + slots * hd;
    }
    dim3 grid((unsigned)tiles, (unsigned)(a->n_kv_heads * p.n_hgroups), (unsigned)p.n_splits);
    return attention_launch(ctx, &p, att_smem(p.qv, p.kt, hd), grid);
}
