/* bench_gpu's results: the rows of decode and prefill speed, the capacity
 * lines and the --verify measurements a run collects, and the text table
 * (stdout; scripts/gpu-kernels.sh and gpu-spec.sh read its columns) and the
 * --json file written from them.  One report per process: the records live
 * in this module's static tables, filled by bench_gpu.c as it measures. */
#ifndef BENCH_GPU_REPORT_H
#define BENCH_GPU_REPORT_H

#include "bench/gpu_options.h"

#include <stdint.h>
#include <stdio.h>

/* The ceilings every row is set against, measured through the backend's ops. */
struct gpu_report_ceilings {
    double bw;         /* bytes/s, copy: read + written */
    double gemm;       /* FLOP/s, F16 matmul without the activation conversion (GPU) */
    double gemm_conv;  /* FLOP/s, the same matmul with the conversion */
    char bw_how[256], gemm_how[320];
};

struct gpu_report_row {
    char shape[32], type[16], phase[8], kv[8];
    char setting[64];   /* --ab: the environment this row ran under */
    int32_t batch, ctx;
    double tok_s, ms_step;
    double bytes_step;  /* decode: weights + KV read per step */
    double flops_step;  /* prefill: model FLOPs of the prompt */
    double achieved;    /* decode: bytes/s; prefill: FLOP/s */
    double frac;        /* of the matching ceiling */
    double target;      /* the target fraction, or < 0 for none */
};

/* How many sequences of cap_ctx positions fit a memory budget next to the
 * weights, for each KV cache type: one line per model. */
struct gpu_report_cap {
    char shape[32], type[16];
    double weight_bytes;     /* the GGUF file: every tensor, embeddings included */
    double kv_seq[2];        /* KV bytes of one sequence: F16, Q8_0 */
    int64_t seqs[2];         /* sequences that fit (0 when the weights alone do not) */
};

/* --verify K: speculation's verification cost (docs/router.md,
 * "Speculation"): one sequence at context ctx, a step of its last token
 * plus K drafts (K + 1 rows, every row's logits sampled, as the last stage
 * verifies) against a step of one token at the same position. */
struct gpu_report_verify {
    char shape[32], type[16], kv[8], setting[64];
    int32_t ctx, k;
    double ms_one, ms_k1; /* medians */
};

/* The setting the records added from now on carry, "VAR=value" (--ab);
 * empty until set. */
void gpu_report_set_setting(const char *var, const char *value);

/* Each adds a record named by its arguments and the current setting, the
 * rest zero (a row's kv "-" and target -1) for the caller to fill; the
 * record stays in the report.  NULL when the table is full (the run goes on
 * without it).  gpu_report_cap_add also gives NULL when the model has its
 * capacity line already (an earlier KV type or --ab run). */
struct gpu_report_row *gpu_report_row_add(const char *shape, const char *type, const char *phase);
struct gpu_report_cap *gpu_report_cap_add(const char *shape, const char *type);
struct gpu_report_verify *gpu_report_verify_add(const char *shape, const char *type, const char *kv);

/* The table of every record to f: the ceilings and how they were measured,
 * the run's settings from o, then the rows, the verify lines and the
 * capacity lines.  device names the backend. */
void gpu_report_print_table(FILE *f, const char *device, const struct gpu_report_ceilings *c,
                            const struct gpu_options *o);

/* The same records as JSON in the file at path (created or truncated).
 * Returns STATUS_OK, or STATUS_IO with err naming --json, the path and the
 * system's reason. */
int gpu_report_write_json(const char *path, const char *device, const struct gpu_report_ceilings *c,
                          const struct gpu_options *o, char *err, size_t errlen);

#endif
