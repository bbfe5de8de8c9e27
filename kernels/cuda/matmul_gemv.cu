/* Batch-1..4 decode matmul on quantized weights (Q8_0, Q4_0, Q4_K, Q5_K,
 * Q6_K): one warp per output row streams the row's bytes straight into
 * registers, several independent loads per lane in flight, no shared
 * memory and no block barrier; the activations are quantized once per call
 * to int8 per 32 (a tiny pre-kernel) so that 4 weights cost one dp4a.
 * Decode is memory-bound: the aim is the DRAM rate (docs/cuda-backend.md). */
#include "common.cuh"
#include "matmul_group.cuh"

/* 4 warps (rows) per block: small blocks fill every SM evenly; launch
 * bounds keep registers at 64 so that 8 blocks (32 warps) fit per SM. */
#define GV_WARPS 4
/* Chunks (32 weights of one row) a lane loads before using any.  2 on
 * every type: on an H200 (7B, batch 1) 2 beat 4 for Q8_0 (2.89 -> 2.77 ms
 * a step) and Q4_K (2.70 -> 2.63 ms for Q4_K_M), and 1 was no better for
 * Q8_0 and worse for Q4_K (docs/cuda-backend.md, run 8): all warps asking
 * for their whole row at once did not reach the DRAM rate sooner. */
#define GV_UNROLL 2
#define GV_NT_MAX 4

/* ---- Activations: x[n, cols] F32 -> xq int8 [n, cols], xd[n, cols / 32]
 * (scale of each block of 32: x ~ xd * xq).  One warp per block. ---- */
__global__ void gemv_quant_x_kernel(int8_t *__restrict__ xq, float *__restrict__ xd, const float *__restrict__ x,
                                    int64_t nblk) {
    pdl_begin();
    int64_t b = ((int64_t)blockIdx.x * blockDim.x + threadIdx.x) / 32;
    int lane = threadIdx.x & 31;
    if (b >= nblk) return;
    float v = __ldg(x + b * 32 + lane), a = fabsf(v);
#pragma unroll
    for (int o = 16; o > 0; o >>= 1) a = fmaxf(a, __shfl_xor_sync(0xffffffffu, a, o));
    float d = a / 127.0f;
    int q = d > 0.0f ? __float2int_rn(v / d) : 0;
    xq[b * 32 + lane] = (int8_t)q;
    if (lane == 0) xd[b] = d;
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
    __device__ __forceinline__ void load(const uint8_t *wr, int c, int cols) {
        q0 = __ldg((const uint4 *)wr + 2 * c);
        q1 = __ldg((const uint4 *)wr + 2 * c + 1);
        d = __ldg((const uint16_t *)(wr + q8s_d_off(cols)) + c);
    }
    template <int NT>
    __device__ __forceinline__ void dot(int c, const int8_t *xq, const float *xd, int cols, int n, float (&acc)[NT]) const {
        float dw = gv_half(d);
#pragma unroll
        for (int t = 0; t < NT; t++) {
            if (t < n) {
                const uint4 *xp = (const uint4 *)(xq + (size_t)t * cols + 32 * c);
                uint4 x0 = __ldg(xp), x1 = __ldg(xp + 1);
                float dx = __ldg(xd + (size_t)t * (cols / 32) + c);
                acc[t] += dw * dx * (float)gv_dot4(q0, x0, gv_dot4(q1, x1, 0));
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
    __device__ __forceinline__ void load(const uint8_t *wr, int c, int cols) {
        const uint8_t *blk = wr + (size_t)c * 18;
        d = __ldg((const uint16_t *)blk);
        q = gv_ld16u(blk + 2);
    }
    template <int NT>
    __device__ __forceinline__ void dot(int c, const int8_t *xq, const float *xd, int cols, int n, float (&acc)[NT]) const {
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
 * (d, dmin, 12 scale bytes) is one more 16-byte load, shared by 8 lanes. */
template <int T> struct gv_chunk_k45 {
    static constexpr int cw = 32, bb = T == DTYPE_Q4_K ? 144 : 176, qo = T == DTYPE_Q4_K ? 16 : 48;
    uint4 h, q, qh;
    __device__ __forceinline__ void load(const uint8_t *wr, int c, int cols) {
        const uint8_t *blk = wr + (size_t)(c >> 3) * bb;
        int j = c & 7;
        h = __ldg((const uint4 *)blk);
        q = __ldg((const uint4 *)(blk + qo + 32 * (j >> 1) + 16 * (j & 1)));
        if constexpr (T == DTYPE_Q5_K) qh = __ldg((const uint4 *)(blk + 16 + 16 * (j & 1)));
    }
    /* Scale and min of sub-block s (0..7) from the header words (the
     * 6-bit packing of kq_scale_min). */
    __device__ __forceinline__ void scale_min(int s, float *sc, float *mn) const {
        int k = s & 3;
        uint32_t a = gv_byte(h.y, k), b = gv_byte(h.z, k), e = gv_byte(h.w, k);
        if (s < 4) {
            *sc = (float)(a & 63);
            *mn = (float)(b & 63);
        } else {
            *sc = (float)((e & 0xF) | ((a >> 6) << 4));
            *mn = (float)((e >> 4) | ((b >> 6) << 4));
        }
    }
    template <int NT>
    __device__ __forceinline__ void dot(int c, const int8_t *xq, const float *xd, int cols, int n, float (&acc)[NT]) const {
        int j = c & 7, p = j >> 1;
        float d = gv_half(h.x), dmin = gv_half(h.x >> 16), sc1, m1, sc2, m2;
        scale_min(2 * p, &sc1, &m1);
        scale_min(2 * p + 1, &sc2, &m2);
        float ds1 = d * sc1, dm1 = dmin * m1, ds2 = d * sc2, dm2 = dmin * m2;
        uint4 lo = gv_and(q, 0x0F0F0F0Fu), hi = gv_and(gv_shr(q, 4), 0x0F0F0F0Fu);
        if constexpr (T == DTYPE_Q5_K) {
            /* 5th code bit of each byte: bit 2p (low) / 2p + 1 (high) of qh. */
            lo = gv_or(lo, gv_bit5(qh, 2 * p));
            hi = gv_or(hi, gv_bit5(qh, 2 * p + 1));
        }
        /* Elements 256 sb + 64 p + 16 (j & 1) + i (low) and + 32 (high). */
        const size_t e0 = (size_t)(c >> 3) * 256 + 64 * p + 16 * (j & 1);
        const size_t b0 = (size_t)(c >> 3) * 8 + 2 * p;
#pragma unroll
        for (int t = 0; t < NT; t++) {
            if (t < n) {
                const int8_t *xr = xq + (size_t)t * cols + e0;
                uint4 x0 = __ldg((const uint4 *)xr), x1 = __ldg((const uint4 *)(xr + 32));
                const float *dr = xd + (size_t)t * (cols / 32) + b0;
                float dx0 = __ldg(dr), dx1 = __ldg(dr + 1);
                acc[t] += dx0 * (ds1 * (float)gv_dot4(lo, x0, 0) - dm1 * (float)gv_sum4(x0)) +
                          dx1 * (ds2 * (float)gv_dot4(hi, x1, 0) - dm2 * (float)gv_sum4(x1));
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
    __device__ __forceinline__ void load(const uint8_t *wr, int c, int cols) {
        const size_t sb = (size_t)(c >> 3);
        int j = c & 7, h = j >> 2, l0 = 8 * (j & 3);
        const uint8_t *ql = wr + 128 * sb + 64 * h + l0;
        a = __ldg((const uint2 *)ql);
        b = __ldg((const uint2 *)(ql + 32));
        hh = __ldg((const uint2 *)(wr + q6s_qh_off(cols) + 64 * sb + 32 * h + l0));
        sc = __ldg((const uint2 *)(wr + q6s_sc_off(cols) + 16 * sb + 8 * h));
        d = __ldg((const uint16_t *)(wr + q6s_d_off(cols)) + sb);
    }
    template <int NT>
    __device__ __forceinline__ void dot(int c, const int8_t *xq, const float *xd, int cols, int n, float (&acc)[NT]) const {
        int j = c & 7, h = j >> 2, l0 = 8 * (j & 3);
        float dw = gv_half(d);
        /* Codes 0..63 minus 32, quarter by quarter, as signed bytes. */
        uint2 q[4];
        q[0] = make_uint2(__vsub4((a.x & 0x0F0F0F0Fu) | ((hh.x & 0x03030303u) << 4), 0x20202020u),
                          __vsub4((a.y & 0x0F0F0F0Fu) | ((hh.y & 0x03030303u) << 4), 0x20202020u));
        q[1] = make_uint2(__vsub4((b.x & 0x0F0F0F0Fu) | (((hh.x >> 2) & 0x03030303u) << 4), 0x20202020u),
                          __vsub4((b.y & 0x0F0F0F0Fu) | (((hh.y >> 2) & 0x03030303u) << 4), 0x20202020u));
        q[2] = make_uint2(__vsub4(((a.x >> 4) & 0x0F0F0F0Fu) | (((hh.x >> 4) & 0x03030303u) << 4), 0x20202020u),
                          __vsub4(((a.y >> 4) & 0x0F0F0F0Fu) | (((hh.y >> 4) & 0x03030303u) << 4), 0x20202020u));
        q[3] = make_uint2(__vsub4(((b.x >> 4) & 0x0F0F0F0Fu) | (((hh.x >> 6) & 0x03030303u) << 4), 0x20202020u),
                          __vsub4(((b.y >> 4) & 0x0F0F0F0Fu) | (((hh.y >> 6) & 0x03030303u) << 4), 0x20202020u));
        /* Scale of quarter k: byte l0 / 16 + 2 k of the half's 8. */
        float s[4];
#pragma unroll
        for (int k = 0; k < 4; k++) {
            int i = (l0 >> 4) + 2 * k;
            s[k] = dw * (float)(int8_t)gv_byte(i < 4 ? sc.x : sc.y, i & 3);
        }
        const size_t e0 = (size_t)(c >> 3) * 256 + 128 * h + l0;
        const size_t b0 = (size_t)(c >> 3) * 8 + 4 * h;
#pragma unroll
        for (int t = 0; t < NT; t++) {
            if (t < n) {
                const int8_t *xr = xq + (size_t)t * cols + e0;
                const float *dr = xd + (size_t)t * (cols / 32) + b0;
                float r = 0.0f;
#pragma unroll
                for (int k = 0; k < 4; k++) {
                    uint2 xv = __ldg((const uint2 *)(xr + 32 * k));
                    int v = __dp4a((int)q[k].x, (int)xv.x, __dp4a((int)q[k].y, (int)xv.y, 0));
                    r += s[k] * __ldg(dr + k) * (float)v;
                }
                acc[t] += r;
            }
        }
    }
};

/* acc[t] += x[t] . one row (wr) for t < n <= NT, this lane's share: each
 * lane loads GV_UNROLL chunks before using any (the loads are
 * independent: several DRAM requests in flight per lane), then dots
 * them. */
template <int T, int NT>
__device__ __forceinline__ void gv_row(const uint8_t *wr, int cols, const int8_t *__restrict__ xq,
                                       const float *__restrict__ xd, int n, int lane, float (&acc)[NT]) {
    using C = gv_chunk<T>;
    constexpr int U = GV_UNROLL;
    const int nch = cols / C::cw;
    for (int c0 = lane; c0 < nch; c0 += 32 * U) {
        C ch[U];
#pragma unroll
        for (int u = 0; u < U; u++)
            if (c0 + 32 * u < nch) ch[u].load(wr, c0 + 32 * u, cols);
#pragma unroll
        for (int u = 0; u < U; u++)
            if (c0 + 32 * u < nch) ch[u].template dot<NT>(c0 + 32 * u, xq, xd, cols, n, acc);
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
                   const int8_t *__restrict__ xq, const float *__restrict__ xd, int n) {
    pdl_begin();
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
    float acc[NT];
#pragma unroll
    for (int t = 0; t < NT; t++) acc[t] = 0.0f;
    if (const mm_row r = mg_locate<GV_WARPS>(g, warp); r.row < r.rows) {
        if (T1 != T && (int)blockIdx.x >= b1)
            gv_row<T1, NT>(r.w + (size_t)r.row * row_bytes1, cols, xq, xd, n, lane, acc);
        else
            gv_row<T, NT>(r.w + (size_t)r.row * row_bytes, cols, xq, xd, n, lane, acc);
    }
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
                       int n) {
    const unsigned grid = mg_layout(&g, GV_WARPS);
    const size_t rb = cuda_row_bytes((enum dtype)T, cols), rb1 = cuda_row_bytes((enum dtype)T1, cols);
    const int b1 = seg1 < g.n ? g.blk0[seg1] : (int)grid;
    if (n == 1)
        CUDA_CHECK(ctx, cuda_launch(ctx, (matmul_gemv_kernel<T, 1, T1>), dim3(grid), dim3(GV_WARPS * 32), 0, g, rb, rb1,
                                    b1, (int)cols, xq, xd, n));
    else if (n == 2)
        CUDA_CHECK(ctx, cuda_launch(ctx, (matmul_gemv_kernel<T, 2, T1>), dim3(grid), dim3(GV_WARPS * 32), 0, g, rb, rb1,
                                    b1, (int)cols, xq, xd, n));
    else
        CUDA_CHECK(ctx, cuda_launch(ctx, (matmul_gemv_kernel<T, 4, T1>), dim3(grid), dim3(GV_WARPS * 32), 0, g, rb, rb1,
                                    b1, (int)cols, xq, xd, n));
    CUDA_CHECK(ctx, cudaGetLastError());
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
    /* Scratch: xq (n x cols bytes, 256-aligned size) then xd. */
    size_t q_bytes = ((size_t)n * cols + 255) & ~(size_t)255;
    int64_t nblk = (int64_t)n * cols / 32;
    uint8_t *scratch = (uint8_t *)cuda_scratch(ctx, q_bytes + (size_t)nblk * sizeof(float));
    if (!scratch) return STATUS_NO_MEMORY;
    int8_t *xq = (int8_t *)scratch;
    float *xd = (float *)(scratch + q_bytes);
    if (!cuda_act_reuse(ctx, MATMUL_ACT_Q8, x, n, cols, scratch)) {
        CUDA_CHECK(ctx, cuda_launch(ctx, gemv_quant_x_kernel, dim3(cuda_blocks(nblk * 32, 256)), dim3(256), 0, xq, xd,
                                    x, nblk));
        CUDA_CHECK(ctx, cudaGetLastError());
    }
    if (seg1 < g->n && type1 != type) {
        if (type == DTYPE_Q4_K) return gemv_launch<DTYPE_Q4_K, DTYPE_Q6_K>(ctx, *g, seg1, cols, xq, xd, n);
        return gemv_launch<DTYPE_Q5_K, DTYPE_Q6_K>(ctx, *g, seg1, cols, xq, xd, n);
    }
    switch (type) {
    case DTYPE_Q8_0: return gemv_launch<DTYPE_Q8_0, DTYPE_Q8_0>(ctx, *g, g->n, cols, xq, xd, n);
    case DTYPE_Q4_0: return gemv_launch<DTYPE_Q4_0, DTYPE_Q4_0>(ctx, *g, g->n, cols, xq, xd, n);
    case DTYPE_Q4_K: return gemv_launch<DTYPE_Q4_K, DTYPE_Q4_K>(ctx, *g, g->n, cols, xq, xd, n);
    case DTYPE_Q5_K: return gemv_launch<DTYPE_Q5_K, DTYPE_Q5_K>(ctx, *g, g->n, cols, xq, xd, n);
    case DTYPE_Q6_K: return gemv_launch<DTYPE_Q6_K, DTYPE_Q6_K>(ctx, *g, g->n, cols, xq, xd, n);
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
    struct mm_group g = {};
    g.w[0] = (const uint8_t *)w;
    g.out[0] = out;
    g.rows[0] = (int)rows;
    g.n = 1;
    return cuda_matmul_gemv_group(ctx, &g, type, cols, x, n);
}
