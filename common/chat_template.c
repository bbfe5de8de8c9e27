/* Chat templates recognised by their markers and rendered by C code, one
 * function per family, each writing the text the family's reference Jinja
 * template produces for system/user/assistant messages. */
#include "common/chat_template.h"

#include <cjson/cJSON.h>
#include <errno.h>
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>

#include "common/gguf.h"
#include "common/status.h"

static const char *const family_names[CHAT_FAMILY_COUNT] = {
    "none", "llama2", "llama3", "chatml", "mistral", "zephyr", "gemma", "phi3", "deepseek",
};

const char *chat_family_name(enum chat_family f) {
    return f >= 0 && f < CHAT_FAMILY_COUNT ? family_names[f] : "none";
}

enum chat_family chat_family_from_name(const char *name) {
    if (!name) return CHAT_FAMILY_NONE;
    for (int i = 1; i < CHAT_FAMILY_COUNT; i++)
        if (strcmp(name, family_names[i]) == 0) return (enum chat_family)i;
    if (strcmp(name, "qwen") == 0) return CHAT_FAMILY_CHATML;
    return CHAT_FAMILY_NONE;
}

const char *chat_family_names(void) {
    return "llama2, llama3, chatml (or qwen), mistral, zephyr, gemma, phi3, deepseek";
}

/* Markers that only one family's template contains.  Order matters where a
 * marker is shared: Phi-3 and Zephyr both open turns with <|user|>, and
 * only Phi-3 closes them with <|end|>; Llama-2 and Mistral both use
 * [INST], and only Llama-2 wraps a system prompt in <<SYS>>. */
enum chat_family chat_template_detect(const char *t) {
    if (!t || !*t) return CHAT_FAMILY_NONE;
    if (strstr(t, "<|start_header_id|>") && strstr(t, "<|eot_id|>")) return CHAT_FAMILY_LLAMA3;
    if (strstr(t, "<|im_start|>")) return CHAT_FAMILY_CHATML;
    if (strstr(t, "<start_of_turn>")) return CHAT_FAMILY_GEMMA;
    if (strstr(t, "<\xef\xbd\x9c" "User\xef\xbd\x9c>")) return CHAT_FAMILY_DEEPSEEK;
    if (strstr(t, "<|user|>") && strstr(t, "<|end|>")) return CHAT_FAMILY_PHI3;
    if (strstr(t, "<|user|>")) return CHAT_FAMILY_ZEPHYR;
    if (strstr(t, "[INST]") && strstr(t, "<<SYS>>")) return CHAT_FAMILY_LLAMA2;
    if (strstr(t, "[INST]")) return CHAT_FAMILY_MISTRAL;
    return CHAT_FAMILY_NONE;
}

const char *chat_template_end_of_turn(enum chat_family f) {
    switch (f) {
    case CHAT_FAMILY_LLAMA2:
    case CHAT_FAMILY_MISTRAL:
    case CHAT_FAMILY_ZEPHYR: return "</s>";
    case CHAT_FAMILY_LLAMA3: return "<|eot_id|>";
    case CHAT_FAMILY_CHATML: return "<|im_end|>";
    case CHAT_FAMILY_GEMMA: return "<end_of_turn>";
    case CHAT_FAMILY_PHI3: return "<|end|>";
    case CHAT_FAMILY_DEEPSEEK: return "<\xef\xbd\x9c" "end\xe2\x96\x81of\xe2\x96\x81sentence\xef\xbd\x9c>";
    default: return "";
    }
}

/* ---- reading the template from a model ----------------------------------- */

static char *read_file(const char *path, size_t max, char *err, size_t errlen, int *missing) {
    *missing = 0;
    FILE *f = fopen(path, "rb");
    if (!f) {
        if (errno == ENOENT) *missing = 1;
        else snprintf(err, errlen, "%s: %s", path, strerror(errno));
        return NULL;
    }
    struct stat st;
    if (fstat(fileno(f), &st) != 0 || (size_t)st.st_size > max) {
        snprintf(err, errlen, "%s: larger than %zu bytes", path, max);
        fclose(f);
        return NULL;
    }
    char *buf = malloc((size_t)st.st_size + 1);
    if (!buf) {
        snprintf(err, errlen, "%s: out of memory", path);
        fclose(f);
        return NULL;
    }
    size_t n = fread(buf, 1, (size_t)st.st_size, f);
    fclose(f);
    buf[n] = 0;
    return buf;
}

static int template_from_hf(const char *dir, char **out, char *err, size_t errlen) {
    char path[4096];
    int missing;
    snprintf(path, sizeof path, "%s/tokenizer_config.json", dir);
    char *text = read_file(path, 64u << 20, err, errlen, &missing);
    if (!text && !missing) return STATUS_IO;
    if (text) {
        cJSON *root = cJSON_Parse(text);
        free(text);
        if (!root) {
            snprintf(err, errlen, "%s: not valid JSON", path);
            return STATUS_BAD_INPUT;
        }
        const cJSON *ct = cJSON_GetObjectItemCaseSensitive(root, "chat_template");
        const char *found = NULL;
        if (cJSON_IsString(ct)) found = ct->valuestring;
        else if (cJSON_IsArray(ct)) {
            const cJSON *e;
            cJSON_ArrayForEach(e, ct) {
                const cJSON *name = cJSON_GetObjectItemCaseSensitive(e, "name");
                const cJSON *tm = cJSON_GetObjectItemCaseSensitive(e, "template");
                if (cJSON_IsString(name) && cJSON_IsString(tm) && strcmp(name->valuestring, "default") == 0)
                    found = tm->valuestring;
            }
        }
        if (found) {
            *out = strdup(found);
            cJSON_Delete(root);
            return *out ? 0 : STATUS_NO_MEMORY;
        }
        cJSON_Delete(root);
    }
    snprintf(path, sizeof path, "%s/chat_template.jinja", dir);
    *out = read_file(path, 16u << 20, err, errlen, &missing);
    if (*out || missing) return 0;
    return STATUS_IO;
}

int chat_template_from_model(const char *path, char **out, char *err, size_t errlen) {
    *out = NULL;
    struct stat st;
    if (stat(path, &st) != 0) {
        snprintf(err, errlen, "%s: %s", path, strerror(errno));
        return STATUS_NOT_FOUND;
    }
    if (S_ISDIR(st.st_mode)) return template_from_hf(path, out, err, errlen);
    gguf_file *g;
    int rc = gguf_open(&g, path, err, errlen);
    if (rc < 0) return rc;
    struct gguf_str s;
    if (gguf_get_str(g, "tokenizer.chat_template", &s) == 0) {
        *out = malloc(s.len + 1);
        if (!*out) {
            gguf_close(g);
            snprintf(err, errlen, "%s: out of memory", path);
            return STATUS_NO_MEMORY;
        }
        memcpy(*out, s.ptr, s.len);
        (*out)[s.len] = 0;
    }
    gguf_close(g);
    return 0;
}

/* ---- rendering ------------------------------------------------------------ */

struct sbuf {
    char *p;
    size_t len, cap;
    int oom;
    size_t *spans; /* [start, end) of each message's text in p */
    size_t n_spans, cap_spans;
};

static void sb_addn(struct sbuf *b, const char *s, size_t n) {
    if (b->oom) return;
    if (b->len + n + 1 > b->cap) {
        size_t cap = b->cap ? b->cap : 256;
        while (cap < b->len + n + 1) cap *= 2;
        char *p = realloc(b->p, cap);
        if (!p) {
            b->oom = 1;
            return;
        }
        b->p = p;
        b->cap = cap;
    }
    memcpy(b->p + b->len, s, n);
    b->len += n;
    b->p[b->len] = 0;
}

static void sb_add(struct sbuf *b, const char *s) { sb_addn(b, s, strlen(s)); }

/* A message's text (a client's), its span recorded so that the tokenizer
 * never reads a template marker inside it. */
static void sb_text(struct sbuf *b, const char *s, size_t n) {
    size_t start = b->len;
    sb_addn(b, s, n);
    if (b->oom || n == 0) return;
    if (b->n_spans == b->cap_spans) {
        size_t cap = b->cap_spans ? 2 * b->cap_spans : 16;
        size_t *v = realloc(b->spans, 2 * cap * sizeof *v);
        if (!v) {
            b->oom = 1;
            return;
        }
        b->spans = v;
        b->cap_spans = cap;
    }
    b->spans[2 * b->n_spans] = start;
    b->spans[2 * b->n_spans + 1] = b->len;
    b->n_spans++;
}

static void sb_content(struct sbuf *b, const char *s) { sb_text(b, s, strlen(s)); }

/* Jinja's |trim: the text without leading and trailing whitespace. */
static void sb_content_trimmed(struct sbuf *b, const char *s) {
    while (*s == ' ' || *s == '\t' || *s == '\n' || *s == '\r') s++;
    size_t n = strlen(s);
    while (n > 0 && (s[n - 1] == ' ' || s[n - 1] == '\t' || s[n - 1] == '\n' || s[n - 1] == '\r')) n--;
    sb_text(b, s, n);
}

enum role { ROLE_SYSTEM, ROLE_USER, ROLE_ASSISTANT };

/* The messages after checking: the system text (or NULL) and the turns. */
struct turns {
    const char *system;
    size_t first; /* index of the first non-system message */
};

static int check_messages(enum chat_family f, const struct chat_message *m, size_t n, enum role *roles,
                          struct turns *t, char *err, size_t errlen) {
    t->system = NULL;
    t->first = 0;
    if (n == 0) {
        snprintf(err, errlen, "messages: at least one message is needed");
        return STATUS_BAD_INPUT;
    }
    for (size_t i = 0; i < n; i++) {
        const char *r = m[i].role ? m[i].role : "";
        if (!m[i].content) {
            snprintf(err, errlen, "messages[%zu]: no content", i);
            return STATUS_BAD_INPUT;
        }
        if (strcmp(r, "system") == 0 || strcmp(r, "developer") == 0) roles[i] = ROLE_SYSTEM;
        else if (strcmp(r, "user") == 0) roles[i] = ROLE_USER;
        else if (strcmp(r, "assistant") == 0) roles[i] = ROLE_ASSISTANT;
        else {
            snprintf(err, errlen, "messages[%zu].role = \"%.64s\": expected system, developer, user or assistant",
                     i, r);
            return STATUS_BAD_INPUT;
        }
        if (roles[i] == ROLE_SYSTEM && i != 0) {
            snprintf(err, errlen, "messages[%zu]: a system message must come first", i);
            return STATUS_BAD_INPUT;
        }
    }
    if (roles[0] == ROLE_SYSTEM) {
        t->system = m[0].content;
        t->first = 1;
    }
    /* The [INST] families and Gemma raise an exception in their reference
     * templates unless turns alternate user/assistant starting with user. */
    if (f == CHAT_FAMILY_LLAMA2 || f == CHAT_FAMILY_MISTRAL || f == CHAT_FAMILY_GEMMA) {
        for (size_t i = t->first; i < n; i++) {
            enum role want = (i - t->first) % 2 == 0 ? ROLE_USER : ROLE_ASSISTANT;
            if (roles[i] != want) {
                snprintf(err, errlen, "messages[%zu]: the %s template needs user and assistant turns to "
                         "alternate, starting with user; this one is %s", i, chat_family_name(f),
                         m[i].role);
                return STATUS_BAD_INPUT;
            }
        }
        if (t->first == n) {
            snprintf(err, errlen, "messages: the %s template needs a user message", chat_family_name(f));
            return STATUS_BAD_INPUT;
        }
    }
    return 0;
}

static const char *role_word(enum role r) {
    return r == ROLE_SYSTEM ? "system" : r == ROLE_USER ? "user" : "assistant";
}

/* <s>[INST] <<SYS>>\nS\n<</SYS>>\n\nU [/INST] A </s><s>[INST] U [/INST] */
static void render_llama2(struct sbuf *b, const struct chat_message *m, size_t n, const enum role *roles,
                          const struct turns *t) {
    for (size_t i = t->first; i < n; i++) {
        if (roles[i] == ROLE_USER) {
            if (i != t->first) sb_add(b, "<s>");
            sb_add(b, "[INST] ");
            if (i == t->first && t->system) {
                sb_add(b, "<<SYS>>\n");
                sb_content(b, t->system);
                sb_add(b, "\n<</SYS>>\n\n");
            }
            sb_content_trimmed(b, m[i].content);
            sb_add(b, " [/INST]");
        } else {
            sb_add(b, " ");
            sb_content_trimmed(b, m[i].content);
            sb_add(b, " </s>");
        }
    }
}

/* [INST] S\n\nU [/INST]A</s>[INST] U [/INST] */
static void render_mistral(struct sbuf *b, const struct chat_message *m, size_t n, const enum role *roles,
                           const struct turns *t) {
    for (size_t i = t->first; i < n; i++) {
        if (roles[i] == ROLE_USER) {
            sb_add(b, "[INST] ");
            if (i == t->first && t->system) {
                sb_content(b, t->system);
                sb_add(b, "\n\n");
            }
            sb_content(b, m[i].content);
            sb_add(b, " [/INST]");
        } else {
            sb_content(b, m[i].content);
            sb_add(b, "</s>");
        }
    }
}

/* <|start_header_id|>R<|end_header_id|>\n\nC<|eot_id|> per message. */
static void render_llama3(struct sbuf *b, const struct chat_message *m, size_t n, const enum role *roles,
                          int gen) {
    for (size_t i = 0; i < n; i++) {
        sb_add(b, "<|start_header_id|>");
        sb_add(b, role_word(roles[i]));
        sb_add(b, "<|end_header_id|>\n\n");
        sb_content_trimmed(b, m[i].content);
        sb_add(b, "<|eot_id|>");
    }
    if (gen) sb_add(b, "<|start_header_id|>assistant<|end_header_id|>\n\n");
}

/* <|im_start|>R\nC<|im_end|>\n per message. */
static void render_chatml(struct sbuf *b, const struct chat_message *m, size_t n, const enum role *roles,
                          int gen) {
    for (size_t i = 0; i < n; i++) {
        sb_add(b, "<|im_start|>");
        sb_add(b, role_word(roles[i]));
        sb_add(b, "\n");
        sb_content(b, m[i].content);
        sb_add(b, "<|im_end|>\n");
    }
    if (gen) sb_add(b, "<|im_start|>assistant\n");
}

/* <|R|>\nC</s>\n (Zephyr) or <|R|>\nC<|end|>\n (Phi-3) per message. */
static void render_tagged(struct sbuf *b, const struct chat_message *m, size_t n, const enum role *roles,
                          int gen, const char *end) {
    for (size_t i = 0; i < n; i++) {
        sb_add(b, "<|");
        sb_add(b, role_word(roles[i]));
        sb_add(b, "|>\n");
        sb_content(b, m[i].content);
        sb_add(b, end);
        sb_add(b, "\n");
    }
    if (gen) sb_add(b, "<|assistant|>\n");
}

/* <start_of_turn>user\nC<end_of_turn>\n, the assistant being "model". */
static void render_gemma(struct sbuf *b, const struct chat_message *m, size_t n, const enum role *roles,
                         const struct turns *t, int gen) {
    for (size_t i = t->first; i < n; i++) {
        sb_add(b, roles[i] == ROLE_USER ? "<start_of_turn>user\n" : "<start_of_turn>model\n");
        if (i == t->first && t->system) {
            sb_content(b, t->system);
            sb_add(b, "\n\n");
        }
        sb_content_trimmed(b, m[i].content);
        sb_add(b, "<end_of_turn>\n");
    }
    if (gen) sb_add(b, "<start_of_turn>model\n");
}

/* S<｜User｜>U<｜Assistant｜>A<｜end▁of▁sentence｜> */
static void render_deepseek(struct sbuf *b, const struct chat_message *m, size_t n, const enum role *roles,
                            const struct turns *t, int gen) {
    if (t->system) sb_content(b, t->system);
    for (size_t i = t->first; i < n; i++) {
        if (roles[i] == ROLE_USER) {
            sb_add(b, "<\xef\xbd\x9cUser\xef\xbd\x9c>");
            sb_content(b, m[i].content);
        } else {
            sb_add(b, "<\xef\xbd\x9c" "Assistant\xef\xbd\x9c>");
            sb_content(b, m[i].content);
            sb_add(b, chat_template_end_of_turn(CHAT_FAMILY_DEEPSEEK));
        }
    }
    if (gen) sb_add(b, "<\xef\xbd\x9c" "Assistant\xef\xbd\x9c>");
}

int chat_template_render(enum chat_family f, const struct chat_message *msgs, size_t n,
                         int add_generation_prompt, char **out, size_t **spans, size_t *n_spans, char *err,
                         size_t errlen) {
    *out = NULL;
    if (spans) *spans = NULL;
    if (n_spans) *n_spans = 0;
    if (f <= CHAT_FAMILY_NONE || f >= CHAT_FAMILY_COUNT) {
        snprintf(err, errlen, "no chat template (family %d)", (int)f);
        return STATUS_BAD_INPUT;
    }
    enum role *roles = malloc((n ? n : 1) * sizeof *roles);
    if (!roles) {
        snprintf(err, errlen, "out of memory");
        return STATUS_NO_MEMORY;
    }
    struct turns t;
    int rc = check_messages(f, msgs, n, roles, &t, err, errlen);
    if (rc < 0) {
        free(roles);
        return rc;
    }
    struct sbuf b = {0};
    sb_add(&b, "");
    switch (f) {
    case CHAT_FAMILY_LLAMA2: render_llama2(&b, msgs, n, roles, &t); break;
    case CHAT_FAMILY_MISTRAL: render_mistral(&b, msgs, n, roles, &t); break;
    case CHAT_FAMILY_LLAMA3: render_llama3(&b, msgs, n, roles, add_generation_prompt); break;
    case CHAT_FAMILY_CHATML: render_chatml(&b, msgs, n, roles, add_generation_prompt); break;
    case CHAT_FAMILY_ZEPHYR: render_tagged(&b, msgs, n, roles, add_generation_prompt, "</s>"); break;
    case CHAT_FAMILY_PHI3: render_tagged(&b, msgs, n, roles, add_generation_prompt, "<|end|>"); break;
    case CHAT_FAMILY_GEMMA: render_gemma(&b, msgs, n, roles, &t, add_generation_prompt); break;
    case CHAT_FAMILY_DEEPSEEK: render_deepseek(&b, msgs, n, roles, &t, add_generation_prompt); break;
    default: break;
    }
    free(roles);
    if (b.oom) {
        free(b.p);
        free(b.spans);
        snprintf(err, errlen, "out of memory");
        return STATUS_NO_MEMORY;
    }
    *out = b.p;
    if (spans && n_spans) {
        *spans = b.spans;
        *n_spans = b.n_spans;
    } else {
        free(b.spans);
    }
    return 0;
}
