"""Store metadata: for every key (a 16-byte block hash, or any 1..256-byte key), its
replicas (segment, offset, tier, state), read lease, last access, heat and soft pin.
Pure logic, no I/O and no awaits: the servicer wraps it and runs the data-moving steps
(spill, promote, replicate) that some of these calls plan.

A block's life: PutStart allocates one PENDING DRAM replica -> PutEnd makes it COMPLETE
(the block is now visible) -> it may gain replicas (hot-block replication: PENDING on
another node until that node has copied it; promotion from SSD) and lose them (eviction:
spilled to the owning node's SSD tier when it has one, else dropped) -> it is gone when
its last replica goes (Remove, eviction, its node's lease ends, a put that never ended is
reclaimed after ``put_timeout_s``).

The data model is in :mod:`kvmesh.services.store_master.model`, the replica movement
policy (allocation, eviction and spilling, promotion, hot-block replication) in
:mod:`kvmesh.services.store_master.policy` and the slots reserved for local and remote
writers in :mod:`kvmesh.services.store_master.slots`; this module re-exports the
model's names.
"""

from __future__ import annotations

import math
import time
from collections import OrderedDict
from collections.abc import Callable, Iterable

from kvmesh.services.store_master.model import (  # noqa: F401
    DRAM,
    SSD,
    Block,
    BlockState,
    EventSink,
    Plan,
    Replica,
    Segment,
)
from kvmesh.services.store_master.policy import ReplicaPolicy
from kvmesh.services.store_master.slots import SlotReservations


class StoreMetadata(SlotReservations, ReplicaPolicy):
    """Placement, leases, pins, heat, tiers and eviction for the cluster KV store."""

    def __init__(
        self,
        lease_s: float = 10.0,
        put_timeout_s: float = 30.0,
        high_watermark: float = 0.9,
        low_watermark: float = 0.8,
        clock: Callable[[], float] = time.monotonic,
        hot_reads: float = 8.0,
        hot_window_s: float = 2.0,
        max_replicas: int = 3,
        on_event: EventSink | None = None,
    ) -> None:
        self.lease_s = lease_s
        self.put_timeout_s = put_timeout_s
        self.high = high_watermark
        self.low = low_watermark
        self.clock = clock
        self.hot_reads = hot_reads
        self.hot_window_s = hot_window_s
        self.max_replicas = max_replicas
        self.on_event = on_event
        self.segments: dict[str, Segment] = {}
        self.blocks: OrderedDict[bytes, Block] = OrderedDict()  # LRU order: oldest first
        self.pins: set[bytes] = set()
        # no pending put can have run out before this (every put_start lowers it; a
        # scan sets it to the earliest deadline left): puts skip the O(blocks) scan
        self._reclaim_at = math.inf
        # slots reserved for writers that lend no memory (see :meth:`reserve_remote`):
        # (segment id, offset) -> (deadline, token); counted in ``Segment.reserved`` as
        # well. Token 0: quarantined (held till its deadline, never committed)
        self.remote_slots: dict[tuple[str, int], tuple[float, int]] = {}
        # remote slots of an unmounted segment, per (node, region, data address):
        # [(offset, size, deadline)]: a writer may still be writing there until then, so
        # a re-mount of that memory reserves them again (see :meth:`mount`)
        self.quarantine: dict[tuple[str, int, str], list[tuple[int, int, float]]] = {}
        self.stats = {
            "evictions": 0,
            "spills": 0,
            "promotions": 0,
            "replications": 0,
            "puts_reclaimed": 0,
        }

    @property
    def evictions(self) -> int:
        return self.stats["evictions"]

    def emit(self, kind: str, blk: Block, rep: Replica) -> None:
        """Tells ``on_event`` that ``rep`` of ``blk`` was ``"stored"`` or ``"removed"``."""
        if self.on_event is not None:
            self.on_event(kind, blk, rep)

    # -- segments ----------------------------------------------------------------------
    def mount(
        self,
        node_id: str,
        data_address: str,
        region_id: int,
        size: int,
        grpc_address: str = "",
        ssd_bytes: int = 0,
    ) -> Segment:
        seg_id = f"{node_id}/{region_id}"
        old = self.segments.get(seg_id)
        if old and old.data_address == data_address and old.size == size:
            old.grpc_address, old.ssd_bytes = grpc_address or old.grpc_address, ssd_bytes
            # the lender re-mounts only after forgetting its reserved slots (their puts
            # fail at commit): free them
            # (slots held for remote writers stay: they may be writing into them now;
            # they end with their deadline)
            for off, sz in list(old.reserved.items()):
                if (seg_id, off) not in self.remote_slots:
                    old.release(off, sz)
                    del old.reserved[off]
            return old
        if old:
            self.unmount_segment(seg_id)
        seg = Segment(seg_id, node_id, data_address, region_id, size, grpc_address, ssd_bytes)
        self.segments[seg_id] = seg
        self._requarantine(seg)
        return seg

    def _requarantine(self, seg: Segment) -> None:
        """Reserves again, in the freshly mounted ``seg``, the remote slots its memory
        (same node, region and data address) held when it was unmounted and whose
        deadline has not passed: a writer may still be writing into them, so no put is
        placed there before then; they are never committed (token 0) and are freed at
        their deadline as any remote slot."""
        held = self.quarantine.pop((seg.node_id, seg.region_id, seg.data_address), [])
        now = self.clock()
        for off, size, deadline in held:
            if deadline >= now and seg.fits(off, size) and off not in seg.reserved:
                seg.reserved[off] = size
                self.remote_slots[(seg.segment_id, off)] = (deadline, 0)
                self._reclaim_at = min(self._reclaim_at, deadline)
        if seg.reserved:
            seg.rebuild(list(seg.reserved.items()))

    def unmount_segment(self, seg_id: str) -> int:
        """Drops every replica on the segment at once; returns blocks that vanished."""
        seg = self.segments.pop(seg_id, None)
        if seg is None:
            return 0
        slots = [k for k in self.remote_slots if k[0] == seg_id]
        if slots:
            q = self.quarantine.setdefault((seg.node_id, seg.region_id, seg.data_address), [])
            for key in slots:
                deadline, _ = self.remote_slots.pop(key)
                if size := seg.reserved.get(key[1], 0):
                    q.append((key[1], size, deadline))
        gone = 0
        for blk in list(self.blocks.values()):
            mine = [r for r in blk.replicas if r.segment is seg]
            if not mine:
                continue
            for r in mine:
                self.drop_replica(blk, r, release=False)
            if blk.hash not in self.blocks:
                gone += 1
        return gone

    def unmount_node(self, node_id: str) -> tuple[int, int]:
        segs = [s for s, seg in self.segments.items() if seg.node_id == node_id]
        return len(segs), sum(self.unmount_segment(s) for s in segs)

    def report(
        self, node_id: str, region_id: int, records: Iterable[tuple[bytes, int, int, str]]
    ) -> tuple[int, int]:
        """A node re-reports (hash, offset, size, tier) it holds on its mounted segment
        (after a store-master restart). Overlapping or out-of-range DRAM records are
        rejected; the segment allocator is rebuilt around what was accepted."""
        seg = self.segments.get(f"{node_id}/{region_id}")
        if seg is None:
            return 0, 0
        now = self.clock()
        ok = bad = 0
        taken: list[tuple[int, int]] = [
            (r.offset, b.size)
            for b in self.blocks.values()
            for r in b.replicas
            if r.segment is seg and r.tier == DRAM
        ]
        taken += list(seg.reserved.items())  # a writer may be copying into these
        recs = sorted(records, key=lambda r: (r[3] != DRAM, r[1]))
        spans = sorted(taken)
        for h, off, size, tier in recs:
            if not 1 <= len(h) <= 256 or size <= 0:
                bad += 1
                continue
            blk = self.blocks.get(h)
            if blk is not None and blk.size != size:
                bad += 1
                continue
            if tier == DRAM:
                if not seg.fits(off, size) or any(o < off + size and off < o + s for o, s in spans):
                    bad += 1
                    continue
                spans.append((off, size))
            if blk is None:
                blk = self.blocks[h] = Block(h, size, last_access=now, pinned=h in self.pins)
            if any(r.segment is seg and r.tier == tier for r in blk.replicas):
                bad += 1
                continue
            rep = Replica(seg, off if tier == DRAM else 0, tier, BlockState.COMPLETE)
            blk.replicas.append(rep)
            self.emit("stored", blk, rep)
            ok += 1
        seg.rebuild(spans)
        return ok, bad

    @property
    def capacity(self) -> int:
        return sum(s.size for s in self.segments.values())

    def tier_counts(self) -> dict[str, tuple[int, int]]:
        """Per tier: (blocks with a complete replica there, capacity in bytes)."""
        dram = sum(1 for b in self.blocks.values() if b.complete(DRAM))
        ssd = sum(1 for b in self.blocks.values() if b.complete(SSD))
        return {
            DRAM: (dram, self.capacity),
            SSD: (ssd, sum(s.ssd_bytes for s in self.segments.values())),
        }

    @property
    def used(self) -> int:
        return sum(s.used for s in self.segments.values())

    # -- puts --------------------------------------------------------------------------
    def put_start(
        self, writer: str, hashes: Iterable[bytes], size: int | list[int]
    ) -> tuple[list[Block], list[bytes]]:
        """Allocates one PENDING DRAM replica for each absent key; returns (new blocks,
        skipped keys: present or being put). Stops at the first key that does not fit."""
        self.reclaim_abandoned()
        now = self.clock()
        placed: list[Block] = []
        skipped: list[bytes] = []
        hashes = list(hashes)
        sizes = size if isinstance(size, list) else [size] * len(hashes)
        for h, sz in zip(hashes, sizes):
            if h in self.blocks:
                skipped.append(h)
                continue
            seg_off = self.allocate(sz, prefer_node=writer)
            if seg_off is None:
                break  # the store is full of leased/pending blocks: put what fits
            seg, off = seg_off
            blk = Block(h, sz, last_access=now, pinned=h in self.pins)
            deadline = now + self.put_timeout_s
            self._reclaim_at = min(self._reclaim_at, deadline)
            blk.replicas.append(Replica(seg, off, DRAM, BlockState.PENDING, put_deadline=deadline))
            self.blocks[h] = blk
            placed.append(blk)
        return placed, skipped

    def put_end(self, hashes: Iterable[bytes], abort: bool = False) -> int:
        return len(self.put_end_detail(hashes, abort)[0])

    def put_end_detail(
        self, hashes: Iterable[bytes], abort: bool = False
    ) -> tuple[list[bytes], list[bytes]]:
        """(committed, failed) keys; failed = no pending put replica any more."""
        done, failed = [], []
        now = self.clock()
        for h in hashes:
            blk = self.blocks.get(h)
            rep = (
                None
                if blk is None
                else next(
                    (r for r in blk.replicas if r.state is BlockState.PENDING and r.kind == "put"),
                    None,
                )
            )
            if blk is None or rep is None:
                failed.append(h)
                continue
            if abort:
                self.drop_replica(blk, rep)
                failed.append(h)
            else:
                rep.state = BlockState.COMPLETE
                blk.last_access = now
                self.blocks.move_to_end(h)
                self.emit("stored", blk, rep)
                done.append(h)
        return done, failed

    def reclaim_abandoned(self) -> int:
        """Frees puts never ended and remote slots never committed by their deadline."""
        now = self.clock()
        if now <= self._reclaim_at:
            return 0  # no pending put's (or remote slot's) deadline has passed
        pending = [
            (b, r)
            for b in self.blocks.values()
            for r in b.replicas
            if r.state is BlockState.PENDING and r.kind == "put"
        ]
        stale = [(b, r) for b, r in pending if r.put_deadline < now]
        for key in [k for k, (d, _) in self.remote_slots.items() if d < now]:
            del self.remote_slots[key]
            seg = self.segments.get(key[0])
            size = seg.reserved.pop(key[1], None) if seg is not None else None
            if seg is not None and size is not None:
                seg.release(key[1], size)
        self._reclaim_at = min(
            min((r.put_deadline for _, r in pending if r.put_deadline >= now), default=math.inf),
            min((d for d, _ in self.remote_slots.values()), default=math.inf),
        )
        for qk, q in list(self.quarantine.items()):
            q[:] = [s for s in q if s[2] >= now]
            if not q:
                del self.quarantine[qk]
            else:
                self._reclaim_at = min(self._reclaim_at, min(s[2] for s in q))
        for b, r in stale:
            self.drop_replica(b, r)
        self.stats["puts_reclaimed"] += len(stale)
        return len(stale)

    # -- gets --------------------------------------------------------------------------
    def prefix(self, hashes: Iterable[bytes], tiers: tuple[str, ...] = (DRAM, SSD)) -> list[Block]:
        """The longest run of keys each with a complete replica in one of ``tiers``."""
        out = []
        for h in hashes:
            blk = self.blocks.get(h)
            if blk is None or not any(
                r.state is BlockState.COMPLETE and r.tier in tiers for r in blk.replicas
            ):
                break
            out.append(blk)
        return out

    def present(self, hashes: Iterable[bytes]) -> list[bool]:
        return [(b := self.blocks.get(h)) is not None and b.visible for h in hashes]

    def get_replicas(
        self, hashes: Iterable[bytes], reader: str = "", any_order: bool = False
    ) -> tuple[list[tuple[Block, Replica]], float]:
        """The longest prefix (or, ``any_order``, every key) with a complete DRAM
        replica, each leased until the returned time, with the replica the reader should
        use: its own node's if it has one, else the least-loaded one."""
        now = self.clock()
        until = now + self.lease_s
        out = []
        blocks = self.blocks
        exp = math.exp
        window = self.hot_window_s
        for h in hashes:
            blk = blocks.get(h)
            reps = blk.complete(DRAM) if blk is not None else ()
            if blk is None or not reps:
                if any_order:
                    continue
                break
            if len(reps) == 1:
                rep = reps[0]
            else:
                own = [r for r in reps if r.segment.node_id == reader]
                rep = (
                    own[0]
                    if own
                    else min(reps, key=lambda r: r.segment.load * exp(-(now - r.segment.load_t)))
                )
            rep.segment.touch_load(now)
            if blk.lease_until < until:
                blk.lease_until = until
            blk.last_access = now
            blk.heat = blk.heat * exp(-(now - blk.heat_t) / window) + 1.0
            blk.heat_t = now
            blocks.move_to_end(h)
            out.append((blk, rep))
        return out, until

    def remove(self, hashes: Iterable[bytes]) -> int:
        n = 0
        for h in hashes:
            blk = self.blocks.get(h)
            if blk is not None and blk.visible and not blk.in_flight:
                for r in list(blk.replicas):
                    self.drop_replica(blk, r)
                n += 1
        return n

    # -- pins --------------------------------------------------------------------------
    def pin(self, hashes: Iterable[bytes], on: bool = True) -> int:
        n = 0
        for h in hashes:
            if on:
                self.pins.add(h)
            else:
                self.pins.discard(h)
            blk = self.blocks.get(h)
            if blk is not None:
                blk.pinned = on
                n += 1
        return n

    # -- replica bookkeeping -------------------------------------------------------------
    def drop_replica(self, blk: Block, rep: Replica, release: bool = True) -> None:
        """Removes ``rep`` from ``blk`` (``release``: frees its DRAM slot, unless its
        segment is going away anyway), publishes the removal of a complete replica, and
        forgets the block with its last replica."""
        if rep not in blk.replicas:
            return
        blk.replicas.remove(rep)
        if rep.tier == DRAM and release:
            rep.segment.release(rep.offset, blk.size)
        if rep.state is BlockState.COMPLETE:
            self.emit("removed", blk, rep)
        if not blk.replicas and self.blocks.get(blk.hash) is blk:
            del self.blocks[blk.hash]
