/* The Compose files: docker-compose.yml (alone and with the GPU override)
 * passes `docker compose config` (or docker-compose v1's), with the Redis
 * password and the keys given as secret files the way the Kubernetes
 * manifests give them, and every LLM_* setting they give a program is one
 * that a program's --help lists (a typo would otherwise be silently
 * ignored).  The Kubernetes manifests are tests/deploy/test_k8s.c's. */
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
    /* Secrets as files: Redis reads its password from one, every program
     * its key, and no URL carries a password. */
    const char *want[] = {"requirepass", "/run/secrets/redis-password", "LLM_REDIS_PASSWORD_FILE",
                          "LLM_CURVE_KEY_FILE: /run/secrets/router-key", "LLM_CURVE_KEY_FILE: /run/secrets/worker-key",
                          "LLM_CURVE_KEY_FILE: /run/secrets/gateway-key", "LLM_API_KEYS_FILE: /run/secrets/api-keys",
                          "llm-gateway"};
    for (size_t i = 0; i < sizeof want / sizeof want[0]; i++)
        if (!strstr(out, want[i])) TEST_FAIL("%s config has no %s:\n%s", dc, want[i], out);
    for (const char *p = out; (p = strstr(p, "redis://")) != NULL; p++) {
        const char *end = strpbrk(p, " \n'\"");
        const char *at = strchr(p, '@');
        if (at && (!end || at < end)) TEST_FAIL("a Redis URL with a password in docker-compose.yml: %.60s", p);
    }
    snprintf(cmd, sizeof cmd, "cd '%s' && %s -f docker-compose.yml -f deploy/compose.gpu.yml config 2>&1", SRC, dc);
    rc = sh(cmd, out, sizeof out);
    if (rc != 0) TEST_FAIL("%s config with deploy/compose.gpu.yml: status %d:\n%s", dc, rc, out);
    ASSERT_TRUE(strstr(out, "driver: nvidia") != NULL);
    ASSERT_TRUE(strstr(out, "Dockerfile.cuda") != NULL);
}

/* Names agreed for the trust and metrics interfaces that a program may not
 * list yet while they are being built: a note, not a failure. */
static const char *const contract_names[] = {"LLM_CURVE_KEY_FILE", "LLM_INSECURE", "LLM_CLIENT_KEYS",
                                             "LLM_WORKER_KEYS", "LLM_ROUTER_KEY", "LLM_REDIS_PASSWORD_FILE",
                                             "LLM_MAX_MSG_SIZE", "LLM_METRICS_LISTEN"};

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
                bool agreed = false;
                for (size_t i = 0; i < sizeof contract_names / sizeof contract_names[0]; i++)
                    agreed |= strcmp(name, contract_names[i]) == 0;
                if (!strstr(help, padded) && agreed) {
                    printf("  note: %s:%d sets %s, agreed but not in any --help yet\n", file, lineno, name);
                } else if (!strstr(help, padded)) {
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
    const char *progs[] = {BIN "/router/llm-router", BIN "/worker/llm-worker", BIN "/clients/c/llm",
                           BIN "/gateway/llm-gateway"};
    for (size_t i = 0; i < sizeof progs / sizeof progs[0]; i++) {
        if (access(progs[i], X_OK) != 0) TEST_SKIP("%s is not built", progs[i]);
        char cmd[1100];
        snprintf(cmd, sizeof cmd, "'%s' --help 2>&1", progs[i]);
        if (sh(cmd, help + off, sizeof help - off) != 0) TEST_FAIL("%s --help failed", progs[i]);
        off += strlen(help + off);
    }
    check_env_names("docker-compose.yml", help);
    check_env_names("deploy/compose.gpu.yml", help);
}

TEST_MAIN(compose_file_parses, compose_settings_are_real_options)
