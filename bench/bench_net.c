/* bench_net: a 1xS pipeline's throughput across hosts for each stage-link
 * element type (--link-dtype) and link rate (issue 32).  It builds the
 * network-namespace test bed of tests/net/netbed.h -- Redis on host "db",
 * the router on "ctl", stage k on "s<k>", the client on "cli", every
 * host's link but the client's capped with tc tbf at the rate measured --
 * starts the real redis-server, llm-router and llm-workers there with
 * CURVE keys, and runs a fixed load through libllmclient: greedy requests
 * of fixed prompt and output lengths (distinct prompts, EOS ignored) at a
 * few concurrency levels.  Each repetition starts every type's cluster
 * again and runs each level at every rate back to back.  Per (type, rate,
 * level) it prints generated tokens/s, time to first token, the bytes the
 * stage hosts sent per token crossing a link and the workers' CPU time per
 * generated token; then what each rate costs against the first one listed,
 * as ratios of the runs measured back to back.  The rate "loopback" runs
 * every stage on one host (the links on its loopback, no cap): the
 * baseline the issue compares the 1 Gbit/s bed with.
 *
 *   bench_net                                   # wide synthetic, 4 types x 10gbit,1gbit
 *   bench_net --dtypes f32,int8 --rates loopback,1gbit --concurrency 16
 *   bench_net --model ../shared/models/pycode/pycode-target-f16.gguf
 *
 * The default model is a synthetic one (worker/synth.h) 16384 wide -- the
 * hidden width of Llama 3.1 405B, so a link carries that model's bytes per
 * token (64 KB in F32, 32 KB in F16) -- with layers about as light as a
 * model can have (one 16-wide attention head, a 16-wide feed-forward, 260
 * tokens: 1.8M weights a layer): a CPU stage computes a token's layer in
 * less time than 1 Gbit/s takes to carry its F32 row (0.52 ms), as a GPU
 * stage of a real model would.  A real layer of that width (3.2G weights
 * in the 405B) would take this CPU most of a second a token, and no link
 * would matter; with the standard attention (heads x head_dim = dim) a
 * layer is at least 2 x dim^2 weights, which is why the head width is set
 * apart (llm-synth --head-dim).
 *
 * Needs root for network namespaces; without them it says why and exits
 * 3 (other failures 1, bad options 2).  Speed numbers go in docs/deploy.md,
 * never in a test's assertions. */
#include "tests/net/netbed.h"

#include "common/log.h"
#include "common/model.h"
#include "common/options.h"
#include "worker/synth.h"

#include <limits.h>
#include <stdatomic.h>
#include <sys/utsname.h>

#define BN_LIST_MAX 8
#define BN_REPEAT_MAX 16
#define BN_CONC_MAX 256

struct bn_opts {
    const char *model, *type, *dtypes_s, *rates_s, *conc_s, *router_args, *worker_args, *tmpdir;
    int dim, layers, heads, head_dim, ffn, vocab, stages, prompt_tokens, max_tokens, requests, repeat,
        time_limit_s;
    char dtypes[BN_LIST_MAX][16], rates[BN_LIST_MAX][16];
    int conc[BN_LIST_MAX], n_dtypes, n_rates, n_conc;
};

/* One measured repetition of a level. */
struct bn_run {
    double tok_s, ttft_p50_ms, ttft_p90_ms, bytes_per_tok;
    double hop_mbit_s; /* a link's mean rate over the level */
    double cpu_ms_per_tok; /* the workers' CPU time (user + system) per generated token */
    long long tokens;
};

struct bn_row {
    int dtype, rate, conc, n_runs;
    struct bn_run runs[BN_REPEAT_MAX];
};

static struct bn_row bn_rows[BN_LIST_MAX * BN_LIST_MAX * BN_LIST_MAX];
/* Set by SIGTERM/SIGINT: the streams send no new request, the level in
 * progress is not counted, and the run ends through nb_free (processes
 * stopped, namespaces deleted) with the table of what was measured. */
static volatile sig_atomic_t bn_stop;
static int bn_n_rows;
static int64_t bn_deadline_ms;
static int bn_timed_out;

/* snprintf through a function: a path or message cut to fit its buffer
 * is not a warning (a cut message is still a message). */
static void bn_fmt(char *out, size_t size, const char *fmt, ...) __attribute__((format(printf, 3, 4)));
static void bn_fmt(char *out, size_t size, const char *fmt, ...) {
    va_list ap;
    va_start(ap, fmt);
    vsnprintf(out, size, fmt, ap);
    va_end(ap);
}

static void bn_on_signal(int sig) {
    (void)sig;
    bn_stop = 1;
}

static double bn_now(void) {
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (double)ts.tv_sec + (double)ts.tv_nsec * 1e-9;
}

/* Splits a comma-separated list into out (each at most 15 characters). */
static int bn_split(const char *flag, const char *s, char out[][16], int *n, char *err, size_t errlen) {
    *n = 0;
    for (const char *p = s; p && *p;) {
        const char *end = strchr(p, ',');
        size_t len = end ? (size_t)(end - p) : strlen(p);
        if (len == 0 || len > 15 || *n >= BN_LIST_MAX) {
            snprintf(err, errlen, "--%s \"%s\": items of 1 to 15 characters, at most %d", flag, s, BN_LIST_MAX);
            return -1;
        }
        memcpy(out[*n], p, len);
        out[(*n)++][len] = 0;
        p = end ? end + 1 : NULL;
    }
    if (*n == 0) {
        snprintf(err, errlen, "--%s: empty list", flag);
        return -1;
    }
    return 0;
}

static int bn_parse_lists(struct bn_opts *o, char *err, size_t errlen) {
    if (bn_split("dtypes", o->dtypes_s, o->dtypes, &o->n_dtypes, err, errlen) ||
        bn_split("rates", o->rates_s, o->rates, &o->n_rates, err, errlen))
        return -1;
    static const char *const types[] = {"f32", "f16", "bf16", "int8"};
    for (int i = 0; i < o->n_dtypes; i++) {
        int ok = 0;
        for (int k = 0; k < 4; k++) ok |= strcmp(o->dtypes[i], types[k]) == 0;
        if (!ok) {
            snprintf(err, errlen, "--dtypes: \"%s\" is not f32, f16, bf16 or int8", o->dtypes[i]);
            return -1;
        }
    }
    for (int i = 0; i < o->n_rates; i++) {
        const char *r = o->rates[i];
        char *end;
        double v = strtod(r, &end);
        /* tc's own units; "none": the bridge uncapped; "loopback": one host */
        if (strcmp(r, "none") != 0 && strcmp(r, "loopback") != 0 &&
            !(v > 0 && (strcmp(end, "kbit") == 0 || strcmp(end, "mbit") == 0 || strcmp(end, "gbit") == 0))) {
            snprintf(err, errlen, "--rates: \"%s\" is not N kbit/mbit/gbit, none or loopback", r);
            return -1;
        }
    }
    char conc[BN_LIST_MAX][16];
    if (bn_split("concurrency", o->conc_s, conc, &o->n_conc, err, errlen)) return -1;
    for (int i = 0; i < o->n_conc; i++) {
        char *end;
        long v = strtol(conc[i], &end, 10);
        if (*end || v < 1 || v > BN_CONC_MAX) {
            snprintf(err, errlen, "--concurrency: \"%s\" is not an integer in [1, %d]", conc[i], BN_CONC_MAX);
            return -1;
        }
        o->conc[i] = (int)v;
    }
    return 0;
}

/* Bytes a device of a namespace sent so far ("ip -s link": the line after
 * "TX:"). */
static uint64_t bn_tx_bytes(const char *ns, const char *dev) {
    char cmd[256], line[256];
    snprintf(cmd, sizeof cmd, NB_IP " -n %s -s link show %s", ns, dev);
    FILE *f = popen(cmd, "r");
    if (!f) return 0;
    unsigned long long v = 0;
    int want = 0;
    while (fgets(line, sizeof line, f)) {
        if (want && sscanf(line, " %llu", &v) == 1) break;
        want = strstr(line, "TX:") != NULL;
    }
    pclose(f);
    return v;
}

/* CPU time (user + system, ms) the cluster's workers used so far: what the
 * other engineers' load on a shared machine changes least. */
static double bn_workers_cpu_ms(const struct cluster *cl) {
    double ms = 0;
    long hz = sysconf(_SC_CLK_TCK);
    for (int i = 0; i < cl->n_workers; i++) {
        char path[64], buf[1024];
        snprintf(path, sizeof path, "/proc/%d/stat", (int)cl->workers[i].pid);
        FILE *f = fopen(path, "r");
        if (!f) continue;
        size_t n = fread(buf, 1, sizeof buf - 1, f);
        fclose(f);
        buf[n] = 0;
        /* fields 14 and 15 (utime, stime), counted after the ")" that ends
         * the command name */
        const char *p = strrchr(buf, ')');
        unsigned long long ut = 0, st = 0;
        if (p && sscanf(p + 2, "%*c %*d %*d %*d %*d %*d %*u %*u %*u %*u %*u %llu %llu", &ut, &st) == 2)
            ms += (double)(ut + st) * 1000.0 / (double)hz;
    }
    return ms;
}

/* ---- the load --------------------------------------------------------------- */

struct bn_level {
    const struct bn_opts *o;
    struct cluster *cl;
    int32_t n_vocab;
    int n_req, first_id;
    atomic_int next, ready, go, n_err;
    atomic_llong tokens;
    double t0;
    double *ttft_ms; /* per request */
    char err[512];
    pthread_mutex_t mu;
};

struct bn_req {
    double sent, first;
};

static int bn_on_chunk(void *ud, const struct llm_chunk *ch) {
    struct bn_req *r = ud;
    if (r->first == 0 && ch->n_tokens > 0) r->first = bn_now();
    return 0;
}

/* Prompt ids of request idx: distinct per request, so that the router's
 * prefix cache finds nothing and every prompt crosses the links. */
static void bn_prompt(int idx, int32_t n_vocab, int32_t *ids, int n) {
    int32_t lo = 3; /* past the specials */
    uint64_t x = 0x9e3779b97f4a7c15ULL * (uint64_t)(idx + 1) + 0x632be59bd9b4e019ULL;
    for (int i = 0; i < n; i++) {
        x ^= x >> 12;
        x ^= x << 25;
        x ^= x >> 27;
        ids[i] = lo + (int32_t)((x * 0x2545f4914f6cdd1dULL >> 33) % (uint64_t)(n_vocab - lo));
    }
}

static void bn_level_error(struct bn_level *lv, const char *fmt, ...) __attribute__((format(printf, 2, 3)));
static void bn_level_error(struct bn_level *lv, const char *fmt, ...) {
    atomic_fetch_add(&lv->n_err, 1);
    pthread_mutex_lock(&lv->mu);
    if (!lv->err[0]) {
        va_list ap;
        va_start(ap, fmt);
        vsnprintf(lv->err, sizeof lv->err, fmt, ap);
        va_end(ap);
    }
    pthread_mutex_unlock(&lv->mu);
}

/* One stream of a closed loop: sends the level's next request when its
 * last one ended, until all are taken. */
static void *bn_stream(void *arg) {
    struct bn_level *lv = arg;
    const struct bn_opts *o = lv->o;
    const char *eps[1] = {lv->cl->client_ep};
    struct llm_client_config cfg;
    llm_client_config_default(&cfg);
    cfg.endpoints = eps;
    cfg.n_endpoints = 1;
    cfg.zmq_ctx = lv->cl->zctx;
    cfg.idle_timeout_ms = 10000;
    cfg.retry_ms = 30000;
    llm_client *c = NULL;
    char err[256];
    int32_t *ids = malloc((size_t)o->prompt_tokens * sizeof *ids);
    if (llm_client_open(&c, &cfg, err, sizeof err) != 0) {
        bn_level_error(lv, "llm_client_open: %s", err);
        c = NULL;
    }
    /* Connected (CURVE handshake done) before the clock starts. */
    Llm__ClientEnvelope *env = NULL;
    if (c && llm_client_health(c, &env) == 0) proto_client_free(env);
    atomic_fetch_add(&lv->ready, 1);
    while (!atomic_load(&lv->go)) h_sleep_ms(1);
    while (c && ids && !bn_stop) {
        int idx = atomic_fetch_add(&lv->next, 1);
        if (idx >= lv->n_req) break;
        bn_prompt(lv->first_id + idx, lv->n_vocab, ids, o->prompt_tokens);
        struct llm_generate_params p;
        llm_generate_params_default(&p);
        p.prompt_tokens = ids;
        p.n_prompt_tokens = (size_t)o->prompt_tokens;
        p.max_tokens = (uint32_t)o->max_tokens;
        p.sampling.ignore_eos = 1; /* every request generates exactly max_tokens */
        p.stream = true;
        p.wait_ms = 120000;
        struct bn_req r = {bn_now(), 0};
        struct llm_generate_result res;
        int rc = llm_client_generate(c, &p, bn_on_chunk, &r, &res);
        if (rc < 0) {
            bn_level_error(lv, "request %d: %s", idx, llm_client_errstr(c));
        } else {
            if (res.finish_reason != LLM__GENERATE_DONE__FINISH_REASON__LENGTH ||
                res.tokens_received != (uint32_t)o->max_tokens)
                bn_level_error(lv, "request %d (%s): %s after %u tokens (%s), expected LENGTH after %d", idx,
                               res.request_id, llm_finish_reason_name(res.finish_reason), res.tokens_received,
                               res.error_message, o->max_tokens);
            atomic_fetch_add(&lv->tokens, (long long)res.tokens_received);
            llm_generate_result_free(&res);
        }
        lv->ttft_ms[idx] = r.first > 0 ? (r.first - r.sent) * 1000.0 : -1;
    }
    free(ids);
    if (c) llm_client_close(c);
    return NULL;
}

static int bn_cmp_double(const void *a, const void *b) {
    double x = *(const double *)a, y = *(const double *)b;
    return x < y ? -1 : x > y;
}

/* Nearest-rank percentile (q in (0, 1]) of n values; sorts v. */
static double bn_percentile(double *v, int n, double q) {
    if (n <= 0) return 0;
    qsort(v, (size_t)n, sizeof *v, bn_cmp_double);
    int k = (int)(q * n + 0.999999);
    if (k < 1) k = 1;
    if (k > n) k = n;
    return v[k - 1];
}

/* Runs one level (conc streams, n_req requests) on the running cluster;
 * the bytes are what link_dev of each namespace in link_ns sent: across
 * hosts every stage host's but the last's eth0 (each carries one link's
 * hidden states), on one host its lo (all the links). */
static void bn_level_run(const struct bn_opts *o, struct netbed *nb, int32_t n_vocab, int conc, int n_req,
                         const char *const *link_ns, int n_links, const char *link_dev, struct bn_run *out) {
    int hops = o->stages - 1;
    static int next_id;
    struct bn_level lv;
    memset(&lv, 0, sizeof lv);
    lv.o = o;
    lv.cl = nb->cl;
    lv.n_vocab = n_vocab;
    lv.n_req = n_req;
    lv.first_id = next_id;
    next_id += n_req;
    lv.ttft_ms = calloc((size_t)n_req, sizeof *lv.ttft_ms);
    pthread_mutex_init(&lv.mu, NULL);
    pthread_t th[BN_CONC_MAX];
    for (int i = 0; i < conc; i++) pthread_create(&th[i], NULL, bn_stream, &lv);
    while (atomic_load(&lv.ready) < conc) h_sleep_ms(1);
    uint64_t tx0[NB_HOSTS_MAX], tx1[NB_HOSTS_MAX];
    for (int k = 0; k < n_links; k++) tx0[k] = bn_tx_bytes(link_ns[k], link_dev);
    double cpu0 = bn_workers_cpu_ms(nb->cl);
    lv.t0 = bn_now();
    atomic_store(&lv.go, 1);
    for (int i = 0; i < conc; i++) pthread_join(th[i], NULL);
    double secs = bn_now() - lv.t0;
    double cpu1 = bn_workers_cpu_ms(nb->cl);
    uint64_t sent = 0;
    for (int k = 0; k < n_links; k++) {
        tx1[k] = bn_tx_bytes(link_ns[k], link_dev);
        sent += tx1[k] - tx0[k];
    }
    if (atomic_load(&lv.n_err) > 0) {
        free(lv.ttft_ms);
        H_FAIL(nb->cl, "%d of %d requests failed; the first: %s", atomic_load(&lv.n_err), n_req, lv.err);
    }
    memset(out, 0, sizeof *out);
    out->tokens = atomic_load(&lv.tokens);
    out->tok_s = (double)out->tokens / secs;
    out->ttft_p50_ms = bn_percentile(lv.ttft_ms, n_req, 0.5);
    out->ttft_p90_ms = bn_percentile(lv.ttft_ms, n_req, 0.9);
    /* every position of every request crosses each link once, but the
     * last generated token (it is only sampled) */
    double positions = (double)n_req * (o->prompt_tokens + o->max_tokens - 1);
    out->bytes_per_tok = (double)sent / hops / positions;
    out->hop_mbit_s = (double)sent / hops / secs * 8e-6;
    out->cpu_ms_per_tok = out->tokens > 0 ? (cpu1 - cpu0) / (double)out->tokens : 0;
    free(lv.ttft_ms);
    pthread_mutex_destroy(&lv.mu);
}

/* ---- the cluster per type and rate ---------------------------------------- */

static const char *const bn_hosts[] = {"db", "ctl", "s0", "s1", "s2", "s3", "cli", NULL};

static void bn_caps(struct netbed *nb, int stages, const char *rate) {
    const char *capped[] = {"db", "ctl", "s0", "s1", "s2", "s3"};
    for (int i = 0; i < 2 + stages; i++) nb_cap(nb, capped[i], strcmp(rate, "none") == 0 ? NULL : rate);
}

static struct bn_row *bn_row_get(int dtype, int rate, int conc) {
    for (int i = 0; i < bn_n_rows; i++)
        if (bn_rows[i].dtype == dtype && bn_rows[i].rate == rate && bn_rows[i].conc == conc) return &bn_rows[i];
    struct bn_row *r = &bn_rows[bn_n_rows++];
    memset(r, 0, sizeof *r);
    r->dtype = dtype;
    r->rate = rate;
    r->conc = conc;
    return r;
}

/* One cluster of link type dtype; runs every rate in rates[] (indices into
 * o->rates) on it, levels and repeats inside. */
static void bn_cluster_run(const struct bn_opts *o, const char *model, int32_t n_vocab, int dtype, int loopback,
                           const int *rates, int n_rates, int rep) {
    struct netbed *nb = nb_init(bn_hosts);
    if (loopback) snprintf(nb->worker_host, sizeof nb->worker_host, "s0");
    char wx[512], rx[512];
    snprintf(wx, sizeof wx, "--link-dtype %s %s", o->dtypes[dtype], o->worker_args);
    snprintf(rx, sizeof rx, "%s", o->router_args);
    struct nb_cluster_opts co = {1, o->stages, rx, wx, 0};
    double t0 = bn_now();
    nb_cluster_start(nb, model, &co);
    printf("  %s: cluster %s up in %.1f s\n", o->dtypes[dtype], loopback ? "on one host" : "across hosts",
           bn_now() - t0);
    fflush(stdout);
    const char *link_ns[NB_HOSTS_MAX];
    int n_links = loopback ? 1 : o->stages - 1;
    for (int k = 0; k < n_links; k++) {
        char h[16];
        snprintf(h, sizeof h, "s%d", k);
        link_ns[k] = nb_host(nb, h)->ns;
    }
    /* The rates take turns within each level (tc replaces the caps in a
     * few ms), and each repetition starts the clusters of every type again
     * (bn_main): a change of the machine's other load then falls on every
     * rate and type alike instead of on the ones measured last. */
    const char *dev = loopback ? "lo" : "eth0";
    if (!loopback) bn_caps(nb, o->stages, o->rates[rates[0]]);
    /* A warm-up request: first touch of the weights and the KV pages, and
     * the connections between the stages. */
    struct bn_run warm;
    bn_level_run(o, nb, n_vocab, 1, 1, link_ns, n_links, dev, &warm);
    for (int ci = 0; ci < o->n_conc; ci++) {
        int conc = o->conc[ci];
        int n_req = o->requests > 0 ? o->requests : (conc < 4 ? 4 : conc);
        if (n_req < conc) n_req = conc;
        for (int ri = 0; ri < n_rates; ri++) {
            if (bn_stop) break;
            if (h_now_ms() > bn_deadline_ms) {
                bn_timed_out = 1;
                break;
            }
            int rate = rates[ri];
            if (!loopback && n_rates > 1) bn_caps(nb, o->stages, o->rates[rate]);
            struct bn_row *row = bn_row_get(dtype, rate, conc);
            struct bn_run *run = &row->runs[row->n_runs];
            bn_level_run(o, nb, n_vocab, conc, n_req, link_ns, n_links, dev, run);
            if (bn_stop) break;
            row->n_runs++;
            printf("  %-4s %-8s c=%-3d #%d: %d requests, %6.1f gen tok/s, TTFT p50 %6.1f ms p90 %6.1f ms, "
                   "%7.1f link bytes/token, a link's mean %6.1f Mbit/s, workers' CPU %.2f ms/token\n",
                   o->dtypes[dtype], o->rates[rate], conc, rep + 1, n_req, run->tok_s, run->ttft_p50_ms,
                   run->ttft_p90_ms, run->bytes_per_tok, run->hop_mbit_s, run->cpu_ms_per_tok);
            fflush(stdout);
        }
    }
    nb_free(nb);
}

/* ---- report ------------------------------------------------------------------ */

static double bn_median(double *v, int n) {
    if (n <= 0) return 0;
    qsort(v, (size_t)n, sizeof *v, bn_cmp_double);
    return n % 2 ? v[n / 2] : (v[n / 2 - 1] + v[n / 2]) / 2;
}

/* Median, min and max of one field over a row's runs. */
static void bn_stat(const struct bn_row *r, size_t off, double *med, double *lo, double *hi) {
    double v[BN_REPEAT_MAX];
    for (int i = 0; i < r->n_runs; i++) v[i] = *(const double *)((const char *)&r->runs[i] + off);
    *med = bn_median(v, r->n_runs);
    *lo = r->n_runs ? v[0] : 0;
    *hi = r->n_runs ? v[r->n_runs - 1] : 0;
}

static const struct bn_row *bn_row_find(int dtype, int rate, int conc) {
    for (int i = 0; i < bn_n_rows; i++)
        if (bn_rows[i].dtype == dtype && bn_rows[i].rate == rate && bn_rows[i].conc == conc) return &bn_rows[i];
    return NULL;
}

static void bn_report(const struct bn_opts *o) {
    printf("\n| link dtype | rate | concurrency | gen tok/s (median, min-max) | TTFT p50 ms (median, min-max) | "
           "link bytes/token | a link's mean Mbit/s | workers' CPU ms/token |\n|---|---|---|---|---|---|---|---|\n");
    for (int d = 0; d < o->n_dtypes; d++)
        for (int ra = 0; ra < o->n_rates; ra++)
            for (int c = 0; c < o->n_conc; c++) {
                const struct bn_row *r = bn_row_find(d, ra, o->conc[c]);
                if (!r || r->n_runs == 0) {
                    printf("| %s | %s | %d | not measured (time limit or signal) | | | | |\n", o->dtypes[d],
                           o->rates[ra], o->conc[c]);
                    continue;
                }
                double tm, tl, th, fm, fl, fh, bm, bl, bh, mm, ml, mh, cm, cl, ch;
                bn_stat(r, offsetof(struct bn_run, tok_s), &tm, &tl, &th);
                bn_stat(r, offsetof(struct bn_run, ttft_p50_ms), &fm, &fl, &fh);
                bn_stat(r, offsetof(struct bn_run, bytes_per_tok), &bm, &bl, &bh);
                bn_stat(r, offsetof(struct bn_run, hop_mbit_s), &mm, &ml, &mh);
                bn_stat(r, offsetof(struct bn_run, cpu_ms_per_tok), &cm, &cl, &ch);
                printf("| %s | %s | %d | %.1f (%.1f-%.1f) | %.0f (%.0f-%.0f) | %.0f | %.0f | %.2f |\n", o->dtypes[d],
                       o->rates[ra], o->conc[c], tm, tl, th, fm, fl, fh, bm, mm, cm);
            }
    if (o->n_rates < 2) return;
    /* Repetition k of every rate ran back to back (bn_cluster_run), so the
     * ratio of a pair cancels most of the drift of the machine's load; the
     * median pair and the extreme pairs are shown. */
    printf("\nEach rate against %s: gen tok/s and TTFT p50 of the runs measured back to back, as a ratio "
           "(median pair, min-max):\n\n| link dtype | concurrency |", o->rates[0]);
    for (int ra = 1; ra < o->n_rates; ra++) printf(" %s tok/s | %s TTFT |", o->rates[ra], o->rates[ra]);
    printf("\n|---|---|");
    for (int ra = 1; ra < o->n_rates; ra++) printf("---|---|");
    printf("\n");
    for (int d = 0; d < o->n_dtypes; d++)
        for (int c = 0; c < o->n_conc; c++) {
            printf("| %s | %d |", o->dtypes[d], o->conc[c]);
            const struct bn_row *base = bn_row_find(d, 0, o->conc[c]);
            for (int ra = 1; ra < o->n_rates; ra++) {
                const struct bn_row *r = bn_row_find(d, ra, o->conc[c]);
                int n = base && r ? (base->n_runs < r->n_runs ? base->n_runs : r->n_runs) : 0;
                double t[BN_REPEAT_MAX], f[BN_REPEAT_MAX];
                int nt = 0, nf = 0;
                for (int k = 0; k < n; k++) {
                    if (base->runs[k].tok_s > 0) t[nt++] = r->runs[k].tok_s / base->runs[k].tok_s;
                    if (base->runs[k].ttft_p50_ms > 0) f[nf++] = r->runs[k].ttft_p50_ms / base->runs[k].ttft_p50_ms;
                }
                if (nt == 0 || nf == 0) {
                    printf(" - | - |");
                    continue;
                }
                double tm = bn_median(t, nt), fm = bn_median(f, nf); /* sorts */
                printf(" %.2f (%.2f-%.2f) | %.2f (%.2f-%.2f) |", tm, t[0], t[nt - 1], fm, f[0], f[nf - 1]);
            }
            printf("\n");
        }
}

/* date, machine, commit and load: what a table in the docs needs next to it */
static void bn_header(const char *command, const char *model, const struct model_hparams *hp) {
    time_t now = time(NULL);
    char date[64];
    strftime(date, sizeof date, "%Y-%m-%d %H:%M UTC", gmtime(&now));
    struct utsname u;
    uname(&u);
    char cpu[128] = "?", line[256];
    FILE *f = fopen("/proc/cpuinfo", "r");
    while (f && fgets(line, sizeof line, f))
        if (strncmp(line, "model name", 10) == 0) {
            const char *c = strchr(line, ':');
            bn_fmt(cpu, sizeof cpu, "%s", c ? c + 2 : line);
            cpu[strcspn(cpu, "\n")] = 0;
            break;
        }
    if (f) fclose(f);
    char commit[64] = "?", dirty[16] = "";
    f = popen("git -C " LLM_SOURCE_DIR " rev-parse --short HEAD 2>/dev/null", "r");
    if (f && fgets(commit, sizeof commit, f)) commit[strcspn(commit, "\n")] = 0;
    if (f) pclose(f);
    f = popen("git -C " LLM_SOURCE_DIR " status --porcelain --untracked-files=no 2>/dev/null | wc -l", "r");
    if (f && fgets(dirty, sizeof dirty, f)) dirty[strcspn(dirty, "\n")] = 0;
    if (f) pclose(f);
    double load[3] = {0, 0, 0};
    getloadavg(load, 3);
    printf("bench_net %s on %s (%s, %ld CPUs, kernel %s), commit %s (%s tracked files changed), load %.2f %.2f "
           "%.2f\n", date, u.nodename, cpu, sysconf(_SC_NPROCESSORS_ONLN), u.release, commit, dirty, load[0],
           load[1], load[2]);
    printf("command: %s\nmodel %s: dim %d, %d layers, attention %d x %d, ffn %d, vocab %d; a row is %d bytes in "
           "f32, %d in f16/bf16, %d in int8\n",
           command, model, hp->dim, hp->n_layers, hp->n_heads, hp->head_dim, hp->ffn_dim, hp->n_vocab, hp->dim * 4,
           hp->dim * 2, hp->dim + 4);
    fflush(stdout);
}

/* The synthetic model of the options, written once into tmpdir and kept
 * (its name says its shape). */
static int bn_synth(const struct bn_opts *o, char *path, size_t size, char *err, size_t errlen) {
    struct synth_config cfg;
    memset(&cfg, 0, sizeof cfg);
    synth_shape_preset("tiny", &cfg.shape);
    cfg.shape.n_layers = o->layers;
    cfg.shape.dim = o->dim;
    cfg.shape.n_heads = o->heads;
    cfg.shape.n_kv_heads = 1;
    cfg.shape.head_dim = o->head_dim;
    cfg.shape.ffn_dim = o->ffn;
    cfg.shape.n_vocab = o->vocab;
    cfg.shape.ctx_len = 1024;
    while (cfg.shape.ctx_len < o->prompt_tokens + o->max_tokens + 16) cfg.shape.ctx_len *= 2;
    int t = -1;
    for (int i = 0; synth_type_names[i]; i++)
        if (strcmp(synth_type_names[i], o->type) == 0) t = i;
    if (t < 0) {
        snprintf(err, errlen, "--type %s: not a synthetic weight type", o->type);
        return -1;
    }
    cfg.type = (enum synth_type)t;
    cfg.seed = 1;
    cfg.name = "bench-net-wide";
    snprintf(path, size, "%s/bench-net-d%d-l%d-h%dx%d-f%d-v%d-c%d-%s.gguf", o->tmpdir, o->dim, o->layers, o->heads,
             o->head_dim, o->ffn, o->vocab, cfg.shape.ctx_len, o->type);
    if (access(path, R_OK) == 0) return 0;
    char tmp[PATH_MAX];
    bn_fmt(tmp, sizeof tmp, "%s.%d", path, (int)getpid());
    if (synth_write(&cfg, tmp, err, errlen) != 0) return -1;
    if (rename(tmp, path) != 0) {
        bn_fmt(err, errlen, "rename %s: %s", tmp, strerror(errno));
        unlink(tmp);
        return -1;
    }
    return 0;
}

static char bn_command[2048]; /* the command line as given, for the header */

static int bn_main(struct bn_opts *o) {
    char model[PATH_MAX], err[1024];
    if (o->model) {
        snprintf(model, sizeof model, "%s", o->model);
    } else if (bn_synth(o, model, sizeof model, err, sizeof err) != 0) {
        fprintf(stderr, "bench_net: synthetic model: %s\n", err);
        return 1;
    }
    model_file *m = NULL;
    if (model_file_open(&m, model, err, sizeof err) != 0) {
        fprintf(stderr, "bench_net: %s\n", err);
        return 1;
    }
    struct model_hparams hp = *model_file_hparams(m);
    model_file_close(m);
    if (hp.n_layers < o->stages) {
        fprintf(stderr, "bench_net: %s has %d layers, fewer than --stages %d\n", model, hp.n_layers, o->stages);
        return 2;
    }
    if (o->prompt_tokens + o->max_tokens > hp.ctx_len) {
        fprintf(stderr, "bench_net: --prompt-tokens %d + --max-tokens %d exceed the model's context %d\n",
                o->prompt_tokens, o->max_tokens, hp.ctx_len);
        return 2;
    }
    bn_header(bn_command, model, &hp);
    bn_deadline_ms = h_now_ms() + (int64_t)o->time_limit_s * 1000;
    int bed[BN_LIST_MAX], n_bed = 0, lo = -1;
    for (int r = 0; r < o->n_rates; r++) {
        if (strcmp(o->rates[r], "loopback") == 0) lo = r;
        else bed[n_bed++] = r;
    }
    /* The one-host cluster and the bed take turns at going first: the
     * first after a bed's teardown shares the machine with the kernel's
     * clean-up of its namespaces. */
    for (int rep = 0; rep < o->repeat; rep++)
        for (int d = 0; d < o->n_dtypes; d++)
            for (int k = 0; k < 2; k++) {
                int one_host = (k + rep) % 2 == 0;
                if (bn_stop || h_now_ms() > bn_deadline_ms) break;
                if (one_host && lo >= 0) bn_cluster_run(o, model, hp.n_vocab, d, 1, &lo, 1, rep);
                if (!one_host && n_bed > 0) bn_cluster_run(o, model, hp.n_vocab, d, 0, bed, n_bed, rep);
            }
    bn_report(o);
    if (bn_stop) {
        printf("\nbench_net: stopped by a signal; the levels measured before it are above\n");
        return 1;
    }
    if (bn_timed_out || h_now_ms() > bn_deadline_ms)
        printf("\nbench_net: the time limit (--time-limit-s %d) ended the run before every level was measured\n",
               o->time_limit_s);
    return 0;
}

int main(int argc, char **argv) {
    static struct bn_opts o;
    const struct option_def defs[] = {
        {"model", "LLM_MODEL", OPTION_STRING, NULL, "GGUF file or HF directory; none: the wide synthetic below",
         &o.model, 0, 0, NULL},
        {"dim", NULL, OPTION_INT, "16384", "synthetic: hidden width (a link row is dim elements)", &o.dim, 2,
         1 << 20, NULL},
        {"layers", NULL, OPTION_INT, "3", "synthetic: layers (one a stage by default)", &o.layers, 1, 1000, NULL},
        {"heads", NULL, OPTION_INT, "1", "synthetic: attention heads (one key/value head)", &o.heads, 1, 1024,
         NULL},
        {"head-dim", NULL, OPTION_INT, "16", "synthetic: width of a head", &o.head_dim, 2, 1 << 16, NULL},
        {"ffn", NULL, OPTION_INT, "16", "synthetic: feed-forward width", &o.ffn, 1, 1 << 20, NULL},
        {"vocab", NULL, OPTION_INT, "260", "synthetic: vocabulary (260 is the least: bytes and specials)",
         &o.vocab, 260, 1 << 20, NULL},
        {"type", NULL, OPTION_STRING, "f16", "synthetic: weight types", &o.type, 0, 0, NULL},
        {"stages", NULL, OPTION_INT, "3", "stages of the pipeline, one host each", &o.stages, 2, 4, NULL},
        {"dtypes", NULL, OPTION_STRING, "f32,f16,bf16,int8", "--link-dtype values to measure", &o.dtypes_s, 0, 0,
         NULL},
        {"rates", NULL, OPTION_STRING, "10gbit,1gbit", "link rates (tc tbf: N kbit/mbit/gbit; none: uncapped; "
         "loopback: every stage on one host); the first is the one the others are compared with", &o.rates_s, 0,
         0, NULL},
        {"concurrency", NULL, OPTION_STRING, "1,4,16", "requests in flight, comma-separated", &o.conc_s, 0, 0,
         NULL},
        {"requests", NULL, OPTION_INT, "0", "requests per level (0: as many as the concurrency, at least 4)",
         &o.requests, 0, 100000, NULL},
        {"prompt-tokens", NULL, OPTION_INT, "128", "prompt length in tokens", &o.prompt_tokens, 1, 1 << 16, NULL},
        {"max-tokens", NULL, OPTION_INT, "128", "tokens generated per request", &o.max_tokens, 1, 1 << 16, NULL},
        {"repeat", NULL, OPTION_INT, "2", "runs of each level, each on fresh clusters of every type (the table "
         "gives median, min and max)", &o.repeat, 1,
         BN_REPEAT_MAX, NULL},
        {"time-limit-s", NULL, OPTION_INT, "270", "start no level after this many seconds", &o.time_limit_s, 1,
         86400, NULL},
        {"router-args", NULL, OPTION_STRING, "", "extra llm-router arguments, space-separated", &o.router_args, 0,
         0, NULL},
        {"worker-args", NULL, OPTION_STRING, "", "extra llm-worker arguments, space-separated", &o.worker_args, 0,
         0, NULL},
        {"tmpdir", "TMPDIR", OPTION_STRING, "/tmp", "where the synthetic model is written (and kept)", &o.tmpdir,
         0, 0, NULL},
    };
    struct options opts = {"bench_net", "[options]",
                           "Measures a 1xS pipeline across network-namespace hosts for each link dtype and rate.",
                           defs, (int)(sizeof defs / sizeof defs[0]), false};
    for (int i = 0; i < argc; i++) {
        size_t l = strlen(bn_command);
        bn_fmt(bn_command + l, sizeof bn_command - l, "%s%s", i ? " " : "", argv[i]);
    }
    char err[1024];
    int rc = options_parse(&opts, &argc, argv, err, sizeof err);
    if (rc == STATUS_CANCELLED) return 0;
    if (rc == STATUS_OK && argc > 1) {
        snprintf(err, sizeof err, "unexpected argument \"%s\"", argv[1]);
        rc = STATUS_BAD_INPUT;
    }
    if (rc == STATUS_OK && bn_parse_lists(&o, err, sizeof err) != 0) rc = STATUS_BAD_INPUT;
    if (rc != STATUS_OK) {
        fprintf(stderr, "bench_net: %s\n", err);
        return 2;
    }
    log_set_level(LL_WARN);
    signal(SIGPIPE, SIG_IGN);
    struct sigaction sa;
    memset(&sa, 0, sizeof sa);
    sa.sa_handler = bn_on_signal;
    sigaction(SIGTERM, &sa, NULL);
    sigaction(SIGINT, &sa, NULL);
    /* The bed's TEST_SKIP (no namespaces) and TEST_FAIL (a process that
     * died, a request that failed) end up here; nb_init's exit handler
     * stops what was started and keeps the logs. */
    int jumped = setjmp(test_jmp);
    if (jumped == 0) return bn_main(&o);
    if (jumped == 2) {
        fprintf(stderr, "bench_net: the network-namespace test bed cannot be made here (the reason is above); "
                        "nothing was measured\n");
        return 3;
    }
    fprintf(stderr, "bench_net: the run failed (above); the cluster's logs are kept\n");
    return 1;
}
