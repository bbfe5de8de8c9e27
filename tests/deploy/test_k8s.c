/* deploy/k8s offline: every overlay renders with `kubectl kustomize`, every
 * object validates against its schema, and the properties an operator
 * relies on hold (locked-down containers, probes, network policies, no
 * secret in the repository, workers able to register before the router is
 * ready, overridable images, the worker's grace period, KEDA on the
 * routers' consumer group, T4 placement, no replicas on autoscaled objects,
 * surge and 2 pipelines on T4, workers waiting for the model, DNS and fill
 * egress, PodMonitors, T4 memory, per-provider storage).  The checks are in
 * validate.mjs (Node, with the kubernetes-models, @kubernetes-models/keda,
 * @kubernetes-models/prometheus-operator and ajv npm packages of
 * package-lock.json); this program runs it so that ctest does.
 * It skips when kubectl (Debian: kubernetes-client) or node is missing, or
 * when the npm packages cannot be installed (no registry). */
#include "tests/test.h"

#include <stdlib.h>
#include <unistd.h>

#define DIR LLM_SOURCE_DIR "/tests/deploy"

TEST(k8s_manifests) {
    const char *kubectl = getenv("KUBECTL") ? getenv("KUBECTL") : "kubectl";
    char cmd[4096];
    snprintf(cmd, sizeof cmd, "'%s' kustomize --help > /dev/null 2>&1", kubectl);
    if (system(cmd) != 0)
        TEST_SKIP("%s with `kustomize` is not installed (Debian package kubernetes-client; or set KUBECTL)", kubectl);
    if (system("node --version > /dev/null 2>&1") != 0 || system("npm --version > /dev/null 2>&1") != 0)
        TEST_SKIP("node or npm is not installed (Node 18 or newer)");
    if (access(DIR "/node_modules/@kubernetes-models/keda", R_OK) != 0 ||
        access(DIR "/node_modules/kubernetes-models", R_OK) != 0 || access(DIR "/node_modules/ajv", R_OK) != 0 ||
        access(DIR "/node_modules/yaml", R_OK) != 0 ||
        access(DIR "/node_modules/@kubernetes-models/prometheus-operator", R_OK) != 0) {
        snprintf(cmd, sizeof cmd, "cd '%s' && npm ci --no-audit --no-fund > npm-ci.log 2>&1", DIR);
        if (system(cmd) != 0)
            TEST_SKIP("npm ci in %s failed (no registry reachable?): see %s/npm-ci.log", DIR, DIR);
    }
    snprintf(cmd, sizeof cmd, "cd '%s' && timeout 120 node validate.mjs --kubectl '%s' --bin '%s' 2>&1", DIR, kubectl,
             LLM_BINARY_DIR);
    fflush(stdout);
    int st = system(cmd);
    if (st != 0) TEST_FAIL("validate.mjs found problems (status 0x%x): the FAIL lines above", st);
}

TEST_MAIN(k8s_manifests)
