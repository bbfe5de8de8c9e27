/* Metrics: a registry of counters, gauges and histograms that renders the
 * Prometheus text exposition format (version 0.0.4), for the /metrics
 * endpoint every long-running process serves (common/httpd.h).
 *
 * A family is one metric name with a fixed list of label names; a series is
 * one combination of label values in it.  Callers look a series up once (at
 * start, for the label values they know: finish reasons, status codes, the
 * stage) and then update it on the hot path with atomic operations only: no
 * lock, no allocation, no lookup.
 *
 *   static const char *const reason[] = {"finished_reason", NULL};
 *   static const struct metrics_def def = {
 *       METRICS_COUNTER, "llm_request_success_total",
 *       "Requests finished, by finish reason.", reason};
 *   metrics *m; metrics_family *f;
 *   metrics_init(&m);
 *   if (metrics_family_new(m, &def, &f, err, sizeof err) < 0) ...;
 *   metrics_series *stop = metrics_series_get(f, (const char *[]){"stop"});
 *   metrics_counter_inc(stop);                  // any thread, any time
 *   char *text; size_t len;
 *   metrics_render(m, &text, &len);             // then free(text)
 *
 * Thread safety: every function may be called from any thread.  A registry's
 * families and series live until metrics_free, which no other thread may be
 * running concurrently with. */
#ifndef COMMON_METRICS_H
#define COMMON_METRICS_H

#include <stddef.h>
#include <stdint.h>

typedef struct metrics metrics;
typedef struct metrics_family metrics_family;
typedef struct metrics_series metrics_series;

enum metrics_type {
    METRICS_COUNTER = 0,   /* only goes up; the name must end in _total */
    METRICS_GAUGE = 1,     /* set to the current value, up or down */
    METRICS_HISTOGRAM = 2, /* observations counted into fixed buckets, with their sum */
};

/* Most label values one family accepts: a bound on what a bad caller (a
 * label taken from outside) can make the registry hold and render. */
#define METRICS_SERIES_MAX 1024
/* Longest label value, in bytes. */
#define METRICS_LABEL_VALUE_MAX 256

/* One family, as a caller declares it (a static table of these reads well). */
struct metrics_def {
    enum metrics_type type;
    const char *name;   /* [a-z_][a-z0-9_]*, at most 128 bytes, not starting with
                           __; a counter's ends in _total, no other type's in
                           _total, _bucket, _sum or _count.  Callers use an llm_
                           prefix and base units (seconds, bytes) */
    const char *help;   /* for # HELP: UTF-8, not empty (escaped on output) */
    const char *const *labels; /* label names, NULL-terminated; NULL: none.  At
                                  most 8, named as metrics are (without the
                                  suffix rules), no repeats; a histogram may
                                  not use "le" */
    const double *bounds; /* histograms: the buckets' upper bounds, finite and
                             strictly increasing (+Inf is added); else NULL */
    int n_bounds;         /* histograms: 1 to 64 */
};

/* An empty registry.  Returns 0, or STATUS_NO_MEMORY. */
int metrics_init(metrics **out);
/* Frees the registry with all its families and series (NULL is a no-op). */
void metrics_free(metrics *m);

/* Adds a family.  Every string in def is copied.  A family without labels
 * gets its one series now, so it renders (as 0) before its first update.
 * Returns 0 and *out (owned by the registry); STATUS_BAD_INPUT with a message
 * in err naming the metric and the value for a bad name, label, bound or a
 * name that is taken (also by a histogram's _bucket, _sum or _count);
 * STATUS_NO_MEMORY. */
int metrics_family_new(metrics *m, const struct metrics_def *def, metrics_family **out,
                       char *err, size_t errlen);

/* The series for these label values, one per label name of the family in
 * the same order (NULL for a family without labels), created on first use.
 * Label values may hold any UTF-8 text.  The series is owned by the registry
 * and stays valid until metrics_free.  Takes the family's lock: look series
 * up once, not per update.  Returns NULL, after a warning in the log naming
 * the metric and the value, for a NULL value, a value that is not UTF-8 or
 * longer than METRICS_LABEL_VALUE_MAX, a family already holding
 * METRICS_SERIES_MAX series, or no memory. */
metrics_series *metrics_series_get(metrics_family *f, const char *const *values);

/* Hot-path updates: lock-free, allocation-free.  Each asserts that the series
 * is of its type.  A counter ignores v < 0 and NaN (a counter never goes
 * down); a histogram ignores NaN. */
void metrics_counter_add(metrics_series *s, double v);
void metrics_counter_inc(metrics_series *s);
void metrics_gauge_set(metrics_series *s, double v);
void metrics_gauge_add(metrics_series *s, double v); /* v may be negative */
void metrics_histogram_observe(metrics_series *s, double v);

/* Reads, for tests and for callers that derive values: a counter's or
 * gauge's value, a histogram's sum; a histogram's number of observations. */
double metrics_series_value(const metrics_series *s);
uint64_t metrics_histogram_count(const metrics_series *s);

/* The registry in the Prometheus text format: families in the order they
 * were added, each with # HELP and # TYPE, series in the order they were
 * created (families without series are left out).  Returns 0 with a
 * NUL-terminated text in *out (the caller frees it) and its length in *len
 * (may be NULL), or STATUS_NO_MEMORY. */
int metrics_render(metrics *m, char **out, size_t *len);

/* Writes v as the format writes sample values: the shortest decimal that
 * reads back as v, "+Inf", "-Inf" or "NaN".  buf holds at least 32 bytes. */
void metrics_format_value(double v, char *buf, size_t size);

#endif
