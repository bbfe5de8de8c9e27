/* Decode attention over the 8-bit (Q8_0) KV cache: one query row per
 * sequence, the int8 rows read as they are stored.
 *
 * Flash-decoding as attention.cu's F16 decode kernel: a block owns one
 * row, one KV head with the G query heads that share it (each K/V row is
 * read once for the group) and one slice of the context, merged by a
 * combine kernel when the context is split.  A cache row of a KV head is
 * head_dim / Q groups of (F16 scale, Q int8), Q + 2 bytes a group, with
 * Q = backend_kv_q8_group (kernels/backend.h): 64 for heads of 128 and
 * 256, 32 for 64.  A row's groups sit at 2-byte offsets that no 16-byte
 * load can follow.  Each warp therefore copies whole chunks of T
 * consecutive positions (contiguous in the cache four positions at a time,
 * 16-byte aligned) into a shared buffer of its own with 16-byte loads, and
 * its sub-warps read their rows from there with 4-byte loads; the next
 * chunk's loads are issued before the present chunk is used, and only
 * __syncwarp orders the buffer, so the loop has no block barrier.  A lane
 * owns 8 dims of a row (one group holds Q / 8 lanes' dims, so the scale is
 * applied once per 8 values); the int8 values become floats by a byte
 * permute into a float's mantissa and one subtraction (conversion
 * instructions run at a quarter of the rate). */
#include "attention_prefill.h"
#include "attn_merge.cuh"
#include "common.cuh"

#include "../backend.h"

#include <math.h>

#define ATQ_THREADS 128
#define ATQ_WARPS (ATQ_THREADS / 32)
/* Most context splits of one launch (the merge's own bound). */
#define ATQ_MAX_SPLITS 64

struct atq_params {
    struct cuda_attn_args a;
    int32_t lbs;        /* log2(block_size) */
    int32_t n_splits;   /* grid z: enough for the longest row */
    int32_t split_want; /* most splits of one row */
    int32_t split_step; /* a split's positions are a multiple of this (ATQ_WARPS chunks) */
    int32_t split_min;  /* and at least this many */
    float *part_acc;    /* (n_splits, n_tokens, n_heads, head_dim) unnormalized sums */
    float *part_ml;     /* (n_splits, n_tokens, n_heads, 2) running max and sum */
    fp16_t *out16;      /* out's F16 form too, unless NULL (cuda_att_scratch) */
};

/* Four int8 of w as floats: w ^ 0x80808080 is each value + 128 as a byte,
 * which a byte permute puts in the mantissa of 2^23 (0x4B0000xx), so the
 * float is 2^23 + 128 + value exactly. */
__device__ __forceinline__ void atq_i8x4(uint32_t w, float *f) {
    const uint32_t x = w ^ 0x80808080u;
    f[0] = __uint_as_float(__byte_perm(x, 0x4B000000u, 0x7440)) - 8388736.0f;
    f[1] = __uint_as_float(__byte_perm(x, 0x4B000000u, 0x7441)) - 8388736.0f;
    f[2] = __uint_as_float(__byte_perm(x, 0x4B000000u, 0x7442)) - 8388736.0f;
    f[3] = __uint_as_float(__byte_perm(x, 0x4B000000u, 0x7443)) - 8388736.0f;
}

/* A lane's 8 values of a row in the warp's buffer (row at a 4-byte
 * aligned address): the scale of its group and the int8 as floats.  wo is
 * the 4-byte word holding the first value, sh 16 when the values start
 * at the word's third byte (even groups), else 0: three aligned words and
 * two funnel shifts give the 8 bytes. */
__device__ __forceinline__ float atq_row(const uint8_t *row, int so, int wo, int sh, float *f) {
    const uint32_t *w = (const uint32_t *)(row + wo);
    const uint32_t w0 = w[0], w1 = w[1], w2 = w[2];
    atq_i8x4(__funnelshift_r(w0, w1, sh), f);
    atq_i8x4(__funnelshift_r(w1, w2, sh), f + 4);
    return h2f(*(const fp16_t *)(row + so));
}

/* G query heads per KV head, LP lanes a row (head_dim = 8 LP), chunks of
 * T positions a warp. */
template <int G, int LP, int T>
__global__ void __launch_bounds__(ATQ_THREADS) attention_q8_decode_kernel(struct atq_params p) {
    pdl_begin();
    const struct cuda_attn_args &a = p.a;
    constexpr int HD = LP * 8, Q = backend_kv_q8_group(HD), RB = HD / Q * (Q + 2); /* values a scale, bytes a row */
    constexpr int SW = 32 / LP, U = T / SW, NS = ATQ_WARPS * SW;
    constexpr int CB = T * RB, NP = CB / 16, PPL = (NP + 31) / 32; /* chunk bytes, 16-byte pieces */
    constexpr int QB = 4 * RB, QP = QB / 16;                        /* four rows: 16-byte aligned */
    constexpr int BUF = CB + 16; /* a lane's third word may read past the last row */
    static_assert(HD % Q == 0 && Q % 32 == 0 && RB % 4 == 0 && T % SW == 0 && T % 4 == 0 && QB % 16 == 0,
                  "atq shape");
    const float ninf = -INFINITY;
    const int lane = threadIdx.x % 32, warp = threadIdx.x / 32, li = lane % LP, sub = lane / LP;
    const int32_t kvh = blockIdx.y, z = blockIdx.z;
    const bool one = a.rows == CUDA_ATT_ONE_ROW;

    /* The sequence holding this row, and this split of its context (from
     * its length in device memory, as attention.cu's decode kernel: the
     * grid has enough splits for the longest row, the rest exit empty).
     * CUDA_ATT_ONE_ROW: a block a sequence, skipping those of several rows
     * (partial sums by sequence). */
    int32_t row, s;
    if (!att_decode_row(a, &row, &s)) return;
    const int32_t len = a.seq_pos0[s] + (row - a.seq_tok0[s]) + 1, step = p.split_step;
    int32_t sp = min(p.split_want, (len + p.split_min - 1) / p.split_min);
    sp = max(sp, 1);
    const int32_t chunk = ((len + sp - 1) / sp + step - 1) / step * step;
    const int32_t j_begin = z * chunk, j_end = min(j_begin + chunk, len);
    const int32_t width = a.n_heads * HD, bmask = a.block_size - 1;
    const int32_t *btab = a.block_tables + (int64_t)s * a.max_blocks;
    const uint8_t *kc = (const uint8_t *)a.k, *vc = (const uint8_t *)a.v;

    float q[G][8], acc[G][8], m[G], l[G];
#pragma unroll
    for (int g = 0; g < G; g++) {
        const float4 *qp = (const float4 *)(a.q + (int64_t)row * width + (int64_t)(kvh * G + g) * HD + 8 * li);
        const float4 q0 = __ldg(qp), q1 = __ldg(qp + 1);
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

    /* Where this lane's 8 values lie in a row: group gi = li / (Q / 8),
     * bytes (Q + 2) gi + 2 + 8 (li % (Q / 8)) onwards; rows are 4-byte
     * aligned (RB is a multiple of 4) and Q + 2 is 2 mod 4, so the phase
     * depends on the group's parity only: 2 bytes into a word in even
     * groups, on a word in odd ones. */
    const int gi = li / (Q / 8), vo = (Q + 2) * gi + 2 + 8 * (li % (Q / 8));
    const int so = (Q + 2) * gi, wo = vo & ~3, sh = (vo & 3) * 8;

    extern __shared__ __align__(16) uint8_t atq_smem[];
    uint8_t *kbuf = atq_smem + (size_t)warp * 2 * BUF, *vbuf = kbuf + BUF;

    /* Piece i of a chunk at c0: the rows of positions c0 + 4 (i / QP) ..
     * + 3 lie in one cache block (c0 and block_size are multiples of 4), at
     * byte 16 i - QB (i / QP) of them.  Positions past the slice: not
     * loaded (their scores are masked); a block id outside the cache: all
     * ones, whose F16 scale is NaN, so the row comes out NaN. */
    uint4 kr[PPL], vr[PPL];
    auto load_chunk = [&](int32_t c0) {
#pragma unroll
        for (int k = 0; k < PPL; k++) {
            const int i = lane + 32 * k, quad = i / QP;
            const int32_t j = c0 + 4 * quad;
            kr[k] = vr[k] = make_uint4(0, 0, 0, 0);
            if (i < NP && j < j_end) {
                const int32_t bi = j >> p.lbs, blk = bi < a.max_blocks ? __ldg(btab + bi) : -1;
                if (blk < 0 || blk >= a.n_blocks) {
                    kr[k] = vr[k] = make_uint4(~0u, ~0u, ~0u, ~0u);
                } else {
                    const size_t at = (((size_t)blk * a.n_kv_heads + kvh) * a.block_size + (j & bmask)) * RB +
                                      (size_t)(16 * i - QB * quad);
                    kr[k] = __ldg((const uint4 *)(kc + at));
                    vr[k] = __ldg((const uint4 *)(vc + at));
                }
            }
        }
    };

    /* Warp w walks chunks j_begin + (w + ATQ_WARPS n) T; the trip count is
     * the warp's own, the same in all its lanes (the shuffles need 32). */
    int32_t c0 = j_begin + warp * T;
    if (c0 < j_end) load_chunk(c0);
    for (; c0 < j_end; c0 += ATQ_WARPS * T) {
        __syncwarp(); /* every lane is done with the last chunk's rows */
#pragma unroll
        for (int k = 0; k < PPL; k++) {
            const int i = lane + 32 * k;
            if (i < NP) {
                *(uint4 *)(kbuf + 16 * i) = kr[k];
                *(uint4 *)(vbuf + 16 * i) = vr[k];
            }
        }
        __syncwarp();
        if (c0 + ATQ_WARPS * T < j_end) load_chunk(c0 + ATQ_WARPS * T);
#pragma unroll
        for (int u = 0; u < U; u++) {
            /* Sub-warps take alternate rows of the chunk. */
            const int t = u * SW + sub;
            const bool ok = c0 + t < j_end;
            float kf[8], vf[8];
            const float ks = atq_row(kbuf + t * RB, so, wo, sh, kf);
            const float vs = atq_row(vbuf + t * RB, so, wo, sh, vf);
#pragma unroll
            for (int g = 0; g < G; g++) {
                float d = 0.0f;
#pragma unroll
                for (int e = 0; e < 8; e++) d += q[g][e] * kf[e];
                d *= ks;
                /* The butterfly leaves the same sum, bit for bit, in every
                 * lane of the sub-warp, so its branches below agree. */
#pragma unroll
                for (int o = LP / 2; o > 0; o >>= 1) d += __shfl_xor_sync(0xffffffffu, d, o);
                if (ok) {
                    /* Rescale only when the max grows (rare past the first
                     * positions).  A NaN score fails the test and reaches
                     * l and acc through pr. */
                    if (d > m[g]) {
                        const float alpha = __expf(m[g] - d);
                        l[g] *= alpha;
#pragma unroll
                        for (int e = 0; e < 8; e++) acc[g][e] *= alpha;
                        m[g] = d;
                    }
                    const float pr = __expf(d - m[g]), pv = pr * vs;
                    l[g] += pr;
#pragma unroll
                    for (int e = 0; e < 8; e++) acc[g][e] = fmaf(pv, vf[e], acc[g][e]);
                }
            }
        }
    }

    /* Merge the NS sub-warp states through shared memory (reusing the
     * buffers): sml[sw][g] = (m, l), sacc[sw][g][HD]. */
    __syncthreads();
    float *sml = (float *)atq_smem, *sacc = sml + NS * G * 2;
    const int sw = warp * SW + sub;
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
    for (int i = threadIdx.x; i < G * HD; i += ATQ_THREADS) {
        const int g = i / HD, dd = i % HD;
        float mx = ninf;
        for (int k = 0; k < NS; k++) mx = fmaxf(mx, sml[(k * G + g) * 2]);
        /* A state that saw a NaN row has a NaN sum, perhaps with max
         * -inf: it still counts, so the row comes out NaN. */
        float ls = 0.0f, as = 0.0f;
        for (int k = 0; k < NS; k++) {
            const float mk = sml[(k * G + g) * 2], lk = sml[(k * G + g) * 2 + 1];
            if (mk == ninf && lk == 0.0f) continue; /* saw no position */
            const float w = mk == ninf ? 0.0f : __expf(mk - mx);
            ls += lk * w;
            as += sacc[(k * G + g) * HD + dd] * w;
        }
        const int64_t head = kvh * G + g;
        if (p.n_splits == 1) {
            const float o = ls == 0.0f ? 0.0f : as / ls;
            a.out[(int64_t)row * width + head * HD + dd] = o;
            if (p.out16) p.out16[(int64_t)row * width + head * HD + dd] = f2h(o);
        } else {
            const int64_t slot = one ? ((int64_t)z * a.n_seqs + s) * a.n_heads + head
                                     : ((int64_t)z * a.n_tokens + row) * a.n_heads + head;
            p.part_acc[slot * HD + dd] = as;
            if (dd == 0) {
                p.part_ml[slot * 2] = ls != ls ? ls : mx; /* NaN max: the merge keeps it */
                p.part_ml[slot * 2 + 1] = ls;
            }
        }
    }
}

/* Chunks of 16 positions a warp for groups of 1-2 (4.1 KB of K and V in
 * flight for heads of 128), 8 for 4 and 4 for 8, where the group's q and
 * sums already hold 144 registers. */
template <int G, int LP>
static int atq_launch(struct cuda_ctx *ctx, struct atq_params *p) {
    constexpr int T = G <= 2 ? 16 : G == 4 ? 8 : 4;
    constexpr int HD = LP * 8, Q = backend_kv_q8_group(HD), RB = HD / Q * (Q + 2), SW = 32 / LP,
                  NS = ATQ_WARPS * SW;
    const struct cuda_attn_args *a = &p->a;
    const bool one = a->rows == CUDA_ATT_ONE_ROW;
    const int32_t n_idx = one ? a->n_seqs : a->n_tokens; /* blocks (and sums) by sequence or by row */
    const int64_t blocks = (int64_t)n_idx * a->n_kv_heads;
    const size_t stage = (size_t)ATQ_WARPS * 2 * (T * RB + 16), merge = (size_t)NS * G * (2 + HD) * sizeof(float);
    const size_t smem = stage > merge ? stage : merge;
    /* Split the context as cuda_att_split weighs the waves of the
     * blocks this variant holds a multiprocessor (asked of CUDA once a
     * device: 5 for heads of 128 ungrouped), past the fewest that fill
     * one wave too, each split at least ctx->att_steps chunks of every
     * warp: blocks of thousands of positions leave a long last wave
     * (docs/cuda-attention.md, "The 8-bit decode kernel"). */
    static int per_sm[64];
    int &bps = per_sm[ctx->device >= 0 && ctx->device < 64 ? ctx->device : 0];
    CUDA_CHECK(ctx, cuda_blocks_per_sm(attention_q8_decode_kernel<G, LP, T>, ATQ_THREADS, smem, &bps));
    const int64_t step = (int64_t)ATQ_WARPS * T;
    struct cuda_att_split sp;
    if (cuda_att_split(ctx, a, n_idx, (int64_t)bps * ctx->n_sms, blocks, 9, step, step * ctx->att_steps,
                       ATQ_MAX_SPLITS, &sp) != STATUS_OK)
        return STATUS_NO_MEMORY;
    p->split_want = sp.want;
    p->split_step = sp.step;
    p->split_min = sp.least;
    p->n_splits = sp.n_splits;
    p->out16 = (fp16_t *)sp.out16;
    p->part_acc = sp.part_acc;
    p->part_ml = sp.part_ml;
    const dim3 grid((unsigned)n_idx, (unsigned)a->n_kv_heads, (unsigned)p->n_splits);
    CUDA_CHECK(ctx, cuda_launch(ctx, (attention_q8_decode_kernel<G, LP, T>), grid, dim3(ATQ_THREADS), smem, *p));
    CUDA_CHECK(ctx, cudaGetLastError());
    if (p->n_splits > 1) {
        CUDA_CHECK(ctx, cuda_launch(ctx, attention_combine_kernel, dim3(n_idx, a->n_heads), dim3(128), 0,
                                    a->out, p->out16, p->part_acc, p->part_ml, p->n_splits, n_idx,
                                    a->n_heads, a->head_dim, one ? a->seq_tok0 : (const int32_t *)NULL));
        CUDA_CHECK(ctx, cudaGetLastError());
    }
    return STATUS_OK;
}

template <int LP> static int atq_g(struct cuda_ctx *ctx, struct atq_params *p, int32_t G) {
    switch (G) {
    case 1: return atq_launch<1, LP>(ctx, p);
    case 2: return atq_launch<2, LP>(ctx, p);
    case 4: return atq_launch<4, LP>(ctx, p);
    default: return atq_launch<8, LP>(ctx, p);
    }
}

extern "C" int cuda_attention_q8_decode_takes(const struct cuda_attn_args *a) {
    if (a->n_kv_heads <= 0 || a->n_heads % a->n_kv_heads != 0) return 0;
    const int32_t G = a->n_heads / a->n_kv_heads, hd = a->head_dim, bs = a->block_size;
    return a->kv_type == DTYPE_Q8_0 && (a->n_tokens == a->n_seqs || a->rows == CUDA_ATT_ONE_ROW) &&
           (hd == 64 || hd == 128 || hd == 256) && (G == 1 || G == 2 || G == 4 || G == 8) && bs >= 4 &&
           (bs & (bs - 1)) == 0 && (uintptr_t)a->q % 16 == 0 && (uintptr_t)a->k % 16 == 0 &&
           (uintptr_t)a->v % 16 == 0;
}

extern "C" int cuda_attention_q8_decode(struct cuda_ctx *ctx, const struct cuda_attn_args *a) {
    if (!cuda_attention_q8_decode_takes(a))
        return cuda_fail(ctx, STATUS_UNSUPPORTED,
                         "attention_q8_decode: %s cache, head_dim %d, %d heads over %d KV heads, block %d, "
                         "%d rows of %d sequences",
                         dtype_name(a->kv_type), a->head_dim, a->n_heads, a->n_kv_heads, a->block_size,
                         a->n_tokens, a->n_seqs);
    struct atq_params p;
    memset(&p, 0, sizeof p);
    p.a = *a;
    while ((1 << p.lbs) < a->block_size) p.lbs++;
    const int32_t G = a->n_heads / a->n_kv_heads;
    if (a->head_dim == 64) return atq_g<8>(ctx, &p, G);
    if (a->head_dim == 128) return atq_g<16>(ctx, &p, G);
    return atq_g<32>(ctx, &p, G);
}
