/* The transport-independent half of a stage-to-stage link: dispatch to the
 * transport's table, argument checks shared by both, error text, and the
 * wire's element encoding (kernels/cuda/link_codec.cu does the same on the
 * GPU, bit for bit). */
#include "link.h"
#include "link-impl.h"

#include "common/dtype.h"
#include "common/status.h"

#include <math.h>
#include <stdarg.h>
#include <stdio.h>
#include <string.h>

int link_fail(link_conn *l, int code, const char *fmt, ...) {
    va_list ap;
    va_start(ap, fmt);
    vsnprintf(l->errstr, sizeof l->errstr, fmt, ap);
    va_end(ap);
    return code;
}

void link_free(link_conn *l) {
    if (l) l->ops->free(l);
}

int link_send(link_conn *l, uint64_t step_id, const void *buf, size_t bytes) {
    if (l->dir != LINK_SEND)
        return link_fail(l, STATUS_BAD_INPUT, "%s link %s: send on the receiving end (step %llu)",
                         l->ops->kind, l->endpoint, (unsigned long long)step_id);
    if (!buf && bytes)
        return link_fail(l, STATUS_BAD_INPUT, "%s link %s: step %llu: NULL buffer of %zu bytes",
                         l->ops->kind, l->endpoint, (unsigned long long)step_id, bytes);
    l->errstr[0] = 0;
    return l->ops->send(l, step_id, buf, bytes);
}

int link_recv(link_conn *l, uint64_t step_id, void *buf, size_t bytes) {
    if (l->dir != LINK_RECV)
        return link_fail(l, STATUS_BAD_INPUT, "%s link %s: receive on the sending end (step %llu)",
                         l->ops->kind, l->endpoint, (unsigned long long)step_id);
    if (!buf && bytes)
        return link_fail(l, STATUS_BAD_INPUT, "%s link %s: step %llu: NULL buffer of %zu bytes",
                         l->ops->kind, l->endpoint, (unsigned long long)step_id, bytes);
    l->errstr[0] = 0;
    return l->ops->recv(l, step_id, buf, bytes);
}

void link_set_epoch(link_conn *l, uint64_t epoch) { l->epoch = epoch; }

void link_set_abort(link_conn *l, const _Atomic uint64_t *gen) { l->abort_gen = gen; }

const char *const link_dtype_names[] = {"f32", "f16", "bf16", "int8", NULL};

size_t link_dtype_wire_bytes(enum link_dtype t, size_t bytes, size_t row_elems) {
    size_t elems = bytes / sizeof(float);
    switch (t) {
    case LINK_DTYPE_F16:
    case LINK_DTYPE_BF16: return elems * 2;
    case LINK_DTYPE_INT8: return row_elems ? elems / row_elems * link_int8_row_bytes(row_elems) : 0;
    default: return bytes;
    }
}

void link_encode(enum link_dtype t, const float *src, size_t elems, size_t row, uint8_t *dst) {
    if (t == LINK_DTYPE_F32) {
        memcpy(dst, src, elems * sizeof(float)); /* as the host holds it, as ZeroMQ always sent it */
        return;
    }
#if defined(__BYTE_ORDER__) && __BYTE_ORDER__ == __ORDER_LITTLE_ENDIAN__
    /* The wire's little-endian halves are the host's: convert the row whole
     * (F16C where the CPU has it) instead of element by element.  A buffer
     * off a 2-byte boundary (a tiny ZeroMQ message held inline) cannot be
     * read as halves and takes the byte loop below. */
    if (t == LINK_DTYPE_F16 && ((uintptr_t)dst & 1) == 0) {
        dtype_f32_to_fp16_row(src, (fp16_t *)(void *)dst, elems);
        return;
    }
#endif
    if (t == LINK_DTYPE_F16 || t == LINK_DTYPE_BF16) {
        for (size_t i = 0; i < elems; i++) {
            uint16_t h = t == LINK_DTYPE_F16 ? f32_to_fp16(src[i]) : f32_to_bf16(src[i]);
            dst[2 * i] = (uint8_t)h;
            dst[2 * i + 1] = (uint8_t)(h >> 8);
        }
        return;
    }
    /* INT8: each block of LINK_INT8_BLOCK values of a row (the last may be
     * shorter), the block's scale (BF16, little-endian) then its values.
     * The GPU encoder (link_codec.cu) does these float operations in this
     * order, so that both give the same bytes. */
    const size_t rb = link_int8_row_bytes(row);
    for (size_t r = 0; r < elems / row; r++) {
        uint8_t *o = dst + r * rb;
        for (size_t b0 = 0; b0 < row; b0 += LINK_INT8_BLOCK) {
            const float *x = src + r * row + b0;
            const size_t nb = row - b0 < LINK_INT8_BLOCK ? row - b0 : LINK_INT8_BLOCK;
            float amax = 0;
            for (size_t i = 0; i < nb; i++) amax = fabsf(x[i]) > amax ? fabsf(x[i]) : amax;
            const uint16_t sb = f32_to_bf16(amax / 127.0f);
            const float scale = bf16_to_f32(sb), inv = scale > 0 ? 1.0f / scale : 0;
            o[0] = (uint8_t)sb;
            o[1] = (uint8_t)(sb >> 8);
            for (size_t i = 0; i < nb; i++) {
                float q = roundf(x[i] * inv);
                q = q > 127 ? 127 : q < -127 ? -127 : q == q ? q : 0; /* NaN: 0 */
                o[2 + i] = (uint8_t)(int8_t)q;
            }
            o += 2 + nb;
        }
    }
}

void link_decode(enum link_dtype t, const uint8_t *src, size_t elems, size_t row, float *dst) {
    if (t == LINK_DTYPE_F32) {
        memcpy(dst, src, elems * sizeof(float));
        return;
    }
#if defined(__BYTE_ORDER__) && __BYTE_ORDER__ == __ORDER_LITTLE_ENDIAN__
    if (t == LINK_DTYPE_F16 && ((uintptr_t)src & 1) == 0) {
        dtype_fp16_to_f32_row((const fp16_t *)(const void *)src, dst, elems);
        return;
    }
#endif
    if (t == LINK_DTYPE_F16 || t == LINK_DTYPE_BF16) {
        for (size_t i = 0; i < elems; i++) {
            uint16_t h = (uint16_t)(src[2 * i] | src[2 * i + 1] << 8);
            dst[i] = t == LINK_DTYPE_F16 ? fp16_to_f32(h) : bf16_to_f32(h);
        }
        return;
    }
    const size_t rb = link_int8_row_bytes(row);
    for (size_t r = 0; r < elems / row; r++) {
        const uint8_t *in = src + r * rb;
        for (size_t b0 = 0; b0 < row; b0 += LINK_INT8_BLOCK) {
            const size_t nb = row - b0 < LINK_INT8_BLOCK ? row - b0 : LINK_INT8_BLOCK;
            const float scale = bf16_to_f32((uint16_t)(in[0] | in[1] << 8));
            for (size_t i = 0; i < nb; i++) dst[r * row + b0 + i] = (float)(int8_t)in[2 + i] * scale;
            in += 2 + nb;
        }
    }
}

int link_set_dtype(link_conn *l, enum link_dtype t, size_t row_elems) {
    if ((int)t < 0 || t >= LINK_DTYPE_N || row_elems == 0 || row_elems >= ((size_t)1 << 20))
        return link_fail(l, STATUS_BAD_INPUT, "%s link %s: element type %d for rows of %zu: need a "
                         "type of enum link_dtype and rows of 1 to 2^20 - 1 elements",
                         l->ops->kind, l->endpoint, (int)t, row_elems);
    if (!l->ops->set_dtype)
        return t == LINK_DTYPE_F32 ? STATUS_OK
                                   : link_fail(l, STATUS_UNSUPPORTED, "%s link: carries no %s",
                                               l->ops->kind, link_dtype_names[t]);
    return l->ops->set_dtype(l, t, row_elems);
}

uint64_t link_wire_bytes_sent(const link_conn *l) { return l->wire_sent; }
uint64_t link_dropped(const link_conn *l, enum link_drop why) {
    return (unsigned)why < LINK_DROP_N ? l->dropped[why] : 0;
}

const char *link_drop_name(enum link_drop why) {
    switch (why) {
    case LINK_DROP_MALFORMED: return "malformed";
    case LINK_DROP_STALE: return "stale";
    case LINK_DROP_AHEAD: return "ahead";
    default: return "unknown";
    }
}

int link_on_device(const link_conn *l) { return l->ops->on_device; }
const char *link_endpoint(const link_conn *l) { return l->endpoint; }
const char *link_kind(const link_conn *l) { return l->ops->kind; }
const char *link_errstr(const link_conn *l) { return l->errstr; }

void link_nccl_key(char *buf, size_t size, uint32_t pipeline_id, uint32_t link_index,
                   uint64_t epoch) {
    snprintf(buf, size, "llm:nccl:%u:%u:%llu", pipeline_id, link_index,
             (unsigned long long)epoch);
}
