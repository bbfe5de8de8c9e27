/* Loading a stage: its layers' matrices go to the backend as they are stored
 * (quantized or not), norms and biases become F32 backend vectors, and every
 * scratch buffer of the step is allocated here, once, for the largest step
 * the configuration allows, so that forward_step never allocates. */
#include "stage.h"
#include "stage-impl.h"

#include "common/log.h"
#include "common/status.h"

#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

void stage_config_default(struct stage_config *cfg) {
    memset(cfg, 0, sizeof *cfg);
    cfg->kv_type = -1;
    cfg->weight_type = -1;
}

/* *out = the rows of tensor t converted to type wt on the host, a row at a
 * time through F32; kept in s->conv for the stage's life (the CPU backend
 * reads a weight in place). */
static int stage_convert_matrix(stage *s, const char *name, const struct model_tensor *t, enum dtype wt,
                                int64_t rows, int64_t cols, const void **out, char *err, size_t errlen) {
    const size_t src_row = dtype_row_bytes(t->type, cols), dst_row = dtype_row_bytes(wt, cols);
    void **conv = realloc(s->conv, (size_t)(s->n_conv + 1) * sizeof *conv);
    float *tmp = malloc((size_t)cols * sizeof(float));
    uint8_t *dst = malloc((size_t)rows * dst_row);
    if (conv) s->conv = conv;
    if (!conv || !tmp || !dst) {
        free(tmp);
        free(dst);
        return status_fail(err, errlen, STATUS_NO_MEMORY, "%s: tensor %s: no host memory to convert it to %s",
                           model_file_path(s->m), name, dtype_name(wt));
    }
    for (int64_t r = 0; r < rows; r++) {
        dtype_dequant_row(t->type, (const uint8_t *)t->data + (size_t)r * src_row, tmp, cols);
        int rc = dtype_quant_row(wt, tmp, dst + (size_t)r * dst_row, cols);
        if (rc != STATUS_OK) {
            free(tmp);
            free(dst);
            return status_fail(err, errlen, rc, "%s: tensor %s: converting it to %s: %s", model_file_path(s->m),
                               name, dtype_name(wt), status_str(rc));
        }
    }
    free(tmp);
    s->conv[s->n_conv++] = dst;
    *out = dst;
    return STATUS_OK;
}

/* A matrix by GGUF name, with its expected shape (rows = ne[1], cols = ne[0]). */
static int stage_load_matrix(stage *s, const char *name, int64_t rows, int64_t cols,
                             struct backend_weight *w, char *err, size_t errlen) {
    struct model_tensor t;
    if (model_file_tensor(s->m, name, &t) != STATUS_OK)
        return status_fail(err, errlen, STATUS_NOT_FOUND, "%s: tensor %s is missing",
                           model_file_path(s->m), name);
    if (t.ne[0] != cols || t.ne[1] != rows)
        return status_fail(err, errlen, STATUS_BAD_INPUT, "%s: tensor %s is [%lld, %lld], want [%lld, %lld]",
                           model_file_path(s->m), name, (long long)t.ne[0], (long long)t.ne[1],
                           (long long)cols, (long long)rows);
    enum dtype type = t.type;
    const void *data = t.data;
    size_t bytes = t.nbytes;
    const int is_float = type == DTYPE_F32 || type == DTYPE_F16 || type == DTYPE_BF16;
    const enum dtype wt = (enum dtype)s->cfg.weight_type;
    if (s->cfg.weight_type >= 0 && is_float && type != wt && strcmp(name, "token_embd.weight") != 0 &&
        cols % dtype_block_elems(wt) != 0) {
        /* As llama.cpp's quantizer does with such rows, it stays as stored. */
        LOG(LL_INFO, "%s: tensor %s stays %s: its %lld columns are not a multiple of %s's blocks of %lld",
            model_file_path(s->m), name, dtype_name(type), (long long)cols, dtype_name(wt),
            (long long)dtype_block_elems(wt));
    } else if (s->cfg.weight_type >= 0 && is_float && type != wt && strcmp(name, "token_embd.weight") != 0) {
        type = wt;
        int rc = stage_convert_matrix(s, name, &t, type, rows, cols, &data, err, errlen);
        if (rc != STATUS_OK) return rc;
        bytes = (size_t)rows * dtype_row_bytes(type, cols);
    }
    int rc = backend_weight_load(s->b, w, type, data, rows, cols);
    if (rc != STATUS_OK)
        return status_fail(err, errlen, rc, "%s: tensor %s (%s): %s", model_file_path(s->m), name,
                           dtype_name(type), backend_errstr(s->b));
    s->weight_bytes += bytes;
    return STATUS_OK;
}

/* Uploads n host floats into a new backend buffer. */
static int stage_upload_floats(stage *s, const float *host, int64_t n, float **out, const char *what,
                               char *err, size_t errlen) {
    *out = backend_alloc(s->b, (size_t)n * sizeof(float));
    if (!*out)
        return status_fail(err, errlen, STATUS_NO_MEMORY, "%s: %s", what, backend_errstr(s->b));
    int rc = backend_upload(s->b, *out, host, (size_t)n * sizeof(float));
    if (rc == STATUS_OK) rc = backend_sync(s->b); /* host is freed by the caller right after */
    if (rc != STATUS_OK) return status_fail(err, errlen, rc, "%s: upload: %s", what, backend_errstr(s->b));
    return STATUS_OK;
}

/* A vector (norm weight, bias) by name, converted to F32 whatever it is stored as. */
static int stage_load_vector(stage *s, const char *name, int64_t n, float **out, char *err,
                             size_t errlen) {
    struct model_tensor t;
    *out = NULL;
    if (model_file_tensor(s->m, name, &t) != STATUS_OK)
        return status_fail(err, errlen, STATUS_NOT_FOUND, "%s: tensor %s is missing",
                           model_file_path(s->m), name);
    if (t.ne[0] != n || t.ne[1] > 1 || n % dtype_block_elems(t.type) != 0)
        return status_fail(err, errlen, STATUS_BAD_INPUT, "%s: tensor %s is [%lld, %lld] %s, want [%lld]",
                           model_file_path(s->m), name, (long long)t.ne[0], (long long)t.ne[1],
                           dtype_name(t.type), (long long)n);
    float *host = malloc((size_t)n * sizeof *host);
    if (!host) return status_fail(err, errlen, STATUS_NO_MEMORY, "%s: out of host memory", name);
    dtype_dequant_row(t.type, t.data, host, n);
    int rc = stage_upload_floats(s, host, n, out, name, err, errlen);
    free(host);
    s->weight_bytes += t.nbytes;
    return rc;
}

static int stage_load_layer(stage *s, int32_t il, struct stage_layer *l, char *err, size_t errlen) {
    const struct model_hparams *hp = &s->hp;
    char name[96];
    int rc;
#define STAGE_NAME(suffix) (snprintf(name, sizeof name, "blk.%d." suffix, il), name)
    if ((rc = stage_load_vector(s, STAGE_NAME("attn_norm.weight"), hp->dim, &l->attn_norm, err, errlen)) ||
        (rc = stage_load_vector(s, STAGE_NAME("ffn_norm.weight"), hp->dim, &l->ffn_norm, err, errlen)) ||
        (rc = stage_load_matrix(s, STAGE_NAME("attn_q.weight"), s->q_dim, hp->dim, &l->wq, err, errlen)) ||
        (rc = stage_load_matrix(s, STAGE_NAME("attn_k.weight"), s->kv_dim, hp->dim, &l->wk, err, errlen)) ||
        (rc = stage_load_matrix(s, STAGE_NAME("attn_v.weight"), s->kv_dim, hp->dim, &l->wv, err, errlen)) ||
        (rc = stage_load_matrix(s, STAGE_NAME("attn_output.weight"), hp->dim, s->q_dim, &l->wo, err, errlen)) ||
        (rc = stage_load_matrix(s, STAGE_NAME("ffn_gate.weight"), hp->ffn_dim, hp->dim, &l->w_gate, err, errlen)) ||
        (rc = stage_load_matrix(s, STAGE_NAME("ffn_up.weight"), hp->ffn_dim, hp->dim, &l->w_up, err, errlen)) ||
        (rc = stage_load_matrix(s, STAGE_NAME("ffn_down.weight"), hp->dim, hp->ffn_dim, &l->w_down, err, errlen)))
        return rc;
    if (hp->qkv_bias) {
        if ((rc = stage_load_vector(s, STAGE_NAME("attn_q.bias"), s->q_dim, &l->bq, err, errlen)) ||
            (rc = stage_load_vector(s, STAGE_NAME("attn_k.bias"), s->kv_dim, &l->bk, err, errlen)) ||
            (rc = stage_load_vector(s, STAGE_NAME("attn_v.bias"), s->kv_dim, &l->bv, err, errlen)))
            return rc;
    }
#undef STAGE_NAME
    return STATUS_OK;
}

static void stage_free_layer(stage *s, struct stage_layer *l) {
    backend_dealloc(s->b, l->attn_norm);
    backend_dealloc(s->b, l->ffn_norm);
    backend_dealloc(s->b, l->bq);
    backend_dealloc(s->b, l->bk);
    backend_dealloc(s->b, l->bv);
    backend_weight_free(s->b, &l->wq);
    backend_weight_free(s->b, &l->wk);
    backend_weight_free(s->b, &l->wv);
    backend_weight_free(s->b, &l->wo);
    backend_weight_free(s->b, &l->w_gate);
    backend_weight_free(s->b, &l->w_up);
    backend_weight_free(s->b, &l->w_down);
}

/* Fills in defaults and checks the configuration against the model. */
static int stage_config_resolve(stage *s, const struct stage_config *in, char *err, size_t errlen) {
    const struct model_hparams *hp = &s->hp;
    struct stage_config c = *in;
    if (c.layer_last <= 0) c.layer_last = hp->n_layers;
    if (c.n_tokens_max <= 0) c.n_tokens_max = 512;
    if (c.n_seqs_max <= 0) c.n_seqs_max = 16;
    if (c.n_ctx_max <= 0) c.n_ctx_max = hp->ctx_len > 0 ? hp->ctx_len : 2048;
    if (c.n_logits_max <= 0) c.n_logits_max = c.n_seqs_max;
    if (c.n_logits_max > c.n_tokens_max) c.n_logits_max = c.n_tokens_max;
    if (c.block_size <= 0) c.block_size = KVBLOCKS_BLOCK_SIZE_DEFAULT;
    int32_t per_seq = (c.n_ctx_max + c.block_size - 1) / c.block_size;
    if (c.n_blocks <= 0) c.n_blocks = c.n_seqs_max * per_seq;
    if (c.kv_type < 0) c.kv_type = backend_is_gpu(s->b) ? DTYPE_F16 : DTYPE_F32;
    if (c.layer_first < 0 || c.layer_first >= c.layer_last || c.layer_last > hp->n_layers)
        return status_fail(err, errlen, STATUS_BAD_INPUT, "stage: layers [%d, %d) of a %d-layer model",
                           c.layer_first, c.layer_last, hp->n_layers);
    if (c.n_seqs_max > c.n_tokens_max)
        return status_fail(err, errlen, STATUS_BAD_INPUT,
                           "stage: %d sequences per step but only %d tokens per step", c.n_seqs_max,
                           c.n_tokens_max);
    if (c.kv_type != DTYPE_F32 && c.kv_type != DTYPE_F16 && c.kv_type != DTYPE_Q8_0)
        return status_fail(err, errlen, STATUS_UNSUPPORTED, "stage: KV cache type %s (F32, F16 or Q8_0)",
                           dtype_name(c.kv_type));
    if (c.kv_type == DTYPE_Q8_0 && hp->head_dim % backend_kv_q8_group(hp->head_dim) != 0)
        return status_fail(err, errlen, STATUS_UNSUPPORTED,
                           "stage: KV cache type Q8_0 needs head_dim below 32 or a multiple of 32; this model's is %d",
                           hp->head_dim);
    if (hp->head_dim % 2 != 0 || hp->n_kv_heads <= 0 || hp->n_heads % hp->n_kv_heads != 0)
        return status_fail(err, errlen, STATUS_UNSUPPORTED, "stage: %d heads, %d KV heads of %d",
                           hp->n_heads, hp->n_kv_heads, hp->head_dim);
    /* Metadata offsets are int32 slot numbers. */
    if ((int64_t)c.n_blocks * c.block_size > INT32_MAX)
        return status_fail(err, errlen, STATUS_BAD_INPUT, "stage: %d blocks of %d exceed int32 slots",
                           c.n_blocks, c.block_size);
    s->cfg = c;
    s->max_blocks_per_seq = per_seq;
    return STATUS_OK;
}

static int stage_alloc_scratch(stage *s, char *err, size_t errlen) {
    const struct model_hparams *hp = &s->hp;
    size_t T = (size_t)s->cfg.n_tokens_max, L = (size_t)s->cfg.n_logits_max;
    size_t S = (size_t)s->cfg.n_seqs_max;
    struct {
        float **p;
        size_t n;
        const char *what;
    } bufs[] = {
        {&s->x, T * hp->dim, "x"},           {&s->xn, T * hp->dim, "xn"},
        {&s->q, T * s->q_dim, "q"},          {&s->k, T * s->kv_dim, "k"},
        {&s->v, T * s->kv_dim, "v"},         {&s->att, T * s->q_dim, "att"},
        {&s->proj, T * hp->dim, "proj"},     {&s->gate, T * hp->ffn_dim, "gate"},
        {&s->up, T * hp->ffn_dim, "up"},     {&s->ffn_h, T * hp->ffn_dim, "ffn_h"},
        {&s->xl, s->last ? L * hp->dim : 1, "xl"},
        {&s->xln, s->last ? L * hp->dim : 1, "xln"},
        {&s->logits, s->last ? L * hp->n_vocab : 1, "logits"},
    };
    for (size_t i = 0; i < sizeof bufs / sizeof bufs[0]; i++) {
        *bufs[i].p = backend_alloc(s->b, bufs[i].n * sizeof(float));
        if (!*bufs[i].p)
            return status_fail(err, errlen, STATUS_NO_MEMORY, "stage: scratch %s (%zu floats): %s",
                               bufs[i].what, bufs[i].n, backend_errstr(s->b));
    }
    /* ids, pos, slots (3T), seq_tok0 (S+1), seq_pos0 (S), tables (S * max
     * blocks), logit rows (T). */
    s->meta_cap = 4 * T + 2 * S + 1 + S * (size_t)s->max_blocks_per_seq;
    s->meta = backend_alloc(s->b, s->meta_cap * sizeof(int32_t));
    s->meta_host = backend_host_alloc(s->b, s->meta_cap * sizeof(int32_t));
    if (!s->meta || !s->meta_host)
        return status_fail(err, errlen, STATUS_NO_MEMORY, "stage: step metadata (%zu ints): %s", s->meta_cap,
                           backend_errstr(s->b));
    /* Step graphs: LLM_CUDA_GRAPHS=0 keeps every step on separate
     * launches, to compare. */
    const char *env = getenv("LLM_CUDA_GRAPHS");
    s->graphs_on = backend_has_graphs(s->b) && !(env && strcmp(env, "0") == 0);
    if (s->graphs_on) {
        s->graphs = calloc((size_t)stage_graph_keys(s), sizeof *s->graphs);
        s->graph_dead = calloc((size_t)stage_graph_keys(s), 1);
        if (!s->graphs || !s->graph_dead)
            return status_fail(err, errlen, STATUS_NO_MEMORY, "stage: out of host memory");
    }
    return STATUS_OK;
}

int stage_init(stage **out, const model_file *m, backend *b, const struct stage_config *cfg,
               char *err, size_t errlen) {
    *out = NULL;
    stage *s = calloc(1, sizeof *s);
    if (!s) return status_fail(err, errlen, STATUS_NO_MEMORY, "stage: out of host memory");
    s->b = b;
    s->m = m;
    s->hp = *model_file_hparams(m);
    const struct model_hparams *hp = &s->hp;
    struct stage_config defaults;
    stage_config_default(&defaults);
    int rc = stage_config_resolve(s, cfg ? cfg : &defaults, err, errlen);
    if (rc != STATUS_OK) goto fail;
    s->first = s->cfg.layer_first == 0;
    s->last = s->cfg.layer_last == hp->n_layers;
    s->q_dim = hp->n_heads * hp->head_dim;
    s->kv_dim = hp->n_kv_heads * hp->head_dim;
    s->n_local = s->cfg.layer_last - s->cfg.layer_first;

    if (s->first || (s->last && hp->tied_embeddings)) {
        rc = stage_load_matrix(s, "token_embd.weight", hp->n_vocab, hp->dim, &s->tok_embd, err, errlen);
        if (rc != STATUS_OK) goto fail;
        /* A decode step reads one row of the embedding, not all of it. */
        if (!s->last || !hp->tied_embeddings) s->weight_bytes -= (size_t)dtype_row_bytes(s->tok_embd.type, hp->dim) * (hp->n_vocab - 1);
    }
    if (s->last) {
        rc = stage_load_vector(s, "output_norm.weight", hp->dim, &s->output_norm, err, errlen);
        if (rc != STATUS_OK) goto fail;
        if (hp->tied_embeddings) {
            s->lm_head = &s->tok_embd;
        } else {
            rc = stage_load_matrix(s, "output.weight", hp->n_vocab, hp->dim, &s->output, err, errlen);
            if (rc != STATUS_OK) goto fail;
            s->lm_head = &s->output;
        }
    }
    s->layers = calloc((size_t)s->n_local, sizeof *s->layers);
    if (!s->layers) {
        rc = status_fail(err, errlen, STATUS_NO_MEMORY, "stage: out of host memory");
        goto fail;
    }
    for (int32_t i = 0; i < s->n_local; i++) {
        rc = stage_load_layer(s, s->cfg.layer_first + i, &s->layers[i], err, errlen);
        if (rc != STATUS_OK) goto fail;
    }

    int32_t n_freq = hp->head_dim / 2;
    float *inv = malloc((size_t)n_freq * sizeof *inv);
    if (!inv) {
        rc = status_fail(err, errlen, STATUS_NO_MEMORY, "stage: out of host memory");
        goto fail;
    }
    model_rope_inv_freq(hp, inv);
    rc = stage_upload_floats(s, inv, n_freq, &s->inv_freq, "rope frequencies", err, errlen);
    free(inv);
    if (rc != STATUS_OK) goto fail;

    rc = kvcache_init(&s->kv, b, s->n_local, (enum dtype)s->cfg.kv_type, s->cfg.n_blocks,
                      s->cfg.block_size, hp->n_kv_heads, hp->head_dim, err, errlen);
    if (rc != STATUS_OK) goto fail;
    rc = stage_alloc_scratch(s, err, errlen);
    if (rc != STATUS_OK) goto fail;
    LOG(LL_INFO, "stage: layers [%d, %d) of %s on %s: %.1f MiB weights, KV %d blocks x %d (%s, %.1f MiB), "
        "step max %d tokens / %d seqs / %d ctx, step graphs %s",
        s->cfg.layer_first, s->cfg.layer_last, model_file_path(m), backend_name(b),
        s->weight_bytes / 1048576.0, s->cfg.n_blocks, s->cfg.block_size, dtype_name(s->cfg.kv_type),
        kvcache_bytes(s->kv) / 1048576.0, s->cfg.n_tokens_max, s->cfg.n_seqs_max, s->cfg.n_ctx_max,
        s->graphs_on ? "on" : "off");
    *out = s;
    return STATUS_OK;
fail:
    stage_free(s);
    return rc;
}

void stage_free(stage *s) {
    if (!s) return;
    backend *b = s->b;
    if (s->layers)
        for (int32_t i = 0; i < s->n_local; i++) stage_free_layer(s, &s->layers[i]);
    free(s->layers);
    backend_weight_free(b, &s->tok_embd);
    backend_weight_free(b, &s->output);
    backend_dealloc(b, s->output_norm);
    backend_dealloc(b, s->inv_freq);
    kvcache_free(s->kv);
    float *bufs[] = {s->x, s->xn, s->q, s->k, s->v, s->att, s->proj, s->gate, s->up, s->ffn_h,
                     s->xl, s->xln, s->logits};
    for (size_t i = 0; i < sizeof bufs / sizeof bufs[0]; i++) backend_dealloc(b, bufs[i]);
    if (s->graphs)
        for (int32_t i = 0; i < stage_graph_keys(s); i++) backend_graph_free(b, s->graphs[i]);
    free(s->graphs);
    free(s->graph_dead);
    backend_dealloc(b, s->meta);
    backend_host_free(b, s->meta_host);
    for (int32_t i = 0; i < s->n_conv; i++) free(s->conv[i]);
    free(s->conv);
    free(s);
}

const struct model_hparams *stage_hparams(const stage *s) { return &s->hp; }
const struct stage_config *stage_config_get(const stage *s) { return &s->cfg; }
int stage_is_first(const stage *s) { return s->first; }
int stage_is_last(const stage *s) { return s->last; }
backend *stage_backend(const stage *s) { return s->b; }
kvcache *stage_kvcache(const stage *s) { return s->kv; }
size_t stage_weight_bytes(const stage *s) { return s->weight_bytes; }
int32_t stage_graphs_recorded(const stage *s) {
    int32_t n = 0;
    if (s->graphs)
        for (int32_t i = 0; i < stage_graph_keys(s); i++) n += s->graphs[i] != NULL;
    return n;
}
