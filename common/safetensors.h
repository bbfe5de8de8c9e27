/* Hugging Face safetensors files, read over mmap: an 8-byte header length,
 * a JSON header naming each tensor's dtype, shape and byte range, then the
 * data.  Every range is checked against the file at open, so the data
 * pointers can be trusted afterwards. */
#ifndef COMMON_SAFETENSORS_H
#define COMMON_SAFETENSORS_H

#include <stddef.h>
#include <stdint.h>

#include "dtype.h"

struct safetensors_tensor {
    char *name;         /* as in the file; owned by the safetensors_file */
    char dtype_str[16]; /* as in the file ("BF16", "F64", ...) */
    int supported;      /* 1 if dtype_str is F32, F16 or BF16 (then type holds it) */
    enum dtype type;
    int n_dims;         /* 0..4 */
    int64_t ne[4];      /* GGML order: ne[0] is the last (contiguous) dimension; unused dims 1 */
    const void *data;   /* inside the mapping, valid until safetensors_close */
    size_t nbytes;
};

typedef struct safetensors_file safetensors_file;

/* Maps and validates PATH.  A tensor of a dtype we do not handle is kept
 * (supported = 0) so that callers can refuse it by name only if they need
 * it.  On failure returns a negative status, *out = NULL and err holds
 * "PATH: tensor NAME: why".  The caller frees with safetensors_close. */
int safetensors_open(safetensors_file **out, const char *path, char *err, size_t errlen);
void safetensors_close(safetensors_file *f);
const char *safetensors_path(const safetensors_file *f);
int64_t safetensors_n_tensors(const safetensors_file *f);
const struct safetensors_tensor *safetensors_tensor_at(const safetensors_file *f, int64_t i);
const struct safetensors_tensor *safetensors_tensor_find(const safetensors_file *f, const char *name); /* NULL if absent */

#endif
