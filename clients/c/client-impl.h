/* The body of an llm_client and the helpers that client.c (connection,
 * request/reply) shares with client_generate.c (streamed generation).
 * Only clients/c/client*.c include this. */
#ifndef CLIENTS_C_CLIENT_IMPL_H
#define CLIENTS_C_CLIENT_IMPL_H

#include "client.h"

#include "common/keys.h"
#include "common/zio.h"

struct llm_client {
    char **endpoints;
    size_t n_endpoints, cur;
    void *ctx;
    bool own_ctx;
    struct llm_client_config cfg;
    struct zio_sock *sock; /* DEALER to endpoints[cur]; NULL until needed */
    struct zio_sock *mon;  /* PAIR fed by the DEALER's socket monitor */
    uint32_t n_opened;     /* sockets opened so far (names the monitor's inproc endpoint) */
    bool connected;        /* the socket's TCP (or IPC) connection was made at least once */
    bool lost;             /* it broke, seen while frames were waiting: reported once they are read */
    uint64_t next_tag;
    bool secure;
    struct keys_pair kp;   /* this client's CURVE key pair, when secure */
    char router_pub[KEYS_Z85_LEN + 1];
    char auth_note[320];   /* why the last handshake failed, "" when none did */
    Llm__Error__Code err_code;
    uint32_t retry_after_ms; /* of the router's Error behind err_code */
    char err_reason[64];     /* its reason ("" when none) */
    char errstr[1024];
};

/* What client_wait found.  CLIENT_REFUSED: the endpoint could not be
 * connected to at all (nothing listens there: a router that is down);
 * reported only when there is another endpoint to try. */
enum client_event { CLIENT_MSG = 0, CLIENT_IDLE = 1, CLIENT_LOST = 2, CLIENT_REFUSED = 3 };

/* Monotonic milliseconds. */
int64_t client_now_ms(void);
/* Records an error (code OK: not the router's) in c->errstr. */
void client_seterr(llm_client *c, Llm__Error__Code code, const char *fmt, ...) __attribute__((format(printf, 3, 4)));
/* Sends an envelope on the connection (opened when needed); 0 or a status. */
int client_send(llm_client *c, Llm__ClientEnvelope *env);
/* Waits up to timeout_ms for an envelope: CLIENT_MSG with *env (the caller
 * frees it), CLIENT_IDLE, CLIENT_LOST, CLIENT_REFUSED, or a negative
 * status. */
int client_wait(llm_client *c, int timeout_ms, Llm__ClientEnvelope **env);
/* Opens the connection to the next endpoint; ensure: one if none is open. */
int client_reconnect(llm_client *c, const char *why);
int client_sock_ensure(llm_client *c);
/* Records the router's Error and returns the matching status. */
int client_router_error(llm_client *c, const Llm__Error *e, const char *what);
void client_sleep_ms(int ms);
/* The current endpoint cannot serve now: it answered UNAVAILABLE, or it
 * refused the connection.  Another endpoint may serve at once, so this
 * returns true (try the next one now) until every endpoint in a row could
 * not (*in_a_row counts them); then it sleeps pause_ms (200 when 0), sets
 * *in_a_row back to 0 and returns false: after an UNAVAILABLE the caller
 * asks the same router again, after a refusal it tries the next one. */
bool client_unavailable(llm_client *c, size_t *in_a_row, int pause_ms);
/* The request id an envelope's body names, "" for none. */
const char *client_body_request_id(const Llm__ClientEnvelope *e);

#endif
