/* The per-pipeline scheduler: which sequences run in the next step, how many
 * of their tokens, and in which KV blocks.  Decodes go first so that a long
 * prompt, cut into chunks under the step's token budget, never stalls them;
 * the pool is shared by admission (a sequence is let in only when its
 * recomputation fits) and preemption (the least important sequence gives its
 * blocks back and is recomputed later). */
#include "router/scheduler.h"

#include <assert.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "common/status.h"
#include "router/ngram.h"

struct sched_seq {
    uint64_t id;
    int32_t priority;
    uint64_t order;
    int32_t *tokens; /* every known token: prompt, then generated */
    int32_t n_tokens, cap;
    /* table.n_tokens = positions handed to steps so far (computed once the
     * steps in flight finish). */
    struct kvblocks_table table;
    bool running;      /* admitted: may hold blocks and be planned */
    uint64_t inflight; /* step id, or 0 */
    bool seen;         /* some worker may hold state for it: free it there */
    bool deferred;     /* waiting for a running sequence to publish its prefix */
    int32_t idx;       /* position in sched.all */
    /* Speculation (sched_seq_set_spec): drafts a decode step may carry,
     * whether only while sched_set_spec_auto allows, and the drafts of
     * the step in flight (tokens[n_tokens .. n_tokens + n_draft), their
     * positions reserved in table until sched_spec_accept). */
    int32_t spec_k;
    bool spec_auto;
    int32_t spec_limit; /* tokens it may reach in all (0: no limit) */
    int32_t n_draft;
    /* Draft-model speculation (sched_seq_set_spec_source): the sources,
     * the source of the drafts in flight, and the last stage's drafts to
     * follow tokens[0 .. mdraft_at). */
    unsigned spec_src, draft_src;
    int32_t mdraft[SCHED_SPEC_TOKENS_MAX];
    int32_t n_mdraft, mdraft_at;
    /* Forked choices (sched_seq_set_fork): the group (0: none), the
     * positions its members share, and the positions of this sequence's
     * table whose KV is written (steps done, or forked). */
    uint64_t group;
    int32_t n_shared;
    int32_t n_computed;
};

struct sched {
    struct sched_config cfg;
    kvblocks *kv;
    bool cache; /* prefix caching on */
    bool admit;
    struct sched_seq **all;
    int32_t n_all, cap_all;
    int32_t n_running;
    uint64_t next_step_id;
    uint64_t *flights; /* step ids in flight, max_inflight entries */
    int32_t n_flights;
    /* Ids to free in the workers with the next step. */
    uint64_t *freed;
    int32_t n_freed, cap_freed;
    /* Output buffers of sched_plan. */
    struct sched_step_seq *out;
    struct kvblocks_copy *copies;
    struct sched_seq **stuck;
    uint64_t *freed_out;
    int32_t cap_freed_out;
    struct sched_seq **cands; /* scratch: cap_all entries */
    int32_t cap_cands;
    struct sched_seq **leaders; /* scratch of sched_admit: cap_leaders entries */
    int32_t cap_leaders;
    struct sched_seq **members; /* scratch of sched_admit: running members of fork groups */
    int32_t cap_members;
    uint64_t forks, fork_tokens;
    uint64_t steps_total, preemptions_total;
    uint64_t hit_tokens, miss_tokens, hit_blocks, miss_blocks, deferred;
    int32_t prefill_cap; /* < 0: none */
    int32_t hold_tokens; /* sched_set_prefill_hold; <= 0: none */
    uint64_t admissions_held;
    uint64_t steps_capped, capped_tokens;
    bool spec_auto_on; /* sched_set_spec_auto */
    int32_t spec_ngram_max, spec_ngram_min;
    uint64_t spec_steps, spec_proposed, spec_accepted;
};

static int sched_grow(void **p, int32_t *cap, int32_t want, size_t elem) {
    if (want <= *cap) return STATUS_OK;
    int32_t n = *cap ? *cap : 16;
    while (n < want) n *= 2;
    void *q = realloc(*p, (size_t)n * elem);
    if (!q) return STATUS_NO_MEMORY;
    *p = q;
    *cap = n;
    return STATUS_OK;
}

int sched_init(sched **out, const struct sched_config *cfg, char *err, size_t errlen) {
    *out = NULL;
    const char *bad = NULL;
    int32_t val = 0;
    if (cfg->n_blocks < 1) bad = "n_blocks", val = cfg->n_blocks;
    else if (cfg->block_size < 1) bad = "block_size", val = cfg->block_size;
    else if (cfg->step_tokens < 1) bad = "step_tokens", val = cfg->step_tokens;
    else if (cfg->max_batch < 1) bad = "max_batch", val = cfg->max_batch;
    else if (cfg->max_inflight < 1) bad = "max_inflight", val = cfg->max_inflight;
    if (bad) {
        snprintf(err, errlen, "scheduler: %s = %d must be at least 1", bad, val);
        return STATUS_BAD_INPUT;
    }
    sched *s = calloc(1, sizeof *s);
    if (!s) goto oom;
    s->cfg = *cfg;
    s->admit = true;
    s->prefill_cap = -1;
    s->spec_auto_on = true;
    s->spec_ngram_max = 3;
    s->spec_ngram_min = 1;
    s->next_step_id = cfg->first_step_id ? cfg->first_step_id : 1;
    int rc = kvblocks_init(&s->kv, cfg->n_blocks, cfg->block_size, err, errlen);
    if (rc < 0) {
        free(s);
        return rc;
    }
    s->flights = calloc((size_t)cfg->max_inflight, sizeof *s->flights);
    s->out = calloc((size_t)cfg->max_batch, sizeof *s->out);
    s->copies = calloc((size_t)cfg->max_batch, sizeof *s->copies);
    s->stuck = calloc((size_t)cfg->max_batch, sizeof *s->stuck);
    if (!s->flights || !s->out || !s->copies || !s->stuck) {
        sched_free(s);
        goto oom;
    }
    *out = s;
    return STATUS_OK;
oom:
    snprintf(err, errlen, "scheduler: out of memory for %d sequences", cfg->max_batch);
    return STATUS_NO_MEMORY;
}

int sched_enable_prefix_cache(sched *s, char *err, size_t errlen) {
    if (s->n_all > 0) {
        snprintf(err, errlen, "scheduler: the prefix cache is turned on before sequences are added "
                 "(%d are)", s->n_all);
        return STATUS_BAD_INPUT;
    }
    int rc = kvblocks_cache_enable(s->kv, err, errlen);
    if (rc == STATUS_OK) s->cache = true;
    return rc;
}

static void sched_seq_destroy(sched *s, struct sched_seq *q) {
    kvblocks_table_free(s->kv, &q->table);
    free(q->tokens);
    free(q);
}

void sched_free(sched *s) {
    if (!s) return;
    for (int32_t i = 0; i < s->n_all; i++) sched_seq_destroy(s, s->all[i]);
    free(s->all);
    kvblocks_free(s->kv);
    free(s->flights);
    free(s->freed);
    free(s->out);
    free(s->copies);
    free(s->stuck);
    free(s->freed_out);
    free(s->cands);
    free(s->leaders);
    free(s->members);
    free(s);
}

int sched_add(sched *s, uint64_t seq_id, int32_t priority, uint64_t order, const int32_t *tokens,
              int32_t n_tokens, struct sched_seq **out) {
    *out = NULL;
    if (n_tokens < 1) return STATUS_BAD_INPUT;
    for (int32_t i = 0; i < s->n_all; i++)
        if (s->all[i]->id == seq_id) return STATUS_BAD_INPUT;
    if (sched_blocks_for(s, n_tokens + 1) > s->cfg.n_blocks) return STATUS_EXHAUSTED;
    if (sched_grow((void **)&s->all, &s->cap_all, s->n_all + 1, sizeof *s->all) < 0)
        return STATUS_NO_MEMORY;
    if (sched_grow((void **)&s->cands, &s->cap_cands, s->n_all + 1, sizeof *s->cands) < 0)
        return STATUS_NO_MEMORY;
    if (sched_grow((void **)&s->leaders, &s->cap_leaders, s->n_all + 1, sizeof *s->leaders) < 0)
        return STATUS_NO_MEMORY;
    if (sched_grow((void **)&s->members, &s->cap_members, s->n_all + 1, sizeof *s->members) < 0)
        return STATUS_NO_MEMORY;
    struct sched_seq *q = calloc(1, sizeof *q);
    if (!q) return STATUS_NO_MEMORY;
    q->cap = n_tokens + 64;
    q->tokens = malloc((size_t)q->cap * sizeof *q->tokens);
    if (!q->tokens) {
        free(q);
        return STATUS_NO_MEMORY;
    }
    memcpy(q->tokens, tokens, (size_t)n_tokens * sizeof *tokens);
    q->n_tokens = n_tokens;
    q->id = seq_id;
    q->priority = priority;
    q->order = order;
    q->spec_src = SCHED_SPEC_NGRAM;
    kvblocks_table_init(&q->table);
    q->idx = s->n_all;
    s->all[s->n_all++] = q;
    *out = q;
    return STATUS_OK;
}

int sched_append(sched *s, struct sched_seq *q, int32_t token) {
    (void)s;
    /* Past n_tokens, the table covers only accepted drafts (after
     * sched_spec_accept): the token must be the one computed there. */
    if (q->n_draft > 0 || q->table.n_tokens < q->n_tokens) return STATUS_BAD_INPUT;
    if (q->table.n_tokens > q->n_tokens && q->tokens[q->n_tokens] != token) return STATUS_BAD_INPUT;
    if (q->n_tokens == q->cap) {
        int32_t cap = q->cap * 2;
        int32_t *t = realloc(q->tokens, (size_t)cap * sizeof *t);
        if (!t) return STATUS_NO_MEMORY;
        q->tokens = t;
        q->cap = cap;
    }
    q->tokens[q->n_tokens++] = token;
    return STATUS_OK;
}

static void sched_note_freed(sched *s, struct sched_seq *q) {
    if (!q->seen) return;
    q->seen = false;
    if (sched_grow((void **)&s->freed, &s->cap_freed, s->n_freed + 1, sizeof *s->freed) < 0) {
        /* Out of memory: the worker keeps stale per-sequence state, which a
         * later start at position 0 overwrites; the blocks are ours anyway. */
        return;
    }
    s->freed[s->n_freed++] = q->id;
}

/* Back to waiting with every token to recompute. */
static void sched_preempt(sched *s, struct sched_seq *q) {
    kvblocks_table_free(s->kv, &q->table);
    sched_note_freed(s, q);
    if (q->running) s->n_running--;
    q->running = false;
    q->inflight = 0;
    q->n_draft = 0;
    q->n_computed = 0;
}

void sched_remove(sched *s, struct sched_seq *q) {
    sched_preempt(s, q);
    int32_t i = q->idx;
    assert(i >= 0 && i < s->n_all && s->all[i] == q);
    s->all[i] = s->all[--s->n_all];
    s->all[i]->idx = i;
    sched_seq_destroy(s, q);
}

void sched_restart(sched *s, struct sched_seq *q) {
    sched_preempt(s, q);
    s->preemptions_total++;
}

/* a runs before b. */
static bool sched_before(const struct sched_seq *a, const struct sched_seq *b) {
    if (a->priority != b->priority) return a->priority > b->priority;
    return a->order < b->order;
}

static int sched_cmp(const void *pa, const void *pb) {
    const struct sched_seq *a = *(struct sched_seq *const *)pa, *b = *(struct sched_seq *const *)pb;
    if (a == b) return 0;
    return sched_before(a, b) ? -1 : 1;
}

/* Decodes (one token left) before prefill chunks, each in priority order. */
static int sched_cmp_cand(const void *pa, const void *pb) {
    const struct sched_seq *a = *(struct sched_seq *const *)pa, *b = *(struct sched_seq *const *)pb;
    bool da = a->n_tokens - a->table.n_tokens == 1, db = b->n_tokens - b->table.n_tokens == 1;
    if (da != db) return da ? -1 : 1;
    return sched_cmp(pa, pb);
}

/* The least important running sequence that holds blocks and is not in a
 * step (in flight, or already in the one being planned), other than skip. */
static struct sched_seq *sched_victim(sched *s, const struct sched_seq *skip) {
    struct sched_seq *v = NULL;
    for (int32_t i = 0; i < s->n_all; i++) {
        struct sched_seq *q = s->all[i];
        if (q == skip || !q->running || q->inflight || q->table.n_ids == 0) continue;
        if (!v || sched_before(v, q)) v = q;
    }
    return v;
}

int32_t sched_blocks_for(const sched *s, int32_t n_tokens) {
    int32_t bs = s->cfg.block_size;
    return (n_tokens + bs - 1) / bs;
}

int32_t sched_blocks_free(const sched *s) { return kvblocks_n_free(s->kv); }

/* Blocks running sequences still need to hold all their known tokens plus
 * the next one: admission keeps these free so admitted prefills complete. */
static int32_t sched_outstanding(const sched *s, const struct sched_seq *q) {
    int32_t n = q->n_tokens + 1 - q->table.n_tokens;
    return n > 0 ? kvblocks_blocks_needed(s->kv, &q->table, n) : 0;
}

/* Maps the leading blocks of w's tokens found in the prefix cache into its
 * (empty) table: at most those below its last token, which is computed in
 * any case for its logits, so the next write always starts in a block of
 * its own.  Returns the blocks mapped. */
static int32_t sched_map_prefix(sched *s, struct sched_seq *w) {
    int32_t bs = s->cfg.block_size;
    int32_t n = kvblocks_cache_lookup(s->kv, w->tokens, w->n_tokens, NULL);
    int32_t most = (w->n_tokens - 1) / bs;
    if (n > most) n = most;
    if (n > 0 && kvblocks_cache_map(s->kv, &w->table, w->tokens, n, n * bs) != STATUS_OK) n = 0;
    return n;
}

/* In-flight prefix sharing.  A running sequence L "leads" while the first
 * full block of its known tokens that it has not published (block k =
 * L->table.n_hashed) is still to be computed by it or is in a step in
 * flight: when that step is done, sched_step_done publishes the block.  A
 * waiting sequence whose tokens equal L's up to the end of block k, and
 * that could map block k (it lies before its last token), is not admitted
 * to compute the same KV again: it waits, and the admission after L's step
 * maps the blocks L published and goes on from there (waiting again while
 * L computes its next shared block).  Blocks are still published only
 * after their step is done, so a follower never maps a block whose KV is
 * not written on every stage.
 *
 * A wait always ends: L stops leading for block k once the step computing
 * it is done (block k published, or publishing stopped for L: then the
 * follower is admitted normally), or once L leaves the running set
 * (finished, cancelled, preempted, its step failed); every admission
 * evaluates the waiting sequences again, and the first of them in line
 * then becomes a leader itself.  A follower waits only for a leader of its
 * priority or higher, so a sequence never waits on a less important one
 * that could be preempted or planned after others. */
static bool sched_leads(const sched *s, const struct sched_seq *q) {
    const struct kvblocks_table *t = &q->table;
    int32_t end = (t->n_hashed + 1) * s->cfg.block_size; /* block k's end */
    return q->running && !t->hash_stop && q->n_tokens >= end &&
           (q->inflight != 0 || t->n_tokens < end);
}

/* Whether w waits for one of leaders[0..n) to publish the next blocks of
 * its prefix.  Cost: O(n) leader checks of a few fields each, plus for a
 * leader whose block k starts a block w could map, one compare of block k
 * (bs tokens, ending at the first token that differs: a leader that does
 * not share it is rejected there); only a leader sharing block k also
 * compares the k * bs tokens before it and hashes block k once, and then
 * the search ends.  So O(n_leaders * bs) per waiting candidate at worst,
 * and the leaders are the running sequences with an unpublished full block
 * still to compute (those in prefill, or with a block in flight), not all
 * of them. */
static bool sched_prefix_pending(const sched *s, const struct sched_seq *w,
                                 struct sched_seq *const *leaders, int32_t n) {
    int32_t bs = s->cfg.block_size;
    int32_t most = (w->n_tokens - 1) / bs; /* blocks w could map */
    for (int32_t i = 0; i < n; i++) {
        const struct sched_seq *l = leaders[i];
        if (!l->running || l->priority < w->priority) continue; /* preempted since the list was made */
        int32_t k = l->table.n_hashed;
        if (k >= most) continue; /* w could map no block beyond what is cached */
        size_t off = (size_t)k * (size_t)bs;
        if (memcmp(w->tokens + off, l->tokens + off, (size_t)bs * sizeof *w->tokens) != 0) continue;
        if (k > 0 && memcmp(w->tokens, l->tokens, off * sizeof *w->tokens) != 0) continue;
        /* Another sequence published block k already: w maps it now. */
        if (kvblocks_cache_next_found(s->kv, &l->table, l->tokens)) continue;
        return true;
    }
    return false;
}

/* A running sequence with at most its next input left: it is decoding (or
 * its last prefill chunk is in flight and its first token comes next). */
static bool sched_decoding(const struct sched_seq *q) {
    return q->running && q->n_tokens - q->table.n_tokens <= 1;
}

/* sched_set_prefill_hold: true while sequences decode and the waiting ones
 * bring fewer tokens than the hold, or than a step can take beside the
 * decodes. */
static bool sched_holds(const sched *s) {
    int32_t n_dec = 0;
    int64_t waiting = 0;
    for (int32_t i = 0; i < s->n_all; i++) {
        const struct sched_seq *q = s->all[i];
        if (sched_decoding(q)) n_dec++;
        else if (!q->running) waiting += q->n_tokens;
    }
    int32_t want = s->hold_tokens, room = s->cfg.step_tokens - n_dec;
    if (room < want) want = room;
    return n_dec > 0 && waiting > 0 && waiting < want;
}

/* Forked choices (sched_seq_set_fork).  A waiting member w of a group is
 * admitted on a fork of a running member m that has written the KV of the
 * shared positions (m->n_computed, counted only when m's steps are done, so
 * that w never reads KV some stage has not written): w's table takes m's
 * blocks covering them, with their references, and w computes only from
 * there (its last prompt token first, for its own logits; the write into
 * the shared partial block copies it first).  While a running member is
 * still computing them, w waits (taking neither slot nor blocks); with no
 * member running, w is admitted as usual and computes them itself, and the
 * members behind it wait for it.  The tokens are compared, so a group id
 * that two unrelated sequences happen to share costs a fork, never a
 * wrong KV.  Returns the member to fork, or NULL with *wait set when w
 * waits. */
static struct sched_seq *sched_fork_source(const sched *s, const struct sched_seq *w,
                                           struct sched_seq *const *members, int32_t n, bool *wait) {
    *wait = false;
    if (w->group == 0) return NULL;
    size_t bytes = (size_t)w->n_shared * sizeof *w->tokens;
    for (int32_t i = 0; i < n; i++) {
        struct sched_seq *m = members[i];
        if (m == w || m->group != w->group || !m->running || m->n_shared != w->n_shared ||
            m->n_tokens < w->n_shared || memcmp(m->tokens, w->tokens, bytes) != 0)
            continue;
        if (m->n_computed >= w->n_shared && m->table.n_tokens >= w->n_shared) return m;
        *wait = true;
    }
    (void)s;
    return NULL;
}

static void sched_admit(sched *s) {
    if (!s->admit) return;
    if (s->hold_tokens > 0 && sched_holds(s)) {
        s->admissions_held++;
        return;
    }
    int32_t n_wait = 0, reserved = 0, n_lead = 0, n_memb = 0;
    for (int32_t i = 0; i < s->n_all; i++) {
        struct sched_seq *q = s->all[i];
        if (q->running) {
            reserved += sched_outstanding(s, q);
            if (s->cache && sched_leads(s, q)) s->leaders[n_lead++] = q;
            if (q->group) s->members[n_memb++] = q;
        } else {
            s->cands[n_wait++] = q;
        }
    }
    if (n_wait == 0) return;
    qsort(s->cands, (size_t)n_wait, sizeof *s->cands, sched_cmp);
    for (int32_t i = 0; i < n_wait; i++) {
        struct sched_seq *w = s->cands[i];
        /* A waiting sequence of higher priority takes the place (batch slot
         * or blocks) of a lower-priority running one, which is recomputed
         * later; equal priorities never preempt each other here.  With no
         * slot to take, nobody behind w (of its priority or lower) could
         * take one either. */
        if (s->n_running >= s->cfg.max_batch) {
            struct sched_seq *v = sched_victim(s, NULL);
            if (!v || v->priority >= w->priority) return;
        }
        /* A follower takes neither slot nor blocks, and those behind it
         * are still admitted by the usual rules. */
        bool fork_wait = false;
        struct sched_seq *src = sched_fork_source(s, w, s->members, n_memb, &fork_wait);
        if (fork_wait || (!src && n_lead > 0 && sched_prefix_pending(s, w, s->leaders, n_lead))) {
            if (!w->deferred) s->deferred++;
            w->deferred = true;
            continue;
        }
        w->deferred = false;
        while (s->n_running >= s->cfg.max_batch) {
            struct sched_seq *v = sched_victim(s, NULL);
            if (!v || v->priority >= w->priority) return;
            reserved -= sched_outstanding(s, v);
            sched_restart(s, v);
        }
        /* A fork, or blocks found cached, are mapped first: they need no
         * free block (an idle cached one leaves the free count as it is
         * mapped). */
        bool forked = src && kvblocks_fork(s->kv, &w->table, &src->table, w->n_shared) == STATUS_OK;
        int32_t hits = !forked && s->cache ? sched_map_prefix(s, w) : 0;
        int32_t need = sched_outstanding(s, w);
        while (need > kvblocks_n_free(s->kv) - reserved) {
            struct sched_seq *v = sched_victim(s, NULL);
            if (!v || v->priority >= w->priority) {
                kvblocks_table_free(s->kv, &w->table);
                return;
            }
            reserved -= sched_outstanding(s, v);
            sched_restart(s, v);
        }
        w->running = true;
        s->n_running++;
        reserved += need;
        if (w->group) s->members[n_memb++] = w;
        if (forked) {
            w->n_computed = w->n_shared;
            s->forks++;
            s->fork_tokens += (uint64_t)w->n_shared;
        }
        if (s->cache && !forked) {
            int32_t full = w->n_tokens / s->cfg.block_size;
            s->hit_blocks += (uint64_t)hits;
            s->miss_blocks += (uint64_t)(full - hits);
            s->hit_tokens += (uint64_t)w->table.n_tokens;
            s->miss_tokens += (uint64_t)(w->n_tokens - w->table.n_tokens);
        }
        if (s->cache) {
            /* w now leads the sequences behind it that share its blocks. */
            if (sched_leads(s, w)) s->leaders[n_lead++] = w;
        }
    }
}

void sched_set_prefill_cap(sched *s, int32_t max_tokens) { s->prefill_cap = max_tokens; }

void sched_set_prefill_hold(sched *s, int32_t min_tokens) { s->hold_tokens = min_tokens; }

struct sched_seq *sched_first_waiting(const sched *s) {
    struct sched_seq *first = NULL;
    for (int32_t i = 0; i < s->n_all; i++) {
        struct sched_seq *q = s->all[i];
        if (!q->running && (!first || sched_before(q, first))) first = q;
    }
    return first;
}

int32_t sched_prefill_floor(const sched *s) {
    int32_t f = s->cfg.step_tokens / 16;
    if (f < 16) f = 16;
    return f < s->cfg.step_tokens ? f : s->cfg.step_tokens;
}

/* A capped step takes at least this fraction (1/N) of the prompt tokens
 * the running sequences have left to prefill. */
#define SCHED_PREFILL_SPREAD 4

int sched_plan(sched *s, struct sched_step *step) {
    memset(step, 0, sizeof *step);
    if (s->n_flights >= s->cfg.max_inflight) return 0;
    sched_admit(s);

    int32_t n_cand = 0;
    bool decoding = false;
    int64_t backlog = 0; /* prompt tokens the running sequences still have to prefill */
    for (int32_t i = 0; i < s->n_all; i++) {
        struct sched_seq *q = s->all[i];
        decoding = decoding || sched_decoding(q);
        if (q->running && !q->inflight && q->table.n_tokens < q->n_tokens) {
            s->cands[n_cand++] = q;
            if (q->n_tokens - q->table.n_tokens > 1) backlog += q->n_tokens - q->table.n_tokens;
        }
    }
    if (n_cand == 0) return 0;
    qsort(s->cands, (size_t)n_cand, sizeof *s->cands, sched_cmp_cand);

    /* Spread the running sequences over the micro-batches so that every
     * stage has work: each step takes about 1/max_inflight of them. */
    int32_t per_step = (s->n_running + s->cfg.max_inflight - 1) / s->cfg.max_inflight;
    if (per_step < 1) per_step = 1;
    if (s->cfg.max_step_seqs > 0 && per_step > s->cfg.max_step_seqs) per_step = s->cfg.max_step_seqs;
    uint64_t step_id = s->next_step_id;
    int32_t budget = s->cfg.step_tokens, n_out = 0, n_copies = 0, n_stuck = 0;
    int32_t n_prefill = 0, n_decode = 0;
    int32_t bs = s->cfg.block_size;
    /* Prefill tokens this step may still take, and those the cap held back
     * (counted against what the step would have carried without it, so
     * that two prompts never count the same budget twice). */
    int32_t pf_room = budget, held = 0;
    if (decoding && s->prefill_cap >= 0) {
        /* The floor keeps prompts moving when decodes alone take the
         * target; the spread keeps prefill up with its arrivals, so that a
         * cap below what the prompts bring never lets them pile up (and
         * the batch empty out): a burst goes out over SCHED_PREFILL_SPREAD
         * steps instead of one. */
        int32_t floor = sched_prefill_floor(s);
        int64_t spread = (backlog + SCHED_PREFILL_SPREAD - 1) / SCHED_PREFILL_SPREAD;
        pf_room = s->prefill_cap > floor ? s->prefill_cap : floor;
        if (spread > pf_room) pf_room = spread < budget ? (int32_t)spread : budget;
    }

    for (int32_t c = 0; c < n_cand && n_out < per_step && budget > 0; c++) {
        struct sched_seq *q = s->cands[c];
        if (!q->running) continue; /* preempted while planning this step */
        int32_t left = q->n_tokens - q->table.n_tokens;
        int32_t n = left < budget ? left : budget;
        bool prefill = left > 1;
        if (prefill && n > pf_room) {
            int32_t uncapped = budget - held;
            uncapped = left < uncapped ? left : uncapped;
            if (uncapped > pf_room) held += uncapped - pf_room;
            n = pf_room;
            if (n == 0) continue;
        }
        int32_t n_draft = 0;
        if (!prefill && n == 1 && q->spec_k > 0 && (!q->spec_auto || s->spec_auto_on) &&
            budget > 1) {
            /* Drafts ride only on blocks that are free: speculation never
             * preempts anyone. */
            int32_t k = q->spec_k < budget - 1 ? q->spec_k : budget - 1;
            /* Past its limit a draft could never be kept, and its position
             * could lie past the context. */
            if (q->spec_limit > 0 && k > q->spec_limit - 1 - q->n_tokens) k = q->spec_limit - 1 - q->n_tokens;
            if (k < 0) k = 0;
            if (k > 0 && sched_grow((void **)&q->tokens, &q->cap, q->n_tokens + k, sizeof *q->tokens) == 0) {
                q->draft_src = 0;
                if (q->spec_src & SCHED_SPEC_NGRAM)
                    n_draft = ngram_propose(q->tokens, q->n_tokens, s->spec_ngram_max,
                                            s->spec_ngram_min, k, q->tokens + q->n_tokens);
                if (n_draft > 0) {
                    q->draft_src = SCHED_SPEC_NGRAM;
                } else if ((q->spec_src & SCHED_SPEC_MODEL) && q->n_mdraft > 0 &&
                           q->mdraft_at == q->n_tokens) {
                    n_draft = q->n_mdraft < k ? q->n_mdraft : k;
                    memcpy(q->tokens + q->n_tokens, q->mdraft, (size_t)n_draft * sizeof *q->tokens);
                    q->draft_src = SCHED_SPEC_MODEL;
                }
                q->n_mdraft = 0;
            }
            while (n_draft > 0 &&
                   kvblocks_blocks_needed(s->kv, &q->table, 1 + n_draft) > kvblocks_n_free(s->kv))
                n_draft--;
            n += n_draft;
        }
        while (kvblocks_blocks_needed(s->kv, &q->table, n) > kvblocks_n_free(s->kv)) {
            struct sched_seq *v = sched_victim(s, q);
            if (!v || sched_before(v, q)) break;
            sched_restart(s, v);
        }
        if (kvblocks_blocks_needed(s->kv, &q->table, n) > kvblocks_n_free(s->kv)) {
            /* A shorter chunk that fits the free blocks still makes progress
             * (prefill only: a decode is one token). */
            int32_t room = (q->table.n_ids + kvblocks_n_free(s->kv)) * bs - q->table.n_tokens;
            if (kvblocks_write_copies(s->kv, &q->table))
                room -= bs; /* the shared last block would need a copy first */
            if (room >= 1 && room < n) {
                n = room;
            } else {
                struct sched_seq *v = sched_victim(s, q);
                if (v) {
                    /* Everyone else left to preempt is more important. */
                    sched_restart(s, q);
                } else if (s->n_flights == 0 && n_out == 0 && s->n_running == 1) {
                    s->stuck[n_stuck++] = q;
                }
                /* else: steps in flight will return blocks; try again later. */
                continue;
            }
        }
        struct kvblocks_copy cp;
        int32_t nc = 0;
        int32_t start = q->table.n_tokens;
        if (kvblocks_reserve(s->kv, &q->table, n, &cp, &nc) < 0) continue;
        if (nc) s->copies[n_copies++] = cp;
        struct sched_step_seq *o = &s->out[n_out++];
        o->context = q->tokens;
        o->n_context = q->seen ? 0 : start;
        q->inflight = step_id;
        q->seen = true;
        o->seq_id = q->id;
        o->seq = q;
        o->start_pos = start;
        o->n_tokens = n;
        o->tokens = q->tokens + start;
        o->block_table = q->table.ids;
        o->n_blocks = q->table.n_ids;
        o->want_logits = q->table.n_tokens >= q->n_tokens;
        o->n_draft = n_draft;
        q->n_draft = n_draft;
        /* The draft model proposes the next step's drafts after this one's
         * answer (docs/router.md, "Speculation"). */
        o->draft_k = (q->spec_src & SCHED_SPEC_MODEL) && q->spec_k > 0 && o->want_logits &&
                             (!q->spec_auto || s->spec_auto_on)
                         ? q->spec_k
                         : 0;
        if (n_draft > 0) {
            s->spec_steps++;
            s->spec_proposed += (uint64_t)n_draft;
        }
        if (o->want_logits && !prefill) n_decode += n;
        else n_prefill += n;
        if (prefill) pf_room -= n;
        budget -= n;
    }
    step->n_stuck = n_stuck;
    step->stuck = s->stuck;
    if (n_out == 0) return 0;

    if (sched_grow((void **)&s->freed_out, &s->cap_freed_out, s->n_freed, sizeof *s->freed_out) == 0) {
        /* s->freed is NULL until a sequence is first freed. */
        if (s->n_freed) memcpy(s->freed_out, s->freed, (size_t)s->n_freed * sizeof *s->freed);
        step->n_freed = s->n_freed;
        step->freed = s->freed_out;
        s->n_freed = 0;
    }
    s->next_step_id++;
    s->flights[s->n_flights++] = step_id;
    s->steps_total++;
    if (held > 0) {
        s->steps_capped++;
        s->capped_tokens += (uint64_t)held;
    }
    step->step_id = step_id;
    step->n_seqs = n_out;
    step->seqs = s->out;
    step->n_copies = n_copies;
    step->copies = s->copies;
    step->n_prefill_tokens = n_prefill;
    step->n_decode_tokens = n_decode;
    return 1;
}

int sched_step_done(sched *s, uint64_t step_id) {
    int32_t f = -1;
    for (int32_t i = 0; i < s->n_flights; i++)
        if (s->flights[i] == step_id) f = i;
    if (f < 0) return STATUS_NOT_FOUND;
    s->flights[f] = s->flights[--s->n_flights];
    for (int32_t i = 0; i < s->n_all; i++) {
        struct sched_seq *q = s->all[i];
        if (q->inflight != step_id) continue;
        q->inflight = 0;
        if (q->n_draft > 0) {
            /* No verdict came for the drafts (sched_spec_accept): none
             * counts as written. */
            kvblocks_truncate(s->kv, &q->table, q->table.n_tokens - q->n_draft);
            q->n_draft = 0;
        }
        /* The step's KV is written (a failed step restarted its sequences
         * before this): full blocks become findable.  Only now, so a block
         * is never mapped before its KV exists. */
        if (s->cache) kvblocks_cache_publish(s->kv, &q->table, q->tokens, q->table.n_tokens);
        q->n_computed = q->table.n_tokens;
    }
    return STATUS_OK;
}

int32_t sched_take_freed(sched *s, const uint64_t **ids) {
    *ids = NULL;
    if (s->n_freed == 0 ||
        sched_grow((void **)&s->freed_out, &s->cap_freed_out, s->n_freed, sizeof *s->freed_out) < 0)
        return 0;
    memcpy(s->freed_out, s->freed, (size_t)s->n_freed * sizeof *s->freed);
    int32_t n = s->n_freed;
    s->n_freed = 0;
    *ids = s->freed_out;
    return n;
}

void sched_set_admit(sched *s, bool admit) { s->admit = admit; }

/* Whether a member of q's fork group other than q runs here. */
static bool sched_group_runs(const sched *s, const struct sched_seq *q) {
    if (!q->group) return false;
    for (int32_t i = 0; i < s->n_all; i++) {
        const struct sched_seq *m = s->all[i];
        if (m != q && m->running && m->group == q->group && m->n_shared == q->n_shared &&
            memcmp(m->tokens, q->tokens, (size_t)q->n_shared * sizeof *q->tokens) == 0)
            return true;
    }
    return false;
}

int32_t sched_take_waiting(sched *s, uint64_t *ids, int32_t max) {
    int32_t n = 0;
    for (int32_t i = 0; i < s->n_all && n < max;) {
        struct sched_seq *q = s->all[i];
        /* A choice of a group with a member running here stays, to fork
         * it: elsewhere it would compute the prompt again (and be sent
         * back here, where its request's choices go). */
        if (!q->running && !sched_group_runs(s, q)) {
            ids[n++] = q->id;
            sched_remove(s, q); /* moves the last entry into slot i */
        } else {
            i++;
        }
    }
    return n;
}

uint64_t sched_seq_id(const struct sched_seq *q) { return q->id; }
bool sched_seq_running(const struct sched_seq *q) { return q->running; }
bool sched_seq_inflight(const struct sched_seq *q) { return q->inflight != 0; }
int32_t sched_seq_n_tokens(const struct sched_seq *q) { return q->n_tokens; }

void sched_get_stats(const sched *s, struct sched_stats *st) {
    memset(st, 0, sizeof *st);
    st->n_running = s->n_running;
    st->n_waiting = s->n_all - s->n_running;
    st->n_inflight = s->n_flights;
    st->blocks_total = kvblocks_n_blocks(s->kv);
    st->blocks_used = kvblocks_n_used(s->kv);
    st->steps_total = s->steps_total;
    st->preemptions_total = s->preemptions_total;
    st->blocks_cached = kvblocks_n_cached(s->kv);
    st->blocks_idle = kvblocks_n_idle(s->kv);
    st->prefix_hit_tokens = s->hit_tokens;
    st->prefix_miss_tokens = s->miss_tokens;
    st->prefix_hit_blocks = s->hit_blocks;
    st->prefix_miss_blocks = s->miss_blocks;
    st->prefix_deferred = s->deferred;
    st->steps_capped = s->steps_capped;
    st->prefill_capped_tokens = s->capped_tokens;
    st->admissions_held = s->admissions_held;
    st->spec_steps = s->spec_steps;
    st->spec_proposed = s->spec_proposed;
    st->spec_accepted = s->spec_accepted;
    st->blocks_shared = kvblocks_n_shared(s->kv);
    st->forks = s->forks;
    st->fork_tokens = s->fork_tokens;
}

int32_t sched_prefix_blocks(const sched *s, const int32_t *tokens, int32_t n_tokens) {
    return kvblocks_cache_lookup(s->kv, tokens, n_tokens, NULL);
}

void sched_seq_set_spec(struct sched_seq *q, int32_t k, bool auto_only, int32_t limit) {
    q->spec_k = k > 0 ? k : 0;
    q->spec_auto = auto_only;
    q->spec_limit = limit > 0 ? limit : 0;
}

void sched_set_spec_auto(sched *s, bool on) { s->spec_auto_on = on; }

void sched_seq_set_fork(struct sched_seq *q, uint64_t group, int32_t n_shared) {
    bool on = group != 0 && n_shared > 0 && n_shared < q->n_tokens;
    q->group = on ? group : 0;
    q->n_shared = on ? n_shared : 0;
}

void sched_seq_set_spec_source(struct sched_seq *q, unsigned sources) {
    q->spec_src = sources & (SCHED_SPEC_NGRAM | SCHED_SPEC_MODEL);
}

void sched_seq_set_model_drafts(struct sched_seq *q, const int32_t *drafts, int32_t n) {
    if (n < 0) n = 0;
    if (n > SCHED_SPEC_TOKENS_MAX) n = SCHED_SPEC_TOKENS_MAX;
    memcpy(q->mdraft, drafts, (size_t)n * sizeof *drafts);
    q->n_mdraft = n;
    q->mdraft_at = q->n_tokens;
}

unsigned sched_seq_draft_source(const struct sched_seq *q) { return q->n_draft > 0 ? q->draft_src : 0; }

int sched_spec_accept(sched *s, struct sched_seq *q, int32_t n_accepted) {
    if (n_accepted < 0 || n_accepted > q->n_draft) return STATUS_BAD_INPUT;
    /* Positions past the last token and the accepted drafts were written
     * with rejected guesses: as if never written. */
    int32_t keep = q->table.n_tokens - (q->n_draft - n_accepted);
    if (kvblocks_truncate(s->kv, &q->table, keep) < 0) return STATUS_BAD_INPUT;
    s->spec_accepted += (uint64_t)n_accepted;
    q->n_draft = 0;
    return STATUS_OK;
}

int32_t sched_seq_n_draft(const struct sched_seq *q) { return q->n_draft; }
int32_t sched_n_running(const sched *s) { return s->n_running; }
const int32_t *sched_seq_drafts(const struct sched_seq *q) { return q->tokens + q->n_tokens; }
