/* bench_gpu: the engine's speed on one backend (the CUDA issue's speed
 * table).  For synthetic models of real shapes and weight mixes it prints
 * decode tokens/s at several batch sizes (every sequence at a ~512-token
 * context) and prefill tokens/s of one prompt, each set against a ceiling
 * measured by the same program in the same run through the backend's own
 * ops: decode against the copy bandwidth (bytes a step must read: weights
 * plus the KV cache), prefill against the F16 GEMM rate.  This file measures
 * (the ceilings, each model's prefill, decode and --verify steps) and runs
 * the models; the options are gpu_options.c's, the rows and the table and
 * JSON written from them gpu_report.c's.
 *
 *   bench_gpu --device cuda:0 [--shapes tinyllama-1.1b,llama2-7b]
 *             [--types f16,q8_0,q4_k_m] [--batches 1,8,32,64] [--ctx 512]
 *   bench_gpu --shapes llama2-7b --types q4_k_m --kv-type f16,q8_0 --batches 1,64 --ctx 2048
 *             (and the capacity line: sequences of --capacity-ctx in --capacity-budget, F16 vs Q8_0 KV)
 *   bench_gpu --device cpu --shapes tiny     (a quick run without a GPU)
 *   bench_gpu --device cpu --model pycode-target-f16.gguf --batches 1 --verify 4
 *             (a model file instead of synthetic shapes: no targets)
 *   bench_gpu --shapes llama2-7b --types q4_k_m --batches 1 --verify 4
 *             (speculation's verification cost: one sequence's step of 4 + 1
 *             tokens against a one-token step at the same context) */
#include "bench/gpu_options.h"
#include "bench/gpu_report.h"

#include "common/dtype.h"
#include "common/kvblocks.h"
#include "common/log.h"
#include "common/model.h"
#include "common/status.h"
#include "kernels/backend.h"
#include "worker/forward.h"
#include "worker/kvcache.h"
#include "worker/stage.h"
#include "worker/synth.h"

#include <errno.h>
#include <signal.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <time.h>
#include <unistd.h>

/* Set by SIGTERM/SIGINT (a time limit): the run stops after the current
 * step and still prints the rows it has. */
static volatile sig_atomic_t bench_stop;
static void bench_on_signal(int sig) {
    (void)sig;
    bench_stop = 1;
}

static double bench_now(void) {
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (double)ts.tv_sec + (double)ts.tv_nsec * 1e-9;
}

static int bench_cmp_double(const void *a, const void *b) {
    double x = *(const double *)a, y = *(const double *)b;
    return x < y ? -1 : x > y;
}

/* Median of n values (sorts v). */
static double bench_median(double *v, int n) {
    qsort(v, (size_t)n, sizeof *v, bench_cmp_double);
    return n % 2 ? v[n / 2] : 0.5 * (v[n / 2 - 1] + v[n / 2]);
}

/* ---- Ceilings, measured through the backend's ops ---- */

/* Runs fn repeatedly: a warm-up, then rounds of enough calls to last about
 * 50 ms each, synchronized; returns the median per-call time, or < 0 on a
 * backend failure. */
typedef int (*bench_fn)(backend *b, void *arg, int i);
static double bench_time_op(backend *b, bench_fn fn, void *arg) {
    if (fn(b, arg, 0) || backend_sync(b)) return -1;
    double t0 = bench_now();
    if (fn(b, arg, 1) || backend_sync(b)) return -1;
    double one = bench_now() - t0;
    int iters = (int)(0.05 / (one > 1e-6 ? one : 1e-6));
    if (iters < 1) iters = 1;
    if (iters > 1000) iters = 1000;
    double r[5];
    for (int k = 0; k < 5; k++) {
        t0 = bench_now();
        for (int i = 0; i < iters; i++)
            if (fn(b, arg, i)) return -1;
        if (backend_sync(b)) return -1;
        r[k] = (bench_now() - t0) / iters;
    }
    return bench_median(r, 5);
}

struct bench_copy_arg {
    void *x, *y;
    size_t bytes;
};
static int bench_copy_fn(backend *b, void *arg, int i) {
    struct bench_copy_arg *c = arg;
    return i % 2 ? backend_copy(b, c->x, c->y, c->bytes) : backend_copy(b, c->y, c->x, c->bytes);
}

struct bench_mm_arg {
    const struct backend_weight *w;
    float *x, *out;
    int32_t n;
};
static int bench_mm_fn(backend *b, void *arg, int i) {
    (void)i;
    struct bench_mm_arg *m = arg;
    return backend_matmul(b, m->out, m->w, m->x, m->n);
}

struct bench_cv_arg {
    void *dst;
    const float *src;
    int64_t n;
};
static int bench_cv_fn(backend *b, void *arg, int i) {
    (void)i;
    struct bench_cv_arg *c = arg;
    return backend_convert(b, c->dst, DTYPE_F16, c->src, DTYPE_F32, c->n);
}

/* Fills bytes of backend memory at dst with pseudo-random values in
 * [-1, 1) of type t (F16 or F32), a 16 MiB pattern repeated (uploading in
 * pieces keeps host memory small). */
static int bench_fill(backend *b, void *dst, size_t bytes, enum dtype t, uint32_t seed) {
    size_t pat = (size_t)16 << 20;
    if (pat > bytes) pat = bytes;
    void *h = malloc(pat);
    if (!h) return STATUS_NO_MEMORY;
    size_t esz = t == DTYPE_F32 ? 4 : 2;
    for (size_t i = 0; i < pat / esz; i++) {
        seed = seed * 1664525u + 1013904223u;
        float v = (float)((seed >> 9) & 0xffff) / 32768.0f - 1.0f;
        if (t == DTYPE_F32) ((float *)h)[i] = v;
        else ((uint16_t *)h)[i] = f32_to_fp16(v);
    }
    int rc = STATUS_OK;
    for (size_t off = 0; off < bytes && rc == STATUS_OK; off += pat) {
        size_t m = bytes - off < pat ? bytes - off : pat;
        rc = backend_upload(b, (uint8_t *)dst + off, h, m);
        if (rc == STATUS_OK) rc = backend_sync(b); /* h is reused by the next piece */
    }
    free(h);
    return rc;
}

static int bench_ceilings_measure(backend *b, const struct gpu_options *o, struct gpu_report_ceilings *c, char *err,
                                  size_t errlen) {
    int gpu = backend_is_gpu(b);
    memset(c, 0, sizeof *c);

    /* Bandwidth: back-and-forth copies between two buffers far larger than
     * any cache; a copy reads and writes every byte, both are counted. */
    size_t cb = (size_t)(o->copy_bytes > 0 ? o->copy_bytes : gpu ? (int64_t)2 << 30 : (int64_t)256 << 20);
    struct bench_copy_arg ca = {backend_alloc(b, cb), backend_alloc(b, cb), cb};
    int rc = STATUS_OK;
    double t = -1;
    if (!ca.x || !ca.y) {
        snprintf(err, errlen, "bandwidth buffers of 2 x %zu MiB: %s", cb >> 20, backend_errstr(b));
        rc = STATUS_NO_MEMORY;
    } else if ((rc = bench_fill(b, ca.x, cb, DTYPE_F16, 1)) != STATUS_OK || (rc = bench_fill(b, ca.y, cb, DTYPE_F16, 2)) != STATUS_OK ||
               (t = bench_time_op(b, bench_copy_fn, &ca)) < 0) {
        snprintf(err, errlen, "bandwidth copy of %zu MiB: %s", cb >> 20, backend_errstr(b));
        if (rc == STATUS_OK) rc = STATUS_INTERNAL;
    }
    if (ca.x) backend_dealloc(b, ca.x);
    if (ca.y) backend_dealloc(b, ca.y);
    if (rc != STATUS_OK) return rc;
    c->bw = 2.0 * (double)cb / t;
    snprintf(c->bw_how, sizeof c->bw_how,
             "backend_copy between two %zu MiB buffers, bytes read + bytes written, median of 5 rounds", cb >> 20);

    /* GEMM rate: an F16 weight of gs x gs times gt tokens.  The CUDA backend
     * converts the F32 activations to F16 before cuBLAS; that conversion is
     * timed alone and subtracted so the figure is cuBLAS's own rate. */
    int64_t gs = o->gemm_size > 0 ? o->gemm_size : gpu ? 8192 : 1024;
    int32_t gt = o->gemm_tokens > 0 ? o->gemm_tokens : gpu ? 4096 : 128;
    size_t wbytes = (size_t)gs * (size_t)gs * 2;
    uint16_t *hw = malloc(wbytes);
    struct backend_weight w;
    memset(&w, 0, sizeof w);
    struct bench_mm_arg ma = {&w, NULL, NULL, gt};
    struct bench_cv_arg cv = {NULL, NULL, (int64_t)gt * gs};
    int loaded = 0;
    if (!hw) {
        snprintf(err, errlen, "GEMM weight of %zu MiB: host out of memory", wbytes >> 20);
        return STATUS_NO_MEMORY;
    }
    uint32_t seed = 7;
    for (size_t i = 0; i < (size_t)gs * (size_t)gs; i++) {
        seed = seed * 1664525u + 1013904223u;
        hw[i] = f32_to_fp16((float)((seed >> 9) & 0xffff) / 32768.0f - 1.0f);
    }
    rc = backend_weight_load(b, &w, DTYPE_F16, hw, gs, gs);
    loaded = rc == STATUS_OK;
    ma.x = backend_alloc(b, (size_t)gt * (size_t)gs * sizeof(float));
    ma.out = backend_alloc(b, (size_t)gt * (size_t)gs * sizeof(float));
    if (gpu) cv.dst = backend_alloc(b, (size_t)gt * (size_t)gs * 2);
    cv.src = ma.x;
    double tm = -1, tc = 0;
    if (rc != STATUS_OK || !ma.x || !ma.out || (gpu && !cv.dst)) {
        snprintf(err, errlen, "GEMM %lldx%lld x %d tokens: %s", (long long)gs, (long long)gs, gt, backend_errstr(b));
        if (rc == STATUS_OK) rc = STATUS_NO_MEMORY;
    } else if ((rc = bench_fill(b, ma.x, (size_t)gt * (size_t)gs * sizeof(float), DTYPE_F32, 3)) != STATUS_OK) {
        snprintf(err, errlen, "GEMM activations: %s", backend_errstr(b));
    } else {
        tm = bench_time_op(b, bench_mm_fn, &ma);
        if (tm >= 0 && gpu) tc = bench_time_op(b, bench_cv_fn, &cv);
        if (tm < 0 || tc < 0) {
            snprintf(err, errlen, "GEMM %lldx%lld x %d tokens: %s", (long long)gs, (long long)gs, gt,
                     backend_errstr(b));
            rc = STATUS_INTERNAL;
        }
    }
    free(hw);
    if (loaded) backend_weight_free(b, &w);
    if (ma.x) backend_dealloc(b, ma.x);
    if (ma.out) backend_dealloc(b, ma.out);
    if (cv.dst) backend_dealloc(b, cv.dst);
    if (rc != STATUS_OK) return rc;
    double flops = 2.0 * (double)gs * (double)gs * gt;
    c->gemm_conv = flops / tm;
    c->gemm = tc > 0 && tc < tm ? flops / (tm - tc) : c->gemm_conv;
    if (gpu)
        snprintf(c->gemm_how, sizeof c->gemm_how,
                 "backend_matmul, F16 weight %lldx%lld x %d tokens (cuBLAS F16 x F16 -> F32); the backend's "
                 "F32->F16 activation conversion (%.3f of %.3f ms) timed alone and subtracted; "
                 "with it: %.1f TFLOP/s",
                 (long long)gs, (long long)gs, gt, tc * 1e3, tm * 1e3, c->gemm_conv / 1e12);
    else
        snprintf(c->gemm_how, sizeof c->gemm_how, "backend_matmul, F16 weight %lldx%lld x %d tokens (CPU backend)",
                 (long long)gs, (long long)gs, gt);
    return STATUS_OK;
}

/* ---- One model ---- */
/* KV bytes of one sequence of ctx positions: K and V of every layer and KV
 * head, rows of the backend's own size for the type (kernels/backend.h),
 * positions rounded up to whole blocks as the paged cache holds them. */
static double bench_kv_seq_bytes(const struct model_hparams *hp, enum dtype kv, int32_t ctx, int32_t block) {
    int64_t positions = ((int64_t)ctx + block - 1) / block * block;
    return (double)positions * hp->n_layers * hp->n_kv_heads * 2.0 * (double)backend_kv_row_bytes(kv, hp->head_dim);
}

static const char *bench_kv_name(enum dtype kv) {
    return kv == DTYPE_Q8_0 ? "q8_0" : kv == DTYPE_F32 ? "f32" : "f16";
}

/* A synthetic mix's name, or "file" for --model (SYNTH_TYPE_COUNT). */
static const char *bench_type_name(enum synth_type t) {
    return (int)t >= 0 && (int)t < SYNTH_TYPE_COUNT ? synth_type_names[t] : "file";
}

/* The H100 targets: batch-1 decode of the 7B shape >= 80% of the
 * bandwidth (F16, Q8_0) or >= 70% (Q4_K_M); batch-64 decode >= 70% counting
 * KV bytes; prefill >= 50% of the cuBLAS F16 rate.  The batch-64 and
 * prefill targets are applied to every shape. */
static double bench_target(const char *shape, enum synth_type type, int prefill, int32_t batch) {
    if (prefill) return 0.50;
    if (batch == 64) return 0.70;
    if (batch == 1 && strcmp(shape, "llama2-7b") == 0) {
        if (type == SYNTH_F16 || type == SYNTH_Q8_0) return 0.80;
        if (type == SYNTH_Q4_K_M) return 0.70;
    }
    return -1;
}

/* Model FLOPs of a causal prefill of n tokens from position 0: 2 per
 * multiply-add of every layer matmul, attention's QK^T and PV over the
 * causal triangle, and lm_head for the one row that gets logits. */
static double bench_prefill_flops(const struct model_hparams *hp, int32_t n) {
    double d = hp->dim, hd = hp->head_dim, q = (double)hp->n_heads * hd, kv = (double)hp->n_kv_heads * hd;
    double per_tok = d * q + 2.0 * d * kv + q * d + 3.0 * d * hp->ffn_dim;
    double mm = 2.0 * per_tok * n * hp->n_layers;
    double att = 4.0 * hd * ((double)n * (n + 1) / 2.0) * hp->n_heads * hp->n_layers;
    return mm + att + 2.0 * d * hp->n_vocab;
}

/* One timed step (synchronized), in seconds; < 0 on failure (err says). */
static double bench_step_time(stage *s, backend *b, const struct forward_batch *fb, struct forward_out *fo,
                              char *err, size_t errlen) {
    double t0 = bench_now();
    if (forward_step(s, fb, fo, err, errlen) != STATUS_OK) return -1;
    if (backend_sync(b) != STATUS_OK) {
        snprintf(err, errlen, "sync: %s", backend_errstr(b));
        return -1;
    }
    return bench_now() - t0;
}

/* --verify: sequence 0 (KV of o->ctx positions in tab) decodes one token
 * at position ctx, then K + 1 tokens from there with every row sampled;
 * the two kinds of step alternate (warm-up first) so that both see the
 * same clocks and caches.  Adds a gpu_report_verify. */
static int bench_verify_run(stage *s, backend *b, struct forward_batch *fb, struct forward_out *fo,
                            struct forward_seq *seqs, const struct kvblocks_table *tab, const int32_t *toks,
                            double *times, const char *shape, enum synth_type type, enum dtype kv,
                            const struct gpu_options *o, char *err, size_t errlen) {
    int32_t k1 = o->verify + 1;
    struct forward_seq one = {toks, 1, o->ctx, tab->ids, tab->n_ids, FORWARD_LOGITS_LAST};
    struct forward_seq many = {toks, k1, o->ctx, tab->ids, tab->n_ids, FORWARD_LOGITS_ALL};
    fb->n_seqs = 1;
    double *t_many = times + o->steps; /* the caller's times hold 2 * steps */
    for (int k = 0; k < o->warmup + o->steps && !bench_stop; k++) {
        seqs[0] = one;
        double a = bench_step_time(s, b, fb, fo, err, errlen);
        seqs[0] = many;
        double c = a < 0 ? -1 : bench_step_time(s, b, fb, fo, err, errlen);
        if (a < 0 || c < 0) return STATUS_INTERNAL;
        if (c >= 0 && fo->n_logits != k1) {
            snprintf(err, errlen, "--verify: the %d-token step sampled %d rows", k1, fo->n_logits);
            return STATUS_INTERNAL;
        }
        if (k >= o->warmup) {
            times[k - o->warmup] = a;
            t_many[k - o->warmup] = c;
        }
    }
    if (bench_stop) return STATUS_OK;
    struct gpu_report_verify *v = gpu_report_verify_add(shape, bench_type_name(type), bench_kv_name(kv));
    if (!v) return STATUS_OK;
    v->ctx = o->ctx;
    v->k = o->verify;
    v->ms_one = bench_median(times, o->steps) * 1e3;
    v->ms_k1 = bench_median(t_many, o->steps) * 1e3;
    fprintf(stderr, "bench_gpu: %s %s verify at context %d: 1 token %.3f ms, %d tokens %.3f ms: %.2fx\n", shape,
            bench_type_name(type), o->ctx, v->ms_one, k1, v->ms_k1, v->ms_k1 / v->ms_one);
    return STATUS_OK;
}

/* Prefill and decode of the model at path on b; adds rows (and a capacity
 * line, and --verify's) to the report.  Everything allocated here is
 * released before returning, on success and failure. */
static int bench_model(backend *b, const char *path, const char *shape, enum synth_type type, enum dtype kv,
                       const struct gpu_options *o, const struct gpu_report_ceilings *c, char *err, size_t errlen) {
    model_file *m = NULL;
    stage *s = NULL;
    kvblocks *kb = NULL;
    struct kvblocks_table *tabs = NULL;
    struct forward_seq *seqs = NULL;
    struct kvblocks_copy *copies = NULL;
    float *logits = NULL;
    struct backend_sample_row *srows = NULL;
    static const struct sampling_params greedy; /* all zero: argmax */
    int32_t *ids = NULL;
    double *times = NULL;
    int32_t B = o->batch_max;
    /* Rows of logits a step may sample: a batch's, or the K + 1 of --verify. */
    int32_t R = o->verify + 1 > B ? o->verify + 1 : B;
    int rc = model_file_open(&m, path, err, errlen);
    if (rc != STATUS_OK) goto done;
    const struct model_hparams *hp = model_file_hparams(m);

    int32_t n_ctx = o->prompt > o->ctx + 1 + o->verify ? o->prompt : o->ctx + 1 + o->verify;
    struct stage_config cfg;
    stage_config_default(&cfg);
    cfg.n_seqs_max = B;
    cfg.n_tokens_max = o->prompt > o->ctx ? o->prompt : o->ctx;
    if (cfg.n_tokens_max < R) cfg.n_tokens_max = R;
    cfg.n_ctx_max = n_ctx;
    cfg.n_logits_max = R;
    cfg.kv_type = kv;
    double t0 = bench_now();
    rc = stage_init(&s, m, b, &cfg, err, errlen);
    if (rc != STATUS_OK) goto done;
    const struct stage_config *sc = stage_config_get(s);
    kvcache *kc = stage_kvcache(s);
    fprintf(stderr, "bench_gpu: %s %s: loaded in %.1f s: weights %.2f GB read per token, KV pool %.2f GB "
            "(%d blocks of %d, %s)\n", shape, bench_type_name(type), bench_now() - t0,
            (double)stage_weight_bytes(s) / 1e9, (double)kvcache_bytes(kc) / 1e9, sc->n_blocks, sc->block_size,
            bench_kv_name(kv));
    if (o->cap_budget > 0) {
        struct gpu_report_cap *cap = gpu_report_cap_add(shape, bench_type_name(type));
        if (cap) {
            struct stat st;
            cap->weight_bytes = stat(path, &st) == 0 ? (double)st.st_size : 0;
            static const enum dtype kvs[2] = {DTYPE_F16, DTYPE_Q8_0};
            for (int k = 0; k < 2; k++) {
                cap->kv_seq[k] = bench_kv_seq_bytes(hp, kvs[k], o->cap_ctx, sc->block_size);
                double left = (double)o->cap_budget - cap->weight_bytes;
                cap->seqs[k] = left > 0 ? (int64_t)(left / cap->kv_seq[k]) : 0;
            }
        }
    }

    rc = kvblocks_init(&kb, sc->n_blocks, sc->block_size, err, errlen);
    if (rc != STATUS_OK) goto done;
    int n_times = 2 * o->steps > o->prefill_reps ? 2 * o->steps : o->prefill_reps;
    tabs = calloc((size_t)B, sizeof *tabs);
    seqs = calloc((size_t)B, sizeof *seqs);
    copies = calloc((size_t)(n_ctx / sc->block_size + 1), sizeof *copies);
    logits = o->logits ? malloc(sizeof(float) * (size_t)R * (size_t)hp->n_vocab) : NULL;
    srows = calloc((size_t)R, sizeof *srows);
    ids = malloc(sizeof(int32_t) * (size_t)(cfg.n_tokens_max + R));
    times = malloc(sizeof(double) * (size_t)n_times);
    if (!tabs || !seqs || !copies || (o->logits && !logits) || !srows || !ids || !times) {
        rc = STATUS_NO_MEMORY;
        snprintf(err, errlen, "host out of memory for %d sequences of %d positions", B, n_ctx);
        goto done;
    }
    for (int32_t i = 0; i < B; i++) kvblocks_table_init(&tabs[i]);
    for (int32_t i = 0; i < B; i++) {
        rc = kvblocks_reserve(kb, &tabs[i], n_ctx, NULL, NULL);
        if (rc != STATUS_OK) {
            snprintf(err, errlen, "KV blocks exhausted reserving %d positions for sequence %d", n_ctx, i);
            goto done;
        }
    }
    uint32_t seed = 12345;
    for (int32_t i = 0; i < cfg.n_tokens_max + R; i++) {
        seed = seed * 1664525u + 1013904223u;
        ids[i] = 3 + (int32_t)((seed >> 8) % (uint32_t)(hp->n_vocab - 3));
    }

    /* Prefill: one prompt of o->prompt tokens from position 0, into sequence
     * 0's blocks (each repetition overwrites the same KV). */
    for (int32_t i = 0; i < R; i++) srows[i].params = &greedy;
    struct forward_out fo = {logits, 0, NULL, o->logits ? NULL : srows};
    seqs[0] = (struct forward_seq){ids, o->prompt, 0, tabs[0].ids, tabs[0].n_ids, FORWARD_LOGITS_LAST};
    struct forward_batch fb = {seqs, 1, NULL, 0, NULL, 0};
    rc = forward_step(s, &fb, &fo, err, errlen); /* warm-up */
    for (int k = 0; k < o->prefill_reps && rc == STATUS_OK; k++) {
        t0 = bench_now();
        rc = forward_step(s, &fb, &fo, err, errlen);
        times[k] = bench_now() - t0;
    }
    if (rc != STATUS_OK) goto done;
    struct gpu_report_row *r = gpu_report_row_add(shape, bench_type_name(type), "prefill");
    if (r) {
        snprintf(r->kv, sizeof r->kv, "%s", bench_kv_name(kv));
        double t = bench_median(times, o->prefill_reps);
        r->batch = 1;
        r->ctx = o->prompt;
        r->ms_step = t * 1e3;
        r->tok_s = o->prompt / t;
        r->flops_step = bench_prefill_flops(hp, o->prompt);
        r->achieved = r->flops_step / t;
        r->frac = r->achieved / c->gemm;
        r->target = bench_target(shape, type, 1, 1);
    }

    /* Decode context: sequence 0 holds o->ctx positions of KV (a prefill of
     * that length); every other sequence gets a private copy of those
     * blocks, so each reads its own memory as real sequences do. */
    if (o->prompt != o->ctx) {
        seqs[0].n_tokens = o->ctx;
        rc = forward_step(s, &fb, &fo, err, errlen);
        if (rc != STATUS_OK) goto done;
    }
    int32_t n_full = (o->ctx + sc->block_size - 1) / sc->block_size;
    for (int32_t i = 1; i < B && rc == STATUS_OK; i++) {
        for (int32_t j = 0; j < n_full; j++) copies[j] = (struct kvblocks_copy){tabs[0].ids[j], tabs[i].ids[j]};
        rc = kvcache_copy_blocks(kc, copies, n_full, err, errlen);
    }
    if (rc == STATUS_OK && backend_sync(b) != STATUS_OK) {
        rc = STATUS_INTERNAL;
        snprintf(err, errlen, "KV copies: %s", backend_errstr(b));
    }
    if (rc != STATUS_OK) goto done;

    /* Decode: every sequence brings one token at position o->ctx, so each
     * step attends over ctx + 1 positions; repeating the same position
     * keeps the context fixed across the timed steps. */
    double kv_per_seq =
        (double)(o->ctx + 1) * hp->n_layers * hp->n_kv_heads * 2.0 * (double)backend_kv_row_bytes(kv, hp->head_dim);
    for (int bi = 0; bi < o->n_batches && rc == STATUS_OK && !bench_stop; bi++) {
        int32_t nb = o->batch_v[bi];
        for (int32_t i = 0; i < nb; i++)
            seqs[i] = (struct forward_seq){&ids[cfg.n_tokens_max + i], 1, o->ctx, tabs[i].ids, tabs[i].n_ids,
                                           FORWARD_LOGITS_LAST};
        fb.n_seqs = nb;
        for (int k = 0; k < o->warmup && rc == STATUS_OK; k++) rc = forward_step(s, &fb, &fo, err, errlen);
        for (int k = 0; k < o->steps && rc == STATUS_OK; k++) {
            t0 = bench_now();
            /* The step downloads the tokens (or the logits), so it has
             * finished on return; the sync only makes that explicit. */
            rc = forward_step(s, &fb, &fo, err, errlen);
            if (rc == STATUS_OK && backend_sync(b) != STATUS_OK) {
                rc = STATUS_INTERNAL;
                snprintf(err, errlen, "sync: %s", backend_errstr(b));
            }
            times[k] = bench_now() - t0;
        }
        if (rc != STATUS_OK) break;
        r = gpu_report_row_add(shape, bench_type_name(type), "decode");
        if (!r) continue;
        snprintf(r->kv, sizeof r->kv, "%s", bench_kv_name(kv));
        double t = bench_median(times, o->steps);
        r->batch = nb;
        r->ctx = o->ctx;
        r->ms_step = t * 1e3;
        r->tok_s = nb / t;
        r->bytes_step = (double)stage_weight_bytes(s) + nb * kv_per_seq;
        r->achieved = r->bytes_step / t;
        r->frac = r->achieved / c->bw;
        r->target = bench_target(shape, type, 0, nb);
        fprintf(stderr, "bench_gpu: %s %s decode batch %d, %s KV: %.2f ms/step, %.1f tokens/s, %.1f%% of "
                "bandwidth\n", shape, bench_type_name(type), nb, bench_kv_name(kv), r->ms_step, r->tok_s,
                100.0 * r->frac);
    }
    if (rc == STATUS_OK && o->verify > 0 && !bench_stop)
        rc = bench_verify_run(s, b, &fb, &fo, seqs, &tabs[0], ids + cfg.n_tokens_max, times, shape, type, kv, o, err,
                              errlen);
done:
    if (tabs && kb)
        for (int32_t i = 0; i < B; i++) kvblocks_table_free(kb, &tabs[i]);
    free(tabs);
    free(seqs);
    free(copies);
    free(logits);
    free(srows);
    free(ids);
    free(times);
    kvblocks_free(kb);
    stage_free(s);
    model_file_close(m);
    return rc;
}

/* The synthetic model of sc at path: a file already there (--model-cache,
 * written by an earlier run, whole since it was renamed into place), else
 * written now, through a name of its own when it is to be kept so that a
 * run cut short leaves no partial file under the kept name. */
static int bench_synth(const struct synth_config *sc, const char *path, int keep, char *err, size_t errlen) {
    struct stat st;
    if (keep && stat(path, &st) == 0 && S_ISREG(st.st_mode) && st.st_size > 0) {
        fprintf(stderr, "bench_gpu: reused %s (%.2f GB), kept by an earlier run\n", path, (double)st.st_size / 1e9);
        return STATUS_OK;
    }
    char part[4300];
    snprintf(part, sizeof part, "%s.%d.part", path, (int)getpid());
    const double t0 = bench_now();
    int rc = synth_write(sc, keep ? part : path, err, errlen);
    if (rc == STATUS_OK && keep && rename(part, path) != 0)
        rc = status_fail(err, errlen, STATUS_IO, "--model-cache: cannot rename %s to %s: %s", part, path,
                         strerror(errno));
    if (rc != STATUS_OK) {
        if (keep) unlink(part);
        return rc;
    }
    fprintf(stderr, "bench_gpu: wrote %s (%.2f GB) in %.1f s\n", path,
            stat(path, &st) == 0 ? (double)st.st_size / 1e9 : 0.0, bench_now() - t0);
    return STATUS_OK;
}

int main(int argc, char **argv) {
    struct gpu_options o;
    char err[1024];
    int rc = gpu_options_parse(&o, argc, argv, err, sizeof err);
    if (rc == STATUS_CANCELLED) return 0;
    if (rc != STATUS_OK) {
        fprintf(stderr, "bench_gpu: %s\n", err);
        return 2;
    }
    if (o.model_cache && mkdir(o.model_cache, 0755) != 0 && errno != EEXIST) {
        fprintf(stderr, "bench_gpu: --model-cache %s: cannot create the folder: %s\n", o.model_cache,
                strerror(errno));
        return 2;
    }
    struct stat cst;
    if (o.model_cache && (stat(o.model_cache, &cst) != 0 || !S_ISDIR(cst.st_mode))) {
        fprintf(stderr, "bench_gpu: --model-cache %s: not a folder\n", o.model_cache);
        return 2;
    }
    log_set_level(LL_WARN);
    struct sigaction sa;
    memset(&sa, 0, sizeof sa);
    sa.sa_handler = bench_on_signal;
    sigaction(SIGTERM, &sa, NULL);
    sigaction(SIGINT, &sa, NULL);

    backend *b = NULL;
    rc = o.device_id < 0 ? backend_cpu_init(&b, o.threads, err, sizeof err)
                         : backend_cuda_init(&b, o.device_id, err, sizeof err);
    if (rc != STATUS_OK) {
        fprintf(stderr, "bench_gpu: --device %s: %s (%s)%s\n", o.device, err, status_str(rc),
                rc == STATUS_UNSUPPORTED ? "; this build has no CUDA backend: rebuild where nvcc is found, or use "
                                           "--device cpu"
                : rc == STATUS_UNAVAILABLE ? "; no such GPU here: use --device cpu for a CPU run" : "");
        return 2;
    }
    char devname[256];
    size_t mfree = 0, mtot = 0;
    backend_mem_info(b, &mfree, &mtot);
    snprintf(devname, sizeof devname, "%s, %.1f of %.1f GiB free", backend_name(b), mfree / 1073741824.0,
             mtot / 1073741824.0);
    fprintf(stderr, "bench_gpu: backend %s\n", devname);

    struct gpu_report_ceilings c;
    rc = bench_ceilings_measure(b, &o, &c, err, sizeof err);
    if (rc != STATUS_OK) {
        fprintf(stderr, "bench_gpu: ceilings: %s\n", err);
        backend_free(b);
        return 1;
    }
    fprintf(stderr, "bench_gpu: bandwidth %.1f GB/s; GEMM %.2f TFLOP/s (%.2f with conversion)\n", c.bw / 1e9,
            c.gemm / 1e12, c.gemm_conv / 1e12);

    char dir[4096];
    snprintf(dir, sizeof dir, "%s/bench_gpu_XXXXXX", o.tmpdir);
    if (!mkdtemp(dir)) {
        fprintf(stderr, "bench_gpu: --tmpdir %s: cannot create a folder: %s\n", o.tmpdir, strerror(errno));
        backend_free(b);
        return 1;
    }
    int failed = 0;
    if (o.model) {
        const char *base = strrchr(o.model, '/') ? strrchr(o.model, '/') + 1 : o.model;
        for (int ki = 0; ki < o.n_kv && rc == STATUS_OK && !bench_stop; ki++)
            rc = bench_model(b, o.model, base, SYNTH_TYPE_COUNT, o.kv_v[ki], &o, &c, err, sizeof err);
        if (rc != STATUS_OK) {
            fprintf(stderr, "bench_gpu: --model %s: %s\n", o.model, err);
            failed = 1;
        }
        o.n_shapes = 0; /* no synthetic models */
    }
    for (int si = 0; si < o.n_shapes && !bench_stop; si++)
        for (int ti = 0; ti < o.n_types && !bench_stop; ti++) {
            struct synth_config sc;
            memset(&sc, 0, sizeof sc);
            synth_shape_preset(o.shape_v[si], &sc.shape);
            sc.type = o.type_v[ti];
            sc.seed = 1;
            sc.n_threads = o.threads;
            char path[4200];
            snprintf(path, sizeof path, "%s/%s-%s.gguf", o.model_cache ? o.model_cache : dir, o.shape_v[si],
                     synth_type_names[sc.type]);
            rc = bench_synth(&sc, path, o.model_cache != NULL, err, sizeof err);
            if (rc == STATUS_OK) {
                for (int ki = 0; !o.ab && ki < o.n_kv && rc == STATUS_OK && !bench_stop; ki++)
                    rc = bench_model(b, path, o.shape_v[si], sc.type, o.kv_v[ki], &o, &c, err, sizeof err);
                /* Runs: as given, V1 .. Vk, Vk .. V1, as given. */
                for (int k = 0; o.ab && k < 2 * o.ab_n + 2 && rc == STATUS_OK && !bench_stop; k++) {
                    const char *val =
                        k == 0 || k == 2 * o.ab_n + 1 ? NULL : o.ab_vals[k <= o.ab_n ? k - 1 : 2 * o.ab_n - k];
                    if (val) setenv(o.ab_var, val, 1);
                    else if (o.ab_had) setenv(o.ab_var, o.ab_old, 1);
                    else unsetenv(o.ab_var);
                    gpu_report_set_setting(o.ab_var, val ? val : o.ab_had ? o.ab_old : "(unset)");
                    backend *bk = NULL;
                    rc = o.device_id < 0 ? backend_cpu_init(&bk, o.threads, err, sizeof err)
                                         : backend_cuda_init(&bk, o.device_id, err, sizeof err);
                    for (int ki = 0; ki < o.n_kv && rc == STATUS_OK && !bench_stop; ki++)
                        rc = bench_model(bk, path, o.shape_v[si], sc.type, o.kv_v[ki], &o, &c, err, sizeof err);
                    backend_free(bk);
                }
            }
            if (rc != STATUS_OK) {
                fprintf(stderr, "bench_gpu: %s %s: %s\n", o.shape_v[si], synth_type_names[sc.type], err);
                failed = 1;
            }
            if (!o.model_cache) unlink(path);
        }
    rmdir(dir);
    if (bench_stop) {
        fprintf(stderr, "bench_gpu: stopped by a signal; the table has the rows measured so far\n");
        failed = 1;
    }
    gpu_report_print_table(stdout, devname, &c, &o);
    if (o.json && gpu_report_write_json(o.json, devname, &c, &o, err, sizeof err) != STATUS_OK) {
        fprintf(stderr, "bench_gpu: %s\n", err);
        failed = 1;
    }
    backend_free(b);
    return failed;
}
