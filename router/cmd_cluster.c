/* llm-cluster: the whole cluster on one machine, for a first try and for
 * development.  `up` starts a private redis-server, one llm-router and
 * pipelines x stages llm-workers in the background, waits until every
 * pipeline serves, and prints the router's endpoint and the run directory
 * (pid files, logs, keys, env.sh); `status` and `down` act on what `up`
 * started; `scale --pipelines N` adds or drains pipelines while it serves
 * (cluster_scale.c).  Secure by default: `up` makes CURVE keys for the router, a
 * client and every worker in RUN_DIR/keys/ and starts everything with them;
 * `--insecure` runs without.  `--http-port P` adds an llm-gateway (the
 * OpenAI HTTP API) on 127.0.0.1:P with an API key in RUN_DIR/api-key.  Every
 * process gets a metrics port of its own, listed for Prometheus in
 * RUN_DIR/prometheus-targets.json. */
#include "router/cluster-impl.h"

#include "common/chat_template.h"
#include "common/log.h"
#include "common/options.h"
#include "common/status.h"

#include <errno.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

static int cl_up(int argc, char **argv) {
    static const char *const devices[] = {"auto", "cpu", NULL};
    struct cl_up *u = calloc(1, sizeof *u);
    if (!u) {
        fprintf(stderr, "llm-cluster: out of memory\n");
        return 1;
    }
    int device_i = 0;
    const struct option_def defs[] = {
        {"model", "LLM_MODEL", OPTION_STRING, NULL, "GGUF file or Hugging Face directory", &u->model, 0, 0, NULL},
        {"pipelines", NULL, OPTION_INT, "1", "pipelines (replicas of the model)", &u->pipelines, 1, 64, NULL},
        {"routers", NULL, OPTION_INT, "1",
         "routers on the same Redis and keys; workers and clients get every endpoint and fail over between them",
         &u->routers, 1, 4, NULL},
        {"stages", NULL, OPTION_INT, "2", "stages per pipeline (one worker each)", &u->stages, 1, 64, NULL},
        {"redis", "LLM_REDIS_URL", OPTION_STRING, NULL, "use this Redis instead of starting a private one",
         &u->redis, 0, 0, NULL},
        {"port", "LLM_PORT", OPTION_INT, "5555", "router port for clients on 127.0.0.1 (0: any free port)",
         &u->port, 0, 65535, NULL},
        {"run-dir", "LLM_RUN_DIR", OPTION_STRING, "run/cluster", "where pid files and logs go", &u->run_dir, 0, 0,
         NULL},
        {"device", "LLM_CLUSTER_DEVICE", OPTION_CHOICE, "auto", "auto: one GPU per worker where GPUs are present, else the CPU; cpu: the CPU",
         &device_i, 0, 0, devices},
        {"threads", NULL, OPTION_INT, "0", "CPU threads per worker (0: the cores shared out)", &u->threads, 0,
         1024, NULL},
        {"kv-blocks", NULL, OPTION_INT, "0", "KV blocks per worker (0: the worker's default)", &u->kv_blocks, 0,
         1 << 24, NULL},
        {"timeout-s", NULL, OPTION_INT, "300", "give up if the cluster is not in service by then", &u->timeout_s,
         1, 86400, NULL},
        {"log-level", "LLM_LOG_LEVEL", OPTION_STRING, "info", "log level of the processes", &u->log_level, 0, 0,
         NULL},
        {"router-args", NULL, OPTION_STRING, "", "extra llm-router arguments, space-separated", &u->router_args,
         0, 0, NULL},
        {"worker-args", NULL, OPTION_STRING, "", "extra llm-worker arguments, space-separated", &u->worker_args,
         0, 0, NULL},
        {"insecure", "LLM_INSECURE", OPTION_BOOL, "false",
         "no CURVE keys: plain sockets that anyone who reaches the ports may use", &u->insecure, 0, 0, NULL},
        {"http-port", "LLM_HTTP_PORT", OPTION_INT, "0",
         "also start llm-gateway (the OpenAI HTTP API) on 127.0.0.1:PORT (0: none)", &u->http_port, 0, 65535,
         NULL},
        {"api-keys-file", "LLM_API_KEYS_FILE", OPTION_STRING, NULL,
         "the gateway's API keys, one a line (default: a fresh key in RUN_DIR/api-key)", &u->api_keys_file, 0, 0,
         NULL},
        {"chat-template", "LLM_CHAT_TEMPLATE", OPTION_STRING, NULL,
         "the gateway's chat template family, for a model without a template of its own (llm-gateway "
         "--chat-template): llama2, llama3, chatml, mistral, zephyr, gemma, phi3 or deepseek",
         &u->chat_template, 0, 0, NULL},
    };
    struct options o = {"llm-cluster up", "--model PATH [options]",
                        "Starts Redis, a router and pipelines x stages workers in the background and waits "
                        "until every pipeline serves.",
                        defs, (int)(sizeof defs / sizeof defs[0]), false};
    char err[1024] = "";
    int rc = options_parse(&o, &argc, argv, err, sizeof err);
    if (rc == STATUS_CANCELLED) {
        free(u);
        return 0;
    }
    if (rc < 0 || argc > 1 || !u->model) {
        fprintf(stderr, "llm-cluster up: %s\n",
                rc < 0 ? err : argc > 1 ? "unexpected argument (see --help)" : "need --model PATH");
        free(u);
        return 2;
    }
    u->device = devices[device_i];
    if (u->chat_template && u->chat_template[0]) {
        /* Refused here rather than by the gateway after the cluster started. */
        if (chat_family_from_name(u->chat_template) == CHAT_FAMILY_NONE) {
            fprintf(stderr, "llm-cluster up: --chat-template %s: unknown; expected one of %s\n", u->chat_template,
                    chat_family_names());
            free(u);
            return 2;
        }
        if (u->http_port <= 0)
            fprintf(stderr, "llm-cluster up: --chat-template %s: only the gateway uses it, and without "
                    "--http-port none is started\n", u->chat_template);
    }
    rc = cl_up_run(u, err, sizeof err);
    if (rc < 0) {
        fprintf(stderr, "llm-cluster up: %s\n", err);
        if (u->n_procs) fprintf(stderr, "llm-cluster up: stopping the %d processes it started\n", u->n_procs);
        cl_stop_all(u);
        free(u);
        return 1;
    }
    if (u->routers > 1) printf("routers: %s\nrun dir: %s\n", u->endpoints, u->dir);
    else printf("router: %s\nrun dir: %s\n", u->endpoint, u->dir);
    printf("keys: %s\n", u->insecure ? "none (--insecure)" : "RUN_DIR/keys (router, clients/client, workers/)");
    /* Printed to be pasted: env.sh puts llm on PATH. */
    char path[PATH_MAX + 32], env_sh[PATH_MAX + 64], self[PATH_MAX + 64], dir_w[PATH_MAX + 64];
    cl_fmt(path, sizeof path, "%s/env.sh", u->dir);
    cl_sh_word(env_sh, sizeof env_sh, path);
    ssize_t got = readlink("/proc/self/exe", path, sizeof path - 1);
    path[got > 0 ? got : 0] = 0;
    cl_sh_word(self, sizeof self, got > 0 ? path : "llm-cluster");
    cl_sh_word(dir_w, sizeof dir_w, u->dir);
    printf("try: . %s && llm generate --prompt \"Once upon a time\"\n", env_sh);
    if (u->http_url[0]) {
        bool own_keys = u->api_keys_file && u->api_keys_file[0];
        char key_cmd[PATH_MAX + 96];
        if (own_keys) cl_fmt(key_cmd, sizeof key_cmd, "head -n1 %s", u->api_keys_file);
        else cl_fmt(key_cmd, sizeof key_cmd, "cat %s/api-key", dir_w);
        printf("http: %s (OpenAI API; API key in %s%s)\n", u->http_url, own_keys ? "" : "RUN_DIR/api-key, ",
               own_keys ? u->api_keys_file : "OPENAI_API_KEY in env.sh");
        printf("try: curl %s/completions -H \"Authorization: Bearer $(%s)\" -H 'Content-Type: application/json' "
               "-d '{\"prompt\": \"Once upon a time\", \"max_tokens\": 20}'\n",
               u->http_url, key_cmd);
    }
    printf("metrics: %s/prometheus-targets.json (Prometheus file_sd)\n", u->dir);
    printf("stop: %s down --run-dir %s\n", self, dir_w);
    free(u);
    return 0;
}

/* ---- status and down ------------------------------------------------------ */

static int cl_parse_dir(const char *name, const char *about, int argc, char **argv, const char **run_dir) {
    const struct option_def defs[] = {
        {"run-dir", "LLM_RUN_DIR", OPTION_STRING, "run/cluster", "the run dir llm-cluster up wrote", run_dir, 0, 0,
         NULL},
    };
    struct options o = {name, "[--run-dir DIR]", about, defs, 1, false};
    char err[512];
    int rc = options_parse(&o, &argc, argv, err, sizeof err);
    if (rc == STATUS_CANCELLED) return 0;
    if (rc < 0 || argc > 1) {
        fprintf(stderr, "%s: %s\n", name, rc < 0 ? err : "unexpected argument (see --help)");
        return 2;
    }
    return -1;
}

static int cl_down(int argc, char **argv) {
    const char *run_dir;
    int rc = cl_parse_dir("llm-cluster down", "Stops what llm-cluster up started from the run dir.", argc, argv,
                          &run_dir);
    if (rc >= 0) return rc;
    static struct cl_pidfile pf[CL_PROCS_MAX];
    int n = cl_read_pidfiles(run_dir, pf, CL_PROCS_MAX);
    if (n < 0) {
        fprintf(stderr, "llm-cluster down: run dir %s: %s\n", run_dir, strerror(errno));
        return 1;
    }
    int stopped = 0;
    for (int i = 0; i < n; i++) {
        bool alive = cl_pid_is(pf[i].pid, pf[i].program);
        if (alive) {
            cl_stop_pid(pf[i].pid, pf[i].program, 10000);
            printf("stopped %s (pid %d)\n", pf[i].name, (int)pf[i].pid);
            stopped++;
        }
        char path[PATH_MAX + 80];
        cl_fmt(path, sizeof path, "%s/%s.pid", run_dir, pf[i].name);
        unlink(path);
    }
    char path[PATH_MAX + 32];
    cl_fmt(path, sizeof path, "%s/endpoint", run_dir);
    unlink(path);
    cl_fmt(path, sizeof path, "%s/http-url", run_dir);
    unlink(path);
    if (stopped == 0) printf("nothing was running from %s\n", run_dir);
    return 0;
}

static int cl_status(int argc, char **argv) {
    const char *run_dir;
    int rc = cl_parse_dir("llm-cluster status", "Shows the processes of the run dir and the router's status.", argc,
                          argv, &run_dir);
    if (rc >= 0) return rc;
    static struct cl_pidfile pf[CL_PROCS_MAX];
    int n = cl_read_pidfiles(run_dir, pf, CL_PROCS_MAX);
    if (n <= 0) {
        fprintf(stderr, "llm-cluster status: no cluster in %s (no pid files)\n", run_dir);
        return 1;
    }
    int dead = 0;
    for (int i = 0; i < n; i++) {
        bool alive = cl_pid_is(pf[i].pid, pf[i].program);
        dead += !alive;
        printf("%-20s pid %-8d %s\n", pf[i].name, (int)pf[i].pid, alive ? "running" : "NOT RUNNING");
    }
    char path[PATH_MAX + 32], ep[256] = "";
    cl_fmt(path, sizeof path, "%s/endpoint", run_dir);
    FILE *f = fopen(path, "r");
    if (f) {
        if (!fgets(ep, sizeof ep, f)) ep[0] = 0;
        fclose(f);
        ep[strcspn(ep, "\r\n")] = 0;
    }
    if (!ep[0]) {
        printf("router endpoint unknown (%s missing: up did not finish)\n", path);
        return 1;
    }
    char url[256] = "";
    cl_fmt(path, sizeof path, "%s/http-url", run_dir);
    cl_last_line(path, url, sizeof url);
    if (url[0]) printf("gateway %s (OpenAI API)\n", url);
    const char *eps[1] = {ep};
    struct llm_client_config cfg;
    llm_client_config_default(&cfg);
    cfg.endpoints = eps;
    cfg.n_endpoints = 1;
    cfg.reply_timeout_ms = 2000;
    cfg.retry_ms = 2000;
    char key[PATH_MAX + 64], router_key[PATH_MAX + 64];
    cl_client_keys(run_dir, &cfg, key, router_key, sizeof key);
    llm_client *c;
    char err[512];
    if (llm_client_open(&c, &cfg, err, sizeof err) < 0) {
        fprintf(stderr, "llm-cluster status: %s\n", err);
        return 1;
    }
    Llm__ClientEnvelope *env;
    rc = llm_client_status(c, &env);
    if (rc < 0) {
        printf("router %s: %s\n", ep, llm_client_errstr(c));
        llm_client_close(c);
        return 1;
    }
    const Llm__StatusReply *s = env->status_reply;
    int ready = 0;
    for (size_t i = 0; i < s->n_pipelines; i++) ready += s->pipelines[i]->ready;
    printf("router %s: %d/%zu pipelines ready, %zu workers, queue %u, running %u, KV blocks %llu/%llu, "
           "%.1f tokens/s\n",
           ep, ready, s->n_pipelines, s->n_workers, s->queue_depth, s->running,
           (unsigned long long)s->kv_blocks_used, (unsigned long long)s->kv_blocks_total, s->tokens_per_s);
    proto_client_free(env);
    llm_client_close(c);
    return dead ? 1 : 0;
}

/* ---- scale ------------------------------------------------------------------ */

static int cl_scale(int argc, char **argv) {
    struct cl_up *u = calloc(1, sizeof *u);
    if (!u) {
        fprintf(stderr, "llm-cluster scale: out of memory\n");
        return 1;
    }
    const struct option_def defs[] = {
        {"pipelines", NULL, OPTION_INT, NULL, "pipelines the cluster is to have (1..64)", &u->pipelines, 1, 64,
         NULL},
        {"run-dir", "LLM_RUN_DIR", OPTION_STRING, "run/cluster", "the run dir llm-cluster up wrote", &u->run_dir, 0,
         0, NULL},
        {"timeout-s", NULL, OPTION_INT, "300",
         "give up if the router does not show the change by then (new pipelines in service, removed ones gone)",
         &u->timeout_s, 1, 86400, NULL},
        {"drain-timeout-s", NULL, OPTION_INT, "60",
         "removing pipelines: how long their running sequences may finish there before the rest move to the others "
         "(0: move them at once)",
         &u->drain_timeout_s, 0, 86400, NULL},
    };
    struct options o = {"llm-cluster scale", "--pipelines N [--run-dir DIR]",
                        "Adds pipelines to the running cluster of the run dir (their workers started as up "
                        "starts them) and waits until they serve, or drains the highest-numbered ones (no new "
                        "work goes to them, their sequences move to the others without loss) and stops their "
                        "workers.",
                        defs, (int)(sizeof defs / sizeof defs[0]), false};
    char err[1024] = "";
    int rc = options_parse(&o, &argc, argv, err, sizeof err);
    if (rc == STATUS_CANCELLED) {
        free(u);
        return 0;
    }
    if (rc < 0 || argc > 1 || u->pipelines < 1) {
        fprintf(stderr, "llm-cluster scale: %s\n",
                rc < 0 ? err : argc > 1 ? "unexpected argument (see --help)" : "need --pipelines N (1..64)");
        free(u);
        return 2;
    }
    rc = cl_scale_run(u, err, sizeof err);
    if (rc < 0) fprintf(stderr, "llm-cluster scale: %s\n", err);
    free(u);
    return rc < 0 ? 1 : 0;
}

int main(int argc, char **argv) {
    const char *log_level;
    const struct option_def defs[] = {
        {"log-level", NULL, OPTION_STRING, "warn", "llm-cluster's own log level", &log_level, 0, 0, NULL},
    };
    struct options o = {"llm-cluster", "[options] (up | scale | status | down) [subcommand options]",
                        "Runs a whole cluster on this machine: Redis, a router and workers.  Each subcommand "
                        "has its own --help.",
                        defs, 1, true};
    char err[512];
    log_set_process("llm-cluster");
    int rc = options_parse(&o, &argc, argv, err, sizeof err);
    if (rc == STATUS_CANCELLED) return 0;
    if (rc < 0) {
        fprintf(stderr, "llm-cluster: %s\n", err);
        return 2;
    }
    int level;
    if (log_level_parse(log_level, &level) < 0) {
        fprintf(stderr, "llm-cluster: --log-level %s: expected debug, info, warn, error or none\n", log_level);
        return 2;
    }
    log_set_level(level);
    if (argc < 2) {
        options_help(&o, stderr);
        return 2;
    }
    int n = argc - 1;
    if (strcmp(argv[1], "up") == 0) return cl_up(n, argv + 1);
    if (strcmp(argv[1], "down") == 0) return cl_down(n, argv + 1);
    if (strcmp(argv[1], "status") == 0) return cl_status(n, argv + 1);
    if (strcmp(argv[1], "scale") == 0) return cl_scale(n, argv + 1);
    fprintf(stderr, "llm-cluster: unknown subcommand \"%s\": expected up, scale, status or down\n", argv[1]);
    return 2;
}
