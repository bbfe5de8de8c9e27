/* llm: the command-line client of a running cluster.  `llm generate` has
 * the options and output of llm-run (text streamed to stdout, --json's
 * object on the last line) but asks the router; `llm status`, `llm health`,
 * `llm models` and `llm cancel` show and steer the cluster; `llm keygen`
 * writes a CURVE key pair.  The router is --router, else $LLM_ROUTER, else
 * tcp://127.0.0.1:5555; the keys are --curve-key-file and --router-key (or
 * LLM_CURVE_KEY_FILE, LLM_ROUTER_KEY; see docs/security.md). */
#include "client.h"
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

struct llm_global {
    const char *router, *log_level, *curve_key_file, *router_key;
    int reply_timeout_ms, retry_ms, idle_timeout_ms, connect_timeout_ms;
    bool insecure;
};

/* The global options, declared once: main parses them before the
 * subcommand, and every subcommand's table takes them again (defaults =
 * the values so far, no environment) so that they work after it too. */
#define LLM_N_GLOBAL 9
static void llm_global_defs(struct llm_global *g, struct option_def *d) {
    const struct option_def defs[LLM_N_GLOBAL] = {
        {"router", "LLM_ROUTER", OPTION_STRING, "tcp://127.0.0.1:5555",
         "router client endpoint(s), comma-separated: tried in order after a failure", &g->router, 0, 0, NULL},
        {"connect-timeout-ms", "LLM_CONNECT_TIMEOUT_MS", OPTION_INT, "2000",
         "say that no router answers after this long, and how to start one", &g->connect_timeout_ms, 1,
         1 << 30, NULL},
        {"reply-timeout-ms", "LLM_REPLY_TIMEOUT_MS", OPTION_INT, "5000",
         "wait this long for a reply before trying the next endpoint", &g->reply_timeout_ms, 1, 1 << 30, NULL},
        {"retry-ms", "LLM_RETRY_MS", OPTION_INT, "30000",
         "give up after this long without progress (no answer, or only 'cannot serve now')", &g->retry_ms, 1,
         1 << 30, NULL},
        {"idle-timeout-ms", "LLM_IDLE_TIMEOUT_MS", OPTION_INT, "30000",
         "re-attach after this long without a message during a generation", &g->idle_timeout_ms, 1, 1 << 30, NULL},
        {"log-level", "LLM_LOG_LEVEL", OPTION_STRING, "warn", "debug, info, warn, error or none", &g->log_level,
         0, 0, NULL},
        {"curve-key-file", "LLM_CURVE_KEY_FILE", OPTION_STRING, NULL,
         "this client's CURVE key pair (NAME.key from llm keygen)", &g->curve_key_file, 0, 0, NULL},
        {"router-key", "LLM_ROUTER_KEY", OPTION_STRING, NULL, "the router's public key file (NAME.pub)",
         &g->router_key, 0, 0, NULL},
        {"insecure", "LLM_INSECURE", OPTION_BOOL, "false", "plain socket, for a router that runs --insecure",
         &g->insecure, 0, 0, NULL},
    };
    memcpy(d, defs, sizeof defs);
}

/* Parses a subcommand's options followed by the global ones.  Returns -1 to
 * go on, else the exit code (0 after --help, 2 for a bad flag). */
static int llm_parse_sub(struct llm_global *g, const char *name, const char *usage, const char *about,
                         const struct option_def *sub, int n_sub, int *argc, char **argv) {
    enum { N_SUB_MAX = 32 };
    struct option_def defs[N_SUB_MAX + LLM_N_GLOBAL];
    static char values[LLM_N_GLOBAL][512];
    /* A subcommand with more options is a bug here, not bad input. */
    assert(n_sub <= N_SUB_MAX);
    memcpy(defs, sub, (size_t)n_sub * sizeof *defs);
    llm_global_defs(g, defs + n_sub);
    for (int i = 0; i < LLM_N_GLOBAL; i++) {
        struct option_def *d = &defs[n_sub + i];
        options_value_str(d, values[i], sizeof values[i]);
        /* An unset string stays unset (its text would be "(none)"). */
        d->def = d->type == OPTION_STRING && !*(const char **)d->target ? NULL : values[i];
        d->env = NULL; /* already applied by main: a flag before the subcommand stays */
    }
    struct options o = {name, usage, about, defs, n_sub + LLM_N_GLOBAL, false};
    char err[512];
    int rc = options_parse(&o, argc, argv, err, sizeof err);
    if (rc == STATUS_CANCELLED) return 0;
    if (rc < 0) {
        fprintf(stderr, "%s: %s\n", name, err);
        return 2;
    }
    int level;
    if (log_level_parse(g->log_level, &level) < 0) {
        fprintf(stderr, "%s: --log-level %s: expected debug, info, warn, error or none\n", name, g->log_level);
        return 2;
    }
    log_set_level(level);
    return -1;
}

/* Splits "tcp://a:1,tcp://b:2" in place into eps (at most max). */
static size_t llm_split_endpoints(char *list, const char **eps, size_t max) {
    size_t n = 0;
    for (char *save = NULL, *t = strtok_r(list, ", ", &save); t && n < max; t = strtok_r(NULL, ", ", &save))
        eps[n++] = t;
    return n;
}

/* Opens a client and checks that a router answers; returns 0, or the exit
 * code (2: a bad --router; 1: no router answers, said how to start one). */
static int llm_open(const struct llm_global *g, llm_client **c) {
    *c = NULL;
    static char list[2048];
    snprintf(list, sizeof list, "%s", g->router);
    const char *eps[16];
    struct llm_client_config cfg;
    llm_client_config_default(&cfg);
    cfg.endpoints = eps;
    cfg.n_endpoints = llm_split_endpoints(list, eps, 16);
    cfg.reply_timeout_ms = g->reply_timeout_ms;
    cfg.retry_ms = g->retry_ms;
    cfg.idle_timeout_ms = g->idle_timeout_ms;
    cfg.curve_key_file = g->curve_key_file;
    cfg.router_key_file = g->router_key;
    cfg.insecure = g->insecure;
    if (g->insecure) LOG(LL_WARN, "llm: --insecure: plain socket to %s, without keys", g->router);
    char err[512];
    int rc = llm_client_open(c, &cfg, err, sizeof err);
    if (rc < 0) {
        fprintf(stderr, "llm: --router %s: %s\n", g->router, err);
        return 2;
    }
    /* Seconds, not retry_ms, to learn that nothing listens: the usual cause
     * is a cluster not started, and the user should hear how to start it. */
    if (llm_client_probe(*c, g->connect_timeout_ms) < 0) {
        fprintf(stderr,
                "llm: %s.\n"
                "  Start a cluster with:  llm-cluster up --model MODEL.gguf   (then: . RUN_DIR/env.sh)\n"
                "  or point --router (or LLM_ROUTER) at a running router's client endpoint.\n",
                llm_client_errstr(*c));
        llm_client_close(*c);
        *c = NULL;
        return 1;
    }
    return 0;
}

static void llm_print_json(cJSON *j) {
    char *s = cJSON_PrintUnformatted(j);
    if (s) {
        printf("%s\n", s);
        cJSON_free(s);
    }
    fflush(stdout);
}

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

static int llm_generate(struct llm_global *gl, int argc, char **argv) {
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
