/* The fixture of the llm-gateway tests (test_gateway*.c): one cluster
 * (Redis, a router with its metrics port, a CPU worker with stories260K),
 * started by the first test's setup(), with two gateways in front of it
 * (gw_keyed: API keys and --max-body 64K; gw_open: --chat-template chatml)
 * and llm-run's reference output of PROMPT; curl, and the checks of
 * OpenAI's error object.  Each file ends its TEST_MAIN with teardown, which
 * stops them.  Included by each of those files (one program each): every
 * function is static, unused ones are fine. */
#ifndef TESTS_GATEWAY_GW_FIXTURE_H
#define TESTS_GATEWAY_GW_FIXTURE_H

#include "tests/router/cluster_harness.h"

#define GW_BIN LLM_BINARY_DIR "/gateway/llm-gateway"
#define GW_MODEL_NAME "stories"
#define GW_KEY "sk-test-key"

static const char *model_path(void) { return LLM_SOURCE_DIR "/../shared/models/stories260K-f32.gguf"; }

struct gw {
    struct h_proc proc;
    int port;
    char url[64];
    char metrics_url[64]; /* the metrics port */
};

/* Starts llm-gateway on a free port with extra flags, serving the model as
 * model_name (NULL: no --model-name, the router's id); waits until it
 * answers. */
static void gw_start_named(struct cluster *cl, struct gw *g, const char *name, const char *router,
                           const char *model_name, const char *extra) {
    if (access(GW_BIN, X_OK) != 0) TEST_FAIL("%s is not built", GW_BIN);
    char err[256];
    if (zio_free_port(NULL, &g->port, err, sizeof err) != 0) TEST_FAIL("free port: %s", err);
    snprintf(g->url, sizeof g->url, "http://127.0.0.1:%d", g->port);
    char listen[64], words[512];
    snprintf(listen, sizeof listen, "127.0.0.1:%d", g->port);
    snprintf(words, sizeof words, "%s", extra);
    snprintf(g->proc.name, sizeof g->proc.name, "%s", name);
    snprintf(g->proc.log, sizeof g->proc.log, "%s/%s.log", cl->dir, name);
    const char *argv[48] = {GW_BIN, "--listen", listen, "--router", router, "--model", model_path(),
                            "--log-level", "info", "--metrics-listen", "127.0.0.1:0"};
    int n = 11;
    if (model_name) {
        argv[n++] = "--model-name";
        argv[n++] = model_name;
    }
    n = h_add_words(argv, n, words);
    argv[n] = NULL;
    h_proc_setargs(&g->proc, argv);
    h_proc_start(cl, &g->proc);
    int64_t end = h_now_ms() + 10000;
    char buf[4096];
    for (;;) {
        h_tail(g->proc.log, buf, sizeof buf, 20);
        const char *mp = strstr(buf, "/metrics, /health");
        if (strstr(buf, "listening on port")) {
            const char *port = strstr(buf, "(port ");
            if (!mp || !port) H_FAIL(cl, "%s started without a metrics port: %s", name, buf);
            snprintf(g->metrics_url, sizeof g->metrics_url, "http://127.0.0.1:%d", atoi(port + 6));
            /* The URL in the log line is the one to use: the port it got,
             * not the 0 it was asked for. */
            char logged[96];
            snprintf(logged, sizeof logged, "metrics on %s (port", g->metrics_url);
            if (!strstr(buf, logged)) H_FAIL(cl, "%s: the metrics line does not say \"%s\": %s", name, logged, buf);
            return;
        }
        int st;
        if (h_proc_exited(&g->proc, &st) || h_now_ms() > end) H_FAIL(cl, "%s did not start: %s", name, buf);
        h_sleep_ms(20);
    }
}

static void gw_start(struct cluster *cl, struct gw *g, const char *name, const char *router, const char *extra) {
    gw_start_named(cl, g, name, router, GW_MODEL_NAME, extra);
}

struct resp {
    int status;
    char headers[4096];
    char *body;        /* malloc'ed */
    cJSON *json;       /* the body parsed, or NULL */
};

static H_UNUSED void resp_free(struct resp *r) {
    free(r->body);
    cJSON_Delete(r->json);
    memset(r, 0, sizeof r[0]);
}

static H_UNUSED char *read_all(const char *path, size_t *len) {
    FILE *f = fopen(path, "rb");
    if (!f) return strdup("");
    fseek(f, 0, SEEK_END);
    long n = ftell(f);
    fseek(f, 0, SEEK_SET);
    char *b = malloc((size_t)n + 1);
    size_t got = fread(b, 1, (size_t)n, f);
    b[got] = 0;
    fclose(f);
    if (len) *len = got;
    return b;
}

/* curl METHOD URL with body (NULL: none) and extra curl arguments (NULL
 * terminated); key NULL sends no Authorization header. */
static H_UNUSED void curl(struct cluster *cl, const char *method, const char *url, const char *key,
                          const char *body, size_t body_len, const char *const *extra, struct resp *r) {
    memset(r, 0, sizeof *r);
    char in[320], out[320], hdr[320], code[320], auth[128];
    snprintf(in, sizeof in, "%s/curl-in", cl->dir);
    snprintf(out, sizeof out, "%s/curl-out", cl->dir);
    snprintf(hdr, sizeof hdr, "%s/curl-hdr", cl->dir);
    snprintf(code, sizeof code, "%s/curl-code", cl->dir);
    unlink(out);
    unlink(hdr);
    char data[340];
    const char *argv[40] = {"curl", "-s", "-X", method, "-o", out, "-D", hdr, "-w", "%{http_code}", "--max-time",
                            "30"};
    int n = 12;
    if (key) {
        snprintf(auth, sizeof auth, "Authorization: Bearer %s", key);
        argv[n++] = "-H";
        argv[n++] = auth;
    }
    if (body) {
        FILE *f = fopen(in, "wb");
        if (!f) TEST_FAIL("%s: %s", in, strerror(errno));
        fwrite(body, 1, body_len, f);
        fclose(f);
        snprintf(data, sizeof data, "@%s", in);
        argv[n++] = "-H";
        argv[n++] = "Content-Type: application/json";
        argv[n++] = "--data-binary";
        argv[n++] = data;
    }
    for (int i = 0; extra && extra[i] && n < 38; i++) argv[n++] = extra[i];
    argv[n++] = url;
    argv[n] = NULL;
    pid_t pid = fork();
    if (pid == 0) {
        int fd = open(code, O_WRONLY | O_CREAT | O_TRUNC, 0644);
        dup2(fd, 1);
        execvp("curl", (char *const *)argv);
        _exit(127);
    }
    int st;
    waitpid(pid, &st, 0);
    char *c = read_all(code, NULL);
    r->status = atoi(c);
    free(c);
    char *h = read_all(hdr, NULL);
    snprintf(r->headers, sizeof r->headers, "%s", h);
    free(h);
    r->body = read_all(out, NULL);
    r->json = cJSON_Parse(r->body);
}

static H_UNUSED void post(struct cluster *cl, const struct gw *g, const char *path, const char *key,
                          const char *body, struct resp *r) {
    char url[256];
    snprintf(url, sizeof url, "%s%s", g->url, path);
    curl(cl, "POST", url, key, body, strlen(body), NULL, r);
}

/* The error object's field (message, type, param, code), or "" / "null". */
static H_UNUSED const char *err_field(const struct resp *r, const char *name) {
    const cJSON *e = cJSON_GetObjectItemCaseSensitive(r->json, "error");
    const cJSON *v = cJSON_GetObjectItemCaseSensitive(e, name);
    if (cJSON_IsNull(v)) return "null";
    return cJSON_IsString(v) ? v->valuestring : "";
}

/* Asserts an OpenAI error object with this status, param and, when not
 * NULL, a message containing needle. */
static H_UNUSED void expect_error(struct cluster *cl, const struct resp *r, int status, const char *param,
                                  const char *needle, const char *what) {
    if (r->status != status) H_FAIL(cl, "%s: status %d, expected %d; body %s", what, r->status, status, r->body);
    const cJSON *e = cJSON_GetObjectItemCaseSensitive(r->json, "error");
    if (!cJSON_IsObject(e) || !cJSON_IsString(cJSON_GetObjectItemCaseSensitive(e, "message")) ||
        !cJSON_IsString(cJSON_GetObjectItemCaseSensitive(e, "type")) || !cJSON_GetObjectItemCaseSensitive(e, "param") ||
        !cJSON_GetObjectItemCaseSensitive(e, "code"))
        H_FAIL(cl, "%s: not an OpenAI error object: %s", what, r->body);
    if (param && strcmp(err_field(r, "param"), param) != 0)
        H_FAIL(cl, "%s: param %s, expected %s (%s)", what, err_field(r, "param"), param, r->body);
    if (needle && !strstr(err_field(r, "message"), needle))
        H_FAIL(cl, "%s: message does not say \"%s\": %s", what, needle, r->body);
}

/* Asserts the error's code: OpenAI's string, or "null" (the gateway's own
 * 400s name one, as SDKs branch on it; a body that is not a JSON object
 * has none, as with OpenAI). */
static H_UNUSED void expect_code(struct cluster *cl, const struct resp *r, const char *code, const char *what) {
    if (strcmp(err_field(r, "code"), code) != 0)
        H_FAIL(cl, "%s: code %s, expected %s (%s)", what, err_field(r, "code"), code, r->body);
}

/* Asserts that the error's message contains needle. */
static H_UNUSED void msg_has(struct cluster *cl, const struct resp *r, const char *needle) {
    if (!strstr(err_field(r, "message"), needle))
        H_FAIL(cl, "the message does not say \"%s\": %s", needle, r->body);
}

/* The text of a completion response (choices[0].text). */
static H_UNUSED const char *completion_text(const struct resp *r) {
    const cJSON *c = cJSON_GetArrayItem(cJSON_GetObjectItemCaseSensitive(r->json, "choices"), 0);
    const cJSON *t = cJSON_GetObjectItemCaseSensitive(c, "text");
    return cJSON_IsString(t) ? t->valuestring : "(none)";
}

#define PROMPT "Once upon a time"
#define MAX_TOKENS 24

static struct cluster *cl_;
static struct gw gw_open, gw_keyed;
static struct h_ref ref_;
static int router_metrics_port_; /* the router's /metrics (llm_spec_*) */

static void setup(void) {
    if (access(model_path(), R_OK) != 0) TEST_SKIP("%s is missing", model_path());
    if (system("curl --version > /dev/null 2>&1") != 0) TEST_SKIP("curl is not installed");
    if (cl_) return;
    cl_ = h_cluster_start(model_path(), 1, 1, "--metrics-listen 127.0.0.1:0", "");
    router_metrics_port_ = h_logged_port(&cl_->router);
    H_ASSERT(cl_, router_metrics_port_ > 0, "the router logged no metrics port");
    char keyfile[320];
    snprintf(keyfile, sizeof keyfile, "%s/keys", cl_->dir);
    FILE *f = fopen(keyfile, "w");
    fprintf(f, "# test keys\nsk-other\n%s\n", GW_KEY);
    fclose(f);
    char extra[400];
    snprintf(extra, sizeof extra, "--api-keys-file %s --max-body 64K", keyfile);
    gw_start(cl_, &gw_keyed, "gateway-keyed", cl_->client_ep, extra);
    gw_start(cl_, &gw_open, "gateway-chatml", cl_->client_ep, "--chat-template chatml");
    h_reference(model_path(), PROMPT, MAX_TOKENS, 1, &ref_);
}

/* Last: the cluster and gateways go. */
TEST(teardown) {
    if (!cl_) TEST_SKIP("nothing started");
    h_proc_kill(&gw_keyed.proc, SIGTERM);
    h_proc_kill(&gw_open.proc, SIGTERM);
    h_cluster_stop(cl_);
    cl_ = NULL;
}

#endif
