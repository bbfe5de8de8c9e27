/* The `llm` command as a user meets it: with no router it says so within
 * seconds and how to start one; global flags work after the subcommand;
 * --retry-ms bounds `llm generate` against a router that cannot serve (no
 * pipeline), which answers why. */
#include "router/server.h"

#include <errno.h>
#include <fcntl.h>
#include <pthread.h>
#include <signal.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/wait.h>
#include <time.h>
#include <unistd.h>

#include "common/log.h"
#include "common/zio.h"
#include "tests/redis_fixture.h"
#include "tests/test.h"

#define LLM_BIN LLM_BINARY_DIR "/router/llm"

static int64_t t_ms(void) {
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (int64_t)ts.tv_sec * 1000 + ts.tv_nsec / 1000000;
}

/* Runs argv (killed after 20 s); its stderr goes to err (NUL-terminated).
 * Returns the exit status, or -1 when it did not exit by itself. */
static int run_llm(const char *const *argv, char *err, size_t errlen) {
    if (access(LLM_BIN, X_OK) != 0) TEST_FAIL("%s is not built", LLM_BIN);
    char epath[] = "/tmp/llm-cli-errXXXXXX";
    int efd = mkstemp(epath);
    if (efd < 0) TEST_FAIL("mkstemp: %s", strerror(errno));
    unlink(epath);
    pid_t pid = fork();
    if (pid == 0) {
        dup2(efd, 2);
        int devnull = open("/dev/null", O_WRONLY);
        if (devnull >= 0) dup2(devnull, 1);
        unsetenv("LLM_ROUTER");
        setenv("LLM_INSECURE", "true", 1); /* the test's router is a plain socket */
        alarm(20);
        execv(argv[0], (char *const *)argv);
        _exit(127);
    }
    int st;
    waitpid(pid, &st, 0);
    lseek(efd, 0, SEEK_SET);
    ssize_t n = read(efd, err, errlen - 1);
    err[n > 0 ? n : 0] = 0;
    close(efd);
    return WIFEXITED(st) ? WEXITSTATUS(st) : -1;
}

static void free_endpoint(char *ep, size_t n) {
    char err[128];
    int port;
    if (zio_free_port(NULL, &port, err, sizeof err) < 0) TEST_FAIL("%s", err);
    snprintf(ep, n, "tcp://127.0.0.1:%d", port);
}

TEST(llm_cli_says_no_router_fast) {
    char ep[64], err[4096];
    free_endpoint(ep, sizeof ep);
    /* --router after the subcommand: a global flag works there too. */
    const char *argv[] = {LLM_BIN, "health", "--router", ep, NULL};
    int64_t t0 = t_ms();
    int rc = run_llm(argv, err, sizeof err);
    int64_t took = t_ms() - t0;
    ASSERT_EQ(1, rc);
    ASSERT_TRUE(took < 5000);
    ASSERT_TRUE(strstr(err, ep) != NULL);
    ASSERT_TRUE(strstr(err, "llm-cluster up") != NULL);
    ASSERT_TRUE(strstr(err, "LLM_ROUTER") != NULL);
}

TEST(llm_cli_global_flags_after_the_subcommand) {
    char a[64], b[64], err[4096];
    free_endpoint(a, sizeof a);
    free_endpoint(b, sizeof b);
    /* The later flag wins, wherever it stands. */
    const char *argv[] = {LLM_BIN, "--router", a, "generate", "--prompt", "hi", "--router", b,
                          "--connect-timeout-ms", "300", NULL};
    int64_t t0 = t_ms();
    ASSERT_EQ(1, run_llm(argv, err, sizeof err));
    ASSERT_TRUE(t_ms() - t0 < 3000);
    ASSERT_TRUE(strstr(err, b) != NULL);
    ASSERT_TRUE(strstr(err, a) == NULL);
    /* A bad global value after the subcommand is named. */
    const char *bad[] = {LLM_BIN, "status", "--log-level", "loud", NULL};
    ASSERT_EQ(2, run_llm(bad, err, sizeof err));
    ASSERT_TRUE(strstr(err, "loud") != NULL);
}

struct fx {
    struct redis_fixture r;
    server *s;
    pthread_t th;
    volatile sig_atomic_t stop;
};

static void *fx_thread(void *arg) {
    struct fx *f = arg;
    server_run(f->s, &f->stop);
    return NULL;
}

TEST(llm_cli_retry_bounds_generate) {
    struct fx f;
    memset(&f, 0, sizeof f);
    log_set_level(LL_ERROR);
    const char *model = test_model_path("stories260K-f32.gguf"); /* skips before Redis starts */
    fixture_redis_start(&f.r, 0);
    struct server_config c = {0};
    c.model_path = model;
    c.listen = "tcp://127.0.0.1:*";
    c.worker_listen = "tcp://127.0.0.1:*";
    c.redis_url = f.r.url;
    c.redis_prefix = "llm:";
    c.router_id = "r";
    c.max_queue = 100;
    c.step_tokens = 64;
    c.max_batch = 8;
    c.heartbeat_ms = 100;
    c.worker_timeout_ms = 2000;
    c.stages = 1;
    c.insecure = true;
    char err[4096];
    if (server_init(&f.s, &c, err, sizeof err) < 0) TEST_FAIL("server_init: %s", err);
    char ep[128];
    snprintf(ep, sizeof ep, "%s", server_client_endpoint(f.s));
    pthread_create(&f.th, NULL, fx_thread, &f);
    /* No worker: the router answers UNAVAILABLE; llm retries, and gives up
     * when --retry-ms says, with the router's reason. */
    const char *argv[] = {LLM_BIN, "generate", "--router", ep, "--retry-ms", "1500", "--prompt", "hi",
                          "--max-tokens", "8", NULL};
    int64_t t0 = t_ms();
    int rc = run_llm(argv, err, sizeof err);
    int64_t took = t_ms() - t0;
    f.stop = 1;
    pthread_join(f.th, NULL);
    server_free(f.s);
    ASSERT_OK(fixture_redis_stop(&f.r));
    ASSERT_EQ(1, rc);
    ASSERT_TRUE(took >= 900 && took < 4000);
    ASSERT_TRUE(strstr(err, "UNAVAILABLE") != NULL);
    ASSERT_TRUE(strstr(err, "no pipeline is in service") != NULL);
}

TEST_MAIN(llm_cli_says_no_router_fast, llm_cli_global_flags_after_the_subcommand, llm_cli_retry_bounds_generate)
