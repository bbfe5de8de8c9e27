/* llm-cluster up, in order: Redis (with a password and its append-only
 * file), the routers, the workers, waiting until every pipeline serves,
 * the gateway, then the run dir's files that point clients at it all. */
#include "router/cluster-impl.h"

#include "common/rconn.h"
#include "common/status.h"

#include <errno.h>
#include <fcntl.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/random.h>
#include <sys/stat.h>
#include <unistd.h>

/* The --redis words for the router and the workers (u->redis_plain and
 * u->redis_pwfile, see cl_redis_prepare). */
static int cl_redis_words(const struct cl_up *u, char **argv, int n) {
    argv[n++] = "--redis";
    argv[n++] = (char *)u->redis_plain;
    if (u->redis_pwfile[0]) {
        argv[n++] = "--redis-password-file";
        argv[n++] = (char *)u->redis_pwfile;
    }
    return n;
}

/* For the private Redis the URL without its password and the password file
 * beside it, so that no command line shows the password; a --redis URL
 * given to llm-cluster is passed as it came. */
static void cl_redis_prepare(struct cl_up *u) {
    const char *at = strchr(u->redis_url, '@');
    u->redis_pwfile[0] = 0;
    if ((u->redis && u->redis[0]) || !at) {
        cl_fmt(u->redis_plain, sizeof u->redis_plain, "%s", u->redis_url);
        return;
    }
    cl_fmt(u->redis_plain, sizeof u->redis_plain, "redis://%s", at + 1);
    cl_fmt(u->redis_pwfile, sizeof u->redis_pwfile, "%s/redis.password", u->dir);
}

static int cl_start_redis(struct cl_up *u, char *err, size_t errlen) {
    if (cl_find_redis(u->bin_redis, sizeof u->bin_redis, err, errlen) < 0) return STATUS_NOT_FOUND;
    int port = cl_free_port(err, errlen);
    if (port < 0) return STATUS_IO;
    char port_s[16];
    cl_fmt(port_s, sizeof port_s, "%d", port);
    /* A fresh password (requirepass), in a config file of the run dir that
     * only this user reads, so that it is not on redis-server's command
     * line; the URL that carries it goes to env.sh. */
    uint8_t raw[16];
    if (getrandom(raw, sizeof raw, 0) != (ssize_t)sizeof raw) {
        cl_fmt(err, errlen, "getrandom: %s", strerror(errno));
        return STATUS_IO;
    }
    char password[2 * sizeof raw + 1], conf[PATH_MAX + 32], text[128];
    for (size_t i = 0; i < sizeof raw; i++) cl_fmt(password + 2 * i, 3, "%02x", raw[i]);
    cl_fmt(conf, sizeof conf, "%s/redis.conf", u->dir);
    cl_fmt(text, sizeof text, "requirepass %s\n", password);
    int fd = open(conf, O_WRONLY | O_CREAT | O_TRUNC | O_CLOEXEC, 0600);
    if (fd < 0 || fchmod(fd, 0600) != 0 || write(fd, text, strlen(text)) != (ssize_t)strlen(text)) {
        cl_fmt(err, errlen, "%s: %s", conf, strerror(errno));
        if (fd >= 0) close(fd);
        return STATUS_IO;
    }
    close(fd);
    /* The same password for the router and the workers, in a file they
     * read (--redis-password-file), so that their command lines, which
     * every user of the host sees in ps, carry only the host and port. */
    char pwfile[PATH_MAX + 32];
    cl_fmt(pwfile, sizeof pwfile, "%s/redis.password", u->dir);
    cl_fmt(text, sizeof text, "%s\n", password);
    fd = open(pwfile, O_WRONLY | O_CREAT | O_TRUNC | O_CLOEXEC, 0600);
    if (fd < 0 || fchmod(fd, 0600) != 0 || write(fd, text, strlen(text)) != (ssize_t)strlen(text)) {
        cl_fmt(err, errlen, "%s: %s", pwfile, strerror(errno));
        if (fd >= 0) close(fd);
        return STATUS_IO;
    }
    close(fd);
    /* A private store that survives its own restart: the append-only file
     * in the run dir, written to disk every second (at most a second of
     * writes lost); no RDB snapshots besides. */
    char *argv[] = {u->bin_redis, conf, "--port", port_s, "--bind", "127.0.0.1", "--dir", u->dir,
                    "--save", "", "--appendonly", "yes", "--appendfsync", "everysec",
                    "--daemonize", "no", NULL};
    int rc = cl_spawn(u, "redis", "redis-server", argv, err, errlen);
    if (rc < 0) return rc;
    cl_fmt(u->redis_url, sizeof u->redis_url, "redis://:%s@127.0.0.1:%d", password, port);
    int64_t end = cl_now_ms() + 10000;
    for (;;) {
        struct rconn *rc_conn = NULL;
        char e2[256];
        if (rconn_open_url(u->redis_url, 500, &rc_conn, e2, sizeof e2) == 0 && rconn_ping(rc_conn) == 0) {
            rconn_close(rc_conn);
            return 0;
        }
        rconn_close(rc_conn);
        int ws;
        struct cl_proc *dead = cl_find_dead(u, &ws);
        if (dead) {
            cl_report_dead(u, dead, ws, "while starting");
            cl_fmt(err, errlen, "redis-server did not start");
            return STATUS_UNAVAILABLE;
        }
        if (cl_now_ms() > end) {
            cl_fmt(err, errlen, "redis-server on port %d did not answer PING within 10 s: %s", port, e2);
            return STATUS_TIMEOUT;
        }
        cl_sleep_ms(50);
    }
}

int cl_poll_status(struct cl_up *u, const struct cl_poll *poll, void *ctx, char *err, size_t errlen) {
    const char *eps[1] = {u->endpoint};
    struct llm_client_config cfg;
    llm_client_config_default(&cfg);
    cfg.endpoints = eps;
    cfg.n_endpoints = 1;
    cfg.reply_timeout_ms = 1000;
    cfg.retry_ms = 1000;
    char key[PATH_MAX + 64], router_key[PATH_MAX + 64];
    cl_client_keys(u->dir, &cfg, key, router_key, sizeof key);
    llm_client *c;
    int rc = llm_client_open(&c, &cfg, err, errlen);
    if (rc < 0) return rc;
    int64_t end = cl_now_ms() + (int64_t)u->timeout_s * 1000;
    char problem[512] = "no answer from the router yet";
    for (;;) {
        int ws;
        struct cl_proc *dead = cl_find_dead(u, &ws);
        if (dead) {
            cl_report_dead(u, dead, ws, poll->dead_when);
            cl_fmt(err, errlen, "%s stopped %s", dead->name, poll->dead_during);
            rc = STATUS_UNAVAILABLE;
            break;
        }
        Llm__ClientEnvelope *env = NULL;
        if (llm_client_status(c, &env) == 0) {
            int done = poll->judge(u, env->status_reply, ctx, problem, sizeof problem);
            proto_client_free(env);
            if (done) {
                rc = 0;
                break;
            }
        } else {
            cl_fmt(problem, sizeof problem, "%s", llm_client_errstr(c));
        }
        if (cl_now_ms() > end) {
            cl_fmt(err, errlen, "%s within --timeout-s %d: %s", poll->timeout_what, u->timeout_s, problem);
            rc = STATUS_TIMEOUT;
            break;
        }
        cl_sleep_ms(200);
    }
    llm_client_close(c);
    return rc;
}

/* cl_wait_ready's judge: every pipeline ready; progress on stderr when the
 * count changes (ctx: the last count). */
static int cl_judge_ready(struct cl_up *u, const Llm__StatusReply *s, void *ctx, char *problem, size_t n) {
    int *last_ready = ctx, ready = 0;
    for (size_t i = 0; i < s->n_pipelines; i++) ready += s->pipelines[i]->ready ? 1 : 0;
    cl_fmt(problem, n, "%d of %d pipelines ready, %zu workers known", ready, u->pipelines, s->n_workers);
    if (ready != *last_ready) {
        fprintf(stderr, "llm-cluster: %s\n", problem);
        *last_ready = ready;
    }
    return ready >= u->pipelines;
}

/* Polls the router until every pipeline is ready, checking all along that
 * no process died; progress on stderr when it changes. */
static int cl_wait_ready(struct cl_up *u, char *err, size_t errlen) {
    static const struct cl_poll poll = {cl_judge_ready, "before the cluster was in service",
                                        "while the cluster was starting", "the cluster was not in service"};
    int last_ready = -1;
    return cl_poll_status(u, &poll, &last_ready, err, errlen);
}

/* The gateway on 127.0.0.1:--http-port, a client of the router with its
 * own key in keys/clients/, started once the cluster serves; returns when
 * its /ready says it reaches a serving router, so that the first request
 * after `up` is answered. */
static int cl_start_gateway(struct cl_up *u, const char *pub_router, char *err, size_t errlen) {
    char listen[64], metrics[64], key[PATH_MAX + 64], keys_file[PATH_MAX + 32];
    int mport = cl_free_port(err, errlen);
    if (mport < 0) return STATUS_IO;
    cl_fmt(listen, sizeof listen, "127.0.0.1:%d", u->http_port);
    cl_fmt(metrics, sizeof metrics, "127.0.0.1:%d", mport);
    if (u->api_keys_file && u->api_keys_file[0]) {
        cl_fmt(keys_file, sizeof keys_file, "%s", u->api_keys_file);
    } else {
        cl_fmt(keys_file, sizeof keys_file, "%s/api-key", u->dir);
        int rc = cl_api_key_ensure(keys_file, err, errlen);
        if (rc < 0) return rc;
    }
    char *argv[CL_ARGS_MAX];
    int n = 0;
    argv[n++] = u->bin_gateway;
    argv[n++] = "--listen";
    argv[n++] = listen;
    argv[n++] = "--router";
    argv[n++] = u->endpoint;
    argv[n++] = "--model";
    argv[n++] = (char *)u->model;
    argv[n++] = "--metrics-listen";
    argv[n++] = metrics;
    argv[n++] = "--api-keys-file";
    argv[n++] = keys_file;
    argv[n++] = "--log-level";
    argv[n++] = (char *)u->log_level;
    if (u->chat_template && u->chat_template[0]) {
        argv[n++] = "--chat-template";
        argv[n++] = (char *)u->chat_template;
    }
    if (u->insecure) {
        argv[n++] = "--insecure";
    } else {
        cl_key_path(key, sizeof key, u->dir, "clients/gateway.key");
        argv[n++] = "--curve-key-file";
        argv[n++] = key;
        argv[n++] = "--router-key";
        argv[n++] = (char *)pub_router;
    }
    argv[n] = NULL;
    int rc = cl_spawn(u, "gateway", "llm-gateway", argv, err, errlen);
    if (rc < 0) return rc;
    u->procs[u->n_procs - 1].metrics_port = mport;
    cl_fmt(u->http_url, sizeof u->http_url, "http://127.0.0.1:%d/v1", u->http_port);
    int64_t end = cl_now_ms() + 30000;
    for (;;) {
        int ws;
        struct cl_proc *dead = cl_find_dead(u, &ws);
        if (dead) {
            cl_report_dead(u, dead, ws, "while the gateway was starting");
            cl_fmt(err, errlen, "%s stopped while the gateway was starting", dead->name);
            return STATUS_UNAVAILABLE;
        }
        int code = cl_http_status(mport, "/ready");
        if (code == 200 && cl_http_status(u->http_port, "/v1/models") > 0) return 0;
        if (cl_now_ms() > end) {
            cl_fmt(err, errlen, "the gateway on %s was not ready within 30 s (its /ready on port %d: %d); see %s/gateway.log",
                   listen, mport, code, u->dir);
            return STATUS_TIMEOUT;
        }
        cl_sleep_ms(100);
    }
}

int cl_worker_threads(const struct cl_up *u, int n_workers) {
    if (u->threads > 0) return u->threads;
    long cores = sysconf(_SC_NPROCESSORS_ONLN);
    return n_workers > 0 && cores / n_workers > 0 ? (int)(cores / n_workers) : 1;
}

int cl_spawn_worker(struct cl_up *u, int p, int s, int threads, int n_gpus, char *err, size_t errlen) {
    char name[64], pid_s[16], sid_s[16], nst_s[16], thr_s[16], kv_s[16], dev[32], listen[64], extra_w[1024],
        metrics_w[64], wkey[PATH_MAX + 96];
    char *argv[CL_ARGS_MAX];
    int idx = p * u->stages + s, n = 0;
    cl_fmt(name, sizeof name, "worker-p%d-s%d", p, s);
    cl_fmt(pid_s, sizeof pid_s, "%d", p);
    cl_fmt(sid_s, sizeof sid_s, "%d", s);
    cl_fmt(nst_s, sizeof nst_s, "%d", u->stages);
    cl_fmt(thr_s, sizeof thr_s, "%d", threads);
    cl_fmt(kv_s, sizeof kv_s, "%d", u->kv_blocks);
    if (n_gpus > 0) cl_fmt(dev, sizeof dev, "cuda:%d", idx % n_gpus);
    else cl_fmt(dev, sizeof dev, "cpu");
    int lport = cl_free_port(err, errlen);
    if (lport < 0) return STATUS_IO;
    cl_fmt(listen, sizeof listen, "tcp://127.0.0.1:%d", lport);
    int mport = cl_free_port(err, errlen);
    if (mport < 0) return STATUS_IO;
    cl_fmt(metrics_w, sizeof metrics_w, "127.0.0.1:%d", mport);
    cl_fmt(extra_w, sizeof extra_w, "%s", u->worker_args ? u->worker_args : "");
    argv[n++] = u->bin_worker;
    argv[n++] = "--model";
    argv[n++] = (char *)u->model;
    argv[n++] = "--router";
    argv[n++] = u->worker_eps;
    n = cl_redis_words(u, argv, n);
    argv[n++] = "--worker-id";
    argv[n++] = name;
    argv[n++] = "--pipeline";
    argv[n++] = pid_s;
    argv[n++] = "--stage";
    argv[n++] = sid_s;
    argv[n++] = "--stages";
    argv[n++] = nst_s;
    argv[n++] = "--listen";
    argv[n++] = listen;
    argv[n++] = "--device";
    argv[n++] = dev;
    argv[n++] = "--threads";
    argv[n++] = thr_s;
    argv[n++] = "--metrics-listen";
    argv[n++] = metrics_w;
    if (u->kv_blocks > 0) {
        argv[n++] = "--kv-blocks";
        argv[n++] = kv_s;
    }
    argv[n++] = "--log-level";
    argv[n++] = (char *)u->log_level;
    if (u->insecure) {
        argv[n++] = "--insecure";
    } else {
        cl_fmt(wkey, sizeof wkey, "%s/keys/workers/%s.key", u->dir, name);
        argv[n++] = "--curve-key-file";
        argv[n++] = wkey;
        argv[n++] = "--router-key";
        argv[n++] = u->pub_router;
    }
    if ((n = cl_add_words(argv, n, extra_w, err, errlen)) < 0) return STATUS_BAD_INPUT;
    argv[n] = NULL;
    int rc = cl_spawn(u, name, "llm-worker", argv, err, errlen);
    if (rc < 0) return rc;
    u->procs[u->n_procs - 1].metrics_port = mport;
    return 0;
}

int cl_up_run(struct cl_up *u, char *err, size_t errlen) {
    int rc = cl_check_model(u->model, err, errlen);
    if (rc < 0) return rc;
    if (cl_mkdirs(u->run_dir, err, errlen) < 0) return STATUS_IO;
    if (!realpath(u->run_dir, u->dir)) {
        cl_fmt(err, errlen, "run dir %s: %s", u->run_dir, strerror(errno));
        return STATUS_IO;
    }
    /* Everything in the run dir is this user's alone: Redis's append-only
     * file holds every prompt and completion, the logs may quote them, and
     * the keys and passwords are there.  The umask reaches what the
     * processes started below create (the AOF, its rewrites); what an
     * earlier run left is made private here. */
    umask(077);
    cl_private_dir(u->dir);
    char running[64];
    pid_t other = cl_running_pid(u->dir, running, sizeof running);
    if (other) {
        cl_fmt(err, errlen, "a cluster already runs from %s (%s, pid %d): llm-cluster down --run-dir %s first",
                 u->dir, running, (int)other, u->dir);
        return STATUS_UNAVAILABLE;
    }
    if ((rc = cl_find_sibling("llm-router", "router", u->bin_router, sizeof u->bin_router, err, errlen)) < 0 ||
        (rc = cl_find_sibling("llm-worker", "worker", u->bin_worker, sizeof u->bin_worker, err, errlen)) < 0)
        return rc;
    int port = u->port;
    if (port == 0 && (port = cl_free_port(err, errlen)) < 0) return STATUS_IO;
    if ((rc = cl_port_free("--port", port, err, errlen)) < 0) return rc;
    if (u->http_port > 0) {
        if ((rc = cl_port_free("--http-port", u->http_port, err, errlen)) < 0) return rc;
        if ((rc = cl_find_sibling("llm-gateway", "gateway", u->bin_gateway, sizeof u->bin_gateway, err, errlen)) < 0)
            return rc;
    }

    if (u->redis && u->redis[0]) {
        cl_fmt(u->redis_url, sizeof u->redis_url, "%s", u->redis);
        struct rconn *r = NULL;
        char e2[256];
        if (rconn_open_url(u->redis_url, 2000, &r, e2, sizeof e2) < 0 || rconn_ping(r) < 0) {
            cl_fmt(err, errlen, "--redis %s: %s", u->redis_url, r ? rconn_errstr(r) : e2);
            rconn_close(r);
            return STATUS_UNAVAILABLE;
        }
        rconn_close(r);
    } else if ((rc = cl_start_redis(u, err, errlen)) < 0) {
        return rc;
    }
    char marker[PATH_MAX + 32], key_router[PATH_MAX + 64], keys_clients[PATH_MAX + 64],
        keys_workers[PATH_MAX + 64], keys_admin[PATH_MAX + 64];
    cl_fmt(marker, sizeof marker, "%s/insecure", u->dir);
    cl_key_path(key_router, sizeof key_router, u->dir, "router.key");
    cl_key_path(u->pub_router, sizeof u->pub_router, u->dir, "router.pub");
    cl_key_path(keys_clients, sizeof keys_clients, u->dir, "clients");
    cl_key_path(keys_workers, sizeof keys_workers, u->dir, "workers");
    cl_key_path(keys_admin, sizeof keys_admin, u->dir, "admin");
    if (u->insecure) {
        fprintf(stderr, "llm-cluster: --insecure: no keys; anyone who reaches the ports is served\n");
        cl_write_file(marker, "started with --insecure\n");
    } else {
        unlink(marker);
        if ((rc = cl_make_keys(u, err, errlen)) < 0) return rc;
    }

    /* The routers: with --routers N, N of them on the same Redis with the
     * same key pair, so that workers and clients admit each alike; the
     * workers and clients get every endpoint and move to the next when one
     * stops answering, and the routers take over each other's requests
     * (--claim-idle-ms, docs/router.md "Fail-over"). */
    char extra_r[1024], stages_s[16];
    cl_fmt(stages_s, sizeof stages_s, "%d", u->stages);
    cl_redis_prepare(u);
    char *argv[CL_ARGS_MAX];
    int n = 0;
    u->endpoints[0] = 0;
    u->worker_eps[0] = 0;
    for (int r = 0; r < u->routers; r++) {
        char client_ep[64], worker_ep[64], metrics_r[64], rname[32], rid[32];
        int cport = r == 0 ? port : cl_free_port(err, errlen);
        int wport = cl_free_port(err, errlen);
        int metrics_port = cl_free_port(err, errlen);
        if (cport < 0 || wport < 0 || metrics_port < 0) return STATUS_IO;
        cl_fmt(metrics_r, sizeof metrics_r, "127.0.0.1:%d", metrics_port);
        cl_fmt(client_ep, sizeof client_ep, "tcp://127.0.0.1:%d", cport);
        cl_fmt(worker_ep, sizeof worker_ep, "tcp://127.0.0.1:%d", wport);
        if (r == 0) cl_fmt(u->endpoint, sizeof u->endpoint, "%s", client_ep);
        size_t el = strlen(u->endpoints), wl = strlen(u->worker_eps);
        cl_fmt(u->endpoints + el, sizeof u->endpoints - el, "%s%s", r ? "," : "", client_ep);
        cl_fmt(u->worker_eps + wl, sizeof u->worker_eps - wl, "%s%s", r ? "," : "", worker_ep);
        if (r == 0) {
            cl_fmt(rname, sizeof rname, "router");
            cl_fmt(rid, sizeof rid, "router");
        } else {
            cl_fmt(rname, sizeof rname, "router%d", r + 1);
            cl_fmt(rid, sizeof rid, "router-%d", r + 1);
        }
        cl_fmt(extra_r, sizeof extra_r, "%s", u->router_args ? u->router_args : "");
        n = 0;
        argv[n++] = u->bin_router;
        argv[n++] = "--model";
        argv[n++] = (char *)u->model;
        argv[n++] = "--listen";
        argv[n++] = client_ep;
        argv[n++] = "--worker-listen";
        argv[n++] = worker_ep;
        argv[n++] = "--router-id";
        argv[n++] = rid;
        if (u->routers > 1) {
            argv[n++] = "--claim-idle-ms";
            argv[n++] = "5000";
        }
        n = cl_redis_words(u, argv, n);
        argv[n++] = "--stages";
        argv[n++] = stages_s;
        argv[n++] = "--metrics-listen";
        argv[n++] = metrics_r;
        argv[n++] = "--log-level";
        argv[n++] = (char *)u->log_level;
        if (u->insecure) {
            argv[n++] = "--insecure";
        } else {
            argv[n++] = "--curve-key-file";
            argv[n++] = key_router;
            argv[n++] = "--client-keys";
            argv[n++] = keys_clients;
            argv[n++] = "--worker-keys";
            argv[n++] = keys_workers;
            argv[n++] = "--admin-keys";
            argv[n++] = keys_admin;
        }
        if ((n = cl_add_words(argv, n, extra_r, err, errlen)) < 0) return STATUS_BAD_INPUT;
        argv[n] = NULL;
        if ((rc = cl_spawn(u, rname, "llm-router", argv, err, errlen)) < 0) return rc;
        u->procs[u->n_procs - 1].metrics_port = metrics_port;
    }

    /* The workers. */
    int n_gpus = strcmp(u->device, "auto") == 0 ? cl_gpu_count() : 0;
    int n_workers = u->pipelines * u->stages;
    int threads = cl_worker_threads(u, n_workers);
    if (n_gpus > 0 && n_gpus < n_workers)
        fprintf(stderr, "llm-cluster: %d workers share %d GPUs\n", n_workers, n_gpus);
    for (int p = 0; p < u->pipelines; p++)
        for (int s = 0; s < u->stages; s++)
            if ((rc = cl_spawn_worker(u, p, s, threads, n_gpus, err, errlen)) < 0) return rc;
    if ((rc = cl_wait_ready(u, err, errlen)) < 0) return rc;
    if (u->http_port > 0 && (rc = cl_start_gateway(u, u->pub_router, err, errlen)) < 0) return rc;
    if ((rc = cl_write_targets(u, err, errlen)) < 0) return rc;
    if ((rc = cl_conf_write(u, err, errlen)) < 0) return rc;

    char path[PATH_MAX + 32], text[512];
    cl_fmt(path, sizeof path, "%s/endpoint", u->dir);
    cl_fmt(text, sizeof text, "%s\n", u->endpoint);
    cl_write_file(path, text);
    cl_fmt(path, sizeof path, "%s/cluster.env", u->dir);
    cl_fmt(text, sizeof text, "LLM_ROUTER=%s\nLLM_REDIS_URL=%s\n", u->endpoints, u->redis_url);
    cl_write_file(path, text);
    chmod(path, 0600);
    cl_fmt(path, sizeof path, "%s/http-url", u->dir);
    if (u->http_url[0]) {
        cl_fmt(text, sizeof text, "%s\n", u->http_url);
        cl_write_file(path, text);
    } else {
        unlink(path);
    }
    if (cl_write_env(u) < 0) {
        cl_fmt(err, errlen, "%s/env.sh: cannot write it", u->dir);
        return STATUS_IO;
    }
    return 0;
}
