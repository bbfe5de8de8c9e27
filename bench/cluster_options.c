/* bench_cluster's options past the table in main: the lists of --stages,
 * --pipelines, --layouts and --concurrency parsed into the layouts and levels
 * to run, the checks of --shape, --type and --device, --json-schema's file,
 * and the prompt length and request count they give. */
#include "bench/cluster_bench.h"

#include "common/status.h"
#include "worker/synth.h"

#include <errno.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

/* Tokens of every prompt: the shared prefix and a question, or --prompt-tokens. */
int cb_prompt_len(const struct cb_opts *o) {
    return o->shared_prefix > 0 ? o->shared_prefix + o->question_tokens : o->prompt_tokens;
}

/* Parses a comma-separated list of integers in [lo, hi] into v.  Returns
 * the count or STATUS_BAD_INPUT with err naming the flag and the item. */
static int cb_parse_ints(const char *flag, const char *s, int lo, int hi, int *v, char *err, size_t errlen) {
    char buf[512];
    if (strlen(s) + 1 > sizeof buf) {
        cb_fmt(err, errlen, "--%s: list of %zu characters is too long", flag, strlen(s));
        return STATUS_BAD_INPUT;
    }
    memcpy(buf, s, strlen(s) + 1);
    int n = 0;
    for (char *save = NULL, *t = strtok_r(buf, ",", &save); t; t = strtok_r(NULL, ",", &save)) {
        if (n == CB_LIST_MAX) {
            cb_fmt(err, errlen, "--%s: more than %d items in \"%s\"", flag, CB_LIST_MAX, s);
            return STATUS_BAD_INPUT;
        }
        char *end = NULL;
        errno = 0;
        long x = strtol(t, &end, 10);
        if (errno || end == t || *end || x < lo || x > hi) {
            cb_fmt(err, errlen, "--%s: \"%s\" is not an integer in [%d, %d]", flag, t, lo, hi);
            return STATUS_BAD_INPUT;
        }
        v[n++] = (int)x;
    }
    if (n == 0) {
        cb_fmt(err, errlen, "--%s: empty list \"%s\"", flag, s);
        return STATUS_BAD_INPUT;
    }
    return n;
}

int cb_parse_lists(struct cb_opts *o, char *err, size_t errlen) {
    if ((o->n_stages = cb_parse_ints("stages", o->stages, 1, 64, o->stage_v, err, errlen)) < 0) return o->n_stages;
    if ((o->n_pipes = cb_parse_ints("pipelines", o->pipelines, 1, 64, o->pipe_v, err, errlen)) < 0)
        return o->n_pipes;
    int pipes[CB_LIST_MAX * CB_LIST_MAX], stages[CB_LIST_MAX * CB_LIST_MAX];
    bool sockets[CB_LIST_MAX * CB_LIST_MAX];
    int n = 0;
    if (o->layouts && o->layouts[0]) {
        char buf[512];
        if (strlen(o->layouts) + 1 > sizeof buf) {
            cb_fmt(err, errlen, "--layouts: list of %zu characters is too long", strlen(o->layouts));
            return STATUS_BAD_INPUT;
        }
        memcpy(buf, o->layouts, strlen(o->layouts) + 1);
        for (char *save = NULL, *t = strtok_r(buf, ",", &save); t; t = strtok_r(NULL, ",", &save)) {
            int p = 0, st = 0, used = 0;
            bool s = false;
            if (sscanf(t, "%dx%d%n", &p, &st, &used) == 2 && t[used] == 's') {
                s = true;
                used++;
            }
            if (sscanf(t, "%dx%d", &p, &st) != 2 || t[used] || p < 1 || p > 64 || st < 1 || st > 64 ||
                n == CB_LIST_MAX) {
                cb_fmt(err, errlen, "--layouts: \"%s\" is not PIPELINESxSTAGES with both in [1, 64], optionally "
                       "followed by s for NCCL over sockets (at most %d layouts)", t, CB_LIST_MAX);
                return STATUS_BAD_INPUT;
            }
            pipes[n] = p;
            stages[n] = st;
            sockets[n++] = s;
        }
    } else {
        for (int pi = 0; pi < o->n_pipes; pi++)
            for (int si = 0; si < o->n_stages; si++) {
                pipes[n] = o->pipe_v[pi];
                stages[n] = o->stage_v[si];
                sockets[n++] = false;
            }
    }
    o->n_layouts = 0;
    for (int i = 0; i < n; i++)
        for (int c = o->shared_prefix > 0 ? 1 : -1; c >= (o->shared_prefix > 0 ? 0 : -1); c--) {
            struct cb_layout *l = &o->lay[o->n_layouts++];
            l->pipelines = pipes[i];
            l->stages = stages[i];
            l->sockets = sockets[i];
            l->cache = c;
            cb_fmt(l->name, sizeof l->name, "%dx%d%s", pipes[i], stages[i], sockets[i] ? "s" : "");
        }
    if ((o->n_conc = cb_parse_ints("concurrency", o->concurrency, 1, CB_CONC_MAX, o->conc_v, err, errlen)) < 0)
        return o->n_conc;
    if (!o->model) {
        struct synth_shape sh;
        if (synth_shape_preset(o->shape, &sh) != STATUS_OK) {
            cb_fmt(err, errlen, "--shape: unknown shape \"%s\" (worker/synth.h presets: tiny, 100m, "
                     "tinyllama-1.1b, llama2-7b, llama3-8b, llama2-13b)", o->shape);
            return STATUS_BAD_INPUT;
        }
        int k = 0;
        while (synth_type_names[k] && strcmp(synth_type_names[k], o->type) != 0) k++;
        if (!synth_type_names[k]) {
            cb_fmt(err, errlen, "--type: unknown type \"%s\" (f32, f16, bf16, q8_0, q4_0, q4_k_m, q5_k_m, q6_k)",
                     o->type);
            return STATUS_BAD_INPUT;
        }
        o->synth_type = (enum synth_type)k;
    }
    if (strcmp(o->device, "cpu") != 0 && strcmp(o->device, "auto") != 0) {
        cb_fmt(err, errlen, "--device %s: expected cpu or auto (llm-cluster's choices)", o->device);
        return STATUS_BAD_INPUT;
    }
    return STATUS_OK;
}

/* Reads --json-schema's file into o->json_schema (freed at exit).  The
 * router checks the schema itself: one it does not support fails the
 * warm-up request, naming the keyword. */
int cb_read_schema(struct cb_opts *o, char *err, size_t errlen) {
    FILE *f = fopen(o->json_schema_file, "rb");
    if (!f) {
        cb_fmt(err, errlen, "--json-schema %s: %s", o->json_schema_file, strerror(errno));
        return STATUS_IO;
    }
    size_t cap = 4096, n = 0;
    char *buf = malloc(cap);
    while (buf) {
        n += fread(buf + n, 1, cap - n - 1, f);
        if (n < cap - 1) break;
        char *b = cap < (1u << 24) ? realloc(buf, cap * 2) : NULL;
        if (!b) {
            free(buf);
            buf = NULL;
            break;
        }
        buf = b;
        cap *= 2;
    }
    bool bad = ferror(f);
    fclose(f);
    if (!buf || bad || n == 0) {
        cb_fmt(err, errlen, "--json-schema %s: %s", o->json_schema_file,
               !buf ? "larger than 16 MiB or out of memory" : bad ? "read error" : "empty file");
        free(buf);
        return STATUS_BAD_INPUT;
    }
    buf[n] = 0;
    o->json_schema = buf;
    return STATUS_OK;
}

/* The requests of one level: --requests, else two per stream and at least 8. */
int cb_level_requests(const struct cb_opts *o, int conc) {
    if (o->requests > 0) return o->requests;
    return 2 * conc > 8 ? 2 * conc : 8;
}
