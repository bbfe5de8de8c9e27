/* bench_gpu's options: the table of flags (the --help text), then the
 * lists and values they name checked and parsed (gpu_options.h). */
#include "bench/gpu_options.h"

#include "common/options.h"
#include "common/status.h"

#include <errno.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

/* Splits a comma-separated list into items (written into buf, a copy of s)
 * and checks each against its kind.  Returns the count or a negative status
 * with err naming the flag and the item. */
static int gpu_options_split(const char *flag, const char *s, char *buf, size_t buflen, char **items, char *err,
                             size_t errlen) {
    if (strlen(s) + 1 > buflen) {
        snprintf(err, errlen, "--%s: list of %zu characters is too long", flag, strlen(s));
        return STATUS_BAD_INPUT;
    }
    memcpy(buf, s, strlen(s) + 1);
    int n = 0;
    for (char *save = NULL, *tok = strtok_r(buf, ",", &save); tok; tok = strtok_r(NULL, ",", &save)) {
        if (n == GPU_OPTIONS_LIST_MAX) {
            snprintf(err, errlen, "--%s: more than %d items in \"%s\"", flag, GPU_OPTIONS_LIST_MAX, s);
            return STATUS_BAD_INPUT;
        }
        items[n++] = tok;
    }
    if (n == 0) {
        snprintf(err, errlen, "--%s: empty list \"%s\"", flag, s);
        return STATUS_BAD_INPUT;
    }
    return n;
}

static int gpu_options_lists(struct gpu_options *o, char *err, size_t errlen) {
    char *items[GPU_OPTIONS_LIST_MAX];
    int n = gpu_options_split("shapes", o->shapes, o->shape_buf, sizeof o->shape_buf, items, err, errlen);
    if (n < 0) return n;
    for (int i = 0; i < n; i++) {
        struct synth_shape sh;
        if (synth_shape_preset(items[i], &sh) != STATUS_OK) {
            snprintf(err, errlen, "--shapes: unknown shape \"%s\" (worker/synth.h presets: tiny, 100m, "
                     "tinyllama-1.1b, llama2-7b, llama3-8b, llama2-13b)", items[i]);
            return STATUS_BAD_INPUT;
        }
        o->shape_v[i] = items[i];
    }
    o->n_shapes = n;

    char buf[512];
    n = gpu_options_split("types", o->types, buf, sizeof buf, items, err, errlen);
    if (n < 0) return n;
    for (int i = 0; i < n; i++) {
        int k = 0;
        while (synth_type_names[k] && strcmp(synth_type_names[k], items[i]) != 0) k++;
        if (!synth_type_names[k]) {
            snprintf(err, errlen, "--types: unknown type \"%s\" (f32, f16, bf16, q8_0, q4_0, q4_k_m, q5_k_m, q6_k)",
                     items[i]);
            return STATUS_BAD_INPUT;
        }
        o->type_v[i] = (enum synth_type)k;
    }
    o->n_types = n;

    n = gpu_options_split("batches", o->batches, buf, sizeof buf, items, err, errlen);
    if (n < 0) return n;
    o->batch_max = 0;
    for (int i = 0; i < n; i++) {
        char *end = NULL;
        errno = 0;
        long v = strtol(items[i], &end, 10);
        if (errno || !end || *end || v < 1 || v > 1024) {
            snprintf(err, errlen, "--batches: \"%s\" is not a batch size from 1 to 1024", items[i]);
            return STATUS_BAD_INPUT;
        }
        o->batch_v[i] = (int32_t)v;
        if (v > o->batch_max) o->batch_max = (int32_t)v;
    }
    o->n_batches = n;

    n = gpu_options_split("kv-type", o->kv_types, buf, sizeof buf, items, err, errlen);
    if (n < 0) return n;
    for (int i = 0; i < n; i++) {
        if (strcmp(items[i], "f16") == 0) o->kv_v[i] = DTYPE_F16;
        else if (strcmp(items[i], "q8_0") == 0) o->kv_v[i] = DTYPE_Q8_0;
        else if (strcmp(items[i], "f32") == 0) o->kv_v[i] = DTYPE_F32;
        else {
            snprintf(err, errlen, "--kv-type: unknown KV cache type \"%s\" (f16, q8_0, f32)", items[i]);
            return STATUS_BAD_INPUT;
        }
    }
    o->n_kv = n;
    return STATUS_OK;
}

/* "cpu" -> -1; "cuda" / "cuda:N" -> N (>= 0). */
static int gpu_options_device(const char *s, int *device, char *err, size_t errlen) {
    if (strcmp(s, "cpu") == 0) {
        *device = -1;
        return STATUS_OK;
    }
    if (strcmp(s, "cuda") == 0) {
        *device = 0;
        return STATUS_OK;
    }
    if (strncmp(s, "cuda:", 5) == 0) {
        char *end = NULL;
        errno = 0;
        long v = strtol(s + 5, &end, 10);
        if (!errno && end && end != s + 5 && !*end && v >= 0 && v < 1024) {
            *device = (int)v;
            return STATUS_OK;
        }
    }
    snprintf(err, errlen, "--device: \"%s\" is not cpu, cuda or cuda:N", s);
    return STATUS_BAD_INPUT;
}

int gpu_options_parse(struct gpu_options *o, int argc, char **argv, char *err, size_t errlen) {
    memset(o, 0, sizeof *o);
    struct option_def defs[] = {
        {"device", "LLM_BENCH_DEVICE", OPTION_STRING, "cuda:0", "cpu, cuda or cuda:N", &o->device, 0, 0, NULL},
        {"shapes", NULL, OPTION_STRING, "tinyllama-1.1b,llama2-7b", "comma-separated synth shape presets", &o->shapes,
         0, 0, NULL},
        {"model", NULL, OPTION_STRING, NULL, "a GGUF model file to measure instead of --shapes and --types (no "
         "targets apply)", &o->model, 0, 0, NULL},
        {"types", NULL, OPTION_STRING, "f16,q8_0,q4_k_m", "comma-separated synth weight mixes", &o->types, 0, 0, NULL},
        {"batches", NULL, OPTION_STRING, "1,8,32,64", "comma-separated decode batch sizes", &o->batches, 0, 0, NULL},
        {"kv-type", NULL, OPTION_STRING, "f16", "comma-separated KV cache types to measure each model with (f16, "
         "q8_0, f32)", &o->kv_types, 0, 0, NULL},
        {"capacity-budget", NULL, OPTION_SIZE, "16G", "capacity line: sequences of --capacity-ctx that fit this "
         "budget next to the weights, F16 against Q8_0 KV (0: no line)", &o->cap_budget, 0, 0, NULL},
        {"capacity-ctx", NULL, OPTION_INT, "2048", "capacity line: positions of each sequence", &o->cap_ctx, 1,
         1 << 24, NULL},
        {"ctx", NULL, OPTION_INT, "512", "context of every decoding sequence", &o->ctx, 1, 1 << 20, NULL},
        {"prompt", NULL, OPTION_INT, "512", "prefill prompt tokens", &o->prompt, 1, 1 << 20, NULL},
        {"steps", NULL, OPTION_INT, "10", "timed decode steps per batch size (the median is reported)", &o->steps, 1,
         100000, NULL},
        {"warmup", NULL, OPTION_INT, "2", "untimed decode steps before each batch size", &o->warmup, 0, 1000, NULL},
        {"verify", NULL, OPTION_INT, "0", "speculation's verification cost: also time one sequence's step of K + 1 "
         "tokens (every row sampled) against a one-token step at --ctx (0: not; at most 16)", &o->verify, 0, 16, NULL},
        {"prefill-reps", NULL, OPTION_INT, "3", "timed prefills per model (after one warm-up)", &o->prefill_reps, 1,
         1000, NULL},
        {"threads", "LLM_THREADS", OPTION_INT, "0", "CPU threads (0: one per core): CPU backend and model writer",
         &o->threads, 0, 1024, NULL},
        {"copy-size", NULL, OPTION_SIZE, "0", "bytes per bandwidth copy (0: 2G on a GPU, 256M on the CPU)",
         &o->copy_bytes, 0, 0, NULL},
        {"gemm-size", NULL, OPTION_INT, "0", "rows = cols of the GEMM-ceiling weight (0: 8192 GPU, 1024 CPU)",
         &o->gemm_size, 0, 65536, NULL},
        {"gemm-tokens", NULL, OPTION_INT, "0", "tokens of the GEMM-ceiling matmul (0: 4096 GPU, 128 CPU)",
         &o->gemm_tokens, 0, 65536, NULL},
        {"tmpdir", "TMPDIR", OPTION_STRING, "/tmp", "where the synthetic models are written (one at a time)",
         &o->tmpdir, 0, 0, NULL},
        {"model-cache", NULL, OPTION_STRING, NULL,
         "a folder that keeps each synthetic model (SHAPE-TYPE.gguf) after the run and reuses one already there, "
         "so that runs in turn (builds against each other) write it once; made if missing (its parent must exist)",
         &o->model_cache, 0, 0, NULL},
        {"json", NULL, OPTION_STRING, NULL, "also write the results as JSON to this file", &o->json, 0, 0, NULL},
        {"out", NULL, OPTION_STRING, "sample",
         "what a step hands back: sample (each row's token, picked on the device as a worker does) or logits "
         "(every row's logits downloaded to the host)",
         &o->out, 0, 0, NULL},
        {"ab", NULL, OPTION_STRING, NULL,
         "VAR=V1[,V2...]: run each model on a fresh backend with VAR as given, =V1 .. =Vk, =Vk .. =V1, as "
         "given (an A/B of a backend switch on one card, up to 8 values; rows name their setting)",
         &o->ab, 0, 0, NULL},
    };
    struct options opt = {"bench_gpu", "[options]",
                          "Decode and prefill speed of synthetic models against the bandwidth and GEMM ceilings "
                          "measured in the same run.",
                          defs, (int)(sizeof defs / sizeof defs[0]), false};
    int rc = options_parse(&opt, &argc, argv, err, errlen);
    if (rc == STATUS_CANCELLED) return rc;
    if (rc == STATUS_OK && argc > 1) {
        snprintf(err, errlen, "unexpected argument \"%s\"", argv[1]);
        rc = STATUS_BAD_INPUT;
    }
    if (rc == STATUS_OK) rc = gpu_options_lists(o, err, errlen);
    if (rc == STATUS_OK) rc = gpu_options_device(o->device, &o->device_id, err, errlen);
    if (rc == STATUS_OK && strcmp(o->out, "sample") != 0 && strcmp(o->out, "logits") != 0) {
        snprintf(err, errlen, "--out \"%s\": expected sample or logits", o->out);
        rc = STATUS_BAD_INPUT;
    }
    o->logits = rc == STATUS_OK && strcmp(o->out, "logits") == 0;
    if (rc == STATUS_OK && o->ab) {
        const char *eq = strchr(o->ab, '=');
        if (eq && eq != o->ab && (size_t)(eq - o->ab) < sizeof o->ab_var && strlen(eq + 1) < sizeof o->ab_val) {
            snprintf(o->ab_val, sizeof o->ab_val, "%s", eq + 1);
            for (char *v = o->ab_val; v;) {
                char *next = strchr(v, ',');
                if (next) *next++ = '\0';
                if (!*v || o->ab_n == GPU_OPTIONS_AB_MAX) { /* an empty value, or a ninth */
                    o->ab_n = 0;
                    break;
                }
                o->ab_vals[o->ab_n++] = v;
                v = next;
            }
        }
        if (o->ab_n == 0) {
            snprintf(err, errlen, "--ab \"%s\": expected VAR=V1[,V2...] (1 to 8 values, names and values under "
                     "64 bytes)", o->ab);
            rc = STATUS_BAD_INPUT;
        } else {
            snprintf(o->ab_var, sizeof o->ab_var, "%.*s", (int)(eq - o->ab), o->ab);
            const char *old = getenv(o->ab_var);
            o->ab_had = old != NULL;
            snprintf(o->ab_old, sizeof o->ab_old, "%.63s", old ? old : "");
        }
    }
    return rc;
}
