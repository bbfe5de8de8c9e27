/* The draft model beside the last stage: a whole small model on the stage's
 * backend, its own KV pool and tables, and the passes that bring each
 * sequence's cache up to its accepted tokens and draw its guesses. */
#include "draft.h"
#include "forward.h"
#include "stage.h"

#include "common/status.h"
#include "common/tokenizer.h"

#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

struct draft {
    model_file *m; /* the caller's (draft_open) */
    stage *s;
    kvblocks *kv;
    struct draft_config cfg;
    int32_t n_vocab;
    /* Pass scratch, [n_seqs_max]. */
    struct forward_seq *fseqs;
    struct backend_sample_row *rows;
    struct sampling_params *params; /* [n_seqs_max]: a request's own, with logprobs (min_prob) */
    float min_logprob;              /* log(cfg.min_prob); -inf: off */
    int32_t *row_req, *fseq_req, *chunk; /* request of each row / batch entry; its tokens this pass */
};

int draft_vocab_check(const model_file *dm, const model_file *tm, char *err, size_t errlen) {
    const tokenizer *dt = model_file_tokenizer(dm), *tt = model_file_tokenizer(tm);
    if (!dt || !tt) {
        snprintf(err, errlen, "draft %s: %s has no tokenizer to compare with the target %s",
                 model_file_path(dm), !dt ? model_file_path(dm) : model_file_path(tm), model_file_path(tm));
        return STATUS_BAD_INPUT;
    }
    int32_t nd = tokenizer_n_vocab(dt), nt = tokenizer_n_vocab(tt);
    if (nd != nt || model_file_hparams(dm)->n_vocab != model_file_hparams(tm)->n_vocab) {
        snprintf(err, errlen, "draft %s has a vocabulary of %d tokens (%d logits), the target %s "
                 "one of %d (%d logits): a draft must share the target's tokenizer",
                 model_file_path(dm), nd, model_file_hparams(dm)->n_vocab, model_file_path(tm), nt,
                 model_file_hparams(tm)->n_vocab);
        return STATUS_BAD_INPUT;
    }
    char a[256], b[256];
    for (int32_t id = 0; id < nd; id++) {
        int la = tokenizer_token_bytes(dt, id, a, sizeof a);
        int lb = tokenizer_token_bytes(tt, id, b, sizeof b);
        if (la != lb || (la > 0 && memcmp(a, b, (size_t)(la < (int)sizeof a ? la : (int)sizeof a)) != 0) ||
            tokenizer_token_type(dt, id) != tokenizer_token_type(tt, id)) {
            snprintf(err, errlen, "draft %s and target %s (both %d tokens) differ at token %d: "
                     "\"%.*s\" against \"%.*s\"", model_file_path(dm), model_file_path(tm), nd, id,
                     la > 0 ? (la < 64 ? la : 64) : 0, a, lb > 0 ? (lb < 64 ? lb : 64) : 0, b);
            return STATUS_BAD_INPUT;
        }
    }
    return STATUS_OK;
}

void draft_free(draft *d) {
    if (!d) return;
    stage_free(d->s);
    kvblocks_free(d->kv);
    free(d->fseqs);
    free(d->rows);
    free(d->params);
    free(d->row_req);
    free(d->fseq_req);
    free(d->chunk);
    free(d);
}

int draft_open(draft **out, model_file *m, const model_file *target, backend *b, const struct draft_config *cfg,
               char *err, size_t errlen) {
    *out = NULL;
    const char *path = model_file_path(m);
    draft *d = calloc(1, sizeof *d);
    if (!d) {
        snprintf(err, errlen, "draft %s: out of memory", path);
        return STATUS_NO_MEMORY;
    }
    d->cfg = *cfg;
    d->m = m;
    int rc = draft_vocab_check(d->m, target, err, errlen);
    if (rc != STATUS_OK) goto fail;
    d->n_vocab = model_file_hparams(d->m)->n_vocab;
    struct stage_config sc;
    stage_config_default(&sc);
    sc.n_tokens_max = cfg->n_tokens_max;
    sc.n_seqs_max = cfg->n_seqs_max;
    sc.n_ctx_max = cfg->n_ctx_max;
    sc.block_size = cfg->block_size;
    sc.n_blocks = cfg->n_blocks;
    sc.kv_type = cfg->kv_type;
    sc.weight_type = cfg->weight_type;
    char why[400];
    rc = stage_init(&d->s, d->m, b, &sc, why, sizeof why);
    if (rc != STATUS_OK) {
        snprintf(err, errlen, "draft %s: %s", path, why);
        goto fail;
    }
    d->cfg.n_ctx_max = stage_config_get(d->s)->n_ctx_max;
    rc = kvblocks_init(&d->kv, stage_config_get(d->s)->n_blocks, stage_config_get(d->s)->block_size, why,
                       sizeof why);
    if (rc != STATUS_OK) {
        snprintf(err, errlen, "draft %s: %s", path, why);
        goto fail;
    }
    size_t n = (size_t)cfg->n_seqs_max;
    d->fseqs = calloc(n, sizeof *d->fseqs);
    d->rows = calloc(n, sizeof *d->rows);
    d->params = calloc(n, sizeof *d->params);
    d->min_logprob = cfg->min_prob > 0 ? logf(cfg->min_prob) : -INFINITY;
    d->row_req = calloc(n, sizeof *d->row_req);
    d->fseq_req = calloc(n, sizeof *d->fseq_req);
    d->chunk = calloc(n, sizeof *d->chunk);
    if (!d->fseqs || !d->rows || !d->params || !d->row_req || !d->fseq_req || !d->chunk) {
        snprintf(err, errlen, "draft %s: out of memory", path);
        rc = STATUS_NO_MEMORY;
        goto fail;
    }
    *out = d;
    return STATUS_OK;
fail:
    draft_free(d);
    return rc;
}

const char *draft_path(const draft *d) { return model_file_path(d->m); }

void draft_seq_init(struct draft_seq *ds) {
    memset(ds, 0, sizeof *ds);
    kvblocks_table_init(&ds->table);
}

void draft_seq_clear(draft *d, struct draft_seq *ds) {
    if (d) kvblocks_table_free(d->kv, &ds->table);
    else free(ds->table.ids);
    free(ds->tok);
    draft_seq_init(ds);
}

/* The sequence's tokens become r's, and its cache keeps only the prefix it
 * computed from the same tokens; blocks for the positions this round
 * writes (up to the k - 1th guess) are reserved.  0 if it can be drafted. */
static int draft_seq_sync(draft *d, struct draft_req *r) {
    struct draft_seq *ds = r->ds;
    int32_t n = r->n_tokens, k = r->k;
    if (k > d->cfg.n_ctx_max - n) k = d->cfg.n_ctx_max - n; /* guesses stay inside the context */
    r->k = k;
    if (k <= 0 || n <= 0) return -1;
    /* The last token is always fed again (its KV may be there already, from
     * a guess equal to it, but its logits are not). */
    int32_t same = 0, lim = ds->n_kv < n - 1 ? ds->n_kv : n - 1;
    while (same < lim && ds->tok[same] == r->tokens[same]) same++;
    if (n + k > ds->cap) {
        int32_t cap = ds->cap ? ds->cap : 256;
        while (cap < n + k) cap *= 2;
        int32_t *t = realloc(ds->tok, (size_t)cap * sizeof *t);
        if (!t) return -1;
        ds->tok = t;
        ds->cap = cap;
    }
    memcpy(ds->tok + same, r->tokens + same, (size_t)(n - same) * sizeof *ds->tok);
    ds->n_tok = n;
    ds->n_kv = same;
    if (kvblocks_truncate(d->kv, &ds->table, ds->n_kv < ds->table.n_tokens ? ds->n_kv : ds->table.n_tokens) < 0)
        return -1;
    /* Writes go up to position n + k - 2 (the k - 1th guess is the last fed). */
    int32_t need = n + k - 1 - ds->table.n_tokens;
    if (need > 0 && kvblocks_reserve(d->kv, &ds->table, need, NULL, NULL) < 0) {
        /* The pool is short: give this sequence's blocks back for the others. */
        kvblocks_table_free(d->kv, &ds->table);
        kvblocks_table_init(&ds->table);
        ds->n_kv = 0;
        return -1;
    }
    return 0;
}

int draft_propose(draft *d, struct draft_req *reqs, int32_t n_reqs, char *err, size_t errlen) {
    int32_t live = 0;
    for (int32_t i = 0; i < n_reqs; i++) {
        reqs[i].n_out = 0;
        if (draft_seq_sync(d, &reqs[i]) == 0) live++;
        else reqs[i].k = 0;
    }
    int32_t n_seqs_max = d->cfg.n_seqs_max, n_tokens_max = d->cfg.n_tokens_max;
    int32_t start = 0; /* round-robin start, so that long catch-ups do not starve others */
    while (live > 0) {
        int32_t nb = 0, nr = 0, budget = n_tokens_max;
        for (int32_t c = 0; c < n_reqs && nb < n_seqs_max && budget > 0; c++) {
            int32_t i = (start + c) % n_reqs;
            struct draft_req *r = &reqs[i];
            if (r->n_out >= r->k) continue;
            struct draft_seq *ds = r->ds;
            int32_t pending = ds->n_tok - ds->n_kv; /* >= 1: the last token is never fed yet */
            int32_t ch = pending < budget ? pending : budget;
            struct forward_seq *f = &d->fseqs[nb];
            f->tokens = ds->tok + ds->n_kv;
            f->n_tokens = ch;
            f->pos0 = ds->n_kv;
            f->block_table = ds->table.ids;
            f->n_blocks = ds->table.n_ids;
            f->logits = ch == pending ? FORWARD_LOGITS_LAST : FORWARD_LOGITS_NONE;
            d->fseq_req[nb] = i;
            d->chunk[nb] = ch;
            if (ch == pending) {
                struct backend_sample_row *row = &d->rows[nr];
                memset(row, 0, sizeof *row);
                row->params = r->params;
                if (d->min_logprob > -INFINITY && i < d->cfg.n_seqs_max) {
                    /* The guess's probability, to stop at an unlikely one;
                     * logprobs change nothing that is drawn. */
                    d->params[i] = *r->params;
                    d->params[i].logprobs = 1;
                    row->params = &d->params[i];
                }
                row->history = ds->tok;
                row->n_history = ds->n_tok;
                row->pos = ds->n_tok; /* the target's draw at this position */
                d->row_req[nr++] = i;
            }
            nb++;
            budget -= ch;
        }
        start = (start + 1) % n_reqs;
        struct forward_batch batch = {0};
        batch.seqs = d->fseqs;
        batch.n_seqs = nb;
        struct forward_out out = {NULL, 0, NULL, d->rows};
        char why[400];
        int rc = forward_step(d->s, &batch, &out, why, sizeof why);
        if (rc != STATUS_OK) {
            snprintf(err, errlen, "draft %s: %s", model_file_path(d->m), why);
            for (int32_t i = 0; i < n_reqs; i++) {
                reqs[i].n_out = 0;
                /* what was written is unknown: compute it all again next time */
                reqs[i].ds->n_kv = 0;
            }
            return rc;
        }
        for (int32_t j = 0; j < nb; j++) reqs[d->fseq_req[j]].ds->n_kv += d->chunk[j];
        for (int32_t j = 0; j < nr; j++) {
            struct draft_req *r = &reqs[d->row_req[j]];
            struct draft_seq *ds = r->ds;
            const struct backend_sample_row *row = &d->rows[j];
            if (row->status < 0 || row->result.token < 0 || row->result.token >= d->n_vocab ||
                (row->params != r->params && row->result.logprob < d->min_logprob)) {
                r->k = r->n_out; /* no more guesses for it */
            } else {
                r->out[r->n_out++] = row->result.token;
                ds->tok[ds->n_tok++] = row->result.token; /* cap >= n + k: draft_seq_sync */
            }
            if (r->n_out >= r->k) live--;
        }
    }
    return STATUS_OK;
}
