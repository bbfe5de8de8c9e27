/* Tests of the stage links' GPU encoding (kernels/cuda/link_codec.h)
 * against the host's (worker/link.h's link_encode and link_decode): the
 * same bytes on the wire and the same floats back, bit for bit, for every
 * element type, on fresh random rows of several widths and on the rows
 * that catch a rounding difference (zeros, ties, large, tiny, mixed
 * magnitudes).  Exact equality is the bound: an NCCL link must carry a row
 * as the ZeroMQ link does.  Apart from test_cuda_ops.c, whose ops compare
 * two backends; this compares the GPU with worker/ code.  Without a GPU
 * (CI) every test skips and ctest reports the program skipped. */
#include "cuda_test.h"

#include "worker/link.h"

#if defined(LLM_HAVE_CUDA)
#include "kernels/cuda/link_codec.h"
#include "kernels/cuda/stream_access.h"

/* ---- Fixture: the GPU backend and its buffers; released by fx_close ---- */

static struct {
    backend *gpu;
    void *dev[4];
    int n_dev;
} fx;

static void fx_close(void) {
    for (int i = 0; i < fx.n_dev; i++) backend_dealloc(fx.gpu, fx.dev[i]);
    backend_free(fx.gpu);
    memset(&fx, 0, sizeof fx);
}

static void fx_open(void) {
    fx_close();
    cuda_test_open(&fx.gpu);
}

static void *fx_dev(size_t bytes) {
    if (fx.n_dev == 4) TEST_FAIL("fixture: more than 4 device buffers");
    void *p = backend_alloc(fx.gpu, bytes);
    if (!p) TEST_FAIL("fixture: %zu device bytes: %s", bytes, backend_errstr(fx.gpu));
    return fx.dev[fx.n_dev++] = p;
}

/* Row r of width w, by kind: random of one magnitude, zeros, ties, large,
 * tiny, and large and tiny mixed.  INT8's inverse scale 127 / amax stays
 * finite (amax above 127 / FLT_MAX): both codecs then agree; below it both
 * would compute an infinite inverse, and the tests keep to rows the
 * stages produce. */
enum { ROW_KINDS = 6 };
static void fill_row(float *x, size_t w, int kind) {
    /* ties: halfway between F16 and between BF16 neighbours, and x * 127 /
     * amax halfway between integers (amax 127, so the inverse is 1) */
    static const float ties[] = {127.0f, 2.5f, -2.5f, 0.5f, -126.5f, 1.00048828125f /* 1 + 2^-11 */,
                                 1.00146484375f /* 1 + 3 * 2^-11 */, 1.00390625f /* 1 + 2^-8 */,
                                 -3.0078125f /* a BF16 tie */};
    for (size_t i = 0; i < w; i++) {
        switch (kind) {
        case 0: x[i] = rng_f(-2.0f, 2.0f); break;
        case 1: x[i] = 0.0f; break;
        case 2: x[i] = i < sizeof ties / sizeof *ties ? ties[i] : rng_f(-127.0f, 127.0f); break;
        case 3: x[i] = rng_f(-1e30f, 1e30f); break;
        case 4: x[i] = rng_f(-1e-30f, 1e-30f); break;
        default: x[i] = i % 3 == 0 ? rng_f(-3e4f, 3e4f) : rng_f(-1e-6f, 1e-6f); break;
        }
    }
}

/* Encodes rows of width w on both sides and compares the bytes; decodes the
 * host's bytes on both sides and compares the floats. */
static void check_width(size_t w, size_t rows) {
    /* The widest wire: F32's 4 bytes a value, or INT8's 1 and a 4-byte
     * scale a row (rows of 1 and 2: 5 and 3 bytes a value). */
    size_t n = w * rows, wmax = n * 4 + rows * 4;
    float *x = malloc(n * sizeof *x), *want = malloc(n * sizeof *want), *got = malloc(n * sizeof *got);
    uint8_t *hw = malloc(wmax), *gw = malloc(wmax);
    ASSERT_TRUE(x && want && got && hw && gw);
    for (size_t r = 0; r < rows; r++) fill_row(x + r * w, w, (int)(r % ROW_KINDS));
    float *dx = fx_dev(n * 4), *dy = fx_dev(n * 4);
    void *dw = fx_dev(wmax);
    void *stream = backend_cuda_stream(fx.gpu);
    char err[256];
    ASSERT_OK(backend_upload(fx.gpu, dx, x, n * 4));
    for (int t = 0; t < LINK_DTYPE_N; t++) {
        size_t wire = link_dtype_wire_bytes((enum link_dtype)t, n * 4, w);
        link_encode((enum link_dtype)t, x, n, w, hw);
        if (link_codec_encode(stream, (enum link_codec_type)t, dx, n, w, dw, err, sizeof err) < 0)
            TEST_FAIL("%s encode, rows of %zu: %s", link_dtype_names[t], w, err);
        ASSERT_OK(backend_download(fx.gpu, gw, dw, wire));
        for (size_t i = 0; i < wire; i++)
            if (hw[i] != gw[i]) {
                size_t rb = t == LINK_DTYPE_INT8 ? link_int8_row_bytes(w) : t == LINK_DTYPE_F32 ? w * 4 : w * 2;
                TEST_FAIL("%s encode, rows of %zu: byte %zu (row %zu, kind %zu) is 0x%02x on the GPU, 0x%02x "
                          "on the host", link_dtype_names[t], w, i, i / rb, i / rb % ROW_KINDS, gw[i], hw[i]);
            }
        link_decode((enum link_dtype)t, hw, n, w, want);
        ASSERT_OK(backend_upload(fx.gpu, dw, hw, wire));
        if (link_codec_decode(stream, (enum link_codec_type)t, dw, n, w, dy, err, sizeof err) < 0)
            TEST_FAIL("%s decode, rows of %zu: %s", link_dtype_names[t], w, err);
        ASSERT_OK(backend_download(fx.gpu, got, dy, n * 4));
        for (size_t i = 0; i < n; i++)
            if (memcmp(&want[i], &got[i], 4) != 0)
                TEST_FAIL("%s decode, rows of %zu: element %zu is %.9g on the GPU, %.9g on the host",
                          link_dtype_names[t], w, i, got[i], want[i]);
    }
    for (int i = 0; i < fx.n_dev; i++) backend_dealloc(fx.gpu, fx.dev[i]);
    fx.n_dev = 0;
    free(x);
    free(want);
    free(got);
    free(hw);
    free(gw);
}

TEST(cuda_link_codec_equals_host) {
    fx_open();
    rng_seed();
    /* odd widths (INT8 rows then start off any alignment), a block's
     * width, a model's, wider than a block's threads many times over */
    static const size_t widths[] = {1, 7, 64, 255, 333, 4096, 8195};
    for (size_t i = 0; i < sizeof widths / sizeof *widths; i++) check_width(widths[i], 2 * ROW_KINDS);
    /* more rows than one launch's blocks (65535): the grid-stride loop */
    check_width(3, 70001);
    fx_close();
}

TEST(cuda_link_codec_refuses_bad_shapes) {
    fx_open();
    void *stream = backend_cuda_stream(fx.gpu);
    float *d = fx_dev(64 * 4);
    char err[256];
    ASSERT_EQ(STATUS_BAD_INPUT, link_codec_encode(stream, LINK_CODEC_INT8, d, 10, 4, d, err, sizeof err));
    ASSERT_TRUE(strstr(err, "whole rows of 4") != NULL);
    ASSERT_EQ(STATUS_BAD_INPUT, link_codec_encode(stream, LINK_CODEC_F16, d, 8, 8, (char *)d + 1, err, sizeof err));
    ASSERT_EQ(STATUS_BAD_INPUT, link_codec_decode(stream, LINK_CODEC_BF16, (char *)d + 1, 8, 8, d, err, sizeof err));
    ASSERT_EQ(STATUS_BAD_INPUT, link_codec_decode(stream, (enum link_codec_type)9, d, 8, 8, d, err, sizeof err));
    ASSERT_OK(link_codec_encode(stream, LINK_CODEC_INT8, d, 0, 4, d, err, sizeof err));
    fx_close();
}

#else /* built without CUDA */

TEST(cuda_link_codec_equals_host) { TEST_SKIP("this build has no CUDA backend"); }
TEST(cuda_link_codec_refuses_bad_shapes) { TEST_SKIP("this build has no CUDA backend"); }

#endif

TEST_MAIN(cuda_link_codec_equals_host, cuda_link_codec_refuses_bad_shapes)
