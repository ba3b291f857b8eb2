"""The fast lane of the TCP transport (:class:`kvmesh.rdma.tcp.TcpTransport`): the latency
path for a single small WRITE/READ submitted on the event-loop thread.

One more authenticated connection per peer, driven by the event loop itself
(non-blocking ``sendmsg``, reply parsed in an ``add_reader`` callback, optional busy
polling for the reply), so such a request costs no thread handoff.  The server side is
the same as for the channels (:mod:`kvmesh.rdma.tcp_server`); requests lost with the lane's
socket are retried on the peer's channels (:mod:`kvmesh.rdma.tcp_channel`).  The transport
is seen through :class:`~kvmesh.rdma.tcp_proto.TcpEndpoint`.
"""

from __future__ import annotations

import asyncio
import collections
import itertools
import logging
import socket
import threading
import time
import zlib
from typing import cast

from .tcp_channel import Channel, open_socket
from .tcp_proto import F_CRC, MAX_NOTIFY_BYTES, POLL_BACKOFF, ST_CHECKSUM, ST_OK, TcpEndpoint
from .transport import Op, TransferError, WorkRequest
from .wire import REP, REQ, AuthError, PollBackoff

log = logging.getLogger("kvmesh.rdma.tcp")  # the transport's logger, as before the split

FAST_MAX_INFLIGHT = 2  # the lane takes a request while it has fewer than this in flight
FAST_RETRY_S = 1.0  # after a failed fast-lane connect, use the channels this long


class FastLane:
    """Per-peer connection driven by the event loop itself, for small
    WRITE/READ requests issued *on* the loop thread (one slice per call,
    awaited one at a time: the latency-bound case).

    The thread path costs two cross-thread handoffs per request (loop ->
    sender thread, receiver thread -> loop via the self-pipe).  Here the loop
    thread does a non-blocking ``sendmsg`` right away and parses the reply in
    an ``add_reader`` callback (READ data goes straight into local memory with
    ``recv_into``), completing the request on the loop thread: no thread
    switch at all.  The socket is an ordinary authenticated connection, so the
    server side is unchanged; requests lost with it are retried on the
    peer's channels under the usual ``MAX_ATTEMPTS`` policy.
    """

    def __init__(
        self, transport: TcpEndpoint, peer: str, chan: Channel, loop: asyncio.AbstractEventLoop
    ) -> None:
        self.tr = transport
        self.peer = peer
        self.chan = chan  # retries go here
        self.loop = loop
        self.sock: socket.socket | None = None
        self.fd = -1
        self.connecting = False
        self.retry_at = 0.0
        self.ids = itertools.count(1)
        self.inflight: collections.deque[tuple[int, WorkRequest]] = collections.deque()
        self.out: list[bytes | memoryview] = []  # unsent (writer registered while non-empty)
        self.hdr = bytearray(REP.size)
        self.hmv = memoryview(self.hdr)
        self.hpos = 0
        self.body: memoryview | None = None  # READ data / error text being received
        self.bpos = 0
        self.berr = -1  # status of the reply whose error text is in ``body``
        self.bcrc = 0
        self.backoff = PollBackoff(POLL_BACKOFF)

    # -- connection -----------------------------------------------------------
    def usable(self) -> bool:
        """Ready for a request now; otherwise starts (re)connecting if due."""
        if self.sock is not None:
            return not self.out and len(self.inflight) < FAST_MAX_INFLIGHT
        if not self.connecting and time.monotonic() >= self.retry_at:
            self.connecting = True
            threading.Thread(
                target=self._connect, daemon=True, name=f"kvmesh-fast-{self.peer}"
            ).start()
        return False

    def _connect(self) -> None:
        sock: socket.socket | None
        try:
            sock = open_socket(self.tr, self.peer)
        except (OSError, AuthError, ValueError):  # the channels report real errors
            sock = None
        try:
            self.loop.call_soon_threadsafe(self._install, sock)
        except RuntimeError:  # loop closed
            if sock is not None:
                sock.close()

    def _install(self, sock: socket.socket | None) -> None:
        self.connecting = False
        if sock is None or self.tr.closed:
            self.retry_at = time.monotonic() + FAST_RETRY_S
            if sock is not None:
                sock.close()
            return
        sock.setblocking(False)
        self.sock, self.fd = sock, sock.fileno()
        self.hpos, self.body = 0, None
        self.loop.add_reader(self.fd, self._on_readable)

    def _drop(self) -> list[WorkRequest]:
        sock, self.sock = self.sock, None
        if sock is None:
            return []
        self.loop.remove_reader(self.fd)
        if self.out:
            self.loop.remove_writer(self.fd)
            self.out = []
        sock.close()
        self.retry_at = time.monotonic() + FAST_RETRY_S
        reqs = [r for _, r in self.inflight]
        self.inflight.clear()
        return reqs

    def fail(self, exc: BaseException) -> None:
        """Socket lost: its requests get the channels' retry policy."""
        reqs = self._drop()
        if reqs:
            self.chan.on_conn_failed(reqs, exc)

    def close(self) -> None:
        """Drops the socket and fails what is in flight (the transport is closing)."""
        for r in self._drop():
            r.complete(TransferError("transfer engine closed"))

    # -- requests (loop thread) ---------------------------------------------
    def submit(self, r: WorkRequest) -> None:
        """Sends ``r`` (a WRITE or READ) now; call only when :meth:`usable`."""
        rid = next(self.ids)
        flags = crc = 0
        bufs: list[bytes | memoryview]
        if r.op is Op.WRITE:
            if self.tr.checksum:
                flags, crc = F_CRC, zlib.crc32(r.local)
            bufs = [REQ.pack(r.op, flags, 0, crc, r.region, rid, r.offset, r.length)]
            if r.length:
                bufs.append(r.local)
        else:
            if self.tr.checksum:
                flags = F_CRC
            bufs = [REQ.pack(r.op, flags, 0, 0, r.region, rid, r.offset, r.length)]
        r.sent = True
        self.inflight.append((rid, r))
        self._send(bufs)
        if self.tr.poll_s > 0 and self.backoff.should_poll():
            self._poll(rid)

    def _poll(self, rid: int) -> None:
        """Busy-polls the reply for up to ``poll_s`` on the loop thread: a reply
        that comes back within the window skips the event loop's wake-up; a
        slow peer makes later requests skip polling (:class:`PollBackoff`)."""
        deadline = time.perf_counter() + self.tr.poll_s
        inflight = self.inflight
        while self.sock is not None and not self.out and inflight and inflight[-1][0] == rid:
            if time.perf_counter() > deadline:
                self.backoff.missed()
                return
            self._on_readable()
        if self.sock is not None and not any(i == rid for i, _ in inflight):
            self.backoff.caught()  # answered (not a dropped socket or a partial send)

    def _send(self, bufs: list[bytes | memoryview]) -> None:
        sock = self.sock
        if sock is None:
            return  # dropped meanwhile: its requests went to the channel
        try:
            sent = sock.sendmsg(bufs)
        except (BlockingIOError, InterruptedError):
            sent = 0
        except OSError as e:
            self.fail(e)
            return
        for i, b in enumerate(bufs):
            n = len(b)
            if sent < n:
                rest = bufs[i:]
                if sent:
                    rest[0] = memoryview(b)[sent:]
                if not self.out:
                    self.loop.add_writer(self.fd, self._on_writable)
                self.out = rest
                return
            sent -= n
        if self.out:
            self.out = []
            self.loop.remove_writer(self.fd)

    def _on_writable(self) -> None:
        if self.sock is not None and self.out:
            self._send(self.out)

    def _on_readable(self) -> None:
        sock = self.sock
        if sock is None:
            return  # dropped meanwhile (a late callback)
        try:
            while sock is self.sock:
                body = self.body
                if body is not None:
                    got = sock.recv_into(body[self.bpos :])
                    if not got:
                        raise ConnectionError("connection closed by peer")
                    self.bpos += got
                    if self.bpos < len(body):
                        continue
                    self.body = None
                    self._finish_body(body)
                    continue
                if not self.inflight:
                    return  # nothing expected; EOF/garbage shows up next time
                got = sock.recv_into(self.hmv[self.hpos :])
                if not got:
                    raise ConnectionError("connection closed by peer")
                self.hpos += got
                if self.hpos < REP.size:
                    continue
                self.hpos = 0
                _, status, _, crc, rid, length = REP.unpack_from(self.hdr)
                if self.inflight[0][0] != rid:
                    raise ConnectionError(f"reply for unknown request {rid}")
                r = self.inflight[0][1]
                if status == ST_OK:
                    if r.op is Op.READ:
                        if length != r.length:
                            raise ConnectionError("READ reply has wrong length")
                        dst = cast(memoryview, r.local)  # a READ's writable destination
                        if length:
                            self.body, self.bpos, self.berr, self.bcrc = dst, 0, -1, crc
                            continue
                        self.bcrc = crc
                        self._finish_body(dst)
                        continue
                    self.inflight.popleft()
                    r.complete(None)
                else:
                    if length > MAX_NOTIFY_BYTES:
                        raise ConnectionError("error reply too long")
                    self.body = memoryview(bytearray(length))
                    self.bpos, self.berr = 0, status
                    if not length:
                        self.body = None
                        self._finish_body(memoryview(b""))
        except (BlockingIOError, InterruptedError):
            return
        except OSError as e:  # the socket failed or the peer broke the protocol
            if sock is self.sock:
                self.fail(e)
        except Exception as e:  # a loop callback: a bug must still fail over the requests
            log.exception("fast lane to %s crashed", self.peer)
            if sock is self.sock:
                self.fail(e)

    def _finish_body(self, body: memoryview) -> None:
        tr = self.tr
        _, r = self.inflight.popleft()
        status, self.berr = self.berr, -1
        if status < 0:  # READ data landed in local memory
            if tr.checksum and zlib.crc32(body) != self.bcrc:
                tr.counters.add("checksum_failures")
                r.complete(
                    TransferError(
                        f"checksum mismatch reading {r.length} bytes from "
                        f"{self.peer} region {r.region} offset {r.offset}"
                    )
                )
            else:
                r.complete(None)
            return
        if status == ST_CHECKSUM:
            tr.counters.add("checksum_failures")
        msg = bytes(body).decode("utf-8", "replace")
        r.complete(TransferError(f"peer {self.peer}: {msg}"))
