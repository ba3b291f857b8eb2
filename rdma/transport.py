"""Transport-independent pieces of the transfer engine.

A :class:`Transport` moves bytes between local memory and *registered memory
regions* of a peer.  It is one-sided: the peer's application code is not
involved in a WRITE or READ, only its transport (for TCP, a server thread; for
RDMA verbs, the NIC).  The public :class:`~rdma.engine.TransferEngine` cuts user
requests into :class:`WorkRequest` s and hands them to a transport; the transport
completes each work request exactly once via :meth:`WorkRequest.complete`.

A verbs transport would implement the same interface: ``start`` creates the
protection domain / queue pairs and registers the regions of the
:class:`RegionTable` (``ibv_reg_mr``), ``submit`` posts work requests
(``IBV_WR_RDMA_WRITE`` / ``IBV_WR_RDMA_READ`` / ``IBV_WR_SEND`` for notifies on
an ordered queue pair) and a completion-queue poller calls ``complete``.
"""

from __future__ import annotations

import enum
import threading
from abc import ABC, abstractmethod
from collections.abc import Callable
from typing import Any

__all__ = [
    "Op",
    "RegionTable",
    "RemoteAccessError",
    "TransferError",
    "Transport",
    "WorkRequest",
    "as_byte_view",
]


class Op(enum.IntEnum):
    """Operation codes (also used on the wire by the TCP transport)."""

    WRITE = 1
    READ = 2
    NOTIFY = 3


class TransferError(Exception):
    """A transfer (or one of its slices) failed; the message names the cause."""


class RemoteAccessError(Exception):
    """A request named an unknown region or fell outside its bounds."""


def as_byte_view(buffer: Any) -> memoryview:
    """Return a writable, flat ``uint8`` memoryview over ``buffer``'s memory.

    Accepts a contiguous CPU ``torch.Tensor`` (any dtype, including bfloat16),
    a C-contiguous writable numpy array, a ``bytearray`` or a writable
    memoryview.  No data is copied.
    """
    if type(buffer).__module__.startswith("torch"):
        import torch  # local import: torch is heavy and optional here

        if not isinstance(buffer, torch.Tensor):
            raise TypeError(f"unsupported buffer type {type(buffer)!r}")
        if buffer.device.type != "cpu":
            raise ValueError("only CPU tensors can be registered")
        if not buffer.is_contiguous():
            raise ValueError("tensor must be contiguous")
        t = buffer.detach().reshape(-1)
        if t.dtype != torch.uint8:
            t = t.view(torch.uint8)  # works for bf16/fp8 that numpy lacks
        buffer = t.numpy()
    try:
        mv = memoryview(buffer)
    except TypeError as e:
        raise TypeError(f"unsupported buffer type {type(buffer)!r}") from e
    if mv.readonly:
        raise ValueError("buffer must be writable")
    if not mv.c_contiguous:
        raise ValueError("buffer must be C-contiguous")
    if mv.format != "B" or mv.ndim != 1:
        mv = mv.cast("B")
    return mv


class RegionTable:
    """Thread-safe table of registered memory regions (id -> byte view).

    Region ids are small positive integers, never reused within a table, so a
    stale id held by a peer cannot silently alias a new region.
    """

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._views: dict[int, memoryview] = {}
        self._owners: dict[int, Any] = {}
        self._next_id = 1

    def register(self, buffer: Any) -> int:
        view = as_byte_view(buffer)
        with self._lock:
            rid = self._next_id
            self._next_id += 1
            self._views[rid] = view
            self._owners[rid] = buffer  # keep the owner alive
        return rid

    def unregister(self, region_id: int) -> None:
        with self._lock:
            if region_id not in self._views:
                raise KeyError(f"unknown region {region_id}")
            del self._views[region_id]
            del self._owners[region_id]

    def size(self, region_id: int) -> int:
        view = self._views.get(region_id)
        if view is None:
            raise KeyError(f"unknown region {region_id}")
        return view.nbytes

    def view(self, region_id: int, offset: int, length: int) -> memoryview:
        """Bounds-checked slice of a region; raises :class:`RemoteAccessError`."""
        view = self._views.get(region_id)  # dict.get is atomic under the GIL
        if view is None:
            raise RemoteAccessError(f"unknown region {region_id}")
        if offset < 0 or length < 0 or offset + length > view.nbytes:
            raise RemoteAccessError(
                f"out of bounds: region {region_id} has {view.nbytes} bytes, "
                f"access [{offset}, {offset + length})"
            )
        return view[offset : offset + length]

    def ids(self) -> list[int]:
        with self._lock:
            return list(self._views)


class WorkRequest:
    """One contiguous piece of work for a transport.

    ``local`` is the local memory: the source for WRITE, the destination for
    READ, the payload for NOTIFY.  ``on_done(error_or_None)`` is called exactly
    once, from whatever thread finished the request.
    """

    __slots__ = (
        "op",
        "local",
        "region",
        "offset",
        "length",
        "on_done",
        "attempts",
        "sent",
        "_finished",
    )

    def __init__(
        self,
        op: Op,
        local: memoryview | bytes,
        region: int,
        offset: int,
        length: int,
        on_done: Callable[[Exception | None], None],
    ) -> None:
        self.op = op
        self.local = local
        self.region = region
        self.offset = offset
        self.length = length
        self.on_done = on_done
        self.attempts = 0  # failed delivery attempts so far
        self.sent = False  # at least one byte may have reached the peer
        self._finished = False

    def complete(self, error: Exception | None = None) -> None:
        if self._finished:  # defensive: a transport bug must not double-count
            return
        self._finished = True
        self.on_done(error)

    def __repr__(self) -> str:
        return (
            f"WorkRequest({self.op.name}, region={self.region}, "
            f"offset={self.offset}, length={self.length})"
        )


class Transport(ABC):
    """Moves :class:`WorkRequest` s to peers and serves peers' requests.

    Implementations serve WRITE/READ requests from peers against ``regions``
    without involving the application, and deliver received NOTIFY payloads to
    ``on_notify`` in arrival order (it may be called from any thread; the
    engine bridges it to the event loop).  Delivery guarantees a transport
    must give:

    * WRITE completes successfully only after the bytes are in the peer's
      memory; READ only after the bytes are in local memory.
    * NOTIFYs submitted to one peer are delivered in submission order.
    * Every submitted work request is completed exactly once, with an error if
      the peer is unreachable, dies, or rejects the request.
    """

    @abstractmethod
    async def start(self, regions: RegionTable, on_notify: Callable[[bytes], None]) -> str:
        """Start serving; return the address peers use to reach us."""

    @abstractmethod
    def submit(self, peer: str, requests: list[WorkRequest]) -> None:
        """Queue requests to ``peer``; never blocks on the network."""

    @abstractmethod
    async def close(self) -> None:
        """Stop serving, fail outstanding requests, release resources."""

    def stats(self) -> dict[str, int]:
        """Transport-level counters (optional)."""
        return {}
