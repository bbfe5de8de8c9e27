/* A pipeline stage: the weights of layers [layer_first, layer_last) of a
 * model on one backend, that slice's paged KV cache, and every scratch
 * buffer a step needs, sized at init for the largest step allowed.  The
 * first stage (layer_first == 0) also holds the token embedding and takes
 * token ids; the last (layer_last == n_layers) also holds the final norm
 * and lm_head and returns logits.  Steps run through forward.h. */
#ifndef WORKER_STAGE_H
#define WORKER_STAGE_H

#include <stddef.h>
#include <stdint.h>

#include "common/model.h"
#include "kernels/backend.h"
#include "kvcache.h"

typedef struct stage stage;

/* Zero or negative fields take the defaults stage_config_default documents. */
struct stage_config {
    int32_t layer_first;  /* default 0 */
    int32_t layer_last;   /* one past the last layer held; default n_layers */
    int32_t n_tokens_max; /* rows per step, all sequences together; default 512 */
    int32_t n_seqs_max;   /* sequences per step; default 16 */
    int32_t n_ctx_max;    /* positions per sequence; default the model's ctx_len */
    int32_t n_logits_max; /* lm_head rows per launch (more are done in chunks); default n_seqs_max */
    int32_t block_size;   /* KV positions per block; default KVBLOCKS_BLOCK_SIZE_DEFAULT */
    int32_t n_blocks;     /* KV blocks in the pool; default n_seqs_max * blocks of n_ctx_max */
    int32_t kv_type;      /* DTYPE_F32, DTYPE_F16 or DTYPE_Q8_0; < 0: F32 on CPU, F16 on GPU (the default) */
    /* < 0 (the default): every matrix as stored.  Else a dtype that
     * dtype_quant_row makes: the layers' matrices and an untied lm_head
     * stored as F32, F16 or BF16 are converted to it as they are loaded
     * (the token embedding table stays as stored, as does a matrix whose
     * columns are not a multiple of the type's block); quantized ones stay. */
    int32_t weight_type;
};

/* All fields 0 / -1: "use the default". */
void stage_config_default(struct stage_config *cfg);

/* Loads the stage's weights from m onto b and allocates its KV cache and
 * scratch.  Both m and b must outlive the stage (the CPU backend may read
 * weights in place from the model's mapping).  Returns 0 and *out, or a
 * negative status with a message naming the tensor or setting (then *out is
 * NULL and nothing is left allocated). */
int stage_init(stage **out, const model_file *m, backend *b, const struct stage_config *cfg,
               char *err, size_t errlen);
void stage_free(stage *s);

const struct model_hparams *stage_hparams(const stage *s);
/* The configuration with every default filled in. */
const struct stage_config *stage_config_get(const stage *s);
int stage_is_first(const stage *s);
int stage_is_last(const stage *s);
backend *stage_backend(const stage *s);
kvcache *stage_kvcache(const stage *s);
/* Bytes of weights this stage reads for one token (matrices, norms,
 * embedding row excluded): what a decode step streams from memory. */
size_t stage_weight_bytes(const stage *s);
/* Decode-step graphs recorded so far (forward.c replays them); 0 on a
 * backend without graphs or with LLM_CUDA_GRAPHS=0. */
int32_t stage_graphs_recorded(const stage *s);

#endif
