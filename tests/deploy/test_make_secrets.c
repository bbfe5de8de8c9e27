/* deploy/make-secrets.sh --kubernetes, as the walkthrough runs it: from a
 * copy of the script with no build tree beside it and no llm on PATH, so
 * that the keys come from the image (`docker run IMAGE llm keygen`, here a
 * fake docker that runs this build's llm instead), against a fake kubectl
 * that keeps the objects it is given and refuses a second create of one
 * (AlreadyExists) as a server would.  It is run twice: the second run must
 * succeed, make no new key and leave the same objects.  The break-test runs
 * the script with plain `kubectl create` (what it did before) and must see
 * the second run fail.  `kubectl create --dry-run=client -o yaml` is the
 * real kubectl when it is installed (it needs no cluster). */
#include "tests/test.h"

#include <errno.h>
#include <stdarg.h>
#include <sys/wait.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <unistd.h>

static char tmp[64];

static int sh(const char *fmt, ...) __attribute__((format(printf, 1, 2)));
static int sh(const char *fmt, ...) {
    char cmd[8192];
    va_list ap;
    va_start(ap, fmt);
    vsnprintf(cmd, sizeof cmd, fmt, ap);
    va_end(ap);
    fflush(stdout);
    int st = system(cmd);
    return WIFEXITED(st) ? WEXITSTATUS(st) : -1;
}

static void write_file(const char *path, const char *text, mode_t mode) {
    FILE *f = fopen(path, "w");
    if (!f) TEST_FAIL("%s: %s", path, strerror(errno));
    fputs(text, f);
    fclose(f);
    chmod(path, mode);
}

/* docker run ... -v HOST:/keys IMAGE llm keygen --out /keys --name N: the
 * build's llm writes into HOST; every call is logged. */
static const char fake_docker[] =
    "#!/bin/sh\n"
    "echo \"$*\" >> \"$FAKE_DIR/docker.log\"\n"
    "[ \"$1\" = run ] || { echo 'fake docker: only run' >&2; exit 2; }\n"
    "shift; host=''; img=''\n"
    "while [ $# -gt 0 ]; do case \"$1\" in\n"
    "  --rm) shift;; --network|-u) shift 2;;\n"
    "  -v) host=\"${2%%:/keys}\"; shift 2;;\n"
    "  -*) echo \"fake docker: unknown flag $1\" >&2; exit 2;;\n"
    "  *) img=\"$1\"; shift; break;; esac; done\n"
    "[ \"$1\" = llm ] && [ \"$2\" = keygen ] || { echo \"fake docker: $img runs '$*', not llm keygen\" >&2; exit 2; }\n"
    "shift 2; args=''\n"
    "while [ $# -gt 0 ]; do case \"$1\" in --out) shift 2;; --name) name=\"$2\"; shift 2;; *) shift;; esac; done\n"
    "exec \"$FAKE_LLM\" keygen --out \"$host\" --name \"$name\"\n";

/* kubectl -n NS create KIND NAME ... [--dry-run=client -o yaml] and
 * kubectl -n NS apply -f -, on objects kept as files in $FAKE_DIR/state. */
static const char fake_kubectl[] =
    "#!/bin/sh\n"
    "echo \"$*\" >> \"$FAKE_DIR/kubectl.log\"\n"
    "mkdir -p \"$FAKE_DIR/state\"\n"
    "case \" $* \" in\n"
    "*' apply -f - '*)\n"
    "  doc=$(cat); kind=$(printf '%s\\n' \"$doc\" | sed -n 's/^kind: //p' | head -1)\n"
    "  name=$(printf '%s\\n' \"$doc\" | sed -n 's/^  name: //p' | head -1)\n"
    "  [ -n \"$kind\" ] && [ -n \"$name\" ] || { echo 'fake kubectl: apply got no object' >&2; exit 1; }\n"
    "  printf '%s\\n' \"$doc\" > \"$FAKE_DIR/state/$kind-$name\"; echo \"$kind/$name configured\";;\n"
    "*' --dry-run=client '*)\n"
    "  if [ -n \"$REAL_KUBECTL\" ]; then exec \"$REAL_KUBECTL\" \"$@\"; fi\n"
    "  shift 3; printf 'apiVersion: v1\\nkind: %s\\nmetadata:\\n  name: %s\\n' \"$([ $1 = secret ] && echo Secret || echo ConfigMap)\" \"$([ $1 = secret ] && echo $3 || echo $2)\";;\n"
    "*' create '*)\n"
    "  shift 3; if [ \"$1\" = secret ]; then k=Secret; n=$3; else k=ConfigMap; n=$2; fi\n"
    "  if [ -f \"$FAKE_DIR/state/$k-$n\" ]; then echo \"Error from server (AlreadyExists): $n already exists\" >&2; exit 1; fi\n"
    "  echo made > \"$FAKE_DIR/state/$k-$n\";;\n"
    "*) echo \"fake kubectl: $*\" >&2; exit 2;;\n"
    "esac\n";

static int count_lines(const char *path) {
    char *t = test_read_file(path, NULL);
    int n = 0;
    for (char *p = t; p && *p; p++) n += *p == '\n';
    free(t);
    return n;
}

/* Runs the copied script with the fakes first on PATH and nothing else of
 * ours; returns its exit status. */
static int run_script(const char *script) {
    return sh("cd '%s' && env -i HOME='%s' PATH='%s/bin:/usr/bin:/bin' FAKE_DIR='%s' FAKE_LLM='%s' REAL_KUBECTL='%s' "
              "sh '%s' --kubernetes llm '%s/secrets' >> '%s/run.log' 2>&1",
              tmp, tmp, tmp, tmp, getenv("FAKE_LLM"), getenv("REAL_KUBECTL") ? getenv("REAL_KUBECTL") : "", script,
              tmp, tmp);
}

static void setup(void) {
    snprintf(tmp, sizeof tmp, "/tmp/llm-make-secrets-XXXXXX");
    if (!mkdtemp(tmp)) TEST_FAIL("mkdtemp: %s", strerror(errno));
    const char *llm = LLM_BINARY_DIR "/clients/c/llm";
    if (access(llm, X_OK) != 0) llm = LLM_BINARY_DIR "/router/llm";
    if (access(llm, X_OK) != 0) TEST_SKIP("llm is not built (clients/c/llm)");
    setenv("FAKE_LLM", llm, 1);
    /* The real kubectl for --dry-run=client, when there is one. */
    char path[256] = "";
    FILE *p = popen("command -v kubectl 2>/dev/null", "r");
    if (p && fgets(path, sizeof path, p)) path[strcspn(path, "\n")] = 0;
    if (p) pclose(p);
    if (path[0] && sh("'%s' create secret generic t --from-literal=a=b --dry-run=client -o yaml >/dev/null 2>&1", path) == 0)
        setenv("REAL_KUBECTL", path, 1);
    else
        printf("  no kubectl that renders offline: the fake writes the objects itself\n");
    char d[128];
    snprintf(d, sizeof d, "%s/bin", tmp);
    mkdir(d, 0755);
    snprintf(d, sizeof d, "%s/deploy", tmp);
    mkdir(d, 0755);
    char f[160];
    snprintf(f, sizeof f, "%s/bin/docker", tmp);
    write_file(f, fake_docker, 0755);
    snprintf(f, sizeof f, "%s/bin/kubectl", tmp);
    write_file(f, fake_kubectl, 0755);
    ASSERT_EQ(0, sh("cp '%s/deploy/make-secrets.sh' '%s/deploy/make-secrets.sh'", LLM_SOURCE_DIR, tmp));
    /* Neither llm nor a build tree is reachable from the copy. */
    ASSERT_TRUE(sh("env -i PATH='%s/bin:/usr/bin:/bin' sh -c 'command -v llm' >/dev/null", tmp) != 0);
}

TEST(make_secrets_idempotent_without_build) {
    setup();
    char script[160], log[160], state[160];
    snprintf(script, sizeof script, "%s/deploy/make-secrets.sh", tmp);
    snprintf(log, sizeof log, "%s/docker.log", tmp);
    snprintf(state, sizeof state, "%s/state", tmp);
    int rc = run_script(script);
    if (rc != 0) sh("cat '%s/run.log'", tmp);
    ASSERT_EQ(0, rc);
    ASSERT_EQ(4, count_lines(log)); /* router, worker, gateway, operator: through the image */
    ASSERT_EQ(0, sh("grep -q ' llmcluster:cpu llm keygen ' '%s'", log));
    static const char *const objs[] = {"Secret-llm-redis", "Secret-llm-router-key", "Secret-llm-worker-key",
                                       "Secret-llm-gateway-key", "Secret-llm-api-keys", "ConfigMap-llm-public-keys"};
    for (int i = 0; i < 6; i++) ASSERT_EQ(0, sh("test -s '%s/%s'", state, objs[i]));
    if (getenv("REAL_KUBECTL")) {
        /* The Secret holds the file that was made. */
        ASSERT_EQ(0, sh("grep -q \"password: $(base64 -w0 < '%s/secrets/redis-password')\" '%s/Secret-llm-redis'", tmp,
                        state));
        ASSERT_EQ(0, sh("grep -q 'router.pub:' '%s/ConfigMap-llm-public-keys'", state));
    }
    ASSERT_EQ(0, sh("cd '%s' && cat state/* secrets/* | md5sum > first.sum", tmp));

    /* Again: no AlreadyExists, no new key, the same objects. */
    rc = run_script(script);
    if (rc != 0) sh("cat '%s/run.log'", tmp);
    ASSERT_EQ(0, rc);
    ASSERT_EQ(4, count_lines(log));
    ASSERT_EQ(0, sh("cd '%s' && cat state/* secrets/* | md5sum | cmp -s - first.sum", tmp));
    printf("  two runs: 4 keys made through the image once, 6 objects applied twice, unchanged\n");

    /* Break-test: plain kubectl create fails on the second run. */
    char old[160];
    snprintf(old, sizeof old, "%s/deploy/old-make-secrets.sh", tmp);
    ASSERT_EQ(0, sh("sed 's/ --dry-run=client -o yaml | kubectl -n \"$kube\" apply -f -//' '%s' > '%s' && "
                    "! grep -q 'apply -f' '%s'", script, old, old));
    ASSERT_EQ(0, sh("rm -rf '%s/state'", tmp));
    ASSERT_EQ(0, run_script(old));
    ASSERT_TRUE(run_script(old) != 0);
    ASSERT_EQ(0, sh("grep -q AlreadyExists '%s/run.log'", tmp));
    printf("  break-test: kubectl create without apply fails its second run (AlreadyExists)\n");
    sh("rm -rf '%s'", tmp);
}

TEST_MAIN(make_secrets_idempotent_without_build)
