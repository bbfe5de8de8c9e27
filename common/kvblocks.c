/* KV-block accounting: a free stack of block ids, a reference count per
 * block, and per-sequence block tables that grow, fork (share a prefix) and
 * shrink.  Copy-on-write is decided here and executed by whoever owns the
 * KV memory. */
#include "kvblocks.h"
#include "status.h"

#include <stdio.h>
#include <stdlib.h>
#include <string.h>

struct kvblocks {
    int32_t n_blocks;
    int32_t block_size;
    int32_t n_free;
    int32_t *free_ids;  /* (n_blocks) stack; the top is free_ids[n_free - 1] */
    int32_t *refs;      /* (n_blocks) references per block, 0 = free */
};

int kvblocks_init(kvblocks **out, int32_t n_blocks, int32_t block_size, char *err, size_t errlen) {
    *out = NULL;
    if (n_blocks <= 0 || block_size <= 0) {
        snprintf(err, errlen, "kvblocks: %d blocks of %d tokens: both must be positive", n_blocks,
                 block_size);
        return STATUS_BAD_INPUT;
    }
    kvblocks *a = calloc(1, sizeof *a);
    if (a) {
        a->free_ids = malloc((size_t)n_blocks * sizeof *a->free_ids);
        a->refs = calloc((size_t)n_blocks, sizeof *a->refs);
    }
    if (!a || !a->free_ids || !a->refs) {
        kvblocks_free(a);
        snprintf(err, errlen, "kvblocks: cannot allocate the tables of %d blocks", n_blocks);
        return STATUS_NO_MEMORY;
    }
    a->n_blocks = n_blocks;
    a->block_size = block_size;
    /* Lowest ids on top, so a fresh pool hands out 0, 1, 2, ... (readable logs). */
    for (int32_t i = 0; i < n_blocks; i++) a->free_ids[i] = n_blocks - 1 - i;
    a->n_free = n_blocks;
    *out = a;
    return STATUS_OK;
}

void kvblocks_free(kvblocks *a) {
    if (!a) return;
    free(a->free_ids);
    free(a->refs);
    free(a);
}

int32_t kvblocks_block_size(const kvblocks *a) { return a->block_size; }
int32_t kvblocks_n_blocks(const kvblocks *a) { return a->n_blocks; }
int32_t kvblocks_n_free(const kvblocks *a) { return a->n_free; }
int32_t kvblocks_n_used(const kvblocks *a) { return a->n_blocks - a->n_free; }

int32_t kvblocks_refcount(const kvblocks *a, int32_t id) {
    return id >= 0 && id < a->n_blocks ? a->refs[id] : -1;
}

static int32_t kvblocks_take(kvblocks *a) {
    int32_t id = a->free_ids[--a->n_free];
    a->refs[id] = 1;
    return id;
}

static void kvblocks_release(kvblocks *a, int32_t id) {
    if (--a->refs[id] == 0) a->free_ids[a->n_free++] = id;
}

void kvblocks_table_init(struct kvblocks_table *t) { memset(t, 0, sizeof *t); }

void kvblocks_table_free(kvblocks *a, struct kvblocks_table *t) {
    for (int32_t i = 0; i < t->n_ids; i++) kvblocks_release(a, t->ids[i]);
    free(t->ids);
    kvblocks_table_init(t);
}

static int kvblocks_table_grow(struct kvblocks_table *t, int32_t n_ids) {
    if (n_ids <= t->cap) return STATUS_OK;
    int32_t cap = t->cap ? t->cap : 8;
    while (cap < n_ids) cap *= 2;
    int32_t *ids = realloc(t->ids, (size_t)cap * sizeof *ids);
    if (!ids) return STATUS_NO_MEMORY;
    t->ids = ids;
    t->cap = cap;
    return STATUS_OK;
}

static int32_t kvblocks_ceil(int32_t n, int32_t bs) { return (n + bs - 1) / bs; }

/* 1 if the next write (at position t->n_tokens) falls into an existing,
 * shared block. */
static int kvblocks_needs_cow(const kvblocks *a, const struct kvblocks_table *t) {
    int32_t bi = t->n_tokens / a->block_size;
    return t->n_tokens % a->block_size != 0 && bi < t->n_ids && a->refs[t->ids[bi]] > 1;
}

int32_t kvblocks_blocks_needed(const kvblocks *a, const struct kvblocks_table *t, int32_t n_new) {
    if (n_new <= 0) return 0;
    int32_t want = kvblocks_ceil(t->n_tokens + n_new, a->block_size);
    int32_t fresh = want > t->n_ids ? want - t->n_ids : 0;
    return fresh + kvblocks_needs_cow(a, t);
}

int kvblocks_reserve(kvblocks *a, struct kvblocks_table *t, int32_t n_new,
                     struct kvblocks_copy *copy, int32_t *n_copies) {
    if (n_copies) *n_copies = 0;
    if (n_new < 0) return STATUS_BAD_INPUT;
    if (n_new == 0) return STATUS_OK;
    int32_t need = kvblocks_blocks_needed(a, t, n_new);
    if (need > a->n_free) return STATUS_EXHAUSTED;
    int32_t want = kvblocks_ceil(t->n_tokens + n_new, a->block_size);
    if (kvblocks_table_grow(t, want) != STATUS_OK) return STATUS_NO_MEMORY;
    if (kvblocks_needs_cow(a, t)) {
        if (!copy || !n_copies) return STATUS_BAD_INPUT;
        int32_t bi = t->n_tokens / a->block_size;
        int32_t old = t->ids[bi];
        t->ids[bi] = kvblocks_take(a);
        kvblocks_release(a, old);
        copy->src = old;
        copy->dst = t->ids[bi];
        *n_copies = 1;
    }
    while (t->n_ids < want) t->ids[t->n_ids++] = kvblocks_take(a);
    t->n_tokens += n_new;
    return STATUS_OK;
}

int kvblocks_fork(kvblocks *a, struct kvblocks_table *dst, const struct kvblocks_table *src,
                  int32_t n_tokens) {
    if (n_tokens < 0 || n_tokens > src->n_tokens || dst->n_ids != 0 || dst == src)
        return STATUS_BAD_INPUT;
    int32_t n = kvblocks_ceil(n_tokens, a->block_size);
    if (kvblocks_table_grow(dst, n) != STATUS_OK) return STATUS_NO_MEMORY;
    for (int32_t i = 0; i < n; i++) {
        dst->ids[i] = src->ids[i];
        a->refs[src->ids[i]]++;
    }
    dst->n_ids = n;
    dst->n_tokens = n_tokens;
    return STATUS_OK;
}

int kvblocks_truncate(kvblocks *a, struct kvblocks_table *t, int32_t n_tokens) {
    if (n_tokens < 0 || n_tokens > t->n_tokens) return STATUS_BAD_INPUT;
    int32_t n = kvblocks_ceil(n_tokens, a->block_size);
    while (t->n_ids > n) kvblocks_release(a, t->ids[--t->n_ids]);
    t->n_tokens = n_tokens;
    return STATUS_OK;
}

int32_t kvblocks_slot(const kvblocks *a, const struct kvblocks_table *t, int32_t pos) {
    if (pos < 0) return -1;
    int32_t bi = pos / a->block_size;
    if (bi >= t->n_ids) return -1;
    return t->ids[bi] * a->block_size + pos % a->block_size;
}
