"""Replica movement policy of the store metadata, a mixin of
:class:`~services.store_master.metadata.StoreMetadata`: allocation under the DRAM
watermarks, eviction (and spilling to a node's SSD tier), promotion from SSD back to
DRAM, and hot-block replication. The ``plan_*`` calls reserve space and return the
:class:`~services.store_master.model.Plan` s the servicer carries out; ``finish_*``
record the outcome.

Eviction is LRU over an ordered dict (exact order, O(1) touch), run from the high
watermark down to the low one over DRAM bytes; it never touches a leased block or one
with a pending replica, and soft-pinned blocks go only after every unpinned one.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Callable, Iterable
from typing import TYPE_CHECKING

from kvmesh.services.store_master.model import DRAM, SSD, Block, BlockState, Plan, Replica, Segment


class ReplicaPolicy:
    """Where replicas go and when they leave; mixed into ``StoreMetadata``, whose state
    (segments, blocks, stats, settings) and bookkeeping (``used``, ``capacity``,
    ``drop_replica``, ``emit``) it uses."""

    segments: dict[str, Segment]
    blocks: OrderedDict[bytes, Block]
    stats: dict[str, int]
    clock: Callable[[], float]
    lease_s: float
    high: float
    low: float
    hot_reads: float
    max_replicas: int

    if TYPE_CHECKING:

        @property
        def used(self) -> int: ...

        @property
        def capacity(self) -> int: ...

        def drop_replica(self, blk: Block, rep: Replica, release: bool = True) -> None: ...

        def emit(self, kind: str, blk: Block, rep: Replica) -> None: ...

    # -- promotion and hot-block replication ---------------------------------------------
    def plan_promotions(self, blocks: Iterable[Block]) -> list[Plan]:
        """For each block with an SSD replica but no DRAM one, allocates DRAM on the same
        node (pending ``promote`` replica) for the node to read its file into."""
        plans = []
        now = self.clock()
        for blk in blocks:
            if blk.complete(DRAM) or any(r.kind == "promote" for r in blk.replicas):
                continue
            ssd = blk.complete(SSD)
            if not ssd:
                continue
            seg = ssd[0].segment
            off = seg.allocate(blk.size)
            if off is None:
                self.evict(target_used=self.used - blk.size, only=seg, now=now)
                off = seg.allocate(blk.size)
            if off is None:
                continue
            rep = Replica(seg, off, DRAM, BlockState.PENDING, put_deadline=now + 30, kind="promote")
            blk.replicas.append(rep)
            plans.append(Plan(blk, rep, ssd[0]))
        return plans

    def finish_plan(self, plan: Plan, ok: bool) -> None:
        """A promote/replicate copy finished (``ok``) or failed."""
        blk, rep = plan.block, plan.replica
        if self.blocks.get(blk.hash) is not blk or rep not in blk.replicas:
            return  # removed or its node left meanwhile
        if ok:
            rep.state = BlockState.COMPLETE
            self.stats["promotions" if rep.kind == "promote" else "replications"] += 1
            self.emit("stored", blk, rep)
        else:
            self.drop_replica(blk, rep)
            if rep.kind == "promote" and plan.source in blk.replicas:
                self.drop_replica(blk, plan.source)  # missing or corrupt file: a miss

    def plan_replications(self, blocks: Iterable[Block]) -> list[Plan]:
        """Hot blocks (decayed reads over ``hot_reads``) below ``max_replicas`` DRAM
        replicas get one more, on the most-free segment of a node that lacks one."""
        plans: list[Plan] = []
        now = self.clock()
        hot = [b for b in blocks if b.heat >= self.hot_reads]
        if not hot:
            return plans
        targets = sorted(
            (s for s in self.segments.values() if s.grpc_address), key=lambda s: -s.free_ratio
        )
        if not targets:
            return plans
        for blk in hot:
            if blk.in_flight:
                continue
            reps = blk.complete(DRAM)
            if not reps or len(reps) >= self.max_replicas:
                continue
            have = {r.segment.node_id for r in blk.replicas}
            cands = [s for s in targets if s.node_id not in have]
            if not cands:
                continue
            for seg in cands:
                if (seg.used + blk.size) / seg.size <= self.high:
                    off = seg.allocate(blk.size)
                    if off is None:
                        continue
                    rep = Replica(
                        seg, off, DRAM, BlockState.PENDING, put_deadline=now + 30, kind="replicate"
                    )
                    blk.replicas.append(rep)
                    blk.lease_until = max(blk.lease_until, now + self.lease_s)  # hold source
                    blk.heat = 0.0
                    plans.append(Plan(blk, rep, reps[0]))
                    break
        return plans

    # -- allocation and eviction ---------------------------------------------------------
    def over_high(self, extra: int = 0) -> bool:
        cap = self.capacity
        return bool(cap) and (self.used + extra) / cap > self.high

    def allocate(self, size: int, prefer_node: str = "") -> tuple[Segment, int] | None:
        """A DRAM slot of ``size`` bytes: (segment, offset) on ``prefer_node``'s segment
        if it has room, else on the segment with the highest free ratio. Evicts down to
        the low watermark first when the slot would cross the high one, and LRU blocks
        for ``size`` more bytes when nothing fits; None when still nothing does."""
        if self.over_high(size):
            self.evict(target_used=int(self.low * self.capacity))
        for attempt in range(2):
            # local-first, then the segment with the highest free ratio
            segs = sorted(
                self.segments.values(), key=lambda s: (s.node_id != prefer_node, -s.free_ratio)
            )
            for seg in segs:
                off = seg.allocate(size)
                if off is not None:
                    return seg, off
            if attempt == 0 and not self.evict(target_used=self.used - size):
                return None
        return None

    def evictable(self, blk: Block, now: float) -> bool:
        return blk.lease_until <= now and not blk.in_flight and bool(blk.complete(DRAM))

    def plan_eviction(self, target_used: int) -> list[Plan]:
        """Picks LRU victims (unpinned first) down to ``target_used`` DRAM bytes. A victim
        whose node has an SSD tier (and no SSD copy yet) becomes a spill plan: its DRAM
        replica stays, held by a lease, until :meth:`finish_spill`; the others are
        dropped now (or only lose their DRAM replica when an SSD copy exists)."""
        now = self.clock()
        plans: list[Plan] = []
        freed = 0
        need = self.used - target_used
        for pinned_pass in (False, True):
            if freed >= need:
                break
            for blk in list(self.blocks.values()):
                if freed >= need:
                    break
                if blk.pinned != pinned_pass or not self.evictable(blk, now):
                    continue
                dram = blk.complete(DRAM)
                has_ssd = bool(blk.complete(SSD))
                for rep in dram:
                    freed += blk.size
                    if rep.segment.ssd_bytes and not has_ssd:
                        blk.lease_until = now + 30  # held until the spill is done
                        plans.append(Plan(blk, rep))
                        has_ssd = True
                    else:
                        self.drop_replica(blk, rep)
                        self.stats["evictions"] += 1
        return plans

    def finish_spill(self, plan: Plan, ok: bool, dropped: Iterable[bytes] = ()) -> None:
        blk, rep = plan.block, plan.replica
        seg = rep.segment
        for h in dropped:  # the node deleted these SSD copies to stay within its disk
            b = self.blocks.get(h)
            if b is not None:
                for r in [r for r in b.replicas if r.segment is seg and r.tier == SSD]:
                    self.drop_replica(b, r)
        self.stats["evictions"] += 1
        if self.blocks.get(blk.hash) is not blk or rep not in blk.replicas:
            return
        blk.lease_until = 0.0
        if ok and seg.segment_id in self.segments:
            ssd = Replica(seg, 0, SSD, BlockState.COMPLETE)
            blk.replicas.append(ssd)
            self.stats["spills"] += 1
            self.emit("stored", blk, ssd)
        self.drop_replica(blk, rep)

    def evict(self, target_used: int, only: Segment | None = None, now: float | None = None) -> int:
        """Synchronous eviction (no spilling): drops LRU DRAM replicas, unpinned first,
        until ``used <= target_used``. Used under allocation pressure."""
        now = self.clock() if now is None else now
        n = 0
        for pinned_pass in (False, True):
            for blk in list(self.blocks.values()):
                if self.used <= target_used:
                    self.stats["evictions"] += n
                    return n
                if blk.pinned != pinned_pass or not self.evictable(blk, now):
                    continue
                for rep in blk.complete(DRAM):
                    if only is None or rep.segment is only:
                        self.drop_replica(blk, rep)
                        n += 1
        self.stats["evictions"] += n
        return n
