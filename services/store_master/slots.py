"""Reserved slots, a mixin of :class:`~services.store_master.metadata.StoreMetadata`:
slots a writer holds before it names the keys that go into them. Local puts reserve
slots in the writer's own segment (its node copies the bytes in, then commits a key into
each); remote slots are held in one segment for a writer that lends no memory (it
writes the bytes over the transfer engine, then commits under the slots' token, before
``put_timeout_s`` passes). Nothing is visible until a commit; a commit of a key already
present leaves the slot the writer's.

The metadata's state (segments, blocks, pins, ``remote_slots``, settings) and the
placement calls of :mod:`kvmesh.services.store_master.policy` (``allocate``,
``over_high``, ``evict``) are what it works on; reclaiming remote slots past their
deadline is :meth:`StoreMetadata.reclaim_abandoned`'s.
"""

from __future__ import annotations

import secrets
from collections import OrderedDict
from collections.abc import Callable, Iterable
from typing import TYPE_CHECKING

from kvmesh.services.store_master import wire
from kvmesh.services.store_master.model import DRAM, Block, BlockState, Replica, Segment

# spare slots for a remote writer (PUT_RESERVE's spare, PUT_SLOTS' refill) come only
# from this share of the segment's free space at the time: a writer's pool never fills a
# segment to its eviction watermark, after which every data put would evict cached blocks
REMOTE_SPARE_SHARE = 0.125


class SlotReservations:
    """Reserved slots for local and remote writers; mixed into ``StoreMetadata``, whose
    state and calls (placement, eviction, ``emit``, ``reclaim_abandoned``) it uses."""

    segments: dict[str, Segment]
    blocks: OrderedDict[bytes, Block]
    pins: set[bytes]
    remote_slots: dict[tuple[str, int], tuple[float, int]]
    clock: Callable[[], float]
    put_timeout_s: float
    low: float
    _reclaim_at: float

    if TYPE_CHECKING:

        @property
        def used(self) -> int: ...

        @property
        def capacity(self) -> int: ...

        def emit(self, kind: str, blk: Block, rep: Replica) -> None: ...

        def reclaim_abandoned(self) -> int: ...

        def over_high(self, extra: int = 0) -> bool: ...

        def allocate(self, size: int, prefer_node: str = "") -> tuple[Segment, int] | None: ...

        def evict(
            self, target_used: int, only: Segment | None = None, now: float | None = None
        ) -> int: ...

    # -- local puts: reserved slots in the writer's own segment -----------------------------
    def local_segment(self, writer: str, region_id: int) -> Segment | None:
        return self.segments.get(f"{writer}/{region_id}")

    def reserve(
        self, writer: str, region_id: int, size: int, count: int, spare: int = 0
    ) -> list[int]:
        """Reserves slots of ``size`` bytes in the writer's own segment for local puts:
        ``count`` of them evicting LRU blocks if needed, then up to ``spare`` more only
        from free space below the high watermark. A reserved slot is the writer's until
        it commits a key into it (:meth:`commit_local`) or releases it; only its node
        writes there, so it needs no timeout (it goes with the segment)."""
        seg = self.local_segment(writer, region_id)
        if seg is None or size <= 0 or size > seg.size:
            return []
        return self._reserve_in(seg, size, count, spare)

    def _reserve_in(self, seg: Segment, size: int, count: int, spare: int) -> list[int]:
        out: list[int] = []
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

    # -- remote slots: reserved for a writer that lends no memory -------------------------
    def reserve_remote(
        self, writer: str, size: int, count: int, spare: int = 0
    ) -> tuple[Segment | None, list[int], int]:
        """Reserves slots of ``size`` bytes for a writer without a segment of its own,
        all in one segment placed as a put's would be (the writer's node first, else the
        most free): ``count`` of them evicting if needed, ``spare`` more only from free
        space. Each is the writer's until it commits a key into it
        (:meth:`commit_remote`) or ``put_timeout_s`` passes (then it is freed, as a put
        that never ended). Nothing is visible until a commit. -> (segment, offsets,
        token): a commit must present the token (random, 64-bit, never 0)."""
        self.reclaim_abandoned()
        if size <= 0 or count + spare <= 0:
            return None, [], 0
        got = self.allocate(size, prefer_node=writer)
        if got is None:
            return None, [], 0
        seg, off = got
        seg.reserved[off] = size
        offs = [off] + self._reserve_in(seg, size, max(0, count - 1), 0)
        spare = self._spare_cap(seg, size, spare)
        if spare:
            offs += self._reserve_in(seg, size, 0, spare)
        return seg, offs, self._hold_remote(seg, offs)

    @staticmethod
    def _spare_cap(seg: Segment, size: int, spare: int) -> int:
        """``spare`` cut to what ``REMOTE_SPARE_SHARE`` of ``seg``'s free space holds."""
        return min(spare, int((seg.size - seg.used) * REMOTE_SPARE_SHARE) // size)

    def _hold_remote(self, seg: Segment, offs: list[int]) -> int:
        """Holds ``offs`` of ``seg`` for ``put_timeout_s`` under a fresh token."""
        if not offs:
            return 0
        token = secrets.randbits(64) or 1
        deadline = self.clock() + self.put_timeout_s
        for off in offs:
            self.remote_slots[(seg.segment_id, off)] = (deadline, token)
        self._reclaim_at = min(self._reclaim_at, deadline)
        return token

    def commit_remote(
        self,
        node_id: str,
        region_id: int,
        items: Iterable[tuple[bytes, int, int, int]],
        refill: int = 0,
    ) -> tuple[list[int], int, list[int]]:
        """As :meth:`commit_local`, for (key, offset, size, token) slots that
        :meth:`reserve_remote` holds on segment ``node_id``/``region_id`` under that
        token (the writer has written the bytes over the transfer engine and its write
        was acknowledged): status per item 1 stored, 2 present (the slot stays the
        writer's), 0 no such slot held under that token (expired, perhaps reserved
        again for another writer; quarantined; a restarted master). Then reserves up to
        ``refill`` more slots there, from free space, of the items' size; -> (status,
        token of the new slots, new offsets)."""
        self.reclaim_abandoned()
        seg_id = f"{node_id}/{region_id}"
        seg = self.segments.get(seg_id)
        items = list(items)
        held = self.remote_slots
        ok = []
        for h, off, size, token in items:
            slot = held.get((seg_id, off))
            mine = seg is not None and slot is not None and slot[1] == token and token != 0
            ok.append((h, off if mine else -1, size))
        gens = [wire.slot_gen(token, off) for _, off, _, token in items]
        status = self._commit_in(seg, ok, gens) if seg is not None else [0] * len(ok)
        for (_, off, _), st in zip(ok, status):
            if st == 1:
                del held[(seg_id, off)]
        new: list[int] = []
        token = 0
        if seg is not None and refill > 0 and items:
            size = items[0][2]
            if 0 < size <= seg.size:
                new = self._reserve_in(seg, size, 0, self._spare_cap(seg, size, refill))
                token = self._hold_remote(seg, new)
        return status, token, new

    def release_remote(
        self, node_id: str, region_id: int, size: int, slots: Iterable[tuple[int, int]]
    ) -> int:
        """Frees (offset, token) slots of ``size`` that :meth:`reserve_remote` holds on
        segment ``node_id``/``region_id`` under that token (a writer gives back slots it
        will not write: its pool over budget, or it closes); others are ignored (expired,
        another writer's, a restarted master). -> how many were freed."""
        seg_id = f"{node_id}/{region_id}"
        seg = self.segments.get(seg_id)
        if seg is None:
            return 0
        n = 0
        for off, token in slots:
            held = self.remote_slots.get((seg_id, off))
            if held is None or held[1] != token or token == 0:
                continue
            if seg.reserved.get(off) != size:
                continue
            del self.remote_slots[(seg_id, off)]
            del seg.reserved[off]
            seg.release(off, size)
            n += 1
        return n

    def release_reserved(
        self, writer: str, region_id: int, slots: Iterable[tuple[int, int]]
    ) -> int:
        """Frees reserved (offset, size) slots; unknown ones are ignored (a restarted
        master never reserved them)."""
        seg = self.local_segment(writer, region_id)
        n = 0
        for off, size in slots:
            if seg is not None and (seg.segment_id, off) in self.remote_slots:
                continue  # a remote writer's, not the lender's
            if seg is not None and seg.reserved.get(off) == size:
                del seg.reserved[off]
                seg.release(off, size)
                n += 1
        return n

    def commit_local(
        self, writer: str, region_id: int, items: Iterable[tuple[bytes, int, int]]
    ) -> list[int]:
        """Publishes (key, offset, size) whose bytes the writer has already copied into
        its reserved slot at ``offset``: 1 stored (COMPLETE at once), 2 the key is
        present or being put (the slot stays reserved), 0 no such reserved slot (a slot
        held for a remote writer is not the lender's: 0 too)."""
        seg = self.local_segment(writer, region_id)
        if seg is None:
            return [0 for _ in items]
        remote = self.remote_slots
        if not remote:
            return self._commit_in(seg, items)
        sid = seg.segment_id
        return self._commit_in(
            seg, [(h, -1 if (sid, off) in remote else off, size) for h, off, size in items]
        )

    def _commit_in(
        self,
        seg: Segment,
        items: Iterable[tuple[bytes, int, int]],
        gens: list[int] | None = None,
    ) -> list[int]:
        """``gens``: each new replica's generation (a remote slot's, which its writer
        knows: :func:`~kvmesh.services.store_master.wire.slot_gen`); else a fresh one."""
        now = self.clock()
        out = []
        for j, (h, off, size) in enumerate(items):
            if seg.reserved.get(off) != size:
                out.append(0)
                continue
            if h in self.blocks:
                out.append(2)
                continue
            del seg.reserved[off]
            blk = Block(h, size, last_access=now, pinned=h in self.pins)
            rep = Replica(seg, off, DRAM, BlockState.COMPLETE)
            if gens is not None:
                rep.gen = gens[j]
            blk.replicas.append(rep)
            self.blocks[h] = blk
            self.emit("stored", blk, rep)
            out.append(1)
        return out
