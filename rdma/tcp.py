"""TCP implementation of :class:`rdma.transport.Transport`.

Threads, not coroutines, do all socket I/O: blocking socket calls release the
GIL, so several connections move bytes in parallel and the asyncio event loop
is never blocked.  Per peer there are ``conns_per_peer`` *channels*; each has a
sender thread (pipelines requests, coalescing small ones into one
``sendmsg``) and, per live socket, a receiver thread (matches replies to
requests by id and ``recv_into`` s READ data straight into local memory).  The
server side runs one thread per accepted connection that ``recv_into`` s WRITE
payloads straight into the registered region and coalesces acks.

Latency path: a single small WRITE/READ (up to ``FAST_MAX_BYTES``) submitted
on the event-loop thread goes over a per-peer *fast lane* instead: one more
authenticated connection that the event loop drives itself (non-blocking
``sendmsg``, reply parsed in an ``add_reader`` callback), so the request costs
no thread handoff at all; see :class:`_FastLane`.

Busy polling (``poll_us``, default 200): after serving a request a server
thread spins on non-blocking receives that long before it blocks, and the
event loop spins that long for a fast-lane reply.  On a VM a sleeping
thread's wake-up costs tens of microseconds per hop, which is most of a
64 KiB request's time; a window that runs out backs the lane off for a few
requests.  ``poll_us=0`` never spins.

Wire format (network byte order), after the handshake in :mod:`rdma.wire`::

    request: op u8 | flags u8 | rsv u16 | crc32 u32 | region u32 | req_id u64
             | offset u64 | length u64          (+ payload for WRITE / NOTIFY)
    reply:   kind u8 | status u8 | rsv u16 | crc32 u32 | req_id u64 | length u64
             (+ data for a READ that succeeded, + utf-8 message for an error)
"""

from __future__ import annotations

import collections
import itertools
import logging
import socket
import threading
import time
import zlib
from typing import Callable

from .transport import (Op, RegionTable, RemoteAccessError, TransferError,
                        Transport, WorkRequest)
from .wire import (REP, REQ, AuthError, Counters, Reader, client_handshake,
                   configure_socket, recv_exact, recv_polled, sendmsg_all, server_handshake,
                   split_address)

log = logging.getLogger(__name__)

F_CRC = 0x01
REPLY = 0x80
ST_OK, ST_BAD_ACCESS, ST_CHECKSUM, ST_BAD_REQUEST = 0, 1, 2, 3

CONNECT_TIMEOUT = 3.0       # default seconds for TCP connect + handshake
MAX_ATTEMPTS = 2            # one retry on a fresh connection
MAX_BATCH_REQS = 128        # requests coalesced into one sendmsg
MAX_BATCH_BYTES = 8 << 20
MAX_PENDING_ACKS = 64       # server flushes replies at least this often...
MAX_PENDING_REPLY_BYTES = 1 << 20  # ...or once this much READ data is queued
MAX_NOTIFY_BYTES = 64 << 20
SCRATCH_BYTES = 64 << 10
FAST_MAX_BYTES = 1 << 20    # loop-thread requests up to this size use the fast lane
FAST_MAX_INFLIGHT = 2       # ...while it has fewer than this many in flight
POLL_MAX_BYTES = 1 << 20    # payloads up to this size are busy-polled too
POLL_BACKOFF = 16           # fast-lane requests that skip polling after a window ran out
FAST_RETRY_S = 1.0          # after a failed fast-lane connect, use the channels this long


def _open_socket(tr: "TcpTransport", peer: str) -> socket.socket:
    """Connect to ``peer`` and authenticate; returns a blocking socket."""
    host, port = split_address(peer)
    family, stype, proto, _, addr = socket.getaddrinfo(
        host, port, type=socket.SOCK_STREAM)[0]
    sock = socket.socket(family, stype, proto)
    try:
        configure_socket(sock, tr.sock_buf_bytes)  # before connect: window scale
        sock.settimeout(tr.connect_timeout)
        sock.connect(addr)
        client_handshake(sock, tr.secret)
        sock.settimeout(None)
    except BaseException:
        sock.close()
        raise
    tr.counters.add("connects")
    return sock


class _Conn:
    """One authenticated client socket of a channel, with its receiver thread."""

    def __init__(self, channel: "_Channel", sock: socket.socket) -> None:
        self.channel = channel
        self.sock = sock
        self.lock = threading.Lock()
        self.inflight: dict[int, WorkRequest] = {}
        self.dead = False
        self.ids = itertools.count(1)
        self.rx = threading.Thread(target=self._recv_loop, daemon=True,
                                   name=f"kvmesh-rx-{channel.peer}")
        self.rx.start()

    def send_batch(self, batch: list[WorkRequest]) -> None:
        tr = self.channel.transport
        iovs: list = []
        ids: list[int] = []
        for r in batch:
            rid = next(self.ids)
            ids.append(rid)
            flags = crc = 0
            payload = None
            if r.op is Op.WRITE or r.op is Op.NOTIFY:
                payload = r.local
                if tr.checksum:
                    flags, crc = F_CRC, zlib.crc32(payload)
                if tr.corrupt_next and r.op is Op.WRITE and r.length:
                    tr.corrupt_next = False
                    payload = bytearray(payload)
                    payload[0] ^= 0xFF  # test hook: damage after the crc
            elif tr.checksum:
                flags = F_CRC  # ask the server to checksum READ data
            iovs.append(REQ.pack(r.op, flags, 0, crc, r.region, rid,
                                 r.offset, r.length))
            if payload is not None and r.length:
                iovs.append(payload)
        with self.lock:
            if self.dead:
                self.channel.requeue(batch)  # never sent: no attempt used
                return
            for rid, r in zip(ids, batch):
                self.inflight[rid] = r
                r.sent = True
        try:
            sendmsg_all(self.sock, iovs)
        except OSError as e:
            self.fail(e)

    def _recv_loop(self) -> None:
        tr = self.channel.transport
        reader = Reader(self.sock)
        current: WorkRequest | None = None
        try:
            while True:
                _, status, _, crc, rid, length = reader.read_struct(REP)
                with self.lock:
                    current = self.inflight.pop(rid, None)
                if current is None:
                    raise ConnectionError(f"reply for unknown request {rid}")
                r = current
                if status == ST_OK:
                    if r.op is Op.READ:
                        if length != r.length:
                            raise ConnectionError("READ reply has wrong length")
                        reader.read_into(r.local)
                        if tr.checksum and zlib.crc32(r.local) != crc:
                            tr.counters.add("checksum_failures")
                            current = None
                            r.complete(TransferError(
                                f"checksum mismatch reading {length} bytes from "
                                f"{self.channel.peer} region {r.region} offset {r.offset}"))
                            continue
                    current = None
                    r.complete(None)
                else:
                    msg = reader.read_bytes(length).decode("utf-8", "replace")
                    current = None
                    if status == ST_CHECKSUM:
                        tr.counters.add("checksum_failures")
                    r.complete(TransferError(f"peer {self.channel.peer}: {msg}"))
        except Exception as e:  # noqa: BLE001 - any failure kills this socket
            self.fail(e, extra=current)

    def fail(self, exc: BaseException, extra: WorkRequest | None = None) -> None:
        """Mark the socket dead and hand its unacked requests to the channel."""
        with self.lock:
            if self.dead and extra is None:
                return
            self.dead = True
            reqs = list(self.inflight.values())
            self.inflight.clear()
        if extra is not None:
            reqs.append(extra)
        try:
            self.sock.shutdown(socket.SHUT_RDWR)
        except OSError:
            pass
        self.channel.on_conn_failed(reqs, exc)

    def dispose(self) -> None:
        """Called by the sender thread only: join the receiver, close the fd."""
        self.fail(ConnectionError("connection closed"))
        self.rx.join(timeout=5)
        self.sock.close()


class _Channel:
    """One connection slot to a peer, served by a sender thread."""

    def __init__(self, transport: "TcpTransport", peer: str, index: int) -> None:
        self.transport = transport
        self.peer = peer
        self.cv = threading.Condition()
        self.queue: collections.deque[WorkRequest] = collections.deque()
        self.queued_bytes = 0
        self.closed = False
        self.conn: _Conn | None = None
        self.thread = threading.Thread(target=self._run, daemon=True,
                                       name=f"kvmesh-tx-{peer}-{index}")
        self.thread.start()

    # -- queue management (any thread) ------------------------------------
    def enqueue(self, reqs: list[WorkRequest], front: bool = False) -> None:
        with self.cv:
            if self.closed:
                closed = True
            else:
                closed = False
                if front:
                    self.queue.extendleft(reversed(reqs))
                else:
                    self.queue.extend(reqs)
                self.queued_bytes += sum(r.length for r in reqs)
                self.cv.notify()
        if closed:
            for r in reqs:
                r.complete(TransferError("transfer engine closed"))

    def requeue(self, reqs: list[WorkRequest]) -> None:
        self.enqueue(reqs, front=True)

    def on_conn_failed(self, reqs: list[WorkRequest], exc: BaseException) -> None:
        retry: list[WorkRequest] = []
        for r in reqs:
            r.attempts += 1
            if self.closed or self.transport.closed:
                r.complete(TransferError("transfer engine closed"))
            elif r.op is Op.NOTIFY and r.sent:
                r.complete(TransferError(
                    f"connection to {self.peer} lost; notify delivery unknown ({exc})"))
            elif r.attempts >= MAX_ATTEMPTS:
                r.complete(TransferError(
                    f"{r.op.name} to {self.peer} failed after {r.attempts} attempts: {exc!r}"))
            else:
                retry.append(r)
        if retry:
            self.transport.counters.add("retries", len(retry))
            self.requeue(retry)

    def close(self) -> None:
        with self.cv:
            self.closed = True
            self.cv.notify()
        conn = self.conn
        if conn is not None:
            conn.fail(ConnectionError("transfer engine closed"))

    # -- sender thread ------------------------------------------------------
    def _take_batch(self) -> list[WorkRequest] | None:
        with self.cv:
            while not self.queue and not self.closed:
                self.cv.wait()
            if self.closed:
                return None
            batch = [self.queue.popleft()]
            nbytes = batch[0].length
            while (self.queue and len(batch) < MAX_BATCH_REQS
                   and nbytes + self.queue[0].length <= MAX_BATCH_BYTES):
                r = self.queue.popleft()
                batch.append(r)
                nbytes += r.length
            self.queued_bytes -= nbytes
            return batch

    def _connect(self) -> _Conn:
        return _Conn(self, _open_socket(self.transport, self.peer))

    def _fail_queued(self, exc: BaseException) -> None:
        with self.cv:
            reqs = list(self.queue)
            self.queue.clear()
            self.queued_bytes = 0
        self.on_conn_failed(reqs, exc)

    def _run(self) -> None:
        try:
            while True:
                conn = self.conn
                if conn is not None and conn.dead:
                    conn.dispose()
                    self.conn = conn = None
                batch = self._take_batch()
                if batch is None:
                    break
                if conn is None:
                    try:
                        self.conn = conn = self._connect()
                    except (OSError, AuthError) as e:
                        if isinstance(e, AuthError):
                            self.transport.counters.add("auth_failures")
                        self.requeue(batch)
                        self._fail_queued(
                            ConnectionError(f"cannot connect to {self.peer}: {e}"))
                        continue
                conn.send_batch(batch)
        except Exception:  # pragma: no cover - defensive
            log.exception("sender thread for %s crashed", self.peer)
        finally:
            if self.conn is not None:
                self.conn.dispose()
                self.conn = None
            with self.cv:
                self.closed = True
                reqs = list(self.queue)
                self.queue.clear()
            for r in reqs:
                r.complete(TransferError("transfer engine closed"))


class _FastLane:
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

    def __init__(self, transport: "TcpTransport", peer: str, chan: "_Channel",
                 loop) -> None:
        self.tr = transport
        self.peer = peer
        self.chan = chan  # retries go here
        self.loop = loop
        self.sock: socket.socket | None = None
        self.fd = -1
        self.connecting = False
        self.retry_at = 0.0
        self.ids = itertools.count(1)
        self.inflight: collections.deque = collections.deque()  # (rid, req)
        self.out: list = []  # unsent buffers (writer registered while non-empty)
        self.hdr = bytearray(REP.size)
        self.hmv = memoryview(self.hdr)
        self.hpos = 0
        self.body: memoryview | None = None  # READ data / error text being received
        self.bpos = 0
        self.berr = -1   # status of the reply whose error text is in ``body``
        self.bcrc = 0
        self.skip_polls = 0

    # -- connection -----------------------------------------------------------
    def usable(self) -> bool:
        """Ready for a request now; otherwise starts (re)connecting if due."""
        if self.sock is not None:
            return not self.out and len(self.inflight) < FAST_MAX_INFLIGHT
        if not self.connecting and time.monotonic() >= self.retry_at:
            self.connecting = True
            threading.Thread(target=self._connect, daemon=True,
                             name=f"kvmesh-fast-{self.peer}").start()
        return False

    def _connect(self) -> None:
        try:
            sock = _open_socket(self.tr, self.peer)
        except Exception:  # noqa: BLE001 - the channels report real errors
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
        for r in self._drop():
            r.complete(TransferError("transfer engine closed"))

    # -- requests (loop thread) ---------------------------------------------
    def submit(self, r: WorkRequest) -> None:
        rid = next(self.ids)
        flags = crc = 0
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
        if self.tr.poll_s > 0:
            if self.skip_polls:
                self.skip_polls -= 1
            else:
                self._poll(rid)

    def _poll(self, rid: int) -> None:
        """Busy-polls the reply for up to ``poll_s`` on the loop thread: a reply
        that comes back within the window skips the event loop's wake-up. A
        window that runs out makes the next ``POLL_BACKOFF`` requests skip
        polling, so a slow peer costs little spinning."""
        deadline = time.perf_counter() + self.tr.poll_s
        inflight = self.inflight
        while self.sock is not None and not self.out and inflight and inflight[-1][0] == rid:
            if time.perf_counter() > deadline:
                self.skip_polls = POLL_BACKOFF
                return
            self._on_readable()

    def _send(self, bufs: list) -> None:
        try:
            sent = self.sock.sendmsg(bufs)
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
        try:
            while sock is self.sock:
                body = self.body
                if body is not None:
                    got = sock.recv_into(body[self.bpos:])
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
                got = sock.recv_into(self.hmv[self.hpos:])
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
                        if length:
                            self.body, self.bpos, self.berr, self.bcrc = r.local, 0, -1, crc
                            continue
                        self.bcrc = crc
                        self._finish_body(r.local)
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
        except Exception as e:  # noqa: BLE001 - any failure kills this socket
            if sock is self.sock:
                self.fail(e)

    def _finish_body(self, body: memoryview) -> None:
        tr = self.tr
        _, r = self.inflight.popleft()
        status, self.berr = self.berr, -1
        if status < 0:  # READ data landed in local memory
            if tr.checksum and zlib.crc32(body) != self.bcrc:
                tr.counters.add("checksum_failures")
                r.complete(TransferError(
                    f"checksum mismatch reading {r.length} bytes from "
                    f"{self.peer} region {r.region} offset {r.offset}"))
            else:
                r.complete(None)
            return
        if status == ST_CHECKSUM:
            tr.counters.add("checksum_failures")
        msg = bytes(body).decode("utf-8", "replace")
        r.complete(TransferError(f"peer {self.peer}: {msg}"))


class TcpTransport(Transport):
    """The TCP transport: authenticated, pipelined, multi-connection.

    ``corrupt_next`` is a test-only fault-injection hook: when set, the next
    payload this transport sends (WRITE data as a client, READ data as a
    server) has one byte flipped *after* its crc32 was computed.
    """

    def __init__(self, secret: bytes, host: str = "127.0.0.1", port: int = 0, *,
                 conns_per_peer: int = 4, checksum: bool = False,
                 sock_buf_bytes: int = 4 << 20,
                 connect_timeout: float = CONNECT_TIMEOUT, poll_us: int = 200) -> None:
        if not secret:
            raise ValueError("a non-empty cluster secret is required")
        if conns_per_peer < 1:
            raise ValueError("conns_per_peer must be >= 1")
        self.secret = bytes(secret)
        self.host = host
        self.port = port
        self.conns_per_peer = conns_per_peer
        self.checksum = checksum
        self.sock_buf_bytes = sock_buf_bytes
        self.connect_timeout = connect_timeout
        if poll_us < 0:
            raise ValueError("poll_us must be >= 0")
        self.poll_s = poll_us / 1e6
        self.corrupt_next = False
        self.counters = Counters()
        self.closed = False
        self._lock = threading.Lock()
        self._channels: dict[str, list[_Channel]] = {}
        self._rr = 0
        self._listener: socket.socket | None = None
        self._accept_thread: threading.Thread | None = None
        self._server_socks: set[socket.socket] = set()
        self._server_threads: set[threading.Thread] = set()
        self._regions: RegionTable | None = None
        self._on_notify: Callable[[bytes], None] | None = None
        self._loop = None
        self._loop_tid: int | None = None
        self._lanes: dict[str, _FastLane] = {}  # loop thread only
        self.fast_requests = 0
        self.address = ""

    # -- lifecycle ----------------------------------------------------------
    async def start(self, regions: RegionTable,
                    on_notify: Callable[[bytes], None]) -> str:
        import asyncio

        self._regions = regions
        self._on_notify = on_notify
        self._loop = asyncio.get_running_loop()
        self._loop_tid = threading.get_ident()
        family = socket.getaddrinfo(self.host, self.port, type=socket.SOCK_STREAM)[0][0]
        ls = socket.socket(family, socket.SOCK_STREAM)
        ls.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        configure_socket(ls, self.sock_buf_bytes)  # inherited by accepted sockets
        ls.bind((self.host, self.port))
        ls.listen(128)
        ls.settimeout(1.0)  # lets the accept loop notice close() even if shutdown() does not wake it
        self._listener = ls
        self.port = ls.getsockname()[1]
        self.address = f"{self.host}:{self.port}"
        self._accept_thread = threading.Thread(target=self._accept_loop, daemon=True,
                                               name=f"kvmesh-accept-{self.port}")
        self._accept_thread.start()
        return self.address

    async def close(self) -> None:
        import asyncio

        if self.closed:
            return
        self.closed = True
        if self._listener is not None:
            try:
                self._listener.shutdown(socket.SHUT_RDWR)
            except OSError:
                pass
        with self._lock:
            channels = [c for cs in self._channels.values() for c in cs]
            self._channels.clear()
            socks = list(self._server_socks)
        for c in channels:
            c.close()
        lanes = list(self._lanes.values())
        self._lanes.clear()
        for lane in lanes:
            if threading.get_ident() == self._loop_tid:
                lane.close()
            else:  # lanes belong to the loop thread
                try:
                    self._loop.call_soon_threadsafe(lane.close)
                except RuntimeError:
                    pass
        for s in socks:
            try:
                s.shutdown(socket.SHUT_RDWR)
            except OSError:
                pass
        threads = [c.thread for c in channels] + list(self._server_threads)
        if self._accept_thread is not None:
            threads.append(self._accept_thread)

        def join_all() -> None:
            for t in threads:
                t.join(timeout=5)

        await asyncio.to_thread(join_all)
        if self._listener is not None:
            self._listener.close()

    # -- client side ----------------------------------------------------------
    def _channels_for(self, peer: str) -> list[_Channel]:
        chans = self._channels.get(peer)
        if chans is None:
            with self._lock:
                if self.closed:
                    raise TransferError("transfer engine closed")
                chans = self._channels.get(peer)
                if chans is None:
                    split_address(peer)  # validate early
                    chans = [_Channel(self, peer, i) for i in range(self.conns_per_peer)]
                    self._channels[peer] = chans
        return chans

    def submit(self, peer: str, requests: list[WorkRequest]) -> None:
        if not requests:
            return
        try:
            chans = self._channels_for(peer)
        except (TransferError, ValueError) as e:
            for r in requests:
                r.complete(TransferError(str(e)))
            return
        if len(requests) == 1:
            r = requests[0]
            if (r.length <= FAST_MAX_BYTES and r.op is not Op.NOTIFY
                    and threading.get_ident() == self._loop_tid
                    and not self.corrupt_next and not self.closed):
                lane = self._lanes.get(peer)
                if lane is None:
                    lane = self._lanes[peer] = _FastLane(self, peer, chans[0], self._loop)
                if lane.usable():
                    self.fast_requests += 1  # loop thread only: no lock needed
                    lane.submit(r)
                    return
            if r.op is Op.NOTIFY:
                chans[0].enqueue(requests)  # one ordered channel for notifies
            else:
                min(chans, key=lambda c: c.queued_bytes).enqueue(requests)
            return
        # Spread over the channels, balancing bytes; keep each channel's share
        # in submission order so small requests coalesce into few sendmsgs.
        n = len(chans)
        loads = [c.queued_bytes for c in chans]
        buckets: list[list[WorkRequest]] = [[] for _ in range(n)]
        for r in requests:
            i = min(range(n), key=loads.__getitem__)
            buckets[i].append(r)
            loads[i] += r.length + 64  # + header cost so empty requests spread too
        for c, b in zip(chans, buckets):
            if b:
                c.enqueue(b)

    # -- server side ----------------------------------------------------------
    def _accept_loop(self) -> None:
        ls = self._listener
        assert ls is not None
        while not self.closed:
            try:
                sock, _ = ls.accept()
            except socket.timeout:
                continue
            except OSError:
                if self.closed:
                    break
                continue
            sock.setblocking(True)
            t = threading.Thread(target=self._serve, args=(sock,), daemon=True,
                                 name=f"kvmesh-srv-{self.port}")
            with self._lock:
                if self.closed:
                    sock.close()
                    break
                self._server_socks.add(sock)
                self._server_threads.add(t)
            t.start()

    def _serve(self, sock: socket.socket) -> None:
        try:
            try:
                sock.settimeout(max(self.connect_timeout, 1.0))
                server_handshake(sock, self.secret)
                sock.settimeout(None)
            except (OSError, AuthError) as e:
                self.counters.add("auth_rejected" if isinstance(e, AuthError)
                                  else "handshake_errors")
                return
            self._serve_requests(sock)
        except (OSError, ConnectionError):
            pass  # peer went away
        except Exception:  # pragma: no cover - defensive
            log.exception("server connection crashed")
        finally:
            with self._lock:
                self._server_socks.discard(sock)
                self._server_threads.discard(threading.current_thread())
            sock.close()

    def _serve_requests(self, sock: socket.socket) -> None:
        regions = self._regions
        assert regions is not None and self._on_notify is not None
        hdr = bytearray(REQ.size)
        hmv = memoryview(hdr)
        scratch = memoryview(bytearray(SCRATCH_BYTES))
        acks: list = []  # coalesced replies (acks, errors, READ data views)
        pending_out = 0  # READ bytes referenced by ``acks``
        counters = self.counters
        poll_s = self.poll_s

        def error(rid: int, status: int, msg: str) -> None:
            data = msg.encode()
            acks.append(REP.pack(REPLY, status, 0, 0, rid, len(data)))
            acks.append(data)
            counters.add("requests_rejected")

        while True:
            # Header: try without blocking first; flush coalesced acks only
            # when the pipe is empty (or too many are pending).
            got = 0
            if acks:
                if len(acks) < MAX_PENDING_ACKS:
                    try:
                        got = sock.recv_into(hmv, REQ.size, socket.MSG_DONTWAIT)
                        if got == 0:
                            return
                    except BlockingIOError:
                        got = 0
                if got < REQ.size:
                    sendmsg_all(sock, acks)
                    acks.clear()
                    pending_out = 0
            if got < REQ.size:
                recv_polled(sock, hmv[got:], poll_s)
            op, flags, _, crc, region, rid, offset, length = REQ.unpack_from(hdr)

            if op == Op.WRITE:
                try:
                    dst = regions.view(region, offset, length)
                except RemoteAccessError as e:
                    left = length
                    while left:
                        left -= recv_exact(sock, scratch[:min(left, SCRATCH_BYTES)])
                    error(rid, ST_BAD_ACCESS, f"WRITE rejected: {e}")
                    continue
                if length <= POLL_MAX_BYTES:
                    recv_polled(sock, dst, poll_s)
                else:
                    recv_exact(sock, dst)
                if flags & F_CRC and zlib.crc32(dst) != crc:
                    error(rid, ST_CHECKSUM,
                          f"checksum mismatch in WRITE of {length} bytes to region "
                          f"{region} offset {offset}")
                    counters.add("checksum_failures")
                    continue
                acks.append(REP.pack(REPLY, ST_OK, 0, 0, rid, 0))
                counters.add("bytes_served_in", length)
            elif op == Op.READ:
                try:
                    src = regions.view(region, offset, length)
                except RemoteAccessError as e:
                    error(rid, ST_BAD_ACCESS, f"READ rejected: {e}")
                    continue
                rcrc = zlib.crc32(src) if flags & F_CRC else 0
                data = src
                if self.corrupt_next and length:
                    self.corrupt_next = False
                    data = bytearray(src)
                    data[0] ^= 0xFF
                acks.append(REP.pack(REPLY, ST_OK, 0, rcrc, rid, length))
                acks.append(data)  # zero-copy: the region view itself
                pending_out += length
                if pending_out >= MAX_PENDING_REPLY_BYTES:
                    sendmsg_all(sock, acks)
                    acks.clear()
                    pending_out = 0
                counters.add("bytes_served_out", length)
            elif op == Op.NOTIFY:
                if length > MAX_NOTIFY_BYTES:
                    raise ConnectionError("notify payload too large")
                buf = bytearray(length)
                recv_exact(sock, memoryview(buf))
                if flags & F_CRC and zlib.crc32(buf) != crc:
                    error(rid, ST_CHECKSUM, "checksum mismatch in NOTIFY payload")
                    continue
                self._on_notify(bytes(buf))
                acks.append(REP.pack(REPLY, ST_OK, 0, 0, rid, 0))
            else:
                raise ConnectionError(f"bad opcode {op}")  # unrecoverable framing

    def stats(self) -> dict[str, int]:
        out = self.counters.snapshot()
        if self.fast_requests:
            out["fast_lane_requests"] = self.fast_requests
        return out
