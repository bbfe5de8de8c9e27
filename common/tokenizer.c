/* Tokenizers: SentencePiece-style BPE driven by scores (GGUF "llama") and
 * byte-level / merges-ranked BPE (GGUF "gpt2", Hugging Face tokenizer.json),
 * special-token partitioning and BOS/EOS rules.  Loading from GGUF and from
 * Hugging Face folders lives in tok_load.c, detokenization in
 * tok_detok.c. */
#include "tokenizer.h"

#include <stdlib.h>
#include <string.h>

#include "status.h"
#include "tok_impl.h"
#include "tok_pretok.h"
#include "unicode.h"

/* ---- hashing and the two hash tables ---------------------------------- */

static uint64_t tok_hash(const char *s, size_t n) {
    /* FNV-1a over 8-byte words, then a final avalanche: strings are short. */
    uint64_t h = 0xcbf29ce484222325ull ^ (n * 0x9E3779B97F4A7C15ull);
    size_t i = 0;
    for (; i + 8 <= n; i += 8) {
        uint64_t w;
        memcpy(&w, s + i, 8);
        h = (h ^ w) * 0x100000001b3ull;
        h ^= h >> 29;
    }
    for (; i < n; i++) h = (h ^ (unsigned char)s[i]) * 0x100000001b3ull;
    h ^= h >> 33;
    h *= 0xff51afd7ed558ccdull;
    h ^= h >> 33;
    return h;
}

static int tok_map_grow(struct tokenizer *t);

int32_t tok_map_find(const struct tokenizer *t, const char *s, size_t n) {
    if (!t->map_slots) return -1;
    uint64_t h = tok_hash(s, n);
    for (size_t i = h & t->map_mask;; i = (i + 1) & t->map_mask) {
        uint32_t v = t->map_slots[i];
        if (v == 0) return -1;
        const struct tok_str *ts = &t->strs[v - 1];
        if (ts->len == n && memcmp(t->arena + ts->off, s, n) == 0) return (int32_t)(v - 1);
    }
}

static void tok_map_put_slot(struct tokenizer *t, int32_t id) {
    const struct tok_str *ts = &t->strs[id];
    uint64_t h = tok_hash(t->arena + ts->off, ts->len);
    size_t i = h & t->map_mask;
    for (;; i = (i + 1) & t->map_mask) {
        uint32_t v = t->map_slots[i];
        if (v == 0) break;
        const struct tok_str *o = &t->strs[v - 1];
        /* Duplicate text: the later id wins, as in llama.cpp's map. */
        if (o->len == ts->len && memcmp(t->arena + o->off, t->arena + ts->off, ts->len) == 0) break;
    }
    t->map_slots[i] = (uint32_t)id + 1;
}

static int tok_map_grow(struct tokenizer *t) {
    size_t cap = t->map_mask ? (t->map_mask + 1) * 2 : 1024;
    while (cap < (size_t)t->n_strs * 2) cap *= 2;
    uint32_t *slots = calloc(cap, sizeof *slots);
    if (!slots) return STATUS_NO_MEMORY;
    free(t->map_slots);
    t->map_slots = slots;
    t->map_mask = cap - 1;
    for (int32_t id = 0; id < t->n_strs; id++) tok_map_put_slot(t, id);
    return 0;
}

int tok_map_build(struct tokenizer *t) { return tok_map_grow(t); }

/* Appends a string to the arena and the string list (not to the map). */
int tok_str_add(struct tokenizer *t, const char *s, size_t n, int32_t *id_out) {
    if (t->arena_len + n + 1 > t->arena_cap) {
        size_t cap = t->arena_cap ? t->arena_cap : 4096;
        while (t->arena_len + n + 1 > cap) cap *= 2;
        char *a = realloc(t->arena, cap);
        if (!a) return STATUS_NO_MEMORY;
        t->arena = a;
        t->arena_cap = cap;
    }
    if (t->n_strs == t->cap_strs) {
        int32_t cap = t->cap_strs ? t->cap_strs * 2 : 1024;
        struct tok_str *ss = realloc(t->strs, (size_t)cap * sizeof *ss);
        if (!ss) return STATUS_NO_MEMORY;
        t->strs = ss;
        t->cap_strs = cap;
    }
    memcpy(t->arena + t->arena_len, s, n);
    t->arena[t->arena_len + n] = 0; /* NUL-terminated so that tok_text is a C string */
    t->strs[t->n_strs].off = t->arena_len;
    t->strs[t->n_strs].len = (uint32_t)n;
    t->arena_len += n + 1;
    *id_out = t->n_strs++;
    return 0;
}

/* Id of a string, adding it beyond the vocabulary when it is new: merges may
 * name strings that are not tokens. */
int tok_intern(struct tokenizer *t, const char *s, size_t n, int32_t *id_out) {
    int32_t id = tok_map_find(t, s, n);
    if (id >= 0) {
        *id_out = id;
        return 0;
    }
    int rc = tok_str_add(t, s, n, &id);
    if (rc < 0) return rc;
    if ((size_t)t->n_strs * 2 > t->map_mask + 1) {
        if ((rc = tok_map_grow(t)) < 0) return rc;
    } else {
        tok_map_put_slot(t, id);
    }
    *id_out = id;
    return 0;
}

static uint64_t tok_pair_key(int32_t l, int32_t r) { return ((uint64_t)(uint32_t)l << 32) | (uint32_t)r; }

static size_t tok_pair_slot(uint64_t key, size_t mask) {
    uint64_t h = key * 0x9E3779B97F4A7C15ull;
    return (size_t)(h ^ (h >> 31)) & mask;
}

static int tok_pairs_grow(struct tokenizer *t) {
    size_t cap = t->pair_mask ? (t->pair_mask + 1) * 2 : 1024;
    struct tok_pair *slots = malloc(cap * sizeof *slots);
    if (!slots) return STATUS_NO_MEMORY;
    for (size_t i = 0; i < cap; i++) slots[i].key = UINT64_MAX;
    if (t->pairs) {
        for (size_t i = 0; i <= t->pair_mask; i++) {
            if (t->pairs[i].key == UINT64_MAX) continue;
            size_t j = tok_pair_slot(t->pairs[i].key, cap - 1);
            while (slots[j].key != UINT64_MAX) j = (j + 1) & (cap - 1);
            slots[j] = t->pairs[i];
        }
    }
    free(t->pairs);
    t->pairs = slots;
    t->pair_mask = cap - 1;
    return 0;
}

int tok_merge_add(struct tokenizer *t, int32_t left, int32_t right, int32_t rank, int32_t result) {
    if (!t->pairs || (t->n_pairs + 1) * 2 > t->pair_mask + 1) {
        int rc = tok_pairs_grow(t);
        if (rc < 0) return rc;
    }
    uint64_t key = tok_pair_key(left, right);
    size_t j = tok_pair_slot(key, t->pair_mask);
    while (t->pairs[j].key != UINT64_MAX) {
        if (t->pairs[j].key == key) return 0; /* a repeated merge keeps its first rank */
        j = (j + 1) & t->pair_mask;
    }
    t->pairs[j].key = key;
    t->pairs[j].rank = rank;
    t->pairs[j].result = result;
    t->n_pairs++;
    return 0;
}

static const struct tok_pair *tok_merge_find(const struct tokenizer *t, int32_t left, int32_t right) {
    if (!t->pairs) return NULL;
    uint64_t key = tok_pair_key(left, right);
    for (size_t j = tok_pair_slot(key, t->pair_mask);; j = (j + 1) & t->pair_mask) {
        if (t->pairs[j].key == key) return &t->pairs[j];
        if (t->pairs[j].key == UINT64_MAX) return NULL;
    }
}

/* ---- the GPT-2 byte <-> unicode mapping -------------------------------- */

/* Printable bytes stand for themselves; the other 68 (controls, space,
 * 0x7F..0xA0, 0xAD) move to U+0100 onwards in byte order, so every byte
 * becomes a visible character. */
static void tok_byte_map_init(struct tokenizer *t) {
    uint32_t next = 256;
    for (int b = 0; b < 256; b++) {
        int printable = (b >= 0x21 && b <= 0x7E) || (b >= 0xA1 && b <= 0xAC) || b >= 0xAE;
        t->byte_cp[b] = printable ? (uint32_t)b : next++;
    }
    for (size_t i = 0; i < sizeof t->cp_byte / sizeof t->cp_byte[0]; i++) t->cp_byte[i] = -1;
    for (int b = 0; b < 256; b++) t->cp_byte[t->byte_cp[b]] = (int16_t)b;
}

int tok_cp_to_byte(const struct tokenizer *t, uint32_t cp) {
    return cp < sizeof t->cp_byte / sizeof t->cp_byte[0] ? t->cp_byte[cp] : -1;
}

int tok_parse_byte_token(const char *s, size_t len) {
    if (len != 6 || memcmp(s, "<0x", 3) != 0 || s[5] != '>') return -1;
    int v = 0;
    for (int i = 3; i < 5; i++) {
        char c = s[i];
        int d = c >= '0' && c <= '9' ? c - '0' : c >= 'A' && c <= 'F' ? c - 'A' + 10 : c >= 'a' && c <= 'f' ? c - 'a' + 10 : -1;
        if (d < 0) return -1;
        v = v * 16 + d;
    }
    return v;
}

/* ---- lifetime and queries ----------------------------------------------- */

struct tokenizer *tok_alloc(void) {
    struct tokenizer *t = calloc(1, sizeof *t);
    if (!t) return NULL;
    t->bos = t->eos = t->eot = t->eom = t->unk = -1;
    for (int i = 0; i < 256; i++) t->byte_ids[i] = t->byte_char_ids[i] = -1;
    tok_byte_map_init(t);
    return t;
}

void tokenizer_free(tokenizer *t) {
    if (!t) return;
    free(t->strs);
    free(t->arena);
    free(t->scores);
    free(t->types);
    free(t->map_slots);
    free(t->pairs);
    free(t->eog);
    free(t->special);
    free(t);
}

int32_t tokenizer_n_vocab(const tokenizer *t) { return t->n_vocab; }
int32_t tokenizer_bos(const tokenizer *t) { return t->bos; }
int32_t tokenizer_eos(const tokenizer *t) { return t->eos; }
int32_t tokenizer_eot(const tokenizer *t) { return t->eot; }
int tokenizer_adds_bos(const tokenizer *t) { return t->add_bos; }
int tokenizer_adds_eos(const tokenizer *t) { return t->add_eos; }
int tokenizer_adds_space_prefix(const tokenizer *t) { return t->strip_space_prefix; }

int tokenizer_is_eog(const tokenizer *t, int32_t id) {
    if (id < 0) return 0;
    for (int i = 0; i < t->n_eog; i++)
        if (t->eog[i] == id) return 1;
    return 0;
}

int tokenizer_token_type(const tokenizer *t, int32_t id) {
    if (id < 0 || id >= t->n_vocab) return STATUS_BAD_INPUT;
    return t->types[id];
}

int32_t tokenizer_token_find(const tokenizer *t, const char *text, size_t len) {
    int32_t id = tok_map_find(t, text, len);
    return id < t->n_vocab ? id : -1;
}

int32_t tokenizer_token_len_max(const tokenizer *t) { return t->token_len_max; }

size_t tokenizer_detok_size_max(const tokenizer *t) {
    /* Every byte may become U+FFFD (3 bytes), pending bytes included, + NUL. */
    return 3 * ((size_t)t->token_len_max + 8) + 1;
}

/* Order of the ids matched in text: longest text first, then by id, so that
 * "<|eot_id|>" wins over any shorter token inside it. */
struct tok_special_key {
    uint32_t len;
    int32_t id;
};

static int tok_special_cmp(const void *a, const void *b) {
    const struct tok_special_key *x = a, *y = b;
    if (x->len != y->len) return x->len > y->len ? -1 : 1;
    return x->id < y->id ? -1 : x->id > y->id;
}

int tok_finish(struct tokenizer *t) {
    int n = 0;
    t->token_len_max = 0;
    for (int32_t id = 0; id < t->n_vocab; id++) {
        if ((int32_t)t->strs[id].len > t->token_len_max) t->token_len_max = (int32_t)t->strs[id].len;
        int ty = t->types[id];
        if ((ty == TOK_TYPE_CONTROL || ty == TOK_TYPE_USER || ty == TOK_TYPE_UNKNOWN) && t->strs[id].len > 0) n++;
    }
    free(t->special);
    t->special = malloc(((size_t)n + 1) * sizeof *t->special);
    struct tok_special_key *keys = malloc(((size_t)n + 1) * sizeof *keys);
    if (!t->special || !keys) {
        free(keys);
        return STATUS_NO_MEMORY;
    }
    t->n_special = 0;
    for (int32_t id = 0; id < t->n_vocab; id++) {
        int ty = t->types[id];
        if ((ty == TOK_TYPE_CONTROL || ty == TOK_TYPE_USER || ty == TOK_TYPE_UNKNOWN) && t->strs[id].len > 0)
            keys[t->n_special++] = (struct tok_special_key){t->strs[id].len, id};
    }
    qsort(keys, (size_t)t->n_special, sizeof *keys, tok_special_cmp);
    for (int i = 0; i < t->n_special; i++) t->special[i] = keys[i].id;
    free(keys);
    return 0;
}

int tok_eog_add(struct tokenizer *t, int32_t id) {
    if (id < 0 || tokenizer_is_eog(t, id)) return 0;
    int32_t *e = realloc(t->eog, ((size_t)t->n_eog + 1) * sizeof *e);
    if (!e) return STATUS_NO_MEMORY;
    t->eog = e;
    t->eog[t->n_eog++] = id;
    return 0;
}

/* ---- output vector and heaps -------------------------------------------- */

struct tok_out {
    int32_t *ids;
    size_t n, cap;
};

static int tok_out_push(struct tok_out *o, int32_t id) {
    if (o->n == o->cap) {
        size_t cap = o->cap ? o->cap * 2 : 256;
        int32_t *ids = realloc(o->ids, cap * sizeof *ids);
        if (!ids) return STATUS_NO_MEMORY;
        o->ids = ids;
        o->cap = cap;
    }
    o->ids[o->n++] = id;
    return 0;
}

/* A candidate merge of symbols left and right.  SPM orders by score (higher
 * first), BPE by rank (lower first): both store a key where larger wins. */
struct tok_bigram {
    double key;
    int32_t left, right;
    int32_t a, b; /* SPM: size of the merged text; BPE: ids of left and right */
};

struct tok_heap {
    struct tok_bigram *v;
    size_t n, cap;
};

/* Larger key first; on ties the left-most pair. */
static int tok_bigram_before(const struct tok_bigram *x, const struct tok_bigram *y) {
    if (x->key != y->key) return x->key > y->key;
    return x->left < y->left;
}

static int tok_heap_push(struct tok_heap *h, struct tok_bigram b) {
    if (h->n == h->cap) {
        size_t cap = h->cap ? h->cap * 2 : 256;
        struct tok_bigram *v = realloc(h->v, cap * sizeof *v);
        if (!v) return STATUS_NO_MEMORY;
        h->v = v;
        h->cap = cap;
    }
    size_t i = h->n++;
    while (i > 0) {
        size_t p = (i - 1) / 2;
        if (!tok_bigram_before(&b, &h->v[p])) break;
        h->v[i] = h->v[p];
        i = p;
    }
    h->v[i] = b;
    return 0;
}

static struct tok_bigram tok_heap_pop(struct tok_heap *h) {
    struct tok_bigram top = h->v[0], last = h->v[--h->n];
    size_t i = 0;
    for (;;) {
        size_t c = 2 * i + 1;
        if (c >= h->n) break;
        if (c + 1 < h->n && tok_bigram_before(&h->v[c + 1], &h->v[c])) c++;
        if (!tok_bigram_before(&h->v[c], &last)) break;
        h->v[i] = h->v[c];
        i = c;
    }
    if (h->n > 0) h->v[i] = last;
    return top;
}

/* Symbols of one word being merged, a doubly linked list over an array. */
struct tok_sym {
    int32_t prev, next;
    int32_t id;          /* BPE: interned id, -1 unknown, INT32_MIN merged away */
    uint32_t start, end; /* bytes of the word */
};

struct tok_work {
    struct tok_sym *syms;
    size_t cap_syms;
    struct tok_heap heap;
    char *buf; /* escaped / byte-mapped text */
    size_t cap_buf;
    struct tok_pieces pieces;
};

static void tok_work_free(struct tok_work *w) {
    free(w->syms);
    free(w->heap.v);
    free(w->buf);
    tok_pieces_free(&w->pieces);
}

static int tok_work_syms(struct tok_work *w, size_t n) {
    if (n <= w->cap_syms) return 0;
    size_t cap = w->cap_syms ? w->cap_syms : 256;
    while (cap < n) cap *= 2;
    struct tok_sym *s = realloc(w->syms, cap * sizeof *s);
    if (!s) return STATUS_NO_MEMORY;
    w->syms = s;
    w->cap_syms = cap;
    return 0;
}

static int tok_work_buf(struct tok_work *w, size_t n) {
    if (n <= w->cap_buf) return 0;
    size_t cap = w->cap_buf ? w->cap_buf : 1024;
    while (cap < n) cap *= 2;
    char *b = realloc(w->buf, cap);
    if (!b) return STATUS_NO_MEMORY;
    w->buf = b;
    w->cap_buf = cap;
    return 0;
}

/* Token of one raw byte: <0xNN>, else the byte as a one-character token,
 * else <unk>; STATUS_UNSUPPORTED if the vocabulary has none of them. */
static int tok_push_byte(const struct tokenizer *t, unsigned char b, struct tok_out *o) {
    int32_t id = t->byte_ids[b];
    if (id < 0) {
        char c = (char)b;
        id = tokenizer_token_find(t, &c, 1);
    }
    if (id < 0) id = t->unk;
    if (id < 0) return STATUS_UNSUPPORTED;
    return tok_out_push(o, id);
}

/* ---- SentencePiece-style merging by score -------------------------------- */

static int tok_spm_try(const struct tokenizer *t, struct tok_work *w, const char *text, int32_t l, int32_t r) {
    if (l < 0 || r < 0) return 0;
    const struct tok_sym *a = &w->syms[l], *b = &w->syms[r];
    int32_t id = tokenizer_token_find(t, text + a->start, b->end - a->start);
    if (id < 0) return 0;
    struct tok_bigram bg = {t->scores[id], l, r, (int32_t)(b->end - a->start), 0};
    return tok_heap_push(&w->heap, bg);
}

/* Repeatedly merges the adjacent pair whose text is the highest-scoring
 * token (left-most on ties); what stays unmerged and is not a token becomes
 * byte tokens. */
static int tok_spm_encode(const struct tokenizer *t, struct tok_work *w, const char *text, size_t len,
                          struct tok_out *o) {
    if (len == 0) return 0;
    int rc = tok_work_syms(w, len);
    if (rc < 0) return rc;
    int32_t n = 0;
    for (size_t i = 0; i < len;) {
        int l = unicode_utf8_len((unsigned char)text[i]);
        if (l == 0 || i + (size_t)l > len) l = 1;
        w->syms[n] = (struct tok_sym){n - 1, i + (size_t)l == len ? -1 : n + 1, 0, (uint32_t)i,
                                      (uint32_t)(i + (size_t)l)};
        n++;
        i += (size_t)l;
    }
    w->heap.n = 0;
    for (int32_t i = 1; i < n; i++)
        if ((rc = tok_spm_try(t, w, text, i - 1, i)) < 0) return rc;
    while (w->heap.n > 0) {
        struct tok_bigram bg = tok_heap_pop(&w->heap);
        struct tok_sym *a = &w->syms[bg.left], *b = &w->syms[bg.right];
        /* Stale when either side has been merged since it was queued. */
        if (a->start == a->end || b->start == b->end || a->next != bg.right ||
            (int32_t)(b->end - a->start) != bg.a)
            continue;
        a->end = b->end;
        b->start = b->end;
        a->next = b->next;
        if (b->next >= 0) w->syms[b->next].prev = bg.left;
        if ((rc = tok_spm_try(t, w, text, a->prev, bg.left)) < 0) return rc;
        if ((rc = tok_spm_try(t, w, text, bg.left, a->next)) < 0) return rc;
    }
    for (int32_t i = 0; i >= 0; i = w->syms[i].next) {
        const struct tok_sym *s = &w->syms[i];
        int32_t id = tokenizer_token_find(t, text + s->start, s->end - s->start);
        if (id >= 0) {
            if ((rc = tok_out_push(o, id)) < 0) return rc;
            continue;
        }
        /* Not a token: byte tokens, or one <unk> when the vocabulary has none. */
        if (t->byte_ids[(unsigned char)text[s->start]] < 0 && t->unk >= 0) {
            if ((rc = tok_out_push(o, t->unk)) < 0) return rc;
            continue;
        }
        for (uint32_t j = s->start; j < s->end; j++)
            if ((rc = tok_push_byte(t, (unsigned char)text[j], o)) < 0) return rc;
    }
    return 0;
}

/* ---- BPE merging by rank -------------------------------------------------- */

static int tok_bpe_try(const struct tokenizer *t, struct tok_work *w, int32_t l, int32_t r) {
    if (l < 0 || r < 0) return 0;
    int32_t a = w->syms[l].id, b = w->syms[r].id;
    if (a < 0 || b < 0) return 0;
    const struct tok_pair *p = tok_merge_find(t, a, b);
    if (!p) return 0;
    struct tok_bigram bg = {-(double)p->rank, l, r, a, b};
    return tok_heap_push(&w->heap, bg);
}

/* Tokens for a symbol that is not in the vocabulary: per character (per
 * byte for byte-level), then <0xNN> byte fallback, then <unk>. */
static int tok_bpe_fallback(const struct tokenizer *t, const char *word, uint32_t s, uint32_t e,
                            struct tok_out *o) {
    int rc;
    if (t->byte_level) {
        for (uint32_t j = s; j < e; j++) {
            int32_t id = t->byte_char_ids[(unsigned char)word[j]];
            if (id >= t->n_vocab) id = -1;
            if (id < 0) id = t->unk;
            if (id >= 0 && (rc = tok_out_push(o, id)) < 0) return rc;
        }
        return 0;
    }
    for (uint32_t j = s; j < e;) {
        int l = unicode_utf8_len((unsigned char)word[j]);
        if (l == 0 || j + (uint32_t)l > e) l = 1;
        int32_t id = tokenizer_token_find(t, word + j, (size_t)l);
        if (id >= 0) {
            if ((rc = tok_out_push(o, id)) < 0) return rc;
        } else if (t->byte_fallback) {
            for (int k = 0; k < l; k++)
                if ((rc = tok_push_byte(t, (unsigned char)word[j + (uint32_t)k], o)) < 0) return rc;
        } else if (t->unk >= 0) {
            if ((rc = tok_out_push(o, t->unk)) < 0) return rc;
        }
        j += (uint32_t)l;
    }
    return 0;
}

/* One pre-tokenized word: raw bytes for byte-level BPE, else text. */
static int tok_bpe_word(const struct tokenizer *t, struct tok_work *w, const char *word, size_t len,
                        struct tok_out *o) {
    int rc;
    if (len == 0) return 0;
    if (t->ignore_merges) {
        /* A word that is a token is taken whole (Llama-3, HF ignore_merges). */
        const char *s = word;
        size_t n = len;
        if (t->byte_level) {
            if ((rc = tok_work_buf(w, len * 2)) < 0) return rc;
            n = 0;
            for (size_t i = 0; i < len; i++) {
                unsigned char b = (unsigned char)word[i];
                n += (size_t)unicode_utf8_encode(t->byte_cp[b], w->buf + n);
            }
            s = w->buf;
        }
        int32_t id = tokenizer_token_find(t, s, n);
        if (id >= 0) return tok_out_push(o, id);
    }
    if ((rc = tok_work_syms(w, len)) < 0) return rc;
    int32_t n = 0;
    for (size_t i = 0; i < len;) {
        int l = 1;
        int32_t id;
        if (t->byte_level) {
            id = t->byte_char_ids[(unsigned char)word[i]];
        } else {
            l = unicode_utf8_len((unsigned char)word[i]);
            if (l == 0 || i + (size_t)l > len) l = 1;
            id = tok_map_find(t, word + i, (size_t)l);
        }
        w->syms[n] = (struct tok_sym){n - 1, i + (size_t)l == len ? -1 : n + 1, id, (uint32_t)i,
                                      (uint32_t)(i + (size_t)l)};
        n++;
        i += (size_t)l;
    }
    w->heap.n = 0;
    for (int32_t i = 1; i < n; i++)
        if ((rc = tok_bpe_try(t, w, i - 1, i)) < 0) return rc;
    while (w->heap.n > 0) {
        struct tok_bigram bg = tok_heap_pop(&w->heap);
        struct tok_sym *a = &w->syms[bg.left], *b = &w->syms[bg.right];
        if (a->id != bg.a || b->id != bg.b || a->next != bg.right) continue;
        const struct tok_pair *p = tok_merge_find(t, a->id, b->id);
        a->id = p->result;
        a->end = b->end;
        b->id = INT32_MIN;
        a->next = b->next;
        if (b->next >= 0) w->syms[b->next].prev = bg.left;
        if ((rc = tok_bpe_try(t, w, a->prev, bg.left)) < 0) return rc;
        if ((rc = tok_bpe_try(t, w, bg.left, a->next)) < 0) return rc;
    }
    for (int32_t i = 0; i >= 0; i = w->syms[i].next) {
        const struct tok_sym *s = &w->syms[i];
        if (s->id >= 0 && s->id < t->n_vocab) {
            if ((rc = tok_out_push(o, s->id)) < 0) return rc;
        } else if ((rc = tok_bpe_fallback(t, word, s->start, s->end, o)) < 0) {
            return rc;
        }
    }
    return 0;
}

/* ---- encoding ---------------------------------------------------------- */

/* A fragment of the text: raw text [start, start+len) or a matched token. */
struct tok_frag {
    size_t start, len;
    int32_t id; /* -1 for raw text */
};

struct tok_frags {
    struct tok_frag *v;
    size_t n, cap;
};

static int tok_frags_push(struct tok_frags *f, struct tok_frag x) {
    if (f->n == f->cap) {
        size_t cap = f->cap ? f->cap * 2 : 16;
        struct tok_frag *v = realloc(f->v, cap * sizeof *v);
        if (!v) return STATUS_NO_MEMORY;
        f->v = v;
        f->cap = cap;
    }
    f->v[f->n++] = x;
    return 0;
}

/* Whether [at, at + n) overlaps one of the n_plain sorted spans of plain. */
static int tok_in_plain(const size_t *plain, size_t n_plain, size_t at, size_t n) {
    size_t lo = 0, hi = n_plain;
    while (lo < hi) { /* the first span that ends after at */
        size_t mid = lo + (hi - lo) / 2;
        if (plain[2 * mid + 1] <= at) lo = mid + 1;
        else hi = mid;
    }
    return lo < n_plain && plain[2 * lo] < at + n;
}

/* Whether tt (tl bytes) occurs in text somewhere outside the plain spans. */
static int tok_outside_plain(const char *text, size_t len, const char *tt, size_t tl, const size_t *plain,
                             size_t n_plain) {
    for (size_t from = 0; len - from >= tl;) {
        const char *m = memmem(text + from, len - from, tt, tl);
        if (!m) return 0;
        size_t at = (size_t)(m - text);
        if (!tok_in_plain(plain, n_plain, at, tl)) return 1;
        from = at + 1;
    }
    return 0;
}

/* Splits the raw fragments around every occurrence of each special token,
 * the longest tokens first (llama.cpp's partition).  User-defined tokens are
 * always matched (inside the spans of plain only where the text has them
 * nowhere else); control and unknown ones only with parse_special, and
 * never where they overlap a span of plain. */
static int tok_partition(const struct tokenizer *t, const char *text, size_t len, int parse_special,
                         const size_t *plain, size_t n_plain, struct tok_frags *frags) {
    struct tok_frags next = {0};
    int rc = tok_frags_push(frags, (struct tok_frag){0, len, -1});
    if (rc < 0) return rc;
    for (int s = 0; s < t->n_special; s++) {
        int32_t id = t->special[s];
        if (!parse_special && t->types[id] != TOK_TYPE_USER) continue;
        const char *tt = t->arena + t->strs[id].off;
        size_t tl = t->strs[id].len;
        int found = 0;
        for (size_t k = 0; k < frags->n && !found; k++)
            found = frags->v[k].id < 0 && frags->v[k].len >= tl &&
                    memmem(text + frags->v[k].start, frags->v[k].len, tt, tl) != NULL;
        if (!found) continue;
        /* Inside the plain spans a control token is never matched, nor an
         * added one that this text also has outside them (a marker of the
         * template); an added token that only the spans have is matched
         * there as anywhere. */
        int guarded = n_plain > 0 && (t->types[id] != TOK_TYPE_USER || tok_outside_plain(text, len, tt, tl, plain,
                                                                                          n_plain));
        next.n = 0;
        for (size_t k = 0; k < frags->n; k++) {
            struct tok_frag f = frags->v[k];
            if (f.id >= 0) {
                if ((rc = tok_frags_push(&next, f)) < 0) goto done;
                continue;
            }
            size_t pos = f.start, from = pos, end = f.start + f.len;
            for (;;) {
                const char *m = end - from >= tl ? memmem(text + from, end - from, tt, tl) : NULL;
                if (!m) break;
                size_t at = (size_t)(m - text);
                if (guarded && tok_in_plain(plain, n_plain, at, tl)) {
                    from = at + 1;
                    continue;
                }
                if (at > pos && (rc = tok_frags_push(&next, (struct tok_frag){pos, at - pos, -1})) < 0) goto done;
                if ((rc = tok_frags_push(&next, (struct tok_frag){at, tl, id})) < 0) goto done;
                pos = from = at + tl;
            }
            if (end > pos && (rc = tok_frags_push(&next, (struct tok_frag){pos, end - pos, -1})) < 0) goto done;
        }
        struct tok_frags tmp = *frags;
        *frags = next;
        next = tmp;
    }
done:
    free(next.v);
    return rc;
}

/* Text of one raw fragment after the normalizer: the optional prefix, then
 * spaces escaped to U+2581 when the model does that. */
static int tok_normalize(const struct tokenizer *t, struct tok_work *w, const char *s, size_t len,
                         int prefix, const char **out, size_t *out_len) {
    if (!prefix && !t->escape_spaces) {
        *out = s;
        *out_len = len;
        return 0;
    }
    int rc = tok_work_buf(w, len * 3 + sizeof t->prefix + 1);
    if (rc < 0) return rc;
    size_t n = 0;
    if (prefix) {
        memcpy(w->buf, t->prefix, t->prefix_len);
        n = t->prefix_len;
    }
    for (size_t i = 0; i < len; i++) {
        if (s[i] == ' ' && t->escape_spaces) {
            memcpy(w->buf + n, "\xE2\x96\x81", 3);
            n += 3;
        } else {
            w->buf[n++] = s[i];
        }
    }
    *out = w->buf;
    *out_len = n;
    return 0;
}

static int tok_encode_raw(const struct tokenizer *t, struct tok_work *w, const char *s, size_t len,
                          int first, int prev_special, struct tok_out *o) {
    int prefix = 0;
    switch (t->prepend) {
    case TOK_PREPEND_NEVER: break;
    case TOK_PREPEND_AFTER_SPECIAL: prefix = prev_special; break;
    case TOK_PREPEND_ALWAYS: prefix = 1; break;
    case TOK_PREPEND_FIRST: prefix = first; break;
    case TOK_PREPEND_IF_MISSING:
        prefix = len == 0 || len < t->prefix_len || memcmp(s, t->prefix, t->prefix_len) != 0;
        break;
    }
    const char *x;
    size_t n;
    int rc = tok_normalize(t, w, s, len, prefix, &x, &n);
    if (rc < 0) return rc;
    if (t->kind == TOK_KIND_SPM) return tok_spm_encode(t, w, x, n, o);
    /* BPE: words of the pre-tokenizer, each merged on its own.  The
     * normalized text may live in w->buf, which ignore_merges reuses, so
     * keep a private copy when it does. */
    char *own = NULL;
    if (x == w->buf) {
        own = malloc(n ? n : 1);
        if (!own) return STATUS_NO_MEMORY;
        memcpy(own, x, n);
        x = own;
    }
    w->pieces.n = 0;
    rc = tok_pretok_split(t->pretok, x, n, &w->pieces);
    size_t start = 0;
    for (size_t i = 0; rc == 0 && i < w->pieces.n; i++) {
        size_t end = w->pieces.end[i];
        rc = tok_bpe_word(t, w, x + start, end - start, o);
        start = end;
    }
    free(own);
    return rc;
}

static int32_t tok_encode(const tokenizer *t, const char *text, size_t len, int add_bos, int parse_special,
                          const size_t *plain, size_t n_plain, int32_t *ids, int32_t n_max) {
    if (!text && len > 0) return STATUS_BAD_INPUT;
    if (len > UINT32_MAX / 4) return STATUS_BAD_INPUT; /* offsets are 32-bit */
    if (unicode_utf8_valid_prefix(text, len) != len) return STATUS_BAD_INPUT;
    int bos = add_bos < 0 ? t->add_bos : add_bos != 0;
    if (bos && t->bos < 0) return STATUS_BAD_INPUT;
    struct tok_out o = {0};
    struct tok_frags frags = {0};
    struct tok_work w = {0};
    int rc = 0;
    if (bos && (rc = tok_out_push(&o, t->bos)) < 0) goto done;
    if (len > 0 && (rc = tok_partition(t, text, len, parse_special, plain, n_plain, &frags)) < 0) goto done;
    int prev_special = 1;
    for (size_t k = 0; k < frags.n; k++) {
        const struct tok_frag *f = &frags.v[k];
        if (f->id >= 0) {
            if ((rc = tok_out_push(&o, f->id)) < 0) goto done;
            prev_special = 1;
            continue;
        }
        rc = tok_encode_raw(t, &w, text + f->start, f->len, f->start == 0, prev_special, &o);
        if (rc < 0) goto done;
        prev_special = 0;
    }
    /* add_bos 0 means no added tokens at all (llama.cpp's add_special). */
    if (add_bos != 0 && t->add_eos && t->eos >= 0 && (rc = tok_out_push(&o, t->eos)) < 0) goto done;
    if (o.n > INT32_MAX) {
        rc = STATUS_BAD_INPUT;
        goto done;
    }
    if (ids && n_max > 0 && o.n > 0) memcpy(ids, o.ids, (o.n < (size_t)n_max ? o.n : (size_t)n_max) * sizeof *ids);
done:
    free(o.ids);
    free(frags.v);
    tok_work_free(&w);
    return rc < 0 ? rc : (int32_t)o.n;
}

int32_t tokenizer_encode(const tokenizer *t, const char *text, size_t len, int add_bos, int parse_special,
                         int32_t *ids, int32_t n_max) {
    return tok_encode(t, text, len, add_bos, parse_special, NULL, 0, ids, n_max);
}

int32_t tokenizer_encode_plain(const tokenizer *t, const char *text, size_t len, int add_bos, const size_t *plain,
                               size_t n_plain, int32_t *ids, int32_t n_max) {
    for (size_t i = 0; i < n_plain; i++)
        if (plain[2 * i] > plain[2 * i + 1] || plain[2 * i + 1] > len || (i > 0 && plain[2 * i] < plain[2 * i - 1]))
            return STATUS_BAD_INPUT;
    return tok_encode(t, text, len, add_bos, 1, plain, n_plain, ids, n_max);
}
