/* bench_gpu's options: the one table that drives its flags, environment
 * variables and --help, and the checks of what they name (shapes, weight
 * mixes, batch sizes, KV cache types, the device, --out and --ab's variable
 * and values), parsed into one struct the rest of bench_gpu reads. */
#ifndef BENCH_GPU_OPTIONS_H
#define BENCH_GPU_OPTIONS_H

#include "common/dtype.h"
#include "worker/synth.h"

#include <stddef.h>
#include <stdint.h>

#define GPU_OPTIONS_LIST_MAX 16 /* items of --shapes, --types, --batches and --kv-type each */
#define GPU_OPTIONS_AB_MAX 8    /* values of --ab */

struct gpu_options {
    const char *device, *shapes, *types, *batches, *json, *tmpdir, *ab, *out, *kv_types;
    const char *model; /* --model: a GGUF file instead of synthetic shapes */
    const char *model_cache; /* --model-cache: a folder keeping the synthetic models between runs */
    int logits; /* --out logits: each step downloads the logits instead of sampling */
    int ctx, prompt, steps, warmup, prefill_reps, threads;
    int verify; /* --verify K: time a step of K + 1 tokens of one sequence (0: not) */
    int64_t copy_bytes;
    int gemm_size, gemm_tokens;
    /* Parsed lists. */
    const char *shape_v[GPU_OPTIONS_LIST_MAX]; /* point into shape_buf */
    int n_shapes;
    enum synth_type type_v[GPU_OPTIONS_LIST_MAX];
    int n_types;
    int32_t batch_v[GPU_OPTIONS_LIST_MAX];
    int n_batches;
    int32_t batch_max;
    enum dtype kv_v[GPU_OPTIONS_LIST_MAX];
    int n_kv;
    int64_t cap_budget;  /* the capacity line's memory budget (weights + KV), bytes; 0: none */
    int cap_ctx;         /* and the context each sequence holds */
    int device_id;       /* --device: -1 for cpu, else the CUDA device */
    /* --ab VAR=V1[,V2...]: the variable, its values (ab_vals point into
     * ab_val) and what the environment held before the run. */
    char ab_var[64], ab_val[64], ab_old[64];
    const char *ab_vals[GPU_OPTIONS_AB_MAX];
    int ab_had, ab_n;
    char shape_buf[512];
};

/* Parses argv (and the environment) into o, which must stay where it is
 * while it is used: the lists point into it.  Strings point into argv, the
 * environment or the table's defaults; nothing is allocated, nothing to
 * free.  Returns STATUS_OK; STATUS_CANCELLED after writing the help to
 * stdout for --help (exit with 0); or a negative status with err naming the
 * flag and the value (an unknown shape, a batch size out of range, a bad
 * --device, --out or --ab, an unexpected argument). */
int gpu_options_parse(struct gpu_options *o, int argc, char **argv, char *err, size_t errlen);

#endif
