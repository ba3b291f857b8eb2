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

A warm-up (``PrefillRequest.warm``: the conductor's, for a prompt it refused whose
prefix others will share) takes the compute slot only when no request holds or waits
for it, computes the prompt's full blocks into the prefix cache and the store (steps 2,
4 and 6, no target), and yields the slot to the first request that comes to wait: it
stops at the next chunk boundary and fails with RESOURCE_EXHAUSTED (``warm_yielded``).

Without room in the pool for its blocks a request fails with RESOURCE_EXHAUSTED (the
conductor tries another prefill node); every block it took is given back.
"""

from __future__ import annotations

import asyncio
import logging
import os
import time
from collections.abc import Callable
from dataclasses import dataclass, field

import grpc
import torch

from kvmesh.protos import kvmesh_pb2 as pb
from kvmesh.protos import kvmesh_pb2_grpc as pbg
from kvmesh.rdma import Slice, TransferError
from kvmesh.services.common import metrics as kvm
from kvmesh.services.common.config import load
from kvmesh.services.common.sampling_params import Sampling
from kvmesh.services.common.service import run, setup_logging
from kvmesh.services.common.telemetry import record_span
from kvmesh.services.engine.kv_pool import KVPool, OutOfBlocks
from kvmesh.services.engine.model import PrefillStopped
from kvmesh.services.engine.sampler_device import History
from kvmesh.services.engine.sampling import sample_with_logprob
from kvmesh.services.model_node import ModelNode, drop_payload, first_alternatives, to_the_end
from kvmesh.services.node_config import NodeConfig
from kvmesh.services.prefill.deadline import Deadline, Slowdown, TooLate
from kvmesh.services.prefill.prompt import Prompt
from kvmesh.services.prefill.queue import ComputeQueue, NotInTime
from kvmesh.services.prefill.warm import WarmYielded, warm_up

log = logging.getLogger(__name__)


@dataclass
class PrefillConfig(NodeConfig):
    """prefill-node: runs (incremental) prefill and streams KV to decode nodes."""


@dataclass
class _Timing:
    started: float  # perf_counter at the start of the computation
    ms: float
    start_ns: int
    end_ns: int


@dataclass
class _Handoff:
    """The writes of one request's KV into the decode node's reserved blocks: the prefix
    blocks whole, at once; then each layer of every new block as soon as it is computed.
    The first ``target.held_blocks`` blocks the decode node holds already: none of them
    is written (prompt block ``i`` goes to ``target.block_ids[i - held_blocks]``)."""

    te: object  # the node's TransferEngine
    pool: KVPool
    region: int
    target: pb.KVTarget
    table: list[int]
    first_new: int  # table[first_new:] are computed here, the blocks before are the prefix
    transfers: list = field(default_factory=list)
    layer_events: list = field(default_factory=list)
    clean: bool = True  # no write failed (set when a failed request has settled)

    def send_prefix(self) -> None:
        t, pool = self.target, self.pool
        held = t.held_blocks
        if self.first_new <= held:
            return
        self.transfers.append(
            self.te.write(
                t.data_address,
                [
                    Slice(
                        self.region,
                        pool.block_offset(self.table[i]),
                        t.region_id,
                        t.block_ids[i - held] * t.block_nbytes,
                        pool.block_nbytes,
                    )
                    for i in range(held, self.first_new)
                ],
            )
        )

    def send_layer(self, layer: int, lo: int, hi: int) -> None:
        """Layer ``layer`` of the blocks holding positions ``lo..hi-1`` (one chunk of the
        prefill: ``lo`` on a block boundary, ``hi`` too unless it ends the prompt)."""
        t, pool = self.target, self.pool
        bs, held = pool.block_size, t.held_blocks
        first = max(self.first_new, lo // bs, held)
        end = min(len(self.table), -(-hi // bs))
        if first >= end:  # a chunk of the prefix the decode node holds: nothing to send
            return
        self.layer_events.append(
            (f"layer {layer} sent", time.time_ns(), {"layer": layer, "from": lo, "to": hi})
        )
        self.transfers.append(
            self.te.write(
                t.data_address,
                [
                    Slice(
                        self.region,
                        pool.layer_offset(self.table[i], layer),
                        t.region_id,
                        t.block_ids[i - held] * t.block_nbytes + layer * pool.layer_nbytes,
                        pool.layer_nbytes,
                    )
                    for i in range(first, end)
                ],
            )
        )

    async def finish(self, request_id: str) -> None:
        """Waits for every write to land, then tells the decode node the KV is complete
        (an ordered notify: delivered after the writes)."""
        for tr in self.transfers:
            await tr
        await self.te.notify(self.target.data_address, b"kv:" + request_id.encode())

    async def settle(self) -> bool:
        """Waits (through cancellations) until every write started has ended, landed or
        failed: they read the pool blocks, which must not be reused before. True if every
        one landed (none can land later: the decode node may reuse its blocks at once)."""
        if not self.transfers:
            return True
        ended = await to_the_end(asyncio.gather(*self.transfers, return_exceptions=True))
        return not any(isinstance(e, BaseException) for e in ended)


class PrefillServicer(pbg.PrefillNodeServicer):
    def __init__(self, node: PrefillNode) -> None:
        self.node = node

    async def Prefill(self, req, context):
        if err := self.node.check(req):
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, err)
        try:
            if req.warm:
                return await self.node.warm(req)
            return await self.node.prefill(req)
        except WarmYielded as e:
            await context.abort(
                grpc.StatusCode.RESOURCE_EXHAUSTED,
                f"prefill node {self.node.node_id} did not warm {req.request_id}: {e}",
                trailing_metadata=(("kvmesh-reject-reason", "warm_yielded"),),
            )
        except TransferError as e:
            await context.abort(
                grpc.StatusCode.UNAVAILABLE,
                f"KV handoff to decode node {req.target.node_id} failed: {e}",
            )
        except OutOfBlocks as e:
            await context.abort(
                grpc.StatusCode.RESOURCE_EXHAUSTED,
                f"prefill node {self.node.node_id} has no room for the KV of "
                f"{len(req.token_ids)} tokens ({e}); retry",
            )
        except TooLate as e:
            await context.abort(
                grpc.StatusCode.RESOURCE_EXHAUSTED,
                f"prefill node {self.node.node_id} refused request {req.request_id} before any "
                f"work: {e}",
                trailing_metadata=(("kvmesh-reject-reason", "deadline"),),
            )

    async def Status(self, req, context):
        return self.node.status(queue_depth=self.node.queue_depth)

    async def WatchEvents(self, req, context):
        async for event in self.node.watch_events(req):
            yield event


class PrefillNode(ModelNode):
    role = "prefill"
    test_hold_dir = ""  # test only: see _test_hold

    def __init__(self, cfg: PrefillConfig) -> None:
        super().__init__(cfg)
        self.compute = ComputeQueue()
        self.slowdown = Slowdown()  # measured against the conductor's estimates
        self.counters["warmed"] = 0  # prompt tokens computed by warm-ups
        self.background: set[asyncio.Task] = set()
        self.test_hold_dir = os.environ.get("KVMESH_TEST_HOLD_PREFILL", "")  # test only

    @property
    def queue_depth(self) -> int:
        """Requests waiting for the compute slot."""
        return self.compute.depth

    async def setup(self) -> None:
        await super().setup()
        pbg.add_PrefillNodeServicer_to_server(PrefillServicer(self), self.server)

    def load_info(self) -> dict:
        return {
            **super().load_info(),
            "queue_depth": self.queue_depth,
            "running": int(self.compute.busy),
        }

    def check(self, req: pb.PrefillRequest) -> str | None:
        n, bs = len(req.token_ids), self.cfg.block_size
        if n == 0:
            return "Prefill: token_ids is empty"
        if n > (limit := self.model_config.max_position_embeddings):
            return (
                f"Prefill: {n} tokens exceed the model's maximum position of {limit} "
                f"tokens; shorten the prompt"
            )
        if any(t < 0 or t >= self.model_config.vocab_size for t in req.token_ids):
            return f"Prefill: token ids must be in [0, {self.model_config.vocab_size})"
        if len(req.block_hashes) > n // bs:
            return "Prefill: more block hashes than full blocks"
        if req.warm:
            if req.HasField("target") or not req.block_hashes:
                return "Prefill: a warm-up has block hashes and no target"
            return None
        t = req.target
        if t.held_blocks > (n - 1) // bs:
            return "Prefill: target holds more blocks than the prompt's cached prefix can be"
        if (
            t.held_blocks + len(t.block_ids) < -(-n // bs)
            or t.block_nbytes != self.pool.block_nbytes
        ):
            return "Prefill: target has too few blocks or another KV layout"
        return Sampling.from_proto(req.sampling).validate(self.model_config.vocab_size)

    async def prefill(self, req: pb.PrefillRequest) -> pb.PrefillResponse:
        """Waits for the compute slot (FIFO), then runs the request's prefill. A request
        with a deadline waits only while it can still finish inside it, and is refused
        (:class:`TooLate`) once it cannot. A request that fails, is refused or is
        cancelled (the client went away) at any stage, queued included, tells the decode
        node once none of its writes can land any more (``drop``)."""
        t_queue, t0 = time.time_ns(), time.perf_counter()
        handoffs: list[_Handoff] = []
        deadline = Deadline.of(req.deadline_ms, req.expected_ms, t0)
        try:
            limit = (lambda: deadline.wait_limit_s(self.slowdown)) if deadline else None
            try:
                async with self.compute.turn(limit):
                    waited = time.perf_counter() - t0
                    kvm.PREFILL_QUEUE_SECONDS.observe(waited)
                    record_span(
                        "prefill.queue",
                        t_queue,
                        attributes={"kvmesh.queue_depth": self.queue_depth},
                    )
                    if deadline:
                        deadline.check(self.slowdown, waited)
                    return await self._prefill_locked(req, waited * 1000, handoffs)
            except NotInTime:
                assert deadline is not None  # only a deadline sets a limit
                raise deadline.too_late(self.slowdown, time.perf_counter() - t0) from None
        except BaseException as e:  # cleanup only: re-raised
            if isinstance(e, TooLate):
                kvm.PREFILL_REFUSED.labels("deadline").inc()
            # _prefill_locked has settled its writes; a failed one might still land late
            # (a cut-off link that heals), so then the decode node keeps its fence
            if all(h.clean for h in handoffs):
                self._spawn(self._drop(req))
            raise

    async def warm(self, req: pb.PrefillRequest) -> pb.PrefillResponse:
        """The warm-up of ``req``'s full blocks (module docstring; ``prefill/warm.py``)."""
        return await warm_up(self, req)

    async def _drop(self, req: pb.PrefillRequest) -> None:
        """Tells the decode node this node will never write ``req``'s reserved blocks
        again (an ordered notify: delivered after every write issued before it)."""
        try:
            await self.te.notify(
                req.target.data_address, drop_payload(self.node_id, req.request_id)
            )
        except Exception as e:  # the decode node then frees them after its fence
            log.info(
                "could not tell %s that %s was dropped: %s", req.target.node_id, req.request_id, e
            )

    def _spawn(self, coro) -> None:
        task = asyncio.create_task(coro)
        self.background.add(task)
        task.add_done_callback(self.background.discard)

    async def _test_hold(self, stage: str, request_id: str) -> None:
        """Test only: with ``KVMESH_TEST_HOLD_PREFILL=<dir>`` (unset in production), a
        request reaching the stage named in ``<dir>/hold`` (``prefilling``: with the compute
        slot, before the forward; ``transferring``: every layer's write issued, before the
        KV-complete notify) appends ``<stage> <request id>`` to ``<dir>/held`` and waits
        there until it is cancelled, or goes on once ``<dir>/hold`` names another stage."""
        if not self.test_hold_dir:
            return
        try:
            with open(os.path.join(self.test_hold_dir, "hold")) as f:
                if f.read().strip() != stage:
                    return
        except FileNotFoundError:
            return
        with open(os.path.join(self.test_hold_dir, "held"), "a") as f:
            f.write(f"{stage} {request_id}\n")
        while _read(os.path.join(self.test_hold_dir, "hold")) == stage:
            await asyncio.sleep(0.05)

    async def _prefill_locked(
        self, req: pb.PrefillRequest, queue_ms: float, handoffs: list[_Handoff]
    ) -> pb.PrefillResponse:
        """One request with the compute slot held: load its prefix, compute the rest while
        handing the KV off layer by layer, sample the first token, then keep the new full
        blocks (prefix cache, store). Every block it takes is given back whatever happens, but
        only once nothing writes or reads it any more: a cancelled request first waits for
        its forward (a worker thread) and its transfers to end, holding the compute slot."""
        t0 = time.perf_counter()
        bs = self.cfg.block_size
        p = Prompt.of(req, bs)
        local, fetched = await self.load_prefix(p)
        prefix = local + fetched
        table = self.allocate_table(len(p.tokens), prefix)
        start = len(prefix) * bs
        handoff = _Handoff(self.te, self.pool, self.pool_region, req.target, table, len(prefix))
        handoffs.append(handoff)
        try:
            handoff.send_prefix()
            await self._test_hold("prefilling", req.request_id)
            logits, timing = await self.compute_kv(p.tokens, start, table, handoff.send_layer)
            hist = History(p.tokens, (), frozenset(self.tokenizer.eos_ids))
            sampling = Sampling.from_proto(req.sampling)
            first, first_lp = sample_with_logprob(logits, sampling, 0, hist)
            first_top = first_alternatives(logits, sampling)
            await self._test_hold("transferring", req.request_id)
            await handoff.finish(req.request_id)
        except BaseException:  # cleanup only (a failure or a cancellation): re-raised
            # not clean unless settle() says so: a cancellation may land while it waits
            handoff.clean = False
            try:
                handoff.clean = await handoff.settle()  # compute_kv has ended (waits its thread)
            finally:
                self.pool.free(table)
            raise
        prefill_ms = (time.perf_counter() - t0) * 1000
        self.slowdown.observe(
            req.expected_ms,
            prefill_ms,
            expected_tokens=req.expected_computed_tokens,
            computed_tokens=len(p.tokens) - start,
        )
        self._observe(len(p.tokens), start, handoff, timing, prefill_ms)
        self.keep_new_blocks(p, table, len(prefix))
        c = self.counters
        c["computed"] += len(p.tokens) - start
        c["cached"] += len(local) * bs
        c["fetched"] += len(fetched) * bs
        self.put_new_blocks(p, table, len(prefix))
        self.pool.free(table)
        return pb.PrefillResponse(
            first_token=first,
            computed_tokens=len(p.tokens) - start,
            cached_tokens=len(local) * bs,
            fetched_tokens=len(fetched) * bs,
            prefill_ms=prefill_ms,
            queue_ms=queue_ms,
            first_logprob=first_lp if req.sampling.logprobs else 0.0,
            first_top=first_top,
        )

    async def load_prefix(self, p: Prompt) -> tuple[list[int], list[int]]:
        """The longest run of the prompt's usable blocks in this node's pool, then the next
        run fetched from the store: (local, fetched) block ids, each referenced."""
        pool = self.pool
        chain, chain_tokens = p.hashes[: p.usable], p.blocks_tokens[: p.usable]
        t_prefix, tp = time.time_ns(), time.perf_counter()
        local = pool.match(chain, chain_tokens)
        try:
            fetched = await self._fetch(chain, chain_tokens, len(local))
        except BaseException:  # cleanup only (cancelled while fetching): re-raised
            pool.free(local)
            raise
        if fetched:
            nbytes, dt = len(fetched) * pool.block_nbytes, time.perf_counter() - tp
            kvm.observe_transfer("store_get", nbytes, dt)
            self.events.record_store_fetch(nbytes, dt * 1000.0)
        record_span(
            "prefill.prefix_fetch",
            t_prefix,
            attributes={
                "kvmesh.local_blocks": len(local),
                "kvmesh.fetched_blocks": len(fetched),
                "kvmesh.lookup_blocks": p.usable,
            },
        )
        return local, fetched

    def allocate_table(self, n: int, prefix: list[int]) -> list[int]:
        """The prefix blocks, then new blocks for the rest of ``n`` tokens. Raises
        :class:`OutOfBlocks` when the pool has no room, the prefix released."""
        try:
            return prefix + self.pool.allocate(-(-n // self.cfg.block_size) - len(prefix))
        except OutOfBlocks:
            self.pool.free(prefix)
            raise

    async def compute_kv(
        self,
        tokens: list[int],
        start: int,
        table: list[int],
        on_layer: Callable[[int, int, int], None],
        chunk: int = 0,
    ) -> tuple[torch.Tensor, _Timing]:
        """KV of ``tokens[start:]`` into ``table`` (off the event loop), in chunks of
        ``prefill_chunk`` tokens so that a long prompt's memory stays bounded;
        ``on_layer(l, lo, hi)`` runs on the loop as layer ``l`` of positions ``lo..hi-1``
        is written, all before this returns. Returns the logits of the last token. A
        cancelled request (the client went away) stops at the next chunk boundary."""
        loop = asyncio.get_running_loop()
        task = asyncio.current_task()
        new = torch.tensor(tokens[start:], dtype=torch.long)
        tc, t_compute = time.perf_counter(), time.time_ns()
        try:
            logits = await to_the_end(
                asyncio.to_thread(
                    self.model.forward_prefill_chunked,
                    new,
                    start,
                    self.pool,
                    table,
                    chunk or self.cfg.prefill_chunk,
                    lambda layer, lo, hi: loop.call_soon_threadsafe(on_layer, layer, lo, hi),
                    lambda: task.cancelling() > 0,  # read from the worker thread: a count
                )
            )
        except PrefillStopped:  # only ever after a cancellation: the thread has ended
            raise asyncio.CancelledError() from None
        timing = _Timing(tc, (time.perf_counter() - tc) * 1000, t_compute, time.time_ns())
        await asyncio.sleep(0)  # run the layer callbacks queued before the result
        return logits, timing

    def _observe(
        self, n: int, start: int, handoff: _Handoff, timing: _Timing, prefill_ms: float
    ) -> None:
        """Metrics, spans and the node event of one finished prefill."""
        handoff_bytes = (len(handoff.table) - handoff.target.held_blocks) * self.pool.block_nbytes
        kvm.PREFILL_SECONDS.observe(prefill_ms / 1000)
        kvm.observe_transfer("handoff", handoff_bytes, time.perf_counter() - timing.started)
        record_span(
            "prefill.compute",
            timing.start_ns,
            timing.end_ns,
            attributes={"kvmesh.new_tokens": n - start, "kvmesh.cached_tokens": start},
            events=handoff.layer_events,
        )
        record_span(
            "prefill.kv_handoff",
            timing.start_ns,
            attributes={
                "kvmesh.bytes": handoff_bytes,
                "kvmesh.decode_node": handoff.target.node_id,
                "kvmesh.layerwise_transfers": len(handoff.transfers),
            },
        )
        self.events.record_prefill(n - start, start, timing.ms)

    def keep_new_blocks(self, p: Prompt, table: list[int], first_new: int) -> None:
        """The newly computed full blocks enter the local prefix cache."""
        for i in range(first_new, len(p.hashes)):
            self.pool.insert(
                p.hashes[i],
                table[i],
                p.blocks_tokens[i],
                parent_hash=p.hashes[i - 1] if i else None,
            )

    def put_new_blocks(self, p: Prompt, table: list[int], first_new: int) -> None:
        """Puts the newly computed full blocks into the store in the background (off the
        TTFT path); they stay referenced until the put ends."""
        to_put = list(range(first_new, len(p.hashes)))
        if not to_put or self.store is None or self.store.master_address() is None:
            return
        keep = [table[i] for i in to_put]
        self.pool.ref(keep)
        self._spawn(self._put([p.hashes[i] for i in to_put], keep))

    async def _fetch(self, chain: list[bytes], chain_tokens: list[tuple], have: int) -> list[int]:
        """Pulls the longest present run of ``chain[have:]`` from the store into new pool
        blocks; returns their ids (referenced), or [] when there is nothing to gain (a
        miss, an expired read lease, a failed read, no room in the pool: the node
        recomputes)."""
        hashes, blocks_tokens = chain[have:], chain_tokens[have:]
        store, pool = self.store, self.pool
        if not hashes or store is None or store.master_address() is None:
            return []
        n = await store.prefix_len(hashes)
        if n == 0:
            return []
        try:
            ids = pool.allocate(n)
        except OutOfBlocks:
            return []
        try:
            got = await to_the_end(
                store.get_into(
                    hashes[:n],
                    self.pool_region,
                    [pool.block_offset(b) for b in ids],
                    capacities=[pool.block_nbytes] * n,
                    prefix=True,
                )
            )
        except BaseException:  # cleanup only (the read has ended): re-raised
            pool.free(ids)
            raise
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
        except Exception:
            # a background task nobody awaits, for a cache: the store client turns every
            # store failure into False, so whatever lands here is a bug; log it, keep serving
            log.exception("store put failed")
        finally:
            pool.free(block_ids)

    async def drain(self) -> None:
        await self.compute.idle()
        if self.background:
            await asyncio.wait(self.background, timeout=10)


def _read(path: str) -> str:
    try:
        with open(path) as f:
            return f.read().strip()
    except FileNotFoundError:
        return ""


def main(argv: list[str] | None = None) -> None:
    cfg = load(PrefillConfig, argv, prog="kvmesh prefill", section="prefill")
    setup_logging(cfg.log_level, "prefill")
    run(lambda: PrefillNode(cfg))
