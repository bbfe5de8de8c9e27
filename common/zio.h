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

/* Opens a socket of a ZeroMQ type (ZMQ_ROUTER, ZMQ_DEALER, ...) on ctx with
 * linger set to 1000 ms, so that closing never hangs the process for long.
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

#endif
