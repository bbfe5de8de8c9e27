/* Envelope helpers for the cluster's two wire protocols: a ClientEnvelope
 * between clients and the router, a WorkerEnvelope between the router and
 * its workers.  Pack stamps the protocol version; unpack checks size,
 * decoding, version, body and UTF-8 before a process looks at a frame, so a
 * bad frame becomes an error reply and never a crash. */
#ifndef PROTO_WIRE_H
#define PROTO_WIRE_H

#include <stddef.h>
#include <stdint.h>

#include "proto/client.pb-c.h"
#include "proto/cluster.pb-c.h"
#include "proto/types.pb-c.h"

/* Version this build writes into every envelope.  Unpack accepts versions
 * PROTO_VERSION_MIN..PROTO_VERSION.  New fields and new message types are
 * compatible changes and do not bump it (proto3 skips unknown fields; an
 * unknown body reads as "no body"); a change of meaning does. */
#define PROTO_VERSION 1u
#define PROTO_VERSION_MIN 1u
/* Largest frame either side packs or unpacks (64 MiB): a longer one is
 * rejected before decoding, so a hostile length cannot make us allocate. */
#define PROTO_FRAME_MAX ((size_t)64 << 20)
/* Client request ids: 1..PROTO_REQUEST_ID_MAX bytes of printable ASCII. */
#define PROTO_REQUEST_ID_MAX 128
/* The router's name of one choice of a request of n > 1: the client's id,
 * then " <choice>" for choices 1.. (a space, which no client id holds;
 * docs/protocol.md, "Several choices").  Room for that suffix. */
#define PROTO_REQUEST_KEY_MAX (PROTO_REQUEST_ID_MAX + 8)

/* --- Packing ---------------------------------------------------------------
 * Sets env->version to PROTO_VERSION and packs env into a new buffer.
 * On success returns 0, *buf is malloc'd and owned by the caller (free() it,
 * or hand it to zmq_msg_init_data(msg, buf, len, proto_buf_free, NULL) to
 * send without a copy) and *len is its size.  env stays the caller's.
 * On failure (no body set: STATUS_BAD_INPUT; larger than PROTO_FRAME_MAX:
 * STATUS_BAD_INPUT; out of memory: STATUS_NO_MEMORY) *buf is NULL, *len 0
 * and err (may be NULL) says why. */
int proto_client_pack(Llm__ClientEnvelope *env, uint8_t **buf, size_t *len, char *err,
                      size_t errlen);
int proto_worker_pack(Llm__WorkerEnvelope *env, uint8_t **buf, size_t *len, char *err,
                      size_t errlen);
/* free(data); has the signature of zmq_free_fn. */
void proto_buf_free(void *data, void *hint);

/* --- Unpacking -------------------------------------------------------------
 * Decodes len bytes (buf may be NULL when len is 0; it is not kept).
 * On success returns 0 and *env is a decoded envelope the caller frees with
 * proto_client_free / proto_worker_free; every string in it is valid UTF-8
 * and the body is set.  On failure *env is NULL, nothing is to be freed,
 * err names the side, the size or the version, and the result is:
 *   STATUS_PROTOCOL     empty, larger than PROTO_FRAME_MAX, not a valid protobuf
 *                       envelope, a version outside PROTO_VERSION_MIN..
 *                       PROTO_VERSION, or a string that is not UTF-8;
 *   STATUS_UNSUPPORTED  no body: a message type this build does not know
 *                       (a newer peer) or none at all.
 * Every failure also counts in proto_frames_rejected(). */
int proto_client_unpack(const uint8_t *buf, size_t len, Llm__ClientEnvelope **env, char *err,
                        size_t errlen);
int proto_worker_unpack(const uint8_t *buf, size_t len, Llm__WorkerEnvelope **env, char *err,
                        size_t errlen);
/* Only for envelopes from *_unpack; NULL is fine. */
void proto_client_free(Llm__ClientEnvelope *env);
void proto_worker_free(Llm__WorkerEnvelope *env);

/* Frames this process has refused to unpack since it started (all threads). */
uint64_t proto_frames_rejected(void);

/* --- Errors ----------------------------------------------------------------
 * Status codes (common/status.h) and the wire's gRPC-style codes, both ways:
 * STATUS_BAD_INPUT and STATUS_PROTOCOL <-> INVALID_ARGUMENT, STATUS_NOT_FOUND
 * <-> NOT_FOUND, STATUS_UNSUPPORTED <-> UNIMPLEMENTED, STATUS_NO_MEMORY and
 * STATUS_EXHAUSTED <-> RESOURCE_EXHAUSTED, STATUS_UNAVAILABLE <-> UNAVAILABLE,
 * STATUS_TIMEOUT <-> DEADLINE_EXCEEDED, STATUS_CANCELLED <-> CANCELLED,
 * STATUS_IO and STATUS_INTERNAL <-> INTERNAL; 0 <-> OK; anything else
 * -> UNKNOWN / STATUS_INTERNAL. */
Llm__Error__Code proto_code_from_status(int status);
int proto_status_from_code(Llm__Error__Code code);
/* "INVALID_ARGUMENT"; "UNKNOWN_CODE" for a value outside the enum.  Static. */
const char *proto_code_name(Llm__Error__Code code);

/* Fills *e, which the caller owns (a stack variable is fine): nothing is
 * allocated or copied, so request_id and message (NULL = "") must outlive
 * every use of *e. */
void proto_error_init(Llm__Error *e, Llm__Error__Code code, const char *request_id,
                      const char *message, uint32_t retry_after_ms);
/* A malloc'd copy of message (NULL = "") in whole UTF-8 characters, or
 * NULL out of memory: messages quote a peer's text cut at a length limit
 * ("%.128s"), and a reply that is not UTF-8 is refused by its reader
 * (proto_*_unpack) instead of read.  The packers below use it; so does a
 * caller that fills an Error itself. */
char *proto_error_text(const char *message);
/* Packs an envelope whose body is that Error (its message as
 * proto_error_text makes it), as proto_client_pack does
 * (the client one echoes tag).  The usual reply to a frame that failed to
 * unpack: proto_client_error_pack(0, proto_code_from_status(rc), "", err, 0, &buf, &len). */
int proto_client_error_pack(uint64_t tag, Llm__Error__Code code, const char *request_id,
                            const char *message, uint32_t retry_after_ms, uint8_t **buf,
                            size_t *len);
int proto_worker_error_pack(Llm__Error__Code code, const char *request_id, const char *message,
                            uint32_t retry_after_ms, uint8_t **buf, size_t *len);

/* 0 if id is a valid client request id (1..PROTO_REQUEST_ID_MAX bytes,
 * 0x21..0x7e), else STATUS_BAD_INPUT with err naming the length or the
 * offending byte and its offset. */
int proto_request_id_check(const char *id, char *err, size_t errlen);

#endif
