"""The conductor's cache index: which KV blocks each node holds, by tier, kept current
from the nodes' and the store's block events.

``lookup(hashes)`` answers, in time proportional to the request's blocks (times the
nodes still matching), the longest prefix each node holds in its own pool and the
longest prefix present anywhere in the cluster store.

A block held by one node (the common case) maps to that node's id itself, one shared
string per node, and only a block held by several maps to a set of them: no set object
per block (about 200 bytes each, and one more object for the garbage collector to walk
at 10^6 blocks), and a lookup that follows one node compares pointers instead of
reading a set for each block.

Compiled (setup.py), the index also keeps a mirror of its three dicts in one C table
(``_blocktable``: a block's holder and its store and SSD replica counts in one slot),
written with the dicts, from which ``lookup`` answers (one cache miss per block); plain
Python has no table and the dicts answer, with the same answers.
"""

from __future__ import annotations

import logging
from collections.abc import Iterable
from dataclasses import dataclass

from kvmesh.services.conductor import _blocktable, _prefetch

POOL = "pool"  # a node's engine KV pool (prefix cache)
STORE = "store"  # the cluster store: DRAM segments, and SSD tiers behind them


@dataclass(init=False)  # (its own __init__: a default factory costs ~1 us compiled)
class Lookup:
    """Longest held prefix, in blocks: per node (own pool) and in the store."""

    per_node: dict[str, int]
    store_prefix: int  # any tier
    store_dram_prefix: int  # the leading part of it held in DRAM (the rest on SSD)

    def __init__(
        self,
        per_node: dict[str, int] | None = None,
        store_prefix: int = 0,
        store_dram_prefix: int = 0,
    ) -> None:
        self.per_node = per_node if per_node is not None else {}
        self.store_prefix = store_prefix
        self.store_dram_prefix = store_dram_prefix


def _run(pool: dict, hashes: list[bytes], i: int, node: str) -> int:
    """Where ``node``'s run of held blocks that reaches block ``i`` ends (``pool`` maps a
    hash to its holder or holders)."""
    n = len(hashes)
    while i < n:
        holders = pool.get(hashes[i])
        if holders is not node and (
            holders is None or (holders != node if type(holders) is str else node not in holders)
        ):
            break
        i += 1
    return i


_log = logging.getLogger(__name__)


class CacheIndex:
    def __init__(self) -> None:
        # hash -> its holder's id (one holder) or a set of two or more ids
        self._pool: dict[bytes, str | set[str]] = {}
        # node -> the hashes it holds, as the keys of a dict (values None), not a set: a
        # dict of bytes and None is one the garbage collector does not track, so its full
        # collections never walk the 10^6 hashes (a set is always tracked and walked)
        self._by_node: dict[str, dict[bytes, None]] = {}
        self._names: dict[str, str] = {}  # one string object per node id
        self._store: dict[bytes, int] = {}  # hash -> replica count, any tier
        self._ssd: dict[bytes, int] = {}  # hash -> replicas on an SSD tier
        # compiled: the dicts' mirror that ``lookup`` reads (plain Python: None)
        self._table = _blocktable.new_table()

    # -- node pools ------------------------------------------------------------------------
    def stored(self, node: str, hashes: Iterable[bytes]) -> None:
        node = self._names.setdefault(node, str(node))
        mine = self._by_node.setdefault(node, {})
        pool, table = self._pool, self._table
        for h in hashes:
            holders = pool.get(h)
            if holders is None:
                pool[h] = holders = node
            elif isinstance(holders, str):
                if holders != node:
                    pool[h] = holders = {holders, node}
            else:
                holders.add(node)
            mine[h] = None
            if table is not None and _blocktable.set_holder(table, h, holders):
                self._drop_table()
                table = None

    def removed(self, node: str, hashes: Iterable[bytes]) -> None:
        mine = self._by_node.get(node)
        pool, table = self._pool, self._table
        for h in hashes:
            holders = pool.get(h)
            if holders is not None:
                if isinstance(holders, str):
                    if holders == node:
                        del pool[h]
                else:
                    holders.discard(node)
                    if len(holders) == 1:
                        pool[h] = next(iter(holders))
                if table is not None and _blocktable.set_holder(table, h, pool.get(h)):
                    self._drop_table()
                    table = None
            if mine is not None:
                mine.pop(h, None)

    def reset(self, node: str, hashes: Iterable[bytes]) -> None:
        """Replaces everything known about ``node`` with a full snapshot."""
        self.drop_node(node)
        self.stored(node, hashes)

    def drop_node(self, node: str) -> None:
        self.removed(node, list(self._by_node.pop(node, ())))
        self._names.pop(node, None)

    def holds(self, node: str) -> int:
        return len(self._by_node.get(node, ()))

    def holders(self, h: bytes) -> set[str]:
        """The nodes whose pool holds block ``h``."""
        holders = self._pool.get(h)
        if holders is None:
            return set()
        return {holders} if type(holders) is str else set(holders)

    # -- store -----------------------------------------------------------------------------
    def store_stored(self, hashes: Iterable[bytes], tier: str = "dram") -> None:
        table = self._table
        for h in hashes:
            self._store[h] = self._store.get(h, 0) + 1
            if tier == "ssd":
                self._ssd[h] = self._ssd.get(h, 0) + 1
            if table is not None and _blocktable.set_store(
                table, h, self._store[h], self._ssd.get(h, 0)
            ):
                self._drop_table()
                table = None

    def store_removed(self, hashes: Iterable[bytes], tier: str = "dram") -> None:
        kvt = self._table
        for h in hashes:
            for table in (self._store, self._ssd) if tier == "ssd" else (self._store,):
                n = table.get(h, 0) - 1
                if n > 0:
                    table[h] = n
                else:
                    table.pop(h, None)
            if kvt is not None and _blocktable.set_store(
                kvt, h, self._store.get(h, 0), self._ssd.get(h, 0)
            ):
                self._drop_table()
                kvt = None

    def store_reset(self, hashes: Iterable[bytes]) -> None:
        self._store, self._ssd = {}, {}
        if self._table is not None and _blocktable.clear_store(self._table):
            self._drop_table()
        self.store_stored(hashes)

    def _drop_table(self) -> None:
        """The table broke (a key that is not bytes, out of memory): it is dropped, which
        frees its memory and references, and the dicts answer from now on (said once:
        lookups are slower, not wrong)."""
        self._table = None
        _log.warning(
            "cache index: the compiled block table was dropped (a block key that is not "
            "bytes, or out of memory); lookups read the index's dicts from now on"
        )

    # -- queries ---------------------------------------------------------------------------
    def lookup(self, hashes: list[bytes]) -> Lookup:
        """The longest prefix of ``hashes`` each node holds (in ``per_node``, in the order
        of ``holders`` of the first block, the order candidates are tried in) and the
        longest prefix in the store (and in its DRAM)."""
        out = Lookup()
        if self._table is not None:  # compiled: the table (None: the dicts must answer)
            got = _blocktable.lookup(self._table, hashes, out.per_node)
            if got is not None:
                out.store_prefix, out.store_dram_prefix, many = got
                if many is not None:  # several hold the first block
                    self._lookup_many(self._pool, hashes, set(many), out.per_node)
                return out
        store, ssd = self._store, self._ssd
        _prefetch.prefetch(self._pool, hashes)  # (compiled: the misses overlap)
        _prefetch.prefetch(store, hashes)
        get = self._pool.get
        n = len(hashes)
        first = get(hashes[0]) if n else None
        if first is not None:
            per_node = out.per_node
            if type(first) is str:  # one holder: follow it alone
                per_node[first] = _run(self._pool, hashes, 1, first)
            else:
                self._lookup_many(self._pool, hashes, set(first), per_node)
        k = 0
        if not ssd:
            while k < n and hashes[k] in store:
                k += 1
            out.store_prefix = out.store_dram_prefix = k
            return out
        dram = 0
        for h, replicas in zip(hashes, map(store.get, hashes)):
            if replicas is None:
                break
            k += 1
            if dram == k - 1 and replicas > ssd.get(h, 0):
                dram = k
        out.store_prefix, out.store_dram_prefix = k, dram
        return out

    @staticmethod
    def _lookup_many(
        pool: dict, hashes: list[bytes], alive: set[str], per_node: dict[str, int]
    ) -> None:
        """``lookup`` when several nodes hold the first block: each keeps the length at
        which it drops out, and only steps where some node drops out cost more than a
        lookup; once one node is left it is followed alone."""
        for node in alive:
            per_node[node] = 1
        get = pool.get
        n = len(hashes)
        i = 1
        while i < n:
            holders = get(hashes[i])
            if holders is None:
                break
            if type(holders) is str:
                if holders not in alive:
                    break
                for node in alive:
                    if node != holders:
                        per_node[node] = i
                per_node[holders] = _run(pool, hashes, i, holders)
                return
            if not alive <= holders:
                gone = alive - holders
                for node in gone:
                    per_node[node] = i
                alive -= gone
                if not alive:
                    return
                if len(alive) == 1:
                    node = next(iter(alive))
                    per_node[node] = _run(pool, hashes, i, node)
                    return
            i += 1
        for node in alive:
            per_node[node] = i

    def __len__(self) -> int:
        return len(self._pool)
