/* Tests for common/metrics: the exact text of every metric type, escaping,
 * value formatting, name and label checks, bounded series, exact totals
 * under concurrent updates, and promtool's verdict on the output. */
#include "common/log.h"
#include "common/metrics.h"
#include "common/status.h"
#include "tests/test.h"

#include <pthread.h>
#include <stdint.h>
#include <sys/wait.h>
#include <unistd.h>

static metrics_family *t_family(metrics *m, const struct metrics_def *def) {
    char err[256] = "";
    metrics_family *f = NULL;
    int rc = metrics_family_new(m, def, &f, err, sizeof err);
    if (rc != 0) TEST_FAIL("metrics_family_new(%s): %d %s", def->name, rc, err);
    return f;
}

static char *t_render(metrics *m) {
    char *text = NULL;
    size_t len = 0;
    ASSERT_OK(metrics_render(m, &text, &len));
    ASSERT_EQ(strlen(text), len);
    return text;
}

static const char *const t_reason[] = {"finished_reason", NULL};
static const char *const t_stage[] = {"stage", NULL};
static const double t_bounds[] = {0.005, 0.1, 1, 2.5};

TEST(metrics_render_counter_and_gauge) {
    metrics *m;
    ASSERT_OK(metrics_init(&m));
    metrics_family *fin = t_family(m, &(struct metrics_def){.type = METRICS_COUNTER,
        .name = "llm_request_success_total", .help = "Requests finished, by finish reason.", .labels = t_reason});
    metrics_family *run = t_family(m, &(struct metrics_def){.type = METRICS_GAUGE,
        .name = "llm_num_requests_running", .help = "Requests in a running batch."});
    metrics_family *tok = t_family(m, &(struct metrics_def){.type = METRICS_COUNTER,
        .name = "llm_prompt_tokens_total", .help = "Prompt tokens processed."});
    metrics_series *stop = metrics_series_get(fin, (const char *[]){"stop"});
    metrics_series *length = metrics_series_get(fin, (const char *[]){"length"});
    ASSERT_TRUE(stop && length);
    ASSERT_TRUE(stop == metrics_series_get(fin, (const char *[]){"stop"}));
    metrics_counter_inc(stop);
    metrics_counter_inc(stop);
    metrics_counter_add(length, 5);
    metrics_series *r = metrics_series_get(run, NULL);
    metrics_gauge_set(r, 7);
    metrics_gauge_add(r, -2.5);
    metrics_counter_add(metrics_series_get(tok, NULL), 1234567);
    char *text = t_render(m);
    ASSERT_STREQ("# HELP llm_request_success_total Requests finished, by finish reason.\n"
                 "# TYPE llm_request_success_total counter\n"
                 "llm_request_success_total{finished_reason=\"stop\"} 2\n"
                 "llm_request_success_total{finished_reason=\"length\"} 5\n"
                 "# HELP llm_num_requests_running Requests in a running batch.\n"
                 "# TYPE llm_num_requests_running gauge\n"
                 "llm_num_requests_running 4.5\n"
                 "# HELP llm_prompt_tokens_total Prompt tokens processed.\n"
                 "# TYPE llm_prompt_tokens_total counter\n"
                 "llm_prompt_tokens_total 1234567\n",
                 text);
    free(text);
    metrics_free(m);
}

TEST(metrics_render_histogram) {
    metrics *m;
    ASSERT_OK(metrics_init(&m));
    metrics_family *h = t_family(m, &(struct metrics_def){.type = METRICS_HISTOGRAM,
        .name = "llm_step_time_seconds", .help = "Time of one step.", .labels = t_stage, .bounds = t_bounds, .n_bounds = 4});
    t_family(m, &(struct metrics_def){.type = METRICS_HISTOGRAM,
        .name = "llm_request_queue_time_seconds", .help = "Time waiting.", .labels = NULL, .bounds = t_bounds, .n_bounds = 1});
    metrics_series *s0 = metrics_series_get(h, (const char *[]){"0"});
    metrics_series *s1 = metrics_series_get(h, (const char *[]){"1"});
    /* A value equal to a bound counts in that bound's bucket. */
    metrics_histogram_observe(s0, 0.005);
    metrics_histogram_observe(s0, 0.05);
    metrics_histogram_observe(s0, 0.5);
    metrics_histogram_observe(s0, 1);
    metrics_histogram_observe(s0, 3);
    metrics_histogram_observe(s0, NAN);
    ASSERT_EQ((uint64_t)5, metrics_histogram_count(s0));
    ASSERT_NEAR(4.555, metrics_series_value(s0), 1e-12);
    metrics_histogram_observe(s1, 0.25);
    char *text = t_render(m);
    ASSERT_STREQ("# HELP llm_step_time_seconds Time of one step.\n"
                 "# TYPE llm_step_time_seconds histogram\n"
                 "llm_step_time_seconds_bucket{stage=\"0\",le=\"0.005\"} 1\n"
                 "llm_step_time_seconds_bucket{stage=\"0\",le=\"0.1\"} 2\n"
                 "llm_step_time_seconds_bucket{stage=\"0\",le=\"1\"} 4\n"
                 "llm_step_time_seconds_bucket{stage=\"0\",le=\"2.5\"} 4\n"
                 "llm_step_time_seconds_bucket{stage=\"0\",le=\"+Inf\"} 5\n"
                 "llm_step_time_seconds_sum{stage=\"0\"} 4.555\n"
                 "llm_step_time_seconds_count{stage=\"0\"} 5\n"
                 "llm_step_time_seconds_bucket{stage=\"1\",le=\"0.005\"} 0\n"
                 "llm_step_time_seconds_bucket{stage=\"1\",le=\"0.1\"} 0\n"
                 "llm_step_time_seconds_bucket{stage=\"1\",le=\"1\"} 1\n"
                 "llm_step_time_seconds_bucket{stage=\"1\",le=\"2.5\"} 1\n"
                 "llm_step_time_seconds_bucket{stage=\"1\",le=\"+Inf\"} 1\n"
                 "llm_step_time_seconds_sum{stage=\"1\"} 0.25\n"
                 "llm_step_time_seconds_count{stage=\"1\"} 1\n"
                 "# HELP llm_request_queue_time_seconds Time waiting.\n"
                 "# TYPE llm_request_queue_time_seconds histogram\n"
                 "llm_request_queue_time_seconds_bucket{le=\"0.005\"} 0\n"
                 "llm_request_queue_time_seconds_bucket{le=\"+Inf\"} 0\n"
                 "llm_request_queue_time_seconds_sum 0\n"
                 "llm_request_queue_time_seconds_count 0\n",
                 text);
    free(text);
    metrics_free(m);
}

TEST(metrics_escapes_labels_and_help) {
    metrics *m;
    ASSERT_OK(metrics_init(&m));
    static const char *const two[] = {"model", "path", NULL};
    metrics_family *f = t_family(m, &(struct metrics_def){.type = METRICS_GAUGE, .name = "llm_info",
        .help = "Back\\slash and\nnewline; \"quotes\" stay.", .labels = two});
    metrics_series *s =
        metrics_series_get(f, (const char *[]){"a\"b\\c\nd", "caf\xc3\xa9 \xe2\x82\xac"});
    ASSERT_TRUE(s != NULL);
    metrics_gauge_set(s, 1);
    char *text = t_render(m);
    ASSERT_STREQ("# HELP llm_info Back\\\\slash and\\nnewline; \"quotes\" stay.\n"
                 "# TYPE llm_info gauge\n"
                 "llm_info{model=\"a\\\"b\\\\c\\nd\",path=\"caf\xc3\xa9 \xe2\x82\xac\"} 1\n",
                 text);
    free(text);
    metrics_free(m);
}

TEST(metrics_formats_values) {
    static const struct {
        double v;
        const char *text;
    } cases[] = {
        {0, "0"}, {1, "1"}, {-2, "-2"}, {0.1, "0.1"}, {0.005, "0.005"}, {2.5, "2.5"},
        {1.0 / 3, "0.3333333333333333"}, {1e6, "1000000"}, {-0.0, "-0"}, {1e20, "1e+20"}, {123456789, "123456789"},
        {1.5e-7, "1.5e-07"}, {123456.5, "123456.5"}, {0.0001, "0.0001"},
    };
    char buf[32];
    for (size_t i = 0; i < sizeof cases / sizeof cases[0]; i++) {
        metrics_format_value(cases[i].v, buf, sizeof buf);
        ASSERT_STREQ(cases[i].text, buf);
        ASSERT_EQ(cases[i].v, strtod(buf, NULL));
    }
    metrics_format_value(INFINITY, buf, sizeof buf);
    ASSERT_STREQ("+Inf", buf);
    metrics_format_value(-INFINITY, buf, sizeof buf);
    ASSERT_STREQ("-Inf", buf);
    metrics_format_value(NAN, buf, sizeof buf);
    ASSERT_STREQ("NaN", buf);
}

/* Each bad definition is refused with STATUS_BAD_INPUT and a message that
 * holds the given text (the metric's name or the offending value). */
static void t_refused(metrics *m, const struct metrics_def *def, const char *says) {
    char err[256] = "";
    metrics_family *f = NULL;
    int rc = metrics_family_new(m, def, &f, err, sizeof err);
    if (rc != STATUS_BAD_INPUT)
        TEST_FAIL("%s: expected STATUS_BAD_INPUT, got %d", def->name ? def->name : "(null)", rc);
    if (!strstr(err, says)) TEST_FAIL("message \"%s\" does not say \"%s\"", err, says);
}

TEST(metrics_checks_definitions) {
    metrics *m;
    ASSERT_OK(metrics_init(&m));
    static const double down[] = {1, 0.5}, inf[] = {1, INFINITY};
    static const char *const le[] = {"le", NULL}, *const camel[] = {"finishReason", NULL},
                             *const twice[] = {"a", "a", NULL}, *const dunder[] = {"__x", NULL},
                             *const nine[] = {"a", "b", "c", "d", "e", "f", "g", "h", "i", NULL};
    t_refused(m, &(struct metrics_def){.type = METRICS_COUNTER, .name = "llm_requests", .help = "h"}, "_total");
    t_refused(m, &(struct metrics_def){.type = METRICS_GAUGE, .name = "llm_blocks_total", .help = "h"}, "_total");
    t_refused(m, &(struct metrics_def){.type = METRICS_GAUGE, .name = "llm_blocks_count", .help = "h"}, "_count");
    t_refused(m, &(struct metrics_def){.type = METRICS_GAUGE, .name = "llmBlocks", .help = "h"}, "'llmBlocks'");
    t_refused(m, &(struct metrics_def){.type = METRICS_GAUGE, .name = "llm:blocks", .help = "h"}, "'llm:blocks'");
    t_refused(m, &(struct metrics_def){.type = METRICS_GAUGE, .name = "9llm", .help = "h"}, "digit");
    t_refused(m, &(struct metrics_def){.type = METRICS_GAUGE, .name = "", .help = "h"}, "empty");
    t_refused(m, &(struct metrics_def){.type = METRICS_GAUGE, .name = NULL, .help = "h"}, "missing");
    t_refused(m, &(struct metrics_def){.type = METRICS_GAUGE, .name = "llm_x", .help = ""}, "help");
    t_refused(m, &(struct metrics_def){.type = METRICS_GAUGE, .name = "llm_x", .help = "bad \xff utf-8"}, "UTF-8");
    t_refused(m, &(struct metrics_def){.type = (enum metrics_type)7, .name = "llm_x", .help = "h"}, "type 7");
    t_refused(m, &(struct metrics_def){.type = METRICS_GAUGE, .name = "llm_x", .help = "h", .labels = camel}, "'finishReason'");
    t_refused(m, &(struct metrics_def){.type = METRICS_GAUGE, .name = "llm_x", .help = "h", .labels = twice}, "repeated");
    t_refused(m, &(struct metrics_def){.type = METRICS_GAUGE, .name = "llm_x", .help = "h", .labels = dunder}, "'__x'");
    t_refused(m, &(struct metrics_def){.type = METRICS_GAUGE, .name = "llm_x", .help = "h", .labels = nine}, "more than 8");
    t_refused(m, &(struct metrics_def){.type = METRICS_HISTOGRAM, .name = "llm_x", .help = "h", .labels = le, .bounds = t_bounds, .n_bounds = 4}, "'le'");
    t_refused(m, &(struct metrics_def){.type = METRICS_HISTOGRAM, .name = "llm_x", .help = "h"}, "bucket bounds");
    t_refused(m, &(struct metrics_def){.type = METRICS_HISTOGRAM, .name = "llm_x", .help = "h", .labels = NULL, .bounds = down, .n_bounds = 2},
              "bound 1 (0.5)");
    t_refused(m, &(struct metrics_def){.type = METRICS_HISTOGRAM, .name = "llm_x", .help = "h", .labels = NULL, .bounds = inf, .n_bounds = 2},
              "bound 1 (+Inf)");
    t_refused(m, &(struct metrics_def){.type = METRICS_GAUGE, .name = "llm_x", .help = "h", .labels = NULL, .bounds = t_bounds, .n_bounds = 4},
              "no bucket bounds");
    /* Taken names; a histogram's derived names are kept free by the suffix
     * rules. */
    t_family(m, &(struct metrics_def){.type = METRICS_GAUGE, .name = "llm_x", .help = "h"});
    t_family(m, &(struct metrics_def){.type = METRICS_HISTOGRAM, .name = "llm_t", .help = "h", .labels = NULL, .bounds = t_bounds, .n_bounds = 4});
    t_refused(m, &(struct metrics_def){.type = METRICS_GAUGE, .name = "llm_x", .help = "h"}, "clashes with the gauge");
    t_refused(m, &(struct metrics_def){.type = METRICS_GAUGE, .name = "llm_t_bucket", .help = "h"}, "_bucket");
    t_refused(m, &(struct metrics_def){.type = METRICS_HISTOGRAM, .name = "llm_t", .help = "h", .labels = NULL, .bounds = t_bounds, .n_bounds = 1},
              "clashes with the histogram llm_t");
    t_family(m, &(struct metrics_def){.type = METRICS_COUNTER, .name = "llm_u_sum_total", .help = "h"});
    /* Refusals leave nothing behind: only the three accepted families render. */
    char *text = t_render(m);
    ASSERT_EQ(3, (int)(strstr(text, "llm_u_sum_total 0") != NULL) +
                     (int)(strstr(text, "llm_x 0") != NULL) +
                     (int)(strstr(text, "llm_t_count 0") != NULL));
    free(text);
    metrics_free(m);
}

struct t_logged {
    int n;
    char last[512];
};

static void t_log(int level, const char *line, void *ud) {
    struct t_logged *l = ud;
    l->n++;
    snprintf(l->last, sizeof l->last, "%s", line);
}

TEST(metrics_series_bounded_and_checked) {
    metrics *m;
    ASSERT_OK(metrics_init(&m));
    metrics_family *f = t_family(m, &(struct metrics_def){.type = METRICS_COUNTER,
        .name = "llm_http_requests_total", .help = "Requests by status.", .labels = (const char *const[]){"code", NULL}});
    struct t_logged logged = {0};
    log_set_callback(t_log, &logged);
    metrics_series *bad_utf8 = metrics_series_get(f, (const char *[]){"\xc3("});
    int after_utf8 = logged.n;
    char long_value[METRICS_LABEL_VALUE_MAX + 2];
    memset(long_value, 'x', sizeof long_value - 1);
    long_value[sizeof long_value - 1] = 0;
    metrics_series *too_long = metrics_series_get(f, (const char *[]){long_value});
    metrics_series *missing = metrics_series_get(f, (const char *[]){NULL});
    int created = 0;
    for (int i = 0; i < METRICS_SERIES_MAX; i++) {
        char v[16];
        snprintf(v, sizeof v, "%d", i);
        created += metrics_series_get(f, (const char *[]){v}) != NULL;
    }
    metrics_series *over = metrics_series_get(f, (const char *[]){"one-too-many"});
    metrics_series *old = metrics_series_get(f, (const char *[]){"200"});
    log_set_callback(NULL, NULL);
    ASSERT_TRUE(bad_utf8 == NULL);
    ASSERT_EQ(1, after_utf8);
    ASSERT_TRUE(too_long == NULL);
    ASSERT_TRUE(missing == NULL);
    ASSERT_EQ(METRICS_SERIES_MAX, created);
    ASSERT_TRUE(over == NULL);
    ASSERT_TRUE(strstr(logged.last, "llm_http_requests_total") != NULL);
    ASSERT_TRUE(strstr(logged.last, "one-too-many") != NULL);
    ASSERT_TRUE(old != NULL); /* existing series are still found */
    ASSERT_EQ(4, logged.n);
    metrics_free(m);
}

TEST(metrics_counter_ignores_decrease) {
    metrics *m;
    ASSERT_OK(metrics_init(&m));
    metrics_family *f = t_family(m, &(struct metrics_def){.type = METRICS_COUNTER,
        .name = "llm_num_preemptions_total", .help = "Preemptions."});
    metrics_series *s = metrics_series_get(f, NULL);
    metrics_counter_add(s, 2);
    metrics_counter_add(s, -1);
    metrics_counter_add(s, NAN);
    metrics_counter_add(s, 0.5);
    ASSERT_EQ(2.5, metrics_series_value(s));
    /* A labelled family with no series yet renders nothing. */
    t_family(m, &(struct metrics_def){.type = METRICS_GAUGE, .name = "llm_gpu_memory_used_bytes", .help = "Used.",
                                      .labels = t_stage});
    char *text = t_render(m);
    ASSERT_TRUE(strstr(text, "llm_gpu_memory_used_bytes") == NULL);
    free(text);
    metrics_free(m);
}

#define T_THREADS 8
#define T_UPDATES 100000

struct t_worker {
    metrics_family *labelled;
    metrics_series *counter, *gauge, *hist;
    int id;
};

static void *t_update(void *arg) {
    struct t_worker *w = arg;
    char v[16];
    snprintf(v, sizeof v, "%d", w->id % 4);
    /* Threads race to create the same four series. */
    metrics_series *mine = metrics_series_get(w->labelled, (const char *[]){v});
    for (int i = 0; i < T_UPDATES; i++) {
        metrics_counter_inc(w->counter);
        metrics_gauge_add(w->gauge, (i & 1) ? -1 : 2);
        metrics_histogram_observe(w->hist, (double)(i % 4) * 0.5);
        if (mine) metrics_counter_inc(mine);
    }
    return NULL;
}

TEST(metrics_concurrent_updates_are_exact) {
    metrics *m;
    ASSERT_OK(metrics_init(&m));
    static const double b[] = {0.5, 1};
    metrics_family *c = t_family(m, &(struct metrics_def){.type = METRICS_COUNTER,
        .name = "llm_generation_tokens_total", .help = "Tokens."});
    metrics_family *g = t_family(m, &(struct metrics_def){.type = METRICS_GAUGE,
        .name = "llm_num_requests_waiting", .help = "Waiting."});
    metrics_family *h = t_family(m, &(struct metrics_def){.type = METRICS_HISTOGRAM,
        .name = "llm_inter_token_latency_seconds", .help = "ITL.", .labels = NULL, .bounds = b, .n_bounds = 2});
    metrics_family *l = t_family(m, &(struct metrics_def){.type = METRICS_COUNTER,
        .name = "llm_by_stage_total", .help = "By stage.", .labels = t_stage});
    struct t_worker w[T_THREADS];
    pthread_t th[T_THREADS];
    for (int i = 0; i < T_THREADS; i++) {
        w[i] = (struct t_worker){l, metrics_series_get(c, NULL), metrics_series_get(g, NULL),
                                 metrics_series_get(h, NULL), i};
        ASSERT_EQ(0, pthread_create(&th[i], NULL, t_update, &w[i]));
    }
    /* Scrapes while the threads update: each one stays well-formed, with
     * _count equal to the +Inf bucket. */
    for (int r = 0; r < 20; r++) {
        char *text = t_render(m);
        const char *inf = strstr(text, "llm_inter_token_latency_seconds_bucket{le=\"+Inf\"} ");
        const char *cnt = strstr(text, "llm_inter_token_latency_seconds_count ");
        ASSERT_TRUE(inf && cnt);
        ASSERT_EQ(strtoull(inf + strlen("llm_inter_token_latency_seconds_bucket{le=\"+Inf\"} "),
                           NULL, 10),
                  strtoull(cnt + strlen("llm_inter_token_latency_seconds_count "), NULL, 10));
        free(text);
    }
    for (int i = 0; i < T_THREADS; i++) pthread_join(th[i], NULL);
    const double n = (double)T_THREADS * T_UPDATES;
    ASSERT_EQ(n, metrics_series_value(w[0].counter));
    ASSERT_EQ(n / 2, metrics_series_value(w[0].gauge));
    ASSERT_EQ((uint64_t)n, metrics_histogram_count(w[0].hist));
    ASSERT_EQ(n / 4 * (0 + 0.5 + 1 + 1.5), metrics_series_value(w[0].hist));
    for (int s = 0; s < 4; s++) {
        char v[16];
        snprintf(v, sizeof v, "%d", s);
        metrics_series *x = metrics_series_get(l, (const char *[]){v});
        ASSERT_EQ(n / 4, metrics_series_value(x));
    }
    char *text = t_render(m);
    ASSERT_TRUE(strstr(text, "llm_inter_token_latency_seconds_bucket{le=\"0.5\"} 400000\n"));
    ASSERT_TRUE(strstr(text, "llm_inter_token_latency_seconds_bucket{le=\"1\"} 600000\n"));
    ASSERT_TRUE(strstr(text, "llm_inter_token_latency_seconds_bucket{le=\"+Inf\"} 800000\n"));
    ASSERT_TRUE(strstr(text, "llm_inter_token_latency_seconds_sum 600000\n"));
    free(text);
    metrics_free(m);
}

/* promtool's exit status on text (its lint output goes to the test's log),
 * or -1 when promtool is not installed. */
static int t_promtool(const char *text) {
    if (system("command -v promtool >/dev/null 2>&1") != 0) return -1;
    char path[] = "/tmp/llm_metrics_XXXXXX";
    int fd = mkstemp(path);
    if (fd < 0) TEST_FAIL("mkstemp failed");
    size_t len = strlen(text);
    ssize_t w = write(fd, text, len);
    close(fd);
    if (w != (ssize_t)len) TEST_FAIL("write %s failed", path);
    char cmd[256];
    snprintf(cmd, sizeof cmd, "promtool check metrics < %s", path);
    fflush(stdout);
    int st = system(cmd);
    printf("\n"); /* promtool's lint lines end without one */
    unlink(path);
    return WIFEXITED(st) ? WEXITSTATUS(st) : 128;
}

TEST(metrics_promtool_accepts_output) {
    metrics *m;
    ASSERT_OK(metrics_init(&m));
    metrics_family *fin = t_family(m, &(struct metrics_def){.type = METRICS_COUNTER,
        .name = "llm_request_success_total", .help = "Requests finished, by finish reason.", .labels = t_reason});
    metrics_family *kv = t_family(m, &(struct metrics_def){.type = METRICS_GAUGE,
        .name = "llm_kv_blocks_used", .help = "KV blocks in use \\ \"held\"\nby sequences.", .labels = t_stage});
    metrics_family *ttft = t_family(m, &(struct metrics_def){.type = METRICS_HISTOGRAM,
        .name = "llm_time_to_first_token_seconds", .help = "Time to the first token.", .labels = NULL, .bounds = t_bounds, .n_bounds = 4});
    metrics_family *step = t_family(m, &(struct metrics_def){.type = METRICS_HISTOGRAM,
        .name = "llm_step_time_seconds", .help = "Time of one step.", .labels = t_stage, .bounds = t_bounds, .n_bounds = 4});
    metrics_counter_add(metrics_series_get(fin, (const char *[]){"stop"}), 3);
    metrics_counter_add(metrics_series_get(fin, (const char *[]){"a \"quoted\\ \n reason"}), 1);
    metrics_gauge_set(metrics_series_get(kv, (const char *[]){"0"}), 12);
    metrics_histogram_observe(metrics_series_get(ttft, NULL), 0.2);
    metrics_histogram_observe(metrics_series_get(step, (const char *[]){"0"}), 0.01);
    metrics_histogram_observe(metrics_series_get(step, (const char *[]){"1"}), 7);
    char *text = t_render(m);
    int rc = t_promtool(text);
    free(text);
    metrics_free(m);
    if (rc < 0)
        TEST_SKIP("promtool is not installed (Debian package prometheus); the format was not "
                  "checked by it");
    ASSERT_EQ(0, rc);
    /* The check can fail: a counter without _total, as this module refuses
     * to write it, is flagged. */
    ASSERT_NE(0, t_promtool("# HELP llm_requests Requests.\n# TYPE llm_requests counter\n"
                            "llm_requests 1\n"));
}

TEST_MAIN(metrics_render_counter_and_gauge, metrics_render_histogram,
          metrics_escapes_labels_and_help, metrics_formats_values, metrics_checks_definitions,
          metrics_series_bounded_and_checked, metrics_counter_ignores_decrease,
          metrics_concurrent_updates_are_exact, metrics_promtool_accepts_output)
