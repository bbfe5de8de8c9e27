/* Tests of the KV-block accounting: growth, exhaustion without side
 * effects, prefix sharing with copy-on-write, truncation, and that every
 * block returns to the pool. */
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

TEST_MAIN(kvblocks_init_rejects_bad_shape, kvblocks_reserve_grows_and_frees,
          kvblocks_exhausted_changes_nothing, kvblocks_fork_shares_and_copies_on_write,
          kvblocks_fork_at_block_boundary_needs_no_copy, kvblocks_truncate_releases_tail,
          kvblocks_random_churn_returns_everything)
