/* Tests of llm-gateway in front of a real cluster (Redis, router, worker on
 * the CPU, stories260K): curl checks the HTTP side (SSE framing, error
 * objects and status codes, API keys, bad and huge bodies, a client that
 * hangs up, an unreachable router) and the official openai npm package
 * drives completions and chat (tests/gateway/node).  Completions at
 * temperature 0 must equal llm-run's output. */
#include "tests/router/cluster_harness.h"

#include <stdatomic.h>
#include <sys/resource.h>

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

static void resp_free(struct resp *r) {
    free(r->body);
    cJSON_Delete(r->json);
    memset(r, 0, sizeof r[0]);
}

static char *read_all(const char *path, size_t *len) {
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
static void curl(struct cluster *cl, const char *method, const char *url, const char *key, const char *body,
                 size_t body_len, const char *const *extra, struct resp *r) {
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

static void post(struct cluster *cl, const struct gw *g, const char *path, const char *key, const char *body,
                 struct resp *r) {
    char url[256];
    snprintf(url, sizeof url, "%s%s", g->url, path);
    curl(cl, "POST", url, key, body, strlen(body), NULL, r);
}

/* The error object's field (message, type, param, code), or "" / "null". */
static const char *err_field(const struct resp *r, const char *name) {
    const cJSON *e = cJSON_GetObjectItemCaseSensitive(r->json, "error");
    const cJSON *v = cJSON_GetObjectItemCaseSensitive(e, name);
    if (cJSON_IsNull(v)) return "null";
    return cJSON_IsString(v) ? v->valuestring : "";
}

/* Asserts an OpenAI error object with this status, param and, when not
 * NULL, a message containing needle. */
static void expect_error(struct cluster *cl, const struct resp *r, int status, const char *param, const char *needle,
                         const char *what) {
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
static void expect_code(struct cluster *cl, const struct resp *r, const char *code, const char *what) {
    if (strcmp(err_field(r, "code"), code) != 0)
        H_FAIL(cl, "%s: code %s, expected %s (%s)", what, err_field(r, "code"), code, r->body);
}

/* Asserts that the error's message contains needle. */
static void msg_has(struct cluster *cl, const struct resp *r, const char *needle) {
    if (!strstr(err_field(r, "message"), needle))
        H_FAIL(cl, "the message does not say \"%s\": %s", needle, r->body);
}

/* The text of a completion response (choices[0].text). */
static const char *completion_text(const struct resp *r) {
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

TEST(completion_equals_llm_run) {
    setup();
    struct resp r;
    post(cl_, &gw_keyed, "/v1/completions", GW_KEY,
         "{\"model\":\"stories\",\"prompt\":\"" PROMPT "\",\"max_tokens\":24,\"temperature\":0}", &r);
    H_ASSERT(cl_, r.status == 200, "status %d: %s", r.status, r.body);
    H_ASSERT(cl_, strcmp(completion_text(&r), ref_.text) == 0, "text \"%s\", llm-run's \"%s\"", completion_text(&r),
             ref_.text);
    const cJSON *u = cJSON_GetObjectItemCaseSensitive(r.json, "usage");
    ASSERT_EQ(ref_.n, cJSON_GetObjectItemCaseSensitive(u, "completion_tokens")->valueint);
    ASSERT_EQ(ref_.n_prompt, cJSON_GetObjectItemCaseSensitive(u, "prompt_tokens")->valueint);
    ASSERT_STREQ("text_completion", cJSON_GetObjectItemCaseSensitive(r.json, "object")->valuestring);
    ASSERT_TRUE(strncmp(cJSON_GetObjectItemCaseSensitive(r.json, "id")->valuestring, "cmpl-", 5) == 0);
    ASSERT_TRUE(strstr(r.headers, "Content-Type: application/json") != NULL);
    resp_free(&r);
}

/* A completion with a prediction (OpenAI's predicted outputs, drafted
 * from by prompt lookup) has the text of one without: with the right
 * prediction (as a string and as text parts, speculation otherwise off),
 * a wrong one, and one the request turns off. */
TEST(prediction_same_text) {
    setup();
    const char *preds[] = {ref_.text, "", " and the dog ran to the park. The end.", ref_.text};
    const char *spec[] = {NULL, NULL, "ngram", "off"};
    for (int i = 0; i < 4; i++) {
        cJSON *b = cJSON_CreateObject();
        cJSON_AddStringToObject(b, "prompt", PROMPT);
        cJSON_AddNumberToObject(b, "max_tokens", MAX_TOKENS);
        cJSON_AddNumberToObject(b, "temperature", 0);
        if (spec[i]) cJSON_AddStringToObject(b, "speculation", spec[i]);
        cJSON *p = cJSON_AddObjectToObject(b, "prediction");
        cJSON_AddStringToObject(p, "type", "content");
        if (i == 1) {
            /* text parts: the reference cut in two */
            size_t half = strlen(ref_.text) / 2;
            char first[512];
            snprintf(first, sizeof first, "%.*s", (int)half, ref_.text);
            cJSON *a = cJSON_AddArrayToObject(p, "content");
            cJSON *t1 = cJSON_CreateObject(), *t2 = cJSON_CreateObject();
            cJSON_AddStringToObject(t1, "type", "text");
            cJSON_AddStringToObject(t1, "text", first);
            cJSON_AddStringToObject(t2, "type", "text");
            cJSON_AddStringToObject(t2, "text", ref_.text + half);
            cJSON_AddItemToArray(a, t1);
            cJSON_AddItemToArray(a, t2);
        } else {
            cJSON_AddStringToObject(p, "content", preds[i]);
        }
        char *body = cJSON_PrintUnformatted(b);
        cJSON_Delete(b);
        struct resp r;
        post(cl_, &gw_keyed, "/v1/completions", GW_KEY, body, &r);
        H_ASSERT(cl_, r.status == 200, "prediction %d: status %d: %s", i, r.status, r.body);
        H_ASSERT(cl_, strcmp(completion_text(&r), ref_.text) == 0, "prediction %d: text \"%s\", llm-run's \"%s\"",
                 i, completion_text(&r), ref_.text);
        resp_free(&r);
        free(body);
    }
}

/* The router's llm_spec_draft_tokens_total and _accepted_tokens_total. */
static void spec_counts(double *drafts, double *accepted) {
    static char body[1 << 18];
    H_ASSERT(cl_, h_http_get(router_metrics_port_, "/metrics", body, sizeof body) == 200, "router /metrics");
    *drafts = h_sample(body, "llm_spec_draft_tokens_total");
    *accepted = h_sample(body, "llm_spec_accepted_tokens_total");
}

/* usage.completion_tokens_details' prediction counts: -1 when absent. */
static void usage_pred(const cJSON *usage, int *accepted, int *rejected) {
    const cJSON *d = cJSON_GetObjectItemCaseSensitive(usage, "completion_tokens_details");
    const cJSON *a = cJSON_GetObjectItemCaseSensitive(d, "accepted_prediction_tokens");
    const cJSON *r = cJSON_GetObjectItemCaseSensitive(d, "rejected_prediction_tokens");
    *accepted = cJSON_IsNumber(a) ? a->valueint : -1;
    *rejected = cJSON_IsNumber(r) ? r->valueint : -1;
}

/* A completion of PROMPT with this prediction (NULL: none) and n choices,
 * streamed with include_usage or not: its usage object (a copy, the
 * caller's), choice 0's text checked against llm-run's, and the router's
 * llm_spec_* deltas over it (the tests run one request at a time). */
static cJSON *pred_completion(const char *prediction, bool stream, int n, double *drafts, double *accepted) {
    cJSON *b = cJSON_CreateObject();
    cJSON_AddStringToObject(b, "prompt", PROMPT);
    if (n > 1) cJSON_AddNumberToObject(b, "n", n);
    cJSON_AddNumberToObject(b, "max_tokens", MAX_TOKENS);
    cJSON_AddNumberToObject(b, "temperature", 0);
    if (prediction) {
        cJSON *p = cJSON_AddObjectToObject(b, "prediction");
        cJSON_AddStringToObject(p, "type", "content");
        cJSON_AddStringToObject(p, "content", prediction);
    }
    if (stream) {
        cJSON_AddBoolToObject(b, "stream", 1);
        cJSON_AddBoolToObject(cJSON_AddObjectToObject(b, "stream_options"), "include_usage", 1);
    }
    char *body = cJSON_PrintUnformatted(b);
    cJSON_Delete(b);
    double d0, a0, d1, a1;
    spec_counts(&d0, &a0);
    struct resp r;
    post(cl_, &gw_keyed, "/v1/completions", GW_KEY, body, &r);
    free(body);
    spec_counts(&d1, &a1);
    *drafts = d1 - d0;
    *accepted = a1 - a0;
    H_ASSERT(cl_, r.status == 200, "status %d: %s", r.status, r.body);
    cJSON *usage = NULL;
    char text[4096] = "";
    if (!stream) {
        usage = cJSON_Duplicate(cJSON_GetObjectItemCaseSensitive(r.json, "usage"), 1);
        snprintf(text, sizeof text, "%s", completion_text(&r));
    } else {
        /* the usage chunk is the last event before [DONE] */
        char *copy = strdup(r.body), *save = NULL;
        for (char *ev = strtok_r(copy, "\n", &save); ev; ev = strtok_r(NULL, "\n", &save)) {
            if (strncmp(ev, "data: {", 7) != 0) continue;
            cJSON *j = cJSON_Parse(ev + 6);
            const cJSON *u = cJSON_GetObjectItemCaseSensitive(j, "usage");
            if (cJSON_IsObject(u)) {
                cJSON_Delete(usage);
                usage = cJSON_Duplicate(u, 1);
            }
            const cJSON *c = cJSON_GetArrayItem(cJSON_GetObjectItemCaseSensitive(j, "choices"), 0);
            const cJSON *t = cJSON_GetObjectItemCaseSensitive(c, "text");
            if (cJSON_IsString(t) && cJSON_GetObjectItemCaseSensitive(c, "index")->valueint == 0)
                strncat(text, t->valuestring, sizeof text - strlen(text) - 1);
            cJSON_Delete(j);
        }
        free(copy);
    }
    H_ASSERT(cl_, usage != NULL, "no usage in %s", r.body);
    H_ASSERT(cl_, strcmp(text, ref_.text) == 0, "prediction: text \"%s\", llm-run's \"%s\"", text, ref_.text);
    resp_free(&r);
    return usage;
}

/* OpenAI's usage.completion_tokens_details.accepted_prediction_tokens and
 * rejected_prediction_tokens, as the router counted the prediction's
 * drafts for the request: a right prediction mostly accepted, a wrong one
 * rejected, both within the router's llm_spec_* deltas over the request;
 * streamed (the include_usage chunk) as not; absent without a
 * prediction. */
TEST(prediction_usage) {
    setup();
    /* The reference's first words, then another story. */
    char wrong[256];
    const char *sp = strchr(ref_.text + 2, ' ');
    snprintf(wrong, sizeof wrong, "%.*s was a big red car that liked to drive fast.",
             sp ? (int)(sp - ref_.text) : 0, ref_.text);
    const char *preds[] = {ref_.text, ref_.text, wrong, wrong};
    int acc[4], rej[4];
    for (int i = 0; i < 4; i++) {
        double d, a;
        cJSON *u = pred_completion(preds[i], i % 2 == 1, 1, &d, &a);
        usage_pred(u, &acc[i], &rej[i]);
        char *us = cJSON_PrintUnformatted(u);
        printf("  %s prediction%s: %s; router: %g drafts, %g accepted\n", i < 2 ? "right" : "wrong",
               i % 2 ? ", streamed" : "", us, d, a);
        H_ASSERT(cl_, acc[i] >= 0 && rej[i] >= 0, "no prediction counts in %s", us);
        H_ASSERT(cl_, acc[i] <= a && acc[i] + rej[i] <= d && rej[i] <= d - a,
                 "usage %s against the router's %g accepted of %g drafts", us, a, d);
        free(us);
        cJSON_Delete(u);
    }
    H_ASSERT(cl_, acc[0] >= MAX_TOKENS / 2 && rej[0] * 6 <= acc[0], "a right prediction: %d accepted, %d rejected",
             acc[0], rej[0]);
    H_ASSERT(cl_, rej[2] > 0, "a wrong prediction (\"%s\"): %d accepted, none rejected", wrong, acc[2]);
    /* Streamed or not, the same greedy request drafts alike. */
    ASSERT_EQ(acc[0], acc[1]);
    ASSERT_EQ(rej[0], rej[1]);
    ASSERT_EQ(acc[2], acc[3]);
    ASSERT_EQ(rej[2], rej[3]);
    /* n = 2 greedy: two choices alike, each counted, the usage their sum. */
    double d, a;
    for (int stream = 0; stream < 2; stream++) {
        cJSON *u = pred_completion(ref_.text, stream, 2, &d, &a);
        int acc2, rej2;
        usage_pred(u, &acc2, &rej2);
        char *us = cJSON_PrintUnformatted(u);
        printf("  right prediction, n = 2%s: %s; router: %g drafts, %g accepted\n", stream ? ", streamed" : "", us,
               d, a);
        H_ASSERT(cl_, acc2 == 2 * acc[0] && rej2 == 2 * rej[0] && acc2 <= a && acc2 + rej2 <= d,
                 "n = 2: usage %s, one choice alone %d accepted, %d rejected; router %g of %g", us, acc[0], rej[0],
                 a, d);
        free(us);
        cJSON_Delete(u);
    }
    /* Without a prediction, no details. */
    cJSON *u = pred_completion(NULL, false, 1, &d, &a);
    ASSERT_TRUE(cJSON_GetObjectItemCaseSensitive(u, "completion_tokens_details") == NULL);
    cJSON_Delete(u);
}

/* SSE: "data: JSON\n\n" events, the text equal to llm-run's, a usage
 * chunk with empty choices, then "data: [DONE]\n\n" last. */
TEST(completion_stream_sse) {
    setup();
    struct resp r;
    post(cl_, &gw_keyed, "/v1/completions", GW_KEY,
         "{\"model\":\"stories\",\"prompt\":\"" PROMPT "\",\"max_tokens\":24,\"temperature\":0,\"stream\":true,"
         "\"stream_options\":{\"include_usage\":true}}", &r);
    H_ASSERT(cl_, r.status == 200, "status %d: %s", r.status, r.body);
    ASSERT_TRUE(strstr(r.headers, "Content-Type: text/event-stream") != NULL);
    char text[4096] = "";
    int events = 0, usage_tokens = -1;
    bool done = false;
    const char *finish = NULL;
    char *save = NULL;
    char *copy = strdup(r.body);
    size_t blen = strlen(r.body);
    H_ASSERT(cl_, blen >= 14 && strcmp(r.body + blen - 14, "data: [DONE]\n\n") == 0, "stream does not end with [DONE]: %s",
             r.body);
    for (char *ev = strtok_r(copy, "\n", &save); ev; ev = strtok_r(NULL, "\n", &save)) {
        H_ASSERT(cl_, strncmp(ev, "data: ", 6) == 0, "a line that is not \"data: \": %s", ev);
        H_ASSERT(cl_, !done, "an event after [DONE]");
        if (strcmp(ev, "data: [DONE]") == 0) {
            done = true;
            continue;
        }
        cJSON *j = cJSON_Parse(ev + 6);
        H_ASSERT(cl_, j != NULL, "event is not JSON: %s", ev);
        const cJSON *cs = cJSON_GetObjectItemCaseSensitive(j, "choices");
        const cJSON *u = cJSON_GetObjectItemCaseSensitive(j, "usage");
        if (cJSON_IsObject(u)) {
            ASSERT_EQ(0, cJSON_GetArraySize(cs));
            usage_tokens = cJSON_GetObjectItemCaseSensitive(u, "completion_tokens")->valueint;
        }
        const cJSON *c = cJSON_GetArrayItem(cs, 0);
        if (c) {
            strncat(text, cJSON_GetObjectItemCaseSensitive(c, "text")->valuestring, sizeof text - strlen(text) - 1);
            const cJSON *f = cJSON_GetObjectItemCaseSensitive(c, "finish_reason");
            if (cJSON_IsString(f)) finish = strcmp(f->valuestring, "length") == 0 ? "length" : "other";
        }
        cJSON_Delete(j);
        events++;
    }
    free(copy);
    /* Events are separated by blank lines: as many "\n\n" as events. */
    int seps = 0;
    for (const char *p = r.body; (p = strstr(p, "\n\n")); p += 2) seps++;
    ASSERT_EQ(events + 1, seps);
    ASSERT_TRUE(done);
    ASSERT_STREQ(ref_.text, text);
    ASSERT_EQ(ref_.n, usage_tokens);
    ASSERT_STREQ("length", finish);
    resp_free(&r);
}

TEST(chat_without_template) {
    setup();
    struct resp r;
    post(cl_, &gw_keyed, "/v1/chat/completions", GW_KEY,
         "{\"model\":\"stories\",\"messages\":[{\"role\":\"user\",\"content\":\"Hi\"}]}", &r);
    expect_error(cl_, &r, 400, "messages", "--chat-template", "chat on stories260K");
    ASSERT_TRUE(strstr(err_field(&r, "message"), "stories") != NULL);
    ASSERT_STREQ("chat_template_not_found", err_field(&r, "code"));
    resp_free(&r);
    /* With --chat-template chatml the same request runs. */
    post(cl_, &gw_open, "/v1/chat/completions", NULL,
         "{\"model\":\"stories\",\"messages\":[{\"role\":\"user\",\"content\":\"Hi\"}],\"max_tokens\":5}", &r);
    H_ASSERT(cl_, r.status == 200, "status %d: %s", r.status, r.body);
    const cJSON *m = cJSON_GetObjectItemCaseSensitive(cJSON_GetArrayItem(cJSON_GetObjectItemCaseSensitive(r.json, "choices"), 0), "message");
    ASSERT_STREQ("assistant", cJSON_GetObjectItemCaseSensitive(m, "role")->valuestring);
    resp_free(&r);
}

TEST(api_keys) {
    setup();
    struct resp r;
    const char *body = "{\"prompt\":\"a\",\"max_tokens\":1}";
    post(cl_, &gw_keyed, "/v1/completions", NULL, body, &r);
    expect_error(cl_, &r, 401, NULL, "API key", "no key");
    ASSERT_TRUE(strstr(r.headers, "WWW-Authenticate: Bearer") != NULL);
    resp_free(&r);
    post(cl_, &gw_keyed, "/v1/completions", "sk-wrong", body, &r);
    expect_error(cl_, &r, 401, NULL, NULL, "wrong key");
    resp_free(&r);
    post(cl_, &gw_keyed, "/v1/completions", "sk-other", body, &r);
    ASSERT_EQ(200, r.status);
    resp_free(&r);
    char url[128];
    snprintf(url, sizeof url, "%s/v1/models", gw_keyed.url);
    curl(cl_, "GET", url, NULL, NULL, 0, NULL, &r);
    ASSERT_EQ(401, r.status);
    resp_free(&r);
}

TEST(bad_requests) {
    setup();
    struct resp r;
    static const struct {
        const char *body, *param, *needle, *code; /* code: OpenAI's, "null" for none */
    } cases[] = {
        {"{\"prompt\": \"a\", ", "null", "not valid JSON", "null"},
        {"[1, 2]", "null", "must be a JSON object", "null"},
        {"{\"prompt\":\"a\",\"temperature\":\"hot\"}", "temperature", "must be a number", "invalid_type"},
        {"{\"prompt\":\"a\",\"temperature\":2.5}", "temperature", "outside [0, 2]", "decimal_above_max_value"},
        {"{\"prompt\":\"a\",\"max_tokens\":1.5}", "max_tokens", "must be an integer", "invalid_type"},
        {"{\"prompt\":\"a\",\"max_tokens\":0}", "max_tokens", "outside", "integer_below_min_value"},
        {"{\"prompt\":\"a\",\"n\":17}", "n", "outside", "integer_above_max_value"},
        {"{\"prompt\":\"a\",\"best_of\":2}", "best_of", "does not rank completions", "unsupported_value"},
        {"{\"prompt\":\"a\",\"frobnicate\":1}", "frobnicate", "Unrecognized request argument", "unknown_parameter"},
        {"{\"prompt\":\"a\",\"stop\":[\"x\",3]}", "stop[1]", "must be a string", "invalid_type"},
        {"{\"prompt\":\"a\",\"stop\":\"\"}", "stop", "empty", "invalid_value"},
        {"{\"prompt\":\"a\",\"top_p\":-0.1}", "top_p", "outside", "decimal_below_min_value"},
        {"{\"prompt\":\"a\",\"presence_penalty\":3}", "presence_penalty", "outside [-2, 2]", "decimal_above_max_value"},
        {"{\"prompt\":\"a\",\"logprobs\":6}", "logprobs", "outside", "integer_above_max_value"},
        {"{\"prompt\":[\"a\",\"b\"]}", "prompt", "one prompt", "invalid_value"},
        {"{\"max_tokens\":3}", "prompt", "prompt is required", "missing_required_parameter"},
        {"{\"prompt\":\"a\",\"stream_options\":{\"include_usage\":true}}", "stream_options", "stream is true",
         "invalid_value"},
        {"{\"prompt\":\"a\",\"seed\":-1}", "seed", "outside", "integer_below_min_value"},
        {"{\"prompt\":\"a\",\"echo\":true}", "echo", "not supported", "unsupported_value"},
    };
    for (size_t i = 0; i < sizeof cases / sizeof cases[0]; i++) {
        post(cl_, &gw_keyed, "/v1/completions", GW_KEY, cases[i].body, &r);
        expect_error(cl_, &r, 400, cases[i].param, cases[i].needle, cases[i].body);
        expect_code(cl_, &r, cases[i].code, cases[i].body);
        resp_free(&r);
    }
    post(cl_, &gw_open, "/v1/chat/completions", NULL, "{\"messages\":[{\"role\":\"tool\",\"content\":\"x\"}]}", &r);
    expect_error(cl_, &r, 400, "messages", "messages[0].role", "tool role");
    expect_code(cl_, &r, "invalid_value", "tool role");
    resp_free(&r);
    post(cl_, &gw_open, "/v1/chat/completions", NULL, "{\"messages\":[{\"role\":\"user\",\"content\":7}]}", &r);
    expect_error(cl_, &r, 400, "messages[0].content", "must be a string", "content type");
    expect_code(cl_, &r, "invalid_type", "content type");
    resp_free(&r);
    post(cl_, &gw_open, "/v1/chat/completions", NULL,
         "{\"messages\":[{\"role\":\"user\",\"content\":\"x\"}],\"tools\":[{\"type\":\"function\"}]}", &r);
    expect_error(cl_, &r, 400, "tools", "not supported", "tools");
    expect_code(cl_, &r, "unsupported_parameter", "tools");
    resp_free(&r);
    /* The sampler's extensions and the penalties are accepted. */
    post(cl_, &gw_keyed, "/v1/completions", GW_KEY,
         "{\"prompt\":\"a\",\"max_tokens\":3,\"temperature\":0.8,\"top_k\":40,\"min_p\":0.05,\"top_p\":0.9,"
         "\"repetition_penalty\":1.1,\"presence_penalty\":0.5,\"frequency_penalty\":0.5,\"seed\":7,"
         "\"ignore_eos\":true,\"user\":\"u1\",\"stop\":[\"\\n\"],\"logprobs\":null}", &r);
    H_ASSERT(cl_, r.status == 200, "extensions: status %d: %s", r.status, r.body);
    resp_free(&r);
    /* Speculation per request (docs/gateway.md): named modes only. */
    post(cl_, &gw_keyed, "/v1/completions", GW_KEY,
         "{\"prompt\":\"a b a b a\",\"max_tokens\":4,\"speculation\":\"ngram\",\"num_speculative_tokens\":3}", &r);
    H_ASSERT(cl_, r.status == 200, "speculation: status %d: %s", r.status, r.body);
    resp_free(&r);
    post(cl_, &gw_open, "/v1/completions", NULL, "{\"prompt\":\"a\",\"speculation\":\"bogus\"}", &r);
    expect_error(cl_, &r, 400, "speculation", "one of", "speculation bogus");
    expect_code(cl_, &r, "unsupported_value", "speculation bogus");
    resp_free(&r);
    /* Predicted outputs: only {"type": "content"} with text content. */
    post(cl_, &gw_open, "/v1/completions", NULL,
         "{\"prompt\":\"a\",\"prediction\":{\"type\":\"diff\",\"content\":\"x\"}}", &r);
    expect_error(cl_, &r, 400, "prediction.type", "\"diff\" is not supported", "prediction type");
    expect_code(cl_, &r, "unsupported_value", "prediction type");
    resp_free(&r);
    post(cl_, &gw_open, "/v1/completions", NULL, "{\"prompt\":\"a\",\"prediction\":\"x\"}", &r);
    expect_error(cl_, &r, 400, "prediction", "must be an object", "prediction string");
    expect_code(cl_, &r, "invalid_type", "prediction string");
    resp_free(&r);
    post(cl_, &gw_open, "/v1/completions", NULL, "{\"prompt\":\"a\",\"prediction\":{\"type\":\"content\"}}", &r);
    expect_error(cl_, &r, 400, "prediction.content", "missing", "prediction without content");
    expect_code(cl_, &r, "missing_required_parameter", "prediction without content");
    resp_free(&r);
    post(cl_, &gw_open, "/v1/completions", NULL,
         "{\"prompt\":\"a\",\"prediction\":{\"type\":\"content\",\"content\":[{\"type\":\"image_url\"}]}}", &r);
    expect_error(cl_, &r, 400, "prediction.content", "only text parts", "prediction image part");
    resp_free(&r);
    post(cl_, &gw_open, "/v1/completions", NULL, "{\"prompt\":\"a\",\"num_speculative_tokens\":17}", &r);
    expect_error(cl_, &r, 400, "num_speculative_tokens", NULL, "spec tokens");
    resp_free(&r);
    /* Routes and methods. */
    char url[128];
    snprintf(url, sizeof url, "%s/v1/completions", gw_keyed.url);
    curl(cl_, "GET", url, GW_KEY, NULL, 0, NULL, &r);
    expect_error(cl_, &r, 405, NULL, "use POST", "GET completions");
    ASSERT_TRUE(strstr(r.headers, "Allow: POST") != NULL);
    resp_free(&r);
    snprintf(url, sizeof url, "%s/v1/embeddings", gw_keyed.url);
    curl(cl_, "POST", url, GW_KEY, "{}", 2, NULL, &r);
    expect_error(cl_, &r, 404, NULL, "/v1/embeddings", "unknown path");
    resp_free(&r);
    /* An unknown model: the router's NOT_FOUND. */
    post(cl_, &gw_keyed, "/v1/completions", GW_KEY, "{\"model\":\"gpt-9\",\"prompt\":\"a\",\"max_tokens\":2}", &r);
    expect_error(cl_, &r, 404, "model", NULL, "unknown model");
    resp_free(&r);
    /* "default", the name a response reports when no model is named,
     * names the default model back. */
    post(cl_, &gw_keyed, "/v1/completions", GW_KEY, "{\"model\":\"default\",\"prompt\":\"a\",\"max_tokens\":2}", &r);
    H_ASSERT(cl_, r.status == 200, "model \"default\": status %d: %s", r.status, r.body);
    resp_free(&r);
    /* A prompt longer than the context: the router's refusal, as 400. */
    char *big = malloc(40000);
    strcpy(big, "{\"prompt\":\"");
    for (int i = 0; i < 3000; i++) strcat(big, "dog ");
    strcat(big, "\",\"max_tokens\":10}");
    post(cl_, &gw_keyed, "/v1/completions", GW_KEY, big, &r);
    H_ASSERT(cl_, r.status == 400 || r.status == 413, "long prompt: status %d: %s", r.status, r.body);
    resp_free(&r);
    free(big);
}

/* Logprobs carry token text: the legacy object's tokens and chat's
 * content[].bytes make the output text; top_logprobs on chat needs
 * logprobs. */
TEST(logprobs_with_text) {
    setup();
    struct resp r;
    post(cl_, &gw_keyed, "/v1/completions", GW_KEY,
         "{\"prompt\":\"" PROMPT "\",\"max_tokens\":24,\"temperature\":0,\"logprobs\":2}", &r);
    H_ASSERT(cl_, r.status == 200, "status %d: %s", r.status, r.body);
    const cJSON *c = cJSON_GetArrayItem(cJSON_GetObjectItemCaseSensitive(r.json, "choices"), 0);
    const cJSON *lp = cJSON_GetObjectItemCaseSensitive(c, "logprobs");
    const cJSON *toks = cJSON_GetObjectItemCaseSensitive(lp, "tokens");
    const cJSON *tlp = cJSON_GetObjectItemCaseSensitive(lp, "token_logprobs");
    const cJSON *top = cJSON_GetObjectItemCaseSensitive(lp, "top_logprobs");
    const cJSON *off = cJSON_GetObjectItemCaseSensitive(lp, "text_offset");
    H_ASSERT(cl_, cJSON_GetArraySize(toks) == 24 && cJSON_GetArraySize(tlp) == 24 && cJSON_GetArraySize(top) == 24 &&
                      cJSON_GetArraySize(off) == 24, "logprobs arrays: %s", r.body);
    char joined[4096] = "";
    for (int i = 0; i < 24; i++) {
        ASSERT_EQ((int)strlen(joined), cJSON_GetArrayItem(off, i)->valueint); /* ASCII text */
        strncat(joined, cJSON_GetArrayItem(toks, i)->valuestring, sizeof joined - strlen(joined) - 1);
        ASSERT_TRUE(cJSON_GetArrayItem(tlp, i)->valuedouble <= 0);
        const cJSON *d = cJSON_GetArrayItem(top, i);
        ASSERT_TRUE(cJSON_GetArraySize(d) >= 1 && cJSON_GetArraySize(d) <= 2);
        /* Greedy: the chosen token is the likeliest alternative. */
        const cJSON *mine = cJSON_GetObjectItemCaseSensitive(d, cJSON_GetArrayItem(toks, i)->valuestring);
        H_ASSERT(cl_, cJSON_IsNumber(mine), "token %d's text is not among its alternatives: %s", i, r.body);
    }
    H_ASSERT(cl_, strcmp(joined, ref_.text) == 0, "tokens make \"%s\", the text is \"%s\"", joined, ref_.text);
    resp_free(&r);

    post(cl_, &gw_open, "/v1/chat/completions", NULL,
         "{\"messages\":[{\"role\":\"user\",\"content\":\"Hi\"}],\"max_tokens\":8,\"temperature\":0,"
         "\"logprobs\":true,\"top_logprobs\":2}", &r);
    H_ASSERT(cl_, r.status == 200, "chat: status %d: %s", r.status, r.body);
    c = cJSON_GetArrayItem(cJSON_GetObjectItemCaseSensitive(r.json, "choices"), 0);
    const cJSON *content = cJSON_GetObjectItemCaseSensitive(cJSON_GetObjectItemCaseSensitive(c, "logprobs"), "content");
    const char *msg = cJSON_GetObjectItemCaseSensitive(cJSON_GetObjectItemCaseSensitive(c, "message"), "content")->valuestring;
    H_ASSERT(cl_, cJSON_GetArraySize(content) >= 1, "chat logprobs.content: %s", r.body);
    size_t jl = 0;
    const cJSON *t;
    cJSON_ArrayForEach(t, content) {
        ASSERT_TRUE(cJSON_IsString(cJSON_GetObjectItemCaseSensitive(t, "token")));
        ASSERT_EQ(2, cJSON_GetArraySize(cJSON_GetObjectItemCaseSensitive(t, "top_logprobs")));
        const cJSON *b;
        cJSON_ArrayForEach(b, cJSON_GetObjectItemCaseSensitive(t, "bytes")) {
            if (jl + 1 < sizeof joined) joined[jl++] = (char)b->valueint;
        }
    }
    joined[jl] = 0;
    H_ASSERT(cl_, strcmp(joined, msg) == 0, "chat tokens' bytes make \"%s\", the content is \"%s\"", joined, msg);
    resp_free(&r);

    post(cl_, &gw_open, "/v1/chat/completions", NULL,
         "{\"messages\":[{\"role\":\"user\",\"content\":\"Hi\"}],\"top_logprobs\":2}", &r);
    expect_error(cl_, &r, 400, "top_logprobs", "logprobs: true", "top_logprobs without logprobs");
    expect_code(cl_, &r, "invalid_value", "top_logprobs without logprobs");
    resp_free(&r);
}

/* Bodies beyond --max-body (64K here) are refused: with Content-Length
 * before a byte is read, chunked ones as they pass the limit.  The gateway
 * keeps serving. */
TEST(huge_body) {
    setup();
    size_t n = 2 << 20;
    char *big = malloc(n + 64);
    memset(big, ' ', n + 64);
    memcpy(big, "{\"prompt\":\"", 11);
    memcpy(big + n, "\"}", 3);
    struct resp r;
    char url[128];
    snprintf(url, sizeof url, "%s/v1/completions", gw_keyed.url);
    curl(cl_, "POST", url, GW_KEY, big, n + 2, NULL, &r);
    expect_error(cl_, &r, 413, NULL, "--max-body", "2 MiB body");
    resp_free(&r);
    /* Chunked: read and dropped past the limit, then 413; past 8 times the
     * limit the connection is closed. */
    const char *chunked[] = {"-H", "Transfer-Encoding: chunked", NULL};
    size_t mid = 200 << 10;
    memcpy(big + mid, "\"}", 3);
    curl(cl_, "POST", url, GW_KEY, big, mid + 2, chunked, &r);
    expect_error(cl_, &r, 413, NULL, "--max-body", "200 KiB chunked body");
    resp_free(&r);
    memset(big + mid, ' ', 3);
    curl(cl_, "POST", url, GW_KEY, big, n + 2, chunked, &r);
    H_ASSERT(cl_, r.status != 200 && r.status != 400, "2 MiB chunked body: status %d", r.status);
    resp_free(&r);
    free(big);
    post(cl_, &gw_keyed, "/v1/completions", GW_KEY, "{\"prompt\":\"a\",\"max_tokens\":2}", &r);
    ASSERT_EQ(200, r.status);
    resp_free(&r);
}

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

/* No router behind it: 503 with the error object, for generations and models. */
TEST(router_unreachable) {
    setup();
    int port;
    char err[256], ep[64];
    if (zio_free_port(NULL, &port, err, sizeof err) != 0) TEST_FAIL("free port: %s", err);
    snprintf(ep, sizeof ep, "tcp://127.0.0.1:%d", port);
    struct gw dead;
    memset(&dead, 0, sizeof dead);
    gw_start(cl_, &dead, "gateway-dead", ep, "--router-retry-ms 300 --router-reply-timeout-ms 200");
    struct resp r;
    post(cl_, &dead, "/v1/completions", NULL, "{\"prompt\":\"a\",\"max_tokens\":2}", &r);
    expect_error(cl_, &r, 503, NULL, "cannot be reached", "dead router, completion");
    ASSERT_TRUE(strstr(r.headers, "Retry-After:") != NULL);
    resp_free(&r);
    char url[128];
    snprintf(url, sizeof url, "%s/v1/models", dead.url);
    curl(cl_, "GET", url, NULL, NULL, 0, NULL, &r);
    expect_error(cl_, &r, 503, NULL, NULL, "dead router, models");
    resp_free(&r);
    snprintf(url, sizeof url, "%s/ready", dead.metrics_url);
    curl(cl_, "GET", url, NULL, NULL, 0, NULL, &r);
    H_ASSERT(cl_, r.status == 503 && strstr(r.body, "not ready"), "/ready without a router: %d %s", r.status, r.body);
    resp_free(&r);
    h_proc_kill(&dead.proc, SIGTERM);
}

/* The metrics port: /metrics counts the responses by endpoint and status,
 * /health and /ready answer, and promtool accepts the text when present. */
TEST(metrics_port) {
    setup();
    struct resp r;
    char url[160];
    snprintf(url, sizeof url, "%s/metrics", gw_keyed.metrics_url);
    curl(cl_, "GET", url, NULL, NULL, 0, NULL, &r);
    H_ASSERT(cl_, r.status == 200, "/metrics: status %d", r.status);
    /* Sample lines (a newline first: not the # HELP lines). */
    const char *want[] = {"\nllm_http_requests_total{endpoint=\"completions\",code=\"200\"} ",
                          "\nllm_http_requests_total{endpoint=\"completions\",code=\"401\"} ",
                          "\nllm_http_requests_total{endpoint=\"completions\",code=\"413\"} ",
                          "\nllm_gateway_time_to_first_token_seconds_count ", "\nllm_gateway_generation_tokens_total ",
                          "\nllm_gateway_added_latency_seconds_count "};
    for (size_t i = 0; i < sizeof want / sizeof want[0]; i++) {
        const char *p = strstr(r.body, want[i]);
        H_ASSERT(cl_, p != NULL, "/metrics lacks %s:\n%s", want[i], r.body);
        H_ASSERT(cl_, atof(p + strlen(want[i])) >= 1, "%s is 0 after requests that made it", want[i]);
    }
    /* The gateway's own share of a first token: more than nothing, and far
     * below the first tokens themselves (a whole prefill on the CPU). */
    const char *as = strstr(r.body, "\nllm_gateway_added_latency_seconds_sum ");
    const char *ac = strstr(r.body, "\nllm_gateway_added_latency_seconds_count ");
    const char *ts = strstr(r.body, "\nllm_gateway_time_to_first_token_seconds_sum ");
    const char *tc = strstr(r.body, "\nllm_gateway_time_to_first_token_seconds_count ");
    H_ASSERT(cl_, as && ac && ts && tc, "/metrics lacks a _sum or _count:\n%s", r.body);
    double added = atof(as + strlen("\nllm_gateway_added_latency_seconds_sum ")) /
                   atof(ac + strlen("\nllm_gateway_added_latency_seconds_count "));
    double ttft = atof(ts + strlen("\nllm_gateway_time_to_first_token_seconds_sum ")) /
                  atof(tc + strlen("\nllm_gateway_time_to_first_token_seconds_count "));
    H_ASSERT(cl_, added > 0 && added < 0.05, "the gateway's mean added latency is %.6f s", added);
    printf("  gateway's own share of a first token: %.3f ms mean (time to first token %.3f ms mean)\n",
           added * 1e3, ttft * 1e3);
    if (system("promtool --version > /dev/null 2>&1") == 0) {
        char cmd[512];
        snprintf(cmd, sizeof cmd, "promtool check metrics < %s/curl-out", cl_->dir);
        H_ASSERT(cl_, system(cmd) == 0, "promtool check metrics refused the gateway's /metrics");
    } else {
        printf("  (promtool not installed: the format check is left to tests/common/test_httpd)\n");
    }
    resp_free(&r);
    snprintf(url, sizeof url, "%s/health", gw_keyed.metrics_url);
    curl(cl_, "GET", url, NULL, NULL, 0, NULL, &r);
    ASSERT_EQ(200, r.status);
    resp_free(&r);
    snprintf(url, sizeof url, "%s/ready", gw_keyed.metrics_url);
    curl(cl_, "GET", url, NULL, NULL, 0, NULL, &r);
    H_ASSERT(cl_, r.status == 200, "/ready: %d %s", r.status, r.body);
    resp_free(&r);
}

TEST(models) {
    setup();
    struct resp r;
    char url[128];
    snprintf(url, sizeof url, "%s/v1/models", gw_keyed.url);
    curl(cl_, "GET", url, GW_KEY, NULL, 0, NULL, &r);
    H_ASSERT(cl_, r.status == 200, "status %d: %s", r.status, r.body);
    const cJSON *m = cJSON_GetArrayItem(cJSON_GetObjectItemCaseSensitive(r.json, "data"), 0);
    ASSERT_STREQ(GW_MODEL_NAME, cJSON_GetObjectItemCaseSensitive(m, "id")->valuestring);
    ASSERT_STREQ("model", cJSON_GetObjectItemCaseSensitive(m, "object")->valuestring);
    resp_free(&r);
}

/* The official openai npm package against both gateways. */
TEST(openai_node) {
    setup();
    if (system("node --version > /dev/null 2>&1") != 0 || system("npm --version > /dev/null 2>&1") != 0)
        TEST_SKIP("node or npm is not installed: the openai npm package test needs Node 18 or newer");
    const char *dir = LLM_SOURCE_DIR "/tests/gateway/node";
    char cmd[2048];
    if (access(LLM_SOURCE_DIR "/tests/gateway/node/node_modules/openai", R_OK) != 0 ||
        access(LLM_SOURCE_DIR "/tests/gateway/node/node_modules/ajv", R_OK) != 0) {
        snprintf(cmd, sizeof cmd, "cd %s && npm ci --no-audit --no-fund > %s/npm.log 2>&1", dir, cl_->dir);
        if (system(cmd) != 0) {
            char log[2000];
            snprintf(cmd, sizeof cmd, "%s/npm.log", cl_->dir);
            h_tail(cmd, log, sizeof log, 8);
            TEST_SKIP("npm ci in %s failed (no registry reachable?): %s", dir, log);
        }
    }
    setenv("GW_URL", gw_keyed.url, 1);
    setenv("GW_KEY", GW_KEY, 1);
    setenv("GW_CHAT_URL", gw_open.url, 1);
    setenv("GW_MODEL", GW_MODEL_NAME, 1);
    setenv("GW_PROMPT", PROMPT, 1);
    char mt[16];
    snprintf(mt, sizeof mt, "%d", MAX_TOKENS);
    setenv("GW_MAX_TOKENS", mt, 1);
    setenv("GW_EXPECT_TEXT", ref_.text, 1);
    snprintf(cmd, sizeof cmd, "cd %s && timeout 120 node test.mjs", dir);
    fflush(stdout);
    int st = system(cmd);
    H_ASSERT(cl_, st == 0, "the openai npm package test failed (status 0x%x); its output is above", st);
    /* Structured outputs (issue 33): response_format through the SDK,
     * every complete output checked by ajv. */
    snprintf(cmd, sizeof cmd, "cd %s && timeout 300 node structured.mjs", dir);
    fflush(stdout);
    st = system(cmd);
    H_ASSERT(cl_, st == 0, "structured.mjs failed (status 0x%x); its output is above", st);
}


/* ---- issue 29: hardening and first use -------------------------------------- */

/* Invalid UTF-8 anywhere in a body is the client's error, named by its
 * field and answered at once (it used to reach the router, whose refusal
 * libllmclient dropped: 503 router_unavailable after --router-retry-ms). */
TEST(invalid_utf8_refused) {
    setup();
    struct resp r;
    static const struct {
        const struct gw *g;
        const char *path, *key, *body, *param;
    } cases[] = {
        {&gw_keyed, "/v1/completions", GW_KEY, "{\"prompt\":\"\xff\xfe\",\"max_tokens\":2}", "prompt"},
        {&gw_keyed, "/v1/completions", GW_KEY, "{\"prompt\":[\"ok \xc3\"],\"max_tokens\":2}", "prompt[0]"},
        {&gw_keyed, "/v1/completions", GW_KEY, "{\"prompt\":\"a\",\"stop\":[\"x\",\"\xe2\x82\"]}", "stop[1]"},
        {&gw_open, "/v1/chat/completions", NULL, "{\"messages\":[{\"role\":\"user\",\"content\":\"caf\xe9\"}]}",
         "messages[0].content"},
        {&gw_open, "/v1/chat/completions", NULL,
         "{\"messages\":[{\"role\":\"user\",\"content\":\"ok\"},{\"role\":\"user\",\"content\":[{\"type\":\"text\","
         "\"text\":\"\xed\xa0\x80\"}]}]}", "messages[1].content[0].text"},
    };
    for (size_t i = 0; i < sizeof cases / sizeof cases[0]; i++) {
        int64_t t0 = h_now_ms();
        post(cl_, cases[i].g, cases[i].path, cases[i].key, cases[i].body, &r);
        int64_t took = h_now_ms() - t0;
        expect_error(cl_, &r, 400, cases[i].param, "not valid UTF-8", cases[i].param);
        ASSERT_STREQ("invalid_request_error", err_field(&r, "type"));
        H_ASSERT(cl_, took < 1000, "%s: the refusal took %lld ms", cases[i].param, (long long)took);
        resp_free(&r);
    }
    /* Whole characters pass: é as UTF-8. */
    post(cl_, &gw_keyed, "/v1/completions", GW_KEY, "{\"prompt\":\"caf\xc3\xa9\",\"max_tokens\":2}", &r);
    H_ASSERT(cl_, r.status == 200, "a valid UTF-8 prompt: status %d: %s", r.status, r.body);
    resp_free(&r);
}

/* A body is one JSON value: a second object after it was silently dropped. */
TEST(trailing_bytes_refused) {
    setup();
    struct resp r;
    post(cl_, &gw_keyed, "/v1/completions", GW_KEY, "{\"prompt\":\"a\",\"max_tokens\":2} {\"prompt\":\"b\"}", &r);
    expect_error(cl_, &r, 400, "null", "after its JSON value", "two objects");
    resp_free(&r);
    post(cl_, &gw_keyed, "/v1/completions", GW_KEY, "{\"prompt\":\"a\",\"max_tokens\":2}x", &r);
    expect_error(cl_, &r, 400, "null", "1 more bytes", "one trailing byte");
    resp_free(&r);
    /* Blanks after the object are fine. */
    post(cl_, &gw_keyed, "/v1/completions", GW_KEY, "{\"prompt\":\"a\",\"max_tokens\":2}\r\n \n", &r);
    H_ASSERT(cl_, r.status == 200, "trailing blanks: status %d: %s", r.status, r.body);
    resp_free(&r);
}

/* A prompt longer than the context is OpenAI's 400 context_length_exceeded
 * with the prompt's field as param, and a message without libllmclient's
 * "generate: INVALID_ARGUMENT: ... (request ...)" wrapping: a text prompt
 * through the router's refusal, token ids and chat by the gateway itself. */
TEST(context_length_exceeded) {
    setup();
    struct resp r;
    char *big = malloc(40000);
    strcpy(big, "{\"prompt\":\"");
    for (int i = 0; i < 3000; i++) strcat(big, "dog ");
    strcat(big, "\",\"max_tokens\":10}");
    post(cl_, &gw_keyed, "/v1/completions", GW_KEY, big, &r);
    expect_error(cl_, &r, 400, "prompt", "context", "a 3000-word prompt");
    ASSERT_STREQ("context_length_exceeded", err_field(&r, "code"));
    const char *msg = err_field(&r, "message");
    H_ASSERT(cl_, !strstr(msg, "INVALID_ARGUMENT") && !strstr(msg, "generate:") && !strstr(msg, "(request "),
             "the message carries libllmclient's wrapping: %s", msg);
    resp_free(&r);

    strcpy(big, "{\"prompt\":[1");
    for (int i = 1; i < 200; i++) strcat(big, ",1");
    strcat(big, "],\"max_tokens\":2}");
    post(cl_, &gw_keyed, "/v1/completions", GW_KEY, big, &r);
    expect_error(cl_, &r, 400, "prompt", "maximum context length is 128 tokens", "200 token ids");
    ASSERT_STREQ("context_length_exceeded", err_field(&r, "code"));
    resp_free(&r);

    strcpy(big, "{\"messages\":[{\"role\":\"user\",\"content\":\"");
    for (int i = 0; i < 300; i++) strcat(big, "dog ");
    strcat(big, "\"}]}");
    post(cl_, &gw_open, "/v1/chat/completions", NULL, big, &r);
    expect_error(cl_, &r, 400, "messages", "maximum context length is 128 tokens", "a 300-word chat");
    ASSERT_STREQ("context_length_exceeded", err_field(&r, "code"));
    resp_free(&r);
    free(big);
}

/* The model's name when a request does not give one: the id /v1/models
 * lists (the router's, without --model-name), in whole and streamed
 * responses, not "default".  The chat template error names it the same
 * way, never by path, and says how to choose a template with the
 * environment variable and with llm-cluster. */
TEST(model_named_as_listed) {
    setup();
    struct gw g;
    memset(&g, 0, sizeof g);
    gw_start_named(cl_, &g, "gateway-unnamed", cl_->client_ep, NULL, "");
    struct resp r;
    char url[128];
    snprintf(url, sizeof url, "%s/v1/models", g.url);
    curl(cl_, "GET", url, NULL, NULL, 0, NULL, &r);
    H_ASSERT(cl_, r.status == 200, "/v1/models: %d %s", r.status, r.body);
    const cJSON *id = cJSON_GetObjectItemCaseSensitive(
        cJSON_GetArrayItem(cJSON_GetObjectItemCaseSensitive(r.json, "data"), 0), "id");
    H_ASSERT(cl_, cJSON_IsString(id), "/v1/models has no id: %s", r.body);
    char name[256];
    snprintf(name, sizeof name, "%s", id->valuestring);
    resp_free(&r);
    H_ASSERT(cl_, strcmp(name, "default") != 0, "/v1/models lists \"default\"");

    post(cl_, &g, "/v1/completions", NULL, "{\"prompt\":\"a\",\"max_tokens\":2}", &r);
    H_ASSERT(cl_, r.status == 200, "completion: %d %s", r.status, r.body);
    const cJSON *m = cJSON_GetObjectItemCaseSensitive(r.json, "model");
    H_ASSERT(cl_, cJSON_IsString(m) && strcmp(m->valuestring, name) == 0, "completion's model is %s, /v1/models "
             "lists %s", cJSON_IsString(m) ? m->valuestring : "(none)", name);
    resp_free(&r);
    post(cl_, &g, "/v1/completions", NULL, "{\"prompt\":\"a\",\"max_tokens\":2,\"stream\":true}", &r);
    char want[300];
    snprintf(want, sizeof want, "\"model\":\"%s\"", name);
    H_ASSERT(cl_, r.status == 200 && strstr(r.body, want) && !strstr(r.body, "\"model\":\"default\""),
             "streamed completion does not name %s: %s", name, r.body);
    resp_free(&r);

    post(cl_, &g, "/v1/chat/completions", NULL, "{\"messages\":[{\"role\":\"user\",\"content\":\"Hi\"}]}", &r);
    expect_error(cl_, &r, 400, "messages", "LLM_CHAT_TEMPLATE", "chat without a template");
    msg_has(cl_, &r, name);
    msg_has(cl_, &r, "llm-cluster up --chat-template");
    msg_has(cl_, &r, "--chat-template NAME");
    H_ASSERT(cl_, !strstr(err_field(&r, "message"), "/shared/models/"), "the message names the model by path: %s",
             err_field(&r, "message"));
    resp_free(&r);
    h_proc_kill(&g.proc, SIGTERM);
}

/* A streamed chat opens with the role alone (content ""), as OpenAI's does
 * and docs/gateway.md shows; no later chunk repeats it, and text comes in
 * chunks of its own. */
TEST(chat_stream_role_first) {
    setup();
    struct resp r;
    post(cl_, &gw_open, "/v1/chat/completions", NULL,
         "{\"messages\":[{\"role\":\"user\",\"content\":\"Once upon a time\"}],\"max_tokens\":8,\"temperature\":0,"
         "\"stream\":true}", &r);
    H_ASSERT(cl_, r.status == 200, "status %d: %s", r.status, r.body);
    char *copy = strdup(r.body), *save = NULL;
    int n = 0, texts = 0;
    for (char *ev = strtok_r(copy, "\n", &save); ev; ev = strtok_r(NULL, "\n", &save)) {
        if (strcmp(ev, "data: [DONE]") == 0) break;
        cJSON *j = cJSON_Parse(ev + 6);
        const cJSON *d = cJSON_GetObjectItemCaseSensitive(
            cJSON_GetArrayItem(cJSON_GetObjectItemCaseSensitive(j, "choices"), 0), "delta");
        const cJSON *role = cJSON_GetObjectItemCaseSensitive(d, "role");
        const cJSON *content = cJSON_GetObjectItemCaseSensitive(d, "content");
        if (n == 0) {
            H_ASSERT(cl_, cJSON_IsString(role) && strcmp(role->valuestring, "assistant") == 0 &&
                              cJSON_IsString(content) && content->valuestring[0] == 0,
                     "the first chunk is not the role alone: %s", ev);
        } else {
            H_ASSERT(cl_, !role, "chunk %d repeats the role: %s", n, ev);
            if (cJSON_IsString(content) && content->valuestring[0]) texts++;
        }
        cJSON_Delete(j);
        n++;
    }
    free(copy);
    H_ASSERT(cl_, texts >= 1, "no chunk after the role carries text: %s", r.body);
    resp_free(&r);
}


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

/* Last: the cluster and gateways go. */
TEST(teardown) {
    if (!cl_) TEST_SKIP("nothing started");
    h_proc_kill(&gw_keyed.proc, SIGTERM);
    h_proc_kill(&gw_open.proc, SIGTERM);
    h_cluster_stop(cl_);
    cl_ = NULL;
}

TEST_MAIN(completion_equals_llm_run, prediction_same_text, prediction_usage, completion_stream_sse, chat_without_template, api_keys, bad_requests, logprobs_with_text,
          huge_body, invalid_utf8_refused, trailing_bytes_refused, context_length_exceeded, model_named_as_listed,
          chat_stream_role_first, slowloris, read_deadline,
          disconnect_cancels, runners_reused, router_unreachable, metrics_port, models, openai_node, teardown)
