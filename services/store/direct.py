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
from collections.abc import Sequence

import numpy as np

from kvmesh.rdma import TransferEngine

# a bytes-API put whose values are all this large sends them from the caller's buffers
DIRECT_PUT_MIN = 256 << 10


def usable(te: TransferEngine, views: Sequence[memoryview]) -> bool:
    """Whether a put of ``views`` sends them from their own buffers."""
    return te.transport_kind != "rdma" and all(len(v) >= DIRECT_PUT_MIN for v in views)


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
