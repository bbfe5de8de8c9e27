/* What the router needs to know about the model it serves, read from the
 * model's metadata only (never its weights): id, architecture, vocabulary,
 * context length, layer count and the bytes of each layer, from which
 * common/layersplit computes the default layer split (equal bytes per
 * stage, the same split a worker makes). */
#ifndef ROUTER_MODELINFO_H
#define ROUTER_MODELINFO_H

#include <stddef.h>
#include <stdint.h>

#include "common/layersplit.h"

struct modelinfo {
    char id[128];   /* the file or directory name: what workers report as model */
    char arch[32];  /* "llama", "qwen2" */
    int32_t n_vocab, n_ctx, n_layers;
    struct layersplit_sizes sizes; /* freed by modelinfo_free */
};

/* PATH is a .gguf file (metadata and tensor sizes) or a Hugging Face
 * directory (config.json; layer sizes estimated from the shapes).  On
 * failure *mi is zeroed and err names the file, the key and the value. */
int modelinfo_load(struct modelinfo *mi, const char *path, char *err, size_t errlen);
void modelinfo_free(struct modelinfo *mi);

/* The default split of the layers over n_stages stages (layersplit_ranges:
 * equal bytes per stage, embedding counted in stage 0, the head in the
 * last, at least one layer each): stage s gets layers [first[s], end[s]).
 * STATUS_BAD_INPUT when n_stages is outside 1..n_layers (err says so). */
int modelinfo_split(const struct modelinfo *mi, int32_t n_stages, int32_t *first, int32_t *end,
                    char *err, size_t errlen);

/* The base name of a path ("/m/stories260K-f32.gguf" -> "stories260K-f32.gguf"),
 * without trailing slashes, into out. */
void modelinfo_basename(const char *path, char *out, size_t size);

#endif
