/* Token sampling: turns one row of logits into the next token under a
 * request's parameters (penalties, temperature, top-k, top-p, min-p, seed),
 * with optional log-probabilities.  Every random draw is a pure function of
 * (seed, token position), so a request gives the same tokens wherever and
 * whenever it runs — also after it is resumed on another process. */
#ifndef COMMON_SAMPLING_H
#define COMMON_SAMPLING_H

#include <stddef.h>
#include <stdint.h>

#define SAMPLING_STOP_IDS_MAX 32
#define SAMPLING_TOP_LOGPROBS_MAX 20

/* The wire's SamplingParams (proto/types.proto) as a plain struct; the same
 * zero-means-off rules.  All zero (sampling_params_default) is greedy with
 * nothing else on. */
struct sampling_params {
    float temperature;        /* 0 = greedy (argmax); > 0 divides the logits */
    int32_t top_k;            /* 0 = off; larger than n_vocab = off */
    float top_p;              /* 0 or 1 = off; else in (0, 1) */
    float min_p;              /* 0 = off; in [0, 1] */
    float repetition_penalty; /* 0 or 1 = off; llama.cpp rule (see sampler_sample) */
    float presence_penalty;   /* 0 = off; in [-2, 2] */
    float frequency_penalty;  /* 0 = off; in [-2, 2] */
    int32_t penalty_last_n;   /* window of the history the penalties see; 0 = all */
    uint64_t seed;
    int32_t n_stop_token_ids;
    int32_t stop_token_ids[SAMPLING_STOP_IDS_MAX];
    int ignore_eos;           /* for the caller: do not stop at end-of-generation tokens */
    int logprobs;             /* report the chosen token's log-probability */
    int32_t top_logprobs;     /* and this many alternatives (0..SAMPLING_TOP_LOGPROBS_MAX) */
};

void sampling_params_default(struct sampling_params *p);

/* 0 if every field is in range (NaN and infinities are not), else
 * STATUS_BAD_INPUT with err naming the first bad field and its value in the
 * wire's terms ("top_p = 1.5 is outside [0, 1]").  n_vocab > 0 also checks
 * the stop token ids; pass 0 when the vocabulary is not known yet. */
int sampling_params_validate(const struct sampling_params *p, int32_t n_vocab, char *err,
                             size_t errlen);

/* 1 if token is one of p's stop_token_ids.  (End-of-generation tokens are
 * the tokenizer's business: tokenizer_is_eog, unless p->ignore_eos.) */
int sampling_is_stop(const struct sampling_params *p, int32_t token);

/* The uniform draw in [0, 1) for (seed, pos): what sampler_sample uses. */
double sampling_uniform(uint64_t seed, int64_t pos);

struct sampling_result {
    int32_t token;
    int is_stop;  /* sampling_is_stop(p, token) */
    /* Filled when p->logprobs or p->top_logprobs > 0 (else zero):
     * log-softmax over the logits after penalties, before temperature and
     * the top-k/top-p/min-p cuts — the model's view, independent of how
     * the token was drawn. */
    float logprob;
    int32_t n_top;  /* = p->top_logprobs, at most n_vocab */
    int32_t top_token[SAMPLING_TOP_LOGPROBS_MAX];    /* most likely first; ties: lower id */
    float top_logprob[SAMPLING_TOP_LOGPROBS_MAX];
};

/* Scratch for one thread: four n_vocab arrays, allocated here once so
 * that sampling allocates nothing.  Not thread-safe; one per thread. */
typedef struct sampler sampler;

/* On success *out is the caller's, freed with sampler_free.  On failure
 * (n_vocab < 1: STATUS_BAD_INPUT; STATUS_NO_MEMORY) *out is NULL and err
 * says why. */
int sampler_init(sampler **out, int32_t n_vocab, char *err, size_t errlen);
void sampler_free(sampler *s); /* NULL is fine */
int32_t sampler_n_vocab(const sampler *s);

/* Picks the token at position pos (its index in the sequence: prompt length
 * + number of tokens generated before it) from logits[0..n_vocab) (not
 * modified).  history[0..n_history) are the sequence's tokens so far
 * (prompt included), used by the penalties only.  p must have passed
 * sampling_params_validate.  Steps, in order:
 *   1. penalties over the last penalty_last_n history tokens, each distinct
 *      token t once, with c = its count in the window (llama.cpp's rule):
 *      logit > 0 ? logit /= repetition : logit *= repetition, then
 *      logit -= c * frequency + presence;
 *   2. logprobs, when asked (see sampling_result);
 *   3. temperature 0 (or top_k 1): the argmax, lowest id on ties; done;
 *   4. logits / temperature; top-k keeps the k largest; top-p keeps the
 *      smallest most-likely-first prefix of those whose probability
 *      (renormalised over the top-k set) reaches top_p; min-p drops tokens
 *      whose probability is below min_p times the largest;
 *   5. draws from what is left: u = sampling_uniform(seed, pos); walking the
 *      kept tokens in ascending id order (never one whose logit is -inf),
 *      the first whose cumulative weight
 *      exp((logit - max) / temperature) exceeds u times their total.
 *      (Defined this way, the result does not depend on how the cuts are
 *      computed; another implementation can reproduce it.)
 * Returns 0, or STATUS_BAD_INPUT (a history token outside the vocabulary)
 * or STATUS_INTERNAL (a NaN or +inf logit, or every logit -inf) with out
 * zeroed and out->token = -1. */
int sampler_sample(sampler *s, const float *logits, const struct sampling_params *p,
                   const int32_t *history, int32_t n_history, int64_t pos,
                   struct sampling_result *out);

/* Why the last sampler_sample failed ("logit of token 17 is nan"). */
const char *sampler_errstr(const sampler *s);

#endif
