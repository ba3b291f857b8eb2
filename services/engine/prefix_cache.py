"""Local prefix cache of KV blocks keyed by chained block hashes.

The cache maps a block hash to the pool block holding that block's KV. It knows
which cached blocks are currently referenced (the owning :class:`KVPool` tells
it through :meth:`PrefixCache.acquire` / :meth:`PrefixCache.release`) and
evicts unreferenced blocks least-recently-used first, preferring leaves: a
block is not evicted while an evictable cached child of it is still present
(tails of chains go before heads). A head whose child is still referenced is
evicted only as a last resort (its children then become chain roots).
"""

from __future__ import annotations

import heapq
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

BlockEvent = tuple[str, bytes]  # ("stored" | "removed", block_hash)


@dataclass
class _Entry:
    block_hash: bytes
    block_id: int
    token_ids: tuple[int, ...]
    parent: bytes | None
    children: set[bytes] = field(default_factory=set)
    tick: int = 0
    referenced: bool = True


class PrefixCache:
    """Hash -> block index with LRU, leaf-first eviction and block events.

    ``ref_blocks`` is called with the ids of matched blocks so the owner can
    increment their reference counts (the owner must then call
    :meth:`acquire` for blocks going from 0 to 1 reference). When it is None
    the cache marks hits as referenced itself. ``on_event`` receives
    ``("stored", hash)`` / ``("removed", hash)``; without it events are queued
    for :meth:`drain_events`.
    """

    def __init__(
        self,
        ref_blocks: Callable[[list[int]], None] | None = None,
        on_event: Callable[[BlockEvent], None] | None = None,
    ) -> None:
        self._ref_blocks = ref_blocks
        self._on_event = on_event
        self._events: list[BlockEvent] = []
        self._by_hash: dict[bytes, _Entry] = {}
        self._by_block: dict[int, _Entry] = {}
        self._unreferenced: set[int] = set()  # cached, refcount 0: all reclaimable
        self._heap: list[tuple[int, int]] = []  # (tick, block) candidates among leaves
        self._tick = 0

    # ------------------------------------------------------------------ queries
    def __len__(self) -> int:
        return len(self._by_hash)

    def hashes(self) -> list[bytes]:
        """Every cached block hash (a snapshot for a new event subscriber)."""
        return list(self._by_hash)

    def __contains__(self, block_hash: bytes) -> bool:
        return block_hash in self._by_hash

    @property
    def num_evictable(self) -> int:
        """Number of cached, unreferenced blocks (all can be evicted)."""
        return len(self._unreferenced)

    def is_cached(self, block_id: int) -> bool:
        """Whether ``block_id`` currently holds a cached prefix block."""
        return block_id in self._by_block

    def cached_as(self, block_id: int) -> tuple[bytes, tuple[int, ...]] | None:
        """The hash and token ids ``block_id`` is cached under (None if it is not)."""
        e = self._by_block.get(block_id)
        return None if e is None else (e.block_hash, e.token_ids)

    def block_for(self, block_hash: bytes) -> int | None:
        """Block id cached under ``block_hash`` (no reference taken, no LRU touch)."""
        e = self._by_hash.get(block_hash)
        return None if e is None else e.block_id

    # ---------------------------------------------------------------- mutation
    def insert(
        self,
        block_hash: bytes,
        block_id: int,
        token_ids: tuple[int, ...],
        parent_hash: bytes | None = None,
    ) -> bool:
        """Cache ``block_id`` (which the caller must hold a reference to) under ``block_hash``.

        ``parent_hash`` is the hash of the previous block of the chain, used to
        evict tails before heads. Returns False (and caches nothing) when the
        hash is already cached in another block.
        """
        existing = self._by_hash.get(block_hash)
        if existing is not None:
            return existing.block_id == block_id
        if block_id in self._by_block:
            raise ValueError(f"block {block_id} is already cached under another hash")
        parent = self._by_hash.get(parent_hash) if parent_hash is not None else None
        entry = _Entry(
            block_hash,
            block_id,
            tuple(int(t) for t in token_ids),
            parent.block_hash if parent else None,
            tick=self._next_tick(),
        )
        if parent is not None:
            parent.children.add(block_hash)
        self._by_hash[block_hash] = entry
        self._by_block[block_id] = entry
        self._emit(("stored", block_hash))
        return True

    def match(
        self, block_hashes: Sequence[bytes], token_ids_per_block: Sequence[Sequence[int]]
    ) -> list[int]:
        """Block ids of the longest cached prefix; takes one reference on each hit.

        A hash hit only counts if the cached block's token ids equal the
        request's tokens for that block (guards against hash collisions).
        """
        hits: list[int] = []
        for h, toks in zip(block_hashes, token_ids_per_block):
            e = self._by_hash.get(h)
            if e is None or e.token_ids != tuple(int(t) for t in toks):
                break
            e.tick = self._next_tick()
            hits.append(e.block_id)
        if hits:
            if self._ref_blocks is not None:
                self._ref_blocks(hits)
            else:
                for b in hits:
                    self.acquire(b)
        return hits

    def lookup(self, block_hashes: Sequence[bytes]) -> list[int]:
        """Block ids of the longest cached prefix named by ``block_hashes`` alone (no
        token check, no reference taken; the hits count as used for LRU). The caller
        checks the tokens before it reads the blocks (:meth:`match`)."""
        hits: list[int] = []
        for h in block_hashes:
            e = self._by_hash.get(h)
            if e is None:
                break
            e.tick = self._next_tick()
            hits.append(e.block_id)
        return hits

    def acquire(self, block_id: int) -> None:
        """Owner notification: ``block_id`` went from 0 to 1 reference."""
        e = self._by_block.get(block_id)
        if e is not None:
            e.referenced = True
            self._unreferenced.discard(block_id)

    def release(self, block_id: int) -> bool:
        """Owner notification: ``block_id`` dropped to 0 references.

        Returns True if the block stays cached (now evictable), False if it is
        not cached and the owner should return it to its free list.
        """
        e = self._by_block.get(block_id)
        if e is None:
            return False
        e.referenced = False
        e.tick = self._next_tick()
        self._unreferenced.add(block_id)
        self._push_if_leaf(e)
        return True

    def evict(self, n: int) -> list[int]:
        """Evict up to ``n`` unreferenced blocks (LRU leaves first); return their ids."""
        out: list[int] = []
        while len(out) < n and self._unreferenced:
            if self._heap:
                tick, block_id = heapq.heappop(self._heap)
                e = self._by_block.get(block_id)
                if e is None or e.referenced or e.children or e.tick != tick:
                    continue  # stale heap entry
            else:  # only heads of referenced tails remain: evict the LRU one
                e = min((self._by_block[b] for b in self._unreferenced), key=lambda x: x.tick)
            self._remove(e)
            out.append(e.block_id)
        return out

    def drain_events(self) -> list[BlockEvent]:
        """Return and clear the queued block events."""
        events, self._events = self._events, []
        return events

    # ----------------------------------------------------------------- helpers
    def _next_tick(self) -> int:
        self._tick += 1
        return self._tick

    def _push_if_leaf(self, e: _Entry) -> None:
        if not e.referenced and not e.children:
            heapq.heappush(self._heap, (e.tick, e.block_id))

    def _remove(self, e: _Entry) -> None:
        del self._by_hash[e.block_hash]
        del self._by_block[e.block_id]
        self._unreferenced.discard(e.block_id)
        for child in e.children:
            self._by_hash[child].parent = None
        if e.parent is not None:
            parent = self._by_hash[e.parent]
            parent.children.discard(e.block_hash)
            self._push_if_leaf(parent)
        self._emit(("removed", e.block_hash))

    def _emit(self, event: BlockEvent) -> None:
        if self._on_event is not None:
            self._on_event(event)
        else:
            self._events.append(event)
