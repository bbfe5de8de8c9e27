/* What the parts of bench_cluster share: the layouts and options
 * (cluster_options.c), a running cluster (cluster_run.c), the levels'
 * rows (cluster_load.c fills them, cluster_report.c keeps and prints them)
 * and the small helpers of bench_cluster.c.  Nothing here allocates for
 * its caller unless it says so. */
#ifndef BENCH_CLUSTER_BENCH_H
#define BENCH_CLUSTER_BENCH_H

#include "worker/synth.h"

#include <signal.h>
#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>
#include <stdio.h>

#define CB_LIST_MAX 16
#define CB_ROWS_MAX 512
#define CB_CONC_MAX 1024
#define CB_WORKERS_MAX 64

/* ---- bench_cluster.c ---- */

/* Set by SIGTERM/SIGINT: whatever is running winds down and the rows
 * measured so far are printed. */
extern volatile sig_atomic_t cb_stop;

/* snprintf that may cut to fit out without a warning. */
void cb_fmt(char *out, size_t size, const char *fmt, ...) __attribute__((format(printf, 3, 4)));
/* CLOCK_MONOTONIC in seconds. */
double cb_now(void);
void cb_sleep_ms(int ms);

/* ---- cluster_options.c ---- */

/* One cluster to start: pipelines x stages, the stage links' NCCL limited
 * to sockets (as between hosts without NVLink or a shared /dev/shm), and in
 * the shared-prefix workload the router's prefix cache on or off. */
struct cb_layout {
    int pipelines, stages;
    bool sockets;
    int cache;            /* -1: not the shared-prefix workload; 0: --no-prefix-cache; 1: the cache on */
    char name[24];        /* "1x2", "1x2s" */
};

struct cb_opts {
    const char *model, *shape, *type, *stages, *pipelines, *layouts, *concurrency, *device, *cluster, *tmpdir, *run_root,
        *router_args, *worker_args, *log_level, *json, *no_cache_arg, *json_schema_file;
    /* --json-schema: the file's text (NULL: unconstrained); --schema-baseline. */
    char *json_schema;
    bool schema_baseline;
    int requests, prompt_tokens, max_tokens, threads, kv_blocks, warmup, up_timeout_s, up_tries;
    int shared_prefix, question_tokens;
    /* Open loop: Poisson arrivals of rate per second (0: the closed loop),
     * level k of a layout drawn from seed + k. */
    double rate;
    int seed;
    bool insecure;
    /* Parsed lists. */
    int stage_v[CB_LIST_MAX], n_stages;
    int pipe_v[CB_LIST_MAX], n_pipes;
    /* The clusters to start, in order: --layouts, else pipelines x stages;
     * the shared-prefix workload starts each twice (cache on, then off). */
    struct cb_layout lay[2 * CB_LIST_MAX * CB_LIST_MAX];
    int n_layouts;
    int conc_v[CB_LIST_MAX], n_conc;
    enum synth_type synth_type;
};

/* Tokens of every prompt: the shared prefix and a question, or --prompt-tokens. */
int cb_prompt_len(const struct cb_opts *o);
/* Parses the lists into o's layouts and levels and checks --shape, --type
 * and --device.  STATUS_OK, or STATUS_BAD_INPUT with err naming the flag. */
int cb_parse_lists(struct cb_opts *o, char *err, size_t errlen);
/* Reads --json-schema's file into o->json_schema, which the caller frees.
 * STATUS_OK, or a negative status with err naming the file. */
int cb_read_schema(struct cb_opts *o, char *err, size_t errlen);
/* The requests of one level of conc streams. */
int cb_level_requests(const struct cb_opts *o, int conc);

/* ---- cluster_run.c ---- */

/* One worker's counters at one moment: its step time sum and the token
 * rows it computed; < 0 where the scrape failed. */
struct cb_wm {
    double step_s, rows;
};

/* A running cluster: its layout, run dir and each worker's metrics port
 * (worker p*stages+s; 0: unknown). */
struct cb_cluster {
    const struct cb_layout *lay;
    const char *dir;
    int ports[CB_WORKERS_MAX];
    int n_workers;
};

/* Removes dir and everything under it. */
void cb_rmtree(const char *dir);
/* Prints the last lines of every log of a run dir to stderr. */
void cb_print_log_tails(const char *dir);
/* The llm-cluster program next to this one or in the build tree, into
 * out.  0, or a negative status with err saying where it looked. */
int cb_find_cluster(char *out, size_t size, char *err, size_t errlen);
/* Keeps the key variables this program started with; call once, before
 * the first cb_layout. */
void cb_keys_save(void);
/* Each worker's counters now, into wm[cl->n_workers]. */
void cb_cluster_scrape(const struct cb_cluster *cl, struct cb_wm *wm);
/* Starts a cluster of the layout in run_root, measures every level on it
 * (rows added with cb_row_add) and stops it.  0, or a negative status with
 * err saying why. */
int cb_layout(const struct cb_opts *o, const char *cluster, const char *model, const char *run_root,
              const struct cb_layout *lay, char *err, size_t errlen);

/* ---- cluster_load.c ---- */

/* Warms up the running cluster cl at endpoint and measures every
 * concurrency level, one row each.  0, or a negative status with err. */
int cb_levels(const struct cb_opts *o, const struct cb_cluster *cl, const char *endpoint, char *err,
              size_t errlen);

/* ---- cluster_report.c ---- */

/* One concurrency level of one layout: what it ran and what it measured,
 * or a layout that did not start (failed). */
struct cb_row {
    struct cb_layout lay;
    int conc;
    /* Open loop: the arrival rate (0: closed loop) and seed of this level,
     * the requests that waited for a free stream and their mean wait. */
    double rate;
    int seed;
    int n_capped;
    double cap_wait_ms;
    /* -1: no --json-schema; 1: every request constrained by it; 0: the
     * same level unconstrained (--schema-baseline). */
    int constrained;
    int n_req, n_ok, n_err, n_short;
    double wall_s, req_s, tok_s, ttft50, ttft90, itl50, itl90;
    uint64_t steps, tokens;
    double plan_mean, plan_max, turn_mean;
    /* From the workers' metrics ports: each worker's step time over the
     * level's wall time (worker p*stages+s; < 0: not measured), and the
     * token rows the first stages computed (prefill and decode, all
     * pipelines; < 0: not measured). */
    double busy[CB_WORKERS_MAX];
    double rows0;
    bool failed;          /* the cluster did not start: nothing measured */
    char note[160];
};

/* The rows measured so far, in order (cb_rows[0..cb_n_rows)). */
extern struct cb_row cb_rows[CB_ROWS_MAX];
extern int cb_n_rows;

/* A new row of the layout and concurrency, nothing measured yet; NULL when
 * CB_ROWS_MAX are taken. */
struct cb_row *cb_row_add(const struct cb_layout *lay, int conc);
/* The table of every row, and the comparisons the options ask for. */
void cb_print_table(FILE *f, const struct cb_opts *o, const char *model);
/* Every row as JSON into path.  STATUS_OK, or STATUS_IO with err. */
int cb_write_json(const char *path, const struct cb_opts *o, const char *model, char *err, size_t errlen);

#endif
