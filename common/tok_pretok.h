/* Pre-tokenizer splitting for byte-level BPE: the GPT-2 and Llama-3 regexes
 * (and a split before every U+2581 for Metaspace), implemented by hand over
 * Unicode categories because no portable C regex library knows \p{L}. */
#ifndef COMMON_TOK_PRETOK_H
#define COMMON_TOK_PRETOK_H

#include <stddef.h>
#include <stdint.h>

enum tok_pretok_kind {
    TOK_PRETOK_NONE = 0,   /* the whole text is one piece */
    /* 's|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)|\s+ */
    TOK_PRETOK_GPT2,
    /* (?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}|
     * ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+ */
    TOK_PRETOK_LLAMA3,
    TOK_PRETOK_METASPACE,  /* a piece starts at every U+2581 */
};

/* Piece boundaries: end[i] is the byte offset where piece i ends. */
struct tok_pieces {
    uint32_t *end;
    size_t n, cap;
};

/* Splits text (len bytes of valid UTF-8, len < 4 GiB) into pieces appended to
 * p (whose arrays the caller frees, also on failure).  Returns 0,
 * STATUS_BAD_INPUT for invalid UTF-8, or STATUS_NO_MEMORY. */
int tok_pretok_split(enum tok_pretok_kind kind, const char *text, size_t len, struct tok_pieces *p);
void tok_pieces_free(struct tok_pieces *p);

#endif
