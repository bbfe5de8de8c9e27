/* The private redis-server fixture: fork/exec on a free loopback port, wait
 * for PING, stop and clean up; an exit hook kills what a failed test left. */
#include "redis_fixture.h"

#include "common/status.h"
#include "common/zio.h"
#include "test.h"

#include <ctype.h>
#include <errno.h>
#include <fcntl.h>
#include <ftw.h>
#include <hiredis/hiredis.h>
#include <signal.h>
#include <sys/prctl.h>
#include <sys/stat.h>
#include <sys/time.h>
#include <sys/wait.h>
#include <time.h>
#include <unistd.h>

/* Servers still running, by pid and folder, for the exit hook: the fixture
 * structs themselves may live on the stack of a test that has ended. */
#define FIXTURE_REDIS_MAX 32
static struct {
    pid_t pid;
    char dir[256];
} fixture_live[FIXTURE_REDIS_MAX];
static int fixture_hook_set;

static int fixture_rm_entry(const char *path, const struct stat *st, int flag, struct FTW *ftw) {
    return remove(path);
}

static int fixture_rmdir(const char *dir) {
    if (!dir[0]) return 0;
    struct stat st;
    if (stat(dir, &st) != 0) return 0;
    return nftw(dir, fixture_rm_entry, 16, FTW_DEPTH | FTW_PHYS) == 0 ? 0 : STATUS_IO;
}

static void fixture_reap(pid_t pid) {
    if (pid <= 0) return;
    kill(pid, SIGKILL);
    while (waitpid(pid, NULL, 0) < 0 && errno == EINTR) {
    }
}

static void fixture_atexit(void) {
    for (int i = 0; i < FIXTURE_REDIS_MAX; i++) {
        if (fixture_live[i].pid > 0) fixture_reap(fixture_live[i].pid);
        if (fixture_live[i].dir[0]) fixture_rmdir(fixture_live[i].dir);
        fixture_live[i].pid = 0;
        fixture_live[i].dir[0] = '\0';
    }
}

/* Records (or updates, when old_pid is found) a live server. */
static void fixture_track(pid_t old_pid, pid_t pid, const char *dir) {
    if (!fixture_hook_set) {
        atexit(fixture_atexit);
        fixture_hook_set = 1;
    }
    int slot = -1;
    for (int i = 0; i < FIXTURE_REDIS_MAX; i++) {
        if (old_pid > 0 && fixture_live[i].pid == old_pid) {
            slot = i;
            break;
        }
        if (slot < 0 && fixture_live[i].pid == 0 && !fixture_live[i].dir[0]) slot = i;
    }
    if (slot < 0) return; /* more than 32 at once: the test's own stop still cleans up */
    fixture_live[slot].pid = pid;
    snprintf(fixture_live[slot].dir, sizeof fixture_live[slot].dir, "%s", dir);
}

static void fixture_untrack(pid_t pid, const char *dir, int keep_dir) {
    for (int i = 0; i < FIXTURE_REDIS_MAX; i++) {
        if ((pid > 0 && fixture_live[i].pid == pid) ||
            (dir[0] && strcmp(fixture_live[i].dir, dir) == 0)) {
            fixture_live[i].pid = 0;
            if (!keep_dir) fixture_live[i].dir[0] = '\0';
        }
    }
}

static int fixture_find_server(char *path, size_t size) {
    const char *env = getenv("LLM_REDIS_SERVER");
    if (env && *env) {
        snprintf(path, size, "%s", env);
        return access(path, X_OK) == 0 ? 0 : -1;
    }
    const char *p = getenv("PATH");
    if (!p) p = "/usr/local/bin:/usr/bin:/bin";
    while (*p) {
        const char *c = strchr(p, ':');
        size_t len = c ? (size_t)(c - p) : strlen(p);
        snprintf(path, size, "%.*s/redis-server", (int)len, p);
        if (len && access(path, X_OK) == 0) return 0;
        p += len + (c ? 1 : 0);
    }
    return -1;
}

void fixture_redis_log_tail(const struct redis_fixture *f, char *buf, size_t size) {
    char path[300];
    snprintf(path, sizeof path, "%s/redis.log", f->dir);
    buf[0] = '\0';
    FILE *fp = fopen(path, "r");
    if (!fp) {
        snprintf(buf, size, "(no log at %s)", path);
        return;
    }
    fseek(fp, 0, SEEK_END);
    long end = ftell(fp);
    long from = end > (long)size - 1 ? end - (long)size + 1 : 0;
    fseek(fp, from, SEEK_SET);
    size_t n = fread(buf, 1, size - 1, fp);
    buf[n] = '\0';
    fclose(fp);
}

static pid_t fixture_spawn(const char *server, const struct redis_fixture *f) {
    char port[16];
    snprintf(port, sizeof port, "%d", f->port);
    int persist = (f->flags & FIXTURE_REDIS_PERSIST) != 0;
    pid_t parent = getpid();
    pid_t pid = fork();
    if (pid != 0) return pid;
    /* Child: die with the test process, keep the test's output clean. */
    prctl(PR_SET_PDEATHSIG, SIGKILL);
    if (getppid() != parent) _exit(127);
    int null = open("/dev/null", O_RDWR);
    if (null >= 0) {
        dup2(null, 0);
        dup2(null, 1);
        dup2(null, 2);
    }
    char *argv[] = {(char *)server, "--port", port, "--bind", "127.0.0.1",
                    "--dir", (char *)f->dir, "--logfile", "redis.log",
                    "--daemonize", "no", "--save", "",
                    "--appendonly", persist ? "yes" : "no",
                    "--appendfsync", "always",
                    f->password[0] ? "--requirepass" : NULL, (char *)f->password, NULL};
    execv(server, argv);
    _exit(127);
}

/* Waits until the server answers PING (0), exits (1: see its log), or 10 s
 * pass (-1). */
static int fixture_wait_ready(struct redis_fixture *f) {
    struct timespec t0, now;
    clock_gettime(CLOCK_MONOTONIC, &t0);
    for (;;) {
        int st;
        pid_t w = waitpid(f->pid, &st, WNOHANG);
        if (w == f->pid) {
            f->pid = 0;
            return 1;
        }
        struct timeval tv = {0, 200000};
        redisContext *c = redisConnectWithTimeout(f->host, f->port, tv);
        if (c && !c->err) {
            if (f->password[0]) {
                const char *argv[] = {"AUTH", f->password};
                redisReply *a = redisCommandArgv(c, 2, argv, NULL);
                if (a) freeReplyObject(a);
            }
            redisReply *r = redisCommand(c, "PING");
            int ok = r && r->type == REDIS_REPLY_STATUS && strcmp(r->str, "PONG") == 0;
            if (r) freeReplyObject(r);
            redisFree(c);
            if (ok) return 0;
        } else if (c) {
            redisFree(c);
        }
        clock_gettime(CLOCK_MONOTONIC, &now);
        if ((now.tv_sec - t0.tv_sec) * 1000 + (now.tv_nsec - t0.tv_nsec) / 1000000 > 10000)
            return -1;
        usleep(10000);
    }
}

/* Starts the server on f->port (or a fresh free port when pick_port); ends
 * the test on failure. */
static void fixture_launch(struct redis_fixture *f, int pick_port, pid_t old_pid) {
    char server[512];
    if (fixture_find_server(server, sizeof server) < 0)
        TEST_SKIP("redis-server is not installed (not in PATH; set LLM_REDIS_SERVER or "
                  "install the redis-server package)");
    char why[1024] = "";
    for (int attempt = 0; attempt < 5; attempt++) {
        if (pick_port) {
            char err[256];
            if (zio_free_port(NULL, &f->port, err, sizeof err) < 0) {
                fixture_untrack(old_pid, f->dir, 0);
                fixture_rmdir(f->dir);
                TEST_FAIL("redis fixture: %s", err);
            }
        }
        snprintf(f->url, sizeof f->url, "redis://%s:%d", f->host, f->port);
        if (f->password[0]) {
            char esc[3 * 40];
            size_t k = 0;
            for (const char *c = f->password; *c; c++)
                k += (size_t)(isalnum((unsigned char)*c) ? snprintf(esc + k, sizeof esc - k, "%c", *c)
                                                         : snprintf(esc + k, sizeof esc - k, "%%%02X", *c));
            snprintf(f->url_auth, sizeof f->url_auth, "redis://:%s@%s:%d", esc, f->host, f->port);
        } else {
            snprintf(f->url_auth, sizeof f->url_auth, "%s", f->url);
        }
        f->pid = fixture_spawn(server, f);
        if (f->pid < 0) {
            f->pid = 0;
            snprintf(why, sizeof why, "fork: %s", strerror(errno));
            break;
        }
        fixture_track(old_pid, f->pid, f->dir);
        old_pid = f->pid;
        int rc = fixture_wait_ready(f);
        if (rc == 0) return;
        fixture_redis_log_tail(f, why, sizeof why);
        if (rc < 0) { /* alive but silent: give up */
            fixture_reap(f->pid);
            f->pid = 0;
            break;
        }
        /* It exited: most often the port was taken between finding and binding it. */
        if (!pick_port || !strstr(why, "in use")) break;
    }
    fixture_untrack(old_pid, f->dir, 0);
    char dir[256];
    snprintf(dir, sizeof dir, "%s", f->dir);
    fixture_rmdir(f->dir);
    f->dir[0] = '\0';
    TEST_FAIL("redis fixture: %s on port %d did not answer PING; folder %s; log tail:\n%s",
              server, f->port, dir, why);
}

void fixture_redis_start(struct redis_fixture *f, int flags) {
    memset(f, 0, sizeof *f);
    f->flags = flags;
    snprintf(f->host, sizeof f->host, "127.0.0.1");
    /* Characters a URL must escape, so that the tests see them round-trip. */
    if (flags & FIXTURE_REDIS_AUTH) snprintf(f->password, sizeof f->password, "s3cr@t:/%%%d", (int)getpid());
    char server[512];
    if (fixture_find_server(server, sizeof server) < 0)
        TEST_SKIP("redis-server is not installed (not in PATH; set LLM_REDIS_SERVER or "
                  "install the redis-server package)");
    const char *tmp = getenv("TMPDIR");
    snprintf(f->dir, sizeof f->dir, "%s/llm-redis-XXXXXX", tmp && *tmp ? tmp : "/tmp");
    if (!mkdtemp(f->dir)) {
        int e = errno;
        char dir[256];
        snprintf(dir, sizeof dir, "%s", f->dir);
        f->dir[0] = '\0';
        TEST_FAIL("redis fixture: mkdtemp %s: %s", dir, strerror(e));
    }
    fixture_launch(f, 1, 0);
}

/* SIGTERM, then SIGKILL after 5 s; 0 once the process is gone. */
static int fixture_terminate(pid_t pid) {
    if (pid <= 0) return 0;
    if (kill(pid, SIGTERM) != 0 && errno == ESRCH) {
        waitpid(pid, NULL, WNOHANG);
        return 0;
    }
    for (int i = 0; i < 500; i++) {
        pid_t w = waitpid(pid, NULL, WNOHANG);
        if (w == pid || (w < 0 && errno == ECHILD)) return 0;
        usleep(10000);
    }
    fixture_reap(pid);
    return 0;
}

int fixture_redis_stop(struct redis_fixture *f) {
    pid_t pid = f->pid;
    fixture_terminate(pid);
    f->pid = 0;
    int rc = 0;
    if (pid > 0 && kill(pid, 0) == 0) rc = STATUS_INTERNAL; /* still there: cannot happen after waitpid */
    if (fixture_rmdir(f->dir) < 0) rc = STATUS_IO;
    fixture_untrack(pid, f->dir, 0);
    f->dir[0] = '\0';
    return rc;
}

void fixture_redis_kill(struct redis_fixture *f) {
    fixture_untrack(f->pid, "", 1);
    fixture_reap(f->pid);
    f->pid = 0;
}

void fixture_redis_restart(struct redis_fixture *f) {
    pid_t old = f->pid;
    fixture_terminate(old);
    f->pid = 0;
    fixture_launch(f, 0, old);
}
