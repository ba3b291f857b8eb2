"""store-master: the metadata service of the cluster KV store (Mooncake Store).

A block's life through it:
  1. a node lends DRAM: ``MountSegment`` (its transfer-engine address and region, its
     ``StoreSegment`` gRPC address and SSD-tier size); when the node's etcd lease ends,
     every replica on it leaves the metadata at once (watched membership);
  2. a writer calls ``PutStart`` with keys (16-byte block hashes, or any 1..256-byte
     keys with per-key ``sizes``) -> each absent key gets a PENDING DRAM placement,
     local-first, then the segment with the highest free ratio;
  3. the writer moves the bytes with the transfer engine, then ``PutEnd`` -> COMPLETE;
     ``failed`` lists keys whose placement vanished meanwhile (its node died, or the put
     ran past ``put_timeout_s`` and was reclaimed);
  4. readers call ``Exists`` (longest present prefix, or per key) or ``GetReplicas``
     (one placement per key under a read lease, default 10 s, its own node's replica
     first, else the least-loaded one). Blocks only on SSD are promoted into DRAM first
     (the owning node reads its file, checksum verified; a bad file is a miss).
     **Lease rule** (reader-checked): the reader computes its deadline as the time it
     *sent* GetReplicas plus ``lease_ms`` and treats a read that completes after it as
     a miss (recompute) - see :mod:`kvmesh.services.store.client`. Until the lease ends the
     master never evicts, spills or reuses the block's space;
  5. hot blocks (decayed read count over ``hot_reads`` within ``hot_window_s``) get
     another DRAM replica on another node, up to ``max_replicas``: the master asks the
     target node (``StoreSegment.Replicate``) to read the block with its transfer
     engine into a pending placement, then publishes it;
  6. blocks leave by ``Remove``, by LRU eviction from the high to the low watermark
     (never leased or in-flight ones; soft-pinned ones last) - spilled to the owning
     node's SSD tier (``StoreSegment.Spill``) when it has one, else dropped;
  7. every replica stored/removed is published on ``WatchBlocks`` (seq, node, tier).

Restart: the master keeps no disk state. Nodes keep an index of what their segment
holds (fed by ``WatchBlocks`` filtered to their node, checksummed), and when a
store-master joins they re-mount and ``ReportBlocks``; until then lookups miss and
nodes recompute.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import sys
import time
from collections.abc import Callable, Coroutine
from typing import Any

import grpc

from kvmesh.protos import kvmesh_pb2 as pb
from kvmesh.protos import kvmesh_pb2_grpc as pbg
from kvmesh.services.common import channels
from kvmesh.services.common.channels import make_channel
from kvmesh.services.common.config import load
from kvmesh.services.common.election import LeaderElection, leader_key
from kvmesh.services.common.interceptors import wrap_handler
from kvmesh.services.common.registry import Membership, node_key, nodes_prefix
from kvmesh.services.common.service import Service, run, setup_logging
from kvmesh.services.store_master.config import StoreMasterConfig
from kvmesh.services.store_master.events import EventBus, watch
from kvmesh.services.store_master.fastpath import FastPathServer, serve_fast_path
from kvmesh.services.store_master.metadata import DRAM, SSD, Block, Plan, Replica, StoreMetadata
from kvmesh.services.store_master.validation import (
    MAX_HASHES,
    biggest_segment,
    check_keys,
    check_put_sizes,
)

log = logging.getLogger(__name__)


def _placement(b: Block, r: Replica | None = None) -> pb.Placement:
    r = r or b.replicas[0]
    s = r.segment
    return pb.Placement(
        hash=b.hash,
        data_address=s.data_address,
        region_id=s.region_id,
        offset=r.offset,
        size=b.size,
        node_id=s.node_id,
        tier=r.tier,
    )


def _record(b: Block, r: Replica) -> pb.BlockRecord:
    return pb.BlockRecord(
        hash=b.hash, offset=r.offset, size=b.size, tier=r.tier, region_id=r.segment.region_id
    )


class StoreMasterServicer(pbg.StoreMasterServicer):
    """gRPC face of :class:`StoreMetadata`; metadata calls are short and in-memory, the
    data-moving steps (spill, promote, replicate) are RPCs to the owning nodes."""

    def __init__(self, meta: StoreMetadata, bus: EventBus | None = None) -> None:
        self.meta = meta
        self.bus = bus or EventBus()
        if meta.on_event is None:
            meta.on_event = self.bus.publish
        self._channels: dict[str, grpc.aio.Channel] = {}
        self._evicting: asyncio.Lock | None = None
        self._tasks: set[asyncio.Task] = set()
        self.fast_address = ""  # the raw-TCP control path, when it listens
        # why store calls are refused now ("" to serve them): set by a store-master
        # that campaigns, read by the fast path (the gRPC face has StandbyGate)
        self.refusal: Callable[[], str] | None = None

    # -- node side -----------------------------------------------------------------------
    def node_stub(self, addr: str) -> pbg.StoreSegmentStub:
        ch = self._channels.get(addr)
        if ch is None:
            ch = self._channels[addr] = make_channel(addr)
        return pbg.StoreSegmentStub(ch)

    async def close(self) -> None:
        for t in list(self._tasks):
            t.cancel()
        for ch in self._channels.values():
            await ch.close()

    def spawn(self, coro: Coroutine[Any, Any, Any]) -> None:
        """Runs ``coro`` as a task the servicer owns (cancelled by :meth:`close`)."""
        t = asyncio.get_running_loop().create_task(coro)
        self._tasks.add(t)
        t.add_done_callback(self._tasks.discard)

    async def run_eviction(self, extra: int = 0) -> None:
        """Evicts from above the high watermark down to the low one, spilling victims
        to their node's SSD tier where there is one. One eviction at a time."""
        if self._evicting is None:
            self._evicting = asyncio.Lock()
        async with self._evicting:
            m = self.meta
            if not m.over_high(extra):
                return
            # one call frees at most a segment's worth below the low watermark (a size
            # no segment can hold is refused before this)
            extra = min(extra, biggest_segment(m.segments.values()))
            plans = m.plan_eviction(max(0, int(m.low * m.capacity) - extra))
            by_node: dict[str, list[Plan]] = {}
            for p in plans:
                by_node.setdefault(p.replica.segment.grpc_address, []).append(p)
            await asyncio.gather(*(self._spill(addr, ps) for addr, ps in by_node.items()))

    async def _spill(self, addr: str, plans: list[Plan]) -> None:
        spilled: set[bytes] = set()
        dropped: list[bytes] = []
        try:
            resp = await self.node_stub(addr).Spill(
                pb.SpillRequest(blocks=[_record(p.block, p.replica) for p in plans]), timeout=10
            )
            spilled, dropped = set(resp.spilled), list(resp.dropped)
        except grpc.aio.AioRpcError as e:
            log.warning("spill to %s failed (%s): dropping %d block(s)", addr, e.code(), len(plans))
        for i, p in enumerate(plans):
            self.meta.finish_spill(p, p.block.hash in spilled, dropped if i == 0 else ())

    async def _copy(self, plans: list[Plan], what: str) -> None:
        """Runs promote or replicate plans, batched per target node."""
        by_node: dict[str, list[Plan]] = {}
        for p in plans:
            by_node.setdefault(p.replica.segment.grpc_address, []).append(p)

        async def one(addr: str, ps: list[Plan]) -> None:
            ok: set[bytes] = set()
            try:
                stub = self.node_stub(addr)
                if what == "promote":
                    resp = await stub.Promote(
                        pb.PromoteRequest(blocks=[_record(p.block, p.replica) for p in ps]),
                        timeout=10,
                    )
                    ok = set(resp.promoted)
                else:
                    resp = await stub.Replicate(
                        pb.ReplicateRequest(
                            sources=[_placement(p.block, p.source) for p in ps],
                            offsets=[p.replica.offset for p in ps],
                        ),
                        timeout=30,
                    )
                    ok = set(resp.copied)
            except grpc.aio.AioRpcError as e:
                log.warning("%s on %s failed: %s", what, addr, e.code())
            for p in ps:
                self.meta.finish_plan(p, p.block.hash in ok)

        await asyncio.gather(*(one(a, ps) for a, ps in by_node.items()))

    # -- RPCs ----------------------------------------------------------------------------
    async def MountSegment(self, req, context):
        if not req.node_id or not req.data_address or req.size <= 0:
            await context.abort(
                grpc.StatusCode.INVALID_ARGUMENT,
                "MountSegment needs node_id, data_address and size > 0",
            )
        seg = self.meta.mount(
            req.node_id, req.data_address, req.region_id, req.size, req.grpc_address, req.ssd_bytes
        )
        log.info(
            "mounted segment %s (%d bytes at %s, ssd %d)",
            seg.segment_id,
            seg.size,
            seg.data_address,
            seg.ssd_bytes,
        )
        return pb.MountSegmentResponse(segment_id=seg.segment_id)

    async def UnmountSegment(self, req, context):
        segs, blocks = self.meta.unmount_node(req.node_id)
        return pb.UnmountSegmentResponse(segments=segs, blocks_dropped=blocks)

    async def ReportBlocks(self, req, context):
        by_region: dict[int, list] = {}
        for r in req.blocks:
            by_region.setdefault(r.region_id, []).append(
                (bytes(r.hash), r.offset, r.size, r.tier or DRAM)
            )
        ok = bad = 0
        for region, recs in by_region.items():
            a, b = self.meta.report(req.node_id, region, recs)
            ok, bad = ok + a, bad + b
        log.info("node %s re-reported %d block(s) (%d rejected)", req.node_id, ok, bad)
        return pb.ReportBlocksResponse(accepted=ok, rejected=bad)

    async def PutStart(self, req, context):
        if err := check_keys(req.hashes, "PutStart"):
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, err)
        sizes = list(req.sizes)
        if sizes and len(sizes) != len(req.hashes):
            await context.abort(
                grpc.StatusCode.INVALID_ARGUMENT, "PutStart: sizes must have one entry per key"
            )
        biggest = biggest_segment(self.meta.segments.values())
        if err := check_put_sizes(sizes or [req.size], biggest, "PutStart"):
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, err)
        total = sum(sizes) if sizes else req.size * len(req.hashes)
        if self.meta.over_high(total):
            await self.run_eviction(total)
        placed, skipped = self.meta.put_start(req.node_id, list(req.hashes), sizes or req.size)
        return pb.PutStartResponse(
            placements=[_placement(b) for b in placed], already_present=skipped
        )

    async def PutEnd(self, req, context):
        if err := check_keys(req.hashes, "PutEnd"):
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, err)
        done, failed = self.meta.put_end_detail(list(req.hashes), req.abort)
        return pb.PutEndResponse(committed=len(done), failed=[] if req.abort else failed)

    async def GetReplicas(self, req, context):
        if err := check_keys(req.hashes, "GetReplicas"):
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, err)
        m = self.meta
        hashes = list(req.hashes)
        # blocks present only on SSD are promoted into DRAM before the answer
        if cand := self.needs_promotion(hashes, req.any_order):
            await self.promote(cand)
        got, until = self.get_now(hashes, req.node_id, req.any_order)
        expires_ms = int((time.time() + (until - m.clock())) * 1000)
        return pb.GetReplicasResponse(
            replicas=[_placement(b, r) for b, r in got],
            lease_expires_unix_ms=expires_ms,
            lease_ms=int(m.lease_s * 1000),
        )

    # -- the hot calls' cores, shared by gRPC and the raw-TCP path (its ``Backend``) ------
    def needs_promotion(self, hashes: list[bytes], any_order: bool) -> list[Block]:
        """The candidate blocks when one of them is only on SSD (promote first), else []."""
        m = self.meta
        if any_order:
            cand = [b for h in hashes if (b := m.blocks.get(h)) is not None]
        else:
            cand = m.prefix(hashes, (DRAM, SSD))
        return cand if any(not b.complete(DRAM) for b in cand) else []

    async def promote(self, cand: list[Block]) -> None:
        """Copies the SSD-only blocks among ``cand`` back into DRAM (on their own node)."""
        if plans := self.meta.plan_promotions(cand):
            await self._copy(plans, "promote")

    def get_now(
        self, hashes: list[bytes], node_id: str, any_order: bool
    ) -> tuple[list[tuple[Block, Replica]], float]:
        """GetReplicas on what is in DRAM now: ([(block, replica to read)], lease end on
        the metadata clock); starts replicating blocks that turned hot."""
        m = self.meta
        got, until = m.get_replicas(hashes, node_id, any_order)
        if m.max_replicas > 1 and got:
            if plans := m.plan_replications(b for b, _ in got):
                self.spawn(self._copy(plans, "replicate"))
        return got, until

    def _put_local_now(self, req) -> pb.PutLocalResponse:
        status, reserved = self.put_local_plain(
            req.node_id,
            req.region_id,
            zip(req.hashes, req.offsets, req.sizes),
            req.reserve_size,
            req.reserve_count,
            req.reserve_spare,
            zip(req.release_offsets, req.release_sizes),
        )
        return pb.PutLocalResponse(status=status, reserved=reserved)

    def put_local_plain(
        self, node: str, region: int, items, rsize: int, rcount: int, rspare: int, release=()
    ) -> tuple[list[int], list[int]]:
        """PutLocal on plain values (the raw-TCP path skips protobuf): releases, commits
        (key, offset, size) items, reserves; returns (status per item, reserved)."""
        m = self.meta
        if release:
            m.release_reserved(node, region, release)
        status = m.commit_local(node, region, items)
        reserved = []
        if rsize and (rcount or rspare):
            reserved = m.reserve(node, region, rsize, rcount, rspare)
        return status, reserved

    @staticmethod
    def _put_local_error(req) -> str | None:
        if err := check_keys(req.hashes, "PutLocal"):
            return err
        if not len(req.hashes) == len(req.offsets) == len(req.sizes):
            return "PutLocal: offsets and sizes must have one entry per key"
        if len(req.release_offsets) != len(req.release_sizes):
            return "PutLocal: release_offsets and release_sizes must pair up"
        if req.reserve_count + req.reserve_spare > MAX_HASHES:
            return f"PutLocal: at most {MAX_HASHES} slots per call"
        return None

    async def PutLocal(self, req, context):
        if err := self._put_local_error(req):
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, err)
        if req.reserve_count and self.meta.over_high(req.reserve_size * req.reserve_count):
            await self.run_eviction(req.reserve_size * req.reserve_count)
        return self._put_local_now(req)

    async def StoreHello(self, req, context):
        return pb.StoreHelloResponse(
            master_id=self.bus.master_id,
            lease_ms=int(self.meta.lease_s * 1000),
            fast_address=self.fast_address,
        )

    async def Exists(self, req, context):
        if err := check_keys(req.hashes, "Exists"):
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, err)
        hashes = list(req.hashes)
        if req.any_order:
            present = self.meta.present(hashes)
            n = next((i for i, p in enumerate(present) if not p), len(present))
            return pb.ExistsResponse(prefix_blocks=n, present=present)
        return pb.ExistsResponse(prefix_blocks=len(self.meta.prefix(hashes)))

    async def Remove(self, req, context):
        if err := check_keys(req.hashes, "Remove"):
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, err)
        return pb.RemoveResponse(removed=self.meta.remove(list(req.hashes)))

    async def Pin(self, req, context):
        if err := check_keys(req.hashes, "Pin"):
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, err)
        return pb.PinResponse(pinned=self.meta.pin(list(req.hashes), True))

    async def Unpin(self, req, context):
        if err := check_keys(req.hashes, "Unpin"):
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, err)
        return pb.PinResponse(pinned=self.meta.pin(list(req.hashes), False))

    async def WatchBlocks(self, req, context):
        async with contextlib.aclosing(watch(self.bus, self.meta.blocks, req)) as events:
            async for ev in events:
                yield ev

    async def Stats(self, req, context):
        m = self.meta
        replicas = sum(len(b.complete(None)) for b in m.blocks.values())
        ssd = sum(1 for b in m.blocks.values() if b.complete(SSD))
        return pb.StoreStatsResponse(
            blocks=sum(1 for b in m.blocks.values() if b.visible),
            bytes_used=m.used,
            bytes_total=m.capacity,
            segments=len(m.segments),
            evictions=m.evictions,
            replicas=replicas,
            ssd_blocks=ssd,
            spills=m.stats["spills"],
            promotions=m.stats["promotions"],
            replications=m.stats["replications"],
            pinned=len(m.pins),
            puts_reclaimed=m.stats["puts_reclaimed"],
        )


class StoreMaster(Service):
    role = "store-master"
    cfg: StoreMasterConfig

    def __init__(self, cfg: StoreMasterConfig) -> None:
        super().__init__(cfg)
        self.meta = StoreMetadata(
            lease_s=cfg.lease_ms / 1000,
            put_timeout_s=cfg.put_timeout_s,
            high_watermark=cfg.high_watermark,
            low_watermark=cfg.low_watermark,
            hot_reads=cfg.hot_reads,
            hot_window_s=cfg.hot_window_s,
            max_replicas=cfg.max_replicas,
        )
        self.servicer = StoreMasterServicer(self.meta)
        self.membership = Membership(self.etcd, nodes_prefix(cfg.cluster))
        self._reaper: asyncio.Task | None = None
        self._fast: FastPathServer | None = None  # the raw-TCP control path, when it listens
        self.election: LeaderElection | None = None
        self.lost_leadership = False
        self.servicer.refusal = self.standby_refusal

    def standby_refusal(self) -> str:
        """Why store calls are refused now: this store-master does not lead ("" only
        while it leads). Before it campaigns (its server listens before it registers)
        leadership is unknown: refused too, or a standby-to-be would serve from its own
        empty metadata."""
        election = self.election
        if election is None:
            return (
                f"store-master {self.node_id} is starting and has not joined the leader "
                f"election yet: retry shortly, or call the leader registered in etcd"
            )
        if election.leading.is_set():
            return ""
        leader = election.leader
        if leader == election.value:  # it led, and its keepalives stopped reaching etcd
            return (
                f"store-master {self.node_id} has lost contact with etcd and stood down "
                f"(its lease may have lapsed; etcd key {election.key}): call the leader "
                f"registered in etcd"
            )
        who = json.loads(leader).get("grpc", "?") if leader else "not elected yet"
        return (
            f"store-master {self.node_id} is a standby; the leader is {who} "
            f"(etcd key {election.key}): call the leader"
        )

    def server_interceptors(self) -> list:
        return [StandbyGate(self)]

    async def register(self) -> None:
        """Campaigns for leadership (see :mod:`kvmesh.services.common.election`): only
        the leader's node key exists, so stores, nodes and the conductor follow it; a
        standby serves gRPC (health included) but refuses store calls until it leads."""
        cluster = self.cfg.cluster
        self.election = LeaderElection(
            self.etcd,
            leader_key(cluster, self.role),
            node_key(cluster, self.role, self.node_id),
            self._info_bytes(),
            ttl=self.cfg.lease_ttl,
            on_lead=self._on_lead,
            on_lost=self._on_lost,
        )
        self.registration = self.election
        await self.election.start()

    def _on_lead(self) -> None:
        log.info("store-master %s leads; nodes mount and re-report to it", self.node_id)

    def _on_lost(self) -> None:
        # another store-master leads: its metadata, not ours, describes the segments now
        log.error("store-master %s lost the leadership; exiting", self.node_id)
        self.lost_leadership = True
        self.request_stop()

    async def setup(self) -> None:
        pbg.add_StoreMasterServicer_to_server(self.servicer, self.server)
        # before the gRPC port opens, so every StoreHello already advertises it
        if self.cfg.fast_path:
            try:
                self._fast, self.servicer.fast_address = await serve_fast_path(
                    self.servicer,
                    self.cfg.host,
                    self.cfg.fast_port,
                    self.cfg.fast_poll_us,
                    channels.ssl_server_context(),  # TLS as gRPC has it: same cert and CA
                    self.cfg.fast_max_conns,
                    self.cfg.fast_max_handshakes,
                )
            except OSError:
                raise channels.bind_error(
                    f"{self.cfg.host}:{self.cfg.fast_port}",
                    "the raw-TCP control path",
                    "--fast-port",
                ) from None
            log.info(
                "raw-TCP control path on %s%s",
                self.servicer.fast_address,
                " (TLS)" if self._fast.ssl is not None else "",
            )

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
        """Reclaims abandoned puts and keeps DRAM use under the high watermark."""
        tick = 0
        while True:
            await asyncio.sleep(0.2)
            tick += 1
            try:
                if tick % 5 == 0 and (n := self.meta.reclaim_abandoned()):
                    log.info("reclaimed %d abandoned put(s)", n)
                if self.meta.over_high():
                    await self.servicer.run_eviction()
            except Exception:
                # the maintenance loop must never die (puts would never be reclaimed nor
                # DRAM kept under the watermark): log the bug and go on with the next tick
                log.exception("store maintenance failed")

    async def teardown(self) -> None:
        if self._reaper:
            self._reaper.cancel()
        if self._fast is not None:
            self._fast.close()
        await self.membership.stop()
        for node, q in list(self.servicer.bus.subs):
            self.servicer.bus.cut(node, q)
        await self.servicer.close()


class StandbyGate(grpc.aio.ServerInterceptor):
    """A standby store-master refuses every store call with UNAVAILABLE naming the
    leader (health and reflection still answer: it is alive and ready to take over)."""

    def __init__(self, master: StoreMaster) -> None:
        self.master = master

    async def intercept_service(self, continuation, details):
        handler = await continuation(details)
        if handler is None or not details.method.startswith("/kvmesh.v1.StoreMaster/"):
            return handler
        message = self.master.standby_refusal()
        if not message:
            return handler

        @contextlib.asynccontextmanager
        async def refuse(ctx):
            await ctx.abort(grpc.StatusCode.UNAVAILABLE, message)
            yield  # pragma: no cover - abort raises

        return wrap_handler(handler, refuse, request_deserializer=None)


def main(argv: list[str] | None = None) -> None:
    cfg = load(StoreMasterConfig, argv, prog="kvmesh store-master", section="store-master")
    setup_logging(cfg.log_level, "store-master")
    made: list[StoreMaster] = []

    def build() -> StoreMaster:
        made.append(StoreMaster(cfg))
        return made[-1]

    run(build)
    if made and made[-1].lost_leadership:
        sys.exit("store-master: another store-master leads now; restart this one as a standby")
