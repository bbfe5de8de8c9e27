/* The stage links' element encoding on the GPU (link_codec.h): the bytes of
 * worker/link.c's link_encode and the floats of its link_decode, bit for
 * bit.  That holds because every step is exact or correctly rounded in
 * both: F16 and BF16 round to nearest even (__float2half_rn; f2bf is
 * f32_to_bf16's integer rounding), the INT8 row maximum is a max (any
 * order gives the same value; a NaN never wins a > comparison, on either
 * side), and the scale, its inverse, the product and the decode are single
 * IEEE operations written as __fdiv_rn / __fmul_rn so that no compiler
 * flag can turn them into approximations or fuse them; roundf rounds half
 * away from zero on both.  Only NaN payloads may differ (F16 keeps its top
 * bits on the host, the GPU writes its canonical NaN). */
#include "link_codec.h"

#include "common.cuh"

#include <stdio.h>

#define LC_THREADS 256
#define LC_ROW_MAX ((size_t)1 << 20)

/* Wraps every CUDA call here: on failure, name the call and CUDA's reason. */
#define LC_CHECK(call)                                                                             \
    do {                                                                                           \
        cudaError_t r_ = (call);                                                                   \
        if (r_ != cudaSuccess) {                                                                   \
            snprintf(err, errlen, "%s (%s:%d): %s", #call, __FILE__, __LINE__, cudaGetErrorString(r_)); \
            return STATUS_INTERNAL;                                                                \
        }                                                                                          \
    } while (0)

template <bool BF> __global__ void link_encode_half_kernel(const float *src, uint16_t *dst, int64_t n) {
    for (int64_t i = blockIdx.x * (int64_t)blockDim.x + threadIdx.x; i < n; i += (int64_t)gridDim.x * blockDim.x)
        dst[i] = BF ? f2bf(src[i]) : f2h(src[i]);
}

template <bool BF> __global__ void link_decode_half_kernel(const uint16_t *src, float *dst, int64_t n) {
    for (int64_t i = blockIdx.x * (int64_t)blockDim.x + threadIdx.x; i < n; i += (int64_t)gridDim.x * blockDim.x)
        dst[i] = BF ? bf2f(src[i]) : h2f(src[i]);
}

/* One block per row: the row's largest magnitude, then the scale's four
 * bytes and the row's int8 values (rows are row + 4 bytes apart, so the
 * scale is written bytewise). */
__global__ void link_encode_int8_kernel(const float *src, uint8_t *dst, int64_t n_rows, int32_t row) {
    __shared__ float part[LC_THREADS];
    for (int64_t r = blockIdx.x; r < n_rows; r += gridDim.x) {
        const float *x = src + r * row;
        uint8_t *o = dst + r * ((int64_t)row + 4);
        float amax = 0.0f;
        for (int32_t i = threadIdx.x; i < row; i += blockDim.x) amax = fabsf(x[i]) > amax ? fabsf(x[i]) : amax;
        part[threadIdx.x] = amax;
        __syncthreads();
        for (int s = blockDim.x / 2; s > 0; s >>= 1) {
            if ((int)threadIdx.x < s)
                part[threadIdx.x] = part[threadIdx.x + s] > part[threadIdx.x] ? part[threadIdx.x + s] : part[threadIdx.x];
            __syncthreads();
        }
        amax = part[0];
        __syncthreads(); /* part is the next row's */
        const float scale = __fdiv_rn(amax, 127.0f), inv = amax > 0.0f ? __fdiv_rn(127.0f, amax) : 0.0f;
        if (threadIdx.x < 4) o[threadIdx.x] = (uint8_t)(__float_as_uint(scale) >> (8 * threadIdx.x));
        for (int32_t i = threadIdx.x; i < row; i += blockDim.x) {
            float q = roundf(__fmul_rn(x[i], inv));
            q = q > 127.0f ? 127.0f : q < -127.0f ? -127.0f : q;
            o[4 + i] = (uint8_t)(int8_t)q;
        }
    }
}

__global__ void link_decode_int8_kernel(const uint8_t *src, float *dst, int64_t n_rows, int32_t row) {
    for (int64_t r = blockIdx.x; r < n_rows; r += gridDim.x) {
        const uint8_t *in = src + r * ((int64_t)row + 4);
        const float scale = __uint_as_float((uint32_t)in[0] | (uint32_t)in[1] << 8 | (uint32_t)in[2] << 16 |
                                            (uint32_t)in[3] << 24);
        for (int32_t i = threadIdx.x; i < row; i += blockDim.x)
            dst[r * row + i] = __fmul_rn((float)(int8_t)in[4 + i], scale);
    }
}

/* The checks both directions share: a known type, whole rows for INT8, a
 * 2-byte aligned wire buffer for F16 and BF16. */
static int lc_check(enum link_codec_type t, size_t elems, size_t row, const void *wire, const char *what,
                    char *err, size_t errlen) {
    if ((unsigned)t > LINK_CODEC_INT8) {
        snprintf(err, errlen, "link %s: element type %d is not one of enum link_codec_type", what, (int)t);
        return STATUS_BAD_INPUT;
    }
    if (t == LINK_CODEC_INT8 && (row == 0 || row >= LC_ROW_MAX || elems % row != 0)) {
        snprintf(err, errlen, "link %s: %zu values are not whole rows of %zu (1 to 2^20 - 1)", what, elems, row);
        return STATUS_BAD_INPUT;
    }
    if ((t == LINK_CODEC_F16 || t == LINK_CODEC_BF16) && ((uintptr_t)wire & 1) != 0) {
        snprintf(err, errlen, "link %s: the wire buffer %p is not 2-byte aligned", what, wire);
        return STATUS_BAD_INPUT;
    }
    return STATUS_OK;
}

static unsigned lc_row_blocks(int64_t n_rows) { return (unsigned)(n_rows < 65535 ? n_rows : 65535); }

extern "C" int link_codec_encode(void *stream, enum link_codec_type t, const float *src, size_t elems,
                                 size_t row, void *dst, char *err, size_t errlen) {
    int rc = lc_check(t, elems, row, dst, "encode", err, errlen);
    if (rc != STATUS_OK || elems == 0) return rc;
    cudaStream_t s = (cudaStream_t)stream;
    const int64_t n = (int64_t)elems;
    switch (t) {
    case LINK_CODEC_F32: LC_CHECK(cudaMemcpyAsync(dst, src, elems * sizeof(float), cudaMemcpyDeviceToDevice, s)); break;
    case LINK_CODEC_F16: link_encode_half_kernel<false><<<cuda_blocks(n, LC_THREADS), LC_THREADS, 0, s>>>(src, (uint16_t *)dst, n); break;
    case LINK_CODEC_BF16: link_encode_half_kernel<true><<<cuda_blocks(n, LC_THREADS), LC_THREADS, 0, s>>>(src, (uint16_t *)dst, n); break;
    case LINK_CODEC_INT8:
        link_encode_int8_kernel<<<lc_row_blocks(n / (int64_t)row), LC_THREADS, 0, s>>>(src, (uint8_t *)dst, n / (int64_t)row,
                                                                                        (int32_t)row);
        break;
    }
    LC_CHECK(cudaGetLastError());
    return STATUS_OK;
}

extern "C" int link_codec_decode(void *stream, enum link_codec_type t, const void *src, size_t elems, size_t row,
                                 float *dst, char *err, size_t errlen) {
    int rc = lc_check(t, elems, row, src, "decode", err, errlen);
    if (rc != STATUS_OK || elems == 0) return rc;
    cudaStream_t s = (cudaStream_t)stream;
    const int64_t n = (int64_t)elems;
    switch (t) {
    case LINK_CODEC_F32: LC_CHECK(cudaMemcpyAsync(dst, src, elems * sizeof(float), cudaMemcpyDeviceToDevice, s)); break;
    case LINK_CODEC_F16: link_decode_half_kernel<false><<<cuda_blocks(n, LC_THREADS), LC_THREADS, 0, s>>>((const uint16_t *)src, dst, n); break;
    case LINK_CODEC_BF16: link_decode_half_kernel<true><<<cuda_blocks(n, LC_THREADS), LC_THREADS, 0, s>>>((const uint16_t *)src, dst, n); break;
    case LINK_CODEC_INT8:
        link_decode_int8_kernel<<<lc_row_blocks(n / (int64_t)row), LC_THREADS, 0, s>>>((const uint8_t *)src, dst, n / (int64_t)row,
                                                                                        (int32_t)row);
        break;
    }
    LC_CHECK(cudaGetLastError());
    return STATUS_OK;
}
