/* The `llm` command as a user meets it: with no router it says so within
 * seconds and how to start one; global flags work after the subcommand;
 * --retry-ms bounds `llm generate` against a router that cannot serve (no
 * pipeline), which answers why; against a real cluster, --logprobs lists
 * each token's text (which together make the output text) and --stop (given
 * several times) ends the text before the first match; against a scripted
 * router, `llm status` flags a stage of an idle pipeline whose KV view
 * differs from the router's, only once the view is newer than the
 * idleness, and exits 3. */
#include "router/server.h"
#include "tests/router/cluster_harness.h"

#include <errno.h>
#include <fcntl.h>
#include <pthread.h>
#include <signal.h>
#include <stdatomic.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/wait.h>
#include <time.h>
#include <unistd.h>

#include "common/log.h"
#include "common/zio.h"
#include "proto/wire.h"
#include "tests/redis_fixture.h"
#include "tests/test.h"

#define LLM_BIN LLM_BINARY_DIR "/clients/c/llm"

static int64_t t_ms(void) {
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (int64_t)ts.tv_sec * 1000 + ts.tv_nsec / 1000000;
}

/* Runs argv (killed after 20 s); its stderr goes to err (NUL-terminated),
 * its stdout to out when not NULL.  Returns the exit status, or -1 when it
 * did not exit by itself. */
static int run_llm_out(const char *const *argv, char *err, size_t errlen, char *out, size_t outlen) {
    if (access(LLM_BIN, X_OK) != 0) TEST_FAIL("%s is not built", LLM_BIN);
    char epath[] = "/tmp/llm-cli-errXXXXXX", opath[] = "/tmp/llm-cli-outXXXXXX";
    int efd = mkstemp(epath), ofd = mkstemp(opath);
    if (efd < 0 || ofd < 0) TEST_FAIL("mkstemp: %s", strerror(errno));
    unlink(epath);
    unlink(opath);
    pid_t pid = fork();
    if (pid == 0) {
        dup2(efd, 2);
        dup2(ofd, 1);
        unsetenv("LLM_ROUTER");
        setenv("LLM_INSECURE", "true", 1); /* the test's router is a plain socket */
        alarm(20);
        execv(argv[0], (char *const *)argv);
        _exit(127);
    }
    int st;
    waitpid(pid, &st, 0);
    lseek(efd, 0, SEEK_SET);
    ssize_t n = read(efd, err, errlen - 1);
    err[n > 0 ? n : 0] = 0;
    close(efd);
    if (out) {
        lseek(ofd, 0, SEEK_SET);
        n = read(ofd, out, outlen - 1);
        out[n > 0 ? n : 0] = 0;
    }
    close(ofd);
    return WIFEXITED(st) ? WEXITSTATUS(st) : -1;
}

static int run_llm(const char *const *argv, char *err, size_t errlen) {
    return run_llm_out(argv, err, errlen, NULL, 0);
}

static void free_endpoint(char *ep, size_t n) {
    char err[128];
    int port;
    if (zio_free_port(NULL, &port, err, sizeof err) < 0) TEST_FAIL("%s", err);
    snprintf(ep, n, "tcp://127.0.0.1:%d", port);
}

TEST(llm_cli_says_no_router_fast) {
    char ep[64], err[4096];
    free_endpoint(ep, sizeof ep);
    /* --router after the subcommand: a global flag works there too. */
    const char *argv[] = {LLM_BIN, "health", "--router", ep, NULL};
    int64_t t0 = t_ms();
    int rc = run_llm(argv, err, sizeof err);
    int64_t took = t_ms() - t0;
    ASSERT_EQ(1, rc);
    ASSERT_TRUE(took < 5000);
    ASSERT_TRUE(strstr(err, ep) != NULL);
    ASSERT_TRUE(strstr(err, "llm-cluster up") != NULL);
    ASSERT_TRUE(strstr(err, "LLM_ROUTER") != NULL);
}

TEST(llm_cli_global_flags_after_the_subcommand) {
    char a[64], b[64], err[4096];
    free_endpoint(a, sizeof a);
    free_endpoint(b, sizeof b);
    /* The later flag wins, wherever it stands. */
    const char *argv[] = {LLM_BIN, "--router", a, "generate", "--prompt", "hi", "--router", b,
                          "--connect-timeout-ms", "300", NULL};
    int64_t t0 = t_ms();
    ASSERT_EQ(1, run_llm(argv, err, sizeof err));
    ASSERT_TRUE(t_ms() - t0 < 3000);
    ASSERT_TRUE(strstr(err, b) != NULL);
    ASSERT_TRUE(strstr(err, a) == NULL);
    /* A bad global value after the subcommand is named. */
    const char *bad[] = {LLM_BIN, "status", "--log-level", "loud", NULL};
    ASSERT_EQ(2, run_llm(bad, err, sizeof err));
    ASSERT_TRUE(strstr(err, "loud") != NULL);
}

struct fx {
    struct redis_fixture r;
    server *s;
    pthread_t th;
    volatile sig_atomic_t stop;
};

static void *fx_thread(void *arg) {
    struct fx *f = arg;
    server_run(f->s, &f->stop);
    return NULL;
}

TEST(llm_cli_retry_bounds_generate) {
    struct fx f;
    memset(&f, 0, sizeof f);
    log_set_level(LL_ERROR);
    const char *model = test_model_path("stories260K-f32.gguf"); /* skips before Redis starts */
    fixture_redis_start(&f.r, 0);
    struct server_config c = {0};
    c.model_path = model;
    c.listen = "tcp://127.0.0.1:*";
    c.worker_listen = "tcp://127.0.0.1:*";
    c.redis_url = f.r.url;
    c.redis_prefix = "llm:";
    c.router_id = "r";
    c.max_queue = 100;
    c.step_tokens = 64;
    c.max_batch = 8;
    c.heartbeat_ms = 100;
    c.worker_timeout_ms = 2000;
    c.stages = 1;
    c.insecure = true;
    char err[4096];
    if (server_init(&f.s, &c, err, sizeof err) < 0) TEST_FAIL("server_init: %s", err);
    char ep[128];
    snprintf(ep, sizeof ep, "%s", server_client_endpoint(f.s));
    pthread_create(&f.th, NULL, fx_thread, &f);
    /* No worker: the router answers UNAVAILABLE; llm retries, and gives up
     * when --retry-ms says, with the router's reason. */
    const char *argv[] = {LLM_BIN, "generate", "--router", ep, "--retry-ms", "1500", "--prompt", "hi",
                          "--max-tokens", "8", NULL};
    int64_t t0 = t_ms();
    int rc = run_llm(argv, err, sizeof err);
    int64_t took = t_ms() - t0;
    f.stop = 1;
    pthread_join(f.th, NULL);
    server_free(f.s);
    ASSERT_OK(fixture_redis_stop(&f.r));
    ASSERT_EQ(1, rc);
    ASSERT_TRUE(took >= 900 && took < 4000);
    ASSERT_TRUE(strstr(err, "UNAVAILABLE") != NULL);
    ASSERT_TRUE(strstr(err, "no pipeline is in service") != NULL);
}

/* The JSON object on the last line of out. */
static cJSON *last_json(char *out) {
    size_t n = strlen(out);
    while (n > 0 && out[n - 1] == '\n') out[--n] = 0;
    char *line = strrchr(out, '\n');
    return cJSON_Parse(line ? line + 1 : out);
}

TEST(llm_cli_logprobs_and_stop) {
    const char *model = test_model_path("stories260K-f32.gguf");
    struct cluster *cl = h_cluster_start(model, 1, 1, "--insecure", "");
    static char out[1 << 16], err[8192];
    const char *prompt = "Once upon a time";
    /* --logprobs 2 --json: a record per token with the token's text, the
     * chosen token first among its alternatives (greedy), and the texts
     * together are the output text. */
    const char *a1[] = {LLM_BIN, "generate", "--router", cl->client_ep, "--prompt", prompt, "--max-tokens", "24",
                        "--logprobs", "2", "--json", NULL};
    int rc = run_llm_out(a1, err, sizeof err, out, sizeof out);
    H_ASSERT(cl, rc == 0, "llm generate --logprobs 2 --json: exit %d: %s", rc, err);
    cJSON *j = last_json(out);
    H_ASSERT(cl, j != NULL, "no JSON on the last line: %s", out);
    const cJSON *ids = cJSON_GetObjectItemCaseSensitive(j, "ids");
    const cJSON *lps = cJSON_GetObjectItemCaseSensitive(j, "logprobs");
    char text[4096];
    snprintf(text, sizeof text, "%s", cJSON_GetObjectItemCaseSensitive(j, "text")->valuestring);
    H_ASSERT(cl, cJSON_GetArraySize(ids) == 24 && cJSON_GetArraySize(lps) == 24, "%d ids, %d logprobs: %s",
             cJSON_GetArraySize(ids), cJSON_GetArraySize(lps), out);
    char joined[4096];
    size_t jl = 0;
    for (int i = 0; i < 24; i++) {
        const cJSON *l = cJSON_GetArrayItem(lps, i);
        ASSERT_EQ(cJSON_GetArrayItem(ids, i)->valueint, cJSON_GetObjectItemCaseSensitive(l, "id")->valueint);
        double lp = cJSON_GetObjectItemCaseSensitive(l, "logprob")->valuedouble;
        ASSERT_TRUE(lp <= 0);
        const cJSON *top = cJSON_GetObjectItemCaseSensitive(l, "top");
        ASSERT_EQ(2, cJSON_GetArraySize(top));
        const cJSON *t0 = cJSON_GetArrayItem(top, 0), *t1 = cJSON_GetArrayItem(top, 1);
        ASSERT_EQ(cJSON_GetObjectItemCaseSensitive(l, "id")->valueint,
                  cJSON_GetObjectItemCaseSensitive(t0, "id")->valueint);
        ASSERT_TRUE(cJSON_GetObjectItemCaseSensitive(t1, "logprob")->valuedouble <= lp);
        const cJSON *b;
        cJSON_ArrayForEach(b, cJSON_GetObjectItemCaseSensitive(l, "bytes")) {
            if (jl + 1 < sizeof joined) joined[jl++] = (char)b->valueint;
        }
    }
    joined[jl] = 0;
    H_ASSERT(cl, strcmp(joined, text) == 0, "the tokens' texts make \"%s\", the text is \"%s\"", joined, text);
    cJSON_Delete(j);

    /* Without --json: the text, then one line per token. */
    const char *a2[] = {LLM_BIN, "generate", "--router", cl->client_ep, "--prompt", prompt, "--max-tokens", "5",
                        "--logprobs", "1", NULL};
    rc = run_llm_out(a2, err, sizeof err, out, sizeof out);
    H_ASSERT(cl, rc == 0, "llm generate --logprobs 1: exit %d: %s", rc, err);
    const char *list = strstr(out, "logprobs (");
    H_ASSERT(cl, list != NULL, "no logprobs listing: %s", out);
    int lines = 0;
    for (const char *p = strchr(list, '\n'); p && p[1]; p = strchr(p + 1, '\n')) lines++;
    H_ASSERT(cl, lines == 5, "%d lines of logprobs for 5 tokens: %s", lines, out);

    /* --stop twice: the first match of either ends the text, and is not
     * in it.  The stop string is a piece of the greedy text. */
    char stop[16];
    const char *mid = text + strlen(text) / 2;
    snprintf(stop, sizeof stop, "%.4s", mid);
    size_t want_len = (size_t)(strstr(text, stop) - text);
    const char *a3[] = {LLM_BIN, "generate", "--router", cl->client_ep, "--prompt", prompt, "--max-tokens", "24",
                        "--stop", "zzqx-never", "--stop", stop, "--json", NULL};
    rc = run_llm_out(a3, err, sizeof err, out, sizeof out);
    H_ASSERT(cl, rc == 0, "llm generate --stop: exit %d: %s", rc, err);
    j = last_json(out);
    H_ASSERT(cl, j != NULL, "no JSON on the last line: %s", out);
    const char *got = cJSON_GetObjectItemCaseSensitive(j, "text")->valuestring;
    H_ASSERT(cl, strlen(got) == want_len && strncmp(got, text, want_len) == 0,
             "--stop \"%s\": text \"%s\", expected the first %zu bytes of \"%s\"", stop, got, want_len, text);
    ASSERT_STREQ("STOP", cJSON_GetObjectItemCaseSensitive(j, "finish_reason")->valuestring);
    ASSERT_STREQ(stop, cJSON_GetObjectItemCaseSensitive(j, "stop_string")->valuestring);
    cJSON_Delete(j);

    /* Bad values are named; the penalties are accepted. */
    const char *a4[] = {LLM_BIN, "generate", "--router", cl->client_ep, "--prompt", prompt, "--logprobs", "21", NULL};
    ASSERT_EQ(2, run_llm_out(a4, err, sizeof err, out, sizeof out));
    ASSERT_TRUE(strstr(err, "logprobs") != NULL && strstr(err, "21") != NULL);
    const char *a5[] = {LLM_BIN, "generate", "--router", cl->client_ep, "--prompt", prompt, "--stop", "", NULL};
    ASSERT_EQ(2, run_llm_out(a5, err, sizeof err, out, sizeof out));
    ASSERT_TRUE(strstr(err, "--stop") != NULL);
    const char *a6[] = {LLM_BIN, "generate", "--router", cl->client_ep, "--prompt", prompt, "--max-tokens", "4",
                        "--temperature", "0.8", "--seed", "7", "--presence-penalty", "0.5", "--frequency-penalty",
                        "0.5", "--repetition-penalty", "1.1", "--penalty-last-n", "16", NULL};
    rc = run_llm_out(a6, err, sizeof err, out, sizeof out);
    H_ASSERT(cl, rc == 0, "llm generate with penalties: exit %d: %s", rc, err);
    /* llm status shows the prefix cache. */
    const char *a7[] = {LLM_BIN, "status", "--router", cl->client_ep, "--json", NULL};
    rc = run_llm_out(a7, err, sizeof err, out, sizeof out);
    H_ASSERT(cl, rc == 0, "llm status --json: exit %d: %s", rc, err);
    j = last_json(out);
    H_ASSERT(cl, j && cJSON_IsNumber(cJSON_GetObjectItemCaseSensitive(j, "prefix_hit_tokens")) &&
                     cJSON_IsNumber(cJSON_GetObjectItemCaseSensitive(j, "prefix_miss_tokens")) &&
                     cJSON_GetObjectItemCaseSensitive(j, "prefix_miss_tokens")->valuedouble > 0,
             "llm status --json lacks the prefix cache counters: %s", out);
    cJSON_Delete(j);
    const char *a8[] = {LLM_BIN, "status", "--router", cl->client_ep, NULL};
    rc = run_llm_out(a8, err, sizeof err, out, sizeof out);
    H_ASSERT(cl, rc == 0 && strstr(out, "prefix cache"), "llm status: exit %d: %s %s", rc, out, err);
    h_cluster_stop(cl);
}

/* A newcomer's first calls (issue 29): the default --max-tokens (128) plus
 * the prompt runs past stories260K's 128-token context, and is clamped to
 * what the context leaves, with a note, instead of refused; a prompt that
 * is not UTF-8 fails at once with the router's reason (not "router
 * unavailable" after the retries); only a prompt that fills the whole
 * context is refused, with the reason context_length_exceeded. */
TEST(llm_cli_first_use) {
    const char *model = test_model_path("stories260K-f32.gguf");
    struct cluster *cl = h_cluster_start(model, 1, 1, "--insecure", "");
    static char out[1 << 16], err[8192];
    const char *a1[] = {LLM_BIN, "generate", "--router", cl->client_ep, "--prompt", "Once upon a time", "--json",
                        NULL};
    int rc = run_llm_out(a1, err, sizeof err, out, sizeof out);
    H_ASSERT(cl, rc == 0, "llm generate with the default --max-tokens: exit %d: %s", rc, err);
    H_ASSERT(cl, strstr(err, "--max-tokens 128 was clamped to") != NULL, "no note of the clamp: %s", err);
    cJSON *j = last_json(out);
    H_ASSERT(cl, j != NULL, "no JSON on the last line: %s", out);
    int n_prompt = cJSON_GetArraySize(cJSON_GetObjectItemCaseSensitive(j, "prompt_ids"));
    int n_ids = cJSON_GetArraySize(cJSON_GetObjectItemCaseSensitive(j, "ids"));
    const char *fin = cJSON_GetObjectItemCaseSensitive(j, "finish_reason")->valuestring;
    printf("  default --max-tokens: %d prompt + %d completion tokens, %s; %s", n_prompt, n_ids, fin, err);
    /* Greedy on stories260K may meet its end token first; never more than fits. */
    H_ASSERT(cl, n_prompt > 0 && n_ids > 0 && n_prompt + n_ids <= 128, "%d + %d tokens in a 128-token context",
             n_prompt, n_ids);
    H_ASSERT(cl, strcmp(fin, "STOP") == 0 || (strcmp(fin, "LENGTH") == 0 && n_prompt + n_ids == 128),
             "finish %s after %d + %d tokens", fin, n_prompt, n_ids);
    cJSON_Delete(j);

    /* Not UTF-8: refused at once, well inside --retry-ms. */
    const char *a2[] = {LLM_BIN, "generate", "--router", cl->client_ep, "--retry-ms", "15000", "--prompt", "\xff",
                        NULL};
    int64_t t0 = t_ms();
    rc = run_llm_out(a2, err, sizeof err, out, sizeof out);
    int64_t took = t_ms() - t0;
    printf("  --prompt $'\\xff': exit %d after %lld ms: %s", rc, (long long)took, err);
    H_ASSERT(cl, rc == 1 && took < 5000, "exit %d after %lld ms: %s", rc, (long long)took, err);
    H_ASSERT(cl, strstr(err, "INVALID_ARGUMENT") && strstr(err, "UTF-8") && strstr(err, "prompt"),
             "the error does not name the prompt's UTF-8: %s", err);

    /* A prompt that fills the context: refused, with a reason to branch on. */
    static char longp[8192];
    size_t n = 0;
    for (int i = 0; i < 200 && n + 16 < sizeof longp; i++) n += (size_t)snprintf(longp + n, sizeof longp - n, "cat dog ");
    const char *a3[] = {LLM_BIN, "generate", "--router", cl->client_ep, "--prompt", longp, NULL};
    rc = run_llm_out(a3, err, sizeof err, out, sizeof out);
    H_ASSERT(cl, rc == 1 && strstr(err, "INVALID_ARGUMENT") && strstr(err, "fill the context"),
             "a prompt longer than the context: exit %d: %s", rc, err);
    llm_client *c = h_client(cl, 5000, 30000, 10000);
    struct llm_generate_params p;
    llm_generate_params_default(&p);
    p.prompt = longp;
    p.max_tokens = 4;
    struct llm_generate_result res;
    rc = llm_client_generate(c, &p, NULL, NULL, &res);
    H_ASSERT(cl, rc == STATUS_BAD_INPUT, "generate: %d (%s)", rc, llm_client_errstr(c));
    ASSERT_EQ((int)LLM__ERROR__CODE__INVALID_ARGUMENT, (int)llm_client_error_code(c));
    ASSERT_STREQ("context_length_exceeded", llm_client_error_reason(c));
    llm_generate_result_free(&res);
    /* Through the library: the bound in effect is in the result. */
    p.prompt = "Once upon a time";
    p.max_tokens = 500;
    p.sampling.ignore_eos = true;
    ASSERT_OK(llm_client_generate(c, &p, NULL, NULL, &res));
    ASSERT_EQ((uint32_t)(128 - res.n_prompt_ids), res.max_tokens);
    ASSERT_EQ((uint32_t)(128 - res.n_prompt_ids), res.completion_tokens);
    ASSERT_TRUE(res.finish_reason == LLM__GENERATE_DONE__FINISH_REASON__LENGTH);
    llm_generate_result_free(&res);
    llm_client_close(c);
    h_cluster_stop(cl);
}

/* ---- llm status against a scripted router ---------------------------------- */

/* One StatusReply of a pipeline of two stages (workers w0, w1). */
struct sf_reply {
    uint32_t running, router_kv, stage_kv[2], age_ms;
    uint64_t steps;
};

/* A router that answers each Status with the next of its replies (the last
 * again once they run out) and counts them. */
struct status_fake {
    char ep[64];
    pthread_t th;
    atomic_int stop, asked;
    int n;
    struct sf_reply r[4];
};

static void sf_send(struct zio_sock *s, const struct zio_parts *from, Llm__ClientEnvelope *env) {
    uint8_t *buf;
    size_t len;
    char err[128];
    if (proto_client_pack(env, &buf, &len, err, sizeof err) != 0) return;
    struct zio_frame f[2] = {{zio_parts_data(from, 0), zio_parts_size(from, 0), NULL, NULL},
                             {buf, len, proto_buf_free, NULL}};
    zio_send(s, f, 2, 0);
}

static void *sf_main(void *arg) {
    struct status_fake *f = arg;
    void *ctx = zmq_ctx_new();
    struct zio_sock *s = NULL;
    char err[128];
    if (zio_sock_open(ctx, ZMQ_ROUTER, &s, err, sizeof err) != 0 || zio_bind(s, f->ep) != 0) {
        fprintf(stderr, "status fake: cannot bind %s\n", f->ep);
        atomic_store(&f->asked, -1000);
        if (s) zio_sock_close(s);
        zmq_ctx_term(ctx);
        return NULL;
    }
    zio_set_int(s, ZMQ_LINGER, 0);
    struct zio_parts in = {0};
    while (!atomic_load(&f->stop)) {
        if (zio_recv(s, &in, 10) != 0 || in.n != 2) continue;
        Llm__ClientEnvelope *env;
        if (proto_client_unpack(zio_parts_data(&in, 1), zio_parts_size(&in, 1), &env, err, sizeof err) != 0)
            continue;
        if (env->body_case == LLM__CLIENT_ENVELOPE__BODY_STATUS) {
            int k = atomic_fetch_add(&f->asked, 1);
            const struct sf_reply *x = &f->r[k < f->n ? k : f->n - 1];
            Llm__StageStatus st[2], *stp[2];
            for (int i = 0; i < 2; i++) {
                llm__stage_status__init(&st[i]);
                st[i].stage_index = (uint32_t)i;
                st[i].worker_id = i ? "w1" : "w0";
                st[i].backend = "cpu";
                st[i].device = "cpu";
                st[i].kv_blocks_used = x->stage_kv[i];
                st[i].kv_blocks_total = 128;
                st[i].heartbeat_age_ms = x->age_ms;
                st[i].ready = true;
                stp[i] = &st[i];
            }
            Llm__PipelineStatus p = LLM__PIPELINE_STATUS__INIT, *pp = &p;
            p.model = "m";
            p.ready = true;
            p.stages = stp;
            p.n_stages = 2;
            p.running = x->running;
            p.kv_blocks_used = x->router_kv;
            p.kv_blocks_total = 128;
            Llm__StatusReply sr = LLM__STATUS_REPLY__INIT;
            sr.pipelines = &pp;
            sr.n_pipelines = 1;
            sr.running = x->running;
            sr.steps_total = x->steps;
            Llm__ClientEnvelope r = LLM__CLIENT_ENVELOPE__INIT;
            r.tag = env->tag;
            r.body_case = LLM__CLIENT_ENVELOPE__BODY_STATUS_REPLY;
            r.status_reply = &sr;
            sf_send(s, &in, &r);
        }
        if (env->body_case == LLM__CLIENT_ENVELOPE__BODY_HEALTH) { /* llm's first probe */
            Llm__ClientEnvelope r = LLM__CLIENT_ENVELOPE__INIT;
            Llm__HealthReply hr = LLM__HEALTH_REPLY__INIT;
            hr.status = LLM__HEALTH_REPLY__SERVING_STATUS__SERVING;
            r.tag = env->tag;
            r.body_case = LLM__CLIENT_ENVELOPE__BODY_HEALTH_REPLY;
            r.health_reply = &hr;
            sf_send(s, &in, &r);
        }
        proto_client_free(env);
    }
    zio_parts_free(&in);
    zio_sock_close(s);
    zmq_ctx_term(ctx);
    return NULL;
}

static void sf_start(struct status_fake *f, int n, const struct sf_reply *r) {
    memset(f, 0, sizeof *f);
    free_endpoint(f->ep, sizeof f->ep);
    f->n = n;
    memcpy(f->r, r, sizeof *r * (size_t)n);
    pthread_create(&f->th, NULL, sf_main, f);
}

static int sf_stop(struct status_fake *f) {
    atomic_store(&f->stop, 1);
    pthread_join(f->th, NULL);
    return atomic_load(&f->asked);
}

/* `llm status` [--json] against f with --settle-ms settle; out gets stdout. */
static int sf_status(struct status_fake *f, bool json, const char *settle, char *out, size_t outlen) {
    char err[4096];
    const char *argv[] = {LLM_BIN, "--router", f->ep, "status", "--settle-ms", settle, json ? "--json" : NULL, NULL};
    int rc = run_llm_out(argv, err, sizeof err, out, outlen);
    printf("  llm status%s --settle-ms %s: exit %d\n%s%s", json ? " --json" : "", settle, rc, out, err);
    return rc;
}

/* The stages' KV view of an idle pipeline against the router's (issue 29,
 * defect 4): a difference is flagged in text and JSON with exit status 3
 * once a view newer than the idleness still shows it; a view from before
 * (an old heartbeat) is asked for again, not flagged; a busy pipeline's
 * views are not judged. */
TEST(llm_cli_status_flags_stage_kv_differing_from_router) {
    static char out[1 << 16];
    struct status_fake f;

    /* Stage 1 keeps 123 blocks while the router's idle pipeline holds 0,
     * in views 0 ms old: asked again once, then flagged. */
    const struct sf_reply stuck[] = {{0, 0, {0, 123}, 0, 50}};
    sf_start(&f, 1, stuck);
    ASSERT_EQ(3, sf_status(&f, false, "5000", out, sizeof out));
    ASSERT_TRUE(strstr(out, "stage 1: worker w1") != NULL);
    ASSERT_TRUE(strstr(out, "KV blocks 123/128, heartbeat 0 ms ago, KV DIFFERS from the router's") != NULL);
    ASSERT_TRUE(strstr(out, "warning: pipeline 0 is idle and holds 0 KV blocks, but stage 1 (worker w1) holds 123") != NULL);
    ASSERT_TRUE(strstr(out, "stage 0: worker w0, layers [0, 0), cpu cpu, KV blocks 0/128, heartbeat 0 ms ago\n") != NULL);
    ASSERT_EQ(2, sf_stop(&f));

    sf_start(&f, 1, stuck);
    ASSERT_EQ(3, sf_status(&f, true, "5000", out, sizeof out));
    cJSON *j = cJSON_Parse(out);
    ASSERT_TRUE(j != NULL);
    ASSERT_EQ(1, cJSON_GetObjectItem(j, "stages_kv_differ")->valueint);
    cJSON *p = cJSON_GetArrayItem(cJSON_GetObjectItem(j, "pipelines"), 0);
    ASSERT_TRUE(cJSON_IsTrue(cJSON_GetObjectItem(p, "idle")));
    cJSON *ss = cJSON_GetObjectItem(p, "stages");
    ASSERT_TRUE(cJSON_IsFalse(cJSON_GetObjectItem(cJSON_GetArrayItem(ss, 0), "kv_differs")));
    ASSERT_TRUE(cJSON_IsTrue(cJSON_GetObjectItem(cJSON_GetArrayItem(ss, 1), "kv_differs")));
    cJSON_Delete(j);
    ASSERT_EQ(2, sf_stop(&f));

    /* A view 900 ms old that differs, then a fresh one that agrees: the
     * last frees had not reached the heartbeat yet.  Nothing flagged. */
    const struct sf_reply stale[] = {{0, 4, {4, 9}, 900, 50}, {0, 4, {4, 4}, 10, 50}};
    sf_start(&f, 2, stale);
    ASSERT_EQ(0, sf_status(&f, false, "5000", out, sizeof out));
    ASSERT_TRUE(strstr(out, "DIFFERS") == NULL && strstr(out, "warning") == NULL);
    ASSERT_EQ(2, sf_stop(&f));

    /* Steps ran between two reads: the idle moment moves on, so a fresh
     * view must be newer than the second read; the third read's is. */
    const struct sf_reply moved[] = {{0, 0, {0, 7}, 0, 50}, {0, 0, {0, 7}, 0, 51}, {0, 0, {0, 7}, 0, 51}};
    sf_start(&f, 3, moved);
    ASSERT_EQ(3, sf_status(&f, true, "5000", out, sizeof out));
    ASSERT_EQ(3, sf_stop(&f));

    /* A busy pipeline (2 running): views lag by design, none is judged. */
    const struct sf_reply busy[] = {{2, 10, {10, 12}, 0, 50}};
    sf_start(&f, 1, busy);
    ASSERT_EQ(0, sf_status(&f, true, "5000", out, sizeof out));
    j = cJSON_Parse(out);
    ASSERT_TRUE(j != NULL);
    ASSERT_EQ(0, cJSON_GetObjectItem(j, "stages_kv_differ")->valueint);
    p = cJSON_GetArrayItem(cJSON_GetObjectItem(j, "pipelines"), 0);
    ASSERT_TRUE(cJSON_IsFalse(cJSON_GetObjectItem(p, "idle")));
    cJSON_Delete(j);
    ASSERT_EQ(1, sf_stop(&f));

    /* --settle-ms 0 judges the first reply as it is, old view or not. */
    sf_start(&f, 2, stale);
    ASSERT_EQ(3, sf_status(&f, false, "0", out, sizeof out));
    ASSERT_EQ(1, sf_stop(&f));

    /* A stage whose view never gets newer than the idleness is not judged:
     * after --settle-ms the reply is shown as it is, exit 0. */
    const struct sf_reply old[] = {{0, 0, {0, 5}, 60000, 50}};
    sf_start(&f, 1, old);
    int64_t t0 = t_ms();
    ASSERT_EQ(0, sf_status(&f, false, "600", out, sizeof out));
    int64_t took = t_ms() - t0;
    ASSERT_TRUE(took >= 600 && took < 5000);
    ASSERT_TRUE(strstr(out, "DIFFERS") == NULL);
    ASSERT_TRUE(sf_stop(&f) >= 2);
}

TEST_MAIN(llm_cli_says_no_router_fast, llm_cli_global_flags_after_the_subcommand, llm_cli_retry_bounds_generate,
          llm_cli_logprobs_and_stop, llm_cli_first_use, llm_cli_status_flags_stage_kv_differing_from_router)
