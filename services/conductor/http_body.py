"""The HTTP API's request bodies, read without unbounded work on the conductor's event
loop (issue 34): every stream the conductor serves shares that loop, so a body that takes
a second to parse is a second-long gap in every stream's tokens.

- Size: at most :data:`MAX_BODY_BYTES` on the wire (413), and at most that once inflated.
  The body is kept as the chunks aiohttp received (its ``read`` grows and copies one
  buffer on the loop: 50-80 ms of stalled loop for 15 MB on a busy machine).
- Compression: ``Content-Encoding`` gzip or deflate (or identity). aiohttp's own inflation
  is off (``auto_decompress=False`` in ``http_api``): it inflated a body in full even when
  nobody read it (a 401, 404 or 405 drained it after the reply: a 1 MB gzip bomb cost the
  loop seconds). Here a body is inflated only when read, incrementally, and refused (413)
  as soon as it would pass the limit; other encodings (br, zstd, ...) get a 415.
- Structure: before ``json.loads`` runs, a scan at C speed (``bytes.count`` and friends,
  strings set aside) counts the body's values - arrays' elements and objects' members. A
  body with more than a request can need is refused (400) unparsed: a prompt of token ids
  holds at most the model's context, so ``{"prompt": [1] * 7_800_000}`` never reaches the
  parser. While parsing, an object with more than :data:`MAX_KEYS` keys is refused.
- Where: a small body (:data:`INLINE_BYTES`) is parsed on the loop (a millisecond at
  most); a larger or compressed one in a worker thread (:func:`_executor`, one thread),
  whose C calls each take one bounded step (:data:`STEP` bytes) while holding the GIL,
  so the loop waits for it a millisecond or so at a time.

Every refusal is an :class:`~kvmesh.services.conductor.http_request.ApiError` saying what
to send instead.
"""

from __future__ import annotations

import asyncio
import json
import zlib
from collections.abc import Callable, Iterable
from concurrent.futures import ThreadPoolExecutor
from typing import Any

from aiohttp import web

from kvmesh.services.conductor.http_request import MAX_BODY_BYTES, ApiError

INLINE_BYTES = 64 << 10  # bodies up to this (uncompressed) are parsed on the event loop
STEP = 1 << 20  # bytes a worker thread counts, copies or inflates per GIL-holding call
MAX_KEYS = 1024  # keys of one JSON object (a request has a few dozen fields)
# JSON values a body may hold: VALUES_PER_TOKEN per token of the largest context served
# (a prompt of token ids, or chat messages of a few values each), plus VALUES_SLACK
VALUES_PER_TOKEN = 4
VALUES_SLACK = 4096
DEFAULT_CONTEXT = 4096  # when no served model says its context yet
ENCODINGS = ("gzip", "x-gzip", "deflate", "identity")

_pool: ThreadPoolExecutor | None = None


def _executor() -> ThreadPoolExecutor:
    """The one thread large bodies are inflated and parsed in. One, so that a burst of
    hostile bodies queues there rather than crowding the loop thread out of the GIL."""
    global _pool
    if _pool is None:
        _pool = ThreadPoolExecutor(1, thread_name_prefix="kvmesh-http-body")
    return _pool


def max_values(context: int) -> int:
    """The most JSON values a body may hold when the largest context served is
    ``context`` tokens (0: not known yet)."""
    return VALUES_PER_TOKEN * (context or DEFAULT_CONTEXT) + VALUES_SLACK


def _too_large(what: str) -> ApiError:
    return ApiError(
        413,
        f"the request body {what} the {MAX_BODY_BYTES >> 20} MiB limit; send a shorter prompt",
        code="request_too_large",
    )


def encoding_of(request: web.Request) -> str:
    """The body's content coding ("" for none); ApiError 415 for one not supported."""
    enc = request.headers.get("Content-Encoding", "").strip().lower()
    if enc in ("", "identity"):
        return ""
    if enc not in ENCODINGS:
        raise ApiError(
            415,
            f"Content-Encoding {enc[:40]!r} is not supported; send the body uncompressed, "
            f"or compressed with gzip or deflate",
            code="unsupported_media_type",
        )
    return "gzip" if enc == "x-gzip" else enc


def inflate(chunks: Iterable[bytes], encoding: str, cap: int = MAX_BODY_BYTES) -> list[bytes]:
    """``chunks`` (gzip, possibly several members, or deflate with or without its zlib
    header) inflated, in pieces of at most :data:`STEP` bytes; ApiError 413 as soon as
    the output would pass ``cap`` bytes: never more than ``cap + 1`` bytes are inflated,
    whatever the body claims."""
    out: list[bytes] = []
    total = 0
    d: Any = None
    try:
        for data in chunks:
            while data:
                if d is None:  # RFC 1950 says deflate is zlib-wrapped; some send it raw
                    raw = encoding == "deflate" and data[0] & 0x0F != 8
                    wbits = 16 + zlib.MAX_WBITS if encoding == "gzip" else zlib.MAX_WBITS
                    d = zlib.decompressobj(-zlib.MAX_WBITS if raw else wbits)
                piece = d.decompress(data, min(STEP, cap + 1 - total))
                total += len(piece)
                if total > cap:
                    raise _too_large(f"inflates ({encoding}) past")
                if piece:
                    out.append(piece)
                if d.unconsumed_tail:  # the piece is full: more of this input to inflate
                    data = d.unconsumed_tail
                elif d.eof:  # a member ended: what follows is the next gzip member
                    data = d.unused_data
                    if data and encoding != "gzip":
                        raise ApiError(400, f"the {encoding} request body has trailing bytes")
                    d = None
                else:
                    data = b""
    except zlib.error as e:
        raise ApiError(400, f"the request body is not valid {encoding} ({e})") from None
    if d is not None:
        raise ApiError(400, f"the {encoding} request body is truncated")
    return out


def _count(buf: bytes | bytearray, sub: bytes, start: int = 0, end: int = -1) -> int:
    """``buf.count(sub, start, end)`` (``sub`` one byte) in :data:`STEP`-sized calls: a
    thread counting a large body holds the GIL one step at a time."""
    end = len(buf) if end < 0 else end
    return sum(buf.count(sub, i, min(i + STEP, end)) for i in range(start, end, STEP))


def check_values(chunks: list[bytes], limit: int, context: int) -> None:
    """ApiError 400 when the body (``chunks``) holds more than ``limit`` JSON values
    (arrays' elements and objects' members: the commas outside strings, plus one). At C
    speed, one chunk at a time: in the usual case (few commas in all) by counting commas
    alone; otherwise the commas inside strings are found by their quotes (at most
    ``limit`` strings, or the body is refused for them). Exact for valid JSON; for
    invalid JSON the count matches ``json.loads``'s view up to where that fails."""
    n = sum(_count(c, b",") for c in chunks) + 1
    if n <= limit:
        return
    why = (
        f"at most {limit} are accepted (a prompt of token ids holds at most the model's "
        f"context, {context or DEFAULT_CONTEXT} tokens; a request needs a few dozen more)"
    )
    if any(c.find(b"\\") >= 0 for c in chunks):  # escapes: drop escaped backslashes,
        body = b"".join(chunks).replace(b"\\\\", b"").replace(b'\\"', b"")  # then quotes
        chunks = [body[i : i + STEP] for i in range(0, len(body), STEP)]
    quotes = sum(_count(c, b'"') for c in chunks)
    if quotes > 4 * limit + 4:  # a key and a value per member, at most
        raise ApiError(400, f"the request body holds {quotes // 2} JSON strings; {why}")
    inside = False  # the commas inside strings are not values
    for c in chunks:
        pos = 0
        while (q := c.find(b'"', pos)) >= 0:
            if inside:
                n -= _count(c, b",", pos, q)
            inside, pos = not inside, q + 1
        if inside:
            n -= _count(c, b",", pos)
    if n > limit:
        raise ApiError(
            400,
            f"the request body holds {n} JSON values (arrays' elements and objects' "
            f"members); {why}",
        )


@web.middleware
async def close_unread(request: web.Request, handler) -> web.StreamResponse:
    """A reply that leaves the request's body unread (401, 404, 405, 413, ...) closes the
    connection (``Connection: close``), and with ``lingering_time=0`` aiohttp does not
    drain the rest first: the body is never read, let alone inflated (issue 34)."""
    resp = await handler(request)
    if not request.content.is_eof():
        resp.force_close()
    return resp


class _TooManyKeys(Exception):
    pass


def _object(pairs: list[tuple[str, Any]]) -> dict:
    if len(pairs) > MAX_KEYS:
        raise _TooManyKeys(len(pairs))
    return dict(pairs)


def _no_constant(name: str) -> Any:
    raise ValueError(f"{name} is not a JSON value")


def decode_body(chunks: list[bytes], encoding: str, context: int) -> dict:
    """The request's JSON object from its body (``chunks`` as received; ``encoding``:
    "" or a supported content coding; ``context``: the largest context served, 0 if none
    is known yet); ApiError otherwise. Bounded work: see the module docstring."""
    if encoding:
        chunks = inflate(chunks, encoding)
    check_values(chunks, max_values(context), context)
    try:
        obj = json.loads(
            b"".join(chunks).decode("utf-8"), parse_constant=_no_constant, object_pairs_hook=_object
        )
    except UnicodeDecodeError:
        raise ApiError(400, "the request body must be JSON in UTF-8") from None
    except RecursionError:
        raise ApiError(
            400, "the request body nests arrays or objects too deeply to be a request"
        ) from None
    except _TooManyKeys as e:
        raise ApiError(
            400,
            f"an object in the request body has {e.args[0]} keys; at most {MAX_KEYS} are "
            f"accepted (a request has a few dozen fields)",
        ) from None
    except ValueError as e:
        raise ApiError(400, f"the request body must be JSON ({e})") from None
    if not isinstance(obj, dict):
        raise ApiError(400, "the request body must be a JSON object")
    return obj


async def read_chunks(request: web.Request) -> list[bytes]:
    """The body as received (not joined: aiohttp's ``read`` grows and copies one buffer
    on the loop, tens of milliseconds for 16 MiB); ApiError 413 once past the limit."""
    chunks: list[bytes] = []
    size = 0
    try:
        while chunk := await request.content.readany():
            size += len(chunk)
            if size > MAX_BODY_BYTES:
                raise _too_large("is larger than")
            chunks.append(chunk)
    except ConnectionError:  # the client stopped short of its Content-Length, and left
        raise ApiError(
            400, "the connection closed before the whole body (its Content-Length) arrived"
        ) from None
    return chunks


async def read_body(request: web.Request, context: Callable[[], int]) -> dict:
    """The request's JSON object; ApiError 413, 415 or 400 otherwise. ``context()``: the
    largest context of the models served (0: none known yet)."""
    encoding = encoding_of(request)
    chunks = await read_chunks(request)
    ctx = context()
    if not encoding and sum(map(len, chunks)) <= INLINE_BYTES:
        return decode_body(chunks, "", ctx)
    loop = asyncio.get_running_loop()
    return await loop.run_in_executor(_executor(), decode_body, chunks, encoding, ctx)
