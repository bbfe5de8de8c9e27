/* Tests of a client re-attaching to a request the router runs
 * (router/server*.c in-process, tests/router/router_server_fixture.h): the
 * stream moves to the new connection, a different body under the same id is
 * refused, a cancel ends both streams and frees the sequence on the worker,
 * a replay after a stale re-attach keeps every token's text, and a
 * re-attach in the turn its request ends still replays every token. */
#include "tests/router/router_server_fixture.h"

#include "common/tokenizer.h"

TEST(router_server_reattach_and_cancel) {
    struct fx f;
    fx_start(&f, 2000, 100);
    struct fw w;
    fw_open(&f, &w, "w1");
    struct zio_sock *c1 = cl_open(&f), *c2 = cl_open(&f);
    cl_generate(c1, 1, "ra-1", prompt3, 3, 10, 0);
    proto_client_free(cl_expect(c1, LLM__CLIENT_ENVELOPE__BODY_ACCEPTED));
    uint64_t seq_id = 0;
    for (int k = 0; k < 2; k++) {
        Llm__WorkerEnvelope *pe = fw_plan(&w);
        seq_id = pe->plan->seqs[0]->seq_id;
        fw_answer(&w, pe->plan, 200 + k);
        proto_worker_free(pe);
    }
    Llm__WorkerEnvelope *held = fw_plan(&w); /* the third step, not answered yet */
    /* Another connection re-attaches, having one token. */
    cl_generate(c2, 2, "ra-1", prompt3, 3, 10, 1);
    Llm__ClientEnvelope *e = cl_expect(c2, LLM__CLIENT_ENVELOPE__BODY_ACCEPTED);
    ASSERT_TRUE(e->accepted->reattached);
    proto_client_free(e);
    e = cl_expect(c2, LLM__CLIENT_ENVELOPE__BODY_CHUNK);
    ASSERT_EQ(1u, e->chunk->index);
    ASSERT_EQ((size_t)1, e->chunk->n_token_ids);
    ASSERT_EQ(201, e->chunk->token_ids[0]);
    proto_client_free(e);
    /* The stream now goes to the new connection. */
    fw_answer(&w, held->plan, 202);
    proto_worker_free(held);
    e = cl_expect(c2, LLM__CLIENT_ENVELOPE__BODY_CHUNK);
    ASSERT_EQ(2u, e->chunk->index);
    proto_client_free(e);
    /* A different body under the same id is refused. */
    cl_generate(c2, 3, "ra-1", prompt3, 3, 11, 0);
    cl_expect_error(c2, LLM__ERROR__CODE__ALREADY_EXISTS, NULL);
    /* Cancel from the first connection: both get the end. */
    Llm__Cancel cc = LLM__CANCEL__INIT;
    cc.request_id = "ra-1";
    Llm__ClientEnvelope cancel = LLM__CLIENT_ENVELOPE__INIT;
    cancel.body_case = LLM__CLIENT_ENVELOPE__BODY_CANCEL;
    cancel.cancel = &cc;
    cl_send(c1, &cancel);
    for (int i = 0; i < 2; i++) {
        struct zio_sock *c = i ? c2 : c1;
        for (;;) {
            e = cl_recv(c, 3000);
            ASSERT_TRUE(e != NULL);
            if (e->body_case == LLM__CLIENT_ENVELOPE__BODY_DONE) break;
            proto_client_free(e);
        }
        ASSERT_EQ((int)LLM__GENERATE_DONE__FINISH_REASON__CANCELLED, (int)e->done->finish_reason);
        proto_client_free(e);
    }
    /* With no step after it, a plan of frees only tells the worker to free
     * the cancelled sequence (docs/worker.md, "KV view"). */
    Llm__WorkerEnvelope *before = fw_plan(&w); /* planned before the cancel */
    fw_answer(&w, before->plan, 203);          /* its result is ignored */
    proto_worker_free(before);
    Llm__WorkerEnvelope *pe = NULL;
    for (int i = 0; i < 10 && !pe; i++) {
        pe = fw_recv(&w, 3000);
        ASSERT_TRUE(pe != NULL);
        if (pe->body_case != LLM__WORKER_ENVELOPE__BODY_PLAN) {
            proto_worker_free(pe);
            pe = NULL;
        }
    }
    ASSERT_TRUE(pe != NULL);
    ASSERT_EQ((size_t)0, pe->plan->n_seqs);
    ASSERT_EQ((size_t)1, pe->plan->n_freed_seqs);
    ASSERT_EQ(seq_id, pe->plan->freed_seqs[0]);
    proto_worker_free(pe);
    cl_generate(c1, 4, "ra-2", prompt3, 3, 2, 0);
    proto_client_free(cl_expect(c1, LLM__CLIENT_ENVELOPE__BODY_ACCEPTED));
    pe = fw_plan(&w);
    ASSERT_EQ((size_t)0, pe->plan->n_freed_seqs);
    proto_worker_free(pe);
    zio_sock_close(c1);
    zio_sock_close(c2);
    fw_close(&w);
    fx_stop(&f);
}

/* The text a client builds from a stream as clients/c does: a chunk that
 * ends at or before what it has is a duplicate; one that starts past it is
 * a gap; one that starts before it and ends after it (a replay straddling
 * its count) cannot be split by text, so the client would keep its new
 * tokens and lose their text. */
struct tc_client {
    uint32_t have;
    char text[256];
    size_t len;
};

static void tc_take(struct tc_client *t, const Llm__GenerateChunk *ch) {
    uint32_t end = ch->index + (uint32_t)ch->n_token_ids;
    if (end <= t->have) return;
    if (ch->index > t->have) TEST_FAIL("chunk at token %u, but the client has %u (a gap)", ch->index, t->have);
    if (ch->index < t->have)
        TEST_FAIL("chunk of tokens %u..%u (text \"%s\") straddles the %u tokens the client has: their text "
                  "cannot be split, the client loses that of tokens %u..%u", ch->index, end, ch->text, t->have,
                  t->have, end);
    size_t n = strlen(ch->text);
    if (t->len + n >= sizeof t->text) TEST_FAIL("text longer than %zu bytes", sizeof t->text);
    memcpy(t->text + t->len, ch->text, n + 1);
    t->len += n;
    t->have = end;
}

/* A client that re-attached twice from one position (two gaps came before
 * the first replay) is answered the second time after it got the tokens
 * streamed since: the second replay must not put those and a token not
 * streamed yet in one chunk, or that token's text (here " p" of " the
 * park", SentencePiece pieces whose spaces start the next token) is lost
 * though its id arrives.  Stopping Redis holds the router in its token
 * store for a moment, so that a result and the re-attach are handled in
 * one turn, the result first, as under load. */
TEST(router_server_reattach_replay_keeps_the_text) {
    static const char *const pieces[] = {"\xe2\x96\x81the", "\xe2\x96\x81p", "ar", "k", "."};
    int32_t toks[5];
    tokenizer *tok = NULL;
    char err[256];
    ASSERT_OK(tokenizer_load(&tok, test_model_path("stories260K-f32.gguf"), err, sizeof err));
    for (int i = 0; i < 5; i++) {
        toks[i] = tokenizer_token_find(tok, pieces[i], strlen(pieces[i]));
        if (toks[i] < 0) TEST_FAIL("stories260K has no token \"%s\"", pieces[i]);
    }
    tokenizer_free(tok);
    struct fx f;
    fx_start(&f, 2000, 100);
    struct fw w;
    fw_open(&f, &w, "w1");
    struct zio_sock *c = cl_open(&f);
    struct tc_client t = {0};
    cl_generate(c, 1, "rt-1", prompt3, 3, 5, 0);
    proto_client_free(cl_expect(c, LLM__CLIENT_ENVELOPE__BODY_ACCEPTED));
    Llm__WorkerEnvelope *pe = fw_plan(&w);
    fw_answer(&w, pe->plan, toks[0]);
    proto_worker_free(pe);
    Llm__ClientEnvelope *e = cl_expect(c, LLM__CLIENT_ENVELOPE__BODY_CHUNK);
    tc_take(&t, e->chunk);
    proto_client_free(e);
    ASSERT_EQ(1u, t.have);
    ASSERT_EQ(0, kill(f.r.pid, SIGSTOP));
    /* Token 1: the router plans step 3 and blocks storing the token, so
     * its chunk goes out only once Redis is back. */
    pe = fw_plan(&w);
    fw_answer(&w, pe->plan, toks[1]);
    proto_worker_free(pe);
    pe = fw_plan(&w);
    fw_answer(&w, pe->plan, toks[2]); /* token 2, not streamed before the re-attach is handled */
    proto_worker_free(pe);
    cl_generate(c, 2, "rt-1", prompt3, 3, 5, t.have); /* the client has 1 token: stale once token 1 comes */
    usleep(100 * 1000);
    ASSERT_EQ(0, kill(f.r.pid, SIGCONT));
    int next = 3; /* the next token the worker answers */
    for (;;) {
        e = cl_recv(c, 3000);
        if (!e) TEST_FAIL("no chunk or done (the client has %u tokens, text \"%s\")", t.have, t.text);
        if (e->body_case == LLM__CLIENT_ENVELOPE__BODY_DONE) {
            proto_client_free(e);
            break;
        }
        if (e->body_case == LLM__CLIENT_ENVELOPE__BODY_CHUNK) tc_take(&t, e->chunk);
        else if (e->body_case != LLM__CLIENT_ENVELOPE__BODY_ACCEPTED) TEST_FAIL("unexpected body %d", (int)e->body_case);
        proto_client_free(e);
        if (next < 5 && t.have == (uint32_t)next) {
            pe = fw_plan(&w);
            fw_answer(&w, pe->plan, toks[next++]);
            proto_worker_free(pe);
        }
    }
    ASSERT_EQ(5u, t.have);
    ASSERT_STREQ(" the park.", t.text);
    zio_sock_close(c);
    fw_close(&w);
    fx_stop(&f);
}

/* A client that re-attaches from another connection in the turn its
 * request ends (the last token's result and the re-attach handled in one
 * turn, the result first: Redis stopped holds the router in its token
 * store meanwhile, as in the test above) gets every token: those streamed
 * to the earlier connection are replayed before the last chunk and the
 * GenerateDone go out. */
TEST(router_server_reattach_as_it_ends) {
    struct fx f;
    fx_start(&f, 2000, 100);
    struct fw w;
    fw_open(&f, &w, "w1");
    struct zio_sock *c1 = cl_open(&f), *c2 = cl_open(&f);
    cl_generate(c1, 1, "re-1", prompt3, 3, 3, 0);
    proto_client_free(cl_expect(c1, LLM__CLIENT_ENVELOPE__BODY_ACCEPTED));
    Llm__WorkerEnvelope *pe = fw_plan(&w);
    fw_answer(&w, pe->plan, 300);
    proto_worker_free(pe);
    proto_client_free(cl_expect(c1, LLM__CLIENT_ENVELOPE__BODY_CHUNK));
    ASSERT_EQ(0, kill(f.r.pid, SIGSTOP));
    pe = fw_plan(&w);
    fw_answer(&w, pe->plan, 301); /* streamed to c1 once Redis is back */
    proto_worker_free(pe);
    pe = fw_plan(&w);
    fw_answer(&w, pe->plan, 302); /* the last token: handled with the re-attach */
    proto_worker_free(pe);
    cl_generate(c2, 2, "re-1", prompt3, 3, 3, 0);
    usleep(100 * 1000);
    ASSERT_EQ(0, kill(f.r.pid, SIGCONT));
    struct tc_client t = {0};
    int32_t ids[3] = {0};
    for (;;) {
        Llm__ClientEnvelope *e = cl_recv(c2, 3000);
        if (!e) TEST_FAIL("no chunk or done on the re-attached connection (it has %u tokens)", t.have);
        if (e->body_case == LLM__CLIENT_ENVELOPE__BODY_DONE) {
            ASSERT_EQ(3u, e->done->usage->completion_tokens);
            proto_client_free(e);
            break;
        }
        if (e->body_case == LLM__CLIENT_ENVELOPE__BODY_CHUNK) {
            for (size_t i = 0; i < e->chunk->n_token_ids; i++)
                if (e->chunk->index + i < 3) ids[e->chunk->index + i] = e->chunk->token_ids[i];
            tc_take(&t, e->chunk);
        } else if (e->body_case != LLM__CLIENT_ENVELOPE__BODY_ACCEPTED) {
            TEST_FAIL("unexpected body %d", (int)e->body_case);
        }
        proto_client_free(e);
    }
    ASSERT_EQ(3u, t.have);
    for (int i = 0; i < 3; i++) ASSERT_EQ(300 + i, ids[i]);
    zio_sock_close(c1);
    zio_sock_close(c2);
    fw_close(&w);
    fx_stop(&f);
}

TEST_MAIN(router_server_reattach_and_cancel, router_server_reattach_replay_keeps_the_text,
          router_server_reattach_as_it_ends)
