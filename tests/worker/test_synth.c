/* Tests for worker/synth: files of several shapes and every type load back
 * through model_file_open with the shapes asked for and llama.cpp-like type
 * mixes, their vocabulary tokenizes any text and decodes it back, weights
 * are deterministic per seed with the intended statistics, bad shapes are
 * refused, and the llm-synth program writes a loadable file. */
#include "worker/synth.h"

#include "common/gguf.h"
#include "common/model.h"
#include "common/status.h"
#include "common/tokenizer.h"
#include "tests/test.h"

#include <sys/stat.h>
#include <unistd.h>

static char tmpdir[256];

static const char *tmp_path(const char *name) {
    static char path[2][512];
    static int k;
    if (!tmpdir[0]) {
        struct stat st;
        const char *base = stat("/dev/shm", &st) == 0 && access("/dev/shm", W_OK) == 0 ? "/dev/shm" : "/tmp";
        snprintf(tmpdir, sizeof tmpdir, "%s/test_synth.XXXXXX", base);
        if (!mkdtemp(tmpdir)) TEST_FAIL("mkdtemp failed");
    }
    k ^= 1;
    snprintf(path[k], sizeof path[k], "%s/%s", tmpdir, name);
    return path[k];
}

static struct synth_config tiny_config(enum synth_type type) {
    struct synth_config c;
    memset(&c, 0, sizeof c);
    ASSERT_OK(synth_shape_preset("tiny", &c.shape));
    c.type = type;
    c.seed = 42;
    c.n_threads = 2;
    return c;
}

static enum dtype tensor_type(const model_file *m, const char *name) {
    struct model_tensor t;
    if (model_file_tensor(m, name, &t) != 0) TEST_FAIL("tensor %s missing", name);
    return t.type;
}

TEST(synth_presets) {
    struct synth_shape s;
    ASSERT_OK(synth_shape_preset("llama2-7b", &s));
    ASSERT_EQ(32, s.n_layers);
    ASSERT_EQ(4096, s.dim);
    ASSERT_EQ(11008, s.ffn_dim);
    ASSERT_EQ(32000, s.n_vocab);
    ASSERT_OK(synth_shape_preset("llama3-8b", &s));
    ASSERT_EQ(8, s.n_kv_heads);
    ASSERT_EQ(128256, s.n_vocab);
    ASSERT_EQ(500000.0f, s.rope_theta);
    ASSERT_OK(synth_shape_preset("tinyllama-1.1b", &s));
    ASSERT_EQ(22, s.n_layers);
    ASSERT_EQ(4, s.n_kv_heads);
    ASSERT_OK(synth_shape_preset("llama2-13b", &s));
    ASSERT_EQ(5120, s.dim);
    ASSERT_OK(synth_shape_preset("100m", &s));
    int64_t params = (int64_t)s.n_vocab * s.dim * 2 +
                     (int64_t)s.n_layers * ((int64_t)s.dim * s.dim * 2 + (int64_t)s.dim * (s.dim / s.n_heads) * s.n_kv_heads * 2 +
                                            (int64_t)s.dim * s.ffn_dim * 3);
    ASSERT_TRUE(params > 90000000 && params < 110000000);
    for (int i = 0; synth_shape_names[i]; i++) ASSERT_OK(synth_shape_preset(synth_shape_names[i], &s));
    ASSERT_EQ((int)STATUS_NOT_FOUND, synth_shape_preset("llama9-1t", &s));
    ASSERT_STREQ("q4_k_m", synth_type_names[SYNTH_Q4_K_M]);
}

/* Every type, written and loaded back: hyper-parameters as asked, the
 * type mix as llama.cpp would choose it, and weights that decode near the
 * generator's values. */
TEST(synth_every_type_loads) {
    for (int ty = 0; ty < SYNTH_TYPE_COUNT; ty++) {
        struct synth_config c = tiny_config((enum synth_type)ty);
        c.shape.n_layers = 3;
        const char *path = tmp_path("t.gguf");
        char err[512];
        ASSERT_OK(synth_write(&c, path, err, sizeof err));
        model_file *m = NULL;
        if (model_file_open(&m, path, err, sizeof err) != 0) TEST_FAIL("type %s: %s", synth_type_names[ty], err);
        const struct model_hparams *hp = model_file_hparams(m);
        ASSERT_EQ(3, hp->n_layers);
        ASSERT_EQ(256, hp->dim);
        ASSERT_EQ(4, hp->n_heads);
        ASSERT_EQ(2, hp->n_kv_heads);
        ASSERT_EQ(64, hp->head_dim);
        ASSERT_EQ(512, hp->ffn_dim);
        ASSERT_EQ(512, hp->n_vocab);
        ASSERT_EQ(512, hp->ctx_len);
        ASSERT_EQ(0, hp->tied_embeddings);
        ASSERT_EQ(512, tokenizer_n_vocab(model_file_tokenizer(m)));
        ASSERT_EQ((int)DTYPE_F32, (int)tensor_type(m, "blk.1.ffn_norm.weight"));
        static const enum dtype q_type[] = {DTYPE_F32, DTYPE_F16, DTYPE_BF16, DTYPE_Q8_0, DTYPE_Q4_0, DTYPE_Q4_K, DTYPE_Q5_K, DTYPE_Q6_K};
        static const enum dtype out_type[] = {DTYPE_F32, DTYPE_F16, DTYPE_BF16, DTYPE_Q8_0, DTYPE_Q6_K, DTYPE_Q6_K, DTYPE_Q6_K, DTYPE_Q6_K};
        ASSERT_EQ((int)q_type[ty], (int)tensor_type(m, "blk.0.attn_q.weight"));
        ASSERT_EQ((int)out_type[ty], (int)tensor_type(m, "output.weight"));
        /* decoded weights against the generator: error within the type's precision */
        struct model_tensor t;
        ASSERT_OK(model_file_tensor(m, "blk.2.ffn_up.weight", &t));
        float row[256];
        double se = 0, sx = 0, sum = 0, norm_sum = 0;
        size_t rb = dtype_row_bytes(t.type, t.ne[0]);
        for (int64_t r = 0; r < t.ne[1]; r++) {
            dtype_dequant_row(t.type, (const uint8_t *)t.data + r * rb, row, 256);
            for (int i = 0; i < 256; i++) {
                float w = synth_weight(42, "blk.2.ffn_up.weight", (uint64_t)(r * 256 + i));
                se += (double)(row[i] - w) * (row[i] - w);
                sx += (double)w * w;
                sum += w;
            }
        }
        double n = (double)t.ne[0] * t.ne[1];
        double nrmse = sqrt(se / sx), std = sqrt(sx / n);
        static const double bound[] = {0, 6e-4, 4e-3, 8e-3, 0.13, 0.11, 0.055, 0.03};
        if (nrmse > bound[ty]) TEST_FAIL("type %s: nrmse %.4f > %.4f", synth_type_names[ty], nrmse, bound[ty]);
        ASSERT_NEAR(0.02, std, 0.001);
        ASSERT_NEAR(0.0, sum / n, 0.001);
        ASSERT_OK(model_file_tensor(m, "output_norm.weight", &t));
        for (int i = 0; i < 256; i++) norm_sum += ((const float *)t.data)[i];
        ASSERT_EQ(256.0, norm_sum);
        model_file_close(m);
        unlink(path);
    }
}

TEST(synth_q4_k_m_mix_and_fallbacks) {
    struct synth_config c = tiny_config(SYNTH_Q4_K_M);
    c.shape.n_layers = 8;
    c.tied = 1;
    const char *path = tmp_path("mix.gguf");
    char err[512];
    ASSERT_OK(synth_write(&c, path, err, sizeof err));
    model_file *m = NULL;
    ASSERT_OK(model_file_open(&m, path, err, sizeof err));
    ASSERT_EQ(1, model_file_hparams(m)->tied_embeddings);
    ASSERT_EQ((int)DTYPE_Q6_K, (int)tensor_type(m, "token_embd.weight")); /* it is the lm_head too */
    /* more bits for layers 0 and 7 (first and last eighth) and 3, 6 (every third between) */
    for (int l = 0; l < 8; l++) {
        char name[64];
        int more = l == 0 || l == 3 || l == 6 || l == 7;
        snprintf(name, sizeof name, "blk.%d.attn_v.weight", l);
        ASSERT_EQ((int)(more ? DTYPE_Q6_K : DTYPE_Q4_K), (int)tensor_type(m, name));
        snprintf(name, sizeof name, "blk.%d.ffn_down.weight", l);
        ASSERT_EQ((int)(more ? DTYPE_Q6_K : DTYPE_Q4_K), (int)tensor_type(m, name));
        snprintf(name, sizeof name, "blk.%d.attn_k.weight", l);
        ASSERT_EQ((int)DTYPE_Q4_K, (int)tensor_type(m, name));
    }
    model_file_close(m);

    /* rows that do not divide into 256 fall back to Q8_0, then to F16 */
    c = tiny_config(SYNTH_Q4_K_M);
    c.shape.dim = 192;
    c.shape.n_heads = 3;
    c.shape.n_kv_heads = 1;
    c.shape.ffn_dim = 200;
    ASSERT_OK(synth_write(&c, path, err, sizeof err));
    ASSERT_OK(model_file_open(&m, path, err, sizeof err));
    ASSERT_EQ(64, model_file_hparams(m)->head_dim);
    ASSERT_EQ((int)DTYPE_Q8_0, (int)tensor_type(m, "blk.0.attn_q.weight"));
    ASSERT_EQ((int)DTYPE_Q8_0, (int)tensor_type(m, "output.weight"));
    ASSERT_EQ((int)DTYPE_F16, (int)tensor_type(m, "blk.0.ffn_down.weight")); /* rows of 200 */
    model_file_close(m);
    unlink(path);
}

/* Any text, with bytes outside the generated pieces, tokenizes and decodes
 * back exactly. */
TEST(synth_vocab_tokenizes_any_text) {
    struct synth_config c = tiny_config(SYNTH_F16);
    c.shape.n_layers = 1;
    c.shape.n_vocab = 2000;
    const char *path = tmp_path("vocab.gguf");
    char err[512];
    ASSERT_OK(synth_write(&c, path, err, sizeof err));
    model_file *m = NULL;
    ASSERT_OK(model_file_open(&m, path, err, sizeof err));
    const tokenizer *tok = model_file_tokenizer(m);
    ASSERT_EQ(2000, tokenizer_n_vocab(tok));
    ASSERT_EQ(1, tokenizer_bos(tok));
    ASSERT_EQ(2, tokenizer_eos(tok));
    const char *texts[] = {"the quick brown fox jumps over the lazy dog", "Hello, World! 123",
                           "caf\xc3\xa9 \xe6\x97\xa5\xe6\x9c\xac \xf0\x9f\x98\x80 tabs\tand\nnewlines", "   spaces  "};
    for (size_t k = 0; k < sizeof texts / sizeof texts[0]; k++) {
        int32_t ids[512];
        int32_t n = tokenizer_encode(tok, texts[k], strlen(texts[k]), 0, 0, ids, 512);
        ASSERT_TRUE(n > 0 && n < 512);
        char out[2048];
        size_t len = 0;
        for (int32_t i = 0; i < n; i++) {
            ASSERT_TRUE(ids[i] >= 3 && ids[i] < 2000);
            int b = tokenizer_token_bytes(tok, ids[i], out + len, sizeof out - len);
            ASSERT_TRUE(b >= 0);
            len += (size_t)b;
        }
        out[len] = 0;
        /* SentencePiece adds one leading space */
        const char *got = out[0] == ' ' ? out + 1 : out;
        ASSERT_STREQ(texts[k], got);
        if (k == 0) ASSERT_TRUE(n < (int32_t)strlen(texts[k])); /* merges happened */
    }
    int32_t ids[8];
    ASSERT_EQ(2, tokenizer_encode(tok, "a", 1, 1, 0, ids, 8));
    ASSERT_EQ(1, ids[0]);
    model_file_close(m);
    unlink(path);
}

TEST(synth_deterministic) {
    struct synth_config c = tiny_config(SYNTH_Q8_0);
    c.shape.n_layers = 1;
    char err[512], a[512], b[512];
    snprintf(a, sizeof a, "%s", tmp_path("a.gguf"));
    snprintf(b, sizeof b, "%s", tmp_path("b.gguf"));
    ASSERT_OK(synth_write(&c, a, err, sizeof err));
    c.n_threads = 1; /* the thread count does not change the bytes */
    ASSERT_OK(synth_write(&c, b, err, sizeof err));
    FILE *fa = fopen(a, "rb"), *fb = fopen(b, "rb");
    ASSERT_TRUE(fa && fb);
    int same = 1, ca, cb;
    do {
        ca = fgetc(fa);
        cb = fgetc(fb);
        if (ca != cb) same = 0;
    } while (ca != EOF && cb != EOF);
    fclose(fa);
    fclose(fb);
    ASSERT_EQ(1, same);
    c.seed = 43;
    ASSERT_OK(synth_write(&c, b, err, sizeof err));
    gguf_file *ga = NULL, *gb = NULL;
    ASSERT_OK(gguf_open(&ga, a, err, sizeof err));
    ASSERT_OK(gguf_open(&gb, b, err, sizeof err));
    const struct gguf_tensor *ta = gguf_tensor_find(ga, "blk.0.attn_q.weight"), *tb = gguf_tensor_find(gb, "blk.0.attn_q.weight");
    ASSERT_TRUE(ta && tb && ta->nbytes == tb->nbytes);
    ASSERT_TRUE(memcmp(ta->data, tb->data, ta->nbytes) != 0);
    /* different tensors get different streams */
    ASSERT_TRUE(synth_weight(1, "blk.0.attn_q.weight", 0) != synth_weight(1, "blk.0.attn_k.weight", 0));
    gguf_close(ga);
    gguf_close(gb);
    unlink(a);
    unlink(b);
}

/* head_dim apart from dim / heads: the attention is heads x head_dim wide
 * (q and output 64 wide on a 256-wide model), and readers learn the head's
 * width from key_length. */
TEST(synth_head_dim_apart_from_dim) {
    struct synth_config c = tiny_config(SYNTH_F16);
    c.shape.n_heads = 2;
    c.shape.n_kv_heads = 1;
    c.shape.head_dim = 32;
    const char *path = tmp_path("hd.gguf");
    char err[512];
    ASSERT_OK(synth_write(&c, path, err, sizeof err));
    model_file *m = NULL;
    if (model_file_open(&m, path, err, sizeof err) != 0) TEST_FAIL("%s", err);
    const struct model_hparams *hp = model_file_hparams(m);
    ASSERT_EQ(256, hp->dim);
    ASSERT_EQ(2, hp->n_heads);
    ASSERT_EQ(1, hp->n_kv_heads);
    ASSERT_EQ(32, hp->head_dim);
    struct model_tensor t;
    ASSERT_OK(model_file_tensor(m, "blk.1.attn_q.weight", &t));
    ASSERT_EQ((int64_t)256, t.ne[0]);
    ASSERT_EQ((int64_t)64, t.ne[1]);
    ASSERT_OK(model_file_tensor(m, "blk.1.attn_k.weight", &t));
    ASSERT_EQ((int64_t)32, t.ne[1]);
    ASSERT_OK(model_file_tensor(m, "blk.1.attn_output.weight", &t));
    ASSERT_EQ((int64_t)64, t.ne[0]);
    ASSERT_EQ((int64_t)256, t.ne[1]);
    model_file_close(m);
    unlink(path);
    c.shape.head_dim = 31;
    ASSERT_EQ((int)STATUS_BAD_INPUT, synth_write(&c, path, err, sizeof err));
    ASSERT_TRUE(strstr(err, "head dim 31") != NULL);
}

TEST(synth_refuses_bad_shapes) {
    char err[512];
    struct synth_config c = tiny_config(SYNTH_F16);
    c.shape.n_heads = 3; /* 256 / 3 */
    ASSERT_EQ((int)STATUS_BAD_INPUT, synth_write(&c, tmp_path("bad.gguf"), err, sizeof err));
    ASSERT_TRUE(strstr(err, "dim 256 is not a multiple of heads 3") != NULL);
    c = tiny_config(SYNTH_F16);
    c.shape.n_kv_heads = 3;
    ASSERT_EQ((int)STATUS_BAD_INPUT, synth_write(&c, tmp_path("bad.gguf"), err, sizeof err));
    ASSERT_TRUE(strstr(err, "heads 4 is not a multiple of kv-heads 3") != NULL);
    c = tiny_config(SYNTH_F16);
    c.shape.n_vocab = 100;
    ASSERT_EQ((int)STATUS_BAD_INPUT, synth_write(&c, tmp_path("bad.gguf"), err, sizeof err));
    ASSERT_TRUE(strstr(err, "vocab 100") != NULL);
    c = tiny_config(SYNTH_F16);
    c.shape.dim = 4 * 5; /* head dim 5 */
    ASSERT_EQ((int)STATUS_BAD_INPUT, synth_write(&c, tmp_path("bad.gguf"), err, sizeof err));
    ASSERT_TRUE(strstr(err, "odd") != NULL);
    c = tiny_config(SYNTH_F16);
    ASSERT_EQ((int)STATUS_IO, synth_write(&c, "/nonexistent-dir/x.gguf", err, sizeof err));
    ASSERT_TRUE(strstr(err, "/nonexistent-dir/x.gguf") != NULL);
    struct stat st;
    ASSERT_TRUE(stat(tmp_path("bad.gguf"), &st) != 0); /* nothing half-written is left */
}

/* The program end to end: flags override the preset. */
TEST(synth_program) {
    char exe[1024], cmd[2048];
    snprintf(exe, sizeof exe, "%s/worker/llm-synth", LLM_BINARY_DIR);
    if (access(exe, X_OK) != 0) TEST_SKIP("%s is not built", exe);
    const char *path = tmp_path("cli.gguf");
    snprintf(cmd, sizeof cmd, "'%s' --out '%s' --shape tiny --layers 3 --heads 8 --kv-heads 4 --type q8_0 --seed 5 --vocab 1000 --log-level warn",
             exe, path);
    ASSERT_EQ(0, system(cmd));
    char err[512];
    model_file *m = NULL;
    ASSERT_OK(model_file_open(&m, path, err, sizeof err));
    const struct model_hparams *hp = model_file_hparams(m);
    ASSERT_EQ(3, hp->n_layers);
    ASSERT_EQ(8, hp->n_heads);
    ASSERT_EQ(4, hp->n_kv_heads);
    ASSERT_EQ(32, hp->head_dim);
    ASSERT_EQ(1000, hp->n_vocab);
    ASSERT_EQ((int)DTYPE_Q8_0, (int)tensor_type(m, "blk.2.ffn_gate.weight"));
    model_file_close(m);
    unlink(path);
    snprintf(cmd, sizeof cmd, "'%s' --out '%s' --type q9 2>/dev/null", exe, path);
    ASSERT_TRUE(system(cmd) != 0);
    snprintf(cmd, sizeof cmd, "'%s' --shape tiny 2>/dev/null", exe);
    ASSERT_TRUE(system(cmd) != 0); /* --out is required */
}

TEST(synth_cleanup) {
    if (tmpdir[0]) rmdir(tmpdir);
}

TEST_MAIN(synth_presets, synth_every_type_loads, synth_q4_k_m_mix_and_fallbacks, synth_vocab_tokenizes_any_text,
          synth_deterministic, synth_head_dim_apart_from_dim, synth_refuses_bad_shapes, synth_program, synth_cleanup)
