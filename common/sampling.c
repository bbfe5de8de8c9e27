/* Token sampling with penalties, temperature, top-k, top-p and min-p, drawn
 * from a counter-based hash of (seed, position) so that no RNG state exists
 * to lose when a request moves.  Works in scratch owned by the sampler:
 * nothing is allocated per call.  Cost is a few O(n_vocab) passes (no full
 * sort): about 1 ms per token at n_vocab 128256 with top-p on one core. */
#include "common/sampling.h"

#include <float.h>
#include <math.h>
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "common/status.h"

struct sampler {
    int32_t n_vocab;
    float *z;       /* (n_vocab) penalised logits, then divided by temperature */
    int32_t *idx;   /* (n_vocab) candidate token ids */
    int32_t *count; /* (n_vocab) occurrences in the penalty window; all zero between calls */
    float *w;       /* (n_vocab) weights exp((z - z_max) / temperature) */
    char errstr[160];
};

/* Weight levels of the top-k/top-p prefilter in sampler_sample. */
#define SAMPLING_LEVELS 6

void sampling_params_default(struct sampling_params *p) { memset(p, 0, sizeof *p); }

/* isfinite() plus range; NaN fails every comparison, so test it first. */
static int sampling_in_range(float v, float lo, float hi) {
    return isfinite(v) && v >= lo && v <= hi;
}

int sampling_params_validate(const struct sampling_params *p, int32_t n_vocab, char *err,
                             size_t errlen) {
    const int bad = STATUS_BAD_INPUT;
    if (!isfinite(p->temperature) || p->temperature < 0)
        return status_fail(err, errlen, bad, "temperature = %g must be a finite number >= 0",
                           p->temperature);
    if (p->top_k < 0)
        return status_fail(err, errlen, bad, "top_k = %d must be >= 0 (0 = off)", p->top_k);
    if (!sampling_in_range(p->top_p, 0, 1))
        return status_fail(err, errlen, bad, "top_p = %g is outside [0, 1]", p->top_p);
    if (!sampling_in_range(p->min_p, 0, 1))
        return status_fail(err, errlen, bad, "min_p = %g is outside [0, 1]", p->min_p);
    if (!isfinite(p->repetition_penalty) || p->repetition_penalty < 0)
        return status_fail(err, errlen, bad, "repetition_penalty = %g must be a finite number "
                           ">= 0 (0 or 1 = off)", p->repetition_penalty);
    if (!sampling_in_range(p->presence_penalty, -2, 2))
        return status_fail(err, errlen, bad, "presence_penalty = %g is outside [-2, 2]",
                           p->presence_penalty);
    if (!sampling_in_range(p->frequency_penalty, -2, 2))
        return status_fail(err, errlen, bad, "frequency_penalty = %g is outside [-2, 2]",
                           p->frequency_penalty);
    if (p->penalty_last_n < 0)
        return status_fail(err, errlen, bad, "penalty_last_n = %d must be >= 0 (0 = whole "
                           "sequence)", p->penalty_last_n);
    if (p->n_stop_token_ids < 0 || p->n_stop_token_ids > SAMPLING_STOP_IDS_MAX)
        return status_fail(err, errlen, bad, "stop_token_ids has %d entries, at most %d are "
                           "allowed", p->n_stop_token_ids, SAMPLING_STOP_IDS_MAX);
    for (int32_t i = 0; i < p->n_stop_token_ids; i++) {
        int32_t t = p->stop_token_ids[i];
        if (t < 0 && n_vocab <= 0)
            return status_fail(err, errlen, bad, "stop_token_ids[%d] = %d must be >= 0", i, t);
        if (t < 0 || (n_vocab > 0 && t >= n_vocab))
            return status_fail(err, errlen, bad, "stop_token_ids[%d] = %d is outside the "
                               "vocabulary [0, %d)", i, t, n_vocab);
    }
    if (p->top_logprobs < 0 || p->top_logprobs > SAMPLING_TOP_LOGPROBS_MAX)
        return status_fail(err, errlen, bad, "top_logprobs = %d is outside [0, %d]",
                           p->top_logprobs, SAMPLING_TOP_LOGPROBS_MAX);
    return 0;
}

int sampling_is_stop(const struct sampling_params *p, int32_t token) {
    for (int32_t i = 0; i < p->n_stop_token_ids && i < SAMPLING_STOP_IDS_MAX; i++)
        if (p->stop_token_ids[i] == token) return 1;
    return 0;
}

/* splitmix64's finaliser: a bijection that spreads every input bit. */
static uint64_t sampling_mix(uint64_t x) {
    x = (x ^ (x >> 30)) * 0xbf58476d1ce4e5b9ULL;
    x = (x ^ (x >> 27)) * 0x94d049bb133111ebULL;
    return x ^ (x >> 31);
}

double sampling_uniform(uint64_t seed, int64_t pos) {
    /* Mix the seed alone first, so nearby seeds give unrelated streams, then
     * fold in the position and mix again. */
    uint64_t x = sampling_mix(seed ^ 0x243f6a8885a308d3ULL);
    x = sampling_mix(x ^ ((uint64_t)pos * 0x9e3779b97f4a7c15ULL + 0xd1b54a32d192ed03ULL));
    return (double)(x >> 11) * 0x1p-53;
}

int sampler_init(sampler **out, int32_t n_vocab, char *err, size_t errlen) {
    *out = NULL;
    if (n_vocab < 1)
        return status_fail(err, errlen, STATUS_BAD_INPUT, "sampler: n_vocab = %d must be >= 1",
                           n_vocab);
    sampler *s = calloc(1, sizeof *s);
    if (!s) goto oom;
    s->n_vocab = n_vocab;
    s->z = malloc((size_t)n_vocab * sizeof *s->z);
    s->idx = malloc((size_t)n_vocab * sizeof *s->idx);
    s->count = calloc((size_t)n_vocab, sizeof *s->count);
    s->w = malloc((size_t)n_vocab * sizeof *s->w);
    if (!s->z || !s->idx || !s->count || !s->w) goto oom;
    *out = s;
    return 0;
oom:
    sampler_free(s);
    return status_fail(err, errlen, STATUS_NO_MEMORY, "sampler: out of memory for n_vocab = %d",
                       n_vocab);
}

void sampler_free(sampler *s) {
    if (!s) return;
    free(s->z);
    free(s->idx);
    free(s->count);
    free(s->w);
    free(s);
}

int32_t sampler_n_vocab(const sampler *s) { return s->n_vocab; }

const char *sampler_errstr(const sampler *s) { return s->errstr; }

/* The order every selection uses: larger value first, lower id on ties.
 * A total order, so the result never depends on the algorithm. */
static inline int sampling_before(const float *z, int32_t a, int32_t b) {
    return z[a] > z[b] || (z[a] == z[b] && a < b);
}

/* Rearranges idx[0..n) so that idx[0..k) hold its k first tokens in
 * sampling_before order (themselves unordered).  Quickselect, median of
 * three; O(n) on logits, which are not adversarial. */
static void sampling_select(const float *z, int32_t *idx, int32_t n, int32_t k) {
    int32_t lo = 0, hi = n; /* the k-th boundary lies in [lo, hi) */
    if (k <= 0 || k >= n) return;
    while (hi - lo > 1) {
        int32_t mid = lo + (hi - lo) / 2, a = idx[lo], b = idx[mid], c = idx[hi - 1];
        int32_t piv_at;
        if (sampling_before(z, a, b))
            piv_at = sampling_before(z, b, c) ? mid : (sampling_before(z, a, c) ? hi - 1 : lo);
        else
            piv_at = sampling_before(z, a, c) ? lo : (sampling_before(z, b, c) ? hi - 1 : mid);
        int32_t piv = idx[piv_at];
        idx[piv_at] = idx[hi - 1];
        idx[hi - 1] = piv;
        int32_t store = lo;
        for (int32_t i = lo; i < hi - 1; i++) {
            if (sampling_before(z, idx[i], piv)) {
                int32_t t = idx[i];
                idx[i] = idx[store];
                idx[store++] = t;
            }
        }
        idx[hi - 1] = idx[store];
        idx[store] = piv;
        if (store == k - 1 || store == k) return;
        if (store > k) hi = store;
        else lo = store + 1;
    }
}

/* Like sampling_select, but by probability mass: rearranges idx[0..m) so
 * that its first L tokens (in sampling_before order) are the smallest
 * most-likely-first prefix whose weight w reaches target, and returns L;
 * *last is the L-th token, the least likely one kept.  Expected O(m). */
static int32_t sampling_select_mass(const float *z, const float *w, int32_t *idx, int32_t m,
                                    double target, int32_t *last) {
    /* Invariants: idx[0..lo) come first in order and weigh acc < target;
     * idx[0..hi) weigh >= target (or hi == m). */
    int32_t lo = 0, hi = m;
    double acc = 0;
    while (hi - lo > 1) {
        int32_t mid = lo + (hi - lo) / 2, a = idx[lo], b = idx[mid], c = idx[hi - 1];
        int32_t piv_at;
        if (sampling_before(z, a, b))
            piv_at = sampling_before(z, b, c) ? mid : (sampling_before(z, a, c) ? hi - 1 : lo);
        else
            piv_at = sampling_before(z, a, c) ? lo : (sampling_before(z, b, c) ? hi - 1 : mid);
        int32_t piv = idx[piv_at];
        idx[piv_at] = idx[hi - 1];
        idx[hi - 1] = piv;
        int32_t store = lo;
        double mass = 0;
        for (int32_t i = lo; i < hi - 1; i++) {
            if (sampling_before(z, idx[i], piv)) {
                int32_t t = idx[i];
                mass += w[t];
                idx[i] = idx[store];
                idx[store++] = t;
            }
        }
        idx[hi - 1] = idx[store];
        idx[store] = piv;
        if (acc + mass >= target) {
            hi = store;
            continue;
        }
        acc += mass;
        if (acc + w[piv] >= target) {
            *last = piv;
            return store + 1;
        }
        acc += w[piv];
        lo = store + 1;
    }
    if (hi > lo) {
        *last = idx[lo];
        return lo + 1;
    }
    /* lo == hi: only float rounding gets here; keep idx[0..lo). */
    int32_t l = idx[0];
    for (int32_t i = 1; i < lo; i++)
        if (sampling_before(z, l, idx[i])) l = idx[i];
    *last = l;
    return lo > 0 ? lo : 1;
}

static int sampler_fail(sampler *s, struct sampling_result *out, int rc, const char *fmt, ...)
    __attribute__((format(printf, 4, 5)));
static int sampler_fail(sampler *s, struct sampling_result *out, int rc, const char *fmt, ...) {
    va_list ap;
    va_start(ap, fmt);
    status_vfail(s->errstr, sizeof s->errstr, rc, fmt, ap);
    va_end(ap);
    memset(out, 0, sizeof *out);
    out->token = -1;
    return rc;
}

/* Step 1 of sampler_sample. */
static int sampler_penalize(sampler *s, const struct sampling_params *p, const int32_t *history,
                            int32_t n_history, struct sampling_result *out) {
    float rep = p->repetition_penalty;
    int use_rep = rep != 0 && rep != 1;
    if (!use_rep && p->presence_penalty == 0 && p->frequency_penalty == 0) return 0;
    int32_t start = 0;
    if (p->penalty_last_n > 0 && p->penalty_last_n < n_history)
        start = n_history - p->penalty_last_n;
    for (int32_t i = start; i < n_history; i++)
        if (history[i] < 0 || history[i] >= s->n_vocab)
            return sampler_fail(s, out, STATUS_BAD_INPUT,
                                "history[%d] = %d is outside the vocabulary [0, %d)", i,
                                history[i], s->n_vocab);
    for (int32_t i = start; i < n_history; i++) s->count[history[i]]++;
    /* Each distinct token once; clearing its count as we go leaves the
     * array zero for the next call. */
    for (int32_t i = start; i < n_history; i++) {
        int32_t t = history[i], c = s->count[t];
        if (c == 0) continue;
        s->count[t] = 0;
        float v = s->z[t];
        if (use_rep) v = v > 0 ? v / rep : v * rep;
        v -= (float)c * p->frequency_penalty + p->presence_penalty;
        /* A tiny repetition penalty can overflow a large logit; +inf would
         * turn the weights into NaN. */
        s->z[t] = v > FLT_MAX ? FLT_MAX : v;
    }
    return 0;
}

/* Step 2: log-softmax of the penalised logits, for the chosen token (filled
 * in later) and the top n. */
static double sampler_logsumexp(const sampler *s) {
    const float *z = s->z;
    float m = -INFINITY;
    for (int32_t i = 0; i < s->n_vocab; i++) m = z[i] > m ? z[i] : m;
    double sum = 0;
    for (int32_t i = 0; i < s->n_vocab; i++) sum += exp((double)z[i] - m);
    return m + log(sum);
}

static void sampler_top_logprobs(const sampler *s, int32_t n, double lse,
                                 struct sampling_result *out) {
    const float *z = s->z;
    int32_t *top = out->top_token, filled = 0;
    if (n > s->n_vocab) n = s->n_vocab;
    for (int32_t i = 0; i < s->n_vocab; i++) {
        if (filled == n && !sampling_before(z, i, top[n - 1])) continue;
        int32_t at = filled < n ? filled++ : n - 1;
        while (at > 0 && sampling_before(z, i, top[at - 1])) {
            top[at] = top[at - 1];
            at--;
        }
        top[at] = i;
    }
    out->n_top = n;
    for (int32_t k = 0; k < n; k++) out->top_logprob[k] = (float)(z[top[k]] - lse);
}

int sampler_sample(sampler *s, const float *logits, const struct sampling_params *p,
                   const int32_t *history, int32_t n_history, int64_t pos,
                   struct sampling_result *out) {
    const int32_t n = s->n_vocab;
    float *z = s->z;
    int32_t *idx = s->idx;
    s->errstr[0] = 0;
    int32_t best = -1;
    for (int32_t i = 0; i < n; i++) {
        float v = logits[i];
        if (isnan(v) || v == INFINITY)
            return sampler_fail(s, out, STATUS_INTERNAL, "logit of token %d is %g", i, v);
        z[i] = v;
    }
    int rc = sampler_penalize(s, p, history, n_history, out);
    if (rc < 0) return rc;
    for (int32_t i = 0; i < n; i++)
        if (best < 0 || sampling_before(z, i, best)) best = i;
    if (z[best] == -INFINITY)
        return sampler_fail(s, out, STATUS_INTERNAL, "every one of the %d logits is -inf", n);

    memset(out, 0, sizeof *out);
    int want_lp = p->logprobs || p->top_logprobs > 0;
    double lse = want_lp ? sampler_logsumexp(s) : 0;
    if (want_lp && p->top_logprobs > 0) sampler_top_logprobs(s, p->top_logprobs, lse, out);

    int32_t token = best;
    /* A temperature so small that 1/T overflows is greedy too (and would
     * give 0 * inf = NaN below). */
    if (p->temperature > 0 && p->top_k != 1 && isfinite(1.0f / p->temperature)) {
        /* Temperature only scales, so the order of tokens stays that of z;
         * z is kept as is (the chosen token's logprob wants it) and the
         * weights are w_i = exp((z_i - z_best) / temperature) in (0, 1]. */
        float *w = s->w;
        const float inv_t = 1.0f / p->temperature, zmax = z[best];
        /* While computing the weights, count tokens and mass above a few
         * weight levels: the top-k or top-p prefix then lies inside the
         * highest level that holds k tokens or enough mass, and the
         * selections below only look at that (usually small) set.  A level
         * is a prefix of the order because exp is monotonic. */
        const int use_k = p->top_k > 0 && p->top_k < n;
        const int use_p = p->top_p > 0 && p->top_p < 1;
        /* Level j holds the tokens with (z_best - z) / T above cut[j-1]:
         * weights below e^-2.3 ~ 0.1, e^-4.6 ~ 0.01, ... */
        static const float cut[SAMPLING_LEVELS - 1] = {2.3f, 4.6f, 6.9f, 9.2f, 13.8f};
        int32_t level_n[SAMPLING_LEVELS] = {0};
        double level_mass[SAMPLING_LEVELS] = {0};
        if (use_k || use_p) {
            for (int32_t i = 0; i < n; i++) {
                float d = (zmax - z[i]) * inv_t;
                float wi = expf(-d);
                w[i] = wi;
                int j = (d > cut[0]) + (d > cut[1]) + (d > cut[2]) + (d > cut[3]) + (d > cut[4]);
                level_n[j]++;
                level_mass[j] += wi;
            }
            for (int j = 1; j < SAMPLING_LEVELS; j++) {
                level_n[j] += level_n[j - 1];
                level_mass[j] += level_mass[j - 1];
            }
        } else {
            for (int32_t i = 0; i < n; i++) w[i] = expf((z[i] - zmax) * inv_t);
        }
        /* top-k and top-p keep a prefix of the order: all tokens up to and
         * including `last` (-1 = no cut). */
        int32_t last = -1;
        if (use_k || use_p) {
            int j = 0;
            if (use_k) /* top-p then works inside the top-k set */
                while (level_n[j] < p->top_k) j++;
            else
                while (j < SAMPLING_LEVELS - 1 &&
                       level_mass[j] < p->top_p * level_mass[SAMPLING_LEVELS - 1])
                    j++;
            int32_t m = 0;
            if (j == SAMPLING_LEVELS - 1) {
                for (int32_t i = 0; i < n; i++) idx[i] = i;
                m = n;
            } else {
                for (int32_t i = 0; i < n; i++)
                    if ((zmax - z[i]) * inv_t <= cut[j]) idx[m++] = i;
                if (use_k && m < p->top_k) { /* cannot happen: same arithmetic as the count */
                    for (int32_t i = 0; i < n; i++) idx[i] = i;
                    m = n;
                }
            }
            if (use_k) {
                sampling_select(z, idx, m, p->top_k);
                m = p->top_k;
                last = idx[0];
                for (int32_t i = 1; i < m; i++)
                    if (sampling_before(z, last, idx[i])) last = idx[i];
            }
            if (use_p) {
                double total = level_mass[SAMPLING_LEVELS - 1];
                if (use_k) {
                    total = 0;
                    for (int32_t i = 0; i < m; i++) total += w[idx[i]];
                }
                sampling_select_mass(z, w, idx, m, p->top_p * total, &last);
            }
        }
        /* min-p: p_i >= min_p * p_best  <=>  z_i >= z_best + T log(min_p). */
        const float zmin = p->min_p > 0 ? zmax + p->temperature * logf(p->min_p) : -INFINITY;
        /* The draw walks the kept tokens in ascending id order: a definition
         * that does not depend on how the cuts were computed. */
        double total = 0;
        for (int32_t i = 0; i < n; i++)
            if (z[i] >= zmin && (last < 0 || i == last || sampling_before(z, i, last)))
                total += w[i];
        const double target = sampling_uniform(p->seed, pos) * total;
        double cum = 0;
        for (int32_t i = 0; i < n; i++) {
            /* A -inf logit (a grammar's mask) weighs 0: never the fallback
             * either. */
            if (z[i] >= zmin && z[i] > -INFINITY && (last < 0 || i == last || sampling_before(z, i, last))) {
                token = i; /* the last kept token, if rounding leaves cum short */
                cum += w[i];
                if (cum > target) break;
            }
        }
    }
    if (want_lp) out->logprob = (float)(z[token] - lse);
    out->token = token;
    out->is_stop = sampling_is_stop(p, token);
    return 0;
}
