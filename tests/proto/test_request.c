/* Tests of proto/request: GenerateRequest validation names the field and
 * the value for each rule of docs/protocol.md, and SamplingParams converts
 * to the sampler's struct and back without loss. */
#include "proto/request.h"

#include "common/status.h"
#include "proto/wire.h"
#include "tests/test.h"

#define NOW_MS 1700000000000LL

/* A valid request; each test breaks one thing. */
struct req {
    Llm__GenerateRequest g;
    Llm__SamplingParams sp;
    int32_t toks[3];
    char *stops[PROTO_STOP_STRINGS_MAX + 1];
};

static void req_init(struct req *r) {
    llm__generate_request__init(&r->g);
    llm__sampling_params__init(&r->sp);
    r->toks[0] = 1;
    r->toks[1] = 50;
    r->toks[2] = 999;
    r->g.request_id = "req-1";
    r->g.n_prompt_tokens = 3;
    r->g.prompt_tokens = r->toks;
    r->g.max_tokens = 16;
    r->g.sampling = &r->sp;
    r->sp.temperature = 0.8f;
    r->sp.top_p = 0.9f;
    for (int i = 0; i <= PROTO_STOP_STRINGS_MAX; i++) r->stops[i] = "###";
    r->g.stop = r->stops;
    r->g.n_stop = 2;
}

/* Validates r and expects rc with text in the message. */
#define EXPECT_REFUSED(r, rc, text)                                                    \
    do {                                                                               \
        char m_[256] = "";                                                             \
        ASSERT_EQ((rc), proto_generate_validate(&(r).g, 1000, NOW_MS, m_, sizeof m_)); \
        if (!strstr(m_, (text))) TEST_FAIL("message \"%s\" lacks \"%s\"", m_, (text)); \
    } while (0)

TEST(request_valid_passes) {
    struct req r;
    req_init(&r);
    char err[256] = "";
    ASSERT_OK(proto_generate_validate(&r.g, 1000, NOW_MS, err, sizeof err));
    /* Text instead of ids; no sampling message at all (greedy). */
    r.g.n_prompt_tokens = 0;
    r.g.prompt = "Once upon a time";
    r.g.sampling = NULL;
    r.g.deadline_ms = NOW_MS + 1;
    r.g.priority = PROTO_PRIORITY_MIN;
    ASSERT_OK(proto_generate_validate(&r.g, 1000, NOW_MS, err, sizeof err));
}

/* An empty prompt is the start of a document (BOS alone once the router
 * tokenizes it).  proto3 cannot tell it from an absent prompt: after the
 * wire both are "", and both are accepted. */
TEST(request_empty_prompt_passes) {
    struct req r;
    req_init(&r);
    char err[256] = "";
    r.g.n_prompt_tokens = 0;
    r.g.prompt = "";
    ASSERT_OK(proto_generate_validate(&r.g, 1000, NOW_MS, err, sizeof err));
    r.g.prompt = NULL;
    ASSERT_OK(proto_generate_validate(&r.g, 1000, NOW_MS, err, sizeof err));
    /* Through the wire: nothing of the prompt is sent, "" comes back. */
    r.g.prompt = "";
    size_t len = llm__generate_request__get_packed_size(&r.g);
    uint8_t *buf = malloc(len + 1);
    ASSERT_TRUE(buf != NULL);
    llm__generate_request__pack(&r.g, buf);
    Llm__GenerateRequest *back = llm__generate_request__unpack(NULL, len, buf);
    free(buf);
    ASSERT_TRUE(back != NULL);
    ASSERT_STREQ("", back->prompt);
    ASSERT_EQ((size_t)0, back->n_prompt_tokens);
    ASSERT_OK(proto_generate_validate(back, 1000, NOW_MS, err, sizeof err));
    llm__generate_request__free_unpacked(back, NULL);
    /* An empty text beside ids is no conflict: the ids are the prompt. */
    req_init(&r);
    r.g.prompt = "";
    ASSERT_OK(proto_generate_validate(&r.g, 1000, NOW_MS, err, sizeof err));
}

TEST(request_invalid_fields_named) {
    struct req r;
    req_init(&r);
    r.g.request_id = "";
    EXPECT_REFUSED(r, STATUS_BAD_INPUT, "request_id has 0 bytes");
    req_init(&r);
    r.g.request_id = "has space";
    EXPECT_REFUSED(r, STATUS_BAD_INPUT, "request_id byte 3 is 0x20");
    req_init(&r);
    r.g.prompt = "text too";
    EXPECT_REFUSED(r, STATUS_BAD_INPUT, "both set");
    req_init(&r);
    r.toks[2] = 1000;
    EXPECT_REFUSED(r, STATUS_BAD_INPUT, "prompt_tokens[2] = 1000 is outside the vocabulary [0, 1000)");
    req_init(&r);
    r.toks[0] = -4;
    EXPECT_REFUSED(r, STATUS_BAD_INPUT, "prompt_tokens[0] = -4");
    req_init(&r);
    r.g.n_stop = PROTO_STOP_STRINGS_MAX + 1;
    EXPECT_REFUSED(r, STATUS_BAD_INPUT, "stop has 17 strings");
    req_init(&r);
    r.stops[1] = "";
    EXPECT_REFUSED(r, STATUS_BAD_INPUT, "stop[1] has 0 bytes");
    req_init(&r);
    r.g.priority = 101;
    EXPECT_REFUSED(r, STATUS_BAD_INPUT, "priority = 101 is outside [-100, 100]");
    req_init(&r);
    r.g.deadline_ms = -5;
    EXPECT_REFUSED(r, STATUS_BAD_INPUT, "deadline_ms = -5");
    req_init(&r);
    r.g.deadline_ms = NOW_MS - 250;
    EXPECT_REFUSED(r, STATUS_TIMEOUT, "passed 250 ms ago");
    req_init(&r);
    r.sp.top_p = 1.5f;
    EXPECT_REFUSED(r, STATUS_BAD_INPUT, "request req-1: sampling.top_p = 1.5 is outside [0, 1]");
    req_init(&r);
    r.sp.temperature = -0.5f;
    EXPECT_REFUSED(r, STATUS_BAD_INPUT, "sampling.temperature = -0.5");
    req_init(&r);
    int32_t many[SAMPLING_STOP_IDS_MAX + 1] = {0};
    r.sp.stop_token_ids = many;
    r.sp.n_stop_token_ids = SAMPLING_STOP_IDS_MAX + 1;
    EXPECT_REFUSED(r, STATUS_BAD_INPUT, "sampling.stop_token_ids has 33 entries");
    req_init(&r);
    int32_t stop_ids[1] = {5000};
    r.sp.stop_token_ids = stop_ids;
    r.sp.n_stop_token_ids = 1;
    EXPECT_REFUSED(r, STATUS_BAD_INPUT, "sampling.stop_token_ids[0] = 5000");
    /* The router answers with these codes. */
    ASSERT_EQ((int)LLM__ERROR__CODE__INVALID_ARGUMENT, (int)proto_code_from_status(STATUS_BAD_INPUT));
    ASSERT_EQ((int)LLM__ERROR__CODE__DEADLINE_EXCEEDED, (int)proto_code_from_status(STATUS_TIMEOUT));
}

TEST(request_sampling_converts_both_ways) {
    int32_t stops[3] = {2, 7, 11};
    Llm__SamplingParams m = LLM__SAMPLING_PARAMS__INIT;
    m.temperature = 0.7f;
    m.top_k = 40;
    m.top_p = 0.95f;
    m.min_p = 0.05f;
    m.repetition_penalty = 1.1f;
    m.presence_penalty = 0.5f;
    m.frequency_penalty = -0.25f;
    m.penalty_last_n = 64;
    m.seed = 0x123456789abcULL;
    m.n_stop_token_ids = 3;
    m.stop_token_ids = stops;
    m.ignore_eos = 1;
    m.logprobs = 1;
    m.top_logprobs = 5;
    struct sampling_params p;
    char err[128];
    ASSERT_OK(proto_sampling_from_msg(&m, &p, err, sizeof err));
    ASSERT_EQ(0.7f, p.temperature);
    ASSERT_EQ(40, p.top_k);
    ASSERT_EQ(0.05f, p.min_p);
    ASSERT_EQ(-0.25f, p.frequency_penalty);
    ASSERT_EQ(64, p.penalty_last_n);
    ASSERT_EQ((uint64_t)0x123456789abcULL, p.seed);
    ASSERT_EQ(3, p.n_stop_token_ids);
    ASSERT_EQ(11, p.stop_token_ids[2]);
    ASSERT_EQ(1, p.ignore_eos);
    ASSERT_EQ(5, p.top_logprobs);
    /* Back to the wire, packed and unpacked inside a plan: unchanged. */
    Llm__SamplingParams m2;
    proto_sampling_to_msg(&p, &m2);
    size_t n = llm__sampling_params__get_packed_size(&m), n2 = llm__sampling_params__get_packed_size(&m2);
    ASSERT_EQ(n, n2);
    uint8_t b1[256], b2[256];
    ASSERT_TRUE(n <= sizeof b1);
    llm__sampling_params__pack(&m, b1);
    llm__sampling_params__pack(&m2, b2);
    ASSERT_EQ(0, memcmp(b1, b2, n));
    /* NULL is the defaults (greedy). */
    ASSERT_OK(proto_sampling_from_msg(NULL, &p, err, sizeof err));
    ASSERT_EQ(0.0f, p.temperature);
    ASSERT_EQ(0, p.n_stop_token_ids);
}

/* Constraints compile at the router: errors name line and column (GBNF)
 * or keyword and place (schema); one that compiles passes, unless stops
 * come with it (they could end the output inside the grammar).  n > 1 is
 * refused as not served yet. */
TEST(request_constraints_checked) {
    struct req r;
    req_init(&r);
    r.g.n_stop = 0;
    r.sp.constraint_case = LLM__SAMPLING_PARAMS__CONSTRAINT_GRAMMAR;
    r.sp.grammar = "root ::= item+\nitem ::= \"a\" missing\n";
    EXPECT_REFUSED(r, STATUS_BAD_INPUT,
                   "request req-1: sampling.grammar: line 2, column 14: undefined rule 'missing'");
    r.sp.grammar = "root ::= [a-z\n";
    EXPECT_REFUSED(r, STATUS_BAD_INPUT, "sampling.grammar: line 1, column 10: unterminated "
                   "character class");
    r.sp.grammar = "root ::= \"yes\" | \"no\"\n";
    char err[256] = "";
    ASSERT_OK(proto_generate_validate(&r.g, 1000, NOW_MS, err, sizeof err));
    /* a stop could end the output inside the grammar */
    int32_t stop_id = 7;
    r.sp.n_stop_token_ids = 1;
    r.sp.stop_token_ids = &stop_id;
    EXPECT_REFUSED(r, STATUS_UNSUPPORTED, "request req-1: sampling.stop_token_ids with "
                   "sampling.grammar is not supported: a stop could cut the output short of the "
                   "grammar");
    r.sp.n_stop_token_ids = 0;
    r.sp.stop_token_ids = NULL;
    r.sp.constraint_case = LLM__SAMPLING_PARAMS__CONSTRAINT_JSON_SCHEMA;
    r.sp.json_schema = "{\"type\":\"object\",\"properties\":{\"age\":{\"type\":\"integer\","
                       "\"minimum\":0}}}";
    EXPECT_REFUSED(r, STATUS_BAD_INPUT, "sampling.json_schema: json schema /properties/age: "
                   "keyword 'minimum' is not supported");
    r.sp.json_schema = "{\"type\":\"object\"";
    EXPECT_REFUSED(r, STATUS_BAD_INPUT, "sampling.json_schema: json schema: not valid JSON");
    r.sp.json_schema = "{\"type\":\"object\",\"properties\":{\"a\":{\"enum\":[1,2]}}}";
    ASSERT_OK(proto_generate_validate(&r.g, 1000, NOW_MS, err, sizeof err));
    r.sp.constraint_case = LLM__SAMPLING_PARAMS__CONSTRAINT_JSON_OBJECT;
    r.sp.json_object = 1;
    ASSERT_OK(proto_generate_validate(&r.g, 1000, NOW_MS, err, sizeof err));
    r.g.n_stop = 2;
    EXPECT_REFUSED(r, STATUS_UNSUPPORTED, "request req-1: stop with sampling.json_object is not "
                   "supported: a stop could cut the output short of the JSON text");
    r.g.n_stop = 0;
    r.sp.json_object = 0; /* false: no constraint */
    ASSERT_OK(proto_generate_validate(&r.g, 1000, NOW_MS, err, sizeof err));
    r.sp.constraint_case = LLM__SAMPLING_PARAMS__CONSTRAINT__NOT_SET;
    r.g.n = 1;
    ASSERT_OK(proto_generate_validate(&r.g, 1000, NOW_MS, err, sizeof err));
    r.g.n = 4;
    ASSERT_OK(proto_generate_validate(&r.g, 1000, NOW_MS, err, sizeof err));
    r.g.n = PROTO_N_MAX + 1;
    EXPECT_REFUSED(r, STATUS_BAD_INPUT, "request req-1: n = 17 is more than 16");
}

/* Choice 0 keeps the request's seed; the others differ from it and from
 * each other, and never are 0 (a seed the router would replace). */
TEST(request_choice_seeds) {
    ASSERT_EQ((uint64_t)42, proto_choice_seed(42, 0));
    uint64_t seen[PROTO_N_MAX];
    for (uint32_t i = 0; i < PROTO_N_MAX; i++) {
        seen[i] = proto_choice_seed(42, i);
        ASSERT_TRUE(seen[i] != 0);
        for (uint32_t k = 0; k < i; k++) ASSERT_TRUE(seen[k] != seen[i]);
    }
    ASSERT_EQ(seen[3], proto_choice_seed(42, 3)); /* a function of (seed, i) only */
    ASSERT_TRUE(proto_choice_seed(43, 1) != seen[1]);
}

/* A prediction up to PROTO_PREDICTION_BYTES_MAX bytes passes; one byte
 * more is refused naming the field and its size. */
TEST(request_prediction_bounded) {
    struct req r;
    req_init(&r);
    char *big = malloc(PROTO_PREDICTION_BYTES_MAX + 2);
    ASSERT_TRUE(big != NULL);
    memset(big, 'x', PROTO_PREDICTION_BYTES_MAX + 1);
    big[PROTO_PREDICTION_BYTES_MAX] = 0;
    r.g.prediction = big;
    char err[256] = "";
    ASSERT_OK(proto_generate_validate(&r.g, 1000, NOW_MS, err, sizeof err));
    big[PROTO_PREDICTION_BYTES_MAX] = 'x';
    big[PROTO_PREDICTION_BYTES_MAX + 1] = 0;
    EXPECT_REFUSED(r, STATUS_BAD_INPUT, "request req-1: prediction has 262145 bytes, at most 262144");
    free(big);
    /* As ids: inside the vocabulary, and not with the text. */
    int32_t ids[3] = {5, 999, 7};
    r.g.prediction = "";
    r.g.prediction_tokens = ids;
    r.g.n_prediction_tokens = 3;
    ASSERT_OK(proto_generate_validate(&r.g, 1000, NOW_MS, err, sizeof err));
    ids[1] = 1000;
    EXPECT_REFUSED(r, STATUS_BAD_INPUT, "prediction_tokens[1] = 1000 is outside the vocabulary [0, 1000)");
    ids[1] = 3;
    r.g.prediction = "x";
    EXPECT_REFUSED(r, STATUS_BAD_INPUT, "prediction (1 bytes) and prediction_tokens (3 ids) are both set");
}

TEST_MAIN(request_valid_passes, request_prediction_bounded, request_constraints_checked, request_empty_prompt_passes, request_invalid_fields_named,
          request_sampling_converts_both_ways, request_choice_seeds)
