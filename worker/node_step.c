/* The worker's compute thread: the per-sequence state, and one step plan
 * checked, run through the stage and answered with a StepResult. */
#include "node-impl.h"
#include "node_metrics.h"

#include "common/log.h"
#include "common/status.h"
#include "common/watchdog.h"
#include "proto/request.h"
#if defined(LLM_HAVE_CUDA)
#include "kernels/cuda/nccl_link.h"
#include "kernels/cuda/stream_access.h"
#endif

#include <stdio.h>
#include <stdlib.h>
#include <string.h>

static struct node_seq *node_seq_find(node *n, uint64_t id) {
    for (int32_t i = 0; i < n->n_seqs; i++)
        if (n->seqs[i].id == id) return &n->seqs[i];
    return NULL;
}

static struct node_seq *node_seq_get(node *n, uint64_t id) {
    struct node_seq *q = node_seq_find(n, id);
    if (q) return q;
    if (n->n_seqs == n->cap_seqs) {
        int32_t cap = n->cap_seqs ? n->cap_seqs * 2 : 64;
        struct node_seq *t = realloc(n->seqs, (size_t)cap * sizeof *t);
        if (!t) return NULL;
        n->seqs = t;
        n->cap_seqs = cap;
    }
    q = &n->seqs[n->n_seqs++];
    memset(q, 0, sizeof *q);
    q->id = id;
    constrain_seq_invalidate(&q->cs);
    draft_seq_init(&q->ds);
    return q;
}

/* Moves a block's reference count; kv_used counts blocks with any.  Ids
 * outside the cache (a plan the batch check refuses) are not counted. */
static void node_kv_ref(node *n, int32_t id, int32_t delta) {
    if (!n->kv_refs || id < 0 || (uint32_t)id >= atomic_load(&n->kv_blocks_total)) return;
    int32_t was = n->kv_refs[id];
    n->kv_refs[id] = was + delta;
    if (was == 0 && delta > 0) n->kv_used++;
    else if (was > 0 && was + delta == 0) n->kv_used--;
}

/* The sequence's block table becomes the plan's.  STATUS_NO_MEMORY leaves
 * the old one. */
static int node_seq_table_set(node *n, struct node_seq *q, const uint32_t *ids, size_t n_ids) {
    if (n_ids > (size_t)q->cap_table) {
        int32_t *t = realloc(q->table, n_ids * sizeof *t);
        if (!t) return STATUS_NO_MEMORY;
        q->table = t;
        q->cap_table = (int32_t)n_ids;
    }
    /* References to the new blocks first: a block in both tables never
     * passes through 0. */
    for (size_t j = 0; j < n_ids; j++) node_kv_ref(n, (int32_t)ids[j], +1);
    for (int32_t j = 0; j < q->n_blocks; j++) node_kv_ref(n, q->table[j], -1);
    for (size_t j = 0; j < n_ids; j++) q->table[j] = (int32_t)ids[j];
    q->n_blocks = (int32_t)n_ids;
    return STATUS_OK;
}

static void node_seq_forget(node *n, uint64_t id) {
    struct node_seq *q = node_seq_find(n, id);
    if (!q) return;
    for (int32_t j = 0; j < q->n_blocks; j++) node_kv_ref(n, q->table[j], -1);
    free(q->table);
    free(q->hist);
    constrain_seq_clear(n->cons, &q->cs);
    draft_seq_clear(n->dm, &q->ds);
    *q = n->seqs[--n->n_seqs];
}

static void node_kv_used_update(node *n) {
    uint32_t total = atomic_load(&n->kv_blocks_total);
    atomic_store(&n->kv_blocks_used, (uint32_t)n->kv_used > total ? total : (uint32_t)n->kv_used);
}

/* Drops every sequence's state; keeps the array when keep_array. */
static void node_seqs_clear(node *n, int keep_array) {
    for (int32_t i = 0; i < n->n_seqs; i++) {
        free(n->seqs[i].table);
        free(n->seqs[i].hist);
        constrain_seq_clear(n->cons, &n->seqs[i].cs);
        draft_seq_clear(n->dm, &n->seqs[i].ds);
    }
    n->n_seqs = 0;
    if (!keep_array) {
        free(n->seqs);
        n->seqs = NULL;
        n->cap_seqs = 0;
    }
    if (n->kv_refs) memset(n->kv_refs, 0, (size_t)atomic_load(&n->kv_blocks_total) * sizeof *n->kv_refs);
    n->kv_used = 0;
    node_kv_used_update(n);
}

void node_seqs_free(node *n) { node_seqs_clear(n, 0); }

void node_seqs_reset(node *n, const char *why) {
    if (n->n_seqs > 0 || n->kv_used > 0)
        LOG(LL_INFO, "stage %d: forgetting %d sequences holding %d KV blocks: %s", n->stage_index,
            n->n_seqs, n->kv_used, why);
    node_seqs_clear(n, 1);
}

static int node_hist_append(struct node_seq *q, const int32_t *toks, size_t n_toks) {
    if ((size_t)q->n_hist + n_toks > (size_t)INT32_MAX / 2) return STATUS_BAD_INPUT;
    int32_t need = q->n_hist + (int32_t)n_toks;
    if (need > q->cap_hist) {
        int32_t cap = q->cap_hist ? q->cap_hist : 64;
        while (cap < need) cap *= 2;
        int32_t *t = realloc(q->hist, (size_t)cap * sizeof *t);
        if (!t) return STATUS_NO_MEMORY;
        q->hist = t;
        q->cap_hist = cap;
    }
    memcpy(q->hist + q->n_hist, toks, n_toks * sizeof *toks);
    q->n_hist = need;
    return STATUS_OK;
}

/* The last stage's history of a sequence after this step's tokens ran:
 * positions 0..start_pos-1 as known (reset at position 0, rolled back if
 * the router went back, or replaced by penalty_context when the sequence
 * starts on a prefix this worker has not seen), then the step's tokens. */
static int node_hist_update(struct node_seq *q, const Llm__SeqPlan *sp) {
    int32_t pos = (int32_t)sp->start_pos;
    /* Anything but an append may change tokens the constraint's state has
     * taken: it is rebuilt from the history (worker/constrain.h). */
    if (q->n_hist != pos || pos == 0) constrain_seq_invalidate(&q->cs);
    if (pos == 0) {
        q->n_hist = 0;
        q->hist_whole = 1;
    } else if (q->n_hist != pos) {
        if (sp->n_penalty_context > 0) {
            q->n_hist = 0;
            q->hist_whole = sp->n_penalty_context == (size_t)pos;
            int rc = node_hist_append(q, sp->penalty_context, sp->n_penalty_context);
            if (rc != STATUS_OK) return rc;
        } else if (q->n_hist > pos) {
            q->n_hist = pos;
        } else {
            q->hist_whole = 0;
            LOG(LL_DEBUG, "seq %llu: history has %d tokens before position %d; penalties see "
                "only those", (unsigned long long)sp->seq_id, q->n_hist, pos);
        }
    }
    return node_hist_append(q, sp->tokens, sp->n_tokens);
}

/* ---- one step ----------------------------------------------------------- */

/* Checks the plan's sequences and lays out the forward batch.  Returns 0,
 * or STATUS_BAD_INPUT with err naming the sequence and the field. */
static int node_batch_build(node *n, const Llm__StepPlan *p, int32_t *n_tokens, char *err,
                            size_t errlen) {
    if (p->n_seqs == 0) {
        snprintf(err, errlen, "step %llu has no sequences", (unsigned long long)p->step_id);
        return STATUS_BAD_INPUT;
    }
    if (p->n_seqs > (size_t)n->n_seqs_max) {
        snprintf(err, errlen, "step %llu: %zu sequences, this stage takes at most %d per step",
                 (unsigned long long)p->step_id, p->n_seqs, n->n_seqs_max);
        return STATUS_BAD_INPUT;
    }
    int64_t total = 0;
    int last = stage_is_last(n->s);
    for (size_t i = 0; i < p->n_seqs; i++) {
        const Llm__SeqPlan *sp = p->seqs[i];
        unsigned long long id = (unsigned long long)sp->seq_id;
        if (sp->n_tokens == 0) {
            snprintf(err, errlen, "step %llu: seq %llu has no tokens", (unsigned long long)p->step_id, id);
            return STATUS_BAD_INPUT;
        }
        if (sp->n_block_table > (size_t)n->max_blocks) {
            snprintf(err, errlen, "step %llu: seq %llu: block table of %zu blocks, more than the "
                     "%d a sequence of this stage can have", (unsigned long long)p->step_id, id,
                     sp->n_block_table, n->max_blocks);
            return STATUS_BAD_INPUT;
        }
        if (sp->start_pos > (uint32_t)INT32_MAX || sp->n_tokens > (size_t)n->n_tokens_max) {
            snprintf(err, errlen, "step %llu: seq %llu: start_pos %u with %zu tokens is out of "
                     "range (at most %d tokens per step)", (unsigned long long)p->step_id, id,
                     sp->start_pos, sp->n_tokens, n->n_tokens_max);
            return STATUS_BAD_INPUT;
        }
        int32_t *table = n->tables + i * (size_t)n->max_blocks;
        for (size_t j = 0; j < sp->n_block_table; j++) {
            if (sp->block_table[j] > (uint32_t)INT32_MAX) {
                snprintf(err, errlen, "step %llu: seq %llu: block_table[%zu] = %u is out of range",
                         (unsigned long long)p->step_id, id, j, sp->block_table[j]);
                return STATUS_BAD_INPUT;
            }
            table[j] = (int32_t)sp->block_table[j];
        }
        struct forward_seq *f = &n->fseqs[i];
        f->tokens = sp->tokens;
        f->n_tokens = (int32_t)sp->n_tokens;
        f->pos0 = (int32_t)sp->start_pos;
        f->block_table = table;
        f->n_blocks = (int32_t)sp->n_block_table;
        f->logits = last && sp->want_logits ? FORWARD_LOGITS_LAST : FORWARD_LOGITS_NONE;
        /* Verified rows want every row's logits; the stages before the
         * last mark them so too, which gives their forward.c the shape of
         * a verifying step (its graphs). */
        if (sp->want_logits && sp->n_draft > 0) f->logits = FORWARD_LOGITS_ALL;
        total += f->n_tokens;
        n->seq_err[i][0] = 0;
        n->seq_status[i] = 0;
        if (sp->n_draft > 0 && (sp->n_draft >= sp->n_tokens || !sp->want_logits)) {
            snprintf(err, errlen, "step %llu: seq %llu: n_draft %u with %zu tokens%s (the drafts "
                     "follow one accepted token and are verified)", (unsigned long long)p->step_id,
                     id, sp->n_draft, sp->n_tokens, sp->want_logits ? "" : " and no logits");
            return STATUS_BAD_INPUT;
        }
        if (last && sp->want_logits) {
            char why[200];
            if (proto_sampling_check(sp->sampling, n->n_vocab, &n->params[i], why, sizeof why) < 0)
                snprintf(n->seq_err[i], sizeof n->seq_err[i], "seq %llu: %s", id, why);
            else if (sp->n_draft > 0 && sp->sampling &&
                     sp->sampling->constraint_case != LLM__SAMPLING_PARAMS__CONSTRAINT__NOT_SET &&
                     !(sp->sampling->constraint_case == LLM__SAMPLING_PARAMS__CONSTRAINT_JSON_OBJECT &&
                       !sp->sampling->json_object)) {
                /* The masks follow one parse state per sequence: verifying
                 * drafts would need one per drafted position. */
                snprintf(n->seq_err[i], sizeof n->seq_err[i], "seq %llu: drafted tokens with a "
                         "constraint are not supported (the router does not speculate constrained "
                         "requests)", id);
                n->seq_status[i] = STATUS_UNSUPPORTED;
            }
        }
    }
    if (total > n->n_tokens_max) {
        snprintf(err, errlen, "step %llu: %lld tokens, this stage takes at most %d per step",
                 (unsigned long long)p->step_id, (long long)total, n->n_tokens_max);
        return STATUS_BAD_INPUT;
    }
    *n_tokens = (int32_t)total;
    return STATUS_OK;
}

static int node_copies_run(node *n, const Llm__StepPlan *p, char *err, size_t errlen) {
    if (p->n_copies == 0) return STATUS_OK;
    if (p->n_copies > (size_t)n->cap_copies) {
        struct kvblocks_copy *c = realloc(n->copies, p->n_copies * sizeof *c);
        if (!c) {
            snprintf(err, errlen, "out of memory for %zu block copies", p->n_copies);
            return STATUS_NO_MEMORY;
        }
        n->copies = c;
        n->cap_copies = (int32_t)p->n_copies;
    }
    for (size_t i = 0; i < p->n_copies; i++) {
        if (p->copies[i]->src > (uint32_t)INT32_MAX || p->copies[i]->dst > (uint32_t)INT32_MAX) {
            snprintf(err, errlen, "copies[%zu]: block %u -> %u is out of range", i,
                     p->copies[i]->src, p->copies[i]->dst);
            return STATUS_BAD_INPUT;
        }
        n->copies[i].src = (int32_t)p->copies[i]->src;
        n->copies[i].dst = (int32_t)p->copies[i]->dst;
    }
    return kvcache_copy_blocks(stage_kvcache(n->s), n->copies, (int32_t)p->n_copies, err, errlen);
}

/* Packs and hands a StepResult to the io thread. */
static void node_result_send(node *n, const Llm__StepPlan *p, Llm__SeqResult **seqs, size_t n_seqs,
                             Llm__Error *error, int64_t t0_us) {
    Llm__StepResult r = LLM__STEP_RESULT__INIT;
    r.step_id = p->step_id;
    r.pipeline_id = p->pipeline_id;
    r.epoch = p->epoch;
    r.worker_id = n->s_worker_id;
    r.stage_index = (uint32_t)n->stage_index;
    r.n_seqs = n_seqs;
    r.seqs = seqs;
    r.error = error;
    r.compute_us = (uint64_t)(node_now_us() - t0_us);
    Llm__WorkerEnvelope env = LLM__WORKER_ENVELOPE__INIT;
    env.body_case = LLM__WORKER_ENVELOPE__BODY_RESULT;
    env.result = &r;
    uint8_t *buf;
    size_t len;
    char err[256];
    if (proto_worker_pack(&env, &buf, &len, err, sizeof err) < 0) {
        LOG(LL_ERROR, "step %llu: cannot pack the result: %s", (unsigned long long)p->step_id, err);
        return;
    }
    const char type = NODE_MSG_RESULT;
    struct zio_frame f[2] = {{&type, 1, NULL, NULL}, {buf, len, proto_buf_free, NULL}};
    if (zio_send(n->pipe_compute, f, 2, 0) < 0)
        LOG(LL_ERROR, "step %llu: %s", (unsigned long long)p->step_id, zio_errstr(n->pipe_compute));
}

static void node_step_fail(node *n, const Llm__StepPlan *p, int rc, const char *why, int64_t t0) {
    Llm__Error e;
    Llm__Error__Code code = proto_code_from_status(rc);
    proto_error_init(&e, code, "", why, 0);
    LOG(LL_WARN, "pipeline %u stage %d: step %llu failed (%s): %s", p->pipeline_id, n->stage_index,
        (unsigned long long)p->step_id, proto_code_name(code), why);
    node_result_send(n, p, NULL, 0, &e, t0);
}

/* A constrained sequence's row: its parse state brought over the tokens it
 * generated so far (hist from output_start), and a mask row for
 * node_masks_compute.  A failure is the sequence's (seq_err): it is never
 * sampled unconstrained. */
static void node_constrain_prepare(node *n, const Llm__StepPlan *p, size_t i, struct node_seq *q,
                                   struct backend_sample_row *r) {
    const Llm__SeqPlan *sp = p->seqs[i];
    char why[224] = "";
    int rc = constrain_seq_set(n->cons, &q->cs, sp->sampling, why, sizeof why);
    if (rc == STATUS_OK && !q->cs.g) return;
    if (rc == STATUS_OK && !q->hist_whole) {
        rc = STATUS_UNAVAILABLE;
        snprintf(why, sizeof why, "its tokens before position %u are not known to this stage; the "
                 "constraint cannot be applied", sp->start_pos);
    } else if (rc == STATUS_OK && sp->output_start > (uint32_t)q->n_hist) {
        rc = STATUS_BAD_INPUT;
        snprintf(why, sizeof why, "output_start %u is past its %d tokens", sp->output_start, q->n_hist);
    }
    if (rc == STATUS_OK) {
        int32_t n_out = q->n_hist - (int32_t)sp->output_start;
        /* a rebuild (not a new sequence's start) is what the metric counts */
        bool replay = n_out > 0 && (q->cs.n_done < 0 || q->cs.n_done > n_out);
        rc = constrain_seq_advance(n->cons, &q->cs, q->hist + sp->output_start, n_out, why, sizeof why);
        if (replay) node_metrics_constrain_replay(n->metrics, (uint64_t)n_out);
    }
    size_t words = constrain_mask_words(n->cons);
    if (rc == STATUS_OK && !n->masks) {
        n->masks = malloc((size_t)n->n_seqs_max * words * sizeof *n->masks);
        n->mask_seq = malloc((size_t)n->n_seqs_max * sizeof *n->mask_seq);
        if (!n->masks || !n->mask_seq) {
            free(n->masks), free(n->mask_seq);
            n->masks = NULL, n->mask_seq = NULL;
            rc = STATUS_NO_MEMORY;
            snprintf(why, sizeof why, "out of memory for the grammar masks");
        }
    }
    if (rc != STATUS_OK) {
        snprintf(n->seq_err[i], sizeof n->seq_err[i], "seq %llu: %s", (unsigned long long)sp->seq_id, why);
        n->seq_status[i] = rc;
        return;
    }
    int32_t k = n->n_masks++;
    n->mask_seq[k] = (int32_t)i;
    r->allow = n->masks + (size_t)k * words;
}

struct node_masks_arg {
    node *n;
    const Llm__StepPlan *p;
};

/* forward_out.before_sample: the masks of the step's constrained rows,
 * while the device (if any) runs the step.  A mask that cannot be computed
 * stays empty (the row then fails to sample) and names the sequence. */
static void node_masks_compute(void *arg) {
    const struct node_masks_arg *a = arg;
    node *n = a->n;
    size_t words = constrain_mask_words(n->cons);
    for (int32_t k = 0; k < n->n_masks; k++) {
        int32_t i = n->mask_seq[k];
        const Llm__SeqPlan *sp = a->p->seqs[i];
        struct node_seq *q = node_seq_find(n, sp->seq_id);
        uint64_t *mask = n->masks + (size_t)k * words;
        int64_t t0 = node_now_us();
        int rc = q ? constrain_seq_mask(n->cons, &q->cs, mask) : STATUS_INTERNAL;
        node_metrics_constrain_mask(n->metrics, (double)(node_now_us() - t0) / 1e6);
        if (rc != STATUS_OK) {
            memset(mask, 0, words * sizeof *mask);
            snprintf(n->seq_err[i], sizeof n->seq_err[i], "seq %llu: its grammar's tables are full",
                     (unsigned long long)sp->seq_id);
            n->seq_status[i] = rc;
        }
    }
}

/* Last stage, before the forward pass: each sequence's history takes the
 * step's tokens (the penalties see the prompt and every token so far; a
 * step that fails is corrected by the next plan's start_pos) and each
 * logits row gets its sampling request for forward_step.  A sequence with
 * an error still has a row (greedy, its result unused). */
static void node_sample_prepare(node *n, const Llm__StepPlan *p) {
    static const struct sampling_params greedy; /* all zero: argmax */
    int32_t row = 0;
    n->n_masks = 0;
    for (size_t i = 0; i < p->n_seqs; i++) {
        const Llm__SeqPlan *sp = p->seqs[i];
        struct node_seq *q = node_seq_get(n, sp->seq_id);
        if (q && !n->seq_err[i][0] && node_hist_update(q, sp) != STATUS_OK)
            snprintf(n->seq_err[i], sizeof n->seq_err[i], "seq %llu: out of memory for its token history",
                     (unsigned long long)sp->seq_id);
        if (!sp->want_logits) continue;
        struct backend_sample_row *r = &n->srows[row++];
        memset(r, 0, sizeof *r);
        if (q && !n->seq_err[i][0] && sp->n_draft == 0) node_constrain_prepare(n, p, i, q, r);
        int ok = q && !n->seq_err[i][0];
        r->params = ok ? &n->params[i] : &greedy;
        r->history = ok ? q->hist : NULL;
        r->n_history = ok ? q->n_hist : 0;
        r->pos = (int64_t)sp->start_pos + (int64_t)sp->n_tokens;
        if (sp->n_draft > 0) {
            /* Speculation: a row after each of the k + 1 tokens, each
             * sampled as a decode at its position would be (its history
             * ends with the token it follows; its draw is the one of
             * (seed, position)), so the tokens accepted are those the
             * sequence would have produced without drafts. */
            int32_t n_rows = (int32_t)sp->n_tokens;
            int32_t hist0 = ok ? q->n_hist - n_rows : 0;
            row--;
            for (int32_t j = 0; j < n_rows; j++) {
                r = &n->srows[row++];
                memset(r, 0, sizeof *r);
                r->params = ok ? &n->params[i] : &greedy;
                r->history = ok ? q->hist : NULL;
                r->n_history = ok ? hist0 + j + 1 : 0;
                r->pos = (int64_t)sp->start_pos + j + 1;
            }
        }
    }
}

/* The SeqResult's logprob for the token sampled in row r (rows r are
 * res_lp's too), or NULL when p does not ask for them. */
static Llm__TokenLogprob *node_result_logprob(node *n, const struct sampling_params *p, int32_t r) {
    if (!p->logprobs && p->top_logprobs <= 0) return NULL;
    const struct sampling_result *sr = &n->srows[r].result;
    Llm__TokenLogprob *lp = &n->res_lp[r];
    llm__token_logprob__init(lp);
    lp->token = sr->token;
    lp->logprob = sr->logprob;
    for (int32_t k = 0; k < sr->n_top; k++) {
        llm__top_logprob__init(&n->res_top[r][k]);
        n->res_top[r][k].token = sr->top_token[k];
        n->res_top[r][k].logprob = sr->top_logprob[k];
        n->res_top_ptr[r][k] = &n->res_top[r][k];
    }
    lp->n_top = (size_t)sr->n_top;
    lp->top = n->res_top_ptr[r];
    return lp;
}

/* Draft-model speculation (docs/router.md, "Speculation"): for each
 * sequence the plan asks it of (draft_k), the draft model's guesses of the
 * tokens after the one answered, put in SeqResult.draft_tokens for the
 * router's next plan of it.  The draft follows the sequence's accepted
 * tokens: its history up to the last accepted position, then the token
 * answered.  A sequence it cannot draft for (a history with gaps, a
 * constraint, the pool or the context short) gets none: it decodes one
 * token a step. */
static void node_step_draft(node *n, const Llm__StepPlan *p) {
    int32_t nr = 0;
    for (size_t i = 0; i < p->n_seqs; i++) {
        const Llm__SeqPlan *sp = p->seqs[i];
        Llm__SeqResult *r = &n->res[i];
        if (sp->draft_k == 0 || !sp->want_logits || r->error || r->token < 0) continue;
        if (sp->sampling && sp->sampling->constraint_case != LLM__SAMPLING_PARAMS__CONSTRAINT__NOT_SET)
            continue;
        struct node_seq *q = node_seq_find(n, sp->seq_id);
        /* The accepted positions: the plan's first token and the drafts
         * accepted (a plain step: all its tokens). */
        int64_t h = (int64_t)sp->start_pos + (int64_t)sp->n_tokens - sp->n_draft + (int64_t)r->n_next_tokens;
        if (!q || !q->hist_whole || h > q->n_hist) continue;
        int32_t t_new = r->n_next_tokens ? r->next_tokens[r->n_next_tokens - 1] : r->token;
        q->n_hist = (int32_t)h; /* the rejected drafts are gone; the next plan starts here */
        if (node_hist_append(q, &t_new, 1) != STATUS_OK) continue;
        struct draft_req *dr = &n->dreqs[nr++];
        dr->ds = &q->ds;
        dr->tokens = q->hist;
        dr->n_tokens = q->n_hist;
        dr->params = &n->params[i];
        dr->k = sp->draft_k < NODE_DRAFT_MAX ? (int32_t)sp->draft_k : NODE_DRAFT_MAX;
        dr->out = n->res_draft + i * NODE_DRAFT_MAX;
        dr->tag = (int32_t)i;
        q->n_hist--; /* t_new stays past the end: the next plan brings it */
    }
    if (nr == 0) return;
    int64_t t0 = node_now_us();
    char err[512];
    int rc = draft_propose(n->dm, n->dreqs, nr, err, sizeof err);
    if (rc != STATUS_OK) {
        LOG(LL_WARN, "step %llu: %s: no drafts this step", (unsigned long long)p->step_id, err);
        return;
    }
    int64_t total = 0;
    for (int32_t j = 0; j < nr; j++) {
        Llm__SeqResult *r = &n->res[n->dreqs[j].tag];
        r->n_draft_tokens = (size_t)n->dreqs[j].n_out;
        r->draft_tokens = n->dreqs[j].out;
        total += n->dreqs[j].n_out;
    }
    LOG(LL_DEBUG, "step %llu: draft model: %lld guesses for %d sequences in %lld us",
        (unsigned long long)p->step_id, (long long)total, nr, (long long)(node_now_us() - t0));
}

/* Sends the StepResult: each sequence's token as forward_step sampled it;
 * for a speculative sequence, the drafts accepted and the token after them
 * (SeqResult.next_tokens). */
static void node_step_sample(node *n, const Llm__StepPlan *p, int64_t t0) {
    size_t ns = p->n_seqs; /* <= n_seqs_max: node_batch_build checked */
    Llm__SeqResult *res = n->res, **resp = n->res_ptr;
    Llm__Error *errs = n->res_err;
    int32_t row = 0;
    for (size_t i = 0; i < ns; i++) {
        const Llm__SeqPlan *sp = p->seqs[i];
        llm__seq_result__init(&res[i]);
        resp[i] = &res[i];
        res[i].seq_id = sp->seq_id;
        res[i].token = -1;
        if (!sp->want_logits) continue;
        int32_t r0 = row, n_rows = sp->n_draft > 0 ? (int32_t)sp->n_tokens : 1;
        row += n_rows;
        if (n->seq_err[i][0]) {
            Llm__Error__Code code = n->seq_status[i] < 0 ? proto_code_from_status(n->seq_status[i])
                                                         : LLM__ERROR__CODE__INVALID_ARGUMENT;
            proto_error_init(&errs[i], code, "", n->seq_err[i], 0);
            res[i].error = &errs[i];
            continue;
        }
        /* Rows past the first rejected draft are not looked at: a failure
         * there is not the sequence's. */
        int32_t n_emit = 0, bad = -1;
        for (int32_t j = 0; j < n_rows; j++) {
            const struct backend_sample_row *r = &n->srows[r0 + j];
            if (r->status < 0) {
                bad = r0 + j;
                break;
            }
            n_emit++;
            if (j + 1 < n_rows && r->result.token != sp->tokens[j + 1]) break; /* draft j rejected */
        }
        if (bad >= 0 && n_emit == 0) {
            const struct backend_sample_row *r = &n->srows[bad];
            snprintf(n->seq_err[i], sizeof n->seq_err[i], "seq %llu at position %lld: %s",
                     (unsigned long long)sp->seq_id, (long long)r->pos, r->err);
            proto_error_init(&errs[i], proto_code_from_status(r->status), "", n->seq_err[i], 0);
            res[i].error = &errs[i];
            continue;
        }
        /* bad >= 0 past row 0: the rows before it are emitted; the last
         * of them (an accepted draft) becomes the sequence's next input,
         * its position computed again by the next step. */
        const struct backend_sample_row *r = &n->srows[r0];
        const struct sampling_result *sr = &r->result;
        if (r->allow && !constrain_mask_allows(r->allow, sr->token)) {
            /* cannot happen: the sampler never draws a -inf logit */
            snprintf(n->seq_err[i], sizeof n->seq_err[i], "seq %llu at position %lld: token %d was "
                     "sampled outside its grammar's mask", (unsigned long long)sp->seq_id,
                     (long long)r->pos, sr->token);
            proto_error_init(&errs[i], LLM__ERROR__CODE__INTERNAL, "", n->seq_err[i], 0);
            res[i].error = &errs[i];
            continue;
        }
        res[i].token = sr->token;
        res[i].logprob = node_result_logprob(n, &n->params[i], r0);
        if (n_emit > 1) {
            for (int32_t j = 1; j < n_emit; j++) {
                n->res_next[r0 + j] = n->srows[r0 + j].result.token;
                n->res_lp_ptr[r0 + j] = node_result_logprob(n, &n->params[i], r0 + j);
            }
            res[i].n_next_tokens = (size_t)(n_emit - 1);
            res[i].next_tokens = &n->res_next[r0 + 1];
            if (res[i].logprob) {
                res[i].n_next_logprobs = (size_t)(n_emit - 1);
                res[i].next_logprobs = &n->res_lp_ptr[r0 + 1];
            }
        }
    }
    if (n->dm) node_step_draft(n, p);
    node_result_send(n, p, resp, ns, NULL, t0);
}

/* Executes one plan: frees, copies, input, forward, output. */
/* received_us: when the io thread took the plan from the router. */
static void node_step(node *n, const Llm__StepPlan *p, int64_t received_us) {
    int64_t t0 = node_now_us();
    char err[640] = "";
    if (p->epoch < n->epoch) {
        LOG(LL_DEBUG, "step %llu of epoch %llu dropped: the pipeline is at epoch %llu",
            (unsigned long long)p->step_id, (unsigned long long)p->epoch,
            (unsigned long long)n->epoch);
        return;
    }
    /* The router re-formed the pipeline and its placement is queued behind
     * this plan (the io thread has handed it on): the step will never
     * count, and the other stages drop it too, so waiting on the links for
     * it would only delay the new epoch. */
    uint64_t placed = atomic_load(&n->placement_epoch);
    if (p->epoch < placed) {
        LOG(LL_DEBUG, "step %llu of epoch %llu dropped: a placement of epoch %llu follows it",
            (unsigned long long)p->step_id, (unsigned long long)p->epoch, (unsigned long long)placed);
        return;
    }
    if (p->pipeline_id != n->pipeline_id) {
        snprintf(err, sizeof err, "step %llu is for pipeline %u; this worker serves pipeline %u",
                 (unsigned long long)p->step_id, p->pipeline_id, n->pipeline_id);
        node_step_fail(n, p, STATUS_BAD_INPUT, err, t0);
        return;
    }
    if (p->epoch > n->epoch) {
        /* The router re-formed the pipeline and its RegisterReply has not
         * reached us: follow the plans, which carry the epoch. */
        LOG(LL_WARN, "step %llu carries epoch %llu, newer than %llu: following it",
            (unsigned long long)p->step_id, (unsigned long long)p->epoch,
            (unsigned long long)n->epoch);
        pthread_mutex_lock(&n->lock); /* the io thread reads the epoch for Register */
        n->epoch = p->epoch;
        pthread_mutex_unlock(&n->lock);
        if (n->rx) link_set_epoch(n->rx, n->epoch);
        if (n->tx) link_set_epoch(n->tx, n->epoch);
        /* The router started the pipeline's scheduler afresh: it plans
         * every sequence again from its start. */
        node_seqs_reset(n, "the router's plans moved to a new epoch");
    }
    for (size_t i = 0; i < p->n_freed_seqs; i++) node_seq_forget(n, p->freed_seqs[i]);
    if (p->n_seqs == 0 && p->n_freed_seqs > 0) {
        /* Only frees (the router sends them so when no step follows): no
         * computation, no link message, no result. */
        node_kv_used_update(n);
        return;
    }

    int first = stage_is_first(n->s), last = stage_is_last(n->s);
    int32_t T = 0;
    struct forward_batch batch = {0};
    int rc = STATUS_OK;
    int upstream_failed = 0;
    if (!n->links_ok) {
        snprintf(err, sizeof err, "stage %d is not linked to its neighbours: %s", n->stage_index,
                 n->links_err);
        rc = STATUS_UNAVAILABLE;
    }
    if (rc == STATUS_OK) rc = node_batch_build(n, p, &T, err, sizeof err);
    if (rc == STATUS_OK) rc = node_copies_run(n, p, err, sizeof err);
    batch.seqs = n->fseqs;
    batch.n_seqs = (int32_t)p->n_seqs;
    struct forward_out out = {NULL, 0, !last && !link_on_device(n->tx) ? n->hidden_out_host : NULL,
                              last ? n->srows : NULL};
    if (rc == STATUS_OK && !first) {
        /* What the step needs before its input, queued ahead of the
         * receive: on a GPU nothing of it then waits behind the input on
         * the stream.  The input is taken even when that failed, so that
         * the link stays in step with the previous stage. */
        char berr[256];
        const int brc = forward_begin(n->s, &batch, &out, berr, sizeof berr);
        rc = node_input_recv(n, p->step_id, T, &batch, err, sizeof err);
        if (rc == LINK_SKIPPED) upstream_failed = 1;
        if (rc == STATUS_OK && brc != STATUS_OK) {
            rc = brc;
            snprintf(err, sizeof err, "%s", berr);
        }
        if (rc != STATUS_OK) forward_cancel(n->s);
    }
    const int64_t t_input = node_now_us();
    int64_t t_queued = t_input;
    if (rc == STATUS_OK) {
        if (last) node_sample_prepare(n, p);
        struct node_masks_arg ma = {n, p};
        forward_set_before_sample(n->s, last && n->n_masks > 0 ? node_masks_compute : NULL, &ma);
        rc = forward_step(n->s, &batch, &out, err, sizeof err);
        forward_set_before_sample(n->s, NULL, NULL);
        t_queued = node_now_us();
        /* Counted before the rows leave: a client holding the step's
         * result (it went on through the next stages) reads them counted. */
        if (rc == STATUS_OK) atomic_fetch_add(&n->tokens_total, (uint64_t)T);
        if (rc == STATUS_OK && !last) rc = node_output_send(n, p->step_id, T, err, sizeof err);
        else if (rc != STATUS_OK && !last) node_skip_send(n, p->step_id, T);
    } else if (!last) {
        node_skip_send(n, p->step_id, T);
    }

    if (rc == STATUS_OK) {
        for (size_t i = 0; i < p->n_seqs; i++) {
            const Llm__SeqPlan *sp = p->seqs[i];
            struct node_seq *q = node_seq_get(n, sp->seq_id);
            if (!q || node_seq_table_set(n, q, sp->block_table, sp->n_block_table) != STATUS_OK)
                LOG(LL_WARN, "step %llu: seq %llu: out of memory for its block table: the stage's "
                    "KV view misses it", (unsigned long long)p->step_id,
                    (unsigned long long)sp->seq_id);
        }
    }
    node_kv_used_update(n);
    atomic_fetch_add(&n->steps_total, 1);
    atomic_store(&n->last_step_id, p->step_id);

    if (upstream_failed) {
        if (last) {
            Llm__Error e;
            proto_error_init(&e, LLM__ERROR__CODE__ABORTED, "",
                             "the step failed at an earlier stage of the pipeline", 0);
            node_result_send(n, p, NULL, 0, &e, t0);
        }
    } else if (rc != STATUS_OK) {
        node_step_fail(n, p, rc, err, t0);
    } else if (last) {
        node_step_sample(n, p, t0);
    }
    /* The last stage's step ends with its result sent: after the draft
     * model's passes, which the next plan waits for as it waits for the
     * sampled tokens. */
    const int64_t t_done = node_now_us();
    node_metrics_step(n->metrics, n->stage_index, (double)(t_done - t0) / 1e6);
    /* One line a step at debug level, in the host's monotonic clock (the
     * router's step line uses it too; scripts/step-timeline.py joins them):
     * when the io thread and this thread took the plan, and, from this
     * thread's start, when the input was asked for (on a GPU link, the
     * receive launched), the forward pass launched and the output or
     * result sent. */
    LOG(LL_DEBUG, "step %llu timeline: stage %d, %d tokens, received %lld us, start %lld us, input +%lld, "
        "queued +%lld, done +%lld", (unsigned long long)p->step_id, n->stage_index, (int)T, (long long)received_us,
        (long long)t0, (long long)(t_input - t0), (long long)(t_queued - t0), (long long)(t_done - t0));
}

/* ---- the compute thread ---------------------------------------------------- */

void *node_compute_main(void *arg) {
    node *n = arg;
    struct zio_parts in = {0};
#if defined(LLM_HAVE_CUDA)
    /* CUDA's current device is per thread: this one must use the backend's. */
    if (backend_is_gpu(n->b)) {
        char err[256];
        if (nccl_link_set_device(backend_cuda_device(n->b), err, sizeof err) < 0)
            LOG(LL_ERROR, "compute thread: %s", err);
    }
#endif
    for (;;) {
        /* Between steps: an idle wait lasts 1 s, a step as long as it runs. */
        watchdog_beat(n->cfg.watchdog, 1);
        int rc = zio_recv(n->pipe_compute, &in, 1000);
        if (rc == STATUS_TIMEOUT || rc == STATUS_CANCELLED) continue;
        if (rc < 0) {
            LOG(LL_ERROR, "compute: %s", zio_errstr(n->pipe_compute));
            break;
        }
        if (in.n < 1 || zio_parts_size(&in, 0) != 1) continue;
        char type = *(const char *)zio_parts_data(&in, 0);
        if (type == NODE_MSG_DRAIN) break;
        /* A placement carries its router session as a third frame, a plan
         * the time the io thread took it. */
        const size_t third =
            type == NODE_MSG_PLACEMENT ? sizeof(uint32_t) : type == NODE_MSG_PLAN ? sizeof(int64_t) : 0;
        if (in.n != (third ? 3u : 2u) || (third && zio_parts_size(&in, 2) != third)) continue;
        Llm__WorkerEnvelope *env = NULL;
        char err[256];
        /* The io thread checked the frame already; this cannot fail unless memory runs out. */
        if (proto_worker_unpack(zio_parts_data(&in, 1), zio_parts_size(&in, 1), &env, err,
                                sizeof err) < 0) {
            LOG(LL_ERROR, "compute: %s", err);
            continue;
        }
        if (type == NODE_MSG_PLAN && env->body_case == LLM__WORKER_ENVELOPE__BODY_PLAN) {
            int64_t received_us;
            memcpy(&received_us, zio_parts_data(&in, 2), sizeof received_us);
            node_step(n, env->plan, received_us);
        }
        else if (type == NODE_MSG_PLACEMENT && env->body_case == LLM__WORKER_ENVELOPE__BODY_REGISTER_REPLY) {
            uint32_t session;
            memcpy(&session, zio_parts_data(&in, 2), sizeof session);
            node_placement_apply(n, env->register_reply, session);
        }
        proto_worker_free(env);
    }
    zio_parts_free(&in);
    const char done = NODE_MSG_DONE;
    struct zio_frame f = {&done, 1, NULL, NULL};
    zio_send(n->pipe_compute, &f, 1, 0);
    return NULL;
}
