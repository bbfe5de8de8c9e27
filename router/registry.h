/* The router's view of its workers and the pipelines they form: placement
 * of workers that let the router choose, the default layer split, liveness
 * from heartbeats (and the workers' Redis keys), and when a pipeline is whole
 * and ready.  No sockets here: the server sends what this module decides.
 *
 * The structs are plain data shared with router/server.c (the router's own
 * modules); other programs never see them. */
#ifndef ROUTER_REGISTRY_H
#define ROUTER_REGISTRY_H

#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>

#include "proto/wire.h"
#include "router/modelinfo.h"

#define REGISTRY_ID_MAX 128
#define REGISTRY_STAGES_MAX 64

enum worker_state {
    WORKER_STARTING = 0,
    WORKER_READY = 1,
    WORKER_DRAINING = 2,
    WORKER_FAILED = 3,
    WORKER_LOST = 4, /* no heartbeat within the timeout, or its Redis key expired */
};
const char *worker_state_name(enum worker_state s); /* "starting", ... */

struct worker {
    char id[REGISTRY_ID_MAX + 1];
    uint64_t incarnation;
    /* Register.session it registered with (0: not stated): a Register of
     * another session is a new connection after a broken one, which may
     * have lost plans or results, so the pipeline re-forms. */
    uint32_t session;
    uint8_t ident[256]; /* ZeroMQ routing id of its connection */
    size_t ident_len;
    uint32_t pipeline_id, stage_index, stage_count;
    uint32_t layer_first, layer_end;
    char model[128], backend[32], device[128], host[128], stage_endpoint[256];
    char draft_model[128]; /* Register.draft_model: beside the last stage; "" none */
    uint32_t pid, kv_block_count, kv_block_size;
    uint32_t max_step_tokens, max_step_seqs; /* 0: not stated */
    uint64_t device_memory_bytes;
    enum worker_state state;
    int64_t last_seen_ms;
    uint64_t last_step_id, steps_total, tokens_total;
    uint32_t kv_used, kv_total;
    bool redis_key_seen; /* its TTL key existed once: its absence now means death */
    bool left;           /* lost while draining: it left on purpose (scale-in), forgotten at once */
    char error[256];     /* the last failure it reported */
    /* The CURVE public key (Z85) it registered from, "" on an insecure
     * router: while it lives, its id belongs to this key. */
    char key[48];
    /* When the router last wrote the id's owner record to Redis
     * (docs/security.md): heartbeats renew it once per worker timeout; 0
     * after a registration, so that the first heartbeat gives it its full
     * lifetime. */
    int64_t owner_written_ms;
    struct worker *hnext; /* the registry's index by id */
};

struct pipeline {
    uint32_t id;
    uint32_t stage_count;
    struct worker *stage[REGISTRY_STAGES_MAX]; /* NULL: no worker yet */
    bool auto_placed;  /* formed by the router from workers with stage_count 0 */
    uint64_t epoch;    /* changes whenever its membership changes */
    bool announce;     /* whole with a new epoch: tell every stage (RegisterReply) */
    char problem[256]; /* why a whole pipeline cannot serve ("" when it can) */
    bool drain;        /* an admin's DrainRequest: no new work placed here (registry_pipeline_draining) */
    void *ud;          /* the server's per-pipeline state */
    struct pipeline *hnext; /* the registry's index by id */
};

typedef struct registry registry;

struct registry_config {
    const struct modelinfo *model; /* kept by reference */
    uint32_t auto_stages;          /* stages per pipeline for self-placing workers */
    int64_t worker_timeout_ms;
    int64_t forget_ms;             /* a lost worker is forgotten after this */
    uint64_t epoch_base;           /* epochs start above this (from the start time, server.c) */
};

int registry_init(registry **out, const struct registry_config *cfg);
void registry_free(registry *r); /* pipelines' ud must be released by the caller first */

/* A Register frame.  On success returns 0, *w the worker (placement final:
 * w->pipeline_id, stage_index, stage_count, layer range) and *p its
 * pipeline; *reformed is true when the pipeline's membership changed (a new
 * worker in a slot, a new incarnation): the caller drops the pipeline's
 * running work.  On refusal returns a negative status with *code and err
 * (naming the worker and the value) for the RegisterReply:
 * STATUS_EXHAUSTED when the stage it names is held by another live worker
 * (worth trying again once that one is lost), STATUS_BAD_INPUT otherwise. */
int registry_register(registry *r, const Llm__Register *m, const void *ident, size_t ident_len,
                      int64_t now_ms, struct worker **w, struct pipeline **p, bool *reformed,
                      Llm__Error__Code *code, char *err, size_t errlen);

/* A Heartbeat: updates the worker.  STATUS_NOT_FOUND when the worker is
 * unknown or the incarnation differs (it must register again). */
int registry_heartbeat(registry *r, const Llm__Heartbeat *m, int64_t now_ms, struct worker **w);

/* Marks workers silent for longer than the timeout as lost, and forgets
 * those lost for longer than forget_ms, and at once those lost while
 * draining, which left on purpose (empty pipelines go too; the caller
 * gets each removed pipeline through drop(p, ud) first).  Returns how many
 * workers became lost. */
int registry_expire(registry *r, int64_t now_ms, void (*drop)(struct pipeline *p, void *ud),
                    void *ud);
/* The pipeline is re-formed in place (a step timed out): a new epoch, to
 * be announced to its stages. */
void registry_pipeline_bump(registry *r, struct pipeline *p);
/* A worker is gone now (its Redis key expired, or it said it stops). */
void registry_mark_lost(registry *r, struct worker *w);
/* A message to w could not be queued (its connection is gone, or full):
 * it may have missed a plan or a free.  A READY worker counts as STARTING
 * until it is heard from again (its next heartbeat, or its Register on a
 * new connection), so its pipeline leaves service; with bump, the pipeline
 * also takes a new epoch, so that every stage forgets the formation the
 * worker may have missed part of (false when the message was the new
 * epoch's announcement itself). */
void registry_worker_unreachable(registry *r, struct worker *w, bool bump);

/* Every stage registered, alive, with consistent layers and block sizes. */
bool registry_pipeline_whole(const registry *r, struct pipeline *p);
/* Whole and every stage READY: it may run steps.  (A DRAINING worker takes
 * no new plans, so its pipeline hands its sequences over.) */
bool registry_pipeline_ready(const registry *r, struct pipeline *p);
/* Some stage DRAINING, or an admin's DrainRequest (p->drain): take no new
 * work. */
bool registry_pipeline_draining(const registry *r, const struct pipeline *p);
/* The smallest kv_block_count of its stages, and their block size. */
uint32_t registry_pipeline_kv_blocks(const registry *r, const struct pipeline *p);
uint32_t registry_pipeline_block_size(const registry *r, const struct pipeline *p);
/* The smallest step limits its stages state (0 when none states one). */
uint32_t registry_pipeline_step_tokens(const registry *r, const struct pipeline *p);
uint32_t registry_pipeline_step_seqs(const registry *r, const struct pipeline *p);

/* The live workers (neither lost nor failed) that hold a stage of a
 * pipeline and run on a GPU (Register.backend "cuda"): the router's
 * --spin-us auto polls while there is one.  O(stages). */
size_t registry_n_gpu_stages(const registry *r);

size_t registry_n_workers(const registry *r);
struct worker *registry_worker_at(registry *r, size_t i);
/* By id, in O(1): every step result names its worker and pipeline. */
struct worker *registry_worker_find(registry *r, const char *id);
size_t registry_n_pipelines(const registry *r);
struct pipeline *registry_pipeline_at(registry *r, size_t i);
struct pipeline *registry_pipeline_find(registry *r, uint32_t id);
/* The worker of stage s of p, or NULL. */
struct worker *registry_stage_worker(registry *r, const struct pipeline *p, uint32_t s);

#endif
