/* Tests of kernels/backend's backend_open: cpu opens the CPU, auto a GPU
 * exactly when cuda:0 opens (the CPU otherwise, saying why), a named GPU
 * that is absent falls back to the CPU unless the GPU is required. */
#include "kernels/backend.h"

#include "common/status.h"
#include "tests/test.h"

static struct device_spec spec(const char *text) {
    struct device_spec d;
    char err[256];
    if (device_parse("--device", text, &d, err, sizeof err) != STATUS_OK) TEST_FAIL("%s", err);
    return d;
}

TEST(backend_open_cpu) {
    backend *b = NULL;
    char chosen[256] = "", err[256] = "";
    struct device_spec d = spec("cpu");
    ASSERT_OK(backend_open(&b, &d, 1, 1, chosen, sizeof chosen, err, sizeof err));
    ASSERT_TRUE(b != NULL);
    ASSERT_EQ(0, backend_is_gpu(b));
    ASSERT_STREQ("cpu", chosen);
    backend_free(b);
}

TEST(backend_open_auto_takes_the_gpu_when_one_opens) {
    backend *probe = NULL;
    char why[256] = "";
    int have_gpu = backend_cuda_init(&probe, 0, why, sizeof why) == STATUS_OK;
    backend_free(probe);
    backend *b = NULL;
    char chosen[512] = "", err[256] = "";
    struct device_spec d = spec("auto");
    ASSERT_OK(backend_open(&b, &d, 1, 0, chosen, sizeof chosen, err, sizeof err));
    ASSERT_EQ(have_gpu, backend_is_gpu(b));
    if (have_gpu) {
        ASSERT_TRUE(strncmp(chosen, "cuda:0", 6) == 0);
    } else {
        /* The CPU, with the reason the GPU did not open. */
        printf("  auto chose: %s\n", chosen);
        ASSERT_TRUE(strncmp(chosen, "cpu (cuda:0: ", 13) == 0);
        ASSERT_TRUE(strstr(chosen, why) != NULL);
    }
    backend_free(b);
    /* Required and absent: the failure, not the CPU. */
    if (!have_gpu) {
        b = (backend *)1;
        ASSERT_TRUE(backend_open(&b, &d, 1, 1, chosen, sizeof chosen, err, sizeof err) < 0);
        ASSERT_TRUE(b == NULL);
        ASSERT_TRUE(strstr(err, "--require-gpu") != NULL && strstr(err, "auto") != NULL);
    }
}

TEST(backend_open_absent_gpu_falls_back_unless_required) {
    struct device_spec d = spec("cuda:1023");
    backend *b = NULL;
    char chosen[512] = "", err[256] = "";
    ASSERT_OK(backend_open(&b, &d, 1, 0, chosen, sizeof chosen, err, sizeof err));
    ASSERT_EQ(0, backend_is_gpu(b));
    ASSERT_TRUE(strncmp(chosen, "cpu (cuda:1023: ", 16) == 0);
    backend_free(b);
    b = NULL;
    ASSERT_TRUE(backend_open(&b, &d, 1, 1, NULL, 0, err, sizeof err) < 0);
    ASSERT_TRUE(b == NULL);
    ASSERT_TRUE(strstr(err, "cuda:1023") != NULL);
}

/* A build without the CUDA backend says why configure left it out (no
 * nvcc, LLM_CUDA=OFF, or nvcc without a GPU to build for), which llm-run
 * and the CUDA tests' skip line repeat, rather than always blaming nvcc. */
TEST(backend_cuda_init_names_why_this_build_has_no_cuda) {
#ifdef LLM_HAVE_CUDA
    TEST_SKIP("this build has the CUDA backend");
#else
    backend *b = NULL;
    char err[512] = "";
    ASSERT_EQ(STATUS_UNSUPPORTED, backend_cuda_init(&b, 0, err, sizeof err));
    ASSERT_TRUE(b == NULL);
    printf("  %s\n", err);
    ASSERT_TRUE(strstr(err, "this build has no CUDA backend") != NULL);
    ASSERT_TRUE(strstr(err, LLM_CUDA_WHY) != NULL);
    if (strstr(LLM_CUDA_WHY, "no nvcc") == NULL) ASSERT_TRUE(strstr(err, "nvcc was not found") == NULL);
#endif
}

TEST_MAIN(backend_open_cpu, backend_open_auto_takes_the_gpu_when_one_opens,
          backend_open_absent_gpu_falls_back_unless_required, backend_cuda_init_names_why_this_build_has_no_cuda)
