/* bench_cluster's results: the rows the levels add as they are measured,
 * the Markdown table on stdout (with the constrained-against-unconstrained
 * and prefix-cache on-against-off comparisons) and the --json file. */
#include "bench/cluster_bench.h"

#include "common/status.h"

#include <errno.h>
#include <limits.h>
#include <stdio.h>
#include <string.h>

/* ---- The rows ---- */

struct cb_row cb_rows[CB_ROWS_MAX];
int cb_n_rows;

struct cb_row *cb_row_add(const struct cb_layout *lay, int conc) {
    if (cb_n_rows == CB_ROWS_MAX) return NULL;
    struct cb_row *r = &cb_rows[cb_n_rows++];
    memset(r, 0, sizeof *r);
    r->lay = *lay;
    r->conc = conc;
    for (int w = 0; w < CB_WORKERS_MAX; w++) r->busy[w] = -1;
    r->rows0 = -1;
    r->constrained = -1;
    return r;
}

/* ---- Table and JSON ---- */

/* Mean busy fraction of stage st over the row's pipelines; < 0 when no
 * worker of that stage was measured. */
static double cb_stage_busy(const struct cb_row *r, int st) {
    double sum = 0;
    int n = 0;
    for (int p = 0; p < r->lay.pipelines; p++) {
        int w = p * r->lay.stages + st;
        if (w < CB_WORKERS_MAX && r->busy[w] >= 0) {
            sum += r->busy[w];
            n++;
        }
    }
    return n ? sum / n : -1;
}

static void cb_workload(char *out, size_t size, const struct cb_opts *o) {
    if (o->shared_prefix > 0)
        cb_fmt(out, size, "prompts of a %d-token shared prefix + a distinct %d-token question", o->shared_prefix,
               o->question_tokens);
    else
        cb_fmt(out, size, "distinct prompts of %d tokens", o->prompt_tokens);
    if (o->json_schema) {
        size_t l = strlen(out);
        cb_fmt(out + l, size - l, ", output constrained by the JSON Schema %s%s", o->json_schema_file,
               o->schema_baseline ? " (and unconstrained)" : "");
    }
}

/* The unconstrained row of the same layout, cache and concurrency as a
 * constrained one (--schema-baseline). */
static const struct cb_row *cb_row_baseline(const struct cb_row *r) {
    for (int i = 0; i < cb_n_rows; i++) {
        const struct cb_row *q = &cb_rows[i];
        if (!q->failed && q->constrained == 0 && q->conc == r->conc && q->lay.cache == r->lay.cache &&
            strcmp(q->lay.name, r->lay.name) == 0)
            return q;
    }
    return NULL;
}

/* The row with the same layout and concurrency and the cache as given. */
static const struct cb_row *cb_row_pair(const struct cb_row *r, int cache) {
    for (int i = 0; i < cb_n_rows; i++) {
        const struct cb_row *q = &cb_rows[i];
        if (!q->failed && q->lay.cache == cache && q->conc == r->conc && q->constrained == r->constrained &&
            strcmp(q->lay.name, r->lay.name) == 0)
            return q;
    }
    return NULL;
}

void cb_print_table(FILE *f, const struct cb_opts *o, const char *model) {
    char wl[PATH_MAX + 256];
    cb_workload(wl, sizeof wl, o);
    bool prefix = o->shared_prefix > 0, open_loop = o->rate > 0;
    char load[160];
    if (open_loop)
        cb_fmt(load, sizeof load, "open loop: Poisson arrivals at %g req/s (seed %d + level), at most conc in flight",
               o->rate, o->seed);
    else
        cb_fmt(load, sizeof load, "closed loop");
    fprintf(f, "\n## bench_cluster: %s, device %s, %s, %d generated (greedy, EOS ignored), %s\n\n", model, o->device,
            wl, o->max_tokens, load);
    bool schema = o->json_schema != NULL;
    fprintf(f, "| layout |%s%s conc |%s requests | req/s | gen tok/s | TTFT p50 ms | TTFT p90 ms | ITL p50 ms | "
               "ITL p90 ms | busy by stage | stage-0 rows/req | steps | tok/step | plan us mean | plan us max | "
               "turnaround us | errors |\n", prefix ? " prefix cache |" : "", schema ? " schema |" : "",
            open_loop ? " rate req/s | capped |" : "");
    fprintf(f, "|---|%s%s---|%s---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|\n", prefix ? "---|" : "",
            schema ? "---|" : "", open_loop ? "---|---|" : "");
    for (int i = 0; i < cb_n_rows; i++) {
        const struct cb_row *r = &cb_rows[i];
        char cache[32] = "";
        if (prefix) cb_fmt(cache, sizeof cache, " %s |", r->lay.cache ? "on" : "off");
        if (schema) {
            size_t l = strlen(cache);
            cb_fmt(cache + l, sizeof cache - l, " %s |", r->failed ? "-" : r->constrained ? "yes" : "no");
        }
        if (r->failed) {
            fprintf(f, "| %s |%s - |%s - | - | - | - | - | - | - | - | - | - | - | - | - | - | did not run: %s |\n",
                    r->lay.name, cache, open_loop ? " - | - |" : "", r->note);
            continue;
        }
        char rate[48] = "";
        if (open_loop) cb_fmt(rate, sizeof rate, " %g | %d |", r->rate, r->n_capped);
        char errs[64], busy[24 * 8] = "", rows[32];
        if (r->n_err || r->n_short)
            cb_fmt(errs, sizeof errs, "%d failed, %d short", r->n_err, r->n_short);
        else
            cb_fmt(errs, sizeof errs, "0");
        for (int st = 0; st < r->lay.stages && st < 8; st++) {
            double b = cb_stage_busy(r, st);
            size_t l = strlen(busy);
            if (b >= 0) cb_fmt(busy + l, sizeof busy - l, "%s%.2f", st ? "/" : "", b);
            else cb_fmt(busy + l, sizeof busy - l, "%s-", st ? "/" : "");
        }
        if (r->lay.stages > 8) cb_fmt(busy + strlen(busy), sizeof busy - strlen(busy), "/...");
        int n_done = r->n_ok + r->n_err + r->n_short;
        if (r->rows0 >= 0 && n_done > 0) cb_fmt(rows, sizeof rows, "%.0f", r->rows0 / n_done);
        else cb_fmt(rows, sizeof rows, "-");
        fprintf(f,
                "| %s |%s %d |%s %d | %.2f | %.1f | %.1f | %.1f | %.2f | %.2f | %s | %s | %llu | %.1f | %.1f | %.1f | "
                "%.1f | %s |\n",
                r->lay.name, cache, r->conc, rate, n_done, r->req_s, r->tok_s, r->ttft50, r->ttft90, r->itl50, r->itl90,
                busy, rows, (unsigned long long)r->steps, r->steps ? (double)r->tokens / (double)r->steps : 0.0,
                r->plan_mean, r->plan_max, r->turn_mean, errs);
    }
    if (open_loop)
        fprintf(f, "\nrate: arrivals per second, level k of a layout drawn from seed %d + k as serve-bench --rate "
                   "--seed draws them; capped: arrivals that found every stream (conc) busy and were sent when one "
                   "ended.  TTFT counts from the send.\n", o->seed);
    fprintf(f, "\nlayout: PIPELINESxSTAGES, s: NCCL over sockets only.  busy by stage: step time over wall time "
               "per stage (mean over pipelines; after the first stage it includes the wait for the previous "
               "stage's hidden states).\nstage-0 rows/req: token rows the first stage computed per request "
               "(prompt not found in a cache + generated).  plan us: the router's time to plan and send one step "
               "(mean over this level; max since the cluster started).\nturnaround us: from a step's result "
               "arriving to the next plans sent.  tok/step: generated tokens per router step.\n");
    if (schema && o->schema_baseline) {
        fprintf(f, "\n### JSON-schema constrained against unconstrained (same cluster)\n\n");
        fprintf(f, "| layout |%s conc | gen tok/s unconstrained | gen tok/s constrained | tok/s constrained/unconstrained | "
                   "ITL p50 ms unconstrained | ITL p50 ms constrained |\n|---|%s---|---|---|---|---|---|\n",
                prefix ? " prefix cache |" : "", prefix ? "---|" : "");
        for (int i = 0; i < cb_n_rows; i++) {
            const struct cb_row *on = &cb_rows[i], *off;
            if (on->failed || on->constrained != 1 || !(off = cb_row_baseline(on))) continue;
            char cache[16] = "";
            if (prefix) cb_fmt(cache, sizeof cache, " %s |", on->lay.cache ? "on" : "off");
            fprintf(f, "| %s |%s %d | %.1f | %.1f | %.3f | %.2f | %.2f |\n", on->lay.name, cache, on->conc, off->tok_s,
                    on->tok_s, off->tok_s > 0 ? on->tok_s / off->tok_s : 0.0, off->itl50, on->itl50);
        }
    }
    if (prefix) {
        fprintf(f, "\n### shared prefix: prefix cache on against off\n\n");
        fprintf(f, "| layout | conc | TTFT p50 ms off | TTFT p50 ms on | TTFT off/on | gen tok/s off | gen tok/s on | "
                   "tok/s on/off |\n|---|---|---|---|---|---|---|---|\n");
        for (int i = 0; i < cb_n_rows; i++) {
            const struct cb_row *on = &cb_rows[i], *off;
            if (on->failed || on->lay.cache != 1 || on->constrained == 0 || !(off = cb_row_pair(on, 0))) continue;
            fprintf(f, "| %s | %d | %.1f | %.1f | %.2f | %.1f | %.1f | %.2f |\n", on->lay.name, on->conc, off->ttft50,
                    on->ttft50, on->ttft50 > 0 ? off->ttft50 / on->ttft50 : 0.0, off->tok_s, on->tok_s,
                    off->tok_s > 0 ? on->tok_s / off->tok_s : 0.0);
        }
    }
    fflush(f);
}

static void cb_json_str(FILE *f, const char *s) {
    fputc('"', f);
    for (const unsigned char *p = (const unsigned char *)s; *p; p++) {
        if (*p == '"' || *p == '\\') fprintf(f, "\\%c", *p);
        else if (*p < 0x20) fprintf(f, "\\u%04x", *p);
        else fputc(*p, f);
    }
    fputc('"', f);
}

/* A number, or null for what was not measured (< 0). */
static void cb_json_num(FILE *f, double v) {
    if (v >= 0) fprintf(f, "%.6g", v);
    else fputs("null", f);
}

int cb_write_json(const char *path, const struct cb_opts *o, const char *model, char *err, size_t errlen) {
    FILE *f = fopen(path, "w");
    if (!f) {
        cb_fmt(err, errlen, "--json %s: %s", path, strerror(errno));
        return STATUS_IO;
    }
    fputs("{\n  \"model\": ", f);
    cb_json_str(f, model);
    fputs(",\n  \"device\": ", f);
    cb_json_str(f, o->device);
    fputs(",\n  \"json_schema\": ", f);
    if (o->json_schema) cb_json_str(f, o->json_schema_file);
    else fputs("null", f);
    fprintf(f, ",\n  \"workload\": \"%s\",\n  \"prompt_tokens\": %d,\n  \"shared_prefix\": %d,\n  "
               "\"question_tokens\": %d,\n  \"max_tokens\": %d,\n  \"rate\": ",
            o->shared_prefix > 0 ? "shared-prefix" : "distinct", cb_prompt_len(o), o->shared_prefix > 0 ? o->shared_prefix : 0,
            o->shared_prefix > 0 ? o->question_tokens : 0, o->max_tokens);
    /* rate and seed null: the closed loop. */
    if (o->rate > 0) fprintf(f, "%.6g,\n  \"seed\": %d,\n  \"rows\": [", o->rate, o->seed);
    else fputs("null,\n  \"seed\": null,\n  \"rows\": [", f);
    for (int i = 0; i < cb_n_rows; i++) {
        const struct cb_row *r = &cb_rows[i];
        fprintf(f, "%s\n    {\"layout\": ", i ? "," : "");
        cb_json_str(f, r->lay.name);
        fprintf(f, ", \"pipelines\": %d, \"stages\": %d, \"nccl_sockets\": %s, \"prefix_cache\": %s, "
                   "\"constrained\": %s, \"ran\": %s", r->lay.pipelines, r->lay.stages, r->lay.sockets ? "true" : "false",
                r->lay.cache < 0 ? "null" : r->lay.cache ? "true" : "false",
                r->constrained < 0 ? "null" : r->constrained ? "true" : "false", r->failed ? "false" : "true");
        if (r->failed) {
            fputs(", \"error\": ", f);
            cb_json_str(f, r->note);
            fputs("}", f);
            continue;
        }
        fprintf(f, ", \"concurrency\": %d, \"requests\": %d, \"ok\": %d, \"failed\": %d, \"short\": %d, "
                   "\"wall_s\": %.6g, \"req_s\": %.6g, \"tok_s\": %.6g, \"ttft_p50_ms\": %.6g, \"ttft_p90_ms\": "
                   "%.6g, \"itl_p50_ms\": %.6g, \"itl_p90_ms\": %.6g, \"steps\": %llu, \"tokens\": %llu, "
                   "\"plan_us_mean\": %.6g, \"plan_us_max\": %.6g, \"turnaround_us_mean\": %.6g, \"stage0_rows\": ",
                r->conc, r->n_req, r->n_ok, r->n_err, r->n_short, r->wall_s, r->req_s, r->tok_s, r->ttft50,
                r->ttft90, r->itl50, r->itl90, (unsigned long long)r->steps, (unsigned long long)r->tokens,
                r->plan_mean, r->plan_max, r->turn_mean);
        cb_json_num(f, r->rows0);
        if (r->rate > 0)
            fprintf(f, ", \"rate\": %.6g, \"arrival_seed\": %d, \"capped\": %d, \"cap_wait_ms_mean\": %.6g", r->rate,
                    r->seed, r->n_capped, r->cap_wait_ms);
        else
            fputs(", \"rate\": null, \"arrival_seed\": null, \"capped\": null, \"cap_wait_ms_mean\": null", f);
        fputs(", \"busy_by_stage\": [", f);
        for (int st = 0; st < r->lay.stages; st++) {
            if (st) fputs(", ", f);
            cb_json_num(f, cb_stage_busy(r, st));
        }
        fputs("], \"busy_by_worker\": [", f);
        for (int w = 0; w < r->lay.pipelines * r->lay.stages && w < CB_WORKERS_MAX; w++) {
            fprintf(f, "%s{\"pipeline\": %d, \"stage\": %d, \"busy\": ", w ? ", " : "", w / r->lay.stages,
                    w % r->lay.stages);
            cb_json_num(f, r->busy[w]);
            fputs("}", f);
        }
        fputs("]", f);
        if (r->note[0]) {
            fputs(", \"first_problem\": ", f);
            cb_json_str(f, r->note);
        }
        fputs("}", f);
    }
    fputs("\n  ]", f);
    if (o->json_schema && o->schema_baseline) {
        fputs(",\n  \"constrained_vs_unconstrained\": [", f);
        int k = 0;
        for (int i = 0; i < cb_n_rows; i++) {
            const struct cb_row *on = &cb_rows[i], *off;
            if (on->failed || on->constrained != 1 || !(off = cb_row_baseline(on))) continue;
            fprintf(f, "%s\n    {\"layout\": ", k++ ? "," : "");
            cb_json_str(f, on->lay.name);
            fprintf(f, ", \"prefix_cache\": %s, \"concurrency\": %d, \"tok_s_unconstrained\": %.6g, "
                       "\"tok_s_constrained\": %.6g, \"throughput_ratio\": %.6g, \"itl_p50_ms_unconstrained\": %.6g, "
                       "\"itl_p50_ms_constrained\": %.6g}",
                    on->lay.cache < 0 ? "null" : on->lay.cache ? "true" : "false", on->conc, off->tok_s, on->tok_s,
                    off->tok_s > 0 ? on->tok_s / off->tok_s : 0.0, off->itl50, on->itl50);
        }
        fputs("\n  ]", f);
    }
    if (o->shared_prefix > 0) {
        fputs(",\n  \"prefix_cache\": [", f);
        int k = 0;
        for (int i = 0; i < cb_n_rows; i++) {
            const struct cb_row *on = &cb_rows[i], *off;
            if (on->failed || on->lay.cache != 1 || on->constrained == 0 || !(off = cb_row_pair(on, 0))) continue;
            fprintf(f, "%s\n    {\"layout\": ", k++ ? "," : "");
            cb_json_str(f, on->lay.name);
            fprintf(f, ", \"concurrency\": %d, \"ttft_p50_ms_off\": %.6g, \"ttft_p50_ms_on\": %.6g, "
                       "\"ttft_ratio\": %.6g, \"tok_s_off\": %.6g, \"tok_s_on\": %.6g, \"throughput_ratio\": %.6g}",
                    on->conc, off->ttft50, on->ttft50, on->ttft50 > 0 ? off->ttft50 / on->ttft50 : 0.0, off->tok_s,
                    on->tok_s, off->tok_s > 0 ? on->tok_s / off->tok_s : 0.0);
        }
        fputs("\n  ]", f);
    }
    fputs("\n}\n", f);
    if (fclose(f) != 0) {
        cb_fmt(err, errlen, "--json %s: %s", path, strerror(errno));
        return STATUS_IO;
    }
    return STATUS_OK;
}
