"""The conductor's cache index: which KV blocks each node holds, by tier, kept current
from the nodes' and the store's block events.

``lookup(hashes)`` answers, in time proportional to the request's blocks (times the
nodes still matching), the longest prefix each node holds in its own pool and the
longest prefix present anywhere in the cluster store.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass, field

POOL = "pool"  # a node's engine KV pool (prefix cache)
STORE = "store"  # the cluster store: DRAM segments, and SSD tiers behind them


@dataclass
class Lookup:
    """Longest held prefix, in blocks: per node (own pool) and in the store."""

    per_node: dict[str, int] = field(default_factory=dict)
    store_prefix: int = 0  # any tier
    store_dram_prefix: int = 0  # the leading part of it held in DRAM (the rest on SSD)


class CacheIndex:
    def __init__(self) -> None:
        self._pool: dict[bytes, set[str]] = {}
        self._by_node: dict[str, set[bytes]] = {}
        self._store: dict[bytes, int] = {}  # hash -> replica count, any tier
        self._ssd: dict[bytes, int] = {}  # hash -> replicas on an SSD tier

    # -- node pools ------------------------------------------------------------------------
    def stored(self, node: str, hashes: Iterable[bytes]) -> None:
        mine = self._by_node.setdefault(node, set())
        for h in hashes:
            self._pool.setdefault(h, set()).add(node)
            mine.add(h)

    def removed(self, node: str, hashes: Iterable[bytes]) -> None:
        mine = self._by_node.get(node)
        for h in hashes:
            holders = self._pool.get(h)
            if holders is not None:
                holders.discard(node)
                if not holders:
                    del self._pool[h]
            if mine is not None:
                mine.discard(h)

    def reset(self, node: str, hashes: Iterable[bytes]) -> None:
        """Replaces everything known about ``node`` with a full snapshot."""
        self.drop_node(node)
        self.stored(node, hashes)

    def drop_node(self, node: str) -> None:
        self.removed(node, list(self._by_node.pop(node, ())))

    def holds(self, node: str) -> int:
        return len(self._by_node.get(node, ()))

    # -- store -----------------------------------------------------------------------------
    def store_stored(self, hashes: Iterable[bytes], tier: str = "dram") -> None:
        for h in hashes:
            self._store[h] = self._store.get(h, 0) + 1
            if tier == "ssd":
                self._ssd[h] = self._ssd.get(h, 0) + 1

    def store_removed(self, hashes: Iterable[bytes], tier: str = "dram") -> None:
        for h in hashes:
            for table in (self._store, self._ssd) if tier == "ssd" else (self._store,):
                n = table.get(h, 0) - 1
                if n > 0:
                    table[h] = n
                else:
                    table.pop(h, None)

    def store_reset(self, hashes: Iterable[bytes]) -> None:
        self._store, self._ssd = {}, {}
        self.store_stored(hashes)

    # -- queries ---------------------------------------------------------------------------
    def lookup(self, hashes: list[bytes]) -> Lookup:
        out = Lookup()
        pool = self._pool
        holders = pool.get(hashes[0]) if hashes else None
        if holders:
            # the nodes holding the first block, in the order of a copy of its holder set
            # (the order candidates are tried in); each keeps the length at which it
            # drops out, and only steps where some node drops out cost more than a lookup
            alive = set(holders)
            per_node = out.per_node = dict.fromkeys(alive, 1)
            n = len(hashes)
            i = 1
            while i < n:
                holders = pool.get(hashes[i])
                if not holders:
                    break
                if not alive <= holders:
                    gone = alive - holders
                    for node in gone:
                        per_node[node] = i
                    alive -= gone
                    if not alive:
                        break
                i += 1
            for node in alive:
                per_node[node] = i
        store, ssd = self._store, self._ssd
        n = dram = 0
        get = store.get
        for h in hashes:
            replicas = get(h)
            if replicas is None:
                break
            n += 1
            if dram == n - 1 and (not ssd or replicas > ssd.get(h, 0)):
                dram = n
        out.store_prefix, out.store_dram_prefix = n, dram
        return out

    def __len__(self) -> int:
        return len(self._pool)
