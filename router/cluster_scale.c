/* llm-cluster scale: changes the number of pipelines of a cluster that
 * `up` started, while it serves.  More pipelines: their workers start as
 * `up` starts them (a key each, admitted by the routers on SIGHUP; the same
 * device, threads, Redis and extra words) and the command returns once the
 * router has them in service.  Fewer: the pipelines with the highest ids
 * drain, as Kubernetes removes the highest LeaderWorkerSet group: first the
 * router, asked with llm-cluster's admin key (DrainRequest), places nothing
 * more on them and lets the sequences they run finish there, up to
 * --drain-timeout-s; then their workers get SIGTERM, report DRAINING (the
 * router hands what still runs there to the pipelines that stay: nothing is
 * lost, docs/router.md) and exit, and their keys leave the allowlists. */
#include "router/cluster-impl.h"

#include "common/status.h"

#include <errno.h>
#include <fcntl.h>
#include <signal.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/file.h>
#include <sys/stat.h>
#include <unistd.h>

#define CL_PIPELINES_MAX 64
/* A draining worker leaves within its own bound (llm-worker's 60 s drain)
 * plus deregistering; one still there after this is killed. */
#define CL_DRAIN_WAIT_MS 90000
#define CL_HUP_PAUSE_MS 300

/* The run dir's workers by pipeline, from the pid files. */
struct cl_pipes {
    struct cl_pidfile pf[CL_PROCS_MAX];
    int n_pf;
    int alive[CL_PIPELINES_MAX]; /* workers of pipeline p that run */
    int files[CL_PIPELINES_MAX]; /* pid files of pipeline p */
    int n;                       /* pipelines with a worker that runs */
};

/* "worker-p<P>-s<S>" into p and s. */
static bool cl_worker_name(const char *name, int *p, int *s) {
    int used = 0;
    return sscanf(name, "worker-p%d-s%d%n", p, s, &used) == 2 && name[used] == 0 && *p >= 0 &&
           *p < CL_PIPELINES_MAX && *s >= 0;
}

static void cl_scan(const struct cl_up *u, struct cl_pipes *ps) {
    memset(ps->alive, 0, sizeof ps->alive);
    memset(ps->files, 0, sizeof ps->files);
    ps->n = 0;
    ps->n_pf = cl_read_pidfiles(u->dir, ps->pf, CL_PROCS_MAX);
    if (ps->n_pf < 0) ps->n_pf = 0;
    for (int i = 0; i < ps->n_pf; i++) {
        int p, s;
        if (!cl_worker_name(ps->pf[i].name, &p, &s)) continue;
        ps->files[p]++;
        if (cl_pid_is(ps->pf[i].pid, ps->pf[i].program)) ps->alive[p]++;
    }
    for (int p = 0; p < CL_PIPELINES_MAX; p++) ps->n += ps->alive[p] > 0;
}

/* SIGHUP to every router of the run dir: they reread their allowlists
 * (docs/security.md).  Returns how many got it. */
static int cl_hup_routers(const struct cl_pipes *ps) {
    int n = 0;
    for (int i = 0; i < ps->n_pf; i++)
        if (strcmp(ps->pf[i].program, "llm-router") == 0 && cl_pid_is(ps->pf[i].pid, "llm-router") &&
            kill(ps->pf[i].pid, SIGHUP) == 0)
            n++;
    return n;
}

/* Removes keys/workers/worker-pP-sS.{key,pub} of pipeline p. */
static void cl_forget_keys(const struct cl_up *u, int p) {
    for (int s = 0; s < u->stages; s++) {
        char path[PATH_MAX + 96];
        static const char *const ext[] = {"key", "pub"};
        for (int e = 0; e < 2; e++) {
            cl_fmt(path, sizeof path, "%s/keys/workers/worker-p%d-s%d.%s", u->dir, p, s, ext[e]);
            if (unlink(path) != 0 && errno != ENOENT)
                fprintf(stderr, "llm-cluster scale: %s: %s\n", path, strerror(errno));
        }
    }
}

/* prometheus-targets.json again: what it listed, less the workers of the
 * pipelines in gone, plus the processes this command started. */
static int cl_retarget(struct cl_up *u, const bool *gone, char *err, size_t errlen) {
    struct cl_up *t = calloc(1, sizeof *t);
    if (!t) {
        cl_fmt(err, errlen, "out of memory");
        return STATUS_NO_MEMORY;
    }
    cl_fmt(t->dir, sizeof t->dir, "%s", u->dir);
    int n = cl_read_targets(u->dir, t->procs, CL_PROCS_MAX);
    for (int i = 0; i < n; i++) {
        int p, s;
        bool drop = cl_worker_name(t->procs[i].name, &p, &s) && gone[p];
        for (int j = 0; j < u->n_procs && !drop; j++) drop = strcmp(u->procs[j].name, t->procs[i].name) == 0;
        if (!drop) t->procs[t->n_procs++] = t->procs[i];
    }
    for (int j = 0; j < u->n_procs && t->n_procs < CL_PROCS_MAX; j++) t->procs[t->n_procs++] = u->procs[j];
    int rc = cl_write_targets(t, err, errlen);
    free(t);
    return rc;
}

/* cl_wait_router's judge (ctx: its want and gone); prints the router's
 * summary line when done. */
struct cl_wait_sets {
    const bool *want, *gone;
};
static int cl_judge_sets(struct cl_up *u, const Llm__StatusReply *s, void *ctx, char *problem, size_t n) {
    const struct cl_wait_sets *w = ctx;
    bool seen[CL_PIPELINES_MAX] = {false}, ready[CL_PIPELINES_MAX] = {false};
    problem[0] = 0; /* this answer's, not an earlier one's */
    int n_ready = 0;
    for (size_t i = 0; i < s->n_pipelines; i++) {
        uint32_t id = s->pipelines[i]->pipeline_id;
        n_ready += s->pipelines[i]->ready ? 1 : 0;
        if (id >= CL_PIPELINES_MAX) continue;
        seen[id] = true;
        ready[id] = s->pipelines[i]->ready;
        if (!ready[id] && w->want[id] && s->pipelines[i]->problem && s->pipelines[i]->problem[0])
            cl_fmt(problem, n, "%s", s->pipelines[i]->problem);
    }
    int missing = -1, left = -1;
    for (int p = 0; p < CL_PIPELINES_MAX; p++) {
        if (w->want[p] && !ready[p] && missing < 0) missing = p;
        if (w->gone[p] && seen[p] && left < 0) left = p;
    }
    if (missing < 0 && left < 0) {
        printf("router %s: %d/%zu pipelines ready, %zu workers, queue %u, running %u, KV blocks %llu/%llu\n",
               u->endpoint, n_ready, s->n_pipelines, s->n_workers, s->queue_depth, s->running,
               (unsigned long long)s->kv_blocks_used, (unsigned long long)s->kv_blocks_total);
        return 1;
    }
    if (missing >= 0 && !(seen[missing] && problem[0]))
        cl_fmt(problem, n, "pipeline %d is not ready yet (%s)", missing,
               seen[missing] ? "its stages are loading or forming" : "not all its workers registered");
    else if (left >= 0)
        cl_fmt(problem, n, "pipeline %d is still listed (its workers not yet lost)", left);
    return 0;
}

/* The router's Status, polled until every pipeline in want is ready and
 * none in gone is left (its workers lost or deregistered), for at most
 * u->timeout_s; a process this command started that dies ends it too.
 * Prints the router's summary line at the end. */
static int cl_wait_router(struct cl_up *u, const bool *want, const bool *gone, char *err, size_t errlen) {
    char path[PATH_MAX + 32];
    cl_fmt(path, sizeof path, "%s/endpoint", u->dir);
    cl_last_line(path, u->endpoint, sizeof u->endpoint);
    if (!u->endpoint[0]) {
        cl_fmt(err, errlen, "%s is missing: llm-cluster up did not finish in this run dir", path);
        return STATUS_NOT_FOUND;
    }
    static const struct cl_poll poll = {cl_judge_sets, "before its pipeline was in service",
                                        "while its pipeline was forming", "the router did not show the change"};
    struct cl_wait_sets w = {want, gone};
    return cl_poll_status(u, &poll, &w, err, errlen);
}

static int cl_scale_out(struct cl_up *u, struct cl_pipes *ps, char *err, size_t errlen) {
    bool want[CL_PIPELINES_MAX] = {false}, none[CL_PIPELINES_MAX] = {false};
    int adding = u->pipelines - ps->n, rc = 0;
    /* The lowest free ids, as `up` numbers from 0. */
    for (int p = 0; p < CL_PIPELINES_MAX && adding > 0; p++) {
        if (ps->alive[p]) continue;
        want[p] = true;
        adding--;
    }
    int n_gpus = strcmp(u->device, "auto") == 0 ? cl_gpu_count() : 0;
    int threads = cl_worker_threads(u, u->pipelines * u->stages);
    for (int p = 0; p < CL_PIPELINES_MAX && rc == 0 && !u->insecure; p++)
        for (int s = 0; want[p] && s < u->stages && rc == 0; s++) {
            char name[64];
            cl_fmt(name, sizeof name, "worker-p%d-s%d", p, s);
            rc = cl_worker_key_ensure(u->dir, name, err, errlen);
        }
    if (rc < 0) return rc;
    /* The routers admit the new keys before the workers connect: they
     * reread their lists within about 50 ms of the signal, the pause leaves
     * room on a busy machine, and a worker that still comes early is
     * refused once and tries again after 2 s (docs/security.md). */
    if (!u->insecure) {
        if (cl_hup_routers(ps) == 0) {
            cl_fmt(err, errlen, "no router runs from %s (llm-cluster status shows what does)", u->dir);
            return STATUS_UNAVAILABLE;
        }
        cl_sleep_ms(CL_HUP_PAUSE_MS);
    }
    int64_t t0 = cl_now_ms();
    for (int p = 0; p < CL_PIPELINES_MAX && rc == 0; p++) {
        if (!want[p]) continue;
        /* A pipeline that stopped on its own leaves pid files: new ones replace them. */
        printf("pipeline %d: starting %d workers (worker-p%d-s0..%d, threads %d each)\n", p, u->stages, p,
               u->stages - 1, threads);
        for (int s = 0; s < u->stages && rc == 0; s++) rc = cl_spawn_worker(u, p, s, threads, n_gpus, err, errlen);
    }
    fflush(stdout);
    if (rc == 0) rc = cl_wait_router(u, want, none, err, errlen);
    if (rc < 0) {
        if (u->n_procs) fprintf(stderr, "llm-cluster scale: stopping the %d workers it started\n", u->n_procs);
        cl_stop_all(u);
        for (int p = 0; p < CL_PIPELINES_MAX && !u->insecure; p++)
            if (want[p]) cl_forget_keys(u, p);
        cl_scan(u, ps);
        cl_hup_routers(ps);
        return rc;
    }
    printf("scaled out to %d pipelines: the new ones in service after %.1f s\n", u->pipelines,
           (double)(cl_now_ms() - t0) / 1000.0);
    return cl_retarget(u, none, err, errlen);
}

/* Asks the router to drain the pipelines in gone (DrainRequest with
 * llm-cluster's admin key) and waits until they run nothing, at most
 * u->drain_timeout_s.  Whatever stops it (an older run dir without the
 * key, a router that does not know them, the time) is said on stdout: the
 * SIGTERM after it moves what still runs, so nothing is lost either way. */
static void cl_drain_router(struct cl_up *u, const bool *gone) {
    uint32_t ids[CL_PIPELINES_MAX];
    size_t n = 0;
    for (int p = 0; p < CL_PIPELINES_MAX; p++)
        if (gone[p]) ids[n++] = (uint32_t)p;
    char path[PATH_MAX + 32], key[PATH_MAX + 64], router_key[PATH_MAX + 64];
    cl_fmt(path, sizeof path, "%s/endpoint", u->dir);
    cl_last_line(path, u->endpoint, sizeof u->endpoint);
    const char *eps[1] = {u->endpoint};
    struct llm_client_config cfg;
    llm_client_config_default(&cfg);
    cfg.endpoints = eps;
    cfg.n_endpoints = 1;
    cfg.reply_timeout_ms = 2000;
    cfg.retry_ms = 5000;
    cl_client_keys(u->dir, &cfg, key, router_key, sizeof key);
    if (!cfg.insecure) {
        cl_key_path(key, sizeof key, u->dir, "admin/cluster.key");
        if (access(key, R_OK) != 0) {
            printf("no admin key (%s: an older llm-cluster up): the SIGTERM alone drains, moving what runs\n", key);
            return;
        }
    }
    llm_client *c;
    char err[512];
    if (!u->endpoint[0] || llm_client_open(&c, &cfg, err, sizeof err) < 0) {
        printf("cannot reach the router to drain (%s): the SIGTERM alone drains, moving what runs\n",
               u->endpoint[0] ? err : "no endpoint file");
        return;
    }
    int64_t t0 = cl_now_ms(), end = t0 + (int64_t)u->drain_timeout_s * 1000;
    uint32_t running = 0, first_running = 0;
    for (int round = 0;; round++) {
        Llm__ClientEnvelope *env = NULL;
        if (llm_client_drain(c, ids, n, false, &env) < 0) {
            printf("the router refused the drain (%s): the SIGTERM alone drains, moving what runs\n",
                   llm_client_errstr(c));
            break;
        }
        const Llm__DrainReply *r = env->drain_reply;
        bool idle = true;
        running = 0;
        for (size_t i = 0; i < r->n_pipelines; i++) {
            idle = idle && r->pipelines[i]->idle;
            running += r->pipelines[i]->running;
        }
        proto_client_free(env);
        if (round == 0) first_running = running;
        if (idle) {
            printf("router: no new work to them since %.1f s; the %u sequences they ran finished there\n",
                   (double)(cl_now_ms() - t0) / 1000.0, first_running);
            break;
        }
        if (cl_now_ms() > end) {
            printf("router: after --drain-timeout-s %d, %u sequences still run there: the SIGTERM moves them to the "
                   "pipelines that stay\n", u->drain_timeout_s, running);
            break;
        }
        cl_sleep_ms(100);
    }
    llm_client_close(c);
    fflush(stdout);
}

static int cl_scale_in(struct cl_up *u, struct cl_pipes *ps, char *err, size_t errlen) {
    bool gone[CL_PIPELINES_MAX] = {false}, none[CL_PIPELINES_MAX] = {false};
    int removing = ps->n - u->pipelines;
    for (int p = CL_PIPELINES_MAX - 1; p >= 0 && removing > 0; p--) {
        if (!ps->alive[p]) continue;
        gone[p] = true;
        removing--;
    }
    for (int p = 0; p < CL_PIPELINES_MAX; p++)
        if (gone[p]) printf("pipeline %d: draining\n", p);
    fflush(stdout);
    cl_drain_router(u, gone);
    int64_t t0 = cl_now_ms();
    /* Every stage of a pipeline at once: one stage draining already
     * takes the whole pipeline out of service. */
    for (int p = 0; p < CL_PIPELINES_MAX; p++) {
        if (!gone[p]) continue;
        printf("pipeline %d: SIGTERM to its %d workers\n", p, ps->alive[p]);
        for (int i = 0; i < ps->n_pf; i++) {
            int wp, ws;
            if (cl_worker_name(ps->pf[i].name, &wp, &ws) && wp == p && cl_pid_is(ps->pf[i].pid, "llm-worker"))
                kill(ps->pf[i].pid, SIGTERM);
        }
    }
    fflush(stdout);
    int64_t end = t0 + CL_DRAIN_WAIT_MS;
    for (;;) {
        int running = 0;
        for (int i = 0; i < ps->n_pf; i++) {
            int wp, ws;
            if (cl_worker_name(ps->pf[i].name, &wp, &ws) && gone[wp] && cl_pid_is(ps->pf[i].pid, "llm-worker"))
                running++;
        }
        if (running == 0) break;
        if (cl_now_ms() > end) {
            fprintf(stderr, "llm-cluster scale: %d workers still draining after %d s: killing them\n", running,
                    CL_DRAIN_WAIT_MS / 1000);
            for (int i = 0; i < ps->n_pf; i++) {
                int wp, ws;
                if (cl_worker_name(ps->pf[i].name, &wp, &ws) && gone[wp] && cl_pid_is(ps->pf[i].pid, "llm-worker"))
                    kill(ps->pf[i].pid, SIGKILL);
            }
            break;
        }
        cl_sleep_ms(100);
    }
    printf("drained: their workers stopped after %.1f s\n", (double)(cl_now_ms() - t0) / 1000.0);
    for (int i = 0; i < ps->n_pf; i++) {
        int wp, ws;
        if (!cl_worker_name(ps->pf[i].name, &wp, &ws) || !gone[wp]) continue;
        char path[PATH_MAX + 80];
        cl_fmt(path, sizeof path, "%s/%s.pid", u->dir, ps->pf[i].name);
        unlink(path);
    }
    if (!u->insecure) {
        for (int p = 0; p < CL_PIPELINES_MAX; p++)
            if (gone[p]) cl_forget_keys(u, p);
        cl_hup_routers(ps);
    }
    int rc = cl_retarget(u, gone, err, errlen);
    if (rc == 0) rc = cl_wait_router(u, none, gone, err, errlen);
    if (rc == 0) printf("scaled in to %d pipelines\n", u->pipelines);
    return rc;
}

int cl_scale_run(struct cl_up *u, char *err, size_t errlen) {
    if (!realpath(u->run_dir, u->dir)) {
        cl_fmt(err, errlen, "run dir %s: %s", u->run_dir, strerror(errno));
        return STATUS_NOT_FOUND;
    }
    umask(077);
    int want = u->pipelines, timeout_s = u->timeout_s;
    int rc = cl_conf_read(u, err, errlen);
    if (rc < 0) return rc;
    u->pipelines = want;
    u->timeout_s = timeout_s;
    /* One scale at a time on a run dir: two would pick the same new ids. */
    char path[PATH_MAX + 32];
    cl_fmt(path, sizeof path, "%s/scale.lock", u->dir);
    int lock = open(path, O_RDWR | O_CREAT | O_CLOEXEC, 0600);
    if (lock < 0) {
        cl_fmt(err, errlen, "%s: %s", path, strerror(errno));
        return STATUS_IO;
    }
    if (flock(lock, LOCK_EX | LOCK_NB) != 0) {
        cl_fmt(err, errlen, "another llm-cluster scale is running on %s (%s is locked)", u->dir, path);
        close(lock);
        return STATUS_UNAVAILABLE;
    }
    static struct cl_pipes ps;
    cl_scan(u, &ps);
    bool router = false;
    for (int i = 0; i < ps.n_pf && !router; i++)
        router = strcmp(ps.pf[i].program, "llm-router") == 0 && cl_pid_is(ps.pf[i].pid, "llm-router");
    if (!router) {
        cl_fmt(err, errlen, "no router runs from %s: llm-cluster up --run-dir %s first", u->dir, u->dir);
        close(lock);
        return STATUS_UNAVAILABLE;
    }
    for (int p = 0; p < CL_PIPELINES_MAX; p++)
        if (ps.alive[p] && ps.alive[p] < u->stages)
            fprintf(stderr, "llm-cluster scale: pipeline %d has %d of its %d workers running (see "
                    "worker-p%d-s*.log)\n", p, ps.alive[p], u->stages, p);
    printf("%d pipelines of %d stages running; want %d\n", ps.n, u->stages, u->pipelines);
    if (u->pipelines > ps.n) {
        if ((rc = cl_find_sibling("llm-worker", "worker", u->bin_worker, sizeof u->bin_worker, err, errlen)) == 0)
            rc = cl_scale_out(u, &ps, err, errlen);
    } else if (u->pipelines < ps.n) {
        rc = cl_scale_in(u, &ps, err, errlen);
    } else {
        bool none[CL_PIPELINES_MAX] = {false};
        rc = cl_wait_router(u, none, none, err, errlen);
    }
    close(lock);
    return rc;
}
