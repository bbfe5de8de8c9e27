/* The body of a Redis connection and its one call path, shared by rconn.c
 * (connecting, the call path), rconn_cmd.c (the typed command helpers) and
 * rconn_url.c (redis:// URLs, password files).  Not part of the API: use
 * rconn.h. */
#ifndef COMMON_RCONN_IMPL_H
#define COMMON_RCONN_IMPL_H

#include "rconn.h"

struct rconn {
    redisContext *ctx; /* NULL while disconnected */
    char host[256];
    int port;
    int db;
    char *user;     /* NULL: AUTH with the password alone (the "default" user) */
    char *password; /* NULL: no AUTH; wiped before it is freed */
    int timeout_ms;
    int err;
    char errstr[512];
    char addr[300]; /* "host:port" */
};

/* err = code, errstr = "redis host:port: " and the formatted message. */
void rconn_seterr(struct rconn *c, int code, const char *fmt, ...)
    __attribute__((format(printf, 3, 4)));
/* err = 0, errstr = "". */
void rconn_ok(struct rconn *c);
/* The command's name and first argument into buf, for messages. */
void rconn_describe(int argc, const char **argv, const size_t *argvlen, char *buf, size_t size);
/* Sends argv (argvlen NULL: strlen) and waits for the reply, reconnecting
 * first if needed.  what names the command in messages (NULL: described from
 * argv); extra_ms > 0 widens the reply timeout.  On success *reply is the
 * caller's to free; on any failure (an error reply included) it is NULL and
 * err/errstr say why. */
int rconn_call(struct rconn *c, const char *what, int extra_ms, redisReply **reply, int argc,
               const char **argv, const size_t *argvlen);
/* Zeroes the NUL-terminated string p, then frees it; NULL is fine. */
void rconn_wipe_free(char *p);

#endif
