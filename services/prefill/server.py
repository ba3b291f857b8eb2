"""prefill-node: computes a request's prompt KV once and hands it to a decode node.

A request's life here (``Prefill`` RPC):
  1. queued: waits for the compute worker (``queue_depth`` counts the waiters);
  2. prefix: the longest run of its block hashes found in this node's pool (prefix
     cache, confirmed by token ids), then the next run fetched from the cluster store
     (``GetReplicas`` under a read lease, read with the transfer engine); any failure
     there means "recompute", never an error;
  3. handoff of the prefix: cached/fetched blocks are written whole into the decode
     node's reserved blocks at once;
  4. prefill: only the new tokens are computed; as each layer finishes, that layer of
     every new block is written to the decode node while the next layer computes;
  5. done: all writes land, then an ordered ``notify`` tells the decode node the KV is
     complete; the first token is sampled and returned;
  6. background: the new full blocks enter the local prefix cache and are put into the
     store (``PutStart`` -> transfer-engine write -> ``PutEnd``), off the TTFT path.
"""

from __future__ import annotations

import asyncio
import logging
import time
from dataclasses import dataclass

import grpc
import torch

from protos import kvmesh_pb2 as pb
from protos import kvmesh_pb2_grpc as pbg
from rdma import Slice, TransferError
from services.common.config import load
from services.common.model_node import ModelNode
from services.common.service import run, setup_logging
from services.common.settings import NodeConfig
from services.engine.sampling import Sampling, sample

log = logging.getLogger(__name__)


@dataclass
class PrefillConfig(NodeConfig):
    """prefill-node: runs (incremental) prefill and streams KV to decode nodes."""


class PrefillServicer(pbg.PrefillNodeServicer):
    def __init__(self, node: "PrefillNode") -> None:
        self.node = node

    async def Prefill(self, req, context):
        if err := self.node.check(req):
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, err)
        try:
            return await self.node.prefill(req)
        except TransferError as e:
            await context.abort(grpc.StatusCode.UNAVAILABLE,
                                f"KV handoff to decode node {req.target.node_id} failed: {e}")

    async def Status(self, req, context):
        return self.node.status(queue_depth=self.node.queue_depth)


class PrefillNode(ModelNode):
    role = "prefill"

    def __init__(self, cfg: PrefillConfig) -> None:
        super().__init__(cfg)
        self.compute = asyncio.Lock()
        self.queue_depth = 0
        self.background: set[asyncio.Task] = set()

    async def setup(self) -> None:
        await super().setup()
        pbg.add_PrefillNodeServicer_to_server(PrefillServicer(self), self.server)

    def check(self, req: pb.PrefillRequest) -> str | None:
        n, bs = len(req.token_ids), self.cfg.block_size
        if n == 0:
            return "Prefill: token_ids is empty"
        if n > self.model_config.max_position_embeddings:
            return f"Prefill: {n} tokens exceed the model context"
        if any(t < 0 or t >= self.model_config.vocab_size for t in req.token_ids):
            return f"Prefill: token ids must be in [0, {self.model_config.vocab_size})"
        if len(req.block_hashes) > n // bs:
            return "Prefill: more block hashes than full blocks"
        t = req.target
        if len(t.block_ids) < -(-n // bs) or t.block_nbytes != self.pool.block_nbytes:
            return "Prefill: target has too few blocks or another KV layout"
        return Sampling.from_proto(req.sampling).validate(self.model_config.vocab_size)

    async def prefill(self, req: pb.PrefillRequest) -> pb.PrefillResponse:
        t0 = time.perf_counter()
        self.queue_depth += 1
        waiting = True
        try:
            async with self.compute:
                self.queue_depth -= 1
                waiting = False
                return await self._prefill_locked(req, (time.perf_counter() - t0) * 1000)
        finally:
            if waiting:
                self.queue_depth -= 1

    async def _prefill_locked(self, req: pb.PrefillRequest, queue_ms: float) -> pb.PrefillResponse:
        pool, bs = self.pool, self.cfg.block_size
        tokens = list(req.token_ids)
        n = len(tokens)
        hashes = list(req.block_hashes)
        blocks_tokens = [tuple(tokens[i * bs:(i + 1) * bs]) for i in range(len(hashes))]
        usable = min(len(hashes), (n - 1) // bs)  # leave >= 1 token to compute logits from
        t0 = time.perf_counter()

        local = pool.match(hashes[:usable], blocks_tokens[:usable])
        fetched = await self._fetch(hashes[:usable], blocks_tokens[:usable], len(local))
        prefix = local + fetched
        table: list[int] = []
        try:
            table = prefix + pool.allocate(-(-n // bs) - len(prefix))
        except Exception:
            pool.free(prefix)
            raise
        start = len(prefix) * bs
        target = req.target
        transfers = []
        try:
            if prefix:
                transfers.append(self.te.write(target.data_address, [
                    Slice(self.pool_region, pool.block_offset(table[i]), target.region_id,
                          target.block_ids[i] * target.block_nbytes, pool.block_nbytes)
                    for i in range(len(prefix))]))
            loop = asyncio.get_running_loop()

            def send_layer(layer: int) -> None:
                transfers.append(self.te.write(target.data_address, [
                    Slice(self.pool_region, pool.layer_offset(table[i], layer),
                          target.region_id,
                          target.block_ids[i] * target.block_nbytes + layer * pool.layer_nbytes,
                          pool.layer_nbytes)
                    for i in range(len(prefix), len(table))]))

            new = torch.tensor(tokens[start:], dtype=torch.long)
            logits = await asyncio.to_thread(
                self.model.forward_prefill, new, start, pool, table,
                lambda layer: loop.call_soon_threadsafe(send_layer, layer))
            await asyncio.sleep(0)  # run the layer callbacks queued before the result
            first = sample(logits, Sampling.from_proto(req.sampling), step=0)
            for tr in transfers:
                await tr
            await self.te.notify(target.data_address, b"kv:" + req.request_id.encode())
        except BaseException:
            pool.free(table)
            raise
        prefill_ms = (time.perf_counter() - t0) * 1000

        for i in range(len(prefix), len(hashes)):
            pool.insert(hashes[i], table[i], blocks_tokens[i],
                        parent_hash=hashes[i - 1] if i else None)
        c = self.counters
        c["computed"] += n - start
        c["cached"] += len(local) * bs
        c["fetched"] += len(fetched) * bs
        to_put = list(range(len(prefix), len(hashes)))
        if to_put and self.store_stub() is not None:
            keep = [table[i] for i in to_put]
            pool.ref(keep)
            task = asyncio.create_task(self._put([hashes[i] for i in to_put], keep))
            self.background.add(task)
            task.add_done_callback(self.background.discard)
        pool.free(table)
        return pb.PrefillResponse(first_token=first, computed_tokens=n - start,
                                  cached_tokens=len(local) * bs,
                                  fetched_tokens=len(fetched) * bs,
                                  prefill_ms=prefill_ms, queue_ms=queue_ms)

    async def _fetch(self, chain: list[bytes], chain_tokens: list[tuple], have: int) -> list[int]:
        """Pulls the longest present run of ``chain[have:]`` from the store into new pool
        blocks; returns their ids (referenced), or [] whenever anything goes wrong."""
        hashes, blocks_tokens = chain[have:], chain_tokens[have:]
        stub = self.store_stub()
        if not hashes or stub is None:
            return []
        pool = self.pool
        try:
            resp = await stub.GetReplicas(pb.GetReplicasRequest(hashes=hashes), timeout=2)
        except grpc.aio.AioRpcError as e:
            log.warning("store lookup failed (%s); recomputing", e.code())
            return []
        reps = [r for r in resp.replicas if r.size == pool.block_nbytes]
        if not reps:
            return []
        try:
            ids = pool.allocate(len(reps))
        except Exception:
            return []
        try:
            by_peer: dict[str, list[Slice]] = {}
            for r, b in zip(reps, ids):
                by_peer.setdefault(r.data_address, []).append(
                    Slice(self.pool_region, pool.block_offset(b), r.region_id, r.offset, r.size))
            for peer, slices in by_peer.items():
                await self.te.read(peer, slices)
            if time.time() * 1000 > resp.lease_expires_unix_ms:
                raise TransferError("read lease expired before the read finished")
        except Exception as e:
            log.warning("store fetch failed (%s); recomputing", e)
            pool.free(ids)
            return []
        for i, (h, b, toks) in enumerate(zip(hashes, ids, blocks_tokens), start=have):
            pool.insert(h, b, toks, parent_hash=chain[i - 1] if i else None)
        return ids

    async def _put(self, hashes: list[bytes], block_ids: list[int]) -> None:
        stub = self.store_stub()
        pool = self.pool
        try:
            resp = await stub.PutStart(pb.PutStartRequest(
                node_id=self.node_id, hashes=hashes, size=pool.block_nbytes), timeout=5)
            where = dict(zip(hashes, block_ids))
            by_peer: dict[str, list[Slice]] = {}
            for p in resp.placements:
                by_peer.setdefault(p.data_address, []).append(
                    Slice(self.pool_region, pool.block_offset(where[p.hash]), p.region_id,
                          p.offset, p.size))
            placed = [p.hash for p in resp.placements]
            try:
                for peer, slices in by_peer.items():
                    await self.te.write(peer, slices)
            except TransferError as e:
                log.warning("store put failed (%s); aborting it", e)
                await stub.PutEnd(pb.PutEndRequest(hashes=placed, abort=True), timeout=5)
                return
            await stub.PutEnd(pb.PutEndRequest(hashes=placed), timeout=5)
        except grpc.aio.AioRpcError as e:
            log.warning("store put failed (%s)", e.code())
        finally:
            pool.free(block_ids)

    async def drain(self) -> None:
        async with self.compute:
            pass
        if self.background:
            await asyncio.wait(self.background, timeout=10)


def main(argv: list[str] | None = None) -> None:
    cfg = load(PrefillConfig, argv, prog="kvmesh prefill", section="prefill")
    setup_logging(cfg.log_level, "prefill")
    run(lambda: PrefillNode(cfg))
