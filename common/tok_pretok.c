/* The pre-tokenizer regexes as hand-written matchers.  Each matcher tries
 * the regex's alternatives in order at one position, with the same
 * backtracking outcome a regex engine would reach, and returns where the
 * match ends; every position is covered by some alternative, so the pieces
 * tile the text. */
#include "tok_pretok.h"

#include <stdlib.h>

#include "status.h"
#include "unicode.h"

struct pretok_text {
    const uint32_t *cp;  /* code points */
    const uint8_t *fl;   /* their unicode_flags */
    size_t n;
};

static int pt_letter(const struct pretok_text *t, size_t i) { return i < t->n && (t->fl[i] & UNICODE_LETTER); }
static int pt_number(const struct pretok_text *t, size_t i) { return i < t->n && (t->fl[i] & UNICODE_NUMBER); }
static int pt_space(const struct pretok_text *t, size_t i) { return i < t->n && (t->fl[i] & UNICODE_SPACE); }
/* [^\s\p{L}\p{N}] */
static int pt_other(const struct pretok_text *t, size_t i) { return i < t->n && t->fl[i] == 0; }
static int pt_newline(const struct pretok_text *t, size_t i) {
    return i < t->n && (t->cp[i] == '\r' || t->cp[i] == '\n');
}

static uint32_t pt_lower_ascii(uint32_t c) { return c >= 'A' && c <= 'Z' ? c + 32 : c; }

/* 's 't 're 've 'm 'll 'd at i: returns the end, or 0. */
static size_t pt_contraction(const struct pretok_text *t, size_t i, int icase) {
    if (t->cp[i] != '\'' || i + 1 >= t->n) return 0;
    uint32_t c1 = icase ? pt_lower_ascii(t->cp[i + 1]) : t->cp[i + 1];
    if (c1 == 's' || c1 == 't' || c1 == 'm' || c1 == 'd') return i + 2;
    if (i + 2 >= t->n) return 0;
    uint32_t c2 = icase ? pt_lower_ascii(t->cp[i + 2]) : t->cp[i + 2];
    if ((c1 == 'r' && c2 == 'e') || (c1 == 'v' && c2 == 'e') || (c1 == 'l' && c2 == 'l')) return i + 3;
    return 0;
}

/* \s+(?!\S)|\s+ at a whitespace position i. */
static size_t pt_spaces(const struct pretok_text *t, size_t i) {
    size_t k = i;
    while (pt_space(t, k)) k++;
    if (k == t->n || k - i < 2) return k;  /* at the end (?!\S) holds; one char: \s+ */
    return k - 1;                          /* leave the last space to the next word */
}

static size_t pt_match_gpt2(const struct pretok_text *t, size_t i) {
    size_t e = pt_contraction(t, i, 0);
    if (e) return e;
    /* " ?X+": the optional space only helps when the space is literal ' '. */
    size_t j = t->cp[i] == ' ' ? i + 1 : i;
    if (pt_letter(t, j)) {
        while (pt_letter(t, j)) j++;
        return j;
    }
    if (pt_number(t, j)) {
        while (pt_number(t, j)) j++;
        return j;
    }
    if (pt_other(t, j)) {
        while (pt_other(t, j)) j++;
        return j;
    }
    if (pt_space(t, i)) return pt_spaces(t, i);
    return i + 1;
}

static size_t pt_match_llama3(const struct pretok_text *t, size_t i) {
    size_t e = pt_contraction(t, i, 1);
    if (e) return e;
    /* [^\r\n\p{L}\p{N}]?\p{L}+ */
    if (!pt_newline(t, i) && !pt_letter(t, i) && !pt_number(t, i) && pt_letter(t, i + 1)) {
        size_t j = i + 1;
        while (pt_letter(t, j)) j++;
        return j;
    }
    if (pt_letter(t, i)) {
        size_t j = i;
        while (pt_letter(t, j)) j++;
        return j;
    }
    /* \p{N}{1,3} */
    if (pt_number(t, i)) {
        size_t j = i + 1;
        while (j < i + 3 && pt_number(t, j)) j++;
        return j;
    }
    /* ' ?[^\s\p{L}\p{N}]+[\r\n]*' */
    size_t j = t->cp[i] == ' ' ? i + 1 : i;
    if (pt_other(t, j)) {
        while (pt_other(t, j)) j++;
        while (pt_newline(t, j)) j++;
        return j;
    }
    if (pt_space(t, i)) {
        /* \s*[\r\n]+ backtracks to the last newline of the whitespace run. */
        size_t k = i, last = 0;
        int have = 0;
        while (pt_space(t, k)) {
            if (pt_newline(t, k)) last = k, have = 1;
            k++;
        }
        if (have) return last + 1;
        return pt_spaces(t, i);
    }
    return i + 1;
}

static int pt_push(struct tok_pieces *p, size_t end) {
    if (p->n == p->cap) {
        size_t cap = p->cap ? p->cap * 2 : 64;
        uint32_t *e = realloc(p->end, cap * sizeof *e);
        if (!e) return STATUS_NO_MEMORY;
        p->end = e;
        p->cap = cap;
    }
    p->end[p->n++] = (uint32_t)end;
    return 0;
}

int tok_pretok_split(enum tok_pretok_kind kind, const char *text, size_t len, struct tok_pieces *p) {
    if (len == 0) return 0;
    if (kind == TOK_PRETOK_NONE) return pt_push(p, len);
    if (kind == TOK_PRETOK_METASPACE) {
        /* U+2581 is E2 96 81; a piece ends before each one (except at 0). */
        for (size_t i = 1; i + 2 < len; i++)
            if ((unsigned char)text[i] == 0xE2 && (unsigned char)text[i + 1] == 0x96 &&
                (unsigned char)text[i + 2] == 0x81 && pt_push(p, i) < 0)
                return STATUS_NO_MEMORY;
        return pt_push(p, len);
    }
    uint32_t *cp = malloc(len * sizeof *cp);
    uint32_t *off = malloc((len + 1) * sizeof *off);
    uint8_t *fl = malloc(len);
    int rc = 0;
    if (!cp || !off || !fl) {
        rc = STATUS_NO_MEMORY;
        goto done;
    }
    size_t n = 0;
    for (size_t i = 0; i < len;) {
        int l = unicode_utf8_decode(text + i, len - i, &cp[n]);
        if (l < 0) {
            rc = STATUS_BAD_INPUT;
            goto done;
        }
        fl[n] = (uint8_t)unicode_flags(cp[n]);
        off[n++] = (uint32_t)i;
        i += (size_t)l;
    }
    off[n] = (uint32_t)len;
    struct pretok_text t = {cp, fl, n};
    for (size_t i = 0; i < n;) {
        size_t e = kind == TOK_PRETOK_GPT2 ? pt_match_gpt2(&t, i) : pt_match_llama3(&t, i);
        if ((rc = pt_push(p, off[e])) < 0) goto done;
        i = e;
    }
done:
    free(cp);
    free(off);
    free(fl);
    return rc;
}

void tok_pieces_free(struct tok_pieces *p) {
    free(p->end);
    p->end = NULL;
    p->n = p->cap = 0;
}
