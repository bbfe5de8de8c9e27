/* Helpers shared by the libFuzzer harnesses: a private scratch folder for
 * the parsers that read files (GGUF, safetensors, Hugging Face folders),
 * splitting one input into several files, and where the test models are. */
#ifndef TESTS_FUZZ_UTIL_H
#define TESTS_FUZZ_UTIL_H

#include <stddef.h>
#include <stdint.h>

/* A folder of this process's own (under /dev/shm when there is one, so that
 * writing an input per run costs no disk I/O), removed at exit.  Aborts when
 * it cannot be made: a harness without it would test nothing. */
const char *fuzz_scratch_dir(void);

/* Writes n bytes to DIR/NAME (replacing it) and returns the path in a
 * static buffer of its own per call site's slot (0..3).  Aborts on failure. */
const char *fuzz_write(int slot, const char *name, const void *data, size_t n);
/* Removes DIR/NAME if present. */
void fuzz_remove(const char *name);

/* Splits data at NUL bytes into at most max parts (the last keeps any
 * further NULs); returns how many.  The parts point into data. */
int fuzz_split(const uint8_t *data, size_t n, const uint8_t **part, size_t *len, int max);

/* ../shared/models (LLM_MODELS_DIR overrides), or NULL if missing. */
const char *fuzz_models_dir(void);

/* A small valid Hugging Face model that fuzz_hf_config opens and
 * fuzz_seeds writes: llama-shaped, 1 layer, hidden size 8, 2 heads of 4
 * (1 KV head), ffn 16, vocabulary 16, F32, with q/k/v biases (so that a
 * qwen2 config opens too).  The config.json seeds in
 * tests/fuzz/corpus/hf_config match it.  fuzz_tiny_safetensors returns the
 * size of a malloc'd file image. */
size_t fuzz_tiny_safetensors(uint8_t **out);
/* A byte-level BPE tokenizer.json of 8 tokens (<s> and </s> added). */
extern const char fuzz_tiny_tokenizer_json[];

/* A random walk through a compiled grammar, steered by choice[0..n), with
 * small tables (grammar_set_limits: 65536 frames, 4096 states): from
 * the start state, each step takes the mask over a small vocabulary (every
 * byte as a token of its own, some multi-byte tokens, an end token) and
 * checks it against grammar_state_accept_token for every token (the mask
 * holds exactly the tokens the matcher accepts; an incomplete live state
 * allows some token), then takes the allowed token the next choice byte
 * picks; the end token stops the walk.  Up to cap - 1 bytes of the output
 * go to out (NUL-terminated; *out_len bytes, which may hold NULs).  Returns 1 when the walk ended on the end
 * token (out is then a whole sentence of the grammar), 0 when the choices
 * or the room ran out first or the grammar's tables filled. */
struct grammar;
int fuzz_grammar_walk(struct grammar *g, const uint8_t *choice, size_t n, char *out, size_t cap, size_t *out_len);

/* Aborts with a message: an invariant of the code under test broke, which
 * libFuzzer reports as a crash and saves the input for. */
_Noreturn void fuzz_fail(const char *fmt, ...) __attribute__((format(printf, 1, 2)));

#endif
