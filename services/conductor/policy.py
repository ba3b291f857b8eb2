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
estimated on its route (``estimator.ErrorTail``; an estimate near the SLO by the tail of
the estimates of its size). If no pair meets both SLOs the request
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
from dataclasses import dataclass
from operator import attrgetter
from time import monotonic as _monotonic

# (``X as X``: the node states and candidates, in nodes.py and candidates.py, are
# importable from here as well)
from kvmesh.services.conductor import candidates
from kvmesh.services.conductor.candidates import COLOCATED as COLOCATED
from kvmesh.services.conductor.candidates import DIRECT as DIRECT
from kvmesh.services.conductor.candidates import DISAGG as DISAGG
from kvmesh.services.conductor.candidates import Candidate as Candidate
from kvmesh.services.conductor.candidates import Decision as Decision
from kvmesh.services.conductor.candidates import Misses
from kvmesh.services.conductor.candidates import Request as Request
from kvmesh.services.conductor.estimator import ErrorTail, ErrorTracker
from kvmesh.services.conductor.index import CacheIndex, Lookup
from kvmesh.services.conductor.nodes import DecodeNodeState as DecodeNodeState
from kvmesh.services.conductor.nodes import PrefillNodeState as PrefillNodeState
from kvmesh.services.conductor.queue_order import NodeMap, QueueOrder
from kvmesh.services.conductor.rolling import RollingWindow

POLICIES = ("random", "load", "cache", "cache-load", "kvmesh")
# the rejection reason of a request no node could ever serve (an SLO below the floor, KV
# beyond the largest node): the conductor answers INVALID_ARGUMENT, not "retry"
INFEASIBLE = "infeasible"
KV_RETRY_MS = 500.0  # the retry hint of a refusal for KV room (blocks free as requests end)
# admit only when the estimate is within this share of the SLO; the one default of both
# PolicyConfig.slo_margin and the conductor's --slo-margin. Near 1: the estimate's own
# recent error is allowed for separately (Scheduler.error_tail), not by a wide margin
SLO_MARGIN = 0.95
_TTFT = attrgetter("ttft_ms")
_QUEUED = attrgetter("queue_ms")


def _ms(x: float) -> str:
    return f"{x:.1f}" if x >= 0.1 else f"{x:.2g}"


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
    # kvmesh: a request no decode node has KV room for now waits for the room that the
    # requests booked there free as they end, where it still meets its SLOs
    wait_for_kv: bool = True
    # admission's error tail counts the ratios of this many seconds at most (ErrorTail)
    error_tail_horizon_s: float = 60.0


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
        horizon_ms = 1000.0 * self.cfg.error_tail_horizon_s
        self.error_tail = {route: ErrorTail(horizon_ms=horizon_ms) for route in self.overhead_ms}

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
        return candidates.disagg_candidate(
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
        if usable < len(hashes) or type(hashes) is not list:  # (else no copy; a slice
            hashes = hashes[:usable]  # of a list subclass is the plain list lookup takes)
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
        candidates.sort_by_ttft(cands)
        if fast:
            candidates.sort_by_ttft(fast)
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
            candidates.disagg_candidate(
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
        for et in tail.values():  # the ratios past the horizon out (ErrorTail.expire)
            et.expire(now)
        misses = Misses()
        for c in cands:
            # the estimate as late as the estimates on this route have lately turned out
            et = tail[c.route]  # (ErrorTail.factor, inline: the tail of its size)
            f = et.value
            if c.ttft_ms >= et.mid_share * ttft_limit:
                f = et.near_value if c.ttft_ms >= et.near_share * ttft_limit else et.mid_value
            if 0.0 < et.idle_value < f and c.queue_ms <= et.idle_share * c.ttft_ms:
                f = et.idle_value  # (it waits on nothing: the tail of such estimates)
            if c.ttft_ms * f > ttft_limit:
                misses.reason = misses.reason or "ttft"
                if c.route != DISAGG:
                    continue
                break  # the disaggregated ones come last, by TTFT: the rest miss too
            chosen = self._decode_choice(r, c, need_blocks, now, misses)
            if chosen is not None:
                d, tbt = chosen
                prefill_node = c.node if c.route == DISAGG else None
                return Decision(True, c.route, prefill_node, d.node_id, c, tbt, cands)
        if misses.kv_short and self.cfg.wait_for_kv and self.cfg.policy == "kvmesh":
            waited = self._admit_waiting(r, cands, need_blocks, now)
            if waited is not None:
                return waited
        return self._rejection(r, cands, misses)

    def _admit_waiting(
        self, r: Request, cands: list[Candidate], need_blocks: int, now: float
    ) -> Decision | None:
        """No decode node has KV room for ``r`` now (``_admit``): the first of ``cands``
        whose decode node will have it, as the requests booked there end, soon enough
        for the TTFT SLO (the prefill starts once the room is there, or once the node's
        queue has drained, whichever is later) and within the TBT SLO when it joins; the
        decision waits up to the latest moment that still meets the SLO. None if none."""
        ttft_limit = r.ttft_slo_ms * self.cfg.slo_margin
        tbt_limit = r.tbt_slo_ms * self.cfg.slo_margin
        misses = Misses()
        for c in cands:
            if c.route != DISAGG:
                options = [self.decode[c.node]]
            else:
                options = list(self.decode.values())
            rest = c.ttft_ms - c.queue_ms  # the prefill, its transfers and the hops
            best = None  # (ttft, decode node, tbt)
            for d in options:
                need = need_blocks
                if d.prompts:
                    need -= d.held_prefix(r.hashes, (r.n_tokens - 1) // d.block_size)
                wait = d.room_in(need, now)
                if wait != wait or wait == float("inf"):
                    continue
                ttft = max(wait, c.queue_ms) + rest
                f = self.error_tail[c.route].factor(ttft, ttft_limit, ttft - rest)
                if ttft * f > ttft_limit or (best is not None and ttft >= best[0]):
                    continue
                room = d.free_blocks()  # (now short: the scan below judges the TBT only)
                chosen = candidates.decode_scan(
                    (d,), room, now + ttft, r.n_tokens, tbt_limit, True, misses, r.hashes
                )
                if chosen is not None:
                    best = (ttft, d, chosen[1])
            if best is not None:
                ttft, d, tbt = best
                f = self.error_tail[c.route].factor(ttft, ttft_limit, ttft - rest)
                # it may wait as long as the SLO leaves, the queue it has now still ahead
                # of it then (the node's prefill refuses it if that runs late)
                most = max(ttft - rest, ttft_limit / f - rest - c.queue_ms)
                c.queue_ms, c.ttft_ms = ttft - rest, ttft  # the wait is its queue now
                return Decision(
                    True,
                    c.route,
                    c.node if c.route == DISAGG else None,
                    d.node_id,
                    c,
                    tbt,
                    cands,
                    kv_wait_ms=most,
                )
        return None

    def _decode_choice(
        self, r: Request, c: Candidate, need_blocks: int, now: float, misses: Misses
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
        return candidates.decode_scan(
            options,
            need_blocks,
            now + c.ttft_ms,
            r.n_tokens,
            tbt_limit,
            self.cfg.policy == "kvmesh",
            misses,
            r.hashes,
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

    def _rejection(self, r: Request, cands: list[Candidate], misses: Misses) -> Decision:
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
            tail = self.error_tail[best.route].factor(
                best.ttft_ms, r.ttft_slo_ms * self.cfg.slo_margin, best.queue_ms
            )
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
            retry = KV_RETRY_MS
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
        if d.kv_wait_ms <= 0:  # (one waiting for KV room queues once it has it)
            self._enqueue(r, d, c, now)
        dn = self.decode[decode_node]
        expected = max(1.0, r.max_tokens * self._output_share)
        join = now + c.ttft_ms  # it joins the batch with its first token
        blocks = -(-(r.n_tokens + r.max_tokens) // dn.block_size)
        if dn.prompts:  # the prefix a request decoding there holds is pinned, not taken
            blocks -= dn.held_prefix(r.hashes, (r.n_tokens - 1) // dn.block_size)
        dn.admit(
            r.request_id,
            join + expected * max(d.tbt_ms, 1e-3),
            r.n_tokens + r.max_tokens,
            blocks,
            join,
        )
        if d.kv_wait_ms > 0:
            dn.wait_for_room(r.request_id)

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
            dn.unbook_local(r.request_id)
            if ms is not None:
                dn.prefill_model.observe(new, cached, ms)
            if node_ms is not None:
                dn.prefill_rate.observe(new, cached, 0.0, node_ms)
        if ttft_ms is not None:
            self.ttft_error.add(c.ttft_ms, ttft_ms)
            window = self._residuals[d.route]
            et = self.error_tail[d.route]
            # (its window by its size as admission judged it: ``_admit``)
            et.add(
                c.ttft_ms + r.ttft_spent_ms,
                ttft_ms,
                r.ttft_slo_ms * self.cfg.slo_margin,
                c.ttft_ms,
                now,
                c.queue_ms,
            )
            if node_ms is not None:  # what neither the queue nor the slot explains
                window.append(ttft_ms - (node_queue_ms or 0.0) - node_ms)
            else:
                window.append(ttft_ms - (c.ttft_ms - self.overhead_ms[d.route]))
            self.overhead_ms[d.route] = min(max(window.median(), 0.0), 1000.0)

    def _enqueue(self, r: Request, d: Decision, c: Candidate, now: float) -> None:
        """``r``'s prefill joins its node's queue: the prefill node's, or the decode
        node's own on the local routes."""
        if d.route == DISAGG and d.prefill_node is not None:
            p = self.prefill.get(d.prefill_node)
            if p is not None:
                p.enqueue(r.request_id, c.work_ms, now)
        elif d.decode_node in self.decode:
            self.decode[d.decode_node].book_local(r.request_id, c.prefill_ms)

    def kv_slack_ms(self, r: Request, d: Decision) -> float:
        """How long accepted ``r`` may still wait for KV room and meet its TTFT SLO by
        its estimate (0 where the policy does not wait): for a decode node that refuses
        the reservation admission counted room for (its pool filled before its report
        said so)."""
        if not (self.cfg.wait_for_kv and self.cfg.policy == "kvmesh"):
            return 0.0
        c = d.booked()[0]
        limit = r.ttft_slo_ms * self.cfg.slo_margin
        f = self.error_tail[c.route].factor(c.ttft_ms, limit, c.queue_ms)
        return max(0.0, limit / f - c.ttft_ms)

    def await_room(self, r: Request, d: Decision) -> None:
        """Accepted ``r`` waits for KV room after all (:meth:`kv_slack_ms`): its blocks
        count as waiting, and its prefill leaves its node's queue until
        :meth:`room_taken`."""
        c, decode_node = d.booked()
        dn = self.decode.get(decode_node)
        if dn is not None:
            dn.wait_for_room(r.request_id)
            dn.unbook_local(r.request_id)
        if d.route == DISAGG and d.prefill_node in self.prefill:
            self.prefill[d.prefill_node].dequeue(r.request_id, self.clock())

    def room_now(self, r: Request, d: Decision) -> bool:
        """Whether ``r``, waiting for KV room, has it on its decode node now by what the
        conductor knows (the node's own check comes at ``Reserve``): the node's pool
        has room for every request's growth only so."""
        dn = self.decode.get(d.booked()[1])
        return True if dn is None else dn.room_for(r.request_id)

    def room_taken(self, r: Request, d: Decision) -> None:
        """The decode node reserved the KV of ``r``, admitted to wait for it: its
        blocks count as reserved there, and its prefill joins its node's queue now (a
        request waiting in the conductor is no work at the head of a node's queue)."""
        c, decode_node = d.booked()
        dn = self.decode.get(decode_node)
        if dn is not None:
            dn.room_taken(r.request_id)
        self._enqueue(r, d, c, self.clock())

    def reserved(self, r: Request, d: Decision, seq: int) -> None:
        """The decode node reserved the KV of accepted ``r`` under the number ``seq``
        (``ReserveResponse.reserve_seq``; 0 from a node that does not number them): its
        booked blocks count against the node's free ones until a load report made after
        it says them used (:meth:`DecodeNodeState.reserved`)."""
        dn = self.decode.get(d.booked()[1])
        if dn is not None:
            dn.reserved(r.request_id, seq)

    def rebook(self, r: Request, d: Decision) -> None:
        """A prefill retry gives back accepted ``r``'s decode reservation to take it again
        under a new id: its blocks count as reserved until a report made after the new
        one (:meth:`DecodeNodeState.rebook`, then :meth:`reserved`)."""
        dn = self.decode.get(d.booked()[1])
        if dn is not None:
            dn.rebook(r.request_id)

    def prompt_held(self, r: Request, d: Decision) -> None:
        """``r``'s prompt KV is in place on its decode node, cached there under its
        hashes (the node was given them at ``Reserve``): until ``r`` ends, a request
        sharing the prefix needs KV room there only for the rest."""
        dn = self.decode.get(d.booked()[1])
        if dn is not None:
            dn.prompt_held(r.request_id, r.hashes)

    def held_locally(self, r: Request, d: Decision, cached_blocks: int) -> tuple[str, float] | None:
        """The decode node of an accepted colocated or decode-direct decision pinned
        ``cached_blocks`` of the prompt's prefix at ``Reserve``. Fewer than the estimate
        counted on (evicted since the index last heard) make the prompt's compute
        longer: the estimate and the booking take the truth, and admission's TTFT rule
        is asked again. Returns why the request now misses its TTFT SLO and the ms after
        which a retry may not, else None."""
        c, decode_node = d.booked()
        dn = self.decode.get(decode_node)
        if d.route == DISAGG or dn is None or cached_blocks >= c.cached_blocks:
            return None
        n = r.n_tokens
        cached = cached_blocks * dn.block_size
        work = dn.prefill_model.predict(n - cached, cached)
        prefill_ms = work * c.speed
        late = prefill_ms - c.prefill_ms
        was, counted = c.ttft_ms, c.cached_blocks
        c.ttft_ms += late
        c.prefill_ms, c.work_ms, c.cached_blocks = prefill_ms, work, cached_blocks
        dn.book_local(r.request_id, prefill_ms)
        limit = r.ttft_slo_ms * self.cfg.slo_margin
        f = self.error_tail[c.route].factor(c.ttft_ms, limit, c.queue_ms)
        if c.ttft_ms * f <= limit:
            return None
        return (
            f"decode node {decode_node} holds {cached_blocks} of the {counted} prefix blocks "
            f"its estimate ({was:.0f} ms) counted on (evicted since): computing the rest "
            f"there puts the first token at {c.ttft_ms:.0f} ms, counted x{f:.2f} (how late "
            f"recent TTFTs came against their estimates), past the TTFT SLO of "
            f"{_ms(r.ttft_slo_ms + r.ttft_spent_ms)} ms within a margin of "
            f"{self.cfg.slo_margin:g}",
            max(c.ttft_ms * f - limit, 50.0),
        )

    def request_done(self, r: Request, d: Decision, output_tokens: int | None = None) -> None:
        dn = self.decode.get(d.decode_node) if d.decode_node else None
        if dn is not None:
            dn.finish(r.request_id)
            dn.unbook_local(r.request_id)  # (ended before its prompt was computed)
        if d.route == DISAGG and d.prefill_node in self.prefill:
            self.prefill[d.prefill_node].dequeue(r.request_id, self.clock())
        if output_tokens is not None and r.max_tokens:
            share = min(1.0, output_tokens / r.max_tokens)
            self._output_share = 0.95 * self._output_share + 0.05 * share
