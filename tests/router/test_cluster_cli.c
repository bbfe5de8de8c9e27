/* llm-cluster as a user runs it: up starts Redis, a router and the workers
 * in the background and returns once they serve (the output then equals
 * llm-run's), status shows them, down stops every process; a worker that
 * dies while loading and a port already taken are reported with the cause
 * and leave nothing running. */
#include "tests/router/cluster_harness.h"

#include <dirent.h>
#include <netinet/in.h>
#include <sys/socket.h>

#define MODEL "stories260K-f32.gguf"
#define CLUSTER_BIN LLM_BINARY_DIR "/router/llm-cluster"

/* The run dir, RUN_BASE/run: up makes it, as it would a fresh clone's
 * run/cluster, inside a folder others may read (0755). */
static char run_base[256], run_dir[300];

/* Stops what a failed test left running. */
static void cli_atexit(void) {
    if (!run_base[0]) return;
    char cmd[1024];
    snprintf(cmd, sizeof cmd, "%s down --run-dir '%s' >/dev/null 2>&1; rm -rf '%s'", CLUSTER_BIN, run_dir, run_base);
    if (system(cmd) != 0) fprintf(stderr, "cleanup of %s failed\n", run_base);
}

static void cli_new_run_dir(void) {
    static int registered;
    if (!registered) {
        atexit(cli_atexit);
        registered = 1;
    }
    cli_atexit();
    snprintf(run_base, sizeof run_base, "/tmp/llm-cluster-cli-XXXXXX");
    if (!mkdtemp(run_base)) TEST_FAIL("mkdtemp: %s", strerror(errno));
    if (chmod(run_base, 0755) != 0) TEST_FAIL("chmod %s: %s", run_base, strerror(errno));
    snprintf(run_dir, sizeof run_dir, "%s/run", run_base);
}

/* Everything under dir, dir included, is this user's alone: no group or
 * other bit on a file or folder (Redis's append-only file holds every
 * prompt and completion, the logs may quote them, and the keys are there).
 * Returns how many entries it checked. */
static int cli_assert_private(const char *dir) {
    struct stat st;
    if (lstat(dir, &st) != 0) TEST_FAIL("%s: %s", dir, strerror(errno));
    if (st.st_mode & 077) TEST_FAIL("%s is mode %04o: others may read it", dir, (unsigned)(st.st_mode & 07777));
    int n = 1;
    if (!S_ISDIR(st.st_mode)) return n;
    DIR *d = opendir(dir);
    if (!d) TEST_FAIL("%s: %s", dir, strerror(errno));
    for (struct dirent *e; (e = readdir(d));) {
        if (strcmp(e->d_name, ".") == 0 || strcmp(e->d_name, "..") == 0) continue;
        char path[1024];
        snprintf(path, sizeof path, "%s/%s", dir, e->d_name);
        n += cli_assert_private(path);
    }
    closedir(d);
    return n;
}

/* Runs argv (bounded to 120 s); stdout and stderr go to *out / *err (malloc'ed). */
static int cli_run(const char *const *argv, char **out, char **err) {
    char opath[] = "/tmp/cli-outXXXXXX", epath[] = "/tmp/cli-errXXXXXX";
    int ofd = mkstemp(opath), efd = mkstemp(epath);
    if (ofd < 0 || efd < 0) TEST_FAIL("mkstemp: %s", strerror(errno));
    unlink(opath);
    unlink(epath);
    pid_t pid = fork();
    if (pid == 0) {
        dup2(ofd, 1);
        dup2(efd, 2);
        alarm(120);
        execv(argv[0], (char *const *)argv);
        _exit(127);
    }
    int st;
    waitpid(pid, &st, 0);
    char **dst[2] = {out, err};
    int fds[2] = {ofd, efd};
    for (int i = 0; i < 2; i++) {
        off_t n = lseek(fds[i], 0, SEEK_END);
        lseek(fds[i], 0, SEEK_SET);
        *dst[i] = calloc(1, (size_t)n + 1);
        ssize_t got = read(fds[i], *dst[i], (size_t)n);
        (*dst[i])[got > 0 ? got : 0] = 0;
        close(fds[i]);
    }
    return WIFEXITED(st) ? WEXITSTATUS(st) : 128 + WTERMSIG(st);
}

/* pids from the run dir's *.pid files. */
static int cli_pids(pid_t *pids, int max) {
    DIR *d = opendir(run_dir);
    int n = 0;
    if (!d) return 0;
    for (struct dirent *e; (e = readdir(d)) && n < max;) {
        size_t l = strlen(e->d_name);
        if (l < 5 || strcmp(e->d_name + l - 4, ".pid") != 0) continue;
        char path[600];
        snprintf(path, sizeof path, "%s/%s", run_dir, e->d_name);
        FILE *f = fopen(path, "r");
        int pid = 0;
        if (f && fscanf(f, "%d", &pid) == 1 && pid > 1) pids[n++] = pid;
        if (f) fclose(f);
    }
    closedir(d);
    return n;
}

/* A live (not zombie) process whose command line contains needle, or 0. */
static pid_t cli_find_process(const char *needle) {
    DIR *d = opendir("/proc");
    pid_t found = 0;
    for (struct dirent *e; d && (e = readdir(d)) && !found;) {
        int pid = atoi(e->d_name);
        if (pid <= 1 || pid == getpid()) continue;
        char path[64], buf[4096];
        snprintf(path, sizeof path, "/proc/%d/cmdline", pid);
        FILE *f = fopen(path, "r");
        if (!f) continue;
        size_t n = fread(buf, 1, sizeof buf - 1, f);
        fclose(f);
        for (size_t i = 0; i < n; i++)
            if (!buf[i]) buf[i] = ' ';
        buf[n] = 0;
        if (n && strstr(buf, needle) && !strstr(buf, "llm-cluster")) found = pid;
    }
    if (d) closedir(d);
    return found;
}

/* The command line of a process, its arguments joined by spaces, into buf. */
static void cli_cmdline(pid_t pid, char *buf, size_t size) {
    char path[64];
    snprintf(path, sizeof path, "/proc/%d/cmdline", (int)pid);
    buf[0] = 0;
    FILE *f = fopen(path, "r");
    if (!f) return;
    size_t n = fread(buf, 1, size - 1, f);
    fclose(f);
    for (size_t i = 0; i < n; i++)
        if (!buf[i]) buf[i] = ' ';
    buf[n] = 0;
}

/* The first line of a file, without its newline. */
static void cli_first_line(const char *path, char *buf, size_t size) {
    buf[0] = 0;
    FILE *f = fopen(path, "r");
    if (!f) return;
    if (!fgets(buf, (int)size, f)) buf[0] = 0;
    fclose(f);
    buf[strcspn(buf, "\r\n")] = 0;
}

static bool cli_alive(pid_t pid) {
    char path[64], state = 0;
    snprintf(path, sizeof path, "/proc/%d/stat", (int)pid);
    FILE *f = fopen(path, "r");
    if (!f) return false;
    int r = fscanf(f, "%*d %*s %c", &state);
    fclose(f);
    return r == 1 && state != 'Z';
}

TEST(cluster_cli_up_generate_status_down) {
    const char *model = test_model_path(MODEL);
    struct h_ref ref;
    h_reference(model, "Once upon a time", 40, 1, &ref);
    cli_new_run_dir();
    char *out, *err;
    const char *up[] = {CLUSTER_BIN, "up", "--model", model, "--port", "0", "--run-dir", run_dir, "--stages", "2",
                        "--threads", "1", "--timeout-s", "60", NULL};
    int rc = cli_run(up, &out, &err);
    if (rc != 0) printf("  stdout:\n%s  stderr:\n%s", out, err);
    ASSERT_EQ(0, rc);
    const char *r = strstr(out, "router: ");
    ASSERT_TRUE(r != NULL);
    char endpoint[64] = "";
    sscanf(r + 8, "%63s", endpoint);
    ASSERT_TRUE(strncmp(endpoint, "tcp://127.0.0.1:", 16) == 0);
    ASSERT_TRUE(strstr(out, run_dir) != NULL);
    /* The line printed after "try:" works as printed, in a shell with
     * nothing of this build on its PATH: env.sh puts llm there, and the
     * router fits the default --max-tokens to the model's context. */
    const char *t = strstr(out, "try: ");
    ASSERT_TRUE(t != NULL);
    char try_line[1024];
    snprintf(try_line, sizeof try_line, "%.*s", (int)strcspn(t + 5, "\n"), t + 5);
    free(out);
    free(err);
    const char *try_argv[] = {"/usr/bin/env", "-i", "PATH=/usr/bin:/bin", "/bin/sh", "-c", try_line, NULL};
    rc = cli_run(try_argv, &out, &err);
    printf("  try: %s\n  (status %d) stdout: %.200s\n  stderr: %.300s\n", try_line, rc, out, err);
    ASSERT_EQ(0, rc);
    ASSERT_TRUE(strlen(out) > 10);
    free(out);
    free(err);
    pid_t pids[16];
    int n_pids = cli_pids(pids, 16);
    ASSERT_EQ(4, n_pids); /* redis, router, 2 workers */

    /* Secure by default: keys in the run dir, Redis with its append-only
     * file there, and an env.sh that gives llm what it needs. */
    char path[512];
    struct stat st;
    snprintf(path, sizeof path, "%s/keys/router.key", run_dir);
    ASSERT_EQ(0, stat(path, &st));
    ASSERT_EQ(0600u, (unsigned)(st.st_mode & 0777));
    snprintf(path, sizeof path, "%s/keys/workers/worker-p0-s1.pub", run_dir);
    ASSERT_EQ(0, stat(path, &st));
    char aof[512], aofdir[512];
    snprintf(aof, sizeof aof, "%s/appendonly.aof", run_dir);
    snprintf(aofdir, sizeof aofdir, "%s/appendonlydir", run_dir);
    ASSERT_TRUE(stat(aof, &st) == 0 || stat(aofdir, &st) == 0);
    /* ... and the run dir, the AOF, the logs, env.sh and the keys are this
     * user's alone, although the folder above is open (0755). */
    int n_private = cli_assert_private(run_dir);
    printf("  %d entries of the run dir, none readable by others\n", n_private);
    ASSERT_TRUE(n_private >= 15);
    /* The Redis password is in a file of the run dir that only this user
     * reads, and on no command line that ps shows: the router and the
     * workers get the file (--redis-password-file). */
    char password[128], pwfile[512];
    snprintf(pwfile, sizeof pwfile, "%s/redis.password", run_dir);
    ASSERT_EQ(0, stat(pwfile, &st));
    ASSERT_EQ(0600u, (unsigned)(st.st_mode & 0777));
    cli_first_line(pwfile, password, sizeof password);
    ASSERT_TRUE(strlen(password) >= 16);
    int n_checked = 0;
    for (int i = 0; i < n_pids; i++) {
        char cmd[4096];
        cli_cmdline(pids[i], cmd, sizeof cmd);
        if (!strstr(cmd, "llm-router") && !strstr(cmd, "llm-worker")) continue;
        if (strstr(cmd, password)) TEST_FAIL("pid %d shows the Redis password: %s", (int)pids[i], cmd);
        ASSERT_TRUE(strstr(cmd, "--redis-password-file") != NULL);
        n_checked++;
    }
    ASSERT_EQ(3, n_checked); /* the router and 2 workers */
    /* A password file that Redis refuses stops a router and a worker at
     * start, naming the file and not the password. */
    char redis_url[256] = "", wrong[512];
    {
        char envf[512], line[512];
        snprintf(envf, sizeof envf, "%s/cluster.env", run_dir);
        FILE *f = fopen(envf, "r");
        ASSERT_TRUE(f != NULL);
        while (fgets(line, sizeof line, f)) {
            const char *at = strchr(line, '@');
            if (strncmp(line, "LLM_REDIS_URL=", 14) == 0 && at) {
                snprintf(redis_url, sizeof redis_url, "redis://%s", at + 1);
                redis_url[strcspn(redis_url, "\r\n")] = 0;
            }
        }
        fclose(f);
    }
    ASSERT_TRUE(strncmp(redis_url, "redis://127.0.0.1:", 18) == 0);
    snprintf(wrong, sizeof wrong, "%s/wrong.password", run_dir);
    {
        FILE *f = fopen(wrong, "w");
        ASSERT_TRUE(f != NULL);
        fputs("not-the-password-x7\n", f);
        fclose(f);
    }
    const char *bad_router[] = {LLM_BINARY_DIR "/router/llm-router", "--model", model, "--insecure",
                                "--listen", "tcp://127.0.0.1:0", "--worker-listen", "tcp://127.0.0.1:0",
                                "--metrics-listen", "", "--redis", redis_url, "--redis-password-file",
                                wrong, NULL};
    const char *bad_worker[] = {LLM_BINARY_DIR "/worker/llm-worker", "--model", model, "--insecure",
                                "--metrics-listen", "", "--redis", redis_url, "--redis-password-file",
                                wrong, NULL};
    const char *const *bad[] = {bad_router, bad_worker};
    for (int i = 0; i < 2; i++) {
        rc = cli_run(bad[i], &out, &err);
        printf("  %s with a wrong password file (status %d): %s", bad[i][0], rc, err);
        ASSERT_EQ(2, rc);
        ASSERT_TRUE(strstr(err, wrong) != NULL);
        ASSERT_TRUE(strstr(err, "refused the password") != NULL);
        ASSERT_TRUE(strstr(err, "not-the-password-x7") == NULL);
        free(out);
        free(err);
    }
    /* A password file that is not there is named too. */
    snprintf(wrong, sizeof wrong, "%s/missing.password", run_dir);
    rc = cli_run(bad_router, &out, &err);
    ASSERT_EQ(2, rc);
    ASSERT_TRUE(strstr(err, wrong) != NULL);
    free(out);
    free(err);
    /* Without keys llm refuses, naming the options. */
    const char *nokeys[] = {LLM_BINARY_DIR "/clients/c/llm", "--router", endpoint, "health", NULL};
    rc = cli_run(nokeys, &out, &err);
    if (rc != 2 || !strstr(err, "--curve-key-file")) printf("  llm without keys (status %d):\n%s%s", rc, out, err);
    ASSERT_EQ(2, rc);
    ASSERT_TRUE(strstr(err, "--curve-key-file") && strstr(err, "--insecure"));
    free(out);
    free(err);

    /* It serves: llm generate after ". RUN_DIR/env.sh" prints llm-run's JSON. */
    char script[1024];
    snprintf(script, sizeof script, ". '%s/env.sh' && exec '%s' generate --prompt 'Once upon a time' "
             "--max-tokens 40 --json", run_dir, LLM_BINARY_DIR "/clients/c/llm");
    const char *gen[] = {"/bin/sh", "-c", script, NULL};
    rc = cli_run(gen, &out, &err);
    /* The JSON line, found by its first key: it holds objects of its own
     * ("timing"), so the last '{' is not where it starts. */
    cJSON *j = cJSON_Parse(strstr(out, "{\"prompt_ids\"") ? strstr(out, "{\"prompt_ids\"") : "");
    int same = j != NULL && cJSON_GetArraySize(cJSON_GetObjectItem(j, "ids")) == ref.n;
    for (int i = 0; same && i < ref.n; i++)
        same = cJSON_GetArrayItem(cJSON_GetObjectItem(j, "ids"), i)->valueint == ref.ids[i];
    if (rc != 0 || !same) printf("  llm generate (status %d):\n%s%s", rc, out, err);
    cJSON_Delete(j);
    free(out);
    free(err);
    ASSERT_EQ(0, rc);
    ASSERT_TRUE(same);

    /* --n 3: a "choices" array of three, choice 0 the top-level output. */
    snprintf(script, sizeof script, ". '%s/env.sh' && exec '%s' generate --prompt 'Once upon a time' "
             "--max-tokens 20 --temperature 1 --seed 5 --n 3 --json", run_dir, LLM_BINARY_DIR "/clients/c/llm");
    rc = cli_run(gen, &out, &err);
    j = cJSON_Parse(strrchr(out, '\n') && strstr(out, "{\"prompt_ids\"") ? strstr(out, "{\"prompt_ids\"") : "");
    cJSON *choices = j ? cJSON_GetObjectItem(j, "choices") : NULL;
    int n_choices = choices ? cJSON_GetArraySize(choices) : -1;
    if (rc != 0 || n_choices != 3) printf("  llm generate --n 3 (status %d):\n%s%s", rc, out, err);
    ASSERT_EQ(0, rc);
    ASSERT_EQ(3, n_choices);
    ASSERT_TRUE(cJSON_Compare(cJSON_GetObjectItem(j, "ids"),
                              cJSON_GetObjectItem(cJSON_GetArrayItem(choices, 0), "ids"), 1));
    for (int i = 0; i < 3; i++) {
        int n_ids = cJSON_GetArraySize(cJSON_GetObjectItem(cJSON_GetArrayItem(choices, i), "ids"));
        ASSERT_TRUE(n_ids >= 1 && n_ids <= 20);
    }
    cJSON_Delete(j);
    free(out);
    free(err);

    const char *status[] = {CLUSTER_BIN, "status", "--run-dir", run_dir, NULL};
    rc = cli_run(status, &out, &err);
    if (rc != 0 || !strstr(out, "1/1 pipelines ready")) printf("  status (%d):\n%s%s", rc, out, err);
    ASSERT_EQ(0, rc);
    ASSERT_TRUE(strstr(out, "1/1 pipelines ready") != NULL);
    free(out);
    free(err);

    const char *down[] = {CLUSTER_BIN, "down", "--run-dir", run_dir, NULL};
    rc = cli_run(down, &out, &err);
    ASSERT_EQ(0, rc);
    ASSERT_TRUE(strstr(out, "stopped router") != NULL);
    free(out);
    free(err);
    int64_t end = h_now_ms() + 5000;
    for (int i = 0; i < n_pids; i++) {
        while (cli_alive(pids[i]) && h_now_ms() < end) h_sleep_ms(20);
        if (cli_alive(pids[i])) TEST_FAIL("pid %d still runs after llm-cluster down", (int)pids[i]);
    }
    ASSERT_EQ(0, cli_pids(pids, 16));
    cli_atexit();
    run_dir[0] = 0;
}

TEST(cluster_cli_worker_dying_while_loading_is_reported) {
    const char *model = test_model_path(MODEL);
    cli_new_run_dir();
    int port;
    char e[128];
    ASSERT_OK(zio_free_port(NULL, &port, e, sizeof e));
    char port_s[16], needle[64];
    snprintf(port_s, sizeof port_s, "%d", port);
    snprintf(needle, sizeof needle, "tcp://127.0.0.1:%d", port);
    /* Layers the model does not have: the worker refuses while loading. */
    const char *up[] = {CLUSTER_BIN, "up", "--model", model, "--port", port_s, "--run-dir", run_dir, "--stages", "2",
                        "--threads", "1", "--timeout-s", "60", "--worker-args", "--layers 0:99", NULL};
    char *out, *err;
    int rc = cli_run(up, &out, &err);
    printf("  stderr:\n%s", err);
    ASSERT_EQ(1, rc);
    ASSERT_TRUE(strstr(err, "worker-p0-s") != NULL);
    ASSERT_TRUE(strstr(err, "last line of") != NULL);
    ASSERT_TRUE(strstr(err, "99") != NULL); /* the worker's own message names the range */
    free(out);
    free(err);
    pid_t pids[16];
    ASSERT_EQ(0, cli_pids(pids, 16));
    pid_t left = cli_find_process(needle);
    if (left) TEST_FAIL("pid %d (the router on %s) still runs after the failed up", (int)left, needle);
}

TEST(cluster_cli_port_taken_is_reported) {
    const char *model = test_model_path(MODEL);
    cli_new_run_dir();
    int fd = socket(AF_INET, SOCK_STREAM, 0);
    struct sockaddr_in a = {0};
    a.sin_family = AF_INET;
    a.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
    ASSERT_EQ(0, bind(fd, (struct sockaddr *)&a, sizeof a));
    ASSERT_EQ(0, listen(fd, 1));
    socklen_t len = sizeof a;
    getsockname(fd, (struct sockaddr *)&a, &len);
    char port_s[16];
    snprintf(port_s, sizeof port_s, "%d", ntohs(a.sin_port));
    const char *up[] = {CLUSTER_BIN, "up", "--model", model, "--port", port_s, "--run-dir", run_dir, NULL};
    char *out, *err;
    int rc = cli_run(up, &out, &err);
    close(fd);
    printf("  stderr: %s", err);
    ASSERT_EQ(1, rc);
    ASSERT_TRUE(strstr(err, port_s) != NULL);
    ASSERT_TRUE(strstr(err, "in use") != NULL);
    free(out);
    free(err);
    pid_t pids[16];
    ASSERT_EQ(0, cli_pids(pids, 16));
    /* And an unreadable model is refused before anything starts. */
    const char *up2[] = {CLUSTER_BIN, "up", "--model", "/nonexistent/model.gguf", "--run-dir", run_dir, NULL};
    rc = cli_run(up2, &out, &err);
    ASSERT_EQ(1, rc);
    ASSERT_TRUE(strstr(err, "/nonexistent/model.gguf") != NULL);
    free(out);
    free(err);
}

/* GET url with curl (bounded to 10 s): the HTTP status, the body into
 * *body (malloc'ed); extra headers and a JSON body when given. */
static int cli_curl(const char *url, const char *auth, const char *json, char **body) {
    char header[256] = "", *out, *err;
    if (auth) snprintf(header, sizeof header, "Authorization: Bearer %s", auth);
    const char *argv[16];
    int n = 0;
    argv[n++] = "/usr/bin/curl";
    argv[n++] = "-sS";
    argv[n++] = "--max-time";
    argv[n++] = "10";
    argv[n++] = "-w";
    argv[n++] = "\n%{http_code}";
    if (auth) {
        argv[n++] = "-H";
        argv[n++] = header;
    }
    if (json) {
        argv[n++] = "-H";
        argv[n++] = "Content-Type: application/json";
        argv[n++] = "-d";
        argv[n++] = json;
    }
    argv[n++] = url;
    argv[n] = NULL;
    int rc = cli_run(argv, &out, &err);
    char *nl = strrchr(out, '\n');
    int code = rc == 0 && nl ? atoi(nl + 1) : -1;
    if (nl) *nl = 0;
    if (rc != 0) printf("  curl %s: exit %d: %s", url, rc, err);
    free(err);
    *body = out;
    return code;
}

/* up --http-port: a gateway with a fresh API key answers the OpenAI API
 * (llm-run's greedy text), refuses a request without the key, shows in
 * status and stops on down; prometheus-targets.json lists every process's
 * metrics address, and each one serves /metrics. */
TEST(cluster_cli_http_gateway_and_prometheus_targets) {
    if (access("/usr/bin/curl", X_OK) != 0) TEST_SKIP("no /usr/bin/curl");
    const char *model = test_model_path(MODEL);
    struct h_ref ref;
    h_reference(model, "Once upon a time", 20, 1, &ref);
    cli_new_run_dir();
    int http_port;
    char e[128];
    ASSERT_OK(zio_free_port(NULL, &http_port, e, sizeof e));
    char http_s[16];
    snprintf(http_s, sizeof http_s, "%d", http_port);
    char *out, *err;
    /* An unknown chat template is refused before anything starts, with
     * the names that would do. */
    const char *bad_tmpl[] = {CLUSTER_BIN, "up", "--model", model, "--port", "0", "--run-dir", run_dir,
                              "--http-port", http_s, "--chat-template", "no-such-family", NULL};
    int rc = cli_run(bad_tmpl, &out, &err);
    printf("  up --chat-template no-such-family (status %d): %s", rc, err);
    ASSERT_EQ(2, rc);
    ASSERT_TRUE(strstr(err, "no-such-family") != NULL && strstr(err, "chatml") != NULL);
    free(out);
    free(err);
    pid_t pids[16];
    ASSERT_EQ(0, cli_pids(pids, 16));
    /* A run dir an earlier llm-cluster left open to others (0755, its
     * env.sh and a log of a worker this run does not start at 0644) is
     * made private by up. */
    char path[512];
    ASSERT_EQ(0, mkdir(run_dir, 0755));
    ASSERT_EQ(0, chmod(run_dir, 0755));
    static const char *const left[] = {"env.sh", "worker-p1-s0.log"};
    for (int i = 0; i < 2; i++) {
        snprintf(path, sizeof path, "%s/%s", run_dir, left[i]);
        FILE *f = fopen(path, "w");
        ASSERT_TRUE(f != NULL);
        fputs("# from an earlier run: a prompt\n", f);
        fclose(f);
        ASSERT_EQ(0, chmod(path, 0644));
    }
    /* stories260K has no chat template: --chat-template gives the gateway
     * one, and chat completions are served. */
    const char *up[] = {CLUSTER_BIN, "up", "--model", model, "--port", "0", "--run-dir", run_dir, "--stages", "2",
                        "--threads", "1", "--timeout-s", "60", "--http-port", http_s, "--chat-template", "chatml",
                        NULL};
    rc = cli_run(up, &out, &err);
    if (rc != 0) printf("  stdout:\n%s  stderr:\n%s", out, err);
    ASSERT_EQ(0, rc);
    char url[128];
    snprintf(url, sizeof url, "http://127.0.0.1:%d/v1", http_port);
    ASSERT_TRUE(strstr(out, url) != NULL);
    ASSERT_TRUE(strstr(out, "api-key") != NULL);
    free(out);
    free(err);

    char key[128] = "";
    struct stat st;
    ASSERT_TRUE(cli_assert_private(run_dir) >= 15);
    snprintf(path, sizeof path, "%s/api-key", run_dir);
    ASSERT_EQ(0, stat(path, &st));
    ASSERT_EQ(0600u, (unsigned)(st.st_mode & 0777));
    FILE *f = fopen(path, "r");
    ASSERT_TRUE(f && fgets(key, sizeof key, f));
    fclose(f);
    key[strcspn(key, "\r\n")] = 0;
    ASSERT_TRUE(strlen(key) >= 32);

    char completions[160];
    snprintf(completions, sizeof completions, "%s/completions", url);
    const char *req = "{\"prompt\": \"Once upon a time\", \"max_tokens\": 20, \"temperature\": 0}";
    char *body;
    int code = cli_curl(completions, key, req, &body);
    cJSON *j = cJSON_Parse(body);
    cJSON *text = cJSON_GetObjectItem(cJSON_GetArrayItem(cJSON_GetObjectItem(j, "choices"), 0), "text");
    int same = cJSON_IsString(text) && strcmp(text->valuestring, ref.text) == 0;
    if (code != 200 || !same) printf("  completions (%d): %s\n  llm-run: %s\n", code, body, ref.text);
    cJSON_Delete(j);
    free(body);
    ASSERT_EQ(200, code);
    ASSERT_TRUE(same);
    code = cli_curl(completions, NULL, req, &body);
    if (code != 401) printf("  completions without a key (%d): %s\n", code, body);
    free(body);
    ASSERT_EQ(401, code);
    code = cli_curl(completions, "not-the-key", req, &body);
    free(body);
    ASSERT_EQ(401, code);
    char chat[160];
    snprintf(chat, sizeof chat, "%s/chat/completions", url);
    code = cli_curl(chat, key, "{\"messages\": [{\"role\": \"user\", \"content\": \"Tell me a story\"}], "
                    "\"max_tokens\": 8}", &body);
    j = cJSON_Parse(body);
    cJSON *msg = cJSON_GetObjectItem(cJSON_GetArrayItem(cJSON_GetObjectItem(j, "choices"), 0), "message");
    int has_content = cJSON_IsString(cJSON_GetObjectItem(msg, "content"));
    if (code != 200 || !has_content) printf("  chat completions with --chat-template chatml (%d): %s\n", code, body);
    cJSON_Delete(j);
    free(body);
    ASSERT_EQ(200, code);
    ASSERT_TRUE(has_content);

    /* The targets: router, both workers and the gateway, each with a
     * /metrics in the Prometheus text format. */
    snprintf(path, sizeof path, "%s/prometheus-targets.json", run_dir);
    f = fopen(path, "r");
    ASSERT_TRUE(f != NULL);
    char text_buf[8192];
    size_t got = fread(text_buf, 1, sizeof text_buf - 1, f);
    fclose(f);
    text_buf[got] = 0;
    cJSON *targets = cJSON_Parse(text_buf);
    if (!cJSON_IsArray(targets)) printf("  %s:\n%s\n", path, text_buf);
    ASSERT_TRUE(cJSON_IsArray(targets));
    ASSERT_EQ(4, cJSON_GetArraySize(targets));
    int jobs[3] = {0, 0, 0};
    for (int i = 0; i < cJSON_GetArraySize(targets); i++) {
        cJSON *t = cJSON_GetArrayItem(targets, i);
        cJSON *addrs = cJSON_GetObjectItem(t, "targets");
        cJSON *job = cJSON_GetObjectItem(cJSON_GetObjectItem(t, "labels"), "job");
        ASSERT_TRUE(cJSON_IsArray(addrs) && cJSON_GetArraySize(addrs) == 1 && cJSON_IsString(job));
        const char *addr = cJSON_GetArrayItem(addrs, 0)->valuestring;
        ASSERT_TRUE(addr && strncmp(addr, "127.0.0.1:", 10) == 0);
        jobs[0] += strcmp(job->valuestring, "llm-router") == 0;
        jobs[1] += strcmp(job->valuestring, "llm-worker") == 0;
        jobs[2] += strcmp(job->valuestring, "llm-gateway") == 0;
        char murl[96];
        snprintf(murl, sizeof murl, "http://%s/metrics", addr);
        code = cli_curl(murl, NULL, NULL, &body);
        int ok = code == 200 && strstr(body, "# TYPE llm_") != NULL;
        if (!ok) printf("  %s (%s): %d\n%.300s\n", murl, job->valuestring, code, body);
        free(body);
        ASSERT_TRUE(ok);
    }
    cJSON_Delete(targets);
    ASSERT_EQ(1, jobs[0]);
    ASSERT_EQ(2, jobs[1]);
    ASSERT_EQ(1, jobs[2]);

    const char *status[] = {CLUSTER_BIN, "status", "--run-dir", run_dir, NULL};
    rc = cli_run(status, &out, &err);
    if (rc != 0 || !strstr(out, url)) printf("  status (%d):\n%s%s", rc, out, err);
    ASSERT_EQ(0, rc);
    ASSERT_TRUE(strstr(out, "gateway ") != NULL && strstr(out, url) != NULL);
    free(out);
    free(err);
    int n_pids = cli_pids(pids, 16);
    ASSERT_EQ(5, n_pids); /* redis, router, 2 workers, gateway */
    const char *down[] = {CLUSTER_BIN, "down", "--run-dir", run_dir, NULL};
    rc = cli_run(down, &out, &err);
    ASSERT_EQ(0, rc);
    ASSERT_TRUE(strstr(out, "stopped gateway") != NULL);
    free(out);
    free(err);
    int64_t end = h_now_ms() + 5000;
    for (int i = 0; i < n_pids; i++) {
        while (cli_alive(pids[i]) && h_now_ms() < end) h_sleep_ms(20);
        if (cli_alive(pids[i])) TEST_FAIL("pid %d still runs after llm-cluster down", (int)pids[i]);
    }
    cli_atexit();
    run_dir[0] = 0;
}

TEST_MAIN(cluster_cli_up_generate_status_down, cluster_cli_worker_dying_while_loading_is_reported,
          cluster_cli_port_taken_is_reported, cluster_cli_http_gateway_and_prometheus_targets)
