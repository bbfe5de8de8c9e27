/* Rope, the cache write and attention for decode rows (each sequence of
 * the batch at one new position), in one launch where the op-by-op path
 * takes three: rope_kv_write, attention and the merge of its context
 * slices.
 *
 * A warp owns one (row, query head, slice of the context) unit: it rotates
 * its head of q in registers (the position's cosines and sines formed once a
 * block), and walks its slice with an online softmax, sub-warps of LP
 * lanes (8 dims a lane) owning positions, U positions' loads in flight.
 * The slice that holds the new position rotates the new k there, rounds k
 * and v to F16 as the cache holds them, uses them from registers and
 * (once per KV head) writes them to the cache.  The first round of a
 * slice's cache loads is issued before the programmatic wait (no kernel of
 * the step writes those rows).  A block's four slices are merged in its
 * shared memory, then the last block of a (row, head) to finish (a counter
 * each in ctx->att_sync, left at zero) merges the blocks' sums.  Data other
 * blocks wrote in this launch is read through L2 (__ldcg).  Query heads of
 * one KV head read its rows separately: at batch 1 they come from L2 after
 * the first.
 *
 * Up to ctx->att_defer rows (4 by default) the
 * blocks' sums are merged by a second kernel instead (ra_merge_kernel),
 * which also leaves the output in the int8 form of the gemv matmul that
 * may read it next (o): the fence, counter and last block's round trips
 * leave the attention's critical path, and a gemv o matmul needs no
 * quantizing launch of its own.  Above that (5-8 rows by default) the
 * blocks that write the output write its F16 form too, for the o matmul
 * (matmul_mr, cuBLAS), as the other attention kernels do from 3 rows, and
 * with att_defer 0 its int8 form at 1-2 rows. */
#include "act_q8.cuh"
#include "attention_prefill.h"
#include "attn_decode.cuh"

#include <math.h>

/* Context slices of one head at most, and the block sums (up to 16) the
 * last merge loads at a time.  Each launch also fixes U (positions whose K/V loads a sub-warp
 * issues at once) and STEPS (the least steps of U a slice takes): one row
 * takes U = 8 in one step, so a slice costs one memory round trip; more
 * rows take U = 4 in two steps, 1% faster at 2-4 rows (fewer registers,
 * more blocks). */
#define RA_SPLITS_MAX 64
#define RA_MB 16

struct ra_args {
    const float *q, *k, *v; /* q [rows, n_heads * hd], k and v [rows, n_kv_heads * hd], unrotated */
    float *att, *part_acc, *part_ml;
    fp16_t *att16; /* att's F16 form too (for the o matmul), unless NULL; not with defer */
    int8_t *xq;    /* or its int8 form (act_q8.cuh; 1-2 rows), unless NULL; not with defer */
    float *xd, *xs;
    unsigned *sync;
    fp16_t *kc, *vc;
    const int32_t *pos, *slots, *btab;
    const float *inv_freq;
    int n_blocks, block_size, n_kv_heads, n_heads, max_blocks, n_freq, neox;
    int defer; /* blocks write their sums only; ra_merge_kernel merges them */
    float scale;
};

/* Context slices S of a row of len positions and the positions of each
 * (chunk): slices of whole rounds (step positions), at least `steps`
 * rounds each, at most RA_SPLITS_MAX slices. */
__device__ __forceinline__ int ra_slices(int len, int step, int steps, int *chunk) {
    int S = (len + step * steps - 1) / (step * steps);
    S = S < 1 ? 1 : S > RA_SPLITS_MAX ? RA_SPLITS_MAX : S;
    *chunk = ((len + S - 1) / S + step - 1) / step * step;
    return (len + *chunk - 1) / *chunk;
}

__device__ __forceinline__ float ra_warp_sum(float v) {
#pragma unroll
    for (int o = 16; o > 0; o >>= 1) v += __shfl_xor_sync(0xffffffffu, v, o);
    return v;
}

/* Dims d0 .. d0 + 7 of head vector hv rotated at the position whose
 * cosines and sines are cs[0 .. nf), cs[nf .. 2 nf), as
 * rope_kv_write_kernel rotates them. */
__device__ __forceinline__ void ra_rope8(const float *hv, int d0, const float *cs, int nf, int neox, float (&y)[8]) {
    const float4 a = __ldcg((const float4 *)(hv + d0)), b = __ldcg((const float4 *)(hv + d0 + 4));
    const float x[8] = {a.x, a.y, a.z, a.w, b.x, b.y, b.z, b.w};
#pragma unroll
    for (int e = 0; e < 8; e++) {
        const int d = d0 + e;
        y[e] = x[e];
        if (neox) {
            if (d < nf) y[e] = x[e] * cs[d] - __ldcg(hv + d + nf) * cs[nf + d];
            else if (d < 2 * nf) y[e] = __ldcg(hv + d - nf) * cs[d] + x[e] * cs[d - nf];
        } else if (d < 2 * nf) {
            const int i = d / 2;
            /* The pair (2i, 2i + 1) is within the lane's 8 dims (d0 is a
             * multiple of 8, so d is odd exactly when e is). */
            y[e] = (e & 1) ? x[e - 1] * cs[nf + i] + x[e] * cs[i] : x[e] * cs[i] - x[e + 1] * cs[nf + i];
        }
    }
}

/* Eight floats as F16, rounded as the cache stores them. */
__device__ __forceinline__ uint4 ra_pack8(const float (&v)[8]) {
    uint4 r;
    r.x = (uint32_t)f2h(v[0]) | ((uint32_t)f2h(v[1]) << 16);
    r.y = (uint32_t)f2h(v[2]) | ((uint32_t)f2h(v[3]) << 16);
    r.z = (uint32_t)f2h(v[4]) | ((uint32_t)f2h(v[5]) << 16);
    r.w = (uint32_t)f2h(v[6]) | ((uint32_t)f2h(v[7]) << 16);
    return r;
}

/* Loads of positions j0 .. j0 + U - 1 of a slice that ends at j_end, from
 * the cache (zeros past j_end and at the new position len - 1, which the
 * slice takes from registers; NaN where the block table is bad;
 * attn_decode.cuh).  The cache rows and the tables are no output of this
 * step's kernels, so the first round is issued before the programmatic
 * wait. */
template <int HD, int U>
__device__ __forceinline__ void ra_kv_load(const ra_args &a, int kvh, int li, int j0, int j_end, int len,
                                           uint4 (&kr)[U], uint4 (&vr)[U]) {
    att_kv_rows<HD, U>(a.kc, a.vc, a.btab, a.max_blocks, a.n_blocks, a.block_size, a.n_kv_heads, kvh, li, j0,
                       min(j_end, len - 1), kr, vr);
}

/* N output values of the row at column c: F32, and F16 or int8 where
 * asked (mask: the lanes writing, whole blocks of 32 columns). */
template <int N>
__device__ __forceinline__ void ra_out(const ra_args &a, size_t c, const float (&v)[N], unsigned mask = 0xffffffffu) {
    static_assert(N % 2 == 0, "pairs of values");
    if constexpr (N % 4 == 0) {
#pragma unroll
        for (int i = 0; i < N; i += 4) *(float4 *)(a.att + c + i) = make_float4(v[i], v[i + 1], v[i + 2], v[i + 3]);
    } else {
#pragma unroll
        for (int i = 0; i < N; i += 2) *(float2 *)(a.att + c + i) = make_float2(v[i], v[i + 1]);
    }
    if (a.att16)
#pragma unroll
        for (int i = 0; i < N; i += 2)
            *(uint32_t *)(a.att16 + c + i) = (uint32_t)f2h(v[i]) | ((uint32_t)f2h(v[i + 1]) << 16);
    if (a.xq) act_q8_lanes<N>(v, (int64_t)c, mask, a.xq, a.xd, a.xs);
}

/* ---- A warp's slice z (of S, chunk positions each) of query head h.  Sub-warps of LP lanes (8 dims a lane) own positions, each with
 * its own online softmax, U positions' loads in flight (the arithmetic of
 * attention_decode_kernel). ---- */
template <int LP, int U>
__device__ __forceinline__ void ra_attn_slice(const ra_args &a, int h, int z, int S, int chunk, int len, const float *cs,
                                              float *sm, uint4 (&kr)[U], uint4 (&vr)[U]) {
    constexpr int HD = LP * 8, SW = 32 / LP;
    const int lane = threadIdx.x & 31, li = lane % LP, sw = lane / LP;
    const int G = a.n_heads / a.n_kv_heads, kvh = h / G;
    const float ninf = -INFINITY;
    float q[8];
    ra_rope8(a.q + (size_t)h * HD, 8 * li, cs, a.n_freq, a.neox, q);
#pragma unroll
    for (int e = 0; e < 8; e++) q[e] *= a.scale;
    const int j_begin = z * chunk, j_end = min(j_begin + chunk, len);
    /* The new position's k (rotated) and v, as the cache will hold them. */
    uint4 kn = make_uint4(0, 0, 0, 0), vn = kn;
    if (j_end == len) {
        float kv8[8];
        ra_rope8(a.k + (size_t)kvh * HD, 8 * li, cs, a.n_freq, a.neox, kv8);
        kn = ra_pack8(kv8);
        const float4 v0 = __ldcg((const float4 *)(a.v + (size_t)kvh * HD + 8 * li)),
                     v1 = __ldcg((const float4 *)(a.v + (size_t)kvh * HD + 8 * li + 4));
        const float vv[8] = {v0.x, v0.y, v0.z, v0.w, v1.x, v1.y, v1.z, v1.w};
        vn = ra_pack8(vv);
        const int32_t slot = a.slots[0]; /* the row's own (rope_attention_kernel offsets them) */
        if (h % G == 0 && sw == 0 && slot >= 0 && slot < a.n_blocks * a.block_size) {
            const size_t at =
                (((size_t)(slot / a.block_size) * a.n_kv_heads + kvh) * a.block_size + slot % a.block_size) * HD +
                8 * li;
            *(uint4 *)(a.kc + at) = kn;
            *(uint4 *)(a.vc + at) = vn;
        }
    }
    float m = ninf, l = 0.0f, acc[8];
#pragma unroll
    for (int e = 0; e < 8; e++) acc[e] = 0.0f;
    for (int jw = j_begin; jw < j_end; jw += SW * U) {
        const int j0 = jw + sw * U;
        if (jw != j_begin) ra_kv_load<HD, U>(a, kvh, li, j0, j_end, len, kr, vr); /* the first round came in */
#pragma unroll
        for (int u = 0; u < U; u++)
            if (j0 + u == len - 1) {
                kr[u] = kn;
                vr[u] = vn;
            }
#pragma unroll
        for (int u = 0; u < U; u++) {
            const __half2 *kh = (const __half2 *)&kr[u], *vh = (const __half2 *)&vr[u];
            float d = 0.0f, vf[8];
#pragma unroll
            for (int e = 0; e < 4; e++) {
                const float2 kf = __half22float2(kh[e]), f = __half22float2(vh[e]);
                d += q[2 * e] * kf.x + q[2 * e + 1] * kf.y;
                vf[2 * e] = f.x;
                vf[2 * e + 1] = f.y;
            }
#pragma unroll
            for (int o = LP / 2; o > 0; o >>= 1) d += __shfl_xor_sync(0xffffffffu, d, o);
            if (j0 + u < j_end) att_online_add(m, l, acc, d, vf);
        }
    }
    /* The sub-warps' states merged into sub-warp 0. */
#pragma unroll
    for (int o = LP; o < 32; o <<= 1) {
        const float mo = __shfl_xor_sync(0xffffffffu, m, o), lo = __shfl_xor_sync(0xffffffffu, l, o);
        const float mn = fmaxf(m, mo);
        const float wa = m == ninf ? 0.0f : __expf(m - mn), wb = mo == ninf ? 0.0f : __expf(mo - mn);
        l = l * wa + lo * wb;
#pragma unroll
        for (int e = 0; e < 8; e++) acc[e] = acc[e] * wa + __shfl_xor_sync(0xffffffffu, acc[e], o) * wb;
        m = mn;
    }
    if (S == 1 && !a.defer) {
        if (sw == 0) {
            const float r = l > 0.0f ? 1.0f / l : 0.0f;
#pragma unroll
            for (int e = 0; e < 8; e++) acc[e] *= r;
            ra_out<8>(a, (size_t)h * HD + 8 * li, acc, LP == 32 ? 0xffffffffu : (1u << LP) - 1u);
        }
        return;
    }
    /* The block's slices (z = 4 blockIdx.x + warp, those under S) merged
     * in shared memory by its first warp (attn_merge.cuh's rule: weights
     * exp(m_z - max m), a slice that saw nothing adds nothing), so that the
     * head's last merge reads a quarter of the slices. */
    constexpr int DPL = HD / 32;
    const int w = threadIdx.x >> 5, nz = min(4, S - 4 * (int)blockIdx.x), nb = (S + 3) / 4;
    if (sw == 0) {
#pragma unroll
        for (int e = 0; e < 8; e++) sm[w * HD + 8 * li + e] = acc[e];
        if (li == 0) {
            sm[4 * HD + 2 * w] = m;
            sm[4 * HD + 2 * w + 1] = l;
        }
    }
    asm volatile("bar.sync 1, %0;" ::"r"(nz * 32) : "memory");
    if (w != 0) return;
    float bm = ninf;
    for (int i = 0; i < nz; i++) bm = fmaxf(bm, sm[4 * HD + 2 * i]);
    float bl = 0.0f, bo[DPL];
#pragma unroll
    for (int i = 0; i < DPL; i++) bo[i] = 0.0f;
    for (int k = 0; k < nz; k++) {
        const float mk = sm[4 * HD + 2 * k], wk = mk == ninf ? 0.0f : __expf(mk - bm);
        bl += wk * sm[4 * HD + 2 * k + 1];
#pragma unroll
        for (int i = 0; i < DPL; i++) bo[i] += wk * sm[k * HD + DPL * lane + i];
    }
    if (nb == 1 && !a.defer) { /* one block held every slice */
#pragma unroll
        for (int i = 0; i < DPL; i++) bo[i] = bl > 0.0f ? bo[i] / bl : 0.0f;
        ra_out<DPL>(a, (size_t)h * HD + DPL * lane, bo);
        return;
    }
    const size_t slot = (size_t)h * RA_SPLITS_MAX + blockIdx.x;
    float *po = a.part_acc + slot * HD + DPL * lane;
    if constexpr (DPL == 4) *(float4 *)po = make_float4(bo[0], bo[1], bo[2], bo[3]);
    else *(float2 *)po = make_float2(bo[0], bo[1]);
    if (lane == 0) *(float2 *)(a.part_ml + slot * 2) = make_float2(bl != bl ? bl : bm, bl);
    if (a.defer) return;
    __threadfence();
    __syncwarp();
    unsigned done = 0;
    if (lane == 0) done = atomicAdd(a.sync + h, 1u);
    done = __shfl_sync(0xffffffffu, done, 0);
    if (done != (unsigned)nb - 1) return;
    /* The last block of head h merges the nb block sums, by the same rule. */
    __threadfence();
    if (lane == 0) atomicExch(a.sync + h, 0u);
    const float *ml = a.part_ml + (size_t)h * RA_SPLITS_MAX * 2;
    const float m0 = lane < nb ? __ldcg(ml + 2 * lane) : ninf, l0 = lane < nb ? __ldcg(ml + 2 * lane + 1) : 0.0f;
    const float m1 = lane + 32 < nb ? __ldcg(ml + 2 * lane + 64) : ninf,
                l1 = lane + 32 < nb ? __ldcg(ml + 2 * lane + 65) : 0.0f;
    float gm = fmaxf(m0, m1);
#pragma unroll
    for (int o = 16; o > 0; o >>= 1) gm = fmaxf(gm, __shfl_xor_sync(0xffffffffu, gm, o));
    const float w0 = m0 == ninf ? 0.0f : __expf(m0 - gm), w1 = m1 == ninf ? 0.0f : __expf(m1 - gm);
    const float L = ra_warp_sum(w0 * l0 + w1 * l1);
    /* Lane l owns dims DPL l .. DPL l + DPL - 1; the blocks' partial sums
     * are loaded RA_MB at a time before any is used (one L2 round trip a
     * batch: a loop that waited on each load took most of the kernel's
     * time). */
    float o[DPL];
#pragma unroll
    for (int i = 0; i < DPL; i++) o[i] = 0.0f;
    const float *pa = a.part_acc + (size_t)h * RA_SPLITS_MAX * HD + DPL * lane;
    for (int z0 = 0; z0 < nb; z0 += RA_MB) {
        float v[RA_MB][DPL];
#pragma unroll
        for (int j = 0; j < RA_MB; j++) {
            if (z0 + j < nb) {
                if constexpr (DPL == 4) {
                    const float4 f = __ldcg((const float4 *)(pa + (size_t)(z0 + j) * HD));
                    v[j][0] = f.x, v[j][1] = f.y, v[j][2] = f.z, v[j][3] = f.w;
                } else {
                    const float2 f = __ldcg((const float2 *)(pa + (size_t)(z0 + j) * HD));
                    v[j][0] = f.x, v[j][1] = f.y;
                }
            } else {
#pragma unroll
                for (int i = 0; i < DPL; i++) v[j][i] = 0.0f;
            }
        }
#pragma unroll
        for (int j = 0; j < RA_MB; j++) {
            const int zz = z0 + j;
            const float wz0 = __shfl_sync(0xffffffffu, w0, zz & 31), wz1 = __shfl_sync(0xffffffffu, w1, zz & 31);
            const float wz = zz < 32 ? wz0 : wz1;
            if (zz < nb && wz != 0.0f)
#pragma unroll
                for (int i = 0; i < DPL; i++) o[i] += wz * v[j][i];
        }
    }
#pragma unroll
    for (int i = 0; i < DPL; i++) o[i] = L > 0.0f ? o[i] / L : 0.0f;
    ra_out<DPL>(a, (size_t)h * HD + DPL * lane, o);
}

/* Grid (RA_SPLITS_MAX / 4, n_heads, rows) of 4 warps: row blockIdx.z (its
 * sequence's only row), head blockIdx.y, slices 4 blockIdx.x .. + 3 (those
 * past the row's count exit). */
template <int LP, int U, int STEPS>
__global__ void __launch_bounds__(128) rope_attention_kernel(const ra_args a) {
    constexpr int HD = LP * 8;
    __shared__ float cs[128]; /* cos, sin of this position: n_freq <= head_dim / 2 <= 64 */
    __shared__ float sm[4 * HD + 8]; /* the 4 warps' sums, then their (max, sum) pairs */
    const int t = blockIdx.z;
    /* The position is step metadata (uploaded before the step), no
     * kernel's output: the rotation is formed before the wait. */
    const int len = a.pos[t] + 1, nf = a.n_freq;
    int chunk;
    const int S = ra_slices(len, (32 / LP) * U, STEPS, &chunk);
    const int z = blockIdx.x * 4 + (threadIdx.x >> 5);
    ra_args r = a;
    const size_t qw = (size_t)a.n_heads * HD, kw = (size_t)a.n_kv_heads * HD, units = (size_t)a.n_heads * RA_SPLITS_MAX;
    r.q += t * qw;
    r.k += t * kw;
    r.v += t * kw;
    r.att += t * qw;
    if (r.att16) r.att16 += t * qw;
    if (r.xq) {
        r.xq += t * qw;
        r.xd += t * qw / 32;
        r.xs += t * qw / 32 * 4;
    }
    r.part_acc += t * units * HD;
    r.part_ml += t * units * 2;
    r.sync += (size_t)t * a.n_heads;
    r.slots += t;
    r.btab += (size_t)t * a.max_blocks;
    /* The slice's first round of cache loads, then the rotation, before
     * the wait on the kernel before (which wrote q, k and v). */
    uint4 kr[U], vr[U];
    if (z < S) {
        const int lane = threadIdx.x & 31, j0 = z * chunk + (lane / LP) * U;
        ra_kv_load<HD, U>(r, (int)blockIdx.y / (a.n_heads / a.n_kv_heads), lane % LP, j0, min(z * chunk + chunk, len),
                          len, kr, vr);
    }
    for (int i = threadIdx.x; i < nf; i += 128) {
        double sn, c;
        sincos((double)(len - 1) * (double)a.inv_freq[i], &sn, &c);
        cs[i] = (float)c;
        cs[nf + i] = (float)sn;
    }
    __syncthreads();
    pdl_begin();
    if (z >= S) return;
    ra_attn_slice<LP, U>(r, blockIdx.y, z, S, chunk, len, cs, sm, kr, vr);
}

/* The merge of the block sums rope_attention_kernel left with defer set
 * (its slices counted as there: `step` positions a round, at least
 * `steps` rounds): grid (ceil(cols / 128), rows) of 4 warps, a warp 32
 * dims of one head of row blockIdx.y, which are one block of the int8
 * form it also writes where xq is given.  Every load is issued before
 * any is used (one round trip); the arithmetic is the last block's merge
 * of ra_attn_slice. */
template <int HD>
__global__ void __launch_bounds__(128) ra_merge_kernel(const ra_args a, int step, int steps, int8_t *xq, float *xd,
                                                       float *xs) {
    constexpr int NB = RA_SPLITS_MAX / 4; /* block sums a head has at most */
    pdl_begin();
    const int t = blockIdx.y, lane = threadIdx.x & 31, cols = a.n_heads * HD;
    const int d0 = ((int)blockIdx.x * 4 + (int)(threadIdx.x >> 5)) * 32;
    if (d0 >= cols) return;
    const int h = d0 / HD;
    int chunk;
    const int nb = (ra_slices(a.pos[t] + 1, step, steps, &chunk) + 3) / 4;
    const size_t slot0 = ((size_t)t * a.n_heads + h) * RA_SPLITS_MAX;
    const float *ml = a.part_ml + slot0 * 2, *pa = a.part_acc + slot0 * HD + d0 % HD + lane;
    const float ninf = -INFINITY;
    const float mz = lane < nb ? __ldcg(ml + 2 * lane) : ninf, lz = lane < nb ? __ldcg(ml + 2 * lane + 1) : 0.0f;
    float v[NB];
#pragma unroll
    for (int z = 0; z < NB; z++) v[z] = z < nb ? __ldcg(pa + (size_t)z * HD) : 0.0f;
    float gm = mz;
#pragma unroll
    for (int o = 16; o > 0; o >>= 1) gm = fmaxf(gm, __shfl_xor_sync(0xffffffffu, gm, o));
    const float w = mz == ninf ? 0.0f : __expf(mz - gm), L = ra_warp_sum(w * lz);
    float acc = 0.0f;
#pragma unroll
    for (int z = 0; z < NB; z++) {
        const float wz = __shfl_sync(0xffffffffu, w, z);
        if (z < nb && wz != 0.0f) acc += wz * v[z];
    }
    const float y = L > 0.0f ? acc / L : 0.0f;
    a.att[(size_t)t * cols + d0 + lane] = y;
    const float yv[1] = {y};
    if (xq) act_q8_lanes<1>(yv, (int64_t)t * cols + d0 + lane, 0xffffffffu, xq, xd, xs);
}

extern "C" int cuda_rope_attention(struct cuda_ctx *ctx, const struct cuda_attn_args *at, const float *k,
                                   const float *v, const int32_t *pos, const int32_t *slots, const float *inv_freq,
                                   int32_t n_freq, int neox) {
    const int32_t hd = at->head_dim;
    const int32_t rows = at->n_tokens;
    const int max_rows = at->n_kv_heads == at->n_heads ? ctx->rope_att_mha : ctx->rope_att;
    if (!ctx->att_sync || rows < 1 || rows > max_rows || at->n_seqs != rows || at->kv_type != DTYPE_F16 ||
        (hd != 64 && hd != 128) || at->n_kv_heads < 1 || at->n_heads % at->n_kv_heads != 0 ||
        (int64_t)rows * at->n_heads > CUDA_ATT_SYNC_WORDS || 2 * n_freq > hd)
        return CUDA_NOT_FUSED;
    const void *bufs[] = {at->q, k, v, at->out, at->k, at->v};
    for (const void *p : bufs)
        if ((uintptr_t)p % 16 != 0) return CUDA_NOT_FUSED;
    /* Up to ctx->att_defer rows the merge is a kernel of its own that also
     * writes the gemv's int8 form of the output, at the start of the
     * scratch (the block sums go past it). */
    const int64_t cols = (int64_t)at->n_heads * hd;
    const bool defer = ctx->att_defer && rows <= ctx->att_defer && cols % 64 == 0;
    /* Without the merge kernel, its blocks leave the form at 1-2 rows
     * (the gemv's o matmul). */
    const bool q8 = defer || (rows <= 2 && cols % 64 == 0);
    const size_t q8_bytes = q8 ? (cuda_gemv_act_bytes(rows, cols) + 255) & ~(size_t)255 : 0;
    const size_t slots_n = (size_t)rows * at->n_heads * RA_SPLITS_MAX, part_bytes = slots_n * ((size_t)hd + 2) * sizeof(float);
    /* Else, from 3 rows, the output's F16 form for the o matmul at the
     * start (cuda_att_scratch, as the other attention kernels). */
    float *part = NULL;
    uint16_t *att16 = NULL;
    int8_t *xq = NULL;
    float *xd = NULL, *xs = NULL;
    if (q8) {
        uint8_t *base = (uint8_t *)cuda_scratch(ctx, q8_bytes + part_bytes);
        if (!base) return STATUS_NO_MEMORY;
        part = (float *)(base + q8_bytes);
        /* Recorded as the output's kept form before the launch when the
         * attention's blocks write it (forgotten if the launch fails). */
        if (!defer && cuda_gemv_act_q8s(ctx, at->out, rows, cols, &xq, &xd, &xs) != STATUS_OK) {
            xq = NULL; /* the o matmul quantizes for itself */
            xd = xs = NULL;
        }
    } else if (cuda_att_scratch(ctx, at, part_bytes, &att16, &part) != STATUS_OK) {
        return STATUS_NO_MEMORY;
    }
    ra_args a = {};
    a.q = at->q;
    a.k = k;
    a.v = v;
    a.att = at->out;
    a.att16 = (fp16_t *)att16;
    a.xq = xq;
    a.xd = xd;
    a.xs = xs;
    a.part_acc = part;
    a.part_ml = part + slots_n * hd;
    a.sync = ctx->att_sync;
    a.kc = (fp16_t *)at->k;
    a.vc = (fp16_t *)at->v;
    a.pos = pos;
    a.slots = slots;
    a.btab = at->block_tables;
    a.inv_freq = inv_freq;
    a.n_blocks = at->n_blocks;
    a.block_size = at->block_size;
    a.n_kv_heads = at->n_kv_heads;
    a.n_heads = at->n_heads;
    a.max_blocks = at->max_blocks;
    a.n_freq = n_freq;
    a.neox = neox;
    a.defer = defer;
    a.scale = at->scale;
    const dim3 grid(RA_SPLITS_MAX / 4, (unsigned)at->n_heads, (unsigned)rows);
    cudaError_t e;
    if (rows == 1)
        e = hd == 64 ? cuda_launch(ctx, rope_attention_kernel<8, 8, 1>, grid, dim3(128), 0, a)
                     : cuda_launch(ctx, rope_attention_kernel<16, 8, 1>, grid, dim3(128), 0, a);
    else
        e = hd == 64 ? cuda_launch(ctx, rope_attention_kernel<8, 4, 2>, grid, dim3(128), 0, a)
                     : cuda_launch(ctx, rope_attention_kernel<16, 4, 2>, grid, dim3(128), 0, a);
    if (e != cudaSuccess && xq) cuda_act_forget(ctx); /* the form recorded above was not written */
    CUDA_CHECK(ctx, e);
    CUDA_CHECK(ctx, cudaGetLastError());
    if (defer) {
        /* Recorded as the kept form of the output only now that the
         * attention is queued (the scratch already holds it). */
        if (cuda_gemv_act_q8s(ctx, at->out, rows, cols, &xq, &xd, &xs) != STATUS_OK) {
            xq = NULL; /* the o matmul quantizes for itself */
            xd = xs = NULL;
        }
        /* The slicing of the launch above: (32 / LP) * U positions a round. */
        const int step = 32 / (hd / 8) * (rows == 1 ? 8 : 4), steps = rows == 1 ? 1 : 2;
        const dim3 mgrid((unsigned)((cols + 127) / 128), (unsigned)rows);
        e = hd == 64 ? cuda_launch(ctx, ra_merge_kernel<64>, mgrid, dim3(128), 0, a, step, steps, xq, xd, xs)
                     : cuda_launch(ctx, ra_merge_kernel<128>, mgrid, dim3(128), 0, a, step, steps, xq, xd, xs);
        if (e != cudaSuccess) cuda_act_forget(ctx); /* the form recorded above was not written */
        CUDA_CHECK(ctx, e);
        CUDA_CHECK(ctx, cudaGetLastError());
    }
    return STATUS_OK;
}
