/* The row-wise ops of the CPU backend: embed, rmsnorm, add_rmsnorm, add,
 * rope, swiglu, get_rows, convert.  Threads claim ranges of rows (or
 * elements) from a shared counter; small inputs run on the caller's thread
 * because waking the pool would cost more than the op. */
#include "cpu.h"

#include <math.h>
#include <string.h>

#include "../../common/status.h"

/* Below this many elements an op runs on one thread. */
#define OPS_PARALLEL_MIN 32768

struct ops_task {
    float *out, *x;
    const float *cx, *y, *w;
    const void *src;
    void *dst;
    const int32_t *idx;
    const float *inv_freq;
    const struct backend_weight *weight;
    enum dtype src_type, dst_type;
    int64_t n, dim;          /* rows and row length, or elements (dim = 1) */
    int32_t n_heads, head_dim, n_freq, neox;
    float eps;
    int64_t chunk;           /* rows per claim */
    atomic_llong next;       /* first unclaimed row */
};

/* The next range [i0, i1) of rows, or 0 when all are taken. */
static int claim(struct ops_task *t, int64_t *i0, int64_t *i1) {
    *i0 = atomic_fetch_add_explicit(&t->next, t->chunk, memory_order_relaxed);
    if (*i0 >= t->n) return 0;
    *i1 = *i0 + t->chunk < t->n ? *i0 + t->chunk : t->n;
    return 1;
}

typedef void (*ops_rows_fn)(struct ops_task *t, int64_t i0, int64_t i1);

struct ops_job {
    struct ops_task *t;
    ops_rows_fn fn;
};

static void ops_main(void *arg, int ith, int nth) {
    struct ops_job *j = arg;
    int64_t i0, i1;
    (void)ith;
    (void)nth;
    while (claim(j->t, &i0, &i1)) j->fn(j->t, i0, i1);
}

static void run(struct backend_cpu *b, ops_rows_fn fn, struct ops_task *t, int64_t elems) {
    int nth = elems < OPS_PARALLEL_MIN ? 1 : b->n_threads;
    /* Four claims per thread: few enough to be cheap, enough to even out a
     * thread that starts late. */
    t->chunk = (t->n + 4 * nth - 1) / (4 * nth);
    if (t->chunk < 1) t->chunk = 1;
    atomic_init(&t->next, 0);
    struct ops_job job = {t, fn};
    cpu_pool_run(b->pool, ops_main, &job, nth);
}

/* ---- embed ---- */

static void embed_rows(struct ops_task *t, int64_t i0, int64_t i1) {
    const struct cpu_type_traits *tr = cpu_type_traits(t->weight->type);
    size_t row_bytes = (size_t)(t->weight->cols / tr->block_elems) * tr->block_bytes;
    for (int64_t i = i0; i < i1; i++)
        cpu_dequant_row(t->weight->type, (const uint8_t *)t->weight->data + (size_t)t->idx[i] * row_bytes,
                        t->out + i * t->weight->cols, t->weight->cols);
}

int cpu_embed(backend *b_, float *out, const struct backend_weight *w, const int32_t *ids, int32_t n) {
    struct backend_cpu *b = (struct backend_cpu *)b_;
    if (!cpu_type_traits(w->type))
        return backend_fail(b_, STATUS_UNSUPPORTED, "embed: weight type %d is not supported", (int)w->type);
    for (int32_t i = 0; i < n; i++)
        if (ids[i] < 0 || ids[i] >= w->rows)
            return backend_fail(b_, STATUS_BAD_INPUT, "embed: token id %d at row %d is outside 0..%lld",
                                ids[i], i, (long long)w->rows - 1);
    struct ops_task t = {.out = out, .weight = w, .idx = ids, .n = n};
    run(b, embed_rows, &t, (int64_t)n * w->cols);
    return STATUS_OK;
}

/* ---- rmsnorm and add_rmsnorm ---- */

static float rms_scale(const float *x, int64_t dim, float eps) {
    float acc[8] = {0};
    int64_t i = 0;
    for (; i + 8 <= dim; i += 8)
        for (int j = 0; j < 8; j++) acc[j] += x[i + j] * x[i + j];
    float ss = 0;
    for (; i < dim; i++) ss += x[i] * x[i];
    for (int j = 0; j < 8; j++) ss += acc[j];
    return 1.0f / sqrtf(ss / (float)dim + eps);
}

static void rmsnorm_rows(struct ops_task *t, int64_t i0, int64_t i1) {
    for (int64_t r = i0; r < i1; r++) {
        const float *x = t->cx + r * t->dim;
        float *o = t->out + r * t->dim;
        float s = rms_scale(x, t->dim, t->eps);
        for (int64_t i = 0; i < t->dim; i++) o[i] = x[i] * s * t->w[i];
    }
}

int cpu_rmsnorm(backend *b_, float *out, const float *x, const float *w, int32_t n, int32_t dim, float eps) {
    struct backend_cpu *b = (struct backend_cpu *)b_;
    if (n < 0 || dim <= 0) return backend_fail(b_, STATUS_BAD_INPUT, "rmsnorm: shape [%d x %d]", n, dim);
    struct ops_task t = {.out = out, .cx = x, .w = w, .n = n, .dim = dim, .eps = eps};
    run(b, rmsnorm_rows, &t, (int64_t)n * dim);
    return STATUS_OK;
}

static void add_rmsnorm_rows(struct ops_task *t, int64_t i0, int64_t i1) {
    for (int64_t r = i0; r < i1; r++) {
        float *x = t->x + r * t->dim, *o = t->out + r * t->dim;
        const float *d = t->y + r * t->dim;
        for (int64_t i = 0; i < t->dim; i++) x[i] += d[i];
        float s = rms_scale(x, t->dim, t->eps);
        for (int64_t i = 0; i < t->dim; i++) o[i] = x[i] * s * t->w[i];
    }
}

int cpu_add_rmsnorm(backend *b_, float *x, const float *delta, float *out, const float *w,
                    int32_t n, int32_t dim, float eps) {
    struct backend_cpu *b = (struct backend_cpu *)b_;
    if (n < 0 || dim <= 0) return backend_fail(b_, STATUS_BAD_INPUT, "add_rmsnorm: shape [%d x %d]", n, dim);
    struct ops_task t = {.x = x, .y = delta, .out = out, .w = w, .n = n, .dim = dim, .eps = eps};
    run(b, add_rmsnorm_rows, &t, (int64_t)n * dim);
    return STATUS_OK;
}

/* ---- add, swiglu ---- */

static void add_rows(struct ops_task *t, int64_t i0, int64_t i1) {
    for (int64_t i = i0; i < i1; i++) t->x[i] += t->y[i];
}

int cpu_add(backend *b_, float *x, const float *y, int64_t n) {
    struct ops_task t = {.x = x, .y = y, .n = n};
    run((struct backend_cpu *)b_, add_rows, &t, n);
    return STATUS_OK;
}

static void swiglu_rows(struct ops_task *t, int64_t i0, int64_t i1) {
    for (int64_t i = i0; i < i1; i++) {
        float g = t->cx[i];
        t->out[i] = g / (1.0f + expf(-g)) * t->y[i];
    }
}

int cpu_swiglu(backend *b_, float *out, const float *gate, const float *up, int64_t n) {
    struct ops_task t = {.out = out, .cx = gate, .y = up, .n = n};
    run((struct backend_cpu *)b_, swiglu_rows, &t, n);
    return STATUS_OK;
}

/* ---- rope ---- */

static void rope_rows(struct ops_task *t, int64_t i0, int64_t i1) {
    int32_t nf = t->n_freq;
    for (int64_t r = i0; r < i1; r++) {
        float *row = t->x + r * (int64_t)t->n_heads * t->head_dim;
        /* The angle in double: positions reach 1e5 and more, where a float
         * product loses the low digits of the phase. */
        double p = (double)t->idx[r];
        for (int32_t i = 0; i < nf; i++) {
            double a = p * (double)t->inv_freq[i];
            float c = (float)cos(a), s = (float)sin(a);
            int32_t j0 = t->neox ? i : 2 * i, j1 = t->neox ? i + nf : 2 * i + 1;
            for (int32_t h = 0; h < t->n_heads; h++) {
                float *v = row + (int64_t)h * t->head_dim;
                float x0 = v[j0], x1 = v[j1];
                v[j0] = x0 * c - x1 * s;
                v[j1] = x0 * s + x1 * c;
            }
        }
    }
}

int cpu_rope(backend *b_, float *x, const int32_t *pos, int32_t n, int32_t n_heads, int32_t head_dim,
             const float *inv_freq, int32_t n_freq, int neox) {
    struct backend_cpu *b = (struct backend_cpu *)b_;
    if (n < 0 || n_heads <= 0 || head_dim <= 0 || n_freq < 0 || 2 * n_freq > head_dim)
        return backend_fail(b_, STATUS_BAD_INPUT, "rope: %d tokens x %d heads x %d dims, %d frequencies", n,
                            n_heads, head_dim, n_freq);
    struct ops_task t = {.x = x, .idx = pos, .n = n, .n_heads = n_heads, .head_dim = head_dim,
                         .inv_freq = inv_freq, .n_freq = n_freq, .neox = neox};
    run(b, rope_rows, &t, (int64_t)n * n_heads * n_freq * 8);
    return STATUS_OK;
}

/* ---- get_rows ---- */

static void gather_rows(struct ops_task *t, int64_t i0, int64_t i1) {
    for (int64_t i = i0; i < i1; i++)
        memcpy(t->out + i * t->dim, t->cx + (int64_t)t->idx[i] * t->dim, (size_t)t->dim * sizeof(float));
}

int cpu_get_rows(backend *b_, float *out, const float *x, const int32_t *idx, int32_t n, int32_t dim) {
    struct backend_cpu *b = (struct backend_cpu *)b_;
    if (n < 0 || dim <= 0) return backend_fail(b_, STATUS_BAD_INPUT, "get_rows: %d rows of %d", n, dim);
    for (int32_t i = 0; i < n; i++)
        if (idx[i] < 0) return backend_fail(b_, STATUS_BAD_INPUT, "get_rows: index %d at %d", idx[i], i);
    struct ops_task t = {.out = out, .cx = x, .idx = idx, .n = n, .dim = dim};
    run(b, gather_rows, &t, (int64_t)n * dim);
    return STATUS_OK;
}

/* ---- convert ---- */

static void convert_rows(struct ops_task *t, int64_t i0, int64_t i1) {
    if (t->src_type == t->dst_type) {
        size_t es = t->src_type == DTYPE_F32 ? 4 : 2;
        memcpy((uint8_t *)t->dst + i0 * es, (const uint8_t *)t->src + i0 * es, (size_t)(i1 - i0) * es);
        return;
    }
    /* Through float: every F16 and BF16 value is exact in F32. */
    float buf[256];
    for (int64_t i = i0; i < i1; i += 256) {
        int64_t m = i1 - i < 256 ? i1 - i : 256;
        const float *f = buf;
        if (t->src_type == DTYPE_F32) f = (const float *)t->src + i;
        else cpu_dequant_row(t->src_type, (const uint16_t *)t->src + i, buf, m);
        if (t->dst_type == DTYPE_F32) {
            memcpy((float *)t->dst + i, f, (size_t)m * sizeof(float));
        } else {
            uint16_t *d = (uint16_t *)t->dst + i;
            if (t->dst_type == DTYPE_F16)
                for (int64_t j = 0; j < m; j++) d[j] = cpu_f32_to_fp16(f[j]);
            else
                for (int64_t j = 0; j < m; j++) d[j] = cpu_f32_to_bf16(f[j]);
        }
    }
}

static int convert_type_ok(enum dtype t) { return t == DTYPE_F32 || t == DTYPE_F16 || t == DTYPE_BF16; }

int cpu_convert(backend *b_, void *dst, enum dtype dst_type, const void *src, enum dtype src_type, int64_t n) {
    struct backend_cpu *b = (struct backend_cpu *)b_;
    if (!convert_type_ok(dst_type) || !convert_type_ok(src_type))
        return backend_fail(b_, STATUS_UNSUPPORTED, "convert: %s to %s (F32, F16 and BF16 only)",
                            dtype_name(src_type), dtype_name(dst_type));
    if (n < 0) return backend_fail(b_, STATUS_BAD_INPUT, "convert: %lld elements", (long long)n);
    struct ops_task t = {.dst = dst, .dst_type = dst_type, .src = src, .src_type = src_type, .n = n};
    run(b, convert_rows, &t, n);
    return STATUS_OK;
}
