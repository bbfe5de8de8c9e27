/* JSON Schema to GBNF: the grammar of the JSON texts a schema accepts, for
 * grammar_parse.  Supported: type (string, integer, number, boolean, null,
 * object, array, or a list of them), properties with required and optional
 * members (in the schema's order), additionalProperties true/false, enum,
 * const, items with minItems/maxItems, anyOf, minLength/maxLength, local
 * $ref (#/$defs/NAME, #/definitions/NAME, also recursive), and the
 * annotations (title, description, default, examples, $schema, $id,
 * $comment).  Any other keyword is refused by name with its place in the
 * schema ("/properties/age: keyword 'minimum' is not supported"): a
 * constraint is never silently dropped.
 *
 * What the grammar produces is a subset of what the schema accepts: only
 * declared properties (also when additionalProperties allows more), at most
 * 16 integer digits and 16 fraction digits, exponents of at most 2 digits,
 * no \u escapes for UTF-16 surrogates, and at most one newline and 20
 * blanks between tokens. */
#ifndef COMMON_JSON_SCHEMA_H
#define COMMON_JSON_SCHEMA_H

#include <stddef.h>

/* The schema text (len bytes) as GBNF.  On success *gbnf is a
 * NUL-terminated string the caller frees with free().  On failure *gbnf is
 * NULL, STATUS_BAD_INPUT (not JSON, an invalid schema) or
 * STATUS_UNSUPPORTED (a keyword or value we do not handle) is returned and
 * err says what and where. */
int json_schema_to_gbnf(const char *schema, size_t len, char **gbnf, char *err, size_t errlen);

/* The GBNF of "any JSON object" (OpenAI's response_format json_object): a
 * static string, not to be freed. */
const char *json_schema_any_object_gbnf(void);

#endif
