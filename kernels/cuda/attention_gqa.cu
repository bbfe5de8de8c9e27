/* Decode attention of grouped query heads on tensor cores: every sequence
 * (or the one-row sequences of a mixed batch) has one query row, the F16
 * cache holds n_kv_heads heads of 64 or 128 dims, and G = n_heads /
 * n_kv_heads query heads (2 to 16) share each KV head.
 *
 * A block owns one row, one KV head and one slice of its context; each of
 * its 4 warps walks steps of 16 positions of the slice with its own online
 * softmax, and the warps' states are merged in shared memory at the end
 * (across slices by attention.cu's combine kernel).  The G query heads are
 * the rows of the mma's A operand (16 rows: G <= 8 leave rows 8-15 empty),
 * so each K/V row is read once for the whole group and the dot products
 * and P.V are mma.sync m16n8k16 (two m16n8k8 on sm_75), F16 in, F32
 * accumulate; the softmax is per (head, position) in the S accumulators,
 * with no shuffles but the 4 lanes of a row.
 *
 * Lane (g, t) loads 16 bytes of its position's K and V rows a 32-dim group
 * (dims 32 c + 8 t ..): S = Q.K^T takes them as B fragments under a
 * permutation of the dims (the same for Q's A fragments), and P.V's B
 * fragments are the V words transposed in registers (movmatrix), whose
 * output columns then land on dims 32 c + 8 t + 2 u .. of lane t's
 * accumulators: 8 contiguous dims a group.  On sm_80 and later those
 * words travel through shared memory (LLM_CUDA_ATT_RING): each lane copies
 * its own with cp.async two steps ahead into a ring of three stages a warp
 * and reads them back before the step, which keeps twice the bytes in
 * flight that registers can hold (255 of them, a step ahead) and leaves
 * the kernel 150-160 registers.
 *
 * An 8-bit (Q8_0) cache takes the same path.  Its rows (backend_kv_q8_group:
 * two groups of an F16 scale and 64 or 32 int8 values, 132 or 68 bytes)
 * sit at 2-byte offsets that no 16-byte load can follow, but a step's 16
 * positions (blocks of a multiple of 16 positions) are 16 consecutive
 * rows: each warp copies them into a shared buffer of its own with 16-byte
 * loads a step ahead (on sm_80 and later, where the rows' blocks fit one
 * wave, by cp.async into a ring of such buffers two steps ahead: 145
 * registers, three blocks a multiprocessor), and its lanes read their 8
 * values a group from there as int8, which become F16 exactly (a byte
 * permute into 1024 + 128 + q and one subtraction).  The scales stay out
 * of the products: S is summed per group and each group's sum scaled by
 * its K row's scale in F32, and each V group's P.V takes P times the V
 * row's scale, so that the int8 values need no rounding and the output
 * carries the F16 rounding of P and Q alone, as with an F16 cache.
 *
 * ROPE (cuda_attention_gqa_rope: speculation's verifying steps, sequences
 * of 2-16 rows on an F16 cache, rows x G at most 16) puts all the rows of
 * one sequence times the G heads in the mma's rows (row r, head h:
 * r G + h), each masked at its own position, so that the K/V rows are
 * read once for all of them, as a group's heads are.  It also does the
 * rope and the cache write that rope.cu's launch before it would: q comes
 * unrotated from the matmul and is rotated as its fragments are formed;
 * positions from the sequence's first new row on come from the matmul's k
 * (rotated) and v rows, rounded to F16 as the cache keeps them, and
 * written to the cache by the block whose slice holds them.  A lane's 8
 * dims of each 32-dim group hold both dims of every pair it rotates:
 * (2i, 2i + 1), or in the neox pairing (i, i + HD / 2), the same dims of
 * group c + HD / 64.
 * Each row's cosines and sines are formed once a block (att_rope_cs),
 * as attention_prefill.cu's ROPE kernel forms them. */
#include "attention_prefill.h"
#include "attn_merge.cuh"
#include "common.cuh"
#include "knobs.h"

#include "../backend.h"

#define AGQ_WARPS 4
#define AGQ_STEP 16 /* positions a warp takes at a time */
#define AGQ_SPLITS_MAX 64
/* Positions a block's warps take a step, and the least a context split
 * holds: two steps of every warp. */
#define AGQ_SPLIT_STEP (AGQ_WARPS * AGQ_STEP)
#define AGQ_SPLIT_LEAST (2 * AGQ_SPLIT_STEP)
/* The 8-bit ring's margin past the fill, in tenths (cuda_att_split_want):
 * its routing and its launch weigh with the same one. */
#define AGQ_Q8_RING_TENTHS 8
#define AGQ_ROPE_ROWS 16 /* most rows x G of a sequence the ROPE kernel takes: the mma's rows */
#define AGQ_RING_AHEAD_MIN 32 /* fewest steps a warp in a slice for a ring to ask L2 ahead */

struct agq_params {
    struct cuda_attn_args a;
    struct cuda_att_split sp;
    int ahead; /* ctx->l2_ahead: steps past the next one asked of L2 */
    /* ROPE: the rows' k and v as the matmuls left them (n_tokens,
     * n_kv_heads * head_dim; q is a.q, unrotated too), each row's cache
     * slot, and the head_dim / 2 frequencies. */
    const float *k_new, *v_new;
    const int32_t *slots;
    const float *inv_freq;
    int32_t neox;
};

__device__ __forceinline__ uint32_t agq_pack(float lo, float hi) {
    __half2 h = __floats2half2_rn(lo, hi);
    return *(const uint32_t *)&h;
}

/* d += a . b for the m16n8k16 tile: a0/a2 row g, a1/a3 row g + 8, k slots
 * 2t, 2t + 1 (a0, a1, b0) and 2t + 8, 2t + 9 (a2, a3, b1). */
__device__ __forceinline__ void agq_mma(float (&d)[4], uint32_t a0, uint32_t a1, uint32_t a2, uint32_t a3,
                                        uint32_t b0, uint32_t b1) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 800
    asm volatile("mma.sync.aligned.m16n8k16.row.col.f32.f16.f16.f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, "
                 "{%0,%1,%2,%3};\n"
                 : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3])
                 : "r"(a0), "r"(a1), "r"(a2), "r"(a3), "r"(b0), "r"(b1));
#else
    asm volatile("mma.sync.aligned.m16n8k8.row.col.f32.f16.f16.f32 {%0,%1,%2,%3}, {%4,%5}, {%6}, {%0,%1,%2,%3};\n"
                 : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3])
                 : "r"(a0), "r"(a1), "r"(b0));
    asm volatile("mma.sync.aligned.m16n8k8.row.col.f32.f16.f16.f32 {%0,%1,%2,%3}, {%4,%5}, {%6}, {%0,%1,%2,%3};\n"
                 : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3])
                 : "r"(a2), "r"(a3), "r"(b1));
#endif
}

/* The 8 x 8 matrix of 16-bit values whose row r lane (r, t) holds at
 * columns 2t, 2t + 1, transposed. */
__device__ __forceinline__ uint32_t agq_trans(uint32_t x) {
    uint32_t y;
    asm volatile("movmatrix.sync.aligned.m8n8.trans.b16 %0, %1;\n" : "=r"(y) : "r"(x));
    return y;
}

/* Lane (g, t)'s K and V words of positions j0 + g and j0 + 8 + g (dims
 * 32 c + 8 t .. of each group c): zeros past the slice (masked by the
 * caller), NaN for a block id outside the cache, which then reaches the
 * output. */
template <int HD>
__device__ __forceinline__ void agq_load(const struct cuda_attn_args &a, const int32_t *btab, const fp16_t *kc,
                                         const fp16_t *vc, int32_t kvh, int32_t j0, int32_t j_end, int g, int t,
                                         uint4 (&kr)[2][HD / 32], uint4 (&vr)[2][HD / 32]) {
#pragma unroll
    for (int e = 0; e < 2; e++) {
        const int32_t j = j0 + 8 * e + g;
        const int32_t bi = j / a.block_size, blk = j >= j_end ? 0 : bi < a.max_blocks ? btab[bi] : -1;
        const bool bad = j < j_end && (blk < 0 || blk >= a.n_blocks);
        const size_t at =
            (((size_t)(bad ? 0 : blk) * a.n_kv_heads + kvh) * a.block_size + j % a.block_size) * HD + 8 * t;
#pragma unroll
        for (int c = 0; c < HD / 32; c++) {
            if (j < j_end && !bad) {
                kr[e][c] = __ldg((const uint4 *)(kc + at + 32 * c));
                vr[e][c] = __ldg((const uint4 *)(vc + at + 32 * c));
            } else {
                const uint32_t f = bad ? 0x7e007e00u : 0u;
                kr[e][c] = vr[e][c] = make_uint4(f, f, f, f);
            }
        }
    }
}

/* sm_80+ (RING): agq_load's words copied with cp.async into the lane's
 * own slots of a ring stage (piece (c, e, K/V) at st[(4 c + 2 e + kv) 32
 * + lane], so that a warp's 16-byte reads of one piece are 512 contiguous
 * bytes), zeros past the slice; bit e of the result set where position
 * j0 + 8 e + g has a block id outside the cache (agq_read then gives NaN). */
template <int HD>
__device__ __forceinline__ uint32_t agq_copy(const struct cuda_attn_args &a, const int32_t *btab, const fp16_t *kc,
                                             const fp16_t *vc, int32_t kvh, int32_t j0, int32_t j_end, int g, int t,
                                             int lane, uint4 *st) {
    uint32_t bad_bits = 0;
#pragma unroll
    for (int e = 0; e < 2; e++) {
        const int32_t j = j0 + 8 * e + g;
        const int32_t bi = j / a.block_size, blk = j >= j_end ? 0 : bi < a.max_blocks ? btab[bi] : -1;
        const bool bad = j < j_end && (blk < 0 || blk >= a.n_blocks), in = j < j_end && !bad;
        const size_t at =
            (((size_t)(in ? blk : 0) * a.n_kv_heads + kvh) * a.block_size + j % a.block_size) * HD + 8 * t;
#pragma unroll
        for (int c = 0; c < HD / 32; c++) {
            cp_async16(st + (4 * c + 2 * e) * 32 + lane, kc + at + 32 * c, in ? 16 : 0);
            cp_async16(st + (4 * c + 2 * e + 1) * 32 + lane, vc + at + 32 * c, in ? 16 : 0);
        }
        bad_bits |= (uint32_t)bad << e;
    }
    return bad_bits;
}

/* The lane's words of a ring stage (agq_copy's), as agq_load leaves them. */
template <int HD>
__device__ __forceinline__ void agq_read(const uint4 *st, int lane, uint32_t bad_bits, uint4 (&kr)[2][HD / 32],
                                         uint4 (&vr)[2][HD / 32]) {
#pragma unroll
    for (int e = 0; e < 2; e++)
#pragma unroll
        for (int c = 0; c < HD / 32; c++) {
            kr[e][c] = st[(4 * c + 2 * e) * 32 + lane];
            vr[e][c] = st[(4 * c + 2 * e + 1) * 32 + lane];
            if (bad_bits >> e & 1) kr[e][c] = vr[e][c] = make_uint4(0x7e007e00u, 0x7e007e00u, 0x7e007e00u, 0x7e007e00u);
        }
}

/* ROPE: lane t's 8 dims of 32-dim groups c and c + HD / 64 of one row
 * (x0, x1), rotated as rope.cu rotates them (cs: the row's (cos, sin) of
 * each of the HD / 2 frequencies). */
template <int HD>
__device__ __forceinline__ void agq_rotate2(float (&x0)[8], float (&x1)[8], int c, const float2 *cs, int t,
                                            int neox) {
    constexpr int NC = HD / 32;
    if (neox) {
#pragma unroll
        for (int e = 0; e < 8; e++) {
            const float2 r = cs[32 * c + 8 * t + e];
            const float lo = x0[e], hi = x1[e];
            x0[e] = lo * r.x - hi * r.y;
            x1[e] = lo * r.y + hi * r.x;
        }
    } else {
#pragma unroll
        for (int e = 0; e < 8; e += 2) {
            const float2 r0 = cs[16 * c + 4 * t + e / 2], r1 = cs[16 * (c + NC / 2) + 4 * t + e / 2];
            const float a0 = x0[e], a1 = x0[e + 1], b0 = x1[e], b1 = x1[e + 1];
            x0[e] = a0 * r0.x - a1 * r0.y;
            x0[e + 1] = a0 * r0.y + a1 * r0.x;
            x1[e] = b0 * r1.x - b1 * r1.y;
            x1[e + 1] = b0 * r1.y + b1 * r1.x;
        }
    }
}

/* Lane t's 8 dims of group c of the F32 row at r (16-byte aligned). */
__device__ __forceinline__ void agq_row8(const float *r, int c, int t, float (&x)[8]) {
    *(float4 *)x = __ldg((const float4 *)(r + 32 * c + 8 * t));
    *(float4 *)(x + 4) = __ldg((const float4 *)(r + 32 * c + 8 * t + 4));
}

__device__ __forceinline__ uint4 agq_pack8(const float (&x)[8]) {
    return make_uint4(agq_pack(x[0], x[1]), agq_pack(x[2], x[3]), agq_pack(x[4], x[5]), agq_pack(x[6], x[7]));
}

/* ROPE: lane (g, t)'s K and V words of the step at j0 (agq_load's) at the
 * positions from pos0 (the sequence's new rows) to j_end, from the
 * matmul's rows: k rotated, both rounded to F16, and stored at their cache
 * slots (each position is in one block's slice, one warp's step).  Two
 * groups at a time, the fewest registers the neox pairs allow. */
template <int HD>
__device__ __forceinline__ void agq_new_kv(const struct agq_params &p, const float2 *rope_cs, int32_t tok0,
                                           int32_t pos0, int32_t kvh, int32_t j0, int32_t j_end, int g, int t,
                                           uint4 (&kr)[2][HD / 32], uint4 (&vr)[2][HD / 32]) {
    constexpr int NC = HD / 32;
    const struct cuda_attn_args &a = p.a;
#pragma unroll
    for (int e = 0; e < 2; e++) {
        const int32_t j = j0 + 8 * e + g, r = j - pos0;
        if (j < pos0 || j >= j_end) continue;
        const int64_t at = ((int64_t)(tok0 + r) * a.n_kv_heads + kvh) * HD;
        const int32_t slot = p.slots[tok0 + r];
        const bool put = slot >= 0 && slot < a.n_blocks * a.block_size;
        const size_t to = (((size_t)(put ? slot / a.block_size : 0) * a.n_kv_heads + kvh) * a.block_size +
                           (put ? slot % a.block_size : 0)) * HD + 8 * t;
#pragma unroll
        for (int c = 0; c < NC / 2; c++) {
            float x0[8], x1[8], w0[8], w1[8];
            agq_row8(p.k_new + at, c, t, x0);
            agq_row8(p.k_new + at, c + NC / 2, t, x1);
            agq_row8(p.v_new + at, c, t, w0);
            agq_row8(p.v_new + at, c + NC / 2, t, w1);
            agq_rotate2<HD>(x0, x1, c, rope_cs + r * (HD / 2), t, p.neox);
            kr[e][c] = agq_pack8(x0);
            kr[e][c + NC / 2] = agq_pack8(x1);
            vr[e][c] = agq_pack8(w0);
            vr[e][c + NC / 2] = agq_pack8(w1);
        }
        if (put)
#pragma unroll
            for (int c = 0; c < NC; c++) {
                *(uint4 *)((fp16_t *)a.k + to + 32 * c) = kr[e][c];
                *(uint4 *)((fp16_t *)a.v + to + 32 * c) = vr[e][c];
            }
    }
}

/* Asks L2 for the K and V rows of the step at j0 (agq_load's positions):
 * lane (g, t) one of the HD / 64 lines of a K or V row of positions
 * j0 + g and j0 + 8 + g, none past the slice or for a bad block id. */
template <int HD>
__device__ __forceinline__ void agq_prefetch(const struct cuda_attn_args &a, const int32_t *btab, const fp16_t *kc,
                                             const fp16_t *vc, int32_t kvh, int32_t j0, int32_t j_end, int g,
                                             int t) {
    constexpr int LINES = HD / 64; /* 128-byte lines a row */
    if (t >= 2 * LINES) return;
#pragma unroll
    for (int e = 0; e < 2; e++) {
        const int32_t j = j0 + 8 * e + g;
        if (j >= j_end) return;
        const int32_t bi = j / a.block_size, blk = bi < a.max_blocks ? btab[bi] : -1;
        if (blk < 0 || blk >= a.n_blocks) return;
        const size_t at = (((size_t)blk * a.n_kv_heads + kvh) * a.block_size + j % a.block_size) * HD;
        l2_prefetch((t < LINES ? kc : vc) + at + 64 * (t % LINES));
    }
}

/* The Q8_0 rows of a step: QG values a scale, RB bytes a row, 16 rows
 * (RB 16-byte pieces) from a position that is a multiple of 16 in a block
 * of a multiple of 16, so contiguous and 16-byte aligned; PPL pieces a
 * lane. */
template <int HD> struct agq_q8 {
    static constexpr int QG = backend_kv_q8_group(HD), RB = HD / QG * (QG + 2), PPL = (RB + 31) / 32;
    static_assert(HD / QG == 2 && RB % 4 == 0, "two groups a row, rows 4-byte aligned");
};

/* Byte offset of the step at j0 in K or V, and *bad where its block id
 * is outside the cache (then the offset of block 0). */
template <int HD>
__device__ __forceinline__ size_t agq_q8_at(const struct cuda_attn_args &a, const int32_t *btab, int32_t kvh,
                                            int32_t j0, bool *bad) {
    const int32_t bi = j0 / a.block_size, blk = bi < a.max_blocks ? btab[bi] : -1;
    *bad = blk < 0 || blk >= a.n_blocks;
    return (((size_t)(*bad ? 0 : blk) * a.n_kv_heads + kvh) * a.block_size + j0 % a.block_size) * agq_q8<HD>::RB;
}

/* Lane's pieces of the step at j0 (j0 < j_end): K into kr, V into vr; all
 * ones (an F16 scale of NaN) for a block id outside the cache.  Rows past
 * the slice are loaded (their block is the slice's) and masked later. */
template <int HD>
__device__ __forceinline__ void agq_q8_fetch(const struct cuda_attn_args &a, const int32_t *btab, const uint8_t *kc,
                                             const uint8_t *vc, int32_t kvh, int32_t j0, int lane,
                                             uint4 (&kr)[agq_q8<HD>::PPL], uint4 (&vr)[agq_q8<HD>::PPL]) {
    using Q = agq_q8<HD>;
    bool bad;
    const size_t at = agq_q8_at<HD>(a, btab, kvh, j0, &bad);
#pragma unroll
    for (int k = 0; k < Q::PPL; k++) {
        const int i = lane + 32 * k;
        if (Q::RB % 32 != 0 && i >= Q::RB) break;
        if (bad) {
            kr[k] = vr[k] = make_uint4(~0u, ~0u, ~0u, ~0u);
        } else {
            kr[k] = __ldg((const uint4 *)(kc + at) + i);
            vr[k] = __ldg((const uint4 *)(vc + at) + i);
        }
    }
}

/* Asks L2 for the Q8_0 rows of the step at j0: a 128-byte line each lane. */
template <int HD>
__device__ __forceinline__ void agq_q8_prefetch(const struct cuda_attn_args &a, const int32_t *btab,
                                                const uint8_t *kc, const uint8_t *vc, int32_t kvh, int32_t j0,
                                                int32_t j_end, int lane) {
    using Q = agq_q8<HD>;
    constexpr int LINES = (16 * Q::RB + 127) / 128;
    if (j0 >= j_end || lane >= 2 * LINES) return;
    bool bad;
    const size_t at = agq_q8_at<HD>(a, btab, kvh, j0, &bad);
    if (bad) return;
    l2_prefetch((lane < LINES ? kc : vc) + at + 128 * (lane % LINES));
}

/* sm_80+ (RING): the pieces agq_q8_fetch would load, copied with cp.async
 * into a ring stage (kb, vb: 16 rows each, contiguous as in the cache);
 * all ones for a block id outside the cache, stored by the lane itself.
 * The warp's other lanes read them after cp_async_wait and __syncwarp. */
template <int HD>
__device__ __forceinline__ void agq_q8_copy(const struct cuda_attn_args &a, const int32_t *btab, const uint8_t *kc,
                                            const uint8_t *vc, int32_t kvh, int32_t j0, int lane, uint8_t *kb,
                                            uint8_t *vb) {
    using Q = agq_q8<HD>;
    bool bad;
    const size_t at = agq_q8_at<HD>(a, btab, kvh, j0, &bad);
#pragma unroll
    for (int k = 0; k < Q::PPL; k++) {
        const int i = lane + 32 * k;
        if (Q::RB % 32 != 0 && i >= Q::RB) break;
        if (bad) {
            ((uint4 *)kb)[i] = ((uint4 *)vb)[i] = make_uint4(~0u, ~0u, ~0u, ~0u);
        } else {
            cp_async16((uint4 *)kb + i, (const uint4 *)(kc + at) + i);
            cp_async16((uint4 *)vb + i, (const uint4 *)(vc + at) + i);
        }
    }
}

/* Two int8 of x (biased by 128: bytes b0 and b1 of x ^ 0x80808080) as a
 * half2 of the values, exactly. */
__device__ __forceinline__ uint32_t agq_i8x2(uint32_t x, uint32_t sel) {
    const uint32_t b = __byte_perm(x, 0x64646464u, sel);
    const __half2 h = __hsub2(*(const __half2 *)&b, __float2half2_rn(1152.0f));
    return *(const uint32_t *)&h;
}

/* The 8 values of 32-dim group c of the row at r (a warp buffer), lane t's
 * dims 32 c + 8 t .., as 4 words of F16 pairs (the F16 cache's uint4). */
template <int HD> __device__ __forceinline__ uint4 agq_q8_vals(const uint8_t *r, int c, int t) {
    using Q = agq_q8<HD>;
    const int gi = 32 * c / Q::QG, vo = (Q::QG + 2) * gi + 2 + (32 * c) % Q::QG + 8 * t;
    const uint32_t *w = (const uint32_t *)(r + (vo & ~3));
    uint32_t lo, hi;
    if (gi % 2 == 0) { /* 2 bytes into a word (QG + 2 is 2 mod 4, rows 4-byte aligned) */
        const uint32_t w0 = w[0], w1 = w[1], w2 = w[2];
        lo = __funnelshift_r(w0, w1, 16);
        hi = __funnelshift_r(w1, w2, 16);
    } else {
        lo = w[0];
        hi = w[1];
    }
    lo ^= 0x80808080u;
    hi ^= 0x80808080u;
    return make_uint4(agq_i8x2(lo, 0x4140u), agq_i8x2(lo, 0x4342u), agq_i8x2(hi, 0x4140u), agq_i8x2(hi, 0x4342u));
}

/* The scale of group gi of the row at r. */
template <int HD> __device__ __forceinline__ float agq_q8_scale(const uint8_t *r, int gi) {
    return h2f(*(const fp16_t *)(r + (agq_q8<HD>::QG + 2) * gi));
}

/* HD dims a head (64 or 128), G2: rows g + 8 in use (G > 8, or ROPE's
 * rows x G), Q8: a Q8_0 cache (else F16), ROPE: all the rows of a
 * sequence with the rope and cache write (an F16 cache), RING: an F16
 * cache's steps copied RING - 1 ahead into a ring of RING stages a warp in
 * shared memory (cp.async, sm_80+; 0: a step ahead in registers). */
template <int HD, bool G2, bool Q8, bool ROPE, int RING>
__global__ void __launch_bounds__(AGQ_WARPS * 32, RING == 2 ? 3 : RING == 3 ? 2 : 1)
    attention_gqa_kernel(const struct agq_params p) {
    static_assert(!(ROPE && Q8), "the ROPE kernel writes an F16 cache");
    static_assert(RING == 0 || !ROPE, "the ring takes decode rows");
    pdl_begin();
    constexpr int NC = HD / 32; /* 32-dim groups */
    const struct cuda_attn_args &a = p.a;
    const int lane = threadIdx.x % 32, warp = threadIdx.x / 32, g = lane >> 2, t = lane & 3;
    const int32_t kvh = blockIdx.y, z = blockIdx.z;
    const int G = a.n_heads / a.n_kv_heads;
    const bool one = a.rows == CUDA_ATT_ONE_ROW;
    int32_t row = blockIdx.x, s = blockIdx.x, nr = 1;
    if constexpr (ROPE) { /* block x: sequence x, all its rows */
        row = a.seq_tok0[s];
        nr = a.seq_tok0[s + 1] - row;
    } else if (!(a.n_tokens == a.n_seqs && !one) && !att_decode_row(a, &row, &s)) {
        return; /* (every sequence one row: block x is row and sequence, no search) */
    }
    /* The slice follows from the block's last row's context. */
    const int32_t tok0 = a.seq_tok0[s], pos0 = a.seq_pos0[s];
    const int32_t len = pos0 + (row + nr - 1 - tok0) + 1, step = p.sp.step;
    const int32_t nsp = max(min(p.sp.want, (len + p.sp.least - 1) / p.sp.least), 1);
    const int32_t chunk = ((len + nsp - 1) / nsp + step - 1) / step * step;
    const int32_t j_begin = z * chunk, j_end = min(j_begin + chunk, len);
    const int32_t width = a.n_heads * HD;
    const int32_t *btab = a.block_tables + (int64_t)s * a.max_blocks;
    extern __shared__ __align__(16) uint8_t agq_smem[];

    /* ROPE: each new row's (cos, sin) of every frequency. */
    __shared__ float2 rope_cs[ROPE ? AGQ_ROPE_ROWS * (HD / 2) : 1];
    if constexpr (ROPE) {
        att_rope_cs(rope_cs, min(nr, AGQ_ROPE_ROWS), pos0, p.inv_freq, HD, AGQ_WARPS * 32);
        __syncthreads();
    }
    /* mma row i (g, g + 8) is head kvh G + i % G of row row + i / G (ROPE;
     * else head kvh G + i of row): its Q as A fragments, scaled (k-step
     * (c, h) takes dims 32c + 8t + 4h + {0, 1}, slots 2t, 2t + 1, and
     * + {2, 3}, slots 2t + 8, 2t + 9), and the end of its context in the
     * slice (ROPE's rows end at their own positions). */
    uint32_t qa[NC][2][2], qb[NC][2][2];
    int32_t je[2] = {j_end, j_end};
    if constexpr (ROPE) {
#pragma unroll
        for (int r = 0; r < 2; r++) {
            uint32_t(&f)[NC][2][2] = r ? qb : qa;
            const int i = g + 8 * r, rr = i / G;
            const bool in = (r == 0 || G2) && rr < nr;
            float x[NC][8];
            const float *qr = a.q + (int64_t)(row + rr) * width + (int64_t)(kvh * G + i % G) * HD;
            je[r] = min(j_end, pos0 + (row + rr - tok0) + 1);
            if (in) {
#pragma unroll
                for (int c = 0; c < NC; c++) agq_row8(qr, c, t, x[c]);
#pragma unroll
                for (int c = 0; c < NC / 2; c++)
                    agq_rotate2<HD>(x[c], x[c + NC / 2], c, rope_cs + (row + rr - tok0) * (HD / 2), t, p.neox);
            }
#pragma unroll
            for (int c = 0; c < NC; c++)
#pragma unroll
                for (int h = 0; h < 2; h++) {
                    f[c][h][0] = in ? agq_pack(x[c][4 * h] * a.scale, x[c][4 * h + 1] * a.scale) : 0u;
                    f[c][h][1] = in ? agq_pack(x[c][4 * h + 2] * a.scale, x[c][4 * h + 3] * a.scale) : 0u;
                }
        }
    } else {
#pragma unroll
        for (int c = 0; c < NC; c++)
#pragma unroll
            for (int h = 0; h < 2; h++) {
                qa[c][h][0] = qa[c][h][1] = qb[c][h][0] = qb[c][h][1] = 0;
                if (g < G) {
                    const float4 v = __ldg((const float4 *)(a.q + (int64_t)row * width + (int64_t)(kvh * G + g) * HD +
                                                            32 * c + 8 * t + 4 * h));
                    qa[c][h][0] = agq_pack(v.x * a.scale, v.y * a.scale);
                    qa[c][h][1] = agq_pack(v.z * a.scale, v.w * a.scale);
                }
                if (G2 && g + 8 < G) {
                    const float4 v = __ldg((const float4 *)(a.q + (int64_t)row * width +
                                                            (int64_t)(kvh * G + g + 8) * HD + 32 * c + 8 * t + 4 * h));
                    qb[c][h][0] = agq_pack(v.x * a.scale, v.y * a.scale);
                    qb[c][h][1] = agq_pack(v.z * a.scale, v.w * a.scale);
                }
            }
    }

    /* acc[c][u]: head g (and g + 8), dims 32c + 8t + 2u + {0, 1}; m, l: this
     * lane's rows' running max and its own part of the sum. */
    float acc[NC][4][4];
#pragma unroll
    for (int c = 0; c < NC; c++)
#pragma unroll
        for (int u = 0; u < 4; u++) acc[c][u][0] = acc[c][u][1] = acc[c][u][2] = acc[c][u][3] = 0.0f;
    float m[2] = {-INFINITY, -INFINITY}, l[2] = {0.0f, 0.0f};

    /* Each step's K and V rows are loaded a step ahead, so that their
     * latency hides behind the present step's products, and the steps
     * p.ahead past that are asked of L2 (registers hold one step: the
     * load then waits for L2, not DRAM).  An F16 cache's go to registers
     * as the products' operands, or with RING through the warp's ring
     * (RING - 1 steps ahead, copied and read back by the same lane, so no
     * barrier orders them); a Q8_0 cache's to the warp's buffer (kb, vb:
     * the step's 16 rows each) before the step, or with RING by cp.async
     * into a ring of RING such buffers a warp, read after __syncwarp. */
    constexpr int32_t WS = AGQ_WARPS * AGQ_STEP;
    constexpr int PPL = Q8 ? agq_q8<HD>::PPL : 1, RB = Q8 ? agq_q8<HD>::RB : 0;
    const fp16_t *kc = (const fp16_t *)a.k, *vc = (const fp16_t *)a.v;
    const uint8_t *kq = (const uint8_t *)a.k, *vq = (const uint8_t *)a.v;
    constexpr int QS = 2 * 16 * RB; /* bytes of a Q8_0 buffer (a ring stage) */
    uint8_t *const qbuf = agq_smem + (size_t)warp * (RING > 0 ? RING : 1) * QS;
    uint8_t *kb = qbuf, *vb = qbuf + 16 * RB;
    uint4 kr[2][NC], vr[2][NC], kn[2][NC], vn[2][NC], kp[PPL], vp[PPL];
    constexpr int PS = 4 * NC * 32; /* uint4 a warp's ring stage */
    uint4 *const ring = (uint4 *)agq_smem + (size_t)warp * RING * PS;
    uint32_t bad_q = 0; /* RING: bits 2 i, 2 i + 1 stage i's agq_copy result */
    /* A ring asks L2 ahead only in slices of AGQ_RING_AHEAD_MIN steps a
     * warp or more: in shorter ones the requests compete with the ring's
     * first copies and measured slower (docs/cuda-attention.md). */
    const int ahead = RING > 0 && j_end - j_begin < AGQ_RING_AHEAD_MIN * WS ? 0 : p.ahead;
    int it = 0;
    /* ROPE: positions from pos0 on come from the matmul's rows, not the
     * cache, which this launch writes. */
    const int32_t jc = ROPE ? min(j_end, pos0) : j_end;
    int32_t j0 = j_begin + warp * AGQ_STEP;
    if constexpr (Q8 && RING > 0) {
#pragma unroll
        for (int k = 0; k < RING - 1; k++) {
            if (j0 + k * WS < j_end)
                agq_q8_copy<HD>(a, btab, kq, vq, kvh, j0 + k * WS, lane, qbuf + k * QS, qbuf + k * QS + 16 * RB);
            cp_async_commit();
        }
        for (int k = 2; k <= ahead; k++)
            agq_q8_prefetch<HD>(a, btab, kq, vq, kvh, j0 + (RING - 2 + k) * WS, j_end, lane);
    } else if constexpr (Q8) {
        if (j0 < j_end) agq_q8_fetch<HD>(a, btab, kq, vq, kvh, j0, lane, kp, vp);
        for (int k = 2; k <= p.ahead; k++) agq_q8_prefetch<HD>(a, btab, kq, vq, kvh, j0 + k * WS, j_end, lane);
    } else if constexpr (RING > 0) {
#pragma unroll
        for (int k = 0; k < RING - 1; k++) {
            if (j0 + k * WS < j_end)
                bad_q |= agq_copy<HD>(a, btab, kc, vc, kvh, j0 + k * WS, jc, g, t, lane, ring + k * PS) << (2 * k);
            cp_async_commit();
        }
        for (int k = 2; k <= ahead; k++) agq_prefetch<HD>(a, btab, kc, vc, kvh, j0 + (RING - 2 + k) * WS, jc, g, t);
    } else {
        agq_load<HD>(a, btab, kc, vc, kvh, j0, jc, g, t, kr, vr);
        if (ROPE && j0 + AGQ_STEP > pos0) agq_new_kv<HD>(p, rope_cs, tok0, pos0, kvh, j0, j_end, g, t, kr, vr);
        for (int k = 2; k <= p.ahead; k++) agq_prefetch<HD>(a, btab, kc, vc, kvh, j0 + k * WS, jc, g, t);
    }
    for (; j0 < j_end; j0 += WS, it++) {
        const int32_t jn = j0 + WS;
        if constexpr (Q8 && RING > 0) {
            /* The stage the step before read takes the step RING - 1
             * ahead, once every lane is done with it. */
            const int sf = (it + RING - 1) % RING, sr = it % RING;
            const int32_t jf = j0 + (RING - 1) * WS;
            __syncwarp();
            if (jf < j_end)
                agq_q8_copy<HD>(a, btab, kq, vq, kvh, jf, lane, qbuf + sf * QS, qbuf + sf * QS + 16 * RB);
            cp_async_commit();
            if (ahead > 0) agq_q8_prefetch<HD>(a, btab, kq, vq, kvh, jf + ahead * WS, j_end, lane);
            cp_async_wait<RING - 1>();
            __syncwarp(); /* every lane's copies of this step have landed */
            kb = qbuf + sr * QS;
            vb = kb + 16 * RB;
        } else if constexpr (Q8) {
            __syncwarp(); /* every lane is done with the last step's rows */
#pragma unroll
            for (int k = 0; k < PPL; k++) {
                const int i = lane + 32 * k;
                if (RB % 32 != 0 && i >= RB) break;
                ((uint4 *)kb)[i] = kp[k];
                ((uint4 *)vb)[i] = vp[k];
            }
            __syncwarp();
            if (jn < j_end) agq_q8_fetch<HD>(a, btab, kq, vq, kvh, jn, lane, kp, vp);
            if (p.ahead > 0) agq_q8_prefetch<HD>(a, btab, kq, vq, kvh, jn + p.ahead * WS, j_end, lane);
        } else if constexpr (RING > 0) {
            /* The stage the step before read (into registers) takes the
             * step RING - 1 ahead; then this step's copies have landed. */
            const int sf = (it + RING - 1) % RING, sr = it % RING;
            const int32_t jf = j0 + (RING - 1) * WS;
            bad_q &= ~(3u << (2 * sf));
            if (jf < j_end) bad_q |= agq_copy<HD>(a, btab, kc, vc, kvh, jf, jc, g, t, lane, ring + sf * PS) << (2 * sf);
            cp_async_commit();
            if (ahead > 0) agq_prefetch<HD>(a, btab, kc, vc, kvh, jf + ahead * WS, jc, g, t);
            cp_async_wait<RING - 1>();
            agq_read<HD>(ring + sr * PS, lane, bad_q >> (2 * sr) & 3u, kr, vr);
        } else {
            if (jn < j_end) agq_load<HD>(a, btab, kc, vc, kvh, jn, jc, g, t, kn, vn);
            if (ROPE && jn < j_end && jn + AGQ_STEP > pos0)
                agq_new_kv<HD>(p, rope_cs, tok0, pos0, kvh, jn, j_end, g, t, kn, vn);
            if (p.ahead > 0) agq_prefetch<HD>(a, btab, kc, vc, kvh, jn + p.ahead * WS, jc, g, t);
        }
        /* S = Q.K^T for the two n-tiles of 8 positions; over a Q8_0 cache
         * each of the row's two groups summed apart (sg[1]), then scaled. */
        float sc[2][4];
#pragma unroll
        for (int e = 0; e < 2; e++) {
            float sg[2][4] = {};
#pragma unroll
            for (int c = 0; c < NC; c++) {
                const uint4 kw = Q8 ? agq_q8_vals<HD>(kb + (8 * e + g) * RB, c, t) : kr[e][c];
                float(&d)[4] = sg[Q8 && c >= NC / 2];
                agq_mma(d, qa[c][0][0], qb[c][0][0], qa[c][0][1], qb[c][0][1], kw.x, kw.y);
                agq_mma(d, qa[c][1][0], qb[c][1][0], qa[c][1][1], qb[c][1][1], kw.z, kw.w);
            }
            /* Lane (g, t) holds positions j0 + 8e + 2t, + 1. */
#pragma unroll
            for (int i = 0; i < 4; i++) {
                sc[e][i] = sg[0][i];
                if constexpr (Q8) {
                    const uint8_t *r = kb + (8 * e + 2 * t + (i & 1)) * RB;
                    sc[e][i] = sg[0][i] * agq_q8_scale<HD>(r, 0) + sg[1][i] * agq_q8_scale<HD>(r, 1);
                }
                if (j0 + 8 * e + 2 * t + (i & 1) >= je[i >> 1]) sc[e][i] = -INFINITY;
            }
        }
        /* V's scales at P's positions (slots 2t, 2t + 1 of each n-tile),
         * zero past the slice, where a row is not the slice's. */
        float dv[2][4];
        if constexpr (Q8) {
#pragma unroll
            for (int i = 0; i < 4; i++) {
                const int32_t jp = 8 * (i >> 1) + 2 * t + (i & 1);
                const bool in = j0 + jp < j_end;
                dv[0][i] = in ? agq_q8_scale<HD>(vb + jp * RB, 0) : 0.0f;
                dv[1][i] = in ? agq_q8_scale<HD>(vb + jp * RB, 1) : 0.0f;
            }
        }
        /* Online softmax of rows g (r = 0) and g + 8 (r = 1). */
        uint32_t pa[2][2][2]; /* [V group (Q8_0; else 0)][r][k half] */
#pragma unroll
        for (int r = 0; r < 2; r++) {
            if (r == 1 && !G2) {
                pa[0][1][0] = pa[0][1][1] = pa[1][1][0] = pa[1][1][1] = 0;
                continue;
            }
            float mx = fmaxf(fmaxf(sc[0][2 * r], sc[0][2 * r + 1]), fmaxf(sc[1][2 * r], sc[1][2 * r + 1]));
            mx = fmaxf(mx, __shfl_xor_sync(0xffffffffu, mx, 1));
            mx = fmaxf(mx, __shfl_xor_sync(0xffffffffu, mx, 2));
            const float mn = fmaxf(m[r], mx);
            /* Nothing seen yet and nothing here: keep the state. */
            const float alpha = mn == -INFINITY ? 1.0f : __expf(m[r] - mn);
            float pr[4];
#pragma unroll
            for (int e = 0; e < 2; e++)
#pragma unroll
                for (int i = 0; i < 2; i++) pr[2 * e + i] = mn == -INFINITY ? 0.0f : __expf(sc[e][2 * r + i] - mn);
            l[r] = l[r] * alpha + pr[0] + pr[1] + pr[2] + pr[3];
            m[r] = mn;
#pragma unroll
            for (int c = 0; c < NC; c++)
#pragma unroll
                for (int u = 0; u < 4; u++) {
                    acc[c][u][2 * r] *= alpha;
                    acc[c][u][2 * r + 1] *= alpha;
                }
            /* P as A: slots 2t, 2t + 1 are the first n-tile's positions,
             * 2t + 8, 2t + 9 the second's (times each V group's scale). */
#pragma unroll
            for (int v = 0; v < (Q8 ? 2 : 1); v++) {
                const float *d = dv[v];
                pa[v][r][0] = Q8 ? agq_pack(pr[0] * d[0], pr[1] * d[1]) : agq_pack(pr[0], pr[1]);
                pa[v][r][1] = Q8 ? agq_pack(pr[2] * d[2], pr[3] * d[3]) : agq_pack(pr[2], pr[3]);
            }
        }
        /* O += P.V: V word u of group c is an 8 x 8 tile (positions x
         * dims 32c + 8t + 2u + {0, 1}); transposed, it is the B fragment. */
#pragma unroll
        for (int c = 0; c < NC; c++) {
            const uint4 v0 = Q8 ? agq_q8_vals<HD>(vb + g * RB, c, t) : vr[0][c];
            const uint4 v1 = Q8 ? agq_q8_vals<HD>(vb + (8 + g) * RB, c, t) : vr[1][c];
            const uint32_t(&pv)[2][2] = pa[Q8 && c >= NC / 2];
#pragma unroll
            for (int u = 0; u < 4; u++) {
                const uint32_t w0 = u == 0 ? v0.x : u == 1 ? v0.y : u == 2 ? v0.z : v0.w;
                const uint32_t w1 = u == 0 ? v1.x : u == 1 ? v1.y : u == 2 ? v1.z : v1.w;
                agq_mma(acc[c][u], pv[0][0], pv[1][0], pv[0][1], pv[1][1], agq_trans(w0), agq_trans(w1));
            }
        }
        if constexpr (!Q8 && RING == 0) {
#pragma unroll
            for (int e = 0; e < 2; e++)
#pragma unroll
                for (int c = 0; c < NC; c++) {
                    kr[e][c] = kn[e][c];
                    vr[e][c] = vn[e][c];
                }
        }
    }

    /* Merge the warps: sml[warp][row] = (m, l), sacc[warp][row][HD], in
     * the dynamic shared memory (after the Q8_0 buffers' last use). */
    constexpr int R = G2 ? 16 : 8;
    cp_async_wait<0>();
    if (Q8 || RING > 0) __syncthreads();
    float(*sacc)[R][HD] = (float(*)[R][HD])agq_smem;
    float(*sml)[R][2] = (float(*)[R][2])(agq_smem + sizeof(float) * AGQ_WARPS * R * HD);
#pragma unroll
    for (int r = 0; r < 2; r++) {
        if (r == 1 && !G2) break;
        float lr = l[r];
        lr += __shfl_xor_sync(0xffffffffu, lr, 1);
        lr += __shfl_xor_sync(0xffffffffu, lr, 2);
        if (t == 0) {
            sml[warp][g + 8 * r][0] = m[r];
            sml[warp][g + 8 * r][1] = lr;
        }
#pragma unroll
        for (int c = 0; c < NC; c++) {
            float *d = &sacc[warp][g + 8 * r][32 * c + 8 * t];
            *(float4 *)d = make_float4(acc[c][0][2 * r], acc[c][0][2 * r + 1], acc[c][1][2 * r], acc[c][1][2 * r + 1]);
            *(float4 *)(d + 4) =
                make_float4(acc[c][2][2 * r], acc[c][2][2 * r + 1], acc[c][3][2 * r], acc[c][3][2 * r + 1]);
        }
    }
    __syncthreads();
    for (int i = threadIdx.x; i < nr * G * HD; i += AGQ_WARPS * 32) {
        const int hg = i / HD, d = i % HD;
        float mx = -INFINITY;
#pragma unroll
        for (int w = 0; w < AGQ_WARPS; w++) mx = fmaxf(mx, sml[w][hg][0]);
        float ls = 0.0f, as = 0.0f;
#pragma unroll
        for (int w = 0; w < AGQ_WARPS; w++) {
            const float mw = sml[w][hg][0], lw = sml[w][hg][1];
            if (mw == -INFINITY && lw == 0.0f) continue; /* saw no position */
            const float wt = mw == -INFINITY ? 0.0f : __expf(mw - mx);
            ls += lw * wt;
            as += sacc[w][hg][d] * wt;
        }
        const int head = kvh * G + (ROPE ? hg % G : hg), orow = row + (ROPE ? hg / G : 0);
        if (p.sp.n_splits == 1) {
            const float o = ls == 0.0f ? 0.0f : as / ls;
            a.out[(int64_t)orow * width + (int64_t)head * HD + d] = o;
            if (p.sp.out16) p.sp.out16[(int64_t)orow * width + (int64_t)head * HD + d] = f2h(o);
        } else {
            const int64_t slot = one ? ((int64_t)z * a.n_seqs + s) * a.n_heads + head
                                     : ((int64_t)z * a.n_tokens + orow) * a.n_heads + head;
            p.sp.part_acc[slot * HD + d] = as;
            if (d == 0) {
                p.sp.part_ml[slot * 2] = ls != ls ? ls : mx;
                p.sp.part_ml[slot * 2 + 1] = ls;
            }
        }
    }
}

extern "C" int cuda_attention_gqa_takes(const struct cuda_ctx *ctx, const struct cuda_attn_args *a) {
    const int32_t G = a->n_kv_heads > 0 ? a->n_heads / a->n_kv_heads : 0;
    return ctx->att_gqa_min > 0 && G >= ctx->att_gqa_min && G >= 2 && G <= 16 &&
           a->n_heads == G * a->n_kv_heads && (a->n_tokens == a->n_seqs || a->rows == CUDA_ATT_ONE_ROW) &&
           (a->kv_type == DTYPE_F16 || (a->kv_type == DTYPE_Q8_0 && a->block_size % AGQ_STEP == 0)) &&
           (a->head_dim == 64 || a->head_dim == 128) && (uintptr_t)a->q % 16 == 0 &&
           (uintptr_t)a->k % 16 == 0 && (uintptr_t)a->v % 16 == 0;
}

/* Dynamic shared memory: a Q8_0 cache's warp buffers or the warps' rings,
 * then (reused) the merge's sacc and sml. */
template <int HD, bool G2, bool Q8, int RING> static constexpr size_t agq_smem_bytes() {
    constexpr size_t R = G2 ? 16 : 8, merge = sizeof(float) * AGQ_WARPS * R * (HD + 2);
    constexpr size_t bufs = Q8     ? (size_t)AGQ_WARPS * (RING > 0 ? RING : 1) * 2 * 16 * agq_q8<HD>::RB
                            : RING ? (size_t)AGQ_WARPS * RING * 4 * (HD / 32) * 32 * 16
                                   : 0;
    return bufs > merge ? bufs : merge;
}

/* Blocks of a variant resident a multiprocessor of ctx's card (asked once
 * a device), into *bps. */
template <int HD, bool G2, bool Q8, bool ROPE, int RING> static int agq_occupancy(struct cuda_ctx *ctx, int *bps) {
    constexpr size_t smem = agq_smem_bytes<HD, G2, Q8, RING>();
    static int per_sm[64];
    int &b = per_sm[ctx->device >= 0 && ctx->device < 64 ? ctx->device : 0];
    CUDA_CHECK(ctx, cuda_blocks_per_sm(attention_gqa_kernel<HD, G2, Q8, ROPE, RING>, AGQ_WARPS * 32, smem, &b));
    *bps = b;
    return STATUS_OK;
}

template <int HD, bool G2, bool Q8, bool ROPE, int RING = 0>
static int agq_launch(struct cuda_ctx *ctx, struct agq_params *p) {
    const struct cuda_attn_args *a = &p->a;
    const bool one = !ROPE && a->rows == CUDA_ATT_ONE_ROW;
    const int32_t n_idx = one ? a->n_seqs : a->n_tokens, n_blk = ROPE ? a->n_seqs : n_idx; /* ROPE: a sequence */
    const int64_t blocks = (int64_t)n_blk * a->n_kv_heads;
    constexpr size_t smem = agq_smem_bytes<HD, G2, Q8, RING>();
    /* Split the context over the resident slots as cuda_att_split weighs
     * waves against block lengths, each split at least two steps of every
     * warp: long blocks keep their loads a step ahead, short ones pay the
     * start (the row, Q, the first loads) more often.  The 8-bit ring's
     * grids of more than one wave unsplit look past the fewest splits
     * that fill one, for 8/10 of the time: llama3-8b's 64 rows at context
     * 2048 are 512 blocks for 396 slots, 3 splits measured 3.6% faster a
     * step than 1 (at context 512, 3.7% slower: the margin keeps 1). */
    int bps = 0;
    const int rc = agq_occupancy<HD, G2, Q8, ROPE, RING>(ctx, &bps);
    if (rc != STATUS_OK) return rc;
    const int64_t slots = (int64_t)bps * ctx->n_sms;
    const int past_tenths = Q8 && RING && blocks > slots ? AGQ_Q8_RING_TENTHS : 0;
    if (cuda_att_split(ctx, a, n_idx, slots, blocks, past_tenths, AGQ_SPLIT_STEP, AGQ_SPLIT_LEAST, AGQ_SPLITS_MAX,
                       &p->sp) != STATUS_OK)
        return STATUS_NO_MEMORY;
    const struct cuda_att_split &sp = p->sp;
    const dim3 grid((unsigned)n_blk, (unsigned)a->n_kv_heads, (unsigned)sp.n_splits);
    CUDA_CHECK(ctx,
               cuda_launch(ctx, (attention_gqa_kernel<HD, G2, Q8, ROPE, RING>), grid, dim3(AGQ_WARPS * 32), smem, *p));
    CUDA_CHECK(ctx, cudaGetLastError());
    if (sp.n_splits > 1) {
        CUDA_CHECK(ctx, cuda_launch(ctx, attention_combine_kernel, dim3(n_idx, a->n_heads), dim3(128), 0, a->out,
                                    (fp16_t *)sp.out16, sp.part_acc, sp.part_ml, sp.n_splits, n_idx, a->n_heads,
                                    a->head_dim, one ? a->seq_tok0 : (const int32_t *)NULL));
        CUDA_CHECK(ctx, cudaGetLastError());
    }
    return STATUS_OK;
}

/* Resident blocks on ctx's card of the variant with `ring` stages (0:
 * the steps in registers), into *slots. */
template <int HD, bool G2, bool Q8> static int agq_slots(struct cuda_ctx *ctx, int ring, int64_t *slots) {
    int bps = 0;
    const int rc = ring == 2   ? agq_occupancy<HD, G2, Q8, false, 2>(ctx, &bps)
                   : ring == 3 ? agq_occupancy<HD, G2, Q8, false, 3>(ctx, &bps)
                               : agq_occupancy<HD, G2, Q8, false, 0>(ctx, &bps);
    *slots = (int64_t)bps * ctx->n_sms;
    return rc;
}

/* The ring over an F16 cache from ctx->att_ring_rows decode rows (32:
 * below, whole steps measured as fast or faster in registers), with 2
 * stages in place of 3 where only theirs (3 blocks a multiprocessor
 * against 2) hold the rows' blocks in one wave; over a Q8_0 cache up to
 * ctx->att_q8_ring_max rows, or by default where the rows' blocks fit one
 * wave of the ring's (3 a multiprocessor, where the registers' 2 left a
 * second wave) and past that where the split weighs more splits than
 * fill one wave (agq_launch): unsplit, a partial second wave of the ring
 * measured no faster than the registers' (docs/cuda-attention.md). */
template <int HD, bool G2, bool Q8> static int agq_launch_r(struct cuda_ctx *ctx, struct agq_params *p) {
    const int32_t rows = p->a.rows == CUDA_ATT_ONE_ROW ? p->a.n_seqs : p->a.n_tokens;
    const int64_t blocks = (int64_t)rows * p->a.n_kv_heads;
    int ring = ctx->cc >= 80 ? ctx->att_ring : 0, rc;
    if (!Q8 && rows < ctx->att_ring_rows) ring = 0;
    if (Q8 && ctx->att_q8_ring_max >= 0 && rows > ctx->att_q8_ring_max) ring = 0;
    if (!Q8 && ring == 3 && ctx->att_ring_shallow) {
        int64_t s3 = 0, s2 = 0;
        if ((rc = agq_slots<HD, G2, Q8>(ctx, 3, &s3)) != STATUS_OK ||
            (rc = agq_slots<HD, G2, Q8>(ctx, 2, &s2)) != STATUS_OK)
            return rc;
        if (blocks > s3 && blocks <= s2) ring = 2;
    }
    if (Q8 && ring && ctx->att_q8_ring_max < 0) {
        int64_t s = 0;
        if ((rc = agq_slots<HD, G2, Q8>(ctx, ring, &s)) != STATUS_OK) return rc;
        const int64_t by_ctx = (p->a.max_ctx + AGQ_SPLIT_LEAST - 1) / AGQ_SPLIT_LEAST;
        if (blocks > s &&
            cuda_att_split_want(ctx->att_splits, p->a.max_ctx, s, blocks, AGQ_SPLIT_STEP, by_ctx, AGQ_Q8_RING_TENTHS) <= 1)
            ring = 0;
    }
    if (ring == 2) return agq_launch<HD, G2, Q8, false, 2>(ctx, p);
    if (ring == 3) return agq_launch<HD, G2, Q8, false, 3>(ctx, p);
    return agq_launch<HD, G2, Q8, false>(ctx, p);
}

template <int HD, bool Q8> static int agq_launch_g(struct cuda_ctx *ctx, struct agq_params *p) {
    const bool g2 = p->a.n_heads / p->a.n_kv_heads > 8;
    return g2 ? agq_launch_r<HD, true, Q8>(ctx, p) : agq_launch_r<HD, false, Q8>(ctx, p);
}

extern "C" int cuda_attention_gqa(struct cuda_ctx *ctx, const struct cuda_attn_args *a) {
    if (!cuda_attention_gqa_takes(ctx, a))
        return cuda_fail(ctx, STATUS_UNSUPPORTED, "attention_gqa: %d heads over %d KV heads of %d, %s cache, block %d",
                         a->n_heads, a->n_kv_heads, a->head_dim, dtype_name(a->kv_type), a->block_size);
    struct agq_params p;
    memset(&p, 0, sizeof p);
    p.a = *a;
    p.ahead = ctx->l2_ahead;
    const bool q8 = a->kv_type == DTYPE_Q8_0;
    if (a->head_dim == 64) return q8 ? agq_launch_g<64, true>(ctx, &p) : agq_launch_g<64, false>(ctx, &p);
    return q8 ? agq_launch_g<128, true>(ctx, &p) : agq_launch_g<128, false>(ctx, &p);
}

extern "C" int cuda_attention_gqa_rope(struct cuda_ctx *ctx, const struct cuda_attn_args *a, const float *k,
                                       const float *v, const int32_t *slots, const float *inv_freq, int32_t n_freq,
                                       int neox, int32_t rows_min, int32_t rows_max) {
    const int32_t G = a->n_kv_heads > 0 ? a->n_heads / a->n_kv_heads : 0;
    /* A sequence's rows x G fit the mma's 16 rows: with more, tiles of
     * rows would each read the context, where attention_prefill.cu's one
     * tile reads it once (docs/cuda-attention.md). */
    if (!ctx->rope_gqa || rows_min < 2 || rows_max > ctx->rope_tc || G < 1 || rows_max * G > AGQ_ROPE_ROWS ||
        a->n_heads != G * a->n_kv_heads || a->kv_type != DTYPE_F16 || (a->head_dim != 64 && a->head_dim != 128) ||
        2 * n_freq != a->head_dim || (uintptr_t)a->q % 16 != 0 || (uintptr_t)a->k % 16 != 0 ||
        (uintptr_t)a->v % 16 != 0 || (uintptr_t)k % 16 != 0 || (uintptr_t)v % 16 != 0)
        return CUDA_NOT_FUSED;
    struct agq_params p;
    memset(&p, 0, sizeof p);
    p.a = *a;
    p.ahead = ctx->l2_ahead;
    p.k_new = k;
    p.v_new = v;
    p.slots = slots;
    p.inv_freq = inv_freq;
    p.neox = neox;
    const bool g2 = rows_max * G > 8;
    if (a->head_dim == 64)
        return g2 ? agq_launch<64, true, false, true>(ctx, &p) : agq_launch<64, false, false, true>(ctx, &p);
    return g2 ? agq_launch<128, true, false, true>(ctx, &p) : agq_launch<128, false, false, true>(ctx, &p);
}
