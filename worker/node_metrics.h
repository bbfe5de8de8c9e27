/* The worker's metrics (docs/metrics.md): the families it exports, the
 * hooks its threads call, and the /ready answer.  llm-worker makes one,
 * serves its registry with common/httpd and attaches the node once it is
 * loaded; a node without one (tests) records nothing: every hook takes
 * NULL.
 *
 * Threads: node_metrics_step and _link_send run on the compute thread;
 * node_metrics_refresh and node_metrics_ready on the metrics port's thread
 * (they read the node's atomics only). */
#ifndef WORKER_NODE_METRICS_H
#define WORKER_NODE_METRICS_H

#include <stddef.h>
#include <stdint.h>

#include "common/metrics.h"
#include "link.h"
#include "node.h"

typedef struct node_metrics node_metrics;

/* Returns 0 and *out, or STATUS_NO_MEMORY (STATUS_INTERNAL for a bad
 * definition, a bug) with err filled. */
int node_metrics_init(node_metrics **out, char *err, size_t errlen);
void node_metrics_free(node_metrics *nm); /* NULL is fine */
metrics *node_metrics_registry(node_metrics *nm);
/* From now on n records into nm, and the port reports on n; also reads the
 * device's memory.  Call on the thread that called node_init, before
 * node_run.  Stop the port before node_free. */
void node_metrics_attach(node_metrics *nm, node *n);

/* httpd_refresh_fn and httpd_ready_fn (ud: the node_metrics).  Ready while
 * the worker is registered and placed with its links up. */
void node_metrics_refresh(void *ud);
const char *node_metrics_ready(void *ud, char *buf, size_t size);

/* ---- hooks, on the compute thread ---------------------------------------- */

/* One step plan executed by stage stage_index, in seconds. */
void node_metrics_step(node_metrics *nm, int32_t stage_index, double seconds);
/* One send of hidden states to the next stage, in seconds. */
void node_metrics_link_send(node_metrics *nm, int32_t stage_index, double seconds);
/* n messages the receiving link dropped for reason why (link.h). */
void node_metrics_link_dropped(node_metrics *nm, enum link_drop why, uint64_t n);
/* The backend's memory in use (all of the device, other processes too) and
 * its size, in bytes. */
void node_metrics_memory(node_metrics *nm, int32_t stage_index, uint64_t used, uint64_t total);
/* Constrained decoding on the last stage: one mask computed, in seconds;
 * one parse state rebuilt by replaying n_tokens generated tokens. */
void node_metrics_constrain_mask(node_metrics *nm, double seconds);
void node_metrics_constrain_replay(node_metrics *nm, uint64_t n_tokens);

#endif
