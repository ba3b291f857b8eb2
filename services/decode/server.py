"""decode-node: holds a request's KV from prefill to its last token.

A request's life here:
  1. ``Reserve``: KV blocks for the prompt (and the first generated token) are taken
     from the pool at once, so a finished prefill never waits for decode memory ->
     RESERVED; the cached prefix the request's block hashes name is pinned first (one
     copy of a shared prefix serves every request holding it; taking the rest cannot
     evict it) and the target names only the blocks after it; a reservation is owned
     by the conductor process that made it (its incarnation,
     services.common.ownership) and freed when that process ends; one never used is
     reclaimed after ``reservation_timeout_s`` (``reservation_owned_timeout_s`` while
     its owner lives);
  2. the prefill node writes the prompt KV into the blocks after the pinned prefix
     over the transfer engine,
     layer by layer, then sends ``kv:<request id>`` as an ordered notify -> KV_READY;
     (on the colocated and decode-direct routes this node computes the prompt itself,
     reusing its own cached prefix, in chunks between decode steps);
  3. ``Decode`` (server stream): once KV_READY the prompt's full blocks enter the
     prefix cache (a request sharing the prefix pins them from then on, while this one
     still decodes) and the request joins the running batch of
     the :class:`~services.decode.batch.BatchScheduler` at once: the next step holds
     it -> RUNNING; with ``report_join`` the caller hears (a message with ``joined``
     set; on the local routes, the first token's own message) as that step begins, so
     it can hold the first token until then and the second follows one step later;
     every step decodes one token for each running request; blocks are added as a
     request grows, and when the pool runs out the youngest request is preempted and
     later recomputed (see ``batch.py``);
  4. it leaves on EOS, a stop token or max_tokens (or when the client goes away); its
     full blocks stay in the prefix cache for the conversation's next turn, the rest go
     back to the pool. ``Release`` drops a reservation whose prefill failed (or whose
     client went away); one that overtakes its ``Reserve`` makes the node refuse that
     ``Reserve`` when it comes (``early_release``).
"""

from __future__ import annotations

import asyncio
import collections
import json
import logging
import time
from dataclasses import dataclass

import grpc

from kvmesh.protos import kvmesh_pb2 as pb
from kvmesh.protos import kvmesh_pb2_grpc as pbg
from kvmesh.services.common.config import ConfigError, load, option
from kvmesh.services.common.ownership import CONDUCTOR_MD, INCARNATION_MD, WRITERS_MD, Owners
from kvmesh.services.common.sampling_params import Sampling
from kvmesh.services.common.service import run, setup_logging
from kvmesh.services.common.telemetry import record_span
from kvmesh.services.decode.batch import JOINED, BatchScheduler, Reservation, Running
from kvmesh.services.decode.early_release import EarlyReleases
from kvmesh.services.engine.kv_pool import OutOfBlocks
from kvmesh.services.engine.sampler_device import History
from kvmesh.services.engine.sampling import sample_with_logprob
from kvmesh.services.model_node import ModelNode, first_alternatives, parse_drop, top_message
from kvmesh.services.node_config import NodeConfig

log = logging.getLogger(__name__)


def _metadata(context) -> dict[str, str]:
    return {k: v for k, v in (context.invocation_metadata() or ()) if isinstance(v, str)}


@dataclass
class DecodeConfig(NodeConfig):
    """decode-node: continuous-batching decode over KV handed off by prefill nodes."""

    max_batch: int = option(32, "most requests decoded in one step")
    kv_wait_s: float = option(30.0, "how long Decode waits for the prefill's KV")
    reservation_timeout_s: float = option(
        60.0,
        "a reservation not decoded within this is freed, unless the conductor "
        "process that made it is alive (its owner key holds its incarnation)",
    )
    reservation_owned_timeout_s: float = option(
        600.0,
        "a reservation not decoded within this is freed even though its conductor "
        "is alive (a bound on leaks; above the conductor's request timeout)",
    )
    fence_s: float = option(
        30.0,
        "blocks of a reservation whose KV never completed stay "
        "unused this long (late writes from a cut-off prefill node)",
    )
    step_token_budget: int = option(
        512,
        "most tokens one model step computes: the running "
        "batch plus a chunk of a prompt computed here",
    )
    prefill_chunk_ms: float = option(
        0.0,
        "most ms of compute in one chunk of a prompt computed here (colocated, "
        "decode-direct, resume) while requests decode, by the node's measured prefill "
        "speed (0 = no fixed bound; --prefill-chunk-tbt-share bounds chunks by the "
        "requests' TBT SLOs)",
    )
    prefill_chunk_tbt_share: float = option(
        0.8,
        "while requests decode, a chunk of a prompt computed here is cut so that the "
        "next step ends within this share of the tightest TBT SLO among them (the SLO "
        "times the share, less the last step's time; one block at least): such prompts "
        "add to the running requests' time between tokens only what their SLOs leave; "
        "with nothing decoding, or loose SLOs, chunks are bounded by tokens alone "
        "(0 = not by the SLOs)",
    )

    cuda_graphs: bool = option(
        True,
        "with --device cuda: replay the decode step from CUDA graphs captured per "
        "batch-size bucket (--no-cuda-graphs: run the same fixed-shape step eagerly)",
    )

    kv_mirror: bool = option(
        True,
        "on the CPU: keep each running request's KV also as float32, contiguous per KV "
        "head, so a decode step reads it without gathering blocks (about 3x faster steps "
        "at batch 32 x 512 tokens; costs up to 2.25x the bytes of a bfloat16 pool; "
        "--no-kv-mirror saves that memory)",
    )

    def validate(self) -> None:
        super().validate()
        if self.max_batch < 1:
            raise ConfigError("max_batch: must be >= 1")
        if self.step_token_budget < self.block_size:
            raise ConfigError("step_token_budget: must be >= block_size")
        if self.prefill_chunk_ms < 0:
            raise ConfigError("prefill_chunk_ms: must be >= 0")
        if not 0 <= self.prefill_chunk_tbt_share <= 1:
            raise ConfigError("prefill_chunk_tbt_share: must be between 0 and 1")


class DecodeServicer(pbg.DecodeNodeServicer):
    def __init__(self, node: DecodeNode) -> None:
        self.node = node

    async def Reserve(self, req, context):
        node = self.node
        if not req.request_id or req.prompt_tokens == 0 or req.max_tokens == 0:
            await context.abort(
                grpc.StatusCode.INVALID_ARGUMENT,
                "Reserve needs request_id, prompt_tokens > 0 and max_tokens > 0",
            )
        if req.request_id in node.reservations:
            await context.abort(
                grpc.StatusCode.ALREADY_EXISTS,
                f"request {req.request_id} already holds a reservation",
            )
        if node.released_early.released(req.request_id):
            # its Release (the client went away) overtook this Reserve: nothing may be
            # held for it, or the blocks would wait for the reaper
            await context.abort(
                grpc.StatusCode.ABORTED,
                f"request {req.request_id} was released before this Reserve arrived "
                f"(its client went away); nothing is reserved",
            )
        total = req.prompt_tokens + req.max_tokens
        if total > (limit := node.model_config.max_position_embeddings):
            await context.abort(
                grpc.StatusCode.INVALID_ARGUMENT,
                f"prompt_tokens + max_tokens = {total} exceed the model's maximum position "
                f"of {limit} tokens; shorten the prompt or lower max_tokens",
            )
        if len(req.block_hashes) > req.prompt_tokens // node.cfg.block_size:
            await context.abort(
                grpc.StatusCode.INVALID_ARGUMENT,
                f"{len(req.block_hashes)} block hashes for a prompt of {req.prompt_tokens} "
                f"tokens: at most one per full block of {node.cfg.block_size}",
            )
        md = _metadata(context)
        try:
            res = node.reserve(
                req.request_id,
                req.prompt_tokens,
                md.get(CONDUCTOR_MD, ""),
                md.get(INCARNATION_MD, ""),
                list(req.block_hashes),
                req.prefill_here,
                req.max_tokens,
            )
        except OutOfBlocks:
            await context.abort(
                grpc.StatusCode.RESOURCE_EXHAUSTED,
                f"decode node {node.node_id} has no room for a prompt of "
                f"{req.prompt_tokens} tokens",
            )
        return pb.ReserveResponse(
            target=pb.KVTarget(
                node_id=node.node_id,
                data_address=node.te.address,
                region_id=node.pool_region,
                block_ids=[] if res.prefill_here else res.blocks[res.pinned :],
                block_nbytes=node.pool.block_nbytes,
                held_blocks=0 if res.prefill_here else res.pinned,
            ),
            cached_tokens=res.pinned * node.cfg.block_size,
            prefix_pinned=True,
            reserve_seq=node.reserves,  # (no await since node.reserve: this one's number)
        )

    async def Decode(self, req, context):
        node = self.node
        res = node.reservations.get(req.request_id)
        if res is None or res.decoding:
            await context.abort(
                grpc.StatusCode.NOT_FOUND,
                f"no reservation for request {req.request_id!r}; call Reserve first",
            )
        sampling = Sampling.from_proto(req.sampling)
        if err := sampling.validate(node.model_config.vocab_size):
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, err)
        res.decoding = True
        r: Running | None = None
        try:
            async for msg in self._decode(node, req, res, sampling, context):
                if isinstance(msg, Running):
                    r = msg
                else:
                    yield msg
        finally:
            # whatever ends the call (the last token, an error, the client going away while
            # the prompt computes here, while the KV is awaited or mid-decode), the blocks
            # go back: those of a request in the batch once its step has ended
            if r is not None:
                node.retire(r)
            else:
                node.release(req.request_id, res)

    async def _decode(self, node: DecodeNode, req, res: Reservation, sampling, context):
        """The body of ``Decode``: yields the responses, and the :class:`Running` request
        once it joined the batch (the caller retires it)."""
        t_wait = time.time_ns()
        res.prompt_ids = list(req.prompt_token_ids)
        res.hashes = list(req.block_hashes)
        first, step = req.first_token, 1
        if res.prefill_here and not req.prefill_here:
            await context.abort(
                grpc.StatusCode.FAILED_PRECONDITION,
                f"request {req.request_id} was reserved with prefill_here: its Decode "
                f"must set prefill_here too (no other node may write its blocks)",
            )
        if req.prefill_here:
            res.writers = frozenset()  # this node computes it: no other node writes its KV
            if err := node.check_prompt(req, res):
                await context.abort(grpc.StatusCode.INVALID_ARGUMENT, err)
            try:
                first, presp = await node.prefill_here(res, sampling)
                node.batch.cache_blocks(res)  # (see below: before the first token is out)
            except OutOfBlocks as e:
                await context.abort(
                    grpc.StatusCode.RESOURCE_EXHAUSTED,
                    f"decode node {node.node_id} has no room to compute the prompt of "
                    f"request {req.request_id} ({e}); retry",
                )
            record_span(
                "decode.prefill_here",
                t_wait,
                attributes={
                    "kvmesh.computed_tokens": presp.computed_tokens,
                    "kvmesh.cached_tokens": presp.cached_tokens + presp.fetched_tokens,
                },
            )
            held = pb.DecodeResponse(
                token_ids=[first],
                prefill=presp,
                finish_reason="" if req.max_tokens > 1 else "length",
            )
            if req.max_tokens <= 1:
                yield held
                return
            if not req.report_join:
                yield held
                held = None
        else:
            held = None  # (the caller holds the prefill node's first token)
            if res.pinned and (err := node.check_pinned(res)):
                res.prompt_ids, res.hashes = [], []  # (nothing of it may enter the cache)
                await context.abort(grpc.StatusCode.FAILED_PRECONDITION, err)
            try:
                async with asyncio.timeout(node.cfg.kv_wait_s):
                    await res.kv_ready.wait()
            except TimeoutError:
                await context.abort(
                    grpc.StatusCode.DEADLINE_EXCEEDED,
                    f"KV of request {req.request_id} did not arrive in "
                    f"{node.cfg.kv_wait_s}s; retry the request",
                )
            record_span("decode.kv_wait", t_wait)
            # the prompt's KV is in place and stays as it is: its full blocks are
            # findable from now on, so a request sharing the prefix pins them instead of
            # holding a copy (the conductor counts on it from the first message it gets)
            node.batch.cache_blocks(res)
        res.generated = [first]
        t_decode, n_out = time.time_ns(), 0
        r = Running(
            res,
            first,
            res.prompt_tokens,
            req.max_tokens - 1,
            step,
            sampling,
            frozenset(req.stop_token_ids) | sampling.stop_token_ids,
            tbt_slo_ms=req.tbt_slo_ms,
            join_signal=True,  # (its span; a message only where report_join asks)
        )
        node.batch.admit(r)
        yield r
        try:
            while True:
                item = await r.out.get()
                if item is JOINED:  # its first step begins: the first token may go
                    # from its admission to the first step holding it
                    record_span(
                        "decode.join",
                        t_decode,
                        attributes={"kvmesh.prefill_here": bool(req.prefill_here)},
                    )
                    if req.report_join:
                        yield held if held is not None else pb.DecodeResponse(joined=True)
                    held = None
                    continue
                if isinstance(item, MemoryError):
                    await context.abort(grpc.StatusCode.RESOURCE_EXHAUSTED, str(item))
                if isinstance(item, Exception):
                    await context.abort(grpc.StatusCode.INTERNAL, f"decode failed: {item}")
                tok, reason, lp = item
                n_out += 1
                yield pb.DecodeResponse(
                    token_ids=[tok],
                    finish_reason=reason,
                    logprobs=[lp] if sampling.logprobs else [],
                    top_logprobs=[top_message(r.tops.popleft())] if r.tops else [],
                )
                if reason:
                    return
        finally:
            record_span(
                "decode.generate",
                t_decode,
                attributes={
                    "kvmesh.tokens": n_out,
                    "kvmesh.batch_size": len(node.running),
                    "kvmesh.preemptions": r.preemptions,
                },
            )

    async def Release(self, req, context):
        """Drops a reservation whose prefill failed or whose client went away; one being
        decoded is left to its Decode call, which frees it as it ends. Its blocks are
        fenced unless the caller names the prefill nodes it asked to write them (metadata
        ``kvmesh-prefill-writers``, a JSON list) and each has said it is done (``drop``)."""
        res = self.node.reservations.get(req.request_id)
        if res is None and req.request_id:
            # its Reserve may still be on its way: it will be refused (early_release)
            self.node.released_early.note(req.request_id)
        if res is None or res.decoding:
            return pb.ReleaseResponse(released=False)
        raw = _metadata(context).get(WRITERS_MD)
        if raw is not None:
            try:
                names = json.loads(raw)
                if not isinstance(names, list) or not all(isinstance(n, str) for n in names):
                    raise ValueError
            except ValueError:
                await context.abort(
                    grpc.StatusCode.INVALID_ARGUMENT,
                    f"{WRITERS_MD} must be a JSON list of prefill node ids, got {raw[:100]!r}",
                )
            res.writers = frozenset(names)
        return pb.ReleaseResponse(released=self.node.release(req.request_id, res))

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
        # each Reserve's answer carries its number, each load report the last number at
        # its making, so a conductor knows which reports hold which reservation. Numbered
        # on from the microseconds since the epoch at start: never 0 (a node that does not
        # number says 0), and a restarted node's numbers run on past its earlier ones
        self.reserves = time.time_ns() // 1000
        self.released_early = EarlyReleases(cfg.reservation_timeout_s)
        self.batch: BatchScheduler | None = None
        self._fenced: collections.deque[tuple[float, Reservation]] = collections.deque()
        self._tasks: list[asyncio.Task] = []
        # the conductors' owner keys: an incarnation that ends takes its reservations
        self.owners = Owners(self.etcd, cfg.cluster, self._owner_ended)

    def node_info(self) -> dict:
        return {
            **super().node_info(),
            # Decode answers report_join: a first token may be held until the request
            # is in the running batch
            "reports_join": True,
            "prefill_chunk_ms": self.cfg.prefill_chunk_ms,
            "prefill_chunk_tbt_share": self.cfg.prefill_chunk_tbt_share,
        }

    @property
    def running(self) -> list[Running]:
        return self.batch.running if self.batch else []

    async def setup(self) -> None:
        await super().setup()
        self.batch = BatchScheduler(
            self.model,
            self.pool,
            self.cfg.block_size,
            self.cfg.max_batch,
            self.cfg.step_token_budget,
            frozenset(self.tokenizer.eos_ids),
            on_step=self.events.record_decode,
            on_prompt=self.events.record_prefill,
            counters=self.counters,
            prefill_chunk=self.cfg.prefill_chunk,
            cuda_graphs=self.cfg.cuda_graphs,
            kv_mirror=self.cfg.kv_mirror,
            chunk_ms=self.cfg.prefill_chunk_ms,
            profile=self.profile.get("prefill"),
            tbt_share=self.cfg.prefill_chunk_tbt_share,
        )
        self.te.add_notify_handler(self._on_notify)
        pbg.add_DecodeNodeServicer_to_server(DecodeServicer(self), self.server)

    async def after_start(self) -> None:
        await super().after_start()
        await self.owners.start()
        self._tasks = [
            asyncio.create_task(self.batch.run()),
            asyncio.create_task(self._reap_loop()),
        ]

    def _on_notify(self, payload: bytes) -> None:
        if payload.startswith(b"kv:"):
            res = self.reservations.get(payload[3:].decode(errors="replace"))
            if res is not None:
                res.kv_ready.set()
        elif (drop := parse_drop(payload)) is not None:
            node, rid = drop
            res = self.reservations.get(rid)
            if res is not None:
                res.dropped.add(node)
                return
            for _, fenced in self._fenced:
                if fenced.request_id == rid:
                    fenced.dropped.add(node)
                    if fenced.writes_ended():  # its last writer is done: no need to wait
                        self._fenced = collections.deque(
                            (t, f) for t, f in self._fenced if f is not fenced
                        )
                        self.batch.free(fenced)
                    return

    def reserve(
        self,
        request_id: str,
        prompt_tokens: int,
        conductor: str = "",
        incarnation: str = "",
        hashes: list[bytes] | None = None,
        prefill_here: bool = False,
        max_tokens: int = 0,
    ) -> Reservation:
        """Blocks for the prompt and the first generated token; later ones come as the
        request grows (BatchScheduler). ``conductor``/``incarnation``: its owner.
        ``hashes``: the prompt's full blocks'; the cached prefix they name is pinned
        first and only the rest is taken from the pool (which may evict others' blocks,
        never this prefix); a prefill node writes only the rest. ``prefill_here``: this
        node computes the prompt (no other node writes its blocks)."""
        bs = self.cfg.block_size
        n = prompt_tokens // bs + 1
        pinned: list[int] = []
        if hashes:
            # the last token is always computed: its block is never a cached one
            pinned = self.pool.pin_prefix(hashes[: (prompt_tokens - 1) // bs])
        try:
            blocks = pinned + self.pool.allocate(n - len(pinned))
        except OutOfBlocks:
            self.pool.free(pinned)
            raise
        res = Reservation(
            request_id,
            prompt_tokens,
            blocks,
            conductor=conductor,
            incarnation=incarnation,
            prefill_here=prefill_here,
            pinned=len(pinned),
            max_tokens=max_tokens,
        )
        if res.prefill_here:
            res.writers = frozenset()  # no prefill node writes it: nothing to fence
        self.reservations[request_id] = res
        self.reserves += 1
        return res

    def release(self, request_id: str, res: Reservation | None = None) -> bool:
        """Drops the reservation of ``request_id`` (only if it is ``res``, when given)."""
        if res is not None and self.reservations.get(request_id) is not res:
            return False
        res = self.reservations.pop(request_id, None)
        if res is None:
            return False
        if not res.writes_ended() and res.blocks:
            # its prefill failed or was abandoned and a prefill node may still write these
            # blocks (one not known to be done, or cut off: its writes may land when its link
            # heals), so they are fenced until its TCP connections must have timed out (the
            # transfer engine's user timeout is 20 s), or until every writer says ``drop``
            self._fenced.append((time.monotonic() + self.cfg.fence_s, res))
            return True
        self.batch.free(res)
        return True

    def _owner_ended(self, conductor: str, incarnation: str) -> None:
        """A conductor process ended (its owner key was deleted or expired, or put again
        by a new process under the same id): it will never decode what it reserved. Not
        when it merely deregisters: a stopping conductor still serves while it drains."""
        how = "left" if conductor not in self.owners.current else "restarted"
        for rid, res in list(self.reservations.items()):
            if res.conductor == conductor and res.incarnation == incarnation and not res.decoding:
                log.warning("conductor %s %s; freeing reservation %s", conductor, how, rid)
                self.release(rid, res)

    def reap_due(self, res: Reservation, now: float) -> bool:
        """Whether the reaper frees ``res``: never once decoding; one whose conductor
        process is alive after ``reservation_owned_timeout_s`` (a long prompt may take
        that long to prefill), any other after ``reservation_timeout_s``."""
        if res.decoding:
            return False
        age = now - res.created
        if self.owners.alive(res.conductor, res.incarnation):
            return age > max(self.cfg.reservation_owned_timeout_s, self.cfg.reservation_timeout_s)
        return age > self.cfg.reservation_timeout_s

    def load_info(self) -> dict:
        bs = self.cfg.block_size
        growth = sum([res.growth(bs) for res in self.reservations.values()])
        return {
            **super().load_info(),
            "queue_depth": len(self.reservations) - len(self.running),
            "running": len(self.running),
            # free for new requests: the blocks the requests here may still take as they
            # decode (to prompt + max_tokens, as the conductor books them) are spoken for
            "kv_blocks_free": max(0, self.pool.num_free - growth),
            "reserves": self.reserves,
        }

    def check_prompt(self, req: pb.DecodeRequest, res: Reservation) -> str | None:
        n, bs = len(req.prompt_token_ids), self.cfg.block_size
        if n != res.prompt_tokens:
            return f"prompt_token_ids has {n} tokens; the reservation was for {res.prompt_tokens}"
        if any(t < 0 or t >= self.model_config.vocab_size for t in req.prompt_token_ids):
            return f"token ids must be in [0, {self.model_config.vocab_size})"
        if len(req.block_hashes) > n // bs:
            return "more block hashes than full blocks"
        return None

    def check_pinned(self, res: Reservation) -> str | None:
        """Why the prefix blocks ``res`` pinned by hash at Reserve do not hold its prompt
        (its Decode's hashes and tokens), or None: a prefill node wrote only the blocks
        after them, so they must."""
        bs, cache = self.cfg.block_size, self.pool.prefix_cache
        for i in range(res.pinned):
            want = (
                res.hashes[i] if i < len(res.hashes) else None,
                tuple(res.prompt_ids[i * bs : (i + 1) * bs]),
            )
            if cache.cached_as(res.blocks[i]) != want:
                return (
                    f"request {res.request_id}: the prefix block {i} pinned at Reserve by its "
                    f"hash holds other tokens than the prompt's, or the Decode call's "
                    f"block_hashes differ from the Reserve's; retry the request"
                )
        return None

    async def prefill_here(self, res: Reservation, sampling: Sampling):
        """Colocated / decode-direct route: this node computes the prompt itself,
        reusing whatever prefix its own pool holds, in chunks between decode steps."""
        bs = self.cfg.block_size
        tokens = res.prompt_ids
        n = len(tokens)
        t0 = time.perf_counter()
        local = self.batch.match_prefix(tokens, res.hashes)  # tokens checked this time
        k = len(local)
        # the blocks the match covers go back (the pins Reserve took, fresh ones); pinned
        # blocks past the match hold other tokens (a hash the prompt's tokens do not
        # bear out): they are cached blocks, never written, so fresh ones replace them
        covered = max(k, res.pinned)
        self.pool.free(res.blocks[:covered])
        res.blocks = local + res.blocks[covered:]
        res.pinned = 0
        if covered > k:
            res.blocks[k:k] = self.pool.allocate(covered - k)
        start = k * bs
        times: dict = {}
        logits = await self.batch.compute_prompt(tokens, start, res.blocks, times)
        res.kv_ready.set()
        hist = History(tokens, (), frozenset(self.tokenizer.eos_ids))
        first, first_lp = sample_with_logprob(logits, sampling, 0, hist)
        first_top = first_alternatives(logits, sampling)
        self.counters["computed"] += n - start
        self.counters["cached"] += start
        # queue: the wait for the prompts computed here before it; prefill: the rest,
        # the steps of the running batch between its chunks included
        queue_ms = times.get("queue_ms", 0.0)
        return first, pb.PrefillResponse(
            first_token=first,
            computed_tokens=n - start,
            cached_tokens=start,
            first_logprob=first_lp if sampling.logprobs else 0.0,
            first_top=first_top,
            prefill_ms=(time.perf_counter() - t0) * 1000 - queue_ms,
            queue_ms=queue_ms,
        )

    def retire(self, r: Running) -> None:
        self.batch.leave(r)
        self.release(r.res.request_id)

    async def _reap_loop(self) -> None:
        while True:
            await asyncio.sleep(1.0)
            now = time.monotonic()
            while self._fenced and self._fenced[0][0] <= now:
                self.batch.free(self._fenced.popleft()[1])
            for rid, res in list(self.reservations.items()):
                if self.reap_due(res, now):
                    log.warning("reservation %s never decoded; freeing it", rid)
                    self.release(rid)

    async def drain(self) -> None:
        deadline = time.monotonic() + 20
        while self.running and time.monotonic() < deadline:
            await asyncio.sleep(0.05)

    async def teardown(self) -> None:
        for t in self._tasks:
            t.cancel()
        await self.owners.stop()
        await super().teardown()


def main(argv: list[str] | None = None) -> None:
    cfg = load(DecodeConfig, argv, prog="kvmesh decode", section="decode")
    setup_logging(cfg.log_level, "decode")
    run(lambda: DecodeNode(cfg))
