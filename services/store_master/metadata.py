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

Eviction is LRU over an ordered dict (exact order, O(1) touch), run from the high
watermark down to the low one over DRAM bytes; it never touches a leased block or one
with a pending replica, and soft-pinned blocks go only after every unpinned one.
"""

from __future__ import annotations

import enum
import math
import time
from collections import OrderedDict
from dataclasses import dataclass, field
from typing import Callable, Iterable

DRAM, SSD = "dram", "ssd"


class BlockState(enum.Enum):
    PENDING = 1
    COMPLETE = 2


class Segment:
    """DRAM a node lends to the store: a transfer-engine region on that node.

    Allocator: exact-size free lists (KV blocks all have one size, so reuse is exact and
    O(1)), a bump pointer, and splitting of a larger free slot as the last resort. Free
    slots are not coalesced (documented limit for mixed-size generic keys)."""

    def __init__(self, segment_id: str, node_id: str, data_address: str, region_id: int,
                 size: int, grpc_address: str = "", ssd_bytes: int = 0) -> None:
        self.segment_id, self.node_id = segment_id, node_id
        self.data_address, self.region_id, self.size = data_address, region_id, size
        self.grpc_address, self.ssd_bytes = grpc_address, ssd_bytes
        self.used = 0
        self.bump = 0
        self.free_slots: dict[int, list[int]] = {}
        self.load = 0.0          # decayed count of reads served (replica choice)
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


@dataclass
class Replica:
    segment: Segment
    offset: int
    tier: str = DRAM
    state: BlockState = BlockState.PENDING
    put_deadline: float = 0.0
    kind: str = "put"        # put | replicate | promote


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
        if len(reps) == 1:   # the common case, without a comprehension
            r = reps[0]
            return [r] if r.state is BlockState.COMPLETE and (tier is None or r.tier == tier) \
                else []
        return [r for r in reps if r.state is BlockState.COMPLETE
                and (tier is None or r.tier == tier)]

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
    replica: Replica          # the replica being created (replicate/promote) or spilled
    source: Replica | None = None


EventSink = Callable[[str, Block, Replica], None]


class StoreMetadata:
    """Placement, leases, pins, heat, tiers and eviction for the cluster KV store."""

    def __init__(self, lease_s: float = 10.0, put_timeout_s: float = 30.0,
                 high_watermark: float = 0.9, low_watermark: float = 0.8,
                 clock: Callable[[], float] = time.monotonic, hot_reads: float = 8.0,
                 hot_window_s: float = 2.0, max_replicas: int = 3,
                 on_event: EventSink | None = None) -> None:
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
        self.stats = {"evictions": 0, "spills": 0, "promotions": 0, "replications": 0,
                      "puts_reclaimed": 0}

    @property
    def evictions(self) -> int:
        return self.stats["evictions"]

    def _emit(self, kind: str, blk: Block, rep: Replica) -> None:
        if self.on_event is not None:
            self.on_event(kind, blk, rep)

    # -- segments ----------------------------------------------------------------------
    def mount(self, node_id: str, data_address: str, region_id: int, size: int,
              grpc_address: str = "", ssd_bytes: int = 0) -> Segment:
        seg_id = f"{node_id}/{region_id}"
        old = self.segments.get(seg_id)
        if old and old.data_address == data_address and old.size == size:
            old.grpc_address, old.ssd_bytes = grpc_address or old.grpc_address, ssd_bytes
            # the lender re-mounts only after forgetting its reserved slots (their puts
            # fail at commit): free them
            for off, sz in old.reserved.items():
                old.release(off, sz)
            old.reserved.clear()
            return old
        if old:
            self.unmount_segment(seg_id)
        seg = Segment(seg_id, node_id, data_address, region_id, size, grpc_address, ssd_bytes)
        self.segments[seg_id] = seg
        return seg

    def unmount_segment(self, seg_id: str) -> int:
        """Drops every replica on the segment at once; returns blocks that vanished."""
        seg = self.segments.pop(seg_id, None)
        if seg is None:
            return 0
        gone = 0
        for blk in list(self.blocks.values()):
            mine = [r for r in blk.replicas if r.segment is seg]
            if not mine:
                continue
            for r in mine:
                self._drop_replica(blk, r, release=False)
            if blk.hash not in self.blocks:
                gone += 1
        return gone

    def unmount_node(self, node_id: str) -> tuple[int, int]:
        segs = [s for s, seg in self.segments.items() if seg.node_id == node_id]
        return len(segs), sum(self.unmount_segment(s) for s in segs)

    def report(self, node_id: str, region_id: int, records: Iterable[tuple[bytes, int, int, str]]
               ) -> tuple[int, int]:
        """A node re-reports (hash, offset, size, tier) it holds on its mounted segment
        (after a store-master restart). Overlapping or out-of-range DRAM records are
        rejected; the segment allocator is rebuilt around what was accepted."""
        seg = self.segments.get(f"{node_id}/{region_id}")
        if seg is None:
            return 0, 0
        now = self.clock()
        ok = bad = 0
        taken: list[tuple[int, int]] = [(r.offset, b.size) for b in self.blocks.values()
                                        for r in b.replicas if r.segment is seg and r.tier == DRAM]
        taken += list(seg.reserved.items())   # a writer may be copying into these
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
            self._emit("stored", blk, rep)
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
        return {DRAM: (dram, self.capacity),
                SSD: (ssd, sum(s.ssd_bytes for s in self.segments.values()))}

    @property
    def used(self) -> int:
        return sum(s.used for s in self.segments.values())

    # -- puts --------------------------------------------------------------------------
    def put_start(self, writer: str, hashes: Iterable[bytes], size: int | list[int]
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
            seg_off = self._allocate(sz, prefer_node=writer)
            if seg_off is None:
                break  # the store is full of leased/pending blocks: put what fits
            seg, off = seg_off
            blk = Block(h, sz, last_access=now, pinned=h in self.pins)
            blk.replicas.append(Replica(seg, off, DRAM, BlockState.PENDING,
                                        put_deadline=now + self.put_timeout_s))
            self.blocks[h] = blk
            placed.append(blk)
        return placed, skipped

    def put_end(self, hashes: Iterable[bytes], abort: bool = False) -> int:
        return len(self.put_end_detail(hashes, abort)[0])

    def put_end_detail(self, hashes: Iterable[bytes], abort: bool = False
                       ) -> tuple[list[bytes], list[bytes]]:
        """(committed, failed) keys; failed = no pending put replica any more."""
        done, failed = [], []
        now = self.clock()
        for h in hashes:
            blk = self.blocks.get(h)
            rep = None if blk is None else next(
                (r for r in blk.replicas if r.state is BlockState.PENDING and r.kind == "put"),
                None)
            if rep is None:
                failed.append(h)
                continue
            if abort:
                self._drop_replica(blk, rep)
                failed.append(h)
            else:
                rep.state = BlockState.COMPLETE
                blk.last_access = now
                self.blocks.move_to_end(h)
                self._emit("stored", blk, rep)
                done.append(h)
        return done, failed

    # -- local puts: reserved slots in the writer's own segment -----------------------------
    def local_segment(self, writer: str, region_id: int) -> Segment | None:
        return self.segments.get(f"{writer}/{region_id}")

    def reserve(self, writer: str, region_id: int, size: int, count: int, spare: int = 0
                ) -> list[int]:
        """Reserves slots of ``size`` bytes in the writer's own segment for local puts:
        ``count`` of them evicting LRU blocks if needed, then up to ``spare`` more only
        from free space below the high watermark. A reserved slot is the writer's until
        it commits a key into it (:meth:`commit_local`) or releases it; only its node
        writes there, so it needs no timeout (it goes with the segment)."""
        seg = self.local_segment(writer, region_id)
        out: list[int] = []
        if seg is None or size <= 0 or size > seg.size:
            return out
        if count and self.over_high(size * count):
            self.evict(target_used=int(self.low * self.capacity))
        for i in range(count + spare):
            spare_one = i >= count
            if spare_one and self.over_high(size):
                break
            off = seg.allocate(size)
            if off is None and not spare_one:
                self.evict(target_used=self.used - size, only=seg)
                off = seg.allocate(size)
            if off is None:
                break
            seg.reserved[off] = size
            out.append(off)
        return out

    def release_reserved(self, writer: str, region_id: int,
                         slots: Iterable[tuple[int, int]]) -> int:
        """Frees reserved (offset, size) slots; unknown ones are ignored (a restarted
        master never reserved them)."""
        seg = self.local_segment(writer, region_id)
        n = 0
        for off, size in slots:
            if seg is not None and seg.reserved.get(off) == size:
                del seg.reserved[off]
                seg.release(off, size)
                n += 1
        return n

    def commit_local(self, writer: str, region_id: int,
                     items: Iterable[tuple[bytes, int, int]]) -> list[int]:
        """Publishes (key, offset, size) whose bytes the writer has already copied into
        its reserved slot at ``offset``: 1 stored (COMPLETE at once), 2 the key is
        present or being put (the slot stays reserved), 0 no such reserved slot."""
        seg = self.local_segment(writer, region_id)
        now = self.clock()
        out = []
        for h, off, size in items:
            if seg is None or seg.reserved.get(off) != size:
                out.append(0)
                continue
            if h in self.blocks:
                out.append(2)
                continue
            del seg.reserved[off]
            blk = Block(h, size, last_access=now, pinned=h in self.pins)
            rep = Replica(seg, off, DRAM, BlockState.COMPLETE)
            blk.replicas.append(rep)
            self.blocks[h] = blk
            self._emit("stored", blk, rep)
            out.append(1)
        return out

    def reclaim_abandoned(self) -> int:
        now = self.clock()
        stale = [(b, r) for b in self.blocks.values() for r in b.replicas
                 if r.state is BlockState.PENDING and r.kind == "put" and r.put_deadline < now]
        for b, r in stale:
            self._drop_replica(b, r)
        self.stats["puts_reclaimed"] += len(stale)
        return len(stale)

    # -- gets --------------------------------------------------------------------------
    def prefix(self, hashes: Iterable[bytes], tiers: tuple[str, ...] = (DRAM, SSD)
               ) -> list[Block]:
        """The longest run of keys each with a complete replica in one of ``tiers``."""
        out = []
        for h in hashes:
            blk = self.blocks.get(h)
            if blk is None or not any(r.state is BlockState.COMPLETE and r.tier in tiers
                                      for r in blk.replicas):
                break
            out.append(blk)
        return out

    def present(self, hashes: Iterable[bytes]) -> list[bool]:
        return [(b := self.blocks.get(h)) is not None and b.visible for h in hashes]

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
            rep = Replica(seg, off, DRAM, BlockState.PENDING, put_deadline=now + 30,
                          kind="promote")
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
            self._emit("stored", blk, rep)
        else:
            self._drop_replica(blk, rep)
            if rep.kind == "promote" and plan.source in blk.replicas:
                self._drop_replica(blk, plan.source)  # missing or corrupt file: a miss

    def get_replicas(self, hashes: Iterable[bytes], reader: str = "", any_order: bool = False
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
            if not reps:
                if any_order:
                    continue
                break
            if len(reps) == 1:
                rep = reps[0]
            else:
                own = [r for r in reps if r.segment.node_id == reader]
                rep = own[0] if own else min(reps, key=lambda r: r.segment.load * exp(
                    -(now - r.segment.load_t)))
            rep.segment.touch_load(now)
            if blk.lease_until < until:
                blk.lease_until = until
            blk.last_access = now
            blk.heat = blk.heat * exp(-(now - blk.heat_t) / window) + 1.0
            blk.heat_t = now
            blocks.move_to_end(h)
            out.append((blk, rep))
        return out, until

    def plan_replications(self, blocks: Iterable[Block]) -> list[Plan]:
        """Hot blocks (decayed reads over ``hot_reads``) below ``max_replicas`` DRAM
        replicas get one more, on the most-free segment of a node that lacks one."""
        plans: list[Plan] = []
        now = self.clock()
        hot = [b for b in blocks if b.heat >= self.hot_reads]
        if not hot:
            return plans
        targets = sorted((s for s in self.segments.values() if s.grpc_address),
                         key=lambda s: -s.free_ratio)
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
                    rep = Replica(seg, off, DRAM, BlockState.PENDING, put_deadline=now + 30,
                                  kind="replicate")
                    blk.replicas.append(rep)
                    blk.lease_until = max(blk.lease_until, now + self.lease_s)  # hold source
                    blk.heat = 0.0
                    plans.append(Plan(blk, rep, reps[0]))
                    break
        return plans

    def remove(self, hashes: Iterable[bytes]) -> int:
        n = 0
        for h in hashes:
            blk = self.blocks.get(h)
            if blk is not None and blk.visible and not blk.in_flight:
                for r in list(blk.replicas):
                    self._drop_replica(blk, r)
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

    # -- allocation and eviction ---------------------------------------------------------
    def over_high(self, extra: int = 0) -> bool:
        cap = self.capacity
        return bool(cap) and (self.used + extra) / cap > self.high

    def _allocate(self, size: int, prefer_node: str = "") -> tuple[Segment, int] | None:
        if self.over_high(size):
            self.evict(target_used=int(self.low * self.capacity))
        for attempt in range(2):
            # local-first, then the segment with the highest free ratio
            segs = sorted(self.segments.values(),
                          key=lambda s: (s.node_id != prefer_node, -s.free_ratio))
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
                        blk.lease_until = now + 30   # held until the spill is done
                        plans.append(Plan(blk, rep))
                        has_ssd = True
                    else:
                        self._drop_replica(blk, rep)
                        self.stats["evictions"] += 1
        return plans

    def finish_spill(self, plan: Plan, ok: bool, dropped: Iterable[bytes] = ()) -> None:
        blk, rep = plan.block, plan.replica
        seg = rep.segment
        for h in dropped:   # the node deleted these SSD copies to stay within its disk
            b = self.blocks.get(h)
            if b is not None:
                for r in [r for r in b.replicas if r.segment is seg and r.tier == SSD]:
                    self._drop_replica(b, r)
        self.stats["evictions"] += 1
        if self.blocks.get(blk.hash) is not blk or rep not in blk.replicas:
            return
        blk.lease_until = 0.0
        if ok and seg.segment_id in self.segments:
            ssd = Replica(seg, 0, SSD, BlockState.COMPLETE)
            blk.replicas.append(ssd)
            self.stats["spills"] += 1
            self._emit("stored", blk, ssd)
        self._drop_replica(blk, rep)

    def evict(self, target_used: int, only: Segment | None = None, now: float | None = None
              ) -> int:
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
                        self._drop_replica(blk, rep)
                        n += 1
        self.stats["evictions"] += n
        return n

    def _drop_replica(self, blk: Block, rep: Replica, release: bool = True) -> None:
        if rep not in blk.replicas:
            return
        blk.replicas.remove(rep)
        if rep.tier == DRAM and release:
            rep.segment.release(rep.offset, blk.size)
        if rep.state is BlockState.COMPLETE:
            self._emit("removed", blk, rep)
        if not blk.replicas and self.blocks.get(blk.hash) is blk:
            del self.blocks[blk.hash]
