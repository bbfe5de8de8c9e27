"""The asyncio client (zmq.asyncio): the same calls as Client, awaited, and
generate() as an async iterator.  One AsyncClient is one DEALER connection;
any number of generations and calls may be in flight on it at once from
tasks of one event loop: a reader task hands each message to the call or
stream it belongs to (direct replies by tag, pushed chunks by request id)."""

import asyncio

import zmq
import zmq.asyncio

from ._pb import client_pb2 as pb
from . import keys as _keys
from .client import (PROTOCOL_VERSION, LlmError, SeedMemory, StreamState, accepted_from_pb, build_generate,
                     completion_of, discard_before_accepted, done_chunk, health_from_pb, new_request_id,
                     open_socket)


class AsyncGeneration:
    """One generate request: `async for chunk in gen`.  Sent on the first
    step (or `await gen.start()`), which raises LlmError when the router
    refuses it.  Iterating to the end releases it; close() releases one
    abandoned earlier (the request goes on running: cancel() stops it)."""

    def __init__(self, client, request_id, env, resume_from, idle_timeout):
        self._client = client
        self.request_id = request_id
        self._env = env
        g = env.generate
        self._state = StreamState(resume_from, g.n, g.resume_from_choice)
        self._idle_timeout = idle_timeout
        self._queue = None
        self.accepted = None
        self._closed = False

    @property
    def tokens_received(self):
        return self._state.have

    @property
    def tokens_received_by_choice(self):
        return list(self._state.haves)

    @property
    def finish_reason(self):
        return self._state.finished.finish_reason if self._state.finished else None

    async def start(self):
        if self.accepted is None:
            self._queue = asyncio.Queue()
            self.accepted = await self._client._start(self)
        return self

    def __aiter__(self):
        return self

    async def __anext__(self):
        if self._state.finished or self._closed:
            raise StopAsyncIteration
        await self.start()
        while True:
            try:
                env = await asyncio.wait_for(self._queue.get(), self._idle_timeout)
            except asyncio.TimeoutError:
                raise TimeoutError(f"{self._client.endpoint}: no message of request {self.request_id} "
                                   f"within {self._idle_timeout} s") from None
            if isinstance(env, BaseException):
                self.close()
                raise env
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

    async def collect(self):
        return completion_of(self, [ch async for ch in self])

    async def cancel(self):
        return await self._client.cancel(self.request_id)

    def close(self):
        self._closed = True
        if self._client._streams.get(self.request_id) is self._queue:
            self._client._streams.pop(self.request_id, None)


class AsyncClient:
    """A connection to the router for asyncio code.  timeout bounds the wait
    for a direct reply; generate(idle_timeout=S) the gap between a stream's
    messages (default none).  Both raise TimeoutError.  Use
    `async with AsyncClient(ep) as c:` or call `await c.close()`.  The
    endpoint and the keys are chosen as Client's."""

    def __init__(self, endpoint=None, *, timeout=30.0, context=None, curve_key_file=None, router_key=None,
                 insecure=None, curve_secretkey=None, curve_publickey=None, curve_serverkey=None):
        self.endpoint = endpoint or _keys.default_endpoint()
        self.timeout = timeout
        self._sock = None
        self._reader = None
        self._ctx = context or zmq.asyncio.Context.instance()
        self._sock = open_socket(self._ctx, self.endpoint, dict(
            curve_key_file=curve_key_file, router_key=router_key, insecure=insecure,
            curve_secretkey=curve_secretkey, curve_publickey=curve_publickey, curve_serverkey=curve_serverkey))
        self._seeds = SeedMemory()
        self._tag = 0
        self._replies = {}        # tag -> Future of the direct reply
        self._streams = {}        # request_id -> asyncio.Queue of pushed envelopes
        self._cancel_waits = {}   # request_id -> Future of its GenerateDone

    async def close(self):
        if self._reader is not None:
            self._reader.cancel()
            try:
                await self._reader
            except asyncio.CancelledError:
                pass
            self._reader = None
        if self._sock is not None:
            self._sock.close(0)
            self._sock = None

    async def __aenter__(self):
        return self

    async def __aexit__(self, *exc):
        await self.close()

    # ---- the connection ---------------------------------------------------

    async def _read(self):
        try:
            while True:
                env = pb.ClientEnvelope.FromString(await self._sock.recv())
                self._dispatch(env)
        except asyncio.CancelledError:
            raise
        except Exception as e:  # the socket failed: everything waiting hears it
            for f in list(self._replies.values()) + list(self._cancel_waits.values()):
                if not f.done():
                    f.set_exception(e)
            for q in self._streams.values():
                q.put_nowait(e)
            raise

    def _dispatch(self, env):
        kind = env.WhichOneof("body")
        if kind in ("chunk", "done"):
            rid = getattr(env, kind).request_id
            q = self._streams.get(rid)
            if q is not None:
                q.put_nowait(env)
            f = self._cancel_waits.get(rid)
            if kind == "done" and f is not None and not f.done():
                f.set_result(env)
        elif env.tag:
            if kind == "accepted":
                discard_before_accepted(self._streams.get(env.accepted.request_id))
            f = self._replies.pop(env.tag, None)
            if f is not None and not f.done():
                f.set_result(env)
        elif kind == "error" and env.error.request_id in self._streams:
            self._streams[env.error.request_id].put_nowait(env)

    def _prepare(self, env):
        if self._sock is None:
            raise RuntimeError(f"llmcluster.AsyncClient({self.endpoint}) is closed")
        if self._reader is None:
            self._reader = asyncio.get_running_loop().create_task(self._read())
        self._tag += 1
        env.version = PROTOCOL_VERSION
        env.tag = self._tag
        return self._tag

    async def _call(self, env, kind, also=None):
        tag = self._prepare(env)
        fut = asyncio.get_running_loop().create_future()
        self._replies[tag] = fut
        waits = {fut} if also is None else {fut, also}
        try:
            await self._sock.send(env.SerializeToString())
            done, _ = await asyncio.wait(waits, timeout=self.timeout, return_when=asyncio.FIRST_COMPLETED)
        finally:
            self._replies.pop(tag, None)
        if not done:
            raise TimeoutError(f"{self.endpoint}: no answer to {kind} within {self.timeout} s")
        reply = (fut if fut in done else also).result()
        if reply.WhichOneof("body") == "error":
            raise LlmError.from_pb(reply.error)
        return reply

    # ---- generation -------------------------------------------------------

    def generate(self, prompt=None, *, request_id=None, idle_timeout=None, **params):
        """As Client.generate; returns an AsyncGeneration (`async for`)."""
        env = pb.ClientEnvelope()
        self._seeds.fill(request_id, params)
        rid = request_id or new_request_id()
        build_generate(env, rid, prompt, params)
        return AsyncGeneration(self, rid, env, env.generate.resume_from, idle_timeout)

    async def _start(self, gen):
        self._streams[gen.request_id] = gen._queue
        try:
            reply = await self._call(gen._env, "generate")
        except BaseException:
            self._streams.pop(gen.request_id, None)
            raise
        self._seeds.remember(gen.request_id, reply.accepted.seed)
        return accepted_from_pb(reply.accepted)

    async def cancel(self, request_id):
        """As Client.cancel."""
        env = pb.ClientEnvelope()
        env.cancel.request_id = request_id
        done = asyncio.get_running_loop().create_future()
        self._cancel_waits[request_id] = done
        try:
            reply = await self._call(env, f"cancel {request_id}", also=done)
        finally:
            self._cancel_waits.pop(request_id, None)
        return done_chunk(reply.done, reply.done.usage.completion_tokens)

    # ---- the cluster ------------------------------------------------------

    async def health(self):
        env = pb.ClientEnvelope()
        env.health.SetInParent()
        return health_from_pb((await self._call(env, "health")).health_reply)

    async def status(self):
        env = pb.ClientEnvelope()
        env.status.SetInParent()
        return (await self._call(env, "status")).status_reply

    async def models(self):
        env = pb.ClientEnvelope()
        env.models.SetInParent()
        return list((await self._call(env, "models")).models_reply.models)
