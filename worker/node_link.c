/* The worker's links to its neighbouring stages: made or remade for each
 * placement (ZeroMQ or NCCL), and the hidden-state rows a step receives and
 * sends over them. */
#include "node-impl.h"
#include "node_metrics.h"

#include "common/log.h"
#include "common/rconn.h"
#include "common/status.h"

#include <stdio.h>
#include <string.h>

/* The type this stage sends hidden states in: --link-dtype, or F16 for
 * auto on either transport (docs/deploy.md, "Across hosts"). */
static enum link_dtype node_link_dtype(const node *n) {
    return n->cfg.link_dtype >= 0 ? (enum link_dtype)n->cfg.link_dtype : LINK_DTYPE_F16;
}

void node_links_close(node *n, int keep_rx_zmq) {
    if (n->tx) link_free(n->tx);
    n->tx = NULL;
    n->next_endpoint[0] = 0;
    if (n->rx && !(keep_rx_zmq && !link_on_device(n->rx))) {
        link_free(n->rx);
        n->rx = NULL;
        memset(n->rx_dropped_mark, 0, sizeof n->rx_dropped_mark);
    }
}

/* Makes the links the current placement needs: a receiving link unless this
 * is the first stage, a sending one unless it is the last.  ZeroMQ: the
 * receiving socket was bound at init; the sending one connects to the
 * next stage's endpoint from the RegisterReply.  NCCL: new communicators
 * for every epoch.  On failure the node keeps serving, failing plans with
 * the reason, until a later RegisterReply makes the links. */
static int node_links_setup(node *n, const char *next_ep, const char *next_key, int whole, char *err,
                            size_t errlen) {
    int first = stage_is_first(n->s), last = stage_is_last(n->s);
    if (n->device_links) {
        if (n->links_ok && n->links_epoch == n->epoch) return STATUS_OK;
        node_links_close(n, 0);
        if (first && last) {
            n->links_epoch = n->epoch;
            return STATUS_OK;
        }
        /* NCCL needs both ends at once, at the same epoch: before the
         * pipeline is whole the next registration changes the epoch and a
         * peer would never come. */
        if (!whole) {
            snprintf(err, errlen, "stage %d: waiting for the other stages of pipeline %u",
                     n->stage_index, n->pipeline_id);
            return STATUS_UNAVAILABLE;
        }
        if (!*n->s_redis) {
            snprintf(err, errlen, "stage %d: NCCL links need --redis to exchange their ids",
                     n->stage_index);
            return STATUS_BAD_INPUT;
        }
        /* A connection of this thread's own: the io thread's is in use for heartbeats. */
        struct rconn *redis = NULL;
        int rc = rconn_open_url(n->s_redis, 2000, &redis, err, errlen);
        if (rc < 0) return rc;
        /* NCCL has no header to name the type: both ends are given it and
         * check in Redis that they were given the same. */
        struct link_nccl_opts o = {
            .dtype = node_link_dtype(n),
            .row_elems = (size_t)n->dim,
            .bytes_max = (size_t)n->n_tokens_max * (size_t)n->dim * sizeof(float),
            .timeout_ms = n->cfg.link_timeout_ms,
        };
        char key[128];
        if (!first) {
            link_nccl_key(key, sizeof key, n->pipeline_id, (uint32_t)(n->stage_index - 1), n->epoch);
            rc = link_nccl_init(&n->rx, n->b, LINK_RECV, redis, key, &o, err, errlen);
        }
        if (rc == STATUS_OK && !last) {
            link_nccl_key(key, sizeof key, n->pipeline_id, (uint32_t)n->stage_index, n->epoch);
            rc = link_nccl_init(&n->tx, n->b, LINK_SEND, redis, key, &o, err, errlen);
        }
        rconn_close(redis);
        if (rc < 0) return rc;
        n->links_epoch = n->epoch;
        return STATUS_OK;
    }
    if (!first && !n->rx) {
        snprintf(err, errlen, "stage %d has no ZeroMQ endpoint bound for the previous stage",
                 n->stage_index);
        return STATUS_INTERNAL;
    }
    if (n->rx) link_set_epoch(n->rx, n->epoch);
    if (last) {
        if (n->tx) link_free(n->tx);
        n->tx = NULL;
        n->next_endpoint[0] = 0;
        return STATUS_OK;
    }
    if (!next_ep || !*next_ep) {
        snprintf(err, errlen, "stage %d of %d: the router gave no next_stage_endpoint yet",
                 n->stage_index, n->stage_count);
        return STATUS_UNAVAILABLE;
    }
    if (n->secure && (!next_key || !keys_z85_valid(next_key))) {
        snprintf(err, errlen, "stage %d of %d: the router gave no valid next_stage_key (\"%.48s\"); "
                 "does it run with keys?", n->stage_index, n->stage_count, next_key ? next_key : "");
        return STATUS_UNAVAILABLE;
    }
    if (!n->secure) next_key = "";
    /* A new epoch gets a new connection even to the same endpoint.  The
     * pipeline is re-formed after a fault, and the old connection has no
     * ZMTP heartbeats (link_zmq.c): if the network lost what it carried,
     * its TCP retransmissions have backed off (0.2 s doubling from the
     * fault: 2.6 s after the heal of a 10 s outage, up to about the
     * outage's own length in general) and the new epoch's steps would
     * queue behind them.  A fresh connect is answered within a round trip once
     * the network is back; a connect made during the fault is retried
     * within ZIO_CONNECT_TIMEOUT_MS.  What the old connection still holds
     * is of the old epoch, which the next stage drops anyway. */
    if (!n->tx || strcmp(next_ep, n->next_endpoint) != 0 || strcmp(next_key, n->next_key) != 0 ||
        n->links_epoch != n->epoch) {
        if (n->tx) link_free(n->tx);
        n->tx = NULL;
        int rc = link_zmq_init_curve(&n->tx, n->zctx, LINK_SEND, next_ep, n->cfg.link_timeout_ms,
                                     n->secure ? &n->kp : NULL, next_key, err, errlen);
        if (rc < 0) return rc;
        enum link_dtype t = node_link_dtype(n);
        if ((rc = link_set_dtype(n->tx, t, (size_t)n->dim)) < 0) {
            snprintf(err, errlen, "%s", link_errstr(n->tx));
            link_free(n->tx);
            n->tx = NULL;
            return rc;
        }
        snprintf(n->next_endpoint, sizeof n->next_endpoint, "%s", next_ep);
        snprintf(n->next_key, sizeof n->next_key, "%s", next_key);
        n->links_epoch = n->epoch;
        LOG(LL_INFO, "stage %d: sending hidden states to %s as %s (epoch %llu)", n->stage_index, next_ep,
            link_dtype_names[t], (unsigned long long)n->epoch);
    }
    link_set_epoch(n->tx, n->epoch);
    link_set_abort(n->tx, &n->placements_sent);
    return STATUS_OK;
}

/* Applies a RegisterReply (compute thread, or before it starts). */
void node_placement_apply(node *n, const Llm__RegisterReply *r, uint32_t session) {
    char err[512] = "";
    int rc = STATUS_OK;
    if (!r->accepted) return;
    int32_t first = (int32_t)r->layer_first, end = (int32_t)r->layer_end;
    pthread_mutex_lock(&n->lock);
    int moved = r->epoch != n->epoch || r->pipeline_id != n->pipeline_id;
    if (moved)
        LOG(LL_INFO, "pipeline %u: epoch %llu -> %llu", r->pipeline_id,
            (unsigned long long)n->epoch, (unsigned long long)r->epoch);
    else if (session != n->epoch_session)
        LOG(LL_INFO, "pipeline %u: epoch %llu again, from router session %u (was %u): a new placement",
            r->pipeline_id, (unsigned long long)r->epoch, session, n->epoch_session);
    /* Epochs are unique within one router only: two routers started in the
     * same millisecond count from the same base, so a worker moving to
     * the other can be given the epoch it has.  A router re-forms the
     * pipeline for every new session's Register anyway, so a reply of a new
     * session is a new placement whatever its epoch. */
    moved = moved || session != n->epoch_session;
    n->epoch_session = session;
    n->pipeline_id = r->pipeline_id;
    if (r->stage_count > 0) {
        n->stage_index = (int32_t)r->stage_index;
        n->stage_count = (int32_t)r->stage_count;
    }
    n->epoch = r->epoch;
    pthread_mutex_unlock(&n->lock);
    /* A new epoch is a new scheduler at the router (the pipeline was
     * re-formed, or another router placed us): it re-plans every sequence
     * it resumes from position 0 and will never free the old ones, so the
     * stage's view of its KV starts empty.  The same epoch again in the
     * same session (a resent reply) keeps it. */
    if (moved) node_seqs_reset(n, "a new placement epoch");
    if (end > 0 && (first != n->layer_first || end != n->layer_end)) {
        LOG(LL_WARN, "router placed this worker on layers %d:%d (it loaded %d:%d): reloading",
            first, end, n->layer_first, n->layer_end);
        atomic_store(&n->state, LLM__HEARTBEAT__STATE__STARTING);
        node_links_close(n, 1);
        pthread_mutex_lock(&n->lock);
        rc = node_stage_load(n, first, end, err, sizeof err);
        pthread_mutex_unlock(&n->lock);
    }
    /* Only the predecessor the router placed may send on our link (a
     * connection it admitted before stays until it closes; the epoch
     * check drops what such a stale peer sends). */
    if (n->zap && zio_zap_set_one(n->zap, LINK_ZAP_DOMAIN, r->prev_stage_key, "previous stage") < 0 &&
        r->prev_stage_key[0])
        LOG(LL_WARN, "pipeline %u stage %d: the router's prev_stage_key \"%.48s\" is not a key: the "
            "link admits nobody", r->pipeline_id, n->stage_index, r->prev_stage_key);
    if (rc == STATUS_OK)
        rc = node_links_setup(n, r->next_stage_endpoint, r->next_stage_key, r->pipeline_whole, err,
                              sizeof err);
    n->links_ok = rc == STATUS_OK;
    pthread_mutex_lock(&n->lock); /* the io thread reads links_err for heartbeats */
    snprintf(n->links_err, sizeof n->links_err, "%s", rc == STATUS_OK ? "" : err);
    pthread_mutex_unlock(&n->lock);
    if (rc == STATUS_OK) {
        atomic_store(&n->state, LLM__HEARTBEAT__STATE__READY);
        LOG(LL_INFO, "pipeline %u stage %d/%d (layers %d:%d), epoch %llu: ready", n->pipeline_id,
            n->stage_index, n->stage_count, n->layer_first, n->layer_end,
            (unsigned long long)n->epoch);
    } else {
        /* Waiting for the neighbours is a normal start; anything else failed. */
        atomic_store(&n->state, rc == STATUS_UNAVAILABLE ? LLM__HEARTBEAT__STATE__STARTING
                                                         : LLM__HEARTBEAT__STATE__FAILED);
        LOG(rc == STATUS_UNAVAILABLE ? LL_INFO : LL_ERROR, "pipeline %u stage %d: %s",
            n->pipeline_id, n->stage_index, err);
    }
}

/* Receives this step's input rows from the previous stage into
 * batch->hidden_in.  Returns 0, LINK_SKIPPED or a negative status. */
int node_input_recv(node *n, uint64_t step, int32_t T, struct forward_batch *batch,
                           char *err, size_t errlen) {
    size_t rows = (size_t)T * n->dim;
    int rc;
    if (link_on_device(n->rx)) {
        /* Straight into the rows the step reads (the previous step's output,
         * sent on before this receive on the same stream). */
        float *in = forward_input_buffer(n->s);
        rc = link_recv(n->rx, step, in, rows * sizeof(float));
        batch->hidden_in = in;
        batch->hidden_in_backend = 1;
    } else {
        rc = link_recv(n->rx, step, n->hidden_in_host, rows * sizeof(float));
        batch->hidden_in = n->hidden_in_host;
        batch->hidden_in_backend = 0;
    }
    /* What the link dropped while waiting (garbage from an admitted peer,
     * stale steps) goes to the metrics, never into this step's result. */
    for (int r = 0; r < LINK_DROP_N; r++) {
        uint64_t d = link_dropped(n->rx, (enum link_drop)r);
        if (d < n->rx_dropped_mark[r]) n->rx_dropped_mark[r] = 0; /* a new link */
        if (d > n->rx_dropped_mark[r])
            node_metrics_link_dropped(n->metrics, (enum link_drop)r, d - n->rx_dropped_mark[r]);
        n->rx_dropped_mark[r] = d;
    }
    if (rc < 0)
        snprintf(err, errlen, "%s", link_errstr(n->rx));
    return rc;
}

/* Sends this step's output rows to the next stage (out->hidden already
 * holds them for a host link; an NCCL link encodes them from the stage's
 * device buffer). */
int node_output_send(node *n, uint64_t step, int32_t T, char *err, size_t errlen) {
    size_t rows = (size_t)T * n->dim;
    int64_t t0 = node_now_us();
    int rc;
    if (link_on_device(n->tx)) {
        rc = link_send(n->tx, step, forward_hidden(n->s), rows * sizeof(float));
    } else {
        rc = link_send(n->tx, step, n->hidden_out_host, rows * sizeof(float));
    }
    if (rc < 0) snprintf(err, errlen, "%s", link_errstr(n->tx));
    else node_metrics_link_send(n->metrics, n->stage_index, (double)(node_now_us() - t0) / 1e6);
    return rc;
}

/* Tells the next stage not to wait for a step that failed here.  ZeroMQ
 * carries a skip marker.  NCCL has no way to say it: when the step's size
 * is known (T > 0) the stage's output buffer goes out anyway, encoded as
 * the link's type (so its size is what the next stage's receive, already
 * queued on its stream, waits for) and the receive completes; its result is
 * meaningless and this stage's StepResult tells the router the step failed.
 * With T = 0 the plan was refused before its size was known, and the next
 * stage, checking the same plan, refuses it too. */
void node_skip_send(node *n, uint64_t step, int32_t T) {
    if (!n->tx || !n->links_ok) return;
    int rc;
    if (!link_on_device(n->tx)) rc = link_send(n->tx, step, NULL, 0);
    else if (T > 0) rc = link_send(n->tx, step, forward_hidden(n->s), (size_t)T * n->dim * sizeof(float));
    else return;
    if (rc < 0)
        LOG(LL_WARN, "step %llu: telling the next stage it failed here: %s",
            (unsigned long long)step, link_errstr(n->tx));
}
