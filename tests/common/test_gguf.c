/* Tests for common/gguf: the real stories260K file, writer/reader round
 * trips of every value type (and the streaming writer), hand-built files
 * with nested arrays and specific faults, every truncation of a small file,
 * and thousands of random byte flips in the header and metadata. */
#include "common/gguf.h"
#include "common/status.h"
#include "tests/test.h"

#include <sys/stat.h>
#include <unistd.h>

static char tmpdir[256];

static const char *tmp_path(const char *name) {
    static char path[512];
    if (!tmpdir[0]) {
        /* tmpfs when there is one: the mutation tests write thousands of files */
        struct stat st;
        const char *base = stat("/dev/shm", &st) == 0 && S_ISDIR(st.st_mode) && access("/dev/shm", W_OK) == 0 ? "/dev/shm" : "/tmp";
        snprintf(tmpdir, sizeof tmpdir, "%s/test_gguf.XXXXXX", base);
        if (!mkdtemp(tmpdir)) TEST_FAIL("mkdtemp failed");
    }
    snprintf(path, sizeof path, "%s/%s", tmpdir, name);
    return path;
}

static void write_bytes(const char *path, const void *p, size_t n) {
    FILE *fp = fopen(path, "wb");
    if (!fp) TEST_FAIL("cannot create %s", path);
    if (n && fwrite(p, 1, n, fp) != n) TEST_FAIL("cannot write %s", path);
    fclose(fp);
}


/* A hand encoder for GGUF bytes, written from the format description and
 * independent of the writer under test. */
struct hb {
    uint8_t p[8192];
    size_t n;
};
static void hb_put(struct hb *b, const void *s, size_t n) {
    memcpy(b->p + b->n, s, n);
    b->n += n;
}
static void hb_u32(struct hb *b, uint32_t v) { hb_put(b, &v, 4); }
static void hb_u64(struct hb *b, uint64_t v) { hb_put(b, &v, 8); }
static void hb_str(struct hb *b, const char *s) {
    hb_u64(b, strlen(s));
    hb_put(b, s, strlen(s));
}
static void hb_head(struct hb *b, uint32_t version, uint64_t nt, uint64_t nkv) {
    hb_put(b, "GGUF", 4);
    hb_u32(b, version);
    hb_u64(b, nt);
    hb_u64(b, nkv);
}
static void hb_pad(struct hb *b, size_t a) {
    while (b->n % a) b->p[b->n++] = 0;
}

static int open_err(const char *path, char *err, size_t errlen) {
    gguf_file *f = NULL;
    int st = gguf_open(&f, path, err, errlen);
    if (st == 0) gguf_close(f);
    return st;
}

TEST(gguf_reads_stories260k) {
    char err[512];
    gguf_file *f = NULL;
    ASSERT_OK(gguf_open(&f, test_model_path("stories260K-f32.gguf"), err, sizeof err));
    ASSERT_EQ(3u, gguf_version(f));
    ASSERT_EQ(32u, gguf_alignment(f));
    ASSERT_EQ((int64_t)48, gguf_n_tensors(f)); /* 5 layers x 9 + embd, norm, output */
    struct gguf_str s;
    ASSERT_OK(gguf_get_str(f, "general.architecture", &s));
    ASSERT_TRUE(gguf_str_eq(s, "llama"));
    ASSERT_OK(gguf_get_str(f, "tokenizer.ggml.model", &s));
    ASSERT_TRUE(gguf_str_eq(s, "llama"));
    uint32_t u;
    ASSERT_OK(gguf_get_u32(f, "llama.embedding_length", &u));
    ASSERT_EQ(64u, u);
    ASSERT_OK(gguf_get_u32(f, "llama.block_count", &u));
    ASSERT_EQ(5u, u);
    ASSERT_OK(gguf_get_u32(f, "llama.attention.head_count_kv", &u));
    ASSERT_EQ(4u, u);
    ASSERT_OK(gguf_get_u32(f, "llama.feed_forward_length", &u));
    ASSERT_EQ(172u, u);
    ASSERT_OK(gguf_get_u32(f, "llama.context_length", &u));
    ASSERT_EQ(128u, u);
    ASSERT_OK(gguf_get_u32(f, "tokenizer.ggml.padding_token_id", &u));
    ASSERT_EQ(0xffffffffu, u);
    int64_t i64;
    ASSERT_OK(gguf_get_i64(f, "tokenizer.ggml.bos_token_id", &i64));
    ASSERT_EQ((int64_t)1, i64);
    float eps;
    ASSERT_OK(gguf_get_f32(f, "llama.attention.layer_norm_rms_epsilon", &eps));
    ASSERT_NEAR(1e-5, eps, 1e-12);
    /* u32 -> float converts; float -> u32 does not, and says why */
    float fu;
    ASSERT_OK(gguf_get_f32(f, "llama.block_count", &fu));
    ASSERT_EQ(5.0f, fu);
    ASSERT_EQ((int)STATUS_BAD_INPUT, gguf_get_u32(f, "llama.attention.layer_norm_rms_epsilon", &u));
    ASSERT_TRUE(strstr(gguf_errstr(f), "key llama.attention.layer_norm_rms_epsilon") != NULL);
    ASSERT_EQ((int)STATUS_NOT_FOUND, gguf_get_u32(f, "llama.rope.freq_base", &u));
    ASSERT_EQ((int)STATUS_BAD_INPUT, gguf_get_str(f, "llama.block_count", &s));
    /* the vocabulary */
    enum gguf_vtype et;
    uint64_t n;
    ASSERT_OK(gguf_get_arr(f, "tokenizer.ggml.tokens", &et, &n));
    ASSERT_EQ((int)GGUF_TYPE_STRING, (int)et);
    ASSERT_EQ((uint64_t)512, n);
    ASSERT_OK(gguf_arr_str(f, "tokenizer.ggml.tokens", 1, &s));
    ASSERT_TRUE(gguf_str_eq(s, "<s>"));
    ASSERT_OK(gguf_arr_str(f, "tokenizer.ggml.tokens", 3, &s));
    ASSERT_TRUE(gguf_str_eq(s, "<0x00>"));
    ASSERT_OK(gguf_arr_str(f, "tokenizer.ggml.tokens", 258, &s));
    ASSERT_TRUE(gguf_str_eq(s, "<0xFF>"));
    ASSERT_EQ((int)STATUS_BAD_INPUT, gguf_arr_str(f, "tokenizer.ggml.tokens", 512, &s));
    float sc;
    ASSERT_OK(gguf_arr_f32(f, "tokenizer.ggml.scores", 300, &sc));
    ASSERT_EQ(-41.0f, sc); /* scores are -(id - 259) */
    ASSERT_EQ((int)STATUS_BAD_INPUT, gguf_arr_f32(f, "tokenizer.ggml.tokens", 0, &sc));
    ASSERT_OK(gguf_arr_i64(f, "tokenizer.ggml.token_type", 3, &i64));
    ASSERT_EQ((int64_t)6, i64); /* byte tokens have type 6 */
    const float *scores_raw = gguf_arr_data(f, "tokenizer.ggml.scores", &et, &n);
    ASSERT_TRUE(scores_raw != NULL);
    ASSERT_EQ((int)GGUF_TYPE_FLOAT32, (int)et);
    /* tensors */
    const struct gguf_tensor *t = gguf_tensor_find(f, "blk.0.ffn_down.weight");
    ASSERT_TRUE(t != NULL);
    ASSERT_EQ((int)DTYPE_F32, (int)t->type);
    ASSERT_EQ(2, t->n_dims);
    ASSERT_EQ((int64_t)172, t->ne[0]);
    ASSERT_EQ((int64_t)64, t->ne[1]);
    ASSERT_EQ((size_t)(172 * 64 * 4), t->nbytes);
    t = gguf_tensor_find(f, "blk.4.attn_k.weight");
    ASSERT_TRUE(t != NULL);
    ASSERT_EQ((int64_t)64, t->ne[0]);
    ASSERT_EQ((int64_t)32, t->ne[1]);
    t = gguf_tensor_find(f, "output_norm.weight");
    ASSERT_TRUE(t != NULL);
    ASSERT_EQ(1, t->n_dims);
    ASSERT_EQ(1.0f, 1.0f);
    ASSERT_TRUE(gguf_tensor_find(f, "blk.5.attn_q.weight") == NULL);
    /* every tensor lies in the data section, aligned */
    for (int64_t i = 0; i < gguf_n_tensors(f); i++) {
        t = gguf_tensor_at(f, i);
        const uint8_t *base = (const uint8_t *)gguf_tensor_at(f, 0)->data - 0;
        (void)base;
        ASSERT_TRUE(((uintptr_t)t->data - (uintptr_t)gguf_tensor_find(f, "token_embd.weight")->data) % 32 == 0);
    }
    gguf_close(f);

    /* the quantized files open too, with their types */
    ASSERT_OK(gguf_open(&f, test_model_path("stories260K-q4_0.gguf"), err, sizeof err));
    ASSERT_EQ((int)DTYPE_Q8_0, (int)gguf_tensor_find(f, "output.weight")->type);
    ASSERT_EQ((int)DTYPE_F16, (int)gguf_tensor_find(f, "blk.0.ffn_down.weight")->type);
    ASSERT_EQ((int)DTYPE_Q4_0, (int)gguf_tensor_find(f, "blk.0.ffn_up.weight")->type);
    gguf_close(f);
    /* a vocab-only file: no tensors */
    ASSERT_OK(gguf_open(&f, test_model_path("vocab/ggml-vocab-gpt-2.gguf"), err, sizeof err));
    ASSERT_EQ((int64_t)0, gguf_n_tensors(f));
    ASSERT_OK(gguf_get_arr(f, "tokenizer.ggml.merges", &et, &n));
    ASSERT_EQ((int)GGUF_TYPE_STRING, (int)et);
    gguf_close(f);
}

/* Writes a file with one key of every type and tensors of several types. */
static void write_all_types(const char *path, int streaming) {
    char err[512];
    gguf_writer *w = gguf_writer_init();
    ASSERT_TRUE(w != NULL);
    gguf_writer_set_str(w, "general.architecture", "llama");
    gguf_writer_set_u8(w, "t.u8", 200);
    gguf_writer_set_i8(w, "t.i8", -100);
    gguf_writer_set_u16(w, "t.u16", 60000);
    gguf_writer_set_i16(w, "t.i16", -30000);
    gguf_writer_set_u32(w, "t.u32", 4000000000u);
    gguf_writer_set_i32(w, "t.i32", -2000000000);
    gguf_writer_set_u64(w, "t.u64", 18000000000000000000ull);
    gguf_writer_set_i64(w, "t.i64", -9000000000000000000ll);
    gguf_writer_set_f32(w, "t.f32", 3.25f);
    gguf_writer_set_f64(w, "t.f64", -1.0e300);
    gguf_writer_set_bool(w, "t.bool", 1);
    gguf_writer_set_str(w, "t.str", "h\xc3\xa9llo");
    gguf_writer_set_str(w, "t.empty", "");
    gguf_writer_set_u32(w, "t.replaced", 1);
    gguf_writer_set_u32(w, "t.replaced", 2);
    const char *strs[] = {"a", "", "\xe2\x96\x81the", "<0x0A>"};
    gguf_writer_set_arr_str(w, "t.arr_str", strs, 4);
    const float fa[] = {1.5f, -2.0f, 0.0f};
    gguf_writer_set_arr_f32(w, "t.arr_f32", fa, 3);
    const int32_t ia[] = {-1, 7, 2147483647};
    gguf_writer_set_arr_i32(w, "t.arr_i32", ia, 3);
    const uint8_t ba[] = {1, 0, 1};
    gguf_writer_set_arr(w, "t.arr_bool", GGUF_TYPE_BOOL, ba, 3);
    const uint64_t ua[] = {0, 1ull << 40};
    gguf_writer_set_arr(w, "t.arr_u64", GGUF_TYPE_UINT64, ua, 2);
    const double da[] = {0.5};
    gguf_writer_set_arr(w, "t.arr_f64", GGUF_TYPE_FLOAT64, da, 1);
    gguf_writer_set_arr(w, "t.arr_empty", GGUF_TYPE_INT16, NULL, 0);

    static float f32[64 * 3];
    static uint8_t q8[2 * 3 * 34], f16[64 * 2];
    for (int i = 0; i < 64 * 3; i++) f32[i] = (float)i * 0.25f - 7;
    for (int r = 0; r < 3; r++) dtype_quant_row(DTYPE_Q8_0, f32 + 64 * r, q8 + r * 68, 64);
    dtype_quant_row(DTYPE_F16, f32, f16, 64);
    int64_t ne_a[2] = {64, 3}, ne_b[1] = {64}, ne_c[3] = {32, 1, 3};
    if (!streaming) {
        gguf_writer_add_tensor(w, "a.weight", DTYPE_F32, 2, ne_a, f32);
        gguf_writer_add_tensor(w, "b.weight", DTYPE_F16, 1, ne_b, f16);
        gguf_writer_add_tensor(w, "c.weight", DTYPE_Q8_0, 3, ne_c, q8);
        ASSERT_OK(gguf_writer_write(w, path, err, sizeof err));
    } else {
        gguf_writer_add_tensor_info(w, "a.weight", DTYPE_F32, 2, ne_a);
        gguf_writer_add_tensor_info(w, "b.weight", DTYPE_F16, 1, ne_b);
        gguf_writer_add_tensor_info(w, "c.weight", DTYPE_Q8_0, 3, ne_c);
        ASSERT_OK(gguf_writer_begin(w, path, err, sizeof err));
        /* out of order is refused and changes nothing */
        ASSERT_EQ((int)STATUS_BAD_INPUT, gguf_writer_stream_tensor(w, "b.weight", f16, 128, 1, err, sizeof err));
        ASSERT_TRUE(strstr(err, "out of order") != NULL);
        ASSERT_OK(gguf_writer_stream_tensor(w, "a.weight", f32, 100, 0, err, sizeof err));
        ASSERT_OK(gguf_writer_stream_tensor(w, "a.weight", (uint8_t *)f32 + 100, sizeof f32 - 100, 1, err, sizeof err));
        ASSERT_EQ((int)STATUS_BAD_INPUT, gguf_writer_stream_tensor(w, "b.weight", f16, 129, 1, err, sizeof err));
        ASSERT_OK(gguf_writer_stream_tensor(w, "b.weight", f16, 128, 1, err, sizeof err));
        ASSERT_OK(gguf_writer_stream_tensor(w, "c.weight", q8, 3 * 34, 1, err, sizeof err));
        ASSERT_OK(gguf_writer_finish(w, err, sizeof err));
    }
    gguf_writer_free(w);
}

static void check_all_types(const char *path) {
    char err[512];
    gguf_file *f = NULL;
    ASSERT_OK(gguf_open(&f, path, err, sizeof err));
    ASSERT_EQ(3u, gguf_version(f));
    ASSERT_EQ((int64_t)22, gguf_n_keys(f));
    uint32_t u;
    int64_t i;
    float x;
    int b;
    struct gguf_str s;
    ASSERT_OK(gguf_get_u32(f, "t.u8", &u));
    ASSERT_EQ(200u, u);
    ASSERT_EQ((int)GGUF_TYPE_UINT8, (int)gguf_key_type(f, gguf_find_key(f, "t.u8")));
    ASSERT_OK(gguf_get_i64(f, "t.i8", &i));
    ASSERT_EQ((int64_t)-100, i);
    ASSERT_EQ((int)STATUS_BAD_INPUT, gguf_get_u32(f, "t.i8", &u)); /* negative does not fit */
    ASSERT_OK(gguf_get_u32(f, "t.u16", &u));
    ASSERT_EQ(60000u, u);
    ASSERT_OK(gguf_get_i64(f, "t.i16", &i));
    ASSERT_EQ((int64_t)-30000, i);
    ASSERT_OK(gguf_get_u32(f, "t.u32", &u));
    ASSERT_EQ(4000000000u, u);
    ASSERT_OK(gguf_get_i64(f, "t.i32", &i));
    ASSERT_EQ((int64_t)-2000000000, i);
    ASSERT_EQ((int)STATUS_BAD_INPUT, gguf_get_i64(f, "t.u64", &i)); /* above INT64_MAX */
    ASSERT_TRUE(strstr(gguf_errstr(f), "t.u64") != NULL);
    ASSERT_EQ((int)STATUS_BAD_INPUT, gguf_get_u32(f, "t.u64", &u));
    ASSERT_OK(gguf_get_f32(f, "t.u64", &x));
    ASSERT_NEAR(1.8e19, x, 1e13);
    ASSERT_OK(gguf_get_i64(f, "t.i64", &i));
    ASSERT_EQ((int64_t)-9000000000000000000ll, i);
    ASSERT_OK(gguf_get_f32(f, "t.f32", &x));
    ASSERT_EQ(3.25f, x);
    ASSERT_OK(gguf_get_f32(f, "t.f64", &x));
    ASSERT_TRUE(isinf(x) && x < 0); /* -1e300 does not fit a float */
    ASSERT_OK(gguf_get_bool(f, "t.bool", &b));
    ASSERT_EQ(1, b);
    ASSERT_EQ((int)STATUS_BAD_INPUT, gguf_get_bool(f, "t.u8", &b));
    ASSERT_OK(gguf_get_str(f, "t.str", &s));
    ASSERT_TRUE(gguf_str_eq(s, "h\xc3\xa9llo"));
    ASSERT_OK(gguf_get_str(f, "t.empty", &s));
    ASSERT_EQ((uint64_t)0, s.len);
    ASSERT_OK(gguf_get_u32(f, "t.replaced", &u));
    ASSERT_EQ(2u, u);
    enum gguf_vtype et;
    uint64_t n;
    ASSERT_OK(gguf_get_arr(f, "t.arr_str", &et, &n));
    ASSERT_EQ((uint64_t)4, n);
    ASSERT_OK(gguf_arr_str(f, "t.arr_str", 2, &s));
    ASSERT_TRUE(gguf_str_eq(s, "\xe2\x96\x81the"));
    ASSERT_OK(gguf_arr_str(f, "t.arr_str", 1, &s));
    ASSERT_EQ((uint64_t)0, s.len);
    ASSERT_OK(gguf_arr_str(f, "t.arr_str", 3, &s));
    ASSERT_TRUE(gguf_str_eq(s, "<0x0A>"));
    ASSERT_OK(gguf_arr_f32(f, "t.arr_f32", 1, &x));
    ASSERT_EQ(-2.0f, x);
    ASSERT_OK(gguf_arr_i64(f, "t.arr_i32", 2, &i));
    ASSERT_EQ((int64_t)2147483647, i);
    ASSERT_OK(gguf_arr_f32(f, "t.arr_i32", 0, &x));
    ASSERT_EQ(-1.0f, x);
    ASSERT_EQ((int)STATUS_BAD_INPUT, gguf_arr_i64(f, "t.arr_f32", 0, &i));
    ASSERT_OK(gguf_get_arr(f, "t.arr_bool", &et, &n));
    ASSERT_EQ((int)GGUF_TYPE_BOOL, (int)et);
    const uint8_t *bools = gguf_arr_data(f, "t.arr_bool", &et, &n);
    ASSERT_TRUE(bools && n == 3 && bools[0] == 1 && bools[1] == 0 && bools[2] == 1);
    ASSERT_OK(gguf_arr_i64(f, "t.arr_u64", 1, &i));
    ASSERT_EQ((int64_t)1 << 40, i);
    ASSERT_OK(gguf_arr_f32(f, "t.arr_f64", 0, &x));
    ASSERT_EQ(0.5f, x);
    ASSERT_OK(gguf_get_arr(f, "t.arr_empty", &et, &n));
    ASSERT_EQ((uint64_t)0, n);
    ASSERT_EQ((int)GGUF_TYPE_INT16, (int)et);
    ASSERT_EQ((int)STATUS_BAD_INPUT, gguf_arr_i64(f, "t.arr_empty", 0, &i));

    ASSERT_EQ((int64_t)3, gguf_n_tensors(f));
    const struct gguf_tensor *t = gguf_tensor_find(f, "a.weight");
    ASSERT_TRUE(t != NULL);
    ASSERT_EQ((int64_t)3, t->ne[1]);
    ASSERT_EQ(-7.0f, ((const float *)t->data)[0]);
    ASSERT_EQ(40.75f, ((const float *)t->data)[191]);
    t = gguf_tensor_find(f, "b.weight");
    ASSERT_EQ((int)DTYPE_F16, (int)t->type);
    ASSERT_EQ(1, t->n_dims);
    float row[64];
    dtype_dequant_row(DTYPE_F16, t->data, row, 64);
    ASSERT_EQ(-6.75f, row[1]);
    t = gguf_tensor_find(f, "c.weight");
    ASSERT_EQ(3, t->n_dims);
    ASSERT_EQ((int64_t)32, t->ne[0]);
    ASSERT_EQ((int64_t)1, t->ne[1]);
    ASSERT_EQ((int64_t)3, t->ne[2]);
    ASSERT_EQ((size_t)(3 * 34), t->nbytes);
    for (int64_t k = 0; k < 3; k++)
        ASSERT_EQ((uintptr_t)0, ((uintptr_t)gguf_tensor_at(f, k)->data - (uintptr_t)gguf_tensor_at(f, 0)->data) % 32);
    gguf_close(f);
}

TEST(gguf_roundtrip_every_type) {
    const char *p1 = tmp_path("all.gguf");
    char path1[512];
    snprintf(path1, sizeof path1, "%s", p1);
    write_all_types(path1, 0);
    check_all_types(path1);
    /* the streaming writer makes the same bytes */
    const char *p2 = tmp_path("all-stream.gguf");
    char path2[512];
    snprintf(path2, sizeof path2, "%s", p2);
    write_all_types(path2, 1);
    check_all_types(path2);
    size_t n1, n2;
    uint8_t *a = (uint8_t *)test_read_file(path1, &n1), *b = (uint8_t *)test_read_file(path2, &n2);
    ASSERT_TRUE(a && b);
    ASSERT_EQ(n1, n2);
    ASSERT_TRUE(memcmp(a, b, n1) == 0);
    free(a);
    free(b);
    unlink(path1);
    unlink(path2);
}

TEST(gguf_writer_refuses) {
    char err[512];
    gguf_writer *w = gguf_writer_init();
    int64_t ne[2] = {48, 2};
    float data[96] = {0};
    gguf_writer_add_tensor(w, "x", DTYPE_Q8_0, 2, ne, data); /* 48 is not a multiple of 32 */
    ASSERT_EQ((int)STATUS_BAD_INPUT, gguf_writer_write(w, tmp_path("refused.gguf"), err, sizeof err));
    gguf_writer_free(w);
    w = gguf_writer_init();
    gguf_writer_add_tensor(w, "x", DTYPE_F32, 2, ne, data);
    gguf_writer_add_tensor(w, "x", DTYPE_F32, 2, ne, data);
    ASSERT_EQ((int)STATUS_BAD_INPUT, gguf_writer_write(w, tmp_path("refused.gguf"), err, sizeof err));
    ASSERT_TRUE(strstr(err, "tensor x: added twice") != NULL);
    gguf_writer_free(w);
    w = gguf_writer_init();
    gguf_writer_add_tensor_info(w, "y", DTYPE_F32, 2, ne);
    ASSERT_OK(gguf_writer_begin(w, tmp_path("refused.gguf"), err, sizeof err));
    ASSERT_EQ((int)STATUS_BAD_INPUT, gguf_writer_finish(w, err, sizeof err));
    ASSERT_TRUE(strstr(err, "tensor y was never written") != NULL);
    gguf_writer_free(w);
    unlink(tmp_path("refused.gguf"));
}

/* Copies a file key by key (in order, same types) and tensor by tensor
 * through the writer. */
static void copy_through_writer(const char *src, const char *dst) {
    char err[512];
    gguf_file *f = NULL;
    ASSERT_OK(gguf_open(&f, src, err, sizeof err));
    gguf_writer *w = gguf_writer_init();
    for (int64_t k = 0; k < gguf_n_keys(f); k++) {
        struct gguf_str kn = gguf_key_name(f, k);
        char key[256];
        snprintf(key, sizeof key, "%.*s", (int)kn.len, kn.ptr);
        enum gguf_vtype t = gguf_key_type(f, k);
        if (t == GGUF_TYPE_STRING) {
            struct gguf_str s;
            ASSERT_OK(gguf_get_str(f, key, &s));
            char *v = strndup(s.ptr, s.len);
            gguf_writer_set_str(w, key, v);
            free(v);
        } else if (t == GGUF_TYPE_ARRAY) {
            enum gguf_vtype et;
            uint64_t n;
            ASSERT_OK(gguf_get_arr(f, key, &et, &n));
            if (et == GGUF_TYPE_STRING) {
                char **v = calloc(n, sizeof *v);
                for (uint64_t i = 0; i < n; i++) {
                    struct gguf_str s;
                    ASSERT_OK(gguf_arr_str(f, key, i, &s));
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
            ASSERT_OK(gguf_get_f32(f, key, &v));
            gguf_writer_set_f32(w, key, v);
        } else if (t == GGUF_TYPE_UINT32) {
            uint32_t v;
            ASSERT_OK(gguf_get_u32(f, key, &v));
            gguf_writer_set_u32(w, key, v);
        } else {
            TEST_FAIL("%s: key %s has type %d, not handled here", src, key, (int)t);
        }
    }
    for (int64_t i = 0; i < gguf_n_tensors(f); i++) {
        const struct gguf_tensor *t = gguf_tensor_at(f, i);
        char name[256];
        snprintf(name, sizeof name, "%.*s", (int)t->name.len, t->name.ptr);
        gguf_writer_add_tensor(w, name, t->type, t->n_dims, t->ne, t->data);
    }
    ASSERT_OK(gguf_writer_write(w, dst, err, sizeof err));
    gguf_writer_free(w);
    gguf_close(f);
}

/* The writer lays files out exactly as llama.cpp (and gguf-py) do: copying
 * their files through it gives the same bytes. */
TEST(gguf_writer_matches_llama_cpp_layout) {
    const char *files[] = {"stories260K-f32.gguf", "stories260K-q4_0.gguf", "synth256-q4_k_m.gguf", "synth256-q6_k.gguf"};
    char dst[512];
    snprintf(dst, sizeof dst, "%s", tmp_path("copy.gguf"));
    for (size_t i = 0; i < sizeof files / sizeof files[0]; i++) {
        char src[2048];
        snprintf(src, sizeof src, "%s", test_model_path(files[i]));
        copy_through_writer(src, dst);
        size_t na, nb;
        uint8_t *a = (uint8_t *)test_read_file(src, &na), *b = (uint8_t *)test_read_file(dst, &nb);
        ASSERT_TRUE(a && b);
        ASSERT_EQ(na, nb);
        size_t diff = 0;
        while (diff < na && a[diff] == b[diff]) diff++;
        if (diff != na) TEST_FAIL("%s: the copy differs first at byte %zu", files[i], diff);
        free(a);
        free(b);
    }
    unlink(dst);
}

/* Nested arrays (arrays of arrays) are parsed and skipped safely. */
TEST(gguf_nested_arrays) {
    static struct hb b;
    memset(&b, 0, sizeof b);
    hb_head(&b, 2, 0, 3);
    hb_str(&b, "nested");
    hb_u32(&b, GGUF_TYPE_ARRAY);
    hb_u32(&b, GGUF_TYPE_ARRAY);
    hb_u64(&b, 2);
    hb_u32(&b, GGUF_TYPE_INT32); /* inner 0: 2 int32 */
    hb_u64(&b, 2);
    hb_u32(&b, 5);
    hb_u32(&b, 6);
    hb_u32(&b, GGUF_TYPE_STRING); /* inner 1: 1 string */
    hb_u64(&b, 1);
    hb_str(&b, "xy");
    hb_str(&b, "after");
    hb_u32(&b, GGUF_TYPE_UINT32);
    hb_u32(&b, 77);
    hb_str(&b, "deep");
    hb_u32(&b, GGUF_TYPE_ARRAY);
    hb_u32(&b, GGUF_TYPE_ARRAY);
    hb_u64(&b, 1);
    hb_u32(&b, GGUF_TYPE_ARRAY);
    hb_u64(&b, 0);
    const char *path = tmp_path("nested.gguf");
    write_bytes(path, b.p, b.n);
    char err[512];
    gguf_file *f = NULL;
    ASSERT_OK(gguf_open(&f, path, err, sizeof err));
    ASSERT_EQ(2u, gguf_version(f));
    uint32_t u;
    ASSERT_OK(gguf_get_u32(f, "after", &u));
    ASSERT_EQ(77u, u);
    enum gguf_vtype et;
    uint64_t n;
    ASSERT_OK(gguf_get_arr(f, "nested", &et, &n));
    ASSERT_EQ((int)GGUF_TYPE_ARRAY, (int)et);
    ASSERT_EQ((uint64_t)2, n);
    int64_t i;
    struct gguf_str s;
    ASSERT_EQ((int)STATUS_BAD_INPUT, gguf_arr_i64(f, "nested", 0, &i));
    ASSERT_EQ((int)STATUS_BAD_INPUT, gguf_arr_str(f, "nested", 1, &s));
    ASSERT_TRUE(gguf_arr_data(f, "nested", &et, &n) == NULL);
    gguf_close(f);

    /* nesting past the limit is refused, not recursed without bound */
    memset(&b, 0, sizeof b);
    hb_head(&b, 3, 0, 1);
    hb_str(&b, "k");
    hb_u32(&b, GGUF_TYPE_ARRAY);
    for (int d = 0; d < 100; d++) {
        hb_u32(&b, GGUF_TYPE_ARRAY);
        hb_u64(&b, 1);
    }
    hb_u32(&b, GGUF_TYPE_UINT8);
    hb_u64(&b, 0);
    write_bytes(path, b.p, b.n);
    ASSERT_EQ((int)STATUS_BAD_INPUT, open_err(path, err, sizeof err));
    ASSERT_TRUE(strstr(err, "key k: arrays nested deeper") != NULL);
    unlink(path);
}

/* A file with one tensor whose info the caller patches. */
static void build_one_tensor(struct hb *b, uint32_t type, uint64_t ne0, uint64_t offset, uint32_t align) {
    memset(b, 0, sizeof *b);
    hb_head(b, 3, 1, align ? 2 : 1);
    hb_str(b, "general.architecture");
    hb_u32(b, GGUF_TYPE_STRING);
    hb_str(b, "llama");
    if (align) {
        hb_str(b, "general.alignment");
        hb_u32(b, GGUF_TYPE_UINT32);
        hb_u32(b, align);
    }
    hb_str(b, "blk.3.attn_q.weight");
    hb_u32(b, 2);
    hb_u64(b, ne0);
    hb_u64(b, 2);
    hb_u32(b, type);
    hb_u64(b, offset);
    hb_pad(b, align && !(align & (align - 1)) ? align : 32);
    for (int i = 0; i < 64 * 2 * 4 / 4; i++) hb_u32(b, 0x3f800000);
}

TEST(gguf_errors_name_the_problem) {
    static struct hb b;
    char err[512];
    const char *p = tmp_path("bad.gguf");
    char path[512];
    snprintf(path, sizeof path, "%s", p);

    build_one_tensor(&b, DTYPE_F32, 64, 0, 0);
    write_bytes(path, b.p, b.n);
    gguf_file *f = NULL;
    ASSERT_OK(gguf_open(&f, path, err, sizeof err));
    ASSERT_EQ(1.0f, ((const float *)gguf_tensor_find(f, "blk.3.attn_q.weight")->data)[127]);
    gguf_close(f);

    build_one_tensor(&b, 23, 64, 0, 0);
    write_bytes(path, b.p, b.n);
    ASSERT_EQ((int)STATUS_UNSUPPORTED, open_err(path, err, sizeof err));
    ASSERT_TRUE(strstr(err, "bad.gguf: tensor blk.3.attn_q.weight: type 23 (IQ4_XS) is not supported") != NULL);

    build_one_tensor(&b, 99, 64, 0, 0);
    write_bytes(path, b.p, b.n);
    ASSERT_EQ((int)STATUS_UNSUPPORTED, open_err(path, err, sizeof err));
    ASSERT_TRUE(strstr(err, "type 99") != NULL);

    build_one_tensor(&b, DTYPE_Q8_0, 48, 0, 0);
    write_bytes(path, b.p, b.n);
    ASSERT_EQ((int)STATUS_BAD_INPUT, open_err(path, err, sizeof err));
    ASSERT_TRUE(strstr(err, "tensor blk.3.attn_q.weight: row length ne[0] = 48") != NULL);

    build_one_tensor(&b, DTYPE_F32, 64, 16, 0);
    write_bytes(path, b.p, b.n);
    ASSERT_EQ((int)STATUS_BAD_INPUT, open_err(path, err, sizeof err));
    ASSERT_TRUE(strstr(err, "not a multiple of the alignment 32") != NULL);

    build_one_tensor(&b, DTYPE_F32, 64, 64, 0); /* data runs past the end */
    write_bytes(path, b.p, b.n);
    ASSERT_EQ((int)STATUS_BAD_INPUT, open_err(path, err, sizeof err));
    ASSERT_TRUE(strstr(err, "tensor blk.3.attn_q.weight: data") != NULL);
    ASSERT_TRUE(strstr(err, "past the end") != NULL);

    build_one_tensor(&b, DTYPE_F32, 1ull << 62, 0, 0); /* bytes overflow */
    write_bytes(path, b.p, b.n);
    ASSERT_EQ((int)STATUS_BAD_INPUT, open_err(path, err, sizeof err));

    build_one_tensor(&b, DTYPE_F32, 64, 0, 24);
    write_bytes(path, b.p, b.n);
    ASSERT_EQ((int)STATUS_BAD_INPUT, open_err(path, err, sizeof err));
    ASSERT_TRUE(strstr(err, "key general.alignment: alignment 24 is not a power of two") != NULL);

    build_one_tensor(&b, DTYPE_F32, 64, 0, 64); /* a larger alignment works */
    write_bytes(path, b.p, b.n);
    ASSERT_OK(gguf_open(&f, path, err, sizeof err));
    ASSERT_EQ(64u, gguf_alignment(f));
    ASSERT_EQ((uint64_t)0, gguf_data_offset(f) % 64);
    gguf_close(f);

    build_one_tensor(&b, DTYPE_F32, 64, 0, 0);
    b.p[4] = 1; /* version 1 */
    write_bytes(path, b.p, b.n);
    ASSERT_EQ((int)STATUS_UNSUPPORTED, open_err(path, err, sizeof err));
    ASSERT_TRUE(strstr(err, "version 1 is not supported") != NULL);

    build_one_tensor(&b, DTYPE_F32, 64, 0, 0);
    b.p[0] = 'X';
    write_bytes(path, b.p, b.n);
    ASSERT_EQ((int)STATUS_BAD_INPUT, open_err(path, err, sizeof err));
    ASSERT_TRUE(strstr(err, "not a GGUF file") != NULL);

    memset(&b, 0, sizeof b); /* a duplicate key */
    hb_head(&b, 3, 0, 2);
    hb_str(&b, "a.b");
    hb_u32(&b, GGUF_TYPE_UINT8);
    b.p[b.n++] = 1;
    hb_str(&b, "a.b");
    hb_u32(&b, GGUF_TYPE_UINT8);
    b.p[b.n++] = 2;
    write_bytes(path, b.p, b.n);
    ASSERT_EQ((int)STATUS_BAD_INPUT, open_err(path, err, sizeof err));
    ASSERT_TRUE(strstr(err, "key a.b: appears more than once") != NULL);

    memset(&b, 0, sizeof b); /* a key count that cannot fit */
    hb_head(&b, 3, 0, 1ull << 60);
    write_bytes(path, b.p, b.n);
    ASSERT_EQ((int)STATUS_BAD_INPUT, open_err(path, err, sizeof err));

    memset(&b, 0, sizeof b); /* a huge string length */
    hb_head(&b, 3, 0, 1);
    hb_u64(&b, ~0ull);
    hb_put(&b, "abcdefghijklmnop", 16);
    write_bytes(path, b.p, b.n);
    ASSERT_EQ((int)STATUS_BAD_INPUT, open_err(path, err, sizeof err));
    ASSERT_TRUE(strstr(err, "key #0: string of 18446744073709551615 bytes") != NULL);

    write_bytes(path, "", 0);
    ASSERT_EQ((int)STATUS_BAD_INPUT, open_err(path, err, sizeof err));
    ASSERT_TRUE(strstr(err, "empty") != NULL);
    ASSERT_EQ((int)STATUS_NOT_FOUND, open_err("/nonexistent/x.gguf", err, sizeof err));
    ASSERT_TRUE(strstr(err, "/nonexistent/x.gguf: cannot open") != NULL);
    ASSERT_EQ((int)STATUS_BAD_INPUT, open_err("/tmp", err, sizeof err));
    unlink(path);
}

/* Every proper prefix of a small valid file is refused with a message that
 * names the file; none crashes. */
TEST(gguf_every_truncation_refused) {
    const char *p = tmp_path("full.gguf");
    char full[512], cut[512];
    snprintf(full, sizeof full, "%s", p);
    snprintf(cut, sizeof cut, "%s", tmp_path("cut.gguf"));
    write_all_types(full, 0);
    size_t n;
    uint8_t *bytes = (uint8_t *)test_read_file(full, &n);
    ASSERT_TRUE(bytes != NULL);
    char err[512];
    /* the tensor data ends before the file does: ggml pads after the last tensor too */
    gguf_file *f = NULL;
    ASSERT_OK(gguf_open(&f, full, err, sizeof err));
    const struct gguf_tensor *last = gguf_tensor_find(f, "c.weight");
    size_t data_end = (size_t)((const uint8_t *)last->data - (const uint8_t *)gguf_tensor_find(f, "a.weight")->data) +
                      (size_t)gguf_data_offset(f) + last->nbytes;
    gguf_close(f);
    ASSERT_EQ((size_t)0, n % 32);
    ASSERT_TRUE(data_end < n);
    for (size_t len = 0; len < n; len++) {
        write_bytes(cut, bytes, len);
        int st = open_err(cut, err, sizeof err);
        if (len >= data_end) {
            if (st != 0) TEST_FAIL("cut to %zu, within the final padding: refused: %s", len, err);
            continue;
        }
        if (st == 0) TEST_FAIL("a file cut to %zu of %zu bytes was accepted", len, n);
        if (!strstr(err, cut)) TEST_FAIL("cut to %zu: message does not name the file: %s", len, err);
        if (len > 24 && !strstr(err, "truncated") && !strstr(err, "past the end"))
            TEST_FAIL("cut to %zu: message does not say truncated: %s", len, err);
    }
    for (size_t len = 100; len < n; len += 300) {
        write_bytes(cut, bytes, len);
        open_err(cut, err, sizeof err);
        printf("  e.g. %s\n", err);
    }
    free(bytes);
    unlink(full);
    unlink(cut);
}

/* Random byte flips in the header/metadata region: each mutant is refused
 * or opens, and then every key and tensor can be read without leaving the
 * mapping (run under ASan to make that check strict). */
TEST(gguf_random_mutations_safe) {
    const char *p = tmp_path("m.gguf");
    char full[512], mut[512];
    snprintf(full, sizeof full, "%s", p);
    snprintf(mut, sizeof mut, "%s", tmp_path("mut.gguf"));
    write_all_types(full, 0);
    size_t n;
    uint8_t *bytes = (uint8_t *)test_read_file(full, &n);
    ASSERT_TRUE(bytes != NULL);
    uint8_t *m = malloc(n);
    gguf_file *f0 = NULL;
    char err[512];
    ASSERT_OK(gguf_open(&f0, full, err, sizeof err));
    size_t meta = (size_t)gguf_data_offset(f0);
    gguf_close(f0);
    uint64_t rs = 12345;
    int opened = 0, refused = 0;
    for (int it = 0; it < 4000; it++) {
        memcpy(m, bytes, n);
        int flips = 1 + (int)(rs % 4);
        for (int k = 0; k < flips; k++) {
            rs = rs * 6364136223846793005ull + 1442695040888963407ull;
            size_t pos = (size_t)((rs >> 33) % meta);
            uint8_t v = (uint8_t)(rs >> 20);
            if (it % 3 == 0) m[pos] ^= (uint8_t)(1u << (v & 7)); /* one bit */
            else if (it % 3 == 1) m[pos] = v;                      /* any byte */
            else m[pos] = (v & 1) ? 0xff : 0x00;                   /* extremes */
        }
        write_bytes(mut, m, n);
        gguf_file *f = NULL;
        int st = gguf_open(&f, mut, err, sizeof err);
        if (st != 0) {
            ASSERT_TRUE(f == NULL);
            ASSERT_TRUE(strstr(err, mut) != NULL);
            refused++;
            continue;
        }
        opened++;
        volatile uint64_t sink = 0;
        for (int64_t k = 0; k < gguf_n_keys(f); k++) {
            struct gguf_str key = gguf_key_name(f, k);
            char kb[300];
            snprintf(kb, sizeof kb, "%.*s", (int)(key.len < 250 ? key.len : 250), key.ptr);
            uint32_t u;
            int64_t i;
            float x;
            int b;
            struct gguf_str s;
            gguf_get_u32(f, kb, &u);
            gguf_get_i64(f, kb, &i);
            gguf_get_f32(f, kb, &x);
            gguf_get_bool(f, kb, &b);
            if (gguf_get_str(f, kb, &s) == 0)
                for (uint64_t c = 0; c < s.len; c++) sink += (uint8_t)s.ptr[c];
            enum gguf_vtype et;
            uint64_t an;
            if (gguf_get_arr(f, kb, &et, &an) == 0) {
                for (uint64_t e = 0; e < an && e < 64; e++) {
                    if (gguf_arr_str(f, kb, e, &s) == 0)
                        for (uint64_t c = 0; c < s.len; c++) sink += (uint8_t)s.ptr[c];
                    gguf_arr_f32(f, kb, e, &x);
                    gguf_arr_i64(f, kb, e, &i);
                }
            }
        }
        for (int64_t t = 0; t < gguf_n_tensors(f); t++) {
            const struct gguf_tensor *tt = gguf_tensor_at(f, t);
            const uint8_t *d = tt->data;
            if (tt->nbytes) sink += d[0] + d[tt->nbytes - 1];
        }
        (void)sink;
        gguf_close(f);
    }
    printf("  %d mutants opened, %d refused\n", opened, refused);
    ASSERT_TRUE(refused > 0);
    free(bytes);
    free(m);
    unlink(full);
    unlink(mut);
    rmdir(tmpdir);
}

TEST_MAIN(gguf_reads_stories260k, gguf_roundtrip_every_type, gguf_writer_matches_llama_cpp_layout, gguf_writer_refuses, gguf_nested_arrays,
          gguf_errors_name_the_problem, gguf_every_truncation_refused, gguf_random_mutations_safe)
