/* A Redis connection over hiredis (synchronous) with the commands the
 * cluster needs: keys with TTL, hashes, counters, streams with consumer
 * groups (request queue, claiming a dead router's entries), SCAN, and a
 * generic call for the rest.  Values are binary-safe (protobuf bytes).
 *
 * Every call returns 0 (or a documented non-negative result) or a negative
 * status, and then the connection's err/errstr say what failed, naming
 * host:port and the command ("redis 127.0.0.1:6379: XADD requests:
 * Connection refused").  Statuses: STATUS_UNAVAILABLE (cannot connect, the
 * connection dropped), STATUS_TIMEOUT (no reply in time), STATUS_NOT_FOUND
 * (a missing key, or NOGROUP), STATUS_INTERNAL (Redis replied with an
 * error), STATUS_PROTOCOL (a reply of an unexpected shape).
 *
 * Reconnection: before each command the connection checks whether the
 * server closed it (a restart, a timeout, idle-kill) and if so reconnects,
 * so a command is never lost on a connection known to be dead.  A command
 * whose connection drops while it is in flight fails with
 * STATUS_UNAVAILABLE, since it may or may not have run; the next call
 * reconnects.  One connection is used by one thread at a time.
 *
 * hiredis writes with write(): a server that closes the connection while
 * we write would raise SIGPIPE and end the process.  rconn_open therefore
 * sets SIGPIPE to ignored if it still has its default action (a process
 * that installed its own handler keeps it). */
#ifndef COMMON_RCONN_H
#define COMMON_RCONN_H

#include <hiredis/hiredis.h>
#include <stddef.h>
#include <stdint.h>

struct rconn;

#define RCONN_ID_MAX 48 /* a stream entry id "1700000000000-12" with its NUL */

/* One field of a hash or a stream entry.  In results name and val are
 * NUL-terminated copies (the NUL is not counted in len) owned by the
 * result; in arguments they are the caller's. */
struct rconn_field {
    char *name;
    void *val;
    size_t len;
};

/* A hash (HGETALL). */
struct rconn_fields {
    size_t n;
    struct rconn_field *items;
};

/* Stream entries (XREADGROUP, XAUTOCLAIM). */
struct rconn_entry {
    char id[RCONN_ID_MAX];
    size_t n_fields;
    struct rconn_field *fields;
};
struct rconn_entries {
    size_t n;
    struct rconn_entry *items;
};

/* One pending entry of a consumer group (XPENDING). */
struct rconn_pending {
    char id[RCONN_ID_MAX];
    char consumer[128];
    int64_t idle_ms;
    int64_t deliveries;
};

/* Connects to host:port, selects db, with timeout_ms for connecting and for
 * each reply (0: 5000 ms).  On failure *out is NULL and err names host:port
 * and the reason.  The caller frees the connection with rconn_close. */
int rconn_open(const char *host, int port, int db, int timeout_ms, struct rconn **out, char *err,
               size_t err_size);
/* Same, authenticating every connection (and every reconnection) with AUTH
 * before SELECT: user and password for an ACL user, the password alone
 * (user NULL or "") for requirepass.  password NULL or "": no AUTH.  The
 * strings are copied; the password copy is wiped when the connection is
 * closed.  A refused password is STATUS_BAD_INPUT ("redis host:port: AUTH as
 * user 'app': WRONGPASS ..."); no message ever contains the password. */
int rconn_open_auth(const char *host, int port, int db, const char *user, const char *password,
                    int timeout_ms, struct rconn **out, char *err, size_t err_size);
/* Same from "redis://[user[:password]@]host[:port][/db]" (port 6379, db 0 by
 * default; user and password %-escaped where they hold reserved characters:
 * '@' is %40, ':' %3A, '/' %2F, '%' %25); STATUS_BAD_INPUT names a
 * malformed URL.  Error messages show the URL with its password as "***". */
int rconn_open_url(const char *url, int timeout_ms, struct rconn **out, char *err,
                   size_t err_size);
/* The URL with the password of the file at path in place of the URL's own
 * (the URL's user, host, port and db kept): *out is malloc'd, the caller's to
 * free.  The file holds the password as one line (a final newline is
 * dropped).  STATUS_IO (the file cannot be read) or STATUS_BAD_INPUT (empty,
 * several lines, a malformed URL) with err naming the file or the redacted
 * URL.  For --redis-password-file, so that the URL itself can stay in a
 * ConfigMap and the password in a Secret. */
int rconn_url_password_file(const char *url, const char *path, char **out, char *err,
                            size_t err_size);

/* rconn_url_password_file for --redis-password-file, then one connection to
 * check the password: a password Redis refuses is STATUS_BAD_INPUT naming
 * the file (a process would otherwise only warn and retry for ever); a Redis
 * that cannot be reached yet is not an error (the caller connects when it
 * comes up).  Messages start with "--redis-password-file". */
int rconn_url_password_file_checked(const char *url, const char *path, char **out, char *err,
                                    size_t err_size);
/* url with the password of its user part replaced by "***", for logs and
 * error messages ("redis://app:***@host:6379/0"); a URL without a password
 * is copied as it is. */
void rconn_url_redact(const char *url, char *out, size_t size);
/* NULL is fine. */
void rconn_close(struct rconn *c);
/* Drops the connection and connects again (the automatic path uses this). */
int rconn_reconnect(struct rconn *c);

int rconn_err(const struct rconn *c);
const char *rconn_errstr(const struct rconn *c);
/* "host:port" */
const char *rconn_addr(const struct rconn *c);

int rconn_ping(struct rconn *c);

/* SET key val, with an expiry when ttl_ms > 0 (PX). */
int rconn_set(struct rconn *c, const char *key, const void *val, size_t len, int64_t ttl_ms);
/* SET key val NX: returns 1 if set, 0 if the key already existed. */
int rconn_set_nx(struct rconn *c, const char *key, const void *val, size_t len, int64_t ttl_ms);
/* GET: *val is a malloc'd copy with a NUL after its len bytes, the caller's
 * to free; STATUS_NOT_FOUND (and *val NULL) when the key does not exist. */
int rconn_get(struct rconn *c, const char *key, void **val, size_t *len);
/* DEL one key: returns 1 if it existed, 0 if not. */
int rconn_del(struct rconn *c, const char *key);
/* PEXPIRE: returns 1 if set, 0 if the key does not exist. */
int rconn_expire(struct rconn *c, const char *key, int64_t ttl_ms);
/* PTTL in *ttl_ms: -1 no expiry; STATUS_NOT_FOUND if the key does not exist. */
int rconn_ttl(struct rconn *c, const char *key, int64_t *ttl_ms);
/* INCRBY key by; the new value in *value (may be NULL). */
int rconn_incr(struct rconn *c, const char *key, int64_t by, int64_t *value);

/* HSET key with n fields. */
int rconn_hset(struct rconn *c, const char *key, const struct rconn_field *fields, size_t n);
/* HGET: like rconn_get. */
int rconn_hget(struct rconn *c, const char *key, const char *field, void **val, size_t *len);
/* HGETALL: out is filled (an absent key gives n = 0); free with rconn_fields_free. */
int rconn_hgetall(struct rconn *c, const char *key, struct rconn_fields *out);
/* HDEL one field: 1 if it existed, 0 if not. */
int rconn_hdel(struct rconn *c, const char *key, const char *field);
void rconn_fields_free(struct rconn_fields *f);

/* XADD stream [MAXLEN ~ maxlen] * fields...; maxlen 0: no trimming.  The new
 * entry's id goes to id_out (RCONN_ID_MAX bytes) unless it is NULL. */
int rconn_xadd(struct rconn *c, const char *stream, int64_t maxlen,
               const struct rconn_field *fields, size_t n, char *id_out);
/* XLEN: entries in *len (0 for a missing stream). */
int rconn_xlen(struct rconn *c, const char *stream, int64_t *len);
/* XGROUP CREATE stream group start MKSTREAM; start is "$" (new entries only)
 * or "0" (everything).  A group that already exists is success. */
int rconn_xgroup_create(struct rconn *c, const char *stream, const char *group,
                        const char *start);
/* XREADGROUP GROUP group consumer COUNT count [BLOCK block_ms] STREAMS stream id.
 * id ">" reads new entries; "0" re-reads this consumer's pending ones.
 * block_ms 0 does not wait; > 0 waits up to that long (never for ever, so
 * that callers get to check for shutdown).  out holds 0..count entries
 * (0 on timeout); free with rconn_entries_free.  STATUS_NOT_FOUND when the
 * group or stream does not exist. */
int rconn_xreadgroup(struct rconn *c, const char *stream, const char *group, const char *consumer,
                     size_t count, int block_ms, const char *id, struct rconn_entries *out);
/* XACK one id: 1 if it was pending, 0 if not. */
int rconn_xack(struct rconn *c, const char *stream, const char *group, const char *id);
/* XAUTOCLAIM stream group consumer min_idle_ms start COUNT count: moves
 * entries idle for at least min_idle_ms (a dead consumer's) to consumer and
 * returns them in out.  next (RCONN_ID_MAX bytes, or NULL) receives the
 * cursor for the next call; "0-0" once the whole list was scanned.  Entries
 * deleted from the stream meanwhile are dropped from the pending list and
 * not returned. */
int rconn_xautoclaim(struct rconn *c, const char *stream, const char *group, const char *consumer,
                     int64_t min_idle_ms, const char *start, size_t count,
                     struct rconn_entries *out, char *next);
/* XPENDING stream group - + count [consumer]: up to count pending entries
 * (of consumer, or of all when it is NULL) into a malloc'd array *out of *n
 * (the caller frees it with free()). */
int rconn_xpending(struct rconn *c, const char *stream, const char *group, const char *consumer,
                   size_t count, struct rconn_pending **out, size_t *n);
/* XDEL one id: 1 if it existed. */
int rconn_xdel(struct rconn *c, const char *stream, const char *id);
void rconn_entries_free(struct rconn_entries *e);
/* The value of a field of an entry, or NULL; its length into *len if not NULL. */
const void *rconn_entry_field(const struct rconn_entry *e, const char *name, size_t *len);

/* SCAN 0 MATCH pattern ... until the cursor returns to 0: every key that
 * matches (each once, in no order) into a malloc'd array *keys of *n
 * malloc'd strings; free with rconn_keys_free. */
int rconn_scan(struct rconn *c, const char *pattern, char ***keys, size_t *n);
void rconn_keys_free(char **keys, size_t n);

/* Any command, binary-safe: argv[i] with argvlen[i] bytes (argvlen NULL:
 * strlen).  On success *reply is the caller's (freeReplyObject); an error
 * reply from Redis is a failure (STATUS_INTERNAL, or STATUS_NOT_FOUND for
 * NOGROUP) with the text in errstr and *reply NULL. */
int rconn_command_argv(struct rconn *c, redisReply **reply, int argc, const char **argv,
                       const size_t *argvlen);
/* Same with hiredis's format ("%s" a string, "%b" bytes and a size_t length). */
int rconn_command(struct rconn *c, redisReply **reply, const char *fmt, ...);

/* One command of a pipeline: argv[i] with argvlen[i] bytes (argvlen NULL: strlen). */
struct rconn_cmd {
    int argc;
    const char **argv;
    const size_t *argvlen;
};

/* Sends n commands at once and reads their n replies (one round trip, for
 * example the per-step state updates of many requests; wrap them in MULTI
 * and EXEC to make them atomic).  replies[i] gets command i's reply, the
 * caller's to free with freeReplyObject; all are NULL when the call fails
 * before any reply was read.  Returns 0 when every reply arrived and none
 * is an error reply; STATUS_INTERNAL (or STATUS_NOT_FOUND for NOGROUP) when
 * some are, with the first one's text and index in errstr and every reply
 * still handed over; a transport failure frees what was read and returns
 * its status like any command (the commands may or may not have run). */
int rconn_pipeline(struct rconn *c, const struct rconn_cmd *cmds, size_t n, redisReply **replies);

#endif
