"""The fault suite's ``hostile-body`` row (issue 34): while the closed-loop gRPC clients
run on the shared cluster, the hostile bodies of :mod:`kvmesh.loadtest.hostile_body` (7.8
million token ids, a million keys, gzip bombs to paths that answer 401/404/405 without
reading them) are sent to the conductor's HTTP API, each kind alongside a live HTTP
stream whose token gaps are measured. The row passes when every kind's worst gap stays
within the issue's bound (100 ms, or 5x the same stream's worst gap just before) and no
request of the load fails, hangs or is wrong."""

from __future__ import annotations

import asyncio

from kvmesh.loadtest.fault_harness import Load, Plan, run_fault
from kvmesh.loadtest.hostile_body import KINDS, measure

BASELINE_S = 3.0  # each kind's stream runs this long before its bodies are sent


def hostile_body(cluster, prompts, expect, plan: Plan) -> dict:
    addr = f"127.0.0.1:{cluster.http_port}"
    pid = cluster.procs["conductor-0"].pid

    async def act(load: Load, res: dict) -> None:
        await asyncio.sleep(plan.before_s)
        res["t_fault"] = load.now()
        kinds = [
            await asyncio.to_thread(measure, addr, kind, "", BASELINE_S, pid) for kind in KINDS
        ]
        res["hostile"] = {
            k["kind"]: {
                "worst_gap_s": k["worst_gap_s"],
                "baseline_worst_gap_s": k["baseline_worst_gap_s"],
                "bound_s": k["bound_s"],
                "cpu_s_extra": k["cpu_s_extra"],
                "replies": [r[:60] for r in k["replies"]],
            }
            for k in kinds
        }
        res["gaps_bounded"] = all(k["bounded"] for k in kinds)
        res["cluster_whole_s"] = 0.0  # nothing was broken
        res["whole_means"] = "nothing to recover: the conductor served on"
        await asyncio.sleep(max(0.0, plan.after_s - (load.now() - res["t_fault"])))

    row = run_fault(cluster, "hostile-body", prompts, expect, plan, act)
    row["passed"] = bool(row.get("gaps_bounded")) and not (
        row["wrong"] or row["hung"] or row["failed_other"] or row["failed_retriable"]
    )
    return row
