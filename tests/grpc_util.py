"""A tiny real grpc.aio server with one method of each of the four kinds, for tests of
server interceptors (raw bytes in and out, no generated code)."""

from __future__ import annotations

import asyncio
import concurrent.futures
import contextlib
from collections.abc import AsyncIterator, Callable, Coroutine
from typing import Any

import grpc

from kvmesh.services.common.channels import make_server

KINDS = ("unary_unary", "unary_stream", "stream_unary", "stream_stream")
METHOD = {kind: "".join(w.title() for w in kind.split("_")) for kind in KINDS}


def probe_handler(service: str, probe: Callable[[], bytes]) -> grpc.GenericRpcHandler:
    """``/<service>/UnaryUnary`` ... ``/<service>/StreamStream``: each reads its request(s)
    and answers ``probe()`` as seen inside the handler (once, or twice for a stream)."""

    async def unary_unary(request: bytes, ctx) -> bytes:
        return probe()

    async def unary_stream(request: bytes, ctx) -> AsyncIterator[bytes]:
        for _ in range(2):
            yield probe()

    async def stream_unary(requests: AsyncIterator[bytes], ctx) -> bytes:
        async for _ in requests:
            pass
        return probe()

    async def stream_stream(requests: AsyncIterator[bytes], ctx) -> AsyncIterator[bytes]:
        async for _ in requests:
            yield probe()

    return grpc.method_handlers_generic_handler(
        service,
        {
            "UnaryUnary": grpc.unary_unary_rpc_method_handler(unary_unary),
            "UnaryStream": grpc.unary_stream_rpc_method_handler(unary_stream),
            "StreamUnary": grpc.stream_unary_rpc_method_handler(stream_unary),
            "StreamStream": grpc.stream_stream_rpc_method_handler(stream_stream),
        },
    )


@contextlib.asynccontextmanager
async def serving(
    handlers: list[grpc.GenericRpcHandler], interceptors: list
) -> AsyncIterator[grpc.aio.Channel]:
    """A server on a loopback port chosen by the kernel, and a channel to it."""
    server = make_server(interceptors)  # the options of every kvmesh server
    server.add_generic_rpc_handlers(tuple(handlers))
    port = server.add_insecure_port("127.0.0.1:0")
    await server.start()
    try:
        async with grpc.aio.insecure_channel(f"127.0.0.1:{port}") as channel:
            yield channel
    finally:
        await server.stop(None)


async def call(
    channel: grpc.aio.Channel, service: str, kind: str, metadata: tuple = ()
) -> list[bytes]:
    """Calls the ``kind`` method with two request messages (one for a unary request);
    returns every answer."""
    path = f"/{service}/{METHOD[kind]}"
    if kind == "unary_unary":
        return [await channel.unary_unary(path)(b"q", metadata=metadata, timeout=10)]
    if kind == "unary_stream":
        return [r async for r in channel.unary_stream(path)(b"q", metadata=metadata, timeout=10)]

    async def requests() -> AsyncIterator[bytes]:
        yield b"q1"
        yield b"q2"

    if kind == "stream_unary":
        return [await channel.stream_unary(path)(requests(), metadata=metadata, timeout=10)]
    return [r async for r in channel.stream_stream(path)(requests(), metadata=metadata, timeout=10)]


async def refusal(
    channel: grpc.aio.Channel, service: str, kind: str, metadata: tuple = ()
) -> tuple[grpc.StatusCode, str]:
    """The status of a call the server refuses at its start (code, details). A call with a
    request stream sends no message here: a message racing the server's refusal may fail
    on the client's side first ("Internal error from Core") and hide the server's status."""
    path = f"/{service}/{METHOD[kind]}"
    if kind.startswith("unary_"):
        try:
            await call(channel, service, kind, metadata)
        except grpc.aio.AioRpcError as e:
            return e.code(), e.details() or ""
        raise AssertionError(f"{path} was not refused")
    factory = channel.stream_unary if kind == "stream_unary" else channel.stream_stream
    rpc = factory(path)(metadata=metadata, timeout=10)
    code = await rpc.code()
    return code, await rpc.details() or ""


def in_thread(coro: Coroutine[Any, Any, Any]) -> Any:
    """Runs ``coro`` on its own event loop in its own thread (grpc.aio state stays out of
    the test process's other loops)."""
    with concurrent.futures.ThreadPoolExecutor(1) as ex:
        return ex.submit(asyncio.run, coro).result(60)
