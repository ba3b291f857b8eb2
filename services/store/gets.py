"""Gets, as a part of :class:`~kvmesh.services.store.client.StoreClient`: ``get_into``
(zero-copy, into a registered region) and ``get``/``batch_get`` (bytes).

A get sends one ``GET`` to the master for every key's replica and lease, reading where
the client last saw small keys meanwhile (:mod:`~kvmesh.services.store.located`), then
copies replicas in the client's own segment and reads the others with the transfer
engine, per holder at once: bytes gets of ``limits.DIRECT_GET_MIN`` or more straight into
the ``bytes`` they return, smaller ones through the staging buffer in runs of
``limits.PIPELINE_BYTES`` (a run's values are copied out while later runs are on the
wire). A read that ends after the lease is a miss."""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Awaitable, Callable, Sequence
from typing import Any

from kvmesh.rdma import Slice, TransferEngine, TransferError
from kvmesh.services.store import limits
from kvmesh.services.store.batching import run_all
from kvmesh.services.store.copy import FILLABLE_BYTES, fresh_bytes_many, fresh_bytes_target
from kvmesh.services.store.limits import Loc, check_keys
from kvmesh.services.store.located import Locations

log = logging.getLogger(__name__)


class Gets:
    """The get paths of a store client (a mixin: the client supplies its engine, its
    segment, its staging buffer, its read-ahead and its ``GET`` call)."""

    # supplied by the client
    te: TransferEngine
    segment: Any  # the SegmentHost it lends, or None
    stats: dict[str, int]
    _where: Locations
    _staging_lock: asyncio.Lock
    _stage: Callable[[int], tuple[memoryview, int]]
    _get_replicas: Callable[..., Awaitable[tuple[int, list[Loc], list[int]] | None]]
    _read_ahead: Callable[..., Awaitable[set[int]]]
    _read_ahead_bytes: Callable[..., Awaitable[dict[int, bytes]]]
    _take_early: Callable[..., list[Loc]]
    _is_local: Callable[[str, int], bool]
    _region_view: Callable[[int, int, int], memoryview | None]

    async def _ask_reading_ahead(self, keys: list[bytes], any_order: bool, read: Any) -> Any:
        """The master's answer for ``keys`` (``_get_replicas``), with ``read`` (the read
        where the keys were, :mod:`~kvmesh.services.store.located`; or None) running
        meanwhile: (answer, what the read got, or None)."""
        early = asyncio.ensure_future(read) if read is not None else None
        try:
            got = await self._get_replicas(keys, any_order)
        except BaseException:
            if early is not None:
                early.cancel()
            raise
        return got, (await early if early is not None else None)

    async def get_into(
        self,
        keys: Sequence[bytes],
        region_id: int,
        offsets: Sequence[int],
        capacities: Sequence[int] | None = None,
        prefix: bool = False,
    ) -> list[int]:
        """Reads each key into local region ``region_id`` at ``offsets[i]``; returns the
        bytes read per key, -1 for a miss. ``prefix``: only the longest run of present
        keys from the first one is read (a KV hash chain); the rest are -1."""
        keys = check_keys(keys)
        if len(offsets) != len(keys):
            raise ValueError("get_into: keys and offsets must have one entry each")
        out = [-1] * len(keys)
        if not keys:
            return out
        sent = time.monotonic()
        ahead = [] if prefix or self.segment is not None else self._where.plan(keys)
        if capacities is not None:
            ahead = [(i, w) for i, w in ahead if w[3] <= capacities[i]]
        got, read_early = await self._ask_reading_ahead(
            keys,
            not prefix,
            self._read_ahead(ahead, lambda i, w: Slice(region_id, offsets[i], *w[1:4]))
            if ahead
            else None,
        )
        if got is None:
            self.stats["misses"] += len(keys)
            return out
        lease_ms, locs, gens = got
        deadline = sent + lease_ms / 1000
        if read_early:
            locs = self._take_early(dict(ahead), read_early, locs, gens, out, True)
        by_peer: dict[str, list[Loc]] = {}
        for loc in locs:
            i, addr, region, _, off, size = loc
            if capacities is not None and size > capacities[i]:
                continue
            if self._is_local(addr, region):
                dst = self._region_view(region_id, offsets[i], size)
                if dst is not None:
                    dst[:] = self.segment.view[off : off + size]
                    out[i] = size
                    self.stats["local_gets"] += 1
                    continue
            by_peer.setdefault(addr, []).append(loc)

        async def read(peer: str, items: list[Loc]) -> None:
            try:
                await self.te.read(
                    peer,
                    [
                        Slice(region_id, offsets[i], region, off, size)
                        for i, _, region, _, off, size in items
                    ],
                )
            except (TransferError, OSError) as e:
                self.stats["read_failed"] += len(items)
                log.warning("store read from %s failed (%s): a miss", peer, e)
                return
            for i, *_, size in items:
                out[i] = size

        if by_peer:
            await run_all(read(a, it) for a, it in by_peer.items())
        if time.monotonic() > deadline:
            # the master may have reused the space: what we read cannot be trusted
            self.stats["lease_expired"] += 1
            log.warning("store read finished after its lease; treating it as a miss")
            out = [-1] * len(keys)
        if prefix:
            n = next((i for i, s in enumerate(out) if s < 0), len(out))
            out = out[:n] + [-1] * (len(out) - n)
        hits = sum(1 for s in out if s >= 0)
        self.stats["gets"] += hits
        self.stats["misses"] += len(out) - hits
        return out

    async def get(self, key: bytes) -> bytes | None:
        return (await self.batch_get([key]))[0]

    async def batch_get(self, keys: Sequence[bytes]) -> list[bytes | None]:
        """Values of ``keys`` (None = miss). Sizes come from the master, so this asks it
        once for placements, copies replicas in the own segment and reads the others
        into a staging buffer."""
        keys = check_keys(keys)
        if not keys:
            return []
        out: list[bytes | None] = [None] * len(keys)
        sent = time.monotonic()
        ahead = [] if self.segment is not None else self._where.plan(keys)
        got, read_early = await self._ask_reading_ahead(
            keys, True, self._read_ahead_bytes(ahead) if ahead else None
        )
        if got is None:
            self.stats["misses"] += len(keys)
            return out
        lease_ms, locs, gens = got
        deadline = sent + lease_ms / 1000
        if read_early:
            locs = self._take_early(dict(ahead), read_early, locs, gens, out, False)
        remote: list[Loc] = []
        local: list[tuple[int, memoryview]] = []
        seg = self.segment
        for loc in locs:
            i, addr, region, _, off, size = loc
            if seg is not None and region == seg.region and addr == self.te.address:
                local.append((i, seg.view[off : off + size]))
            else:
                remote.append(loc)
        for (i, _), v in zip(local, fresh_bytes_many([v for _, v in local])):
            out[i] = v
        nlocal = len(locs) - len(remote)
        if remote and FILLABLE_BYTES and self.te.transport_kind != "rdma":
            # large values land straight in the bytes handed back (no staging, no copy)
            direct = [loc for loc in remote if loc[5] >= limits.DIRECT_GET_MIN]
            if direct:
                remote = [loc for loc in remote if loc[5] < limits.DIRECT_GET_MIN]
                await self._get_direct(direct, out)
        if remote:
            async with self._staging_lock:
                buf, sregion = self._stage(sum(loc[5] for loc in remote))
                offs, pos = [], 0
                for loc in remote:
                    offs.append(pos)
                    pos += loc[5]
                # per peer, runs of PIPELINE_BYTES: each run's values are copied out
                # while the later runs are still on the wire
                by_peer: dict[str, list[int]] = {}
                runs: list[tuple[str, list[int]]] = []
                run_bytes: dict[str, int] = {}
                for j, loc in enumerate(remote):
                    js = by_peer.setdefault(loc[1], [])
                    js.append(j)
                    run_bytes[loc[1]] = run_bytes.get(loc[1], 0) + loc[5]
                    if run_bytes[loc[1]] >= limits.PIPELINE_BYTES:
                        runs.append((loc[1], by_peer.pop(loc[1])))
                        run_bytes[loc[1]] = 0
                runs.extend(by_peer.items())

                async def read(peer: str, js: list[int]) -> None:
                    try:
                        await self.te.read(
                            peer,
                            [
                                Slice(sregion, offs[j], remote[j][2], remote[j][4], remote[j][5])
                                for j in js
                            ],
                        )
                        vals = fresh_bytes_many([buf[offs[j] : offs[j] + remote[j][5]] for j in js])
                        for j, v in zip(js, vals):
                            out[remote[j][0]] = v
                    except (TransferError, OSError) as e:
                        self.stats["read_failed"] += len(js)
                        log.warning("store read from %s failed (%s): a miss", peer, e)

                await run_all(read(a, js) for a, js in runs)
        if time.monotonic() > deadline:
            self.stats["lease_expired"] += 1
            out = [None] * len(keys)
        hits = sum(1 for v in out if v is not None)
        self.stats["local_gets"] += nlocal if hits else 0
        self.stats["gets"] += hits
        self.stats["misses"] += len(out) - hits
        return out

    async def _get_direct(self, locs: list[Loc], out: list[bytes | None]) -> None:
        """Reads each remote value of ``DIRECT_GET_MIN`` bytes or more into a fresh
        ``bytes`` registered for the read (a table entry on the TCP transport): the value
        is on the wire once and copied never; the peers' reads run concurrently."""
        targets = [fresh_bytes_target(loc[5]) for loc in locs]
        regions = [self.te.register(t[1]) for t in targets]
        try:
            by_peer: dict[str, list[int]] = {}
            for j, loc in enumerate(locs):
                by_peer.setdefault(loc[1], []).append(j)

            async def read(peer: str, js: list[int]) -> None:
                try:
                    await self.te.read(
                        peer, [Slice(regions[j], 0, locs[j][2], locs[j][4], locs[j][5]) for j in js]
                    )
                except (TransferError, OSError) as e:
                    self.stats["read_failed"] += len(js)
                    log.warning("store read from %s failed (%s): a miss", peer, e)
                    return
                for j in js:
                    out[locs[j][0]] = targets[j][0]

            await run_all(read(a, js) for a, js in by_peer.items())
        finally:
            for rid in regions:
                self.te.unregister(rid)
