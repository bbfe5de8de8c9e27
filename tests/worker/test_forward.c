/* Tests of the forward pass on the CPU backend against llama.cpp's and
 * transformers' goldens (../shared/models), and of the engine's own
 * invariants: batching, paged KV sharing with copy-on-write and the stage
 * split give the same logits as the plain path. */
#include "../test.h"
#include "common/kvblocks.h"
#include "common/model.h"
#include "common/status.h"
#include "kernels/backend.h"
#include "worker/forward.h"
#include "worker/stage.h"

#include <cjson/cJSON.h>

/* ---- Fixture: a model on the CPU backend, one stage, a block pool ---- */

struct fx {
    backend *b;
    model_file *m;
    stage *s;
    kvblocks *kb;
    int32_t n_vocab;
};

/* LLM_TEST_DEVICE=cuda:N runs the whole suite on that GPU instead of the
 * CPU (then a missing GPU is a failure, not a skip). */
static void fx_backend(backend **b) {
    char err[512];
    const char *dev = getenv("LLM_TEST_DEVICE");
    if (dev && strncmp(dev, "cuda:", 5) == 0) {
        if (backend_cuda_init(b, atoi(dev + 5), err, sizeof err) != 0) TEST_FAIL("LLM_TEST_DEVICE=%s: %s", dev, err);
    } else if (backend_cpu_init(b, 2, err, sizeof err) != 0) {
        TEST_FAIL("backend_cpu_init: %s", err);
    }
}

static void fx_open(struct fx *f, const char *file, const struct stage_config *cfg_in) {
    char err[512];
    memset(f, 0, sizeof *f);
    const char *path = test_model_path(file);
    fx_backend(&f->b);
    if (model_file_open(&f->m, path, err, sizeof err) != 0) TEST_FAIL("model_file_open: %s", err);
    struct stage_config cfg;
    if (cfg_in) {
        cfg = *cfg_in;
    } else {
        stage_config_default(&cfg);
        cfg.kv_type = DTYPE_F32; /* exact comparisons, on a GPU too */
    }
    if (stage_init(&f->s, f->m, f->b, &cfg, err, sizeof err) != 0) TEST_FAIL("stage_init: %s", err);
    const struct stage_config *c = stage_config_get(f->s);
    if (kvblocks_init(&f->kb, c->n_blocks, c->block_size, err, sizeof err) != 0)
        TEST_FAIL("kvblocks_init: %s", err);
    f->n_vocab = model_file_hparams(f->m)->n_vocab;
}

static void fx_close(struct fx *f) {
    if (f->kb) ASSERT_EQ(kvblocks_n_blocks(f->kb), kvblocks_n_free(f->kb));
    kvblocks_free(f->kb);
    stage_free(f->s);
    model_file_close(f->m);
    backend_free(f->b);
    memset(f, 0, sizeof *f);
}

/* Runs ids[0..n) as the next chunk of the sequence of table t, alone in a
 * step.  logits: rows per mode (NULL to skip). */
static void fx_run(struct fx *f, struct kvblocks_table *t, const int32_t *ids, int32_t n,
                   enum forward_logits mode, float *logits) {
    struct kvblocks_copy cp;
    int32_t n_cp = 0, pos0 = t->n_tokens;
    ASSERT_OK(kvblocks_reserve(f->kb, t, n, &cp, &n_cp));
    struct forward_seq q = {ids, n, pos0, t->ids, t->n_ids, mode};
    struct forward_batch bt = {&q, 1, &cp, n_cp, NULL, 0};
    struct forward_out o = {logits, 0, NULL, NULL};
    char err[512];
    int rc = forward_step(f->s, &bt, &o, err, sizeof err);
    if (rc != 0) TEST_FAIL("forward_step: %s", err);
}

/* ids[0..n) as a new sequence's first chunk, its blocks freed after. */
static void fx_run_alone(struct fx *f, const int32_t *ids, int32_t n, enum forward_logits mode, float *logits) {
    struct kvblocks_table t;
    kvblocks_table_init(&t);
    fx_run(f, &t, ids, n, mode, logits);
    kvblocks_table_free(f->kb, &t);
}

static int32_t argmax(const float *x, int32_t n) {
    int32_t best = 0;
    for (int32_t i = 1; i < n; i++)
        if (x[i] > x[best]) best = i;
    return best;
}

static double max_abs_diff(const float *a, const float *b, size_t n) {
    double m = 0;
    for (size_t i = 0; i < n; i++) {
        double d = fabs((double)a[i] - b[i]);
        if (d > m || d != d) m = d != d ? INFINITY : d;
    }
    return m;
}

/* ---- Goldens ---- */

static cJSON *load_json(const char *file) {
    const char *path = test_model_path(file);
    char *buf = test_read_file(path, NULL);
    if (!buf) TEST_FAIL("cannot read %s", path);
    cJSON *j = cJSON_Parse(buf);
    free(buf);
    if (!j) TEST_FAIL("%s: not JSON", path);
    return j;
}

static int32_t json_ids(const cJSON *arr, int32_t *out, int32_t max) {
    int32_t n = 0;
    const cJSON *e;
    cJSON_ArrayForEach(e, arr) {
        if (n < max) out[n] = (int32_t)e->valuedouble;
        n++;
    }
    return n;
}

static const cJSON *golden_prompts(const cJSON *root, const char *model) {
    const cJSON *m = cJSON_GetObjectItem(cJSON_GetObjectItem(root, "models"), model);
    if (!m) TEST_FAIL("golden has no model %s", model);
    return cJSON_GetObjectItem(m, "prompts");
}

/* ---- stories260K against llama.cpp ---- */

TEST(forward_stories_f32_greedy_matches_golden) {
    cJSON *root = load_json("stories260K-golden.json");
    struct fx f;
    fx_open(&f, "stories260K-f32.gguf", NULL);
    const cJSON *p;
    cJSON_ArrayForEach(p, golden_prompts(root, "stories260K-f32.gguf")) {
        int32_t prompt[64], gold[128];
        int32_t np = json_ids(cJSON_GetObjectItem(p, "prompt_ids"), prompt, 64);
        int32_t ng = json_ids(cJSON_GetObjectItem(p, "generated_ids"), gold, 128);
        const cJSON *top5 = cJSON_GetObjectItem(p, "top5_logits");
        float *logits = malloc(sizeof(float) * f.n_vocab);
        struct kvblocks_table t;
        kvblocks_table_init(&t);
        fx_run(&f, &t, prompt, np, FORWARD_LOGITS_LAST, logits);
        double worst = 0;
        for (int32_t k = 0; k < ng; k++) {
            const cJSON *row = cJSON_GetArrayItem(top5, k), *e;
            cJSON_ArrayForEach(e, row) {
                int32_t id = (int32_t)cJSON_GetArrayItem(e, 0)->valuedouble;
                double d = fabs(logits[id] - cJSON_GetArrayItem(e, 1)->valuedouble);
                if (d > worst) worst = d;
            }
            int32_t id = argmax(logits, f.n_vocab);
            if (id != gold[k]) TEST_FAIL("prompt %d ids, token %d: expected %d, got %d", np, k, gold[k], id);
            fx_run(&f, &t, &id, 1, FORWARD_LOGITS_LAST, logits);
        }
        printf("  %d tokens equal; golden top-5 logits within %.2g\n", ng, worst);
        ASSERT_TRUE(worst < 1e-4);
        kvblocks_table_free(f.kb, &t);
        free(logits);
    }
    fx_close(&f);
    cJSON_Delete(root);
}

/* Teacher forcing on prompt + golden ids: at every generated position the
 * golden token's logit is within tol of the highest logit, and the golden
 * top-5 logits are matched within tol. */
static void check_teacher_forced(const char *file, const char *golden_model, double tol) {
    cJSON *root = load_json("stories260K-golden.json");
    struct fx f;
    fx_open(&f, file, NULL);
    const cJSON *p;
    double worst_gap = 0, worst_top = 0;
    cJSON_ArrayForEach(p, golden_prompts(root, golden_model)) {
        int32_t ids[256];
        int32_t np = json_ids(cJSON_GetObjectItem(p, "prompt_ids"), ids, 64);
        int32_t ng = json_ids(cJSON_GetObjectItem(p, "generated_ids"), ids + np, 128);
        const cJSON *top5 = cJSON_GetObjectItem(p, "top5_logits");
        int32_t n = np + ng;
        float *logits = malloc(sizeof(float) * f.n_vocab * (size_t)n);
        struct kvblocks_table t;
        kvblocks_table_init(&t);
        fx_run(&f, &t, ids, n, FORWARD_LOGITS_ALL, logits);
        for (int32_t k = 0; k < ng; k++) {
            const float *row = logits + (size_t)(np - 1 + k) * f.n_vocab;
            double gap = row[argmax(row, f.n_vocab)] - row[ids[np + k]];
            if (gap > worst_gap) worst_gap = gap;
            if (gap > tol) TEST_FAIL("%s: generated token %d (id %d) is %.4f below the top logit", file, k, ids[np + k], gap);
            const cJSON *g = cJSON_GetArrayItem(top5, k), *e;
            cJSON_ArrayForEach(e, g) {
                int32_t id = (int32_t)cJSON_GetArrayItem(e, 0)->valuedouble;
                double d = fabs(row[id] - cJSON_GetArrayItem(e, 1)->valuedouble);
                if (d > worst_top) worst_top = d;
                if (d > tol) TEST_FAIL("%s: position %d: logit of %d is %.6f, golden %.6f", file, k, id, row[id], cJSON_GetArrayItem(e, 1)->valuedouble);
            }
        }
        kvblocks_table_free(f.kb, &t);
        free(logits);
    }
    printf("  %s vs %s goldens: golden token at most %.4f below the top; top-5 logits within %.4f (tolerance %g)\n",
           file, golden_model, worst_gap, worst_top, tol);
    fx_close(&f);
    cJSON_Delete(root);
}

/* pycode's target in Q4_K_M (real weights, K-quants), teacher-forced on
 * llama.cpp's greedy ids: the prompt as one chunk, then the 64 generated
 * ids in chunks (n_chunks of chunk ids each, the last cut at 64), and the
 * top-1 at each generated position compared with the next golden id.  On
 * the CPU the engine agreed on 98-99% of them (the rest are near-ties
 * under other activation rounding, ../shared/models/README.md); a GPU must
 * agree as often. */
static void pycode_teacher_forced(int32_t kv_type, const int32_t *chunks, int n_chunks, const char *what) {
    cJSON *root = load_json("pycode/golden-target-q4_k_m.json");
    struct fx f;
    struct stage_config cfg;
    stage_config_default(&cfg);
    cfg.kv_type = kv_type;
    fx_open(&f, "pycode/pycode-target-q4_k_m.gguf", &cfg);
    int32_t agree = 0, total = 0;
    const cJSON *p;
    cJSON_ArrayForEach(p, root) {
        int32_t ids[160];
        int32_t np = json_ids(cJSON_GetObjectItem(p, "prompt_ids"), ids, 64);
        int32_t ng = json_ids(cJSON_GetObjectItem(p, "greedy_ids"), ids + np, 96);
        ASSERT_EQ(48, np);
        ASSERT_EQ(64, ng);
        float *logits = malloc(sizeof(float) * f.n_vocab * 64);
        struct kvblocks_table t;
        kvblocks_table_init(&t);
        fx_run(&f, &t, ids, np, FORWARD_LOGITS_LAST, logits);
        if (argmax(logits, f.n_vocab) == ids[np]) agree++;
        total++;
        int32_t at = np;
        for (int c = 0; c < n_chunks && at < np + ng; c++) {
            int32_t n = chunks[c] < np + ng - at ? chunks[c] : np + ng - at;
            fx_run(&f, &t, ids + at, n, FORWARD_LOGITS_ALL, logits);
            for (int32_t k = 0; k < n && at + k + 1 < np + ng; k++) {
                agree += argmax(logits + (size_t)k * f.n_vocab, f.n_vocab) == ids[at + k + 1];
                total++;
            }
            at += n;
        }
        kvblocks_table_free(f.kb, &t);
        free(logits);
    }
    printf("  pycode Q4_K_M teacher-forced, %s: top-1 equals llama.cpp's next greedy id at %d of %d positions "
           "(%.1f%%)\n", what, agree, total, 100.0 * agree / total);
    ASSERT_TRUE(agree * 100 >= total * 98);
    fx_close(&f);
    cJSON_Delete(root);
}

/* Chunks of 16, 24 and 24: the decode-batch matmul kernels, not only
 * prefill's; an F32 cache. */
TEST(forward_pycode_q4_k_m_teacher_forced) {
    static const int32_t chunks[] = {16, 24, 24};
    pycode_teacher_forced(DTYPE_F32, chunks, 3, "F32 KV, chunks of 16-24");
}

/* One id a step over the 8-bit cache: decode rows of 2 query heads a KV
 * head (on a GPU, attention_gqa.cu over the Q8_0 cache). */
TEST(forward_pycode_q4_k_m_q8_kv_decode) {
    int32_t ones[64];
    for (int i = 0; i < 64; i++) ones[i] = 1;
    pycode_teacher_forced(DTYPE_Q8_0, ones, 64, "Q8_0 KV, one id a step");
}

/* The golden of the file itself when the golden set has one, else the F32
 * golden with the fallback tolerance (the public set has goldens for f32
 * and q8_0 only).  F16 weights stay within 0.01 of the F32 goldens; Q4_0
 * weights move this 64-wide model's logits by up to about 1.8 (measured:
 * golden token at most 1.76 below the top, top-5 logits within 1.54). */
static void check_quant(const char *file, double tol, double fallback_tol) {
    cJSON *root = load_json("stories260K-golden.json");
    int own = cJSON_GetObjectItem(cJSON_GetObjectItem(root, "models"), file) != NULL;
    cJSON_Delete(root);
    if (own) check_teacher_forced(file, file, tol);
    else check_teacher_forced(file, "stories260K-f32.gguf", fallback_tol);
}

TEST(forward_stories_f16_teacher_forced) { check_quant("stories260K-f16.gguf", 0.01, 0.01); }
TEST(forward_stories_q8_0_teacher_forced) { check_quant("stories260K-q8_0.gguf", 0.3, 0.3); }
TEST(forward_stories_q4_0_teacher_forced) { check_quant("stories260K-q4_0.gguf", 0.3, 2.5); }

/* ---- tiny-llama-hf against transformers ---- */

TEST(forward_tiny_llama_hf_matches_reference) {
    cJSON *root = load_json("tiny-llama-hf/reference.json");
    const cJSON *g = cJSON_GetArrayItem(cJSON_GetObjectItem(root, "generation"), 0);
    struct fx f;
    fx_open(&f, "tiny-llama-hf", NULL);
    int32_t ids[128], greedy[64];
    int32_t np = json_ids(cJSON_GetObjectItem(g, "prompt_ids"), ids, 64);
    int32_t ng = json_ids(cJSON_GetObjectItem(g, "greedy_ids"), greedy, 64);
    float *logits = malloc(sizeof(float) * f.n_vocab * (size_t)(np + ng));
    struct kvblocks_table t;
    kvblocks_table_init(&t);
    /* Every prompt position in one prefill. */
    fx_run(&f, &t, ids, np, FORWARD_LOGITS_ALL, logits);
    /* A GPU's matmuls round activations to F16 on the tensor cores: measured
     * 1.2e-3 on an H100 against 7e-6 for the float32 CPU path, and more
     * between its one-row and many-row kernels. */
    const int gpu = getenv("LLM_TEST_DEVICE") != NULL;
    const double tol = gpu ? 5e-3 : 1e-3, margin = gpu ? 5e-2 : 1e-3;
    double worst = 0;
    const cJSON *top = cJSON_GetObjectItem(g, "top5_per_prompt_position");
    for (int32_t k = 0; k < np; k++) {
        const cJSON *e;
        cJSON_ArrayForEach(e, cJSON_GetArrayItem(top, k)) {
            int32_t id = (int32_t)cJSON_GetArrayItem(e, 0)->valuedouble;
            double ref = cJSON_GetArrayItem(e, 1)->valuedouble;
            double d = fabs(logits[(size_t)k * f.n_vocab + id] - ref);
            if (d > worst) worst = d;
            if (d > tol) TEST_FAIL("prompt position %d: logit of %d is %.6f, reference %.6f", k, id, logits[(size_t)k * f.n_vocab + id], ref);
        }
    }
    /* Greedy decode, one token at a time. */
    float *row = logits + (size_t)(np - 1) * f.n_vocab;
    for (int32_t k = 0; k < ng; k++) {
        int32_t id = argmax(row, f.n_vocab);
        if (id != greedy[k]) TEST_FAIL("greedy token %d: expected %d, got %d", k, greedy[k], id);
        ids[np + k] = id;
        row = logits + (size_t)(np + k) * f.n_vocab;
        fx_run(&f, &t, &id, 1, FORWARD_LOGITS_LAST, row);
    }
    /* The same sequence in one teacher-forced prefill gives the same logits
     * as the step-by-step decode. */
    float *tf = malloc(sizeof(float) * f.n_vocab * (size_t)(np + ng));
    struct kvblocks_table t2;
    kvblocks_table_init(&t2);
    fx_run(&f, &t2, ids, np + ng, FORWARD_LOGITS_ALL, tf);
    double d_tf = max_abs_diff(logits + (size_t)(np - 1) * f.n_vocab, tf + (size_t)(np - 1) * f.n_vocab,
                               (size_t)(ng + 1) * f.n_vocab);
    /* top5_along_greedy holds [id, logit] pairs for every position of the
     * prompt followed by the greedy tokens. */
    const cJSON *along = cJSON_GetObjectItem(g, "top5_along_greedy");
    int32_t n_along = cJSON_GetArraySize(along), checked = 0;
    double worst_along = 0;
    for (int32_t k = 0; k < n_along && k < np + ng; k++) {
        const cJSON *e;
        cJSON_ArrayForEach(e, cJSON_GetArrayItem(along, k)) {
            int32_t id = (int32_t)cJSON_GetArrayItem(e, 0)->valuedouble;
            double ref = cJSON_GetArrayItem(e, 1)->valuedouble;
            ASSERT_TRUE(id >= 0 && id < f.n_vocab);
            double d = fabs(tf[(size_t)k * f.n_vocab + id] - ref);
            if (d > worst_along) worst_along = d;
            if (d > tol + margin)
                TEST_FAIL("along greedy %d: logit of %d is %.6f, reference %.6f", k, id, tf[(size_t)k * f.n_vocab + id], ref);
            checked++;
        }
    }
    printf("  prompt logits within %.2g of transformers; %d greedy ids equal; decode vs prefill %.2g; %d logits along greedy within %.2g\n",
           worst, ng, d_tf, checked, worst_along);
    ASSERT_TRUE(d_tf < (gpu ? 5e-2 : 1e-4));
    kvblocks_table_free(f.kb, &t);
    kvblocks_table_free(f.kb, &t2);
    free(tf);
    free(logits);
    fx_close(&f);
    cJSON_Delete(root);
}

/* ---- Engine invariants ---- */

static void make_ids(int32_t *ids, int32_t n, uint32_t seed, int32_t n_vocab) {
    for (int32_t i = 0; i < n; i++) {
        seed = seed * 1664525u + 1013904223u;
        ids[i] = i == 0 ? 1 : 3 + (int32_t)((seed >> 8) % (uint32_t)(n_vocab - 3));
    }
}

/* Three sequences, each run alone in one prefill, then together in steps
 * that mix prefill chunks and decode tokens at different positions. */
TEST(forward_batch_equals_single) {
    enum { N_SEQ = 3, LEN = 40 };
    struct fx f;
    fx_open(&f, "stories260K-f32.gguf", NULL);
    int32_t ids[N_SEQ][LEN];
    float *alone[N_SEQ], *batched[N_SEQ];
    for (int s = 0; s < N_SEQ; s++) {
        make_ids(ids[s], LEN, 77u + (uint32_t)s, f.n_vocab);
        alone[s] = malloc(sizeof(float) * f.n_vocab * LEN);
        batched[s] = calloc((size_t)f.n_vocab * LEN, sizeof(float));
        struct kvblocks_table t;
        kvblocks_table_init(&t);
        fx_run(&f, &t, ids[s], LEN, FORWARD_LOGITS_ALL, alone[s]);
        kvblocks_table_free(f.kb, &t);
    }
    /* Chunk schedule: seq s starts at step s and takes chunk sizes that
     * vary (1 = a decode token). */
    static const int32_t chunks[] = {5, 1, 7, 1, 1, 13, 2, 1, 9, 1, 1, 3, 17, 1};
    struct kvblocks_table t[N_SEQ];
    int32_t done[N_SEQ] = {0}, next_chunk[N_SEQ] = {0};
    for (int s = 0; s < N_SEQ; s++) kvblocks_table_init(&t[s]);
    float *out = malloc(sizeof(float) * f.n_vocab * LEN * N_SEQ);
    for (int step = 0; step < 64; step++) {
        struct forward_seq q[N_SEQ];
        int32_t who[N_SEQ], n = 0;
        for (int s = 0; s < N_SEQ; s++) {
            if (step < s || done[s] == LEN) continue;
            int32_t c = chunks[(next_chunk[s]++ + s) % (int32_t)(sizeof chunks / sizeof chunks[0])];
            if (c > LEN - done[s]) c = LEN - done[s];
            ASSERT_OK(kvblocks_reserve(f.kb, &t[s], c, NULL, NULL));
            q[n] = (struct forward_seq){ids[s] + done[s], c, done[s], t[s].ids, t[s].n_ids, FORWARD_LOGITS_ALL};
            who[n++] = s;
        }
        if (n == 0) break;
        struct forward_batch bt = {q, n, NULL, 0, NULL, 0};
        struct forward_out o = {out, 0, NULL, NULL};
        char err[512];
        if (forward_step(f.s, &bt, &o, err, sizeof err) != 0) TEST_FAIL("forward_step: %s", err);
        int32_t row = 0;
        for (int32_t i = 0; i < n; i++) {
            int s = who[i];
            memcpy(batched[s] + (size_t)done[s] * f.n_vocab, out + (size_t)row * f.n_vocab,
                   sizeof(float) * f.n_vocab * q[i].n_tokens);
            row += q[i].n_tokens;
            done[s] += q[i].n_tokens;
        }
        ASSERT_EQ(row, o.n_logits);
    }
    double worst = 0;
    for (int s = 0; s < N_SEQ; s++) {
        ASSERT_EQ((int32_t)LEN, done[s]);
        double d = max_abs_diff(alone[s], batched[s], (size_t)f.n_vocab * LEN);
        if (d > worst) worst = d;
        kvblocks_table_free(f.kb, &t[s]);
        free(alone[s]);
        free(batched[s]);
    }
    printf("  batched vs alone: max abs diff %.3g\n", worst);
    ASSERT_TRUE(worst < 1e-4);
    free(out);
    fx_close(&f);
}

/* A parent sequence and a child forked from its prefix (mid-block), both
 * continuing with different tokens in one step: the child's first write
 * copies the shared block, and the logits equal those of unshared runs. */
TEST(forward_shared_prefix_copy_on_write) {
    enum { PREFIX = 20, FORK_AT = 18, MORE = 6 };
    struct fx f;
    fx_open(&f, "stories260K-f32.gguf", NULL);
    int32_t par[PREFIX + MORE], chi[FORK_AT + MORE];
    make_ids(par, PREFIX + MORE, 5, f.n_vocab);
    memcpy(chi, par, sizeof(int32_t) * FORK_AT);
    make_ids(chi + FORK_AT, MORE, 99, f.n_vocab);
    chi[FORK_AT] = 7; /* not 1: a different token from the parent's */
    size_t V = (size_t)f.n_vocab;
    float *ref_p = malloc(sizeof(float) * V * (PREFIX + MORE));
    float *ref_c = malloc(sizeof(float) * V * (FORK_AT + MORE));
    struct kvblocks_table t;
    kvblocks_table_init(&t);
    fx_run(&f, &t, par, PREFIX + MORE, FORWARD_LOGITS_ALL, ref_p);
    kvblocks_table_free(f.kb, &t);
    fx_run(&f, &t, chi, FORK_AT + MORE, FORWARD_LOGITS_ALL, ref_c);
    kvblocks_table_free(f.kb, &t);

    struct kvblocks_table tp, tc;
    kvblocks_table_init(&tp);
    kvblocks_table_init(&tc);
    float *lp = malloc(sizeof(float) * V * PREFIX);
    fx_run(&f, &tp, par, PREFIX, FORWARD_LOGITS_ALL, lp);
    int32_t used_before = kvblocks_n_used(f.kb);
    ASSERT_OK(kvblocks_fork(f.kb, &tc, &tp, FORK_AT));
    ASSERT_EQ(used_before, kvblocks_n_used(f.kb));
    ASSERT_EQ(2, kvblocks_refcount(f.kb, tp.ids[1]));
    /* One step: the child's tokens 18.. and the parent's tokens 20.. */
    struct kvblocks_copy cps[2];
    int32_t n_cp = 0, k;
    ASSERT_OK(kvblocks_reserve(f.kb, &tc, MORE, &cps[n_cp], &k));
    ASSERT_EQ(1, k);
    n_cp += k;
    ASSERT_OK(kvblocks_reserve(f.kb, &tp, MORE, &cps[n_cp], &k));
    ASSERT_EQ(0, k); /* the parent owns its block alone after the child's copy */
    n_cp += k;
    struct forward_seq q[2] = {
        {chi + FORK_AT, MORE, FORK_AT, tc.ids, tc.n_ids, FORWARD_LOGITS_ALL},
        {par + PREFIX, MORE, PREFIX, tp.ids, tp.n_ids, FORWARD_LOGITS_ALL},
    };
    struct forward_batch bt = {q, 2, cps, n_cp, NULL, 0};
    float *out = malloc(sizeof(float) * V * 2 * MORE);
    struct forward_out o = {out, 0, NULL, NULL};
    char err[512];
    if (forward_step(f.s, &bt, &o, err, sizeof err) != 0) TEST_FAIL("forward_step: %s", err);
    double d_prefix = max_abs_diff(ref_p, lp, V * PREFIX);
    double d_child = max_abs_diff(ref_c + V * FORK_AT, out, V * MORE);
    double d_parent = max_abs_diff(ref_p + V * PREFIX, out + V * MORE, V * MORE);
    printf("  shared prefix: parent prefix %.3g, child %.3g, parent %.3g\n", d_prefix, d_child, d_parent);
    ASSERT_TRUE(d_prefix < 1e-4);
    ASSERT_TRUE(d_child < 1e-4);
    ASSERT_TRUE(d_parent < 1e-4);
    kvblocks_table_free(f.kb, &tc);
    kvblocks_table_free(f.kb, &tp);
    free(out);
    free(lp);
    free(ref_p);
    free(ref_c);
    fx_close(&f); /* asserts every block is back */
}

/* Layers [0, k) and [k, n) as two stages chained through hidden states
 * (host copies and backend pointers) give the logits of one stage, with
 * the later stage's steps begun before their input (forward_begin) or
 * not, and after a begun step given up (forward_cancel). */
TEST(forward_two_stages_equal_one) {
    enum { LEN = 23 };
    struct fx f;
    fx_open(&f, "stories260K-f32.gguf", NULL);
    int32_t n_layers = model_file_hparams(f.m)->n_layers, dim = model_file_hparams(f.m)->dim;
    size_t V = (size_t)f.n_vocab;
    int32_t ids[LEN];
    make_ids(ids, LEN, 3, f.n_vocab);
    float *ref = malloc(sizeof(float) * V * LEN), *got = malloc(sizeof(float) * V * LEN);
    struct kvblocks_table t;
    kvblocks_table_init(&t);
    /* The reference takes the same chunks as the split run below (a GPU may
     * pick other matmul kernels for 1 row than for 15, rounding differently). */
    for (int32_t done = 0; done < LEN; done += done == 0 ? 15 : 1)
        fx_run(&f, &t, ids + done, done == 0 ? 15 : 1, FORWARD_LOGITS_ALL, ref + (size_t)done * V);
    kvblocks_table_free(f.kb, &t);

    char err[512];
    for (int32_t k = 1; k < n_layers; k += n_layers - 2) {
        struct stage_config ca, cb;
        stage_config_default(&ca);
        stage_config_default(&cb);
        ca.layer_last = k;
        cb.layer_first = k;
        ca.kv_type = cb.kv_type = DTYPE_F32; /* as the reference's (a GPU's default is F16) */
        stage *sa = NULL, *sb = NULL;
        if (stage_init(&sa, f.m, f.b, &ca, err, sizeof err) != 0) TEST_FAIL("stage a: %s", err);
        if (stage_init(&sb, f.m, f.b, &cb, err, sizeof err) != 0) TEST_FAIL("stage b: %s", err);
        ASSERT_TRUE(stage_is_first(sa) && !stage_is_last(sa));
        ASSERT_TRUE(!stage_is_first(sb) && stage_is_last(sb));
        float *hidden = malloc(sizeof(float) * (size_t)dim * LEN);
        /* Prefill 15 tokens through host memory, then decode the rest one at
         * a time handing over the backend pointer, or writing into the next
         * stage's input buffer. */
        int32_t done = 0;
        kvblocks_table_init(&t);
        while (done < LEN) {
            int32_t n = done == 0 ? 15 : 1;
            ASSERT_OK(kvblocks_reserve(f.kb, &t, n, NULL, NULL));
            struct forward_seq q = {ids + done, n, done, t.ids, t.n_ids, FORWARD_LOGITS_ALL};
            struct forward_batch ba = {&q, 1, NULL, 0, NULL, 0};
            struct forward_out oa = {NULL, 0, done == 0 ? hidden : NULL, NULL};
            if (forward_step(sa, &ba, &oa, err, sizeof err) != 0) TEST_FAIL("stage a: %s", err);
            ASSERT_EQ(0, oa.n_logits);
            struct forward_batch bb = {&q, 1, NULL, 0, done == 0 ? hidden : forward_hidden(sa), done != 0};
            struct forward_out ob = {got + (size_t)done * V, 0, NULL, NULL};
            if (done > 0 && done % 3 == 0) {
                /* As a worker does: the part before the input first. */
                struct forward_batch early = {&q, 1, NULL, 0, NULL, 0};
                if (forward_begin(sb, &early, &ob, err, sizeof err) != 0) TEST_FAIL("stage b, begin: %s", err);
            } else if (done > 0 && done % 3 == 1) {
                /* A step begun and given up (its input never came) leaves
                 * nothing that the next step uses: this one's layout is
                 * for position 0. */
                struct forward_seq wrong = {ids, 1, 0, t.ids, t.n_ids, FORWARD_LOGITS_ALL};
                struct forward_batch wb = {&wrong, 1, NULL, 0, NULL, 0};
                if (forward_begin(sb, &wb, &ob, err, sizeof err) != 0) TEST_FAIL("stage b, begin: %s", err);
                forward_cancel(sb);
            }
            if (done > 0 && done % 2 == 0) {
                /* As a transport would: rows written straight into b's input buffer. */
                ASSERT_OK(backend_copy(f.b, forward_input_buffer(sb), forward_hidden(sa), sizeof(float) * (size_t)dim * n));
                bb.hidden_in = forward_input_buffer(sb);
            }
            if (forward_step(sb, &bb, &ob, err, sizeof err) != 0) TEST_FAIL("stage b: %s", err);
            ASSERT_EQ(n, ob.n_logits);
            done += n;
        }
        double d = max_abs_diff(ref, got, V * LEN);
        printf("  split at layer %d: max abs diff %.3g\n", k, d);
        ASSERT_TRUE(d < 1e-5);
        /* A later stage without hidden states is refused. */
        struct forward_seq q = {ids, 1, 0, t.ids, t.n_ids, FORWARD_LOGITS_LAST};
        struct forward_batch bb = {&q, 1, NULL, 0, NULL, 0};
        struct forward_out ob = {got, 0, NULL, NULL};
        ASSERT_EQ((int)STATUS_BAD_INPUT, forward_step(sb, &bb, &ob, err, sizeof err));
        kvblocks_table_free(f.kb, &t);
        free(hidden);
        stage_free(sa);
        stage_free(sb);
    }
    free(ref);
    free(got);
    fx_close(&f);
}

/* K-quant and Q8_0 versions of synth256 against its F32 file: relative
 * error ||a - b|| / ||a|| of the logits of a 48-token prefill.  Measured:
 * 0.020, 0.060, 0.102, 0.208.  The weights themselves carry relative errors
 * of 0.0054 (Q8_0), 0.018 (Q6_K), 0.036 (Q5_K), 0.072 (Q4_K); with 16
 * matrices of random weights each adding its own error the logits see
 * about sqrt(16) = 4 times that, which is what the measurements show.  The
 * bounds leave 30% headroom. */
TEST(forward_synth256_quants_close_to_f32) {
    enum { LEN = 48 };
    static const struct { const char *file; double bound; } files[] = {
        {"synth256-q8_0.gguf", 0.027},
        {"synth256-q6_k.gguf", 0.08},
        {"synth256-q5_k_m.gguf", 0.135},
        {"synth256-q4_k_m.gguf", 0.27},
    };
    struct fx f;
    fx_open(&f, "synth256-f32.gguf", NULL);
    size_t V = (size_t)f.n_vocab;
    int32_t ids[LEN];
    make_ids(ids, LEN, 11, f.n_vocab);
    float *ref = malloc(sizeof(float) * V * LEN), *got = malloc(sizeof(float) * V * LEN);
    double rels[sizeof files / sizeof files[0]];
    struct kvblocks_table t;
    kvblocks_table_init(&t);
    fx_run(&f, &t, ids, LEN, FORWARD_LOGITS_ALL, ref);
    kvblocks_table_free(f.kb, &t);
    fx_close(&f);
    for (size_t i = 0; i < sizeof files / sizeof files[0]; i++) {
        fx_open(&f, files[i].file, NULL);
        kvblocks_table_init(&t);
        fx_run(&f, &t, ids, LEN, FORWARD_LOGITS_ALL, got);
        kvblocks_table_free(f.kb, &t);
        fx_close(&f);
        double num = 0, den = 0;
        for (size_t j = 0; j < V * LEN; j++) {
            num += ((double)got[j] - ref[j]) * ((double)got[j] - ref[j]);
            den += (double)ref[j] * ref[j];
        }
        double rel = sqrt(num / den);
        printf("  %s: relative error %.4f (bound %.2f)\n", files[i].file, rel, files[i].bound);
        rels[i] = rel;
    }
    for (size_t i = 0; i < sizeof files / sizeof files[0]; i++) ASSERT_TRUE(rels[i] < files[i].bound);
    free(ref);
    free(got);
}

/* An F16 KV cache changes the logits only by the rounding of K and V. */
TEST(forward_f16_kv_cache_close_to_f32) {
    enum { LEN = 30 };
    struct stage_config c;
    stage_config_default(&c);
    c.kv_type = DTYPE_F32;
    struct fx f;
    fx_open(&f, "stories260K-f32.gguf", &c);
    c.kv_type = DTYPE_F16;
    size_t V = (size_t)f.n_vocab;
    int32_t ids[LEN];
    make_ids(ids, LEN, 21, f.n_vocab);
    float *ref = malloc(sizeof(float) * V * LEN), *got = malloc(sizeof(float) * V * LEN);
    fx_run_alone(&f, ids, LEN, FORWARD_LOGITS_ALL, ref);
    fx_close(&f);
    fx_open(&f, "stories260K-f32.gguf", &c);
    ASSERT_EQ((int)DTYPE_F16, (int)kvcache_type(stage_kvcache(f.s)));
    fx_run_alone(&f, ids, LEN, FORWARD_LOGITS_ALL, got);
    double d = max_abs_diff(ref, got, V * LEN);
    printf("  F16 KV vs F32 KV: max abs diff %.3g\n", d);
    ASSERT_TRUE(d > 0 && d < 0.05);
    free(ref);
    free(got);
    fx_close(&f);
}

/* stage_config.weight_type: the F32 model's matrices converted to Q8_0 as
 * they load move its logits about as far as the Q8_0 file llama.cpp made
 * from the same weights does (the 172-column ffn_down, which Q8_0's blocks
 * of 32 do not divide, stays F32), in under half the bytes; with Q4_K,
 * whose blocks of 256 divide none of this 64-wide model's matrices, every
 * one stays as stored and the logits are the F32 model's. */
TEST(forward_weights_converted_at_load) {
    enum { LEN = 24 };
    struct stage_config c;
    stage_config_default(&c);
    c.kv_type = DTYPE_F32;
    struct fx f;
    int32_t ids[LEN];
    size_t bytes[4], V = 0;
    float *logits[4];
    static const char *const files[4] = {"stories260K-q8_0.gguf", "stories260K-f32.gguf", "stories260K-f32.gguf",
                                         "stories260K-f32.gguf"};
    static const int32_t types[4] = {-1, -1, DTYPE_Q8_0, DTYPE_Q4_K};
    for (int i = 0; i < 4; i++) {
        c.weight_type = types[i];
        fx_open(&f, files[i], &c);
        if (i == 0) {
            make_ids(ids, LEN, 5, f.n_vocab);
            V = (size_t)f.n_vocab * LEN;
        }
        bytes[i] = stage_weight_bytes(f.s);
        logits[i] = malloc(sizeof(float) * (size_t)f.n_vocab * LEN);
        fx_run_alone(&f, ids, LEN, FORWARD_LOGITS_ALL, logits[i]);
        fx_close(&f);
    }
    const double d_file = max_abs_diff(logits[1], logits[0], V), d_q8 = max_abs_diff(logits[1], logits[2], V);
    const double d_k = max_abs_diff(logits[1], logits[3], V);
    printf("  F32 converted to Q8_0 at load: %zu weight bytes a token (the Q8_0 file %zu, F32 %zu), logits within "
           "%.3g of F32's (the Q8_0 file's %.3g); to Q4_K: %zu bytes, logits within %.3g of F32's\n",
           bytes[2], bytes[0], bytes[1], d_q8, d_file, bytes[3], d_k);
    ASSERT_TRUE(d_q8 > 0 && d_q8 <= 1.25 * d_file);
    ASSERT_TRUE(bytes[2] * 2 < bytes[1]);
    ASSERT_TRUE(bytes[3] == bytes[1] && d_k == 0);
    for (int i = 0; i < 4; i++) free(logits[i]);
}

/* Bad steps are refused with a message naming the sequence and the value,
 * before anything runs. */
TEST(forward_rejects_bad_input) {
    struct fx f;
    fx_open(&f, "stories260K-f32.gguf", NULL);
    const struct stage_config *c = stage_config_get(f.s);
    struct kvblocks_table t;
    kvblocks_table_init(&t);
    ASSERT_OK(kvblocks_reserve(f.kb, &t, 4, NULL, NULL));
    int32_t ids[4] = {1, 2, 3, 4};
    float *logits = malloc(sizeof(float) * (size_t)f.n_vocab * 4);
    struct forward_seq q[2] = {{ids, 4, 0, t.ids, t.n_ids, FORWARD_LOGITS_LAST},
                               {ids, 1, 0, t.ids, t.n_ids, FORWARD_LOGITS_LAST}};
    struct forward_batch bt = {q, 2, NULL, 0, NULL, 0};
    struct forward_out o = {logits, 0, NULL, NULL};
    char err[512];

    ids[2] = f.n_vocab;
    ASSERT_EQ((int)STATUS_BAD_INPUT, forward_step(f.s, &bt, &o, err, sizeof err));
    ASSERT_TRUE(strstr(err, "sequence 0") && strstr(err, "512"));
    ids[2] = -1;
    ASSERT_EQ((int)STATUS_BAD_INPUT, forward_step(f.s, &bt, &o, err, sizeof err));
    ids[2] = 3;

    q[1].pos0 = 4; /* past its one block of 16?  no: position 4 is covered */
    ASSERT_OK(forward_step(f.s, &bt, &o, err, sizeof err));
    ASSERT_EQ(2, o.n_logits);
    q[1].pos0 = c->block_size; /* not covered by one block */
    ASSERT_EQ((int)STATUS_BAD_INPUT, forward_step(f.s, &bt, &o, err, sizeof err));
    ASSERT_TRUE(strstr(err, "sequence 1") != NULL);
    q[1].pos0 = c->n_ctx_max;
    ASSERT_EQ((int)STATUS_BAD_INPUT, forward_step(f.s, &bt, &o, err, sizeof err));
    q[1].pos0 = 0;

    int32_t bad_table[1] = {c->n_blocks};
    q[1].block_table = bad_table;
    ASSERT_EQ((int)STATUS_BAD_INPUT, forward_step(f.s, &bt, &o, err, sizeof err));
    ASSERT_TRUE(strstr(err, "sequence 1") && strstr(err, "block"));
    q[1].block_table = t.ids;

    struct kvblocks_copy cp = {0, c->n_blocks + 3};
    bt.copies = &cp;
    bt.n_copies = 1;
    ASSERT_EQ((int)STATUS_BAD_INPUT, forward_step(f.s, &bt, &o, err, sizeof err));
    bt.n_copies = 0;

    q[1].n_tokens = c->n_tokens_max;
    ASSERT_EQ((int)STATUS_BAD_INPUT, forward_step(f.s, &bt, &o, err, sizeof err));
    q[1].n_tokens = 0;
    ASSERT_EQ((int)STATUS_BAD_INPUT, forward_step(f.s, &bt, &o, err, sizeof err));
    q[1].n_tokens = 1;
    bt.n_seqs = c->n_seqs_max + 1;
    ASSERT_EQ((int)STATUS_BAD_INPUT, forward_step(f.s, &bt, &o, err, sizeof err));
    bt.n_seqs = 2;
    ASSERT_OK(forward_step(f.s, &bt, &o, err, sizeof err));

    /* A bad stage configuration is refused too. */
    struct stage_config bad;
    stage_config_default(&bad);
    bad.layer_first = 3;
    bad.layer_last = 2;
    stage *s2 = NULL;
    ASSERT_EQ((int)STATUS_BAD_INPUT, stage_init(&s2, f.m, f.b, &bad, err, sizeof err));
    ASSERT_TRUE(s2 == NULL);
    kvblocks_table_free(f.kb, &t);
    free(logits);
    fx_close(&f);
}

/* ---- The GPU against the CPU ---- */

/* A scenario touching every path of a step: a 20-token prefill, a child
 * forked at 18, then one step with the child's 3 tokens (copy-on-write) and
 * the parent's decode token, then a step of both decoding.  Every row's
 * logits go to out in order; returns the rows written. */
static int32_t scenario_run(stage *s, kvblocks *kb, const int32_t *ids, float *out) {
    size_t V = (size_t)stage_hparams(s)->n_vocab;
    struct kvblocks_table tp, tc;
    kvblocks_table_init(&tp);
    kvblocks_table_init(&tc);
    struct kvblocks_copy cps[2];
    int32_t n_cp = 0, k, rows = 0;
    char err[512];
    ASSERT_OK(kvblocks_reserve(kb, &tp, 20, NULL, NULL));
    struct forward_seq q0 = {ids, 20, 0, tp.ids, tp.n_ids, FORWARD_LOGITS_ALL};
    struct forward_batch b0 = {&q0, 1, NULL, 0, NULL, 0};
    struct forward_out o = {out, 0, NULL, NULL};
    if (forward_step(s, &b0, &o, err, sizeof err) != 0) TEST_FAIL("step 0: %s", err);
    rows += o.n_logits;
    ASSERT_OK(kvblocks_fork(kb, &tc, &tp, 18));
    ASSERT_OK(kvblocks_reserve(kb, &tc, 3, &cps[n_cp], &k));
    n_cp += k;
    ASSERT_OK(kvblocks_reserve(kb, &tp, 1, &cps[n_cp], &k));
    n_cp += k;
    ASSERT_EQ(1, n_cp);
    struct forward_seq q1[2] = {{ids + 30, 3, 18, tc.ids, tc.n_ids, FORWARD_LOGITS_ALL},
                                {ids + 20, 1, 20, tp.ids, tp.n_ids, FORWARD_LOGITS_LAST}};
    struct forward_batch b1 = {q1, 2, cps, n_cp, NULL, 0};
    o.logits = out + rows * V;
    if (forward_step(s, &b1, &o, err, sizeof err) != 0) TEST_FAIL("step 1: %s", err);
    rows += o.n_logits;
    ASSERT_OK(kvblocks_reserve(kb, &tc, 1, NULL, NULL));
    ASSERT_OK(kvblocks_reserve(kb, &tp, 1, NULL, NULL));
    struct forward_seq q2[2] = {{ids + 33, 1, 21, tc.ids, tc.n_ids, FORWARD_LOGITS_LAST},
                                {ids + 21, 1, 21, tp.ids, tp.n_ids, FORWARD_LOGITS_LAST}};
    struct forward_batch b2 = {q2, 2, NULL, 0, NULL, 0};
    o.logits = out + rows * V;
    if (forward_step(s, &b2, &o, err, sizeof err) != 0) TEST_FAIL("step 2: %s", err);
    rows += o.n_logits;
    kvblocks_table_free(kb, &tc);
    kvblocks_table_free(kb, &tp);
    return rows;
}

/* The same scenario on the CUDA backend and on the CPU backend, for F32,
 * Q8_0, a K-quant mix and BF16 (F16 on the GPU) weights, with F32 and F16
 * KV caches.  Skips without a GPU.  The CPU backend rounds activations to
 * 8-bit blocks for quantized weights (as llama.cpp does) and the GPU does
 * not, so quantized models differ by that rounding: measured 0.226 on
 * logits up to 18.6 (1.2%) for stories260K Q8_0. */
TEST(forward_gpu_matches_cpu) {
    char err[512];
    backend *g = NULL;
    if (backend_cuda_init(&g, 0, err, sizeof err) != 0) TEST_SKIP("no GPU: %s", err);
    static const struct { const char *file; int kv_type; double bound; } cases[] = {
        {"stories260K-f32.gguf", DTYPE_F32, 1e-4}, {"stories260K-q8_0.gguf", DTYPE_F32, 0.03},
        {"synth256-q4_k_m.gguf", DTYPE_F32, 0.03}, {"tiny-llama-hf", DTYPE_F32, 1e-3},
        {"stories260K-f32.gguf", DTYPE_F16, 1e-2},
    };
    int ok[sizeof cases / sizeof cases[0]];
    for (size_t c = 0; c < sizeof cases / sizeof cases[0]; c++) {
        struct stage_config cfg;
        stage_config_default(&cfg);
        cfg.kv_type = cases[c].kv_type;
        struct fx f;
        fx_open(&f, cases[c].file, &cfg);
        size_t V = (size_t)f.n_vocab;
        int32_t ids[40];
        make_ids(ids, 40, 17, f.n_vocab);
        float *ref = malloc(sizeof(float) * V * 30), *got = malloc(sizeof(float) * V * 30);
        int32_t n_ref = scenario_run(f.s, f.kb, ids, ref);
        stage *sg = NULL;
        if (stage_init(&sg, f.m, g, &cfg, err, sizeof err) != 0) TEST_FAIL("stage on %s: %s", backend_name(g), err);
        int32_t n_got = scenario_run(sg, f.kb, ids, got);
        ASSERT_EQ(n_ref, n_got);
        double d = max_abs_diff(ref, got, V * (size_t)n_ref), m = 0;
        for (size_t i = 0; i < V * (size_t)n_ref; i++) m = fabs(ref[i]) > m ? fabs(ref[i]) : m;
        printf("  %s, KV %s: GPU vs CPU max abs diff %.3g (max |logit| %.3g, bound %.3g relative)\n",
               cases[c].file, dtype_name(cases[c].kv_type), d, m, cases[c].bound);
        ok[c] = d <= cases[c].bound * m;
        stage_free(sg);
        free(ref);
        free(got);
        fx_close(&f);
    }
    backend_free(g);
    for (size_t c = 0; c < sizeof cases / sizeof cases[0]; c++) ASSERT_TRUE(ok[c]);
}

/* ---- Decode steps replayed from graphs ---- */

/* A stage of file with an F16 cache, made with LLM_CUDA_GRAPHS=graphs
 * (n_logits_max 0: the stage's default). */
static void graph_fx_open(struct fx *f, const char *file, int graphs, int32_t n_seqs_max, int32_t n_ctx_max,
                          int32_t n_logits_max) {
    setenv("LLM_CUDA_GRAPHS", graphs ? "1" : "0", 1);
    struct stage_config cfg;
    stage_config_default(&cfg);
    cfg.n_seqs_max = n_seqs_max;
    cfg.n_ctx_max = n_ctx_max;
    cfg.n_logits_max = n_logits_max;
    cfg.kv_type = DTYPE_F16;
    fx_open(f, file, &cfg);
    unsetenv("LLM_CUDA_GRAPHS");
}

/* Decodes `steps` steps of n_seqs sequences (prompts of different lengths,
 * so each decodes at its own position; block ids descending with a stride
 * of 9, never in order) on a stage made with LLM_CUDA_GRAPHS=graphs, and
 * returns every decode step's logits in out.  Step 2 asks for no logits
 * (the graph without lm_head); a 100-token prefill of a sequence outside
 * the batch comes after step 3 (a prefill between replays, which may grow
 * the backend's scratch).  *recorded: graphs the stage recorded. */
#define GS_SEQS 21 /* sequences a scenario has: up to 20 in the batch, the last one outside */
static void graph_scenario(const char *file, int graphs, int32_t n_seqs, int32_t steps, float *out,
                           int32_t *recorded) {
    char err[512];
    struct fx f;
    graph_fx_open(&f, file, graphs, GS_SEQS, 128, 0);
    const struct stage_config *c = stage_config_get(f.s);
    const int32_t per_seq = c->n_ctx_max / c->block_size, V = f.n_vocab;
    ASSERT_EQ(512, V); /* the caller's buffer */
    ASSERT_TRUE(n_seqs < GS_SEQS);
    static int32_t tables[GS_SEQS][16], ids[GS_SEQS][128];
    ASSERT_TRUE(per_seq <= 16 && c->n_blocks >= GS_SEQS * per_seq);
    for (int32_t i = 0; i < GS_SEQS; i++) {
        for (int32_t j = 0; j < per_seq; j++) tables[i][j] = c->n_blocks - 1 - (j * GS_SEQS + i);
        make_ids(ids[i], 128, 100 + (uint32_t)i, V);
    }
    int32_t len[GS_SEQS];
    struct forward_seq q[GS_SEQS];
    struct forward_out o = {NULL, 0, NULL, NULL};
    for (int32_t i = 0; i < n_seqs; i++) {
        len[i] = 3 + 5 * i % 61;
        q[0] = (struct forward_seq){ids[i], len[i], 0, tables[i], per_seq, FORWARD_LOGITS_LAST};
        struct forward_batch bt = {q, 1, NULL, 0, NULL, 0};
        if (forward_step(f.s, &bt, &o, err, sizeof err) != 0) TEST_FAIL("prefill %d: %s", i, err);
    }
    for (int32_t k = 0; k < steps; k++) {
        for (int32_t i = 0; i < n_seqs; i++)
            q[i] = (struct forward_seq){&ids[i][len[i]], 1, len[i], tables[i], per_seq,
                                        k == 2 ? FORWARD_LOGITS_NONE : FORWARD_LOGITS_LAST};
        struct forward_batch bt = {q, n_seqs, NULL, 0, NULL, 0};
        o.logits = out + (size_t)k * n_seqs * V;
        if (k == 2) memset(o.logits, 0, sizeof(float) * (size_t)n_seqs * V);
        if (forward_step(f.s, &bt, &o, err, sizeof err) != 0) TEST_FAIL("decode step %d: %s", k, err);
        ASSERT_EQ(k == 2 ? 0 : n_seqs, o.n_logits);
        for (int32_t i = 0; i < n_seqs; i++) len[i]++;
        if (k == 3) {
            struct forward_seq p = {ids[GS_SEQS - 1], 100, 0, tables[GS_SEQS - 1], per_seq, FORWARD_LOGITS_LAST};
            struct forward_batch bp = {&p, 1, NULL, 0, NULL, 0};
            o.logits = NULL;
            if (forward_step(f.s, &bp, &o, err, sizeof err) != 0) TEST_FAIL("prefill between: %s", err);
        }
    }
    *recorded = stage_graphs_recorded(f.s);
    fx_close(&f);
}

/* Speculation's verifying steps: n_seqs sequences of R rows a step, every
 * row's logits, at contexts of 130 to 340 positions (so the tensor-core
 * attention splits a tile's context, by that tile's own length, where a
 * graph is sized for n_ctx_max), advancing 1 .. R positions a step as
 * accepted drafts do (the next step writes over the rejected rows' cache
 * entries).  Like graph_scenario: every step's logits in out, the graphs
 * recorded in *recorded. */
static void verify_scenario(const char *file, int graphs, int32_t n_seqs, int32_t R, int32_t steps, float *out,
                            int32_t *recorded) {
    char err[512];
    struct fx f;
    graph_fx_open(&f, file, graphs, 4, 512, 16);
    const struct stage_config *c = stage_config_get(f.s);
    const int32_t per_seq = c->n_ctx_max / c->block_size, V = f.n_vocab;
    ASSERT_EQ(512, V);
    ASSERT_TRUE(n_seqs <= 4 && n_seqs * R <= 16);
    static int32_t tables[4][64], ids[4][512];
    ASSERT_TRUE(per_seq <= 64 && c->n_blocks >= 4 * per_seq);
    int32_t len[4];
    struct forward_seq q[4];
    struct forward_out o = {NULL, 0, NULL, NULL};
    for (int32_t i = 0; i < n_seqs; i++) {
        for (int32_t j = 0; j < per_seq; j++) tables[i][j] = c->n_blocks - 1 - (j * 4 + i);
        make_ids(ids[i], 512, 200 + (uint32_t)i, V);
        len[i] = 130 + 70 * i;
        for (int32_t p0 = 0; p0 < len[i]; p0 += 100) {
            int32_t n = len[i] - p0 < 100 ? len[i] - p0 : 100;
            q[0] = (struct forward_seq){ids[i] + p0, n, p0, tables[i], per_seq, FORWARD_LOGITS_NONE};
            struct forward_batch bt = {q, 1, NULL, 0, NULL, 0};
            if (forward_step(f.s, &bt, &o, err, sizeof err) != 0) TEST_FAIL("prefill %d: %s", i, err);
        }
    }
    for (int32_t k = 0; k < steps; k++) {
        for (int32_t i = 0; i < n_seqs; i++)
            q[i] = (struct forward_seq){&ids[i][len[i]], R, len[i], tables[i], per_seq, FORWARD_LOGITS_ALL};
        struct forward_batch bt = {q, n_seqs, NULL, 0, NULL, 0};
        o.logits = out + (size_t)k * n_seqs * R * V;
        if (forward_step(f.s, &bt, &o, err, sizeof err) != 0) TEST_FAIL("verifying step %d: %s", k, err);
        ASSERT_EQ(n_seqs * R, o.n_logits);
        for (int32_t i = 0; i < n_seqs; i++) len[i] += 1 + (k + i) % R;
    }
    *recorded = stage_graphs_recorded(f.s);
    fx_close(&f);
}

/* The same decode steps with graphs and without give the same logits, bit
 * for bit, at batch 1, 3, 8 and 20, and at 3 and 20 with the decode
 * attention on tensor cores (on a GPU; the CPU backend has no
 * graphs and records none).  The F16 cache takes the decode attention
 * kernel, whose split of a row's context depends on that row's length
 * only.  At 20 every matmul takes matmul_wide.cu (LLM_CUDA_WIDE_ITEMS=0:
 * this model's matmuls are too small for it by default), whose arrival
 * counters and partial sums must be right on every replay.  Then
 * verifying steps (verify_scenario) of 1 x 5, 3 x 4 and 2 x 2 rows. */
TEST(forward_graphs_equal_ops) {
    const char *dev = getenv("LLM_TEST_DEVICE");
    const int gpu = dev && strncmp(dev, "cuda:", 5) == 0;
    static const int32_t batches[] = {1, 3, 8, 20, 3, 20};
    setenv("LLM_CUDA_WIDE_ITEMS", "0", 1);
    const int32_t steps = 6;
    const char *file = "synth256-q8_0.gguf";
    for (size_t bi = 0; bi < sizeof batches / sizeof batches[0]; bi++) {
        int32_t B = batches[bi], rec_on = 0, rec_off = 0;
        /* The last two again with the decode attention on the tensor-core
         * kernel (by default only groups of 8 take it; this model has 2),
         * which splits each row's context by its own length too. */
        if (bi >= 4) setenv("LLM_CUDA_DECODE_TC_G", "1", 1);
        size_t n = (size_t)steps * B * 512;
        float *on = malloc(sizeof(float) * n), *off = malloc(sizeof(float) * n);
        graph_scenario(file, 1, B, steps, on, &rec_on);
        graph_scenario(file, 0, B, steps, off, &rec_off);
        double d = max_abs_diff(on, off, n);
        printf("  batch %d%s: %d graphs recorded, max abs diff with and without %.3g\n", B,
               bi >= 4 ? " (attention on tensor cores)" : "", rec_on, d);
        ASSERT_EQ(0, rec_off);
        ASSERT_EQ(gpu ? 2 : 0, rec_on); /* with logits and without */
        ASSERT_TRUE(d == 0.0);
        free(on);
        free(off);
    }
    unsetenv("LLM_CUDA_WIDE_ITEMS");
    unsetenv("LLM_CUDA_DECODE_TC_G");
    static const int32_t shapes[][2] = {{1, 5}, {3, 4}, {2, 2}};
    for (size_t si = 0; si < sizeof shapes / sizeof shapes[0]; si++) {
        const int32_t S = shapes[si][0], R = shapes[si][1];
        int32_t rec_on = 0, rec_off = 0;
        size_t n = (size_t)steps * S * R * 512;
        float *on = malloc(sizeof(float) * n), *off = malloc(sizeof(float) * n);
        verify_scenario(file, 1, S, R, steps, on, &rec_on);
        verify_scenario(file, 0, S, R, steps, off, &rec_off);
        double d = max_abs_diff(on, off, n);
        printf("  %d sequences of %d verified rows: %d graphs recorded, max abs diff with and without %.3g\n", S, R,
               rec_on, d);
        ASSERT_EQ(0, rec_off);
        ASSERT_EQ(gpu ? 1 : 0, rec_on);
        ASSERT_TRUE(d == 0.0);
        free(on);
        free(off);
    }
}

/* Sampling on the stage's backend (forward_out.sample; on a GPU on the
 * device) picks what common/sampling.c picks from the same logits, with
 * the logits downloaded too for the comparison: 4 sequences with
 * different requests (greedy; temperature + top-k; top-p with repetition
 * penalty over the history; min-p with logprobs and 5 alternatives)
 * decode 12 tokens each in batched steps (graph steps on a GPU), each
 * sampled token fed back.  Tokens equal (a draw at a float boundary would
 * differ, with odds ~1e-6 per row here), logprobs within 1e-4. */
TEST(forward_samples_like_host_sampler) {
    enum { N_SEQ = 4, PROMPT = 6, GEN = 12 };
    struct fx f;
    fx_open(&f, "stories260K-f32.gguf", NULL);
    struct sampling_params sp[N_SEQ];
    for (int i = 0; i < N_SEQ; i++) {
        sampling_params_default(&sp[i]);
        sp[i].seed = 1000u + (uint64_t)i;
    }
    sp[1].temperature = 0.9f, sp[1].top_k = 20;
    sp[2].temperature = 1.1f, sp[2].top_p = 0.8f, sp[2].repetition_penalty = 1.3f, sp[2].penalty_last_n = 8;
    sp[3].temperature = 0.7f, sp[3].min_p = 0.05f, sp[3].logprobs = 1, sp[3].top_logprobs = 5;
    sampler *smp = NULL;
    char err[512];
    if (sampler_init(&smp, f.n_vocab, err, sizeof err) != 0) TEST_FAIL("sampler_init: %s", err);
    int32_t hist[N_SEQ][PROMPT + GEN + 1];
    struct kvblocks_table t[N_SEQ];
    for (int i = 0; i < N_SEQ; i++) {
        make_ids(hist[i], PROMPT, 300u + (uint32_t)i, f.n_vocab);
        kvblocks_table_init(&t[i]);
    }
    float *logits = malloc(sizeof(float) * f.n_vocab * N_SEQ);
    struct backend_sample_row rows[N_SEQ];
    int differ = 0, checked = 0;
    for (int step = 0; step <= GEN; step++) {
        struct forward_seq q[N_SEQ];
        for (int i = 0; i < N_SEQ; i++) {
            int32_t pos0 = step == 0 ? 0 : PROMPT + step - 1, n = step == 0 ? PROMPT : 1;
            ASSERT_OK(kvblocks_reserve(f.kb, &t[i], n, NULL, NULL));
            q[i] = (struct forward_seq){hist[i] + pos0, n, pos0, t[i].ids, t[i].n_ids, FORWARD_LOGITS_LAST};
            memset(&rows[i], 0, sizeof rows[i]);
            rows[i].params = &sp[i];
            rows[i].history = hist[i];
            rows[i].n_history = pos0 + n;
            rows[i].pos = pos0 + n;
        }
        struct forward_batch bt = {q, N_SEQ, NULL, 0, NULL, 0};
        struct forward_out o = {logits, 0, NULL, rows};
        if (forward_step(f.s, &bt, &o, err, sizeof err) != 0) TEST_FAIL("forward_step: %s", err);
        ASSERT_EQ((int32_t)N_SEQ, o.n_logits);
        for (int i = 0; i < N_SEQ; i++) {
            struct sampling_result want;
            ASSERT_OK(sampler_sample(smp, logits + (size_t)i * f.n_vocab, &sp[i], hist[i], rows[i].n_history,
                                     rows[i].pos, &want));
            ASSERT_EQ(0, rows[i].status);
            checked++;
            if (rows[i].result.token != want.token) {
                printf("  step %d seq %d: backend picked %d, host %d\n", step, i, rows[i].result.token, want.token);
                differ++;
            }
            if (sp[i].logprobs) {
                ASSERT_NEAR(want.logprob, rows[i].result.logprob, 1e-4);
                ASSERT_EQ(want.n_top, rows[i].result.n_top);
                for (int32_t k = 0; k < want.n_top; k++) {
                    ASSERT_EQ(want.top_token[k], rows[i].result.top_token[k]);
                    ASSERT_NEAR(want.top_logprob[k], rows[i].result.top_logprob[k], 1e-4);
                }
            }
            hist[i][rows[i].pos] = want.token; /* the host's choice drives both */
        }
    }
    printf("  %d of %d sampled tokens differ from the host sampler on %s\n", differ, checked, backend_name(f.b));
    ASSERT_EQ(0, differ);
    for (int i = 0; i < N_SEQ; i++) kvblocks_table_free(f.kb, &t[i]);
    free(logits);
    sampler_free(smp);
    fx_close(&f);
}

TEST_MAIN(forward_stories_f32_greedy_matches_golden, forward_stories_f16_teacher_forced,
          forward_stories_q8_0_teacher_forced, forward_stories_q4_0_teacher_forced,
          forward_tiny_llama_hf_matches_reference, forward_batch_equals_single,
          forward_shared_prefix_copy_on_write, forward_two_stages_equal_one,
          forward_synth256_quants_close_to_f32, forward_f16_kv_cache_close_to_f32,
          forward_weights_converted_at_load, forward_rejects_bad_input, forward_gpu_matches_cpu, forward_graphs_equal_ops,
          forward_samples_like_host_sampler, forward_pycode_q4_k_m_teacher_forced,
          forward_pycode_q4_k_m_q8_kv_decode)
