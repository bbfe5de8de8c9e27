/* Status codes shared by every module: 0 for success, a negative STATUS_*
 * for failure, and status_str() to turn one into text.  Functions that can
 * fail return one of these; details go into the caller's error buffer or the
 * object's errstr. */
#ifndef COMMON_STATUS_H
#define COMMON_STATUS_H

#include <stdarg.h>
#include <stddef.h>

enum status {
    STATUS_OK = 0,
    STATUS_BAD_INPUT = -1,    /* malformed input from outside: a file, a client, a flag */
    STATUS_NOT_FOUND = -2,    /* a named thing (file, key, tensor, request) is absent */
    STATUS_UNSUPPORTED = -3,  /* well-formed, but a type or feature we do not handle */
    STATUS_IO = -4,           /* the operating system refused (open, read, mmap, socket) */
    STATUS_NO_MEMORY = -5,    /* host or device allocation failed */
    STATUS_PROTOCOL = -6,     /* a peer broke the wire protocol (version, framing) */
    STATUS_UNAVAILABLE = -7,  /* a service (Redis, a worker, the GPU) cannot be reached */
    STATUS_TIMEOUT = -8,      /* a deadline passed */
    STATUS_CANCELLED = -9,    /* the caller asked to stop */
    STATUS_EXHAUSTED = -10,   /* a bounded resource is full (queue, KV blocks) */
    STATUS_INTERNAL = -11,    /* a bug or a failure of a library we call (CUDA, NCCL) */
};
#define STATUS_COUNT 12

/* Text for a status code ("bad input", ...); never NULL, also for unknown codes. */
const char *status_str(int code);

/* Formats a message into the caller's error buffer and returns status, so
 * that a failure path is one statement:
 *     return status_fail(err, errlen, STATUS_BAD_INPUT, "%s: n = %d", path, n);
 * err may be NULL or errlen 0 (the message is then dropped); the message is
 * truncated to errlen - 1 bytes and always NUL-terminated. */
int status_fail(char *err, size_t errlen, int status, const char *fmt, ...)
    __attribute__((format(printf, 4, 5)));

/* status_fail with a va_list, for helpers that write into an object's errstr
 * and do more on failure. */
int status_vfail(char *err, size_t errlen, int status, const char *fmt, va_list ap)
    __attribute__((format(printf, 4, 0)));

#endif
