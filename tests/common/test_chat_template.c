/* Tests of common/chat_template: each family renders a system, user,
 * assistant, user conversation to exactly the text its reference template
 * gives; detection by markers; names; message checks; reading the template
 * from a GGUF file and from a Hugging Face directory. */
#include "common/chat_template.h"

#include <stdlib.h>
#include <sys/stat.h>
#include <unistd.h>

#include "common/gguf.h"
#include "common/status.h"
#include "tests/test.h"

static const struct chat_message conv[] = {
    {"system", "You are terse."},
    {"user", "Hi"},
    {"assistant", "Hello."},
    {"user", "Name a colour."},
};
#define N_CONV (sizeof conv / sizeof conv[0])

/* Renders m and checks the text, and that the spans are the messages'
 * texts in order (each as given, or trimmed where the family trims). */
static void check_render(enum chat_family f, const struct chat_message *m, size_t n, int gen,
                         const char *want) {
    char err[256], *out = NULL;
    size_t *spans = NULL, n_spans = 0;
    int rc = chat_template_render(f, m, n, gen, &out, &spans, &n_spans, err, sizeof err);
    if (rc < 0) TEST_FAIL("%s: %s", chat_family_name(f), err);
    ASSERT_STREQ(want, out);
    ASSERT_EQ(n, n_spans);
    for (size_t i = 0; i < n_spans; i++) {
        size_t a = spans[2 * i], b = spans[2 * i + 1];
        const char *c = m[i].content;
        size_t cn = strlen(c);
        if (b - a != cn) { /* trimmed */
            while (cn > 0 && strchr(" \t\n\r", *c)) c++, cn--;
            while (cn > 0 && strchr(" \t\n\r", c[cn - 1])) cn--;
        }
        if (b - a != cn || memcmp(out + a, c, cn) != 0)
            TEST_FAIL("%s: span %zu is \"%.*s\", not message %zu's text \"%s\"", chat_family_name(f), i,
                      (int)(b - a), out + a, i, m[i].content);
        if (i > 0) ASSERT_TRUE(a >= spans[2 * i - 1]);
    }
    free(spans);
    free(out);
}

TEST(llama2) {
    check_render(CHAT_FAMILY_LLAMA2, conv, N_CONV, 1,
                 "[INST] <<SYS>>\nYou are terse.\n<</SYS>>\n\nHi [/INST] Hello. </s><s>[INST] Name a colour. [/INST]");
    check_render(CHAT_FAMILY_LLAMA2, conv + 1, 1, 1, "[INST] Hi [/INST]");
}

TEST(llama3) {
    check_render(CHAT_FAMILY_LLAMA3, conv, N_CONV, 1,
                 "<|start_header_id|>system<|end_header_id|>\n\nYou are terse.<|eot_id|>"
                 "<|start_header_id|>user<|end_header_id|>\n\nHi<|eot_id|>"
                 "<|start_header_id|>assistant<|end_header_id|>\n\nHello.<|eot_id|>"
                 "<|start_header_id|>user<|end_header_id|>\n\nName a colour.<|eot_id|>"
                 "<|start_header_id|>assistant<|end_header_id|>\n\n");
    /* Content is trimmed as the reference template's |trim does. */
    const struct chat_message m[] = {{"user", "  padded \n"}};
    check_render(CHAT_FAMILY_LLAMA3, m, 1, 0, "<|start_header_id|>user<|end_header_id|>\n\npadded<|eot_id|>");
}

TEST(chatml) {
    check_render(CHAT_FAMILY_CHATML, conv, N_CONV, 1,
                 "<|im_start|>system\nYou are terse.<|im_end|>\n"
                 "<|im_start|>user\nHi<|im_end|>\n"
                 "<|im_start|>assistant\nHello.<|im_end|>\n"
                 "<|im_start|>user\nName a colour.<|im_end|>\n"
                 "<|im_start|>assistant\n");
    check_render(CHAT_FAMILY_CHATML, conv + 1, 1, 0, "<|im_start|>user\nHi<|im_end|>\n");
}

TEST(mistral) {
    check_render(CHAT_FAMILY_MISTRAL, conv, N_CONV, 1,
                 "[INST] You are terse.\n\nHi [/INST]Hello.</s>[INST] Name a colour. [/INST]");
}

TEST(zephyr) {
    check_render(CHAT_FAMILY_ZEPHYR, conv, N_CONV, 1,
                 "<|system|>\nYou are terse.</s>\n<|user|>\nHi</s>\n<|assistant|>\nHello.</s>\n"
                 "<|user|>\nName a colour.</s>\n<|assistant|>\n");
}

TEST(gemma) {
    check_render(CHAT_FAMILY_GEMMA, conv, N_CONV, 1,
                 "<start_of_turn>user\nYou are terse.\n\nHi<end_of_turn>\n"
                 "<start_of_turn>model\nHello.<end_of_turn>\n"
                 "<start_of_turn>user\nName a colour.<end_of_turn>\n"
                 "<start_of_turn>model\n");
}

TEST(phi3) {
    check_render(CHAT_FAMILY_PHI3, conv, N_CONV, 1,
                 "<|system|>\nYou are terse.<|end|>\n<|user|>\nHi<|end|>\n<|assistant|>\nHello.<|end|>\n"
                 "<|user|>\nName a colour.<|end|>\n<|assistant|>\n");
}

TEST(deepseek) {
    check_render(CHAT_FAMILY_DEEPSEEK, conv, N_CONV, 1,
                 "You are terse.<\xef\xbd\x9cUser\xef\xbd\x9c>Hi<\xef\xbd\x9c" "Assistant\xef\xbd\x9c>Hello."
                 "<\xef\xbd\x9c" "end\xe2\x96\x81of\xe2\x96\x81sentence\xef\xbd\x9c>"
                 "<\xef\xbd\x9cUser\xef\xbd\x9c>Name a colour.<\xef\xbd\x9c" "Assistant\xef\xbd\x9c>");
}

/* Fragments with each family's markers, written for this test. */
TEST(detect) {
    ASSERT_EQ((int)CHAT_FAMILY_LLAMA3,
              (int)chat_template_detect("{{ '<|start_header_id|>' + m.role + '<|end_header_id|>' }}{{ '<|eot_id|>' }}"));
    ASSERT_EQ((int)CHAT_FAMILY_CHATML, (int)chat_template_detect("{{'<|im_start|>' + role}}"));
    ASSERT_EQ((int)CHAT_FAMILY_GEMMA, (int)chat_template_detect("<start_of_turn>{{ role }}"));
    ASSERT_EQ((int)CHAT_FAMILY_DEEPSEEK, (int)chat_template_detect("{{'<\xef\xbd\x9cUser\xef\xbd\x9c>' + c}}"));
    ASSERT_EQ((int)CHAT_FAMILY_PHI3, (int)chat_template_detect("{{'<|user|>\n' + c + '<|end|>'}}"));
    ASSERT_EQ((int)CHAT_FAMILY_ZEPHYR, (int)chat_template_detect("{{'<|user|>\n' + c + eos_token}}"));
    ASSERT_EQ((int)CHAT_FAMILY_LLAMA2, (int)chat_template_detect("[INST] <<SYS>>\\n{{ s }}"));
    ASSERT_EQ((int)CHAT_FAMILY_MISTRAL, (int)chat_template_detect("{{ '[INST] ' + c + ' [/INST]' }}"));
    ASSERT_EQ((int)CHAT_FAMILY_NONE, (int)chat_template_detect("{{ messages }}"));
    ASSERT_EQ((int)CHAT_FAMILY_NONE, (int)chat_template_detect(""));
    ASSERT_EQ((int)CHAT_FAMILY_NONE, (int)chat_template_detect(NULL));
}

TEST(names) {
    for (int f = 1; f < CHAT_FAMILY_COUNT; f++) {
        ASSERT_EQ(f, (int)chat_family_from_name(chat_family_name((enum chat_family)f)));
        ASSERT_TRUE(chat_template_end_of_turn((enum chat_family)f)[0] != 0);
    }
    ASSERT_EQ((int)CHAT_FAMILY_CHATML, (int)chat_family_from_name("qwen"));
    ASSERT_EQ((int)CHAT_FAMILY_NONE, (int)chat_family_from_name("vicuna"));
    ASSERT_STREQ("<|eot_id|>", chat_template_end_of_turn(CHAT_FAMILY_LLAMA3));
    ASSERT_STREQ("<|im_end|>", chat_template_end_of_turn(CHAT_FAMILY_CHATML));
}

static void check_refused(enum chat_family f, const struct chat_message *m, size_t n, const char *needle) {
    char err[256], *out = (char *)1;
    ASSERT_EQ((int)STATUS_BAD_INPUT, chat_template_render(f, m, n, 1, &out, NULL, NULL, err, sizeof err));
    ASSERT_TRUE(out == NULL);
    if (!strstr(err, needle)) TEST_FAIL("error \"%s\" does not name \"%s\"", err, needle);
}

TEST(bad_messages) {
    check_refused(CHAT_FAMILY_CHATML, conv, 0, "at least one");
    const struct chat_message tool[] = {{"tool", "42"}};
    check_refused(CHAT_FAMILY_CHATML, tool, 1, "messages[0].role = \"tool\"");
    const struct chat_message late_sys[] = {{"user", "a"}, {"system", "b"}};
    check_refused(CHAT_FAMILY_LLAMA3, late_sys, 2, "messages[1]: a system message must come first");
    const struct chat_message twice[] = {{"user", "a"}, {"user", "b"}};
    check_refused(CHAT_FAMILY_LLAMA2, twice, 2, "messages[1]");
    check_refused(CHAT_FAMILY_GEMMA, conv, 1, "needs a user message");
    const struct chat_message nocontent[] = {{"user", NULL}};
    check_refused(CHAT_FAMILY_CHATML, nocontent, 1, "messages[0]: no content");
    /* ChatML has no alternation rule. */
    check_render(CHAT_FAMILY_CHATML, twice, 2, 0, "<|im_start|>user\na<|im_end|>\n<|im_start|>user\nb<|im_end|>\n");
    /* developer is the system role. */
    const struct chat_message dev[] = {{"developer", "d"}, {"user", "u"}};
    check_render(CHAT_FAMILY_PHI3, dev, 2, 0, "<|system|>\nd<|end|>\n<|user|>\nu<|end|>\n");
}

TEST(from_model) {
    char dir[] = "/tmp/test_chat_template_XXXXXX";
    ASSERT_TRUE(mkdtemp(dir) != NULL);
    char path[512], err[256], *t = NULL;

    /* GGUF with and without the key. */
    snprintf(path, sizeof path, "%s/with.gguf", dir);
    gguf_writer *w = gguf_writer_init();
    gguf_writer_set_str(w, "general.architecture", "llama");
    gguf_writer_set_str(w, "tokenizer.chat_template", "{{'<|im_start|>'}}");
    ASSERT_OK(gguf_writer_write(w, path, err, sizeof err));
    gguf_writer_free(w);
    ASSERT_OK(chat_template_from_model(path, &t, err, sizeof err));
    ASSERT_STREQ("{{'<|im_start|>'}}", t);
    ASSERT_EQ((int)CHAT_FAMILY_CHATML, (int)chat_template_detect(t));
    free(t);
    unlink(path);

    snprintf(path, sizeof path, "%s/without.gguf", dir);
    w = gguf_writer_init();
    gguf_writer_set_str(w, "general.architecture", "llama");
    ASSERT_OK(gguf_writer_write(w, path, err, sizeof err));
    gguf_writer_free(w);
    t = (char *)1;
    ASSERT_OK(chat_template_from_model(path, &t, err, sizeof err));
    ASSERT_TRUE(t == NULL);
    unlink(path);

    /* HF directory: a list of named templates picks "default". */
    snprintf(path, sizeof path, "%s/tokenizer_config.json", dir);
    FILE *f = fopen(path, "w");
    ASSERT_TRUE(f != NULL);
    fputs("{\"chat_template\":[{\"name\":\"tool_use\",\"template\":\"x\"},"
          "{\"name\":\"default\",\"template\":\"<start_of_turn>\"}]}", f);
    fclose(f);
    ASSERT_OK(chat_template_from_model(dir, &t, err, sizeof err));
    ASSERT_STREQ("<start_of_turn>", t);
    free(t);
    f = fopen(path, "w");
    fputs("{\"chat_template\": 12", f);
    fclose(f);
    ASSERT_EQ((int)STATUS_BAD_INPUT, chat_template_from_model(dir, &t, err, sizeof err));
    ASSERT_TRUE(strstr(err, "tokenizer_config.json") != NULL);
    unlink(path);

    /* No tokenizer_config.json: chat_template.jinja. */
    snprintf(path, sizeof path, "%s/chat_template.jinja", dir);
    f = fopen(path, "w");
    fputs("[INST] <<SYS>>", f);
    fclose(f);
    ASSERT_OK(chat_template_from_model(dir, &t, err, sizeof err));
    ASSERT_EQ((int)CHAT_FAMILY_LLAMA2, (int)chat_template_detect(t));
    free(t);
    unlink(path);
    rmdir(dir);

    ASSERT_EQ((int)STATUS_NOT_FOUND, chat_template_from_model("/nonexistent/model.gguf", &t, err, sizeof err));
    ASSERT_TRUE(strstr(err, "/nonexistent/model.gguf") != NULL);
}

TEST_MAIN(llama2, llama3, chatml, mistral, zephyr, gemma, phi3, deepseek, detect, names, bad_messages,
          from_model)
