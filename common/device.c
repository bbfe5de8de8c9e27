/* Parsing of the --device flag shared by llm-run and llm-worker. */
#include "device.h"
#include "status.h"

#include <stdio.h>
#include <string.h>

int device_parse(const char *flag, const char *text, struct device_spec *out, char *err, size_t errlen) {
    out->kind = DEVICE_AUTO;
    out->index = 0;
    if (!text || strcmp(text, "auto") == 0) return STATUS_OK;
    if (strcmp(text, "cpu") == 0) {
        out->kind = DEVICE_CPU;
        return STATUS_OK;
    }
    if (strcmp(text, "cuda") == 0) {
        out->kind = DEVICE_CUDA;
        return STATUS_OK;
    }
    if (strncmp(text, "cuda:", 5) == 0 && text[5]) {
        /* Digits only: strtol would also take "+1", " 1" and "0x1". */
        long v = 0;
        const char *p = text + 5;
        for (; *p >= '0' && *p <= '9'; p++)
            if (v <= DEVICE_CUDA_INDEX_MAX) v = v * 10 + (*p - '0');
        if (!*p && v <= DEVICE_CUDA_INDEX_MAX) {
            out->kind = DEVICE_CUDA;
            out->index = (int)v;
            return STATUS_OK;
        }
        if (!*p) {
            snprintf(err, errlen, "%s %s: GPU index above %d", flag ? flag : "device", text,
                     DEVICE_CUDA_INDEX_MAX);
            return STATUS_BAD_INPUT;
        }
    }
    snprintf(err, errlen, "%s \"%s\": expected auto, cpu, cuda or cuda:N (N a GPU index from 0)",
             flag ? flag : "device", text);
    return STATUS_BAD_INPUT;
}

const char *device_format(const struct device_spec *d, char *buf, size_t size) {
    switch (d->kind) {
    case DEVICE_CPU: snprintf(buf, size, "cpu"); break;
    case DEVICE_CUDA: snprintf(buf, size, "cuda:%d", d->index); break;
    default: snprintf(buf, size, "auto"); break;
    }
    return buf;
}
