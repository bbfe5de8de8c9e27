/* KV-block accounting: a pool of fixed-size blocks (block_size token slots
 * each) with reference counts, and one block table per sequence mapping its
 * positions to blocks.  Sequences share prefix blocks (kvblocks_fork); a
 * write into a shared block first gets a private copy (copy-on-write), which
 * the caller executes on the KV memory from the returned copy instruction.
 * Pure bookkeeping: no KV memory lives here, so the router can own every
 * table while the workers only execute block ids and copies.
 *
 * With the prefix cache on (kvblocks_cache_enable), a full block whose KV is
 * computed can be published under a hash chained over its tokens and every
 * token before it; a new table maps the leading blocks of its tokens that are
 * published instead of computing them.  A published block nobody holds is
 * "idle": it counts as free and is reused (evicted) least recently released
 * first, only when no never-used block is left. */
#ifndef COMMON_KVBLOCKS_H
#define COMMON_KVBLOCKS_H

#include <stddef.h>
#include <stdint.h>

#define KVBLOCKS_BLOCK_SIZE_DEFAULT 16

typedef struct kvblocks kvblocks;

/* One sequence's block table.  Callers read it (ids are what a step plan
 * carries) but change it only through the kvblocks_* functions.
 * ids[i] holds positions [i*block_size, (i+1)*block_size). */
struct kvblocks_table {
    int32_t *ids;     /* n_ids block ids; heap, owned by the table */
    int32_t n_ids;
    int32_t cap;      /* allocated entries of ids */
    int32_t n_tokens; /* positions 0..n_tokens-1 hold (or are reserved for) KV */
    /* Prefix cache: ids[0..n_hashed) are published, found cached, or
     * duplicates of published blocks; hash is the chain hash of block
     * n_hashed-1 and hash_parent the published block holding that KV (the
     * parent of the next block published).  pin1 - 1: a published block the
     * table holds a reference on because one of its own blocks duplicates it
     * (0: none); hash_stop: publishing ended (a second duplicate). */
    int32_t n_hashed;
    uint64_t hash;
    int32_t hash_parent;
    int32_t pin1;
    int hash_stop;
};

/* "Copy KV block src into block dst" (all layers, K and V), to run on the KV
 * memory before the step that writes into dst. */
struct kvblocks_copy {
    int32_t src, dst;
};

/* A pool of n_blocks blocks, all free.  Returns 0 and *out, or
 * STATUS_BAD_INPUT / STATUS_NO_MEMORY with a message in err. */
int kvblocks_init(kvblocks **out, int32_t n_blocks, int32_t block_size, char *err, size_t errlen);
/* Frees the pool.  Tables still holding blocks must be freed first (their
 * arrays are the caller's to release with kvblocks_table_free). */
void kvblocks_free(kvblocks *a);

int32_t kvblocks_block_size(const kvblocks *a);
int32_t kvblocks_n_blocks(const kvblocks *a);
/* Free blocks, idle cached ones included (they are taken when needed). */
int32_t kvblocks_n_free(const kvblocks *a);
/* Blocks some table holds. */
int32_t kvblocks_n_used(const kvblocks *a);
/* Blocks held more than once (by forked tables, tables that mapped the same
 * cached blocks, or a table's pin): each counts once in kvblocks_n_used. */
int32_t kvblocks_n_shared(const kvblocks *a);
/* References held on block id (0 when free), or -1 for an id out of range. */
int32_t kvblocks_refcount(const kvblocks *a, int32_t id);

/* An empty table (no heap memory yet). */
void kvblocks_table_init(struct kvblocks_table *t);
/* Drops the table's references (blocks whose count reaches 0 become free)
 * and frees its array; the table is empty again afterwards. */
void kvblocks_table_free(kvblocks *a, struct kvblocks_table *t);

/* Blocks kvblocks_reserve(t, n_new) would take from the pool now: new blocks
 * for positions past the table's last block, plus one if the partly filled
 * last block is shared (copy-on-write). */
int32_t kvblocks_blocks_needed(const kvblocks *a, const struct kvblocks_table *t, int32_t n_new);

/* Makes positions t->n_tokens .. t->n_tokens + n_new - 1 writable and
 * advances t->n_tokens by n_new.  If the write lands in a shared block, that
 * block is replaced by a fresh one and *copy = {old, new} (*n_copies = 1):
 * the caller must copy the KV block before the step writes; otherwise
 * *n_copies = 0.  copy/n_copies may be NULL only if the caller knows no block
 * is shared.  On STATUS_EXHAUSTED (not enough free blocks) or
 * STATUS_BAD_INPUT (n_new < 0) nothing changes. */
int kvblocks_reserve(kvblocks *a, struct kvblocks_table *t, int32_t n_new,
                     struct kvblocks_copy *copy, int32_t *n_copies);

/* dst (empty) becomes a sequence whose first n_tokens positions are those of
 * src: it shares src's blocks covering them (reference counts + 1); no block
 * is copied until one side writes into a shared block.  STATUS_BAD_INPUT if
 * n_tokens > src->n_tokens or dst is not empty; STATUS_NO_MEMORY. */
int kvblocks_fork(kvblocks *a, struct kvblocks_table *dst, const struct kvblocks_table *src,
                  int32_t n_tokens);

/* Shortens t to its first n_tokens positions (n_tokens <= t->n_tokens),
 * releasing the blocks no longer needed.  STATUS_BAD_INPUT otherwise. */
int kvblocks_truncate(kvblocks *a, struct kvblocks_table *t, int32_t n_tokens);

/* The cache slot (block * block_size + offset) of position pos of t, or -1
 * if pos is not covered by the table. */
int32_t kvblocks_slot(const kvblocks *a, const struct kvblocks_table *t, int32_t pos);

/* ---- prefix cache ---------------------------------------------------------- */

/* The chain hash of the root (no block before). */
#define KVBLOCKS_HASH_ROOT UINT64_C(0x6c6c6d2d70726566)

/* The chain hash of a block holding tokens[0..n) after the block whose chain
 * hash is parent. */
uint64_t kvblocks_hash_block(uint64_t parent, const int32_t *tokens, int32_t n);

/* Turns the prefix cache on (an empty pool only: STATUS_BAD_INPUT
 * otherwise), or STATUS_NO_MEMORY with err filled. */
int kvblocks_cache_enable(kvblocks *a, char *err, size_t errlen);
int kvblocks_cache_on(const kvblocks *a);
/* Blocks published (held or idle), and idle ones. */
int32_t kvblocks_n_cached(const kvblocks *a);
int32_t kvblocks_n_idle(const kvblocks *a);
/* Idle blocks reused for something else so far. */
uint64_t kvblocks_n_evicted(const kvblocks *a);

/* How many leading full blocks of tokens[0..n_tokens) are cached (0 with
 * the cache off); *n_idle (may be NULL) receives how many of them are idle,
 * i.e. how many free blocks mapping them uses up.  Tokens are compared
 * exactly, never only by hash. */
int32_t kvblocks_cache_lookup(const kvblocks *a, const int32_t *tokens, int32_t n_tokens,
                              int32_t *n_idle);
/* t (empty) takes the first n_blocks cached blocks of tokens (n_blocks at
 * most what kvblocks_cache_lookup found), their references + 1, and holds
 * n_tokens positions of them (n_tokens <= n_blocks * block_size): the next
 * write starts at n_tokens, and a write into a cached block copies it first
 * (kvblocks_reserve), so a published block is never rewritten.
 * STATUS_BAD_INPUT (t not empty, n_blocks or n_tokens out of range, or a block
 * not cached) leaves t empty; STATUS_NO_MEMORY likewise. */
int kvblocks_cache_map(kvblocks *a, struct kvblocks_table *t, const int32_t *tokens,
                       int32_t n_blocks, int32_t n_tokens);
/* Publishes t's full blocks whose positions are all below n_computed (their
 * KV is written), tokens being t's tokens from position 0.  A block whose
 * KV is already published in another block (computed twice) stays private:
 * t pins the published one and publishes its next blocks after that one;
 * after a second such block in t, none of the rest is published.  Returns
 * the blocks newly published. */
int32_t kvblocks_cache_publish(kvblocks *a, struct kvblocks_table *t, const int32_t *tokens,
                               int32_t n_computed);
/* 1 if block t->n_hashed of tokens (t's tokens from position 0, at least
 * (t->n_hashed + 1) * block_size of them), the first one t has not
 * published, is published already under t's chain (by another table), so
 * that a lookup of these tokens finds it now; 0 otherwise or with the cache
 * off.  Hashes one block. */
int kvblocks_cache_next_found(const kvblocks *a, const struct kvblocks_table *t, const int32_t *tokens);
/* 1 if the next write into t (at position t->n_tokens) lands in a block that
 * must be copied first (shared, or published). */
int kvblocks_write_copies(const kvblocks *a, const struct kvblocks_table *t);

#endif
