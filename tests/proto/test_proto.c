/* Tests of the wire protocol: every message type round-trips with every
 * field set to a non-default value, and truncated, random, mutated,
 * oversized, wrong-version, body-less and non-UTF-8 frames are all refused
 * with an error and never crash.  Also built with ASan + UBSan
 * (test_proto_asan). */
#include "proto/wire.h"

#include <time.h>

#include "common/status.h"
#include "tests/test.h"

/* ---- A descriptor-driven filler and comparator ----------------------------
 * Filling through the descriptors means a field added to a .proto later is
 * covered without touching this file. */

struct arena {
    void **ptrs;
    size_t n, cap;
};

static void *arena_alloc(struct arena *a, size_t size) {
    if (a->n == a->cap) {
        a->cap = a->cap ? 2 * a->cap : 64;
        a->ptrs = realloc(a->ptrs, a->cap * sizeof *a->ptrs);
        if (!a->ptrs) abort();
    }
    void *p = calloc(1, size ? size : 1);
    if (!p) abort();
    a->ptrs[a->n++] = p;
    return p;
}

static void arena_free(struct arena *a) {
    for (size_t i = 0; i < a->n; i++) free(a->ptrs[i]);
    free(a->ptrs);
    memset(a, 0, sizeof *a);
}

static size_t field_elem_size(const ProtobufCFieldDescriptor *f) {
    switch (f->type) {
    case PROTOBUF_C_TYPE_INT32: case PROTOBUF_C_TYPE_SINT32: case PROTOBUF_C_TYPE_SFIXED32:
    case PROTOBUF_C_TYPE_UINT32: case PROTOBUF_C_TYPE_FIXED32: case PROTOBUF_C_TYPE_ENUM:
        return 4;
    case PROTOBUF_C_TYPE_INT64: case PROTOBUF_C_TYPE_SINT64: case PROTOBUF_C_TYPE_SFIXED64:
    case PROTOBUF_C_TYPE_UINT64: case PROTOBUF_C_TYPE_FIXED64:
        return 8;
    case PROTOBUF_C_TYPE_FLOAT: return sizeof(float);
    case PROTOBUF_C_TYPE_DOUBLE: return sizeof(double);
    case PROTOBUF_C_TYPE_BOOL: return sizeof(protobuf_c_boolean);
    case PROTOBUF_C_TYPE_STRING: return sizeof(char *);
    case PROTOBUF_C_TYPE_BYTES: return sizeof(ProtobufCBinaryData);
    case PROTOBUF_C_TYPE_MESSAGE: return sizeof(ProtobufCMessage *);
    }
    return 0;
}

static void fill_message(ProtobufCMessage *m, struct arena *a, uint32_t *counter, int depth,
                         uint32_t oneof_pick);

/* One non-default value of f's type at p, distinct per call (counter). */
static void fill_value(const ProtobufCFieldDescriptor *f, void *p, struct arena *a,
                       uint32_t *counter, int depth) {
    uint32_t v = ++*counter;
    switch (f->type) {
    case PROTOBUF_C_TYPE_INT32: case PROTOBUF_C_TYPE_SINT32: case PROTOBUF_C_TYPE_SFIXED32:
        *(int32_t *)p = (v & 1) ? -(int32_t)v * 1000 : (int32_t)v * 1000;
        break;
    case PROTOBUF_C_TYPE_UINT32: case PROTOBUF_C_TYPE_FIXED32:
        *(uint32_t *)p = v * 100003u;
        break;
    case PROTOBUF_C_TYPE_ENUM: {
        const ProtobufCEnumDescriptor *e = f->descriptor;
        if (e->n_values < 2) abort(); /* an enum with only its zero value */
        *(int32_t *)p = e->values[1 + v % (e->n_values - 1)].value; /* skip the zero value */
        break;
    }
    case PROTOBUF_C_TYPE_INT64: case PROTOBUF_C_TYPE_SINT64: case PROTOBUF_C_TYPE_SFIXED64:
        *(int64_t *)p = ((v & 1) ? -1 : 1) * (((int64_t)v << 35) + v);
        break;
    case PROTOBUF_C_TYPE_UINT64: case PROTOBUF_C_TYPE_FIXED64:
        *(uint64_t *)p = ((uint64_t)v << 40) | v;
        break;
    case PROTOBUF_C_TYPE_FLOAT: *(float *)p = (float)v + 0.25f; break;
    case PROTOBUF_C_TYPE_DOUBLE: *(double *)p = v + 0.125; break;
    case PROTOBUF_C_TYPE_BOOL: *(protobuf_c_boolean *)p = 1; break;
    case PROTOBUF_C_TYPE_STRING: {
        char *s = arena_alloc(a, 96);
        snprintf(s, 96, "%s-%u-h\xc3\xa9llo-\xf0\x9f\x98\x80", f->name, v); /* é, U+1F600 */
        *(char **)p = s;
        break;
    }
    case PROTOBUF_C_TYPE_BYTES: {
        ProtobufCBinaryData *b = p;
        b->len = 5;
        b->data = arena_alloc(a, 5);
        for (int i = 0; i < 5; i++) b->data[i] = (uint8_t)(v + i * 51);
        break;
    }
    case PROTOBUF_C_TYPE_MESSAGE: {
        const ProtobufCMessageDescriptor *d = f->descriptor;
        ProtobufCMessage *sub = arena_alloc(a, d->sizeof_message);
        d->message_init(sub);
        fill_message(sub, a, counter, depth + 1, 0);
        *(ProtobufCMessage **)p = sub;
        break;
    }
    }
}

/* Sets every field; of a oneof only the member with id oneof_pick (or, when
 * 0 or nested, the first member). */
static void fill_message(ProtobufCMessage *m, struct arena *a, uint32_t *counter, int depth,
                         uint32_t oneof_pick) {
    const ProtobufCMessageDescriptor *d = m->descriptor;
    char *base = (char *)m;
    if (depth > 8) abort(); /* our schema is not recursive */
    for (unsigned i = 0; i < d->n_fields; i++) {
        const ProtobufCFieldDescriptor *f = &d->fields[i];
        if (f->flags & PROTOBUF_C_FIELD_FLAG_ONEOF) {
            uint32_t *which = (uint32_t *)(base + f->quantifier_offset);
            if (oneof_pick && depth == 0 ? f->id != oneof_pick : *which != 0) continue;
            *which = f->id;
        }
        if (f->label == PROTOBUF_C_LABEL_REPEATED) {
            size_t n = 3, es = field_elem_size(f);
            char *arr = arena_alloc(a, n * es);
            for (size_t k = 0; k < n; k++) fill_value(f, arr + k * es, a, counter, depth);
            *(size_t *)(base + f->quantifier_offset) = n;
            *(void **)(base + f->offset) = arr;
        } else {
            fill_value(f, base + f->offset, a, counter, depth);
            if (f->label == PROTOBUF_C_LABEL_OPTIONAL && f->type != PROTOBUF_C_TYPE_STRING &&
                f->type != PROTOBUF_C_TYPE_MESSAGE && !(f->flags & PROTOBUF_C_FIELD_FLAG_ONEOF))
                *(protobuf_c_boolean *)(base + f->quantifier_offset) = 1;
        }
    }
}

static int value_equal(const ProtobufCFieldDescriptor *f, const void *x, const void *y,
                       char *path, size_t pathlen);

/* 1 if equal; else 0 and path names the first differing field. */
static int message_equal(const ProtobufCMessage *x, const ProtobufCMessage *y, char *path,
                         size_t pathlen) {
    const ProtobufCMessageDescriptor *d = x->descriptor;
    if (!y || y->descriptor != d) {
        snprintf(path, pathlen, "%s (descriptor)", d->name);
        return 0;
    }
    const char *bx = (const char *)x, *by = (const char *)y;
    for (unsigned i = 0; i < d->n_fields; i++) {
        const ProtobufCFieldDescriptor *f = &d->fields[i];
        if (f->flags & PROTOBUF_C_FIELD_FLAG_ONEOF) {
            uint32_t wx = *(const uint32_t *)(bx + f->quantifier_offset);
            uint32_t wy = *(const uint32_t *)(by + f->quantifier_offset);
            if (wx != wy) {
                snprintf(path, pathlen, "%s.%s (oneof case %u vs %u)", d->name, f->name, wx, wy);
                return 0;
            }
            if (wx != f->id) continue;
        }
        if (f->label == PROTOBUF_C_LABEL_REPEATED) {
            size_t nx = *(const size_t *)(bx + f->quantifier_offset);
            size_t ny = *(const size_t *)(by + f->quantifier_offset);
            if (nx != ny) {
                snprintf(path, pathlen, "%s.%s (count %zu vs %zu)", d->name, f->name, nx, ny);
                return 0;
            }
            const char *ax = *(const char *const *)(bx + f->offset);
            const char *ay = *(const char *const *)(by + f->offset);
            size_t es = field_elem_size(f);
            for (size_t k = 0; k < nx; k++)
                if (!value_equal(f, ax + k * es, ay + k * es, path, pathlen)) return 0;
        } else if (!value_equal(f, bx + f->offset, by + f->offset, path, pathlen)) {
            return 0;
        }
    }
    return 1;
}

static int value_equal(const ProtobufCFieldDescriptor *f, const void *x, const void *y,
                       char *path, size_t pathlen) {
    int eq;
    switch (f->type) {
    case PROTOBUF_C_TYPE_STRING: {
        const char *sx = *(const char *const *)x, *sy = *(const char *const *)y;
        eq = sx && sy && strcmp(sx, sy) == 0;
        break;
    }
    case PROTOBUF_C_TYPE_BYTES: {
        const ProtobufCBinaryData *bx = x, *by = y;
        eq = bx->len == by->len && (bx->len == 0 || memcmp(bx->data, by->data, bx->len) == 0);
        break;
    }
    case PROTOBUF_C_TYPE_MESSAGE: {
        const ProtobufCMessage *mx = *(const ProtobufCMessage *const *)x;
        const ProtobufCMessage *my = *(const ProtobufCMessage *const *)y;
        if (!mx || !my) {
            eq = mx == my;
            break;
        }
        return message_equal(mx, my, path, pathlen);
    }
    default: /* scalars: bit-exact, floats included (they travel unchanged) */
        eq = memcmp(x, y, field_elem_size(f)) == 0;
        break;
    }
    if (!eq) snprintf(path, pathlen, "field %s (type %d)", f->name, (int)f->type);
    return eq;
}

/* 1 if every field (every set oneof member) of m and its sub-messages holds
 * a non-default value: proves that nothing was dropped on the way. */
static int message_all_set(const ProtobufCMessage *m, char *path, size_t pathlen) {
    const ProtobufCMessageDescriptor *d = m->descriptor;
    const char *b = (const char *)m;
    for (unsigned i = 0; i < d->n_fields; i++) {
        const ProtobufCFieldDescriptor *f = &d->fields[i];
        if ((f->flags & PROTOBUF_C_FIELD_FLAG_ONEOF) &&
            *(const uint32_t *)(b + f->quantifier_offset) != f->id)
            continue;
        size_t n = 1, es = field_elem_size(f);
        const char *arr = b + f->offset;
        if (f->label == PROTOBUF_C_LABEL_REPEATED) {
            n = *(const size_t *)(b + f->quantifier_offset);
            arr = *(const char *const *)(b + f->offset);
        }
        if (n == 0) {
            snprintf(path, pathlen, "%s.%s is empty", d->name, f->name);
            return 0;
        }
        for (size_t k = 0; k < n; k++) {
            const char *p = arr + k * es;
            int set;
            if (f->type == PROTOBUF_C_TYPE_STRING) {
                const char *s = *(const char *const *)p;
                set = s && *s;
            } else if (f->type == PROTOBUF_C_TYPE_BYTES) {
                set = ((const ProtobufCBinaryData *)p)->len > 0;
            } else if (f->type == PROTOBUF_C_TYPE_MESSAGE) {
                const ProtobufCMessage *sub = *(const ProtobufCMessage *const *)p;
                if (!sub) {
                    set = 0;
                } else {
                    if (!message_all_set(sub, path, pathlen)) return 0;
                    set = 1;
                }
            } else {
                static const char zero[8];
                set = memcmp(p, zero, es) != 0;
            }
            if (!set) {
                snprintf(path, pathlen, "%s.%s[%zu] has its default value", d->name, f->name, k);
                return 0;
            }
        }
    }
    return 1;
}

/* Ids of the oneof members of an envelope descriptor. */
static int body_ids(const ProtobufCMessageDescriptor *d, uint32_t *ids, int max) {
    int n = 0;
    for (unsigned i = 0; i < d->n_fields && n < max; i++)
        if (d->fields[i].flags & PROTOBUF_C_FIELD_FLAG_ONEOF) ids[n++] = d->fields[i].id;
    return n;
}

/* Envelope of either kind, filled for body id, packed with the wire helper. */
static int pack_filled(const ProtobufCMessageDescriptor *d, uint32_t id, struct arena *a,
                       ProtobufCMessage **env, uint8_t **buf, size_t *len) {
    uint32_t counter = 0;
    *env = arena_alloc(a, d->sizeof_message);
    d->message_init(*env);
    fill_message(*env, a, &counter, 0, id);
    char err[256] = "";
    int rc = d == &llm__client_envelope__descriptor
                 ? proto_client_pack((Llm__ClientEnvelope *)*env, buf, len, err, sizeof err)
                 : proto_worker_pack((Llm__WorkerEnvelope *)*env, buf, len, err, sizeof err);
    if (rc != 0) printf("  pack %s body %u: %s\n", d->name, id, err);
    return rc;
}

static int unpack_any(const ProtobufCMessageDescriptor *d, const uint8_t *buf, size_t len,
                      ProtobufCMessage **env, char *err, size_t errlen) {
    if (d == &llm__client_envelope__descriptor)
        return proto_client_unpack(buf, len, (Llm__ClientEnvelope **)env, err, errlen);
    return proto_worker_unpack(buf, len, (Llm__WorkerEnvelope **)env, err, errlen);
}

static void free_any(ProtobufCMessage *env) {
    if (env) protobuf_c_message_free_unpacked(env, NULL);
}

static const ProtobufCMessageDescriptor *const envelopes[2] = {
    &llm__client_envelope__descriptor, &llm__worker_envelope__descriptor};

/* ---- Round trips ---------------------------------------------------------- */

TEST(proto_roundtrip_every_body) {
    int n_total = 0;
    for (int e = 0; e < 2; e++) {
        const ProtobufCMessageDescriptor *d = envelopes[e];
        uint32_t ids[64];
        int n = body_ids(d, ids, 64);
        ASSERT_TRUE(n >= 6);
        for (int i = 0; i < n; i++) {
            struct arena a = {0};
            ProtobufCMessage *env, *back = NULL;
            uint8_t *buf = NULL, *buf2 = NULL;
            size_t len, len2;
            char err[256] = "", path[256] = "";
            ASSERT_OK(pack_filled(d, ids[i], &a, &env, &buf, &len));
            int rc = unpack_any(d, buf, len, &back, err, sizeof err);
            if (rc != 0) TEST_FAIL("%s body %u: %s", d->name, ids[i], err);
            if (!message_equal(env, back, path, sizeof path))
                TEST_FAIL("%s body %u differs after the round trip at %s", d->name, ids[i], path);
            if (!message_all_set(back, path, sizeof path))
                TEST_FAIL("%s body %u: %s", d->name, ids[i], path);
            /* Packing what was decoded gives the same bytes. */
            len2 = protobuf_c_message_get_packed_size(back);
            ASSERT_EQ(len, len2);
            buf2 = malloc(len2);
            ASSERT_EQ(len2, protobuf_c_message_pack(back, buf2));
            ASSERT_EQ(0, memcmp(buf, buf2, len));
            free(buf2);
            proto_buf_free(buf, NULL);
            free_any(back);
            arena_free(&a);
            n_total++;
        }
    }
    printf("  %d message types round-tripped\n", n_total);
}

/* Named fields, written by hand, so the generic check above is not the only
 * witness. */
TEST(proto_roundtrip_named_fields) {
    int32_t prompt[3] = {1, 15043, 3186};
    int32_t stops[2] = {2, 13};
    char *stop_strs[1] = {"\n\n"};
    Llm__SamplingParams sp = LLM__SAMPLING_PARAMS__INIT;
    sp.temperature = 0.7f;
    sp.top_k = 40;
    sp.top_p = 0.95f;
    sp.seed = 0x5eed0123cafeULL;
    sp.n_stop_token_ids = 2;
    sp.stop_token_ids = stops;
    Llm__GenerateRequest gr = LLM__GENERATE_REQUEST__INIT;
    gr.request_id = "req-42";
    gr.n_prompt_tokens = 3;
    gr.prompt_tokens = prompt;
    gr.max_tokens = 128;
    gr.sampling = &sp;
    gr.n_stop = 1;
    gr.stop = stop_strs;
    gr.priority = -5;
    gr.deadline_ms = 1700000000123LL;
    gr.stream = 1;
    Llm__ClientEnvelope env = LLM__CLIENT_ENVELOPE__INIT;
    env.tag = 99;
    env.body_case = LLM__CLIENT_ENVELOPE__BODY_GENERATE;
    env.generate = &gr;
    uint8_t *buf;
    size_t len;
    char err[256];
    ASSERT_OK(proto_client_pack(&env, &buf, &len, err, sizeof err));
    ASSERT_EQ(PROTO_VERSION, env.version);
    Llm__ClientEnvelope *back;
    ASSERT_OK(proto_client_unpack(buf, len, &back, err, sizeof err));
    proto_buf_free(buf, NULL);
    ASSERT_EQ(PROTO_VERSION, back->version);
    ASSERT_EQ((uint64_t)99, back->tag);
    ASSERT_EQ((int)LLM__CLIENT_ENVELOPE__BODY_GENERATE, (int)back->body_case);
    Llm__GenerateRequest *g = back->generate;
    ASSERT_STREQ("req-42", g->request_id);
    ASSERT_STREQ("", g->prompt);
    ASSERT_EQ((size_t)3, g->n_prompt_tokens);
    ASSERT_EQ(15043, g->prompt_tokens[1]);
    ASSERT_EQ(128u, g->max_tokens);
    ASSERT_EQ(0.7f, g->sampling->temperature);
    ASSERT_EQ(40, g->sampling->top_k);
    ASSERT_EQ(0.95f, g->sampling->top_p);
    ASSERT_EQ(0.0f, g->sampling->min_p);
    ASSERT_EQ((uint64_t)0x5eed0123cafeULL, g->sampling->seed);
    ASSERT_EQ(13, g->sampling->stop_token_ids[1]);
    ASSERT_STREQ("\n\n", g->stop[0]);
    ASSERT_EQ(-5, g->priority);
    ASSERT_EQ((int64_t)1700000000123LL, g->deadline_ms);
    ASSERT_EQ(1, (int)g->stream);
    proto_client_free(back);

    /* A step plan with a block table, a copy and a freed sequence. */
    uint32_t blocks[3] = {7, 3, 11};
    int32_t toks[1] = {318};
    Llm__SeqPlan sq = LLM__SEQ_PLAN__INIT;
    sq.seq_id = 5;
    sq.n_tokens = 1;
    sq.tokens = toks;
    sq.start_pos = 37;
    sq.n_block_table = 3;
    sq.block_table = blocks;
    sq.want_logits = 1;
    Llm__SeqPlan *sqs[1] = {&sq};
    Llm__BlockCopy cp = LLM__BLOCK_COPY__INIT;
    cp.src = 3;
    cp.dst = 12;
    Llm__BlockCopy *cps[1] = {&cp};
    uint64_t freed[2] = {1, 2};
    Llm__StepPlan plan = LLM__STEP_PLAN__INIT;
    plan.step_id = 1000001;
    plan.pipeline_id = 2;
    plan.n_seqs = 1;
    plan.seqs = sqs;
    plan.n_copies = 1;
    plan.copies = cps;
    plan.n_freed_seqs = 2;
    plan.freed_seqs = freed;
    Llm__WorkerEnvelope wenv = LLM__WORKER_ENVELOPE__INIT;
    wenv.body_case = LLM__WORKER_ENVELOPE__BODY_PLAN;
    wenv.plan = &plan;
    ASSERT_OK(proto_worker_pack(&wenv, &buf, &len, err, sizeof err));
    Llm__WorkerEnvelope *wback;
    ASSERT_OK(proto_worker_unpack(buf, len, &wback, err, sizeof err));
    proto_buf_free(buf, NULL);
    ASSERT_EQ((int)LLM__WORKER_ENVELOPE__BODY_PLAN, (int)wback->body_case);
    Llm__StepPlan *p = wback->plan;
    ASSERT_EQ((uint64_t)1000001, p->step_id);
    ASSERT_EQ((size_t)1, p->n_seqs);
    ASSERT_EQ(37u, p->seqs[0]->start_pos);
    ASSERT_EQ((size_t)3, p->seqs[0]->n_block_table);
    ASSERT_EQ(11u, p->seqs[0]->block_table[2]);
    ASSERT_EQ(318, p->seqs[0]->tokens[0]);
    ASSERT_TRUE(p->seqs[0]->sampling == NULL);
    ASSERT_EQ(12u, p->copies[0]->dst);
    ASSERT_EQ((uint64_t)2, p->freed_seqs[1]);
    proto_worker_free(wback);
}

/* ---- Bad frames ------------------------------------------------------------ */

/* rc must be a failure with nothing to free and a message. */
#define ASSERT_REJECTED(rc, env, err)                                               \
    do {                                                                            \
        if ((rc) >= 0) TEST_FAIL("frame accepted, expected a rejection");          \
        ASSERT_TRUE((env) == NULL);                                                 \
        ASSERT_TRUE((err)[0] != '\0');                                              \
    } while (0)

/* Every strict prefix of a valid frame is refused: the body is the last
 * field of an envelope, so a cut either splits it or removes it. */
TEST(proto_truncated_frames_rejected) {
    uint64_t before = proto_frames_rejected(), expect = 0;
    for (int e = 0; e < 2; e++) {
        const ProtobufCMessageDescriptor *d = envelopes[e];
        uint32_t ids[64];
        int n = body_ids(d, ids, 64);
        for (int i = 0; i < n; i++) {
            struct arena a = {0};
            ProtobufCMessage *env;
            uint8_t *buf;
            size_t len;
            ASSERT_OK(pack_filled(d, ids[i], &a, &env, &buf, &len));
            for (size_t cut = 0; cut < len; cut++) {
                /* A copy of exactly cut bytes, so ASan sees any read past it. */
                uint8_t *part = malloc(cut ? cut : 1);
                memcpy(part, buf, cut);
                ProtobufCMessage *back = (ProtobufCMessage *)1;
                char err[256] = "";
                int rc = unpack_any(d, cut ? part : NULL, cut, &back, err, sizeof err);
                free(part);
                if (rc >= 0) {
                    free_any(back);
                    TEST_FAIL("%s body %u: prefix of %zu/%zu bytes accepted", d->name, ids[i],
                              cut, len);
                }
                ASSERT_REJECTED(rc, back, err);
                ASSERT_TRUE(rc == STATUS_PROTOCOL || rc == STATUS_UNSUPPORTED);
                expect++;
            }
            free(buf);
            arena_free(&a);
        }
    }
    ASSERT_EQ(expect, proto_frames_rejected() - before);
    printf("  %llu truncated frames rejected\n", (unsigned long long)expect);
}

static uint64_t splitmix(uint64_t *s) {
    uint64_t z = (*s += 0x9e3779b97f4a7c15ULL);
    z = (z ^ (z >> 30)) * 0xbf58476d1ce4e5b9ULL;
    z = (z ^ (z >> 27)) * 0x94d049bb133111ebULL;
    return z ^ (z >> 31);
}

/* Decodes buf; an accepted frame must be whole (version and body checked). */
static int fuzz_one(const ProtobufCMessageDescriptor *d, const uint8_t *buf, size_t len) {
    ProtobufCMessage *env = NULL;
    char err[256] = "";
    int rc = unpack_any(d, buf, len, &env, err, sizeof err);
    if (rc < 0) {
        if (env != NULL || err[0] == '\0') return -1;
        return 0;
    }
    uint32_t version = d == &llm__client_envelope__descriptor
                           ? ((Llm__ClientEnvelope *)env)->version
                           : ((Llm__WorkerEnvelope *)env)->version;
    uint32_t body = d == &llm__client_envelope__descriptor
                        ? (uint32_t)((Llm__ClientEnvelope *)env)->body_case
                        : (uint32_t)((Llm__WorkerEnvelope *)env)->body_case;
    free_any(env);
    return version == PROTO_VERSION && body != 0 ? 1 : -1;
}

static void fuzz_with_seed(uint64_t seed, int *accepted, int *total) {
    uint64_t s = seed;
    /* Pure random buffers: mostly garbage at the first byte. */
    for (int i = 0; i < 10000; i++) {
        size_t len = splitmix(&s) % 300;
        uint8_t *b = malloc(len ? len : 1);
        for (size_t k = 0; k < len; k++) b[k] = (uint8_t)splitmix(&s);
        /* Half of them start like a real envelope (version 1), to get past
         * the first field and into the bodies. */
        if (len >= 2 && (i & 1)) {
            b[0] = 0x08;
            b[1] = 0x01;
        }
        int r = fuzz_one(envelopes[i & 2 ? 1 : 0], b, len);
        free(b);
        if (r < 0) TEST_FAIL("seed %llu buffer %d: rejected without a message, or accepted "
                             "with a bad version or no body", (unsigned long long)seed, i);
        *accepted += r;
        (*total)++;
    }
    /* Mutations of valid frames: flipped, inserted and dropped bytes reach
     * deep into nested messages. */
    for (int e = 0; e < 2; e++) {
        const ProtobufCMessageDescriptor *d = envelopes[e];
        uint32_t ids[64];
        int n = body_ids(d, ids, 64);
        for (int i = 0; i < n; i++) {
            struct arena a = {0};
            ProtobufCMessage *env;
            uint8_t *buf;
            size_t len;
            if (pack_filled(d, ids[i], &a, &env, &buf, &len) != 0) TEST_FAIL("pack failed");
            for (int m = 0; m < 400; m++) {
                uint8_t *b = malloc(len + 8);
                size_t blen = len;
                memcpy(b, buf, len);
                int edits = 1 + (int)(splitmix(&s) % 4);
                for (int k = 0; k < edits && blen > 0; k++) {
                    size_t at = splitmix(&s) % blen;
                    switch (splitmix(&s) % 3) {
                    case 0: b[at] ^= (uint8_t)(1u << (splitmix(&s) % 8)); break;
                    case 1: b[at] = (uint8_t)splitmix(&s); break;
                    case 2:
                        memmove(b + at, b + at + 1, blen - at - 1);
                        blen--;
                        break;
                    }
                }
                int r = fuzz_one(d, b, blen);
                free(b);
                if (r < 0) TEST_FAIL("seed %llu: mutated %s body %u: bad rejection or acceptance",
                                     (unsigned long long)seed, d->name, ids[i]);
                *accepted += r;
                (*total)++;
            }
            free(buf);
            arena_free(&a);
        }
    }
}

TEST(proto_random_frames_never_crash) {
    uint64_t seeds[2] = {12345, (uint64_t)time(NULL) ^ ((uint64_t)clock() << 32)};
    for (int i = 0; i < 2; i++) {
        int accepted = 0, total = 0;
        printf("  seed %llu%s\n", (unsigned long long)seeds[i], i ? " (from the clock)" : "");
        fflush(stdout);
        fuzz_with_seed(seeds[i], &accepted, &total);
        printf("  seed %llu: %d frames, %d decoded as whole envelopes\n",
               (unsigned long long)seeds[i], total, accepted);
        ASSERT_TRUE(total > 15000);
    }
}

TEST(proto_oversized_frames_rejected) {
    /* Refused on the length alone: the buffer is never read. */
    uint8_t *big = malloc(PROTO_FRAME_MAX + 1);
    ASSERT_TRUE(big != NULL);
    Llm__ClientEnvelope *env = (Llm__ClientEnvelope *)1;
    char err[256] = "";
    int rc = proto_client_unpack(big, PROTO_FRAME_MAX + 1, &env, err, sizeof err);
    ASSERT_EQ(STATUS_PROTOCOL, rc);
    ASSERT_TRUE(env == NULL);
    ASSERT_TRUE(strstr(err, "67108865") != NULL);
    Llm__WorkerEnvelope *wenv = (Llm__WorkerEnvelope *)1;
    ASSERT_EQ(STATUS_PROTOCOL, proto_worker_unpack(big, PROTO_FRAME_MAX + 1, &wenv, err, sizeof err));
    ASSERT_TRUE(wenv == NULL);

    /* And never packed: a prompt of the whole limit does not fit. */
    memset(big, 'a', PROTO_FRAME_MAX);
    big[PROTO_FRAME_MAX] = 0;
    Llm__GenerateRequest gr = LLM__GENERATE_REQUEST__INIT;
    gr.request_id = "big";
    gr.prompt = (char *)big;
    Llm__ClientEnvelope out = LLM__CLIENT_ENVELOPE__INIT;
    out.body_case = LLM__CLIENT_ENVELOPE__BODY_GENERATE;
    out.generate = &gr;
    uint8_t *buf = (uint8_t *)1;
    size_t len = 1;
    err[0] = 0;
    ASSERT_EQ(STATUS_BAD_INPUT, proto_client_pack(&out, &buf, &len, err, sizeof err));
    ASSERT_TRUE(buf == NULL);
    ASSERT_EQ((size_t)0, len);
    ASSERT_TRUE(strstr(err, "limit") != NULL);
    free(big);
}

/* Packs env with protobuf-c directly, keeping whatever version it has. */
static uint8_t *raw_pack(const ProtobufCMessage *m, size_t *len) {
    *len = protobuf_c_message_get_packed_size(m);
    uint8_t *b = malloc(*len ? *len : 1);
    protobuf_c_message_pack(m, b);
    return b;
}

TEST(proto_wrong_version_rejected) {
    Llm__HealthRequest h = LLM__HEALTH_REQUEST__INIT;
    Llm__Heartbeat hb = LLM__HEARTBEAT__INIT;
    hb.worker_id = "w0";
    uint32_t versions[3] = {0, PROTO_VERSION + 1, 0xffffffffu};
    for (int i = 0; i < 3; i++) {
        Llm__ClientEnvelope env = LLM__CLIENT_ENVELOPE__INIT;
        env.version = versions[i];
        env.body_case = LLM__CLIENT_ENVELOPE__BODY_HEALTH;
        env.health = &h;
        size_t len;
        uint8_t *b = raw_pack(&env.base, &len);
        Llm__ClientEnvelope *back = (Llm__ClientEnvelope *)1;
        char err[256] = "", want[32];
        ASSERT_EQ(STATUS_PROTOCOL, proto_client_unpack(b, len, &back, err, sizeof err));
        ASSERT_TRUE(back == NULL);
        snprintf(want, sizeof want, "version %u ", versions[i]);
        if (!strstr(err, want)) TEST_FAIL("error \"%s\" does not name \"%s\"", err, want);
        free(b);

        Llm__WorkerEnvelope wenv = LLM__WORKER_ENVELOPE__INIT;
        wenv.version = versions[i];
        wenv.body_case = LLM__WORKER_ENVELOPE__BODY_HEARTBEAT;
        wenv.heartbeat = &hb;
        b = raw_pack(&wenv.base, &len);
        Llm__WorkerEnvelope *wback = (Llm__WorkerEnvelope *)1;
        err[0] = 0;
        ASSERT_EQ(STATUS_PROTOCOL, proto_worker_unpack(b, len, &wback, err, sizeof err));
        ASSERT_TRUE(wback == NULL);
        if (!strstr(err, want)) TEST_FAIL("error \"%s\" does not name \"%s\"", err, want);
        free(b);
    }
}

TEST(proto_missing_body_rejected) {
    /* Version only. */
    Llm__ClientEnvelope env = LLM__CLIENT_ENVELOPE__INIT;
    env.version = PROTO_VERSION;
    size_t len;
    uint8_t *b = raw_pack(&env.base, &len);
    Llm__ClientEnvelope *back = (Llm__ClientEnvelope *)1;
    char err[256] = "";
    ASSERT_EQ(STATUS_UNSUPPORTED, proto_client_unpack(b, len, &back, err, sizeof err));
    ASSERT_TRUE(back == NULL);
    ASSERT_TRUE(strstr(err, "no body") != NULL);
    free(b);
    /* A newer peer's body: version 1, then field 99 (length-delimited,
     * 2 bytes) that this build does not know. */
    const uint8_t newer[] = {0x08, 0x01, 0x9a, 0x06, 0x02, 0x08, 0x05};
    back = (Llm__ClientEnvelope *)1;
    ASSERT_EQ(STATUS_UNSUPPORTED, proto_client_unpack(newer, sizeof newer, &back, err, sizeof err));
    ASSERT_TRUE(back == NULL);
    Llm__WorkerEnvelope *wback = (Llm__WorkerEnvelope *)1;
    ASSERT_EQ(STATUS_UNSUPPORTED, proto_worker_unpack(newer, sizeof newer, &wback, err, sizeof err));
    ASSERT_TRUE(wback == NULL);
    /* An empty frame. */
    ASSERT_EQ(STATUS_PROTOCOL, proto_worker_unpack(NULL, 0, &wback, err, sizeof err));
    ASSERT_TRUE(wback == NULL);
    ASSERT_TRUE(strstr(err, "empty") != NULL);
    /* And pack refuses to send one. */
    uint8_t *buf = (uint8_t *)1;
    ASSERT_EQ(STATUS_BAD_INPUT, proto_client_pack(&env, &buf, &len, err, sizeof err));
    ASSERT_TRUE(buf == NULL);
    ASSERT_TRUE(strstr(err, "no body") != NULL);
}

TEST(proto_invalid_utf8_rejected) {
    static const char *const bad[] = {
        "\xc3\x28",         /* continuation missing */
        "\xc0\xaf",         /* overlong '/' */
        "\xed\xa0\x80",     /* surrogate */
        "\xf4\x90\x80\x80", /* above U+10FFFF */
        "ok\xff",           /* never valid */
        "\xe2\x82",         /* cut short */
    };
    static const char *const good[] = {"", "plain", "h\xc3\xa9llo \xe2\x82\xac \xf0\x9f\x98\x80"};
    for (int i = 0; i < (int)(sizeof bad / sizeof bad[0]) + 3; i++) {
        int is_bad = i < (int)(sizeof bad / sizeof bad[0]);
        const char *s = is_bad ? bad[i] : good[i - (int)(sizeof bad / sizeof bad[0])];
        Llm__GenerateRequest gr = LLM__GENERATE_REQUEST__INIT;
        gr.request_id = "r1";
        gr.prompt = (char *)s;
        Llm__ClientEnvelope env = LLM__CLIENT_ENVELOPE__INIT;
        env.body_case = LLM__CLIENT_ENVELOPE__BODY_GENERATE;
        env.generate = &gr;
        uint8_t *buf;
        size_t len;
        char err[256] = "";
        ASSERT_OK(proto_client_pack(&env, &buf, &len, err, sizeof err));
        Llm__ClientEnvelope *back = (Llm__ClientEnvelope *)1;
        int rc = proto_client_unpack(buf, len, &back, err, sizeof err);
        free(buf);
        if (is_bad) {
            ASSERT_EQ(STATUS_PROTOCOL, rc);
            ASSERT_TRUE(back == NULL);
            if (!strstr(err, "llm.GenerateRequest.prompt"))
                TEST_FAIL("error \"%s\" does not name the field", err);
        } else {
            ASSERT_OK(rc);
            ASSERT_STREQ(s, back->generate->prompt);
            proto_client_free(back);
        }
    }
}

TEST(proto_error_reply) {
    uint8_t *buf;
    size_t len;
    ASSERT_OK(proto_client_error_pack(77, LLM__ERROR__CODE__RESOURCE_EXHAUSTED, "req-9",
                                      "queue full: 1000 requests waiting", 250, &buf, &len));
    Llm__ClientEnvelope *env;
    char err[256];
    ASSERT_OK(proto_client_unpack(buf, len, &env, err, sizeof err));
    free(buf);
    ASSERT_EQ((uint64_t)77, env->tag);
    ASSERT_EQ((int)LLM__CLIENT_ENVELOPE__BODY_ERROR, (int)env->body_case);
    ASSERT_EQ((int)LLM__ERROR__CODE__RESOURCE_EXHAUSTED, (int)env->error->code);
    ASSERT_STREQ("req-9", env->error->request_id);
    ASSERT_STREQ("queue full: 1000 requests waiting", env->error->message);
    ASSERT_EQ(250u, env->error->retry_after_ms);
    proto_client_free(env);

    ASSERT_OK(proto_worker_error_pack(LLM__ERROR__CODE__INTERNAL, NULL, NULL, 0, &buf, &len));
    Llm__WorkerEnvelope *wenv;
    ASSERT_OK(proto_worker_unpack(buf, len, &wenv, err, sizeof err));
    free(buf);
    ASSERT_EQ((int)LLM__WORKER_ENVELOPE__BODY_ERROR, (int)wenv->body_case);
    ASSERT_EQ((int)LLM__ERROR__CODE__INTERNAL, (int)wenv->error->code);
    ASSERT_STREQ("", wenv->error->request_id);
    proto_worker_free(wenv);

    /* A message cut inside a character by a length limit ("%.128s" of a
     * peer's text) keeps whole characters: its reader refuses text that is
     * not UTF-8, so the reply would be lost. */
    ASSERT_OK(proto_worker_error_pack(LLM__ERROR__CODE__ALREADY_EXISTS, "", "worker w\xc3\xa9\xc3", 0, &buf, &len));
    ASSERT_OK(proto_worker_unpack(buf, len, &wenv, err, sizeof err));
    free(buf);
    ASSERT_STREQ("worker w\xc3\xa9", wenv->error->message);
    proto_worker_free(wenv);
    ASSERT_OK(proto_client_error_pack(5, LLM__ERROR__CODE__NOT_FOUND, "r", "model \xe2\x82", 0, &buf, &len));
    ASSERT_OK(proto_client_unpack(buf, len, &env, err, sizeof err));
    free(buf);
    ASSERT_STREQ("model ", env->error->message);
    proto_client_free(env);

    /* The reply to a frame that failed to unpack. */
    const uint8_t junk[] = {0xff, 0xff, 0xff};
    int rc = proto_client_unpack(junk, sizeof junk, &env, err, sizeof err);
    ASSERT_EQ(STATUS_PROTOCOL, rc);
    ASSERT_OK(proto_client_error_pack(0, proto_code_from_status(rc), "", err, 0, &buf, &len));
    ASSERT_OK(proto_client_unpack(buf, len, &env, err, sizeof err));
    free(buf);
    ASSERT_EQ((int)LLM__ERROR__CODE__INVALID_ARGUMENT, (int)env->error->code);
    ASSERT_TRUE(strstr(env->error->message, "3 bytes") != NULL);
    proto_client_free(env);
}

TEST(proto_codes_map_both_ways) {
    /* Every status maps to a code that maps back to a status of the same
     * meaning (two pairs fold: PROTOCOL->BAD_INPUT, NO_MEMORY->EXHAUSTED,
     * IO->INTERNAL). */
    static const int statuses[] = {STATUS_OK, STATUS_BAD_INPUT, STATUS_NOT_FOUND,
                                   STATUS_UNSUPPORTED, STATUS_IO, STATUS_NO_MEMORY,
                                   STATUS_PROTOCOL, STATUS_UNAVAILABLE, STATUS_TIMEOUT,
                                   STATUS_CANCELLED, STATUS_EXHAUSTED, STATUS_INTERNAL};
    static const int back[] = {STATUS_OK, STATUS_BAD_INPUT, STATUS_NOT_FOUND,
                               STATUS_UNSUPPORTED, STATUS_INTERNAL, STATUS_EXHAUSTED,
                               STATUS_BAD_INPUT, STATUS_UNAVAILABLE, STATUS_TIMEOUT,
                               STATUS_CANCELLED, STATUS_EXHAUSTED, STATUS_INTERNAL};
    ASSERT_EQ(STATUS_COUNT, (int)(sizeof statuses / sizeof statuses[0]));
    for (int i = 0; i < STATUS_COUNT; i++)
        ASSERT_EQ(back[i], proto_status_from_code(proto_code_from_status(statuses[i])));
    ASSERT_EQ((int)LLM__ERROR__CODE__UNKNOWN, (int)proto_code_from_status(-999));
    ASSERT_EQ((int)LLM__ERROR__CODE__DEADLINE_EXCEEDED, (int)proto_code_from_status(STATUS_TIMEOUT));
    ASSERT_STREQ("INVALID_ARGUMENT", proto_code_name(LLM__ERROR__CODE__INVALID_ARGUMENT));
    ASSERT_STREQ("UNAVAILABLE", proto_code_name(LLM__ERROR__CODE__UNAVAILABLE));
    ASSERT_STREQ("UNKNOWN_CODE", proto_code_name((Llm__Error__Code)77));
    ASSERT_EQ(STATUS_INTERNAL, proto_status_from_code((Llm__Error__Code)77));
}

TEST(proto_request_id_check) {
    char err[128], longid[PROTO_REQUEST_ID_MAX + 2];
    ASSERT_OK(proto_request_id_check("3f2b-9c1e_a.b:c", err, sizeof err));
    memset(longid, 'x', sizeof longid - 1);
    longid[PROTO_REQUEST_ID_MAX] = 0;
    ASSERT_OK(proto_request_id_check(longid, err, sizeof err));
    longid[PROTO_REQUEST_ID_MAX] = 'x';
    longid[PROTO_REQUEST_ID_MAX + 1] = 0;
    ASSERT_EQ(STATUS_BAD_INPUT, proto_request_id_check(longid, err, sizeof err));
    ASSERT_TRUE(strstr(err, "129 bytes") != NULL);
    ASSERT_EQ(STATUS_BAD_INPUT, proto_request_id_check("", err, sizeof err));
    ASSERT_EQ(STATUS_BAD_INPUT, proto_request_id_check(NULL, err, sizeof err));
    ASSERT_EQ(STATUS_BAD_INPUT, proto_request_id_check("a b", err, sizeof err));
    ASSERT_TRUE(strstr(err, "byte 1 is 0x20") != NULL);
    ASSERT_EQ(STATUS_BAD_INPUT, proto_request_id_check("r\xc3\xa9q", err, sizeof err));
}

TEST_MAIN(proto_roundtrip_every_body, proto_roundtrip_named_fields, proto_truncated_frames_rejected,
          proto_random_frames_never_crash, proto_oversized_frames_rejected,
          proto_wrong_version_rejected, proto_missing_body_rejected, proto_invalid_utf8_rejected,
          proto_error_reply, proto_codes_map_both_ways, proto_request_id_check)
