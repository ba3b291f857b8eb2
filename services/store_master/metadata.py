"""Store metadata: which block lives in which segment at which offset, with its state,
read lease and last access. Pure logic, no I/O: the servicer wraps it.

A block's life: PENDING (PutStart allocated space; the writer is moving bytes) ->
COMPLETE (PutEnd; readable) -> gone (Remove, eviction, its segment unmounted, or a put
that never ended is reclaimed after ``put_timeout_s``). Eviction is approximate LRU from
the high watermark down to the low one and never touches a leased or pending block.
"""

from __future__ import annotations

import bisect
import enum
import time
from dataclasses import dataclass, field
from typing import Callable, Iterable


class BlockState(enum.Enum):
    PENDING = 1
    COMPLETE = 2


@dataclass
class Segment:
    """DRAM a node lends to the store: a transfer-engine region on that node."""

    segment_id: str
    node_id: str
    data_address: str
    region_id: int
    size: int
    used: int = 0
    free_slots: dict[int, list[int]] = field(default_factory=dict)  # size -> offsets
    bump: int = 0

    def allocate(self, size: int) -> int | None:
        slots = self.free_slots.get(size)
        if slots:
            self.used += size
            return slots.pop()
        if self.bump + size <= self.size:
            off, self.bump = self.bump, self.bump + size
            self.used += size
            return off
        return None

    def release(self, offset: int, size: int) -> None:
        self.used -= size
        if offset + size == self.bump:
            self.bump = offset
        else:
            bisect.insort(self.free_slots.setdefault(size, []), offset)

    @property
    def free_ratio(self) -> float:
        return 1.0 - self.used / self.size if self.size else 0.0


@dataclass
class Block:
    hash: bytes
    segment: Segment
    offset: int
    size: int
    state: BlockState
    lease_until: float = 0.0
    last_access: float = 0.0
    put_deadline: float = 0.0


class StoreMetadata:
    """Placement, leases and eviction for the cluster KV store."""

    def __init__(self, lease_s: float = 10.0, put_timeout_s: float = 30.0,
                 high_watermark: float = 0.9, low_watermark: float = 0.8,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self.lease_s = lease_s
        self.put_timeout_s = put_timeout_s
        self.high = high_watermark
        self.low = low_watermark
        self.clock = clock
        self.segments: dict[str, Segment] = {}
        self.blocks: dict[bytes, Block] = {}
        self.evictions = 0

    # -- segments ----------------------------------------------------------------------
    def mount(self, node_id: str, data_address: str, region_id: int, size: int) -> Segment:
        seg_id = f"{node_id}/{region_id}"
        old = self.segments.get(seg_id)
        if old and old.data_address == data_address and old.size == size:
            return old
        if old:
            self.unmount_segment(seg_id)
        seg = Segment(seg_id, node_id, data_address, region_id, size)
        self.segments[seg_id] = seg
        return seg

    def unmount_segment(self, seg_id: str) -> int:
        seg = self.segments.pop(seg_id, None)
        if seg is None:
            return 0
        gone = [h for h, b in self.blocks.items() if b.segment is seg]
        for h in gone:
            del self.blocks[h]
        return len(gone)

    def unmount_node(self, node_id: str) -> tuple[int, int]:
        segs = [s for s, seg in self.segments.items() if seg.node_id == node_id]
        return len(segs), sum(self.unmount_segment(s) for s in segs)

    @property
    def capacity(self) -> int:
        return sum(s.size for s in self.segments.values())

    @property
    def used(self) -> int:
        return sum(s.used for s in self.segments.values())

    # -- puts --------------------------------------------------------------------------
    def put_start(self, writer: str, hashes: Iterable[bytes], size: int
                  ) -> tuple[list[Block], list[bytes]]:
        """Allocates space for each absent hash; returns (new blocks, skipped hashes)."""
        self.reclaim_abandoned()
        now = self.clock()
        placed: list[Block] = []
        skipped: list[bytes] = []
        for h in hashes:
            if h in self.blocks:
                skipped.append(h)
                continue
            seg_off = self._allocate(writer, size)
            if seg_off is None:
                break  # the store is full of leased/pending blocks: put what fits
            seg, off = seg_off
            blk = Block(h, seg, off, size, BlockState.PENDING, last_access=now,
                        put_deadline=now + self.put_timeout_s)
            self.blocks[h] = blk
            placed.append(blk)
        return placed, skipped

    def put_end(self, hashes: Iterable[bytes], abort: bool = False) -> int:
        n = 0
        for h in hashes:
            blk = self.blocks.get(h)
            if blk is None or blk.state is not BlockState.PENDING:
                continue
            if abort:
                self._drop(blk)
            else:
                blk.state = BlockState.COMPLETE
                blk.last_access = self.clock()
                n += 1
        return n

    def reclaim_abandoned(self) -> int:
        now = self.clock()
        stale = [b for b in self.blocks.values()
                 if b.state is BlockState.PENDING and b.put_deadline < now]
        for b in stale:
            self._drop(b)
        return len(stale)

    # -- gets --------------------------------------------------------------------------
    def prefix(self, hashes: Iterable[bytes]) -> list[Block]:
        out = []
        for h in hashes:
            blk = self.blocks.get(h)
            if blk is None or blk.state is not BlockState.COMPLETE:
                break
            out.append(blk)
        return out

    def get_replicas(self, hashes: Iterable[bytes]) -> tuple[list[Block], float]:
        """The longest complete prefix, each block leased until the returned time."""
        now = self.clock()
        blocks = self.prefix(hashes)
        until = now + self.lease_s
        for b in blocks:
            b.lease_until = max(b.lease_until, until)
            b.last_access = now
        return blocks, until

    def remove(self, hashes: Iterable[bytes]) -> int:
        n = 0
        for h in hashes:
            blk = self.blocks.get(h)
            if blk is not None and blk.state is BlockState.COMPLETE:
                self._drop(blk)
                n += 1
        return n

    # -- allocation and eviction ---------------------------------------------------------
    def _allocate(self, writer: str, size: int) -> tuple[Segment, int] | None:
        if self.capacity and (self.used + size) / self.capacity > self.high:
            self.evict(target_used=int(self.low * self.capacity))
        for attempt in range(2):
            # local-first, then the segment with the most free space
            segs = sorted(self.segments.values(),
                          key=lambda s: (s.node_id != writer, -s.free_ratio))
            for seg in segs:
                off = seg.allocate(size)
                if off is not None:
                    return seg, off
            if attempt == 0 and not self.evict(target_used=self.used - size):
                return None
        return None

    def evict(self, target_used: int) -> int:
        """Drops least-recently-used evictable blocks until ``used <= target_used``."""
        now = self.clock()
        victims = sorted((b for b in self.blocks.values()
                          if b.state is BlockState.COMPLETE and b.lease_until <= now),
                         key=lambda b: b.last_access)
        n = 0
        for b in victims:
            if self.used <= target_used:
                break
            self._drop(b)
            n += 1
        self.evictions += n
        return n

    def _drop(self, blk: Block) -> None:
        if self.blocks.get(blk.hash) is blk:
            del self.blocks[blk.hash]
            blk.segment.release(blk.offset, blk.size)
