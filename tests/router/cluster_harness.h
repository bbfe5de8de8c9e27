/* The multi-process harness of the tests/router/test_cluster_*.c files: a
 * private redis-server (tests/redis_fixture.h), a real llm-router and
 * llm-worker processes on loopback ports, each started as a child that dies
 * with the test (PR_SET_PDEATHSIG), logs in a temporary folder, bounded
 * waits, kill/restart of single processes, the llm-run reference output of
 * a prompt, and many generations at once on threads.
 *
 * Keys as in production (docs/security.md): every cluster gets fresh CURVE
 * key pairs in its folder (curve/router, curve/clients/client, one per
 * worker slot in curve/workers/), and the test process exports LLM_CURVE_KEY_FILE
 * and LLM_ROUTER_KEY as llm-cluster's env.sh does, so that its clients and
 * the programs it starts (llm, llm-gateway) use them.  "--insecure" among
 * the router's extra words runs the whole cluster without keys instead.
 *
 * Included by each cluster test file (the build makes one program per
 * test_*.c), so every function is static; unused ones are fine.
 *
 *   struct cluster *cl = h_cluster_start(model, 1, 2, "", "");  // skips without redis
 *   ... h_generate(cl, &req) ... h_kill_worker(cl, 1, SIGKILL) ...
 *   h_cluster_stop(cl);   // every process stopped; logs removed
 *
 * A failed assertion longjmps out of the test: the next h_cluster_start and
 * the exit handler stop what a failed test left, and keep its logs. */
#ifndef TESTS_ROUTER_CLUSTER_HARNESS_H
#define TESTS_ROUTER_CLUSTER_HARNESS_H

#include "tests/redis_fixture.h"
#include "tests/test.h"

#include "clients/c/client.h"
#include "common/keys.h"
#include "common/status.h"
#include "common/zio.h"

#include <cjson/cJSON.h>
#include <errno.h>
#include <fcntl.h>
#include <pthread.h>
#include <signal.h>
#include <stdarg.h>
#include <sys/prctl.h>
#include <arpa/inet.h>
#include <netinet/in.h>
#include <sys/socket.h>
#include <sys/stat.h>
#include <sys/time.h>
#include <sys/wait.h>
#include <time.h>
#include <unistd.h>

#define H_ROUTER LLM_BINARY_DIR "/router/llm-router"
#define H_WORKER LLM_BINARY_DIR "/worker/llm-worker"
#define H_RUN LLM_BINARY_DIR "/worker/llm-run"
#define H_WORKERS_MAX 16
#define H_UNUSED __attribute__((unused))

struct h_proc {
    char name[48];
    pid_t pid;        /* 0: not running */
    char log[320];
    char *argv[48];   /* kept to restart it; strings point into args */
    char args[2048];
};

struct cluster {
    struct redis_fixture redis;
    char dir[256];    /* logs */
    char model[1024];
    char client_ep[64], worker_ep[64];
    int pipelines, stages;
    struct h_proc router;
    struct h_proc workers[H_WORKERS_MAX];
    int n_workers;
    char router_extra[512], worker_extra[512];
    void *zctx;       /* shared by the test's clients */
    int insecure;     /* "--insecure" in router_extra: no keys anywhere */
    char keys[320];   /* dir/curve: the CURVE keys */
    /* A second router on the same Redis with the same key pair
     * (h_cluster_start_routers with 2): workers and clients are given both
     * endpoints, the first router's first. */
    int n_routers;
    struct h_proc router2;
    char client_ep2[64], worker_ep2[64];
};

/* The first chunk a client callback saw at or after h_mark_ms (0: none
 * yet, or no mark): when the mark is a kill of the router that served, the
 * first token another router served. */
static int64_t h_mark_ms, h_first_after_mark_ms;

static struct cluster *h_current; /* the running cluster, for cleanup after a failed test */
/* Fixture flags of the Redis the next h_cluster_start starts (tests/redis_fixture.h:
 * FIXTURE_REDIS_PERSIST keeps its data across fixture_redis_kill + _restart). */
static int h_redis_flags H_UNUSED;

static H_UNUSED int64_t h_now_ms(void) {
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (int64_t)ts.tv_sec * 1000 + ts.tv_nsec / 1000000;
}

static H_UNUSED void h_sleep_ms(int ms) {
    struct timespec ts = {ms / 1000, (long)(ms % 1000) * 1000000L};
    while (nanosleep(&ts, &ts) != 0 && errno == EINTR) {}
}

/* The last lines of a file (at most size bytes) into buf. */
static H_UNUSED void h_tail(const char *path, char *buf, size_t size, int lines) {
    buf[0] = 0;
    int fd = open(path, O_RDONLY);
    if (fd < 0) return;
    off_t end = lseek(fd, 0, SEEK_END);
    off_t from = end > (off_t)size - 1 ? end - (off_t)size + 1 : 0;
    lseek(fd, from, SEEK_SET);
    ssize_t n = read(fd, buf, size - 1);
    close(fd);
    buf[n > 0 ? n : 0] = 0;
    /* keep the last `lines` lines */
    int seen = 0;
    for (ssize_t i = (n > 0 ? n : 0) - 1; i > 0; i--) {
        if (buf[i - 1] == '\n' && ++seen >= lines) {
            memmove(buf, buf + i, strlen(buf + i) + 1);
            break;
        }
    }
}

/* Prints the end of every process's log: the evidence a failure needs. */
static H_UNUSED void h_dump_logs(struct cluster *cl) {
    char buf[6000];
    if (!cl) return;
    struct h_proc *ps[H_WORKERS_MAX + 1];
    int n = 0;
    ps[n++] = &cl->router;
    for (int i = 0; i < cl->n_workers; i++) ps[n++] = &cl->workers[i];
    for (int i = 0; i < n; i++) {
        if (!ps[i]->log[0]) continue;
        h_tail(ps[i]->log, buf, sizeof buf, 12);
        printf("  ---- %s (%s), last lines:\n%s", ps[i]->name, ps[i]->log, buf);
    }
    printf("  ---- logs kept in %s\n", cl->dir);
    fflush(stdout);
}

#define H_FAIL(cl, ...)            \
    do {                           \
        h_dump_logs(cl);           \
        TEST_FAIL(__VA_ARGS__);    \
    } while (0)
#define H_ASSERT(cl, cond, ...)                    \
    do {                                           \
        if (!(cond)) H_FAIL(cl, __VA_ARGS__);      \
    } while (0)

static H_UNUSED void h_proc_setargs(struct h_proc *p, const char *const *argv) {
    size_t off = 0;
    int n = 0;
    for (; argv[n] && n < 47; n++) {
        size_t l = strlen(argv[n]) + 1;
        if (off + l > sizeof p->args) break;
        memcpy(p->args + off, argv[n], l);
        p->argv[n] = p->args + off;
        off += l;
    }
    p->argv[n] = NULL;
}

/* Splits extra words ("--max-batch 4") onto argv from slot n. */
static H_UNUSED int h_add_words(const char **argv, int n, char *words) {
    for (char *save = NULL, *t = strtok_r(words, " ", &save); t && n < 40; t = strtok_r(NULL, " ", &save))
        argv[n++] = t;
    return n;
}

static H_UNUSED void h_proc_start(struct cluster *cl, struct h_proc *p) {
    if (access(p->argv[0], X_OK) != 0) TEST_FAIL("%s is not built", p->argv[0]);
    int fd = open(p->log, O_WRONLY | O_CREAT | O_APPEND | O_CLOEXEC, 0644);
    if (fd < 0) TEST_FAIL("%s: %s", p->log, strerror(errno));
    fflush(stdout);
    pid_t parent = getpid();
    pid_t pid = fork();
    if (pid < 0) TEST_FAIL("fork: %s", strerror(errno));
    if (pid == 0) {
        prctl(PR_SET_PDEATHSIG, SIGKILL);
        if (getppid() != parent) _exit(127);
        int null = open("/dev/null", O_RDONLY);
        if (null >= 0) dup2(null, 0);
        dup2(fd, 1);
        dup2(fd, 2);
        execv(p->argv[0], p->argv);
        dprintf(2, "cannot run %s: %s\n", p->argv[0], strerror(errno));
        _exit(127);
    }
    close(fd);
    p->pid = pid;
    (void)cl;
}

/* Sends sig and waits for the process (SIGKILL after 5 s). */
static H_UNUSED void h_proc_kill(struct h_proc *p, int sig) {
    if (p->pid <= 0) return;
    kill(p->pid, sig);
    int64_t end = h_now_ms() + 5000;
    for (;;) {
        int st;
        pid_t r = waitpid(p->pid, &st, WNOHANG);
        if (r == p->pid || (r < 0 && errno == ECHILD)) break;
        if (h_now_ms() > end) {
            kill(p->pid, SIGKILL);
            waitpid(p->pid, &st, 0);
            break;
        }
        h_sleep_ms(10);
    }
    p->pid = 0;
}

/* 1 when the process has exited (it is then reaped and its pid cleared). */
static H_UNUSED int h_proc_exited(struct h_proc *p, int *status) {
    if (p->pid <= 0) return 1;
    if (waitpid(p->pid, status, WNOHANG) == p->pid) {
        p->pid = 0;
        return 1;
    }
    return 0;
}

static H_UNUSED void h_start_router_as(struct cluster *cl, struct h_proc *p, const char *name, const char *client_ep,
                                       const char *worker_ep, const char *router_id) {
    snprintf(p->name, sizeof p->name, "%s", name);
    snprintf(p->log, sizeof p->log, "%s/%s.log", cl->dir, name);
    char stages[16], extra[512];
    snprintf(stages, sizeof stages, "%d", cl->stages);
    snprintf(extra, sizeof extra, "%s", cl->router_extra);
    char key[400], clients[400], workers[400];
    snprintf(key, sizeof key, "%s/router.key", cl->keys);
    snprintf(clients, sizeof clients, "%s/clients", cl->keys);
    snprintf(workers, sizeof workers, "%s/workers", cl->keys);
    const char *argv[48] = {H_ROUTER, "--model", cl->model, "--listen", client_ep, "--worker-listen",
                            worker_ep, "--redis", cl->redis.url, "--stages", stages,
                            "--router-id", router_id, "--log-level", "info"};
    int n = 15;
    if (!cl->insecure) {
        const char *k[] = {"--curve-key-file", key, "--client-keys", clients, "--worker-keys", workers};
        for (int i = 0; i < 6; i++) argv[n++] = k[i];
    }
    n = h_add_words(argv, n, extra);
    argv[n] = NULL;
    h_proc_setargs(p, argv);
    h_proc_start(cl, p);
}

static H_UNUSED void h_start_router(struct cluster *cl) {
    h_start_router_as(cl, &cl->router, "router", cl->client_ep, cl->worker_ep, "test-router");
}

static H_UNUSED void h_start_router2(struct cluster *cl) {
    h_start_router_as(cl, &cl->router2, "router2", cl->client_ep2, cl->worker_ep2, "test-router-2");
}

/* Starts the worker of (pipeline, stage) in slot idx (a new slot when idx
 * is n_workers); its id names the slot and a generation counter so that a
 * replacement is a new worker. */
static H_UNUSED void h_start_worker(struct cluster *cl, int idx, int pipeline, int stage) {
    if (idx > cl->n_workers || idx >= H_WORKERS_MAX) TEST_FAIL("worker slot %d out of range", idx);
    static int generation;
    struct h_proc *p = &cl->workers[idx];
    if (idx == cl->n_workers) cl->n_workers++;
    generation++;
    char name[48];
    snprintf(name, sizeof name, "w-p%d-s%d-%d", pipeline, stage, generation);
    memcpy(p->name, name, sizeof name);
    snprintf(p->log, sizeof p->log, "%s/%s.log", cl->dir, name);
    char pl[16], st[16], sts[16], extra[512];
    snprintf(pl, sizeof pl, "%d", pipeline);
    snprintf(st, sizeof st, "%d", stage);
    snprintf(sts, sizeof sts, "%d", cl->stages);
    snprintf(extra, sizeof extra, "%s", cl->worker_extra);
    char routers[160];
    if (cl->n_routers > 1) snprintf(routers, sizeof routers, "%s,%s", cl->worker_ep, cl->worker_ep2);
    else snprintf(routers, sizeof routers, "%s", cl->worker_ep);
    const char *argv[48] = {H_WORKER, "--model", cl->model, "--router", routers, "--redis", cl->redis.url,
                            "--pipeline", pl, "--stage", st, "--stages", sts, "--worker-id", p->name,
                            "--listen", "tcp://127.0.0.1:*", "--device", "cpu", "--threads", "1",
                            "--log-level", "info"};
    int n = 23;
    char key[400], router_key[400];
    snprintf(key, sizeof key, "%s/workers/worker-%d.key", cl->keys, idx);
    snprintf(router_key, sizeof router_key, "%s/router.pub", cl->keys);
    if (cl->insecure) {
        if (!strstr(cl->worker_extra, "--insecure")) argv[n++] = "--insecure";
    } else {
        const char *k[] = {"--curve-key-file", key, "--router-key", router_key};
        for (int i = 0; i < 4; i++) argv[n++] = k[i];
    }
    n = h_add_words(argv, n, extra);
    argv[n] = NULL;
    h_proc_setargs(p, argv);
    h_proc_start(cl, p);
}

/* A client of the given endpoints (NULL: the cluster's, both routers' when
 * it has two). */
static H_UNUSED llm_client *h_client_at(struct cluster *cl, const char *ep, int reply_ms, int idle_ms,
                                        int retry_ms) {
    const char *eps[2] = {cl->client_ep, cl->client_ep2};
    struct llm_client_config cfg;
    llm_client_config_default(&cfg);
    cfg.endpoints = eps;
    cfg.n_endpoints = cl->n_routers > 1 ? 2 : 1;
    if (ep) {
        eps[0] = ep;
        cfg.n_endpoints = 1;
    }
    cfg.zmq_ctx = cl->zctx;
    cfg.reply_timeout_ms = reply_ms;
    cfg.idle_timeout_ms = idle_ms;
    cfg.retry_ms = retry_ms;
    llm_client *c = NULL;
    char err[256];
    if (llm_client_open(&c, &cfg, err, sizeof err) != 0) H_FAIL(cl, "llm_client_open: %s", err);
    return c;
}

static H_UNUSED llm_client *h_client(struct cluster *cl, int reply_ms, int idle_ms, int retry_ms) {
    return h_client_at(cl, NULL, reply_ms, idle_ms, retry_ms);
}

/* A raw socket of type on the cluster's context, set up as a client with the
 * key in curve/<key_name>.key (CURVE towards the router) unless the cluster
 * is insecure, and connected to ep. */
static H_UNUSED struct zio_sock *h_raw_socket(struct cluster *cl, int type, const char *key_name,
                                              const char *ep) {
    struct zio_sock *s = NULL;
    char err[512];
    if (zio_sock_open(cl->zctx, type, &s, err, sizeof err) != 0) H_FAIL(cl, "socket: %s", err);
    zio_set_int(s, ZMQ_LINGER, 0);
    if (!cl->insecure) {
        struct keys_pair kp;
        char path[512], router[KEYS_Z85_LEN + 1];
        snprintf(path, sizeof path, "%s/%s.key", cl->keys, key_name);
        if (keys_pair_load(path, &kp, err, sizeof err) < 0) H_FAIL(cl, "%s", err);
        snprintf(path, sizeof path, "%s/router.pub", cl->keys);
        if (keys_pub_load(path, router, err, sizeof err) < 0) H_FAIL(cl, "%s", err);
        if (zio_curve_client(s, &kp, router) != 0) H_FAIL(cl, "%s", zio_errstr(s));
    }
    if (zio_connect(s, ep) != 0) H_FAIL(cl, "%s", zio_errstr(s));
    return s;
}

/* Pipelines ready in the router's Status, or -1 when it did not answer. */
static H_UNUSED int h_ready_pipelines(struct cluster *cl, llm_client *c, Llm__ClientEnvelope **keep) {
    Llm__ClientEnvelope *env;
    if (llm_client_status(c, &env) != 0) return -1;
    int ready = 0;
    for (size_t i = 0; i < env->status_reply->n_pipelines; i++) ready += env->status_reply->pipelines[i]->ready;
    if (keep) *keep = env;
    else proto_client_free(env);
    (void)cl;
    return ready;
}

/* Waits until `want` pipelines are ready (exactly, when exact), failing the
 * test with the logs after timeout_ms or when a process died. */
static H_UNUSED void h_wait_ready(struct cluster *cl, int want, int exact, int timeout_ms) {
    /* With two routers, the second answers once the first is gone. */
    llm_client *c = h_client_at(cl, cl->n_routers > 1 && !cl->router.pid ? cl->client_ep2 : cl->client_ep, 500,
                                1000, 500);
    int64_t end = h_now_ms() + timeout_ms;
    int got = -1;
    for (;;) {
        got = h_ready_pipelines(cl, c, NULL);
        if (exact ? got == want : got >= want) break;
        int st;
        if (cl->router.pid && h_proc_exited(&cl->router, &st)) {
            llm_client_close(c);
            H_FAIL(cl, "llm-router exited (status 0x%x) while waiting for %d ready pipelines", st, want);
        }
        for (int i = 0; i < cl->n_workers; i++) {
            struct h_proc *w = &cl->workers[i];
            if (w->pid && h_proc_exited(w, &st)) {
                llm_client_close(c);
                H_FAIL(cl, "%s exited (status 0x%x) while waiting for %d ready pipelines", w->name, st, want);
            }
        }
        if (h_now_ms() > end) {
            llm_client_close(c);
            H_FAIL(cl, "%d pipelines ready after %d ms, expected %s%d", got, timeout_ms, exact ? "" : ">= ", want);
        }
        h_sleep_ms(50);
    }
    llm_client_close(c);
}

static H_UNUSED void h_cluster_cleanup(struct cluster *cl, int keep_logs) {
    if (!cl) return;
    for (int i = 0; i < cl->n_workers; i++) h_proc_kill(&cl->workers[i], SIGKILL);
    h_proc_kill(&cl->router, SIGKILL);
    h_proc_kill(&cl->router2, SIGKILL);
    fixture_redis_stop(&cl->redis);
    if (cl->zctx) zmq_ctx_term(cl->zctx);
    cl->zctx = NULL;
    const char *keep = getenv("LLM_TEST_KEEP_LOGS"); /* set: logs stay, for a look after a pass */
    if (keep && *keep && cl->dir[0]) printf("  logs kept in %s\n", cl->dir);
    else if (!keep_logs && cl->dir[0]) {
        char cmd[400];
        snprintf(cmd, sizeof cmd, "rm -rf '%s'", cl->dir);
        if (system(cmd) != 0) printf("  could not remove %s\n", cl->dir);
    }
    if (h_current == cl) h_current = NULL;
    free(cl);
}

static void h_atexit(void) { h_cluster_cleanup(h_current, 1); }

/* Fresh keys for the cluster in cl->keys, and the environment its clients
 * read; or, insecure, the environment that says so. */
static H_UNUSED void h_keys_make(struct cluster *cl) {
    snprintf(cl->keys, sizeof cl->keys, "%s/curve", cl->dir);
    if (cl->insecure) {
        setenv("LLM_INSECURE", "true", 1);
        unsetenv("LLM_CURVE_KEY_FILE");
        unsetenv("LLM_ROUTER_KEY");
        return;
    }
    if (!zmq_has("curve")) TEST_SKIP("libzmq without CURVE");
    char err[512], sub[400];
    struct keys_pair kp;
    if (keys_pair_generate(&kp, err, sizeof err) < 0 || keys_pair_write(cl->keys, "router", &kp, err, sizeof err) < 0)
        TEST_FAIL("router key: %s", err);
    snprintf(sub, sizeof sub, "%s/clients", cl->keys);
    if (keys_pair_generate(&kp, err, sizeof err) < 0 || keys_pair_write(sub, "client", &kp, err, sizeof err) < 0)
        TEST_FAIL("client key: %s", err);
    snprintf(sub, sizeof sub, "%s/workers", cl->keys);
    for (int i = 0; i < H_WORKERS_MAX; i++) {
        char name[32];
        snprintf(name, sizeof name, "worker-%d", i);
        if (keys_pair_generate(&kp, err, sizeof err) < 0 || keys_pair_write(sub, name, &kp, err, sizeof err) < 0)
            TEST_FAIL("worker key: %s", err);
    }
    char path[400];
    snprintf(path, sizeof path, "%s/clients/client.key", cl->keys);
    setenv("LLM_CURVE_KEY_FILE", path, 1);
    snprintf(path, sizeof path, "%s/router.pub", cl->keys);
    setenv("LLM_ROUTER_KEY", path, 1);
    unsetenv("LLM_INSECURE");
}

/* Two loopback endpoints on ports free now. */
static H_UNUSED void h_pick_ports(char *client_ep, char *worker_ep, size_t size) {
    int p1, p2;
    char err[256];
    if (zio_free_port(NULL, &p1, err, sizeof err) != 0 || zio_free_port(NULL, &p2, err, sizeof err) != 0)
        TEST_FAIL("free port: %s", err);
    snprintf(client_ep, size, "tcp://127.0.0.1:%d", p1);
    snprintf(worker_ep, size, "tcp://127.0.0.1:%d", p2);
}

/* 1 once router p has bound its sockets (its "clients on ..." line); 0
 * when it exited because a port was taken meanwhile (bind: Address already
 * in use), for the caller to try other ports; any other exit, or no line
 * within 30 s, fails the test with the logs. */
static H_UNUSED int h_router_bound(struct cluster *cl, struct h_proc *p) {
    int64_t end = h_now_ms() + 30000;
    for (;;) {
        char *log = test_read_file(p->log, NULL);
        int bound = log && strstr(log, "clients on ") != NULL;
        int taken = log && strstr(log, "Address already in use") != NULL;
        free(log);
        if (bound) return 1;
        int st;
        if (h_proc_exited(p, &st)) {
            if (taken) return 0;
            H_FAIL(cl, "%s exited (status 0x%x) before it bound its ports", p->name, st);
        }
        if (h_now_ms() > end) H_FAIL(cl, "%s did not bind its ports within 30 s", p->name);
        h_sleep_ms(10);
    }
}

/* Starts Redis, the router and pipelines x stages workers and waits (60 s at
 * most) until every pipeline is ready.  Extra words go on the router's and
 * every worker's command line. */
static H_UNUSED struct cluster *h_cluster_start_routers(const char *model, int pipelines, int stages,
                                                        const char *router_extra, const char *worker_extra,
                                                        int n_routers) {
    static int registered;
    if (!registered) {
        atexit(h_atexit);
        registered = 1;
    }
    h_cluster_cleanup(h_current, 1); /* what a failed test left behind */
    if (pipelines * stages > H_WORKERS_MAX) TEST_FAIL("at most %d workers", H_WORKERS_MAX);
    struct cluster *cl = calloc(1, sizeof *cl);
    if (!cl) TEST_FAIL("out of memory");
    h_current = cl;
    fixture_redis_start(&cl->redis, h_redis_flags);
    snprintf(cl->dir, sizeof cl->dir, "/tmp/llm-cluster-test-XXXXXX");
    if (!mkdtemp(cl->dir)) TEST_FAIL("mkdtemp: %s", strerror(errno));
    snprintf(cl->model, sizeof cl->model, "%s", model);
    cl->pipelines = pipelines;
    cl->stages = stages;
    snprintf(cl->router_extra, sizeof cl->router_extra, "%s", router_extra ? router_extra : "");
    snprintf(cl->worker_extra, sizeof cl->worker_extra, "%s", worker_extra ? worker_extra : "");
    cl->insecure = strstr(cl->router_extra, "--insecure") != NULL;
    h_keys_make(cl);
    cl->n_routers = n_routers > 1 ? 2 : 1;
    cl->zctx = zmq_ctx_new();
    /* Each client holds a socket and its monitor's pair (and closed ones
     * linger briefly): hundreds of clients pass ZeroMQ's default 1023. */
    zmq_ctx_set(cl->zctx, ZMQ_MAX_SOCKETS, 8192);
    /* A port found free can be taken by another test's process before the
     * router binds it (ctest runs tests side by side): new ports then. */
    for (int tries = 1;; tries++) {
        char log[400];
        snprintf(log, sizeof log, "%s/router.log", cl->dir);
        unlink(log); /* a retry's log starts afresh (they append) */
        snprintf(log, sizeof log, "%s/router2.log", cl->dir);
        unlink(log);
        h_pick_ports(cl->client_ep, cl->worker_ep, sizeof cl->client_ep);
        if (cl->n_routers > 1) h_pick_ports(cl->client_ep2, cl->worker_ep2, sizeof cl->client_ep2);
        h_start_router(cl);
        int up = h_router_bound(cl, &cl->router);
        if (up && cl->n_routers > 1) {
            h_start_router2(cl);
            up = h_router_bound(cl, &cl->router2);
            if (!up) h_proc_kill(&cl->router, SIGTERM);
        }
        if (up) break;
        if (tries == 3) H_FAIL(cl, "the router could not bind its ports in %d tries", tries);
    }
    for (int p = 0; p < pipelines; p++)
        for (int s = 0; s < stages; s++) h_start_worker(cl, cl->n_workers, p, s);
    h_wait_ready(cl, pipelines, 0, 60000);
    return cl;
}

static H_UNUSED struct cluster *h_cluster_start(const char *model, int pipelines, int stages,
                                                const char *router_extra, const char *worker_extra) {
    return h_cluster_start_routers(model, pipelines, stages, router_extra, worker_extra, 1);
}

/* Stops everything and removes the logs; the test asserts on nothing left. */
static H_UNUSED void h_cluster_stop(struct cluster *cl) { h_cluster_cleanup(cl, 0); }

/* Slot of the worker of (pipeline, stage), or -1. */
static H_UNUSED int h_worker_slot(struct cluster *cl, int pipeline, int stage) {
    char prefix[32];
    snprintf(prefix, sizeof prefix, "w-p%d-s%d-", pipeline, stage);
    for (int i = 0; i < cl->n_workers; i++)
        if (cl->workers[i].pid && strncmp(cl->workers[i].name, prefix, strlen(prefix)) == 0) return i;
    return -1;
}

/* ---- reference outputs ---------------------------------------------------- */

struct h_ref {
    int32_t prompt_ids[256];
    int n_prompt;
    int32_t ids[512];
    int n;
    char text[4096];
};

/* llm-run --json of the same model and prompt, greedy. */
static H_UNUSED void h_reference(const char *model, const char *prompt, int max_tokens, int stop_at_eos,
                                 struct h_ref *ref) {
    memset(ref, 0, sizeof *ref);
    char maxs[16];
    snprintf(maxs, sizeof maxs, "%d", max_tokens);
    const char *argv[] = {H_RUN, "--model", model, "--prompt", prompt, "--max-tokens", maxs, "--json",
                          "--threads", "1", stop_at_eos ? "--stop-at-eos" : "--no-stop-at-eos", NULL};
    if (access(H_RUN, X_OK) != 0) TEST_FAIL("%s is not built", H_RUN);
    int fds[2];
    if (pipe(fds) != 0) TEST_FAIL("pipe: %s", strerror(errno));
    pid_t pid = fork();
    if (pid == 0) {
        dup2(fds[1], 1);
        close(fds[0]);
        close(fds[1]);
        alarm(60);
        execv(H_RUN, (char *const *)argv);
        _exit(127);
    }
    close(fds[1]);
    static char out[1 << 16];
    size_t len = 0;
    ssize_t got;
    while (len < sizeof out - 1 && (got = read(fds[0], out + len, sizeof out - 1 - len)) > 0) len += (size_t)got;
    out[len] = 0;
    close(fds[0]);
    int st;
    waitpid(pid, &st, 0);
    if (!WIFEXITED(st) || WEXITSTATUS(st) != 0) TEST_FAIL("llm-run on \"%s\" failed (status 0x%x)", prompt, st);
    while (len > 0 && out[len - 1] == '\n') out[--len] = 0;
    char *last = strrchr(out, '\n');
    cJSON *j = cJSON_Parse(last ? last + 1 : out);
    if (!j) TEST_FAIL("llm-run printed no JSON on its last line: %s", out);
    cJSON *it;
    cJSON_ArrayForEach(it, cJSON_GetObjectItem(j, "prompt_ids")) if (ref->n_prompt < 256) ref->prompt_ids[ref->n_prompt++] = it->valueint;
    cJSON_ArrayForEach(it, cJSON_GetObjectItem(j, "ids")) if (ref->n < 512) ref->ids[ref->n++] = it->valueint;
    cJSON *t = cJSON_GetObjectItem(j, "text");
    snprintf(ref->text, sizeof ref->text, "%s", cJSON_IsString(t) ? t->valuestring : "");
    cJSON_Delete(j);
}

/* ---- generations ---------------------------------------------------------- */

struct h_gen {
    /* in */
    struct cluster *cl;
    char request_id[64];
    const char *prompt;
    int max_tokens;
    int ignore_eos;
    int32_t priority;
    int cancel_after;   /* > 0: the callback cancels after this many tokens */
    int retry_ms;       /* the client's give-up time without answers (default 60 s) */
    int reply_ms;       /* the client's reply timeout (default 5 s) */
    int idle_ms;        /* the client's idle timeout once accepted (default 10 s) */
    int wait_ms;        /* the bound on the whole call (default 90 s) */
    /* out */
    int rc;
    char err[512];
    struct llm_generate_result res;
    int32_t ids[512];
    int n;
    char text[4096];
    int callbacks, out_of_order;
    int64_t first_token_ms;  /* h_now_ms() of the first token, 0 before */
    int64_t last_token_ms;   /* h_now_ms() of the latest token */
};

static int h_on_chunk(void *ud, const struct llm_chunk *ch) {
    struct h_gen *g = ud;
    g->callbacks++;
    if ((int)ch->index != g->n) g->out_of_order++;
    int64_t now = h_now_ms();
    if (!g->first_token_ms) __atomic_store_n(&g->first_token_ms, now, __ATOMIC_RELEASE);
    g->last_token_ms = now;
    int64_t mark = __atomic_load_n(&h_mark_ms, __ATOMIC_ACQUIRE), none = 0;
    if (mark && now >= mark)
        __atomic_compare_exchange_n(&h_first_after_mark_ms, &none, now, 0, __ATOMIC_ACQ_REL, __ATOMIC_ACQUIRE);
    for (size_t i = 0; i < ch->n_tokens; i++) {
        if (g->n < 512) g->ids[g->n] = ch->token_ids[i];
        g->n++;
    }
    size_t l = strlen(g->text);
    snprintf(g->text + l, sizeof g->text - l, "%s", ch->text);
    return g->cancel_after > 0 && g->n >= g->cancel_after;
}

/* One generation, greedy, on its own client. */
static H_UNUSED void h_generate(struct h_gen *g) {
    llm_client *c = h_client(g->cl, g->reply_ms > 0 ? g->reply_ms : 5000, g->idle_ms > 0 ? g->idle_ms : 10000,
                             g->retry_ms > 0 ? g->retry_ms : 60000);
    struct llm_generate_params p;
    llm_generate_params_default(&p);
    p.request_id = g->request_id[0] ? g->request_id : NULL;
    p.prompt = g->prompt;
    p.max_tokens = (uint32_t)g->max_tokens;
    p.sampling.ignore_eos = g->ignore_eos;
    p.priority = g->priority;
    p.wait_ms = g->wait_ms > 0 ? g->wait_ms : 90000;
    g->rc = llm_client_generate(c, &p, h_on_chunk, g, &g->res);
    if (g->rc != 0) snprintf(g->err, sizeof g->err, "%s", llm_client_errstr(c));
    llm_client_close(c);
}

static void *h_gen_thread(void *arg) {
    h_generate(arg);
    return NULL;
}

/* Runs n generations at once, one thread each, and joins them. */
static H_UNUSED void h_generate_all(struct h_gen *gs, int n) {
    pthread_t *th = calloc((size_t)n, sizeof *th);
    for (int i = 0; i < n; i++) pthread_create(&th[i], NULL, h_gen_thread, &gs[i]);
    for (int i = 0; i < n; i++) pthread_join(th[i], NULL);
    free(th);
}

struct h_batch {
    struct h_gen *gs;
    int n;
    pthread_t th;
};

static void *h_batch_thread(void *arg) {
    struct h_batch *b = arg;
    h_generate_all(b->gs, b->n);
    return NULL;
}

/* Starts h_generate_all in the background; h_batch_join waits for it. */
static H_UNUSED void h_batch_start(struct h_batch *b, struct h_gen *gs, int n) {
    b->gs = gs;
    b->n = n;
    pthread_create(&b->th, NULL, h_batch_thread, b);
}
static H_UNUSED void h_batch_join(struct h_batch *b) { pthread_join(b->th, NULL); }

/* Tokens received so far over all of gs (racy read: a progress hint). */
static H_UNUSED int h_tokens_seen(const struct h_gen *gs, int n) {
    int t = 0;
    for (int i = 0; i < n; i++) t += __atomic_load_n(&gs[i].n, __ATOMIC_RELAXED);
    return t;
}

/* Checks one finished generation against its reference, token for token:
 * every token exactly once (the callback saw the chunks in order, the
 * router's completion count equals what arrived) and the same ids and text
 * as llm-run. */
static H_UNUSED void h_check(struct cluster *cl, const struct h_gen *g, const struct h_ref *ref) {
    H_ASSERT(cl, g->rc == 0, "request %s (\"%.40s\", %d tokens): status %d: %s", g->res.request_id, g->prompt,
             g->max_tokens, g->rc, g->err);
    H_ASSERT(cl,
             g->res.finish_reason == LLM__GENERATE_DONE__FINISH_REASON__LENGTH ||
                 g->res.finish_reason == LLM__GENERATE_DONE__FINISH_REASON__STOP,
             "request %s: finish %s (%s: %s)", g->res.request_id, llm_finish_reason_name(g->res.finish_reason),
             proto_code_name(g->res.error_code), g->res.error_message);
    H_ASSERT(cl, g->out_of_order == 0, "request %s: %d chunks out of order", g->res.request_id, g->out_of_order);
    int want = ref->n < g->max_tokens ? ref->n : g->max_tokens;
    H_ASSERT(cl, g->n == want, "request %s (\"%.40s\"): %d tokens, llm-run gave %d", g->res.request_id, g->prompt,
             g->n, want);
    H_ASSERT(cl, (int)g->res.completion_tokens == g->n, "request %s: the router counts %u completion tokens, "
             "the client received %d", g->res.request_id, g->res.completion_tokens, g->n);
    for (int i = 0; i < want; i++)
        H_ASSERT(cl, g->ids[i] == ref->ids[i], "request %s (\"%.40s\"): token %d is %d, llm-run has %d",
                 g->res.request_id, g->prompt, i, g->ids[i], ref->ids[i]);
    if (want == ref->n)
        H_ASSERT(cl, strcmp(g->text, ref->text) == 0, "request %s: text \"%s\", llm-run \"%s\"", g->res.request_id,
                 g->text, ref->text);
    else
        H_ASSERT(cl, strncmp(g->text, ref->text, strlen(g->text)) == 0,
                 "request %s: text \"%s\" is not a prefix of llm-run's \"%s\"", g->res.request_id, g->text,
                 ref->text);
}


/* ---- metrics ports ---- */

/* GET path; returns the status (-1: no answer) with the body in body. */
static H_UNUSED int h_http_get(int port, const char *path, char *body, size_t size) {
    body[0] = 0;
    int fd = socket(AF_INET, SOCK_STREAM, 0);
    struct timeval tv = {5, 0};
    setsockopt(fd, SOL_SOCKET, SO_RCVTIMEO, &tv, sizeof tv);
    struct sockaddr_in sa = {.sin_family = AF_INET, .sin_port = htons((uint16_t)port)};
    sa.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
    if (connect(fd, (struct sockaddr *)&sa, sizeof sa) != 0) {
        close(fd);
        return -1;
    }
    char req[256];
    int n = snprintf(req, sizeof req, "GET %s HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n", path);
    if (write(fd, req, (size_t)n) != n) {
        close(fd);
        return -1;
    }
    size_t cap = 1 << 20, len = 0;
    char *raw = malloc(cap);
    ssize_t got;
    while (len < cap - 1 && (got = read(fd, raw + len, cap - 1 - len)) > 0) len += (size_t)got;
    close(fd);
    raw[len] = 0;
    int status = -1;
    char *end = strstr(raw, "\r\n\r\n");
    if (end && sscanf(raw, "HTTP/1.%*d %d", &status) == 1) snprintf(body, size, "%s", end + 4);
    free(raw);
    return status;
}

/* The value of the sample line that starts with `series ` in text, or -1. */
static H_UNUSED double h_sample(const char *text, const char *series) {
    size_t n = strlen(series);
    for (const char *p = text; p && *p; p = strchr(p, '\n'), p = p ? p + 1 : NULL)
        if (strncmp(p, series, n) == 0 && p[n] == ' ') return strtod(p + n + 1, NULL);
    return -1;
}

/* The port a process logged ("metrics on http://... (port N)"), waiting for
 * the line (bounded); -1 when it never came. */
static H_UNUSED int h_logged_port(struct h_proc *p) {
    int64_t end = h_now_ms() + 10000;
    while (h_now_ms() < end) {
        char *log = test_read_file(p->log, NULL);
        const char *at = log ? strstr(log, "metrics on http://") : NULL;
        at = at ? strstr(at, "(port ") : NULL;
        int port = at ? atoi(at + 6) : -1;
        free(log);
        if (port > 0) return port;
        h_sleep_ms(50);
    }
    return -1;
}

#endif
