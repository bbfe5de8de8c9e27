/* llm-cluster: the whole cluster on one machine, for a first try and for
 * development.  `up` starts a private redis-server, one llm-router and
 * pipelines x stages llm-workers in the background, waits until every
 * pipeline serves, and prints the router's endpoint and the run directory
 * (pid files, logs, keys, env.sh); `status` and `down` act on what `up`
 * started.  Secure by default: `up` makes CURVE keys for the router, a
 * client and every worker in RUN_DIR/keys/ and starts everything with them;
 * `--insecure` runs without.  `--http-port P` adds an llm-gateway (the
 * OpenAI HTTP API) on 127.0.0.1:P with an API key in RUN_DIR/api-key.  Every
 * process gets a metrics port of its own, listed for Prometheus in
 * RUN_DIR/prometheus-targets.json. */
#include "client.h"

#include "common/keys.h"
#include "common/log.h"
#include "common/options.h"
#include "common/rconn.h"
#include "common/status.h"
#include "common/zio.h"

#include <dirent.h>
#include <errno.h>
#include <fcntl.h>
#include <limits.h>
#include <netinet/in.h>
#include <signal.h>
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/random.h>
#include <sys/socket.h>
#include <sys/stat.h>
#include <sys/time.h>
#include <sys/wait.h>
#include <time.h>
#include <unistd.h>

#define CL_PROCS_MAX 512
#define CL_ARGS_MAX 96

/* One process `up` started: its name in the run dir (name.pid, name.log)
 * and what its command line must show before `down` signals a pid, so
 * that a pid reused by an unrelated process is never killed. */
struct cl_proc {
    char name[64];
    char program[32]; /* "llm-worker", "llm-router", "llm-gateway", "redis-server" */
    pid_t pid;
    int metrics_port; /* its /metrics on 127.0.0.1, 0 for none (Redis) */
};

struct cl_up {
    const char *model, *redis, *run_dir, *device, *log_level, *router_args, *worker_args, *api_keys_file;
    int pipelines, stages, port, threads, timeout_s, kv_blocks, http_port, routers;
    bool insecure;
    char dir[PATH_MAX];     /* run dir, absolute */
    char bin_router[PATH_MAX], bin_worker[PATH_MAX], bin_redis[PATH_MAX], bin_gateway[PATH_MAX];
    char http_url[128];     /* the gateway's base URL, "" without --http-port */
    char redis_url[128];
    char endpoint[128];     /* the first router's client endpoint */
    char endpoints[640];    /* every router's, comma-separated (LLM_ROUTER) */
    struct cl_proc procs[CL_PROCS_MAX];
    int n_procs;
};

/* vsnprintf-based formatting: paths and messages here may be cut to fit
 * their buffer (a cut message is still a message; a cut path fails to open). */
static void cl_fmt(char *out, size_t size, const char *fmt, ...) __attribute__((format(printf, 3, 4)));
static void cl_fmt(char *out, size_t size, const char *fmt, ...) {
    va_list ap;
    va_start(ap, fmt);
    vsnprintf(out, size, fmt, ap);
    va_end(ap);
}

static int64_t cl_now_ms(void) {
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (int64_t)ts.tv_sec * 1000 + ts.tv_nsec / 1000000;
}

static void cl_sleep_ms(int ms) {
    struct timespec ts = {ms / 1000, (long)(ms % 1000) * 1000000L};
    nanosleep(&ts, NULL);
}

/* ---- files ---------------------------------------------------------------- */

static int cl_write_file(const char *path, const char *text) {
    FILE *f = fopen(path, "w");
    if (!f) return STATUS_IO;
    fputs(text, f);
    return fclose(f) == 0 ? 0 : STATUS_IO;
}

/* The last non-empty line of a log file into out ("" when none). */
static void cl_last_line(const char *path, char *out, size_t size) {
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

/* mkdir -p */
static int cl_mkdirs(const char *path, char *err, size_t errlen) {
    char tmp[PATH_MAX];
    cl_fmt(tmp, sizeof tmp, "%s", path);
    for (char *p = tmp + 1;; p++) {
        if (*p == '/' || *p == 0) {
            char c = *p;
            *p = 0;
            if (mkdir(tmp, 0755) != 0 && errno != EEXIST) {
                cl_fmt(err, errlen, "run dir %s: mkdir %s: %s", path, tmp, strerror(errno));
                return STATUS_IO;
            }
            *p = c;
            if (!c) break;
        }
    }
    return 0;
}

/* A program next to this one (an installed bin/), else in the build tree's
 * folder for it (build/router/llm-cluster -> build/worker/llm-worker). */
static int cl_find_sibling(const char *name, const char *folder, char *out, size_t size, char *err,
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
static int cl_find_redis(char *out, size_t size, char *err, size_t errlen) {
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

/* ---- processes ------------------------------------------------------------ */

/* Starts argv in its own session (it outlives llm-cluster and a closed
 * terminal) with stdout and stderr in DIR/name.log, and writes DIR/name.pid. */
static int cl_spawn(struct cl_up *u, const char *name, const char *program, char *const argv[], char *err,
                    size_t errlen) {
    if (u->n_procs >= CL_PROCS_MAX) {
        cl_fmt(err, errlen, "more than %d processes", CL_PROCS_MAX);
        return STATUS_BAD_INPUT;
    }
    char log_path[PATH_MAX + 80], pid_path[PATH_MAX + 80];
    cl_fmt(log_path, sizeof log_path, "%s/%s.log", u->dir, name);
    cl_fmt(pid_path, sizeof pid_path, "%s/%s.pid", u->dir, name);
    int log_fd = open(log_path, O_WRONLY | O_CREAT | O_TRUNC | O_APPEND | O_CLOEXEC, 0644);
    if (log_fd < 0) {
        cl_fmt(err, errlen, "%s: %s", log_path, strerror(errno));
        return STATUS_IO;
    }
    fflush(stdout);
    fflush(stderr);
    pid_t pid = fork();
    if (pid < 0) {
        cl_fmt(err, errlen, "fork for %s: %s", name, strerror(errno));
        close(log_fd);
        return STATUS_IO;
    }
    if (pid == 0) {
        setsid();
        int null = open("/dev/null", O_RDONLY);
        if (null >= 0) dup2(null, 0);
        dup2(log_fd, 1);
        dup2(log_fd, 2);
        execv(argv[0], argv);
        dprintf(2, "llm-cluster: cannot run %s: %s\n", argv[0], strerror(errno));
        _exit(127);
    }
    close(log_fd);
    struct cl_proc *p = &u->procs[u->n_procs++];
    cl_fmt(p->name, sizeof p->name, "%s", name);
    cl_fmt(p->program, sizeof p->program, "%s", program);
    p->pid = pid;
    char text[32];
    cl_fmt(text, sizeof text, "%d\n", (int)pid);
    if (cl_write_file(pid_path, text) < 0) {
        cl_fmt(err, errlen, "%s: %s", pid_path, strerror(errno));
        return STATUS_IO;
    }
    return 0;
}

/* Whether pid still runs and its command line names program (a pid file
 * can outlive its process; the number may belong to another one now). */
static bool cl_pid_is(pid_t pid, const char *program) {
    char path[64], cmd[512];
    cl_fmt(path, sizeof path, "/proc/%d/cmdline", (int)pid);
    FILE *f = fopen(path, "r");
    if (!f) return false;
    size_t n = fread(cmd, 1, sizeof cmd - 1, f);
    fclose(f);
    cmd[n] = 0; /* the first argument, which redis-server rewrites to "redis-server host:port" */
    if (n == 0) return false; /* a zombie */
    return strstr(cmd, program) != NULL;
}

/* SIGTERM, then SIGKILL after grace_ms; reaps it when it is our child. */
static void cl_stop_pid(pid_t pid, const char *program, int grace_ms) {
    if (pid <= 0 || !cl_pid_is(pid, program)) {
        if (pid > 0) waitpid(pid, NULL, WNOHANG);
        return;
    }
    kill(pid, SIGTERM);
    int64_t end = cl_now_ms() + grace_ms;
    while (cl_now_ms() < end) {
        if (waitpid(pid, NULL, WNOHANG) == pid || !cl_pid_is(pid, program)) return;
        cl_sleep_ms(50);
    }
    kill(pid, SIGKILL);
    waitpid(pid, NULL, 0);
}

/* Stops every process of u, the last started first (workers, then the
 * router, then Redis), and removes their pid files. */
static void cl_stop_all(struct cl_up *u) {
    for (int i = u->n_procs - 1; i >= 0; i--) {
        struct cl_proc *p = &u->procs[i];
        cl_stop_pid(p->pid, p->program, 10000);
        char pid_path[PATH_MAX + 80];
        cl_fmt(pid_path, sizeof pid_path, "%s/%s.pid", u->dir, p->name);
        unlink(pid_path);
    }
    u->n_procs = 0;
}

/* A process of u that has exited, or NULL. */
static struct cl_proc *cl_find_dead(struct cl_up *u, int *wstatus) {
    for (int i = 0; i < u->n_procs; i++) {
        if (waitpid(u->procs[i].pid, wstatus, WNOHANG) == u->procs[i].pid) return &u->procs[i];
    }
    return NULL;
}

static void cl_report_dead(struct cl_up *u, const struct cl_proc *p, int wstatus, const char *when) {
    char path[PATH_MAX + 80], line[1024];
    cl_fmt(path, sizeof path, "%s/%s.log", u->dir, p->name);
    cl_last_line(path, line, sizeof line);
    char how[64];
    if (WIFEXITED(wstatus)) cl_fmt(how, sizeof how, "exited with status %d", WEXITSTATUS(wstatus));
    else if (WIFSIGNALED(wstatus)) cl_fmt(how, sizeof how, "was killed by signal %d", WTERMSIG(wstatus));
    else cl_fmt(how, sizeof how, "stopped");
    fprintf(stderr, "llm-cluster: %s (pid %d) %s %s; last line of %s:\n  %s\n", p->name, (int)p->pid, how, when,
            path, line[0] ? line : "(empty log)");
}

/* Splits extra arguments ("--kv-blocks 64 --threads 1") into argv slots. */
static int cl_add_words(char **argv, int n, char *words, char *err, size_t errlen) {
    for (char *save = NULL, *t = strtok_r(words, " \t", &save); t; t = strtok_r(NULL, " \t", &save)) {
        if (n >= CL_ARGS_MAX - 1) {
            cl_fmt(err, errlen, "too many extra arguments (at most %d)", CL_ARGS_MAX);
            return -1;
        }
        argv[n++] = t;
    }
    return n;
}

/* ---- up ------------------------------------------------------------------- */

/* The GPUs the NVIDIA driver shows, without linking CUDA into llm-cluster. */
static int cl_gpu_count(void) {
    DIR *d = opendir("/proc/driver/nvidia/gpus");
    if (!d) return 0;
    int n = 0;
    for (struct dirent *e; (e = readdir(d));)
        if (e->d_name[0] != '.') n++;
    closedir(d);
    return n;
}

/* 0 when nothing listens on 127.0.0.1:port and the port can be bound. */
static int cl_port_free(const char *option, int port, char *err, size_t errlen) {
    int fd = socket(AF_INET, SOCK_STREAM, 0);
    if (fd < 0) return 0; /* cannot tell; the router will say */
    int one = 1;
    setsockopt(fd, SOL_SOCKET, SO_REUSEADDR, &one, sizeof one);
    struct sockaddr_in a = {0};
    a.sin_family = AF_INET;
    a.sin_port = htons((uint16_t)port);
    a.sin_addr.s_addr = htonl(INADDR_ANY);
    int rc = bind(fd, (struct sockaddr *)&a, sizeof a);
    int e = errno;
    close(fd);
    if (rc != 0) {
        cl_fmt(err, errlen, "%s %d: cannot listen there: %s (another process holds it: pick another port)", option,
               port, strerror(e));
        return STATUS_UNAVAILABLE;
    }
    return 0;
}

/* A free loopback port not handed out before by this process: each probe
 * binds and releases, so two probes in a row can return the same port (Redis
 * and the router once got one port between them). */
static int cl_free_port(char *err, size_t errlen) {
    static int given[64];
    static int n_given;
    for (int attempt = 0; attempt < 32; attempt++) {
        int port = 0, seen = 0;
        if (zio_free_port(NULL, &port, err, errlen) < 0) return -1;
        for (int i = 0; i < n_given; i++) seen |= given[i] == port;
        if (seen) continue;
        if (n_given < (int)(sizeof given / sizeof given[0])) given[n_given++] = port;
        return port;
    }
    cl_fmt(err, errlen, "no free loopback port that was not handed out already (32 tries)");
    return -1;
}

/* Some process running from a run dir's pid files, or 0. */
static pid_t cl_running_pid(const char *dir, char *name, size_t size);

static int cl_check_model(const char *path, char *err, size_t errlen) {
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

/* The --redis words for the router and the workers: for the private Redis
 * the URL without its password and the password file beside it, so that no
 * command line shows the password; a --redis URL given to llm-cluster is
 * passed as it came. */
static int cl_redis_words(const struct cl_up *u, char **argv, int n, char *url, size_t url_size,
                          char *pwfile, size_t pwfile_size) {
    const char *at = strchr(u->redis_url, '@');
    argv[n++] = "--redis";
    if ((u->redis && u->redis[0]) || !at) {
        argv[n++] = (char *)u->redis_url;
        return n;
    }
    cl_fmt(url, url_size, "redis://%s", at + 1);
    cl_fmt(pwfile, pwfile_size, "%s/redis.password", u->dir);
    argv[n++] = url;
    argv[n++] = "--redis-password-file";
    argv[n++] = pwfile;
    return n;
}

static int cl_start_redis(struct cl_up *u, char *err, size_t errlen) {
    if (cl_find_redis(u->bin_redis, sizeof u->bin_redis, err, errlen) < 0) return STATUS_NOT_FOUND;
    int port = cl_free_port(err, errlen);
    if (port < 0) return STATUS_IO;
    char port_s[16];
    cl_fmt(port_s, sizeof port_s, "%d", port);
    /* A fresh password (requirepass), in a config file of the run dir that
     * only this user reads, so that it is not on redis-server's command
     * line; the URL that carries it goes to env.sh. */
    uint8_t raw[16];
    if (getrandom(raw, sizeof raw, 0) != (ssize_t)sizeof raw) {
        cl_fmt(err, errlen, "getrandom: %s", strerror(errno));
        return STATUS_IO;
    }
    char password[2 * sizeof raw + 1], conf[PATH_MAX + 32], text[128];
    for (size_t i = 0; i < sizeof raw; i++) cl_fmt(password + 2 * i, 3, "%02x", raw[i]);
    cl_fmt(conf, sizeof conf, "%s/redis.conf", u->dir);
    cl_fmt(text, sizeof text, "requirepass %s\n", password);
    int fd = open(conf, O_WRONLY | O_CREAT | O_TRUNC | O_CLOEXEC, 0600);
    if (fd < 0 || fchmod(fd, 0600) != 0 || write(fd, text, strlen(text)) != (ssize_t)strlen(text)) {
        cl_fmt(err, errlen, "%s: %s", conf, strerror(errno));
        if (fd >= 0) close(fd);
        return STATUS_IO;
    }
    close(fd);
    /* The same password for the router and the workers, in a file they
     * read (--redis-password-file), so that their command lines, which
     * every user of the host sees in ps, carry only the host and port. */
    char pwfile[PATH_MAX + 32];
    cl_fmt(pwfile, sizeof pwfile, "%s/redis.password", u->dir);
    cl_fmt(text, sizeof text, "%s\n", password);
    fd = open(pwfile, O_WRONLY | O_CREAT | O_TRUNC | O_CLOEXEC, 0600);
    if (fd < 0 || fchmod(fd, 0600) != 0 || write(fd, text, strlen(text)) != (ssize_t)strlen(text)) {
        cl_fmt(err, errlen, "%s: %s", pwfile, strerror(errno));
        if (fd >= 0) close(fd);
        return STATUS_IO;
    }
    close(fd);
    /* A private store that survives its own restart: the append-only file
     * in the run dir, written to disk every second (at most a second of
     * writes lost); no RDB snapshots besides. */
    char *argv[] = {u->bin_redis, conf, "--port", port_s, "--bind", "127.0.0.1", "--dir", u->dir,
                    "--save", "", "--appendonly", "yes", "--appendfsync", "everysec",
                    "--daemonize", "no", NULL};
    int rc = cl_spawn(u, "redis", "redis-server", argv, err, errlen);
    if (rc < 0) return rc;
    cl_fmt(u->redis_url, sizeof u->redis_url, "redis://:%s@127.0.0.1:%d", password, port);
    int64_t end = cl_now_ms() + 10000;
    for (;;) {
        struct rconn *rc_conn = NULL;
        char e2[256];
        if (rconn_open_url(u->redis_url, 500, &rc_conn, e2, sizeof e2) == 0 && rconn_ping(rc_conn) == 0) {
            rconn_close(rc_conn);
            return 0;
        }
        rconn_close(rc_conn);
        int ws;
        struct cl_proc *dead = cl_find_dead(u, &ws);
        if (dead) {
            cl_report_dead(u, dead, ws, "while starting");
            cl_fmt(err, errlen, "redis-server did not start");
            return STATUS_UNAVAILABLE;
        }
        if (cl_now_ms() > end) {
            cl_fmt(err, errlen, "redis-server on port %d did not answer PING within 10 s: %s", port, e2);
            return STATUS_TIMEOUT;
        }
        cl_sleep_ms(50);
    }
}

/* The key files of a run dir (docs/security.md). */
static void cl_key_path(char *out, size_t size, const char *dir, const char *which) {
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

/* Keys for the router, one client (env.sh's) and each worker. */
static int cl_make_keys(struct cl_up *u, char *err, size_t errlen) {
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
static void cl_client_keys(const char *dir, struct llm_client_config *cfg, char *key, char *router,
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

/* RUN_DIR/env.sh: sourced, it points llm and any libllmclient program at
 * this cluster with its client key. */
static int cl_write_env(struct cl_up *u) {
    char path[PATH_MAX + 32], key[PATH_MAX + 64], text[4 * PATH_MAX];
    cl_fmt(text, sizeof text, "# llm-cluster up: . %s/env.sh\n", u->dir);
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

/* Polls the router until health says SERVING with every pipeline ready,
 * checking all along that no process died.  Prints progress once a second
 * on stderr when it changes. */
static int cl_wait_ready(struct cl_up *u, char *err, size_t errlen) {
    const char *eps[1] = {u->endpoint};
    struct llm_client_config cfg;
    llm_client_config_default(&cfg);
    cfg.endpoints = eps;
    cfg.n_endpoints = 1;
    cfg.reply_timeout_ms = 1000;
    cfg.retry_ms = 1000;
    char key[PATH_MAX + 64], router_key[PATH_MAX + 64];
    cl_client_keys(u->dir, &cfg, key, router_key, sizeof key);
    llm_client *c;
    int rc = llm_client_open(&c, &cfg, err, errlen);
    if (rc < 0) return rc;
    int64_t end = cl_now_ms() + (int64_t)u->timeout_s * 1000;
    int last_ready = -1;
    char last_problem[512] = "no answer from the router yet";
    for (;;) {
        int ws;
        struct cl_proc *dead = cl_find_dead(u, &ws);
        if (dead) {
            cl_report_dead(u, dead, ws, "before the cluster was in service");
            cl_fmt(err, errlen, "%s stopped while the cluster was starting", dead->name);
            rc = STATUS_UNAVAILABLE;
            break;
        }
        Llm__ClientEnvelope *env = NULL;
        if (llm_client_status(c, &env) == 0) {
            const Llm__StatusReply *s = env->status_reply;
            int ready = 0;
            for (size_t i = 0; i < s->n_pipelines; i++) ready += s->pipelines[i]->ready ? 1 : 0;
            cl_fmt(last_problem, sizeof last_problem, "%d of %d pipelines ready, %zu workers known", ready,
                     u->pipelines, s->n_workers);
            proto_client_free(env);
            if (ready != last_ready) {
                fprintf(stderr, "llm-cluster: %s\n", last_problem);
                last_ready = ready;
            }
            if (ready >= u->pipelines) {
                rc = 0;
                break;
            }
        } else {
            cl_fmt(last_problem, sizeof last_problem, "%s", llm_client_errstr(c));
        }
        if (cl_now_ms() > end) {
            cl_fmt(err, errlen, "the cluster was not in service within --timeout-s %d: %s", u->timeout_s,
                     last_problem);
            rc = STATUS_TIMEOUT;
            break;
        }
        cl_sleep_ms(200);
    }
    llm_client_close(c);
    return rc;
}

/* The HTTP status of GET path from 127.0.0.1:port, or -1 when nothing
 * answers there (yet). */
static int cl_http_status(int port, const char *path) {
    int fd = socket(AF_INET, SOCK_STREAM | SOCK_CLOEXEC, 0);
    if (fd < 0) return -1;
    struct timeval tv = {1, 0};
    setsockopt(fd, SOL_SOCKET, SO_RCVTIMEO, &tv, sizeof tv);
    setsockopt(fd, SOL_SOCKET, SO_SNDTIMEO, &tv, sizeof tv);
    struct sockaddr_in a = {0};
    a.sin_family = AF_INET;
    a.sin_port = htons((uint16_t)port);
    a.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
    char req[256], reply[64] = "";
    cl_fmt(req, sizeof req, "GET %s HTTP/1.0\r\nHost: 127.0.0.1\r\n\r\n", path);
    int code = -1;
    if (connect(fd, (struct sockaddr *)&a, sizeof a) == 0 && write(fd, req, strlen(req)) == (ssize_t)strlen(req)) {
        ssize_t got = read(fd, reply, sizeof reply - 1);
        if (got > 0) {
            reply[got] = 0;
            if (sscanf(reply, "HTTP/%*s %d", &code) != 1) code = -1;
        }
    }
    close(fd);
    return code;
}

/* RUN_DIR/api-key: kept when there from an earlier `up` (a client may hold
 * it), else a fresh random one, readable by this user only. */
static int cl_api_key_ensure(const char *path, char *err, size_t errlen) {
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

/* The gateway on 127.0.0.1:--http-port, a client of the router with its
 * own key in keys/clients/, started once the cluster serves; returns when
 * its /ready says it reaches a serving router, so that the first request
 * after `up` is answered. */
static int cl_start_gateway(struct cl_up *u, const char *pub_router, char *err, size_t errlen) {
    char listen[64], metrics[64], key[PATH_MAX + 64], keys_file[PATH_MAX + 32];
    int mport = cl_free_port(err, errlen);
    if (mport < 0) return STATUS_IO;
    cl_fmt(listen, sizeof listen, "127.0.0.1:%d", u->http_port);
    cl_fmt(metrics, sizeof metrics, "127.0.0.1:%d", mport);
    if (u->api_keys_file && u->api_keys_file[0]) {
        cl_fmt(keys_file, sizeof keys_file, "%s", u->api_keys_file);
    } else {
        cl_fmt(keys_file, sizeof keys_file, "%s/api-key", u->dir);
        int rc = cl_api_key_ensure(keys_file, err, errlen);
        if (rc < 0) return rc;
    }
    char *argv[CL_ARGS_MAX];
    int n = 0;
    argv[n++] = u->bin_gateway;
    argv[n++] = "--listen";
    argv[n++] = listen;
    argv[n++] = "--router";
    argv[n++] = u->endpoint;
    argv[n++] = "--model";
    argv[n++] = (char *)u->model;
    argv[n++] = "--metrics-listen";
    argv[n++] = metrics;
    argv[n++] = "--api-keys-file";
    argv[n++] = keys_file;
    argv[n++] = "--log-level";
    argv[n++] = (char *)u->log_level;
    if (u->insecure) {
        argv[n++] = "--insecure";
    } else {
        cl_key_path(key, sizeof key, u->dir, "clients/gateway.key");
        argv[n++] = "--curve-key-file";
        argv[n++] = key;
        argv[n++] = "--router-key";
        argv[n++] = (char *)pub_router;
    }
    argv[n] = NULL;
    int rc = cl_spawn(u, "gateway", "llm-gateway", argv, err, errlen);
    if (rc < 0) return rc;
    u->procs[u->n_procs - 1].metrics_port = mport;
    cl_fmt(u->http_url, sizeof u->http_url, "http://127.0.0.1:%d/v1", u->http_port);
    int64_t end = cl_now_ms() + 30000;
    for (;;) {
        int ws;
        struct cl_proc *dead = cl_find_dead(u, &ws);
        if (dead) {
            cl_report_dead(u, dead, ws, "while the gateway was starting");
            cl_fmt(err, errlen, "%s stopped while the gateway was starting", dead->name);
            return STATUS_UNAVAILABLE;
        }
        int code = cl_http_status(mport, "/ready");
        if (code == 200 && cl_http_status(u->http_port, "/v1/models") > 0) return 0;
        if (cl_now_ms() > end) {
            cl_fmt(err, errlen, "the gateway on %s was not ready within 30 s (its /ready on port %d: %d); see %s/gateway.log",
                   listen, mport, code, u->dir);
            return STATUS_TIMEOUT;
        }
        cl_sleep_ms(100);
    }
}

/* RUN_DIR/prometheus-targets.json in Prometheus' file_sd format: each
 * process's metrics address with its job (llm-router, llm-worker,
 * llm-gateway) and its name in the run dir as the "process" label. */
static int cl_write_targets(struct cl_up *u, char *err, size_t errlen) {
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

static int cl_up_run(struct cl_up *u, char *err, size_t errlen) {
    int rc = cl_check_model(u->model, err, errlen);
    if (rc < 0) return rc;
    if (cl_mkdirs(u->run_dir, err, errlen) < 0) return STATUS_IO;
    if (!realpath(u->run_dir, u->dir)) {
        cl_fmt(err, errlen, "run dir %s: %s", u->run_dir, strerror(errno));
        return STATUS_IO;
    }
    char running[64];
    pid_t other = cl_running_pid(u->dir, running, sizeof running);
    if (other) {
        cl_fmt(err, errlen, "a cluster already runs from %s (%s, pid %d): llm-cluster down --run-dir %s first",
                 u->dir, running, (int)other, u->dir);
        return STATUS_UNAVAILABLE;
    }
    if ((rc = cl_find_sibling("llm-router", "router", u->bin_router, sizeof u->bin_router, err, errlen)) < 0 ||
        (rc = cl_find_sibling("llm-worker", "worker", u->bin_worker, sizeof u->bin_worker, err, errlen)) < 0)
        return rc;
    int port = u->port;
    if (port == 0 && (port = cl_free_port(err, errlen)) < 0) return STATUS_IO;
    if ((rc = cl_port_free("--port", port, err, errlen)) < 0) return rc;
    if (u->http_port > 0) {
        if ((rc = cl_port_free("--http-port", u->http_port, err, errlen)) < 0) return rc;
        if ((rc = cl_find_sibling("llm-gateway", "gateway", u->bin_gateway, sizeof u->bin_gateway, err, errlen)) < 0)
            return rc;
    }

    if (u->redis && u->redis[0]) {
        cl_fmt(u->redis_url, sizeof u->redis_url, "%s", u->redis);
        struct rconn *r = NULL;
        char e2[256];
        if (rconn_open_url(u->redis_url, 2000, &r, e2, sizeof e2) < 0 || rconn_ping(r) < 0) {
            cl_fmt(err, errlen, "--redis %s: %s", u->redis_url, r ? rconn_errstr(r) : e2);
            rconn_close(r);
            return STATUS_UNAVAILABLE;
        }
        rconn_close(r);
    } else if ((rc = cl_start_redis(u, err, errlen)) < 0) {
        return rc;
    }
    char marker[PATH_MAX + 32], key_router[PATH_MAX + 64], keys_clients[PATH_MAX + 64],
        keys_workers[PATH_MAX + 64], pub_router[PATH_MAX + 64];
    cl_fmt(marker, sizeof marker, "%s/insecure", u->dir);
    cl_key_path(key_router, sizeof key_router, u->dir, "router.key");
    cl_key_path(pub_router, sizeof pub_router, u->dir, "router.pub");
    cl_key_path(keys_clients, sizeof keys_clients, u->dir, "clients");
    cl_key_path(keys_workers, sizeof keys_workers, u->dir, "workers");
    if (u->insecure) {
        fprintf(stderr, "llm-cluster: --insecure: no keys; anyone who reaches the ports is served\n");
        cl_write_file(marker, "started with --insecure\n");
    } else {
        unlink(marker);
        if ((rc = cl_make_keys(u, err, errlen)) < 0) return rc;
    }

    /* The routers: with --routers N, N of them on the same Redis with the
     * same key pair, so that workers and clients admit each alike; the
     * workers and clients get every endpoint and move to the next when one
     * stops answering, and the routers take over each other's requests
     * (--claim-idle-ms, docs/router.md "Fail-over"). */
    char worker_eps[640] = "", extra_r[1024], stages_s[16];
    cl_fmt(stages_s, sizeof stages_s, "%d", u->stages);
    char redis_plain[160], redis_pwfile[PATH_MAX + 32];
    char *argv[CL_ARGS_MAX];
    int n = 0;
    u->endpoints[0] = 0;
    for (int r = 0; r < u->routers; r++) {
        char client_ep[64], worker_ep[64], metrics_r[64], rname[32], rid[32];
        int cport = r == 0 ? port : cl_free_port(err, errlen);
        int wport = cl_free_port(err, errlen);
        int metrics_port = cl_free_port(err, errlen);
        if (cport < 0 || wport < 0 || metrics_port < 0) return STATUS_IO;
        cl_fmt(metrics_r, sizeof metrics_r, "127.0.0.1:%d", metrics_port);
        cl_fmt(client_ep, sizeof client_ep, "tcp://127.0.0.1:%d", cport);
        cl_fmt(worker_ep, sizeof worker_ep, "tcp://127.0.0.1:%d", wport);
        if (r == 0) cl_fmt(u->endpoint, sizeof u->endpoint, "%s", client_ep);
        size_t el = strlen(u->endpoints), wl = strlen(worker_eps);
        cl_fmt(u->endpoints + el, sizeof u->endpoints - el, "%s%s", r ? "," : "", client_ep);
        cl_fmt(worker_eps + wl, sizeof worker_eps - wl, "%s%s", r ? "," : "", worker_ep);
        if (r == 0) {
            cl_fmt(rname, sizeof rname, "router");
            cl_fmt(rid, sizeof rid, "router");
        } else {
            cl_fmt(rname, sizeof rname, "router%d", r + 1);
            cl_fmt(rid, sizeof rid, "router-%d", r + 1);
        }
        cl_fmt(extra_r, sizeof extra_r, "%s", u->router_args ? u->router_args : "");
        n = 0;
        argv[n++] = u->bin_router;
        argv[n++] = "--model";
        argv[n++] = (char *)u->model;
        argv[n++] = "--listen";
        argv[n++] = client_ep;
        argv[n++] = "--worker-listen";
        argv[n++] = worker_ep;
        argv[n++] = "--router-id";
        argv[n++] = rid;
        if (u->routers > 1) {
            argv[n++] = "--claim-idle-ms";
            argv[n++] = "5000";
        }
        n = cl_redis_words(u, argv, n, redis_plain, sizeof redis_plain, redis_pwfile, sizeof redis_pwfile);
        argv[n++] = "--stages";
        argv[n++] = stages_s;
        argv[n++] = "--metrics-listen";
        argv[n++] = metrics_r;
        argv[n++] = "--log-level";
        argv[n++] = (char *)u->log_level;
        if (u->insecure) {
            argv[n++] = "--insecure";
        } else {
            argv[n++] = "--curve-key-file";
            argv[n++] = key_router;
            argv[n++] = "--client-keys";
            argv[n++] = keys_clients;
            argv[n++] = "--worker-keys";
            argv[n++] = keys_workers;
        }
        if ((n = cl_add_words(argv, n, extra_r, err, errlen)) < 0) return STATUS_BAD_INPUT;
        argv[n] = NULL;
        if ((rc = cl_spawn(u, rname, "llm-router", argv, err, errlen)) < 0) return rc;
        u->procs[u->n_procs - 1].metrics_port = metrics_port;
    }

    /* The workers. */
    int n_gpus = strcmp(u->device, "auto") == 0 ? cl_gpu_count() : 0;
    long cores = sysconf(_SC_NPROCESSORS_ONLN);
    int n_workers = u->pipelines * u->stages;
    int threads = u->threads > 0 ? u->threads : (int)(cores / n_workers > 0 ? cores / n_workers : 1);
    if (n_gpus > 0 && n_gpus < n_workers)
        fprintf(stderr, "llm-cluster: %d workers share %d GPUs\n", n_workers, n_gpus);
    for (int p = 0; p < u->pipelines; p++) {
        for (int s = 0; s < u->stages; s++) {
            int idx = p * u->stages + s;
            char name[64], pid_s[16], sid_s[16], nst_s[16], thr_s[16], kv_s[16], dev[32], listen[64], extra_w[1024],
                metrics_w[64];
            char wkey[PATH_MAX + 96];
            cl_fmt(name, sizeof name, "worker-p%d-s%d", p, s);
            cl_fmt(pid_s, sizeof pid_s, "%d", p);
            cl_fmt(sid_s, sizeof sid_s, "%d", s);
            cl_fmt(nst_s, sizeof nst_s, "%d", u->stages);
            cl_fmt(thr_s, sizeof thr_s, "%d", threads);
            cl_fmt(kv_s, sizeof kv_s, "%d", u->kv_blocks);
            if (n_gpus > 0) cl_fmt(dev, sizeof dev, "cuda:%d", idx % n_gpus);
            else cl_fmt(dev, sizeof dev, "cpu");
            int lport = cl_free_port(err, errlen);
            if (lport < 0) return STATUS_IO;
            cl_fmt(listen, sizeof listen, "tcp://127.0.0.1:%d", lport);
            int mport = cl_free_port(err, errlen);
            if (mport < 0) return STATUS_IO;
            cl_fmt(metrics_w, sizeof metrics_w, "127.0.0.1:%d", mport);
            cl_fmt(extra_w, sizeof extra_w, "%s", u->worker_args ? u->worker_args : "");
            n = 0;
            argv[n++] = u->bin_worker;
            argv[n++] = "--model";
            argv[n++] = (char *)u->model;
            argv[n++] = "--router";
            argv[n++] = worker_eps;
            n = cl_redis_words(u, argv, n, redis_plain, sizeof redis_plain, redis_pwfile, sizeof redis_pwfile);
            argv[n++] = "--worker-id";
            argv[n++] = name;
            argv[n++] = "--pipeline";
            argv[n++] = pid_s;
            argv[n++] = "--stage";
            argv[n++] = sid_s;
            argv[n++] = "--stages";
            argv[n++] = nst_s;
            argv[n++] = "--listen";
            argv[n++] = listen;
            argv[n++] = "--device";
            argv[n++] = dev;
            argv[n++] = "--threads";
            argv[n++] = thr_s;
            argv[n++] = "--metrics-listen";
            argv[n++] = metrics_w;
            if (u->kv_blocks > 0) {
                argv[n++] = "--kv-blocks";
                argv[n++] = kv_s;
            }
            argv[n++] = "--log-level";
            argv[n++] = (char *)u->log_level;
            if (u->insecure) {
                argv[n++] = "--insecure";
            } else {
                cl_fmt(wkey, sizeof wkey, "%s/keys/workers/%s.key", u->dir, name);
                argv[n++] = "--curve-key-file";
                argv[n++] = wkey;
                argv[n++] = "--router-key";
                argv[n++] = pub_router;
            }
            if ((n = cl_add_words(argv, n, extra_w, err, errlen)) < 0) return STATUS_BAD_INPUT;
            argv[n] = NULL;
            if ((rc = cl_spawn(u, name, "llm-worker", argv, err, errlen)) < 0) return rc;
            u->procs[u->n_procs - 1].metrics_port = mport;
        }
    }
    if ((rc = cl_wait_ready(u, err, errlen)) < 0) return rc;
    if (u->http_port > 0 && (rc = cl_start_gateway(u, pub_router, err, errlen)) < 0) return rc;
    if ((rc = cl_write_targets(u, err, errlen)) < 0) return rc;

    char path[PATH_MAX + 32], text[512];
    cl_fmt(path, sizeof path, "%s/endpoint", u->dir);
    cl_fmt(text, sizeof text, "%s\n", u->endpoint);
    cl_write_file(path, text);
    cl_fmt(path, sizeof path, "%s/cluster.env", u->dir);
    cl_fmt(text, sizeof text, "LLM_ROUTER=%s\nLLM_REDIS_URL=%s\n", u->endpoints, u->redis_url);
    cl_write_file(path, text);
    chmod(path, 0600);
    cl_fmt(path, sizeof path, "%s/http-url", u->dir);
    if (u->http_url[0]) {
        cl_fmt(text, sizeof text, "%s\n", u->http_url);
        cl_write_file(path, text);
    } else {
        unlink(path);
    }
    if (cl_write_env(u) < 0) {
        cl_fmt(err, errlen, "%s/env.sh: cannot write it", u->dir);
        return STATUS_IO;
    }
    return 0;
}

static int cl_up(int argc, char **argv) {
    static const char *const devices[] = {"auto", "cpu", NULL};
    struct cl_up *u = calloc(1, sizeof *u);
    if (!u) {
        fprintf(stderr, "llm-cluster: out of memory\n");
        return 1;
    }
    int device_i = 0;
    const struct option_def defs[] = {
        {"model", "LLM_MODEL", OPTION_STRING, NULL, "GGUF file or Hugging Face directory", &u->model, 0, 0, NULL},
        {"pipelines", NULL, OPTION_INT, "1", "pipelines (replicas of the model)", &u->pipelines, 1, 64, NULL},
        {"routers", NULL, OPTION_INT, "1",
         "routers on the same Redis and keys; workers and clients get every endpoint and fail over between them",
         &u->routers, 1, 4, NULL},
        {"stages", NULL, OPTION_INT, "2", "stages per pipeline (one worker each)", &u->stages, 1, 64, NULL},
        {"redis", "LLM_REDIS_URL", OPTION_STRING, NULL, "use this Redis instead of starting a private one",
         &u->redis, 0, 0, NULL},
        {"port", "LLM_PORT", OPTION_INT, "5555", "router port for clients on 127.0.0.1 (0: any free port)",
         &u->port, 0, 65535, NULL},
        {"run-dir", "LLM_RUN_DIR", OPTION_STRING, "run/cluster", "where pid files and logs go", &u->run_dir, 0, 0,
         NULL},
        {"device", "LLM_CLUSTER_DEVICE", OPTION_CHOICE, "auto", "auto: one GPU per worker where GPUs are present, else the CPU; cpu: the CPU",
         &device_i, 0, 0, devices},
        {"threads", NULL, OPTION_INT, "0", "CPU threads per worker (0: the cores shared out)", &u->threads, 0,
         1024, NULL},
        {"kv-blocks", NULL, OPTION_INT, "0", "KV blocks per worker (0: the worker's default)", &u->kv_blocks, 0,
         1 << 24, NULL},
        {"timeout-s", NULL, OPTION_INT, "300", "give up if the cluster is not in service by then", &u->timeout_s,
         1, 86400, NULL},
        {"log-level", "LLM_LOG_LEVEL", OPTION_STRING, "info", "log level of the processes", &u->log_level, 0, 0,
         NULL},
        {"router-args", NULL, OPTION_STRING, "", "extra llm-router arguments, space-separated", &u->router_args,
         0, 0, NULL},
        {"worker-args", NULL, OPTION_STRING, "", "extra llm-worker arguments, space-separated", &u->worker_args,
         0, 0, NULL},
        {"insecure", "LLM_INSECURE", OPTION_BOOL, "false",
         "no CURVE keys: plain sockets that anyone who reaches the ports may use", &u->insecure, 0, 0, NULL},
        {"http-port", "LLM_HTTP_PORT", OPTION_INT, "0",
         "also start llm-gateway (the OpenAI HTTP API) on 127.0.0.1:PORT (0: none)", &u->http_port, 0, 65535,
         NULL},
        {"api-keys-file", "LLM_API_KEYS_FILE", OPTION_STRING, NULL,
         "the gateway's API keys, one a line (default: a fresh key in RUN_DIR/api-key)", &u->api_keys_file, 0, 0,
         NULL},
    };
    struct options o = {"llm-cluster up", "--model PATH [options]",
                        "Starts Redis, a router and pipelines x stages workers in the background and waits "
                        "until every pipeline serves.",
                        defs, (int)(sizeof defs / sizeof defs[0]), false};
    char err[1024] = "";
    int rc = options_parse(&o, &argc, argv, err, sizeof err);
    if (rc == STATUS_CANCELLED) {
        free(u);
        return 0;
    }
    if (rc < 0 || argc > 1 || !u->model) {
        fprintf(stderr, "llm-cluster up: %s\n",
                rc < 0 ? err : argc > 1 ? "unexpected argument (see --help)" : "need --model PATH");
        free(u);
        return 2;
    }
    u->device = devices[device_i];
    rc = cl_up_run(u, err, sizeof err);
    if (rc < 0) {
        fprintf(stderr, "llm-cluster up: %s\n", err);
        if (u->n_procs) fprintf(stderr, "llm-cluster up: stopping the %d processes it started\n", u->n_procs);
        cl_stop_all(u);
        free(u);
        return 1;
    }
    if (u->routers > 1) printf("routers: %s\nrun dir: %s\n", u->endpoints, u->dir);
    else printf("router: %s\nrun dir: %s\n", u->endpoint, u->dir);
    printf("keys: %s\n", u->insecure ? "none (--insecure)" : "RUN_DIR/keys (router, clients/client, workers/)");
    printf("try: . %s/env.sh; llm generate --prompt \"Once upon a time\"\n", u->dir);
    if (u->http_url[0]) {
        bool own_keys = u->api_keys_file && u->api_keys_file[0];
        char key_cmd[PATH_MAX + 32];
        if (own_keys) cl_fmt(key_cmd, sizeof key_cmd, "head -n1 %s", u->api_keys_file);
        else cl_fmt(key_cmd, sizeof key_cmd, "cat %s/api-key", u->dir);
        printf("http: %s (OpenAI API; API key in %s%s)\n", u->http_url, own_keys ? "" : "RUN_DIR/api-key, ",
               own_keys ? u->api_keys_file : "OPENAI_API_KEY in env.sh");
        printf("try: curl %s/completions -H \"Authorization: Bearer $(%s)\" -H 'Content-Type: application/json' "
               "-d '{\"prompt\": \"Once upon a time\", \"max_tokens\": 20}'\n",
               u->http_url, key_cmd);
    }
    printf("metrics: %s/prometheus-targets.json (Prometheus file_sd)\n", u->dir);
    printf("stop: llm-cluster down --run-dir %s\n", u->dir);
    free(u);
    return 0;
}

/* ---- status and down ------------------------------------------------------ */

/* The pid files of a run dir, in the order down stops them: the gateway,
 * the workers, the router, then Redis. */
struct cl_pidfile {
    char name[64];
    char program[32];
    pid_t pid;
};

static int cl_pidfile_rank(const char *name) {
    if (strncmp(name, "gateway", 7) == 0) return 0;
    if (strncmp(name, "worker", 6) == 0) return 1;
    if (strncmp(name, "router", 6) == 0) return 2;
    return 3;
}

static int cl_pidfile_cmp(const void *a, const void *b) {
    const struct cl_pidfile *x = a, *y = b;
    int d = cl_pidfile_rank(x->name) - cl_pidfile_rank(y->name);
    return d ? d : strcmp(x->name, y->name);
}

static int cl_read_pidfiles(const char *dir, struct cl_pidfile *out, int max) {
    DIR *d = opendir(dir);
    if (!d) return -1;
    int n = 0;
    for (struct dirent *e; (e = readdir(d)) && n < max;) {
        size_t len = strlen(e->d_name);
        if (len < 5 || len > 60 || strcmp(e->d_name + len - 4, ".pid") != 0) continue;
        char path[PATH_MAX + 80];
        cl_fmt(path, sizeof path, "%s/%s", dir, e->d_name);
        FILE *f = fopen(path, "r");
        if (!f) continue;
        int pid = 0;
        int ok = fscanf(f, "%d", &pid);
        fclose(f);
        if (ok != 1 || pid <= 1) continue;
        struct cl_pidfile *p = &out[n++];
        cl_fmt(p->name, sizeof p->name, "%.*s", (int)(len - 4), e->d_name);
        p->pid = pid;
        static const char *const programs[] = {"llm-gateway", "llm-worker", "llm-router", "redis-server"};
        cl_fmt(p->program, sizeof p->program, "%s", programs[cl_pidfile_rank(p->name)]);
    }
    closedir(d);
    qsort(out, (size_t)n, sizeof *out, cl_pidfile_cmp);
    return n;
}

static pid_t cl_running_pid(const char *dir, char *name, size_t size) {
    static struct cl_pidfile pf[CL_PROCS_MAX];
    int n = cl_read_pidfiles(dir, pf, CL_PROCS_MAX);
    for (int i = 0; i < n; i++) {
        if (cl_pid_is(pf[i].pid, pf[i].program)) {
            cl_fmt(name, size, "%s", pf[i].name);
            return pf[i].pid;
        }
    }
    return 0;
}

static int cl_parse_dir(const char *name, const char *about, int argc, char **argv, const char **run_dir) {
    const struct option_def defs[] = {
        {"run-dir", "LLM_RUN_DIR", OPTION_STRING, "run/cluster", "the run dir llm-cluster up wrote", run_dir, 0, 0,
         NULL},
    };
    struct options o = {name, "[--run-dir DIR]", about, defs, 1, false};
    char err[512];
    int rc = options_parse(&o, &argc, argv, err, sizeof err);
    if (rc == STATUS_CANCELLED) return 0;
    if (rc < 0 || argc > 1) {
        fprintf(stderr, "%s: %s\n", name, rc < 0 ? err : "unexpected argument (see --help)");
        return 2;
    }
    return -1;
}

static int cl_down(int argc, char **argv) {
    const char *run_dir;
    int rc = cl_parse_dir("llm-cluster down", "Stops what llm-cluster up started from the run dir.", argc, argv,
                          &run_dir);
    if (rc >= 0) return rc;
    static struct cl_pidfile pf[CL_PROCS_MAX];
    int n = cl_read_pidfiles(run_dir, pf, CL_PROCS_MAX);
    if (n < 0) {
        fprintf(stderr, "llm-cluster down: run dir %s: %s\n", run_dir, strerror(errno));
        return 1;
    }
    int stopped = 0;
    for (int i = 0; i < n; i++) {
        bool alive = cl_pid_is(pf[i].pid, pf[i].program);
        if (alive) {
            cl_stop_pid(pf[i].pid, pf[i].program, 10000);
            printf("stopped %s (pid %d)\n", pf[i].name, (int)pf[i].pid);
            stopped++;
        }
        char path[PATH_MAX + 80];
        cl_fmt(path, sizeof path, "%s/%s.pid", run_dir, pf[i].name);
        unlink(path);
    }
    char path[PATH_MAX + 32];
    cl_fmt(path, sizeof path, "%s/endpoint", run_dir);
    unlink(path);
    cl_fmt(path, sizeof path, "%s/http-url", run_dir);
    unlink(path);
    if (stopped == 0) printf("nothing was running from %s\n", run_dir);
    return 0;
}

static int cl_status(int argc, char **argv) {
    const char *run_dir;
    int rc = cl_parse_dir("llm-cluster status", "Shows the processes of the run dir and the router's status.", argc,
                          argv, &run_dir);
    if (rc >= 0) return rc;
    static struct cl_pidfile pf[CL_PROCS_MAX];
    int n = cl_read_pidfiles(run_dir, pf, CL_PROCS_MAX);
    if (n <= 0) {
        fprintf(stderr, "llm-cluster status: no cluster in %s (no pid files)\n", run_dir);
        return 1;
    }
    int dead = 0;
    for (int i = 0; i < n; i++) {
        bool alive = cl_pid_is(pf[i].pid, pf[i].program);
        dead += !alive;
        printf("%-20s pid %-8d %s\n", pf[i].name, (int)pf[i].pid, alive ? "running" : "NOT RUNNING");
    }
    char path[PATH_MAX + 32], ep[256] = "";
    cl_fmt(path, sizeof path, "%s/endpoint", run_dir);
    FILE *f = fopen(path, "r");
    if (f) {
        if (!fgets(ep, sizeof ep, f)) ep[0] = 0;
        fclose(f);
        ep[strcspn(ep, "\r\n")] = 0;
    }
    if (!ep[0]) {
        printf("router endpoint unknown (%s missing: up did not finish)\n", path);
        return 1;
    }
    char url[256] = "";
    cl_fmt(path, sizeof path, "%s/http-url", run_dir);
    cl_last_line(path, url, sizeof url);
    if (url[0]) printf("gateway %s (OpenAI API)\n", url);
    const char *eps[1] = {ep};
    struct llm_client_config cfg;
    llm_client_config_default(&cfg);
    cfg.endpoints = eps;
    cfg.n_endpoints = 1;
    cfg.reply_timeout_ms = 2000;
    cfg.retry_ms = 2000;
    char key[PATH_MAX + 64], router_key[PATH_MAX + 64];
    cl_client_keys(run_dir, &cfg, key, router_key, sizeof key);
    llm_client *c;
    char err[512];
    if (llm_client_open(&c, &cfg, err, sizeof err) < 0) {
        fprintf(stderr, "llm-cluster status: %s\n", err);
        return 1;
    }
    Llm__ClientEnvelope *env;
    rc = llm_client_status(c, &env);
    if (rc < 0) {
        printf("router %s: %s\n", ep, llm_client_errstr(c));
        llm_client_close(c);
        return 1;
    }
    const Llm__StatusReply *s = env->status_reply;
    int ready = 0;
    for (size_t i = 0; i < s->n_pipelines; i++) ready += s->pipelines[i]->ready;
    printf("router %s: %d/%zu pipelines ready, %zu workers, queue %u, running %u, KV blocks %llu/%llu, "
           "%.1f tokens/s\n",
           ep, ready, s->n_pipelines, s->n_workers, s->queue_depth, s->running,
           (unsigned long long)s->kv_blocks_used, (unsigned long long)s->kv_blocks_total, s->tokens_per_s);
    proto_client_free(env);
    llm_client_close(c);
    return dead ? 1 : 0;
}

int main(int argc, char **argv) {
    const char *log_level;
    const struct option_def defs[] = {
        {"log-level", NULL, OPTION_STRING, "warn", "llm-cluster's own log level", &log_level, 0, 0, NULL},
    };
    struct options o = {"llm-cluster", "[options] (up | status | down) [subcommand options]",
                        "Runs a whole cluster on this machine: Redis, a router and workers.  Each subcommand "
                        "has its own --help.",
                        defs, 1, true};
    char err[512];
    log_set_process("llm-cluster");
    int rc = options_parse(&o, &argc, argv, err, sizeof err);
    if (rc == STATUS_CANCELLED) return 0;
    if (rc < 0) {
        fprintf(stderr, "llm-cluster: %s\n", err);
        return 2;
    }
    int level;
    if (log_level_parse(log_level, &level) < 0) {
        fprintf(stderr, "llm-cluster: --log-level %s: expected debug, info, warn, error or none\n", log_level);
        return 2;
    }
    log_set_level(level);
    if (argc < 2) {
        options_help(&o, stderr);
        return 2;
    }
    int n = argc - 1;
    if (strcmp(argv[1], "up") == 0) return cl_up(n, argv + 1);
    if (strcmp(argv[1], "down") == 0) return cl_down(n, argv + 1);
    if (strcmp(argv[1], "status") == 0) return cl_status(n, argv + 1);
    fprintf(stderr, "llm-cluster: unknown subcommand \"%s\": expected up, status or down\n", argv[1]);
    return 2;
}
