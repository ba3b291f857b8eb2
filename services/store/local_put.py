"""Puts into the client's own segment, as a part of
:class:`~kvmesh.services.store.client.StoreClient`: a client that lends memory (``lend``,
or its node's :class:`~kvmesh.services.store.segment.SegmentHost`) keeps a pool of slots
it reserved there; a put copies each value into a slot and commits key -> slot in ONE
``PutLocal`` call, which also refills the pool. A block is visible only after that
commit, i.e. after its bytes are written. Slots belong to one mount of the segment: a
re-mount bumps ``SegmentHost.epoch``, which empties the pool."""

from __future__ import annotations

from collections.abc import Awaitable, Callable, Sequence
from typing import Any

from kvmesh.protos import kvmesh_pb2 as pb
from kvmesh.rdma import TransferEngine
from kvmesh.rdma.transport import RemoteAccessError
from kvmesh.services.store.copy import copy_many
from kvmesh.services.store_master import wire


class LocalPuts:
    """The own-segment put path of a store client (a mixin: the client supplies its
    segment, its engine and its calls to the master)."""

    # supplied by the client
    te: TransferEngine
    segment: Any  # the SegmentHost it lends, or None
    node_id: str
    pool_bytes: int
    pool_slots: int
    stats: dict[str, int]
    _pool: dict[int, list[int]]  # size -> reserved slot offsets
    _pool_epoch: int
    _fast_call: Callable[[int, bytes], Awaitable[bytes | None | bool]]
    _call: Callable[..., Awaitable[Any]]

    async def _put_local_call(
        self,
        region: int,
        keys: list[bytes],
        slots: list[tuple[int, int]],
        rsize: int,
        rcount: int,
        rspare: int,
    ) -> tuple[list[int], list[int]] | None:
        body = await self._fast_call(
            wire.PUT_LOCAL,
            wire.pack_put_local(self.node_id, region, keys, slots, rsize, rcount, rspare, []),
        )
        if body is not False:
            return None if body is None else wire.unpack_put_local_resp(body, len(keys))
        resp = await self._call(
            "PutLocal",
            pb.PutLocalRequest(
                node_id=self.node_id,
                region_id=region,
                hashes=keys,
                offsets=[o for o, _ in slots],
                sizes=[z for _, z in slots],
                reserve_size=rsize,
                reserve_count=rcount,
                reserve_spare=rspare,
            ),
        )
        return None if resp is None else (list(resp.status), list(resp.reserved))

    def _local_region(self) -> int:
        seg = self.segment
        if seg is None or seg.region < 0 or not seg.mounted.is_set():
            return -1
        return seg.region

    def _is_local(self, addr: str, region: int) -> bool:
        seg = self.segment
        return seg is not None and region == seg.region and addr == self.te.address

    def _region_view(self, region_id: int, offset: int, size: int) -> memoryview | None:
        """A view of one of this engine's registered regions (local copies)."""
        try:
            return self.te.region_view(region_id, offset, size)
        except RemoteAccessError:  # an unknown region or out of its bounds
            return None

    def _pool_for(self, size: int) -> list[int]:
        seg = self.segment
        if self._pool_epoch != seg.epoch:  # re-mounted: older slots are not ours any more
            self._pool.clear()
            self._pool_epoch = seg.epoch
        return self._pool.setdefault(size, [])

    def _pool_target(self, size: int) -> int:
        return max(1, min(self.pool_slots, self.pool_bytes // size))

    async def _put_local(
        self,
        keys: list[bytes],
        sizes: Sequence[int],
        src: Callable[[int], memoryview],
        ok: list[bool],
    ) -> list[int]:
        """Puts what it can through reserved slots of the own segment (one ``PutLocal``
        call, plus one to reserve when the pool lacks slots); returns the indices left
        for the remote path."""
        region = self._local_region()
        if region < 0:
            return list(range(len(keys)))
        size = sizes[0]
        if any(s != size for s in sizes):
            return list(range(len(keys)))  # mixed sizes: PutStart places them locally
        n = len(keys)
        epoch = self.segment.epoch
        if len(self._pool_for(size)) < n:
            missing = n - len(self._pool_for(size))
            r = await self._put_local_call(region, [], [], size, missing, self._pool_target(size))
            if r is None or self.segment is None:
                return list(range(n))
            if self.segment.epoch == epoch:
                self._pool_for(size).extend(r[1])
        seg = self.segment
        if seg is None or seg.epoch != epoch:
            return list(range(n))
        pool = self._pool_for(size)
        take = min(n, len(pool))
        if take == 0:
            return list(range(n))
        slots = [pool.pop() for _ in range(take)]
        view = seg.view
        # no await between taking the slots (same mount epoch) and copying into them
        copy_many([(view[off : off + size], src(i)) for i, off in enumerate(slots)])
        want = self._pool_target(size) - len(pool)
        spare = want if want > self._pool_target(size) // 2 else 0
        r = await self._put_local_call(
            region, keys[:take], [(o, size) for o in slots], size if spare else 0, 0, spare
        )
        if r is None:
            for i in range(take):
                ok[i] = False
            return list(range(take, n))
        status, reserved = r
        same = self.segment is not None and self.segment.epoch == epoch
        pool = self._pool_for(size) if same else []
        for i in range(take):
            ok[i] = status[i] in (1, 2)
            if status[i] == 2 and same:
                pool.append(slots[i])  # key was present: the slot is still ours
        if same:
            pool.extend(reserved)
        self.stats["local_puts"] += sum(1 for i in range(take) if status[i] == 1)
        return list(range(take, n))
