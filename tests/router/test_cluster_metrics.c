/* The metrics ports of a real cluster.  The router's: /health at once,
 * /ready 200 once a pipeline serves and 503 naming the reason when none
 * does, /metrics counting what three generations did (finish reasons,
 * tokens, latency histograms, KV blocks), accepted by promtool; a bad
 * --metrics-listen stops the router with a message naming the value.  The
 * workers': per-stage step and link times, memory, KV blocks. */
#include "tests/router/cluster_harness.h"

#include <arpa/inet.h>
#include <netinet/in.h>
#include <sys/socket.h>

#define MODEL "stories260K-f32.gguf"

/* A loopback port free right now (bound and closed). */
static int free_port(void) {
    int fd = socket(AF_INET, SOCK_STREAM, 0);
    struct sockaddr_in sa = {.sin_family = AF_INET};
    sa.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
    socklen_t len = sizeof sa;
    if (fd < 0 || bind(fd, (struct sockaddr *)&sa, sizeof sa) != 0 ||
        getsockname(fd, (struct sockaddr *)&sa, &len) != 0)
        TEST_FAIL("no free loopback port: %s", strerror(errno));
    close(fd);
    return ntohs(sa.sin_port);
}

/* promtool's verdict on a scrape (a note when it is not installed). */
static void promtool_check(const char *text) {
    if (system("command -v promtool >/dev/null 2>&1") != 0) {
        printf("  promtool is not installed (Debian package prometheus): format not checked by it\n");
        return;
    }
    char path[] = "/tmp/llm_cluster_metrics_XXXXXX";
    int fd = mkstemp(path);
    ASSERT_TRUE(fd >= 0);
    size_t len = strlen(text);
    ASSERT_EQ((ssize_t)len, write(fd, text, len));
    close(fd);
    char cmd[256];
    snprintf(cmd, sizeof cmd, "promtool check metrics < %s", path);
    fflush(stdout);
    int rc = system(cmd);
    unlink(path);
    ASSERT_TRUE(WIFEXITED(rc));
    ASSERT_EQ(0, WEXITSTATUS(rc));
}

/* Polls /ready until it answers want (bounded). */
static void wait_ready_status(struct cluster *cl, int port, int want, char *body, size_t size) {
    int64_t end = h_now_ms() + 15000;
    int st;
    while ((st = h_http_get(port, "/ready", body, size)) != want) {
        if (h_now_ms() > end) H_FAIL(cl, "/ready answers %d (\"%s\"), expected %d", st, body, want);
        h_sleep_ms(50);
    }
}

TEST(cluster_router_metrics) {
    const char *model = test_model_path(MODEL);
    int port = free_port();
    char extra[128];
    snprintf(extra, sizeof extra, "--metrics-listen 127.0.0.1:%d --worker-timeout-ms 600", port);
    struct cluster *cl = h_cluster_start(model, 1, 1, extra, "");
    static char body[1 << 20];
    ASSERT_EQ(200, h_http_get(port, "/health", body, sizeof body));
    ASSERT_STREQ("ok\n", body);
    wait_ready_status(cl, port, 200, body, sizeof body);
    ASSERT_STREQ("ready\n", body);

    struct h_gen g[3];
    memset(g, 0, sizeof g);
    int tokens = 0;
    for (int i = 0; i < 3; i++) {
        g[i].cl = cl;
        g[i].prompt = "Once upon a time";
        g[i].max_tokens = 8 + 4 * i;
        g[i].ignore_eos = 1;
        snprintf(g[i].request_id, sizeof g[i].request_id, "metrics-%d", i);
        h_generate(&g[i]);
        H_ASSERT(cl, g[i].rc == 0, "request %d: %s", i, g[i].err);
        tokens += g[i].n;
        llm_generate_result_free(&g[i].res);
    }
    ASSERT_EQ(8 + 12 + 16, tokens);
    /* Counters follow the loop's turn after the last reply: poll briefly. */
    int64_t end = h_now_ms() + 5000;
    do {
        ASSERT_EQ(200, h_http_get(port, "/metrics", body, sizeof body));
    } while (h_sample(body, "llm_generation_tokens_total") < tokens && h_now_ms() < end && (h_sleep_ms(20), 1));
    ASSERT_EQ((double)tokens, h_sample(body, "llm_generation_tokens_total"));
    ASSERT_EQ(3.0, h_sample(body, "llm_requests_finished_total{finished_reason=\"length\"}"));
    ASSERT_EQ(0.0, h_sample(body, "llm_requests_finished_total{finished_reason=\"error\"}"));
    ASSERT_TRUE(h_sample(body, "llm_prompt_tokens_total") >= 3.0);
    ASSERT_EQ(3.0, h_sample(body, "llm_time_to_first_token_seconds_count"));
    ASSERT_EQ(3.0, h_sample(body, "llm_time_to_first_token_seconds_bucket{le=\"+Inf\"}"));
    ASSERT_EQ(3.0, h_sample(body, "llm_e2e_request_latency_seconds_count"));
    ASSERT_EQ(3.0, h_sample(body, "llm_request_queue_time_seconds_count"));
    ASSERT_EQ((double)(tokens - 3), h_sample(body, "llm_inter_token_latency_seconds_count"));
    ASSERT_EQ(0.0, h_sample(body, "llm_num_requests_running"));
    ASSERT_EQ(0.0, h_sample(body, "llm_num_requests_waiting"));
    ASSERT_TRUE(h_sample(body, "llm_kv_blocks_capacity") > 0);
    ASSERT_EQ(0.0, h_sample(body, "llm_kv_blocks_used"));
    ASSERT_EQ(1.0, h_sample(body, "llm_pipelines_in_service"));
    ASSERT_EQ(1.0, h_sample(body, "llm_redis_connected"));
    ASSERT_TRUE(h_sample(body, "llm_num_preemptions_total") >= 0);

    promtool_check(body);

    /* Without its worker the pipeline leaves service and /ready says so. */
    h_proc_kill(&cl->workers[0], SIGKILL);
    wait_ready_status(cl, port, 503, body, sizeof body);
    ASSERT_TRUE(strstr(body, "not ready: no pipeline in service") != NULL);
    ASSERT_EQ(200, h_http_get(port, "/health", body, sizeof body));
    h_cluster_stop(cl);
}

/* Each stage of a 2-stage pipeline on its own metrics port (port 0: the
 * worker logs which): step times per stage, the first stage's link sends,
 * memory, KV blocks, steps; ready while placed; promtool accepts it. */
TEST(cluster_worker_metrics) {
    const char *model = test_model_path(MODEL);
    struct cluster *cl = h_cluster_start(model, 1, 2, "",
                                         "--metrics-listen 127.0.0.1:0");
    int port[2];
    static char body[1 << 20];
    for (int i = 0; i < 2; i++) {
        port[i] = h_logged_port(&cl->workers[i]);
        H_ASSERT(cl, port[i] > 0, "%s logged no metrics port", cl->workers[i].name);
        wait_ready_status(cl, port[i], 200, body, sizeof body);
    }
    struct h_gen g = {0};
    g.cl = cl;
    g.prompt = "Once upon a time";
    g.max_tokens = 10;
    g.ignore_eos = 1;
    snprintf(g.request_id, sizeof g.request_id, "worker-metrics");
    h_generate(&g);
    H_ASSERT(cl, g.rc == 0, "request: %s", g.err);
    llm_generate_result_free(&g.res);
    for (int i = 0; i < 2; i++) {
        char series[128];
        snprintf(series, sizeof series, "llm_step_time_seconds_count{stage=\"%d\"}", i);
        /* One prefill step and a decode step per further token, at least.
         * The first stage records a step after sending it on, so the reply
         * can reach the client first: poll briefly. */
        int64_t end = h_now_ms() + 5000;
        do {
            ASSERT_EQ(200, h_http_get(port[i], "/metrics", body, sizeof body));
        } while (h_sample(body, series) < 10 && h_now_ms() < end && (h_sleep_ms(20), 1));
        if (!(h_sample(body, series) >= 10)) H_FAIL(cl, "stage %d: %s is %g", i, series, h_sample(body, series));
        ASSERT_TRUE(h_sample(body, "llm_stage_steps_total") >= 10);
        ASSERT_TRUE(h_sample(body, "llm_stage_tokens_total") >= 10);
        ASSERT_TRUE(h_sample(body, "llm_stage_kv_blocks_capacity") > 0);
        snprintf(series, sizeof series, "llm_device_memory_capacity_bytes{stage=\"%d\"}", i);
        ASSERT_TRUE(h_sample(body, series) > 0);
        snprintf(series, sizeof series, "llm_link_send_time_seconds_count{stage=\"%d\"}", i);
        if (i == 0) ASSERT_TRUE(h_sample(body, series) >= 10);
        else ASSERT_EQ(0.0, h_sample(body, series)); /* the last stage sends nothing on */
        promtool_check(body);
    }
    h_cluster_stop(cl);
}

TEST(cluster_router_bad_metrics_listen) {
    const char *model = test_model_path(MODEL);
    int status = 0;
    const char *argv[] = {H_ROUTER, "--model", model, "--metrics-listen", "127.0.0.1:notaport", NULL};
    int fds[2];
    ASSERT_EQ(0, pipe(fds));
    pid_t pid = fork();
    if (pid == 0) {
        dup2(fds[1], 2);
        close(fds[0]);
        close(fds[1]);
        alarm(30);
        execv(argv[0], (char *const *)argv);
        _exit(127);
    }
    close(fds[1]);
    /* The router logs every option first: keep the whole of stderr (the
     * error is its last line). */
    static char err[65536];
    size_t len = 0;
    ssize_t got;
    while (len < sizeof err - 1 && (got = read(fds[0], err + len, sizeof err - 1 - len)) > 0) len += (size_t)got;
    err[len] = 0;
    close(fds[0]);
    waitpid(pid, &status, 0);
    ASSERT_TRUE(WIFEXITED(status));
    ASSERT_EQ(2, WEXITSTATUS(status));
    if (!strstr(err, "--metrics-listen") || !strstr(err, "'127.0.0.1:notaport'"))
        TEST_FAIL("stderr does not name the flag and value: %s", err);
}

TEST_MAIN(cluster_router_metrics, cluster_worker_metrics, cluster_router_bad_metrics_listen)
