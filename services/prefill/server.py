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

from kvmesh.protos import kvmesh_pb2 as pb
from kvmesh.protos import kvmesh_pb2_grpc as pbg
from kvmesh.rdma import Slice, TransferError
from kvmesh.services.common import metrics as kvm
from kvmesh.services.common.config import load
from kvmesh.services.common.sampling_params import Sampling
from kvmesh.services.common.service import run, setup_logging
from kvmesh.services.common.settings import NodeConfig
from kvmesh.services.common.telemetry import record_span
from kvmesh.services.engine.sampling import sample_with_logprob
from kvmesh.services.model_node import ModelNode

log = logging.getLogger(__name__)


@dataclass
class PrefillConfig(NodeConfig):
    """prefill-node: runs (incremental) prefill and streams KV to decode nodes."""


class PrefillServicer(pbg.PrefillNodeServicer):
    def __init__(self, node: PrefillNode) -> None:
        self.node = node

    async def Prefill(self, req, context):
        if err := self.node.check(req):
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, err)
        try:
            return await self.node.prefill(req)
        except TransferError as e:
            await context.abort(
                grpc.StatusCode.UNAVAILABLE,
                f"KV handoff to decode node {req.target.node_id} failed: {e}",
            )

    async def Status(self, req, context):
        return self.node.status(queue_depth=self.node.queue_depth)

    async def WatchEvents(self, req, context):
        async for event in self.node.watch_events(req):
            yield event


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

    def load_info(self) -> dict:
        return {
            **super().load_info(),
            "queue_depth": self.queue_depth,
            "running": int(self.compute.locked()),
        }

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
        t_queue = time.time_ns()
        self.queue_depth += 1
        waiting = True
        try:
            async with self.compute:
                self.queue_depth -= 1
                waiting = False
                kvm.PREFILL_QUEUE_SECONDS.observe(time.perf_counter() - t0)
                record_span(
                    "prefill.queue", t_queue, attributes={"kvmesh.queue_depth": self.queue_depth}
                )
                return await self._prefill_locked(req, (time.perf_counter() - t0) * 1000)
        finally:
            if waiting:
                self.queue_depth -= 1

    async def _prefill_locked(self, req: pb.PrefillRequest, queue_ms: float) -> pb.PrefillResponse:
        pool, bs = self.pool, self.cfg.block_size
        tokens = list(req.token_ids)
        n = len(tokens)
        hashes = list(req.block_hashes)
        blocks_tokens = [tuple(tokens[i * bs : (i + 1) * bs]) for i in range(len(hashes))]
        usable = min(len(hashes), (n - 1) // bs)  # leave >= 1 token to compute logits from
        t0 = time.perf_counter()

        t_prefix, tp = time.time_ns(), time.perf_counter()
        local = pool.match(hashes[:usable], blocks_tokens[:usable])
        fetched = await self._fetch(hashes[:usable], blocks_tokens[:usable], len(local))
        if fetched:
            kvm.observe_transfer(
                "store_get", len(fetched) * pool.block_nbytes, time.perf_counter() - tp
            )
        record_span(
            "prefill.prefix_fetch",
            t_prefix,
            attributes={
                "kvmesh.local_blocks": len(local),
                "kvmesh.fetched_blocks": len(fetched),
                "kvmesh.lookup_blocks": usable,
            },
        )
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
                transfers.append(
                    self.te.write(
                        target.data_address,
                        [
                            Slice(
                                self.pool_region,
                                pool.block_offset(table[i]),
                                target.region_id,
                                target.block_ids[i] * target.block_nbytes,
                                pool.block_nbytes,
                            )
                            for i in range(len(prefix))
                        ],
                    )
                )
            loop = asyncio.get_running_loop()
            layer_events: list = []

            def send_layer(layer: int) -> None:
                layer_events.append((f"layer {layer} sent", time.time_ns(), {"layer": layer}))
                transfers.append(
                    self.te.write(
                        target.data_address,
                        [
                            Slice(
                                self.pool_region,
                                pool.layer_offset(table[i], layer),
                                target.region_id,
                                target.block_ids[i] * target.block_nbytes
                                + layer * pool.layer_nbytes,
                                pool.layer_nbytes,
                            )
                            for i in range(len(prefix), len(table))
                        ],
                    )
                )

            new = torch.tensor(tokens[start:], dtype=torch.long)
            tc, t_compute = time.perf_counter(), time.time_ns()
            logits = await asyncio.to_thread(
                self.model.forward_prefill,
                new,
                start,
                pool,
                table,
                lambda layer: loop.call_soon_threadsafe(send_layer, layer),
            )
            compute_ms = (time.perf_counter() - tc) * 1000
            t_computed = time.time_ns()
            await asyncio.sleep(0)  # run the layer callbacks queued before the result
            first, first_lp = sample_with_logprob(logits, Sampling.from_proto(req.sampling), 0)
            for tr in transfers:
                await tr
            await self.te.notify(target.data_address, b"kv:" + req.request_id.encode())
        except BaseException:
            pool.free(table)
            raise
        prefill_ms = (time.perf_counter() - t0) * 1000
        handoff_bytes = len(table) * pool.block_nbytes
        kvm.PREFILL_SECONDS.observe(prefill_ms / 1000)
        kvm.observe_transfer("handoff", handoff_bytes, time.perf_counter() - tc)
        record_span(
            "prefill.compute",
            t_compute,
            t_computed,
            attributes={"kvmesh.new_tokens": n - start, "kvmesh.cached_tokens": start},
            events=layer_events,
        )
        record_span(
            "prefill.kv_handoff",
            t_compute,
            attributes={
                "kvmesh.bytes": handoff_bytes,
                "kvmesh.decode_node": target.node_id,
                "kvmesh.layerwise_transfers": len(transfers),
            },
        )
        self.events.record_prefill(n - start, start, compute_ms)

        for i in range(len(prefix), len(hashes)):
            pool.insert(
                hashes[i], table[i], blocks_tokens[i], parent_hash=hashes[i - 1] if i else None
            )
        c = self.counters
        c["computed"] += n - start
        c["cached"] += len(local) * bs
        c["fetched"] += len(fetched) * bs
        to_put = list(range(len(prefix), len(hashes)))
        if to_put and self.store is not None and self.store.master_address() is not None:
            keep = [table[i] for i in to_put]
            pool.ref(keep)
            task = asyncio.create_task(self._put([hashes[i] for i in to_put], keep))
            self.background.add(task)
            task.add_done_callback(self.background.discard)
        pool.free(table)
        return pb.PrefillResponse(
            first_token=first,
            computed_tokens=n - start,
            cached_tokens=len(local) * bs,
            fetched_tokens=len(fetched) * bs,
            prefill_ms=prefill_ms,
            queue_ms=queue_ms,
            first_logprob=first_lp if req.sampling.logprobs else 0.0,
        )

    async def _fetch(self, chain: list[bytes], chain_tokens: list[tuple], have: int) -> list[int]:
        """Pulls the longest present run of ``chain[have:]`` from the store into new pool
        blocks; returns their ids (referenced), or [] whenever anything goes wrong (a
        miss, an expired read lease, a failed read: the node recomputes)."""
        hashes, blocks_tokens = chain[have:], chain_tokens[have:]
        store, pool = self.store, self.pool
        if not hashes or store is None or store.master_address() is None:
            return []
        n = await store.prefix_len(hashes)
        if n == 0:
            return []
        try:
            ids = pool.allocate(n)
        except Exception:
            return []
        got = await store.get_into(
            hashes[:n],
            self.pool_region,
            [pool.block_offset(b) for b in ids],
            capacities=[pool.block_nbytes] * n,
            prefix=True,
        )
        k = next((i for i, sz in enumerate(got) if sz != pool.block_nbytes), n)
        if k < n:
            kvm.LATE_HITS.labels("fetch_failed").inc(n - k)
            pool.free(ids[k:])
            ids = ids[:k]
        for i, (h, b, toks) in enumerate(zip(hashes, ids, blocks_tokens), start=have):
            pool.insert(h, b, toks, parent_hash=chain[i - 1] if i else None)
        return ids

    async def _put(self, hashes: list[bytes], block_ids: list[int]) -> None:
        pool = self.pool
        t_put = time.perf_counter()
        try:
            ok = await self.store.put_from(
                hashes,
                self.pool_region,
                [pool.block_offset(b) for b in block_ids],
                [pool.block_nbytes] * len(hashes),
            )
            kvm.observe_transfer(
                "store_put", sum(ok) * pool.block_nbytes, time.perf_counter() - t_put
            )
            if not all(ok):
                log.info("store kept %d of %d new block(s)", sum(ok), len(ok))
        except Exception as e:  # the store is a cache: never fail the request for it
            log.warning("store put failed (%s)", e)
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
