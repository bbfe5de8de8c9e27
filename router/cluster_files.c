/* llm-cluster's run dir: its files (env.sh, the endpoint, keys, the API
 * key, prometheus-targets.json), the programs it starts and the model it
 * checks before starting anything. */
#include "router/cluster-impl.h"

#include "common/keys.h"
#include "common/status.h"

#include <dirent.h>
#include <errno.h>
#include <fcntl.h>
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/random.h>
#include <sys/stat.h>
#include <unistd.h>

/* vsnprintf-based formatting: paths and messages here may be cut to fit
 * their buffer (a cut message is still a message; a cut path fails to open). */
void cl_fmt(char *out, size_t size, const char *fmt, ...) {
    va_list ap;
    va_start(ap, fmt);
    vsnprintf(out, size, fmt, ap);
    va_end(ap);
}

/* ---- files ---------------------------------------------------------------- */

int cl_write_file(const char *path, const char *text) {
    int fd = open(path, O_WRONLY | O_CREAT | O_TRUNC | O_CLOEXEC, 0600);
    if (fd < 0) return STATUS_IO;
    /* A file an earlier llm-cluster left readable by others keeps its mode
     * through O_TRUNC: set it. */
    size_t n = strlen(text);
    int ok = fchmod(fd, 0600) == 0 && write(fd, text, n) == (ssize_t)n;
    return close(fd) == 0 && ok ? 0 : STATUS_IO;
}

/* The last non-empty line of a log file into out ("" when none). */
void cl_last_line(const char *path, char *out, size_t size) {
    out[0] = 0;
    FILE *f = fopen(path, "r");
    if (!f) return;
    char line[1024];
    while (fgets(line, sizeof line, f)) {
        size_t n = strlen(line);
        while (n && (line[n - 1] == '\n' || line[n - 1] == '\r')) line[--n] = 0;
        if (n) cl_fmt(out, size, "%s", line);
    }
    fclose(f);
}

int cl_mkdirs(const char *path, char *err, size_t errlen) {
    char tmp[PATH_MAX];
    cl_fmt(tmp, sizeof tmp, "%s", path);
    size_t len = strlen(tmp);
    while (len > 1 && tmp[len - 1] == '/') tmp[--len] = 0;
    for (char *p = tmp + 1;; p++) {
        if (*p == '/' || *p == 0) {
            char c = *p;
            *p = 0;
            /* The run dir holds Redis's append-only file (every prompt and
             * completion), the logs and the keys: for this user only. */
            if (mkdir(tmp, c ? 0755 : 0700) != 0 && errno != EEXIST) {
                cl_fmt(err, errlen, "run dir %s: mkdir %s: %s", path, tmp, strerror(errno));
                return STATUS_IO;
            }
            *p = c;
            if (!c) break;
        }
    }
    return 0;
}

/* Whether name is a file or folder llm-cluster or its Redis writes into a
 * run dir: only those are made private, so that a --run-dir pointed at a
 * folder with other things in it keeps their modes. */
static bool cl_run_file(const char *name) {
    static const char *const exact[] = {"keys", "appendonlydir", "appendonly.aof", "dump.rdb", "redis.conf",
                                        "redis.password", "env.sh", "cluster.env", "endpoint", "http-url",
                                        "api-key", "insecure", "prometheus-targets.json",
                                        "prometheus-targets.json.tmp", "cluster.conf", "scale.lock"};
    for (size_t i = 0; i < sizeof exact / sizeof exact[0]; i++)
        if (strcmp(name, exact[i]) == 0) return true;
    size_t n = strlen(name);
    return (n > 4 && (strcmp(name + n - 4, ".log") == 0 || strcmp(name + n - 4, ".pid") == 0)) ||
           strncmp(name, "temp-", 5) == 0; /* Redis's rewrite files */
}

/* Strips group and other access from the files of dir that match (all,
 * or cl_run_file's) and makes its folders 0700, depth levels down. */
static void cl_private_tree(const char *dir, bool all, int depth) {
    DIR *d = opendir(dir);
    if (!d) return;
    for (struct dirent *e; (e = readdir(d));) {
        if (strcmp(e->d_name, ".") == 0 || strcmp(e->d_name, "..") == 0) continue;
        if (!all && !cl_run_file(e->d_name)) continue;
        char path[PATH_MAX];
        cl_fmt(path, sizeof path, "%s/%s", dir, e->d_name);
        struct stat st;
        if (lstat(path, &st) != 0 || st.st_uid != geteuid()) continue;
        if (S_ISDIR(st.st_mode)) {
            if ((st.st_mode & 077) && chmod(path, 0700) != 0)
                fprintf(stderr, "llm-cluster: chmod 700 %s: %s\n", path, strerror(errno));
            if (depth > 0) cl_private_tree(path, true, depth - 1);
        } else if (S_ISREG(st.st_mode) && (st.st_mode & 077)) {
            if (chmod(path, st.st_mode & 0700) != 0)
                fprintf(stderr, "llm-cluster: chmod go-rwx %s: %s\n", path, strerror(errno));
        }
    }
    closedir(d);
}

void cl_private_dir(const char *dir) {
    struct stat st;
    if (stat(dir, &st) != 0) return;
    if ((st.st_mode & 077) != 0) {
        /* A folder an earlier `up` wrote (it has its Redis config, env.sh
         * or keys) is made private; any other keeps its mode: --run-dir may
         * name a folder that is not llm-cluster's alone. */
        char probe[PATH_MAX];
        bool ours = false;
        static const char *const marks[] = {"redis.conf", "env.sh", "keys"};
        for (size_t i = 0; i < sizeof marks / sizeof marks[0] && !ours; i++) {
            cl_fmt(probe, sizeof probe, "%s/%s", dir, marks[i]);
            ours = access(probe, F_OK) == 0;
        }
        if (ours && st.st_uid == geteuid() && !(st.st_mode & S_ISVTX)) {
            if (chmod(dir, 0700) != 0) fprintf(stderr, "llm-cluster: chmod 700 %s: %s\n", dir, strerror(errno));
        } else {
            fprintf(stderr, "llm-cluster: run dir %s is open to other users (mode %04o); the files llm-cluster "
                    "writes there are private (0600), but a run dir of its own (a new --run-dir) is safer\n", dir,
                    (unsigned)(st.st_mode & 07777));
        }
    }
    cl_private_tree(dir, false, 3);
}

void cl_sh_word(char *out, size_t size, const char *word) {
    bool plain = word[0] != 0;
    for (const char *c = word; *c && plain; c++)
        plain = strchr("ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz0123456789/._-+:@,=%", *c) != NULL;
    if (plain) {
        cl_fmt(out, size, "%s", word);
        return;
    }
    size_t n = 0;
    if (size < 3) {
        if (size) out[0] = 0;
        return;
    }
    out[n++] = '\'';
    for (const char *c = word; *c && n + 6 < size; c++) {
        if (*c == '\'') {
            memcpy(out + n, "'\\''", 4);
            n += 4;
        } else {
            out[n++] = *c;
        }
    }
    out[n++] = '\'';
    out[n] = 0;
}

/* A program next to this one (an installed bin/), else in the build tree's
 * folder for it (build/router/llm-cluster -> build/worker/llm-worker). */
int cl_find_sibling(const char *name, const char *folder, char *out, size_t size, char *err,
                    size_t errlen) {
    char self[PATH_MAX];
    ssize_t n = readlink("/proc/self/exe", self, sizeof self - 1);
    if (n <= 0) {
        cl_fmt(err, errlen, "/proc/self/exe: %s", strerror(errno));
        return STATUS_IO;
    }
    self[n] = 0;
    char *slash = strrchr(self, '/');
    if (slash) *slash = 0;
    cl_fmt(out, size, "%s/%s", self, name);
    if (access(out, X_OK) == 0) return 0;
    cl_fmt(out, size, "%s/../%s/%s", self, folder, name);
    if (access(out, X_OK) == 0) return 0;
    cl_fmt(err, errlen, "%s not found next to %s or in %s/../%s (build it first)", name, self, self, folder);
    return STATUS_NOT_FOUND;
}

/* redis-server from $LLM_REDIS_SERVER or PATH. */
int cl_find_redis(char *out, size_t size, char *err, size_t errlen) {
    const char *env = getenv("LLM_REDIS_SERVER");
    if (env && *env) {
        cl_fmt(out, size, "%s", env);
        if (access(out, X_OK) == 0) return 0;
        cl_fmt(err, errlen, "LLM_REDIS_SERVER=%s is not an executable", env);
        return STATUS_NOT_FOUND;
    }
    const char *path = getenv("PATH");
    if (!path) path = "/usr/bin:/bin";
    for (const char *p = path; *p;) {
        const char *e = strchr(p, ':');
        size_t len = e ? (size_t)(e - p) : strlen(p);
        cl_fmt(out, size, "%.*s/redis-server", (int)len, p);
        if (len && access(out, X_OK) == 0) return 0;
        p += len + (e ? 1 : 0);
    }
    cl_fmt(err, errlen, "redis-server not found in PATH (install redis-server, set LLM_REDIS_SERVER, "
             "or give --redis URL)");
    return STATUS_NOT_FOUND;
}

int cl_check_model(const char *path, char *err, size_t errlen) {
    struct stat st;
    if (stat(path, &st) != 0) {
        cl_fmt(err, errlen, "--model %s: %s", path, strerror(errno));
        return STATUS_NOT_FOUND;
    }
    if (S_ISDIR(st.st_mode)) {
        char cfg[PATH_MAX + 16];
        cl_fmt(cfg, sizeof cfg, "%s/config.json", path);
        if (access(cfg, R_OK) != 0) {
            cl_fmt(err, errlen, "--model %s: a directory without a readable config.json (%s)", path,
                     strerror(errno));
            return STATUS_NOT_FOUND;
        }
        return 0;
    }
    int fd = open(path, O_RDONLY);
    char magic[4];
    if (fd < 0) {
        cl_fmt(err, errlen, "--model %s: %s", path, strerror(errno));
        return STATUS_IO;
    }
    ssize_t n = read(fd, magic, 4);
    close(fd);
    if (n != 4 || memcmp(magic, "GGUF", 4) != 0) {
        cl_fmt(err, errlen, "--model %s: not a GGUF file (no GGUF magic in its first 4 bytes)", path);
        return STATUS_BAD_INPUT;
    }
    return 0;
}

/* The key files of a run dir (docs/security.md). */
void cl_key_path(char *out, size_t size, const char *dir, const char *which) {
    cl_fmt(out, size, "%s/keys/%s", dir, which);
}

/* dir/NAME.key and .pub: kept when there from an earlier `up` in this run
 * dir (a client may hold them), else made now. */
static int cl_key_ensure(const char *dir, const char *name, char *err, size_t errlen) {
    char path[PATH_MAX + 80];
    cl_fmt(path, sizeof path, "%s/%s.key", dir, name);
    struct keys_pair kp;
    if (access(path, F_OK) == 0) return keys_pair_load(path, &kp, err, errlen);
    int rc = keys_pair_generate(&kp, err, errlen);
    if (rc == 0) rc = keys_pair_write(dir, name, &kp, err, errlen);
    memset(&kp, 0, sizeof kp);
    return rc;
}

int cl_worker_key_ensure(const char *dir, const char *name, char *err, size_t errlen) {
    char sub[PATH_MAX + 48];
    cl_fmt(sub, sizeof sub, "%s/keys/workers", dir);
    return cl_key_ensure(sub, name, err, errlen);
}

/* Keys for the router, one client (env.sh's), llm-cluster's admin key
 * (keys/admin/cluster.key) and each worker. */
int cl_make_keys(struct cl_up *u, char *err, size_t errlen) {
    char dir[PATH_MAX + 32], sub[PATH_MAX + 48];
    cl_fmt(dir, sizeof dir, "%s/keys", u->dir);
    if (mkdir(dir, 0700) != 0 && errno != EEXIST) {
        cl_fmt(err, errlen, "%s: %s", dir, strerror(errno));
        return STATUS_IO;
    }
    int rc = cl_key_ensure(dir, "router", err, errlen);
    cl_fmt(sub, sizeof sub, "%s/clients", dir);
    if (rc == 0) rc = cl_key_ensure(sub, "client", err, errlen);
    if (rc == 0 && u->http_port > 0) rc = cl_key_ensure(sub, "gateway", err, errlen);
    /* llm-cluster's own admin key (scale drains pipelines with it). */
    cl_fmt(sub, sizeof sub, "%s/admin", dir);
    if (rc == 0) rc = cl_key_ensure(sub, "cluster", err, errlen);
    cl_fmt(sub, sizeof sub, "%s/workers", dir);
    for (int p = 0; rc == 0 && p < u->pipelines; p++) {
        for (int s = 0; rc == 0 && s < u->stages; s++) {
            char name[64];
            cl_fmt(name, sizeof name, "worker-p%d-s%d", p, s);
            rc = cl_key_ensure(sub, name, err, errlen);
        }
    }
    return rc;
}

/* The client settings of a run dir into cfg: its client key, or insecure
 * when `up` ran with --insecure.  Paths go into the two buffers. */
void cl_client_keys(const char *dir, struct llm_client_config *cfg, char *key, char *router,
                    size_t size) {
    char marker[PATH_MAX + 32];
    cl_fmt(marker, sizeof marker, "%s/insecure", dir);
    if (access(marker, F_OK) == 0) {
        cfg->insecure = true;
        return;
    }
    cl_key_path(key, size, dir, "clients/client.key");
    cl_key_path(router, size, dir, "router.pub");
    cfg->curve_key_file = key;
    cfg->router_key_file = router;
}

/* Appends "export NAME='value'\n" to text, the value quoted for sh. */
static void cl_export(char *text, size_t size, const char *name, const char *value) {
    size_t n = strlen(text);
    n += (size_t)snprintf(text + n, n < size ? size - n : 0, "export %s='", name);
    for (const char *v = value; *v && n + 5 < size; v++) {
        if (*v == '\'') n += (size_t)snprintf(text + n, size - n, "'\\''");
        else text[n++] = *v;
    }
    snprintf(text + (n < size ? n : size - 1), n < size ? size - n : 1, "'\n");
}

/* The folder of program path, resolved ("build/router/../worker/llm-worker"
 * -> "/abs/build/worker"), into out; "" when it cannot be. */
static void cl_bin_dir(const char *program, char *out, size_t size) {
    char real[PATH_MAX];
    out[0] = 0;
    if (!program[0] || !realpath(program, real)) return;
    char *slash = strrchr(real, '/');
    if (slash) *slash = 0;
    cl_fmt(out, size, "%s", real);
}

/* Appends to text the lines that put the folders of the programs `up`
 * started, its own (llm-cluster) and llm's (clients/c/ in a build tree),
 * first on PATH, each once however often env.sh is sourced: the line `up`
 * prints after "try:" runs as printed. */
static void cl_env_path(struct cl_up *u, char *text, size_t size) {
    char dirs[5][PATH_MAX], self[PATH_MAX], llm[PATH_MAX], gateway[PATH_MAX] = "", e[256];
    ssize_t got = readlink("/proc/self/exe", self, sizeof self - 1);
    self[got > 0 ? got : 0] = 0;
    if (cl_find_sibling("llm", "clients/c", llm, sizeof llm, e, sizeof e) < 0) llm[0] = 0;
    if (u->bin_gateway[0]) cl_fmt(gateway, sizeof gateway, "%s", u->bin_gateway);
    else if (cl_find_sibling("llm-gateway", "gateway", gateway, sizeof gateway, e, sizeof e) < 0) gateway[0] = 0;
    const char *programs[] = {self, llm, u->bin_router, u->bin_worker, gateway};
    int n = 0;
    for (size_t i = 0; i < sizeof programs / sizeof programs[0]; i++) {
        cl_bin_dir(programs[i], dirs[n], sizeof dirs[n]);
        bool seen = !dirs[n][0];
        for (int j = 0; j < n && !seen; j++) seen = strcmp(dirs[j], dirs[n]) == 0;
        if (!seen) n++;
    }
    size_t len = strlen(text);
    cl_fmt(text + len, size - len, "# The programs of the build llm-cluster came from: llm, llm-cluster, llm-run, ...\n"
           "for llm_bin_dir in");
    for (int i = n - 1; i >= 0; i--) { /* prepended in turn: the first ends up first */
        char word[PATH_MAX + 64];
        cl_sh_word(word, sizeof word, dirs[i]);
        len = strlen(text);
        cl_fmt(text + len, size - len, " %s", word);
    }
    len = strlen(text);
    cl_fmt(text + len, size - len, "; do\n"
           "    case \":$PATH:\" in *\":$llm_bin_dir:\"*) ;; *) PATH=\"$llm_bin_dir${PATH:+:$PATH}\" ;; esac\n"
           "done\n"
           "unset llm_bin_dir\n"
           "export PATH\n");
}

/* RUN_DIR/env.sh: sourced, it points llm and any libllmclient program at
 * this cluster with its client key, and puts the programs on PATH. */
int cl_write_env(struct cl_up *u) {
    char path[PATH_MAX + 32], key[PATH_MAX + 64], text[8 * PATH_MAX], word[PATH_MAX + 64];
    cl_sh_word(word, sizeof word, u->dir);
    cl_fmt(text, sizeof text, "# llm-cluster up: . %s/env.sh\n", word);
    cl_env_path(u, text, sizeof text);
    cl_export(text, sizeof text, "LLM_ROUTER", u->endpoints);
    cl_export(text, sizeof text, "LLM_REDIS", u->redis_url);
    if (u->insecure) {
        cl_export(text, sizeof text, "LLM_INSECURE", "true");
        size_t n = strlen(text);
        cl_fmt(text + n, sizeof text - n, "unset LLM_CURVE_KEY_FILE LLM_ROUTER_KEY\n");
    } else {
        cl_key_path(key, sizeof key, u->dir, "clients/client.key");
        cl_export(text, sizeof text, "LLM_CURVE_KEY_FILE", key);
        cl_key_path(key, sizeof key, u->dir, "router.pub");
        cl_export(text, sizeof text, "LLM_ROUTER_KEY", key);
        size_t n = strlen(text);
        cl_fmt(text + n, sizeof text - n, "unset LLM_INSECURE\n");
    }
    if (u->http_url[0]) {
        /* What the openai SDKs read, so that a sourced env.sh points them
         * here too. */
        cl_export(text, sizeof text, "OPENAI_BASE_URL", u->http_url);
        if (!u->api_keys_file || !u->api_keys_file[0]) {
            char kp[PATH_MAX + 32], k[128] = "";
            cl_fmt(kp, sizeof kp, "%s/api-key", u->dir);
            cl_last_line(kp, k, sizeof k);
            if (k[0]) cl_export(text, sizeof text, "OPENAI_API_KEY", k);
        }
    }
    cl_fmt(path, sizeof path, "%s/env.sh", u->dir);
    int rc = cl_write_file(path, text);
    /* It names the Redis password: for this user only. */
    if (rc == 0 && chmod(path, 0600) != 0) rc = STATUS_IO;
    return rc;
}

/* RUN_DIR/api-key: kept when there from an earlier `up` (a client may hold
 * it), else a fresh random one, readable by this user only. */
int cl_api_key_ensure(const char *path, char *err, size_t errlen) {
    if (access(path, F_OK) == 0) return 0;
    uint8_t raw[24];
    if (getrandom(raw, sizeof raw, 0) != (ssize_t)sizeof raw) {
        cl_fmt(err, errlen, "getrandom: %s", strerror(errno));
        return STATUS_IO;
    }
    char text[8 + 2 * sizeof raw + 2] = "llm-";
    for (size_t i = 0; i < sizeof raw; i++) cl_fmt(text + 4 + 2 * i, 3, "%02x", raw[i]);
    strcat(text, "\n");
    int fd = open(path, O_WRONLY | O_CREAT | O_EXCL | O_CLOEXEC, 0600);
    if (fd < 0 || write(fd, text, strlen(text)) != (ssize_t)strlen(text)) {
        cl_fmt(err, errlen, "%s: %s", path, strerror(errno));
        if (fd >= 0) close(fd);
        return STATUS_IO;
    }
    close(fd);
    return 0;
}

/* RUN_DIR/prometheus-targets.json in Prometheus' file_sd format: each
 * process's metrics address with its job (llm-router, llm-worker,
 * llm-gateway) and its name in the run dir as the "process" label. */
int cl_write_targets(struct cl_up *u, char *err, size_t errlen) {
    char path[PATH_MAX + 48], tmp[PATH_MAX + 56];
    cl_fmt(path, sizeof path, "%s/prometheus-targets.json", u->dir);
    cl_fmt(tmp, sizeof tmp, "%s.tmp", path);
    FILE *f = fopen(tmp, "w");
    if (!f) {
        cl_fmt(err, errlen, "%s: %s", tmp, strerror(errno));
        return STATUS_IO;
    }
    fputs("[", f);
    int written = 0;
    for (int i = 0; i < u->n_procs; i++) {
        const struct cl_proc *p = &u->procs[i];
        if (p->metrics_port <= 0) continue;
        fprintf(f, "%s\n  {\"targets\": [\"127.0.0.1:%d\"], \"labels\": {\"job\": \"%s\", \"process\": \"%s\"}}",
                written++ ? "," : "", p->metrics_port, p->program, p->name);
    }
    fputs("\n]\n", f);
    /* Renamed into place: Prometheus rereads the file when it changes and
     * must never see half of it. */
    if (fclose(f) != 0 || rename(tmp, path) != 0) {
        cl_fmt(err, errlen, "%s: %s", path, strerror(errno));
        unlink(tmp);
        return STATUS_IO;
    }
    return 0;
}

int cl_read_targets(const char *dir, struct cl_proc *out, int max) {
    char path[PATH_MAX + 48], line[512];
    cl_fmt(path, sizeof path, "%s/prometheus-targets.json", dir);
    FILE *f = fopen(path, "r");
    if (!f) return -1;
    int n = 0;
    /* The file is cl_write_targets' own: one target a line. */
    while (n < max && fgets(line, sizeof line, f)) {
        struct cl_proc *p = &out[n];
        memset(p, 0, sizeof *p);
        if (sscanf(line, " {\"targets\": [\"127.0.0.1:%d\"], \"labels\": {\"job\": \"%31[^\"]\", \"process\": "
                   "\"%63[^\"]\"}}", &p->metrics_port, p->program, p->name) == 3)
            n++;
    }
    fclose(f);
    return n;
}

/* ---- cluster.conf ----------------------------------------------------------- */

/* One "key=value" line; a value never holds a newline (the options that
 * could are refused by cl_conf_write). */
static void cl_conf_line(FILE *f, const char *key, const char *value) {
    fprintf(f, "%s=%s\n", key, value ? value : "");
}

int cl_conf_write(const struct cl_up *u, char *err, size_t errlen) {
    char path[PATH_MAX + 32], model[PATH_MAX], num[32];
    const char *strs[] = {u->worker_args, u->redis_plain, u->worker_eps, u->model};
    for (size_t i = 0; i < sizeof strs / sizeof strs[0]; i++)
        if (strs[i] && strpbrk(strs[i], "\r\n")) {
            cl_fmt(err, errlen, "\"%s\": a line break in a setting", strs[i]);
            return STATUS_BAD_INPUT;
        }
    /* Absolute: `scale` may run from another folder than `up` did. */
    if (!realpath(u->model, model)) cl_fmt(model, sizeof model, "%s", u->model);
    cl_fmt(path, sizeof path, "%s/cluster.conf", u->dir);
    int fd = open(path, O_WRONLY | O_CREAT | O_TRUNC | O_CLOEXEC, 0600);
    FILE *f = fd >= 0 && fchmod(fd, 0600) == 0 ? fdopen(fd, "w") : NULL;
    if (!f) {
        cl_fmt(err, errlen, "%s: %s", path, strerror(errno));
        if (fd >= 0) close(fd);
        return STATUS_IO;
    }
    fputs("# llm-cluster up's settings: llm-cluster scale starts workers as up did\n", f);
    cl_conf_line(f, "model", model);
    cl_fmt(num, sizeof num, "%d", u->stages);
    cl_conf_line(f, "stages", num);
    cl_conf_line(f, "device", u->device);
    cl_fmt(num, sizeof num, "%d", u->threads);
    cl_conf_line(f, "threads", num);
    cl_fmt(num, sizeof num, "%d", u->kv_blocks);
    cl_conf_line(f, "kv_blocks", num);
    cl_conf_line(f, "log_level", u->log_level);
    cl_conf_line(f, "worker_args", u->worker_args);
    cl_conf_line(f, "insecure", u->insecure ? "1" : "0");
    cl_conf_line(f, "redis", u->redis_plain);
    cl_conf_line(f, "redis_password_file", u->redis_pwfile);
    cl_conf_line(f, "worker_endpoints", u->worker_eps);
    if (fclose(f) != 0) {
        cl_fmt(err, errlen, "%s: %s", path, strerror(errno));
        return STATUS_IO;
    }
    return 0;
}

/* A whole decimal in [lo, hi] into *out. */
static bool cl_conf_int(const char *v, int lo, int hi, int *out) {
    char *end;
    errno = 0;
    long x = strtol(v, &end, 10);
    if (errno || end == v || *end || x < lo || x > hi) return false;
    *out = (int)x;
    return true;
}

int cl_conf_read(struct cl_up *u, char *err, size_t errlen) {
    char path[PATH_MAX + 32], line[4 * PATH_MAX];
    cl_fmt(path, sizeof path, "%s/cluster.conf", u->dir);
    FILE *f = fopen(path, "r");
    if (!f) {
        cl_fmt(err, errlen, "%s: %s (a run dir that llm-cluster up started and finished writes it)", path,
               strerror(errno));
        return STATUS_NOT_FOUND;
    }
    int lineno = 0, seen = 0, insecure = 0;
    u->stages = 0;
    while (fgets(line, sizeof line, f)) {
        lineno++;
        line[strcspn(line, "\r\n")] = 0;
        if (!line[0] || line[0] == '#') continue;
        char *eq = strchr(line, '=');
        if (!eq) {
            cl_fmt(err, errlen, "%s:%d: \"%.80s\" is not key=value", path, lineno, line);
            fclose(f);
            return STATUS_BAD_INPUT;
        }
        *eq = 0;
        const char *k = line, *v = eq + 1;
        bool ok = true;
        char *str = NULL; /* a string setting's buffer */
        size_t size = 0;
        if (strcmp(k, "model") == 0) str = u->saved[0], size = sizeof u->saved[0], seen |= 1;
        else if (strcmp(k, "device") == 0) str = u->saved[1], size = sizeof u->saved[1];
        else if (strcmp(k, "log_level") == 0) str = u->saved[2], size = sizeof u->saved[2];
        else if (strcmp(k, "worker_args") == 0) str = u->saved[3], size = sizeof u->saved[3];
        else if (strcmp(k, "redis") == 0) str = u->redis_plain, size = sizeof u->redis_plain, seen |= 4;
        else if (strcmp(k, "redis_password_file") == 0) str = u->redis_pwfile, size = sizeof u->redis_pwfile;
        else if (strcmp(k, "worker_endpoints") == 0) str = u->worker_eps, size = sizeof u->worker_eps, seen |= 8;
        else if (strcmp(k, "stages") == 0) ok = cl_conf_int(v, 1, 64, &u->stages), seen |= 2;
        else if (strcmp(k, "threads") == 0) ok = cl_conf_int(v, 0, 1024, &u->threads);
        else if (strcmp(k, "kv_blocks") == 0) ok = cl_conf_int(v, 0, 1 << 24, &u->kv_blocks);
        else if (strcmp(k, "insecure") == 0) ok = cl_conf_int(v, 0, 1, &insecure);
        if (str) cl_fmt(str, size, "%s", v);
        /* Keys a later llm-cluster may add are skipped. */
        if (!ok) {
            cl_fmt(err, errlen, "%s:%d: %s=%s: not a number in range", path, lineno, k, v);
            fclose(f);
            return STATUS_BAD_INPUT;
        }
    }
    fclose(f);
    if (seen != 15) {
        cl_fmt(err, errlen, "%s: missing %s", path,
               !(seen & 1) ? "model" : !(seen & 2) ? "stages" : !(seen & 4) ? "redis" : "worker_endpoints");
        return STATUS_BAD_INPUT;
    }
    u->model = u->saved[0];
    u->device = u->saved[1][0] ? u->saved[1] : "auto";
    u->log_level = u->saved[2][0] ? u->saved[2] : "info";
    u->worker_args = u->saved[3];
    u->insecure = insecure != 0;
    cl_key_path(u->pub_router, sizeof u->pub_router, u->dir, "router.pub");
    return 0;
}
