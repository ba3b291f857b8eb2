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
  * a slot this client drops (expired, a failed or late write, a changed connection)
    stays reserved on the master until its deadline and is freed there; that memory is
    not usable meanwhile (bounded by the pool's budget per connection).

The pool holds at most ``remote_pool_slots`` slots of one size and ``remote_pool_bytes``
across all sizes; a put that does not fit the budget left takes the usual path.
"""

from __future__ import annotations

from kvmesh.services.store.fastconn import FastConn

# a client that lends no memory puts a value up to this size through the pool (when
# the byte budget holds at least as many slots of that size as the put has values)
REMOTE_SLOT_MAX = 64 << 20
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
