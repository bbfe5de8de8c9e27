/* The stage-to-stage transport: one directed link k -> k+1 carries each
 * step's hidden states from a stage to the next.  One interface, two
 * implementations: ZeroMQ (PUSH -> PULL over TCP, host buffers; the CPU
 * backend) and NCCL (a 2-rank communicator per link, device buffers on the
 * backend's stream; GPUs).  Both sides execute the same step plans in the
 * same order, so a message is matched to its step by the step id.
 *
 *   link_conn *rx;   // stage k+1: binds where stage k connects
 *   link_zmq_init(&rx, ctx, LINK_RECV, "tcp://127.0.0.1:*", 10000, err, sizeof err);
 *   ... register link_endpoint(rx) ...
 *   rc = link_recv(rx, step_id, hidden, bytes);   // 0, LINK_SKIPPED or < 0
 *   link_free(rx);
 *
 * A link is used by one thread at a time. */
#ifndef WORKER_LINK_H
#define WORKER_LINK_H

#include <stddef.h>
#include <stdint.h>

#include "common/keys.h"
#include "kernels/backend.h"

typedef struct link_conn link_conn;

enum link_dir {
    LINK_SEND = 0, /* this stage is k: it sends to k+1 */
    LINK_RECV = 1, /* this stage is k+1: it receives from k */
};

/* link_recv's result when the sender marked the step as failed upstream
 * (link_send with buf NULL): the receiver skips the step too. */
#define LINK_SKIPPED 1

/* The element type of the hidden states on the wire (--link-dtype).  The
 * stages compute F32 rows; a link converts them to its type on the way out
 * and back to F32 on the way in, on either transport (link_encode and
 * link_decode below, and their GPU twins in kernels/cuda/link_codec.h).
 * INT8 carries each block of LINK_INT8_BLOCK values of a row (the last
 * may be shorter) as one scale (the block's max |x| / 127 rounded to BF16)
 * and its values rounded to int8: 34 bytes for 32 values, 17/32 of F16's.  A scale a
 * block instead of a row keeps one large value (a transformer's hidden
 * states have a few channels far above the rest) from coarsening the
 * whole row's steps.  On ZeroMQ each message names its type, so a receiver reads
 * whatever its sender chose; NCCL carries no header, so both ends of an
 * NCCL link are given the type and check in Redis that they agree
 * (link_nccl_init). */
enum link_dtype {
    LINK_DTYPE_F32 = 0,
    LINK_DTYPE_F16 = 1,
    LINK_DTYPE_BF16 = 2,
    LINK_DTYPE_INT8 = 3,
    LINK_DTYPE_N = 4,
};
#define LINK_INT8_BLOCK 32
/* Wire bytes of one INT8 row of row_elems values. */
static inline size_t link_int8_row_bytes(size_t row_elems) {
    return row_elems + 2 * ((row_elems + LINK_INT8_BLOCK - 1) / LINK_INT8_BLOCK);
}
/* "f32", "f16", "bf16", "int8", NULL: indexed by enum link_dtype. */
extern const char *const link_dtype_names[];
/* Bytes on the wire for `bytes` of F32 rows of row_elems elements. */
size_t link_dtype_wire_bytes(enum link_dtype t, size_t bytes, size_t row_elems);

/* The wire's encoding, shared by both transports (host memory): elems F32
 * values (whole rows of row_elems for INT8) into the
 * link_dtype_wire_bytes(t, elems * 4, row_elems) bytes at dst, little-endian;
 * and back.  F16 and BF16 round to nearest even; INT8 rounds x / scale
 * half away from zero (x times the scale's F32 reciprocal) and clamps to
 * +-127.  dst may have any alignment. */
void link_encode(enum link_dtype t, const float *src, size_t elems, size_t row_elems, uint8_t *dst);
void link_decode(enum link_dtype t, const uint8_t *src, size_t elems, size_t row_elems, float *dst);

/* ZeroMQ.  LINK_RECV binds a PULL socket at endpoint ("tcp://host:port",
 * "tcp://127.0.0.1:*" picks a port; link_endpoint says which); LINK_SEND
 * connects a PUSH socket to it.  timeout_ms (> 0) bounds every send and
 * every receive, so a peer that is gone gives STATUS_TIMEOUT, not a hang.
 * ctx is the caller's ZeroMQ context and must outlive the link.  Returns 0
 * and *out (freed with link_free), or a negative status with err naming the
 * endpoint (*out NULL). */
int link_zmq_init(link_conn **out, void *ctx, enum link_dir dir, const char *endpoint,
                  int timeout_ms, char *err, size_t errlen);

/* The ZAP domain of the links' listeners: the worker admits in it only the
 * public key of the stage the router placed before it (zio_zap_set_one). */
#define LINK_ZAP_DOMAIN "link"

/* link_zmq_init with CURVE (docs/security.md): own is this worker's key
 * pair.  LINK_RECV listens as a CURVE server in LINK_ZAP_DOMAIN, so the
 * context's ZAP handler (common/zio.h) decides who may send; peer_key is
 * unused.  LINK_SEND connects as a client that talks only to the holder of
 * peer_key, the next stage's public key.  own NULL: link_zmq_init. */
int link_zmq_init_curve(link_conn **out, void *ctx, enum link_dir dir, const char *endpoint,
                        int timeout_ms, const struct keys_pair *own, const char *peer_key, char *err,
                        size_t errlen);

/* NCCL: the link between stage k (LINK_SEND, rank 0) and k+1 (LINK_RECV,
 * rank 1) over a 2-rank communicator of its own.  The sender creates the
 * ncclUniqueId and publishes it in Redis under nccl_key (see
 * link_nccl_key) with its element type; the receiver waits for it and
 * answers with its own (link_nccl_exchange).  b must be a CUDA backend:
 * the link works on its device and queues the encoding, ncclSend/ncclRecv
 * and the decoding on its stream, so buffers are device memory (F32 rows,
 * as on ZeroMQ) and nothing synchronizes.  redis is a struct rconn
 * (common/rconn.h), used only during the call.  timeout_ms bounds the
 * exchange and the wait for the peer to join.  STATUS_UNSUPPORTED when
 * built without NCCL or b is not a CUDA backend; STATUS_BAD_INPUT (err
 * naming both types) when the two ends were given different types or row
 * widths. */
struct link_nccl_opts {
    enum link_dtype dtype; /* on the wire; both ends must be given the same */
    size_t row_elems;      /* floats per row (the model's width); 1 to 2^20 - 1 */
    size_t bytes_max;      /* the largest send or receive (F32 bytes): sizes the staging buffer */
    int timeout_ms;
};
int link_nccl_init(link_conn **out, backend *b, enum link_dir dir, void *redis,
                   const char *nccl_key, const struct link_nccl_opts *opts, char *err, size_t errlen);
/* The Redis half of link_nccl_init, which needs no GPU.  The sender
 * publishes id (LINK_NCCL_ID_BYTES) with t and row_elems under nccl_key,
 * then waits for the receiver's answer under "<nccl_key>:rx"; the receiver
 * waits for the id (copied into id), then publishes its own t and
 * row_elems.  Each end then compares: STATUS_BAD_INPUT, err naming both
 * types and widths, when they differ, so both stages fail with the reason
 * instead of one timing out or reading garbage.  STATUS_TIMEOUT when the
 * peer does not come within timeout_ms, STATUS_PROTOCOL for a value that
 * is not an id with a type. */
#define LINK_NCCL_ID_BYTES 128
int link_nccl_exchange(void *redis, const char *nccl_key, enum link_dir dir, uint8_t *id,
                       enum link_dtype t, size_t row_elems, int timeout_ms, char *err, size_t errlen);
/* The Redis key of link k of a pipeline in an epoch:
 * "llm:nccl:<pipeline>:<link>:<epoch>". */
void link_nccl_key(char *buf, size_t size, uint32_t pipeline_id, uint32_t link_index,
                   uint64_t epoch);

/* Frees the link and its sockets or communicator; NULL is fine. */
void link_free(link_conn *l);

/* Sends bytes of buf as step step_id's message (copied, or queued on the
 * device stream: buf may be reused once the call returns on ZeroMQ, once the
 * stream passes the send on NCCL).  buf NULL (bytes 0) on ZeroMQ tells the
 * receiver the step failed here (it gets LINK_SKIPPED).  Returns 0,
 * STATUS_TIMEOUT when the peer does not take it in time, STATUS_CANCELLED
 * when link_set_abort's generation moved meanwhile, or another negative
 * status (link_errstr says why). */
int link_send(link_conn *l, uint64_t step_id, const void *buf, size_t bytes);

/* Receives step step_id's message into buf, which must be exactly bytes
 * long.  Messages of earlier steps (of a dropped plan) are discarded;
 * messages of a later step are kept for their own call.  Returns 0, or
 * LINK_SKIPPED (buf untouched) when the sender failed the step, or
 * STATUS_TIMEOUT (nothing within the link's timeout), STATUS_NOT_FOUND (the
 * sender went on to a later step, or is at a later epoch and the step did
 * not come within a short grace: this one will never come),
 * STATUS_PROTOCOL (the step's own message has a size other than bytes), or
 * STATUS_CANCELLED (a signal interrupted the wait, or on ZeroMQ
 * link_set_abort's generation moved meanwhile: the wait goes in slices of
 * 100 ms for it).  A malformed message
 * (anything an admitted peer may send that is not a link message) is
 * dropped and counted (link_dropped), and the wait goes on: it never fails
 * the step by itself; the timeout bounds the whole call. */
int link_recv(link_conn *l, uint64_t step_id, void *buf, size_t bytes);

/* A send of the ZeroMQ transport waiting for room (its next stage gone or
 * slow), or a receive waiting for its step, gives up with STATUS_CANCELLED
 * as soon as *gen differs from its value when the call began.  The node bumps it when the router sends a
 * new placement, so a stage whose next stage died does not wait out the
 * link timeout on a step the new placement replaces before it can apply
 * that placement.  gen (NULL: none) must outlive the link. */
void link_set_abort(link_conn *l, const _Atomic uint64_t *gen);

/* Messages from another epoch of the pipeline are stale: after
 * link_set_epoch a receiver drops those of older epochs, and senders stamp
 * theirs with it.  Starts at 0. */
void link_set_epoch(link_conn *l, uint64_t epoch);

/* Sets what a ZeroMQ sender puts on the wire; rows are row_elems floats
 * (the model's width; every send is then whole rows).  A ZeroMQ link
 * starts at LINK_DTYPE_F32.  An NCCL link's type is fixed at
 * link_nccl_init: STATUS_UNSUPPORTED for any other type or width there.
 * STATUS_BAD_INPUT for row_elems 0 or past 2^20. */
int link_set_dtype(link_conn *l, enum link_dtype t, size_t row_elems);
/* Bytes this end has put on the wire (ZeroMQ payloads with their headers,
 * NCCL payloads). */
uint64_t link_wire_bytes_sent(const link_conn *l);

/* Why a receiver dropped a message instead of returning it (ZeroMQ; NCCL
 * carries no framing and drops nothing).  None of them fails a step: the
 * receiver goes on waiting for the step's own message until its timeout. */
enum link_drop {
    LINK_DROP_MALFORMED = 0, /* not a link message: frame count, header size, magic or body size */
    LINK_DROP_STALE = 1,     /* an older epoch, or a step before the one awaited (a dropped plan) */
    LINK_DROP_AHEAD = 2,     /* too far ahead of the awaited step, or a later-epoch message replaced */
    LINK_DROP_N = 3,
};
/* Messages dropped for that reason since the link was made. */
uint64_t link_dropped(const link_conn *l, enum link_drop why);
/* "malformed", "stale" or "ahead" (the metric's label). */
const char *link_drop_name(enum link_drop why);

/* 1 if send/recv take device (backend) memory, 0 for host memory. */
int link_on_device(const link_conn *l);
/* The bound endpoint (receiver) or the peer's (sender); "" for NCCL. */
const char *link_endpoint(const link_conn *l);
/* "zmq" or "nccl". */
const char *link_kind(const link_conn *l);
/* Why the last call failed. */
const char *link_errstr(const link_conn *l);

#endif
