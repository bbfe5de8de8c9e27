/* A model on disk: a GGUF file or a Hugging Face directory (config.json,
 * model.safetensors or shards through model.safetensors.index.json,
 * tokenizer.json), seen through one description (hyper-parameters) and one
 * tensor namespace (GGUF names) with the tokenizer that comes with it. */
#ifndef COMMON_MODEL_H
#define COMMON_MODEL_H

#include <stddef.h>
#include <stdint.h>

#include "dtype.h"
#include "tokenizer.h"

enum model_arch { MODEL_ARCH_LLAMA = 0, MODEL_ARCH_QWEN2 = 1 };
enum rope_scaling { ROPE_SCALING_NONE = 0, ROPE_SCALING_LINEAR = 1, ROPE_SCALING_LLAMA3 = 2 };

struct model_hparams {
    enum model_arch arch;
    int32_t n_vocab;
    int32_t dim;        /* hidden size */
    int32_t n_layers;
    int32_t n_heads;
    int32_t n_kv_heads;
    int32_t head_dim;   /* dim / n_heads unless the file says otherwise */
    int32_t ffn_dim;
    int32_t ctx_len;    /* trained context length */
    float rms_eps;
    float rope_theta;
    int rope_neox;      /* 1: Hugging Face q/k order, pairs (i, i + head_dim/2) */
    enum rope_scaling rope_scaling;
    float rope_factor;
    float rope_low_freq_factor, rope_high_freq_factor; /* Llama-3 */
    int32_t rope_orig_ctx;                              /* Llama-3 original_max_position_embeddings */
    int tied_embeddings; /* no output.weight: lm_head is token_embd */
    int qkv_bias;        /* qwen2: attn_{q,k,v}.bias present */
    /* GGUF rope_freqs.weight (how llama.cpp stores Llama-3.1 scaling): head_dim/2
     * divisors of the inverse frequencies, or NULL.  Points into the model
     * file, valid while it is open; model_rope_inv_freq applies it. */
    const float *rope_freq_factors;
};

/* A tensor of the model, by its GGUF name. ne[0] is the row length. */
struct model_tensor {
    enum dtype type;
    int n_dims;
    int64_t ne[4];
    const void *data; /* host memory valid while the model_file is open */
    size_t nbytes;
};

typedef struct model_file model_file;

/* PATH is a .gguf file or a directory.  Reads the description and checks
 * that every tensor the architecture needs is present with the right shape
 * and a supported type; loads the tokenizer.  Errors name the file, the
 * tensor or key, and the reason. */
int model_file_open(model_file **out, const char *path, char *err, size_t errlen);
void model_file_close(model_file *m);
const char *model_file_path(const model_file *m);
const struct model_hparams *model_file_hparams(const model_file *m);
const tokenizer *model_file_tokenizer(const model_file *m);
/* GGUF names: token_embd.weight, output_norm.weight, output.weight,
 * blk.N.{attn_norm,attn_q,attn_k,attn_v,attn_output,ffn_norm,ffn_gate,
 * ffn_up,ffn_down}.weight (and blk.N.attn_{q,k,v}.bias for qwen2).
 * STATUS_NOT_FOUND if absent. */
int model_file_tensor(const model_file *m, const char *name, struct model_tensor *out);

/* The head_dim/2 rotary inverse frequencies, with the scaling applied. */
void model_rope_inv_freq(const struct model_hparams *hp, float *inv_freq);

#endif
