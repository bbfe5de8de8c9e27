/* The model's description for the router, from GGUF metadata and tensor
 * infos or from a Hugging Face config.json, and the default layer split
 * (common/layersplit). */
#include "router/modelinfo.h"

#include <cjson/cJSON.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>

#include "common/gguf.h"
#include "common/status.h"

void modelinfo_basename(const char *path, char *out, size_t size) {
    size_t n = strlen(path);
    while (n > 1 && path[n - 1] == '/') n--;
    size_t b = n;
    while (b > 0 && path[b - 1] != '/') b--;
    snprintf(out, size, "%.*s", (int)(n - b), path + b);
}

void modelinfo_free(struct modelinfo *mi) {
    layersplit_sizes_free(&mi->sizes);
    memset(mi, 0, sizeof *mi);
}

static int modelinfo_gguf(struct modelinfo *mi, const char *path, char *err, size_t errlen) {
    gguf_file *f = NULL;
    int rc = gguf_open(&f, path, err, errlen);
    if (rc < 0) return rc;
    struct gguf_str arch;
    rc = STATUS_BAD_INPUT;
    if (gguf_get_str(f, "general.architecture", &arch) < 0 || arch.len == 0 ||
        arch.len >= sizeof mi->arch) {
        snprintf(err, errlen, "%s: general.architecture is missing or too long", path);
        goto done;
    }
    snprintf(mi->arch, sizeof mi->arch, "%.*s", (int)arch.len, arch.ptr);
    char key[96];
    uint32_t u = 0;
    snprintf(key, sizeof key, "%s.block_count", mi->arch);
    if (gguf_get_u32(f, key, &u) < 0 || u == 0 || u > 100000) {
        snprintf(err, errlen, "%s: %s is missing or out of range (%u)", path, key, u);
        goto done;
    }
    mi->n_layers = (int32_t)u;
    snprintf(key, sizeof key, "%s.context_length", mi->arch);
    u = 0;
    if (gguf_get_u32(f, key, &u) < 0 || u == 0 || u > (1u << 24)) {
        snprintf(err, errlen, "%s: %s is missing or out of range (%u)", path, key, u);
        goto done;
    }
    mi->n_ctx = (int32_t)u;
    enum gguf_vtype et;
    uint64_t nv = 0;
    if (gguf_get_arr(f, "tokenizer.ggml.tokens", &et, &nv) == 0) mi->n_vocab = (int32_t)nv;
    rc = layersplit_sizes_gguf(&mi->sizes, f, mi->n_layers, err, errlen);
done:
    gguf_close(f);
    return rc;
}

static int modelinfo_json_int(const cJSON *root, const char *name, int32_t *out) {
    const cJSON *v = cJSON_GetObjectItemCaseSensitive(root, name);
    if (!cJSON_IsNumber(v) || v->valuedouble < 0 || v->valuedouble > 1e9) return -1;
    *out = (int32_t)v->valuedouble;
    return 0;
}

static int modelinfo_hf(struct modelinfo *mi, const char *dir, char *err, size_t errlen) {
    char path[4096];
    snprintf(path, sizeof path, "%s/config.json", dir);
    FILE *fp = fopen(path, "rb");
    if (!fp) {
        snprintf(err, errlen, "%s: cannot open", path);
        return STATUS_IO;
    }
    char *text = NULL;
    size_t n = 0, cap = 0;
    for (;;) {
        if (n + 4096 + 1 > cap) {
            cap = cap ? cap * 2 : 16384;
            char *t = realloc(text, cap);
            if (!t || cap > (64u << 20)) {
                free(t ? t : text);
                fclose(fp);
                snprintf(err, errlen, "%s: too large or out of memory", path);
                return STATUS_BAD_INPUT;
            }
            text = t;
        }
        size_t got = fread(text + n, 1, 4096, fp);
        n += got;
        if (got < 4096) break;
    }
    fclose(fp);
    text[n] = '\0';
    cJSON *root = cJSON_Parse(text);
    free(text);
    if (!root) {
        snprintf(err, errlen, "%s: not valid JSON", path);
        return STATUS_BAD_INPUT;
    }
    int rc = STATUS_BAD_INPUT;
    int32_t dim = 0, ffn = 0, heads = 0, kv_heads = 0, head_dim = 0;
    const char *missing = NULL;
    if (modelinfo_json_int(root, "num_hidden_layers", &mi->n_layers) < 0 || mi->n_layers < 1)
        missing = "num_hidden_layers";
    else if (modelinfo_json_int(root, "max_position_embeddings", &mi->n_ctx) < 0 || mi->n_ctx < 1)
        missing = "max_position_embeddings";
    else if (modelinfo_json_int(root, "vocab_size", &mi->n_vocab) < 0)
        missing = "vocab_size";
    else if (modelinfo_json_int(root, "hidden_size", &dim) < 0)
        missing = "hidden_size";
    if (missing) {
        snprintf(err, errlen, "%s: %s is missing or not a number in range", path, missing);
        goto done;
    }
    modelinfo_json_int(root, "intermediate_size", &ffn);
    modelinfo_json_int(root, "num_attention_heads", &heads);
    if (modelinfo_json_int(root, "num_key_value_heads", &kv_heads) < 0) kv_heads = heads;
    if (modelinfo_json_int(root, "head_dim", &head_dim) < 0 && heads > 0) head_dim = dim / heads;
    const cJSON *mt = cJSON_GetObjectItemCaseSensitive(root, "model_type");
    snprintf(mi->arch, sizeof mi->arch, "%s", cJSON_IsString(mt) ? mt->valuestring : "llama");
    /* A worker estimates from the same fields (common/model.c reads them
     * with the same defaults), so both sides split alike. */
    struct layersplit_shapes sh = {mi->n_layers, mi->n_vocab, dim, ffn, heads, kv_heads, head_dim};
    char why[256];
    rc = layersplit_sizes_shapes(&mi->sizes, &sh, why, sizeof why);
    if (rc < 0) snprintf(err, errlen, "%s: %s", path, why);
done:
    cJSON_Delete(root);
    return rc;
}

int modelinfo_load(struct modelinfo *mi, const char *path, char *err, size_t errlen) {
    memset(mi, 0, sizeof *mi);
    struct stat st;
    if (stat(path, &st) != 0) {
        snprintf(err, errlen, "%s: no such file or directory", path);
        return STATUS_NOT_FOUND;
    }
    int rc = S_ISDIR(st.st_mode) ? modelinfo_hf(mi, path, err, errlen)
                                 : modelinfo_gguf(mi, path, err, errlen);
    if (rc < 0) {
        modelinfo_free(mi);
        return rc;
    }
    modelinfo_basename(path, mi->id, sizeof mi->id);
    return STATUS_OK;
}

int modelinfo_split(const struct modelinfo *mi, int32_t n_stages, int32_t *first, int32_t *end,
                    char *err, size_t errlen) {
    char why[256];
    int rc = layersplit_ranges(&mi->sizes, n_stages, first, end, why, sizeof why);
    if (rc < 0) snprintf(err, errlen, "model %s: %s", mi->id, why);
    return rc;
}
