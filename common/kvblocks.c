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
    /* Prefix cache (NULL arrays while off).  A published block is in the
     * hash index (bucket lists through hnext) with its chain hash, its
     * parent block (the one before it in the table that published it, -1
     * for the first) and a copy of its tokens, which lookups compare
     * exactly, so a hash collision costs a miss, never a wrong block.  With
     * no reference it is idle: on the LRU list (head = released longest
     * ago), not on the free stack.
     *
     * Matching the parent by block id is exact because a parent is never
     * evicted while a child is published: whoever holds a child holds its
     * parent, and tables release their blocks last first, so every child
     * joins the LRU list before its parent does. */
    uint8_t *cached;
    uint64_t *bhash;
    int32_t *parent;
    int32_t *btoks;     /* (n_blocks * block_size) */
    int32_t *hnext;
    int32_t *buckets;   /* (hmask + 1) heads, -1 = empty */
    uint32_t hmask;
    int32_t *lru_prev, *lru_next;
    int32_t lru_head, lru_tail;
    int32_t n_idle, n_cached;
    uint64_t n_evicted;
    int32_t n_shared;   /* blocks with more than one reference */
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
    free(a->cached);
    free(a->bhash);
    free(a->parent);
    free(a->btoks);
    free(a->hnext);
    free(a->buckets);
    free(a->lru_prev);
    free(a->lru_next);
    free(a);
}

int32_t kvblocks_block_size(const kvblocks *a) { return a->block_size; }
int32_t kvblocks_n_blocks(const kvblocks *a) { return a->n_blocks; }
int32_t kvblocks_n_free(const kvblocks *a) { return a->n_free + a->n_idle; }
int32_t kvblocks_n_used(const kvblocks *a) { return a->n_blocks - a->n_free - a->n_idle; }
int32_t kvblocks_n_shared(const kvblocks *a) { return a->n_shared; }

int32_t kvblocks_refcount(const kvblocks *a, int32_t id) {
    return id >= 0 && id < a->n_blocks ? a->refs[id] : -1;
}

/* ---- the cache's index and LRU list ---- */

static void kvblocks_lru_unlink(kvblocks *a, int32_t id) {
    int32_t p = a->lru_prev[id], n = a->lru_next[id];
    if (p >= 0) a->lru_next[p] = n;
    else a->lru_head = n;
    if (n >= 0) a->lru_prev[n] = p;
    else a->lru_tail = p;
    a->lru_prev[id] = a->lru_next[id] = -1;
    a->n_idle--;
}

static void kvblocks_lru_append(kvblocks *a, int32_t id) {
    a->lru_prev[id] = a->lru_tail;
    a->lru_next[id] = -1;
    if (a->lru_tail >= 0) a->lru_next[a->lru_tail] = id;
    else a->lru_head = id;
    a->lru_tail = id;
    a->n_idle++;
}

/* The published block with this hash, parent and tokens, or -1. */
static int32_t kvblocks_index_find(const kvblocks *a, uint64_t h, int32_t parent, const int32_t *tokens) {
    size_t bytes = (size_t)a->block_size * sizeof *tokens;
    for (int32_t id = a->buckets[h & a->hmask]; id >= 0; id = a->hnext[id])
        if (a->bhash[id] == h && a->parent[id] == parent &&
            memcmp(a->btoks + (size_t)id * a->block_size, tokens, bytes) == 0)
            return id;
    return -1;
}

static void kvblocks_index_remove(kvblocks *a, int32_t id) {
    int32_t *link = &a->buckets[a->bhash[id] & a->hmask];
    while (*link != id) link = &a->hnext[*link];
    *link = a->hnext[id];
    a->cached[id] = 0;
    a->n_cached--;
}

static int32_t kvblocks_take(kvblocks *a) {
    int32_t id;
    if (a->n_free > 0) {
        id = a->free_ids[--a->n_free];
    } else {
        /* Only idle cached blocks are left: the least recently released
         * one (a leaf of the cache, see struct kvblocks) is forgotten. */
        id = a->lru_head;
        kvblocks_lru_unlink(a, id);
        kvblocks_index_remove(a, id);
        a->n_evicted++;
    }
    a->refs[id] = 1;
    return id;
}

/* One more reference on a block some table already holds, or on an idle
 * published one (the caller unlinks it from the LRU list). */
static int32_t kvblocks_ref(kvblocks *a, int32_t id) {
    if (a->refs[id] == 1) a->n_shared++;
    return a->refs[id]++;
}

static void kvblocks_release(kvblocks *a, int32_t id) {
    if (a->refs[id] == 2) a->n_shared--;
    if (--a->refs[id] > 0) return;
    if (a->cached && a->cached[id]) kvblocks_lru_append(a, id);
    else a->free_ids[a->n_free++] = id;
}

void kvblocks_table_init(struct kvblocks_table *t) { memset(t, 0, sizeof *t); }

void kvblocks_table_free(kvblocks *a, struct kvblocks_table *t) {
    /* Last block first: children reach the LRU list before their parents. */
    for (int32_t i = t->n_ids - 1; i >= 0; i--) kvblocks_release(a, t->ids[i]);
    if (t->pin1 > 0) kvblocks_release(a, t->pin1 - 1);
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

/* 1 if the next write (at position t->n_tokens) falls into an existing
 * block that is shared or published: a published block's KV belongs to
 * every later reader and is never rewritten. */
static int kvblocks_needs_cow(const kvblocks *a, const struct kvblocks_table *t) {
    int32_t bi = t->n_tokens / a->block_size;
    if (bi >= t->n_ids) return 0;
    int32_t id = t->ids[bi];
    return a->refs[id] > 1 || (a->cached && a->cached[id]);
}

int kvblocks_write_copies(const kvblocks *a, const struct kvblocks_table *t) {
    return kvblocks_needs_cow(a, t);
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
    if (need > a->n_free + a->n_idle) return STATUS_EXHAUSTED;
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
        kvblocks_ref(a, src->ids[i]);
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
    if (t->n_hashed > n) {
        /* The chain hash of a shorter prefix is not kept: publishing walks
         * again from the first block (blocks found published stay so). */
        t->n_hashed = 0;
        t->hash = 0;
        t->hash_parent = -1;
    }
    return STATUS_OK;
}

int32_t kvblocks_slot(const kvblocks *a, const struct kvblocks_table *t, int32_t pos) {
    if (pos < 0) return -1;
    int32_t bi = pos / a->block_size;
    if (bi >= t->n_ids) return -1;
    return t->ids[bi] * a->block_size + pos % a->block_size;
}

/* ---- prefix cache ---------------------------------------------------------- */

uint64_t kvblocks_hash_block(uint64_t parent, const int32_t *tokens, int32_t n) {
    /* FNV-1a over the parent hash and the tokens' bytes, then a 64-bit
     * finaliser so that the low bits (the bucket) mix every input bit. */
    uint64_t h = UINT64_C(0xcbf29ce484222325);
    for (int i = 0; i < 8; i++) h = (h ^ ((parent >> (8 * i)) & 0xff)) * UINT64_C(0x100000001b3);
    for (int32_t k = 0; k < n; k++) {
        uint32_t v = (uint32_t)tokens[k];
        for (int i = 0; i < 4; i++) h = (h ^ ((v >> (8 * i)) & 0xff)) * UINT64_C(0x100000001b3);
    }
    h ^= h >> 33;
    h *= UINT64_C(0xff51afd7ed558ccd);
    h ^= h >> 33;
    h *= UINT64_C(0xc4ceb9fe1a85ec53);
    h ^= h >> 33;
    return h;
}

int kvblocks_cache_enable(kvblocks *a, char *err, size_t errlen) {
    if (a->cached) return STATUS_OK;
    if (a->n_free != a->n_blocks) {
        snprintf(err, errlen, "kvblocks: the prefix cache can only be turned on in an empty pool "
                 "(%d of %d blocks in use)", a->n_blocks - a->n_free, a->n_blocks);
        return STATUS_BAD_INPUT;
    }
    size_t n = (size_t)a->n_blocks;
    uint32_t nb = 1;
    while (nb < 2 * (uint32_t)a->n_blocks && nb < (UINT32_C(1) << 30)) nb <<= 1;
    a->cached = calloc(n, 1);
    a->bhash = calloc(n, sizeof *a->bhash);
    a->parent = malloc(n * sizeof *a->parent);
    a->btoks = malloc(n * (size_t)a->block_size * sizeof *a->btoks);
    a->hnext = malloc(n * sizeof *a->hnext);
    a->buckets = malloc((size_t)nb * sizeof *a->buckets);
    a->lru_prev = malloc(n * sizeof *a->lru_prev);
    a->lru_next = malloc(n * sizeof *a->lru_next);
    if (!a->cached || !a->bhash || !a->parent || !a->btoks || !a->hnext || !a->buckets ||
        !a->lru_prev || !a->lru_next) {
        free(a->cached), free(a->bhash), free(a->parent), free(a->btoks);
        free(a->hnext), free(a->buckets), free(a->lru_prev), free(a->lru_next);
        a->cached = NULL, a->bhash = NULL, a->parent = NULL, a->btoks = NULL;
        a->hnext = NULL, a->buckets = NULL, a->lru_prev = NULL, a->lru_next = NULL;
        snprintf(err, errlen, "kvblocks: cannot allocate the prefix cache of %d blocks of %d tokens",
                 a->n_blocks, a->block_size);
        return STATUS_NO_MEMORY;
    }
    for (uint32_t i = 0; i < nb; i++) a->buckets[i] = -1;
    for (size_t i = 0; i < n; i++) a->lru_prev[i] = a->lru_next[i] = a->hnext[i] = a->parent[i] = -1;
    a->hmask = nb - 1;
    a->lru_head = a->lru_tail = -1;
    return STATUS_OK;
}

int kvblocks_cache_on(const kvblocks *a) { return a->cached != NULL; }
int32_t kvblocks_n_cached(const kvblocks *a) { return a->n_cached; }
int32_t kvblocks_n_idle(const kvblocks *a) { return a->n_idle; }
uint64_t kvblocks_n_evicted(const kvblocks *a) { return a->n_evicted; }

int32_t kvblocks_cache_lookup(const kvblocks *a, const int32_t *tokens, int32_t n_tokens,
                              int32_t *n_idle) {
    if (n_idle) *n_idle = 0;
    if (!a->cached || a->n_cached == 0 || n_tokens < a->block_size) return 0;
    int32_t bs = a->block_size, full = n_tokens / bs, n = 0, parent = -1;
    uint64_t h = KVBLOCKS_HASH_ROOT;
    for (; n < full; n++) {
        const int32_t *tk = tokens + (size_t)n * bs;
        h = kvblocks_hash_block(h, tk, bs);
        int32_t id = kvblocks_index_find(a, h, parent, tk);
        if (id < 0) break;
        if (n_idle && a->refs[id] == 0) (*n_idle)++;
        parent = id;
    }
    return n;
}

int kvblocks_cache_map(kvblocks *a, struct kvblocks_table *t, const int32_t *tokens,
                       int32_t n_blocks, int32_t n_tokens) {
    int32_t bs = a->block_size;
    if (t->n_ids != 0 || n_blocks < 0 || n_tokens < 0 || n_tokens > n_blocks * bs ||
        (n_blocks > 0 && (!a->cached || n_tokens <= (n_blocks - 1) * bs)))
        return STATUS_BAD_INPUT;
    if (kvblocks_table_grow(t, n_blocks) != STATUS_OK) return STATUS_NO_MEMORY;
    uint64_t h = KVBLOCKS_HASH_ROOT;
    int32_t parent = -1;
    for (int32_t i = 0; i < n_blocks; i++) {
        const int32_t *tk = tokens + (size_t)i * bs;
        h = kvblocks_hash_block(h, tk, bs);
        int32_t id = kvblocks_index_find(a, h, parent, tk);
        if (id < 0) {
            kvblocks_table_free(a, t);
            return STATUS_BAD_INPUT;
        }
        if (kvblocks_ref(a, id) == 0) kvblocks_lru_unlink(a, id);
        t->ids[t->n_ids++] = id;
        parent = id;
    }
    t->n_tokens = n_tokens;
    t->n_hashed = n_blocks;
    t->hash = h;
    t->hash_parent = parent;
    return STATUS_OK;
}

int32_t kvblocks_cache_publish(kvblocks *a, struct kvblocks_table *t, const int32_t *tokens,
                               int32_t n_computed) {
    if (!a->cached || t->hash_stop) return 0;
    int32_t bs = a->block_size, full = n_computed / bs, n_new = 0;
    if (full > t->n_ids) full = t->n_ids;
    if (t->n_hashed == 0) t->hash = KVBLOCKS_HASH_ROOT;
    int32_t parent = t->n_hashed > 0 ? t->hash_parent : -1;
    for (int32_t i = t->n_hashed; i < full; i++) {
        const int32_t *tk = tokens + (size_t)i * bs;
        uint64_t h = kvblocks_hash_block(t->hash, tk, bs);
        int32_t id = t->ids[i];
        int32_t same = kvblocks_index_find(a, h, parent, tk);
        if (same >= 0 && same != id) {
            /* Computed twice (two sequences at once, or a prompt whose last
             * full block was recomputed for its logits).  Children must hang
             * under a parent their holders hold, so t pins the published
             * one; one pin per table, after that publishing ends. */
            if (t->pin1 > 0 && t->pin1 - 1 != same) {
                t->hash_stop = 1;
                return n_new;
            }
            if (t->pin1 == 0) {
                if (kvblocks_ref(a, same) == 0) kvblocks_lru_unlink(a, same);
                t->pin1 = same + 1;
            }
            id = same;
        } else if (same < 0) {
            if (a->cached[id]) {
                /* Published under another chain (a table mapped otherwise
                 * than by these tokens): it cannot be this chain's too. */
                t->hash_stop = 1;
                return n_new;
            }
            a->cached[id] = 1;
            a->bhash[id] = h;
            a->parent[id] = parent;
            memcpy(a->btoks + (size_t)id * bs, tk, (size_t)bs * sizeof *tk);
            uint32_t b = (uint32_t)(h & a->hmask);
            a->hnext[id] = a->buckets[b];
            a->buckets[b] = id;
            a->n_cached++;
            n_new++;
        }
        t->hash = h;
        t->hash_parent = parent = id;
        t->n_hashed = i + 1;
    }
    return n_new;
}

int kvblocks_cache_next_found(const kvblocks *a, const struct kvblocks_table *t, const int32_t *tokens) {
    if (!a->cached || a->n_cached == 0) return 0;
    int32_t k = t->n_hashed, bs = a->block_size;
    const int32_t *tk = tokens + (size_t)k * bs;
    uint64_t h = kvblocks_hash_block(k > 0 ? t->hash : KVBLOCKS_HASH_ROOT, tk, bs);
    return kvblocks_index_find(a, h, k > 0 ? t->hash_parent : -1, tk) >= 0;
}
