/* The worker's stage and its memory: its default layers, what weights,
 * KV cache and workspace take and whether they fit, loading the stage and
 * sizing the step buffers. */
#include "node-impl.h"
#include "node_metrics.h"
#include "sizing.h"

#include "common/gguf.h"
#include "common/layersplit.h"
#include "common/log.h"
#include "common/status.h"

#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>

static size_t node_tensor_bytes(const model_file *m, const char *name) {
    struct model_tensor t;
    return model_file_tensor(m, name, &t) == STATUS_OK ? t.nbytes : 0;
}

static size_t node_layer_bytes(const model_file *m, int32_t layer) {
    static const char *const parts[] = {"attn_norm.weight", "attn_q.weight",   "attn_k.weight",
                                        "attn_v.weight",    "attn_output.weight", "ffn_norm.weight",
                                        "ffn_gate.weight",  "ffn_up.weight",   "ffn_down.weight",
                                        "attn_q.bias",      "attn_k.bias",     "attn_v.bias"};
    size_t sum = 0;
    char name[96];
    for (size_t i = 0; i < sizeof parts / sizeof parts[0]; i++) {
        snprintf(name, sizeof name, "blk.%d.%s", layer, parts[i]);
        sum += node_tensor_bytes(m, name);
    }
    return sum;
}

/* Bytes of weights a stage of layers [first, end) holds. */
static size_t node_range_bytes(const model_file *m, int32_t first, int32_t end) {
    const struct model_hparams *hp = model_file_hparams(m);
    size_t sum = 0;
    for (int32_t l = first; l < end; l++) sum += node_layer_bytes(m, l);
    if (first == 0) sum += node_tensor_bytes(m, "token_embd.weight");
    if (end == hp->n_layers) {
        sum += node_tensor_bytes(m, "output_norm.weight");
        sum += hp->tied_embeddings ? node_tensor_bytes(m, "token_embd.weight")
                                   : node_tensor_bytes(m, "output.weight");
    }
    return sum;
}

int node_layers_default(node *n, int32_t *first, int32_t *end, char *err, size_t errlen) {
    int32_t n_stages = n->cfg.stage_count, index = n->cfg.stage_index;
    if (n_stages < 1 || index < 0 || index >= n_stages) {
        snprintf(err, errlen, "stage %d of %d: the index must lie in [0, %d)", index, n_stages,
                 n_stages < 1 ? 1 : n_stages);
        return STATUS_BAD_INPUT;
    }
    /* The sizes the router reads: a GGUF file's tensor infos, or for a
     * Hugging Face directory the estimate from the shapes (the router does
     * not read the weights' headers). */
    const struct model_hparams *hp = n->hp;
    const char *path = model_file_path(n->m);
    struct layersplit_sizes sz = {0};
    char why[400];
    int rc;
    struct stat st;
    if (stat(path, &st) == 0 && S_ISDIR(st.st_mode)) {
        struct layersplit_shapes sh = {hp->n_layers, hp->n_vocab, hp->dim, hp->ffn_dim,
                                       hp->n_heads, hp->n_kv_heads, hp->head_dim};
        rc = layersplit_sizes_shapes(&sz, &sh, why, sizeof why);
    } else {
        gguf_file *f = NULL;
        rc = gguf_open(&f, path, why, sizeof why);
        if (rc == STATUS_OK) rc = layersplit_sizes_gguf(&sz, f, hp->n_layers, why, sizeof why);
        gguf_close(f);
    }
    int32_t *cuts = rc == STATUS_OK ? malloc(2 * (size_t)n_stages * sizeof *cuts) : NULL;
    if (rc == STATUS_OK && !cuts) {
        snprintf(why, sizeof why, "out of memory for %d stages", n_stages);
        rc = STATUS_NO_MEMORY;
    }
    if (rc == STATUS_OK) rc = layersplit_ranges(&sz, n_stages, cuts, cuts + n_stages, why, sizeof why);
    if (rc == STATUS_OK) {
        *first = cuts[index];
        *end = cuts[n_stages + index];
    } else {
        snprintf(err, errlen, "%s: %s", path, why);
    }
    free(cuts);
    layersplit_sizes_free(&sz);
    return rc;
}

static double node_mib(size_t bytes) { return bytes / (1024.0 * 1024.0); }

/* ---- the stage and its buffers ------------------------------------------ */

void node_buffers_free(node *n) {
    free(n->hidden_in_host);
    free(n->hidden_out_host);
    free(n->srows);
    free(n->fseqs);
    free(n->tables);
    free(n->copies);
    free(n->params);
    free(n->seq_err);
    free(n->seq_status);
    free(n->masks);
    free(n->mask_seq);
    free(n->res);
    free(n->res_ptr);
    free(n->res_lp);
    free(n->res_lp_ptr);
    free(n->res_next);
    free(n->res_err);
    free(n->res_top);
    free(n->res_top_ptr);
    free(n->kv_refs);
    free(n->dreqs);
    free(n->res_draft);
    n->dreqs = NULL;
    n->res_draft = NULL;
    n->kv_refs = NULL;
    n->kv_used = 0;
    n->res = NULL;
    n->res_ptr = NULL;
    n->res_lp = NULL;
    n->res_lp_ptr = NULL;
    n->res_next = NULL;
    n->res_err = NULL;
    n->res_top = NULL;
    n->res_top_ptr = NULL;
    n->hidden_in_host = n->hidden_out_host = NULL;
    n->srows = NULL;
    n->fseqs = NULL;
    n->tables = NULL;
    n->copies = NULL;
    n->cap_copies = 0;
    n->params = NULL;
    n->seq_err = NULL;
    n->seq_status = NULL;
    n->masks = NULL;
    n->mask_seq = NULL;
    n->n_masks = 0;
}

static int node_buffers_init(node *n, char *err, size_t errlen) {
    const struct stage_config *c = stage_config_get(n->s);
    n->n_tokens_max = c->n_tokens_max;
    n->n_seqs_max = c->n_seqs_max;
    n->max_blocks = (c->n_ctx_max + c->block_size - 1) / c->block_size;
    size_t rows = (size_t)n->n_tokens_max * n->dim;
    n->hidden_in_host = malloc(rows * sizeof(float));
    n->hidden_out_host = malloc(rows * sizeof(float));
    /* Sampling rows: one per sequence, or one per token of a speculative
     * sequence's verification (all k + 1 rows get logits). */
    size_t nr = (size_t)(n->n_tokens_max > n->n_seqs_max ? n->n_tokens_max : n->n_seqs_max);
    n->srows = calloc(nr, sizeof *n->srows);
    n->fseqs = calloc((size_t)n->n_seqs_max, sizeof *n->fseqs);
    n->tables = calloc((size_t)n->n_seqs_max * n->max_blocks, sizeof *n->tables);
    n->params = calloc((size_t)n->n_seqs_max, sizeof *n->params);
    n->seq_err = calloc((size_t)n->n_seqs_max, sizeof *n->seq_err);
    n->seq_status = calloc((size_t)n->n_seqs_max, sizeof *n->seq_status);
    size_t ns = (size_t)n->n_seqs_max;
    n->res = calloc(ns, sizeof *n->res);
    n->res_ptr = calloc(ns, sizeof *n->res_ptr);
    n->res_lp = calloc(nr, sizeof *n->res_lp);
    n->res_lp_ptr = calloc(nr, sizeof *n->res_lp_ptr);
    n->res_next = calloc(nr, sizeof *n->res_next);
    n->res_err = calloc(ns, sizeof *n->res_err);
    n->res_top = calloc(nr, sizeof *n->res_top);
    n->res_top_ptr = calloc(nr, sizeof *n->res_top_ptr);
    n->kv_refs = calloc((size_t)(c->n_blocks > 0 ? c->n_blocks : 1), sizeof *n->kv_refs);
    n->kv_used = 0;
    n->dreqs = calloc(ns, sizeof *n->dreqs);
    n->res_draft = calloc(ns * NODE_DRAFT_MAX, sizeof *n->res_draft);
    if (!n->dreqs || !n->res_draft || !n->kv_refs || !n->hidden_in_host || !n->hidden_out_host || !n->srows || !n->fseqs || !n->tables ||
        !n->params || !n->seq_err || !n->seq_status || !n->res || !n->res_ptr || !n->res_lp || !n->res_err ||
        !n->res_lp_ptr || !n->res_next || !n->res_top || !n->res_top_ptr) {
        snprintf(err, errlen, "out of host memory for the step buffers (%d rows of %d)",
                 n->n_tokens_max, n->dim);
        return STATUS_NO_MEMORY;
    }
    return STATUS_OK;
}

/* What the draft model (--draft-model, opened beside the last stage by
 * node_stage_load) takes of the stage's memory: fixed, its weights (on a
 * GPU), its workspace for the largest step sizing may choose and the
 * blocks its guesses add (NODE_DRAFT_MAX positions a sequence); per_block,
 * one block of all its layers, as its pool has a block for every block of
 * the stage's.  Zeros without a draft. */
struct node_draft_budget {
    size_t fixed, per_block;
};

static void node_draft_budget(const node *n, int gpu, enum dtype kv_type, struct node_draft_budget *db) {
    db->fixed = db->per_block = 0;
    const model_file *dm = n->draft_m;
    if (!dm) return;
    const struct model_hparams *dh = model_file_hparams(dm);
    const struct node_config *cfg = &n->cfg;
    const int32_t bs = cfg->kv_block_size;
    const int32_t seqs = cfg->max_seqs > 0 ? cfg->max_seqs : SIZING_SEQS_MAX;
    const int32_t toks = cfg->max_batch_tokens > 0 ? cfg->max_batch_tokens : seqs + SIZING_PREFILL_CHUNK + 64;
    db->per_block = (size_t)dh->n_layers * kvcache_block_bytes(kv_type, bs, dh->n_kv_heads, dh->head_dim);
    db->fixed = (gpu ? node_range_bytes(dm, 0, dh->n_layers) : 0) +
                sizing_workspace_bytes(gpu, toks, seqs, dh->dim, dh->ffn_dim, dh->n_vocab) +
                db->per_block * (size_t)seqs * (size_t)(NODE_DRAFT_MAX / bs + 2);
}

/* Loads layers [first, end): checks that weights, KV cache and workspace
 * fit before allocating, then logs what each takes. */
int node_stage_load(node *n, int32_t first, int32_t end, char *err, size_t errlen) {
    const struct node_config *cfg = &n->cfg;
    node_buffers_free(n);
    stage_free(n->s);
    n->s = NULL;
    node_seqs_free(n);
    draft_free(n->dm);
    n->dm = NULL;
    const struct model_hparams *hp = n->hp;
    if (first < 0 || end > hp->n_layers || first >= end) {
        snprintf(err, errlen, "layers %d:%d: %s has layers 0:%d", first, end,
                 model_file_path(n->m), hp->n_layers);
        return STATUS_BAD_INPUT;
    }
    int gpu = backend_is_gpu(n->b);
    struct stage_config sc;
    stage_config_default(&sc);
    sc.layer_first = first;
    sc.layer_last = end;
    sc.n_ctx_max = cfg->ctx > 0 ? cfg->ctx : hp->ctx_len;
    sc.block_size = cfg->kv_block_size;
    int32_t ctx = sc.n_ctx_max > 0 ? sc.n_ctx_max : 2048;
    size_t weights = node_range_bytes(n->m, first, end);
    sc.kv_type = cfg->kv_type >= 0 ? cfg->kv_type : gpu ? DTYPE_F16 : DTYPE_F32;
    size_t per_block = (size_t)(end - first) *
                       kvcache_block_bytes((enum dtype)sc.kv_type, cfg->kv_block_size, hp->n_kv_heads, hp->head_dim);
    size_t mem_free = 0, mem_total = 0;
    backend_mem_info(n->b, &mem_free, &mem_total);
    /* The draft beside the last stage shares the budget (sizing.h:
     * node_draft_budget's bytes). */
    struct node_draft_budget db = {0, 0};
    if (end == hp->n_layers) node_draft_budget(n, gpu, (enum dtype)sc.kv_type, &db);
    /* Steps and KV from the memory budget, unless the flags give them
     * (worker/sizing.h); a stage holds the KV of every micro-batch in
     * flight, one per stage of its pipeline. */
    struct sizing_input si = {gpu, mem_free, cfg->mem_fraction, weights, per_block,
                              cfg->kv_block_size, hp->dim, hp->ffn_dim, hp->n_vocab, ctx,
                              cfg->target_ctx, n->stage_count, cfg->kv_blocks, cfg->max_seqs,
                              cfg->max_batch_tokens, db.fixed, db.per_block};
    struct sizing sz;
    char why[400];
    int rc = sizing_choose(&sz, &si, why, sizeof why);
    if (rc != STATUS_OK) {
        snprintf(err, errlen, "%s: layers %d:%d do not fit: %s", backend_name(n->b), first, end, why);
        return rc;
    }
    LOG(LL_INFO, "stage %d/%d sizing (layers %d:%d, %s KV): %s", n->stage_index, n->stage_count, first,
        end, dtype_name((enum dtype)sc.kv_type), sz.why);
    sc.n_tokens_max = sz.max_tokens;
    sc.n_seqs_max = sz.max_seqs;
    size_t work = sz.work_bytes;
    int32_t blocks = sz.kv_blocks;
    sc.n_blocks = blocks;
    size_t kv = per_block * (size_t)blocks;
    /* On the CPU the weights are read in place from the file mapping (page
     * cache), so only KV and workspace need free RAM. */
    size_t draft_bytes = db.fixed + db.per_block * (size_t)blocks;
    size_t need = kv + work + (gpu ? weights : 0) + draft_bytes;
    if (mem_free > 0 && need > mem_free) {
        snprintf(err, errlen,
                 "%s: layers %d:%d do not fit: %sKV %.1f MiB (%d blocks of %d) + workspace "
                 "~%.1f MiB%s%.1f MiB = %.1f MiB, %.1f MiB free: lower --kv-blocks or --max-batch-tokens, "
                 "or use more stages",
                 backend_name(n->b), first, end, gpu ? "weights + " : "", node_mib(kv), blocks,
                 cfg->kv_block_size, node_mib(work), draft_bytes ? " + the draft model " : "",
                 draft_bytes ? node_mib(draft_bytes) : 0.0, node_mib(need), node_mib(mem_free));
        return STATUS_NO_MEMORY;
    }
    rc = stage_init(&n->s, n->m, n->b, &sc, err, errlen);
    if (rc != STATUS_OK) return rc;
    size_t free_after = 0;
    backend_mem_info(n->b, &free_after, &mem_total);
    size_t kv_real = kvcache_bytes(stage_kvcache(n->s));
    if (gpu && mem_free > free_after && mem_free - free_after > weights + kv_real)
        work = mem_free - free_after - weights - kv_real;
    const struct stage_config *c = stage_config_get(n->s);
    LOG(LL_INFO,
        "stage %d/%d: layers %d:%d of %s on %s: weights %.2f MiB%s, KV %.2f MiB (%d blocks of %d "
        "positions, %s), workspace %s%.2f MiB; %d tokens and %d sequences per step",
        n->stage_index, n->stage_count, first, end, model_file_path(n->m), backend_name(n->b),
        node_mib(weights), gpu ? "" : " (mapped from the file)", node_mib(kv_real), c->n_blocks,
        c->block_size, dtype_name(c->kv_type), gpu ? "" : "~", node_mib(work),
        c->n_tokens_max, c->n_seqs_max);
    n->layer_first = first;
    n->layer_end = end;
    n->target_ctx = sz.target_ctx;
    n->kv_seqs = sz.kv_seqs;
    n->sized_auto = sz.auto_mask;
    atomic_store(&n->kv_blocks_total, (uint32_t)c->n_blocks);
    if (mem_total >= free_after)
        node_metrics_memory(n->metrics, n->stage_index, mem_total - free_after, mem_total);
    atomic_store(&n->kv_block_size, (uint32_t)c->block_size);
    if (n->s_draft && stage_is_last(n->s)) {
        /* The draft beside the last stage (docs/router.md, "Speculation"):
         * its pool holds the router's positions and k guesses a sequence. */
        struct draft_config dc = {c->n_tokens_max, c->n_seqs_max, c->n_ctx_max, c->block_size,
                                  c->n_blocks + c->n_seqs_max * (NODE_DRAFT_MAX / c->block_size + 2),
                                  c->kv_type, n->draft_min_prob, n->draft_type};
        rc = draft_open(&n->dm, n->draft_m, n->m, n->b, &dc, err, errlen);
        if (rc != STATUS_OK) return rc;
        LOG(LL_INFO, "stage %d/%d: draft model %s beside the last stage (%d KV blocks of its own)",
            n->stage_index, n->stage_count, n->s_draft, dc.n_blocks);
    }
    return node_buffers_init(n, err, errlen);
}
