/* Redis connection over hiredis: connecting (AUTH, SELECT, reconnecting) and
 * the one call path every command takes (reconnect if the server closed us,
 * send, map hiredis and Redis errors to statuses and messages naming
 * host:port and the command), with the generic and pipelined calls on it.
 * The typed helpers that copy replies into plain structs are in
 * rconn_cmd.c; redis:// URLs and password files in rconn_url.c. */
#include "rconn.h"
#include "rconn-impl.h"

#include "log.h"
#include "status.h"

#include <ctype.h>
#include <errno.h>
#include <poll.h>
#include <signal.h>
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/socket.h>
#include <sys/time.h>

void rconn_seterr(struct rconn *c, int code, const char *fmt, ...) {
    c->err = code;
    int n = snprintf(c->errstr, sizeof c->errstr, "redis %s: ", c->addr);
    va_list ap;
    va_start(ap, fmt);
    if (n > 0 && (size_t)n < sizeof c->errstr) vsnprintf(c->errstr + n, sizeof c->errstr - (size_t)n, fmt, ap);
    va_end(ap);
}

void rconn_ok(struct rconn *c) {
    c->err = 0;
    c->errstr[0] = '\0';
}

static struct timeval rconn_tv(int ms) {
    struct timeval tv = {ms / 1000, (ms % 1000) * 1000};
    return tv;
}

static void rconn_drop(struct rconn *c) {
    if (c->ctx) redisFree(c->ctx);
    c->ctx = NULL;
}

/* Connects (again); on failure err/errstr name the step. */
static int rconn_connect(struct rconn *c) {
    rconn_drop(c);
    redisContext *ctx = redisConnectWithTimeout(c->host, c->port, rconn_tv(c->timeout_ms));
    if (!ctx) {
        rconn_seterr(c, STATUS_NO_MEMORY, "connect: out of memory");
        return c->err;
    }
    if (ctx->err) {
        rconn_seterr(c, STATUS_UNAVAILABLE, "connect: %s", ctx->errstr);
        redisFree(ctx);
        return c->err;
    }
    redisSetTimeout(ctx, rconn_tv(c->timeout_ms));
    redisEnableKeepAlive(ctx);
    c->ctx = ctx;
    if (c->password) {
        /* Argument vector, never a format string: the password may hold any byte. */
        const char *argv[3] = {"AUTH", c->user ? c->user : c->password, c->password};
        redisReply *r = redisCommandArgv(ctx, c->user ? 3 : 2, argv, NULL);
        if (!r || r->type == REDIS_REPLY_ERROR) {
            /* Redis's refusal ("WRONGPASS invalid username-password pair")
             * never echoes the password, and neither does this message. */
            if (c->user)
                rconn_seterr(c, r ? STATUS_BAD_INPUT : STATUS_UNAVAILABLE, "AUTH as user '%s': %s",
                             c->user, r ? r->str : ctx->errstr);
            else
                rconn_seterr(c, r ? STATUS_BAD_INPUT : STATUS_UNAVAILABLE, "AUTH: %s",
                             r ? r->str : ctx->errstr);
            if (r) freeReplyObject(r);
            rconn_drop(c);
            return c->err;
        }
        freeReplyObject(r);
    }
    if (c->db != 0) {
        redisReply *r = redisCommand(ctx, "SELECT %d", c->db);
        if (!r || r->type == REDIS_REPLY_ERROR) {
            rconn_seterr(c, r ? STATUS_BAD_INPUT : STATUS_UNAVAILABLE, "SELECT %d: %s", c->db,
                         r ? r->str : ctx->errstr);
            if (r) freeReplyObject(r);
            rconn_drop(c);
            return c->err;
        }
        freeReplyObject(r);
    }
    rconn_ok(c);
    return 0;
}

int rconn_reconnect(struct rconn *c) { return rconn_connect(c); }

void rconn_wipe_free(char *p) {
    if (!p) return;
    for (volatile char *v = p; *v; v++) *v = 0;
    free(p);
}

static void rconn_free(struct rconn *c) {
    rconn_drop(c);
    free(c->user);
    rconn_wipe_free(c->password);
    free(c);
}

int rconn_open(const char *host, int port, int db, int timeout_ms, struct rconn **out, char *err,
               size_t err_size) {
    return rconn_open_auth(host, port, db, NULL, NULL, timeout_ms, out, err, err_size);
}

int rconn_open_auth(const char *host, int port, int db, const char *user, const char *password,
                    int timeout_ms, struct rconn **out, char *err, size_t err_size) {
    *out = NULL;
    if (!host || !*host || port <= 0 || port > 65535 || db < 0) {
        snprintf(err, err_size, "redis %s:%d db %d: bad address", host ? host : "(null)", port, db);
        return STATUS_BAD_INPUT;
    }
    if (user && *user && (!password || !*password)) {
        snprintf(err, err_size, "redis %s:%d: user '%s' has no password (give one in the URL or a "
                 "password file)", host, port, user);
        return STATUS_BAD_INPUT;
    }
    struct sigaction sa;
    if (sigaction(SIGPIPE, NULL, &sa) == 0 && sa.sa_handler == SIG_DFL && !(sa.sa_flags & SA_SIGINFO))
        signal(SIGPIPE, SIG_IGN);
    struct rconn *c = calloc(1, sizeof *c);
    if (!c) {
        snprintf(err, err_size, "redis %s:%d: out of memory", host, port);
        return STATUS_NO_MEMORY;
    }
    snprintf(c->host, sizeof c->host, "%s", host);
    c->port = port;
    c->db = db;
    c->timeout_ms = timeout_ms > 0 ? timeout_ms : 5000;
    snprintf(c->addr, sizeof c->addr, "%s:%d", c->host, port);
    if (password && *password) {
        c->password = strdup(password);
        c->user = user && *user ? strdup(user) : NULL;
        if (!c->password || (user && *user && !c->user)) {
            snprintf(err, err_size, "redis %s:%d: out of memory", host, port);
            rconn_free(c);
            return STATUS_NO_MEMORY;
        }
    }
    int rc = rconn_connect(c);
    if (rc < 0) {
        snprintf(err, err_size, "%s", c->errstr);
        rconn_free(c);
        return rc;
    }
    *out = c;
    return 0;
}

void rconn_close(struct rconn *c) {
    if (c) rconn_free(c);
}

int rconn_err(const struct rconn *c) { return c->err; }
const char *rconn_errstr(const struct rconn *c) { return c->errstr; }
const char *rconn_addr(const struct rconn *c) { return c->addr; }

/* True if the server has closed the connection (or sent bytes nobody asked
 * for): outside pub/sub Redis only ever writes replies to requests. */
static int rconn_stale(struct rconn *c) {
    struct pollfd pfd = {c->ctx->fd, POLLIN, 0};
    if (poll(&pfd, 1, 0) <= 0) return 0;
    char b;
    ssize_t n = recv(c->ctx->fd, &b, 1, MSG_PEEK | MSG_DONTWAIT);
    if (n < 0 && (errno == EAGAIN || errno == EWOULDBLOCK || errno == EINTR)) return 0;
    return 1;
}

/* "XADD requests" for messages: the command and its first argument when
 * that argument is short printable text. */
void rconn_describe(int argc, const char **argv, const size_t *argvlen, char *buf, size_t size) {
    size_t l0 = argvlen ? argvlen[0] : strlen(argv[0]);
    int n = snprintf(buf, size, "%.*s", (int)(l0 < 32 ? l0 : 32), argv[0]);
    if (argc < 2 || n < 0 || (size_t)n >= size) return;
    size_t l1 = argvlen ? argvlen[1] : strlen(argv[1]);
    for (size_t i = 0; i < l1; i++)
        if (!isprint((unsigned char)argv[1][i])) return;
    snprintf(buf + n, size - (size_t)n, " %.*s%s", (int)(l1 < 80 ? l1 : 80), argv[1],
             l1 > 80 ? "..." : "");
}

/* Makes sure there is a live connection before sending desc: reconnects if
 * the last command broke it or the server has closed it since. */
static int rconn_ready(struct rconn *c, const char *desc) {
    if (c->ctx && (c->ctx->err || rconn_stale(c))) {
        LOG(LL_INFO, "redis %s: connection closed, reconnecting before %s", c->addr, desc);
        rconn_drop(c);
    }
    if (!c->ctx && rconn_connect(c) < 0) {
        char why[512];
        snprintf(why, sizeof why, "%s", c->errstr);
        /* errstr already starts with "redis host:port: "; add the command */
        const char *reason = strstr(why, ": ");
        rconn_seterr(c, c->err, "%s: %s", desc, reason ? reason + 2 : why);
        return c->err;
    }
    return 0;
}

/* A transport failure (no reply): a timeout or a lost connection.  The
 * connection is dropped, since a late reply would be read as the answer to
 * the next command. */
static int rconn_transport_error(struct rconn *c, const char *desc, int e, int wait_ms) {
    int timeout = c->ctx->err == REDIS_ERR_IO && (e == EAGAIN || e == EWOULDBLOCK);
    if (timeout)
        rconn_seterr(c, STATUS_TIMEOUT, "%s: no reply within %d ms", desc, wait_ms);
    else
        rconn_seterr(c, STATUS_UNAVAILABLE, "%s: %s", desc,
                     c->ctx->errstr[0] ? c->ctx->errstr : "connection lost");
    rconn_drop(c);
    return c->err;
}

/* The one path every command takes.  extra_ms widens the reply timeout for
 * commands that block on the server (XREADGROUP BLOCK). */
int rconn_call(struct rconn *c, const char *what, int extra_ms, redisReply **reply, int argc,
               const char **argv, const size_t *argvlen) {
    *reply = NULL;
    char desc[320];
    if (what)
        snprintf(desc, sizeof desc, "%s", what);
    else
        rconn_describe(argc, argv, argvlen, desc, sizeof desc);
    if (rconn_ready(c, desc) < 0) return c->err;
    if (extra_ms > 0) redisSetTimeout(c->ctx, rconn_tv(c->timeout_ms + extra_ms));
    redisReply *r = redisCommandArgv(c->ctx, argc, argv, argvlen);
    int e = errno;
    if (extra_ms > 0 && c->ctx && !c->ctx->err) redisSetTimeout(c->ctx, rconn_tv(c->timeout_ms));
    if (!r) return rconn_transport_error(c, desc, e, c->timeout_ms + (extra_ms > 0 ? extra_ms : 0));
    if (r->type == REDIS_REPLY_ERROR) {
        int code = strncmp(r->str, "NOGROUP", 7) == 0 ? STATUS_NOT_FOUND : STATUS_INTERNAL;
        rconn_seterr(c, code, "%s: %s", desc, r->str);
        freeReplyObject(r);
        return c->err;
    }
    rconn_ok(c);
    *reply = r;
    return 0;
}

int rconn_pipeline(struct rconn *c, const struct rconn_cmd *cmds, size_t n, redisReply **replies) {
    for (size_t i = 0; i < n; i++) replies[i] = NULL;
    if (n == 0) {
        rconn_ok(c);
        return 0;
    }
    if (cmds[0].argc < 1 || !cmds[0].argv) {
        rconn_seterr(c, STATUS_BAD_INPUT, "pipeline of %zu: command 0 is empty", n);
        return c->err;
    }
    char desc[200], first[160];
    rconn_describe(cmds[0].argc, cmds[0].argv, cmds[0].argvlen, first, sizeof first);
    snprintf(desc, sizeof desc, "pipeline of %zu (%s, ...)", n, first);
    for (size_t i = 0; i < n; i++)
        if (cmds[i].argc < 1 || !cmds[i].argv) {
            rconn_seterr(c, STATUS_BAD_INPUT, "%s: command %zu is empty", desc, i);
            return c->err;
        }
    if (rconn_ready(c, desc) < 0) return c->err;
    for (size_t i = 0; i < n; i++) {
        if (redisAppendCommandArgv(c->ctx, cmds[i].argc, cmds[i].argv, cmds[i].argvlen) != REDIS_OK) {
            rconn_seterr(c, STATUS_NO_MEMORY, "%s: queueing command %zu failed", desc, i);
            rconn_drop(c);
            return c->err;
        }
    }
    int rc = 0;
    for (size_t i = 0; i < n; i++) {
        void *r = NULL;
        if (redisGetReply(c->ctx, &r) != REDIS_OK || !r) {
            int e = errno;
            for (size_t k = 0; k < i; k++) {
                freeReplyObject(replies[k]);
                replies[k] = NULL;
            }
            return rconn_transport_error(c, desc, e, c->timeout_ms);
        }
        replies[i] = r;
        const redisReply *rr = r;
        if (rr->type == REDIS_REPLY_ERROR && rc == 0) {
            char which[160];
            rconn_describe(cmds[i].argc, cmds[i].argv, cmds[i].argvlen, which, sizeof which);
            rc = strncmp(rr->str, "NOGROUP", 7) == 0 ? STATUS_NOT_FOUND : STATUS_INTERNAL;
            rconn_seterr(c, rc, "%s: command %zu (%s): %s", desc, i, which, rr->str);
        }
    }
    if (rc == 0) rconn_ok(c);
    return rc;
}

int rconn_command_argv(struct rconn *c, redisReply **reply, int argc, const char **argv,
                       const size_t *argvlen) {
    *reply = NULL;
    if (argc < 1) {
        rconn_seterr(c, STATUS_BAD_INPUT, "empty command");
        return c->err;
    }
    return rconn_call(c, NULL, 0, reply, argc, argv, argvlen);
}

int rconn_command(struct rconn *c, redisReply **reply, const char *fmt, ...) {
    *reply = NULL;
    /* hiredis formats only into RESP, so format and split the request back
     * into arguments: every command then takes the one call path. */
    char *cmd = NULL;
    va_list ap;
    va_start(ap, fmt);
    int len = redisvFormatCommand(&cmd, fmt, ap);
    va_end(ap);
    if (len <= 0 || !cmd) {
        if (cmd) redisFreeCommand(cmd);
        rconn_seterr(c, STATUS_BAD_INPUT, "format '%s': cannot build a command", fmt);
        return c->err;
    }
    /* RESP request: *<argc>\r\n then $<len>\r\n<bytes>\r\n per argument. */
    const char *p = cmd;
    int argc = (int)strtol(p + 1, (char **)&p, 10);
    const char **argv = argc > 0 ? calloc((size_t)argc, sizeof *argv) : NULL;
    size_t *argvlen = argc > 0 ? calloc((size_t)argc, sizeof *argvlen) : NULL;
    if (!argv || !argvlen) {
        free(argv);
        free(argvlen);
        redisFreeCommand(cmd);
        rconn_seterr(c, argc > 0 ? STATUS_NO_MEMORY : STATUS_BAD_INPUT, "format '%s': %d arguments",
                     fmt, argc);
        return c->err;
    }
    p += 2;
    for (int i = 0; i < argc; i++) {
        argvlen[i] = (size_t)strtoull(p + 1, (char **)&p, 10);
        p += 2;
        argv[i] = p;
        p += argvlen[i] + 2;
    }
    int rc = rconn_call(c, NULL, 0, reply, argc, argv, argvlen);
    free(argv);
    free(argvlen);
    redisFreeCommand(cmd);
    return rc;
}
