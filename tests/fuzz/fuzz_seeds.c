/* Writes the binary seeds of the fuzzers, which are not kept in git:
 * packed client and worker envelopes of every kind a process receives,
 * small GGUF files (a llama model with a SentencePiece vocabulary that
 * model_file_open accepts, a GPT-2 vocabulary with merges, every value
 * type) and the tiny safetensors model.  Built from the project's own
 * writers, so the seeds follow the formats as the code reads them.
 *   fuzz_seeds OUTDIR   ->  OUTDIR/{client_frame,worker_frame,gguf,safetensors}/...
 */
#include <errno.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>

#include "common/gguf.h"
#include "proto/wire.h"
#include "tests/fuzz/fuzz_util.h"

static const char *outdir;

static void put(const char *sub, const char *name, const void *data, size_t n) {
    char p[2048];
    snprintf(p, sizeof p, "%s/%s", outdir, sub);
    if (mkdir(p, 0777) != 0 && errno != EEXIST) fuzz_fail("mkdir %s: %s", p, strerror(errno));
    snprintf(p, sizeof p, "%s/%s/%s", outdir, sub, name);
    FILE *fp = fopen(p, "wb");
    if (!fp || fwrite(data, 1, n, fp) != n || fclose(fp) != 0) fuzz_fail("cannot write %s", p);
}

static void put_client(const char *name, Llm__ClientEnvelope *env) {
    uint8_t *buf;
    size_t n;
    char err[256];
    if (proto_client_pack(env, &buf, &n, err, sizeof err) < 0) fuzz_fail("%s: %s", name, err);
    put("client_frame", name, buf, n);
    free(buf);
}

static void put_worker(const char *name, Llm__WorkerEnvelope *env) {
    uint8_t *buf;
    size_t n;
    char err[256];
    if (proto_worker_pack(env, &buf, &n, err, sizeof err) < 0) fuzz_fail("%s: %s", name, err);
    put("worker_frame", name, buf, n);
    free(buf);
}

static void client_frames(void) {
    Llm__ClientEnvelope env = LLM__CLIENT_ENVELOPE__INIT;
    Llm__GenerateRequest g = LLM__GENERATE_REQUEST__INIT;
    Llm__SamplingParams sp = LLM__SAMPLING_PARAMS__INIT;
    int32_t stop_ids[] = {2, 13};
    char *stops[] = {"\n\n", "END"};
    g.request_id = "req-1";
    g.model = "stories260K";
    g.prompt = "Once upon a time";
    g.max_tokens = 16;
    sp.temperature = 0.8f;
    sp.top_k = 40;
    sp.top_p = 0.95f;
    sp.min_p = 0.05f;
    sp.repetition_penalty = 1.1f;
    sp.presence_penalty = 0.5f;
    sp.frequency_penalty = -0.5f;
    sp.penalty_last_n = 64;
    sp.seed = 42;
    sp.n_stop_token_ids = 2;
    sp.stop_token_ids = stop_ids;
    sp.logprobs = 1;
    sp.top_logprobs = 3;
    g.sampling = &sp;
    g.n_stop = 2;
    g.stop = stops;
    g.priority = 5;
    g.deadline_ms = 4102444800000LL; /* 2100 */
    g.timeout_ms = 30000;
    g.stream = 1;
    env.tag = 7;
    env.body_case = LLM__CLIENT_ENVELOPE__BODY_GENERATE;
    env.generate = &g;
    put_client("generate_text", &env);

    int32_t toks[] = {1, 400, 259, 31999};
    g.prompt = "";
    g.n_prompt_tokens = 4;
    g.prompt_tokens = toks;
    g.sampling = NULL;
    g.n_stop = 0;
    put_client("generate_tokens", &env);

    Llm__Cancel c = LLM__CANCEL__INIT;
    c.request_id = "req-1";
    env.body_case = LLM__CLIENT_ENVELOPE__BODY_CANCEL;
    env.cancel = &c;
    put_client("cancel", &env);

    Llm__HealthRequest h = LLM__HEALTH_REQUEST__INIT;
    env.body_case = LLM__CLIENT_ENVELOPE__BODY_HEALTH;
    env.health = &h;
    put_client("health", &env);
    Llm__StatusRequest s = LLM__STATUS_REQUEST__INIT;
    env.body_case = LLM__CLIENT_ENVELOPE__BODY_STATUS;
    env.status = &s;
    put_client("status", &env);
    Llm__ModelsRequest m = LLM__MODELS_REQUEST__INIT;
    env.body_case = LLM__CLIENT_ENVELOPE__BODY_MODELS;
    env.models = &m;
    put_client("models", &env);
    uint32_t drain_ids[] = {0, 3};
    Llm__DrainRequest dr = LLM__DRAIN_REQUEST__INIT;
    dr.pipeline_ids = drain_ids;
    dr.n_pipeline_ids = 2;
    env.body_case = LLM__CLIENT_ENVELOPE__BODY_DRAIN;
    env.drain = &dr;
    put_client("drain", &env);

    uint8_t *buf;
    size_t n;
    if (proto_client_error_pack(3, LLM__ERROR__CODE__INVALID_ARGUMENT, "req-1", "bad \xc3\xa9", 100, &buf, &n) < 0)
        fuzz_fail("client error");
    put("client_frame", "error", buf, n);
    free(buf);
}

static void worker_frames(void) {
    Llm__WorkerEnvelope env = LLM__WORKER_ENVELOPE__INIT;
    Llm__Register r = LLM__REGISTER__INIT;
    r.worker_id = "worker-p0-s0";
    r.incarnation = 1735689600000000ULL;
    r.stage_count = 2;
    r.layer_end = 3;
    r.model = "stories260K-f32.gguf";
    r.backend = "cpu";
    r.device = "cpu x2";
    r.kv_block_count = 64;
    r.kv_block_size = 16;
    r.stage_endpoint = "tcp://127.0.0.1:5601";
    r.host = "localhost";
    r.pid = 1234;
    r.max_step_tokens = 512;
    r.max_step_seqs = 16;
    env.body_case = LLM__WORKER_ENVELOPE__BODY_REGISTER;
    env.register_ = &r;
    put_worker("register", &env);

    Llm__Heartbeat hb = LLM__HEARTBEAT__INIT;
    hb.worker_id = "worker-p0-s0";
    hb.incarnation = 1;
    hb.state = LLM__HEARTBEAT__STATE__READY;
    hb.time_ms = 1735689600000LL;
    hb.last_step_id = 99;
    hb.kv_blocks_used = 3;
    hb.kv_blocks_total = 64;
    env.body_case = LLM__WORKER_ENVELOPE__BODY_HEARTBEAT;
    env.heartbeat = &hb;
    put_worker("heartbeat", &env);

    Llm__StepResult res = LLM__STEP_RESULT__INIT;
    Llm__SeqResult s0 = LLM__SEQ_RESULT__INIT, s1 = LLM__SEQ_RESULT__INIT;
    Llm__TokenLogprob lp = LLM__TOKEN_LOGPROB__INIT;
    Llm__Error e = LLM__ERROR__INIT;
    Llm__SeqResult *seqs[] = {&s0, &s1};
    s0.seq_id = 1;
    s0.token = 42;
    lp.token = 42;
    lp.logprob = -0.5f;
    s0.logprob = &lp;
    s1.seq_id = 2;
    s1.token = -1;
    e.code = LLM__ERROR__CODE__INVALID_ARGUMENT;
    e.request_id = "";
    e.message = "seq 2: sampling.top_p = 2 is outside [0, 1]";
    s1.error = &e;
    res.step_id = 99;
    res.epoch = 3;
    res.worker_id = "worker-p0-s1";
    res.stage_index = 1;
    res.n_seqs = 2;
    res.seqs = seqs;
    res.compute_us = 1500;
    env.body_case = LLM__WORKER_ENVELOPE__BODY_RESULT;
    env.result = &res;
    put_worker("step_result", &env);

    Llm__RegisterReply rr = LLM__REGISTER_REPLY__INIT;
    rr.worker_id = "worker-p0-s0";
    rr.accepted = 1;
    rr.heartbeat_interval_ms = 1000;
    rr.stage_count = 2;
    rr.layer_end = 1;
    rr.next_stage_endpoint = "tcp://127.0.0.1:5602";
    rr.epoch = 3;
    rr.pipeline_whole = 1;
    env.body_case = LLM__WORKER_ENVELOPE__BODY_REGISTER_REPLY;
    env.register_reply = &rr;
    put_worker("register_reply", &env);

    Llm__StepPlan plan = LLM__STEP_PLAN__INIT;
    Llm__SeqPlan p0 = LLM__SEQ_PLAN__INIT, p1 = LLM__SEQ_PLAN__INIT;
    Llm__SeqPlan *pseqs[] = {&p0, &p1};
    Llm__SamplingParams sp = LLM__SAMPLING_PARAMS__INIT;
    Llm__BlockCopy bc = LLM__BLOCK_COPY__INIT;
    Llm__BlockCopy *copies[] = {&bc};
    int32_t prefill[] = {1, 9, 33, 7, 60, 2}, decode[] = {17}, ctx[] = {5, 5, 6};
    uint32_t table0[] = {0}, table1[] = {1, 2};
    uint64_t freed[] = {7};
    p0.seq_id = 1;
    p0.n_tokens = 6;
    p0.tokens = prefill;
    p0.n_block_table = 1;
    p0.block_table = table0;
    p0.want_logits = 1;
    p1.seq_id = 2;
    p1.n_tokens = 1;
    p1.tokens = decode;
    p1.start_pos = 20;
    p1.n_block_table = 2;
    p1.block_table = table1;
    p1.want_logits = 1;
    p1.n_penalty_context = 3;
    p1.penalty_context = ctx;
    sp.temperature = 0.7f;
    sp.top_k = 8;
    sp.top_p = 0.9f;
    sp.min_p = 0.01f;
    sp.repetition_penalty = 1.3f;
    sp.frequency_penalty = 0.2f;
    sp.seed = 1234;
    sp.top_logprobs = 2;
    p1.sampling = &sp;
    bc.src = 1;
    bc.dst = 3;
    plan.step_id = 100;
    plan.epoch = 3;
    plan.n_seqs = 2;
    plan.seqs = pseqs;
    plan.n_freed_seqs = 1;
    plan.freed_seqs = freed;
    plan.n_copies = 1;
    plan.copies = copies;
    env.body_case = LLM__WORKER_ENVELOPE__BODY_PLAN;
    env.plan = &plan;
    put_worker("step_plan", &env);

    uint8_t *buf;
    size_t n;
    if (proto_worker_error_pack(LLM__ERROR__CODE__UNAVAILABLE, "", "draining", 500, &buf, &n) < 0)
        fuzz_fail("worker error");
    put("worker_frame", "error", buf, n);
    free(buf);
}

static void put_gguf(const char *name, gguf_writer *w) {
    char path[2048], err[512];
    snprintf(path, sizeof path, "%s/gguf", outdir);
    if (mkdir(path, 0777) != 0 && errno != EEXIST) fuzz_fail("mkdir %s: %s", path, strerror(errno));
    snprintf(path, sizeof path, "%s/gguf/%s", outdir, name);
    if (gguf_writer_write(w, path, err, sizeof err) < 0) fuzz_fail("%s: %s", name, err);
    gguf_writer_free(w);
}

/* The llama model of fuzz_tiny_safetensors' shape with a 16-token
 * SentencePiece vocabulary (byte fallback for newline and space). */
static void gguf_llama(void) {
    enum { V = 16, D = 8, KV = 4, F = 16 };
    gguf_writer *w = gguf_writer_init();
    gguf_writer_set_str(w, "general.architecture", "llama");
    gguf_writer_set_str(w, "general.name", "fuzz-seed");
    gguf_writer_set_u32(w, "general.alignment", 32);
    gguf_writer_set_u32(w, "llama.context_length", 64);
    gguf_writer_set_u32(w, "llama.embedding_length", D);
    gguf_writer_set_u32(w, "llama.block_count", 1);
    gguf_writer_set_u32(w, "llama.feed_forward_length", F);
    gguf_writer_set_u32(w, "llama.attention.head_count", 2);
    gguf_writer_set_u32(w, "llama.attention.head_count_kv", 1);
    gguf_writer_set_f32(w, "llama.attention.layer_norm_rms_epsilon", 1e-5f);
    gguf_writer_set_f32(w, "llama.rope.freq_base", 10000.0f);
    gguf_writer_set_u32(w, "llama.rope.dimension_count", 4);
    gguf_writer_set_u32(w, "llama.vocab_size", V);
    static const char *const toks[V] = {"<unk>", "<s>", "</s>", "<0x0A>", "<0x20>", "\xe2\x96\x81", "a", "b",
                                        "\xe2\x96\x81" "a", "ab", "\xe2\x96\x81" "ab", "c", "o", "n", "e", "."};
    float scores[V];
    int32_t types[V];
    for (int i = 0; i < V; i++) {
        scores[i] = -(float)i;
        types[i] = i == 0 ? 2 : i < 3 ? 3 : i < 5 ? 6 : 1;
    }
    gguf_writer_set_str(w, "tokenizer.ggml.model", "llama");
    gguf_writer_set_arr_str(w, "tokenizer.ggml.tokens", toks, V);
    gguf_writer_set_arr_f32(w, "tokenizer.ggml.scores", scores, V);
    gguf_writer_set_arr_i32(w, "tokenizer.ggml.token_type", types, V);
    gguf_writer_set_u32(w, "tokenizer.ggml.bos_token_id", 1);
    gguf_writer_set_u32(w, "tokenizer.ggml.eos_token_id", 2);
    gguf_writer_set_u32(w, "tokenizer.ggml.unknown_token_id", 0);
    gguf_writer_set_bool(w, "tokenizer.ggml.add_bos_token", 1);
    static float data[F * D];
    for (int i = 0; i < F * D; i++) data[i] = 0.01f * (float)(i % 7);
    static const struct { const char *name; int64_t ne0, ne1; } t[] = {
        {"token_embd.weight", D, V}, {"output_norm.weight", D, 1}, {"blk.0.attn_norm.weight", D, 1},
        {"blk.0.ffn_norm.weight", D, 1}, {"blk.0.attn_q.weight", D, D}, {"blk.0.attn_k.weight", D, KV},
        {"blk.0.attn_v.weight", D, KV}, {"blk.0.attn_output.weight", D, D}, {"blk.0.ffn_gate.weight", D, F},
        {"blk.0.ffn_up.weight", D, F}, {"blk.0.ffn_down.weight", F, D}};
    for (size_t i = 0; i < sizeof t / sizeof t[0]; i++) {
        int64_t ne[2] = {t[i].ne0, t[i].ne1};
        gguf_writer_add_tensor(w, t[i].name, DTYPE_F32, t[i].ne1 == 1 ? 1 : 2, ne, data);
    }
    put_gguf("llama_spm", w);
}

/* A GPT-2 vocabulary with merges and no tensors (as the vocab-only files
 * of ../shared/models/vocab), plus a key of every value type. */
static void gguf_gpt2(void) {
    gguf_writer *w = gguf_writer_init();
    gguf_writer_set_str(w, "general.architecture", "gpt2");
    static const char *const toks[] = {"!", "a", "b", "c", "\xc4\xa0", "\xc4\xa0" "a", "ab", "\xc4\xa0" "ab",
                                       "<|endoftext|>"};
    static const char *const merges[] = {"a b", "\xc4\xa0 a", "\xc4\xa0 ab"};
    int32_t types[9] = {1, 1, 1, 1, 1, 1, 1, 1, 3};
    gguf_writer_set_str(w, "tokenizer.ggml.model", "gpt2");
    gguf_writer_set_str(w, "tokenizer.ggml.pre", "gpt-2");
    gguf_writer_set_arr_str(w, "tokenizer.ggml.tokens", toks, 9);
    gguf_writer_set_arr_i32(w, "tokenizer.ggml.token_type", types, 9);
    gguf_writer_set_arr_str(w, "tokenizer.ggml.merges", merges, 3);
    gguf_writer_set_u32(w, "tokenizer.ggml.bos_token_id", 8);
    gguf_writer_set_u32(w, "tokenizer.ggml.eos_token_id", 8);
    gguf_writer_set_u8(w, "t.u8", 200);
    gguf_writer_set_i8(w, "t.i8", -100);
    gguf_writer_set_u16(w, "t.u16", 60000);
    gguf_writer_set_i16(w, "t.i16", -30000);
    gguf_writer_set_i32(w, "t.i32", -7);
    gguf_writer_set_u64(w, "t.u64", 1ULL << 40);
    gguf_writer_set_i64(w, "t.i64", -(1LL << 40));
    gguf_writer_set_f64(w, "t.f64", 0.5);
    gguf_writer_set_bool(w, "t.bool", 1);
    uint16_t a16[] = {1, 2, 65535};
    double af64[] = {1.5, -2.5};
    gguf_writer_set_arr(w, "t.arr_u16", GGUF_TYPE_UINT16, a16, 3);
    gguf_writer_set_arr(w, "t.arr_f64", GGUF_TYPE_FLOAT64, af64, 2);
    put_gguf("gpt2_vocab", w);
}

int main(int argc, char **argv) {
    if (argc != 2) {
        fprintf(stderr, "usage: fuzz_seeds OUTDIR\n");
        return 2;
    }
    outdir = argv[1];
    if (mkdir(outdir, 0777) != 0 && errno != EEXIST) fuzz_fail("mkdir %s: %s", outdir, strerror(errno));
    client_frames();
    worker_frames();
    gguf_llama();
    gguf_gpt2();
    uint8_t *st;
    size_t n = fuzz_tiny_safetensors(&st);
    put("safetensors", "tiny_llama", st, n);
    free(st);
    return 0;
}
