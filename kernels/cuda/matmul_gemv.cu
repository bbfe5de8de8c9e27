/* Batch-1..4 decode matmul on quantized weights (Q8_0, Q4_0, Q4_K, Q5_K,
 * Q6_K): one warp per output row streams the row's bytes straight into
 * registers, several independent loads per lane in flight, no shared
 * memory and no block barrier; the activations are quantized once per call
 * to int8 per 32 (a tiny pre-kernel) so that 4 weights cost one dp4a.
 * Decode is memory-bound: the aim is the DRAM rate (docs/cuda-backend.md). */
#include "common.cuh"
#include "act_q8.cuh"
#include "matmul_group.cuh"

/* 4 warps (rows) per block: small blocks fill every SM evenly; launch
 * bounds keep registers at 64 so that 8 blocks (32 warps) fit per SM. */
#define GV_WARPS 4
/* Chunks (32 weights of one row) a lane loads before using any: 2 on
 * every type.  With 32 warps an SM, more loads in flight do not reach the
 * DRAM rate sooner: 4 chunks make a 7B batch-1 step 3-5% slower on Q8_0
 * and Q4_K_M (H100 and H200), and 1 chunk is no faster on Q8_0 and 11%
 * slower on Q4_K_M. */
#define GV_UNROLL 2
#define GV_NT_MAX 4

/* ---- Activations: x[n, cols] F32 -> xq int8 [n, cols], xd[n, cols / 32]
 * (scale of each block of 32: x ~ xd * xq).  One warp per block.  Where
 * cols is a multiple of 64, also xs, for the K-quants with a min (Q4_K,
 * Q5_K): one float4 per 64-element group g and half h (16 elements of each
 * of its two blocks), {xd[2g], xd[2g + 1], xd[2g] * sum of xq over block
 * 2g's half h, the same for 2g + 1}, so that a chunk's min term is a
 * product and its scales one load. ---- */
__global__ void gemv_quant_x_kernel(int8_t *__restrict__ xq, float *__restrict__ xd, float *__restrict__ xs,
                                    const float *__restrict__ x, int64_t nblk) {
    pdl_begin();
    int64_t b = ((int64_t)blockIdx.x * blockDim.x + threadIdx.x) / 32;
    int lane = threadIdx.x & 31;
    if (b >= nblk) return;
    const float v[1] = {__ldg(x + b * 32 + lane)};
    act_q8_lanes<1>(v, b * 32 + lane, 0xffffffffu, xq, xd, xs);
}

/* ---- An unaligned (2-byte aligned) 16-byte load as aligned 4-byte
 * words: Q4_0's blocks of 18 bytes start at even addresses only (Q8_0 and
 * Q6_K are regrouped at load instead).  The last word is a 2-byte load so
 * that nothing past the range's last 4-byte word is read. ---- */
__device__ __forceinline__ uint4 gv_ld16u(const uint8_t *p) {
    const uint32_t *q = (const uint32_t *)((uintptr_t)p & ~(uintptr_t)3);
    const unsigned sh = ((unsigned)(uintptr_t)p & 2u) * 8u;
    uint32_t w0 = __ldg(q), w1 = __ldg(q + 1), w2 = __ldg(q + 2), w3 = __ldg(q + 3);
    uint32_t w4 = sh ? (uint32_t)__ldg((const uint16_t *)(p + 14)) : 0u;
    return make_uint4(__funnelshift_r(w0, w1, sh), __funnelshift_r(w1, w2, sh), __funnelshift_r(w2, w3, sh),
                      __funnelshift_r(w3, w4, sh));
}
__device__ __forceinline__ float gv_half(uint32_t bits) { return __half2float(__ushort_as_half((unsigned short)bits)); }
__device__ __forceinline__ int gv_dot4(uint4 a, uint4 b, int c) {
    c = __dp4a((int)a.x, (int)b.x, c);
    c = __dp4a((int)a.y, (int)b.y, c);
    c = __dp4a((int)a.z, (int)b.z, c);
    return __dp4a((int)a.w, (int)b.w, c);
}
__device__ __forceinline__ int gv_sum4(uint4 b) { return gv_dot4(make_uint4(0x01010101u, 0x01010101u, 0x01010101u, 0x01010101u), b, 0); }
__device__ __forceinline__ uint4 gv_and(uint4 a, uint32_t m) { return make_uint4(a.x & m, a.y & m, a.z & m, a.w & m); }
__device__ __forceinline__ uint4 gv_shr(uint4 a, int s) { return make_uint4(a.x >> s, a.y >> s, a.z >> s, a.w >> s); }
__device__ __forceinline__ uint4 gv_or(uint4 a, uint4 b) { return make_uint4(a.x | b.x, a.y | b.y, a.z | b.z, a.w | b.w); }
/* Bit s of every byte of v moved to bit 4 of that byte. */
__device__ __forceinline__ uint4 gv_bit5(uint4 v, int s) {
    return make_uint4(((v.x >> s) & 0x01010101u) << 4, ((v.y >> s) & 0x01010101u) << 4,
                      ((v.z >> s) & 0x01010101u) << 4, ((v.w >> s) & 0x01010101u) << 4);
}
__device__ __forceinline__ uint32_t gv_byte(uint32_t v, int i) { return (v >> (8 * i)) & 0xffu; }
/* c + the dot of a's unsigned bytes with b's signed ones. */
__device__ __forceinline__ int gv_dp4a_us(uint32_t a, uint32_t b, int c) {
    int d;
    asm("dp4a.u32.s32 %0, %1, %2, %3;" : "=r"(d) : "r"(a), "r"(b), "r"(c));
    return d;
}
/* Integer sums as floats without a conversion instruction (conversions
 * issue at a quarter of the rate of arithmetic): a dot started at
 * GV_MAGIC_I is the bit pattern of GV_MAGIC_F + the dot while |dot| <
 * 2^22, so one exact subtraction gives it; a byte b placed under 0x4B00
 * (gv_byte_f) is 2^23 + b. */
#define GV_MAGIC_I 0x4B400000
#define GV_MAGIC_F 12582912.0f
__device__ __forceinline__ float gv_dot_f(int r) { return __int_as_float(r) - GV_MAGIC_F; }
__device__ __forceinline__ float gv_byte_f(uint32_t v, int i) {
    return __int_as_float((int)__byte_perm(v, 0x4B00u, 0x5440u | (uint32_t)i));
}

/* ---- Per type: a row is cut into chunks of CW weights; lane l of a warp
 * takes chunks l, l + 32, ... so that a warp's loads cover consecutive
 * bytes.  gv_load issues a chunk's loads, gv_dot uses them. ---- */
template <int T> struct gv_chunk;

/* Q8_0 (the backend's regrouped rows, common.cuh): a chunk is one block,
 * its 32 codes two aligned 16-byte loads and its d one 2-byte load (a
 * warp's 32 scales are 64 consecutive bytes). */
template <> struct gv_chunk<DTYPE_Q8_0> {
    static constexpr int cw = 32;
    uint4 q0, q1;
    uint32_t d;
    __device__ __forceinline__ void load(const uint8_t *wr, int c, int j, int cols) {
        q0 = __ldg((const uint4 *)wr + 2 * c);
        q1 = __ldg((const uint4 *)wr + 2 * c + 1);
        d = __ldg((const uint16_t *)(wr + q8s_d_off(cols)) + c);
    }
    template <int NT>
    __device__ __forceinline__ void dot(int c, int j, const int8_t *xq, const float *xd, const float4 *, int cols, int n,
                                        float (&acc)[NT]) const {
        float dw = gv_half(d);
#pragma unroll
        for (int t = 0; t < NT; t++) {
            if (t < n) {
                const uint4 *xp = (const uint4 *)(xq + (size_t)t * cols + 32 * c);
                uint4 x0 = __ldg(xp), x1 = __ldg(xp + 1);
                float dx = __ldg(xd + (size_t)t * (cols / 32) + c);
                acc[t] += dw * dx * gv_dot_f(gv_dot4(q0, x0, gv_dot4(q1, x1, GV_MAGIC_I)));
            }
        }
    }
};

/* Q4_0: a chunk is one block (16 code bytes at byte 2: low nibbles are
 * elements 0..15, high 16..31). */
template <> struct gv_chunk<DTYPE_Q4_0> {
    static constexpr int cw = 32;
    uint4 q;
    uint32_t d;
    __device__ __forceinline__ void load(const uint8_t *wr, int c, int j, int cols) {
        const uint8_t *blk = wr + (size_t)c * 18;
        d = __ldg((const uint16_t *)blk);
        q = gv_ld16u(blk + 2);
    }
    template <int NT>
    __device__ __forceinline__ void dot(int c, int j, const int8_t *xq, const float *xd, const float4 *, int cols, int n,
                                        float (&acc)[NT]) const {
        float dw = gv_half(d);
        uint4 lo = gv_and(q, 0x0F0F0F0Fu), hi = gv_and(gv_shr(q, 4), 0x0F0F0F0Fu);
#pragma unroll
        for (int t = 0; t < NT; t++) {
            if (t < n) {
                const uint4 *xp = (const uint4 *)(xq + (size_t)t * cols + 32 * c);
                uint4 x0 = __ldg(xp), x1 = __ldg(xp + 1);
                float dx = __ldg(xd + (size_t)t * (cols / 32) + c);
                int s = gv_dot4(lo, x0, gv_dot4(hi, x1, 0)) - 8 * (gv_sum4(x0) + gv_sum4(x1));
                acc[t] += dw * dx * (float)s;
            }
        }
    }
};

/* Q4_K / Q5_K: a chunk is 16 code bytes of a super-block (j = c % 8: pair
 * p = j / 2, bytes 32 p + 16 (j & 1)): low nibbles are 16 elements of
 * sub-block 2p, high nibbles of 2p + 1.  The super-block's 16-byte header
 * (d, dmin, 12 scale bytes) is one more 16-byte load, shared by 8 lanes.
 * j is the same in every chunk of a lane (c = lane + 32 k), so the byte
 * selectors of its scales are fixed; the min term comes from xs. */
template <int T> struct gv_chunk_k45 {
    static constexpr int cw = 32, bb = T == DTYPE_Q4_K ? 144 : 176, qo = T == DTYPE_Q4_K ? 16 : 48;
    uint4 h, q, qh;
    __device__ __forceinline__ void load(const uint8_t *wr, int c, int j, int cols) {
        const uint8_t *blk = wr + (size_t)(c >> 3) * bb;
        h = __ldg((const uint4 *)blk);
        q = __ldg((const uint4 *)(blk + qo + 32 * (j >> 1) + 16 * (j & 1)));
        if constexpr (T == DTYPE_Q5_K) qh = __ldg((const uint4 *)(blk + 16 + 16 * (j & 1)));
    }
    /* Bytes sc(2p), sc(2p + 1), mn(2p), mn(2p + 1) of the header (the
     * 6-bit packing of kq_scale_min: sub-blocks 0-3 in the low 6 bits of
     * h.y / h.z, 4-7 split between h.w's nibbles and those bytes' top 2
     * bits), without a branch on p. */
    __device__ __forceinline__ uint32_t scales(int p) const {
        const uint32_t k = 2 * (p & 1), sel = k | (k + 1) << 4 | (k + 4) << 8 | (k + 5) << 12;
        const uint32_t yz = __byte_perm(h.y, h.z, sel);
        const uint32_t hi = (__byte_perm(h.w, h.w >> 4, sel) & 0x0F0F0F0Fu) | ((yz >> 2) & 0x30303030u);
        return p >= 2 ? hi : yz & 0x3F3F3F3Fu;
    }
    template <int NT>
    __device__ __forceinline__ void dot(int c, int j, const int8_t *xq, const float *xd, const float4 *xs, int cols, int n,
                                        float (&acc)[NT]) const {
        const int p = j >> 1;
        const float d = gv_half(h.x), dmin = gv_half(h.x >> 16);
        const uint32_t sm = scales(p);
        /* d sc and -dmin mn as one rounding each (2^23 + b times d, less
         * 2^23 d, is d b exactly before rounding).  Q4_K's high nibbles
         * stay in place (16 times the code): 1/16 of the scale, exactly. */
        const float hs = T == DTYPE_Q4_K ? 0.0625f : 1.0f;
        const float ds1 = fmaf(d, gv_byte_f(sm, 0), -8388608.0f * d);
        const float ds2 = fmaf(d * hs, gv_byte_f(sm, 1), -8388608.0f * hs * d);
        const float dm1 = fmaf(-dmin, gv_byte_f(sm, 2), 8388608.0f * dmin);
        const float dm2 = fmaf(-dmin, gv_byte_f(sm, 3), 8388608.0f * dmin);
        uint4 lo = gv_and(q, 0x0F0F0F0Fu), hi;
        if constexpr (T == DTYPE_Q5_K) {
            /* 5th code bit of each byte: bit 2p (low) / 2p + 1 (high) of qh. */
            hi = gv_or(gv_and(gv_shr(q, 4), 0x0F0F0F0Fu), gv_bit5(qh, 2 * p + 1));
            lo = gv_or(lo, gv_bit5(qh, 2 * p));
        } else {
            hi = gv_and(q, 0xF0F0F0F0u);
        }
        /* Elements 256 sb + 64 p + 16 (j & 1) + i (low) and + 32 (high). */
        const size_t e0 = (size_t)(c >> 3) * 256 + 64 * p + 16 * (j & 1);
        const size_t g0 = ((size_t)(c >> 3) * 4 + p) * 2 + (j & 1);
#pragma unroll
        for (int t = 0; t < NT; t++) {
            if (t < n) {
                const int8_t *xr = xq + (size_t)t * cols + e0;
                uint4 x0 = __ldg((const uint4 *)xr), x1 = __ldg((const uint4 *)(xr + 32));
                const float4 s = __ldg(xs + (size_t)t * (cols / 32) + g0);
                int r0 = GV_MAGIC_I, r1 = GV_MAGIC_I;
                r0 = gv_dp4a_us(lo.x, x0.x, r0);
                r0 = gv_dp4a_us(lo.y, x0.y, r0);
                r0 = gv_dp4a_us(lo.z, x0.z, r0);
                r0 = gv_dp4a_us(lo.w, x0.w, r0);
                r1 = gv_dp4a_us(hi.x, x1.x, r1);
                r1 = gv_dp4a_us(hi.y, x1.y, r1);
                r1 = gv_dp4a_us(hi.z, x1.z, r1);
                r1 = gv_dp4a_us(hi.w, x1.w, r1);
                acc[t] += fmaf(ds1 * s.x, gv_dot_f(r0), fmaf(ds2 * s.y, gv_dot_f(r1), fmaf(dm1, s.z, dm2 * s.w)));
            }
        }
    }
};
template <> struct gv_chunk<DTYPE_Q4_K> : gv_chunk_k45<DTYPE_Q4_K> {};
template <> struct gv_chunk<DTYPE_Q5_K> : gv_chunk_k45<DTYPE_Q5_K> {};

/* Q6_K (the backend's regrouped rows, common.cuh): a chunk is 32
 * elements of super-block sb = c / 8 (j = c % 8: half h = j / 4, columns
 * l0 = 8 (j & 3) .. + 7 of each of the 4 quarters): 8 bytes of the block's
 * ql at 64 h + l0 (quarters 0 and 2), 8 at 64 h + 32 + l0 (1 and 3), 8 of
 * its qh at 32 h + l0, the 8 scale bytes of the half and d: five aligned
 * loads. */
template <> struct gv_chunk<DTYPE_Q6_K> {
    static constexpr int cw = 32;
    uint2 a, b, hh, sc;
    uint32_t d;
    __device__ __forceinline__ void load(const uint8_t *wr, int c, int j, int cols) {
        const size_t sb = (size_t)(c >> 3);
        const int h = j >> 2, l0 = 8 * (j & 3);
        const uint8_t *ql = wr + 128 * sb + 64 * h + l0;
        a = __ldg((const uint2 *)ql);
        b = __ldg((const uint2 *)(ql + 32));
        hh = __ldg((const uint2 *)(wr + q6s_qh_off(cols) + 64 * sb + 32 * h + l0));
        sc = __ldg((const uint2 *)(wr + q6s_sc_off(cols) + 16 * sb + 8 * h));
        d = __ldg((const uint16_t *)(wr + q6s_d_off(cols)) + sb);
    }
    template <int NT>
    __device__ __forceinline__ void dot(int c, int j, const int8_t *xq, const float *xd, const float4 *, int cols, int n,
                                        float (&acc)[NT]) const {
        const int h = j >> 2, l0 = 8 * (j & 3);
        /* Codes 0..63 less 32 as signed bytes: (code + 96) ^ 128 never
         * carries from one byte into the next. */
        uint2 q[4];
#define GV_Q6(lo, hb) ((((lo) & 0x0F0F0F0Fu) | (((hb) & 0x03030303u) << 4)) + 0x60606060u) ^ 0x80808080u
        q[0] = make_uint2(GV_Q6(a.x, hh.x), GV_Q6(a.y, hh.y));
        q[1] = make_uint2(GV_Q6(b.x, hh.x >> 2), GV_Q6(b.y, hh.y >> 2));
        q[2] = make_uint2(GV_Q6(a.x >> 4, hh.x >> 4), GV_Q6(a.y >> 4, hh.y >> 4));
        q[3] = make_uint2(GV_Q6(b.x >> 4, hh.x >> 6), GV_Q6(b.y >> 4, hh.y >> 6));
#undef GV_Q6
        /* Scale of quarter k: byte l0 / 16 + 2 k of the half's 8. */
        float s[4];
#pragma unroll
        for (int k = 0; k < 4; k++) {
            int i = (l0 >> 4) + 2 * k;
            s[k] = (float)(int8_t)gv_byte(i < 4 ? sc.x : sc.y, i & 3);
        }
        const float dw = gv_half(d);
        const size_t e0 = (size_t)(c >> 3) * 256 + 128 * h + l0;
        const size_t b0 = (size_t)(c >> 3) * 8 + 4 * h; /* 4 blocks: one 16-byte load */
#pragma unroll
        for (int t = 0; t < NT; t++) {
            if (t < n) {
                const int8_t *xr = xq + (size_t)t * cols + e0;
                const float4 dx = __ldg((const float4 *)(xd + (size_t)t * (cols / 32) + b0));
                const float dk[4] = {dx.x, dx.y, dx.z, dx.w};
                float r = 0.0f;
#pragma unroll
                for (int k = 0; k < 4; k++) {
                    uint2 xv = __ldg((const uint2 *)(xr + 32 * k));
                    int v = __dp4a((int)q[k].x, (int)xv.x, __dp4a((int)q[k].y, (int)xv.y, GV_MAGIC_I));
                    r = fmaf(s[k] * dk[k], gv_dot_f(v), r);
                }
                acc[t] = fmaf(dw, r, acc[t]);
            }
        }
    }
};

/* acc[t] += x[t] . one row (wr) for t < n <= NT, this lane's share: each
 * lane loads GV_UNROLL chunks before using any (the loads are
 * independent: several DRAM requests in flight per lane), then dots
 * them.  The weights are no kernel's output, so the first chunks are
 * loaded before the programmatic wait (pdl_begin, called here): their
 * trip to DRAM overlaps the end of the kernel before. */
template <int T, int NT>
__device__ __forceinline__ void gv_row(const uint8_t *wr, int cols, const int8_t *__restrict__ xq,
                                       const float *__restrict__ xd, const float4 *__restrict__ xs, int n, int lane,
                                       float (&acc)[NT]) {
    using C = gv_chunk<T>;
    constexpr int U = GV_UNROLL;
    const int nch = cols / C::cw, j = lane & 7; /* c % 8 of every chunk of the lane */
    C ch[U];
    int c0 = lane;
#pragma unroll
    for (int u = 0; u < U; u++)
        if (c0 + 32 * u < nch) ch[u].load(wr, c0 + 32 * u, j, cols);
    pdl_begin();
    for (;;) {
#pragma unroll
        for (int u = 0; u < U; u++)
            if (c0 + 32 * u < nch) ch[u].template dot<NT>(c0 + 32 * u, j, xq, xd, xs, cols, n, acc);
        c0 += 32 * U;
        if (c0 >= nch) break;
#pragma unroll
        for (int u = 0; u < U; u++)
            if (c0 + 32 * u < nch) ch[u].load(wr, c0 + 32 * u, j, cols);
    }
}

/* out[t, row] = x[t] . w[row] for t < n <= NT, for each weight of the
 * group g (matmul_group.cuh): a warp owns one row, the 32 partial sums
 * are added with shuffles.  The weights from block b1 on may be of a
 * second type T1 (row_bytes1 a row): Q4_K_M's v and Q5_K_M's, Q6_K beside
 * Q4_K / Q5_K q and k, in the same launch (a branch per block).  No early
 * return: a swiglu block meets at a barrier. */
template <int T, int NT, int T1>
__global__ void __launch_bounds__(GV_WARPS * 32, 8)
matmul_gemv_kernel(const mm_group g, size_t row_bytes, size_t row_bytes1, int b1, int cols,
                   const int8_t *__restrict__ xq, const float *__restrict__ xd, const float4 *__restrict__ xs, int n) {
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
    float acc[NT];
#pragma unroll
    for (int t = 0; t < NT; t++) acc[t] = 0.0f;
    /* Each branch waits for the kernel before once (gv_row's pdl_begin). */
    if (const mm_row r = mg_locate<GV_WARPS>(g, warp); r.row >= r.rows)
        pdl_begin();
    else if (T1 != T && (int)blockIdx.x >= b1)
        gv_row<T1, NT>(r.w + (size_t)r.row * row_bytes1, cols, xq, xd, xs, n, lane, acc);
    else
        gv_row<T, NT>(r.w + (size_t)r.row * row_bytes, cols, xq, xd, xs, n, lane, acc);
#pragma unroll
    for (int t = 0; t < NT; t++) {
#pragma unroll
        for (int o = 16; o > 0; o >>= 1) acc[t] += __shfl_xor_sync(0xffffffffu, acc[t], o);
    }
    mg_store<GV_WARPS, NT>(g, warp, lane, n, acc);
}

/* Segments seg1 .. of g are of type T1 (T1 == T: none). */
template <int T, int T1>
static int gemv_launch(struct cuda_ctx *ctx, mm_group &g, int seg1, int64_t cols, const int8_t *xq, const float *xd,
                       const float4 *xs, int n) {
    const unsigned grid = mg_layout(&g, GV_WARPS);
    const size_t rb = cuda_row_bytes((enum dtype)T, cols), rb1 = cuda_row_bytes((enum dtype)T1, cols);
    const int b1 = seg1 < g.n ? g.blk0[seg1] : (int)grid;
    if (n == 1)
        CUDA_CHECK(ctx, cuda_launch(ctx, (matmul_gemv_kernel<T, 1, T1>), dim3(grid), dim3(GV_WARPS * 32), 0, g, rb, rb1,
                                    b1, (int)cols, xq, xd, xs, n));
    else if (n == 2)
        CUDA_CHECK(ctx, cuda_launch(ctx, (matmul_gemv_kernel<T, 2, T1>), dim3(grid), dim3(GV_WARPS * 32), 0, g, rb, rb1,
                                    b1, (int)cols, xq, xd, xs, n));
    else
        CUDA_CHECK(ctx, cuda_launch(ctx, (matmul_gemv_kernel<T, 4, T1>), dim3(grid), dim3(GV_WARPS * 32), 0, g, rb, rb1,
                                    b1, (int)cols, xq, xd, xs, n));
    CUDA_CHECK(ctx, cudaGetLastError());
    return STATUS_OK;
}

/* Scratch: xq (n x cols bytes, 256-aligned size), xd, then (cols a
 * multiple of 64) xs: gemv_quant_x_kernel's outputs. */
static size_t gv_q_bytes(int32_t n, int64_t cols) { return ((size_t)n * cols + 255) & ~(size_t)255; }
static size_t gv_d_bytes(int32_t n, int64_t cols) { return ((size_t)n * cols / 32 * sizeof(float) + 15) & ~(size_t)15; }

extern "C" size_t cuda_gemv_act_bytes(int32_t n, int64_t cols) {
    return gv_q_bytes(n, cols) + gv_d_bytes(n, cols) + (cols % 64 == 0 ? (size_t)n * cols / 32 * 16 : 0);
}

static int gv_scratch(struct cuda_ctx *ctx, int32_t n, int64_t cols, uint8_t **scratch, int8_t **xq, float **xd,
                      float4 **xs) {
    const size_t q_bytes = gv_q_bytes(n, cols);
    uint8_t *p = (uint8_t *)cuda_scratch(ctx, cuda_gemv_act_bytes(n, cols));
    if (!p) return STATUS_NO_MEMORY;
    *scratch = p;
    *xq = (int8_t *)p;
    *xd = (float *)(p + q_bytes);
    *xs = cols % 64 == 0 ? (float4 *)(p + q_bytes + gv_d_bytes(n, cols)) : NULL;
    return STATUS_OK;
}

extern "C" int cuda_gemv_act_q8s(struct cuda_ctx *ctx, const float *x, int32_t n, int64_t cols, int8_t **xq,
                                 float **xd, float **xs) {
    if (n < 1 || n > GV_NT_MAX || cols <= 0 || cols % 64 != 0 || cols > INT32_MAX)
        return cuda_fail(ctx, STATUS_BAD_INPUT, "matmul_gemv: no int8 form for [%d x %lld]", n, (long long)cols);
    uint8_t *scratch;
    float4 *s4;
    if (gv_scratch(ctx, n, cols, &scratch, xq, xd, &s4) != STATUS_OK) return STATUS_NO_MEMORY;
    *xs = (float *)s4;
    cuda_act_reuse(ctx, MATMUL_ACT_Q8S, x, n, cols, scratch); /* records it */
    return STATUS_OK;
}

extern "C" int cuda_matmul_gemv_supports(enum dtype type, int64_t cols, int32_t n) {
    if (n < 1 || n > GV_NT_MAX || cols <= 0 || cols > INT32_MAX) return 0;
    switch (type) {
    case DTYPE_Q8_0: case DTYPE_Q4_0: return cols % 32 == 0;
    case DTYPE_Q4_K: case DTYPE_Q5_K: case DTYPE_Q6_K: return cols % 256 == 0;
    default: return 0;
    }
}

/* The group's weights (16-byte aligned, each checked here) against x
 * quantized once; segments seg1 .. are of type1 (seg1 = g->n: none), a
 * pair cuda_matmul_gemv_pair takes. */
extern "C" int cuda_matmul_gemv_group2(struct cuda_ctx *ctx, struct mm_group *g, enum dtype type, enum dtype type1,
                                       int seg1, int64_t cols, const float *x, int32_t n) {
    for (int s = 0; s < g->n; s++) {
        const enum dtype t = s < seg1 ? type : type1;
        if (g->rows[s] <= 0 || !cuda_matmul_gemv_supports(t, cols, n) || (uintptr_t)g->w[s] % 16 != 0)
            return cuda_fail(ctx, STATUS_BAD_INPUT, "matmul_gemv: %d tokens x %s [%d x %lld] at %p is not a gemv shape",
                             n, dtype_name(t), g->rows[s], (long long)cols, (const void *)g->w[s]);
    }
    if (seg1 < g->n && type1 != type && !cuda_matmul_gemv_pair(type, type1))
        return cuda_fail(ctx, STATUS_UNSUPPORTED, "matmul_gemv: %s with %s in one launch", dtype_name(type),
                         dtype_name(type1));
    const int64_t nblk = (int64_t)n * cols / 32;
    const bool with_s = cols % 64 == 0;
    uint8_t *scratch;
    int8_t *xq;
    float *xd;
    float4 *xs;
    if (gv_scratch(ctx, n, cols, &scratch, &xq, &xd, &xs) != STATUS_OK) return STATUS_NO_MEMORY;
    /* The sums are written for the types that read them (or where the
     * kept form has them already: another input will need them again). */
    const bool mins = type == DTYPE_Q4_K || type == DTYPE_Q5_K;
    const int kind = with_s && (mins || ctx->act_kind == MATMUL_ACT_Q8S) ? MATMUL_ACT_Q8S : MATMUL_ACT_Q8;
    if (!cuda_act_reuse(ctx, kind, x, n, cols, scratch)) {
        CUDA_CHECK(ctx, cuda_launch(ctx, gemv_quant_x_kernel, dim3(cuda_blocks(nblk * 32, 256)), dim3(256), 0, xq, xd,
                                    kind == MATMUL_ACT_Q8S ? (float *)xs : (float *)NULL, x, nblk));
        CUDA_CHECK(ctx, cudaGetLastError());
    }
    if (seg1 < g->n && type1 != type) {
        if (type == DTYPE_Q4_K) return gemv_launch<DTYPE_Q4_K, DTYPE_Q6_K>(ctx, *g, seg1, cols, xq, xd, xs, n);
        return gemv_launch<DTYPE_Q5_K, DTYPE_Q6_K>(ctx, *g, seg1, cols, xq, xd, xs, n);
    }
    switch (type) {
    case DTYPE_Q8_0: return gemv_launch<DTYPE_Q8_0, DTYPE_Q8_0>(ctx, *g, g->n, cols, xq, xd, xs, n);
    case DTYPE_Q4_0: return gemv_launch<DTYPE_Q4_0, DTYPE_Q4_0>(ctx, *g, g->n, cols, xq, xd, xs, n);
    case DTYPE_Q4_K: return gemv_launch<DTYPE_Q4_K, DTYPE_Q4_K>(ctx, *g, g->n, cols, xq, xd, xs, n);
    case DTYPE_Q5_K: return gemv_launch<DTYPE_Q5_K, DTYPE_Q5_K>(ctx, *g, g->n, cols, xq, xd, xs, n);
    case DTYPE_Q6_K: return gemv_launch<DTYPE_Q6_K, DTYPE_Q6_K>(ctx, *g, g->n, cols, xq, xd, xs, n);
    default: break;
    }
    return cuda_fail(ctx, STATUS_UNSUPPORTED, "matmul_gemv: weight type %s", dtype_name(type));
}

extern "C" int cuda_matmul_gemv_group(struct cuda_ctx *ctx, struct mm_group *g, enum dtype type, int64_t cols,
                                      const float *x, int32_t n) {
    return cuda_matmul_gemv_group2(ctx, g, type, type, g->n, cols, x, n);
}

/* The mixes of one launch: Q6_K after Q4_K or Q5_K (the K-quant "_M"
 * files' v and down beside Q4_K / Q5_K q and k). */
extern "C" int cuda_matmul_gemv_pair(enum dtype type, enum dtype type1) {
    return type1 == DTYPE_Q6_K && (type == DTYPE_Q4_K || type == DTYPE_Q5_K);
}

extern "C" int cuda_matmul_gemv(struct cuda_ctx *ctx, float *out, const void *w, enum dtype type, int64_t rows,
                                int64_t cols, const float *x, int32_t n) {
    if (rows <= 0 || rows > INT32_MAX)
        return cuda_fail(ctx, STATUS_BAD_INPUT, "matmul_gemv: %lld rows", (long long)rows);
    struct mm_group g = mg_single(w, out, rows);
    return cuda_matmul_gemv_group(ctx, &g, type, cols, x, n);
}
