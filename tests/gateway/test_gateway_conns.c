/* Tests of llm-gateway's connections, in front of a real cluster
 * (tests/gateway/gw_fixture.h): slow clients (a slowloris on the API and
 * metrics ports, the read deadline against a request that waits for its
 * worker), a streaming client that hangs up (its request is cancelled in
 * the router), and runner threads reused from one request to the next. */
#include "tests/gateway/gw_fixture.h"

#include <stdatomic.h>
#include <sys/resource.h>

/* ---- slow clients ------------------------------------------------------------ */

/* One request on a fresh connection to 127.0.0.1:port ("Connection: close"
 * in req), read to its end; status, or -1.  Waits at most 5 s. */
static int raw_http(int port, const char *req, char *body, size_t size) {
    int fd = socket(AF_INET, SOCK_STREAM, 0);
    if (fd < 0) return -1;
    struct timeval tv = {5, 0};
    setsockopt(fd, SOL_SOCKET, SO_RCVTIMEO, &tv, sizeof tv);
    setsockopt(fd, SOL_SOCKET, SO_SNDTIMEO, &tv, sizeof tv);
    struct sockaddr_in sa = {.sin_family = AF_INET, .sin_port = htons((uint16_t)port)};
    sa.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
    ssize_t n = (ssize_t)strlen(req);
    if (connect(fd, (struct sockaddr *)&sa, sizeof sa) != 0 || write(fd, req, (size_t)n) != n) {
        close(fd);
        return -1;
    }
    size_t len = 0;
    ssize_t got;
    while (len + 1 < size && (got = read(fd, body + len, size - 1 - len)) > 0) len += (size_t)got;
    close(fd);
    body[len] = 0;
    int status = -1;
    if (sscanf(body, "HTTP/1.%*d %d", &status) != 1) return -1;
    return status;
}

/* A slowloris: LORIS_N connections that never finish a request, half idle,
 * half sending one more byte of a header every tick; one the server closes
 * is opened again at the next tick, as an attacker would.  Its own thread. */
#define LORIS_N 500
#define LORIS_TICK_MS 200

struct loris {
    int port;
    const char *head;
    int fd[LORIS_N];
    atomic_int stop, opened, closed;
    pthread_t th;
};

static int loris_connect(int port) {
    int fd = socket(AF_INET, SOCK_STREAM | SOCK_NONBLOCK, 0);
    if (fd < 0) return -1;
    struct sockaddr_in sa = {.sin_family = AF_INET, .sin_port = htons((uint16_t)port)};
    sa.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
    if (connect(fd, (struct sockaddr *)&sa, sizeof sa) != 0 && errno != EINPROGRESS) {
        close(fd);
        return -1;
    }
    return fd;
}

static bool loris_alive(int fd) {
    char buf[512];
    for (;;) {
        ssize_t n = recv(fd, buf, sizeof buf, MSG_DONTWAIT);
        if (n > 0) continue;
        if (n == 0) return false;
        return errno == EAGAIN || errno == EWOULDBLOCK || errno == ENOTCONN || errno == EINTR;
    }
}

static void *loris_main(void *arg) {
    struct loris *l = arg;
    size_t sent[LORIS_N] = {0}, hl = strlen(l->head);
    while (!atomic_load(&l->stop)) {
        for (int i = 0; i < LORIS_N; i++) {
            if (l->fd[i] >= 0 && !loris_alive(l->fd[i])) {
                close(l->fd[i]);
                l->fd[i] = -1;
                atomic_fetch_add(&l->closed, 1);
            }
            if (l->fd[i] < 0) {
                l->fd[i] = loris_connect(l->port);
                sent[i] = 0;
                if (l->fd[i] >= 0) atomic_fetch_add(&l->opened, 1);
                continue;
            }
            if (i % 2 == 1) {
                char b = sent[i] < hl ? l->head[sent[i]] : 'a';
                if (send(l->fd[i], &b, 1, MSG_NOSIGNAL | MSG_DONTWAIT) == 1) sent[i]++;
            }
        }
        h_sleep_ms(LORIS_TICK_MS);
    }
    for (int i = 0; i < LORIS_N; i++)
        if (l->fd[i] >= 0) close(l->fd[i]);
    return NULL;
}

static void loris_start(struct loris *l, int port, const char *head) {
    memset(l, 0, sizeof *l);
    l->port = port;
    l->head = head;
    for (int i = 0; i < LORIS_N; i++) l->fd[i] = -1;
    ASSERT_EQ(0, pthread_create(&l->th, NULL, loris_main, l));
}

static void loris_stop(struct loris *l) {
    atomic_store(&l->stop, 1);
    pthread_join(l->th, NULL);
}

/* 500 idle or trickling connections on the API port and 500 more on the
 * metrics port, coming back as they are closed: a fresh client still gets
 * /v1/models and /health within 1 s, every time over 3 s, and a completion.
 * The gateway runs with its defaults (256 connections, 10 s to send a
 * request); before, 256 idle connections shut everyone out for 60 s and
 * 32 shut out /health for 10 s. */
TEST(slowloris) {
    setup();
    struct rlimit rl;
    if (getrlimit(RLIMIT_NOFILE, &rl) == 0 && rl.rlim_cur < 4 * LORIS_N) {
        rl.rlim_cur = rl.rlim_max < 4 * LORIS_N ? rl.rlim_max : 4 * LORIS_N;
        setrlimit(RLIMIT_NOFILE, &rl);
        if (rl.rlim_cur < 4 * LORIS_N)
            TEST_SKIP("ulimit -n is %llu: 2 x %d slow connections need %d", (unsigned long long)rl.rlim_cur, LORIS_N,
                      4 * LORIS_N);
    }
    struct gw g;
    memset(&g, 0, sizeof g);
    gw_start(cl_, &g, "gateway-slowloris", cl_->client_ep, "");
    int mport = atoi(strrchr(g.metrics_url, ':') + 1);
    static struct loris api, met;
    loris_start(&api, g.port, "POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\nX-Slow: ");
    loris_start(&met, mport, "GET /health HTTP/1.1\r\nHost: x\r\nX-Slow: ");
    int64_t end = h_now_ms() + 10000;
    while ((atomic_load(&api.opened) < LORIS_N || atomic_load(&met.opened) < LORIS_N) && h_now_ms() < end)
        h_sleep_ms(20);
    h_sleep_ms(3 * LORIS_TICK_MS);
    static char body[65536];
    int64_t worst_api = 0, worst_health = 0;
    const char *fail = NULL;
    int status = 0;
    int64_t took = 0;
    for (int i = 0; i < 10 && !fail; i++) {
        int64_t t0 = h_now_ms();
        status = raw_http(g.port, "GET /v1/models HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n", body, sizeof body);
        took = h_now_ms() - t0;
        if (status != 200 || took > 1000) fail = "/v1/models";
        if (took > worst_api) worst_api = took;
        if (fail) break;
        t0 = h_now_ms();
        status = raw_http(mport, "GET /health HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n", body, sizeof body);
        took = h_now_ms() - t0;
        if (status != 200 || took > 1000) fail = "/health";
        if (took > worst_health) worst_health = took;
        h_sleep_ms(300);
    }
    int64_t t0 = h_now_ms();
    int cstatus = fail ? 0 : raw_http(g.port, "POST /v1/completions HTTP/1.1\r\nHost: x\r\nConnection: close\r\n"
                                      "Content-Type: application/json\r\nContent-Length: 31\r\n\r\n"
                                      "{\"prompt\":\"a\",\"max_tokens\":2}  ", body, sizeof body);
    int64_t ctook = h_now_ms() - t0;
    int a_open = atomic_load(&api.opened), a_closed = atomic_load(&api.closed);
    int m_open = atomic_load(&met.opened), m_closed = atomic_load(&met.closed);
    loris_stop(&api);
    loris_stop(&met);
    if (fail)
        H_FAIL(cl_, "%s under %d slow connections: status %d after %lld ms (expected 200 within 1000 ms)", fail,
               LORIS_N, status, (long long)took);
    printf("  under 2 x %d slow connections: /v1/models within %lld ms, /health within %lld ms, a completion %d in "
           "%lld ms; the gateway closed %d of %d on its API port and %d of %d on its metrics port\n",
           LORIS_N, (long long)worst_api, (long long)worst_health, cstatus, (long long)ctook, a_closed, a_open,
           m_closed, m_open);
    H_ASSERT(cl_, cstatus == 200 && ctook < 5000, "a completion under the slowloris: status %d in %lld ms: %s", cstatus,
             (long long)ctook, body);
    /* It still serves once they are gone. */
    struct resp r;
    post(cl_, &g, "/v1/completions", NULL, "{\"prompt\":\"a\",\"max_tokens\":2}", &r);
    H_ASSERT(cl_, r.status == 200, "after the slowloris: %d %s", r.status, r.body);
    resp_free(&r);
    h_proc_kill(&g.proc, SIGTERM);
}

/* The read deadline bounds sending a request, not answering it: with
 * --read-timeout-ms 1000, a trickling header is closed after about 1 s,
 * while a streamed request whose worker is stopped for 5 s still ends
 * with its whole answer, within 10 s of the SIGCONT.  5 s is past the 3 s
 * ZeroMQ heartbeat timeout of the worker's connection to the router (and
 * its 3 s Redis key): the connection breaks, or the worker is lost, and
 * the request must still be answered once it is back (it waited for
 * curl's 30 s when the plan on the broken connection was lost;
 * tests/router/test_cluster_pause.c measures the recovery).  A lost
 * worker leaves no pipeline in service, which the gateway waits out for
 * --router-retry-ms before it answers 503: 20 s here instead of the 5 s
 * default, which a 5 s stop would reach.  The clock starts before connect(): the handshake
 * completes inside it and the gateway may accept (and start the deadline)
 * before connect() returns, so a clock read after it is late by however
 * long a busy machine keeps this thread off a core, and the lower bound
 * could fail by that much. */
TEST(read_deadline) {
    setup();
    struct gw g;
    memset(&g, 0, sizeof g);
    gw_start(cl_, &g, "gateway-deadline", cl_->client_ep, "--read-timeout-ms 1000 --router-retry-ms 20000");
    int64_t t0 = h_now_ms(), closed_at = 0;
    int fd = loris_connect(g.port);
    H_ASSERT(cl_, fd >= 0, "connect to %d", g.port);
    const char *head = "POST /v1/completions HTTP/1.1\r\nHost: x\r\nX-Slow: ";
    for (size_t k = 0; h_now_ms() - t0 < 8000; k++) {
        char b = k < strlen(head) ? head[k] : 'a';
        if (!loris_alive(fd) || send(fd, &b, 1, MSG_NOSIGNAL | MSG_DONTWAIT) < 0) {
            closed_at = h_now_ms() - t0;
            break;
        }
        h_sleep_ms(50);
    }
    close(fd);
    H_ASSERT(cl_, closed_at > 0, "a connection trickling a header was still open after 8 s (deadline 1 s)");
    printf("  a trickling connection was closed after %lld ms\n", (long long)closed_at);
    H_ASSERT(cl_, closed_at >= 800 && closed_at <= 4000, "closed after %lld ms, expected about 1000",
             (long long)closed_at);

    pid_t worker = cl_->workers[0].pid;
    H_ASSERT(cl_, worker > 0, "no worker");
    kill(worker, SIGSTOP);
    char url[128];
    snprintf(url, sizeof url, "%s/v1/completions", g.url);
    int64_t t_post = h_now_ms();
    pid_t cont = fork();
    if (cont == 0) {
        usleep(5000 * 1000);
        kill(worker, SIGCONT);
        _exit(0);
    }
    struct resp r;
    post(cl_, &g, "/v1/completions", NULL, "{\"prompt\":\"a\",\"max_tokens\":8,\"stream\":true}", &r);
    int64_t took = h_now_ms() - t_post;
    kill(worker, SIGCONT);
    waitpid(cont, NULL, 0);
    H_ASSERT(cl_, r.status == 200 && strstr(r.body, "data: [DONE]"), "a request that waited 5 s: %d %s", r.status,
             r.body);
    printf("  a request sent while its worker was stopped 5 s was answered after %lld ms\n", (long long)took);
    H_ASSERT(cl_, took < 15000, "answered %lld ms after it was sent (the worker stopped 5 s; bound 15 s)",
             (long long)took);
    resp_free(&r);
    h_proc_kill(&g.proc, SIGTERM);
}


/* ---- clients that hang up, runner threads ----------------------------------- */

/* A streaming client that hangs up cancels its request in the cluster.
 * The worker is stopped (SIGSTOP) so that the request is still waiting for
 * its first token when curl gives up: the gateway must notice the closed
 * socket by itself, not by a failed write. */
TEST(disconnect_cancels) {
    setup();
    struct resp r;
    char url[128];
    snprintf(url, sizeof url, "%s/v1/completions", gw_open.url);
    const char *body = "{\"prompt\":\"a\",\"max_tokens\":100,\"ignore_eos\":true,\"stream\":true}";
    const char *quick[] = {"--max-time", "1", NULL};
    pid_t worker = cl_->workers[0].pid;
    H_ASSERT(cl_, worker > 0, "no worker");
    kill(worker, SIGSTOP);
    curl(cl_, "POST", url, NULL, body, strlen(body), quick, &r);
    resp_free(&r);
    char log[8192];
    int64_t end = h_now_ms() + 5000;
    for (;;) {
        h_tail(gw_open.proc.log, log, sizeof log, 40);
        if (strstr(log, "went away; cancelling")) break;
        if (h_now_ms() > end) {
            kill(worker, SIGCONT);
            H_FAIL(cl_, "the gateway did not cancel after the client hung up: %s", log);
        }
        h_sleep_ms(50);
    }
    kill(worker, SIGCONT);
    /* The router ends it: nothing keeps running. */
    llm_client *c = h_client(cl_, 2000, 30000, 5000);
    end = h_now_ms() + 10000;
    for (;;) {
        Llm__ClientEnvelope *rep = NULL;
        ASSERT_OK(llm_client_status(c, &rep));
        uint32_t running = rep->status_reply->running, queued = rep->status_reply->queue_depth;
        proto_client_free(rep);
        if (running == 0 && queued == 0) break;
        if (h_now_ms() > end) H_FAIL(cl_, "%u requests still running after the cancel", running);
        h_sleep_ms(50);
    }
    llm_client_close(c);
}

/* The threads of a process (/proc/PID/status), or -1. */
static int proc_threads(pid_t pid) {
    char path[64], line[256];
    snprintf(path, sizeof path, "/proc/%d/status", (int)pid);
    FILE *f = fopen(path, "r");
    if (!f) return -1;
    int n = -1;
    while (fgets(line, sizeof line, f))
        if (sscanf(line, "Threads: %d", &n) == 1) break;
    fclose(f);
    return n;
}

/* Waits up to 3 s for the gateway to have want threads; returns the count. */
static int threads_settle(const struct gw *g, int want) {
    int n = proc_threads(g->proc.pid);
    for (int64_t end = h_now_ms() + 3000; n != want && h_now_ms() < end; n = proc_threads(g->proc.pid)) h_sleep_ms(20);
    return n;
}

/* A generation runs on a runner thread that stays for the next one instead
 * of a thread per request (a new thread costs time to the first token): one
 * request leaves one idle runner, four more one after another reuse it, and
 * the gateway still stops at once with it idle. */
TEST(runners_reused) {
    setup();
    struct gw g;
    memset(&g, 0, sizeof g);
    gw_start(cl_, &g, "gateway-runners", cl_->client_ep, "");
    /* /v1/models first: it opens a router client on the connection's own
     * thread, which starts ZeroMQ's threads, and runs no generation. */
    struct resp m;
    char url[128];
    snprintf(url, sizeof url, "%s/v1/models", g.url);
    curl(cl_, "GET", url, NULL, NULL, 0, NULL, &m);
    H_ASSERT(cl_, m.status == 200, "/v1/models: %d %s", m.status, m.body);
    resp_free(&m);
    int base = proc_threads(g.proc.pid);
    H_ASSERT(cl_, base > 0, "no thread count for pid %d", (int)g.proc.pid);
    h_sleep_ms(200);
    for (int prev = -1; base != prev;) {
        prev = base;
        h_sleep_ms(100);
        base = proc_threads(g.proc.pid);
    }
    const char *body = "{\"prompt\":\"" PROMPT "\",\"max_tokens\":8,\"stream\":true}";
    for (int i = 0; i < 5; i++) {
        struct resp r;
        post(cl_, &g, "/v1/completions", NULL, body, &r);
        H_ASSERT(cl_, r.status == 200 && strstr(r.body, "data: [DONE]"), "request %d: %d %s", i, r.status, r.body);
        resp_free(&r);
        /* The connection's thread ends with the connection; the runner stays. */
        int n = threads_settle(&g, base + 1);
        H_ASSERT(cl_, n == base + 1, "after %d sequential requests the gateway has %d threads, expected %d (%d "
                 "before any generation and one idle runner)", i + 1, n, base + 1, base);
    }
    int64_t t0 = h_now_ms();
    h_proc_kill(&g.proc, SIGTERM);
    H_ASSERT(cl_, g.proc.pid == 0 && h_now_ms() - t0 < 2000, "the gateway took %lld ms to stop with an idle runner",
             (long long)(h_now_ms() - t0));
}

TEST_MAIN(slowloris, read_deadline, disconnect_cancels, runners_reused, teardown)
