/* Prefill's dequantized weight tiles, each made ahead of its matmul.
 *
 * At prefill sizes a quantized weight is dequantized into an F16 tile and
 * multiplied by cuBLAS (matmul.cu).  The dequantize pass is memory-bound
 * and the GEMM compute-bound, and a 4096-row GEMM at 512 tokens is about
 * half a wave of cuBLAS's output tiles on an H100: run one after the other
 * they leave each other's resources idle.  Here the tile of the next
 * matmul is made on a second, lower-priority stream while the present one
 * multiplies (and while the attention and norms between them run), in
 * the other of two tile buffers.
 *
 * Which weight comes next is learned: a step's matmuls come in the same
 * order every time (q, k, v, o, gate, up, down, the next layer's q, ...),
 * so each weight records the weight that followed it last time, and the
 * tile made ahead is the next tile of this weight or the first tile of
 * that one.  A wrong guess costs a wasted pass, never a wrong result: a
 * tile is used only when it holds exactly the rows asked for, and every
 * change to device memory that could reach a weight (a free, a weight
 * upload, an upload or copy over the weight a tile came from) forgets the
 * tiles and what was learned.  Off while a graph is being recorded (a
 * recording must not allocate: the caller's scratch tile is used then)
 * and with LLM_CUDA_DEQUANT_AHEAD=0 (device.cu). */
#include "common.cuh"

#include <stdlib.h>

/* Weights whose successor is remembered: a stage of an 80-layer model
 * has 560 matmul weights; the table stops learning when 3/4 full. */
#define AHEAD_MAP 2048

struct ahead_unit { /* rows r0 .. r0 + m of w, dequantized */
    const void *w;
    int type;
    int64_t rows, cols, r0, m;
};

struct ahead_next { /* after w came next (type, rows, cols) */
    const void *w, *next;
    int type;
    int64_t rows, cols;
};

struct cuda_ahead {
    cudaStream_t side;
    cudaEvent_t ready[2]; /* side: the tile of buf[i] written */
    cudaEvent_t done[2];  /* main: the last GEMM reading buf[i] finished */
    uint16_t *buf[2];
    size_t bytes; /* of each buffer */
    struct ahead_unit held[2];
    const void *last_w;
    int map_n;
    struct ahead_next map[AHEAD_MAP];
};

static size_t ahead_hash(const void *w) { return ((uintptr_t)w >> 8) * 0x9E3779B97F4A7C15ull >> 53; }

static struct ahead_next *ahead_find(struct cuda_ahead *a, const void *w, int insert) {
    for (size_t i = ahead_hash(w) % AHEAD_MAP;; i = (i + 1) % AHEAD_MAP) {
        if (a->map[i].w == w) return &a->map[i];
        if (!a->map[i].w) {
            if (!insert || a->map_n >= AHEAD_MAP * 3 / 4) return NULL;
            a->map_n++;
            a->map[i].w = w;
            return &a->map[i];
        }
    }
}

/* Creates the side stream and events on first use; NULL when they cannot
 * be had (then the caller's serial path runs). */
static struct cuda_ahead *ahead_get(struct cuda_ctx *ctx) {
    if (ctx->ahead) return ctx->ahead;
    struct cuda_ahead *a = (struct cuda_ahead *)calloc(1, sizeof *a);
    if (!a) return NULL;
    int least = 0, greatest = 0;
    bool ok = cudaDeviceGetStreamPriorityRange(&least, &greatest) == cudaSuccess &&
              cudaStreamCreateWithPriority(&a->side, cudaStreamNonBlocking, least) == cudaSuccess;
    for (int i = 0; ok && i < 2; i++)
        ok = cudaEventCreateWithFlags(&a->ready[i], cudaEventDisableTiming) == cudaSuccess &&
             cudaEventCreateWithFlags(&a->done[i], cudaEventDisableTiming) == cudaSuccess;
    ctx->ahead = a;
    if (!ok) {
        cudaGetLastError();
        cuda_ahead_free(ctx);
        return NULL;
    }
    return a;
}

/* Both buffers of at least bytes (after the work queued on them). */
static bool ahead_reserve(struct cuda_ctx *ctx, struct cuda_ahead *a, size_t bytes) {
    if (bytes <= a->bytes) return true;
    if (cudaStreamSynchronize(a->side) != cudaSuccess || cudaStreamSynchronize(CUDA_STREAM(ctx)) != cudaSuccess) {
        cudaGetLastError();
        return false;
    }
    for (int i = 0; i < 2; i++) {
        cudaFree(a->buf[i]);
        a->buf[i] = NULL;
        a->held[i].w = NULL;
    }
    a->bytes = 0;
    size_t want = (bytes + ((size_t)1 << 20) - 1) & ~(((size_t)1 << 20) - 1);
    for (int i = 0; i < 2; i++)
        if (cudaMalloc((void **)&a->buf[i], want) != cudaSuccess) {
            cudaGetLastError(); /* not sticky: the serial path may still fit */
            cudaFree(a->buf[0]);
            a->buf[0] = a->buf[1] = NULL;
            return false;
        }
    a->bytes = want;
    return true;
}

static bool unit_eq(const struct ahead_unit *u, const void *w, int type, int64_t cols, int64_t r0, int64_t m) {
    return u->w == w && u->type == type && u->cols == cols && u->r0 == r0 && u->m == m;
}

extern "C" int cuda_ahead_tile(struct cuda_ctx *ctx, const void *w, enum dtype type, int64_t rows, int64_t cols,
                               int64_t r0, int64_t m, const uint16_t **tile, int *slot) {
    *tile = NULL;
    cudaStreamCaptureStatus cap = cudaStreamCaptureStatusNone;
    if (!ctx->dequant_ahead || cudaStreamIsCapturing(CUDA_STREAM(ctx), &cap) != cudaSuccess ||
        cap != cudaStreamCaptureStatusNone)
        return STATUS_OK;
    struct cuda_ahead *a = ahead_get(ctx);
    if (!a) return STATUS_OK;
    if (r0 == 0 && a->last_w != w) { /* learn: w came after last_w */
        struct ahead_next *e = a->last_w ? ahead_find(a, a->last_w, 1) : NULL;
        if (e) {
            e->next = w;
            e->type = (int)type;
            e->rows = rows;
            e->cols = cols;
        }
        a->last_w = w;
    }
    int s = unit_eq(&a->held[0], w, type, cols, r0, m) ? 0 : unit_eq(&a->held[1], w, type, cols, r0, m) ? 1 : -1;
    if (s >= 0) {
        CUDA_CHECK(ctx, cudaStreamWaitEvent(CUDA_STREAM(ctx), a->ready[s], 0));
    } else {
        if (!ahead_reserve(ctx, a, (size_t)m * cols * 2)) return STATUS_OK;
        s = a->held[0].w ? (a->held[1].w ? 0 : 1) : 0;
        /* A tile still being written there on the side stream first. */
        CUDA_CHECK(ctx, cudaStreamWaitEvent(CUDA_STREAM(ctx), a->ready[s], 0));
        a->held[s].w = NULL;
        int rc = cuda_dequant_f16(ctx, a->buf[s], w, type, r0, m, cols);
        if (rc != STATUS_OK) return rc;
        a->held[s] = {w, (int)type, rows, cols, r0, m};
    }
    *tile = a->buf[s];
    *slot = s;
    return STATUS_OK;
}

extern "C" void cuda_ahead_queued(struct cuda_ctx *ctx, int slot, size_t tile_bytes) {
    struct cuda_ahead *a = ctx->ahead;
    if (!a) return;
    const struct ahead_unit cur = a->held[slot];
    if (cudaEventRecord(a->done[slot], CUDA_STREAM(ctx)) != cudaSuccess) {
        cudaGetLastError();
        a->held[0].w = a->held[1].w = NULL; /* no ordering against that GEMM: no tile made ahead */
        return;
    }
    if (!tile_bytes) return;
    struct ahead_unit next;
    if (cur.r0 + cur.m < cur.rows) {
        next = cur;
        next.r0 = cur.r0 + cur.m;
    } else {
        const struct ahead_next *e = ahead_find(a, cur.w, 0);
        if (!e || !e->next) return;
        next = {e->next, e->type, e->rows, e->cols, 0, 0};
    }
    next.m = cuda_tile_rows(tile_bytes, next.rows, next.cols);
    if (next.m > next.rows - next.r0) next.m = next.rows - next.r0;
    if (unit_eq(&a->held[slot ^ 1], next.w, next.type, next.cols, next.r0, next.m)) return;
    int t = slot ^ 1;
    if ((size_t)next.m * next.cols * 2 > a->bytes) return; /* grows only on the serial path */
    a->held[t].w = NULL;
    /* The dequantize kernels launch on ctx->stream: a copy of ctx that
     * names the side stream, after the last GEMM that read buffer t. */
    struct cuda_ctx side = *ctx;
    side.stream = a->side;
    if (cudaStreamWaitEvent(a->side, a->done[t], 0) != cudaSuccess ||
        cuda_dequant_f16(&side, a->buf[t], next.w, (enum dtype)next.type, next.r0, next.m, next.cols) != STATUS_OK ||
        cudaEventRecord(a->ready[t], a->side) != cudaSuccess) {
        cudaGetLastError(); /* nothing made ahead; the matmul makes its tile itself */
        return;
    }
    a->held[t] = next;
}

extern "C" void cuda_ahead_forget(struct cuda_ctx *ctx) {
    struct cuda_ahead *a = ctx->ahead;
    if (!a) return;
    a->held[0].w = a->held[1].w = NULL;
    a->last_w = NULL;
    a->map_n = 0;
    memset(a->map, 0, sizeof a->map);
}

extern "C" void cuda_ahead_written(struct cuda_ctx *ctx, const void *dst, size_t bytes) {
    struct cuda_ahead *a = ctx->ahead;
    if (!a) return;
    const uint8_t *d = (const uint8_t *)dst;
    for (int i = 0; i < 2; i++) {
        const struct ahead_unit *u = &a->held[i];
        if (!u->w) continue;
        const uint8_t *w = (const uint8_t *)u->w;
        size_t wb = cuda_row_bytes((enum dtype)u->type, u->cols) * (size_t)u->rows;
        if (d < w + wb && w < d + bytes) a->held[i].w = NULL;
    }
}

extern "C" void cuda_ahead_free(struct cuda_ctx *ctx) {
    struct cuda_ahead *a = ctx->ahead;
    if (!a) return;
    if (a->side) cudaStreamSynchronize(a->side);
    for (int i = 0; i < 2; i++) {
        if (a->buf[i]) cudaFree(a->buf[i]);
        if (a->ready[i]) cudaEventDestroy(a->ready[i]);
        if (a->done[i]) cudaEventDestroy(a->done[i]);
    }
    if (a->side) cudaStreamDestroy(a->side);
    free(a);
    ctx->ahead = NULL;
}
