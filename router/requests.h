/* Durable requests in Redis: what the router stores before it acknowledges
 * a request, the tokens it generates (so a restarted router, or a request
 * moved off a failed pipeline, resumes where it was and the client sees
 * each token once), and the recovery of every accepted, unfinished request
 * after a router restart.
 *
 * Layout (prefix "llm:" by default):
 *   <p>requests          stream, one entry {id, owner} per accepted request,
 *                        read by the consumer group "routers"; an entry stays
 *                        pending (XPENDING) until the request finishes (XACK +
 *                        XDEL)
 *   <p>req:<id>          a request without an owner (a router without keys);
 *   <p>req@<owner>:<id>  one created by the client key owner (its public key,
 *                        Z85): request ids are per key (docs/security.md)
 *                        hash: params (the canonical GenerateRequest bytes),
 *                        prompt (int32 little-endian), seed, created_ms,
 *                        deadline_ms, state ("queued" | "done"), entry, owner
 *                        (the creating client's public key, "" without keys), and
 *                        when done finish, stop_token, stop_string,
 *                        error_code, error_message
 *   <p>req...<id>:gen    string: the generated tokens, int32 little-endian,
 *                        appended as they are sampled (beside its hash)
 *   <p>worker-owner:<id> string: the public key (Z85) that worker id
 *                        registered from, with a TTL the router renews while
 *                        the worker lives (docs/security.md)
 * Finished requests expire after the retention period. */
#ifndef ROUTER_REQUESTS_H
#define ROUTER_REQUESTS_H

#include <stddef.h>
#include <stdint.h>

#include "common/rconn.h"
#include "proto/wire.h"

typedef struct reqstore reqstore;

struct reqstore_config {
    const char *url;        /* redis://host:port/db */
    const char *prefix;     /* key prefix, "llm:" */
    const char *consumer;   /* this router's consumer name in the group */
    int64_t retention_ms;   /* finished requests are kept this long */
    int64_t claim_idle_ms;  /* another consumer's entries idle this long are claimed */
    int timeout_ms;         /* per Redis reply */
};

enum reqrec_state { REQREC_QUEUED = 0, REQREC_DONE = 1 };

/* One request as stored.  Every pointer is owned by the record: free it
 * with reqrec_free (a zeroed record is empty; reqrec_free leaves it so). */
struct reqrec {
    char id[PROTO_REQUEST_KEY_MAX + 1]; /* a choice's: "<id> <choice>" (server-impl.h) */
    uint8_t *params; /* packed GenerateRequest, canonical (see server.c) */
    size_t params_len;
    int32_t *prompt;
    int32_t n_prompt;
    int32_t *gen;    /* filled by reqstore_load / _recover only */
    int32_t n_gen;
    uint64_t seed;
    int64_t created_ms, deadline_ms; /* Unix ms; deadline 0 = none */
    enum reqrec_state state;
    char entry[RCONN_ID_MAX];        /* stream entry id, "" if not known */
    /* The CURVE public key (Z85) of the client that created it, "" when
     * the router had no keys.  Part of the request's name: the id is the
     * owner's, other keys have their own (docs/security.md, "Request
     * ownership"), and it picks the Redis keys. */
    char owner[48];
    /* When done: */
    int32_t finish;                  /* Llm__GenerateDone__FinishReason */
    int32_t stop_token;
    char *stop_string;               /* may be NULL */
    int32_t error_code;              /* Llm__Error__Code */
    char *error_message;             /* may be NULL */
};
void reqrec_free(struct reqrec *r);

/* Connects (the connection reconnects by itself later) and makes sure the
 * stream and group exist.  On failure *out is NULL, err says why; the
 * caller may retry later.  The strings of cfg are copied. */
int reqstore_open(reqstore **out, const struct reqstore_config *cfg, char *err, size_t errlen);
void reqstore_close(reqstore *rs); /* NULL is fine */
const char *reqstore_errstr(const reqstore *rs);
/* After reqstore_load refused a request another router holds: in how many
 * ms its entry becomes claimable here if that router stays silent (a retry
 * hint); 0 after any other outcome. */
int64_t reqstore_claim_in_ms(const reqstore *rs);
/* The connection, for other keys (the worker registry). */
struct rconn *reqstore_conn(reqstore *rs);

/* Stores a new request: the hash (state queued), then a stream entry whose
 * id goes to r->entry.  Once it returns 0 the request is durable.  When
 * the consumer group is gone (NOGROUP: Redis restarted without its data) it
 * is made again and the request stored at once, so a Redis that lost
 * everything costs no request a retry. */
int reqstore_create(reqstore *rs, struct reqrec *r);

/* Appends generated tokens of several requests in one round trip. */
struct reqstore_append {
    const char *id;
    const int32_t *tokens;
    int32_t n;
    const char *owner; /* the request's owner; NULL or "": none */
};
int reqstore_append(reqstore *rs, const struct reqstore_append *a, size_t n);

/* Marks r done with its finish fields, acknowledges and deletes its stream
 * entry, and lets both keys expire after the retention period. */
int reqstore_finish(reqstore *rs, const struct reqrec *r);

/* Loads request id of owner ("": a request without one) with its generated
 * tokens into *r (zeroed first).  STATUS_NOT_FOUND when Redis does not know
 * the id under that owner (another key's request of that id is not found); STATUS_PROTOCOL when the
 * stored hash is malformed (naming the key and field); STATUS_UNAVAILABLE
 * (errstr names the holder) when, with claim_idle_ms set, the request is
 * queued and its stream entry is held by another router heard from within
 * claim_idle_ms: that router runs it.  A holder silent longer loses the
 * entry to this router here. */
int reqstore_load(reqstore *rs, const char *owner, const char *id, struct reqrec *r);

/* Takes into this consumer every stream entry it should work on: its own
 * pending entries (a restart under the same name), entries of other
 * consumers idle for claim_idle_ms (a dead router), and entries no consumer
 * has read yet.  Each request that is still queued is loaded into the array
 * *out of *n records (the caller frees each with reqrec_free, then the array
 * with free()); entries whose hash is gone or done are acknowledged and
 * dropped.  Requests the caller already has are returned again: skip them. */
int reqstore_recover(reqstore *rs, struct reqrec **out, size_t *n);

/* Several routers on one Redis (docs/router.md, "Fail-over"): every router
 * that lives touches its pending entries each heartbeat (reqstore_touch:
 * their idle time restarts), so an entry idle for claim_idle_ms belongs to
 * a router that is dead or cut off from Redis.  reqstore_claim takes those
 * into this consumer (XAUTOCLAIM) and loads them as reqstore_recover does;
 * the caller skips the ids it already has.  reqstore_touch returns how many
 * entries it touched, or a negative status. */
int reqstore_touch(reqstore *rs);
int reqstore_claim(reqstore *rs, struct reqrec **out, size_t *n);

/* Checks that Redis answers and still holds this router's data (the
 * request stream exists).  Returns 0 when it does; 1 when Redis lost its
 * data since the last check or since reqstore_open (the stream and group
 * are made again here, or were by reqstore_open, or by a create or recover
 * that met NOGROUP): requests only in the caller's memory should be stored
 * again; a negative status (errstr says
 * why) when Redis cannot be reached or refuses us. */
int reqstore_check(reqstore *rs);

/* How often the consumer group was made again after NOGROUP (create and
 * recover do it by themselves); the router notices Redis lost its data. */
uint64_t reqstore_groups_recreated(const reqstore *rs);

/* Worker ids across router restarts (docs/security.md): the record
 * <p>worker-owner:<id> names the key a live worker registered from.
 * reqstore_worker_claim, for an id this router does not know: when the
 * record is absent or names key, writes key with ttl_ms and returns 0; when
 * it names another key, writes nothing and returns 1 with that key in
 * holder (size bytes) and its remaining time in *ttl_left_ms.  One round
 * trip, atomic, so two routers on one Redis never both hand the id out.
 * reqstore_worker_own writes the record whatever it held (the router knows
 * the worker registered from key).  Both return a negative status when
 * Redis fails (errstr says why). */
int reqstore_worker_claim(reqstore *rs, const char *id, const char *key, int64_t ttl_ms, char *holder,
                          size_t size, int64_t *ttl_left_ms);
int reqstore_worker_own(reqstore *rs, const char *id, const char *key, int64_t ttl_ms);

/* Little-endian int32 encoding of token ids (the stored format). */
void reqstore_tokens_encode(const int32_t *ids, int32_t n, uint8_t *out);
void reqstore_tokens_decode(const uint8_t *in, int32_t n, int32_t *ids);

#endif
