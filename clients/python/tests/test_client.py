"""Tests of the llmcluster package against a running cluster serving
stories260K (tests/clients/test_cluster_python_client.c starts one and runs this):
greedy streams equal llm-run's output token for token, sync and asyncio;
logprobs; non-streamed requests; cancel; re-attach by request id (with the
seed of GenerateAccepted); n > 1 (each choice equal to the request of n = 1
with its seed, re-attach per choice); JSON Schema, json_object and GBNF
constraints (every output that ends with "stop" parsed and checked) and
their errors; health, status and models; CURVE keys from files and the
environment, refused keys and bad key files.

Environment: LLM_ROUTER (the router's client endpoint), LLM_TEST_MODEL (the
GGUF file it serves), LLM_RUN (the llm-run program), LLMCLUSTER_PROTO_DIR
(the generated protobuf modules), LLM_CURVE_KEY_FILE and LLM_ROUTER_KEY (an
admitted client key and the router's public key)."""

import asyncio
import json
import os
import subprocess
import sys
import tempfile
import unittest
import uuid
from unittest import mock

import zmq

import llmcluster
from llmcluster import AsyncClient, Client, LlmError
from llmcluster import keys as llmkeys

ROUTER = os.environ["LLM_ROUTER"]
MODEL = os.environ["LLM_TEST_MODEL"]
LLM_RUN = os.environ["LLM_RUN"]

_refs = {}


def reference(prompt, max_tokens, stop_at_eos=True):
    """llm-run's greedy output (ids, text) for prompt, the reference every
    cluster generation at temperature 0 must equal."""
    key = (prompt, max_tokens, stop_at_eos)
    if key not in _refs:
        cmd = [LLM_RUN, "--model", MODEL, "--prompt", prompt, "--max-tokens", str(max_tokens), "--json",
               "--threads", "1", "--stop-at-eos" if stop_at_eos else "--no-stop-at-eos"]
        r = subprocess.run(cmd, capture_output=True, text=True, timeout=60)
        if r.returncode != 0:
            raise AssertionError(f"{' '.join(cmd)}: exit {r.returncode}: {r.stderr[-500:]}")
        j = json.loads(r.stdout.strip().splitlines()[-1])
        _refs[key] = (j["ids"], j["text"])
    return _refs[key]


PROMPTS = ["Once upon a time", "The little dog", "Lily and Tom went to the park"]


class SyncTest(unittest.TestCase):
    def setUp(self):
        self.c = Client(ROUTER, timeout=20)

    def tearDown(self):
        self.c.close()

    def test_cluster_calls(self):
        h = self.c.health()
        self.assertTrue(h.serving, h)
        self.assertEqual(h.protocol_version, llmcluster.PROTOCOL_VERSION)
        self.assertGreaterEqual(h.pipelines_ready, 1)
        models = self.c.models()
        self.assertEqual(len(models), 1, models)
        m = models[0]
        self.assertEqual(m.id, os.path.basename(MODEL))
        self.assertTrue(m.is_default)
        self.assertEqual(m.n_vocab, 512)
        self.assertGreaterEqual(m.pipelines, 1)
        s = self.c.status()
        self.assertEqual(len(s.pipelines), 1)
        self.assertTrue(s.pipelines[0].ready)
        self.assertEqual(len(s.workers), 1)

    def check_stream(self, gen, prompt, max_tokens):
        ids, text = reference(prompt, max_tokens)
        got_ids, got_text, chunks = [], [], list(gen)
        for i, ch in enumerate(chunks[:-1]):
            self.assertIsNone(ch.finish_reason, f"chunk {i} of {len(chunks)} has a finish reason")
            self.assertEqual(ch.index, len(got_ids), f"chunk {i} starts at token {ch.index}")
            got_ids += ch.token_ids
            got_text.append(ch.text)
        last = chunks[-1]
        self.assertIn(last.finish_reason, ("length", "stop"))
        self.assertEqual(last.token_ids, [])
        self.assertEqual(got_ids, ids, f'"{prompt}": token ids differ from llm-run\'s')
        self.assertEqual("".join(got_text), text)
        self.assertEqual(last.usage.completion_tokens, len(ids))
        self.assertEqual(gen.finish_reason, last.finish_reason)
        self.assertEqual(gen.tokens_received, len(ids))
        return chunks

    def test_greedy_equals_llm_run(self):
        for p in PROMPTS:
            gen = self.c.generate(p, max_tokens=40, temperature=0)
            chunks = self.check_stream(gen, p, 40)
            self.assertGreater(len(chunks), 2, "streamed as one chunk")
            self.assertFalse(gen.accepted.reattached)
            self.assertEqual(gen.accepted.prompt_tokens, len(gen.accepted.prompt_token_ids))

    def test_several_streams_on_one_client(self):
        gens = [self.c.generate(p, max_tokens=30) for p in PROMPTS]
        for g in gens:
            g.start()
        # read them interleaved: each message must reach its own stream
        out = {g.request_id: [] for g in gens}
        live = list(gens)
        while live:
            for g in list(live):
                ch = next(g)
                out[g.request_id] += ch.token_ids
                if ch.finish_reason:
                    live.remove(g)
        for p, g in zip(PROMPTS, gens):
            self.assertEqual(out[g.request_id], reference(p, 30)[0], p)

    def test_logprobs_and_not_streamed(self):
        p = PROMPTS[0]
        comp = self.c.generate(p, max_tokens=12, logprobs=True, top_logprobs=2, stream=False).collect()
        ids, text = reference(p, 12)
        self.assertEqual(comp.token_ids, ids)
        self.assertEqual(comp.text, text)
        self.assertEqual(len(comp.logprobs), len(ids))
        for tid, lp in zip(ids, comp.logprobs):
            self.assertEqual(lp.token, tid)
            self.assertLess(lp.logprob, 0.0 + 1e-6)
            self.assertEqual(len(lp.top), 2)
            # greedy takes the most likely token, which heads the alternatives
            self.assertEqual(lp.top[0].token, tid)
            self.assertAlmostEqual(lp.top[0].logprob, lp.logprob, places=5)
            self.assertGreaterEqual(lp.top[0].logprob, lp.top[1].logprob)

    def test_cancel(self):
        # The router runs one sequence at a time (--max-batch 1), so a
        # request behind long ones is still queued when the cancel comes:
        # cancelled for certain, not a race with its last token.
        blockers = [self.c.generate(PROMPTS[0], max_tokens=100, ignore_eos=True) for _ in range(6)]
        for b in blockers:
            b.start()
        gen = self.c.generate(PROMPTS[1], max_tokens=50, priority=-100).start()
        last = self.c.cancel(gen.request_id)
        self.assertEqual(last.finish_reason, "cancelled", last)
        self.assertEqual(last.error.code, "CANCELLED")
        chunks = list(gen)
        self.assertEqual(chunks[-1].finish_reason, "cancelled")
        self.assertEqual(sum(len(ch.token_ids) for ch in chunks), 0)
        # the last blocker is queued behind the others too
        for b in reversed(blockers):
            self.c.cancel(b.request_id)
        rest = list(blockers[-1])
        self.assertEqual(rest[-1].finish_reason, "cancelled")
        self.assertEqual(sum(len(ch.token_ids) for ch in rest), 0)
        for b in blockers:
            b.close()
        # cancelling a finished request answers its real end again
        self.assertEqual(self.c.cancel(gen.request_id).finish_reason, "cancelled")
        with self.assertRaises(LlmError) as e:
            self.c.cancel("no-such-request-" + uuid.uuid4().hex)
        self.assertEqual(e.exception.code, "NOT_FOUND")
        self.assertIn("no-such-request", e.exception.message)

    def test_reattach(self):
        p, n = PROMPTS[2], 40
        ids, text = reference(p, n)
        rid = "py-reattach-" + uuid.uuid4().hex
        with Client(ROUTER) as first:
            gen = first.generate(p, max_tokens=n, request_id=rid)
            self.assertEqual(gen.request_id, rid)
            self.assertTrue(next(gen).token_ids)
        # the first connection is gone; the same request on another replays it
        again = self.c.generate(p, max_tokens=n, request_id=rid)
        comp = again.collect()
        self.assertTrue(again.accepted.reattached)
        self.assertEqual(comp.token_ids, ids)
        self.assertEqual(comp.text, text)
        # resume_from: only the tokens after those held
        tail = self.c.generate(p, max_tokens=n, request_id=rid, resume_from=10)
        chunks = list(tail)
        self.assertEqual(chunks[0].index, 10)
        self.assertEqual([t for ch in chunks for t in ch.token_ids], ids[10:])
        # the same id with another body is refused
        with self.assertRaises(LlmError) as e:
            self.c.generate(p, max_tokens=n + 1, request_id=rid).start()
        self.assertEqual(e.exception.code, "ALREADY_EXISTS")

    def test_empty_chunks_are_not_handed_out(self):
        # The router sends an empty chunk now and then to check a client is
        # still there; a stream hands out only chunks with something in them.
        from llmcluster._pb import client_pb2 as pb
        from llmcluster.client import StreamState
        st = StreamState(0)
        env = pb.ClientEnvelope()
        env.chunk.index = 0
        self.assertIsNone(st.feed(env))
        env.chunk.token_ids.extend([5, 6])
        env.chunk.text = "ab"
        c = st.feed(env)
        self.assertEqual([5, 6], c.token_ids)
        self.assertEqual(2, st.have)

    def test_reattach_sends_the_seed(self):
        # A sampled request without a seed: the router picks one and says it
        # in Accepted; a re-send of the id carries it unless given.
        p, n = PROMPTS[0], 24
        rid = "py-seed-" + uuid.uuid4().hex
        first = self.c.generate(p, max_tokens=n, request_id=rid, temperature=0.9)
        comp = first.collect()
        seed = first.accepted.seed
        self.assertNotEqual(seed, 0)
        again = self.c.generate(p, max_tokens=n, request_id=rid, temperature=0.9, resume_from=8)
        self.assertEqual(again._env.generate.sampling.seed, seed)
        self.assertEqual([t for ch in again for t in ch.token_ids], comp.token_ids[8:])
        self.assertTrue(again.accepted.reattached)
        # the same seed runs the same tokens as a new request
        other = self.c.generate(p, max_tokens=n, temperature=0.9, seed=seed).collect()
        self.assertEqual(other.token_ids, comp.token_ids)
        # a seed the caller gives is kept (and, differing, refused as another body)
        with self.assertRaises(LlmError) as e:
            self.c.generate(p, max_tokens=n, request_id=rid, temperature=0.9, seed=seed + 1).start()
        self.assertEqual(e.exception.code, "ALREADY_EXISTS")

    def test_refusals(self):
        with self.assertRaises(LlmError) as e:
            next(self.c.generate(PROMPTS[0], max_tokens=4, top_p=1.5))
        self.assertEqual(e.exception.code, "INVALID_ARGUMENT")
        self.assertIn("top_p", e.exception.message)
        with self.assertRaises(ValueError):
            self.c.generate(max_tokens=4)
        with self.assertRaises(TypeError):
            self.c.generate("x", max_token=4)
        # the connection still serves after the refusals
        self.assertTrue(self.c.health().serving)

    def test_prompt_tokens(self):
        gen = self.c.generate(PROMPTS[1], max_tokens=5)
        ids = gen.collect().token_ids
        comp = self.c.generate(prompt_tokens=gen.accepted.prompt_token_ids, max_tokens=5).collect()
        self.assertEqual(comp.token_ids, ids)


    # ---- n > 1 (docs/protocol.md, "Several choices") ----------------------

    def test_n_choices_equal_separate_requests(self):
        p = PROMPTS[0]
        gen = self.c.generate(p, n=3, max_tokens=20, temperature=1.0, seed=77, ignore_eos=True)
        chunks = list(gen)
        self.assertEqual(gen.accepted.seed, 77)
        self.assertEqual(gen.finish_reason, "length")
        ends = [ch for ch in chunks if ch.finish_reason]
        self.assertEqual(sorted(ch.choice for ch in ends), [0, 1, 2])
        ids, text, nxt = [[], [], []], ["", "", ""], [0, 0, 0]
        for ch in chunks:
            if ch.finish_reason:
                self.assertEqual(ch.usage.completion_tokens, 20)
                continue
            self.assertEqual(ch.index, nxt[ch.choice], "chunks of one choice in order")
            nxt[ch.choice] += len(ch.token_ids)
            ids[ch.choice] += ch.token_ids
            text[ch.choice] += ch.text
        self.assertEqual(gen.tokens_received_by_choice, [20, 20, 20])
        # each choice is the request of n = 1 with its seed
        for i in range(3):
            one = self.c.generate(p, max_tokens=20, temperature=1.0, seed=llmcluster.choice_seed(77, i),
                                  ignore_eos=True).collect()
            self.assertEqual((one.token_ids, one.text), (ids[i], text[i]), f"choice {i}")
        self.assertEqual(llmcluster.choice_seed(77, 0), 77)
        self.assertTrue(text[1] != text[0] or text[2] != text[0], "three sampled choices, one text")
        # collect(): every choice, greedy ones all equal to llm-run
        comp = self.c.generate(p, n=2, max_tokens=20, temperature=0).collect()
        ref_ids, ref_text = reference(p, 20)
        self.assertEqual([c.index for c in comp.choices], [0, 1])
        for c in comp.choices:
            self.assertEqual((c.token_ids, c.text), (ref_ids, ref_text))
            self.assertIn(c.finish_reason, ("length", "stop"))
        self.assertEqual((comp.text, comp.token_ids), (ref_text, ref_ids))
        with self.assertRaises(LlmError) as e:
            self.c.generate(p, n=17, max_tokens=4).start()
        self.assertEqual(e.exception.code, "INVALID_ARGUMENT")
        self.assertIn("n = 17", e.exception.message)

    def test_n_choices_reattach(self):
        kw = dict(n=2, max_tokens=30, temperature=0.8, seed=5, ignore_eos=True)
        full = self.c.generate(PROMPTS[1], **kw).collect()
        rid = "py-n-" + uuid.uuid4().hex
        g1 = self.c.generate(PROMPTS[1], request_id=rid, **kw)
        got = [[], []]
        for _ in range(3):
            ch = next(g1)
            got[ch.choice] += ch.token_ids
        g1.close()
        have = g1.tokens_received_by_choice
        self.assertEqual(have, [len(got[0]), len(got[1])])
        with Client(ROUTER, timeout=20) as c2:
            g2 = c2.generate(PROMPTS[1], request_id=rid, resume_from=have[0], resume_from_choice=have, **kw)
            comp = g2.collect()
        self.assertTrue(g2.accepted.reattached)
        for i in range(2):
            self.assertEqual(got[i] + comp.choices[i].token_ids, full.choices[i].token_ids, f"choice {i}")

    # ---- constraints (docs/grammar.md) -------------------------------------

    SCHEMA = {"type": "object", "properties": {"name": {"type": "string", "maxLength": 8},
                                               "age": {"type": "integer"}, "ok": {"type": "boolean"}},
              "required": ["name", "age", "ok"], "additionalProperties": False}

    def check_schema_output(self, text):
        v = json.loads(text)
        self.assertIsInstance(v, dict, text)
        self.assertEqual(sorted(v), ["age", "name", "ok"], text)
        self.assertIsInstance(v["name"], str)
        self.assertLessEqual(len(v["name"]), 8, text)
        self.assertTrue(isinstance(v["age"], int) and not isinstance(v["age"], bool), text)
        self.assertIsInstance(v["ok"], bool, text)

    def test_json_schema_and_json_object(self):
        stops = 0
        outs = []
        for i, p in enumerate(PROMPTS):
            # the schema as a dict, and as its JSON text
            schema = self.SCHEMA if i % 2 == 0 else json.dumps(self.SCHEMA)
            comp = self.c.generate(p, max_tokens=200, temperature=1.0, seed=100 + i, json_schema=schema).collect()
            outs.append(comp.choices[0])
        # n = 2: every choice constrained
        comp = self.c.generate(PROMPTS[0], n=2, max_tokens=200, temperature=1.0, seed=7,
                               json_schema=self.SCHEMA).collect()
        outs += comp.choices
        for c in outs:
            if c.finish_reason == "stop":
                self.check_schema_output(c.text)
                stops += 1
            else:
                self.assertEqual(c.finish_reason, "length", c)
        self.assertGreater(stops, 0, [c.text for c in outs])
        comp = self.c.generate(PROMPTS[2], max_tokens=200, temperature=0.7, seed=3, json_object=True).collect()
        if comp.finish_reason == "stop":
            self.assertIsInstance(json.loads(comp.text), dict, comp.text)
        else:
            self.assertEqual(comp.finish_reason, "length")
            self.assertTrue(comp.text.lstrip().startswith("{"), comp.text)

    def test_grammar(self):
        grammar = 'root ::= greet " " name "!"\ngreet ::= "hello" | "hi"\nname ::= [A-Z] [a-z]{1,6}\n'
        stops = 0
        for i, p in enumerate(PROMPTS):
            comp = self.c.generate(p, max_tokens=40, temperature=1.0, seed=11 + i, grammar=grammar).collect()
            if comp.finish_reason == "stop":
                self.assertRegex(comp.text, r"^(hello|hi) [A-Z][a-z]{1,6}!$")
                stops += 1
        self.assertGreater(stops, 0)
        # errors name the place: the line and column of a grammar, the
        # keyword of a schema
        with self.assertRaises(LlmError) as e:
            self.c.generate(PROMPTS[0], max_tokens=5, grammar='root ::= "a" missing\n').start()
        self.assertEqual(e.exception.code, "INVALID_ARGUMENT")
        self.assertIn("line 1, column", e.exception.message)
        self.assertIn("missing", e.exception.message)
        with self.assertRaises(LlmError) as e:
            self.c.generate(PROMPTS[0], max_tokens=5, json_schema={"type": "string", "pattern": "a+"}).start()
        self.assertIn("pattern", e.exception.message)


class AsyncTest(unittest.TestCase):
    def test_async(self):
        asyncio.run(self.run_async())

    async def run_async(self):
        async with AsyncClient(ROUTER, timeout=20) as c:
            h, models = await asyncio.gather(c.health(), c.models())
            self.assertTrue(h.serving)
            self.assertEqual(models[0].n_vocab, 512)
            self.assertTrue((await c.status()).pipelines[0].ready)

            # several generations at once on one connection, each equal to llm-run
            async def one(p):
                gen = c.generate(p, max_tokens=40)
                ids, text, idx = [], [], []
                async for ch in gen:
                    idx.append(ch.index)
                    ids += ch.token_ids
                    text.append(ch.text)
                return gen, ids, "".join(text)

            results = await asyncio.gather(*(one(p) for p in PROMPTS))
            for p, (gen, ids, text) in zip(PROMPTS, results):
                self.assertEqual((ids, text), reference(p, 40), p)
                self.assertIn(gen.finish_reason, ("length", "stop"))

            # cancel a request queued behind others (--max-batch 1), from
            # another task while its stream is awaited
            blockers = [c.generate(PROMPTS[0], max_tokens=100, ignore_eos=True) for _ in range(4)]
            await asyncio.gather(*(b.start() for b in blockers))
            gen = c.generate(PROMPTS[2], max_tokens=50, priority=-100)
            await gen.start()
            streamed = asyncio.ensure_future(gen.collect())
            last = await c.cancel(gen.request_id)
            self.assertEqual(last.finish_reason, "cancelled")
            comp = await streamed
            self.assertEqual((comp.finish_reason, comp.token_ids), ("cancelled", []))
            for b in blockers:
                await b.cancel()
                b.close()
            with self.assertRaises(LlmError) as e:
                await c.cancel("no-such-" + uuid.uuid4().hex)
            self.assertEqual(e.exception.code, "NOT_FOUND")

            # re-attach by id
            rid = "py-async-" + uuid.uuid4().hex
            g1 = c.generate(PROMPTS[1], max_tokens=30, request_id=rid)
            await g1.__anext__()
            g1.close()
            g2 = c.generate(PROMPTS[1], max_tokens=30, request_id=rid)
            comp = await g2.collect()
            self.assertTrue(g2.accepted.reattached)
            self.assertEqual(comp.token_ids, reference(PROMPTS[1], 30)[0])

            # n = 2 greedy: both choices equal llm-run, each with its end
            comp = await c.generate(PROMPTS[2], n=2, max_tokens=20, temperature=0).collect()
            self.assertEqual([ch.token_ids for ch in comp.choices], [reference(PROMPTS[2], 20)[0]] * 2)
            self.assertEqual([ch.last.choice for ch in comp.choices], [0, 1])


class KeysTest(unittest.TestCase):
    """The keys of the environment (the harness's admitted client) reach the
    router; given explicitly they do too; an unlisted key gets no answer; a
    bad key file and missing keys are errors that name the file or the
    options."""

    def test_keys_from_files_and_values(self):
        key, router = os.environ["LLM_CURVE_KEY_FILE"], os.environ["LLM_ROUTER_KEY"]
        with mock.patch.dict(os.environ, {}, clear=False):
            for v in ("LLM_CURVE_KEY_FILE", "LLM_ROUTER_KEY", "LLM_INSECURE"):
                os.environ.pop(v, None)
            with Client(ROUTER, timeout=10, curve_key_file=key, router_key=router) as c:
                self.assertTrue(c.health().serving)
            pub, sec = llmkeys.load_key_pair(key)
            server = llmkeys.load_public_key(router)
            with Client(ROUTER, timeout=10, curve_secretkey=sec.decode(), curve_publickey=pub,
                        curve_serverkey=server) as c:
                self.assertTrue(c.health().serving)
            with self.assertRaises(ValueError) as e:
                Client(ROUTER)
            self.assertIn("curve_key_file", str(e.exception))
            self.assertIn("LLM_CURVE_KEY_FILE", str(e.exception))
            self.assertIn("insecure", str(e.exception))

    def test_unlisted_key_gets_no_answer(self):
        pub, sec = zmq.curve_keypair()
        with tempfile.TemporaryDirectory() as d:
            path = os.path.join(d, "stranger.key")
            with open(path, "w") as f:
                f.write(f"# a key the router does not list\npublic {pub.decode()}\nsecret {sec.decode()}\n")
            os.chmod(path, 0o600)
            with Client(ROUTER, timeout=1.5, curve_key_file=path, router_key=os.environ["LLM_ROUTER_KEY"]) as c:
                with self.assertRaises(TimeoutError):
                    c.health()
        # a plain socket gets nothing from a router with keys either
        with Client(ROUTER, timeout=1.5, insecure=True) as c:
            with self.assertRaises(TimeoutError):
                c.health()

    def test_bad_key_files(self):
        pub, sec = zmq.curve_keypair()
        other_pub, _ = zmq.curve_keypair()
        cases = {
            "short.key": (f"public {pub.decode()}\nsecret abc\n", "short.key:2: secret key 'abc' is not a key"),
            "nosecret.key": (f"public {pub.decode()}\n", "no 'secret <key>' line"),
            "mismatch.key": (f"public {other_pub.decode()}\nsecret {sec.decode()}\n", "does not belong"),
            "words.key": ("private xyz\n", "words.key:1: expected 'public <key>' or 'secret <key>'"),
        }
        with tempfile.TemporaryDirectory() as d:
            for name, (text, want) in cases.items():
                path = os.path.join(d, name)
                with open(path, "w") as f:
                    f.write(text)
                os.chmod(path, 0o600)
                with self.assertRaises(llmkeys.KeyFileError) as e:
                    Client(ROUTER, curve_key_file=path, router_key=os.environ["LLM_ROUTER_KEY"])
                self.assertIn(want, str(e.exception))
            two = os.path.join(d, "two.pub")
            with open(two, "w") as f:
                f.write(f"{pub.decode()}\n{other_pub.decode()}\n")
            with self.assertRaises(llmkeys.KeyFileError) as e:
                llmkeys.load_public_key(two)
            self.assertIn("two.pub:2: a public key file holds one key on one line", str(e.exception))
            with self.assertRaises(llmkeys.KeyFileError) as e:
                llmkeys.load_public_key(os.path.join(d, "missing.pub"))
            self.assertIn("missing.pub", str(e.exception))


class BuildTest(unittest.TestCase):
    def test_missing_proto_dir(self):
        from llmcluster import build
        with self.assertRaises(build.BuildError) as e:
            build.build(proto_dir="/nonexistent-proto-dir", out="/tmp/unused")
        self.assertIn("/nonexistent-proto-dir/types.proto", str(e.exception))


if __name__ == "__main__":
    unittest.main(verbosity=2)
