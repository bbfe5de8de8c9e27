/* llm-run: the whole model in one process, for a newcomer's first try and
 * for the tests.  It generates from a prompt (text streamed as it comes),
 * tokenizes, or runs given ids through the model in one teacher-forced
 * prefill and prints the top logits of every position with the perplexity.
 * Same stage and forward step as the worker, with the whole layer range. */
#include "forward.h"
#include "stage.h"

#include "common/device.h"
#include "common/kvblocks.h"
#include "common/log.h"
#include "common/model.h"
#include "common/options.h"
#include "common/sampling.h"
#include "common/status.h"
#include "common/tokenizer.h"
#include "kernels/backend.h"

#include <cjson/cJSON.h>
#include <errno.h>
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

struct run_opts {
    const char *model, *prompt, *tokenize, *eval_ids, *device, *log_level;
    int max_tokens, top, top_k, threads, kv_blocks, kv_type, ctx, batch;
    double temperature, top_p, min_p, repeat_penalty;
    int64_t seed;
    bool json, stop_at_eos, require_gpu, bos, parse_special;
    struct device_spec dev; /* --device, parsed */
};

static double run_now(void) {
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return ts.tv_sec + ts.tv_nsec * 1e-9;
}

/* The device --device names.  Under auto the user did not choose, so the
 * choice is told on stderr: backend_open logs it at info level, and below
 * that level (the default, warn) it gets a line of its own. */
static int run_backend(const struct run_opts *o, backend **out, char *err, size_t errlen) {
    char chosen[600];
    int rc = backend_open(out, &o->dev, o->threads, o->require_gpu, chosen, sizeof chosen, err, errlen);
    if (rc == STATUS_OK && o->dev.kind == DEVICE_AUTO && log_level_min > LL_INFO && log_level_min < LL_NONE)
        fprintf(stderr, "llm-run: device auto: %s\n", chosen);
    return rc;
}

static cJSON *run_json_ids(const int32_t *ids, int32_t n) {
    cJSON *a = cJSON_CreateArray();
    for (int32_t i = 0; a && i < n; i++) cJSON_AddItemToArray(a, cJSON_CreateNumber(ids[i]));
    return a;
}

static void run_print_json(cJSON *j) {
    char *s = cJSON_PrintUnformatted(j);
    if (s) {
        printf("%s\n", s);
        cJSON_free(s);
    }
    fflush(stdout);
}

/* Tokenizes text; add_bos and parse_special as tokenizer_encode takes
 * them (-1: the BOS rule of the metadata).  *ids is malloc'ed. */
static int run_encode(const tokenizer *tok, const char *text, int add_bos, int parse_special, int32_t **ids,
                      int32_t *n, char *err, size_t errlen) {
    size_t len = strlen(text);
    int32_t cap = (int32_t)(len + 8);
    *ids = malloc((size_t)cap * sizeof **ids);
    if (!*ids) {
        snprintf(err, errlen, "out of memory for %zu bytes of text", len);
        return STATUS_NO_MEMORY;
    }
    int32_t got = tokenizer_encode(tok, text, len, add_bos, parse_special, *ids, cap);
    if (got > cap) { /* cannot happen with one token per byte plus BOS, but the API allows it */
        int32_t *more = realloc(*ids, (size_t)got * sizeof **ids);
        if (!more) {
            snprintf(err, errlen, "out of memory for %d tokens", got);
            return STATUS_NO_MEMORY;
        }
        *ids = more;
        got = tokenizer_encode(tok, text, len, add_bos, parse_special, *ids, got);
    }
    if (got < 0) {
        snprintf(err, errlen, "cannot tokenize the text: %s", status_str(got));
        return got;
    }
    *n = got;
    return STATUS_OK;
}

/* "1,403,407" -> ids; *ids is malloc'ed. */
static int run_parse_ids(const char *text, int32_t **ids, int32_t *n, char *err, size_t errlen) {
    int32_t cap = 1;
    for (const char *p = text; *p; p++) cap += *p == ',';
    *ids = malloc((size_t)cap * sizeof **ids);
    if (!*ids) return STATUS_NO_MEMORY;
    *n = 0;
    const char *p = text;
    while (*p) {
        char *end;
        errno = 0;
        long v = strtol(p, &end, 10);
        if (end == p || errno || v < 0 || v > INT32_MAX || (*end && *end != ',')) {
            snprintf(err, errlen, "--eval-ids: item %d of \"%s\" is not a token id", *n, text);
            return STATUS_BAD_INPUT;
        }
        (*ids)[(*n)++] = (int32_t)v;
        p = *end ? end + 1 : end;
    }
    if (*n == 0) {
        snprintf(err, errlen, "--eval-ids: no ids in \"%s\"", text);
        return STATUS_BAD_INPUT;
    }
    return STATUS_OK;
}

/* Runs ids[0..n) as one sequence from position 0, in chunks of the stage's
 * step size.  For each row that produced logits, calls row_fn(pos, logits). */
typedef int (*run_row_fn)(void *ud, int32_t pos, const float *logits);

static int run_prefill(stage *s, kvblocks *kb, struct kvblocks_table *t, const int32_t *ids, int32_t n,
                       enum forward_logits mode, float *logits, run_row_fn row_fn, void *ud, char *err,
                       size_t errlen) {
    int32_t step = stage_config_get(s)->n_tokens_max;
    int32_t n_vocab = stage_hparams(s)->n_vocab;
    for (int32_t done = 0; done < n;) {
        int32_t c = n - done < step ? n - done : step;
        int32_t pos0 = t->n_tokens;
        struct kvblocks_copy cp;
        int32_t n_cp = 0;
        int rc = kvblocks_reserve(kb, t, c, &cp, &n_cp);
        if (rc != STATUS_OK) {
            snprintf(err, errlen, "KV cache: no room for %d more tokens at position %d (%d blocks free)", c,
                     pos0, kvblocks_n_free(kb));
            return rc;
        }
        enum forward_logits m = mode == FORWARD_LOGITS_LAST && done + c < n ? FORWARD_LOGITS_NONE : mode;
        struct forward_seq q = {ids + done, c, pos0, t->ids, t->n_ids, m};
        struct forward_batch b = {&q, 1, &cp, n_cp, NULL, 0};
        struct forward_out out = {logits, 0, NULL, NULL};
        rc = forward_step(s, &b, &out, err, errlen);
        if (rc != STATUS_OK) return rc;
        for (int32_t r = 0; row_fn && r < out.n_logits; r++) {
            int32_t pos = m == FORWARD_LOGITS_ALL ? pos0 + r : pos0 + c - 1;
            rc = row_fn(ud, pos, logits + (size_t)r * n_vocab);
            if (rc != STATUS_OK) return rc;
        }
        done += c;
    }
    return STATUS_OK;
}

/* ---- --eval-ids ---- */

struct run_eval {
    const int32_t *ids;
    int32_t n, n_vocab, top;
    cJSON *rows;
    double nll;
    int32_t n_nll;
};

static int run_eval_row(void *ud, int32_t pos, const float *logits) {
    struct run_eval *e = ud;
    int32_t best[64];
    int32_t k = e->top < 64 ? e->top : 64, nb = 0;
    if (k > e->n_vocab) k = e->n_vocab;
    /* Top k by insertion: k is small and the vocabulary is read once. */
    for (int32_t i = 0; i < e->n_vocab; i++) {
        if (nb == k && logits[i] <= logits[best[k - 1]]) continue;
        int32_t j = nb < k ? nb++ : k - 1;
        while (j > 0 && logits[best[j - 1]] < logits[i]) {
            best[j] = best[j - 1];
            j--;
        }
        best[j] = i;
    }
    cJSON *row = cJSON_CreateArray();
    for (int32_t j = 0; j < nb; j++) {
        cJSON *pair = cJSON_CreateArray();
        cJSON_AddItemToArray(pair, cJSON_CreateNumber(best[j]));
        cJSON_AddItemToArray(pair, cJSON_CreateNumber(logits[best[j]]));
        cJSON_AddItemToArray(row, pair);
    }
    cJSON_AddItemToArray(e->rows, row);
    if (pos + 1 < e->n) {
        /* -log softmax(logits)[next], computed around the maximum. */
        double m = logits[best[0]], sum = 0;
        for (int32_t i = 0; i < e->n_vocab; i++) sum += exp((double)logits[i] - m);
        e->nll += m + log(sum) - logits[e->ids[pos + 1]];
        e->n_nll++;
    }
    return STATUS_OK;
}

/* ---- generation ---- */

struct run_gen {
    int32_t *history; /* prompt then generated ids; malloc'ed */
    int32_t *ids;     /* the generated part of history */
    int32_t n, cap;
    char *text;    /* generated text, for --json */
    size_t text_len, text_cap;
};

static int run_gen_append_text(struct run_gen *g, const char *s, size_t len) {
    if (g->text_len + len + 1 > g->text_cap) {
        size_t cap = g->text_cap ? g->text_cap * 2 : 256;
        while (cap < g->text_len + len + 1) cap *= 2;
        char *t = realloc(g->text, cap);
        if (!t) return STATUS_NO_MEMORY;
        g->text = t;
        g->text_cap = cap;
    }
    memcpy(g->text + g->text_len, s, len);
    g->text_len += len;
    g->text[g->text_len] = 0;
    return STATUS_OK;
}

static const struct option_def run_defs_proto[] = {
    {"model", "LLM_MODEL", OPTION_STRING, NULL, "GGUF file or Hugging Face directory", NULL, 0, 0, NULL},
    {"prompt", NULL, OPTION_STRING, NULL, "generate a continuation of this text", NULL, 0, 0, NULL},
    {"tokenize", NULL, OPTION_STRING, NULL, "print the token ids of this text", NULL, 0, 0, NULL},
    {"eval-ids", NULL, OPTION_STRING, NULL, "comma-separated ids: print the top logits of every position and the perplexity", NULL, 0, 0, NULL},
    {"top", NULL, OPTION_INT, "5", "--eval-ids: logits per position", NULL, 1, 64, NULL},
    {"max-tokens", NULL, OPTION_INT, "128", "tokens to generate at most", NULL, 0, 1 << 20, NULL},
    {"temperature", NULL, OPTION_FLOAT, "0", "sampling temperature; 0 is greedy (argmax)", NULL, 0, 100, NULL},
    {"top-k", NULL, OPTION_INT, "0", "keep the k most likely tokens (0: all)", NULL, 0, 1 << 30, NULL},
    {"top-p", NULL, OPTION_FLOAT, "1", "keep the smallest set of tokens with this much probability", NULL, 0, 1, NULL},
    {"min-p", NULL, OPTION_FLOAT, "0", "drop tokens below this fraction of the top probability", NULL, 0, 1, NULL},
    {"repeat-penalty", NULL, OPTION_FLOAT, "1", "repetition penalty (1: off)", NULL, 0, 10, NULL},
    {"seed", NULL, OPTION_SIZE, "0", "sampling seed", NULL, 0, 0, NULL},
    {"json", NULL, OPTION_BOOL, "false", "print one JSON object on the last line", NULL, 0, 0, NULL},
    {"stop-at-eos", NULL, OPTION_BOOL, "true", "stop at an end-of-generation token", NULL, 0, 0, NULL},
    {"threads", "LLM_THREADS", OPTION_INT, "0", "CPU threads (0: one per core)", NULL, 0, 1024, NULL},
    {"kv-blocks", "LLM_KV_BLOCKS", OPTION_INT, "0", "KV cache blocks of 16 positions (0: enough for the run)", NULL, 0, 1 << 24, NULL},
    {"kv-type", "LLM_KV_TYPE", OPTION_CHOICE, "auto", "KV cache elements: auto (f32 on the CPU, f16 on a GPU), f32, f16 or q8_0 (8-bit, about half of f16's memory)", NULL, 0, 0, kvcache_type_names},
    {"ctx", NULL, OPTION_INT, "0", "positions per sequence (0: prompt + max tokens)", NULL, 0, 1 << 24, NULL},
    {"batch", NULL, OPTION_INT, "512", "tokens per prefill step", NULL, 1, 1 << 20, NULL},
    {"bos", NULL, OPTION_BOOL, "true", "--tokenize: add BOS as the metadata says (--no-bos: never)", NULL, 0, 0, NULL},
    {"parse-special", NULL, OPTION_BOOL, "true", "--tokenize: turn the text of special tokens (\"<s>\") into their ids", NULL, 0, 0, NULL},
    {"device", "LLM_DEVICE", OPTION_STRING, "auto", "auto (a GPU when one can be used, else the CPU), cpu, cuda or cuda:N", NULL, 0, 0, NULL},
    {"require-gpu", NULL, OPTION_BOOL, "false", "fail instead of falling back to the CPU", NULL, 0, 0, NULL},
    {"log-level", "LLM_LOG_LEVEL", OPTION_STRING, "warn", "debug, info, warn, error or none", NULL, 0, 0, NULL},
};

/* --tokenize reads only the tokenizer, so it also works on vocab-only
 * GGUF files (metadata without tensors) and needs no device. */
static int run_tokenize(const struct run_opts *o, char *err, size_t errlen) {
    tokenizer *tok = NULL;
    int32_t *ids = NULL, n = 0;
    int rc = tokenizer_load(&tok, o->model, err, errlen);
    if (rc == STATUS_OK) rc = run_encode(tok, o->tokenize, o->bos ? -1 : 0, o->parse_special, &ids, &n, err, errlen);
    if (rc == STATUS_OK && o->json) {
        cJSON *json = cJSON_CreateObject();
        cJSON_AddItemToObject(json, "ids", run_json_ids(ids, n));
        run_print_json(json);
        cJSON_Delete(json);
    } else if (rc == STATUS_OK) {
        for (int32_t i = 0; i < n; i++) printf("%s%d", i ? " " : "", ids[i]);
        printf("\n");
    }
    free(ids);
    tokenizer_free(tok);
    return rc;
}

static int run_main(struct run_opts *o, char *err, size_t errlen) {
    int n_modes = !!o->prompt + !!o->tokenize + !!o->eval_ids;
    if (!o->model || n_modes != 1) {
        snprintf(err, errlen, "need --model and exactly one of --prompt, --tokenize, --eval-ids (see --help)");
        return STATUS_BAD_INPUT;
    }
    if (o->tokenize) return run_tokenize(o, err, errlen);
    backend *b = NULL;
    model_file *m = NULL;
    stage *s = NULL;
    kvblocks *kb = NULL;
    struct kvblocks_table t;
    kvblocks_table_init(&t);
    int32_t *prompt = NULL, n_prompt = 0;
    float *logits = NULL;
    cJSON *json = NULL;
    struct run_gen g = {0};
    sampler *smp = NULL;
    int rc = model_file_open(&m, o->model, err, errlen);
    if (rc != STATUS_OK) goto done;
    const tokenizer *tok = model_file_tokenizer(m);
    const struct model_hparams *hp = model_file_hparams(m);

    if (o->eval_ids) rc = run_parse_ids(o->eval_ids, &prompt, &n_prompt, err, errlen);
    else rc = run_encode(tok, o->prompt, -1, 1, &prompt, &n_prompt, err, errlen);
    if (rc != STATUS_OK) goto done;
    /* An empty prompt is BOS alone, where the tokenizer adds one. */
    if (n_prompt == 0) {
        snprintf(err, errlen, "the prompt is empty and %s's tokenizer adds no BOS: no token to generate from",
                 o->model);
        rc = STATUS_BAD_INPUT;
        goto done;
    }
    rc = run_backend(o, &b, err, errlen);
    if (rc != STATUS_OK) goto done;

    struct stage_config cfg;
    stage_config_default(&cfg);
    int32_t want_ctx = n_prompt + (o->eval_ids ? 0 : o->max_tokens);
    cfg.n_ctx_max = o->ctx > 0 ? o->ctx : want_ctx;
    if (cfg.n_ctx_max < want_ctx) {
        snprintf(err, errlen, "--ctx %d: the run needs %d positions", o->ctx, want_ctx);
        rc = STATUS_BAD_INPUT;
        goto done;
    }
    if (hp->ctx_len > 0 && want_ctx > hp->ctx_len)
        LOG(LL_WARN, "%s: %d positions exceed the trained context of %d", o->model, want_ctx, hp->ctx_len);
    cfg.n_seqs_max = 1;
    cfg.n_tokens_max = o->batch;
    cfg.n_blocks = o->kv_blocks;
    cfg.kv_type = kvcache_type_of_name(o->kv_type);
    /* Evaluation wants every row's logits: run lm_head on up to 64 rows at once. */
    cfg.n_logits_max = o->eval_ids ? 64 : 1;
    rc = stage_init(&s, m, b, &cfg, err, errlen);
    if (rc != STATUS_OK) goto done;
    const struct stage_config *c = stage_config_get(s);
    rc = kvblocks_init(&kb, c->n_blocks, c->block_size, err, errlen);
    if (rc != STATUS_OK) goto done;
    int32_t n_rows = o->eval_ids ? (c->n_tokens_max < n_prompt ? c->n_tokens_max : n_prompt) : 1;
    logits = malloc(sizeof(float) * (size_t)hp->n_vocab * n_rows);
    if (!logits) {
        snprintf(err, errlen, "out of memory for %d rows of %d logits", n_rows, hp->n_vocab);
        rc = STATUS_NO_MEMORY;
        goto done;
    }

    if (o->eval_ids) {
        struct run_eval e = {prompt, n_prompt, hp->n_vocab, o->top, cJSON_CreateArray(), 0, 0};
        double t0 = run_now();
        rc = run_prefill(s, kb, &t, prompt, n_prompt, FORWARD_LOGITS_ALL, logits, run_eval_row, &e, err, errlen);
        LOG(LL_INFO, "eval: %d tokens in %.3f s", n_prompt, run_now() - t0);
        json = cJSON_CreateObject();
        cJSON_AddItemToObject(json, "top", e.rows);
        if (rc != STATUS_OK) goto done;
        if (e.n_nll > 0) cJSON_AddNumberToObject(json, "perplexity", exp(e.nll / e.n_nll));
        else cJSON_AddNullToObject(json, "perplexity");
        if (o->json) {
            run_print_json(json);
        } else {
            if (e.n_nll > 0) printf("perplexity %.6f over %d predicted tokens\n", exp(e.nll / e.n_nll), e.n_nll);
            else printf("perplexity: none (one token predicts nothing)\n");
        }
        goto done;
    }

    /* Generation.  history = prompt then generated ids (the penalties' view). */
    struct sampling_params sp;
    sampling_params_default(&sp);
    sp.temperature = (float)o->temperature;
    sp.top_k = o->top_k;
    sp.top_p = (float)o->top_p;
    sp.min_p = (float)o->min_p;
    sp.repetition_penalty = (float)o->repeat_penalty;
    sp.seed = (uint64_t)o->seed;
    rc = sampling_params_validate(&sp, hp->n_vocab, err, errlen);
    if (rc != STATUS_OK) goto done;
    rc = sampler_init(&smp, hp->n_vocab, err, errlen);
    if (rc != STATUS_OK) goto done;
    g.cap = n_prompt + (o->max_tokens > 0 ? o->max_tokens : 1);
    g.history = malloc(sizeof(int32_t) * (size_t)g.cap);
    g.ids = g.history ? g.history + n_prompt : NULL;
    if (g.history) memcpy(g.history, prompt, sizeof(int32_t) * (size_t)n_prompt);
    if (!g.ids) {
        rc = STATUS_NO_MEMORY;
        snprintf(err, errlen, "out of memory");
        goto done;
    }
    struct detok d;
    tokenizer_detok_init(&d, 0);
    double t0 = run_now();
    rc = run_prefill(s, kb, &t, prompt, n_prompt, FORWARD_LOGITS_LAST, logits, NULL, NULL, err, errlen);
    if (rc != STATUS_OK) goto done;
    double t1 = run_now();
    char piece[256];
    while (g.n < o->max_tokens) {
        struct sampling_result res;
        rc = sampler_sample(smp, logits, &sp, g.history, n_prompt + g.n, n_prompt + g.n, &res);
        if (rc != STATUS_OK) {
            snprintf(err, errlen, "sampling token %d: %s", g.n, sampler_errstr(smp));
            goto done;
        }
        int32_t id = res.token;
        if (o->stop_at_eos && tokenizer_is_eog(tok, id)) break;
        g.ids[g.n++] = id;
        int len = tokenizer_detok_push(tok, &d, id, piece, sizeof piece);
        if (len > 0) {
            fwrite(piece, 1, (size_t)len, stdout);
            fflush(stdout);
            if (run_gen_append_text(&g, piece, (size_t)len) != STATUS_OK) {
                rc = STATUS_NO_MEMORY;
                snprintf(err, errlen, "out of memory");
                goto done;
            }
        }
        if (g.n == o->max_tokens) break;
        rc = run_prefill(s, kb, &t, &id, 1, FORWARD_LOGITS_LAST, logits, NULL, NULL, err, errlen);
        if (rc != STATUS_OK) goto done;
    }
    int len = tokenizer_detok_flush(&d, piece, sizeof piece);
    if (len > 0) {
        fwrite(piece, 1, (size_t)len, stdout);
        if (run_gen_append_text(&g, piece, (size_t)len) != STATUS_OK) {
            rc = STATUS_NO_MEMORY;
            snprintf(err, errlen, "out of memory");
            goto done;
        }
    }
    double t2 = run_now();
    printf("\n");
    LOG(LL_INFO, "prefill %d tokens in %.3f s (%.1f tok/s); decode %d tokens in %.3f s (%.1f tok/s)", n_prompt,
        t1 - t0, n_prompt / (t1 - t0), g.n, t2 - t1, g.n > 1 ? (g.n - 1) / (t2 - t1) : 0.0);
    if (o->json) {
        json = cJSON_CreateObject();
        cJSON_AddItemToObject(json, "prompt_ids", run_json_ids(prompt, n_prompt));
        cJSON_AddItemToObject(json, "ids", run_json_ids(g.ids, g.n));
        cJSON_AddStringToObject(json, "text", g.text ? g.text : "");
        run_print_json(json);
    }
done:
    cJSON_Delete(json);
    free(g.history);
    free(g.text);
    sampler_free(smp);
    free(logits);
    free(prompt);
    if (kb) kvblocks_table_free(kb, &t);
    kvblocks_free(kb);
    stage_free(s);
    model_file_close(m);
    backend_free(b);
    return rc;
}

int main(int argc, char **argv) {
    struct run_opts o;
    memset(&o, 0, sizeof o);
    struct option_def defs[sizeof run_defs_proto / sizeof run_defs_proto[0]];
    memcpy(defs, run_defs_proto, sizeof defs);
    void *targets[] = {&o.model, &o.prompt, &o.tokenize, &o.eval_ids, &o.top, &o.max_tokens,
                       &o.temperature, &o.top_k, &o.top_p, &o.min_p, &o.repeat_penalty, &o.seed, &o.json, &o.stop_at_eos,
                       &o.threads, &o.kv_blocks, &o.kv_type, &o.ctx, &o.batch, &o.bos, &o.parse_special, &o.device, &o.require_gpu,
                       &o.log_level};
    _Static_assert(sizeof targets / sizeof targets[0] == sizeof defs / sizeof defs[0], "one target per option");
    for (size_t i = 0; i < sizeof defs / sizeof defs[0]; i++) defs[i].target = targets[i];
    struct options opts = {"llm-run", "--model PATH (--prompt TEXT | --tokenize TEXT | --eval-ids IDS) [options]",
                           "Runs a model in one process: generation, tokenization or teacher-forced evaluation.",
                           defs, (int)(sizeof defs / sizeof defs[0]), false};
    char err[1024] = "";
    log_set_process("llm-run");
    int rc = options_parse(&opts, &argc, argv, err, sizeof err);
    if (rc == STATUS_CANCELLED) return 0;
    if (rc != STATUS_OK) {
        fprintf(stderr, "llm-run: %s\n", err);
        return 2;
    }
    if (argc > 1) {
        fprintf(stderr, "llm-run: unexpected argument \"%s\" (see --help)\n", argv[1]);
        return 2;
    }
    int level;
    if (log_level_parse(o.log_level, &level) != STATUS_OK) {
        fprintf(stderr, "llm-run: --log-level %s: expected debug, info, warn, error or none\n", o.log_level);
        return 2;
    }
    log_set_level(level);
    if (device_parse("--device", o.device, &o.dev, err, sizeof err) != STATUS_OK) {
        fprintf(stderr, "llm-run: %s\n", err);
        return 2;
    }
    rc = run_main(&o, err, sizeof err);
    if (rc != STATUS_OK) {
        fflush(stdout);
        fprintf(stderr, "llm-run: %s\n", err);
        return 1;
    }
    return 0;
}
