"""The remote put through the pool of held slots (:mod:`~kvmesh.services.store.remote_pool`
has the rules), as a part of :class:`~kvmesh.services.store.client.StoreClient`: taking
slots (one ``PUT_RESERVE`` per size in flight), the write into them, the ``PUT_SLOTS``
commit and its refill, and ``PUT_RELEASE`` of the slots the client will not write."""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Awaitable, Callable, Sequence
from typing import Any

from kvmesh.rdma import Slice
from kvmesh.services.store.batching import gather_results, per_key
from kvmesh.services.store.copy import copy_into
from kvmesh.services.store.fastconn import FastConn
from kvmesh.services.store.located import Locations
from kvmesh.services.store.remote_pool import (
    REMOTE_SLOT_MAX,
    REMOTE_SLOT_USE,
    RemotePool,
    RemoteSlot,
    write_time,
)
from kvmesh.services.store_master import wire

log = logging.getLogger(__name__)


class RemotePuts:
    """The pooled remote put of a store client (a mixin: the client supplies its fast
    connection, its calls to the master, its staging buffer and the PUT_START/PUT_END
    path that a key not committed through a slot takes)."""

    # supplied by the client
    _rslots: RemotePool
    _fast: FastConn | None
    _fast_addr: str
    segment: Any  # the SegmentHost it lends, if any (no pooled puts then)
    node_id: str
    rpc_timeout: float
    master_address: Callable[[], str | None]
    _conn: Callable[[], Awaitable[FastConn | None]]
    _call_on: Callable[..., Awaitable[bytes | None | bool]]
    _traced: Callable[[str, Awaitable[bytes | None | bool]], Awaitable[bytes | None | bool]]
    _write: Callable[[str, list[Slice]], Awaitable[bool]]
    _put_placed: Callable[..., Awaitable[list[bool]]]
    _where: Locations

    @property
    def _staging_view(self) -> memoryview:  # the client's staging buffer
        raise NotImplementedError

    async def _give_back_pool(self) -> None:
        """Gives the pooled remote slots back to the master (they would stay reserved
        until their deadline; popped ones are being written: never given back)."""
        rp, conn = self._rslots, self._fast
        held = [(z, s) for z, pool in rp.slots.items() for s in pool]
        rp.slots.clear()
        if not held or conn is None or conn.closed or rp.conn is not conn:
            return
        try:
            async with asyncio.timeout(min(1.0, self.rpc_timeout)):
                await self._release_slots(conn, held)
        except TimeoutError:
            log.debug("store: pooled slots not given back in time (freed at their deadline)")

    async def _put_pooled(
        self,
        keys: list[bytes],
        sizes: Sequence[int],
        region_id: int | Sequence[int],
        offsets: Sequence[int] | None = None,
        values: Sequence[memoryview] | None = None,
    ) -> list[bool] | None:
        """A put of values of one size by a client that lends no memory (see the module
        :mod:`~kvmesh.services.store.remote_pool`'s rules). None when the pool does not
        apply (the caller puts with PUT_START/PUT_END); a key whose slot is not committed
        for any reason (a failed write too) is put that way here."""
        size, n = sizes[0], len(keys)
        if size > REMOTE_SLOT_MAX or self.segment is not None:
            return None
        rp = self._rslots
        conn = self._fast
        if conn is None or conn.closed or self._fast_addr != self.master_address():
            conn = await self._conn()
        if (
            conn is None
            or conn.closed
            or self._fast_addr != self.master_address()
            or any(z != size for z in sizes)
            or n > rp.max_slots
            or n * size > rp.max_bytes
        ):
            return None
        slots = await self._take_slots(conn, size, n)
        if slots is None:
            return None
        busy = n  # popped by _take_slots, counted against the budget until resolved
        try:
            by_peer: dict[str, list[int]] = {}
            regs = per_key(region_id, n)
            pos = 0
            src: list[int] = []
            for i, s in enumerate(slots):
                if values is not None:
                    copy_into(self._staging_view[pos : pos + size], values[i])
                    src.append(pos)
                    pos += size
                elif offsets is not None:
                    src.append(offsets[i])
                by_peer.setdefault(s[1], []).append(i)
            peers = list(by_peer)
            writes = [
                self._write_by(
                    p,
                    [Slice(regs[i], src[i], slots[i][2], slots[i][4], size) for i in by_peer[p]],
                    min(slots[i][0] for i in by_peer[p]),
                )
                for p in peers
            ]
            oks = await gather_results(writes)
            # None: put again through PUT_START/PUT_END (a failed write, one not
            # acknowledged in time, not committed); True: stored or present
            out: list[bool | None] = [None] * n
            # commit per segment (one, usually): only keys whose write was acknowledged in time
            by_seg: dict[tuple[str, int], list[int]] = {}
            dead: list[tuple[int, RemoteSlot]] = []
            for p, ok in zip(peers, oks):
                if ok:
                    for i in by_peer[p]:
                        by_seg.setdefault((slots[i][3], slots[i][2]), []).append(i)
                    continue
                if rp.conn is conn:  # failed (died?) or not acknowledged in time (hung?):
                    # none of the holder's slots (never written: given back), so that the
                    # next put does not wait on it again
                    dead += [(z, s) for z, pool in rp.slots.items() for s in pool if s[1] == p]
                    rp.drop_peer(p)
                rp.add_busy(size, -len(by_peer[p]))  # resolved: dropped (never committed)
                busy -= len(by_peer[p])
            if dead:
                await self._release_slots(conn, dead)
            for (node, region), idx in by_seg.items():
                rp.add_busy(size, -len(idx))  # resolved by this commit
                busy -= len(idx)
                want = rp.spare(size, n) if rp.conn is conn else 0
                refill = want if want > rp.want(size, n) // 2 else 0
                rp.add_busy(size, refill)  # asked for: counted while the call is out
                sent = time.monotonic()
                try:
                    body = await self._traced(
                        "PutSlots",
                        self._call_on(
                            conn,
                            wire.PUT_SLOTS,
                            wire.pack_put_slots(
                                node,
                                region,
                                [keys[i] for i in idx],
                                size,
                                [slots[i][4] for i in idx],
                                [slots[i][5] for i in idx],
                                refill,
                            ),
                        ),
                    )
                finally:
                    rp.add_busy(size, -refill)
                if not body:  # not committed (or not known to be): put again
                    continue
                status, token, new = wire.unpack_put_slots_resp(body, len(idx))
                back: list[RemoteSlot] = []
                for i, st in zip(idx, status):
                    out[i] = True if st in (1, 2) else None
                    if st == 1:  # where it is, for a get that reads it ahead (located.py)
                        _, addr, reg, _, off, tok = slots[i]
                        self._where.note(keys[i], (addr, reg, off, size, wire.slot_gen(tok, off)))
                    elif st == 2:
                        back.append(slots[i])  # the key was present: the slot is still ours
                use_by = sent + rp.use_s  # held as long as the first ones
                back += [(use_by, slots[idx[0]][1], region, node, o, token) for o in new]
                await self._pool_add(conn, size, back)
        finally:
            rp.add_busy(size, -busy)
        retry = [i for i in range(n) if out[i] is None]
        if retry:  # slots not committed (failed, expired, another master): the usual path
            sub = await self._put_placed(
                [keys[i] for i in retry],
                [size] * len(retry),
                region_id if isinstance(region_id, int) else [regs[i] for i in retry],
                offsets=[src[i] for i in retry] if values is None else None,
                values=[values[i] for i in retry] if values is not None else None,
            )
            for i, v in zip(retry, sub):
                out[i] = v
        return [bool(v) for v in out]

    async def _take_slots(self, conn: FastConn, size: int, n: int) -> list[RemoteSlot] | None:
        """``n`` pooled slots of ``size`` with time left for the write (counted as busy),
        reserving them when the pool lacks them (one PUT_RESERVE per size in flight: a
        put that finds one awaits it and takes from what it brought); when the budget
        has no room, the slots of other sizes that are idle or out of time are given
        back first (oldest first, only as many as the put needs). None when it still has
        no room, the master gave none or the client is closing."""
        rp = self._rslots
        need = write_time(size)
        for _ in range(6):
            if rp.closing or conn.closed or conn is not self._fast:
                return None
            pool = rp.of(size, conn)
            late: list[RemoteSlot] = []
            slots = rp.take(pool, n, time.monotonic(), need, late)
            if slots is not None:
                rp.add_busy(size, n)  # popped: counted against the budget until resolved
            if late:  # never written: the master may have them back now
                try:
                    await self._release_slots(conn, [(size, s) for s in late])
                except BaseException:
                    if slots is not None:
                        rp.add_busy(size, -n)
                    raise
            if slots is not None:
                return slots
            fut = rp.reserving.get(size)
            if fut is not None:
                await asyncio.shield(fut)
                continue
            count = n - len(pool)
            room = rp.room(size)
            if count > room:
                # other sizes' idle or expired slots may hold the budget: give them back
                freed = rp.make_room(size, count, time.monotonic())
                if not freed:
                    return None
                await self._release_slots(conn, freed)
                continue  # look again: other puts may have run meanwhile
            if not await self._reserve(conn, size, count, max(0, rp.spare(size, n) - count)):
                return None
        return None

    async def _reserve(self, conn: FastConn, size: int, count: int, spare: int) -> bool:
        """One PUT_RESERVE of ``count`` slots of ``size`` and up to ``spare`` more into
        the pool (the slots asked for count against the budget while it is out)."""
        rp = self._rslots
        fut = rp.reserving[size] = asyncio.get_running_loop().create_future()
        rp.add_busy(size, count + spare)
        asked = count + spare
        try:
            sent = time.monotonic()
            body = await self._traced(
                "PutReserve",
                self._call_on(
                    conn, wire.PUT_RESERVE, wire.pack_put_reserve(self.node_id, size, count, spare)
                ),
            )
            if not body:  # None (failed, the connection changed) or False (an older master)
                return False
            ttl_ms, region, addr, node, token, offs = wire.unpack_put_reserve_resp(body)
            rp.use_s = ttl_ms / 1000 * REMOTE_SLOT_USE
            use_by = sent + rp.use_s
            rp.add_busy(size, -asked)
            asked = 0
            await self._pool_add(conn, size, [(use_by, addr, region, node, o, token) for o in offs])
            return bool(offs)
        finally:
            rp.add_busy(size, -asked)
            if rp.reserving.get(size) is fut:
                del rp.reserving[size]
            fut.set_result(None)

    async def _pool_add(self, conn: FastConn, size: int, slots: list[RemoteSlot]) -> None:
        """Puts ``slots`` (of ``size``, reserved on ``conn``) into the pool, and gives
        back what is beyond its budget, or all of them once the client is closing (none
        when the connection changed meanwhile: the master that reserved them frees them
        itself)."""
        rp = self._rslots
        if not slots or conn.closed or conn is not self._fast:
            return
        if rp.closing:  # close() has given the pool back already: these too
            await self._release_slots(conn, [(size, s) for s in slots])
            return
        rp.of(size, conn).extend(slots)
        extra = rp.trim(size)
        if extra:
            await self._release_slots(conn, [(size, s) for s in extra])

    async def _release_slots(self, conn: FastConn, slots: list[tuple[int, RemoteSlot]]) -> None:
        """Gives back (size, slot) pairs this client will not write (PUT_RELEASE on the
        connection that reserved them; best effort: the master frees them at their
        deadline anyway)."""
        groups: dict[tuple[str, int, int], list[tuple[int, int]]] = {}
        for size, s in slots:
            groups.setdefault((s[3], s[2], size), []).append((s[4], s[5]))
        for (node, region, size), items in groups.items():
            body = wire.pack_put_release(node, region, size, items)
            await self._call_on(conn, wire.PUT_RELEASE, body, check=False)

    async def _write_by(self, peer: str, slices: list[Slice], use_by: float) -> bool | None:
        """The write into held slots, awaited until ``use_by``: True acknowledged in time,
        False failed, None not acknowledged by then (not to be committed: its slot may be
        another writer's once the master's hold ends)."""
        left = use_by - time.monotonic()
        if left <= 0:
            return None
        try:
            async with asyncio.timeout(left):
                ok = await self._write(peer, slices)
        except TimeoutError:
            return None
        if ok and time.monotonic() > use_by:
            return None
        return ok
