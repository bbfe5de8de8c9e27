/* Internals shared by tokenizer.c (encoding, decoding) and tok_load.c
 * (building a tokenizer from GGUF metadata or a Hugging Face folder).  Not
 * part of the public API: use tokenizer.h. */
#ifndef COMMON_TOK_IMPL_H
#define COMMON_TOK_IMPL_H

#include <stddef.h>
#include <stdint.h>

#include "tok_pretok.h"
#include "tokenizer.h"

enum tok_kind { TOK_KIND_SPM = 1, TOK_KIND_BPE = 2 };

/* When the normalizer puts t->prefix before a raw-text fragment. */
enum tok_prepend {
    TOK_PREPEND_NEVER = 0,
    TOK_PREPEND_AFTER_SPECIAL, /* at the start and after a special token (llama.cpp SPM) */
    TOK_PREPEND_ALWAYS,        /* every fragment (HF Prepend normalizer) */
    TOK_PREPEND_FIRST,         /* the fragment at offset 0 only (HF Metaspace "first") */
    TOK_PREPEND_IF_MISSING,    /* unless the fragment starts with it (HF ByteLevel add_prefix_space) */
};

struct tok_str {
    uint32_t off, len; /* in arena; arena[off + len] is NUL */
};

struct tok_pair {
    uint64_t key;    /* left id << 32 | right id; UINT64_MAX for an empty slot */
    int32_t rank;    /* lower merges first */
    int32_t result;  /* id of the merged string */
};

struct tokenizer {
    int kind;               /* enum tok_kind */
    int32_t n_vocab;        /* ids 0..n_vocab-1 are tokens */
    int32_t n_strs, cap_strs;
    struct tok_str *strs;   /* n_strs: the tokens, then strings merges name that are not tokens */
    char *arena;
    size_t arena_len, arena_cap;
    float *scores;          /* (n_vocab) SPM merge priority */
    uint8_t *types;         /* (n_vocab) enum tok_type */
    uint32_t *map_slots;    /* text -> id + 1 (0 empty), open addressing */
    size_t map_mask;
    struct tok_pair *pairs; /* (left, right) -> merge */
    size_t pair_mask, n_pairs;

    enum tok_pretok_kind pretok;
    int byte_level;         /* words are bytes mapped through byte_cp; tokens decode back */
    int byte_fallback;      /* characters outside the vocabulary become <0xNN> */
    int ignore_merges;      /* a word that is a token is taken whole */
    int escape_spaces;      /* ' ' -> U+2581 before merging */
    int decode_spaces;      /* U+2581 -> ' ' when decoding */
    int strip_space_prefix; /* decoding should drop the space the prefix added */
    int prepend;            /* enum tok_prepend */
    char prefix[8];
    size_t prefix_len;

    int32_t bos, eos, eot, eom, unk; /* -1 when absent */
    int add_bos, add_eos;
    int32_t *eog;
    int n_eog;
    int32_t *special;       /* tokens matched in text, longest first */
    int n_special;
    int32_t token_len_max;

    int32_t byte_ids[256];      /* <0xNN> token of each byte, -1 if none */
    int32_t byte_char_ids[256]; /* byte-level: id of the character byte b maps to */
    uint32_t byte_cp[256];      /* GPT-2 byte -> code point */
    int16_t cp_byte[324];       /* and back, -1 where none */
};

enum tok_type {
    TOK_TYPE_NORMAL = 1, TOK_TYPE_UNKNOWN = 2, TOK_TYPE_CONTROL = 3,
    TOK_TYPE_USER = 4, TOK_TYPE_UNUSED = 5, TOK_TYPE_BYTE = 6,
};

struct tokenizer *tok_alloc(void);
/* Adds a string to the string list (not the map); *id_out is its index. */
int tok_str_add(struct tokenizer *t, const char *s, size_t n, int32_t *id_out);
/* (Re)builds the text -> id map over all strings. */
int tok_map_build(struct tokenizer *t);
int32_t tok_map_find(const struct tokenizer *t, const char *s, size_t n);
/* Id of s, adding it (with an id >= n_vocab) if new; the map must exist. */
int tok_intern(struct tokenizer *t, const char *s, size_t n, int32_t *id_out);
int tok_merge_add(struct tokenizer *t, int32_t left, int32_t right, int32_t rank, int32_t result);
int tok_cp_to_byte(const struct tokenizer *t, uint32_t cp);
/* "<0xNN>" -> NN, else -1. */
int tok_parse_byte_token(const char *s, size_t len);
int tok_eog_add(struct tokenizer *t, int32_t id);
/* After the vocabulary and types are final: the special-token list and the
 * longest token length. */
int tok_finish(struct tokenizer *t);

#endif
