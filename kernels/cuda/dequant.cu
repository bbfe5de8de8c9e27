/* Dequantize weight rows of any type to F16: the tiles that the cuBLAS
 * path of matmul multiplies (one tile at a time, so no second full copy of
 * a weight ever exists). */
#include "quant_units.cuh"

/* One thread per unit of quant_units.cuh: coalesced reads of the codes,
 * 8- or 16-byte stores of the F16 runs. */
template <int T>
__global__ void dequant_f16_kernel(fp16_t *dst, const uint8_t *w, size_t row_bytes, int64_t rows, int64_t cols) {
    constexpr int RUNS = qu_shape<T>::runs, RLEN = qu_shape<T>::rlen;
    int64_t units = qu_units<T>(cols), total = rows * units;
    for (int64_t id = blockIdx.x * (int64_t)blockDim.x + threadIdx.x; id < total;
         id += (int64_t)gridDim.x * blockDim.x) {
        int64_t r = id / units, u = id % units;
        float wv[RUNS * RLEN];
        qu_load<T>(w + (size_t)r * row_bytes, u, wv);
#pragma unroll
        for (int k = 0; k < RUNS; k++) {
            __half2 h[RLEN / 2];
#pragma unroll
            for (int e = 0; e < RLEN / 2; e++) h[e] = __floats2half2_rn(wv[k * RLEN + 2 * e], wv[k * RLEN + 2 * e + 1]);
            fp16_t *o = dst + r * cols + qu_off<T>(u, k);
            if constexpr (RLEN == 8) *(uint4 *)o = *(const uint4 *)h;
            else *(uint2 *)o = *(const uint2 *)h;
        }
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
        dst[id] = f2h(dq_elem<T>(w + (size_t)r * row_bytes, c));
    }
}

template <int T>
static int dequant_launch(struct cuda_ctx *ctx, uint16_t *dst, const void *w, int64_t r0, int64_t rows,
                          int64_t cols) {
    size_t rb = cuda_row_bytes((enum dtype)T, cols);
    const uint8_t *src = (const uint8_t *)w + (size_t)r0 * rb;
    /* Vector stores need 16-byte aligned rows (cols % 8) and whole units;
     * vector loads need 16-byte aligned float rows, 4-byte aligned blocks. */
    constexpr int UE = qu_shape<T>::runs * qu_shape<T>::rlen;
    constexpr uintptr_t ALIGN = (T == DTYPE_F32 || T == DTYPE_F16 || T == DTYPE_BF16) ? 16 : 4;
    if (cols % 8 == 0 && cols % UE == 0 && (uintptr_t)src % ALIGN == 0)
        dequant_f16_kernel<T><<<cuda_blocks(rows * qu_units<T>(cols), 256), 256, 0, CUDA_STREAM(ctx)>>>(dst, src, rb,
                                                                                                     rows, cols);
    else
        dequant_f16_odd_kernel<T><<<cuda_blocks(rows * cols, 256), 256, 0, CUDA_STREAM(ctx)>>>(dst, src, rb, rows,
                                                                                             cols);
    CUDA_CHECK(ctx, cudaGetLastError());
    return STATUS_OK;
}

extern "C" int cuda_dequant_f16(struct cuda_ctx *ctx, uint16_t *dst, const void *w, enum dtype type, int64_t r0,
                                int64_t rows, int64_t cols) {
    if (r0 < 0 || rows <= 0 || cols <= 0)
        return cuda_fail(ctx, STATUS_BAD_INPUT, "dequant: rows %lld + %lld of width %lld", (long long)r0,
                         (long long)rows, (long long)cols);
    CUDA_DTYPE_DISPATCH(ctx, type, dequant_launch, ctx, dst, w, r0, rows, cols);
}
