"""TCP implementation of :class:`kvmesh.rdma.transport.Transport`.

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
no thread handoff at all; see :class:`kvmesh.rdma.tcp_lane.FastLane`.

Busy polling (``poll_us``, default 200): a server thread waiting for the next
request (or a WRITE payload) spins on non-blocking receives that long before it
blocks, and the event loop spins that long for a small fast-lane reply.  On a
VM a sleeping thread's wake-up costs tens of microseconds per hop, which is most
of a 64 KiB request's time.  At most ``spinners`` server threads spin at once
(however many connections there are), and windows that run out make later
waits skip polling for a while (:class:`kvmesh.rdma.wire.PollBackoff`).
``poll_us=0`` never spins.

Wire format (network byte order), after the handshake in :mod:`kvmesh.rdma.wire`::

    request: op u8 | flags u8 | rsv u16 | crc32 u32 | region u32 | req_id u64
             | offset u64 | length u64          (+ payload for WRITE / NOTIFY)
    reply:   kind u8 | status u8 | rsv u16 | crc32 u32 | req_id u64 | length u64
             (+ data for a READ that succeeded, + utf-8 message for an error)

Modules: this one holds :class:`TcpTransport` (lifecycle, client-side submit,
stats); :mod:`kvmesh.rdma.tcp_channel` the client channels (sender/receiver threads,
retries); :mod:`kvmesh.rdma.tcp_lane` the fast lane; :mod:`kvmesh.rdma.tcp_accept` the accept
loop (handshakes with a deadline, the connection cap); :mod:`kvmesh.rdma.tcp_server`
per-connection request serving; :mod:`kvmesh.rdma.tcp_proto` the framing
constants and :class:`~kvmesh.rdma.tcp_proto.TcpEndpoint`, the part of the transport the
other modules see (none of them imports this one).  Each tunable is defined in the
module that reads it and re-exported here: to change one at run time (tests), patch it
in the module that defines it.
"""

from __future__ import annotations

import asyncio
import socket
import threading
from collections.abc import Callable

# Each tunable lives in the module that reads it; they and the framing constants
# are re-exported here, where they were defined before the split.
from .tcp_accept import MAX_CONNS, accept_loop  # noqa: F401
from .tcp_channel import MAX_ATTEMPTS, MAX_BATCH_BYTES, MAX_BATCH_REQS, Channel  # noqa: F401
from .tcp_lane import FAST_MAX_INFLIGHT, FAST_RETRY_S, FastLane  # noqa: F401
from .tcp_proto import (  # noqa: F401
    F_CRC,
    MAX_NOTIFY_BYTES,
    POLL_BACKOFF,
    REPLY,
    ST_BAD_ACCESS,
    ST_BAD_REQUEST,
    ST_CHECKSUM,
    ST_OK,
)
from .tcp_server import (  # noqa: F401
    MAX_PENDING_ACKS,
    MAX_PENDING_REPLY_BYTES,
    POLL_MAX_BYTES,
    SCRATCH_BYTES,
    ServerState,
)
from .transport import Op, RegionTable, TransferError, Transport, WorkRequest
from .wire import Counters, configure_socket, split_address, usable_cpus

CONNECT_TIMEOUT = 3.0  # default seconds for TCP connect + handshake
FAST_MAX_BYTES = 1 << 20  # loop-thread requests up to this size use the fast lane
# (while it has fewer than FAST_MAX_INFLIGHT in flight)
# a batch is spread over one channel per this many bytes of it (at least one, at most
# conns_per_peer): a batch of small requests on one connection wakes one server thread
# that takes them back to back, instead of several that contend for the GIL and for
# the cores (4 KiB batches of 128: ~12% faster puts, ~10% faster gets, issue 13)
SPREAD_BYTES = 1 << 20


class TcpTransport(Transport):
    """The TCP transport: authenticated, pipelined, multi-connection.

    ``corrupt_next`` is a test-only fault-injection hook: when set, the next
    payload this transport sends (WRITE data as a client, READ data as a
    server) has one byte flipped *after* its crc32 was computed.

    It satisfies :class:`~kvmesh.rdma.tcp_proto.TcpEndpoint`, which is how its channels,
    fast lanes and server threads see it.
    """

    def __init__(
        self,
        secret: bytes,
        host: str = "127.0.0.1",
        port: int = 0,
        *,
        conns_per_peer: int = 4,
        checksum: bool = False,
        sock_buf_bytes: int = 4 << 20,
        connect_timeout: float = CONNECT_TIMEOUT,
        poll_us: int = 200,
        max_conns: int = MAX_CONNS,
    ) -> None:
        """``connect_timeout``: seconds for connecting to a peer and its handshake, and
        (at least 1 s) for a peer's whole handshake with this one's data port; ``max_conns``:
        most connections the data port holds at once (:mod:`kvmesh.rdma.tcp_accept`)."""
        if not secret:
            raise ValueError("a non-empty cluster secret is required")
        if conns_per_peer < 1:
            raise ValueError("conns_per_peer must be >= 1")
        if max_conns < 1:
            raise ValueError(f"max_conns must be >= 1, not {max_conns}")
        self.secret = bytes(secret)
        self.host = host
        self.port = port
        self.conns_per_peer = conns_per_peer
        self.checksum = checksum
        self.sock_buf_bytes = sock_buf_bytes
        self.connect_timeout = connect_timeout
        self.handshake_s = max(connect_timeout, 1.0)
        self.max_conns = max_conns
        if poll_us < 0:
            raise ValueError("poll_us must be >= 0")
        self.poll_s = poll_us / 1e6
        # server threads allowed to busy-poll at once (a quarter of the cores, at least 1)
        self.spinners = threading.BoundedSemaphore(max(1, usable_cpus() // 4))
        self.corrupt_next = False
        self.counters = Counters()
        self.closed = False
        self._lock = threading.Lock()
        self._channels: dict[str, list[Channel]] = {}
        self._server: ServerState | None = None  # set by start()
        self._accept_thread: threading.Thread | None = None
        self._spread_turn = 0  # which idle channel a small batch takes next
        self._loop: asyncio.AbstractEventLoop | None = None
        self._loop_tid: int | None = None
        self._lanes: dict[str, FastLane] = {}  # loop thread only
        self.fast_requests = 0
        self.address = ""

    # -- lifecycle ----------------------------------------------------------
    async def start(self, regions: RegionTable, on_notify: Callable[[bytes], None]) -> str:
        self._loop = asyncio.get_running_loop()
        self._loop_tid = threading.get_ident()
        family = socket.getaddrinfo(self.host, self.port, type=socket.SOCK_STREAM)[0][0]
        ls = socket.socket(family, socket.SOCK_STREAM)
        ls.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        configure_socket(ls, self.sock_buf_bytes)  # inherited by accepted sockets
        ls.bind((self.host, self.port))
        ls.listen(512)  # the accept loop makes it non-blocking and wakes every 0.5 s
        self._server = server = ServerState(ls, regions, on_notify)
        self.port = ls.getsockname()[1]
        self.address = f"{self.host}:{self.port}"
        self._accept_thread = threading.Thread(
            target=accept_loop,
            args=(self, server),
            daemon=True,
            name=f"kvmesh-accept-{self.port}",
        )
        self._accept_thread.start()
        return self.address

    async def close(self) -> None:
        if self.closed:
            return
        self.closed = True
        server = self._server
        if server is not None:
            try:
                server.listener.shutdown(socket.SHUT_RDWR)
            except OSError:
                pass
        with self._lock:
            channels = [c for cs in self._channels.values() for c in cs]
            self._channels.clear()
        socks, server_threads = server.shut() if server is not None else ([], [])
        for c in channels:
            c.close()
        lanes = list(self._lanes.values())
        self._lanes.clear()
        for lane in lanes:
            if threading.get_ident() == self._loop_tid or self._loop is None:
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
        threads = [c.thread for c in channels] + server_threads
        if self._accept_thread is not None:
            threads.append(self._accept_thread)

        def join_all() -> None:
            for t in threads:
                t.join(timeout=5)

        await asyncio.to_thread(join_all)
        if server is not None:
            server.listener.close()

    # -- client side ----------------------------------------------------------
    def _channels_for(self, peer: str) -> list[Channel]:
        chans = self._channels.get(peer)
        if chans is None:
            with self._lock:
                if self.closed:
                    raise TransferError("transfer engine closed")
                chans = self._channels.get(peer)
                if chans is None:
                    split_address(peer)  # validate early
                    chans = [Channel(self, peer, i) for i in range(self.conns_per_peer)]
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
            loop = self._loop
            if (
                r.length <= FAST_MAX_BYTES
                and r.op is not Op.NOTIFY
                and threading.get_ident() == self._loop_tid
                and loop is not None
                and not self.corrupt_next
                and not self.closed
            ):
                lane = self._lanes.get(peer)
                if lane is None:
                    lane = self._lanes[peer] = FastLane(self, peer, chans[0], loop)
                if lane.usable():
                    self.fast_requests += 1  # loop thread only: no lock needed
                    lane.submit(r)
                    return
            if r.op is Op.NOTIFY:
                chans[0].enqueue(requests)  # one ordered channel for notifies
            else:
                min(chans, key=lambda c: c.queued_bytes).enqueue(requests)
            return
        # Spread over the least loaded channels (one per SPREAD_BYTES), balancing
        # bytes; keep each channel's share in submission order so small requests
        # coalesce into few sendmsgs.
        n = max(1, min(len(chans), sum(r.length for r in requests) // SPREAD_BYTES))
        if n < len(chans):
            # ties (idle channels: a sender's batch in flight is not counted) go round,
            # so small batches do not all queue on the first channel
            k = len(chans)
            turn = self._spread_turn = (self._spread_turn + 1) % k
            order = sorted(range(k), key=lambda i: (chans[i].queued_bytes, (i - turn) % k))
            chans = [chans[i] for i in order[:n]]
        loads = [c.queued_bytes for c in chans]
        buckets: list[list[WorkRequest]] = [[] for _ in range(n)]
        for r in requests:
            i = min(range(n), key=loads.__getitem__)
            buckets[i].append(r)
            loads[i] += r.length + 64  # + header cost so empty requests spread too
        for c, b in zip(chans, buckets):
            if b:
                c.enqueue(b)

    def stats(self) -> dict[str, int]:
        out = self.counters.snapshot()
        if self.fast_requests:
            out["fast_lane_requests"] = self.fast_requests
        return out
