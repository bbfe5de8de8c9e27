/* ZeroMQ helpers: a socket object that keeps err/errstr (messages name the
 * endpoint), multipart send and receive with timeouts, zero-copy frames for
 * large payloads (activations, logits), poll, and a free loopback port.
 *
 *   struct zio_sock *s;
 *   if (zio_sock_open(ctx, ZMQ_DEALER, &s, err, sizeof err) < 0) ...
 *   if (zio_connect(s, "tcp://router:5555") < 0) LOG(LL_ERROR, "%s", zio_errstr(s));
 *   struct zio_frame f[2] = {{hdr, hdr_len}, {buf, n, free_buf, pool}};
 *   zio_send(s, f, 2, 0);            // f[1] is not copied; free_buf(buf, pool) runs later
 *   struct zio_parts in = {0};
 *   int rc = zio_recv(s, &in, 1000); // STATUS_TIMEOUT after a second
 *   ... zio_parts_data(&in, 0), zio_parts_size(&in, 0) ...
 *   zio_parts_free(&in);
 *   zio_sock_close(s);
 *
 * A socket is used by one thread at a time (a ZeroMQ rule). */
#ifndef COMMON_ZIO_H
#define COMMON_ZIO_H

#include <stddef.h>
#include <stdint.h>
#include <zmq.h>

#include "keys.h"

struct zio_sock;

/* Frees a zero-copy frame's data once ZeroMQ is done with it; it may run on
 * a ZeroMQ I/O thread. */
typedef void (*zio_free_fn)(void *data, void *hint);

/* One frame to send.  With free_fn NULL the bytes are copied during the call
 * and stay the caller's; with free_fn set the frame is sent without copying,
 * and ZeroMQ owns data from the call on: free_fn(data, hint) runs once when
 * it is done, also when the send fails. */
struct zio_frame {
    const void *data;
    size_t size;
    zio_free_fn free_fn;
    void *hint;
};

/* Received frames.  Start from {0}; zio_recv refills it (freeing the old
 * frames); zio_parts_free releases the frames. */
struct zio_parts {
    size_t n, cap;
    zmq_msg_t *msgs;
};

/* Dead-peer bounds every socket but ZMQ_PAIR gets from zio_sock_open (a
 * caller may set others after it): a ZMTP PING every IVL, the connection
 * closed when nothing came for TIMEOUT after one (and the peer told to do
 * the same, ZMQ_HEARTBEAT_TTL); a TCP connect given up after
 * CONNECT_TIMEOUT and tried again.  A half-open connection is thus closed
 * within IVL + TIMEOUT (4 s).  docs/protocol.md, "Dead peers". */
#define ZIO_HEARTBEAT_IVL_MS 1000
#define ZIO_HEARTBEAT_TIMEOUT_MS 3000
#define ZIO_CONNECT_TIMEOUT_MS 2000

/* Opens a socket of a ZeroMQ type (ZMQ_ROUTER, ZMQ_DEALER, ...) on ctx with
 * linger set to 1000 ms, so that closing never hangs the process for long,
 * ZMQ_MAXMSGSIZE set to zio_max_msg_size(), and (but on ZMQ_PAIR) the
 * heartbeats and connect timeout above.
 * On failure *out is NULL and err holds the reason. */
int zio_sock_open(void *ctx, int type, struct zio_sock **out, char *err, size_t err_size);
/* Closes the socket; NULL is fine. */
void zio_sock_close(struct zio_sock *s);

/* 0 or a negative status; on failure errstr names the endpoint and the reason
 * ("bind tcp://127.0.0.1:99999: Invalid argument"). */
int zio_bind(struct zio_sock *s, const char *endpoint);
int zio_connect(struct zio_sock *s, const char *endpoint);
/* The endpoint of the last successful bind, with the port that "*" chose
 * ("tcp://127.0.0.1:40123"); empty before any bind. */
const char *zio_endpoint(const struct zio_sock *s);

/* zmq_setsockopt for an int option, errors naming the option number. */
int zio_set_int(struct zio_sock *s, int option, int value);
/* zmq_setsockopt for a byte option (ZMQ_ROUTING_ID, ZMQ_SUBSCRIBE). */
int zio_set_bytes(struct zio_sock *s, int option, const void *value, size_t size);

/* Sends n frames as one message.  flags: 0 (wait while the peer's queue is
 * full) or ZMQ_DONTWAIT (STATUS_EXHAUSTED when it is).  Ownership of the
 * zero-copy frames: see struct zio_frame. */
int zio_send(struct zio_sock *s, const struct zio_frame *frames, size_t n, int flags);

/* Receives one whole message into parts.  timeout_ms < 0 waits for ever;
 * 0 only takes a message that is already there.  Returns 0, STATUS_TIMEOUT
 * (parts then holds no frames), STATUS_CANCELLED when a signal interrupted
 * the wait or the context is being terminated (so a process can check its
 * shutdown flag), or another negative status. */
int zio_recv(struct zio_sock *s, struct zio_parts *parts, int timeout_ms);
const void *zio_parts_data(const struct zio_parts *p, size_t i);
size_t zio_parts_size(const struct zio_parts *p, size_t i);
void zio_parts_free(struct zio_parts *p);

/* Waits up to timeout_ms (< 0: for ever) until one of the n sockets has a
 * message (ZMQ_POLLIN) or room (ZMQ_POLLOUT) as asked in events[i]; fills
 * revents[i] and returns the number ready (0 on timeout) or a negative
 * status, with the reason in the first socket's errstr.  Interrupted waits
 * (EINTR) return 0. */
int zio_poll(struct zio_sock *const *socks, const short *events, short *revents, size_t n,
             int timeout_ms);

/* Waits on s (zio_recv, and zio_poll of a set holding it: the largest of
 * the set's) first poll without blocking for up to us microseconds of
 * their timeout, then block: a message that comes within that time is
 * taken without the wake-up of a blocked thread (tens of microseconds on
 * some hosts), at the cost of a busy core while it lasts.  0 (the
 * default): block at once.
 *
 * A wait spins only while s is busy: when s took a message (a zio_recv
 * that returned one, a zio_poll that found ZMQ_POLLIN on it) within the
 * last ZIO_SPIN_RECENT_US; otherwise it blocks at once, so that an idle
 * process does not keep a core busy.  A socket that has never received
 * does not spin until its first message. */
void zio_set_spin(struct zio_sock *s, int us);
/* How recent a message must be for a wait to spin: long enough to cover
 * the gap between a pipeline's steps under load (milliseconds), short
 * enough that an idle process stops polling within a fraction of a
 * second. */
#define ZIO_SPIN_RECENT_US 200000
/* The spin that --spin-us auto gives a GPU worker's waits, and the
 * router's while GPU workers serve: a GPU step at batch 1 takes about
 * 2 ms on an H200, and 3000 us cover it. */
#define ZIO_SPIN_US_GPU 3000

/* While a wait on s spins (zio_set_spin), keep the I/O thread of s's
 * context zctx awake: every 50 us the waiting thread sends an empty
 * message to itself through a pair of that context's sockets (an abstract
 * Unix socket of a random name).  ZeroMQ's I/O thread takes every message
 * off the network and is idle between a step's messages; on a virtual
 * machine a vCPU idle past its halt polling sleeps, and waking it costs
 * tens to hundreds of microseconds (docs/worker.md, "Polling before
 * blocking").  The pair is used by the thread that waits on s, so only
 * one thread may wait on s.  Returns 0 or a status (the reason in
 * zio_errstr); the sockets close with s. */
int zio_set_warm(struct zio_sock *s, void *zctx);
/* The ticks of s's waits that came back through the I/O thread so far. */
long zio_warm_ticks(const struct zio_sock *s);

int zio_err(const struct zio_sock *s);
const char *zio_errstr(const struct zio_sock *s);
/* The underlying ZeroMQ socket, for options and calls not wrapped here. */
void *zio_sock_raw(const struct zio_sock *s);

/* Finds a TCP port on 127.0.0.1 that is free now, by binding a socket to
 * tcp://127.0.0.1:* and reading ZMQ_LAST_ENDPOINT.  With ctx NULL a private
 * context is made and ended, so that the port is released before the call
 * returns (with a shared ctx ZeroMQ closes the listener a moment later, in
 * its I/O thread).  Another process may take the port before the caller
 * binds it: callers retry. */
int zio_free_port(void *ctx, int *port, char *err, size_t err_size);

/* --- Frame bound and CURVE security (docs/security.md) -------------------- */

/* The largest frame a socket opened from now on accepts (ZMQ_MAXMSGSIZE):
 * ZeroMQ drops a peer's connection as soon as a frame header announces more,
 * before any of it is allocated.  Process-wide, set once at start from
 * --max-msg-size; <= 0 means no bound.  Default ZIO_MAX_MSG_SIZE_DEFAULT. */
#define ZIO_MAX_MSG_SIZE_DEFAULT ((int64_t)64 << 20)
void zio_set_max_msg_size(int64_t bytes);
int64_t zio_max_msg_size(void);

/* Makes s a CURVE server with this secret key (before bind).  Peers are
 * then checked by the context's ZAP handler (zio_zap) under zap_domain.
 * 0 or a negative status with errstr. */
int zio_curve_server(struct zio_sock *s, const struct keys_pair *own, const char *zap_domain);
/* Makes s a CURVE client (before connect) that talks only to a server
 * holding the secret key of server_pub. */
int zio_curve_client(struct zio_sock *s, const struct keys_pair *own, const char *server_pub);

/* The User-Id the ZAP handler gave the connection a message came in on
 * ("name/<z85 key>", or "<z85 key>" for a key listed without a name), or ""
 * on a plain socket.  Valid while the parts are. */
const char *zio_parts_user_id(const struct zio_parts *p);
/* The Z85 public key in a User-Id (its last 40 characters), or "" when it
 * holds none. */
const char *zio_user_id_key(const char *user_id);

/* The ZAP handler of one ZeroMQ context: a thread with a REP socket on
 * inproc://zeromq.zap.01 that admits a CURVE peer only if its public key is
 * in the list of the socket's ZAP domain, and counts the refusals.  Lists
 * can be replaced at any time from any thread (a stage's link learns its
 * predecessor's key when the router places it).  A handshake in a domain
 * with no keys yet is held, unanswered, until the domain gets keys (at most
 * 64 are held; the peer's handshake timeout, ZMQ_HANDSHAKE_IVL, makes it
 * retry meanwhile): a refusal is final for a ZeroMQ peer, which never
 * reconnects after one, so a predecessor that connects before the router
 * named it must wait rather than be turned away.
 *
 *   zio_zap *z;
 *   zio_zap_start(ctx, &z, err, sizeof err);
 *   zio_zap_set(z, "clients", client_keys);   // copied
 *   zio_curve_server(sock, &kp, "clients"); zio_bind(sock, ...);
 *   ...
 *   zio_zap_stop(z);                          // before zmq_ctx_term(ctx) */
typedef struct zio_zap zio_zap;
int zio_zap_start(void *ctx, zio_zap **out, char *err, size_t errlen);
/* Stops the thread and closes its socket; NULL is fine. */
void zio_zap_stop(zio_zap *z);
/* Replaces the domain's admitted keys with a copy of l (NULL: none yet).
 * 0 or STATUS_NO_MEMORY / STATUS_BAD_INPUT (more than 16 domains). */
int zio_zap_set(zio_zap *z, const char *domain, const struct keys_list *l);
/* Admits exactly one key in the domain ("" or NULL: none yet), named name.
 * Such a domain holds a handshake with another key for up to 5 s before
 * refusing it: when the router re-places a stage, its new predecessor may
 * connect just before the stage learns the new key. */
int zio_zap_set_one(zio_zap *z, const char *domain, const char *pub, const char *name);
/* Handshakes refused and admitted in the domain so far. */
uint64_t zio_zap_refused(zio_zap *z, const char *domain);
uint64_t zio_zap_admitted(zio_zap *z, const char *domain);

#endif
