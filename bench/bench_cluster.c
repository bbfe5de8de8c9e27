/* bench_cluster: the whole cluster's speed as a client sees it, and the
 * router's share of each step (the cluster issue's table).  For each layout
 * (pipelines x stages, optionally with NCCL held to sockets) it starts a
 * private cluster with the built llm-cluster, then at each concurrency level
 * sends N fixed-length greedy requests through libllmclient with that many
 * in flight and measures requests/s, generated tokens/s, time to first
 * token and inter-token latency; the router's Status gives its planning
 * cost per step, the workers' metrics ports each stage's busy fraction.
 * The shared-prefix workload (one system prompt, distinct questions) runs
 * every layout with the router's prefix cache on and off.
 *
 *   bench_cluster --shape tiny --layouts 1x1,1x2,2x1 --concurrency 1,4,16 --threads 1
 *   bench_cluster --model m.gguf --device auto --layouts 1x1,1x2,1x2s,2x1 --concurrency 64,128
 *   bench_cluster --model m.gguf --device auto --layouts 1x1 --shared-prefix 1024 --question-tokens 32 \
 *       --requests 64 --concurrency 16 --max-tokens 64
 *   bench_cluster --model m.gguf --device auto --layouts 1x1 --concurrency 64 --requests 256 --rate 60
 *   bench_cluster --shape llama2-7b --type q4_k_m --device auto --layouts 1x1 --concurrency 64 \
 *       --json-schema bench/schemas/records.json --schema-baseline
 *
 * --json-schema FILE constrains every request by that JSON Schema (the
 * grammar engine's masks on the last stage, docs/grammar.md); with
 * --schema-baseline each level runs first unconstrained, then constrained,
 * on the same cluster, and the table gives their ratio.
 *
 * --rate R makes each level an open loop: its requests arrive as a Poisson
 * process of R per second, drawn from --seed exactly as serve-bench draws
 * its --rate arrivals, and the level's --concurrency threads send them at
 * their times (an arrival that finds every thread busy waits for the first
 * one free, as serve-bench's in-flight cap does).
 *
 * The program's parts: cluster_options.c (the lists and checks past the
 * option table below), cluster_run.c (llm-cluster up and down, keys, the
 * workers' metrics ports), cluster_load.c (the levels' requests) and
 * cluster_report.c (the rows, the table and the JSON); cluster_bench.h
 * holds what they share. */
#include "bench/cluster_bench.h"

#include "common/log.h"
#include "common/options.h"
#include "common/status.h"
#include "worker/synth.h"

#include <errno.h>
#include <limits.h>
#include <signal.h>
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <time.h>
#include <unistd.h>

/* Set by SIGTERM/SIGINT (a time limit): requests in flight are cancelled,
 * the cluster is stopped, and the rows measured so far are printed. */
volatile sig_atomic_t cb_stop;
static void cb_on_signal(int sig) {
    (void)sig;
    cb_stop = 1;
}

/* snprintf through a function, so that paths and messages cut to fit
 * their buffer are not warnings (a cut message is still a message). */
void cb_fmt(char *out, size_t size, const char *fmt, ...) {
    va_list ap;
    va_start(ap, fmt);
    vsnprintf(out, size, fmt, ap);
    va_end(ap);
}

double cb_now(void) {
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (double)ts.tv_sec + (double)ts.tv_nsec * 1e-9;
}

void cb_sleep_ms(int ms) {
    struct timespec ts = {ms / 1000, (long)(ms % 1000) * 1000000L};
    nanosleep(&ts, NULL);
}

/* ---- main ---- */

int main(int argc, char **argv) {
    struct cb_opts o;
    memset(&o, 0, sizeof o);
    const struct option_def defs[] = {
        {"model", "LLM_MODEL", OPTION_STRING, NULL, "GGUF file or HF directory; none: a synthetic --shape model",
         &o.model, 0, 0, NULL},
        {"shape", NULL, OPTION_STRING, "100m", "synthetic model shape (worker/synth.h presets)", &o.shape, 0, 0,
         NULL},
        {"type", NULL, OPTION_STRING, "f16", "synthetic model weight types", &o.type, 0, 0, NULL},
        {"stages", NULL, OPTION_STRING, "1,2", "stages per pipeline to measure, comma-separated", &o.stages, 0, 0,
         NULL},
        {"pipelines", NULL, OPTION_STRING, "1", "pipelines to measure, comma-separated", &o.pipelines, 0, 0, NULL},
        {"layouts", NULL, OPTION_STRING, "", "clusters as PIPELINESxSTAGES[s], comma-separated (\"1x1,1x2,1x2s,2x1\"; "
         "s: NCCL over sockets only); replaces --pipelines x --stages", &o.layouts, 0, 0, NULL},
        {"concurrency", NULL, OPTION_STRING, "1,4,16,64", "requests in flight, comma-separated", &o.concurrency, 0,
         0, NULL},
        {"requests", NULL, OPTION_INT, "0", "requests per level (0: two per stream, at least 8)", &o.requests, 0,
         1000000, NULL},
        {"prompt-tokens", NULL, OPTION_INT, "128", "prompt length in tokens", &o.prompt_tokens, 1, 1 << 20, NULL},
        {"shared-prefix", NULL, OPTION_INT, "0", "the shared-prefix workload: every prompt starts with the same "
         "N tokens (a system prompt) and each layout runs with the router's prefix cache on and off", &o.shared_prefix,
         0, 1 << 20, NULL},
        {"question-tokens", NULL, OPTION_INT, "32", "with --shared-prefix: each request's own tokens after the "
         "prefix", &o.question_tokens, 1, 1 << 20, NULL},
        {"no-cache-arg", NULL, OPTION_STRING, "--no-prefix-cache", "with --shared-prefix: the llm-router argument "
         "that turns its prefix cache off", &o.no_cache_arg, 0, 0, NULL},
        {"max-tokens", NULL, OPTION_INT, "64", "tokens generated per request", &o.max_tokens, 1, 1 << 20, NULL},
        {"rate", NULL, OPTION_FLOAT, "0", "open loop: requests arrive as a Poisson process of R per second, sent by "
         "the level's --concurrency streams (an arrival that finds all busy waits for one); 0: closed loop, each "
         "stream sends its next request when the last ends", &o.rate, 0, 1e6, NULL},
        {"seed", NULL, OPTION_INT, "1", "with --rate: level k of each layout draws its arrivals from seed N + k, as "
         "serve-bench --rate --seed N + k does", &o.seed, 0, INT_MAX / 2, NULL},
        {"warmup", NULL, OPTION_INT, "1", "requests sent one by one before the first level", &o.warmup, 0, 1000,
         NULL},
        {"device", NULL, OPTION_STRING, "cpu", "llm-cluster --device: cpu, or auto (one GPU per worker)", &o.device,
         0, 0, NULL},
        {"threads", NULL, OPTION_INT, "0", "CPU threads per worker (0: llm-cluster shares the cores out)",
         &o.threads, 0, 1024, NULL},
        {"kv-blocks", NULL, OPTION_INT, "0", "KV blocks per worker (0: the worker's default)", &o.kv_blocks, 0,
         1 << 24, NULL},
        {"up-timeout-s", NULL, OPTION_INT, "300", "give up on a cluster not in service by then", &o.up_timeout_s, 1,
         86400, NULL},
        {"up-tries", NULL, OPTION_INT, "2", "attempts to start each cluster", &o.up_tries, 1, 100, NULL},
        {"cluster", NULL, OPTION_STRING, NULL, "the llm-cluster program (default: found next to this one)",
         &o.cluster, 0, 0, NULL},
        {"router-args", NULL, OPTION_STRING, "", "extra llm-router arguments, space-separated", &o.router_args, 0,
         0, NULL},
        {"worker-args", NULL, OPTION_STRING, "", "extra llm-worker arguments, space-separated", &o.worker_args, 0,
         0, NULL},
        {"log-level", NULL, OPTION_STRING, "info", "log level of the cluster's processes (info or lower: the "
         "workers' metrics ports are read from their logs)", &o.log_level, 0, 0, NULL},
        {"insecure", NULL, OPTION_BOOL, "false", "llm-cluster up --insecure: no CURVE keys", &o.insecure, 0, 0,
         NULL},
        {"json", NULL, OPTION_STRING, NULL, "also write the results as JSON to this file", &o.json, 0, 0, NULL},
        {"json-schema", NULL, OPTION_STRING, NULL, "constrain every request's output by this JSON Schema file "
         "(docs/grammar.md; the last stage masks each step); EOS is still ignored, so pick a schema whose "
         "output outlasts --max-tokens (bench/schemas/records.json)", &o.json_schema_file, 0, 0, NULL},
        {"schema-baseline", NULL, OPTION_BOOL, "false", "with --json-schema: run each level unconstrained first, "
         "then constrained, on the same cluster, and compare them", &o.schema_baseline, 0, 0, NULL},
        {"tmpdir", "TMPDIR", OPTION_STRING, "/tmp", "where the synthetic model and run dirs go", &o.tmpdir, 0, 0,
         NULL},
        {"run-root", NULL, OPTION_STRING, NULL, "keep each cluster's run dir (logs) under this folder",
         &o.run_root, 0, 0, NULL},
    };
    struct options opts = {"bench_cluster", "[options]",
                           "Starts a cluster per layout with llm-cluster and measures throughput and latency at "
                           "several concurrency levels through libllmclient.",
                           defs, (int)(sizeof defs / sizeof defs[0]), false};
    char err[1024];
    int rc = options_parse(&opts, &argc, argv, err, sizeof err);
    if (rc == STATUS_CANCELLED) return 0;
    if (rc == STATUS_OK && argc > 1) {
        cb_fmt(err, sizeof err, "unexpected argument \"%s\"", argv[1]);
        rc = STATUS_BAD_INPUT;
    }
    if (rc == STATUS_OK) rc = cb_parse_lists(&o, err, sizeof err);
    if (rc == STATUS_OK && o.json_schema_file) rc = cb_read_schema(&o, err, sizeof err);
    if (rc == STATUS_OK && o.schema_baseline && !o.json_schema_file) {
        cb_fmt(err, sizeof err, "--schema-baseline compares with --json-schema FILE, which is not given");
        rc = STATUS_BAD_INPUT;
    }
    char cluster[PATH_MAX];
    if (rc == STATUS_OK) {
        if (o.cluster) {
            cb_fmt(cluster, sizeof cluster, "%s", o.cluster);
            if (access(cluster, X_OK) != 0) {
                cb_fmt(err, sizeof err, "--cluster %s: not an executable: %s", o.cluster, strerror(errno));
                rc = STATUS_NOT_FOUND;
            }
        } else {
            rc = cb_find_cluster(cluster, sizeof cluster, err, sizeof err);
        }
    }
    if (rc != STATUS_OK) {
        fprintf(stderr, "bench_cluster: %s\n", err);
        return 2;
    }
    log_set_level(LL_WARN);
    struct sigaction sa;
    memset(&sa, 0, sizeof sa);
    sa.sa_handler = cb_on_signal;
    sigaction(SIGTERM, &sa, NULL);
    sigaction(SIGINT, &sa, NULL);
    signal(SIGPIPE, SIG_IGN);

    char tmp[PATH_MAX];
    cb_fmt(tmp, sizeof tmp, "%s/bench_cluster_XXXXXX", o.tmpdir);
    if (!mkdtemp(tmp)) {
        fprintf(stderr, "bench_cluster: --tmpdir %s: cannot create a folder: %s\n", o.tmpdir, strerror(errno));
        return 1;
    }
    char model[PATH_MAX + 64], model_name[128];
    if (o.model) {
        if (!realpath(o.model, model)) {
            fprintf(stderr, "bench_cluster: --model %s: %s\n", o.model, strerror(errno));
            rmdir(tmp);
            return 1;
        }
        const char *slash = strrchr(model, '/');
        cb_fmt(model_name, sizeof model_name, "%s", slash ? slash + 1 : model);
    } else {
        struct synth_config sc;
        memset(&sc, 0, sizeof sc);
        synth_shape_preset(o.shape, &sc.shape);
        sc.type = o.synth_type;
        sc.seed = 1;
        cb_fmt(model, sizeof model, "%s/%s-%s.gguf", tmp, o.shape, o.type);
        cb_fmt(model_name, sizeof model_name, "synthetic %s %s", o.shape, o.type);
        double t0 = cb_now();
        if (synth_write(&sc, model, err, sizeof err) != STATUS_OK) {
            fprintf(stderr, "bench_cluster: writing the synthetic model %s: %s\n", model, err);
            cb_rmtree(tmp);
            return 1;
        }
        struct stat st;
        fprintf(stderr, "bench_cluster: wrote %s (%.1f MB) in %.1f s\n", model,
                stat(model, &st) == 0 ? (double)st.st_size / 1e6 : 0.0, cb_now() - t0);
    }
    char run_root[PATH_MAX];
    if (o.run_root) {
        if (mkdir(o.run_root, 0755) != 0 && errno != EEXIST) {
            fprintf(stderr, "bench_cluster: --run-root %s: %s\n", o.run_root, strerror(errno));
            cb_rmtree(tmp);
            return 1;
        }
        if (!realpath(o.run_root, run_root)) {
            fprintf(stderr, "bench_cluster: --run-root %s: %s\n", o.run_root, strerror(errno));
            cb_rmtree(tmp);
            return 1;
        }
    } else {
        cb_fmt(run_root, sizeof run_root, "%s/runs", tmp);
        mkdir(run_root, 0755);
    }

    int failed = 0;
    cb_keys_save();
    for (int li = 0; li < o.n_layouts && !cb_stop; li++) {
        const struct cb_layout *lay = &o.lay[li];
        int n_before = cb_n_rows;
        rc = cb_layout(&o, cluster, model, run_root, lay, err, sizeof err);
        if (rc < 0) {
            fprintf(stderr, "bench_cluster: %s: %s\n", lay->name, err);
            failed = 1;
            if (cb_n_rows == n_before) {
                struct cb_row *r = cb_row_add(lay, 0);
                if (r) {
                    r->failed = true;
                    cb_fmt(r->note, sizeof r->note, "%s", err);
                }
            }
        }
    }
    for (int i = 0; i < cb_n_rows; i++)
        if (cb_rows[i].n_err || cb_rows[i].n_short) failed = 1;
    if (cb_stop) {
        fprintf(stderr, "bench_cluster: stopped by a signal; the table has the rows measured so far\n");
        failed = 1;
    }
    cb_print_table(stdout, &o, model_name);
    if (o.json && cb_write_json(o.json, &o, model_name, err, sizeof err) != STATUS_OK) {
        fprintf(stderr, "bench_cluster: %s\n", err);
        failed = 1;
    }
    if (failed && !o.run_root) {
        /* Keep the logs, not the synthetic model written into tmp; a model
         * the user gave is never touched. */
        if (!o.model) unlink(model);
        fprintf(stderr, "bench_cluster: kept the run dirs (logs) under %s\n", run_root);
    } else {
        cb_rmtree(tmp);
    }
    free(o.json_schema);
    return failed;
}
