"""Keeps the scheduler's node states and cache index current: one state per live model
node (from its etcd registration and start-up profile) and one WatchEvents stream per
node (cache events, load reports, observed timings), restarted while the node lives."""

from __future__ import annotations

import asyncio
import logging
import statistics
from collections.abc import Callable

import grpc

from kvmesh.protos import kvmesh_pb2 as pb
from kvmesh.protos import kvmesh_pb2_grpc as pbg
from kvmesh.services.conductor.cluster import ClusterView, NodeInfo
from kvmesh.services.conductor.policy import DecodeNodeState, PrefillNodeState, Scheduler

log = logging.getLogger(__name__)


class NodeFeeds:
    def __init__(self, view: ClusterView, sched: Scheduler, interval_ms: float = 200) -> None:
        self.view = view
        self.sched = sched
        self.interval_ms = interval_ms
        self._tasks: dict[str, asyncio.Task] = {}
        self.fingerprint_of: dict[str, str] = {}
        self.store_live = False
        # per prefill node: a moving average of its observed prefill times (every
        # conductor's requests), the cost of each other conductor's request it queues
        self.prefill_ms: dict[str, float] = {}
        # called with a decode node's id after each of its load reports (requests
        # waiting for KV room there look again: the report may show the room)
        self.on_report: Callable[[str], None] | None = None

    def on_member(self, event: str, key: str, value: bytes | None) -> None:
        parts = key.rstrip("/").split("/")
        role, node_id = parts[-2], parts[-1]
        if role == "store-master":
            self._store_member(event, node_id)
            return
        if role not in ("prefill", "decode"):
            return
        if event == "leave":
            self._drop(node_id)
            return
        info = next((n for n in self.view.nodes(role) if n.node_id == node_id), None)
        if info is None:
            return
        if event == "update" and node_id in self._tasks:
            return  # same node, refreshed registration: keep its learned state
        self._add(info)

    def _add(self, n: NodeInfo) -> None:
        raw = n.raw
        bs, profile = int(raw["block_size"]), raw.get("profile", {})
        if n.role == "prefill":
            p = PrefillNodeState(n.node_id, bs, int(raw["block_nbytes"]), int(raw["layer_nbytes"]))
            p.model.warm_start(profile.get("prefill", []))
            self.sched.prefill[n.node_id] = p
        else:
            kv = int(raw.get("kv_blocks", 0))
            d = DecodeNodeState(n.node_id, bs, kv, kv)
            d.model.warm_start(profile.get("decode", []))
            d.prefill_model.warm_start(profile.get("prefill", []))
            self.sched.decode[n.node_id] = d
        self.fingerprint_of[n.node_id] = n.fingerprint
        old = self._tasks.pop(n.node_id, None)
        if old:
            old.cancel()
        self._tasks[n.node_id] = asyncio.get_running_loop().create_task(self._follow(n))

    def _drop(self, node_id: str) -> None:
        self.sched.prefill.pop(node_id, None)
        self.sched.decode.pop(node_id, None)
        self.sched.index.drop_node(node_id)
        self.fingerprint_of.pop(node_id, None)
        self.prefill_ms.pop(node_id, None)
        task = self._tasks.pop(node_id, None)
        if task:
            task.cancel()

    async def _follow(self, n: NodeInfo) -> None:
        stub = self.view.prefill_stub(n) if n.role == "prefill" else self.view.decode_stub(n)
        backoff = 0.1
        while True:
            try:
                async for ev in stub.WatchEvents(
                    pb.WatchEventsRequest(interval_ms=self.interval_ms)
                ):
                    self._apply(n, ev)
                    backoff = 0.1
            except grpc.aio.AioRpcError as e:
                log.debug("event stream of %s ended (%s); retrying", n.node_id, e.code())
            await asyncio.sleep(backoff)
            backoff = min(2.0, backoff * 2)

    def _apply(self, n: NodeInfo, ev: pb.NodeEvent) -> None:
        idx = self.sched.index
        if ev.reset:
            idx.reset(n.node_id, ev.stored)
        else:
            if ev.stored:
                idx.stored(n.node_id, ev.stored)
            if ev.removed:
                idx.removed(n.node_id, ev.removed)
        load = ev.load
        bws = [bw / 1000.0 for bw in load.bandwidth_bytes_per_s.values() if bw > 0]
        st: PrefillNodeState | DecodeNodeState
        if n.role == "prefill":
            p = self.sched.prefill.get(n.node_id)
            if p is None:
                return
            avg = self.prefill_ms.get(n.node_id)
            for s in load.prefill_samples:
                p.model.observe(s.new_tokens, s.cached_tokens, s.ms)
                avg = s.ms if avg is None else 0.8 * avg + 0.2 * s.ms
            for f in load.store_fetches:
                p.store_fetch.observe(f.bytes, f.ms)
            if avg is not None:
                self.prefill_ms[n.node_id] = avg
            elif p.queue:  # nothing observed yet: our own requests' predicted mean
                avg = sum(p.queue.values()) / len(p.queue)
            p.report_queue(load.queue_depth + load.running, avg or 0.0)
            st = p
        else:
            d = self.sched.decode.get(n.node_id)
            if d is None:
                return
            for s in load.prefill_samples:
                d.prefill_model.observe(s.new_tokens, s.cached_tokens, s.ms)
            for s in load.decode_samples:
                d.model.observe(s.batch, s.kv_tokens, s.ms)
            d.report(load.kv_blocks_free, load.kv_blocks_total, load.reserves_seen)
            if self.on_report is not None:
                self.on_report(n.node_id)
            used = (load.kv_blocks_total - load.kv_blocks_free) * d.block_size
            d.report_queue(load.queue_depth + load.running, used)
            st = d
        if bws:
            st.bandwidth = statistics.median(bws)

    def _store_member(self, event: str, node_id: str) -> None:
        key = f"store-master/{node_id}"
        task = self._tasks.pop(key, None)
        if task:
            task.cancel()
        self.store_live = False
        if event != "leave":
            info = next((n for n in self.view.nodes("store-master") if n.node_id == node_id), None)
            if info is not None:
                self._tasks[key] = asyncio.get_running_loop().create_task(self._follow_store(info))

    async def _follow_store(self, n: NodeInfo) -> None:
        """Store replicas enter the index from the master's WatchBlocks stream; on every
        (re)connect the index's store side is rebuilt from the snapshot."""
        stub = pbg.StoreMasterStub(self.view.channel(n.grpc))
        idx = self.sched.index
        backoff = 0.1
        while True:
            try:
                stream = stub.WatchBlocks(pb.WatchBlocksRequest(snapshot=True, coalesce=True))
                idx.store_reset(())
                self.store_live = True
                async for msg in stream:
                    for ev in (msg, *msg.more) if msg.more else (msg,):  # coalesced events
                        if ev.type == "stored":
                            idx.store_stored((ev.hash,), ev.tier)
                        elif ev.type == "removed":
                            idx.store_removed((ev.hash,), ev.tier)
                    backoff = 0.1
            except grpc.aio.AioRpcError as e:
                log.debug("store event stream of %s ended (%s); retrying", n.node_id, e.code())
            self.store_live = False
            await asyncio.sleep(backoff)
            backoff = min(2.0, backoff * 2)

    async def close(self) -> None:
        for t in self._tasks.values():
            t.cancel()
        self._tasks.clear()
