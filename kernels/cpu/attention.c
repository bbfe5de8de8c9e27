/* Paged KV cache writes (F32, F16, or Q8_0 quantized on write) and causal
 * grouped-query attention on the CPU backend.  Attention threads take (sequence, head) pairs from a shared
 * counter; each computes, for every query row of its sequence, the scores
 * against positions 0..p, a max-subtracted softmax, and the weighted sum of
 * V, with per-thread score buffers from the backend's scratch (F32 and F16
 * caches through the AVX2 row kernels, cpu_attn_qk_fn / cpu_attn_v_fn). */
#include "cpu.h"

#include <math.h>
#include <string.h>

#include "../../common/status.h"

/* ---- Q8_0 rows ----
 * An 8-bit cache row is head_dim / g groups (g = backend_kv_q8_group): an
 * F16 scale, then g int8.  Attention dots it against the float query and
 * adds it into the float accumulator a group at a time, the scale applied
 * once per group: the query and the sums stay F32, so the cache's own
 * rounding is the only error the 8-bit cache adds. */

static void quant_q8_row(const float *x, uint8_t *row, int64_t n, int g) {
    for (int64_t i = 0; i < n / g; i++, row += g + 2, x += g) {
        float amax = 0;
        for (int j = 0; j < g; j++) amax = fmaxf(amax, fabsf(x[j]));
        /* Round against the stored F16 scale, as dtype_quant_row does. */
        uint16_t dh = cpu_f32_to_fp16(amax / 127.0f);
        float d = cpu_fp16_to_f32(dh), id = d > 0 ? 1.0f / d : 0.0f;
        memcpy(row, &dh, 2);
        int8_t *qs = (int8_t *)(row + 2);
        for (int j = 0; j < g; j++) {
            long q = lrintf(x[j] * id);
            qs[j] = (int8_t)(q > 127 ? 127 : q < -127 ? -127 : q);
        }
    }
}

static inline float q8_scale(const uint8_t *group) {
    uint16_t h;
    memcpy(&h, group, 2);
    return cpu_fp16_to_f32(h);
}

static float dot_q8_row(const uint8_t *row, const float *x, int64_t n, int g) {
    float sum = 0;
    for (int64_t i = 0; i < n / g; i++, row += g + 2, x += g) {
        const int8_t *qs = (const int8_t *)(row + 2);
        float s = 0;
        for (int j = 0; j < g; j++) s += (float)qs[j] * x[j];
        sum += s * q8_scale(row);
    }
    return sum;
}

static void axpy_q8_row(float *y, float a, const uint8_t *row, int64_t n, int g) {
    for (int64_t i = 0; i < n / g; i++, row += g + 2, y += g) {
        const int8_t *qs = (const int8_t *)(row + 2);
        float ad = a * q8_scale(row);
        for (int j = 0; j < g; j++) y[j] += ad * (float)qs[j];
    }
}

/* ---- kv_write ---- */

int cpu_kv_write(backend *b_, struct backend_kv *kv, const float *k, const float *v, const int32_t *slots,
                 int32_t n) {
    int64_t n_slots = (int64_t)kv->n_blocks * kv->block_size;
    int64_t hd = kv->head_dim, width = (int64_t)kv->n_kv_heads * hd;
    for (int32_t i = 0; i < n; i++)
        if (slots[i] < 0 || slots[i] >= n_slots)
            return backend_fail(b_, STATUS_BAD_INPUT, "kv_write: slot %d of row %d is outside 0..%lld", slots[i],
                                i, (long long)n_slots - 1);
    for (int32_t i = 0; i < n; i++) {
        int64_t blk = slots[i] / kv->block_size, off = slots[i] % kv->block_size;
        for (int32_t h = 0; h < kv->n_kv_heads; h++) {
            /* [block][kv head][offset][dim] */
            int64_t dst = ((blk * kv->n_kv_heads + h) * kv->block_size + off) * hd;
            const float *ks = k + i * width + h * hd, *vs = v + i * width + h * hd;
            if (kv->type == DTYPE_Q8_0) {
                /* dst counts elements: dst / hd is the row. */
                size_t rb = backend_kv_row_bytes(DTYPE_Q8_0, kv->head_dim), at = (size_t)(dst / hd) * rb;
                int g = backend_kv_q8_group(kv->head_dim);
                quant_q8_row(ks, (uint8_t *)kv->k + at, hd, g);
                quant_q8_row(vs, (uint8_t *)kv->v + at, hd, g);
            } else if (kv->type == DTYPE_F32) {
                memcpy((float *)kv->k + dst, ks, (size_t)hd * sizeof(float));
                memcpy((float *)kv->v + dst, vs, (size_t)hd * sizeof(float));
            } else {
                uint16_t *kd = (uint16_t *)kv->k + dst, *vd = (uint16_t *)kv->v + dst;
                for (int64_t d = 0; d < hd; d++) {
                    kd[d] = cpu_f32_to_fp16(ks[d]);
                    vd[d] = cpu_f32_to_fp16(vs[d]);
                }
            }
        }
    }
    return STATUS_OK;
}

/* ---- attention ---- */

/* Query rows of one sequence whose attention goes through the row kernels
 * together, and the positions of a tile: each tile's K rows (then V rows)
 * are read into L1 once for all of those rows (a verifying step's k + 1, a
 * prefill chunk's rows) instead of once a row from L2 or memory.  Every
 * row's arithmetic is what it is alone: a score is one dot, and the V sum
 * of each element goes through the positions in order, tile after tile. */
#define ATTN_ROWS 8
#define ATTN_TILE 32

struct attn_task {
    float *out;
    const float *q;
    const struct backend_kv *kv;
    const struct backend_attn_batch *batch;
    int32_t n_heads;
    float scale;
    float *scratch;         /* per thread: scores[ATTN_ROWS][max_ctx], acc[ATTN_ROWS][head_dim], K and V row
                             * pointers[max_ctx] */
    size_t scratch_floats;  /* per thread */
    size_t ptr_off;         /* floats from a thread's scratch to its pointers */
    atomic_long next;
};

/* The softmax of one row's n scores in place (scaled, less their max,
 * exponentiated); returns their sum. */
static float attn_softmax(float *scores, int32_t n, float scale) {
    float mx = -INFINITY;
    for (int32_t j = 0; j < n; j++) {
        scores[j] *= scale;
        if (scores[j] > mx) mx = scores[j];
    }
    float sum = 0;
    for (int32_t j = 0; j < n; j++) {
        scores[j] = expf(scores[j] - mx);
        sum += scores[j];
    }
    return sum;
}

/* Rows r0 .. r0 + nr - 1 (nr <= ATTN_ROWS) of sequence s, head h, through
 * the row kernels of an F32 or F16 cache, the positions tile by tile. */
static void attn_rows(const struct attn_task *t, const struct cpu_type_traits *tr, int32_t s, int32_t h, int32_t r0,
                      int32_t nr, float *scores, float *acc, const void **krows, const void **vrows) {
    const struct backend_attn_batch *ba = t->batch;
    const int64_t hd = t->kv->head_dim, width = (int64_t)t->n_heads * hd, mc = ba->max_ctx;
    const int32_t n0 = ba->seq_pos0[s] + (r0 - ba->seq_tok0[s]) + 1; /* row r0's positions; row i has i more */
    const int32_t n_last = n0 + nr - 1;
    for (int32_t j0 = 0; j0 < n_last; j0 += ATTN_TILE)
        for (int32_t i = j0 < n0 ? 0 : j0 - n0 + 1; i < nr; i++) { /* the rows that reach j0 */
            int32_t n = n0 + i - j0 < ATTN_TILE ? n0 + i - j0 : ATTN_TILE;
            tr->attn_qk(scores + i * mc + j0, krows + j0, n, t->q + (r0 + i) * width + h * hd, hd);
        }
    float sum[ATTN_ROWS];
    for (int32_t i = 0; i < nr; i++) sum[i] = attn_softmax(scores + i * mc, n0 + i, t->scale);
    memset(acc, 0, (size_t)nr * (size_t)hd * sizeof(float));
    for (int32_t j0 = 0; j0 < n_last; j0 += ATTN_TILE)
        for (int32_t i = j0 < n0 ? 0 : j0 - n0 + 1; i < nr; i++) { /* the rows that reach j0 */
            int32_t n = n0 + i - j0 < ATTN_TILE ? n0 + i - j0 : ATTN_TILE;
            tr->attn_v(acc + i * hd, scores + i * mc + j0, vrows + j0, n, hd);
        }
    for (int32_t i = 0; i < nr; i++) {
        float inv = 1.0f / sum[i], *o = t->out + (r0 + i) * width + h * hd;
        for (int64_t d = 0; d < hd; d++) o[d] = acc[i * hd + d] * inv;
    }
}

static void attn_one(const struct attn_task *t, int32_t s, int32_t h, float *scores, float *acc,
                     const void **krows, const void **vrows) {
    const struct backend_kv *kv = t->kv;
    const struct backend_attn_batch *ba = t->batch;
    int64_t hd = kv->head_dim, bs = kv->block_size;
    int32_t kvh = h / (t->n_heads / kv->n_kv_heads);
    int64_t width = (int64_t)t->n_heads * hd;
    const int32_t *bt = ba->block_tables + (int64_t)s * ba->max_blocks;
    int32_t tok0 = ba->seq_tok0[s], tok1 = ba->seq_tok0[s + 1], pos0 = ba->seq_pos0[s];
    /* Bytes of one position's row of head_dim values. */
    size_t rb = backend_kv_row_bytes(kv->type, kv->head_dim);
    const struct cpu_type_traits *tr = cpu_type_traits(kv->type);
    int q8 = kv->type == DTYPE_Q8_0, g = backend_kv_q8_group(kv->head_dim);

    if (!q8 && tr->attn_qk && tr->attn_v) {
        /* Where each position's K and V rows are, for the rows' kernels. */
        for (int32_t j = 0; j < pos0 + (tok1 - tok0); j++) {
            int64_t e = ((int64_t)bt[j / bs] * kv->n_kv_heads + kvh) * bs + j % bs;
            krows[j] = (const uint8_t *)kv->k + e * rb;
            vrows[j] = (const uint8_t *)kv->v + e * rb;
        }
        for (int32_t r = tok0; r < tok1; r += ATTN_ROWS)
            attn_rows(t, tr, s, h, r, tok1 - r < ATTN_ROWS ? tok1 - r : ATTN_ROWS, scores, acc, krows, vrows);
        return;
    }
    for (int32_t r = tok0; r < tok1; r++) {
        const float *q = t->q + r * width + h * hd;
        int32_t n_ctx = pos0 + (r - tok0) + 1;
        for (int32_t j = 0; j < n_ctx; j++) {
            int64_t e = ((int64_t)bt[j / bs] * kv->n_kv_heads + kvh) * bs + j % bs;
            const void *kr = (const uint8_t *)kv->k + e * rb;
            scores[j] = q8 ? dot_q8_row(kr, q, hd, g) : tr->dot(kr, q, hd);
        }
        float sum = attn_softmax(scores, n_ctx, t->scale);
        memset(acc, 0, (size_t)hd * sizeof(float));
        for (int32_t j = 0; j < n_ctx; j++) {
            int64_t e = ((int64_t)bt[j / bs] * kv->n_kv_heads + kvh) * bs + j % bs;
            const void *vr = (const uint8_t *)kv->v + e * rb;
            if (q8)
                axpy_q8_row(acc, scores[j], vr, hd, g);
            else
                tr->axpy(acc, scores[j], vr, hd);
        }
        float inv = 1.0f / sum;
        float *o = t->out + r * width + h * hd;
        for (int64_t d = 0; d < hd; d++) o[d] = acc[d] * inv;
    }
}

static void attn_run(void *arg, int ith, int nth) {
    struct attn_task *t = arg;
    (void)nth;
    float *scores = t->scratch + (size_t)ith * t->scratch_floats;
    float *acc = scores + (size_t)ATTN_ROWS * t->batch->max_ctx;
    /* The rows' pointers after acc, 8-byte aligned (per is a multiple of 16 floats). */
    const void **krows = (const void **)(scores + t->ptr_off), **vrows = krows + t->batch->max_ctx;
    long n_pairs = (long)t->batch->n_seqs * t->n_heads;
    for (;;) {
        long i = atomic_fetch_add_explicit(&t->next, 1, memory_order_relaxed);
        if (i >= n_pairs) break;
        attn_one(t, (int32_t)(i / t->n_heads), (int32_t)(i % t->n_heads), scores, acc, krows, vrows);
    }
}

/* The batch comes from the engine's scheduler: check it against the cache
 * before any thread indexes with it. */
static int attn_check(backend *b, const struct backend_kv *kv, const struct backend_attn_batch *ba) {
    if (ba->n_seqs <= 0 || ba->max_blocks <= 0 || ba->seq_tok0[0] != 0 || ba->seq_tok0[ba->n_seqs] != ba->n_tokens)
        return backend_fail(b, STATUS_BAD_INPUT, "attention: %d sequences, %d tokens, %d blocks per table",
                            ba->n_seqs, ba->n_tokens, ba->max_blocks);
    for (int32_t s = 0; s < ba->n_seqs; s++) {
        int32_t len = ba->seq_tok0[s + 1] - ba->seq_tok0[s], pos0 = ba->seq_pos0[s];
        if (len < 0 || pos0 < 0)
            return backend_fail(b, STATUS_BAD_INPUT, "attention: sequence %d has %d tokens at position %d", s,
                                len, pos0);
        int64_t ctx = (int64_t)pos0 + len;
        if (ctx > ba->max_ctx)
            return backend_fail(b, STATUS_BAD_INPUT, "attention: sequence %d reaches %lld > max_ctx %d", s,
                                (long long)ctx, ba->max_ctx);
        int64_t nb = (ctx + kv->block_size - 1) / kv->block_size;
        if (nb > ba->max_blocks)
            return backend_fail(b, STATUS_BAD_INPUT, "attention: sequence %d needs %lld blocks > max_blocks %d",
                                s, (long long)nb, ba->max_blocks);
        for (int64_t i = 0; i < nb; i++) {
            int32_t id = ba->block_tables[(int64_t)s * ba->max_blocks + i];
            if (id < 0 || id >= kv->n_blocks)
                return backend_fail(b, STATUS_BAD_INPUT,
                                    "attention: sequence %d block %lld is %d, outside 0..%d", s, (long long)i, id,
                                    kv->n_blocks - 1);
        }
    }
    return STATUS_OK;
}

int cpu_attention(backend *b_, float *out, const float *q, const struct backend_kv *kv,
                  const struct backend_attn_batch *batch, int32_t n_heads, float scale) {
    struct backend_cpu *b = (struct backend_cpu *)b_;
    int st = attn_check(b_, kv, batch);
    if (st != STATUS_OK) return st;
    /* Per-thread buffers rounded to 64 bytes so threads never share a line. */
    size_t ptr_off = ((size_t)ATTN_ROWS * ((size_t)batch->max_ctx + (size_t)kv->head_dim) + 15) & ~(size_t)15;
    size_t per = ptr_off + (2 * (size_t)batch->max_ctx * sizeof(void *) / sizeof(float) + 15) / 16 * 16;
    struct attn_task t = {.out = out, .q = q, .kv = kv, .batch = batch, .n_heads = n_heads, .scale = scale,
                          .scratch_floats = per, .ptr_off = ptr_off};
    t.scratch = cpu_scratch(b, per * sizeof(float) * (size_t)b->n_threads);
    if (!t.scratch) return STATUS_NO_MEMORY;
    atomic_init(&t.next, 0);
    int64_t work = (int64_t)batch->n_tokens * n_heads * batch->max_ctx * kv->head_dim;
    cpu_pool_run(b->pool, attn_run, &t, work < 32768 ? 1 : b->n_threads);
    return STATUS_OK;
}
