/* Building a tokenizer from GGUF metadata (tokenizer.ggml.*) or from a
 * Hugging Face folder (tokenizer.json, tokenizer_config.json, config.json,
 * generation_config.json).  Every refusal names the file, the key and the
 * value. */
#include <cjson/cJSON.h>
#include <errno.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>

#include "log.h"
#include "status.h"
#include "tok_impl.h"
#include "unicode.h"

/* Texts of end-of-turn tokens that models use without naming them in the
 * metadata; a control or user-defined token with one of these texts ends
 * generation (the first ones also serve as EOT). */
static const char *const tl_eot_texts[] = {"<|eot_id|>", "<|im_end|>", "<|end|>", "<end_of_turn>", "<EOT>"};
static const char *const tl_eog_texts[] = {"<|eom_id|>", "<|endoftext|>", "<|end_of_text|>"};

/* EOS, EOT, EOM and the end tokens found by their text. */
static int tl_collect_eog(struct tokenizer *t) {
    int rc;
    for (size_t i = 0; i < sizeof tl_eot_texts / sizeof tl_eot_texts[0]; i++) {
        int32_t id = tokenizer_token_find(t, tl_eot_texts[i], strlen(tl_eot_texts[i]));
        if (id < 0 || (t->types[id] != TOK_TYPE_CONTROL && t->types[id] != TOK_TYPE_USER)) continue;
        if (t->eot < 0) t->eot = id;
        if ((rc = tok_eog_add(t, id)) < 0) return rc;
    }
    for (size_t i = 0; i < sizeof tl_eog_texts / sizeof tl_eog_texts[0]; i++) {
        int32_t id = tokenizer_token_find(t, tl_eog_texts[i], strlen(tl_eog_texts[i]));
        if (id < 0 || (t->types[id] != TOK_TYPE_CONTROL && t->types[id] != TOK_TYPE_USER)) continue;
        if ((rc = tok_eog_add(t, id)) < 0) return rc;
    }
    if ((rc = tok_eog_add(t, t->eos)) < 0) return rc;
    if ((rc = tok_eog_add(t, t->eot)) < 0) return rc;
    return tok_eog_add(t, t->eom);
}

/* Byte-level BPE: the id of the character each byte maps to. */
static int tl_byte_chars(struct tokenizer *t) {
    for (int b = 0; b < 256; b++) {
        char u[4];
        int l = unicode_utf8_encode(t->byte_cp[b], u);
        int rc = tok_intern(t, u, (size_t)l, &t->byte_char_ids[b]);
        if (rc < 0) return rc;
    }
    return 0;
}

/* One merge "left right" (split at the first space after the first byte, so
 * that a left side starting with a space still works) with rank `rank`. */
static int tl_merge(struct tokenizer *t, const char *l, size_t ll, const char *r, size_t rl, int32_t rank) {
    int32_t a, b, m;
    int rc;
    if ((rc = tok_intern(t, l, ll, &a)) < 0) return rc;
    if ((rc = tok_intern(t, r, rl, &b)) < 0) return rc;
    char stack[256];
    char *cat = ll + rl <= sizeof stack ? stack : malloc(ll + rl);
    if (!cat) return STATUS_NO_MEMORY;
    memcpy(cat, l, ll);
    memcpy(cat + ll, r, rl);
    rc = tok_intern(t, cat, ll + rl, &m);
    if (cat != stack) free(cat);
    if (rc < 0) return rc;
    return tok_merge_add(t, a, b, rank, m);
}

static const char *tl_split_merge(const char *s, size_t n) {
    if (n < 3) return NULL;
    const char *sp = memchr(s + 1, ' ', n - 1);
    return sp && sp + 1 < s + n ? sp : NULL;
}

/* ---- GGUF ---------------------------------------------------------------- */

/* A special token id: absent leaves *id alone; -1 and 0xFFFFFFFF (what
 * llama2.c's converter writes) mean none; anything else outside the
 * vocabulary is an error. */
static int tl_gguf_id(const gguf_file *f, const char *key, int32_t n_vocab, int32_t *id, char *err, size_t errlen) {
    int64_t v;
    int rc = gguf_get_i64(f, key, &v);
    if (rc == STATUS_NOT_FOUND) return 0;
    if (rc < 0) return status_fail(err, errlen, rc, "%s", gguf_errstr(f));
    if (v == -1 || v == 0xFFFFFFFFll) {
        *id = -1;
        return 0;
    }
    if (v < 0 || v >= n_vocab)
        return status_fail(err, errlen, STATUS_BAD_INPUT, "%s: key %s: token id %lld is outside the vocabulary (%d tokens)",
                           gguf_path(f), key, (long long)v, (int)n_vocab);
    *id = (int32_t)v;
    return 0;
}

static int tl_gguf_bool(const gguf_file *f, const char *key, int *out, char *err, size_t errlen) {
    int v, rc = gguf_get_bool(f, key, &v);
    if (rc == STATUS_NOT_FOUND) return 0;
    if (rc < 0) return status_fail(err, errlen, rc, "%s", gguf_errstr(f));
    *out = v != 0;
    return 0;
}

static int tl_gguf_load(struct tokenizer *t, const gguf_file *f, char *err, size_t errlen) {
    const char *path = gguf_path(f);
    struct gguf_str model, pre;
    enum gguf_vtype et;
    uint64_t n;
    int rc = gguf_get_str(f, "tokenizer.ggml.model", &model);
    if (rc == STATUS_NOT_FOUND)
        return status_fail(err, errlen, rc, "%s: key tokenizer.ggml.model: missing (the file has no tokenizer)", path);
    if (rc < 0) return status_fail(err, errlen, rc, "%s", gguf_errstr(f));
    if (gguf_str_eq(model, "llama")) {
        t->kind = TOK_KIND_SPM;
    } else if (gguf_str_eq(model, "gpt2")) {
        t->kind = TOK_KIND_BPE;
    } else {
        return status_fail(err, errlen, STATUS_UNSUPPORTED,
                           "%s: key tokenizer.ggml.model: tokenizer \"%.*s\" is not supported (llama, gpt2)", path,
                           (int)(model.len > 64 ? 64 : model.len), model.ptr);
    }

    rc = gguf_get_arr(f, "tokenizer.ggml.tokens", &et, &n);
    if (rc == STATUS_NOT_FOUND)
        return status_fail(err, errlen, rc, "%s: key tokenizer.ggml.tokens: missing (the file has no token list)", path);
    if (rc < 0) return status_fail(err, errlen, rc, "%s", gguf_errstr(f));
    if (et != GGUF_TYPE_STRING)
        return status_fail(err, errlen, STATUS_BAD_INPUT, "%s: key tokenizer.ggml.tokens: array of type %d, want strings",
                           path, (int)et);
    if (n == 0 || n > (1u << 24))
        return status_fail(err, errlen, STATUS_BAD_INPUT, "%s: key tokenizer.ggml.tokens: %llu tokens (want 1..%u)", path,
                           (unsigned long long)n, 1u << 24);
    t->n_vocab = (int32_t)n;
    t->scores = calloc(n, sizeof *t->scores);
    t->types = malloc(n);
    if (!t->scores || !t->types) return status_fail(err, errlen, STATUS_NO_MEMORY, "%s: tokenizer: out of memory", path);
    for (uint64_t i = 0; i < n; i++) {
        struct gguf_str s;
        int32_t id;
        if ((rc = gguf_arr_str(f, "tokenizer.ggml.tokens", i, &s)) < 0)
            return status_fail(err, errlen, rc, "%s", gguf_errstr(f));
        if (s.len > (1u << 20))
            return status_fail(err, errlen, STATUS_BAD_INPUT, "%s: key tokenizer.ggml.tokens: token %llu is %llu bytes long",
                               path, (unsigned long long)i, (unsigned long long)s.len);
        if ((rc = tok_str_add(t, s.ptr, (size_t)s.len, &id)) < 0)
            return status_fail(err, errlen, rc, "%s: tokenizer: out of memory", path);
        t->types[i] = TOK_TYPE_NORMAL;
    }

    uint64_t m;
    rc = gguf_get_arr(f, "tokenizer.ggml.scores", &et, &m);
    if (rc == 0) {
        if (m != n)
            return status_fail(err, errlen, STATUS_BAD_INPUT, "%s: key tokenizer.ggml.scores: %llu scores for %llu tokens",
                               path, (unsigned long long)m, (unsigned long long)n);
        for (uint64_t i = 0; i < n; i++)
            if ((rc = gguf_arr_f32(f, "tokenizer.ggml.scores", i, &t->scores[i])) < 0)
                return status_fail(err, errlen, rc, "%s", gguf_errstr(f));
    } else if (rc != STATUS_NOT_FOUND) {
        return status_fail(err, errlen, rc, "%s", gguf_errstr(f));
    }
    int have_types = 0;
    rc = gguf_get_arr(f, "tokenizer.ggml.token_type", &et, &m);
    if (rc == 0) {
        if (m != n)
            return status_fail(err, errlen, STATUS_BAD_INPUT, "%s: key tokenizer.ggml.token_type: %llu types for %llu tokens",
                               path, (unsigned long long)m, (unsigned long long)n);
        for (uint64_t i = 0; i < n; i++) {
            int64_t v;
            if ((rc = gguf_arr_i64(f, "tokenizer.ggml.token_type", i, &v)) < 0)
                return status_fail(err, errlen, rc, "%s", gguf_errstr(f));
            if (v < 0 || v > TOK_TYPE_BYTE)
                return status_fail(err, errlen, STATUS_BAD_INPUT,
                                   "%s: key tokenizer.ggml.token_type: token %llu has type %lld (want 0..6)", path,
                                   (unsigned long long)i, (long long)v);
            t->types[i] = v == 0 ? TOK_TYPE_NORMAL : (uint8_t)v; /* 0 is llama.cpp's "undefined" */
        }
        have_types = 1;
    } else if (rc != STATUS_NOT_FOUND) {
        return status_fail(err, errlen, rc, "%s", gguf_errstr(f));
    }
    if ((rc = tok_map_build(t)) < 0) return status_fail(err, errlen, rc, "%s: tokenizer: out of memory", path);

    int add_space_prefix;
    if (t->kind == TOK_KIND_SPM) {
        for (int b = 0; b < 256; b++) {
            char name[8];
            snprintf(name, sizeof name, "<0x%02X>", b);
            t->byte_ids[b] = tokenizer_token_find(t, name, 6);
            if (!have_types && t->byte_ids[b] >= 0) t->types[t->byte_ids[b]] = TOK_TYPE_BYTE;
        }
        /* llama.cpp's defaults for SentencePiece vocabularies. */
        if (n > 2) t->unk = 0, t->bos = 1, t->eos = 2;
        t->add_bos = 1;
        add_space_prefix = 1;
        t->escape_spaces = t->decode_spaces = 1;
    } else {
        t->byte_level = 1;
        add_space_prefix = 0;
        rc = gguf_get_str(f, "tokenizer.ggml.pre", &pre);
        if (rc == STATUS_NOT_FOUND) {
            LOG(LL_WARN, "%s: no tokenizer.ggml.pre: using the gpt-2 pre-tokenizer", path);
            t->pretok = TOK_PRETOK_GPT2;
        } else if (rc < 0) {
            return status_fail(err, errlen, rc, "%s", gguf_errstr(f));
        } else if (gguf_str_eq(pre, "gpt-2") || gguf_str_eq(pre, "phi-2")) {
            t->pretok = TOK_PRETOK_GPT2;
        } else if (gguf_str_eq(pre, "llama-bpe") || gguf_str_eq(pre, "llama3") || gguf_str_eq(pre, "llama-v3") ||
                   gguf_str_eq(pre, "falcon3")) {
            t->pretok = TOK_PRETOK_LLAMA3;
            t->ignore_merges = 1;
            t->add_bos = 1;
        } else {
            return status_fail(err, errlen, STATUS_UNSUPPORTED,
                               "%s: key tokenizer.ggml.pre: unknown pre-tokenizer \"%.*s\" (known: gpt-2, phi-2, "
                               "llama-bpe, llama3, llama-v3, falcon3)",
                               path, (int)(pre.len > 64 ? 64 : pre.len), pre.ptr);
        }
        if ((rc = tl_byte_chars(t)) < 0) return status_fail(err, errlen, rc, "%s: tokenizer: out of memory", path);
        rc = gguf_get_arr(f, "tokenizer.ggml.merges", &et, &m);
        if (rc == STATUS_NOT_FOUND)
            return status_fail(err, errlen, rc, "%s: key tokenizer.ggml.merges: missing (gpt2 tokenizers need merges)", path);
        if (rc < 0) return status_fail(err, errlen, rc, "%s", gguf_errstr(f));
        if (et != GGUF_TYPE_STRING || m > INT32_MAX)
            return status_fail(err, errlen, STATUS_BAD_INPUT, "%s: key tokenizer.ggml.merges: want an array of strings", path);
        for (uint64_t i = 0; i < m; i++) {
            struct gguf_str s;
            if ((rc = gguf_arr_str(f, "tokenizer.ggml.merges", i, &s)) < 0)
                return status_fail(err, errlen, rc, "%s", gguf_errstr(f));
            const char *sp = tl_split_merge(s.ptr, (size_t)s.len);
            if (!sp)
                return status_fail(err, errlen, STATUS_BAD_INPUT,
                                   "%s: key tokenizer.ggml.merges: merge %llu \"%.*s\" is not \"left right\"", path,
                                   (unsigned long long)i, (int)(s.len > 64 ? 64 : s.len), s.ptr);
            rc = tl_merge(t, s.ptr, (size_t)(sp - s.ptr), sp + 1, (size_t)(s.ptr + s.len - sp - 1), (int32_t)i);
            if (rc < 0) return status_fail(err, errlen, rc, "%s: tokenizer: out of memory", path);
        }
    }

    if ((rc = tl_gguf_id(f, "tokenizer.ggml.bos_token_id", t->n_vocab, &t->bos, err, errlen)) < 0) return rc;
    if ((rc = tl_gguf_id(f, "tokenizer.ggml.eos_token_id", t->n_vocab, &t->eos, err, errlen)) < 0) return rc;
    if ((rc = tl_gguf_id(f, "tokenizer.ggml.unknown_token_id", t->n_vocab, &t->unk, err, errlen)) < 0) return rc;
    if ((rc = tl_gguf_id(f, "tokenizer.ggml.eot_token_id", t->n_vocab, &t->eot, err, errlen)) < 0) return rc;
    if ((rc = tl_gguf_id(f, "tokenizer.ggml.eom_token_id", t->n_vocab, &t->eom, err, errlen)) < 0) return rc;
    if ((rc = tl_gguf_bool(f, "tokenizer.ggml.add_bos_token", &t->add_bos, err, errlen)) < 0) return rc;
    if ((rc = tl_gguf_bool(f, "tokenizer.ggml.add_eos_token", &t->add_eos, err, errlen)) < 0) return rc;
    if ((rc = tl_gguf_bool(f, "tokenizer.ggml.add_space_prefix", &add_space_prefix, err, errlen)) < 0) return rc;
    if (t->add_bos && t->bos < 0)
        return status_fail(err, errlen, STATUS_BAD_INPUT,
                           "%s: key tokenizer.ggml.add_bos_token: BOS is to be added but the file names no BOS token", path);
    if (t->add_eos && t->eos < 0)
        return status_fail(err, errlen, STATUS_BAD_INPUT,
                           "%s: key tokenizer.ggml.add_eos_token: EOS is to be added but the file names no EOS token", path);
    if (t->kind == TOK_KIND_SPM && add_space_prefix) {
        memcpy(t->prefix, "\xE2\x96\x81", 3);
        t->prefix_len = 3;
        t->prepend = TOK_PREPEND_AFTER_SPECIAL;
        t->strip_space_prefix = 1;
    }
    if ((rc = tok_finish(t)) < 0 || (rc = tl_collect_eog(t)) < 0)
        return status_fail(err, errlen, rc, "%s: tokenizer: out of memory", path);
    return 0;
}

int tokenizer_from_gguf(tokenizer **out, const gguf_file *f, char *err, size_t errlen) {
    *out = NULL;
    struct tokenizer *t = tok_alloc();
    if (!t) return status_fail(err, errlen, STATUS_NO_MEMORY, "%s: tokenizer: out of memory", gguf_path(f));
    int rc = tl_gguf_load(t, f, err, errlen);
    if (rc < 0) {
        tokenizer_free(t);
        return rc;
    }
    *out = t;
    return 0;
}

/* ---- Hugging Face --------------------------------------------------------- */

/* Reads and parses PATH; STATUS_NOT_FOUND (no message) when it is absent. */
static int tl_json_read(const char *path, cJSON **out, char *err, size_t errlen) {
    *out = NULL;
    FILE *fp = fopen(path, "rb");
    if (!fp) {
        if (errno == ENOENT) return STATUS_NOT_FOUND;
        return status_fail(err, errlen, STATUS_IO, "%s: %s", path, strerror(errno));
    }
    char *buf = NULL;
    size_t len = 0, cap = 0;
    for (;;) {
        if (len == cap) {
            if (cap >= ((size_t)1 << 30)) {
                free(buf);
                fclose(fp);
                return status_fail(err, errlen, STATUS_BAD_INPUT, "%s: larger than 1 GiB", path);
            }
            cap = cap ? cap * 2 : 65536;
            char *b = realloc(buf, cap);
            if (!b) {
                free(buf);
                fclose(fp);
                return status_fail(err, errlen, STATUS_NO_MEMORY, "%s: out of memory", path);
            }
            buf = b;
        }
        size_t got = fread(buf + len, 1, cap - len, fp);
        len += got;
        if (got == 0) break;
    }
    int bad = ferror(fp);
    fclose(fp);
    if (bad) {
        free(buf);
        return status_fail(err, errlen, STATUS_IO, "%s: read error", path);
    }
    const char *end = NULL;
    cJSON *j = cJSON_ParseWithLengthOpts(buf, len, &end, 0);
    if (!j) {
        long at = end ? (long)(end - buf) : -1;
        free(buf);
        return status_fail(err, errlen, STATUS_BAD_INPUT, "%s: invalid JSON near byte %ld", path, at);
    }
    free(buf);
    *out = j;
    return 0;
}

static const cJSON *tl_get(const cJSON *o, const char *key) { return cJSON_GetObjectItemCaseSensitive(o, key); }

static const char *tl_get_str(const cJSON *o, const char *key) {
    const cJSON *v = tl_get(o, key);
    return cJSON_IsString(v) ? v->valuestring : NULL;
}

static int tl_get_bool(const cJSON *o, const char *key, int dflt) {
    const cJSON *v = tl_get(o, key);
    return cJSON_IsBool(v) ? cJSON_IsTrue(v) : dflt;
}

/* The name of a special token in tokenizer_config.json: a string or an
 * object with "content". */
static const char *tl_token_name(const cJSON *v) {
    if (cJSON_IsString(v)) return v->valuestring;
    if (cJSON_IsObject(v)) return tl_get_str(v, "content");
    return NULL;
}

static int tl_hf_fail_type(char *err, size_t errlen, const char *path, const char *what, const cJSON *node) {
    const char *type = tl_get_str(node, "type");
    return status_fail(err, errlen, STATUS_UNSUPPORTED, "%s: %s: type \"%s\" is not supported", path, what,
                       type ? type : "(none)");
}

static int tl_set_prefix(struct tokenizer *t, const char *p, int mode) {
    size_t n = strlen(p);
    if (n >= sizeof t->prefix) return STATUS_UNSUPPORTED;
    memcpy(t->prefix, p, n);
    t->prefix_len = n;
    t->prepend = mode;
    return 0;
}

static int tl_hf_normalizer(struct tokenizer *t, const cJSON *n, const char *path, char *err, size_t errlen) {
    if (!n || cJSON_IsNull(n)) return 0;
    const char *type = tl_get_str(n, "type");
    if (!type) return tl_hf_fail_type(err, errlen, path, "normalizer", n);
    if (strcmp(type, "Sequence") == 0) {
        const cJSON *e;
        cJSON_ArrayForEach(e, tl_get(n, "normalizers")) {
            int rc = tl_hf_normalizer(t, e, path, err, errlen);
            if (rc < 0) return rc;
        }
        return 0;
    }
    if (strcmp(type, "Prepend") == 0) {
        const char *p = tl_get_str(n, "prepend");
        if (!p || tl_set_prefix(t, p, TOK_PREPEND_ALWAYS) < 0)
            return status_fail(err, errlen, STATUS_UNSUPPORTED, "%s: normalizer Prepend: prepend \"%s\" is not supported",
                               path, p ? p : "(none)");
        return 0;
    }
    if (strcmp(type, "Replace") == 0) {
        const char *from = tl_get_str(tl_get(n, "pattern"), "String"), *to = tl_get_str(n, "content");
        if (!from || !to || strcmp(from, " ") != 0 || strcmp(to, "\xE2\x96\x81") != 0)
            return status_fail(err, errlen, STATUS_UNSUPPORTED,
                               "%s: normalizer Replace: only \" \" -> \"\xE2\x96\x81\" is supported (got \"%s\" -> \"%s\")",
                               path, from ? from : "(regex)", to ? to : "(none)");
        t->escape_spaces = 1;
        return 0;
    }
    return tl_hf_fail_type(err, errlen, path, "normalizer", n);
}

static const char tl_regex_gpt2[] = "'s|'t|'re|'ve|'m|'ll|'d| ?\\p{L}+| ?\\p{N}+| ?[^\\s\\p{L}\\p{N}]+|\\s+(?!\\S)|\\s+";
static const char tl_regex_llama3[] =
    "(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\\r\\n\\p{L}\\p{N}]?\\p{L}+|\\p{N}{1,3}| ?[^\\s\\p{L}\\p{N}]+[\\r\\n]*|"
    "\\s*[\\r\\n]+|\\s+(?!\\S)|\\s+";

static int tl_set_pretok(struct tokenizer *t, enum tok_pretok_kind k, const char *path, char *err, size_t errlen) {
    if (t->pretok != TOK_PRETOK_NONE && t->pretok != k)
        return status_fail(err, errlen, STATUS_UNSUPPORTED, "%s: pre_tokenizer: two different splitting stages are not supported",
                           path);
    t->pretok = k;
    return 0;
}

static int tl_hf_pretok(struct tokenizer *t, const cJSON *p, const char *path, char *err, size_t errlen) {
    if (!p || cJSON_IsNull(p)) return 0;
    const char *type = tl_get_str(p, "type");
    if (!type) return tl_hf_fail_type(err, errlen, path, "pre_tokenizer", p);
    if (strcmp(type, "Sequence") == 0) {
        const cJSON *e;
        cJSON_ArrayForEach(e, tl_get(p, "pretokenizers")) {
            int rc = tl_hf_pretok(t, e, path, err, errlen);
            if (rc < 0) return rc;
        }
        return 0;
    }
    if (strcmp(type, "ByteLevel") == 0) {
        t->byte_level = 1;
        if (tl_get_bool(p, "add_prefix_space", 0)) tl_set_prefix(t, " ", TOK_PREPEND_IF_MISSING);
        if (tl_get_bool(p, "use_regex", 1)) return tl_set_pretok(t, TOK_PRETOK_GPT2, path, err, errlen);
        return 0;
    }
    if (strcmp(type, "Split") == 0) {
        const char *re = tl_get_str(tl_get(p, "pattern"), "Regex");
        const char *behavior = tl_get_str(p, "behavior");
        if (!re || (behavior && strcmp(behavior, "Isolated") != 0) || tl_get_bool(p, "invert", 0))
            return status_fail(err, errlen, STATUS_UNSUPPORTED,
                               "%s: pre_tokenizer Split: only an isolating Regex is supported (behavior \"%s\")", path,
                               behavior ? behavior : "(none)");
        if (strcmp(re, tl_regex_gpt2) == 0) return tl_set_pretok(t, TOK_PRETOK_GPT2, path, err, errlen);
        if (strcmp(re, tl_regex_llama3) == 0) return tl_set_pretok(t, TOK_PRETOK_LLAMA3, path, err, errlen);
        return status_fail(err, errlen, STATUS_UNSUPPORTED,
                           "%s: pre_tokenizer Split: regex \"%.120s\" is not supported (the GPT-2 and Llama-3 ones are)",
                           path, re);
    }
    if (strcmp(type, "Metaspace") == 0) {
        const char *rep = tl_get_str(p, "replacement"), *scheme = tl_get_str(p, "prepend_scheme");
        if (rep && strcmp(rep, "\xE2\x96\x81") != 0)
            return status_fail(err, errlen, STATUS_UNSUPPORTED, "%s: pre_tokenizer Metaspace: replacement \"%s\" is not supported",
                               path, rep);
        t->escape_spaces = 1;
        int mode = tl_get_bool(p, "add_prefix_space", 1) ? TOK_PREPEND_ALWAYS : TOK_PREPEND_NEVER;
        if (scheme) mode = strcmp(scheme, "first") == 0 ? TOK_PREPEND_FIRST
                           : strcmp(scheme, "never") == 0 ? TOK_PREPEND_NEVER : TOK_PREPEND_ALWAYS;
        if (mode != TOK_PREPEND_NEVER) tl_set_prefix(t, "\xE2\x96\x81", mode);
        if (tl_get_bool(p, "split", 1)) return tl_set_pretok(t, TOK_PRETOK_METASPACE, path, err, errlen);
        return 0;
    }
    return tl_hf_fail_type(err, errlen, path, "pre_tokenizer", p);
}

static int tl_hf_decoder(struct tokenizer *t, const cJSON *d, const char *path, char *err, size_t errlen) {
    if (!d || cJSON_IsNull(d)) return 0;
    const char *type = tl_get_str(d, "type");
    if (!type) return tl_hf_fail_type(err, errlen, path, "decoder", d);
    if (strcmp(type, "Sequence") == 0) {
        const cJSON *e;
        cJSON_ArrayForEach(e, tl_get(d, "decoders")) {
            int rc = tl_hf_decoder(t, e, path, err, errlen);
            if (rc < 0) return rc;
        }
        return 0;
    }
    if (strcmp(type, "ByteLevel") == 0) {
        if (!t->byte_level)
            return status_fail(err, errlen, STATUS_UNSUPPORTED, "%s: decoder ByteLevel without a ByteLevel pre_tokenizer", path);
        return 0;
    }
    if (strcmp(type, "Replace") == 0) {
        const char *from = tl_get_str(tl_get(d, "pattern"), "String"), *to = tl_get_str(d, "content");
        if (!from || !to || strcmp(from, "\xE2\x96\x81") != 0 || strcmp(to, " ") != 0)
            return status_fail(err, errlen, STATUS_UNSUPPORTED, "%s: decoder Replace: only \"\xE2\x96\x81\" -> \" \" is supported",
                               path);
        t->decode_spaces = 1;
        return 0;
    }
    if (strcmp(type, "Metaspace") == 0) {
        t->decode_spaces = 1;
        t->strip_space_prefix = t->prepend != TOK_PREPEND_NEVER;
        return 0;
    }
    if (strcmp(type, "Strip") == 0) {
        const cJSON *start = tl_get(d, "start");
        t->strip_space_prefix = cJSON_IsNumber(start) && start->valuedouble >= 1;
        return 0;
    }
    if (strcmp(type, "ByteFallback") == 0 || strcmp(type, "Fuse") == 0) return 0; /* bytes are typed BYTE */
    return tl_hf_fail_type(err, errlen, path, "decoder", d);
}

/* An id from a JSON number: -2 when not an integer inside the vocabulary. */
static int64_t tl_json_id(const cJSON *v, int32_t n_vocab) {
    if (!cJSON_IsNumber(v)) return -2;
    double d = v->valuedouble;
    if (d < 0 || d >= n_vocab || d != (double)(int64_t)d) return -2;
    return (int64_t)d;
}

/* BOS/EOS from the post_processor: TemplateProcessing's "single" template
 * (special tokens before $A are added at the start, after it at the end),
 * RobertaProcessing's cls/sep. */
static int tl_hf_post(struct tokenizer *t, const cJSON *p, int *decided) {
    if (!p || cJSON_IsNull(p)) return 0;
    const char *type = tl_get_str(p, "type");
    if (!type) return 0;
    if (strcmp(type, "Sequence") == 0) {
        const cJSON *e;
        cJSON_ArrayForEach(e, tl_get(p, "processors")) tl_hf_post(t, e, decided);
        return 0;
    }
    if (strcmp(type, "RobertaProcessing") == 0) {
        int64_t cls = tl_json_id(cJSON_GetArrayItem(tl_get(p, "cls"), 1), t->n_vocab);
        int64_t sep = tl_json_id(cJSON_GetArrayItem(tl_get(p, "sep"), 1), t->n_vocab);
        if (cls >= 0) t->bos = (int32_t)cls, t->add_bos = 1;
        if (sep >= 0) t->eos = (int32_t)sep, t->add_eos = 1;
        *decided = 1;
        return 0;
    }
    if (strcmp(type, "TemplateProcessing") != 0) return 0;
    const cJSON *single = tl_get(p, "single"), *specials = tl_get(p, "special_tokens"), *e;
    int seen_a = 0;
    t->add_bos = t->add_eos = 0;
    cJSON_ArrayForEach(e, single) {
        const cJSON *sp = tl_get(e, "SpecialToken");
        if (!sp) {
            if (tl_get(e, "Sequence")) seen_a = 1;
            continue;
        }
        const char *name = tl_get_str(sp, "id");
        if (!name) continue;
        int64_t id = tl_json_id(cJSON_GetArrayItem(tl_get(tl_get(specials, name), "ids"), 0), t->n_vocab);
        if (id < 0) id = tokenizer_token_find(t, name, strlen(name));
        if (id < 0) continue;
        if (!seen_a) t->bos = (int32_t)id, t->add_bos = 1;
        else t->eos = (int32_t)id, t->add_eos = 1;
    }
    *decided = 1;
    return 0;
}

struct tl_hf_names {
    const char **name; /* (n_vocab) token text or NULL */
    uint8_t *type;
};

static int tl_hf_vocab(struct tokenizer *t, const cJSON *model, const cJSON *added, const char *path, char *err,
                       size_t errlen) {
    const cJSON *vocab = tl_get(model, "vocab"), *e;
    if (!cJSON_IsObject(vocab) || !vocab->child)
        return status_fail(err, errlen, STATUS_BAD_INPUT, "%s: model.vocab: missing (no token list)", path);
    int64_t max_id = -1;
    cJSON_ArrayForEach(e, vocab) {
        int64_t id = tl_json_id(e, 1 << 24);
        if (id < 0)
            return status_fail(err, errlen, STATUS_BAD_INPUT, "%s: model.vocab: token \"%.64s\" has id %.17g (want 0..%d)",
                               path, e->string, cJSON_IsNumber(e) ? e->valuedouble : -1.0, (1 << 24) - 1);
        if (id > max_id) max_id = id;
    }
    cJSON_ArrayForEach(e, added) {
        int64_t id = tl_json_id(tl_get(e, "id"), 1 << 24);
        const char *content = tl_get_str(e, "content");
        if (id < 0 || !content)
            return status_fail(err, errlen, STATUS_BAD_INPUT, "%s: added_tokens: entry \"%.64s\" needs an id in 0..%d and a content",
                               path, content ? content : "(none)", (1 << 24) - 1);
        if (id > max_id) max_id = id;
    }
    t->n_vocab = (int32_t)(max_id + 1);
    const char **names = calloc((size_t)t->n_vocab, sizeof *names);
    t->scores = calloc((size_t)t->n_vocab, sizeof *t->scores);
    t->types = malloc((size_t)t->n_vocab);
    if (!names || !t->scores || !t->types) {
        free(names);
        return status_fail(err, errlen, STATUS_NO_MEMORY, "%s: tokenizer: out of memory", path);
    }
    memset(t->types, TOK_TYPE_NORMAL, (size_t)t->n_vocab);
    cJSON_ArrayForEach(e, vocab) names[(int64_t)e->valuedouble] = e->string;
    cJSON_ArrayForEach(e, added) {
        int64_t id = (int64_t)tl_get(e, "id")->valuedouble;
        names[id] = tl_get_str(e, "content");
        t->types[id] = tl_get_bool(e, "special", 0) ? TOK_TYPE_CONTROL : TOK_TYPE_USER;
    }
    int rc = 0;
    for (int32_t id = 0; id < t->n_vocab && rc == 0; id++) {
        int32_t got;
        if (!names[id]) t->types[id] = TOK_TYPE_UNUSED; /* a hole in the ids */
        rc = tok_str_add(t, names[id] ? names[id] : "", names[id] ? strlen(names[id]) : 0, &got);
    }
    free(names);
    if (rc < 0 || (rc = tok_map_build(t)) < 0) return status_fail(err, errlen, rc, "%s: tokenizer: out of memory", path);
    return 0;
}

static int tl_hf_merges(struct tokenizer *t, const cJSON *merges, const char *path, char *err, size_t errlen) {
    const cJSON *e;
    int32_t rank = 0;
    cJSON_ArrayForEach(e, merges) {
        int rc;
        if (cJSON_IsString(e)) {
            const char *s = e->valuestring;
            size_t n = strlen(s);
            const char *sp = tl_split_merge(s, n);
            if (!sp)
                return status_fail(err, errlen, STATUS_BAD_INPUT, "%s: model.merges: merge %d \"%.64s\" is not \"left right\"",
                                   path, (int)rank, s);
            rc = tl_merge(t, s, (size_t)(sp - s), sp + 1, (size_t)(s + n - sp - 1), rank);
        } else {
            const cJSON *l = cJSON_GetArrayItem(e, 0), *r = cJSON_GetArrayItem(e, 1);
            if (!cJSON_IsString(l) || !cJSON_IsString(r) || cJSON_GetArraySize(e) != 2)
                return status_fail(err, errlen, STATUS_BAD_INPUT, "%s: model.merges: merge %d is not a string or a pair of strings",
                                   path, (int)rank);
            rc = tl_merge(t, l->valuestring, strlen(l->valuestring), r->valuestring, strlen(r->valuestring), rank);
        }
        if (rc < 0) return status_fail(err, errlen, rc, "%s: tokenizer: out of memory", path);
        rank++;
    }
    return 0;
}

/* config.json / generation_config.json: bos_token_id, eos_token_id (a number
 * or a list of them; every one ends generation). */
static int tl_hf_config_ids(struct tokenizer *t, const cJSON *cfg, const char *path, int set_bos, char *err,
                            size_t errlen) {
    if (!cfg) return 0;
    const cJSON *bos = tl_get(cfg, "bos_token_id"), *eos = tl_get(cfg, "eos_token_id"), *e;
    if (set_bos && bos && !cJSON_IsNull(bos)) {
        int64_t id = tl_json_id(bos, t->n_vocab);
        if (id < 0)
            return status_fail(err, errlen, STATUS_BAD_INPUT, "%s: bos_token_id %.17g is outside the vocabulary (%d tokens)",
                               path, cJSON_IsNumber(bos) ? bos->valuedouble : -1.0, (int)t->n_vocab);
        t->bos = (int32_t)id;
    }
    if (eos && !cJSON_IsNull(eos)) {
        int first = 1;
        const cJSON *one = cJSON_IsArray(eos) ? eos->child : eos;
        for (e = one; e; e = cJSON_IsArray(eos) ? e->next : NULL) {
            int64_t id = tl_json_id(e, t->n_vocab);
            if (id < 0)
                return status_fail(err, errlen, STATUS_BAD_INPUT, "%s: eos_token_id %.17g is outside the vocabulary (%d tokens)",
                                   path, cJSON_IsNumber(e) ? e->valuedouble : -1.0, (int)t->n_vocab);
            if (first && set_bos) t->eos = (int32_t)id;
            first = 0;
            if (tok_eog_add(t, (int32_t)id) < 0) return status_fail(err, errlen, STATUS_NO_MEMORY, "%s: out of memory", path);
        }
    }
    return 0;
}

static int tl_hf_load(struct tokenizer *t, const char *dir, char *err, size_t errlen) {
    char path[4096], cfg_path[4096], gen_path[4096], tc_path[4096];
    snprintf(path, sizeof path, "%s/tokenizer.json", dir);
    snprintf(cfg_path, sizeof cfg_path, "%s/config.json", dir);
    snprintf(gen_path, sizeof gen_path, "%s/generation_config.json", dir);
    snprintf(tc_path, sizeof tc_path, "%s/tokenizer_config.json", dir);
    cJSON *root = NULL, *tc = NULL, *cfg = NULL, *gen = NULL;
    int rc = tl_json_read(path, &root, err, errlen);
    if (rc == STATUS_NOT_FOUND) return status_fail(err, errlen, rc, "%s: no such file", path);
    if (rc < 0) return rc;
    if ((rc = tl_json_read(tc_path, &tc, err, errlen)) < 0 && rc != STATUS_NOT_FOUND) goto done;
    if ((rc = tl_json_read(cfg_path, &cfg, err, errlen)) < 0 && rc != STATUS_NOT_FOUND) goto done;
    if ((rc = tl_json_read(gen_path, &gen, err, errlen)) < 0 && rc != STATUS_NOT_FOUND) goto done;
    rc = 0;

    const cJSON *model = tl_get(root, "model");
    const char *mtype = tl_get_str(model, "type");
    if (!cJSON_IsObject(model)) {
        rc = status_fail(err, errlen, STATUS_BAD_INPUT, "%s: model: missing", path);
        goto done;
    }
    if (mtype ? strcmp(mtype, "BPE") != 0 : !tl_get(model, "merges")) {
        rc = status_fail(err, errlen, STATUS_UNSUPPORTED, "%s: model.type: \"%s\" is not supported (BPE)", path,
                         mtype ? mtype : "(none)");
        goto done;
    }
    t->kind = TOK_KIND_BPE;
    const cJSON *added = tl_get(root, "added_tokens");
    if ((rc = tl_hf_vocab(t, model, added, path, err, errlen)) < 0) goto done;
    t->byte_fallback = tl_get_bool(model, "byte_fallback", 0);
    t->ignore_merges = tl_get_bool(model, "ignore_merges", 0);
    if (t->byte_fallback) {
        for (int32_t id = 0; id < t->n_vocab; id++) {
            int b = tok_parse_byte_token(t->arena + t->strs[id].off, t->strs[id].len);
            if (b >= 0 && t->types[id] == TOK_TYPE_NORMAL) t->types[id] = TOK_TYPE_BYTE, t->byte_ids[b] = id;
        }
    }
    const char *unk = tl_get_str(model, "unk_token");
    if (unk) t->unk = tokenizer_token_find(t, unk, strlen(unk));
    if ((rc = tl_hf_normalizer(t, tl_get(root, "normalizer"), path, err, errlen)) < 0) goto done;
    if ((rc = tl_hf_pretok(t, tl_get(root, "pre_tokenizer"), path, err, errlen)) < 0) goto done;
    if ((rc = tl_hf_decoder(t, tl_get(root, "decoder"), path, err, errlen)) < 0) goto done;
    if (t->byte_level && (rc = tl_byte_chars(t)) < 0) {
        rc = status_fail(err, errlen, rc, "%s: tokenizer: out of memory", path);
        goto done;
    }
    const cJSON *merges = tl_get(model, "merges");
    if (!cJSON_IsArray(merges)) {
        rc = status_fail(err, errlen, STATUS_BAD_INPUT, "%s: model.merges: missing (BPE needs merges)", path);
        goto done;
    }
    if ((rc = tl_hf_merges(t, merges, path, err, errlen)) < 0) goto done;

    /* BOS/EOS: the names in tokenizer_config.json, then config.json's ids;
     * whether they are added: the post_processor, else tokenizer_config.json. */
    const char *bos_name = tl_token_name(tl_get(tc, "bos_token"));
    const char *eos_name = tl_token_name(tl_get(tc, "eos_token"));
    if (bos_name) t->bos = tokenizer_token_find(t, bos_name, strlen(bos_name));
    if (eos_name) t->eos = tokenizer_token_find(t, eos_name, strlen(eos_name));
    if ((rc = tl_hf_config_ids(t, cfg, cfg_path, 1, err, errlen)) < 0) goto done;
    if ((rc = tl_hf_config_ids(t, gen, gen_path, 0, err, errlen)) < 0) goto done;
    int decided = 0;
    tl_hf_post(t, tl_get(root, "post_processor"), &decided);
    if (!decided) {
        t->add_bos = tl_get_bool(tc, "add_bos_token", 0);
        t->add_eos = tl_get_bool(tc, "add_eos_token", 0);
    }
    if (t->add_bos && t->bos < 0) {
        rc = status_fail(err, errlen, STATUS_BAD_INPUT, "%s: BOS is to be added but no BOS token is named", dir);
        goto done;
    }
    if (t->add_eos && t->eos < 0) {
        rc = status_fail(err, errlen, STATUS_BAD_INPUT, "%s: EOS is to be added but no EOS token is named", dir);
        goto done;
    }
    if ((rc = tok_finish(t)) < 0 || (rc = tl_collect_eog(t)) < 0)
        rc = status_fail(err, errlen, rc, "%s: tokenizer: out of memory", path);
done:
    cJSON_Delete(root);
    cJSON_Delete(tc);
    cJSON_Delete(cfg);
    cJSON_Delete(gen);
    return rc;
}

int tokenizer_from_hf(tokenizer **out, const char *dir, char *err, size_t errlen) {
    *out = NULL;
    struct tokenizer *t = tok_alloc();
    if (!t) return status_fail(err, errlen, STATUS_NO_MEMORY, "%s: tokenizer: out of memory", dir);
    int rc = tl_hf_load(t, dir, err, errlen);
    if (rc < 0) {
        tokenizer_free(t);
        return rc;
    }
    *out = t;
    return 0;
}

int tokenizer_load(tokenizer **out, const char *path, char *err, size_t errlen) {
    *out = NULL;
    struct stat st;
    if (stat(path, &st) != 0)
        return status_fail(err, errlen, errno == ENOENT ? STATUS_NOT_FOUND : STATUS_IO, "%s: %s", path, strerror(errno));
    if (S_ISDIR(st.st_mode)) return tokenizer_from_hf(out, path, err, errlen);
    gguf_file *f;
    int rc = gguf_open(&f, path, err, errlen);
    if (rc < 0) return rc;
    rc = tokenizer_from_gguf(out, f, err, errlen);
    gguf_close(f);
    return rc;
}
