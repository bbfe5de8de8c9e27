/* bench_cluster's private clusters: llm-cluster up and down run as child
 * processes (their logs, run dirs and retries), the client keys each cluster
 * makes, and its workers' metrics ports, read from their logs and scraped
 * around each level.  cb_layout starts one layout, measures it (cb_levels,
 * cluster_load.c) and stops it. */
#include "bench/cluster_bench.h"

#include "common/status.h"

#include <errno.h>
#include <fcntl.h>
#include <ftw.h>
#include <limits.h>
#include <signal.h>
#include <spawn.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <sys/wait.h>
#include <unistd.h>

#include <arpa/inet.h>
#include <netinet/in.h>
#include <sys/socket.h>
#include <sys/time.h>

extern char **environ;

/* ---- Files and child processes ---- */

static int cb_rm_entry(const char *path, const struct stat *st, int flag, struct FTW *ftw) {
    (void)st;
    (void)flag;
    (void)ftw;
    return remove(path) == 0 || errno == ENOENT ? 0 : -1;
}

void cb_rmtree(const char *dir) {
    nftw(dir, cb_rm_entry, 16, FTW_DEPTH | FTW_PHYS);
}

/* Prints the last n lines of path to stderr, indented. */
static void cb_print_tail(const char *path, int n) {
    FILE *f = fopen(path, "r");
    if (!f) return;
    char ring[8][512];
    int count = 0;
    if (n > 8) n = 8;
    while (fgets(ring[count % n], sizeof ring[0], f)) count++;
    fclose(f);
    fprintf(stderr, "  --- %s (last %d of %d lines)\n", path, count < n ? count : n, count);
    for (int i = count > n ? count - n : 0; i < count; i++) {
        const char *line = ring[i % n];
        fprintf(stderr, "  %s%s", line, line[strlen(line) - 1] == '\n' ? "" : "\n");
    }
}

/* The tails of every *.log of a run dir: what the router and workers said. */
void cb_print_log_tails(const char *dir) {
    static const char *const names[] = {"cluster-up.log", "router.log", "redis.log", NULL};
    char path[PATH_MAX + 64];
    for (int i = 0; names[i]; i++) {
        cb_fmt(path, sizeof path, "%s/%s", dir, names[i]);
        cb_print_tail(path, 6);
    }
    for (int p = 0; p < 64; p++)
        for (int s = 0; s < 64; s++) {
            cb_fmt(path, sizeof path, "%s/worker-p%d-s%d.log", dir, p, s);
            if (access(path, R_OK) != 0) {
                if (s == 0) return;
                break;
            }
            cb_print_tail(path, 6);
        }
}

/* Runs argv with stdout and stderr appended to log_path and waits for it,
 * at most timeout_s; a signal to this program sends it SIGTERM.  envp: its
 * environment (NULL: this program's).  Returns its exit status (0..255), or
 * a negative status with err saying why. */
static int cb_run(char *const argv[], char *const envp[], const char *log_path, int timeout_s, char *err,
                  size_t errlen) {
    posix_spawn_file_actions_t fa;
    posix_spawn_file_actions_init(&fa);
    posix_spawn_file_actions_addopen(&fa, 0, "/dev/null", O_RDONLY, 0);
    posix_spawn_file_actions_addopen(&fa, 1, log_path, O_WRONLY | O_CREAT | O_APPEND, 0644);
    posix_spawn_file_actions_adddup2(&fa, 1, 2);
    pid_t pid;
    int rc = posix_spawn(&pid, argv[0], &fa, NULL, argv, envp ? envp : environ);
    posix_spawn_file_actions_destroy(&fa);
    if (rc != 0) {
        cb_fmt(err, errlen, "cannot run %s: %s", argv[0], strerror(rc));
        return STATUS_IO;
    }
    double end = cb_now() + timeout_s;
    bool termed = false;
    for (;;) {
        int ws;
        pid_t w = waitpid(pid, &ws, WNOHANG);
        if (w == pid) {
            if (WIFEXITED(ws)) return WEXITSTATUS(ws);
            cb_fmt(err, errlen, "%s %s was killed by signal %d (log: %s)", argv[0], argv[1],
                     WIFSIGNALED(ws) ? WTERMSIG(ws) : 0, log_path);
            return STATUS_INTERNAL;
        }
        if (w < 0 && errno != EINTR) {
            cb_fmt(err, errlen, "waitpid %s: %s", argv[0], strerror(errno));
            return STATUS_IO;
        }
        if (!termed && (cb_stop || cb_now() > end)) {
            kill(pid, SIGTERM);
            termed = true;
            end = cb_now() + 10;
        } else if (termed && cb_now() > end) {
            kill(pid, SIGKILL);
        }
        cb_sleep_ms(50);
    }
}

/* llm-cluster next to this program (an installed bin/) or in the build
 * tree (build/bench/bench_cluster -> build/router/llm-cluster). */
int cb_find_cluster(char *out, size_t size, char *err, size_t errlen) {
    char self[PATH_MAX];
    ssize_t n = readlink("/proc/self/exe", self, sizeof self - 1);
    if (n <= 0) {
        cb_fmt(err, errlen, "/proc/self/exe: %s", strerror(errno));
        return STATUS_IO;
    }
    self[n] = 0;
    char *slash = strrchr(self, '/');
    if (slash) *slash = 0;
    cb_fmt(out, size, "%s/llm-cluster", self);
    if (access(out, X_OK) == 0) return 0;
    cb_fmt(out, size, "%s/../router/llm-cluster", self);
    if (access(out, X_OK) == 0) return 0;
    cb_fmt(err, errlen, "llm-cluster not found next to %s or in %s/../router (build it, or give --cluster PATH)",
             self, self);
    return STATUS_NOT_FOUND;
}

/* ---- Keys ---- */

/* llm-cluster up makes CURVE keys for the router, one client and every
 * worker in RUN_DIR/keys, or, run with --insecure, leaves the marker
 * RUN_DIR/insecure.  The bench's clients take theirs from the environment
 * as env.sh would set it; the variables this program started with are put
 * back before llm-cluster runs again (llm-cluster up reads LLM_INSECURE). */
static const char *const cb_key_vars[] = {"LLM_CURVE_KEY_FILE", "LLM_ROUTER_KEY", "LLM_INSECURE"};
static char *cb_key_vars_saved[3];
static bool cb_key_vars_had[3];

void cb_keys_save(void) {
    for (int i = 0; i < 3; i++) {
        const char *v = getenv(cb_key_vars[i]);
        cb_key_vars_had[i] = v != NULL;
        cb_key_vars_saved[i] = v ? strdup(v) : NULL;
    }
}

static void cb_keys_restore(void) {
    for (int i = 0; i < 3; i++) {
        if (cb_key_vars_had[i] && cb_key_vars_saved[i]) setenv(cb_key_vars[i], cb_key_vars_saved[i], 1);
        else unsetenv(cb_key_vars[i]);
    }
}

/* The client settings of the cluster in dir.  Called with no client thread
 * running (setenv is not thread-safe). */
static void cb_keys_use(const char *dir) {
    char path[PATH_MAX + 64];
    cb_fmt(path, sizeof path, "%s/insecure", dir);
    if (access(path, F_OK) == 0) {
        setenv("LLM_INSECURE", "true", 1);
        unsetenv("LLM_CURVE_KEY_FILE");
        unsetenv("LLM_ROUTER_KEY");
        return;
    }
    cb_fmt(path, sizeof path, "%s/keys/clients/client.key", dir);
    setenv("LLM_CURVE_KEY_FILE", path, 1);
    cb_fmt(path, sizeof path, "%s/keys/router.pub", dir);
    setenv("LLM_ROUTER_KEY", path, 1);
    unsetenv("LLM_INSECURE");
}

/* ---- The workers' metrics ports ---- */

/* The port a process logged for its metrics ("metrics on http://HOST:PORT
 * (port N)"): the clusters run with LLM_METRICS_LISTEN=127.0.0.1:0, so
 * that every process picks a free port and says which.  0: none logged. */
static int cb_log_metrics_port(const char *log_path) {
    FILE *f = fopen(log_path, "r");
    if (!f) return 0;
    char line[1024];
    int port = 0;
    while (fgets(line, sizeof line, f)) {
        const char *m = strstr(line, "metrics on http://");
        const char *q = m ? strstr(m, "(port ") : NULL;
        if (q) port = atoi(q + 6);
    }
    fclose(f);
    return port > 0 && port < 65536 ? port : 0;
}

/* The body of GET /metrics from 127.0.0.1:port into buf, NUL-terminated
 * (cut at size).  Returns 0, or -1 when there is no answer or no 200 within
 * 2 s. */
static int cb_http_metrics(int port, char *buf, size_t size) {
    int fd = socket(AF_INET, SOCK_STREAM | SOCK_CLOEXEC, 0);
    if (fd < 0) return -1;
    struct timeval tv = {2, 0};
    setsockopt(fd, SOL_SOCKET, SO_RCVTIMEO, &tv, sizeof tv);
    setsockopt(fd, SOL_SOCKET, SO_SNDTIMEO, &tv, sizeof tv);
    struct sockaddr_in a;
    memset(&a, 0, sizeof a);
    a.sin_family = AF_INET;
    a.sin_port = htons((uint16_t)port);
    a.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
    static const char req[] = "GET /metrics HTTP/1.0\r\nHost: 127.0.0.1\r\n\r\n";
    if (connect(fd, (struct sockaddr *)&a, sizeof a) != 0 || write(fd, req, sizeof req - 1) != (ssize_t)(sizeof req - 1)) {
        close(fd);
        return -1;
    }
    size_t n = 0;
    ssize_t got;
    while (n + 1 < size && (got = read(fd, buf + n, size - 1 - n)) > 0) n += (size_t)got;
    close(fd);
    buf[n] = 0;
    const char *body = strstr(buf, "\r\n\r\n");
    if (strncmp(buf, "HTTP/1.", 7) != 0 || n < 12 || atoi(buf + 9) != 200 || !body) return -1;
    memmove(buf, body + 4, strlen(body + 4) + 1);
    return 0;
}

/* Sum over the series of one metric in Prometheus text (name, or name{...}),
 * or -1 when the text has none. */
static double cb_metric_sum(const char *text, const char *name) {
    size_t len = strlen(name);
    double sum = 0;
    bool found = false;
    for (const char *l = text; l && *l; l = strchr(l, '\n'), l = l ? l + 1 : NULL) {
        if (strncmp(l, name, len) != 0 || (l[len] != ' ' && l[len] != '{')) continue;
        const char *v = l + len;
        if (*v == '{') {
            const char *end = strchr(v, '}'), *nl = strchr(v, '\n');
            if (!end || (nl && end > nl)) continue;
            v = end + 1;
        }
        char *e = NULL;
        double x = strtod(v, &e);
        if (e == v) continue;
        sum += x;
        found = true;
    }
    return found ? sum : -1;
}

static void cb_cluster_ports(struct cb_cluster *cl) {
    const struct cb_layout *l = cl->lay;
    cl->n_workers = l->pipelines * l->stages <= CB_WORKERS_MAX ? l->pipelines * l->stages : 0;
    int missing = 0;
    for (int w = 0; w < cl->n_workers; w++) {
        char path[PATH_MAX + 64];
        cb_fmt(path, sizeof path, "%s/worker-p%d-s%d.log", cl->dir, w / l->stages, w % l->stages);
        cl->ports[w] = cb_log_metrics_port(path);
        missing += cl->ports[w] == 0;
    }
    if (missing || !cl->n_workers)
        fprintf(stderr, "bench_cluster: %s: %d of %d workers logged no metrics port (--log-level above info, or "
                "more than %d workers): their busy fractions are not measured\n", l->name,
                cl->n_workers ? missing : l->pipelines * l->stages, l->pipelines * l->stages, CB_WORKERS_MAX);
}

void cb_cluster_scrape(const struct cb_cluster *cl, struct cb_wm *wm) {
    static char buf[1 << 18];
    for (int w = 0; w < cl->n_workers; w++) {
        wm[w].step_s = wm[w].rows = -1;
        if (cl->ports[w] && cb_http_metrics(cl->ports[w], buf, sizeof buf) == 0) {
            wm[w].step_s = cb_metric_sum(buf, "llm_step_time_seconds_sum");
            wm[w].rows = cb_metric_sum(buf, "llm_stage_tokens_total");
        }
    }
}

/* ---- One cluster layout ---- */

/* llm-cluster down on a run dir, to its end even after a stop signal. */
static void cb_down(const char *cluster, const char *dir) {
    char down_log[PATH_MAX + 32], err[256];
    cb_fmt(down_log, sizeof down_log, "%s/cluster-down.log", dir);
    char *down[] = {(char *)cluster, "down", "--run-dir", (char *)dir, NULL};
    sig_atomic_t stop = cb_stop;
    cb_stop = 0;
    cb_keys_restore();
    int rc = cb_run(down, NULL, down_log, 60, err, sizeof err);
    cb_stop = cb_stop || stop;
    if (rc != 0)
        fprintf(stderr, "bench_cluster: llm-cluster down --run-dir %s: %s\n", dir,
                rc < 0 ? err : "non-zero exit status (see cluster-down.log)");
}

/* The environment of llm-cluster up, which its router and workers inherit:
 * this program's, with every metrics port on a free loopback port (the
 * processes log which: cb_log_metrics_port) and, for a sockets layout,
 * NCCL without peer-to-peer and shared-memory transports, as between two
 * hosts.  A NULL-terminated array the caller frees (the strings are
 * environ's or static). */
static char **cb_up_env(const struct cb_layout *lay) {
    static char metrics[] = "LLM_METRICS_LISTEN=127.0.0.1:0";
    static char p2p[] = "NCCL_P2P_DISABLE=1", shm[] = "NCCL_SHM_DISABLE=1";
    char *add[3] = {metrics, lay->sockets ? p2p : NULL, lay->sockets ? shm : NULL};
    size_t n = 0;
    while (environ[n]) n++;
    char **env = malloc((n + 4) * sizeof *env);
    if (!env) return NULL;
    size_t k = 0;
    for (size_t i = 0; i < n; i++) {
        bool replaced = false;
        for (int a = 0; a < 3; a++) {
            if (!add[a]) continue;
            size_t len = (size_t)(strchr(add[a], '=') - add[a]) + 1;
            replaced = replaced || strncmp(environ[i], add[a], len) == 0;
        }
        if (!replaced) env[k++] = environ[i];
    }
    for (int a = 0; a < 3; a++)
        if (add[a]) env[k++] = add[a];
    env[k] = NULL;
    return env;
}

/* Starts a cluster of the layout in run_root/NAME, measures it and stops it. */
int cb_layout(const struct cb_opts *o, const char *cluster, const char *model, const char *run_root,
                     const struct cb_layout *lay, char *err, size_t errlen) {
    char dir[PATH_MAX], log_path[PATH_MAX + 32];
    cb_fmt(dir, sizeof dir, "%s/%s%s", run_root, lay->name, lay->cache < 0 ? "" : lay->cache ? "-cache" : "-nocache");
    if (mkdir(dir, 0755) != 0 && errno != EEXIST) {
        cb_fmt(err, errlen, "run dir %s: %s", dir, strerror(errno));
        return STATUS_IO;
    }
    cb_fmt(log_path, sizeof log_path, "%s/cluster-up.log", dir);
    char p_s[16], s_s[16], t_s[16], kv_s[16], to_s[16], router_args[1024];
    cb_fmt(p_s, sizeof p_s, "%d", lay->pipelines);
    cb_fmt(s_s, sizeof s_s, "%d", lay->stages);
    cb_fmt(t_s, sizeof t_s, "%d", o->threads);
    cb_fmt(kv_s, sizeof kv_s, "%d", o->kv_blocks);
    cb_fmt(to_s, sizeof to_s, "%d", o->up_timeout_s);
    cb_fmt(router_args, sizeof router_args, "%s%s%s", o->router_args,
           lay->cache == 0 && o->router_args[0] ? " " : "", lay->cache == 0 ? o->no_cache_arg : "");
    char *up[32] = {(char *)cluster, "up", "--model", (char *)model, "--pipelines", p_s, "--stages", s_s,
                    "--run-dir", dir, "--port", "0", "--device", (char *)o->device, "--threads", t_s,
                    "--kv-blocks", kv_s, "--timeout-s", to_s, "--log-level", (char *)o->log_level,
                    "--router-args", router_args, "--worker-args", (char *)o->worker_args};
    int n_up = 26;
    if (o->insecure) up[n_up++] = "--insecure";
    up[n_up] = NULL;
    char **env = cb_up_env(lay);
    if (!env) {
        cb_fmt(err, errlen, "out of memory");
        return STATUS_NO_MEMORY;
    }
    fprintf(stderr, "bench_cluster: starting %d pipeline(s) x %d stage(s)%s%s in %s\n", lay->pipelines,
            lay->stages, lay->sockets ? ", NCCL over sockets" : "",
            lay->cache < 0 ? "" : lay->cache ? ", prefix cache on" : ", prefix cache off", dir);
    double t0 = cb_now();
    int rc;
    for (int attempt = 1;; attempt++) {
        cb_keys_restore();
        rc = cb_run(up, env, log_path, o->up_timeout_s + 30, err, errlen);
        if (rc == 0 || cb_stop || attempt >= o->up_tries) break;
        /* A start can fail for a reason outside this layout (a port taken
         * meanwhile): say why, clean up, and start it once more. */
        fprintf(stderr, "bench_cluster: %s: llm-cluster up failed (attempt %d of %d, status %d):\n", lay->name,
                attempt, o->up_tries, rc);
        cb_print_log_tails(dir);
        cb_down(cluster, dir);
        t0 = cb_now();
    }
    free(env);
    if (rc == 0) {
        char ep_path[PATH_MAX + 32], endpoint[256] = "";
        cb_fmt(ep_path, sizeof ep_path, "%s/endpoint", dir);
        FILE *f = fopen(ep_path, "r");
        if (f) {
            if (!fgets(endpoint, sizeof endpoint, f)) endpoint[0] = 0;
            fclose(f);
            endpoint[strcspn(endpoint, "\r\n")] = 0;
        }
        if (!endpoint[0]) {
            cb_fmt(err, errlen, "llm-cluster up succeeded but wrote no endpoint in %s", ep_path);
            rc = STATUS_INTERNAL;
        } else {
            fprintf(stderr, "bench_cluster: cluster in service at %s after %.1f s\n", endpoint, cb_now() - t0);
            struct cb_cluster cl;
            memset(&cl, 0, sizeof cl);
            cl.lay = lay;
            cl.dir = dir;
            cb_cluster_ports(&cl);
            cb_keys_use(dir);
            rc = cb_levels(o, &cl, endpoint, err, errlen);
            if (rc < 0) cb_print_log_tails(dir);
        }
    } else if (rc > 0) {
        cb_fmt(err, errlen, "llm-cluster up exited with status %d%s (log: %s)", rc,
                 cb_stop ? " after a stop signal" : "", log_path);
        cb_print_log_tails(dir);
        rc = STATUS_UNAVAILABLE;
    }
    /* Always: up may have left processes behind when it failed or was stopped. */
    cb_down(cluster, dir);
    return rc;
}
