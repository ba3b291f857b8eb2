"""Admission and routing: for each request, the (route, prefill node, decode node) that
reaches its first token soonest inside its SLOs, or an early rejection.

Pure logic over the conductor's view (node states, cache index, fitted time models) and
an injected clock, so it is unit-tested with fake reports and benchmarked alone.

Estimate for a prefill node p (design §2.4):
    TTFT(p) = queue(p) + prefill(p, new, cached) + fetch(p) + handoff(p)
- queue(p): what this request waits on p, FIFO: everything booked ahead of it (ours,
  and other conductors' from p's load reports) at p's measured rate (real slot time per
  model ms, ``estimator.MeasuredRate``), less the part of the running prefill already
  done (slower while it overruns);
- cached: p's own longest prefix (cache index) plus store blocks worth fetching: the
  store run is fetched only if its fetch time is less than the prefill time it saves
  (the paper's bandwidth inequality), the fetch time fitted from p's own store fetches
  (``store_fetch``: the store's remote path, not the engine's raw bandwidth);
- handoff: the last layer's KV of the new blocks (the rest overlaps with compute).

Decode choice predicts each decode node's batch at the moment the request joins it (the
requests booked there whose first token comes earlier, less those ended by then) and
its TBT at that batch; a node whose TBT would break the SLO, or whose KV cannot hold the
request, is out. Admission scales each TTFT estimate by the slow tail of actual /
estimated on its route (``estimator.ErrorTail``). If no pair meets both SLOs the request
is rejected before any work starts.

Routes: ``colocated`` (a short prompt prefilled by the decode node itself: no transfer
tax), ``decode-direct`` (the decode node already holds most of the prefix), and
``disaggregated`` (everything else; a less-loaded node pulling a hot prefix from the
store is hot-prefix migration, chosen by the same estimate).

Policies, for comparison: ``random``, ``load`` (least queue), ``cache`` (longest local
prefix), ``cache-load`` (Mooncake paper: queue + prefill with local prefix; decode by
current load, plain early rejection) and ``kvmesh`` (all of the above).
"""

from __future__ import annotations

import heapq
import random
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from operator import attrgetter
from time import monotonic as _monotonic
from typing import Any

from kvmesh.services.conductor import _sorted
from kvmesh.services.conductor.estimator import (
    DecodeModel,
    ErrorTail,
    ErrorTracker,
    MeasuredRate,
    PrefillModel,
)
from kvmesh.services.conductor.index import CacheIndex, Lookup
from kvmesh.services.conductor.queue_order import NodeMap, QueueOrder
from kvmesh.services.conductor.rolling import RollingWindow
from kvmesh.services.conductor.store_fetch import StoreFetchModel

POLICIES = ("random", "load", "cache", "cache-load", "kvmesh")
DISAGG, COLOCATED, DIRECT = "disaggregated", "colocated", "decode-direct"
# the rejection reason of a request no node could ever serve (an SLO below the floor, KV
# beyond the largest node): the conductor answers INVALID_ARGUMENT, not "retry"
INFEASIBLE = "infeasible"
# admit only when the estimate is within this share of the SLO; the one default of both
# PolicyConfig.slo_margin and the conductor's --slo-margin. Near 1: the estimate's own
# recent error is allowed for separately (Scheduler.error_tail), not by a wide margin
SLO_MARGIN = 0.95
_TTFT = attrgetter("ttft_ms")
_QUEUED = attrgetter("queue_ms")


@dataclass
class Request:
    """What admission needs to know about a request."""

    request_id: str
    n_tokens: int
    hashes: list[bytes]
    max_tokens: int
    ttft_slo_ms: float  # what is left of the TTFT SLO when admission starts
    tbt_slo_ms: float
    ttft_spent_ms: float = 0.0  # of the SLO, spent in the conductor before admission


def _ms(x: float) -> str:
    return f"{x:.1f}" if x >= 0.1 else f"{x:.2g}"


@dataclass
class Candidate:
    """One estimated way to serve a request."""

    route: str
    node: str  # the node that computes the prompt
    ttft_ms: float
    queue_ms: float = 0.0
    prefill_ms: float = 0.0
    fetch_ms: float = 0.0
    handoff_ms: float = 0.0
    cached_blocks: int = 0  # from the computing node's own pool
    fetch_blocks: int = 0  # pulled from the store
    work_ms: float = 0.0  # the node's time on it by its fitted model (before the rate)
    speed: float = 1.0  # the node's real ms per model ms the estimate counted on


@dataclass(init=False)  # (its own __init__: a default factory costs ~1 us compiled)
class Decision:
    accepted: bool
    route: str
    prefill_node: str | None
    decode_node: str | None
    estimate: Candidate | None
    tbt_ms: float
    candidates: list[Candidate]
    reason: str  # when rejected: ttft, tbt, kv, no-nodes, infeasible
    message: str
    retry_after_ms: float

    def __init__(
        self,
        accepted: bool,
        route: str = DISAGG,
        prefill_node: str | None = None,
        decode_node: str | None = None,
        estimate: Candidate | None = None,
        tbt_ms: float = 0.0,
        candidates: list[Candidate] | None = None,
        reason: str = "",
        message: str = "",
        retry_after_ms: float = 0.0,
    ) -> None:
        self.accepted = accepted
        self.route = route
        self.prefill_node = prefill_node
        self.decode_node = decode_node
        self.estimate = estimate
        self.tbt_ms = tbt_ms
        self.candidates = candidates if candidates is not None else []
        self.reason = reason
        self.message = message
        self.retry_after_ms = retry_after_ms

    def booked(self) -> tuple[Candidate, str]:
        """The estimate and the decode node of an accepted decision (ValueError if it
        was rejected)."""
        if (
            not self.accepted
            or self.estimate is None
            or self.decode_node is None
            or (self.route == DISAGG and self.prefill_node is None)
        ):
            raise ValueError(f"the request was not accepted ({self.reason or 'no route'})")
        return self.estimate, self.decode_node


@dataclass
class _Misses:
    """Why the candidates tried so far were turned down, for the rejection."""

    reason: str = ""  # the first of ttft and kv, overridden by tbt
    least_tbt: float | None = None  # the lowest predicted TBT over the SLO


class PrefillNodeState:
    """A prefill node as the conductor sees it: its time models and its queue.

    - ``queue``: FIFO, as the node serves it: request -> its slot time in model ms
      (prefill, fetch and handoff, as predicted by ``model``; ``rate.factor`` turns it
      into real ms);
    - ``queue_ms``: model ms of everything queued (ours + ``foreign_ms``); setting it
      tells the least-queued orders holding this node (queue_order.py) that it moved;
    - ``store_fetch``: the store's remote path as this node's fetches measured it (not
      the engine's bandwidth); ``bandwidth``: bytes per ms (1 GB/s until measured);
    - ``head_since``: when the head of the queue started computing; ``rate``: real /
      model slot time; ``lag_ms``: from booking to the node starting a request of an
      empty queue;
    - ``foreign``/``foreign_ms``: other conductors' work on the node, the requests its
      load report counts beyond ours (see ``report_queue``), at the node's observed time
      per prefill.

    (A plain class, not a dataclass: compiled (policy.pxd) it is an extension type with
    typed attributes, and ``queue_ms`` is a property of its own.)"""

    def __init__(
        self,
        node_id: str,
        block_size: int,
        block_nbytes: int,
        layer_nbytes: int,
        model: PrefillModel | None = None,
        bandwidth: float = 1e6,
        store_fetch: StoreFetchModel | None = None,
        queue: dict[str, float] | None = None,
        queue_ms: float = 0.0,
        head_since: float = 0.0,
        rate: MeasuredRate | None = None,
        lag_ms: float = 0.0,
        foreign: int = 0,
        foreign_ms: float = 0.0,
    ) -> None:
        self._orders: tuple[Any, ...] = ()  # the least-queued orders holding this node
        self.node_id = node_id
        self.block_size = block_size
        self.block_nbytes = block_nbytes
        self.layer_nbytes = layer_nbytes
        self.model = model if model is not None else PrefillModel()
        self.bandwidth = bandwidth
        self.store_fetch = store_fetch if store_fetch is not None else StoreFetchModel()
        self.queue = queue if queue is not None else {}
        self._queue_ms = 0.0
        self.queue_ms = queue_ms
        self.head_since = head_since
        self.rate = rate if rate is not None else MeasuredRate()
        self.lag_ms = lag_ms
        self.foreign = foreign
        self.foreign_ms = foreign_ms

    def __repr__(self) -> str:
        return (
            f"PrefillNodeState(node_id={self.node_id!r}, queued={len(self.queue)}, "
            f"queue_ms={self._queue_ms!r}, foreign={self.foreign!r})"
        )

    @property
    def queue_ms(self) -> float:
        return self._queue_ms

    @queue_ms.setter
    def queue_ms(self, ms: float) -> None:
        self._set_queue_ms(ms)

    def _set_queue_ms(self, ms: float) -> None:
        self._queue_ms = ms
        for order in self._orders:  # the schedulers' least-queued orders holding this node
            order.moved(self)

    def enqueue(self, rid: str, ms: float, now: float = 0.0) -> None:
        if not self.queue:
            self.head_since = now + self.lag_ms
        self.queue[rid] = ms
        self._set_queue_ms(self._queue_ms + ms)

    def dequeue(self, rid: str, now: float = 0.0) -> None:
        queue = self.queue
        if rid not in queue:
            return
        head = None
        for head in queue:  # noqa: B007 (the first key; compiled: no iterator object)
            break
        was_head = head == rid
        left = self._queue_ms - queue.pop(rid)
        self._set_queue_ms(left if left > 0.0 else 0.0)  # max(0.0, left)
        if was_head:
            self.head_since = now

    def speed(self, now: float) -> float:
        """Real ms per model ms now: the measured rate, or slower while the head of the
        queue has already run past its prediction at that rate (the node is slower right
        now than its recent prefills said)."""
        f = self.rate.factor(self.model)
        if self.queue:
            head = next(iter(self.queue.values()))
            if head > 0:
                f = max(f, (now - self.head_since) / head)
        return f

    def remaining(self, now: float) -> float:
        """Real ms until everything queued has left the slot, the wait of a request booked
        now (FIFO: it waits for all of it): the queued model ms at the node's speed, less
        the part of the head's slot time already served (in-flight credit)."""
        return self.wait(now)[0]

    def wait(self, now: float) -> tuple[float, float]:
        """``(remaining(now), speed(now))``, computed together (the estimate of every
        candidate needs both)."""
        f = self.rate.factor(self.model)
        queue = self.queue
        if not queue:
            return self.foreign_ms, f
        head = 0.0
        for head in queue.values():  # noqa: B007 (the first; compiled: no iterator object)
            break
        since = now - self.head_since
        if head > 0:
            late = since / head
            if late > f:  # max(f, late), written out (a decision's hot path)
                f = late
        done = head * f
        served = since if since > 0.0 else 0.0  # max(0.0, since)
        if served < done:  # min(done, served)
            done = served
        foreign = self.foreign_ms
        return (self._queue_ms - foreign) * f + foreign - done, f

    def report_queue(self, reported: int, per_request_ms: float) -> None:
        """The node's load report: ``reported`` requests queued or computing there, from
        every conductor. Ours are those in ``queue`` (some of which may not have reached
        the node yet, or have left it), so the node holds at least ``reported -
        len(queue)`` of other conductors': counted at ``per_request_ms`` each, never one
        of ours twice."""
        self.foreign = max(0, reported - len(self.queue))
        self.foreign_ms = self.foreign * per_request_ms
        self.queue_ms = sum(self.queue.values()) + self.foreign_ms


@dataclass
class DecodeNodeState:
    node_id: str
    block_size: int
    kv_blocks_total: int
    kv_blocks_free: int
    model: DecodeModel = field(default_factory=DecodeModel)
    prefill_model: PrefillModel = field(default_factory=PrefillModel)
    bandwidth: float = 1e6
    ends: list[float] = field(default_factory=list)  # predicted end times, sorted
    # when each booked request joins the batch (its first token out), sorted, and by id
    joins: list[float] = field(default_factory=list)
    join_of: dict[str, float] = field(default_factory=dict)
    work: dict[str, tuple[float, int, int]] = field(
        default_factory=dict
    )  # rid -> (end, kv, blocks)
    kv_tokens: int = 0
    reserved_blocks: int = 0  # reserved by us since the last report
    unreported: set[str] = field(default_factory=set)  # requests counted in reserved_blocks
    local_queue_ms: float = 0.0  # colocated prefills queued here
    # other conductors' requests on the node (reserved or decoding) beyond ours, from its
    # load report (see report_queue), and their KV tokens
    foreign: int = 0
    foreign_kv: int = 0
    prefill_rate: MeasuredRate = field(default_factory=MeasuredRate)  # colocated prefills

    def report_queue(self, reported: int, kv_used_tokens: int) -> None:
        """The node's load report: ``reported`` requests reserved or decoding there, from
        every conductor, holding ``kv_used_tokens``. Ours are those in ``work``, so the
        node holds at least ``reported - len(work)`` of other conductors' requests; they
        hold the used KV beyond ours (never one of ours counted twice)."""
        self.foreign = max(0, reported - len(self.work))
        self.foreign_kv = max(0, kv_used_tokens - self.kv_tokens) if self.foreign else 0

    def batch_at(self, t: float) -> int:
        """The batch at time ``t``: the booked requests that have joined by then (their
        prefill done) and not yet ended. Each joins before it ends, so this is the joined
        count less the ended count."""
        return _sorted.bisect_right(self.joins, t) - _sorted.bisect_right(self.ends, t)

    def admit(
        self, rid: str, end: float, kv: int, blocks: int, join: float = float("-inf")
    ) -> None:
        """Books ``rid``: it joins the batch at ``join`` (when its first token is due; by
        default it is in the batch already) and leaves at ``end``."""
        join = min(join, end)
        _sorted.insort(self.ends, end)
        _sorted.insort(self.joins, join)
        self.join_of[rid] = join
        self.work[rid] = (end, kv, blocks)
        self.kv_tokens += kv
        self.reserved_blocks += blocks
        self.unreported.add(rid)

    def finish(self, rid: str) -> None:
        w = self.work.pop(rid, None)
        if w is None:
            return
        end, kv, blocks = w
        if rid in self.unreported:  # ended before a report counted its blocks as used
            self.unreported.discard(rid)
            self.reserved_blocks = max(0, self.reserved_blocks - blocks)
        _remove(self.ends, end)
        _remove(self.joins, self.join_of.pop(rid))
        self.kv_tokens -= kv

    def joined(self, rid: str, t: float) -> None:
        """``rid``'s first token is out at ``t``: it is in the batch from then on."""
        join = self.join_of.get(rid)
        if join is not None and join > t:
            _remove(self.joins, join)
            _sorted.insort(self.joins, t)
            self.join_of[rid] = t

    def free_blocks(self) -> int:
        return self.kv_blocks_free - self.reserved_blocks

    def report(self, free: int, total: int) -> None:
        """A load report from the node: its free blocks already count our reservations."""
        self.kv_blocks_free, self.kv_blocks_total, self.reserved_blocks = free, total, 0
        self.unreported.clear()


def _remove(xs: list[float], x: float) -> None:
    """Removes one ``x`` from the sorted list ``xs`` (if there)."""
    i = _sorted.bisect_left(xs, x)
    if i < len(xs) and xs[i] == x:
        xs.pop(i)


def _disagg_candidate(
    p: PrefillNodeState,
    n: int,
    usable: int,
    local: int,
    store_prefix: int,
    use_store: bool,
    now: float,
    dram_prefix: int | None,
    overhead_ms: float,
    ssd_bytes_per_ms: float,
) -> Candidate:
    """The disaggregated route's estimate on prefill node ``p`` (``Scheduler``'s
    ``_prefill_candidate``; typed where compiled, policy.pxd)."""
    # (the hot path of every decision: ``PrefillModel.predict`` is inlined from the
    # fit's coefficients, term for term, and ``min``/``max`` of ints are written out)
    bs = p.block_size
    a, b, k2 = p.model.coef
    if usable < local:
        local = usable
    fetch_blocks, fetch_ms = 0, 0.0
    if use_store:
        top = usable if usable < store_prefix else store_prefix
        k = top - local
        if k > 0:
            if dram_prefix is not None:
                top = usable if usable < dram_prefix else dram_prefix
            on_ssd = k - (top - local if top > local else 0)
            fetch_ms = (
                p.store_fetch.predict_ms(k * p.block_nbytes, p.bandwidth)
                + on_ssd * p.block_nbytes / ssd_bytes_per_ms
            )
            new, cached = n - local * bs, local * bs
            new2, cached2 = n - (local + k) * bs, (local + k) * bs
            saved = (a + b * new + k2 * new * (new + cached)) - (
                a + b * new2 + k2 * new2 * (new2 + cached2)
            )
            if fetch_ms < saved:
                fetch_blocks = k
            else:
                fetch_ms = 0.0
    held = local + fetch_blocks
    cached = held * bs
    new = n - cached
    prefill_ms = a + b * new + k2 * new * (new + cached)
    new_blocks = -(-n // bs) - held
    # the prefix blocks go to the decode node while the new tokens compute; only the
    # part that outlasts the compute, and the last layer of the new blocks, add up
    bw = p.bandwidth
    over = held * p.block_nbytes / bw - prefill_ms
    handoff_ms = (over if over > 0.0 else 0.0) + new_blocks * p.layer_nbytes / bw
    # the slot time (what the node's measured rate scales) and the wait for the slot
    work = prefill_ms + fetch_ms + handoff_ms
    queue, f = p.wait(now)
    c = Candidate.__new__(Candidate)  # (compiled: no call through __init__'s arguments)
    c.route = DISAGG
    c.node = p.node_id
    c.ttft_ms = queue + work * f + overhead_ms
    c.queue_ms = queue
    c.prefill_ms = prefill_ms * f
    c.fetch_ms = fetch_ms * f
    c.handoff_ms = handoff_ms * f
    c.cached_blocks = local
    c.fetch_blocks = fetch_blocks
    c.work_ms = work
    c.speed = f
    return c


def _sort_by_ttft(cands: list[Candidate]) -> None:
    """``cands.sort(key=attrgetter("ttft_ms"))``, in place: stable, by insertion (a
    handful of candidates; compiled, no key calls). With a NaN among them, the sort
    itself, so that the order stays the same."""
    n = len(cands)
    for i in range(n):
        c = cands[i]
        t = c.ttft_ms
        if t != t:
            cands.sort(key=_TTFT)
            return
    for i in range(1, n):
        c = cands[i]
        t = c.ttft_ms
        j = i
        while j > 0:
            prev = cands[j - 1]
            if not prev.ttft_ms > t:
                break
            cands[j] = prev
            j -= 1
        cands[j] = c


def _decode_scan(
    options: Iterable[DecodeNodeState],
    need_blocks: int,
    at: float,
    n: int,
    tbt_limit: float,
    predict: bool,
    misses: _Misses,
) -> tuple[DecodeNodeState, float] | None:
    """Of ``options``, the decode node with ``need_blocks`` of KV room and the lowest
    predicted TBT within ``tbt_limit`` for a request of ``n`` prompt tokens joining at
    ``at`` (by the batch then with ``predict``, else by every request booked), and that
    TBT; None if none qualifies (why is added to ``misses``). ``Scheduler``'s
    ``_decode_choice``; typed where compiled (policy.pxd)."""
    best_tbt, best_d = float("inf"), None
    for d in options:
        if d.kv_blocks_free - d.reserved_blocks < need_blocks:
            misses.reason = misses.reason or "kv"
            continue
        # the batch when this request joins it, at its first token (kvmesh; the
        # others judge by every request booked): those booked whose first token comes
        # earlier, less those ended by then; attending over their share of the KV
        # booked, plus this one's. (Each search is skipped where the answer is at an
        # end: all joined by then, or none ended.)
        ends = d.ends
        now_batch = len(ends)
        if predict:
            joins = d.joins
            batch = len(joins)
            if batch:
                last = joins[batch - 1]
                if last > at:
                    batch = _sorted.bisect_right(joins, at)
            if now_batch:
                first = ends[0]
                if not first > at:  # (a NaN: as the search)
                    batch -= _sorted.bisect_right(ends, at)
        else:
            batch = now_batch
        kv = d.kv_tokens * batch / now_batch if now_batch else 0
        a_, b_, k_ = d.model.coef
        # with other conductors' requests (``foreign``) and their KV
        tbt = a_ + b_ * (batch + d.foreign + 1) + k_ * (kv + d.foreign_kv + n)
        if tbt > tbt_limit:
            misses.reason = "tbt"
            if misses.least_tbt is None or tbt < misses.least_tbt:
                misses.least_tbt = tbt
        elif tbt < best_tbt:
            best_tbt, best_d = tbt, d
    return None if best_d is None else (best_d, best_tbt)


@dataclass
class PolicyConfig:
    policy: str = "kvmesh"
    colocate_below_tokens: int = 512  # colocated fast path threshold
    direct_share: float = 0.9  # decode-direct when the decode node holds this share
    expected_output_share: float = 1.0  # expected output tokens / max_tokens (learned)
    candidates: int = 2  # uncached prefill nodes considered, least queued first
    disagg_overhead_ms: float = 2.0  # extra RPC hops of the disaggregated route
    slo_margin: float = SLO_MARGIN  # admit only if the estimate <= margin x SLO
    ssd_bytes_per_ms: float = 5e5  # promoting a spilled block (0.5 GB/s) before the fetch


def _monotonic_ms() -> float:
    return _monotonic() * 1000.0


class Scheduler:
    """Holds node states and the cache index; decides; books what it decided."""

    def __init__(
        self,
        cfg: PolicyConfig | None = None,
        index: CacheIndex | None = None,
        clock: Callable[[], float] = _monotonic_ms,
        rng: random.Random | None = None,
    ) -> None:
        self.cfg = cfg or PolicyConfig()
        if self.cfg.policy not in POLICIES:
            raise ValueError(f"policy {self.cfg.policy!r} is not one of {POLICIES}")
        self.index = index if index is not None else CacheIndex()
        self.clock = clock
        self.rng = rng or random.Random(0)
        # a dict that counts its changes, for the least-queued order (``_prefill_nodes``)
        self.prefill: dict[str, PrefillNodeState] = NodeMap()
        self._queue_order = QueueOrder()
        self.decode: dict[str, DecodeNodeState] = {}
        self.ttft_error = ErrorTracker()
        # per route: TTFT the models do not explain (RPC hops), learned from actual TTFTs
        self.overhead_ms = {DISAGG: self.cfg.disagg_overhead_ms, COLOCATED: 0.0, DIRECT: 0.0}
        self._residuals = {route: RollingWindow(64) for route in self.overhead_ms}
        self._output_share = self.cfg.expected_output_share
        # per route: the slow tail of actual / estimated TTFT, what admission allows for
        self.error_tail = {route: ErrorTail() for route in self.overhead_ms}

    # -- estimates ---------------------------------------------------------------------
    def _prefill_candidate(
        self,
        p: PrefillNodeState,
        n: int,
        usable: int,
        local: int,
        store_prefix: int,
        use_store: bool,
        now: float,
        dram_prefix: int | None = None,
        overhead_ms: float | None = None,
    ) -> Candidate:
        if overhead_ms is None:
            overhead_ms = self.overhead_ms[DISAGG]
        return _disagg_candidate(
            p,
            n,
            usable,
            local,
            store_prefix,
            use_store,
            now,
            dram_prefix,
            overhead_ms,
            self.cfg.ssd_bytes_per_ms,
        )

    def _colocated_candidate(
        self, d: DecodeNodeState, n: int, usable: int, local: int, route: str
    ) -> Candidate:
        bs = d.block_size
        cached = min(local, usable) * bs
        # a running step (ours and other conductors' requests) finishes first
        step = d.model.predict(len(d.ends) + d.foreign, d.kv_tokens + d.foreign_kv)
        work = d.prefill_model.predict(n - cached, cached)
        f = d.prefill_rate.factor(d.prefill_model)
        prefill_ms = work * f  # at the node's measured rate
        return Candidate(
            route,
            d.node_id,
            d.local_queue_ms + step + prefill_ms + self.overhead_ms[route],
            d.local_queue_ms + step,
            prefill_ms,
            0.0,
            0.0,
            min(local, usable),
            0,
            work,
            f,
        )

    # -- the decision ------------------------------------------------------------------
    def decide(self, r: Request, store_prefix: int | None = None) -> Decision:
        """The route for ``r``, or its early rejection, in steps: the cache index's view
        of the prefix, the candidate routes with their TTFT estimates, then admission (the
        first candidate within the TTFT SLO with a decode node within the TBT SLO).
        ``store_prefix`` overrides the index's store view (when the conductor had to ask
        the store-master because no store event stream is live)."""
        if not self.prefill and not self.decode:
            return Decision(False, reason="no-nodes", message="no prefill or decode node is live")
        now = self.clock()
        n = r.n_tokens
        any_node = next(iter(self.prefill.values()), None) or next(iter(self.decode.values()))
        bs = any_node.block_size
        hashes = r.hashes
        usable = min(len(hashes), (n - 1) // bs)  # the last token is always computed
        if usable < len(hashes):  # (else the list as it is: no copy)
            hashes = hashes[:usable]
        look = self._lookup(hashes, store_prefix)
        cands = self._prefill_candidates(n, usable, look, store_prefix is not None, now)
        fast = (
            self._decode_node_candidates(n, usable, look.per_node if look else {})
            if self.cfg.policy == "kvmesh"
            else []
        )
        # the fast paths skip the transfer tax (a short prompt; a prefix the decode node
        # already holds): they are tried first, the others only if they break an SLO;
        # each kind by TTFT (a stable sort: ties keep their order)
        _sort_by_ttft(cands)
        if fast:
            _sort_by_ttft(fast)
            cands = fast + cands
        if not cands or not self.decode:
            return Decision(
                False,
                reason="no-nodes",
                candidates=cands,
                message="no live node can serve this request; retry shortly",
            )
        return self._admit(r, cands, -(-(n + r.max_tokens) // bs), now)

    def _lookup(self, hashes: list[bytes], store_prefix: int | None) -> Lookup | None:
        """The index's longest prefixes of ``hashes`` (None for the policies blind to
        caches); ``store_prefix``, when given, replaces the store's."""
        if self.cfg.policy in ("random", "load"):
            return None
        look = self.index.lookup(hashes)
        if store_prefix is not None:
            look.store_prefix = store_prefix
        return look

    def _prefill_nodes(self, per_node: dict[str, int]) -> list[PrefillNodeState]:
        """The prefill nodes worth an estimate: one, by the policy's rule, for ``random``
        and ``load``; else those holding part of the prefix and the ``cfg.candidates``
        least queued others."""
        if self.cfg.policy == "random":
            return [self.rng.choice(list(self.prefill.values()))]
        if self.cfg.policy == "load":
            return [min(self.prefill.values(), key=_QUEUED)]
        prefill, k = self.prefill, self.cfg.candidates
        pick = [prefill[nid] for nid in per_node if nid in prefill]
        if type(prefill) is NodeMap:  # the order kept current (queue_order.py)
            order = self._queue_order
            order.sync(prefill)
            return pick + order.least(prefill, k, per_node)
        nodes = list(prefill.values())
        others = [p for p in nodes if p.node_id not in per_node] if per_node else nodes
        if len(others) > k > 0:  # only those queued no longer than the k-th least compete
            cut = sorted([p.queue_ms for p in others])[k - 1]
            queued = [(p.queue_ms, p.node_id) for p in others if p.queue_ms <= cut]
        else:
            queued = [(p.queue_ms, p.node_id) for p in others]
        return pick + [prefill[nid] for _, nid in heapq.nsmallest(k, queued)]

    def _prefill_candidates(
        self, n: int, usable: int, look: Lookup | None, store_given: bool, now: float
    ) -> list[Candidate]:
        """The disaggregated route's estimate on each prefill node worth one; the
        ``cache`` policy keeps only the least queued of those holding the longest prefix."""
        if not self.prefill:
            return []
        per_node = look.per_node if look else {}
        use_store = self.cfg.policy == "kvmesh"
        store_prefix = look.store_prefix if look else 0
        dram_prefix = look.store_dram_prefix if look and not store_given else None
        get, overhead = per_node.get, self.overhead_ms[DISAGG]
        ssd_rate = self.cfg.ssd_bytes_per_ms
        cands = [
            _disagg_candidate(
                p,
                n,
                usable,
                get(p.node_id, 0),
                store_prefix,
                use_store,
                now,
                dram_prefix,
                overhead,
                ssd_rate,
            )
            for p in self._prefill_nodes(per_node)
        ]
        if self.cfg.policy == "cache":
            best_local = max([c.cached_blocks for c in cands])
            cands = [
                min(
                    [c for c in cands if c.cached_blocks == best_local],
                    key=_QUEUED,
                )
            ]
        return cands

    def _decode_node_candidates(
        self, n: int, usable: int, per_node: dict[str, int]
    ) -> list[Candidate]:
        """kvmesh's fast paths, on each decode node: ``colocated`` for a short prompt (or
        when no prefill node is live), ``decode-direct`` when it holds most of the prefix."""
        out: list[Candidate] = []
        colocate = n < self.cfg.colocate_below_tokens or not self.prefill
        if not colocate and not (usable and not self.decode.keys().isdisjoint(per_node)):
            return out  # no decode node holds any of the prefix: no fast path
        for d in self.decode.values():
            local = per_node.get(d.node_id, 0)
            if colocate:
                out.append(self._colocated_candidate(d, n, usable, local, COLOCATED))
            elif usable and local >= self.cfg.direct_share * usable:
                out.append(self._colocated_candidate(d, n, usable, local, DIRECT))
        return out

    def _admit(self, r: Request, cands: list[Candidate], need_blocks: int, now: float) -> Decision:
        """The first of ``cands`` (in order) within the TTFT SLO that has a decode node
        within the TBT SLO and with ``need_blocks`` of KV room; else the rejection."""
        ttft_limit = r.ttft_slo_ms * self.cfg.slo_margin
        tail = self.error_tail
        misses = _Misses()
        for c in cands:
            # the estimate as late as the estimates on this route have lately turned out
            if c.ttft_ms * tail[c.route].value > ttft_limit:
                misses.reason = misses.reason or "ttft"
                if c.route != DISAGG:
                    continue
                break  # the disaggregated ones come last, by TTFT: the rest miss too
            chosen = self._decode_choice(r, c, need_blocks, now, misses)
            if chosen is not None:
                d, tbt = chosen
                prefill_node = c.node if c.route == DISAGG else None
                return Decision(True, c.route, prefill_node, d.node_id, c, tbt, cands)
        return self._rejection(r, cands, misses)

    def _decode_choice(
        self, r: Request, c: Candidate, need_blocks: int, now: float, misses: _Misses
    ) -> tuple[DecodeNodeState, float] | None:
        """The decode node for candidate ``c`` and its predicted TBT: of those with KV room
        (``c``'s own node on the fast paths; one at random for ``random``), the lowest TBT
        within the SLO at the moment the prefill would end. None if none qualifies (why is
        added to ``misses``)."""
        options: Iterable[DecodeNodeState]
        if c.route != DISAGG:
            options = (self.decode[c.node],)
        elif self.cfg.policy == "random":
            options = (self.rng.choice(list(self.decode.values())),)
        else:
            options = self.decode.values()
        tbt_limit = r.tbt_slo_ms * self.cfg.slo_margin
        return _decode_scan(
            options,
            need_blocks,
            now + c.ttft_ms,
            r.n_tokens,
            tbt_limit,
            self.cfg.policy == "kvmesh",
            misses,
        )

    def _floor(self, r: Request, cands: list[Candidate]) -> str | None:
        """Why no node could ever serve ``r``, even idle (None if an idle one could): the
        prompt and output outgrow the largest decode node's KV, or an SLO lies below
        what an idle node takes (the best TTFT estimate less its queue; the TBT of a
        batch of one), the admission margin included. A retry cannot help."""
        n_kv = r.n_tokens + r.max_tokens
        if all(-(-n_kv // d.block_size) > d.kv_blocks_total for d in self.decode.values()):
            most = max(d.kv_blocks_total * d.block_size for d in self.decode.values())
            return (
                f"{r.n_tokens} prompt tokens + max_tokens {r.max_tokens} need KV for "
                f"{n_kv} tokens, more than the largest decode node holds ({most}); "
                f"shorten the prompt or lower max_tokens"
            )
        margin = self.cfg.slo_margin

        def idle_ms(c: Candidate) -> float:
            # without its queue, at the node's fitted model where it measures slower now
            # (a node slowed by load is no floor: a retry may find it fast again)
            return c.ttft_ms - c.queue_ms - c.work_ms * max(0.0, c.speed - 1.0)

        idle = min(cands, key=idle_ms)
        ttft = idle_ms(idle)
        if ttft > (r.ttft_slo_ms + r.ttft_spent_ms) * margin:
            return (
                f"the TTFT SLO of {_ms(r.ttft_slo_ms + r.ttft_spent_ms)} ms is below the "
                f"floor: even idle, the best node {idle.node} needs an estimated "
                f"{ttft:.1f} ms for this prompt, and admission keeps a margin of "
                f"{margin:g}; ask for a TTFT SLO of at least {ttft / margin:.1f} ms"
            )
        tbt = min(d.model.predict(1, r.n_tokens) for d in self.decode.values())
        if tbt > r.tbt_slo_ms * margin:
            return (
                f"the TBT SLO of {_ms(r.tbt_slo_ms)} ms is below the floor: even alone on "
                f"a decode node a step takes an estimated {tbt:.1f} ms, and admission "
                f"keeps a margin of {margin:g}; ask for a TBT SLO of at least "
                f"{tbt / margin:.1f} ms"
            )
        return None

    def _rejection(self, r: Request, cands: list[Candidate], misses: _Misses) -> Decision:
        """The early rejection: the reason, a message with the numbers behind it, and
        when to retry; or, when no node could ever serve it (``_floor``), ``infeasible``
        without a retry."""
        best = min(cands, key=_TTFT)
        floor = self._floor(r, cands)
        if floor is not None:
            return Decision(
                False, candidates=cands, reason=INFEASIBLE, estimate=best, message=floor
            )
        reason = misses.reason or "ttft"
        if reason == "ttft":
            msg = (
                f"estimated TTFT {best.ttft_ms:.1f} ms (queue {best.queue_ms:.1f} + prefill "
                f"{best.prefill_ms:.1f} + fetch {best.fetch_ms:.1f} + handoff "
                f"{best.handoff_ms:.1f}) on the best node {best.node} exceeds the TTFT SLO "
                f"of {_ms(r.ttft_slo_ms + r.ttft_spent_ms)} ms"
            )
            if r.ttft_spent_ms >= 0.05:
                msg += f" ({r.ttft_spent_ms:.1f} ms of it spent in the conductor before routing)"
            tail = self.error_tail[best.route].value
            if tail != 1.0:
                msg += (
                    f", counted x{tail:.2f} (how late recent TTFTs came against their "
                    f"estimates) within a margin of {self.cfg.slo_margin:g}"
                )
            retry = max(
                best.ttft_ms * tail - r.ttft_slo_ms * self.cfg.slo_margin, best.queue_ms, 50.0
            )
        elif reason == "tbt":
            tbt = misses.least_tbt if misses.least_tbt is not None else float("nan")
            msg = (
                f"predicted time between tokens {tbt:.1f} ms on the least-loaded decode node "
                f"exceeds the TBT SLO of {r.tbt_slo_ms:.1f} ms"
            )
            retry = 500.0
        else:
            msg = f"no decode node has KV room for {r.n_tokens + r.max_tokens} tokens"
            retry = 500.0
        return Decision(
            False,
            candidates=cands,
            reason=reason,
            estimate=best,
            message=f"{msg}; retry after {retry:.0f} ms",
            retry_after_ms=retry,
        )

    # -- booking -------------------------------------------------------------------------
    def commit(self, r: Request, d: Decision) -> None:
        """Books an accepted decision: queue time on the prefill node, the request's
        predicted decode interval and KV on the decode node."""
        now = self.clock()
        c, decode_node = d.booked()
        if d.route == DISAGG and d.prefill_node is not None:
            p = self.prefill[d.prefill_node]
            p.enqueue(r.request_id, c.work_ms, now)
        else:
            self.decode[decode_node].local_queue_ms += c.prefill_ms
        dn = self.decode[decode_node]
        expected = max(1.0, r.max_tokens * self._output_share)
        join = now + c.ttft_ms  # it joins the batch with its first token
        dn.admit(
            r.request_id,
            join + expected * max(d.tbt_ms, 1e-3),
            r.n_tokens + r.max_tokens,
            -(-(r.n_tokens + r.max_tokens) // dn.block_size),
            join,
        )

    def prefill_done(
        self,
        r: Request,
        d: Decision,
        new: int,
        cached: int,
        ms: float | None = None,
        ttft_ms: float | None = None,
        node_ms: float | None = None,
        node_queue_ms: float | None = None,
    ) -> None:
        """The prompt is computed: free its queue slot; learn from the compute time ``ms``
        (when the caller has no better source, e.g. node reports), from the time the node
        says the request held its slot (``node_ms``: the node's measured rate against its
        model) and from the TTFT seen: the part of it no node time explains (RPC hops,
        event loops; with ``node_queue_ms``, the TTFT less the node's queue and slot
        time) becomes the route's learned overhead."""
        c, decode_node = d.booked()
        now = self.clock()
        dn = self.decode.get(decode_node)
        if dn is not None:
            dn.joined(r.request_id, now)
        if d.route == DISAGG:
            p = self.prefill.get(d.prefill_node) if d.prefill_node is not None else None
            if p is not None:
                p.dequeue(r.request_id, now)
                if ms is not None:
                    p.model.observe(new, cached, ms)
                if node_ms is not None:
                    transfer = (c.fetch_ms + c.handoff_ms) / c.speed
                    p.rate.observe(new, cached, transfer, node_ms)
                p.lag_ms = self.overhead_ms[DISAGG]
        elif dn is not None:
            dn.local_queue_ms = max(0.0, dn.local_queue_ms - c.prefill_ms)
            if ms is not None:
                dn.prefill_model.observe(new, cached, ms)
            if node_ms is not None:
                dn.prefill_rate.observe(new, cached, 0.0, node_ms)
        if ttft_ms is not None:
            self.ttft_error.add(c.ttft_ms, ttft_ms)
            window = self._residuals[d.route]
            et = self.error_tail[d.route]
            et.add(c.ttft_ms + r.ttft_spent_ms, ttft_ms)
            if node_ms is not None:  # what neither the queue nor the slot explains
                window.append(ttft_ms - (node_queue_ms or 0.0) - node_ms)
            else:
                window.append(ttft_ms - (c.ttft_ms - self.overhead_ms[d.route]))
            self.overhead_ms[d.route] = min(max(window.median(), 0.0), 1000.0)

    def request_done(self, r: Request, d: Decision, output_tokens: int | None = None) -> None:
        dn = self.decode.get(d.decode_node) if d.decode_node else None
        if dn is not None:
            dn.finish(r.request_id)
        if d.route == DISAGG and d.prefill_node in self.prefill:
            self.prefill[d.prefill_node].dequeue(r.request_id, self.clock())
        if output_tokens is not None and r.max_tokens:
            share = min(1.0, output_tokens / r.max_tokens)
            self._output_share = 0.95 * self._output_share + 0.05 * share
