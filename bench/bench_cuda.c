/* Benchmark of the CUDA backend's decode-critical kernels.  It measures the
 * card's two ceilings first (device-to-device copy bandwidth, F16 GEMM
 * rate through cuBLAS), then times matmul on Llama-7B layer shapes at
 * batch 1..64 and paged attention decode over a 512-token context at batch
 * 1..64, printing achieved bytes/s as a fraction of the measured bandwidth,
 * and the weight-reading kernels against dequantize + cuBLAS at batch 1..64.
 *
 *   bench_cuda [device] [gemv | wide | mmq | route | prefill | attn]
 *
 * With "gemv", "wide", "mmq" or "route", only the bandwidth and a
 * comparison of kernels on the same matmuls (kernel_compare): the
 * batch-1..4 kernel of matmul_gemv.cu against the tensor-core kernel, the
 * batch-17..64 kernel of matmul_wide.cu against matmul_vec.cu's mq,
 * matmul_mmq.cu at batch 8-64 against the path the backend takes without
 * it (7B shapes), or mq, matmul_wide.cu and matmul_mmq.cu at 17-64 on the
 * llama2-7b and llama3-8b shapes.
 *
 * With "prefill", only the ceilings and a 7B-shaped prefill of 512 tokens
 * op by op: the q/k/v/o, gate/up and down matmuls at n = 512 (F16, Q8_0,
 * Q4_K, Q6_K; quantized weights with dequantized tiles of 16 MiB, the old
 * size, and of the default size), attention over 512 tokens (tensor-core
 * kernel against LLM_CUDA_PREFILL_TC=0), and their sum for 32 layers.
 * With "attn", only the bandwidth and the attention decode tables (run it
 * with LLM_CUDA_DECODE_TC_G set to compare the kernels): context 512 on
 * an F16 cache at batch 1..64, and batch 64 at context 2048 on an F16
 * against a Q8_0 cache (attn_kv_compare).
 *
 * Inputs rotate over enough copies to exceed the L2 cache, so the numbers
 * are DRAM numbers.  Times are the median of 5 rounds. */
#include <math.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#include "common/dtype.h"
#include "common/status.h"
#include "kernels/backend.h"

static backend *be;

static double now_s(void) {
    struct timespec t;
    clock_gettime(CLOCK_MONOTONIC, &t);
    return (double)t.tv_sec + (double)t.tv_nsec * 1e-9;
}

static void die(const char *what) {
    fprintf(stderr, "bench_cuda: %s: %s\n", what, be ? backend_errstr(be) : "");
    exit(1);
}

static void *dev_alloc(size_t bytes) {
    void *p = backend_alloc(be, bytes);
    if (!p) die("alloc");
    return p;
}

static uint64_t rng = 0x243f6a8885a308d3ull;
static float rnd(void) {
    rng ^= rng << 13;
    rng ^= rng >> 7;
    rng ^= rng << 17;
    return (float)((rng >> 40) & 0xffffff) / 8388608.0f - 1.0f;
}

static void *dev_random_f32(size_t n) {
    float *h = malloc(n * sizeof(float));
    if (!h) die("host alloc");
    for (size_t i = 0; i < n; i++) h[i] = rnd();
    void *d = dev_alloc(n * sizeof(float));
    if (backend_upload(be, d, h, n * sizeof(float)) || backend_sync(be)) die("upload");
    free(h);
    return d;
}

/* Median over 5 rounds of the mean time of one call of fn(arg, i). */
typedef int (*bench_fn)(void *arg, int i);
static double time_median(bench_fn fn, void *arg) {
    for (int i = 0; i < 3; i++)
        if (fn(arg, i)) die("warm-up");
    if (backend_sync(be)) die("sync");
    double t0 = now_s();
    for (int i = 0; i < 5; i++)
        if (fn(arg, i)) die("probe");
    if (backend_sync(be)) die("sync");
    double one = (now_s() - t0) / 5;
    int iters = (int)(0.03 / (one > 1e-7 ? one : 1e-7));
    if (iters < 3) iters = 3;
    if (iters > 2000) iters = 2000;
    double r[5];
    for (int k = 0; k < 5; k++) {
        t0 = now_s();
        for (int i = 0; i < iters; i++)
            if (fn(arg, i)) die("timed run");
        if (backend_sync(be)) die("sync");
        r[k] = (now_s() - t0) / iters;
    }
    for (int a = 0; a < 5; a++)
        for (int b = a + 1; b < 5; b++)
            if (r[b] < r[a]) {
                double t = r[a];
                r[a] = r[b];
                r[b] = t;
            }
    return r[2];
}

/* ---- Ceilings ---- */
struct copy_arg { void *a, *b; size_t bytes; };
static int copy_fn(void *arg, int i) {
    struct copy_arg *c = arg;
    return i % 2 ? backend_copy(be, c->a, c->b, c->bytes) : backend_copy(be, c->b, c->a, c->bytes);
}

struct mm_arg {
    struct backend_weight *w; /* copies, rotated */
    int n_w;
    float *x, *out;
    int32_t n;
};
static int mm_fn(void *arg, int i) {
    struct mm_arg *m = arg;
    return backend_matmul(be, m->out, &m->w[i % m->n_w], m->x, m->n);
}
struct cv_arg { void *dst; const float *src; int64_t n; };
static int cv_fn(void *arg, int i) {
    (void)i;
    struct cv_arg *c = arg;
    return backend_convert(be, c->dst, DTYPE_F16, c->src, DTYPE_F32, c->n);
}

/* A weight of type t whose rows repeat 64 distinct quantized random rows
 * (quantizing 45M elements would dominate the run). */
static void *host_weight(enum dtype t, int64_t rows, int64_t cols) {
    size_t rb = dtype_row_bytes(t, cols);
    uint8_t *h = malloc(rb * rows);
    float *f = malloc(cols * sizeof(float));
    if (!h || !f) die("host alloc");
    for (int64_t r = 0; r < rows && r < 64; r++) {
        for (int64_t i = 0; i < cols; i++) f[i] = rnd();
        if (dtype_quant_row(t, f, h + rb * r, cols)) die("quantize");
    }
    for (int64_t r = 64; r < rows; r++) memcpy(h + rb * r, h + rb * (r % 64), rb);
    free(f);
    return h;
}

/* The weight-reading kernels against dequantize + cuBLAS on 4096x4096, on
 * a fresh backend for each path (LLM_CUDA_SKINNY_MAX picks it at init). */
static void crossover(int device, double bw) {
    static const enum dtype types[4] = {DTYPE_F16, DTYPE_Q8_0, DTYPE_Q4_K, DTYPE_Q6_K};
    static const int32_t batches[7] = {1, 2, 4, 8, 16, 32, 64};
    static const char *modes[2] = {"64", "0"};
    double t[2][4][7];
    int64_t R = 4096, C = 4096;
    for (int m = 0; m < 2; m++) {
        backend_free(be);
        be = NULL;
        setenv("LLM_CUDA_SKINNY_MAX", modes[m], 1);
        char err[256];
        if (backend_cuda_init(&be, device, err, sizeof err)) {
            fprintf(stderr, "bench_cuda: %s\n", err);
            exit(1);
        }
        for (int k = 0; k < 4; k++) {
            size_t wbytes = dtype_row_bytes(types[k], C) * R;
            int n_w = (int)((512u << 20) / wbytes) + 1;
            if (n_w > 16) n_w = 16;
            struct backend_weight ws[16];
            void *hw = host_weight(types[k], R, C);
            for (int i = 0; i < n_w; i++)
                if (backend_weight_load(be, &ws[i], types[k], hw, R, C)) die("weight_load");
            free(hw);
            float *x = dev_random_f32((size_t)64 * C), *out = dev_alloc((size_t)64 * R * 4);
            for (int b = 0; b < 7; b++) {
                struct mm_arg a = {ws, n_w, x, out, batches[b]};
                t[m][k][b] = time_median(mm_fn, &a);
            }
            backend_dealloc(be, x);
            backend_dealloc(be, out);
            for (int i = 0; i < n_w; i++) backend_weight_free(be, &ws[i]);
        }
    }
    unsetenv("LLM_CUDA_SKINNY_MAX");
    printf("\nmatmul 4096x4096, weight-reading kernel vs dequantize + cuBLAS (us; %% of bw counts weight bytes)\n");
    printf("%-6s %5s %10s %7s %10s %7s\n", "type", "batch", "reading", "of bw", "cublas", "of bw");
    for (int k = 0; k < 4; k++)
        for (int b = 0; b < 7; b++) {
            double wb = (double)dtype_row_bytes(types[k], C) * R;
            printf("%-6s %5d %10.1f %6.1f%% %10.1f %6.1f%%\n", dtype_name(types[k]), batches[b], t[0][k][b] * 1e6,
                   100.0 * wb / t[0][k][b] / bw, t[1][k][b] * 1e6, 100.0 * wb / t[1][k][b] / bw);
        }
}

/* Two or three kernels for the same matmuls, each on a backend of its own
 * made with up to two variables set at init (name=value; the first column
 * is the old kernel):
 *   - "gemv": batch 1, 2 and 4, the tensor-core kernel (LLM_CUDA_GEMV_MAX=0)
 *     against matmul_gemv.cu (LLM_CUDA_GEMV_MAX=4);
 *   - "wide": batch 17-64, matmul_vec.cu's mq (LLM_CUDA_WIDE=0) against
 *     matmul_wide.cu on every shape (LLM_CUDA_WIDE_ITEMS=0);
 *   - "mmq": batch 8-64, the path without matmul_mmq.cu against it;
 *   - "route": batch 17-64, mq, matmul_wide.cu and matmul_mmq.cu each on
 *     every shape, on the Q4_K_M matmuls of llama2-7b and llama3-8b (a
 *     group of weights on one input as one weight of all their rows), in
 *     Q4_K, Q5_K and Q6_K: the table LLM_CUDA_MM_ROUTE's choices come from. */
struct cmp_spec {
    const char *title, *env[3][4], *name[3]; /* per backend up to two NAME, VALUE pairs */
    int n_k;
    int32_t batches[8];
    int n_b;
    const int64_t (*shapes)[2]; /* rows, cols */
    int n_s;
    const enum dtype *types;
    int n_t;
};
static void kernel_compare(int device, double bw, const struct cmp_spec *c) {
    const int64_t(*shapes)[2] = c->shapes;
    const enum dtype *types = c->types;
    const int32_t nmax = c->batches[c->n_b - 1];
    backend *bes[3];
    for (int m = 0; m < c->n_k; m++) {
        for (int v = 0; v < 4 && c->env[m][v]; v += 2) setenv(c->env[m][v], c->env[m][v + 1], 1);
        char err[256];
        if (backend_cuda_init(&bes[m], device, err, sizeof err)) {
            fprintf(stderr, "bench_cuda: %s\n", err);
            exit(1);
        }
        for (int v = 0; v < 4 && c->env[m][v]; v += 2) unsetenv(c->env[m][v]);
    }
    backend *keep = be;
    printf("\n%s, us (%% of bw: weight + activation + output bytes)\n", c->title);
    printf("%-6s %-13s %5s", "type", "rows x cols", "batch");
    for (int m = 0; m < c->n_k; m++) printf(" %10s %7s", c->name[m], "of bw");
    printf("%s\n", c->n_k > 2 ? "  fastest" : "");
    for (int s = 0; s < c->n_s; s++)
        for (int k = 0; k < c->n_t; k++) {
            int64_t R = shapes[s][0], C = shapes[s][1];
            size_t wbytes = dtype_row_bytes(types[k], C) * R;
            int n_w = (int)((512u << 20) / wbytes) + 1;
            if (n_w > 16) n_w = 16;
            void *hw = host_weight(types[k], R, C);
            double t[3][8];
            for (int m = 0; m < c->n_k; m++) {
                be = bes[m];
                struct backend_weight ws[16];
                for (int i = 0; i < n_w; i++)
                    if (backend_weight_load(be, &ws[i], types[k], hw, R, C)) die("weight_load");
                float *x = dev_random_f32((size_t)nmax * C), *out = dev_alloc((size_t)nmax * R * 4);
                for (int b = 0; b < c->n_b; b++) {
                    struct mm_arg a = {ws, n_w, x, out, c->batches[b]};
                    t[m][b] = time_median(mm_fn, &a);
                }
                backend_dealloc(be, x);
                backend_dealloc(be, out);
                for (int i = 0; i < n_w; i++) backend_weight_free(be, &ws[i]);
            }
            free(hw);
            for (int b = 0; b < c->n_b; b++) {
                double bytes = (double)wbytes + 4.0 * c->batches[b] * (C + R);
                int best = 0;
                printf("%-6s %5lldx%-7lld %5d", dtype_name(types[k]), (long long)R, (long long)C, c->batches[b]);
                for (int m = 0; m < c->n_k; m++) {
                    printf(" %10.1f %6.1f%%", t[m][b] * 1e6, 100.0 * bytes / t[m][b] / bw);
                    if (t[m][b] < t[best][b]) best = m;
                }
                if (c->n_k > 2) printf("  %s", c->name[best]);
                printf("\n");
            }
            fflush(stdout);
        }
    be = keep;
    for (int m = 0; m < c->n_k; m++) backend_free(bes[m]);
}

/* F16 GEMM rate: 8192 x 8192 weight, 4096 tokens, through backend_matmul;
 * the activation conversion is timed alone and subtracted.  Returns
 * FLOP/s. */
static double gemm_ceiling(void) {
    int64_t R = 8192, C = 8192;
    int32_t n = 4096;
    void *hw = host_weight(DTYPE_F16, R, C);
    struct backend_weight w;
    if (backend_weight_load(be, &w, DTYPE_F16, hw, R, C)) die("weight_load");
    free(hw);
    struct mm_arg m = {&w, 1, dev_random_f32((size_t)n * C), dev_alloc((size_t)n * R * 4), n};
    double t = time_median(mm_fn, &m);
    struct cv_arg cv = {dev_alloc((size_t)n * C * 2), m.x, (int64_t)n * C};
    double tc = time_median(cv_fn, &cv);
    double flops = 2.0 * R * C * n;
    double rate = flops / (t - tc);
    printf("F16 GEMM (cuBLAS, F32 accumulate) %lldx%lld x %d tokens: %.1f TFLOP/s (%.1f with the F32->F16 "
           "activation conversion, %.3f ms of %.3f ms)\n",
           (long long)R, (long long)C, n, flops / (t - tc) / 1e12, flops / t / 1e12, tc * 1e3, t * 1e3);
    backend_dealloc(be, cv.dst);
    backend_dealloc(be, m.x);
    backend_dealloc(be, m.out);
    backend_weight_free(be, &w);
    return rate;
}

/* ---- Prefill of 512 tokens, 7B shapes, op by op ---- */
struct attn_arg {
    struct backend_kv *kv;
    struct backend_attn_batch ab;
    float *q, *out;
    int32_t n_heads;
};
static int attn_fn(void *arg, int i) {
    (void)i;
    struct attn_arg *a = arg;
    return backend_attention(be, a->out, a->q, a->kv, &a->ab, a->n_heads, 1.0f / sqrtf(128.0f));
}

/* One sequence of n rows at positions pos0 .. pos0 + n - 1, 32 heads of
 * 128 over n_kv KV heads, F16 cache in blocks of 16; the tensor-core
 * kernel (tc) or the general one (LLM_CUDA_PREFILL_TC=0).  Seconds. */
static double prefill_attention(int32_t n_kv, int32_t n, int32_t pos0, int tc) {
    int32_t n_heads = 32, hd = 128, bs = 16, ctx = pos0 + n, nb = (ctx + bs - 1) / bs;
    struct backend_kv kv;
    if (backend_kv_init(be, &kv, DTYPE_F16, nb, bs, n_kv, hd)) die("kv_init");
    size_t elems = (size_t)nb * bs * n_kv * hd;
    uint16_t *h = malloc(elems * 2);
    if (!h) die("host alloc");
    for (size_t i = 0; i < elems; i++) h[i] = f32_to_fp16(rnd());
    if (backend_upload(be, kv.k, h, elems * 2) || backend_upload(be, kv.v, h, elems * 2) || backend_sync(be))
        die("upload kv");
    free(h);
    int32_t tok0[2] = {0, n}, p0[1] = {pos0}, *tab = malloc((size_t)nb * 4);
    if (!tab) die("host alloc");
    /* Blocks out of order (37 is prime to every nb used here). */
    for (int32_t i = 0; i < nb; i++) tab[i] = (int32_t)((int64_t)i * 37 % nb);
    int32_t *d0 = dev_alloc(sizeof tok0), *dp = dev_alloc(sizeof p0), *dt = dev_alloc((size_t)nb * 4);
    if (backend_upload(be, d0, tok0, sizeof tok0) || backend_upload(be, dp, p0, sizeof p0) ||
        backend_upload(be, dt, tab, (size_t)nb * 4) || backend_sync(be))
        die("upload");
    free(tab);
    struct attn_arg a = {&kv, {1, n, nb, ctx, d0, dp, dt, n, n}, dev_random_f32((size_t)n * n_heads * hd),
                         dev_alloc((size_t)n * n_heads * hd * 4), n_heads};
    if (tc) unsetenv("LLM_CUDA_PREFILL_TC");
    else setenv("LLM_CUDA_PREFILL_TC", "0", 1);
    double t = time_median(attn_fn, &a);
    unsetenv("LLM_CUDA_PREFILL_TC");
    backend_dealloc(be, a.q);
    backend_dealloc(be, a.out);
    backend_dealloc(be, d0);
    backend_dealloc(be, dp);
    backend_dealloc(be, dt);
    backend_kv_free(be, &kv);
    return t;
}

/* matmul at n tokens of a rows x cols weight of type t, weights rotated
 * over > 256 MiB; tile_mb sets LLM_CUDA_DEQUANT_TILE_MB (0: default).
 * Seconds. */
static double prefill_matmul(enum dtype t, int64_t R, int64_t C, int32_t n, int tile_mb) {
    size_t wbytes = dtype_row_bytes(t, C) * R;
    int n_w = (int)((256u << 20) / wbytes) + 1;
    if (n_w > 8) n_w = 8;
    struct backend_weight ws[8];
    void *hw = host_weight(t, R, C);
    for (int i = 0; i < n_w; i++)
        if (backend_weight_load(be, &ws[i], t, hw, R, C)) die("weight_load");
    free(hw);
    float *x = dev_random_f32((size_t)n * C), *out = dev_alloc((size_t)n * R * 4);
    char mb[16];
    snprintf(mb, sizeof mb, "%d", tile_mb);
    if (tile_mb > 0) setenv("LLM_CUDA_DEQUANT_TILE_MB", mb, 1);
    else unsetenv("LLM_CUDA_DEQUANT_TILE_MB");
    struct mm_arg m = {ws, n_w, x, out, n};
    double s = time_median(mm_fn, &m);
    unsetenv("LLM_CUDA_DEQUANT_TILE_MB");
    backend_dealloc(be, x);
    backend_dealloc(be, out);
    for (int i = 0; i < n_w; i++) backend_weight_free(be, &ws[i]);
    return s;
}

static void prefill_bench(double gemm_rate) {
    const int32_t n = 512;
    /* q, k, v, o: 4096 x 4096; gate, up: 11008 x 4096; down: 4096 x 11008. */
    static const int64_t shapes[3][2] = {{4096, 4096}, {11008, 4096}, {4096, 11008}};
    static const int per_layer[3] = {4, 2, 1};
    static const char *names[3] = {"q/k/v/o", "gate/up", "down"};
    static const enum dtype types[4] = {DTYPE_F16, DTYPE_Q8_0, DTYPE_Q4_K, DTYPE_Q6_K};
    printf("\nprefill, 512 tokens, 7B shapes; %% of the F16 GEMM rate above (%.1f TFLOP/s)\n", gemm_rate / 1e12);
    printf("%-6s %-8s %-13s %12s %7s %7s %12s %7s %7s\n", "type", "op", "rows x cols", "tile 16M us", "TFLOP/s",
           "of F16", "default us", "TFLOP/s", "of F16");
    double layer[4][2];
    for (int k = 0; k < 4; k++) {
        layer[k][0] = layer[k][1] = 0.0;
        for (int s = 0; s < 3; s++) {
            int64_t R = shapes[s][0], C = shapes[s][1];
            double fl = 2.0 * R * C * n;
            double t16 = types[k] == DTYPE_F16 ? 0.0 : prefill_matmul(types[k], R, C, n, 16);
            double td = prefill_matmul(types[k], R, C, n, 0);
            if (types[k] == DTYPE_F16) t16 = td;
            layer[k][0] += per_layer[s] * t16;
            layer[k][1] += per_layer[s] * td;
            printf("%-6s %-8s %5lldx%-7lld %12.1f %7.1f %6.1f%% %12.1f %7.1f %6.1f%%\n", dtype_name(types[k]),
                   names[s], (long long)R, (long long)C, t16 * 1e6, fl / t16 / 1e12, 100.0 * fl / t16 / gemm_rate,
                   td * 1e6, fl / td / 1e12, 100.0 * fl / td / gemm_rate);
            fflush(stdout);
        }
    }
    /* The activation conversion every matmul call does once (F32 -> F16). */
    {
        float *x = dev_random_f32((size_t)n * 11008);
        struct cv_arg c4 = {dev_alloc((size_t)n * 11008 * 2), x, (int64_t)n * 4096};
        struct cv_arg c11 = {c4.dst, x, (int64_t)n * 11008};
        printf("F32->F16 activations, 512 x 4096: %.1f us; 512 x 11008: %.1f us\n", time_median(cv_fn, &c4) * 1e6,
               time_median(cv_fn, &c11) * 1e6);
        backend_dealloc(be, c4.dst);
        backend_dealloc(be, x);
    }

    printf("\nprefill attention, 32 heads x 128, F16 cache, block 16: general kernel vs tensor cores\n");
    printf("%-9s %6s %6s %12s %8s %12s %8s\n", "heads/kv", "rows", "pos0", "general us", "TFLOP/s", "tc us",
           "TFLOP/s");
    static const int32_t cases[4][3] = {{32, 512, 0}, {8, 512, 0}, {32, 512, 1536}, {32, 128, 3968}};
    double att512[2] = {0.0, 0.0};
    for (int c = 0; c < 4; c++) {
        int32_t n_kv = cases[c][0], rows = cases[c][1], pos0 = cases[c][2];
        /* QK^T and PV over the causal context: 4 x head_dim FLOPs per
         * (query head, visible position). */
        double fl = 0.0;
        for (int32_t r = 0; r < rows; r++) fl += 4.0 * 128 * 32 * (pos0 + r + 1);
        double tg = prefill_attention(n_kv, rows, pos0, 0), tt = prefill_attention(n_kv, rows, pos0, 1);
        if (c == 0) {
            att512[0] = tg;
            att512[1] = tt;
        }
        printf("%2d/%-6d %6d %6d %12.1f %8.2f %12.1f %8.2f\n", 32, n_kv, rows, pos0, tg * 1e6, fl / tg / 1e12,
               tt * 1e6, fl / tt / 1e12);
        fflush(stdout);
    }

    /* 32 layers of the above (MHA attention at 512); the norms, rope,
     * swiglu and residual adds are not counted. */
    double fl_model = 32.0 * 2.0 * n * (4.0 * 4096 * 4096 + 3.0 * 11008 * 4096);
    printf("\n32 layers at 512 tokens: matmuls + attention, ms (matmul FLOPs %.2f T; %% of the F16 rate)\n",
           fl_model / 1e12);
    printf("%-6s %22s %22s\n", "type", "before (16M, general)", "now (default, tc)");
    for (int k = 0; k < 4; k++) {
        double before = 32.0 * (layer[k][0] + att512[0]), now = 32.0 * (layer[k][1] + att512[1]);
        printf("%-6s %14.2f (%4.1f%%) %14.2f (%4.1f%%)\n", dtype_name(types[k]), before * 1e3,
               100.0 * fl_model / before / gemm_rate, now * 1e3, 100.0 * fl_model / now / gemm_rate);
    }
}

/* ---- Decode attention, F16 against the 8-bit (Q8_0) cache ----
 * Batch 64 at context 512 and 2048 on 7B heads (32 of 128 over 32 or 8 KV heads),
 * blocks of 16 in order: the same step on an F16 cache (the decode kernel,
 * or the tensor-core one where LLM_CUDA_DECODE_TC_G sends the group there;
 * attention_gqa.cu for the groups) and on a Q8_0 cache (attention_gqa.cu for
 * the groups, attention_q8.cu without).  K and V together are 69 MB (Q8_0,
 * 8 KV heads, context 512) to 2.1 GB, past an H200's 60 MB of L2 (the
 * smallest barely), so no rotation is needed.  Bytes = the K and V
 * rows read (256 a position and KV head in F16, 132 in Q8_0); the rest
 * (q, out, tables) is 1 MB. */
static void attn_kv_compare(double bw, int32_t ctx) {
    const int32_t B = 64, n_heads = 32, hd = 128, bs = 16, per_seq = ctx / bs;
    const int32_t n_blocks = B * per_seq;
    static const int32_t kv_heads[2] = {32, 8};
    static const enum dtype kv_types[2] = {DTYPE_F16, DTYPE_Q8_0};
    printf("\nattention decode, F16 against Q8_0 cache: batch %d, context %d, 32 heads of 128, block 16\n", B, ctx);
    printf("%-9s %-5s %10s %10s %9s %7s %8s\n", "heads/kv", "cache", "MB read", "time us", "GB/s", "of bw",
           "vs F16");
    int32_t tok0[65], pos0[64];
    for (int i = 0; i <= B; i++) tok0[i] = i;
    for (int i = 0; i < B; i++) pos0[i] = ctx - 1;
    int32_t *tables = malloc((size_t)n_blocks * 4);
    if (!tables) die("host alloc");
    for (int32_t i = 0; i < n_blocks; i++) tables[i] = i;
    int32_t *d0 = dev_alloc(sizeof tok0), *dp = dev_alloc(sizeof pos0), *dt = dev_alloc((size_t)n_blocks * 4);
    if (backend_upload(be, d0, tok0, sizeof tok0) || backend_upload(be, dp, pos0, sizeof pos0) ||
        backend_upload(be, dt, tables, (size_t)n_blocks * 4) || backend_sync(be))
        die("upload");
    free(tables);
    float *q = dev_random_f32((size_t)B * n_heads * hd), *out = dev_alloc((size_t)B * n_heads * hd * 4);
    /* A pattern of 32768 random rows, repeated over the cache. */
    const size_t pat_rows = 32768;
    float *f = malloc(pat_rows * hd * sizeof(float));
    void *row_bytes = malloc(pat_rows * hd * 2);
    if (!f || !row_bytes) die("host alloc");
    for (size_t i = 0; i < pat_rows * hd; i++) f[i] = rnd();
    for (int kh = 0; kh < 2; kh++) {
        double t_f16 = 0.0;
        for (int ti = 0; ti < 2; ti++) {
            const enum dtype t = kv_types[ti];
            const int32_t n_kv = kv_heads[kh];
            const size_t rb = backend_kv_row_bytes(t, hd);
            for (size_t r = 0; r < pat_rows; r++)
                if (dtype_quant_row(t, f + r * hd, (uint8_t *)row_bytes + r * rb, hd)) die("quantize pattern");
            struct backend_kv kv;
            if (backend_kv_init(be, &kv, t, n_blocks, bs, n_kv, hd)) die("kv_init");
            const size_t rows = (size_t)n_blocks * bs * n_kv;
            for (size_t off = 0; off < rows; off += pat_rows) {
                size_t m = rows - off < pat_rows ? rows - off : pat_rows;
                if (backend_upload(be, (uint8_t *)kv.k + off * rb, row_bytes, m * rb) ||
                    backend_upload(be, (uint8_t *)kv.v + off * rb, (uint8_t *)row_bytes + (pat_rows - m) * rb,
                                   m * rb) ||
                    backend_sync(be))
                    die("upload kv");
            }
            struct attn_arg a = {&kv, {B, B, per_seq, ctx, d0, dp, dt, 1, 1}, q, out, n_heads};
            const double tm = time_median(attn_fn, &a);
            const double bytes = (double)B * ctx * n_kv * rb * 2;
            if (t == DTYPE_F16) t_f16 = tm;
            printf("%2d/%-6d %-5s %10.1f %10.1f %9.1f %6.1f%% %7.2fx\n", n_heads, n_kv, dtype_name(t), bytes / 1e6,
                   tm * 1e6, bytes / tm / 1e9, 100.0 * bytes / tm / bw, t_f16 / tm);
            backend_kv_free(be, &kv);
        }
    }
    free(f);
    free(row_bytes);
    backend_dealloc(be, q);
    backend_dealloc(be, out);
    backend_dealloc(be, d0);
    backend_dealloc(be, dp);
    backend_dealloc(be, dt);
}

int main(int argc, char **argv) {
    int device = argc > 1 ? atoi(argv[1]) : 0;
    char err[256];
    int rc = backend_cuda_init(&be, device, err, sizeof err);
    if (rc) {
        fprintf(stderr, "bench_cuda: %s\n", err);
        return rc == STATUS_UNAVAILABLE || rc == STATUS_UNSUPPORTED ? 2 : 1;
    }
    size_t fr = 0, tot = 0;
    backend_mem_info(be, &fr, &tot);
    printf("device: %s, %.1f of %.1f GiB free\n", backend_name(be), fr / 1073741824.0, tot / 1073741824.0);

    /* Copy bandwidth: 2 x 512 MiB buffers, bytes read plus bytes written. */
    struct copy_arg ca = {NULL, NULL, (size_t)512 << 20};
    ca.a = dev_random_f32(ca.bytes / 4);
    ca.b = dev_random_f32(ca.bytes / 4);
    double t_copy = time_median(copy_fn, &ca);
    double bw = 2.0 * ca.bytes / t_copy;
    printf("copy bandwidth: %.1f GB/s (device-to-device, %zu MiB, read + write)\n", bw / 1e9, ca.bytes >> 20);
    backend_dealloc(be, ca.a);
    backend_dealloc(be, ca.b);
    /* The 7B layer shapes in every weight-reading type; llama2-7b's and
     * llama3-8b's q/k/v, o, gate/up, down (and the 8B's output) in the
     * K-quants of Q4_K_M and Q5_K_M. */
    static const int64_t shapes7b[4][2] = {{4096, 4096}, {11008, 4096}, {4096, 11008}, {32000, 4096}};
    static const enum dtype types_all[5] = {DTYPE_Q8_0, DTYPE_Q4_0, DTYPE_Q4_K, DTYPE_Q5_K, DTYPE_Q6_K};
    static const int64_t route_shapes[8][2] = {{12288, 4096}, {4096, 4096}, {22016, 4096}, {4096, 11008},
                                               {6144, 4096},  {28672, 4096}, {4096, 14336}, {128256, 4096}};
    static const enum dtype route_types[3] = {DTYPE_Q4_K, DTYPE_Q5_K, DTYPE_Q6_K};
    static const struct cmp_spec gemv = {"matmul batch 1-4, tensor-core kernel (mq) vs matmul_gemv",
                                         {{"LLM_CUDA_GEMV_MAX", "0"}, {"LLM_CUDA_GEMV_MAX", "4"}},
                                         {"mq", "gemv"}, 2, {1, 2, 4}, 3, shapes7b, 4, types_all, 5};
    static const struct cmp_spec wide = {"matmul batch 17-64, mq vs matmul_wide (pipelined, stream-K)",
                                         {{"LLM_CUDA_WIDE", "0"},
                                          {"LLM_CUDA_WIDE_ITEMS", "0"}},
                                         {"mq", "wide"}, 2, {17, 32, 48, 64}, 4, shapes7b, 4, types_all, 5};
    static const struct cmp_spec mmq = {"matmul batch 8-64, the other kernels vs matmul_mmq (int8 tensor cores)",
                                        {{"LLM_CUDA_MMQ_MIN", "0"}, {"LLM_CUDA_MMQ_MIN", "1"}},
                                        {"before", "mmq"}, 2, {8, 16, 32, 64}, 4, shapes7b, 4, types_all, 5};
    static const struct cmp_spec route = {"matmul batch 17-64, mq vs matmul_wide vs matmul_mmq, llama2-7b and "
                                          "llama3-8b shapes",
                                          {{"LLM_CUDA_WIDE", "0", "LLM_CUDA_MMQ_MIN", "0"},
                                           {"LLM_CUDA_WIDE_ITEMS", "0", "LLM_CUDA_MMQ_MIN", "0"},
                                           {"LLM_CUDA_MMQ_MIN", "1"}},
                                          {"mq", "wide", "mmq"}, 3, {17, 24, 32, 40, 48, 56, 64}, 7,
                                          route_shapes, 8, route_types, 3};
    const char *mode = argc > 2 ? argv[2] : "";
    const struct cmp_spec *cmp = strcmp(mode, "gemv") == 0   ? &gemv
                                 : strcmp(mode, "wide") == 0 ? &wide
                                 : strcmp(mode, "mmq") == 0  ? &mmq
                                 : strcmp(mode, "route") == 0 ? &route
                                                              : NULL;
    if (cmp) {
        kernel_compare(device, bw, cmp);
        backend_free(be);
        return 0;
    }

    /* "attn": the attention table alone. */
    const int attn_only = strcmp(mode, "attn") == 0;
    double gemm_rate = attn_only ? 0.0 : gemm_ceiling();
    if (argc > 2 && strcmp(argv[2], "prefill") == 0) {
        prefill_bench(gemm_rate);
        backend_free(be);
        return 0;
    }

    /* Matmul on 7B layer shapes (attention/MLP projections and lm_head). */
    static const int64_t shapes[4][2] = {{4096, 4096}, {11008, 4096}, {4096, 11008}, {32000, 4096}};
    static const enum dtype types[6] = {DTYPE_F16, DTYPE_Q8_0, DTYPE_Q4_0, DTYPE_Q4_K, DTYPE_Q5_K, DTYPE_Q6_K};
    static const int32_t batches[5] = {1, 8, 16, 32, 64};
    printf("\nmatmul (out = x . W^T), median of 5 rounds; bytes = weight + activations + output\n");
    printf("%-6s %-13s %5s %10s %9s %7s %9s\n", "type", "rows x cols", "batch", "time us", "GB/s", "of bw", "TFLOP/s");
    for (int s = 0; s < (attn_only ? 0 : 4); s++)
        for (int k = 0; k < 6; k++) {
            int64_t R = shapes[s][0], C = shapes[s][1];
            size_t wbytes = dtype_row_bytes(types[k], C) * R;
            int n_w = (int)((512u << 20) / wbytes) + 1; /* > 512 MiB in all: far past L2 */
            if (n_w > 16) n_w = 16;
            struct backend_weight ws[16];
            void *hw = host_weight(types[k], R, C);
            for (int i = 0; i < n_w; i++)
                if (backend_weight_load(be, &ws[i], types[k], hw, R, C)) die("weight_load");
            free(hw);
            float *x = dev_random_f32((size_t)64 * C), *out = dev_alloc((size_t)64 * R * 4);
            for (int b = 0; b < 5; b++) {
                struct mm_arg m = {ws, n_w, x, out, batches[b]};
                double t = time_median(mm_fn, &m);
                double bytes = (double)wbytes + 4.0 * batches[b] * (C + R);
                printf("%-6s %5lldx%-7lld %5d %10.1f %9.1f %6.1f%% %9.2f\n", dtype_name(types[k]), (long long)R,
                       (long long)C, batches[b], t * 1e6, bytes / t / 1e9, 100.0 * bytes / t / bw,
                       2.0 * R * C * batches[b] / t / 1e12);
            }
            backend_dealloc(be, x);
            backend_dealloc(be, out);
            for (int i = 0; i < n_w; i++) backend_weight_free(be, &ws[i]);
        }

    /* Attention decode: 32 heads of 128, F16 cache in blocks of 16, every
     * sequence at position 511 (context 512).  Sequences rotate over the
     * cache's blocks between calls. */
    printf("\nattention decode, context 512, F16 cache, block 16, head_dim 128; bytes = K + V read\n");
    printf("%-9s %5s %10s %9s %7s\n", "heads/kv", "batch", "time us", "GB/s", "of bw");
    static const int32_t kv_heads[3] = {32, 8, 4};
    for (int kh = 0; kh < 3; kh++) {
        int32_t n_heads = 32, n_kv = kv_heads[kh], hd = 128, bs = 16, ctx = 512, per_seq = ctx / bs;
        int32_t n_blocks = 64 * per_seq * 2;
        struct backend_kv kv;
        if (backend_kv_init(be, &kv, DTYPE_F16, n_blocks, bs, n_kv, hd)) die("kv_init");
        /* Random F16 values, a 32 MiB pattern repeated over the cache. */
        size_t kv_elems = (size_t)n_blocks * bs * n_kv * hd, pat = (size_t)16 << 20;
        uint16_t *hkv = malloc(pat * 2);
        if (!hkv) die("host alloc");
        for (size_t i = 0; i < pat; i++) hkv[i] = f32_to_fp16(rnd());
        for (size_t off = 0; off < kv_elems; off += pat) {
            size_t m = kv_elems - off < pat ? kv_elems - off : pat;
            if (backend_upload(be, (uint16_t *)kv.k + off, hkv, m * 2) ||
                backend_upload(be, (uint16_t *)kv.v + off, hkv + (pat - m), m * 2) || backend_sync(be))
                die("upload kv");
        }
        free(hkv);
        int32_t *tables = malloc((size_t)n_blocks * 4);
        for (int32_t i = 0; i < n_blocks; i++) tables[i] = i;
        int32_t *dtab = dev_alloc((size_t)n_blocks * 4);
        if (backend_upload(be, dtab, tables, (size_t)n_blocks * 4)) die("upload");
        free(tables);
        static const int32_t bb[7] = {1, 2, 4, 8, 16, 32, 64};
        for (int b = 0; b < 7; b++) {
            int32_t B = bb[b];
            int32_t tok0[65], pos0[64];
            for (int i = 0; i <= B; i++) tok0[i] = i;
            for (int i = 0; i < B; i++) pos0[i] = ctx - 1;
            int32_t *d0 = dev_alloc(sizeof tok0), *dp = dev_alloc(sizeof pos0);
            if (backend_upload(be, d0, tok0, sizeof tok0) || backend_upload(be, dp, pos0, sizeof pos0)) die("upload");
            float *q = dev_random_f32((size_t)B * n_heads * hd), *out = dev_alloc((size_t)B * n_heads * hd * 4);
            int sets = n_blocks / (B * per_seq);
            /* Time by hand: the block-table offset changes every call. */
            double r[5];
            for (int k = 0; k < 6; k++) {
                int iters = 200;
                if (backend_sync(be)) die("sync");
                double t0 = now_s();
                for (int i = 0; i < iters; i++) {
                    struct backend_attn_batch ab = {B, B, per_seq, ctx, d0, dp,
                                                    dtab + (size_t)(i % sets) * B * per_seq, 1, 1};
                    if (backend_attention(be, out, q, &kv, &ab, n_heads, 1.0f / sqrtf((float)hd))) die("attention");
                }
                if (backend_sync(be)) die("sync");
                if (k > 0) r[k - 1] = (now_s() - t0) / iters; /* round 0 warms up */
            }
            for (int x = 0; x < 5; x++)
                for (int y = x + 1; y < 5; y++)
                    if (r[y] < r[x]) {
                        double t = r[x];
                        r[x] = r[y];
                        r[y] = t;
                    }
            double t = r[2];
            double bytes = (double)B * ctx * n_kv * hd * 2 * 2;
            printf("%2d/%-6d %5d %10.1f %9.1f %6.1f%%\n", n_heads, n_kv, B, t * 1e6, bytes / t / 1e9,
                   100.0 * bytes / t / bw);
            backend_dealloc(be, d0);
            backend_dealloc(be, dp);
            backend_dealloc(be, q);
            backend_dealloc(be, out);
        }
        backend_dealloc(be, dtab);
        backend_kv_free(be, &kv);
    }
    attn_kv_compare(bw, 512);
    attn_kv_compare(bw, 2048);
    if (!attn_only) crossover(device, bw);
    backend_free(be);
    return 0;
}
