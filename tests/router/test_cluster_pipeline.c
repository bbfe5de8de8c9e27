/* End to end through real processes: greedy output of 2- and 3-stage
 * pipelines equals llm-run's token for token (the 3-stage one with the
 * router and workers polling before they block, --spin-us); the llm command prints the
 * same tokens and text as llm-run; cancel frees the request's KV blocks;
 * bad requests and unreadable frames get clear error replies and the router
 * keeps serving. */
#include "tests/router/cluster_harness.h"

#define MODEL "stories260K-f32.gguf"
#define LLM_BIN LLM_BINARY_DIR "/clients/c/llm"

static const char *const prompts[] = {
    "Once upon a time",
    "Lily and Tom went to the park",
    "The little dog",
    "One day, a big bird",
    "She was very happy because",
};
#define N_PROMPTS ((int)(sizeof prompts / sizeof prompts[0]))

/* Each prompt in turn through the cluster against llm-run; extra: words
 * for the router and the workers alike. */
static void pipeline_matches(int stages, const char *extra) {
    const char *model = test_model_path(MODEL);
    struct h_ref refs[N_PROMPTS];
    for (int i = 0; i < N_PROMPTS; i++) h_reference(model, prompts[i], 60, 1, &refs[i]);
    struct cluster *cl = h_cluster_start(model, 1, stages, extra, extra);
    for (int i = 0; i < N_PROMPTS; i++) {
        struct h_gen g = {0};
        g.cl = cl;
        g.prompt = prompts[i];
        g.max_tokens = 60;
        snprintf(g.request_id, sizeof g.request_id, "s%d-%d", stages, i);
        h_generate(&g);
        h_check(cl, &g, &refs[i]);
        H_ASSERT(cl, (int)g.res.n_prompt_ids == refs[i].n_prompt, "prompt of %d ids, llm-run %d",
                 (int)g.res.n_prompt_ids, refs[i].n_prompt);
        for (int k = 0; k < refs[i].n_prompt; k++) ASSERT_EQ(refs[i].prompt_ids[k], g.res.prompt_ids[k]);
        llm_generate_result_free(&g.res);
    }
    /* The whole layer range is covered by the stages, in order. */
    llm_client *c = h_client(cl, 2000, 5000, 5000);
    Llm__ClientEnvelope *env = NULL;
    ASSERT_OK(llm_client_status(c, &env));
    const Llm__StatusReply *s = env->status_reply;
    ASSERT_EQ((size_t)1, s->n_pipelines);
    ASSERT_EQ((size_t)stages, s->pipelines[0]->n_stages);
    uint32_t next = 0;
    for (int k = 0; k < stages; k++) {
        ASSERT_EQ(next, s->pipelines[0]->stages[k]->layer_first);
        next = s->pipelines[0]->stages[k]->layer_end;
    }
    ASSERT_EQ((uint32_t)5, next); /* stories260K has 5 layers */
    proto_client_free(env);
    llm_client_close(c);
    h_cluster_stop(cl);
}

TEST(cluster_pipeline2_matches_llm_run) { pipeline_matches(2, ""); }
TEST(cluster_pipeline3_matches_llm_run) { pipeline_matches(3, "--spin-us 200"); }

/* Runs argv and returns its stdout (malloc'ed) and exit status; the start
 * of its stderr goes to run_stderr. */
static char run_stderr[4096];
static char *run_capture(const char *const *argv, int *status) {
    int fds[2];
    char epath[] = "/tmp/llm-test-errXXXXXX";
    int efd = mkstemp(epath);
    if (pipe(fds) != 0 || efd < 0) TEST_FAIL("pipe/mkstemp: %s", strerror(errno));
    unlink(epath);
    pid_t pid = fork();
    if (pid == 0) {
        dup2(efd, 2);
        dup2(fds[1], 1);
        close(fds[0]);
        close(fds[1]);
        alarm(60);
        execv(argv[0], (char *const *)argv);
        _exit(127);
    }
    close(fds[1]);
    size_t cap = 1 << 16, len = 0;
    char *out = malloc(cap);
    ssize_t got;
    while (len < cap - 1 && (got = read(fds[0], out + len, cap - 1 - len)) > 0) len += (size_t)got;
    out[len] = 0;
    close(fds[0]);
    int st;
    waitpid(pid, &st, 0);
    *status = WIFEXITED(st) ? WEXITSTATUS(st) : 128 + WTERMSIG(st);
    lseek(efd, 0, SEEK_SET);
    ssize_t e = read(efd, run_stderr, sizeof run_stderr - 1);
    run_stderr[e > 0 ? e : 0] = 0;
    close(efd);
    return out;
}

/* Splits out at the start of its last line: *json gets that line parsed
 * (NULL when it is not JSON), and the length of what comes before it (the
 * streamed text) is returned. */
static size_t split_last_line(const char *out, cJSON **json) {
    const char *end = out + strlen(out);
    while (end > out && end[-1] == '\n') end--;
    const char *start = end;
    while (start > out && start[-1] != '\n') start--;
    char *line = strndup(start, (size_t)(end - start));
    *json = cJSON_Parse(line);
    free(line);
    return (size_t)(start - out);
}

/* Whether item key is present in both objects and equal in them. */
static int json_same(const cJSON *a, const cJSON *b, const char *key) {
    const cJSON *x = cJSON_GetObjectItemCaseSensitive(a, key), *y = cJSON_GetObjectItemCaseSensitive(b, key);
    return x && y && cJSON_Compare(x, y, 1);
}

/* llm generate --json against llm-run --json: the same prompt ids, ids and
 * text, and the same text streamed before the JSON line.  Only those are
 * compared: llm's line also holds what llm-run has no counterpart of (the
 * request id, the finish reason, the "timing" of the stream), and more such
 * fields may come. */
TEST(cluster_llm_command_prints_what_llm_run_prints) {
    const char *model = test_model_path(MODEL);
    struct cluster *cl = h_cluster_start(model, 1, 2, "", "");
    int st1, st2;
    const char *a1[] = {LLM_BIN, "--router", cl->client_ep, "generate", "--prompt", "Once upon a time",
                        "--max-tokens", "50", "--json", NULL};
    const char *a2[] = {H_RUN, "--model", model, "--prompt", "Once upon a time", "--max-tokens", "50", "--json",
                        "--threads", "1", NULL};
    char *o1 = run_capture(a1, &st1);
    char *o2 = run_capture(a2, &st2);
    cJSON *j1 = NULL, *j2 = NULL;
    size_t n1 = split_last_line(o1, &j1), n2 = split_last_line(o2, &j2);
    int same_json = j1 && j2 && json_same(j1, j2, "prompt_ids") && json_same(j1, j2, "ids") &&
                    json_same(j1, j2, "text") && cJSON_GetArraySize(cJSON_GetObjectItem(j2, "ids")) == 50;
    int same_text = n1 == n2 && memcmp(o1, o2, n2) == 0;
    const cJSON *fin = j1 ? cJSON_GetObjectItemCaseSensitive(j1, "finish_reason") : NULL;
    int length = cJSON_IsString(fin) && strcmp(fin->valuestring, "LENGTH") == 0;
    int ok = st1 == 0 && st2 == 0 && same_json && same_text && length;
    if (!ok)
        printf("  llm (status %d):\n%s\n  llm-run (status %d):\n%s\n  ids, prompt ids and text %s, streamed text "
               "%s, finish %s\n", st1, o1, st2, o2, same_json ? "equal" : "differ", same_text ? "equal" : "differs",
               cJSON_IsString(fin) ? fin->valuestring : "missing");
    free(o1);
    free(o2);
    cJSON_Delete(j1);
    cJSON_Delete(j2);
    H_ASSERT(cl, ok, "llm generate --json differs from llm-run --json in ids, prompt ids or text (or its streamed "
             "text does, or it did not end LENGTH)");

    /* A bad flag value is refused by llm itself (exit status 2)... */
    const char *a3[] = {LLM_BIN, "--router", cl->client_ep, "generate", "--prompt", "x", "--top-k", "-1", NULL};
    char *o3 = run_capture(a3, &st1);
    free(o3);
    ASSERT_EQ(2, st1);
    ASSERT_TRUE(strstr(run_stderr, "--top-k") != NULL);
    /* ...a router error is printed with its code and message (exit status 1):
     * a known request id with another prompt is ALREADY_EXISTS. */
    const char *a6[] = {LLM_BIN, "--router", cl->client_ep, "generate", "--prompt", "Once upon a time",
                        "--max-tokens", "5", "--request-id", "llm-cmd-1", NULL};
    char *o6 = run_capture(a6, &st1);
    free(o6);
    ASSERT_EQ(0, st1);
    const char *a7[] = {LLM_BIN, "--router", cl->client_ep, "generate", "--prompt", "Another prompt",
                        "--max-tokens", "5", "--request-id", "llm-cmd-1", NULL};
    char *o7 = run_capture(a7, &st1);
    printf("  llm with a reused id: status %d, stderr: %s", st1, run_stderr);
    free(o7);
    H_ASSERT(cl, st1 == 1 && strstr(run_stderr, "ALREADY_EXISTS") && strstr(run_stderr, "llm-cmd-1"),
             "llm generate with a reused id: status %d, stderr %s", st1, run_stderr);
    const char *a4[] = {LLM_BIN, "--router", cl->client_ep, "health", NULL};
    char *o4 = run_capture(a4, &st1);
    H_ASSERT(cl, st1 == 0 && strstr(o4, "SERVING"), "llm health: status %d, output %s", st1, o4);
    free(o4);
    const char *a5[] = {LLM_BIN, "--router", cl->client_ep, "status", "--json", NULL};
    char *o5 = run_capture(a5, &st1);
    cJSON *j = cJSON_Parse(o5);
    H_ASSERT(cl, st1 == 0 && j && cJSON_GetArraySize(cJSON_GetObjectItem(j, "pipelines")) == 1,
             "llm status --json: status %d, output %s", st1, o5);
    cJSON_Delete(j);
    free(o5);
    h_cluster_stop(cl);
}

/* KV blocks in use, summed over pipelines, from the router's Status. */
static int kv_used(struct cluster *cl, llm_client *c) {
    Llm__ClientEnvelope *env = NULL;
    if (llm_client_status(c, &env) != 0) H_FAIL(cl, "status: %s", llm_client_errstr(c));
    int used = (int)env->status_reply->kv_blocks_used;
    proto_client_free(env);
    return used;
}

/* After 5 tokens: reads the KV use from Status (the request holds blocks
 * now) and cancels. */
struct cancel_probe {
    struct cluster *cl;
    llm_client *status_client;
    int tokens, kv_used_running;
};

static int cancel_probe_chunk(void *ud, const struct llm_chunk *ch) {
    struct cancel_probe *p = ud;
    p->tokens += (int)ch->n_tokens;
    if (p->tokens < 5) return 0;
    if (p->kv_used_running < 0) p->kv_used_running = kv_used(p->cl, p->status_client);
    return 1;
}

TEST(cluster_cancel_frees_kv_blocks) {
    const char *model = test_model_path(MODEL);
    struct cluster *cl = h_cluster_start(model, 1, 2, "", "");
    llm_client *c = h_client(cl, 2000, 5000, 10000);
    ASSERT_EQ(0, kv_used(cl, c));
    struct cancel_probe probe = {cl, c, 0, -1};
    llm_client *gc = h_client(cl, 2000, 5000, 10000);
    struct llm_generate_params p;
    llm_generate_params_default(&p);
    p.prompt = "Once upon a time";
    p.request_id = "cancel-me";
    p.max_tokens = 100;
    p.sampling.ignore_eos = 1;
    struct llm_generate_result gr;
    int rc = llm_client_generate(gc, &p, cancel_probe_chunk, &probe, &gr);
    H_ASSERT(cl, rc == 0, "generate: %s", llm_client_errstr(gc));
    llm_client_close(gc);
    H_ASSERT(cl, gr.finish_reason == LLM__GENERATE_DONE__FINISH_REASON__CANCELLED,
             "finish %s, expected CANCELLED", llm_finish_reason_name(gr.finish_reason));
    H_ASSERT(cl, gr.completion_tokens < 100, "all %u tokens were generated despite the cancel",
             gr.completion_tokens);
    printf("  KV blocks in use while it ran: %d\n", probe.kv_used_running);
    H_ASSERT(cl, probe.kv_used_running > 0, "Status showed %d KV blocks in use while the request ran",
             probe.kv_used_running);
    llm_generate_result_free(&gr);
    int64_t end = h_now_ms() + 5000;
    int used;
    while ((used = kv_used(cl, c)) != 0 && h_now_ms() < end) h_sleep_ms(50);
    H_ASSERT(cl, used == 0, "%d KV blocks still used 5 s after the cancel", used);
    /* A cancel of an unknown id is NOT_FOUND; of a finished one, its Done again. */
    ASSERT_EQ(STATUS_NOT_FOUND, llm_client_cancel(c, "never-was", NULL));
    ASSERT_EQ((int)LLM__ERROR__CODE__NOT_FOUND, (int)llm_client_error_code(c));
    struct llm_generate_result r;
    ASSERT_OK(llm_client_cancel(c, "cancel-me", &r));
    ASSERT_EQ((int)LLM__GENERATE_DONE__FINISH_REASON__CANCELLED, (int)r.finish_reason);
    llm_client_close(c);
    h_cluster_stop(cl);
}

/* Sends raw bytes on a fresh DEALER and returns the reply's Error (the
 * envelope is the caller's), or fails the test. */
static Llm__ClientEnvelope *raw_exchange(struct cluster *cl, const void *buf, size_t len) {
    char err[256];
    struct zio_sock *s = h_raw_socket(cl, ZMQ_DEALER, "clients/client", cl->client_ep);
    struct zio_frame f = {buf, len, NULL, NULL};
    if (zio_send(s, &f, 1, 0) != 0) H_FAIL(cl, "%s", zio_errstr(s));
    struct zio_parts in = {0};
    int rc = zio_recv(s, &in, 5000);
    Llm__ClientEnvelope *env = NULL;
    if (rc == 0 && in.n == 1)
        proto_client_unpack(zio_parts_data(&in, 0), zio_parts_size(&in, 0), &env, err, sizeof err);
    zio_parts_free(&in);
    zio_sock_close(s);
    if (rc != 0) H_FAIL(cl, "no reply within 5 s to a frame of %zu bytes", len);
    if (!env) H_FAIL(cl, "the reply to a frame of %zu bytes does not decode", len);
    return env;
}

static void expect_error(struct cluster *cl, Llm__ClientEnvelope *env, Llm__Error__Code code, const char *needle,
                         const char *what) {
    H_ASSERT(cl, env->body_case == LLM__CLIENT_ENVELOPE__BODY_ERROR, "%s: reply body %d, expected an Error", what,
             (int)env->body_case);
    printf("  %s -> %s: %s\n", what, proto_code_name(env->error->code), env->error->message);
    H_ASSERT(cl, env->error->code == code, "%s: code %s, expected %s (%s)", what, proto_code_name(env->error->code),
             proto_code_name(code), env->error->message);
    H_ASSERT(cl, needle == NULL || strstr(env->error->message, needle), "%s: message \"%s\" does not name \"%s\"",
             what, env->error->message, needle);
    proto_client_free(env);
}

TEST(cluster_bad_requests_get_errors_and_router_serves_on) {
    const char *model = test_model_path(MODEL);
    struct h_ref ref;
    h_reference(model, "The little dog", 30, 1, &ref);
    struct cluster *cl = h_cluster_start(model, 1, 2, "", "");
    llm_client *c = h_client(cl, 2000, 5000, 3000);
    struct llm_generate_params p;
    struct llm_generate_result r;

    /* An over-long prompt: stories260K's context is 128 positions. */
    char longp[4096] = "";
    for (int i = 0; i < 150; i++) strcat(longp, "dog ");
    llm_generate_params_default(&p);
    p.prompt = longp;
    p.request_id = "too-long";
    int rc = llm_client_generate(c, &p, NULL, NULL, &r);
    printf("  over-long prompt -> %s\n", llm_client_errstr(c));
    H_ASSERT(cl, rc < 0 && (llm_client_error_code(c) == LLM__ERROR__CODE__INVALID_ARGUMENT ||
                            llm_client_error_code(c) == LLM__ERROR__CODE__RESOURCE_EXHAUSTED),
             "over-long prompt: status %d, %s", rc, llm_client_errstr(c));
    llm_generate_result_free(&r);

    /* Bad sampling values, each named in the reply. */
    struct { const char *field; float temperature, top_p, min_p; int32_t top_k; } bad[] = {
        {"top_p", 0, 1.5f, 0, 0}, {"temperature", -1, 0, 0, 0}, {"min_p", 0, 0, 2.0f, 0}, {"top_k", 0, 0, 0, -3}};
    for (size_t i = 0; i < sizeof bad / sizeof bad[0]; i++) {
        llm_generate_params_default(&p);
        p.prompt = "hi";
        p.sampling.temperature = bad[i].temperature;
        p.sampling.top_p = bad[i].top_p;
        p.sampling.min_p = bad[i].min_p;
        p.sampling.top_k = bad[i].top_k;
        rc = llm_client_generate(c, &p, NULL, NULL, &r);
        printf("  bad %s -> %s\n", bad[i].field, llm_client_errstr(c));
        H_ASSERT(cl, rc == STATUS_BAD_INPUT && llm_client_error_code(c) == LLM__ERROR__CODE__INVALID_ARGUMENT &&
                         strstr(llm_client_errstr(c), bad[i].field),
                 "bad %s: status %d, %s", bad[i].field, rc, llm_client_errstr(c));
        llm_generate_result_free(&r);
    }

    /* A wrong protocol version. */
    Llm__ClientEnvelope env = LLM__CLIENT_ENVELOPE__INIT;
    Llm__HealthRequest hr = LLM__HEALTH_REQUEST__INIT;
    env.body_case = LLM__CLIENT_ENVELOPE__BODY_HEALTH;
    env.health = &hr;
    env.version = 99;
    size_t len = llm__client_envelope__get_packed_size(&env);
    uint8_t *buf = malloc(len);
    llm__client_envelope__pack(&env, buf);
    expect_error(cl, raw_exchange(cl, buf, len), LLM__ERROR__CODE__INVALID_ARGUMENT, "99", "version 99");
    free(buf);

    /* Random bytes, and an empty frame. */
    uint8_t junk[257];
    unsigned seed = 12345;
    for (size_t i = 0; i < sizeof junk; i++) junk[i] = (uint8_t)(rand_r(&seed) >> 7);
    expect_error(cl, raw_exchange(cl, junk, sizeof junk), LLM__ERROR__CODE__INVALID_ARGUMENT, NULL, "random bytes");
    expect_error(cl, raw_exchange(cl, "", 0), LLM__ERROR__CODE__INVALID_ARGUMENT, NULL, "empty frame");

    /* The router counted them and still serves, correctly. */
    Llm__ClientEnvelope *st = NULL;
    ASSERT_OK(llm_client_status(c, &st));
    H_ASSERT(cl, st->status_reply->frames_rejected >= 3, "frames_rejected %llu, expected >= 3",
             (unsigned long long)st->status_reply->frames_rejected);
    proto_client_free(st);
    int status;
    H_ASSERT(cl, !h_proc_exited(&cl->router, &status), "the router exited (0x%x)", status);
    struct h_gen g = {0};
    g.cl = cl;
    g.prompt = "The little dog";
    g.max_tokens = 30;
    h_generate(&g);
    h_check(cl, &g, &ref);
    llm_generate_result_free(&g.res);
    llm_client_close(c);
    h_cluster_stop(cl);
}

TEST_MAIN(cluster_pipeline2_matches_llm_run, cluster_pipeline3_matches_llm_run,
          cluster_llm_command_prints_what_llm_run_prints, cluster_cancel_frees_kv_blocks,
          cluster_bad_requests_get_errors_and_router_serves_on)
