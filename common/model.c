/* Model files: a GGUF file or a Hugging Face directory, read into one
 * description (hyper-parameters) and one tensor namespace (GGUF names),
 * with every tensor the architecture needs checked for presence, shape and
 * type at open, and the tokenizer that comes with the model. */
#include "model.h"

#include <cjson/cJSON.h>
#include <errno.h>
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>

#include "gguf.h"
#include "safetensors.h"
#include "status.h"

#define MODEL_JSON_MAX (64u << 20) /* config.json / index.json size limit */

struct model_entry {
    char *name; /* GGUF name */
    struct model_tensor t;
};

struct model_file {
    char *path;
    struct model_hparams hp;
    tokenizer *tok;
    gguf_file *gguf;          /* GGUF models */
    safetensors_file **shards; /* Hugging Face models */
    int n_shards;
    struct model_entry *entries; /* Hugging Face models: GGUF name -> tensor */
    int64_t n_entries;
};

void model_file_close(model_file *m) {
    if (!m) return;
    tokenizer_free(m->tok);
    gguf_close(m->gguf);
    for (int i = 0; i < m->n_shards; i++) safetensors_close(m->shards[i]);
    free(m->shards);
    for (int64_t i = 0; i < m->n_entries; i++) free(m->entries[i].name);
    free(m->entries);
    free(m->path);
    free(m);
}

const char *model_file_path(const model_file *m) { return m->path; }
const struct model_hparams *model_file_hparams(const model_file *m) { return &m->hp; }
const tokenizer *model_file_tokenizer(const model_file *m) { return m->tok; }

int model_file_tensor(const model_file *m, const char *name, struct model_tensor *out) {
    if (m->gguf) {
        const struct gguf_tensor *t = gguf_tensor_find(m->gguf, name);
        if (!t) return STATUS_NOT_FOUND;
        out->type = t->type;
        out->n_dims = t->n_dims;
        memcpy(out->ne, t->ne, sizeof out->ne);
        out->data = t->data;
        out->nbytes = t->nbytes;
        return STATUS_OK;
    }
    for (int64_t i = 0; i < m->n_entries; i++) {
        if (strcmp(m->entries[i].name, name) == 0) {
            *out = m->entries[i].t;
            return STATUS_OK;
        }
    }
    return STATUS_NOT_FOUND;
}

/* ---- rope ---- */

void model_rope_inv_freq(const struct model_hparams *hp, float *inv_freq) {
    int n = hp->head_dim / 2;
    double theta = hp->rope_theta > 0 ? hp->rope_theta : 10000.0;
    for (int i = 0; i < n; i++) {
        double f = pow(theta, -2.0 * i / hp->head_dim);
        if (hp->rope_scaling == ROPE_SCALING_LINEAR && hp->rope_factor > 0) {
            f /= hp->rope_factor;
        } else if (hp->rope_scaling == ROPE_SCALING_LLAMA3 && hp->rope_factor > 0) {
            /* Meta's reference: frequencies whose wavelength is short next to the
             * original context keep their value, long ones are divided by the
             * factor, and the band between is interpolated smoothly */
            double orig = hp->rope_orig_ctx > 0 ? hp->rope_orig_ctx : 8192;
            double lo = hp->rope_low_freq_factor, hi = hp->rope_high_freq_factor;
            double low_freq_wavelen = orig / lo, high_freq_wavelen = orig / hi;
            double wavelen = 2.0 * M_PI / f;
            if (wavelen < high_freq_wavelen) {
                /* unchanged */
            } else if (wavelen > low_freq_wavelen) {
                f /= hp->rope_factor;
            } else {
                double smooth = (orig / wavelen - lo) / (hi - lo);
                f = (1.0 - smooth) * f / hp->rope_factor + smooth * f;
            }
        }
        if (hp->rope_freq_factors) f /= hp->rope_freq_factors[i];
        inv_freq[i] = (float)f;
    }
}

/* ---- shared checks ---- */

/* Checks hyper-parameters for consistency; fills head_dim when 0. */
static int check_hparams(const char *path, struct model_hparams *hp, char *err, size_t errlen) {
    struct { const char *what; int32_t v; } pos[] = {
        {"n_vocab", hp->n_vocab}, {"dim (embedding length)", hp->dim}, {"n_layers (block count)", hp->n_layers},
        {"n_heads", hp->n_heads}, {"n_kv_heads", hp->n_kv_heads}, {"ffn_dim", hp->ffn_dim}, {"ctx_len", hp->ctx_len}};
    for (size_t i = 0; i < sizeof pos / sizeof pos[0]; i++)
        if (pos[i].v <= 0) return status_fail(err, errlen, STATUS_BAD_INPUT, "%s: %s is %d, must be positive", path, pos[i].what, pos[i].v);
    if (hp->n_layers > 10000) return status_fail(err, errlen, STATUS_BAD_INPUT, "%s: block count %d is implausible", path, hp->n_layers);
    if (hp->head_dim == 0) {
        if (hp->dim % hp->n_heads != 0)
            return status_fail(err, errlen, STATUS_BAD_INPUT, "%s: dim %d is not a multiple of n_heads %d", path, hp->dim, hp->n_heads);
        hp->head_dim = hp->dim / hp->n_heads;
    }
    if (hp->head_dim <= 0 || hp->head_dim % 2 != 0)
        return status_fail(err, errlen, STATUS_BAD_INPUT, "%s: head_dim %d must be positive and even", path, hp->head_dim);
    if (hp->n_heads % hp->n_kv_heads != 0)
        return status_fail(err, errlen, STATUS_BAD_INPUT, "%s: n_heads %d is not a multiple of n_kv_heads %d", path, hp->n_heads, hp->n_kv_heads);
    if ((int64_t)hp->n_heads * hp->head_dim > INT32_MAX)
        return status_fail(err, errlen, STATUS_BAD_INPUT, "%s: n_heads %d x head_dim %d overflows", path, hp->n_heads, hp->head_dim);
    if (!(hp->rms_eps > 0 && hp->rms_eps < 1))
        return status_fail(err, errlen, STATUS_BAD_INPUT, "%s: rms epsilon %g is not in (0, 1)", path, hp->rms_eps);
    if (!(hp->rope_theta > 0) || !isfinite(hp->rope_theta))
        return status_fail(err, errlen, STATUS_BAD_INPUT, "%s: rope theta %g must be positive", path, hp->rope_theta);
    if (hp->rope_scaling != ROPE_SCALING_NONE && !(hp->rope_factor > 0 && isfinite(hp->rope_factor)))
        return status_fail(err, errlen, STATUS_BAD_INPUT, "%s: rope scaling factor %g must be positive", path, hp->rope_factor);
    if (hp->rope_scaling == ROPE_SCALING_LLAMA3 &&
        !(hp->rope_low_freq_factor > 0 && hp->rope_high_freq_factor > hp->rope_low_freq_factor && hp->rope_orig_ctx > 0))
        return status_fail(err, errlen, STATUS_BAD_INPUT,
                           "%s: llama3 rope scaling needs 0 < low_freq_factor (%g) < high_freq_factor (%g) and original context (%d) > 0",
                           path, hp->rope_low_freq_factor, hp->rope_high_freq_factor, hp->rope_orig_ctx);
    return 0;
}

/* One required (or optional) tensor: present, a supported type, a shape
 * of n_dims listed dims (1-D tensors may be stored as [n, 1]). */
static int check_tensor(const model_file *m, const char *name, int n_dims, int64_t ne0, int64_t ne1, int optional,
                        int vector_types_only, char *err, size_t errlen) {
    struct model_tensor t;
    if (model_file_tensor(m, name, &t) != STATUS_OK) {
        if (optional) return 1;
        return status_fail(err, errlen, STATUS_NOT_FOUND, "%s: tensor %s: missing", m->path, name);
    }
    if (!dtype_valid((int)t.type))
        return status_fail(err, errlen, STATUS_UNSUPPORTED, "%s: tensor %s: type %d is not supported", m->path, name, (int)t.type);
    if (vector_types_only && t.type != DTYPE_F32 && t.type != DTYPE_F16 && t.type != DTYPE_BF16)
        return status_fail(err, errlen, STATUS_UNSUPPORTED, "%s: tensor %s: type %s is not supported for a vector (F32, F16, BF16 are)",
                           m->path, name, dtype_name(t.type));
    int64_t rest = t.ne[2] * t.ne[3];
    int ok = t.ne[0] == ne0 && rest == 1 && (n_dims == 1 ? t.ne[1] == 1 : t.ne[1] == ne1);
    if (!ok) {
        char got[96], want[64];
        if (t.n_dims <= 1) snprintf(got, sizeof got, "[%lld]", (long long)t.ne[0]);
        else if (t.n_dims == 2) snprintf(got, sizeof got, "[%lld, %lld]", (long long)t.ne[0], (long long)t.ne[1]);
        else snprintf(got, sizeof got, "[%lld, %lld, %lld, %lld]", (long long)t.ne[0], (long long)t.ne[1], (long long)t.ne[2], (long long)t.ne[3]);
        if (n_dims == 1) snprintf(want, sizeof want, "[%lld]", (long long)ne0);
        else snprintf(want, sizeof want, "[%lld, %lld]", (long long)ne0, (long long)ne1);
        return status_fail(err, errlen, STATUS_BAD_INPUT, "%s: tensor %s: shape %s (GGML order), want %s", m->path, name, got, want);
    }
    return 0;
}

static int check_tensors(model_file *m, char *err, size_t errlen) {
    struct model_hparams *hp = &m->hp;
    int64_t dim = hp->dim, q = (int64_t)hp->n_heads * hp->head_dim, kv = (int64_t)hp->n_kv_heads * hp->head_dim;
    int st;
    if ((st = check_tensor(m, "token_embd.weight", 2, dim, hp->n_vocab, 0, 0, err, errlen))) return st;
    if ((st = check_tensor(m, "output_norm.weight", 1, dim, 1, 0, 1, err, errlen))) return st;
    st = check_tensor(m, "output.weight", 2, dim, hp->n_vocab, 1, 0, err, errlen);
    if (st < 0) return st;
    hp->tied_embeddings = st == 1;
    char name[96];
    for (int32_t l = 0; l < hp->n_layers; l++) {
        struct { const char *suffix; int nd; int64_t ne0, ne1; int vec; } need[] = {
            {"attn_norm.weight", 1, dim, 1, 1}, {"ffn_norm.weight", 1, dim, 1, 1},
            {"attn_q.weight", 2, dim, q, 0}, {"attn_k.weight", 2, dim, kv, 0}, {"attn_v.weight", 2, dim, kv, 0},
            {"attn_output.weight", 2, q, dim, 0}, {"ffn_gate.weight", 2, dim, hp->ffn_dim, 0},
            {"ffn_up.weight", 2, dim, hp->ffn_dim, 0}, {"ffn_down.weight", 2, hp->ffn_dim, dim, 0},
            {"attn_q.bias", 1, q, 1, 1}, {"attn_k.bias", 1, kv, 1, 1}, {"attn_v.bias", 1, kv, 1, 1}};
        size_t n_need = sizeof need / sizeof need[0] - (hp->qkv_bias ? 0 : 3);
        for (size_t i = 0; i < n_need; i++) {
            snprintf(name, sizeof name, "blk.%d.%s", l, need[i].suffix);
            if ((st = check_tensor(m, name, need[i].nd, need[i].ne0, need[i].ne1, 0, need[i].vec, err, errlen))) return st;
        }
    }
    /* a layer beyond block_count means the count and the tensors disagree */
    snprintf(name, sizeof name, "blk.%d.attn_q.weight", hp->n_layers);
    struct model_tensor extra;
    if (model_file_tensor(m, name, &extra) == STATUS_OK)
        return status_fail(err, errlen, STATUS_BAD_INPUT, "%s: tensor %s: present, but the block count is %d", m->path, name, hp->n_layers);
    return 0;
}

static int load_tokenizer(model_file *m, char *err, size_t errlen) {
    char terr[512] = "";
    int st = m->gguf ? tokenizer_from_gguf(&m->tok, m->gguf, terr, sizeof terr) : tokenizer_from_hf(&m->tok, m->path, terr, sizeof terr);
    if (st) {
        m->tok = NULL;
        return status_fail(err, errlen, st, "%s: tokenizer: %s", m->path, terr);
    }
    int32_t nt = tokenizer_n_vocab(m->tok);
    if (nt > m->hp.n_vocab)
        return status_fail(err, errlen, STATUS_BAD_INPUT, "%s: tokenizer has %d tokens, the model embeds only %d", m->path, nt, m->hp.n_vocab);
    return 0;
}

/* ---- GGUF ---- */

/* A positive int32 hyper-parameter from KEY; optional ones keep *out when absent. */
static int gguf_hp_i32(gguf_file *g, const char *path, const char *key, int optional, int32_t *out, char *err, size_t errlen) {
    int64_t v;
    int st = gguf_get_i64(g, key, &v);
    if (st == STATUS_NOT_FOUND) {
        if (optional) return 0;
        return status_fail(err, errlen, STATUS_BAD_INPUT, "%s: key %s: missing", path, key);
    }
    if (st) return status_fail(err, errlen, STATUS_BAD_INPUT, "%s", gguf_errstr(g));
    if (v <= 0 || v > INT32_MAX) return status_fail(err, errlen, STATUS_BAD_INPUT, "%s: key %s: value %lld is out of range", path, key, (long long)v);
    *out = (int32_t)v;
    return 0;
}

static int gguf_hp_f32(gguf_file *g, const char *path, const char *key, int optional, float *out, char *err, size_t errlen) {
    int st = gguf_get_f32(g, key, out);
    if (st == STATUS_NOT_FOUND) {
        if (optional) return 0;
        return status_fail(err, errlen, STATUS_BAD_INPUT, "%s: key %s: missing", path, key);
    }
    if (st) return status_fail(err, errlen, STATUS_BAD_INPUT, "%s", gguf_errstr(g));
    if (!isfinite(*out)) return status_fail(err, errlen, STATUS_BAD_INPUT, "%s: key %s: value %g is not finite", path, key, *out);
    return 0;
}

static int open_gguf(model_file *m, char *err, size_t errlen) {
    int st = gguf_open(&m->gguf, m->path, err, errlen);
    if (st) return st;
    gguf_file *g = m->gguf;
    struct model_hparams *hp = &m->hp;
    struct gguf_str arch;
    if (gguf_get_str(g, "general.architecture", &arch) != 0)
        return status_fail(err, errlen, STATUS_BAD_INPUT, "%s: key general.architecture: missing or not a string", m->path);
    const char *a;
    if (gguf_str_eq(arch, "llama")) {
        a = "llama";
        hp->arch = MODEL_ARCH_LLAMA;
    } else if (gguf_str_eq(arch, "qwen2")) {
        a = "qwen2";
        hp->arch = MODEL_ARCH_QWEN2;
        hp->qkv_bias = 1;
        hp->rope_neox = 1; /* llama.cpp runs qwen2 with the NeoX rotation */
    } else {
        return status_fail(err, errlen, STATUS_UNSUPPORTED, "%s: key general.architecture: \"%.*s\" is not supported (llama, qwen2 are)",
                           m->path, (int)(arch.len > 64 ? 64 : arch.len), arch.ptr);
    }
    char key[128];
#define K(suffix) (snprintf(key, sizeof key, "%s.%s", a, suffix), key)
    hp->rms_eps = 1e-5f;
    hp->rope_theta = 10000.0f;
    if ((st = gguf_hp_i32(g, m->path, K("embedding_length"), 0, &hp->dim, err, errlen)) ||
        (st = gguf_hp_i32(g, m->path, K("block_count"), 0, &hp->n_layers, err, errlen)) ||
        (st = gguf_hp_i32(g, m->path, K("attention.head_count"), 0, &hp->n_heads, err, errlen)) ||
        (st = gguf_hp_i32(g, m->path, K("feed_forward_length"), 0, &hp->ffn_dim, err, errlen)) ||
        (st = gguf_hp_i32(g, m->path, K("context_length"), 0, &hp->ctx_len, err, errlen)) ||
        (st = gguf_hp_f32(g, m->path, K("attention.layer_norm_rms_epsilon"), 0, &hp->rms_eps, err, errlen)) ||
        (st = gguf_hp_f32(g, m->path, K("rope.freq_base"), 1, &hp->rope_theta, err, errlen)))
        return st;
    hp->n_kv_heads = hp->n_heads;
    if ((st = gguf_hp_i32(g, m->path, K("attention.head_count_kv"), 1, &hp->n_kv_heads, err, errlen)) ||
        (st = gguf_hp_i32(g, m->path, K("attention.key_length"), 1, &hp->head_dim, err, errlen)))
        return st;
    int32_t vlen = 0;
    if ((st = gguf_hp_i32(g, m->path, K("attention.value_length"), 1, &vlen, err, errlen))) return st;
    /* vocabulary: the key, else the token list, else the embedding rows */
    if ((st = gguf_hp_i32(g, m->path, K("vocab_size"), 1, &hp->n_vocab, err, errlen))) return st;
    if (hp->n_vocab == 0) {
        uint64_t n;
        enum gguf_vtype et;
        if (gguf_get_arr(g, "tokenizer.ggml.tokens", &et, &n) == 0 && n > 0 && n <= INT32_MAX) hp->n_vocab = (int32_t)n;
        const struct gguf_tensor *te = gguf_tensor_find(g, "token_embd.weight");
        if (hp->n_vocab == 0 && te && te->ne[1] > 0 && te->ne[1] <= INT32_MAX) hp->n_vocab = (int32_t)te->ne[1];
    }
    /* rope scaling */
    struct gguf_str stype;
    int has_type = gguf_get_str(g, K("rope.scaling.type"), &stype) == 0;
    float factor = 0;
    if ((st = gguf_hp_f32(g, m->path, K("rope.scaling.factor"), 1, &factor, err, errlen))) return st;
    if (has_type && gguf_str_eq(stype, "linear")) {
        hp->rope_scaling = ROPE_SCALING_LINEAR;
        hp->rope_factor = factor;
    } else if (has_type && !gguf_str_eq(stype, "none")) {
        return status_fail(err, errlen, STATUS_UNSUPPORTED, "%s: key %s: rope scaling \"%.*s\" is not supported (none, linear are)",
                           m->path, key, (int)(stype.len > 32 ? 32 : stype.len), stype.ptr);
    } else if (!has_type && factor > 0 && factor != 1) {
        hp->rope_scaling = ROPE_SCALING_LINEAR; /* older files give only the factor */
        hp->rope_factor = factor;
    }
    if (hp->rope_scaling == ROPE_SCALING_NONE) hp->rope_factor = 1.0f;
    if ((st = check_hparams(m->path, hp, err, errlen))) return st;
    if (vlen && vlen != hp->head_dim)
        return status_fail(err, errlen, STATUS_UNSUPPORTED, "%s: key %s.attention.value_length: %d differs from the key length %d", m->path, a, vlen, hp->head_dim);
    int32_t rope_dim = hp->head_dim;
    if ((st = gguf_hp_i32(g, m->path, K("rope.dimension_count"), 1, &rope_dim, err, errlen))) return st;
    if (rope_dim != hp->head_dim)
        return status_fail(err, errlen, STATUS_UNSUPPORTED, "%s: key %s: rotary dimension %d differs from head_dim %d (partial rotary is not supported)",
                           m->path, K("rope.dimension_count"), rope_dim, hp->head_dim);
#undef K
    /* Llama 3.1 style scaling comes as a tensor of per-frequency divisors */
    const struct gguf_tensor *rf = gguf_tensor_find(g, "rope_freqs.weight");
    if (rf) {
        if (rf->type != DTYPE_F32 || rf->ne[0] != hp->head_dim / 2 || rf->ne[1] * rf->ne[2] * rf->ne[3] != 1)
            return status_fail(err, errlen, STATUS_BAD_INPUT, "%s: tensor rope_freqs.weight: %s [%lld], want F32 [%d]", m->path,
                               dtype_name(rf->type), (long long)rf->ne[0], hp->head_dim / 2);
        hp->rope_freq_factors = rf->data;
        for (int i = 0; i < hp->head_dim / 2; i++)
            if (!(hp->rope_freq_factors[i] > 0) || !isfinite(hp->rope_freq_factors[i]))
                return status_fail(err, errlen, STATUS_BAD_INPUT, "%s: tensor rope_freqs.weight: element %d is %g, must be positive", m->path, i,
                                   hp->rope_freq_factors[i]);
    }
    if ((st = check_tensors(m, err, errlen))) return st;
    return load_tokenizer(m, err, errlen);
}

/* ---- Hugging Face ---- */

static char *read_text(const char *path, size_t *len, char *err, size_t errlen, int *status) {
    FILE *fp = fopen(path, "rb");
    if (!fp) {
        int e = errno;
        *status = status_fail(err, errlen, e == ENOENT ? STATUS_NOT_FOUND : STATUS_IO, "%s: cannot open: %s", path, strerror(e));
        return NULL;
    }
    struct stat sb;
    if (fstat(fileno(fp), &sb) != 0 || !S_ISREG(sb.st_mode) || sb.st_size > (off_t)MODEL_JSON_MAX) {
        fclose(fp);
        *status = status_fail(err, errlen, STATUS_BAD_INPUT, "%s: not a regular file of at most %u bytes", path, MODEL_JSON_MAX);
        return NULL;
    }
    char *buf = malloc((size_t)sb.st_size + 1);
    if (!buf) {
        fclose(fp);
        *status = status_fail(err, errlen, STATUS_NO_MEMORY, "%s: no memory", path);
        return NULL;
    }
    size_t n = fread(buf, 1, (size_t)sb.st_size, fp);
    fclose(fp);
    if (n != (size_t)sb.st_size) {
        free(buf);
        *status = status_fail(err, errlen, STATUS_IO, "%s: short read", path);
        return NULL;
    }
    buf[n] = 0;
    *len = n;
    return buf;
}

static cJSON *read_json(const char *path, char *err, size_t errlen, int *status) {
    size_t len;
    char *text = read_text(path, &len, err, errlen, status);
    if (!text) return NULL;
    cJSON *j = cJSON_ParseWithLength(text, len);
    if (!j || !cJSON_IsObject(j)) {
        const char *where = cJSON_GetErrorPtr();
        long off = where && where >= text && where <= text + len ? (long)(where - text) : -1;
        cJSON_Delete(j);
        free(text);
        *status = status_fail(err, errlen, STATUS_BAD_INPUT, "%s: not a JSON object (parse error near byte %ld)", path, off);
        return NULL;
    }
    free(text);
    return j;
}

/* Integer field of a JSON object: 0 ok, 1 absent (or null), negative on a bad value. */
static int json_i32(const cJSON *o, const char *key, int32_t *out, const char *path, char *err, size_t errlen) {
    const cJSON *v = cJSON_GetObjectItemCaseSensitive(o, key);
    if (!v || cJSON_IsNull(v)) return 1;
    if (!cJSON_IsNumber(v) || v->valuedouble != floor(v->valuedouble) || v->valuedouble < 0 || v->valuedouble > INT32_MAX)
        return status_fail(err, errlen, STATUS_BAD_INPUT, "%s: config.json: %s is not a non-negative 32-bit integer", path, key);
    *out = (int32_t)v->valuedouble;
    return 0;
}

static int json_f32(const cJSON *o, const char *key, float *out, const char *path, char *err, size_t errlen) {
    const cJSON *v = cJSON_GetObjectItemCaseSensitive(o, key);
    if (!v || cJSON_IsNull(v)) return 1;
    if (!cJSON_IsNumber(v) || !isfinite(v->valuedouble))
        return status_fail(err, errlen, STATUS_BAD_INPUT, "%s: config.json: %s is not a finite number", path, key);
    *out = (float)v->valuedouble;
    return 0;
}

/* Rope settings: transformers 5 keeps them in rope_parameters, older
 * configs put rope_theta at the top and the scaling in rope_scaling. */
static int hf_rope(const cJSON *cfg, struct model_hparams *hp, const char *path, char *err, size_t errlen) {
    const cJSON *rp = cJSON_GetObjectItemCaseSensitive(cfg, "rope_parameters");
    const cJSON *rs = cJSON_GetObjectItemCaseSensitive(cfg, "rope_scaling");
    int st;
    hp->rope_theta = 10000.0f;
    if ((st = json_f32(cfg, "rope_theta", &hp->rope_theta, path, err, errlen)) < 0) return st;
    const cJSON *sc = NULL;
    if (cJSON_IsObject(rp)) {
        if ((st = json_f32(rp, "rope_theta", &hp->rope_theta, path, err, errlen)) < 0) return st;
        sc = rp;
    }
    if (cJSON_IsObject(rs)) sc = rs;
    hp->rope_scaling = ROPE_SCALING_NONE;
    hp->rope_factor = 1.0f;
    if (!sc) return 0;
    const cJSON *ty = cJSON_GetObjectItemCaseSensitive(sc, "rope_type");
    if (!cJSON_IsString(ty)) ty = cJSON_GetObjectItemCaseSensitive(sc, "type");
    const char *t = cJSON_IsString(ty) ? ty->valuestring : "default";
    if (strcmp(t, "default") == 0) return 0;
    if ((st = json_f32(sc, "factor", &hp->rope_factor, path, err, errlen)) != 0)
        return st < 0 ? st : status_fail(err, errlen, STATUS_BAD_INPUT, "%s: config.json: rope scaling \"%s\" without a factor", path, t);
    if (strcmp(t, "linear") == 0) {
        hp->rope_scaling = ROPE_SCALING_LINEAR;
        return 0;
    }
    if (strcmp(t, "llama3") == 0) {
        hp->rope_scaling = ROPE_SCALING_LLAMA3;
        if ((st = json_f32(sc, "low_freq_factor", &hp->rope_low_freq_factor, path, err, errlen)) ||
            (st = json_f32(sc, "high_freq_factor", &hp->rope_high_freq_factor, path, err, errlen)) ||
            (st = json_i32(sc, "original_max_position_embeddings", &hp->rope_orig_ctx, path, err, errlen)))
            return st < 0 ? st : status_fail(err, errlen, STATUS_BAD_INPUT,
                                             "%s: config.json: llama3 rope scaling needs low_freq_factor, high_freq_factor and original_max_position_embeddings", path);
        return 0;
    }
    return status_fail(err, errlen, STATUS_UNSUPPORTED, "%s: config.json: rope scaling \"%s\" is not supported (default, linear, llama3 are)", path, t);
}

/* The GGUF name of a Hugging Face tensor name, or 0 when it is not one we use. */
static int hf_to_gguf(const char *hf, char *out, size_t size) {
    static const struct { const char *hf, *gg; } top[] = {
        {"model.embed_tokens.weight", "token_embd.weight"}, {"model.norm.weight", "output_norm.weight"},
        {"lm_head.weight", "output.weight"}};
    for (size_t i = 0; i < sizeof top / sizeof top[0]; i++)
        if (strcmp(hf, top[i].hf) == 0) return snprintf(out, size, "%s", top[i].gg) > 0;
    static const struct { const char *hf, *gg; } layer[] = {
        {"input_layernorm.weight", "attn_norm.weight"}, {"post_attention_layernorm.weight", "ffn_norm.weight"},
        {"self_attn.q_proj.weight", "attn_q.weight"}, {"self_attn.k_proj.weight", "attn_k.weight"},
        {"self_attn.v_proj.weight", "attn_v.weight"}, {"self_attn.o_proj.weight", "attn_output.weight"},
        {"self_attn.q_proj.bias", "attn_q.bias"}, {"self_attn.k_proj.bias", "attn_k.bias"},
        {"self_attn.v_proj.bias", "attn_v.bias"}, {"mlp.gate_proj.weight", "ffn_gate.weight"},
        {"mlp.up_proj.weight", "ffn_up.weight"}, {"mlp.down_proj.weight", "ffn_down.weight"}};
    const char *p = "model.layers.";
    if (strncmp(hf, p, strlen(p)) != 0) return 0;
    const char *s = hf + strlen(p);
    char *end;
    errno = 0;
    long n = strtol(s, &end, 10);
    if (end == s || *end != '.' || n < 0 || n > 100000 || errno) return 0;
    for (size_t i = 0; i < sizeof layer / sizeof layer[0]; i++)
        if (strcmp(end + 1, layer[i].hf) == 0) return snprintf(out, size, "blk.%ld.%s", n, layer[i].gg) > 0;
    return 0;
}

static int add_shard(model_file *m, const char *file, char *err, size_t errlen) {
    if (!*file || strchr(file, '/') || strcmp(file, ".") == 0 || strcmp(file, "..") == 0)
        return status_fail(err, errlen, STATUS_BAD_INPUT, "%s: model.safetensors.index.json: shard name \"%s\" is not a file in the directory", m->path, file);
    for (int i = 0; i < m->n_shards; i++) {
        const char *p = safetensors_path(m->shards[i]);
        const char *base = strrchr(p, '/');
        if (strcmp(base ? base + 1 : p, file) == 0) return 0;
    }
    safetensors_file **ns = realloc(m->shards, (size_t)(m->n_shards + 1) * sizeof *ns);
    if (!ns) return status_fail(err, errlen, STATUS_NO_MEMORY, "%s: no memory", m->path);
    m->shards = ns;
    char path[4096];
    snprintf(path, sizeof path, "%s/%s", m->path, file);
    int st = safetensors_open(&m->shards[m->n_shards], path, err, errlen);
    if (st) return st;
    m->n_shards++;
    return 0;
}

static const safetensors_file *shard_named(const model_file *m, const char *file) {
    for (int i = 0; i < m->n_shards; i++) {
        const char *p = safetensors_path(m->shards[i]);
        const char *base = strrchr(p, '/');
        if (strcmp(base ? base + 1 : p, file) == 0) return m->shards[i];
    }
    return NULL;
}

static int open_hf(model_file *m, char *err, size_t errlen) {
    char path[4096];
    int st = 0;
    snprintf(path, sizeof path, "%s/config.json", m->path);
    cJSON *cfg = read_json(path, err, errlen, &st);
    if (!cfg) return st;
    struct model_hparams *hp = &m->hp;
    const cJSON *mt = cJSON_GetObjectItemCaseSensitive(cfg, "model_type");
    const char *type = cJSON_IsString(mt) ? mt->valuestring : "";
    if (strcmp(type, "llama") == 0 || strcmp(type, "mistral") == 0) {
        hp->arch = MODEL_ARCH_LLAMA;
    } else if (strcmp(type, "qwen2") == 0) {
        hp->arch = MODEL_ARCH_QWEN2;
        hp->qkv_bias = 1;
    } else {
        st = status_fail(err, errlen, STATUS_UNSUPPORTED, "%s: config.json: model_type \"%.64s\" is not supported (llama, mistral, qwen2 are)", m->path, type);
        goto done;
    }
    hp->rope_neox = 1; /* Hugging Face q/k rows pair dimension i with i + head_dim/2 */
    struct { const char *key; int32_t *dst; int required; } ints[] = {
        {"vocab_size", &hp->n_vocab, 1}, {"hidden_size", &hp->dim, 1}, {"num_hidden_layers", &hp->n_layers, 1},
        {"num_attention_heads", &hp->n_heads, 1}, {"num_key_value_heads", &hp->n_kv_heads, 0},
        {"intermediate_size", &hp->ffn_dim, 1}, {"max_position_embeddings", &hp->ctx_len, 1}, {"head_dim", &hp->head_dim, 0}};
    for (size_t i = 0; i < sizeof ints / sizeof ints[0]; i++) {
        int r = json_i32(cfg, ints[i].key, ints[i].dst, m->path, err, errlen);
        if (r < 0) {
            st = r;
            goto done;
        }
        if (r == 1 && ints[i].required) {
            st = status_fail(err, errlen, STATUS_BAD_INPUT, "%s: config.json: %s: missing", m->path, ints[i].key);
            goto done;
        }
    }
    if (hp->n_kv_heads == 0) hp->n_kv_heads = hp->n_heads;
    hp->rms_eps = 1e-6f;
    if ((st = json_f32(cfg, "rms_norm_eps", &hp->rms_eps, m->path, err, errlen)) < 0) goto done;
    if ((st = hf_rope(cfg, hp, m->path, err, errlen)) < 0) goto done;
    if ((st = check_hparams(m->path, hp, err, errlen))) goto done;
    const cJSON *tie = cJSON_GetObjectItemCaseSensitive(cfg, "tie_word_embeddings");
    int tied_cfg = cJSON_IsBool(tie) ? cJSON_IsTrue(tie) : 0;

    /* shards: the index when there is one, else model.safetensors */
    snprintf(path, sizeof path, "%s/model.safetensors.index.json", m->path);
    struct stat sb;
    cJSON *index = NULL;
    if (stat(path, &sb) == 0) {
        index = read_json(path, err, errlen, &st);
        if (!index) goto done;
        const cJSON *wm = cJSON_GetObjectItemCaseSensitive(index, "weight_map");
        if (!cJSON_IsObject(wm)) {
            st = status_fail(err, errlen, STATUS_BAD_INPUT, "%s: weight_map: missing or not an object", path);
            cJSON_Delete(index);
            goto done;
        }
        for (const cJSON *e = wm->child; e; e = e->next) {
            if (!cJSON_IsString(e)) {
                st = status_fail(err, errlen, STATUS_BAD_INPUT, "%s: weight_map: tensor %s: shard is not a string", path, e->string ? e->string : "?");
                break;
            }
            if ((st = add_shard(m, e->valuestring, err, errlen))) break;
        }
        /* each listed tensor must be in the shard the index names */
        for (const cJSON *e = wm->child; e && !st; e = e->next) {
            const safetensors_file *sf = shard_named(m, e->valuestring);
            if (!sf || !safetensors_tensor_find(sf, e->string))
                st = status_fail(err, errlen, STATUS_BAD_INPUT, "%s: tensor %s: listed in model.safetensors.index.json under %s but absent there",
                                 m->path, e->string, e->valuestring);
        }
        cJSON_Delete(index);
        if (st) goto done;
    } else {
        if ((st = add_shard(m, "model.safetensors", err, errlen))) goto done;
    }
    int64_t total = 0;
    for (int i = 0; i < m->n_shards; i++) total += safetensors_n_tensors(m->shards[i]);
    m->entries = calloc((size_t)(total ? total : 1), sizeof *m->entries);
    if (!m->entries) {
        st = status_fail(err, errlen, STATUS_NO_MEMORY, "%s: no memory", m->path);
        goto done;
    }
    for (int i = 0; i < m->n_shards && !st; i++) {
        for (int64_t k = 0; k < safetensors_n_tensors(m->shards[i]); k++) {
            const struct safetensors_tensor *t = safetensors_tensor_at(m->shards[i], k);
            char gname[96];
            if (!hf_to_gguf(t->name, gname, sizeof gname)) continue;
            struct model_tensor dummy;
            if (model_file_tensor(m, gname, &dummy) == STATUS_OK) {
                st = status_fail(err, errlen, STATUS_BAD_INPUT, "%s: tensor %s: appears in more than one shard", m->path, t->name);
                break;
            }
            if (!t->supported) {
                st = status_fail(err, errlen, STATUS_UNSUPPORTED, "%s: tensor %s: dtype %s is not supported (F32, F16, BF16 are)",
                                 safetensors_path(m->shards[i]), t->name, t->dtype_str);
                break;
            }
            struct model_entry *e = &m->entries[m->n_entries];
            e->name = strdup(gname);
            if (!e->name) {
                st = status_fail(err, errlen, STATUS_NO_MEMORY, "%s: no memory", m->path);
                break;
            }
            m->n_entries++;
            e->t.type = t->type;
            e->t.n_dims = t->n_dims;
            memcpy(e->t.ne, t->ne, sizeof e->t.ne);
            e->t.data = t->data;
            e->t.nbytes = t->nbytes;
        }
    }
    if (st) goto done;
    if ((st = check_tensors(m, err, errlen))) goto done;
    if (tied_cfg && !hp->tied_embeddings) {
        /* transformers ignores a stored lm_head when the config ties them */
        for (int64_t i = 0; i < m->n_entries; i++) {
            if (strcmp(m->entries[i].name, "output.weight") == 0) {
                free(m->entries[i].name);
                m->entries[i] = m->entries[--m->n_entries];
                break;
            }
        }
        hp->tied_embeddings = 1;
    }
    st = load_tokenizer(m, err, errlen);
done:
    cJSON_Delete(cfg);
    return st;
}

int model_file_open(model_file **out, const char *path, char *err, size_t errlen) {
    *out = NULL;
    if (err && errlen) err[0] = 0;
    model_file *m = calloc(1, sizeof *m);
    if (!m) return status_fail(err, errlen, STATUS_NO_MEMORY, "%s: no memory", path);
    /* keep the path without trailing slashes: it prefixes every message */
    size_t len = strlen(path);
    while (len > 1 && path[len - 1] == '/') len--;
    m->path = strndup(path, len);
    if (!m->path) {
        free(m);
        return status_fail(err, errlen, STATUS_NO_MEMORY, "%s: no memory", path);
    }
    struct stat sb;
    int st;
    if (stat(m->path, &sb) != 0) {
        int e = errno;
        st = status_fail(err, errlen, e == ENOENT ? STATUS_NOT_FOUND : STATUS_IO, "%s: cannot open: %s", m->path, strerror(e));
    } else if (S_ISDIR(sb.st_mode)) {
        st = open_hf(m, err, errlen);
    } else {
        st = open_gguf(m, err, errlen);
    }
    if (st) {
        model_file_close(m);
        return st;
    }
    *out = m;
    return 0;
}
