/* bench/bench_net on the network-namespace bed with stories260K: a small
 * run (two link types, one host against 1 Gbit/s, one level) prints a row
 * for every type and rate with the link bytes ordered as the types' sizes
 * and the comparison table; without root it says the bed cannot be made
 * and exits 3; bad command lines are refused.  No speed is asserted: that
 * is the benchmark's business, never a test's. */
#include "tests/bench/bench_child.h"

#include <grp.h>

#define BENCH_BIN LLM_BINARY_DIR "/bench/bench_net"

static char out_path[256], err_path[256];

/* The link bytes per token of the table row of (dtype, rate), or -1. */
static double row_bytes(const char *out, const char *dtype, const char *rate) {
    char head[64];
    snprintf(head, sizeof head, "\n| %s | %s | ", dtype, rate);
    const char *p = strstr(out, head);
    if (!p) return -1;
    /* | dtype | rate | c | tok/s (..) | TTFT (..) | bytes | */
    for (int bars = 0; *p && bars < 6; p++)
        if (*p == '|') bars++;
    return *p ? strtod(p, NULL) : -1;
}

TEST(bench_net_measures_types_and_rates) {
    if (geteuid() != 0) TEST_SKIP("bench_net needs root for network namespaces");
    bench_child_begin(BENCH_BIN, "test_bench_net", out_path, err_path);
    const char *model = test_model_path("stories260K-f32.gguf");
    const char *argv[] = {BENCH_BIN, "--model", model, "--dtypes", "f32,int8", "--rates", "loopback,1gbit",
                          "--concurrency", "2", "--repeat", "1", "--prompt-tokens", "16", "--max-tokens", "16",
                          NULL};
    int rc = bench_child_run(argv, out_path, err_path, 240);
    char *out = bench_child_slurp(out_path);
    if (rc == 3 && out && strstr(out, "netbed:")) {
        free(out);
        TEST_SKIP("network namespaces cannot be made here");
    }
    if (rc != 0 || !out) bench_child_show("bench_net", out_path, err_path);
    ASSERT_EQ(0, rc);
    ASSERT_TRUE(out != NULL);
    ASSERT_TRUE(strstr(out, "bench_net 20") != NULL); /* the header: date, machine, commit */
    ASSERT_TRUE(strstr(out, "dim 64, 5 layers") != NULL);
    double f32_lo = row_bytes(out, "f32", "loopback"), f32_bed = row_bytes(out, "f32", "1gbit");
    double i8_lo = row_bytes(out, "int8", "loopback"), i8_bed = row_bytes(out, "int8", "1gbit");
    printf("  link bytes/token: f32 %.0f (one host) %.0f (1 Gbit/s), int8 %.0f %.0f\n", f32_lo, f32_bed, i8_lo,
           i8_bed);
    if (f32_lo <= 0 || f32_bed <= 0 || i8_lo <= 0 || i8_bed <= 0) bench_child_show("bench_net", out_path, err_path);
    /* a row of 64 elements is 256 bytes in f32 and 68 in int8, plus the
     * step's header and the transport's share */
    ASSERT_TRUE(f32_bed > 256 && f32_lo > 256);
    ASSERT_TRUE(i8_bed > 68 && i8_lo > 68);
    ASSERT_TRUE(i8_bed < f32_bed && i8_lo < f32_lo);
    ASSERT_TRUE(strstr(out, "Each rate against loopback") != NULL);
    ASSERT_TRUE(strstr(out, "| f32 | 2 |") != NULL && strstr(out, "| int8 | 2 |") != NULL);
    ASSERT_TRUE(strstr(out, "not measured") == NULL);
    free(out);
    bench_child_end(out_path, err_path);
}

/* As another user (or when the test itself is not root): no namespaces,
 * the reason, exit 3, nothing measured. */
TEST(bench_net_without_namespaces_says_so) {
    bench_child_begin(BENCH_BIN, "test_bench_net", out_path, err_path);
    const char *model = test_model_path("stories260K-f32.gguf");
    fflush(stdout);
    pid_t pid = fork();
    if (pid < 0) TEST_FAIL("fork: %s", strerror(errno));
    if (pid == 0) {
        int o = open(out_path, O_WRONLY | O_CREAT | O_TRUNC, 0666);
        int e = open(err_path, O_WRONLY | O_CREAT | O_TRUNC, 0666);
        if (o < 0 || e < 0) _exit(127);
        dup2(o, 1);
        dup2(e, 2);
        if (geteuid() == 0 && (setgroups(0, NULL) != 0 || setgid(65534) != 0 || setuid(65534) != 0)) _exit(126);
        alarm(60);
        execl(BENCH_BIN, BENCH_BIN, "--model", model, "--dtypes", "f32", "--rates", "1gbit", "--concurrency", "1",
              "--repeat", "1", "--prompt-tokens", "16", "--max-tokens", "16", (char *)NULL);
        _exit(127);
    }
    int st;
    waitpid(pid, &st, 0);
    int rc = WIFEXITED(st) ? WEXITSTATUS(st) : -1;
    if (rc != 3) bench_child_show("bench_net", out_path, err_path);
    ASSERT_EQ(3, rc);
    char *out = bench_child_slurp(out_path), *err = bench_child_slurp(err_path);
    ASSERT_TRUE(out && strstr(out, "netbed: needs root") != NULL);
    ASSERT_TRUE(err && strstr(err, "cannot be made") != NULL && strstr(err, "nothing was measured") != NULL);
    ASSERT_TRUE(strstr(out, "gen tok/s") == NULL);
    free(out);
    free(err);
    bench_child_end(out_path, err_path);
}

TEST(bench_net_bad_command_lines_are_refused) {
    bench_child_begin(BENCH_BIN, "test_bench_net", out_path, err_path);
    const char *bad[][3] = {
        {"--dtypes", "f64"},   {"--dtypes", ""},          {"--rates", "3parsec"},
        {"--rates", "0gbit"},  {"--concurrency", "0"},    {"--concurrency", "4,x"},
        {"--stages", "7"},     {"--repeat", "99"},
    };
    for (size_t i = 0; i < sizeof bad / sizeof bad[0]; i++) {
        const char *argv[] = {BENCH_BIN, bad[i][0], bad[i][1], NULL};
        int rc = bench_child_run(argv, out_path, err_path, 20);
        if (rc != 2) bench_child_show("bench_net", out_path, err_path);
        ASSERT_EQ(2, rc);
        char *e = bench_child_slurp(err_path);
        ASSERT_TRUE(e && strstr(e, bad[i][0]) != NULL); /* the message names the flag */
        free(e);
    }
    bench_child_end(out_path, err_path);
}

TEST_MAIN(bench_net_bad_command_lines_are_refused, bench_net_without_namespaces_says_so,
          bench_net_measures_types_and_rates)
