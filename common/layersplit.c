/* The default layer split (equal bytes per stage) and the sizes it is
 * computed from: a GGUF file's tensor infos or a Hugging Face model's
 * shapes. */
#include "layersplit.h"
#include "status.h"

#include <stdlib.h>
#include <string.h>

void layersplit_sizes_free(struct layersplit_sizes *s) {
    if (!s) return;
    free(s->layer_bytes);
    memset(s, 0, sizeof *s);
}

static int layersplit_alloc(struct layersplit_sizes *s, int32_t n_layers, const char *what,
                            char *err, size_t errlen) {
    memset(s, 0, sizeof *s);
    if (n_layers < 1 || n_layers > (1 << 20))
        return status_fail(err, errlen, STATUS_BAD_INPUT, "%s: %d layers: need 1..%d", what,
                           n_layers, 1 << 20);
    s->layer_bytes = calloc((size_t)n_layers, sizeof *s->layer_bytes);
    if (!s->layer_bytes)
        return status_fail(err, errlen, STATUS_NO_MEMORY, "%s: out of memory for %d layer sizes",
                           what, n_layers);
    s->n_layers = n_layers;
    return STATUS_OK;
}

/* The N of a "blk.N." tensor name, or -1 for any other name. */
static int64_t layersplit_block_of(struct gguf_str name) {
    if (name.len < 6 || memcmp(name.ptr, "blk.", 4) != 0) return -1;
    int64_t l = 0;
    uint64_t k = 4;
    for (; k < name.len && name.ptr[k] >= '0' && name.ptr[k] <= '9' && l < (1 << 30); k++)
        l = l * 10 + (name.ptr[k] - '0');
    return k > 4 && k < name.len && name.ptr[k] == '.' ? l : -1;
}

int layersplit_sizes_gguf(struct layersplit_sizes *s, const gguf_file *f, int32_t n_layers,
                          char *err, size_t errlen) {
    int rc = layersplit_alloc(s, n_layers, gguf_path(f), err, errlen);
    if (rc < 0) return rc;
    int tied = 1;
    for (int64_t i = 0; i < gguf_n_tensors(f); i++) {
        const struct gguf_tensor *t = gguf_tensor_at(f, i);
        int64_t l = layersplit_block_of(t->name);
        if (l >= 0) {
            /* A block beyond the block count is not loaded by any stage. */
            if (l < n_layers) s->layer_bytes[l] += t->nbytes;
        } else if (gguf_str_eq(t->name, "token_embd.weight")) {
            s->embed_bytes += t->nbytes;
        } else {
            if (gguf_str_eq(t->name, "output.weight")) tied = 0;
            s->head_bytes += t->nbytes;
        }
    }
    if (tied) s->head_bytes += s->embed_bytes;
    return STATUS_OK;
}

int layersplit_sizes_shapes(struct layersplit_sizes *s, const struct layersplit_shapes *sh,
                            char *err, size_t errlen) {
    int rc = layersplit_alloc(s, sh->n_layers, "model shapes", err, errlen);
    if (rc < 0) return rc;
    if (sh->n_vocab < 0 || sh->dim < 0 || sh->ffn_dim < 0 || sh->n_heads < 0 ||
        sh->n_kv_heads < 0 || sh->head_dim < 0) {
        layersplit_sizes_free(s);
        return status_fail(err, errlen, STATUS_BAD_INPUT,
                           "model shapes: a negative size (vocab %d, dim %d, ffn %d, heads %d, "
                           "kv heads %d, head_dim %d)", sh->n_vocab, sh->dim, sh->ffn_dim,
                           sh->n_heads, sh->n_kv_heads, sh->head_dim);
    }
    uint64_t d = (uint64_t)sh->dim, qd = (uint64_t)sh->n_heads * (uint64_t)sh->head_dim,
             kvd = (uint64_t)sh->n_kv_heads * (uint64_t)sh->head_dim;
    uint64_t layer = d * qd * 2 + d * kvd * 2 + 3 * d * (uint64_t)sh->ffn_dim + 2 * d;
    for (int32_t i = 0; i < s->n_layers; i++) s->layer_bytes[i] = layer;
    s->embed_bytes = (uint64_t)sh->n_vocab * d;
    s->head_bytes = (uint64_t)sh->n_vocab * d + d;
    return STATUS_OK;
}

int layersplit_ranges(const struct layersplit_sizes *s, int32_t n_stages, int32_t *first,
                      int32_t *end, char *err, size_t errlen) {
    int32_t L = s->n_layers;
    if (n_stages < 1 || n_stages > L)
        return status_fail(err, errlen, STATUS_BAD_INPUT, "%d stages for %d layers: need 1..%d",
                           n_stages, L, L);
    double total = (double)s->embed_bytes + (double)s->head_bytes;
    for (int32_t i = 0; i < L; i++) total += (double)s->layer_bytes[i];
    int32_t cut = 0;
    double acc = (double)s->embed_bytes; /* the bytes before layer `cut` */
    for (int32_t k = 0; k < n_stages; k++) {
        first[k] = cut;
        if (k == n_stages - 1) {
            end[k] = L;
            break;
        }
        /* Candidates leave a layer for this stage and for each one after. */
        double target = total * (double)(k + 1) / (double)n_stages;
        int32_t lo = cut + 1, hi = L - (n_stages - k - 1);
        double run = acc + (double)s->layer_bytes[cut];
        double best = run > target ? run - target : target - run;
        int32_t c = lo;
        for (int32_t e = lo + 1; e <= hi; e++) {
            run += (double)s->layer_bytes[e - 1];
            double dist = run > target ? run - target : target - run;
            if (dist < best) {
                best = dist;
                c = e;
            }
        }
        for (int32_t l = cut; l < c; l++) acc += (double)s->layer_bytes[l];
        end[k] = c;
        cut = c;
    }
    return STATUS_OK;
}
