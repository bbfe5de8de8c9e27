/* bench_engine: prefill and decode tokens/s of the engine on the CPU backend
 * for stories260K and for a synthetic ~100M-parameter model (written to a
 * temporary folder in F16, Q8_0 and Q4_K_M), with each decode figure set
 * against the memory bandwidth a plain read loop reaches on the same
 * machine in the same run (decode reads every weight once per token, so
 * that is its ceiling). */
#include "common/kvblocks.h"
#include "common/log.h"
#include "common/model.h"
#include "common/options.h"
#include "common/status.h"
#include "kernels/backend.h"
#include "worker/forward.h"
#include "worker/stage.h"
#include "worker/synth.h"

#include <pthread.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>
#include <unistd.h>

static double bench_now(void) {
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return ts.tv_sec + ts.tv_nsec * 1e-9;
}

/* ---- Read bandwidth: n threads each summing its part of a buffer ---- */

struct bench_read {
    const uint64_t *p;
    size_t n;
    uint64_t sum;
};

static void *bench_read_part(void *arg) {
    struct bench_read *r = arg;
    uint64_t s0 = 0, s1 = 0, s2 = 0, s3 = 0;
    for (size_t i = 0; i + 4 <= r->n; i += 4) {
        s0 += r->p[i];
        s1 += r->p[i + 1];
        s2 += r->p[i + 2];
        s3 += r->p[i + 3];
    }
    r->sum = s0 + s1 + s2 + s3;
    return NULL;
}

/* Bytes per second of the best of several passes over a buffer much larger
 * than the caches. */
static double bench_read_bandwidth(int n_threads, size_t bytes) {
    size_t n = bytes / sizeof(uint64_t);
    uint64_t *buf = malloc(n * sizeof *buf);
    if (!buf) return 0;
    for (size_t i = 0; i < n; i++) buf[i] = i * 2654435761u;
    double best = 0;
    uint64_t keep = 0;
    for (int pass = 0; pass < 5; pass++) {
        pthread_t th[256];
        struct bench_read parts[256];
        double t0 = bench_now();
        for (int t = 0; t < n_threads; t++) {
            parts[t].p = buf + n / n_threads * t;
            parts[t].n = n / n_threads;
            if (t == 0) continue;
            pthread_create(&th[t], NULL, bench_read_part, &parts[t]);
        }
        bench_read_part(&parts[0]);
        for (int t = 1; t < n_threads; t++) pthread_join(th[t], NULL);
        double dt = bench_now() - t0;
        for (int t = 0; t < n_threads; t++) keep += parts[t].sum;
        double bw = (double)(n / n_threads * n_threads) * sizeof(uint64_t) / dt;
        if (bw > best) best = bw;
    }
    free(buf);
    if (keep == 42) printf(" "); /* the sums are used, so the loop stays */
    return best;
}

/* ---- One model ---- */

struct bench_result {
    double prefill_tps, decode_tps, weight_bytes;
};

static int bench_model(const char *path, backend *b, int32_t n_prompt, int32_t n_decode,
                       struct bench_result *res, char *err, size_t errlen) {
    model_file *m = NULL;
    stage *s = NULL;
    kvblocks *kb = NULL;
    struct kvblocks_table t;
    kvblocks_table_init(&t);
    float *logits = NULL;
    int32_t *ids = NULL;
    int rc = model_file_open(&m, path, err, errlen);
    if (rc != STATUS_OK) goto done;
    const struct model_hparams *hp = model_file_hparams(m);
    struct stage_config cfg;
    stage_config_default(&cfg);
    cfg.n_seqs_max = 1;
    cfg.n_tokens_max = n_prompt;
    cfg.n_ctx_max = n_prompt + n_decode;
    cfg.n_logits_max = 1;
    rc = stage_init(&s, m, b, &cfg, err, errlen);
    if (rc != STATUS_OK) goto done;
    rc = kvblocks_init(&kb, stage_config_get(s)->n_blocks, stage_config_get(s)->block_size, err, errlen);
    if (rc != STATUS_OK) goto done;
    logits = malloc(sizeof(float) * (size_t)hp->n_vocab);
    ids = malloc(sizeof(int32_t) * (size_t)(n_prompt + n_decode));
    if (!logits || !ids) {
        rc = STATUS_NO_MEMORY;
        snprintf(err, errlen, "out of memory");
        goto done;
    }
    uint32_t seed = 1;
    for (int32_t i = 0; i < n_prompt; i++) {
        seed = seed * 1664525u + 1013904223u;
        ids[i] = (int32_t)((seed >> 8) % (uint32_t)hp->n_vocab);
    }
    double t_prefill = 0, t_decode = 0;
    for (int32_t i = 0; i < n_decode + 1 && rc == STATUS_OK; i++) {
        int32_t n = i == 0 ? n_prompt : 1, pos0 = t.n_tokens;
        const int32_t *chunk = i == 0 ? ids : &ids[n_prompt + i - 1];
        rc = kvblocks_reserve(kb, &t, n, NULL, NULL);
        if (rc != STATUS_OK) {
            snprintf(err, errlen, "KV blocks exhausted at position %d", pos0);
            break;
        }
        struct forward_seq q = {chunk, n, pos0, t.ids, t.n_ids, FORWARD_LOGITS_LAST};
        struct forward_batch bt = {&q, 1, NULL, 0, NULL, 0};
        struct forward_out o = {logits, 0, NULL, NULL};
        double t0 = bench_now();
        rc = forward_step(s, &bt, &o, err, errlen);
        double dt = bench_now() - t0;
        if (i == 0) t_prefill = dt;
        else t_decode += dt;
        /* Greedy, so the decode path sees realistic ids. */
        int32_t best = 0;
        for (int32_t v = 1; v < hp->n_vocab; v++)
            if (logits[v] > logits[best]) best = v;
        if (i < n_decode) ids[n_prompt + i] = best;
    }
    if (rc == STATUS_OK) {
        res->prefill_tps = n_prompt / t_prefill;
        res->decode_tps = n_decode / t_decode;
        res->weight_bytes = (double)stage_weight_bytes(s);
    }
done:
    free(ids);
    free(logits);
    if (kb) kvblocks_table_free(kb, &t);
    kvblocks_free(kb);
    stage_free(s);
    model_file_close(m);
    return rc;
}

static void bench_report(const char *label, const struct bench_result *r, double bandwidth) {
    double used = r->weight_bytes * r->decode_tps;
    printf("%-28s %9.1f MiB %11.1f %11.2f %9.1f GB/s %6.1f%%\n", label, r->weight_bytes / 1048576.0,
           r->prefill_tps, r->decode_tps, used / 1e9, 100.0 * used / bandwidth);
    fflush(stdout);
}

int main(int argc, char **argv) {
    const char *models_dir = NULL;
    const char *synth_preset = NULL;
    int threads = 0, n_prompt = 128, n_decode = 32;
    struct option_def defs[] = {
        {"models", "LLM_MODELS_DIR", OPTION_STRING, "../shared/models", "folder of the test models", &models_dir, 0, 0, NULL},
        {"threads", "LLM_THREADS", OPTION_INT, "0", "CPU threads (0: one per core)", &threads, 0, 256, NULL},
        {"prompt", NULL, OPTION_INT, "128", "prefill tokens", &n_prompt, 1, 8192, NULL},
        {"decode", NULL, OPTION_INT, "32", "decode tokens", &n_decode, 1, 8192, NULL},
        {"synth", NULL, OPTION_STRING, "100m", "shape of the synthetic model (worker/synth.h presets)", &synth_preset, 0, 0, NULL},
    };
    struct options o = {"bench_engine", "[options]",
                        "Prefill and decode tokens/s on the CPU, and decode's share of the read bandwidth.", defs,
                        (int)(sizeof defs / sizeof defs[0]), false};
    char err[1024];
    int rc = options_parse(&o, &argc, argv, err, sizeof err);
    if (rc == STATUS_CANCELLED) return 0;
    if (rc != STATUS_OK) {
        fprintf(stderr, "bench_engine: %s\n", err);
        return 2;
    }
    log_set_level(LL_WARN);
    backend *b = NULL;
    if (backend_cpu_init(&b, threads, err, sizeof err) != STATUS_OK) {
        fprintf(stderr, "bench_engine: %s\n", err);
        return 1;
    }
    int n_threads = threads > 0 ? threads : (int)sysconf(_SC_NPROCESSORS_ONLN);
    if (n_threads > 256) n_threads = 256;
    double bw = bench_read_bandwidth(n_threads, (size_t)512 << 20);
    printf("backend %s, %d threads; plain read loop: %.2f GB/s\n", backend_name(b), n_threads, bw / 1e9);
    printf("%-28s %13s %11s %11s %14s %7s\n", "model", "weights", "prefill t/s", "decode t/s", "decode reads",
           "of bw");
    int failed = 0;
    static const char *files[] = {"stories260K-f32.gguf", "stories260K-q8_0.gguf"};
    for (size_t i = 0; i < sizeof files / sizeof files[0]; i++) {
        char path[4096];
        snprintf(path, sizeof path, "%s/%s", models_dir, files[i]);
        struct bench_result r = {0, 0, 0};
        if (bench_model(path, b, n_prompt, n_decode, &r, err, sizeof err) != STATUS_OK) {
            fprintf(stderr, "bench_engine: %s: %s\n", files[i], err);
            failed = 1;
            continue;
        }
        bench_report(files[i], &r, bw);
    }
    /* The synthetic model, written to a temporary folder and removed after. */
    char dir[] = "/tmp/bench_engine_XXXXXX";
    if (!mkdtemp(dir)) {
        fprintf(stderr, "bench_engine: cannot create a temporary folder\n");
        backend_free(b);
        return 1;
    }
    static const enum synth_type types[] = {SYNTH_F16, SYNTH_Q8_0, SYNTH_Q4_K_M};
    for (size_t i = 0; i < sizeof types / sizeof types[0]; i++) {
        struct synth_config sc;
        memset(&sc, 0, sizeof sc);
        if (synth_shape_preset(synth_preset, &sc.shape) != STATUS_OK) {
            fprintf(stderr, "bench_engine: --synth %s: unknown shape\n", synth_preset);
            failed = 1;
            break;
        }
        sc.type = types[i];
        sc.seed = 1;
        sc.n_threads = threads;
        char path[4096], label[64];
        snprintf(path, sizeof path, "%s/synth-%s-%s.gguf", dir, synth_preset, synth_type_names[types[i]]);
        snprintf(label, sizeof label, "synth %s %s", synth_preset, synth_type_names[types[i]]);
        struct bench_result r = {0, 0, 0};
        if (synth_write(&sc, path, err, sizeof err) != STATUS_OK ||
            bench_model(path, b, n_prompt, n_decode, &r, err, sizeof err) != STATUS_OK) {
            fprintf(stderr, "bench_engine: %s: %s\n", label, err);
            failed = 1;
        } else {
            bench_report(label, &r, bw);
        }
        unlink(path);
    }
    rmdir(dir);
    backend_free(b);
    return failed;
}
