/* The stages' view of their KV cache follows the router's across a router
 * fail-over: two routers on one Redis, one pipeline of two CPU stages, kill
 * -9 of the router the workers serve under load.  The workers register with
 * the other router, which places them in a new epoch and resumes the
 * requests from their start; the sequences the dead router planned are
 * never freed by anyone, so a stage must forget them itself.  Once the load
 * is done, `llm status --json` must show every stage holding exactly the
 * KV blocks the router's pipeline holds (issue 29, defect 4: both stages
 * stayed at 123/128 while the router showed 0/128). */
#include "tests/router/cluster_harness.h"

#include "common/log.h"

#define MODEL "stories260K-f32.gguf"

static const char *const prompts[] = {
    "Once upon a time",
    "The little dog",
    "Lily and Tom went to the park",
    "One day, a big bird",
};
#define N_PROMPTS 4
#define N_TOKENS 40
#define N_REQ 48
/* A busy 2-core machine: the heartbeat that carries a stage's view comes
 * every 200 ms; the bound is for everything to settle. */
#define SETTLE_MS 20000

#define ROUTER_ARGS \
    "--heartbeat-ms 200 --worker-timeout-ms 1000 --step-timeout-ms 3000 --claim-idle-ms 1500 --max-batch 16"

static struct h_ref refs[N_PROMPTS];

#define LLM_BIN LLM_BINARY_DIR "/clients/c/llm"

/* `llm --router EP status --json`: its output parsed (NULL when it failed)
 * and its exit status in *code (3: it flags a stage of an idle pipeline). */
static cJSON *llm_status(const char *ep, int *code) {
    const char *argv[] = {LLM_BIN, "--router", ep, "status", "--json", NULL};
    int fds[2];
    if (pipe(fds) != 0) TEST_FAIL("pipe: %s", strerror(errno));
    pid_t pid = fork();
    if (pid == 0) {
        int null = open("/dev/null", O_WRONLY);
        if (null >= 0) dup2(null, 2);
        dup2(fds[1], 1);
        close(fds[0]);
        close(fds[1]);
        alarm(30);
        execv(argv[0], (char *const *)argv);
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
    *code = WIFEXITED(st) ? WEXITSTATUS(st) : -1;
    if (*code != 0 && *code != 3) return NULL;
    return cJSON_Parse(out);
}

struct kv_view {
    int ok;          /* the status was read and names one pipeline with two stages */
    int running, in_flight;
    int router_used; /* the router's pipeline */
    int stage_used[2], stage_total[2];
    int code, flagged; /* llm status's exit status, its stages_kv_differ */
    int idle;          /* its pipeline's "idle" */
};

static struct kv_view kv_view_read(const char *ep) {
    struct kv_view v = {0};
    cJSON *j = llm_status(ep, &v.code);
    cJSON *ps = j ? cJSON_GetObjectItem(j, "pipelines") : NULL;
    cJSON *p = cJSON_GetArraySize(ps) == 1 ? cJSON_GetArrayItem(ps, 0) : NULL;
    cJSON *ss = p ? cJSON_GetObjectItem(p, "stages") : NULL;
    if (p && cJSON_GetArraySize(ss) == 2 && cJSON_IsTrue(cJSON_GetObjectItem(p, "ready"))) {
        v.ok = 1;
        v.running = cJSON_GetObjectItem(p, "running")->valueint;
        v.in_flight = cJSON_GetObjectItem(p, "steps_in_flight")->valueint;
        v.router_used = cJSON_GetObjectItem(p, "kv_blocks_used")->valueint;
        v.idle = cJSON_IsTrue(cJSON_GetObjectItem(p, "idle"));
        v.flagged = cJSON_GetObjectItem(j, "stages_kv_differ")->valueint;
        for (int k = 0; k < 2; k++) {
            cJSON *s = cJSON_GetArrayItem(ss, k);
            v.stage_used[k] = cJSON_GetObjectItem(s, "kv_blocks_used")->valueint;
            v.stage_total[k] = cJSON_GetObjectItem(s, "kv_blocks_total")->valueint;
        }
    }
    cJSON_Delete(j);
    return v;
}

static void make_requests(struct cluster *cl, struct h_gen *gs, int n, const char *tag) {
    memset(gs, 0, sizeof *gs * (size_t)n);
    for (int i = 0; i < n; i++) {
        gs[i].cl = cl;
        gs[i].prompt = prompts[i % N_PROMPTS];
        gs[i].max_tokens = N_TOKENS;
        gs[i].ignore_eos = 1;
        gs[i].retry_ms = 40000;
        gs[i].wait_ms = 80000;
        snprintf(gs[i].request_id, sizeof gs[i].request_id, "%s-%03d", tag, i);
    }
}

/* Waits until the router at ep is idle and each stage's view equals its
 * own; fails with the last views read.  llm status then calls the pipeline
 * idle, flags no stage and exits 0. */
static void wait_views_match(struct cluster *cl, const char *ep, const char *when) {
    int64_t end = h_now_ms() + SETTLE_MS;
    struct kv_view v;
    for (;;) {
        v = kv_view_read(ep);
        if (v.ok && v.running == 0 && v.in_flight == 0 && v.stage_used[0] == v.router_used &&
            v.stage_used[1] == v.router_used)
            break;
        if (h_now_ms() > end)
            H_FAIL(cl, "%s: %d ms after the load, llm status shows the router's pipeline holding %d KV blocks "
                   "(%d running, %d steps in flight) and the stages %d/%d and %d/%d (status read: %s, exit %d, "
                   "%d stages flagged)",
                   when, SETTLE_MS, v.router_used, v.running, v.in_flight, v.stage_used[0], v.stage_total[0],
                   v.stage_used[1], v.stage_total[1], v.ok ? "yes" : "no", v.code, v.flagged);
        h_sleep_ms(200);
    }
    H_ASSERT(cl, v.idle && v.flagged == 0 && v.code == 0,
             "%s: the views agree, yet llm status says idle %d, %d stages flagged, exit %d", when, v.idle,
             v.flagged, v.code);
    printf("  %s: router %d KV blocks, stages %d/%d and %d/%d\n", when, v.router_used, v.stage_used[0],
           v.stage_total[0], v.stage_used[1], v.stage_total[1]);
}

TEST(cluster_epoch_stage_kv_matches_router_after_failover) {
    const char *model = test_model_path(MODEL);
    log_set_level(LL_WARN);
    for (int p = 0; p < N_PROMPTS; p++) h_reference(model, prompts[p], N_TOKENS, 0, &refs[p]);
    struct cluster *cl = h_cluster_start_routers(model, 1, 2, ROUTER_ARGS, "", 2);
    static struct h_gen gs[N_REQ];

    /* Before any fail-over: the views agree once a load is done (the frees
     * of its last sequences must reach the stages with no step after them). */
    make_requests(cl, gs, N_REQ / 4, "warm");
    h_generate_all(gs, N_REQ / 4);
    for (int i = 0; i < N_REQ / 4; i++) {
        h_check(cl, &gs[i], &refs[i % N_PROMPTS]);
        llm_generate_result_free(&gs[i].res);
    }
    wait_views_match(cl, cl->client_ep, "after a load");

    /* kill -9 of the serving router with sequences running on both stages. */
    make_requests(cl, gs, N_REQ, "fo");
    struct h_batch b;
    h_batch_start(&b, gs, N_REQ);
    int64_t end = h_now_ms() + 60000;
    int seen;
    while ((seen = h_tokens_seen(gs, N_REQ)) < N_REQ * N_TOKENS / 4) {
        if (h_now_ms() > end) H_FAIL(cl, "%d tokens within 60 s", seen);
        h_sleep_ms(2);
    }
    struct kv_view before = kv_view_read(cl->client_ep);
    printf("  before the kill: router %d KV blocks, stages %d and %d, %d running\n", before.router_used,
           before.stage_used[0], before.stage_used[1], before.running);
    h_proc_kill(&cl->router, SIGKILL);
    printf("  kill -9 of the router after %d of %d tokens\n", seen, N_REQ * N_TOKENS);
    h_batch_join(&b);
    for (int i = 0; i < N_REQ; i++) {
        h_check(cl, &gs[i], &refs[i % N_PROMPTS]);
        llm_generate_result_free(&gs[i].res);
    }
    printf("  %d requests complete and correct\n", N_REQ);
    wait_views_match(cl, cl->client_ep2, "after the fail-over");

    /* The surviving router keeps both views right through another load. */
    make_requests(cl, gs, N_REQ / 4, "after");
    h_generate_all(gs, N_REQ / 4);
    for (int i = 0; i < N_REQ / 4; i++) {
        h_check(cl, &gs[i], &refs[i % N_PROMPTS]);
        llm_generate_result_free(&gs[i].res);
    }
    wait_views_match(cl, cl->client_ep2, "after a load on the survivor");
    h_cluster_stop(cl);
}

TEST_MAIN(cluster_epoch_stage_kv_matches_router_after_failover)
