"""Client end of the store-master's raw-TCP control path (see
:mod:`kvmesh.services.store_master.wire`): one connection, many calls in flight, matched by id.

The event loop drives a plain non-blocking socket (``add_reader``), so a call can also
busy-poll for its answer: for up to ``poll_us`` after sending, the loop thread keeps
trying a non-blocking receive instead of going back to sleep in the loop, and an
answer that comes back inside the window costs no wake-up (tens of microseconds on a
VM, a third of a small get). Windows that run out make later calls skip polling
(:class:`kvmesh.rdma.wire.PollBackoff`), so a slow or busy master costs little spinning;
``poll_us=0`` never spins.

Under TLS (``ssl_ctx``, from :func:`kvmesh.services.common.channels.ssl_client_context`:
the gRPC certificate and CA) the socket is an :class:`ssl.SSLSocket`, handshaken before
the first call; reads and writes stay non-blocking and polled the same way.
"""

from __future__ import annotations

import asyncio
import socket
import ssl
import time

from kvmesh.rdma.wire import PollBackoff
from kvmesh.services.common.channels import ssl_handshake
from kvmesh.services.store_master.wire import HEAD, split_frames

POLL_BACKOFF = 16
_RECV_BYTES = 256 << 10
# a non-blocking socket, plain or TLS, that has nothing more to give or take now
_WOULD_BLOCK = (BlockingIOError, InterruptedError, ssl.SSLWantReadError, ssl.SSLWantWriteError)


class FastConnError(Exception):
    """The connection failed or the call timed out (the caller falls back to gRPC)."""


class CallError(Exception):
    """The master answered with an error status."""

    def __init__(self, status: int, details: str) -> None:
        super().__init__(f"status {status}: {details}")
        self.status, self.details = status, details


class FastConn:
    def __init__(self, sock: socket.socket, poll_us: int = 200) -> None:
        self.sock = sock
        self.fd = sock.fileno()
        self.buf = bytearray()
        self.out = bytearray()  # bytes the socket did not take yet (writer registered)
        self.pending: dict[int, tuple[asyncio.Future, float]] = {}
        self.next_id = 0
        self.closed = False
        self.poll_s = poll_us / 1e6
        self.backoff = PollBackoff(POLL_BACKOFF)
        self._watch: asyncio.TimerHandle | None = None
        self.loop = asyncio.get_running_loop()
        self.loop.add_reader(self.fd, self._on_readable)

    @classmethod
    async def connect(
        cls,
        addr: str,
        timeout: float = 3.0,
        poll_us: int = 200,
        ssl_ctx: ssl.SSLContext | None = None,
        server_name: str = "",
    ) -> FastConn:
        """Connects (TLS with ``ssl_ctx``, the server's certificate checked against
        ``server_name`` or the address's host)."""
        host, port = addr.rsplit(":", 1)
        loop = asyncio.get_running_loop()
        infos = await loop.getaddrinfo(host.strip("[]"), int(port), type=socket.SOCK_STREAM)
        err: BaseException = OSError(f"{addr}: no address")
        for family, stype, proto, _, sa in infos:  # every address, like create_connection
            sock = socket.socket(family, stype, proto)
            try:
                sock.setblocking(False)
                sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
                async with asyncio.timeout(timeout):
                    await loop.sock_connect(sock, sa)
                if ssl_ctx is not None:
                    sock = ssl_ctx.wrap_socket(
                        sock,
                        server_hostname=server_name or host.strip("[]"),
                        do_handshake_on_connect=False,
                    )
                    await ssl_handshake(sock, timeout)
                return cls(sock, poll_us)
            except (TimeoutError, OSError) as e:
                sock.close()
                err = e
            except BaseException:
                sock.close()
                raise
        raise err

    # -- socket events -----------------------------------------------------------------
    def _on_readable(self) -> None:
        while not self.closed:
            try:
                data = self.sock.recv(_RECV_BYTES)
            except _WOULD_BLOCK:
                return
            except OSError as e:
                self._fail_all(FastConnError(f"connection lost: {e}"))
                return
            if not data:
                self._fail_all(FastConnError("connection closed by the master"))
                return
            self.data_received(data)

    def _on_writable(self) -> None:
        self._flush()

    def _flush(self) -> None:
        try:
            n = self.sock.send(self.out)
        except _WOULD_BLOCK:
            return
        except OSError as e:
            self._fail_all(FastConnError(f"connection lost: {e}"))
            return
        del self.out[:n]
        if not self.out:
            self.loop.remove_writer(self.fd)

    def data_received(self, data: bytes) -> None:
        frames, oversized = split_frames(self.buf, data)
        pending = self.pending
        for rid, status, body in frames:
            item = pending.pop(rid, None)
            if item is None or item[0].done():
                continue  # timed out meanwhile
            if status == 0:
                item[0].set_result(body)
            else:
                item[0].set_exception(CallError(status, body.decode(errors="replace")))
        if oversized:
            self.close()

    # -- calls -------------------------------------------------------------------------
    def call(self, method: int, body: bytes, timeout: float) -> asyncio.Future:
        fut = self.loop.create_future()
        if self.closed:
            fut.set_exception(FastConnError("closed"))
            return fut
        self.next_id = rid = (self.next_id + 1) & 0xFFFFFFFF
        self.pending[rid] = (fut, time.monotonic() + timeout)
        frame = HEAD.pack(len(body), rid, method) + body
        if self.out:
            self.out += frame
        else:
            try:
                n = self.sock.send(frame)
            except _WOULD_BLOCK:
                n = 0
            except OSError as e:
                self._fail_all(FastConnError(f"connection lost: {e}"))
                return fut
            if n < len(frame):
                self.out += frame[n:]
                self.loop.add_writer(self.fd, self._on_writable)
        if self._watch is None:
            self._watch = self.loop.call_later(0.25, self._check)
        if self.poll_s > 0 and not self.out and self.backoff.should_poll():
            self._poll(fut)
        return fut

    def _poll(self, fut: asyncio.Future) -> None:
        deadline = time.perf_counter() + self.poll_s
        while not fut.done() and not self.closed:
            if time.perf_counter() > deadline:
                self.backoff.missed()
                return
            self._on_readable()
        if fut.done() and not self.closed:
            self.backoff.caught()

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
        if not self.closed:
            self.closed = True
            self.loop.remove_reader(self.fd)
            if self.out:
                self.loop.remove_writer(self.fd)
                self.out.clear()
            self.sock.close()
        pending, self.pending = self.pending, {}
        for fut, _ in pending.values():
            if not fut.done():
                fut.set_exception(exc)
        if self._watch is not None:
            self._watch.cancel()
            self._watch = None

    def close(self) -> None:
        self._fail_all(FastConnError("closed"))
