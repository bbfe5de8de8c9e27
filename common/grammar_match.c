/* The matcher behind grammar.h: hash-consed parse stacks, states as
 * interned sets of stacks with a lazily filled byte transition table (a DFA
 * built as it is used), the vocabulary's token trie, and masks computed by
 * walking that trie from a state, cached per state.
 *
 * Why it is fast enough per step: a transition already taken is one table
 * load; a trie subtree whose bytes all lead a state back to itself (the
 * inside of a string, a run of digits) is allowed whole without visiting
 * it; and a state seen before (by this sequence or another one sharing the
 * grammar) costs one copy of its cached mask. */
#include "grammar.h"

#include <stdlib.h>
#include <string.h>

#include "grammar-impl.h"
#include "status.h"

/* ---- the vocabulary and its trie ---------------------------------------- */

struct tnode {
    int32_t first_child, n_child; /* children are nodes[first_child .. + n_child) */
    int32_t lo, n_end, hi;        /* trie-order tokens: [lo, lo + n_end) end here, [lo, hi) below */
    int32_t desc;                 /* index into desc bytes, -1 when the subtree is small */
    uint8_t byte;
    uint8_t height;               /* longest token below, in bytes past this node (max 255) */
};

enum { VOCAB_NORMAL = 0, VOCAB_EOG = 1, VOCAB_NEVER = 2 };

struct grammar_vocab {
    int32_t n_vocab;
    uint8_t *bytes;     /* token bytes, concatenated */
    uint32_t *off;      /* (n_vocab + 1) */
    uint8_t *kind;      /* (n_vocab) VOCAB_* */
    int32_t *eog;
    int32_t n_eog;
    struct tnode *nodes; /* nodes[0] is the root (no byte) */
    int32_t n_nodes;
    int32_t *order;      /* trie order -> token id */
    int32_t n_order;
    uint64_t (*desc)[4]; /* bytes that occur strictly below a node */
    int32_t n_desc;
    uint64_t *normal;    /* (mask words) the tokens a grammar may allow at all */
    /* For each node with a descendant byte set (index d): the trie-order
     * tokens strictly below it sorted by length past the node,
     * bylen[bylen_at[d] ..], and cum[cum_at[d] + L] = how many of them
     * are at most L bytes longer than the node (L = 0 .. height). */
    int32_t *bylen, *bylen_at, *cum, *cum_at;
    size_t n_bylen, n_cum;
};

/* Subtrees with at least this many tokens get a descendant byte set. */
#define TRIE_DESC_MIN 16

static const grammar_vocab *sort_vocab;

static int tok_cmp(const void *a, const void *b) {
    const grammar_vocab *v = sort_vocab;
    int32_t x = *(const int32_t *)a, y = *(const int32_t *)b;
    uint32_t lx = v->off[x + 1] - v->off[x], ly = v->off[y + 1] - v->off[y];
    int c = memcmp(v->bytes + v->off[x], v->bytes + v->off[y], lx < ly ? lx : ly);
    if (c) return c;
    if (lx != ly) return lx < ly ? -1 : 1;
    return x < y ? -1 : x > y;
}

static int32_t tok_len(const grammar_vocab *v, int32_t id) {
    return (int32_t)(v->off[id + 1] - v->off[id]);
}

/* Builds node ni over order[lo..hi), which share their first depth bytes. */
static void trie_build(grammar_vocab *v, int32_t ni, int32_t lo, int32_t hi, int32_t depth) {
    struct tnode *n = &v->nodes[ni];
    n->lo = lo;
    n->hi = hi;
    int32_t i = lo;
    while (i < hi && tok_len(v, v->order[i]) == depth) i++;
    n->n_end = i - lo;
    int32_t n_child = 0;
    for (int32_t j = i; j < hi;) {
        uint8_t b = v->bytes[v->off[v->order[j]] + depth];
        while (j < hi && v->bytes[v->off[v->order[j]] + depth] == b) j++;
        n_child++;
    }
    int32_t first = v->n_nodes;
    v->n_nodes += n_child;
    v->nodes[ni].first_child = first;
    v->nodes[ni].n_child = n_child;
    int32_t c = first;
    for (int32_t j = i; j < hi;) {
        uint8_t b = v->bytes[v->off[v->order[j]] + depth];
        int32_t k = j;
        while (k < hi && v->bytes[v->off[v->order[k]] + depth] == b) k++;
        v->nodes[c].byte = b;
        v->nodes[c].desc = -1;
        trie_build(v, c, j, k, depth + 1);
        c++;
        j = k;
    }
}

/* Fills the descendant byte sets bottom-up; out gets node ni's own
 * "bytes at or below" set. */
/* Fills the by-length lists of node ni (a node with a descendant set) at
 * depth depth. */
static void trie_bylen(grammar_vocab *v, int32_t ni, int32_t depth) {
    const struct tnode *n = &v->nodes[ni];
    int32_t d = n->desc, h = n->height;
    v->bylen_at[d] = (int32_t)v->n_bylen;
    v->cum_at[d] = (int32_t)v->n_cum;
    int32_t *cum = v->cum + v->n_cum;
    memset(cum, 0, sizeof *cum * ((size_t)h + 1));
    for (int32_t i = n->lo + n->n_end; i < n->hi; i++) cum[tok_len(v, v->order[i]) - depth]++;
    int32_t acc = 0;
    for (int32_t L = 0; L <= h; L++) {
        int32_t c = cum[L];
        cum[L] = acc; /* start of length L, for the placement below */
        acc += c;
    }
    for (int32_t i = n->lo + n->n_end; i < n->hi; i++)
        v->bylen[v->n_bylen + (size_t)cum[tok_len(v, v->order[i]) - depth]++] = i;
    /* cum[L] is now the end of length L: the count of lengths <= L */
    v->n_bylen += (size_t)(n->hi - n->lo - n->n_end);
    v->n_cum += (size_t)h + 1;
}

static void trie_bylen_all(grammar_vocab *v, int32_t ni, int32_t depth) {
    const struct tnode *n = &v->nodes[ni];
    if (n->desc >= 0) trie_bylen(v, ni, depth);
    for (int32_t c = n->first_child; c < n->first_child + n->n_child; c++)
        trie_bylen_all(v, c, depth + 1);
}

static void trie_desc(grammar_vocab *v, int32_t ni, uint64_t out[4]) {
    uint64_t d[4] = {0, 0, 0, 0};
    struct tnode *n = &v->nodes[ni];
    int h = 0;
    for (int32_t c = n->first_child; c < n->first_child + n->n_child; c++) {
        uint64_t s[4];
        trie_desc(v, c, s);
        for (int k = 0; k < 4; k++) d[k] |= s[k];
        if (v->nodes[c].height + 1 > h) h = v->nodes[c].height + 1;
    }
    n->height = (uint8_t)(h > 255 ? 255 : h);
    if (ni != 0 && n->hi - n->lo >= TRIE_DESC_MIN && n->n_child) {
        n->desc = v->n_desc++;
        memcpy(v->desc[n->desc], d, 32);
    }
    if (ni != 0) d[n->byte >> 6] |= 1ull << (n->byte & 63);
    memcpy(out, d, 32);
}

int grammar_vocab_from_bytes(grammar_vocab **out, int32_t n_vocab, const char *const *bytes,
                             const int32_t *lens, const int32_t *eog, int32_t n_eog, char *err,
                             size_t errlen) {
    *out = NULL;
    if (n_vocab < 1) return status_fail(err, errlen, STATUS_BAD_INPUT, "n_vocab = %d", n_vocab);
    grammar_vocab *v = calloc(1, sizeof *v);
    if (!v) return status_fail(err, errlen, STATUS_NO_MEMORY, "grammar vocab: out of memory");
    v->n_vocab = n_vocab;
    size_t total = 0;
    for (int32_t i = 0; i < n_vocab; i++) total += lens[i] > 0 ? (size_t)lens[i] : 0;
    v->bytes = malloc(total + 1);
    v->off = malloc(sizeof *v->off * ((size_t)n_vocab + 1));
    v->kind = calloc((size_t)n_vocab, 1);
    v->eog = malloc(sizeof *v->eog * ((size_t)n_eog + 1));
    v->order = malloc(sizeof *v->order * (size_t)n_vocab);
    /* a trie has at most total + 1 nodes */
    v->nodes = calloc(total + 1, sizeof *v->nodes);
    if (!v->bytes || !v->off || !v->kind || !v->eog || !v->order || !v->nodes) goto oom;
    size_t o = 0;
    for (int32_t i = 0; i < n_vocab; i++) {
        v->off[i] = (uint32_t)o;
        if (lens[i] > 0) {
            memcpy(v->bytes + o, bytes[i], (size_t)lens[i]);
            o += (size_t)lens[i];
        } else {
            v->kind[i] = VOCAB_NEVER;
        }
    }
    v->off[n_vocab] = (uint32_t)o;
    for (int32_t i = 0; i < n_eog; i++) {
        if (eog[i] < 0 || eog[i] >= n_vocab) continue;
        v->kind[eog[i]] = VOCAB_EOG;
        v->eog[v->n_eog++] = eog[i];
    }
    for (int32_t i = 0; i < n_vocab; i++)
        if (v->kind[i] == VOCAB_NORMAL) v->order[v->n_order++] = i;
    /* qsort has no context argument in C11: the comparison reads sort_vocab, under a lock */
    static pthread_mutex_t sort_mu = PTHREAD_MUTEX_INITIALIZER;
    pthread_mutex_lock(&sort_mu);
    sort_vocab = v;
    qsort(v->order, (size_t)v->n_order, sizeof *v->order, tok_cmp);
    pthread_mutex_unlock(&sort_mu);
    v->n_nodes = 1;
    v->nodes[0].desc = -1;
    trie_build(v, 0, 0, v->n_order, 0);
    int32_t n_big = 0;
    for (int32_t i = 0; i < v->n_nodes; i++)
        if (i && v->nodes[i].hi - v->nodes[i].lo >= TRIE_DESC_MIN && v->nodes[i].n_child) n_big++;
    v->desc = malloc(32 * ((size_t)n_big + 1));
    if (!v->desc) goto oom;
    uint64_t all[4];
    trie_desc(v, 0, all);
    size_t n_bylen = 0, n_cum = 0;
    for (int32_t i = 1; i < v->n_nodes; i++)
        if (v->nodes[i].desc >= 0) {
            n_bylen += (size_t)(v->nodes[i].hi - v->nodes[i].lo - v->nodes[i].n_end);
            n_cum += (size_t)v->nodes[i].height + 1;
        }
    v->bylen = malloc(sizeof *v->bylen * (n_bylen + 1));
    v->cum = malloc(sizeof *v->cum * (n_cum + 1));
    v->bylen_at = malloc(sizeof *v->bylen_at * ((size_t)v->n_desc + 1));
    v->cum_at = malloc(sizeof *v->cum_at * ((size_t)v->n_desc + 1));
    if (!v->bylen || !v->cum || !v->bylen_at || !v->cum_at) goto oom;
    trie_bylen_all(v, 0, 0);
    v->normal = calloc(grammar_vocab_mask_words(v), 8);
    if (!v->normal) goto oom;
    for (int32_t i = 0; i < v->n_order; i++) v->normal[v->order[i] >> 6] |= 1ull << (v->order[i] & 63);
    *out = v;
    return 0;
oom:
    grammar_vocab_free(v);
    return status_fail(err, errlen, STATUS_NO_MEMORY, "grammar vocab: out of memory (%d tokens)",
                       n_vocab);
}

void grammar_vocab_free(grammar_vocab *v) {
    if (!v) return;
    free(v->bytes), free(v->off), free(v->kind), free(v->eog), free(v->order), free(v->nodes);
    free(v->desc), free(v->normal), free(v->bylen), free(v->cum), free(v->bylen_at), free(v->cum_at);
    free(v);
}

int32_t grammar_vocab_n_vocab(const grammar_vocab *v) { return v->n_vocab; }
size_t grammar_vocab_mask_words(const grammar_vocab *v) { return ((size_t)v->n_vocab + 63) / 64; }
int grammar_vocab_is_eog(const grammar_vocab *v, int32_t token) {
    return token >= 0 && token < v->n_vocab && v->kind[token] == VOCAB_EOG;
}

/* ---- stacks and states -------------------------------------------------- */

static uint32_t hash2(uint32_t a, uint32_t b) {
    uint64_t h = ((uint64_t)a << 32 | b) * 0x9E3779B97F4A7C15ull;
    return (uint32_t)(h >> 32);
}

static int ht_grow(int32_t **ht, uint32_t *mask, int32_t n_used) {
    if (*ht && (uint32_t)n_used * 2 < *mask) return 0;
    uint32_t size = *ht ? (*mask + 1) * 2 : 1024;
    int32_t *nt = calloc(size, sizeof *nt);
    if (!nt) return STATUS_NO_MEMORY;
    free(*ht);
    *ht = nt;
    *mask = size - 1;
    return 1; /* the caller rehashes */
}

static uint32_t node_hash(const struct gnode *n) { return hash2(n->pos, (uint32_t)n->parent); }

/* The id of frame (pos, parent), made when new; -1 when the table is full. */
static int32_t node_get(grammar *g, uint32_t pos, int32_t parent) {
    int grown = ht_grow(&g->node_ht, &g->node_ht_mask, g->n_nodes);
    if (grown < 0) return -1;
    if (grown) {
        for (int32_t i = 1; i < g->n_nodes; i++) {
            uint32_t h = node_hash(&g->nodes[i]) & g->node_ht_mask;
            while (g->node_ht[h]) h = (h + 1) & g->node_ht_mask;
            g->node_ht[h] = i + 1;
        }
    }
    uint32_t h = hash2(pos, (uint32_t)parent) & g->node_ht_mask;
    for (;; h = (h + 1) & g->node_ht_mask) {
        int32_t id = g->node_ht[h] - 1;
        if (id < 0) break;
        if (g->nodes[id].pos == pos && g->nodes[id].parent == parent) return id;
    }
    if (g->n_nodes >= g->lim.n_nodes_max) return -1;
    if (g->n_nodes == g->cap_nodes) {
        int32_t cap = g->cap_nodes * 2;
        struct gnode *nn = realloc(g->nodes, sizeof *nn * (size_t)cap);
        if (!nn) return -1;
        g->nodes = nn;
        g->cap_nodes = cap;
    }
    int32_t id = g->n_nodes++;
    g->nodes[id] = (struct gnode){pos, parent};
    g->node_ht[h] = id + 1;
    return id;
}

static int scratch_push(grammar *g, int32_t id) {
    if (g->n_scratch == g->cap_scratch) {
        int32_t cap = g->cap_scratch ? g->cap_scratch * 2 : 64;
        int32_t *s = realloc(g->scratch, sizeof *s * (size_t)cap);
        if (!s) return STATUS_EXHAUSTED;
        g->scratch = s;
        g->cap_scratch = cap;
    }
    g->scratch[g->n_scratch++] = id;
    return 0;
}

/* Adds to the scratch list the stacks that continue at (pos, parent), each
 * with a byte element on top (0 for "nothing left": complete). */
static int expand(grammar *g, uint32_t pos, int32_t parent, int depth) {
    if (depth > 10000) return STATUS_EXHAUSTED;
    for (;;) {
        const struct gel *e = &g->els[pos];
        if (e->type == GEL_END || e->type == GEL_ALT) {
            if (parent == 0) return scratch_push(g, 0);
            pos = g->nodes[parent].pos;
            parent = g->nodes[parent].parent;
            continue;
        }
        if (e->type == GEL_BYTES) {
            int32_t id = node_get(g, pos, parent);
            return id < 0 ? STATUS_EXHAUSTED : scratch_push(g, id);
        }
        /* GEL_REF: a frame for where this rule continues, unless it would
         * only pop (a tail call) */
        uint32_t nt = g->els[pos + 1].type;
        int32_t ret = parent;
        if (nt != GEL_END && nt != GEL_ALT) {
            ret = node_get(g, pos + 1, parent);
            if (ret < 0) return STATUS_EXHAUSTED;
        }
        uint32_t r = e->value;
        for (int32_t a = g->alt_off[r]; a < g->alt_off[r + 1]; a++) {
            int rc = expand(g, (uint32_t)g->alts[a], ret, depth + 1);
            if (rc) return rc;
        }
        return 0;
    }
}

static int i32_cmp(const void *a, const void *b) {
    int32_t x = *(const int32_t *)a, y = *(const int32_t *)b;
    return x < y ? -1 : x > y;
}

static uint32_t state_hash(const int32_t *ids, uint32_t n) {
    uint32_t h = 2166136261u;
    for (uint32_t i = 0; i < n; i++) h = hash2(h, (uint32_t)ids[i]);
    return h;
}

/* Interns the scratch list as a state: its id, -1 (dead) when empty, or
 * STATUS_EXHAUSTED. */
static int32_t state_intern(grammar *g) {
    if (g->n_scratch == 0) return GRAMMAR_STATE_DEAD;
    qsort(g->scratch, (size_t)g->n_scratch, sizeof *g->scratch, i32_cmp);
    uint32_t n = 0;
    for (int32_t i = 0; i < g->n_scratch; i++)
        if (n == 0 || g->scratch[n - 1] != g->scratch[i]) g->scratch[n++] = g->scratch[i];
    if (n > (uint32_t)g->lim.n_stacks_max) return STATUS_EXHAUSTED;
    int grown = ht_grow(&g->state_ht, &g->state_ht_mask, g->n_states);
    if (grown < 0) return STATUS_EXHAUSTED;
    if (grown) {
        for (int32_t i = 0; i < g->n_states; i++) {
            uint32_t h = state_hash(g->pool + g->states[i].off, g->states[i].n) & g->state_ht_mask;
            while (g->state_ht[h]) h = (h + 1) & g->state_ht_mask;
            g->state_ht[h] = i + 1;
        }
    }
    uint32_t h = state_hash(g->scratch, n) & g->state_ht_mask;
    for (;; h = (h + 1) & g->state_ht_mask) {
        int32_t id = g->state_ht[h] - 1;
        if (id < 0) break;
        const struct gstate *s = &g->states[id];
        if (s->n == n && memcmp(g->pool + s->off, g->scratch, sizeof(int32_t) * n) == 0) return id;
    }
    if (g->n_states >= g->lim.n_states_max) return STATUS_EXHAUSTED;
    if (g->n_states == g->cap_states) {
        int32_t cap = g->cap_states ? g->cap_states * 2 : 256;
        struct gstate *ns = realloc(g->states, sizeof *ns * (size_t)cap);
        if (!ns) return STATUS_EXHAUSTED;
        g->states = ns;
        g->cap_states = cap;
    }
    if (g->n_pool + n > g->cap_pool) {
        uint32_t cap = g->cap_pool ? g->cap_pool * 2 : 4096;
        while (cap < g->n_pool + n) cap *= 2;
        int32_t *np = realloc(g->pool, sizeof *np * cap);
        if (!np) return STATUS_EXHAUSTED;
        g->pool = np;
        g->cap_pool = cap;
    }
    memcpy(g->pool + g->n_pool, g->scratch, sizeof(int32_t) * n);
    int32_t id = g->n_states++;
    struct gstate *s = &g->states[id];
    memset(s, 0, sizeof *s);
    s->off = g->n_pool;
    s->n = n;
    s->complete = g->scratch[0] == 0;
    g->n_pool += n;
    g->state_ht[h] = id + 1;
    return id;
}

static int tables_init(grammar *g) {
    if (g->nodes) return 0;
    g->cap_nodes = 1024;
    g->nodes = malloc(sizeof *g->nodes * (size_t)g->cap_nodes);
    if (!g->nodes) return STATUS_NO_MEMORY;
    g->nodes[0] = (struct gnode){UINT32_MAX, 0};
    g->n_nodes = 1;
    return 0;
}

/* The state after byte b from state s (locked). */
static int32_t trans(grammar *g, int32_t s, uint8_t b);

/* Fills state s's whole transition table at once when it has at most 64
 * stacks: bytes that the same stacks accept lead to the same state, so a
 * table costs one expansion per distinct group (a handful), not 256. */
static int trans_fill(grammar *g, int32_t s) {
    struct gstate *st = &g->states[s];
    st->trans = malloc(256 * sizeof *st->trans);
    if (!st->trans) return STATUS_EXHAUSTED;
    for (int i = 0; i < 256; i++) st->trans[i] = -2;
    if (st->n > 64) return 0; /* filled byte by byte as used */
    uint64_t sig[256];
    memset(sig, 0, sizeof sig);
    for (uint32_t i = 0; i < st->n; i++) {
        int32_t id = g->pool[st->off + i];
        if (id == 0) continue;
        const uint64_t *set = g->sets[g->els[g->nodes[id].pos].value];
        for (int w = 0; w < 4; w++)
            for (uint64_t x = set[w]; x; x &= x - 1) sig[w * 64 + __builtin_ctzll(x)] |= 1ull << i;
    }
    uint64_t dsig[256];
    int32_t dres[256];
    int nd = 0;
    for (int b = 0; b < 256; b++) {
        if (!sig[b]) {
            g->states[s].trans[b] = GRAMMAR_STATE_DEAD;
            continue;
        }
        int j = 0;
        while (j < nd && dsig[j] != sig[b]) j++;
        if (j == nd) {
            g->n_scratch = 0;
            for (uint64_t x = sig[b]; x; x &= x - 1) {
                int i = __builtin_ctzll(x);
                const struct gnode nd_ = g->nodes[g->pool[g->states[s].off + (uint32_t)i]];
                int rc = expand(g, nd_.pos + 1, nd_.parent, 0);
                if (rc) return rc;
            }
            int32_t t = state_intern(g);
            if (t == STATUS_EXHAUSTED) return t;
            dsig[nd] = sig[b];
            dres[nd++] = t;
        }
        g->states[s].trans[b] = dres[j];
    }
    return 0;
}

static int32_t trans(grammar *g, int32_t s, uint8_t b) {
    struct gstate *st = &g->states[s];
    if (!st->trans) {
        int rc = trans_fill(g, s);
        if (rc) return rc;
        st = &g->states[s];
    }
    int32_t t = st->trans[b];
    if (t != -2) return t;
    g->n_scratch = 0;
    uint32_t off = st->off, n = st->n;
    for (uint32_t i = 0; i < n; i++) {
        int32_t id = g->pool[off + i];
        if (id == 0) continue;
        const struct gnode nd = g->nodes[id];
        const uint64_t *set = g->sets[g->els[nd.pos].value];
        if (!(set[b >> 6] >> (b & 63) & 1)) continue;
        int rc = expand(g, nd.pos + 1, nd.parent, 0);
        if (rc) return rc;
    }
    t = state_intern(g);
    if (t == STATUS_EXHAUSTED) return t;
    g->states[s].trans[b] = t; /* g->states may have moved */
    return t;
}

static int start_locked(grammar *g, int32_t *state) {
    if (g->start == -2) {
        if (tables_init(g)) return STATUS_EXHAUSTED;
        g->n_scratch = 0;
        int rc = 0;
        for (int32_t a = g->alt_off[g->root]; a < g->alt_off[g->root + 1] && !rc; a++)
            rc = expand(g, (uint32_t)g->alts[a], 0, 0);
        int32_t s = rc ? STATUS_EXHAUSTED : state_intern(g);
        if (s == STATUS_EXHAUSTED) return STATUS_EXHAUSTED;
        g->start = s;
    }
    *state = g->start;
    return 0;
}

int grammar_state_start(grammar *g, int32_t *state) {
    pthread_mutex_lock(&g->mu);
    int rc = start_locked(g, state);
    pthread_mutex_unlock(&g->mu);
    if (rc) *state = GRAMMAR_STATE_DEAD;
    return rc;
}

int grammar_state_is_complete(grammar *g, int32_t state) {
    if (state < 0) return 0;
    pthread_mutex_lock(&g->mu);
    int c = state < g->n_states && g->states[state].complete;
    pthread_mutex_unlock(&g->mu);
    return c;
}

static int accept_locked(grammar *g, int32_t s, const uint8_t *p, size_t len, int32_t *next) {
    for (size_t i = 0; i < len && s >= 0; i++) s = trans(g, s, p[i]);
    if (s == STATUS_EXHAUSTED) {
        *next = GRAMMAR_STATE_DEAD;
        return STATUS_EXHAUSTED;
    }
    *next = s < 0 ? GRAMMAR_STATE_DEAD : s;
    return 0;
}

int grammar_state_accept_bytes(grammar *g, int32_t state, const void *bytes, size_t len,
                               int32_t *next) {
    if (state < 0) {
        *next = GRAMMAR_STATE_DEAD;
        return 0;
    }
    pthread_mutex_lock(&g->mu);
    int rc = accept_locked(g, state, bytes, len, next);
    pthread_mutex_unlock(&g->mu);
    return rc;
}

int grammar_state_accept_token(grammar *g, const grammar_vocab *v, int32_t state, int32_t token,
                               int32_t *next) {
    *next = GRAMMAR_STATE_DEAD;
    if (state < 0 || token < 0 || token >= v->n_vocab) return 0;
    if (v->kind[token] == VOCAB_EOG) {
        if (grammar_state_is_complete(g, state)) *next = state;
        return 0;
    }
    if (v->kind[token] == VOCAB_NEVER) return 0;
    return grammar_state_accept_bytes(g, state, v->bytes + v->off[token],
                                      v->off[token + 1] - v->off[token], next);
}

/* ---- masks -------------------------------------------------------------- */

static void bits_set_range(uint64_t *w, int32_t lo, int32_t hi) {
    while (lo < hi && (lo & 63)) {
        w[lo >> 6] |= 1ull << (lo & 63);
        lo++;
    }
    while (lo + 64 <= hi) {
        w[lo >> 6] = ~0ull;
        lo += 64;
    }
    while (lo < hi) {
        w[lo >> 6] |= 1ull << (lo & 63);
        lo++;
    }
}

/* The run of state s (see struct gstate), computed to at least depth h
 * when it goes that far; *out = s's run array, *n its length. */
static int run_bytes(grammar *g, int32_t s, int h, const uint64_t (**out)[4], int *n) {
    if (h > GRAMMAR_RUN_MAX) h = GRAMMAR_RUN_MAX;
    /* the successor and bytes of each state on the chain, as needed */
    struct gstate *st = &g->states[s];
    if (!st->run) {
        st->run = malloc(sizeof *st->run * GRAMMAR_RUN_MAX);
        st->chain = malloc(sizeof *st->chain * (GRAMMAR_RUN_MAX + 1));
        if (!st->run || !st->chain) return STATUS_EXHAUSTED;
        st->chain[0] = s;
        for (int j = 1; j <= GRAMMAR_RUN_MAX; j++) st->chain[j] = -1;
    }
    int32_t cur = s;
    /* walk the chain to where s's run stops being computed */
    if (!g->states[s].run_end)
        for (int j = 0; j < g->states[s].n_run; j++) cur = g->states[cur].next;
    while (!g->states[s].run_end && g->states[s].n_run < h) {
        struct gstate *c = &g->states[cur];
        if (!c->run_known) {
            int32_t succ[256];
            for (int b = 0; b < 256; b++) {
                succ[b] = trans(g, cur, (uint8_t)b);
                if (succ[b] == STATUS_EXHAUSTED) return STATUS_EXHAUSTED;
            }
            /* the live successor reached by the most bytes */
            int32_t best = -1, best_n = 0;
            for (int b = 0; b < 256; b++) {
                if (succ[b] < 0) continue;
                int cnt = 0;
                for (int k = b; k < 256; k++) cnt += succ[k] == succ[b];
                if (cnt > best_n) best_n = cnt, best = succ[b];
                if (best_n > 128) break;
            }
            c = &g->states[cur];
            memset(c->run_bytes, 0, 32);
            c->next = best;
            for (int b = 0; b < 256 && best >= 0; b++)
                if (succ[b] == best) c->run_bytes[b >> 6] |= 1ull << (b & 63);
            c->run_known = 1;
        }
        struct gstate *ss = &g->states[s];
        int j = ss->n_run;
        for (int k = 0; k < 4; k++)
            ss->run[j][k] = (j ? ss->run[j - 1][k] : ~0ull) & c->run_bytes[k];
        ss->n_run++;
        ss->chain[j + 1] = c->next;
        if (c->next < 0 || !(ss->run[j][0] | ss->run[j][1] | ss->run[j][2] | ss->run[j][3])) {
            ss->run_end = 1; /* nothing longer can run */
            break;
        }
        cur = c->next;
    }
    *out = (const uint64_t(*)[4])g->states[s].run;
    *n = g->states[s].n_run;
    return 0;
}

/* The bytes with a live successor from s. */
static int alive_bytes(grammar *g, int32_t s, const uint64_t **out) {
    if (!g->states[s].alive_known) {
        uint64_t a[4] = {0, 0, 0, 0};
        for (int b = 0; b < 256; b++) {
            int32_t t = trans(g, s, (uint8_t)b);
            if (t == STATUS_EXHAUSTED) return t;
            if (t >= 0) a[b >> 6] |= 1ull << (b & 63);
        }
        memcpy(g->states[s].alive, a, 32);
        g->states[s].alive_known = 1;
    }
    *out = g->states[s].alive;
    return 0;
}

static int subset4(const uint64_t *a, const uint64_t *b) {
    return !(a[0] & ~b[0]) && !(a[1] & ~b[1]) && !(a[2] & ~b[2]) && !(a[3] & ~b[3]);
}

/* Marks in g->walk_bits the trie-order tokens below trie node ni (whose
 * bytes led to state s) that keep s alive. */
static int walk(grammar *g, const grammar_vocab *v, int32_t ni, int32_t s) {
    const struct tnode *n = &v->nodes[ni];
    for (int32_t c = n->first_child; c < n->first_child + n->n_child; c++) {
        const struct tnode *cn = &v->nodes[c];
        g->n_trie_visits++;
        int32_t t = trans(g, s, cn->byte);
        if (t == STATUS_EXHAUSTED) return t;
        if (t < 0) continue;
        if (cn->n_end) bits_set_range(g->walk_bits, cn->lo, cn->lo + cn->n_end);
        if (!cn->n_child) continue;
        if (cn->desc >= 0 && cn->height <= GRAMMAR_RUN_MAX) {
            /* every token below stays alive if all their bytes run from t */
            const uint64_t(*run)[4];
            int n_run;
            int rc = run_bytes(g, t, cn->height, &run, &n_run);
            if (rc) return rc;
            const uint64_t *d = v->desc[cn->desc];
            /* r: how many bytes of the subtree surely run from t */
            int r = 0, lim = n_run < cn->height ? n_run : cn->height;
            while (r < lim && subset4(d, run[r])) r++;
            if (r == cn->height) {
                bits_set_range(g->walk_bits, cn->lo + cn->n_end, cn->hi);
                continue;
            }
            if (r > 0 && g->states[t].chain[r] >= 0) {
                /* the tokens of at most r more bytes live; if no byte below
                 * lives after them, the longer ones all die */
                const uint64_t *alive;
                rc = alive_bytes(g, g->states[t].chain[r], &alive);
                if (rc) return rc;
                if (!(d[0] & alive[0]) && !(d[1] & alive[1]) && !(d[2] & alive[2]) &&
                    !(d[3] & alive[3])) {
                    const int32_t *bl = v->bylen + v->bylen_at[cn->desc];
                    int32_t k = v->cum[v->cum_at[cn->desc] + r];
                    for (int32_t i = 0; i < k; i++)
                        g->walk_bits[bl[i] >> 6] |= 1ull << (bl[i] & 63);
                    continue;
                }
            }
        }
        int rc = walk(g, v, c, t);
        if (rc) return rc;
    }
    return 0;
}

static void masks_drop(grammar *g) {
    for (int32_t i = 0; i < g->n_states; i++) {
        free(g->states[i].mask);
        g->states[i].mask = NULL;
    }
    g->mask_bytes = 0;
}

static int mask_locked(grammar *g, const grammar_vocab *v, int32_t s, uint64_t *mask) {
    size_t words = grammar_vocab_mask_words(v);
    if (g->mask_vocab != v) {
        masks_drop(g);
        g->mask_vocab = v;
    }
    if (g->states[s].mask) {
        memcpy(mask, g->states[s].mask, words * 8);
        g->n_masks_cached++;
        return 0;
    }
    size_t twords = ((size_t)v->n_order + 63) / 64 + 1;
    if (g->walk_words < twords) {
        uint64_t *w = realloc(g->walk_bits, twords * 8);
        if (!w) return STATUS_EXHAUSTED;
        g->walk_bits = w;
        g->walk_words = twords;
    }
    memset(g->walk_bits, 0, twords * 8);
    int rc = walk(g, v, 0, s);
    if (rc) return rc;
    /* trie order to id order: set the allowed tokens, or when they are
     * most of the vocabulary, clear the others */
    size_t n_set = 0;
    for (size_t w = 0; w < twords; w++) n_set += (size_t)__builtin_popcountll(g->walk_bits[w]);
    int invert = n_set * 2 > (size_t)v->n_order;
    if (invert) memcpy(mask, v->normal, words * 8);
    else memset(mask, 0, words * 8);
    size_t full = (size_t)v->n_order / 64;
    for (size_t w = 0; w < twords && w * 64 < (size_t)v->n_order; w++) {
        uint64_t x = g->walk_bits[w];
        if (invert) {
            x = ~x;
            if (w == full) x &= (1ull << (v->n_order & 63)) - 1;
        }
        while (x) {
            int b = __builtin_ctzll(x);
            x &= x - 1;
            int32_t id = v->order[w * 64 + (size_t)b];
            if (invert) mask[id >> 6] &= ~(1ull << (id & 63));
            else mask[id >> 6] |= 1ull << (id & 63);
        }
    }
    if (g->states[s].complete)
        for (int32_t i = 0; i < v->n_eog; i++) mask[v->eog[i] >> 6] |= 1ull << (v->eog[i] & 63);
    g->n_masks_computed++;
    if (g->mask_bytes + words * 8 > g->lim.mask_cache_bytes) masks_drop(g);
    uint64_t *keep = malloc(words * 8);
    if (keep) {
        memcpy(keep, mask, words * 8);
        g->states[s].mask = keep;
        g->mask_bytes += words * 8;
    }
    return 0;
}

int grammar_mask(grammar *g, const grammar_vocab *v, int32_t state, uint64_t *mask) {
    size_t words = grammar_vocab_mask_words(v);
    if (state < 0) {
        memset(mask, 0, words * 8);
        return 0;
    }
    pthread_mutex_lock(&g->mu);
    int rc = state < g->n_states ? mask_locked(g, v, state, mask) : STATUS_BAD_INPUT;
    pthread_mutex_unlock(&g->mu);
    if (rc) memset(mask, 0, words * 8);
    return rc;
}

void grammar_get_stats(grammar *g, struct grammar_stats *st) {
    pthread_mutex_lock(&g->mu);
    st->n_nodes = g->n_nodes;
    st->n_states = g->n_states;
    st->n_masks_computed = g->n_masks_computed;
    st->n_masks_cached = g->n_masks_cached;
    st->n_trie_visits = g->n_trie_visits;
    pthread_mutex_unlock(&g->mu);
}

void grammar_free(grammar *g) {
    if (!g) return;
    for (int32_t i = 0; i < g->n_states; i++) {
        free(g->states[i].trans);
        free(g->states[i].mask);
        free(g->states[i].run);
        free(g->states[i].chain);
    }
    free(g->states), free(g->state_ht), free(g->pool), free(g->nodes), free(g->node_ht);
    free(g->scratch), free(g->walk_bits);
    free(g->els), free(g->alts), free(g->alt_off), free(g->sets);
    pthread_mutex_destroy(&g->mu);
    free(g);
}
