"""Public, asyncio-facing transfer engine.

:class:`TransferEngine` owns the registered memory regions, cuts batched
one-sided requests into ``chunk_bytes`` work requests, hands them to a
:class:`~rdma.transport.Transport` (TCP by default), and bridges completion
back to the event loop with ``loop.call_soon_threadsafe`` (or resolves the
awaiters directly when the transport completes on the loop thread itself).
"""

from __future__ import annotations

import asyncio
import enum
import logging
import os
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from .tcp_accept import MAX_CONNS
from .transport import Op, RegionTable, RemoteAccessError, TransferError, Transport, WorkRequest
from .wire import LoopTurns

__all__ = ["Slice", "Transfer", "TransferEngine", "TransferError", "TransferStatus"]

log = logging.getLogger(__name__)
_TURNS = LoopTurns()  # see Transfer.__await__

# TEST-ONLY fault injection, off by default: with KVMESH_FAULT_CORRUPT_EVERY=N (N > 0) in
# a process's environment, every N-th WRITE/READ its engines issue arms ``_corrupt_next``
# (one byte of the next data payload this engine sends is flipped after its crc32 was
# computed).  Used by loadtest.faults / tests.test_faults to check that a damaged KV
# handoff or store read is detected (``--checksum``) and never yields a wrong token.
# Read once at import; never set it in production.
try:
    _FAULT_CORRUPT_EVERY = max(0, int(os.environ.get("KVMESH_FAULT_CORRUPT_EVERY", "0") or 0))
except ValueError:
    _FAULT_CORRUPT_EVERY = 0

BW_MIN_BYTES = 256 << 10  # busy periods moving less than this give no sample
BW_MAX_WINDOW = 0.5  # seconds: a long busy period is sampled this often
BW_ALPHA = 0.3  # EWMA weight of the newest sample


class TransferStatus(enum.Enum):
    """Lifecycle of a :class:`Transfer`."""

    PENDING = "pending"
    DONE = "done"
    FAILED = "failed"


@dataclass(frozen=True)
class Slice:
    """One contiguous copy between a local and a remote registered region."""

    local_region: int
    local_offset: int
    remote_region: int
    remote_offset: int
    length: int


class Transfer:
    """Handle for one batched WRITE/READ/NOTIFY.

    Completes when every piece has completed; fails (``status is FAILED``,
    ``error`` set to the first error message) if any piece failed.  Await it
    on the engine's event loop (raises :class:`TransferError` on failure), or
    call :meth:`wait` from another thread.
    """

    __slots__ = (
        "kind",
        "peer",
        "bytes",
        "error",
        "_status",
        "_loop",
        "_loop_tid",
        "_waiters",
        "_done",
        "_lock",
        "_remaining",
        "_callbacks",
    )

    def __init__(
        self,
        loop: asyncio.AbstractEventLoop,
        kind: str,
        peer: str,
        nbytes: int,
        loop_tid: int | None = None,
    ) -> None:
        self.kind = kind
        self.peer = peer
        self.bytes = nbytes
        self.error: str | None = None
        self._status = TransferStatus.PENDING
        self._loop = loop
        self._loop_tid = loop_tid  # thread running ``loop`` (None: unknown)
        self._waiters: list[asyncio.Future] | None = None  # loop thread only
        self._done = threading.Lock()  # held until finished (cheaper than an Event)
        self._done.acquire()
        self._lock = threading.Lock()
        self._remaining = 0
        self._callbacks: list[Callable[[Transfer], None]] = []

    # -- public -------------------------------------------------------------
    @property
    def status(self) -> TransferStatus:
        return self._status

    def done(self) -> bool:
        return self._status is not TransferStatus.PENDING

    def wait(self, timeout: float | None = None) -> bool:
        """Block the calling thread (never the event loop's) until done."""
        if self._status is not TransferStatus.PENDING:
            return True
        if not self._done.acquire(timeout=-1 if timeout is None else max(timeout, 0)):
            return False
        self._done.release()  # let other waiters through
        return True

    def __await__(self):
        if self._status is TransferStatus.PENDING:
            # One future per awaiter (resolved together by _resolve): cancelling
            # one awaiter cannot disturb another, as with asyncio.shield, but
            # without shield's extra future and extra event-loop hop.
            waiter = self._loop.create_future()
            if self._waiters is None:
                self._waiters = [waiter]
            else:
                self._waiters.append(waiter)
            yield from waiter
        elif _TURNS.owed():
            # Done before it was awaited (e.g. a fast-lane reply caught while polling):
            # a task awaiting such transfers back to back would never let other
            # tasks, timers or cancellation in, so it yields now and then.
            yield from asyncio.sleep(0).__await__()
        if self._status is TransferStatus.FAILED:
            raise TransferError(self.error)
        return self

    def __repr__(self) -> str:
        return (
            f"Transfer({self.kind} {self.peer}, {self.bytes} B, "
            f"{self._status.name}{', ' + self.error if self.error else ''})"
        )

    # -- engine side (thread-safe) ----------------------------------------
    def _expect(self, parts: int) -> None:
        """Arm with the number of pieces; 0 completes immediately."""
        with self._lock:
            self._remaining += parts
            finished = self._remaining == 0
        if finished:
            self._finish()

    def _part_done(self, error: Exception | None) -> None:
        with self._lock:
            if error is not None and self.error is None:
                self.error = str(error) or repr(error)
            self._remaining -= 1
            finished = self._remaining == 0
        if finished:
            self._finish()

    def _fail_now(self, message: str) -> None:
        self.error = message
        self._finish()

    def _finish(self) -> None:
        with self._lock:
            if self._status is not TransferStatus.PENDING:
                return
            self._status = TransferStatus.FAILED if self.error is not None else TransferStatus.DONE
            callbacks, self._callbacks = self._callbacks, []
        self._done.release()
        for cb in callbacks:
            try:
                cb(self)
            except Exception:  # pragma: no cover - runs on a transport thread: one failing
                # callback must not stop the others nor the transfer's resolution
                log.exception("transfer callback failed")
        if self._loop_tid is not None and threading.get_ident() == self._loop_tid:
            self._resolve()  # already on the loop: no self-pipe wakeup needed
            return
        try:
            self._loop.call_soon_threadsafe(self._resolve)
        except RuntimeError:
            pass  # loop closed; wait()/status still work

    def _resolve(self) -> None:
        waiters, self._waiters = self._waiters, None
        if waiters:
            for w in waiters:
                if not w.done():  # cancelled awaiters are skipped
                    w.set_result(None)

    def _add_callback(self, cb: Callable[[Transfer], None]) -> None:
        """Run ``cb(self)`` in the completing thread (now if already done)."""
        with self._lock:
            if self._status is TransferStatus.PENDING:
                self._callbacks.append(cb)
                return
        cb(self)


def _when_all(transfers: list[Transfer], fn: Callable[[], None]) -> None:
    if not transfers:
        fn()
        return
    lock = threading.Lock()
    left = [len(transfers)]

    def one_done(_: Transfer) -> None:
        with lock:
            left[0] -= 1
            last = left[0] == 0
        if last:
            fn()

    for t in transfers:
        t._add_callback(one_done)


class TransferEngine:
    """One-sided, batched, asynchronous bulk transfers between registered
    memory regions of cluster nodes.

    Peers address memory as ``(engine address, region id, offset)``.  WRITE and
    READ never involve the peer's application code; NOTIFY delivers a small
    payload to the peer's handlers only after every WRITE this engine issued
    to that peer before the notify has landed.  All methods except
    :meth:`start`/:meth:`close` are synchronous and non-blocking; they may be
    called from any thread once :meth:`start` has run.
    """

    def __init__(
        self,
        secret: bytes,
        host: str = "127.0.0.1",
        port: int = 0,
        *,
        conns_per_peer: int = 4,
        chunk_bytes: int = 2 << 20,
        checksum: bool = False,
        connect_timeout: float = 3.0,
        poll_us: int = 200,
        max_conns: int = MAX_CONNS,
        transport: Transport | str | None = None,
        transport_options: dict | None = None,
    ) -> None:
        """``transport`` is a :class:`Transport` instance, or a kind for
        :func:`kvmesh.rdma.factory.make_transport`: ``"tcp"``, ``"rdma"`` or
        ``"auto"`` (the default: RDMA verbs when a device is usable, else TCP
        with one log line saying why).  ``transport_options`` are passed to
        the factory (e.g. ``devices=["mlx5_0"]``). ``poll_us`` is the TCP
        transport's busy-poll window (0 = never spin; see ``TcpTransport``), ``max_conns``
        the most connections its data port holds at once (:mod:`kvmesh.rdma.tcp_accept`)."""
        if chunk_bytes < 1:
            raise ValueError("chunk_bytes must be positive")
        self.chunk_bytes = chunk_bytes
        self.checksum = checksum
        self.poll_us = poll_us  # also the store client's busy-poll window
        if transport is None or isinstance(transport, str):
            from .factory import make_transport  # local: factory imports engine deps

            transport = make_transport(
                transport or "auto",
                secret=secret,
                host=host,
                port=port,
                conns_per_peer=conns_per_peer,
                checksum=checksum,
                connect_timeout=connect_timeout,
                poll_us=poll_us,
                max_conns=max_conns,
                **(transport_options or {}),
            )
        self._transport = transport
        self.transport_kind = getattr(transport, "kind", type(transport).__name__)
        self._regions = RegionTable()
        self._handlers: list[Callable[[bytes], None]] = []
        self._loop: asyncio.AbstractEventLoop | None = None
        self._loop_tid: int | None = None
        self._address = ""
        self._closed = False
        self._lock = threading.Lock()
        self._pending_writes: dict[str, set[Transfer]] = {}
        self._last_notify: dict[str, Transfer] = {}
        self._stats = {
            "bytes_written": 0,
            "bytes_read": 0,
            "writes": 0,
            "reads": 0,
            "notifies_sent": 0,
            "notifies_received": 0,
            "transfers_failed": 0,
        }
        # per-peer busy-period bandwidth measurement (see bandwidth())
        self._bw: dict[str, float] = {}
        self._bw_inflight: dict[str, int] = {}
        self._bw_window: dict[str, list] = {}  # peer -> [start, bytes, first period]
        self._bw_seen: set[str] = set()  # peers with a busy period behind them
        self._fault_every = _FAULT_CORRUPT_EVERY  # test-only, see KVMESH_FAULT_CORRUPT_EVERY
        self._fault_count = 0
        if self._fault_every:
            log.warning(
                "TEST-ONLY fault injection on: one data-plane byte in every %d "
                "transfers is corrupted (KVMESH_FAULT_CORRUPT_EVERY)",
                self._fault_every,
            )

    # -- lifecycle ----------------------------------------------------------
    async def start(self) -> None:
        """Bind and serve; must be awaited inside the running event loop."""
        if self._loop is not None:
            raise RuntimeError("engine already started")
        self._loop = asyncio.get_running_loop()
        self._loop_tid = threading.get_ident()
        self._address = await self._transport.start(self._regions, self._on_notify)

    async def close(self) -> None:
        """Stop serving, close connections (failing what is in flight), join threads."""
        if self._closed:
            return
        self._closed = True
        await self._transport.close()

    async def __aenter__(self) -> TransferEngine:
        await self.start()
        return self

    async def __aexit__(self, *exc: Any) -> None:
        await self.close()

    @property
    def address(self) -> str:
        """``"host:port"`` peers use to reach this engine."""
        return self._address

    # -- memory regions -----------------------------------------------------
    def register(self, buffer: Any) -> int:
        """Register a contiguous CPU tensor / numpy array / bytearray /
        writable memoryview; returns its region id (a reference is kept)."""
        return self._regions.register(buffer)

    def unregister(self, region_id: int) -> None:
        """Forget a region; in-flight transfers touching it must be finished."""
        self._regions.unregister(region_id)

    def region_size(self, region_id: int) -> int:
        return self._regions.size(region_id)

    def region_view(self, region_id: int, offset: int, length: int) -> memoryview:
        """A bounds-checked, zero-copy view of ``length`` bytes at ``offset`` in one of
        this engine's registered regions (to copy locally without a transfer).  Raises
        :class:`~kvmesh.rdma.transport.RemoteAccessError` for an unknown region or an
        access out of its bounds."""
        return self._regions.view(region_id, offset, length)

    # -- data path ----------------------------------------------------------
    def write(self, peer: str, slices: list[Slice]) -> Transfer:
        """Copy local -> remote for every slice."""
        t = self._issue(Op.WRITE, peer, slices)
        if not t.done():
            with self._lock:
                pending = self._pending_writes.setdefault(peer, set())
                pending.add(t)
            t._add_callback(self._write_finished)
        return t

    def read(self, peer: str, slices: list[Slice]) -> Transfer:
        """Copy remote -> local for every slice."""
        return self._issue(Op.READ, peer, slices)

    def notify(self, peer: str, payload: bytes) -> Transfer:
        """Deliver ``payload`` to ``peer``'s notify handlers after every write
        previously issued to ``peer`` has landed (fails if one of them failed).
        Notifies to one peer are delivered in issue order."""
        loop = self._require_started()
        payload = bytes(payload)
        t = Transfer(loop, "notify", peer, len(payload), self._loop_tid)
        self._count("notifies_sent")
        with self._lock:
            writes = list(self._pending_writes.get(peer, ()))
            prev = self._last_notify.get(peer)
            self._last_notify[peer] = t
        deps = writes + ([prev] if prev is not None else [])

        def send() -> None:
            failed = [w for w in writes if w.status is TransferStatus.FAILED]
            if failed:
                t._fail_now(
                    f"notify not sent: a preceding write to {peer} failed: {failed[0].error}"
                )
                return
            if self._closed:
                t._fail_now("transfer engine closed")
                return
            t._expect(1)
            self._transport.submit(
                peer, [WorkRequest(Op.NOTIFY, payload, 0, 0, len(payload), t._part_done)]
            )

        _when_all(deps, send)
        t._add_callback(self._transfer_finished)
        return t

    def add_notify_handler(self, fn: Callable[[bytes], None]) -> None:
        """``fn(payload)`` runs on the event loop thread for each notify, in order."""
        self._handlers.append(fn)

    @property
    def stats(self) -> dict:
        """Engine counters plus transport counters (bytes_served_in/out,
        retries...), plus ``"bandwidth"``: ``{peer: measured bytes/s}``."""
        with self._lock:
            out: dict = dict(self._stats)
            out["bandwidth"] = dict(self._bw)
        for k, v in self._transport.stats().items():
            out[k] = v
        return out

    def bandwidth(self, peer: str) -> float | None:
        """Measured WRITE/READ throughput to ``peer`` in bytes/s, or None
        before enough data has moved.

        The engine tracks *busy periods* per peer (at least one write/read to
        it in flight) and takes a sample of bytes completed / period length
        when a period ends, or every ``BW_MAX_WINDOW`` s while traffic is
        continuous, if it moved at least ``BW_MIN_BYTES``; never from the first
        period to a peer, which includes connecting to it.  Concurrent
        transfers therefore measure the aggregate rate, not a per-transfer
        share.  Samples are smoothed with an EWMA (``BW_ALPHA``)."""
        with self._lock:
            return self._bw.get(peer)

    # -- internals ------------------------------------------------------------
    def _require_started(self) -> asyncio.AbstractEventLoop:
        if self._loop is None:
            raise RuntimeError("TransferEngine.start() has not been awaited")
        return self._loop

    def _count(self, key: str, n: int = 1) -> None:
        with self._lock:
            self._stats[key] += n

    def _issue(self, op: Op, peer: str, slices: list[Slice]) -> Transfer:
        loop = self._require_started()
        total = sum(s.length for s in slices)
        kind = "write" if op is Op.WRITE else "read"
        t = Transfer(loop, kind, peer, total, self._loop_tid)
        with self._lock:
            self._stats["writes" if op is Op.WRITE else "reads"] += 1
            n = self._bw_inflight.get(peer, 0)
            self._bw_inflight[peer] = n + 1
            if n == 0:
                self._bw_window[peer] = [time.monotonic(), 0, peer not in self._bw_seen]
        t._add_callback(self._transfer_finished)
        if self._closed:
            t._fail_now("transfer engine closed")
            return t
        reqs: list[WorkRequest] = []
        chunk = self.chunk_bytes
        try:
            for s in slices:
                if s.remote_offset < 0 or s.length < 0:
                    raise RemoteAccessError(f"negative offset/length in {s}")
                local = self._regions.view(s.local_region, s.local_offset, s.length)
                for off in range(0, s.length, chunk):
                    n = min(chunk, s.length - off)
                    reqs.append(
                        WorkRequest(
                            op,
                            local[off : off + n],
                            s.remote_region,
                            s.remote_offset + off,
                            n,
                            t._part_done,
                        )
                    )
        except RemoteAccessError as e:
            t._fail_now(f"local {e}")
            return t
        t._expect(len(reqs))
        if self._fault_every and reqs:  # test-only fault injection (off by default)
            with self._lock:
                self._fault_count += 1
                arm = self._fault_count % self._fault_every == 0
            if arm:
                self._corrupt_next = True
        self._transport.submit(peer, reqs)
        return t

    def _write_finished(self, t: Transfer) -> None:
        with self._lock:
            pending = self._pending_writes.get(t.peer)
            if pending is not None:
                pending.discard(t)
                if not pending:
                    del self._pending_writes[t.peer]

    def _transfer_finished(self, t: Transfer) -> None:
        with self._lock:
            if t.status is TransferStatus.FAILED:
                self._stats["transfers_failed"] += 1
            elif t.kind == "write":
                self._stats["bytes_written"] += t.bytes
            elif t.kind == "read":
                self._stats["bytes_read"] += t.bytes
            if t.kind != "notify":
                self._bw_account(t)
            if t.kind == "notify" and self._last_notify.get(t.peer) is t:
                del self._last_notify[t.peer]

    def _bw_account(self, t: Transfer) -> None:
        """Caller holds ``self._lock``; ``t`` is a finished write/read."""
        peer = t.peer
        window = self._bw_window.get(peer)
        left = self._bw_inflight.get(peer, 1) - 1
        if left <= 0:
            self._bw_inflight.pop(peer, None)
            self._bw_window.pop(peer, None)
        else:
            self._bw_inflight[peer] = left
        if window is None:
            return
        if t.status is TransferStatus.DONE:
            window[1] += t.bytes
        now = time.monotonic()
        elapsed = now - window[0]
        if left > 0 and elapsed < BW_MAX_WINDOW:
            return
        # a peer's first busy period is not sampled: it holds the connection's setup (the
        # transport connects on first use), which once made a node holding a prefix look
        # slower to hand off from than recomputing it elsewhere
        if window[1] >= BW_MIN_BYTES and elapsed > 0 and not window[2]:
            sample = window[1] / elapsed
            old = self._bw.get(peer)
            self._bw[peer] = sample if old is None else old + BW_ALPHA * (sample - old)
        self._bw_seen.add(peer)
        window[0], window[1], window[2] = now, 0, False

    def _on_notify(self, payload: bytes) -> None:
        """Called by the transport (any thread) in arrival order."""
        loop = self._loop
        if loop is not None:
            try:
                loop.call_soon_threadsafe(self._dispatch_notify, payload)
            except RuntimeError:
                pass  # loop closed

    def _dispatch_notify(self, payload: bytes) -> None:
        self._count("notifies_received")
        for fn in list(self._handlers):
            try:
                fn(payload)
            except Exception:  # application code: one failing handler must not stop the others
                log.exception("notify handler failed")

    # -- test hooks -----------------------------------------------------------
    @property
    def _corrupt_next(self) -> bool:
        """Test-only: flip one byte of the next payload sent, after its crc."""
        return bool(getattr(self._transport, "corrupt_next", False))

    @_corrupt_next.setter
    def _corrupt_next(self, value: bool) -> None:
        self._transport.corrupt_next = value  # type: ignore[attr-defined]
