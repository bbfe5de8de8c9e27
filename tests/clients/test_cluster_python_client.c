/* The Python client (clients/python, package llmcluster) against a real
 * cluster: Redis, llm-router (one sequence at a time, so that a queued
 * request can be cancelled for certain) and one CPU worker serving
 * stories260K.  The package's build step generates its protobuf modules
 * from the proto files into the test's temporary folder, then
 * clients/python/tests/test_client.py checks streams against llm-run
 * (sync and asyncio), cancel, re-attach, n > 1, the JSON Schema, json_object
 * and GBNF constraints, errors, health, status and models,
 * and the CURVE keys (from the environment, files and values; a refused key).
 * Skipped without a python3 that has zmq and google.protobuf (Debian
 * python3-zmq, python3-protobuf), protoc (protobuf-compiler), redis-server
 * or the model.  Also: the package installs with pip (pyproject.toml), its
 * dependencies declared, into a fresh virtual environment; and on a second
 * cluster serving pycode, tests/test_prediction.py checks speculation's
 * arguments and predicted outputs' usage. */
#include "tests/router/cluster_harness.h"

#define PY_PKG LLM_SOURCE_DIR "/clients/python"
#define PY_TEST PY_PKG "/tests/test_client.py"
#define PY_TEST_PRED PY_PKG "/tests/test_prediction.py"

static const char *model_path(void) { return LLM_SOURCE_DIR "/../shared/models/stories260K-f32.gguf"; }
static const char *pycode_path(void) { return LLM_SOURCE_DIR "/../shared/models/pycode/pycode-target-f16.gguf"; }

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

/* Speculation through the package (clients/python/tests/test_prediction.py)
 * on pycode, whose code a prediction can meaningfully repeat: a 1x1
 * cluster whose router speculates only when asked (--spec off, k = 4), as
 * test_cluster_spec_pred's.  A right prediction (text or ids) gives the
 * output of the request without it with drafts accepted, a wrong one the
 * same output with drafts rejected (GenerateDone.Usage), n = 2 counts per
 * choice, sync and asyncio; bad spec, spec_tokens, prediction and
 * prediction_tokens are refused naming the argument. */
TEST(python_client_prediction) {
    const char *py = find_python();
    if (!py) TEST_SKIP("no python3 with zmq and google.protobuf (Debian: python3-zmq python3-protobuf)");
    if (run_quiet("protoc --version") != 0) TEST_SKIP("protoc is not installed (Debian: protobuf-compiler)");
    if (access(pycode_path(), R_OK) != 0) TEST_SKIP("%s is missing", pycode_path());
    if (access(H_RUN, X_OK) != 0) TEST_FAIL("%s is not built", H_RUN);
    struct cluster *cl = h_cluster_start(pycode_path(), 1, 1, "--spec off --spec-tokens 4", "");

    char proto_dir[320];
    snprintf(proto_dir, sizeof proto_dir, "%s/llmcluster-proto", cl->dir);
    setenv("PYTHONPATH", PY_PKG, 1);
    setenv("PYTHONDONTWRITEBYTECODE", "1", 1);
    const char *build[] = {py, "-m", "llmcluster.build", "--out", proto_dir, NULL};
    int rc = run(build, 60);
    H_ASSERT(cl, rc == 0, "%s -m llmcluster.build --out %s: exit %d", py, proto_dir, rc);

    setenv("LLMCLUSTER_PROTO_DIR", proto_dir, 1);
    setenv("LLM_ROUTER", cl->client_ep, 1);
    setenv("LLM_TEST_MODEL", pycode_path(), 1);
    setenv("LLM_RUN", H_RUN, 1);
    const char *test[] = {py, PY_TEST_PRED, NULL};
    rc = run(test, 240);
    H_ASSERT(cl, rc == 0, "%s %s: exit %d (its report is above)", py, PY_TEST_PRED, rc);
    h_cluster_stop(cl);
}

/* The first python3 that can make a virtual environment and install into
 * it offline (pip, setuptools and wheel; no PyPI here), or NULL. */
static const char *find_pip_python(void) {
    static const char *cands[3];
    cands[0] = getenv("LLM_PYTHON");
    cands[1] = "/usr/bin/python3";
    cands[2] = "python3";
    for (int i = 0; i < 3; i++) {
        if (!cands[i] || !cands[i][0]) continue;
        char cmd[512];
        /* setuptools first: Debian's distutils shim fails when venv comes before it. */
        snprintf(cmd, sizeof cmd, "'%s' -c 'import setuptools, wheel, pip, venv'", cands[i]);
        if (run_quiet(cmd) == 0) return cands[i];
    }
    return NULL;
}

/* clients/python is a package pip installs, for any python3 and not only
 * Debian's: `pip install -e clients/python` (here from a copy, into a
 * fresh virtual environment, without the network: --no-deps) installs
 * llmcluster with pyzmq and protobuf declared as its dependencies, its
 * build step runs from the installed package, and with those two present
 * (Debian's, through --system-site-packages) the client imports from
 * anywhere without PYTHONPATH. */
TEST(python_client_installs_with_pip) {
    const char *py = find_pip_python();
    if (!py) TEST_SKIP("no python3 with venv, pip, setuptools and wheel (Debian: python3-pip python3-wheel)");
    char dir[] = "/tmp/llm-pyinstall-XXXXXX";
    if (!mkdtemp(dir)) TEST_FAIL("mkdtemp: %s", strerror(errno));
    unsetenv("PYTHONPATH");
    unsetenv("LLMCLUSTER_PROTO_DIR");
    setenv("PYTHONDONTWRITEBYTECODE", "1", 1);
    setenv("PIP_DISABLE_PIP_VERSION_CHECK", "1", 1);
    /* The copy sits as in the repository, beside a proto/, so that the
     * editable package's build step finds the protocol files. */
    char script[4096];
    snprintf(script, sizeof script,
             "set -e; cd '%s'; mkdir clients; cp -r '%s' clients/python; rm -rf clients/python/llmcluster/_generated; "
             "ln -s '%s/proto' proto; '%s' -m venv --without-pip --system-site-packages venv; "
             "venv/bin/python -m pip install -q --no-deps --no-build-isolation --no-index -e clients/python; "
             "cd /; '%s/venv/bin/python' -c \""
             "import importlib.metadata as m; r = m.requires('llmcluster') or []; print('  requires:', r); "
             "assert any(x.startswith('pyzmq') for x in r) and any(x.startswith('protobuf') for x in r), r\"",
             dir, PY_PKG, LLM_SOURCE_DIR, py, dir);
    const char *install[] = {"/bin/sh", "-c", script, NULL};
    int rc = run(install, 180);
    if (rc != 0) {
        char cmd[600];
        snprintf(cmd, sizeof cmd, "rm -rf '%s'", dir);
        if (system(cmd) != 0) printf("  %s failed\n", cmd);
        TEST_FAIL("pip install -e clients/python (from a copy in %s): exit %d (its report is above)", dir, rc);
    }
    if (run_quiet("protoc --version") == 0) {
        snprintf(script, sizeof script,
                 "set -e; cd /; '%s/venv/bin/python' -m llmcluster.build; "
                 "if '%s/venv/bin/python' -c 'import zmq, google.protobuf' 2>/dev/null; then "
                 "'%s/venv/bin/python' -c \"import llmcluster; print('  imports', llmcluster.Client, 'from', "
                 "llmcluster.__file__)\"; else echo '  (no zmq or protobuf for %s: the import is not tried)'; fi",
                 dir, dir, dir, py);
        const char *use[] = {"/bin/sh", "-c", script, NULL};
        rc = run(use, 120);
    } else {
        printf("  protoc is not installed: the build step is not tried\n");
    }
    char cmd[600];
    snprintf(cmd, sizeof cmd, "rm -rf '%s'", dir);
    if (system(cmd) != 0) printf("  %s failed\n", cmd);
    ASSERT_EQ(0, rc);
}

TEST_MAIN(python_client_installs_with_pip, python_client, python_client_prediction)
