/* Tests of the llm-run program as a real process: its --json generation
 * (from a prompt and from BOS alone), --tokenize and --eval-ids output
 * against the llama.cpp goldens, --tokenize on vocab-only files against
 * llama.cpp's tokenizer suites, the device it picks by default, and its
 * exit status and message on bad input. */
#include "../test.h"

#include <cjson/cJSON.h>
#include <fcntl.h>
#include <signal.h>
#include <sys/wait.h>
#include <unistd.h>

#define RUN_BINARY LLM_BINARY_DIR "/worker/llm-run"

struct proc_result {
    char *out;     /* stdout, NUL-terminated; malloc'ed */
    char err[4096];/* the start of stderr */
    int status;    /* exit code, or 128 + signal */
};

/* The device of the runs that give none (LLM_DEVICE in their environment):
 * the CPU, whose tolerances the golden checks hold (a GPU's F16 KV cache
 * moves the logits by about 4e-3; tests/worker/test_forward covers the
 * GPU).  "" leaves LLM_DEVICE unset, so llm-run's own default (auto) holds. */
static const char *run_device = "cpu";

/* Runs llm-run with args (NULL-terminated), bounded to 120 s. */
static void run_llm(const char *const *args, struct proc_result *r) {
    if (access(RUN_BINARY, X_OK) != 0) TEST_FAIL("%s is not built", RUN_BINARY);
    memset(r, 0, sizeof *r);
    const char *argv[64];
    int n = 0;
    argv[n++] = RUN_BINARY;
    for (int i = 0; args[i] && n < 63; i++) argv[n++] = args[i];
    argv[n] = NULL;
    int out_pipe[2];
    char err_path[] = "/tmp/test_llm_run_errXXXXXX";
    int err_fd = mkstemp(err_path);
    if (pipe(out_pipe) != 0 || err_fd < 0) TEST_FAIL("pipe/mkstemp failed");
    unlink(err_path);
    pid_t pid = fork();
    if (pid == 0) {
        dup2(out_pipe[1], 1);
        dup2(err_fd, 2);
        close(out_pipe[0]);
        close(out_pipe[1]);
        if (*run_device) setenv("LLM_DEVICE", run_device, 1);
        else unsetenv("LLM_DEVICE");
        alarm(120); /* survives exec: a hung run is killed */
        execv(RUN_BINARY, (char *const *)argv);
        _exit(127);
    }
    close(out_pipe[1]);
    size_t cap = 4096, len = 0;
    r->out = malloc(cap);
    ssize_t got;
    while ((got = read(out_pipe[0], r->out + len, cap - len - 1)) > 0) {
        len += (size_t)got;
        if (cap - len < 1024) r->out = realloc(r->out, cap *= 2);
    }
    r->out[len] = 0;
    close(out_pipe[0]);
    int st;
    waitpid(pid, &st, 0);
    r->status = WIFEXITED(st) ? WEXITSTATUS(st) : 128 + WTERMSIG(st);
    lseek(err_fd, 0, SEEK_SET);
    ssize_t e = read(err_fd, r->err, sizeof r->err - 1);
    r->err[e > 0 ? e : 0] = 0;
    close(err_fd);
}

/* The JSON object on the last line of stdout. */
static cJSON *last_line_json(const struct proc_result *r) {
    size_t len = strlen(r->out);
    while (len > 0 && r->out[len - 1] == '\n') len--;
    size_t start = len;
    while (start > 0 && r->out[start - 1] != '\n') start--;
    char *line = strndup(r->out + start, len - start);
    cJSON *j = cJSON_Parse(line);
    if (!j) TEST_FAIL("last line of stdout is not JSON: \"%s\" (stderr: %s)", line, r->err);
    free(line);
    return j;
}

static cJSON *load_json(const char *file) {
    const char *path = test_model_path(file);
    char *buf = test_read_file(path, NULL);
    if (!buf) TEST_FAIL("cannot read %s", path);
    cJSON *j = cJSON_Parse(buf);
    free(buf);
    if (!j) TEST_FAIL("%s: not JSON", path);
    return j;
}

static void assert_same_ids(const cJSON *expected, const cJSON *actual, const char *what) {
    if (!cJSON_IsArray(actual)) TEST_FAIL("%s: not an array", what);
    ASSERT_EQ(cJSON_GetArraySize(expected), cJSON_GetArraySize(actual));
    for (int i = 0; i < cJSON_GetArraySize(expected); i++) {
        int e = (int)cJSON_GetArrayItem(expected, i)->valuedouble, a = (int)cJSON_GetArrayItem(actual, i)->valuedouble;
        if (e != a) TEST_FAIL("%s[%d]: expected %d, got %d", what, i, e, a);
    }
}

TEST(llm_run_generate_matches_golden) {
    char model[2048];
    snprintf(model, sizeof model, "%s", test_model_path("stories260K-f32.gguf"));
    cJSON *root = load_json("stories260K-golden.json");
    const cJSON *prompts = cJSON_GetObjectItem(
        cJSON_GetObjectItem(cJSON_GetObjectItem(root, "models"), "stories260K-f32.gguf"), "prompts");
    const cJSON *p;
    int i = 0;
    cJSON_ArrayForEach(p, prompts) {
        const cJSON *gen = cJSON_GetObjectItem(p, "generated_ids");
        char n[16];
        snprintf(n, sizeof n, "%d", cJSON_GetArraySize(gen));
        /* The second prompt is prefilled in chunks of 2 tokens. */
        const char *args[] = {"--model", model, "--prompt", cJSON_GetObjectItem(p, "prompt")->valuestring,
                              "--max-tokens", n, "--temperature", "0", "--no-stop-at-eos", "--threads", "2",
                              "--batch", i++ ? "2" : "512", "--json", NULL};
        struct proc_result r;
        run_llm(args, &r);
        if (r.status != 0) TEST_FAIL("llm-run exited %d: %s", r.status, r.err);
        cJSON *j = last_line_json(&r);
        assert_same_ids(cJSON_GetObjectItem(p, "prompt_ids"), cJSON_GetObjectItem(j, "prompt_ids"), "prompt_ids");
        assert_same_ids(gen, cJSON_GetObjectItem(j, "ids"), "ids");
        const char *golden_text = cJSON_GetObjectItem(p, "generated_text")->valuestring;
        ASSERT_STREQ(golden_text, cJSON_GetObjectItem(j, "text")->valuestring);
        /* The text was streamed before the JSON line. */
        ASSERT_TRUE(strncmp(r.out, golden_text, strlen(golden_text)) == 0);
        cJSON_Delete(j);
        free(r.out);
    }
    cJSON_Delete(root);
}

/* An empty prompt is BOS alone, as in llama.cpp.  The golden set has no
 * run from BOS, but its first prompt starts at BOS and the model's greedy
 * picks after BOS reproduce that prompt ("Once upon a time"), so greedy
 * from BOS must give the prompt's ids after BOS and then llama.cpp's
 * greedy continuation of the prompt, token for token. */
TEST(llm_run_empty_prompt_generates_from_bos) {
    char model[2048];
    snprintf(model, sizeof model, "%s", test_model_path("stories260K-f32.gguf"));
    cJSON *root = load_json("stories260K-golden.json");
    const cJSON *p = cJSON_GetArrayItem(cJSON_GetObjectItem(
        cJSON_GetObjectItem(cJSON_GetObjectItem(root, "models"), "stories260K-f32.gguf"), "prompts"), 0);
    const cJSON *prompt_ids = cJSON_GetObjectItem(p, "prompt_ids"), *gen = cJSON_GetObjectItem(p, "generated_ids");
    ASSERT_EQ(1, (int)cJSON_GetArrayItem(prompt_ids, 0)->valuedouble); /* BOS */
    cJSON *want = cJSON_CreateArray();
    const cJSON *e;
    for (int i = 1; i < cJSON_GetArraySize(prompt_ids); i++)
        cJSON_AddItemToArray(want, cJSON_CreateNumber(cJSON_GetArrayItem(prompt_ids, i)->valuedouble));
    cJSON_ArrayForEach(e, gen) cJSON_AddItemToArray(want, cJSON_CreateNumber(e->valuedouble));
    char n[16];
    snprintf(n, sizeof n, "%d", cJSON_GetArraySize(want));
    const char *args[] = {"--model", model, "--prompt", "", "--max-tokens", n, "--no-stop-at-eos", "--threads", "2",
                          "--json", NULL};
    struct proc_result r;
    run_llm(args, &r);
    if (r.status != 0) TEST_FAIL("llm-run exited %d: %s", r.status, r.err);
    cJSON *j = last_line_json(&r);
    cJSON *bos = cJSON_CreateArray();
    cJSON_AddItemToArray(bos, cJSON_CreateNumber(1));
    assert_same_ids(bos, cJSON_GetObjectItem(j, "prompt_ids"), "prompt_ids");
    assert_same_ids(want, cJSON_GetObjectItem(j, "ids"), "ids");
    printf("  %d greedy ids from BOS equal the golden's\n", cJSON_GetArraySize(want));
    cJSON_Delete(bos);
    cJSON_Delete(want);
    cJSON_Delete(j);
    free(r.out);
    cJSON_Delete(root);
}

TEST(llm_run_tokenize_matches_golden) {
    char model[2048];
    snprintf(model, sizeof model, "%s", test_model_path("stories260K-f32.gguf"));
    cJSON *root = load_json("tokenize-golden.json");
    const cJSON *c;
    cJSON_ArrayForEach(c, cJSON_GetObjectItem(root, "cases")) {
        const char *args[] = {"--model", model, "--tokenize", cJSON_GetObjectItem(c, "text")->valuestring, "--json", NULL};
        struct proc_result r;
        run_llm(args, &r);
        if (r.status != 0) TEST_FAIL("llm-run exited %d: %s", r.status, r.err);
        cJSON *j = last_line_json(&r);
        assert_same_ids(cJSON_GetObjectItem(c, "ids_with_bos"), cJSON_GetObjectItem(j, "ids"), "ids");
        cJSON_Delete(j);
        free(r.out);
    }
    cJSON_Delete(root);
}

/* llama.cpp's tokenizer suite of a vocab-only GGUF file (metadata, no
 * tensors) through the llm-run program, one process per text: FILE.inp
 * holds the texts separated by "\n__ggml_vocab_test__\n", FILE.out one
 * line of ids per text, made without BOS and without parsing special
 * tokens.  tests/common/test_tokenizer.c runs the same suites on the
 * library; this is about the program's path (tokenizer only, no model). */
static void run_vocab_suite(const char *name) {
    char path[2048], inp_path[2100], out_path[2100];
    snprintf(path, sizeof path, "%s", test_model_path(name));
    snprintf(inp_path, sizeof inp_path, "%s.inp", path);
    snprintf(out_path, sizeof out_path, "%s.out", path);
    char *inp = test_read_file(inp_path, NULL), *out = test_read_file(out_path, NULL);
    if (!inp || !out) TEST_FAIL("cannot read %s or %s", inp_path, out_path);
    static const char sep[] = "\n__ggml_vocab_test__\n";
    char *pos = inp, *line = out, *end;
    int n_cases = 0, n_failed = 0;
    for (; (end = strstr(pos, sep)); pos = end + sizeof sep - 1, n_cases++) {
        char *eol = strchr(line, '\n');
        if (!eol) TEST_FAIL("%s: fewer lines than texts (at case %d)", out_path, n_cases);
        *eol = 0;
        *end = 0;
        const char *args[] = {"--model", path, "--tokenize", pos, "--no-bos", "--no-parse-special", "--json", NULL};
        struct proc_result r;
        run_llm(args, &r);
        if (r.status != 0) TEST_FAIL("%s case %d: llm-run exited %d: %s", name, n_cases, r.status, r.err);
        cJSON *j = last_line_json(&r);
        const cJSON *ids = cJSON_GetObjectItem(j, "ids");
        /* The expected line against the printed ids, as text. */
        char got[8192] = "";
        size_t len = 0;
        const cJSON *e;
        cJSON_ArrayForEach(e, ids) len += (size_t)snprintf(got + len, len < sizeof got ? sizeof got - len : 0, " %d",
                                                           (int)e->valuedouble);
        if (!cJSON_IsArray(ids) || strcmp(got, line) != 0) {
            printf("  %s case %d \"%s\":\n    expected%s\n    got     %s\n", name, n_cases, pos, line, got);
            n_failed++;
        }
        cJSON_Delete(j);
        free(r.out);
        line = eol + 1;
    }
    free(inp);
    free(out);
    printf("  %s: %d cases through llm-run, %d failed\n", name, n_cases, n_failed);
    ASSERT_EQ(46, n_cases);
    ASSERT_EQ(0, n_failed);
}

TEST(llm_run_tokenize_vocab_only_llama_spm) { run_vocab_suite("vocab/ggml-vocab-llama-spm.gguf"); }
TEST(llm_run_tokenize_vocab_only_gpt2) { run_vocab_suite("vocab/ggml-vocab-gpt-2.gguf"); }

TEST(llm_run_eval_ids_top5_matches_golden) {
    char model[2048];
    snprintf(model, sizeof model, "%s", test_model_path("stories260K-f32.gguf"));
    cJSON *root = load_json("stories260K-golden.json");
    const cJSON *p = cJSON_GetArrayItem(cJSON_GetObjectItem(
        cJSON_GetObjectItem(cJSON_GetObjectItem(root, "models"), "stories260K-f32.gguf"), "prompts"), 0);
    char ids[4096] = "";
    size_t len = 0;
    int np = 0, n = 0;
    const cJSON *e;
    cJSON_ArrayForEach(e, cJSON_GetObjectItem(p, "prompt_ids")) {
        len += (size_t)snprintf(ids + len, sizeof ids - len, "%s%d", n ? "," : "", (int)e->valuedouble);
        np++, n++;
    }
    cJSON_ArrayForEach(e, cJSON_GetObjectItem(p, "generated_ids")) {
        len += (size_t)snprintf(ids + len, sizeof ids - len, ",%d", (int)e->valuedouble);
        n++;
    }
    /* Chunks of 7 tokens: the 69 positions take 10 steps. */
    const char *args[] = {"--model", model, "--eval-ids", ids, "--top", "5", "--json", "--threads", "2", "--batch", "7", NULL};
    struct proc_result r;
    run_llm(args, &r);
    if (r.status != 0) TEST_FAIL("llm-run exited %d: %s", r.status, r.err);
    cJSON *j = last_line_json(&r);
    const cJSON *top = cJSON_GetObjectItem(j, "top");
    ASSERT_EQ(n, cJSON_GetArraySize(top));
    const cJSON *gold = cJSON_GetObjectItem(p, "top5_logits");
    double worst = 0;
    for (int k = 0; k < cJSON_GetArraySize(gold); k++) {
        const cJSON *grow = cJSON_GetArrayItem(gold, k), *row = cJSON_GetArrayItem(top, np - 1 + k);
        ASSERT_EQ(5, cJSON_GetArraySize(row));
        for (int i = 0; i < 5; i++) {
            const cJSON *ge = cJSON_GetArrayItem(grow, i), *oe = cJSON_GetArrayItem(row, i);
            ASSERT_EQ((int)cJSON_GetArrayItem(ge, 0)->valuedouble, (int)cJSON_GetArrayItem(oe, 0)->valuedouble);
            double d = fabs(cJSON_GetArrayItem(ge, 1)->valuedouble - cJSON_GetArrayItem(oe, 1)->valuedouble);
            if (d > worst) worst = d;
        }
    }
    printf("  top-5 ids equal, logits within %.2g\n", worst);
    ASSERT_TRUE(worst < 1e-4);
    const cJSON *ppl = cJSON_GetObjectItem(j, "perplexity");
    ASSERT_TRUE(cJSON_IsNumber(ppl));
    /* The golden continuation is the model's own greedy choice: low perplexity. */
    ASSERT_TRUE(ppl->valuedouble > 1.0 && ppl->valuedouble < 20.0);
    cJSON_Delete(j);
    free(r.out);
    cJSON_Delete(root);
}

/* Without --device, llm-run picks a GPU when one opens, else the CPU, and
 * says which on stderr. */
TEST(llm_run_device_auto_says_which) {
    char model[2048];
    snprintf(model, sizeof model, "%s", test_model_path("stories260K-f32.gguf"));
    const char *args[] = {"--model", model, "--prompt", "Once", "--max-tokens", "3", "--threads", "2", NULL};
    struct proc_result r;
    run_device = "";
    run_llm(args, &r);
    run_device = "cpu";
    if (r.status != 0) TEST_FAIL("llm-run exited %d: %s", r.status, r.err);
    const char *line = strstr(r.err, "llm-run: device auto: ");
    if (!line) TEST_FAIL("no \"device auto:\" line on stderr: %s", r.err);
    line += strlen("llm-run: device auto: ");
    ASSERT_TRUE(strncmp(line, "cuda:0 (", 8) == 0 || strncmp(line, "cpu (", 5) == 0);
    printf("  %.*s\n", (int)strcspn(line, "\n"), line);
    free(r.out);
}

TEST(llm_run_bad_input_fails_with_message) {
    char model[2048];
    snprintf(model, sizeof model, "%s", test_model_path("stories260K-f32.gguf"));
    struct proc_result r;
    const char *bad_id[] = {"--model", model, "--eval-ids", "1,403,99999", "--json", NULL};
    run_llm(bad_id, &r);
    ASSERT_EQ(1, r.status);
    ASSERT_TRUE(strstr(r.err, "99999") != NULL);
    free(r.out);
    const char *bad_list[] = {"--model", model, "--eval-ids", "1,x,3", NULL};
    run_llm(bad_list, &r);
    ASSERT_EQ(1, r.status);
    ASSERT_TRUE(strstr(r.err, "--eval-ids") != NULL);
    free(r.out);
    const char *missing[] = {"--model", "/nonexistent/model.gguf", "--prompt", "hi", NULL};
    run_llm(missing, &r);
    ASSERT_EQ(1, r.status);
    ASSERT_TRUE(strstr(r.err, "/nonexistent/model.gguf") != NULL);
    free(r.out);
    const char *unknown[] = {"--model", model, "--prompt", "hi", "--no-such-flag", NULL};
    run_llm(unknown, &r);
    ASSERT_EQ(2, r.status);
    ASSERT_TRUE(strstr(r.err, "no-such-flag") != NULL);
    free(r.out);
    const char *no_mode[] = {"--model", model, NULL};
    run_llm(no_mode, &r);
    ASSERT_EQ(1, r.status);
    free(r.out);
    const char *gpu[] = {"--model", model, "--prompt", "hi", "--device", "cuda:99", "--require-gpu", NULL};
    run_llm(gpu, &r);
    ASSERT_EQ(1, r.status);
    ASSERT_TRUE(strstr(r.err, "cuda:99") != NULL);
    free(r.out);
    const char *bad_device[] = {"--model", model, "--prompt", "hi", "--device", "gpu0", NULL};
    run_llm(bad_device, &r);
    ASSERT_EQ(2, r.status);
    ASSERT_TRUE(strstr(r.err, "--device") != NULL && strstr(r.err, "gpu0") != NULL);
    free(r.out);
    /* A vocab-only file tokenizes, but has no weights to generate with. */
    char vocab[2048];
    snprintf(vocab, sizeof vocab, "%s", test_model_path("vocab/ggml-vocab-llama-spm.gguf"));
    const char *no_weights[] = {"--model", vocab, "--prompt", "hi", NULL};
    run_llm(no_weights, &r);
    ASSERT_EQ(1, r.status);
    ASSERT_TRUE(strstr(r.err, "ggml-vocab-llama-spm.gguf") != NULL);
    free(r.out);
}

TEST_MAIN(llm_run_generate_matches_golden, llm_run_empty_prompt_generates_from_bos, llm_run_tokenize_matches_golden, llm_run_tokenize_vocab_only_llama_spm,
          llm_run_tokenize_vocab_only_gpt2, llm_run_eval_ids_top5_matches_golden,
          llm_run_device_auto_says_which, llm_run_bad_input_fails_with_message)
