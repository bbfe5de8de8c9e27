/* Tests of the KV-block accounting: growth, exhaustion without side
 * effects, prefix sharing with copy-on-write, truncation, that every block
 * returns to the pool, and the prefix cache: the hash chain, exact lookups,
 * publishing only computed full blocks, idle blocks counted free and evicted
 * least recently released first (children before parents), duplicates,
 * and a cached block never written in place. */
#include "../test.h"
#include "common/kvblocks.h"
#include "common/status.h"

static kvblocks *new_pool(int32_t n, int32_t bs) {
    kvblocks *a = NULL;
    char err[256];
    if (kvblocks_init(&a, n, bs, err, sizeof err) != 0) TEST_FAIL("kvblocks_init: %s", err);
    return a;
}

TEST(kvblocks_init_rejects_bad_shape) {
    kvblocks *a = (kvblocks *)1;
    char err[256] = "";
    ASSERT_EQ((int)STATUS_BAD_INPUT, kvblocks_init(&a, 0, 16, err, sizeof err));
    ASSERT_TRUE(a == NULL);
    ASSERT_TRUE(strstr(err, "0 blocks") != NULL);
    ASSERT_EQ((int)STATUS_BAD_INPUT, kvblocks_init(&a, 4, -1, err, sizeof err));
}

TEST(kvblocks_reserve_grows_and_frees) {
    kvblocks *a = new_pool(8, 4);
    struct kvblocks_table t;
    kvblocks_table_init(&t);
    ASSERT_EQ(2, kvblocks_blocks_needed(a, &t, 5));
    ASSERT_OK(kvblocks_reserve(a, &t, 5, NULL, NULL));
    ASSERT_EQ(2, t.n_ids);
    ASSERT_EQ(5, t.n_tokens);
    ASSERT_EQ(6, kvblocks_n_free(a));
    ASSERT_EQ(0, kvblocks_blocks_needed(a, &t, 3)); /* fills block 1 exactly */
    ASSERT_OK(kvblocks_reserve(a, &t, 3, NULL, NULL));
    ASSERT_EQ(2, t.n_ids);
    ASSERT_OK(kvblocks_reserve(a, &t, 1, NULL, NULL));
    ASSERT_EQ(3, t.n_ids);
    /* Slots follow the table. */
    ASSERT_EQ(t.ids[0] * 4 + 3, kvblocks_slot(a, &t, 3));
    ASSERT_EQ(t.ids[2] * 4 + 0, kvblocks_slot(a, &t, 8));
    ASSERT_EQ(-1, kvblocks_slot(a, &t, 12));
    ASSERT_EQ(-1, kvblocks_slot(a, &t, -1));
    ASSERT_EQ(1, kvblocks_refcount(a, t.ids[0]));
    kvblocks_table_free(a, &t);
    ASSERT_EQ(8, kvblocks_n_free(a));
    ASSERT_EQ(0, kvblocks_n_used(a));
    ASSERT_EQ(0, t.n_ids);
    kvblocks_free(a);
}

TEST(kvblocks_exhausted_changes_nothing) {
    kvblocks *a = new_pool(3, 4);
    struct kvblocks_table t, u;
    kvblocks_table_init(&t);
    kvblocks_table_init(&u);
    ASSERT_OK(kvblocks_reserve(a, &t, 6, NULL, NULL));
    ASSERT_EQ((int)STATUS_EXHAUSTED, kvblocks_reserve(a, &u, 5, NULL, NULL));
    ASSERT_EQ(0, u.n_tokens);
    ASSERT_EQ(0, u.n_ids);
    ASSERT_EQ(1, kvblocks_n_free(a));
    ASSERT_EQ((int)STATUS_BAD_INPUT, kvblocks_reserve(a, &u, -1, NULL, NULL));
    ASSERT_OK(kvblocks_reserve(a, &u, 4, NULL, NULL));
    ASSERT_EQ(0, kvblocks_n_free(a));
    kvblocks_table_free(a, &t);
    kvblocks_table_free(a, &u);
    ASSERT_EQ(3, kvblocks_n_free(a));
    kvblocks_free(a);
}

TEST(kvblocks_fork_shares_and_copies_on_write) {
    kvblocks *a = new_pool(16, 4);
    struct kvblocks_table p, c;
    struct kvblocks_copy cp = {-1, -1};
    int32_t n_cp = -1;
    kvblocks_table_init(&p);
    kvblocks_table_init(&c);
    ASSERT_OK(kvblocks_reserve(a, &p, 10, &cp, &n_cp)); /* blocks 0,1 full, 2 holds 2 */
    ASSERT_EQ(0, n_cp);
    ASSERT_OK(kvblocks_fork(a, &c, &p, 10));
    ASSERT_EQ(3, c.n_ids);
    ASSERT_EQ(10, c.n_tokens);
    for (int i = 0; i < 3; i++) {
        ASSERT_EQ(p.ids[i], c.ids[i]);
        ASSERT_EQ(2, kvblocks_refcount(a, p.ids[i]));
    }
    ASSERT_EQ(13, kvblocks_n_free(a));
    ASSERT_EQ(3, kvblocks_n_used(a)); /* shared blocks count once */
    ASSERT_EQ(3, kvblocks_n_shared(a));
    /* The child's next write lands in shared block 2: it gets a copy. */
    int32_t shared = p.ids[2];
    ASSERT_EQ(1, kvblocks_blocks_needed(a, &c, 1));
    ASSERT_OK(kvblocks_reserve(a, &c, 1, &cp, &n_cp));
    ASSERT_EQ(1, n_cp);
    ASSERT_EQ(shared, cp.src);
    ASSERT_EQ(c.ids[2], cp.dst);
    ASSERT_NE(shared, c.ids[2]);
    ASSERT_EQ(1, kvblocks_refcount(a, shared));
    ASSERT_EQ(2, kvblocks_refcount(a, p.ids[0]));
    ASSERT_EQ(2, kvblocks_n_shared(a));
    /* Now the parent owns block 2 alone: no copy for its write. */
    ASSERT_OK(kvblocks_reserve(a, &p, 3, &cp, &n_cp));
    ASSERT_EQ(0, n_cp);
    ASSERT_EQ(shared, p.ids[2]);
    /* Reserving without a copy buffer when a copy is needed is refused. */
    struct kvblocks_table g;
    kvblocks_table_init(&g);
    ASSERT_OK(kvblocks_fork(a, &g, &p, 6));
    ASSERT_EQ((int)STATUS_BAD_INPUT, kvblocks_reserve(a, &g, 1, NULL, NULL));
    ASSERT_EQ(6, g.n_tokens);
    /* Fork errors. */
    ASSERT_EQ((int)STATUS_BAD_INPUT, kvblocks_fork(a, &g, &p, 2)); /* g not empty */
    struct kvblocks_table h;
    kvblocks_table_init(&h);
    ASSERT_EQ((int)STATUS_BAD_INPUT, kvblocks_fork(a, &h, &p, p.n_tokens + 1));
    kvblocks_table_free(a, &g);
    kvblocks_table_free(a, &p);
    ASSERT_EQ(1, kvblocks_refcount(a, c.ids[0]));
    ASSERT_EQ(0, kvblocks_n_shared(a));
    kvblocks_table_free(a, &c);
    ASSERT_EQ(16, kvblocks_n_free(a));
    kvblocks_free(a);
}

TEST(kvblocks_fork_at_block_boundary_needs_no_copy) {
    kvblocks *a = new_pool(8, 4);
    struct kvblocks_table p, c;
    struct kvblocks_copy cp;
    int32_t n_cp = -1;
    kvblocks_table_init(&p);
    kvblocks_table_init(&c);
    ASSERT_OK(kvblocks_reserve(a, &p, 8, NULL, NULL));
    ASSERT_OK(kvblocks_fork(a, &c, &p, 8));
    ASSERT_OK(kvblocks_reserve(a, &c, 2, &cp, &n_cp));
    ASSERT_EQ(0, n_cp);
    ASSERT_EQ(3, c.n_ids);
    ASSERT_EQ(5, kvblocks_n_free(a));
    kvblocks_table_free(a, &p);
    kvblocks_table_free(a, &c);
    ASSERT_EQ(8, kvblocks_n_free(a));
    kvblocks_free(a);
}

TEST(kvblocks_truncate_releases_tail) {
    kvblocks *a = new_pool(8, 4);
    struct kvblocks_table t;
    kvblocks_table_init(&t);
    ASSERT_OK(kvblocks_reserve(a, &t, 13, NULL, NULL));
    ASSERT_EQ(4, t.n_ids);
    ASSERT_OK(kvblocks_truncate(a, &t, 5));
    ASSERT_EQ(2, t.n_ids);
    ASSERT_EQ(5, t.n_tokens);
    ASSERT_EQ(6, kvblocks_n_free(a));
    ASSERT_EQ((int)STATUS_BAD_INPUT, kvblocks_truncate(a, &t, 6));
    ASSERT_OK(kvblocks_truncate(a, &t, 0));
    ASSERT_EQ(0, t.n_ids);
    ASSERT_EQ(8, kvblocks_n_free(a));
    kvblocks_table_free(a, &t);
    kvblocks_free(a);
}

/* Many sequences forking and growing at random: the counts always add up and
 * everything returns. */
TEST(kvblocks_random_churn_returns_everything) {
    enum { N_SEQ = 12 };
    kvblocks *a = new_pool(64, 4);
    struct kvblocks_table t[N_SEQ];
    for (int i = 0; i < N_SEQ; i++) kvblocks_table_init(&t[i]);
    uint32_t rng = 12345;
    for (int step = 0; step < 2000; step++) {
        rng = rng * 1664525u + 1013904223u;
        int i = (int)((rng >> 8) % N_SEQ), op = (int)((rng >> 20) % 4);
        struct kvblocks_copy cp;
        int32_t n_cp;
        if (op == 0 && t[i].n_ids == 0) {
            int j = (i + 1) % N_SEQ;
            if (t[j].n_tokens > 0) ASSERT_OK(kvblocks_fork(a, &t[i], &t[j], (int32_t)(rng % (uint32_t)(t[j].n_tokens + 1))));
        } else if (op == 1) {
            kvblocks_table_free(a, &t[i]);
        } else {
            int32_t n = (int32_t)((rng >> 4) % 7);
            int32_t need = kvblocks_blocks_needed(a, &t[i], n);
            int32_t free0 = kvblocks_n_free(a);
            int r = kvblocks_reserve(a, &t[i], n, &cp, &n_cp);
            if (need > free0) {
                ASSERT_EQ((int)STATUS_EXHAUSTED, r);
            } else {
                ASSERT_OK(r);
                ASSERT_EQ(free0 - need, kvblocks_n_free(a));
            }
        }
        /* Sum of references equals table entries. */
        int64_t refs = 0, entries = 0;
        for (int b = 0; b < 64; b++) refs += kvblocks_refcount(a, b);
        for (int s = 0; s < N_SEQ; s++) entries += t[s].n_ids;
        ASSERT_EQ(entries, refs);
    }
    for (int i = 0; i < N_SEQ; i++) kvblocks_table_free(a, &t[i]);
    ASSERT_EQ(64, kvblocks_n_free(a));
    kvblocks_free(a);
}


static kvblocks *new_cache(int32_t n, int32_t bs) {
    kvblocks *a = new_pool(n, bs);
    char err[256];
    if (kvblocks_cache_enable(a, err, sizeof err) != 0) TEST_FAIL("kvblocks_cache_enable: %s", err);
    return a;
}

/* A sequence of n tokens computed in one table: reserved, then published. */
static void run_seq(kvblocks *a, struct kvblocks_table *t, const int32_t *toks, int32_t n) {
    kvblocks_table_init(t);
    ASSERT_OK(kvblocks_reserve(a, t, n, NULL, NULL));
    kvblocks_cache_publish(a, t, toks, n);
}

TEST(kvblocks_hash_chain_covers_every_earlier_token) {
    int32_t x[4] = {1, 2, 3, 4}, y[4] = {1, 2, 3, 5};
    uint64_t h0 = kvblocks_hash_block(KVBLOCKS_HASH_ROOT, x, 4);
    ASSERT_EQ(h0, kvblocks_hash_block(KVBLOCKS_HASH_ROOT, x, 4));
    ASSERT_NE(h0, kvblocks_hash_block(KVBLOCKS_HASH_ROOT, y, 4));
    /* The same block after different parents hashes differently. */
    uint64_t hy = kvblocks_hash_block(KVBLOCKS_HASH_ROOT, y, 4);
    ASSERT_NE(kvblocks_hash_block(h0, x, 4), kvblocks_hash_block(hy, x, 4));
    /* Token order matters. */
    int32_t z[4] = {2, 1, 3, 4};
    ASSERT_NE(h0, kvblocks_hash_block(KVBLOCKS_HASH_ROOT, z, 4));
}

TEST(kvblocks_cache_publishes_full_computed_blocks_only) {
    kvblocks *a = new_cache(16, 4);
    int32_t toks[11];
    for (int i = 0; i < 11; i++) toks[i] = 100 + i;
    struct kvblocks_table t;
    kvblocks_table_init(&t);
    ASSERT_OK(kvblocks_reserve(a, &t, 11, NULL, NULL));
    ASSERT_EQ(0, kvblocks_cache_lookup(a, toks, 11, NULL));
    /* 6 positions computed: one full block. */
    ASSERT_EQ(1, kvblocks_cache_publish(a, &t, toks, 6));
    ASSERT_EQ(1, kvblocks_cache_lookup(a, toks, 11, NULL));
    ASSERT_EQ(1, kvblocks_n_cached(a));
    ASSERT_EQ(1, kvblocks_cache_publish(a, &t, toks, 11));
    ASSERT_EQ(0, kvblocks_cache_publish(a, &t, toks, 11)); /* already */
    ASSERT_EQ(2, kvblocks_cache_lookup(a, toks, 11, NULL));
    ASSERT_EQ(2, kvblocks_cache_lookup(a, toks, 8, NULL));
    ASSERT_EQ(1, kvblocks_cache_lookup(a, toks, 7, NULL)); /* only full blocks of the query */
    /* A different token anywhere before a block hides it and all after. */
    int32_t other[11];
    memcpy(other, toks, sizeof toks);
    other[5] = 7;
    ASSERT_EQ(1, kvblocks_cache_lookup(a, other, 11, NULL));
    other[0] = 7;
    ASSERT_EQ(0, kvblocks_cache_lookup(a, other, 11, NULL));
    int32_t idle = -1;
    ASSERT_EQ(2, kvblocks_cache_lookup(a, toks, 11, &idle));
    ASSERT_EQ(0, idle); /* t still holds them */
    kvblocks_table_free(a, &t);
    /* Published blocks stay, idle, and count as free. */
    ASSERT_EQ(2, kvblocks_n_cached(a));
    ASSERT_EQ(2, kvblocks_n_idle(a));
    ASSERT_EQ(16, kvblocks_n_free(a));
    ASSERT_EQ(0, kvblocks_n_used(a));
    ASSERT_EQ(2, kvblocks_cache_lookup(a, toks, 11, &idle));
    ASSERT_EQ(2, idle);
    kvblocks_free(a);
}

TEST(kvblocks_cache_map_shares_and_never_rewrites) {
    kvblocks *a = new_cache(16, 4);
    int32_t toks[12];
    for (int i = 0; i < 12; i++) toks[i] = 7 * i + 1;
    struct kvblocks_table t, u, v;
    run_seq(a, &t, toks, 10); /* publishes blocks 0 and 1 */
    kvblocks_table_init(&u);
    ASSERT_EQ(2, kvblocks_cache_lookup(a, toks, 12, NULL));
    ASSERT_EQ((int)STATUS_BAD_INPUT, kvblocks_cache_map(a, &u, toks, 2, 4)); /* block 1 unused */
    ASSERT_EQ(0, u.n_ids);
    ASSERT_OK(kvblocks_cache_map(a, &u, toks, 2, 8));
    ASSERT_EQ(t.ids[0], u.ids[0]);
    ASSERT_EQ(t.ids[1], u.ids[1]);
    ASSERT_EQ(2, kvblocks_refcount(a, t.ids[0]));
    ASSERT_EQ(8, u.n_tokens);
    /* The next write starts in a fresh block: no copy. */
    struct kvblocks_copy cp;
    int32_t nc = -1;
    ASSERT_OK(kvblocks_reserve(a, &u, 4, &cp, &nc));
    ASSERT_EQ(0, nc);
    kvblocks_table_free(a, &t);
    /* A table mapping a cached block partly and writing into it gets a copy,
     * even when it is the block's only holder: published KV is never
     * rewritten. */
    kvblocks_table_init(&v);
    ASSERT_OK(kvblocks_cache_map(a, &v, toks, 2, 7));
    ASSERT_EQ(1, kvblocks_write_copies(a, &v));
    ASSERT_EQ(1, kvblocks_blocks_needed(a, &v, 1));
    int32_t cached1 = v.ids[1];
    ASSERT_OK(kvblocks_reserve(a, &v, 1, &cp, &nc));
    ASSERT_EQ(1, nc);
    ASSERT_EQ(cached1, cp.src);
    ASSERT_NE(cached1, v.ids[1]);
    ASSERT_EQ(2, kvblocks_cache_lookup(a, toks, 12, NULL)); /* still published */
    kvblocks_table_free(a, &u);
    kvblocks_table_free(a, &v);
    ASSERT_EQ(0, kvblocks_n_used(a));
    ASSERT_EQ(16, kvblocks_n_free(a));
    kvblocks_free(a);
}

TEST(kvblocks_cache_evicts_least_recently_released_leaves_first) {
    /* 6 blocks of 2 tokens.  A publishes 2 blocks, B 2 others; A is released
     * before B, so A's blocks go first, child before parent. */
    kvblocks *a = new_cache(6, 2);
    int32_t ta[4] = {1, 2, 3, 4}, tb[4] = {5, 6, 7, 8};
    struct kvblocks_table A, B, C;
    run_seq(a, &A, ta, 4);
    run_seq(a, &B, tb, 4);
    int32_t a0 = A.ids[0], a1 = A.ids[1];
    kvblocks_table_free(a, &A);
    kvblocks_table_free(a, &B);
    ASSERT_EQ(4, kvblocks_n_idle(a));
    ASSERT_EQ(6, kvblocks_n_free(a));
    /* Two never-used blocks go before any idle one. */
    kvblocks_table_init(&C);
    ASSERT_OK(kvblocks_reserve(a, &C, 4, NULL, NULL));
    ASSERT_EQ(0, (int)kvblocks_n_evicted(a));
    ASSERT_EQ(2, kvblocks_cache_lookup(a, ta, 4, NULL));
    /* The next one evicts A's child, then A's parent. */
    ASSERT_OK(kvblocks_reserve(a, &C, 2, NULL, NULL));
    ASSERT_EQ(a1, C.ids[2]);
    ASSERT_EQ(1, (int)kvblocks_n_evicted(a));
    ASSERT_EQ(1, kvblocks_cache_lookup(a, ta, 4, NULL));
    ASSERT_EQ(2, kvblocks_cache_lookup(a, tb, 4, NULL));
    ASSERT_OK(kvblocks_reserve(a, &C, 2, NULL, NULL));
    ASSERT_EQ(a0, C.ids[3]);
    ASSERT_EQ(0, kvblocks_cache_lookup(a, ta, 4, NULL));
    ASSERT_EQ(2, kvblocks_cache_lookup(a, tb, 4, NULL));
    /* Mapping B's blocks takes them off the LRU list: nothing is left to
     * evict, and a reservation beyond the pool fails without side effects. */
    struct kvblocks_table D;
    kvblocks_table_init(&D);
    ASSERT_OK(kvblocks_cache_map(a, &D, tb, 2, 4));
    ASSERT_EQ(0, kvblocks_n_idle(a));
    ASSERT_EQ(0, kvblocks_n_free(a));
    ASSERT_EQ((int)STATUS_EXHAUSTED, kvblocks_reserve(a, &D, 1, NULL, NULL));
    kvblocks_table_free(a, &C);
    kvblocks_table_free(a, &D);
    ASSERT_EQ(6, kvblocks_n_free(a));
    ASSERT_EQ(0, kvblocks_n_used(a));
    kvblocks_free(a);
}

TEST(kvblocks_cache_duplicate_pins_the_published_block) {
    /* Two tables compute the same prefix at once: the second one's block 0
     * stays private, it pins the first's, and its block 1 is published
     * under the first's block 0, where a lookup finds it. */
    kvblocks *a = new_cache(16, 2);
    int32_t t1[4] = {1, 2, 3, 4}, t2[4] = {1, 2, 9, 9};
    struct kvblocks_table A, B;
    kvblocks_table_init(&A);
    kvblocks_table_init(&B);
    ASSERT_OK(kvblocks_reserve(a, &A, 4, NULL, NULL));
    ASSERT_OK(kvblocks_reserve(a, &B, 4, NULL, NULL));
    ASSERT_EQ(2, kvblocks_cache_publish(a, &A, t1, 4));
    ASSERT_EQ(1, kvblocks_cache_publish(a, &B, t2, 4));
    ASSERT_EQ(A.ids[0] + 1, B.pin1);
    ASSERT_EQ(2, kvblocks_refcount(a, A.ids[0]));
    ASSERT_EQ(2, kvblocks_cache_lookup(a, t2, 4, NULL));
    ASSERT_EQ(16, kvblocks_n_used(a) + kvblocks_n_free(a));
    /* A ends: its block 0 stays held by B's pin, so B's published child
     * keeps a live parent. */
    kvblocks_table_free(a, &A);
    ASSERT_EQ(1, kvblocks_refcount(a, B.pin1 - 1));
    ASSERT_EQ(2, kvblocks_cache_lookup(a, t2, 4, NULL));
    ASSERT_EQ(2, kvblocks_cache_lookup(a, t1, 4, NULL)); /* A's block 1 idle, still found */
    kvblocks_table_free(a, &B);
    ASSERT_EQ(0, kvblocks_n_used(a));
    ASSERT_EQ(16, kvblocks_n_free(a));
    kvblocks_free(a);
}

TEST(kvblocks_cache_off_changes_nothing) {
    kvblocks *a = new_pool(8, 2);
    int32_t toks[4] = {1, 2, 3, 4};
    struct kvblocks_table t, u;
    kvblocks_table_init(&t);
    ASSERT_OK(kvblocks_reserve(a, &t, 4, NULL, NULL));
    ASSERT_EQ(0, kvblocks_cache_publish(a, &t, toks, 4));
    kvblocks_table_free(a, &t);
    ASSERT_EQ(0, kvblocks_cache_lookup(a, toks, 4, NULL));
    ASSERT_EQ(0, kvblocks_n_cached(a));
    kvblocks_table_init(&u);
    ASSERT_EQ((int)STATUS_BAD_INPUT, kvblocks_cache_map(a, &u, toks, 1, 2));
    ASSERT_EQ(8, kvblocks_n_free(a));
    /* Turning it on needs an empty pool. */
    char err[256] = "";
    ASSERT_OK(kvblocks_reserve(a, &u, 1, NULL, NULL));
    ASSERT_EQ((int)STATUS_BAD_INPUT, kvblocks_cache_enable(a, err, sizeof err));
    ASSERT_TRUE(strstr(err, "empty pool") != NULL);
    kvblocks_table_free(a, &u);
    kvblocks_free(a);
}

/* Reserves n more positions of t and "writes" their tokens into content, as
 * a worker would (copies first). */
static int write(kvblocks *a, struct kvblocks_table *t, const int32_t *toks, int32_t n,
                 int32_t (*content)[2]) {
    struct kvblocks_copy cp;
    int32_t nc = 0, start = t->n_tokens;
    int rc = kvblocks_reserve(a, t, n, &cp, &nc);
    if (rc != STATUS_OK) return rc;
    if (nc) memcpy(content[cp.dst], content[cp.src], sizeof content[0]);
    for (int32_t p = start; p < start + n; p++) content[t->ids[p / 2]][p % 2] = toks[p];
    return STATUS_OK;
}

/* Many tables over a few shared prefixes, mapping what is cached, publishing
 * what they compute and ending at random: references always equal table
 * entries plus pins, a lookup never returns a block whose tokens differ,
 * and everything comes back. */
TEST(kvblocks_cache_random_churn_stays_consistent) {
    enum { N_SEQ = 8, BS = 2, NB = 40 };
    kvblocks *a = new_cache(NB, BS);
    struct kvblocks_table t[N_SEQ];
    int32_t toks[N_SEQ][32];
    int32_t len[N_SEQ];
    static int32_t content[NB][BS]; /* what each block's slots were last written with */
    for (int i = 0; i < N_SEQ; i++) kvblocks_table_init(&t[i]), len[i] = 0;
    uint32_t rng = 99;
    for (int it = 0; it < 4000; it++) {
        rng = rng * 1103515245u + 12345u;
        int i = (int)((rng >> 16) % N_SEQ);
        int op = (int)((rng >> 8) % 5);
        if (t[i].n_ids == 0) {
            /* Start: a few shared prefixes of tokens 0..3. */
            int32_t n = 4 + (int32_t)((rng >> 4) % 20);
            int32_t fam = (int32_t)((rng >> 12) % 3);
            for (int32_t k = 0; k < n; k++) toks[i][k] = k < 10 ? fam * 10 + k % 4 : (int32_t)(rng >> (k % 16)) % 5;
            len[i] = n;
            int32_t hits = kvblocks_cache_lookup(a, toks[i], n, NULL);
            if (hits > (n - 1) / BS) hits = (n - 1) / BS;
            if (hits > 0) ASSERT_OK(kvblocks_cache_map(a, &t[i], toks[i], hits, hits * BS));
            /* A mapped block holds exactly these tokens, as written. */
            for (int32_t k = 0; k < hits * BS; k++)
                ASSERT_EQ(toks[i][k], content[t[i].ids[k / BS]][k % BS]);
            if (write(a, &t[i], toks[i], n - t[i].n_tokens, content) != STATUS_OK) {
                kvblocks_table_free(a, &t[i]);
                continue;
            }
            kvblocks_cache_publish(a, &t[i], toks[i], t[i].n_tokens);
        } else if (op == 0) {
            kvblocks_table_free(a, &t[i]);
        } else if (len[i] < 32) {
            toks[i][len[i]] = (int32_t)(rng % 3);
            if (write(a, &t[i], toks[i], 1, content) == STATUS_OK) {
                len[i]++;
                kvblocks_cache_publish(a, &t[i], toks[i], t[i].n_tokens);
            }
        }
        int64_t refs = 0, entries = 0;
        for (int b = 0; b < NB; b++) refs += kvblocks_refcount(a, b);
        for (int s = 0; s < N_SEQ; s++) entries += t[s].n_ids + (t[s].pin1 > 0);
        ASSERT_EQ(entries, refs);
        ASSERT_EQ(NB, kvblocks_n_used(a) + kvblocks_n_free(a));
        ASSERT_TRUE(kvblocks_n_idle(a) <= kvblocks_n_cached(a));
    }
    ASSERT_TRUE(kvblocks_n_evicted(a) > 0); /* the pool was full of idle blocks at times */
    for (int i = 0; i < N_SEQ; i++) kvblocks_table_free(a, &t[i]);
    ASSERT_EQ(NB, kvblocks_n_free(a));
    ASSERT_EQ(0, kvblocks_n_used(a));
    ASSERT_EQ(kvblocks_n_cached(a), kvblocks_n_idle(a));
    kvblocks_free(a);
}

TEST_MAIN(kvblocks_init_rejects_bad_shape, kvblocks_reserve_grows_and_frees,
          kvblocks_exhausted_changes_nothing, kvblocks_fork_shares_and_copies_on_write,
          kvblocks_fork_at_block_boundary_needs_no_copy, kvblocks_truncate_releases_tail,
          kvblocks_random_churn_returns_everything, kvblocks_hash_chain_covers_every_earlier_token,
          kvblocks_cache_publishes_full_computed_blocks_only, kvblocks_cache_map_shares_and_never_rewrites,
          kvblocks_cache_evicts_least_recently_released_leaves_first,
          kvblocks_cache_duplicate_pins_the_published_block, kvblocks_cache_off_changes_nothing,
          kvblocks_cache_random_churn_stays_consistent)
