"""decode-node: holds a request's KV from prefill to its last token.

A request's life here:
  1. ``Reserve``: KV blocks for prompt + max_tokens are taken from the pool at once (so a
     finished prefill never waits for decode memory) -> state RESERVED; a reservation
     never used is reclaimed after ``reservation_timeout_s``;
  2. the prefill node writes the prompt KV into those blocks over the transfer engine,
     layer by layer, then sends ``kv:<request id>`` as an ordered notify -> KV_READY;
  3. ``Decode`` (server stream): once KV_READY, the request joins the running batch
     (``running``) between two steps -> RUNNING; every step decodes one token for each
     running request (continuous batching: requests join and leave between steps);
  4. it leaves on EOS or max_tokens (or when the client goes away); its blocks go back
     to the pool. ``Release`` drops a reservation whose prefill failed.
"""

from __future__ import annotations

import asyncio
import logging
import time
from dataclasses import dataclass, field

import grpc
import torch

from protos import kvmesh_pb2 as pb
from protos import kvmesh_pb2_grpc as pbg
from services.common.config import ConfigError, load, option
from services.common.hashing import prefix_hashes
from services.common.model_node import ModelNode
from services.common.telemetry import record_span
from services.common.service import run, setup_logging
from services.common.settings import NodeConfig
from services.engine.kv_pool import OutOfBlocks
from services.engine.sampling import Sampling, sample

log = logging.getLogger(__name__)


@dataclass
class DecodeConfig(NodeConfig):
    """decode-node: continuous-batching decode over KV handed off by prefill nodes."""

    max_batch: int = option(32, "most requests decoded in one step")
    kv_wait_s: float = option(30.0, "how long Decode waits for the prefill's KV")
    reservation_timeout_s: float = option(60.0, "a reservation not decoded within this is freed")

    def validate(self) -> None:
        super().validate()
        if self.max_batch < 1:
            raise ConfigError("max_batch: must be >= 1")


@dataclass
class Reservation:
    request_id: str
    prompt_tokens: int
    blocks: list[int]
    created: float = field(default_factory=time.monotonic)
    kv_ready: asyncio.Event = field(default_factory=asyncio.Event)
    decoding: bool = False
    prompt_ids: list[int] = field(default_factory=list)   # for caching blocks at the end
    hashes: list[bytes] = field(default_factory=list)      # of the prompt's full blocks
    generated: list[int] = field(default_factory=list)


@dataclass
class Running:
    """A request in the batch: its next input token sits at ``position``."""

    res: Reservation
    token: int
    position: int
    remaining: int
    step: int
    sampling: Sampling
    stop_ids: frozenset[int]
    out: asyncio.Queue = field(default_factory=asyncio.Queue)


class DecodeServicer(pbg.DecodeNodeServicer):
    def __init__(self, node: "DecodeNode") -> None:
        self.node = node

    async def Reserve(self, req, context):
        node = self.node
        if not req.request_id or req.prompt_tokens == 0 or req.max_tokens == 0:
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT,
                                "Reserve needs request_id, prompt_tokens > 0 and max_tokens > 0")
        if req.request_id in node.reservations:
            await context.abort(grpc.StatusCode.ALREADY_EXISTS,
                                f"request {req.request_id} already holds a reservation")
        total = req.prompt_tokens + req.max_tokens
        if total > node.model_config.max_position_embeddings:
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT,
                                f"{total} tokens exceed the model context")
        try:
            res = node.reserve(req.request_id, req.prompt_tokens, req.max_tokens)
        except OutOfBlocks:
            await context.abort(grpc.StatusCode.RESOURCE_EXHAUSTED,
                                f"decode node {node.node_id} has no room for {total} tokens")
        return pb.ReserveResponse(target=pb.KVTarget(
            node_id=node.node_id, data_address=node.te.address, region_id=node.pool_region,
            block_ids=res.blocks, block_nbytes=node.pool.block_nbytes))

    async def Decode(self, req, context):
        node = self.node
        res = node.reservations.get(req.request_id)
        if res is None or res.decoding:
            await context.abort(grpc.StatusCode.NOT_FOUND,
                                f"no reservation for request {req.request_id!r}; call Reserve first")
        sampling = Sampling.from_proto(req.sampling)
        if err := sampling.validate(node.model_config.vocab_size):
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, err)
        res.decoding = True
        t_wait = time.time_ns()
        res.prompt_ids = list(req.prompt_token_ids)
        res.hashes = list(req.block_hashes)
        first, step = req.first_token, 1
        if req.prefill_here:
            if err := node.check_prompt(req, res):
                node.release(req.request_id)
                await context.abort(grpc.StatusCode.INVALID_ARGUMENT, err)
            first, presp = await node.prefill_here(res, sampling)
            record_span("decode.prefill_here", t_wait, attributes={
                "kvmesh.computed_tokens": presp.computed_tokens,
                "kvmesh.cached_tokens": presp.cached_tokens + presp.fetched_tokens})
            yield pb.DecodeResponse(token_ids=[first], prefill=presp,
                                    finish_reason="" if req.max_tokens > 1 else "length")
            if req.max_tokens <= 1:
                node.release(req.request_id)
                return
        else:
            try:
                await asyncio.wait_for(res.kv_ready.wait(), node.cfg.kv_wait_s)
            except asyncio.TimeoutError:
                node.release(req.request_id)
                await context.abort(grpc.StatusCode.DEADLINE_EXCEEDED,
                                    f"KV of request {req.request_id} did not arrive in "
                                    f"{node.cfg.kv_wait_s}s; retry the request")
            record_span("decode.kv_wait", t_wait)
        res.generated = [first]
        t_decode, n_out = time.time_ns(), 0
        r = Running(res, first, res.prompt_tokens, req.max_tokens - 1, step, sampling,
                    frozenset(req.stop_token_ids))
        node.admit(r)
        try:
            while True:
                item = await r.out.get()
                if isinstance(item, Exception):
                    await context.abort(grpc.StatusCode.INTERNAL, f"decode failed: {item}")
                tok, reason = item
                n_out += 1
                yield pb.DecodeResponse(token_ids=[tok], finish_reason=reason)
                if reason:
                    return
        finally:
            node.retire(r)
            record_span("decode.generate", t_decode, attributes={
                "kvmesh.tokens": n_out, "kvmesh.batch_size": len(node.running)})

    async def Release(self, req, context):
        return pb.ReleaseResponse(released=self.node.release(req.request_id))

    async def Status(self, req, context):
        n = self.node
        return n.status(queue_depth=len(n.reservations) - len(n.running), running=len(n.running))

    async def WatchEvents(self, req, context):
        async for event in self.node.watch_events(req):
            yield event


class DecodeNode(ModelNode):
    role = "decode"

    def __init__(self, cfg: DecodeConfig) -> None:
        super().__init__(cfg)
        self.cfg: DecodeConfig = cfg
        self.reservations: dict[str, Reservation] = {}
        self.running: list[Running] = []
        self._wake = asyncio.Event()
        self._tasks: list[asyncio.Task] = []
        self._in_step: list[Running] = []
        self._deferred: list[Running] = []
        self.compute = asyncio.Lock()   # one model computation at a time: steps, prefills

    async def setup(self) -> None:
        await super().setup()
        self.te.add_notify_handler(self._on_notify)
        pbg.add_DecodeNodeServicer_to_server(DecodeServicer(self), self.server)

    async def after_start(self) -> None:
        await super().after_start()
        self._tasks = [asyncio.create_task(self._step_loop()),
                       asyncio.create_task(self._reap_loop())]

    def _on_notify(self, payload: bytes) -> None:
        if payload.startswith(b"kv:"):
            res = self.reservations.get(payload[3:].decode(errors="replace"))
            if res is not None:
                res.kv_ready.set()

    def reserve(self, request_id: str, prompt_tokens: int, max_tokens: int) -> Reservation:
        n = -(-(prompt_tokens + max_tokens) // self.cfg.block_size)
        res = Reservation(request_id, prompt_tokens, self.pool.allocate(n))
        self.reservations[request_id] = res
        return res

    def release(self, request_id: str) -> bool:
        res = self.reservations.pop(request_id, None)
        if res is None:
            return False
        self._cache_blocks(res)
        self.pool.free(res.blocks)
        return True

    def load_info(self) -> dict:
        return {**super().load_info(), "queue_depth": len(self.reservations) - len(self.running),
                "running": len(self.running)}

    def _cache_blocks(self, res: Reservation) -> None:
        """Keeps the full blocks whose KV this node holds (prompt, then generated tokens
        whose KV was computed) in its prefix cache: the next turn of a conversation
        starts with exactly that prefix (decode-direct)."""
        bs = self.cfg.block_size
        if not res.prompt_ids or not res.kv_ready.is_set():
            return
        tokens = res.prompt_ids + res.generated[:-1]  # the last token's KV was never computed
        hashes = list(res.hashes)
        if len(hashes) != len(res.prompt_ids) // bs:
            return
        if hashes:
            hashes += prefix_hashes(hashes[-1], tokens[len(hashes) * bs:], bs)
        for i, h in enumerate(hashes[: len(res.blocks)]):
            self.pool.insert(h, res.blocks[i], tokens[i * bs:(i + 1) * bs],
                             parent_hash=hashes[i - 1] if i else None)

    def check_prompt(self, req: pb.DecodeRequest, res: Reservation) -> str | None:
        n, bs = len(req.prompt_token_ids), self.cfg.block_size
        if n != res.prompt_tokens:
            return f"prompt_token_ids has {n} tokens; the reservation was for {res.prompt_tokens}"
        if any(t < 0 or t >= self.model_config.vocab_size for t in req.prompt_token_ids):
            return f"token ids must be in [0, {self.model_config.vocab_size})"
        if len(req.block_hashes) > n // bs:
            return "more block hashes than full blocks"
        return None

    async def prefill_here(self, res: Reservation, sampling: Sampling):
        """Colocated / decode-direct route: this node computes the prompt itself,
        reusing whatever prefix its own pool holds."""
        pool, bs = self.pool, self.cfg.block_size
        tokens, hashes = res.prompt_ids, res.hashes
        n = len(tokens)
        usable = min(len(hashes), (n - 1) // bs)
        t0 = time.perf_counter()
        async with self.compute:
            local = pool.match(hashes[:usable], [tuple(tokens[i * bs:(i + 1) * bs])
                                                 for i in range(usable)])
            k = len(local)
            if k:
                pool.free(res.blocks[:k])
                res.blocks = local + res.blocks[k:]
            start = k * bs
            tc = time.perf_counter()
            logits = await asyncio.to_thread(
                self.model.forward_prefill, torch.tensor(tokens[start:], dtype=torch.long),
                start, pool, res.blocks)
            compute_ms = (time.perf_counter() - tc) * 1000
        res.kv_ready.set()
        first = sample(logits, sampling, step=0)
        self.counters["computed"] += n - start
        self.counters["cached"] += start
        self.events.record_prefill(n - start, start, compute_ms)
        return first, pb.PrefillResponse(first_token=first, computed_tokens=n - start,
                                         cached_tokens=start,
                                         prefill_ms=(time.perf_counter() - t0) * 1000)

    def admit(self, r: Running) -> None:
        self.running.append(r)
        self._wake.set()

    def retire(self, r: Running) -> None:
        if r in self.running:
            self.running.remove(r)
        if r in self._in_step:  # the step thread may still write its KV: free after it
            self._deferred.append(r)
        else:
            self.release(r.res.request_id)

    async def _step_loop(self) -> None:
        eos_ids = frozenset(self.tokenizer.eos_ids)
        while True:
            if not self.running:
                self._wake.clear()
                await self._wake.wait()
                continue
            batch = self.running[: self.cfg.max_batch]
            tokens = torch.tensor([r.token for r in batch], dtype=torch.long)
            positions = [r.position for r in batch]
            tables = [r.res.blocks for r in batch]
            self._in_step = batch
            try:
                async with self.compute:
                    tc = time.perf_counter()
                    logits = await asyncio.to_thread(self.model.forward_decode, tokens,
                                                     positions, tables, self.pool)
                    self.events.record_decode(len(batch), sum(positions) + len(batch),
                                              (time.perf_counter() - tc) * 1000)
            except Exception as e:  # a bug, not a client's mistake: fail these requests
                log.exception("decode step failed")
                for r in batch:
                    r.out.put_nowait(e)
                    if r in self.running:
                        self.running.remove(r)
                continue
            finally:
                self._in_step = []
                for r in self._deferred:
                    self.release(r.res.request_id)
                self._deferred.clear()
            for i, r in enumerate(batch):
                if r not in self.running:  # left (client gone) while the step ran
                    continue
                tok = sample(logits[i], r.sampling, step=r.step)
                r.token, r.position, r.step = tok, r.position + 1, r.step + 1
                r.res.generated.append(tok)
                r.remaining -= 1
                self.counters["generated"] += 1
                reason = ""
                if (tok in eos_ids and not r.sampling.ignore_eos) or tok in r.stop_ids:
                    reason = "stop"
                elif r.remaining <= 0:
                    reason = "length"
                r.out.put_nowait((tok, reason))
                if reason:
                    self.running.remove(r)
            # round-robin so a batch larger than max_batch shares steps fairly
            if len(self.running) > self.cfg.max_batch:
                self.running = self.running[self.cfg.max_batch:] + self.running[: self.cfg.max_batch]

    async def _reap_loop(self) -> None:
        while True:
            await asyncio.sleep(1.0)
            now = time.monotonic()
            for rid, res in list(self.reservations.items()):
                if not res.decoding and now - res.created > self.cfg.reservation_timeout_s:
                    log.warning("reservation %s never decoded; freeing it", rid)
                    self.release(rid)

    async def drain(self) -> None:
        deadline = time.monotonic() + 20
        while self.running and time.monotonic() < deadline:
            await asyncio.sleep(0.05)

    async def teardown(self) -> None:
        for t in self._tasks:
            t.cancel()
        await super().teardown()


def main(argv: list[str] | None = None) -> None:
    cfg = load(DecodeConfig, argv, prog="kvmesh decode", section="decode")
    setup_logging(cfg.log_level, "decode")
    run(lambda: DecodeNode(cfg))
