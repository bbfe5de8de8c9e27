/* Synthetic Llama models: a valid GGUF of any shape with a complete
 * SentencePiece-style vocabulary (so any text tokenizes) and deterministic
 * random weights, for benchmarks at real sizes and for tests.  Weights come
 * from a counter-based generator (element i of tensor T is a pure function
 * of the seed, T's name and i), so files are written tensor by tensor,
 * streaming, in bounded memory whatever the model size. */
#ifndef WORKER_SYNTH_H
#define WORKER_SYNTH_H

#include <stddef.h>
#include <stdint.h>

#include "common/dtype.h"

struct synth_shape {
    int32_t n_layers;
    int32_t dim;
    int32_t n_heads;
    int32_t n_kv_heads;
    int32_t ffn_dim;
    int32_t n_vocab;    /* at least 260: 3 specials, 256 byte tokens and U+2581 */
    int32_t ctx_len;
    float rope_theta;
    float rms_eps;
    /* 0: dim / n_heads (Llama's rule).  Otherwise each head's width, so
     * that the attention's width n_heads * head_dim differs from dim (as in
     * Gemma): a wide model with light layers, whose hidden states cost a
     * stage link more than its layers cost compute (bench/bench_net.c). */
    int32_t head_dim;
};

/* The weight mix: like llama.cpp's file types of the same names. */
enum synth_type {
    SYNTH_F32 = 0, SYNTH_F16, SYNTH_BF16, SYNTH_Q8_0, SYNTH_Q4_0, SYNTH_Q4_K_M, SYNTH_Q5_K_M, SYNTH_Q6_K,
};
#define SYNTH_TYPE_COUNT 8

/* Preset names in the order synth_shape_preset knows them, NULL-terminated
 * ("tiny", "100m", "tinyllama-1.1b", "llama2-7b", "llama3-8b", "llama2-13b"). */
extern const char *const synth_shape_names[];
/* Type names, indexed by enum synth_type, NULL-terminated ("f32", ..., "q6_k"). */
extern const char *const synth_type_names[];

/* Fills *out with a preset; STATUS_NOT_FOUND for an unknown name. */
int synth_shape_preset(const char *name, struct synth_shape *out);

struct synth_config {
    struct synth_shape shape;
    enum synth_type type;
    uint64_t seed;
    int tied;        /* 1: no output.weight (lm_head is token_embd) */
    int n_threads;   /* generation and quantization threads; <= 0: one per CPU */
    const char *name; /* general.name; NULL: "synthetic" */
};

/* The storage type of one tensor under cfg's mix (norms are F32; K-quant
 * and 32-block types fall back, as llama.cpp does, when ne0 does not
 * divide into their blocks).  layer is the block index, -1 for the others. */
enum dtype synth_tensor_type(const struct synth_config *cfg, const char *name, int64_t ne0, int32_t layer);

/* Writes the model to path.  Returns 0, or a negative status with err
 * naming what was wrong (a shape that does not fit together, a write
 * failure).  Memory used is a few chunks of rows, not the model. */
int synth_write(const struct synth_config *cfg, const char *path, char *err, size_t errlen);

/* The value synth_write draws for element i of the tensor named name
 * (before quantization); norms are 1 regardless.  For tests. */
float synth_weight(uint64_t seed, const char *name, uint64_t i);

#endif
