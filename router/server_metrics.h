/* The router's metrics (docs/metrics.md): the families it exports, the
 * hooks its event loop calls, and the /ready state the metrics port reads.
 * llm-router makes one, serves its registry with common/httpd and passes it
 * to the server in server_config.metrics; a server without one (tests)
 * records nothing: every hook takes NULL.
 *
 * Threads: the hooks run on the router's loop thread; the registry is
 * rendered and server_metrics_ready runs on the metrics port's thread. */
#ifndef ROUTER_SERVER_METRICS_H
#define ROUTER_SERVER_METRICS_H

#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>

#include "common/metrics.h"
#include "router/server.h"

typedef struct server_metrics server_metrics;

/* Returns 0 and *out, or STATUS_NO_MEMORY (STATUS_INTERNAL for a bad
 * definition, a bug) with err filled. */
int server_metrics_init(server_metrics **out, char *err, size_t errlen);
void server_metrics_free(server_metrics *sm); /* NULL is fine */
metrics *server_metrics_registry(server_metrics *sm);
/* An httpd_ready_fn (ud: the server_metrics): NULL while Redis answers and
 * a pipeline is in service, else why not. */
const char *server_metrics_ready(void *ud, char *buf, size_t size);

/* ---- hooks, on the loop thread ------------------------------------------- */

/* Every 50 ms of the loop: the gauges (requests running and waiting, KV
 * blocks, pipelines in service), the token, preemption and prefill-cap
 * counters (from the server's own running totals) and the ready state. */
void server_metrics_tick(server *s);
/* A request's first token came, created_ms (wall clock) after it arrived. */
void server_metrics_first_token(server_metrics *sm, int64_t created_ms, int64_t now_ms);
/* Seconds between two tokens of one request. */
void server_metrics_token_gap(server_metrics *sm, double seconds);
/* A request was placed on a pipeline for the first time. */
void server_metrics_scheduled(server_metrics *sm, int64_t created_ms, int64_t now_ms);
/* The planning of one step took this long (router/server_pipes.c). */
void server_metrics_step_plan(server_metrics *sm, double seconds);
/* A pipeline held its first step this long for more prompts (--batch-wait-us). */
void server_metrics_batch_wait(server_metrics *sm, double seconds);
/* A request finished with a GenerateDone finish reason. */
void server_metrics_finished(server_metrics *sm, int32_t finish, int64_t created_ms, int64_t done_ms);
/* A sequence's drafts were verified: n_accepted of n_draft accepted. */
void server_metrics_spec(server_metrics *sm, int32_t n_draft, int32_t n_accepted, bool model);
/* Refusals (docs/security.md): a Cancel (cancel true) or a re-attaching
 * Generate from a key other than the request's creator; a worker message
 * naming a live worker id from a key other than its owner's.  The refused
 * CURVE handshakes come from the ZAP handler's counters in the tick. */
void server_metrics_request_refused(server_metrics *sm, bool cancel);
enum server_refused_worker { SERVER_REFUSED_REGISTER, SERVER_REFUSED_HEARTBEAT, SERVER_REFUSED_RESULT };
void server_metrics_worker_refused(server_metrics *sm, enum server_refused_worker what);

#endif
