/* JSON Schema to GBNF (see json_schema.h for what is supported).  Each
 * schema node becomes one rule s<N>; the shared primitives (ws, string,
 * number, any value) are written once at the end. */
#include "json_schema.h"

#include <cjson/cJSON.h>
#include <math.h>
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "status.h"
#include "unicode.h"

/* Longest string and array bounds we expand into rules. */
#define JS_BOUND_MAX 10000

static const char js_prims[] =
    "ws ::= | \" \" | \"\\n\" [ \\t]{0,20}\n"
    "hex ::= [0-9a-fA-F]\n"
    /* no \u escapes of UTF-16 surrogates: a pair would count as two
     * characters here and one for a validator's minLength */
    "char ::= [^\"\\\\\\x00-\\x1f] | \"\\\\\" ([\"\\\\/bfnrt] | \"u\" ([0-9a-cA-CefEF] hex hex hex "
    "| [dD] [0-7] hex hex))\n"
    "string ::= \"\\\"\" char* \"\\\"\"\n"
    "integer ::= \"-\"? (\"0\" | [1-9] [0-9]{0,15})\n"
    "number ::= integer (\".\" [0-9]{1,16})? ([eE] [-+]? [0-9]{1,2})?\n"
    "boolean ::= \"true\" | \"false\"\n"
    "null ::= \"null\"\n"
    "value ::= object | array | string | number | boolean | null\n"
    "kv ::= string ws \":\" ws value ws\n"
    "object ::= \"{\" ws (kv (\",\" ws kv)*)? \"}\"\n"
    "array ::= \"[\" ws (value ws (\",\" ws value ws)*)? \"]\"\n";

static const char js_any_object[] =
    "root ::= object ws\n"
    "ws ::= | \" \" | \"\\n\" [ \\t]{0,20}\n"
    "hex ::= [0-9a-fA-F]\n"
    "char ::= [^\"\\\\\\x00-\\x1f] | \"\\\\\" ([\"\\\\/bfnrt] | \"u\" ([0-9a-cA-CefEF] hex hex hex "
    "| [dD] [0-7] hex hex))\n"
    "string ::= \"\\\"\" char* \"\\\"\"\n"
    "integer ::= \"-\"? (\"0\" | [1-9] [0-9]{0,15})\n"
    "number ::= integer (\".\" [0-9]{1,16})? ([eE] [-+]? [0-9]{1,2})?\n"
    "value ::= object | array | string | number | \"true\" | \"false\" | \"null\"\n"
    "kv ::= string ws \":\" ws value ws\n"
    "object ::= \"{\" ws (kv (\",\" ws kv)*)? \"}\"\n"
    "array ::= \"[\" ws (value ws (\",\" ws value ws)*)? \"]\"\n";

const char *json_schema_any_object_gbnf(void) { return js_any_object; }

struct sb {
    char *s;
    size_t n, cap;
    int oom;
};

__attribute__((format(printf, 2, 3))) static void sb_printf(struct sb *b, const char *fmt, ...) {
    if (b->oom) return;
    for (;;) {
        va_list ap;
        va_start(ap, fmt);
        int k = vsnprintf(b->s ? b->s + b->n : NULL, b->s ? b->cap - b->n : 0, fmt, ap);
        va_end(ap);
        if (k < 0) {
            b->oom = 1;
            return;
        }
        if (b->s && b->n + (size_t)k < b->cap) {
            b->n += (size_t)k;
            return;
        }
        size_t cap = b->cap ? b->cap * 2 : 4096;
        while (cap < b->n + (size_t)k + 1) cap *= 2;
        char *s = realloc(b->s, cap);
        if (!s) {
            b->oom = 1;
            return;
        }
        b->s = s;
        b->cap = cap;
    }
}

/* A GBNF literal for len bytes of text. */
static void sb_lit(struct sb *b, const char *t, size_t len) {
    sb_printf(b, "\"");
    for (size_t i = 0; i < len; i++) {
        unsigned char c = (unsigned char)t[i];
        if (c == '"' || c == '\\') sb_printf(b, "\\%c", c);
        else if (c == '\n') sb_printf(b, "\\n");
        else if (c < 0x20 || c == 0x7f) sb_printf(b, "\\x%02X", c);
        else sb_printf(b, "%c", c);
    }
    sb_printf(b, "\"");
}

struct ctx {
    struct sb out;
    int n_rules;
    cJSON *doc;
    /* $ref targets already given a rule: pointer -> rule number */
    const cJSON **ref_node;
    int *ref_rule;
    int n_refs, cap_refs;
    char *err;
    size_t errlen;
    int status;
    int depth;
};

__attribute__((format(printf, 4, 5))) static int js_fail(struct ctx *c, int status,
                                                          const char *path, const char *fmt, ...) {
    if (c->status) return c->status;
    char msg[300];
    va_list ap;
    va_start(ap, fmt);
    vsnprintf(msg, sizeof msg, fmt, ap);
    va_end(ap);
    c->status = status_fail(c->err, c->errlen, status, "json schema %s: %s", path[0] ? path : "/",
                            msg);
    return c->status;
}

static int gen(struct ctx *c, const cJSON *s, const char *path, const char *type_only);

static int is_annotation(const char *k) {
    static const char *const ann[] = {"$schema", "$id", "title", "description", "default",
                                      "examples", "$comment", "deprecated", "readOnly",
                                      "writeOnly", "$defs", "definitions", NULL};
    for (int i = 0; ann[i]; i++)
        if (strcmp(k, ann[i]) == 0) return 1;
    return 0;
}

static int is_handled(const char *k) {
    static const char *const ok[] = {"type", "properties", "required", "additionalProperties",
                                     "enum", "const", "items", "minItems", "maxItems", "anyOf",
                                     "minLength", "maxLength", "$ref", NULL};
    for (int i = 0; ok[i]; i++)
        if (strcmp(k, ok[i]) == 0) return 1;
    return 0;
}

static int get_bound(struct ctx *c, const cJSON *s, const char *key, const char *path, int dflt,
                     int *out) {
    const cJSON *v = cJSON_GetObjectItemCaseSensitive(s, key);
    *out = dflt;
    if (!v) return 0;
    if (!cJSON_IsNumber(v) || v->valuedouble < 0 || floor(v->valuedouble) != v->valuedouble)
        return js_fail(c, STATUS_BAD_INPUT, path, "'%s' must be a non-negative integer", key);
    if (v->valuedouble > JS_BOUND_MAX)
        return js_fail(c, STATUS_UNSUPPORTED, path, "'%s' = %.0f is above the supported %d", key,
                       v->valuedouble, JS_BOUND_MAX);
    *out = (int)v->valuedouble;
    return 0;
}

/* "{m,n}" / "{m,}" for a repetition. */
static void sb_rep(struct sb *b, int lo, int hi) {
    if (hi < 0) sb_printf(b, "{%d,}", lo);
    else sb_printf(b, "{%d,%d}", lo, hi);
}

static int gen_enum(struct ctx *c, const cJSON *vals, int rule) {
    sb_printf(&c->out, "s%d ::=", rule);
    int i = 0;
    for (const cJSON *v = vals->child; v; v = v->next, i++) {
        char *t = cJSON_PrintUnformatted(v);
        if (!t) {
            c->out.oom = 1;
            return 0;
        }
        sb_printf(&c->out, "%s ", i ? " |" : "");
        sb_lit(&c->out, t, strlen(t));
        free(t);
    }
    sb_printf(&c->out, "\n");
    return 0;
}

static int gen_object(struct ctx *c, const cJSON *s, const char *path, int rule) {
    const cJSON *props = cJSON_GetObjectItemCaseSensitive(s, "properties");
    const cJSON *req = cJSON_GetObjectItemCaseSensitive(s, "required");
    const cJSON *addl = cJSON_GetObjectItemCaseSensitive(s, "additionalProperties");
    char p[512];
    if (props && !cJSON_IsObject(props))
        return js_fail(c, STATUS_BAD_INPUT, path, "'properties' must be an object");
    if (req && !cJSON_IsArray(req))
        return js_fail(c, STATUS_BAD_INPUT, path, "'required' must be an array");
    if (addl && !cJSON_IsBool(addl))
        return js_fail(c, STATUS_UNSUPPORTED, path,
                       "keyword 'additionalProperties' is supported as true or false only");
    for (const cJSON *r = req ? req->child : NULL; r; r = r->next) {
        if (!cJSON_IsString(r))
            return js_fail(c, STATUS_BAD_INPUT, path, "'required' must list strings");
        if (!props || !cJSON_GetObjectItemCaseSensitive(props, r->valuestring))
            return js_fail(c, STATUS_UNSUPPORTED, path,
                           "required property '%s' has no schema in 'properties'", r->valuestring);
    }
    int n = cJSON_GetArraySize(props);
    if (n == 0) {
        if (addl && cJSON_IsFalse(addl)) sb_printf(&c->out, "s%d ::= \"{\" ws \"}\"\n", rule);
        else sb_printf(&c->out, "s%d ::= object\n", rule);
        return 0;
    }
    /* kv rules */
    int *kv = malloc(sizeof *kv * (size_t)n);
    int *isreq = calloc((size_t)n, sizeof *isreq);
    if (!kv || !isreq) {
        free(kv), free(isreq);
        c->out.oom = 1;
        return 0;
    }
    int i = 0;
    for (const cJSON *pr = props->child; pr && !c->status; pr = pr->next, i++) {
        for (const cJSON *r = req ? req->child : NULL; r; r = r->next)
            if (strcmp(r->valuestring, pr->string) == 0) isreq[i] = 1;
        snprintf(p, sizeof p, "%s/properties/%s", path, pr->string);
        int vr = gen(c, pr, p, NULL);
        if (vr < 0) break;
        kv[i] = ++c->n_rules;
        /* the property name as JSON text, then as a GBNF literal */
        cJSON *nm = cJSON_CreateString(pr->string);
        char *t = nm ? cJSON_PrintUnformatted(nm) : NULL;
        cJSON_Delete(nm);
        if (!t) {
            c->out.oom = 1;
            break;
        }
        sb_printf(&c->out, "s%d ::= ", kv[i]);
        sb_lit(&c->out, t, strlen(t));
        sb_printf(&c->out, " ws \":\" ws s%d ws\n", vr);
        free(t);
    }
    if (!c->status && !c->out.oom) {
        /* first_i: properties i.. with none written yet; after_i: some written.
         * Rules numbered base + 2 * i (first) and base + 2 * i + 1 (after). */
        int base = c->n_rules + 1;
        c->n_rules += 2 * (n + 1);
        for (i = 0; i < n; i++) {
            int f = base + 2 * i, a = f + 1, nf = f + 2, na = f + 3;
            if (isreq[i]) {
                sb_printf(&c->out, "s%d ::= s%d s%d\n", f, kv[i], na);
                sb_printf(&c->out, "s%d ::= \",\" ws s%d s%d\n", a, kv[i], na);
            } else {
                sb_printf(&c->out, "s%d ::= s%d s%d | s%d\n", f, kv[i], na, nf);
                sb_printf(&c->out, "s%d ::= (\",\" ws s%d)? s%d\n", a, kv[i], na);
            }
        }
        sb_printf(&c->out, "s%d ::= \"\"\ns%d ::= \"\"\n", base + 2 * n, base + 2 * n + 1);
        sb_printf(&c->out, "s%d ::= \"{\" ws s%d \"}\"\n", rule, base);
    }
    free(kv), free(isreq);
    return c->status;
}

static int gen_array(struct ctx *c, const cJSON *s, const char *path, int rule) {
    const cJSON *items = cJSON_GetObjectItemCaseSensitive(s, "items");
    int lo, hi;
    if (get_bound(c, s, "minItems", path, 0, &lo) || get_bound(c, s, "maxItems", path, -1, &hi))
        return c->status;
    if (hi >= 0 && hi < lo)
        return js_fail(c, STATUS_BAD_INPUT, path, "maxItems %d is below minItems %d", hi, lo);
    int ir = -1;
    char p[512];
    snprintf(p, sizeof p, "%s/items", path);
    if (items) {
        if (cJSON_IsArray(items))
            return js_fail(c, STATUS_UNSUPPORTED, path, "keyword 'items' as an array (tuple) is "
                           "not supported");
        ir = gen(c, items, p, NULL);
        if (ir < 0) return c->status;
    }
    char item[32];
    if (ir >= 0) snprintf(item, sizeof item, "s%d", ir);
    else snprintf(item, sizeof item, "value");
    if (hi == 0) {
        sb_printf(&c->out, "s%d ::= \"[\" ws \"]\"\n", rule);
        return 0;
    }
    sb_printf(&c->out, "s%d ::= \"[\" ws (%s ws (\",\" ws %s ws)", rule, item, item);
    sb_rep(&c->out, lo > 0 ? lo - 1 : 0, hi < 0 ? -1 : hi - 1);
    sb_printf(&c->out, ")%s \"]\"\n", lo == 0 ? "?" : "");
    return 0;
}

static int gen_string(struct ctx *c, const cJSON *s, const char *path, int rule) {
    int lo, hi;
    if (get_bound(c, s, "minLength", path, 0, &lo) || get_bound(c, s, "maxLength", path, -1, &hi))
        return c->status;
    if (hi >= 0 && hi < lo)
        return js_fail(c, STATUS_BAD_INPUT, path, "maxLength %d is below minLength %d", hi, lo);
    if (lo == 0 && hi < 0) {
        sb_printf(&c->out, "s%d ::= string\n", rule);
        return 0;
    }
    sb_printf(&c->out, "s%d ::= \"\\\"\" char", rule);
    sb_rep(&c->out, lo, hi);
    sb_printf(&c->out, " \"\\\"\"\n");
    return 0;
}

/* The rule for a $ref: made once per target, so recursion terminates. */
static int gen_ref(struct ctx *c, const cJSON *s, const char *path) {
    const char *ref = cJSON_GetStringValue(cJSON_GetObjectItemCaseSensitive(s, "$ref"));
    if (!ref) return js_fail(c, STATUS_BAD_INPUT, path, "'$ref' must be a string");
    const char *name = NULL;
    const cJSON *defs = NULL;
    if (strncmp(ref, "#/$defs/", 8) == 0) {
        name = ref + 8;
        defs = cJSON_GetObjectItemCaseSensitive(c->doc, "$defs");
    } else if (strncmp(ref, "#/definitions/", 14) == 0) {
        name = ref + 14;
        defs = cJSON_GetObjectItemCaseSensitive(c->doc, "definitions");
    } else if (strcmp(ref, "#") == 0) {
        defs = NULL;
    } else {
        return js_fail(c, STATUS_UNSUPPORTED, path, "'$ref' = \"%s\": only local references "
                       "(#, #/$defs/NAME, #/definitions/NAME) are supported", ref);
    }
    const cJSON *target = name ? cJSON_GetObjectItemCaseSensitive(defs, name) : c->doc;
    if (!target) return js_fail(c, STATUS_BAD_INPUT, path, "'$ref' = \"%s\" names nothing", ref);
    for (int i = 0; i < c->n_refs; i++)
        if (c->ref_node[i] == target) return c->ref_rule[i];
    if (c->n_refs == c->cap_refs) {
        int cap = c->cap_refs ? c->cap_refs * 2 : 8;
        const cJSON **rn = realloc(c->ref_node, sizeof *rn * (size_t)cap);
        if (rn) c->ref_node = rn;
        int *rr = realloc(c->ref_rule, sizeof *rr * (size_t)cap);
        if (rr) c->ref_rule = rr;
        if (!rn || !rr) {
            c->out.oom = 1;
            return -1;
        }
        c->cap_refs = cap;
    }
    /* reserve the rule number before generating, for recursive references */
    int rule = ++c->n_rules;
    c->ref_node[c->n_refs] = target;
    c->ref_rule[c->n_refs] = rule;
    c->n_refs++;
    char p[512];
    snprintf(p, sizeof p, "%s", ref + 1);
    int body = gen(c, target, p, NULL);
    if (body < 0) return -1;
    sb_printf(&c->out, "s%d ::= s%d\n", rule, body);
    return rule;
}

/* Writes the rules for schema s; returns its rule number or -1 (c->status
 * says why).  type_only: generate for this one type of a type list. */
static int gen(struct ctx *c, const cJSON *s, const char *path, const char *type_only) {
    if (c->status || c->out.oom) return -1;
    if (++c->depth > 64) {
        js_fail(c, STATUS_UNSUPPORTED, path, "schema nested deeper than 64 levels");
        return -1;
    }
    int rule = ++c->n_rules;
    int rc = 0;
    if (cJSON_IsTrue(s)) {
        sb_printf(&c->out, "s%d ::= value\n", rule);
        goto out;
    }
    if (cJSON_IsFalse(s)) {
        rc = js_fail(c, STATUS_UNSUPPORTED, path, "the schema false accepts nothing");
        goto out;
    }
    if (!cJSON_IsObject(s)) {
        rc = js_fail(c, STATUS_BAD_INPUT, path, "a schema must be an object or a boolean");
        goto out;
    }
    for (const cJSON *k = s->child; k; k = k->next) {
        if (is_annotation(k->string) || is_handled(k->string)) continue;
        if (strcmp(k->string, "uniqueItems") == 0 && cJSON_IsFalse(k)) continue;
        rc = js_fail(c, STATUS_UNSUPPORTED, path, "keyword '%s' is not supported", k->string);
        goto out;
    }
    if (cJSON_GetObjectItemCaseSensitive(s, "$ref")) {
        if (s->child && s->child->next) {
            for (const cJSON *k = s->child; k; k = k->next)
                if (!is_annotation(k->string) && strcmp(k->string, "$ref") != 0) {
                    rc = js_fail(c, STATUS_UNSUPPORTED, path, "keyword '%s' next to '$ref' is not "
                                 "supported", k->string);
                    goto out;
                }
        }
        int r = gen_ref(c, s, path);
        if (r < 0) rc = -1;
        else sb_printf(&c->out, "s%d ::= s%d\n", rule, r);
        goto out;
    }
    const cJSON *cst = cJSON_GetObjectItemCaseSensitive(s, "const");
    const cJSON *en = cJSON_GetObjectItemCaseSensitive(s, "enum");
    if (cst || en) {
        if (en && (!cJSON_IsArray(en) || cJSON_GetArraySize(en) == 0)) {
            rc = js_fail(c, STATUS_BAD_INPUT, path, "'enum' must be a non-empty array");
            goto out;
        }
        if (cst) {
            /* a list of one, without unlinking it from the document */
            cJSON *one = cJSON_CreateArray();
            cJSON *dup = cJSON_Duplicate(cst, 1);
            if (!one || !dup) {
                cJSON_Delete(one), cJSON_Delete(dup);
                c->out.oom = 1;
                goto out;
            }
            cJSON_AddItemToArray(one, dup);
            gen_enum(c, one, rule);
            cJSON_Delete(one);
        } else {
            gen_enum(c, en, rule);
        }
        goto out;
    }
    const cJSON *any = cJSON_GetObjectItemCaseSensitive(s, "anyOf");
    if (any) {
        if (!cJSON_IsArray(any) || cJSON_GetArraySize(any) == 0) {
            rc = js_fail(c, STATUS_BAD_INPUT, path, "'anyOf' must be a non-empty array");
            goto out;
        }
        for (const cJSON *k = s->child; k; k = k->next)
            if (!is_annotation(k->string) && strcmp(k->string, "anyOf") != 0) {
                rc = js_fail(c, STATUS_UNSUPPORTED, path, "keyword '%s' next to 'anyOf' is not "
                             "supported (move it into each branch)", k->string);
                goto out;
            }
        int n = cJSON_GetArraySize(any);
        int *sub = malloc(sizeof *sub * (size_t)n);
        if (!sub) {
            c->out.oom = 1;
            goto out;
        }
        int i = 0;
        for (const cJSON *b = any->child; b; b = b->next, i++) {
            char p[512];
            snprintf(p, sizeof p, "%s/anyOf/%d", path, i);
            sub[i] = gen(c, b, p, NULL);
            if (sub[i] < 0) break;
        }
        if (!c->status) {
            sb_printf(&c->out, "s%d ::=", rule);
            for (i = 0; i < n; i++) sb_printf(&c->out, "%s s%d", i ? " |" : "", sub[i]);
            sb_printf(&c->out, "\n");
        }
        free(sub);
        goto out;
    }
    const cJSON *ty = cJSON_GetObjectItemCaseSensitive(s, "type");
    const char *t = type_only;
    if (!t && ty && cJSON_IsArray(ty)) {
        int n = cJSON_GetArraySize(ty), i = 0;
        if (n == 0) {
            rc = js_fail(c, STATUS_BAD_INPUT, path, "'type' is an empty list");
            goto out;
        }
        int *sub = malloc(sizeof *sub * (size_t)n);
        if (!sub) {
            c->out.oom = 1;
            goto out;
        }
        for (const cJSON *e = ty->child; e; e = e->next, i++) {
            if (!cJSON_IsString(e)) {
                rc = js_fail(c, STATUS_BAD_INPUT, path, "'type' must list strings");
                break;
            }
            sub[i] = gen(c, s, path, e->valuestring);
            if (sub[i] < 0) break;
        }
        if (!c->status) {
            sb_printf(&c->out, "s%d ::=", rule);
            for (i = 0; i < n; i++) sb_printf(&c->out, "%s s%d", i ? " |" : "", sub[i]);
            sb_printf(&c->out, "\n");
        }
        free(sub);
        goto out;
    }
    if (!t && ty) {
        if (!cJSON_IsString(ty)) {
            rc = js_fail(c, STATUS_BAD_INPUT, path, "'type' must be a string or a list");
            goto out;
        }
        t = ty->valuestring;
    }
    if (!t) {
        /* no type: infer it from the keywords that apply to one type only */
        if (cJSON_GetObjectItemCaseSensitive(s, "properties") ||
            cJSON_GetObjectItemCaseSensitive(s, "required") ||
            cJSON_GetObjectItemCaseSensitive(s, "additionalProperties"))
            t = "object";
        else if (cJSON_GetObjectItemCaseSensitive(s, "items") ||
                 cJSON_GetObjectItemCaseSensitive(s, "minItems") ||
                 cJSON_GetObjectItemCaseSensitive(s, "maxItems"))
            t = "array";
        else if (cJSON_GetObjectItemCaseSensitive(s, "minLength") ||
                 cJSON_GetObjectItemCaseSensitive(s, "maxLength"))
            t = "string";
    }
    if (!t) {
        sb_printf(&c->out, "s%d ::= value\n", rule);
    } else if (strcmp(t, "object") == 0) {
        rc = gen_object(c, s, path, rule);
    } else if (strcmp(t, "array") == 0) {
        rc = gen_array(c, s, path, rule);
    } else if (strcmp(t, "string") == 0) {
        rc = gen_string(c, s, path, rule);
    } else if (strcmp(t, "integer") == 0 || strcmp(t, "number") == 0 ||
               strcmp(t, "boolean") == 0 || strcmp(t, "null") == 0) {
        sb_printf(&c->out, "s%d ::= %s\n", rule, t);
    } else {
        rc = js_fail(c, STATUS_BAD_INPUT, path, "'type' = \"%s\" is not a JSON Schema type", t);
    }
out:
    c->depth--;
    if (!rc && c->out.oom)
        rc = status_fail(c->err, c->errlen, STATUS_NO_MEMORY, "json schema: out of memory");
    if (rc && !c->status) c->status = rc;
    /* A failure inside a branch (anyOf, a list of types) fails the whole. */
    return c->status ? -1 : rule;
}

int json_schema_to_gbnf(const char *schema, size_t len, char **gbnf, char *err, size_t errlen) {
    *gbnf = NULL;
    /* JSON text is UTF-8; a string's bytes become the grammar's literals. */
    size_t bad = unicode_utf8_valid_prefix(schema, len);
    if (bad < len)
        return status_fail(err, errlen, STATUS_BAD_INPUT, "json schema: not valid UTF-8 (byte %zu is not part of a "
                           "character)", bad);
    const char *end = NULL;
    cJSON *doc = cJSON_ParseWithLengthOpts(schema, len, &end, 0);
    if (!doc) {
        size_t off = end && end >= schema ? (size_t)(end - schema) : 0;
        return status_fail(err, errlen, STATUS_BAD_INPUT, "json schema: not valid JSON (near byte %zu)",
                           off);
    }
    struct ctx c = {.doc = doc, .err = err, .errlen = errlen};
    int top = gen(&c, doc, "", NULL);
    if (top >= 0) {
        sb_printf(&c.out, "root ::= s%d ws\n%s", top, js_prims);
    }
    cJSON_Delete(doc);
    free(c.ref_node), free(c.ref_rule);
    if (top < 0 || c.out.oom) {
        free(c.out.s);
        if (!c.status) c.status = status_fail(err, errlen, STATUS_NO_MEMORY, "json schema: out of memory");
        return c.status;
    }
    *gbnf = c.out.s;
    return 0;
}
