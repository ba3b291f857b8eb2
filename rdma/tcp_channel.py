"""Client channels of the TCP transport (:class:`kvmesh.rdma.tcp.TcpTransport`).

Per peer the transport keeps ``conns_per_peer`` :class:`Channel` s.  Each has a
sender thread that pipelines queued requests, coalescing small ones into one
``sendmsg``, over one authenticated socket at a time (:class:`_Conn`); per live socket
a receiver thread matches replies to requests by id and ``recv_into`` s READ data
straight into local memory.  A request lost with its socket is retried on a fresh
connection, up to ``MAX_ATTEMPTS`` attempts in all (a NOTIFY that was already sent is
not: its delivery is unknown).  :func:`open_socket` is also used by the fast lane
(:mod:`kvmesh.rdma.tcp_lane`), whose lost requests fall back to these channels
(:meth:`Channel.on_conn_failed`).  The transport is seen through
:class:`~kvmesh.rdma.tcp_proto.TcpEndpoint`.
"""

from __future__ import annotations

import collections
import itertools
import logging
import socket
import threading
import zlib
from typing import cast

from .tcp_proto import F_CRC, ST_CHECKSUM, ST_OK, TcpEndpoint
from .transport import Op, TransferError, WorkRequest
from .wire import (
    REP,
    REQ,
    AuthError,
    Reader,
    client_handshake,
    configure_socket,
    sendmsg_all,
    split_address,
)

log = logging.getLogger("kvmesh.rdma.tcp")  # the transport's logger, as before the split

MAX_ATTEMPTS = 2  # one retry on a fresh connection
MAX_BATCH_REQS = 128  # requests coalesced into one sendmsg
MAX_BATCH_BYTES = 8 << 20


def open_socket(tr: TcpEndpoint, peer: str) -> socket.socket:
    """Connect to ``peer`` and authenticate; returns a blocking socket.  Raises
    ``OSError`` (unreachable, timed out), :class:`~kvmesh.rdma.wire.AuthError` or
    ``ValueError`` (a malformed address)."""
    host, port = split_address(peer)
    family, stype, proto, _, addr = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM)[0]
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

    def __init__(self, channel: Channel, sock: socket.socket) -> None:
        self.channel = channel
        self.sock = sock
        self.lock = threading.Lock()
        self.inflight: dict[int, WorkRequest] = {}
        self.dead = False
        self.ids = itertools.count(1)
        self.rx = threading.Thread(
            target=self._recv_loop, daemon=True, name=f"kvmesh-rx-{channel.peer}"
        )
        self.rx.start()

    def send_batch(self, batch: list[WorkRequest]) -> None:
        tr = self.channel.transport
        iovs: list[bytes | bytearray | memoryview] = []
        ids: list[int] = []
        for r in batch:
            rid = next(self.ids)
            ids.append(rid)
            flags = crc = 0
            payload: bytes | bytearray | memoryview | None = None
            if r.op is Op.WRITE or r.op is Op.NOTIFY:
                payload = r.local
                if tr.checksum:
                    flags, crc = F_CRC, zlib.crc32(payload)
                if tr.corrupt_next and r.op is Op.WRITE and r.length:
                    tr.corrupt_next = False
                    damaged = bytearray(payload)
                    damaged[0] ^= 0xFF  # test hook: damage after the crc
                    payload = damaged
            elif tr.checksum:
                flags = F_CRC  # ask the server to checksum READ data
            iovs.append(REQ.pack(r.op, flags, 0, crc, r.region, rid, r.offset, r.length))
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
                        # a READ's ``local`` is the writable destination view
                        reader.read_into(cast(memoryview, r.local))
                        if tr.checksum and zlib.crc32(r.local) != crc:
                            tr.counters.add("checksum_failures")
                            current = None
                            r.complete(
                                TransferError(
                                    f"checksum mismatch reading {length} bytes from "
                                    f"{self.channel.peer} region {r.region} offset {r.offset}"
                                )
                            )
                            continue
                    current = None
                    r.complete(None)
                else:
                    msg = reader.read_bytes(length).decode("utf-8", "replace")
                    current = None
                    if status == ST_CHECKSUM:
                        tr.counters.add("checksum_failures")
                    r.complete(TransferError(f"peer {self.channel.peer}: {msg}"))
        except OSError as e:  # the socket failed or the peer broke the protocol
            self.fail(e, extra=current)
        except Exception as e:  # the thread's top: a bug must still fail over its requests
            log.exception("receiver thread for %s crashed", self.channel.peer)
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


class Channel:
    """One connection slot to a peer, served by a sender thread.

    The transport queues requests with :meth:`enqueue` (and reads ``queued_bytes`` to
    balance its channels), closes it with :meth:`close` and joins ``thread``; the fast
    lane hands it the requests its socket lost (:meth:`on_conn_failed`).
    """

    def __init__(self, transport: TcpEndpoint, peer: str, index: int) -> None:
        self.transport = transport
        self.peer = peer
        self.cv = threading.Condition()
        self.queue: collections.deque[WorkRequest] = collections.deque()
        self.queued_bytes = 0
        self.closed = False
        self.conn: _Conn | None = None
        self.thread = threading.Thread(
            target=self._run, daemon=True, name=f"kvmesh-tx-{peer}-{index}"
        )
        self.thread.start()

    # -- queue management (any thread) ------------------------------------
    def enqueue(self, reqs: list[WorkRequest], front: bool = False) -> None:
        """Queues ``reqs`` for the sender thread (ahead of the rest with ``front``);
        fails them at once if the channel is closed."""
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
        """``reqs`` were lost with a socket (``exc`` says why): each is requeued for
        another attempt, or failed (closed, a NOTIFY already sent, or out of attempts)."""
        retry: list[WorkRequest] = []
        for r in reqs:
            r.attempts += 1
            if self.closed or self.transport.closed:
                r.complete(TransferError("transfer engine closed"))
            elif r.op is Op.NOTIFY and r.sent:
                r.complete(
                    TransferError(
                        f"connection to {self.peer} lost; notify delivery unknown ({exc})"
                    )
                )
            elif r.attempts >= MAX_ATTEMPTS:
                r.complete(
                    TransferError(
                        f"{r.op.name} to {self.peer} failed after {r.attempts} attempts: {exc!r}"
                    )
                )
            else:
                retry.append(r)
        if retry:
            self.transport.counters.add("retries", len(retry))
            self.requeue(retry)

    def close(self) -> None:
        """Stops the sender thread; what is still queued or in flight fails."""
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
            while (
                self.queue
                and len(batch) < MAX_BATCH_REQS
                and nbytes + self.queue[0].length <= MAX_BATCH_BYTES
            ):
                r = self.queue.popleft()
                batch.append(r)
                nbytes += r.length
            self.queued_bytes -= nbytes
            return batch

    def _connect(self) -> _Conn:
        return _Conn(self, open_socket(self.transport, self.peer))

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
                        self._fail_queued(ConnectionError(f"cannot connect to {self.peer}: {e}"))
                        continue
                conn.send_batch(batch)
        except Exception:  # pragma: no cover - the thread's top: the finally fails the queue
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
