"""The node side of the store: the DRAM segment a node lends, its optional SSD tier, the
small local index that survives a store-master restart, and the ``StoreSegment`` gRPC
service through which the store-master moves data it cannot touch itself.

Design (why the node, not the master, touches bytes):
  * **Spill** - the master decides eviction. For a victim on a node with an SSD tier it
    keeps the block leased (so nobody reuses the space), calls ``Spill`` on the owning
    node, which copies the DRAM bytes into a checksummed file, and only then records an
    SSD replica and frees the DRAM. Disk use is bounded by ``ssd_bytes``: the node drops
    its least recently spilled/used files and tells the master which (``dropped``).
  * **Promote** - a ``GetReplicas`` hit on an SSD-only block makes the master allocate
    DRAM on the same node and call ``Promote``; the node reads the file, verifies its
    CRC32 and copies it in. A missing or corrupt file is a miss (the master forgets the
    replica), never an error for the user.
  * **Replicate** - hot blocks: the master allocates a placement here and asks this node
    to read the block from a node that holds it with the transfer engine.
  * **Re-report** - the node follows ``WatchBlocks`` for its own node id and keeps
    ``index``: hash -> (offset, size, :func:`digest` of the bytes when they were stored). When a
    store-master joins (first start or restart) the node mounts its segment, re-reports
    every DRAM entry whose bytes still match their CRC plus every SSD file, then follows
    the event stream again (with a snapshot). Segment bytes are never copied or lost by
    a master restart.
"""

from __future__ import annotations

import asyncio
import hashlib
import json
import logging
import os
import struct
import zlib
from collections import OrderedDict

import grpc
import numpy as np

from kvmesh.protos import kvmesh_pb2 as pb
from kvmesh.protos import kvmesh_pb2_grpc as pbg
from kvmesh.rdma import Slice, TransferEngine, TransferError
from kvmesh.services.common.channels import make_channel

log = logging.getLogger(__name__)

_MAGIC = b"KVMS"
# values this large get the cheaper digest (zlib.crc32 runs ~1.5-3.5 GB/s here, the
# block sums ~6x faster: 73 vs 12 us per 256 KiB, 1.2 ms vs 0.12 ms per 4 MiB, CPU a
# store-node spends on every put, on the cores the transfers need)
DIGEST_SUM_MIN = 64 << 10
# a digest of a value this large runs on a worker thread; a smaller one inline (at most
# ~0.3 ms, less than the thread hand-off costs a busy host; the GIL is released anyway)
DIGEST_THREAD_MIN = 8 << 20
_DIGEST_BLOCK = 4096
# how long the master may hold this node's block events to send them together (the
# master's default is 2 ms): one gRPC message per put cost this node and the master CPU on
# the cores the puts run on (issue 13). Kept short: the index these events feed is
# re-reported after a master restart, and an event applied late digests the slot as it is
# then (were the slot reused meanwhile and the "removed" event lost with the master, the
# index would carry another block's bytes under the key: unlikely in 10 ms, not 0)
INDEX_EVENT_LAG_MS = 10


def digest(data: memoryview) -> int:
    """A 32-bit check of a stored value's bytes, for the index a node re-reports: it
    tells whether a slot still holds what was stored there (not adversarial input).
    Below ``DIGEST_SUM_MIN``: zlib.crc32. From there: crc32 of the wrapping 64-bit sum
    of every 4 KiB block's words, then of the tail - any change that alters a block's
    sum (every single-word change, every other value written over it) is caught, at
    ~6x crc32's speed (numpy; the GIL is released)."""
    n = len(data)
    if n < DIGEST_SUM_MIN:
        return zlib.crc32(data)
    whole = n - n % _DIGEST_BLOCK
    words = np.frombuffer(data, dtype=np.uint64, count=whole // 8)
    sums = words.reshape(-1, _DIGEST_BLOCK // 8).sum(axis=1, dtype=np.uint64)
    return zlib.crc32(data[whole:], zlib.crc32(sums.tobytes()))


_HDR = struct.Struct("<4sIQI H")  # magic, version, size, crc32, key length


class SsdTier:
    """Checksummed block files in ``directory``, at most ``capacity`` bytes of data,
    LRU-dropped. Survives a node restart (the directory is re-scanned)."""

    def __init__(self, directory: str, capacity: int) -> None:
        self.dir, self.capacity = directory, capacity
        os.makedirs(directory, exist_ok=True)
        self.files: OrderedDict[bytes, int] = OrderedDict()  # key -> data size
        self.used = 0
        for name in sorted(
            os.listdir(directory), key=lambda n: os.path.getmtime(os.path.join(directory, n))
        ):
            if not name.endswith(".blk"):
                if name.endswith(".tmp"):
                    os.unlink(os.path.join(directory, name))
                continue
            try:
                with open(os.path.join(directory, name), "rb") as f:
                    magic, _, size, _, klen = _HDR.unpack(f.read(_HDR.size))
                    key = f.read(klen)
                if magic == _MAGIC and self._path(key).endswith(name):
                    self.files[key] = size
                    self.used += size
                    continue
            except (OSError, struct.error):
                pass
            os.unlink(os.path.join(directory, name))
        self._trim()

    def _path(self, key: bytes) -> str:
        return os.path.join(self.dir, hashlib.sha1(key).hexdigest() + ".blk")

    def _trim(self, keep: bytes | None = None) -> list[bytes]:
        dropped = []
        while self.used > self.capacity and self.files:
            key = next(iter(self.files))
            if key == keep and len(self.files) == 1:
                break
            if key == keep:
                self.files.move_to_end(key)
                continue
            self.discard(key)
            dropped.append(key)
        return dropped

    def discard(self, key: bytes) -> None:
        size = self.files.pop(key, None)
        if size is not None:
            self.used -= size
        try:
            os.unlink(self._path(key))
        except OSError:
            pass

    def write(self, key: bytes, data: memoryview) -> list[bytes]:
        """Stores ``data`` under ``key``; returns keys dropped to stay within capacity."""
        if len(data) > self.capacity:
            return []
        path = self._path(key)
        tmp = path + ".tmp"
        with open(tmp, "wb") as f:
            f.write(_HDR.pack(_MAGIC, 1, len(data), zlib.crc32(data), len(key)))
            f.write(key)
            f.write(data)
        os.replace(tmp, path)
        if key in self.files:
            self.used -= self.files.pop(key)
        self.files[key] = len(data)
        self.used += len(data)
        return self._trim(keep=key)

    def read_into(self, key: bytes, dest: memoryview) -> bool:
        """Copies the file into ``dest``; False (and the file is gone) when it is
        missing, short, of another size or fails its checksum."""
        try:
            with open(self._path(key), "rb") as f:
                magic, _, size, crc, klen = _HDR.unpack(f.read(_HDR.size))
                if magic != _MAGIC or size != len(dest) or f.read(klen) != key:
                    raise ValueError("bad header")
                if f.readinto(dest) != size or zlib.crc32(dest) != crc:
                    raise ValueError("short or corrupt")
        except (OSError, ValueError, struct.error) as e:
            log.warning("ssd block %s unreadable (%s): a miss", key.hex()[:16], e)
            self.discard(key)
            return False
        if key in self.files:
            self.files.move_to_end(key)
        return True


class SegmentHost:
    """A node's store segment: DRAM registered with ``te``, optional SSD tier, local index,
    and the loops that keep every live store-master informed."""

    def __init__(
        self,
        te: TransferEngine,
        node_id: str,
        size: int,
        ssd_dir: str = "",
        ssd_bytes: int = 0,
        track: bool = True,
    ) -> None:
        """``track=False``: a lender that keeps no index (e.g. a StoreClient lending its
        own memory, as Mooncake Store clients do): no event stream, no CRCs, nothing to
        re-report - after a store-master restart it re-mounts empty (its blocks are
        misses and get recomputed). It notices a restart by polling ``StoreHello``."""
        self.te, self.node_id, self.size = te, node_id, size
        self.track = track
        # bumped (synchronously) before every MountSegment: a StoreClient sharing this
        # segment drops the slots it reserved under an older mount (see StoreClient)
        self.epoch = 0
        self.mounted = asyncio.Event()
        self.buf = bytearray(size)  # calloc'd: pages are touched only when written
        self.view = memoryview(self.buf)
        self.region = -1
        self.ssd = SsdTier(ssd_dir, ssd_bytes) if ssd_dir and ssd_bytes > 0 else None
        self.index: dict[bytes, tuple[int, int, int]] = {}  # hash -> (offset, size, crc)
        self.by_offset: dict[int, bytes] = {}
        self.grpc_address = ""
        self.master_id = ""
        self._masters: dict[str, asyncio.Task] = {}
        self._channels: dict[str, grpc.aio.Channel] = {}

    def register(self) -> None:
        """After ``te.start()``."""
        self.region = self.te.register(self.buf)

    def add_to_server(self, server: grpc.aio.Server) -> None:
        pbg.add_StoreSegmentServicer_to_server(StoreSegmentServicer(self), server)

    # -- store-masters ---------------------------------------------------------------------
    def on_member(self, event: str, key: str, value: bytes | None) -> None:
        """Membership listener: follow every store-master that joins, drop those leaving."""
        if "/store-master/" not in key:
            return
        if event == "leave":
            t = self._masters.pop(key, None)
            if t:
                t.cancel()
            return
        addr = json.loads(value or b"{}").get("grpc")
        if not addr:
            return
        old = self._masters.pop(key, None)
        if old:
            old.cancel()
        self._masters[key] = asyncio.get_running_loop().create_task(self._follow(addr))

    def follow(self, addr: str) -> None:
        """Lends the segment to the store-master at ``addr`` (without etcd membership)."""
        old = self._masters.pop(addr, None)
        if old:
            old.cancel()
        self._masters[addr] = asyncio.get_running_loop().create_task(self._follow(addr))

    def stub(self, addr: str) -> pbg.StoreMasterStub:
        ch = self._channels.get(addr)
        if ch is None:
            ch = self._channels[addr] = make_channel(addr)
        return pbg.StoreMasterStub(ch)

    def records(self) -> list[pb.BlockRecord]:
        """What to re-report: DRAM entries whose bytes still match, then SSD files."""
        out = []
        for h, (off, size, crc) in list(self.index.items()):
            if digest(self.view[off : off + size]) == crc:
                out.append(
                    pb.BlockRecord(
                        hash=h, offset=off, size=size, tier="dram", region_id=self.region
                    )
                )
            else:
                self._forget(h)
        if self.ssd is not None:
            out.extend(
                pb.BlockRecord(hash=h, size=size, tier="ssd", region_id=self.region)
                for h, size in self.ssd.files.items()
            )
        return out

    async def _follow(self, addr: str) -> None:
        """Mount -> re-report -> follow this node's block events; again after a failure,
        for as long as that store-master is registered."""
        backoff = 0.2
        while True:
            try:
                stub = self.stub(addr)
                master_id = ""
                if not self.track:
                    master_id = (await stub.StoreHello(pb.StoreHelloRequest(), timeout=5)).master_id
                self.epoch += 1
                await stub.MountSegment(
                    pb.MountSegmentRequest(
                        node_id=self.node_id,
                        data_address=self.te.address,
                        region_id=self.region,
                        size=self.size,
                        grpc_address=self.grpc_address,
                        ssd_bytes=self.ssd.capacity if self.ssd else 0,
                    ),
                    timeout=5,
                )
                self.mounted.set()
                if not self.track:
                    log.info("lent %d bytes (untracked) to store-master %s", self.size, addr)
                    backoff = 0.2
                    while (
                        await stub.StoreHello(pb.StoreHelloRequest(), timeout=5)
                    ).master_id == master_id:
                        await asyncio.sleep(1.0)
                    log.info("store-master %s restarted: re-mounting", addr)
                    continue
                recs = await asyncio.to_thread(self.records)
                if recs:
                    r = await stub.ReportBlocks(
                        pb.ReportBlocksRequest(node_id=self.node_id, blocks=recs), timeout=30
                    )
                    log.info(
                        "re-reported %d block(s) to %s (%d rejected)", r.accepted, addr, r.rejected
                    )
                log.info("lent %d bytes to store-master %s", self.size, addr)
                backoff = 0.2
                stream = stub.WatchBlocks(
                    pb.WatchBlocksRequest(
                        node_id=self.node_id,
                        snapshot=True,
                        coalesce=True,
                        coalesce_ms=INDEX_EVENT_LAG_MS,
                    )
                )
                async for msg in stream:
                    for ev in (msg, *msg.more) if msg.more else (msg,):
                        if ev.master_id != self.master_id:
                            self.master_id = ev.master_id
                        if ev.tier == "dram":
                            await self._apply(ev)
                        elif ev.type == "removed" and self.ssd is not None:
                            self.ssd.discard(bytes(ev.hash))  # removed or evicted from disk
            except asyncio.CancelledError:
                raise
            except grpc.aio.AioRpcError as e:
                log.warning("store-master %s: %s; retrying", addr, e.code())
            except Exception:
                # this loop must outlive any one failure (else the segment silently stops
                # being lent to that master): log the bug and mount again after backoff
                log.exception("store-master %s: segment loop failed; retrying", addr)
            await asyncio.sleep(backoff)
            backoff = min(backoff * 2, 2.0)

    async def _apply(self, ev: pb.BlockEvent) -> None:
        h = bytes(ev.hash)
        if ev.type == "removed":
            cur = self.index.get(h)
            if cur and cur[0] == ev.offset:
                self._forget(h)
            return
        if ev.offset + ev.size > self.size:
            return
        other = self.by_offset.get(ev.offset)
        if other is not None and other != h:
            self._forget(other)
        data = self.view[ev.offset : ev.offset + ev.size]
        crc = digest(data) if ev.size < DIGEST_THREAD_MIN else await asyncio.to_thread(digest, data)
        self.index[h] = (ev.offset, ev.size, crc)
        self.by_offset[ev.offset] = h

    def _forget(self, h: bytes) -> None:
        cur = self.index.pop(h, None)
        if cur and self.by_offset.get(cur[0]) == h:
            del self.by_offset[cur[0]]

    async def close(self) -> None:
        for t in self._masters.values():
            t.cancel()
        self._masters.clear()
        for ch in self._channels.values():
            await ch.close()


class StoreSegmentServicer(pbg.StoreSegmentServicer):
    """The store-master's hands on this node's segment: spill, promote, replicate."""

    def __init__(self, host: SegmentHost) -> None:
        self.host = host

    def _range(self, r: pb.BlockRecord) -> memoryview | None:
        if r.offset + r.size > self.host.size or r.size == 0:
            return None
        return self.host.view[r.offset : r.offset + r.size]

    async def Spill(self, req, context):
        h = self.host
        if h.ssd is None:
            return pb.SpillResponse()

        def work():
            spilled, dropped = [], []
            for r in req.blocks:
                mv = self._range(r)
                if mv is None:
                    continue
                try:
                    dropped.extend(h.ssd.write(bytes(r.hash), mv))
                except OSError as e:
                    log.warning("spill of %s failed: %s", r.hash.hex()[:16], e)
                    continue
                if bytes(r.hash) in h.ssd.files:
                    spilled.append(r.hash)
            return spilled, dropped

        spilled, dropped = await asyncio.to_thread(work)
        return pb.SpillResponse(spilled=spilled, dropped=dropped)

    async def Promote(self, req, context):
        h = self.host
        if h.ssd is None:
            return pb.PromoteResponse()

        def work():
            return [
                r.hash
                for r in req.blocks
                if (mv := self._range(r)) is not None and h.ssd.read_into(bytes(r.hash), mv)
            ]

        return pb.PromoteResponse(promoted=await asyncio.to_thread(work))

    async def Replicate(self, req, context):
        h = self.host
        by_peer: dict[str, list[tuple[bytes, Slice]]] = {}
        for src, off in zip(req.sources, req.offsets):
            if off + src.size > h.size:
                continue
            by_peer.setdefault(src.data_address, []).append(
                (src.hash, Slice(h.region, off, src.region_id, src.offset, src.size))
            )
        copied = []
        for peer, items in by_peer.items():
            try:
                await h.te.read(peer, [s for _, s in items])
                copied.extend(k for k, _ in items)
            except (TransferError, OSError) as e:
                log.warning("replicating from %s failed: %s", peer, e)
        return pb.ReplicateResponse(copied=copied)
