/* Matrix multiplication on the CPU backend: out[n, rows] = x[n, cols] . W^T
 * for W of any dtype.  The activations are converted once per call to the
 * format the weight type dots against (cpu.h); then threads take chunks of
 * (output rows x tokens) from shared counters, so a core that another
 * process slows down simply takes fewer chunks. */
#include "cpu.h"

#include <sched.h>

#include "../../common/status.h"

/* Tokens per chunk.  Chunks are numbered token tile first, so a thread
 * that takes consecutive chunks keeps the same weight rows in L1/L2 while
 * the tiles of activations (all of which fit in L2/L3) pass over them:
 * the weights are read from memory about once per call. */
#define MM_TOKENS_PER_CHUNK 32
/* The chunks are cut into one contiguous part per thread (up to this many
 * parts); a thread walks its own part in order, so each core streams
 * consecutive weight rows and the hardware prefetcher keeps up, then takes
 * what is left of the other parts. */
#define MM_MAX_PARTS 64

struct mm_part {
    _Alignas(64) atomic_long next; /* next chunk of this part to take */
    long end;
    char pad[64 - sizeof(atomic_long) - sizeof(long)]; /* one cache line each */
};

struct mm_task {
    float *out;
    const uint8_t *w;           /* rows x row_bytes */
    size_t w_row_bytes;
    const float *x;             /* [n, cols] F32 input */
    uint8_t *xq;                /* [n, xq_row_bytes] converted input, or NULL (F32 act) */
    size_t xq_row_bytes;
    enum cpu_act act;
    cpu_dot_fn dot;
    cpu_dot4_fn dot4;           /* or NULL */
    cpu_dotn_fn dotn;           /* or NULL */
    cpu_dot2n_fn dot2n;         /* or NULL */
    int64_t rows, cols;
    int32_t n;
    int64_t rows_per_chunk, n_row_chunks, n_tok_chunks, n_chunks;
    int n_parts;
    struct mm_part parts[MM_MAX_PARTS];
    atomic_long next_quant;     /* next token to convert */
    atomic_int quant_done;      /* tokens converted */
};

static void mm_quantize(struct mm_task *t) {
    for (;;) {
        long i = atomic_fetch_add_explicit(&t->next_quant, 1, memory_order_relaxed);
        if (i >= t->n) break;
        cpu_act_quant_row(t->act, t->x + (size_t)i * t->cols, t->xq + (size_t)i * t->xq_row_bytes, t->cols);
        atomic_fetch_add_explicit(&t->quant_done, 1, memory_order_release);
    }
}

/* Rows ra and rb against tokens t0..t1 through dot2n: fours, or a last
 * five in one pass, then what is left (1-3) in one. */
static void mm_rows2(const struct mm_task *t, int64_t ra, int64_t rb, int32_t t0, int32_t t1, const uint8_t *xs,
                     size_t x_row_bytes) {
    const uint8_t *wa = t->w + (size_t)ra * t->w_row_bytes, *wb = t->w + (size_t)rb * t->w_row_bytes;
    for (int32_t i = t0; i < t1;) {
        int nt = t1 - i == 5 ? 5 : t1 - i >= 4 ? 4 : t1 - i;
        float oa[5], ob[5];
        t->dot2n(wa, wb, xs + (size_t)i * x_row_bytes, x_row_bytes, t->cols, nt, oa, ob);
        for (int j = 0; j < nt; j++) {
            t->out[(size_t)(i + j) * t->rows + ra] = oa[j];
            t->out[(size_t)(i + j) * t->rows + rb] = ob[j];
        }
        i += nt;
    }
}

/* Chunk c: rows_per_chunk output rows x MM_TOKENS_PER_CHUNK tokens. */
static void mm_chunk(const struct mm_task *t, long c, const uint8_t *xs, size_t x_row_bytes) {
    int64_t r0 = (c / t->n_tok_chunks) * t->rows_per_chunk;
    int64_t r1 = r0 + t->rows_per_chunk < t->rows ? r0 + t->rows_per_chunk : t->rows;
    int32_t t0 = (int32_t)(c % t->n_tok_chunks) * MM_TOKENS_PER_CHUNK;
    int32_t t1 = t0 + MM_TOKENS_PER_CHUNK < t->n ? t0 + MM_TOKENS_PER_CHUNK : t->n;
    /* Pairs of rows where a two-row kernel exists, from 2 tokens (one
     * token's dot is bound by the weights' stream alone): row j of the
     * chunk's first half with row j of its second, so that each half is
     * read in order, two streams the prefetchers follow. */
    if (t->dot2n && t1 - t0 >= 2) {
        int64_t h = (r1 - r0) / 2;
        for (int64_t j = 0; j < h; j++) mm_rows2(t, r0 + j, r0 + h + j, t0, t1, xs, x_row_bytes);
        r0 += 2 * h;
    }
    for (int64_t r = r0; r < r1; r++) {
        const uint8_t *wr = t->w + (size_t)r * t->w_row_bytes;
        int32_t i = t0;
        /* Fours while 4 are left (with dotn, but for the last 5), then 3
         * or 5 in one pass where dotn takes them, the rest one by one. */
        if (t->dot4)
            for (; i + 4 <= t1 && (!t->dotn || t1 - i != 5); i += 4) {
                float o[4];
                t->dot4(wr, xs + (size_t)i * x_row_bytes, x_row_bytes, t->cols, o);
                for (int j = 0; j < 4; j++) t->out[(size_t)(i + j) * t->rows + r] = o[j];
            }
        if (t->dotn && (t1 - i == 3 || t1 - i == 5)) {
            float o[5];
            t->dotn(wr, xs + (size_t)i * x_row_bytes, x_row_bytes, t->cols, t1 - i, o);
            for (int j = 0; j < t1 - i; j++) t->out[(size_t)(i + j) * t->rows + r] = o[j];
            i = t1;
        }
        for (; i < t1; i++) t->out[(size_t)i * t->rows + r] = t->dot(wr, xs + (size_t)i * x_row_bytes, t->cols);
    }
}

static void mm_run(void *arg, int ith, int nth) {
    struct mm_task *t = arg;
    (void)nth;
    const uint8_t *xs = t->xq ? t->xq : (const uint8_t *)t->x;
    size_t x_row_bytes = t->xq ? t->xq_row_bytes : (size_t)t->cols * sizeof(float);
    if (t->xq) {
        /* Every thread helps convert the activations, then waits for the
         * rows the others are still converting (a short wait: the
         * conversion is O(n * cols), the product O(n * cols * rows)). */
        mm_quantize(t);
        for (int spins = 0; atomic_load_explicit(&t->quant_done, memory_order_acquire) < t->n; spins++) {
            /* A thread that holds a row and is not running (another
             * process took its core) gets this core after a short while. */
            if (spins < 1000) CPU_RELAX();
            else sched_yield();
        }
    }
    for (int k = 0; k < t->n_parts; k++) {
        struct mm_part *part = &t->parts[(ith + k) % t->n_parts];
        for (;;) {
            long c = atomic_fetch_add_explicit(&part->next, 1, memory_order_relaxed);
            if (c >= part->end) break;
            mm_chunk(t, c, xs, x_row_bytes);
        }
    }
}

int cpu_matmul(backend *b_, float *out, const struct backend_weight *w, const float *x, int32_t n) {
    struct backend_cpu *b = (struct backend_cpu *)b_;
    const struct cpu_type_traits *tr = cpu_type_traits(w->type);
    if (!tr) return backend_fail(b_, STATUS_UNSUPPORTED, "matmul: weight type %d is not supported", (int)w->type);
    if (n < 0) return backend_fail(b_, STATUS_BAD_INPUT, "matmul: %d tokens", n);

    struct mm_task t = {
        .out = out,
        .w = w->data,
        .w_row_bytes = (size_t)(w->cols / tr->block_elems) * tr->block_bytes,
        .x = x,
        .act = tr->act,
        .dot = tr->dot,
        .dot4 = tr->dot4,
        .dotn = tr->dotn,
        .dot2n = tr->dot2n,
        .rows = w->rows,
        .cols = w->cols,
        .n = n,
    };
    if (tr->act != CPU_ACT_F32) {
        t.xq_row_bytes = cpu_act_row_bytes(tr->act, w->cols);
        t.xq = cpu_scratch(b, t.xq_row_bytes * (size_t)n);
        if (!t.xq) return STATUS_NO_MEMORY;
    }
    /* Small chunks balance the load; 8 per thread is plenty, and at least 4
     * rows keep the per-chunk overhead negligible. */
    int nth = b->n_threads;
    int64_t rpc = (w->rows + 8 * nth - 1) / (8 * nth);
    if (rpc < 4) rpc = 4;
    if (rpc > 64) rpc = 64;
    t.rows_per_chunk = rpc;
    t.n_row_chunks = (w->rows + rpc - 1) / rpc;
    t.n_tok_chunks = (n + MM_TOKENS_PER_CHUNK - 1) / MM_TOKENS_PER_CHUNK;
    t.n_chunks = t.n_row_chunks * t.n_tok_chunks;
    /* Tiny products are cheaper than waking the pool. */
    int64_t work = w->rows * w->cols * (int64_t)n;
    if (work < 32768) nth = 1;
    t.n_parts = nth < MM_MAX_PARTS ? nth : MM_MAX_PARTS;
    for (int p = 0; p < t.n_parts; p++) {
        atomic_init(&t.parts[p].next, (long)(t.n_chunks * p / t.n_parts));
        t.parts[p].end = (long)(t.n_chunks * (p + 1) / t.n_parts);
    }
    atomic_init(&t.next_quant, 0);
    atomic_init(&t.quant_done, 0);
    cpu_pool_run(b->pool, mm_run, &t, nth);
    return STATUS_OK;
}
