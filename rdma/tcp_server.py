"""Server side of the TCP transport (:class:`kvmesh.rdma.tcp.TcpTransport`).

:func:`kvmesh.rdma.tcp_accept.accept_loop` accepts connections and authenticates them
(with a deadline for the whole handshake and a cap on connections); it starts one
:func:`serve` thread per authenticated connection, which sends the handshake's last
message and then serves the peer's requests (:func:`serve_requests`): WRITE payloads are
``recv_into``'d straight into the registered region, READ data goes out zero-copy from
it, NOTIFY payloads go to the transport's ``on_notify`` callback, and acks are coalesced
into few ``sendmsg`` s.  While it waits for the next request (or for a WRITE payload of
up to ``POLL_MAX_BYTES``) the thread busy-polls the socket for up to the transport's
``poll_s`` before it blocks (:func:`kvmesh.rdma.wire.recv_spin`), if one of the transport's
few spinner slots is free (at most ``TcpTransport.spinners`` threads spin at once,
however many connections there are) and its :class:`~rdma.wire.PollBackoff` agrees.

These functions see the transport through :class:`~kvmesh.rdma.tcp_proto.TcpEndpoint`
(settings, counters, the ``corrupt_next`` fault hook) and a :class:`ServerState` the
transport owns (listener, region table, notify callback, live connections).
"""

from __future__ import annotations

import logging
import socket
import threading
import time
import zlib
from collections.abc import Callable

from .tcp_proto import (
    F_CRC,
    MAX_NOTIFY_BYTES,
    POLL_BACKOFF,
    REPLY,
    ST_BAD_ACCESS,
    ST_CHECKSUM,
    ST_OK,
    TcpEndpoint,
)
from .transport import Op, RegionTable, RemoteAccessError
from .wire import (
    REP,
    REQ,
    PollBackoff,
    recv_exact,
    recv_spin,
    sendmsg_all,
)

log = logging.getLogger("kvmesh.rdma.tcp")  # the transport's logger, as before the split

MAX_PENDING_ACKS = 64  # server flushes replies at least this often...
MAX_PENDING_REPLY_BYTES = 1 << 20  # ...or once this much READ data is queued
SCRATCH_BYTES = 64 << 10  # sink for the payload of a rejected WRITE
POLL_MAX_BYTES = 1 << 20  # WRITE payloads up to this size are busy-polled too


class ServerState:
    """The server side's share of a transport, made when it starts serving: the
    listening socket, the region table and notify callback that requests are served
    against, and the live connections with their threads, which the transport shuts
    down and joins when it closes (:meth:`shut`)."""

    def __init__(
        self,
        listener: socket.socket,
        regions: RegionTable,
        on_notify: Callable[[bytes], None],
    ) -> None:
        self.listener = listener
        self.regions = regions
        self.on_notify = on_notify
        self._lock = threading.Lock()
        self._socks: set[socket.socket] = set()
        self._threads: set[threading.Thread] = set()
        self._shut = False

    def add(self, sock: socket.socket, thread: threading.Thread) -> bool:
        """Tracks an accepted connection and its thread; False once :meth:`shut` ran
        (the caller closes the socket instead of serving it)."""
        with self._lock:
            if self._shut:
                return False
            self._socks.add(sock)
            self._threads.add(thread)
            return True

    def count(self) -> int:
        """Authenticated connections being served now."""
        with self._lock:
            return len(self._socks)

    def discard(self, sock: socket.socket, thread: threading.Thread) -> None:
        """Forgets a connection whose thread is ending."""
        with self._lock:
            self._socks.discard(sock)
            self._threads.discard(thread)

    def shut(self) -> tuple[list[socket.socket], list[threading.Thread]]:
        """Stops tracking new connections; returns the live sockets (to shut down) and
        their threads (to join)."""
        with self._lock:
            self._shut = True
            return list(self._socks), list(self._threads)


def serve(
    tr: TcpEndpoint, server: ServerState, sock: socket.socket, answer: bytes, deadline: float
) -> None:
    """One authenticated connection: the handshake's last message (``answer``, sent by
    ``deadline``, a ``time.monotonic()``), then :func:`serve_requests` until it ends."""
    try:
        try:
            sock.setblocking(True)
            sock.settimeout(max(0.05, deadline - time.monotonic()))
            sock.sendall(answer)
            sock.settimeout(None)
        except OSError:
            tr.counters.add("handshake_errors")
            return
        serve_requests(tr, server, sock)
    except OSError:
        pass  # peer went away (ConnectionError is an OSError)
    except Exception:  # the thread's top: log a bug, then drop just this connection
        log.exception("server connection crashed")
    finally:
        server.discard(sock, threading.current_thread())
        sock.close()


def serve_requests(tr: TcpEndpoint, server: ServerState, sock: socket.socket) -> None:
    """Serves an authenticated peer's requests until it goes away: returns when the
    peer closes between requests, raises (``OSError``) otherwise."""
    _Requests(tr, server, sock).run()


class _Requests:
    """One connection's request loop (:meth:`run`), in steps: wait for the next header
    (:meth:`wait_header`, flushing coalesced acks first when the pipe is empty), then
    :meth:`handle_write`, :meth:`handle_read` or :meth:`handle_notify`.

    The hot path allocates nothing per request beyond the ack itself; what each step
    needs is kept in slots, and the loop holds its own in locals.
    """

    __slots__ = (
        "tr",
        "sock",
        "regions",
        "on_notify",
        "counters",
        "poll_s",
        "spinners",
        "hdr",
        "hmv",
        "scratch",
        "acks",
        "pending_out",
        "backoff",
        "payload_backoff",
    )

    def __init__(self, tr: TcpEndpoint, server: ServerState, sock: socket.socket) -> None:
        self.tr = tr
        self.sock = sock
        self.regions = server.regions
        self.on_notify = server.on_notify
        self.counters = tr.counters
        self.poll_s = tr.poll_s
        self.spinners = tr.spinners
        self.hdr = bytearray(REQ.size)
        self.hmv = memoryview(self.hdr)
        self.scratch = memoryview(bytearray(SCRATCH_BYTES))
        # coalesced replies (acks, errors, READ data views)
        self.acks: list[bytes | bytearray | memoryview] = []
        self.pending_out = 0  # READ bytes referenced by ``acks``
        self.backoff = PollBackoff(POLL_BACKOFF)  # waits for the next request
        self.payload_backoff = PollBackoff(POLL_BACKOFF)  # waits for a WRITE payload

    def run(self) -> None:
        """Reads and dispatches requests until the peer goes away."""
        sock, hdr, hmv, acks = self.sock, self.hdr, self.hmv, self.acks
        hsize, unpack = REQ.size, REQ.unpack_from
        write, read, notify = Op.WRITE, Op.READ, Op.NOTIFY
        while True:
            # Header: try without blocking first; flush coalesced acks only
            # when the pipe is empty (or too many are pending).
            got = 0
            if acks:
                if len(acks) < MAX_PENDING_ACKS:
                    try:
                        got = sock.recv_into(hmv, hsize, socket.MSG_DONTWAIT)
                        if got == 0:
                            return
                    except BlockingIOError:
                        got = 0
                if got < hsize:
                    self.flush()
            if got < hsize:
                self.wait_header(got)
            op, flags, _, crc, region, rid, offset, length = unpack(hdr)
            if op == write:
                self.handle_write(flags, crc, region, rid, offset, length)
            elif op == read:
                self.handle_read(flags, region, rid, offset, length)
            elif op == notify:
                self.handle_notify(flags, crc, rid, length)
            else:
                raise ConnectionError(f"bad opcode {op}")  # unrecoverable framing

    def flush(self) -> None:
        """Sends the coalesced replies."""
        sendmsg_all(self.sock, self.acks)
        self.acks.clear()
        self.pending_out = 0

    def reject(self, rid: int, status: int, msg: str) -> None:
        """Queues an error reply for request ``rid``."""
        data = msg.encode()
        self.acks.append(REP.pack(REPLY, status, 0, 0, rid, len(data)))
        self.acks.append(data)
        self.counters.add("requests_rejected")

    def wait_header(self, got: int) -> None:
        """Receives the rest of the next request header (``got`` bytes are in):
        busy-polls first if allowed, then blocks."""
        hmv = self.hmv
        poll_s = self.poll_s
        if poll_s:
            backoff, spinners = self.backoff, self.spinners
            if backoff.should_poll() and spinners.acquire(blocking=False):
                try:  # the slot is held while spinning only, never while blocked
                    got += recv_spin(self.sock, hmv[got:], poll_s)
                finally:
                    spinners.release()
                if got < REQ.size:  # the window ran out: this peer is not that quick
                    backoff.missed()
                else:
                    backoff.caught()
        if got < REQ.size:
            recv_exact(self.sock, hmv[got:])

    def handle_write(
        self, flags: int, crc: int, region: int, rid: int, offset: int, length: int
    ) -> None:
        """Receives a WRITE payload straight into the region and queues its ack (or
        drains a rejected one and queues the error)."""
        sock = self.sock
        try:
            dst = self.regions.view(region, offset, length)
        except RemoteAccessError as e:
            scratch = self.scratch
            left = length
            while left:
                left -= recv_exact(sock, scratch[: min(left, SCRATCH_BYTES)])
            self.reject(rid, ST_BAD_ACCESS, f"WRITE rejected: {e}")
            return
        got = 0
        poll_s = self.poll_s
        if poll_s and length <= POLL_MAX_BYTES:
            backoff, spinners = self.payload_backoff, self.spinners
            if backoff.should_poll() and spinners.acquire(blocking=False):
                try:
                    got = recv_spin(sock, dst, poll_s)
                finally:
                    spinners.release()
                if got < length:  # a slow sender: its own back-off, not the headers'
                    backoff.missed()
                else:
                    backoff.caught()
        if got < length:
            recv_exact(sock, dst[got:] if got else dst)
        if flags & F_CRC and zlib.crc32(dst) != crc:
            self.reject(
                rid,
                ST_CHECKSUM,
                f"checksum mismatch in WRITE of {length} bytes to region {region} offset {offset}",
            )
            self.counters.add("checksum_failures")
            return
        self.acks.append(REP.pack(REPLY, ST_OK, 0, 0, rid, 0))
        self.counters.add("bytes_served_in", length)

    def handle_read(self, flags: int, region: int, rid: int, offset: int, length: int) -> None:
        """Queues a READ's reply and its data, zero-copy from the region; flushes once
        ``MAX_PENDING_REPLY_BYTES`` of data are queued."""
        try:
            src = self.regions.view(region, offset, length)
        except RemoteAccessError as e:
            self.reject(rid, ST_BAD_ACCESS, f"READ rejected: {e}")
            return
        rcrc = zlib.crc32(src) if flags & F_CRC else 0
        data: memoryview | bytearray = src
        tr = self.tr
        if tr.corrupt_next and length:
            tr.corrupt_next = False
            damaged = bytearray(src)
            damaged[0] ^= 0xFF
            data = damaged
        acks = self.acks
        acks.append(REP.pack(REPLY, ST_OK, 0, rcrc, rid, length))
        acks.append(data)  # zero-copy: the region view itself
        self.pending_out += length
        if self.pending_out >= MAX_PENDING_REPLY_BYTES:
            self.flush()
        self.counters.add("bytes_served_out", length)

    def handle_notify(self, flags: int, crc: int, rid: int, length: int) -> None:
        """Receives a NOTIFY payload, hands it to ``on_notify`` and queues its ack."""
        if length > MAX_NOTIFY_BYTES:
            raise ConnectionError("notify payload too large")
        buf = bytearray(length)
        recv_exact(self.sock, memoryview(buf))
        if flags & F_CRC and zlib.crc32(buf) != crc:
            self.reject(rid, ST_CHECKSUM, "checksum mismatch in NOTIFY payload")
            return
        self.on_notify(bytes(buf))
        self.acks.append(REP.pack(REPLY, ST_OK, 0, 0, rid, 0))
