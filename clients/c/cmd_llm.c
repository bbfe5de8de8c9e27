/* llm: the command-line client of a running cluster.  `llm generate` has
 * the options and output of llm-run (text streamed to stdout, --json's
 * object on the last line) but asks the router; `llm status`, `llm health`,
 * `llm models` and `llm cancel` show and steer the cluster; `llm keygen`
 * writes a CURVE key pair.  The router is --router, else $LLM_ROUTER, else
 * tcp://127.0.0.1:5555; the keys are --curve-key-file and --router-key (or
 * LLM_CURVE_KEY_FILE, LLM_ROUTER_KEY; see docs/security.md). */
#include "llm_cli.h"
#include "status_view.h"

#include "common/keys.h"
#include "common/log.h"
#include "common/options.h"
#include "common/status.h"
#include "common/unicode.h"

#include <cjson/cJSON.h>
#include <assert.h>
#include <errno.h>
#include <signal.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

/* ---- status, health, models, cancel --------------------------------------- */

/* Parses a subcommand that takes only --json (and no positionals unless
 * n_pos says how many); returns -1 to go on, else the exit code. */
static int llm_parse_simple(struct llm_global *gl, const char *name, const char *about, const char *usage,
                            int *argc, char **argv, bool *json, int n_pos) {
    const struct option_def defs[] = {
        {"json", NULL, OPTION_BOOL, "false", "print JSON", json, 0, 0, NULL},
    };
    int rc = llm_parse_sub(gl, name, usage, about, defs, 1, argc, argv);
    if (rc >= 0) return rc;
    if (*argc - 1 != n_pos) {
        fprintf(stderr, "%s: expected %d argument%s, got %d (see --help)\n", name, n_pos, n_pos == 1 ? "" : "s",
                *argc - 1);
        return 2;
    }
    return -1;
}

static int64_t llm_now_ms(void) {
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (int64_t)ts.tv_sec * 1000 + ts.tv_nsec / 1000000;
}

/* Exit 3 when a stage of an idle pipeline holds other KV blocks than the
 * router's pipeline.  A view older than the idle moment is asked for again
 * (every 200 ms, for --settle-ms at most) rather than judged; anything run
 * in between (requests or steps counted) moves the idle moment on. */
static int llm_status(struct llm_global *gl, int argc, char **argv) {
    bool json = false;
    int settle_ms = 3000;
    const struct option_def defs[] = {
        {"json", NULL, OPTION_BOOL, "false", "print JSON", &json, 0, 0, NULL},
        {"settle-ms", NULL, OPTION_INT, "3000",
         "wait this long at most for a stage's KV view newer than its pipeline's idleness (0: judge the first reply)",
         &settle_ms, 0, 600000, NULL},
    };
    int rc = llm_parse_sub(gl, "llm status", "[--json] [--settle-ms MS]",
                           "Shows pipelines, stages, workers, queue, KV use and throughput; exits 3 when a stage "
                           "of an idle pipeline holds other KV blocks than the router's pipeline.",
                           defs, 2, &argc, argv);
    if (rc >= 0) return rc;
    if (argc != 1) {
        fprintf(stderr, "llm status: expected 0 arguments, got %d (see --help)\n", argc - 1);
        return 2;
    }
    llm_client *c;
    if ((rc = llm_open(gl, &c)) != 0) return rc;
    Llm__ClientEnvelope *env;
    struct status_kv_read kv = {.compare_all = settle_ms == 0};
    kv.sent_ms = llm_now_ms();
    rc = llm_client_status(c, &env);
    kv.idle_ms = llm_now_ms();
    int64_t end = kv.idle_ms + settle_ms;
    while (rc >= 0) {
        kv.s = env->status_reply;
        if (status_kv_count(&kv, false) == 0 || llm_now_ms() >= end) break;
        int64_t wait = end - llm_now_ms();
        struct timespec ts = {0, (wait < 200 ? wait : 200) * 1000000L};
        nanosleep(&ts, NULL);
        uint64_t requests = env->status_reply->requests_total, steps = env->status_reply->steps_total;
        Llm__ClientEnvelope *next;
        kv.sent_ms = llm_now_ms();
        if ((rc = llm_client_status(c, &next)) < 0) break;
        proto_client_free(env);
        env = next;
        if (env->status_reply->requests_total != requests || env->status_reply->steps_total != steps)
            kv.idle_ms = llm_now_ms();
    }
    if (rc < 0) {
        fprintf(stderr, "llm: %s\n", llm_client_errstr(c));
        if (kv.s) proto_client_free(env);
        llm_client_close(c);
        return 1;
    }
    if (json) {
        cJSON *j = status_view_json(&kv);
        llm_print_json(j);
        cJSON_Delete(j);
    } else {
        status_view_print(llm_client_endpoint(c), &kv);
    }
    int differ = status_kv_count(&kv, true);
    proto_client_free(env);
    llm_client_close(c);
    return differ ? 3 : 0;
}

static const char *llm_serving_name(Llm__HealthReply__ServingStatus s) {
    switch (s) {
    case LLM__HEALTH_REPLY__SERVING_STATUS__SERVING: return "SERVING";
    case LLM__HEALTH_REPLY__SERVING_STATUS__NOT_SERVING: return "NOT_SERVING";
    default: return "UNKNOWN";
    }
}

/* Exit 0 only when SERVING: usable as a readiness probe. */
static int llm_health(struct llm_global *gl, int argc, char **argv) {
    bool json = false;
    int rc = llm_parse_simple(gl, "llm health", "Asks the router whether it can serve (exit 0 only when SERVING).",
                              "[--json]", &argc, argv, &json, 0);
    if (rc >= 0) return rc;
    llm_client *c;
    if ((rc = llm_open(gl, &c)) != 0) return rc;
    Llm__ClientEnvelope *env;
    rc = llm_client_health(c, &env);
    if (rc < 0) {
        fprintf(stderr, "llm: %s\n", llm_client_errstr(c));
        llm_client_close(c);
        return 1;
    }
    const Llm__HealthReply *h = env->health_reply;
    if (json) {
        cJSON *j = cJSON_CreateObject();
        cJSON_AddStringToObject(j, "status", llm_serving_name(h->status));
        cJSON_AddNumberToObject(j, "protocol_version", h->protocol_version);
        cJSON_AddStringToObject(j, "build", h->build);
        cJSON_AddNumberToObject(j, "pipelines_ready", h->pipelines_ready);
        llm_print_json(j);
        cJSON_Delete(j);
    } else {
        printf("%s: %s, protocol %u, build %s, %u pipelines ready\n", llm_client_endpoint(c),
               llm_serving_name(h->status), h->protocol_version, h->build, h->pipelines_ready);
    }
    int code = h->status == LLM__HEALTH_REPLY__SERVING_STATUS__SERVING ? 0 : 1;
    proto_client_free(env);
    llm_client_close(c);
    return code;
}

static int llm_models(struct llm_global *gl, int argc, char **argv) {
    bool json = false;
    int rc = llm_parse_simple(gl, "llm models", "Lists the models the cluster serves.", "[--json]", &argc, argv,
                              &json, 0);
    if (rc >= 0) return rc;
    llm_client *c;
    if ((rc = llm_open(gl, &c)) != 0) return rc;
    Llm__ClientEnvelope *env;
    rc = llm_client_models(c, &env);
    if (rc < 0) {
        fprintf(stderr, "llm: %s\n", llm_client_errstr(c));
        llm_client_close(c);
        return 1;
    }
    const Llm__ModelsReply *m = env->models_reply;
    cJSON *arr = json ? cJSON_CreateArray() : NULL;
    for (size_t i = 0; i < m->n_models; i++) {
        const Llm__ModelInfo *mi = m->models[i];
        if (arr) {
            cJSON *j = cJSON_CreateObject();
            cJSON_AddStringToObject(j, "id", mi->id);
            cJSON_AddStringToObject(j, "architecture", mi->architecture);
            cJSON_AddNumberToObject(j, "n_vocab", mi->n_vocab);
            cJSON_AddNumberToObject(j, "n_ctx", mi->n_ctx);
            cJSON_AddNumberToObject(j, "n_layers", mi->n_layers);
            cJSON_AddNumberToObject(j, "pipelines", mi->pipelines);
            cJSON_AddBoolToObject(j, "is_default", mi->is_default);
            cJSON_AddItemToArray(arr, j);
        } else {
            printf("%s%s: %s, %u layers, vocabulary %u, context %u, %u pipelines ready\n", mi->id,
                   mi->is_default ? " (default)" : "", mi->architecture, mi->n_layers, mi->n_vocab, mi->n_ctx,
                   mi->pipelines);
        }
    }
    if (arr) {
        llm_print_json(arr);
        cJSON_Delete(arr);
    }
    proto_client_free(env);
    llm_client_close(c);
    return 0;
}

static int llm_cancel(struct llm_global *gl, int argc, char **argv) {
    bool json = false;
    int rc = llm_parse_simple(gl, "llm cancel", "Cancels a request by id and prints how it ended.",
                              "REQUEST_ID", &argc, argv, &json, 1);
    if (rc >= 0) return rc;
    llm_client *c;
    if ((rc = llm_open(gl, &c)) != 0) return rc;
    struct llm_generate_result r;
    rc = llm_client_cancel(c, argv[1], &r);
    if (rc < 0) {
        fprintf(stderr, "llm: %s\n", llm_client_errstr(c));
        llm_client_close(c);
        return 1;
    }
    printf("%s: %s, %u completion tokens\n", r.request_id, llm_finish_reason_name(r.finish_reason),
           r.completion_tokens);
    llm_client_close(c);
    return 0;
}

/* llm keygen: a key pair for a client, a worker or a router. */
static int llm_keygen(struct llm_global *gl, int argc, char **argv) {
    const char *out = NULL, *name = NULL;
    const struct option_def defs[] = {
        {"out", NULL, OPTION_STRING, NULL, "folder to write NAME.key and NAME.pub into (made if missing)",
         &out, 0, 0, NULL},
        {"name", NULL, OPTION_STRING, NULL, "the key's name: the files' names, and the peer's name in logs",
         &name, 0, 0, NULL},
    };
    int rc = llm_parse_sub(gl, "llm keygen",
                           "--out DIR --name NAME",
                           "Writes a CURVE key pair: DIR/NAME.key (secret, mode 0600) and DIR/NAME.pub; "
                           "never overwrites.  Put NAME.pub in the router's --client-keys or "
                           "--worker-keys.", defs, 2, &argc, argv);
    if (rc >= 0) return rc;
    if (!out || !out[0] || !name || !name[0]) {
        fprintf(stderr, "llm keygen: give --out DIR and --name NAME\n");
        return 2;
    }
    if (argc > 1) {
        fprintf(stderr, "llm keygen: unexpected argument \"%s\"\n", argv[1]);
        return 2;
    }
    struct keys_pair kp;
    char err[512];
    if ((rc = keys_pair_generate(&kp, err, sizeof err)) == 0)
        rc = keys_pair_write(out, name, &kp, err, sizeof err);
    if (rc < 0) {
        fprintf(stderr, "llm keygen: %s\n", err);
        return rc == STATUS_BAD_INPUT ? 2 : 1;
    }
    printf("%s/%s.key\n%s/%s.pub\n%s\n", out, name, out, name, kp.pub);
    memset(&kp, 0, sizeof kp);
    return 0;
}

int main(int argc, char **argv) {
    struct llm_global g;
    struct option_def defs[LLM_N_GLOBAL];
    llm_global_defs(&g, defs);
    struct options o = {"llm", "[options] (generate | status | health | models | cancel | keygen) [subcommand options]",
                        "Talks to a running cluster's router.  Each subcommand has its own --help; "
                        "these options also work after the subcommand.", defs, LLM_N_GLOBAL, true};
    char err[512];
    log_set_process("llm");
    int rc = options_parse(&o, &argc, argv, err, sizeof err);
    if (rc == STATUS_CANCELLED) return 0;
    if (rc < 0) {
        fprintf(stderr, "llm: %s\n", err);
        return 2;
    }
    int level;
    if (log_level_parse(g.log_level, &level) < 0) {
        fprintf(stderr, "llm: --log-level %s: expected debug, info, warn, error or none\n", g.log_level);
        return 2;
    }
    log_set_level(level);
    if (argc < 2) {
        options_help(&o, stderr);
        return 2;
    }
    const char *cmd = argv[1];
    int n = argc - 1;
    if (strcmp(cmd, "generate") == 0) return llm_generate(&g, n, argv + 1);
    if (strcmp(cmd, "status") == 0) return llm_status(&g, n, argv + 1);
    if (strcmp(cmd, "health") == 0) return llm_health(&g, n, argv + 1);
    if (strcmp(cmd, "models") == 0) return llm_models(&g, n, argv + 1);
    if (strcmp(cmd, "cancel") == 0) return llm_cancel(&g, n, argv + 1);
    if (strcmp(cmd, "keygen") == 0) return llm_keygen(&g, n, argv + 1);
    fprintf(stderr, "llm: unknown subcommand \"%s\": expected generate, status, health, models, cancel or keygen\n", cmd);
    return 2;
}
