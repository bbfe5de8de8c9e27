/* Tests of common/sampling: greedy and its equivalents, determinism of
 * (seed, position) draws, frequencies against the softmax (chi-square),
 * top-k/top-p/min-p sets against a plain full-sort reference, penalties,
 * log-probabilities, parameter validation and bad logits. */
#include "common/sampling.h"

#include <float.h>
#include <time.h>

#include "common/status.h"
#include "tests/test.h"

static uint64_t rng_next(uint64_t *s) {
    uint64_t z = (*s += 0x9e3779b97f4a7c15ULL);
    z = (z ^ (z >> 30)) * 0xbf58476d1ce4e5b9ULL;
    z = (z ^ (z >> 27)) * 0x94d049bb133111ebULL;
    return z ^ (z >> 31);
}

/* Logits roughly like a model's: normal-ish, spread sigma. */
static void random_logits(float *x, int32_t n, uint64_t seed, float sigma) {
    uint64_t s = seed;
    for (int32_t i = 0; i < n; i++) {
        double a = 0;
        for (int k = 0; k < 4; k++) a += (double)(rng_next(&s) >> 11) * 0x1p-53;
        x[i] = (float)((a - 2.0) * sigma * 1.7);
    }
}

static int32_t argmax(const float *x, int32_t n) {
    int32_t b = 0;
    for (int32_t i = 1; i < n; i++)
        if (x[i] > x[b]) b = i;
    return b;
}

TEST(sampling_greedy_picks_argmax) {
    enum { V = 1000 };
    static float x[V];
    sampler *s;
    char err[128];
    ASSERT_OK(sampler_init(&s, V, err, sizeof err));
    struct sampling_params p;
    sampling_params_default(&p);
    struct sampling_result r;
    for (int t = 0; t < 50; t++) {
        random_logits(x, V, 100 + t, 3);
        ASSERT_OK(sampler_sample(s, x, &p, NULL, 0, t, &r));
        ASSERT_EQ(argmax(x, V), r.token);
    }
    /* Ties go to the lower id. */
    for (int32_t i = 0; i < V; i++) x[i] = 0;
    x[700] = x[300] = 5;
    ASSERT_OK(sampler_sample(s, x, &p, NULL, 0, 0, &r));
    ASSERT_EQ(300, r.token);
    /* top_k = 1 at a high temperature is greedy too. */
    p.temperature = 5;
    p.top_k = 1;
    p.seed = 9;
    for (int t = 0; t < 50; t++) {
        random_logits(x, V, 200 + t, 3);
        ASSERT_OK(sampler_sample(s, x, &p, NULL, 0, t, &r));
        ASSERT_EQ(argmax(x, V), r.token);
    }
    sampler_free(s);
}

TEST(sampling_tiny_top_p_is_greedy) {
    enum { V = 5000 };
    static float x[V];
    sampler *s;
    ASSERT_OK(sampler_init(&s, V, NULL, 0));
    struct sampling_params p;
    sampling_params_default(&p);
    p.temperature = 1.5f;
    p.top_p = 1e-6f;
    p.seed = 1234;
    struct sampling_result r;
    for (int t = 0; t < 100; t++) {
        random_logits(x, V, 300 + t, 2);
        ASSERT_OK(sampler_sample(s, x, &p, NULL, 0, t, &r));
        ASSERT_EQ(argmax(x, V), r.token);
    }
    /* min_p = 1 keeps only the largest as well. */
    p.top_p = 0;
    p.min_p = 1;
    for (int t = 0; t < 100; t++) {
        random_logits(x, V, 400 + t, 2);
        ASSERT_OK(sampler_sample(s, x, &p, NULL, 0, t, &r));
        ASSERT_EQ(argmax(x, V), r.token);
    }
    sampler_free(s);
}

/* The same (seed, position) gives the same token in a fresh sampler (as in
 * another process); another seed gives another sequence. */
TEST(sampling_seed_and_position_decide) {
    enum { V = 2000, N = 300 };
    static float x[V];
    static int32_t a[N], b[N], c[N];
    sampler *s1, *s2;
    ASSERT_OK(sampler_init(&s1, V, NULL, 0));
    ASSERT_OK(sampler_init(&s2, V, NULL, 0));
    struct sampling_params p;
    sampling_params_default(&p);
    p.temperature = 1;
    p.top_p = 0.95f;
    p.top_k = 200;
    random_logits(x, V, 7, 1.0f); /* flat: many candidates */
    struct sampling_result r;
    for (int t = 0; t < N; t++) {
        p.seed = 42;
        ASSERT_OK(sampler_sample(s1, x, &p, NULL, 0, t, &r));
        a[t] = r.token;
        p.seed = 43;
        ASSERT_OK(sampler_sample(s1, x, &p, NULL, 0, t, &r));
        c[t] = r.token;
    }
    /* Replayed backwards in the other sampler: order of calls is irrelevant. */
    for (int t = N - 1; t >= 0; t--) {
        p.seed = 42;
        ASSERT_OK(sampler_sample(s2, x, &p, NULL, 0, t, &r));
        b[t] = r.token;
    }
    int same = 0, distinct = 0;
    for (int t = 0; t < N; t++) {
        ASSERT_EQ(a[t], b[t]);
        same += a[t] == c[t];
        distinct += t > 0 && a[t] != a[t - 1];
    }
    printf("  seeds 42 and 43 agree on %d of %d positions\n", same, N);
    ASSERT_TRUE(same < N / 10);      /* independent draws over ~hundreds of tokens */
    ASSERT_TRUE(distinct > N / 2);   /* the position matters too */
    ASSERT_EQ(sampling_uniform(42, 17), sampling_uniform(42, 17));
    ASSERT_TRUE(sampling_uniform(42, 17) != sampling_uniform(43, 17));
    ASSERT_TRUE(sampling_uniform(42, 17) != sampling_uniform(42, 18));
    sampler_free(s1);
    sampler_free(s2);
}

/* Pearson's chi-square of observed counts against probabilities q. */
static double chi_square(const long *obs, const double *q, int n, long total, int *dof) {
    double chi = 0;
    *dof = -1;
    for (int i = 0; i < n; i++) {
        if (q[i] <= 0) {
            if (obs[i] != 0) return INFINITY; /* a token that should never appear */
            continue;
        }
        double e = q[i] * total;
        chi += (obs[i] - e) * (obs[i] - e) / e;
        (*dof)++;
    }
    return chi;
}

/* Expected distribution after temperature and the cuts, by the plain
 * definition: full sort, cumulative sums. */
static void reference_probs(const float *x, int n, const struct sampling_params *p, double *q) {
    int order[64];
    for (int i = 0; i < n; i++) order[i] = i;
    for (int i = 1; i < n; i++) /* insertion sort, larger first, lower id on ties */
        for (int j = i; j > 0 && (x[order[j]] > x[order[j - 1]] ||
                                  (x[order[j]] == x[order[j - 1]] && order[j] < order[j - 1])); j--) {
            int t = order[j];
            order[j] = order[j - 1];
            order[j - 1] = t;
        }
    double w[64], sum = 0;
    for (int i = 0; i < n; i++) w[i] = exp((x[i] - x[order[0]]) / p->temperature);
    int keep = p->top_k > 0 && p->top_k < n ? p->top_k : n;
    for (int i = 0; i < keep; i++) sum += w[order[i]];
    if (p->top_p > 0 && p->top_p < 1) {
        double cum = 0;
        for (int i = 0; i < keep; i++) {
            cum += w[order[i]];
            if (cum >= p->top_p * sum) {
                keep = i + 1;
                break;
            }
        }
    }
    for (int i = 0; i < n; i++) q[i] = 0;
    sum = 0;
    for (int i = 0; i < keep; i++)
        if (w[order[i]] >= p->min_p) sum += w[order[i]];
    for (int i = 0; i < keep; i++)
        if (w[order[i]] >= p->min_p) q[order[i]] = w[order[i]] / sum;
}

/* Sampling over many positions matches the distribution: 16 tokens, 15
 * degrees of freedom, whose chi-square exceeds 45 with probability < 1e-4. */
TEST(sampling_frequencies_match_softmax) {
    enum { V = 16, DRAWS = 200000 };
    const float x[V] = {2.0f, 1.5f, 1.4f, 1.0f, 0.9f, 0.5f, 0.3f, 0.0f,
                        -0.2f, -0.5f, -0.7f, -1.0f, -1.5f, -2.0f, -3.0f, 1.45f};
    sampler *s;
    ASSERT_OK(sampler_init(&s, V, NULL, 0));
    struct {
        float temperature, top_p, min_p;
        int32_t top_k;
    } cases[] = {{1, 0, 0, 0}, {0.7f, 0, 0, 0}, {2.5f, 0, 0, 0}, {1, 0, 0, 5},
                 {1, 0.8f, 0, 0}, {1, 0, 0.2f, 0}, {0.9f, 0.9f, 0.05f, 8}};
    for (size_t c = 0; c < sizeof cases / sizeof cases[0]; c++) {
        struct sampling_params p;
        sampling_params_default(&p);
        p.temperature = cases[c].temperature;
        p.top_p = cases[c].top_p;
        p.min_p = cases[c].min_p;
        p.top_k = cases[c].top_k;
        p.seed = 2024 + c;
        long obs[V] = {0};
        double q[V];
        struct sampling_result r;
        for (int t = 0; t < DRAWS; t++) {
            ASSERT_OK(sampler_sample(s, x, &p, NULL, 0, t, &r));
            obs[r.token]++;
        }
        reference_probs(x, V, &p, q);
        int dof;
        double chi = chi_square(obs, q, V, DRAWS, &dof);
        printf("  T=%g top_k=%d top_p=%g min_p=%g: chi-square %.2f with %d dof\n", p.temperature,
               p.top_k, p.top_p, p.min_p, chi, dof);
        ASSERT_TRUE(dof >= 2);
        ASSERT_TRUE(chi < 45);
    }
    sampler_free(s);
}

/* Large vocabularies: the top-k / top-p set and the drawn token equal those
 * of a full-sort reference (the quickselect paths). */
static const float *cmp_x;
static int cmp_desc(const void *a, const void *b) {
    int32_t i = *(const int32_t *)a, j = *(const int32_t *)b;
    if (cmp_x[i] != cmp_x[j]) return cmp_x[i] > cmp_x[j] ? -1 : 1;
    return i < j ? -1 : 1;
}

TEST(sampling_large_vocab_matches_reference) {
    enum { V = 32000 };
    float *x = malloc(V * sizeof *x);
    int32_t *order = malloc(V * sizeof *order);
    char *in_set = calloc(V, 1);
    sampler *s;
    ASSERT_OK(sampler_init(&s, V, NULL, 0));
    int agree = 0, total = 0;
    for (int cfg = 0; cfg < 3; cfg++) {
        struct sampling_params p;
        sampling_params_default(&p);
        p.temperature = cfg == 2 ? 0.6f : 1.0f;
        p.top_p = cfg == 0 ? 0.9f : cfg == 2 ? 0.97f : 0;
        p.top_k = cfg == 1 ? 50 : cfg == 2 ? 3000 : 0;
        p.seed = 77 + cfg;
        for (int t = 0; t < 100; t++) {
            random_logits(x, V, 1000 * cfg + t, 1.0f + 0.02f * t);
            struct sampling_result r;
            ASSERT_OK(sampler_sample(s, x, &p, NULL, 0, t, &r));
            /* Reference: sort all, cut, walk in order. */
            for (int32_t i = 0; i < V; i++) order[i] = i;
            cmp_x = x;
            qsort(order, V, sizeof *order, cmp_desc);
            int32_t keep = p.top_k > 0 ? p.top_k : V;
            double sum = 0, cum = 0;
            for (int32_t i = 0; i < keep; i++) sum += exp((x[order[i]] - x[order[0]]) / p.temperature);
            if (p.top_p > 0) {
                for (int32_t i = 0; i < keep; i++) {
                    cum += exp((x[order[i]] - x[order[0]]) / p.temperature);
                    if (cum >= p.top_p * sum) {
                        keep = i + 1;
                        break;
                    }
                }
            }
            int32_t rank = -1;
            for (int32_t i = 0; i < keep; i++)
                if (order[i] == r.token) rank = i;
            if (rank < 0) TEST_FAIL("cfg %d pos %d: token %d is outside the %d-token set", cfg, t,
                                    r.token, keep);
            /* Same u, same walk (kept tokens in id order): the same token
             * unless float rounding moved a boundary. */
            double ksum = 0, c2 = 0;
            for (int32_t i = 0; i < keep; i++) {
                ksum += exp((x[order[i]] - x[order[0]]) / p.temperature);
                in_set[order[i]] = 1;
            }
            double target = sampling_uniform(p.seed, t) * ksum;
            int32_t want = -1;
            for (int32_t i = 0; i < V; i++) {
                if (!in_set[i]) continue;
                want = i;
                c2 += exp((x[i] - x[order[0]]) / p.temperature);
                if (c2 > target) break;
            }
            for (int32_t i = 0; i < keep; i++) in_set[order[i]] = 0;
            agree += want == r.token;
            total++;
        }
    }
    printf("  %d of %d draws equal the reference's\n", agree, total);
    ASSERT_TRUE(agree >= total - 2);
    /* Time per call at a Llama-3 vocabulary, for the record. */
    sampler_free(s);
    enum { V3 = 128256 };
    float *y = malloc(V3 * sizeof *y);
    ASSERT_OK(sampler_init(&s, V3, NULL, 0));
    random_logits(y, V3, 5, 2);
    struct sampling_params p;
    sampling_params_default(&p);
    p.temperature = 0.8f;
    p.top_p = 0.95f;
    p.top_k = 0;
    struct timespec t0, t1;
    clock_gettime(CLOCK_MONOTONIC, &t0);
    struct sampling_result r;
    for (int t = 0; t < 50; t++) ASSERT_OK(sampler_sample(s, y, &p, NULL, 0, t, &r));
    clock_gettime(CLOCK_MONOTONIC, &t1);
    printf("  n_vocab %d, T 0.8, top_p 0.95: %.3f ms per token\n", V3,
           ((t1.tv_sec - t0.tv_sec) * 1e3 + (t1.tv_nsec - t0.tv_nsec) / 1e6) / 50);
    sampler_free(s);
    free(y);
    free(x);
    free(order);
    free(in_set);
}

/* Log-probabilities are taken after the penalties, so their differences
 * show the penalised logits exactly. */
TEST(sampling_penalties_change_logits) {
    enum { V = 8 };
    const float x[V] = {1.0f, 4.0f, -2.0f, 3.0f, 0.5f, 3.5f, 2.0f, -1.0f};
    sampler *s;
    ASSERT_OK(sampler_init(&s, V, NULL, 0));
    struct sampling_params p;
    sampling_params_default(&p);
    p.top_logprobs = V;
    struct sampling_result r;
    const int32_t hist[] = {1, 2, 1, 6, 1};
    double lp[V];
    /* Without penalties token 1 wins. */
    ASSERT_OK(sampler_sample(s, x, &p, hist, 5, 5, &r));
    ASSERT_EQ(1, r.token);
    /* Repetition 2: 4 -> 2 (positive: divided), -2 -> -4 (negative:
     * multiplied), 2 -> 1; token 5 (3.5) now wins. */
    p.repetition_penalty = 2;
    ASSERT_OK(sampler_sample(s, x, &p, hist, 5, 5, &r));
    ASSERT_EQ(5, r.token);
    for (int k = 0; k < r.n_top; k++) lp[r.top_token[k]] = r.top_logprob[k];
    ASSERT_NEAR(2.0 - 1.0, lp[1] - lp[0], 1e-5);
    ASSERT_NEAR(-4.0 - 1.0, lp[2] - lp[0], 1e-5);
    ASSERT_NEAR(1.0 - 1.0, lp[6] - lp[0], 1e-5);
    ASSERT_NEAR(3.5 - 1.0, lp[5] - lp[0], 1e-5);
    /* Frequency 0.5 (token 1 thrice: -1.5) and presence 0.25 (-0.25 each). */
    p.repetition_penalty = 0;
    p.frequency_penalty = 0.5f;
    p.presence_penalty = 0.25f;
    ASSERT_OK(sampler_sample(s, x, &p, hist, 5, 5, &r));
    for (int k = 0; k < r.n_top; k++) lp[r.top_token[k]] = r.top_logprob[k];
    ASSERT_NEAR(4.0 - 1.5 - 0.25 - 1.0, lp[1] - lp[0], 1e-5);
    ASSERT_NEAR(-2.0 - 0.5 - 0.25 - 1.0, lp[2] - lp[0], 1e-5);
    ASSERT_NEAR(3.5 - 1.0, lp[5] - lp[0], 1e-5);
    ASSERT_EQ(5, r.token); /* 3.5 > 4 - 1.75 */
    /* A window of the last 2 tokens (6, 1): token 2 is not penalised,
     * token 1 counts once. */
    p.penalty_last_n = 2;
    ASSERT_OK(sampler_sample(s, x, &p, hist, 5, 5, &r));
    for (int k = 0; k < r.n_top; k++) lp[r.top_token[k]] = r.top_logprob[k];
    ASSERT_NEAR(-2.0 - 1.0, lp[2] - lp[0], 1e-5);
    ASSERT_NEAR(4.0 - 0.75 - 1.0, lp[1] - lp[0], 1e-5);
    ASSERT_EQ(5, r.token); /* 3.5 > 3.25 */
    /* A negative presence penalty encourages: +2 for tokens 1, 2 and 6. */
    p.penalty_last_n = 0;
    p.frequency_penalty = 0;
    p.presence_penalty = -2;
    ASSERT_OK(sampler_sample(s, x, &p, hist, 5, 5, &r));
    ASSERT_EQ(1, r.token); /* 6.0 */
    for (int k = 0; k < r.n_top; k++) lp[r.top_token[k]] = r.top_logprob[k];
    ASSERT_NEAR(4.0 - 1.0, lp[6] - lp[0], 1e-5);
    ASSERT_NEAR(0.0 - 1.0, lp[2] - lp[0], 1e-5);
    /* The count scratch is left clean: no penalty again gives the plain
     * logits. */
    sampling_params_default(&p);
    p.top_logprobs = V;
    ASSERT_OK(sampler_sample(s, x, &p, hist, 5, 5, &r));
    for (int k = 0; k < r.n_top; k++) lp[r.top_token[k]] = r.top_logprob[k];
    ASSERT_NEAR(4.0 - 1.0, lp[1] - lp[0], 1e-5);
    sampler_free(s);
}

TEST(sampling_logprobs_are_normalised) {
    enum { V = 20 };
    float x[V];
    random_logits(x, V, 99, 2);
    sampler *s;
    ASSERT_OK(sampler_init(&s, V, NULL, 0));
    struct sampling_params p;
    sampling_params_default(&p);
    p.logprobs = 1;
    p.top_logprobs = SAMPLING_TOP_LOGPROBS_MAX;
    p.seed = 5;
    struct sampling_result r;
    float at_t1 = 0;
    for (int ti = 0; ti < 3; ti++) {
        p.temperature = ti == 0 ? 1.0f : ti == 1 ? 0.3f : 0.0f;
        ASSERT_OK(sampler_sample(s, x, &p, NULL, 0, 11, &r));
        ASSERT_EQ(V, r.n_top);
        double sum = 0;
        int found = 0;
        for (int k = 0; k < r.n_top; k++) {
            sum += exp(r.top_logprob[k]);
            if (k > 0) ASSERT_TRUE(r.top_logprob[k] <= r.top_logprob[k - 1]);
            if (r.top_token[k] == r.token) {
                ASSERT_NEAR(r.top_logprob[k], r.logprob, 1e-6);
                found = 1;
            }
        }
        ASSERT_TRUE(found);
        ASSERT_NEAR(1.0, sum, 1e-5);
        ASSERT_EQ(argmax(x, V), r.top_token[0]);
        /* Before temperature: the same numbers at every temperature. */
        if (ti == 0) at_t1 = r.top_logprob[0];
        ASSERT_NEAR(at_t1, r.top_logprob[0], 1e-6);
    }
    /* Fewer alternatives than the vocabulary, and none when not asked. */
    p.top_logprobs = 3;
    ASSERT_OK(sampler_sample(s, x, &p, NULL, 0, 11, &r));
    ASSERT_EQ(3, r.n_top);
    ASSERT_EQ(argmax(x, V), r.top_token[0]);
    sampling_params_default(&p);
    ASSERT_OK(sampler_sample(s, x, &p, NULL, 0, 11, &r));
    ASSERT_EQ(0, r.n_top);
    ASSERT_EQ(0.0f, r.logprob);
    sampler_free(s);
}

TEST(sampling_stop_tokens) {
    enum { V = 10 };
    float x[V] = {0, 0, 0, 9, 0, 0, 0, 0, 0, 0};
    sampler *s;
    ASSERT_OK(sampler_init(&s, V, NULL, 0));
    struct sampling_params p;
    sampling_params_default(&p);
    struct sampling_result r;
    ASSERT_OK(sampler_sample(s, x, &p, NULL, 0, 0, &r));
    ASSERT_EQ(3, r.token);
    ASSERT_EQ(0, r.is_stop);
    p.n_stop_token_ids = 2;
    p.stop_token_ids[0] = 7;
    p.stop_token_ids[1] = 3;
    ASSERT_OK(sampler_sample(s, x, &p, NULL, 0, 0, &r));
    ASSERT_EQ(1, r.is_stop);
    ASSERT_EQ(0, sampling_is_stop(&p, 4));
    sampler_free(s);
}

/* The router rejects client requests with these messages. */
#define EXPECT_INVALID(field_expr, text)                                              \
    do {                                                                              \
        struct sampling_params q_;                                                    \
        sampling_params_default(&q_);                                                 \
        q_.field_expr;                                                                \
        char msg_[160] = "";                                                            \
        ASSERT_EQ(STATUS_BAD_INPUT, sampling_params_validate(&q_, 1000, msg_, sizeof msg_)); \
        if (!strstr(msg_, text)) TEST_FAIL("message \"%s\" lacks \"%s\"", msg_, text);    \
    } while (0)

TEST(sampling_validate_names_field_and_value) {
    struct sampling_params p;
    sampling_params_default(&p);
    char err[160];
    ASSERT_OK(sampling_params_validate(&p, 1000, err, sizeof err));
    p.temperature = 0.8f;
    p.top_k = 40;
    p.top_p = 1;
    p.min_p = 0.05f;
    p.repetition_penalty = 1.1f;
    p.presence_penalty = -2;
    p.frequency_penalty = 2;
    p.penalty_last_n = 64;
    p.n_stop_token_ids = 1;
    p.stop_token_ids[0] = 999;
    p.top_logprobs = SAMPLING_TOP_LOGPROBS_MAX;
    ASSERT_OK(sampling_params_validate(&p, 1000, err, sizeof err));

    EXPECT_INVALID(temperature = -1, "temperature = -1");
    EXPECT_INVALID(temperature = NAN, "temperature = nan");
    EXPECT_INVALID(temperature = INFINITY, "temperature = inf");
    EXPECT_INVALID(top_k = -3, "top_k = -3");
    EXPECT_INVALID(top_p = 1.5f, "top_p = 1.5 is outside [0, 1]");
    EXPECT_INVALID(top_p = -0.1f, "top_p = -0.1");
    EXPECT_INVALID(min_p = 2, "min_p = 2");
    EXPECT_INVALID(repetition_penalty = -1, "repetition_penalty = -1");
    EXPECT_INVALID(presence_penalty = 2.5f, "presence_penalty = 2.5");
    EXPECT_INVALID(frequency_penalty = -3, "frequency_penalty = -3");
    EXPECT_INVALID(penalty_last_n = -1, "penalty_last_n = -1");
    EXPECT_INVALID(n_stop_token_ids = SAMPLING_STOP_IDS_MAX + 1, "stop_token_ids has 33 entries");
    EXPECT_INVALID(top_logprobs = 21, "top_logprobs = 21");
    struct sampling_params q;
    sampling_params_default(&q);
    q.n_stop_token_ids = 2;
    q.stop_token_ids[1] = 1000;
    ASSERT_EQ(STATUS_BAD_INPUT, sampling_params_validate(&q, 1000, err, sizeof err));
    ASSERT_TRUE(strstr(err, "stop_token_ids[1] = 1000") != NULL);
    /* Without a vocabulary only the sign is checked. */
    ASSERT_OK(sampling_params_validate(&q, 0, err, sizeof err));
    q.stop_token_ids[0] = -1;
    ASSERT_EQ(STATUS_BAD_INPUT, sampling_params_validate(&q, 0, err, sizeof err));
}

TEST(sampling_bad_logits_and_history) {
    enum { V = 6 };
    float x[V] = {0, 1, 2, 3, 4, 5};
    sampler *s;
    ASSERT_OK(sampler_init(&s, V, NULL, 0));
    struct sampling_params p;
    sampling_params_default(&p);
    struct sampling_result r;
    x[2] = NAN;
    ASSERT_EQ(STATUS_INTERNAL, sampler_sample(s, x, &p, NULL, 0, 0, &r));
    ASSERT_EQ(-1, r.token);
    ASSERT_TRUE(strstr(sampler_errstr(s), "token 2") != NULL);
    x[2] = INFINITY;
    ASSERT_EQ(STATUS_INTERNAL, sampler_sample(s, x, &p, NULL, 0, 0, &r));
    for (int i = 0; i < V; i++) x[i] = -INFINITY;
    ASSERT_EQ(STATUS_INTERNAL, sampler_sample(s, x, &p, NULL, 0, 0, &r));
    ASSERT_TRUE(strstr(sampler_errstr(s), "-inf") != NULL);
    /* -inf logits (masked tokens) are fine and never drawn. */
    x[4] = 1;
    x[1] = 1;
    p.temperature = 1;
    p.seed = 3;
    for (int t = 0; t < 200; t++) {
        ASSERT_OK(sampler_sample(s, x, &p, NULL, 0, t, &r));
        ASSERT_TRUE(r.token == 1 || r.token == 4);
    }
    /* A history token outside the vocabulary. */
    const int32_t hist[] = {1, 9};
    p.repetition_penalty = 1.3f;
    ASSERT_EQ(STATUS_BAD_INPUT, sampler_sample(s, x, &p, hist, 2, 2, &r));
    ASSERT_TRUE(strstr(sampler_errstr(s), "history[1] = 9") != NULL);
    /* A huge logit under a tiny repetition penalty stays finite. */
    float y[V] = {FLT_MAX / 2, 0, 0, 0, 0, 0};
    const int32_t h0[] = {0};
    p.repetition_penalty = 1e-6f;
    ASSERT_OK(sampler_sample(s, y, &p, h0, 1, 1, &r));
    ASSERT_EQ(0, r.token);
    /* A denormal temperature acts as greedy instead of producing NaN. */
    float u[V] = {0, 1, 3, 2, 0, 0};
    p.repetition_penalty = 0;
    p.temperature = 1e-40f;
    ASSERT_OK(sampler_sample(s, u, &p, NULL, 0, 0, &r));
    ASSERT_EQ(2, r.token);
    char err[128];
    sampler *bad = (sampler *)1;
    ASSERT_EQ(STATUS_BAD_INPUT, sampler_init(&bad, 0, err, sizeof err));
    ASSERT_TRUE(bad == NULL);
    sampler_free(s);
}

TEST_MAIN(sampling_greedy_picks_argmax, sampling_tiny_top_p_is_greedy,
          sampling_seed_and_position_decide, sampling_frequencies_match_softmax,
          sampling_large_vocab_matches_reference, sampling_penalties_change_logits,
          sampling_logprobs_are_normalised, sampling_stop_tokens,
          sampling_validate_names_field_and_value, sampling_bad_logits_and_history)
