/* safetensors reader: maps the file, parses the JSON header with cJSON and
 * checks every tensor's dtype, shape and byte range against the file, with
 * overflow-safe arithmetic, before handing out pointers into the mapping. */
#include "safetensors.h"

#include <cjson/cJSON.h>
#include <errno.h>
#include <fcntl.h>
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <unistd.h>

#include "status.h"

#define ST_HEADER_MAX (100u << 20) /* the format's own limit on the JSON header */

struct safetensors_file {
    char *path;
    const uint8_t *map;
    size_t size;
    int64_t n;
    struct safetensors_tensor *t;
};

void safetensors_close(safetensors_file *f) {
    if (!f) return;
    for (int64_t i = 0; i < f->n; i++) free(f->t[i].name);
    free(f->t);
    if (f->map) munmap((void *)f->map, f->size);
    free(f->path);
    free(f);
}

/* A JSON number that is a non-negative integer below 2^53 (exact in a double). */
static int json_uint(const cJSON *j, uint64_t *out) {
    if (!cJSON_IsNumber(j)) return -1;
    double v = j->valuedouble;
    if (!(v >= 0 && v <= 9007199254740992.0) || v != floor(v)) return -1;
    *out = (uint64_t)v;
    return 0;
}

static int dtype_from_str(const char *s, enum dtype *t, size_t *elem) {
    if (strcmp(s, "F32") == 0) { *t = DTYPE_F32; *elem = 4; return 1; }
    if (strcmp(s, "F16") == 0) { *t = DTYPE_F16; *elem = 2; return 1; }
    if (strcmp(s, "BF16") == 0) { *t = DTYPE_BF16; *elem = 2; return 1; }
    /* known but unsupported: their sizes still let us check the ranges */
    static const struct { const char *n; size_t e; } other[] = {
        {"F64", 8}, {"I64", 8}, {"U64", 8}, {"I32", 4}, {"U32", 4}, {"I16", 2}, {"U16", 2},
        {"I8", 1}, {"U8", 1}, {"BOOL", 1}, {"F8_E4M3", 1}, {"F8_E5M2", 1}};
    for (size_t i = 0; i < sizeof other / sizeof other[0]; i++)
        if (strcmp(s, other[i].n) == 0) { *elem = other[i].e; return 0; }
    *elem = 0;
    return 0;
}

static int tensor_name_cmp(const void *a, const void *b) {
    return strcmp((*(const struct safetensors_tensor *const *)a)->name, (*(const struct safetensors_tensor *const *)b)->name);
}

static int parse_header(safetensors_file *f, const char *json, size_t len, uint64_t data_start, char *err, size_t errlen) {
    cJSON *root = cJSON_ParseWithLength(json, len);
    if (!root || !cJSON_IsObject(root)) {
        cJSON_Delete(root);
        return status_fail(err, errlen, STATUS_BAD_INPUT, "%s: header: not a JSON object (corrupt header of %zu bytes)", f->path, len);
    }
    int64_t count = 0;
    for (cJSON *e = root->child; e; e = e->next) count++;
    f->t = calloc((size_t)(count ? count : 1), sizeof *f->t);
    if (!f->t) {
        cJSON_Delete(root);
        return status_fail(err, errlen, STATUS_NO_MEMORY, "%s: no memory for %lld tensors", f->path, (long long)count);
    }
    uint64_t data_size = f->size - data_start;
    int st = 0;
    for (cJSON *e = root->child; e && !st; e = e->next) {
        if (!e->string) continue;
        if (strcmp(e->string, "__metadata__") == 0) continue;
        const char *nm = e->string;
        struct safetensors_tensor *t = &f->t[f->n];
        if (!cJSON_IsObject(e)) {
            st = status_fail(err, errlen, STATUS_BAD_INPUT, "%s: tensor %s: entry is not an object", f->path, nm);
            break;
        }
        const cJSON *jd = cJSON_GetObjectItemCaseSensitive(e, "dtype");
        const cJSON *js = cJSON_GetObjectItemCaseSensitive(e, "shape");
        const cJSON *jo = cJSON_GetObjectItemCaseSensitive(e, "data_offsets");
        if (!cJSON_IsString(jd) || !cJSON_IsArray(js) || !cJSON_IsArray(jo) || cJSON_GetArraySize(jo) != 2) {
            st = status_fail(err, errlen, STATUS_BAD_INPUT, "%s: tensor %s: needs dtype (string), shape (array) and data_offsets (2 numbers)", f->path, nm);
            break;
        }
        t->name = strdup(nm);
        if (!t->name) {
            st = status_fail(err, errlen, STATUS_NO_MEMORY, "%s: no memory", f->path);
            break;
        }
        f->n++;
        snprintf(t->dtype_str, sizeof t->dtype_str, "%s", jd->valuestring);
        size_t elem = 0;
        t->supported = dtype_from_str(jd->valuestring, &t->type, &elem);
        if (!elem) {
            st = status_fail(err, errlen, STATUS_UNSUPPORTED, "%s: tensor %s: dtype \"%.15s\" is unknown", f->path, nm, jd->valuestring);
            break;
        }
        int nd = cJSON_GetArraySize(js);
        if (nd > 4) {
            st = status_fail(err, errlen, STATUS_UNSUPPORTED, "%s: tensor %s: %d dimensions (at most 4 are supported)", f->path, nm, nd);
            break;
        }
        t->n_dims = nd;
        for (int d = 0; d < 4; d++) t->ne[d] = 1;
        uint64_t nelem = 1;
        for (int d = 0; d < nd; d++) {
            uint64_t v;
            if (json_uint(cJSON_GetArrayItem(js, d), &v) != 0) {
                st = status_fail(err, errlen, STATUS_BAD_INPUT, "%s: tensor %s: shape[%d] is not a non-negative integer", f->path, nm, d);
                break;
            }
            t->ne[nd - 1 - d] = (int64_t)v;
            if (__builtin_mul_overflow(nelem, v, &nelem)) {
                st = status_fail(err, errlen, STATUS_BAD_INPUT, "%s: tensor %s: element count overflows", f->path, nm);
                break;
            }
        }
        if (st) break;
        uint64_t b0, b1, want;
        if (json_uint(cJSON_GetArrayItem(jo, 0), &b0) || json_uint(cJSON_GetArrayItem(jo, 1), &b1) || b1 < b0) {
            st = status_fail(err, errlen, STATUS_BAD_INPUT, "%s: tensor %s: data_offsets are not an increasing pair of integers", f->path, nm);
            break;
        }
        if (__builtin_mul_overflow(nelem, (uint64_t)elem, &want) || b1 - b0 != want) {
            st = status_fail(err, errlen, STATUS_BAD_INPUT, "%s: tensor %s: data_offsets [%llu, %llu) hold %llu bytes, shape and dtype %s need %llu",
                             f->path, nm, (unsigned long long)b0, (unsigned long long)b1, (unsigned long long)(b1 - b0),
                             t->dtype_str, (unsigned long long)want);
            break;
        }
        if (b1 > data_size) {
            st = status_fail(err, errlen, STATUS_BAD_INPUT, "%s: tensor %s: data [%llu, %llu) runs past the end of the data (%llu bytes; truncated?)",
                             f->path, nm, (unsigned long long)b0, (unsigned long long)b1, (unsigned long long)data_size);
            break;
        }
        /* only tensors we hand out as typed arrays need aligned data */
        if (t->supported && (data_start + b0) % elem != 0) {
            st = status_fail(err, errlen, STATUS_UNSUPPORTED, "%s: tensor %s: data at file offset %llu is not aligned to its %zu-byte elements",
                             f->path, nm, (unsigned long long)(data_start + b0), elem);
            break;
        }
        t->data = f->map + data_start + b0;
        t->nbytes = (size_t)want;
    }
    cJSON_Delete(root);
    if (st) return st;
    /* a repeated name would make lookups ambiguous */
    if (f->n > 1) {
        const struct safetensors_tensor **idx = malloc((size_t)f->n * sizeof *idx);
        if (!idx) return status_fail(err, errlen, STATUS_NO_MEMORY, "%s: no memory", f->path);
        for (int64_t i = 0; i < f->n; i++) idx[i] = &f->t[i];
        qsort(idx, (size_t)f->n, sizeof *idx, tensor_name_cmp);
        for (int64_t i = 1; i < f->n; i++) {
            if (strcmp(idx[i - 1]->name, idx[i]->name) == 0) {
                st = status_fail(err, errlen, STATUS_BAD_INPUT, "%s: tensor %s: appears more than once", f->path, idx[i]->name);
                break;
            }
        }
        free(idx);
    }
    return st;
}

int safetensors_open(safetensors_file **out, const char *path, char *err, size_t errlen) {
    *out = NULL;
    safetensors_file *f = calloc(1, sizeof *f);
    if (!f || !(f->path = strdup(path))) {
        free(f);
        return status_fail(err, errlen, STATUS_NO_MEMORY, "%s: no memory", path);
    }
    int fd = open(path, O_RDONLY | O_CLOEXEC);
    if (fd < 0) {
        int e = errno;
        safetensors_close(f);
        return status_fail(err, errlen, e == ENOENT ? STATUS_NOT_FOUND : STATUS_IO, "%s: cannot open: %s", path, strerror(e));
    }
    struct stat sb;
    if (fstat(fd, &sb) != 0 || !S_ISREG(sb.st_mode)) {
        close(fd);
        safetensors_close(f);
        return status_fail(err, errlen, STATUS_BAD_INPUT, "%s: not a regular file", path);
    }
    if (sb.st_size < 8) {
        close(fd);
        safetensors_close(f);
        return status_fail(err, errlen, STATUS_BAD_INPUT, "%s: header: file of %lld bytes is too short for the 8-byte header length (truncated?)",
                           path, (long long)sb.st_size);
    }
    void *m = mmap(NULL, (size_t)sb.st_size, PROT_READ, MAP_PRIVATE, fd, 0);
    int e = errno;
    close(fd);
    if (m == MAP_FAILED) {
        safetensors_close(f);
        return status_fail(err, errlen, STATUS_IO, "%s: mmap of %lld bytes failed: %s", path, (long long)sb.st_size, strerror(e));
    }
    f->map = m;
    f->size = (size_t)sb.st_size;
    uint64_t hlen;
    memcpy(&hlen, f->map, 8);
    if (hlen > ST_HEADER_MAX || hlen > f->size - 8) {
        int st = status_fail(err, errlen, STATUS_BAD_INPUT, "%s: header: length %llu runs past the end of the file (%zu bytes; truncated?) or exceeds %u",
                             path, (unsigned long long)hlen, f->size, ST_HEADER_MAX);
        safetensors_close(f);
        return st;
    }
    int st = parse_header(f, (const char *)f->map + 8, (size_t)hlen, 8 + hlen, err, errlen);
    if (st) {
        safetensors_close(f);
        return st;
    }
    *out = f;
    return 0;
}

const char *safetensors_path(const safetensors_file *f) { return f->path; }
int64_t safetensors_n_tensors(const safetensors_file *f) { return f->n; }
const struct safetensors_tensor *safetensors_tensor_at(const safetensors_file *f, int64_t i) { return &f->t[i]; }

const struct safetensors_tensor *safetensors_tensor_find(const safetensors_file *f, const char *name) {
    for (int64_t i = 0; i < f->n; i++)
        if (strcmp(f->t[i].name, name) == 0) return &f->t[i];
    return NULL;
}
