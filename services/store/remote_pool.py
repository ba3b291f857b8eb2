"""The pool of remote slots of a :class:`~kvmesh.services.store.client.StoreClient` that
lends no memory: a put of one size (<= ``REMOTE_SLOT_MAX``, as many values as the pool
holds) is one transfer-engine write into slots the client holds in a remote segment, then
ONE ``PUT_SLOTS`` commit that also refills the pool (``PUT_RESERVE`` fills it), instead of
PUT_START -> write -> PUT_END. Large values too: the round trip it saves was ~7% of a
remote 4 MiB put on a busy host, and the pool's byte budget bounds what it holds.

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
  * a slot this client drops without writing it (too little time left, over the
    budget, room for another size, the pool's slots on a holder whose write failed or
    hung, the pool at ``close()``)
    is given back with ``PUT_RELEASE`` on its connection; one it wrote or may still be
    writing (a failed or late write) or one of a changed connection stays reserved on
    the master until its deadline and is freed there (that memory is not usable
    meanwhile, bounded by the pool's budget per connection).

The pool asks for what its puts use (up to twice the values of the put at hand, at least
``REMOTE_POOL_MIN``) and holds at most ``remote_pool_slots`` slots of one size and
``remote_pool_bytes`` across all sizes, counting the slots it holds, those popped by
puts not yet committed and those asked for by a ``PUT_RESERVE`` or a refill still in
flight (so concurrent puts never make it hold more: one ``PUT_RESERVE`` per size is in
flight at a time, the other puts of that size await it, and what comes back beyond the
budget is given back with ``PUT_RELEASE``). A put that does not fit the budget left
first gives back the slots of every size that are out of time and then other sizes' idle
slots, oldest first, until it fits (so one size never locks the others out); if it still
does not fit (slots popped or asked for), it takes the usual path. The master grants
spare slots only from a small share of a segment's free space
(``slots.REMOTE_SPARE_SHARE``), so a pool never fills a segment up to its eviction
watermark.

A slot is taken only when its use-by time leaves room for the write: ``size`` at
``REMOTE_SLOT_MIN_BW`` plus ``REMOTE_SLOT_MARGIN_S`` (a large write into a slot about to
expire would always miss it). A write that fails, or is not acknowledged by its
use-by time, drops every slot of the pool on that holder and gives them back (it likely
died or hangs, and the next put would wait on it again; the keys are put again through
PUT_START/PUT_END, which places them on a live one: such a write is never committed).
Slots that reach the pool after ``close()`` began (a commit's refill, a reservation in
flight) are given back at once.
"""

from __future__ import annotations

import asyncio

from kvmesh.services.store.fastconn import FastConn

# a client that lends no memory puts a value up to this size through the pool (when
# the byte budget holds at least as many slots of that size as the put has values)
REMOTE_SLOT_MAX = 64 << 20
# a remote slot is used only within this share of the master's hold on it (the rest is
# the margin for the commit; the hold counts from when the request was sent)
REMOTE_SLOT_USE = 0.5
# a slot is taken for a write of ``size`` bytes only with at least
# size / REMOTE_SLOT_MIN_BW + REMOTE_SLOT_MARGIN_S left before its use-by time (a
# conservative floor of the engine's bandwidth to a peer: a slow write is late anyway)
REMOTE_SLOT_MIN_BW = 128e6
REMOTE_SLOT_MARGIN_S = 0.1
# a pool asks for slots of a size up to twice the values of the put at hand, and at
# least this many (within its budget and ``max_slots``): a client putting one value at
# a time holds ~32, one putting batches of 128 holds enough for the next batch too
REMOTE_POOL_MIN = 32

# (use by, data address, region, node, offset, token)
RemoteSlot = tuple[float, str, int, str, int, int]


def write_time(size: int) -> float:
    """The time a slot must have left for a write of ``size`` bytes into it."""
    return size / REMOTE_SLOT_MIN_BW + REMOTE_SLOT_MARGIN_S


class RemotePool:
    """Slots held in remote segments, per size, for one fast connection."""

    def __init__(self, max_bytes: int, max_slots: int) -> None:
        self.max_bytes, self.max_slots = max_bytes, max_slots
        self.slots: dict[int, list[RemoteSlot]] = {}
        self.conn: FastConn | None = None
        self.use_s = 0.0  # how long a slot is used after its reserving call was sent
        # per size: slots popped by puts not committed yet, and slots asked for by calls
        # in flight (both count against the budget)
        self.busy: dict[int, int] = {}
        # per size: the PUT_RESERVE in flight (the other puts of that size await it)
        self.reserving: dict[int, asyncio.Future] = {}
        # set by the client's close(): slots that come back from then on are given back
        self.closing = False

    def of(self, size: int, conn: FastConn | None) -> list[RemoteSlot]:
        """The slots of ``size`` held on ``conn`` (those of another connection are
        dropped: the master that reserved them frees them itself)."""
        if self.conn is not conn:
            self.slots.clear()
            self.conn = conn
        return self.slots.setdefault(size, [])

    def held(self, size: int) -> int:
        """Slots of ``size`` held, popped or asked for."""
        return len(self.slots.get(size, ())) + self.busy.get(size, 0)

    def held_bytes(self) -> int:
        sizes = set(self.slots) | set(self.busy)
        return sum(z * self.held(z) for z in sizes)

    def target(self, size: int) -> int:
        """How many slots of ``size`` the pool may hold (popped and asked for included):
        the per-size count, within the byte budget left by the other sizes (0: none)."""
        other = self.held_bytes() - size * self.held(size)
        return max(0, min(self.max_slots, (self.max_bytes - other) // size))

    def room(self, size: int) -> int:
        """How many more slots of ``size`` may be asked for."""
        return max(0, self.target(size) - self.held(size))

    def want(self, size: int, n: int) -> int:
        """How many slots of ``size`` (held, popped or asked for) a put of ``n`` values
        asks the pool to hold: twice ``n``, at least ``REMOTE_POOL_MIN``, within the
        target."""
        return min(self.target(size), max(REMOTE_POOL_MIN, 2 * n))

    def spare(self, size: int, n: int) -> int:
        """How many more slots of ``size`` than it needs now a put of ``n`` values asks
        for (reserving or refilling): up to :meth:`want`, within :meth:`room`."""
        return max(0, min(self.room(size), self.want(size, n) - self.held(size)))

    def add_busy(self, size: int, n: int) -> None:
        self.busy[size] = self.busy.get(size, 0) + n

    def trim(self, size: int) -> list[RemoteSlot]:
        """Pops the slots of ``size`` beyond the target (-> them, to be given back)."""
        pool = self.slots.get(size, [])
        extra = self.held(size) - self.target(size)
        out: list[RemoteSlot] = []
        while extra > 0 and pool:
            out.append(pool.pop(0))
            extra -= 1
        return out

    def make_room(self, size: int, count: int, now: float) -> list[tuple[int, RemoteSlot]]:
        """Makes room in the budget for ``count`` more slots of ``size``: drops the slots
        of every size with too little time left for their write (those of a size no put
        comes for again would hold the budget for good), then the idle slots of other
        sizes, oldest first, until the count fits; forgets sizes left empty. -> the
        (size, slot) pairs dropped (never written: to be given back with PUT_RELEASE).
        Idle slots are dropped only if that makes room enough (slots popped or asked
        for are never dropped)."""
        out: list[tuple[int, RemoteSlot]] = []
        for z, pool in self.slots.items():
            need = write_time(z)
            out += [(z, s) for s in pool if s[0] - now < need]
            pool[:] = [s for s in pool if s[0] - now >= need]
        others = sorted(
            ((s[0], z, s) for z, pool in self.slots.items() if z != size for s in pool),
            key=lambda e: e[0],
        )
        # busy ones stay: drop none unless dropping them all would make room enough
        busy = self.held_bytes() - size * self.held(size) - sum(z for _, z, _ in others)
        fits = min(self.max_slots, (self.max_bytes - busy) // size) - self.held(size) >= count
        for _, z, s in others if fits else ():
            if self.room(size) >= count:
                break
            self.slots[z].remove(s)
            out.append((z, s))
        for z in [z for z, pool in self.slots.items() if not pool and z != size]:
            del self.slots[z]
        return out

    def drop_peer(self, addr: str) -> int:
        """Drops every slot held on the segment holder at data address ``addr``."""
        n = 0
        for pool in self.slots.values():
            keep = [s for s in pool if s[1] != addr]
            n += len(pool) - len(keep)
            pool[:] = keep
        return n

    @staticmethod
    def take(
        pool: list[RemoteSlot],
        n: int,
        now: float,
        need_s: float = 0.0,
        dropped: list[RemoteSlot] | None = None,
    ) -> list[RemoteSlot] | None:
        """Pops ``n`` slots with at least ``need_s`` left before their use-by time (the
        others are dropped as they come, into ``dropped`` when given: the pool is not
        kept in use-by order); None when fewer are left (those taken go back)."""
        out: list[RemoteSlot] = []
        while len(out) < n and pool:
            s = pool.pop()
            if s[0] - now >= need_s:
                out.append(s)
            elif dropped is not None:
                dropped.append(s)
        if len(out) < n:
            pool.extend(reversed(out))
            return None
        return out
