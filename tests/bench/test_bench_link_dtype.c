/* bench/bench_link_dtype on the CPU with stories260K: a short run
 * (--max-tokens 256) prints a row per link type in which the F32 link
 * agrees with itself everywhere and F16 puts about half F32's bytes a token
 * on the wire; bad command lines are refused.  What the other types cost in
 * agreement is the benchmark's to measure, not the test's to assert. */
#include "tests/bench/bench_child.h"

#define BENCH_BIN LLM_BINARY_DIR "/bench/bench_link_dtype"
#define EVAL_TEXT LLM_SOURCE_DIR "/bench/data/stories-eval.txt"

static char out_path[256], err_path[256];

/* The row of dtype: "| f32 | 256 / 256 (100.00%) | 3.8378 | +0.000% | 256.2 |".
 * Fills the agreeing and total positions and the bytes per token; 0 when
 * the row is there and reads whole. */
static int row_read(const char *out, const char *dtype, long *same, long *positions, double *bytes) {
    char head[64];
    snprintf(head, sizeof head, "\n| %s | ", dtype);
    const char *p = strstr(out, head);
    if (!p) return -1;
    p += strlen(head);
    if (sscanf(p, "%ld / %ld", same, positions) != 2) return -1;
    /* past "agreement | perplexity | change |" to the bytes column */
    for (int bars = 0; *p && bars < 3; p++)
        if (*p == '|') bars++;
    if (!*p) return -1;
    char *end;
    *bytes = strtod(p, &end);
    return end == p ? -1 : 0;
}

TEST(bench_link_dtype_f32_agrees_and_f16_halves_the_bytes) {
    bench_child_begin(BENCH_BIN, "test_bench_link_dtype", out_path, err_path);
    const char *model = test_model_path("stories260K-f32.gguf");
    if (access(model, R_OK) != 0) TEST_SKIP("%s is missing", model);
    const char *argv[] = {BENCH_BIN, "--model", model, "--text", EVAL_TEXT, "--max-tokens", "256", "--types",
                          "f32,f16", "--threads", "2", "--device", "cpu", NULL};
    int rc = bench_child_run(argv, out_path, err_path, 60);
    char *out = bench_child_slurp(out_path);
    if (rc != 0 || !out) bench_child_show("bench_link_dtype", out_path, err_path);
    ASSERT_EQ(0, rc);
    ASSERT_TRUE(out != NULL);
    ASSERT_TRUE(strstr(out, "256 tokens") != NULL); /* --max-tokens: two whole windows of 128 */
    ASSERT_TRUE(strstr(out, "; on cpu\n") != NULL);
    long same = 0, positions = 0, same16 = 0, positions16 = 0;
    double bytes32 = 0, bytes16 = 0;
    if (row_read(out, "f32", &same, &positions, &bytes32) != 0 ||
        row_read(out, "f16", &same16, &positions16, &bytes16) != 0)
        bench_child_show("bench_link_dtype", out_path, err_path);
    ASSERT_EQ(0, row_read(out, "f32", &same, &positions, &bytes32));
    ASSERT_EQ(0, row_read(out, "f16", &same16, &positions16, &bytes16));
    ASSERT_EQ(256L, positions);
    ASSERT_EQ(positions, same); /* the reference against itself */
    ASSERT_EQ(positions, positions16);
    /* dim 64: 256 bytes a row in F32, 128 in F16, plus the step header's share */
    ASSERT_TRUE(bytes32 > 256.0 && bytes32 < 258.0);
    ASSERT_TRUE(bytes16 > 0.45 * bytes32 && bytes16 < 0.55 * bytes32);
    ASSERT_TRUE(strstr(out, "\n| bf16 |") == NULL); /* only the types asked for */
    free(out);
    bench_child_end(out_path, err_path);
}

TEST(bench_link_dtype_refuses_bad_command_lines) {
    bench_child_begin(BENCH_BIN, "test_bench_link_dtype", out_path, err_path);
    const char *model = "/nonexistent.gguf";
    const char *bad[][12] = {
        {BENCH_BIN, "--text", EVAL_TEXT, NULL},                                     /* no model */
        {BENCH_BIN, "--model", model, NULL},                                        /* nothing to evaluate */
        {BENCH_BIN, "--model", model, "--text", EVAL_TEXT, "--device", "tpu", NULL}, /* no such device */
        {BENCH_BIN, "--model", model, "--text", EVAL_TEXT, "--types", "f16,f32", NULL}, /* f32 not first */
        {BENCH_BIN, "--model", model, "--text", EVAL_TEXT, "--types", "f32,fp8", NULL}, /* no such type */
    };
    for (size_t i = 0; i < sizeof bad / sizeof bad[0]; i++) {
        int rc = bench_child_run(bad[i], out_path, err_path, 20);
        char *err = bench_child_slurp(err_path);
        if (rc != 2) bench_child_show("bench_link_dtype", out_path, err_path);
        ASSERT_EQ(2, rc);
        ASSERT_TRUE(err != NULL && strstr(err, "bench_link_dtype: ") != NULL);
        free(err);
    }
    bench_child_end(out_path, err_path);
}

TEST_MAIN(bench_link_dtype_f32_agrees_and_f16_halves_the_bytes, bench_link_dtype_refuses_bad_command_lines)
