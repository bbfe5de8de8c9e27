/* llm-gateway's OpenAI response objects: the parts every completion and
 * chunk share, usage, logprobs in chat's and the legacy completion's forms,
 * and the router's refusals as OpenAI errors. */
#include "gateway/gateway-impl.h"

#include "common/unicode.h"

#include <stdbool.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

/* The router's own words: libllmclient's "generate: INVALID_ARGUMENT: TEXT
 * (request ID)" without the call, the code and the request id, which the
 * error object carries in its own fields (type, code, the response id). */
static void router_text(const char *msg, Llm__Error__Code code, char *out, size_t size) {
    const char *t = msg ? msg : "";
    if (code != LLM__ERROR__CODE__OK) {
        char mark[64];
        snprintf(mark, sizeof mark, ": %s: ", proto_code_name(code));
        const char *m = strstr(t, mark);
        if (m) t = m + strlen(mark);
    }
    size_t n = strlen(t);
    /* Only the last, trailing "(request ...)": the text itself may say it. */
    const char *rq = NULL;
    for (const char *p = strstr(t, " (request "); p; p = strstr(p + 1, " (request ")) rq = p;
    if (rq && n > 0 && t[n - 1] == ')' && !strchr(rq + 2, '(')) n = (size_t)(rq - t);
    snprintf(out, size, "%.*s", (int)n, t);
}

/* The router's refusal (llm_client_generate < 0, or a request that ended in
 * ERROR before its first token) as an OpenAI error. */
void gw_error_from_router(struct oai_error *e, enum oai_kind kind, Llm__Error__Code code, const char *reason,
                          const char *msg, uint32_t retry_after_ms) {
    char text[sizeof e->message];
    router_text(msg, code, text, sizeof text);
    const char *prompt = kind == OAI_CHAT ? "messages" : "prompt";
    switch (code) {
    case LLM__ERROR__CODE__INVALID_ARGUMENT:
        /* The router refuses a prompt that fills the model's context with
         * reason context_length_exceeded; one without reasons (before
         * proto/types.proto had them) said so in its message, and also
         * refused a prompt plus max_tokens beyond the context. */
        bool no_reason = !reason || !reason[0];
        if ((!no_reason && strcmp(reason, "context_length_exceeded") == 0) || (no_reason && strstr(text, "context")))
            oai_error_set(e, 400, "invalid_request_error", strstr(text, "max_tokens") ? "max_tokens" : prompt,
                          "context_length_exceeded", "%s", text);
        else
            oai_error_set(e, 400, "invalid_request_error", NULL, "invalid_value", "%s", text);
        break;
    case LLM__ERROR__CODE__NOT_FOUND:
        oai_error_set(e, 404, "invalid_request_error", "model", "model_not_found", "%s", text);
        break;
    case LLM__ERROR__CODE__RESOURCE_EXHAUSTED:
        /* Two refusals share this code: a full queue, with the router's
         * retry_after_ms, and a request that can never fit the KV cache,
         * without (retrying cannot help). */
        if (retry_after_ms == 0) {
            oai_error_set(e, 400, "invalid_request_error", "max_tokens", "context_length_exceeded", "%s", text);
        } else {
            oai_error_set(e, 429, "rate_limit_error", NULL, "rate_limit_exceeded", "%s", text);
            e->retry_after_s = (int)((retry_after_ms + 999) / 1000);
        }
        break;
    case LLM__ERROR__CODE__FAILED_PRECONDITION:
    case LLM__ERROR__CODE__UNAVAILABLE:
    case LLM__ERROR__CODE__ABORTED:
        oai_error_set(e, 503, "server_error", NULL, "service_unavailable", "%s", text);
        e->retry_after_s = retry_after_ms > 0 ? (int)((retry_after_ms + 999) / 1000) : 1;
        break;
    case LLM__ERROR__CODE__OK: /* the client's own failure: no router answered */
        oai_error_set(e, 503, "server_error", NULL, "router_unavailable", "the cluster's router cannot be reached: %s",
                      text);
        e->retry_after_s = 1;
        break;
    default:
        oai_error_set(e, 500, "server_error", NULL, "internal_error", "%s", text);
        break;
    }
}

/* The skeleton every response object shares. */
cJSON *gw_job_object(const struct job *j, bool chunk) {
    cJSON *o = cJSON_CreateObject();
    cJSON_AddStringToObject(o, "id", j->id);
    cJSON_AddStringToObject(o, "object", j->req.kind == OAI_CHAT ? (chunk ? "chat.completion.chunk" : "chat.completion")
                                                                : "text_completion");
    cJSON_AddNumberToObject(o, "created", (double)j->created);
    cJSON_AddStringToObject(o, "model", j->model);
    return o;
}

const char *gw_finish_name(Llm__GenerateDone__FinishReason r) {
    switch (r) {
    case LLM__GENERATE_DONE__FINISH_REASON__LENGTH:
    case LLM__GENERATE_DONE__FINISH_REASON__DEADLINE: return "length";
    default: return "stop";
    }
}

cJSON *gw_usage_json(const struct llm_generate_result *r, bool predicted) {
    /* n > 1: the prompt once, the completions of every choice (OpenAI's) */
    double completion = r->completion_tokens;
    double accepted = r->accepted_prediction_tokens, rejected = r->rejected_prediction_tokens;
    if (r->choices) {
        completion = accepted = rejected = 0;
        for (uint32_t i = 0; i < r->n_choices; i++) {
            completion += r->choices[i].completion_tokens;
            accepted += r->choices[i].accepted_prediction_tokens;
            rejected += r->choices[i].rejected_prediction_tokens;
        }
    }
    cJSON *u = cJSON_CreateObject();
    cJSON_AddNumberToObject(u, "prompt_tokens", r->prompt_tokens);
    cJSON_AddNumberToObject(u, "completion_tokens", completion);
    cJSON_AddNumberToObject(u, "total_tokens", (double)r->prompt_tokens + completion);
    if (predicted) {
        /* The prediction's drafts the router verified: accepted ones are
         * in the completion, rejected ones were computed and dropped
         * (docs/gateway.md). */
        cJSON *d = cJSON_AddObjectToObject(u, "completion_tokens_details");
        cJSON_AddNumberToObject(d, "accepted_prediction_tokens", accepted);
        cJSON_AddNumberToObject(d, "rejected_prediction_tokens", rejected);
    }
    return u;
}

/* ---- logprobs --------------------------------------------------------------
 * A token's text is its bytes (TokenLogprob.text): whole UTF-8 for most, part
 * of a character for some.  JSON strings must be whole UTF-8, so such a
 * token's string is "bytes:\xNN..." (OpenAI's form) while "bytes" (chat)
 * always has the real bytes. */

static cJSON *token_string(const char *text, size_t len) {
    char stack[256], *b = len * 4 + 8 <= sizeof stack ? stack : malloc(len * 4 + 8);
    if (!b) return cJSON_CreateString("");
    if (unicode_utf8_valid_prefix(text, len) == len) {
        memcpy(b, text, len);
        b[len] = 0;
    } else {
        size_t n = (size_t)sprintf(b, "bytes:");
        for (size_t i = 0; i < len; i++) n += (size_t)sprintf(b + n, "\\x%02x", (unsigned char)text[i]);
    }
    cJSON *s = cJSON_CreateString(b);
    if (b != stack) free(b);
    return s;
}

static cJSON *token_bytes(const char *text, size_t len) {
    cJSON *a = cJSON_CreateArray();
    for (size_t i = 0; i < len; i++) cJSON_AddItemToArray(a, cJSON_CreateNumber((unsigned char)text[i]));
    return a;
}

/* An empty logprobs object of the request's kind: chat's {"content": []},
 * the legacy completion's four parallel arrays. */
cJSON *gw_lp_object(const struct job *j) {
    cJSON *o = cJSON_CreateObject();
    if (j->req.kind == OAI_CHAT) {
        cJSON_AddArrayToObject(o, "content");
    } else {
        cJSON_AddArrayToObject(o, "tokens");
        cJSON_AddArrayToObject(o, "token_logprobs");
        cJSON_AddArrayToObject(o, "top_logprobs");
        cJSON_AddArrayToObject(o, "text_offset");
    }
    return o;
}

/* Appends a chunk's tokens to a logprobs object; *chars counts the
 * characters of the text so far (the legacy text_offset). */
void gw_lp_append(const struct job *j, cJSON *o, const struct llm_chunk *ch, size_t *chars) {
    for (size_t i = 0; i < ch->n_logprobs; i++) {
        const struct llm_token_logprob *l = &ch->logprobs[i];
        if (j->req.kind == OAI_CHAT) {
            cJSON *t = cJSON_CreateObject();
            cJSON_AddItemToObject(t, "token", token_string(l->text, l->text_len));
            cJSON_AddNumberToObject(t, "logprob", l->logprob);
            cJSON_AddItemToObject(t, "bytes", token_bytes(l->text, l->text_len));
            cJSON *tops = cJSON_AddArrayToObject(t, "top_logprobs");
            for (size_t k = 0; k < l->n_top; k++) {
                cJSON *a = cJSON_CreateObject();
                cJSON_AddItemToObject(a, "token", token_string(l->top[k].text, l->top[k].text_len));
                cJSON_AddNumberToObject(a, "logprob", l->top[k].logprob);
                cJSON_AddItemToObject(a, "bytes", token_bytes(l->top[k].text, l->top[k].text_len));
                cJSON_AddItemToArray(tops, a);
            }
            cJSON_AddItemToArray(cJSON_GetObjectItemCaseSensitive(o, "content"), t);
        } else {
            cJSON_AddItemToArray(cJSON_GetObjectItemCaseSensitive(o, "tokens"), token_string(l->text, l->text_len));
            cJSON_AddItemToArray(cJSON_GetObjectItemCaseSensitive(o, "token_logprobs"), cJSON_CreateNumber(l->logprob));
            cJSON *d = cJSON_CreateObject();
            for (size_t k = 0; k < l->n_top; k++) {
                cJSON *key = token_string(l->top[k].text, l->top[k].text_len);
                /* Two alternatives with one text (a token and its byte
                 * form) keep the likelier, which comes first. */
                if (!cJSON_GetObjectItemCaseSensitive(d, key->valuestring))
                    cJSON_AddNumberToObject(d, key->valuestring, l->top[k].logprob);
                cJSON_Delete(key);
            }
            cJSON_AddItemToArray(cJSON_GetObjectItemCaseSensitive(o, "top_logprobs"), d);
            cJSON_AddItemToArray(cJSON_GetObjectItemCaseSensitive(o, "text_offset"), cJSON_CreateNumber((double)*chars));
        }
        /* Characters, counted as their first bytes. */
        for (size_t b = 0; b < l->text_len; b++)
            if (((unsigned char)l->text[b] & 0xc0) != 0x80) (*chars)++;
    }
}

/* Choice index of a streamed chunk: text (NULL: none) and finish (NULL: null). */
cJSON *gw_stream_choice(const struct job *j, uint32_t index, const char *text, size_t len, const char *finish, bool role,
                        cJSON *lp) {
    cJSON *c = cJSON_CreateObject();
    cJSON_AddNumberToObject(c, "index", index);
    char *t = NULL;
    if (text) {
        t = malloc(len + 1);
        if (t) {
            memcpy(t, text, len);
            t[len] = 0;
        }
    }
    if (j->req.kind == OAI_CHAT) {
        cJSON *d = cJSON_AddObjectToObject(c, "delta");
        if (role) cJSON_AddStringToObject(d, "role", "assistant");
        if (t || role) cJSON_AddStringToObject(d, "content", t ? t : "");
    } else {
        cJSON_AddStringToObject(c, "text", t ? t : "");
    }
    free(t);
    if (lp) cJSON_AddItemToObject(c, "logprobs", lp);
    else cJSON_AddNullToObject(c, "logprobs");
    if (finish) cJSON_AddStringToObject(c, "finish_reason", finish);
    else cJSON_AddNullToObject(c, "finish_reason");
    return c;
}
