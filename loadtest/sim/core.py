"""A discrete-event simulation of a kvmesh cluster at paper scale, driven by the REAL
conductor policy (``kvmesh.services.conductor.policy.Scheduler`` with a simulated clock, the real
``CacheIndex`` and the real ``PrefillModel``/``DecodeModel`` estimators).

What is simulated (times from :class:`CostModel`):

- prefill node: a FIFO queue, one prefill at a time; time = prefill(new, cached) + the
  store fetch (bytes / bandwidth, not overlapped) + the handoff tail (the last layer of
  the new blocks; the rest streams layer-wise behind compute). Its DRAM holds an LRU
  prefix cache of ``cache_blocks`` blocks. The cluster store is the union of these caches
  (Mooncake Store pools the nodes' DRAM): a block is "in the store" while any node holds
  it. Every policy's nodes reuse their *own* cache (automatic prefix caching); only
  ``kvmesh`` fetches blocks from other nodes (and keeps a replica: hot prefixes spread).
- decode node: continuous batching; one step = decode(B, K) ms for B requests attending
  over K tokens; KV capacity in tokens; the conductor's reservations (prompt + max
  tokens) are held from admission to the end; load reports every ``report_ms``.
- colocated route (``kvmesh`` only, prompts < ``colocate_below_tokens``): the decode node
  prefills between two steps, stalling its batch for that time.

The scheduler sees exactly what the real conductor sees: its own bookings (``commit``,
``prefill_done`` with the node's queue and slot times, ``request_done``), periodic KV
reports, block events in the index, and the prefill nodes' samples of their compute and
of their store fetches, each for its own model. Its time models start with the true
coefficients (a calibrated cluster) and keep refitting from the observed times, as in
production.
"""

from __future__ import annotations

import heapq
import random
from collections import OrderedDict
from dataclasses import dataclass, field

from kvmesh.services.conductor.index import CacheIndex
from kvmesh.services.conductor.policy import (
    DISAGG,
    INFEASIBLE,
    DecodeNodeState,
    PolicyConfig,
    PrefillNodeState,
    Request,
    Scheduler,
)


@dataclass
class CostModel:
    """LLaMA3-70B-class model on one 8-GPU A800-80GB node (tensor parallel 8), bf16.

    Derivation (documented so it can be challenged; fit your own with ``--fit``-style
    overrides on the command line):
    - prefill linear: 2 x 70e9 FLOP/token; 8 x 312 TFLOP/s bf16 at ~50% MFU = 1.25 PFLOP/s
      -> 0.11 ms/token (~9k tokens/s per node, in line with published 70B TP8 prefill);
    - prefill attention: 4 x d_model (8192) FLOP per layer per (query, key) pair, 80 layers,
      causal ~half -> ~1.5e-6 ms per pair (the ``n·(n+c)`` term of PrefillModel);
    - decode: weights 140 GB read per step over 8 x 2.0 TB/s at ~60% -> ~15 ms base,
      +0.2 ms per request (sampling, scheduling), KV read 320 KiB/token (GQA 8 KV heads x
      128 x 80 layers x K,V x 2 B) at ~9.6 TB/s -> 3.3e-5 ms per KV token;
    - KV capacity per decode node: 640 GB HBM - 140 GB weights - activations ~ 400 GB
      -> ~1.2M tokens;
    - transfer: 4 x 100 Gb/s RDMA NICs usable per node ~ 50 GB/s (the paper's nodes have
      8 x 200-400 Gb/s; this is deliberately conservative);
    - DRAM prefix cache per node: 2,000 blocks of 512 tokens (160 MiB each) ~ 320 GB.
    """

    prefill_base_ms: float = 30.0
    prefill_per_token_ms: float = 0.11
    prefill_pair_ms: float = 1.5e-6
    decode_base_ms: float = 15.0
    decode_per_request_ms: float = 0.2
    decode_per_kv_token_ms: float = 3.3e-5
    kv_bytes_per_token: int = 327_680
    layers: int = 80
    bandwidth_gbps: float = 50.0  # GB/s per node
    decode_kv_tokens: int = 1_200_000
    cache_blocks: int = 2_000

    def prefill_ms(self, new: int, cached: int) -> float:
        return (
            self.prefill_base_ms
            + self.prefill_per_token_ms * new
            + self.prefill_pair_ms * new * (new + cached)
        )

    def decode_ms(self, batch: int, kv_tokens: int) -> float:
        return (
            self.decode_base_ms
            + self.decode_per_request_ms * batch
            + self.decode_per_kv_token_ms * kv_tokens
        )

    @property
    def bytes_per_ms(self) -> float:
        return self.bandwidth_gbps * 1e6


@dataclass
class SimConfig:
    policy: str = "kvmesh"
    prefill_nodes: int = 8
    decode_nodes: int = 8
    block_size: int = 512
    ttft_slo_ms: float = 1e12  # huge = no rejection on TTFT
    tbt_slo_ms: float = 1e12
    colocate_below_tokens: int = 512
    report_ms: float = 200.0
    sample_ms: float = 1000.0
    time_scale: float = 1.0  # multiplies inter-arrival times
    max_requests: int | None = None
    seed: int = 0
    cost: CostModel = field(default_factory=CostModel)


class _LRU:
    def __init__(self, cap: int) -> None:
        self.cap, self.d = cap, OrderedDict()

    def __contains__(self, h) -> bool:
        return h in self.d

    def touch(self, hs) -> None:
        for h in hs:
            if h in self.d:
                self.d.move_to_end(h)

    def add(self, hs) -> tuple[list, list]:
        """Inserts; returns (new, evicted)."""
        new, out = [], []
        for h in hs:
            if h in self.d:
                self.d.move_to_end(h)
                continue
            self.d[h] = None
            new.append(h)
        while len(self.d) > self.cap:
            h, _ = self.d.popitem(last=False)
            out.append(h)
        return new, out


@dataclass
class _Req:
    r: Request
    arrival: float
    output: int
    decision: object = None
    start: float = 0.0
    prefill_end: float = 0.0
    first_token: float | None = None
    new: int = 0
    cached: int = 0
    fetched: int = 0
    steps_ms: float = 0.0
    produced: int = 0
    status: str = "OK"
    reason: str = ""


class Simulation:
    def __init__(self, trace: list[dict], cfg: SimConfig) -> None:
        self.cfg, self.cost = cfg, cfg.cost
        self.now = 0.0
        self._ev: list = []
        self._seq = 0
        self.sched = Scheduler(
            PolicyConfig(
                policy=cfg.policy,
                colocate_below_tokens=cfg.colocate_below_tokens,
                slo_margin=1.0,
                wait_for_kv=False,  # (the simulation reserves at admission: no waiting)
            ),
            index=CacheIndex(),
            clock=lambda: self.now,
            rng=random.Random(cfg.seed),
        )
        # (Scheduler does ``index or CacheIndex()``: an empty CacheIndex is falsy (it has
        # __len__), so the one passed in is replaced; use the scheduler's own)
        self.index = self.sched.index
        c, bs = self.cost, cfg.block_size
        block_nbytes = c.kv_bytes_per_token * bs
        self.block_nbytes = block_nbytes
        total_blocks = c.decode_kv_tokens // bs
        coef_p = (c.prefill_base_ms, c.prefill_per_token_ms, c.prefill_pair_ms)
        coef_d = (c.decode_base_ms, c.decode_per_request_ms, c.decode_per_kv_token_ms)
        for i in range(cfg.prefill_nodes):
            p = PrefillNodeState(
                f"p{i}", bs, block_nbytes, block_nbytes // c.layers, bandwidth=c.bytes_per_ms
            )
            p.model.coef = list(coef_p)
            self.sched.prefill[p.node_id] = p
        for i in range(cfg.decode_nodes):
            d = DecodeNodeState(f"d{i}", bs, total_blocks, total_blocks, bandwidth=c.bytes_per_ms)
            d.model.coef = list(coef_d)
            d.prefill_model.coef = list(coef_p)
            self.sched.decode[d.node_id] = d
        # physical state
        self.cache = {p: _LRU(c.cache_blocks) for p in self.sched.prefill}
        self.pqueue: dict[str, list[_Req]] = {p: [] for p in self.sched.prefill}
        self.pbusy: dict[str, _Req | None] = {p: None for p in self.sched.prefill}
        self.pqueued_ms: dict[str, float] = {p: 0.0 for p in self.sched.prefill}
        self.dbatch: dict[str, list[_Req]] = {d: [] for d in self.sched.decode}
        self.djoin: dict[str, list[_Req]] = {d: [] for d in self.sched.decode}
        self.dprefill: dict[str, list[_Req]] = {d: [] for d in self.sched.decode}
        self.dstepping: dict[str, bool] = {d: False for d in self.sched.decode}
        self.dreserved: dict[str, int] = {d: 0 for d in self.sched.decode}
        self.total_blocks = total_blocks
        self.reqs: list[_Req] = []
        self.samples: list[dict] = []
        self.store_bytes_read = 0
        self.decisions = 0
        for i, rec in enumerate(trace[: cfg.max_requests] if cfg.max_requests else trace):
            hashes = [int(h).to_bytes(8, "little") for h in rec["hash_ids"]]
            n = int(rec["input_length"])
            m = max(1, int(rec["output_length"]))
            rq = _Req(
                Request(f"r{i}", n, hashes, m, cfg.ttft_slo_ms, cfg.tbt_slo_ms),
                rec["timestamp"] * cfg.time_scale,
                m,
            )
            self.reqs.append(rq)
            self._push(rq.arrival, "arrive", rq)
        self._push(0.0, "report", None)
        self._push(0.0, "sample", None)
        self._last_arrival = max((r.arrival for r in self.reqs), default=0.0)

    # -- events ---------------------------------------------------------------------------
    def _push(self, t: float, kind: str, obj) -> None:
        self._seq += 1
        heapq.heappush(self._ev, (t, self._seq, kind, obj))

    def run(self) -> Simulation:
        while self._ev:
            t, _, kind, obj = heapq.heappop(self._ev)
            self.now = t
            getattr(self, "_on_" + kind)(obj)
        return self

    def _busy(self) -> bool:
        return (
            any(self.pqueue.values())
            or any(self.pbusy.values())
            or any(self.dbatch.values())
            or any(self.djoin.values())
            or any(self.dprefill.values())
        )

    def _on_report(self, _) -> None:
        for d, st in self.sched.decode.items():
            st.report(self.total_blocks - self.dreserved[d], self.total_blocks)
        if self.now < self._last_arrival or self._busy():
            self._push(self.now + self.cfg.report_ms, "report", None)

    def _on_sample(self, _) -> None:
        np_, nd = len(self.pqueue), len(self.dbatch)
        self.samples.append(
            {
                "t_s": round(self.now / 1000.0, 3),
                # prefill load: seconds of work queued or running per prefill node
                "prefill_load_s": round(sum(self.pqueued_ms.values()) / np_ / 1000.0, 3),
                # decode load: running batch per decode node, and KV reserved share
                "decode_batch": round(sum(len(b) for b in self.dbatch.values()) / nd, 2),
                "decode_kv": round(sum(self.dreserved.values()) / (nd * self.total_blocks), 4),
            }
        )
        if self.now < self._last_arrival or self._busy():
            self._push(self.now + self.cfg.sample_ms, "sample", None)

    def _on_arrive(self, rq: _Req) -> None:
        d = self.sched.decide(rq.r)
        self.decisions += 1
        rq.decision = d
        if not d.accepted:
            # as the conductor answers: no node could ever serve it, or retry later
            code = "INVALID_ARGUMENT" if d.reason == INFEASIBLE else "RESOURCE_EXHAUSTED"
            rq.status, rq.reason = code, d.reason
            return
        self.sched.commit(rq.r, d)
        bs = self.cfg.block_size
        self.dreserved[d.decode_node] += -(-(rq.r.n_tokens + rq.r.max_tokens) // bs)
        if d.route == DISAGG:
            p = d.prefill_node
            self.pqueue[p].append(rq)
            self.pqueued_ms[p] += d.estimate.prefill_ms + d.estimate.fetch_ms
            if self.pbusy[p] is None:
                self._start_prefill(p)
        else:
            self.dprefill[d.decode_node].append(rq)
            self._kick_decode(d.decode_node)

    # -- prefill node ---------------------------------------------------------------------
    def _prefix(self, p: str, hashes: list[bytes]) -> int:
        lru, k = self.cache[p], 0
        for h in hashes:
            if h not in lru:
                break
            k += 1
        return k

    def _store_prefix(self, hashes: list[bytes]) -> int:
        return self.index.lookup(hashes).store_prefix

    def _start_prefill(self, p: str) -> None:
        rq = self.pqueue[p].pop(0)
        self.pbusy[p] = rq
        r, d, bs, c = rq.r, rq.decision, self.cfg.block_size, self.cost
        usable = min(len(r.hashes), (r.n_tokens - 1) // bs)
        local = self._prefix(p, r.hashes[:usable])
        fetch = 0
        if d.estimate.fetch_blocks > 0:
            fetch = max(0, self._store_prefix(r.hashes[:usable]) - local)
        cached = (local + fetch) * bs
        rq.new, rq.cached, rq.fetched = r.n_tokens - cached, local * bs, fetch * bs
        fetch_ms = fetch * self.block_nbytes / c.bytes_per_ms
        self.store_bytes_read += fetch * self.block_nbytes
        compute = c.prefill_ms(rq.new, cached)
        new_blocks = -(-r.n_tokens // bs) - local - fetch
        handoff = new_blocks * (self.block_nbytes / c.layers) / c.bytes_per_ms
        prefix_ms = (local + fetch) * self.block_nbytes / c.bytes_per_ms
        handoff += max(0.0, prefix_ms - compute)
        rq.start = self.now
        self.cache[p].touch(r.hashes[:local])
        self._push(
            self.now + fetch_ms + compute, "prefill_end", (p, rq, fetch_ms, compute, handoff)
        )

    def _insert(self, node: str, hashes: list[bytes]) -> None:
        new, out = self.cache[node].add(hashes)
        if new:
            self.index.stored(node, new)
            self.index.store_stored(new)
        if out:
            self.index.removed(node, out)
            self.index.store_removed(out)

    def _on_prefill_end(self, arg) -> None:
        p, rq, fetch_ms, compute, handoff = arg
        r, d, bs = rq.r, rq.decision, self.cfg.block_size
        self.pbusy[p] = None
        self.pqueued_ms[p] = max(
            0.0, self.pqueued_ms[p] - d.estimate.prefill_ms - d.estimate.fetch_ms
        )
        self._insert(p, r.hashes[: r.n_tokens // bs])
        rq.prefill_end = self.now
        ttft = self.now + handoff - rq.arrival
        # what the real conductor learns (feeds.py, server.py): the node's report of its
        # compute alone and of its store fetch, each to its own model, and with the first
        # token the node's queue and slot times (fetch, compute, handoff). The compute
        # model taking the fetch's time too made every later estimate of a fetching
        # request long (only ``kvmesh`` fetches: its refusals, not the others')
        ps = self.sched.prefill[p]
        if rq.fetched:
            ps.store_fetch.observe(rq.fetched // bs * self.block_nbytes, fetch_ms)
        self.sched.prefill_done(
            r,
            d,
            rq.new,
            rq.cached + rq.fetched,
            compute,
            ttft,
            node_ms=fetch_ms + compute + handoff,
            node_queue_ms=rq.start - rq.arrival,
        )
        rq.first_token = self.now + handoff
        rq.produced = 1
        if self.pqueue[p]:
            self._start_prefill(p)
        if rq.output <= 1:
            self._finish(d.decode_node, rq)
        else:
            self._push(self.now + handoff, "join", rq)

    # -- decode node ----------------------------------------------------------------------
    def _on_join(self, rq: _Req) -> None:
        dn = rq.decision.decode_node
        self.djoin[dn].append(rq)
        self._kick_decode(dn)

    def _kick_decode(self, dn: str) -> None:
        if not self.dstepping[dn]:
            self._on_step(dn)

    def _on_step(self, dn: str) -> None:
        """A step boundary: finish the step's tokens, admit joiners, run colocated
        prefills (stalling the batch), start the next step."""
        batch = self.dbatch[dn]
        if self.dstepping[dn]:
            for rq in batch:
                rq.produced += 1
            done = [rq for rq in batch if rq.produced >= rq.output]
            if done:
                self.dbatch[dn] = batch = [rq for rq in batch if rq.produced < rq.output]
                for rq in done:
                    self._finish(dn, rq)
        stall = 0.0
        c = self.cost
        while self.dprefill[dn]:
            rq = self.dprefill[dn].pop(0)
            r, _bs = rq.r, self.cfg.block_size
            rq.start = self.now + stall
            rq.new, rq.cached = r.n_tokens, 0
            ms = c.prefill_ms(rq.new, 0)
            stall += ms
            self.sched.prefill_done(
                r,
                rq.decision,
                rq.new,
                0,
                ms,
                self.now + stall - rq.arrival,
                node_ms=ms,
                node_queue_ms=rq.start - rq.arrival,
            )
            rq.first_token = self.now + stall
            rq.prefill_end = rq.first_token
            rq.produced = 1
            if rq.output <= 1:
                self._finish(dn, rq)
            else:
                self.djoin[dn].append(rq)
        if self.djoin[dn]:
            batch.extend(self.djoin[dn])
            self.djoin[dn] = []
        if not batch:
            self.dstepping[dn] = False
            return
        kv = sum(rq.r.n_tokens + rq.produced for rq in batch)
        ms = c.decode_ms(len(batch), kv)
        for rq in batch:
            rq.steps_ms += ms + (stall if rq.produced > 1 else 0.0)
        self.dstepping[dn] = True
        self._push(self.now + stall + ms, "step", dn)

    def _finish(self, dn: str, rq: _Req) -> None:
        bs = self.cfg.block_size
        self.dreserved[dn] -= -(-(rq.r.n_tokens + rq.r.max_tokens) // bs)
        rq.end = self.now
        self.sched.request_done(rq.r, rq.decision, rq.produced)

    # -- results --------------------------------------------------------------------------
    def records(self) -> list[dict]:
        out = []
        for rq in self.reqs:
            rec = {
                "rid": rq.r.request_id,
                "status": rq.status,
                "reject_reason": rq.reason,
                "sent_ms": rq.arrival,
                "prompt_tokens": rq.r.n_tokens,
                "completion_tokens": rq.produced if rq.status == "OK" else 0,
                "cached_tokens": rq.cached + rq.fetched if rq.status == "OK" else 0,
                "computed_tokens": rq.new if rq.status == "OK" else 0,
            }
            if rq.status == "OK" and rq.first_token is not None:
                rec["ttft_ms"] = rq.first_token - rq.arrival
                rec["tbt_ms"] = rq.steps_ms / (rq.produced - 1) if rq.produced > 1 else None
                rec["e2e_ms"] = getattr(rq, "end", rq.first_token) - rq.arrival
                rec["route"] = rq.decision.route
            out.append(rec)
        return out


def simulate(trace: list[dict], cfg: SimConfig) -> Simulation:
    return Simulation(trace, cfg).run()
