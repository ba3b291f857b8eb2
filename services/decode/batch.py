"""Continuous batching on a decode node, over one paged KV pool.

States of a request here: ``running`` (decoded every step, in order of admission) ->
done; or, when the pool runs out of blocks mid-decode, the youngest running request is
``preempted``: its full blocks stay in the prefix cache under their hashes, the rest go
back to the pool, and it waits in ``waiting``. When blocks free up it is resumed: its
cached prefix is matched, the remainder recomputed (chunked), and decoding goes on from
the same position with the same next token, so no token changes.

One model computation runs at a time (``compute``, a FIFO lock): a decode step, or one
chunk of a prompt being computed here (colocated route, decode-direct, resume). Prompts
take their turn one at a time (``_prompt_turn``, FIFO; a resume goes past them), so at
most one chunk waits for the compute beside the batch's next step and the two alternate:
a running request never waits for more than one chunk between two steps, however many
prompts are queued (with every queued chunk in one FIFO, a burst of short prompts
computed here stalled the running batch for all of them: issue 31's hand-off gap); and a
request just admitted, not yet in a step, goes before the next chunk of a queued prompt. A
chunk holds at most ``step_token_budget`` minus the running batch's tokens (and at most
``prefill_chunk_tokens``); while requests decode, also at most the ms of compute (by the
node's measured prefill speed, :class:`ChunkClock`) that keep the next step within
``tbt_share`` of the tightest TBT SLO among them (``Running.tbt_slo_ms``: the SLO less the
last step's time), and at most ``chunk_ms`` where that is set: a prompt computed here
adds no more to the running requests' time between tokens than their SLOs leave, and no
more than that to how long a request whose KV has landed waits to join the batch. With
nothing decoding, chunks are bounded by tokens alone (no one waits on them between
tokens), and so they are where the SLOs are loose: a node computing every prompt keeps
its prefill rate (a fixed 50 ms bound halved it where steps were long).

A request joins the running batch at once (``admit``) and is in the next step; with
``join_signal`` its queue gets :data:`JOINED` as the first step holding it begins, so
the node (or the conductor) can hold its first token until then: the first-to-second-
token gap is then one step, like every later gap (the hand-off is a TBT, not a TTFT).
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import logging
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field

import torch

from kvmesh.services.common.hashing import prefix_hashes
from kvmesh.services.common.sampling_params import Sampling
from kvmesh.services.engine.cuda_graphs import DecodeRunner
from kvmesh.services.engine.kv_mirror import KVMirror
from kvmesh.services.engine.kv_pool import OutOfBlocks
from kvmesh.services.engine.sampler_device import History, sample_batch, top_alternatives
from kvmesh.services.engine.sampling import sample_with_logprob
from kvmesh.services.model_node import to_the_end

log = logging.getLogger(__name__)
_seq = itertools.count()

# put in a ``join_signal`` request's queue as the first step that holds it begins (or as
# it is preempted before one: its first token is held no longer)
JOINED = "joined"


class ChunkClock:
    """How many prompt tokens one chunk computed here may hold to take at most a given
    number of ms: a chunk of ``n`` tokens from position ``pos`` modelled as ``(c0 + n x
    (a + b x context)) x factor`` (context = pos + n/2; ``c0`` a forward's own cost),
    ``c0``, ``a`` and ``b`` fitted to the node's start-up profile (``(new, cached, ms)``
    points), ``factor`` the recent measured / modelled ratio of its chunks (load, a CPU
    budget's throttling). Without a profile the first chunk measured sets ``a``."""

    def __init__(self, points: list | None = None) -> None:
        self.c0, self.a, self.b, self.factor = 0.0, 0.0, 0.0, 1.0
        pts = [(float(n), c + n / 2, float(ms)) for n, c, ms in points or () if n > 0 and ms > 0]
        if len(pts) >= 3:  # least squares over (1, n, n x context)
            x = torch.tensor([[1.0, n, n * ctx] for n, ctx, _ in pts], dtype=torch.float64)
            y = torch.tensor([[ms] for _, _, ms in pts], dtype=torch.float64)
            try:
                c0, a, b = (float(v) for v in torch.linalg.lstsq(x, y).solution.flatten())
            except RuntimeError:
                c0 = a = b = -1.0
            if c0 >= 0 and a > 0 and b >= 0:
                self.c0, self.a, self.b = c0, a, b
                return
        per_token = [(ctx, ms / n) for n, ctx, ms in pts]  # else per token, no c0
        if per_token:
            mx = sum(x for x, _ in per_token) / len(per_token)
            my = sum(y for _, y in per_token) / len(per_token)
            var = sum((x - mx) ** 2 for x, _ in per_token)
            b = sum((x - mx) * (y - my) for x, y in per_token) / var if var > 0 else 0.0
            self.b = max(0.0, b)
            self.a = max(my - self.b * mx, my * 0.1)

    def ms(self, tokens: int, pos: int) -> float:
        """Predicted ms of a chunk of ``tokens`` starting at position ``pos``."""
        return (self.c0 + tokens * (self.a + self.b * (pos + tokens / 2))) * self.factor

    def tokens(self, pos: int, most: int, bs: int, budget_ms: float) -> int:
        """Tokens of the next chunk from ``pos``: at most ``most``, in whole blocks of
        ``bs`` (at least one), within ``budget_ms`` by the model (``inf``: ``most``)."""
        if budget_ms == float("inf") or self.a <= 0 or most <= bs:
            return most
        # the largest c with c0 + c x (a + b x (pos + c / 2)) <= budget_ms / factor
        budget = budget_ms / self.factor - self.c0
        if budget <= 0:
            return bs
        lin, quad = self.a + self.b * pos, self.b / 2
        # the root of quad c^2 + lin c - budget, in the form that stays exact as quad
        # goes to 0: (-lin + sqrt(...)) / (2 quad) cancels, and with a fitted b of
        # 1.7e-18 a 20 ms budget came out as the whole prompt
        c = 2 * budget / (lin + (lin * lin + 4 * quad * budget) ** 0.5)
        return max(bs, min(most, int(c) // bs * bs))

    def observe(self, tokens: int, pos: int, ms: float) -> None:
        """A chunk of ``tokens`` from ``pos`` took ``ms``."""
        if tokens <= 0 or ms <= 0:
            return
        if self.a <= 0:
            self.a = ms / tokens
            return
        ratio = ms / max(1e-9, self.ms(tokens, pos) / self.factor)
        self.factor = min(20.0, max(0.05, 0.7 * self.factor + 0.3 * ratio))


@dataclass(eq=False)
class Reservation:
    """KV blocks held for one request, from Reserve to its end."""

    request_id: str
    prompt_tokens: int
    blocks: list[int]
    created: float = field(default_factory=time.monotonic)
    kv_ready: asyncio.Event = field(default_factory=asyncio.Event)
    decoding: bool = False
    prompt_ids: list[int] = field(default_factory=list)  # to cache and to recompute
    hashes: list[bytes] = field(default_factory=list)  # of the prompt's full blocks
    generated: list[int] = field(default_factory=list)  # first token onwards
    conductor: str = ""  # the conductor that reserved it: its reservations go with it
    incarnation: str = ""  # that conductor's process (services.common.ownership)
    # prefill nodes that said they will never write these blocks again (``drop``), and
    # those that may have been asked to (named at Release; None = unknown, fence them)
    dropped: set[str] = field(default_factory=set)
    writers: frozenset[str] | None = None
    # computed here (Reserve said prefill_here): no other node may write its blocks
    prefill_here: bool = False
    # its first ``pinned`` blocks are cached prefix blocks pinned by hash at Reserve
    # (shared with other requests: never written, by a prefill node or by this one)
    pinned: int = 0
    max_tokens: int = 0  # its KV grows to prompt_tokens + max_tokens tokens at most

    def growth(self, bs: int) -> int:
        """Blocks it may still take from the pool as it decodes (all of them again
        while preempted)."""
        if not self.max_tokens:
            return 0
        return max(0, -(-(self.prompt_tokens + self.max_tokens) // bs) - len(self.blocks))

    def writes_ended(self) -> bool:
        """Whether no prefill node can write this reservation's blocks any more."""
        return self.kv_ready.is_set() or (self.writers is not None and self.writers <= self.dropped)


@dataclass(eq=False)
class Running:
    """A request being decoded: its next input token sits at ``position``."""

    res: Reservation
    token: int
    position: int
    remaining: int
    step: int
    sampling: Sampling
    stop_ids: frozenset[int]
    out: asyncio.Queue = field(default_factory=asyncio.Queue)
    seq: int = field(default_factory=lambda: next(_seq))  # admission order: youngest = max
    preemptions: int = 0
    left: bool = False  # its client went away (leave)
    tbt_slo_ms: float = 0.0  # its TBT SLO (0: none given): prompt chunks here respect it
    join_signal: bool = False  # put JOINED in ``out`` as its first step begins
    joined: bool = False  # a step holding it has begun (or JOINED was put anyway)
    # each token's top alternatives, in the order of its tokens in ``out`` (only when
    # sampling.top_logprobs asks for them)
    tops: deque = field(default_factory=deque)

    def signal_join(self) -> None:
        if not self.joined:
            self.joined = True
            if self.join_signal:
                self.out.put_nowait(JOINED)


class BatchScheduler:
    def __init__(
        self,
        model,
        pool,
        block_size: int,
        max_batch: int,
        step_token_budget: int,
        eos_ids: frozenset[int],
        on_step: Callable[[int, int, float], None],
        on_prompt: Callable[[int, int, float], None],
        counters: dict,
        prefill_chunk: int | None = None,
        cuda_graphs: bool = True,
        kv_mirror: bool = True,
        chunk_ms: float = 0.0,
        profile: list | None = None,
        tbt_share: float = 0.0,
    ) -> None:
        self.model, self.pool, self.bs = model, pool, block_size
        self.max_batch, self.budget = max_batch, step_token_budget
        self.prefill_chunk = prefill_chunk or step_token_budget  # most tokens of one chunk
        self.eos_ids = eos_ids
        self.on_step, self.on_prompt = on_step, on_prompt
        self.counters = counters
        self.running: list[Running] = []
        self.waiting: deque[Running] = deque()
        self.compute = asyncio.Lock()
        self._prompt_turn = asyncio.Lock()  # one prompt computed at a time, FIFO
        self._stepped = asyncio.Event()  # a step began: the requests in it have joined
        self.clock = ChunkClock(profile)
        self.chunk_ms, self.tbt_share = chunk_ms, tbt_share  # (see the module docstring)
        self.step_ms = 0.0  # the last decode step's time
        self.preemptions = 0
        self._wake = asyncio.Event()
        self._in_step: list[Running] = []
        self._deferred: list[Reservation] = []
        self._resuming: Running | None = None  # a preempted request whose KV is recomputed
        # on a GPU: padded batch buckets, static inputs, CUDA graphs (cuda_graphs.py)
        on_cpu = pool.kv.device.type == "cpu"
        self.decoder = None if on_cpu else DecodeRunner(model, pool, max_batch, cuda_graphs)
        # on the CPU: each running request's KV also as float32, contiguous per head
        # (kv_mirror.py), room for the whole pool plus each request's capacity rounding
        self.mirror: KVMirror | None = None
        if on_cpu and kv_mirror:
            self.mirror = KVMirror.for_pool(pool.config, pool.num_blocks, block_size)

    # -- prompt computation ----------------------------------------------------------------
    async def compute_prompt(
        self,
        tokens: list[int],
        start: int,
        table: list[int],
        times: dict | None = None,
        queue: bool = True,
    ):
        """KV of ``tokens[start:]`` into ``table``, chunk by chunk; logits of the last.
        Waits for the prompts queued before it (``queue``; a resume does not), then each
        chunk waits for the compute, so the batch steps between two chunks. ``times``,
        when given, gets ``queue_ms`` (the wait for its turn) and ``compute_ms`` (its
        forwards alone)."""
        t0 = time.perf_counter()
        async with self._prompt_turn if queue else contextlib.nullcontext():
            t_turn = time.perf_counter()
            logits, pos, n, compute_ms = None, start, len(tokens), 0.0
            while pos < n:
                # a request just admitted (its KV landed, or its prompt just ended here)
                # goes first: the next step holds it before this prompt's next chunk
                while queue and any(not r.joined for r in self.running):
                    self._stepped.clear()
                    await self._stepped.wait()
                async with self.compute:
                    # sized as it starts: by the batch running now and the node's speed
                    most = min(self.prefill_chunk, max(self.bs, self.budget - len(self.running)))
                    budget = self.chunk_budget_ms()
                    end = min(n, pos + self.clock.tokens(pos, most, self.bs, budget))
                    tc = time.perf_counter()
                    # a cancelled request (the client went away) frees its blocks only once
                    # the forward writing them has ended, and the slot passes on only then
                    logits = await to_the_end(
                        asyncio.to_thread(
                            self.model.forward_prefill,
                            torch.tensor(tokens[pos:end], dtype=torch.long),
                            pos,
                            self.pool,
                            table,
                        )
                    )
                    ms = (time.perf_counter() - tc) * 1000
                self.clock.observe(end - pos, pos, ms)
                compute_ms += ms
                pos = end
        # the node's compute time on it (what the conductor's time model fits); the waits
        # for its turn and for the steps between its chunks are the node's rate and queue
        self.on_prompt(n - start, start, compute_ms)
        if times is not None:
            times["queue_ms"] = (t_turn - t0) * 1000
            times["compute_ms"] = compute_ms
        return logits

    def chunk_budget_ms(self) -> float:
        """The most ms the next prompt chunk may take (``inf``: no bound by time): with
        nothing decoding, none; else ``chunk_ms`` where set, and ``tbt_share`` of the
        tightest TBT SLO of the running requests less the last step's time."""
        if not self.running:
            return float("inf")
        budget = self.chunk_ms if self.chunk_ms > 0 else float("inf")
        if self.tbt_share > 0:
            slos = [r.tbt_slo_ms for r in self.running if r.tbt_slo_ms > 0]
            if slos:
                budget = min(budget, self.tbt_share * min(slos) - self.step_ms)
        return budget

    def match_prefix(self, tokens: list[int], hashes: list[bytes]) -> list[int]:
        """Blocks of the longest cached prefix (referenced), leaving >= 1 token to compute."""
        bs = self.bs
        usable = min(len(hashes), (len(tokens) - 1) // bs)
        return self.pool.match(
            hashes[:usable], [tuple(tokens[i * bs : (i + 1) * bs]) for i in range(usable)]
        )

    # -- blocks ------------------------------------------------------------------------------
    def chain(self, res: Reservation) -> tuple[list[int], list[bytes]] | None:
        """Tokens whose KV the request holds, and the hashes of their full blocks."""
        bs = self.bs
        if not res.prompt_ids or len(res.hashes) != len(res.prompt_ids) // bs:
            return None
        tokens = res.prompt_ids + res.generated[:-1]  # the last token's KV is not computed
        hashes = list(res.hashes)
        if hashes:
            hashes += prefix_hashes(hashes[-1], tokens[len(hashes) * bs :], bs)
        return tokens, hashes

    def cache_blocks(self, res: Reservation) -> None:
        """Full blocks whose KV this node holds become findable in its prefix cache: a
        request sharing the prompt's prefix pins them while this one decodes (called once
        the prompt's KV is in place), and the next turn of a conversation (decode-direct)
        or a resumed request starts from them (called again when the blocks go back)."""
        got = self.chain(res) if res.kv_ready.is_set() else None
        if got is None:
            return
        tokens, hashes = got
        bs = self.bs
        cache = self.pool.prefix_cache
        for i, h in enumerate(hashes[: len(res.blocks)]):
            was = cache.cached_as(res.blocks[i])
            if was is not None and was[0] != h:
                break  # a pinned block under another hash: the chain is not this one's
            self.pool.insert(
                h,
                res.blocks[i],
                tokens[i * bs : (i + 1) * bs],
                parent_hash=hashes[i - 1] if i else None,
            )

    def free(self, res: Reservation) -> None:
        if any(r.res is res for r in self._in_step) or (
            self._resuming is not None and self._resuming.res is res
        ):
            self._deferred.append(res)  # the step thread may still write its KV
            return
        if self.mirror is not None:  # at once when no step runs (nothing reads the mirror)
            self.mirror.drop(res, at_once=not self._in_step)
        try:
            self.cache_blocks(res)
        finally:  # (whatever caching makes of it, the blocks go back)
            self.pool.free(res.blocks)
            res.blocks = []
        self._wake.set()  # a preempted request may fit now

    def _free_deferred(self) -> None:
        deferred, self._deferred = self._deferred, []
        for res in deferred:
            self.free(res)

    # -- admission ---------------------------------------------------------------------------
    def admit(self, r: Running) -> None:
        self.running.append(r)
        self._wake.set()

    def leave(self, r: Running) -> None:
        r.left = True
        if r in self.running:
            self.running.remove(r)
        if r in self.waiting:
            self.waiting.remove(r)

    def _preempt(self, victim: Running) -> None:
        self.running.remove(victim)
        victim.signal_join()  # (not joined: its first token is held no longer)
        self.free(victim.res)
        victim.preemptions += 1
        self.preemptions += 1
        self.waiting.append(victim)
        log.info(
            "preempted %s at position %d (pool out of blocks)",
            victim.res.request_id,
            victim.position,
        )

    async def _resume(self, r: Running) -> bool:
        """Rebuilds a preempted request's KV; False if the pool has no room yet."""
        got = self.chain(r.res)
        tokens, hashes = got
        need = r.position // self.bs + 1
        if self.pool.num_free < need:
            return False
        local = self.match_prefix(tokens, hashes)
        table = local + self.pool.allocate(need - len(local))
        r.res.blocks = table
        self._resuming = r  # a free() meanwhile waits for the compute (it writes the blocks)
        try:
            await self.compute_prompt(tokens, len(local) * self.bs, table, queue=False)
        finally:
            self._resuming = None
            self._free_deferred()
        if r.left:  # its client went away meanwhile
            return True
        if not r.res.blocks:  # freed meanwhile by something else than its client leaving
            r.out.put_nowait(
                MemoryError(f"request {r.res.request_id} lost its KV while resuming; retry")
            )
            return True
        self.running.append(r)
        return True

    def _grow(self, batch: list[Running]) -> list[Running]:
        """A block for every request whose next position starts one; preempts the
        youngest running request (maybe the one growing) when the pool is out."""
        for r in batch:
            while r in self.running and len(r.res.blocks) <= r.position // self.bs:
                try:
                    r.res.blocks += self.pool.allocate(1)
                except OutOfBlocks:
                    victim = max(self.running, key=lambda x: x.seq)
                    if self.chain(victim.res) is None:  # cannot be recomputed
                        # it fails, and its blocks go back at once: left held until its
                        # RPC ends, the next miss would preempt another (maybe the oldest)
                        self.running.remove(victim)
                        self.free(victim.res)
                        victim.out.put_nowait(
                            MemoryError(
                                f"the KV pool has no room to grow request "
                                f"{victim.res.request_id}; retry"
                            )
                        )
                    else:
                        self._preempt(victim)
        return [r for r in batch if r in self.running]

    def history(self, r: Running) -> History:
        """What request ``r``'s logits processing reads: its own prompt and output (the
        same on any node), and the model's EOS ids. Empty when it processes none."""
        if not r.sampling.processes_logits:
            return History()
        return History(r.res.prompt_ids, r.res.generated, self.eos_ids)

    # -- the loop ----------------------------------------------------------------------------
    async def run(self) -> None:
        while True:
            while self.waiting and await self._resume(r := self.waiting[0]):
                if r in self.waiting:  # leave() may have taken it out meanwhile
                    self.waiting.remove(r)
            if self.waiting and self.waiting[0].position // self.bs + 1 > self.pool.num_blocks:
                r = self.waiting.popleft()  # it could never fit, even alone
                r.out.put_nowait(
                    MemoryError(
                        f"the KV pool cannot hold request "
                        f"{r.res.request_id}; retry on a larger node"
                    )
                )
                continue
            if not self.running:  # wait for an admission, or for blocks to free up
                self._wake.clear()
                await self._wake.wait()
                continue
            await self._step()
            # round-robin so a batch larger than max_batch shares steps fairly
            if len(self.running) > self.max_batch:
                self.running = self.running[self.max_batch :] + self.running[: self.max_batch]

    async def _step(self) -> None:
        async with self.compute:
            # the batch as the step begins, not as it began to wait for the compute (a
            # prompt's chunk): a request admitted meanwhile is in this step
            batch = self._grow(self.running[: self.max_batch])
            if not batch:
                return
            tokens = torch.tensor([r.token for r in batch], dtype=torch.long)
            positions = [r.position for r in batch]
            tables = [r.res.blocks for r in batch]
            self._in_step = batch
            try:
                for r in batch:  # the step that computes its next token begins
                    r.signal_join()
                self._stepped.set()
                tc = time.perf_counter()
                if self.decoder is None:
                    kw = {}
                    if self.mirror is not None:
                        kw = {"mirror": self.mirror, "keys": [r.res for r in batch]}
                    logits = await asyncio.to_thread(
                        self.model.forward_decode, tokens, positions, tables, self.pool, **kw
                    )
                else:
                    logits = await asyncio.to_thread(self.decoder.step, tokens, positions, tables)
                self.step_ms = (time.perf_counter() - tc) * 1000
                self.on_step(len(batch), sum(positions) + len(batch), self.step_ms)
            except Exception as e:
                # the batch loop must outlive a failed step (a bug, not a client's mistake):
                # logged with its traceback, it fails only the requests of this step
                log.exception("decode step failed")
                for r in batch:
                    r.out.put_nowait(e)
                    self.leave(r)
                return
            finally:
                self._in_step = []
                self._free_deferred()
        if self.decoder is None:  # CPU: row by row (batched ops are not faster there,
            # loadtest/bench_sampler.py), the same tokens as the batch sampler
            drawn = [
                sample_with_logprob(logits[i], r.sampling, r.step, self.history(r))
                for i, r in enumerate(batch)
            ]
        else:  # GPU: the whole batch sampled on the device, one host sync (sampler_device)
            drawn = sample_batch(
                logits,
                [r.sampling for r in batch],
                [r.step for r in batch],
                [self.history(r) for r in batch],
            )
        ks = [r.sampling.top_logprobs if r.sampling.logprobs else 0 for r in batch]
        tops = top_alternatives(logits, ks) if any(ks) else None
        for i, (r, (tok, lp)) in enumerate(zip(batch, drawn, strict=True)):
            if r not in self.running:  # left (client gone) while the step ran
                continue
            if tops is not None and ks[i]:
                r.tops.append(tops[i])  # (read beside its token: Decode pops one per token)
            r.token, r.position, r.step = tok, r.position + 1, r.step + 1
            r.res.generated.append(tok)
            r.remaining -= 1
            self.counters["generated"] += 1
            reason = ""
            if (tok in self.eos_ids and not r.sampling.ignore_eos) or tok in r.stop_ids:
                reason = "stop"
            elif r.remaining <= 0:
                reason = "length"
            r.out.put_nowait((tok, reason, lp))
            if reason:
                self.running.remove(r)
