/* The stage links' element encoding on the GPU (link_codec.h): the bytes of
 * worker/link.c's link_encode and the floats of its link_decode, bit for
 * bit.  That holds because every step is exact or correctly rounded in
 * both: F16 and BF16 round to nearest even (__float2half_rn; f2bf is
 * f32_to_bf16's integer rounding), the INT8 block maximum is a max (any
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

/* INT8 block b of the wire: its first value x in the F32 rows, its count
 * nb (a row's last block may be shorter) and where its bytes start (the
 * blocks of a row LINK_CODEC_INT8_BLOCK + 2 bytes apart, rows row_bytes). */
struct lc_block {
    int64_t x, at;
    int32_t nb;
};
__device__ __forceinline__ lc_block lc_locate(int64_t b, int32_t row, int32_t row_blocks, int32_t row_bytes) {
    const int64_t r = b / row_blocks;
    const int32_t j = (int32_t)(b % row_blocks), b0 = j * LINK_CODEC_INT8_BLOCK;
    return {r * row + b0, r * row_bytes + (int64_t)j * (LINK_CODEC_INT8_BLOCK + 2),
            row - b0 < LINK_CODEC_INT8_BLOCK ? row - b0 : LINK_CODEC_INT8_BLOCK};
}

/* A warp per block of LINK_CODEC_INT8_BLOCK values (lane i its value i):
 * the block's largest magnitude, its BF16 scale's two bytes, then its int8
 * values.  Rows are row_bytes apart; a row's last block may be shorter. */
__global__ void link_encode_int8_kernel(const float *src, uint8_t *dst, int64_t n_blocks, int32_t row,
                                        int32_t row_blocks, int32_t row_bytes) {
    const int lane = threadIdx.x % 32, wpb = blockDim.x / 32;
    for (int64_t b = blockIdx.x * (int64_t)wpb + threadIdx.x / 32; b < n_blocks; b += (int64_t)gridDim.x * wpb) {
        const lc_block k = lc_locate(b, row, row_blocks, row_bytes);
        const int32_t nb = k.nb;
        const float x = lane < nb ? src[k.x + lane] : 0.0f;
        float amax = fabsf(x);
        for (int o = 16; o > 0; o >>= 1) {
            const float v = __shfl_xor_sync(0xffffffffu, amax, o);
            amax = v > amax ? v : amax;
        }
        const uint16_t sb = f2bf(__fdiv_rn(amax, 127.0f));
        const float scale = bf2f(sb), inv = scale > 0.0f ? __fdiv_rn(1.0f, scale) : 0.0f;
        uint8_t *o = dst + k.at;
        if (lane < 2) o[lane] = (uint8_t)(sb >> (8 * lane));
        if (lane < nb) {
            float q = roundf(__fmul_rn(x, inv));
            q = q > 127.0f ? 127.0f : q < -127.0f ? -127.0f : q == q ? q : 0.0f;
            o[2 + lane] = (uint8_t)(int8_t)q;
        }
    }
}

__global__ void link_decode_int8_kernel(const uint8_t *src, float *dst, int64_t n_blocks, int32_t row,
                                        int32_t row_blocks, int32_t row_bytes) {
    const int lane = threadIdx.x % 32, wpb = blockDim.x / 32;
    for (int64_t b = blockIdx.x * (int64_t)wpb + threadIdx.x / 32; b < n_blocks; b += (int64_t)gridDim.x * wpb) {
        const lc_block k = lc_locate(b, row, row_blocks, row_bytes);
        const uint8_t *in = src + k.at;
        if (lane < k.nb) dst[k.x + lane] = __fmul_rn((float)(int8_t)in[2 + lane], bf2f((uint16_t)(in[0] | in[1] << 8)));
    }
}

/* Launches an INT8 kernel over every block of n / row rows. */
template <typename S, typename D>
static void lc_int8(void (*kernel)(S, D, int64_t, int32_t, int32_t, int32_t), S src, D dst, int64_t n, size_t row,
                    cudaStream_t s) {
    const int32_t rb = (int32_t)((row + LINK_CODEC_INT8_BLOCK - 1) / LINK_CODEC_INT8_BLOCK);
    const int64_t blocks = n / (int64_t)row * rb;
    const int64_t grid = (blocks + LC_THREADS / 32 - 1) / (LC_THREADS / 32);
    kernel<<<(unsigned)(grid < 65535 ? grid : 65535), LC_THREADS, 0, s>>>(src, dst, blocks, (int32_t)row, rb,
                                                                         (int32_t)row + 2 * rb);
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
    case LINK_CODEC_INT8: lc_int8(link_encode_int8_kernel, src, (uint8_t *)dst, n, row, s); break;
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
    case LINK_CODEC_INT8: lc_int8(link_decode_int8_kernel, (const uint8_t *)src, dst, n, row, s); break;
    }
    LC_CHECK(cudaGetLastError());
    return STATUS_OK;
}
