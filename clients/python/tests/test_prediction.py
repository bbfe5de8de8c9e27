"""Speculation and predicted outputs through the llmcluster package, against
a running 1x1 cluster serving pycode whose router runs --spec off
--spec-tokens 4 (tests/clients/test_cluster_python_client.c starts one and
runs this): a right prediction (the greedy output itself, as text or as
token ids) gives the same output as the request without it, with drafts
accepted (usage.accepted_prediction_tokens > 0); a wrong one gives the same
output with drafts rejected; spec="off" ignores a prediction; n = 2 counts
per choice; the same with AsyncClient; speculation's bad arguments are
refused before sending, naming the argument and its value, and a token id
outside the vocabulary by the router.

Environment: LLM_ROUTER, LLM_TEST_MODEL (pycode-target-f16.gguf), LLM_RUN,
LLMCLUSTER_PROTO_DIR, LLM_CURVE_KEY_FILE and LLM_ROUTER_KEY, as for
test_client.py."""

import asyncio
import json
import os
import subprocess
import unittest

from llmcluster import AsyncClient, Client, LlmError

ROUTER = os.environ["LLM_ROUTER"]
MODEL = os.environ["LLM_TEST_MODEL"]
LLM_RUN = os.environ["LLM_RUN"]

# The prompt and wrong prediction of tests/router/test_cluster_spec_pred.c;
# greedy with ignore_eos as there, so that every request runs MAX_TOKENS.
PROMPT = ("import os\n\n\ndef read_lines(path):\n    with open(path) as f:\n        return f.readlines()\n\n\n"
          "def write_lines(path, lines):\n")
WRONG = "    for line in reversed(lines):\n        print(line)\n    return None\n"
MAX_TOKENS = 64

_base = {}


def llm_run(prompt, max_tokens):
    cmd = [LLM_RUN, "--model", MODEL, "--prompt", prompt, "--max-tokens", str(max_tokens), "--json",
           "--threads", "1", "--no-stop-at-eos"]
    r = subprocess.run(cmd, capture_output=True, text=True, timeout=120)
    if r.returncode != 0:
        raise AssertionError(f"llm-run: exit {r.returncode}: {r.stderr[-500:]}")
    return json.loads(r.stdout.strip().splitlines()[-1])["ids"]


def base():
    """The greedy completion of PROMPT without a prediction (checked once
    against llm-run), the reference of every request here."""
    if not _base:
        with Client(ROUTER, timeout=30) as c:
            comp = c.generate(PROMPT, max_tokens=MAX_TOKENS, temperature=0, ignore_eos=True).collect()
        _base["comp"] = comp
        _base["llm_run"] = llm_run(PROMPT, MAX_TOKENS)
    return _base["comp"]


def usage_line(name, comp):
    u = comp.usage
    print(f"  {name}: {len(comp.token_ids)} tokens, accepted_prediction_tokens {u.accepted_prediction_tokens}, "
          f"rejected_prediction_tokens {u.rejected_prediction_tokens}", flush=True)


class SyncPredictionTest(unittest.TestCase):
    def setUp(self):
        self.c = Client(ROUTER, timeout=30)
        self.base = base()

    def tearDown(self):
        self.c.close()

    def same(self, comp, what):
        self.assertEqual(comp.token_ids, self.base.token_ids, f"{what}: token ids differ from those without it")
        self.assertEqual(comp.text, self.base.text, what)
        self.assertEqual(comp.finish_reason, self.base.finish_reason, what)

    def test_base_equals_llm_run_and_counts_nothing(self):
        self.assertEqual(self.base.token_ids, _base["llm_run"], "the request without a prediction against llm-run")
        self.assertEqual(len(self.base.token_ids), MAX_TOKENS)
        self.assertEqual((0, 0), (self.base.accepted_prediction_tokens, self.base.rejected_prediction_tokens))
        self.assertEqual((0, 0), (self.base.usage.accepted_prediction_tokens,
                                  self.base.usage.rejected_prediction_tokens))

    def test_right_prediction_text(self):
        gen = self.c.generate(PROMPT, max_tokens=MAX_TOKENS, temperature=0, ignore_eos=True, prediction=self.base.text)
        chunks = list(gen)
        comp_ids = [t for ch in chunks for t in ch.token_ids]
        self.assertEqual(comp_ids, self.base.token_ids, "right prediction (text): streamed ids")
        last = chunks[-1]
        self.assertEqual(last.finish_reason, "length")
        u = last.usage
        print(f"  right prediction (text), streamed: {u}", flush=True)
        self.assertGreater(u.accepted_prediction_tokens, 0, u)
        self.assertGreaterEqual(u.accepted_prediction_tokens, MAX_TOKENS // 2, u)
        self.assertLessEqual(u.rejected_prediction_tokens * 6, u.accepted_prediction_tokens, u)

    def test_right_prediction_ids(self):
        comp = self.c.generate(PROMPT, max_tokens=MAX_TOKENS, temperature=0, ignore_eos=True,
                               prediction_tokens=self.base.token_ids).collect()
        usage_line("right prediction (ids)", comp)
        self.same(comp, "right prediction (ids)")
        self.assertGreaterEqual(comp.accepted_prediction_tokens, MAX_TOKENS // 2, comp.usage)
        self.assertEqual(0, comp.rejected_prediction_tokens, comp.usage)
        self.assertEqual(comp.choices[0].accepted_prediction_tokens, comp.accepted_prediction_tokens)

    def test_right_prediction_not_streamed(self):
        comp = self.c.generate(PROMPT, max_tokens=MAX_TOKENS, temperature=0, ignore_eos=True, stream=False,
                               prediction_tokens=self.base.token_ids).collect()
        self.same(comp, "right prediction (ids, not streamed)")
        self.assertGreater(comp.accepted_prediction_tokens, 0, comp.usage)

    def test_wrong_prediction(self):
        comp = self.c.generate(PROMPT, max_tokens=MAX_TOKENS, temperature=0, ignore_eos=True, prediction=WRONG).collect()
        usage_line("wrong prediction", comp)
        self.same(comp, "wrong prediction")
        self.assertGreater(comp.rejected_prediction_tokens, 0, comp.usage)
        self.assertEqual(comp.usage.rejected_prediction_tokens, comp.rejected_prediction_tokens)

    def test_spec_off_ignores_the_prediction(self):
        comp = self.c.generate(PROMPT, max_tokens=MAX_TOKENS, temperature=0, ignore_eos=True, spec="off",
                               prediction=self.base.text).collect()
        self.same(comp, "spec off with a prediction")
        self.assertEqual((0, 0), (comp.accepted_prediction_tokens, comp.rejected_prediction_tokens))

    def test_spec_modes_same_output(self):
        for spec, k in (("ngram", 2), ("NGRAM", 0), (2, 16), ("auto", 4), ("default", 0)):
            comp = self.c.generate(PROMPT, max_tokens=MAX_TOKENS, temperature=0, ignore_eos=True, spec=spec, spec_tokens=k).collect()
            self.same(comp, f"spec={spec!r} spec_tokens={k}")
            self.assertEqual((0, 0), (comp.accepted_prediction_tokens, comp.rejected_prediction_tokens))
        comp = self.c.generate(PROMPT, max_tokens=MAX_TOKENS, temperature=0, ignore_eos=True, spec="ngram", spec_tokens=2,
                               prediction_tokens=self.base.token_ids).collect()
        self.same(comp, "spec ngram, 2 tokens, right ids")
        self.assertGreater(comp.accepted_prediction_tokens, 0, comp.usage)

    def test_two_choices_count_each(self):
        comp = self.c.generate(PROMPT, max_tokens=MAX_TOKENS, temperature=0, ignore_eos=True, n=2,
                               prediction_tokens=self.base.token_ids).collect()
        self.assertEqual(len(comp.choices), 2)
        for ch in comp.choices:
            self.assertEqual(ch.token_ids, self.base.token_ids, f"choice {ch.index}")
            self.assertGreater(ch.accepted_prediction_tokens, 0, f"choice {ch.index}: {ch.usage}")
            self.assertEqual(0, ch.rejected_prediction_tokens, f"choice {ch.index}: {ch.usage}")
            self.assertEqual(ch.usage.accepted_prediction_tokens, ch.accepted_prediction_tokens)
        print(f"  n = 2, right ids: accepted {[ch.accepted_prediction_tokens for ch in comp.choices]}", flush=True)

    def test_bad_arguments_named(self):
        ids = self.base.token_ids
        cases = [
            (ValueError, dict(spec="fast"), "spec = 'fast' is not a speculation mode"),
            (ValueError, dict(spec=5), "spec = 5 is not a speculation mode"),
            (TypeError, dict(spec=1.0), "spec must be a str"),
            (ValueError, dict(spec_tokens=17), "spec_tokens = 17 is outside [0, 16]"),
            (ValueError, dict(spec_tokens=-1), "spec_tokens = -1 is outside [0, 16]"),
            (TypeError, dict(spec_tokens="4"), "spec_tokens must be an int, not str"),
            (ValueError, dict(prediction="x" * 262145), "prediction has 262145 bytes (UTF-8), at most 262144"),
            (ValueError, dict(prediction="\u00e9" * 131073), "prediction has 262146 bytes (UTF-8), at most 262144"),
            (TypeError, dict(prediction=ids), "prediction must be a str"),
            (TypeError, dict(prediction_tokens="def"), "prediction_tokens must be a list of token ids, not str"),
            (ValueError, dict(prediction_tokens=[1] * 65537), "prediction_tokens has 65537 ids, at most 65536"),
            (ValueError, dict(prediction_tokens=[5, -3]), "prediction_tokens[1] = -3 is not a token id"),
            (TypeError, dict(prediction_tokens=[5, "6"]), "prediction_tokens[1] = '6' is not an int"),
            (ValueError, dict(prediction="def", prediction_tokens=ids),
             f"prediction (3 bytes) and prediction_tokens ({len(ids)} ids) are both given; give one"),
        ]
        for exc, kw, want in cases:
            with self.assertRaises(exc, msg=str(list(kw))) as e:
                self.c.generate(PROMPT, max_tokens=8, **kw)
            self.assertIn(want, str(e.exception))
        # at the bounds: accepted
        comp = self.c.generate(PROMPT, max_tokens=4, temperature=0, ignore_eos=True, spec_tokens=16,
                               prediction="x" * 262144).collect()
        self.assertEqual(comp.token_ids, self.base.token_ids[:4])
        # inside int32 but outside the vocabulary: the router names it
        n_vocab = self.c.models()[0].n_vocab
        with self.assertRaises(LlmError) as e:
            self.c.generate(PROMPT, max_tokens=4, prediction_tokens=[1, n_vocab]).start()
        self.assertEqual(e.exception.code, "INVALID_ARGUMENT")
        self.assertIn(f"prediction_tokens[1] = {n_vocab} is outside the vocabulary", e.exception.message)


class AsyncPredictionTest(unittest.TestCase):
    def test_async_right_and_wrong(self):
        b = base()

        async def main():
            async with AsyncClient(ROUTER, timeout=30) as c:
                async def one(**kw):
                    return await c.generate(PROMPT, max_tokens=MAX_TOKENS, temperature=0, ignore_eos=True, **kw).collect()
                right, ids, wrong = await asyncio.gather(one(prediction=b.text), one(prediction_tokens=b.token_ids),
                                                         one(prediction=WRONG))
                with self.assertRaises(ValueError) as e:
                    c.generate(PROMPT, spec_tokens=99)
                self.assertIn("spec_tokens = 99 is outside [0, 16]", str(e.exception))
                with self.assertRaises(ValueError) as e:
                    c.generate(PROMPT, prediction="a", prediction_tokens=[1])
                self.assertIn("are both given", str(e.exception))
                return right, ids, wrong

        right, ids, wrong = asyncio.run(main())
        for name, comp in (("right", right), ("ids", ids), ("wrong", wrong)):
            usage_line(f"asyncio {name}", comp)
            self.assertEqual(comp.token_ids, b.token_ids, f"asyncio {name} prediction: token ids differ")
        self.assertGreater(right.accepted_prediction_tokens, 0, right.usage)
        self.assertGreater(ids.accepted_prediction_tokens, 0, ids.usage)
        self.assertEqual(0, ids.rejected_prediction_tokens, ids.usage)
        self.assertGreater(wrong.rejected_prediction_tokens, 0, wrong.usage)


if __name__ == "__main__":
    unittest.main(verbosity=2)
