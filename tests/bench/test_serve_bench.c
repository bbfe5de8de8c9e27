/* Tests of bench/serve-bench.mjs, the OpenAI-API serving benchmark: each
 * test runs one scenario of tests/bench/serve_bench_check.mjs, which starts a
 * mock OpenAI-compatible SSE server with fixed delays in its own process,
 * runs the benchmark against it as a child and checks its JSON report (exact
 * counts, latencies within generous bounds).  Skipped without Node 18 or
 * newer (the built-in fetch). */
#include "tests/test.h"

#include <errno.h>
#include <sys/wait.h>
#include <unistd.h>

#define SB_CHECK LLM_SOURCE_DIR "/tests/bench/serve_bench_check.mjs"

/* Major version of `node` on PATH, 0 when there is none. */
static int node_major(void) {
    FILE *p = popen("node --version 2>/dev/null", "r");
    if (!p) return 0;
    char buf[64] = {0};
    if (!fgets(buf, sizeof buf, p)) buf[0] = 0;
    pclose(p);
    return buf[0] == 'v' ? atoi(buf + 1) : 0;
}

static void run_scenario(const char *name) {
    int major = node_major();
    if (major == 0) TEST_SKIP("node is not installed (serve-bench needs Node 18 or newer)");
    if (major < 18) TEST_SKIP("node v%d has no built-in fetch (serve-bench needs Node 18 or newer)", major);
    fflush(stdout); /* the test's lines before node's */
    pid_t pid = fork();
    if (pid < 0) TEST_FAIL("fork: %s", strerror(errno));
    if (pid == 0) {
        alarm(120);
        execlp("node", "node", SB_CHECK, name, (char *)NULL);
        _exit(127);
    }
    int st;
    while (waitpid(pid, &st, 0) < 0 && errno == EINTR) {}
    if (!WIFEXITED(st) || WEXITSTATUS(st) != 0)
        TEST_FAIL("node %s %s: status 0x%x (its output is above)", SB_CHECK, name, st);
}

TEST(sse_parser) { run_scenario("sse_parser"); }
TEST(completions_concurrency) { run_scenario("completions_concurrency"); }
TEST(chat_chunks) { run_scenario("chat_chunks"); }
TEST(batched_chunks) { run_scenario("batched_chunks"); }
TEST(poisson_and_duration) { run_scenario("poisson_and_duration"); }
TEST(errors_by_status) { run_scenario("errors_by_status"); }
TEST(api_key_and_model) { run_scenario("api_key_and_model"); }
TEST(bad_input) { run_scenario("bad_input"); }
TEST(token_prompts_and_warmup) { run_scenario("token_prompts_and_warmup"); }
TEST(workers) { run_scenario("workers"); }

TEST_MAIN(sse_parser, completions_concurrency, chat_chunks, batched_chunks, poisson_and_duration, errors_by_status,
          api_key_and_model, bad_input, token_prompts_and_warmup, workers)
