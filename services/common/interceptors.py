"""The one handler wrapper behind kvmesh's gRPC server interceptors.

A ``grpc.aio.ServerInterceptor`` that wants to run code around an RPC (check its API key,
open a span, refuse undecodable bytes) gets the method's ``RpcMethodHandler`` and must
return one of the same kind. :func:`wrap_handler` builds it for all four kinds
(unary-unary, unary-stream, stream-unary, stream-stream), so no interceptor can let a
kind through unwrapped: the interceptor says only *what* runs around the call.
"""

from __future__ import annotations

import inspect
from collections.abc import AsyncIterator, Awaitable, Callable
from contextlib import AbstractAsyncContextManager
from typing import Any

import grpc

# Entered (in the RPC's own task) before the handler runs and left when the call ends,
# with the handler's exception if it raised; raising on entry refuses the call.
Around = Callable[[grpc.aio.ServicerContext], AbstractAsyncContextManager[Any]]
# Awaited on every request message before the handler sees it (may abort the call).
RequestCheck = Callable[[Any, grpc.aio.ServicerContext], Awaitable[None]]

KEEP: Any = object()  # request_deserializer: keep the handler's own


def wrap_handler(
    handler: grpc.RpcMethodHandler,
    around: Around,
    *,
    request_deserializer: Callable[[bytes], Any] | None = KEEP,
    check_request: RequestCheck | None = None,
) -> grpc.RpcMethodHandler:
    """A handler of ``handler``'s kind that runs it inside ``around(context)``.

    ``request_deserializer`` replaces the handler's (``None``: requests stay raw bytes,
    e.g. for a refusal that never reads them). ``check_request`` sees each request message
    first: the one of a unary-request call, and every message a streaming-request
    handler takes from its request iterator."""
    deserializer = (
        handler.request_deserializer if request_deserializer is KEEP else request_deserializer
    )
    kw = {"request_deserializer": deserializer, "response_serializer": handler.response_serializer}

    async def checked(requests: AsyncIterator[Any], ctx) -> AsyncIterator[Any]:
        async for request in requests:
            if check_request is not None:
                await check_request(request, ctx)
            yield request

    if handler.unary_unary is not None:
        uu = handler.unary_unary

        async def unary_unary(request, ctx):
            async with around(ctx):
                if check_request is not None:
                    await check_request(request, ctx)
                return await _result(uu(request, ctx))

        return grpc.unary_unary_rpc_method_handler(unary_unary, **kw)
    if handler.unary_stream is not None:
        us = handler.unary_stream

        async def unary_stream(request, ctx):
            async with around(ctx):
                if check_request is not None:
                    await check_request(request, ctx)
                async for item in _items(us(request, ctx)):
                    yield item

        return grpc.unary_stream_rpc_method_handler(unary_stream, **kw)
    if handler.stream_unary is not None:
        su = handler.stream_unary

        async def stream_unary(requests, ctx):
            async with around(ctx):
                return await _result(su(checked(requests, ctx), ctx))

        return grpc.stream_unary_rpc_method_handler(stream_unary, **kw)
    ss = handler.stream_stream
    if ss is None:
        raise ValueError("wrap_handler: the handler has no behaviour of any kind")

    async def stream_stream(requests, ctx):
        async with around(ctx):
            async for item in _items(ss(checked(requests, ctx), ctx)):
                yield item

    return grpc.stream_stream_rpc_method_handler(stream_stream, **kw)


async def _result(value: Any) -> Any:
    """A unary behaviour's answer, whether it is a coroutine function or a plain one."""
    return await value if inspect.isawaitable(value) else value


async def _items(value: Any) -> AsyncIterator[Any]:
    """A streaming behaviour's messages: it is an async generator, or a coroutine that
    writes them itself with ``context.write`` (then this yields nothing)."""
    if hasattr(value, "__aiter__"):
        async for item in value:
            yield item
    elif inspect.isawaitable(value):
        await value
    else:  # a sync generator
        for item in value:
            yield item
