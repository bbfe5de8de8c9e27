/* The probes Kubernetes relies on, on real processes (docs/deploy.md,
 * "Probes"): /health of the router, a worker and the gateway fails within a
 * bound once its loop stops turning and comes back when it turns again, and
 * /ready stays false until the model is loaded and the worker registered.
 * A loop is blocked from outside through the watchdog's test hook
 * (LLM_TEST_STALL_FILE, common/watchdog.h): while the file named there
 * exists, the loop that beats sleeps without beating.  Each process gets a
 * file of its own, so the others keep serving meanwhile. */
#include "tests/router/cluster_harness.h"

#define MODEL "stories260K-f32.gguf"
#define GW_BIN LLM_BINARY_DIR "/gateway/llm-gateway"
/* Above the longest turn of a loop that works: a worker's idle compute
 * thread waits 1 s for a plan between beats. */
#define WATCHDOG_MS 2000
/* From the stall to a failing /health: the bound, plus at most that idle
 * turn (the loop stalls at its next beat), plus the probes' own time. */
#define FAIL_WITHIN_MS (WATCHDOG_MS + 1000 + 500)

static char stall_dir[64];

static void stall_path(char *out, size_t size, const char *who) {
    snprintf(out, size, "%s/stall-%s", stall_dir, who);
}

static void touch(const char *path) {
    int fd = open(path, O_WRONLY | O_CREAT, 0644);
    if (fd < 0) TEST_FAIL("%s: %s", path, strerror(errno));
    close(fd);
}

/* Polls path on port until it answers want; returns the ms it took, or
 * fails the test after bound_ms with the last answer. */
static int64_t wait_status(struct cluster *cl, const char *who, int port, const char *path, int want,
                           int64_t bound_ms, char *body, size_t size) {
    int64_t start = h_now_ms();
    int st;
    while ((st = h_http_get(port, path, body, size)) != want) {
        if (h_now_ms() - start > bound_ms)
            H_FAIL(cl, "%s %s answers %d (\"%s\") after %lld ms, expected %d", who, path, st, body,
                   (long long)bound_ms, want);
        h_sleep_ms(20);
    }
    return h_now_ms() - start;
}

/* Stops who's loop (its stall file), sees /health go 503 naming the loop
 * within the bound while the other processes stay healthy, and lets it go. */
static void stall_and_recover(struct cluster *cl, const char *who, int port, const int *others, int n_others) {
    static char body[4096];
    char path[128];
    stall_path(path, sizeof path, who);
    ASSERT_EQ(200, h_http_get(port, "/health", body, sizeof body));
    touch(path);
    int64_t took = wait_status(cl, who, port, "/health", 503, FAIL_WITHIN_MS, body, sizeof body);
    H_ASSERT(cl, strstr(body, "unhealthy: loop ") && strstr(body, "has not turned for"),
             "%s /health: \"%s\"", who, body);
    for (int i = 0; i < n_others; i++)
        H_ASSERT(cl, h_http_get(others[i], "/health", body, sizeof body) == 200,
                 "%s stalled, and port %d's /health answers \"%s\"", who, others[i], body);
    unlink(path);
    int64_t back = wait_status(cl, who, port, "/health", 200, 3000, body, sizeof body);
    printf("  %s: /health 503 %lld ms after its loop stopped (bound %d ms, watchdog %d ms), 200 again %lld ms "
           "after it went on\n",
           who, (long long)took, FAIL_WITHIN_MS, WATCHDOG_MS, (long long)back);
}

TEST(cluster_health_watchdog) {
    const char *model = test_model_path(MODEL);
    snprintf(stall_dir, sizeof stall_dir, "/tmp/llm-stall-XXXXXX");
    if (!mkdtemp(stall_dir)) TEST_FAIL("mkdtemp: %s", strerror(errno));
    char path[128], extra[160];
    static char body[4096];

    /* The router, alone: alive, not ready (no pipeline). */
    int rport;
    char perr[128];
    if (zio_free_port(NULL, &rport, perr, sizeof perr) != 0) TEST_FAIL("free port: %s", perr);
    snprintf(extra, sizeof extra, "--metrics-listen 127.0.0.1:%d --watchdog-ms %d", rport, WATCHDOG_MS);
    stall_path(path, sizeof path, "router");
    setenv("LLM_TEST_STALL_FILE", path, 1);
    char wextra[96];
    snprintf(wextra, sizeof wextra, "--metrics-listen 127.0.0.1:0 --watchdog-ms %d", WATCHDOG_MS);
    struct cluster *cl = h_cluster_start(model, 0, 1, extra, wextra);
    wait_status(cl, "router", rport, "/health", 200, 10000, body, sizeof body);
    ASSERT_EQ(503, h_http_get(rport, "/ready", body, sizeof body));

    /* A worker whose loops are held from their first turn: the model is
     * loaded, nothing registered.  /health says it is starting (what the
     * startup probe waits out), /ready is false, and the router has no
     * pipeline. */
    stall_path(path, sizeof path, "worker");
    setenv("LLM_TEST_STALL_FILE", path, 1);
    touch(path);
    h_start_worker(cl, 0, 0, 0);
    int wport = h_logged_port(&cl->workers[0]);
    H_ASSERT(cl, wport > 0, "the worker logged no metrics port");
    int64_t end = h_now_ms() + 1500;
    int seen_starting = 0;
    while (h_now_ms() < end) {
        int st = h_http_get(wport, "/health", body, sizeof body);
        H_ASSERT(cl, st == 503 || st == -1, "held worker: /health %d \"%s\"", st, body);
        if (st == 503) {
            H_ASSERT(cl, strstr(body, "unhealthy: starting: loop ") != NULL, "held worker: /health \"%s\"", body);
            seen_starting = 1;
        }
        st = h_http_get(wport, "/ready", body, sizeof body);
        H_ASSERT(cl, st == 503 || st == -1, "held worker: /ready %d \"%s\"", st, body);
        H_ASSERT(cl, h_http_get(rport, "/ready", body, sizeof body) == 503, "router ready without a pipeline: %s",
                 body);
        h_sleep_ms(100);
    }
    H_ASSERT(cl, seen_starting, "the held worker's /health never answered");
    unlink(path);
    wait_status(cl, "worker", wport, "/health", 200, 5000, body, sizeof body);
    wait_status(cl, "worker", wport, "/ready", 200, 15000, body, sizeof body);
    wait_status(cl, "router", rport, "/ready", 200, 15000, body, sizeof body);

    /* The gateway: ready once the router serves. */
    struct h_proc gw = {0};
    snprintf(gw.name, sizeof gw.name, "gateway");
    snprintf(gw.log, sizeof gw.log, "%s/gateway.log", cl->dir);
    char wd[16];
    snprintf(wd, sizeof wd, "%d", WATCHDOG_MS);
    const char *argv[] = {GW_BIN, "--listen", "127.0.0.1:0", "--router", cl->client_ep, "--model", model,
                          "--metrics-listen", "127.0.0.1:0", "--watchdog-ms", wd, "--log-level", "info", NULL};
    stall_path(path, sizeof path, "gateway");
    setenv("LLM_TEST_STALL_FILE", path, 1);
    h_proc_setargs(&gw, argv);
    h_proc_start(cl, &gw);
    unsetenv("LLM_TEST_STALL_FILE");
    int gport = h_logged_port(&gw);
    if (gport <= 0) {
        h_proc_kill(&gw, SIGKILL);
        H_FAIL(cl, "the gateway logged no metrics port");
    }
    wait_status(cl, "gateway", gport, "/health", 200, 5000, body, sizeof body);
    wait_status(cl, "gateway", gport, "/ready", 200, 15000, body, sizeof body);

    /* Each loop in turn stops; only its own /health fails. */
    int for_router[] = {wport, gport}, for_worker[] = {rport, gport}, for_gateway[] = {rport, wport};
    stall_and_recover(cl, "router", rport, for_router, 2);
    stall_and_recover(cl, "worker", wport, for_worker, 2);
    stall_and_recover(cl, "gateway", gport, for_gateway, 2);
    /* And the cluster serves again. */
    wait_status(cl, "worker", wport, "/ready", 200, 15000, body, sizeof body);
    wait_status(cl, "router", rport, "/ready", 200, 15000, body, sizeof body);
    wait_status(cl, "gateway", gport, "/ready", 200, 15000, body, sizeof body);

    h_proc_kill(&gw, SIGTERM);
    h_cluster_stop(cl);
    rmdir(stall_dir);
}

TEST_MAIN(cluster_health_watchdog)
