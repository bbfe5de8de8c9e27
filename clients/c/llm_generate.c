/* llm generate: the options and output of llm-run (text streamed to
 * stdout, --json's object on the last line), asked of the router. */
#include "llm_cli.h"

#include "common/log.h"
#include "common/status.h"
#include "common/unicode.h"

#include <errno.h>
#include <signal.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

static cJSON *llm_json_ids(const int32_t *ids, size_t n) {
    cJSON *a = cJSON_CreateArray();
    for (size_t i = 0; a && i < n; i++) cJSON_AddItemToArray(a, cJSON_CreateNumber(ids[i]));
    return a;
}

/* ---- generate ------------------------------------------------------------- */

/* One token's logprob as --logprobs prints it (texts malloc'ed). */
struct llm_lp_alt {
    int32_t token;
    float logprob;
    char *text;
    size_t text_len;
};
struct llm_lp_rec {
    struct llm_lp_alt chosen;
    struct llm_lp_alt *top;
    size_t n_top;
};

struct llm_gen_out {
    int32_t *ids;
    size_t n, cap;
    char *text;
    size_t text_len, text_cap;
    struct llm_lp_rec *lps;   /* --logprobs: one per token, n_lps of them */
    size_t n_lps, cap_lps;
    bool oom;
    /* When the first and the latest chunk came (llm_now_us; 0: none yet)
     * and the tokens of the first: --json's decode timing. */
    int64_t first_us, last_us;
    size_t n_first;
};

static bool llm_lp_copy(struct llm_lp_alt *d, int32_t token, float logprob, const char *text, size_t len) {
    d->token = token;
    d->logprob = logprob;
    d->text_len = len;
    d->text = malloc(len + 1);
    if (!d->text) return false;
    memcpy(d->text, text, len);
    d->text[len] = 0;
    return true;
}

/* Keeps a chunk's logprobs for the listing after the text. */
static bool llm_lp_keep(struct llm_gen_out *o, const struct llm_chunk *ch) {
    if (o->n_lps + ch->n_logprobs > o->cap_lps) {
        size_t cap = o->cap_lps ? o->cap_lps : 64;
        while (cap < o->n_lps + ch->n_logprobs) cap *= 2;
        struct llm_lp_rec *t = realloc(o->lps, cap * sizeof *t);
        if (!t) return false;
        o->lps = t;
        o->cap_lps = cap;
    }
    for (size_t i = 0; i < ch->n_logprobs; i++) {
        const struct llm_token_logprob *l = &ch->logprobs[i];
        struct llm_lp_rec *r = &o->lps[o->n_lps++];
        memset(r, 0, sizeof *r);
        if (!llm_lp_copy(&r->chosen, l->token, l->logprob, l->text, l->text_len)) return false;
        r->top = calloc(l->n_top + 1, sizeof *r->top);
        if (!r->top) return false;
        for (size_t k = 0; k < l->n_top; k++, r->n_top++)
            if (!llm_lp_copy(&r->top[k], l->top[k].token, l->top[k].logprob, l->top[k].text, l->top[k].text_len))
                return false;
    }
    return true;
}

static void llm_lp_free(struct llm_gen_out *o) {
    for (size_t i = 0; i < o->n_lps; i++) {
        free(o->lps[i].chosen.text);
        for (size_t k = 0; k < o->lps[i].n_top; k++) free(o->lps[i].top[k].text);
        free(o->lps[i].top);
    }
    free(o->lps);
}

/* A token's text as JSON shows it: the text when it is whole UTF-8, else
 * "bytes:\xNN..." (OpenAI's form); out holds 4 * len + 8 bytes. */
static const char *llm_lp_text(const struct llm_lp_alt *a, char *out, size_t size) {
    if (unicode_utf8_valid_prefix(a->text, a->text_len) == a->text_len) return a->text;
    size_t n = (size_t)snprintf(out, size, "bytes:");
    for (size_t i = 0; i < a->text_len && n + 5 < size; i++)
        n += (size_t)snprintf(out + n, size - n, "\\x%02x", (unsigned char)a->text[i]);
    return out;
}

static cJSON *llm_lp_json(const struct llm_lp_alt *a) {
    cJSON *j = cJSON_CreateObject();
    char *buf = malloc(4 * a->text_len + 8);
    cJSON_AddNumberToObject(j, "id", a->token);
    cJSON_AddStringToObject(j, "text", buf ? llm_lp_text(a, buf, 4 * a->text_len + 8) : "");
    cJSON_AddNumberToObject(j, "logprob", a->logprob);
    cJSON *b = cJSON_AddArrayToObject(j, "bytes");
    for (size_t i = 0; i < a->text_len; i++) cJSON_AddItemToArray(b, cJSON_CreateNumber((unsigned char)a->text[i]));
    free(buf);
    return j;
}

/* A token's text for the terminal: quoted, with control characters and the
 * bytes of a partial character escaped. */
static void llm_lp_print_text(const struct llm_lp_alt *a) {
    bool valid = unicode_utf8_valid_prefix(a->text, a->text_len) == a->text_len;
    putchar('"');
    for (size_t i = 0; i < a->text_len; i++) {
        unsigned char c = (unsigned char)a->text[i];
        if (c == '\n') fputs("\\n", stdout);
        else if (c == '"' || c == '\\') printf("\\%c", c);
        else if (c < 0x20 || c == 0x7f || (c >= 0x80 && !valid)) printf("\\x%02x", c);
        else putchar(c);
    }
    putchar('"');
}

/* --logprobs without --json: one line per token after the text. */
static void llm_lp_print(const struct llm_gen_out *o) {
    printf("logprobs (token: text logprob, then the most likely alternatives):\n");
    for (size_t i = 0; i < o->n_lps; i++) {
        const struct llm_lp_rec *r = &o->lps[i];
        printf("%4zu %6d ", i, r->chosen.token);
        llm_lp_print_text(&r->chosen);
        printf(" %.4f", r->chosen.logprob);
        for (size_t k = 0; k < r->n_top; k++) {
            printf(k == 0 ? "   | " : ", ");
            llm_lp_print_text(&r->top[k]);
            printf(" %.4f", r->top[k].logprob);
        }
        printf("\n");
    }
}

/* Ctrl-C during `llm generate` cancels the request at its next chunk
 * (a second Ctrl-C ends llm at once: the handler resets itself). */
static volatile sig_atomic_t llm_interrupted;
static void llm_on_sigint(int sig) {
    (void)sig;
    llm_interrupted = 1;
}

static int llm_gen_keep(struct llm_gen_out *o, const struct llm_chunk *ch);

static int llm_gen_chunk(void *ud, const struct llm_chunk *ch) {
    struct llm_gen_out *o = ud;
    if (llm_interrupted) return 1;
    fwrite(ch->text, 1, ch->text_len, stdout);
    fflush(stdout);
    return llm_gen_keep(o, ch);
}

/* --n > 1: each choice's tokens kept apart (ud: PROTO_N_MAX outputs),
 * printed once all are done. */
static int llm_gen_chunk_choices(void *ud, const struct llm_chunk *ch) {
    struct llm_gen_out *outs = ud;
    if (llm_interrupted) return 1;
    return ch->choice < PROTO_N_MAX ? llm_gen_keep(&outs[ch->choice], ch) : 0;
}

/* Keeps a chunk's ids, text and logprobs in o; 1 (cancel) when out of
 * memory. */
static int64_t llm_now_us(void) {
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (int64_t)ts.tv_sec * 1000000 + ts.tv_nsec / 1000;
}

static int llm_gen_keep(struct llm_gen_out *o, const struct llm_chunk *ch) {
    if (ch->n_tokens > 0) {
        o->last_us = llm_now_us();
        if (o->first_us == 0) {
            o->first_us = o->last_us;
            o->n_first = ch->n_tokens;
        }
    }
    if (o->n + ch->n_tokens > o->cap) {
        size_t cap = o->cap ? o->cap : 64;
        while (cap < o->n + ch->n_tokens) cap *= 2;
        int32_t *t = realloc(o->ids, cap * sizeof *t);
        if (!t) {
            o->oom = true;
            return 1;
        }
        o->ids = t;
        o->cap = cap;
    }
    memcpy(o->ids + o->n, ch->token_ids, ch->n_tokens * sizeof *o->ids);
    o->n += ch->n_tokens;
    if (o->text_len + ch->text_len + 1 > o->text_cap) {
        size_t cap = o->text_cap ? o->text_cap : 256;
        while (cap < o->text_len + ch->text_len + 1) cap *= 2;
        char *t = realloc(o->text, cap);
        if (!t) {
            o->oom = true;
            return 1;
        }
        o->text = t;
        o->text_cap = cap;
    }
    memcpy(o->text + o->text_len, ch->text, ch->text_len);
    o->text_len += ch->text_len;
    o->text[o->text_len] = 0;
    if (ch->n_logprobs > 0 && !llm_lp_keep(o, ch)) {
        o->oom = true;
        return 1;
    }
    return 0;
}

/* --stop may be given several times, which the option table (one value
 * per flag) does not hold: the table checks it and says it in --help, and
 * this collects every value.  Returns how many were found (at most max). */
static size_t llm_collect_stops(int argc, char **argv, const char **stops, size_t max) {
    size_t n = 0;
    for (int i = 1; i < argc && n < max; i++) {
        if (strcmp(argv[i], "--") == 0) break;
        if (strcmp(argv[i], "--stop") == 0 && i + 1 < argc) stops[n++] = argv[++i];
        else if (strncmp(argv[i], "--stop=", 7) == 0) stops[n++] = argv[i] + 7;
        else if (strncmp(argv[i], "--", 2) == 0 && !strchr(argv[i], '=') && i + 1 < argc &&
                 strncmp(argv[i + 1], "--", 2) != 0)
            i++; /* another flag's value, which may itself read "--stop" */
    }
    return n;
}

/* A whole file as a NUL-terminated string (malloc'ed), or NULL after
 * saying why on stderr. */
static char *llm_read_file(const char *path) {
    FILE *f = fopen(path, "rb");
    if (!f) {
        fprintf(stderr, "llm generate: %s: %s\n", path, strerror(errno));
        return NULL;
    }
    size_t cap = 4096, len = 0;
    char *buf = malloc(cap);
    size_t got;
    while (buf && (got = fread(buf + len, 1, cap - len - 1, f)) > 0) {
        len += got;
        if (len + 1 == cap) {
            char *t = cap < ((size_t)1 << 26) ? realloc(buf, cap * 2) : NULL;
            if (!t) {
                free(buf);
                buf = NULL;
                fprintf(stderr, "llm generate: %s: larger than 64 MiB or out of memory\n", path);
                break;
            }
            buf = t;
            cap *= 2;
        }
    }
    int bad = ferror(f);
    fclose(f);
    if (!buf) return NULL;
    if (bad) {
        fprintf(stderr, "llm generate: %s: read error\n", path);
        free(buf);
        return NULL;
    }
    buf[len] = 0;
    return buf;
}

/* The integers of text (token ids; anything but digits and '-' separates
 * them) into *ids (malloc'ed).  0, or 2 after saying why on stderr. */
static int llm_parse_ids(const char *text, const char *path, int32_t **ids, size_t *n) {
    size_t cap = 0;
    *ids = NULL;
    *n = 0;
    for (const char *p = text; *p;) {
        if (!(*p == '-' || (*p >= '0' && *p <= '9'))) {
            p++;
            continue;
        }
        char *end = NULL;
        errno = 0;
        long v = strtol(p, &end, 10);
        if (end == p || errno || v < INT32_MIN || v > INT32_MAX) {
            fprintf(stderr, "llm generate: --prediction-ids %s: \"%.16s\" is not a token id\n", path, p);
            free(*ids);
            *ids = NULL;
            return 2;
        }
        if (*n == cap) {
            cap = cap ? 2 * cap : 256;
            int32_t *t = realloc(*ids, cap * sizeof *t);
            if (!t) {
                fprintf(stderr, "llm generate: --prediction-ids %s: out of memory\n", path);
                free(*ids);
                *ids = NULL;
                return 2;
            }
            *ids = t;
        }
        (*ids)[(*n)++] = (int32_t)v;
        p = end;
    }
    return 0;
}

int llm_generate(struct llm_global *gl, int argc, char **argv) {
    /* Before options_parse, which moves argv's entries. */
    const char *stops[PROTO_STOP_STRINGS_MAX + 1];
    size_t n_stops = llm_collect_stops(argc, argv, stops, PROTO_STOP_STRINGS_MAX + 1);
    const char *prompt = NULL, *request_id = NULL, *model = NULL;
    const char *stop_flag = NULL, *schema_file = NULL, *grammar_file = NULL, *prediction_file = NULL;
    const char *prediction_ids_file = NULL;
    bool json_object = false;
    int n_choices = 1;
    int max_tokens, top_k, priority, timeout_ms, logprobs, penalty_last_n, spec = 0, spec_tokens;
    /* GenerateRequest.Spec's values, in order. */
    static const char *const spec_modes[] = {"default", "off", "ngram", "draft", "auto", NULL};
    double temperature, top_p, min_p, presence_penalty, frequency_penalty, repetition_penalty;
    int64_t seed;
    bool json, stop_at_eos, stream;
    const struct option_def defs[] = {
        {"prompt", NULL, OPTION_STRING, NULL, "generate a continuation of this text", &prompt, 0, 0, NULL},
        {"max-tokens", NULL, OPTION_INT, "128", "tokens to generate at most (0: until a stop)", &max_tokens, 0, 1 << 20, NULL},
        {"temperature", NULL, OPTION_FLOAT, "0", "sampling temperature; 0 is greedy", &temperature, 0, 100, NULL},
        {"top-k", NULL, OPTION_INT, "0", "keep the k most likely tokens (0: all)", &top_k, 0, 1 << 30, NULL},
        {"top-p", NULL, OPTION_FLOAT, "1", "keep the smallest set of tokens with this much probability", &top_p, 0, 1, NULL},
        {"min-p", NULL, OPTION_FLOAT, "0", "drop tokens below this fraction of the most likely one", &min_p, 0, 1, NULL},
        {"seed", NULL, OPTION_SIZE, "0", "sampling seed (0: the router picks one)", &seed, 0, 0, NULL},
        {"json", NULL, OPTION_BOOL, "false", "print one JSON object on the last line", &json, 0, 0, NULL},
        {"stop-at-eos", NULL, OPTION_BOOL, "true", "stop at an end-of-generation token", &stop_at_eos, 0, 0, NULL},
        {"request-id", NULL, OPTION_STRING, NULL, "the request's id (default: a random UUID); a known id re-attaches", &request_id, 0, 0, NULL},
        {"priority", NULL, OPTION_INT, "0", "higher runs first", &priority, -100, 100, NULL},
        {"model", "LLM_MODEL_ID", OPTION_STRING, NULL, "model id (default: the cluster's default)", &model, 0, 0, NULL},
        {"timeout-ms", NULL, OPTION_INT, "0", "the request ends (DEADLINE) this long after acceptance; 0: never", &timeout_ms, 0, 1 << 30, NULL},
        {"stream", NULL, OPTION_BOOL, "true", "print text as it is generated", &stream, 0, 0, NULL},
        {"stop", NULL, OPTION_STRING, NULL, "stop when the text contains this (not printed); repeat for several, "
         "at most 16", &stop_flag, 0, 0, NULL},
        {"logprobs", NULL, OPTION_INT, "-1", "list each token's text and logprob, with the N most likely "
         "alternatives (0: none; -1: no list)", &logprobs, -1, SAMPLING_TOP_LOGPROBS_MAX, NULL},
        {"presence-penalty", NULL, OPTION_FLOAT, "0", "subtract this from the logit of every token already seen",
         &presence_penalty, -2, 2, NULL},
        {"frequency-penalty", NULL, OPTION_FLOAT, "0", "subtract this once per earlier occurrence of a token",
         &frequency_penalty, -2, 2, NULL},
        {"repetition-penalty", NULL, OPTION_FLOAT, "1", "divide positive logits of seen tokens by this, multiply "
         "negative ones (1: off)", &repetition_penalty, 0, 10, NULL},
        {"penalty-last-n", NULL, OPTION_INT, "0", "tokens of history the penalties look at (0: all)",
         &penalty_last_n, 0, 1 << 30, NULL},
        {"json-schema", NULL, OPTION_STRING, NULL, "the output is a JSON text this JSON Schema file accepts "
         "(docs/grammar.md)", &schema_file, 0, 0, NULL},
        {"json-object", NULL, OPTION_BOOL, "false", "the output is a JSON object", &json_object, 0, 0, NULL},
        {"grammar", NULL, OPTION_STRING, NULL, "the output is a sentence of this GBNF grammar file (start "
         "rule root)", &grammar_file, 0, 0, NULL},
        {"spec", NULL, OPTION_CHOICE, "default", "speculative decoding for this request: default (the "
         "router's --spec), off, ngram (prompt lookup), auto (ngram while the pipeline is lightly loaded); "
         "the output is the same, only faster or not", &spec, 0, 0, spec_modes},
        {"spec-tokens", NULL, OPTION_INT, "0", "drafted tokens a step verifies at most (0: the router's "
         "--spec-tokens)", &spec_tokens, 0, 16, NULL},
        {"prediction", NULL, OPTION_STRING, NULL, "predicted output: a file whose text the completion is "
         "expected to repeat (an edit's original); prompt lookup drafts from it (docs/router.md, \"Predicted "
         "outputs\"); the output is the same", &prediction_file, 0, 0, NULL},
        {"prediction-ids", NULL, OPTION_STRING, NULL, "the predicted output as token ids instead: a file of "
         "integers (separated by commas, spaces or brackets, e.g. --json's \"ids\" array)", &prediction_ids_file, 0,
         0, NULL},
        {"n", NULL, OPTION_INT, "1", "choices (completions) to generate, on the prompt's shared KV blocks; "
         "choice i samples with a seed derived from --seed and i (docs/protocol.md, \"Several choices\"); "
         "each is printed whole once all are done", &n_choices, 1, PROTO_N_MAX, NULL},
    };
    int rc = llm_parse_sub(gl, "llm generate", "--prompt TEXT [options]",
                           "Generates a continuation of the prompt on the cluster.", defs,
                           (int)(sizeof defs / sizeof defs[0]), &argc, argv);
    if (rc >= 0) return rc;
    if (argc > 1) {
        fprintf(stderr, "llm generate: unexpected argument \"%s\" (see --help)\n", argv[1]);
        return 2;
    }
    if (!prompt) {
        fprintf(stderr, "llm generate: need --prompt (see --help)\n");
        return 2;
    }
    if (n_stops > PROTO_STOP_STRINGS_MAX) {
        fprintf(stderr, "llm generate: --stop given more than %d times\n", PROTO_STOP_STRINGS_MAX);
        return 2;
    }
    for (size_t i = 0; i < n_stops; i++)
        if (stops[i][0] == 0 || strlen(stops[i]) > PROTO_STOP_STRING_BYTES_MAX) {
            fprintf(stderr, "llm generate: --stop \"%s\": a stop string is 1 to %d bytes\n", stops[i],
                    PROTO_STOP_STRING_BYTES_MAX);
            return 2;
        }
    (void)stop_flag;
    if ((schema_file != NULL) + (grammar_file != NULL) + json_object > 1) {
        fprintf(stderr, "llm generate: --json-schema, --json-object and --grammar exclude each other\n");
        return 2;
    }
    char *constraint = NULL;
    const char *cfile = schema_file ? schema_file : grammar_file;
    if (cfile && !(constraint = llm_read_file(cfile))) return 2;
    char *prediction = NULL;
    if (prediction_file && !(prediction = llm_read_file(prediction_file))) {
        free(constraint);
        return 2;
    }
    int32_t *pred_ids = NULL;
    size_t n_pred_ids = 0;
    if (prediction_ids_file) {
        if (prediction_file) {
            fprintf(stderr, "llm generate: --prediction and --prediction-ids exclude each other\n");
            free(constraint);
            free(prediction);
            return 2;
        }
        char *text = llm_read_file(prediction_ids_file);
        rc = text ? llm_parse_ids(text, prediction_ids_file, &pred_ids, &n_pred_ids) : 2;
        free(text);
        if (rc == 0 && n_pred_ids > PROTO_PREDICTION_TOKENS_MAX) {
            fprintf(stderr, "llm generate: --prediction-ids %s: %zu ids, at most %d\n", prediction_ids_file,
                    n_pred_ids, PROTO_PREDICTION_TOKENS_MAX);
            rc = 2;
        }
        if (rc != 0) {
            free(pred_ids);
            free(constraint);
            return 2;
        }
    }
    if (prediction && strlen(prediction) > PROTO_PREDICTION_BYTES_MAX) {
        fprintf(stderr, "llm generate: --prediction %s: %zu bytes, at most %d\n", prediction_file,
                strlen(prediction), PROTO_PREDICTION_BYTES_MAX);
        free(constraint);
        free(prediction);
        return 2;
    }
    llm_client *c;
    if ((rc = llm_open(gl, &c)) != 0) {
        free(constraint);
        free(prediction);
        free(pred_ids);
        return rc;
    }
    struct llm_generate_params p;
    llm_generate_params_default(&p);
    p.request_id = request_id;
    p.model = model;
    p.prompt = prompt;
    p.max_tokens = (uint32_t)max_tokens;
    p.sampling.temperature = (float)temperature;
    p.sampling.top_k = top_k;
    p.sampling.top_p = (float)top_p;
    p.sampling.min_p = (float)min_p;
    p.sampling.seed = (uint64_t)seed;
    p.sampling.ignore_eos = !stop_at_eos;
    p.sampling.presence_penalty = (float)presence_penalty;
    p.sampling.frequency_penalty = (float)frequency_penalty;
    p.sampling.repetition_penalty = (float)repetition_penalty;
    p.sampling.penalty_last_n = penalty_last_n;
    p.sampling.logprobs = logprobs >= 0;
    p.sampling.top_logprobs = logprobs > 0 ? logprobs : 0;
    p.stop = stops;
    p.n_stop = n_stops;
    p.priority = priority;
    p.timeout_ms = (uint32_t)timeout_ms;
    p.stream = stream;
    p.json_schema = schema_file ? constraint : NULL;
    p.grammar = grammar_file ? constraint : NULL;
    p.json_object = json_object;
    p.spec = spec;
    p.spec_tokens = (uint32_t)spec_tokens;
    p.n = (uint32_t)n_choices;
    p.prediction = prediction;
    p.prediction_tokens = pred_ids;
    p.n_prediction_tokens = n_pred_ids;
    static struct llm_gen_out outs[PROTO_N_MAX];
    struct llm_gen_out out = {0};
    struct llm_generate_result r;
    struct sigaction sa;
    memset(&sa, 0, sizeof sa);
    sa.sa_handler = llm_on_sigint;
    sa.sa_flags = SA_RESETHAND;
    sigaction(SIGINT, &sa, NULL);
    int64_t t_start_us = llm_now_us();
    rc = n_choices > 1 ? llm_client_generate(c, &p, llm_gen_chunk_choices, outs, &r)
                       : llm_client_generate(c, &p, llm_gen_chunk, &out, &r);
    if (n_choices > 1) {
        out = outs[0]; /* choice 0 is the output the single-choice fields show */
        outs[0] = (struct llm_gen_out){0};
    }
    int exit_code = 0;
    if (rc < 0) {
        fflush(stdout);
        fprintf(stderr, "llm: %s\n", llm_client_errstr(c));
        exit_code = 1;
    } else {
        if (n_choices > 1 && !json) {
            /* Each choice whole, choice 0 first, under a line naming it. */
            for (int i = 0; i < n_choices; i++) {
                const struct llm_gen_out *o = i == 0 ? &out : &outs[i];
                printf("[choice %d: %s, %zu tokens]\n%s\n", i,
                       llm_finish_reason_name(r.choices ? r.choices[i].finish_reason : r.finish_reason), o->n,
                       o->text ? o->text : "");
                if (r.choices && r.choices[i].finish_reason == LLM__GENERATE_DONE__FINISH_REASON__ERROR) {
                    fprintf(stderr, "llm: request %s choice %d failed: %s: %s\n", r.request_id, i,
                            proto_code_name(r.choices[i].error_code), r.choices[i].error_message);
                    exit_code = 1;
                }
            }
        }
        printf("\n");
        /* The router clamps a max_tokens that runs past the model's context
         * rather than refusing it: say so, since the text may end sooner
         * than asked (finish LENGTH). */
        if (r.max_tokens > 0 && max_tokens > 0 && r.max_tokens < (uint32_t)max_tokens)
            fprintf(stderr, "llm: note: request %s: --max-tokens %d was clamped to %u, what the model's "
                    "context leaves after the %zu-token prompt\n", r.request_id, max_tokens, r.max_tokens,
                    r.n_prompt_ids);
        if (out.oom) {
            fprintf(stderr, "llm: request %s: out of memory for the output; cancelled\n", r.request_id);
            exit_code = 1;
        } else if (r.finish_reason == LLM__GENERATE_DONE__FINISH_REASON__ERROR) {
            fprintf(stderr, "llm: request %s failed: %s: %s\n", r.request_id, proto_code_name(r.error_code),
                    r.error_message);
            exit_code = 1;
        } else if (r.finish_reason == LLM__GENERATE_DONE__FINISH_REASON__CANCELLED ||
                   r.finish_reason == LLM__GENERATE_DONE__FINISH_REASON__DEADLINE) {
            fprintf(stderr, "llm: request %s ended: %s%s%s\n", r.request_id, llm_finish_reason_name(r.finish_reason),
                    r.error_message[0] ? ": " : "", r.error_message);
            exit_code = 1;
        }
        LOG(LL_INFO, "request %s: %s, %u prompt + %u completion tokens, seed %llu, %u re-attaches",
            r.request_id, llm_finish_reason_name(r.finish_reason), r.prompt_tokens, r.completion_tokens,
            (unsigned long long)r.seed, r.reattaches);
        if (json) {
            cJSON *j = cJSON_CreateObject();
            cJSON_AddItemToObject(j, "prompt_ids", llm_json_ids(r.prompt_ids, r.n_prompt_ids));
            cJSON_AddItemToObject(j, "ids", llm_json_ids(out.ids, out.n));
            cJSON_AddStringToObject(j, "text", out.text ? out.text : "");
            cJSON_AddStringToObject(j, "request_id", r.request_id);
            cJSON_AddStringToObject(j, "finish_reason", llm_finish_reason_name(r.finish_reason));
            if (r.stop_string[0]) cJSON_AddStringToObject(j, "stop_string", r.stop_string);
            bool predicted = prediction_file || prediction_ids_file;
            if (predicted) {
                /* The prediction's drafts the cluster accepted and
                 * rejected (choice 0's; each choice's below). */
                cJSON_AddNumberToObject(j, "accepted_prediction_tokens", r.accepted_prediction_tokens);
                cJSON_AddNumberToObject(j, "rejected_prediction_tokens", r.rejected_prediction_tokens);
            }
            if (out.first_us > 0) {
                /* Decode alone: from the first chunk to the last, the
                 * tokens after the first chunk (with --stream; without it
                 * one chunk holds them all). */
                cJSON *t = cJSON_AddObjectToObject(j, "timing");
                cJSON_AddNumberToObject(t, "first_token_s", (double)(out.first_us - t_start_us) / 1e6);
                cJSON_AddNumberToObject(t, "decode_s", (double)(out.last_us - out.first_us) / 1e6);
                cJSON_AddNumberToObject(t, "decode_tokens", (double)(out.n - out.n_first));
            }
            if (n_choices > 1) {
                /* Every choice, choice 0 (the fields above) included. */
                cJSON *a = cJSON_AddArrayToObject(j, "choices");
                for (int i = 0; i < n_choices; i++) {
                    const struct llm_gen_out *o = i == 0 ? &out : &outs[i];
                    cJSON *ch = cJSON_CreateObject();
                    cJSON_AddNumberToObject(ch, "index", i);
                    cJSON_AddItemToObject(ch, "ids", llm_json_ids(o->ids, o->n));
                    cJSON_AddStringToObject(ch, "text", o->text ? o->text : "");
                    cJSON_AddStringToObject(ch, "finish_reason", llm_finish_reason_name(
                        r.choices ? r.choices[i].finish_reason : r.finish_reason));
                    if (r.choices && r.choices[i].stop_string[0])
                        cJSON_AddStringToObject(ch, "stop_string", r.choices[i].stop_string);
                    if (predicted && r.choices) {
                        cJSON_AddNumberToObject(ch, "accepted_prediction_tokens",
                                                r.choices[i].accepted_prediction_tokens);
                        cJSON_AddNumberToObject(ch, "rejected_prediction_tokens",
                                                r.choices[i].rejected_prediction_tokens);
                    }
                    cJSON_AddItemToArray(a, ch);
                }
            }
            if (logprobs >= 0) {
                cJSON *a = cJSON_AddArrayToObject(j, "logprobs");
                for (size_t i = 0; i < out.n_lps; i++) {
                    cJSON *t = llm_lp_json(&out.lps[i].chosen);
                    cJSON *tops = cJSON_AddArrayToObject(t, "top");
                    for (size_t k = 0; k < out.lps[i].n_top; k++)
                        cJSON_AddItemToArray(tops, llm_lp_json(&out.lps[i].top[k]));
                    cJSON_AddItemToArray(a, t);
                }
            }
            llm_print_json(j);
            cJSON_Delete(j);
        } else if (logprobs >= 0 && !out.oom) {
            llm_lp_print(&out);
        }
    }
    llm_generate_result_free(&r);
    llm_lp_free(&out);
    free(out.ids);
    free(out.text);
    for (int i = 1; i < n_choices; i++) {
        llm_lp_free(&outs[i]);
        free(outs[i].ids);
        free(outs[i].text);
    }
    llm_client_close(c);
    free(constraint);
    free(prediction);
    free(pred_ids);
    return exit_code;
}
