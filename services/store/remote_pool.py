"""The pool of remote slots of a :class:`~kvmesh.services.store.client.StoreClient` that
lends no memory: a small put (<= ``REMOTE_SLOT_MAX``) is one transfer-engine write into a
slot the client holds in a remote segment, then ONE ``PUT_SLOTS`` commit that also refills
the pool (``PUT_RESERVE`` fills it), instead of PUT_START -> write -> PUT_END.

Rules that keep a key pointing at its own bytes:
  * every reservation (``PUT_RESERVE``, a refill) carries a random 64-bit token, and a
    commit presents it: a slot that expired on the master and went to another writer is
    never committed by the first one (status 0, put again through PUT_START/PUT_END);
  * a slot is used only within ``REMOTE_SLOT_USE`` of the master's hold on it, counted
    from when the reserving call was sent; every popped slot is checked, a write is
    awaited only until the earliest use-by time of its slots, and a write acknowledged
    after it is not committed (put again): the rest of the hold is the margin in which
    the commit reaches the master;
  * slots belong to the fast connection they were reserved on, and so does their commit:
    it is sent on that connection only, never on a new one (a new one may be a restarted
    or failed-over master that never reserved them); if it changed or closed the keys
    are put again;
  * a slot this client drops (expired, a failed or late write, a changed connection)
    stays reserved on the master until its deadline and is freed there; that memory is
    not usable meanwhile (bounded by the pool's budget per connection).

The pool holds at most ``remote_pool_slots`` slots of one size and ``remote_pool_bytes``
across all sizes; a put that does not fit the budget left takes the usual path.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Sequence
from typing import TYPE_CHECKING

from kvmesh.rdma import Slice
from kvmesh.services.store.copy import copy_into
from kvmesh.services.store.fastconn import FastConn
from kvmesh.services.store_master import wire

if TYPE_CHECKING:
    from kvmesh.services.store.client import StoreClient

# a client that lends no memory puts a value up to this size through the pool
REMOTE_SLOT_MAX = 1 << 20
# a remote slot is used only within this share of the master's hold on it (the rest is
# the margin for the commit; the hold counts from when the request was sent)
REMOTE_SLOT_USE = 0.5

# (use by, data address, region, node, offset, token)
RemoteSlot = tuple[float, str, int, str, int, int]


class RemotePool:
    """Slots held in remote segments, per size, for one fast connection."""

    def __init__(self, max_bytes: int, max_slots: int) -> None:
        self.max_bytes, self.max_slots = max_bytes, max_slots
        self.slots: dict[int, list[RemoteSlot]] = {}
        self.conn: FastConn | None = None
        self.use_s = 0.0  # how long a slot is used after its reserving call was sent

    def of(self, size: int, conn: FastConn | None) -> list[RemoteSlot]:
        """The slots of ``size`` held on ``conn`` (those of another connection are
        dropped: the master that reserved them frees them itself)."""
        if self.conn is not conn:
            self.slots.clear()
            self.conn = conn
        return self.slots.setdefault(size, [])

    def target(self, size: int) -> int:
        """How many slots of ``size`` the pool may hold: the per-size count, within the
        byte budget left by the other sizes (0: none)."""
        other = sum(z * len(p) for z, p in self.slots.items() if z != size)
        return max(0, min(self.max_slots, (self.max_bytes - other) // size))

    @staticmethod
    def take(pool: list[RemoteSlot], n: int, now: float) -> list[RemoteSlot] | None:
        """Pops ``n`` slots whose use-by time has not passed (expired ones are dropped
        as they come: the pool is not kept in use-by order); None when fewer are left
        (those taken go back)."""
        out: list[RemoteSlot] = []
        while len(out) < n and pool:
            s = pool.pop()
            if s[0] >= now:
                out.append(s)
        if len(out) < n:
            pool.extend(reversed(out))
            return None
        return out


async def put_pooled(
    cl: StoreClient,
    keys: list[bytes],
    sizes: Sequence[int],
    region_id: int,
    offsets: Sequence[int] | None = None,
    values: Sequence[memoryview] | None = None,
) -> list[bool] | None:
    """A put of a few small values of one size by a client that lends no memory (see the
    module's rules). None when the pool does not apply (the caller puts with
    PUT_START/PUT_END); a key whose slot is not committed for any reason but a failed
    write is put that way too."""
    size, n = sizes[0], len(keys)
    if size > REMOTE_SLOT_MAX or cl.segment is not None:
        return None
    rp = cl._rslots
    conn = cl._fast
    if conn is None or conn.closed or cl._fast_addr != cl.master_address():
        conn = await cl._conn()
    if (
        conn is None
        or conn.closed
        or cl._fast_addr != cl.master_address()
        or any(z != size for z in sizes)
    ):
        return None
    pool = rp.of(size, conn)
    target = rp.target(size)
    if n > target:
        return None
    slots = rp.take(pool, n, time.monotonic())
    if slots is None:
        sent = time.monotonic()
        body = await cl._call_on(
            conn,
            wire.PUT_RESERVE,
            wire.pack_put_reserve(cl.node_id, size, n - len(pool), target - n),
        )
        if not body:  # None (failed, the connection changed) or False (an older master)
            return None
        ttl_ms, region, addr, node, token, offs = wire.unpack_put_reserve_resp(body)
        pool = rp.of(size, conn)
        rp.use_s = ttl_ms / 1000 * REMOTE_SLOT_USE
        use_by = sent + rp.use_s
        pool.extend((use_by, addr, region, node, o, token) for o in offs)
        slots = rp.take(pool, n, time.monotonic())
        if slots is None:
            return None
    by_peer: dict[str, list[int]] = {}
    pos = 0
    src: list[int] = []
    for i, s in enumerate(slots):
        if values is not None:
            copy_into(cl._staging_view[pos : pos + size], values[i])
            src.append(pos)
            pos += size
        elif offsets is not None:
            src.append(offsets[i])
        by_peer.setdefault(s[1], []).append(i)
    peers = list(by_peer)
    writes = [
        _write_by(
            cl,
            p,
            [Slice(region_id, src[i], slots[i][2], slots[i][4], size) for i in by_peer[p]],
            min(slots[i][0] for i in by_peer[p]),
        )
        for p in peers
    ]
    oks = [await writes[0]] if len(writes) == 1 else await asyncio.gather(*writes)
    # False: the write failed (not stored); None: put again (not acknowledged in time,
    # not committed); True: stored or present
    out: list[bool | None] = [False] * n
    # commit per segment (one, usually): only keys whose write was acknowledged in time
    by_seg: dict[tuple[str, int], list[int]] = {}
    for p, ok in zip(peers, oks):
        for i in by_peer[p]:
            if ok:
                by_seg.setdefault((slots[i][3], slots[i][2]), []).append(i)
            elif ok is None:
                out[i] = None
    for (node, region), idx in by_seg.items():
        pool = rp.of(size, conn)
        want = rp.target(size) - len(pool)
        refill = want if want > target // 2 else 0
        sent = time.monotonic()
        body = await cl._call_on(
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
        )
        if not body:  # not committed (or not known to be): put again
            for i in idx:
                out[i] = None
            continue
        status, token, new = wire.unpack_put_slots_resp(body, len(idx))
        pool = rp.of(size, conn)
        for i, st in zip(idx, status):
            out[i] = True if st in (1, 2) else None
            if st == 2:
                pool.append(slots[i])  # the key was present: the slot is still ours
        if new:
            use_by = sent + rp.use_s  # held as long as the first ones
            pool.extend((use_by, slots[idx[0]][1], region, node, o, token) for o in new)
    retry = [i for i in range(n) if out[i] is None]
    if retry:  # slots not committed (expired, another master): the usual path
        sub = await cl._put_placed(
            [keys[i] for i in retry],
            [size] * len(retry),
            region_id,
            offsets=[src[i] for i in retry] if values is None else None,
            values=[values[i] for i in retry] if values is not None else None,
        )
        for i, v in zip(retry, sub):
            out[i] = v
    return [bool(v) for v in out]


async def _write_by(cl: StoreClient, peer: str, slices: list[Slice], use_by: float) -> bool | None:
    """The write into held slots, awaited until ``use_by``: True acknowledged in time,
    False failed, None not acknowledged by then (not to be committed: its slot may be
    another writer's once the master's hold ends)."""
    left = use_by - time.monotonic()
    if left <= 0:
        return None
    try:
        async with asyncio.timeout(left):
            ok = await cl._write(peer, slices)
    except TimeoutError:
        return None
    if ok and time.monotonic() > use_by:
        return None
    return ok
