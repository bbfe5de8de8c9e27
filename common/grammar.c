/* GBNF (llama.cpp's grammar format) parsed and compiled to byte-level rules:
 * rules, alternation, sequences, groups, repetition (* + ? {m} {m,} {m,n}),
 * character classes with ranges and negation, '.', literals with escapes.
 * Repetitions become generated right-recursive rules (as llama.cpp does),
 * character classes become byte sets or, beyond ASCII, rules of UTF-8 byte
 * sequences.  Errors say line and column. */
#include "grammar.h"

#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "grammar-impl.h"
#include "status.h"

/* ---- growable arrays of elements ------------------------------------- */

struct gvec {
    struct gel *v;
    int32_t n, cap;
};

static int gvec_push(struct gvec *a, uint32_t type, uint32_t value) {
    if (a->n == a->cap) {
        int32_t cap = a->cap ? a->cap * 2 : 16;
        struct gel *v = realloc(a->v, (size_t)cap * sizeof *v);
        if (!v) return STATUS_NO_MEMORY;
        a->v = v;
        a->cap = cap;
    }
    a->v[a->n].type = type;
    a->v[a->n].value = value;
    a->n++;
    return 0;
}

struct prule {
    char *name;          /* NULL for generated rules */
    struct gvec body;    /* alternatives separated by ALT, END last */
    int defined;
    size_t def_off;      /* where it is defined (or generated) */
    size_t ref_off;      /* first reference, for "undefined rule" */
};

struct parser {
    const char *src, *p, *end;
    struct prule *rules;
    int32_t n_rules, cap_rules;
    uint64_t (*sets)[4];
    int32_t n_sets, cap_sets;
    char *err;
    size_t errlen;
    int status;
};

static void pos_of(const char *src, size_t off, int *line, int *col) {
    int l = 1, c = 1;
    for (size_t i = 0; i < off; i++) {
        if (src[i] == '\n') {
            l++;
            c = 1;
        } else {
            c++;
        }
    }
    *line = l;
    *col = c;
}

__attribute__((format(printf, 3, 4))) static int perr(struct parser *ps, const char *at,
                                                       const char *fmt, ...) {
    if (ps->status) return ps->status;
    int line, col;
    pos_of(ps->src, (size_t)(at - ps->src), &line, &col);
    char msg[256];
    va_list ap;
    va_start(ap, fmt);
    vsnprintf(msg, sizeof msg, fmt, ap);
    va_end(ap);
    ps->status = status_fail(ps->err, ps->errlen, STATUS_BAD_INPUT, "line %d, column %d: %s",
                             line, col, msg);
    return ps->status;
}

static int nomem(struct parser *ps) {
    if (!ps->status)
        ps->status = status_fail(ps->err, ps->errlen, STATUS_NO_MEMORY, "grammar: out of memory");
    return ps->status;
}

static int32_t rule_new(struct parser *ps, const char *name, size_t nlen, size_t off) {
    if (ps->n_rules == ps->cap_rules) {
        int32_t cap = ps->cap_rules ? ps->cap_rules * 2 : 32;
        struct prule *r = realloc(ps->rules, (size_t)cap * sizeof *r);
        if (!r) return nomem(ps);
        ps->rules = r;
        ps->cap_rules = cap;
    }
    struct prule *r = &ps->rules[ps->n_rules];
    memset(r, 0, sizeof *r);
    if (name) {
        r->name = malloc(nlen + 1);
        if (!r->name) return nomem(ps);
        memcpy(r->name, name, nlen);
        r->name[nlen] = 0;
    }
    r->def_off = r->ref_off = off;
    return ps->n_rules++;
}

static int32_t rule_find(struct parser *ps, const char *name, size_t nlen, size_t off) {
    for (int32_t i = 0; i < ps->n_rules; i++)
        if (ps->rules[i].name && strlen(ps->rules[i].name) == nlen &&
            memcmp(ps->rules[i].name, name, nlen) == 0)
            return i;
    return rule_new(ps, name, nlen, off);
}

static int32_t set_add(struct parser *ps, const uint64_t s[4]) {
    for (int32_t i = 0; i < ps->n_sets; i++)
        if (memcmp(ps->sets[i], s, 32) == 0) return i;
    if (ps->n_sets == ps->cap_sets) {
        int32_t cap = ps->cap_sets ? ps->cap_sets * 2 : 64;
        uint64_t(*v)[4] = realloc(ps->sets, (size_t)cap * sizeof *v);
        if (!v) return nomem(ps);
        ps->sets = v;
        ps->cap_sets = cap;
    }
    memcpy(ps->sets[ps->n_sets], s, 32);
    return ps->n_sets++;
}

static int push_byte_range(struct parser *ps, struct gvec *out, unsigned lo, unsigned hi) {
    uint64_t s[4] = {0, 0, 0, 0};
    for (unsigned b = lo; b <= hi; b++) s[b >> 6] |= 1ull << (b & 63);
    int32_t id = set_add(ps, s);
    if (id < 0) return id;
    return gvec_push(out, GEL_BYTES, (uint32_t)id) ? nomem(ps) : 0;
}

/* ---- UTF-8 -------------------------------------------------------------- */

static int utf8_encode(uint32_t cp, uint8_t *b) {
    if (cp < 0x80) {
        b[0] = (uint8_t)cp;
        return 1;
    }
    if (cp < 0x800) {
        b[0] = (uint8_t)(0xC0 | (cp >> 6));
        b[1] = (uint8_t)(0x80 | (cp & 0x3F));
        return 2;
    }
    if (cp < 0x10000) {
        b[0] = (uint8_t)(0xE0 | (cp >> 12));
        b[1] = (uint8_t)(0x80 | ((cp >> 6) & 0x3F));
        b[2] = (uint8_t)(0x80 | (cp & 0x3F));
        return 3;
    }
    b[0] = (uint8_t)(0xF0 | (cp >> 18));
    b[1] = (uint8_t)(0x80 | ((cp >> 12) & 0x3F));
    b[2] = (uint8_t)(0x80 | ((cp >> 6) & 0x3F));
    b[3] = (uint8_t)(0x80 | (cp & 0x3F));
    return 4;
}

/* Decodes one code point at p (< end); 0 bytes on invalid UTF-8. */
static int utf8_decode(const char *p, const char *end, uint32_t *cp) {
    const uint8_t *s = (const uint8_t *)p;
    size_t left = (size_t)(end - p);
    uint32_t c = s[0];
    int n;
    uint32_t min;
    if (c < 0x80) {
        *cp = c;
        return 1;
    } else if ((c & 0xE0) == 0xC0) {
        n = 2, c &= 0x1F, min = 0x80;
    } else if ((c & 0xF0) == 0xE0) {
        n = 3, c &= 0x0F, min = 0x800;
    } else if ((c & 0xF8) == 0xF0) {
        n = 4, c &= 0x07, min = 0x10000;
    } else {
        return 0;
    }
    if (left < (size_t)n) return 0;
    for (int i = 1; i < n; i++) {
        if ((s[i] & 0xC0) != 0x80) return 0;
        c = (c << 6) | (s[i] & 0x3F);
    }
    if (c < min || c > 0x10FFFF || (c >= 0xD800 && c <= 0xDFFF)) return 0;
    *cp = c;
    return n;
}

/* Appends to out, as alternatives (each followed by ALT), the UTF-8 byte
 * sequences of the code points lo..hi (no surrogates inside): the range is
 * split until each piece is a product of byte ranges (RE2's method). */
static int utf8_range(struct parser *ps, struct gvec *out, uint32_t lo, uint32_t hi) {
    if (lo > hi) return 0;
    static const uint32_t maxes[] = {0x7F, 0x7FF, 0xFFFF};
    for (int i = 0; i < 3; i++)
        if (lo <= maxes[i] && hi > maxes[i]) {
            int rc = utf8_range(ps, out, lo, maxes[i]);
            return rc ? rc : utf8_range(ps, out, maxes[i] + 1, hi);
        }
    uint8_t a[4], b[4];
    int n = utf8_encode(lo, a);
    for (int i = 1; i < n; i++) {
        uint32_t m = (1u << (6 * i)) - 1;
        if ((lo & ~m) != (hi & ~m)) {
            if ((lo & m) != 0) {
                int rc = utf8_range(ps, out, lo, lo | m);
                return rc ? rc : utf8_range(ps, out, (lo | m) + 1, hi);
            }
            if ((hi & m) != m) {
                int rc = utf8_range(ps, out, lo, (hi & ~m) - 1);
                return rc ? rc : utf8_range(ps, out, hi & ~m, hi);
            }
        }
    }
    utf8_encode(hi, b);
    for (int i = 0; i < n; i++) {
        int rc = push_byte_range(ps, out, a[i], b[i]);
        if (rc) return rc;
    }
    return gvec_push(out, GEL_ALT, 0) ? nomem(ps) : 0;
}

/* ---- character classes -------------------------------------------------- */

struct cprange {
    uint32_t lo, hi;
};

static int cprange_cmp(const void *a, const void *b) {
    const struct cprange *x = a, *y = b;
    return x->lo < y->lo ? -1 : x->lo > y->lo;
}

/* Emits the class (ranges, maybe negated) into out: one byte-set element
 * when it is ASCII only, else a reference to a generated rule. */
static int emit_class(struct parser *ps, struct gvec *out, struct cprange *r, int n, int negate,
                      size_t off) {
    qsort(r, (size_t)n, sizeof *r, cprange_cmp);
    /* merge */
    int m = 0;
    for (int i = 0; i < n; i++) {
        if (m && r[i].lo <= r[m - 1].hi + 1) {
            if (r[i].hi > r[m - 1].hi) r[m - 1].hi = r[i].hi;
        } else {
            r[m++] = r[i];
        }
    }
    /* complement and cut out the surrogates, into a fresh list */
    struct cprange *c = malloc(sizeof *c * ((size_t)m + 3));
    if (!c) return nomem(ps);
    int k = 0;
    if (negate) {
        uint32_t next = 0;
        for (int i = 0; i < m; i++) {
            if (r[i].lo > next) c[k++] = (struct cprange){next, r[i].lo - 1};
            next = r[i].hi + 1;
        }
        if (next <= 0x10FFFF) c[k++] = (struct cprange){next, 0x10FFFF};
    } else {
        memcpy(c, r, sizeof *c * (size_t)m);
        k = m;
    }
    struct cprange *d = malloc(sizeof *d * ((size_t)k * 2 + 1));
    if (!d) {
        free(c);
        return nomem(ps);
    }
    int nd = 0;
    for (int i = 0; i < k; i++) {
        if (c[i].hi > 0x10FFFF) c[i].hi = 0x10FFFF;
        if (c[i].lo > c[i].hi) continue;
        if (c[i].lo < 0xD800 && c[i].hi > 0xDFFF) {
            d[nd++] = (struct cprange){c[i].lo, 0xD7FF};
            d[nd++] = (struct cprange){0xE000, c[i].hi};
        } else if (c[i].lo >= 0xD800 && c[i].hi <= 0xDFFF) {
            continue;
        } else if (c[i].lo >= 0xD800 && c[i].lo <= 0xDFFF) {
            d[nd++] = (struct cprange){0xE000, c[i].hi};
        } else if (c[i].hi >= 0xD800 && c[i].hi <= 0xDFFF) {
            d[nd++] = (struct cprange){c[i].lo, 0xD7FF};
        } else {
            d[nd++] = c[i];
        }
    }
    free(c);
    int rc = 0;
    if (nd == 0) {
        free(d);
        return perr(ps, ps->src + off, "character class matches nothing");
    }
    uint64_t ascii[4] = {0, 0, 0, 0};
    int any_ascii = 0, any_wide = 0;
    for (int i = 0; i < nd; i++) {
        for (uint32_t cp = d[i].lo; cp <= d[i].hi && cp < 0x80; cp++) {
            ascii[cp >> 6] |= 1ull << (cp & 63);
            any_ascii = 1;
        }
        if (d[i].hi >= 0x80) any_wide = 1;
    }
    if (!any_wide) {
        int32_t id = set_add(ps, ascii);
        free(d);
        if (id < 0) return id;
        return gvec_push(out, GEL_BYTES, (uint32_t)id) ? nomem(ps) : 0;
    }
    int32_t rid = rule_new(ps, NULL, 0, off);
    if (rid < 0) {
        free(d);
        return rid;
    }
    struct gvec body = {0};
    if (any_ascii) {
        int32_t id = set_add(ps, ascii);
        if (id < 0 || gvec_push(&body, GEL_BYTES, (uint32_t)id) || gvec_push(&body, GEL_ALT, 0))
            rc = id < 0 ? id : nomem(ps);
    }
    for (int i = 0; !rc && i < nd; i++) {
        uint32_t lo = d[i].lo < 0x80 ? 0x80 : d[i].lo;
        if (d[i].hi >= lo) rc = utf8_range(ps, &body, lo, d[i].hi);
    }
    free(d);
    if (!rc) {
        body.v[body.n - 1].type = GEL_END; /* the last ALT closes the rule */
        ps->rules[rid].body = body;
        ps->rules[rid].defined = 1;
        return gvec_push(out, GEL_REF, (uint32_t)rid) ? nomem(ps) : 0;
    }
    free(body.v);
    return rc;
}

/* ---- the text ----------------------------------------------------------- */

static int is_word(char c) {
    return (c >= 'a' && c <= 'z') || (c >= 'A' && c <= 'Z') || (c >= '0' && c <= '9') ||
           c == '-' || c == '_';
}

/* Skips blanks and comments; newlines too when newline_ok. */
static void skip_space(struct parser *ps, int newline_ok) {
    while (ps->p < ps->end) {
        char c = *ps->p;
        if (c == ' ' || c == '\t') {
            ps->p++;
        } else if (c == '#') {
            while (ps->p < ps->end && *ps->p != '\n') ps->p++;
        } else if (newline_ok && (c == '\n' || c == '\r')) {
            ps->p++;
        } else {
            break;
        }
    }
}

static int hexval(char c) {
    if (c >= '0' && c <= '9') return c - '0';
    if (c >= 'a' && c <= 'f') return c - 'a' + 10;
    if (c >= 'A' && c <= 'F') return c - 'A' + 10;
    return -1;
}

/* One character of a literal or class at ps->p (escapes decoded). */
static int parse_char(struct parser *ps, uint32_t *cp) {
    const char *at = ps->p;
    if (ps->p >= ps->end) return perr(ps, at, "unexpected end of input");
    if (*ps->p == '\\') {
        ps->p++;
        if (ps->p >= ps->end) return perr(ps, at, "unexpected end of input after '\\'");
        char e = *ps->p++;
        int nhex = 0;
        switch (e) {
        case 'n': *cp = '\n'; return 0;
        case 'r': *cp = '\r'; return 0;
        case 't': *cp = '\t'; return 0;
        case '\\': case '"': case '[': case ']': case '-': case '\'': case '^': case '/':
            *cp = (uint8_t)e;
            return 0;
        case 'x': nhex = 2; break;
        case 'u': nhex = 4; break;
        case 'U': nhex = 8; break;
        default:
            return perr(ps, at, "unknown escape '\\%c'", e);
        }
        uint32_t v = 0;
        for (int i = 0; i < nhex; i++) {
            int h = ps->p < ps->end ? hexval(*ps->p) : -1;
            if (h < 0) return perr(ps, at, "escape '\\%c' needs %d hex digits", e, nhex);
            v = v * 16 + (uint32_t)h;
            ps->p++;
        }
        if (v > 0x10FFFF || (v >= 0xD800 && v <= 0xDFFF))
            return perr(ps, at, "escape names U+%04X, which is not a character", v);
        *cp = v;
        return 0;
    }
    int n = utf8_decode(ps->p, ps->end, cp);
    if (!n) return perr(ps, at, "invalid UTF-8");
    ps->p += n;
    return 0;
}

static int parse_alternates(struct parser *ps, int32_t rid, int nested);

/* Replaces out[start..] (one symbol) by its repetition {lo, hi} (hi -1:
 * unbounded), through generated rules. */
static int repeat(struct parser *ps, struct gvec *out, int32_t start, int lo, int hi, size_t off) {
    int32_t n = out->n - start;
    struct gel *sym = malloc(sizeof *sym * (size_t)(n ? n : 1));
    if (!sym) return nomem(ps);
    if (n) memcpy(sym, out->v + start, sizeof *sym * (size_t)n);
    out->n = start;
    int rc = 0;
    for (int i = 0; i < lo && !rc; i++)
        for (int32_t j = 0; j < n && !rc; j++)
            if (gvec_push(out, sym[j].type, sym[j].value)) rc = nomem(ps);
    if (!rc && hi < 0) {
        /* rec ::= sym rec | "" */
        int32_t rid = rule_new(ps, NULL, 0, off);
        if (rid < 0) rc = rid;
        struct gvec b = {0};
        for (int32_t j = 0; j < n && !rc; j++)
            if (gvec_push(&b, sym[j].type, sym[j].value)) rc = nomem(ps);
        if (!rc && (gvec_push(&b, GEL_REF, (uint32_t)rid) || gvec_push(&b, GEL_ALT, 0) ||
                    gvec_push(&b, GEL_END, 0)))
            rc = nomem(ps);
        if (!rc) {
            ps->rules[rid].body = b;
            ps->rules[rid].defined = 1;
            if (gvec_push(out, GEL_REF, (uint32_t)rid)) rc = nomem(ps);
        } else {
            free(b.v);
        }
    } else if (!rc && hi > lo) {
        /* opt_1 ::= sym | "";  opt_k ::= sym opt_{k-1} | "" */
        int32_t prev = -1;
        for (int k = 1; k <= hi - lo && !rc; k++) {
            int32_t rid = rule_new(ps, NULL, 0, off);
            if (rid < 0) {
                rc = rid;
                break;
            }
            struct gvec b = {0};
            for (int32_t j = 0; j < n && !rc; j++)
                if (gvec_push(&b, sym[j].type, sym[j].value)) rc = nomem(ps);
            if (!rc && prev >= 0 && gvec_push(&b, GEL_REF, (uint32_t)prev)) rc = nomem(ps);
            if (!rc && (gvec_push(&b, GEL_ALT, 0) || gvec_push(&b, GEL_END, 0))) rc = nomem(ps);
            if (rc) {
                free(b.v);
                break;
            }
            ps->rules[rid].body = b;
            ps->rules[rid].defined = 1;
            prev = rid;
        }
        if (!rc && gvec_push(out, GEL_REF, (uint32_t)prev)) rc = nomem(ps);
    }
    free(sym);
    return rc;
}

static int parse_int(struct parser *ps, int *v) {
    const char *at = ps->p;
    long x = 0;
    if (ps->p >= ps->end || *ps->p < '0' || *ps->p > '9') return perr(ps, at, "expected a number");
    while (ps->p < ps->end && *ps->p >= '0' && *ps->p <= '9') {
        x = x * 10 + (*ps->p++ - '0');
        if (x > 100000) return perr(ps, at, "repetition count too large (at most 100000)");
    }
    *v = (int)x;
    return 0;
}

static int parse_sequence(struct parser *ps, struct gvec *out, int nested) {
    int32_t last = -1; /* start of the last symbol in out */
    while (ps->p < ps->end && !ps->status) {
        const char *at = ps->p;
        char c = *ps->p;
        if (c == '"') {
            ps->p++;
            last = out->n;
            while (ps->p < ps->end && *ps->p != '"') {
                uint32_t cp;
                if (*ps->p == '\n') return perr(ps, at, "unterminated literal (the line ends first)");
                if (parse_char(ps, &cp)) return ps->status;
                uint8_t b[4];
                int nb = utf8_encode(cp, b);
                for (int i = 0; i < nb; i++)
                    if (push_byte_range(ps, out, b[i], b[i])) return ps->status;
            }
            if (ps->p >= ps->end) return perr(ps, at, "unterminated literal");
            ps->p++;
        } else if (c == '[') {
            ps->p++;
            int negate = 0;
            if (ps->p < ps->end && *ps->p == '^') {
                negate = 1;
                ps->p++;
            }
            struct cprange *r = NULL;
            int n = 0, cap = 0;
            while (ps->p < ps->end && *ps->p != ']') {
                uint32_t lo, hi;
                const char *rat = ps->p;
                if (*ps->p == '\n') {
                    free(r);
                    return perr(ps, at, "unterminated character class (the line ends first)");
                }
                if (parse_char(ps, &lo)) {
                    free(r);
                    return ps->status;
                }
                hi = lo;
                if (ps->p + 1 < ps->end && *ps->p == '-' && ps->p[1] != ']') {
                    ps->p++;
                    if (parse_char(ps, &hi)) {
                        free(r);
                        return ps->status;
                    }
                    if (hi < lo) {
                        free(r);
                        return perr(ps, rat, "range end U+%04X is before its start U+%04X", hi, lo);
                    }
                }
                if (n == cap) {
                    cap = cap ? cap * 2 : 8;
                    struct cprange *nr = realloc(r, sizeof *r * (size_t)cap);
                    if (!nr) {
                        free(r);
                        return nomem(ps);
                    }
                    r = nr;
                }
                r[n++] = (struct cprange){lo, hi};
            }
            if (ps->p >= ps->end) {
                free(r);
                return perr(ps, at, "unterminated character class");
            }
            ps->p++;
            last = out->n;
            if (n == 0 && !negate) {
                free(r);
                return perr(ps, at, "empty character class");
            }
            int rc = emit_class(ps, out, r ? r : &(struct cprange){0, 0}, n, negate,
                                (size_t)(at - ps->src));
            free(r);
            if (rc) return rc;
        } else if (c == '.') {
            ps->p++;
            last = out->n;
            struct cprange none = {0, 0};
            if (emit_class(ps, out, &none, 0, 1, (size_t)(at - ps->src))) return ps->status;
        } else if (is_word(c)) {
            const char *s = ps->p;
            while (ps->p < ps->end && is_word(*ps->p)) ps->p++;
            /* a name followed by ::= starts the next rule */
            const char *q = ps->p;
            while (q < ps->end && (*q == ' ' || *q == '\t')) q++;
            if (q + 2 < ps->end && q[0] == ':' && q[1] == ':' && q[2] == '=') {
                if (nested) return perr(ps, s, "a rule definition inside a group ('(' not closed?)");
                ps->p = s;
                return 0;
            }
            int32_t rid = rule_find(ps, s, (size_t)(ps->p - s), (size_t)(s - ps->src));
            if (rid < 0) return rid;
            last = out->n;
            if (gvec_push(out, GEL_REF, (uint32_t)rid)) return nomem(ps);
        } else if (c == '(') {
            ps->p++;
            skip_space(ps, 1);
            int32_t rid = rule_new(ps, NULL, 0, (size_t)(at - ps->src));
            if (rid < 0) return rid;
            if (parse_alternates(ps, rid, 1)) return ps->status;
            if (ps->p >= ps->end || *ps->p != ')')
                return perr(ps, at, "this '(' is not closed");
            ps->p++;
            last = out->n;
            if (gvec_push(out, GEL_REF, (uint32_t)rid)) return nomem(ps);
        } else if (c == '*' || c == '+' || c == '?' || c == '{') {
            if (last < 0) return perr(ps, at, "'%c' follows nothing it could repeat", c);
            ps->p++;
            int lo = 0, hi = -1;
            if (c == '+') lo = 1;
            if (c == '?') hi = 1;
            if (c == '{') {
                skip_space(ps, 0);
                if (parse_int(ps, &lo)) return ps->status;
                skip_space(ps, 0);
                hi = lo;
                if (ps->p < ps->end && *ps->p == ',') {
                    ps->p++;
                    skip_space(ps, 0);
                    hi = -1;
                    if (ps->p < ps->end && *ps->p >= '0' && *ps->p <= '9') {
                        if (parse_int(ps, &hi)) return ps->status;
                        skip_space(ps, 0);
                        if (hi < lo)
                            return perr(ps, at, "repetition {%d,%d}: the maximum is below the "
                                        "minimum", lo, hi);
                    }
                }
                if (ps->p >= ps->end || *ps->p != '}') return perr(ps, ps->p, "expected '}'");
                ps->p++;
            }
            if (repeat(ps, out, last, lo, hi, (size_t)(at - ps->src))) return ps->status;
            last = -1;
        } else {
            break; /* '|', ')', newline: the caller decides */
        }
        skip_space(ps, nested);
    }
    return ps->status;
}

static int parse_alternates(struct parser *ps, int32_t rid, int nested) {
    struct gvec body = {0};
    for (;;) {
        if (parse_sequence(ps, &body, nested)) break;
        if (ps->p < ps->end && *ps->p == '|') {
            ps->p++;
            if (gvec_push(&body, GEL_ALT, 0)) {
                nomem(ps);
                break;
            }
            skip_space(ps, 1);
            continue;
        }
        if (gvec_push(&body, GEL_END, 0)) nomem(ps);
        break;
    }
    if (ps->status) {
        free(body.v);
        return ps->status;
    }
    ps->rules[rid].body = body;
    ps->rules[rid].defined = 1;
    return 0;
}

static int parse_all(struct parser *ps) {
    skip_space(ps, 1);
    while (ps->p < ps->end && !ps->status) {
        const char *at = ps->p;
        if (!is_word(*ps->p)) return perr(ps, at, "expected a rule name");
        while (ps->p < ps->end && is_word(*ps->p)) ps->p++;
        size_t nlen = (size_t)(ps->p - at);
        skip_space(ps, 0);
        if (ps->end - ps->p < 3 || memcmp(ps->p, "::=", 3) != 0)
            return perr(ps, ps->p, "expected '::=' after rule name '%.*s'", (int)nlen, at);
        ps->p += 3;
        skip_space(ps, 1);
        int32_t rid = rule_find(ps, at, nlen, (size_t)(at - ps->src));
        if (rid < 0) return rid;
        if (ps->rules[rid].defined) {
            int l, c;
            pos_of(ps->src, ps->rules[rid].def_off, &l, &c);
            return perr(ps, at, "rule '%.*s' is already defined at line %d", (int)nlen, at, l);
        }
        ps->rules[rid].defined = 1;
        ps->rules[rid].def_off = (size_t)(at - ps->src);
        if (parse_alternates(ps, rid, 0)) return ps->status;
        if (ps->p < ps->end && *ps->p != '\n' && *ps->p != '\r') {
            if (*ps->p == ')') return perr(ps, ps->p, "')' without a matching '('");
            return perr(ps, ps->p, "unexpected '%c'", *ps->p);
        }
        skip_space(ps, 1);
    }
    return ps->status;
}

/* ---- checks: every rule defined, a root, no left recursion -------------- */

static int rule_error(struct parser *ps, int32_t r, const char *what) {
    const struct prule *pr = &ps->rules[r];
    if (pr->name) return perr(ps, ps->src + pr->def_off, "rule '%s' %s", pr->name, what);
    return perr(ps, ps->src + pr->def_off, "the group or repetition here %s", what);
}

static int check_left_recursion(struct parser *ps) {
    int32_t n = ps->n_rules;
    uint8_t *nullable = calloc((size_t)n, 1);
    uint8_t *color = calloc((size_t)n, 1);
    int32_t *stack = malloc(sizeof *stack * (size_t)n * 2 + 1);
    if (!nullable || !color || !stack) {
        free(nullable), free(color), free(stack);
        return nomem(ps);
    }
    /* nullable: a fixed point */
    for (int changed = 1; changed;) {
        changed = 0;
        for (int32_t r = 0; r < n; r++) {
            if (nullable[r]) continue;
            const struct gvec *b = &ps->rules[r].body;
            int ok = 1;
            for (int32_t i = 0; i < b->n; i++) {
                const struct gel *e = &b->v[i];
                if (e->type == GEL_ALT || e->type == GEL_END) {
                    if (ok) {
                        nullable[r] = 1;
                        changed = 1;
                        break;
                    }
                    ok = 1;
                } else if (e->type == GEL_BYTES || (e->type == GEL_REF && !nullable[e->value])) {
                    ok = 0;
                }
            }
        }
    }
    /* DFS over "r may start with s" edges; a back edge is left recursion */
    int rc = 0;
    for (int32_t s0 = 0; s0 < n && !rc; s0++) {
        if (color[s0]) continue;
        /* iterative DFS: stack of (rule, element index) */
        int32_t top = 0;
        stack[0] = s0;
        stack[1] = 0;
        color[s0] = 1;
        while (top >= 0 && !rc) {
            int32_t r = stack[2 * top], i = stack[2 * top + 1];
            const struct gvec *b = &ps->rules[r].body;
            int32_t next = -1;
            /* find the next left-position reference from element i on */
            while (i < b->n) {
                const struct gel *e = &b->v[i];
                /* is element i at a left position? all before it in the alternative nullable */
                int left = 1;
                for (int32_t j = i - 1; j >= 0; j--) {
                    const struct gel *f = &b->v[j];
                    if (f->type == GEL_ALT) break;
                    if (f->type == GEL_BYTES || (f->type == GEL_REF && !nullable[f->value])) {
                        left = 0;
                        break;
                    }
                }
                i++;
                if (left && e->type == GEL_REF) {
                    next = (int32_t)e->value;
                    break;
                }
            }
            stack[2 * top + 1] = i;
            if (next < 0) {
                color[r] = 2;
                top--;
            } else if (color[next] == 1) {
                rc = rule_error(ps, next, "is left-recursive (it can reach itself without "
                                "consuming input)");
            } else if (color[next] == 0) {
                color[next] = 1;
                top++;
                stack[2 * top] = next;
                stack[2 * top + 1] = 0;
            }
        }
    }
    free(nullable), free(color), free(stack);
    return rc;
}

static void parser_free(struct parser *ps) {
    for (int32_t i = 0; i < ps->n_rules; i++) {
        free(ps->rules[i].name);
        free(ps->rules[i].body.v);
    }
    free(ps->rules);
    free(ps->sets);
}

int grammar_parse(grammar **out, const char *text, size_t len, char *err, size_t errlen) {
    *out = NULL;
    struct parser ps = {.src = text, .p = text, .end = text + len, .err = err, .errlen = errlen};
    int rc = parse_all(&ps);
    int32_t root = -1;
    for (int32_t i = 0; !rc && i < ps.n_rules; i++) {
        if (!ps.rules[i].defined) {
            rc = perr(&ps, ps.src + ps.rules[i].ref_off, "undefined rule '%s'", ps.rules[i].name);
        } else if (ps.rules[i].name && strcmp(ps.rules[i].name, "root") == 0) {
            root = i;
        }
    }
    if (!rc && root < 0) rc = perr(&ps, ps.src, "no rule named 'root' (the start rule)");
    if (!rc) rc = check_left_recursion(&ps);
    grammar *g = NULL;
    if (!rc) {
        g = calloc(1, sizeof *g);
        int32_t n_els = 0, n_alts = 0;
        for (int32_t i = 0; i < ps.n_rules; i++) {
            n_els += ps.rules[i].body.n;
            for (int32_t j = 0; j < ps.rules[i].body.n; j++)
                if (ps.rules[i].body.v[j].type <= GEL_ALT) n_alts++;
        }
        if (g) {
            g->els = malloc(sizeof *g->els * (size_t)(n_els + 1));
            g->alts = malloc(sizeof *g->alts * (size_t)(n_alts + 1));
            g->alt_off = malloc(sizeof *g->alt_off * (size_t)(ps.n_rules + 1));
            g->sets = malloc(32 * (size_t)(ps.n_sets + 1));
        }
        if (!g || !g->els || !g->alts || !g->alt_off || !g->sets) {
            rc = nomem(&ps);
        } else {
            int32_t e = 0, a = 0;
            for (int32_t r = 0; r < ps.n_rules; r++) {
                const struct gvec *b = &ps.rules[r].body;
                g->alt_off[r] = a;
                g->alts[a++] = e;
                for (int32_t j = 0; j < b->n; j++) {
                    g->els[e++] = b->v[j];
                    if (b->v[j].type == GEL_ALT) g->alts[a++] = e;
                }
            }
            g->alt_off[ps.n_rules] = a;
            g->n_els = e;
            g->n_rules = ps.n_rules;
            g->root = root;
            if (ps.n_sets) memcpy(g->sets, ps.sets, 32 * (size_t)ps.n_sets);
            g->n_sets = ps.n_sets;
            g->start = -2;
            g->lim = (struct grammar_limits){1 << 22, 1 << 20, (size_t)64 << 20, GRAMMAR_STACKS_MAX};
            pthread_mutex_init(&g->mu, NULL);
        }
    }
    parser_free(&ps);
    if (rc) {
        if (g) {
            free(g->els), free(g->alts), free(g->alt_off), free(g->sets);
            free(g);
        }
        return rc;
    }
    *out = g;
    return 0;
}

void grammar_set_limits(grammar *g, const struct grammar_limits *lim) {
    pthread_mutex_lock(&g->mu);
    if (lim->n_nodes_max > 0) g->lim.n_nodes_max = lim->n_nodes_max;
    if (lim->n_states_max > 0) g->lim.n_states_max = lim->n_states_max;
    if (lim->mask_cache_bytes > 0) g->lim.mask_cache_bytes = lim->mask_cache_bytes;
    if (lim->n_stacks_max > 0) g->lim.n_stacks_max = lim->n_stacks_max;
    pthread_mutex_unlock(&g->mu);
}
