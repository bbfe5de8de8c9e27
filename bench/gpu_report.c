/* bench_gpu's results and their two forms: the records a run adds as it
 * measures, the text table on stdout and the --json file (gpu_report.h). */
#include "bench/gpu_report.h"

#include "common/status.h"

#include <errno.h>
#include <string.h>

#define GPU_REPORT_ROWS_MAX 1024

static struct gpu_report_row gpu_report_rows[GPU_REPORT_ROWS_MAX];
static int gpu_report_n_rows;
static struct gpu_report_cap gpu_report_caps[GPU_OPTIONS_LIST_MAX * GPU_OPTIONS_LIST_MAX];
static int gpu_report_n_caps;
static struct gpu_report_verify gpu_report_verifies[GPU_OPTIONS_LIST_MAX * GPU_OPTIONS_LIST_MAX * 8];
static int gpu_report_n_verifies;
static char gpu_report_setting[64]; /* copied into the records added */

void gpu_report_set_setting(const char *var, const char *value) {
    snprintf(gpu_report_setting, sizeof gpu_report_setting, "%s=%s", var, value);
}

struct gpu_report_row *gpu_report_row_add(const char *shape, const char *type, const char *phase) {
    if (gpu_report_n_rows == GPU_REPORT_ROWS_MAX) return NULL;
    struct gpu_report_row *r = &gpu_report_rows[gpu_report_n_rows++];
    memset(r, 0, sizeof *r);
    snprintf(r->shape, sizeof r->shape, "%s", shape);
    snprintf(r->type, sizeof r->type, "%s", type);
    snprintf(r->phase, sizeof r->phase, "%s", phase);
    snprintf(r->setting, sizeof r->setting, "%s", gpu_report_setting);
    snprintf(r->kv, sizeof r->kv, "-");
    r->target = -1;
    return r;
}

struct gpu_report_cap *gpu_report_cap_add(const char *shape, const char *type) {
    for (int i = 0; i < gpu_report_n_caps; i++)
        if (strcmp(gpu_report_caps[i].shape, shape) == 0 && strcmp(gpu_report_caps[i].type, type) == 0) return NULL;
    if (gpu_report_n_caps == (int)(sizeof gpu_report_caps / sizeof gpu_report_caps[0])) return NULL;
    struct gpu_report_cap *cap = &gpu_report_caps[gpu_report_n_caps++];
    memset(cap, 0, sizeof *cap);
    snprintf(cap->shape, sizeof cap->shape, "%s", shape);
    snprintf(cap->type, sizeof cap->type, "%s", type);
    return cap;
}

struct gpu_report_verify *gpu_report_verify_add(const char *shape, const char *type, const char *kv) {
    if (gpu_report_n_verifies == (int)(sizeof gpu_report_verifies / sizeof gpu_report_verifies[0])) return NULL;
    struct gpu_report_verify *v = &gpu_report_verifies[gpu_report_n_verifies++];
    memset(v, 0, sizeof *v);
    snprintf(v->shape, sizeof v->shape, "%s", shape);
    snprintf(v->type, sizeof v->type, "%s", type);
    snprintf(v->kv, sizeof v->kv, "%s", kv);
    snprintf(v->setting, sizeof v->setting, "%s", gpu_report_setting);
    return v;
}

void gpu_report_print_table(FILE *f, const char *device, const struct gpu_report_ceilings *c,
                            const struct gpu_options *o) {
    fprintf(f, "\n== bench_gpu: %s ==\n", device);
    fprintf(f, "bandwidth ceiling: %.1f GB/s  (%s)\n", c->bw / 1e9, c->bw_how);
    fprintf(f, "GEMM ceiling:      %.2f TFLOP/s  (%s)\n", c->gemm / 1e12, c->gemm_how);
    fprintf(f, "decode: every sequence at context %d (KV of %d positions read per layer), median of %d steps "
            "after %d warm-up, %s; moved = weight bytes read per step + KV bytes read\n",
            o->ctx, o->ctx + 1, o->steps, o->warmup,
            o->logits ? "logits downloaded each step" : "each row's token picked on the device (greedy) and downloaded");
    fprintf(f, "prefill: one %d-token prompt, median of %d; FLOPs = layer matmuls + causal attention + lm_head row\n",
            o->prompt, o->prefill_reps);
    fprintf(f, "targets are the issue's H100 figures (fraction of the ceiling); a model whose weights fit in the "
            "caches (tiny shapes on a CPU) can read faster than the ceiling\n\n");
    fprintf(f, "%-15s %-7s %-7s %-5s %5s %5s %11s %9s %11s %14s %8s %7s %-5s %s\n", "shape", "type", "phase", "kv",
            "batch", "ctx", "tokens/s", "ms/step", "moved", "achieved", "of ceil", "target", "",
            o->ab ? "setting" : "");
    for (int i = 0; i < gpu_report_n_rows; i++) {
        const struct gpu_report_row *r = &gpu_report_rows[i];
        int prefill = strcmp(r->phase, "prefill") == 0;
        char moved[32], ach[32], tgt[16];
        if (prefill) {
            if (r->flops_step >= 1e12) snprintf(moved, sizeof moved, "%.2f TFLOP", r->flops_step / 1e12);
            else snprintf(moved, sizeof moved, "%.2f GFLOP", r->flops_step / 1e9);
            if (r->achieved >= 1e12) snprintf(ach, sizeof ach, "%.1f TFLOP/s", r->achieved / 1e12);
            else snprintf(ach, sizeof ach, "%.1f GFLOP/s", r->achieved / 1e9);
        } else {
            if (r->bytes_step >= 1e9) snprintf(moved, sizeof moved, "%.3f GB", r->bytes_step / 1e9);
            else snprintf(moved, sizeof moved, "%.2f MB", r->bytes_step / 1e6);
            snprintf(ach, sizeof ach, "%.1f GB/s", r->achieved / 1e9);
        }
        if (r->target >= 0) snprintf(tgt, sizeof tgt, ">=%.0f%%", 100.0 * r->target);
        else snprintf(tgt, sizeof tgt, "-");
        fprintf(f, "%-15s %-7s %-7s %-5s %5d %5d %11.1f %9.3f %11s %14s %7.1f%% %7s %-5s %s\n", r->shape, r->type,
                r->phase, r->kv, r->batch, r->ctx, r->tok_s, r->ms_step, moved, ach, 100.0 * r->frac, tgt,
                r->target < 0 ? "" : r->frac >= r->target ? "met" : "BELOW", r->setting);
    }
    if (gpu_report_n_verifies) {
        fprintf(f, "\nverification (--verify): one sequence at its context, a step of its last token + K drafts "
                "(every row sampled) against a one-token step; median of %d each, alternated; the issue's target "
                "is <= 1.3x at K + 1 = 5 (7B Q4_K_M)\n", o->steps);
        fprintf(f, "%-15s %-7s %-5s %5s %3s %11s %11s %7s %s\n", "shape", "type", "kv", "ctx", "K", "1-token ms",
                "K+1 ms", "ratio", o->ab ? "setting" : "");
        for (int i = 0; i < gpu_report_n_verifies; i++) {
            const struct gpu_report_verify *v = &gpu_report_verifies[i];
            fprintf(f, "%-15s %-7s %-5s %5d %3d %11.3f %11.3f %6.2fx %s\n", v->shape, v->type, v->kv, v->ctx, v->k,
                    v->ms_one, v->ms_k1, v->ms_k1 / v->ms_one, v->setting);
        }
    }
    if (gpu_report_n_caps) {
        fprintf(f, "\ncapacity in a %.1f GiB budget (weights = the GGUF file, + KV of sequences at context %d; "
                "workspace not counted):\n", (double)o->cap_budget / 1073741824.0, o->cap_ctx);
        for (int i = 0; i < gpu_report_n_caps; i++) {
            const struct gpu_report_cap *cp = &gpu_report_caps[i];
            fprintf(f, "capacity: %s %s: weights %.2f GiB; F16 KV %.1f MiB/seq -> %lld seqs; Q8_0 KV %.1f MiB/seq "
                    "-> %lld seqs; Q8_0/F16 %.2fx\n", cp->shape, cp->type, cp->weight_bytes / 1073741824.0,
                    cp->kv_seq[0] / 1048576.0, (long long)cp->seqs[0], cp->kv_seq[1] / 1048576.0,
                    (long long)cp->seqs[1], cp->seqs[0] > 0 ? (double)cp->seqs[1] / (double)cp->seqs[0] : 0.0);
        }
    }
    fflush(f);
}

int gpu_report_write_json(const char *path, const char *device, const struct gpu_report_ceilings *c,
                          const struct gpu_options *o, char *err, size_t errlen) {
    FILE *f = fopen(path, "w");
    if (!f) {
        snprintf(err, errlen, "--json %s: %s", path, strerror(errno));
        return STATUS_IO;
    }
    fprintf(f, "{\n  \"device\": \"");
    for (const char *p = device; *p; p++)
        if (*p == '"' || *p == '\\') fprintf(f, "\\%c", *p);
        else if ((unsigned char)*p >= 0x20) fputc(*p, f);
    fprintf(f, "\",\n  \"bandwidth_bytes_s\": %.6g,\n  \"gemm_flops_s\": %.6g,\n  \"gemm_with_conversion_flops_s\": "
            "%.6g,\n  \"ctx\": %d,\n  \"prompt\": %d,\n  \"steps\": %d,\n  \"rows\": [\n",
            c->bw, c->gemm, c->gemm_conv, o->ctx, o->prompt, o->steps);
    for (int i = 0; i < gpu_report_n_rows; i++) {
        const struct gpu_report_row *r = &gpu_report_rows[i];
        fprintf(f, "    {\"shape\": \"%s\", \"type\": \"%s\", \"phase\": \"%s\", \"kv\": \"%s\", \"batch\": %d, \"ctx\": %d, "
                "\"tokens_s\": %.6g, \"ms_step\": %.6g, \"bytes_step\": %.6g, \"flops_step\": %.6g, "
                "\"achieved\": %.6g, \"fraction\": %.4f, \"target\": %.2f, \"setting\": \"%s\"}%s\n",
                r->shape, r->type, r->phase, r->kv, r->batch, r->ctx, r->tok_s, r->ms_step, r->bytes_step, r->flops_step,
                r->achieved, r->frac, r->target, r->setting, i + 1 < gpu_report_n_rows ? "," : "");
    }
    fprintf(f, "  ],\n  \"capacity\": [\n");
    for (int i = 0; i < gpu_report_n_caps; i++) {
        const struct gpu_report_cap *cp = &gpu_report_caps[i];
        fprintf(f, "    {\"shape\": \"%s\", \"type\": \"%s\", \"budget_bytes\": %lld, \"ctx\": %d, "
                "\"weight_bytes\": %.0f, \"kv_seq_bytes_f16\": %.0f, \"kv_seq_bytes_q8_0\": %.0f, \"seqs_f16\": %lld, "
                "\"seqs_q8_0\": %lld}%s\n", cp->shape, cp->type, (long long)o->cap_budget, o->cap_ctx,
                cp->weight_bytes, cp->kv_seq[0], cp->kv_seq[1], (long long)cp->seqs[0], (long long)cp->seqs[1],
                i + 1 < gpu_report_n_caps ? "," : "");
    }
    fprintf(f, "  ],\n  \"verify\": [\n");
    for (int i = 0; i < gpu_report_n_verifies; i++) {
        const struct gpu_report_verify *v = &gpu_report_verifies[i];
        fprintf(f, "    {\"shape\": \"%s\", \"type\": \"%s\", \"kv\": \"%s\", \"ctx\": %d, \"k\": %d, "
                "\"ms_one\": %.6g, \"ms_k1\": %.6g, \"ratio\": %.4f, \"setting\": \"%s\"}%s\n", v->shape, v->type, v->kv,
                v->ctx, v->k, v->ms_one, v->ms_k1, v->ms_k1 / v->ms_one, v->setting,
                i + 1 < gpu_report_n_verifies ? "," : "");
    }
    fprintf(f, "  ]\n}\n");
    if (fclose(f) != 0) {
        snprintf(err, errlen, "--json %s: %s", path, strerror(errno));
        return STATUS_IO;
    }
    return STATUS_OK;
}
