"""The P:D ratio planner: how many of ``N`` nodes should prefill and how many decode.

Prefill and decode are separate pools so that each can be sized for its own bottleneck
(docs/architecture.md). The planner predicts each split's
capacity (requests/s inside both SLOs) from a node's measured costs and a workload's token
statistics and prefix reuse, and names the split to run::

    from kvmesh.services.planner import NodeCosts, WorkloadStats, plan

    costs = measure_costs("medium", "float32", block_size=16, cpus=0.375)  # or NodeCosts.load()
    stats = WorkloadStats.from_trace("trace.jsonl", block_tokens=16, max_input=1536)
    p = plan(costs, stats, nodes=4, cpus=0.375, ttft_slo_s=2.0, tbt_slo_s=0.15)
    p.pick            # (P, D)
    print(p.format_table())

Modules: :mod:`.costs` (what a node costs), :mod:`.measure` (measuring it with the real
engine), :mod:`.workload_stats` (a workload's tokens and reuse), :mod:`.model` (a pool's
capacity: the formulas), :mod:`.plan` (every split and the pick), :mod:`.command`
(``kvmesh plan``).
"""

from kvmesh.services.planner.costs import NodeCosts
from kvmesh.services.planner.model import (
    PoolPrediction,
    colocated_pool,
    decode_pool,
    prefill_pool,
)
from kvmesh.services.planner.plan import Plan, RatioPrediction, plan
from kvmesh.services.planner.workload_stats import RequestTokens, WorkloadStats

__all__ = [
    "NodeCosts",
    "Plan",
    "PoolPrediction",
    "RatioPrediction",
    "RequestTokens",
    "WorkloadStats",
    "colocated_pool",
    "decode_pool",
    "plan",
    "prefill_pool",
]
