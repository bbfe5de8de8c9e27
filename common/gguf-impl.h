/* What the GGUF reader (gguf.c) and writer (gguf_write.c) share: the file's
 * magic, its default alignment and the size of a value type.  Not part of
 * the API: use gguf.h. */
#ifndef COMMON_GGUF_IMPL_H
#define COMMON_GGUF_IMPL_H

#include "gguf.h"

#define GGUF_MAGIC "GGUF"
#define GGUF_DEFAULT_ALIGNMENT 32

/* Bytes of one value of a fixed-size type; 0 for string, array, unknown. */
uint64_t gguf_vtype_size(uint32_t t);

#endif
