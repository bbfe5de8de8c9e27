/* Tests of speculation in the scheduler (router/scheduler.c,
 * sched_seq_set_spec), pure logic: a decode step carries the drafts prompt
 * lookup finds, the verdict cuts the block table back to what was accepted,
 * drafts take only free blocks and stop at the sequence's limit. */
#include "tests/router/sched_fixture.h"

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

TEST_MAIN(scheduler_spec_verdict_truncates, scheduler_spec_rejected_all_and_no_verdict,
          scheduler_spec_within_free_blocks_and_auto, scheduler_spec_stops_at_the_limit)
