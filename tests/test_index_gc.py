"""The cache index keeps its 10^6 block hashes out of the garbage collector's walks: a
full collection in a conductor costs the objects it tracks, and the index's per-node
holdings are dicts of bytes to None, which the collector does not track (a set of them
is always tracked, and walked hash by hash on every full collection)."""

from __future__ import annotations

import gc

from kvmesh.services.conductor.index import CacheIndex


def _hashes(prefix: int, n: int) -> list[bytes]:
    return [prefix.to_bytes(2, "little") + i.to_bytes(6, "little") for i in range(n)]


def test_node_holdings_are_not_tracked_by_the_collector():
    idx = CacheIndex()
    idx.stored("n0", _hashes(0, 1000))
    idx.stored("n1", _hashes(0, 10) + _hashes(1, 500))
    idx.removed("n0", _hashes(0, 3))
    idx.reset("n2", _hashes(2, 200))
    gc.collect()
    assert idx.holds("n0") == 997 and idx.holds("n1") == 510 and idx.holds("n2") == 200
    per_node = list(idx._by_node.values())
    assert len(per_node) == 3
    assert not any(gc.is_tracked(held) for held in per_node)
    # the pool itself (hash -> holder id) is untracked while every block has one holder
    idx.removed("n1", _hashes(0, 10))
    gc.collect()
    assert not gc.is_tracked(idx._pool)
    idx.drop_node("n0")
    assert idx.holds("n0") == 0 and len(idx) == 500 + 200
