"""The synchronous client of the cluster's ZeroMQ protocol (docs/protocol.md),
and what it shares with the asyncio one (aio.py): the request builder, the
chunk and error types, and the per-stream rule that drops tokens a client
already has after a re-attach.

One Client is one DEALER connection to the router; it is not thread-safe
(use one per thread, or AsyncClient for many requests in one event loop).
Several generations may be iterated in turn on one Client: replies are
matched by tag and pushed chunks by request id."""

import collections
import json
import dataclasses
import time
import uuid
from typing import List, Optional

import zmq

from . import keys as _keys
from ._pb import client_pb2 as pb
from ._pb import types_pb2

PROTOCOL_VERSION = 1

# Keyword arguments of generate(): those of GenerateRequest, then those of
# SamplingParams (proto/client.proto, proto/types.proto); zero means the
# default, as in the protocol.
REQUEST_FIELDS = ("model", "max_tokens", "stop", "priority", "deadline_ms", "timeout_ms", "stream", "resume_from",
                  "n", "resume_from_choice", "spec", "spec_tokens", "prediction", "prediction_tokens")
SAMPLING_FIELDS = ("temperature", "top_k", "top_p", "min_p", "repetition_penalty", "presence_penalty",
                   "frequency_penalty", "penalty_last_n", "seed", "stop_token_ids", "ignore_eos", "logprobs",
                   "top_logprobs", "json_schema", "json_object", "grammar")

# Speculation (GenerateRequest.spec, docs/protocol.md): the names generate()
# takes, as `llm generate --spec` spells them, and their enum values.
SPEC_MODES = {"default": 0, "off": 1, "ngram": 2, "draft": 3, "auto": 4}
# The protocol's bounds (proto/request.h): the router refuses past them.
SPEC_TOKENS_MAX = 16             # PROTO_SPEC_TOKENS_MAX
PREDICTION_BYTES_MAX = 262144    # PROTO_PREDICTION_BYTES_MAX
PREDICTION_TOKENS_MAX = 65536    # PROTO_PREDICTION_TOKENS_MAX


class LlmError(Exception):
    """An Error reply of the router.  code is the name ("NOT_FOUND",
    "INVALID_ARGUMENT", ...; gRPC's codes), code_value its number."""

    def __init__(self, code_value, message, request_id="", retry_after_ms=0):
        self.code_value = int(code_value)
        codes = types_pb2.Error.Code
        self.code = codes.Name(code_value) if code_value in codes.values() else str(code_value)
        self.message = message
        self.request_id = request_id
        self.retry_after_ms = retry_after_ms
        super().__init__(f"{self.code}: {message}")

    @classmethod
    def from_pb(cls, e):
        return cls(e.code, e.message, e.request_id, e.retry_after_ms)


@dataclasses.dataclass
class TopLogprob:
    token: int
    logprob: float


@dataclasses.dataclass
class TokenLogprob:
    """The chosen token's log-probability and the most likely alternatives."""
    token: int
    logprob: float
    top: List[TopLogprob]


@dataclasses.dataclass
class Usage:
    """GenerateDone.Usage of one choice.  accepted_prediction_tokens and
    rejected_prediction_tokens: for a request with a prediction, the drafts
    taken from it that the cluster verified and accepted or rejected
    (OpenAI's names); 0 without a prediction, and from a router before
    these fields."""
    prompt_tokens: int
    completion_tokens: int
    accepted_prediction_tokens: int = 0
    rejected_prediction_tokens: int = 0


@dataclasses.dataclass
class Accepted:
    """GenerateAccepted: the request is durable and will run."""
    request_id: str
    reattached: bool
    prompt_tokens: int
    prompt_token_ids: List[int]
    seed: int
    queue_position: int


@dataclasses.dataclass
class Chunk:
    """Tokens of a stream, or its end.  index is the position of
    token_ids[0] among the completion tokens of its choice (0 .. n-1 of a
    request of n > 1; 0 otherwise).  The last chunk of every choice has no
    tokens and a finish_reason: "stop", "length", "cancelled", "deadline" or
    "error" (then error says why), with usage and, for "stop", stop_token
    (-1 if none) or stop_string."""
    index: int
    token_ids: List[int]
    text: str
    logprobs: List[TokenLogprob]
    finish_reason: Optional[str] = None
    usage: Optional[Usage] = None
    stop_token: int = -1
    stop_string: str = ""
    error: Optional[LlmError] = None
    choice: int = 0


@dataclasses.dataclass
class Health:
    serving: bool
    status: str  # "SERVING", "NOT_SERVING"
    protocol_version: int
    build: str
    pipelines_ready: int


def new_request_id():
    return str(uuid.uuid4())


def choice_seed(seed, i):
    """The seed choice i of a request of n > 1 with seed `seed` samples with
    (docs/protocol.md, "Several choices"; proto_choice_seed): seed itself for
    choice 0, else the splitmix64 finalizer of seed + i * golden ratio.  A
    request of n = 1 with this seed makes the tokens of choice i."""
    if i == 0:
        return seed
    m = (1 << 64) - 1
    x = (seed + i * 0x9E3779B97F4A7C15) & m
    x = ((x ^ (x >> 30)) * 0xBF58476D1CE4E5B9) & m
    x = ((x ^ (x >> 27)) * 0x94D049BB133111EB) & m
    x ^= x >> 31
    return x or 1


def open_socket(ctx, endpoint, key_args):
    """A DEALER socket connected to the router, with CURVE unless the
    settings (keys.curve_settings(**key_args)) say insecure."""
    curve = _keys.curve_settings(**key_args)
    sock = ctx.socket(zmq.DEALER)
    sock.setsockopt(zmq.LINGER, 0)
    if curve is not None:
        curve.apply(sock)
    sock.connect(endpoint)
    return sock


class SeedMemory:
    """The seeds of the GenerateAccepted replies this client saw, by
    request id, so that a re-send of the same id carries the seed when its
    caller gave none (docs/protocol.md, "Keep the seed": a sampled request
    whose state the cluster lost is refused without it, and run again with
    the same tokens with it).  Bounded: the oldest ids are forgotten."""

    LIMIT = 65536

    def __init__(self):
        self._seeds = collections.OrderedDict()

    def remember(self, request_id, seed):
        if not seed:
            return
        self._seeds[request_id] = seed
        self._seeds.move_to_end(request_id)
        while len(self._seeds) > self.LIMIT:
            self._seeds.popitem(last=False)

    def fill(self, request_id, params):
        if request_id is not None and not params.get("seed") and request_id in self._seeds:
            params["seed"] = self._seeds[request_id]


def _is_int(v):
    return isinstance(v, int) and not isinstance(v, bool)


def spec_value(spec):
    """GenerateRequest.spec for generate(spec=...): a name of SPEC_MODES
    (any case) or the enum's value (0 .. 4)."""
    if isinstance(spec, str):
        v = SPEC_MODES.get(spec.lower())
        if v is not None:
            return v
    elif _is_int(spec):
        if 0 <= spec <= max(SPEC_MODES.values()):
            return spec
    else:
        raise TypeError(f"generate(): spec must be a str (one of {', '.join(map(repr, SPEC_MODES))}) or int, "
                        f"not {type(spec).__name__}")
    raise ValueError(f"generate(): spec = {spec!r} is not a speculation mode: one of "
                     f"{', '.join(map(repr, SPEC_MODES))} (or 0 .. {max(SPEC_MODES.values())})")


def check_speculation(params):
    """Checks generate()'s spec_tokens, prediction and prediction_tokens
    against the protocol's bounds, as the router would, so that a wrong one
    is refused before it is sent: TypeError for a wrong type, ValueError
    naming the argument and its value otherwise.  Token ids inside the
    vocabulary are the router's check (it knows the model)."""
    k = params.get("spec_tokens")
    if k is not None:
        if not _is_int(k):
            raise TypeError(f"generate(): spec_tokens must be an int, not {type(k).__name__}")
        if not 0 <= k <= SPEC_TOKENS_MAX:
            raise ValueError(f"generate(): spec_tokens = {k} is outside [0, {SPEC_TOKENS_MAX}] "
                             "(0: the router's --spec-tokens)")
    text = params.get("prediction")
    n_bytes = 0
    if text is not None:
        if not isinstance(text, str):
            raise TypeError(f"generate(): prediction must be a str (the predicted text), not {type(text).__name__}"
                            + ("; token ids go in prediction_tokens" if isinstance(text, (list, tuple)) else ""))
        try:
            n_bytes = len(text.encode("utf-8"))
        except UnicodeEncodeError as e:
            raise ValueError(f"generate(): prediction: character {e.start} ({text[e.start]!r}) cannot be "
                             "encoded as UTF-8") from None
        if n_bytes > PREDICTION_BYTES_MAX:
            raise ValueError(f"generate(): prediction has {n_bytes} bytes (UTF-8), at most {PREDICTION_BYTES_MAX}")
    ids = params.get("prediction_tokens")
    if ids is not None:
        if isinstance(ids, (str, bytes)) or not hasattr(ids, "__len__"):
            raise TypeError(f"generate(): prediction_tokens must be a list of token ids, not {type(ids).__name__}"
                            + ("; a predicted text goes in prediction" if isinstance(ids, str) else ""))
        if len(ids) > PREDICTION_TOKENS_MAX:
            raise ValueError(f"generate(): prediction_tokens has {len(ids)} ids, at most {PREDICTION_TOKENS_MAX}")
        for i, t in enumerate(ids):
            if not _is_int(t):
                raise TypeError(f"generate(): prediction_tokens[{i}] = {t!r} is not an int")
            if not 0 <= t < 2 ** 31:
                raise ValueError(f"generate(): prediction_tokens[{i}] = {t} is not a token id (0 .. 2147483647)")
        if n_bytes > 0 and len(ids) > 0:
            raise ValueError(f"generate(): prediction ({n_bytes} bytes) and prediction_tokens ({len(ids)} ids) "
                             "are both given; give one")


def build_generate(env, request_id, prompt, params):
    """Fills env.generate from the arguments of generate(); raises TypeError
    or ValueError for arguments that are wrong in Python terms, and for
    speculation's (spec, spec_tokens, prediction, prediction_tokens) past
    the protocol's bounds (the router checks the other ranges and answers
    INVALID_ARGUMENT naming the field)."""
    unknown = sorted(set(params) - set(REQUEST_FIELDS) - set(SAMPLING_FIELDS) - {"prompt_tokens"})
    if unknown:
        raise TypeError(f"generate(): unknown argument {unknown[0]!r}")
    g = env.generate
    g.request_id = request_id
    tokens = params.get("prompt_tokens")
    if (prompt is None) == (tokens is None):
        raise ValueError("generate(): give exactly one of prompt (text) and prompt_tokens (ids)")
    if prompt is not None:
        if not isinstance(prompt, str):
            raise TypeError(f"generate(): prompt must be a str, not {type(prompt).__name__}")
        g.prompt = prompt
    else:
        g.prompt_tokens.extend(int(t) for t in tokens)
    g.stream = bool(params.get("stream", True))
    check_speculation(params)
    if params.get("spec") is not None:
        g.spec = spec_value(params["spec"])
    # Always present, even empty: the router compares a re-send with the
    # stored request byte for byte, and a re-send that carries the seed
    # from GenerateAccepted has this message, so the first send must too.
    g.sampling.SetInParent()
    for f in REQUEST_FIELDS:
        if f in ("stream", "stop", "resume_from_choice", "spec", "prediction_tokens") or params.get(f) is None:
            continue
        setattr(g, f, params[f])
    stop = params.get("stop")
    if stop is not None:
        g.stop.extend([stop] if isinstance(stop, str) else list(stop))
    rfc = params.get("resume_from_choice")
    if rfc is not None:
        g.resume_from_choice.extend(int(t) for t in rfc)
    pids = params.get("prediction_tokens")
    if pids is not None:
        g.prediction_tokens.extend(pids)
    for f in SAMPLING_FIELDS:
        v = params.get(f)
        if v is None:
            continue
        if f == "stop_token_ids":
            g.sampling.stop_token_ids.extend(int(t) for t in v)
        elif f == "json_schema" and not isinstance(v, str):
            # a schema given as a dict (or list) goes as its JSON text
            g.sampling.json_schema = json.dumps(v, separators=(",", ":"))
        else:
            setattr(g.sampling, f, v)


def _logprobs(lps):
    return [TokenLogprob(lp.token, lp.logprob, [TopLogprob(t.token, t.logprob) for t in lp.top]) for lp in lps]


def accepted_from_pb(a):
    return Accepted(a.request_id, a.reattached, a.prompt_tokens, list(a.prompt_token_ids), a.seed, a.queue_position)


def done_chunk(d, index):
    fin = pb.GenerateDone.FinishReason.Name(d.finish_reason).lower()
    err = LlmError.from_pb(d.error) if d.HasField("error") and d.error.code != 0 else None
    u = d.usage
    usage = Usage(u.prompt_tokens, u.completion_tokens, u.accepted_prediction_tokens, u.rejected_prediction_tokens)
    return Chunk(index, [], "", [], fin, usage, d.stop_token, d.stop_string, err, d.choice)


def health_from_pb(h):
    return Health(h.status == pb.HealthReply.SERVING, pb.HealthReply.ServingStatus.Name(h.status),
                  h.protocol_version, h.build, h.pipelines_ready)


def discard_before_accepted(queue):
    """Empties a stream's queue when its Accepted arrives.  Nothing is
    pushed for a new request before its Accepted, and after a re-attach on
    the connection that already followed the request, what came before
    belongs to the old stream: the replay follows the Accepted, and a live
    chunk taken first would make the replay's earlier tokens look held."""
    if queue is None:
        return
    if isinstance(queue, collections.deque):
        queue.clear()
        return
    while not queue.empty():
        queue.get_nowait()


class StreamState:
    """The tokens of one request seen so far, per choice (n of them, 1 but
    for a request of n > 1), and the rule of docs/protocol.md for
    re-attaching: a token whose position the client already has is dropped.
    feed() turns a pushed message into the Chunk to hand out (None for one
    that carries nothing new) and raises LlmError for an error."""

    def __init__(self, resume_from, n=1, resume_from_choice=()):
        n = max(1, n or 1)
        self.haves = [resume_from] + [0] * (n - 1)
        for i, v in enumerate(list(resume_from_choice)[1:n], start=1):
            self.haves[i] = v
        self.dones = [None] * n  # each choice's last Chunk, once its GenerateDone came
        self.finished = None     # the last Chunk of the request, once every choice ended

    @property
    def have(self):
        return self.haves[0]

    def feed(self, env):
        kind = env.WhichOneof("body")
        if kind == "done":
            i = env.done.choice
            if i >= len(self.dones):
                raise LlmError(types_pb2.Error.Code.INTERNAL, f"GenerateDone of choice {i} of a request of "
                               f"n = {len(self.dones)}", env.done.request_id)
            self.dones[i] = done_chunk(env.done, self.haves[i])
            if all(d is not None for d in self.dones):
                self.finished = self.dones[i]
            return self.dones[i]
        if kind == "error":
            raise LlmError.from_pb(env.error)
        c = env.chunk
        if not c.token_ids and not c.text:
            # The router's check that the client is still there
            # (docs/router.md, "Clients that go away"): nothing to hand on.
            return None
        i = c.choice
        if i >= len(self.haves):
            raise LlmError(types_pb2.Error.Code.INTERNAL, f"a chunk of choice {i} of a request of "
                           f"n = {len(self.haves)}", c.request_id)
        ids = list(c.token_ids)
        lps = _logprobs(c.logprobs)
        skip = max(0, self.haves[i] - c.index)
        if ids and skip >= len(ids):
            return None
        if skip:
            # Replays start at resume_from, so a chunk never straddles what
            # the client has; were one to, its ids are cut but its text (whole
            # characters of all its tokens) cannot be, and is kept.
            ids, lps = ids[skip:], lps[skip:]
        self.haves[i] = max(self.haves[i], c.index + len(c.token_ids))
        return Chunk(c.index + skip, ids, c.text, lps, choice=i)


@dataclasses.dataclass
class Choice:
    """One choice of a whole generation (Completion.choices)."""
    index: int
    text: str
    token_ids: List[int]
    logprobs: List[TokenLogprob]
    finish_reason: str
    usage: Usage
    last: Chunk

    @property
    def accepted_prediction_tokens(self):
        """usage.accepted_prediction_tokens: this choice's drafts from the
        prediction that the cluster accepted."""
        return self.usage.accepted_prediction_tokens if self.usage else 0

    @property
    def rejected_prediction_tokens(self):
        """usage.rejected_prediction_tokens: this choice's drafts from the
        prediction that the cluster rejected."""
        return self.usage.rejected_prediction_tokens if self.usage else 0


def collect_chunks(chunks, n):
    """Each choice's (texts, token ids, logprobs, last chunk) from a
    stream's chunks."""
    parts = [([], [], [], None) for _ in range(n)]
    for ch in chunks:
        text, ids, lps, last = parts[ch.choice]
        text.append(ch.text)
        ids.extend(ch.token_ids)
        lps.extend(ch.logprobs)
        parts[ch.choice] = (text, ids, lps, ch if ch.finish_reason else last)
    return parts


@dataclasses.dataclass
class Completion:
    """A whole generation, as Generation.collect() returns it: text,
    token_ids, logprobs, finish_reason, usage and last are choice 0's (the
    only one unless n > 1); choices holds every choice, in order."""
    request_id: str
    text: str
    token_ids: List[int]
    logprobs: List[TokenLogprob]
    finish_reason: str
    usage: Usage
    accepted: Accepted
    last: Chunk
    choices: List[Choice] = dataclasses.field(default_factory=list)

    @property
    def accepted_prediction_tokens(self):
        """usage.accepted_prediction_tokens (choice 0's, as the other
        fields; each choice's is in choices[i].usage)."""
        return self.usage.accepted_prediction_tokens if self.usage else 0

    @property
    def rejected_prediction_tokens(self):
        """usage.rejected_prediction_tokens (choice 0's)."""
        return self.usage.rejected_prediction_tokens if self.usage else 0


def completion_of(gen, chunks):
    """Generation.collect()'s Completion from the chunks it read (and the
    ends the stream saw before)."""
    st = gen._state
    choices = []
    for i, (text, ids, lps, last) in enumerate(collect_chunks(chunks, len(st.dones))):
        last = last or st.dones[i]
        choices.append(Choice(i, "".join(text), ids, lps, last.finish_reason if last else None,
                              last.usage if last else None, last))
    c0 = choices[0]
    return Completion(gen.request_id, c0.text, c0.token_ids, c0.logprobs, c0.finish_reason, c0.usage, gen.accepted,
                      c0.last, choices)


class Generation:
    """One generate request: iterate it for Chunks.  The request is sent on
    the first next() (or start()), which raises LlmError when the router
    refuses it.  request_id is known before.  Iterating to the end (the
    chunk with finish_reason) releases it; close() releases one abandoned
    earlier (the request goes on running: cancel() stops it)."""

    def __init__(self, client, request_id, env, resume_from, idle_timeout):
        self._client = client
        self.request_id = request_id
        self._env = env
        g = env.generate
        self._state = StreamState(resume_from, g.n, g.resume_from_choice)
        self._idle_timeout = idle_timeout
        self.accepted = None
        self._closed = False

    @property
    def tokens_received(self):
        """Completion tokens this client has (choice 0's): resume_from for a
        re-attach."""
        return self._state.have

    @property
    def tokens_received_by_choice(self):
        """Completion tokens this client has of each choice: what a re-attach
        sends as resume_from (the first) and resume_from_choice."""
        return list(self._state.haves)

    @property
    def finish_reason(self):
        return self._state.finished.finish_reason if self._state.finished else None

    def start(self):
        if self.accepted is None:
            self.accepted = self._client._start(self)
        return self

    def __iter__(self):
        return self

    def __next__(self):
        if self._state.finished or self._closed:
            raise StopIteration
        self.start()
        while True:
            env = self._client._next_pushed(self.request_id, self._idle_timeout)
            try:
                chunk = self._state.feed(env)
            except LlmError:
                self.close()
                raise
            if chunk is None:
                continue
            if self._state.finished:
                self.close()
            return chunk

    def collect(self):
        """Reads the rest of the stream; returns a Completion (with every
        choice in choices)."""
        return completion_of(self, list(self))

    def cancel(self):
        return self._client.cancel(self.request_id)

    def close(self):
        self._closed = True
        self._client._streams.pop(self.request_id, None)


class Client:
    """A connection to the router.  timeout (seconds) bounds the wait for a
    direct reply (Accepted, Health, Status, Models, a cancel's GenerateDone);
    generate(idle_timeout=S) bounds the gap between a stream's messages
    (default: none, a queued request may wait long).  Both raise
    TimeoutError; a generation can then be re-attached by its request id.

    endpoint defaults to LLM_ROUTER.  The connection is CURVE-encrypted with
    curve_key_file (this client's NAME.key) and router_key (the router's
    NAME.pub), or with the keys themselves (curve_secretkey,
    curve_publickey, curve_serverkey: Z85), else with LLM_CURVE_KEY_FILE and
    LLM_ROUTER_KEY; insecure=True (or LLM_INSECURE=true) for a router
    without keys.  With none of these the constructor raises ValueError."""

    def __init__(self, endpoint=None, *, timeout=30.0, context=None, curve_key_file=None, router_key=None,
                 insecure=None, curve_secretkey=None, curve_publickey=None, curve_serverkey=None):
        self.endpoint = endpoint or _keys.default_endpoint()
        self.timeout = timeout
        self._sock = None
        self._ctx = context or zmq.Context.instance()
        self._sock = open_socket(self._ctx, self.endpoint, dict(
            curve_key_file=curve_key_file, router_key=router_key, insecure=insecure,
            curve_secretkey=curve_secretkey, curve_publickey=curve_publickey, curve_serverkey=curve_serverkey))
        self._seeds = SeedMemory()
        self._tag = 0
        self._replies = {}       # tag -> envelope of a direct reply
        self._streams = {}       # request_id -> deque of pushed envelopes
        self._cancel_waits = {}  # request_id -> GenerateDone envelope, None until it came

    def close(self):
        if self._sock is not None:
            self._sock.close(0)
            self._sock = None

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()

    # ---- the connection ---------------------------------------------------

    def _send(self, env):
        if self._sock is None:
            raise RuntimeError(f"llmcluster.Client({self.endpoint}) is closed")
        self._tag += 1
        env.version = PROTOCOL_VERSION
        env.tag = self._tag
        self._sock.send(env.SerializeToString())
        return self._tag

    def _dispatch(self, env):
        kind = env.WhichOneof("body")
        if kind in ("chunk", "done"):
            rid = getattr(env, kind).request_id
            q = self._streams.get(rid)
            if q is not None:
                q.append(env)
            if kind == "done" and rid in self._cancel_waits:
                self._cancel_waits[rid] = env
        elif env.tag:
            if kind == "accepted":
                discard_before_accepted(self._streams.get(env.accepted.request_id))
            self._replies[env.tag] = env
        elif kind == "error" and env.error.request_id in self._streams:
            self._streams[env.error.request_id].append(env)
        # else: a message for a stream no longer followed, or about a frame
        # the router could not read (tag 0, no request id): nothing waits.

    def _pump(self, ready, timeout, what):
        """Receives and dispatches until ready() is true; TimeoutError after
        timeout seconds (None: no limit) without it."""
        end = None if timeout is None else time.monotonic() + timeout
        while not ready():
            left = None if end is None else max(0.0, end - time.monotonic())
            if left is not None and left == 0.0:
                raise TimeoutError(f"{self.endpoint}: no {what} within {timeout} s")
            if self._sock.poll(None if left is None else int(left * 1000) + 1) == 0:
                continue
            env = pb.ClientEnvelope.FromString(self._sock.recv())
            self._dispatch(env)

    def _call(self, env, kind):
        tag = self._send(env)
        self._pump(lambda: tag in self._replies, self.timeout, f"answer to {kind}")
        reply = self._replies.pop(tag)
        if reply.WhichOneof("body") == "error":
            raise LlmError.from_pb(reply.error)
        return reply

    # ---- generation -------------------------------------------------------

    def generate(self, prompt=None, *, request_id=None, idle_timeout=None, **params):
        """A streamed generation (a Generation, iterable for Chunks).
        prompt is text (or prompt_tokens=[ids]); the other keywords are the
        GenerateRequest fields (model, max_tokens, stop, priority,
        deadline_ms, timeout_ms, stream, resume_from, n,
        resume_from_choice) and the SamplingParams fields (temperature,
        top_k, top_p, min_p, repetition_penalty, presence_penalty,
        frequency_penalty, penalty_last_n, seed, stop_token_ids, ignore_eos,
        logprobs, top_logprobs, and one of the constraints of
        docs/grammar.md: json_schema (a JSON Schema as a dict or its text),
        json_object=True, or grammar (GBNF text)).  Speculation: spec
        ("default", "off", "ngram", "draft", "auto"), spec_tokens (0 .. 16),
        and a predicted output as text (prediction, at most 262144 bytes) or
        token ids (prediction_tokens, at most 65536; not both); the output
        is the same with or without them, and a prediction's drafts accepted
        and rejected come in the usage of each choice's last chunk.  Sending the
        same request with the request_id of a known request re-attaches to
        it (resume_from: the tokens already held); the re-send carries the
        seed of the request's GenerateAccepted when seed is not given and
        this client saw it (else pass seed=generation.accepted.seed)."""
        env = pb.ClientEnvelope()
        self._seeds.fill(request_id, params)
        rid = request_id or new_request_id()
        build_generate(env, rid, prompt, params)
        return Generation(self, rid, env, env.generate.resume_from, idle_timeout)

    def _start(self, gen):
        # The stream is followed before the request goes out: its first
        # chunks may arrive right behind the Accepted.
        self._streams[gen.request_id] = collections.deque()
        try:
            reply = self._call(gen._env, "generate")
        except BaseException:
            self._streams.pop(gen.request_id, None)
            raise
        self._seeds.remember(gen.request_id, reply.accepted.seed)
        return accepted_from_pb(reply.accepted)

    def _next_pushed(self, rid, timeout):
        q = self._streams.get(rid)
        if q is None:
            raise RuntimeError(f"request {rid}: not followed by this client")
        self._pump(lambda: len(q) > 0, timeout, f"message of request {rid}")
        return q.popleft()

    def cancel(self, request_id):
        """Stops the request; returns its last Chunk (finish_reason
        "cancelled", or its real one if it had finished).  LlmError
        NOT_FOUND for an unknown id."""
        env = pb.ClientEnvelope()
        env.cancel.request_id = request_id
        self._cancel_waits[request_id] = None
        try:
            tag = self._send(env)
            self._pump(lambda: tag in self._replies or self._cancel_waits[request_id] is not None, self.timeout,
                       f"answer to cancel {request_id}")
            if tag in self._replies:
                raise LlmError.from_pb(self._replies.pop(tag).error)
            d = self._cancel_waits[request_id].done
            return done_chunk(d, d.usage.completion_tokens)
        finally:
            self._cancel_waits.pop(request_id, None)

    # ---- the cluster ------------------------------------------------------

    def health(self):
        env = pb.ClientEnvelope()
        env.health.SetInParent()
        return health_from_pb(self._call(env, "health").health_reply)

    def status(self):
        """The router's StatusReply (proto/client.proto): pipelines, workers,
        queue, KV blocks, throughput and counters."""
        env = pb.ClientEnvelope()
        env.status.SetInParent()
        return self._call(env, "status").status_reply

    def models(self):
        """The served models: a list of ModelInfo (id, architecture, n_vocab,
        n_ctx, n_layers, pipelines, is_default)."""
        env = pb.ClientEnvelope()
        env.models.SetInParent()
        return list(self._call(env, "models").models_reply.models)
