/* Weight-reading matmul for decode and small batches (n <= 64 tokens):
 * every weight byte is read from memory once per call for all n tokens,
 * in its stored (quantized) form, and dequantized on the chip.  Decode is
 * memory-bound, so the measure here is the fraction of DRAM bandwidth
 * reached (docs/cuda-backend.md).  Two kernels:
 *   - mq (F16 and every quantized type, widths a multiple of 32): tensor
 *     cores (mma.sync m16n8k8, sm_75) on weights dequantized to F16 in
 *     registers straight from a shared-memory copy of the raw bytes;
 *   - the warp-per-row kernel for what mq does not take (F32 weights, odd
 *     widths), up to 16 tokens. */
#include "knobs.h"
#include "matmul_group.cuh"
#include "mq_frag.cuh"
#include "quant_units.cuh"

/* ---- mq: the tensor-core kernel ----
 * A block is MQ_WARPS warps; warp w owns 16 consecutive weight rows (the M
 * side of the mma) and all NT tokens (the N side, NT / 8 tiles).  The K
 * side is walked in chunks of mq_fmt<T>::ck columns: the warp copies the
 * raw bytes of its 16 rows' chunk into shared memory with 16-byte loads
 * (blocks of 18, 34 or 210 bytes are not 16-byte aligned, so the copy keeps
 * each row's address modulo 16 and the decoders read it from there), the
 * block stages the chunk's activations as F16, and each lane dequantizes
 * its mma fragments (mq_frag.cuh); the matching activations are one
 * 16-byte shared load.
 * When the row blocks cannot fill the GPU the K side is split over
 * gridDim.y blocks; each writes F32 partial sums, and the last block of a
 * row block to finish (a counter per row block, reset by that block) adds
 * them in a fixed order. */

#define MQ_WARPS 8
#define MQ_ROWS (MQ_WARPS * 16)
#define MQ_COUNTERS 16384
#define MQ_NT_MAX 64

/* Arrival counters of the split-K blocks, one per row block; zero between
 * calls (the last block resets its own).  One stream per device uses them
 * (the backend's contract: one worker per GPU, ops from one thread). */
__device__ unsigned int mq_counters[MQ_COUNTERS];

/* The activations of a chunk are staged in XP parts of xc columns each
 * (row stride xs halves, 64 mod 128 bytes as mq_geom's: conflict-free),
 * xi 16-byte loads a thread for NT tokens.  XP = 2 holds 64 tokens within
 * sm_75's 64 KB of shared memory a block: the whole chunk's 64 rows of
 * activations are 36 KB, which with the weights' 22-35 KB (and the
 * K-quants' 4.5 KB scale table) passes 64 KB for every type but Q4_0 and
 * Q4_1, while half of them is 20 KB. */
template <int T, int NT, int XP> struct mq_xpart {
    static constexpr int xc = mq_geom<T>::ck / XP;
    static constexpr int xs = xc + 32;
    static constexpr int xi = NT * xc / 8 / (MQ_WARPS * 32);
};

template <int T, int NT, int XP> static constexpr size_t mq_smem_bytes() {
    return (size_t)MQ_WARPS * 16 * mq_geom<T>::ws + (size_t)NT * mq_xpart<T, NT, XP>::xs * 2;
}

/* buf = this lane's 16-byte loads of the raw bytes of chunk ch of the
 * warp's 16 rows (zeros past the chunk, the rows and the weight's end). */
template <int T>
__device__ __forceinline__ void mq_load_w(uint4 (&buf)[mq_geom<T>::iters], const uint8_t *w, const uint8_t *w_end,
                                          size_t row_bytes, int row0, int rows, int cols, int ch, int lane) {
    using G = mq_geom<T>;
    const int col0 = ch * G::ck, nb = min(G::ck / 32, (cols - col0) / 32);
    if constexpr (mq_fmt<T>::soa != 0) {
#pragma unroll
        for (int i = 0; i < G::iters; i++) {
            int item = lane + 32 * i, r = item / G::nld, c = item % G::nld;
            buf[i] = make_uint4(0, 0, 0, 0);
            if (item < 16 * G::nld && row0 + r < rows) {
                const uint8_t *src = mq_soa_src<T>(w + (size_t)(row0 + r) * row_bytes, cols, ch, c, nb);
                if (src) buf[i] = __ldg((const uint4 *)src);
            }
        }
        return;
    }
    const size_t choff = (size_t)(col0 / mq_fmt<T>::eb) * mq_fmt<T>::bb;
    const int cbytes = nb * 32 / mq_fmt<T>::eb * mq_fmt<T>::bb;
#pragma unroll
    for (int i = 0; i < G::iters; i++) {
        int item = lane + 32 * i, r = item / G::nld, c = item % G::nld;
        buf[i] = make_uint4(0, 0, 0, 0);
        if (item < 16 * G::nld && row0 + r < rows) {
            const uint8_t *gp = w + (size_t)(row0 + r) * row_bytes + choff;
            const uint8_t *src = (const uint8_t *)((uintptr_t)gp & ~(uintptr_t)15) + 16 * c;
            if (src + 16 <= w_end) {
                if (src < gp + cbytes) buf[i] = __ldg((const uint4 *)src);
            } else if (src < gp + cbytes) {
                /* The weight's last bytes when its size is not a multiple
                 * of 16: never read past its end. */
                uint32_t h[4];
#pragma unroll
                for (int e = 0; e < 4; e++) {
                    uint32_t lo = src + 4 * e < w_end ? __ldg((const uint16_t *)src + 2 * e) : 0;
                    uint32_t hi = src + 4 * e + 2 < w_end ? __ldg((const uint16_t *)src + 2 * e + 1) : 0;
                    h[e] = lo | hi << 16;
                }
                buf[i] = make_uint4(h[0], h[1], h[2], h[3]);
            }
        }
    }
}

/* xv = this thread's share of the activations of chunk ch (zeros past n
 * and past cols). */
template <int T, int NT>
__device__ __forceinline__ void mq_load_x(float4 (&xv)[NT * mq_geom<T>::ck / 4 / (MQ_WARPS * 32)], const float *x,
                                          int cols, int n, int ch) {
    constexpr int CK = mq_geom<T>::ck, XI = NT * CK / 4 / (MQ_WARPS * 32);
    const int col0 = ch * CK;
#pragma unroll
    for (int i = 0; i < XI; i++) {
        int item = threadIdx.x + MQ_WARPS * 32 * i, tok = item / (CK / 4), c = (item % (CK / 4)) * 4;
        xv[i] = make_float4(0.0f, 0.0f, 0.0f, 0.0f);
        if (tok < n && col0 + c < cols) xv[i] = __ldg((const float4 *)(x + (size_t)tok * cols + col0 + c));
    }
}

template <int T, int NT>
__device__ __forceinline__ void mq_store_x(__half *xs, const float4 (&xv)[NT * mq_geom<T>::ck / 4 / (MQ_WARPS * 32)]) {
    constexpr int CK = mq_geom<T>::ck, XI = NT * CK / 4 / (MQ_WARPS * 32);
#pragma unroll
    for (int i = 0; i < XI; i++) {
        int item = threadIdx.x + MQ_WARPS * 32 * i, tok = item / (CK / 4), c = (item % (CK / 4)) * 4;
        uint2 hv = make_uint2(mq_u32(__floats2half2_rn(xv[i].x, xv[i].y)), mq_u32(__floats2half2_rn(xv[i].z, xv[i].w)));
        *(uint2 *)(xs + tok * mq_geom<T>::xs + c) = hv;
    }
}

/* From 32 tokens the activations come from their F16 form x16 (which the
 * norms and swiglu leave for the next matmul), 16 bytes at a time: half
 * the bytes of the F32 rows and no conversion in every block.
 * mq_load_xh: this thread's share of part p of chunk ch (zeros past n and
 * past cols); mq_store_xh puts it in shared memory. */
template <int T, int NT, int XP>
__device__ __forceinline__ void mq_load_xh(uint4 (&v)[mq_xpart<T, NT, XP>::xi], const __half *x16, int cols, int n,
                                           int ch, int p) {
    using X = mq_xpart<T, NT, XP>;
    const int col0 = ch * mq_geom<T>::ck + p * X::xc;
#pragma unroll
    for (int i = 0; i < X::xi; i++) {
        int item = threadIdx.x + MQ_WARPS * 32 * i, tok = item / (X::xc / 8), c = (item % (X::xc / 8)) * 8;
        v[i] = make_uint4(0, 0, 0, 0);
        if (tok < n && col0 + c < cols) v[i] = __ldg((const uint4 *)(x16 + (size_t)tok * cols + col0 + c));
    }
}

template <int T, int NT, int XP>
__device__ __forceinline__ void mq_store_xh(__half *xs, const uint4 (&v)[mq_xpart<T, NT, XP>::xi]) {
    using X = mq_xpart<T, NT, XP>;
#pragma unroll
    for (int i = 0; i < X::xi; i++) {
        int item = threadIdx.x + MQ_WARPS * 32 * i, tok = item / (X::xc / 8), c = (item % (X::xc / 8)) * 8;
        *(uint4 *)(xs + tok * X::xs + c) = v[i];
    }
}

/* out[n, rows] = x[n, cols] . w^T for n <= NT.  When the K side is split
 * (gridDim.y > 1) each block writes F32 partial sums to part (gridDim.y,
 * n, rp), rp = gridDim.x * MQ_ROWS; up to 16 tokens the last block of each
 * row block adds them (LAST), above a second kernel does (the sums are
 * n x 128 x splits floats per row block: one block would be the tail).
 * Up to 16 tokens the next chunk's weights and activations are loaded
 * while this one is multiplied (registers allow it; wider tiles rely on
 * the other resident block instead), and x is read as F32; above, x16 (x
 * as F16) is read instead.
 *
 * XP = 2 (sm_75, 33-64 tokens) stages the activations in two halves of
 * the chunk's columns (mq_xpart): the fragments of a 32-column block are
 * decoded once and used at once for every token, so no fragment waits in
 * a register across the barriers between the halves, and each weight is
 * still read and decoded once.  A T4 holds one such block a
 * multiprocessor (42-55 KB of its 64 KB), with no other block to cover
 * the wait for the next chunk, so the next half's activations and the
 * next chunk's weights (with its first half of activations) are loaded
 * while this half is multiplied; the registers that takes (150-200 a
 * thread) are free there, hence launch bounds of one block. */
template <int T, int NT, int XP>
__global__ void __launch_bounds__(MQ_WARPS * 32, XP > 1 ? 1 : 2)
matmul_mq_kernel(float *__restrict__ out, float *__restrict__ part, const uint8_t *__restrict__ w, size_t row_bytes,
                 int rows, int cols, const float *__restrict__ x, const __half *__restrict__ x16, int n) {
    pdl_begin();
    using G = mq_geom<T>;
    using X = mq_xpart<T, NT, XP>;
    constexpr int CK = G::ck, NB = CK / 32, NBP = NB / XP, NTL = NT / 8, XI = NT * CK / 4 / (MQ_WARPS * 32);
    constexpr bool PIPE = NT <= 16, LAST = NT <= 16, HALVES = XP > 1;
    static_assert(XP == 1 || (XP == 2 && NT > 16 && NB % XP == 0), "halves: F16 activations, whole blocks");
    extern __shared__ uint4 mq_smem[];
    __shared__ uint32_t mq_sc[mq_scales<T>::on ? MQ_WARPS * 16 * 9 : 1];
    const int warp = threadIdx.x / 32, lane = threadIdx.x % 32, g = lane >> 2, t = lane & 3;
    uint8_t *wsm = (uint8_t *)mq_smem + warp * 16 * G::ws;
    __half *xs = (__half *)((uint8_t *)mq_smem + MQ_WARPS * 16 * G::ws);
    const int row0 = blockIdx.x * MQ_ROWS + warp * 16;
    const uint8_t *w_end = w + (size_t)rows * row_bytes;
    const int n_chunks = (cols + CK - 1) / CK;
    const int c_begin = (int)((int64_t)n_chunks * blockIdx.y / gridDim.y);
    const int c_end = (int)((int64_t)n_chunks * (blockIdx.y + 1) / gridDim.y);

    float acc[NTL][4];
#pragma unroll
    for (int i = 0; i < NTL; i++) acc[i][0] = acc[i][1] = acc[i][2] = acc[i][3] = 0.0f;

    uint4 buf[G::iters];
    float4 xv[XI];
    uint4 xh[HALVES ? X::xi : 1]; /* HALVES: the next half's activations */
    if (PIPE && c_begin < c_end) {
        mq_load_w<T>(buf, w, w_end, row_bytes, row0, rows, cols, c_begin, lane);
        mq_load_x<T, NT>(xv, x, cols, n, c_begin);
    }
    if constexpr (HALVES) {
        if (c_begin < c_end) {
            mq_load_w<T>(buf, w, w_end, row_bytes, row0, rows, cols, c_begin, lane);
            mq_load_xh<T, NT, XP>(xh, x16, cols, n, c_begin, 0);
        }
    }
    for (int ch = c_begin; ch < c_end; ch++) {
        const int col0 = ch * CK, nb = min(NB, (cols - col0) / 32);
        const size_t choff = (size_t)(col0 / mq_fmt<T>::eb) * mq_fmt<T>::bb;
        /* Issue every 16-byte load of this warp's 16 row chunks before
         * using any: the bytes in flight are what reaches bandwidth. */
        if (!PIPE && !HALVES) mq_load_w<T>(buf, w, w_end, row_bytes, row0, rows, cols, ch, lane);
        __syncthreads(); /* the previous chunk's fragments are all read */
#pragma unroll
        for (int i = 0; i < G::iters; i++) {
            int item = lane + 32 * i, r = item / G::nld, c = item % G::nld;
            if (item < 16 * G::nld) *(uint4 *)(wsm + r * G::ws + 16 * c) = buf[i];
        }
        if constexpr (PIPE) {
            mq_store_x<T, NT>(xs, xv);
        } else if constexpr (HALVES) {
            mq_store_xh<T, NT, XP>(xs, xh);
        } else {
            uint4 v[X::xi];
            mq_load_xh<T, NT, XP>(v, x16, cols, n, ch, 0);
            mq_store_xh<T, NT, XP>(xs, v);
        }
        __syncthreads();
        if (PIPE && ch + 1 < c_end) {
            mq_load_w<T>(buf, w, w_end, row_bytes, row0, rows, cols, ch + 1, lane);
            mq_load_x<T, NT>(xv, x, cols, n, ch + 1);
        }

        /* Where rows g and g + 8 start in shared memory (their global
         * address modulo 16; 0 in the regrouped layout). */
        const uintptr_t m16 = mq_fmt<T>::soa ? 0 : 15;
        const uint8_t *pg = wsm + g * G::ws + ((uintptr_t)(w + (size_t)(row0 + g) * row_bytes + choff) & m16);
        const uint8_t *pg8 =
            wsm + (g + 8) * G::ws + ((uintptr_t)(w + (size_t)(row0 + g + 8) * row_bytes + choff) & m16);
        /* K-quants: the scale pairs of the warp's 16 rows (mq_scale_pair),
         * half a row's blocks a lane, rows 9 words apart. */
        uint32_t *sct = mq_sc + warp * 16 * 9;
        if constexpr (mq_scales<T>::on) {
            const int r = lane & 15, h = lane >> 4;
            const uint8_t *pr = wsm + r * G::ws + ((uintptr_t)(w + (size_t)(row0 + r) * row_bytes + choff) & m16);
#pragma unroll
            for (int b = 0; b < 4; b++) sct[r * 9 + 4 * h + b] = mq_scale_pair<T>(pr, 4 * h + b, ch);
            __syncwarp();
        }
#pragma unroll
        for (int p = 0; p < XP; p++) {
            if constexpr (HALVES) {
                if (p == 0) {
                    mq_load_xh<T, NT, XP>(xh, x16, cols, n, ch, 1);
                } else {
                    __syncthreads(); /* every warp has read the first half */
                    mq_store_xh<T, NT, XP>(xs, xh);
                    __syncthreads();
                    if (ch + 1 < c_end) {
                        mq_load_w<T>(buf, w, w_end, row_bytes, row0, rows, cols, ch + 1, lane);
                        mq_load_xh<T, NT, XP>(xh, x16, cols, n, ch + 1, 0);
                    }
                }
            }
#pragma unroll
            for (int bp = 0; bp < NBP; bp++) {
                const int b = p * NBP + bp;
                if (b < nb) {
                    uint32_t alo[4], ahi[4];
                    mq_decode<T, true>(pg, b, t, ch, alo, sct[g * 9 + b]);
                    mq_decode<T, true>(pg8, b, t, ch, ahi, sct[(g + 8) * 9 + b]);
#pragma unroll
                    for (int nt = 0; nt < NTL; nt++)
                        if (nt * 8 < n)
                            mq_mma32(acc[nt], alo, ahi,
                                     *(const uint4 *)(xs + (nt * 8 + g) * X::xs + 32 * bp + 8 * t));
                }
            }
        }
    }

    /* acc[nt][0, 1]: row g, tokens 8nt + 2t, + 1; [2, 3]: row g + 8. */
    const size_t rp = (size_t)gridDim.x * MQ_ROWS;
    if (gridDim.y == 1) {
#pragma unroll
        for (int nt = 0; nt < NTL; nt++)
#pragma unroll
            for (int e = 0; e < 4; e++) {
                int tok = nt * 8 + 2 * t + (e & 1), row = row0 + g + 8 * (e >> 1);
                if (tok < n && row < rows) out[(size_t)tok * rows + row] = acc[nt][e];
            }
        return;
    }
    /* Partial sums for every row of the padded row block (rp rows). */
    float *dst = part + (size_t)blockIdx.y * n * rp;
#pragma unroll
    for (int nt = 0; nt < NTL; nt++)
#pragma unroll
        for (int e = 0; e < 4; e++) {
            int tok = nt * 8 + 2 * t + (e & 1), row = row0 + g + 8 * (e >> 1);
            if (tok < n) dst[(size_t)tok * rp + row] = acc[nt][e];
        }
    if (!LAST) return;

    __shared__ unsigned int last;
    __threadfence(); /* partials visible before the arrival is counted */
    __syncthreads();
    if (threadIdx.x == 0) {
        unsigned int prev = atomicAdd(&mq_counters[blockIdx.x], 1u);
        last = prev == gridDim.y - 1;
        if (last) mq_counters[blockIdx.x] = 0;
    }
    __syncthreads();
    if (!last) return;
    __threadfence();
    /* Thread (kg, item) adds splits kg, kg + KG, ... of float4 item (token,
     * 4 rows), every load independent of the others; then the KG sums of
     * an item are added in order (deterministic).  Shared memory is free:
     * every warp passed the barrier above. */
    const int items = n * (MQ_ROWS / 4), ks = (int)gridDim.y;
    const int kgs = items >= MQ_WARPS * 32 ? 1 : (MQ_WARPS * 32) / items;
    float4 *red = (float4 *)mq_smem;
    const int rb0 = blockIdx.x * MQ_ROWS;
    for (int i = threadIdx.x; i < items * kgs; i += MQ_WARPS * 32) {
        int item = i % items, kg = i / items, tok = item / (MQ_ROWS / 4), r = rb0 + (item % (MQ_ROWS / 4)) * 4;
        const float4 *src = (const float4 *)(part + (size_t)tok * rp + r);
        const size_t kstride = (size_t)n * rp / 4;
        float4 s = make_float4(0.0f, 0.0f, 0.0f, 0.0f);
        int k = kg;
        for (; k + 3 * kgs < ks; k += 4 * kgs) {
            float4 a = __ldcg(src + k * kstride), b = __ldcg(src + (k + kgs) * kstride);
            float4 c = __ldcg(src + (k + 2 * kgs) * kstride), d = __ldcg(src + (k + 3 * kgs) * kstride);
            s.x += (a.x + b.x) + (c.x + d.x);
            s.y += (a.y + b.y) + (c.y + d.y);
            s.z += (a.z + b.z) + (c.z + d.z);
            s.w += (a.w + b.w) + (c.w + d.w);
        }
        for (; k < ks; k += kgs) {
            float4 a = __ldcg(src + k * kstride);
            s.x += a.x;
            s.y += a.y;
            s.z += a.z;
            s.w += a.w;
        }
        red[i] = s;
    }
    __syncthreads();
    for (int item = threadIdx.x; item < items; item += MQ_WARPS * 32) {
        float4 s = red[item];
        for (int kg = 1; kg < kgs; kg++) {
            float4 a = red[kg * items + item];
            s.x += a.x;
            s.y += a.y;
            s.z += a.z;
            s.w += a.w;
        }
        int tok = item / (MQ_ROWS / 4), r = rb0 + (item % (MQ_ROWS / 4)) * 4;
        float v[4] = {s.x, s.y, s.z, s.w};
#pragma unroll
        for (int e = 0; e < 4; e++)
            if (r + e < rows) out[(size_t)tok * rows + r + e] = v[e];
    }
}

/* out[tok, row] = sum over the splits of part[k, tok, row] (row stride rp). */
__global__ void matmul_mq_reduce_kernel(float *__restrict__ out, const float *__restrict__ part, int ks, int n,
                                        int rows, int rp) {
    pdl_begin();
    int64_t i = blockIdx.x * (int64_t)blockDim.x + threadIdx.x;
    if (i >= (int64_t)n * rows) return;
    int tok = (int)(i / rows), row = (int)(i % rows);
    const float *src = part + (size_t)tok * rp + row;
    const size_t kstride = (size_t)n * rp;
    float s = 0.0f;
    int k = 0;
    for (; k + 4 <= ks; k += 4)
        s += (__ldg(src + k * kstride) + __ldg(src + (k + 1) * kstride)) +
             (__ldg(src + (k + 2) * kstride) + __ldg(src + (k + 3) * kstride));
    for (; k < ks; k++) s += __ldg(src + k * kstride);
    out[i] = s;
}

template <int T, int NT, int XP = 1>
static int mq_launch_nt(struct cuda_ctx *ctx, float *out, const void *w, int64_t rows, int64_t cols, const float *x,
                        int n) {
    constexpr size_t smem = mq_smem_bytes<T, NT, XP>();
    static_assert(XP == 1 || smem + (mq_scales<T>::on ? MQ_WARPS * 16 * 9 * 4 : 4) <= 64 * 1024,
                  "sm_75's halves within its 64 KB of shared memory a block");
    /* Blocks resident per SM, asked once per device (the shared memory
     * limit is raised first: up to 70 KB for 64 tokens of Q8_0 in one
     * part, 55 KB in halves). */
    static int per_sm[64];
    int dev = ctx->device >= 0 && ctx->device < 64 ? ctx->device : 0;
    CUDA_CHECK(ctx, cuda_blocks_per_sm(matmul_mq_kernel<T, NT, XP>, MQ_WARPS * 32, smem, &per_sm[dev]));
    int n_rb = (int)((rows + MQ_ROWS - 1) / MQ_ROWS);
    int n_chunks = (int)((cols + mq_fmt<T>::ck - 1) / mq_fmt<T>::ck);
    /* Split K until the blocks fill every resident slot once (one wave:
     * a second, partial wave would cost a whole block's latency), or into
     * full waves where a single one leaves many slots idle
     * (cuda_mq_split, knobs.c). */
    int slots = ctx->n_sms * per_sm[dev], ks = 1;
    if (n_rb < slots && n_rb <= MQ_COUNTERS) ks = slots / n_rb;
    if (ks > n_chunks) ks = n_chunks;
    if (ks > 65535) ks = 65535;
    if (ks < 1) ks = 1;
    if (n_rb <= MQ_COUNTERS) ks = cuda_mq_split(n_rb, n_chunks, slots, ks);
    size_t rp = (size_t)n_rb * MQ_ROWS;
    /* Scratch: from 32 tokens x's F16 form first (kept for the next
     * matmul on x: cuda_gemm_act), then the split-K partial sums. */
    const size_t x_bytes = NT > 16 ? ((size_t)n * cols * 2 + 255) & ~(size_t)255 : 0;
    const size_t part_bytes = ks > 1 ? (size_t)ks * n * rp * sizeof(float) : 0;
    float *part = NULL;
    if (x_bytes + part_bytes > 0) {
        uint8_t *scr = (uint8_t *)cuda_scratch(ctx, x_bytes + part_bytes);
        if (!scr) return STATUS_NO_MEMORY;
        if (ks > 1) part = (float *)(scr + x_bytes);
    }
    uint16_t *x16 = NULL;
    if (NT > 16) {
        int rc = cuda_gemm_act_f16(ctx, x, n, cols, &x16);
        if (rc != STATUS_OK) return rc;
    } else if (ks > 1) {
        cuda_act_forget(ctx); /* the partial sums overwrite the scratch's activations */
    }
    CUDA_CHECK(ctx, cuda_launch(ctx, (matmul_mq_kernel<T, NT, XP>), dim3((unsigned)n_rb, (unsigned)ks), dim3(MQ_WARPS * 32),
                                smem, out, part, (const uint8_t *)w, cuda_row_bytes((enum dtype)T, cols), (int)rows,
                                (int)cols, x, (const __half *)x16, n));
    CUDA_CHECK(ctx, cudaGetLastError());
    if (ks > 1 && NT > 16) {
        int64_t total = (int64_t)n * rows;
        CUDA_CHECK(ctx, cuda_launch(ctx, matmul_mq_reduce_kernel, dim3(cuda_blocks(total, 256)), dim3(256), 0, out,
                                    part, ks, n, (int)rows, (int)rp));
        CUDA_CHECK(ctx, cudaGetLastError());
    }
    return STATUS_OK;
}

template <int T>
static int mq_launch(struct cuda_ctx *ctx, float *out, const void *w, int64_t rows, int64_t cols, const float *x,
                     int n) {
    if (n <= 8) return mq_launch_nt<T, 8>(ctx, out, w, rows, cols, x, n);
    if (n <= 16) return mq_launch_nt<T, 16>(ctx, out, w, rows, cols, x, n);
    if (n <= 32) return mq_launch_nt<T, 32>(ctx, out, w, rows, cols, x, n);
    /* sm_75: the activations in two halves of each chunk (ctx->mq_x_parts,
     * knobs.c), within its 64 KB of shared memory a block. */
    if (ctx->mq_x_parts == 2) return mq_launch_nt<T, 64, 2>(ctx, out, w, rows, cols, x, n);
    return mq_launch_nt<T, 64>(ctx, out, w, rows, cols, x, n);
}

static int mq_supports(const struct cuda_ctx *ctx, enum dtype type, int64_t cols, int32_t n) {
    if (n < 1 || n > ctx->mq_nt_max || n > MQ_NT_MAX || cols > INT32_MAX) return 0;
    switch (type) {
    case DTYPE_F16: case DTYPE_Q8_0: case DTYPE_Q4_0: case DTYPE_Q4_1: case DTYPE_Q5_0: case DTYPE_Q5_1:
        return cols % 32 == 0;
    case DTYPE_Q4_K: case DTYPE_Q5_K: case DTYPE_Q6_K: return cols % 256 == 0;
    default: return 0;
    }
}

/* ---- The warp-per-row kernel ----
 * Each warp owns one weight row and reads it once with coalesced loads
 * (the unit layout of quant_units.cuh), dequantizes in registers and
 * accumulates the dot products of all n tokens in F32. */

#define MV_WARPS 4
#define MV_NT_MAX 16
#define MV_F16_MAX 2 /* F16 tokens this kernel takes even where mq could */


/* acc[t] += w[0..L) . x[t, off .. off + L) for the n (<= NT) tokens. */
template <int NT, int L>
__device__ __forceinline__ void mv_dot(float (&acc)[NT], const float *w, const float *x, int64_t cols, int64_t off,
                                       int n) {
#pragma unroll
    for (int t = 0; t < NT; t++) {
        if (t < n) {
            const float4 *xp = (const float4 *)(x + t * cols + off);
            float a = 0.0f;
#pragma unroll
            for (int k = 0; k < L / 4; k++) {
                float4 v = __ldg(xp + k);
                a += w[4 * k] * v.x + w[4 * k + 1] * v.y + w[4 * k + 2] * v.z + w[4 * k + 3] * v.w;
            }
            acc[t] += a;
        }
    }
}

/* One warp per row of each weight of the group g (matmul_group.cuh), or
 * with KS = 2 or 4 that many warps per row, each taking every KS-th
 * 32-unit stretch of it and adding up through shared memory (no swiglu
 * then): a grid that is a single wave (o and down at batch 1: 4096 rows)
 * then has KS times the warps and 1 / KS of the serial work per warp.  No
 * early return, since a swiglu block meets at a barrier. */
template <int T, int NT, int KS>
__global__ void __launch_bounds__(MV_WARPS * 32)
matmul_vec_kernel(const mm_group g, size_t row_bytes, int64_t cols, const float *x, int n) {
    constexpr int RUNS = qu_shape<T>::runs, RLEN = qu_shape<T>::rlen;
    const int lane = threadIdx.x % 32, warp = threadIdx.x / 32, part = warp % KS;
    float acc[NT];
#pragma unroll
    for (int t = 0; t < NT; t++) acc[t] = 0.0f;
    if (const mm_row r = mg_locate<MV_WARPS / KS>(g, warp / KS); r.row >= r.rows) {
        pdl_begin();
    } else {
        const uint8_t *wr = r.w + (size_t)r.row * row_bytes;
        const int64_t units = qu_units<T>(cols);
        /* At 1-4 tokens a lane loads MU units before using any: with one
         * load in flight per lane, 32 warps per SM keep ~2 MB in flight on
         * an H100, which caps a 4096-row grid at ~2.2 TB/s (ncu). */
        constexpr int MU = NT == 1 ? 4 : NT <= 4 ? 2 : 1;
        constexpr int ST = 32 * KS; /* units between a lane's consecutive ones */
        int64_t u = part * 32 + lane;
        /* The weights are no kernel's output: the first MU units are loaded
         * before the programmatic wait, x after it. */
        float wv[MU][RUNS * RLEN];
        const bool whole = u + ST * (MU - 1) < units;
        if (whole)
#pragma unroll
            for (int m = 0; m < MU; m++) qu_load<T>(wr, u + ST * m, wv[m], cols);
        pdl_begin();
        while (whole) {
#pragma unroll
            for (int m = 0; m < MU; m++)
#pragma unroll
                for (int k = 0; k < RUNS; k++)
                    mv_dot<NT, RLEN>(acc, wv[m] + k * RLEN, x, cols, qu_off<T>(u + ST * m, k), n);
            u += ST * MU;
            if (u + ST * (MU - 1) >= units) break;
#pragma unroll
            for (int m = 0; m < MU; m++) qu_load<T>(wr, u + ST * m, wv[m], cols);
        }
        for (; u < units; u += ST) {
            float wv[RUNS * RLEN];
            qu_load<T>(wr, u, wv, cols);
#pragma unroll
            for (int k = 0; k < RUNS; k++) mv_dot<NT, RLEN>(acc, wv + k * RLEN, x, cols, qu_off<T>(u, k), n);
        }
    }
#pragma unroll
    for (int t = 0; t < NT; t++) {
#pragma unroll
        for (int o = 16; o > 0; o >>= 1) acc[t] += __shfl_xor_sync(0xffffffffu, acc[t], o);
    }
    mg_store<MV_WARPS, NT, KS>(g, warp, lane, n, acc);
}

template <int T, int NT>
static int mv_launch_group(struct cuda_ctx *ctx, mm_group &g, int64_t cols, const float *x, int n) {
    const size_t rb = cuda_row_bytes((enum dtype)T, cols);
    /* Several warps per row (ctx->mv_split) when one warp per row would be
     * a single wave (every row resident at once: 9 blocks of 4 warps per
     * SM), as o and down are at batch 1: the load latency each warp waits
     * out serially is then cut by as many. */
    int64_t rows = 0;
    for (int s = 0; s < g.n; s++) rows += g.rows[s];
    const int ks = !g.swiglu && rows <= (int64_t)ctx->n_sms * 9 * MV_WARPS ? ctx->mv_split : 1;
    const unsigned grid = mg_layout(&g, MV_WARPS / ks);
    if (ks == 4)
        CUDA_CHECK(ctx, cuda_launch(ctx, (matmul_vec_kernel<T, NT, 4>), dim3(grid), dim3(MV_WARPS * 32), 0, g, rb, cols,
                                    x, n));
    else if (ks == 2)
        CUDA_CHECK(ctx, cuda_launch(ctx, (matmul_vec_kernel<T, NT, 2>), dim3(grid), dim3(MV_WARPS * 32), 0, g, rb, cols,
                                    x, n));
    else
        CUDA_CHECK(ctx, cuda_launch(ctx, (matmul_vec_kernel<T, NT, 1>), dim3(grid), dim3(MV_WARPS * 32), 0, g, rb, cols,
                                    x, n));
    CUDA_CHECK(ctx, cudaGetLastError());
    return STATUS_OK;
}

template <int T, int NT>
static int mv_launch_nt(struct cuda_ctx *ctx, float *out, const void *w, int64_t rows, int64_t cols, const float *x,
                        int n) {
    mm_group g = {};
    g.w[0] = (const uint8_t *)w;
    g.out[0] = out;
    g.rows[0] = (int)rows;
    g.n = 1;
    return mv_launch_group<T, NT>(ctx, g, cols, x, n);
}

template <int T>
static int mv_launch(struct cuda_ctx *ctx, float *out, const void *w, int64_t rows, int64_t cols, const float *x,
                     int n) {
    if (n == 1) return mv_launch_nt<T, 1>(ctx, out, w, rows, cols, x, n);
    if (n <= 4) return mv_launch_nt<T, 4>(ctx, out, w, rows, cols, x, n);
    if (n <= 8) return mv_launch_nt<T, 8>(ctx, out, w, rows, cols, x, n);
    return mv_launch_nt<T, 16>(ctx, out, w, rows, cols, x, n);
}

static int mv_supports(enum dtype type, int64_t cols, int32_t n) {
    if (n < 1 || n > MV_NT_MAX) return 0;
    switch (type) {
    case DTYPE_F32: return cols % 4 == 0;
    case DTYPE_F16: return cols % 8 == 0;
    case DTYPE_Q8_0: case DTYPE_Q4_0: case DTYPE_Q4_1: case DTYPE_Q5_0: case DTYPE_Q5_1:
        return cols % 32 == 0;
    case DTYPE_Q4_K: case DTYPE_Q5_K: case DTYPE_Q6_K: return cols % 256 == 0;
    default: return 0;
    }
}

extern "C" int cuda_matmul_vec_supports(const struct cuda_ctx *ctx, enum dtype type, int64_t cols, int32_t n) {
    return mq_supports(ctx, type, cols, n) || mv_supports(type, cols, n);
}

extern "C" int cuda_matmul_vec(struct cuda_ctx *ctx, float *out, const void *w, enum dtype type, int64_t rows,
                               int64_t cols, const float *x, int32_t n) {
    if (rows <= 0 || rows > INT32_MAX || !cuda_matmul_vec_supports(ctx, type, cols, n))
        return cuda_fail(ctx, STATUS_BAD_INPUT, "matmul_vec: %d tokens x %s [%lld x %lld] is not a skinny shape", n,
                         dtype_name(type), (long long)rows, (long long)cols);
    if ((uintptr_t)x % 16 != 0 || (uintptr_t)w % 16 != 0)
        return cuda_fail(ctx, STATUS_BAD_INPUT, "matmul_vec: x %p or weight %p is not 16-byte aligned", (const void *)x,
                         w);
    /* F16 at 1-2 tokens: the warp-per-row kernel streams the row with no
     * shared-memory staging and measured faster on an H100 (15.6 against
     * 19.0 us on 4096x4096, docs/cuda-backend.md). */
    int f16_rows = type == DTYPE_F16 && n <= MV_F16_MAX && mv_supports(type, cols, n);
    if (mq_supports(ctx, type, cols, n) && !f16_rows) {
        switch (type) {
        case DTYPE_F16: return mq_launch<DTYPE_F16>(ctx, out, w, rows, cols, x, n);
        case DTYPE_Q8_0: return mq_launch<DTYPE_Q8_0>(ctx, out, w, rows, cols, x, n);
        case DTYPE_Q4_0: return mq_launch<DTYPE_Q4_0>(ctx, out, w, rows, cols, x, n);
        case DTYPE_Q4_1: return mq_launch<DTYPE_Q4_1>(ctx, out, w, rows, cols, x, n);
        case DTYPE_Q5_0: return mq_launch<DTYPE_Q5_0>(ctx, out, w, rows, cols, x, n);
        case DTYPE_Q5_1: return mq_launch<DTYPE_Q5_1>(ctx, out, w, rows, cols, x, n);
        case DTYPE_Q4_K: return mq_launch<DTYPE_Q4_K>(ctx, out, w, rows, cols, x, n);
        case DTYPE_Q5_K: return mq_launch<DTYPE_Q5_K>(ctx, out, w, rows, cols, x, n);
        case DTYPE_Q6_K: return mq_launch<DTYPE_Q6_K>(ctx, out, w, rows, cols, x, n);
        default: break;
        }
    }
    switch (type) {
    case DTYPE_F32: return mv_launch<DTYPE_F32>(ctx, out, w, rows, cols, x, n);
    case DTYPE_F16: return mv_launch<DTYPE_F16>(ctx, out, w, rows, cols, x, n);
    case DTYPE_Q8_0: return mv_launch<DTYPE_Q8_0>(ctx, out, w, rows, cols, x, n);
    case DTYPE_Q4_0: return mv_launch<DTYPE_Q4_0>(ctx, out, w, rows, cols, x, n);
    case DTYPE_Q4_1: return mv_launch<DTYPE_Q4_1>(ctx, out, w, rows, cols, x, n);
    case DTYPE_Q5_0: return mv_launch<DTYPE_Q5_0>(ctx, out, w, rows, cols, x, n);
    case DTYPE_Q5_1: return mv_launch<DTYPE_Q5_1>(ctx, out, w, rows, cols, x, n);
    case DTYPE_Q4_K: return mv_launch<DTYPE_Q4_K>(ctx, out, w, rows, cols, x, n);
    case DTYPE_Q5_K: return mv_launch<DTYPE_Q5_K>(ctx, out, w, rows, cols, x, n);
    case DTYPE_Q6_K: return mv_launch<DTYPE_Q6_K>(ctx, out, w, rows, cols, x, n);
    default: break;
    }
    return cuda_fail(ctx, STATUS_UNSUPPORTED, "matmul_vec: weight type %s", dtype_name(type));
}

/* F16 and F32 weights at 1-2 tokens, where cuda_matmul_vec takes the
 * warp-per-row kernel: the group's weights in one launch.  CUDA_NOT_FUSED
 * for anything else. */
extern "C" int cuda_matmul_vec_group(struct cuda_ctx *ctx, struct mm_group *g, enum dtype type, int64_t cols,
                                     const float *x, int32_t n) {
    if ((type != DTYPE_F16 && type != DTYPE_F32) || n > MV_F16_MAX || !mv_supports(type, cols, n) ||
        (uintptr_t)x % 16 != 0)
        return CUDA_NOT_FUSED;
    for (int s = 0; s < g->n; s++)
        if ((uintptr_t)g->w[s] % 16 != 0) return CUDA_NOT_FUSED;
    if (type == DTYPE_F16)
        return n == 1 ? mv_launch_group<DTYPE_F16, 1>(ctx, *g, cols, x, n) : mv_launch_group<DTYPE_F16, 4>(ctx, *g, cols, x, n);
    return n == 1 ? mv_launch_group<DTYPE_F32, 1>(ctx, *g, cols, x, n) : mv_launch_group<DTYPE_F32, 4>(ctx, *g, cols, x, n);
}
