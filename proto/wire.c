/* Envelope packing and checked unpacking for both wire protocols, and the
 * error-reply helpers.  Both envelope types go through the same
 * descriptor-driven code, so the two sides cannot drift apart in what they
 * check. */
#include "proto/wire.h"

#include <stdatomic.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "common/status.h"
#include "common/unicode.h"

static _Atomic uint64_t wire_rejected;

/* A string nested deeper than this is not looked at but rejected: our schema
 * nests at most 5 levels, so deeper means a peer we do not understand. */
#define WIRE_DEPTH_MAX 16

/* Strict UTF-8: no overlong forms, no surrogates, nothing above U+10FFFF.
 * Returns the offset of the first bad byte, or -1 when s is valid. */
static long wire_utf8_bad(const char *s) {
    const unsigned char *p = (const unsigned char *)s;
    size_t i = 0;
    while (p[i]) {
        unsigned c = p[i];
        size_t n;
        unsigned lo = 0x80, hi = 0xbf; /* range of the second byte */
        if (c < 0x80) { i++; continue; }
        if (c >= 0xc2 && c <= 0xdf) n = 1;
        else if (c == 0xe0) { n = 2; lo = 0xa0; }
        else if (c == 0xed) { n = 2; hi = 0x9f; }
        else if (c >= 0xe1 && c <= 0xef) n = 2;
        else if (c == 0xf0) { n = 3; lo = 0x90; }
        else if (c >= 0xf1 && c <= 0xf3) n = 3;
        else if (c == 0xf4) { n = 3; hi = 0x8f; }
        else return (long)i;
        if (p[i + 1] < lo || p[i + 1] > hi) return (long)i;
        for (size_t k = 2; k <= n; k++)
            if (p[i + k] < 0x80 || p[i + k] > 0xbf) return (long)i;
        i += n + 1;
    }
    return -1;
}

/* Walks every set field of m; returns 0, or STATUS_PROTOCOL with err naming
 * the field (full protobuf name) and the byte offset of a non-UTF-8 string,
 * or the message that holds a field numbered 0. */
static int wire_check_strings(const ProtobufCMessage *m, int depth, char *err, size_t errlen) {
    const ProtobufCMessageDescriptor *d = m->descriptor;
    const char *base = (const char *)m;
    if (depth > WIRE_DEPTH_MAX)
        return status_fail(err, errlen, STATUS_PROTOCOL, "%s nested more than %d levels deep",
                           d->name, WIRE_DEPTH_MAX);
    /* Field number 0 does not exist, but protobuf-c keeps one that arrives
     * as an over-long tag among the unknown fields and packs it back as a
     * tag its own decoder refuses: a request accepted once would not decode
     * again from where the router stores it. */
    for (size_t i = 0; i < m->n_unknown_fields; i++)
        if (m->unknown_fields[i].tag == 0)
            return status_fail(err, errlen, STATUS_PROTOCOL, "%s has a field numbered 0",
                               d->name);
    for (unsigned i = 0; i < d->n_fields; i++) {
        const ProtobufCFieldDescriptor *f = &d->fields[i];
        if (f->type != PROTOBUF_C_TYPE_STRING && f->type != PROTOBUF_C_TYPE_MESSAGE) continue;
        if ((f->flags & PROTOBUF_C_FIELD_FLAG_ONEOF) &&
            *(const uint32_t *)(base + f->quantifier_offset) != f->id)
            continue;
        size_t n = 1;
        const void *const *items = (const void *const *)(base + f->offset);
        if (f->label == PROTOBUF_C_LABEL_REPEATED) {
            n = *(const size_t *)(base + f->quantifier_offset);
            items = *(const void *const *const *)(base + f->offset);
        }
        for (size_t k = 0; k < n; k++) {
            const void *item = items[k];
            if (!item) continue;
            if (f->type == PROTOBUF_C_TYPE_STRING) {
                long bad = wire_utf8_bad(item);
                if (bad >= 0)
                    return status_fail(err, errlen, STATUS_PROTOCOL, "field %s.%s: byte %ld "
                                       "(0x%02x) is not valid UTF-8", d->name, f->name, bad,
                                       ((const unsigned char *)item)[bad]);
            } else {
                int rc = wire_check_strings(item, depth + 1, err, errlen);
                if (rc < 0) return rc;
            }
        }
    }
    return 0;
}

static int wire_pack(ProtobufCMessage *m, const char *side, uint32_t body_case, uint8_t **buf,
                     size_t *len, char *err, size_t errlen) {
    *buf = NULL;
    *len = 0;
    if (body_case == 0)
        return status_fail(err, errlen, STATUS_BAD_INPUT, "%s envelope: no body set", side);
    size_t n = protobuf_c_message_get_packed_size(m);
    if (n > PROTO_FRAME_MAX)
        return status_fail(err, errlen, STATUS_BAD_INPUT, "%s envelope: %zu bytes exceeds the "
                           "frame limit of %zu", side, n, PROTO_FRAME_MAX);
    /* malloc(0) may return NULL; an envelope with a body is never empty, but
     * keep the buffer non-NULL regardless. */
    uint8_t *b = malloc(n ? n : 1);
    if (!b)
        return status_fail(err, errlen, STATUS_NO_MEMORY, "%s envelope: out of memory for %zu "
                           "bytes", side, n);
    size_t w = protobuf_c_message_pack(m, b);
    if (w != n) {
        free(b);
        return status_fail(err, errlen, STATUS_INTERNAL, "%s envelope: packed %zu bytes, "
                           "expected %zu", side, w, n);
    }
    *buf = b;
    *len = n;
    return 0;
}

int proto_client_pack(Llm__ClientEnvelope *env, uint8_t **buf, size_t *len, char *err,
                      size_t errlen) {
    env->version = PROTO_VERSION;
    return wire_pack(&env->base, "client", env->body_case, buf, len, err, errlen);
}

int proto_worker_pack(Llm__WorkerEnvelope *env, uint8_t **buf, size_t *len, char *err,
                      size_t errlen) {
    env->version = PROTO_VERSION;
    return wire_pack(&env->base, "worker", env->body_case, buf, len, err, errlen);
}

void proto_buf_free(void *data, void *hint) {
    (void)hint;
    free(data);
}

/* Shared by both envelope types: the version is field 1 and the body a oneof
 * in each, which the caller reads out after decoding. */
static int wire_unpack(const ProtobufCMessageDescriptor *desc, const char *side,
                       const uint8_t *buf, size_t len, ProtobufCMessage **out, char *err,
                       size_t errlen) {
    *out = NULL;
    int rc;
    if (len > PROTO_FRAME_MAX) {
        rc = status_fail(err, errlen, STATUS_PROTOCOL, "%s frame of %zu bytes exceeds the "
                         "limit of %zu", side, len, PROTO_FRAME_MAX);
        goto fail;
    }
    if (len == 0) {
        rc = status_fail(err, errlen, STATUS_PROTOCOL, "%s frame is empty", side);
        goto fail;
    }
    if (!buf) {
        rc = status_fail(err, errlen, STATUS_BAD_INPUT, "%s frame: NULL buffer of %zu bytes",
                         side, len);
        goto fail;
    }
    ProtobufCMessage *m = protobuf_c_message_unpack(desc, NULL, len, buf);
    if (!m) {
        rc = status_fail(err, errlen, STATUS_PROTOCOL, "%s frame of %zu bytes is not a valid %s "
                         "(protobuf decoding failed)", side, len, desc->name);
        goto fail;
    }
    /* Both envelopes: uint32 version then the body case, right after base. */
    uint32_t version, body_case;
    if (desc == &llm__client_envelope__descriptor) {
        version = ((Llm__ClientEnvelope *)m)->version;
        body_case = ((Llm__ClientEnvelope *)m)->body_case;
    } else {
        version = ((Llm__WorkerEnvelope *)m)->version;
        body_case = ((Llm__WorkerEnvelope *)m)->body_case;
    }
    if (version < PROTO_VERSION_MIN || version > PROTO_VERSION) {
        if (PROTO_VERSION_MIN == PROTO_VERSION)
            rc = status_fail(err, errlen, STATUS_PROTOCOL, "%s frame: protocol version %u is not "
                             "supported (this build speaks %u)", side, version, PROTO_VERSION);
        else
            rc = status_fail(err, errlen, STATUS_PROTOCOL, "%s frame: protocol version %u is not "
                             "supported (this build speaks %u..%u)", side, version,
                             PROTO_VERSION_MIN, PROTO_VERSION);
        goto fail_free;
    }
    if (body_case == 0) {
        rc = status_fail(err, errlen, STATUS_UNSUPPORTED, "%s frame of %zu bytes (version %u) "
                         "has no body: none was set, or a message type this build does not "
                         "know", side, len, version);
        goto fail_free;
    }
    char field_err[256];
    rc = wire_check_strings(m, 0, field_err, sizeof field_err);
    if (rc < 0) {
        status_fail(err, errlen, rc, "%s frame: %s", side, field_err);
        goto fail_free;
    }
    *out = m;
    return 0;
fail_free:
    protobuf_c_message_free_unpacked(m, NULL);
fail:
    atomic_fetch_add(&wire_rejected, 1);
    return rc;
}

int proto_client_unpack(const uint8_t *buf, size_t len, Llm__ClientEnvelope **env, char *err,
                        size_t errlen) {
    ProtobufCMessage *m;
    int rc = wire_unpack(&llm__client_envelope__descriptor, "client", buf, len, &m, err, errlen);
    *env = (Llm__ClientEnvelope *)m;
    return rc;
}

int proto_worker_unpack(const uint8_t *buf, size_t len, Llm__WorkerEnvelope **env, char *err,
                        size_t errlen) {
    ProtobufCMessage *m;
    int rc = wire_unpack(&llm__worker_envelope__descriptor, "worker", buf, len, &m, err, errlen);
    *env = (Llm__WorkerEnvelope *)m;
    return rc;
}

void proto_client_free(Llm__ClientEnvelope *env) {
    if (env) llm__client_envelope__free_unpacked(env, NULL);
}

void proto_worker_free(Llm__WorkerEnvelope *env) {
    if (env) llm__worker_envelope__free_unpacked(env, NULL);
}

uint64_t proto_frames_rejected(void) { return atomic_load(&wire_rejected); }

Llm__Error__Code proto_code_from_status(int status) {
    switch (status) {
    case STATUS_OK: return LLM__ERROR__CODE__OK;
    case STATUS_BAD_INPUT:
    case STATUS_PROTOCOL: return LLM__ERROR__CODE__INVALID_ARGUMENT;
    case STATUS_NOT_FOUND: return LLM__ERROR__CODE__NOT_FOUND;
    case STATUS_UNSUPPORTED: return LLM__ERROR__CODE__UNIMPLEMENTED;
    case STATUS_NO_MEMORY:
    case STATUS_EXHAUSTED: return LLM__ERROR__CODE__RESOURCE_EXHAUSTED;
    case STATUS_UNAVAILABLE: return LLM__ERROR__CODE__UNAVAILABLE;
    case STATUS_TIMEOUT: return LLM__ERROR__CODE__DEADLINE_EXCEEDED;
    case STATUS_CANCELLED: return LLM__ERROR__CODE__CANCELLED;
    case STATUS_IO:
    case STATUS_INTERNAL: return LLM__ERROR__CODE__INTERNAL;
    default: return LLM__ERROR__CODE__UNKNOWN;
    }
}

int proto_status_from_code(Llm__Error__Code code) {
    switch (code) {
    case LLM__ERROR__CODE__OK: return STATUS_OK;
    case LLM__ERROR__CODE__CANCELLED: return STATUS_CANCELLED;
    case LLM__ERROR__CODE__INVALID_ARGUMENT: return STATUS_BAD_INPUT;
    case LLM__ERROR__CODE__DEADLINE_EXCEEDED: return STATUS_TIMEOUT;
    case LLM__ERROR__CODE__NOT_FOUND: return STATUS_NOT_FOUND;
    case LLM__ERROR__CODE__RESOURCE_EXHAUSTED: return STATUS_EXHAUSTED;
    case LLM__ERROR__CODE__UNIMPLEMENTED: return STATUS_UNSUPPORTED;
    case LLM__ERROR__CODE__UNAVAILABLE: return STATUS_UNAVAILABLE;
    /* ALREADY_EXISTS, PERMISSION_DENIED, FAILED_PRECONDITION, ABORTED: the
     * request was well formed but cannot go on; the message says why. */
    case LLM__ERROR__CODE__ALREADY_EXISTS:
    case LLM__ERROR__CODE__PERMISSION_DENIED:
    case LLM__ERROR__CODE__FAILED_PRECONDITION: return STATUS_BAD_INPUT;
    case LLM__ERROR__CODE__ABORTED: return STATUS_CANCELLED;
    default: return STATUS_INTERNAL;
    }
}

const char *proto_code_name(Llm__Error__Code code) {
    const ProtobufCEnumValue *v =
        protobuf_c_enum_descriptor_get_value(&llm__error__code__descriptor, (int)code);
    return v ? v->name : "UNKNOWN_CODE";
}

void proto_error_init(Llm__Error *e, Llm__Error__Code code, const char *request_id,
                      const char *message, uint32_t retry_after_ms) {
    llm__error__init(e);
    e->code = code;
    /* Readers of our messages expect "" for an absent string, never NULL. */
    e->request_id = (char *)(request_id ? request_id : "");
    e->message = (char *)(message ? message : "");
    e->retry_after_ms = retry_after_ms;
}

char *proto_error_text(const char *message) {
    char *whole = strdup(message ? message : "");
    if (whole) unicode_utf8_mend(whole);
    return whole;
}

int proto_client_error_pack(uint64_t tag, Llm__Error__Code code, const char *request_id,
                            const char *message, uint32_t retry_after_ms, uint8_t **buf,
                            size_t *len) {
    char *whole = proto_error_text(message);
    if (!whole) return STATUS_NO_MEMORY;
    Llm__Error e;
    Llm__ClientEnvelope env = LLM__CLIENT_ENVELOPE__INIT;
    proto_error_init(&e, code, request_id, whole, retry_after_ms);
    env.tag = tag;
    env.body_case = LLM__CLIENT_ENVELOPE__BODY_ERROR;
    env.error = &e;
    int rc = proto_client_pack(&env, buf, len, NULL, 0);
    free(whole);
    return rc;
}

int proto_worker_error_pack(Llm__Error__Code code, const char *request_id, const char *message,
                            uint32_t retry_after_ms, uint8_t **buf, size_t *len) {
    char *whole = proto_error_text(message);
    if (!whole) return STATUS_NO_MEMORY;
    Llm__Error e;
    Llm__WorkerEnvelope env = LLM__WORKER_ENVELOPE__INIT;
    proto_error_init(&e, code, request_id, whole, retry_after_ms);
    env.body_case = LLM__WORKER_ENVELOPE__BODY_ERROR;
    env.error = &e;
    int rc = proto_worker_pack(&env, buf, len, NULL, 0);
    free(whole);
    return rc;
}

int proto_request_id_check(const char *id, char *err, size_t errlen) {
    if (!id) return status_fail(err, errlen, STATUS_BAD_INPUT, "request_id is missing");
    size_t n = strlen(id);
    if (n == 0 || n > PROTO_REQUEST_ID_MAX)
        return status_fail(err, errlen, STATUS_BAD_INPUT, "request_id has %zu bytes, must have "
                           "1..%d", n, PROTO_REQUEST_ID_MAX);
    for (size_t i = 0; i < n; i++) {
        unsigned char c = (unsigned char)id[i];
        if (c < 0x21 || c > 0x7e)
            return status_fail(err, errlen, STATUS_BAD_INPUT, "request_id byte %zu is 0x%02x, "
                               "must be printable ASCII (0x21..0x7e)", i, c);
    }
    return 0;
}
