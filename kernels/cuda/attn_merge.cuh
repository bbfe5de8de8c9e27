/* The merge of a (row, head)'s context splits for one dim, shared by the
 * combine kernels of attention.cu (whose attention_combine_kernel
 * attention_q8.cu launches too) and attention_prefill.cu (partial sums
 * part_acc (n_splits, n_tokens, n_heads, hd), running (max, sum) part_ml
 * (n_splits, n_tokens, n_heads, 2)).  Weights exp(m_z - max m); a split
 * that saw nothing (max -inf) adds nothing.  The thread loads, for up to
 * ATT_MERGE_GROUP splits at once, each split's (max, sum) and its partial
 * sum of dim d, then merges them in registers: one memory round trip per
 * group and no barrier (loops over the splits had waited on a load, or a
 * barrier, each).  Past one group the running (max, sum, acc) is rescaled
 * to each group's new max; up to one group the arithmetic is the plain
 * merge in split order.  SKIP_ZERO: a split whose weight underflows to 0
 * adds nothing to acc either (the decode kernel's rule: its empty splits'
 * sums are never read). */
#ifndef KERNELS_CUDA_ATTN_MERGE_CUH
#define KERNELS_CUDA_ATTN_MERGE_CUH

#include "common.cuh"
#include "cuda_ops.h"

/* The (cos, sin) of rows 0 .. n - 1 of a sequence (positions pos0 ..) and
 * each of the hd / 2 frequencies into cs, row-major, by the block's first
 * nt threads, for the attention kernels that do the rope themselves
 * (attention_prefill.cu, attention_gqa.cu): the angle in double (at
 * positions of 1e5 and more a float product loses the phase's low
 * digits), reduced to [-pi, pi] in double, its sine and cosine in float
 * (rope.cu's are the double sincos rounded, which may differ in the last
 * bit). */
__device__ __forceinline__ void att_rope_cs(float2 *cs, int32_t n, int32_t pos0, const float *inv_freq, int hd,
                                            int nt) {
    for (int e = threadIdx.x; e < n * (hd / 2); e += nt) {
        const double ang = (double)(pos0 + e / (hd / 2)) * (double)inv_freq[e % (hd / 2)];
        const float r = (float)fma(-rint(ang * 0.15915494309189535), 6.283185307179586, ang);
        float sn, cn;
        sincosf(r, &sn, &cn);
        cs[e] = make_float2(cn, sn);
    }
}

#define ATT_MERGE_GROUP 32

template <bool SKIP_ZERO>
__device__ __forceinline__ void att_merge_dim(const float *__restrict__ part_acc, const float *__restrict__ part_ml,
                                              int32_t n_splits, int32_t n_tokens, int32_t n_heads, int32_t hd,
                                              int32_t row, int32_t head, int d, float *l_out, float *acc_out) {
    float m = -INFINITY, l = 0.0f, acc = 0.0f;
    for (int z0 = 0; z0 < n_splits; z0 += ATT_MERGE_GROUP) {
        float mz[ATT_MERGE_GROUP], lz[ATT_MERGE_GROUP], az[ATT_MERGE_GROUP];
#pragma unroll
        for (int j = 0; j < ATT_MERGE_GROUP; j++) {
            mz[j] = -INFINITY;
            if (z0 + j < n_splits) {
                const int64_t slot = ((int64_t)(z0 + j) * n_tokens + row) * n_heads + head;
                mz[j] = part_ml[slot * 2];
                lz[j] = part_ml[slot * 2 + 1];
                az[j] = part_acc[slot * hd + d];
            }
        }
        float gm = m;
#pragma unroll
        for (int j = 0; j < ATT_MERGE_GROUP; j++) gm = fmaxf(gm, mz[j]);
        if (gm == -INFINITY) continue;
        if (m != -INFINITY && m != gm) {
            const float sc = __expf(m - gm);
            l *= sc;
            acc *= sc;
        }
        m = gm;
#pragma unroll
        for (int j = 0; j < ATT_MERGE_GROUP; j++)
            if (mz[j] != -INFINITY) {
                const float w = __expf(mz[j] - m);
                l += lz[j] * w;
                if (!SKIP_ZERO || w != 0.0f) acc += az[j] * w;
            }
    }
    *l_out = l;
    *acc_out = acc;
}

/* Merges a row's splits into out (and its F16 form out16 when not NULL):
 * a block per (row, head), a thread per dim; with one_tok0
 * (CUDA_ATT_ONE_ROW) a block per sequence, whose sums sit at its index
 * (n_tokens is then the sequence count).  Defined in attention.cu. */
__global__ void attention_combine_kernel(float *__restrict__ out, fp16_t *__restrict__ out16,
                                         const float *__restrict__ part_acc, const float *__restrict__ part_ml,
                                         int32_t n_splits, int32_t n_tokens, int32_t n_heads, int32_t hd,
                                         const int32_t *__restrict__ one_tok0);

/* The row and sequence of a decode block (blockIdx.x).  CUDA_ATT_ONE_ROW: a
 * block a sequence, false for a sequence of several rows (the block has
 * nothing to do; partial sums go by sequence).  Else blockIdx.x is the row
 * and its sequence the last s with seq_tok0[s] <= row. */
__device__ __forceinline__ bool att_decode_row(const struct cuda_attn_args &a, int32_t *row_out, int32_t *seq_out) {
    int32_t lo = 0, row = blockIdx.x;
    if (a.rows == CUDA_ATT_ONE_ROW) {
        lo = blockIdx.x;
        row = a.seq_tok0[lo];
        if (a.seq_tok0[lo + 1] - row != 1) return false;
    } else {
        int32_t hi = a.n_seqs - 1;
        while (lo < hi) {
            int32_t mid = (lo + hi + 1) / 2;
            if (a.seq_tok0[mid] <= row) lo = mid;
            else hi = mid - 1;
        }
    }
    *row_out = row;
    *seq_out = lo;
    return true;
}

#endif
