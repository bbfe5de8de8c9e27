/* Tests of the scheduler's prefix cache (router/scheduler.c,
 * sched_enable_prefix_cache), pure logic: computed blocks mapped by a later
 * sequence with the same prompt, kept through preemption, off by default;
 * a prefix in flight computed once while the others wait for it, and what
 * happens when its leader is cancelled or preempted. */
#include "tests/router/sched_fixture.h"

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

TEST_MAIN(scheduler_prefix_cache_maps_computed_blocks, scheduler_prefix_cache_survives_preemption,
          scheduler_prefix_cache_off_by_default, scheduler_prefix_in_flight_computed_once,
          scheduler_prefix_in_flight_leader_cancelled, scheduler_prefix_in_flight_leader_preempted,
          scheduler_prefix_in_flight_others_not_held, scheduler_prefix_in_flight_needs_a_full_block)
