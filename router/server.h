/* The router process's core: two ZeroMQ ROUTER sockets (clients, workers),
 * one single-threaded event loop around zmq_poll, and the glue between the
 * request store (Redis), the worker registry and the per-pipeline
 * schedulers.  See docs/router.md.
 *
 *   server *s; server_init(&s, &cfg, err, sizeof err);
 *   server_run(s, &stop_flag);   // until stop_flag is set (a signal handler)
 *   server_free(s); */
#ifndef ROUTER_SERVER_H
#define ROUTER_SERVER_H

#include <signal.h>
#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>

/* --spec: speculative decoding by default (a request may choose its own). */
enum server_spec { SERVER_SPEC_OFF = 0, SERVER_SPEC_NGRAM = 1, SERVER_SPEC_DRAFT = 2, SERVER_SPEC_AUTO = 3 };
/* The most drafts one step verifies for a sequence (--spec-tokens, a
 * request's spec_tokens). */
#define SERVER_SPEC_TOKENS_MAX 16 /* = PROTO_SPEC_TOKENS_MAX */

struct server_config {
    const char *model_path;    /* GGUF file or HF directory: tokenizer and metadata */
    const char *listen;        /* client endpoint, "tcp://0.0.0.0:5555" */
    const char *worker_listen; /* worker endpoint, "tcp://0.0.0.0:5556" */
    const char *redis_url;
    const char *redis_prefix;  /* "llm:" */
    const char *router_id;     /* consumer name in the request stream's group */
    int max_queue;             /* accepted requests not yet running, at most */
    int step_tokens;           /* token budget of one step (decodes + prefill chunks) */
    int max_batch;             /* sequences running per pipeline, at most */
    int max_step_seqs;         /* sequences in one step, at most (0: no own limit; workers may state one) */
    int heartbeat_ms;          /* interval the workers are told to use */
    int worker_timeout_ms;     /* a worker silent this long is lost */
    int step_timeout_ms;       /* a step without result this long re-forms its pipeline */
    int stages;                /* stages per pipeline for workers that let the router place them */
    int retention_s;           /* finished requests are remembered this long */
    int claim_idle_ms;         /* another router's requests idle this long are taken over */
    int no_prefix_cache;       /* every prompt computed whole (--no-prefix-cache; docs/router.md) */
    int itl_target_ms;         /* inter-token latency the prefill cap keeps (0: no cap; docs/router.md) */
    int batch_wait_us;         /* an idle pipeline's first step waits this long for more prompts (0: none) */
    /* The loop's poll spins this long before blocking (zio_set_spin; 0:
     * none); < 0: auto, ZIO_SPIN_US_GPU while a GPU worker holds a stage
     * of a pipeline (registry_n_gpu_stages), else 0. */
    int spin_us;
    int prefill_hold_tokens;   /* while sequences decode, prompts wait to bring this many tokens (0: none) */
    int prefill_hold_ms;       /* ... but none waits longer than this */
    int client_gone_ms;        /* a request whose client is unreachable this long is cancelled (0: never) */
    /* Speculation (docs/router.md, "Speculation"): enum server_spec, the
     * drafts a step verifies per sequence, and the running sequences per
     * stage up to which SERVER_SPEC_AUTO speculates. */
    int spec;
    int spec_tokens;
    int spec_auto_batch;
    /* Each verdict sets a sequence's next k to its accepted drafts + 1 (all
     * accepted: the drafts + 1), within its own k (--spec-adapt). */
    int spec_adapt;
    /* Security (docs/security.md).  Without insecure, curve_key_file (the
     * router's key pair), client_keys and worker_keys (allowlists: a file or
     * a directory of *.pub) are required. */
    const char *curve_key_file;
    const char *client_keys;
    const char *worker_keys;
    /* Keys that may also send admin messages (DrainRequest): a list file or a
     * directory of *.pub, admitted on the client socket like client_keys;
     * NULL or "": admin messages are refused (an insecure router takes them
     * from anyone). */
    const char *admin_keys;
    bool insecure;             /* plain sockets: anyone who reaches a port is served */
    /* Set (to non-zero) by the caller's SIGHUP handler: the loop rereads
     * client_keys, admin_keys and worker_keys within 50 ms, admits what they list from
     * then on and sets it back to 0; a list that fails to load leaves the
     * old one in force (logged).  NULL: the lists are read at start only. */
    volatile sig_atomic_t *reload_keys;
    struct server_metrics *metrics; /* updated by the loop (router/server_metrics.h), the
                                       caller's; NULL: no metrics */    struct watchdog *watchdog;      /* the loop beats its loop 0 every turn (common/watchdog.h);
                                       the caller's; NULL: none */
};

typedef struct server server;

/* Loads the model's tokenizer and metadata, binds both sockets and
 * connects to Redis (if Redis is down the router starts anyway, answers
 * UNAVAILABLE and keeps trying).  On failure *out is NULL and err names the
 * file, endpoint or value. */
int server_init(server **out, const struct server_config *cfg, char *err, size_t errlen);
/* Serves until *stop becomes non-zero; returns 0. */
int server_run(server *s, volatile sig_atomic_t *stop);
void server_free(server *s); /* NULL is fine */

/* The bound endpoints (with the port a "*" chose). */
const char *server_client_endpoint(const server *s);
const char *server_worker_endpoint(const server *s);

#endif
