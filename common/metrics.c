/* Metrics registry: families of counters, gauges and histograms, updated with
 * atomics on the hot path and rendered in the Prometheus text format. */
#include "metrics.h"
#include "log.h"
#include "status.h"

#include <assert.h>
#include <math.h>
#include <pthread.h>
#include <stdarg.h>
#include <stdatomic.h>
#include <stdbool.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#define METRICS_NAME_MAX 128
#define METRICS_LABELS_MAX 8
#define METRICS_BOUNDS_MAX 64

/* Values are doubles kept as their bit patterns in 64-bit atomics: C11 has
 * no atomic add on floating point, and an integer compare-and-swap is
 * lock-free everywhere we build. */
struct metrics_series {
    const metrics_family *f;
    _Atomic uint64_t value;   /* counter or gauge value; a histogram's sum */
    char **values;            /* f->n_labels label values, copied */
    metrics_series *next;     /* creation order */
    /* Histograms: f->n_bounds + 1 counts, not cumulative (each observation
     * lands in one bucket; rendering sums them), the last for values above
     * every bound.  The count is their sum, so _count always equals the
     * +Inf bucket even while other threads observe. */
    _Atomic uint64_t buckets[];
};

struct metrics_family {
    enum metrics_type type;
    char *name;
    char *help;
    char **labels;
    int n_labels;
    double *bounds;
    int n_bounds;
    pthread_mutex_t lock;     /* the series list */
    metrics_series *first, *last;
    int n_series;
    metrics_family *next;     /* registration order */
};

struct metrics {
    pthread_mutex_t lock;     /* the family list */
    metrics_family *first, *last;
};

static uint64_t d2b(double d) {
    uint64_t b;
    memcpy(&b, &d, sizeof b);
    return b;
}

static double b2d(uint64_t b) {
    double d;
    memcpy(&d, &b, sizeof d);
    return d;
}

static void atomic_add_double(_Atomic uint64_t *p, double v) {
    uint64_t old = atomic_load_explicit(p, memory_order_relaxed);
    while (!atomic_compare_exchange_weak_explicit(p, &old, d2b(b2d(old) + v),
                                                  memory_order_relaxed, memory_order_relaxed)) {
    }
}

static const char *const type_names[] = {"counter", "gauge", "histogram"};

int metrics_init(metrics **out) {
    metrics *m = calloc(1, sizeof *m);
    if (!m) return STATUS_NO_MEMORY;
    pthread_mutex_init(&m->lock, NULL);
    *out = m;
    return STATUS_OK;
}

static void series_free(metrics_series *s, int n_labels) {
    if (!s) return;
    if (s->values)
        for (int i = 0; i < n_labels; i++) free(s->values[i]);
    free(s->values);
    free(s);
}

static void family_free(metrics_family *f) {
    if (!f) return;
    for (metrics_series *s = f->first, *next; s; s = next) {
        next = s->next;
        series_free(s, f->n_labels);
    }
    if (f->labels)
        for (int i = 0; i < f->n_labels; i++) free(f->labels[i]);
    free(f->labels);
    free(f->bounds);
    free(f->name);
    free(f->help);
    pthread_mutex_destroy(&f->lock);
    free(f);
}

void metrics_free(metrics *m) {
    if (!m) return;
    for (metrics_family *f = m->first, *next; f; f = next) {
        next = f->next;
        family_free(f);
    }
    pthread_mutex_destroy(&m->lock);
    free(m);
}

/* ---- validation ---------------------------------------------------------- */

/* Lower-case snake_case: the format allows more (upper case, colons), but
 * promtool's lint flags camelCase and colons are reserved for recording
 * rules, so a name that passes here passes there. */
static const char *name_problem(const char *name) {
    size_t n = strlen(name);
    if (n == 0) return "is empty";
    if (n > METRICS_NAME_MAX) return "is longer than 128 bytes";
    if (name[0] >= '0' && name[0] <= '9') return "starts with a digit";
    if (name[0] == '_' && name[1] == '_') return "starts with __ (reserved)";
    for (size_t i = 0; i < n; i++) {
        char c = name[i];
        if (!((c >= 'a' && c <= 'z') || (c >= '0' && c <= '9') || c == '_'))
            return "holds a character outside [a-z0-9_]";
    }
    return NULL;
}

static bool ends_with(const char *s, const char *suffix) {
    size_t n = strlen(s), k = strlen(suffix);
    return n >= k && strcmp(s + n - k, suffix) == 0;
}

static bool utf8_valid(const char *s) {
    const unsigned char *p = (const unsigned char *)s;
    while (*p) {
        unsigned c = *p;
        int n;
        uint32_t cp, min;
        if (c < 0x80) {
            p++;
            continue;
        } else if ((c & 0xe0) == 0xc0) {
            n = 1, cp = c & 0x1f, min = 0x80;
        } else if ((c & 0xf0) == 0xe0) {
            n = 2, cp = c & 0x0f, min = 0x800;
        } else if ((c & 0xf8) == 0xf0) {
            n = 3, cp = c & 0x07, min = 0x10000;
        } else {
            return false;
        }
        for (int i = 1; i <= n; i++) {
            if ((p[i] & 0xc0) != 0x80) return false;
            cp = (cp << 6) | (p[i] & 0x3f);
        }
        if (cp < min || cp > 0x10ffff || (cp >= 0xd800 && cp <= 0xdfff)) return false;
        p += n + 1;
    }
    return true;
}

/* The family of m that already has this name, or NULL.  A histogram also
 * writes name_bucket, name_sum and name_count, but the suffix rules of
 * def_check keep every other family's name off those.  Called with m->lock
 * held. */
static const metrics_family *clash(const metrics *m, const char *name) {
    for (const metrics_family *f = m->first; f; f = f->next)
        if (strcmp(f->name, name) == 0) return f;
    return NULL;
}

static int def_check(const struct metrics_def *def, char *err, size_t errlen) {
    const char *name = def->name ? def->name : "(null)";
    const char *why = NULL;
    if (def->type != METRICS_COUNTER && def->type != METRICS_GAUGE &&
        def->type != METRICS_HISTOGRAM) {
        snprintf(err, errlen, "metric %s: type %d is not a counter, gauge or histogram", name,
                 (int)def->type);
        return STATUS_BAD_INPUT;
    }
    const char *type = type_names[def->type];
    if (!def->name || (why = name_problem(def->name))) {
        snprintf(err, errlen, "metric name '%s' %s", name, def->name ? why : "is missing");
        return STATUS_BAD_INPUT;
    }
    if (def->type == METRICS_COUNTER && (!ends_with(name, "_total") || strcmp(name, "_total") == 0)) {
        snprintf(err, errlen, "metric %s: a counter's name must end in _total", name);
        return STATUS_BAD_INPUT;
    }
    if (def->type != METRICS_COUNTER) {
        static const char *const reserved[] = {"_total", "_bucket", "_sum", "_count"};
        for (int i = 0; i < 4; i++)
            if (ends_with(name, reserved[i])) {
                snprintf(err, errlen, "metric %s: a %s's name may not end in %s", name, type,
                         reserved[i]);
                return STATUS_BAD_INPUT;
            }
    }
    if (!def->help || !def->help[0] || !utf8_valid(def->help)) {
        snprintf(err, errlen, "metric %s: help text is %s", name,
                 !def->help || !def->help[0] ? "missing" : "not UTF-8");
        return STATUS_BAD_INPUT;
    }
    int n_labels = 0;
    for (; def->labels && def->labels[n_labels]; n_labels++) {
        const char *l = def->labels[n_labels];
        if ((why = name_problem(l))) {
            snprintf(err, errlen, "metric %s: label name '%s' %s", name, l, why);
            return STATUS_BAD_INPUT;
        }
        if (def->type == METRICS_HISTOGRAM && strcmp(l, "le") == 0) {
            snprintf(err, errlen, "metric %s: label name 'le' is reserved for histogram buckets",
                     name);
            return STATUS_BAD_INPUT;
        }
        for (int j = 0; j < n_labels; j++)
            if (strcmp(def->labels[j], l) == 0) {
                snprintf(err, errlen, "metric %s: label name '%s' is repeated", name, l);
                return STATUS_BAD_INPUT;
            }
        if (n_labels == METRICS_LABELS_MAX) {
            snprintf(err, errlen, "metric %s: more than %d label names", name, METRICS_LABELS_MAX);
            return STATUS_BAD_INPUT;
        }
    }
    if (def->type == METRICS_HISTOGRAM) {
        if (!def->bounds || def->n_bounds < 1 || def->n_bounds > METRICS_BOUNDS_MAX) {
            snprintf(err, errlen, "metric %s: a histogram needs 1 to %d bucket bounds, got %d",
                     name, METRICS_BOUNDS_MAX, def->bounds ? def->n_bounds : 0);
            return STATUS_BAD_INPUT;
        }
        for (int i = 0; i < def->n_bounds; i++) {
            double b = def->bounds[i];
            if (!isfinite(b) || (i > 0 && !(b > def->bounds[i - 1]))) {
                char v[32];
                metrics_format_value(b, v, sizeof v);
                snprintf(err, errlen,
                         "metric %s: bucket bound %d (%s) is not finite and above the one before",
                         name, i, v);
                return STATUS_BAD_INPUT;
            }
        }
    } else if (def->bounds || def->n_bounds) {
        snprintf(err, errlen, "metric %s: a %s has no bucket bounds", name, type);
        return STATUS_BAD_INPUT;
    }
    return STATUS_OK;
}

/* ---- families and series ------------------------------------------------- */

static char *dup_str(const char *s) {
    size_t n = strlen(s) + 1;
    char *d = malloc(n);
    if (d) memcpy(d, s, n);
    return d;
}

static metrics_series *series_new(const metrics_family *f, const char *const *values) {
    size_t n_buckets = f->type == METRICS_HISTOGRAM ? (size_t)f->n_bounds + 1 : 0;
    metrics_series *s = calloc(1, sizeof *s + n_buckets * sizeof s->buckets[0]);
    if (!s) return NULL;
    s->f = f;
    atomic_init(&s->value, d2b(0.0));
    for (size_t i = 0; i < n_buckets; i++) atomic_init(&s->buckets[i], 0);
    if (f->n_labels) {
        s->values = calloc((size_t)f->n_labels, sizeof *s->values);
        if (!s->values) goto fail;
        for (int i = 0; i < f->n_labels; i++)
            if (!(s->values[i] = dup_str(values[i]))) goto fail;
    }
    return s;
fail:
    series_free(s, f->n_labels);
    return NULL;
}

int metrics_family_new(metrics *m, const struct metrics_def *def, metrics_family **out,
                       char *err, size_t errlen) {
    int rc = def_check(def, err, errlen);
    if (rc < 0) return rc;
    metrics_family *f = calloc(1, sizeof *f);
    if (!f) goto oom;
    pthread_mutex_init(&f->lock, NULL);
    f->type = def->type;
    while (def->labels && def->labels[f->n_labels]) f->n_labels++;
    if (!(f->name = dup_str(def->name)) || !(f->help = dup_str(def->help))) goto oom;
    if (f->n_labels) {
        if (!(f->labels = calloc((size_t)f->n_labels, sizeof *f->labels))) goto oom;
        for (int i = 0; i < f->n_labels; i++)
            if (!(f->labels[i] = dup_str(def->labels[i]))) goto oom;
    }
    if (def->type == METRICS_HISTOGRAM) {
        f->n_bounds = def->n_bounds;
        if (!(f->bounds = malloc((size_t)f->n_bounds * sizeof *f->bounds))) goto oom;
        memcpy(f->bounds, def->bounds, (size_t)f->n_bounds * sizeof *f->bounds);
    }
    if (f->n_labels == 0) {
        if (!(f->first = f->last = series_new(f, NULL))) goto oom;
        f->n_series = 1;
    }

    pthread_mutex_lock(&m->lock);
    const metrics_family *other = clash(m, def->name);
    if (other) {
        pthread_mutex_unlock(&m->lock);
        snprintf(err, errlen, "metric %s: the name clashes with the %s %s", def->name,
                 type_names[other->type], other->name);
        family_free(f);
        return STATUS_BAD_INPUT;
    }
    if (m->last)
        m->last->next = f;
    else
        m->first = f;
    m->last = f;
    pthread_mutex_unlock(&m->lock);
    *out = f;
    return STATUS_OK;
oom:
    family_free(f);
    snprintf(err, errlen, "metric %s: out of memory", def->name);
    return STATUS_NO_MEMORY;
}

metrics_series *metrics_series_get(metrics_family *f, const char *const *values) {
    for (int i = 0; i < f->n_labels; i++) {
        const char *v = values ? values[i] : NULL;
        if (!v || strlen(v) > METRICS_LABEL_VALUE_MAX || !utf8_valid(v)) {
            LOG(LL_WARN, "metric %s: label %s: value %s%.64s%s is %s", f->name, f->labels[i],
                v ? "'" : "", v ? v : "(null)", v ? "'" : "",
                !v ? "missing" : strlen(v) > METRICS_LABEL_VALUE_MAX ? "longer than 256 bytes"
                                                                      : "not UTF-8");
            return NULL;
        }
    }
    pthread_mutex_lock(&f->lock);
    metrics_series *s = f->first;
    for (; s; s = s->next) {
        int i = 0;
        while (i < f->n_labels && strcmp(s->values[i], values[i]) == 0) i++;
        if (i == f->n_labels) break;
    }
    if (!s && f->n_series >= METRICS_SERIES_MAX) {
        pthread_mutex_unlock(&f->lock);
        LOG(LL_WARN, "metric %s: already %d series, label value '%.64s' refused", f->name,
            METRICS_SERIES_MAX, values[0]);
        return NULL;
    }
    if (!s) {
        s = series_new(f, values);
        if (s) {
            if (f->last)
                f->last->next = s;
            else
                f->first = s;
            f->last = s;
            f->n_series++;
        }
    }
    pthread_mutex_unlock(&f->lock);
    if (!s) LOG(LL_WARN, "metric %s: out of memory for a new series", f->name);
    return s;
}

/* ---- updates ------------------------------------------------------------- */

void metrics_counter_add(metrics_series *s, double v) {
    assert(s->f->type == METRICS_COUNTER);
    if (!(v >= 0)) return;
    atomic_add_double(&s->value, v);
}

void metrics_counter_inc(metrics_series *s) { metrics_counter_add(s, 1.0); }

void metrics_gauge_set(metrics_series *s, double v) {
    assert(s->f->type == METRICS_GAUGE);
    atomic_store_explicit(&s->value, d2b(v), memory_order_relaxed);
}

void metrics_gauge_add(metrics_series *s, double v) {
    assert(s->f->type == METRICS_GAUGE);
    atomic_add_double(&s->value, v);
}

void metrics_histogram_observe(metrics_series *s, double v) {
    assert(s->f->type == METRICS_HISTOGRAM);
    if (isnan(v)) return;
    const double *b = s->f->bounds;
    /* First bound >= v (a bucket counts values up to and including its
     * bound); n_bounds, the +Inf bucket, when v is above them all. */
    int lo = 0, hi = s->f->n_bounds;
    while (lo < hi) {
        int mid = (lo + hi) / 2;
        if (v <= b[mid])
            hi = mid;
        else
            lo = mid + 1;
    }
    atomic_fetch_add_explicit(&s->buckets[lo], 1, memory_order_relaxed);
    atomic_add_double(&s->value, v);
}

double metrics_series_value(const metrics_series *s) {
    return b2d(atomic_load_explicit((_Atomic uint64_t *)&s->value, memory_order_relaxed));
}

uint64_t metrics_histogram_count(const metrics_series *s) {
    assert(s->f->type == METRICS_HISTOGRAM);
    uint64_t n = 0;
    for (int i = 0; i <= s->f->n_bounds; i++)
        n += atomic_load_explicit((_Atomic uint64_t *)&s->buckets[i], memory_order_relaxed);
    return n;
}

/* ---- rendering ----------------------------------------------------------- */

void metrics_format_value(double v, char *buf, size_t size) {
    if (isnan(v)) {
        snprintf(buf, size, "NaN");
        return;
    }
    if (isinf(v)) {
        snprintf(buf, size, v > 0 ? "+Inf" : "-Inf");
        return;
    }
    /* Whole numbers (counts, bytes) in full rather than as %g's 4e+05; any
     * other value as the shortest %g that reads back as v: 0.1 stays "0.1",
     * not the 17 digits that %.17g writes. */
    if (v == floor(v) && fabs(v) < 1e15) {
        snprintf(buf, size, "%.0f", v);
        return;
    }
    for (int prec = 1; prec <= 17; prec++) {
        snprintf(buf, size, "%.*g", prec, v);
        if (strtod(buf, NULL) == v) return;
    }
}

struct sbuf {
    char *p;
    size_t len, cap;
    bool failed;
};

static void sb_grow(struct sbuf *b, size_t extra) {
    if (b->failed || b->len + extra + 1 <= b->cap) return;
    size_t cap = b->cap ? b->cap : 4096;
    while (cap < b->len + extra + 1) cap *= 2;
    char *p = realloc(b->p, cap);
    if (!p) {
        b->failed = true;
        return;
    }
    b->p = p;
    b->cap = cap;
}

static void sb_put(struct sbuf *b, const char *s, size_t n) {
    sb_grow(b, n);
    if (b->failed) return;
    memcpy(b->p + b->len, s, n);
    b->len += n;
    b->p[b->len] = 0;
}

static void sb_str(struct sbuf *b, const char *s) { sb_put(b, s, strlen(s)); }

/* Label values escape \, " and newline; help text escapes \ and newline. */
static void sb_escaped(struct sbuf *b, const char *s, bool quote) {
    for (; *s; s++) {
        if (*s == '\\')
            sb_put(b, "\\\\", 2);
        else if (*s == '\n')
            sb_put(b, "\\n", 2);
        else if (*s == '"' && quote)
            sb_put(b, "\\\"", 2);
        else
            sb_put(b, s, 1);
    }
}

/* name{l1="v1",...,le="bound"} value\n; suffix follows the name, le may be NULL. */
static void sb_sample(struct sbuf *b, const metrics_family *f, const metrics_series *s,
                      const char *suffix, const char *le, double value) {
    sb_str(b, f->name);
    sb_str(b, suffix);
    if (f->n_labels || le) {
        sb_put(b, "{", 1);
        for (int i = 0; i < f->n_labels; i++) {
            if (i) sb_put(b, ",", 1);
            sb_str(b, f->labels[i]);
            sb_put(b, "=\"", 2);
            sb_escaped(b, s->values[i], true);
            sb_put(b, "\"", 1);
        }
        if (le) {
            sb_str(b, f->n_labels ? ",le=\"" : "le=\"");
            sb_str(b, le);
            sb_put(b, "\"", 1);
        }
        sb_put(b, "}", 1);
    }
    char v[32];
    metrics_format_value(value, v, sizeof v);
    sb_put(b, " ", 1);
    sb_str(b, v);
    sb_put(b, "\n", 1);
}

static void render_family(struct sbuf *b, metrics_family *f) {
    pthread_mutex_lock(&f->lock);
    if (!f->first) {
        pthread_mutex_unlock(&f->lock);
        return;
    }
    sb_str(b, "# HELP ");
    sb_str(b, f->name);
    sb_put(b, " ", 1);
    sb_escaped(b, f->help, false);
    sb_str(b, "\n# TYPE ");
    sb_str(b, f->name);
    sb_put(b, " ", 1);
    sb_str(b, type_names[f->type]);
    sb_put(b, "\n", 1);
    for (const metrics_series *s = f->first; s; s = s->next) {
        if (f->type != METRICS_HISTOGRAM) {
            sb_sample(b, f, s, "", NULL, metrics_series_value(s));
            continue;
        }
        uint64_t cumulative = 0;
        char le[32];
        for (int i = 0; i <= f->n_bounds; i++) {
            cumulative += atomic_load_explicit((_Atomic uint64_t *)&s->buckets[i],
                                               memory_order_relaxed);
            metrics_format_value(i < f->n_bounds ? f->bounds[i] : INFINITY, le, sizeof le);
            sb_sample(b, f, s, "_bucket", le, (double)cumulative);
        }
        sb_sample(b, f, s, "_sum", NULL, metrics_series_value(s));
        sb_sample(b, f, s, "_count", NULL, (double)cumulative);
    }
    pthread_mutex_unlock(&f->lock);
}

int metrics_render(metrics *m, char **out, size_t *len) {
    struct sbuf b = {0};
    sb_grow(&b, 0);
    pthread_mutex_lock(&m->lock);
    for (metrics_family *f = m->first; f; f = f->next) render_family(&b, f);
    pthread_mutex_unlock(&m->lock);
    if (b.failed) {
        free(b.p);
        return STATUS_NO_MEMORY;
    }
    b.p[b.len] = 0;
    *out = b.p;
    if (len) *len = b.len;
    return STATUS_OK;
}
