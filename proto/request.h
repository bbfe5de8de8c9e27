/* Checks and conversions of client requests shared by the router (which
 * must refuse a bad GenerateRequest with a message naming the field and its
 * value) and the worker (which turns a StepPlan's SamplingParams into the
 * sampler's struct).  The rules are those of docs/protocol.md. */
#ifndef PROTO_REQUEST_H
#define PROTO_REQUEST_H

#include <stddef.h>
#include <stdint.h>

#include "common/sampling.h"
#include "proto/client.pb-c.h"
#include "proto/types.pb-c.h"

#define PROTO_STOP_STRINGS_MAX 16
/* Most drafted tokens a request may ask one step to verify (spec_tokens). */
#define PROTO_SPEC_TOKENS_MAX 16
/* Longest GenerateRequest.prediction, in bytes. */
#define PROTO_PREDICTION_BYTES_MAX 262144
/* Most GenerateRequest.prediction_tokens. */
#define PROTO_PREDICTION_TOKENS_MAX 65536
#define PROTO_STOP_STRING_BYTES_MAX 256
#define PROTO_PRIORITY_MIN (-100)
#define PROTO_PRIORITY_MAX 100
/* Most choices one request may ask for (GenerateRequest.n). */
#define PROTO_N_MAX 16

/* The seed choice i of a request with seed `seed` samples with: seed itself
 * for choice 0; for i > 0 the splitmix64 finalizer of
 * seed + i * 0x9e3779b97f4a7c15 (never 0: 1 instead).  A request of n = 1
 * with this seed makes the same tokens as choice i (docs/protocol.md,
 * "Several choices"). */
uint64_t proto_choice_seed(uint64_t seed, uint32_t i);

/* Copies m into *p (m NULL: all defaults, i.e. greedy).  No range checks
 * beyond what the struct can hold: more than SAMPLING_STOP_IDS_MAX stop ids
 * is STATUS_BAD_INPUT with err naming the count.  Nothing is allocated. */
int proto_sampling_from_msg(const Llm__SamplingParams *m, struct sampling_params *p, char *err,
                            size_t errlen);
/* Fills *m (the caller's, e.g. on the stack) from *p.  m->stop_token_ids
 * points into p, so p must outlive every use of m. */
void proto_sampling_to_msg(const struct sampling_params *p, Llm__SamplingParams *m);
/* proto_sampling_from_msg, then sampling_params_validate against n_vocab
 * (0 skips the vocabulary checks): what the router checks in a request and
 * the worker in a plan.  Returns 0, or STATUS_BAD_INPUT with err naming the
 * field as "sampling.<field>" and its value (*p then holds no meaning). */
int proto_sampling_check(const Llm__SamplingParams *m, int32_t n_vocab, struct sampling_params *p,
                         char *err, size_t errlen);

/* Compiles m's constraint (json_schema, json_object or grammar; none when
 * m is NULL), only to refuse one that does not compile.  *field = the
 * constraint's field name ("grammar"), or NULL when m has none.  Returns 0,
 * or STATUS_BAD_INPUT with err as "sampling.grammar: line 2, column 11:
 * undefined rule 'x'" or "sampling.json_schema: json schema /properties/age:
 * keyword 'minimum' is not supported". */
int proto_constraint_check(const Llm__SamplingParams *m, const char **field, char *err,
                           size_t errlen);

/* Everything the router checks before accepting a GenerateRequest:
 * request_id (proto_request_id_check), not both a non-empty prompt and
 * prompt_tokens (neither is the empty prompt: BOS alone once the router
 * tokenizes it), prompt token ids inside [0, n_vocab) (n_vocab 0 skips it),
 * stop strings (count and length), the prediction's length (or its ids:
 * not both, count, inside [0, n_vocab)), priority, deadline_ms and the sampling
 * parameters (sampling_params_validate, field names prefixed "sampling.").
 * now_ms is the current Unix time in ms (for the deadline), and the
 * constraint (proto_constraint_check).  Returns 0; STATUS_BAD_INPUT (reply
 * INVALID_ARGUMENT); STATUS_TIMEOUT when deadline_ms has already passed
 * (reply DEADLINE_EXCEEDED); or STATUS_UNSUPPORTED (reply UNIMPLEMENTED)
 * for n > 1 and for a constraint together with stop strings or
 * stop_token_ids (a stop could end the output inside the grammar).  err
 * names the field and its value. */
int proto_generate_validate(const Llm__GenerateRequest *g, int32_t n_vocab, int64_t now_ms,
                            char *err, size_t errlen);

#endif
