/* The GGUF writer of gguf.h: keys and tensors collected in memory (values
 * encoded as in the file, tensor data copied) and written in one go, or a
 * header written first and each tensor's bytes streamed after it in parts,
 * for models larger than memory.  Files are GGUF v3, padded as ggml pads. */
#include "gguf.h"
#include "gguf-impl.h"

#include <errno.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "status.h"

struct wkv {
    char *key;
    uint8_t *bytes; /* type tag and value, encoded as in the file */
    size_t len;
};

struct wtensor {
    char *name;
    enum dtype type;
    int n_dims;
    int64_t ne[4];
    size_t nbytes;
    uint64_t offset; /* in the data section */
    void *data;      /* copy, or NULL for a tensor streamed later */
};

struct gguf_writer {
    struct wkv *kv;
    size_t n_kv, cap_kv;
    struct wtensor *t;
    size_t n_t, cap_t;
    int failed;          /* an allocation failed while collecting: write refuses */
    FILE *fp;            /* streaming: open between begin and finish */
    char *path;
    size_t next_stream;  /* streaming: index of the next tensor whose data is due */
    uint64_t written;    /* bytes written so far */
    uint64_t stream_done; /* streaming: bytes of the current tensor written */
    uint32_t alignment;
};

struct buf {
    uint8_t *p;
    size_t len, cap;
    int failed;
};

static void buf_put(struct buf *b, const void *src, size_t n) {
    if (b->failed || n == 0) return;
    if (b->len + n > b->cap) {
        size_t cap = b->cap ? b->cap * 2 : 64;
        while (cap < b->len + n) cap *= 2;
        uint8_t *p = realloc(b->p, cap);
        if (!p) {
            b->failed = 1;
            return;
        }
        b->p = p;
        b->cap = cap;
    }
    memcpy(b->p + b->len, src, n);
    b->len += n;
}
static void buf_u32(struct buf *b, uint32_t v) { buf_put(b, &v, 4); }
static void buf_u64(struct buf *b, uint64_t v) { buf_put(b, &v, 8); }
static void buf_str(struct buf *b, const char *s) {
    size_t n = strlen(s);
    buf_u64(b, n);
    buf_put(b, s, n);
}

gguf_writer *gguf_writer_init(void) {
    gguf_writer *w = calloc(1, sizeof *w);
    if (w) w->alignment = GGUF_DEFAULT_ALIGNMENT;
    return w;
}

void gguf_writer_free(gguf_writer *w) {
    if (!w) return;
    for (size_t i = 0; i < w->n_kv; i++) {
        free(w->kv[i].key);
        free(w->kv[i].bytes);
    }
    for (size_t i = 0; i < w->n_t; i++) {
        free(w->t[i].name);
        free(w->t[i].data);
    }
    free(w->kv);
    free(w->t);
    if (w->fp) fclose(w->fp);
    free(w->path);
    free(w);
}

/* Takes ownership of b's bytes; a later set of the same key replaces it. */
static void writer_put_kv(gguf_writer *w, const char *key, struct buf *b) {
    if (b->failed || w->failed) {
        free(b->p);
        w->failed = 1;
        return;
    }
    for (size_t i = 0; i < w->n_kv; i++) {
        if (strcmp(w->kv[i].key, key) == 0) {
            free(w->kv[i].bytes);
            w->kv[i].bytes = b->p;
            w->kv[i].len = b->len;
            return;
        }
    }
    if (w->n_kv == w->cap_kv) {
        size_t cap = w->cap_kv ? w->cap_kv * 2 : 32;
        struct wkv *p = realloc(w->kv, cap * sizeof *p);
        if (!p) {
            free(b->p);
            w->failed = 1;
            return;
        }
        w->kv = p;
        w->cap_kv = cap;
    }
    char *k = strdup(key);
    if (!k) {
        free(b->p);
        w->failed = 1;
        return;
    }
    w->kv[w->n_kv++] = (struct wkv){k, b->p, b->len};
    if (strcmp(key, "general.alignment") == 0 && b->len == 8) {
        uint32_t t, a;
        memcpy(&t, b->p, 4);
        memcpy(&a, b->p + 4, 4);
        if (t == GGUF_TYPE_UINT32 && a && (a & (a - 1)) == 0) w->alignment = a;
    }
}

static void writer_scalar(gguf_writer *w, const char *key, enum gguf_vtype t, const void *v) {
    struct buf b = {0};
    buf_u32(&b, t);
    buf_put(&b, v, gguf_vtype_size(t));
    writer_put_kv(w, key, &b);
}

void gguf_writer_set_u8(gguf_writer *w, const char *key, uint8_t v) { writer_scalar(w, key, GGUF_TYPE_UINT8, &v); }
void gguf_writer_set_i8(gguf_writer *w, const char *key, int8_t v) { writer_scalar(w, key, GGUF_TYPE_INT8, &v); }
void gguf_writer_set_u16(gguf_writer *w, const char *key, uint16_t v) { writer_scalar(w, key, GGUF_TYPE_UINT16, &v); }
void gguf_writer_set_i16(gguf_writer *w, const char *key, int16_t v) { writer_scalar(w, key, GGUF_TYPE_INT16, &v); }
void gguf_writer_set_u32(gguf_writer *w, const char *key, uint32_t v) { writer_scalar(w, key, GGUF_TYPE_UINT32, &v); }
void gguf_writer_set_i32(gguf_writer *w, const char *key, int32_t v) { writer_scalar(w, key, GGUF_TYPE_INT32, &v); }
void gguf_writer_set_u64(gguf_writer *w, const char *key, uint64_t v) { writer_scalar(w, key, GGUF_TYPE_UINT64, &v); }
void gguf_writer_set_i64(gguf_writer *w, const char *key, int64_t v) { writer_scalar(w, key, GGUF_TYPE_INT64, &v); }
void gguf_writer_set_f32(gguf_writer *w, const char *key, float v) { writer_scalar(w, key, GGUF_TYPE_FLOAT32, &v); }
void gguf_writer_set_f64(gguf_writer *w, const char *key, double v) { writer_scalar(w, key, GGUF_TYPE_FLOAT64, &v); }
void gguf_writer_set_bool(gguf_writer *w, const char *key, int v) {
    uint8_t b = v ? 1 : 0;
    writer_scalar(w, key, GGUF_TYPE_BOOL, &b);
}

void gguf_writer_set_str(gguf_writer *w, const char *key, const char *v) {
    struct buf b = {0};
    buf_u32(&b, GGUF_TYPE_STRING);
    buf_str(&b, v);
    writer_put_kv(w, key, &b);
}

void gguf_writer_set_arr_str(gguf_writer *w, const char *key, const char *const *v, uint64_t n) {
    struct buf b = {0};
    buf_u32(&b, GGUF_TYPE_ARRAY);
    buf_u32(&b, GGUF_TYPE_STRING);
    buf_u64(&b, n);
    for (uint64_t i = 0; i < n; i++) buf_str(&b, v[i]);
    writer_put_kv(w, key, &b);
}

void gguf_writer_set_arr(gguf_writer *w, const char *key, enum gguf_vtype elem_type, const void *v, uint64_t n) {
    uint64_t es = gguf_vtype_size(elem_type);
    if (!es) { /* strings and arrays have their own setters; refuse at write */
        w->failed = 1;
        return;
    }
    struct buf b = {0};
    buf_u32(&b, GGUF_TYPE_ARRAY);
    buf_u32(&b, elem_type);
    buf_u64(&b, n);
    buf_put(&b, v, (size_t)(n * es));
    writer_put_kv(w, key, &b);
}

void gguf_writer_set_arr_f32(gguf_writer *w, const char *key, const float *v, uint64_t n) {
    gguf_writer_set_arr(w, key, GGUF_TYPE_FLOAT32, v, n);
}
void gguf_writer_set_arr_i32(gguf_writer *w, const char *key, const int32_t *v, uint64_t n) {
    gguf_writer_set_arr(w, key, GGUF_TYPE_INT32, v, n);
}

static struct wtensor *writer_new_tensor(gguf_writer *w, const char *name, enum dtype type, int n_dims, const int64_t *ne) {
    if (w->failed) return NULL;
    if (!dtype_valid((int)type) || n_dims < 1 || n_dims > 4) {
        w->failed = 1;
        return NULL;
    }
    int64_t rows = 1;
    for (int d = 1; d < n_dims; d++) rows *= ne[d];
    if (ne[0] <= 0 || ne[0] % dtype_block_elems(type) != 0 || rows < 0) {
        w->failed = 1;
        return NULL;
    }
    if (w->n_t == w->cap_t) {
        size_t cap = w->cap_t ? w->cap_t * 2 : 64;
        struct wtensor *p = realloc(w->t, cap * sizeof *p);
        if (!p) {
            w->failed = 1;
            return NULL;
        }
        w->t = p;
        w->cap_t = cap;
    }
    struct wtensor *t = &w->t[w->n_t];
    memset(t, 0, sizeof *t);
    t->name = strdup(name);
    if (!t->name) {
        w->failed = 1;
        return NULL;
    }
    t->type = type;
    t->n_dims = n_dims;
    for (int d = 0; d < 4; d++) t->ne[d] = d < n_dims ? ne[d] : 1;
    t->nbytes = dtype_row_bytes(type, ne[0]) * (size_t)rows;
    w->n_t++;
    return t;
}

void gguf_writer_add_tensor(gguf_writer *w, const char *name, enum dtype type, int n_dims, const int64_t *ne,
                            const void *data) {
    struct wtensor *t = writer_new_tensor(w, name, type, n_dims, ne);
    if (!t) return;
    t->data = malloc(t->nbytes ? t->nbytes : 1);
    if (!t->data) {
        w->failed = 1;
        return;
    }
    memcpy(t->data, data, t->nbytes);
}

void gguf_writer_add_tensor_info(gguf_writer *w, const char *name, enum dtype type, int n_dims, const int64_t *ne) {
    writer_new_tensor(w, name, type, n_dims, ne);
}

static int writer_pad(gguf_writer *w) {
    static const uint8_t zeros[256];
    uint64_t pad = (w->alignment - w->written % w->alignment) % w->alignment;
    while (pad > 0) {
        size_t n = pad > sizeof zeros ? sizeof zeros : (size_t)pad;
        if (fwrite(zeros, 1, n, w->fp) != n) return -1;
        pad -= n;
        w->written += n;
    }
    return 0;
}

/* Writes header, keys, tensor infos and the padding before the data. */
static int writer_head(gguf_writer *w, const char *path, char *err, size_t errlen) {
    if (w->failed) return status_fail(err, errlen, STATUS_BAD_INPUT, "%s: a key or tensor was refused (bad type, shape or no memory)", path);
    for (size_t i = 0; i < w->n_t; i++)
        for (size_t j = 0; j < i; j++)
            if (strcmp(w->t[i].name, w->t[j].name) == 0)
                return status_fail(err, errlen, STATUS_BAD_INPUT, "%s: tensor %s: added twice", path, w->t[i].name);
    uint64_t off = 0;
    for (size_t i = 0; i < w->n_t; i++) {
        w->t[i].offset = off;
        off += w->t[i].nbytes;
        off += (w->alignment - off % w->alignment) % w->alignment;
    }
    free(w->path);
    w->path = strdup(path);
    w->fp = fopen(path, "wb");
    if (!w->fp) return status_fail(err, errlen, STATUS_IO, "%s: cannot create: %s", path, strerror(errno));
    struct buf b = {0};
    buf_put(&b, GGUF_MAGIC, 4);
    buf_u32(&b, 3);
    buf_u64(&b, w->n_t);
    buf_u64(&b, w->n_kv);
    for (size_t i = 0; i < w->n_kv; i++) {
        buf_str(&b, w->kv[i].key);
        buf_put(&b, w->kv[i].bytes, w->kv[i].len);
    }
    for (size_t i = 0; i < w->n_t; i++) {
        const struct wtensor *t = &w->t[i];
        buf_str(&b, t->name);
        buf_u32(&b, (uint32_t)t->n_dims);
        for (int d = 0; d < t->n_dims; d++) buf_u64(&b, (uint64_t)t->ne[d]);
        buf_u32(&b, (uint32_t)t->type);
        buf_u64(&b, t->offset);
    }
    if (b.failed) {
        free(b.p);
        return status_fail(err, errlen, STATUS_NO_MEMORY, "%s: no memory for the header", path);
    }
    int ok = fwrite(b.p, 1, b.len, w->fp) == b.len;
    w->written = b.len;
    free(b.p);
    if (!ok || (w->n_t > 0 && writer_pad(w) != 0))
        return status_fail(err, errlen, STATUS_IO, "%s: write failed: %s", path, strerror(errno));
    w->next_stream = 0;
    w->stream_done = 0;
    return 0;
}

static int writer_close(gguf_writer *w, char *err, size_t errlen) {
    int bad = fflush(w->fp) != 0 || ferror(w->fp);
    int e = errno;
    bad |= fclose(w->fp) != 0;
    w->fp = NULL;
    if (bad) return status_fail(err, errlen, STATUS_IO, "%s: write failed: %s", w->path, strerror(e));
    return 0;
}

int gguf_writer_write(gguf_writer *w, const char *path, char *err, size_t errlen) {
    for (size_t i = 0; i < w->n_t; i++)
        if (!w->t[i].data)
            return status_fail(err, errlen, STATUS_BAD_INPUT, "%s: tensor %s has no data (use the streaming calls)", path, w->t[i].name);
    int st = writer_head(w, path, err, errlen);
    if (st) {
        if (w->fp) fclose(w->fp), w->fp = NULL;
        return st;
    }
    for (size_t i = 0; i < w->n_t; i++) {
        if (fwrite(w->t[i].data, 1, w->t[i].nbytes, w->fp) != w->t[i].nbytes) {
            fclose(w->fp), w->fp = NULL;
            return status_fail(err, errlen, STATUS_IO, "%s: tensor %s: write failed: %s", path, w->t[i].name, strerror(errno));
        }
        w->written += w->t[i].nbytes;
        /* ggml pads after every tensor, the last included */
        if (writer_pad(w) != 0) {
            fclose(w->fp), w->fp = NULL;
            return status_fail(err, errlen, STATUS_IO, "%s: write failed: %s", path, strerror(errno));
        }
    }
    return writer_close(w, err, errlen);
}

int gguf_writer_begin(gguf_writer *w, const char *path, char *err, size_t errlen) {
    if (w->fp) return status_fail(err, errlen, STATUS_BAD_INPUT, "%s: already writing %s", path, w->path);
    int st = writer_head(w, path, err, errlen);
    if (st && w->fp) fclose(w->fp), w->fp = NULL;
    return st;
}

int gguf_writer_stream_tensor(gguf_writer *w, const char *name, const void *data, size_t nbytes, int last_part,
                              char *err, size_t errlen) {
    if (!w->fp) return status_fail(err, errlen, STATUS_BAD_INPUT, "tensor %s: gguf_writer_begin was not called", name);
    if (w->next_stream >= w->n_t)
        return status_fail(err, errlen, STATUS_BAD_INPUT, "%s: tensor %s: every tensor is already written", w->path, name);
    struct wtensor *t = &w->t[w->next_stream];
    if (strcmp(t->name, name) != 0)
        return status_fail(err, errlen, STATUS_BAD_INPUT, "%s: tensor %s written out of order: %s is next", w->path, name, t->name);
    if (nbytes > t->nbytes - w->stream_done)
        return status_fail(err, errlen, STATUS_BAD_INPUT, "%s: tensor %s: %zu more bytes exceed its size %zu (%llu written)",
                           w->path, name, nbytes, t->nbytes, (unsigned long long)w->stream_done);
    if (last_part && w->stream_done + nbytes != t->nbytes)
        return status_fail(err, errlen, STATUS_BAD_INPUT, "%s: tensor %s: ends after %llu of its %zu bytes", w->path, name,
                           (unsigned long long)(w->stream_done + nbytes), t->nbytes);
    if (nbytes && fwrite(data, 1, nbytes, w->fp) != nbytes)
        return status_fail(err, errlen, STATUS_IO, "%s: tensor %s: write failed: %s", w->path, name, strerror(errno));
    w->written += nbytes;
    w->stream_done += nbytes;
    if (last_part) {
        w->next_stream++;
        w->stream_done = 0;
        if (writer_pad(w) != 0)
            return status_fail(err, errlen, STATUS_IO, "%s: write failed: %s", w->path, strerror(errno));
    }
    return 0;
}

int gguf_writer_finish(gguf_writer *w, char *err, size_t errlen) {
    if (!w->fp) return status_fail(err, errlen, STATUS_BAD_INPUT, "gguf_writer_finish: nothing is being written");
    if (w->next_stream != w->n_t) {
        int st = status_fail(err, errlen, STATUS_BAD_INPUT, "%s: tensor %s was never written", w->path, w->t[w->next_stream].name);
        fclose(w->fp), w->fp = NULL;
        return st;
    }
    return writer_close(w, err, errlen);
}
