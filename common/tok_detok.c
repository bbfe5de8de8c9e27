/* Detokenization: a token's bytes (byte tokens, GPT-2's byte <-> unicode
 * mapping, SentencePiece's U+2581 spaces) and the streaming detokenizer,
 * which returns whole UTF-8 characters only (an incomplete one waits for
 * the next token) and drops SentencePiece's leading space when asked. */
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "status.h"
#include "tok_impl.h"
#include "tokenizer.h"
#include "unicode.h"

int tokenizer_token_bytes(const tokenizer *t, int32_t id, char *buf, size_t size) {
    if (id < 0 || id >= t->n_vocab) return STATUS_BAD_INPUT;
    const char *s = t->arena + t->strs[id].off;
    size_t len = t->strs[id].len, n = 0;
    int ty = t->types[id];
#define TOK_PUT(c)                         \
    do {                                   \
        if (n < size) buf[n] = (char)(c);  \
        n++;                               \
    } while (0)
    if (ty == TOK_TYPE_BYTE && tok_parse_byte_token(s, len) >= 0) {
        TOK_PUT(tok_parse_byte_token(s, len));
    } else if (ty == TOK_TYPE_CONTROL || ty == TOK_TYPE_UNKNOWN || (ty == TOK_TYPE_USER && t->kind == TOK_KIND_BPE)) {
        for (size_t i = 0; i < len; i++) TOK_PUT(s[i]);
    } else if (t->byte_level) {
        for (size_t i = 0; i < len;) {
            uint32_t cp;
            int l = unicode_utf8_decode(s + i, len - i, &cp);
            int b = l > 0 ? tok_cp_to_byte(t, cp) : -1;
            if (l <= 0) l = 1;
            if (b >= 0) {
                TOK_PUT(b);
            } else {
                /* Not a mapped byte: the character stands for itself. */
                for (int k = 0; k < l; k++) TOK_PUT(s[i + (size_t)k]);
            }
            i += (size_t)l;
        }
    } else {
        for (size_t i = 0; i < len; i++) {
            if (t->decode_spaces && i + 3 <= len && memcmp(s + i, "\xE2\x96\x81", 3) == 0) {
                TOK_PUT(' ');
                i += 2;
            } else {
                TOK_PUT(s[i]);
            }
        }
    }
#undef TOK_PUT
    return n > INT32_MAX ? STATUS_BAD_INPUT : (int)n;
}

void tokenizer_detok_init(struct detok *d, int strip_leading_space) {
    memset(d, 0, sizeof *d);
    d->at_start = 1;
    d->strip_leading_space = strip_leading_space;
}

/* Whether s[0..n) (n < the length its lead byte announces) can still grow
 * into a valid character: continuation bytes, and the second byte in the
 * range the lead allows (no overlongs, surrogates or values > U+10FFFF). */
static int tok_utf8_prefix_ok(const unsigned char *s, size_t n) {
    for (size_t i = 1; i < n; i++)
        if ((s[i] & 0xC0) != 0x80) return 0;
    if (n >= 2) {
        if (s[0] == 0xE0 && s[1] < 0xA0) return 0;
        if (s[0] == 0xED && s[1] > 0x9F) return 0;
        if (s[0] == 0xF0 && s[1] < 0x90) return 0;
        if (s[0] == 0xF4 && s[1] > 0x8F) return 0;
    }
    return 1;
}

/* Moves whole characters of in[0..n) to out; what may still become a
 * character is left for later (*kept bytes at the end of in).  Returns the
 * bytes written to out, which has room for 3 * n. */
static size_t tok_utf8_emit(const unsigned char *in, size_t n, char *out, size_t *kept) {
    size_t i = 0, o = 0;
    *kept = 0;
    while (i < n) {
        int l = unicode_utf8_len(in[i]);
        if (l == 0) {
            memcpy(out + o, "\xEF\xBF\xBD", 3);
            o += 3;
            i++;
            continue;
        }
        if (i + (size_t)l > n) {
            if (tok_utf8_prefix_ok(in + i, n - i)) {
                *kept = n - i;
                break;
            }
            memcpy(out + o, "\xEF\xBF\xBD", 3);
            o += 3;
            i++;
            continue;
        }
        uint32_t cp;
        if (unicode_utf8_decode((const char *)in + i, (size_t)l, &cp) < 0) {
            memcpy(out + o, "\xEF\xBF\xBD", 3);
            o += 3;
            i++;
            continue;
        }
        memcpy(out + o, in + i, (size_t)l);
        o += (size_t)l;
        i += (size_t)l;
    }
    return o;
}

int tokenizer_detok_push(const tokenizer *t, struct detok *d, int32_t id, char *out, size_t size) {
    if (id < 0 || id >= t->n_vocab) return STATUS_BAD_INPUT;
    if (!out || size == 0) return STATUS_BAD_INPUT;
    out[0] = 0;
    /* Control tokens (BOS, EOS, chat markers) are not text in a stream. */
    if (t->types[id] == TOK_TYPE_CONTROL) return 0;
    size_t len = t->strs[id].len + 4, np = (size_t)d->n_pending;
    unsigned char stack_in[256];
    char stack_out[3 * 256];
    unsigned char *in = stack_in;
    char *o = stack_out;
    if (np + len > sizeof stack_in) {
        in = malloc(np + len);
        o = malloc(3 * (np + len));
        if (!in || !o) {
            if (in != stack_in) free(in);
            if (o != stack_out) free(o);
            return STATUS_NO_MEMORY;
        }
    }
    memcpy(in, d->pending, np);
    int n = tokenizer_token_bytes(t, id, (char *)in + np, len);
    size_t total = np + (size_t)(n > 0 ? n : 0);
    size_t skip = 0;
    if (d->at_start && n > 0) {
        if (d->strip_leading_space && in[0] == ' ') skip = 1;
    }
    size_t kept;
    size_t w = tok_utf8_emit(in + skip, total - skip, o, &kept);
    int rc;
    if (n < 0) {
        rc = n;
    } else if (w + 1 > size) {
        rc = STATUS_EXHAUSTED; /* nothing consumed: the caller may retry with more room */
    } else {
        memcpy(out, o, w);
        out[w] = 0;
        memcpy(d->pending, in + total - kept, kept);
        d->n_pending = (int)kept;
        if (n > 0) d->at_start = 0;
        rc = (int)w;
    }
    if (in != stack_in) free(in);
    if (o != stack_out) free(o);
    return rc;
}

int tokenizer_detok_flush(struct detok *d, char *out, size_t size) {
    if (!out || size == 0) return STATUS_BAD_INPUT;
    out[0] = 0;
    if (d->n_pending == 0) return 0;
    /* An incomplete character at the end is one replacement character. */
    if (size < 4) return STATUS_EXHAUSTED;
    memcpy(out, "\xEF\xBF\xBD", 4);
    d->n_pending = 0;
    return 3;
}
