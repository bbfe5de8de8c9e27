/* Tests of the 8-bit (Q8_0) KV cache: the engine's logits with it stay
 * close to the float caches' on stories260K-f32, teacher-forced on
 * llama.cpp's golden sequences and in perplexity over a few paragraphs of
 * text, and the byte accounting gives it about twice F16's positions.
 * LLM_TEST_DEVICE=cuda:N runs the same checks on that GPU. */
#include "../test.h"
#include "common/kvblocks.h"
#include "common/model.h"
#include "common/status.h"
#include "common/tokenizer.h"
#include "kernels/backend.h"
#include "worker/forward.h"
#include "worker/kvcache.h"
#include "worker/stage.h"

#include <cjson/cJSON.h>
#include <math.h>

#define MODEL "stories260K-f32.gguf"

struct fx {
    backend *b;
    model_file *m;
    stage *s;
    kvblocks *kb;
    int32_t n_vocab;
};

static void fx_open(struct fx *f, int32_t kv_type) {
    char err[512];
    memset(f, 0, sizeof *f);
    const char *path = test_model_path(MODEL);
    const char *dev = getenv("LLM_TEST_DEVICE");
    if (dev && strncmp(dev, "cuda:", 5) == 0) {
        if (backend_cuda_init(&f->b, atoi(dev + 5), err, sizeof err) != 0)
            TEST_FAIL("LLM_TEST_DEVICE=%s: %s", dev, err);
    } else if (backend_cpu_init(&f->b, 2, err, sizeof err) != 0) {
        TEST_FAIL("backend_cpu_init: %s", err);
    }
    if (model_file_open(&f->m, path, err, sizeof err) != 0) TEST_FAIL("model_file_open: %s", err);
    struct stage_config cfg;
    stage_config_default(&cfg);
    cfg.kv_type = kv_type;
    cfg.n_seqs_max = 1;
    cfg.n_ctx_max = 512;
    cfg.n_logits_max = 64;
    if (stage_init(&f->s, f->m, f->b, &cfg, err, sizeof err) != 0) TEST_FAIL("stage_init: %s", err);
    ASSERT_EQ(kv_type, (int)kvcache_type(stage_kvcache(f->s)));
    const struct stage_config *c = stage_config_get(f->s);
    if (kvblocks_init(&f->kb, c->n_blocks, c->block_size, err, sizeof err) != 0)
        TEST_FAIL("kvblocks_init: %s", err);
    f->n_vocab = model_file_hparams(f->m)->n_vocab;
}

static void fx_close(struct fx *f) {
    ASSERT_EQ(kvblocks_n_blocks(f->kb), kvblocks_n_free(f->kb));
    kvblocks_free(f->kb);
    stage_free(f->s);
    model_file_close(f->m);
    backend_free(f->b);
}

/* The logits of every position of ids[0..n) as one sequence: a first step
 * of `first` rows, then steps of `chunk` rows (which read the cache the
 * earlier steps wrote, as decode steps do when chunk is 1). */
static void fx_eval(struct fx *f, const int32_t *ids, int32_t n, int32_t first, int32_t chunk, float *logits) {
    struct kvblocks_table t;
    kvblocks_table_init(&t);
    char err[512];
    for (int32_t i = 0; i < n;) {
        int32_t want = i == 0 ? first : chunk, len = n - i < want ? n - i : want;
        struct kvblocks_copy cp;
        int32_t n_cp = 0, pos0 = t.n_tokens;
        ASSERT_OK(kvblocks_reserve(f->kb, &t, len, &cp, &n_cp));
        struct forward_seq q = {ids + i, len, pos0, t.ids, t.n_ids, FORWARD_LOGITS_ALL};
        struct forward_batch bt = {&q, 1, &cp, n_cp, NULL, 0};
        struct forward_out o = {logits + (size_t)i * f->n_vocab, 0, NULL, NULL};
        if (forward_step(f->s, &bt, &o, err, sizeof err) != 0) TEST_FAIL("forward_step: %s", err);
        i += len;
    }
    kvblocks_table_free(f->kb, &t);
}

static int32_t argmax(const float *x, int32_t n) {
    int32_t best = 0;
    for (int32_t i = 1; i < n; i++)
        if (x[i] > x[best]) best = i;
    return best;
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

/* Teacher forcing on prompt + golden ids (llama.cpp's greedy generation
 * with an F32 model): with an 8-bit cache, every golden token's logit is
 * within 0.05 of the highest logit at its position.  Once as one prefill
 * and once as prefill + one decode step per token, so both attention
 * paths (many rows, one row) read the 8-bit cache. */
TEST(kv_q8_teacher_forced_on_goldens) {
    const char *path = test_model_path("stories260K-golden.json");
    char *buf = test_read_file(path, NULL);
    if (!buf) TEST_FAIL("cannot read %s", path);
    cJSON *root = cJSON_Parse(buf);
    free(buf);
    if (!root) TEST_FAIL("%s: not JSON", path);
    const cJSON *prompts = cJSON_GetObjectItem(
        cJSON_GetObjectItem(cJSON_GetObjectItem(root, "models"), MODEL), "prompts");
    if (!prompts) TEST_FAIL("%s has no %s prompts", path, MODEL);
    struct fx f;
    fx_open(&f, DTYPE_Q8_0);
    double worst = 0;
    int n_checked = 0;
    const cJSON *p;
    cJSON_ArrayForEach(p, prompts) {
        int32_t ids[256];
        int32_t np = json_ids(cJSON_GetObjectItem(p, "prompt_ids"), ids, 64);
        int32_t ng = json_ids(cJSON_GetObjectItem(p, "generated_ids"), ids + np, 128);
        ASSERT_TRUE(np > 0 && np <= 64 && ng > 0 && ng <= 128);
        int32_t n = np + ng;
        float *logits = malloc(sizeof(float) * (size_t)f.n_vocab * n);
        for (int mode = 0; mode < 2; mode++) {
            /* mode 0: one prefill; mode 1: the prompt, then one row a step. */
            fx_eval(&f, ids, n, mode ? np : n, mode ? 1 : n, logits);
            for (int32_t k = 0; k < ng; k++) {
                const float *row = logits + (size_t)(np - 1 + k) * f.n_vocab;
                double gap = row[argmax(row, f.n_vocab)] - row[ids[np + k]];
                if (gap > worst) worst = gap;
                if (gap > 0.05)
                    TEST_FAIL("%s: generated token %d (id %d) is %.4f below the top logit",
                              mode ? "decode" : "prefill", k, ids[np + k], gap);
                n_checked++;
            }
        }
        free(logits);
    }
    printf("  Q8_0 KV: %d golden tokens, each at most %.4f below its position's top logit (bound 0.05)\n",
           n_checked, worst);
    ASSERT_TRUE(n_checked > 0);
    fx_close(&f);
    cJSON_Delete(root);
}

/* A few paragraphs in the style the model was trained on. */
static const char *const paragraphs[] = {
    "Once upon a time, there was a little girl named Lily. She loved to play in the park with her red ball. "
    "One day, she saw a big dog under a tree. The dog was sad because it was lost. Lily wanted to help the "
    "dog find its home.",
    "Tom and his mom went to the store. Tom wanted a toy car, but mom said no. Tom was sad, so he helped mom "
    "carry the bags. Mom was happy and gave him a big hug. They walked home together and ate a yummy cake.",
    "The sun was shining and the birds were singing. A small cat named Tim sat by the window. He watched "
    "the birds fly in the sky. Tim wanted to fly too, but he could not. His friend the bird said, \"You "
    "can run very fast!\" Tim smiled and ran in the garden.",
};

/* Perplexity of every paragraph's tokens after the first, given their
 * prefixes, summed over the paragraphs (each its own sequence). */
static double perplexity(int32_t kv_type, int32_t chunk, int32_t *n_tokens) {
    char err[512];
    tokenizer *tok = NULL;
    if (tokenizer_load(&tok, test_model_path(MODEL), err, sizeof err) != 0) TEST_FAIL("tokenizer: %s", err);
    struct fx f;
    fx_open(&f, kv_type);
    double nll = 0;
    int32_t count = 0;
    for (size_t i = 0; i < sizeof paragraphs / sizeof paragraphs[0]; i++) {
        int32_t ids[512];
        int32_t n = tokenizer_encode(tok, paragraphs[i], strlen(paragraphs[i]), -1, 0, ids, 512);
        ASSERT_TRUE(n > 1 && n <= 128);
        float *logits = malloc(sizeof(float) * (size_t)f.n_vocab * n);
        fx_eval(&f, ids, n, chunk == 1 ? 1 : n, chunk, logits);
        for (int32_t k = 0; k + 1 < n; k++) {
            const float *row = logits + (size_t)k * f.n_vocab;
            double mx = row[argmax(row, f.n_vocab)], sum = 0;
            for (int32_t v = 0; v < f.n_vocab; v++) sum += exp(row[v] - mx);
            nll += mx + log(sum) - row[ids[k + 1]];
            count++;
        }
        free(logits);
    }
    fx_close(&f);
    tokenizer_free(tok);
    *n_tokens = count;
    return exp(nll / count);
}

/* Perplexity with the 8-bit cache is within 1% of the F16 cache's (and of
 * the F32 cache's, the CPU's default), prefilled at once and decoded a
 * token at a time. */
TEST(kv_q8_perplexity_close_to_f16) {
    int32_t n = 0;
    double p32 = perplexity(DTYPE_F32, 512, &n);
    double p16 = perplexity(DTYPE_F16, 512, &n);
    double p8 = perplexity(DTYPE_Q8_0, 512, &n);
    double p8d = perplexity(DTYPE_Q8_0, 1, &n);
    printf("  perplexity over %d tokens: F32 KV %.4f, F16 KV %.4f, Q8_0 KV %.4f (decoded one at a time: %.4f)\n",
           n, p32, p16, p8, p8d);
    ASSERT_TRUE(isfinite(p8) && p8 > 1);
    ASSERT_TRUE(fabs(p8 / p16 - 1) < 0.01);
    ASSERT_TRUE(fabs(p8 / p32 - 1) < 0.01);
    ASSERT_TRUE(fabs(p8d / p16 - 1) < 0.01);
}

/* The byte accounting: at head_dim 128, a Q8_0 row is two groups of an
 * F16 scale and 64 int8 (132 bytes against F16's 256), so a memory budget
 * holds 1.94x the positions; heads of 64 keep groups of 32 (68 against
 * 128, 1.88x); stories260K's 8-wide heads keep one scale per row (10
 * bytes against F16's 16). */
TEST(kv_q8_block_bytes) {
    ASSERT_EQ(132, (int)backend_kv_row_bytes(DTYPE_Q8_0, 128));
    ASSERT_EQ(256, (int)backend_kv_row_bytes(DTYPE_F16, 128));
    ASSERT_EQ(68, (int)backend_kv_row_bytes(DTYPE_Q8_0, 64));
    ASSERT_EQ(10, (int)backend_kv_row_bytes(DTYPE_Q8_0, 8));
    size_t f16 = kvcache_block_bytes(DTYPE_F16, 16, 8, 128), q8 = kvcache_block_bytes(DTYPE_Q8_0, 16, 8, 128);
    ASSERT_EQ(2 * 16 * 8 * 256, (int)f16);
    ASSERT_EQ(2 * 16 * 8 * 132, (int)q8);
    size_t budget = (size_t)4 << 30;
    double ratio = (double)(budget / q8) / (double)(budget / f16);
    ASSERT_TRUE(ratio > 1.93 && ratio < 1.94);
    struct fx f;
    fx_open(&f, DTYPE_Q8_0);
    kvcache *kc = stage_kvcache(f.s);
    const struct model_hparams *hp = model_file_hparams(f.m);
    ASSERT_EQ(kvcache_block_bytes(DTYPE_Q8_0, kvcache_block_size(kc), hp->n_kv_heads, hp->head_dim) *
                  (size_t)kvcache_n_blocks(kc) * (size_t)kvcache_n_layers(kc),
              kvcache_bytes(kc));
    fx_close(&f);
}

/* Odd head widths cannot take the 8-bit layout: a clear refusal. */
TEST(kv_q8_rejects_bad_head_dim) {
    char err[256];
    backend *b = NULL;
    ASSERT_OK(backend_cpu_init(&b, 1, err, sizeof err));
    struct backend_kv kv;
    ASSERT_EQ(STATUS_UNSUPPORTED, backend_kv_init(b, &kv, DTYPE_Q8_0, 4, 16, 2, 48));
    ASSERT_TRUE(strstr(backend_errstr(b), "48") != NULL);
    ASSERT_EQ(STATUS_UNSUPPORTED, backend_kv_init(b, &kv, DTYPE_Q8_0, 4, 16, 2, 7));
    ASSERT_OK(backend_kv_init(b, &kv, DTYPE_Q8_0, 4, 16, 2, 64));
    backend_kv_free(b, &kv);
    backend_free(b);
}

TEST_MAIN(kv_q8_teacher_forced_on_goldens, kv_q8_perplexity_close_to_f16, kv_q8_block_bytes,
          kv_q8_rejects_bad_head_dim)
