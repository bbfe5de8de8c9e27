/* Dequantize weight rows of any type to F16: the tiles that the cuBLAS
 * path of matmul multiplies (one tile at a time, so no second full copy of
 * a weight ever exists). */
#include "quant_units.cuh"

/* The pass is bound by its F16 writes (2 bytes per weight against 0.56-1.06
 * read), so every thread writes whole 16-byte runs of 8 halves, and the
 * index math is 32-bit with no division: blockIdx.y walks rows, x the
 * units of a row. */

/* 8 floats -> 8 halves in one 16-byte store (dst 16-byte aligned). */
__device__ __forceinline__ void dq_store8(fp16_t *dst, const float *v) {
    __half2 h[4];
#pragma unroll
    for (int e = 0; e < 4; e++) h[e] = __floats2half2_rn(v[2 * e], v[2 * e + 1]);
    *(uint4 *)dst = *(const uint4 *)h;
}

__device__ __forceinline__ uint32_t dq_byte(uint32_t v, int i) { return (v >> (8 * i)) & 0xffu; }

/* Elements per thread of the fast kernels; 0: the type takes the
 * quant_units.cuh layout (dq_unit_generic). */
template <int T> struct dq_fast { static constexpr int ept = 0; };
/* Q4_K/Q5_K: 16 units per super-block, unit (p, j) = code bytes 32p + 8j
 * .. + 7: elements 64p + 8j .. + 7 (low nibbles) and 64p + 32 + 8j .. + 7
 * (high), sub-blocks 2p and 2p + 1. */
template <> struct dq_fast<DTYPE_Q4_K> { static constexpr int ept = 16; };
template <> struct dq_fast<DTYPE_Q5_K> { static constexpr int ept = 16; };
/* Q6_K: 8 units per super-block, unit (h, j) = elements 128h + 32k + 8j ..
 * + 7 for k < 4. */
template <> struct dq_fast<DTYPE_Q6_K> { static constexpr int ept = 32; };
/* Q8_0: 2 units per block of 32, 16 elements each. */
template <> struct dq_fast<DTYPE_Q8_0> { static constexpr int ept = 16; };

/* Scale and min of sub-block 2p + s of a K-quant block whose 12 scale
 * bytes are the words s0, s1, s2 (kq_scale_min in registers: no local
 * array indexed by p). */
__device__ __forceinline__ void dq_kq_scale(uint32_t s0, uint32_t s1, uint32_t s2, int p, int s, float *sc,
                                            float *mn) {
    int j = 2 * p + s, b = j & 3;
    uint32_t a = dq_byte(s0, b), c = dq_byte(s1, b), e = dq_byte(s2, b);
    if (j < 4) {
        *sc = (float)(a & 63);
        *mn = (float)(c & 63);
    } else {
        *sc = (float)((e & 0xF) | ((a >> 6) << 4));
        *mn = (float)((e >> 4) | ((c >> 6) << 4));
    }
}

/* Unit u of row wr (cols wide) into row dst (the fast layouts above). */
template <int T> __device__ __forceinline__ void dq_unit_fast(const uint8_t *wr, int u, fp16_t *dst, int cols) {
    if constexpr (T == DTYPE_Q4_K || T == DTYPE_Q5_K) {
        constexpr int BS = T == DTYPE_Q4_K ? sizeof(block_q4_k) : sizeof(block_q5_k);
        constexpr int QS = T == DTYPE_Q4_K ? 16 : 48; /* offset of qs: after d, dmin, scales (, qh) */
        int sb = u >> 4, p = (u >> 2) & 3, j = u & 3;
        const uint8_t *b = wr + sb * BS; /* blocks of 144/176 bytes from a 16-byte aligned row */
        uint4 hd = __ldg((const uint4 *)b); /* d, dmin, scales[12] */
        float d = __half2float(__ushort_as_half((uint16_t)(hd.x & 0xffff)));
        float dmin = __half2float(__ushort_as_half((uint16_t)(hd.x >> 16)));
        float sc1, m1, sc2, m2;
        dq_kq_scale(hd.y, hd.z, hd.w, p, 0, &sc1, &m1);
        dq_kq_scale(hd.y, hd.z, hd.w, p, 1, &sc2, &m2);
        float d1 = d * sc1, d2 = d * sc2, o1 = dmin * m1, o2 = dmin * m2;
        uint2 q = __ldg((const uint2 *)(b + QS + 32 * p + 8 * j));
        uint2 qh = make_uint2(0, 0);
        if constexpr (T == DTYPE_Q5_K) qh = __ldg((const uint2 *)(b + 16 + 8 * j));
        float lo[8], hi[8];
#pragma unroll
        for (int e = 0; e < 8; e++) {
            uint32_t c = dq_byte(e < 4 ? q.x : q.y, e & 3);
            uint32_t l = c & 0xF, h = c >> 4;
            if constexpr (T == DTYPE_Q5_K) {
                uint32_t x = dq_byte(e < 4 ? qh.x : qh.y, e & 3);
                l |= ((x >> (2 * p)) & 1u) << 4;
                h |= ((x >> (2 * p + 1)) & 1u) << 4;
            }
            lo[e] = d1 * (float)l - o1;
            hi[e] = d2 * (float)h - o2;
        }
        fp16_t *o = dst + sb * 256 + 64 * p + 8 * j;
        dq_store8(o, lo);
        dq_store8(o + 32, hi);
    } else if constexpr (T == DTYPE_Q6_K) {
        int sb = u >> 3, h = (u >> 2) & 1, j = u & 3;
        /* The regrouped layout (common.cuh): every array 8-byte aligned here. */
        float d = h2f(__ldg((const fp16_t *)(wr + q6s_d_off(cols)) + sb));
        uint2 qa = __ldg((const uint2 *)(wr + 128 * sb + 64 * h + 8 * j));
        uint2 qc = __ldg((const uint2 *)(wr + 128 * sb + 64 * h + 32 + 8 * j));
        uint2 qx = __ldg((const uint2 *)(wr + q6s_qh_off(cols) + 64 * sb + 32 * h + 8 * j));
        uint32_t a[2] = {qa.x, qa.y}, c[2] = {qc.x, qc.y}, x[2] = {qx.x, qx.y};
        const int8_t *sc = (const int8_t *)(wr + q6s_sc_off(cols)) + 16 * sb + 8 * h + (j >> 1);
        float s[4];
#pragma unroll
        for (int k = 0; k < 4; k++) s[k] = d * (float)__ldg(sc + 2 * k);
        float v[4][8];
#pragma unroll
        for (int e = 0; e < 8; e++) {
            int ab = (int)dq_byte(a[e >> 2], e & 3), cb = (int)dq_byte(c[e >> 2], e & 3);
            int xb = (int)dq_byte(x[e >> 2], e & 3);
            v[0][e] = s[0] * (float)(((ab & 0xF) | ((xb & 3) << 4)) - 32);
            v[1][e] = s[1] * (float)(((cb & 0xF) | (((xb >> 2) & 3) << 4)) - 32);
            v[2][e] = s[2] * (float)(((ab >> 4) | (((xb >> 4) & 3) << 4)) - 32);
            v[3][e] = s[3] * (float)(((cb >> 4) | (((xb >> 6) & 3) << 4)) - 32);
        }
        fp16_t *o = dst + sb * 256 + 128 * h + 8 * j;
#pragma unroll
        for (int k = 0; k < 4; k++) dq_store8(o + 32 * k, v[k]);
    } else if constexpr (T == DTYPE_Q8_0) {
        float d = h2f(__ldg((const fp16_t *)(wr + q8s_d_off(cols)) + (u >> 1)));
        uint4 q4 = __ldg((const uint4 *)wr + u); /* codes of a 16-byte aligned row */
        const uint32_t q[4] = {q4.x, q4.y, q4.z, q4.w};
        float v[16];
#pragma unroll
        for (int w = 0; w < 4; w++) {
#pragma unroll
            for (int e = 0; e < 4; e++) v[4 * w + e] = d * (float)(int8_t)dq_byte(q[w], e);
        }
        fp16_t *o = dst + 16 * u;
        dq_store8(o, v);
        dq_store8(o + 8, v + 8);
    }
}

/* Unit u of quant_units.cuh (runs of 4 or 8 elements: 8- or 16-byte
 * stores), for the types without a fast layout. */
template <int T> __device__ __forceinline__ void dq_unit_generic(const uint8_t *wr, int u, fp16_t *dst, int cols) {
    constexpr int RUNS = qu_shape<T>::runs, RLEN = qu_shape<T>::rlen;
    float wv[RUNS * RLEN];
    qu_load<T>(wr, u, wv, cols);
#pragma unroll
    for (int k = 0; k < RUNS; k++) {
        __half2 h[RLEN / 2];
#pragma unroll
        for (int e = 0; e < RLEN / 2; e++) h[e] = __floats2half2_rn(wv[k * RLEN + 2 * e], wv[k * RLEN + 2 * e + 1]);
        fp16_t *o = dst + qu_off<T>(u, k);
        if constexpr (RLEN == 8) *(uint4 *)o = *(const uint4 *)h;
        else *(uint2 *)o = *(const uint2 *)h;
    }
}

/* Thread (x, row y) of the grid: unit x of rows y, y + gridDim.y, ... */
template <int T, bool FAST>
__global__ void dequant_f16_kernel(fp16_t *dst, const uint8_t *w, size_t row_bytes, int rows, int cols, int units) {
    int u = blockIdx.x * blockDim.x + threadIdx.x;
    if (u >= units) return;
    for (int r = blockIdx.y; r < rows; r += gridDim.y) {
        if constexpr (FAST) dq_unit_fast<T>(w + (size_t)r * row_bytes, u, dst + (size_t)r * cols, cols);
        else dq_unit_generic<T>(w + (size_t)r * row_bytes, u, dst + (size_t)r * cols, cols);
    }
}

/* Widths the unit layout cannot cut (odd F32/F16/BF16 rows): one element
 * per thread. */
template <int T>
__global__ void dequant_f16_odd_kernel(fp16_t *dst, const uint8_t *w, size_t row_bytes, int64_t rows, int64_t cols) {
    int64_t total = rows * cols;
    for (int64_t id = blockIdx.x * (int64_t)blockDim.x + threadIdx.x; id < total;
         id += (int64_t)gridDim.x * blockDim.x) {
        int64_t r = id / cols, c = id % cols;
        dst[id] = f2h(dq_elem<T>(w + (size_t)r * row_bytes, c, cols));
    }
}

/* Launch of dequant_f16_kernel: blocks of up to 256 threads along a row's
 * units (fewer for narrow rows), one grid row per weight row up to 65535. */
template <int T, bool FAST>
static void dequant_launch_units(struct cuda_ctx *ctx, fp16_t *dst, const uint8_t *src, size_t rb, int rows, int cols,
                                 int units) {
    int threads = units < 256 ? (units + 31) / 32 * 32 : 256;
    dim3 grid((unsigned)((units + threads - 1) / threads), (unsigned)(rows < 65535 ? rows : 65535));
    dequant_f16_kernel<T, FAST><<<grid, threads, 0, CUDA_STREAM(ctx)>>>(dst, src, rb, rows, cols, units);
}

template <int T>
static int dequant_launch(struct cuda_ctx *ctx, uint16_t *dst, const void *w, int64_t r0, int64_t rows,
                          int64_t cols) {
    size_t rb = cuda_row_bytes((enum dtype)T, cols);
    const uint8_t *src = (const uint8_t *)w + (size_t)r0 * rb;
    /* Vector stores need 16-byte aligned rows (cols % 8) and whole units;
     * vector loads need 16-byte aligned float rows, 4-byte aligned blocks
     * (16-byte for the K-quant headers of the fast layout). */
    constexpr int UE = qu_shape<T>::runs * qu_shape<T>::rlen, FE = dq_fast<T>::ept;
    constexpr uintptr_t ALIGN = (T == DTYPE_F32 || T == DTYPE_F16 || T == DTYPE_BF16) ? 16 : 4;
    constexpr uintptr_t FALIGN = 16; /* K-quant headers; the regrouped Q8_0 / Q6_K arrays */
    bool fast = false;
    if constexpr (FE > 0) {
        fast = cols % FE == 0 && (uintptr_t)src % FALIGN == 0 && (uintptr_t)dst % 16 == 0;
        if (fast) dequant_launch_units<T, true>(ctx, dst, src, rb, (int)rows, (int)cols, (int)(cols / FE));
    }
    if (!fast && cols % 8 == 0 && cols % UE == 0 && (uintptr_t)src % ALIGN == 0 && (uintptr_t)dst % 16 == 0)
        dequant_launch_units<T, false>(ctx, dst, src, rb, (int)rows, (int)cols, (int)qu_units<T>(cols));
    else if (!fast)
        dequant_f16_odd_kernel<T><<<cuda_blocks(rows * cols, 256), 256, 0, CUDA_STREAM(ctx)>>>(dst, src, rb, rows,
                                                                                             cols);
    CUDA_CHECK(ctx, cudaGetLastError());
    return STATUS_OK;
}

extern "C" int cuda_dequant_f16(struct cuda_ctx *ctx, uint16_t *dst, const void *w, enum dtype type, int64_t r0,
                                int64_t rows, int64_t cols) {
    /* 32-bit index math in the kernels: a row and a row count fit an int. */
    if (r0 < 0 || rows <= 0 || cols <= 0 || rows > INT32_MAX || cols > INT32_MAX)
        return cuda_fail(ctx, STATUS_BAD_INPUT, "dequant: rows %lld + %lld of width %lld", (long long)r0,
                         (long long)rows, (long long)cols);
    CUDA_DTYPE_DISPATCH(ctx, type, dequant_launch, ctx, dst, w, r0, rows, cols);
}
