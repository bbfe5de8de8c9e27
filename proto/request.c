/* Validation of GenerateRequest and conversion of SamplingParams between
 * the wire and common/sampling: one place that decides what the router
 * accepts, so every client gets the same messages. */
#include "proto/request.h"

#include <stdlib.h>
#include <string.h>

#include "common/grammar.h"
#include "common/json_schema.h"
#include "common/status.h"
#include "proto/wire.h"

int proto_sampling_from_msg(const Llm__SamplingParams *m, struct sampling_params *p, char *err,
                            size_t errlen) {
    sampling_params_default(p);
    if (!m) return 0;
    if (m->n_stop_token_ids > SAMPLING_STOP_IDS_MAX) {
        return status_fail(err, errlen, STATUS_BAD_INPUT,
                           "sampling.stop_token_ids has %zu entries, at most %d are allowed",
                           m->n_stop_token_ids, SAMPLING_STOP_IDS_MAX);
    }
    p->temperature = m->temperature;
    p->top_k = m->top_k;
    p->top_p = m->top_p;
    p->min_p = m->min_p;
    p->repetition_penalty = m->repetition_penalty;
    p->presence_penalty = m->presence_penalty;
    p->frequency_penalty = m->frequency_penalty;
    p->penalty_last_n = m->penalty_last_n;
    p->seed = m->seed;
    p->n_stop_token_ids = (int32_t)m->n_stop_token_ids;
    for (size_t i = 0; i < m->n_stop_token_ids; i++) p->stop_token_ids[i] = m->stop_token_ids[i];
    p->ignore_eos = m->ignore_eos != 0;
    p->logprobs = m->logprobs != 0;
    p->top_logprobs = m->top_logprobs;
    return 0;
}

void proto_sampling_to_msg(const struct sampling_params *p, Llm__SamplingParams *m) {
    llm__sampling_params__init(m);
    m->temperature = p->temperature;
    m->top_k = p->top_k;
    m->top_p = p->top_p;
    m->min_p = p->min_p;
    m->repetition_penalty = p->repetition_penalty;
    m->presence_penalty = p->presence_penalty;
    m->frequency_penalty = p->frequency_penalty;
    m->penalty_last_n = p->penalty_last_n;
    m->seed = p->seed;
    int32_t n = p->n_stop_token_ids;
    m->n_stop_token_ids = n > 0 ? (size_t)(n < SAMPLING_STOP_IDS_MAX ? n : SAMPLING_STOP_IDS_MAX) : 0;
    m->stop_token_ids = m->n_stop_token_ids ? (int32_t *)p->stop_token_ids : NULL;
    m->ignore_eos = p->ignore_eos != 0;
    m->logprobs = p->logprobs != 0;
    m->top_logprobs = p->top_logprobs;
}

int proto_generate_validate(const Llm__GenerateRequest *g, int32_t n_vocab, int64_t now_ms,
                            char *err, size_t errlen) {
    int rc = proto_request_id_check(g->request_id, err, errlen);
    if (rc < 0) return rc;
    /* prompt is a proto3 string without presence: an absent prompt and an
     * empty one are the same message ("" after unpacking).  Both mean the
     * empty text, which the router tokenizes to BOS alone, as llama.cpp and
     * OpenAI-style completions generate from the start of a document.
     * prompt_tokens, when given, replaces the text. */
    int has_text = g->prompt && g->prompt[0];
    if (has_text && g->n_prompt_tokens > 0) {
        return status_fail(err, errlen, STATUS_BAD_INPUT,
                           "request %s: prompt (%zu bytes) and prompt_tokens (%zu ids) are "
                           "both set; send one", g->request_id, strlen(g->prompt), g->n_prompt_tokens);
    }
    for (size_t i = 0; i < g->n_prompt_tokens; i++) {
        int32_t t = g->prompt_tokens[i];
        if (t < 0 || (n_vocab > 0 && t >= n_vocab)) {
            return status_fail(err, errlen, STATUS_BAD_INPUT,
                               "request %s: prompt_tokens[%zu] = %d is outside the "
                               "vocabulary [0, %d)", g->request_id, i, t, n_vocab);
        }
    }
    if (g->n_stop > PROTO_STOP_STRINGS_MAX) {
        return status_fail(err, errlen, STATUS_BAD_INPUT,
                           "request %s: stop has %zu strings, at most %d are allowed",
                           g->request_id, g->n_stop, PROTO_STOP_STRINGS_MAX);
    }
    for (size_t i = 0; i < g->n_stop; i++) {
        size_t len = g->stop[i] ? strlen(g->stop[i]) : 0;
        if (len == 0 || len > PROTO_STOP_STRING_BYTES_MAX) {
            return status_fail(err, errlen, STATUS_BAD_INPUT,
                               "request %s: stop[%zu] has %zu bytes, must have 1..%d",
                               g->request_id, i, len, PROTO_STOP_STRING_BYTES_MAX);
        }
    }
    if (g->priority < PROTO_PRIORITY_MIN || g->priority > PROTO_PRIORITY_MAX) {
        return status_fail(err, errlen, STATUS_BAD_INPUT,
                           "request %s: priority = %d is outside [%d, %d]", g->request_id,
                           g->priority, PROTO_PRIORITY_MIN, PROTO_PRIORITY_MAX);
    }
    if (g->deadline_ms < 0) {
        return status_fail(err, errlen, STATUS_BAD_INPUT,
                           "request %s: deadline_ms = %lld must be >= 0 (Unix ms; 0 = none)",
                           g->request_id, (long long)g->deadline_ms);
    }
    if (g->deadline_ms > 0 && g->deadline_ms <= now_ms) {
        return status_fail(err, errlen, STATUS_TIMEOUT,
                           "request %s: deadline_ms = %lld passed %lld ms ago",
                           g->request_id, (long long)g->deadline_ms, (long long)(now_ms - g->deadline_ms));
    }
    struct sampling_params sp;
    char why[300];
    rc = proto_sampling_check(g->sampling, n_vocab, &sp, why, sizeof why);
    if (rc < 0) return status_fail(err, errlen, rc, "request %s: %s", g->request_id, why);
    if (g->n > PROTO_N_MAX) {
        return status_fail(err, errlen, STATUS_BAD_INPUT, "request %s: n = %u is more than %d",
                           g->request_id, g->n, PROTO_N_MAX);
    }
    if (g->n_resume_from_choice > PROTO_N_MAX) {
        return status_fail(err, errlen, STATUS_BAD_INPUT, "request %s: resume_from_choice has %zu entries, "
                           "more than %d", g->request_id, g->n_resume_from_choice, PROTO_N_MAX);
    }
    if ((int)g->spec < LLM__GENERATE_REQUEST__SPEC__SPEC_DEFAULT ||
        (int)g->spec > LLM__GENERATE_REQUEST__SPEC__SPEC_AUTO) {
        return status_fail(err, errlen, STATUS_BAD_INPUT,
                           "request %s: spec = %d is not a speculation mode (0 default, 1 off, 2 ngram, "
                           "3 draft, 4 auto)", g->request_id, (int)g->spec);
    }
    if (g->spec_tokens > PROTO_SPEC_TOKENS_MAX) {
        return status_fail(err, errlen, STATUS_BAD_INPUT,
                           "request %s: spec_tokens = %u is more than %d", g->request_id, g->spec_tokens,
                           PROTO_SPEC_TOKENS_MAX);
    }
    if (g->prediction && g->prediction[0] && g->n_prediction_tokens > 0) {
        return status_fail(err, errlen, STATUS_BAD_INPUT,
                           "request %s: prediction (%zu bytes) and prediction_tokens (%zu ids) are both set; "
                           "send one", g->request_id, strlen(g->prediction), g->n_prediction_tokens);
    }
    if (g->n_prediction_tokens > PROTO_PREDICTION_TOKENS_MAX) {
        return status_fail(err, errlen, STATUS_BAD_INPUT,
                           "request %s: prediction_tokens has %zu ids, at most %d are allowed", g->request_id,
                           g->n_prediction_tokens, PROTO_PREDICTION_TOKENS_MAX);
    }
    for (size_t i = 0; i < g->n_prediction_tokens; i++) {
        int32_t t = g->prediction_tokens[i];
        if (t < 0 || (n_vocab > 0 && t >= n_vocab)) {
            return status_fail(err, errlen, STATUS_BAD_INPUT,
                               "request %s: prediction_tokens[%zu] = %d is outside the vocabulary [0, %d)",
                               g->request_id, i, t, n_vocab);
        }
    }
    if (g->prediction && strlen(g->prediction) > PROTO_PREDICTION_BYTES_MAX) {
        return status_fail(err, errlen, STATUS_BAD_INPUT,
                           "request %s: prediction has %zu bytes, at most %d are allowed", g->request_id,
                           strlen(g->prediction), PROTO_PREDICTION_BYTES_MAX);
    }
    const char *field = NULL;
    rc = proto_constraint_check(g->sampling, &field, why, sizeof why);
    if (rc < 0) return status_fail(err, errlen, rc, "request %s: %s", g->request_id, why);
    if (field && (g->n_stop > 0 || sp.n_stop_token_ids > 0)) {
        /* A stop would end the output wherever it matched, short of the
         * grammar's end, and still report "stop": refused rather than
         * hand back a text the constraint does not accept. */
        return status_fail(err, errlen, STATUS_UNSUPPORTED,
                           "request %s: %s with sampling.%s is not supported: a stop could cut "
                           "the output short of the %s", g->request_id,
                           g->n_stop > 0 ? "stop" : "sampling.stop_token_ids", field,
                           strcmp(field, "grammar") == 0 ? "grammar" : "JSON text");
    }
    return 0;
}

int proto_constraint_check(const Llm__SamplingParams *m, const char **field, char *err,
                           size_t errlen) {
    *field = NULL;
    if (!m) return 0;
    char why[256];
    grammar *gr = NULL;
    int rc = 0;
    switch (m->constraint_case) {
    case LLM__SAMPLING_PARAMS__CONSTRAINT_JSON_SCHEMA: {
        *field = "json_schema";
        char *gbnf = NULL;
        const char *text = m->json_schema ? m->json_schema : "";
        rc = json_schema_to_gbnf(text, strlen(text), &gbnf, why, sizeof why);
        if (rc == 0) rc = grammar_parse(&gr, gbnf, strlen(gbnf), why, sizeof why);
        free(gbnf);
        break;
    }
    case LLM__SAMPLING_PARAMS__CONSTRAINT_JSON_OBJECT:
        if (m->json_object) *field = "json_object";
        break;
    case LLM__SAMPLING_PARAMS__CONSTRAINT_GRAMMAR: {
        *field = "grammar";
        const char *text = m->grammar ? m->grammar : "";
        rc = grammar_parse(&gr, text, strlen(text), why, sizeof why);
        break;
    }
    default:
        break;
    }
    grammar_free(gr);
    if (rc < 0) {
        /* an unsupported schema keyword is a bad request like any other */
        return status_fail(err, errlen, rc == STATUS_NO_MEMORY ? rc : STATUS_BAD_INPUT,
                           "sampling.%s: %s", *field, why);
    }
    return 0;
}

int proto_sampling_check(const Llm__SamplingParams *m, int32_t n_vocab, struct sampling_params *p,
                         char *err, size_t errlen) {
    char why[160];
    int rc = proto_sampling_from_msg(m, p, why, sizeof why);
    if (rc == 0) rc = sampling_params_validate(p, n_vocab, why, sizeof why);
    if (rc < 0) {
        /* proto_sampling_from_msg already names "sampling."; the validator
         * names the bare field. */
        return status_fail(err, errlen, rc, "%s%s",
                           strncmp(why, "sampling.", 9) == 0 ? "" : "sampling.", why);
    }
    return 0;
}

uint64_t proto_choice_seed(uint64_t seed, uint32_t i) {
    if (i == 0) return seed;
    uint64_t x = seed + (uint64_t)i * 0x9e3779b97f4a7c15ull;
    x = (x ^ (x >> 30)) * 0xbf58476d1ce4e5b9ull;
    x = (x ^ (x >> 27)) * 0x94d049bb133111ebull;
    x ^= x >> 31;
    return x ? x : 1;
}
