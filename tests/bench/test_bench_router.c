/* bench/bench_router with one simulated pipeline: the table prints, the JSON
 * row carries the client's latency figures, --sim-args reaches sim_worker,
 * --rate's open loop sends its arrivals at their rate and counts a wait
 * for a free slot in the TTFT, and --shared-prefix's prompts share their
 * prefix, and only it, in the router's prefix cache.  The latencies are held only to what the simulated step time
 * forces (a step of 2 ms cannot give tokens less than about 2 ms apart, nor
 * a first token sooner), with upper bounds orders of magnitude away: they
 * catch a wrong unit or a sample from the wrong request, never a slow
 * machine. */
#include "tests/bench/bench_child.h"

#include <cjson/cJSON.h>
#include <errno.h>
#include <fcntl.h>
#include <signal.h>
#include <stdbool.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/prctl.h>
#include <sys/wait.h>
#include <time.h>
#include <unistd.h>

#define BENCH_BIN LLM_BINARY_DIR "/bench/bench_router"
#define SIM_BIN LLM_BINARY_DIR "/bench/sim_worker"
#define ROUTER_BIN LLM_BINARY_DIR "/router/llm-router"

static char out_path[256], err_path[256], json_path[256];

/* redis-server as bench_router finds it: $LLM_REDIS_SERVER, else
 * /usr/bin/redis-server. */
static void need_programs(void) {
    const char *bins[] = {BENCH_BIN, SIM_BIN, ROUTER_BIN};
    for (size_t i = 0; i < sizeof bins / sizeof bins[0]; i++)
        if (access(bins[i], X_OK) != 0) TEST_FAIL("%s is not built", bins[i]);
    const char *redis = getenv("LLM_REDIS_SERVER");
    if (!redis || !*redis) redis = "/usr/bin/redis-server";
    if (access(redis, X_OK) != 0) TEST_SKIP("no %s (set LLM_REDIS_SERVER): bench_router cannot start a router", redis);
}

/* Runs bench_router with args (NULL-terminated), stdout and stderr into
 * files; returns its exit status, or -1 when it ran past limit_s.
 * bench_router picks its ports by binding port 0 and letting go, so another
 * test running beside this one (or an outgoing connection's ephemeral port)
 * can take one before redis-server or llm-router binds it; that run says
 * "Address already in use" and is run again on fresh ports, at most twice,
 * since it says nothing about bench_router. */
static int run_bench(const char *const *args, int limit_s) {
    const char *dir = getenv("TMPDIR") && *getenv("TMPDIR") ? getenv("TMPDIR") : "/tmp";
    snprintf(out_path, sizeof out_path, "%s/test_bench_router.%d.out", dir, (int)getpid());
    snprintf(err_path, sizeof err_path, "%s/test_bench_router.%d.err", dir, (int)getpid());
    snprintf(json_path, sizeof json_path, "%s/test_bench_router.%d.json", dir, (int)getpid());
    const char *argv[48] = {BENCH_BIN};
    int n = 1;
    for (; args[n - 1] && n < 45; n++) argv[n] = args[n - 1];
    argv[n++] = "--json";
    argv[n++] = json_path;
    argv[n] = NULL;
    for (int attempt = 0;; attempt++) {
        unlink(json_path);
        int rc = bench_child_run(argv, out_path, err_path, limit_s);
        if (rc == 0 || attempt == 2) return rc;
        char *e = bench_child_slurp(err_path);
        bool in_use = e && strstr(e, "Address already in use");
        free(e);
        if (!in_use) return rc;
        printf("  bench_router exited %d: a port it picked was taken meanwhile (attempt %d), running it again\n", rc,
               attempt + 1);
    }
}

static void show_err(void) {
    char *e = bench_child_slurp(err_path);
    printf("  --- bench_router stderr:\n%s\n", e ? e : "(none)");
    free(e);
}

static bool flag(const cJSON *o, const char *key) {
    const cJSON *v = cJSON_GetObjectItem(o, key);
    if (!cJSON_IsBool(v)) TEST_FAIL("JSON without a true or false \"%s\"", key);
    return cJSON_IsTrue(v);
}

static double num(const cJSON *o, const char *key) {
    const cJSON *v = cJSON_GetObjectItem(o, key);
    if (!cJSON_IsNumber(v)) TEST_FAIL("JSON row without a number \"%s\"", key);
    return v->valuedouble;
}

/* Runs one level and returns its JSON (the caller frees it); *row is its
 * only row.  The table must say which loop ran (load: the start of the
 * line above it). */
static cJSON *run_level(const char *const *args, const char *load, const cJSON **row) {
    int rc = run_bench(args, 90);
    if (rc != 0) {
        show_err();
        TEST_FAIL("bench_router exited %d", rc);
    }
    char *text = bench_child_slurp(json_path);
    if (!text) TEST_FAIL("bench_router wrote no %s", json_path);
    cJSON *j = cJSON_Parse(text);
    if (!j) TEST_FAIL("%s does not parse as JSON:\n%s", json_path, text);
    free(text);
    const cJSON *rows = cJSON_GetObjectItem(j, "rows");
    if (cJSON_GetArraySize(rows) != 1) TEST_FAIL("%d rows for one pipeline count", cJSON_GetArraySize(rows));
    *row = cJSON_GetArrayItem(rows, 0);
    char *out = bench_child_slurp(out_path);
    if (!out || !strstr(out, "| TTFT ms p50 / p90 | ITL ms p50 / p90 / p99 |") || !strstr(out, "| prefix hits |") ||
        !strstr(out, "| 1 x 1 |"))
        TEST_FAIL("no latency columns or no row in the table:\n%s", out ? out : "(none)");
    if (strncmp(out, load, strlen(load)) != 0) TEST_FAIL("the table does not start with \"%s\":\n%s", load, out);
    free(out);
    unlink(json_path);
    unlink(out_path);
    unlink(err_path);
    return j;
}

TEST(latency_follows_the_step_time) {
    need_programs();
    const char *args[] = {"--pipelines", "1", "--seqs", "8", "--prompt-tokens", "16", "--max-tokens", "32",
                          "--step-us", "2000", "--seconds", "2", "--warmup-s", "1", NULL};
    const cJSON *r;
    cJSON *j = run_level(args, "closed loop:", &r);
    ASSERT_EQ(0.0, num(r, "errors"));
    ASSERT_EQ(0.0, num(r, "rate"));
    ASSERT_EQ(8.0, num(r, "in_flight"));
    ASSERT_TRUE(num(r, "requests_done") > 0);
    double tok_s = num(r, "gen_tok_s");
    ASSERT_EQ(num(r, "tokens_per_s"), tok_s);
    ASSERT_TRUE(tok_s > 0);
    /* Every token that came in the window is one sample: the first of a
     * request's one TTFT sample (the simulated prefill gives one token),
     * each later one an ITL sample. */
    double tokens = tok_s * num(r, "window_s"), samples = num(r, "ttft_samples") + num(r, "itl_samples");
    if (samples < 0.95 * tokens || samples > 1.01 * tokens)
        TEST_FAIL("%.0f latency samples for %.0f tokens in the window", samples, tokens);
    ASSERT_TRUE(num(r, "ttft_samples") > 0);
    /* A token needs a step of 2 ms; the first needs the prefill's step as
     * well, after the plan that took the request in. */
    double itl50 = num(r, "itl_p50_ms"), itl90 = num(r, "itl_p90_ms"), itl99 = num(r, "itl_p99_ms");
    double ttft50 = num(r, "ttft_p50_ms"), ttft90 = num(r, "ttft_p90_ms");
    printf("  ITL ms %.3f / %.3f / %.3f, TTFT ms %.3f / %.3f, %.0f tok/s\n", itl50, itl90, itl99, ttft50, ttft90,
           tok_s);
    if (itl50 < 1.5 || itl50 > 200) TEST_FAIL("ITL p50 %.3f ms with 2 ms steps", itl50);
    if (ttft50 < 2 || ttft50 > 2000) TEST_FAIL("TTFT p50 %.3f ms with 2 ms steps", ttft50);
    ASSERT_TRUE(itl90 >= itl50 && itl99 >= itl90);
    ASSERT_TRUE(ttft90 >= ttft50);
    cJSON_Delete(j);
}

TEST(sim_args_reach_sim_worker) {
    need_programs();
    /* Steps at once from bench_router's --step-us, 4 ms from the extra
     * words that come after it on sim_worker's command line. */
    const char *args[] = {"--pipelines", "1", "--seqs", "8", "--prompt-tokens", "16", "--max-tokens", "32",
                          "--step-us", "0", "--sim-args", "--log-level info --step-us 4000", "--seconds", "1",
                          "--warmup-s", "1", NULL};
    const cJSON *r;
    cJSON *j = run_level(args, "closed loop:", &r);
    double itl50 = num(r, "itl_p50_ms");
    printf("  ITL p50 %.3f ms\n", itl50);
    if (itl50 < 3) TEST_FAIL("ITL p50 %.3f ms: the 4 ms steps of --sim-args did not reach sim_worker", itl50);
    cJSON_Delete(j);
}

/* sim_worker --step-ms prices a step by its tokens: 8 decodes at 1 ms, any
 * step with a 16-token prompt in it at 10 ms, so first tokens take 10 ms
 * or more while most gaps stay near 1 ms. */
TEST(step_ms_prices_steps_by_their_tokens) {
    need_programs();
    const char *args[] = {"--pipelines", "1", "--seqs", "8", "--prompt-tokens", "16", "--max-tokens", "32",
                          "--sim-args", "--step-ms 1:1,8:1,9:10,2000:10", "--seconds", "2", "--warmup-s", "1", NULL};
    const cJSON *r;
    cJSON *j = run_level(args, "closed loop:", &r);
    double itl50 = num(r, "itl_p50_ms"), ttft50 = num(r, "ttft_p50_ms");
    printf("  ITL p50 %.3f ms, TTFT p50 %.3f ms\n", itl50, ttft50);
    /* Under 9 ms: priced as the 10 ms prompt steps it could not be, with
     * room for a busy machine's scheduling on top of the 1 ms. */
    if (itl50 < 0.8 || itl50 > 9) TEST_FAIL("ITL p50 %.3f ms: decode steps of 8 tokens take 1 ms", itl50);
    if (ttft50 < 9.5) TEST_FAIL("TTFT p50 %.3f ms: a step with a 16-token prompt takes 10 ms", ttft50);
    cJSON_Delete(j);
}

/* Requests of 4 tokens take about 5 steps of 2 ms, so 32 slots carry some
 * 3,000 a second (and several times 200 on a busy machine): 200 arrivals
 * a second all go, about as they come. */
TEST(open_loop_keeps_its_rate) {
    need_programs();
    const char *args[] = {"--pipelines", "1", "--seqs", "32", "--prompt-tokens", "16", "--max-tokens", "4",
                          "--step-us", "2000", "--rate", "200", "--seconds", "2", "--warmup-s", "1", NULL};
    const cJSON *r;
    cJSON *j = run_level(args, "open loop: Poisson arrivals at 200 req/s", &r);
    ASSERT_EQ(200.0, num(r, "rate"));
    ASSERT_EQ(1.0, num(r, "arrival_seed"));
    ASSERT_EQ(0.0, num(r, "errors"));
    double req_s = num(r, "requests_per_s"), w = num(r, "window_s");
    printf("  %.1f requests/s done at 200 arriving, %.0f capped, TTFT p50 %.3f ms\n", req_s, num(r, "capped"),
           num(r, "ttft_p50_ms"));
    if (req_s < 150 || req_s > 250) TEST_FAIL("%.1f requests/s done in the window at 200 arriving", req_s);
    double done = num(r, "requests_done");
    if (done < req_s * w - 1 || done > req_s * w + 1) TEST_FAIL("%.0f requests done, %.1f/s in %.3f s", done, req_s, w);
    double ttft50 = num(r, "ttft_p50_ms");
    if (ttft50 < 2 || ttft50 > 2000) TEST_FAIL("TTFT p50 %.3f ms with 2 ms steps", ttft50);
    cJSON_Delete(j);
}

/* One slot and requests of about 10 ms carry some 100 a second: at 1000
 * arriving the queue grows by about 0.9 s each second, and the TTFT, counted
 * from the arrival, with it (from the send it would stay near 2 steps). */
TEST(open_loop_counts_the_wait_for_a_slot) {
    need_programs();
    const char *args[] = {"--pipelines", "1", "--seqs", "1", "--prompt-tokens", "16", "--max-tokens", "4",
                          "--step-us", "2000", "--rate", "1000", "--seed", "5", "--seconds", "1", "--warmup-s", "1",
                          NULL};
    const cJSON *r;
    cJSON *j = run_level(args, "open loop: Poisson arrivals at 1000 req/s (seed 5 + level)", &r);
    double req_s = num(r, "requests_per_s"), ttft50 = num(r, "ttft_p50_ms"), capped = num(r, "capped");
    printf("  %.1f requests/s done at 1000 arriving, %.0f capped, TTFT p50 %.1f ms\n", req_s, capped, ttft50);
    ASSERT_EQ(5.0, num(r, "arrival_seed"));
    if (req_s > 300) TEST_FAIL("%.1f requests/s done with one slot and 10 ms requests", req_s);
    if (capped < 500) TEST_FAIL("%.0f of about 1000 arrivals in the window found the slot busy", capped);
    if (ttft50 < 300) TEST_FAIL("TTFT p50 %.1f ms: the wait for the slot is not counted", ttft50);
    cJSON_Delete(j);
}

/* Prompts of 256 shared tokens and 32 of their own, in blocks of 16
 * (sim_worker's default): with the cache on each admission finds the 16
 * blocks of the prefix cached and computes its question, so 256 of every
 * 288 prompt tokens are hits, no more (the question's first block found
 * cached would be a match between two requests' own tokens; its last block
 * is computed in any case, for the last token's logits) and not many fewer
 * (only the first requests and those let in while the prefix was still
 * being computed miss it).  With --no-prefix-cache the router finds
 * nothing. */
TEST(shared_prefix_is_found_cached) {
    need_programs();
    const char *on[] = {"--pipelines", "1", "--shared-prefix", "256", "--question-tokens", "32", "--max-tokens", "8",
                        "--seqs", "8", "--step-us", "0", "--seconds", "2", "--warmup-s", "1", NULL};
    /* The loop line names the workload. */
    const char *load = "closed loop: pipelines x 8 in flight, each request replaced when it ends, TTFT from the send; "
                       "prompts of a 256-token shared prefix + a distinct 32-token question";
    const cJSON *r;
    cJSON *j = run_level(on, load, &r);
    ASSERT_EQ(256.0, num(j, "shared_prefix"));
    ASSERT_EQ(32.0, num(j, "question_tokens"));
    ASSERT_EQ(288.0, num(j, "prompt_tokens"));
    ASSERT_EQ(0.0, num(r, "errors"));
    ASSERT_TRUE(flag(r, "prefix_cache"));
    double hit = num(r, "prefix_hit_tokens"), miss = num(r, "prefix_miss_tokens"), done = num(r, "requests_done");
    printf("  cache on: %.0f prompt tokens found cached, %.0f computed, %.0f requests done\n", hit, miss, done);
    if (hit + miss < 288 * 100) TEST_FAIL("%.0f prompt tokens admitted in the window", hit + miss);
    double share = hit / (hit + miss);
    if (share < 0.9 * 256 / 288 || share > 256.0 / 288 + 1e-9)
        TEST_FAIL("%.4f of the prompt tokens found cached; the prefix is %.4f of each prompt", share, 256.0 / 288);
    ASSERT_TRUE(hit > miss);
    cJSON_Delete(j);

    const char *off[] = {"--pipelines", "1", "--shared-prefix", "256", "--question-tokens", "32", "--max-tokens",
                         "8", "--seqs", "8", "--step-us", "0", "--seconds", "2", "--warmup-s", "1", "--router-args",
                         "--no-prefix-cache", NULL};
    j = run_level(off, load, &r);
    ASSERT_EQ(0.0, num(r, "errors"));
    ASSERT_TRUE(!flag(r, "prefix_cache"));
    ASSERT_EQ(0.0, num(r, "prefix_hit_tokens"));
    ASSERT_TRUE(num(r, "requests_done") > 0);
    cJSON_Delete(j);
}

TEST(bad_command_lines_are_refused) {
    if (access(BENCH_BIN, X_OK) != 0) TEST_FAIL("%s is not built", BENCH_BIN);
    ASSERT_EQ(2, run_bench((const char *[]){"--pipelines", "0", NULL}, 30));
    ASSERT_EQ(2, run_bench((const char *[]){"--seqs", "x", NULL}, 30));
    ASSERT_EQ(2, run_bench((const char *[]){"--no-such-option", NULL}, 30));
    ASSERT_EQ(2, run_bench((const char *[]){"--rate", "-1", NULL}, 30));
    char *e = bench_child_slurp(err_path);
    if (!e || !strstr(e, "--rate")) TEST_FAIL("--rate -1 refused without naming the flag: %s", e ? e : "(none)");
    free(e);
    ASSERT_EQ(2, run_bench((const char *[]){"--shared-prefix", "-1", NULL}, 30));
    e = bench_child_slurp(err_path);
    if (!e || !strstr(e, "--shared-prefix"))
        TEST_FAIL("--shared-prefix -1 refused without naming the flag: %s", e ? e : "(none)");
    free(e);
    unlink(out_path);
    unlink(err_path);
}

TEST_MAIN(latency_follows_the_step_time, sim_args_reach_sim_worker, step_ms_prices_steps_by_their_tokens,
          open_loop_keeps_its_rate,
          open_loop_counts_the_wait_for_a_slot, shared_prefix_is_found_cached, bad_command_lines_are_refused)
