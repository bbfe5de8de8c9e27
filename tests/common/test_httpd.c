/* Tests for common/httpd: real HTTP requests over loopback to a server on an
 * ephemeral port (a plain socket client): /metrics, /health, /ready with its
 * callback, 404 and 405, HEAD, bad and busy addresses, concurrent scrapes,
 * that stopping releases the port and every descriptor, and that 500 idle
 * and trickling connections (slowloris) neither keep /health from a fresh
 * client nor outlive the read deadline; promtool checks what /metrics
 * served. */
#include "common/httpd.h"
#include "common/metrics.h"
#include "common/status.h"
#include "tests/test.h"

#include <arpa/inet.h>
#include <dirent.h>
#include <errno.h>
#include <fcntl.h>
#include <stdbool.h>
#include <sys/resource.h>
#include <time.h>
#include <netinet/in.h>
#include <pthread.h>
#include <stdatomic.h>
#include <sys/socket.h>
#include <sys/time.h>
#include <sys/wait.h>
#include <unistd.h>

struct t_reply {
    int status;        /* HTTP status, or -1 when the exchange failed */
    char head[2048];   /* status line and headers */
    char body[65536];
    size_t body_len;
};

static int64_t t_now_ms(void) {
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (int64_t)ts.tv_sec * 1000 + ts.tv_nsec / 1000000;
}

static void t_sleep_ms(int ms) {
    struct timespec ts = {ms / 1000, (long)(ms % 1000) * 1000000L};
    nanosleep(&ts, NULL);
}

/* One request on a fresh connection ("Connection: close"), written
 * pause_ms after connecting, the whole reply read until the server closes;
 * 5 s bounds every wait. */
static int t_http_raw(int port, const char *req, int pause_ms, struct t_reply *r);

static int t_http(int port, const char *method, const char *path, struct t_reply *r) {
    char req[512];
    snprintf(req, sizeof req, "%s %s HTTP/1.1\r\nHost: 127.0.0.1\r\nConnection: close\r\n\r\n",
             method, path);
    return t_http_raw(port, req, 0, r);
}

/* The request as given (headers and body). */
static int t_http_raw(int port, const char *req, int pause_ms, struct t_reply *r) {
    memset(r, 0, sizeof *r);
    r->status = -1;
    int fd = socket(AF_INET, SOCK_STREAM, 0);
    if (fd < 0) return -1;
    struct timeval tv = {5, 0};
    setsockopt(fd, SOL_SOCKET, SO_RCVTIMEO, &tv, sizeof tv);
    setsockopt(fd, SOL_SOCKET, SO_SNDTIMEO, &tv, sizeof tv);
    struct sockaddr_in sa = {0};
    sa.sin_family = AF_INET;
    sa.sin_port = htons((uint16_t)port);
    sa.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
    if (connect(fd, (struct sockaddr *)&sa, sizeof sa) != 0) {
        close(fd);
        return -1;
    }
    if (pause_ms > 0) t_sleep_ms(pause_ms);
    ssize_t n = (ssize_t)strlen(req);
    if (write(fd, req, (size_t)n) != n) {
        close(fd);
        return -1;
    }
    size_t cap = sizeof r->head + sizeof r->body, len = 0;
    char *raw = malloc(cap);
    ssize_t got;
    while (raw && len < cap - 1 && (got = read(fd, raw + len, cap - 1 - len)) > 0)
        len += (size_t)got;
    close(fd);
    if (!raw) return -1;
    raw[len] = 0;
    char *end = strstr(raw, "\r\n\r\n");
    size_t head_len = end ? (size_t)(end - raw) : 0;
    if (!end || sscanf(raw, "HTTP/1.%*d %d", &r->status) != 1 || head_len >= sizeof r->head ||
        len - head_len - 4 >= sizeof r->body) {
        free(raw);
        return -1;
    }
    memcpy(r->head, raw, head_len);
    r->head[head_len] = 0;
    r->body_len = len - head_len - 4;
    memcpy(r->body, end + 4, r->body_len);
    r->body[r->body_len] = 0;
    free(raw);
    return 0;
}

static int t_fds(void) {
    int n = 0;
    DIR *d = opendir("/proc/self/fd");
    if (!d) return -1;
    while (readdir(d)) n++;
    closedir(d);
    return n;
}

struct t_state {
    metrics_series *refreshed;
    atomic_int refreshes;
    atomic_int ready;
};

static void t_refresh(void *ud) {
    struct t_state *s = ud;
    int n = atomic_fetch_add(&s->refreshes, 1) + 1;
    metrics_gauge_set(s->refreshed, n);
}

static const char *t_ready(void *ud, char *buf, size_t size) {
    struct t_state *s = ud;
    if (atomic_load(&s->ready)) return NULL;
    snprintf(buf, size, "no pipeline in service (%d workers)", 0);
    return buf;
}

static const double t_bounds[] = {0.01, 0.1, 1};

static metrics *t_registry(struct t_state *st) {
    metrics *m;
    char err[256];
    metrics_family *g, *c, *h;
    static const char *const reason[] = {"finished_reason", NULL};
    if (metrics_init(&m) != 0 ||
        metrics_family_new(m, &(struct metrics_def){.type = METRICS_GAUGE,
            .name = "llm_scrapes", .help = "Scrapes served so far."}, &g, err, sizeof err) ||
        metrics_family_new(m, &(struct metrics_def){.type = METRICS_COUNTER,
            .name = "llm_request_success_total", .help = "Requests finished.",
            .labels = reason}, &c, err, sizeof err) ||
        metrics_family_new(m, &(struct metrics_def){.type = METRICS_HISTOGRAM,
            .name = "llm_e2e_request_latency_seconds", .help = "End to end.",
            .bounds = t_bounds, .n_bounds = 3}, &h, err, sizeof err))
        TEST_FAIL("registry: %s", err);
    st->refreshed = metrics_series_get(g, NULL);
    metrics_counter_add(metrics_series_get(c, (const char *[]){"stop"}), 3);
    metrics_histogram_observe(metrics_series_get(h, NULL), 0.05);
    return m;
}

TEST(httpd_serves_metrics_health_ready) {
    struct t_state st = {0};
    metrics *m = t_registry(&st);
    int fds_before = t_fds();
    httpd *h = NULL;
    char err[256] = "";
    struct httpd_config c = {.listen = "127.0.0.1:0", .registry = m, .refresh = t_refresh,
                             .refresh_ud = &st, .ready = t_ready, .ready_ud = &st};
    ASSERT_OK(httpd_start(&h, &c, err, sizeof err));
    int port = httpd_port(h);
    ASSERT_TRUE(port > 0 && port <= 65535);
    static struct t_reply r;

    ASSERT_OK(t_http(port, "GET", "/metrics", &r));
    ASSERT_EQ(200, r.status);
    ASSERT_TRUE(strstr(r.head, "Content-Type: text/plain; version=0.0.4; charset=utf-8") != NULL);
    ASSERT_EQ(1, atomic_load(&st.refreshes));
    char *text;
    ASSERT_OK(metrics_render(m, &text, NULL));
    ASSERT_STREQ(text, r.body); /* the refresh ran before the render */
    ASSERT_TRUE(strstr(r.body, "llm_scrapes 1\n") != NULL);
    ASSERT_TRUE(strstr(r.body, "llm_request_success_total{finished_reason=\"stop\"} 3\n") != NULL);
    ASSERT_TRUE(strstr(r.body, "llm_e2e_request_latency_seconds_bucket{le=\"0.1\"} 1\n") != NULL);
    free(text);
    ASSERT_OK(t_http(port, "GET", "/metrics?x=1", &r));
    ASSERT_TRUE(strstr(r.body, "llm_scrapes 2\n") != NULL);

    ASSERT_OK(t_http(port, "GET", "/health", &r));
    ASSERT_EQ(200, r.status);
    ASSERT_STREQ("ok\n", r.body);

    ASSERT_OK(t_http(port, "GET", "/ready", &r));
    ASSERT_EQ(503, r.status);
    ASSERT_STREQ("not ready: no pipeline in service (0 workers)\n", r.body);
    atomic_store(&st.ready, 1);
    ASSERT_OK(t_http(port, "GET", "/ready", &r));
    ASSERT_EQ(200, r.status);
    ASSERT_STREQ("ready\n", r.body);

    ASSERT_OK(t_http(port, "GET", "/nothing/here", &r));
    ASSERT_EQ(404, r.status);
    ASSERT_TRUE(strstr(r.body, "/nothing/here") != NULL);
    ASSERT_OK(t_http(port, "POST", "/metrics", &r));
    ASSERT_EQ(405, r.status);
    ASSERT_TRUE(strstr(r.head, "Allow: GET, HEAD") != NULL);
    ASSERT_TRUE(strstr(r.body, "POST") != NULL);
    /* A body is refused unread. */
    ASSERT_OK(t_http_raw(port, "POST /ready HTTP/1.1\r\nHost: x\r\nContent-Length: 11\r\n"
                               "Connection: close\r\n\r\nhello=world",
                          0, &r));
    ASSERT_EQ(405, r.status);
    ASSERT_OK(t_http(port, "DELETE", "/health", &r));
    ASSERT_EQ(405, r.status);
    ASSERT_OK(t_http(port, "HEAD", "/health", &r));
    ASSERT_EQ(200, r.status);
    ASSERT_EQ((size_t)0, r.body_len);
    /* Refreshes ran for the two GETs of /metrics only. */
    ASSERT_EQ(2, atomic_load(&st.refreshes));

    httpd_stop(h);
    /* The port and every descriptor are released: the port binds again. */
    ASSERT_EQ(fds_before, t_fds());
    ASSERT_EQ(-1, t_http(port, "GET", "/health", &r));
    int fd = socket(AF_INET, SOCK_STREAM, 0);
    int one = 1;
    setsockopt(fd, SOL_SOCKET, SO_REUSEADDR, &one, sizeof one);
    struct sockaddr_in sa = {.sin_family = AF_INET, .sin_port = htons((uint16_t)port)};
    sa.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
    ASSERT_EQ(0, bind(fd, (struct sockaddr *)&sa, sizeof sa));
    close(fd);
    metrics_free(m);
}

TEST(httpd_without_registry_or_ready) {
    httpd *h = NULL;
    char err[256] = "";
    ASSERT_OK(httpd_start(&h, &(struct httpd_config){.listen = "localhost:0"}, err, sizeof err));
    static struct t_reply r;
    ASSERT_OK(t_http(httpd_port(h), "GET", "/metrics", &r));
    ASSERT_EQ(200, r.status);
    ASSERT_EQ((size_t)0, r.body_len);
    ASSERT_OK(t_http(httpd_port(h), "GET", "/ready", &r));
    ASSERT_EQ(200, r.status);
    httpd_stop(h);
    httpd_stop(NULL);
}

static void t_bad(const char *listen, int want, const char *says) {
    httpd *h = NULL;
    char err[256] = "";
    int rc = httpd_start(&h, &(struct httpd_config){.listen = listen}, err, sizeof err);
    if (rc != want) TEST_FAIL("%s: expected status %d, got %d (%s)", listen, want, rc, err);
    if (!strstr(err, says)) TEST_FAIL("%s: message \"%s\" does not say \"%s\"", listen, err, says);
    printf("  %s -> %s\n", listen, err);
}

TEST(httpd_refuses_bad_addresses) {
    int fds_before = t_fds();
    t_bad("nonsense", STATUS_BAD_INPUT, "'nonsense': expected HOST:PORT");
    t_bad("127.0.0.1:99999", STATUS_BAD_INPUT, "port '99999'");
    t_bad("127.0.0.1:http", STATUS_BAD_INPUT, "port 'http'");
    t_bad("127.0.0.1:", STATUS_BAD_INPUT, "port ''");
    t_bad("127.0.0.1:-1", STATUS_BAD_INPUT, "port '-1'");
    t_bad("::1:9464", STATUS_BAD_INPUT, "[::1]:9464");
    t_bad("no-such-host.invalid:9464", STATUS_BAD_INPUT, "'no-such-host.invalid'");

    /* A port another socket holds. */
    int fd = socket(AF_INET, SOCK_STREAM, 0);
    struct sockaddr_in sa = {.sin_family = AF_INET};
    sa.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
    socklen_t sl = sizeof sa;
    ASSERT_EQ(0, bind(fd, (struct sockaddr *)&sa, sizeof sa));
    ASSERT_EQ(0, listen(fd, 1));
    ASSERT_EQ(0, getsockname(fd, (struct sockaddr *)&sa, &sl));
    char busy[64];
    snprintf(busy, sizeof busy, "127.0.0.1:%d", ntohs(sa.sin_port));
    t_bad(busy, STATUS_IO, "in use");
    close(fd);
    ASSERT_EQ(fds_before, t_fds());
}

TEST(httpd_ipv6_loopback) {
    int fd = socket(AF_INET6, SOCK_STREAM, 0);
    struct sockaddr_in6 sa = {.sin6_family = AF_INET6, .sin6_addr = IN6ADDR_LOOPBACK_INIT};
    int ok = fd >= 0 && bind(fd, (struct sockaddr *)&sa, sizeof sa) == 0;
    if (fd >= 0) close(fd);
    if (!ok) TEST_SKIP("this machine has no IPv6 loopback");
    httpd *h = NULL;
    char err[256] = "";
    ASSERT_OK(httpd_start(&h, &(struct httpd_config){.listen = "[::1]:0"}, err, sizeof err));
    int port = httpd_port(h);
    ASSERT_TRUE(port > 0);
    fd = socket(AF_INET6, SOCK_STREAM, 0);
    sa.sin6_port = htons((uint16_t)port);
    ASSERT_EQ(0, connect(fd, (struct sockaddr *)&sa, sizeof sa));
    const char req[] = "GET /health HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n";
    ASSERT_EQ((ssize_t)(sizeof req - 1), write(fd, req, sizeof req - 1));
    char buf[1024] = "";
    size_t len = 0;
    ssize_t got;
    while (len < sizeof buf - 1 && (got = read(fd, buf + len, sizeof buf - 1 - len)) > 0)
        len += (size_t)got;
    close(fd);
    ASSERT_TRUE(strncmp(buf, "HTTP/1.1 200", 12) == 0);
    httpd_stop(h);
}

struct t_scraper {
    int port;
    int ok;
};

static void *t_scrape(void *arg) {
    struct t_scraper *s = arg;
    static _Thread_local struct t_reply r;
    for (int i = 0; i < 25; i++)
        if (t_http(s->port, "GET", "/metrics", &r) == 0 && r.status == 200 &&
            strstr(r.body, "llm_e2e_request_latency_seconds_count "))
            s->ok++;
    return NULL;
}

TEST(httpd_concurrent_scrapes) {
    struct t_state st = {0};
    metrics *m = t_registry(&st);
    httpd *h = NULL;
    char err[256] = "";
    struct httpd_config c = {.listen = "127.0.0.1:0", .registry = m, .refresh = t_refresh,
                             .refresh_ud = &st};
    ASSERT_OK(httpd_start(&h, &c, err, sizeof err));
    struct t_scraper s[4];
    pthread_t th[4];
    for (int i = 0; i < 4; i++) {
        s[i] = (struct t_scraper){httpd_port(h), 0};
        ASSERT_EQ(0, pthread_create(&th[i], NULL, t_scrape, &s[i]));
    }
    metrics_family *f = NULL;
    /* Families added while the server renders. */
    for (int i = 0; i < 20; i++) {
        char name[64];
        snprintf(name, sizeof name, "llm_added_%d", i);
        ASSERT_OK(metrics_family_new(m, &(struct metrics_def){.type = METRICS_GAUGE,
            .name = name, .help = "Added late."}, &f, err, sizeof err));
    }
    for (int i = 0; i < 4; i++) pthread_join(th[i], NULL);
    for (int i = 0; i < 4; i++) ASSERT_EQ(25, s[i].ok);
    ASSERT_EQ(100, atomic_load(&st.refreshes));
    httpd_stop(h);
    metrics_free(m);
}

TEST(httpd_metrics_pass_promtool) {
    if (system("command -v promtool >/dev/null 2>&1") != 0)
        TEST_SKIP("promtool is not installed (Debian package prometheus)");
    struct t_state st = {0};
    metrics *m = t_registry(&st);
    httpd *h = NULL;
    char err[256] = "";
    ASSERT_OK(httpd_start(&h, &(struct httpd_config){.listen = "127.0.0.1:0", .registry = m},
                          err, sizeof err));
    static struct t_reply r;
    ASSERT_OK(t_http(httpd_port(h), "GET", "/metrics", &r));
    httpd_stop(h);
    metrics_free(m);
    ASSERT_EQ(200, r.status);
    char path[] = "/tmp/llm_httpd_XXXXXX";
    int fd = mkstemp(path);
    ASSERT_TRUE(fd >= 0);
    ASSERT_EQ((ssize_t)r.body_len, write(fd, r.body, r.body_len));
    close(fd);
    char cmd[256];
    snprintf(cmd, sizeof cmd, "promtool check metrics < %s", path);
    fflush(stdout);
    int rc = system(cmd);
    unlink(path);
    ASSERT_TRUE(WIFEXITED(rc));
    ASSERT_EQ(0, WEXITSTATUS(rc));
}

/* ---- slow clients ------------------------------------------------------------ */

/* A slowloris: T_LORIS_N connections that never finish a request, half of
 * them idle, half sending one more byte of a header every tick; a
 * connection the server closes is opened again at the next tick, as an
 * attacker would.  Runs on its own thread until stop. */
#define T_LORIS_N 500
#define T_LORIS_TICK_MS 200

struct t_loris {
    int port;
    int fd[T_LORIS_N];
    atomic_int stop;
    atomic_int opened, closed; /* by the server, seen here */
    pthread_t th;
};

static int t_loris_connect(int port) {
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

/* false when the server has closed fd. */
static bool t_loris_alive(int fd) {
    char buf[512];
    for (;;) {
        ssize_t n = recv(fd, buf, sizeof buf, MSG_DONTWAIT);
        if (n > 0) continue; /* a reply (an error page): read on to its end */
        if (n == 0) return false;
        return errno == EAGAIN || errno == EWOULDBLOCK || errno == ENOTCONN || errno == EINTR;
    }
}

static void *t_loris_main(void *arg) {
    struct t_loris *l = arg;
    static const char head[] = "GET /health HTTP/1.1\r\nHost: x\r\nX-Slow: ";
    size_t sent[T_LORIS_N] = {0};
    while (!atomic_load(&l->stop)) {
        for (int i = 0; i < T_LORIS_N; i++) {
            if (l->fd[i] >= 0 && !t_loris_alive(l->fd[i])) {
                close(l->fd[i]);
                l->fd[i] = -1;
                atomic_fetch_add(&l->closed, 1);
            }
            if (l->fd[i] < 0) {
                l->fd[i] = t_loris_connect(l->port);
                sent[i] = 0;
                if (l->fd[i] >= 0) atomic_fetch_add(&l->opened, 1);
                continue;
            }
            if (i % 2 == 1) {
                char b = sent[i] < sizeof head - 1 ? head[sent[i]] : 'a';
                if (send(l->fd[i], &b, 1, MSG_NOSIGNAL | MSG_DONTWAIT) == 1) sent[i]++;
            }
        }
        t_sleep_ms(T_LORIS_TICK_MS);
    }
    for (int i = 0; i < T_LORIS_N; i++)
        if (l->fd[i] >= 0) close(l->fd[i]);
    return NULL;
}

/* Starts the slowloris on port and waits until all its connections are
 * open. */
static void t_loris_start(struct t_loris *l, int port) {
    struct rlimit rl;
    if (getrlimit(RLIMIT_NOFILE, &rl) == 0 && rl.rlim_cur < 2 * T_LORIS_N + 256) {
        rl.rlim_cur = rl.rlim_max < 2 * T_LORIS_N + 256 ? rl.rlim_max : 2 * T_LORIS_N + 256;
        setrlimit(RLIMIT_NOFILE, &rl);
        if (rl.rlim_cur < 2 * T_LORIS_N + 256)
            TEST_SKIP("ulimit -n is %llu: %d connections on both ends need more", (unsigned long long)rl.rlim_cur,
                      T_LORIS_N);
    }
    memset(l, 0, sizeof *l);
    l->port = port;
    for (int i = 0; i < T_LORIS_N; i++) l->fd[i] = -1;
    ASSERT_EQ(0, pthread_create(&l->th, NULL, t_loris_main, l));
    int64_t end = t_now_ms() + 10000;
    while (atomic_load(&l->opened) < T_LORIS_N && t_now_ms() < end) t_sleep_ms(20);
    ASSERT_TRUE(atomic_load(&l->opened) >= T_LORIS_N);
    /* Two ticks more: the trickling ones have started their headers. */
    t_sleep_ms(2 * T_LORIS_TICK_MS);
}

static void t_loris_stop(struct t_loris *l) {
    atomic_store(&l->stop, 1);
    pthread_join(l->th, NULL);
}

/* A probe that writes its request this long after connecting: a client
 * descheduled on a busy node.  Before connections were deferred until their
 * first bytes, the flood's newer connections closed it as the oldest idle
 * one (5 ms was enough). */
#define T_PROBE_PAUSE_MS 50

/* While 500 connections sit idle or trickle a header (and come back when
 * closed), a fresh client's /health is answered within 1 s, every time over
 * 3 s, half of the probes writing their request T_PROBE_PAUSE_MS after
 * connecting.  The server keeps 32 connections: without the guard the 33rd
 * on was refused until an idle one timed out (10 s). */
TEST(httpd_health_under_slowloris) {
    httpd *h = NULL;
    char err[256] = "";
    ASSERT_OK(httpd_start(&h, &(struct httpd_config){.listen = "127.0.0.1:0"}, err, sizeof err));
    int port = httpd_port(h);
    static struct t_loris l;
    t_loris_start(&l, port);
    static struct t_reply r;
    int64_t worst = 0;
    for (int i = 0; i < 10; i++) {
        int64_t t0 = t_now_ms();
        int rc = t_http_raw(port, "GET /health HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n",
                            i % 2 ? T_PROBE_PAUSE_MS : 0, &r);
        int64_t took = t_now_ms() - t0;
        if (rc != 0 || r.status != 200 || took > 1000) {
            t_loris_stop(&l);
            httpd_stop(h);
            TEST_FAIL("probe %d under %d slow connections: rc %d, status %d, %lld ms (expected 200 within 1000 ms)",
                      i, T_LORIS_N, rc, r.status, (long long)took);
        }
        if (took > worst) worst = took;
        t_sleep_ms(300);
    }
    int opened = atomic_load(&l.opened), closed = atomic_load(&l.closed);
    t_loris_stop(&l);
    printf("  10 /health probes under %d slow connections: slowest %lld ms; the server closed %d of the %d "
           "connections the attacker opened\n", T_LORIS_N, (long long)worst, closed, opened);
    ASSERT_TRUE(closed > 0);
    httpd_stop(h);
}

/* Trickling a header one byte every 100 ms does not keep a connection past
 * the read deadline (5 s), though libmicrohttpd's own timeout (10 s of
 * silence) would never fire. */
TEST(httpd_read_deadline) {
    httpd *h = NULL;
    char err[256] = "";
    ASSERT_OK(httpd_start(&h, &(struct httpd_config){.listen = "127.0.0.1:0"}, err, sizeof err));
    int fd = t_loris_connect(httpd_port(h));
    ASSERT_TRUE(fd >= 0);
    static const char head[] = "GET /health HTTP/1.1\r\nHost: x\r\nX-Slow: ";
    int64_t t0 = t_now_ms(), closed_at = 0;
    for (size_t k = 0; t_now_ms() - t0 < 12000; k++) {
        char b = k < sizeof head - 1 ? head[k] : 'a';
        if (!t_loris_alive(fd) || send(fd, &b, 1, MSG_NOSIGNAL | MSG_DONTWAIT) < 0) {
            closed_at = t_now_ms() - t0;
            break;
        }
        t_sleep_ms(100);
    }
    close(fd);
    httpd_stop(h);
    if (closed_at == 0) TEST_FAIL("a connection trickling a header was still open after 12 s (deadline 5 s)");
    printf("  a trickling connection was closed after %lld ms\n", (long long)closed_at);
    ASSERT_TRUE(closed_at >= 4500 && closed_at <= 8000);
}

TEST_MAIN(httpd_serves_metrics_health_ready, httpd_without_registry_or_ready,
          httpd_refuses_bad_addresses, httpd_ipv6_loopback, httpd_concurrent_scrapes,
          httpd_metrics_pass_promtool, httpd_health_under_slowloris, httpd_read_deadline)
