/* Tests of backend_sample on the CUDA backend against sampler_sample on the
 * host (common/sampling.c, the reference), on fresh random logits with
 * planted ties, NaNs and infinities.  Bounds: greedy tokens, errors, top
 * tokens and stop flags exactly equal; a sampled token may differ only where
 * a third, sort-based reference here finds the draw (or a top-p cut) within
 * a relative 1e-5 of a boundary, where expf's last bit decides; logprobs
 * within 1e-4.  Without a GPU (CI) every test skips and ctest reports the
 * program skipped. */
#include "cuda_test.h"

#include <float.h>

#include "common/sampling.h"

/* ---- Fixture ---- */

static struct {
    backend *gpu;
    sampler *smp;
    float *d_logits; /* GPU memory */
    float *logits;   /* host copy [n_rows, n_vocab] */
    int32_t *hist;   /* histories [n_rows, HIST_MAX] */
    struct sampling_params *params;
    struct backend_sample_row *rows, *ref;
    uint64_t *allow; /* masks [n_rows, words] for rows that take one */
    float *masked;   /* one row with a mask applied, for the host reference */
} fx;

#define HIST_MAX 400

static void fx_close(void) {
    if (fx.gpu && fx.d_logits) backend_dealloc(fx.gpu, fx.d_logits);
    backend_free(fx.gpu);
    sampler_free(fx.smp);
    free(fx.logits);
    free(fx.hist);
    free(fx.params);
    free(fx.rows);
    free(fx.ref);
    free(fx.allow);
    free(fx.masked);
    memset(&fx, 0, sizeof fx);
}

/* The GPU backend and buffers for n_rows rows of n_vocab logits. */
static void fx_open(int32_t n_vocab, int32_t n_rows) {
    rng_seed();
    fx_close();
    cuda_test_open(&fx.gpu);
    char err[256];
    int rc = sampler_init(&fx.smp, n_vocab, err, sizeof err);
    if (rc != STATUS_OK) TEST_FAIL("sampler_init(%d): %s", n_vocab, err);
    size_t n = (size_t)n_rows * n_vocab;
    fx.d_logits = backend_alloc(fx.gpu, n * sizeof(float));
    fx.logits = malloc(n * sizeof(float));
    fx.hist = malloc((size_t)n_rows * HIST_MAX * sizeof(int32_t));
    fx.params = calloc((size_t)n_rows, sizeof *fx.params);
    fx.rows = calloc((size_t)n_rows, sizeof *fx.rows);
    fx.ref = calloc((size_t)n_rows, sizeof *fx.ref);
    fx.allow = calloc((size_t)n_rows * (size_t)((n_vocab + 63) / 64), sizeof *fx.allow);
    fx.masked = malloc((size_t)n_vocab * sizeof *fx.masked);
    if (!fx.d_logits || !fx.logits || !fx.hist || !fx.params || !fx.rows || !fx.ref || !fx.allow || !fx.masked)
        TEST_FAIL("fixture: cannot allocate %d rows of %d logits", n_rows, n_vocab);
}

/* Logits like a model's: a broad bulk and a few strong candidates. */
static void fill_base(float *x, int32_t n) {
    for (int32_t i = 0; i < n; i++) x[i] = 1.5f * (rng_f(-1, 1) + rng_f(-1, 1) + rng_f(-1, 1));
}

static void fill_logits(float *x, int32_t n) {
    fill_base(x, n);
    int peaks = 1 + rng_int(8);
    for (int k = 0; k < peaks; k++) x[rng_int(n)] += rng_f(4, 12);
}

static int32_t argmax_of(const float *x, int32_t n) {
    int32_t b = 0;
    for (int32_t i = 1; i < n; i++)
        if (x[i] > x[b]) b = i;
    return b;
}

/* ---- A third reference: sort-based, in double, and it says when float
 * rounding could move its answer (the only case where GPU and CPU may
 * differ). ---- */

static const float *cmp_z;
static int cmp_order(const void *a, const void *b) {
    int32_t i = *(const int32_t *)a, j = *(const int32_t *)b;
    if (cmp_z[i] != cmp_z[j]) return cmp_z[i] > cmp_z[j] ? -1 : 1;
    return i < j ? -1 : 1;
}

#define NEAR_REL 1e-5

/* The token sampler_sample's rules give for a non-greedy row; *ambiguous =
 * 1 when the draw or the top-p cut lies within NEAR_REL of a boundary. */
static int32_t ref_sample(const float *logits, int32_t n, const struct backend_sample_row *row, int *ambiguous) {
    const struct sampling_params *p = row->params;
    float *z = malloc((size_t)n * sizeof(float));
    float *w = malloc((size_t)n * sizeof(float));
    int32_t *ord = malloc((size_t)n * sizeof(int32_t));
    char *kept = calloc((size_t)n, 1);
    int32_t *cnt = calloc((size_t)n, sizeof(int32_t));
    if (!z || !w || !ord || !kept || !cnt) TEST_FAIL("ref_sample: out of memory for %d", n);
    memcpy(z, logits, (size_t)n * sizeof(float));
    float rep = p->repetition_penalty;
    int use_rep = rep != 0 && rep != 1;
    if (use_rep || p->presence_penalty != 0 || p->frequency_penalty != 0) {
        int32_t start = p->penalty_last_n > 0 && p->penalty_last_n < row->n_history ? row->n_history - p->penalty_last_n : 0;
        for (int32_t i = start; i < row->n_history; i++) cnt[row->history[i]]++;
        for (int32_t t = 0; t < n; t++) {
            if (!cnt[t]) continue;
            float v = z[t];
            if (use_rep) v = v > 0 ? v / rep : v * rep;
            v -= (float)cnt[t] * p->frequency_penalty + p->presence_penalty;
            z[t] = v > FLT_MAX ? FLT_MAX : v;
        }
    }
    for (int32_t i = 0; i < n; i++) ord[i] = i;
    cmp_z = z;
    qsort(ord, (size_t)n, sizeof *ord, cmp_order);
    const float zmax = z[ord[0]], inv_t = 1.0f / p->temperature;
    for (int32_t i = 0; i < n; i++) w[i] = expf(-((zmax - z[i]) * inv_t));
    int32_t m = p->top_k > 0 && p->top_k < n ? p->top_k : n;
    *ambiguous = 0;
    if (p->top_p > 0 && p->top_p < 1) {
        double total = 0, acc = 0, before = 0;
        for (int32_t j = 0; j < m; j++) total += w[ord[j]];
        double target = p->top_p * total;
        int32_t l = m;
        for (int32_t j = 0; j < m; j++) {
            before = acc;
            acc += w[ord[j]];
            if (acc >= target) {
                l = j + 1;
                break;
            }
        }
        if (target - before <= NEAR_REL * total || acc - target <= NEAR_REL * total) *ambiguous = 1;
        m = l;
    }
    const float zmin = p->min_p > 0 ? zmax + p->temperature * logf(p->min_p) : -INFINITY;
    for (int32_t j = 0; j < m; j++)
        if (z[ord[j]] >= zmin) kept[ord[j]] = 1;
    double total = 0;
    for (int32_t i = 0; i < n; i++)
        if (kept[i]) total += w[i];
    const double target = sampling_uniform(p->seed, row->pos) * total;
    double cum = 0;
    int32_t token = -1, last = -1;
    for (int32_t i = 0; i < n; i++) {
        if (!kept[i]) continue;
        last = i;
        cum += w[i];
        if (fabs(cum - target) <= NEAR_REL * total) *ambiguous = 1;
        if (token < 0 && cum > target) token = i;
    }
    if (token < 0) token = last; /* rounding left cum short: the last kept token */
    free(z);
    free(w);
    free(ord);
    free(kept);
    free(cnt);
    return token;
}

/* ---- Rows of many kinds ---- */

enum row_kind {
    K_GREEDY_TIE, K_ZERO_TIE, K_TOPK1_TIE, K_TINY_T, K_LOGPROBS_GREEDY, K_TEMP, K_TEMP_LOW, K_TOPK, K_TOPP,
    K_TOPK_TOPP, K_TOPP_PEAKED, K_MINP, K_ALL, K_PEN, K_PEN_GREEDY, K_TIES_TOPK, K_TIES_TOPP, K_TOPK_OFF, K_NAN, K_PINF,
    K_NINF, K_BAD_HIST, K_COUNT
};
static const char *const kind_name[K_COUNT] = {
    "greedy, planted tie", "greedy, -0 and +0 tie", "top_k 1, planted tie", "temperature 1e-39",
    "greedy + top_logprobs 20", "temperature 1", "temperature 0.3", "top_k 40", "top_p 0.9", "top_k 50 + top_p 0.8",
    "top_p 0.9, peaked (model-like)",
    "min_p 0.05", "everything + logprobs", "penalties, last 64", "greedy, penalties", "100-way tie, top_k 50",
    "100-way tie, top_p 0.5", "top_k > n_vocab", "a NaN logit", "a +inf logit", "all -inf", "bad history id",
};

/* Rows whose parameters are greedy.  K_PINF's are the defaults: it fails
 * on its +inf logit, except where a mask leaves that token out. */
static int kind_greedy(int k) {
    return k == K_GREEDY_TIE || k == K_ZERO_TIE || k == K_TOPK1_TIE || k == K_TINY_T || k == K_LOGPROBS_GREEDY ||
           k == K_PEN_GREEDY || k == K_PINF;
}

/* Fill row r (logits, params, history) as kind k. */
static void make_row(int32_t r, int k, int32_t n) {
    float *x = fx.logits + (size_t)r * n;
    struct sampling_params *p = &fx.params[r];
    struct backend_sample_row *row = &fx.rows[r];
    int32_t *h = fx.hist + (size_t)r * HIST_MAX;
    sampling_params_default(p);
    fill_logits(x, n);
    p->seed = ((uint64_t)rng_u32() << 32) | rng_u32();
    memset(row, 0, sizeof *row);
    row->params = p;
    row->history = h;
    row->pos = rng_int(1 << 20);
    int32_t a = rng_int(n), b = rng_int(n);
    if (a == b) b = (a + 1) % n;
    float top = x[argmax_of(x, n)];
    switch (k) {
    case K_GREEDY_TIE: x[a] = x[b] = top + 1; break;
    case K_ZERO_TIE:
        for (int32_t i = 0; i < n; i++) x[i] = rng_f(-8, -1);
        x[a < b ? a : b] = -0.0f;
        x[a < b ? b : a] = 0.0f;
        break;
    case K_TOPK1_TIE: p->temperature = 0.8f; p->top_k = 1; x[a] = x[b] = top + 0.5f; break;
    case K_TINY_T: p->temperature = 1e-39f; break;
    case K_LOGPROBS_GREEDY: p->logprobs = 1; p->top_logprobs = 20; x[a] = x[b] = top; break;
    case K_TEMP: p->temperature = 1.0f; break;
    case K_TEMP_LOW: p->temperature = 0.3f; break;
    case K_TOPK: p->temperature = 0.7f; p->top_k = 40; break;
    case K_TOPP: p->temperature = 1.0f; p->top_p = 0.9f; break;
    case K_TOPK_TOPP: p->temperature = 0.8f; p->top_k = 50; p->top_p = 0.8f; break;
    case K_TOPP_PEAKED:
        /* A couple of dozen candidates well above the bulk, as a model's
         * logits usually are: the top-p cut lies among them. */
        p->temperature = 0.7f; p->top_p = 0.9f;
        for (int j = 0; j < 24; j++) x[rng_int(n)] = 12 + rng_f(0, 4);
        break;
    case K_MINP: p->temperature = 1.2f; p->min_p = 0.05f; break;
    case K_ALL:
        p->temperature = 0.9f; p->top_k = 200; p->top_p = 0.95f; p->min_p = 0.02f;
        p->logprobs = 1; p->top_logprobs = 20;
        p->n_stop_token_ids = 3;
        p->stop_token_ids[0] = argmax_of(x, n);
        p->stop_token_ids[1] = a;
        p->stop_token_ids[2] = b;
        break;
    case K_PEN:
    case K_PEN_GREEDY: {
        /* Repeats of the strongest tokens (where penalties change the
         * answer) and of random ones (negative logits: the * rep branch). */
        int32_t best = argmax_of(x, n);
        row->n_history = 100 + rng_int(HIST_MAX - 100);
        for (int32_t i = 0; i < row->n_history; i++) {
            int c = rng_int(4);
            h[i] = c == 0 ? best : c == 1 ? rng_int(n < 50 ? n : 50) : rng_int(n);
        }
        if (k == K_PEN) {
            p->temperature = 1.0f; p->repetition_penalty = 1.3f; p->presence_penalty = 0.5f;
            p->frequency_penalty = 0.3f; p->penalty_last_n = 64;
        } else {
            p->repetition_penalty = 1.5f; p->frequency_penalty = -0.2f; p->logprobs = 1; p->top_logprobs = 5;
            x[best] = x[b] + 0.01f; /* close, so that the penalty flips the argmax */
        }
        break;
    }
    case K_TIES_TOPK:
    case K_TIES_TOPP: {
        int32_t m = n < 100 ? n : 100;
        for (int32_t i = 0; i < m; i++) x[rng_int(n)] = top + 2;
        p->temperature = 1.0f;
        if (k == K_TIES_TOPK) p->top_k = 50;
        else p->top_p = 0.5f;
        break;
    }
    case K_TOPK_OFF: p->temperature = 1.0f; p->top_k = n + 10; break;
    case K_NAN: p->temperature = 1.0f; x[a] = NAN; x[b] = -NAN; break;
    case K_PINF: x[a] = INFINITY; break;
    case K_NINF:
        p->temperature = 1.0f;
        for (int32_t i = 0; i < n; i++) x[i] = -INFINITY;
        break;
    case K_BAD_HIST:
        p->temperature = 1.0f; p->presence_penalty = 0.5f;
        row->n_history = 5;
        for (int32_t i = 0; i < 5; i++) h[i] = rng_int(n);
        h[3] = n + 7;
        break;
    }
    char err[160];
    if (sampling_params_validate(p, n, err, sizeof err) != 0) TEST_FAIL("row %d (%s): %s", r, kind_name[k], err);
}

struct tally {
    int rows, sampled, greedy, failed, ambiguous_diff;
};

/* Samples rows [0, n_rows) on the GPU and on the host and compares them. */
static void compare_rows(int32_t n, int32_t n_rows, const int *kinds, struct tally *t) {
    ASSERT_OK(backend_upload(fx.gpu, fx.d_logits, fx.logits, (size_t)n_rows * n * sizeof(float)));
    for (int32_t r = 0; r < n_rows; r++) {
        fx.rows[r].status = 12345; /* must be overwritten */
        fx.rows[r].result.token = -7;
        fx.ref[r] = fx.rows[r];
    }
    ASSERT_OK(backend_sample(fx.gpu, fx.d_logits, n, fx.rows, n_rows));
    for (int32_t r = 0; r < n_rows; r++) {
        struct backend_sample_row *g = &fx.rows[r], *c = &fx.ref[r];
        const char *what = kinds ? kind_name[kinds[r]] : "row";
        const float *x = fx.logits + (size_t)r * n;
        if (c->allow) {
            /* The host path's rule: left-out tokens are -inf before
             * anything else (backend_sample_row.allow). */
            for (int32_t i = 0; i < n; i++) fx.masked[i] = (c->allow[i / 64] >> (i % 64)) & 1 ? x[i] : -INFINITY;
            x = fx.masked;
        }
        c->status = sampler_sample(fx.smp, x, c->params, c->history, c->n_history, c->pos, &c->result);
        t->rows++;
        if (c->status != 0) {
            if (g->status != c->status)
                TEST_FAIL("n_vocab %d row %d (%s): status cpu %d (%s), gpu %d (%s)", n, r, what, c->status,
                          sampler_errstr(fx.smp), g->status, g->err);
            ASSERT_STREQ(sampler_errstr(fx.smp), g->err);
            ASSERT_EQ(-1, g->result.token);
            t->failed++;
            continue;
        }
        if (g->status != 0) TEST_FAIL("n_vocab %d row %d (%s): gpu failed: %s", n, r, what, g->err);
        const struct sampling_params *p = c->params;
        int greedy = !(p->temperature > 0 && p->top_k != 1 && isfinite(1.0f / p->temperature));
        if (kinds) ASSERT_EQ(kind_greedy(kinds[r]), greedy); /* the row is what its name says */
        if (greedy) {
            t->greedy++;
            if (c->result.token != g->result.token)
                TEST_FAIL("n_vocab %d row %d (%s): greedy token cpu %d, gpu %d", n, r, what, c->result.token,
                          g->result.token);
        } else {
            t->sampled++;
            int amb = 0;
            int32_t rt = ref_sample(x, n, c, &amb);
            if (!amb && rt != c->result.token)
                TEST_FAIL("n_vocab %d row %d (%s): the test's reference says %d, sampler_sample %d", n, r, what, rt,
                          c->result.token);
            if (c->result.token != g->result.token) {
                if (!amb)
                    TEST_FAIL("n_vocab %d row %d (%s): token cpu %d, gpu %d, and the draw is not near a boundary",
                              n, r, what, c->result.token, g->result.token);
                t->ambiguous_diff++;
                printf("  n_vocab %d row %d (%s): cpu %d, gpu %d: draw within %g of a boundary\n", n, r, what,
                       c->result.token, g->result.token, NEAR_REL);
                continue;
            }
        }
        ASSERT_EQ(c->result.is_stop, g->result.is_stop);
        /* Equal infinities are equal: a mask that allows fewer tokens than
         * top_logprobs leaves -inf in the rest of the list on both. */
        if (!(isinf(c->result.logprob) && c->result.logprob == g->result.logprob))
            ASSERT_NEAR(c->result.logprob, g->result.logprob, 1e-4);
        ASSERT_EQ(c->result.n_top, g->result.n_top);
        for (int32_t k = 0; k < c->result.n_top; k++) {
            if (c->result.top_token[k] != g->result.top_token[k])
                TEST_FAIL("n_vocab %d row %d (%s): top_token[%d] cpu %d, gpu %d", n, r, what, k,
                          c->result.top_token[k], g->result.top_token[k]);
            const float lc = c->result.top_logprob[k], lg = g->result.top_logprob[k];
            if (!(isinf(lc) && lc == lg)) ASSERT_NEAR(lc, lg, 1e-4);
        }
    }
}

/* Every kind of row, several times, at three vocabulary sizes; then the
 * same inputs again must give the same GPU results bit for bit. */
TEST(cuda_sample_matches_cpu) {
    static const int32_t vocabs[] = {1000, 32000, 128256};
    const int reps = 4, n_rows = K_COUNT * reps;
    struct tally t = {0};
    for (int v = 0; v < 3; v++) {
        int32_t n = vocabs[v];
        fx_open(n, n_rows);
        int kinds[K_COUNT * 4];
        for (int32_t r = 0; r < n_rows; r++) {
            kinds[r] = r % K_COUNT;
            make_row(r, kinds[r], n);
        }
        compare_rows(n, n_rows, kinds, &t);
        /* Determinism: the same call again. */
        struct backend_sample_row *first = malloc((size_t)n_rows * sizeof *first);
        if (!first) TEST_FAIL("out of memory");
        memcpy(first, fx.rows, (size_t)n_rows * sizeof *first);
        int rc = backend_sample(fx.gpu, fx.d_logits, n, fx.rows, n_rows);
        int same = rc == 0;
        for (int32_t r = 0; same && r < n_rows; r++)
            same = memcmp(&first[r].result, &fx.rows[r].result, sizeof first[r].result) == 0 &&
                   first[r].status == fx.rows[r].status;
        free(first);
        ASSERT_OK(rc);
        ASSERT_TRUE(same);
    }
    printf("  %d rows: %d greedy (exact), %d sampled, %d failing as the CPU does; %d sampled tokens differ at a "
           "boundary within %g\n",
           t.rows, t.greedy, t.sampled, t.failed, t.ambiguous_diff, NEAR_REL);
    ASSERT_TRUE(t.ambiguous_diff <= 2);
    fx_close();
}

static double now_ms(void) {
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return ts.tv_sec * 1e3 + ts.tv_nsec / 1e6;
}

/* Row r's mask, of kind m: 0 about a tenth of the tokens, 1 one token, 2
 * all but the strongest few, 3 a run of 200 ids, 4 none (an unmasked row
 * between masked ones). */
static void make_mask(int32_t r, int m, int32_t n) {
    struct backend_sample_row *row = &fx.rows[r];
    const float *x = fx.logits + (size_t)r * n;
    int32_t words = (n + 63) / 64;
    uint64_t *a = fx.allow + (size_t)r * words;
    row->allow = m == 4 ? NULL : a;
    memset(a, 0, (size_t)words * sizeof *a);
    switch (m) {
    case 0:
        for (int32_t i = 0; i < n; i++)
            if (rng_int(10) == 0) a[i / 64] |= 1ull << (i % 64);
        a[0] |= 1; /* never empty */
        break;
    case 1: {
        int32_t t = rng_int(n);
        a[t / 64] |= 1ull << (t % 64);
        break;
    }
    case 2: {
        for (int32_t i = 0; i < n; i++) a[i / 64] |= 1ull << (i % 64);
        /* The three strongest, and every NaN and +inf, are left out. */
        for (int k = 0; k < 3; k++) {
            int32_t best = -1;
            for (int32_t i = 0; i < n; i++)
                if (((a[i / 64] >> (i % 64)) & 1) && (best < 0 || x[i] > x[best])) best = i;
            if (best >= 0) a[best / 64] &= ~(1ull << (best % 64));
        }
        for (int32_t i = 0; i < n; i++)
            if (isnan(x[i]) || x[i] == INFINITY) a[i / 64] &= ~(1ull << (i % 64));
        break;
    }
    case 3: {
        int32_t lo = rng_int(n > 200 ? n - 200 : 1);
        for (int32_t i = lo; i < lo + 200 && i < n; i++) a[i / 64] |= 1ull << (i % 64);
        break;
    }
    default: break;
    }
}

/* Rows with a grammar's mask (backend_sample_row.allow), which the CUDA
 * backend applies on the device: every kind of row under each kind of
 * mask, unmasked rows between them, a mask that allows nothing (fails as
 * on the host), NaN and +inf logits left out by the mask (no failure, as
 * on the host, which masks before it checks), more masked rows than the
 * device's 64 slots; all as sampler_sample on the masked row.  Then the
 * time of 64 masked greedy rows on the device against the host path's
 * download, mask and sampler. */
TEST(cuda_sample_masked_rows) {
    static const int32_t vocabs[] = {1000, 32000, 128256};
    const int32_t n_rows = K_COUNT * 5 + 2;
    struct tally t = {0};
    for (int v = 0; v < 3; v++) {
        int32_t n = vocabs[v];
        fx_open(n, n_rows);
        int kinds[K_COUNT * 5 + 2];
        for (int32_t r = 0; r < n_rows - 2; r++) {
            kinds[r] = r % K_COUNT;
            make_row(r, kinds[r], n);
            make_mask(r, (r / K_COUNT + r) % 5, n);
        }
        /* Nothing allowed: every logit -inf. */
        kinds[n_rows - 2] = K_TEMP;
        make_row(n_rows - 2, K_TEMP, n);
        make_mask(n_rows - 2, 1, n);
        memset(fx.allow + (size_t)(n_rows - 2) * ((n + 63) / 64), 0, (size_t)((n + 63) / 64) * sizeof(uint64_t));
        /* A NaN and a -NaN the mask leaves out. */
        kinds[n_rows - 1] = K_NAN;
        make_row(n_rows - 1, K_NAN, n);
        make_mask(n_rows - 1, 2, n);
        compare_rows(n, n_rows, kinds, &t);
        ASSERT_EQ(STATUS_INTERNAL, fx.rows[n_rows - 2].status);
        ASSERT_EQ(0, fx.rows[n_rows - 1].status);
        for (int32_t r = 0; r < n_rows; r++)
            if (fx.rows[r].allow && fx.rows[r].status == 0) {
                int32_t tok = fx.rows[r].result.token;
                if (!((fx.rows[r].allow[tok / 64] >> (tok % 64)) & 1))
                    TEST_FAIL("n_vocab %d row %d: token %d is outside its mask", n, r, tok);
            }
    }
    printf("  %d rows: %d greedy (exact), %d sampled, %d failing as the CPU does; %d sampled tokens differ at a "
           "boundary within %g\n", t.rows, t.greedy, t.sampled, t.failed, t.ambiguous_diff, NEAR_REL);
    ASSERT_TRUE(t.ambiguous_diff <= 2);
    for (int v = 1; v < 3; v++) {
        const int32_t n = vocabs[v], m = 64;
        fx_open(n, m);
        for (int32_t r = 0; r < m; r++) {
            make_row(r, K_GREEDY_TIE, n);
            make_mask(r, r % 4, n);
        }
        struct tally tt = {0};
        compare_rows(n, m, NULL, &tt);
        const int iters = 20;
        ASSERT_OK(backend_sample(fx.gpu, fx.d_logits, n, fx.rows, m));
        double t0 = now_ms();
        for (int it = 0; it < iters; it++) ASSERT_OK(backend_sample(fx.gpu, fx.d_logits, n, fx.rows, m));
        double gpu_ms = (now_ms() - t0) / iters;
        float *buf = malloc((size_t)n * sizeof(float));
        if (!buf) TEST_FAIL("out of memory");
        t0 = now_ms();
        for (int32_t r = 0; r < m; r++) {
            ASSERT_OK(backend_download(fx.gpu, buf, fx.d_logits + (size_t)r * n, (size_t)n * sizeof(float)));
            const uint64_t *a = fx.rows[r].allow;
            for (int32_t i = 0; i < n; i++)
                if (!((a[i / 64] >> (i % 64)) & 1)) buf[i] = -INFINITY;
            struct backend_sample_row *c = &fx.ref[r];
            ASSERT_OK(sampler_sample(fx.smp, buf, c->params, c->history, c->n_history, c->pos, &c->result));
        }
        double host_ms = now_ms() - t0;
        free(buf);
        printf("  n_vocab %d, %d masked greedy rows: gpu %.3f ms, host (download + mask + sampler) %.3f ms\n", n, m,
               gpu_ms, host_ms);
    }
    fx_close();
}

/* More penalised rows than the device keeps slots for (64): several
 * launches in one call. */
TEST(cuda_sample_many_penalised_rows) {
    const int32_t n = 5000, n_rows = 150;
    fx_open(n, n_rows);
    int kinds[150];
    for (int32_t r = 0; r < n_rows; r++) {
        kinds[r] = r % 5 == 4 ? K_TOPK : (r % 2 ? K_PEN : K_PEN_GREEDY);
        make_row(r, kinds[r], n);
    }
    struct tally t = {0};
    compare_rows(n, n_rows, kinds, &t);
    printf("  %d rows (%d greedy, %d sampled), %d differ at a boundary\n", t.rows, t.greedy, t.sampled,
           t.ambiguous_diff);
    ASSERT_TRUE(t.ambiguous_diff <= 1);
    fx_close();
}

/* 2000 draws from one broad distribution: the token histograms of GPU and
 * CPU.  30 tokens share about half the mass (each at 8 to 9 over logits of
 * at most 4.5), so whatever the seed the draws spread over dozens of
 * tokens (random peaks of 4 to 12 sometimes left one or two tokens with
 * all of top-p's 0.95). */
TEST(cuda_sample_histogram) {
    const int32_t n = 32000, n_rows = 250, calls = 8;
    fx_open(n, n_rows);
    float *one = malloc((size_t)n * sizeof(float));
    int32_t *hg = calloc((size_t)n, sizeof(int32_t)), *hc = calloc((size_t)n, sizeof(int32_t));
    if (!one || !hg || !hc) TEST_FAIL("out of memory");
    fill_base(one, n);
    for (int32_t i = 0; i < 30; i++) one[rng_int(n)] = rng_f(8, 9);
    struct tally t = {0};
    uint64_t seed = rng_u32();
    for (int c = 0; c < calls; c++) {
        for (int32_t r = 0; r < n_rows; r++) {
            memcpy(fx.logits + (size_t)r * n, one, (size_t)n * sizeof(float));
            struct sampling_params *p = &fx.params[r];
            sampling_params_default(p);
            p->temperature = 1.0f;
            p->top_p = 0.95f;
            p->min_p = 0.001f;
            p->seed = seed + (uint64_t)(c * n_rows + r);
            memset(&fx.rows[r], 0, sizeof fx.rows[r]);
            fx.rows[r].params = p;
            fx.rows[r].pos = 17;
        }
        compare_rows(n, n_rows, NULL, &t);
        for (int32_t r = 0; r < n_rows; r++) {
            hg[fx.rows[r].result.token]++;
            hc[fx.ref[r].result.token]++;
        }
    }
    int64_t l1 = 0;
    int32_t distinct = 0;
    for (int32_t i = 0; i < n; i++) {
        l1 += llabs((long long)hg[i] - hc[i]);
        distinct += hc[i] > 0;
    }
    printf("  %d draws over %d distinct tokens: histograms differ in %lld of %d draws; %d single draws differ "
           "at a boundary\n",
           t.rows, distinct, (long long)(l1 / 2), t.rows, t.ambiguous_diff);
    ASSERT_TRUE(distinct > 10);
    ASSERT_TRUE(l1 / 2 <= 2);
    free(one);
    free(hg);
    free(hc);
    fx_close();
}

/* Time per call at n_vocab 128256, one row of each kind alone and 64 mixed
 * rows (printed; the results are still compared against the host sampler,
 * which is also timed with its download). */
TEST(cuda_sample_timing) {
    static const int solo[] = {K_GREEDY_TIE, K_TEMP, K_TOPK, K_TOPP, K_TOPP_PEAKED, K_ALL, K_PEN};
    const int32_t n = 128256, n_mixed = 64, n_solo = 7, n_rows = n_mixed + n_solo;
    fx_open(n, n_rows);
    for (int32_t r = 0; r < n_mixed; r++) make_row(r, r % 2 ? K_ALL : K_TOPP, n);
    for (int32_t s = 0; s < n_solo; s++) make_row(n_mixed + s, solo[s], n);
    struct tally t = {0};
    compare_rows(n, n_rows, NULL, &t);
    float *buf = malloc((size_t)n * sizeof(float));
    if (!buf) TEST_FAIL("out of memory");
    for (int32_t s = -1; s < n_solo; s++) {
        int32_t r0 = s < 0 ? 0 : n_mixed + s, m = s < 0 ? n_mixed : 1;
        const int iters = 20;
        ASSERT_OK(backend_sample(fx.gpu, fx.d_logits + (size_t)r0 * n, n, fx.rows + r0, m)); /* warm-up */
        double t0 = now_ms();
        for (int it = 0; it < iters; it++)
            ASSERT_OK(backend_sample(fx.gpu, fx.d_logits + (size_t)r0 * n, n, fx.rows + r0, m));
        double gpu_ms = (now_ms() - t0) / iters;
        t0 = now_ms();
        for (int32_t r = r0; r < r0 + m; r++) {
            ASSERT_OK(backend_download(fx.gpu, buf, fx.d_logits + (size_t)r * n, (size_t)n * sizeof(float)));
            struct backend_sample_row *c = &fx.ref[r];
            ASSERT_OK(sampler_sample(fx.smp, buf, c->params, c->history, c->n_history, c->pos, &c->result));
        }
        double host_ms = now_ms() - t0;
        printf("  n_vocab %d, %2d row(s) %-28s gpu %7.3f ms, host (download + sampler) %8.3f ms\n", n, m,
               s < 0 ? "(top_p | everything+logprobs)" : kind_name[solo[s]], gpu_ms, host_ms);
    }
    free(buf);
    ASSERT_TRUE(t.ambiguous_diff <= 1);
    fx_close();
}

/* The kernel's top-p prefilter levels, (zmax - z) / T <= cut (kept in step
 * with sample_cut in kernels/cuda/sample.cu); the last entry is past them. */
static const float level_cut[] = {0.0f, 1.15f, 2.3f, 3.45f, 4.6f, 6.9f, 9.2f, 13.8f, 20.0f};
#define N_LEVEL_BANDS 8

/* Row r: the top token at 0, g tokens with (zmax - z) / T spread inside
 * band b of the levels (T = 1), the rest 40 or more below (weight 0 in the
 * kernel's fixed point); top_p puts the cut near the middle of the band's
 * weight.  top_k > 0 keeps the top-k set around it. */
static void make_band_row(int32_t r, int32_t n, int b, int32_t g, int32_t top_k) {
    float *x = fx.logits + (size_t)r * n;
    struct sampling_params *p = &fx.params[r];
    struct backend_sample_row *row = &fx.rows[r];
    sampling_params_default(p);
    memset(row, 0, sizeof *row);
    row->params = p;
    row->history = fx.hist + (size_t)r * HIST_MAX;
    row->pos = rng_int(1 << 20);
    p->seed = ((uint64_t)rng_u32() << 32) | rng_u32();
    p->temperature = 1.0f;
    p->top_k = top_k;
    for (int32_t i = 0; i < n; i++) x[i] = -40.0f - rng_f(0, 5);
    int32_t top = rng_int(n);
    x[top] = 0.0f;
    const float lo = level_cut[b] + 0.05f, hi = level_cut[b + 1] - 0.05f;
    double mass = 0;
    for (int32_t k = 0; k < g; k++) {
        int32_t i = rng_int(n);
        while (i == top || x[i] > -40.0f) i = (i + 1) % n;
        x[i] = -rng_f(lo, hi);
        mass += expf(x[i]);
    }
    p->top_p = (float)((1 + mass / 2) / (1 + mass));
    if (!(p->top_p < 1)) p->top_p = 0.99999f;
    char err[160];
    if (sampling_params_validate(p, n, err, sizeof err) != 0) TEST_FAIL("band row %d: %s", r, err);
}

/* top-p whose cut lies in each band of the prefilter's levels (small and
 * large bands, with and without top-k), in a band larger than the kernel's
 * list (the full select instead), past the last level, and on a flat row
 * (every token in the first level): all exactly as sampler_sample, but for
 * draws near a boundary. */
TEST(cuda_sample_top_p_levels) {
    const int32_t n = 32000, per_band = 3, n_rows = N_LEVEL_BANDS * per_band + 4;
    fx_open(n, n_rows);
    struct tally t = {0};
    for (int rep = 0; rep < 2; rep++) {
        int32_t r = 0;
        for (int b = 0; b < N_LEVEL_BANDS; b++) {
            make_band_row(r++, n, b, 40, 0);
            make_band_row(r++, n, b, 4000, 0);
            make_band_row(r++, n, b, 300, 1000);
        }
        make_band_row(r++, n, 3, 6000, 0); /* the band is over the list's 4096 */
        make_band_row(r++, n, 4, 9000, 0);
        for (int k = 0; k < 2; k++, r++) { /* flat: every token in level 0 */
            make_band_row(r, n, 0, 0, 0);
            float *x = fx.logits + (size_t)r * n;
            for (int32_t i = 0; i < n; i++) x[i] = rng_f(-0.01f, 0.01f);
            fx.params[r].top_p = k ? 0.9f : 0.3f;
        }
        compare_rows(n, n_rows, NULL, &t);
    }
    printf("  %d rows (%d sampled), %d differ at a boundary within %g\n", t.rows, t.sampled, t.ambiguous_diff,
           NEAR_REL);
    ASSERT_EQ(t.rows, t.sampled);
    ASSERT_TRUE(t.ambiguous_diff <= 2);
    fx_close();
}

TEST_MAIN(cuda_sample_matches_cpu, cuda_sample_top_p_levels, cuda_sample_many_penalised_rows, cuda_sample_masked_rows,
          cuda_sample_histogram, cuda_sample_timing)
