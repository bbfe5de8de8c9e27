/* A GGUF file as a worker or the router opens it: gguf_open (header, every
 * key, every tensor info), every getter on every key, the tokenizer read
 * from the metadata (then used on a fixed text), and model_file_open (the
 * hyper-parameters and the tensors an architecture needs).  gguf_open
 * promises that every string and tensor it hands out lies inside the file;
 * the harness checks that against the mapping, since ASan does not watch
 * mapped memory. */
#include <stdlib.h>
#include <string.h>

#include "common/gguf.h"
#include "common/model.h"
#include "common/tokenizer.h"
#include "tests/fuzz/fuzz_util.h"

/* The file's first byte: the first key (or tensor) name of a v2/v3 file
 * starts 32 bytes in, after magic, version, the two counts and its length. */
static const uint8_t *file_base(const gguf_file *f) {
    const uint8_t *lo = NULL;
    for (int64_t k = 0; k < gguf_n_keys(f); k++) {
        const uint8_t *p = (const uint8_t *)gguf_key_name(f, k).ptr;
        if (!lo || p < lo) lo = p;
    }
    for (int64_t i = 0; i < gguf_n_tensors(f); i++) {
        const uint8_t *p = (const uint8_t *)gguf_tensor_at(f, i)->name.ptr;
        if (!lo || p < lo) lo = p;
    }
    return lo ? lo - 32 : NULL;
}

static void inside(const gguf_file *f, const uint8_t *base, const void *p, uint64_t n, const char *what) {
    if (!base) return;
    const uint8_t *q = p;
    if (q < base || q > base + gguf_file_size(f) || n > (uint64_t)(base + gguf_file_size(f) - q))
        fuzz_fail("%s: %llu bytes at offset %lld are outside the file of %zu bytes", what,
                  (unsigned long long)n, (long long)(q - base), gguf_file_size(f));
}

static void use_tokenizer(const tokenizer *t) {
    static const char text[] = "Hello world! <s> 12 345 \xc3\xa9t\xc3\xa9 \xe2\x96\x81 \n\n\t<|endoftext|>";
    int32_t ids[256];
    for (int special = 0; special <= 1; special++) {
        int32_t n = tokenizer_encode(t, text, sizeof text - 1, -1, special, ids, 256);
        if (n < 0) continue;
        if (n > 256) fuzz_fail("%d ids for %zu bytes", n, sizeof text - 1);
        struct detok d;
        tokenizer_detok_init(&d, tokenizer_adds_space_prefix(t));
        size_t cap = tokenizer_detok_size_max(t);
        char *out = malloc(cap);
        if (!out) return;
        for (int32_t i = 0; i < n; i++) {
            if (ids[i] < 0 || ids[i] >= tokenizer_n_vocab(t)) fuzz_fail("id %d outside the vocabulary", ids[i]);
            if (tokenizer_detok_push(t, &d, ids[i], out, cap) < 0) fuzz_fail("detok of id %d failed", ids[i]);
        }
        free(out);
    }
}

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size) {
    const char *path = fuzz_write(0, "model.gguf", data, size);
    gguf_file *f = NULL;
    char err[1024] = "";
    if (gguf_open(&f, path, err, sizeof err) < 0) {
        if (f || !err[0]) fuzz_fail("refused GGUF: f %p, message \"%s\"", (void *)f, err);
        return 0;
    }
    const uint8_t *base = file_base(f);
    for (int64_t k = 0; k < gguf_n_keys(f); k++) {
        struct gguf_str name = gguf_key_name(f, k);
        inside(f, base, name.ptr, name.len, "key name");
        char key[256];
        if (name.len >= sizeof key || memchr(name.ptr, 0, name.len)) continue;
        memcpy(key, name.ptr, name.len);
        key[name.len] = 0;
        uint32_t u32;
        int64_t i64;
        float f32;
        int b;
        struct gguf_str s;
        gguf_get_u32(f, key, &u32);
        gguf_get_i64(f, key, &i64);
        gguf_get_f32(f, key, &f32);
        gguf_get_bool(f, key, &b);
        if (gguf_get_str(f, key, &s) == 0) inside(f, base, s.ptr, s.len, "string value");
        enum gguf_vtype et;
        uint64_t n;
        if (gguf_get_arr(f, key, &et, &n) != 0) continue;
        /* The first elements and the last: enough to check the offsets
         * without making a long array slow. */
        for (uint64_t i = 0; i < n; i = i < 16 || i + 1 == n ? i + 1 : n - 1) {
            if (gguf_arr_str(f, key, i, &s) == 0) inside(f, base, s.ptr, s.len, "array string");
            gguf_arr_f32(f, key, i, &f32);
            gguf_arr_i64(f, key, i, &i64);
        }
        gguf_arr_i64(f, key, n, &i64); /* one past the end: refused */
        const void *raw = gguf_arr_data(f, key, &et, &n);
        (void)raw;
    }
    for (int64_t i = 0; i < gguf_n_tensors(f); i++) {
        const struct gguf_tensor *t = gguf_tensor_at(f, i);
        inside(f, base, t->name.ptr, t->name.len, "tensor name");
        inside(f, base, t->data, t->nbytes, "tensor data");
        if (t->n_dims < 0 || t->n_dims > 4) fuzz_fail("tensor with %d dims", t->n_dims);
    }
    tokenizer *tok = NULL;
    if (tokenizer_from_gguf(&tok, f, err, sizeof err) == 0) {
        use_tokenizer(tok);
        tokenizer_free(tok);
    }
    gguf_close(f);
    model_file *m = NULL;
    if (model_file_open(&m, path, err, sizeof err) == 0) model_file_close(m);
    return 0;
}
