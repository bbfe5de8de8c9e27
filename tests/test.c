/* Runner and helpers for tests/test.h. */
#include "test.h"

#include <stdarg.h>
#include <sys/stat.h>
#include <time.h>

jmp_buf test_jmp;
/* Why the last test was skipped, repeated in the summary line. */
static char test_skip_reason[256];

void test_fail_at(const char *file, int line, const char *fmt, ...) {
    va_list ap;
    va_start(ap, fmt);
    fprintf(stdout, "  %s:%d: ", file, line);
    vfprintf(stdout, fmt, ap);
    fprintf(stdout, "\n");
    va_end(ap);
    fflush(stdout);
    longjmp(test_jmp, 1);
}

void test_skip(const char *fmt, ...) {
    va_list ap;
    va_start(ap, fmt);
    vsnprintf(test_skip_reason, sizeof test_skip_reason, fmt, ap);
    va_end(ap);
    printf("  skipped: %s\n", test_skip_reason);
    fflush(stdout);
    longjmp(test_jmp, 2);
}

char *test_read_file(const char *path, size_t *len) {
    FILE *fp = fopen(path, "rb");
    if (!fp) return NULL;
    long n = fseek(fp, 0, SEEK_END) == 0 ? ftell(fp) : -1;
    char *buf = n >= 0 && fseek(fp, 0, SEEK_SET) == 0 ? malloc((size_t)n + 1) : NULL;
    if (buf && fread(buf, 1, (size_t)n, fp) != (size_t)n) {
        free(buf);
        buf = NULL;
    }
    fclose(fp);
    if (!buf) return NULL;
    buf[n] = 0;
    if (len) *len = (size_t)n;
    return buf;
}

const char *test_models_dir(void) {
    static char dir[1024];
    struct stat st;
    const char *env = getenv("LLM_MODELS_DIR");
    snprintf(dir, sizeof dir, "%s", env && *env ? env : LLM_SOURCE_DIR "/../shared/models");
    return stat(dir, &st) == 0 && S_ISDIR(st.st_mode) ? dir : NULL;
}

const char *test_model_path(const char *name) {
    static char path[2048];
    const char *dir = test_models_dir();
    if (!dir) TEST_SKIP("test models folder ../shared/models is missing (set LLM_MODELS_DIR)");
    snprintf(path, sizeof path, "%s/%s", dir, name);
    return path;
}

/* 0 passed, 1 failed, 2 skipped; its own frame so longjmp clobbers nothing. */
static int test_run_one(test_fn fn) {
    int r = setjmp(test_jmp);
    if (r == 0) fn();
    return r;
}

int test_run_all(const struct test_case *cases, int n, int argc, char **argv) {
    int failed = 0, ran = 0, skipped = 0;
    for (int i = 0; i < n; i++) {
        int wanted = argc <= 1;
        for (int a = 1; a < argc; a++) wanted |= strcmp(argv[a], cases[i].name) == 0;
        if (!wanted) continue;
        struct timespec t0, t1;
        clock_gettime(CLOCK_MONOTONIC, &t0);
        printf("[ RUN  ] %s\n", cases[i].name);
        fflush(stdout);
        int r = test_run_one(cases[i].fn);
        clock_gettime(CLOCK_MONOTONIC, &t1);
        double ms = (t1.tv_sec - t0.tv_sec) * 1e3 + (t1.tv_nsec - t0.tv_nsec) / 1e6;
        ran++;
        if (r == 1) {
            failed++;
            printf("[ FAIL ] %s (%.0f ms)\n", cases[i].name, ms);
        } else if (r == 2) {
            skipped++;
            printf("[ SKIP ] %s\n", cases[i].name);
        } else {
            printf("[  OK  ] %s (%.0f ms)\n", cases[i].name, ms);
        }
        fflush(stdout);
    }
    printf("%d tests: %d passed, %d failed, %d skipped\n", ran, ran - failed - skipped, failed, skipped);
    if (failed) return 1;
    if (ran > 0 && skipped == ran) {
        printf("all %d tests skipped (last reason: %s)\n", ran, test_skip_reason);
        return TEST_EXIT_SKIPPED;
    }
    return 0;
}
