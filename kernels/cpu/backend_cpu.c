/* The CPU backend: host memory, a persistent thread pool created at init,
 * and the op table (kernels/cpu/{matmul,attention,ops}.c).  Weights are
 * used in place: the backend keeps a reference to the caller's (usually
 * mmap'd) host data. */
#include "../backend.h"
#include "cpu.h"

#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include "../../common/status.h"

#define CPU_ALIGN 64

static const char *cpu_name(const backend *b) { return ((const struct backend_cpu *)b)->name; }

static void cpu_free(backend *b_) {
    struct backend_cpu *b = (struct backend_cpu *)b_;
    cpu_pool_free(b->pool);
    free(b->scratch);
    free(b);
}

static void *cpu_alloc(backend *b, size_t bytes) {
    size_t rounded = (bytes + CPU_ALIGN - 1) & ~(size_t)(CPU_ALIGN - 1);
    void *p = rounded >= bytes ? aligned_alloc(CPU_ALIGN, rounded) : NULL;
    if (!p) backend_fail(b, STATUS_NO_MEMORY, "cpu: cannot allocate %zu bytes", bytes);
    return p;
}

static void cpu_dealloc(backend *b, void *p) {
    (void)b;
    free(p);
}

void *cpu_scratch(struct backend_cpu *b, size_t bytes) {
    if (bytes <= b->scratch_bytes) return b->scratch;
    /* Grow by at least half again, so a batch that creeps up in size does
     * not reallocate on every step. */
    size_t want = bytes > b->scratch_bytes + b->scratch_bytes / 2 ? bytes : b->scratch_bytes + b->scratch_bytes / 2;
    void *p = cpu_alloc(&b->base, want);
    if (!p) return NULL;
    free(b->scratch);
    b->scratch = p;
    b->scratch_bytes = want;
    return p;
}

static int meminfo_field(const char *text, const char *key, size_t *out) {
    const char *p = strstr(text, key);
    unsigned long long kb;
    if (!p || sscanf(p + strlen(key), " %llu kB", &kb) != 1) return 0;
    *out = (size_t)kb * 1024;
    return 1;
}

static int cpu_mem_info(backend *b, size_t *bytes_free, size_t *bytes_total) {
    (void)b;
    char buf[4096];
    size_t fr = 0, tot = 0;
    FILE *f = fopen("/proc/meminfo", "r");
    if (f) {
        size_t n = fread(buf, 1, sizeof buf - 1, f);
        fclose(f);
        buf[n] = '\0';
        if (meminfo_field(buf, "MemTotal:", &tot) && meminfo_field(buf, "MemAvailable:", &fr)) {
            *bytes_free = fr;
            *bytes_total = tot;
            return STATUS_OK;
        }
    }
    long page = sysconf(_SC_PAGESIZE), pages = sysconf(_SC_PHYS_PAGES), avail = sysconf(_SC_AVPHYS_PAGES);
    if (page <= 0 || pages <= 0 || avail < 0)
        return backend_fail(b, STATUS_IO, "cpu: cannot read /proc/meminfo or sysconf memory sizes");
    *bytes_free = (size_t)avail * (size_t)page;
    *bytes_total = (size_t)pages * (size_t)page;
    return STATUS_OK;
}

static int cpu_memcpy(backend *b, void *dst, const void *src, size_t bytes) {
    (void)b;
    memmove(dst, src, bytes);
    return STATUS_OK;
}

static int cpu_sync(backend *b) {
    (void)b;
    return STATUS_OK; /* every op has finished when it returns */
}

static int cpu_weight_load(backend *b, struct backend_weight *out, enum dtype type, const void *host, int64_t rows,
                           int64_t cols) {
    const struct cpu_type_traits *tr = cpu_type_traits(type);
    if (!tr) return backend_fail(b, STATUS_UNSUPPORTED, "cpu: weight type %s is not supported", dtype_name(type));
    out->type = type;
    out->rows = rows;
    out->cols = cols;
    /* Blocks hold fp16 fields and F32 rows floats: data must be aligned to
     * its element.  GGUF aligns tensors to 32 bytes, so this copies only
     * for odd callers. */
    size_t align = type == DTYPE_F32 ? 4 : 2;
    if ((uintptr_t)host % align == 0) {
        out->data = (void *)host;
        out->owned = 0;
        return STATUS_OK;
    }
    size_t bytes = (size_t)rows * (size_t)(cols / tr->block_elems) * tr->block_bytes;
    out->data = cpu_alloc(b, bytes);
    if (!out->data) return STATUS_NO_MEMORY;
    memcpy(out->data, host, bytes);
    out->owned = 1;
    return STATUS_OK;
}

static void cpu_weight_free(backend *b, struct backend_weight *w) {
    (void)b;
    if (w->owned) free(w->data);
}

static const struct backend_i cpu_iface = {
    .name = cpu_name,
    .free = cpu_free,
    .is_gpu = 0,
    .alloc = cpu_alloc,
    .dealloc = cpu_dealloc,
    .mem_info = cpu_mem_info,
    .upload = cpu_memcpy,
    .download = cpu_memcpy,
    .copy = cpu_memcpy,
    .sync = cpu_sync,
    .weight_load = cpu_weight_load,
    .weight_free = cpu_weight_free,
    .embed = cpu_embed,
    .rmsnorm = cpu_rmsnorm,
    .add_rmsnorm = cpu_add_rmsnorm,
    .add = cpu_add,
    .matmul = cpu_matmul,
    .rope = cpu_rope,
    .swiglu = cpu_swiglu,
    .get_rows = cpu_get_rows,
    .kv_write = cpu_kv_write,
    .attention = cpu_attention,
    .convert = cpu_convert,
};

int backend_cpu_init(backend **out, int n_threads, char *err, size_t errlen) {
    *out = NULL;
    cpu_kernels_init();
    if (n_threads <= 0) {
        long n = sysconf(_SC_NPROCESSORS_ONLN);
        n_threads = n > 0 ? (int)n : 1;
    }
    if (n_threads > 1024) {
        snprintf(err, errlen, "cpu: %d threads requested (at most 1024)", n_threads);
        return STATUS_BAD_INPUT;
    }
    struct backend_cpu *b = calloc(1, sizeof *b);
    if (!b) {
        snprintf(err, errlen, "cpu: cannot allocate the backend");
        return STATUS_NO_MEMORY;
    }
    b->base.i = &cpu_iface;
    b->n_threads = n_threads;
    snprintf(b->name, sizeof b->name, "cpu (%d threads%s)", n_threads, cpu_has_avx2() ? ", avx2" : "");
    b->pool = cpu_pool_init(n_threads);
    if (!b->pool) {
        snprintf(err, errlen, "cpu: cannot start %d threads", n_threads);
        free(b);
        return STATUS_NO_MEMORY;
    }
    /* Enough scratch for decode batches of typical models, so the first
     * steps do not allocate. */
    if (!cpu_scratch(b, (size_t)1 << 20)) {
        snprintf(err, errlen, "cpu: cannot allocate 1 MiB of scratch");
        cpu_free(&b->base);
        return STATUS_NO_MEMORY;
    }
    *out = &b->base;
    return STATUS_OK;
}
