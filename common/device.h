/* The device a program computes on, as its --device flag names it:
 * "auto", "cpu", "cuda" (the first GPU) or "cuda:N".  Every program parses
 * the flag here, so they accept the same forms; opening the device (and
 * resolving "auto" to a GPU or the CPU) is kernels/backend.h's
 * backend_open, since only kernels/ knows whether a GPU can be used. */
#ifndef COMMON_DEVICE_H
#define COMMON_DEVICE_H

#include <stddef.h>

enum device_kind {
    DEVICE_AUTO = 0, /* a GPU when one can be used, else the CPU */
    DEVICE_CPU,
    DEVICE_CUDA,     /* the CUDA device `index` */
};

struct device_spec {
    enum device_kind kind;
    int index; /* DEVICE_CUDA: 0..DEVICE_CUDA_INDEX_MAX; 0 otherwise */
};

#define DEVICE_CUDA_INDEX_MAX 1023

/* Parses text into *out.  NULL means "auto" (the flag was not given).
 * flag names the value in the message ("--device"); NULL reads "device".
 * Returns 0, or STATUS_BAD_INPUT with a message that names the flag and the
 * value in err (then *out is auto). */
int device_parse(const char *flag, const char *text, struct device_spec *out, char *err, size_t errlen);

/* The canonical text of a spec: "auto", "cpu", "cuda:3".  Returns buf. */
const char *device_format(const struct device_spec *d, char *buf, size_t size);

#endif
