"""Capacity of a pool of nodes, predicted from a node's costs and a workload's statistics.

Capacity is the highest arrival rate (requests/s) at which a share ``attainment`` (0.9)
of the requests meets the TTFT SLO and the mean gap between tokens stays inside the TBT
SLO. Notation: ``I``, ``O``, ``h`` a request's prompt, output and hit tokens;
``f, p0, p1, a, b, c`` and ``kv / bw`` the costs of :mod:`.costs`; ``ctx`` and ``kvtok`` the
workload's time-weighted context and KV per decoding sequence (:mod:`.workload_stats`).

**Prefill pool** (``P`` nodes, disaggregated). A request's service time on its node::

    S = f + n * (p0 + p1 * (h_local + h_store + n / 2))         n = I - h_local - h_store
        + min(h_store * kv / bw, what recomputing those tokens would cost)  # store fetch
        + I * kv / bw                  # sending its KV to the decode node (CPU transfers)

with ``h_local`` the hits of the node's own pool (cache split over ``P`` nodes) and
``h_store`` the rest of the cluster-wide reuse, fetched from the store when that is
cheaper than recomputing (the policy's bandwidth inequality; without a store,
``h_store = 0``). Each node is a G/G/1 queue at utilization ``rho = lambda * mean(S) / P``.
Its wait follows Kingman's mean with an exponential tail::

    E[W] = rho / (1 - rho) * (ca2 + cs2) / 2 * mean(S)
    P(W > t) = rho * exp(-t * rho / E[W])

``cs2`` is var(S) / mean(S)^2 over the workload's requests. ``ca2`` is the workload's
arrival burstiness thinned over ``P`` nodes, ``1 + (arrival_cv2 - 1) / P``. A request
misses its TTFT with probability ``P(W > SLO - S)`` (1 when ``S >= SLO``). ``rho_max``
is the highest utilization at which the mean miss is at most ``1 - attainment``.
The pool's capacity is ``P * rho_max / mean(S)``.

**Decode node** (fluid model, shared with colocated nodes). At ``lambda`` requests/s a
node spends a share ``rho_s = lambda * side`` of its time on side work. For a decode node
``side = I * kv / bw``: receiving the KV, when transfers use the CPU. It runs decode
steps back to back in the rest. Steps of ``B`` sequences take
``T(B) = a + (b + c * ctx) * B``. So the mean gap between a sequence's tokens is
``gap = T(B) / (1 - rho_s)``, and Little's law (``B = lambda * O * gap``) gives::

    B = lambda * O * a / ((1 - rho_s) - lambda * O * (b + c * ctx))     (at least 1)

The node holds at ``lambda`` when the denominator is > 0, ``gap <= TBT SLO`` and
``B * kvtok <= pool tokens``. The pool's capacity is ``D`` x the highest such
``lambda``. Near it, ``B`` is the batch the TBT SLO (or KV memory) allows, and the
capacity is ``D * B / (O * T(B) / (1 - rho_s))``.

**Colocated node** (``N`` nodes doing both, local prefix cache only, no transfers). The
side work is the node's own prefill, ``side = mean(S)`` with ``h_local`` the hits of the
cache split over ``N`` nodes. It runs in chunks of ``C = step_token_budget - B`` prompt
tokens, one per decode step (chunked prefill). So the decode constraints above hold with
``rho_s = lambda * mean(S)``. The prefill queue gets a share
``s = C * t_tok / (T(B) + C * t_tok)`` of the node, where ``t_tok`` is the workload's mean
prefill seconds per new token. Its TTFT is the G/G/1 above with service times ``S / s``
at utilization ``rho_s / s``. Capacity is ``N`` x the highest ``lambda`` where all of
these hold.

Not modelled: short prompts that kvmesh prefills on the decode node, queueing of
transfers, the first-to-second-token hand-off gap, batch fluctuations around ``B``,
and the KV pools' finite prefix caches (reuse assumes unbounded caches).
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass

from kvmesh.services.planner.costs import NodeCosts
from kvmesh.services.planner.workload_stats import WorkloadStats

ATTAINMENT = 0.9  # share of requests inside both SLOs that capacity is defined at


@dataclass(frozen=True)
class PoolPrediction:
    """One pool's predicted capacity and what limits it."""

    capacity_rps: float
    """Requests/s the pool serves inside the SLOs (0: not even at a trickle)."""
    limit: str
    """What binds at that rate: "ttft" (prefill queue, or a prompt too long for the TTFT
    SLO), "tbt" (the gap between tokens), "kv" (KV memory caps the batch), "throughput"
    (the node is busy all the time)."""
    nodes: int
    """Nodes in the pool."""
    service_s: float = 0.0
    """Prefill: mean seconds of a request's prefill on its node (``mean(S)``)."""
    batch: float = 0.0
    """Decode: sequences per step at capacity (``B``)."""


# -- prefill -------------------------------------------------------------------------------
def prefill_service_times(
    costs: NodeCosts,
    stats: WorkloadStats,
    nodes: int,
    *,
    shared_store: bool,
    send_kv: bool,
) -> list[float]:
    """``S`` of every sampled request on a prefill node of a pool of ``nodes`` (the module
    docstring's formula): local hits from a cache split over ``nodes``, the rest of the
    shared reuse fetched from the store (``shared_store``), the KV sent on (``send_kv``)."""
    out = []
    for r in stats.samples:
        h_local = min(r.hits(nodes, shared_store=False), r.input_tokens - 1)
        h_all = max(h_local, min(r.hits(nodes, shared_store), r.input_tokens - 1))
        h_store = h_all - h_local if shared_store else 0
        full = costs.prefill_seconds(r.input_tokens - h_local, h_local)
        with_store = costs.prefill_seconds(r.input_tokens - h_all, h_all)
        fetch = min(costs.transfer_seconds(h_store), full - with_store)
        s = with_store + fetch
        if send_kv and costs.transfer_on_cpu:
            s += costs.transfer_seconds(r.input_tokens)
        out.append(s)
    return out


def ttft_miss(
    service: list[float], rho: float, ca2: float, slo_s: float, speed: float = 1.0
) -> float:
    """Share of requests whose TTFT exceeds ``slo_s`` on a G/G/1 node at utilization
    ``rho`` whose server runs at ``speed`` (service times ``service / speed``)."""
    ss = [s / speed for s in service]
    mean = sum(ss) / len(ss)
    cs2 = sum((s - mean) ** 2 for s in ss) / len(ss) / mean**2 if mean > 0 else 0.0
    if rho <= 0:
        return sum(1.0 for s in ss if s >= slo_s) / len(ss)
    if rho >= 1:
        return 1.0
    theta = (ca2 + cs2) / 2.0 * mean / (1.0 - rho)  # E[W] / rho: the tail's mean
    miss = 0.0
    for s in ss:
        slack = slo_s - s
        miss += 1.0 if slack <= 0 else (rho * math.exp(-slack / theta) if theta > 0 else 0.0)
    return miss / len(ss)


def _largest(ok: Callable[[float], bool], hi: float, iters: int = 60) -> float:
    """The largest x in [0, hi] with ``ok(x)`` (``ok`` true up to a point, then false)."""
    lo = 0.0
    if ok(hi):
        return hi
    for _ in range(iters):
        mid = (lo + hi) / 2.0
        if ok(mid):
            lo = mid
        else:
            hi = mid
    return lo


def prefill_pool(
    costs: NodeCosts,
    stats: WorkloadStats,
    nodes: int,
    ttft_slo_s: float,
    *,
    shared_store: bool = True,
    attainment: float = ATTAINMENT,
) -> PoolPrediction:
    """Capacity of ``nodes`` prefill nodes (module docstring, "Prefill pool")."""
    service = prefill_service_times(costs, stats, nodes, shared_store=shared_store, send_kv=True)
    mean = sum(service) / len(service)
    ca2 = 1.0 + (stats.arrival_cv2 - 1.0) / nodes
    allowed = 1.0 - attainment
    rho = _largest(lambda r: ttft_miss(service, r, ca2, ttft_slo_s) <= allowed, 0.999)
    if ttft_miss(service, 0.0, ca2, ttft_slo_s) > allowed:
        rho = 0.0
    return PoolPrediction(nodes * rho / mean, "ttft", nodes, service_s=mean)


# -- decode --------------------------------------------------------------------------------
@dataclass(frozen=True)
class NodeState:
    """A node doing decode steps (and side work) at an arrival rate: the fluid model."""

    ok: bool
    limit: str  # the first constraint that fails ("" when ok)
    batch: float  # B
    gap_s: float  # mean seconds between a sequence's tokens
    side_share: float  # rho_s


def decode_node_state(
    costs: NodeCosts, stats: WorkloadStats, rate: float, side_s: float, tbt_slo_s: float
) -> NodeState:
    """The decode constraints of one node at ``rate`` requests/s with ``side_s`` seconds of
    side work per request (module docstring, "Decode node")."""
    rho_s = rate * side_s
    per_seq = (
        costs.decode_step_s_per_seq + costs.decode_step_s_per_ctx_token * stats.decode_context_mean
    )
    tokens = rate * stats.output_mean
    denom = (1.0 - rho_s) - tokens * per_seq
    if rho_s >= 1.0 or denom <= 0:
        return NodeState(False, "throughput", math.inf, math.inf, rho_s)
    batch = max(1.0, tokens * costs.decode_step_s / denom)
    gap = (costs.decode_step_s + per_seq * batch) / (1.0 - rho_s)
    if gap > tbt_slo_s:
        return NodeState(False, "tbt", batch, gap, rho_s)
    if batch * stats.decode_kv_mean > costs.pool_tokens:
        return NodeState(False, "kv", batch, gap, rho_s)
    return NodeState(True, "", batch, gap, rho_s)


def _max_rate(feasible: Callable[[float], bool]) -> float:
    """The highest rate where ``feasible`` holds (0 if none): doubling, then bisection."""
    lo = 1e-6
    if not feasible(lo):
        return 0.0
    hi = lo * 2
    while feasible(hi):
        lo, hi = hi, hi * 2
        if hi > 1e9:
            return lo
    for _ in range(60):
        mid = (lo + hi) / 2.0
        if feasible(mid):
            lo = mid
        else:
            hi = mid
    return lo


def decode_pool(
    costs: NodeCosts, stats: WorkloadStats, nodes: int, tbt_slo_s: float
) -> PoolPrediction:
    """Capacity of ``nodes`` decode nodes that receive every request's KV (module
    docstring, "Decode node")."""
    side = costs.transfer_seconds(stats.input_mean) if costs.transfer_on_cpu else 0.0
    rate = _max_rate(lambda x: decode_node_state(costs, stats, x, side, tbt_slo_s).ok)
    at = decode_node_state(costs, stats, rate, side, tbt_slo_s)
    beyond = decode_node_state(costs, stats, max(rate, 1e-6) * 1.001, side, tbt_slo_s)
    return PoolPrediction(nodes * rate, beyond.limit or "tbt", nodes, batch=at.batch)


# -- colocated -----------------------------------------------------------------------------
def colocated_pool(
    costs: NodeCosts,
    stats: WorkloadStats,
    nodes: int,
    ttft_slo_s: float,
    tbt_slo_s: float,
    *,
    step_token_budget: int = 128,
    attainment: float = ATTAINMENT,
) -> PoolPrediction:
    """Capacity of ``nodes`` nodes that each prefill (chunked) and decode their own
    requests with a local prefix cache only (module docstring, "Colocated node")."""
    service = prefill_service_times(costs, stats, nodes, shared_store=False, send_kv=False)
    mean = sum(service) / len(service)
    new = sum(
        r.input_tokens - min(r.hits(nodes, shared_store=False), r.input_tokens - 1)
        for r in stats.samples
    ) / len(stats.samples)
    t_tok = mean / new  # prefill seconds per new prompt token, on average
    ca2 = 1.0 + (stats.arrival_cv2 - 1.0) / nodes
    allowed = 1.0 - attainment
    limit = ["ttft"]

    def feasible(rate: float) -> bool:
        st = decode_node_state(costs, stats, rate, mean, tbt_slo_s)
        if not st.ok:
            limit[0] = st.limit
            return False
        chunk = step_token_budget - st.batch
        if chunk < 1:
            limit[0] = "tbt"  # no room in a step for a prompt chunk beside the batch
            return False
        step = costs.step_seconds(st.batch, st.batch * stats.decode_context_mean)
        share = chunk * t_tok / (step + chunk * t_tok)
        rho = st.side_share / share
        if rho >= 1.0 or ttft_miss(service, rho, ca2, ttft_slo_s, speed=share) > allowed:
            limit[0] = "ttft"
            return False
        return True

    rate = _max_rate(feasible)
    feasible(max(rate, 1e-6) * 1.001)  # what binds just above the capacity
    at = decode_node_state(costs, stats, rate, mean, tbt_slo_s)
    return PoolPrediction(nodes * rate, limit[0], nodes, service_s=mean, batch=at.batch)
