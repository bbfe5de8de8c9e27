/* llm-cluster's processes: starting them in the background with a pid
 * file and a log, finding one that died, stopping them by pid only when the
 * pid still names the program, and the loopback ports they get. */
#include "router/cluster-impl.h"

#include "common/status.h"
#include "common/zio.h"

#include <dirent.h>
#include <errno.h>
#include <fcntl.h>
#include <netinet/in.h>
#include <signal.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/socket.h>
#include <sys/stat.h>
#include <sys/time.h>
#include <sys/wait.h>
#include <time.h>
#include <unistd.h>

int64_t cl_now_ms(void) {
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (int64_t)ts.tv_sec * 1000 + ts.tv_nsec / 1000000;
}

void cl_sleep_ms(int ms) {
    struct timespec ts = {ms / 1000, (long)(ms % 1000) * 1000000L};
    nanosleep(&ts, NULL);
}

/* ---- processes ------------------------------------------------------------ */

/* Starts argv in its own session (it outlives llm-cluster and a closed
 * terminal) with stdout and stderr in DIR/name.log, and writes DIR/name.pid. */
int cl_spawn(struct cl_up *u, const char *name, const char *program, char *const argv[], char *err,
             size_t errlen) {
    if (u->n_procs >= CL_PROCS_MAX) {
        cl_fmt(err, errlen, "more than %d processes", CL_PROCS_MAX);
        return STATUS_BAD_INPUT;
    }
    char log_path[PATH_MAX + 80], pid_path[PATH_MAX + 80];
    cl_fmt(log_path, sizeof log_path, "%s/%s.log", u->dir, name);
    cl_fmt(pid_path, sizeof pid_path, "%s/%s.pid", u->dir, name);
    /* Logs can quote prompts: this user's only, like everything in the
     * run dir (an earlier run's log keeps its mode through O_TRUNC). */
    int log_fd = open(log_path, O_WRONLY | O_CREAT | O_TRUNC | O_APPEND | O_CLOEXEC, 0600);
    if (log_fd >= 0 && fchmod(log_fd, 0600) != 0) {
        close(log_fd);
        log_fd = -1;
    }
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
bool cl_pid_is(pid_t pid, const char *program) {
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
void cl_stop_pid(pid_t pid, const char *program, int grace_ms) {
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
void cl_stop_all(struct cl_up *u) {
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
struct cl_proc *cl_find_dead(struct cl_up *u, int *wstatus) {
    for (int i = 0; i < u->n_procs; i++) {
        if (waitpid(u->procs[i].pid, wstatus, WNOHANG) == u->procs[i].pid) return &u->procs[i];
    }
    return NULL;
}

void cl_report_dead(struct cl_up *u, const struct cl_proc *p, int wstatus, const char *when) {
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
int cl_add_words(char **argv, int n, char *words, char *err, size_t errlen) {
    for (char *save = NULL, *t = strtok_r(words, " \t", &save); t; t = strtok_r(NULL, " \t", &save)) {
        if (n >= CL_ARGS_MAX - 1) {
            cl_fmt(err, errlen, "too many extra arguments (at most %d)", CL_ARGS_MAX);
            return -1;
        }
        argv[n++] = t;
    }
    return n;
}

/* The GPUs the NVIDIA driver shows, without linking CUDA into llm-cluster. */
int cl_gpu_count(void) {
    DIR *d = opendir("/proc/driver/nvidia/gpus");
    if (!d) return 0;
    int n = 0;
    for (struct dirent *e; (e = readdir(d));)
        if (e->d_name[0] != '.') n++;
    closedir(d);
    return n;
}

/* 0 when nothing listens on 127.0.0.1:port and the port can be bound. */
int cl_port_free(const char *option, int port, char *err, size_t errlen) {
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
int cl_free_port(char *err, size_t errlen) {
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

/* The HTTP status of GET path from 127.0.0.1:port, or -1 when nothing
 * answers there (yet). */
int cl_http_status(int port, const char *path) {
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

int cl_read_pidfiles(const char *dir, struct cl_pidfile *out, int max) {
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

pid_t cl_running_pid(const char *dir, char *name, size_t size) {
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
