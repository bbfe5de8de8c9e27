/* A safetensors file as a Hugging Face model's shard is opened:
 * safetensors_open (the 8-byte length, the JSON header, every tensor's
 * dtype, shape and byte range), then lookups and a read of every byte each
 * tensor is said to hold.  Mapped memory is not watched by ASan, so a range
 * past the end of the file shows as a fault only beyond its last page; the
 * sizes are also checked against the shapes. */
#include <stdlib.h>
#include <string.h>

#include "common/safetensors.h"
#include "tests/fuzz/fuzz_util.h"

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size) {
    const char *path = fuzz_write(0, "model.safetensors", data, size);
    safetensors_file *f = NULL;
    char err[1024] = "";
    if (safetensors_open(&f, path, err, sizeof err) < 0) {
        if (f || !err[0]) fuzz_fail("refused safetensors: f %p, message \"%s\"", (void *)f, err);
        return 0;
    }
    uint8_t sum = 0;
    for (int64_t i = 0; i < safetensors_n_tensors(f); i++) {
        const struct safetensors_tensor *t = safetensors_tensor_at(f, i);
        if (safetensors_tensor_find(f, t->name) != t) fuzz_fail("tensor %s: lookup finds another", t->name);
        if (t->n_dims < 0 || t->n_dims > 4) fuzz_fail("tensor %s: %d dims", t->name, t->n_dims);
        uint64_t n = 1;
        for (int d = 0; d < 4; d++) {
            if (t->ne[d] < 0) fuzz_fail("tensor %s: ne[%d] = %lld", t->name, d, (long long)t->ne[d]);
            n *= (uint64_t)t->ne[d];
        }
        if (t->supported && n * (t->type == DTYPE_F32 ? 4 : 2) != t->nbytes)
            fuzz_fail("tensor %s: %zu bytes for %llu elements of %s", t->name, t->nbytes,
                      (unsigned long long)n, t->dtype_str);
        if (t->nbytes > size) fuzz_fail("tensor %s: %zu bytes in a file of %zu", t->name, t->nbytes, size);
        const uint8_t *p = t->data;
        for (size_t k = 0; k < t->nbytes; k++) sum += p[k];
    }
    safetensors_close(f);
    /* Keeps the reads. */
    __asm__ volatile("" : : "r"(sum));
    return 0;
}
