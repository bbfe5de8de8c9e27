/* The OpenAI API's request bodies and error objects: parses and checks a
 * /v1/completions or /v1/chat/completions body into the cluster's request
 * terms (prompt, sampling parameters, stops), and formats OpenAI's error
 * object.  Anything the cluster cannot do exactly as asked (an unknown
 * field, best_of > 1, tools) is refused by name, never ignored. */
#ifndef GATEWAY_OAI_H
#define GATEWAY_OAI_H

#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>

#include <cjson/cJSON.h>

#include "common/chat_template.h"
#include "common/sampling.h"

#define OAI_STOP_MAX 16         /* the router's limit on stop strings */
#define OAI_STOP_BYTES_MAX 256
#define OAI_N_MAX 16            /* the router's limit on choices (PROTO_N_MAX) */
#define OAI_PREDICTION_BYTES_MAX 262144 /* the router's limit (PROTO_PREDICTION_BYTES_MAX) */

enum oai_kind { OAI_COMPLETIONS = 0, OAI_CHAT = 1 };

/* OpenAI's {"error": {"message", "type", "param", "code"}} plus the HTTP
 * status that carries it and, for 429, the Retry-After seconds. */
struct oai_error {
    int status;                /* 400, 401, 404, 405, 413, 429, 500, 503 */
    const char *type;          /* "invalid_request_error", ...; static */
    char param[64];            /* "" = null */
    char code[48];             /* "" = null */
    char message[640];
    int retry_after_s;         /* > 0: a Retry-After header */
};

/* Sets every field of e; param and code may be NULL (JSON null). */
void oai_error_set(struct oai_error *e, int status, const char *type, const char *param, const char *code,
                   const char *fmt, ...) __attribute__((format(printf, 6, 7)));
/* The error object as JSON text; malloc'ed (the caller frees it), NULL when
 * out of memory. */
char *oai_error_json(const struct oai_error *e);

struct oai_request {
    enum oai_kind kind;
    cJSON *root;                   /* the parsed body; the strings below point into it */
    const char *model;             /* "" when absent */
    /* completions: text, or token ids (prompt given as an array of integers) */
    const char *prompt;
    int32_t *prompt_tokens;        /* malloc'ed */
    size_t n_prompt_tokens;
    /* chat: the messages, content parts joined (malloc'ed strings) */
    struct chat_message *messages;
    char **contents;
    size_t n_messages;
    uint32_t max_tokens;           /* 0: until a stop or the context ends */
    struct sampling_params sp;
    const char *stop[OAI_STOP_MAX];
    size_t n_stop;
    /* response_format (chat): json_schema's "schema" as JSON text
     * (malloc'ed), or json_object; neither for "text". */
    char *json_schema;
    bool json_object;
    bool stream, include_usage;
    uint32_t n;                    /* choices, 1 .. OAI_N_MAX */
    const char *user;              /* NULL when absent */
    /* Extensions "speculation" and "num_speculative_tokens"
     * (docs/gateway.md): a GenerateRequest.Spec value and its spec_tokens;
     * 0: the router's. */
    int32_t spec;
    uint32_t spec_tokens;
    /* prediction (OpenAI's predicted outputs, {"type": "content"}): its
     * content's text, malloc'ed; NULL when absent. */
    char *prediction;
};

/* Parses body[0..len) (not NUL-terminated) as a request of kind.  On
 * success r is the caller's, freed with oai_request_free; on failure (bad
 * JSON, a wrong type, an unknown field, a value out of range, a feature the
 * cluster does not have) e says why with status 400 and r needs no freeing. */
int oai_parse(enum oai_kind kind, const char *body, size_t len, struct oai_request *r, struct oai_error *e);
void oai_request_free(struct oai_request *r);

#endif
