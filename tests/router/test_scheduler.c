/* Tests of the per-pipeline scheduler (router/scheduler.c), pure logic:
 * continuous batching, chunked prefill under the token budget, admission by
 * free blocks, preemption by recomputation, priorities, micro-batches in
 * flight, cancellation returning blocks, sequences that can never fit; the
 * prefill cap and hold beside decodes, and the first sequence in line.
 * The prefix cache, speculation and forked choices are tested in
 * test_scheduler_prefix.c, test_scheduler_spec.c and test_scheduler_fork.c. */
#include "tests/router/sched_fixture.h"

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

TEST_MAIN(scheduler_rejects_bad_config, scheduler_batches_prefill_then_decodes,
          scheduler_chunked_prefill_keeps_decodes_running, scheduler_admits_by_free_blocks,
          scheduler_preempts_newest_by_recomputation, scheduler_higher_priority_runs_first_and_preempts,
          scheduler_microbatches_in_flight, scheduler_step_seq_limit, scheduler_cancel_frees_blocks,
          scheduler_take_waiting_for_handover, scheduler_never_fitting_sequences,
          scheduler_partial_chunk_when_blocks_are_short, scheduler_prefill_cap_applies_while_decoding,
          scheduler_prefill_cap_spreads_a_burst, scheduler_prefill_cap_idle_without_decodes,
          scheduler_prefill_cap_keeps_order, scheduler_prefill_cap_never_starves,
          scheduler_prefill_hold_gathers_prompts, scheduler_prefill_hold_limits, scheduler_first_waiting)
