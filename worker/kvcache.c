/* The paged KV memory of a stage: one backend_kv per layer, allocated once
 * at start, and block copies for copy-on-write.  A block is contiguous in
 * the [n_blocks][n_kv_heads][block_size][head_dim] layout, so a copy is one
 * backend_copy per layer and per K/V. */
#include "kvcache.h"

#include "common/status.h"

#include <stdio.h>
#include <stdlib.h>

struct kvcache {
    backend *b;
    int32_t n_layers;
    struct backend_kv *layers; /* (n_layers) */
    size_t block_bytes;        /* bytes of one block of K (or V) in one layer */
};

int kvcache_init(kvcache **out, backend *b, int32_t n_layers, enum dtype type, int32_t n_blocks,
                 int32_t block_size, int32_t n_kv_heads, int32_t head_dim, char *err,
                 size_t errlen) {
    *out = NULL;
    if (n_layers < 0) {
        snprintf(err, errlen, "kvcache: %d layers", n_layers);
        return STATUS_BAD_INPUT;
    }
    kvcache *kc = calloc(1, sizeof *kc);
    if (!kc || !(kc->layers = calloc((size_t)(n_layers ? n_layers : 1), sizeof *kc->layers))) {
        free(kc);
        snprintf(err, errlen, "kvcache: out of host memory");
        return STATUS_NO_MEMORY;
    }
    kc->b = b;
    for (int32_t i = 0; i < n_layers; i++) {
        int rc = backend_kv_init(b, &kc->layers[i], type, n_blocks, block_size, n_kv_heads, head_dim);
        if (rc != STATUS_OK) {
            snprintf(err, errlen, "kvcache: layer %d of %d (%d blocks of %d on %s): %s", i, n_layers,
                     n_blocks, block_size, backend_name(b), backend_errstr(b));
            kvcache_free(kc);
            return rc;
        }
        kc->n_layers = i + 1;
    }
    kc->block_bytes = kvcache_block_bytes(type, block_size, n_kv_heads, head_dim) / 2;
    *out = kc;
    return STATUS_OK;
}

const char *const kvcache_type_names[] = {"auto", "f32", "f16", "q8_0", NULL};

int32_t kvcache_type_of_name(int i) {
    static const int32_t types[] = {-1, DTYPE_F32, DTYPE_F16, DTYPE_Q8_0};
    return i >= 0 && i < (int)(sizeof types / sizeof types[0]) ? types[i] : -1;
}

size_t kvcache_block_bytes(enum dtype type, int32_t block_size, int32_t n_kv_heads, int32_t head_dim) {
    return 2 * (size_t)n_kv_heads * (size_t)block_size * backend_kv_row_bytes(type, head_dim);
}

void kvcache_free(kvcache *kc) {
    if (!kc) return;
    for (int32_t i = 0; i < kc->n_layers; i++) backend_kv_free(kc->b, &kc->layers[i]);
    free(kc->layers);
    free(kc);
}

struct backend_kv *kvcache_layer(kvcache *kc, int32_t i) { return &kc->layers[i]; }
int32_t kvcache_n_layers(const kvcache *kc) { return kc->n_layers; }
int32_t kvcache_n_blocks(const kvcache *kc) { return kc->n_layers ? kc->layers[0].n_blocks : 0; }
int32_t kvcache_block_size(const kvcache *kc) { return kc->n_layers ? kc->layers[0].block_size : 0; }
enum dtype kvcache_type(const kvcache *kc) { return kc->n_layers ? kc->layers[0].type : DTYPE_F32; }
size_t kvcache_bytes(const kvcache *kc) {
    return 2 * kc->block_bytes * (size_t)kvcache_n_blocks(kc) * (size_t)kc->n_layers;
}

int kvcache_copy_blocks(kvcache *kc, const struct kvblocks_copy *copies, int32_t n, char *err,
                        size_t errlen) {
    int32_t nb = kvcache_n_blocks(kc);
    for (int32_t c = 0; c < n; c++) {
        if (copies[c].src < 0 || copies[c].src >= nb || copies[c].dst < 0 || copies[c].dst >= nb ||
            copies[c].src == copies[c].dst) {
            snprintf(err, errlen, "kvcache: copy %d: block %d -> %d (cache has %d blocks)", c,
                     copies[c].src, copies[c].dst, nb);
            return STATUS_BAD_INPUT;
        }
    }
    for (int32_t c = 0; c < n; c++) {
        size_t src = (size_t)copies[c].src * kc->block_bytes, dst = (size_t)copies[c].dst * kc->block_bytes;
        for (int32_t i = 0; i < kc->n_layers; i++) {
            struct backend_kv *kv = &kc->layers[i];
            int rc = backend_copy(kc->b, (char *)kv->k + dst, (const char *)kv->k + src, kc->block_bytes);
            if (rc == STATUS_OK)
                rc = backend_copy(kc->b, (char *)kv->v + dst, (const char *)kv->v + src, kc->block_bytes);
            if (rc != STATUS_OK) {
                snprintf(err, errlen, "kvcache: copy block %d -> %d, layer %d: %s", copies[c].src,
                         copies[c].dst, i, backend_errstr(kc->b));
                return rc;
            }
        }
    }
    return STATUS_OK;
}
