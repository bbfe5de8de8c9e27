/* bench/bench_cluster on the CPU with the tiny synthetic model: a small
 * layout sweep (one stage, and two stages with the sockets-only NCCL
 * variant, which on the CPU links by ZeroMQ) and the shared-prefix workload
 * with the router's prefix cache on and off.  Checks that the table prints,
 * that the JSON parses with every row measured (busy fractions from the
 * workers' metrics ports included) and that bad command lines are refused.
 * With --rate, the arrivals: a level lasts at least until its last
 * request's scheduled time (a bound the schedule sets, not a speed).  With
 * --json-schema --schema-baseline, each level unconstrained and constrained
 * on one cluster, compared.  At debug level, scripts/step-timeline.py over
 * a 1x2 cluster's logs.  No
 * speed is asserted: that is the benchmark's business, never a test's. */
#include "tests/bench/bench_child.h"

#include <cjson/cJSON.h>
#include <errno.h>
#include <fcntl.h>
#include <math.h>
#include <stdint.h>
#include <signal.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/prctl.h>
#include <sys/wait.h>
#include <time.h>
#include <unistd.h>

#define BENCH_BIN LLM_BINARY_DIR "/bench/bench_cluster"
#define CLUSTER_BIN LLM_BINARY_DIR "/router/llm-cluster"
#define ROUTER_BIN LLM_BINARY_DIR "/router/llm-router"
#define WORKER_BIN LLM_BINARY_DIR "/worker/llm-worker"

static char out_path[256], err_path[256], json_path[256];

/* redis-server from $LLM_REDIS_SERVER or PATH, as llm-cluster finds it. */
static int have_redis(void) {
    const char *env = getenv("LLM_REDIS_SERVER");
    if (env && *env) return access(env, X_OK) == 0;
    const char *path = getenv("PATH");
    if (!path) return 0;
    char buf[4096], file[4200];
    snprintf(buf, sizeof buf, "%s", path);
    for (char *save = NULL, *d = strtok_r(buf, ":", &save); d; d = strtok_r(NULL, ":", &save)) {
        snprintf(file, sizeof file, "%s/redis-server", d);
        if (access(file, X_OK) == 0) return 1;
    }
    return 0;
}

static void need_programs(void) {
    const char *bins[] = {BENCH_BIN, CLUSTER_BIN, ROUTER_BIN, WORKER_BIN};
    for (size_t i = 0; i < sizeof bins / sizeof bins[0]; i++)
        if (access(bins[i], X_OK) != 0) TEST_FAIL("%s is not built", bins[i]);
    if (!have_redis()) TEST_SKIP("no redis-server (PATH or LLM_REDIS_SERVER): llm-cluster cannot start a cluster");
}

/* Runs bench_cluster with args (NULL-terminated), stdout and stderr into
 * files; returns its exit status, or -1 when it ran past limit_s. */
static int run_bench(const char *const *args, int limit_s) {
    const char *dir = getenv("TMPDIR") && *getenv("TMPDIR") ? getenv("TMPDIR") : "/tmp";
    snprintf(out_path, sizeof out_path, "%s/test_bench_cluster.%d.out", dir, (int)getpid());
    snprintf(err_path, sizeof err_path, "%s/test_bench_cluster.%d.err", dir, (int)getpid());
    const char *argv[48] = {BENCH_BIN};
    int n = 1;
    for (; args[n - 1] && n < 47; n++) argv[n] = args[n - 1];
    argv[n] = NULL;
    return bench_child_run(argv, out_path, err_path, limit_s);
}

static void show_err(void) {
    char *e = bench_child_slurp(err_path);
    printf("  --- bench_cluster stderr:\n%s\n", e ? e : "(none)");
    free(e);
}

static cJSON *load_json(void) {
    char *text = bench_child_slurp(json_path);
    if (!text) TEST_FAIL("bench_cluster wrote no %s", json_path);
    cJSON *j = cJSON_Parse(text);
    if (!j) TEST_FAIL("%s does not parse as JSON:\n%s", json_path, text);
    free(text);
    return j;
}

static double num(const cJSON *o, const char *key) {
    const cJSON *v = cJSON_GetObjectItem(o, key);
    if (!cJSON_IsNumber(v)) TEST_FAIL("JSON row without a number \"%s\"", key);
    return v->valuedouble;
}

/* Every row ran, every request came back whole, and the workers' metrics
 * gave a busy fraction for each stage and the first stages' rows. */
static void check_rows(const cJSON *rows, int requests, int prompt, int max_tokens) {
    const cJSON *r;
    cJSON_ArrayForEach(r, rows) {
        const char *layout = cJSON_GetStringValue(cJSON_GetObjectItem(r, "layout"));
        if (!cJSON_IsTrue(cJSON_GetObjectItem(r, "ran")))
            TEST_FAIL("layout %s did not run: %s", layout, cJSON_GetStringValue(cJSON_GetObjectItem(r, "error")));
        ASSERT_EQ(requests, (int)num(r, "ok"));
        ASSERT_EQ(0, (int)num(r, "failed"));
        ASSERT_EQ(0, (int)num(r, "short"));
        ASSERT_EQ((double)requests * max_tokens, num(r, "tokens"));
        ASSERT_TRUE(num(r, "tok_s") > 0);
        ASSERT_TRUE(num(r, "ttft_p50_ms") > 0);
        ASSERT_TRUE(num(r, "ttft_p90_ms") >= num(r, "ttft_p50_ms"));
        const cJSON *busy = cJSON_GetObjectItem(r, "busy_by_stage");
        ASSERT_EQ((int)num(r, "stages"), cJSON_GetArraySize(busy));
        const cJSON *b;
        cJSON_ArrayForEach(b, busy) {
            if (!cJSON_IsNumber(b)) TEST_FAIL("layout %s: a stage without a busy fraction (metrics port not read)", layout);
            ASSERT_TRUE(b->valuedouble > 0);
        }
        /* The first stages computed at most every prompt row and every
         * generated token but the last (a prefix cache saves rows). */
        double rows0 = num(r, "stage0_rows"), most = (double)requests * (prompt + max_tokens - 1);
        ASSERT_TRUE(rows0 > 0);
        if (rows0 > most)
            TEST_FAIL("layout %s: the first stages computed %.0f rows, more than %.0f", layout, rows0, most);
    }
}

TEST(sweep_prints_the_table_and_json) {
    need_programs();
    snprintf(json_path, sizeof json_path, "%s/test_bench_cluster.%d.json", "/tmp", (int)getpid());
    const char *args[] = {"--shape", "tiny", "--threads", "1", "--layouts", "1x1,1x2s", "--concurrency", "2",
                          "--requests", "4", "--prompt-tokens", "16", "--max-tokens", "4", "--up-tries", "2",
                          "--json", json_path, NULL};
    int rc = run_bench(args, 60);
    if (rc != 0) show_err();
    ASSERT_EQ(0, rc);
    char *out = bench_child_slurp(out_path);
    ASSERT_TRUE(out != NULL);
    ASSERT_TRUE(strstr(out, "| layout | conc | requests |") != NULL);
    ASSERT_TRUE(strstr(out, "| 1x1 | 2 | 4 |") != NULL);
    ASSERT_TRUE(strstr(out, "| 1x2s | 2 | 4 |") != NULL);
    free(out);
    cJSON *j = load_json();
    ASSERT_STREQ("distinct", cJSON_GetStringValue(cJSON_GetObjectItem(j, "workload")));
    const cJSON *rows = cJSON_GetObjectItem(j, "rows");
    ASSERT_EQ(2, cJSON_GetArraySize(rows));
    check_rows(rows, 4, 16, 4);
    const cJSON *r1 = cJSON_GetArrayItem(rows, 1);
    ASSERT_TRUE(cJSON_IsTrue(cJSON_GetObjectItem(r1, "nccl_sockets")));
    ASSERT_EQ(2, (int)num(r1, "stages"));
    cJSON_Delete(j);
    unlink(json_path);
    unlink(out_path);
    unlink(err_path);
}

/* At debug level the router and every stage log a line a step in the
 * host's monotonic clock, and scripts/step-timeline.py joins them by step
 * id: a 1x2 cluster's decode steps, each stage's phases, the trip each
 * way and the router's turn between a result and its next plan; and
 * scripts/c1-cost.py reads the run's 1x1 and 1x2 rows as c1spin rounds
 * (the tools behind the two-GPU second-stage cost, docs/cluster-bench.md). */
TEST(timeline_joins_the_router_and_the_stages) {
    need_programs();
    if (system("python3 -c 'import statistics' >/dev/null 2>&1") != 0) TEST_SKIP("no python3");
    char root[256], cmd[1024];
    snprintf(root, sizeof root, "%s/test_bench_cluster.%d.runs", "/tmp", (int)getpid());
    char json[300];
    snprintf(json, sizeof json, "%s/c1spin_0_1.json", root);
    const char *args[] = {"--shape", "tiny", "--threads", "1", "--layouts", "1x1,1x2", "--concurrency", "1",
                          "--requests", "3", "--prompt-tokens", "16", "--max-tokens", "12", "--up-tries", "2",
                          "--log-level", "debug", "--run-root", root, "--json", json, NULL};
    int rc = run_bench(args, 90);
    if (rc != 0) show_err();
    ASSERT_EQ(0, rc);
    snprintf(cmd, sizeof cmd, "python3 '%s/scripts/step-timeline.py' --tokens 1 '%s/1x2' 2>&1", LLM_SOURCE_DIR, root);
    FILE *f = popen(cmd, "r");
    ASSERT_TRUE(f != NULL);
    static char out[8192];
    size_t len = fread(out, 1, sizeof out - 1, f);
    out[len] = '\0';
    int st = pclose(f);
    printf("%s", out);
    ASSERT_EQ(0, WIFEXITED(st) ? WEXITSTATUS(st) : -1);
    int joined = 0;
    const char *p = strstr(out, "2 stage(s), ");
    ASSERT_TRUE(p != NULL && sscanf(p, "2 stage(s), %d steps", &joined) == 1);
    /* 3 requests of 12 tokens: 11 one-token decode steps each. */
    ASSERT_TRUE(joined >= 3 * 11);
    const char *rows[] = {"plan->s0", "s0 handoff", "s0 done", "plan->s1", "s1 input", "s1 queued", "s1 done",
                          "result->router", "round trip", "router turn", "step interval"};
    for (size_t i = 0; i < sizeof rows / sizeof rows[0]; i++)
        if (!strstr(out, rows[i])) TEST_FAIL("step-timeline.py printed no \"%s\" row", rows[i]);
    /* The same run as two rounds of gpu-session.sh's c1spin: c1-cost.py
     * reads the 1x1 and 1x2 rows of each and prints the median cost. */
    snprintf(cmd, sizeof cmd, "cp '%s' '%s/c1spin_0_2.json' && python3 '%s/scripts/c1-cost.py' '%s' 2>&1", json, root,
             LLM_SOURCE_DIR, root);
    f = popen(cmd, "r");
    ASSERT_TRUE(f != NULL);
    len = fread(out, 1, sizeof out - 1, f);
    out[len] = '\0';
    st = pclose(f);
    printf("%s", out);
    ASSERT_EQ(0, WIFEXITED(st) ? WEXITSTATUS(st) : -1);
    double by_tok = 0.0, by_itl = 0.0;
    p = strstr(out, "--spin-us 0     median of 2 rounds: ");
    ASSERT_TRUE(p != NULL && sscanf(p, "--spin-us 0     median of 2 rounds: %lf%% by tok/s, %lf%% by ITL p50", &by_tok,
                                    &by_itl) == 2);
    ASSERT_TRUE(by_tok > -100.0 && by_tok < 100.0 && by_itl > -100.0);
    snprintf(cmd, sizeof cmd, "rm -rf '%s'", root);
    ASSERT_EQ(0, system(cmd));
    unlink(out_path);
    unlink(err_path);
}

/* The router's --help names its prefix-cache switch: the shared-prefix
 * workload needs it for the run without the cache. */
static int router_has_prefix_cache(void) {
    char cmd[512];
    snprintf(cmd, sizeof cmd, "'%s' --help 2>&1 | grep -q -- --no-prefix-cache", ROUTER_BIN);
    return system(cmd) == 0;
}

TEST(shared_prefix_runs_with_the_cache_on_and_off) {
    need_programs();
    if (!router_has_prefix_cache()) TEST_SKIP("this llm-router has no --no-prefix-cache");
    snprintf(json_path, sizeof json_path, "%s/test_bench_cluster.%d.json", "/tmp", (int)getpid());
    const char *args[] = {"--shape", "tiny", "--threads", "1", "--layouts", "1x1", "--shared-prefix", "64",
                          "--question-tokens", "8", "--concurrency", "2", "--requests", "6", "--max-tokens", "4",
                          "--json", json_path, NULL};
    int rc = run_bench(args, 60);
    if (rc != 0) show_err();
    ASSERT_EQ(0, rc);
    char *out = bench_child_slurp(out_path);
    ASSERT_TRUE(out != NULL);
    ASSERT_TRUE(strstr(out, "| 1x1 | on | 2 | 6 |") != NULL);
    ASSERT_TRUE(strstr(out, "| 1x1 | off | 2 | 6 |") != NULL);
    ASSERT_TRUE(strstr(out, "### shared prefix: prefix cache on against off") != NULL);
    free(out);
    cJSON *j = load_json();
    ASSERT_STREQ("shared-prefix", cJSON_GetStringValue(cJSON_GetObjectItem(j, "workload")));
    ASSERT_EQ(72, (int)num(j, "prompt_tokens"));
    const cJSON *rows = cJSON_GetObjectItem(j, "rows");
    ASSERT_EQ(2, cJSON_GetArraySize(rows));
    check_rows(rows, 6, 72, 4);
    ASSERT_TRUE(cJSON_IsTrue(cJSON_GetObjectItem(cJSON_GetArrayItem(rows, 0), "prefix_cache")));
    ASSERT_TRUE(cJSON_IsFalse(cJSON_GetObjectItem(cJSON_GetArrayItem(rows, 1), "prefix_cache")));
    const cJSON *cmp = cJSON_GetObjectItem(j, "prefix_cache");
    ASSERT_EQ(1, cJSON_GetArraySize(cmp));
    const cJSON *c0 = cJSON_GetArrayItem(cmp, 0);
    ASSERT_TRUE(num(c0, "ttft_ratio") > 0);
    ASSERT_TRUE(num(c0, "throughput_ratio") > 0);
    cJSON_Delete(j);
    unlink(json_path);
    unlink(out_path);
    unlink(err_path);
}

/* The time of the last of n arrivals at rate per second from seed, as
 * serve-bench draws them (mulberry32 seeded with seed ^ 0x5bd1e995,
 * exponential gaps), written out here apart from bench_cluster's own. */
static double last_arrival_s(uint32_t seed, double rate, int n) {
    uint32_t s = seed ^ 0x5bd1e995u;
    double t = 0;
    for (int k = 0; k < n; k++) {
        s += 0x6d2b79f5u;
        uint32_t x = s;
        x = (x ^ (x >> 15)) * (x | 1u);
        x ^= x + (x ^ (x >> 7)) * (x | 61u);
        t += -log(1.0 - (double)(x ^ (x >> 14)) / 4294967296.0) / rate;
    }
    return t;
}

/* 16 requests at 20 req/s from seed 3: the last is due at 0.86 s, where
 * the closed loop sends all 16 in a fraction of that on the tiny model. */
TEST(rate_sends_requests_at_their_poisson_arrivals) {
    need_programs();
    snprintf(json_path, sizeof json_path, "%s/test_bench_cluster.%d.json", "/tmp", (int)getpid());
    const char *args[] = {"--shape", "tiny", "--threads", "1", "--layouts", "1x1", "--concurrency", "4",
                          "--requests", "16", "--prompt-tokens", "16", "--max-tokens", "4", "--rate", "20",
                          "--seed", "3", "--json", json_path, NULL};
    int rc = run_bench(args, 60);
    if (rc != 0) show_err();
    ASSERT_EQ(0, rc);
    char *out = bench_child_slurp(out_path);
    ASSERT_TRUE(out != NULL);
    ASSERT_TRUE(strstr(out, "open loop: Poisson arrivals at 20 req/s") != NULL);
    ASSERT_TRUE(strstr(out, "| layout | conc | rate req/s | capped | requests |") != NULL);
    ASSERT_TRUE(strstr(out, "| 1x1 | 4 | 20 | ") != NULL);
    free(out);
    cJSON *j = load_json();
    ASSERT_EQ(20.0, num(j, "rate"));
    ASSERT_EQ(3, (int)num(j, "seed"));
    const cJSON *rows = cJSON_GetObjectItem(j, "rows");
    ASSERT_EQ(1, cJSON_GetArraySize(rows));
    check_rows(rows, 16, 16, 4);
    const cJSON *r = cJSON_GetArrayItem(rows, 0);
    ASSERT_EQ(20.0, num(r, "rate"));
    ASSERT_EQ(3, (int)num(r, "arrival_seed"));
    ASSERT_TRUE(num(r, "capped") >= 0);
    double last = last_arrival_s(3, 20, 16);
    ASSERT_TRUE(last > 0.8 && last < 0.9);
    if (!(num(r, "wall_s") >= last))
        TEST_FAIL("16 requests at 20 req/s took %.3f s, before the last arrival at %.3f s", num(r, "wall_s"), last);
    cJSON_Delete(j);

    /* One stream and arrivals 1 ms apart on average, each request several
     * ms long: arrivals find the stream busy, wait for it and are counted. */
    const char *capped[] = {"--shape", "tiny", "--threads", "1", "--layouts", "1x1", "--concurrency", "1",
                            "--requests", "8", "--prompt-tokens", "16", "--max-tokens", "16", "--rate", "1000",
                            "--json", json_path, NULL};
    rc = run_bench(capped, 60);
    if (rc != 0) show_err();
    ASSERT_EQ(0, rc);
    j = load_json();
    rows = cJSON_GetObjectItem(j, "rows");
    check_rows(rows, 8, 16, 16);
    r = cJSON_GetArrayItem(rows, 0);
    ASSERT_EQ(1, (int)num(r, "arrival_seed")); /* the default seed, level 0 */
    ASSERT_TRUE(num(r, "capped") >= 1 && num(r, "capped") <= 7);
    ASSERT_TRUE(num(r, "cap_wait_ms_mean") > 0);
    cJSON_Delete(j);
    unlink(json_path);
    unlink(out_path);
    unlink(err_path);
}

/* --json-schema with --schema-baseline: each level unconstrained, then
 * constrained, on one cluster; the constrained outputs are JSON (the first
 * is shown), the table and the JSON compare the two. */
TEST(json_schema_runs_constrained_against_unconstrained) {
    need_programs();
    snprintf(json_path, sizeof json_path, "%s/test_bench_cluster.%d.json", "/tmp", (int)getpid());
    const char *args[] = {"--shape", "tiny", "--threads", "1", "--layouts", "1x1", "--concurrency", "2",
                          "--requests", "4", "--prompt-tokens", "16", "--max-tokens", "8", "--up-tries", "2",
                          "--json-schema", LLM_SOURCE_DIR "/bench/schemas/records.json", "--schema-baseline",
                          "--json", json_path, NULL};
    int rc = run_bench(args, 60);
    if (rc != 0) show_err();
    ASSERT_EQ(0, rc);
    char *out = bench_child_slurp(out_path), *err = bench_child_slurp(err_path);
    ASSERT_TRUE(out && err);
    ASSERT_TRUE(strstr(out, "| layout | schema | conc |") != NULL);
    ASSERT_TRUE(strstr(out, "### JSON-schema constrained against unconstrained") != NULL);
    /* The records schema's output starts with an object (the grammar
     * allows no blank before it). */
    const char *sample = strstr(err, "constrained output of request 0");
    ASSERT_TRUE(sample != NULL);
    sample = strstr(sample, "shown): ");
    ASSERT_TRUE(sample != NULL && sample[8] == '{');
    cJSON *j = load_json();
    ASSERT_TRUE(cJSON_IsString(cJSON_GetObjectItem(j, "json_schema")));
    const cJSON *rows = cJSON_GetObjectItem(j, "rows");
    ASSERT_EQ(2, cJSON_GetArraySize(rows));
    check_rows(rows, 4, 16, 8);
    ASSERT_TRUE(cJSON_IsFalse(cJSON_GetObjectItem(cJSON_GetArrayItem(rows, 0), "constrained")));
    ASSERT_TRUE(cJSON_IsTrue(cJSON_GetObjectItem(cJSON_GetArrayItem(rows, 1), "constrained")));
    const cJSON *cmp = cJSON_GetObjectItem(j, "constrained_vs_unconstrained");
    ASSERT_EQ(1, cJSON_GetArraySize(cmp));
    ASSERT_TRUE(num(cJSON_GetArrayItem(cmp, 0), "throughput_ratio") > 0);
    cJSON_Delete(j);
    free(out);
    free(err);
    unlink(json_path);
    unlink(out_path);
    unlink(err_path);
}

TEST(bad_command_lines_are_refused) {
    if (access(BENCH_BIN, X_OK) != 0) TEST_FAIL("%s is not built", BENCH_BIN);
    const char *bad[][4] = {
        {"--layouts", "1x", NULL},
        {"--layouts", "1x2q", NULL},
        {"--layouts", "0x1", NULL},
        {"--concurrency", "0", NULL},
        {"--shape", "nonesuch", NULL},
        {"--device", "cuda:0", NULL},
        {"--rate", "-1", NULL},
        {"--rate", "nan", NULL},
        {"--rate", "fast", NULL},
        {"--rate", "", NULL},
        {"--seed", "-2", NULL},
        {"--json-schema", "/nonexistent/schema.json", NULL},
    };
    for (size_t i = 0; i < sizeof bad / sizeof bad[0]; i++) {
        int rc = run_bench(bad[i], 10);
        if (rc != 2) show_err();
        ASSERT_EQ(2, rc);
        char *e = bench_child_slurp(err_path);
        ASSERT_TRUE(e && strstr(e, bad[i][0]) != NULL); /* the message names the flag */
        if (bad[i][1][0]) ASSERT_TRUE(strstr(e, bad[i][1]) != NULL); /* and the value */
        free(e);
    }
    /* A comparison with nothing to compare. */
    const char *baseline[] = {"--schema-baseline", NULL};
    ASSERT_EQ(2, run_bench(baseline, 10));
    char *e = bench_child_slurp(err_path);
    ASSERT_TRUE(e && strstr(e, "--schema-baseline") && strstr(e, "--json-schema"));
    free(e);
    unlink(out_path);
    unlink(err_path);
}

TEST_MAIN(sweep_prints_the_table_and_json, shared_prefix_runs_with_the_cache_on_and_off,
          rate_sends_requests_at_their_poisson_arrivals, json_schema_runs_constrained_against_unconstrained,
          timeline_joins_the_router_and_the_stages, bad_command_lines_are_refused)
