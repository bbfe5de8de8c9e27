/* Synthetic model writer: shape presets, llama.cpp-like type mixes, a
 * generated SentencePiece vocabulary, and weights from a counter-based
 * generator streamed tensor by tensor through the GGUF streaming writer,
 * generated and quantized by a few threads one chunk of rows at a time. */
#include "synth.h"

#include <pthread.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include "common/gguf.h"
#include "common/log.h"
#include "common/status.h"

const char *const synth_shape_names[] = {"tiny", "100m", "tinyllama-1.1b", "llama2-7b", "llama3-8b", "llama2-13b", NULL};
const char *const synth_type_names[] = {"f32", "f16", "bf16", "q8_0", "q4_0", "q4_k_m", "q5_k_m", "q6_k", NULL};

int synth_shape_preset(const char *name, struct synth_shape *out) {
    static const struct { const char *name; struct synth_shape s; } presets[] = {
        /* rows are multiples of 256, so every type is stored as asked */
        {"tiny", {2, 256, 4, 2, 512, 512, 512, 10000.0f, 1e-5f, 0}},
        {"100m", {12, 768, 12, 4, 2048, 16384, 2048, 10000.0f, 1e-5f, 0}},
        {"tinyllama-1.1b", {22, 2048, 32, 4, 5632, 32000, 2048, 10000.0f, 1e-5f, 0}},
        {"llama2-7b", {32, 4096, 32, 32, 11008, 32000, 4096, 10000.0f, 1e-5f, 0}},
        {"llama3-8b", {32, 4096, 32, 8, 14336, 128256, 8192, 500000.0f, 1e-5f, 0}},
        {"llama2-13b", {40, 5120, 40, 40, 13824, 32000, 4096, 10000.0f, 1e-5f, 0}},
    };
    for (size_t i = 0; i < sizeof presets / sizeof presets[0]; i++) {
        if (strcmp(presets[i].name, name) == 0) {
            *out = presets[i].s;
            return 0;
        }
    }
    return STATUS_NOT_FOUND;
}

/* ---- weights ---- */

static inline uint64_t splitmix64(uint64_t x) {
    x += 0x9e3779b97f4a7c15ull;
    x = (x ^ (x >> 30)) * 0xbf58476d1ce4e5b9ull;
    x = (x ^ (x >> 27)) * 0x94d049bb133111ebull;
    return x ^ (x >> 31);
}

static uint64_t tensor_key(uint64_t seed, const char *name) {
    uint64_t h = 0xcbf29ce484222325ull; /* FNV-1a */
    for (const unsigned char *p = (const unsigned char *)name; *p; p++) h = (h ^ *p) * 0x100000001b3ull;
    return splitmix64(seed ^ h);
}

/* Mean 0, variance 1 (Irwin-Hall of four 16-bit uniforms, scaled): no
 * transcendental functions, so a 7B model generates at memory speed. */
static inline float weight_at(uint64_t key, uint64_t i) {
    uint64_t z = splitmix64(key + i);
    uint32_t s = (uint32_t)(z & 0xffff) + (uint32_t)((z >> 16) & 0xffff) + (uint32_t)((z >> 32) & 0xffff) + (uint32_t)(z >> 48);
    float u = ((float)s + 2.0f) * (1.0f / 65536.0f); /* in (0, 4), mean 2 */
    return (u - 2.0f) * 1.7320508f * 0.02f;
}

float synth_weight(uint64_t seed, const char *name, uint64_t i) { return weight_at(tensor_key(seed, name), i); }

/* ---- type mix ---- */

/* llama.cpp gives more bits to the first and last eighth of the layers and
 * every third one between. */
static int use_more_bits(int32_t i, int32_t n) { return i < n / 8 || i >= 7 * n / 8 || (i - n / 8) % 3 == 2; }

static enum dtype fit_type(enum dtype want, int64_t ne0) {
    if (ne0 % dtype_block_elems(want) == 0) return want;
    /* the K-quants fall back to a 32-block type (Q8_0: we do not write the
     * Q5_0/Q5_1 llama.cpp would pick), those to F16 */
    if (want == DTYPE_Q4_K || want == DTYPE_Q5_K || want == DTYPE_Q6_K) want = DTYPE_Q8_0;
    if (ne0 % dtype_block_elems(want) == 0) return want;
    return DTYPE_F16;
}

static int name_is(const char *name, const char *suffix) {
    size_t n = strlen(name), s = strlen(suffix);
    return n >= s && strcmp(name + n - s, suffix) == 0;
}

enum dtype synth_tensor_type(const struct synth_config *cfg, const char *name, int64_t ne0, int32_t layer) {
    if (name_is(name, "_norm.weight")) return DTYPE_F32;
    int is_output = strcmp(name, "output.weight") == 0 || (cfg->tied && strcmp(name, "token_embd.weight") == 0);
    int32_t nl = cfg->shape.n_layers;
    enum dtype t;
    switch (cfg->type) {
    case SYNTH_F32: return DTYPE_F32;
    case SYNTH_F16: return DTYPE_F16;
    case SYNTH_BF16: return DTYPE_BF16;
    case SYNTH_Q8_0: t = DTYPE_Q8_0; break;
    case SYNTH_Q4_0: t = is_output ? DTYPE_Q6_K : DTYPE_Q4_0; break;
    case SYNTH_Q6_K: t = DTYPE_Q6_K; break;
    case SYNTH_Q4_K_M:
    case SYNTH_Q5_K_M: {
        enum dtype base = cfg->type == SYNTH_Q4_K_M ? DTYPE_Q4_K : DTYPE_Q5_K;
        if (is_output) t = DTYPE_Q6_K;
        else if ((name_is(name, "attn_v.weight") || name_is(name, "ffn_down.weight")) && layer >= 0 && use_more_bits(layer, nl))
            t = DTYPE_Q6_K;
        else t = base;
        break;
    }
    default: t = DTYPE_F16;
    }
    return fit_type(t, ne0);
}

/* ---- vocabulary ---- */

/* Token texts: <unk>, <s>, </s>, the 256 byte tokens, U+2581, printable
 * ASCII, then "▁"+letters^L and letters^(L+1) for growing L until n_vocab.
 * Shorter pieces score higher, so merges build words from their parts. */
static int make_vocab(int32_t n_vocab, char ***tokens_out, float **scores_out, int32_t **types_out) {
    char **tok = calloc((size_t)n_vocab, sizeof *tok);
    float *sc = calloc((size_t)n_vocab, sizeof *sc);
    int32_t *ty = calloc((size_t)n_vocab, sizeof *ty);
    if (!tok || !sc || !ty) goto fail;
    int32_t n = 0;
    static const char *specials[] = {"<unk>", "<s>", "</s>"};
    static const int32_t special_types[] = {2, 3, 3}; /* unknown, control, control */
    for (int i = 0; i < 3; i++) {
        if (!(tok[n] = strdup(specials[i]))) goto fail;
        ty[n++] = special_types[i];
    }
    for (int b = 0; b < 256; b++) {
        char buf[8];
        snprintf(buf, sizeof buf, "<0x%02X>", b);
        if (!(tok[n] = strdup(buf))) goto fail;
        ty[n++] = 6; /* byte */
    }
    const char *space = "\xe2\x96\x81";
    char buf[64];
#define SYNTH_ADD(text)                                         \
    do {                                                        \
        if (n >= n_vocab) goto done;                            \
        if (!(tok[n] = strdup(text))) goto fail;                \
        ty[n] = 1;                                              \
        sc[n] = -(float)(n - 259);                              \
        n++;                                                    \
    } while (0)
    SYNTH_ADD(space);
    for (int c = 33; c < 127; c++) {
        buf[0] = (char)c;
        buf[1] = 0;
        SYNTH_ADD(buf);
    }
    for (int c = 0; c < 52; c++) {
        snprintf(buf, sizeof buf, "%s%c", space, c < 26 ? 'a' + c : 'A' + c - 26);
        SYNTH_ADD(buf);
    }
    for (int len = 2; len <= 12; len++) {
        /* letters^len, then "▁" + letters^len */
        for (int with_space = 0; with_space < 2; with_space++) {
            uint64_t count = 1;
            for (int k = 0; k < len; k++) count *= 26;
            for (uint64_t v = 0; v < count; v++) {
                char *p = buf;
                if (with_space) p += sprintf(p, "%s", space);
                uint64_t x = v;
                for (int k = len - 1; k >= 0; k--) {
                    p[k] = (char)('a' + x % 26);
                    x /= 26;
                }
                p[len] = 0;
                SYNTH_ADD(buf);
            }
        }
    }
#undef SYNTH_ADD
done:
    *tokens_out = tok;
    *scores_out = sc;
    *types_out = ty;
    return 0;
fail:
    if (tok)
        for (int32_t i = 0; i < n_vocab; i++) free(tok[i]);
    free(tok);
    free(sc);
    free(ty);
    return STATUS_NO_MEMORY;
}

/* ---- writing ---- */

struct tensor_spec {
    char name[64];
    int n_dims;
    int64_t ne[2];
    enum dtype type;
    int32_t layer;
    int is_norm;
};

struct chunk_job {
    const struct tensor_spec *t;
    uint64_t key;
    int64_t row0, rows;   /* rows of this job */
    uint8_t *out;         /* where row row0 goes */
    size_t row_bytes;
    float *scratch;       /* ne[0] floats */
    int status;
};

static void *chunk_worker(void *arg) {
    struct chunk_job *j = arg;
    int64_t ne0 = j->t->ne[0];
    for (int64_t r = 0; r < j->rows; r++) {
        uint64_t base = (uint64_t)(j->row0 + r) * (uint64_t)ne0;
        for (int64_t c = 0; c < ne0; c++) j->scratch[c] = j->t->is_norm ? 1.0f : weight_at(j->key, base + (uint64_t)c);
        int st = dtype_quant_row(j->t->type, j->scratch, j->out + (size_t)r * j->row_bytes, ne0);
        if (st) {
            j->status = st;
            return NULL;
        }
    }
    return NULL;
}

static int check_shape(const struct synth_shape *s, char *err, size_t errlen) {
    struct { const char *what; int32_t v, min, max; } f[] = {
        {"layers", s->n_layers, 1, 10000}, {"dim", s->dim, 2, 1 << 20}, {"heads", s->n_heads, 1, 1 << 16},
        {"kv-heads", s->n_kv_heads, 1, 1 << 16}, {"ffn", s->ffn_dim, 1, 1 << 22}, {"vocab", s->n_vocab, 260, 1 << 24},
        {"context", s->ctx_len, 1, 1 << 24}};
    for (size_t i = 0; i < sizeof f / sizeof f[0]; i++)
        if (f[i].v < f[i].min || f[i].v > f[i].max)
            return status_fail(err, errlen, STATUS_BAD_INPUT, "%s %d is outside [%d, %d]", f[i].what, f[i].v, f[i].min, f[i].max);
    if (s->head_dim < 0 || s->head_dim > (1 << 16) || (s->head_dim > 0 && s->head_dim % 2 != 0))
        return status_fail(err, errlen, STATUS_BAD_INPUT, "head dim %d is not 0 (dim / heads) or an even number up to %d",
                           s->head_dim, 1 << 16);
    if (s->head_dim == 0 && s->dim % s->n_heads != 0)
        return status_fail(err, errlen, STATUS_BAD_INPUT, "dim %d is not a multiple of heads %d", s->dim, s->n_heads);
    if (s->head_dim == 0 && (s->dim / s->n_heads) % 2 != 0)
        return status_fail(err, errlen, STATUS_BAD_INPUT, "head dim %d (dim %d / heads %d) is odd; rope needs pairs", s->dim / s->n_heads,
                           s->dim, s->n_heads);
    if (s->n_heads % s->n_kv_heads != 0)
        return status_fail(err, errlen, STATUS_BAD_INPUT, "heads %d is not a multiple of kv-heads %d", s->n_heads, s->n_kv_heads);
    if (!(s->rope_theta > 0)) return status_fail(err, errlen, STATUS_BAD_INPUT, "rope theta %g must be positive", s->rope_theta);
    if (!(s->rms_eps > 0 && s->rms_eps < 1)) return status_fail(err, errlen, STATUS_BAD_INPUT, "rms epsilon %g is not in (0, 1)", s->rms_eps);
    return 0;
}

static int add_spec(struct tensor_spec *specs, int *n, const struct synth_config *cfg, const char *name, int n_dims,
                    int64_t ne0, int64_t ne1, int32_t layer) {
    struct tensor_spec *t = &specs[(*n)++];
    snprintf(t->name, sizeof t->name, "%s", name);
    t->n_dims = n_dims;
    t->ne[0] = ne0;
    t->ne[1] = ne1;
    t->layer = layer;
    t->is_norm = name_is(name, "_norm.weight");
    t->type = synth_tensor_type(cfg, name, ne0, layer);
    return 0;
}

static int stream_tensor(gguf_writer *w, const struct synth_config *cfg, const struct tensor_spec *t, int n_threads,
                         char *err, size_t errlen) {
    size_t row_bytes = dtype_row_bytes(t->type, t->ne[0]);
    int64_t rows = t->ne[1];
    /* about 32 MiB of output per chunk, at least one row per thread */
    int64_t chunk_rows = (int64_t)((32u << 20) / (row_bytes ? row_bytes : 1));
    if (chunk_rows < n_threads) chunk_rows = n_threads;
    if (chunk_rows > rows) chunk_rows = rows;
    uint8_t *out = malloc((size_t)chunk_rows * row_bytes);
    float *scratch = malloc((size_t)n_threads * (size_t)t->ne[0] * sizeof(float));
    struct chunk_job *jobs = calloc((size_t)n_threads, sizeof *jobs);
    pthread_t *th = calloc((size_t)n_threads, sizeof *th);
    int st = 0;
    if (!out || !scratch || !jobs || !th) {
        st = status_fail(err, errlen, STATUS_NO_MEMORY, "tensor %s: no memory for a chunk of %lld rows", t->name, (long long)chunk_rows);
        goto done;
    }
    uint64_t key = tensor_key(cfg->seed, t->name);
    for (int64_t r0 = 0; r0 < rows && !st; r0 += chunk_rows) {
        int64_t nr = rows - r0 < chunk_rows ? rows - r0 : chunk_rows;
        int nt = nr < n_threads ? (int)nr : n_threads;
        int64_t per = (nr + nt - 1) / nt;
        int started = 0;
        for (int k = 0; k < nt; k++) {
            int64_t a = k * per, b = a + per < nr ? a + per : nr;
            if (a >= b) break;
            jobs[k] = (struct chunk_job){t, key, r0 + a, b - a, out + (size_t)a * row_bytes, row_bytes, scratch + (size_t)k * (size_t)t->ne[0], 0};
            if (nt == 1 || pthread_create(&th[k], NULL, chunk_worker, &jobs[k]) != 0) {
                chunk_worker(&jobs[k]); /* run inline when single-threaded or a thread cannot start */
                th[k] = 0;
            }
            started++;
        }
        for (int k = 0; k < started; k++) {
            if (th[k]) pthread_join(th[k], NULL);
            if (jobs[k].status) st = status_fail(err, errlen, jobs[k].status, "tensor %s: quantizing to %s failed", t->name, dtype_name(t->type));
        }
        if (st) break;
        st = gguf_writer_stream_tensor(w, t->name, out, (size_t)nr * row_bytes, r0 + nr >= rows, err, errlen);
    }
done:
    free(out);
    free(scratch);
    free(jobs);
    free(th);
    return st;
}

int synth_write(const struct synth_config *cfg, const char *path, char *err, size_t errlen) {
    const struct synth_shape *s = &cfg->shape;
    int st = check_shape(s, err, errlen);
    if (st) return st;
    if ((int)cfg->type < 0 || (int)cfg->type >= SYNTH_TYPE_COUNT)
        return status_fail(err, errlen, STATUS_BAD_INPUT, "type %d is not a synth type", (int)cfg->type);
    int32_t head_dim = s->head_dim > 0 ? s->head_dim : s->dim / s->n_heads;
    int64_t q = (int64_t)s->n_heads * head_dim, kv = (int64_t)s->n_kv_heads * head_dim;
    int n_specs_max = 3 + 9 * s->n_layers;
    struct tensor_spec *specs = calloc((size_t)n_specs_max, sizeof *specs);
    if (!specs) return status_fail(err, errlen, STATUS_NO_MEMORY, "no memory for %d tensor specs", n_specs_max);
    int n = 0;
    char name[64];
    add_spec(specs, &n, cfg, "token_embd.weight", 2, s->dim, s->n_vocab, -1);
    for (int32_t l = 0; l < s->n_layers; l++) {
#define SYNTH_LAYER(suffix, nd, a, b) (snprintf(name, sizeof name, "blk.%d." suffix, l), add_spec(specs, &n, cfg, name, nd, a, b, l))
        SYNTH_LAYER("attn_norm.weight", 1, s->dim, 1);
        SYNTH_LAYER("attn_q.weight", 2, s->dim, q);
        SYNTH_LAYER("attn_k.weight", 2, s->dim, kv);
        SYNTH_LAYER("attn_v.weight", 2, s->dim, kv);
        SYNTH_LAYER("attn_output.weight", 2, q, s->dim);
        SYNTH_LAYER("ffn_norm.weight", 1, s->dim, 1);
        SYNTH_LAYER("ffn_gate.weight", 2, s->dim, s->ffn_dim);
        SYNTH_LAYER("ffn_up.weight", 2, s->dim, s->ffn_dim);
        SYNTH_LAYER("ffn_down.weight", 2, s->ffn_dim, s->dim);
#undef SYNTH_LAYER
    }
    add_spec(specs, &n, cfg, "output_norm.weight", 1, s->dim, 1, -1);
    if (!cfg->tied) add_spec(specs, &n, cfg, "output.weight", 2, s->dim, s->n_vocab, -1);

    char **tokens = NULL;
    float *scores = NULL;
    int32_t *types = NULL;
    gguf_writer *w = NULL;
    int begun = 0;
    if ((st = make_vocab(s->n_vocab, &tokens, &scores, &types))) {
        st = status_fail(err, errlen, st, "no memory for a vocabulary of %d tokens", s->n_vocab);
        goto done;
    }
    w = gguf_writer_init();
    if (!w) {
        st = status_fail(err, errlen, STATUS_NO_MEMORY, "no memory for the writer");
        goto done;
    }
    static const uint32_t file_types[SYNTH_TYPE_COUNT] = {0, 1, 32, 7, 2, 15, 17, 18};
    gguf_writer_set_str(w, "general.architecture", "llama");
    gguf_writer_set_str(w, "general.name", cfg->name ? cfg->name : "synthetic");
    gguf_writer_set_u32(w, "general.file_type", file_types[cfg->type]);
    gguf_writer_set_u32(w, "general.quantization_version", 2);
    gguf_writer_set_u64(w, "synth.seed", cfg->seed);
    gguf_writer_set_u32(w, "llama.context_length", (uint32_t)s->ctx_len);
    gguf_writer_set_u32(w, "llama.embedding_length", (uint32_t)s->dim);
    gguf_writer_set_u32(w, "llama.block_count", (uint32_t)s->n_layers);
    gguf_writer_set_u32(w, "llama.feed_forward_length", (uint32_t)s->ffn_dim);
    gguf_writer_set_u32(w, "llama.attention.head_count", (uint32_t)s->n_heads);
    gguf_writer_set_u32(w, "llama.attention.head_count_kv", (uint32_t)s->n_kv_heads);
    if (q != s->dim) { /* the readers' default is dim / heads */
        gguf_writer_set_u32(w, "llama.attention.key_length", (uint32_t)head_dim);
        gguf_writer_set_u32(w, "llama.attention.value_length", (uint32_t)head_dim);
    }
    gguf_writer_set_u32(w, "llama.rope.dimension_count", (uint32_t)head_dim);
    gguf_writer_set_f32(w, "llama.rope.freq_base", s->rope_theta);
    gguf_writer_set_f32(w, "llama.attention.layer_norm_rms_epsilon", s->rms_eps);
    gguf_writer_set_u32(w, "llama.vocab_size", (uint32_t)s->n_vocab);
    gguf_writer_set_str(w, "tokenizer.ggml.model", "llama");
    gguf_writer_set_arr_str(w, "tokenizer.ggml.tokens", (const char *const *)tokens, (uint64_t)s->n_vocab);
    gguf_writer_set_arr_f32(w, "tokenizer.ggml.scores", scores, (uint64_t)s->n_vocab);
    gguf_writer_set_arr_i32(w, "tokenizer.ggml.token_type", types, (uint64_t)s->n_vocab);
    gguf_writer_set_u32(w, "tokenizer.ggml.unknown_token_id", 0);
    gguf_writer_set_u32(w, "tokenizer.ggml.bos_token_id", 1);
    gguf_writer_set_u32(w, "tokenizer.ggml.eos_token_id", 2);
    gguf_writer_set_bool(w, "tokenizer.ggml.add_bos_token", 1);
    gguf_writer_set_bool(w, "tokenizer.ggml.add_eos_token", 0);
    for (int i = 0; i < n; i++) gguf_writer_add_tensor_info(w, specs[i].name, specs[i].type, specs[i].n_dims, specs[i].ne);
    begun = 1;
    if ((st = gguf_writer_begin(w, path, err, errlen))) goto done;
    int n_threads = cfg->n_threads;
    if (n_threads <= 0) {
        long nc = sysconf(_SC_NPROCESSORS_ONLN);
        n_threads = nc > 0 ? (int)(nc > 64 ? 64 : nc) : 1;
    }
    for (int i = 0; i < n && !st; i++) {
        LOG(LL_DEBUG, "synth: %s %s [%lld, %lld]", specs[i].name, dtype_name(specs[i].type), (long long)specs[i].ne[0],
            (long long)specs[i].ne[1]);
        st = stream_tensor(w, cfg, &specs[i], n_threads, err, errlen);
    }
    if (!st) st = gguf_writer_finish(w, err, errlen);
done:
    gguf_writer_free(w);
    if (st && begun) unlink(path); /* never leave a half-written model behind */
    if (tokens)
        for (int32_t i = 0; i < s->n_vocab; i++) free(tokens[i]);
    free(tokens);
    free(scores);
    free(types);
    free(specs);
    return st;
}
