"""Data model of the store metadata: the DRAM segments nodes lend (each with its
allocator and read load), blocks (one per key) and their replicas (segment, offset,
tier, state), and the :class:`Plan` a data-moving step is described by. Plain objects
with no policy: :class:`~services.store_master.metadata.StoreMetadata` owns them and
decides (with :mod:`kvmesh.services.store_master.policy`) where replicas go and when they
leave.
"""

from __future__ import annotations

import enum
import math
import random
from collections.abc import Callable
from dataclasses import dataclass, field

DRAM, SSD = "dram", "ssd"


class BlockState(enum.Enum):
    PENDING = 1
    COMPLETE = 2


class Segment:
    """DRAM a node lends to the store: a transfer-engine region on that node.

    Allocator: exact-size free lists (KV blocks all have one size, so reuse is exact and
    O(1)), a bump pointer, and splitting of a larger free slot as the last resort. Free
    slots are not coalesced (documented limit for mixed-size generic keys)."""

    def __init__(
        self,
        segment_id: str,
        node_id: str,
        data_address: str,
        region_id: int,
        size: int,
        grpc_address: str = "",
        ssd_bytes: int = 0,
    ) -> None:
        self.segment_id, self.node_id = segment_id, node_id
        self.data_address, self.region_id, self.size = data_address, region_id, size
        self.grpc_address, self.ssd_bytes = grpc_address, ssd_bytes
        self.used = 0
        self.bump = 0
        self.free_slots: dict[int, list[int]] = {}
        self.load = 0.0  # decayed count of reads served (replica choice)
        self.load_t = 0.0
        # slots its own node reserved for local puts: offset -> size (counted in used)
        self.reserved: dict[int, int] = {}

    def allocate(self, size: int) -> int | None:
        slots = self.free_slots.get(size)
        if slots:
            self.used += size
            return slots.pop()
        if self.bump + size <= self.size:
            off, self.bump = self.bump, self.bump + size
            self.used += size
            return off
        for big in sorted(s for s, lst in self.free_slots.items() if lst and s > size):
            off = self.free_slots[big].pop()
            self.free_slots.setdefault(big - size, []).append(off + size)
            self.used += size
            return off
        return None

    def release(self, offset: int, size: int) -> None:
        self.used -= size
        if offset + size == self.bump:
            self.bump = offset
        else:
            self.free_slots.setdefault(size, []).append(offset)

    def rebuild(self, extents: list[tuple[int, int]]) -> None:
        """Resets the allocator to exactly ``extents`` (offset, size) in use."""
        self.free_slots, self.used, pos = {}, 0, 0
        for off, size in sorted(extents):
            if off > pos:
                self.free_slots.setdefault(off - pos, []).append(pos)
            pos = max(pos, off + size)
            self.used += size
        self.bump = pos

    def fits(self, offset: int, size: int) -> bool:
        return 0 <= offset and offset + size <= self.size

    def touch_load(self, now: float, tau: float = 1.0) -> float:
        self.load = self.load * math.exp(-(now - self.load_t) / tau) + 1.0
        self.load_t = now
        return self.load

    @property
    def free_ratio(self) -> float:
        return 1.0 - self.used / self.size if self.size else 0.0


def new_gen() -> int:
    """A replica's generation: random, 64-bit, never 0 (not a secret: GET answers carry it)."""
    return random.getrandbits(64) or 1


@dataclass
class Replica:
    segment: Segment
    offset: int
    tier: str = DRAM
    state: BlockState = BlockState.PENDING
    put_deadline: float = 0.0
    kind: str = "put"  # put | replicate | promote
    # names this replica for its life (a GET answer carries it): a client that read the
    # bytes at (segment, offset) before the answer came uses them only if the answer names
    # the same replica, never one put later at the same place (remove + put again)
    gen: int = field(default_factory=new_gen)


@dataclass
class Block:
    hash: bytes
    size: int
    replicas: list[Replica] = field(default_factory=list)
    lease_until: float = 0.0
    last_access: float = 0.0
    heat: float = 0.0
    heat_t: float = 0.0
    pinned: bool = False

    def complete(self, tier: str | None = DRAM) -> list[Replica]:
        reps = self.replicas
        if len(reps) == 1:  # the common case, without a comprehension
            r = reps[0]
            return (
                [r] if r.state is BlockState.COMPLETE and (tier is None or r.tier == tier) else []
            )
        return [
            r for r in reps if r.state is BlockState.COMPLETE and (tier is None or r.tier == tier)
        ]

    @property
    def visible(self) -> bool:
        return any(r.state is BlockState.COMPLETE for r in self.replicas)

    @property
    def in_flight(self) -> bool:
        return any(r.state is BlockState.PENDING for r in self.replicas)

    # compatibility with the one-replica view (tests, callers)
    @property
    def state(self) -> BlockState:
        return BlockState.COMPLETE if self.visible else BlockState.PENDING

    @property
    def segment(self) -> Segment:
        return self.replicas[0].segment

    @property
    def offset(self) -> int:
        return self.replicas[0].offset


@dataclass
class Plan:
    """Data-moving work the servicer must carry out, then report back."""

    block: Block
    replica: Replica  # the replica being created (replicate/promote) or spilled
    source: Replica | None = None


EventSink = Callable[[str, Block, Replica], None]
