/* The options table: defaults, then environment variables, then flags, each
 * value checked against its option's type, range and choices, with messages
 * that name the flag or variable and the value; and the --help text. */
#include "options.h"

#include "log.h"
#include "status.h"

#include <ctype.h>
#include <errno.h>
#include <limits.h>
#include <math.h>
#include <stdarg.h>
#include <stdlib.h>
#include <string.h>
#include <strings.h>

static void options_errf(char *err, size_t err_size, const char *fmt, ...)
    __attribute__((format(printf, 3, 4)));

static void options_errf(char *err, size_t err_size, const char *fmt, ...) {
    if (!err || err_size == 0) return;
    va_list ap;
    va_start(ap, fmt);
    vsnprintf(err, err_size, fmt, ap);
    va_end(ap);
}

static const struct option_def *options_find(const struct options *o, const char *name,
                                             size_t len) {
    for (int i = 0; i < o->n_defs; i++) {
        const char *n = o->defs[i].name;
        if (strlen(n) == len && strncmp(n, name, len) == 0) return &o->defs[i];
    }
    return NULL;
}

static int options_parse_bool(const char *s, bool *v) {
    static const char *const yes[] = {"true", "1", "yes", "on"};
    static const char *const no[] = {"false", "0", "no", "off"};
    for (int i = 0; i < 4; i++) {
        if (strcasecmp(s, yes[i]) == 0) {
            *v = true;
            return 0;
        }
        if (strcasecmp(s, no[i]) == 0) {
            *v = false;
            return 0;
        }
    }
    return -1;
}

static bool options_has_range(const struct option_def *d) { return d->min != 0 || d->max != 0; }

/* "1.5G" -> 1610612736; -1 when s is not a size. */
static int options_parse_size(const char *s, int64_t *v) {
    errno = 0;
    char *end;
    double x = strtod(s, &end);
    if (end == s || errno == ERANGE || !isfinite(x) || x < 0) return -1;
    double mul = 1;
    if (*end) {
        switch (toupper((unsigned char)*end)) {
        case 'K': mul = 1024.0; break;
        case 'M': mul = 1024.0 * 1024; break;
        case 'G': mul = 1024.0 * 1024 * 1024; break;
        case 'T': mul = 1024.0 * 1024 * 1024 * 1024; break;
        case 'B': mul = 1; end--; break; /* plain "512B" */
        default: return -1;
        }
        end++;
        if (strcasecmp(end, "ib") == 0 || strcasecmp(end, "b") == 0 || *end == '\0') {
            /* accepted: "4G", "4GB", "4GiB" */
        } else {
            return -1;
        }
    }
    x *= mul;
    if (x > 9.0e18) return -1;
    if (x != floor(x)) return -1; /* "1.3K" is not a whole number of bytes */
    *v = (int64_t)x;
    return 0;
}

/* Where a value came from: a flag, the environment variable of a flag, the
 * table's default, or the variable of a table read from the environment
 * only (options_parse_env), whose entries have no flag to name. */
enum { ORIGIN_FLAG = 0, ORIGIN_ENV = 1, ORIGIN_DEFAULT = 2, ORIGIN_ENV_ONLY = 3 };

/* Describes where a value came from for error messages: "--port" or
 * "LLM_PORT (for --port)" or "default of --port". */
static void options_origin(const struct option_def *d, int origin, char *buf, size_t size) {
    if (origin == ORIGIN_FLAG)
        snprintf(buf, size, "--%s", d->name);
    else if (origin == ORIGIN_ENV)
        snprintf(buf, size, "environment variable %s (for --%s)", d->env, d->name);
    else if (origin == ORIGIN_ENV_ONLY)
        snprintf(buf, size, "environment variable %s", d->env);
    else
        snprintf(buf, size, "default of --%s in the options table", d->name);
}

/* Parses s into d's target; origin: one of ORIGIN_*. */
static int options_set(const struct option_def *d, const char *s, int origin, char *err,
                       size_t err_size) {
    char from[160];
    options_origin(d, origin, from, sizeof from);
    int bad = origin == ORIGIN_DEFAULT ? STATUS_INTERNAL : STATUS_BAD_INPUT;
    switch (d->type) {
    case OPTION_STRING:
        *(const char **)d->target = s;
        return 0;
    case OPTION_INT: {
        errno = 0;
        char *end;
        long long v = strtoll(s, &end, 10);
        if (end == s || *end != '\0') {
            options_errf(err, err_size, "%s: '%s' is not an integer", from, s);
            return bad;
        }
        double lo = options_has_range(d) ? d->min : INT_MIN;
        double hi = options_has_range(d) ? d->max : INT_MAX;
        if (errno == ERANGE || (double)v < lo || (double)v > hi || v < INT_MIN || v > INT_MAX) {
            options_errf(err, err_size, "%s: %s is out of range [%.0f, %.0f]", from, s, lo, hi);
            return bad;
        }
        *(int *)d->target = (int)v;
        return 0;
    }
    case OPTION_SIZE: {
        int64_t v;
        if (options_parse_size(s, &v) < 0) {
            options_errf(err, err_size,
                         "%s: '%s' is not a size in bytes (a whole number with an optional "
                         "K, M, G or T suffix)", from, s);
            return bad;
        }
        if (options_has_range(d) && ((double)v < d->min || (double)v > d->max)) {
            options_errf(err, err_size, "%s: %s is out of range [%.0f, %.0f] bytes", from, s,
                         d->min, d->max);
            return bad;
        }
        *(int64_t *)d->target = v;
        return 0;
    }
    case OPTION_FLOAT: {
        errno = 0;
        char *end;
        double v = strtod(s, &end);
        if (end == s || *end != '\0' || errno == ERANGE || !isfinite(v)) {
            options_errf(err, err_size, "%s: '%s' is not a finite number", from, s);
            return bad;
        }
        if (options_has_range(d) && (v < d->min || v > d->max)) {
            options_errf(err, err_size, "%s: %s is out of range [%g, %g]", from, s, d->min,
                         d->max);
            return bad;
        }
        *(double *)d->target = v;
        return 0;
    }
    case OPTION_BOOL: {
        bool v;
        if (options_parse_bool(s, &v) < 0) {
            options_errf(err, err_size,
                         "%s: '%s' is not a boolean (true/false, 1/0, yes/no, on/off)", from, s);
            return bad;
        }
        *(bool *)d->target = v;
        return 0;
    }
    case OPTION_CHOICE: {
        if (!d->choices || !d->choices[0]) {
            options_errf(err, err_size, "--%s: the options table lists no choices", d->name);
            return STATUS_INTERNAL;
        }
        for (int i = 0; d->choices[i]; i++)
            if (strcmp(d->choices[i], s) == 0) {
                *(int *)d->target = i;
                return 0;
            }
        char list[512];
        size_t n = 0;
        list[0] = '\0';
        for (int i = 0; d->choices[i] && n < sizeof list; i++)
            n += (size_t)snprintf(list + n, sizeof list - n, "%s%s", i ? ", " : "",
                                  d->choices[i]);
        options_errf(err, err_size, "%s: '%s' is not one of %s", from, s, list);
        return bad;
    }
    }
    options_errf(err, err_size, "--%s: option type %d is unknown", d->name, (int)d->type);
    return STATUS_INTERNAL;
}

static int options_set_default(const struct option_def *d, char *err, size_t err_size) {
    if (!d->target) {
        options_errf(err, err_size, "--%s: the options table gives no target", d->name);
        return STATUS_INTERNAL;
    }
    if (d->def) return options_set(d, d->def, ORIGIN_DEFAULT, err, err_size);
    switch (d->type) {
    case OPTION_STRING: *(const char **)d->target = NULL; break;
    case OPTION_INT: *(int *)d->target = 0; break;
    case OPTION_SIZE: *(int64_t *)d->target = 0; break;
    case OPTION_FLOAT: *(double *)d->target = 0; break;
    case OPTION_BOOL: *(bool *)d->target = false; break;
    case OPTION_CHOICE: *(int *)d->target = 0; break;
    }
    return 0;
}

/* Every target from its default, then from its environment variable;
 * env_origin says how a bad variable is named (ORIGIN_ENV or
 * ORIGIN_ENV_ONLY). */
static int options_set_defaults_env(const struct options *o, int env_origin, char *err,
                                    size_t err_size) {
    if (err && err_size) err[0] = '\0';
    for (int i = 0; i < o->n_defs; i++) {
        int rc = options_set_default(&o->defs[i], err, err_size);
        if (rc < 0) return rc;
    }
    for (int i = 0; i < o->n_defs; i++) {
        const struct option_def *d = &o->defs[i];
        if (!d->env) continue;
        const char *v = getenv(d->env);
        /* An empty variable counts as unset: manifests often template empty values. */
        if (!v || !*v) continue;
        int rc = options_set(d, v, env_origin, err, err_size);
        if (rc < 0) return rc;
    }
    return 0;
}

int options_parse_env(const struct options *o, char *err, size_t err_size) {
    return options_set_defaults_env(o, ORIGIN_ENV_ONLY, err, err_size);
}

int options_parse(const struct options *o, int *argc, char **argv, char *err, size_t err_size) {
    int rc = options_set_defaults_env(o, ORIGIN_ENV, err, err_size);
    if (rc < 0) return rc;

    int n_pos = 1; /* positionals are compacted into argv[1..] in order */
    int i = 1;
    for (; i < *argc; i++) {
        char *a = argv[i];
        if (strcmp(a, "--") == 0) {
            i++;
            break;
        }
        if (a[0] != '-' || a[1] == '\0') { /* "-" alone is a positional (stdin) */
            if (o->stop_at_positional) break;
            argv[n_pos++] = a;
            continue;
        }
        if (strcmp(a, "-h") == 0 || strcmp(a, "--help") == 0) {
            options_help(o, stdout);
            return STATUS_CANCELLED;
        }
        if (a[1] != '-') {
            options_errf(err, err_size, "unknown flag '%s' (flags are written --name)", a);
            return STATUS_BAD_INPUT;
        }
        const char *name = a + 2;
        const char *eq = strchr(name, '=');
        size_t len = eq ? (size_t)(eq - name) : strlen(name);
        const struct option_def *d = options_find(o, name, len);
        if (!d && len > 3 && strncmp(name, "no-", 3) == 0) {
            const struct option_def *b = options_find(o, name + 3, len - 3);
            if (b && b->type == OPTION_BOOL) {
                if (eq) {
                    options_errf(err, err_size, "--%.*s takes no value, got '%s'", (int)len,
                                 name, eq + 1);
                    return STATUS_BAD_INPUT;
                }
                *(bool *)b->target = false;
                continue;
            }
        }
        if (!d) {
            options_errf(err, err_size, "unknown flag --%.*s (see --help)", (int)len, name);
            return STATUS_BAD_INPUT;
        }
        const char *val;
        if (eq) {
            val = eq + 1;
        } else if (d->type == OPTION_BOOL) {
            val = "true";
        } else if (i + 1 < *argc) {
            val = argv[++i];
        } else {
            options_errf(err, err_size, "--%s: missing value", d->name);
            return STATUS_BAD_INPUT;
        }
        rc = options_set(d, val, ORIGIN_FLAG, err, err_size);
        if (rc < 0) return rc;
    }
    for (; i < *argc; i++) argv[n_pos++] = argv[i];
    if (n_pos < *argc) argv[n_pos] = NULL; /* like main's argv, end the list with NULL */
    *argc = n_pos;
    return 0;
}

static const char *options_kind(const struct option_def *d) {
    switch (d->type) {
    case OPTION_STRING: return "TEXT";
    case OPTION_INT: return "INT";
    case OPTION_SIZE: return "BYTES";
    case OPTION_FLOAT: return "NUM";
    case OPTION_BOOL: return "";
    case OPTION_CHOICE: return "CHOICE";
    }
    return "?";
}

void options_help(const struct options *o, FILE *f) {
    fprintf(f, "usage: %s %s\n", o->program ? o->program : "llm", o->usage ? o->usage : "[options]");
    if (o->about) fprintf(f, "%s\n", o->about);
    fprintf(f, "\noptions (a flag overrides its environment variable, which overrides the default):\n");
    fprintf(f, "  %-30s %s\n", "--help, -h", "print this help and exit");
    for (int i = 0; i < o->n_defs; i++) {
        const struct option_def *d = &o->defs[i];
        char head[160];
        const char *kind = options_kind(d);
        if (d->type == OPTION_BOOL) {
            snprintf(head, sizeof head, "--%s, --no-%s", d->name, d->name);
        } else if (d->type == OPTION_CHOICE && d->choices) {
            size_t n = (size_t)snprintf(head, sizeof head, "--%s ", d->name);
            for (int c = 0; d->choices[c] && n < sizeof head; c++)
                n += (size_t)snprintf(head + n, sizeof head - n, "%s%s", c ? "|" : "",
                                      d->choices[c]);
        } else {
            snprintf(head, sizeof head, "--%s %s", d->name, kind);
        }
        if (strlen(head) > 30)
            fprintf(f, "  %s\n  %-30s %s\n", head, "", d->help ? d->help : "");
        else
            fprintf(f, "  %-30s %s\n", head, d->help ? d->help : "");
        /* Whole numbers in full: %g would show 1 << 24 as 1.67772e+07. */
        if ((d->type == OPTION_INT || d->type == OPTION_SIZE) && options_has_range(d))
            fprintf(f, "  %-30s range: %.0f to %.0f\n", "", d->min, d->max);
        else if (d->type == OPTION_FLOAT && options_has_range(d))
            fprintf(f, "  %-30s range: %g to %g\n", "", d->min, d->max);
        const char *def = d->def;
        if (!def) {
            switch (d->type) {
            case OPTION_STRING: def = "(none)"; break;
            case OPTION_BOOL: def = "false"; break;
            case OPTION_CHOICE: def = d->choices && d->choices[0] ? d->choices[0] : "(none)"; break;
            default: def = "0"; break;
            }
        }
        fprintf(f, "  %-30s env: %s, default: %s\n", "", d->env ? d->env : "(none)", def);
    }
}

void options_value_str(const struct option_def *d, char *buf, size_t size) {
    if (!d->target) {
        snprintf(buf, size, "(no target)");
        return;
    }
    switch (d->type) {
    case OPTION_STRING: {
        const char *s = *(const char *const *)d->target;
        snprintf(buf, size, "%s", s ? s : "(none)");
        return;
    }
    case OPTION_INT: snprintf(buf, size, "%d", *(const int *)d->target); return;
    case OPTION_SIZE: snprintf(buf, size, "%lld", (long long)*(const int64_t *)d->target); return;
    case OPTION_FLOAT: snprintf(buf, size, "%g", *(const double *)d->target); return;
    case OPTION_BOOL: snprintf(buf, size, "%s", *(const bool *)d->target ? "true" : "false"); return;
    case OPTION_CHOICE: {
        int k = *(const int *)d->target;
        int n = 0;
        while (d->choices && d->choices[n]) n++;
        if (k >= 0 && k < n)
            snprintf(buf, size, "%s", d->choices[k]);
        else
            snprintf(buf, size, "(choice %d)", k);
        return;
    }
    }
    snprintf(buf, size, "(type %d)", (int)d->type);
}

/* A password in a URL's user part ("redis://app:pw@host") becomes "***":
 * the start-up log goes wherever logs go, the password must not. */
static void options_redact_url(char *v, size_t size) {
    char *auth = strstr(v, "://");
    char *at = auth ? strrchr(auth + 3, '@') : NULL;
    char *colon = at ? memchr(auth + 3, ':', (size_t)(at - (auth + 3))) : NULL;
    if (!colon) return;
    if ((size_t)(colon + 4 - v) >= size) {
        colon[1] = '\0';
        return;
    }
    size_t tail = strlen(at) + 1;
    if ((size_t)(colon + 4 - v) + tail > size) tail = size - (size_t)(colon + 4 - v); /* cut short */
    memmove(colon + 4, at, tail);
    v[size - 1] = '\0';
    memcpy(colon + 1, "***", 3);
}

void options_log(const struct options *o) {
    for (int i = 0; i < o->n_defs; i++) {
        char v[256];
        options_value_str(&o->defs[i], v, sizeof v);
        options_redact_url(v, sizeof v);
        LOG(LL_INFO, "option %s=%s", o->defs[i].name, v);
    }
}
