/* The typed commands of rconn.h: PING, keys with TTL, counters, hashes,
 * streams with consumer groups and SCAN, each one rconn_call under a helper
 * that checks the reply's shape and copies it into plain structs the caller
 * owns. */
#include "rconn.h"
#include "rconn-impl.h"

#include "status.h"

#include <stdio.h>
#include <stdlib.h>
#include <string.h>

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
