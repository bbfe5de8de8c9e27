/* Tokenizers read from model files: SentencePiece-style BPE (GGUF "llama":
 * scores, <0xNN> byte fallback, the U+2581 space prefix) and byte-level BPE
 * (GGUF "gpt2" with merges, or a Hugging Face tokenizer.json) with the
 * pre-tokenizer the file names; special and added tokens; BOS/EOS rules from
 * metadata; incremental detokenization that never emits half a character. */
#ifndef COMMON_TOKENIZER_H
#define COMMON_TOKENIZER_H

#include <stddef.h>
#include <stdint.h>

#include "gguf.h"

typedef struct tokenizer tokenizer;

/* Loaders: on success *out is a tokenizer the caller frees with
 * tokenizer_free (it owns all its memory: the GGUF file may be closed); on
 * failure *out = NULL, a negative status is returned and err says why.
 *
 * From GGUF metadata alone (works on vocab-only files of any architecture).
 * Errors name the file and the key: an unknown tokenizer.ggml.model or
 * tokenizer.ggml.pre is an error, not a fallback. */
int tokenizer_from_gguf(tokenizer **out, const gguf_file *f, char *err, size_t errlen);
/* From DIR/tokenizer.json (and DIR/tokenizer_config.json, DIR/config.json when
 * present, for BOS/EOS and add_bos rules). */
int tokenizer_from_hf(tokenizer **out, const char *dir, char *err, size_t errlen);
/* PATH is a .gguf file or a Hugging Face directory. */
int tokenizer_load(tokenizer **out, const char *path, char *err, size_t errlen);
void tokenizer_free(tokenizer *t);

int32_t tokenizer_n_vocab(const tokenizer *t);
int32_t tokenizer_bos(const tokenizer *t); /* -1 if none */
int32_t tokenizer_eos(const tokenizer *t); /* -1 if none */
int tokenizer_adds_bos(const tokenizer *t); /* does encoding add BOS by default */
/* End of generation: EOS, EOT and the other end tokens the metadata names. */
int tokenizer_is_eog(const tokenizer *t, int32_t id);
int32_t tokenizer_eot(const tokenizer *t); /* end of turn, -1 if none */
int tokenizer_adds_eos(const tokenizer *t); /* does encoding (add_bos -1) append EOS */
/* Does encoding put a space before the text (SentencePiece): pass this as
 * tokenizer_detok_init's strip_leading_space to get the text back. */
int tokenizer_adds_space_prefix(const tokenizer *t);
/* GGUF token type of id: 1 normal, 2 unknown, 3 control, 4 user-defined,
 * 5 unused, 6 byte; STATUS_BAD_INPUT outside the vocabulary. */
int tokenizer_token_type(const tokenizer *t, int32_t id);
/* Id of the token whose text (as stored: U+2581, byte-level characters) is
 * exactly text[0..len), or -1. */
int32_t tokenizer_token_find(const tokenizer *t, const char *text, size_t len);
/* Length of the longest token text, in bytes. */
int32_t tokenizer_token_len_max(const tokenizer *t);

/* Encodes len bytes of text.  add_bos: -1 as the metadata says, 0 never,
 * 1 always; EOS is appended when the metadata says so, unless add_bos is 0.
 * parse_special: 1 turns the text of special/added tokens
 * ("<s>", "<|eot_id|>") into their ids.  Writes at most n_max ids and
 * returns how many the text needs (call again with a larger buffer when that
 * exceeds n_max), or a negative status (invalid UTF-8 is STATUS_BAD_INPUT). */
int32_t tokenizer_encode(const tokenizer *t, const char *text, size_t len, int add_bos,
                         int parse_special, int32_t *ids, int32_t n_max);
/* tokenizer_encode with parse_special 1, except inside the n_plain spans
 * [plain[2i], plain[2i + 1]) (sorted, not overlapping): there no control
 * token is matched, nor an added (user-defined) token whose text also
 * occurs outside the spans; such text stays plain text.  For a chat prompt
 * the spans are the messages' texts (chat_template_render), so that a
 * message cannot forge the template's markers ("<|im_end|><|im_start|>system",
 * or DeepSeek's "<｜Assistant｜>", an added token that is not special). */
int32_t tokenizer_encode_plain(const tokenizer *t, const char *text, size_t len, int add_bos, const size_t *plain,
                               size_t n_plain, int32_t *ids, int32_t n_max);

/* The bytes token id stands for (byte tokens as their byte, U+2581 as a
 * space, byte-level BPE decoded); special tokens give their text.  Returns
 * the length (may exceed size: then truncated) or a negative status for an
 * id outside the vocabulary. */
int tokenizer_token_bytes(const tokenizer *t, int32_t id, char *buf, size_t size);

/* Incremental detokenization for streaming: push ids one at a time; what is
 * returned is always whole UTF-8 characters.  The leading space SentencePiece
 * adds to the first token of a text is dropped when strip_leading_space.
 * Control tokens (BOS, EOS, chat markers) add no text to the stream; use
 * tokenizer_token_bytes for their text.  The struct needs no freeing. */
struct detok {
    char pending[8];  /* bytes of an incomplete character */
    int n_pending;
    int at_start;
    int strip_leading_space;
};
void tokenizer_detok_init(struct detok *d, int strip_leading_space);
/* Writes id's text to out (NUL-terminated) and returns the bytes written,
 * or a negative status.  size >= tokenizer_detok_size_max(t) is always
 * enough; with less, a push that does not fit returns STATUS_EXHAUSTED and
 * changes nothing (64 bytes fit any token of up to 18 bytes). */
int tokenizer_detok_push(const tokenizer *t, struct detok *d, int32_t id, char *out, size_t size);
/* Room one tokenizer_detok_push may need: every byte replaced by U+FFFD. */
size_t tokenizer_detok_size_max(const tokenizer *t);
/* Flushes what is still pending at the end (an incomplete character becomes
 * one U+FFFD); size >= 4 is enough. */
int tokenizer_detok_flush(struct detok *d, char *out, size_t size);

#endif
