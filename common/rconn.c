/* Redis connection over hiredis: one call path (reconnect if the server
 * closed us, send, map hiredis and Redis errors to statuses and messages
 * naming host:port and the command) under typed helpers that copy replies
 * into plain structs. */
#include "rconn.h"

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

static void rconn_seterr(struct rconn *c, int code, const char *fmt, ...)
    __attribute__((format(printf, 3, 4)));

static void rconn_seterr(struct rconn *c, int code, const char *fmt, ...) {
    c->err = code;
    int n = snprintf(c->errstr, sizeof c->errstr, "redis %s: ", c->addr);
    va_list ap;
    va_start(ap, fmt);
    if (n > 0 && (size_t)n < sizeof c->errstr) vsnprintf(c->errstr + n, sizeof c->errstr - (size_t)n, fmt, ap);
    va_end(ap);
}

static void rconn_ok(struct rconn *c) {
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

static void rconn_wipe_free(char *p) {
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

void rconn_url_redact(const char *url, char *out, size_t size) {
    if (!url) url = "(null)";
    const char *scheme = strstr(url, "://");
    const char *auth = scheme ? scheme + 3 : url;
    const char *at = strrchr(auth, '@');
    const char *colon = at ? memchr(auth, ':', (size_t)(at - auth)) : NULL;
    if (!colon) {
        snprintf(out, size, "%s", url);
        return;
    }
    snprintf(out, size, "%.*s***%s", (int)(colon + 1 - url), url, at);
}

/* Percent-decodes n bytes of s into a malloc'd string; NULL on a bad
 * escape, on a NUL byte, or out of memory (*bad says which). */
static char *rconn_pct_decode(const char *s, size_t n, int *bad) {
    *bad = 0;
    char *d = malloc(n + 1);
    if (!d) return NULL;
    size_t k = 0;
    for (size_t i = 0; i < n; i++) {
        if (s[i] != '%') {
            d[k++] = s[i];
            continue;
        }
        unsigned v = 0;
        for (size_t j = i + 1; j <= i + 2 && !*bad; j++) {
            int h = j < n ? tolower((unsigned char)s[j]) : -1;
            if (h >= '0' && h <= '9') v = v * 16 + (unsigned)(h - '0');
            else if (h >= 'a' && h <= 'f') v = v * 16 + (unsigned)(h - 'a' + 10);
            else *bad = 1;
        }
        if (*bad || v == 0) {
            *bad = 1;
            break;
        }
        d[k++] = (char)v;
        i += 2;
    }
    if (*bad) {
        for (size_t i = 0; i < k; i++) d[i] = 0;
        free(d);
        return NULL;
    }
    d[k] = '\0';
    return d;
}

/* The parts of "redis://[user[:password]@]host[:port][/db]". */
struct rconn_url {
    char host[256];
    long port, db;
    char *user, *password; /* malloc'd, NULL when absent */
    const char *hostpart;  /* into the URL: what follows the '@' */
};

static void rconn_url_free(struct rconn_url *u) {
    free(u->user);
    rconn_wipe_free(u->password);
    u->user = u->password = NULL;
}

/* Error messages name the URL with its password replaced by "***". */
static int rconn_url_parse(const char *url, struct rconn_url *u, char *err, size_t err_size) {
    memset(u, 0, sizeof *u);
    char shown[512];
    rconn_url_redact(url, shown, sizeof shown);
    const char *p = url && strncmp(url, "redis://", 8) == 0 ? url + 8 : NULL;
    if (!p) {
        snprintf(err, err_size, "redis URL '%s': does not start with redis://", shown);
        return STATUS_BAD_INPUT;
    }
    const char *at = strrchr(p, '@');
    if (at) {
        const char *colon = memchr(p, ':', (size_t)(at - p));
        size_t ul = colon ? (size_t)(colon - p) : (size_t)(at - p);
        int bad = 0;
        if (ul > 0 && !(u->user = rconn_pct_decode(p, ul, &bad))) {
            snprintf(err, err_size, "redis URL '%s': %s", shown,
                     bad ? "the user name has a bad %-escape" : "out of memory");
            return bad ? STATUS_BAD_INPUT : STATUS_NO_MEMORY;
        }
        if (colon && colon + 1 < at &&
            !(u->password = rconn_pct_decode(colon + 1, (size_t)(at - colon - 1), &bad))) {
            rconn_url_free(u);
            snprintf(err, err_size, "redis URL '%s': %s", shown,
                     bad ? "the password has a bad %-escape (write '%' as %25)" : "out of memory");
            return bad ? STATUS_BAD_INPUT : STATUS_NO_MEMORY;
        }
        p = at + 1;
    }
    u->hostpart = p;
    size_t hl = strcspn(p, ":/");
    if (hl == 0 || hl >= sizeof u->host) {
        rconn_url_free(u);
        snprintf(err, err_size, "redis URL '%s': no host", shown);
        return STATUS_BAD_INPUT;
    }
    memcpy(u->host, p, hl);
    u->host[hl] = '\0';
    p += hl;
    u->port = 6379;
    u->db = 0;
    char *end;
    if (*p == ':') {
        errno = 0;
        u->port = strtol(p + 1, &end, 10);
        if (end == p + 1 || errno || u->port <= 0 || u->port > 65535 || (*end && *end != '/')) {
            rconn_url_free(u);
            snprintf(err, err_size, "redis URL '%s': port is not a number from 1 to 65535", shown);
            return STATUS_BAD_INPUT;
        }
        p = end;
    }
    if (*p == '/' && p[1]) {
        errno = 0;
        u->db = strtol(p + 1, &end, 10);
        if (end == p + 1 || errno || u->db < 0 || u->db > 100000 || *end) {
            rconn_url_free(u);
            snprintf(err, err_size, "redis URL '%s': database '%s' is not a number", shown, p + 1);
            return STATUS_BAD_INPUT;
        }
    } else if (*p && strcmp(p, "/") != 0) {
        rconn_url_free(u);
        snprintf(err, err_size, "redis URL '%s': unexpected '%s' after the host", shown, p);
        return STATUS_BAD_INPUT;
    }
    return 0;
}

int rconn_open_url(const char *url, int timeout_ms, struct rconn **out, char *err,
                   size_t err_size) {
    *out = NULL;
    struct rconn_url u;
    int rc = rconn_url_parse(url, &u, err, err_size);
    if (rc < 0) return rc;
    rc = rconn_open_auth(u.host, (int)u.port, (int)u.db, u.user, u.password, timeout_ms, out, err,
                         err_size);
    if (rc < 0 && u.password) {
        /* Which URL the refused password came from, without the password. */
        char shown[512], why[512];
        rconn_url_redact(url, shown, sizeof shown);
        snprintf(why, sizeof why, "%s", err);
        snprintf(err, err_size, "%s (URL %s)", why, shown);
    }
    rconn_url_free(&u);
    return rc;
}

int rconn_url_password_file(const char *url, const char *path, char **out, char *err,
                            size_t err_size) {
    *out = NULL;
    struct rconn_url u;
    int rc = rconn_url_parse(url, &u, err, err_size);
    if (rc < 0) return rc;
    FILE *f = fopen(path, "rb");
    if (!f) {
        snprintf(err, err_size, "redis password file %s: %s", path, strerror(errno));
        rconn_url_free(&u);
        return STATUS_IO;
    }
    char pw[1025];
    size_t n = fread(pw, 1, sizeof pw, f);
    int read_err = ferror(f);
    fclose(f);
    rc = STATUS_BAD_INPUT;
    if (read_err) {
        snprintf(err, err_size, "redis password file %s: cannot be read", path);
        rc = STATUS_IO;
        goto done;
    }
    if (n == sizeof pw) {
        snprintf(err, err_size, "redis password file %s: longer than %zu bytes", path, sizeof pw - 1);
        goto done;
    }
    /* A Secret or `echo` leaves a final newline; it is not part of the password. */
    while (n > 0 && (pw[n - 1] == '\n' || pw[n - 1] == '\r')) n--;
    pw[n] = '\0';
    if (n == 0) {
        snprintf(err, err_size, "redis password file %s: is empty", path);
        goto done;
    }
    if (memchr(pw, '\n', n) || memchr(pw, '\r', n) || strlen(pw) != n) {
        snprintf(err, err_size, "redis password file %s: the password must be one line of text", path);
        goto done;
    }
    /* redis:// [user] : password (every byte outside the unreserved set
     * escaped) @ host... */
    size_t ulen = u.user ? strlen(u.user) : 0;
    size_t cap = 8 + 3 * ulen + 1 + 3 * n + 1 + strlen(u.hostpart) + 1;
    char *s = malloc(cap);
    if (!s) {
        snprintf(err, err_size, "redis password file %s: out of memory", path);
        rc = STATUS_NO_MEMORY;
        goto done;
    }
    size_t k = (size_t)snprintf(s, cap, "redis://");
    for (int part = 0; part < 2; part++) {
        const char *src = part == 0 ? (u.user ? u.user : "") : pw;
        for (const unsigned char *c = (const unsigned char *)src; *c; c++) {
            if (isalnum(*c) || *c == '-' || *c == '.' || *c == '_' || *c == '~')
                s[k++] = (char)*c;
            else
                k += (size_t)snprintf(s + k, cap - k, "%%%02X", *c);
        }
        s[k++] = part == 0 ? ':' : '@';
    }
    snprintf(s + k, cap - k, "%s", u.hostpart);
    *out = s;
    rc = 0;
done:
    for (volatile char *v = pw; v < pw + sizeof pw; v++) *v = 0;
    rconn_url_free(&u);
    return rc;
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
static void rconn_describe(int argc, const char **argv, const size_t *argvlen, char *buf,
                           size_t size) {
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
static int rconn_call(struct rconn *c, const char *what, int extra_ms, redisReply **reply,
                      int argc, const char **argv, const size_t *argvlen) {
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

/* Reply shape checks: a wrong shape is STATUS_PROTOCOL naming the command. */
static int rconn_expect(struct rconn *c, redisReply *r, int type, const char *desc) {
    if (r->type == type) return 0;
    rconn_seterr(c, STATUS_PROTOCOL, "%s: unexpected reply type %d (wanted %d)", desc, r->type, type);
    freeReplyObject(r);
    return c->err;
}

int rconn_ping(struct rconn *c) {
    const char *argv[] = {"PING"};
    redisReply *r;
    int rc = rconn_call(c, NULL, 0, &r, 1, argv, NULL);
    if (rc < 0) return rc;
    freeReplyObject(r);
    return 0;
}

static int rconn_set_impl(struct rconn *c, const char *key, const void *val, size_t len,
                          int64_t ttl_ms, int nx) {
    char ttl[32];
    snprintf(ttl, sizeof ttl, "%lld", (long long)ttl_ms);
    const char *argv[6] = {"SET", key, (const char *)val};
    size_t argvlen[6] = {3, strlen(key), len};
    int argc = 3;
    if (ttl_ms > 0) {
        argv[argc] = "PX";
        argvlen[argc++] = 2;
        argv[argc] = ttl;
        argvlen[argc++] = strlen(ttl);
    }
    if (nx) {
        argv[argc] = "NX";
        argvlen[argc++] = 2;
    }
    redisReply *r;
    int rc = rconn_call(c, NULL, 0, &r, argc, argv, argvlen);
    if (rc < 0) return rc;
    int set = r->type == REDIS_REPLY_STATUS;
    freeReplyObject(r);
    return nx ? set : 0;
}

int rconn_set(struct rconn *c, const char *key, const void *val, size_t len, int64_t ttl_ms) {
    return rconn_set_impl(c, key, val, len, ttl_ms, 0);
}

int rconn_set_nx(struct rconn *c, const char *key, const void *val, size_t len, int64_t ttl_ms) {
    return rconn_set_impl(c, key, val, len, ttl_ms, 1);
}

/* Copies a string reply into a malloc'd buffer with a trailing NUL. */
static int rconn_copy_str(struct rconn *c, const redisReply *r, void **val, size_t *len,
                          const char *desc) {
    char *b = malloc(r->len + 1);
    if (!b) {
        rconn_seterr(c, STATUS_NO_MEMORY, "%s: out of memory for %zu bytes", desc, (size_t)r->len);
        return c->err;
    }
    if (r->len) memcpy(b, r->str, r->len);
    b[r->len] = '\0';
    *val = b;
    if (len) *len = r->len;
    return 0;
}

/* GET/HGET reply into *val. */
static int rconn_get_reply(struct rconn *c, redisReply *r, void **val, size_t *len,
                           const char *desc) {
    if (r->type == REDIS_REPLY_NIL) {
        freeReplyObject(r);
        rconn_seterr(c, STATUS_NOT_FOUND, "%s: no such key", desc);
        return c->err;
    }
    if (rconn_expect(c, r, REDIS_REPLY_STRING, desc) < 0) return c->err;
    int rc = rconn_copy_str(c, r, val, len, desc);
    freeReplyObject(r);
    return rc;
}

int rconn_get(struct rconn *c, const char *key, void **val, size_t *len) {
    *val = NULL;
    if (len) *len = 0;
    const char *argv[] = {"GET", key};
    redisReply *r;
    int rc = rconn_call(c, NULL, 0, &r, 2, argv, NULL);
    if (rc < 0) return rc;
    char desc[300];
    snprintf(desc, sizeof desc, "GET %s", key);
    return rconn_get_reply(c, r, val, len, desc);
}

/* Commands that answer with an integer. */
static int rconn_int(struct rconn *c, int64_t *out, int argc, const char **argv,
                     const size_t *argvlen) {
    redisReply *r;
    int rc = rconn_call(c, NULL, 0, &r, argc, argv, argvlen);
    if (rc < 0) return rc;
    char desc[160];
    rconn_describe(argc, argv, argvlen, desc, sizeof desc);
    if (rconn_expect(c, r, REDIS_REPLY_INTEGER, desc) < 0) return c->err;
    *out = r->integer;
    freeReplyObject(r);
    return 0;
}

int rconn_del(struct rconn *c, const char *key) {
    const char *argv[] = {"DEL", key};
    int64_t n;
    int rc = rconn_int(c, &n, 2, argv, NULL);
    return rc < 0 ? rc : n > 0;
}

int rconn_expire(struct rconn *c, const char *key, int64_t ttl_ms) {
    char ttl[32];
    snprintf(ttl, sizeof ttl, "%lld", (long long)ttl_ms);
    const char *argv[] = {"PEXPIRE", key, ttl};
    int64_t n;
    int rc = rconn_int(c, &n, 3, argv, NULL);
    return rc < 0 ? rc : n > 0;
}

int rconn_ttl(struct rconn *c, const char *key, int64_t *ttl_ms) {
    const char *argv[] = {"PTTL", key};
    int64_t n;
    int rc = rconn_int(c, &n, 2, argv, NULL);
    if (rc < 0) return rc;
    if (n == -2) {
        rconn_seterr(c, STATUS_NOT_FOUND, "PTTL %s: no such key", key);
        return c->err;
    }
    *ttl_ms = n;
    return 0;
}

int rconn_incr(struct rconn *c, const char *key, int64_t by, int64_t *value) {
    char b[32];
    snprintf(b, sizeof b, "%lld", (long long)by);
    const char *argv[] = {"INCRBY", key, b};
    int64_t n;
    int rc = rconn_int(c, &n, 3, argv, NULL);
    if (rc < 0) return rc;
    if (value) *value = n;
    return 0;
}

/* argv for "CMD key [prefix...] name1 val1 name2 val2 ...". */
static int rconn_field_argv(struct rconn *c, const char *const *head, size_t n_head,
                            const struct rconn_field *fields, size_t n, const char ***argv_out,
                            size_t **len_out) {
    size_t argc = n_head + 2 * n;
    const char **argv = malloc(argc * sizeof *argv);
    size_t *lens = malloc(argc * sizeof *lens);
    if (!argv || !lens) {
        free(argv);
        free(lens);
        rconn_seterr(c, STATUS_NO_MEMORY, "%s %s: out of memory for %zu fields", head[0], head[1], n);
        return c->err;
    }
    for (size_t i = 0; i < n_head; i++) {
        argv[i] = head[i];
        lens[i] = strlen(head[i]);
    }
    for (size_t i = 0; i < n; i++) {
        argv[n_head + 2 * i] = fields[i].name;
        lens[n_head + 2 * i] = strlen(fields[i].name);
        argv[n_head + 2 * i + 1] = fields[i].val;
        lens[n_head + 2 * i + 1] = fields[i].len;
    }
    *argv_out = argv;
    *len_out = lens;
    return 0;
}

int rconn_hset(struct rconn *c, const char *key, const struct rconn_field *fields, size_t n) {
    if (n == 0) {
        rconn_seterr(c, STATUS_BAD_INPUT, "HSET %s: no fields", key);
        return c->err;
    }
    const char *head[] = {"HSET", key};
    const char **argv = NULL;
    size_t *lens = NULL;
    if (rconn_field_argv(c, head, 2, fields, n, &argv, &lens) < 0) return c->err;
    int64_t added;
    int rc = rconn_int(c, &added, (int)(2 + 2 * n), argv, lens);
    free(argv);
    free(lens);
    return rc;
}

int rconn_hget(struct rconn *c, const char *key, const char *field, void **val, size_t *len) {
    *val = NULL;
    if (len) *len = 0;
    const char *argv[] = {"HGET", key, field};
    redisReply *r;
    int rc = rconn_call(c, NULL, 0, &r, 3, argv, NULL);
    if (rc < 0) return rc;
    char desc[300];
    snprintf(desc, sizeof desc, "HGET %s %s", key, field);
    return rconn_get_reply(c, r, val, len, desc);
}

int rconn_hdel(struct rconn *c, const char *key, const char *field) {
    const char *argv[] = {"HDEL", key, field};
    int64_t n;
    int rc = rconn_int(c, &n, 3, argv, NULL);
    return rc < 0 ? rc : n > 0;
}

static void rconn_field_list_free(struct rconn_field *f, size_t n) {
    for (size_t i = 0; i < n; i++) {
        free(f[i].name);
        free(f[i].val);
    }
    free(f);
}

void rconn_fields_free(struct rconn_fields *f) {
    if (!f) return;
    rconn_field_list_free(f->items, f->n);
    f->items = NULL;
    f->n = 0;
}

/* A flat array reply [name, value, name, value, ...] into fields. */
static int rconn_parse_fields(struct rconn *c, const redisReply *r, struct rconn_field **out,
                              size_t *n_out, const char *desc) {
    *out = NULL;
    *n_out = 0;
    if (r->type == REDIS_REPLY_NIL) return 0; /* an entry deleted from the stream */
    if (r->type != REDIS_REPLY_ARRAY || r->elements % 2) {
        rconn_seterr(c, STATUS_PROTOCOL, "%s: field list of type %d with %zu elements", desc,
                     r->type, (size_t)r->elements);
        return c->err;
    }
    size_t n = r->elements / 2;
    if (n == 0) return 0;
    struct rconn_field *f = calloc(n, sizeof *f);
    if (!f) {
        rconn_seterr(c, STATUS_NO_MEMORY, "%s: out of memory for %zu fields", desc, n);
        return c->err;
    }
    for (size_t i = 0; i < n; i++) {
        const redisReply *k = r->element[2 * i], *v = r->element[2 * i + 1];
        if (k->type != REDIS_REPLY_STRING || v->type != REDIS_REPLY_STRING) {
            rconn_field_list_free(f, i);
            rconn_seterr(c, STATUS_PROTOCOL, "%s: field %zu is not a string pair", desc, i);
            return c->err;
        }
        void *name = NULL;
        size_t name_len = 0;
        if (rconn_copy_str(c, k, &name, &name_len, desc) < 0) {
            rconn_field_list_free(f, i);
            return c->err;
        }
        f[i].name = name;
        if (rconn_copy_str(c, v, &f[i].val, &f[i].len, desc) < 0) {
            rconn_field_list_free(f, i + 1);
            return c->err;
        }
    }
    *out = f;
    *n_out = n;
    return 0;
}

int rconn_hgetall(struct rconn *c, const char *key, struct rconn_fields *out) {
    out->n = 0;
    out->items = NULL;
    const char *argv[] = {"HGETALL", key};
    redisReply *r;
    int rc = rconn_call(c, NULL, 0, &r, 2, argv, NULL);
    if (rc < 0) return rc;
    char desc[300];
    snprintf(desc, sizeof desc, "HGETALL %s", key);
    rc = rconn_parse_fields(c, r, &out->items, &out->n, desc);
    freeReplyObject(r);
    return rc;
}

int rconn_xadd(struct rconn *c, const char *stream, int64_t maxlen,
               const struct rconn_field *fields, size_t n, char *id_out) {
    if (id_out) id_out[0] = '\0';
    if (n == 0) {
        rconn_seterr(c, STATUS_BAD_INPUT, "XADD %s: an entry needs at least one field", stream);
        return c->err;
    }
    char ml[32];
    snprintf(ml, sizeof ml, "%lld", (long long)maxlen);
    const char *head_trim[] = {"XADD", stream, "MAXLEN", "~", ml, "*"};
    const char *head_plain[] = {"XADD", stream, "*"};
    const char *const *head = maxlen > 0 ? head_trim : head_plain;
    size_t n_head = maxlen > 0 ? 6 : 3;
    const char **argv = NULL;
    size_t *lens = NULL;
    if (rconn_field_argv(c, head, n_head, fields, n, &argv, &lens) < 0) return c->err;
    redisReply *r;
    int rc = rconn_call(c, NULL, 0, &r, (int)(n_head + 2 * n), argv, lens);
    free(argv);
    free(lens);
    if (rc < 0) return rc;
    char desc[300];
    snprintf(desc, sizeof desc, "XADD %s", stream);
    if (rconn_expect(c, r, REDIS_REPLY_STRING, desc) < 0) return c->err;
    if (r->len >= RCONN_ID_MAX) {
        rconn_seterr(c, STATUS_PROTOCOL, "%s: entry id of %zu bytes", desc, (size_t)r->len);
        freeReplyObject(r);
        return c->err;
    }
    if (id_out) snprintf(id_out, RCONN_ID_MAX, "%s", r->str);
    freeReplyObject(r);
    return 0;
}

int rconn_xlen(struct rconn *c, const char *stream, int64_t *len) {
    const char *argv[] = {"XLEN", stream};
    return rconn_int(c, len, 2, argv, NULL);
}

int rconn_xgroup_create(struct rconn *c, const char *stream, const char *group,
                        const char *start) {
    const char *argv[] = {"XGROUP", "CREATE", stream, group, start ? start : "$", "MKSTREAM"};
    char desc[300];
    snprintf(desc, sizeof desc, "XGROUP CREATE %s %s", stream, group);
    redisReply *r;
    int rc = rconn_call(c, desc, 0, &r, 6, argv, NULL);
    if (rc == STATUS_INTERNAL && strstr(c->errstr, "BUSYGROUP")) {
        rconn_ok(c); /* made before, by us or another router: what we wanted */
        return 0;
    }
    if (rc < 0) return rc;
    freeReplyObject(r);
    return 0;
}

void rconn_entries_free(struct rconn_entries *e) {
    if (!e) return;
    for (size_t i = 0; i < e->n; i++) rconn_field_list_free(e->items[i].fields, e->items[i].n_fields);
    free(e->items);
    e->items = NULL;
    e->n = 0;
}

/* An array of entries [[id, [f, v, ...]], ...] into out; nil elements
 * (entries deleted under XAUTOCLAIM in Redis 6.2) are skipped. */
static int rconn_parse_entries(struct rconn *c, const redisReply *r, struct rconn_entries *out,
                               const char *desc) {
    out->n = 0;
    out->items = NULL;
    if (r->type == REDIS_REPLY_NIL) return 0;
    if (r->type != REDIS_REPLY_ARRAY) {
        rconn_seterr(c, STATUS_PROTOCOL, "%s: entry list of type %d", desc, r->type);
        return c->err;
    }
    if (r->elements == 0) return 0;
    out->items = calloc(r->elements, sizeof *out->items);
    if (!out->items) {
        rconn_seterr(c, STATUS_NO_MEMORY, "%s: out of memory for %zu entries", desc,
                     (size_t)r->elements);
        return c->err;
    }
    for (size_t i = 0; i < r->elements; i++) {
        const redisReply *e = r->element[i];
        if (e->type == REDIS_REPLY_NIL) continue;
        if (e->type != REDIS_REPLY_ARRAY || e->elements != 2 ||
            e->element[0]->type != REDIS_REPLY_STRING || e->element[0]->len >= RCONN_ID_MAX) {
            rconn_seterr(c, STATUS_PROTOCOL, "%s: entry %zu is not [id, fields]", desc, i);
            rconn_entries_free(out);
            return c->err;
        }
        struct rconn_entry *d = &out->items[out->n];
        memcpy(d->id, e->element[0]->str, e->element[0]->len);
        d->id[e->element[0]->len] = '\0';
        if (rconn_parse_fields(c, e->element[1], &d->fields, &d->n_fields, desc) < 0) {
            rconn_entries_free(out);
            return c->err;
        }
        out->n++;
    }
    return 0;
}

int rconn_xreadgroup(struct rconn *c, const char *stream, const char *group, const char *consumer,
                     size_t count, int block_ms, const char *id, struct rconn_entries *out) {
    out->n = 0;
    out->items = NULL;
    char cnt[32], blk[32];
    snprintf(cnt, sizeof cnt, "%zu", count ? count : 1);
    snprintf(blk, sizeof blk, "%d", block_ms);
    const char *argv[12] = {"XREADGROUP", "GROUP", group, consumer, "COUNT", cnt};
    int argc = 6;
    if (block_ms > 0) {
        argv[argc++] = "BLOCK";
        argv[argc++] = blk;
    }
    argv[argc++] = "STREAMS";
    argv[argc++] = stream;
    argv[argc++] = id ? id : ">";
    char desc[300];
    snprintf(desc, sizeof desc, "XREADGROUP %s %s %s", stream, group, consumer);
    redisReply *r;
    int rc = rconn_call(c, desc, block_ms > 0 ? block_ms : 0, &r, argc, argv, NULL);
    if (rc < 0) return rc;
    if (r->type == REDIS_REPLY_NIL) { /* BLOCK ran out */
        freeReplyObject(r);
        return 0;
    }
    /* [[stream, [entries...]]] */
    if (r->type != REDIS_REPLY_ARRAY || r->elements != 1 || r->element[0]->type != REDIS_REPLY_ARRAY ||
        r->element[0]->elements != 2) {
        rconn_seterr(c, STATUS_PROTOCOL, "%s: reply is not [[stream, entries]]", desc);
        freeReplyObject(r);
        return c->err;
    }
    rc = rconn_parse_entries(c, r->element[0]->element[1], out, desc);
    freeReplyObject(r);
    return rc;
}

int rconn_xack(struct rconn *c, const char *stream, const char *group, const char *id) {
    const char *argv[] = {"XACK", stream, group, id};
    int64_t n;
    int rc = rconn_int(c, &n, 4, argv, NULL);
    return rc < 0 ? rc : n > 0;
}

int rconn_xdel(struct rconn *c, const char *stream, const char *id) {
    const char *argv[] = {"XDEL", stream, id};
    int64_t n;
    int rc = rconn_int(c, &n, 3, argv, NULL);
    return rc < 0 ? rc : n > 0;
}

int rconn_xautoclaim(struct rconn *c, const char *stream, const char *group, const char *consumer,
                     int64_t min_idle_ms, const char *start, size_t count,
                     struct rconn_entries *out, char *next) {
    out->n = 0;
    out->items = NULL;
    if (next) next[0] = '\0';
    char idle[32], cnt[32];
    snprintf(idle, sizeof idle, "%lld", (long long)(min_idle_ms > 0 ? min_idle_ms : 0));
    snprintf(cnt, sizeof cnt, "%zu", count ? count : 1);
    const char *argv[] = {"XAUTOCLAIM", stream, group, consumer, idle,
                          start ? start : "0-0", "COUNT", cnt};
    char desc[300];
    snprintf(desc, sizeof desc, "XAUTOCLAIM %s %s %s", stream, group, consumer);
    redisReply *r;
    int rc = rconn_call(c, desc, 0, &r, 8, argv, NULL);
    if (rc < 0) return rc;
    /* Redis 6.2: [next, entries]; 7.0 adds a third element, the deleted ids. */
    if (r->type != REDIS_REPLY_ARRAY || r->elements < 2 ||
        r->element[0]->type != REDIS_REPLY_STRING || r->element[0]->len >= RCONN_ID_MAX) {
        rconn_seterr(c, STATUS_PROTOCOL, "%s: reply is not [next, entries, ...]", desc);
        freeReplyObject(r);
        return c->err;
    }
    if (next) snprintf(next, RCONN_ID_MAX, "%s", r->element[0]->str);
    rc = rconn_parse_entries(c, r->element[1], out, desc);
    freeReplyObject(r);
    return rc;
}

int rconn_xpending(struct rconn *c, const char *stream, const char *group, const char *consumer,
                   size_t count, struct rconn_pending **out, size_t *n) {
    *out = NULL;
    *n = 0;
    char cnt[32];
    snprintf(cnt, sizeof cnt, "%zu", count ? count : 1);
    const char *argv[] = {"XPENDING", stream, group, "-", "+", cnt, consumer};
    char desc[300];
    snprintf(desc, sizeof desc, "XPENDING %s %s", stream, group);
    redisReply *r;
    int rc = rconn_call(c, desc, 0, &r, consumer ? 7 : 6, argv, NULL);
    if (rc < 0) return rc;
    if (rconn_expect(c, r, REDIS_REPLY_ARRAY, desc) < 0) return c->err;
    if (r->elements == 0) {
        freeReplyObject(r);
        return 0;
    }
    struct rconn_pending *p = calloc(r->elements, sizeof *p);
    if (!p) {
        freeReplyObject(r);
        rconn_seterr(c, STATUS_NO_MEMORY, "%s: out of memory", desc);
        return c->err;
    }
    for (size_t i = 0; i < r->elements; i++) {
        const redisReply *e = r->element[i];
        if (e->type != REDIS_REPLY_ARRAY || e->elements != 4 ||
            e->element[0]->type != REDIS_REPLY_STRING || e->element[0]->len >= RCONN_ID_MAX ||
            e->element[1]->type != REDIS_REPLY_STRING ||
            e->element[2]->type != REDIS_REPLY_INTEGER ||
            e->element[3]->type != REDIS_REPLY_INTEGER) {
            free(p);
            freeReplyObject(r);
            rconn_seterr(c, STATUS_PROTOCOL, "%s: entry %zu is not [id, consumer, idle, count]",
                         desc, i);
            return c->err;
        }
        snprintf(p[i].id, sizeof p[i].id, "%s", e->element[0]->str);
        snprintf(p[i].consumer, sizeof p[i].consumer, "%s", e->element[1]->str);
        p[i].idle_ms = e->element[2]->integer;
        p[i].deliveries = e->element[3]->integer;
    }
    *n = r->elements;
    *out = p;
    freeReplyObject(r);
    return 0;
}

const void *rconn_entry_field(const struct rconn_entry *e, const char *name, size_t *len) {
    for (size_t i = 0; i < e->n_fields; i++)
        if (strcmp(e->fields[i].name, name) == 0) {
            if (len) *len = e->fields[i].len;
            return e->fields[i].val;
        }
    if (len) *len = 0;
    return NULL;
}

void rconn_keys_free(char **keys, size_t n) {
    if (!keys) return;
    for (size_t i = 0; i < n; i++) free(keys[i]);
    free(keys);
}

static int rconn_cmp_str(const void *a, const void *b) {
    return strcmp(*(char *const *)a, *(char *const *)b);
}

int rconn_scan(struct rconn *c, const char *pattern, char ***keys_out, size_t *n_out) {
    *keys_out = NULL;
    *n_out = 0;
    char cursor[32] = "0";
    char **keys = NULL;
    size_t n = 0, cap = 0;
    char desc[300];
    snprintf(desc, sizeof desc, "SCAN MATCH %s", pattern);
    do {
        const char *argv[] = {"SCAN", cursor, "MATCH", pattern, "COUNT", "1000"};
        redisReply *r;
        int rc = rconn_call(c, desc, 0, &r, 6, argv, NULL);
        if (rc < 0) {
            rconn_keys_free(keys, n);
            return rc;
        }
        if (r->type != REDIS_REPLY_ARRAY || r->elements != 2 ||
            r->element[0]->type != REDIS_REPLY_STRING || r->element[0]->len >= sizeof cursor ||
            r->element[1]->type != REDIS_REPLY_ARRAY) {
            freeReplyObject(r);
            rconn_keys_free(keys, n);
            rconn_seterr(c, STATUS_PROTOCOL, "%s: reply is not [cursor, keys]", desc);
            return c->err;
        }
        snprintf(cursor, sizeof cursor, "%s", r->element[0]->str);
        const redisReply *list = r->element[1];
        for (size_t i = 0; i < list->elements; i++) {
            if (list->element[i]->type != REDIS_REPLY_STRING) continue;
            if (n == cap) {
                size_t nc = cap ? cap * 2 : 64;
                char **k = realloc(keys, nc * sizeof *k);
                if (!k) {
                    freeReplyObject(r);
                    rconn_keys_free(keys, n);
                    rconn_seterr(c, STATUS_NO_MEMORY, "%s: out of memory for %zu keys", desc, nc);
                    return c->err;
                }
                keys = k;
                cap = nc;
            }
            void *s = NULL;
            if (rconn_copy_str(c, list->element[i], &s, NULL, desc) < 0) {
                freeReplyObject(r);
                rconn_keys_free(keys, n);
                return c->err;
            }
            keys[n++] = s;
        }
        freeReplyObject(r);
    } while (strcmp(cursor, "0") != 0);
    /* SCAN may return a key more than once (rehashing): keep one of each. */
    if (n > 1) {
        qsort(keys, n, sizeof *keys, rconn_cmp_str);
        size_t w = 1;
        for (size_t i = 1; i < n; i++) {
            if (strcmp(keys[i], keys[w - 1]) == 0)
                free(keys[i]);
            else
                keys[w++] = keys[i];
        }
        n = w;
    }
    *keys_out = keys;
    *n_out = n;
    return 0;
}

int rconn_url_password_file_checked(const char *url, const char *path, char **out, char *err,
                                    size_t err_size) {
    char e[512];
    int rc = rconn_url_password_file(url, path, out, e, sizeof e);
    if (rc < 0) return status_fail(err, err_size, rc, "--redis-password-file: %s", e);
    struct rconn *r = NULL;
    rc = rconn_open_url(*out, 2000, &r, e, sizeof e);
    rconn_close(r);
    if (rc == STATUS_BAD_INPUT) {
        free(*out);
        *out = NULL;
        return status_fail(err, err_size, rc,
                           "--redis-password-file %s: Redis refused the password in this file: %s", path, e);
    }
    return STATUS_OK;
}
