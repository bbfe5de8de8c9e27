/* A worker process's life: load one pipeline stage, register with the
 * router (ZeroMQ DEALER) and in Redis (a key with a TTL), heartbeat, and
 * execute the router's step plans strictly in order, with the stage-to-stage
 * links to the neighbouring stages.  It makes no scheduling decision.
 *
 * Two threads: the calling thread talks to the router and Redis (register,
 * heartbeats, error replies to bad frames, forwarding plans and results),
 * so heartbeats keep flowing during a long step; a compute thread executes
 * the plans it is handed, one after the other.  Stage 0 never waits for
 * the last stage: it takes the next plan as soon as it has sent a step's
 * hidden states on, so several micro-batches are in flight along the
 * pipeline.
 *
 *   struct node_config cfg;
 *   node_config_default(&cfg);
 *   cfg.model_path = "m.gguf"; cfg.router = "tcp://router:5556"; ...
 *   node *n;
 *   if (node_init(&n, &cfg, err, sizeof err) < 0) die(err);
 *   rc = node_run(n, &stop_flag, err, sizeof err);   // until stop_flag is set
 *   node_free(n); */
#ifndef WORKER_NODE_H
#define WORKER_NODE_H

#include <signal.h>
#include <stddef.h>
#include <stdint.h>

#include "common/device.h"
#include "common/model.h"

typedef struct node node;

enum node_transport {
    NODE_TRANSPORT_AUTO = 0, /* NCCL between GPU stages when built with it, else ZeroMQ */
    NODE_TRANSPORT_ZMQ = 1,
    NODE_TRANSPORT_NCCL = 2,
};

/* Strings are the caller's and must outlive node_init only (they are copied). */
struct node_config {
    const char *model_path;
    /* A draft model with the same vocabulary (NULL or "": none): loaded
     * beside the stage when the stage is the pipeline's last, to propose
     * the drafts of speculative decoding (worker/draft.h). */
    const char *draft_model;
    float draft_min_prob;       /* draft_config.min_prob (0: always k guesses) */
    int32_t draft_type;         /* draft_config.weight_type: < 0 as stored (node_config_default) */
    const char *worker_id;      /* NULL or "": "<host>-<pid>" */
    struct device_spec device;  /* device_parse of --device; zeroed: auto */
    int require_gpu;            /* no GPU is fatal instead of a fallback to the CPU */
    const char *router;         /* the router's worker endpoint, "tcp://host:port" */
    const char *redis_url;      /* NULL or "": no Redis registration (and no NCCL) */
    const char *listen;         /* where the previous stage's ZeroMQ link connects */
    const char *advertise_host; /* host put in place of "*" / 0.0.0.0 in the endpoint */
    uint32_t pipeline_id;
    int32_t stage_index, stage_count;
    int32_t layer_first, layer_end; /* layer_end > 0: this explicit range */
    /* kv_blocks, max_batch_tokens, max_seqs: 0 = chosen from the memory
     * budget on a GPU, small defaults on the CPU (worker/sizing.h). */
    int32_t kv_blocks;          /* KV blocks */
    double mem_fraction;        /* of the free device memory, for weights + KV + workspace */
    int32_t kv_block_size;
    int32_t kv_type;            /* stage_config.kv_type: DTYPE_F32, F16, Q8_0; < 0: F32 on the CPU, F16 on a GPU */
    int32_t threads;            /* CPU backend threads; 0: one per core */
    int32_t max_batch_tokens;   /* rows per step, all sequences together */
    int32_t max_seqs;           /* sequences per step */
    int32_t ctx;                /* positions per sequence; 0: the model's context length */
    int32_t target_ctx;         /* positions a typical sequence reaches, for the sizing; 0: 2048 */
    enum node_transport transport;
    int link_timeout_ms;        /* bound on one link send/receive (a peer that is gone) */
    /* Hidden states on the wire (enum link_dtype, worker/link.h); < 0: F16
     * on both transports (docs/deploy.md, "Across hosts"). */
    int32_t link_dtype;
    int register_retry_ms;      /* Register is sent again this often until answered */
    /* The io and compute threads' waits poll this long before blocking
     * (zio_set_spin); < 0 (node_config_default): auto, node_spin_us. */
    int spin_us;
    /* CURVE (docs/security.md): this worker's key pair file, used towards
     * the router and on the stage links, and the router's public key file.
     * Both required unless insecure (plain sockets). */
    const char *curve_key_file;
    const char *router_key;
    int insecure;
    /* Liveness (common/watchdog.h), the caller's, NULL for none: node_run
     * beats loop 0 every turn of the io thread, the compute thread loop 1
     * between steps (so a step that hangs, on a stuck link, stops it). */
    struct watchdog *watchdog;
};

void node_config_default(struct node_config *cfg);

/* The spin of a worker's waits for node_config.spin_us on a GPU backend
 * (gpu non-zero) or the CPU: auto (spin_us < 0) is ZIO_SPIN_US_GPU on a
 * GPU and 0 (block at once) on the CPU, whose step needs every core
 * (CI runs CPU workers on two); 0 and above are kept. */
int node_spin_us(int spin_us, int gpu);

/* Opens the backend and the model, loads the stage's layers (logging what
 * weights, KV cache and workspace take; refusing with a message naming the
 * sizes when they do not fit), binds the ZeroMQ link endpoint, connects to
 * Redis.  Returns 0 and *out, or a negative status with the reason in err
 * (*out NULL, nothing left open). */
int node_init(node **out, const struct node_config *cfg, char *err, size_t errlen);

/* Registers and serves until *stop becomes non-zero (a signal handler sets
 * it), then drains: sends Heartbeat DRAINING, finishes the plans it holds,
 * deletes its Redis key and returns 0.  Returns a negative status with the
 * reason in err when it cannot go on (refused by the router without a
 * retry, a link that cannot be set up). */
int node_run(node *n, volatile sig_atomic_t *stop, char *err, size_t errlen);

/* NULL is fine. */
void node_free(node *n);

#endif
