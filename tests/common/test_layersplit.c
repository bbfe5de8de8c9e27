/* Tests for common/layersplit: the ranges (equal bytes, the embedding and
 * the head weighing on the first and last stage, ties to the earlier cut,
 * a layer for every stage, bad stage counts), the sizes read from a GGUF
 * file's tensor infos (layers, embedding, head, tied lm_head) and the
 * estimate from a Hugging Face model's shapes. */
#include "common/gguf.h"
#include "common/layersplit.h"
#include "common/status.h"
#include "tests/test.h"

#include <stdlib.h>
#include <unistd.h>

/* Sizes on the stack: layers[] holds n entries. */
static struct layersplit_sizes ls_sizes(uint64_t *layers, int32_t n, uint64_t embed,
                                        uint64_t head) {
    struct layersplit_sizes s = {n, layers, embed, head};
    return s;
}

/* Splits and checks every range against want (first0, end0, first1, ...). */
static void ls_expect(const struct layersplit_sizes *s, int32_t n_stages, const int32_t *want) {
    int32_t first[16], end[16];
    char err[256];
    ASSERT_OK(layersplit_ranges(s, n_stages, first, end, err, sizeof err));
    for (int32_t k = 0; k < n_stages; k++) {
        ASSERT_EQ(want[2 * k], first[k]);
        ASSERT_EQ(want[2 * k + 1], end[k]);
    }
}

TEST(layersplit_equal_layers_split_evenly) {
    uint64_t l[4] = {10, 10, 10, 10};
    struct layersplit_sizes s = ls_sizes(l, 4, 0, 0);
    ls_expect(&s, 1, (const int32_t[]){0, 4});
    ls_expect(&s, 2, (const int32_t[]){0, 2, 2, 4});
    ls_expect(&s, 4, (const int32_t[]){0, 1, 1, 2, 2, 3, 3, 4});
}

TEST(layersplit_embedding_and_head_weigh_on_the_ends) {
    /* 6 layers of 10, embedding 30: 90 in all, 30 per stage of 3.  Stage 0
     * holds the embedding and needs a layer; then 40 + 10 + 10 = 60. */
    uint64_t l[6] = {10, 10, 10, 10, 10, 10};
    struct layersplit_sizes s = ls_sizes(l, 6, 30, 0);
    ls_expect(&s, 3, (const int32_t[]){0, 1, 1, 3, 3, 6});
    /* The head on the last stage mirrors it. */
    s = ls_sizes(l, 6, 0, 30);
    ls_expect(&s, 3, (const int32_t[]){0, 3, 3, 5, 5, 6});
    /* Uneven layers: the cut follows the bytes, not the count. */
    uint64_t u[4] = {40, 10, 10, 20};
    s = ls_sizes(u, 4, 0, 0);
    ls_expect(&s, 2, (const int32_t[]){0, 1, 1, 4});
}

TEST(layersplit_tie_takes_the_earlier_cut) {
    /* 5 + 10 = 15 and 5 + 20 = 25 are both 5 from 20 (half of 40). */
    uint64_t l[3] = {10, 10, 10};
    struct layersplit_sizes s = ls_sizes(l, 3, 5, 5);
    ls_expect(&s, 2, (const int32_t[]){0, 1, 1, 3});
}

TEST(layersplit_every_stage_gets_a_layer) {
    /* A huge embedding would put every cut at the start; a huge head every
     * cut at the end: each stage still gets one layer. */
    uint64_t l[4] = {1, 1, 1, 1};
    struct layersplit_sizes s = ls_sizes(l, 4, 1000, 0);
    ls_expect(&s, 4, (const int32_t[]){0, 1, 1, 2, 2, 3, 3, 4});
    ls_expect(&s, 3, (const int32_t[]){0, 1, 1, 2, 2, 4});
    s = ls_sizes(l, 4, 0, 1000);
    ls_expect(&s, 3, (const int32_t[]){0, 2, 2, 3, 3, 4});
    /* Zero bytes everywhere (sizes unknown): every cut is as close as the
     * first candidate, so each stage but the last takes one layer. */
    uint64_t z[5] = {0};
    s = ls_sizes(z, 5, 0, 0);
    ls_expect(&s, 3, (const int32_t[]){0, 1, 1, 2, 2, 5});
}

TEST(layersplit_refuses_bad_stage_counts) {
    uint64_t l[3] = {1, 1, 1};
    struct layersplit_sizes s = ls_sizes(l, 3, 0, 0);
    int32_t first[8], end[8];
    char err[256] = "";
    ASSERT_EQ(STATUS_BAD_INPUT, layersplit_ranges(&s, 4, first, end, err, sizeof err));
    ASSERT_STREQ("4 stages for 3 layers: need 1..3", err);
    ASSERT_EQ(STATUS_BAD_INPUT, layersplit_ranges(&s, 0, first, end, err, sizeof err));
    ASSERT_STREQ("0 stages for 3 layers: need 1..3", err);
}

/* Writes a GGUF file with F32 tensors of the given names and element counts. */
static void ls_write_gguf(const char *path, const char *const *names, const int64_t *elts, int n) {
    gguf_writer *w = gguf_writer_init();
    ASSERT_TRUE(w != NULL);
    gguf_writer_set_str(w, "general.architecture", "llama");
    gguf_writer_set_u32(w, "llama.block_count", 2);
    float *zero = calloc(64, sizeof *zero);
    ASSERT_TRUE(zero != NULL);
    for (int i = 0; i < n; i++) gguf_writer_add_tensor(w, names[i], DTYPE_F32, 1, &elts[i], zero);
    char err[256];
    int rc = gguf_writer_write(w, path, err, sizeof err);
    gguf_writer_free(w);
    free(zero);
    if (rc < 0) TEST_FAIL("%s", err);
}

static void ls_tmp(char *path, size_t size, const char *name) {
    snprintf(path, size, "/tmp/test_layersplit_%d_%s.gguf", (int)getpid(), name);
}

TEST(layersplit_sizes_from_gguf_tensors) {
    char path[256];
    ls_tmp(path, sizeof path, "untied");
    /* Two layers; blk.7 lies beyond the block count (no stage loads it). */
    const char *names[] = {"token_embd.weight", "blk.0.attn_q.weight", "blk.0.ffn_up.weight",
                           "blk.1.attn_q.weight", "blk.1.attn_q.bias",  "blk.7.attn_q.weight",
                           "output_norm.weight", "output.weight",       "rope_freqs.weight"};
    const int64_t elts[] = {64, 8, 16, 8, 2, 32, 4, 48, 2};
    ls_write_gguf(path, names, elts, 9);
    gguf_file *f = NULL;
    char err[256];
    ASSERT_OK(gguf_open(&f, path, err, sizeof err));
    struct layersplit_sizes s;
    ASSERT_OK(layersplit_sizes_gguf(&s, f, 2, err, sizeof err));
    ASSERT_EQ(2, s.n_layers);
    ASSERT_EQ((uint64_t)(64 * 4), s.embed_bytes);
    ASSERT_EQ((uint64_t)(24 * 4), s.layer_bytes[0]);
    ASSERT_EQ((uint64_t)(10 * 4), s.layer_bytes[1]);
    ASSERT_EQ((uint64_t)((4 + 48 + 2) * 4), s.head_bytes);
    layersplit_sizes_free(&s);
    ASSERT_TRUE(s.layer_bytes == NULL);
    /* A block count the sizes cannot hold is refused with the file's name. */
    ASSERT_EQ(STATUS_BAD_INPUT, layersplit_sizes_gguf(&s, f, 0, err, sizeof err));
    ASSERT_TRUE(strstr(err, path) != NULL);
    gguf_close(f);
    unlink(path);

    /* Tied: no output.weight, so the last stage holds the embedding too. */
    ls_tmp(path, sizeof path, "tied");
    const char *tied[] = {"token_embd.weight", "blk.0.attn_q.weight", "blk.1.attn_q.weight",
                          "output_norm.weight"};
    const int64_t tied_elts[] = {64, 8, 8, 4};
    ls_write_gguf(path, tied, tied_elts, 4);
    ASSERT_OK(gguf_open(&f, path, err, sizeof err));
    ASSERT_OK(layersplit_sizes_gguf(&s, f, 2, err, sizeof err));
    ASSERT_EQ((uint64_t)(64 * 4), s.embed_bytes);
    ASSERT_EQ((uint64_t)((4 + 64) * 4), s.head_bytes);
    layersplit_sizes_free(&s);
    gguf_close(f);
    unlink(path);
}

TEST(layersplit_sizes_from_shapes) {
    /* dim 8, 2 heads of 4, 1 kv head, ffn 16, vocab 10. */
    struct layersplit_shapes sh = {3, 10, 8, 16, 2, 1, 4};
    struct layersplit_sizes s;
    char err[256];
    ASSERT_OK(layersplit_sizes_shapes(&s, &sh, err, sizeof err));
    ASSERT_EQ(3, s.n_layers);
    uint64_t layer = 8 * 8 * 2 + 8 * 4 * 2 + 3 * 8 * 16 + 2 * 8;
    for (int i = 0; i < 3; i++) ASSERT_EQ(layer, s.layer_bytes[i]);
    ASSERT_EQ((uint64_t)80, s.embed_bytes);
    ASSERT_EQ((uint64_t)88, s.head_bytes);
    layersplit_sizes_free(&s);
    sh.n_layers = 0;
    ASSERT_EQ(STATUS_BAD_INPUT, layersplit_sizes_shapes(&s, &sh, err, sizeof err));
    ASSERT_STREQ("model shapes: 0 layers: need 1..1048576", err);
    sh.n_layers = 2;
    sh.ffn_dim = -1;
    ASSERT_EQ(STATUS_BAD_INPUT, layersplit_sizes_shapes(&s, &sh, err, sizeof err));
    ASSERT_TRUE(strstr(err, "ffn -1") != NULL);
    ASSERT_TRUE(s.layer_bytes == NULL);
    layersplit_sizes_free(NULL);
}

TEST_MAIN(layersplit_equal_layers_split_evenly, layersplit_embedding_and_head_weigh_on_the_ends,
          layersplit_tie_takes_the_earlier_cut, layersplit_every_stage_gets_a_layer,
          layersplit_refuses_bad_stage_counts, layersplit_sizes_from_gguf_tensors,
          layersplit_sizes_from_shapes)
