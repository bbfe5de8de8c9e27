/* The generation helper of the speculative-decoding cluster tests
 * (test_cluster_spec.c, test_cluster_spec_draft.c): a request of a given
 * speculation mode, temperature and seed run on its own client (alone or
 * with others on threads), its ids and text collected, and the checks that
 * it ran to max_tokens and that two runs gave the same ids and text.
 * Included after cluster_harness.h; every function is static. */
#ifndef TESTS_ROUTER_SPEC_HARNESS_H
#define TESTS_ROUTER_SPEC_HARNESS_H

#include "tests/router/cluster_harness.h"

struct sgen {
    struct cluster *cl;
    char request_id[64];
    const char *prompt;
    int spec; /* GenerateRequest.Spec */
    float temperature;
    uint64_t seed;
    int max_tokens;
    const char *prediction; /* GenerateRequest.prediction; NULL: none */
    const int32_t *prediction_tokens; /* or as ids */
    int n_prediction_tokens;
    /* out */
    int rc;
    char err[512];
    struct llm_generate_result res;
    int32_t ids[512];
    int n;
    char text[8192];
    size_t len;
    volatile int *seen; /* tokens seen by all, for the kill test */
};

static int sg_on_chunk(void *ud, const struct llm_chunk *ch) {
    struct sgen *g = ud;
    for (size_t i = 0; i < ch->n_tokens; i++) {
        if (g->n < 512) g->ids[g->n] = ch->token_ids[i];
        g->n++;
    }
    if (g->len + ch->text_len < sizeof g->text) {
        memcpy(g->text + g->len, ch->text, ch->text_len);
        g->len += ch->text_len;
        g->text[g->len] = 0;
    }
    if (g->seen) __atomic_add_fetch(g->seen, (int)ch->n_tokens, __ATOMIC_RELAXED);
    return 0;
}

static void sg_run(struct sgen *g) {
    llm_client *c = h_client(g->cl, 5000, 10000, 60000);
    struct llm_generate_params p;
    llm_generate_params_default(&p);
    p.request_id = g->request_id;
    p.prompt = g->prompt;
    p.max_tokens = (uint32_t)g->max_tokens;
    p.sampling.temperature = g->temperature;
    p.sampling.seed = g->seed;
    p.sampling.ignore_eos = 1;
    p.spec = g->spec;
    p.prediction = g->prediction;
    p.prediction_tokens = g->prediction_tokens;
    p.n_prediction_tokens = (size_t)g->n_prediction_tokens;
    p.wait_ms = 180000;
    g->n = 0;
    g->len = 0;
    g->text[0] = 0;
    g->rc = llm_client_generate(c, &p, sg_on_chunk, g, &g->res);
    if (g->rc != 0) snprintf(g->err, sizeof g->err, "%s", llm_client_errstr(c));
    llm_client_close(c);
}

static void *sg_thread(void *arg) {
    sg_run(arg);
    return NULL;
}

static H_UNUSED void sg_run_all(struct sgen *gs, int n) {
    pthread_t th[32];
    for (int i = 0; i < n; i++) pthread_create(&th[i], NULL, sg_thread, &gs[i]);
    for (int i = 0; i < n; i++) pthread_join(th[i], NULL);
}

static void sg_ok(struct cluster *cl, const struct sgen *g) {
    H_ASSERT(cl, g->rc == 0, "request %s: status %d: %s", g->request_id, g->rc, g->err);
    H_ASSERT(cl, g->res.finish_reason == LLM__GENERATE_DONE__FINISH_REASON__LENGTH,
             "request %s: finish %s (%s)", g->request_id, llm_finish_reason_name(g->res.finish_reason),
             g->res.error_message ? g->res.error_message : "");
    H_ASSERT(cl, g->n == g->max_tokens && (int)g->res.completion_tokens == g->n,
             "request %s: %d tokens received, %u counted, %d asked", g->request_id, g->n,
             g->res.completion_tokens, g->max_tokens);
}

/* llm status, text and --json, names want (NULL: none) as pipeline 0's
 * draft model: what its last stage's worker registered (llm-worker
 * --draft-model's file name). */
static H_UNUSED void sg_status_draft(struct cluster *cl, const char *want) {
    static char out[1 << 16];
    char cmd[600], line[300];
    for (int json = 0; json < 2; json++) {
        snprintf(cmd, sizeof cmd, "'%s' --router '%s' status%s 2>&1", LLM_BINARY_DIR "/clients/c/llm", cl->client_ep,
                 json ? " --json" : "");
        FILE *p = popen(cmd, "r");
        H_ASSERT(cl, p != NULL, "popen %s", cmd);
        size_t n = fread(out, 1, sizeof out - 1, p);
        out[n] = 0;
        int st = pclose(p);
        H_ASSERT(cl, st == 0, "%s: status 0x%x: %s", cmd, st, out);
        if (json) {
            cJSON *j = cJSON_Parse(out);
            const cJSON *d = cJSON_GetObjectItemCaseSensitive(
                cJSON_GetArrayItem(cJSON_GetObjectItemCaseSensitive(j, "pipelines"), 0), "draft_model");
            H_ASSERT(cl, cJSON_IsString(d) && strcmp(d->valuestring, want ? want : "") == 0,
                     "llm status --json: pipeline 0's draft_model is %s, not \"%s\": %s",
                     cJSON_IsString(d) ? d->valuestring : "absent", want ? want : "", out);
            cJSON_Delete(j);
        } else {
            if (want) snprintf(line, sizeof line, "tokens/s, draft model %s", want);
            else snprintf(line, sizeof line, "tokens/s, no draft model");
            H_ASSERT(cl, strstr(out, "pipeline 0: ") && strstr(out, line), "llm status does not say \"%s\": %s",
                     line, out);
        }
    }
}

/* The same ids and text. */
static void sg_same(struct cluster *cl, const struct sgen *want, const struct sgen *got) {
    sg_ok(cl, want);
    sg_ok(cl, got);
    for (int i = 0; i < want->n && i < 512; i++)
        H_ASSERT(cl, want->ids[i] == got->ids[i], "%s: token %d is %d, %s has %d", got->request_id, i,
                 got->ids[i], want->request_id, want->ids[i]);
    ASSERT_STREQ(want->text, got->text);
}

/* n requests (prompts in turn, every other one sampled at 0.8, seeds
 * seed0 ..) run on a 2x2 cluster of model with speculation off, then again
 * speculated by spec while the last stage of pipeline 0 is killed: each
 * resumes on pipeline 1 and must end with the text of its run without
 * speculation. */
static H_UNUSED void sg_worker_killed(const char *model, const char *router_args, const char *worker_args,
                                      const char *const *prompts, int n_prompts, int n, uint64_t seed0,
                                      int spec) {
    struct cluster *cl = h_cluster_start(model, 2, 2, router_args, worker_args);
    enum { N_MAX = 8 };
    static struct sgen ref[N_MAX], gs[N_MAX];
    if (n > N_MAX) TEST_FAIL("sg_worker_killed: %d requests, at most %d", n, N_MAX);
    for (int i = 0; i < n; i++) {
        memset(&ref[i], 0, sizeof ref[i]);
        ref[i].cl = cl;
        snprintf(ref[i].request_id, sizeof ref[i].request_id, "ref-%d", i);
        ref[i].prompt = prompts[i % n_prompts];
        ref[i].max_tokens = 64;
        ref[i].temperature = i % 2 ? 0.8f : 0.0f;
        ref[i].seed = seed0 + (uint64_t)i;
        ref[i].spec = LLM__GENERATE_REQUEST__SPEC__SPEC_OFF;
        gs[i] = ref[i];
        snprintf(gs[i].request_id, sizeof gs[i].request_id, "kill-%d", i);
        gs[i].spec = spec;
    }
    sg_run_all(ref, n);
    static volatile int seen;
    seen = 0;
    for (int i = 0; i < n; i++) gs[i].seen = &seen;
    pthread_t th[N_MAX];
    for (int i = 0; i < n; i++) pthread_create(&th[i], NULL, sg_thread, &gs[i]);
    int64_t t0 = h_now_ms();
    while (__atomic_load_n(&seen, __ATOMIC_RELAXED) < 3 * n && h_now_ms() - t0 < 30000) h_sleep_ms(1);
    int at = __atomic_load_n(&seen, __ATOMIC_RELAXED);
    int slot = h_worker_slot(cl, 0, 1);
    ASSERT_TRUE(slot >= 0);
    h_proc_kill(&cl->workers[slot], SIGKILL);
    for (int i = 0; i < n; i++) pthread_join(th[i], NULL);
    printf("  killed after %d tokens\n", at);
    for (int i = 0; i < n; i++) {
        sg_same(cl, &ref[i], &gs[i]);
        llm_generate_result_free(&gs[i].res);
        llm_generate_result_free(&ref[i].res);
    }
    h_cluster_stop(cl);
}

#endif
