/* Durable requests in Redis (see requests.h for the key layout).  The
 * writes that must be atomic (the hash and its stream entry; finishing with
 * XACK and expiry) run as one Lua script each, which is also one round trip:
 * the router calls these from its event loop. */
#include "router/requests.h"

#include <inttypes.h>
#include <stdbool.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "common/log.h"
#include "common/status.h"

#define REQSTORE_GROUP "routers"

struct reqstore {
    struct rconn *c;
    char prefix[64];
    char consumer[128];
    char stream[96];
    int64_t retention_ms, claim_idle_ms;
    int64_t claim_in_ms;  /* the last load refused for another holder: ms until its entry is claimable here */
    uint64_t groups_made; /* consumer group recreated after NOGROUP */
    uint64_t groups_told; /* of those, reported by reqstore_check */
    char errstr[512];
};

void reqrec_free(struct reqrec *r) {
    free(r->params);
    free(r->prompt);
    free(r->gen);
    free(r->stop_string);
    free(r->error_message);
    memset(r, 0, sizeof *r);
}

void reqstore_tokens_encode(const int32_t *ids, int32_t n, uint8_t *out) {
    for (int32_t i = 0; i < n; i++) {
        uint32_t v = (uint32_t)ids[i];
        out[4 * i + 0] = (uint8_t)v;
        out[4 * i + 1] = (uint8_t)(v >> 8);
        out[4 * i + 2] = (uint8_t)(v >> 16);
        out[4 * i + 3] = (uint8_t)(v >> 24);
    }
}

void reqstore_tokens_decode(const uint8_t *in, int32_t n, int32_t *ids) {
    for (int32_t i = 0; i < n; i++)
        ids[i] = (int32_t)((uint32_t)in[4 * i] | (uint32_t)in[4 * i + 1] << 8 |
                           (uint32_t)in[4 * i + 2] << 16 | (uint32_t)in[4 * i + 3] << 24);
}

/* A request's keys: <p>req:<id> without an owner, <p>req@<owner>:<id> with
 * one.  The "req@" form never meets the "req:" form, so ids of different
 * keys, and of none, live apart. */
static void reqstore_keys(const reqstore *rs, const char *owner, const char *id, char *hkey, char *gkey,
                          size_t size) {
    if (owner && owner[0]) {
        snprintf(hkey, size, "%sreq@%s:%s", rs->prefix, owner, id);
        snprintf(gkey, size, "%sreq@%s:%s:gen", rs->prefix, owner, id);
    } else {
        snprintf(hkey, size, "%sreq:%s", rs->prefix, id);
        snprintf(gkey, size, "%sreq:%s:gen", rs->prefix, id);
    }
}

static int reqstore_fail(reqstore *rs, int rc) {
    snprintf(rs->errstr, sizeof rs->errstr, "%s", rconn_errstr(rs->c));
    return rc;
}

/* After a failed command: when Redis said NOGROUP, the consumer group is
 * gone (Redis restarted without its data, or someone deleted it), and every
 * later command on it would fail the same way for as long as the router
 * runs.  Makes it again (MKSTREAM, from "0": whatever the stream holds is
 * read again) and returns 1 so that the caller retries the command at once;
 * 0 for any other failure, or when the group cannot be made. */
static int reqstore_regroup(reqstore *rs, int rc) {
    if (rc >= 0 || !strstr(rconn_errstr(rs->c), "NOGROUP")) return 0;
    char why[512];
    snprintf(why, sizeof why, "%s", rconn_errstr(rs->c));
    if (rconn_xgroup_create(rs->c, rs->stream, REQSTORE_GROUP, "0") < 0) {
        LOG(LL_WARN, "redis: %s; recreating the group failed: %s", why, rconn_errstr(rs->c));
        return 0;
    }
    rs->groups_made++;
    LOG(LL_WARN, "redis: consumer group %s of %s was gone (Redis restarted without its data?): "
        "made it again", REQSTORE_GROUP, rs->stream);
    return 1;
}

uint64_t reqstore_groups_recreated(const reqstore *rs) { return rs->groups_made; }

int reqstore_check(reqstore *rs) {
    const char *argv[] = {"EXISTS", rs->stream};
    redisReply *r = NULL;
    int rc = rconn_command_argv(rs->c, &r, 2, argv, NULL);
    if (rc < 0) return reqstore_fail(rs, rc);
    bool gone = r->type == REDIS_REPLY_INTEGER && r->integer == 0;
    freeReplyObject(r);
    if (gone) {
        rc = rconn_xgroup_create(rs->c, rs->stream, REQSTORE_GROUP, "0");
        if (rc < 0) return reqstore_fail(rs, rc);
        rs->groups_made++;
        LOG(LL_WARN, "redis: stream %s was gone (Redis restarted without its data?): made it and "
            "its consumer group %s again", rs->stream, REQSTORE_GROUP);
    }
    if (rs->groups_told == rs->groups_made) return 0;
    rs->groups_told = rs->groups_made;
    return 1;
}

int reqstore_open(reqstore **out, const struct reqstore_config *cfg, char *err, size_t errlen) {
    *out = NULL;
    reqstore *rs = calloc(1, sizeof *rs);
    if (!rs) {
        snprintf(err, errlen, "reqstore: out of memory");
        return STATUS_NO_MEMORY;
    }
    snprintf(rs->prefix, sizeof rs->prefix, "%s", cfg->prefix ? cfg->prefix : "llm:");
    snprintf(rs->consumer, sizeof rs->consumer, "%s", cfg->consumer ? cfg->consumer : "router");
    snprintf(rs->stream, sizeof rs->stream, "%srequests", rs->prefix);
    rs->retention_ms = cfg->retention_ms > 0 ? cfg->retention_ms : 3600 * 1000;
    rs->claim_idle_ms = cfg->claim_idle_ms;
    int rc = rconn_open_url(cfg->url, cfg->timeout_ms, &rs->c, err, errlen);
    if (rc < 0) {
        free(rs);
        return rc;
    }
    /* No stream: a new Redis, or one that lost its data while we were
     * away from it; reqstore_check then tells the caller once. */
    const char *argv[] = {"EXISTS", rs->stream};
    redisReply *r = NULL;
    rc = rconn_command_argv(rs->c, &r, 2, argv, NULL);
    if (rc == 0) {
        if (r->type == REDIS_REPLY_INTEGER && r->integer == 0) rs->groups_made = 1;
        freeReplyObject(r);
        rc = rconn_xgroup_create(rs->c, rs->stream, REQSTORE_GROUP, "0");
    }
    if (rc < 0) {
        snprintf(err, errlen, "%s", rconn_errstr(rs->c));
        reqstore_close(rs);
        return rc;
    }
    *out = rs;
    return STATUS_OK;
}

void reqstore_close(reqstore *rs) {
    if (!rs) return;
    rconn_close(rs->c);
    free(rs);
}

const char *reqstore_errstr(const reqstore *rs) { return rs->errstr; }
int64_t reqstore_claim_in_ms(const reqstore *rs) { return rs->claim_in_ms; }
struct rconn *reqstore_conn(reqstore *rs) { return rs->c; }

/* KEYS: hash, stream, consumer name (not a key; passed here so that the
 * script stays the same for every router).  ARGV: request id, owner, then
 * field/value pairs.  The entry names both, which find the hash.  Reading the entry back into this consumer's pending
 * list makes XPENDING show the accepted, unfinished requests; entries of
 * other producers it also reads stay pending and are picked up by
 * reqstore_recover at the next start.  A missing stream means Redis lost
 * its data: the script then fails with NOGROUP before it writes anything
 * (the group lives in the stream key), so the retry after the group is
 * made again leaves no stray entry. */
static const char reqstore_create_lua[] =
    "if redis.call('EXISTS', KEYS[2]) == 0 then\n"
    "  return redis.error_reply('NOGROUP stream ' .. KEYS[2] .. ' does not exist')\n"
    "end\n"
    "redis.call('DEL', KEYS[1], KEYS[1] .. ':gen')\n"
    "redis.call('HSET', KEYS[1], unpack(ARGV, 3))\n"
    "local e = redis.call('XADD', KEYS[2], '*', 'id', ARGV[1], 'owner', ARGV[2])\n"
    "redis.call('HSET', KEYS[1], 'entry', e)\n"
    "redis.call('XREADGROUP', 'GROUP', '" REQSTORE_GROUP "', KEYS[3], 'COUNT', '1000000',\n"
    "           'STREAMS', KEYS[2], '>')\n"
    "return e\n";

int reqstore_create(reqstore *rs, struct reqrec *r) {
    char hkey[256], gkey[256];
    reqstore_keys(rs, r->owner, r->id, hkey, gkey, sizeof hkey);
    uint8_t *prompt = malloc((size_t)r->n_prompt * 4 + 1);
    if (!prompt) {
        snprintf(rs->errstr, sizeof rs->errstr, "reqstore: out of memory for %d prompt tokens",
                 r->n_prompt);
        return STATUS_NO_MEMORY;
    }
    reqstore_tokens_encode(r->prompt, r->n_prompt, prompt);
    char seed[32], created[32], deadline[32];
    snprintf(seed, sizeof seed, "%" PRIu64, r->seed);
    snprintf(created, sizeof created, "%" PRId64, r->created_ms);
    snprintf(deadline, sizeof deadline, "%" PRId64, r->deadline_ms);
    const char *argv[] = {"EVAL", reqstore_create_lua, "3", hkey, rs->stream, rs->consumer, r->id, r->owner,
                          "params", (const char *)r->params, "prompt", (const char *)prompt,
                          "seed", seed, "created_ms", created, "deadline_ms", deadline,
                          "state", "queued", "owner", r->owner};
    size_t lens[sizeof argv / sizeof argv[0]];
    for (size_t i = 0; i < sizeof argv / sizeof argv[0]; i++)
        lens[i] = i == 9 ? r->params_len : i == 11 ? (size_t)r->n_prompt * 4 : strlen(argv[i]);
    redisReply *rep = NULL;
    int rc = rconn_command_argv(rs->c, &rep, (int)(sizeof argv / sizeof argv[0]), argv, lens);
    if (reqstore_regroup(rs, rc))
        rc = rconn_command_argv(rs->c, &rep, (int)(sizeof argv / sizeof argv[0]), argv, lens);
    free(prompt);
    if (rc < 0) return reqstore_fail(rs, rc);
    if (rep->type == REDIS_REPLY_STRING && rep->len < RCONN_ID_MAX) {
        memcpy(r->entry, rep->str, rep->len);
        r->entry[rep->len] = '\0';
    }
    freeReplyObject(rep);
    r->state = REQREC_QUEUED;
    return STATUS_OK;
}

/* KEYS: the owner record.  ARGV: the registering key, the TTL in ms.
 * Returns {} when the key may have the id (the record now names it), else
 * {holder, its PTTL}. */
static const char reqstore_worker_claim_lua[] =
    "local o = redis.call('GET', KEYS[1])\n"
    "if o and o ~= ARGV[1] then return {o, redis.call('PTTL', KEYS[1])} end\n"
    "redis.call('SET', KEYS[1], ARGV[1], 'PX', ARGV[2])\n"
    "return {}\n";

static void reqstore_worker_key(const reqstore *rs, const char *id, char *key, size_t size) {
    snprintf(key, size, "%sworker-owner:%s", rs->prefix, id);
}

int reqstore_worker_claim(reqstore *rs, const char *id, const char *key, int64_t ttl_ms, char *holder,
                          size_t size, int64_t *ttl_left_ms) {
    char rkey[256], ttl[32];
    reqstore_worker_key(rs, id, rkey, sizeof rkey);
    snprintf(ttl, sizeof ttl, "%" PRId64, ttl_ms);
    holder[0] = '\0';
    *ttl_left_ms = 0;
    const char *argv[] = {"EVAL", reqstore_worker_claim_lua, "1", rkey, key, ttl};
    redisReply *rep = NULL;
    int rc = rconn_command_argv(rs->c, &rep, 6, argv, NULL);
    if (rc < 0) return reqstore_fail(rs, rc);
    if (rep->type != REDIS_REPLY_ARRAY || (rep->elements != 0 && rep->elements != 2)) {
        snprintf(rs->errstr, sizeof rs->errstr, "redis %s: claiming worker %s: unexpected reply", rkey, id);
        rc = STATUS_PROTOCOL;
    } else if (rep->elements == 2) {
        const redisReply *o = rep->element[0], *t = rep->element[1];
        if (o->type == REDIS_REPLY_STRING)
            snprintf(holder, size, "%.*s", (int)o->len, o->str);
        if (t->type == REDIS_REPLY_INTEGER) *ttl_left_ms = t->integer;
        rc = 1;
    }
    freeReplyObject(rep);
    return rc;
}

int reqstore_worker_own(reqstore *rs, const char *id, const char *key, int64_t ttl_ms) {
    char rkey[256];
    reqstore_worker_key(rs, id, rkey, sizeof rkey);
    int rc = rconn_set(rs->c, rkey, key, strlen(key), ttl_ms);
    return rc < 0 ? reqstore_fail(rs, rc) : STATUS_OK;
}

static const char reqstore_append_lua[] =
    "for i = 1, #KEYS do redis.call('APPEND', KEYS[i], ARGV[i]) end\n"
    "return #KEYS\n";

int reqstore_append(reqstore *rs, const struct reqstore_append *a, size_t n) {
    size_t m = 0;
    for (size_t i = 0; i < n; i++) m += a[i].n > 0;
    if (m == 0) return STATUS_OK;
    int argc = 3 + 2 * (int)m;
    const char **argv = calloc((size_t)argc, sizeof *argv);
    size_t *lens = calloc((size_t)argc, sizeof *lens);
    char(*keys)[256] = calloc(m, sizeof *keys);
    size_t total = 0;
    for (size_t i = 0; i < n; i++) total += (size_t)(a[i].n > 0 ? a[i].n : 0) * 4;
    uint8_t *bytes = malloc(total + 1);
    int rc = STATUS_NO_MEMORY;
    if (!argv || !lens || !keys || !bytes) {
        snprintf(rs->errstr, sizeof rs->errstr, "reqstore: out of memory appending to %zu requests",
                 m);
        goto done;
    }
    char nkeys[32];
    snprintf(nkeys, sizeof nkeys, "%zu", m);
    argv[0] = "EVAL";
    argv[1] = reqstore_append_lua;
    argv[2] = nkeys;
    size_t k = 0, off = 0;
    for (size_t i = 0; i < n; i++) {
        if (a[i].n <= 0) continue;
        char hkey[256];
        reqstore_keys(rs, a[i].owner, a[i].id, hkey, keys[k], sizeof keys[k]);
        argv[3 + k] = keys[k];
        reqstore_tokens_encode(a[i].tokens, a[i].n, bytes + off);
        argv[3 + m + k] = (const char *)(bytes + off);
        lens[3 + m + k] = (size_t)a[i].n * 4;
        off += (size_t)a[i].n * 4;
        k++;
    }
    for (int i = 0; i < 3 + (int)m; i++) lens[i] = strlen(argv[i]);
    redisReply *rep = NULL;
    rc = rconn_command_argv(rs->c, &rep, argc, argv, lens);
    if (rc < 0) reqstore_fail(rs, rc);
    else freeReplyObject(rep);
done:
    free(argv);
    free(lens);
    free(keys);
    free(bytes);
    return rc;
}

/* KEYS: hash, gen, stream.  ARGV: group, entry ("" = none), retention ms,
 * then field/value pairs. */
static const char reqstore_finish_lua[] =
    "redis.call('HSET', KEYS[1], unpack(ARGV, 4))\n"
    "if ARGV[2] ~= '' then\n"
    "  redis.call('XACK', KEYS[3], ARGV[1], ARGV[2])\n"
    "  redis.call('XDEL', KEYS[3], ARGV[2])\n"
    "end\n"
    "redis.call('PEXPIRE', KEYS[1], ARGV[3])\n"
    "redis.call('PEXPIRE', KEYS[2], ARGV[3])\n"
    "return 1\n";

int reqstore_finish(reqstore *rs, const struct reqrec *r) {
    char hkey[256], gkey[256];
    reqstore_keys(rs, r->owner, r->id, hkey, gkey, sizeof hkey);
    char ret[32], fin[16], stok[16], ecode[16];
    snprintf(ret, sizeof ret, "%" PRId64, rs->retention_ms);
    snprintf(fin, sizeof fin, "%d", (int)r->finish);
    snprintf(stok, sizeof stok, "%d", (int)r->stop_token);
    snprintf(ecode, sizeof ecode, "%d", (int)r->error_code);
    const char *argv[] = {"EVAL", reqstore_finish_lua, "3", hkey, gkey, rs->stream,
                          REQSTORE_GROUP, r->entry, ret,
                          "state", "done", "finish", fin, "stop_token", stok,
                          "stop_string", r->stop_string ? r->stop_string : "",
                          "error_code", ecode,
                          "error_message", r->error_message ? r->error_message : ""};
    redisReply *rep = NULL;
    int rc = rconn_command_argv(rs->c, &rep, (int)(sizeof argv / sizeof argv[0]), argv, NULL);
    if (rc < 0) return reqstore_fail(rs, rc);
    freeReplyObject(rep);
    return STATUS_OK;
}

static const struct rconn_field *reqstore_field(const struct rconn_fields *f, const char *name) {
    for (size_t i = 0; i < f->n; i++)
        if (strcmp(f->items[i].name, name) == 0) return &f->items[i];
    return NULL;
}

static int reqstore_int(reqstore *rs, const char *key, const struct rconn_fields *f,
                        const char *name, int64_t *out, int required) {
    const struct rconn_field *v = reqstore_field(f, name);
    if (!v) {
        if (!required) return STATUS_OK;
        snprintf(rs->errstr, sizeof rs->errstr, "redis %s: field %s is missing", key, name);
        return STATUS_PROTOCOL;
    }
    char *end = NULL;
    long long x = strtoll((const char *)v->val, &end, 10);
    if (v->len == 0 || !end || *end != '\0') {
        snprintf(rs->errstr, sizeof rs->errstr, "redis %s: field %s = \"%.40s\" is not an integer",
                 key, name, (const char *)v->val);
        return STATUS_PROTOCOL;
    }
    *out = x;
    return STATUS_OK;
}

static char *reqstore_strdup(const struct rconn_field *v) {
    if (!v || v->len == 0) return NULL;
    char *s = malloc(v->len + 1);
    if (s) {
        memcpy(s, v->val, v->len);
        s[v->len] = '\0';
    }
    return s;
}

static int reqstore_load_hash(reqstore *rs, const char *owner, const char *id, struct reqrec *r) {
    memset(r, 0, sizeof *r);
    char hkey[256], gkey[256];
    reqstore_keys(rs, owner, id, hkey, gkey, sizeof hkey);
    struct rconn_fields f = {0};
    int rc = rconn_hgetall(rs->c, hkey, &f);
    if (rc < 0) return reqstore_fail(rs, rc);
    if (f.n == 0) {
        rconn_fields_free(&f);
        snprintf(rs->errstr, sizeof rs->errstr, "redis %s: no such request", hkey);
        return STATUS_NOT_FOUND;
    }
    snprintf(r->id, sizeof r->id, "%s", id);
    int64_t v = 0;
    const struct rconn_field *params = reqstore_field(&f, "params");
    const struct rconn_field *prompt = reqstore_field(&f, "prompt");
    const struct rconn_field *state = reqstore_field(&f, "state");
    const struct rconn_field *entry = reqstore_field(&f, "entry");
    rc = STATUS_PROTOCOL;
    if (!params || !prompt || !state) {
        snprintf(rs->errstr, sizeof rs->errstr, "redis %s: field %s is missing", hkey,
                 !params ? "params" : !prompt ? "prompt" : "state");
        goto fail;
    }
    if (prompt->len % 4 != 0 || prompt->len == 0) {
        snprintf(rs->errstr, sizeof rs->errstr,
                 "redis %s: field prompt has %zu bytes, not a positive multiple of 4", hkey,
                 prompt->len);
        goto fail;
    }
    if (strcmp((const char *)state->val, "queued") == 0) r->state = REQREC_QUEUED;
    else if (strcmp((const char *)state->val, "done") == 0) r->state = REQREC_DONE;
    else {
        snprintf(rs->errstr, sizeof rs->errstr, "redis %s: field state = \"%.32s\" is unknown", hkey,
                 (const char *)state->val);
        goto fail;
    }
    r->params = malloc(params->len + 1);
    r->n_prompt = (int32_t)(prompt->len / 4);
    r->prompt = malloc(prompt->len);
    if (!r->params || !r->prompt) goto oom;
    memcpy(r->params, params->val, params->len);
    r->params_len = params->len;
    reqstore_tokens_decode(prompt->val, r->n_prompt, r->prompt);
    const struct rconn_field *seed = reqstore_field(&f, "seed");
    char *end = NULL;
    r->seed = seed ? strtoull((const char *)seed->val, &end, 10) : 0;
    if (!seed || seed->len == 0 || *end != '\0') {
        snprintf(rs->errstr, sizeof rs->errstr, "redis %s: field seed = \"%.40s\" is not an integer",
                 hkey, seed ? (const char *)seed->val : "(missing)");
        rc = STATUS_PROTOCOL;
        goto fail;
    }
    if ((rc = reqstore_int(rs, hkey, &f, "created_ms", &r->created_ms, 1)) < 0) goto fail;
    if ((rc = reqstore_int(rs, hkey, &f, "deadline_ms", &r->deadline_ms, 1)) < 0) goto fail;
    if (entry && entry->len < RCONN_ID_MAX) memcpy(r->entry, entry->val, entry->len + 1);
    /* The key it was found under names the owner (the hash's own field
     * says the same, and older records than the "req@" keys have it too). */
    snprintf(r->owner, sizeof r->owner, "%s", owner ? owner : "");
    if (r->state == REQREC_DONE) {
        v = 0;
        if ((rc = reqstore_int(rs, hkey, &f, "finish", &v, 1)) < 0) goto fail;
        r->finish = (int32_t)v;
        v = -1;
        if ((rc = reqstore_int(rs, hkey, &f, "stop_token", &v, 0)) < 0) goto fail;
        r->stop_token = (int32_t)v;
        v = 0;
        if ((rc = reqstore_int(rs, hkey, &f, "error_code", &v, 0)) < 0) goto fail;
        r->error_code = (int32_t)v;
        r->stop_string = reqstore_strdup(reqstore_field(&f, "stop_string"));
        r->error_message = reqstore_strdup(reqstore_field(&f, "error_message"));
    }
    rconn_fields_free(&f);

    void *gen = NULL;
    size_t glen = 0;
    rc = rconn_get(rs->c, gkey, &gen, &glen);
    if (rc == STATUS_NOT_FOUND) return STATUS_OK;
    if (rc < 0) {
        reqstore_fail(rs, rc);
        reqrec_free(r);
        return rc;
    }
    r->n_gen = (int32_t)(glen / 4); /* a torn last write cannot happen (APPEND is atomic) */
    r->gen = malloc(glen + 4);
    if (!r->gen) {
        free(gen);
        reqrec_free(r);
        snprintf(rs->errstr, sizeof rs->errstr, "reqstore: out of memory for %s", gkey);
        return STATUS_NO_MEMORY;
    }
    reqstore_tokens_decode(gen, r->n_gen, r->gen);
    free(gen);
    return STATUS_OK;
oom:
    snprintf(rs->errstr, sizeof rs->errstr, "reqstore: out of memory loading %s", hkey);
    rc = STATUS_NO_MEMORY;
fail:
    rconn_fields_free(&f);
    reqrec_free(r);
    return rc;
}

struct reqstore_list {
    struct reqrec *items;
    size_t n, cap;
};

/* Who holds a queued request's stream entry, and since when: with several
 * routers on one Redis, a request another live router runs must not be
 * started here too (its client re-attaching to this router after a broken
 * connection would otherwise run it twice).  Returns 0 when this router may
 * take it: the entry is its own, nobody's, or idle for claim_idle_ms (its
 * holder is dead: the entry is claimed here at once); STATUS_UNAVAILABLE
 * with errstr naming the holder otherwise.  Without --claim-idle-ms no
 * router ever takes another's entries, so none is refused either. */
static int reqstore_entry_guard(reqstore *rs, const char *id, const char *entry) {
    if (rs->claim_idle_ms <= 0 || !entry[0]) return STATUS_OK;
    const char *argv[] = {"XPENDING", rs->stream, REQSTORE_GROUP, entry, entry, "1"};
    redisReply *r = NULL;
    int rc = rconn_command_argv(rs->c, &r, 6, argv, NULL);
    if (rc < 0) return reqstore_fail(rs, rc);
    char holder[128] = "";
    long long idle = 0;
    if (r->type == REDIS_REPLY_ARRAY && r->elements == 1 && r->element[0]->type == REDIS_REPLY_ARRAY &&
        r->element[0]->elements >= 3 && r->element[0]->element[1]->type == REDIS_REPLY_STRING) {
        snprintf(holder, sizeof holder, "%s", r->element[0]->element[1]->str);
        idle = r->element[0]->element[2]->integer;
    }
    freeReplyObject(r);
    if (!holder[0] || strcmp(holder, rs->consumer) == 0) return STATUS_OK;
    if (idle >= rs->claim_idle_ms) {
        char min[32];
        snprintf(min, sizeof min, "%" PRId64, rs->claim_idle_ms);
        const char *cv[] = {"XCLAIM", rs->stream, REQSTORE_GROUP, rs->consumer, min, entry, "JUSTID"};
        rc = rconn_command_argv(rs->c, &r, 7, cv, NULL);
        if (rc < 0) return reqstore_fail(rs, rc);
        bool got = r->type == REDIS_REPLY_ARRAY && r->elements == 1;
        freeReplyObject(r);
        if (got) {
            LOG(LL_INFO, "request %s: taken over from router %s (silent for %lld ms)", id, holder, idle);
            return STATUS_OK;
        }
    }
    snprintf(rs->errstr, sizeof rs->errstr,
             "request %.128s runs on router %.100s (heard from %lld ms ago); it moves to another router "
             "once that one is silent for %" PRId64 " ms: retry",
             id, holder, idle, rs->claim_idle_ms);
    /* Asked again this much later, the entry is taken here if its holder
     * stays silent; the margin covers Redis's millisecond idle clock. */
    rs->claim_in_ms = rs->claim_idle_ms - idle + 10;
    return STATUS_UNAVAILABLE;
}

int reqstore_load(reqstore *rs, const char *owner, const char *id, struct reqrec *r) {
    rs->claim_in_ms = 0;
    int rc = reqstore_load_hash(rs, owner, id, r);
    if (rc < 0 || r->state != REQREC_QUEUED) return rc;
    rc = reqstore_entry_guard(rs, id, r->entry);
    if (rc < 0) reqrec_free(r);
    return rc;
}

/* KEYS: stream.  ARGV: group, consumer.  Resets the idle time of every
 * entry pending for this consumer (XCLAIM to itself, JUSTID: no delivery
 * counted), 1000 at a time: unpack() of more would overflow Lua's stack. */
static const char reqstore_touch_lua[] =
    "local n, start = 0, '-'\n"
    "while true do\n"
    "  local p = redis.call('XPENDING', KEYS[1], ARGV[1], start, '+', 1000, ARGV[2])\n"
    "  if #p == 0 then break end\n"
    "  local a = {'XCLAIM', KEYS[1], ARGV[1], ARGV[2], 0}\n"
    "  for _, e in ipairs(p) do a[#a + 1] = e[1] end\n"
    "  a[#a + 1] = 'JUSTID'\n"
    "  redis.call(unpack(a))\n"
    "  n = n + #p\n"
    "  if #p < 1000 then break end\n"
    "  start = '(' .. p[#p][1]\n"
    "end\n"
    "return n\n";

int reqstore_touch(reqstore *rs) {
    const char *argv[] = {"EVAL", reqstore_touch_lua, "1", rs->stream, REQSTORE_GROUP, rs->consumer};
    redisReply *r = NULL;
    int rc = rconn_command_argv(rs->c, &r, 6, argv, NULL);
    if (reqstore_regroup(rs, rc)) rc = rconn_command_argv(rs->c, &r, 6, argv, NULL);
    if (rc < 0) return reqstore_fail(rs, rc);
    int n = r->type == REDIS_REPLY_INTEGER ? (int)r->integer : 0;
    freeReplyObject(r);
    return n;
}

/* Loads the request of one stream entry into the list, or acknowledges and
 * drops an entry whose request is gone or finished. */
static int reqstore_take(reqstore *rs, const struct rconn_entry *e, struct reqstore_list *l) {
    size_t idlen = 0, olen = 0;
    const char *id = rconn_entry_field(e, "id", &idlen);
    /* No owner field: an entry of a router before owners named entries,
     * whose hash is <p>req:<id>. */
    const char *owner = rconn_entry_field(e, "owner", &olen);
    if (!owner || olen >= sizeof l->items[0].owner) owner = "";
    for (size_t i = 0; id && i < l->n; i++)
        if (strcmp(l->items[i].id, id) == 0 && strcmp(l->items[i].owner, owner) == 0) return STATUS_OK;
    struct reqrec r;
    int rc = id && idlen <= PROTO_REQUEST_KEY_MAX ? reqstore_load_hash(rs, owner, id, &r) : STATUS_NOT_FOUND;
    if (rc == STATUS_UNAVAILABLE || rc == STATUS_TIMEOUT || rc == STATUS_NO_MEMORY) return rc;
    if (rc < 0 || r.state == REQREC_DONE) {
        if (rc < 0)
            LOG(LL_WARN, "recover: dropping stream entry %s (request %.64s): %s", e->id,
                id ? id : "(none)", rs->errstr);
        else
            reqrec_free(&r);
        rconn_xack(rs->c, rs->stream, REQSTORE_GROUP, e->id);
        rconn_xdel(rs->c, rs->stream, e->id);
        return STATUS_OK;
    }
    snprintf(r.entry, sizeof r.entry, "%s", e->id);
    if (l->n == l->cap) {
        size_t cap = l->cap ? l->cap * 2 : 16;
        struct reqrec *p = realloc(l->items, cap * sizeof *p);
        if (!p) {
            reqrec_free(&r);
            return STATUS_NO_MEMORY;
        }
        l->items = p;
        l->cap = cap;
    }
    l->items[l->n++] = r;
    return STATUS_OK;
}

static int reqstore_take_all(reqstore *rs, const struct rconn_entries *es, struct reqstore_list *l) {
    for (size_t i = 0; i < es->n; i++) {
        int rc = reqstore_take(rs, &es->items[i], l);
        if (rc < 0) return rc;
    }
    return STATUS_OK;
}

/* XAUTOCLAIM of every entry idle for claim_idle_ms, loaded into l. */
static int reqstore_claim_into(reqstore *rs, struct reqstore_list *l) {
    struct rconn_entries es = {0};
    char start[RCONN_ID_MAX] = "0-0";
    for (int rounds = 0; rounds < 100000; rounds++) {
        char next[RCONN_ID_MAX];
        int rc = rconn_xautoclaim(rs->c, rs->stream, REQSTORE_GROUP, rs->consumer, rs->claim_idle_ms,
                                  start, 128, &es, next);
        if (reqstore_regroup(rs, rc)) break; /* a new group holds nothing to claim */
        if (rc < 0) return rc;
        rc = reqstore_take_all(rs, &es, l);
        rconn_entries_free(&es);
        if (rc < 0) return rc;
        if (strcmp(next, "0-0") == 0 || next[0] == '\0') break;
        snprintf(start, sizeof start, "%s", next);
    }
    return STATUS_OK;
}

int reqstore_claim(reqstore *rs, struct reqrec **out, size_t *n) {
    *out = NULL;
    *n = 0;
    struct reqstore_list l = {0};
    int rc = reqstore_claim_into(rs, &l);
    if (rc < 0) {
        if (rs->errstr[0] == '\0' || rc != STATUS_NO_MEMORY) reqstore_fail(rs, rc);
        for (size_t i = 0; i < l.n; i++) reqrec_free(&l.items[i]);
        free(l.items);
        return rc;
    }
    *out = l.items;
    *n = l.n;
    return STATUS_OK;
}

int reqstore_recover(reqstore *rs, struct reqrec **out, size_t *n) {
    *out = NULL;
    *n = 0;
    struct reqstore_list l = {0};
    struct rconn_entries es = {0};
    int rc;
    /* 1. This consumer's own pending entries (a restart under the same name). */
    char start[RCONN_ID_MAX] = "0";
    for (;;) {
        rc = rconn_xreadgroup(rs->c, rs->stream, REQSTORE_GROUP, rs->consumer, 128, 0, start, &es);
        if (reqstore_regroup(rs, rc))
            rc = rconn_xreadgroup(rs->c, rs->stream, REQSTORE_GROUP, rs->consumer, 128, 0, start, &es);
        if (rc < 0) goto fail;
        if (es.n == 0) break;
        snprintf(start, sizeof start, "%s", es.items[es.n - 1].id);
        rc = reqstore_take_all(rs, &es, &l);
        rconn_entries_free(&es);
        if (rc < 0) goto fail;
    }
    /* 2. Entries of other consumers idle long enough: a dead router's. */
    rc = reqstore_claim_into(rs, &l);
    if (rc < 0) goto fail;
    /* 3. Entries nobody has read: accepted by a router that died before it
     * read them back, or written by another producer. */
    for (;;) {
        rc = rconn_xreadgroup(rs->c, rs->stream, REQSTORE_GROUP, rs->consumer, 128, 0, ">", &es);
        if (rc < 0) goto fail;
        if (es.n == 0) break;
        rc = reqstore_take_all(rs, &es, &l);
        rconn_entries_free(&es);
        if (rc < 0) goto fail;
    }
    *out = l.items;
    *n = l.n;
    return STATUS_OK;
fail:
    if (rs->errstr[0] == '\0' || rc != STATUS_NO_MEMORY) reqstore_fail(rs, rc);
    for (size_t i = 0; i < l.n; i++) reqrec_free(&l.items[i]);
    free(l.items);
    return rc;
}
