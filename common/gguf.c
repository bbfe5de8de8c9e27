/* GGUF v2/v3 reader over mmap.  It validates the whole file at open (every
 * key, every tensor info, every tensor's bytes) so that later accessors can
 * trust the offsets; every read goes through a cursor that checks the bytes
 * left, with overflow-safe arithmetic.  Multi-byte values are read as
 * little-endian with memcpy (GGUF is little-endian; so are the hosts we build
 * for).  The writer is in gguf_write.c. */
#include "gguf.h"
#include "gguf-impl.h"

#include <errno.h>
#include <fcntl.h>
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <unistd.h>

#include "status.h"

#define GGUF_NAME_MAX 256     /* tensor names; llama.cpp allows 63 */
#define GGUF_ARRAY_DEPTH_MAX 8 /* nested arrays are parsed, not exposed */

struct gguf_kv {
    struct gguf_str key;
    enum gguf_vtype type;
    const uint8_t *val;      /* scalar value, string (len + bytes) or first array element */
    enum gguf_vtype elem;    /* arrays */
    uint64_t n;              /* arrays: element count */
    uint64_t *str_offsets;   /* arrays of strings: offset of each element from val */
};

struct gguf_file {
    char *path;
    const uint8_t *map;
    size_t size;
    uint32_t version;
    uint32_t alignment;
    uint64_t data_start;
    int64_t n_kv;
    struct gguf_kv *kv;
    int64_t n_tensors;
    struct gguf_tensor *tensors;
    char *errbuf; /* last getter error; a pointer so const getters can write it */
};

enum { GGUF_ERRBUF = 512 };

/* ---- cursor ---- */

struct cursor {
    const uint8_t *base;
    uint64_t size, pos;
    const char *path;
    char *err;
    size_t errlen;
    const char *what; /* "key general.name", "tensor blk.0.attn_q.weight", "header" */
    char whatbuf[GGUF_NAME_MAX + 64];
};

/* A parse error prefixed with the file and the item being read, so that every
 * message names where in the file it went wrong. */
static int cur_fail(struct cursor *c, int status, const char *fmt, ...) __attribute__((format(printf, 3, 4)));
static int cur_fail(struct cursor *c, int status, const char *fmt, ...) {
    char msg[256];
    va_list ap;
    va_start(ap, fmt);
    vsnprintf(msg, sizeof msg, fmt, ap);
    va_end(ap);
    return status_fail(c->err, c->errlen, status, "%s: %s: %s", c->path, c->what, msg);
}

static int cur_need(struct cursor *c, uint64_t n) {
    if (n > c->size - c->pos)
        return cur_fail(c, STATUS_BAD_INPUT, "truncated at byte %llu (need %llu more bytes, file has %llu)",
                        (unsigned long long)c->pos, (unsigned long long)n, (unsigned long long)c->size);
    return 0;
}

static int cur_read(struct cursor *c, void *dst, uint64_t n) {
    int s = cur_need(c, n);
    if (s) return s;
    memcpy(dst, c->base + c->pos, n);
    c->pos += n;
    return 0;
}

static int cur_u32(struct cursor *c, uint32_t *v) { return cur_read(c, v, 4); }
static int cur_u64(struct cursor *c, uint64_t *v) { return cur_read(c, v, 8); }

static int cur_str(struct cursor *c, struct gguf_str *s) {
    uint64_t len;
    int st = cur_u64(c, &len);
    if (st) return st;
    if (len > c->size - c->pos)
        return cur_fail(c, STATUS_BAD_INPUT, "string of %llu bytes at byte %llu runs past the end of the file (%llu bytes)",
                        (unsigned long long)len, (unsigned long long)(c->pos - 8), (unsigned long long)c->size);
    s->ptr = (const char *)c->base + c->pos;
    s->len = len;
    c->pos += len;
    return 0;
}

/* Bytes of one value of a fixed-size type; 0 for string, array, unknown. */
uint64_t gguf_vtype_size(uint32_t t) {
    switch (t) {
    case GGUF_TYPE_UINT8: case GGUF_TYPE_INT8: case GGUF_TYPE_BOOL: return 1;
    case GGUF_TYPE_UINT16: case GGUF_TYPE_INT16: return 2;
    case GGUF_TYPE_UINT32: case GGUF_TYPE_INT32: case GGUF_TYPE_FLOAT32: return 4;
    case GGUF_TYPE_UINT64: case GGUF_TYPE_INT64: case GGUF_TYPE_FLOAT64: return 8;
    default: return 0;
    }
}

static const char *vtype_name(uint32_t t) {
    static const char *names[] = {"uint8", "int8", "uint16", "int16", "uint32", "int32", "float32",
                                  "bool", "string", "array", "uint64", "int64", "float64"};
    return t < sizeof names / sizeof names[0] ? names[t] : "unknown";
}

/* Skips an array body (element type and count already read), checking every
 * element; string offsets are recorded when offs is non-NULL. */
static int cur_skip_array(struct cursor *c, uint32_t elem, uint64_t n, uint64_t *offs, uint64_t base, int depth) {
    uint64_t es = gguf_vtype_size(elem);
    if (es) {
        if (n > (c->size - c->pos) / es)
            return cur_fail(c, STATUS_BAD_INPUT, "array of %llu %s at byte %llu runs past the end of the file (%llu bytes)",
                            (unsigned long long)n, vtype_name(elem), (unsigned long long)c->pos, (unsigned long long)c->size);
        if (elem == GGUF_TYPE_BOOL) {
            for (uint64_t i = 0; i < n; i++)
                if (c->base[c->pos + i] > 1)
                    return cur_fail(c, STATUS_BAD_INPUT, "bool array element %llu is %u, not 0 or 1",
                                    (unsigned long long)i, c->base[c->pos + i]);
        }
        c->pos += n * es;
        return 0;
    }
    if (elem == GGUF_TYPE_STRING) {
        if (n > (c->size - c->pos) / 8)
            return cur_fail(c, STATUS_BAD_INPUT, "array of %llu strings at byte %llu runs past the end of the file (%llu bytes)",
                            (unsigned long long)n, (unsigned long long)c->pos, (unsigned long long)c->size);
        for (uint64_t i = 0; i < n; i++) {
            if (offs) offs[i] = c->pos - base;
            struct gguf_str s;
            int st = cur_str(c, &s);
            if (st) return st;
        }
        return 0;
    }
    if (elem == GGUF_TYPE_ARRAY) {
        if (depth >= GGUF_ARRAY_DEPTH_MAX)
            return cur_fail(c, STATUS_BAD_INPUT, "arrays nested deeper than %d", GGUF_ARRAY_DEPTH_MAX);
        /* each inner array takes at least 12 bytes: bounds the loop */
        if (n > (c->size - c->pos) / 12)
            return cur_fail(c, STATUS_BAD_INPUT, "array of %llu arrays at byte %llu runs past the end of the file (%llu bytes)",
                            (unsigned long long)n, (unsigned long long)c->pos, (unsigned long long)c->size);
        for (uint64_t i = 0; i < n; i++) {
            uint32_t e2;
            uint64_t n2;
            int st = cur_u32(c, &e2);
            if (!st) st = cur_u64(c, &n2);
            if (!st) st = cur_skip_array(c, e2, n2, NULL, 0, depth + 1);
            if (st) return st;
        }
        return 0;
    }
    return cur_fail(c, STATUS_BAD_INPUT, "array element type %u is unknown", elem);
}

/* ---- open ---- */

static const char *ggml_type_name(uint32_t t) {
    static const char *names[] = {
        "F32", "F16", "Q4_0", "Q4_1", "Q4_2", "Q4_3", "Q5_0", "Q5_1", "Q8_0", "Q8_1",
        "Q2_K", "Q3_K", "Q4_K", "Q5_K", "Q6_K", "Q8_K", "IQ2_XXS", "IQ2_XS", "IQ3_XXS", "IQ1_S",
        "IQ4_NL", "IQ3_S", "IQ2_S", "IQ4_XS", "I8", "I16", "I32", "I64", "F64", "IQ1_M",
        "BF16", "Q4_0_4_4", "Q4_0_4_8", "Q4_0_8_8", "TQ1_0", "TQ2_0", "IQ4_NL_4_4", "IQ4_NL_4_8", "IQ4_NL_8_8"};
    return t < sizeof names / sizeof names[0] ? names[t] : "unknown";
}

static int kv_cmp(const void *a, const void *b) {
    const struct gguf_kv *x = *(const struct gguf_kv *const *)a, *y = *(const struct gguf_kv *const *)b;
    uint64_t n = x->key.len < y->key.len ? x->key.len : y->key.len;
    int r = memcmp(x->key.ptr, y->key.ptr, n);
    if (r) return r;
    return x->key.len < y->key.len ? -1 : x->key.len > y->key.len;
}

static int tensor_cmp(const void *a, const void *b) {
    const struct gguf_tensor *x = *(const struct gguf_tensor *const *)a, *y = *(const struct gguf_tensor *const *)b;
    uint64_t n = x->name.len < y->name.len ? x->name.len : y->name.len;
    int r = memcmp(x->name.ptr, y->name.ptr, n);
    if (r) return r;
    return x->name.len < y->name.len ? -1 : x->name.len > y->name.len;
}

/* Printable, bounded copy of a name from the file for messages. */
static void name_for_msg(char *buf, size_t size, struct gguf_str s) {
    size_t n = 0;
    for (uint64_t i = 0; i < s.len && n + 5 < size; i++) {
        unsigned char ch = (unsigned char)s.ptr[i];
        if (ch >= 0x20 && ch < 0x7f) buf[n++] = (char)ch;
        else n += (size_t)snprintf(buf + n, size - n, "\\x%02x", ch);
    }
    buf[n < size ? n : size - 1] = 0;
}

static int parse_kvs(struct gguf_file *f, struct cursor *c) {
    for (int64_t k = 0; k < f->n_kv; k++) {
        struct gguf_kv *kv = &f->kv[k];
        snprintf(c->whatbuf, sizeof c->whatbuf, "key #%lld", (long long)k);
        c->what = c->whatbuf;
        int st = cur_str(c, &kv->key);
        if (st) return st;
        char nm[160];
        name_for_msg(nm, sizeof nm, kv->key);
        snprintf(c->whatbuf, sizeof c->whatbuf, "key %s", nm);
        uint32_t t;
        if ((st = cur_u32(c, &t))) return st;
        if (t > GGUF_TYPE_FLOAT64) return cur_fail(c, STATUS_BAD_INPUT, "value type %u is unknown", t);
        kv->type = (enum gguf_vtype)t;
        if (t == GGUF_TYPE_STRING) {
            kv->val = c->base + c->pos;
            struct gguf_str s;
            if ((st = cur_str(c, &s))) return st;
        } else if (t == GGUF_TYPE_ARRAY) {
            uint32_t e;
            uint64_t n;
            if ((st = cur_u32(c, &e)) || (st = cur_u64(c, &n))) return st;
            if (e > GGUF_TYPE_FLOAT64) return cur_fail(c, STATUS_BAD_INPUT, "array element type %u is unknown", e);
            kv->elem = (enum gguf_vtype)e;
            kv->n = n;
            kv->val = c->base + c->pos;
            if (e == GGUF_TYPE_STRING && n > 0) {
                if (n > (c->size - c->pos) / 8)
                    return cur_fail(c, STATUS_BAD_INPUT, "array of %llu strings at byte %llu runs past the end of the file (%llu bytes)",
                                    (unsigned long long)n, (unsigned long long)c->pos, (unsigned long long)c->size);
                kv->str_offsets = malloc(n * sizeof(uint64_t));
                if (!kv->str_offsets) return cur_fail(c, STATUS_NO_MEMORY, "no memory for %llu string offsets", (unsigned long long)n);
            }
            if ((st = cur_skip_array(c, e, n, kv->str_offsets, c->pos, 1))) return st;
        } else {
            kv->val = c->base + c->pos;
            if ((st = cur_need(c, gguf_vtype_size(t)))) return st;
            if (t == GGUF_TYPE_BOOL && c->base[c->pos] > 1)
                return cur_fail(c, STATUS_BAD_INPUT, "bool value is %u, not 0 or 1", c->base[c->pos]);
            c->pos += gguf_vtype_size(t);
        }
    }
    /* duplicate keys make lookups ambiguous */
    if (f->n_kv > 1) {
        const struct gguf_kv **idx = malloc((size_t)f->n_kv * sizeof *idx);
        if (!idx) return cur_fail(c, STATUS_NO_MEMORY, "no memory to index %lld keys", (long long)f->n_kv);
        for (int64_t k = 0; k < f->n_kv; k++) idx[k] = &f->kv[k];
        qsort(idx, (size_t)f->n_kv, sizeof *idx, kv_cmp);
        for (int64_t k = 1; k < f->n_kv; k++) {
            if (kv_cmp(&idx[k - 1], &idx[k]) == 0) {
                char nm[160];
                name_for_msg(nm, sizeof nm, idx[k]->key);
                snprintf(c->whatbuf, sizeof c->whatbuf, "key %s", nm);
                c->what = c->whatbuf;
                free(idx);
                return cur_fail(c, STATUS_BAD_INPUT, "appears more than once");
            }
        }
        free(idx);
    }
    return 0;
}

static int parse_tensors(struct gguf_file *f, struct cursor *c) {
    for (int64_t i = 0; i < f->n_tensors; i++) {
        struct gguf_tensor *t = &f->tensors[i];
        snprintf(c->whatbuf, sizeof c->whatbuf, "tensor #%lld", (long long)i);
        c->what = c->whatbuf;
        int st = cur_str(c, &t->name);
        if (st) return st;
        char nm[160];
        name_for_msg(nm, sizeof nm, t->name);
        snprintf(c->whatbuf, sizeof c->whatbuf, "tensor %s", nm);
        if (t->name.len == 0) return cur_fail(c, STATUS_BAD_INPUT, "empty name");
        if (t->name.len > GGUF_NAME_MAX)
            return cur_fail(c, STATUS_BAD_INPUT, "name of %llu bytes is longer than %d", (unsigned long long)t->name.len, GGUF_NAME_MAX);
        uint32_t nd;
        if ((st = cur_u32(c, &nd))) return st;
        if (nd < 1 || nd > 4) return cur_fail(c, STATUS_BAD_INPUT, "n_dims %u is not in 1..4", nd);
        t->n_dims = (int)nd;
        int64_t nelem = 1;
        for (int d = 0; d < 4; d++) t->ne[d] = 1;
        for (uint32_t d = 0; d < nd; d++) {
            uint64_t ne;
            if ((st = cur_u64(c, &ne))) return st;
            if (ne > (uint64_t)INT64_MAX) return cur_fail(c, STATUS_BAD_INPUT, "ne[%u] = %llu is negative as int64", d, (unsigned long long)ne);
            t->ne[d] = (int64_t)ne;
            if (__builtin_mul_overflow(nelem, t->ne[d], &nelem))
                return cur_fail(c, STATUS_BAD_INPUT, "element count overflows int64 at ne[%u] = %lld", d, (long long)t->ne[d]);
        }
        uint32_t type;
        if ((st = cur_u32(c, &type))) return st;
        if (!dtype_valid((int)type))
            return cur_fail(c, STATUS_UNSUPPORTED, "type %u (%s) is not supported", type, ggml_type_name(type));
        t->type = (enum dtype)type;
        uint64_t off;
        if ((st = cur_u64(c, &off))) return st;
        int64_t be = dtype_block_elems(t->type);
        if (t->ne[0] % be != 0)
            return cur_fail(c, STATUS_BAD_INPUT, "row length ne[0] = %lld is not a multiple of the %s block size %lld",
                            (long long)t->ne[0], dtype_name(t->type), (long long)be);
        if (off % f->alignment != 0)
            return cur_fail(c, STATUS_BAD_INPUT, "data offset %llu is not a multiple of the alignment %u",
                            (unsigned long long)off, f->alignment);
        uint64_t rows = (uint64_t)(t->ne[0] ? nelem / t->ne[0] : 0), nbytes;
        if (__builtin_mul_overflow((uint64_t)dtype_row_bytes(t->type, t->ne[0]), rows, &nbytes))
            return cur_fail(c, STATUS_BAD_INPUT, "byte size overflows");
        t->nbytes = (size_t)nbytes;
        t->data = (const void *)(uintptr_t)off; /* made absolute once the data section is known */
    }
    if (f->n_tensors > 1) {
        const struct gguf_tensor **idx = malloc((size_t)f->n_tensors * sizeof *idx);
        if (!idx) return cur_fail(c, STATUS_NO_MEMORY, "no memory to index %lld tensors", (long long)f->n_tensors);
        for (int64_t i = 0; i < f->n_tensors; i++) idx[i] = &f->tensors[i];
        qsort(idx, (size_t)f->n_tensors, sizeof *idx, tensor_cmp);
        for (int64_t i = 1; i < f->n_tensors; i++) {
            if (tensor_cmp(&idx[i - 1], &idx[i]) == 0) {
                char nm[160];
                name_for_msg(nm, sizeof nm, idx[i]->name);
                snprintf(c->whatbuf, sizeof c->whatbuf, "tensor %s", nm);
                c->what = c->whatbuf;
                free(idx);
                return cur_fail(c, STATUS_BAD_INPUT, "appears more than once");
            }
        }
        free(idx);
    }
    return 0;
}

static void gguf_free_parts(struct gguf_file *f) {
    if (f->kv)
        for (int64_t k = 0; k < f->n_kv; k++) free(f->kv[k].str_offsets);
    free(f->kv);
    free(f->tensors);
    free(f->errbuf);
    free(f->path);
    if (f->map && f->size) munmap((void *)f->map, f->size);
    free(f);
}

static int gguf_parse(struct gguf_file *f, char *err, size_t errlen) {
    struct cursor c = {.base = f->map, .size = f->size, .pos = 0, .path = f->path, .err = err, .errlen = errlen, .what = "header"};
    char magic[4];
    int st = cur_read(&c, magic, 4);
    if (st) return st;
    if (memcmp(magic, GGUF_MAGIC, 4) != 0)
        return cur_fail(&c, STATUS_BAD_INPUT, "magic is %02x %02x %02x %02x, not \"GGUF\" (not a GGUF file)",
                        (unsigned char)magic[0], (unsigned char)magic[1], (unsigned char)magic[2], (unsigned char)magic[3]);
    if ((st = cur_u32(&c, &f->version))) return st;
    if (f->version != 2 && f->version != 3)
        return cur_fail(&c, STATUS_UNSUPPORTED, "version %u is not supported (2 and 3 are)", f->version);
    uint64_t nt, nkv;
    if ((st = cur_u64(&c, &nt)) || (st = cur_u64(&c, &nkv))) return st;
    /* A key takes at least 13 bytes and a tensor info 32, so a count larger
     * than the rest of the file allows ends in a truncation error while
     * parsing; allocating only what could fit keeps a hostile count from
     * asking for memory, and the parse still says where the bytes ran out. */
    uint64_t cap_kv = nkv < (c.size - c.pos) / 13 + 1 ? nkv : (c.size - c.pos) / 13 + 1;
    uint64_t cap_t = nt < (c.size - c.pos) / 32 + 1 ? nt : (c.size - c.pos) / 32 + 1;
    f->n_kv = (int64_t)cap_kv;
    f->n_tensors = (int64_t)cap_t;
    f->kv = calloc(cap_kv ? cap_kv : 1, sizeof *f->kv);
    f->tensors = calloc(cap_t ? cap_t : 1, sizeof *f->tensors);
    if (!f->kv || !f->tensors) return cur_fail(&c, STATUS_NO_MEMORY, "no memory for %llu keys and %llu tensors", (unsigned long long)cap_kv, (unsigned long long)cap_t);
    if (cap_kv < nkv) {
        /* parse what is there to report where it ends, then refuse */
        if ((st = parse_kvs(f, &c))) return st;
        return cur_fail(&c, STATUS_BAD_INPUT, "%llu keys cannot fit in a file of %llu bytes", (unsigned long long)nkv, (unsigned long long)c.size);
    }
    if ((st = parse_kvs(f, &c))) return st;

    f->alignment = GGUF_DEFAULT_ALIGNMENT;
    int64_t ka = gguf_find_key(f, "general.alignment");
    if (ka >= 0) {
        c.what = "key general.alignment";
        if (f->kv[ka].type != GGUF_TYPE_UINT32)
            return cur_fail(&c, STATUS_BAD_INPUT, "type %s, want uint32", vtype_name(f->kv[ka].type));
        uint32_t a;
        memcpy(&a, f->kv[ka].val, 4);
        if (a == 0 || (a & (a - 1)) != 0) return cur_fail(&c, STATUS_BAD_INPUT, "alignment %u is not a power of two", a);
        f->alignment = a;
    }
    if ((st = parse_tensors(f, &c))) return st;
    if (cap_t < nt) {
        c.what = "header";
        return cur_fail(&c, STATUS_BAD_INPUT, "%llu tensors cannot fit in a file of %llu bytes", (unsigned long long)nt, (unsigned long long)c.size);
    }

    uint64_t pad = (f->alignment - c.pos % f->alignment) % f->alignment;
    f->data_start = c.pos + pad;
    for (int64_t i = 0; i < f->n_tensors; i++) {
        struct gguf_tensor *t = &f->tensors[i];
        uint64_t off = (uint64_t)(uintptr_t)t->data, end;
        if (__builtin_add_overflow(f->data_start, off, &end) || __builtin_add_overflow(end, (uint64_t)t->nbytes, &end) ||
            end > f->size) {
            char nm[160];
            name_for_msg(nm, sizeof nm, t->name);
            snprintf(c.whatbuf, sizeof c.whatbuf, "tensor %s", nm);
            c.what = c.whatbuf;
            return cur_fail(&c, STATUS_BAD_INPUT, "data [%llu, +%llu) at offset %llu runs past the end of the file (%llu bytes; truncated?)",
                            (unsigned long long)(f->data_start + off), (unsigned long long)t->nbytes,
                            (unsigned long long)off, (unsigned long long)f->size);
        }
        t->data = f->map + f->data_start + off;
    }
    return 0;
}

int gguf_open(gguf_file **out, const char *path, char *err, size_t errlen) {
    *out = NULL;
    if (err && errlen) err[0] = 0;
    struct gguf_file *f = calloc(1, sizeof *f);
    if (!f || !(f->path = strdup(path)) || !(f->errbuf = calloc(1, GGUF_ERRBUF))) {
        if (f) gguf_free_parts(f);
        if (err && errlen) snprintf(err, errlen, "%s: no memory", path);
        return STATUS_NO_MEMORY;
    }
    int fd = open(path, O_RDONLY | O_CLOEXEC);
    if (fd < 0) {
        int e = errno;
        if (err && errlen) snprintf(err, errlen, "%s: cannot open: %s", path, strerror(e));
        gguf_free_parts(f);
        return e == ENOENT ? STATUS_NOT_FOUND : STATUS_IO;
    }
    struct stat st;
    if (fstat(fd, &st) != 0 || !S_ISREG(st.st_mode)) {
        if (err && errlen) snprintf(err, errlen, "%s: not a regular file", path);
        close(fd);
        gguf_free_parts(f);
        return STATUS_BAD_INPUT;
    }
    if (st.st_size == 0) {
        if (err && errlen) snprintf(err, errlen, "%s: header: file is empty (0 bytes)", path);
        close(fd);
        gguf_free_parts(f);
        return STATUS_BAD_INPUT;
    }
    void *m = mmap(NULL, (size_t)st.st_size, PROT_READ, MAP_PRIVATE, fd, 0);
    int e = errno;
    close(fd);
    if (m == MAP_FAILED) {
        if (err && errlen) snprintf(err, errlen, "%s: mmap of %lld bytes failed: %s", path, (long long)st.st_size, strerror(e));
        gguf_free_parts(f);
        return STATUS_IO;
    }
    f->map = m;
    f->size = (size_t)st.st_size;
    int s = gguf_parse(f, err, errlen);
    if (s) {
        gguf_free_parts(f);
        return s;
    }
    *out = f;
    return 0;
}

void gguf_close(gguf_file *f) {
    if (f) gguf_free_parts(f);
}

const char *gguf_path(const gguf_file *f) { return f->path; }
uint32_t gguf_version(const gguf_file *f) { return f->version; }
const char *gguf_errstr(const gguf_file *f) { return f->errbuf; }
uint32_t gguf_alignment(const gguf_file *f) { return f->alignment; }
uint64_t gguf_data_offset(const gguf_file *f) { return f->data_start; }
size_t gguf_file_size(const gguf_file *f) { return f->size; }

int64_t gguf_n_keys(const gguf_file *f) { return f->n_kv; }
struct gguf_str gguf_key_name(const gguf_file *f, int64_t k) { return f->kv[k].key; }
enum gguf_vtype gguf_key_type(const gguf_file *f, int64_t k) { return f->kv[k].type; }

int gguf_str_eq(struct gguf_str s, const char *c) {
    size_t n = strlen(c);
    return s.len == n && memcmp(s.ptr, c, n) == 0;
}

int64_t gguf_find_key(const gguf_file *f, const char *key) {
    for (int64_t k = 0; k < f->n_kv; k++)
        if (gguf_str_eq(f->kv[k].key, key)) return k;
    return -1;
}

/* ---- getters ---- */

/* A getter error, kept in the file's errbuf for gguf_errstr() and prefixed
 * with the file and the key asked for. */
static int get_fail(const gguf_file *f, int status, const char *key, const char *fmt, ...) __attribute__((format(printf, 4, 5)));
static int get_fail(const gguf_file *f, int status, const char *key, const char *fmt, ...) {
    char msg[256];
    va_list ap;
    va_start(ap, fmt);
    vsnprintf(msg, sizeof msg, fmt, ap);
    va_end(ap);
    return status_fail(f->errbuf, GGUF_ERRBUF, status, "%s: key %s: %s", f->path, key, msg);
}

/* A numeric value of type t at p, as signed/unsigned integer or double.
 * kind: 0 integer (fills *i or *u, *is_unsigned), 1 float, -1 other. */
struct num {
    int kind;      /* 0 integer, 1 float, -1 not numeric */
    int neg;       /* integer is negative */
    uint64_t mag;  /* integer magnitude when !neg, else value as int64 in sv */
    int64_t sv;
    double fv;
};

static struct num num_at(enum gguf_vtype t, const uint8_t *p) {
    struct num n = {.kind = 0};
    switch (t) {
    case GGUF_TYPE_UINT8: n.mag = p[0]; break;
    case GGUF_TYPE_INT8: n.sv = (int8_t)p[0]; break;
    case GGUF_TYPE_UINT16: { uint16_t v; memcpy(&v, p, 2); n.mag = v; break; }
    case GGUF_TYPE_INT16: { int16_t v; memcpy(&v, p, 2); n.sv = v; break; }
    case GGUF_TYPE_UINT32: { uint32_t v; memcpy(&v, p, 4); n.mag = v; break; }
    case GGUF_TYPE_INT32: { int32_t v; memcpy(&v, p, 4); n.sv = v; break; }
    case GGUF_TYPE_UINT64: { uint64_t v; memcpy(&v, p, 8); n.mag = v; break; }
    case GGUF_TYPE_INT64: { int64_t v; memcpy(&v, p, 8); n.sv = v; break; }
    case GGUF_TYPE_FLOAT32: { float v; memcpy(&v, p, 4); n.kind = 1; n.fv = v; return n; }
    case GGUF_TYPE_FLOAT64: { double v; memcpy(&v, p, 8); n.kind = 1; n.fv = v; return n; }
    default: n.kind = -1; return n;
    }
    int is_signed = t == GGUF_TYPE_INT8 || t == GGUF_TYPE_INT16 || t == GGUF_TYPE_INT32 || t == GGUF_TYPE_INT64;
    if (is_signed) {
        if (n.sv < 0) n.neg = 1;
        else n.mag = (uint64_t)n.sv;
    }
    n.fv = n.neg ? (double)n.sv : (double)n.mag;
    return n;
}

static const struct gguf_kv *find_kv(const gguf_file *f, const char *key) {
    int64_t k = gguf_find_key(f, key);
    if (k < 0) {
        get_fail(f, STATUS_NOT_FOUND, key, "absent");
        return NULL;
    }
    return &f->kv[k];
}

static int num_to_u32(const gguf_file *f, const char *key, enum gguf_vtype t, const uint8_t *p, uint32_t *out) {
    struct num n = num_at(t, p);
    if (n.kind != 0) return get_fail(f, STATUS_BAD_INPUT, key, "type %s, want an integer", vtype_name(t));
    if (n.neg || n.mag > UINT32_MAX)
        return get_fail(f, STATUS_BAD_INPUT, key, "value %s%llu does not fit uint32", n.neg ? "-" : "",
                        n.neg ? (unsigned long long)(-(n.sv + 1)) + 1ull : (unsigned long long)n.mag);
    *out = (uint32_t)n.mag;
    return 0;
}

static int num_to_i64(const gguf_file *f, const char *key, enum gguf_vtype t, const uint8_t *p, int64_t *out) {
    struct num n = num_at(t, p);
    if (n.kind != 0) return get_fail(f, STATUS_BAD_INPUT, key, "type %s, want an integer", vtype_name(t));
    if (n.neg) {
        *out = n.sv;
        return 0;
    }
    if (n.mag > (uint64_t)INT64_MAX) return get_fail(f, STATUS_BAD_INPUT, key, "value %llu does not fit int64", (unsigned long long)n.mag);
    *out = (int64_t)n.mag;
    return 0;
}

static int num_to_f32(const gguf_file *f, const char *key, enum gguf_vtype t, const uint8_t *p, float *out) {
    struct num n = num_at(t, p);
    if (n.kind < 0) return get_fail(f, STATUS_BAD_INPUT, key, "type %s, want a number", vtype_name(t));
    *out = (float)n.fv;
    return 0;
}

int gguf_get_u32(const gguf_file *f, const char *key, uint32_t *out) {
    const struct gguf_kv *kv = find_kv(f, key);
    if (!kv) return STATUS_NOT_FOUND;
    return num_to_u32(f, key, kv->type, kv->val, out);
}

int gguf_get_i64(const gguf_file *f, const char *key, int64_t *out) {
    const struct gguf_kv *kv = find_kv(f, key);
    if (!kv) return STATUS_NOT_FOUND;
    return num_to_i64(f, key, kv->type, kv->val, out);
}

int gguf_get_f32(const gguf_file *f, const char *key, float *out) {
    const struct gguf_kv *kv = find_kv(f, key);
    if (!kv) return STATUS_NOT_FOUND;
    return num_to_f32(f, key, kv->type, kv->val, out);
}

int gguf_get_bool(const gguf_file *f, const char *key, int *out) {
    const struct gguf_kv *kv = find_kv(f, key);
    if (!kv) return STATUS_NOT_FOUND;
    if (kv->type != GGUF_TYPE_BOOL) return get_fail(f, STATUS_BAD_INPUT, key, "type %s, want bool", vtype_name(kv->type));
    *out = kv->val[0] != 0;
    return 0;
}

int gguf_get_str(const gguf_file *f, const char *key, struct gguf_str *out) {
    const struct gguf_kv *kv = find_kv(f, key);
    if (!kv) return STATUS_NOT_FOUND;
    if (kv->type != GGUF_TYPE_STRING) return get_fail(f, STATUS_BAD_INPUT, key, "type %s, want string", vtype_name(kv->type));
    uint64_t len;
    memcpy(&len, kv->val, 8);
    out->ptr = (const char *)kv->val + 8;
    out->len = len;
    return 0;
}

int gguf_get_arr(const gguf_file *f, const char *key, enum gguf_vtype *elem_type, uint64_t *n) {
    const struct gguf_kv *kv = find_kv(f, key);
    if (!kv) return STATUS_NOT_FOUND;
    if (kv->type != GGUF_TYPE_ARRAY) return get_fail(f, STATUS_BAD_INPUT, key, "type %s, want array", vtype_name(kv->type));
    if (elem_type) *elem_type = kv->elem;
    if (n) *n = kv->n;
    return 0;
}

/* The array kv for an element getter, with i checked. */
static const struct gguf_kv *arr_elem(const gguf_file *f, const char *key, uint64_t i, int *status) {
    const struct gguf_kv *kv = find_kv(f, key);
    if (!kv) {
        *status = STATUS_NOT_FOUND;
        return NULL;
    }
    if (kv->type != GGUF_TYPE_ARRAY) {
        *status = get_fail(f, STATUS_BAD_INPUT, key, "type %s, want array", vtype_name(kv->type));
        return NULL;
    }
    if (i >= kv->n) {
        *status = get_fail(f, STATUS_BAD_INPUT, key, "index %llu outside the array of %llu", (unsigned long long)i,
                           (unsigned long long)kv->n);
        return NULL;
    }
    return kv;
}

int gguf_arr_str(const gguf_file *f, const char *key, uint64_t i, struct gguf_str *out) {
    int st = 0;
    const struct gguf_kv *kv = arr_elem(f, key, i, &st);
    if (!kv) return st;
    if (kv->elem != GGUF_TYPE_STRING)
        return get_fail(f, STATUS_BAD_INPUT, key, "array of %s, want strings", vtype_name(kv->elem));
    const uint8_t *p = kv->val + kv->str_offsets[i];
    uint64_t len;
    memcpy(&len, p, 8);
    out->ptr = (const char *)p + 8;
    out->len = len;
    return 0;
}

int gguf_arr_f32(const gguf_file *f, const char *key, uint64_t i, float *out) {
    int st = 0;
    const struct gguf_kv *kv = arr_elem(f, key, i, &st);
    if (!kv) return st;
    uint64_t es = gguf_vtype_size(kv->elem);
    if (!es || kv->elem == GGUF_TYPE_BOOL)
        return get_fail(f, STATUS_BAD_INPUT, key, "array of %s, want numbers", vtype_name(kv->elem));
    return num_to_f32(f, key, kv->elem, kv->val + i * es, out);
}

int gguf_arr_i64(const gguf_file *f, const char *key, uint64_t i, int64_t *out) {
    int st = 0;
    const struct gguf_kv *kv = arr_elem(f, key, i, &st);
    if (!kv) return st;
    uint64_t es = gguf_vtype_size(kv->elem);
    if (!es || kv->elem == GGUF_TYPE_BOOL)
        return get_fail(f, STATUS_BAD_INPUT, key, "array of %s, want integers", vtype_name(kv->elem));
    return num_to_i64(f, key, kv->elem, kv->val + i * es, out);
}

const void *gguf_arr_data(const gguf_file *f, const char *key, enum gguf_vtype *elem_type, uint64_t *n) {
    const struct gguf_kv *kv = find_kv(f, key);
    if (!kv) return NULL;
    if (kv->type != GGUF_TYPE_ARRAY || !gguf_vtype_size(kv->elem)) {
        get_fail(f, STATUS_BAD_INPUT, key, "not an array of fixed-size values");
        return NULL;
    }
    if (elem_type) *elem_type = kv->elem;
    if (n) *n = kv->n;
    return kv->val;
}

int64_t gguf_n_tensors(const gguf_file *f) { return f->n_tensors; }
const struct gguf_tensor *gguf_tensor_at(const gguf_file *f, int64_t i) { return &f->tensors[i]; }

const struct gguf_tensor *gguf_tensor_find(const gguf_file *f, const char *name) {
    for (int64_t i = 0; i < f->n_tensors; i++)
        if (gguf_str_eq(f->tensors[i].name, name)) return &f->tensors[i];
    return NULL;
}
