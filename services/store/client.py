"""StoreClient: the cluster KV store from a process's point of view, in Mooncake Store's
shape - ``put``/``get``/``batch_put``/``batch_get``/``exists``/``remove`` on bytes, and
zero-copy ``put_from``/``get_into`` between transfer-engine registered buffers and the
segments that hold the blocks. Control goes to the store-master over gRPC; bytes move
only over the transfer engine.

Keys are bytes: 16-byte block hashes for KV, or any key of 1..256 bytes.

Semantics a caller can rely on:
  * a put is all-or-nothing per key: ``PutStart`` -> transfer-engine write -> ``PutEnd``;
    a failed write aborts the key, and a key whose placement vanished meanwhile (its node
    died, the put was reclaimed) is reported as not stored;
  * a get never returns bytes read after its read lease ended: the lease deadline is
    computed locally as (time the ``GetReplicas`` request was *sent*) + ``lease_ms``, so
    clock skew cannot extend it; a late read is a miss (``stats["lease_expired"]``) and
    the caller recomputes;
  * every failure of the store (master down, node gone, transfer error) is a miss or a
    ``False``, never an exception, except bad arguments (``ValueError``).
"""

from __future__ import annotations

import asyncio
import json
import logging
import time
from typing import Sequence

import grpc

from protos import kvmesh_pb2 as pb
from protos import kvmesh_pb2_grpc as pbg
from rdma import Slice, TransferEngine, TransferError
from services.common.registry import Membership
from services.common.channels import make_channel

log = logging.getLogger(__name__)

MAX_KEY_LEN = 256


def _check_keys(keys: Sequence[bytes]) -> list[bytes]:
    out = [bytes(k) for k in keys]
    for k in out:
        if not 1 <= len(k) <= MAX_KEY_LEN:
            raise ValueError(f"store keys must be 1..{MAX_KEY_LEN} bytes, got {len(k)}")
    return out


class StoreClient:
    """``te`` must be started; ``master`` is a store-master gRPC address or a started
    :class:`Membership` of the cluster (any live store-master is used)."""

    def __init__(self, te: TransferEngine, master: str | Membership, node_id: str = "",
                 rpc_timeout: float = 5.0, staging_bytes: int = 4 << 20) -> None:
        self.te = te
        self.master = master
        self.node_id = node_id
        self.rpc_timeout = rpc_timeout
        self._channels: dict[str, grpc.aio.Channel] = {}
        self._staging: bytearray | None = None
        self._staging_region = -1
        self._staging_min = staging_bytes
        self._staging_lock = asyncio.Lock()
        self.stats = {"puts": 0, "put_failed": 0, "gets": 0, "misses": 0,
                      "lease_expired": 0, "read_failed": 0, "master_errors": 0}

    # -- plumbing --------------------------------------------------------------------------
    def master_address(self) -> str | None:
        if isinstance(self.master, str):
            return self.master
        for key, value in self.master.nodes.items():
            if "/store-master/" in key:
                addr = json.loads(value).get("grpc")
                if addr:
                    return addr
        return None

    def stub(self) -> pbg.StoreMasterStub | None:
        addr = self.master_address()
        if addr is None:
            return None
        ch = self._channels.get(addr)
        if ch is None:
            ch = self._channels[addr] = make_channel(addr)
        return pbg.StoreMasterStub(ch)

    async def close(self) -> None:
        for ch in self._channels.values():
            await ch.close()
        self._channels.clear()
        if self._staging_region >= 0:
            self.te.unregister(self._staging_region)
            self._staging_region = -1

    async def _call(self, name: str, req, timeout: float | None = None):
        stub = self.stub()
        if stub is None:
            self.stats["master_errors"] += 1
            return None
        try:
            return await getattr(stub, name)(req, timeout=timeout or self.rpc_timeout)
        except grpc.aio.AioRpcError as e:
            self.stats["master_errors"] += 1
            log.warning("store %s failed: %s %s", name, e.code(), e.details())
            return None

    def _stage(self, nbytes: int) -> tuple[memoryview, int]:
        if self._staging is None or len(self._staging) < nbytes:
            if self._staging_region >= 0:
                self.te.unregister(self._staging_region)
            size = max(nbytes, self._staging_min, 2 * len(self._staging or b""))
            self._staging = bytearray(size)
            self._staging_region = self.te.register(self._staging)
        return memoryview(self._staging), self._staging_region

    # -- zero-copy -------------------------------------------------------------------------
    async def put_from(self, keys: Sequence[bytes], region_id: int, offsets: Sequence[int],
                       sizes: Sequence[int]) -> list[bool]:
        """Stores ``sizes[i]`` bytes at ``offsets[i]`` of local region ``region_id`` under
        ``keys[i]``. True per key when it is in the store afterwards (written now or
        already present); False when it did not fit or its write/commit failed."""
        keys = _check_keys(keys)
        if not (len(keys) == len(offsets) == len(sizes)):
            raise ValueError("put_from: keys, offsets and sizes must have one entry each")
        if not keys:
            return []
        same = all(s == sizes[0] for s in sizes)
        resp = await self._call("PutStart", pb.PutStartRequest(
            node_id=self.node_id, hashes=keys, size=sizes[0] if same else 0,
            sizes=[] if same else list(sizes)))
        if resp is None:
            self.stats["put_failed"] += len(keys)
            return [False] * len(keys)
        where = {k: i for i, k in enumerate(keys)}
        ok = {bytes(h) for h in resp.already_present}
        by_peer: dict[str, list[pb.Placement]] = {}
        for p in resp.placements:
            by_peer.setdefault(p.data_address, []).append(p)

        async def write(peer: str, ps: list[pb.Placement]) -> list[bytes]:
            try:
                await self.te.write(peer, [Slice(region_id, offsets[where[p.hash]], p.region_id,
                                                 p.offset, p.size) for p in ps])
                return []
            except (TransferError, OSError) as e:
                log.warning("store put to %s failed (%s); aborting %d key(s)", peer, e, len(ps))
                return [p.hash for p in ps]

        failed = [h for hs in await asyncio.gather(*(write(a, ps) for a, ps in by_peer.items()))
                  for h in hs]
        written = [p.hash for p in resp.placements if p.hash not in set(failed)]
        if failed:
            await self._call("PutEnd", pb.PutEndRequest(hashes=failed, abort=True))
        if written:
            end = await self._call("PutEnd", pb.PutEndRequest(hashes=written))
            if end is not None:
                bad = set(end.failed)
                ok.update(bytes(h) for h in written if h not in bad)
        out = [k in ok for k in keys]
        self.stats["puts"] += sum(out)
        self.stats["put_failed"] += len(out) - sum(out)
        return out

    async def get_into(self, keys: Sequence[bytes], region_id: int, offsets: Sequence[int],
                       capacities: Sequence[int] | None = None, prefix: bool = False
                       ) -> list[int]:
        """Reads each key into local region ``region_id`` at ``offsets[i]``; returns the
        bytes read per key, -1 for a miss. ``prefix``: only the longest run of present
        keys from the first one is read (a KV hash chain); the rest are -1."""
        keys = _check_keys(keys)
        if len(offsets) != len(keys):
            raise ValueError("get_into: keys and offsets must have one entry each")
        out = [-1] * len(keys)
        if not keys:
            return out
        sent = time.monotonic()
        resp = await self._call("GetReplicas", pb.GetReplicasRequest(
            hashes=keys, node_id=self.node_id, any_order=not prefix))
        if resp is None:
            self.stats["misses"] += len(keys)
            return out
        deadline = sent + (resp.lease_ms or 0) / 1000
        idx: dict[bytes, list[int]] = {}
        for i, k in enumerate(keys):
            idx.setdefault(k, []).append(i)
        by_peer: dict[str, list[tuple[int, pb.Placement]]] = {}
        for p in resp.replicas:
            for i in idx.get(bytes(p.hash), ()):
                if capacities is not None and p.size > capacities[i]:
                    continue
                by_peer.setdefault(p.data_address, []).append((i, p))

        async def read(peer: str, items: list[tuple[int, pb.Placement]]) -> None:
            try:
                await self.te.read(peer, [Slice(region_id, offsets[i], p.region_id, p.offset,
                                                p.size) for i, p in items])
            except (TransferError, OSError) as e:
                self.stats["read_failed"] += len(items)
                log.warning("store read from %s failed (%s): a miss", peer, e)
                return
            for i, p in items:
                out[i] = p.size

        await asyncio.gather(*(read(a, it) for a, it in by_peer.items()))
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

    # -- bytes API -------------------------------------------------------------------------
    async def put(self, key: bytes, value: bytes | bytearray | memoryview) -> bool:
        return (await self.batch_put([key], [value]))[0]

    async def batch_put(self, keys: Sequence[bytes], values: Sequence) -> list[bool]:
        if len(keys) != len(values):
            raise ValueError("batch_put: one value per key")
        sizes = [len(memoryview(v).cast("B")) for v in values]
        if any(s == 0 for s in sizes):
            raise ValueError("batch_put: values must not be empty")
        async with self._staging_lock:
            buf, region = self._stage(sum(sizes))
            offs, pos = [], 0
            for v, s in zip(values, sizes):
                buf[pos:pos + s] = memoryview(v).cast("B")
                offs.append(pos)
                pos += s
            return await self.put_from(keys, region, offs, sizes)

    async def get(self, key: bytes) -> bytes | None:
        return (await self.batch_get([key]))[0]

    async def batch_get(self, keys: Sequence[bytes]) -> list[bytes | None]:
        """Values of ``keys`` (None = miss). Sizes come from the master, so this asks it
        once for placements and reads into a staging buffer."""
        keys = _check_keys(keys)
        if not keys:
            return []
        async with self._staging_lock:
            sent = time.monotonic()
            resp = await self._call("GetReplicas", pb.GetReplicasRequest(
                hashes=keys, node_id=self.node_id, any_order=True))
            if resp is None:
                self.stats["misses"] += len(keys)
                return [None] * len(keys)
            deadline = sent + resp.lease_ms / 1000
            place = {bytes(p.hash): p for p in resp.replicas}
            buf, region = self._stage(sum(p.size for p in place.values()) or 1)
            offs: dict[bytes, int] = {}
            pos = 0
            for h, p in place.items():
                offs[h] = pos
                pos += p.size
            by_peer: dict[str, list[pb.Placement]] = {}
            for p in place.values():
                by_peer.setdefault(p.data_address, []).append(p)
            good: set[bytes] = set()

            async def read(peer: str, ps: list[pb.Placement]) -> None:
                try:
                    await self.te.read(peer, [Slice(region, offs[bytes(p.hash)], p.region_id,
                                                    p.offset, p.size) for p in ps])
                    good.update(bytes(p.hash) for p in ps)
                except (TransferError, OSError) as e:
                    self.stats["read_failed"] += len(ps)
                    log.warning("store read from %s failed (%s): a miss", peer, e)

            await asyncio.gather(*(read(a, ps) for a, ps in by_peer.items()))
            if time.monotonic() > deadline:
                self.stats["lease_expired"] += 1
                good.clear()
            out = [bytes(buf[offs[k]:offs[k] + place[k].size]) if k in good else None
                   for k in keys]
        hits = sum(1 for v in out if v is not None)
        self.stats["gets"] += hits
        self.stats["misses"] += len(out) - hits
        return out

    async def exists(self, keys: bytes | Sequence[bytes]) -> bool | list[bool]:
        """One key -> bool; a list of keys -> one bool per key."""
        single = isinstance(keys, (bytes, bytearray))
        ks = _check_keys([keys] if single else keys)
        resp = await self._call("Exists", pb.ExistsRequest(hashes=ks, any_order=True))
        present = list(resp.present) if resp is not None else [False] * len(ks)
        return present[0] if single else present

    async def prefix_len(self, chain: Sequence[bytes]) -> int:
        """How many blocks of a hash chain, from the first, the store holds."""
        resp = await self._call("Exists", pb.ExistsRequest(hashes=_check_keys(chain)))
        return resp.prefix_blocks if resp is not None else 0

    async def remove(self, keys: bytes | Sequence[bytes]) -> int:
        ks = _check_keys([keys] if isinstance(keys, (bytes, bytearray)) else keys)
        resp = await self._call("Remove", pb.RemoveRequest(hashes=ks))
        return resp.removed if resp is not None else 0

    async def pin(self, keys: Sequence[bytes], on: bool = True) -> int:
        """Soft pin (e.g. a system prompt's blocks): evicted only after unpinned ones."""
        req = pb.PinRequest(hashes=_check_keys(keys))
        resp = await self._call("Pin" if on else "Unpin", req)
        return resp.pinned if resp is not None else 0
