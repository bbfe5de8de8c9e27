/* The default split of a model's layers over the stages of a pipeline:
 * contiguous ranges of about equal bytes, the token embedding counted with
 * stage 0 and the output norm and lm_head with the last.  The router places
 * workers with it and a worker picks the layers it loads before the router
 * has placed it; both take the sizes from the same file the same way, so
 * they arrive at the same ranges (a disagreement would reload the stage).
 *
 *   struct layersplit_sizes sz;
 *   if (layersplit_sizes_gguf(&sz, gguf, n_layers, err, sizeof err) < 0) die(err);
 *   int32_t first[N], end[N];
 *   rc = layersplit_ranges(&sz, N, first, end, err, sizeof err);
 *   layersplit_sizes_free(&sz); */
#ifndef COMMON_LAYERSPLIT_H
#define COMMON_LAYERSPLIT_H

#include <stddef.h>
#include <stdint.h>

#include "gguf.h"

/* What each part of the model weighs, in one unit (bytes, or parameters
 * when estimated from the shapes: only the ratios matter). */
struct layersplit_sizes {
    int32_t n_layers;
    uint64_t *layer_bytes; /* (n_layers) malloc'd, freed by layersplit_sizes_free */
    uint64_t embed_bytes;  /* token embedding: stage 0 holds it */
    uint64_t head_bytes;   /* output norm and lm_head (the embedding again when tied): the last stage */
};

/* The shapes of a Hugging Face model (config.json) that the estimate needs. */
struct layersplit_shapes {
    int32_t n_layers, n_vocab, dim, ffn_dim;
    int32_t n_heads, n_kv_heads, head_dim;
};

/* From a GGUF file's tensor infos: every blk.N.* tensor counts for layer N,
 * token_embd.weight for the embedding, every other tensor for the head,
 * and the embedding once more for the head when there is no output.weight
 * (tied: the last stage holds it as lm_head).  n_layers is the model's
 * block count.  Returns 0, or a negative status with err naming the file
 * (then *s is zeroed). */
int layersplit_sizes_gguf(struct layersplit_sizes *s, const gguf_file *f, int32_t n_layers,
                          char *err, size_t errlen);

/* An estimate in parameters from the shapes (every layer alike: attention
 * q/k/v/o, the three MLP matrices, two norms; the head counted as an
 * untied lm_head).  Returns 0, or a negative status with err saying why
 * (then *s is zeroed). */
int layersplit_sizes_shapes(struct layersplit_sizes *s, const struct layersplit_shapes *sh,
                            char *err, size_t errlen);

/* NULL-safe; leaves *s zeroed. */
void layersplit_sizes_free(struct layersplit_sizes *s);

/* Stage k of n_stages gets layers [first[k], end[k]): each cut between two
 * stages goes where the bytes before it (embedding and layers) are closest
 * to k/n of the whole, the earlier cut on a tie, leaving at least one
 * layer for every stage.  first and end have n_stages entries.  Returns 0,
 * or STATUS_BAD_INPUT when n_stages is outside 1..n_layers (err says so). */
int layersplit_ranges(const struct layersplit_sizes *s, int32_t n_stages, int32_t *first,
                      int32_t *end, char *err, size_t errlen);

#endif
