/* Constrained decoding end to end (docs/grammar.md): requests carrying a
 * JSON Schema, json_object or a GBNF grammar through real routers and
 * workers, greedy and sampled, on 1x1 and 1x2 pipelines of stories260K
 * and of the pycode target, and with the last stage killed mid-generation.  Every output that finished with "stop" is
 * checked: a JSON text the schema accepts (a small validator of the schema
 * subset used here, on cJSON), or a sentence of the grammar (a POSIX regex
 * of the same language).  A request resumed elsewhere must give the same
 * text as one that ran through: the masks depend on the tokens only.  The
 * ajv suite (tests/gateway/node/structured.mjs) checks the same through
 * the gateway with a real JSON Schema validator. */
#include "tests/router/cluster_harness.h"

#include <regex.h>

#define MODEL "stories260K-f32.gguf"
/* A 23M code model with a 32k-class tokenizer of its own (BPE, byte
 * fallback): other token shapes for the masks than stories260K's. */
#define PYCODE "pycode/pycode-target-q4_k_m.gguf"

/* Bounded, so that a 260K-parameter model finishes within max_tokens. */
static const char *const schemas[] = {
    "{\"type\":\"object\",\"properties\":{\"name\":{\"type\":\"string\",\"maxLength\":8},"
    "\"age\":{\"type\":\"integer\"},\"ok\":{\"type\":\"boolean\"}},"
    "\"required\":[\"name\",\"age\",\"ok\"],\"additionalProperties\":false}",
    "{\"type\":\"object\",\"properties\":{\"color\":{\"enum\":[\"red\",\"green\",\"blue\"]},"
    "\"tags\":{\"type\":\"array\",\"items\":{\"type\":\"string\",\"maxLength\":4},\"minItems\":1,"
    "\"maxItems\":3},\"note\":{\"anyOf\":[{\"type\":\"null\"},{\"type\":\"string\",\"maxLength\":5}]}},"
    "\"required\":[\"color\",\"tags\"],\"additionalProperties\":false}",
    "{\"type\":\"array\",\"items\":{\"type\":\"object\",\"properties\":{\"k\":{\"const\":\"v\"},"
    "\"n\":{\"type\":\"number\"},\"z\":{\"type\":\"null\"}},\"required\":[\"k\"],"
    "\"additionalProperties\":false},\"minItems\":1,\"maxItems\":2}",
};
#define N_SCHEMAS ((int)(sizeof schemas / sizeof schemas[0]))

static const char *const grammar_text =
    "root ::= greet \" \" name (\", \" name){0,2} \"!\"\n"
    "greet ::= \"hello\" | \"hi\" | \"dear\"\n"
    "name ::= [A-Z] [a-z]{1,6}\n";
static const char *const grammar_regex = "^(hello|hi|dear) [A-Z][a-z]{1,6}(, [A-Z][a-z]{1,6}){0,2}!$";

static const char *const prompts[] = {"Once upon a time", "The little dog", "Lily and Tom"};

struct cgen {
    struct cluster *cl;
    char request_id[64];
    const char *prompt;
    const char *schema, *grammar;
    int json_object;
    float temperature;
    uint64_t seed;
    int max_tokens;
    /* out */
    int rc;
    char err[512];
    struct llm_generate_result res;
    char text[8192];
    size_t len;
    int n;
    volatile int *kill_at; /* tokens seen by all, for the kill test */
};

static int cg_on_chunk(void *ud, const struct llm_chunk *ch) {
    struct cgen *g = ud;
    if (g->len + ch->text_len < sizeof g->text) {
        memcpy(g->text + g->len, ch->text, ch->text_len);
        g->len += ch->text_len;
        g->text[g->len] = 0;
    }
    g->n += (int)ch->n_tokens;
    if (g->kill_at) __atomic_add_fetch(g->kill_at, (int)ch->n_tokens, __ATOMIC_RELAXED);
    return 0;
}

static void cg_run(struct cgen *g) {
    llm_client *c = h_client(g->cl, 5000, 10000, 60000);
    struct llm_generate_params p;
    llm_generate_params_default(&p);
    p.request_id = g->request_id;
    p.prompt = g->prompt;
    p.max_tokens = (uint32_t)g->max_tokens;
    p.sampling.temperature = g->temperature;
    p.sampling.seed = g->seed;
    p.json_schema = g->schema;
    p.grammar = g->grammar;
    p.json_object = g->json_object;
    p.wait_ms = 120000;
    g->len = 0;
    g->text[0] = 0;
    g->n = 0;
    g->rc = llm_client_generate(c, &p, cg_on_chunk, g, &g->res);
    if (g->rc != 0) snprintf(g->err, sizeof g->err, "%s", llm_client_errstr(c));
    llm_client_close(c);
}

static void *cg_thread(void *arg) {
    cg_run(arg);
    return NULL;
}

static void cg_run_all(struct cgen *gs, int n) {
    pthread_t th[64];
    for (int i = 0; i < n; i++) pthread_create(&th[i], NULL, cg_thread, &gs[i]);
    for (int i = 0; i < n; i++) pthread_join(th[i], NULL);
}

/* ---- a validator of the schema subset above ---- */

static int v_check(const cJSON *s, const cJSON *x, char *why, size_t n);

static int v_type(const char *t, const cJSON *x) {
    if (!strcmp(t, "object")) return cJSON_IsObject(x);
    if (!strcmp(t, "array")) return cJSON_IsArray(x);
    if (!strcmp(t, "string")) return cJSON_IsString(x);
    if (!strcmp(t, "boolean")) return cJSON_IsBool(x);
    if (!strcmp(t, "null")) return cJSON_IsNull(x);
    if (!strcmp(t, "number")) return cJSON_IsNumber(x);
    if (!strcmp(t, "integer")) return cJSON_IsNumber(x) && x->valuedouble == (double)(int64_t)x->valuedouble;
    return 0;
}

static int v_equal(const cJSON *a, const cJSON *b) { return cJSON_Compare(a, b, 1); }

/* UTF-8 characters of a string */
static int v_chars(const char *s) {
    int n = 0;
    for (; *s; s++) n += ((unsigned char)*s & 0xC0) != 0x80;
    return n;
}

static int v_check(const cJSON *s, const cJSON *x, char *why, size_t n) {
    const cJSON *k;
    if ((k = cJSON_GetObjectItemCaseSensitive(s, "type")) && !v_type(k->valuestring, x))
        return snprintf(why, n, "not of type %s", k->valuestring), 0;
    if ((k = cJSON_GetObjectItemCaseSensitive(s, "const")) && !v_equal(k, x))
        return snprintf(why, n, "not the const"), 0;
    if ((k = cJSON_GetObjectItemCaseSensitive(s, "enum"))) {
        int hit = 0;
        for (const cJSON *e = k->child; e; e = e->next) hit |= v_equal(e, x);
        if (!hit) return snprintf(why, n, "not in the enum"), 0;
    }
    if ((k = cJSON_GetObjectItemCaseSensitive(s, "anyOf"))) {
        int hit = 0;
        for (const cJSON *e = k->child; e; e = e->next) hit |= v_check(e, x, why, n);
        if (!hit) return snprintf(why, n, "no anyOf branch"), 0;
    }
    if (cJSON_IsString(x)) {
        int c = v_chars(x->valuestring);
        if ((k = cJSON_GetObjectItemCaseSensitive(s, "maxLength")) && c > k->valueint)
            return snprintf(why, n, "string of %d > maxLength", c), 0;
    }
    if (cJSON_IsArray(x)) {
        int c = cJSON_GetArraySize(x);
        if ((k = cJSON_GetObjectItemCaseSensitive(s, "minItems")) && c < k->valueint)
            return snprintf(why, n, "%d items < minItems", c), 0;
        if ((k = cJSON_GetObjectItemCaseSensitive(s, "maxItems")) && c > k->valueint)
            return snprintf(why, n, "%d items > maxItems", c), 0;
        if ((k = cJSON_GetObjectItemCaseSensitive(s, "items")))
            for (const cJSON *e = x->child; e; e = e->next)
                if (!v_check(k, e, why, n)) return 0;
    }
    if (cJSON_IsObject(x)) {
        const cJSON *props = cJSON_GetObjectItemCaseSensitive(s, "properties");
        if ((k = cJSON_GetObjectItemCaseSensitive(s, "required")))
            for (const cJSON *e = k->child; e; e = e->next)
                if (!cJSON_GetObjectItemCaseSensitive(x, e->valuestring))
                    return snprintf(why, n, "required '%s' missing", e->valuestring), 0;
        const cJSON *ap = cJSON_GetObjectItemCaseSensitive(s, "additionalProperties");
        for (const cJSON *e = x->child; e; e = e->next) {
            const cJSON *ps = props ? cJSON_GetObjectItemCaseSensitive(props, e->string) : NULL;
            if (!ps && cJSON_IsFalse(ap)) return snprintf(why, n, "property '%s' not allowed", e->string), 0;
            if (ps && !v_check(ps, e, why, n)) return 0;
            for (const cJSON *d = e->next; d; d = d->next)
                if (!strcmp(d->string, e->string)) return snprintf(why, n, "'%s' twice", e->string), 0;
        }
    }
    return 1;
}

/* 1 when text is a JSON text schema accepts (schema NULL: any object). */
static int valid_json(const char *schema, const char *text, char *why, size_t n) {
    const char *end = NULL;
    cJSON *x = cJSON_ParseWithOpts(text, &end, 1);
    if (!x) return snprintf(why, n, "not JSON"), 0;
    int ok;
    if (!schema) {
        ok = cJSON_IsObject(x);
        if (!ok) snprintf(why, n, "not an object");
    } else {
        cJSON *s = cJSON_Parse(schema);
        ok = v_check(s, x, why, n);
        cJSON_Delete(s);
    }
    cJSON_Delete(x);
    return ok;
}

static int valid_grammar(const char *text) {
    regex_t re;
    if (regcomp(&re, grammar_regex, REG_EXTENDED | REG_NOSUB) != 0) TEST_FAIL("regcomp");
    int ok = regexec(&re, text, 0, NULL, 0) == 0;
    regfree(&re);
    return ok;
}

/* Checks every output; returns how many finished with "stop". */
static int check_outputs(struct cluster *cl, struct cgen *gs, int n) {
    int stops = 0;
    for (int i = 0; i < n; i++) {
        struct cgen *g = &gs[i];
        H_ASSERT(cl, g->rc == 0, "%s: %s", g->request_id, g->err);
        Llm__GenerateDone__FinishReason f = g->res.finish_reason;
        H_ASSERT(cl, f == LLM__GENERATE_DONE__FINISH_REASON__STOP || f == LLM__GENERATE_DONE__FINISH_REASON__LENGTH,
                 "%s: finish %s: %s", g->request_id, llm_finish_reason_name(f), g->res.error_message);
        if (f != LLM__GENERATE_DONE__FINISH_REASON__STOP) continue;
        stops++;
        char why[128] = "";
        int ok = g->grammar ? valid_grammar(g->text) : valid_json(g->schema, g->text, why, sizeof why);
        H_ASSERT(cl, ok, "%s: invalid output (%s): [%s]", g->request_id, why, g->text);
    }
    return stops;
}

static void make(struct cgen *gs, int n, struct cluster *cl, const char *tag, float temperature) {
    for (int i = 0; i < n; i++) {
        struct cgen *g = &gs[i];
        llm_generate_result_free(&g->res); /* a previous run's */
        memset(g, 0, sizeof *g);
        g->cl = cl;
        snprintf(g->request_id, sizeof g->request_id, "%s-%d", tag, i);
        g->prompt = prompts[i % 3];
        int kind = i % (N_SCHEMAS + 2);
        if (kind < N_SCHEMAS) g->schema = schemas[kind];
        else if (kind == N_SCHEMAS) g->grammar = grammar_text;
        else g->json_object = 1;
        g->temperature = temperature;
        g->seed = 1000 + (uint64_t)i;
        g->max_tokens = 200;
    }
}

static void constrained_serves(int stages) {
    const char *model = test_model_path(MODEL);
    struct cluster *cl = h_cluster_start(model, 1, stages, "", "");
    static struct cgen gs[20];
    char tag[32];
    int total = 0, stops = 0;
    for (int sampled = 0; sampled < 2; sampled++) {
        snprintf(tag, sizeof tag, "c%d-%s", stages, sampled ? "t1" : "greedy");
        make(gs, 10, cl, tag, sampled ? 1.0f : 0.0f);
        cg_run_all(gs, 10);
        stops += check_outputs(cl, gs, 10);
        total += 10;
        for (int i = 0; i < 10; i++) llm_generate_result_free(&gs[i].res);
    }
    printf("  1x%d: %d of %d outputs finished with stop, all valid\n", stages, stops, total);
    H_ASSERT(cl, stops >= total / 2, "only %d of %d outputs finished", stops, total);
    /* Greedy is deterministic: the same request again gives the same text. */
    make(gs, 2, cl, "again", 0.0f);
    cg_run_all(gs, 2);
    char first[2][8192];
    for (int i = 0; i < 2; i++) snprintf(first[i], sizeof first[i], "%s", gs[i].text);
    make(gs, 2, cl, "again2", 0.0f);
    cg_run_all(gs, 2);
    for (int i = 0; i < 2; i++) ASSERT_STREQ(first[i], gs[i].text);
    /* Errors are named. */
    struct cgen *g = &gs[0];
    make(gs, 1, cl, "bad", 0.0f);
    g->schema = NULL;
    g->grammar = "root ::= \"a\" b\n";
    cg_run(g);
    H_ASSERT(cl, g->rc != 0 && strstr(g->err, "line 1, column 14: undefined rule 'b'"), "rc %d: %s", g->rc, g->err);
    for (int i = 0; i < 2; i++) llm_generate_result_free(&gs[i].res);
    h_cluster_stop(cl);
}

/* The pycode target on 1x1 and 1x2 pipelines, greedy and sampled: every
 * output that finished with stop is valid. */
static void constrained_pycode(int stages) {
    static const char *const code_prompts[] = {"# the settings as JSON\nsettings = ", "data = json.loads(",
                                               "def config():\n    return "};
    const char *model = test_model_path(PYCODE);
    struct cluster *cl = h_cluster_start(model, 1, stages, "", "");
    enum { N = 5 };
    static struct cgen gs[N];
    int total = 0, stops = 0;
    int64_t t0 = h_now_ms();
    for (int sampled = 0; sampled < 2; sampled++) {
        make(gs, N, cl, sampled ? "py-t1" : "py-greedy", sampled ? 1.0f : 0.0f);
        for (int i = 0; i < N; i++) {
            gs[i].prompt = code_prompts[i % 3];
            gs[i].max_tokens = 120;
        }
        cg_run_all(gs, N);
        stops += check_outputs(cl, gs, N);
        total += N;
        for (int i = 0; i < N; i++) llm_generate_result_free(&gs[i].res);
    }
    printf("  pycode 1x%d: %d of %d outputs finished with stop, all valid (%lld ms)\n", stages, stops, total,
           (long long)(h_now_ms() - t0));
    H_ASSERT(cl, stops >= total / 3, "only %d of %d outputs finished", stops, total);
    h_cluster_stop(cl);
}

TEST(cluster_constrained_pycode_1x1) { constrained_pycode(1); }
TEST(cluster_constrained_pycode_1x2) { constrained_pycode(2); }
TEST(cluster_constrained_1x1) { constrained_serves(1); }
TEST(cluster_constrained_1x2) { constrained_serves(2); }

/* The last stage of pipeline 0 dies while constrained sampled requests
 * stream: they finish on pipeline 1 (prefilled again with their tokens, the
 * grammar state replayed) with valid outputs equal to an uninterrupted
 * run's. */
TEST(cluster_constrained_worker_killed) {
    const char *model = test_model_path(MODEL);
    struct cluster *cl = h_cluster_start(model, 2, 2, "", "--metrics-listen 127.0.0.1:0");
    enum { N = 10 };
    static struct cgen ref[N], gs[N];
    make(ref, N, cl, "ref", 1.0f);
    cg_run_all(ref, N);
    check_outputs(cl, ref, N);
    make(gs, N, cl, "kill", 1.0f);
    static volatile int seen;
    seen = 0;
    for (int i = 0; i < N; i++) gs[i].kill_at = &seen;
    pthread_t th[N];
    for (int i = 0; i < N; i++) pthread_create(&th[i], NULL, cg_thread, &gs[i]);
    int64_t t0 = h_now_ms();
    while (__atomic_load_n(&seen, __ATOMIC_RELAXED) < 2 * N && h_now_ms() - t0 < 30000) h_sleep_ms(1);
    int at = __atomic_load_n(&seen, __ATOMIC_RELAXED);
    int slot = h_worker_slot(cl, 0, 1);
    ASSERT_TRUE(slot >= 0);
    h_proc_kill(&cl->workers[slot], SIGKILL);
    for (int i = 0; i < N; i++) pthread_join(th[i], NULL);
    int stops = check_outputs(cl, gs, N);
    printf("  killed after %d tokens; %d of %d finished with stop, all valid\n", at, stops, N);
    for (int i = 0; i < N; i++) {
        H_ASSERT(cl, gs[i].res.finish_reason == ref[i].res.finish_reason, "%s: finish %s, uninterrupted %s",
                 gs[i].request_id, llm_finish_reason_name(gs[i].res.finish_reason),
                 llm_finish_reason_name(ref[i].res.finish_reason));
        ASSERT_STREQ(ref[i].text, gs[i].text);
        llm_generate_result_free(&gs[i].res);
        llm_generate_result_free(&ref[i].res);
    }
    /* The surviving last stage computed masks and rebuilt the moved
     * sequences' parse states by replay (docs/metrics.md). */
    int last = h_worker_slot(cl, 1, 1);
    ASSERT_TRUE(last >= 0);
    int port = h_logged_port(&cl->workers[last]);
    H_ASSERT(cl, port > 0, "%s logged no metrics port", cl->workers[last].name);
    static char body[1 << 20];
    H_ASSERT(cl, h_http_get(port, "/metrics", body, sizeof body) == 200, "worker /metrics on port %d", port);
    double masks = h_sample(body, "llm_constrain_mask_time_seconds_count");
    double replays = h_sample(body, "llm_constrain_replays_total");
    double replayed = h_sample(body, "llm_constrain_replayed_tokens_total");
    printf("  surviving last stage: %g masks, %g replays of %g tokens\n", masks, replays, replayed);
    H_ASSERT(cl, masks > 0 && replays >= 1 && replayed >= replays, "masks %g, replays %g, replayed tokens %g",
             masks, replays, replayed);
    h_cluster_stop(cl);
}

TEST_MAIN(cluster_constrained_1x1, cluster_constrained_1x2, cluster_constrained_worker_killed,
          cluster_constrained_pycode_1x1, cluster_constrained_pycode_1x2)
