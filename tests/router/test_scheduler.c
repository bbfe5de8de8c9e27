/* Tests of the per-pipeline scheduler (router/scheduler.c), pure logic:
 * continuous batching, chunked prefill under the token budget, admission by
 * free blocks, preemption by recomputation, priorities, micro-batches in
 * flight, cancellation returning blocks, sequences that can never fit. */
#include "router/scheduler.h"

#include "common/status.h"
#include "tests/test.h"

static sched *mk(int32_t n_blocks, int32_t bs, int32_t step_tokens, int32_t max_batch,
                 int32_t max_inflight) {
    struct sched_config c = {n_blocks, bs, step_tokens, max_batch, max_inflight, 0, 0};
    char err[256];
    sched *s = NULL;
    if (sched_init(&s, &c, err, sizeof err) != 0) TEST_FAIL("sched_init: %s", err);
    return s;
}

static struct sched_seq *add(sched *s, uint64_t id, int32_t prio, int32_t n) {
    int32_t toks[512];
    for (int32_t i = 0; i < n; i++) toks[i] = (int32_t)(id * 1000 + (uint64_t)i);
    struct sched_seq *q = NULL;
    int rc = sched_add(s, id, prio, id, toks, n, &q);
    if (rc != 0) TEST_FAIL("sched_add(%llu, %d tokens): %d", (unsigned long long)id, n, rc);
    return q;
}

static const struct sched_step_seq *find(const struct sched_step *st, uint64_t id) {
    for (int32_t i = 0; i < st->n_seqs; i++)
        if (st->seqs[i].seq_id == id) return &st->seqs[i];
    return NULL;
}

static int has_freed(const struct sched_step *st, uint64_t id) {
    for (int32_t i = 0; i < st->n_freed; i++)
        if (st->freed[i] == id) return 1;
    return 0;
}

TEST(scheduler_rejects_bad_config) {
    struct sched_config c = {0, 16, 64, 8, 1, 0, 0};
    char err[256] = "";
    sched *s = (sched *)1;
    ASSERT_EQ(STATUS_BAD_INPUT, sched_init(&s, &c, err, sizeof err));
    ASSERT_TRUE(s == NULL);
    ASSERT_TRUE(strstr(err, "n_blocks = 0") != NULL);
    c.n_blocks = 4;
    c.max_inflight = -2;
    ASSERT_EQ(STATUS_BAD_INPUT, sched_init(&s, &c, err, sizeof err));
    ASSERT_TRUE(strstr(err, "max_inflight = -2") != NULL);
}

TEST(scheduler_batches_prefill_then_decodes) {
    sched *s = mk(64, 4, 256, 8, 1);
    add(s, 1, 0, 5);
    add(s, 2, 0, 3);
    add(s, 3, 0, 9);
    struct sched_step st;
    ASSERT_EQ(1, sched_plan(s, &st));
    ASSERT_EQ(3, st.n_seqs);
    ASSERT_EQ(17, st.n_prefill_tokens);
    ASSERT_EQ(0, st.n_decode_tokens);
    const struct sched_step_seq *a = find(&st, 3);
    ASSERT_TRUE(a != NULL);
    ASSERT_EQ(0, a->start_pos);
    ASSERT_EQ(9, a->n_tokens);
    ASSERT_EQ(3, a->n_blocks); /* 9 positions in blocks of 4 */
    ASSERT_EQ(3002, a->tokens[2]);
    ASSERT_TRUE(a->want_logits);
    /* All three are in flight: nothing more to plan (one stage). */
    struct sched_step st2;
    ASSERT_EQ(0, sched_plan(s, &st2));
    uint64_t sid = st.step_id;
    struct sched_seq *qs[3];
    for (int i = 0; i < 3; i++) qs[i] = st.seqs[i].seq;
    ASSERT_OK(sched_step_done(s, sid));
    ASSERT_EQ(STATUS_NOT_FOUND, sched_step_done(s, sid));
    for (int i = 0; i < 3; i++) ASSERT_OK(sched_append(s, qs[i], 77 + i));
    ASSERT_EQ(1, sched_plan(s, &st));
    ASSERT_EQ(3, st.n_seqs);
    ASSERT_EQ(3, st.n_decode_tokens);
    ASSERT_EQ(0, st.n_prefill_tokens);
    a = find(&st, 1);
    ASSERT_EQ(5, a->start_pos);
    ASSERT_EQ(1, a->n_tokens);
    ASSERT_EQ(2, a->n_blocks);
    /* One token per sampled step: a second one before it ran is refused. */
    ASSERT_OK(sched_step_done(s, st.step_id));
    ASSERT_OK(sched_append(s, qs[0], 5));
    ASSERT_EQ(STATUS_BAD_INPUT, sched_append(s, qs[0], 6));
    sched_free(s);
}

TEST(scheduler_chunked_prefill_keeps_decodes_running) {
    sched *s = mk(64, 4, 8, 8, 1);
    struct sched_seq *a = add(s, 1, 0, 2);
    struct sched_step st;
    ASSERT_EQ(1, sched_plan(s, &st));
    ASSERT_OK(sched_step_done(s, st.step_id));
    ASSERT_OK(sched_append(s, a, 50));
    add(s, 2, 0, 20); /* a long prompt arrives while 1 decodes */
    int32_t prefilled = 0, steps = 0;
    while (prefilled < 20) {
        ASSERT_EQ(1, sched_plan(s, &st));
        steps++;
        const struct sched_step_seq *d = find(&st, 1), *p = find(&st, 2);
        ASSERT_TRUE(d != NULL); /* the decode is in every step */
        ASSERT_EQ(1, d->n_tokens);
        ASSERT_TRUE(p != NULL);
        ASSERT_EQ(prefilled, p->start_pos);
        ASSERT_TRUE(p->n_tokens <= 7); /* budget 8 minus the decode */
        prefilled += p->n_tokens;
        ASSERT_EQ(prefilled == 20, p->want_logits);
        ASSERT_EQ(p->n_tokens, st.n_prefill_tokens);
        ASSERT_EQ(1, st.n_decode_tokens);
        struct sched_seq *pq = p->seq;
        ASSERT_OK(sched_step_done(s, st.step_id));
        ASSERT_OK(sched_append(s, a, 51 + steps));
        if (prefilled == 20) ASSERT_OK(sched_append(s, pq, 99));
    }
    ASSERT_EQ(3, steps); /* 7 + 7 + 6 */
    sched_free(s);
}

TEST(scheduler_admits_by_free_blocks) {
    sched *s = mk(4, 4, 256, 8, 1);
    struct sched_seq *a = add(s, 1, 0, 10); /* 11 positions: 3 blocks */
    add(s, 2, 0, 6);                        /* 7 positions: 2 blocks, only 1 left */
    struct sched_step st;
    ASSERT_EQ(1, sched_plan(s, &st));
    ASSERT_EQ(1, st.n_seqs);
    ASSERT_EQ(1ull, st.seqs[0].seq_id);
    struct sched_stats ss;
    sched_get_stats(s, &ss);
    ASSERT_EQ(1, ss.n_running);
    ASSERT_EQ(1, ss.n_waiting);
    ASSERT_OK(sched_step_done(s, st.step_id));
    sched_remove(s, a); /* finished: its blocks come back */
    ASSERT_EQ(4, sched_blocks_free(s));
    ASSERT_EQ(1, sched_plan(s, &st));
    ASSERT_EQ(1, st.n_seqs);
    ASSERT_EQ(2ull, st.seqs[0].seq_id);
    ASSERT_TRUE(has_freed(&st, 1));
    sched_free(s);
}

TEST(scheduler_preempts_newest_by_recomputation) {
    sched *s = mk(4, 4, 256, 8, 1);
    struct sched_seq *a = add(s, 1, 0, 7);
    struct sched_seq *b = add(s, 2, 0, 7);
    struct sched_step st;
    ASSERT_EQ(1, sched_plan(s, &st));
    ASSERT_EQ(2, st.n_seqs);
    ASSERT_EQ(0, sched_blocks_free(s));
    ASSERT_OK(sched_step_done(s, st.step_id));
    ASSERT_OK(sched_append(s, a, 1));
    ASSERT_OK(sched_append(s, b, 2));
    /* Position 7 still fits the second block of each. */
    ASSERT_EQ(1, sched_plan(s, &st));
    ASSERT_EQ(2, st.n_seqs);
    ASSERT_OK(sched_step_done(s, st.step_id));
    ASSERT_OK(sched_append(s, a, 3));
    ASSERT_OK(sched_append(s, b, 4));
    /* Position 8 needs a third block each: the newer (2) gives its blocks. */
    ASSERT_EQ(1, sched_plan(s, &st));
    ASSERT_EQ(1, st.n_seqs);
    ASSERT_EQ(1ull, st.seqs[0].seq_id);
    ASSERT_EQ(8, st.seqs[0].start_pos);
    ASSERT_TRUE(has_freed(&st, 2));
    ASSERT_TRUE(!sched_seq_running(b));
    ASSERT_EQ(9, sched_seq_n_tokens(b)); /* prompt + generated, to recompute */
    struct sched_stats ss;
    sched_get_stats(s, &ss);
    ASSERT_EQ(1ull, ss.preemptions_total);
    ASSERT_OK(sched_step_done(s, st.step_id));
    sched_remove(s, a);
    /* 2 resumes from position 0 with all 9 known tokens. */
    ASSERT_EQ(1, sched_plan(s, &st));
    ASSERT_EQ(2ull, st.seqs[0].seq_id);
    ASSERT_EQ(0, st.seqs[0].start_pos);
    ASSERT_EQ(9, st.seqs[0].n_tokens);
    ASSERT_EQ(4, st.seqs[0].tokens[8]);
    ASSERT_TRUE(st.seqs[0].want_logits);
    sched_free(s);
}

TEST(scheduler_higher_priority_runs_first_and_preempts) {
    sched *s = mk(64, 4, 256, 1, 1);
    add(s, 1, 0, 4);
    add(s, 2, 5, 4);
    struct sched_step st;
    ASSERT_EQ(1, sched_plan(s, &st));
    ASSERT_EQ(1, st.n_seqs);
    ASSERT_EQ(2ull, st.seqs[0].seq_id); /* arrived later, higher priority */
    struct sched_seq *hi = st.seqs[0].seq;
    ASSERT_OK(sched_step_done(s, st.step_id));
    sched_remove(s, hi);
    ASSERT_EQ(1, sched_plan(s, &st));
    struct sched_seq *lo = st.seqs[0].seq;
    ASSERT_EQ(1ull, st.seqs[0].seq_id);
    ASSERT_OK(sched_step_done(s, st.step_id));
    ASSERT_OK(sched_append(s, lo, 9));
    /* A higher-priority arrival takes the only batch slot from a running one. */
    add(s, 3, 10, 4);
    ASSERT_EQ(1, sched_plan(s, &st));
    ASSERT_EQ(1, st.n_seqs);
    ASSERT_EQ(3ull, st.seqs[0].seq_id);
    ASSERT_TRUE(has_freed(&st, 1));
    ASSERT_TRUE(!sched_seq_running(lo));
    /* Equal priority never preempts: 4 waits behind 3. */
    add(s, 4, 10, 4);
    struct sched_step st2;
    ASSERT_EQ(0, sched_plan(s, &st2));
    sched_free(s);
}

TEST(scheduler_microbatches_in_flight) {
    sched *s = mk(64, 4, 256, 8, 2);
    for (uint64_t i = 1; i <= 4; i++) add(s, i, 0, 3);
    struct sched_step a, b, c;
    ASSERT_EQ(1, sched_plan(s, &a));
    uint64_t in_a[2] = {a.seqs[0].seq_id, a.seqs[1].seq_id};
    uint64_t a_id = a.step_id;
    ASSERT_EQ(2, a.n_seqs);
    ASSERT_EQ(1, sched_plan(s, &b));
    ASSERT_EQ(2, b.n_seqs);
    ASSERT_NE(a_id, b.step_id);
    for (int i = 0; i < 2; i++) {
        ASSERT_NE(in_a[0], b.seqs[i].seq_id); /* a sequence is in one step at a time */
        ASSERT_NE(in_a[1], b.seqs[i].seq_id);
    }
    ASSERT_EQ(0, sched_plan(s, &c)); /* two stages: two steps out */
    struct sched_stats ss;
    sched_get_stats(s, &ss);
    ASSERT_EQ(2, ss.n_inflight);
    ASSERT_OK(sched_step_done(s, a_id));
    ASSERT_EQ(0, sched_plan(s, &c)); /* a's sequences wait for their tokens */
    sched_free(s);
}

TEST(scheduler_step_seq_limit) {
    struct sched_config c = {64, 4, 256, 8, 1, 100, 2};
    char err[256];
    sched *s = NULL;
    ASSERT_OK(sched_init(&s, &c, err, sizeof err));
    for (uint64_t i = 1; i <= 5; i++) add(s, i, 0, 2);
    struct sched_step st;
    ASSERT_EQ(1, sched_plan(s, &st));
    ASSERT_EQ(2, st.n_seqs); /* a worker takes at most 2 per step */
    ASSERT_EQ((uint64_t)100, st.step_id);
    sched_free(s);
}

TEST(scheduler_cancel_frees_blocks) {
    sched *s = mk(16, 4, 256, 8, 1);
    struct sched_seq *a = add(s, 7, 0, 10);
    struct sched_step st;
    ASSERT_EQ(1, sched_plan(s, &st));
    ASSERT_EQ(13, sched_blocks_free(s));
    /* Cancelled while its step is in flight: blocks return at once. */
    sched_remove(s, a);
    ASSERT_EQ(16, sched_blocks_free(s));
    ASSERT_OK(sched_step_done(s, st.step_id));
    add(s, 8, 0, 2);
    ASSERT_EQ(1, sched_plan(s, &st));
    ASSERT_TRUE(has_freed(&st, 7));
    ASSERT_EQ(1, st.n_freed);
    /* A waiting sequence that never ran frees nothing in the workers. */
    struct sched_seq *w = add(s, 9, 0, 2);
    sched_set_admit(s, false);
    struct sched_step st2;
    ASSERT_OK(sched_step_done(s, st.step_id));
    ASSERT_EQ(0, sched_plan(s, &st2));
    sched_remove(s, w);
    struct sched_stats ss;
    sched_get_stats(s, &ss);
    ASSERT_EQ(1, ss.blocks_used); /* 8's one block */
    ASSERT_EQ(0, ss.n_waiting);
    sched_free(s);
}

TEST(scheduler_take_waiting_for_handover) {
    sched *s = mk(64, 4, 256, 1, 1);
    add(s, 1, 0, 3);
    add(s, 2, 0, 3);
    add(s, 3, 0, 3);
    struct sched_step st;
    ASSERT_EQ(1, sched_plan(s, &st));
    sched_set_admit(s, false);
    uint64_t ids[8];
    ASSERT_EQ(2, sched_take_waiting(s, ids, 8));
    ASSERT_TRUE((ids[0] == 2 && ids[1] == 3) || (ids[0] == 3 && ids[1] == 2));
    struct sched_stats ss;
    sched_get_stats(s, &ss);
    ASSERT_EQ(1, ss.n_running);
    ASSERT_EQ(0, ss.n_waiting);
    sched_free(s);
}

TEST(scheduler_never_fitting_sequences) {
    sched *s = mk(2, 4, 256, 8, 1);
    struct sched_seq *q = NULL;
    int32_t t[8] = {0};
    /* 8 prompt tokens + 1 to generate need 3 blocks of 4: never. */
    ASSERT_EQ(STATUS_EXHAUSTED, sched_add(s, 1, 0, 1, t, 8, &q));
    ASSERT_EQ(STATUS_BAD_INPUT, sched_add(s, 1, 0, 1, t, 0, &q));
    q = add(s, 2, 0, 7);
    ASSERT_EQ(STATUS_BAD_INPUT, sched_add(s, 2, 0, 1, t, 3, &q)); /* duplicate id */
    struct sched_step st;
    ASSERT_EQ(1, sched_plan(s, &st));
    q = st.seqs[0].seq;
    ASSERT_OK(sched_step_done(s, st.step_id));
    ASSERT_OK(sched_append(s, q, 1));
    ASSERT_EQ(1, sched_plan(s, &st)); /* position 7 */
    ASSERT_OK(sched_step_done(s, st.step_id));
    ASSERT_OK(sched_append(s, q, 1));
    /* Position 8 needs a third block; alone in the pool it is stuck. */
    ASSERT_EQ(0, sched_plan(s, &st));
    ASSERT_EQ(1, st.n_stuck);
    ASSERT_TRUE(st.stuck[0] == q);
    sched_remove(s, q);
    ASSERT_EQ(2, sched_blocks_free(s));
    sched_free(s);
}

TEST(scheduler_partial_chunk_when_blocks_are_short) {
    /* 6 blocks of 4: a running decode holds 2, the prompt of 12 is admitted
     * (4 blocks) and prefilled, all in budget. Then a chunk fitting only the
     * free blocks still runs. */
    sched *s = mk(6, 4, 64, 8, 1);
    struct sched_seq *a = add(s, 1, 5, 5);
    struct sched_step st;
    ASSERT_EQ(1, sched_plan(s, &st));
    ASSERT_OK(sched_step_done(s, st.step_id));
    ASSERT_OK(sched_append(s, a, 3)); /* 6 tokens: 2 blocks */
    add(s, 2, 0, 15);                 /* needs 4 blocks for 16 positions: fits */
    ASSERT_EQ(1, sched_plan(s, &st));
    ASSERT_EQ(2, st.n_seqs);
    ASSERT_EQ(15, find(&st, 2)->n_tokens);
    ASSERT_EQ(0, sched_blocks_free(s));
    sched_free(s);
}


/* The rows of st computing prompt tokens: every token but the generated
 * ones, which are 7 here (no prompt holds a 7).  A prompt's last chunk of one
 * token counts as a decode in n_prefill_tokens, but not here. */
static int32_t prompt_rows(const struct sched_step *st) {
    int32_t rows = 0;
    for (int32_t i = 0; i < st->n_seqs; i++)
        for (int32_t k = 0; k < st->seqs[i].n_tokens; k++) rows += st->seqs[i].tokens[k] != 7;
    return rows;
}

/* Runs s until nothing is in flight or planned, appending token 7 to every
 * sequence that asks for logits until it holds max tokens, then removing it.
 * Returns the prompt rows it planned. */
static int32_t drain(sched *s, int32_t max) {
    struct sched_step st;
    int32_t rows = 0;
    for (int guard = 0; guard < 1000 && sched_plan(s, &st) == 1; guard++) {
        uint64_t id = st.step_id;
        rows += prompt_rows(&st);
        struct sched_seq *done[64];
        int nd = 0;
        for (int32_t i = 0; i < st.n_seqs; i++) {
            if (!st.seqs[i].want_logits) continue;
            struct sched_seq *q = st.seqs[i].seq;
            if (sched_seq_n_tokens(q) >= max) done[nd++] = q;
            else ASSERT_OK(sched_append(s, q, 7));
        }
        ASSERT_OK(sched_step_done(s, id));
        for (int k = 0; k < nd; k++) sched_remove(s, done[k]);
    }
    return rows;
}

TEST(scheduler_prefix_cache_maps_computed_blocks) {
    sched *s = mk(32, 4, 256, 8, 2);
    char err[256];
    ASSERT_OK(sched_enable_prefix_cache(s, err, sizeof err));
    int32_t p1[14], p2[14], t1[4];
    for (int i = 0; i < 14; i++) p1[i] = p2[i] = 50 + i;
    p2[13] = 99; /* same first 13 tokens: 3 full blocks */
    struct sched_seq *q = NULL;
    ASSERT_OK(sched_add(s, 1, 0, 1, p1, 14, &q));
    struct sched_step st;
    ASSERT_EQ(1, sched_plan(s, &st));
    ASSERT_EQ(0, st.seqs[0].start_pos);
    ASSERT_EQ(0, st.seqs[0].n_context);
    memcpy(t1, st.seqs[0].block_table, sizeof t1);
    uint64_t step1 = st.step_id;
    /* A sequence sharing 3 full blocks with the first one while their KV is
     * not computed yet waits: blocks are published when their step is done,
     * and computing them twice is what the cache saves. */
    struct sched_seq *r = NULL;
    ASSERT_OK(sched_add(s, 2, 0, 2, p2, 14, &r));
    ASSERT_EQ(0, sched_plan(s, &st));
    ASSERT_EQ(0, sched_plan(s, &st));
    ASSERT_TRUE(!sched_seq_running(r));
    struct sched_stats ss;
    sched_get_stats(s, &ss);
    ASSERT_EQ(1, (int)ss.prefix_deferred); /* once per wait, not per plan */
    ASSERT_EQ(0, ss.blocks_cached);
    ASSERT_OK(sched_step_done(s, step1));
    ASSERT_EQ(1, sched_plan(s, &st));
    ASSERT_EQ(12, find(&st, 2)->start_pos);
    for (int b = 0; b < 3; b++) ASSERT_EQ(t1[b], find(&st, 2)->block_table[b]);
    ASSERT_OK(sched_step_done(s, st.step_id));
    sched_remove(s, r);
    sched_get_stats(s, &ss);
    ASSERT_EQ(3, ss.blocks_cached);
    ASSERT_EQ(12, (int)ss.prefix_hit_tokens);
    ASSERT_EQ(16, (int)ss.prefix_miss_tokens);
    /* Now a third one maps the 3 blocks and starts at 12, with the 12
     * tokens before as penalty context. */
    ASSERT_OK(sched_add(s, 3, 0, 3, p2, 14, &r));
    ASSERT_EQ(3, sched_prefix_blocks(s, p2, 14));
    ASSERT_EQ(1, sched_plan(s, &st));
    const struct sched_step_seq *o = find(&st, 3);
    ASSERT_TRUE(o != NULL);
    ASSERT_EQ(12, o->start_pos);
    ASSERT_EQ(2, o->n_tokens);
    ASSERT_EQ(12, o->n_context);
    ASSERT_EQ(p2[0], o->context[0]);
    ASSERT_EQ(p2[12], o->tokens[0]);
    ASSERT_EQ(0, st.n_copies);
    for (int b = 0; b < 3; b++) ASSERT_EQ(t1[b], o->block_table[b]);
    ASSERT_NE(t1[3], o->block_table[3]);
    sched_get_stats(s, &ss);
    ASSERT_EQ(24, (int)ss.prefix_hit_tokens);
    ASSERT_EQ(6, (int)ss.prefix_hit_blocks);
    ASSERT_EQ(18, (int)ss.prefix_miss_tokens);
    ASSERT_OK(sched_step_done(s, st.step_id));
    /* An identical prompt of whole blocks still computes its last block, so
     * its logits exist. */
    struct sched_seq *u = NULL;
    ASSERT_OK(sched_add(s, 4, 0, 4, p1, 12, &u));
    ASSERT_EQ(1, sched_plan(s, &st));
    ASSERT_EQ(8, find(&st, 4)->start_pos);
    ASSERT_TRUE(find(&st, 4)->want_logits);
    ASSERT_OK(sched_step_done(s, st.step_id));
    ASSERT_OK(sched_append(s, q, 7));
    ASSERT_OK(sched_append(s, r, 7));
    ASSERT_OK(sched_append(s, u, 7));
    drain(s, 20);
    sched_get_stats(s, &ss);
    ASSERT_EQ(0, ss.n_running + ss.n_waiting);
    ASSERT_EQ(0, ss.blocks_used);
    ASSERT_EQ(ss.blocks_cached, ss.blocks_idle);
    ASSERT_TRUE(ss.blocks_cached >= 4);
    sched_free(s);
}

TEST(scheduler_prefix_cache_survives_preemption) {
    /* 6 blocks of 4: a low-priority sequence of 13 tokens is preempted by a
     * high-priority one; its published blocks stay idle and are found again
     * when it comes back, unless the pool needed them. */
    sched *s = mk(6, 4, 256, 1, 1);
    char err[256];
    ASSERT_OK(sched_enable_prefix_cache(s, err, sizeof err));
    struct sched_seq *lo = add(s, 1, 0, 13);
    struct sched_step st;
    ASSERT_EQ(1, sched_plan(s, &st));
    ASSERT_OK(sched_step_done(s, st.step_id));
    ASSERT_OK(sched_append(s, lo, 7));
    struct sched_seq *hi = add(s, 2, 5, 3);
    ASSERT_EQ(1, sched_plan(s, &st)); /* batch of 1: lo gives way */
    ASSERT_TRUE(find(&st, 2) != NULL);
    ASSERT_TRUE(has_freed(&st, 1));
    ASSERT_OK(sched_step_done(s, st.step_id));
    struct sched_stats ss;
    sched_get_stats(s, &ss);
    ASSERT_EQ(3, ss.blocks_idle);
    sched_remove(s, hi);
    ASSERT_EQ(1, sched_plan(s, &st));
    const struct sched_step_seq *o = find(&st, 1);
    ASSERT_EQ(12, o->start_pos);
    ASSERT_EQ(2, o->n_tokens); /* token 12 of the prompt and the sampled one */
    ASSERT_EQ(12, o->n_context);
    ASSERT_OK(sched_step_done(s, st.step_id));
    sched_remove(s, lo);
    sched_get_stats(s, &ss);
    ASSERT_EQ(0, ss.blocks_used);
    sched_free(s);
}

TEST(scheduler_prefix_cache_off_by_default) {
    sched *s = mk(32, 4, 256, 8, 1);
    int32_t p[9] = {1, 2, 3, 4, 5, 6, 7, 8, 9};
    struct sched_seq *q = NULL;
    ASSERT_OK(sched_add(s, 1, 0, 1, p, 9, &q));
    struct sched_step st;
    ASSERT_EQ(1, sched_plan(s, &st));
    ASSERT_OK(sched_step_done(s, st.step_id));
    sched_remove(s, q);
    ASSERT_EQ(0, sched_prefix_blocks(s, p, 9));
    ASSERT_OK(sched_add(s, 2, 0, 2, p, 9, &q));
    ASSERT_EQ(1, sched_plan(s, &st));
    ASSERT_EQ(0, st.seqs[0].start_pos);
    char err[256] = "";
    ASSERT_EQ(STATUS_BAD_INPUT, sched_enable_prefix_cache(s, err, sizeof err));
    ASSERT_TRUE(strstr(err, "before sequences") != NULL);
    sched_free(s);
}

/* A sequence whose first n_shared of n tokens are a prompt every such
 * sequence shares (100 + i), the rest its own. */
static struct sched_seq *add_shared(sched *s, uint64_t id, int32_t prio, uint64_t order,
                                    int32_t n_shared, int32_t n) {
    int32_t toks[512];
    for (int32_t i = 0; i < n; i++) toks[i] = i < n_shared ? 100 + i : (int32_t)(id * 1000 + (uint64_t)i);
    struct sched_seq *q = NULL;
    int rc = sched_add(s, id, prio, order, toks, n, &q);
    if (rc != 0) TEST_FAIL("sched_add(%llu, %d tokens): %d", (unsigned long long)id, n, rc);
    return q;
}

static sched *mk_cached(int32_t n_blocks, int32_t bs, int32_t step_tokens, int32_t max_batch,
                        int32_t max_inflight) {
    sched *s = mk(n_blocks, bs, step_tokens, max_batch, max_inflight);
    char err[256];
    if (sched_enable_prefix_cache(s, err, sizeof err) != 0) TEST_FAIL("prefix cache: %s", err);
    return s;
}

/* Nothing running or waiting, and every block back in the pool (cached
 * ones idle). */
static void assert_all_returned(sched *s) {
    struct sched_stats ss;
    sched_get_stats(s, &ss);
    ASSERT_EQ(0, ss.n_running + ss.n_waiting);
    ASSERT_EQ(0, ss.blocks_used);
    ASSERT_EQ(ss.blocks_total, sched_blocks_free(s));
    ASSERT_EQ(ss.blocks_cached, ss.blocks_idle);
}

TEST(scheduler_prefix_in_flight_computed_once) {
    /* Four sequences arrive together, 20 shared tokens (5 blocks of 4) and
     * 3 of their own each, under a budget of 8 tokens a step and two
     * stages.  The first computes the shared blocks; the others wait for
     * them to be published, map them and compute their own 3: 23 + 3 * 3
     * prefill rows instead of 4 * 23. */
    sched *s = mk_cached(64, 4, 8, 8, 2);
    struct sched_seq *l = add_shared(s, 1, 0, 1, 20, 23);
    struct sched_seq *f[3];
    for (int i = 0; i < 3; i++) f[i] = add_shared(s, 2 + (uint64_t)i, 0, 2 + (uint64_t)i, 20, 23);
    struct sched_step st, st2;
    int32_t rows = 0, lead[5];
    for (int32_t pos = 0; pos < 23;) {
        ASSERT_EQ(1, sched_plan(s, &st));
        ASSERT_EQ(1, st.n_seqs);
        ASSERT_EQ(1ull, st.seqs[0].seq_id);
        ASSERT_EQ(pos, st.seqs[0].start_pos);
        pos += st.seqs[0].n_tokens;
        rows += prompt_rows(&st);
        if (pos >= 20) memcpy(lead, st.seqs[0].block_table, sizeof lead);
        /* The second stage is free, but the followers wait. */
        ASSERT_EQ(0, sched_plan(s, &st2));
        for (int i = 0; i < 3; i++) ASSERT_TRUE(!sched_seq_running(f[i]));
        ASSERT_OK(sched_step_done(s, st.step_id));
    }
    ASSERT_OK(sched_append(s, l, 7));
    struct sched_stats ss;
    sched_get_stats(s, &ss);
    ASSERT_EQ(3, (int)ss.prefix_deferred);
    ASSERT_EQ(5, ss.blocks_cached);
    /* Now each follower maps the 5 blocks and starts at 20. */
    int seen = 0, n_ids = 0;
    uint64_t ids[2];
    while (n_ids < 2 && sched_plan(s, &st) == 1) {
        ids[n_ids++] = st.step_id;
        rows += prompt_rows(&st);
        for (int32_t k = 0; k < st.n_seqs; k++) {
            const struct sched_step_seq *o = &st.seqs[k];
            if (o->seq_id == 1) continue;
            seen++;
            ASSERT_EQ(20, o->start_pos);
            ASSERT_EQ(3, o->n_tokens);
            ASSERT_EQ(20, o->n_context);
            for (int b = 0; b < 5; b++) ASSERT_EQ(lead[b], o->block_table[b]);
        }
    }
    ASSERT_EQ(3, seen);
    for (int k = 0; k < n_ids; k++) ASSERT_OK(sched_step_done(s, ids[k]));
    ASSERT_OK(sched_append(s, l, 7)); /* its decode went first */
    for (int i = 0; i < 3; i++) ASSERT_OK(sched_append(s, f[i], 7));
    sched_get_stats(s, &ss);
    ASSERT_EQ(60, (int)ss.prefix_hit_tokens);
    ASSERT_EQ(15, (int)ss.prefix_hit_blocks);
    ASSERT_EQ(23 + 3 * 3, (int)ss.prefix_miss_tokens);
    rows += drain(s, 26);
    ASSERT_EQ(23 + 3 * 3, rows);
    assert_all_returned(s);
    sched_free(s);
}

TEST(scheduler_prefix_in_flight_leader_cancelled) {
    /* The leader is cancelled while its first chunk is in flight: nothing
     * of it is published, and the first follower in line computes the
     * prefix itself, leading the other. */
    sched *s = mk_cached(64, 4, 8, 8, 2);
    struct sched_seq *l = add_shared(s, 1, 0, 1, 20, 23);
    add_shared(s, 2, 0, 2, 20, 23);
    struct sched_seq *f2 = add_shared(s, 3, 0, 3, 20, 23);
    struct sched_step st;
    ASSERT_EQ(1, sched_plan(s, &st));
    ASSERT_EQ(1, st.n_seqs);
    uint64_t step1 = st.step_id;
    int32_t rows = prompt_rows(&st);
    ASSERT_EQ(0, sched_plan(s, &st));
    sched_remove(s, l);
    ASSERT_OK(sched_step_done(s, step1));
    ASSERT_EQ(1, sched_plan(s, &st));
    ASSERT_EQ(1, st.n_seqs);
    ASSERT_EQ(2ull, st.seqs[0].seq_id);
    ASSERT_EQ(0, st.seqs[0].start_pos);
    ASSERT_TRUE(has_freed(&st, 1));
    ASSERT_TRUE(!sched_seq_running(f2));
    rows += prompt_rows(&st);
    ASSERT_OK(sched_step_done(s, st.step_id));
    rows += drain(s, 26);
    /* The lost chunk, then the prefix once more and f2's own tokens. */
    ASSERT_EQ(8 + 23 + 3, rows);
    assert_all_returned(s);
    sched_free(s);
}

TEST(scheduler_prefix_in_flight_leader_preempted) {
    /* The leader (an older sequence resumed late: order 30) is preempted
     * for the blocks of a high-priority arrival after publishing 2 of the
     * 5 shared blocks.  The followers are not held back for it: the first
     * in line maps the 2 blocks, computes the rest and leads the others,
     * the preempted one included. */
    sched *s = mk_cached(16, 4, 8, 8, 2);
    struct sched_seq *l = add_shared(s, 1, 0, 30, 20, 23);
    struct sched_step st;
    ASSERT_EQ(1, sched_plan(s, &st));
    int32_t rows = prompt_rows(&st);
    uint64_t step1 = st.step_id;
    add_shared(s, 2, 0, 11, 20, 23);
    struct sched_seq *f2 = add_shared(s, 3, 0, 12, 20, 23);
    ASSERT_EQ(0, sched_plan(s, &st));
    ASSERT_OK(sched_step_done(s, step1));
    /* 11 blocks: only with the leader's 2 held and 4 still to come freed. */
    struct sched_seq *h = add_shared(s, 4, 5, 40, 0, 43);
    ASSERT_EQ(1, sched_plan(s, &st));
    ASSERT_TRUE(find(&st, 4) != NULL);
    ASSERT_TRUE(!sched_seq_running(l));
    struct sched_stats ss;
    sched_get_stats(s, &ss);
    ASSERT_EQ(1, (int)ss.preemptions_total);
    ASSERT_EQ(2, ss.blocks_cached);
    rows += prompt_rows(&st);
    ASSERT_OK(sched_step_done(s, st.step_id));
    sched_remove(s, h);
    ASSERT_EQ(1, sched_plan(s, &st));
    ASSERT_EQ(1, st.n_seqs);
    ASSERT_EQ(2ull, st.seqs[0].seq_id);
    ASSERT_EQ(8, st.seqs[0].start_pos);
    ASSERT_TRUE(!sched_seq_running(f2) && !sched_seq_running(l));
    rows += prompt_rows(&st);
    ASSERT_OK(sched_step_done(s, st.step_id));
    rows += drain(s, 26);
    /* 1's and 4's first chunks, 2 from 8 to 23, 3 and 1 their last 3. */
    ASSERT_EQ(8 + 8 + 15 + 3 + 3, rows);
    sched_get_stats(s, &ss);
    ASSERT_EQ(3, (int)ss.prefix_deferred);
    assert_all_returned(s);
    sched_free(s);
}

TEST(scheduler_prefix_in_flight_others_not_held) {
    /* A follower takes no slot: the unrelated sequence behind it is
     * admitted with the leader.  A more important sequence never waits
     * for a less important leader: it maps what is published and computes
     * the rest itself, and then leads. */
    sched *s = mk_cached(64, 4, 8, 8, 1);
    add_shared(s, 1, 1, 1, 20, 23);
    struct sched_seq *f = add_shared(s, 2, 1, 2, 20, 23);
    struct sched_seq *u = add_shared(s, 3, 0, 3, 0, 10);
    struct sched_step st;
    ASSERT_EQ(1, sched_plan(s, &st));
    ASSERT_EQ(8, find(&st, 1)->n_tokens); /* the whole budget */
    ASSERT_TRUE(sched_seq_running(u));
    ASSERT_TRUE(!sched_seq_running(f));
    int32_t rows = prompt_rows(&st);
    ASSERT_OK(sched_step_done(s, st.step_id));
    add_shared(s, 4, 2, 4, 20, 23);
    ASSERT_EQ(1, sched_plan(s, &st));
    ASSERT_EQ(8, find(&st, 4)->start_pos);
    ASSERT_EQ(8, find(&st, 4)->n_tokens);
    ASSERT_TRUE(find(&st, 1) == NULL); /* 4 took the budget */
    ASSERT_TRUE(!sched_seq_running(f));
    rows += prompt_rows(&st);
    ASSERT_OK(sched_step_done(s, st.step_id));
    struct sched_stats ss;
    sched_get_stats(s, &ss);
    ASSERT_EQ(1, (int)ss.prefix_deferred);
    /* 4 published blocks 2 and 3 before 1 computed them: 2 now waits for
     * 4, then maps the 5 blocks and prefills its own 3. */
    rows += drain(s, 26);
    ASSERT_EQ(23 + 10 + 15 + 3, rows);
    sched_get_stats(s, &ss);
    ASSERT_EQ(1, (int)ss.prefix_deferred);
    ASSERT_EQ(8 + 20, (int)ss.prefix_hit_tokens);
    assert_all_returned(s);
    sched_free(s);
}

TEST(scheduler_prefix_in_flight_needs_a_full_block) {
    /* Sharing less than a full block, or only the block holding its last
     * token (computed in any case for its logits), saves nothing: admitted
     * at once.  Sharing one full block before its last token: waits. */
    sched *s = mk_cached(64, 4, 64, 8, 1);
    struct sched_seq *q[4];
    q[0] = add_shared(s, 1, 0, 1, 20, 23);
    q[1] = add_shared(s, 2, 0, 2, 3, 10);
    q[2] = add_shared(s, 3, 0, 3, 4, 4);
    q[3] = add_shared(s, 4, 0, 4, 5, 5);
    struct sched_step st;
    ASSERT_EQ(1, sched_plan(s, &st));
    ASSERT_EQ(3, st.n_seqs);
    ASSERT_TRUE(find(&st, 4) == NULL);
    ASSERT_TRUE(!sched_seq_running(q[3]));
    ASSERT_OK(sched_step_done(s, st.step_id));
    for (int i = 0; i < 3; i++) sched_remove(s, q[i]);
    ASSERT_EQ(1, sched_plan(s, &st));
    ASSERT_EQ(4, find(&st, 4)->start_pos);
    ASSERT_EQ(1, find(&st, 4)->n_tokens);
    ASSERT_OK(sched_step_done(s, st.step_id));
    sched_remove(s, q[3]);
    assert_all_returned(s);
    sched_free(s);
}

/* One step of a decoding sequence a (planned, done, a token appended), so
 * that it is decoding when the next step is planned. */
static struct sched_seq *start_decoding(sched *s, uint64_t id) {
    struct sched_seq *a = add(s, id, 0, 2);
    struct sched_step st;
    ASSERT_EQ(1, sched_plan(s, &st));
    ASSERT_OK(sched_step_done(s, st.step_id));
    ASSERT_OK(sched_append(s, a, 50));
    return a;
}

TEST(scheduler_prefill_cap_applies_while_decoding) {
    sched *s = mk(256, 4, 256, 8, 1);
    ASSERT_EQ(16, sched_prefill_floor(s)); /* 256 / 16 */
    struct sched_seq *a = start_decoding(s, 1);
    add(s, 2, 0, 100);
    sched_set_prefill_cap(s, 40);
    struct sched_step st;
    ASSERT_EQ(1, sched_plan(s, &st));
    ASSERT_EQ(1, st.n_decode_tokens);
    ASSERT_EQ(40, st.n_prefill_tokens); /* above the floor and a quarter of 100 */
    ASSERT_EQ(40, find(&st, 2)->n_tokens);
    struct sched_stats ss;
    sched_get_stats(s, &ss);
    ASSERT_EQ(1, (int)ss.steps_capped);
    ASSERT_EQ(100 - 40, (int)ss.prefill_capped_tokens); /* the prompt fitted the 255 left */
    ASSERT_OK(sched_step_done(s, st.step_id));
    ASSERT_OK(sched_append(s, a, 51));
    /* No cap: the rest of the prompt in one chunk. */
    sched_set_prefill_cap(s, -1);
    ASSERT_EQ(1, sched_plan(s, &st));
    ASSERT_EQ(60, find(&st, 2)->n_tokens);
    sched_get_stats(s, &ss);
    ASSERT_EQ(1, (int)ss.steps_capped);
    sched_free(s);
}

TEST(scheduler_prefill_cap_spreads_a_burst) {
    /* Below a quarter of what the prompts have left, the cap gives way:
     * prefill keeps up with the prompts instead of piling them up. */
    sched *s = mk(256, 4, 256, 8, 1);
    struct sched_seq *a = start_decoding(s, 1);
    add(s, 2, 0, 400);
    sched_set_prefill_cap(s, 0);
    struct sched_step st;
    ASSERT_EQ(1, sched_plan(s, &st));
    ASSERT_EQ(100, find(&st, 2)->n_tokens);
    struct sched_seq *q = find(&st, 2)->seq;
    ASSERT_OK(sched_step_done(s, st.step_id));
    ASSERT_OK(sched_append(s, a, 51));
    ASSERT_EQ(1, sched_plan(s, &st));
    ASSERT_EQ(75, find(&st, 2)->n_tokens); /* a quarter of the 300 left */
    ASSERT_TRUE(find(&st, 2)->seq == q);
    sched_free(s);
}

TEST(scheduler_prefill_cap_idle_without_decodes) {
    sched *s = mk(256, 4, 256, 8, 1);
    sched_set_prefill_cap(s, 40);
    add(s, 1, 0, 200);
    add(s, 2, 0, 30);
    struct sched_step st;
    ASSERT_EQ(1, sched_plan(s, &st));
    /* Nobody is waiting for a token: the whole budget goes to prefill. */
    ASSERT_EQ(230, st.n_prefill_tokens);
    struct sched_stats ss;
    sched_get_stats(s, &ss);
    ASSERT_EQ(0, (int)ss.steps_capped);
    sched_free(s);
}

TEST(scheduler_prefill_cap_keeps_order) {
    sched *s = mk(256, 4, 256, 8, 1);
    struct sched_seq *a = start_decoding(s, 1);
    add(s, 2, 0, 50); /* arrives first */
    add(s, 3, 0, 50);
    sched_set_prefill_cap(s, 40);
    struct sched_step st;
    /* 40 to the first; then its last 10 and 30 to the second. */
    ASSERT_EQ(1, sched_plan(s, &st));
    ASSERT_EQ(40, find(&st, 2)->n_tokens);
    ASSERT_TRUE(find(&st, 3) == NULL);
    ASSERT_OK(sched_step_done(s, st.step_id));
    ASSERT_OK(sched_append(s, a, 51));
    ASSERT_EQ(1, sched_plan(s, &st));
    ASSERT_EQ(10, find(&st, 2)->n_tokens);
    ASSERT_TRUE(find(&st, 2)->want_logits);
    ASSERT_EQ(30, find(&st, 3)->n_tokens);
    ASSERT_EQ(0, find(&st, 3)->start_pos);
    ASSERT_EQ(40, st.n_prefill_tokens);
    sched_free(s);
}

TEST(scheduler_prefill_cap_never_starves) {
    /* A cap of 0 (decodes alone over the target) still moves the first
     * prompt in line every step, by the floor or a quarter of what is
     * left, whichever is more, and the others after it. */
    sched *s = mk(512, 4, 256, 8, 1);
    struct sched_seq *a = start_decoding(s, 1);
    add(s, 2, 0, 100);
    add(s, 3, 0, 20);
    sched_set_prefill_cap(s, 0);
    int32_t done2 = 0, done3 = 0, steps = 0;
    struct sched_step st;
    while (done3 < 20) {
        ASSERT_EQ(1, sched_plan(s, &st));
        steps++;
        ASSERT_TRUE(find(&st, 1) != NULL);
        int32_t rest = 120 - done2 - done3, want = (rest + 3) / 4 > 16 ? (rest + 3) / 4 : 16;
        ASSERT_EQ(rest < want ? rest : want, st.n_prefill_tokens);
        /* Once through its prompt, 2 decodes: only its chunks count. */
        const struct sched_step_seq *p2 = done2 < 100 ? find(&st, 2) : NULL, *p3 = find(&st, 3);
        if (done2 < 100) ASSERT_TRUE(p2 != NULL);
        if (p3) ASSERT_TRUE(done2 + (p2 ? p2->n_tokens : 0) == 100); /* only once 2 is through */
        struct sched_seq *q2 = p2 ? p2->seq : NULL, *q3 = p3 ? p3->seq : NULL;
        done2 += p2 ? p2->n_tokens : 0;
        done3 += p3 ? p3->n_tokens : 0;
        ASSERT_OK(sched_step_done(s, st.step_id));
        ASSERT_OK(sched_append(s, a, 60 + steps));
        if (q2 && done2 == 100) ASSERT_OK(sched_append(s, q2, 7));
        if (q3 && done3 == 20) ASSERT_OK(sched_append(s, q3, 8));
        ASSERT_TRUE(steps <= 8); /* 120 tokens at 16 a step at least */
    }
    ASSERT_EQ(7, steps); /* 30, 23, 17, 16, 16, 16, 2 */
    sched_free(s);
}

/* The prefill hold: while a sequence decodes, prompts are admitted only
 * once they bring the hold's tokens together; then they go in one step. */
TEST(scheduler_prefill_hold_gathers_prompts) {
    sched *s = mk(256, 4, 256, 8, 1);
    struct sched_seq *a = start_decoding(s, 1);
    sched_set_prefill_hold(s, 32);
    add(s, 2, 0, 10);
    struct sched_step st;
    ASSERT_EQ(1, sched_plan(s, &st));
    ASSERT_EQ(1, st.n_seqs); /* the decode alone: 10 of 32 tokens wait */
    ASSERT_EQ(0, st.n_prefill_tokens);
    ASSERT_OK(sched_step_done(s, st.step_id));
    ASSERT_OK(sched_append(s, a, 51));
    struct sched_stats ss;
    sched_get_stats(s, &ss);
    ASSERT_EQ(1, (int)ss.admissions_held);
    ASSERT_EQ(1, ss.n_waiting);
    add(s, 3, 0, 30);
    ASSERT_EQ(1, sched_plan(s, &st));
    ASSERT_EQ(3, st.n_seqs); /* 40 tokens: both prompts beside the decode */
    ASSERT_EQ(40, st.n_prefill_tokens);
    ASSERT_EQ(1, st.n_decode_tokens);
    sched_get_stats(s, &ss);
    ASSERT_EQ(1, (int)ss.admissions_held);
    sched_free(s);
}

/* Without decodes nothing is held, and a hold beyond what a step takes
 * beside the decodes is cut to it; lifting the hold (0) admits at once. */
TEST(scheduler_prefill_hold_limits) {
    sched *s = mk(256, 4, 16, 8, 1);
    sched_set_prefill_hold(s, 100);
    add(s, 1, 0, 2);
    struct sched_step st;
    ASSERT_EQ(1, sched_plan(s, &st));
    ASSERT_EQ(2, st.n_prefill_tokens); /* nobody decodes: admitted */
    struct sched_seq *a = st.seqs[0].seq;
    ASSERT_OK(sched_step_done(s, st.step_id));
    ASSERT_OK(sched_append(s, a, 50));
    add(s, 2, 0, 14);
    ASSERT_EQ(1, sched_plan(s, &st));
    ASSERT_EQ(1, st.n_seqs); /* 14 < 16 - 1 decode */
    ASSERT_OK(sched_step_done(s, st.step_id));
    ASSERT_OK(sched_append(s, a, 51));
    add(s, 3, 0, 1);
    ASSERT_EQ(1, sched_plan(s, &st)); /* 15: as much as the step takes beside the decode */
    ASSERT_EQ(14, find(&st, 2)->n_tokens);
    ASSERT_EQ(1, find(&st, 3)->n_tokens);
    ASSERT_OK(sched_step_done(s, st.step_id));
    ASSERT_OK(sched_append(s, a, 52));
    ASSERT_OK(sched_append(s, find(&st, 2)->seq, 60));
    ASSERT_OK(sched_append(s, find(&st, 3)->seq, 61));
    add(s, 4, 0, 3);
    ASSERT_EQ(1, sched_plan(s, &st));
    ASSERT_TRUE(find(&st, 4) == NULL);
    ASSERT_OK(sched_step_done(s, st.step_id));
    for (int32_t i = 0; i < st.n_seqs; i++) ASSERT_OK(sched_append(s, st.seqs[i].seq, 70));
    sched_set_prefill_hold(s, 0);
    ASSERT_EQ(1, sched_plan(s, &st));
    ASSERT_EQ(3, find(&st, 4)->n_tokens);
    sched_free(s);
}

/* The first in line: priority, then arrival; running ones never. */
TEST(scheduler_first_waiting) {
    sched *s = mk(256, 4, 256, 8, 1);
    ASSERT_TRUE(sched_first_waiting(s) == NULL);
    struct sched_seq *a = start_decoding(s, 1);
    ASSERT_TRUE(sched_first_waiting(s) == NULL);
    struct sched_seq *b = add(s, 2, 0, 5);
    ASSERT_TRUE(sched_first_waiting(s) == b);
    add(s, 3, 0, 5);
    ASSERT_TRUE(sched_first_waiting(s) == b);
    struct sched_seq *d = add(s, 4, 1, 5);
    ASSERT_TRUE(sched_first_waiting(s) == d);
    (void)a;
    sched_free(s);
}

/* Speculation: a decode step carries the drafts prompt lookup finds; the
 * verdict cuts the table back to the accepted positions, and the tokens
 * the step produced are appended as usual. */
static struct sched_seq *spec_seq(sched *s, uint64_t id) {
    /* 1 2 3 4 1 2, then 3 sampled: the suffix 1 2 3 occurred at 0 and was
     * followed by 4 1 2 3. */
    static const int32_t toks[] = {1, 2, 3, 4, 1, 2};
    struct sched_seq *q = NULL;
    ASSERT_OK(sched_add(s, id, 0, id, toks, 6, &q));
    sched_seq_set_spec(q, 4, false, 0);
    struct sched_step st;
    ASSERT_EQ(1, sched_plan(s, &st));
    ASSERT_EQ(0, st.seqs[0].n_draft); /* a prefill carries none */
    ASSERT_OK(sched_step_done(s, st.step_id));
    ASSERT_OK(sched_append(s, q, 3));
    return q;
}

TEST(scheduler_spec_verdict_truncates) {
    sched *s = mk(16, 4, 64, 4, 1);
    struct sched_seq *q = spec_seq(s, 1);
    struct sched_step st;
    ASSERT_EQ(1, sched_plan(s, &st));
    ASSERT_EQ(1, st.n_seqs);
    const struct sched_step_seq *o = &st.seqs[0];
    ASSERT_EQ(6, o->start_pos);
    ASSERT_EQ(4, o->n_draft);
    ASSERT_EQ(5, o->n_tokens);
    int32_t want[5] = {3, 4, 1, 2, 3};
    for (int i = 0; i < 5; i++) ASSERT_EQ(want[i], o->tokens[i]);
    ASSERT_TRUE(o->want_logits);
    ASSERT_EQ(3, o->n_blocks); /* positions 0..10 */
    ASSERT_EQ(5, st.n_decode_tokens);
    ASSERT_EQ(4, sched_seq_n_draft(q));
    ASSERT_EQ(STATUS_BAD_INPUT, sched_append(s, q, 4)); /* no verdict yet */
    ASSERT_EQ(STATUS_BAD_INPUT, sched_spec_accept(s, q, 5));
    ASSERT_OK(sched_spec_accept(s, q, 2)); /* 4 and 1 accepted; 9 follows */
    ASSERT_EQ(0, sched_seq_n_draft(q));
    ASSERT_EQ(STATUS_BAD_INPUT, sched_append(s, q, 5)); /* not the draft at its place */
    ASSERT_OK(sched_append(s, q, 4));
    ASSERT_OK(sched_append(s, q, 1));
    ASSERT_OK(sched_append(s, q, 9));
    ASSERT_OK(sched_step_done(s, st.step_id));
    ASSERT_EQ(10, sched_seq_n_tokens(q));
    struct sched_stats ss;
    sched_get_stats(s, &ss);
    ASSERT_EQ(3, ss.blocks_used); /* 9 positions computed */
    ASSERT_EQ(1, (int)ss.spec_steps);
    ASSERT_EQ(4, (int)ss.spec_proposed);
    ASSERT_EQ(2, (int)ss.spec_accepted);
    /* The next step starts after the accepted positions, with 9 as input:
     * 1 2 3 4 1 2 3 4 1 9 has no earlier 9, 1 9 or 4 1 9: no drafts. */
    ASSERT_EQ(1, sched_plan(s, &st));
    ASSERT_EQ(9, st.seqs[0].start_pos);
    ASSERT_EQ(1, st.seqs[0].n_tokens);
    ASSERT_EQ(0, st.seqs[0].n_draft);
    sched_free(s);
}

TEST(scheduler_spec_rejected_all_and_no_verdict) {
    sched *s = mk(16, 4, 64, 4, 1);
    struct sched_seq *q = spec_seq(s, 1);
    struct sched_step st;
    ASSERT_EQ(1, sched_plan(s, &st));
    ASSERT_EQ(4, st.seqs[0].n_draft);
    ASSERT_OK(sched_spec_accept(s, q, 0));
    ASSERT_OK(sched_append(s, q, 8));
    ASSERT_OK(sched_step_done(s, st.step_id));
    struct sched_stats ss;
    sched_get_stats(s, &ss);
    ASSERT_EQ(2, ss.blocks_used); /* 7 positions: the drafts' block went back */
    /* A step done without a verdict counts none accepted. */
    ASSERT_EQ(1, sched_plan(s, &st));
    ASSERT_EQ(7, st.seqs[0].start_pos);
    ASSERT_EQ(0, st.seqs[0].n_draft); /* ...2 3 8: no match */
    ASSERT_OK(sched_step_done(s, st.step_id));
    ASSERT_OK(sched_append(s, q, 1));
    /* ...3 8 1: the 1 at 4 was followed by 2 3 8 1, of which a match of one
     * token drafts two */
    ASSERT_EQ(1, sched_plan(s, &st));
    ASSERT_EQ(2, st.seqs[0].n_draft);
    ASSERT_OK(sched_step_done(s, st.step_id));
    ASSERT_EQ(0, sched_seq_n_draft(q));
    sched_get_stats(s, &ss);
    ASSERT_EQ(3, ss.blocks_used); /* 9 positions */
    ASSERT_OK(sched_append(s, q, 2));
    sched_free(s);
}

TEST(scheduler_spec_within_free_blocks_and_auto) {
    /* 3 blocks of 4: the sequence holds 2 (7 positions after its decode);
     * drafts may take only what is free and never preempt. */
    sched *s = mk(3, 4, 64, 4, 1);
    struct sched_seq *q = spec_seq(s, 1);
    sched_set_spec_auto(s, false);
    sched_seq_set_spec(q, 4, true, 0);
    struct sched_step st;
    ASSERT_EQ(1, sched_plan(s, &st));
    ASSERT_EQ(0, st.seqs[0].n_draft); /* auto paused */
    ASSERT_OK(sched_step_done(s, st.step_id));
    ASSERT_OK(sched_append(s, q, 4)); /* 1 2 3 4 1 2 3 4: 8 tokens, 7 computed */
    sched_set_spec_auto(s, true);
    ASSERT_EQ(1, sched_plan(s, &st));
    /* positions 7..11 fit the 3 blocks: 4 drafts (1 2 3 4 after 3 4) */
    ASSERT_EQ(4, st.seqs[0].n_draft);
    ASSERT_OK(sched_spec_accept(s, q, 4));
    int32_t acc[5] = {1, 2, 3, 4, 1};
    for (int i = 0; i < 5; i++) ASSERT_OK(sched_append(s, q, acc[i]));
    ASSERT_OK(sched_step_done(s, st.step_id));
    ASSERT_EQ(13, sched_seq_n_tokens(q));
    /* 12 positions computed fill the pool: the next decode needs a block
     * nobody has, so it has no room for drafts either. */
    struct sched_stats ss;
    sched_get_stats(s, &ss);
    ASSERT_EQ(3, ss.blocks_used);
    sched_free(s);
}

TEST(scheduler_spec_stops_at_the_limit) {
    sched *s = mk(16, 4, 64, 4, 1);
    struct sched_seq *q = spec_seq(s, 1); /* 1 2 3 4 1 2 3: drafts 4 1 2 3 */
    sched_seq_set_spec(q, 4, false, 10); /* it ends at 10 tokens: drafts up to index 8 */
    struct sched_step st;
    ASSERT_EQ(1, sched_plan(s, &st));
    ASSERT_EQ(2, st.seqs[0].n_draft);
    ASSERT_OK(sched_spec_accept(s, q, 2));
    ASSERT_OK(sched_step_done(s, st.step_id));
    sched_seq_set_spec(q, 4, false, 8);
    ASSERT_OK(sched_append(s, q, 4));
    ASSERT_OK(sched_append(s, q, 1));
    ASSERT_OK(sched_append(s, q, 2)); /* 10 tokens; past limit 8 no drafts */
    ASSERT_EQ(1, sched_plan(s, &st));
    ASSERT_EQ(0, st.seqs[0].n_draft);
    ASSERT_EQ(1, st.seqs[0].n_tokens);
    sched_free(s);
}

/* Forked choices (sched_seq_set_fork).  Four choices of one 22-token
 * prompt (group 9, sharing its first 21 positions), blocks of 4, steps of
 * 8 tokens over two stages.  check_fork_round runs the leader's prefill
 * alone (the others wait, taking nothing), then the three others start on
 * a fork at position 21: one token each, the leader's first 6 blocks in
 * their tables, a copy of the shared partial block.  Returns the prompt
 * rows planned. */
static int32_t check_fork_round(sched *s, struct sched_seq *l, struct sched_seq *const *f, int32_t *lead) {
    struct sched_step st, st2;
    int32_t rows = 0;
    for (int32_t pos = 0; pos < 22;) {
        ASSERT_EQ(1, sched_plan(s, &st));
        ASSERT_EQ(1, st.n_seqs);
        ASSERT_EQ(sched_seq_id(l), st.seqs[0].seq_id);
        ASSERT_EQ(pos, st.seqs[0].start_pos);
        pos += st.seqs[0].n_tokens;
        rows += prompt_rows(&st);
        if (pos >= 22) memcpy(lead, st.seqs[0].block_table, 6 * sizeof *lead);
        ASSERT_EQ(0, sched_plan(s, &st2));
        for (int i = 0; i < 3; i++) ASSERT_TRUE(!sched_seq_running(f[i]));
        ASSERT_OK(sched_step_done(s, st.step_id));
    }
    ASSERT_OK(sched_append(s, l, 7));
    int seen = 0, n_ids = 0, copies = 0;
    uint64_t ids[2];
    while (n_ids < 2 && sched_plan(s, &st) == 1) {
        ids[n_ids++] = st.step_id;
        rows += prompt_rows(&st);
        copies += st.n_copies;
        for (int32_t k = 0; k < st.n_seqs; k++) {
            const struct sched_step_seq *o = &st.seqs[k];
            if (o->seq == l) continue;
            seen++;
            ASSERT_EQ(21, o->start_pos);
            ASSERT_EQ(1, o->n_tokens);
            ASSERT_TRUE(o->want_logits);
            ASSERT_EQ(21, o->n_context); /* the penalties' context: the shared prompt */
            ASSERT_EQ(6, o->n_blocks);
            for (int b = 0; b < 5; b++) ASSERT_EQ(lead[b], o->block_table[b]);
        }
    }
    ASSERT_EQ(3, seen);
    /* Block 5 (positions 20..23) is shared and written by all four: every
     * writer but the last copies it. */
    ASSERT_EQ(3, copies);
    struct sched_stats ss;
    sched_get_stats(s, &ss);
    ASSERT_EQ(5 + 4, ss.blocks_used); /* not 4 * 6 */
    ASSERT_EQ(5, ss.blocks_shared);
    for (int k = 0; k < n_ids; k++) ASSERT_OK(sched_step_done(s, ids[k]));
    ASSERT_OK(sched_append(s, l, 7));
    for (int i = 0; i < 3; i++) ASSERT_OK(sched_append(s, f[i], 7));
    return rows;
}

static struct sched_seq *add_choice(sched *s, uint64_t id, uint64_t group) {
    struct sched_seq *q = add_shared(s, id, 0, id, 22, 22);
    sched_seq_set_fork(q, group, 21);
    return q;
}

TEST(scheduler_fork_shares_the_prompt) {
    sched *s = mk(64, 4, 8, 8, 2);
    struct sched_seq *l = add_choice(s, 1, 9), *f[3];
    for (int i = 0; i < 3; i++) f[i] = add_choice(s, 2 + (uint64_t)i, 9);
    int32_t lead[6];
    int32_t rows = check_fork_round(s, l, f, lead);
    struct sched_stats ss;
    sched_get_stats(s, &ss);
    ASSERT_EQ(3, (int)ss.forks);
    ASSERT_EQ(3 * 21, (int)ss.fork_tokens);
    ASSERT_EQ(0, (int)ss.prefix_hit_tokens); /* no cache involved */
    rows += drain(s, 30);
    ASSERT_EQ(22 + 3, rows);
    sched_get_stats(s, &ss);
    ASSERT_EQ(0, ss.blocks_shared);
    assert_all_returned(s);
    sched_free(s);
}

TEST(scheduler_fork_with_the_prefix_cache_on) {
    /* The fork takes the partial block too, which the cache cannot: the
     * followers compute one token each instead of 22 - 20. */
    sched *s = mk_cached(64, 4, 8, 8, 2);
    struct sched_seq *l = add_choice(s, 1, 9), *f[3];
    for (int i = 0; i < 3; i++) f[i] = add_choice(s, 2 + (uint64_t)i, 9);
    int32_t lead[6];
    int32_t rows = check_fork_round(s, l, f, lead);
    struct sched_stats ss;
    sched_get_stats(s, &ss);
    ASSERT_EQ(3, (int)ss.forks);
    ASSERT_EQ(0, (int)ss.prefix_hit_tokens);
    rows += drain(s, 30);
    ASSERT_EQ(22 + 3, rows);
    assert_all_returned(s);
    sched_free(s);
}

TEST(scheduler_fork_leader_cancelled_or_finished) {
    /* The leader is cancelled while its first chunk is in flight: the first
     * choice in line computes the prompt itself and the other two fork it.
     * Once that one has finished, a choice resumed later (its own tokens
     * after the prompt) forks from a member still running. */
    sched *s = mk(64, 4, 8, 8, 2);
    struct sched_seq *l = add_choice(s, 1, 9);
    struct sched_seq *a = add_choice(s, 2, 9), *b = add_choice(s, 3, 9), *c = add_choice(s, 4, 9);
    struct sched_step st;
    ASSERT_EQ(1, sched_plan(s, &st));
    uint64_t step1 = st.step_id;
    int32_t rows = prompt_rows(&st);
    sched_remove(s, l);
    ASSERT_OK(sched_step_done(s, step1));
    struct sched_seq *f[3] = {b, c, NULL};
    /* a leads now: its prefill, then b and c fork. */
    for (int32_t pos = 0; pos < 22;) {
        ASSERT_EQ(1, sched_plan(s, &st));
        ASSERT_EQ(1, st.n_seqs);
        ASSERT_EQ(2ull, st.seqs[0].seq_id);
        pos += st.seqs[0].n_tokens;
        rows += prompt_rows(&st);
        for (int i = 0; i < 2; i++) ASSERT_TRUE(!sched_seq_running(f[i]));
        ASSERT_OK(sched_step_done(s, st.step_id));
    }
    ASSERT_OK(sched_append(s, a, 7));
    ASSERT_EQ(1, sched_plan(s, &st));
    rows += prompt_rows(&st);
    ASSERT_OK(sched_step_done(s, st.step_id));
    for (int32_t k = 0; k < st.n_seqs; k++) ASSERT_OK(sched_append(s, st.seqs[k].seq, 7));
    struct sched_stats ss;
    sched_get_stats(s, &ss);
    ASSERT_TRUE(sched_seq_running(b) && sched_seq_running(c));
    ASSERT_EQ(2, (int)ss.forks);
    /* a finishes; a choice resumed with 3 tokens of its own forks from b. */
    sched_remove(s, a);
    int32_t toks[25];
    for (int32_t i = 0; i < 25; i++) toks[i] = i < 22 ? 100 + i : 55;
    struct sched_seq *r = NULL;
    ASSERT_OK(sched_add(s, 5, 0, 5, toks, 25, &r));
    sched_seq_set_fork(r, 9, 21);
    /* Two steps in flight, as on two stages: b and c decode in the first
     * (decodes go first), r's chunk goes in the second. */
    int found = 0;
    struct sched_step st2;
    ASSERT_EQ(1, sched_plan(s, &st));
    uint64_t s1 = st.step_id;
    struct sched_seq *in1[8];
    int32_t n1 = st.n_seqs;
    for (int32_t k = 0; k < n1; k++) in1[k] = st.seqs[k].seq;
    rows += prompt_rows(&st);
    ASSERT_EQ(1, sched_plan(s, &st2));
    const struct sched_step_seq *o = find(&st2, 5);
    if (o) {
        found = 1;
        ASSERT_EQ(21, o->start_pos);
        ASSERT_EQ(4, o->n_tokens);
        ASSERT_EQ(21, o->n_context);
    }
    rows += prompt_rows(&st2);
    ASSERT_OK(sched_step_done(s, s1));
    for (int32_t k = 0; k < n1; k++) ASSERT_OK(sched_append(s, in1[k], 7));
    ASSERT_OK(sched_step_done(s, st2.step_id));
    for (int32_t k = 0; k < st2.n_seqs; k++) ASSERT_OK(sched_append(s, st2.seqs[k].seq, 7));
    ASSERT_TRUE(found);
    sched_get_stats(s, &ss);
    ASSERT_EQ(3, (int)ss.forks);
    rows += drain(s, 30);
    /* The lost chunk, the prompt once more, b's and c's last prompt token,
     * r's last prompt token and its own 3. */
    ASSERT_EQ(8 + 22 + 2 + 4, rows);
    assert_all_returned(s);
    sched_free(s);
}

TEST(scheduler_fork_followers_are_not_handed_over) {
    /* While the leader computes the prompt, its followers wait to fork it:
     * a hand-over to another pipeline takes only the others waiting. */
    sched *s = mk(64, 4, 8, 1, 1);
    struct sched_seq *l = add_choice(s, 1, 9);
    add_choice(s, 2, 9);
    add(s, 3, 0, 10); /* waits for the batch slot */
    struct sched_step st;
    ASSERT_EQ(1, sched_plan(s, &st));
    ASSERT_EQ(1ull, st.seqs[0].seq_id);
    uint64_t ids[8];
    ASSERT_EQ(1, sched_take_waiting(s, ids, 8));
    ASSERT_EQ(3ull, ids[0]);
    ASSERT_OK(sched_step_done(s, st.step_id));
    sched_remove(s, l);
    /* With no member running it is an ordinary waiting sequence again. */
    ASSERT_EQ(1, sched_plan(s, &st));
    ASSERT_EQ(2ull, st.seqs[0].seq_id);
    ASSERT_EQ(0, st.seqs[0].start_pos);
    ASSERT_OK(sched_step_done(s, st.step_id));
    sched_remove(s, st.seqs[0].seq);
    assert_all_returned(s);
    sched_free(s);
}

TEST(scheduler_fork_preempted_forks_again) {
    /* A pool of 16 blocks of 4: the four choices fit (5 shared blocks + 4
     * of block 5's copies = 9), until a higher-priority sequence of 28
     * tokens (8 blocks with its next token) arrives: forked choices are preempted, their
     * private blocks freed while the shared ones stay with the others; once
     * it is done they are admitted on a fork again.  Every block comes
     * back and nothing stays shared. */
    sched *s = mk(16, 4, 64, 8, 1);
    struct sched_seq *l = add_choice(s, 1, 9);
    for (int i = 0; i < 3; i++) add_choice(s, 2 + (uint64_t)i, 9);
    struct sched_step st;
    /* The leader's prefill, then the forks' first step. */
    for (int k = 0; k < 2; k++) {
        ASSERT_EQ(1, sched_plan(s, &st));
        ASSERT_OK(sched_step_done(s, st.step_id));
        for (int32_t j = 0; j < st.n_seqs; j++)
            if (st.seqs[j].want_logits) ASSERT_OK(sched_append(s, st.seqs[j].seq, 7));
    }
    struct sched_stats ss;
    sched_get_stats(s, &ss);
    ASSERT_EQ(4, ss.n_running);
    ASSERT_EQ(3, (int)ss.forks);
    int32_t toks[28];
    for (int32_t i = 0; i < 28; i++) toks[i] = 5000 + i;
    struct sched_seq *h = NULL;
    ASSERT_OK(sched_add(s, 50, 5, 50, toks, 28, &h));
    ASSERT_EQ(1, sched_plan(s, &st));
    sched_get_stats(s, &ss);
    ASSERT_TRUE(ss.preemptions_total > 0);
    ASSERT_TRUE(sched_seq_running(h));
    ASSERT_TRUE(sched_seq_running(l)); /* the oldest choice stays: later ones go first */
    ASSERT_OK(sched_step_done(s, st.step_id));
    for (int32_t j = 0; j < st.n_seqs; j++)
        if (st.seqs[j].want_logits) ASSERT_OK(sched_append(s, st.seqs[j].seq, 7));
    sched_remove(s, h);
    uint64_t forks_before = ss.forks;
    drain(s, 30);
    sched_get_stats(s, &ss);
    ASSERT_TRUE(ss.forks > forks_before); /* the preempted choices forked again */
    ASSERT_EQ(0, ss.blocks_shared);
    assert_all_returned(s);
    sched_free(s);
}

TEST(scheduler_fork_needs_equal_tokens) {
    /* Two sequences of one group id whose tokens differ (a hash that met):
     * the second computes its own prompt, never the other's KV. */
    sched *s = mk(64, 4, 32, 8, 1);
    struct sched_seq *a = add_choice(s, 1, 9);
    struct sched_seq *b = add(s, 2, 0, 22); /* tokens 2000.. */
    sched_seq_set_fork(b, 9, 21);
    struct sched_step st;
    ASSERT_EQ(1, sched_plan(s, &st));
    ASSERT_EQ(2, st.n_seqs); /* both run at once: b never waited on a */
    ASSERT_EQ(0, find(&st, 2)->start_pos);
    ASSERT_OK(sched_step_done(s, st.step_id));
    (void)a;
    struct sched_stats ss;
    sched_get_stats(s, &ss);
    ASSERT_EQ(0, (int)ss.forks);
    ASSERT_EQ(0, ss.blocks_shared);
    for (int32_t k = 0; k < st.n_seqs; k++) sched_remove(s, st.seqs[k].seq);
    assert_all_returned(s);
    sched_free(s);
}

TEST_MAIN(scheduler_rejects_bad_config, scheduler_batches_prefill_then_decodes,
          scheduler_chunked_prefill_keeps_decodes_running, scheduler_admits_by_free_blocks,
          scheduler_preempts_newest_by_recomputation,
          scheduler_higher_priority_runs_first_and_preempts, scheduler_microbatches_in_flight,
          scheduler_step_seq_limit,
          scheduler_cancel_frees_blocks, scheduler_take_waiting_for_handover,
          scheduler_never_fitting_sequences, scheduler_partial_chunk_when_blocks_are_short,
          scheduler_prefix_cache_maps_computed_blocks, scheduler_prefix_cache_survives_preemption,
          scheduler_prefix_cache_off_by_default, scheduler_prefix_in_flight_computed_once,
          scheduler_prefix_in_flight_leader_cancelled, scheduler_prefix_in_flight_leader_preempted,
          scheduler_prefix_in_flight_others_not_held, scheduler_prefix_in_flight_needs_a_full_block,
          scheduler_prefill_cap_applies_while_decoding,
          scheduler_prefill_cap_spreads_a_burst, scheduler_prefill_cap_idle_without_decodes, scheduler_prefill_cap_keeps_order,
          scheduler_prefill_cap_never_starves, scheduler_prefill_hold_gathers_prompts, scheduler_prefill_hold_limits,
          scheduler_first_waiting, scheduler_spec_verdict_truncates,
          scheduler_spec_rejected_all_and_no_verdict, scheduler_spec_within_free_blocks_and_auto,
          scheduler_spec_stops_at_the_limit, scheduler_fork_shares_the_prompt,
          scheduler_fork_with_the_prefix_cache_on, scheduler_fork_leader_cancelled_or_finished,
          scheduler_fork_followers_are_not_handed_over, scheduler_fork_preempted_forks_again,
          scheduler_fork_needs_equal_tokens)
