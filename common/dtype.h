/* Element types of weights and activations, with the GGML numbering used by
 * GGUF files, the quantized block layouts, and row-wise conversions to and
 * from float.  Every backend reads weights through these definitions. */
#ifndef COMMON_DTYPE_H
#define COMMON_DTYPE_H

#include <assert.h>
#include <stddef.h>
#include <stdint.h>

enum dtype {
    DTYPE_F32 = 0,
    DTYPE_F16 = 1,
    DTYPE_Q4_0 = 2,
    DTYPE_Q4_1 = 3,
    DTYPE_Q5_0 = 6,
    DTYPE_Q5_1 = 7,
    DTYPE_Q8_0 = 8,
    DTYPE_Q4_K = 12,
    DTYPE_Q5_K = 13,
    DTYPE_Q6_K = 14,
    DTYPE_BF16 = 30,
};
#define DTYPE_ID_MAX 40 /* GGUF type ids at or above this are not known here */

typedef uint16_t fp16_t; /* IEEE half, stored as bits */
typedef uint16_t bf16_t; /* bfloat16, stored as bits */

#define QK4_0 32
#define QK8_0 32
#define QK_K 256
#define K_SCALE_SIZE 12

typedef struct { fp16_t d; uint8_t qs[QK4_0 / 2]; } block_q4_0;
typedef struct { fp16_t d, m; uint8_t qs[QK4_0 / 2]; } block_q4_1;
typedef struct { fp16_t d; uint8_t qh[4]; uint8_t qs[QK4_0 / 2]; } block_q5_0;
typedef struct { fp16_t d, m; uint8_t qh[4]; uint8_t qs[QK4_0 / 2]; } block_q5_1;
typedef struct { fp16_t d; int8_t qs[QK8_0]; } block_q8_0;
typedef struct { fp16_t d, dmin; uint8_t scales[K_SCALE_SIZE]; uint8_t qs[QK_K / 2]; } block_q4_k;
typedef struct { fp16_t d, dmin; uint8_t scales[K_SCALE_SIZE]; uint8_t qh[QK_K / 8]; uint8_t qs[QK_K / 2]; } block_q5_k;
typedef struct { uint8_t ql[QK_K / 2]; uint8_t qh[QK_K / 4]; int8_t scales[QK_K / 16]; fp16_t d; } block_q6_k;

static_assert(sizeof(block_q4_0) == 18, "block_q4_0 size");
static_assert(sizeof(block_q4_1) == 20, "block_q4_1 size");
static_assert(sizeof(block_q5_0) == 22, "block_q5_0 size");
static_assert(sizeof(block_q5_1) == 24, "block_q5_1 size");
static_assert(sizeof(block_q8_0) == 34, "block_q8_0 size");
static_assert(sizeof(block_q4_k) == 144, "block_q4_k size");
static_assert(sizeof(block_q5_k) == 176, "block_q5_k size");
static_assert(sizeof(block_q6_k) == 210, "block_q6_k size");

/* 1 if this module knows the type (all of the enum above), else 0. */
int dtype_valid(int type);
/* "F32", "Q4_K", ...; "unknown" for an id dtype_valid rejects. */
const char *dtype_name(int type);
/* Elements per block (1 for F32/F16/BF16) and bytes per block. */
int64_t dtype_block_elems(enum dtype t);
size_t dtype_block_bytes(enum dtype t);
/* Bytes of a row of n elements; n must be a multiple of dtype_block_elems. */
size_t dtype_row_bytes(enum dtype t, int64_t n);

float fp16_to_f32(fp16_t h);
fp16_t f32_to_fp16(float f); /* round to nearest even */
float bf16_to_f32(bf16_t h);
bf16_t f32_to_bf16(float f); /* round to nearest even */
/* n elements at once, the same bits as the functions above element by
 * element; faster where the CPU has F16C.  The arrays need no alignment. */
void dtype_f32_to_fp16_row(const float *src, fp16_t *dst, size_t n);
void dtype_fp16_to_f32_row(const fp16_t *src, float *dst, size_t n);

/* dst[0..n) = row src of type t, n a multiple of the block size. */
void dtype_dequant_row(enum dtype t, const void *src, float *dst, int64_t n);
/* Quantize one row; supported for F32, F16, BF16, Q8_0, Q4_0, Q4_K, Q5_K, Q6_K.
 * Returns STATUS_UNSUPPORTED for other types, STATUS_BAD_INPUT if n is not a
 * multiple of the block size. */
int dtype_quant_row(enum dtype t, const float *src, void *dst, int64_t n);

#endif
