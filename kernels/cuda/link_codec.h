/* The stage links' element encoding on the GPU, as plain C prototypes for
 * worker/link_nccl.c (only link_codec.cu includes the CUDA runtime).  It
 * writes the bytes worker/link.h's link_encode writes on the host, bit for
 * bit, and link_decode's floats back (tests/kernels/test_cuda_link_codec.c
 * compares them), so a row crosses an NCCL link exactly as it crosses a
 * ZeroMQ one.  Both queue on stream (a cudaStream_t of the calling
 * thread's current device) and synchronize nothing; src and dst are device
 * memory.  They return 0, or a negative status with the reason in err. */
#ifndef KERNELS_CUDA_LINK_CODEC_H
#define KERNELS_CUDA_LINK_CODEC_H

#include <stddef.h>

#ifdef __cplusplus
extern "C" {
#endif

/* Numbered as worker/link.h's enum link_dtype (link_nccl.c checks that):
 * kernels/ does not include worker/. */
enum link_codec_type {
    LINK_CODEC_F32 = 0,
    LINK_CODEC_F16 = 1,
    LINK_CODEC_BF16 = 2,
    LINK_CODEC_INT8 = 3, /* per block of a row: a BF16 scale (amax / 127), then the block's int8 */
};
#define LINK_CODEC_INT8_BLOCK 32 /* worker/link.h's LINK_INT8_BLOCK */

/* elems F32 values at src (whole rows of row_elems for INT8; rows below
 * 2^20 elements) into the wire's bytes at dst: elems * 4 (F32), elems * 2
 * (F16, BF16; dst 2-byte aligned) or elems + 2 bytes a block of 32 values
 * or fewer for INT8 (worker/link.h's link_int8_row_bytes a row). */
int link_codec_encode(void *stream, enum link_codec_type t, const float *src, size_t elems,
                      size_t row_elems, void *dst, char *err, size_t errlen);
/* The wire's bytes at src (F16 and BF16: 2-byte aligned) back to elems F32
 * values at dst. */
int link_codec_decode(void *stream, enum link_codec_type t, const void *src, size_t elems,
                      size_t row_elems, float *dst, char *err, size_t errlen);

#ifdef __cplusplus
}
#endif

#endif
