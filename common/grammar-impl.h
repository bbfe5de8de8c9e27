/* Internals shared by grammar.c (the GBNF parser and compiler) and
 * grammar_match.c (parse states, token trie, masks).  Not part of the API:
 * use grammar.h.
 *
 * A compiled grammar is llama.cpp's element form at the byte level: every
 * character class and literal has become byte sets, so the matcher never
 * holds half a UTF-8 character and a token that is one raw byte (<0xE2>)
 * is matched like any other. */
#ifndef COMMON_GRAMMAR_IMPL_H
#define COMMON_GRAMMAR_IMPL_H

#include <pthread.h>
#include <stdint.h>

#include "grammar.h"

enum gel_type {
    GEL_END = 0,   /* end of a rule's last alternative */
    GEL_ALT = 1,   /* end of an alternative, another follows */
    GEL_REF = 2,   /* value = rule index */
    GEL_BYTES = 3, /* value = index of a 256-bit byte set */
};

struct gel {
    uint32_t type;
    uint32_t value;
};

/* A parse stack frame, hash-consed: equal stacks are equal ids.  Id 0 is
 * the empty stack (the grammar is complete).  The top frame of a stack
 * points at a GEL_BYTES element; the frames below at where their rule
 * continues after the reference (never at an END/ALT: such a frame would
 * only pop, so the reference is a tail call and pushes nothing). */
struct gnode {
    uint32_t pos;
    int32_t parent;
};

/* A set of stacks (sorted node ids), interned. */
struct gstate {
    uint32_t off, n;   /* in g->pool */
    int32_t *trans;    /* (256) next state per byte, -2 unknown, -1 dead; NULL until used */
    uint64_t *mask;    /* cached mask in token id order, NULL when not cached */
    /* The run of this state, for skipping trie subtrees whole: next is the
     * live successor reached by the most bytes, run_bytes those bytes;
     * run[j - 1] = the bytes that lead from each of the first j states of
     * the chain this, next, next of next, ... to the one after it (so every
     * string of at most j bytes drawn from run[j - 1] stays alive). */
    int32_t next;
    uint64_t run_bytes[4];
    uint64_t (*run)[4];  /* (GRAMMAR_RUN_MAX) the first n_run filled */
    int32_t *chain;      /* (GRAMMAR_RUN_MAX + 1) chain[j]: the j-th state of the chain, -1 past it */
    uint64_t alive[4];   /* bytes with a live successor, when alive_known */
    uint8_t run_known, n_run, run_end, alive_known, complete; /* run_end: the run cannot grow */
};

/* Longest run kept per state (token bytes below a trie node beyond this
 * are walked, not skipped). */
#define GRAMMAR_RUN_MAX 64

struct grammar {
    struct gel *els;       /* (n_els) all rules, flattened */
    int32_t n_els;
    int32_t *alts;         /* (alt_off[n_rules]) the first element of each alternative */
    int32_t *alt_off;      /* (n_rules + 1) rule r's alternatives are alts[alt_off[r] .. alt_off[r+1]) */
    int32_t n_rules, root;
    uint64_t (*sets)[4];   /* (n_sets) byte sets */
    int32_t n_sets;

    pthread_mutex_t mu;    /* guards everything below */
    struct grammar_limits lim;
    struct gnode *nodes;
    int32_t n_nodes, cap_nodes;
    int32_t *node_ht;      /* open addressing, node id + 1, 0 empty */
    uint32_t node_ht_mask;
    struct gstate *states;
    int32_t n_states, cap_states;
    int32_t *state_ht;
    uint32_t state_ht_mask;
    int32_t *pool;
    uint32_t n_pool, cap_pool;
    int32_t *scratch;      /* a transition's stacks before interning */
    int32_t n_scratch, cap_scratch;
    int32_t start;         /* -2 until computed */
    const grammar_vocab *mask_vocab; /* the vocabulary the cached masks are for */
    size_t mask_bytes;
    uint64_t *walk_bits;   /* trie-order bits, one vocabulary's worth */
    size_t walk_words;
    int64_t n_masks_computed, n_masks_cached, n_trie_visits;
};

#endif
