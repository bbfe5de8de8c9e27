/* Sizing through real processes: the limits each worker chooses (or takes
 * from its flags) reach the router in Register, which logs them and sizes
 * the pipeline's steps and running batch from the smallest its stages
 * state; the router's flags override (lower, for the step limits the
 * workers enforce). */
#include "tests/router/cluster_harness.h"

#define MODEL "stories260K-f32.gguf"

/* 1 when the file holds needle, waiting up to timeout_ms for it. */
static int log_has(const char *path, const char *needle, int timeout_ms) {
    int64_t end = h_now_ms() + timeout_ms;
    for (;;) {
        FILE *f = fopen(path, "r");
        if (f) {
            char line[2048];
            int found = 0;
            while (!found && fgets(line, sizeof line, f)) found = strstr(line, needle) != NULL;
            fclose(f);
            if (found) return 1;
        }
        if (h_now_ms() > end) return 0;
        h_sleep_ms(50);
    }
}

#define LOG_HAS(cl, path, needle)                                                     \
    H_ASSERT(cl, log_has(path, needle, 5000), "%s does not say \"%s\"", path, needle)

/* A few generations at once finish: the limits the router planned with are
 * ones the workers accept. */
static void generations_finish(struct cluster *cl, int n) {
    struct h_gen g[4];
    memset(g, 0, sizeof g);
    for (int i = 0; i < n; i++) {
        g[i].cl = cl;
        g[i].prompt = "Once upon a time";
        g[i].max_tokens = 12;
        g[i].ignore_eos = 1;
    }
    h_generate_all(g, n);
    for (int i = 0; i < n; i++) {
        H_ASSERT(cl, g[i].rc == 0, "generation %d: %s", i, g[i].err);
        H_ASSERT(cl, g[i].n == 12, "generation %d: %d tokens, expected 12", i, g[i].n);
        llm_generate_result_free(&g[i].res);
    }
}

TEST(cluster_sizing_defaults_reach_the_router) {
    /* CPU workers keep 16 sequences and 512 tokens a step, chosen rather
     * than given; two stages make two micro-batches of 16: 32 running. */
    struct cluster *cl = h_cluster_start(test_model_path(MODEL), 1, 2, "", "");
    LOG_HAS(cl, cl->workers[0].log, "max-seqs 16 (CPU default), max-batch-tokens 512 (CPU default)");
    char want[256];
    snprintf(want, sizeof want, "worker %s states 512 tokens and 16 sequences a step", cl->workers[1].name);
    LOG_HAS(cl, cl->router.log, want);
    LOG_HAS(cl, cl->router.log, "chosen by the worker rather than flags: KV blocks, step tokens, step sequences");
    LOG_HAS(cl, cl->router.log,
            "steps of 512 tokens (as the stages state) and 16 sequences (as the stages state), "
            "32 running (stages x sequences a step)");
    generations_finish(cl, 3);
    h_cluster_stop(cl);
}

TEST(cluster_sizing_worker_flags_are_stated) {
    /* stories260K's context is 128 positions, 8 blocks: 64 blocks hold 8
     * such sequences. */
    struct cluster *cl = h_cluster_start(test_model_path(MODEL), 1, 1, "",
                                         "--max-seqs 3 --max-batch-tokens 96 --kv-blocks 64");
    char want[256];
    snprintf(want, sizeof want,
             "worker %s states 96 tokens and 3 sequences a step, 64 KV blocks = 8 sequences of 128 "
             "positions; chosen by the worker rather than flags: none",
             cl->workers[0].name);
    LOG_HAS(cl, cl->router.log, want);
    LOG_HAS(cl, cl->router.log,
            "steps of 96 tokens (as the stages state) and 3 sequences (as the stages state), "
            "3 running (stages x sequences a step)");
    generations_finish(cl, 4);
    h_cluster_stop(cl);
}

TEST(cluster_sizing_router_flags_override) {
    /* --max-batch replaces the running limit; --max-step-seqs lowers the
     * workers' 16; --step-tokens above their 512 stays at 512, which they
     * would refuse to exceed. */
    struct cluster *cl = h_cluster_start(test_model_path(MODEL), 1, 1,
                                         "--max-batch 5 --max-step-seqs 2 --step-tokens 100000", "");
    LOG_HAS(cl, cl->router.log,
            "steps of 512 tokens (as the stages state) and 2 sequences (--max-step-seqs), "
            "5 running (--max-batch)");
    generations_finish(cl, 4);
    h_cluster_stop(cl);
}

TEST_MAIN(cluster_sizing_defaults_reach_the_router, cluster_sizing_worker_flags_are_stated,
          cluster_sizing_router_flags_override)
