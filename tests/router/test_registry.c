/* Tests of router/registry's own questions that the server asks without a
 * socket: which workers of the pipelines run on a GPU (the router's
 * --spin-us auto polls while one does). */
#include "router/registry.h"

#include "common/log.h"
#include "common/status.h"
#include "tests/test.h"

/* Registers worker id, backend, as stage 0 of 1 of pipeline pid, all four
 * layers of the test's model; returns registry_register's status. */
static int reg_one(registry *r, const char *id, const char *backend, uint32_t pid, struct worker **w) {
    Llm__Register m = LLM__REGISTER__INIT;
    m.worker_id = (char *)id;
    m.incarnation = 1;
    m.pipeline_id = pid;
    m.stage_index = 0;
    m.stage_count = 1;
    m.layer_first = 0;
    m.layer_end = 4;
    m.backend = (char *)backend;
    m.kv_block_count = 64;
    m.kv_block_size = 16;
    struct pipeline *p;
    bool reformed;
    Llm__Error__Code code;
    char err[256];
    return registry_register(r, &m, id, strlen(id), 1000, w, &p, &reformed, &code, err, sizeof err);
}

/* Only live workers that hold a stage count: not one refused a taken
 * stage, not a CPU one, not one lost. */
TEST(registry_gpu_stages_live_cuda_only) {
    log_set_level(LL_WARN);
    struct modelinfo mi;
    memset(&mi, 0, sizeof mi);
    snprintf(mi.id, sizeof mi.id, "m.gguf");
    mi.n_layers = 4;
    struct registry_config c = {&mi, 1, 1000, 10000, 0};
    registry *r;
    ASSERT_OK(registry_init(&r, &c));
    ASSERT_EQ((size_t)0, registry_n_gpu_stages(r));
    struct worker *g, *cpu, *late;
    ASSERT_OK(reg_one(r, "cpu-0", "cpu", 2, &cpu));
    ASSERT_EQ((size_t)0, registry_n_gpu_stages(r));
    ASSERT_OK(reg_one(r, "gpu-0", "cuda", 1, &g));
    ASSERT_EQ((size_t)1, registry_n_gpu_stages(r));
    /* Pipeline 1's stage is taken: the second GPU worker is in no pipeline. */
    ASSERT_EQ(STATUS_EXHAUSTED, reg_one(r, "gpu-1", "cuda", 1, &late));
    ASSERT_EQ((size_t)1, registry_n_gpu_stages(r));
    registry_mark_lost(r, g);
    ASSERT_EQ((size_t)0, registry_n_gpu_stages(r));
    registry_free(r);
}

TEST_MAIN(registry_gpu_stages_live_cuda_only)
