/* llm-cluster's private state and helpers, shared by its files: the
 * command and its subcommands (cmd_cluster.c), starting the cluster in
 * order (cluster_up.c), the run dir's files (cluster_files.c) and its
 * processes (cluster_proc.c).  Only router/cmd_cluster.c and
 * router/cluster_*.c include this. */
#ifndef ROUTER_CLUSTER_IMPL_H
#define ROUTER_CLUSTER_IMPL_H

#include "clients/c/client.h"

#include <limits.h>
#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>
#include <sys/types.h>

#define CL_PROCS_MAX 512
#define CL_ARGS_MAX 96

/* One process `up` started: its name in the run dir (name.pid, name.log)
 * and what its command line must show before `down` signals a pid, so
 * that a pid reused by an unrelated process is never killed. */
struct cl_proc {
    char name[64];
    char program[32]; /* "llm-worker", "llm-router", "llm-gateway", "redis-server" */
    pid_t pid;
    int metrics_port; /* its /metrics on 127.0.0.1, 0 for none (Redis) */
};

struct cl_up {
    const char *model, *redis, *run_dir, *device, *log_level, *router_args, *worker_args, *api_keys_file;
    const char *chat_template; /* the gateway's --chat-template, NULL for the model's own */
    int pipelines, stages, port, threads, timeout_s, kv_blocks, http_port, routers;
    int drain_timeout_s; /* scale: how long the router lets drained pipelines finish their sequences */
    bool insecure;
    char dir[PATH_MAX];     /* run dir, absolute */
    char bin_router[PATH_MAX], bin_worker[PATH_MAX], bin_redis[PATH_MAX], bin_gateway[PATH_MAX];
    char http_url[128];     /* the gateway's base URL, "" without --http-port */
    char redis_url[128];
    /* What the routers and workers get: --redis redis_plain (the private
     * Redis's URL without its password, or --redis as given) and, for the
     * private one, --redis-password-file redis_pwfile ("" for none). */
    char redis_plain[160], redis_pwfile[PATH_MAX + 32];
    char worker_eps[640];   /* every router's worker endpoint, comma-separated (llm-worker --router) */
    char pub_router[PATH_MAX + 64]; /* keys/router.pub */
    char saved[4][PATH_MAX]; /* cl_conf_read's strings: model, device, log level, worker args */
    char endpoint[128];     /* the first router's client endpoint */
    char endpoints[640];    /* every router's, comma-separated (LLM_ROUTER) */
    struct cl_proc procs[CL_PROCS_MAX];
    int n_procs;
};

/* The pid files of a run dir, in the order down stops them: the gateway,
 * the workers, the router, then Redis. */
struct cl_pidfile {
    char name[64];
    char program[32];
    pid_t pid;
};

/* ---- the run dir's files (cluster_files.c) -------------------------------- */

/* Errors go to a caller's err buffer (errlen bytes) with a negative
 * status; functions without one return only the status. */
void cl_fmt(char *out, size_t size, const char *fmt, ...) __attribute__((format(printf, 3, 4)));
/* Writes text to path, readable by this user only (0600). */
int cl_write_file(const char *path, const char *text);
void cl_last_line(const char *path, char *out, size_t size);
/* mkdir -p; the last folder, the run dir, is made 0700. */
int cl_mkdirs(const char *path, char *err, size_t errlen);
/* Makes what an earlier run left in the run dir dir (absolute) private to
 * this user: its files (logs, the AOF, keys, env.sh, ...) lose group and
 * other access, its folders become 0700, and so does dir when an earlier
 * `up` wrote it.  Any other folder, one this user does not own or a sticky
 * one (/tmp) keeps its mode, with a warning on stderr. */
void cl_private_dir(const char *dir);
/* word into out, single-quoted for sh when it needs it (a path with a
 * space), as it is when not. */
void cl_sh_word(char *out, size_t size, const char *word);
int cl_find_sibling(const char *name, const char *folder, char *out, size_t size, char *err, size_t errlen);
int cl_find_redis(char *out, size_t size, char *err, size_t errlen);
int cl_check_model(const char *path, char *err, size_t errlen);
void cl_key_path(char *out, size_t size, const char *dir, const char *which);
int cl_make_keys(struct cl_up *u, char *err, size_t errlen);
void cl_client_keys(const char *dir, struct llm_client_config *cfg, char *key, char *router, size_t size);
int cl_write_env(struct cl_up *u);
int cl_api_key_ensure(const char *path, char *err, size_t errlen);
int cl_write_targets(struct cl_up *u, char *err, size_t errlen);
/* The targets RUN_DIR/prometheus-targets.json lists, into out (at most
 * max; metrics_port and program from the file, pid 0); -1 without the file. */
int cl_read_targets(const char *dir, struct cl_proc *out, int max);
/* keys/workers/NAME.key and .pub: kept when there, else made now. */
int cl_worker_key_ensure(const char *dir, const char *name, char *err, size_t errlen);
/* RUN_DIR/cluster.conf: how `up` started the workers (model, stages,
 * device, threads, KV blocks, log level, extra words, keys or not, Redis,
 * the routers' worker endpoints), so that `scale` starts more the same
 * way.  cl_conf_read fills u (dir set) from it: its strings point into
 * u->saved.  Errors name the file and the line. */
int cl_conf_write(const struct cl_up *u, char *err, size_t errlen);
int cl_conf_read(struct cl_up *u, char *err, size_t errlen);

/* ---- processes (cluster_proc.c) ------------------------------------------- */

int64_t cl_now_ms(void);
void cl_sleep_ms(int ms);
int cl_spawn(struct cl_up *u, const char *name, const char *program, char *const argv[], char *err, size_t errlen);
bool cl_pid_is(pid_t pid, const char *program);
void cl_stop_pid(pid_t pid, const char *program, int grace_ms);
void cl_stop_all(struct cl_up *u);
struct cl_proc *cl_find_dead(struct cl_up *u, int *wstatus);
void cl_report_dead(struct cl_up *u, const struct cl_proc *p, int wstatus, const char *when);
int cl_add_words(char **argv, int n, char *words, char *err, size_t errlen);
int cl_gpu_count(void);
int cl_port_free(const char *option, int port, char *err, size_t errlen);
int cl_free_port(char *err, size_t errlen);
int cl_http_status(int port, const char *path);
/* The pid files of dir into out (at most max), in the order down stops
 * them; -1 with errno when dir cannot be read. */
int cl_read_pidfiles(const char *dir, struct cl_pidfile *out, int max);
/* Some process running from a run dir's pid files, or 0. */
pid_t cl_running_pid(const char *dir, char *name, size_t size);

/* ---- up (cluster_up.c) ---------------------------------------------------- */

/* Starts Redis (unless u->redis), the routers and the workers of u, waits
 * until every pipeline serves, then the gateway (with u->http_port) and
 * writes the run dir's files.  On failure the processes it started stay in
 * u->procs for cl_stop_all. */
int cl_up_run(struct cl_up *u, char *err, size_t errlen);
/* Starts the worker of pipeline p, stage s (worker-pP-sS, its log, pid
 * file and metrics port in u->procs) with threads CPU threads, on GPU
 * (p * stages + s) % n_gpus when n_gpus > 0, else the CPU. */
int cl_spawn_worker(struct cl_up *u, int p, int s, int threads, int n_gpus, char *err, size_t errlen);
/* cl_poll_status's judge of one Status reply: 1 when the wait is over,
 * else 0 with what is still missing in problem. */
typedef int (*cl_judge_fn)(struct cl_up *u, const Llm__StatusReply *s, void *ctx, char *problem, size_t n);
struct cl_poll {
    cl_judge_fn judge;
    const char *dead_when;    /* cl_report_dead's "when" for a process that died meanwhile */
    const char *dead_during;  /* the error's "NAME stopped ..." */
    const char *timeout_what; /* the error's "... within --timeout-s N: problem" */
};
/* Asks u->endpoint's Status every 200 ms until poll->judge says done, a
 * process of u->procs dies (STATUS_UNAVAILABLE) or u->timeout_s passes
 * (STATUS_TIMEOUT); returns 0 when done. */
int cl_poll_status(struct cl_up *u, const struct cl_poll *poll, void *ctx, char *err, size_t errlen);
/* The CPU threads each worker gets: --threads, or the cores shared out
 * over n_workers (at least 1). */
int cl_worker_threads(const struct cl_up *u, int n_workers);

/* ---- scale (cluster_scale.c) ---------------------------------------------- */

/* llm-cluster scale: brings the cluster of u->run_dir to u->pipelines
 * pipelines (docs/deploy.md, "Scaling a running cluster"), waiting at most
 * u->timeout_s for the router to show it; prints what it does on stdout. */
int cl_scale_run(struct cl_up *u, char *err, size_t errlen);

#endif
