/* The Python client (clients/python, package llmcluster) against a real
 * cluster: Redis, llm-router (one sequence at a time, so that a queued
 * request can be cancelled for certain) and one CPU worker serving
 * stories260K.  The package's build step generates its protobuf modules
 * from the proto files into the test's temporary folder, then
 * clients/python/tests/test_client.py checks streams against llm-run
 * (sync and asyncio), cancel, re-attach, errors, health, status and models,
 * and the CURVE keys (from the environment, files and values; a refused key).
 * Skipped without a python3 that has zmq and google.protobuf (Debian
 * python3-zmq, python3-protobuf), protoc (protobuf-compiler), redis-server
 * or the model. */
#include "tests/router/cluster_harness.h"

#define PY_PKG LLM_SOURCE_DIR "/clients/python"
#define PY_TEST PY_PKG "/tests/test_client.py"

static const char *model_path(void) { return LLM_SOURCE_DIR "/../shared/models/stories260K-f32.gguf"; }

/* Runs argv with the environment as set, output to this test's stdout;
 * returns the exit status (-1: it did not exit normally). */
static int run(const char *const *argv, int timeout_s) {
    fflush(stdout);
    pid_t pid = fork();
    if (pid < 0) TEST_FAIL("fork: %s", strerror(errno));
    if (pid == 0) {
        int null = open("/dev/null", O_RDONLY);
        if (null >= 0) dup2(null, 0);
        alarm((unsigned)timeout_s);
        execvp(argv[0], (char *const *)argv);
        _exit(127);
    }
    int st;
    while (waitpid(pid, &st, 0) < 0 && errno == EINTR) {}
    return WIFEXITED(st) ? WEXITSTATUS(st) : -1;
}

/* Quietly: 0 when the command exits 0. */
static int run_quiet(const char *cmd) {
    char buf[1024];
    snprintf(buf, sizeof buf, "%s >/dev/null 2>&1", cmd);
    return system(buf);
}

/* The first python3 with the packages the client needs: $LLM_PYTHON, then
 * Debian's (the python3-zmq and python3-protobuf packages install for it,
 * and a python3 earlier on PATH, such as pyenv's, may not see them), then
 * python3 from PATH. */
static const char *find_python(void) {
    static const char *cands[3];
    cands[0] = getenv("LLM_PYTHON");
    cands[1] = "/usr/bin/python3";
    cands[2] = "python3";
    for (int i = 0; i < 3; i++) {
        if (!cands[i] || !cands[i][0]) continue;
        char cmd[512];
        snprintf(cmd, sizeof cmd, "'%s' -c 'import zmq, zmq.asyncio, google.protobuf'", cands[i]);
        if (run_quiet(cmd) == 0) return cands[i];
    }
    return NULL;
}

TEST(python_client) {
    const char *py = find_python();
    if (!py) TEST_SKIP("no python3 with zmq and google.protobuf (Debian: python3-zmq python3-protobuf)");
    if (run_quiet("protoc --version") != 0) TEST_SKIP("protoc is not installed (Debian: protobuf-compiler)");
    if (access(model_path(), R_OK) != 0) TEST_SKIP("%s is missing", model_path());
    if (access(H_RUN, X_OK) != 0) TEST_FAIL("%s is not built", H_RUN);
    /* With CURVE keys: the harness exports LLM_CURVE_KEY_FILE and
     * LLM_ROUTER_KEY (an admitted client), which the client reads. */
    struct cluster *cl = h_cluster_start(model_path(), 1, 1, "--max-batch 1", "");

    char proto_dir[320];
    snprintf(proto_dir, sizeof proto_dir, "%s/llmcluster-proto", cl->dir);
    setenv("PYTHONPATH", PY_PKG, 1);
    setenv("PYTHONDONTWRITEBYTECODE", "1", 1); /* nothing written into the source tree */
    const char *build[] = {py, "-m", "llmcluster.build", "--out", proto_dir, NULL};
    int rc = run(build, 60);
    H_ASSERT(cl, rc == 0, "%s -m llmcluster.build --out %s: exit %d", py, proto_dir, rc);

    setenv("LLMCLUSTER_PROTO_DIR", proto_dir, 1);
    setenv("LLM_ROUTER", cl->client_ep, 1);
    setenv("LLM_TEST_MODEL", model_path(), 1);
    setenv("LLM_RUN", H_RUN, 1);
    const char *test[] = {py, PY_TEST, NULL};
    rc = run(test, 120);
    H_ASSERT(cl, rc == 0, "%s %s: exit %d (its report is above)", py, PY_TEST, rc);
    h_cluster_stop(cl);
}

TEST_MAIN(python_client)
