/* OpenAI request bodies into the cluster's terms, and OpenAI error objects.
 * Every field of the body is looked up in the kind's table first, so that
 * an unknown or misspelt field is an error naming it instead of a setting
 * silently dropped. */
#include "gateway/oai.h"

#include <math.h>
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "common/status.h"
#include "common/unicode.h"

void oai_error_set(struct oai_error *e, int status, const char *type, const char *param, const char *code,
                   const char *fmt, ...) {
    e->status = status;
    e->type = type;
    snprintf(e->param, sizeof e->param, "%s", param ? param : "");
    snprintf(e->code, sizeof e->code, "%s", code ? code : "");
    e->retry_after_s = 0;
    va_list ap;
    va_start(ap, fmt);
    vsnprintf(e->message, sizeof e->message, fmt, ap);
    va_end(ap);
    unicode_utf8_mend(e->param);
    unicode_utf8_mend(e->message);
}

char *oai_error_json(const struct oai_error *e) {
    cJSON *root = cJSON_CreateObject();
    cJSON *o = cJSON_AddObjectToObject(root, "error");
    cJSON_AddStringToObject(o, "message", e->message);
    cJSON_AddStringToObject(o, "type", e->type ? e->type : "invalid_request_error");
    if (e->param[0]) cJSON_AddStringToObject(o, "param", e->param);
    else cJSON_AddNullToObject(o, "param");
    if (e->code[0]) cJSON_AddStringToObject(o, "code", e->code);
    else cJSON_AddNullToObject(o, "code");
    char *s = cJSON_PrintUnformatted(root);
    cJSON_Delete(root);
    return s;
}

/* A 400 with OpenAI's code: BAD's "invalid_value" unless a sharper one
 * fits (invalid_type, integer_below_min_value, missing_required_parameter,
 * unsupported_parameter, ...); NULL (null) only where OpenAI sends none, a
 * body that is not a JSON object. */
#define BAD_CODE(e, param, code, ...) \
    (oai_error_set((e), 400, "invalid_request_error", (param), (code), __VA_ARGS__), -1)
#define BAD(e, param, ...) BAD_CODE(e, param, "invalid_value", __VA_ARGS__)
#define BAD_TYPE(e, param, ...) BAD_CODE(e, param, "invalid_type", __VA_ARGS__)

enum field {
    F_MODEL, F_PROMPT, F_MESSAGES, F_MAX_TOKENS, F_MAX_COMPLETION_TOKENS, F_TEMPERATURE, F_TOP_P, F_N,
    F_STREAM, F_STREAM_OPTIONS, F_STOP, F_PRESENCE, F_FREQUENCY, F_SEED, F_USER, F_LOGPROBS,
    F_TOP_LOGPROBS, F_LOGIT_BIAS, F_ECHO, F_BEST_OF, F_SUFFIX, F_TOP_K, F_MIN_P, F_REPETITION,
    F_IGNORE_EOS, F_TOOLS, F_TOOL_CHOICE, F_PARALLEL_TOOL_CALLS, F_RESPONSE_FORMAT, F_FUNCTIONS,
    F_FUNCTION_CALL, F_SPECULATION, F_SPEC_TOKENS, F_PREDICTION,
};

struct field_def {
    const char *name;
    enum field f;
    unsigned kinds; /* bit 1 << OAI_COMPLETIONS, 1 << OAI_CHAT */
};

#define K_CMPL (1u << OAI_COMPLETIONS)
#define K_CHAT (1u << OAI_CHAT)
#define K_BOTH (K_CMPL | K_CHAT)

static const struct field_def fields[] = {
    {"model", F_MODEL, K_BOTH},
    {"prompt", F_PROMPT, K_CMPL},
    {"messages", F_MESSAGES, K_CHAT},
    {"max_tokens", F_MAX_TOKENS, K_BOTH},
    {"max_completion_tokens", F_MAX_COMPLETION_TOKENS, K_CHAT},
    {"temperature", F_TEMPERATURE, K_BOTH},
    {"top_p", F_TOP_P, K_BOTH},
    {"n", F_N, K_BOTH},
    {"stream", F_STREAM, K_BOTH},
    {"stream_options", F_STREAM_OPTIONS, K_BOTH},
    {"stop", F_STOP, K_BOTH},
    {"presence_penalty", F_PRESENCE, K_BOTH},
    {"frequency_penalty", F_FREQUENCY, K_BOTH},
    {"seed", F_SEED, K_BOTH},
    {"user", F_USER, K_BOTH},
    {"logprobs", F_LOGPROBS, K_BOTH},
    {"top_logprobs", F_TOP_LOGPROBS, K_CHAT},
    {"logit_bias", F_LOGIT_BIAS, K_BOTH},
    {"echo", F_ECHO, K_CMPL},
    {"best_of", F_BEST_OF, K_CMPL},
    {"suffix", F_SUFFIX, K_CMPL},
    {"top_k", F_TOP_K, K_BOTH},
    {"min_p", F_MIN_P, K_BOTH},
    {"repetition_penalty", F_REPETITION, K_BOTH},
    {"ignore_eos", F_IGNORE_EOS, K_BOTH},
    {"tools", F_TOOLS, K_CHAT},
    {"tool_choice", F_TOOL_CHOICE, K_CHAT},
    {"parallel_tool_calls", F_PARALLEL_TOOL_CALLS, K_CHAT},
    {"response_format", F_RESPONSE_FORMAT, K_CHAT},
    {"functions", F_FUNCTIONS, K_CHAT},
    {"function_call", F_FUNCTION_CALL, K_CHAT},
    {"speculation", F_SPECULATION, K_BOTH},
    {"num_speculative_tokens", F_SPEC_TOKENS, K_BOTH},
    {"prediction", F_PREDICTION, K_BOTH},
};

static const char *json_type(const cJSON *v) {
    if (cJSON_IsNull(v)) return "null";
    if (cJSON_IsBool(v)) return "a boolean";
    if (cJSON_IsNumber(v)) return "a number";
    if (cJSON_IsString(v)) return "a string";
    if (cJSON_IsArray(v)) return "an array";
    if (cJSON_IsObject(v)) return "an object";
    return "invalid";
}

/* A number in [lo, hi] (finite). */
static int get_number(const cJSON *v, const char *name, double lo, double hi, double *out, struct oai_error *e) {
    if (!cJSON_IsNumber(v)) return BAD_TYPE(e, name, "%s must be a number, got %s", name, json_type(v));
    double d = v->valuedouble;
    if (!isfinite(d) || d < lo || d > hi)
        return BAD_CODE(e, name, d < lo ? "decimal_below_min_value" : "decimal_above_max_value",
                        "%s = %g is outside [%g, %g]", name, d, lo, hi);
    *out = d;
    return 0;
}

/* An integer in [lo, hi]: a JSON number without a fraction. */
static int get_int(const cJSON *v, const char *name, double lo, double hi, int64_t *out, struct oai_error *e) {
    if (!cJSON_IsNumber(v)) return BAD_TYPE(e, name, "%s must be an integer, got %s", name, json_type(v));
    double d = v->valuedouble;
    if (!isfinite(d) || d != floor(d)) return BAD_TYPE(e, name, "%s = %g must be an integer", name, d);
    if (d < lo || d > hi)
        return BAD_CODE(e, name, d < lo ? "integer_below_min_value" : "integer_above_max_value",
                        "%s = %.0f is outside [%.0f, %.0f]", name, d, lo, hi);
    *out = (int64_t)d;
    return 0;
}

static int get_bool(const cJSON *v, const char *name, bool *out, struct oai_error *e) {
    if (!cJSON_IsBool(v)) return BAD_TYPE(e, name, "%s must be a boolean, got %s", name, json_type(v));
    *out = cJSON_IsTrue(v);
    return 0;
}

static int add_stop(struct oai_request *r, const cJSON *v, const char *name, struct oai_error *e) {
    if (!cJSON_IsString(v)) return BAD_TYPE(e, name, "%s must be a string, got %s", name, json_type(v));
    size_t n = strlen(v->valuestring);
    if (n == 0) return BAD(e, name, "%s is empty: a stop string needs 1 to %d bytes", name, OAI_STOP_BYTES_MAX);
    if (n > OAI_STOP_BYTES_MAX)
        return BAD(e, name, "%s is %zu bytes long: at most %d are allowed", name, n, OAI_STOP_BYTES_MAX);
    if (r->n_stop >= OAI_STOP_MAX) return BAD(e, "stop", "stop has more than %d strings", OAI_STOP_MAX);
    r->stop[r->n_stop++] = v->valuestring;
    return 0;
}

/* A content named name (a message's, a prediction's): a string, or an
 * array of {"type": "text", "text"} parts joined in order (malloc'ed). */
static int get_text_parts(const cJSON *c, const char *name, char **out, struct oai_error *e) {
    *out = NULL;
    if (cJSON_IsString(c)) {
        *out = strdup(c->valuestring);
        return *out ? 0 : BAD(e, name, "out of memory");
    }
    if (!cJSON_IsArray(c))
        return BAD_TYPE(e, name, "%s must be a string or an array of text parts, got %s", name, json_type(c));
    size_t total = 0;
    const cJSON *part;
    int k = 0;
    cJSON_ArrayForEach(part, c) {
        const cJSON *type = cJSON_GetObjectItemCaseSensitive(part, "type");
        const cJSON *text = cJSON_GetObjectItemCaseSensitive(part, "text");
        if (!cJSON_IsObject(part) || !cJSON_IsString(type))
            return BAD_TYPE(e, name, "%s[%d] must be an object with a \"type\"", name, k);
        if (strcmp(type->valuestring, "text") != 0)
            return BAD(e, name, "%s[%d].type = \"%.64s\": only text parts are supported", name, k,
                       type->valuestring);
        if (!cJSON_IsString(text)) return BAD_TYPE(e, name, "%s[%d].text must be a string", name, k);
        total += strlen(text->valuestring);
        k++;
    }
    *out = malloc(total + 1);
    if (!*out) return BAD(e, name, "out of memory");
    size_t off = 0;
    cJSON_ArrayForEach(part, c) {
        const char *t = cJSON_GetObjectItemCaseSensitive(part, "text")->valuestring;
        size_t n = strlen(t);
        memcpy(*out + off, t, n);
        off += n;
    }
    (*out)[off] = 0;
    return 0;
}

static int get_content(const cJSON *c, size_t i, char **out, struct oai_error *e) {
    char name[64];
    snprintf(name, sizeof name, "messages[%zu].content", i);
    return get_text_parts(c, name, out, e);
}

/* OpenAI's predicted outputs: {"type": "content", "content": text or text
 * parts}, the text kept in r->prediction. */
static int get_prediction(struct oai_request *r, const cJSON *v, struct oai_error *e) {
    if (!cJSON_IsObject(v))
        return BAD_TYPE(e, "prediction", "prediction must be an object, got %s", json_type(v));
    const cJSON *type = cJSON_GetObjectItemCaseSensitive(v, "type");
    if (!cJSON_IsString(type))
        return BAD_TYPE(e, "prediction.type", "prediction.type must be the string \"content\", got %s",
                        json_type(type));
    if (strcmp(type->valuestring, "content") != 0)
        return BAD_CODE(e, "prediction.type", "unsupported_value",
                        "prediction.type = \"%.64s\" is not supported: only \"content\"", type->valuestring);
    const cJSON *c = cJSON_GetObjectItemCaseSensitive(v, "content");
    if (!c) return BAD_CODE(e, "prediction.content", "missing_required_parameter", "prediction.content is missing");
    free(r->prediction);
    if (get_text_parts(c, "prediction.content", &r->prediction, e) < 0) return -1;
    size_t n = strlen(r->prediction);
    if (n > OAI_PREDICTION_BYTES_MAX)
        return BAD(e, "prediction.content", "prediction.content is %zu bytes long: at most %d are allowed", n,
                   OAI_PREDICTION_BYTES_MAX);
    return 0;
}

static int get_messages(struct oai_request *r, const cJSON *v, struct oai_error *e) {
    if (!cJSON_IsArray(v)) return BAD_TYPE(e, "messages", "messages must be an array, got %s", json_type(v));
    int n = cJSON_GetArraySize(v);
    if (n == 0) return BAD(e, "messages", "messages is empty: at least one message is needed");
    r->messages = calloc((size_t)n, sizeof *r->messages);
    r->contents = calloc((size_t)n, sizeof *r->contents);
    if (!r->messages || !r->contents) return BAD(e, "messages", "out of memory");
    r->n_messages = (size_t)n;
    size_t i = 0;
    const cJSON *m;
    cJSON_ArrayForEach(m, v) {
        char name[64];
        snprintf(name, sizeof name, "messages[%zu]", i);
        if (!cJSON_IsObject(m)) return BAD_TYPE(e, name, "%s must be an object, got %s", name, json_type(m));
        const cJSON *f;
        const cJSON *role = NULL, *content = NULL;
        cJSON_ArrayForEach(f, m) {
            if (strcmp(f->string, "role") == 0) role = f;
            else if (strcmp(f->string, "content") == 0) content = f;
            else if (strcmp(f->string, "name") == 0) {
                if (!cJSON_IsString(f)) return BAD_TYPE(e, name, "%s.name must be a string", name);
            } else
                return BAD(e, name, "%s.%.64s is not supported (a message has role, content and name)", name,
                           f->string);
        }
        if (!cJSON_IsString(role)) return BAD_TYPE(e, name, "%s.role must be a string", name);
        if (!content) return BAD(e, name, "%s.content is missing", name);
        if (get_content(content, i, &r->contents[i], e) < 0) return -1;
        r->messages[i].role = role->valuestring;
        r->messages[i].content = r->contents[i];
        i++;
    }
    return 0;
}

static int get_prompt(struct oai_request *r, const cJSON *v, struct oai_error *e) {
    if (cJSON_IsString(v)) {
        r->prompt = v->valuestring;
        return 0;
    }
    if (!cJSON_IsArray(v)) return BAD_TYPE(e, "prompt", "prompt must be a string or an array, got %s", json_type(v));
    int n = cJSON_GetArraySize(v);
    if (n == 0) return BAD(e, "prompt", "prompt is an empty array");
    const cJSON *first = cJSON_GetArrayItem(v, 0);
    if (cJSON_IsString(first) || cJSON_IsArray(first)) {
        if (n > 1)
            return BAD(e, "prompt", "prompt has %d prompts: this server runs one prompt per request", n);
        return get_prompt(r, first, e);
    }
    r->prompt_tokens = malloc((size_t)n * sizeof *r->prompt_tokens);
    if (!r->prompt_tokens) return BAD(e, "prompt", "out of memory");
    const cJSON *t;
    cJSON_ArrayForEach(t, v) {
        char name[48];
        snprintf(name, sizeof name, "prompt[%zu]", r->n_prompt_tokens);
        int64_t id;
        if (get_int(t, name, 0, INT32_MAX, &id, e) < 0) return -1;
        r->prompt_tokens[r->n_prompt_tokens++] = (int32_t)id;
    }
    return 0;
}

static int apply_field(struct oai_request *r, enum field f, const cJSON *v, struct oai_error *e) {
    const char *name = v->string;
    double d;
    int64_t i;
    bool b;
    switch (f) {
    case F_MODEL:
        if (!cJSON_IsString(v)) return BAD_TYPE(e, name, "model must be a string, got %s", json_type(v));
        r->model = v->valuestring;
        return 0;
    case F_PROMPT: return get_prompt(r, v, e);
    case F_MESSAGES: return get_messages(r, v, e);
    case F_MAX_TOKENS:
    case F_MAX_COMPLETION_TOKENS:
        if (get_int(v, name, 1, UINT32_MAX, &i, e) < 0) return -1;
        r->max_tokens = (uint32_t)i;
        return 0;
    case F_TEMPERATURE:
        if (get_number(v, name, 0, 2, &d, e) < 0) return -1;
        r->sp.temperature = (float)d;
        return 0;
    case F_TOP_P:
        if (get_number(v, name, 0, 1, &d, e) < 0) return -1;
        r->sp.top_p = (float)d;
        return 0;
    case F_N:
        if (get_int(v, name, 1, OAI_N_MAX, &i, e) < 0) return -1;
        r->n = (uint32_t)i;
        return 0;
    case F_BEST_OF:
        if (get_int(v, name, 1, 1e9, &i, e) < 0) return -1;
        if (i != 1)
            return BAD_CODE(e, name, "unsupported_value",
                            "%s = %lld: this server does not rank completions (best_of must be 1; n asks "
                            "for several choices)", name, (long long)i);
        return 0;
    case F_STREAM: return get_bool(v, name, &r->stream, e);
    case F_STREAM_OPTIONS: {
        if (!cJSON_IsObject(v)) return BAD_TYPE(e, name, "stream_options must be an object, got %s", json_type(v));
        const cJSON *o;
        cJSON_ArrayForEach(o, v) {
            if (strcmp(o->string, "include_usage") != 0)
                return BAD(e, "stream_options", "stream_options.%.64s is not supported (only include_usage)",
                           o->string);
            if (get_bool(o, "stream_options.include_usage", &r->include_usage, e) < 0) return -1;
        }
        return 0;
    }
    case F_STOP:
        if (cJSON_IsString(v)) return add_stop(r, v, "stop", e);
        if (!cJSON_IsArray(v))
            return BAD_TYPE(e, name, "stop must be a string or an array of strings, got %s", json_type(v));
        {
            const cJSON *s;
            int k = 0;
            cJSON_ArrayForEach(s, v) {
                char sn[32];
                snprintf(sn, sizeof sn, "stop[%d]", k++);
                if (add_stop(r, s, sn, e) < 0) return -1;
            }
        }
        return 0;
    case F_PRESENCE:
        if (get_number(v, name, -2, 2, &d, e) < 0) return -1;
        r->sp.presence_penalty = (float)d;
        return 0;
    case F_FREQUENCY:
        if (get_number(v, name, -2, 2, &d, e) < 0) return -1;
        r->sp.frequency_penalty = (float)d;
        return 0;
    case F_SEED:
        /* 0 asks the router to pick a seed; any other value is the seed. */
        if (get_int(v, name, 0, 9007199254740991.0, &i, e) < 0) return -1;
        r->sp.seed = (uint64_t)i;
        return 0;
    case F_USER:
        if (!cJSON_IsString(v)) return BAD_TYPE(e, name, "user must be a string, got %s", json_type(v));
        r->user = v->valuestring;
        return 0;
    case F_LOGPROBS:
        if (r->kind == OAI_CHAT) {
            if (get_bool(v, name, &b, e) < 0) return -1;
            r->sp.logprobs = b;
        } else {
            if (get_int(v, name, 0, 5, &i, e) < 0) return -1;
            r->sp.logprobs = 1;
            r->sp.top_logprobs = (int32_t)i;
        }
        return 0;
    case F_TOP_LOGPROBS:
        if (get_int(v, name, 0, SAMPLING_TOP_LOGPROBS_MAX, &i, e) < 0) return -1;
        r->sp.top_logprobs = (int32_t)i;
        return 0;
    case F_LOGIT_BIAS:
        if (!cJSON_IsObject(v)) return BAD_TYPE(e, name, "logit_bias must be an object, got %s", json_type(v));
        if (cJSON_GetArraySize(v) > 0)
            return BAD_CODE(e, name, "unsupported_value", "logit_bias is not supported by this server");
        return 0;
    case F_ECHO:
        if (get_bool(v, name, &b, e) < 0) return -1;
        if (b) return BAD_CODE(e, name, "unsupported_value", "echo = true is not supported by this server");
        return 0;
    case F_SUFFIX:
        return BAD_CODE(e, name, "unsupported_parameter", "suffix is not supported by this server");
    case F_TOP_K:
        /* -1 is how vLLM and llama.cpp clients say "off". */
        if (get_int(v, name, -1, INT32_MAX, &i, e) < 0) return -1;
        r->sp.top_k = i < 0 ? 0 : (int32_t)i;
        return 0;
    case F_MIN_P:
        if (get_number(v, name, 0, 1, &d, e) < 0) return -1;
        r->sp.min_p = (float)d;
        return 0;
    case F_REPETITION:
        if (get_number(v, name, 0, 1e6, &d, e) < 0) return -1;
        if (d == 0) return BAD(e, name, "repetition_penalty = 0: it must be > 0 (1 = off)");
        r->sp.repetition_penalty = (float)d;
        return 0;
    case F_IGNORE_EOS:
        if (get_bool(v, name, &b, e) < 0) return -1;
        r->sp.ignore_eos = b;
        return 0;
    case F_SPECULATION: {
        /* GenerateRequest.Spec's values by name. */
        static const char *const modes[] = {"default", "off", "ngram", "draft", "auto"};
        if (!cJSON_IsString(v)) return BAD_TYPE(e, name, "speculation must be a string, got %s", json_type(v));
        for (int k = 0; k < 5; k++)
            if (modes[k] && strcmp(v->valuestring, modes[k]) == 0) {
                r->spec = k;
                return 0;
            }
        return BAD_CODE(e, name, "unsupported_value",
                        "speculation = \"%.32s\": one of \"default\", \"off\", \"ngram\", \"draft\", \"auto\"",
                        v->valuestring);
    }
    case F_SPEC_TOKENS:
        if (get_int(v, name, 0, 16, &i, e) < 0) return -1;
        r->spec_tokens = (uint32_t)i;
        return 0;
    case F_PREDICTION: return get_prediction(r, v, e);
    case F_TOOLS:
    case F_FUNCTIONS:
        if (cJSON_IsArray(v) && cJSON_GetArraySize(v) == 0) return 0;
        return BAD_CODE(e, name, "unsupported_parameter",
                        "%s: tool and function calling is not supported by this server", name);
    case F_TOOL_CHOICE:
    case F_FUNCTION_CALL:
        if (cJSON_IsString(v) && strcmp(v->valuestring, "none") == 0) return 0;
        return BAD_CODE(e, name, "unsupported_parameter",
                        "%s: tool and function calling is not supported by this server", name);
    case F_PARALLEL_TOOL_CALLS: return get_bool(v, name, &b, e);
    case F_RESPONSE_FORMAT: {
        /* OpenAI's three types.  The schema is enforced whether strict is
         * true or not (docs/gateway.md). */
        if (!cJSON_IsObject(v)) return BAD_TYPE(e, name, "response_format must be an object, got %s", json_type(v));
        const cJSON *t = cJSON_GetObjectItemCaseSensitive(v, "type");
        if (!cJSON_IsString(t))
            return BAD_CODE(e, "response_format.type", "missing_required_parameter",
                            "response_format.type is required: \"text\", \"json_object\" or \"json_schema\"");
        if (strcmp(t->valuestring, "text") == 0) return 0;
        if (strcmp(t->valuestring, "json_object") == 0) {
            r->json_object = true;
            return 0;
        }
        if (strcmp(t->valuestring, "json_schema") != 0)
            return BAD(e, "response_format.type", "response_format.type = \"%.64s\": expected \"text\", "
                       "\"json_object\" or \"json_schema\"", t->valuestring);
        const cJSON *js = cJSON_GetObjectItemCaseSensitive(v, "json_schema");
        if (!cJSON_IsObject(js))
            return BAD_CODE(e, "response_format.json_schema", "missing_required_parameter",
                            "response_format.json_schema is required (an object with name and schema)");
        const cJSON *nm = cJSON_GetObjectItemCaseSensitive(js, "name");
        if (!cJSON_IsString(nm))
            return BAD_CODE(e, "response_format.json_schema.name", "missing_required_parameter",
                            "response_format.json_schema.name is required (a string)");
        const cJSON *st = cJSON_GetObjectItemCaseSensitive(js, "strict");
        if (st && !cJSON_IsNull(st) && !cJSON_IsBool(st))
            return BAD_TYPE(e, "response_format.json_schema.strict", "response_format.json_schema.strict must be "
                            "a boolean, got %s", json_type(st));
        const cJSON *sc = cJSON_GetObjectItemCaseSensitive(js, "schema");
        /* OpenAI: no schema is the empty schema (any JSON value). */
        if (sc && !cJSON_IsNull(sc) && !cJSON_IsObject(sc))
            return BAD_TYPE(e, "response_format.json_schema.schema", "response_format.json_schema.schema must be "
                            "an object, got %s", json_type(sc));
        free(r->json_schema);
        r->json_schema = sc && cJSON_IsObject(sc) ? cJSON_PrintUnformatted(sc) : strdup("{}");
        if (!r->json_schema) return BAD(e, name, "response_format: out of memory");
        return 0;
    }
    }
    return BAD(e, name, "%s: not handled", name);
}

/* The first string of v that is not valid UTF-8, as a path into the body
 * ("messages[2].content[0].text"), with *key set when it is a key of that
 * path rather than its value; false when all are valid.  JSON text must be
 * UTF-8 (RFC 8259), and every string reaches a tokenizer, the router or a
 * response that has to be valid JSON again. */
static bool bad_utf8(const cJSON *v, char *path, size_t size, size_t *at, bool *key) {
    if (cJSON_IsString(v)) {
        size_t sl = strlen(v->valuestring);
        *at = unicode_utf8_valid_prefix(v->valuestring, sl);
        return *at != sl;
    }
    if (!cJSON_IsArray(v) && !cJSON_IsObject(v)) return false;
    size_t n = strlen(path);
    int i = 0;
    const cJSON *c;
    cJSON_ArrayForEach(c, v) {
        if (cJSON_IsArray(v)) {
            snprintf(path + n, size - n, "[%d]", i++);
        } else {
            size_t kl = strlen(c->string);
            *at = unicode_utf8_valid_prefix(c->string, kl);
            if (*at != kl) {
                *key = true;
                return true;
            }
            snprintf(path + n, size - n, "%s%.64s", n ? "." : "", c->string);
        }
        if (bad_utf8(c, path, size, at, key)) return true;
        path[n] = 0;
    }
    return false;
}

int oai_parse(enum oai_kind kind, const char *body, size_t len, struct oai_request *r, struct oai_error *e) {
    memset(r, 0, sizeof *r);
    r->kind = kind;
    r->n = 1;
    r->model = "";
    sampling_params_default(&r->sp);
    /* OpenAI's default for the legacy completions endpoint. */
    if (kind == OAI_COMPLETIONS) r->max_tokens = 16;
    const char *end = NULL;
    r->root = cJSON_ParseWithLengthOpts(body, len, &end, 0);
    if (!r->root) {
        size_t at = end && end >= body ? (size_t)(end - body) : 0;
        (void)BAD_CODE(e, NULL, NULL, "the request body is not valid JSON (error near byte %zu of %zu)", at, len);
        oai_request_free(r);
        return -1;
    }
    /* One value and nothing after it but blanks: a second object would be
     * a request silently dropped. */
    size_t tail = end && end >= body && (size_t)(end - body) <= len ? (size_t)(end - body) : len;
    while (tail < len && (body[tail] == ' ' || body[tail] == '\t' || body[tail] == '\r' || body[tail] == '\n')) tail++;
    if (tail < len) {
        (void)BAD_CODE(e, NULL, NULL,
                       "the request body has %zu more bytes after its JSON value (from byte %zu of %zu): send "
                  "one JSON object per request", len - tail, tail, len);
        oai_request_free(r);
        return -1;
    }
    if (!cJSON_IsObject(r->root)) {
        (void)BAD_CODE(e, NULL, NULL, "the request body must be a JSON object, got %s", json_type(r->root));
        oai_request_free(r);
        return -1;
    }
    char path[256] = "";
    size_t at = 0;
    bool key = false;
    if (bad_utf8(r->root, path, sizeof path, &at, &key)) {
        if (key && !path[0])
            (void)BAD(e, NULL, "a field name is not valid UTF-8 (byte %zu): JSON text must be UTF-8", at);
        else if (key) (void)BAD(e, path, "a field name in %s is not valid UTF-8 (byte %zu): JSON text must be UTF-8",
                                path, at);
        else (void)BAD(e, path, "%s is not valid UTF-8 (byte %zu is not part of a character): JSON text must be UTF-8",
                       path, at);
        oai_request_free(r);
        return -1;
    }
    const cJSON *v;
    cJSON_ArrayForEach(v, r->root) {
        const struct field_def *fd = NULL;
        for (size_t k = 0; k < sizeof fields / sizeof fields[0]; k++)
            if (strcmp(fields[k].name, v->string) == 0 && (fields[k].kinds & (1u << kind))) fd = &fields[k];
        if (!fd) {
            (void)BAD_CODE(e, v->string, "unknown_parameter", "Unrecognized request argument supplied: %.64s",
                           v->string);
            oai_request_free(r);
            return -1;
        }
        /* A field given twice is refused: which one counts differs between
         * JSON parsers, and a client's must not disagree with ours.  Every
         * field before v is a known one, so this scan stays short. */
        for (const cJSON *p = r->root->child; p != v; p = p->next)
            if (strcmp(p->string, v->string) == 0) {
                (void)BAD(e, v->string, "%s appears twice in the request body: give each field once", v->string);
                oai_request_free(r);
                return -1;
            }
        /* null means "the default" for every optional field. */
        if (cJSON_IsNull(v)) continue;
        if (apply_field(r, fd->f, v, e) < 0) {
            oai_request_free(r);
            return -1;
        }
    }
    const char *need = kind == OAI_CHAT ? "messages" : "prompt";
    if ((kind == OAI_CHAT && !r->messages) || (kind == OAI_COMPLETIONS && !r->prompt && !r->prompt_tokens)) {
        (void)BAD_CODE(e, need, "missing_required_parameter", "%s is required", need);
        oai_request_free(r);
        return -1;
    }
    if ((r->json_schema || r->json_object) && r->n_stop > 0) {
        (void)BAD_CODE(e, "stop", "unsupported_parameter",
                       "stop with response_format %s is not supported: a stop could cut the output short of "
                       "the JSON text", r->json_schema ? "json_schema" : "json_object");
        oai_request_free(r);
        return -1;
    }
    if (r->include_usage && !r->stream) {
        (void)BAD(e, "stream_options", "stream_options is only allowed when stream is true");
        oai_request_free(r);
        return -1;
    }
    return 0;
}

void oai_request_free(struct oai_request *r) {
    if (!r) return;
    for (size_t i = 0; r->contents && i < r->n_messages; i++) free(r->contents[i]);
    free(r->contents);
    free(r->messages);
    free(r->prompt_tokens);
    free(r->json_schema);
    free(r->prediction);
    cJSON_Delete(r->root);
    memset(r, 0, sizeof *r);
}
