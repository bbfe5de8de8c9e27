/* GGUF v2/v3 model files, read over mmap: metadata of every value type
 * (arrays included) and tensor infos, all bounds-checked so that a
 * truncated or hostile file is refused with a message and never read
 * outside the mapping.  The writer half makes files (synthetic models). */
#ifndef COMMON_GGUF_H
#define COMMON_GGUF_H

#include <stddef.h>
#include <stdint.h>

#include "dtype.h"

enum gguf_vtype {
    GGUF_TYPE_UINT8 = 0, GGUF_TYPE_INT8 = 1, GGUF_TYPE_UINT16 = 2, GGUF_TYPE_INT16 = 3,
    GGUF_TYPE_UINT32 = 4, GGUF_TYPE_INT32 = 5, GGUF_TYPE_FLOAT32 = 6, GGUF_TYPE_BOOL = 7,
    GGUF_TYPE_STRING = 8, GGUF_TYPE_ARRAY = 9, GGUF_TYPE_UINT64 = 10, GGUF_TYPE_INT64 = 11,
    GGUF_TYPE_FLOAT64 = 12,
};

/* A string inside the mapping: not NUL-terminated. */
struct gguf_str {
    const char *ptr;
    uint64_t len;
};

struct gguf_tensor {
    struct gguf_str name;
    enum dtype type;
    int n_dims;
    int64_t ne[4];      /* ne[0] is the contiguous (row) length; unused dims are 1 */
    const void *data;   /* inside the mapping, aligned as the file says */
    size_t nbytes;
};

typedef struct gguf_file gguf_file;

/* Maps and validates the whole file (header, every key, every tensor info
 * and that each tensor's bytes lie inside the file).  On failure returns a
 * negative status, *out = NULL and err holds "PATH: what: why". */
int gguf_open(gguf_file **out, const char *path, char *err, size_t errlen);
void gguf_close(gguf_file *f);
const char *gguf_path(const gguf_file *f);
uint32_t gguf_version(const gguf_file *f);
/* Details of the last failed getter ("PATH: key K: type string, want uint32"). */
const char *gguf_errstr(const gguf_file *f);

int64_t gguf_n_keys(const gguf_file *f);
struct gguf_str gguf_key_name(const gguf_file *f, int64_t k);
int64_t gguf_find_key(const gguf_file *f, const char *key); /* index, or -1 */
enum gguf_vtype gguf_key_type(const gguf_file *f, int64_t k);

/* Scalar getters.  STATUS_NOT_FOUND when the key is absent; STATUS_BAD_INPUT
 * when its type does not convert (integers of any width convert when the
 * value fits; floats take any numeric type). */
int gguf_get_u32(const gguf_file *f, const char *key, uint32_t *out);
int gguf_get_i64(const gguf_file *f, const char *key, int64_t *out);
int gguf_get_f32(const gguf_file *f, const char *key, float *out);
int gguf_get_bool(const gguf_file *f, const char *key, int *out);
int gguf_get_str(const gguf_file *f, const char *key, struct gguf_str *out);

/* Arrays: element type and count; then elements by index (with the same
 * conversions as the scalar getters). */
int gguf_get_arr(const gguf_file *f, const char *key, enum gguf_vtype *elem_type, uint64_t *n);
int gguf_arr_str(const gguf_file *f, const char *key, uint64_t i, struct gguf_str *out);
int gguf_arr_f32(const gguf_file *f, const char *key, uint64_t i, float *out);
int gguf_arr_i64(const gguf_file *f, const char *key, uint64_t i, int64_t *out);

/* Raw elements of an array of a fixed-size type (little-endian, inside the
 * mapping, possibly unaligned: read with memcpy); NULL if absent or not such
 * an array (gguf_errstr says which). */
const void *gguf_arr_data(const gguf_file *f, const char *key, enum gguf_vtype *elem_type, uint64_t *n);

/* general.alignment (32 when absent), the file offset of the data section,
 * and the file size. */
uint32_t gguf_alignment(const gguf_file *f);
uint64_t gguf_data_offset(const gguf_file *f);
size_t gguf_file_size(const gguf_file *f);

int64_t gguf_n_tensors(const gguf_file *f);
const struct gguf_tensor *gguf_tensor_at(const gguf_file *f, int64_t i);
const struct gguf_tensor *gguf_tensor_find(const gguf_file *f, const char *name); /* NULL if absent */

/* 1 if s equals the NUL-terminated c. */
int gguf_str_eq(struct gguf_str s, const char *c);

/* Writer: collect keys and tensors, then write the file in one go.  Values
 * and tensor data are copied (the caller keeps ownership of what it passes;
 * gguf_writer_free releases the copies).  gguf_writer_write returns 0 or a negative status with err. */
typedef struct gguf_writer gguf_writer;
gguf_writer *gguf_writer_init(void);
void gguf_writer_free(gguf_writer *w);
void gguf_writer_set_u32(gguf_writer *w, const char *key, uint32_t v);
void gguf_writer_set_i32(gguf_writer *w, const char *key, int32_t v);
void gguf_writer_set_f32(gguf_writer *w, const char *key, float v);
void gguf_writer_set_bool(gguf_writer *w, const char *key, int v);
void gguf_writer_set_str(gguf_writer *w, const char *key, const char *v);
void gguf_writer_set_arr_str(gguf_writer *w, const char *key, const char *const *v, uint64_t n);
void gguf_writer_set_arr_f32(gguf_writer *w, const char *key, const float *v, uint64_t n);
void gguf_writer_set_arr_i32(gguf_writer *w, const char *key, const int32_t *v, uint64_t n);
/* data: the tensor's bytes in `type` (dtype_row_bytes(type, ne[0]) * rows). */
void gguf_writer_add_tensor(gguf_writer *w, const char *name, enum dtype type, int n_dims,
                            const int64_t *ne, const void *data);
int gguf_writer_write(gguf_writer *w, const char *path, char *err, size_t errlen);

/* More value types.  gguf_writer_set_arr takes n elements of a fixed-size
 * type (not STRING or ARRAY).  Setting a key again replaces its value; a
 * refused value (bad type, no memory) makes the write fail. */
void gguf_writer_set_u8(gguf_writer *w, const char *key, uint8_t v);
void gguf_writer_set_i8(gguf_writer *w, const char *key, int8_t v);
void gguf_writer_set_u16(gguf_writer *w, const char *key, uint16_t v);
void gguf_writer_set_i16(gguf_writer *w, const char *key, int16_t v);
void gguf_writer_set_u64(gguf_writer *w, const char *key, uint64_t v);
void gguf_writer_set_i64(gguf_writer *w, const char *key, int64_t v);
void gguf_writer_set_f64(gguf_writer *w, const char *key, double v);
void gguf_writer_set_arr(gguf_writer *w, const char *key, enum gguf_vtype elem_type, const void *v, uint64_t n);

/* Streaming, for models larger than memory: declare every tensor with
 * gguf_writer_add_tensor_info (no data), call gguf_writer_begin (writes the
 * header, keys and tensor infos), then pass each tensor's bytes in the
 * declared order with gguf_writer_stream_tensor, in one or more parts
 * (last_part = 1 on its final part; the parts must add up to its size),
 * and end with gguf_writer_finish.  Keys cannot change after begin.  On an
 * error the file is left incomplete; gguf_writer_free closes it. */
void gguf_writer_add_tensor_info(gguf_writer *w, const char *name, enum dtype type, int n_dims, const int64_t *ne);
int gguf_writer_begin(gguf_writer *w, const char *path, char *err, size_t errlen);
int gguf_writer_stream_tensor(gguf_writer *w, const char *name, const void *data, size_t nbytes, int last_part,
                              char *err, size_t errlen);
int gguf_writer_finish(gguf_writer *w, char *err, size_t errlen);

#endif
