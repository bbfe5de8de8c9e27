/* Internals of the CPU backend (kernels/cpu): the backend struct, the
 * persistent thread pool, and the per-dtype row kernels (dequantize, dot
 * product) that the ops are built from.  Only kernels/cpu includes this. */
#ifndef KERNELS_CPU_CPU_H
#define KERNELS_CPU_CPU_H

#include <stdatomic.h>
#include <stddef.h>
#include <stdint.h>

#include "../backend-impl.h"

/* A pause for spin-wait loops. */
#if defined(__x86_64__) || defined(__i386__)
#include <immintrin.h>
#define CPU_RELAX() _mm_pause()
#else
#define CPU_RELAX() ((void)0)
#endif

/* ---- Thread pool ----
 * n_threads - 1 workers live from cpu_pool_init to cpu_pool_free; the
 * calling thread is thread 0 of every job.  Workers spin briefly after a
 * job (decode runs hundreds of small jobs per token) and then sleep on a
 * condition variable, so an idle backend costs no CPU. */
struct cpu_pool;
/* fn(arg, ith, nth) runs on the caller as ith 0 and on each worker ith < nth
 * that wakes before the caller's call returns, concurrently.  So fn must
 * take its work from a shared counter, never by ith, and the caller's call
 * alone must be able to finish the job; ith only indexes per-thread scratch. */
typedef void (*cpu_task_fn)(void *arg, int ith, int nth);

/* Returns NULL when threads cannot be created. */
struct cpu_pool *cpu_pool_init(int n_threads);
void cpu_pool_free(struct cpu_pool *p);
int cpu_pool_threads(const struct cpu_pool *p);
/* Runs fn on up to min(nth, pool size) threads (nth <= 0: all) and returns
 * when every call has returned.  Not reentrant: one caller thread at a time. */
void cpu_pool_run(struct cpu_pool *p, cpu_task_fn fn, void *arg, int nth);

/* ---- The backend ---- */
struct backend_cpu {
    struct backend base; /* first: the handle the public API passes around */
    struct cpu_pool *pool;
    int n_threads;
    char name[32];
    /* Scratch for the ops (quantized activations, attention scores); grown
     * when an op needs more, which happens only for the first large batch. */
    void *scratch;
    size_t scratch_bytes;
};

/* Returns scratch of at least bytes (64-byte aligned), or NULL after
 * recording the failure in b->errstr. */
void *cpu_scratch(struct backend_cpu *b, size_t bytes);

/* ---- Element conversions ---- */
extern float cpu_fp16_table[65536]; /* fp16 bits -> float, filled by cpu_kernels_init */
static inline float cpu_fp16_to_f32(uint16_t h) { return cpu_fp16_table[h]; }
uint16_t cpu_f32_to_fp16(float f); /* round to nearest even */
static inline float cpu_bf16_to_f32(uint16_t h) {
    union { uint32_t u; float f; } v = {(uint32_t)h << 16};
    return v.f;
}
uint16_t cpu_f32_to_bf16(float f); /* round to nearest even */

/* ---- Row kernels ----
 * Matmul reads quantized weights without dequantizing whole rows: the
 * activation row is quantized once per call to 8-bit blocks (cpu_q8 for the
 * 32-element types, cpu_q8k for the K-quants, as llama.cpp does) and each
 * weight block is dotted against it with integer arithmetic.  F32, F16 and
 * BF16 weights are dotted against the float activations directly. */
struct cpu_q8 {   /* 32 activations: x[i] ~= d * qs[i] */
    float d;
    float s;      /* d * sum(qs), for the types with a min (Q4_1, Q5_1) */
    int8_t qs[32];
};
struct cpu_q8k {  /* 256 activations: x[i] ~= d * qs[i] */
    float d;
    int16_t bsums[16]; /* sums of qs over each group of 16 */
    int8_t qs[256];
};

/* Which activation format a weight type dots against. */
enum cpu_act { CPU_ACT_F32, CPU_ACT_Q8, CPU_ACT_Q8K };

/* out = sum_i w[i] * x[i] over one weight row of n elements, x in the
 * activation format of the weight type. */
typedef float (*cpu_dot_fn)(const void *w, const void *x, int64_t n);

/* out[j] = dot(w, x + j * x_stride bytes) for j < 4: one weight row against
 * four activation rows, decoding each weight block once (prefill). */
typedef void (*cpu_dot4_fn)(const void *w, const void *x, size_t x_stride, int64_t n, float *out);

/* out[j] = dot(w, x + j * x_stride bytes) for j < nt, nt 3 or 5: token
 * counts dot4 leaves, in one pass over the weight row. */
typedef void (*cpu_dotn_fn)(const void *w, const void *x, size_t x_stride, int64_t n, int nt, float *out);

/* o0[j] = dot(w0, x + j * x_stride bytes) and o1[j] = dot(w1, ...) for
 * j < nt, nt 1 to 5: two weight rows in one pass, each activation load
 * shared by both. */
typedef void (*cpu_dot2n_fn)(const void *w0, const void *w1, const void *x, size_t x_stride, int64_t n, int nt,
                             float *o0, float *o1);

/* y[0..n) += a * x[0..n), x of an F32 or F16 row (attention's V sums). */
typedef void (*cpu_axpy_fn)(float *y, float a, const void *x, int64_t n);

/* Attention over one query row's n positions of an F32 or F16 cache:
 * out[j] = dot(krows[j], q) over hd elements, each as cpu_dot_fn gives it;
 * acc[0..hd) += s[j] * vrows[j] for j in order, each element as n calls of
 * cpu_axpy_fn give it. */
typedef void (*cpu_attn_qk_fn)(float *out, const void *const *krows, int32_t n, const float *q, int64_t hd);
typedef void (*cpu_attn_v_fn)(float *acc, const float *s, const void *const *vrows, int32_t n, int64_t hd);

struct cpu_type_traits {
    int64_t block_elems;
    size_t block_bytes;
    enum cpu_act act;
    cpu_dot_fn dot;   /* the fastest variant this CPU supports */
    cpu_dot4_fn dot4; /* NULL: matmul calls dot four times */
    cpu_dotn_fn dotn; /* NULL: matmul calls dot4 and dot */
    cpu_dot2n_fn dot2n; /* NULL: matmul takes its rows one at a time */
    cpu_axpy_fn axpy; /* F32 and F16 only, else NULL */
    cpu_attn_qk_fn attn_qk; /* F32 and F16 with AVX2, else NULL: dot and axpy per position */
    cpu_attn_v_fn attn_v;
};

/* Fills the fp16 table and picks the kernel variants; idempotent and
 * thread-safe. */
void cpu_kernels_init(void);
/* NULL for a type the backend does not know. */
const struct cpu_type_traits *cpu_type_traits(enum dtype t);
/* Bytes of one activation row of n elements in format act. */
size_t cpu_act_row_bytes(enum cpu_act act, int64_t n);
/* Quantize one activation row of n elements (a multiple of 32 for Q8, of
 * 256 for Q8K) into dst: d = amax / 127, q = x * (127 / amax) rounded half
 * away from zero.  The AVX2 variant gives the same bytes. */
void cpu_act_quant_row(enum cpu_act act, const float *x, void *dst, int64_t n);
typedef void (*cpu_act_quant_fn)(enum cpu_act act, const float *x, void *dst, int64_t n);
void cpu_act_quant_row_scalar(enum cpu_act act, const float *x, void *dst, int64_t n);
void cpu_act_quant_row_avx2(enum cpu_act act, const float *x, void *dst, int64_t n); /* needs cpu_has_avx2() */
/* dst[0..n) = the weight row src of type t as floats. */
void cpu_dequant_row(enum dtype t, const void *src, float *dst, int64_t n);

/* The portable kernels, also used by tests of the vector variants. */
cpu_dot_fn cpu_dot_scalar(enum dtype t);
cpu_axpy_fn cpu_axpy_scalar(enum dtype t);
/* The AVX2+FMA+F16C kernel of a type, or NULL (type without one, or a build
 * that is not x86-64). */
cpu_dot_fn cpu_dot_avx2(enum dtype t);
cpu_dot4_fn cpu_dot4_avx2(enum dtype t);
cpu_dotn_fn cpu_dotn_avx2(enum dtype t);
cpu_attn_qk_fn cpu_attn_qk_avx2(enum dtype t);
cpu_attn_v_fn cpu_attn_v_avx2(enum dtype t);
cpu_axpy_fn cpu_axpy_avx2(enum dtype t);
int cpu_has_avx2(void);
/* The two-row kernel of a type on AVX-512VL (quant_avx512.c), or NULL. */
cpu_dot2n_fn cpu_dot2n_avx512vl(enum dtype t);
int cpu_has_avx512vl(void);


/* ---- Ops (the table entries) ---- */
int cpu_matmul(backend *b, float *out, const struct backend_weight *w, const float *x, int32_t n);
int cpu_kv_write(backend *b, struct backend_kv *kv, const float *k, const float *v,
                 const int32_t *slots, int32_t n);
int cpu_attention(backend *b, float *out, const float *q, const struct backend_kv *kv,
                  const struct backend_attn_batch *batch, int32_t n_heads, float scale);
int cpu_embed(backend *b, float *out, const struct backend_weight *w, const int32_t *ids, int32_t n);
int cpu_rmsnorm(backend *b, float *out, const float *x, const float *w, int32_t n, int32_t dim, float eps);
int cpu_add_rmsnorm(backend *b, float *x, const float *delta, float *out, const float *w,
                    int32_t n, int32_t dim, float eps);
int cpu_add(backend *b, float *x, const float *y, int64_t n);
int cpu_rope(backend *b, float *x, const int32_t *pos, int32_t n, int32_t n_heads,
             int32_t head_dim, const float *inv_freq, int32_t n_freq, int neox);
int cpu_swiglu(backend *b, float *out, const float *gate, const float *up, int64_t n);
int cpu_get_rows(backend *b, float *out, const float *x, const int32_t *idx, int32_t n, int32_t dim);
int cpu_convert(backend *b, void *dst, enum dtype dst_type, const void *src,
                enum dtype src_type, int64_t n);

#endif
