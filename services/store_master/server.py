"""store-master: the metadata service of the cluster KV store (Mooncake Store).

A block's life through it:
  1. a node lends DRAM: ``MountSegment`` (its transfer-engine address and region);
  2. a writer calls ``PutStart`` with block hashes -> each absent hash gets a PENDING
     placement (segment, offset), local-first then most-free;
  3. the writer moves the bytes with the transfer engine, then ``PutEnd`` -> COMPLETE;
     a put that never ends is reclaimed after ``put_timeout_s``;
  4. readers call ``Exists`` (longest present prefix) or ``GetReplicas`` (placements of
     the longest present prefix, under a read lease) and read with the transfer engine;
  5. blocks leave by ``Remove``, by LRU eviction past the high watermark (never leased or
     pending ones), or at once when their node's etcd lease ends (watched membership).
"""

from __future__ import annotations

import asyncio
import json
import logging
import time
from dataclasses import dataclass

import grpc

from protos import kvmesh_pb2 as pb
from protos import kvmesh_pb2_grpc as pbg
from services.common.config import ConfigError, load, option
from services.common.registry import Membership, nodes_prefix
from services.common.service import Service, run, setup_logging
from services.common.settings import ServiceConfig
from services.store_master.metadata import Block, StoreMetadata

log = logging.getLogger(__name__)

MAX_HASHES = 65536
HASH_LEN = 16


@dataclass
class StoreMasterConfig(ServiceConfig):
    """store-master: metadata of the cluster KV block store."""

    lease_ms: int = option(10000, "read lease granted with replica locations, in ms")
    put_timeout_s: float = option(30.0, "a put not ended within this is reclaimed")
    high_watermark: float = option(0.9, "eviction starts above this fraction of capacity")
    low_watermark: float = option(0.8, "eviction frees down to this fraction of capacity")

    def validate(self) -> None:
        super().validate()
        if self.lease_ms <= 0:
            raise ConfigError("lease_ms: must be > 0")
        if not 0 < self.low_watermark < self.high_watermark <= 1:
            raise ConfigError("watermarks: need 0 < low_watermark < high_watermark <= 1")


def _check_hashes(hashes, context_name: str) -> str | None:
    if len(hashes) > MAX_HASHES:
        return f"{context_name}: at most {MAX_HASHES} hashes per call, got {len(hashes)}"
    for h in hashes:
        if len(h) != HASH_LEN:
            return f"{context_name}: every hash must be {HASH_LEN} bytes, got {len(h)}"
    return None


def _placement(b: Block) -> pb.Placement:
    s = b.segment
    return pb.Placement(hash=b.hash, data_address=s.data_address, region_id=s.region_id,
                        offset=b.offset, size=b.size, node_id=s.node_id)


class StoreMasterServicer(pbg.StoreMasterServicer):
    """gRPC face of :class:`StoreMetadata`; every call is short and in-memory."""

    def __init__(self, meta: StoreMetadata) -> None:
        self.meta = meta

    async def MountSegment(self, req, context):
        if not req.node_id or not req.data_address or req.size <= 0:
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT,
                                "MountSegment needs node_id, data_address and size > 0")
        seg = self.meta.mount(req.node_id, req.data_address, req.region_id, req.size)
        log.info("mounted segment %s (%d bytes at %s)", seg.segment_id, seg.size, seg.data_address)
        return pb.MountSegmentResponse(segment_id=seg.segment_id)

    async def UnmountSegment(self, req, context):
        segs, blocks = self.meta.unmount_node(req.node_id)
        return pb.UnmountSegmentResponse(segments=segs, blocks_dropped=blocks)

    async def PutStart(self, req, context):
        if err := _check_hashes(req.hashes, "PutStart"):
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, err)
        if req.size <= 0:
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, "PutStart: size must be > 0")
        placed, skipped = self.meta.put_start(req.node_id, list(req.hashes), req.size)
        return pb.PutStartResponse(placements=[_placement(b) for b in placed],
                                   already_present=skipped)

    async def PutEnd(self, req, context):
        if err := _check_hashes(req.hashes, "PutEnd"):
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, err)
        return pb.PutEndResponse(committed=self.meta.put_end(list(req.hashes), req.abort))

    async def GetReplicas(self, req, context):
        if err := _check_hashes(req.hashes, "GetReplicas"):
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, err)
        blocks, until = self.meta.get_replicas(list(req.hashes))
        expires_ms = int((time.time() + (until - self.meta.clock())) * 1000)
        return pb.GetReplicasResponse(replicas=[_placement(b) for b in blocks],
                                      lease_expires_unix_ms=expires_ms)

    async def Exists(self, req, context):
        if err := _check_hashes(req.hashes, "Exists"):
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, err)
        return pb.ExistsResponse(prefix_blocks=len(self.meta.prefix(list(req.hashes))))

    async def Remove(self, req, context):
        if err := _check_hashes(req.hashes, "Remove"):
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, err)
        return pb.RemoveResponse(removed=self.meta.remove(list(req.hashes)))

    async def Stats(self, req, context):
        m = self.meta
        return pb.StoreStatsResponse(blocks=len(m.blocks), bytes_used=m.used,
                                     bytes_total=m.capacity, segments=len(m.segments),
                                     evictions=m.evictions)


class StoreMaster(Service):
    role = "store-master"

    def __init__(self, cfg: StoreMasterConfig) -> None:
        super().__init__(cfg)
        self.meta = StoreMetadata(lease_s=cfg.lease_ms / 1000, put_timeout_s=cfg.put_timeout_s,
                                  high_watermark=cfg.high_watermark,
                                  low_watermark=cfg.low_watermark)
        self.membership = Membership(self.etcd, nodes_prefix(cfg.cluster))
        self._reaper: asyncio.Task | None = None

    async def setup(self) -> None:
        pbg.add_StoreMasterServicer_to_server(StoreMasterServicer(self.meta), self.server)

    async def after_start(self) -> None:
        self.membership.add_listener(self._on_member)
        await self.membership.start()
        self._reaper = asyncio.create_task(self._reap())

    def _on_member(self, event: str, key: str, value: bytes | None) -> None:
        if event != "leave":
            return
        node_id = key.rsplit("/", 1)[-1]
        segs, blocks = self.meta.unmount_node(node_id)
        if segs:
            log.info("node %s left: dropped %d segment(s), %d block(s)", node_id, segs, blocks)

    async def _reap(self) -> None:
        while True:
            await asyncio.sleep(1.0)
            if n := self.meta.reclaim_abandoned():
                log.info("reclaimed %d abandoned put(s)", n)

    async def teardown(self) -> None:
        if self._reaper:
            self._reaper.cancel()
        await self.membership.stop()


def main(argv: list[str] | None = None) -> None:
    cfg = load(StoreMasterConfig, argv, prog="kvmesh store-master", section="store-master")
    setup_logging(cfg.log_level, "store-master")
    run(lambda: StoreMaster(cfg))
