"""Where a client last saw each key, so that a small get is one round trip, not two.

A remote get asks the store-master where a key is, then reads the bytes from the holder:
two round trips in a row. A client that remembers where a key is (from its own put into
a pooled slot, or an earlier get) reads the holder *while* it asks the master, and uses
what it read only if the master's answer names the same replica: the same segment,
offset and size and the same *generation* (a number the master gives each replica for
its life, :attr:`~kvmesh.services.store_master.model.Replica.gen`; for a pooled slot the
writer derives it, :func:`~kvmesh.services.store_master.wire.slot_gen`). Else the read is
thrown away and the key read where the answer says, as before.

Why that never returns another value's bytes: the remembered replica was committed
(its bytes written and acknowledged) before this client learned of it, so before the
read began; a replica's bytes do not change while it lives; and an answer naming it
means it still lived when the master answered, with the read lease holding it from
then on (a read that ends after the lease is a miss, as every read). A key removed and
put again at the same offset is a new replica with a new generation: no match. A master
that restarted gives every replica a new generation. On a miss or a mismatch,
``get_into`` may have written the remembered replica's bytes into the caller's buffer
before finding out (the key's entry is then -1, or overwritten by the right value).

Only gets of at most ``SPEC_KEYS`` keys and ``SPEC_BYTES`` in all are read ahead. For
larger ones the saved round trip is a small share of the call, and noting a batch's keys
costs ~2 us a key. The byte limit was 128 KiB until a faster host (a 97 us control
round trip) showed a single 256 KiB ``get_into`` at 360 us p50 asking first and at
180-240 us reading ahead (3 runs each, alternated); at 4 and 16 MiB reading ahead
measured no faster (the read dominates), so 1 MiB. A batch of 128 x 4 KiB gained nothing
from it on a busy 2-core host (9.6 against 9.2 ms), hence the key limit, while single
4 KiB gets gained up to 23% (paired, in one process).
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Sequence

from kvmesh.rdma import Slice, TransferEngine, TransferError
from kvmesh.services.store.batching import run_all
from kvmesh.services.store.copy import FILLABLE_BYTES, fresh_bytes_target

WHERE_MAX = 1 << 16  # keys remembered (least recently used forgotten first)
SPEC_BYTES = 1 << 20  # most bytes one get reads ahead of the master's answer
SPEC_KEYS = 16  # most keys one get reads ahead

# (data address, region id, offset, size, generation)
Where = tuple[str, int, int, int, int]


class Locations:
    """A bounded map key -> :data:`Where` (least recently noted forgotten first)."""

    def __init__(self, cap: int = WHERE_MAX) -> None:
        self.cap = cap
        self.map: OrderedDict[bytes, Where] = OrderedDict()

    def __len__(self) -> int:
        return len(self.map)

    def note(self, key: bytes, where: Where) -> None:
        m = self.map
        m[key] = where
        m.move_to_end(key)
        if len(m) > self.cap:
            m.popitem(last=False)

    def forget(self, keys: Sequence[bytes]) -> None:
        m = self.map
        for k in keys:
            m.pop(k, None)

    def plan(self, keys: Sequence[bytes], budget: int = SPEC_BYTES) -> list[tuple[int, Where]]:
        """(key index, where) of the remembered keys worth reading ahead: none when they
        hold more than ``budget`` bytes in all, or there are more than ``SPEC_KEYS``."""
        m = self.map
        if not m or len(keys) > SPEC_KEYS:
            return []
        out = []
        total = 0
        for i, k in enumerate(keys):
            w = m.get(k)
            if w is not None:
                total += w[3]
                if total > budget:
                    return []
                out.append((i, w))
        return out

    def answer(
        self,
        keys: Sequence[bytes],
        locs: Sequence[tuple[int, str, int, str, int, int]],
        gens: Sequence[int] | None,
    ) -> None:
        """Learns from a master's answer (``locs`` as ``wire.unpack_get_resp``'s): keys
        it placed are noted (with ``gens``), keys it did not are forgotten. An answer
        placing more than ``SPEC_BYTES`` in all, or for more than ``SPEC_KEYS`` keys (as
        :meth:`plan` counts), teaches nothing: such gets never read ahead, and noting a
        large batch's keys costs it ~2 us a key (an entry it leaves stale is only a
        wasted guess: reads ahead are checked by generation)."""
        if len(keys) > SPEC_KEYS or sum(loc[5] for loc in locs) > SPEC_BYTES:
            return
        found = set()
        for j, (i, addr, region, _, off, size) in enumerate(locs):
            found.add(i)
            if gens is not None:
                self.note(keys[i], (addr, region, off, size, gens[j]))
            else:
                self.map.pop(keys[i], None)
        if len(found) < len(keys) and self.map:
            self.forget([k for i, k in enumerate(keys) if i not in found])


def confirmed(
    ahead: dict[int, Where],
    loc: tuple[int, str, int, str, int, int],
    gen: int | None,
) -> bool:
    """Whether the master's answer ``loc`` (with generation ``gen``) names the replica
    that was read ahead for its key."""
    w = ahead.get(loc[0])
    if w is None or gen is None:
        return False
    _, addr, region, _, off, size = loc
    return w == (addr, region, off, size, gen)


Loc = tuple[int, str, int, str, int, int]  # a GET answer's placement (client.Loc)


class ReadAhead:
    """The reads ahead of :class:`~kvmesh.services.store.client.StoreClient` (a mixin:
    its engine and stats)."""

    te: TransferEngine
    stats: dict[str, int]

    async def _read_ahead(self, ahead: list[tuple[int, Where]], slice_of) -> set[int]:
        """Reads each (key index, where) with ``slice_of(i, where)`` (one read per
        holder); -> the key indexes read (a failed read is only a wasted guess)."""
        by_peer: dict[str, list[tuple[int, Where]]] = {}
        for i, w in ahead:
            by_peer.setdefault(w[0], []).append((i, w))
        done: set[int] = set()

        async def read(peer: str, items: list[tuple[int, Where]]) -> None:
            try:
                await self.te.read(peer, [slice_of(i, w) for i, w in items])
            except (TransferError, OSError):
                return
            done.update(i for i, _ in items)

        if len(by_peer) == 1:
            await read(*next(iter(by_peer.items())))
        else:
            await run_all(read(p, it) for p, it in by_peer.items())
        return done

    async def _read_ahead_bytes(self, ahead: list[tuple[int, Where]]) -> dict[int, bytes]:
        """:meth:`_read_ahead` into fresh ``bytes`` (filled in place where it can, else
        read into a registered buffer and copied); -> {key index: value}."""
        if FILLABLE_BYTES and self.te.transport_kind != "rdma":
            targets = {i: fresh_bytes_target(w[3]) for i, w in ahead}
            regions = {i: self.te.register(t[1]) for i, t in targets.items()}
            try:
                done = await self._read_ahead(ahead, lambda i, w: Slice(regions[i], 0, *w[1:4]))
            finally:
                for rid in regions.values():
                    self.te.unregister(rid)
            return {i: targets[i][0] for i in done}
        offs, pos = {}, 0
        for i, w in ahead:
            offs[i] = pos
            pos += w[3]
        buf = bytearray(pos)
        rid = self.te.register(buf)
        try:
            done = await self._read_ahead(ahead, lambda i, w: Slice(rid, offs[i], *w[1:4]))
        finally:
            self.te.unregister(rid)
        view = memoryview(buf)
        return {i: bytes(view[offs[i] : offs[i] + w[3]]) for i, w in ahead if i in done}

    def _take_early(
        self,
        ahead: dict[int, Where],
        read_early,
        locs: list[Loc],
        gens: list[int] | None,
        out: list,
        sizes: bool,
    ) -> list[Loc]:
        """Fills ``out`` from the keys read ahead whose replica the master's answer
        names (``read_early``: their indexes, or {index: value}; ``sizes``: ``out``
        takes the size, as ``get_into``'s); -> the placements still to read."""
        rest: list[Loc] = []
        used = 0
        for j, loc in enumerate(locs):
            i = loc[0]
            if i in read_early and confirmed(ahead, loc, gens[j] if gens is not None else None):
                out[i] = loc[5] if sizes else read_early[i]
                used += 1
            else:
                rest.append(loc)
        self.stats["read_ahead_used"] += used
        self.stats["read_ahead_wasted"] += len(ahead) - used
        return rest
