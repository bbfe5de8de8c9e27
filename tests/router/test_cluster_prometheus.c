/* A real Prometheus server scrapes a real cluster: Redis, a router, a
 * pipeline of two CPU workers on stories260K and a gateway, each with its
 * metrics port on a free loopback port.  The test writes the scrape
 * configuration docs/metrics.md shows (file_sd targets, one job label per
 * process), starts the `prometheus` binary on it, waits until every target
 * is up, sends generations through libllmclient and through the gateway,
 * and asks Prometheus's HTTP API what it scraped: `up` is 1 for every
 * target, finished requests and generated tokens sum to what was sent and
 * received, the TTFT histograms give a median, each stage reports steps.
 * Without prometheus (Debian package `prometheus`, or $LLM_PROMETHEUS) the
 * test is skipped. */
#include "tests/router/cluster_harness.h"

#include <arpa/inet.h>
#include <ctype.h>
#include <math.h>
#include <netinet/in.h>
#include <sys/socket.h>
#include <sys/time.h>

#define MODEL "stories260K-f32.gguf"
#define GW_BIN LLM_BINARY_DIR "/gateway/llm-gateway"
#define N_DIRECT 3  /* generations through libllmclient */
#define N_GATEWAY 2 /* generations through the gateway's /v1/completions */
#define MAX_TOKENS 8
#define BOUND_MS 30000 /* from Prometheus's start to the last answer */

/* The processes Prometheus scrapes: the job each belongs to and its port. */
struct target {
    const char *job;
    int port;
};

struct prom {
    struct h_proc proc;
    struct h_proc gateway; /* pid 0 when llm-gateway is not built */
    int port, gateway_port;
    struct target targets[8];
    int n_targets;
    int64_t deadline;
};

/* The end of a process's log (prometheus, the gateway: the harness prints
 * the router's and the workers'). */
static void dump_log(const struct h_proc *p) {
    char buf[6000];
    if (!p->log[0]) return;
    h_tail(p->log, buf, sizeof buf, 15);
    printf("  ---- %s (%s), last lines:\n%s", p->name, p->log, buf);
}

#define P_FAIL(cl, pr, ...)            \
    do {                               \
        dump_log(&(pr)->proc);         \
        dump_log(&(pr)->gateway);      \
        H_FAIL(cl, __VA_ARGS__);       \
    } while (0)
#define P_ASSERT(cl, pr, cond, ...)                   \
    do {                                              \
        if (!(cond)) P_FAIL(cl, pr, __VA_ARGS__);     \
    } while (0)

/* The prometheus binary: $LLM_PROMETHEUS, else on PATH, else Debian's;
 * NULL when there is none. */
static const char *prometheus_path(void) {
    static char path[1024];
    const char *env = getenv("LLM_PROMETHEUS");
    if (env && *env) {
        if (access(env, X_OK) != 0) TEST_FAIL("LLM_PROMETHEUS=%s: not an executable: %s", env, strerror(errno));
        return env;
    }
    const char *dirs = getenv("PATH");
    char list[4096];
    snprintf(list, sizeof list, "%s", dirs ? dirs : "");
    for (char *save = NULL, *d = strtok_r(list, ":", &save); d; d = strtok_r(NULL, ":", &save)) {
        snprintf(path, sizeof path, "%s/prometheus", d);
        if (access(path, X_OK) == 0) return path;
    }
    return access("/usr/bin/prometheus", X_OK) == 0 ? "/usr/bin/prometheus" : NULL;
}

/* One HTTP/1.0 exchange with 127.0.0.1:port (1.0: the answer is never
 * chunked and ends when the server closes).  Returns the status, -1 when
 * nothing answered; *body is malloc'ed (the caller frees it) or NULL. */
static int http_request(int port, const char *method, const char *path, const char *json, char **body) {
    *body = NULL;
    int fd = socket(AF_INET, SOCK_STREAM, 0);
    if (fd < 0) return -1;
    struct timeval tv = {10, 0};
    setsockopt(fd, SOL_SOCKET, SO_RCVTIMEO, &tv, sizeof tv);
    setsockopt(fd, SOL_SOCKET, SO_SNDTIMEO, &tv, sizeof tv);
    struct sockaddr_in sa = {.sin_family = AF_INET, .sin_port = htons((uint16_t)port)};
    sa.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
    if (connect(fd, (struct sockaddr *)&sa, sizeof sa) != 0) {
        close(fd);
        return -1;
    }
    size_t jl = json ? strlen(json) : 0;
    char *req = malloc(strlen(path) + jl + 256);
    if (!req) {
        close(fd);
        return -1;
    }
    int n = sprintf(req, "%s %s HTTP/1.0\r\nHost: 127.0.0.1:%d\r\n", method, path, port);
    if (json) n += sprintf(req + n, "Content-Type: application/json\r\nContent-Length: %zu\r\n", jl);
    n += sprintf(req + n, "\r\n%s", json ? json : "");
    ssize_t sent = write(fd, req, (size_t)n);
    free(req);
    if (sent != n) {
        close(fd);
        return -1;
    }
    size_t cap = 1 << 16, len = 0;
    char *raw = malloc(cap);
    ssize_t got;
    while ((got = read(fd, raw + len, cap - 1 - len)) > 0) {
        len += (size_t)got;
        if (len == cap - 1) raw = realloc(raw, cap *= 2);
    }
    close(fd);
    raw[len] = 0;
    int status = -1;
    char *end = strstr(raw, "\r\n\r\n");
    if (!end || sscanf(raw, "HTTP/1.%*d %d", &status) != 1) {
        free(raw);
        return -1;
    }
    *body = strdup(end + 4);
    free(raw);
    return status;
}

/* s percent-encoded for a query string. */
static void url_encode(const char *s, char *out, size_t size) {
    size_t o = 0;
    for (; *s && o + 4 < size; s++) {
        unsigned char c = (unsigned char)*s;
        if (isalnum(c) || c == '-' || c == '_' || c == '.' || c == '~') out[o++] = (char)c;
        else o += (size_t)snprintf(out + o, size - o, "%%%02X", c);
    }
    out[o] = 0;
}

/* The port a process logged in "... (port N)" after `marker`, waiting for
 * the line (bounded); -1 when it never came or the process exited. */
static int logged_port(struct h_proc *p, const char *marker, const char *after) {
    int64_t end = h_now_ms() + 10000;
    while (h_now_ms() < end) {
        char *log = test_read_file(p->log, NULL);
        const char *at = log ? strstr(log, marker) : NULL;
        at = at ? strstr(at, after) : NULL;
        int port = at ? atoi(at + strlen(after)) : -1;
        free(log);
        if (port > 0) return port;
        int st;
        if (h_proc_exited(p, &st)) return -1;
        h_sleep_ms(20);
    }
    return -1;
}

/* Whether p's log names its metrics URL with the port it got, not the 0 it
 * was given: "WHO: metrics on http://127.0.0.1:PORT (port PORT)". */
static bool logged_url_has_port(struct h_proc *p, const char *who, int port) {
    char want[128];
    snprintf(want, sizeof want, "%s: metrics on http://127.0.0.1:%d (port %d)", who, port, port);
    char *log = test_read_file(p->log, NULL);
    bool ok = log && strstr(log, want);
    free(log);
    return ok;
}

/* ---- the scrape configuration --------------------------------------------- */

/* The file_sd targets (what `llm-cluster up` writes as RUN_DIR/
 * prometheus-targets.json): one group per job, the job as a label. */
static void write_targets(const char *path, const struct target *t, int n) {
    FILE *f = fopen(path, "w");
    if (!f) TEST_FAIL("%s: %s", path, strerror(errno));
    fprintf(f, "[\n");
    int groups = 0;
    for (int i = 0; i < n; i++) {
        int first = 1;
        for (int j = 0; j < i; j++) first &= strcmp(t[j].job, t[i].job) != 0;
        if (!first) continue; /* its group was written with the first of its job */
        fprintf(f, "%s  {\"targets\": [", groups++ ? ",\n" : "");
        for (int j = i, k = 0; j < n; j++)
            if (strcmp(t[j].job, t[i].job) == 0) fprintf(f, "%s\"127.0.0.1:%d\"", k++ ? ", " : "", t[j].port);
        fprintf(f, "], \"labels\": {\"job\": \"%s\"}}", t[i].job);
    }
    fprintf(f, "\n]\n");
    if (fclose(f) != 0) TEST_FAIL("%s: %s", path, strerror(errno));
}

/* prometheus.yml: every second, targets from the file (re-read when it
 * changes, so processes can come and go without a restart). */
static void write_config(const char *path, const char *targets) {
    FILE *f = fopen(path, "w");
    if (!f) TEST_FAIL("%s: %s", path, strerror(errno));
    fprintf(f,
            "global:\n"
            "  scrape_interval: 1s\n"
            "  scrape_timeout: 1s\n"
            "  evaluation_interval: 1s\n"
            "scrape_configs:\n"
            "  - job_name: llm\n"
            "    file_sd_configs:\n"
            "      - files: ['%s']\n",
            targets);
    if (fclose(f) != 0) TEST_FAIL("%s: %s", path, strerror(errno));
}

/* ---- Prometheus's HTTP API ------------------------------------------------- */

/* GET /api/v1/<what>; the "data" member of a successful answer (the
 * caller deletes *root), or NULL while Prometheus does not answer or
 * answers 503 (starting: its storage not open yet, seen on a busy CI
 * machine). */
static cJSON *api_get(struct cluster *cl, struct prom *pr, const char *what, cJSON **root) {
    char *body;
    char path[2048 + 16];
    snprintf(path, sizeof path, "/api/v1/%s", what);
    int st = http_request(pr->port, "GET", path, NULL, &body);
    *root = NULL;
    if (st < 0 || st == 503) {
        free(body);
        return NULL;
    }
    cJSON *j = cJSON_Parse(body);
    cJSON *status = cJSON_GetObjectItem(j, "status");
    if (st != 200 || !cJSON_IsString(status) || strcmp(status->valuestring, "success") != 0)
        P_FAIL(cl, pr, "Prometheus answered %s with %d: %s", path, st, body);
    free(body);
    *root = j;
    return cJSON_GetObjectItem(j, "data");
}

/* The instant vector of a PromQL query: its result array (owned by
 * *root, which the caller deletes). */
static cJSON *query(struct cluster *cl, struct prom *pr, const char *promql, cJSON **root) {
    char enc[1536], what[2048];
    url_encode(promql, enc, sizeof enc);
    snprintf(what, sizeof what, "query?query=%s", enc);
    cJSON *data = api_get(cl, pr, what, root);
    if (!data) P_FAIL(cl, pr, "Prometheus stopped answering (query %s)", promql);
    cJSON *type = cJSON_GetObjectItem(data, "resultType");
    if (!cJSON_IsString(type) || strcmp(type->valuestring, "vector") != 0)
        P_FAIL(cl, pr, "query %s: result type %s, expected a vector", promql,
               cJSON_IsString(type) ? type->valuestring : "(none)");
    return cJSON_GetObjectItem(data, "result");
}

/* The value of one series of a result ("value": [time, "text"]). */
static double series_value(const cJSON *s) {
    const cJSON *v = cJSON_GetArrayItem(cJSON_GetObjectItem(s, "value"), 1);
    return cJSON_IsString(v) ? strtod(v->valuestring, NULL) : NAN;
}

static const char *series_label(const cJSON *s, const char *name) {
    const cJSON *l = cJSON_GetObjectItem(cJSON_GetObjectItem(s, "metric"), name);
    return cJSON_IsString(l) ? l->valuestring : "";
}

/* The single value a query gives, NAN while it gives no series. */
static double query_one(struct cluster *cl, struct prom *pr, const char *promql) {
    cJSON *root;
    cJSON *res = query(cl, pr, promql, &root);
    int n = cJSON_GetArraySize(res);
    double v = n > 0 ? series_value(cJSON_GetArrayItem(res, 0)) : NAN;
    cJSON_Delete(root);
    if (n > 1) P_FAIL(cl, pr, "query %s: %d series, expected one", promql, n);
    return v;
}

/* Polls a query until its value is want (or, want NAN, until it is a
 * finite number > 0), within the test's bound; returns the value. */
static double query_until(struct cluster *cl, struct prom *pr, const char *promql, double want) {
    double v;
    for (;;) {
        v = query_one(cl, pr, promql);
        if (isnan(want) ? isfinite(v) && v > 0 : v == want) return v;
        if (h_now_ms() > pr->deadline) {
            if (isnan(want)) P_FAIL(cl, pr, "%s is %g after %d ms, expected a number > 0", promql, v, BOUND_MS);
            P_FAIL(cl, pr, "%s is %g after %d ms, expected %g", promql, v, BOUND_MS, want);
        }
        h_sleep_ms(200);
    }
}

/* Waits until Prometheus has every target, and every one is up. */
static void wait_targets_up(struct cluster *cl, struct prom *pr) {
    char last[512] = "Prometheus does not answer";
    for (;;) {
        int st;
        if (h_proc_exited(&pr->proc, &st)) P_FAIL(cl, pr, "prometheus exited (status 0x%x)", st);
        cJSON *root;
        cJSON *data = api_get(cl, pr, "targets?state=active", &root);
        if (data) {
            cJSON *active = cJSON_GetObjectItem(data, "activeTargets"), *t;
            int up = 0, n = cJSON_GetArraySize(active);
            snprintf(last, sizeof last, "%d of %d targets known", n, pr->n_targets);
            cJSON_ArrayForEach(t, active) {
                cJSON *health = cJSON_GetObjectItem(t, "health"), *url = cJSON_GetObjectItem(t, "scrapeUrl");
                cJSON *error = cJSON_GetObjectItem(t, "lastError");
                if (cJSON_IsString(health) && strcmp(health->valuestring, "up") == 0) up++;
                else
                    snprintf(last, sizeof last, "%s is %s (%s)", cJSON_IsString(url) ? url->valuestring : "?",
                             cJSON_IsString(health) ? health->valuestring : "?",
                             cJSON_IsString(error) ? error->valuestring : "");
            }
            cJSON_Delete(root);
            if (n == pr->n_targets && up == n) return;
        }
        if (h_now_ms() > pr->deadline) P_FAIL(cl, pr, "targets not all up after %d ms: %s", BOUND_MS, last);
        h_sleep_ms(100);
    }
}

/* ---- the processes besides the cluster ------------------------------------ */

/* llm-gateway in front of the router, its API and metrics ports chosen at
 * start (the keys come from the environment the harness exports). */
static void gateway_start(struct cluster *cl, struct prom *pr, const char *model) {
    struct h_proc *p = &pr->gateway;
    snprintf(p->name, sizeof p->name, "gateway");
    snprintf(p->log, sizeof p->log, "%s/gateway.log", cl->dir);
    const char *argv[] = {GW_BIN, "--listen", "127.0.0.1:0", "--router", cl->client_ep, "--model", model,
                          "--model-name", "stories", "--metrics-listen", "127.0.0.1:0", "--log-level", "info",
                          NULL};
    h_proc_setargs(p, argv);
    h_proc_start(cl, p);
    int metrics = logged_port(p, "gateway: metrics on http://", "(port ");
    pr->gateway_port = logged_port(p, "llm-gateway: listening on port", "on port ");
    P_ASSERT(cl, pr, metrics > 0 && pr->gateway_port > 0, "llm-gateway logged no ports (metrics %d, API %d)",
             metrics, pr->gateway_port);
    pr->targets[pr->n_targets++] = (struct target){"llm-gateway", metrics};
}

static void prometheus_start(struct cluster *cl, struct prom *pr, const char *bin) {
    char targets[400], config[400], data[400], listen[64];
    snprintf(targets, sizeof targets, "%s/prometheus-targets.json", cl->dir);
    snprintf(config, sizeof config, "%s/prometheus.yml", cl->dir);
    snprintf(data, sizeof data, "%s/prometheus-data", cl->dir);
    write_targets(targets, pr->targets, pr->n_targets);
    write_config(config, targets);
    char err[256];
    if (zio_free_port(NULL, &pr->port, err, sizeof err) != 0) TEST_FAIL("free port: %s", err);
    snprintf(listen, sizeof listen, "--web.listen-address=127.0.0.1:%d", pr->port);
    char cfg_flag[420], data_flag[420];
    snprintf(cfg_flag, sizeof cfg_flag, "--config.file=%s", config);
    snprintf(data_flag, sizeof data_flag, "--storage.tsdb.path=%s", data);
    struct h_proc *p = &pr->proc;
    snprintf(p->name, sizeof p->name, "prometheus");
    snprintf(p->log, sizeof p->log, "%s/prometheus.log", cl->dir);
    const char *argv[] = {bin, cfg_flag, data_flag, listen, NULL};
    h_proc_setargs(p, argv);
    h_proc_start(cl, p);
}

/* SIGTERM and the exit status (SIGKILL after 5 s: a failure). */
static int stop_status(struct h_proc *p) {
    if (p->pid <= 0) return 0;
    kill(p->pid, SIGTERM);
    int64_t end = h_now_ms() + 5000;
    int st = 0;
    while (waitpid(p->pid, &st, WNOHANG) != p->pid) {
        if (h_now_ms() > end) {
            kill(p->pid, SIGKILL);
            waitpid(p->pid, &st, 0);
            break;
        }
        h_sleep_ms(10);
    }
    p->pid = 0;
    return st;
}

/* ---- the test ---------------------------------------------------------------- */

/* One completion through the gateway; its completion_tokens. */
static int gateway_completion(struct cluster *cl, struct prom *pr, int i) {
    char json[256], *body;
    snprintf(json, sizeof json,
             "{\"model\":\"stories\",\"prompt\":\"Once upon a time %d\",\"max_tokens\":%d,"
             "\"temperature\":0,\"ignore_eos\":true}",
             i, MAX_TOKENS);
    int st = http_request(pr->gateway_port, "POST", "/v1/completions", json, &body);
    P_ASSERT(cl, pr, st == 200, "gateway completion %d: status %d: %s", i, st, body ? body : "");
    cJSON *j = cJSON_Parse(body);
    cJSON *tokens = cJSON_GetObjectItem(cJSON_GetObjectItem(j, "usage"), "completion_tokens");
    P_ASSERT(cl, pr, cJSON_IsNumber(tokens), "gateway completion %d: no usage.completion_tokens: %s", i, body);
    int n = tokens->valueint;
    cJSON_Delete(j);
    free(body);
    return n;
}

TEST(cluster_prometheus_scrapes) {
    const char *bin = prometheus_path();
    if (!bin)
        TEST_SKIP("prometheus is not installed (Debian package prometheus, or set LLM_PROMETHEUS to the binary)");
    const char *model = test_model_path(MODEL);
    struct cluster *cl = h_cluster_start(model, 1, 2, "--metrics-listen 127.0.0.1:0", "--metrics-listen 127.0.0.1:0");
    static struct prom pr;
    memset(&pr, 0, sizeof pr);
    int port = logged_port(&cl->router, "router: metrics on http://", "(port ");
    H_ASSERT(cl, port > 0, "the router logged no metrics port");
    H_ASSERT(cl, logged_url_has_port(&cl->router, "router", port), "the router's metrics URL lacks port %d", port);
    pr.targets[pr.n_targets++] = (struct target){"llm-router", port};
    for (int i = 0; i < cl->n_workers; i++) {
        port = logged_port(&cl->workers[i], "worker: metrics on http://", "(port ");
        H_ASSERT(cl, port > 0, "%s logged no metrics port", cl->workers[i].name);
        H_ASSERT(cl, logged_url_has_port(&cl->workers[i], "worker", port), "%s's metrics URL lacks port %d",
                 cl->workers[i].name, port);
        pr.targets[pr.n_targets++] = (struct target){"llm-worker", port};
    }
    int with_gateway = access(GW_BIN, X_OK) == 0;
    if (with_gateway) gateway_start(cl, &pr, model);
    else printf("  %s is not built: the gateway is not scraped\n", GW_BIN);

    int64_t started = h_now_ms();
    pr.deadline = started + BOUND_MS;
    prometheus_start(cl, &pr, bin);
    /* Every target scraped once before any request: the counters and
     * histograms then rise between two scrapes, which rate() needs. */
    wait_targets_up(cl, &pr);
    printf("  %d targets up %lld ms after prometheus started\n", pr.n_targets, (long long)(h_now_ms() - started));

    struct h_gen g[N_DIRECT];
    memset(g, 0, sizeof g);
    int tokens = 0;
    for (int i = 0; i < N_DIRECT; i++) {
        g[i].cl = cl;
        g[i].prompt = "Once upon a time";
        g[i].max_tokens = MAX_TOKENS;
        g[i].ignore_eos = 1;
        snprintf(g[i].request_id, sizeof g[i].request_id, "prometheus-%d", i);
    }
    h_generate_all(g, N_DIRECT);
    for (int i = 0; i < N_DIRECT; i++) {
        P_ASSERT(cl, &pr, g[i].rc == 0, "request %d: %s", i, g[i].err);
        tokens += g[i].n;
        llm_generate_result_free(&g[i].res);
    }
    int requests = N_DIRECT;
    if (with_gateway) {
        for (int i = 0; i < N_GATEWAY; i++) tokens += gateway_completion(cl, &pr, i);
        requests += N_GATEWAY;
    }
    ASSERT_EQ(requests * MAX_TOKENS, tokens);

    /* What Prometheus scraped, as a dashboard would ask for it. */
    query_until(cl, &pr, "sum(llm_requests_finished_total{job=\"llm-router\"})", requests);
    query_until(cl, &pr, "sum(llm_generation_tokens_total{job=\"llm-router\"})", tokens);
    double p50 = query_until(
        cl, &pr, "histogram_quantile(0.5, sum by (le) (rate(llm_time_to_first_token_seconds_bucket[1m])))", NAN);
    /* The quantile interpolates inside a bucket: at most the largest finite bound. */
    P_ASSERT(cl, &pr, p50 <= 120, "median TTFT %g s", p50);
    printf("  median TTFT from Prometheus: %.4f s\n", p50);
    query_until(cl, &pr, "histogram_quantile(0.9, sum by (le) (rate(llm_e2e_request_latency_seconds_bucket[1m])))",
                NAN);
    query_until(cl, &pr, "sum(llm_num_requests_running{job=\"llm-router\"})", 0);
    if (with_gateway) {
        query_until(cl, &pr,
                    "sum(llm_http_requests_total{job=\"llm-gateway\",endpoint=\"completions\",code=\"200\"})",
                    N_GATEWAY);
        query_until(cl, &pr,
                    "histogram_quantile(0.5, sum by (le) (rate(llm_gateway_time_to_first_token_seconds_bucket[1m])))",
                    NAN);
    }
    /* Both stages stepped, each series labelled with its stage. */
    for (int s = 0; s < 2; s++) {
        char q[160];
        snprintf(q, sizeof q, "sum(llm_step_time_seconds_count{job=\"llm-worker\",stage=\"%d\"})", s);
        double steps = query_until(cl, &pr, q, NAN);
        P_ASSERT(cl, &pr, steps >= MAX_TOKENS, "%s is %g after %d generations of %d tokens", q, steps, requests,
                 MAX_TOKENS);
    }

    /* up: 1 for each target, and nothing else scraped. */
    cJSON *root;
    cJSON *res = query(cl, &pr, "up", &root), *s;
    P_ASSERT(cl, &pr, cJSON_GetArraySize(res) == pr.n_targets, "up has %d series for %d targets",
             cJSON_GetArraySize(res), pr.n_targets);
    cJSON_ArrayForEach(s, res) {
        const char *instance = series_label(s, "instance"), *job = series_label(s, "job");
        int known = 0;
        for (int i = 0; i < pr.n_targets; i++) {
            char want[32];
            snprintf(want, sizeof want, "127.0.0.1:%d", pr.targets[i].port);
            known |= strcmp(want, instance) == 0 && strcmp(pr.targets[i].job, job) == 0;
        }
        P_ASSERT(cl, &pr, known, "up{job=\"%s\",instance=\"%s\"} is not one of the targets", job, instance);
        P_ASSERT(cl, &pr, series_value(s) == 1, "up{job=\"%s\",instance=\"%s\"} is %g", job, instance,
                 series_value(s));
    }
    cJSON_Delete(root);
    P_ASSERT(cl, &pr, h_now_ms() <= pr.deadline, "the checks took %lld ms, more than %d",
             (long long)(h_now_ms() - started), BOUND_MS);
    printf("  every query answered %lld ms after prometheus started\n", (long long)(h_now_ms() - started));

    /* Every process stops cleanly on SIGTERM. */
    int st = stop_status(&pr.proc);
    P_ASSERT(cl, &pr, WIFEXITED(st) && WEXITSTATUS(st) == 0, "prometheus stopped with status 0x%x", st);
    st = stop_status(&pr.gateway);
    P_ASSERT(cl, &pr, WIFEXITED(st) && WEXITSTATUS(st) == 0, "llm-gateway stopped with status 0x%x", st);
    for (int i = 0; i < cl->n_workers; i++) {
        st = stop_status(&cl->workers[i]);
        P_ASSERT(cl, &pr, WIFEXITED(st) && WEXITSTATUS(st) == 0, "%s stopped with status 0x%x", cl->workers[i].name,
                 st);
    }
    st = stop_status(&cl->router);
    P_ASSERT(cl, &pr, WIFEXITED(st) && WEXITSTATUS(st) == 0, "llm-router stopped with status 0x%x", st);
    h_cluster_stop(cl);
}

TEST_MAIN(cluster_prometheus_scrapes)
