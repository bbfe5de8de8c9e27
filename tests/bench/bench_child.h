/* Running a benchmark program from a test (tests/bench/test_bench_*.c):
 * as a child with its output in files, bounded in time, and reading those
 * files back. */
#ifndef TESTS_BENCH_BENCH_CHILD_H
#define TESTS_BENCH_BENCH_CHILD_H

#include "tests/test.h"

#include <errno.h>
#include <fcntl.h>
#include <signal.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/prctl.h>
#include <sys/wait.h>
#include <time.h>
#include <unistd.h>

/* Runs argv (argv[0] the program, NULL-terminated) with stdout and stderr
 * into out_path and err_path; returns its exit status, or -1 when it ran
 * past limit_s (it then gets SIGTERM, on which the benchmarks stop the
 * processes they started). */
static int bench_child_run(const char *const *argv, const char *out_path, const char *err_path, int limit_s) {
    fflush(stdout);
    pid_t parent = getpid();
    pid_t pid = fork();
    if (pid < 0) TEST_FAIL("fork: %s", strerror(errno));
    if (pid == 0) {
        prctl(PR_SET_PDEATHSIG, SIGTERM);
        if (getppid() != parent) _exit(127);
        int o = open(out_path, O_WRONLY | O_CREAT | O_TRUNC, 0644), e = open(err_path, O_WRONLY | O_CREAT | O_TRUNC, 0644);
        if (o < 0 || e < 0) _exit(127);
        dup2(o, 1);
        dup2(e, 2);
        execv(argv[0], (char *const *)argv);
        _exit(127);
    }
    for (int i = 0; i < limit_s * 20; i++) {
        int st;
        if (waitpid(pid, &st, WNOHANG) == pid) return WIFEXITED(st) ? WEXITSTATUS(st) : -1;
        struct timespec ts = {0, 50000000L};
        nanosleep(&ts, NULL);
    }
    kill(pid, SIGTERM);
    int st;
    waitpid(pid, &st, 0);
    return -1;
}

/* The file's first 128 KiB as a new string; NULL when it cannot be read. */
static char *bench_child_slurp(const char *path) {
    FILE *f = fopen(path, "r");
    if (!f) return NULL;
    static char buf[1 << 17];
    size_t n = fread(buf, 1, sizeof buf - 1, f);
    fclose(f);
    buf[n] = 0;
    char *copy = malloc(n + 1);
    if (copy) memcpy(copy, buf, n + 1);
    return copy;
}

/* A test's start: the benchmark bin must be built, and its child's stdout
 * and stderr go to /tmp/NAME.PID.out and .err (out and err of 256 bytes
 * each), which bench_child_end removes. */
static inline void bench_child_begin(const char *bin, const char *name, char *out, char *err) {
    if (access(bin, X_OK) != 0) TEST_FAIL("%s is not built", bin);
    snprintf(out, 256, "/tmp/%s.%d.out", name, (int)getpid());
    snprintf(err, 256, "/tmp/%s.%d.err", name, (int)getpid());
}
static inline void bench_child_end(const char *out, const char *err) {
    unlink(out);
    unlink(err);
}

/* Prints what the child prog wrote to out and err. */
static inline void bench_child_show(const char *prog, const char *out, const char *err) {
    char *o = bench_child_slurp(out), *e = bench_child_slurp(err);
    printf("  ---- %s stdout:\n%s\n  ---- stderr:\n%s\n", prog, o ? o : "", e ? e : "");
    free(o);
    free(e);
}

#endif
