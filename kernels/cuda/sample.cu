/* Sampling on the device (backend_sample): one block per row of logits runs
 * sampler_sample's steps (common/sampling.h) — a grammar's mask (the
 * tokens it leaves out become -inf, as the host path sets them before
 * sampler_sample), penalties, NaN/inf checks,
 * argmax, log-softmax, top-k/top-p as radix selects in the total order
 * "larger value first, lower id on ties", min-p and the draw in ascending
 * id order — so that only a few bytes per row come back to the host.
 *
 * Memory.  The ctx has no field for sampling, and the ctx scratch belongs
 * to matmul (a CUDA graph replays it), so this file keeps its own buffers:
 * one grow-only set per device index (a worker has one backend per device),
 * guarded by a mutex, never freed (the process exit releases them).  They
 * are: per-row parameters, penalty pairs and mask words (pinned staging +
 * device copy), per-row results (device + pinned), rewritten-logit rows for
 * the rows that have penalties or a mask (at most SAMPLE_SLOTS at a time;
 * more such rows take more launches), and a host count array of n_vocab
 * ints.
 *
 * top-p first finds, in the pass that sums the weights, the band of weight
 * levels where its cut lies (sampler_sample's prefilter); when that band
 * holds at most SAMPLE_LIST_MAX tokens its select reads a list of them in
 * shared memory instead of the whole row, with the same result.
 *
 * Left to the host sampler (CUDA_NOT_FUSED): n_vocab above SAMPLE_VOCAB_MAX,
 * a device index of SAMPLE_DEVICES_MAX or more, and a failed allocation of
 * these buffers (the host path needs no device memory). */
#include "common.cuh"

#include <float.h>
#include <limits.h>
#include <math.h>
#include <mutex>
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>

extern "C" {
#include "../backend.h"
}

#define SAMPLE_THREADS 1024
#define SAMPLE_WARPS (SAMPLE_THREADS / 32)
#define SAMPLE_VOCAB_MAX (1 << 22) /* keeps every fixed-point mass below 2^62 */
#define SAMPLE_DEVICES_MAX 16
#define SAMPLE_SLOTS 64            /* penalised rows per launch: 64 x n_vocab floats of device memory */
#define SAMPLE_TOP_MAX SAMPLING_TOP_LOGPROBS_MAX
#define SAMPLE_LIST_MAX 4096       /* top-p band list in shared memory: 32 KB */
#define SAMPLE_LEVELS 7            /* weight levels of the top-p prefilter */

/* Row flags. */
enum {
    SAMPLE_F_GREEDY = 1,
    SAMPLE_F_LOGPROBS = 2,
    SAMPLE_F_TOP_P = 4,
    SAMPLE_F_MIN_P = 8,
    SAMPLE_F_REP = 16,
    SAMPLE_F_CHECK_ONLY = 32, /* a bad history id: only the NaN check runs (it is reported first) */
};

/* One row's request as the kernel reads it; every derived float is computed
 * on the host with the same expressions as sampler_sample. */
struct sample_dev_row {
    int32_t flags;
    int32_t top_k;        /* 0 = off, else 0 < top_k < n_vocab */
    int32_t n_top;        /* top logprobs wanted, <= n_vocab */
    int32_t slot;         /* penalised-logit row, or -1: no penalties */
    int32_t pen_off;      /* first (token, count) pair of this row */
    int32_t n_pen;
    int32_t mask_off;     /* first word of this row's mask (bit t of word t / 64: t allowed), or -1: none */
    float inv_t;          /* 1 / temperature */
    float top_p;
    float min_p_off;      /* temperature * logf(min_p): zmin = zmax + this */
    float rep, freq, pres;
    double u;             /* sampling_uniform(seed, pos) */
};

struct sample_dev_out {
    int32_t token;
    int32_t bad;          /* lowest id of a NaN or +inf logit, or -1 */
    float bad_value;
    int32_t all_ninf;     /* every penalised logit is -inf */
    float logprob;
    int32_t top_token[SAMPLE_TOP_MAX];
    float top_logprob[SAMPLE_TOP_MAX];
};

/* ---- Device side ---- */

struct sample_smem {
    uint32_t cnt[256];                /* radix pass: tokens per digit */
    unsigned long long mass[256];     /* and their fixed-point weight */
    double red_d[SAMPLE_WARPS];
    unsigned long long red_u64[SAMPLE_WARPS];
    uint32_t red_u32[SAMPLE_WARPS];
    int32_t red_i[SAMPLE_WARPS];
    uint32_t prefix, k_rem, cnt_last, take_all;
    unsigned long long acc;
    int32_t sel_id, bad, tok_first, tok_last, n_coll;
    int32_t coll[SAMPLE_TOP_MAX];
    int32_t n_list;                   /* the top-p band: ids and values */
    int32_t list_id[SAMPLE_LIST_MAX];
    float list_v[SAMPLE_LIST_MAX];
};

/* Level j of the top-p prefilter holds the tokens with (zmax - z) / T <=
 * cut[j] (weights above ~0.32, 0.1, 0.03, 0.01, 1e-3, 1e-4, 1e-6). */
__device__ __forceinline__ float sample_cut(int j) {
    return j == 0 ? 1.15f : j == 1 ? 2.3f : j == 2 ? 3.45f : j == 3 ? 4.6f : j == 4 ? 6.9f : j == 5 ? 9.2f : 13.8f;
}

/* Order-preserving 32-bit key: larger value, larger key.  -0 becomes +0
 * first, since the CPU's comparisons see them as equal (then id decides). */
__device__ __forceinline__ uint32_t sample_key(float v) {
    uint32_t b = __float_as_uint(v == 0.0f ? 0.0f : v);
    return (b & 0x80000000u) ? ~b : (b | 0x80000000u);
}
__device__ __forceinline__ float sample_key_value(uint32_t k) {
    return __uint_as_float((k & 0x80000000u) ? (k & 0x7fffffffu) : ~k);
}
/* Token (key, i) is in the prefix of the total order that ends at (lk, li).
 * Every non-NaN float has a key above 0, so (0, -1) means "all tokens". */
__device__ __forceinline__ bool sample_in(uint32_t key, int32_t i, uint32_t lk, int32_t li) {
    return key > lk || (key == lk && i <= li);
}
/* (zmax - z) * inv_t, rounded as sampler_sample does (no contraction);
 * non-increasing in z, the same for -0 and +0, +inf for z = -inf. */
__device__ __forceinline__ float sample_dist(float z, float zmax, float inv_t) {
    return __fmul_rn(__fsub_rn(zmax, z), inv_t);
}
/* sampler_sample's weight expf(-((zmax - z) * inv_t)). */
__device__ __forceinline__ float sample_weight(float z, float zmax, float inv_t) {
    return expf(-sample_dist(z, zmax, inv_t));
}
/* Weights in (0, 1] as 2^-40 fixed point: integer sums are exact and the
 * same in any order, so the top-p cut does not depend on thread timing. */
__device__ __forceinline__ unsigned long long sample_fixed(float w) {
    return __double2ull_rn((double)w * 1099511627776.0);
}

template <typename T> __device__ __forceinline__ T sample_warp_sum(T v) {
    for (int o = 16; o > 0; o >>= 1) v += __shfl_xor_sync(0xffffffffu, v, o);
    return v;
}

/* Sum over the block, the same value in every thread (a fixed tree, so a
 * double sum is reproducible). */
template <typename T> __device__ T sample_block_sum(T v, T *sh) {
    __syncthreads();
    v = sample_warp_sum(v);
    if ((threadIdx.x & 31) == 0) sh[threadIdx.x >> 5] = v;
    __syncthreads();
    return sample_warp_sum(sh[threadIdx.x & 31]);
}

/* Exclusive prefix sum over threads in thread order; *total = the sum. */
template <typename T> __device__ T sample_block_scan(T v, T *sh, T *total) {
    __syncthreads();
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
    T incl = v;
    for (int o = 1; o < 32; o <<= 1) {
        T y = __shfl_up_sync(0xffffffffu, incl, o);
        if (lane >= o) incl += y;
    }
    T excl = __shfl_up_sync(0xffffffffu, incl, 1);
    if (lane == 0) excl = 0;
    if (lane == 31) sh[warp] = incl;
    __syncthreads();
    T t = sh[lane];
    for (int o = 1; o < 32; o <<= 1) {
        T y = __shfl_up_sync(0xffffffffu, t, o);
        if (lane >= o) t += y;
    }
    T before = __shfl_sync(0xffffffffu, t, (warp + 31) & 31);
    *total = __shfl_sync(0xffffffffu, t, 31);
    return (warp == 0 ? (T)0 : before) + excl;
}

/* The first token of the order over the block: (key, id) in every thread. */
__device__ void sample_block_first(uint32_t *key, int32_t *id, sample_smem *sm) {
    uint32_t k = *key;
    int32_t i = *id;
    __syncthreads();
    for (int round = 0; round < 2; round++) {
        for (int o = 16; o > 0; o >>= 1) {
            uint32_t k2 = __shfl_xor_sync(0xffffffffu, k, o);
            int32_t i2 = __shfl_xor_sync(0xffffffffu, i, o);
            if (k2 > k || (k2 == k && i2 < i)) {
                k = k2;
                i = i2;
            }
        }
        if (round == 1) break;
        if ((threadIdx.x & 31) == 0) {
            sm->red_u32[threadIdx.x >> 5] = k;
            sm->red_i[threadIdx.x >> 5] = i;
        }
        __syncthreads();
        k = sm->red_u32[threadIdx.x & 31];
        i = sm->red_i[threadIdx.x & 31];
    }
    *key = k;
    *id = i;
}

/* Radix select over the key bits, 8 at a time, within the prefix set S =
 * (sk, si).  Count mode (MASS false): the k-th token of S in the order.
 * Mass mode: the last token of the shortest prefix of S whose fixed-point
 * weight reaches target.  Ties at the found value are taken in ascending id
 * order, so the result is exactly a prefix of the total order: (*lk, *li).
 *
 * LIST (mass mode only): the histograms read sm->list_id/list_v[0..n_list),
 * a band B = S' \ P of S, where P and S' are prefixes of S (unions of whole
 * key classes), P's weight acc0 misses the target and S''s reaches it.  The
 * result is the one over all of S: at any threshold x of a pass, the
 * cumulative weight of S above x is acc0 + weight(B above x) whenever some
 * token of B lies above x (then all of P does), and otherwise both that and
 * the true cumulative are <= acc0, which misses the target; so every digit
 * chosen, the final acc and the count of the found key (a class inside B)
 * are those of the full select.  The last step (the r-th id of that key)
 * scans the whole row with S's bounds, as the full select does. */
template <bool MASS, bool LIST = false>
__device__ void sample_select(const float *z, int32_t n, uint32_t sk, int32_t si, uint32_t k, double target,
                              float zmax, float inv_t, sample_smem *sm, uint32_t *lk, int32_t *li,
                              unsigned long long acc0 = 0) {
    static_assert(MASS || !LIST, "the band list is for mass mode");
    const int tid = threadIdx.x;
    __syncthreads();
    const int32_t n_src = LIST ? min(sm->n_list, SAMPLE_LIST_MAX) : n;
    if (tid == 0) {
        sm->prefix = 0;
        sm->k_rem = k;
        sm->acc = acc0;
        sm->take_all = 0;
        sm->sel_id = 0;
    }
    for (int shift = 24; shift >= 0; shift -= 8) {
        __syncthreads();
        if (tid < 256) {
            sm->cnt[tid] = 0;
            if (MASS) sm->mass[tid] = 0;
        }
        __syncthreads();
        const uint32_t prefix = sm->prefix;
        const uint32_t himask = shift == 24 ? 0u : 0xffffffffu << (shift + 8);
        /* The first passes put most tokens in a few digits: lanes with the
         * same digit add once per warp (__match_any_sync, sm_70+), else
         * same-address shared atomics serialise the block.  The whole warp
         * takes every trip, so the warp-wide calls see all lanes. */
        const int lane = tid & 31;
        for (int32_t base = 0; base < n_src; base += SAMPLE_THREADS) {
            const int32_t at = base + tid;
            const int32_t i = LIST ? (at < n_src ? sm->list_id[at] : 0) : at;
            const float v = at < n_src ? (LIST ? sm->list_v[at] : z[at]) : 0.0f;
            const uint32_t key = sample_key(v);
            const bool valid = at < n_src && !((key ^ prefix) & himask) && sample_in(key, i, sk, si);
            const uint32_t d = valid ? (key >> shift) & 255u : 256u;
            const unsigned peers = __match_any_sync(0xffffffffu, d);
            const bool leader = valid && lane == __ffs(peers) - 1;
            if (!MASS) {
                if (leader) atomicAdd(&sm->cnt[d], (uint32_t)__popc(peers));
                continue;
            }
            const unsigned long long wf = valid ? sample_fixed(sample_weight(v, zmax, inv_t)) : 0ull;
            unsigned leaders = __ballot_sync(0xffffffffu, leader);
            if (__popc(leaders) <= 4) {
                while (leaders) {
                    const int src = __ffs(leaders) - 1;
                    leaders &= leaders - 1;
                    const uint32_t dd = __shfl_sync(0xffffffffu, d, src);
                    const unsigned long long m = sample_warp_sum<unsigned long long>(d == dd ? wf : 0ull);
                    if (lane == src) {
                        atomicAdd(&sm->cnt[dd], (uint32_t)__popc(peers));
                        atomicAdd(&sm->mass[dd], m);
                    }
                }
            } else if (valid) {
                atomicAdd(&sm->cnt[d], 1u);
                atomicAdd(&sm->mass[d], wf);
            }
        }
        __syncthreads();
        if (tid < 32) {
            /* Lane l owns digits 255 - 8l down to 248 - 8l: lanes in order. */
            const int top = 255 - 8 * lane; /* lane == tid here */
            uint32_t c = 0;
            unsigned long long m = 0;
            for (int j = 0; j < 8; j++) {
                c += sm->cnt[top - j];
                if (MASS) m += sm->mass[top - j];
            }
            uint32_t ci = c;
            unsigned long long mi = m;
            for (int o = 1; o < 32; o <<= 1) {
                uint32_t y = __shfl_up_sync(0xffffffffu, ci, o);
                unsigned long long ym = __shfl_up_sync(0xffffffffu, mi, o);
                if (lane >= o) {
                    ci += y;
                    mi += ym;
                }
            }
            const uint32_t need = sm->k_rem;
            const unsigned long long acc = sm->acc;
            const bool all = sm->take_all != 0;
            bool hit = MASS ? (!all && (double)(acc + mi) >= target) : ci >= need;
            unsigned hits = __ballot_sync(0xffffffffu, hit);
            unsigned nonempty = __ballot_sync(0xffffffffu, c > 0);
            /* No lane reaches the mass only through rounding (or once that
             * happened): then keep all of S, i.e. the lowest digit present. */
            int src = hits ? __ffs(hits) - 1 : 31 - __clz(nonempty);
            if (lane == src) {
                uint32_t cb = ci - c;
                unsigned long long mb = mi - m;
                int chosen = -1;
                for (int j = 0; j < 8; j++) {
                    int b = top - j;
                    if (hits) {
                        bool ok = MASS ? (double)(acc + mb + sm->mass[b]) >= target : cb + sm->cnt[b] >= need;
                        if (ok) {
                            chosen = b;
                            break;
                        }
                        cb += sm->cnt[b];
                        if (MASS) mb += sm->mass[b];
                    } else if (sm->cnt[b]) {
                        chosen = b;
                    }
                }
                if (!hits) {
                    cb = ci - c;
                    mb = mi - m;
                    for (int b = top; b > chosen; b--) {
                        cb += sm->cnt[b];
                        if (MASS) mb += sm->mass[b];
                    }
                    sm->take_all = 1;
                }
                sm->prefix = prefix | ((uint32_t)chosen << shift);
                sm->k_rem = need - cb;
                sm->acc = acc + mb;
                sm->cnt_last = sm->cnt[chosen];
            }
        }
    }
    __syncthreads();
    const uint32_t key_at = sm->prefix, cnt_at = sm->cnt_last;
    uint32_t r = sm->k_rem;
    if (MASS) {
        if (sm->take_all) {
            r = cnt_at;
        } else {
            /* Every token with this key has the same weight. */
            unsigned long long w = sample_fixed(sample_weight(sample_key_value(key_at), zmax, inv_t));
            double need = target - (double)sm->acc;
            double q = w ? ceil(need / (double)w) : (double)cnt_at;
            r = q < 1.0 ? 1u : (q > (double)cnt_at ? cnt_at : (uint32_t)q);
        }
    }
    /* The r-th token of S with this key, in ascending id order: each thread
     * takes a contiguous run of ids. */
    const int32_t chunk = (n + SAMPLE_THREADS - 1) / SAMPLE_THREADS;
    const int32_t lo = tid * chunk, hi = min(n, lo + chunk);
    uint32_t c = 0;
    for (int32_t i = lo; i < hi; i++) {
        uint32_t key = sample_key(z[i]);
        c += key == key_at && sample_in(key, i, sk, si);
    }
    uint32_t total;
    uint32_t before = sample_block_scan<uint32_t>(c, sm->red_u32, &total);
    if (before < r && r <= before + c) {
        uint32_t j = before;
        for (int32_t i = lo; i < hi; i++) {
            uint32_t key = sample_key(z[i]);
            if (key == key_at && sample_in(key, i, sk, si) && ++j == r) {
                sm->sel_id = i;
                break;
            }
        }
    }
    __syncthreads();
    *lk = key_at;
    *li = sm->sel_id;
}

__global__ void __launch_bounds__(SAMPLE_THREADS)
sample_f32_kernel(const float *logits, int32_t n, const struct sample_dev_row *rows, const int2 *pairs,
                  const unsigned long long *masks, float *zbuf, struct sample_dev_out *outs, int32_t row0) {
    __shared__ sample_smem sm;
    const int tid = threadIdx.x;
    const int32_t r = row0 + (int32_t)blockIdx.x;
    const struct sample_dev_row p = rows[r];
    const float *x = logits + (size_t)r * n;
    struct sample_dev_out *o = outs + r;
    float *zw = p.slot >= 0 ? zbuf + (size_t)p.slot * n : NULL;
    /* A masked row always has a slot (sample_run): the tokens its mask
     * leaves out are -inf there, before anything else looks at them. */
    const unsigned long long *mk = p.mask_off >= 0 ? masks + p.mask_off : NULL;

    /* NaN and +inf in the raw logits of the allowed tokens (the CPU checks
     * them first, on the masked row), while copying the row where the mask
     * or penalties will change it. */
    if (tid == 0) sm.bad = INT_MAX;
    __syncthreads();
    for (int32_t i = tid; i < n; i += SAMPLE_THREADS) {
        float v = x[i];
        bool ok = !mk || ((mk[i >> 6] >> (i & 63)) & 1ull);
        if (ok && (isnan(v) || v == INFINITY)) atomicMin(&sm.bad, i);
        if (zw) zw[i] = ok ? v : -INFINITY;
    }
    __syncthreads();
    if (sm.bad != INT_MAX || (p.flags & SAMPLE_F_CHECK_ONLY)) {
        if (tid == 0) {
            o->token = -1;
            o->bad = sm.bad != INT_MAX ? sm.bad : -1;
            o->bad_value = sm.bad != INT_MAX ? x[sm.bad] : 0.0f;
            o->all_ninf = 0;
        }
        return;
    }
    if (zw) {
        /* One distinct token per pair, so no two threads touch one logit. */
        for (int32_t j = tid; j < p.n_pen; j += SAMPLE_THREADS) {
            int2 pc = pairs[p.pen_off + j];
            float v = zw[pc.x];
            if (p.flags & SAMPLE_F_REP) v = v > 0 ? __fdiv_rn(v, p.rep) : __fmul_rn(v, p.rep);
            v = __fsub_rn(v, __fadd_rn(__fmul_rn((float)pc.y, p.freq), p.pres));
            zw[pc.x] = v > FLT_MAX ? FLT_MAX : v;
        }
        __syncthreads();
    }
    const float *z = zw ? zw : x;

    uint32_t bk = 0;
    int32_t bi = INT_MAX;
    for (int32_t i = tid; i < n; i += SAMPLE_THREADS) {
        uint32_t key = sample_key(z[i]);
        if (key > bk) { /* ids rise within a thread: the first of equal keys stays */
            bk = key;
            bi = i;
        }
    }
    sample_block_first(&bk, &bi, &sm);
    const float zmax = z[bi];
    if (zmax == -INFINITY) {
        if (tid == 0) {
            o->token = -1;
            o->bad = -1;
            o->all_ninf = 1;
        }
        return;
    }

    double lse = 0;
    if (p.flags & SAMPLE_F_LOGPROBS) {
        double s = 0;
        for (int32_t i = tid; i < n; i += SAMPLE_THREADS) s += exp((double)z[i] - (double)zmax);
        s = sample_block_sum<double>(s, sm.red_d);
        lse = (double)zmax + log(s);
        if (p.n_top > 0) {
            uint32_t tk;
            int32_t ti;
            sample_select<false>(z, n, 0u, -1, (uint32_t)p.n_top, 0.0, zmax, 1.0f, &sm, &tk, &ti);
            if (tid == 0) sm.n_coll = 0;
            __syncthreads();
            for (int32_t i = tid; i < n; i += SAMPLE_THREADS)
                if (sample_in(sample_key(z[i]), i, tk, ti)) {
                    int at = atomicAdd(&sm.n_coll, 1);
                    if (at < SAMPLE_TOP_MAX) sm.coll[at] = i; /* exactly n_top arrive; the test is for safety */
                }
            __syncthreads();
            if (tid == 0) {
                /* Exactly n_top tokens, in arrival order: sort them. */
                for (int a = 1; a < p.n_top; a++) {
                    int32_t t = sm.coll[a];
                    uint32_t kt = sample_key(z[t]);
                    int b = a;
                    for (; b > 0; b--) {
                        int32_t u = sm.coll[b - 1];
                        uint32_t ku = sample_key(z[u]);
                        if (!(kt > ku || (kt == ku && t < u))) break;
                        sm.coll[b] = u;
                    }
                    sm.coll[b] = t;
                }
                for (int a = 0; a < p.n_top; a++) {
                    o->top_token[a] = sm.coll[a];
                    o->top_logprob[a] = (float)((double)z[sm.coll[a]] - lse);
                }
            }
        }
    }

    int32_t token = bi;
    if (!(p.flags & SAMPLE_F_GREEDY)) {
        const float inv_t = p.inv_t;
        uint32_t lk = 0u;
        int32_t li = -1;
        if (p.top_k > 0) sample_select<false>(z, n, 0u, -1, (uint32_t)p.top_k, 0.0, zmax, inv_t, &sm, &lk, &li);
        if (p.flags & SAMPLE_F_TOP_P) {
            /* top-p works inside the top-k set S, renormalised over it.  The
             * pass that sums S's weight t (the target's denominator, always
             * over all of S) also counts tokens and weight in the levels
             * d <= cut[j], d = (zmax - z) / T (sampler_sample's prefilter):
             * each is a prefix of the order, since d does not increase with
             * z.  The cut lies in the first level whose weight reaches the
             * target, past the level before it; the select then only looks
             * at that band, compacted into shared memory. */
            unsigned long long t = 0, lm[SAMPLE_LEVELS];
            uint32_t lc[SAMPLE_LEVELS];
#pragma unroll
            for (int j = 0; j < SAMPLE_LEVELS; j++) {
                lm[j] = 0;
                lc[j] = 0;
            }
            for (int32_t i = tid; i < n; i += SAMPLE_THREADS) {
                float v = z[i];
                if (!sample_in(sample_key(v), i, lk, li)) continue;
                const float d = sample_dist(v, zmax, inv_t);
                const unsigned long long f = sample_fixed(expf(-d));
                t += f;
#pragma unroll
                for (int j = 0; j < SAMPLE_LEVELS; j++)
                    if (d <= sample_cut(j)) {
                        lm[j] += f;
                        lc[j]++;
                    }
            }
            t = sample_block_sum<unsigned long long>(t, sm.red_u64);
            const double target = (double)p.top_p * (double)t;
            int lev = SAMPLE_LEVELS;
            unsigned long long m_lo = 0;
            uint32_t c_lo = 0, c_hi = 0;
#pragma unroll
            for (int j = 0; j < SAMPLE_LEVELS; j++) {
                const unsigned long long mj = sample_block_sum<unsigned long long>(lm[j], sm.red_u64);
                const uint32_t cj = sample_block_sum<uint32_t>(lc[j], sm.red_u32);
                if (lev < SAMPLE_LEVELS) continue;
                /* The select's own test, on the same exact integers. */
                if ((double)mj >= target) {
                    lev = j;
                    c_hi = cj;
                } else {
                    m_lo = mj;
                    c_lo = cj;
                }
            }
            /* The band path needs no 'take all' (the select's branch for a
             * set whose whole weight misses the target through rounding):
             * S' = level lev reaches the target by choice of lev, so every
             * pass of the select has a digit that hits, exactly as over all
             * of S, whose weight t reaches top_p * t because top_p < 1.  So
             * neither path ever takes that branch, and they cannot differ
             * by it. */
            if (lev < SAMPLE_LEVELS && c_hi - c_lo <= SAMPLE_LIST_MAX) {
                const float cut_hi = sample_cut(lev), cut_lo = lev > 0 ? sample_cut(lev - 1) : -1.0f;
                if (tid == 0) sm.n_list = 0;
                __syncthreads();
                const int lane = tid & 31;
                for (int32_t base = 0; base < n; base += SAMPLE_THREADS) {
                    const int32_t i = base + tid;
                    const float v = i < n ? z[i] : -INFINITY;
                    bool take = false;
                    if (i < n && sample_in(sample_key(v), i, lk, li)) {
                        const float d = sample_dist(v, zmax, inv_t);
                        take = d <= cut_hi && !(d <= cut_lo);
                    }
                    const unsigned b = __ballot_sync(0xffffffffu, take);
                    int32_t at = 0;
                    if (lane == 0 && b) at = atomicAdd(&sm.n_list, __popc(b));
                    at = __shfl_sync(0xffffffffu, at, 0) + __popc(b & ((1u << lane) - 1u));
                    if (take && at < SAMPLE_LIST_MAX) { /* exactly c_hi - c_lo arrive; the test is for safety */
                        sm.list_id[at] = i;
                        sm.list_v[at] = v;
                    }
                }
                sample_select<true, true>(z, n, lk, li, 0u, target, zmax, inv_t, &sm, &lk, &li, m_lo);
            } else {
                sample_select<true>(z, n, lk, li, 0u, target, zmax, inv_t, &sm, &lk, &li);
            }
        }
        const float zmin = (p.flags & SAMPLE_F_MIN_P) ? __fadd_rn(zmax, p.min_p_off) : -INFINITY;
        /* The draw: the first kept token, in ascending id order, whose
         * cumulative weight exceeds u times the kept total.  Contiguous id
         * runs per thread and a block scan give the id-order cumulative. */
        const int32_t chunk = (n + SAMPLE_THREADS - 1) / SAMPLE_THREADS;
        const int32_t lo = tid * chunk, hi = min(n, lo + chunk);
        double s = 0;
        for (int32_t i = lo; i < hi; i++) {
            float v = z[i];
            if (v >= zmin && sample_in(sample_key(v), i, lk, li)) s += (double)sample_weight(v, zmax, inv_t);
        }
        if (tid == 0) {
            sm.tok_first = INT_MAX;
            sm.tok_last = -1;
        }
        double total;
        double cum = sample_block_scan<double>(s, sm.red_d, &total);
        const double target = p.u * total;
        int32_t last = -1;
        bool found = false;
        for (int32_t i = lo; i < hi; i++) {
            float v = z[i];
            if (v >= zmin && sample_in(sample_key(v), i, lk, li)) {
                last = i;
                cum += (double)sample_weight(v, zmax, inv_t);
                if (cum > target) {
                    atomicMin(&sm.tok_first, i);
                    found = true;
                    break;
                }
            }
        }
        /* If rounding leaves the cumulative short: the last kept token. */
        if (!found && last >= 0) atomicMax(&sm.tok_last, last);
        __syncthreads();
        token = sm.tok_first != INT_MAX ? sm.tok_first : sm.tok_last;
    }
    if (tid == 0) {
        o->token = token;
        o->bad = -1;
        o->all_ninf = 0;
        o->logprob = (p.flags & SAMPLE_F_LOGPROBS) ? (float)((double)z[token] - lse) : 0.0f;
    }
}

/* ---- Host side ---- */

struct sample_state {
    std::mutex lock;
    void *h_in, *d_in;  /* rows, then (token, count) pairs, then mask words */
    size_t in_bytes;
    struct sample_dev_out *h_out, *d_out;
    int32_t out_rows;
    float *d_z;         /* SAMPLE_SLOTS rows of masked or penalised logits */
    int32_t z_vocab;
    int32_t *count;     /* (n_vocab) history counts; all zero between calls */
    int32_t count_vocab;
};

static struct sample_state sample_states[SAMPLE_DEVICES_MAX];

/* Grow-only buffers; 0, or -1 when an allocation fails (then the call goes
 * to the host sampler). */
static int sample_reserve(struct sample_state *st, size_t in_bytes, int32_t n_rows, int32_t n_vocab, bool need_z) {
    if (in_bytes > st->in_bytes) {
        cudaFreeHost(st->h_in);
        cudaFree(st->d_in);
        st->h_in = st->d_in = NULL;
        st->in_bytes = 0;
        size_t want = in_bytes + in_bytes / 4;
        if (cudaHostAlloc(&st->h_in, want, cudaHostAllocDefault) != cudaSuccess ||
            cudaMalloc(&st->d_in, want) != cudaSuccess)
            return -1;
        st->in_bytes = want;
    }
    if (n_rows > st->out_rows) {
        cudaFreeHost(st->h_out);
        cudaFree(st->d_out);
        st->h_out = st->d_out = NULL;
        st->out_rows = 0;
        int32_t want = n_rows + n_rows / 4;
        size_t bytes = (size_t)want * sizeof(struct sample_dev_out);
        if (cudaHostAlloc((void **)&st->h_out, bytes, cudaHostAllocDefault) != cudaSuccess ||
            cudaMalloc((void **)&st->d_out, bytes) != cudaSuccess)
            return -1;
        st->out_rows = want;
    }
    if (need_z && n_vocab > st->z_vocab) {
        cudaFree(st->d_z);
        st->d_z = NULL;
        st->z_vocab = 0;
        if (cudaMalloc((void **)&st->d_z, (size_t)SAMPLE_SLOTS * n_vocab * sizeof(float)) != cudaSuccess) return -1;
        st->z_vocab = n_vocab;
    }
    if (n_vocab > st->count_vocab) {
        free(st->count);
        st->count = (int32_t *)calloc((size_t)n_vocab, sizeof(int32_t));
        st->count_vocab = st->count ? n_vocab : 0;
        if (!st->count) return -1;
    }
    return 0;
}

/* The penalty window of row sr: history[*start .. n_history). */
static bool sample_penalised(const struct sampling_params *sp) {
    float rep = sp->repetition_penalty;
    return (rep != 0 && rep != 1) || sp->presence_penalty != 0 || sp->frequency_penalty != 0;
}
static int32_t sample_window_start(const struct sampling_params *sp, int32_t n_history) {
    return sp->penalty_last_n > 0 && sp->penalty_last_n < n_history ? n_history - sp->penalty_last_n : 0;
}

static void sample_row_fail(struct backend_sample_row *sr, int status, const char *fmt, ...)
    __attribute__((format(printf, 3, 4)));
static void sample_row_fail(struct backend_sample_row *sr, int status, const char *fmt, ...) {
    memset(&sr->result, 0, sizeof sr->result);
    sr->result.token = -1;
    sr->status = status;
    va_list ap;
    va_start(ap, fmt);
    vsnprintf(sr->err, sizeof sr->err, fmt, ap);
    va_end(ap);
}

static int sample_launch(struct cuda_ctx *ctx, struct sample_state *st, const float *logits, int32_t n_vocab,
                         const struct sample_dev_row *d_rows, const int2 *d_pairs,
                         const unsigned long long *d_masks, int32_t row0, int32_t rows) {
    if (rows == 0) return STATUS_OK;
    sample_f32_kernel<<<rows, SAMPLE_THREADS, 0, CUDA_STREAM(ctx)>>>(logits, n_vocab, d_rows, d_pairs, d_masks,
                                                                     st->d_z, st->d_out, row0);
    CUDA_CHECK(ctx, cudaGetLastError());
    return STATUS_OK;
}

/* With st locked: build the rows and pairs, run, fill the results. */
static int sample_run(struct cuda_ctx *ctx, struct sample_state *st, const float *logits, int32_t n_vocab,
                      struct backend_sample_row *rows, int32_t n_rows) {
    size_t n_pairs_max = 0;
    int32_t n_masked = 0;
    bool any_pen = false;
    for (int32_t r = 0; r < n_rows; r++) {
        const struct sampling_params *sp = rows[r].params;
        n_masked += rows[r].allow != NULL;
        if (!sample_penalised(sp)) continue;
        any_pen = true;
        n_pairs_max += (size_t)(rows[r].n_history - sample_window_start(sp, rows[r].n_history));
    }
    /* Rows, then the pairs (at most n_pairs_max), then each masked row's
     * words; every part starts on 8 bytes (the rows hold a double, a pair
     * is 8 bytes). */
    const size_t words = ((size_t)n_vocab + 63) / 64;
    const size_t rows_bytes = (size_t)n_rows * sizeof(struct sample_dev_row);
    const size_t mask_at = rows_bytes + n_pairs_max * sizeof(int2);
    const size_t in_bytes = mask_at + (size_t)n_masked * words * sizeof(unsigned long long);
    if (sample_reserve(st, in_bytes, n_rows, n_vocab, any_pen || n_masked > 0) != 0) {
        cudaGetLastError(); /* an allocation failure is not sticky; clear it */
        return CUDA_NOT_FUSED;
    }
    struct sample_dev_row *hr = (struct sample_dev_row *)st->h_in;
    int2 *hp = (int2 *)((char *)st->h_in + rows_bytes);
    unsigned long long *hm = (unsigned long long *)((char *)st->h_in + mask_at);
    int32_t n_pairs = 0, slot = 0, n_mask_rows = 0;
    for (int32_t r = 0; r < n_rows; r++) {
        struct backend_sample_row *sr = &rows[r];
        const struct sampling_params *sp = sr->params;
        struct sample_dev_row *d = &hr[r];
        memset(d, 0, sizeof *d);
        d->slot = -1;
        d->mask_off = -1;
        if (sr->allow) {
            memcpy(hm + (size_t)n_mask_rows * words, sr->allow, words * sizeof(unsigned long long));
            d->mask_off = (int32_t)((size_t)n_mask_rows++ * words);
        }
        sr->status = 0;
        sr->err[0] = 0;
        if (!(sp->temperature > 0 && sp->top_k != 1 && isfinite(1.0f / sp->temperature))) {
            d->flags |= SAMPLE_F_GREEDY;
        } else {
            d->inv_t = 1.0f / sp->temperature;
            d->top_k = sp->top_k > 0 && sp->top_k < n_vocab ? sp->top_k : 0;
            if (sp->top_p > 0 && sp->top_p < 1) {
                d->flags |= SAMPLE_F_TOP_P;
                d->top_p = sp->top_p;
            }
            if (sp->min_p > 0) {
                d->flags |= SAMPLE_F_MIN_P;
                d->min_p_off = sp->temperature * logf(sp->min_p);
            }
            d->u = sampling_uniform(sp->seed, sr->pos);
        }
        if (sp->logprobs || sp->top_logprobs > 0) {
            d->flags |= SAMPLE_F_LOGPROBS;
            d->n_top = sp->top_logprobs < n_vocab ? sp->top_logprobs : n_vocab;
        }
        if (!sample_penalised(sp)) {
            if (sr->allow) d->slot = slot++ % SAMPLE_SLOTS;
            continue;
        }
        const int32_t start = sample_window_start(sp, sr->n_history);
        int32_t bad = -1;
        for (int32_t i = start; i < sr->n_history && bad < 0; i++)
            if (sr->history[i] < 0 || sr->history[i] >= n_vocab) bad = i;
        if (bad >= 0) {
            /* Reported unless the logits hold a NaN (the CPU checks those first). */
            d->flags |= SAMPLE_F_CHECK_ONLY;
            snprintf(sr->err, sizeof sr->err, "history[%d] = %d is outside the vocabulary [0, %d)", bad,
                     sr->history[bad], n_vocab);
            continue;
        }
        /* Distinct tokens with their counts (sampler_penalize's rule). */
        int32_t *count = st->count;
        for (int32_t i = start; i < sr->n_history; i++) count[sr->history[i]]++;
        d->pen_off = n_pairs;
        for (int32_t i = start; i < sr->n_history; i++) {
            int32_t t = sr->history[i];
            if (count[t] == 0) continue;
            hp[n_pairs].x = t;
            hp[n_pairs++].y = count[t];
            count[t] = 0;
        }
        d->n_pen = n_pairs - d->pen_off;
        float rep = sp->repetition_penalty;
        if (rep != 0 && rep != 1) d->flags |= SAMPLE_F_REP;
        d->rep = rep;
        d->freq = sp->frequency_penalty;
        d->pres = sp->presence_penalty;
        d->slot = slot++ % SAMPLE_SLOTS;
    }
    /* The pairs' unused tail is sent along when there are masks after it. */
    const size_t used = n_mask_rows > 0 ? mask_at + (size_t)n_mask_rows * words * sizeof(unsigned long long)
                                        : rows_bytes + (size_t)n_pairs * sizeof(int2);
    CUDA_CHECK(ctx, cudaMemcpyAsync(st->d_in, st->h_in, used, cudaMemcpyHostToDevice, CUDA_STREAM(ctx)));
    const struct sample_dev_row *d_rows = (const struct sample_dev_row *)st->d_in;
    const int2 *d_pairs = (const int2 *)((const char *)st->d_in + rows_bytes);
    const unsigned long long *d_masks = (const unsigned long long *)((const char *)st->d_in + mask_at);
    /* A launch takes rows until a penalised row would reuse a slot. */
    int32_t row0 = 0, in_launch = 0;
    for (int32_t r = 0; r < n_rows; r++) {
        if (hr[r].slot < 0) continue;
        if (in_launch == SAMPLE_SLOTS) {
            int rc = sample_launch(ctx, st, logits, n_vocab, d_rows, d_pairs, d_masks, row0, r - row0);
            if (rc != STATUS_OK) return rc;
            row0 = r;
            in_launch = 0;
        }
        in_launch++;
    }
    int rc = sample_launch(ctx, st, logits, n_vocab, d_rows, d_pairs, d_masks, row0, n_rows - row0);
    if (rc != STATUS_OK) return rc;
    CUDA_CHECK(ctx, cudaMemcpyAsync(st->h_out, st->d_out, (size_t)n_rows * sizeof(struct sample_dev_out),
                                    cudaMemcpyDeviceToHost, CUDA_STREAM(ctx)));
    CUDA_CHECK(ctx, cudaStreamSynchronize(CUDA_STREAM(ctx)));

    for (int32_t r = 0; r < n_rows; r++) {
        struct backend_sample_row *sr = &rows[r];
        const struct sample_dev_out *o = &st->h_out[r];
        const struct sample_dev_row *d = &hr[r];
        if (o->bad >= 0) {
            sample_row_fail(sr, STATUS_INTERNAL, "logit of token %d is %g", o->bad, (double)o->bad_value);
        } else if (d->flags & SAMPLE_F_CHECK_ONLY) {
            char msg[sizeof sr->err];
            memcpy(msg, sr->err, sizeof msg);
            sample_row_fail(sr, STATUS_BAD_INPUT, "%s", msg);
        } else if (o->all_ninf) {
            sample_row_fail(sr, STATUS_INTERNAL, "every one of the %d logits is -inf", n_vocab);
        } else {
            struct sampling_result *res = &sr->result;
            memset(res, 0, sizeof *res);
            res->token = o->token;
            res->is_stop = sampling_is_stop(sr->params, o->token);
            if (d->flags & SAMPLE_F_LOGPROBS) {
                res->logprob = o->logprob;
                res->n_top = d->n_top;
                for (int32_t k = 0; k < d->n_top; k++) {
                    res->top_token[k] = o->top_token[k];
                    res->top_logprob[k] = o->top_logprob[k];
                }
            }
        }
    }
    return STATUS_OK;
}

extern "C" int cuda_sample(struct cuda_ctx *ctx, const float *logits, int32_t n_vocab, struct backend_sample_row *rows,
                           int32_t n_rows) {
    if (n_vocab < 1 || n_rows < 0)
        return cuda_fail(ctx, STATUS_BAD_INPUT, "sample: %d rows of %d logits", n_rows, n_vocab);
    if (n_rows == 0) return STATUS_OK;
    if (n_vocab > SAMPLE_VOCAB_MAX || ctx->device < 0 || ctx->device >= SAMPLE_DEVICES_MAX) return CUDA_NOT_FUSED;
    struct sample_state *st = &sample_states[ctx->device];
    std::lock_guard<std::mutex> hold(st->lock);
    return sample_run(ctx, st, logits, n_vocab, rows, n_rows);
}
