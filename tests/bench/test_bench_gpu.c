/* bench/bench_gpu on the CPU with the tiny shape: --model-cache keeps the
 * synthetic model it writes and the next run reuses it (the same rows, no
 * second write, no partial file left behind), and a --model-cache that
 * cannot be a folder is refused, naming the flag and the value.  Speed is
 * the benchmark's to measure, not the test's. */
#include "tests/bench/bench_child.h"

#include <dirent.h>
#include <sys/stat.h>

#define BENCH_BIN LLM_BINARY_DIR "/bench/bench_gpu"

static char out_path[256], err_path[256];

/* One short CPU run of the tiny Q8_0 model with --model-cache cache;
 * returns its exit status, its stderr in *err_out (to free). */
static int run_tiny(const char *cache, char **err_out) {
    const char *argv[] = {BENCH_BIN, "--device", "cpu", "--shapes", "tiny", "--types", "q8_0", "--batches", "1",
                          "--steps", "1", "--warmup", "0", "--prompt", "8", "--prefill-reps", "1", "--copy-size",
                          "1M", "--gemm-size", "64", "--gemm-tokens", "8", "--threads", "2", "--capacity-budget",
                          "0", "--model-cache", cache, NULL};
    int rc = bench_child_run(argv, out_path, err_path, 120);
    *err_out = bench_child_slurp(err_path);
    return rc;
}

/* Files in dir whose name ends in suffix. */
static int count_suffix(const char *dir, const char *suffix) {
    DIR *d = opendir(dir);
    if (!d) return -1;
    int n = 0;
    struct dirent *e;
    while ((e = readdir(d))) {
        size_t l = strlen(e->d_name), s = strlen(suffix);
        if (l >= s && strcmp(e->d_name + l - s, suffix) == 0) n++;
    }
    closedir(d);
    return n;
}

/* A run with --model-cache cache that exits 0 with `want` in its stderr
 * and not `unwanted`, and prints a decode row. */
static void run_expect(const char *cache, const char *want, const char *unwanted) {
    char *e = NULL;
    int rc = run_tiny(cache, &e);
    if (rc != 0 || !e) bench_child_show("bench_gpu", out_path, err_path);
    ASSERT_EQ(0, rc);
    ASSERT_TRUE(e != NULL);
    if (!strstr(e, want)) TEST_FAIL("no \"%s\" in:\n%s", want, e);
    if (strstr(e, unwanted)) TEST_FAIL("\"%s\" in:\n%s", unwanted, e);
    char *o = bench_child_slurp(out_path);
    ASSERT_TRUE(o != NULL && strstr(o, "decode") != NULL);
    free(e);
    free(o);
}

TEST(bench_gpu_model_cache_writes_once) {
    bench_child_begin(BENCH_BIN, "test_bench_gpu", out_path, err_path);
    char base[] = "/tmp/test_bench_gpu.XXXXXX";
    ASSERT_TRUE(mkdtemp(base) != NULL);
    char cache[300], model[400], wrote[500], reused[500];
    snprintf(cache, sizeof cache, "%s/cache", base); /* made by the first run */
    snprintf(model, sizeof model, "%s/tiny-q8_0.gguf", cache);
    snprintf(wrote, sizeof wrote, "bench_gpu: wrote %s", model);
    snprintf(reused, sizeof reused, "bench_gpu: reused %s", model);

    struct stat st1, st2;
    run_expect(cache, wrote, "bench_gpu: reused");
    ASSERT_EQ(0, stat(model, &st1));
    ASSERT_TRUE(st1.st_size > 0);
    run_expect(cache, reused, "bench_gpu: wrote");
    ASSERT_EQ(0, stat(model, &st2));
    ASSERT_EQ(st1.st_size, st2.st_size);
    ASSERT_EQ(st1.st_mtime, st2.st_mtime); /* not written again */
    ASSERT_EQ(0, count_suffix(cache, ".part"));
    ASSERT_EQ(1, count_suffix(cache, ".gguf"));

    unlink(model);
    rmdir(cache);
    rmdir(base);
    bench_child_end(out_path, err_path);
}

TEST(bench_gpu_model_cache_not_a_folder) {
    bench_child_begin(BENCH_BIN, "test_bench_gpu", out_path, err_path);
    char file[] = "/tmp/test_bench_gpu_file.XXXXXX";
    int fd = mkstemp(file);
    ASSERT_TRUE(fd >= 0);
    close(fd);
    char under[300];
    snprintf(under, sizeof under, "%s/cache", file); /* a folder under a plain file */
    const char *cases[2] = {file, under};
    for (int i = 0; i < 2; i++) {
        char *e = NULL;
        int rc = run_tiny(cases[i], &e);
        if (rc != 2 || !e) bench_child_show("bench_gpu", out_path, err_path);
        ASSERT_EQ(2, rc);
        ASSERT_TRUE(e != NULL);
        char want[400];
        snprintf(want, sizeof want, "--model-cache %s:", cases[i]);
        if (!strstr(e, want)) TEST_FAIL("no \"%s\" in:\n%s", want, e);
        free(e);
    }
    unlink(file);
    bench_child_end(out_path, err_path);
}

TEST_MAIN(bench_gpu_model_cache_writes_once, bench_gpu_model_cache_not_a_folder)
