"""llmcluster: a Python client of the cluster's ZeroMQ protocol
(docs/protocol.md).  Client (blocking) and AsyncClient (asyncio) send
generate requests and stream their chunks, cancel and re-attach by request
id, and ask the router for health, status and models.

The protobuf modules come from `python3 -m llmcluster.build` (protoc over
proto/*.proto); they are loaded on first use of the names below, so that the
build step itself runs without them."""

__all__ = ["Client", "AsyncClient", "Generation", "AsyncGeneration", "Chunk", "Completion", "Choice", "TokenLogprob",
           "TopLogprob", "Usage", "Accepted", "Health", "LlmError", "PROTOCOL_VERSION",
           "choice_seed"]


def __getattr__(name):
    if name in ("AsyncClient", "AsyncGeneration"):
        from . import aio
        return getattr(aio, name)
    if name in __all__:
        from . import client
        return getattr(client, name)
    raise AttributeError(f"module 'llmcluster' has no attribute {name!r}")
