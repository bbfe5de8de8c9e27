/* Tensor-core matmul for decode batches of up to 16 tokens on Q4_K, Q5_K
 * and Q6_K weights and up to 8 on Q8_0, with no shared-memory staging:
 * out[n, rows] = x[n, cols] . w^T.  (The dp4a kernel of matmul_gemv.cu
 * keeps 1-2 tokens on the K-quants and 1-3 on Q8_0, where it measured
 * faster: matmul.cu.)
 *
 * matmul_vec.cu's mq copies each chunk of its rows into shared memory and
 * meets at two block barriers a chunk; at 8 tokens it reached about half
 * of the batch-1 kernel's bandwidth (7B Q4_K 11008x4096: 20.9 against
 * 12.0 us).  Here each lane loads exactly the bytes of its own mma
 * fragments straight from global memory -- lane (g, t) holds columns
 * 8t .. 8t + 7 of each 32-column block of rows g and g + 8 (mq_frag.cuh's
 * order), a few contiguous bytes in every layout -- and its activations
 * (8 of token g a block: 16 bytes of the kept F16 form, else 32 of F32
 * converted in registers), so a warp runs from its first load to its last
 * mma with no barrier.
 *
 * A block is MR_WARPS warps on the same 16 rows, each warp one slice of
 * the chunks (256 columns) of the row: parallelism for short matrices
 * without partial sums in global memory.  The warps' sums are added in
 * shared memory in warp order (the same bits every run).  Several weights
 * on one input (q, k, v) are one launch, a block per tile of any of them,
 * a Q6_K v after a Q4_K or Q5_K q and k too (the "_M" files' mix);
 * gate and up with swiglu share each block, half the warps on each tile,
 * and the block writes silu(gate) * up. */
#include "matmul_group.cuh"
#include "mq_frag.cuh"

/* Each warp's raw bytes of the next chunk are loaded while the present
 * chunk is multiplied, so a warp does not wait a DRAM latency per chunk
 * (7B at 8 tokens, Q8_0 4096x11008: 24.5 us, 35.3 with the loads where
 * they are used).  Every tile keeps all MR_WARPS warps even where a
 * matrix has many rows: fewer, longer warps keep fewer bytes in flight
 * (11008x4096 Q4_K: 24.7 us on a tile's chunks over fewer warps, 20.9 on
 * eight). */

#define MR_WARPS 8

/* The raw bytes of one row's chunk (256 columns) that lane t's fragments
 * need, in registers: loaded for the next chunk while this one is
 * multiplied. */
template <int T> struct mr_raw;
template <> struct mr_raw<DTYPE_Q8_0> { uint2 q[8]; uint4 d; };          /* codes; the 8 block scales */
template <> struct mr_raw<DTYPE_Q4_K> { uint4 h; uint2 q[4]; };           /* header; codes of block pairs */
template <> struct mr_raw<DTYPE_Q5_K> { uint4 h; uint2 qh; uint2 q[4]; }; /* and the 5th bits */
template <> struct mr_raw<DTYPE_Q6_K> { uint2 ql[4]; uint2 qh[2]; uint4 sc; uint32_t d; };

/* The backend's layouts: Q8_0 codes[cols] then d[cols / 32]; Q4_K / Q5_K
 * GGUF's super-blocks as they are; Q6_K ql[cols / 2], qh[cols / 4],
 * scales[cols / 16], d[cols / 256] (common.cuh). */
template <int T>
__device__ __forceinline__ void mr_load(mr_raw<T> &r, const uint8_t *row, int cols, int ch, int t) {
    if constexpr (T == DTYPE_Q8_0) {
#pragma unroll
        for (int b = 0; b < 8; b++) r.q[b] = __ldg((const uint2 *)(row + 256 * (size_t)ch + 32 * b + 8 * t));
        r.d = __ldg((const uint4 *)(row + q8s_d_off(cols) + 16 * (size_t)ch));
    } else if constexpr (T == DTYPE_Q6_K) {
#pragma unroll
        for (int i = 0; i < 4; i++) r.ql[i] = __ldg((const uint2 *)(row + 128 * (size_t)ch + 32 * i + 8 * t));
#pragma unroll
        for (int h = 0; h < 2; h++)
            r.qh[h] = __ldg((const uint2 *)(row + q6s_qh_off(cols) + 64 * (size_t)ch + 32 * h + 8 * t));
        r.sc = __ldg((const uint4 *)(row + q6s_sc_off(cols) + 16 * (size_t)ch));
        r.d = __ldg((const uint16_t *)(row + q6s_d_off(cols)) + ch);
    } else {
        constexpr int qo = T == DTYPE_Q4_K ? 16 : 48;
        const uint8_t *p = row + (size_t)ch * mq_fmt<T>::bb;
        r.h = __ldg((const uint4 *)p);
        if constexpr (T == DTYPE_Q5_K) r.qh = __ldg((const uint2 *)(p + 16 + 8 * t));
#pragma unroll
        for (int i = 0; i < 4; i++) r.q[i] = __ldg((const uint2 *)(p + qo + 32 * i + 8 * t));
    }
}

/* Fragment a[0..3] of 32-column block b (a constant after unrolling) for
 * lane t, as mq_decode<T> makes it from shared memory. */
template <int T> __device__ __forceinline__ void mr_decode(const mr_raw<T> &r, int b, int t, uint32_t (&a)[4]) {
    const __half2 zero = mq_hh(0.0f);
    if constexpr (T == DTYPE_Q8_0) {
        const uint32_t dw = b < 2 ? r.d.x : b < 4 ? r.d.y : b < 6 ? r.d.z : r.d.w;
        const __half2 d = mq_h2((b & 1) ? __byte_perm(dw, 0, 0x3232) : __byte_perm(dw, 0, 0x1010));
        mq_cvt(a, r.q[b].x ^ 0x80808080u, r.q[b].y ^ 0x80808080u, mq_hh(1152.0f), d, zero);
    } else if constexpr (T == DTYPE_Q6_K) {
        const int h = b >> 2, q = b & 3, sh = 4 * (q >> 1);
        const uint2 ql = r.ql[2 * h + (q & 1)], qh = r.qh[h];
        const uint32_t v0 = ((ql.x >> sh) & 0x0F0F0F0Fu) | (((qh.x >> (2 * q)) & 0x03030303u) << 4);
        const uint32_t v1 = ((ql.y >> sh) & 0x0F0F0F0Fu) | (((qh.y >> (2 * q)) & 0x03030303u) << 4);
        /* Scale byte 8h + 2q + t / 2 of the chunk's 16. */
        const int wi = 2 * h + (q >> 1);
        const uint32_t sw = wi == 0 ? r.sc.x : wi == 1 ? r.sc.y : wi == 2 ? r.sc.z : r.sc.w;
        const int8_t sc = (int8_t)(sw >> (8 * (2 * (q & 1) + (t >> 1))));
        const float d = __half2float(__ushort_as_half((unsigned short)r.d));
        mq_cvt(a, v0, v1, mq_hh(1056.0f), mq_hh(d * (float)sc), zero);
    } else {
        const __half2 dm = mq_h2(mq_kq_pair(r.h, b));
        const uint2 q = r.q[b >> 1];
        const int sh = 4 * (b & 1);
        uint32_t v0 = (q.x >> sh) & 0x0F0F0F0Fu, v1 = (q.y >> sh) & 0x0F0F0F0Fu;
        if constexpr (T == DTYPE_Q5_K) {
            v0 |= ((r.qh.x >> b) & 0x01010101u) << 4;
            v1 |= ((r.qh.y >> b) & 0x01010101u) << 4;
        }
        mq_cvt(a, v0, v1, mq_hh(1024.0f), __low2half2(dm), __high2half2(dm));
    }
}

/* The 8 activations at p as F16 pairs: the kept F16 form (H), else F32
 * converted in registers. */
template <bool H> __device__ __forceinline__ uint4 mr_act(const char *__restrict__ p) {
    if constexpr (H) {
        return __ldg((const uint4 *)p);
    } else {
        const float4 f0 = __ldg((const float4 *)p), f1 = __ldg((const float4 *)p + 1);
        return make_uint4(mq_u32(__floats2half2_rn(f0.x, f0.y)), mq_u32(__floats2half2_rn(f0.z, f0.w)),
                          mq_u32(__floats2half2_rn(f1.x, f1.y)), mq_u32(__floats2half2_rn(f1.z, f1.w)));
    }
}

/* One block's 16-row tile of T rows. */
template <int T, int NT, bool H, int W>
__device__ __forceinline__ void mr_tile(const mm_group &g, size_t row_bytes, int cols, const void *__restrict__ x,
                                        int n, fp16_t *__restrict__ out16, float4 (&red)[W][NT / 8][32]) {
    constexpr int NTL = NT / 8;
    const int warp = threadIdx.x / 32, lane = threadIdx.x % 32, g8 = lane >> 2, t = lane & 3;
    /* With swiglu, warps of the second half multiply the up weight. */
    const int ks = g.swiglu ? W / 2 : W, z = warp % ks;
    const mg_seg sg = mg_seg_locate(g, blockIdx.x);
    const uint8_t *w = g.swiglu && warp >= ks ? g.w[1] : sg.w;
    const int rows = sg.rows, row0 = ((int)blockIdx.x - sg.u0) * 16, nc = cols / 256;
    const int c0 = nc * z / ks, c1 = nc * (z + 1) / ks;
    /* Rows past the weight read row 0 (their sums are never written). */
    const uint8_t *rlo = w + (size_t)(row0 + g8 < rows ? row0 + g8 : 0) * row_bytes;
    const uint8_t *rhi = w + (size_t)(row0 + g8 + 8 < rows ? row0 + g8 + 8 : 0) * row_bytes;

    float acc[NTL][4];
#pragma unroll
    for (int nt = 0; nt < NTL; nt++) acc[nt][0] = acc[nt][1] = acc[nt][2] = acc[nt][3] = 0.0f;
    mr_raw<T> lo, hi;
    if (c0 < c1) {
        mr_load<T>(lo, rlo, cols, c0, t);
        mr_load<T>(hi, rhi, cols, c0, t);
    }
    /* The weights are no kernel's output: their first chunk is in flight
     * before the wait.  x is one's, so it is loaded after it. */
    pdl_begin();
    /* Each tile's activations from column 8 t of its token g8 (the last
     * token for tiles past n, whose sums are never written): a pointer a
     * chunk and constant offsets, so that no load computes its address or
     * waits on a bound check. */
    constexpr int XB = H ? 2 : 4; /* bytes an activation */
    const char *xa[NTL];
#pragma unroll
    for (int nt = 0; nt < NTL; nt++)
        xa[nt] = (const char *)x + ((size_t)min(nt * 8 + g8, n - 1) * cols + 8 * t) * XB;
    const auto mul = [&](const mr_raw<T> &l, const mr_raw<T> &h, int ch) {
        const char *xc[NTL];
#pragma unroll
        for (int nt = 0; nt < NTL; nt++) xc[nt] = xa[nt] + (size_t)256 * XB * ch;
#pragma unroll
        for (int b = 0; b < 8; b++) {
            uint32_t alo[4], ahi[4];
            mr_decode<T>(l, b, t, alo);
            mr_decode<T>(h, b, t, ahi);
#pragma unroll
            for (int nt = 0; nt < NTL; nt++) mq_mma32(acc[nt], alo, ahi, mr_act<H>(xc[nt] + 32 * XB * b));
        }
    };
    if constexpr (W == 16) { /* one chunk a warp: nothing to load ahead */
        if (c0 < c1) mul(lo, hi, c0);
    } else {
        mr_raw<T> nlo, nhi;
        for (int ch = c0; ch < c1; ch++) {
            if (ch + 1 < c1) { /* the next chunk's bytes in flight while this one is used */
                mr_load<T>(nlo, rlo, cols, ch + 1, t);
                mr_load<T>(nhi, rhi, cols, ch + 1, t);
            }
            mul(lo, hi, ch);
            lo = nlo;
            hi = nhi;
        }
    }
#pragma unroll
    for (int nt = 0; nt < NTL; nt++) red[warp][nt][lane] = make_float4(acc[nt][0], acc[nt][1], acc[nt][2], acc[nt][3]);
    __syncthreads();
    /* Thread i adds element i % 4 of float4 (nt, lane) over the ks warps
     * of its weight, in warp order; with swiglu both halves. */
    for (int i = threadIdx.x; i < NTL * 128; i += W * 32) {
        const int e = i & 3, l = (i >> 2) & 31, nt = i >> 7;
        float s = 0.0f, u = 0.0f;
        for (int k = 0; k < ks; k++) s += ((const float *)&red[k][nt][l])[e];
        if (g.swiglu)
            for (int k = ks; k < 2 * ks; k++) u += ((const float *)&red[k][nt][l])[e];
        /* acc[nt][e]: row g (e < 2) or g + 8, token 8 nt + 2 t + (e & 1). */
        const int tok = nt * 8 + 2 * (l & 3) + (e & 1), row = row0 + (l >> 2) + 8 * (e >> 1);
        if (tok < n && row < rows) {
            const float o = g.swiglu ? s / (1.0f + expf(-s)) * u : s;
            sg.out[(size_t)tok * rows + row] = o;
            if (out16) out16[(size_t)tok * rows + row] = f2h(o);
        }
    }
}

/* The blocks from b1 on multiply T1 rows (of row_bytes1 bytes): a Q4_K or
 * Q5_K q and k with the "_M" files' Q6_K v in one launch. */
template <int T, int NT, bool H, int W = MR_WARPS, int T1 = T>
__global__ void __launch_bounds__(W * 32, 2) /* two blocks an SM: at most 128 registers (64 at W = 16) */
matmul_mr_kernel(const mm_group g, size_t row_bytes, int cols, const void *__restrict__ x, int n,
                 fp16_t *__restrict__ out16, int b1, size_t row_bytes1) {
    __shared__ float4 red[W][NT / 8][32];
    if constexpr (T1 != T)
        if ((int)blockIdx.x >= b1) {
            mr_tile<T1, NT, H, W>(g, row_bytes1, cols, x, n, out16, red);
            return;
        }
    mr_tile<T, NT, H, W>(g, row_bytes, cols, x, n, out16, red);
}

extern "C" int cuda_matmul_mr_supports(const struct cuda_ctx *ctx, enum dtype type, int64_t cols, int32_t n) {
    /* Most tokens: 16 on the K-quants, 8 on Q8_0.  At 16 tokens mq is the
     * faster for Q8_0 (a 7B step 7.25 ms on mq, 7.78 here), this kernel
     * for the K-quants (Q4_K_M 6.38 ms here, 6.78 on mq). */
    const int most = type == DTYPE_Q8_0 ? 8 : 16;
    return ctx->mr && n >= 1 && n <= most && cols % 256 == 0 && cols <= INT32_MAX &&
           (type == DTYPE_Q8_0 || type == DTYPE_Q4_K || type == DTYPE_Q5_K || type == DTYPE_Q6_K);
}

template <int T, int NT, int T1>
static int mr_launch_nt(struct cuda_ctx *ctx, const mm_group &g, int tiles, int b1, int64_t cols, const float *x,
                        int n) {
    const size_t rb = cuda_row_bytes((enum dtype)T, cols), rb1 = cuda_row_bytes((enum dtype)T1, cols);
    /* With swiglu from 3 rows the output's F16 form too, for down to read
     * (as the swiglu kernel leaves it): in the scratch after x's F16 form,
     * which this launch reads from the scratch's start. */
    fp16_t *o16 = NULL;
    if (g.swiglu && n >= 3) {
        const size_t xb = ((size_t)n * cols * 2 + 255) & ~(size_t)255;
        uint8_t *scr = (uint8_t *)cuda_scratch(ctx, xb + (size_t)n * g.rows[0] * 2); /* a larger one forgets x's */
        if (!scr) return STATUS_NO_MEMORY;
        const void *k = cuda_act_kept(ctx, MATMUL_ACT_F16, x, n, cols);
        if (!k || k == scr) o16 = (fp16_t *)(scr + xb);
    }
    const void *x16 = cuda_act_kept(ctx, MATMUL_ACT_F16, x, n, cols);
    void (*kernel)(const mm_group, size_t, int, const void *, int, fp16_t *, int, size_t) =
        x16 ? matmul_mr_kernel<T, NT, true, MR_WARPS, T1> : matmul_mr_kernel<T, NT, false, MR_WARPS, T1>;
    int warps = MR_WARPS;
    /* Up to 8 tokens on weights of at most 16 chunks a row (4096 columns:
     * a 7B's o and v, an 8B's q/k/v and o), 16 warps a tile of one chunk
     * each: twice the warps a multiprocessor that 8 give such a grid (256
     * tiles for 4096 rows, two blocks an SM). */
    if constexpr (NT == 8)
        if (!g.swiglu && cols / 256 <= 16) {
            kernel = x16 ? matmul_mr_kernel<T, NT, true, 16, T1> : matmul_mr_kernel<T, NT, false, 16, T1>;
            warps = 16;
        }
    CUDA_CHECK(ctx, cuda_launch(ctx, kernel, dim3((unsigned)tiles), dim3(warps * 32), 0, g, rb, (int)cols,
                                x16 ? x16 : (const void *)x, n, o16, b1, rb1));
    CUDA_CHECK(ctx, cudaGetLastError());
    if (o16) cuda_act_reuse(ctx, MATMUL_ACT_F16, g.out[0], n, g.rows[0], o16); /* records it */
    return STATUS_OK;
}

/* The activations are read in the F16 form the norms, swiglu (this
 * kernel's too) and the attention leave for 3 rows and more
 * (cuda_act_kept), else as F32. */
template <int T, int T1 = T>
static int mr_launch(struct cuda_ctx *ctx, mm_group &g, int64_t cols, const float *x, int n, int seg1 = 0) {
    int tiles = 0;
    for (int s = 0; s < g.n; s++) {
        g.blk0[s] = tiles;
        tiles += g.swiglu && s == 1 ? 0 : (g.rows[s] + 15) / 16;
    }
    g.blk0[g.n] = tiles; /* with swiglu the up weight has no tiles of its own */
    const int b1 = T1 != T ? g.blk0[seg1] : tiles;
    if constexpr (T != DTYPE_Q8_0) /* Q8_0 stops at 8 tokens */
        if (n > 8) return mr_launch_nt<T, 16, T1>(ctx, g, tiles, b1, cols, x, n);
    return mr_launch_nt<T, 8, T1>(ctx, g, tiles, b1, cols, x, n);
}

/* The weights' rows and alignment as every launch here needs them. */
static bool mr_group_ok(const struct mm_group *g, const float *x) {
    if (g->n < 1 || g->n > MG_MAX || (uintptr_t)x % 16 != 0) return false;
    for (int s = 0; s < g->n; s++)
        if (g->rows[s] <= 0 || (uintptr_t)g->w[s] % 16 != 0) return false;
    return true;
}

extern "C" int cuda_matmul_mr_group(struct cuda_ctx *ctx, struct mm_group *g, enum dtype type, int64_t cols,
                                    const float *x, int32_t n) {
    if (!cuda_matmul_mr_supports(ctx, type, cols, n) || !mr_group_ok(g, x) ||
        (g->swiglu && (g->n != 2 || g->rows[0] != g->rows[1])))
        return CUDA_NOT_FUSED;
    switch (type) {
    case DTYPE_Q8_0: return mr_launch<DTYPE_Q8_0>(ctx, *g, cols, x, n);
    case DTYPE_Q4_K: return mr_launch<DTYPE_Q4_K>(ctx, *g, cols, x, n);
    case DTYPE_Q5_K: return mr_launch<DTYPE_Q5_K>(ctx, *g, cols, x, n);
    case DTYPE_Q6_K: return mr_launch<DTYPE_Q6_K>(ctx, *g, cols, x, n);
    default: return CUDA_NOT_FUSED;
    }
}

extern "C" int cuda_matmul_mr_group2(struct cuda_ctx *ctx, struct mm_group *g, enum dtype type, enum dtype type1,
                                     int seg1, int64_t cols, const float *x, int32_t n) {
    if (!ctx->mr_mixed || type1 != DTYPE_Q6_K || (type != DTYPE_Q4_K && type != DTYPE_Q5_K) || g->swiglu || seg1 < 1 ||
        seg1 >= g->n || !cuda_matmul_mr_supports(ctx, type, cols, n) || !cuda_matmul_mr_supports(ctx, type1, cols, n) ||
        !mr_group_ok(g, x))
        return CUDA_NOT_FUSED;
    return type == DTYPE_Q4_K ? mr_launch<DTYPE_Q4_K, DTYPE_Q6_K>(ctx, *g, cols, x, n, seg1)
                              : mr_launch<DTYPE_Q5_K, DTYPE_Q6_K>(ctx, *g, cols, x, n, seg1);
}

extern "C" int cuda_matmul_mr(struct cuda_ctx *ctx, float *out, const void *w, enum dtype type, int64_t rows,
                              int64_t cols, const float *x, int32_t n) {
    if (rows <= 0 || rows > INT32_MAX) return CUDA_NOT_FUSED;
    struct mm_group g = mg_single(w, out, rows);
    return cuda_matmul_mr_group(ctx, &g, type, cols, x, n);
}
