"""A put's values as transfer-engine sources of their own: the bytes API sends a large
value straight from the caller's buffer instead of copying it into the client's staging
region first (the copy was ~10% of a remote 4 MiB put on a busy 2-core host).

On the TCP transport registering a buffer is an entry in the engine's region table, so a
value is registered for the length of one put and unregistered after it. A read-only
value (``bytes``) is registered through a ctypes array over its memory that keeps the
value alive (the transport's requests keep the array alive in turn, so a write still in
flight after the put gave up waiting never reads freed memory). The engine only reads
a source of a WRITE; like every registered region (the staging buffer, a segment), it is
reachable by the cluster's authenticated peers while registered.

Not on RDMA verbs, where registering pins the pages (a memory-region registration per
put would cost more than the copy)."""

from __future__ import annotations

import ctypes
from collections.abc import Awaitable, Callable, Sequence

import numpy as np

from kvmesh.rdma import TransferEngine

# a bytes-API put whose values are all this large sends them from the caller's buffers
DIRECT_PUT_MIN = 256 << 10
# the transports where registering a buffer is only a table entry (``transport_kind``:
# the TCP transport has no ``kind`` of its own, so its class name; "tcp" if it gets one)
TCP_KINDS = frozenset({"TcpTransport", "tcp"})


def usable(te: TransferEngine, views: Sequence[memoryview]) -> bool:
    """Whether a put of ``views`` sends them from their own buffers."""
    return te.transport_kind in TCP_KINDS and all(len(v) >= DIRECT_PUT_MIN for v in views)


def _source(view: memoryview):
    """A writable-typed object over ``view``'s memory that the region table accepts and
    that keeps ``view`` alive (the engine never writes into a WRITE's source)."""
    if not view.readonly:
        return view
    arr = (ctypes.c_char * len(view)).from_address(np.frombuffer(view, dtype=np.uint8).ctypes.data)
    arr._kvmesh_src = view  # type: ignore[attr-defined]  # the value outlives the array
    return arr


def register(te: TransferEngine, views: Sequence[memoryview]) -> list[int]:
    """One region per value (unregister them with :func:`unregister`)."""
    out: list[int] = []
    try:
        for v in views:
            out.append(te.register(_source(v)))
    except BaseException:
        unregister(te, out)
        raise
    return out


def unregister(te: TransferEngine, regions: Sequence[int]) -> None:
    for rid in regions:
        te.unregister(rid)


# (keys, sizes, region per key, offsets=) -> True per stored key (None: not applicable)
PutFn = Callable[..., Awaitable[list[bool] | None]]


async def put(
    te: TransferEngine,
    keys: list[bytes],
    sizes: list[int],
    views: Sequence[memoryview],
    pooled: PutFn,
    placed: PutFn,
) -> list[bool]:
    """Puts ``views`` from their own buffers: each registered as a region for the put
    (gone afterwards, whatever happened: a failure, a cancellation), through the remote
    slot pool (``pooled``) or else PUT_START/PUT_END (``placed``)."""
    regions = register(te, views)
    try:
        zero = [0] * len(views)
        sub = await pooled(keys, sizes, regions, offsets=zero)
        if sub is None:
            sub = await placed(keys, sizes, regions, offsets=zero)
        return sub or [False] * len(keys)
    finally:
        unregister(te, regions)
