/* The scheduler of one pipeline: pure logic, no sockets and no Redis, so it
 * can be tested alone.  Continuous batching (sequences join and leave between
 * steps), chunked prefill under a token budget per step, KV-block accounting
 * with the kvblocks allocator, admission by free blocks, preemption by
 * recomputation, priorities, and several micro-batches in flight (one per
 * pipeline stage) with each sequence in at most one of them.
 *
 *   sched *s; sched_init(&s, &cfg, err, sizeof err);
 *   struct sched_seq *q; sched_add(s, id, prio, order, prompt, n, &q);
 *   struct sched_step st;
 *   while (sched_plan(s, now_ms, &st) == 1) send(st);   // up to max_inflight steps
 *   on result:  sched_append(s, q, token) or sched_remove(s, q); then sched_step_done(s, id)
 *
 * Sequence handles stay valid until sched_remove or sched_free. */
#ifndef ROUTER_SCHEDULER_H
#define ROUTER_SCHEDULER_H

#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>

#include "common/kvblocks.h"

typedef struct sched sched;
struct sched_seq;

struct sched_config {
    int32_t n_blocks;     /* KV blocks of the pipeline (the smallest stage's count) */
    int32_t block_size;   /* token positions per KV block */
    int32_t step_tokens;  /* tokens per step: decode tokens plus prefill chunks */
    int32_t max_batch;    /* most sequences running (admitted) at once */
    int32_t max_inflight; /* most steps in flight at once: the stage count */
    uint64_t first_step_id; /* step ids count up from here (0: from 1) */
    int32_t max_step_seqs;  /* sequences in one step, at most (0: max_batch) */
};

/* One sequence of a planned step.  The pointers lead into the scheduler and
 * stay valid until the next sched_* call that changes it: pack them first. */
struct sched_step_seq {
    uint64_t seq_id;
    struct sched_seq *seq;
    int32_t start_pos;
    int32_t n_tokens;
    const int32_t *tokens;      /* n_tokens ids: positions start_pos.. */
    const int32_t *block_table; /* n_blocks physical ids covering [0, start_pos + n_tokens) */
    int32_t n_blocks;
    bool want_logits;           /* the last known token is in this chunk: sample after it */
    /* The workers hold no state for this sequence yet (its first step since
     * it was admitted) although it starts past position 0 (cached prefix):
     * context[0..n_context) are the tokens before start_pos, for the
     * sampler's penalties.  n_context is 0 otherwise. */
    const int32_t *context;
    int32_t n_context;
    /* Speculation: the last n_draft of tokens are drafts to verify (a
     * decode of 1 + n_draft tokens; want_logits is true).  The caller
     * gives the verdict with sched_spec_accept before its sched_append. */
    int32_t n_draft;
    /* Draft-model speculation: the last stage is asked to propose up to
     * draft_k tokens to follow this step's answer (SeqPlan.draft_k), given
     * back with sched_seq_set_model_drafts.  0: none. */
    int32_t draft_k;
};

struct sched_step {
    uint64_t step_id;
    int32_t n_seqs;
    const struct sched_step_seq *seqs;
    /* Sequences the workers must forget before this step (finished,
     * cancelled, preempted): their KV blocks may be reused by this step. */
    int32_t n_freed;
    const uint64_t *freed;
    int32_t n_copies; /* copy-on-write instructions, applied after the frees */
    const struct kvblocks_copy *copies;
    int32_t n_prefill_tokens; /* tokens of prefill (and recompute) chunks */
    int32_t n_decode_tokens;  /* one-token decodes */
    /* Sequences that can never get the blocks they need: alone in the pool
     * and still not fitting.  The caller must end (sched_remove) each. */
    int32_t n_stuck;
    struct sched_seq *const *stuck;
};

struct sched_stats {
    int32_t n_running, n_waiting, n_inflight;
    int32_t blocks_used, blocks_total;
    uint64_t steps_total, preemptions_total;
    /* Prefix cache: published blocks (held or idle) and idle ones (counted
     * free in blocks_used); at each admission the tokens found cached (not
     * computed) and those computed, and the full blocks found. */
    int32_t blocks_cached, blocks_idle;
    uint64_t prefix_hit_tokens, prefix_miss_tokens, prefix_hit_blocks, prefix_miss_blocks;
    /* Waiting sequences held back at admission until a running sequence
     * published the blocks of their prefix it was computing (each counted
     * once per wait; docs/router.md, "Prefix caching"). */
    uint64_t prefix_deferred;
    /* The prefill cap (sched_set_prefill_cap): steps it shortened, and the
     * prefill tokens it held back from them (taken by later steps). */
    uint64_t steps_capped, prefill_capped_tokens;
    /* Plans that admitted nothing under sched_set_prefill_hold. */
    uint64_t admissions_held;
    /* Speculation: decode steps that carried drafts, the drafts, and those
     * accepted (sched_spec_accept). */
    uint64_t spec_steps, spec_proposed, spec_accepted;
    /* Forked choices (sched_seq_set_fork): blocks held by more than one
     * sequence now (forks, and blocks mapped from the prefix cache), the
     * admissions made on a fork, and the positions they took from it
     * instead of computing. */
    int32_t blocks_shared;
    uint64_t forks, fork_tokens;
};

/* 0 and *out (the caller frees it with sched_free), or STATUS_BAD_INPUT
 * naming the field and value / STATUS_NO_MEMORY with err filled. */
int sched_init(sched **out, const struct sched_config *cfg, char *err, size_t errlen);
/* Turns on automatic prefix caching (docs/router.md), before the first
 * sched_add: full blocks whose KV is computed stay published after their
 * sequence ends, and a sequence admitted later maps the leading blocks of
 * its tokens found there instead of computing them.  STATUS_BAD_INPUT once
 * sequences exist; STATUS_NO_MEMORY; err filled. */
int sched_enable_prefix_cache(sched *s, char *err, size_t errlen);
/* Frees every sequence and step; handles become invalid. */
void sched_free(sched *s);

/* Adds a waiting sequence whose known tokens are tokens[0..n_tokens) (the
 * prompt, plus tokens generated before when it is resumed: they are
 * recomputed, and the next sampled token follows them); copied.  Higher
 * priority runs first; among equals, the lower order.  *out receives the
 * handle.  STATUS_BAD_INPUT: n_tokens < 1 or a duplicate seq_id;
 * STATUS_EXHAUSTED: n_tokens + 1 positions need more blocks than the pool
 * has (it could never run); STATUS_NO_MEMORY. */
int sched_add(sched *s, uint64_t seq_id, int32_t priority, uint64_t order, const int32_t *tokens,
              int32_t n_tokens, struct sched_seq **out);
/* A token sampled for q: it becomes q's next decode input.  STATUS_BAD_INPUT
 * if q still has tokens waiting to be processed (a result that should not
 * have been asked for), if a verdict on drafts is missing
 * (sched_spec_accept), or if the token differs from the accepted draft
 * computed at its place. */
int sched_append(sched *s, struct sched_seq *q, int32_t token);
/* Removes q (finished, cancelled, moved to another pipeline): its blocks
 * return to the pool now, and its id goes into the next step's freed list if
 * the workers have seen it.  q is invalid afterwards.  Freeing while a step
 * of q is in flight is safe: stages run steps in order, so q's writes finish
 * before a later step reuses the blocks; its result is then ignored. */
void sched_remove(sched *s, struct sched_seq *q);
/* Starts q over (a failed step): blocks freed, back to waiting, all its
 * tokens to be recomputed. */
void sched_restart(sched *s, struct sched_seq *q);

/* Plans the next step.  Returns 1 with *step filled (valid until the next
 * sched_* call that changes s), or 0 when nothing can run now (no runnable
 * sequence, or max_inflight steps are out).  Never fails on input. */
int sched_plan(sched *s, struct sched_step *step);
/* Hands over the ids waiting to be freed with the next step (as a plan
 * would): *ids, valid until the next sched_* call that changes s, and
 * their count (0: none).  For a plan of frees only, sent when no step
 * follows, so that the stages' view of their KV comes back to the
 * router's. */
int32_t sched_take_freed(sched *s, const uint64_t **ids);
/* The step's results were handled: its sequences may be planned again.
 * STATUS_NOT_FOUND for a step that is not in flight. */
int sched_step_done(sched *s, uint64_t step_id);

/* Bounds the prefill a step carries while some running sequence is
 * decoding, so that the step stays short enough for their inter-token
 * latency (docs/router.md, "Decode latency"): at most max_tokens of
 * prefill chunks, but never less than sched_prefill_floor (so that the
 * first prompt in line moves on every step) nor than a quarter of the
 * prompt tokens the running sequences have left (so that prefill keeps up
 * with the prompts coming in: a burst is spread over four steps).  Steps
 * while no sequence decodes take the whole token budget.  max_tokens < 0: no cap (the
 * initial state).  Prefill keeps its order: the chunks still go to the
 * waiting prompts by priority, then arrival. */
void sched_set_prefill_cap(sched *s, int32_t max_tokens);
/* The least prefill a capped step carries: step_tokens / 16, at least 16
 * (at most step_tokens). */
int32_t sched_prefill_floor(const sched *s);

/* Prefill in few, large steps (docs/router.md, "Prefill hold"): while some
 * running sequence decodes, waiting sequences are admitted only once their
 * tokens together reach min_tokens, or as many as a step takes beside one
 * token per decoding sequence if that is fewer; then their prefill goes
 * in one step instead of a small chunk in each of many.  min_tokens <= 0:
 * admitted as they come (the initial state).  The caller lifts the hold
 * (0) when the first in line has waited long enough. */
void sched_set_prefill_hold(sched *s, int32_t min_tokens);
/* The waiting sequence first in line (priority, then arrival); NULL if none. */
struct sched_seq *sched_first_waiting(const sched *s);

/* Speculation (docs/router.md, "Speculation").  q's decode steps carry up
 * to k drafted tokens found by prompt lookup (router/ngram.h) in q's own
 * tokens, on KV blocks that are free (a draft never preempts), within the
 * step's token budget; k = 0: none (the initial state).  auto_only: only
 * while sched_set_spec_auto(s, true) (the initial state).  limit > 0: q
 * ends when it has that many tokens (prompt and output, within the
 * context), so no draft goes at or past position limit - 1. */
void sched_seq_set_spec(struct sched_seq *q, int32_t k, bool auto_only, int32_t limit);
/* Where q's drafts come from (a mask; the initial state is prompt lookup
 * only).  With SCHED_SPEC_MODEL, a decode step asks the last stage for
 * draft_k drafts of the next step (the draft model beside it), and the
 * next step carries those sched_seq_set_model_drafts gave, unless prompt
 * lookup (also in the mask) found some first. */
#define SCHED_SPEC_NGRAM 1u
#define SCHED_SPEC_MODEL 2u
#define SCHED_SPEC_TOKENS_MAX 16
void sched_seq_set_spec_source(struct sched_seq *q, unsigned sources);
/* The draft model's guesses of the n tokens to follow q's tokens as they
 * are now (after the step's sched_append); kept until q gains a token or a
 * step uses them.  At most SCHED_SPEC_TOKENS_MAX are kept. */
void sched_seq_set_model_drafts(struct sched_seq *q, const int32_t *drafts, int32_t n);
/* SCHED_SPEC_NGRAM or SCHED_SPEC_MODEL: where the drafts of q's step in
 * flight came from (0: none in flight). */
unsigned sched_seq_draft_source(const struct sched_seq *q);
void sched_set_spec_auto(sched *s, bool on);
/* The verdict on the drafts of q's step (its result, before any
 * sched_append of it): n_accepted of them were accepted.  The table is cut
 * back to the last token and the accepted drafts; then the caller appends
 * the tokens the step produced (the accepted drafts first, each equal to
 * its draft, then the one after them).  A step done without a verdict
 * counts none as accepted.  STATUS_BAD_INPUT: n_accepted outside
 * [0, drafts in flight]. */
int sched_spec_accept(sched *s, struct sched_seq *q, int32_t n_accepted);
/* Drafts of q's step in flight (0: none), and the drafts themselves
 * (valid until the next sched_* call that changes q). */
int32_t sched_seq_n_draft(const struct sched_seq *q);
const int32_t *sched_seq_drafts(const struct sched_seq *q);
/* Sequences running (admitted). */
int32_t sched_n_running(const sched *s);

/* Forked choices (docs/router.md, "Forked choices"): q (waiting, not yet
 * admitted) is one of the sequences of group (a non-zero id its caller
 * gives every choice of one request) whose first n_shared positions hold
 * the same tokens (the prompt before its last token).  It is admitted on a
 * fork of the table of a running member that has computed them (the
 * blocks shared copy-on-write; it computes from n_shared on), waits while
 * a running member is still computing them, and is admitted as usual when
 * no member runs.  This works with the prefix cache on or off.  group 0,
 * or n_shared outside [1, q's tokens), makes q a sequence of its own. */
void sched_seq_set_fork(struct sched_seq *q, uint64_t group, int32_t n_shared);

/* While false, waiting sequences are not admitted (a draining pipeline). */
void sched_set_admit(sched *s, bool admit);
/* Moves up to max waiting (never-admitted or preempted) sequences out:
 * their ids into ids[], and removes them as sched_remove would; not those
 * of a fork group (sched_seq_set_fork) with a member running here, which
 * wait to fork it.  Returns the count. */
int32_t sched_take_waiting(sched *s, uint64_t *ids, int32_t max);

uint64_t sched_seq_id(const struct sched_seq *q);
bool sched_seq_running(const struct sched_seq *q);
bool sched_seq_inflight(const struct sched_seq *q);
int32_t sched_seq_n_tokens(const struct sched_seq *q);
void sched_get_stats(const sched *s, struct sched_stats *st);
/* Free blocks; blocks a sequence of n tokens needs. */
int32_t sched_blocks_free(const sched *s);
int32_t sched_blocks_for(const sched *s, int32_t n_tokens);
/* Leading full blocks of tokens[0..n_tokens) this pipeline holds in its
 * prefix cache (0 with the cache off): what routing compares. */
int32_t sched_prefix_blocks(const sched *s, const int32_t *tokens, int32_t n_tokens);

#endif
