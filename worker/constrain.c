/* Constrained decoding on the last stage: compiled grammars cached by their
 * constraint text, and per-sequence parse states (worker/constrain.h). */
#include "constrain.h"

#include "common/grammar.h"
#include "common/json_schema.h"
#include "common/log.h"
#include "common/status.h"
#include "common/tokenizer.h"

#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

/* Compiled grammars kept while no sequence uses them, most recently used
 * first; older ones are freed.  A grammar's mask cache is bounded too, so
 * the worst case is CONSTRAIN_IDLE_MAX + (sequences in use) grammars of
 * CONSTRAIN_MASK_CACHE_BYTES each. */
#define CONSTRAIN_IDLE_MAX 16
#define CONSTRAIN_MASK_CACHE_BYTES ((size_t)16 << 20)

struct constrain_grammar {
    struct constrain_grammar *prev, *next; /* every compiled one, most recent first */
    char kind;                             /* 's' json_schema, 'o' json_object, 'g' grammar */
    char *text;
    size_t len;
    grammar *g;
    int32_t refs;
};

struct constrain {
    char *model_path;
    int32_t n_vocab;
    size_t words;
    grammar_vocab *v; /* NULL until the first constrained sequence */
    char v_err[256];  /* why the vocabulary could not be built ("": not tried or fine) */
    struct constrain_grammar *all;
    int32_t n_idle;
    uint64_t *tmp; /* [words] a mask over the tokenizer's vocabulary */
    struct constrain_stats st;
};

int constrain_init(constrain **out, const char *model_path, int32_t n_vocab, char *err, size_t errlen) {
    *out = NULL;
    if (n_vocab < 1) return status_fail(err, errlen, STATUS_BAD_INPUT, "constrain: n_vocab %d", n_vocab);
    constrain *c = calloc(1, sizeof *c);
    if (!c || !(c->model_path = strdup(model_path ? model_path : ""))) {
        free(c);
        return status_fail(err, errlen, STATUS_NO_MEMORY, "constrain: out of memory");
    }
    c->n_vocab = n_vocab;
    c->words = ((size_t)n_vocab + 63) / 64;
    *out = c;
    return STATUS_OK;
}

static void constrain_grammar_unlink(constrain *c, struct constrain_grammar *e) {
    if (e->prev) e->prev->next = e->next;
    else c->all = e->next;
    if (e->next) e->next->prev = e->prev;
    e->prev = e->next = NULL;
}

static void constrain_grammar_free(struct constrain_grammar *e) {
    grammar_free(e->g);
    free(e->text);
    free(e);
}

void constrain_free(constrain *c) {
    if (!c) return;
    while (c->all) {
        struct constrain_grammar *e = c->all;
        constrain_grammar_unlink(c, e);
        constrain_grammar_free(e);
    }
    grammar_vocab_free(c->v);
    free(c->tmp);
    free(c->model_path);
    free(c);
}

size_t constrain_mask_words(const constrain *c) { return c->words; }

/* The vocabulary from the model's tokenizer, read once; a failure is
 * remembered (every constrained sequence then fails with it). */
static int constrain_vocab(constrain *c, char *err, size_t errlen) {
    if (c->v) return STATUS_OK;
    if (c->v_err[0]) return status_fail(err, errlen, STATUS_UNSUPPORTED, "%s", c->v_err);
    tokenizer *t = NULL;
    char why[200];
    int rc = tokenizer_load(&t, c->model_path, why, sizeof why);
    if (rc == STATUS_OK) rc = grammar_vocab_from_tokenizer(&c->v, t, why, sizeof why);
    tokenizer_free(t);
    if (rc == STATUS_OK && grammar_vocab_n_vocab(c->v) > c->n_vocab) {
        snprintf(why, sizeof why, "the tokenizer has %d tokens, the model's logits %d",
                 grammar_vocab_n_vocab(c->v), c->n_vocab);
        grammar_vocab_free(c->v);
        c->v = NULL;
        rc = STATUS_UNSUPPORTED;
    }
    if (rc == STATUS_OK && !(c->tmp = calloc(c->words, sizeof *c->tmp))) {
        grammar_vocab_free(c->v);
        c->v = NULL;
        return status_fail(err, errlen, STATUS_NO_MEMORY, "constrain: out of memory");
    }
    if (rc != STATUS_OK) {
        snprintf(c->v_err, sizeof c->v_err, "constrained decoding needs the tokenizer of %s: %s",
                 c->model_path, why);
        LOG(LL_WARN, "%s", c->v_err);
        return status_fail(err, errlen, STATUS_UNSUPPORTED, "%s", c->v_err);
    }
    LOG(LL_INFO, "constrained decoding: vocabulary of %d tokens from %s", grammar_vocab_n_vocab(c->v),
        c->model_path);
    return STATUS_OK;
}

/* m's constraint as (kind, text); 0 when it has none. */
static char constrain_kind(const Llm__SamplingParams *m, const char **text) {
    *text = "";
    if (!m) return 0;
    switch (m->constraint_case) {
    case LLM__SAMPLING_PARAMS__CONSTRAINT_JSON_SCHEMA:
        *text = m->json_schema ? m->json_schema : "";
        return 's';
    case LLM__SAMPLING_PARAMS__CONSTRAINT_JSON_OBJECT:
        return m->json_object ? 'o' : 0;
    case LLM__SAMPLING_PARAMS__CONSTRAINT_GRAMMAR:
        *text = m->grammar ? m->grammar : "";
        return 'g';
    default:
        return 0;
    }
}

static const char *constrain_kind_name(char kind) {
    return kind == 's' ? "json_schema" : kind == 'o' ? "json_object" : "grammar";
}

static int constrain_compile(struct constrain_grammar *e, char *err, size_t errlen) {
    char why[256];
    int rc;
    if (e->kind == 's') {
        char *gbnf = NULL;
        rc = json_schema_to_gbnf(e->text, e->len, &gbnf, why, sizeof why);
        if (rc == STATUS_OK) rc = grammar_parse(&e->g, gbnf, strlen(gbnf), why, sizeof why);
        free(gbnf);
    } else if (e->kind == 'o') {
        const char *gbnf = json_schema_any_object_gbnf();
        rc = grammar_parse(&e->g, gbnf, strlen(gbnf), why, sizeof why);
    } else {
        rc = grammar_parse(&e->g, e->text, e->len, why, sizeof why);
    }
    if (rc != STATUS_OK)
        return status_fail(err, errlen, rc == STATUS_NO_MEMORY ? rc : STATUS_BAD_INPUT, "sampling.%s: %s",
                           constrain_kind_name(e->kind), why);
    struct grammar_limits lim = {.mask_cache_bytes = CONSTRAIN_MASK_CACHE_BYTES};
    grammar_set_limits(e->g, &lim);
    return STATUS_OK;
}

static int constrain_same(const struct constrain_grammar *e, char kind, const char *text, size_t len) {
    return e->kind == kind && e->len == len && memcmp(e->text, text, len) == 0;
}

void constrain_seq_clear(constrain *c, struct constrain_seq *q) {
    struct constrain_grammar *e = q->g;
    q->g = NULL;
    q->n_done = -1;
    if (!e || --e->refs > 0) return;
    c->n_idle++;
    if (c->n_idle <= CONSTRAIN_IDLE_MAX) return;
    /* the least recently used idle one goes */
    struct constrain_grammar *last = NULL;
    for (struct constrain_grammar *x = c->all; x; x = x->next)
        if (x->refs == 0) last = x;
    if (last) {
        constrain_grammar_unlink(c, last);
        constrain_grammar_free(last);
        c->n_idle--;
        c->st.n_cached--;
    }
}

int constrain_seq_set(constrain *c, struct constrain_seq *q, const Llm__SamplingParams *m, char *err,
                      size_t errlen) {
    const char *text;
    char kind = constrain_kind(m, &text);
    size_t len = strlen(text);
    if (q->g && kind && constrain_same(q->g, kind, text, len)) return STATUS_OK;
    constrain_seq_clear(c, q);
    if (!kind) return STATUS_OK;
    int rc = constrain_vocab(c, err, errlen);
    if (rc != STATUS_OK) return rc;
    struct constrain_grammar *e = c->all;
    while (e && !constrain_same(e, kind, text, len)) e = e->next;
    if (e) {
        constrain_grammar_unlink(c, e);
        if (e->refs == 0) c->n_idle--;
    } else {
        e = calloc(1, sizeof *e);
        if (!e || !(e->text = malloc(len + 1))) {
            free(e);
            return status_fail(err, errlen, STATUS_NO_MEMORY, "constrain: out of memory");
        }
        e->kind = kind;
        memcpy(e->text, text, len + 1);
        e->len = len;
        rc = constrain_compile(e, err, errlen);
        if (rc != STATUS_OK) {
            constrain_grammar_free(e);
            return rc;
        }
        c->st.n_compiled++;
        c->st.n_cached++;
    }
    e->next = c->all;
    if (c->all) c->all->prev = e;
    c->all = e;
    e->refs++;
    q->g = e;
    q->n_done = -1;
    return STATUS_OK;
}

/* What a sequence whose grammar filled its tables is told. */
static const char constrain_full[] =
    "grammar tables are full: the grammar is too deep or too ambiguous (at most %d parse stacks a state)";

int constrain_seq_advance(constrain *c, struct constrain_seq *q, const int32_t *out, int32_t n_out,
                          char *err, size_t errlen) {
    if (!q->g) return STATUS_OK;
    grammar *g = q->g->g;
    if (q->n_done < 0 || q->n_done > n_out) {
        int rc = grammar_state_start(g, &q->state);
        if (rc != STATUS_OK) return status_fail(err, errlen, rc, constrain_full, GRAMMAR_STACKS_MAX);
        c->st.n_replayed += n_out;
        q->n_done = 0;
    }
    for (; q->n_done < n_out; q->n_done++) {
        int32_t t = out[q->n_done];
        int rc = grammar_state_accept_token(g, c->v, q->state, t, &q->state);
        if (rc != STATUS_OK) {
            q->n_done = -1;
            return status_fail(err, errlen, rc, constrain_full, GRAMMAR_STACKS_MAX);
        }
        if (q->state == GRAMMAR_STATE_DEAD) {
            int32_t at = q->n_done;
            q->n_done = -1;
            return status_fail(err, errlen, STATUS_BAD_INPUT,
                               "generated token %d (id %d) leaves the %s", at, t,
                               constrain_kind_name(q->g->kind));
        }
    }
    return STATUS_OK;
}

int constrain_seq_mask(constrain *c, const struct constrain_seq *q, uint64_t *mask) {
    struct timespec t0, t1;
    clock_gettime(CLOCK_MONOTONIC, &t0);
    size_t vw = grammar_vocab_mask_words(c->v);
    uint64_t *dst = vw == c->words ? mask : c->tmp;
    int rc = grammar_mask(q->g->g, c->v, q->state, dst);
    if (dst != mask) {
        /* the model's rows are wider: tokens past the tokenizer's never come */
        memset(mask, 0, c->words * sizeof *mask);
        if (rc == STATUS_OK) memcpy(mask, dst, vw * sizeof *mask);
    } else if (rc != STATUS_OK) {
        memset(mask, 0, c->words * sizeof *mask);
    }
    clock_gettime(CLOCK_MONOTONIC, &t1);
    c->st.n_masks++;
    c->st.mask_ns += (int64_t)(t1.tv_sec - t0.tv_sec) * 1000000000 + (t1.tv_nsec - t0.tv_nsec);
    return rc;
}

void constrain_get_stats(const constrain *c, struct constrain_stats *st) { *st = c->st; }
