/* bench_link_dtype: what --link-dtype costs in accuracy and what it saves
 * on the wire, on a 1x2 pipeline of a real model on one device (--device:
 * the CPU by default, or a GPU).  The model's layers are split in two as
 * the router splits them (equal bytes); stage 0's hidden states go to
 * stage 1 through a real ZeroMQ link (inproc, the worker's link code, its
 * encoding and decoding) in each element type, and stage 1 gives the
 * logits of every position (teacher forcing: each window of the evaluation
 * text is fed whole).  On a GPU both stages share the one backend (as the
 * draft model shares its stage's) and the rows take the path of a GPU
 * worker's ZeroMQ link (worker/node_link.c): downloaded to the host by the
 * step, encoded, sent, received, decoded, uploaded by the next step.
 * Against the F32 link it reports, per type: the share of positions whose
 * top-1 token is the same, the perplexity of the text and its change, and
 * the bytes per token the link put on the wire (headers included).
 * --control adds a row: F32 links with every received element nudged by a
 * relative 2^-20 (far below F16's rounding), which shows how much
 * disagreement the stages' own arithmetic makes of any change of stage 1's
 * input. */
#include "common/device.h"
#include "common/gguf.h"
#include "common/kvblocks.h"
#include "common/layersplit.h"
#include "common/log.h"
#include "common/model.h"
#include "common/options.h"
#include "common/status.h"
#include "common/tokenizer.h"
#include "kernels/backend.h"
#include "worker/forward.h"
#include "worker/link.h"
#include "worker/stage.h"

#include <cjson/cJSON.h>
#include <math.h>
#include <stdbool.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <zmq.h>

struct ld_tokens {
    int32_t *ids;
    int32_t n, cap;
    int32_t *starts; /* where each window begins: sources are not run together */
    int32_t *lens;
    int32_t n_win, cap_win;
};

static int ld_push_window(struct ld_tokens *t, const int32_t *ids, int32_t n) {
    if (n < 2) return 0;
    if (t->n + n > t->cap) {
        int32_t cap = (t->n + n) * 2;
        int32_t *p = realloc(t->ids, (size_t)cap * sizeof *p);
        if (!p) return STATUS_NO_MEMORY;
        t->ids = p;
        t->cap = cap;
    }
    if (t->n_win == t->cap_win) {
        int32_t cap = t->cap_win ? t->cap_win * 2 : 64;
        int32_t *s = realloc(t->starts, (size_t)cap * sizeof *s);
        if (!s) return STATUS_NO_MEMORY;
        t->starts = s;
        int32_t *l = realloc(t->lens, (size_t)cap * sizeof *l);
        if (!l) return STATUS_NO_MEMORY;
        t->lens = l;
        t->cap_win = cap;
    }
    memcpy(t->ids + t->n, ids, (size_t)n * sizeof *ids);
    t->starts[t->n_win] = t->n;
    t->lens[t->n_win++] = n;
    t->n += n;
    return 0;
}

/* A source's ids cut into windows of at most `window`, each after the
 * first starting with BOS again (when the model has one) so that every
 * window is a sequence the model could see. */
static int ld_add_source(struct ld_tokens *t, const int32_t *ids, int32_t n, int32_t window, int32_t bos) {
    int32_t *buf = malloc((size_t)window * sizeof *buf);
    if (!buf) return STATUS_NO_MEMORY;
    int rc = 0;
    for (int32_t at = 0; at < n && rc == 0;) {
        int32_t k = 0;
        if (at > 0 && bos >= 0) buf[k++] = bos;
        while (k < window && at < n) buf[k++] = ids[at++];
        rc = ld_push_window(t, buf, k);
    }
    free(buf);
    return rc;
}

static char *ld_read(const char *path, size_t *len) {
    FILE *f = fopen(path, "rb");
    if (!f) return NULL;
    fseek(f, 0, SEEK_END);
    long n = ftell(f);
    fseek(f, 0, SEEK_SET);
    char *buf = n >= 0 ? malloc((size_t)n + 1) : NULL;
    if (buf && fread(buf, 1, (size_t)n, f) != (size_t)n) {
        free(buf);
        buf = NULL;
    }
    fclose(f);
    if (buf) buf[n] = 0;
    if (len) *len = buf ? (size_t)n : 0;
    return buf;
}

/* Stage 0 -> link -> stage 1 for one window; logits of every row into
 * logits ([n, n_vocab]).  Each call starts both stages' KV afresh.  The
 * hidden rows go as a worker's host link sends them (node_step.c,
 * node_link.c): forward_out.hidden a host buffer (a GPU step downloads its
 * output there), link_send/link_recv between host buffers, and the next
 * step's hidden_in that host buffer (hidden_in_backend 0: uploaded). */
struct ld_pipe {
    stage *s0, *s1;
    kvblocks *kb0, *kb1;
    link_conn *tx, *rx;
    float *hidden, *recv; /* [window, dim] */
    int32_t dim;
    uint64_t step;
    int nudge; /* the control: scale every received element by 1 + 2^-20 */
};

static int ld_run(struct ld_pipe *p, const int32_t *ids, int32_t n, float *logits, char *err, size_t errlen) {
    struct kvblocks_table t0, t1;
    kvblocks_table_init(&t0);
    kvblocks_table_init(&t1);
    struct kvblocks_copy cp;
    int32_t n_cp = 0;
    int rc = kvblocks_reserve(p->kb0, &t0, n, &cp, &n_cp);
    if (rc == 0) rc = kvblocks_reserve(p->kb1, &t1, n, &cp, &n_cp);
    if (rc != 0) {
        snprintf(err, errlen, "KV: no room for %d tokens", n);
        goto done;
    }
    struct forward_seq q0 = {ids, n, 0, t0.ids, t0.n_ids, FORWARD_LOGITS_NONE};
    struct forward_batch b0 = {&q0, 1, NULL, 0, NULL, 0};
    struct forward_out o0 = {NULL, 0, p->hidden, NULL};
    if ((rc = forward_step(p->s0, &b0, &o0, err, errlen)) != 0) goto done;
    size_t bytes = (size_t)n * (size_t)p->dim * sizeof(float);
    p->step++;
    if ((rc = link_send(p->tx, p->step, p->hidden, bytes)) != 0 ||
        (rc = link_recv(p->rx, p->step, p->recv, bytes)) != 0) {
        snprintf(err, errlen, "link, step %llu: %s", (unsigned long long)p->step,
                 link_errstr(rc == 0 ? p->rx : p->tx));
        goto done;
    }
    if (p->nudge)
        for (size_t i = 0; i < (size_t)n * (size_t)p->dim; i++) p->recv[i] *= 1.0f + 0x1p-20f;
    struct forward_seq q1 = {ids, n, 0, t1.ids, t1.n_ids, FORWARD_LOGITS_ALL};
    struct forward_batch b1 = {&q1, 1, NULL, 0, p->recv, 0};
    struct forward_out o1 = {logits, 0, NULL, NULL};
    rc = forward_step(p->s1, &b1, &o1, err, errlen);
done:
    kvblocks_table_free(p->kb0, &t0);
    kvblocks_table_free(p->kb1, &t1);
    return rc;
}

static int32_t ld_argmax(const float *x, int32_t n) {
    int32_t best = 0;
    for (int32_t i = 1; i < n; i++)
        if (x[i] > x[best]) best = i;
    return best;
}

/* -log softmax(x)[id] */
static double ld_nll(const float *x, int32_t n, int32_t id) {
    double m = x[ld_argmax(x, n)], sum = 0;
    for (int32_t i = 0; i < n; i++) sum += exp((double)x[i] - m);
    return m + log(sum) - x[id];
}

int main(int argc, char **argv) {
    const char *model = NULL, *texts = "", *ref_json = "", *types = "f32,f16,bf16,int8", *device = "cpu";
    int window = 0, max_tokens = 0, threads = 0;
    bool control = false;
    const struct option_def defs[] = {
        {"model", "LLM_MODEL", OPTION_STRING, NULL, "GGUF model", &model, 0, 0, NULL},
        {"text", NULL, OPTION_STRING, "", "comma-separated text files to evaluate on (tokenized with BOS)", &texts,
         0, 0, NULL},
        {"ref-json", NULL, OPTION_STRING, "",
         "a JSON file with refs[].prompt_ids (pycode's pytorch-ref.json: held-out code) to evaluate on too",
         &ref_json, 0, 0, NULL},
        {"window", NULL, OPTION_INT, "0", "tokens per teacher-forced window (0: the model's context, at most 512)",
         &window, 0, 512, NULL},
        {"max-tokens", NULL, OPTION_INT, "16384", "evaluate at most this many tokens (whole windows): bounds a run",
         &max_tokens, 2, 1 << 24, NULL},
        {"types", NULL, OPTION_STRING, "f32,f16,bf16,int8", "link element types, f32 first", &types, 0, 0, NULL},
        {"device", NULL, OPTION_STRING, "cpu",
         "cpu, cuda, cuda:N or auto: where both stages run (a named GPU that does not open is an error)", &device,
         0, 0, NULL},
        {"threads", "LLM_THREADS", OPTION_INT, "0", "CPU threads (0: one per core)", &threads, 0, 1024, NULL},
        {"control", NULL, OPTION_BOOL, "false",
         "also F32 links with each received element scaled by 1 + 2^-20: the disagreement any input change makes",
         &control, 0, 0, NULL},
    };
    struct options o = {"bench_link_dtype", "--model M (--text FILES | --ref-json FILE) [options]",
                        "Teacher-forced top-1 agreement with F32 links, perplexity and link bytes per token for "
                        "each --link-dtype on a 1x2 pipeline of the model on one device (the CPU unless --device).",
                        defs, (int)(sizeof defs / sizeof defs[0]), false};
    char err[1024];
    int rc = options_parse(&o, &argc, argv, err, sizeof err);
    if (rc == STATUS_CANCELLED) return 0;
    if (rc < 0 || !model || (!texts[0] && !ref_json[0])) {
        fprintf(stderr, "bench_link_dtype: %s\n", rc < 0 ? err : "need --model and --text or --ref-json");
        return 2;
    }
    log_set_level(LL_WARN);
    enum link_dtype dts[LINK_DTYPE_N + 1];
    int n_dts = 0;
    {
        char buf[128];
        snprintf(buf, sizeof buf, "%s", types);
        for (char *save = NULL, *w = strtok_r(buf, ",", &save); w; w = strtok_r(NULL, ",", &save)) {
            int k = 0;
            while (link_dtype_names[k] && strcmp(link_dtype_names[k], w) != 0) k++;
            if (!link_dtype_names[k] || n_dts == LINK_DTYPE_N) {
                fprintf(stderr, "bench_link_dtype: --types: \"%s\" is not f32, f16, bf16 or int8\n", w);
                return 2;
            }
            dts[n_dts++] = (enum link_dtype)k;
        }
        if (n_dts == 0 || dts[0] != LINK_DTYPE_F32) {
            fprintf(stderr, "bench_link_dtype: --types %s: f32 must come first (the reference)\n", types);
            return 2;
        }
    }
    struct device_spec dev;
    if (device_parse("--device", device, &dev, err, sizeof err) < 0) {
        fprintf(stderr, "bench_link_dtype: %s\n", err);
        return 2;
    }

    model_file *m = NULL;
    if (model_file_open(&m, model, err, sizeof err) < 0) {
        fprintf(stderr, "bench_link_dtype: %s\n", err);
        return 1;
    }
    const struct model_hparams *hp = model_file_hparams(m);
    const tokenizer *tok = model_file_tokenizer(m);
    if (window == 0) window = hp->ctx_len > 0 && hp->ctx_len < 512 ? hp->ctx_len : 512;

    /* The evaluation tokens. */
    struct ld_tokens t = {0};
    char list[4096];
    snprintf(list, sizeof list, "%s", texts);
    for (char *save = NULL, *path = strtok_r(list, ",", &save); path; path = strtok_r(NULL, ",", &save)) {
        size_t len;
        char *text = ld_read(path, &len);
        if (!text) {
            fprintf(stderr, "bench_link_dtype: --text %s: cannot read it\n", path);
            return 1;
        }
        int32_t *ids = malloc((len + 8) * sizeof *ids);
        int32_t n = ids ? tokenizer_encode(tok, text, len, 1, 0, ids, (int32_t)(len + 8)) : -1;
        if (n < 0) {
            fprintf(stderr, "bench_link_dtype: --text %s: tokenizing failed (%d)\n", path, n);
            return 1;
        }
        rc = ld_add_source(&t, ids, n, window, tokenizer_bos(tok));
        free(ids);
        free(text);
        if (rc < 0) {
            fprintf(stderr, "bench_link_dtype: out of memory\n");
            return 1;
        }
    }
    if (ref_json[0]) {
        char *text = ld_read(ref_json, NULL);
        cJSON *j = text ? cJSON_Parse(text) : NULL;
        const cJSON *refs = j ? cJSON_GetObjectItemCaseSensitive(j, "refs") : NULL;
        if (!cJSON_IsArray(refs)) {
            fprintf(stderr, "bench_link_dtype: --ref-json %s: no refs array\n", ref_json);
            return 1;
        }
        const cJSON *r;
        cJSON_ArrayForEach(r, refs) {
            const cJSON *p = cJSON_GetObjectItemCaseSensitive(r, "prompt_ids"), *v;
            int32_t ids[4096], n = 0;
            cJSON_ArrayForEach(v, p) if (n < 4096 && cJSON_IsNumber(v) && v->valueint >= 0 &&
                                         v->valueint < hp->n_vocab) ids[n++] = v->valueint;
            if (ld_add_source(&t, ids, n, window, tokenizer_bos(tok)) < 0) {
                fprintf(stderr, "bench_link_dtype: out of memory\n");
                return 1;
            }
        }
        cJSON_Delete(j);
        free(text);
    }
    /* --max-tokens: whole windows. */
    int32_t total = 0, n_win = 0;
    while (n_win < t.n_win && total + t.lens[n_win] <= max_tokens) total += t.lens[n_win++];
    if (n_win == 0) {
        fprintf(stderr, "bench_link_dtype: no window of at least 2 tokens to evaluate\n");
        return 1;
    }

    /* The 1x2 pipeline, split as the router splits (equal bytes). */
    gguf_file *gf = NULL;
    struct layersplit_sizes sz = {0};
    int32_t first[2], end[2];
    if (gguf_open(&gf, model, err, sizeof err) < 0 ||
        layersplit_sizes_gguf(&sz, gf, hp->n_layers, err, sizeof err) < 0 ||
        layersplit_ranges(&sz, 2, first, end, err, sizeof err) < 0) {
        fprintf(stderr, "bench_link_dtype: %s: the split: %s\n", model, err);
        return 1;
    }
    layersplit_sizes_free(&sz);
    gguf_close(gf);
    backend *b = NULL;
    char chosen[600];
    if (backend_open(&b, &dev, threads, 0, chosen, sizeof chosen, err, sizeof err) < 0) {
        fprintf(stderr, "bench_link_dtype: %s\n", err);
        return 1;
    }
    /* cuda:N must be that GPU: a measurement quietly taken on the CPU
     * instead would be another table's row (and a 7B one would not end). */
    if (dev.kind == DEVICE_CUDA && !backend_is_gpu(b)) {
        fprintf(stderr, "bench_link_dtype: --device %s did not open: %s\n", device, chosen);
        return 1;
    }
    struct ld_pipe p = {0};
    p.dim = hp->dim;
    stage **ss[2] = {&p.s0, &p.s1};
    kvblocks **kbs[2] = {&p.kb0, &p.kb1};
    for (int k = 0; k < 2; k++) {
        struct stage_config cfg;
        stage_config_default(&cfg);
        cfg.layer_first = first[k];
        cfg.layer_last = end[k];
        cfg.n_tokens_max = window;
        cfg.n_seqs_max = 1;
        cfg.n_ctx_max = window;
        cfg.n_logits_max = 64;
        if (stage_init(ss[k], m, b, &cfg, err, sizeof err) < 0 ||
            kvblocks_init(kbs[k], stage_config_get(*ss[k])->n_blocks, stage_config_get(*ss[k])->block_size, err,
                          sizeof err) < 0) {
            fprintf(stderr, "bench_link_dtype: stage %d (layers %d:%d): %s\n", k, first[k], end[k], err);
            return 1;
        }
    }
    void *zctx = zmq_ctx_new();
    if (link_zmq_init(&p.rx, zctx, LINK_RECV, "inproc://bench-link-dtype", 10000, err, sizeof err) < 0 ||
        link_zmq_init(&p.tx, zctx, LINK_SEND, "inproc://bench-link-dtype", 10000, err, sizeof err) < 0) {
        fprintf(stderr, "bench_link_dtype: link: %s\n", err);
        return 1;
    }
    size_t rows = (size_t)window * (size_t)hp->dim;
    p.hidden = malloc(rows * sizeof *p.hidden);
    p.recv = malloc(rows * sizeof *p.recv);
    float *got = malloc((size_t)window * (size_t)hp->n_vocab * sizeof *got);
    int32_t *ref_top = malloc((size_t)t.n * sizeof *ref_top);
    if (!p.hidden || !p.recv || !got || !ref_top) {
        fprintf(stderr, "bench_link_dtype: out of memory\n");
        return 1;
    }

    printf("model %s: %d layers, dim %d, vocab %d; 1x2 split layers [%d, %d) + [%d, %d); %d windows of up to %d "
           "tokens, %d tokens (%d predicted); on %s\n",
           model, hp->n_layers, hp->dim, hp->n_vocab, first[0], end[0], first[1], end[1], n_win, window, total,
           total - n_win, chosen);
    printf("| `--link-dtype` | top-1 equal to F32 links | perplexity | change | link bytes per token |\n");
    printf("|---|---|---|---|---|\n");
    double ppl_f32 = 0;
    if (control) dts[n_dts++] = LINK_DTYPE_F32; /* the last row, nudged */
    for (int d = 0; d < n_dts; d++) {
        p.nudge = control && d == n_dts - 1;
        if (link_set_dtype(p.tx, dts[d], (size_t)hp->dim) < 0) {
            fprintf(stderr, "bench_link_dtype: link_set_dtype %s: %s\n", link_dtype_names[dts[d]], link_errstr(p.tx));
            return 1;
        }
        uint64_t bytes0 = link_wire_bytes_sent(p.tx);
        int64_t same = 0, positions = 0, predicted = 0;
        double nll = 0;
        for (int32_t w = 0; w < n_win; w++) {
            const int32_t *ids = t.ids + t.starts[w];
            int32_t n = t.lens[w];
            if (ld_run(&p, ids, n, got, err, sizeof err) < 0) {
                fprintf(stderr, "bench_link_dtype: %s, window %d: %s\n", link_dtype_names[dts[d]], w, err);
                return 1;
            }
            for (int32_t r = 0; r < n; r++) {
                const float *row = got + (size_t)r * hp->n_vocab;
                int32_t top = ld_argmax(row, hp->n_vocab);
                if (d == 0) ref_top[t.starts[w] + r] = top;
                same += top == ref_top[t.starts[w] + r];
                positions++;
                if (r + 1 < n) {
                    nll += ld_nll(row, hp->n_vocab, ids[r + 1]);
                    predicted++;
                }
            }
        }
        double ppl = exp(nll / (double)predicted);
        if (d == 0) ppl_f32 = ppl;
        double per_token = (double)(link_wire_bytes_sent(p.tx) - bytes0) / (double)total;
        printf("| %s%s | %lld / %lld (%.2f%%) | %.4f | %+.3f%% | %.1f |\n", link_dtype_names[dts[d]],
               p.nudge ? " x (1 + 2^-20)" : "", (long long)same,
               (long long)positions, 100.0 * (double)same / (double)positions, ppl, 100.0 * (ppl / ppl_f32 - 1.0),
               per_token);
        fflush(stdout);
    }
    link_free(p.tx);
    link_free(p.rx);
    zmq_ctx_term(zctx);
    free(p.hidden);
    free(p.recv);
    free(got);
    free(ref_top);
    free(t.ids);
    free(t.starts);
    free(t.lens);
    for (int k = 0; k < 2; k++) {
        stage_free(*ss[k]);
        kvblocks_free(*kbs[k]);
    }
    backend_free(b);
    model_file_close(m);
    return 0;
}
