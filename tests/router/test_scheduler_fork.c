/* Tests of forked choices in the scheduler (router/scheduler.c,
 * sched_seq_set_fork), pure logic: the choices of one prompt share its
 * blocks, with the prefix cache on or off, when the leader is cancelled,
 * finishes or is preempted, and never across prompts that differ. */
#include "tests/router/sched_fixture.h"

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

TEST_MAIN(scheduler_fork_shares_the_prompt, scheduler_fork_with_the_prefix_cache_on,
          scheduler_fork_leader_cancelled_or_finished, scheduler_fork_followers_are_not_handed_over,
          scheduler_fork_preempted_forks_again, scheduler_fork_needs_equal_tokens)
