"""The pick: every prefill:decode split of ``N`` nodes, its predicted capacity, and the one
to run.

For ``P + D = N`` (``P, D >= 1``) at a budget of ``F`` cores per node::

    capacity(P:D) = min(prefill_pool(P), decode_pool(D))          (see .model)
    bottleneck    = the pool with the smaller capacity
    pick          = the split of the highest capacity (ties: the most even split, then
                    fewer prefill nodes)

``colocated`` (``N`` nodes that each do both, local prefix caches only) is predicted too,
for comparison. Costs measured at another budget are rescaled to ``F`` first
(:meth:`NodeCosts.at_budget`).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from kvmesh.services.planner.costs import NodeCosts
from kvmesh.services.planner.model import (
    ATTAINMENT,
    PoolPrediction,
    colocated_pool,
    decode_pool,
    prefill_pool,
)
from kvmesh.services.planner.workload_stats import WorkloadStats


@dataclass(frozen=True)
class RatioPrediction:
    """One split of the nodes: ``prefill_nodes`` : ``decode_nodes``."""

    prefill_nodes: int
    """P."""
    decode_nodes: int
    """D."""
    prefill: PoolPrediction
    """The prefill pool's capacity and its limit."""
    decode: PoolPrediction
    """The decode pool's capacity and its limit."""

    @property
    def capacity_rps(self) -> float:
        """Predicted requests/s inside both SLOs: the smaller pool's capacity."""
        return min(self.prefill.capacity_rps, self.decode.capacity_rps)

    @property
    def bottleneck(self) -> str:
        """Which pool saturates first: "prefill" or "decode"."""
        return "prefill" if self.prefill.capacity_rps <= self.decode.capacity_rps else "decode"

    @property
    def limit(self) -> str:
        """What binds in the bottleneck pool ("ttft", "tbt", "kv", "throughput")."""
        return (self.prefill if self.bottleneck == "prefill" else self.decode).limit

    @property
    def label(self) -> str:
        return f"{self.prefill_nodes}P:{self.decode_nodes}D"

    def to_dict(self) -> dict[str, Any]:
        return {
            "prefill_nodes": self.prefill_nodes,
            "decode_nodes": self.decode_nodes,
            "capacity_rps": self.capacity_rps,
            "bottleneck": self.bottleneck,
            "limit": self.limit,
            "prefill_capacity_rps": self.prefill.capacity_rps,
            "prefill_limit": self.prefill.limit,
            "prefill_service_s": self.prefill.service_s,
            "decode_capacity_rps": self.decode.capacity_rps,
            "decode_limit": self.decode.limit,
            "decode_batch": self.decode.batch,
        }


@dataclass(frozen=True)
class Plan:
    """Predicted capacity of every split of ``nodes`` nodes, colocated's, and the pick."""

    nodes: int
    """N: model nodes in all."""
    cpus: float
    """F: each node's CPU budget (cores)."""
    ttft_slo_s: float
    """TTFT SLO the predictions hold (for ``attainment`` of the requests)."""
    tbt_slo_s: float
    """TBT SLO (mean gap between a request's tokens)."""
    attainment: float
    """Share of requests inside both SLOs that capacity is defined at."""
    ratios: tuple[RatioPrediction, ...]
    """Every split 1:N-1 ... N-1:1, by prefill nodes."""
    colocated: PoolPrediction
    """N nodes that prefill and decode their own requests, local prefix caches only."""
    costs: NodeCosts
    """The costs used (at ``cpus``)."""
    stats: WorkloadStats
    """The workload's statistics used."""

    @property
    def best(self) -> RatioPrediction:
        """The split to run: the highest predicted capacity (ties: the most even split,
        then fewer prefill nodes)."""
        top = max(r.capacity_rps for r in self.ratios)
        tied = [r for r in self.ratios if r.capacity_rps >= top * (1 - 1e-9)]
        return min(tied, key=lambda r: (abs(r.prefill_nodes - r.decode_nodes), r.prefill_nodes))

    @property
    def pick(self) -> tuple[int, int]:
        """``(P, D)`` of :attr:`best`."""
        return self.best.prefill_nodes, self.best.decode_nodes

    def ratio(self, prefill_nodes: int) -> RatioPrediction:
        """The prediction for ``prefill_nodes`` : ``nodes - prefill_nodes``."""
        for r in self.ratios:
            if r.prefill_nodes == prefill_nodes:
                return r
        raise KeyError(f"no split with {prefill_nodes} prefill nodes of {self.nodes}")

    def to_dict(self) -> dict[str, Any]:
        p, d = self.pick
        return {
            "nodes": self.nodes,
            "cpus": self.cpus,
            "ttft_slo_s": self.ttft_slo_s,
            "tbt_slo_s": self.tbt_slo_s,
            "attainment": self.attainment,
            "pick": {"prefill_nodes": p, "decode_nodes": d, "label": self.best.label},
            "ratios": [r.to_dict() for r in self.ratios],
            "colocated": {
                "nodes": self.colocated.nodes,
                "capacity_rps": self.colocated.capacity_rps,
                "limit": self.colocated.limit,
                "prefill_service_s": self.colocated.service_s,
                "decode_batch": self.colocated.batch,
            },
            "costs": self.costs.to_dict(),
            "workload": self.stats.summary(),
        }

    def format_table(self) -> str:
        """The human-readable plan: workload, costs, one row per split, colocated, pick."""
        s = self.stats
        split = " ".join(
            f"{k}:{r:.0%}" for k, r in enumerate(s.reuse_by_nodes[: self.nodes], start=1)
        )
        lines = [
            f"workload: {s.requests} requests, input {s.input_mean:.1f} tokens, output "
            f"{s.output_mean:.1f} tokens, prefix reuse {s.reuse:.0%} with the shared store "
            f"(k nodes, own caches only: {split}), arrival cv^2 {s.arrival_cv2:.2f}",
            f"costs: {self.costs.describe()}",
            f"SLOs: TTFT {self.ttft_slo_s * 1e3:g} ms for {self.attainment:.0%} of requests,"
            f" TBT {self.tbt_slo_s * 1e3:g} ms; {self.nodes} nodes x {self.cpus:g} cores",
            "",
            f"{'ratio':<8}{'capacity':>12}{'prefill':>12}{'decode':>12}  bottleneck",
        ]
        for r in self.ratios:
            lines.append(
                f"{r.label:<8}{r.capacity_rps:>8.3f} r/s{r.prefill.capacity_rps:>12.3f}"
                f"{r.decode.capacity_rps:>12.3f}  {r.bottleneck} ({r.limit})"
            )
        c = self.colocated
        lines.append(
            f"{'coloc':<8}{c.capacity_rps:>8.3f} r/s{'':>12}{'':>12}  "
            f"{c.nodes} nodes doing both ({c.limit})"
        )
        b = self.best
        vs = f", {b.capacity_rps / c.capacity_rps:.2f}x colocated" if c.capacity_rps > 0 else ""
        lines += ["", f"pick: {b.label} (predicted {b.capacity_rps:.3f} requests/s{vs})"]
        return "\n".join(lines)


def plan(
    costs: NodeCosts,
    stats: WorkloadStats,
    nodes: int,
    cpus: float,
    ttft_slo_s: float,
    tbt_slo_s: float,
    *,
    attainment: float = ATTAINMENT,
    step_token_budget: int = 128,
    shared_store: bool = True,
) -> Plan:
    """Predict every split of ``nodes`` nodes of ``cpus`` cores each, and colocated.

    ``shared_store`` False plans disaggregation without the store (prefill nodes reuse
    only their own caches). ``step_token_budget``: a colocated node's tokens per step
    (running batch + prompt chunk), as ``--step-token-budget``.
    """
    if nodes < 2:
        raise ValueError(f"a split needs at least 2 nodes, got {nodes}")
    if cpus <= 0 or ttft_slo_s <= 0 or tbt_slo_s <= 0:
        raise ValueError("cpus and both SLOs must be > 0")
    if not 0 < attainment < 1:
        raise ValueError(f"attainment must be in (0, 1), got {attainment}")
    c = costs.at_budget(cpus)
    c.check()
    ratios = tuple(
        RatioPrediction(
            p,
            nodes - p,
            prefill_pool(c, stats, p, ttft_slo_s, shared_store=shared_store, attainment=attainment),
            decode_pool(c, stats, nodes - p, tbt_slo_s),
        )
        for p in range(1, nodes)
    )
    colocated = colocated_pool(
        c,
        stats,
        nodes,
        ttft_slo_s,
        tbt_slo_s,
        step_token_budget=step_token_budget,
        attainment=attainment,
    )
    return Plan(nodes, cpus, ttft_slo_s, tbt_slo_s, attainment, ratios, colocated, c, stats)
