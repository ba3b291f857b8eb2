"""Client end of the store-master's raw-TCP control path (see
:mod:`services.store_master.wire`): one connection, many calls in flight, matched by id."""

from __future__ import annotations

import asyncio
import time

from services.store_master.wire import HEAD, HEAD_SIZE, MAX_FRAME, set_nodelay


class FastConnError(Exception):
    """The connection failed or the call timed out (the caller falls back to gRPC)."""


class CallError(Exception):
    """The master answered with an error status."""

    def __init__(self, status: int, details: str) -> None:
        super().__init__(f"status {status}: {details}")
        self.status, self.details = status, details


class FastConn(asyncio.Protocol):
    def __init__(self) -> None:
        self.t: asyncio.Transport | None = None
        self.buf = bytearray()
        self.pending: dict[int, tuple[asyncio.Future, float]] = {}
        self.next_id = 0
        self.closed = False
        self._watch: asyncio.TimerHandle | None = None
        self.loop = asyncio.get_running_loop()

    @classmethod
    async def connect(cls, addr: str, timeout: float = 3.0) -> "FastConn":
        host, port = addr.rsplit(":", 1)
        loop = asyncio.get_running_loop()
        _, conn = await asyncio.wait_for(
            loop.create_connection(cls, host.strip("[]"), int(port)), timeout)
        return conn

    # -- protocol ----------------------------------------------------------------------
    def connection_made(self, transport) -> None:
        self.t = transport
        set_nodelay(transport)

    def connection_lost(self, exc) -> None:
        self._fail_all(FastConnError(f"connection lost: {exc}"))

    def data_received(self, data: bytes) -> None:
        buf = self.buf
        if buf:
            buf += data
            data = bytes(buf)
            buf.clear()
        pos, end = 0, len(data)
        pending = self.pending
        while end - pos >= HEAD_SIZE:
            n, rid, status = HEAD.unpack_from(data, pos)
            if n > MAX_FRAME:
                self.close()
                return
            if end - pos - HEAD_SIZE < n:
                break
            body = data[pos + HEAD_SIZE:pos + HEAD_SIZE + n]
            pos += HEAD_SIZE + n
            item = pending.pop(rid, None)
            if item is None or item[0].done():
                continue  # timed out meanwhile
            if status == 0:
                item[0].set_result(body)
            else:
                item[0].set_exception(CallError(status, body.decode(errors="replace")))
        if pos < end:
            buf += data[pos:]

    # -- calls -------------------------------------------------------------------------
    def call(self, method: int, body: bytes, timeout: float) -> asyncio.Future:
        fut = self.loop.create_future()
        if self.closed or self.t is None:
            fut.set_exception(FastConnError("closed"))
            return fut
        self.next_id = rid = (self.next_id + 1) & 0xFFFFFFFF
        self.pending[rid] = (fut, time.monotonic() + timeout)
        self.t.write(HEAD.pack(len(body), rid, method) + body)
        if self._watch is None:
            self._watch = self.loop.call_later(0.25, self._check)
        return fut

    def _check(self) -> None:
        self._watch = None
        now = time.monotonic()
        for rid, (fut, deadline) in list(self.pending.items()):
            if deadline < now:
                del self.pending[rid]
                if not fut.done():
                    fut.set_exception(FastConnError("timed out"))
        if self.pending and not self.closed:
            self._watch = self.loop.call_later(0.25, self._check)

    def _fail_all(self, exc: Exception) -> None:
        self.closed = True
        pending, self.pending = self.pending, {}
        for fut, _ in pending.values():
            if not fut.done():
                fut.set_exception(exc)
        if self._watch is not None:
            self._watch.cancel()
            self._watch = None

    def close(self) -> None:
        if self.t is not None:
            self.t.close()
        self._fail_all(FastConnError("closed"))
