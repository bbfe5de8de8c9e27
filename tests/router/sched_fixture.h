/* The fixture of the scheduler tests (test_scheduler*.c): a scheduler
 * with or without the prefix cache, sequences added with their own or a
 * shared prompt, lookups in a planned step, a loop that runs every
 * sequence to its end, and the check that every block came back.
 * Included by each of those files (one program each): every function is
 * static inline, so that a file may leave some unused. */
#ifndef TESTS_ROUTER_SCHED_FIXTURE_H
#define TESTS_ROUTER_SCHED_FIXTURE_H

#include "router/scheduler.h"

#include "common/status.h"
#include "tests/test.h"

static inline sched *mk(int32_t n_blocks, int32_t bs, int32_t step_tokens, int32_t max_batch,
                        int32_t max_inflight) {
    struct sched_config c = {n_blocks, bs, step_tokens, max_batch, max_inflight, 0, 0};
    char err[256];
    sched *s = NULL;
    if (sched_init(&s, &c, err, sizeof err) != 0) TEST_FAIL("sched_init: %s", err);
    return s;
}

static inline struct sched_seq *add(sched *s, uint64_t id, int32_t prio, int32_t n) {
    int32_t toks[512];
    for (int32_t i = 0; i < n; i++) toks[i] = (int32_t)(id * 1000 + (uint64_t)i);
    struct sched_seq *q = NULL;
    int rc = sched_add(s, id, prio, id, toks, n, &q);
    if (rc != 0) TEST_FAIL("sched_add(%llu, %d tokens): %d", (unsigned long long)id, n, rc);
    return q;
}

static inline const struct sched_step_seq *find(const struct sched_step *st, uint64_t id) {
    for (int32_t i = 0; i < st->n_seqs; i++)
        if (st->seqs[i].seq_id == id) return &st->seqs[i];
    return NULL;
}

static inline int has_freed(const struct sched_step *st, uint64_t id) {
    for (int32_t i = 0; i < st->n_freed; i++)
        if (st->freed[i] == id) return 1;
    return 0;
}

/* The rows of st computing prompt tokens: every token but the generated
 * ones, which are 7 here (no prompt holds a 7).  A prompt's last chunk of one
 * token counts as a decode in n_prefill_tokens, but not here. */
static inline int32_t prompt_rows(const struct sched_step *st) {
    int32_t rows = 0;
    for (int32_t i = 0; i < st->n_seqs; i++)
        for (int32_t k = 0; k < st->seqs[i].n_tokens; k++) rows += st->seqs[i].tokens[k] != 7;
    return rows;
}

/* Runs s until nothing is in flight or planned, appending token 7 to every
 * sequence that asks for logits until it holds max tokens, then removing it.
 * Returns the prompt rows it planned. */
static inline int32_t drain(sched *s, int32_t max) {
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

/* A sequence whose first n_shared of n tokens are a prompt every such
 * sequence shares (100 + i), the rest its own. */
static inline struct sched_seq *add_shared(sched *s, uint64_t id, int32_t prio, uint64_t order,
                                           int32_t n_shared, int32_t n) {
    int32_t toks[512];
    for (int32_t i = 0; i < n; i++) toks[i] = i < n_shared ? 100 + i : (int32_t)(id * 1000 + (uint64_t)i);
    struct sched_seq *q = NULL;
    int rc = sched_add(s, id, prio, order, toks, n, &q);
    if (rc != 0) TEST_FAIL("sched_add(%llu, %d tokens): %d", (unsigned long long)id, n, rc);
    return q;
}

static inline sched *mk_cached(int32_t n_blocks, int32_t bs, int32_t step_tokens, int32_t max_batch,
                               int32_t max_inflight) {
    sched *s = mk(n_blocks, bs, step_tokens, max_batch, max_inflight);
    char err[256];
    if (sched_enable_prefix_cache(s, err, sizeof err) != 0) TEST_FAIL("prefix cache: %s", err);
    return s;
}

/* Nothing running or waiting, and every block back in the pool (cached
 * ones idle). */
static inline void assert_all_returned(sched *s) {
    struct sched_stats ss;
    sched_get_stats(s, &ss);
    ASSERT_EQ(0, ss.n_running + ss.n_waiting);
    ASSERT_EQ(0, ss.blocks_used);
    ASSERT_EQ(ss.blocks_total, sched_blocks_free(s));
    ASSERT_EQ(ss.blocks_cached, ss.blocks_idle);
}

#endif
