/* Tests for common/model (and common/safetensors): the hyper-parameters and
 * tensors of the stories260K, synth256 and tiny-llama-hf test models, rope
 * frequencies against separately written formulas, Hugging Face config
 * variants, and damaged copies of each model that must be refused with a
 * message naming the tensor, key or file at fault. */
#include "common/gguf.h"
#include "common/model.h"
#include "common/safetensors.h"
#include "common/status.h"
#include "tests/test.h"

#include <sys/stat.h>
#include <unistd.h>

static char tmpdir[256];

static const char *tmp_path(const char *name) {
    static char path[4][512];
    static int k;
    if (!tmpdir[0]) {
        struct stat st;
        const char *base = stat("/dev/shm", &st) == 0 && access("/dev/shm", W_OK) == 0 ? "/dev/shm" : "/tmp";
        snprintf(tmpdir, sizeof tmpdir, "%s/test_model.XXXXXX", base);
        if (!mkdtemp(tmpdir)) TEST_FAIL("mkdtemp failed");
    }
    k = (k + 1) % 4;
    snprintf(path[k], sizeof path[k], "%s/%s", tmpdir, name);
    return path[k];
}

static void write_all(const char *path, const void *p, size_t n) {
    FILE *fp = fopen(path, "wb");
    if (!fp) TEST_FAIL("cannot create %s", path);
    if (n && fwrite(p, 1, n, fp) != n) TEST_FAIL("cannot write %s", path);
    fclose(fp);
}

/* Opening must fail with `status` and a message containing each of the
 * given fragments. */
static void expect_refused(const char *path, int status, const char *frag1, const char *frag2) {
    char err[1024];
    model_file *m = NULL;
    int st = model_file_open(&m, path, err, sizeof err);
    if (st == 0) {
        model_file_close(m);
        TEST_FAIL("%s was accepted", path);
    }
    ASSERT_TRUE(m == NULL);
    printf("  refused: %s\n", err);
    if (status) ASSERT_EQ(status, st);
    if (frag1 && !strstr(err, frag1)) TEST_FAIL("message lacks \"%s\": %s", frag1, err);
    if (frag2 && !strstr(err, frag2)) TEST_FAIL("message lacks \"%s\": %s", frag2, err);
}

TEST(model_stories260k) {
    char err[1024];
    model_file *m = NULL;
    ASSERT_OK(model_file_open(&m, test_model_path("stories260K-f32.gguf"), err, sizeof err));
    const struct model_hparams *hp = model_file_hparams(m);
    ASSERT_EQ((int)MODEL_ARCH_LLAMA, (int)hp->arch);
    ASSERT_EQ(512, hp->n_vocab);
    ASSERT_EQ(64, hp->dim);
    ASSERT_EQ(5, hp->n_layers);
    ASSERT_EQ(8, hp->n_heads);
    ASSERT_EQ(4, hp->n_kv_heads);
    ASSERT_EQ(8, hp->head_dim);
    ASSERT_EQ(172, hp->ffn_dim);
    ASSERT_EQ(128, hp->ctx_len);
    ASSERT_NEAR(1e-5, hp->rms_eps, 1e-12);
    ASSERT_EQ(10000.0f, hp->rope_theta); /* the file has no freq_base: the default */
    ASSERT_EQ(0, hp->rope_neox);
    ASSERT_EQ((int)ROPE_SCALING_NONE, (int)hp->rope_scaling);
    ASSERT_EQ(0, hp->tied_embeddings); /* output.weight is a stored copy */
    ASSERT_EQ(0, hp->qkv_bias);
    ASSERT_TRUE(hp->rope_freq_factors == NULL);
    ASSERT_EQ(512, tokenizer_n_vocab(model_file_tokenizer(m)));
    ASSERT_EQ(1, tokenizer_bos(model_file_tokenizer(m)));
    struct model_tensor t;
    ASSERT_OK(model_file_tensor(m, "blk.4.ffn_down.weight", &t));
    ASSERT_EQ((int)DTYPE_F32, (int)t.type);
    ASSERT_EQ((int64_t)172, t.ne[0]);
    ASSERT_EQ((int64_t)64, t.ne[1]);
    ASSERT_EQ((size_t)172 * 64 * 4, t.nbytes);
    ASSERT_OK(model_file_tensor(m, "output_norm.weight", &t));
    ASSERT_EQ(1, t.n_dims);
    ASSERT_EQ((int)STATUS_NOT_FOUND, model_file_tensor(m, "blk.5.attn_q.weight", &t));
    ASSERT_TRUE(strstr(model_file_path(m), "stories260K-f32.gguf") != NULL);
    model_file_close(m);

    ASSERT_OK(model_file_open(&m, test_model_path("stories260K-q4_0.gguf"), err, sizeof err));
    ASSERT_OK(model_file_tensor(m, "output.weight", &t));
    ASSERT_EQ((int)DTYPE_Q8_0, (int)t.type);
    ASSERT_OK(model_file_tensor(m, "blk.0.ffn_down.weight", &t));
    ASSERT_EQ((int)DTYPE_F16, (int)t.type);
    ASSERT_OK(model_file_tensor(m, "blk.0.attn_q.weight", &t));
    ASSERT_EQ((int)DTYPE_Q4_0, (int)t.type);
    model_file_close(m);
}

TEST(model_synth256_quantizations) {
    static const struct { const char *file; enum dtype q, output, v1; } files[] = {
        {"synth256-f32.gguf", DTYPE_F32, DTYPE_F32, DTYPE_F32},
        {"synth256-q8_0.gguf", DTYPE_Q8_0, DTYPE_Q8_0, DTYPE_Q8_0},
        {"synth256-q6_k.gguf", DTYPE_Q6_K, DTYPE_Q6_K, DTYPE_Q6_K},
        {"synth256-q5_k_m.gguf", DTYPE_Q5_K, DTYPE_Q6_K, DTYPE_Q6_K},
        {"synth256-q4_k_m.gguf", DTYPE_Q4_K, DTYPE_Q6_K, DTYPE_Q6_K},
    };
    for (size_t i = 0; i < sizeof files / sizeof files[0]; i++) {
        char err[1024];
        model_file *m = NULL;
        ASSERT_OK(model_file_open(&m, test_model_path(files[i].file), err, sizeof err));
        const struct model_hparams *hp = model_file_hparams(m);
        ASSERT_EQ(256, hp->dim);
        ASSERT_EQ(768, hp->ffn_dim);
        ASSERT_EQ(2, hp->n_layers);
        ASSERT_EQ(4, hp->n_heads);
        ASSERT_EQ(2, hp->n_kv_heads);
        ASSERT_EQ(64, hp->head_dim);
        ASSERT_EQ(512, hp->n_vocab);
        ASSERT_EQ(512, hp->ctx_len);
        ASSERT_EQ(10000.0f, hp->rope_theta);
        ASSERT_EQ(0, hp->tied_embeddings);
        struct model_tensor t;
        ASSERT_OK(model_file_tensor(m, "blk.0.attn_q.weight", &t));
        ASSERT_EQ((int)files[i].q, (int)t.type);
        ASSERT_EQ((int64_t)256, t.ne[0]);
        ASSERT_EQ((int64_t)256, t.ne[1]);
        ASSERT_OK(model_file_tensor(m, "output.weight", &t));
        ASSERT_EQ((int)files[i].output, (int)t.type);
        ASSERT_OK(model_file_tensor(m, "blk.1.attn_v.weight", &t));
        ASSERT_EQ((int)files[i].v1, (int)t.type);
        ASSERT_EQ((int64_t)128, t.ne[1]);
        ASSERT_OK(model_file_tensor(m, "blk.1.ffn_down.weight", &t));
        ASSERT_EQ((int64_t)768, t.ne[0]);
        ASSERT_EQ((int64_t)256, t.ne[1]);
        model_file_close(m);
    }
}

TEST(model_tiny_llama_hf) {
    const char *dir = test_model_path("tiny-llama-hf");
    char dirbuf[1024];
    snprintf(dirbuf, sizeof dirbuf, "%s", dir);
    char err[1024];
    model_file *m = NULL;
    ASSERT_OK(model_file_open(&m, dirbuf, err, sizeof err));
    const struct model_hparams *hp = model_file_hparams(m);
    ASSERT_EQ((int)MODEL_ARCH_LLAMA, (int)hp->arch);
    ASSERT_EQ(50257, hp->n_vocab);
    ASSERT_EQ(64, hp->dim);
    ASSERT_EQ(2, hp->n_layers);
    ASSERT_EQ(4, hp->n_heads);
    ASSERT_EQ(2, hp->n_kv_heads);
    ASSERT_EQ(16, hp->head_dim);
    ASSERT_EQ(176, hp->ffn_dim);
    ASSERT_EQ(256, hp->ctx_len);
    ASSERT_NEAR(1e-5, hp->rms_eps, 1e-12);
    ASSERT_EQ(10000.0f, hp->rope_theta); /* from rope_parameters */
    ASSERT_EQ(1, hp->rope_neox);
    ASSERT_EQ((int)ROPE_SCALING_NONE, (int)hp->rope_scaling);
    ASSERT_EQ(0, hp->tied_embeddings);
    ASSERT_EQ(50257, tokenizer_n_vocab(model_file_tokenizer(m)));
    ASSERT_EQ(0, tokenizer_adds_bos(model_file_tokenizer(m)));
    /* tensors by GGUF name, BF16, GGML order, from both shards */
    struct model_tensor t;
    ASSERT_OK(model_file_tensor(m, "token_embd.weight", &t));
    ASSERT_EQ((int)DTYPE_BF16, (int)t.type);
    ASSERT_EQ((int64_t)64, t.ne[0]);
    ASSERT_EQ((int64_t)50257, t.ne[1]);
    ASSERT_OK(model_file_tensor(m, "blk.0.ffn_down.weight", &t));
    ASSERT_EQ((int64_t)176, t.ne[0]);
    ASSERT_EQ((int64_t)64, t.ne[1]);
    ASSERT_OK(model_file_tensor(m, "blk.1.attn_k.weight", &t));
    ASSERT_EQ((int64_t)64, t.ne[0]);
    ASSERT_EQ((int64_t)32, t.ne[1]);
    ASSERT_OK(model_file_tensor(m, "blk.1.ffn_norm.weight", &t));
    ASSERT_EQ(1, t.n_dims);
    ASSERT_EQ((int)DTYPE_BF16, (int)t.type);
    ASSERT_OK(model_file_tensor(m, "output.weight", &t));
    ASSERT_EQ((int64_t)50257, t.ne[1]);
    /* the same bytes as lm_head.weight in the second shard, read directly */
    char shard[1200];
    snprintf(shard, sizeof shard, "%s/model-00002-of-00002.safetensors", dirbuf);
    safetensors_file *sf = NULL;
    ASSERT_OK(safetensors_open(&sf, shard, err, sizeof err));
    const struct safetensors_tensor *lm = safetensors_tensor_find(sf, "lm_head.weight");
    ASSERT_TRUE(lm != NULL);
    ASSERT_STREQ("BF16", lm->dtype_str);
    ASSERT_EQ(t.nbytes, lm->nbytes);
    ASSERT_TRUE(memcmp(t.data, lm->data, t.nbytes) == 0);
    /* BF16 values of a randomly initialised model: finite, not all zero */
    float row[64];
    double ss = 0;
    dtype_dequant_row(DTYPE_BF16, t.data, row, 64);
    for (int i = 0; i < 64; i++) {
        ASSERT_TRUE(isfinite(row[i]));
        ss += row[i] * row[i];
    }
    ASSERT_TRUE(ss > 0);
    safetensors_close(sf);
    model_file_close(m);
}

/* Rope frequencies against the formulas written out here. */
TEST(model_rope_frequencies) {
    struct model_hparams hp;
    memset(&hp, 0, sizeof hp);
    hp.head_dim = 128;
    hp.rope_theta = 500000.0f;
    float f[64];
    model_rope_inv_freq(&hp, f);
    for (int i = 0; i < 64; i++) ASSERT_NEAR(pow(500000.0, -(double)(2 * i) / 128), f[i], 1e-6 * f[i]);
    hp.rope_scaling = ROPE_SCALING_LINEAR;
    hp.rope_factor = 4;
    model_rope_inv_freq(&hp, f);
    for (int i = 0; i < 64; i++) ASSERT_NEAR(pow(500000.0, -(double)(2 * i) / 128) / 4, f[i], 1e-6 * f[i]);
    /* Llama 3.1: factor 8, low 1, high 4, original context 8192 */
    hp.rope_scaling = ROPE_SCALING_LLAMA3;
    hp.rope_factor = 8;
    hp.rope_low_freq_factor = 1;
    hp.rope_high_freq_factor = 4;
    hp.rope_orig_ctx = 8192;
    model_rope_inv_freq(&hp, f);
    int n_keep = 0, n_div = 0, n_mid = 0;
    for (int i = 0; i < 64; i++) {
        double base = pow(500000.0, -(double)(2 * i) / 128);
        double wl = 2 * M_PI / base, want;
        if (wl < 8192.0 / 4) {
            want = base;
            n_keep++;
        } else if (wl > 8192.0 / 1) {
            want = base / 8;
            n_div++;
        } else {
            double s = (8192.0 / wl - 1) / (4 - 1);
            want = (1 - s) * base / 8 + s * base;
            n_mid++;
            ASSERT_TRUE(f[i] < base && f[i] > base / 8);
        }
        ASSERT_NEAR(want, f[i], 1e-6 * want);
    }
    ASSERT_TRUE(n_keep > 0 && n_div > 0 && n_mid > 0); /* all three regimes were exercised */
    /* GGUF per-frequency divisors */
    float div[64];
    for (int i = 0; i < 64; i++) div[i] = 1.0f + (float)i / 8;
    memset(&hp, 0, sizeof hp);
    hp.head_dim = 128;
    hp.rope_theta = 10000.0f;
    hp.rope_freq_factors = div;
    model_rope_inv_freq(&hp, f);
    for (int i = 0; i < 64; i++) ASSERT_NEAR(pow(10000.0, -(double)(2 * i) / 128) / div[i], f[i], 1e-6 * f[i]);
}

/* A Hugging Face directory whose files are links to tiny-llama-hf's, except
 * config.json (written from `config`) and, optionally, the index. */
static const char *hf_variant(const char *name, const char *config, const char *index) {
    const char *src = test_model_path("tiny-llama-hf");
    char srcbuf[1024];
    snprintf(srcbuf, sizeof srcbuf, "%s", src);
    static char dir[512];
    snprintf(dir, sizeof dir, "%s", tmp_path(name));
    mkdir(dir, 0755);
    const char *files[] = {"model-00001-of-00002.safetensors", "model-00002-of-00002.safetensors", "tokenizer.json",
                           "generation_config.json", "model.safetensors.index.json", "config.json"};
    for (size_t i = 0; i < sizeof files / sizeof files[0]; i++) {
        char a[1200], b[1200];
        snprintf(a, sizeof a, "%s/%s", srcbuf, files[i]);
        snprintf(b, sizeof b, "%s/%s", dir, files[i]);
        unlink(b);
        if (strcmp(files[i], "config.json") == 0 && config) write_all(b, config, strlen(config));
        else if (strcmp(files[i], "model.safetensors.index.json") == 0 && index) write_all(b, index, strlen(index));
        else if (symlink(a, b) != 0) TEST_FAIL("symlink %s", b);
    }
    return dir;
}

/* tiny-llama-hf's config with one substitution made on its text. */
static char *config_with(const char *from, const char *to) {
    static char buf[8192];
    char path[1200];
    snprintf(path, sizeof path, "%s/config.json", test_model_path("tiny-llama-hf"));
    size_t n;
    uint8_t *text = (uint8_t *)test_read_file(path, &n);
    if (!text) TEST_FAIL("cannot read %s", path);
    text[n] = 0;
    char *p = strstr((char *)text, from);
    if (!p) TEST_FAIL("config.json lacks \"%s\"", from);
    snprintf(buf, sizeof buf, "%.*s%s%s", (int)(p - (char *)text), (char *)text, to, p + strlen(from));
    free(text);
    return buf;
}

TEST(model_hf_config_variants) {
    char err[1024];
    model_file *m = NULL;
    /* older style: rope_theta at the top, rope_scaling linear */
    const char *d = hf_variant("old-style", config_with("\"rope_parameters\": {\n    \"rope_theta\": 10000.0,\n    \"rope_type\": \"default\"\n  }",
                                                        "\"rope_theta\": 250000.0, \"rope_scaling\": {\"type\": \"linear\", \"factor\": 2.0}"), NULL);
    ASSERT_OK(model_file_open(&m, d, err, sizeof err));
    ASSERT_EQ(250000.0f, model_file_hparams(m)->rope_theta);
    ASSERT_EQ((int)ROPE_SCALING_LINEAR, (int)model_file_hparams(m)->rope_scaling);
    ASSERT_EQ(2.0f, model_file_hparams(m)->rope_factor);
    model_file_close(m);
    /* transformers 5 style with llama3 scaling */
    d = hf_variant("llama3", config_with("\"rope_type\": \"default\"",
                                         "\"rope_type\": \"llama3\", \"factor\": 8.0, \"low_freq_factor\": 1.0, "
                                         "\"high_freq_factor\": 4.0, \"original_max_position_embeddings\": 128"), NULL);
    ASSERT_OK(model_file_open(&m, d, err, sizeof err));
    const struct model_hparams *hp = model_file_hparams(m);
    ASSERT_EQ((int)ROPE_SCALING_LLAMA3, (int)hp->rope_scaling);
    ASSERT_EQ(8.0f, hp->rope_factor);
    ASSERT_EQ(1.0f, hp->rope_low_freq_factor);
    ASSERT_EQ(4.0f, hp->rope_high_freq_factor);
    ASSERT_EQ(128, hp->rope_orig_ctx);
    model_file_close(m);
    /* tied embeddings: lm_head is not used */
    d = hf_variant("tied", config_with("\"tie_word_embeddings\": false", "\"tie_word_embeddings\": true"), NULL);
    ASSERT_OK(model_file_open(&m, d, err, sizeof err));
    ASSERT_EQ(1, model_file_hparams(m)->tied_embeddings);
    struct model_tensor t;
    ASSERT_EQ((int)STATUS_NOT_FOUND, model_file_tensor(m, "output.weight", &t));
    model_file_close(m);

    d = hf_variant("yarn", config_with("\"rope_type\": \"default\"", "\"rope_type\": \"yarn\", \"factor\": 4.0"), NULL);
    expect_refused(d, STATUS_UNSUPPORTED, "rope scaling \"yarn\" is not supported", NULL);
    d = hf_variant("neox", config_with("\"model_type\": \"llama\"", "\"model_type\": \"gpt_neox\""), NULL);
    expect_refused(d, STATUS_UNSUPPORTED, "model_type \"gpt_neox\"", NULL);
    d = hf_variant("nohidden", config_with("\"hidden_size\": 64,", ""), NULL);
    expect_refused(d, STATUS_BAD_INPUT, "config.json: hidden_size: missing", NULL);
    d = hf_variant("badjson", config_with("\"hidden_size\": 64,", "\"hidden_size\": 64,,"), NULL);
    expect_refused(d, STATUS_BAD_INPUT, "config.json: not a JSON object", NULL);
    d = hf_variant("heads", config_with("\"num_key_value_heads\": 2", "\"num_key_value_heads\": 3"), NULL);
    expect_refused(d, STATUS_BAD_INPUT, "n_heads 4 is not a multiple of n_kv_heads 3", NULL);
}

TEST(model_hf_damaged_copies_refused) {
    /* a tensor the config needs but no shard has */
    const char *d = hf_variant("layers3", config_with("\"num_hidden_layers\": 2", "\"num_hidden_layers\": 3"), NULL);
    expect_refused(d, STATUS_NOT_FOUND, "tensor blk.2.attn_norm.weight: missing", NULL);
    /* tensors beyond the block count */
    d = hf_variant("layers1", config_with("\"num_hidden_layers\": 2", "\"num_hidden_layers\": 1"), NULL);
    expect_refused(d, STATUS_BAD_INPUT, "tensor blk.1.attn_q.weight: present, but the block count is 1", NULL);
    /* a wrong shape */
    d = hf_variant("ffn", config_with("\"intermediate_size\": 176", "\"intermediate_size\": 177"), NULL);
    expect_refused(d, STATUS_BAD_INPUT, "tensor blk.0.ffn_gate.weight: shape [64, 176]", "want [64, 177]");
    /* the index names a shard that does not exist, or the wrong shard */
    d = hf_variant("noshard", NULL, "{\"weight_map\": {\"lm_head.weight\": \"model-00003-of-00002.safetensors\"}}");
    expect_refused(d, STATUS_NOT_FOUND, "model-00003-of-00002.safetensors: cannot open", NULL);
    d = hf_variant("wrongshard", NULL, "{\"weight_map\": {\"lm_head.weight\": \"model-00001-of-00002.safetensors\"}}");
    expect_refused(d, STATUS_BAD_INPUT, "tensor lm_head.weight: listed in model.safetensors.index.json under model-00001-of-00002.safetensors but absent", NULL);
    d = hf_variant("escape", NULL, "{\"weight_map\": {\"lm_head.weight\": \"../x.safetensors\"}}");
    expect_refused(d, STATUS_BAD_INPUT, "is not a file in the directory", NULL);
    /* a truncated shard, and a shard with a damaged header */
    char src[1200], dst[1200];
    snprintf(src, sizeof src, "%s/tiny-llama-hf/model-00002-of-00002.safetensors", test_models_dir());
    size_t n;
    uint8_t *bytes = (uint8_t *)test_read_file(src, &n);
    ASSERT_TRUE(bytes != NULL);
    d = hf_variant("truncated", NULL, NULL);
    snprintf(dst, sizeof dst, "%s/model-00002-of-00002.safetensors", d);
    unlink(dst);
    write_all(dst, bytes, n - 1000);
    expect_refused(d, STATUS_BAD_INPUT, "model-00002-of-00002.safetensors: tensor lm_head.weight: data", "past the end");
    write_all(dst, bytes, 5);
    expect_refused(d, STATUS_BAD_INPUT, "model-00002-of-00002.safetensors: header", "too short");
    uint64_t hlen;
    memcpy(&hlen, bytes, 8);
    bytes[8 + hlen / 2] = '}';
    write_all(dst, bytes, n);
    expect_refused(d, STATUS_BAD_INPUT, "model-00002-of-00002.safetensors: header: not a JSON object", NULL);
    free(bytes);
    /* a header whose offsets disagree with the dtype and shape */
    const char *hdr = "{\"lm_head.weight\":{\"dtype\":\"BF16\",\"shape\":[4,4],\"data_offsets\":[0,30]}}";
    uint8_t buf[256];
    uint64_t hl = strlen(hdr);
    memcpy(buf, &hl, 8);
    memcpy(buf + 8, hdr, hl);
    memset(buf + 8 + hl, 0, 32);
    write_all(dst, buf, 8 + hl + 32);
    expect_refused(d, STATUS_BAD_INPUT, "tensor lm_head.weight: data_offsets [0, 30) hold 30 bytes", "need 32");
    hdr = "{\"lm_head.weight\":{\"dtype\":\"F64\",\"shape\":[2,2],\"data_offsets\":[0,32]}}";
    hl = strlen(hdr);
    memcpy(buf, &hl, 8);
    memcpy(buf + 8, hdr, hl);
    memset(buf + 8 + hl, 0, 32);
    write_all(dst, buf, 8 + hl + 32);
    expect_refused(d, STATUS_UNSUPPORTED, "tensor lm_head.weight: dtype F64 is not supported", NULL);
    hdr = "{\"lm_head.weight\":{\"dtype\":\"F32\",\"shape\":[2,4],\"data_offsets\":[0,32]}}";
    hl = strlen(hdr); /* 8 + hl is not a multiple of 4 */
    ASSERT_TRUE((8 + hl) % 4 != 0);
    memcpy(buf, &hl, 8);
    memcpy(buf + 8, hdr, hl);
    memset(buf + 8 + hl, 0, 32);
    write_all(dst, buf, 8 + hl + 32);
    expect_refused(d, STATUS_UNSUPPORTED, "tensor lm_head.weight: data at file offset", "not aligned");
}

/* Copies a GGUF file key by key and tensor by tensor through the writer,
 * leaving out skip_key / skip_tensor and giving reshape_tensor swapped ne[0]
 * and ne[1]. */
static void gguf_copy(const char *src, const char *dst, const char *skip_key, const char *skip_tensor, const char *reshape_tensor) {
    char err[1024];
    gguf_file *f = NULL;
    ASSERT_OK(gguf_open(&f, src, err, sizeof err));
    gguf_writer *w = gguf_writer_init();
    for (int64_t k = 0; k < gguf_n_keys(f); k++) {
        struct gguf_str kn = gguf_key_name(f, k);
        char key[256];
        snprintf(key, sizeof key, "%.*s", (int)kn.len, kn.ptr);
        if (skip_key && strcmp(key, skip_key) == 0) continue;
        enum gguf_vtype t = gguf_key_type(f, k);
        if (t == GGUF_TYPE_STRING) {
            struct gguf_str s;
            gguf_get_str(f, key, &s);
            char *v = strndup(s.ptr, s.len);
            gguf_writer_set_str(w, key, v);
            free(v);
        } else if (t == GGUF_TYPE_ARRAY) {
            enum gguf_vtype et;
            uint64_t n;
            gguf_get_arr(f, key, &et, &n);
            if (et == GGUF_TYPE_STRING) {
                char **v = calloc(n, sizeof *v);
                for (uint64_t i = 0; i < n; i++) {
                    struct gguf_str s;
                    gguf_arr_str(f, key, i, &s);
                    v[i] = strndup(s.ptr, s.len);
                }
                gguf_writer_set_arr_str(w, key, (const char *const *)v, n);
                for (uint64_t i = 0; i < n; i++) free(v[i]);
                free(v);
            } else {
                gguf_writer_set_arr(w, key, et, gguf_arr_data(f, key, &et, &n), n);
            }
        } else if (t == GGUF_TYPE_FLOAT32) {
            float v;
            gguf_get_f32(f, key, &v);
            gguf_writer_set_f32(w, key, v);
        } else if (t == GGUF_TYPE_UINT32) {
            uint32_t v;
            gguf_get_u32(f, key, &v);
            gguf_writer_set_u32(w, key, v);
        } else {
            TEST_FAIL("gguf_copy: key %s has type %d, not handled here", key, (int)t);
        }
    }
    for (int64_t i = 0; i < gguf_n_tensors(f); i++) {
        const struct gguf_tensor *t = gguf_tensor_at(f, i);
        char name[256];
        snprintf(name, sizeof name, "%.*s", (int)t->name.len, t->name.ptr);
        if (skip_tensor && strcmp(name, skip_tensor) == 0) continue;
        int64_t ne[4] = {t->ne[0], t->ne[1], t->ne[2], t->ne[3]};
        if (reshape_tensor && strcmp(name, reshape_tensor) == 0) {
            ne[0] = t->ne[1];
            ne[1] = t->ne[0];
        }
        gguf_writer_add_tensor(w, name, t->type, t->n_dims, ne, t->data);
    }
    ASSERT_OK(gguf_writer_write(w, dst, err, sizeof err));
    gguf_writer_free(w);
    gguf_close(f);
}

TEST(model_gguf_damaged_copies_refused) {
    char src[1200], dst[600];
    snprintf(src, sizeof src, "%s", test_model_path("stories260K-f32.gguf"));
    snprintf(dst, sizeof dst, "%s", tmp_path("copy.gguf"));
    /* an unchanged copy loads: the writer round-trips a real model */
    gguf_copy(src, dst, NULL, NULL, NULL);
    char err[1024];
    model_file *m = NULL;
    ASSERT_OK(model_file_open(&m, dst, err, sizeof err));
    ASSERT_EQ(5, model_file_hparams(m)->n_layers);
    ASSERT_EQ(512, tokenizer_n_vocab(model_file_tokenizer(m)));
    model_file_close(m);

    gguf_copy(src, dst, NULL, "blk.2.ffn_up.weight", NULL);
    expect_refused(dst, STATUS_NOT_FOUND, "copy.gguf: tensor blk.2.ffn_up.weight: missing", NULL);
    gguf_copy(src, dst, NULL, "blk.2.ffn_norm.weight", NULL);
    expect_refused(dst, STATUS_NOT_FOUND, "tensor blk.2.ffn_norm.weight: missing", NULL);
    gguf_copy(src, dst, NULL, "token_embd.weight", NULL);
    expect_refused(dst, STATUS_NOT_FOUND, "tensor token_embd.weight: missing", NULL);
    gguf_copy(src, dst, NULL, NULL, "blk.1.attn_k.weight");
    expect_refused(dst, STATUS_BAD_INPUT, "tensor blk.1.attn_k.weight: shape [32, 64]", "want [64, 32]");
    gguf_copy(src, dst, "llama.block_count", NULL, NULL);
    expect_refused(dst, STATUS_BAD_INPUT, "key llama.block_count: missing", NULL);
    gguf_copy(src, dst, "llama.embedding_length", NULL, NULL);
    expect_refused(dst, STATUS_BAD_INPUT, "key llama.embedding_length: missing", NULL);
    gguf_copy(src, dst, "general.architecture", NULL, NULL);
    expect_refused(dst, STATUS_BAD_INPUT, "key general.architecture", NULL);
    /* output.weight absent: tied embeddings */
    gguf_copy(src, dst, NULL, "output.weight", NULL);
    ASSERT_OK(model_file_open(&m, dst, err, sizeof err));
    ASSERT_EQ(1, model_file_hparams(m)->tied_embeddings);
    model_file_close(m);

    /* truncated copies of a real file, at several places */
    size_t n;
    uint8_t *bytes = (uint8_t *)test_read_file(src, &n);
    ASSERT_TRUE(bytes != NULL);
    size_t cuts[] = {0, 3, 20, 100, 5000, 14000, n / 2, n - 1};
    for (size_t i = 0; i < sizeof cuts / sizeof cuts[0]; i++) {
        write_all(dst, bytes, cuts[i]);
        expect_refused(dst, 0, "copy.gguf", NULL);
    }
    write_all(dst, bytes, n / 2);
    expect_refused(dst, STATUS_BAD_INPUT, "past the end of the file", NULL);
    write_all(dst, bytes, 5000);
    expect_refused(dst, STATUS_BAD_INPUT, "truncated at byte", NULL);
    free(bytes);
    unlink(dst);
}

/* Random byte changes in the metadata and tensor infos of a real model:
 * model_file_open (tokenizer included) refuses or loads, never crashes;
 * what loads has tensors inside the file (run under ASan for the strict
 * form of that check). */
TEST(model_mutated_metadata_safe) {
    char src[1200], dst[600];
    snprintf(src, sizeof src, "%s", test_model_path("stories260K-q8_0.gguf"));
    snprintf(dst, sizeof dst, "%s", tmp_path("mut.gguf"));
    size_t n;
    uint8_t *bytes = (uint8_t *)test_read_file(src, &n);
    ASSERT_TRUE(bytes != NULL);
    uint8_t *m = malloc(n);
    ASSERT_TRUE(m != NULL);
    char err[1024];
    gguf_file *g = NULL;
    ASSERT_OK(gguf_open(&g, src, err, sizeof err));
    size_t meta = (size_t)gguf_data_offset(g);
    gguf_close(g);
    uint64_t rs = 777;
    int loaded = 0, refused = 0;
    for (int it = 0; it < 1500; it++) {
        memcpy(m, bytes, n);
        for (int k = 0; k < 1 + it % 3; k++) {
            rs = rs * 6364136223846793005ull + 1442695040888963407ull;
            size_t pos = (size_t)((rs >> 33) % meta);
            m[pos] = it % 2 ? (uint8_t)(rs >> 24) : (uint8_t)(m[pos] ^ (1u << ((rs >> 24) & 7)));
        }
        write_all(dst, m, n);
        model_file *mf = NULL;
        if (model_file_open(&mf, dst, err, sizeof err) != 0) {
            ASSERT_TRUE(mf == NULL);
            ASSERT_TRUE(strstr(err, "mut.gguf") != NULL);
            refused++;
            continue;
        }
        loaded++;
        const struct model_hparams *hp = model_file_hparams(mf);
        struct model_tensor t;
        char name[64];
        volatile float sink = 0;
        for (int32_t l = 0; l < hp->n_layers; l++) {
            snprintf(name, sizeof name, "blk.%d.ffn_down.weight", l);
            ASSERT_OK(model_file_tensor(mf, name, &t));
            sink += ((const uint8_t *)t.data)[t.nbytes - 1];
        }
        int32_t ids[64];
        tokenizer_encode(model_file_tokenizer(mf), "Once upon a time", 16, 1, 0, ids, 64);
        (void)sink;
        model_file_close(mf);
    }
    printf("  %d mutants loaded, %d refused\n", loaded, refused);
    ASSERT_TRUE(refused > 0);
    free(bytes);
    free(m);
    unlink(dst);
}

/* Random byte changes in a safetensors header: opened or refused, never a
 * crash or a read outside the file. */
TEST(model_safetensors_mutations_safe) {
    /* a small file with tensors of several dtypes and ranks */
    static const char hdr[] =
        "{\"__metadata__\":{\"format\":\"pt\"},"
        "\"a.weight\":{\"dtype\":\"F32\",\"shape\":[4,8],\"data_offsets\":[0,128]},"
        "\"b\":{\"dtype\":\"BF16\",\"shape\":[16],\"data_offsets\":[128,160]},"
        "\"c\":{\"dtype\":\"F16\",\"shape\":[2,2,2],\"data_offsets\":[160,176]},"
        "\"d\":{\"dtype\":\"I64\",\"shape\":[3],\"data_offsets\":[176,200]}}";
    size_t hl = sizeof hdr - 1, padded = (hl + 7) / 8 * 8;
    size_t n = 8 + padded + 200, head = 8 + padded;
    uint8_t *bytes = calloc(1, n);
    ASSERT_TRUE(bytes != NULL);
    uint64_t hlen = padded;
    memcpy(bytes, &hlen, 8);
    memset(bytes + 8, ' ', padded);
    memcpy(bytes + 8, hdr, hl);
    for (size_t i = head; i < n; i++) bytes[i] = (uint8_t)i;
    uint8_t *m = malloc(n);
    ASSERT_TRUE(m != NULL);
    char dst[600], err[1024];
    snprintf(dst, sizeof dst, "%s", tmp_path("mut.safetensors"));
    write_all(dst, bytes, n);
    safetensors_file *f0 = NULL;
    ASSERT_OK(safetensors_open(&f0, dst, err, sizeof err));
    ASSERT_EQ((int64_t)4, safetensors_n_tensors(f0));
    const struct safetensors_tensor *ta = safetensors_tensor_find(f0, "a.weight");
    ASSERT_TRUE(ta && ta->supported && ta->type == DTYPE_F32 && ta->ne[0] == 8 && ta->ne[1] == 4);
    ASSERT_EQ(3, safetensors_tensor_find(f0, "c")->n_dims);
    ASSERT_EQ(0, safetensors_tensor_find(f0, "d")->supported);
    safetensors_close(f0);
    uint64_t rs = 99;
    int opened = 0, refused = 0;
    static const char alphabet[] = "0123456789[]{},:\"eE.-+ BF16F32";
    for (int it = 0; it < 3000; it++) {
        memcpy(m, bytes, n);
        for (int k = 0; k < 1 + it % 3; k++) {
            rs = rs * 6364136223846793005ull + 1442695040888963407ull;
            size_t pos = (size_t)((rs >> 33) % head);
            /* JSON-ish bytes make mutants that still parse, and so reach the range checks */
            m[pos] = it % 2 ? (uint8_t)alphabet[(rs >> 20) % (sizeof alphabet - 1)] : (uint8_t)(rs >> 24);
        }
        write_all(dst, m, n);
        safetensors_file *f = NULL;
        if (safetensors_open(&f, dst, err, sizeof err) != 0) {
            ASSERT_TRUE(f == NULL);
            ASSERT_TRUE(strstr(err, "mut.safetensors") != NULL);
            refused++;
            continue;
        }
        opened++;
        volatile uint8_t sink = 0;
        for (int64_t i = 0; i < safetensors_n_tensors(f); i++) {
            const struct safetensors_tensor *t = safetensors_tensor_at(f, i);
            if (t->nbytes) sink ^= ((const uint8_t *)t->data)[0] ^ ((const uint8_t *)t->data)[t->nbytes - 1];
        }
        (void)sink;
        safetensors_close(f);
    }
    printf("  %d mutants opened, %d refused\n", opened, refused);
    ASSERT_TRUE(refused > 0 && opened > 0);
    free(bytes);
    free(m);
    unlink(dst);
}

static void rm_tree(const char *dir) {
    char cmd[600];
    snprintf(cmd, sizeof cmd, "rm -rf '%s'", dir);
    if (system(cmd) != 0) printf("  could not remove %s\n", dir);
}

TEST(model_cleanup) {
    if (tmpdir[0]) rm_tree(tmpdir);
}

TEST_MAIN(model_stories260k, model_synth256_quantizations, model_tiny_llama_hf, model_rope_frequencies,
          model_hf_config_variants, model_hf_damaged_copies_refused, model_gguf_damaged_copies_refused,
          model_mutated_metadata_safe, model_safetensors_mutations_safe, model_cleanup)
