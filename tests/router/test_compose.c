/* The deployment files: docker-compose.yml (alone and with the GPU
 * override) passes `docker compose config` (or docker-compose v1's), the
 * Kubernetes manifests are well-formed YAML with the kinds they should
 * hold, and every LLM_* setting they give a program is one that program's
 * --help lists (a typo in a manifest would otherwise be silently ignored). */
#include "tests/test.h"

#include <stdbool.h>
#include <sys/wait.h>
#include <unistd.h>

#define SRC LLM_SOURCE_DIR
#define BIN LLM_BINARY_DIR

/* Runs a shell command; its output (stdout and stderr) into out. */
static int sh(const char *cmd, char *out, size_t size) {
    FILE *p = popen(cmd, "r");
    if (!p) TEST_FAIL("popen %s", cmd);
    size_t n = fread(out, 1, size - 1, p);
    out[n] = 0;
    int st = pclose(p);
    return WIFEXITED(st) ? WEXITSTATUS(st) : 128;
}

/* "docker compose" or "docker-compose", whichever parses files here. */
static const char *compose_cmd(void) {
    static char out[4096];
    if (sh("docker compose version 2>&1", out, sizeof out) == 0) return "docker compose";
    if (sh("docker-compose version 2>&1", out, sizeof out) == 0) return "docker-compose";
    return NULL;
}

TEST(compose_file_parses) {
    const char *dc = compose_cmd();
    if (!dc) TEST_SKIP("neither `docker compose` nor docker-compose is installed (scripts/install-deps.sh)");
    static char cmd[2048], out[1 << 16];
    snprintf(cmd, sizeof cmd, "cd '%s' && %s -f docker-compose.yml config 2>&1", SRC, dc);
    int rc = sh(cmd, out, sizeof out);
    if (rc != 0) TEST_FAIL("%s config: status %d:\n%s", dc, rc, out);
    /* What the file must say: AOF persistence, the router, a 2-stage pipeline. */
    ASSERT_TRUE(strstr(out, "appendonly") != NULL);
    ASSERT_TRUE(strstr(out, "llm-router") != NULL);
    ASSERT_TRUE(strstr(out, "LLM_STAGE: '1'") != NULL || strstr(out, "LLM_STAGE: \"1\"") != NULL);
    snprintf(cmd, sizeof cmd, "cd '%s' && %s -f docker-compose.yml -f deploy/compose.gpu.yml config 2>&1", SRC, dc);
    rc = sh(cmd, out, sizeof out);
    if (rc != 0) TEST_FAIL("%s config with deploy/compose.gpu.yml: status %d:\n%s", dc, rc, out);
    ASSERT_TRUE(strstr(out, "driver: nvidia") != NULL);
    ASSERT_TRUE(strstr(out, "Dockerfile.cuda") != NULL);
}

TEST(compose_k8s_manifests_parse) {
    static char out[1 << 16];
    if (sh("python3 -c 'import yaml' 2>&1", out, sizeof out) != 0)
        TEST_SKIP("python3 with the yaml module is not installed (python3-yaml)");
    /* kinds per file, and every kustomization resource exists */
    static char cmd[2048];
    snprintf(cmd, sizeof cmd,
             "cd '%s/deploy/k8s' && python3 -c \"\n"
             "import yaml, os\n"
             "k = yaml.safe_load(open('kustomization.yaml'))\n"
             "kinds = []\n"
             "for f in k['resources']:\n"
             "    for d in yaml.safe_load_all(open(f)):\n"
             "        if d: kinds.append(d['kind'] + '/' + d['metadata']['name'])\n"
             "print(' '.join(sorted(kinds)))\n\" 2>&1",
             SRC);
    int rc = sh(cmd, out, sizeof out);
    if (rc != 0) TEST_FAIL("deploy/k8s: %s", out);
    printf("  %s", out);
    const char *want[] = {"Deployment/llm-router", "Service/llm-router", "StatefulSet/redis",
                          "PersistentVolumeClaim/redis-data", "StatefulSet/llm-stage-0", "StatefulSet/llm-stage-1",
                          "ConfigMap/llm-config", "Service/redis"};
    for (size_t i = 0; i < sizeof want / sizeof want[0]; i++)
        if (!strstr(out, want[i])) TEST_FAIL("deploy/k8s has no %s (it has: %s)", want[i], out);
}

/* Every LLM_* name a deployment file sets (as "LLM_X:" or "name: LLM_X";
 * not ${LLM_X} substitutions of compose) must be in help. */
static void check_env_names(const char *file, const char *help) {
    char path[1024];
    snprintf(path, sizeof path, "%s/%s", SRC, file);
    FILE *f = fopen(path, "r");
    if (!f) TEST_FAIL("%s: cannot open", path);
    char line[1024];
    int lineno = 0, n = 0;
    while (fgets(line, sizeof line, f)) {
        lineno++;
        char *hash = strchr(line, '#');
        if (hash) *hash = 0;
        for (char *p = line; (p = strstr(p, "LLM_")) != NULL;) {
            size_t len = 4;
            while ((p[len] >= 'A' && p[len] <= 'Z') || p[len] == '_' || (p[len] >= '0' && p[len] <= '9')) len++;
            bool subst = p > line && (p[-1] == '{');
            bool set = p[len] == ':' || (p >= line + 6 && strncmp(p - 6, "name: ", 6) == 0);
            if (set && !subst) {
                char name[64];
                snprintf(name, sizeof name, "%.*s", (int)len, p);
                char padded[80];
                snprintf(padded, sizeof padded, "env: %s", name);
                if (!strstr(help, padded)) {
                    fclose(f);
                    TEST_FAIL("%s:%d sets %s, which no program's --help lists", file, lineno, name);
                }
                n++;
            }
            p += len;
        }
    }
    fclose(f);
    printf("  %s: %d settings, all known\n", file, n);
    ASSERT_TRUE(n > 0);
}

TEST(compose_settings_are_real_options) {
    static char help[1 << 17];
    size_t off = 0;
    const char *progs[] = {BIN "/router/llm-router", BIN "/worker/llm-worker", BIN "/router/llm"};
    for (size_t i = 0; i < 3; i++) {
        if (access(progs[i], X_OK) != 0) TEST_SKIP("%s is not built", progs[i]);
        char cmd[1100];
        snprintf(cmd, sizeof cmd, "'%s' --help 2>&1", progs[i]);
        if (sh(cmd, help + off, sizeof help - off) != 0) TEST_FAIL("%s --help failed", progs[i]);
        off += strlen(help + off);
    }
    check_env_names("docker-compose.yml", help);
    check_env_names("deploy/compose.gpu.yml", help);
    check_env_names("deploy/k8s/config.yaml", help);
    check_env_names("deploy/k8s/router.yaml", help);
    check_env_names("deploy/k8s/workers.yaml", help);
}

TEST_MAIN(compose_file_parses, compose_k8s_manifests_parse, compose_settings_are_real_options)
