/* bench_fp16_row: what the F16 stage link's conversion costs a row, before
 * and after it converted whole rows (common/dtype.h's row functions, F16C
 * where the CPU has it).  "element" is the link's old loop, one
 * f32_to_fp16 / fp16_to_f32 call and two byte stores or loads an element;
 * "row" is dtype_f32_to_fp16_row / dtype_fp16_to_f32_row.  Prints the
 * median ns per row of --dim elements (default 16384, a 405B-wide hidden
 * state) over --repeat timings of --iters rows each. */
#include "common/dtype.h"

#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

static double bf_now_ns(void) {
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (double)ts.tv_sec * 1e9 + (double)ts.tv_nsec;
}

static int bf_cmp(const void *a, const void *b) {
    double x = *(const double *)a, y = *(const double *)b;
    return x < y ? -1 : x > y;
}

static void bf_encode_element(const float *src, uint8_t *dst, size_t n) {
    for (size_t i = 0; i < n; i++) {
        uint16_t h = f32_to_fp16(src[i]);
        dst[2 * i] = (uint8_t)h;
        dst[2 * i + 1] = (uint8_t)(h >> 8);
    }
}
static void bf_decode_element(const uint8_t *src, float *dst, size_t n) {
    for (size_t i = 0; i < n; i++) dst[i] = fp16_to_f32((uint16_t)(src[2 * i] | src[2 * i + 1] << 8));
}

enum bf_kind { BF_ENC_ELEMENT, BF_ENC_ROW, BF_DEC_ELEMENT, BF_DEC_ROW };

int main(int argc, char **argv) {
    size_t dim = 16384;
    int iters = 2000, repeat = 7;
    for (int i = 1; i + 1 < argc; i += 2) {
        if (!strcmp(argv[i], "--dim")) dim = (size_t)atol(argv[i + 1]);
        else if (!strcmp(argv[i], "--iters")) iters = atoi(argv[i + 1]);
        else if (!strcmp(argv[i], "--repeat")) repeat = atoi(argv[i + 1]);
        else {
            fprintf(stderr, "usage: %s [--dim N] [--iters N] [--repeat N]\n", argv[0]);
            return 2;
        }
    }
    if (dim == 0 || iters < 1 || repeat < 1 || repeat > 99) {
        fprintf(stderr, "bench_fp16_row: --dim %zu --iters %d --repeat %d out of range\n", dim, iters, repeat);
        return 2;
    }
    float *x = malloc(dim * sizeof *x), *y = malloc(dim * sizeof *y);
    fp16_t *h = malloc(dim * sizeof *h);
    if (!x || !y || !h) {
        fprintf(stderr, "bench_fp16_row: no memory for %zu elements\n", dim);
        return 1;
    }
    /* hidden-state-like values: mostly small, a few large, some denormal halves */
    uint64_t s = 0x9e3779b97f4a7c15ull;
    for (size_t i = 0; i < dim; i++) {
        s ^= s << 13, s ^= s >> 7, s ^= s << 17;
        x[i] = ((float)(s >> 40) / 16777216.0f - 0.5f) * (i % 97 == 0 ? 300.0f : i % 89 == 0 ? 1e-5f : 4.0f);
    }
    dtype_f32_to_fp16_row(x, h, dim);
    static const char *const names[] = {"encode f32->f16, element", "encode f32->f16, row",
                                        "decode f16->f32, element", "decode f16->f32, row"};
    double t[99];
    volatile float sink = 0;
    printf("bench_fp16_row: %zu elements a row, %d rows a timing, median of %d\n", dim, iters, repeat);
    for (int k = BF_ENC_ELEMENT; k <= BF_DEC_ROW; k++) {
        for (int r = 0; r < repeat; r++) {
            double t0 = bf_now_ns();
            for (int it = 0; it < iters; it++) {
                switch (k) {
                case BF_ENC_ELEMENT: bf_encode_element(x, (uint8_t *)h, dim); break;
                case BF_ENC_ROW: dtype_f32_to_fp16_row(x, h, dim); break;
                case BF_DEC_ELEMENT: bf_decode_element((const uint8_t *)h, y, dim); break;
                case BF_DEC_ROW: dtype_fp16_to_f32_row(h, y, dim); break;
                }
                sink += k >= BF_DEC_ELEMENT ? y[it % dim] : (float)h[it % dim];
            }
            t[r] = (bf_now_ns() - t0) / iters;
        }
        qsort(t, (size_t)repeat, sizeof t[0], bf_cmp);
        printf("%-26s %10.0f ns/row  %6.2f ns/element\n", names[k], t[repeat / 2], t[repeat / 2] / (double)dim);
    }
    free(x);
    free(y);
    free(h);
    return 0;
}
