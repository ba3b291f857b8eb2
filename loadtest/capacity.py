"""The thesis at equal compute: capacity of colocated against kvmesh at every P:D ratio.

    python -m kvmesh.loadtest.capacity            # the whole evaluation (<= 90 min, 2 cores)
    python -m kvmesh.loadtest.capacity --quick    # every phase, small (a few minutes)

**Equal compute.** Every configuration has ``--nodes`` (4) model nodes of ``--cpus``
(0.375) cores each: a cgroup per node with a CFS quota of cpus x 10 ms per 10 ms
(:mod:`kvmesh.services.common.cpu_budget`), ceil(cpus) torch threads, no pinning. The
control plane (etcd, store-master, conductor) shares one budget of ``--control-cpus``;
the load generator runs its probes under ``--loadgen-cpus``. Each run records every
node's CPU-seconds (its cgroup's counter) against its budget; a run in which any node
used more than 105% of it is marked invalid (the kernel's quota makes that a broken
set-up, not noise).

- ``colocated``: every node prefills and decodes its own requests with its local prefix
  cache (chunked prefill, no admission control: the vLLM set-up); the idle prefill node
  the conductor needs is registered with a budget too (its CPU use is in the report).
- ``kvmesh-PpDd``: P prefill + D decode nodes, store segments, every route, early
  rejection; swept over every ratio with P, D >= 1.
- ``nostore-PpDd``: the same split without the store, at kvmesh's best ratio.

**Capacity** is the highest offered rate at which >= 90% of the *offered* requests finish
inside both SLOs; a refusal is a miss. Each probe offers ``--probe-requests`` (>= 150)
requests of its own tokens at one rate; the search starts at the planner's prediction
(else a cost-based guess), steps x1.5 until a rate that holds lies below one that does
not, then bisects that bracket (geometric midpoint) with the probes left. The report
gives the bracket, the attainment curve of every probe (PNG) and, for the pair that
decides the headline, ``--repeats`` whole searches (medians; the lowest kvmesh search
against the highest colocated one).

Phases (``--phases``): ``costs`` (each node's prefill time per token and decode step at
its budget, KV bytes per token), ``plan`` (the planner's predicted capacity per ratio),
``sweep`` (trace and shared-prefix: colocated, every kvmesh ratio, nostore at the best),
``others`` (long-prompt and decode-heavy: colocated, the planner's pick and 2P+2D where
the pick differs; agentic sessions on those, served inside both SLOs), ``repeat``
(the headline pair again). Results: ``<out>/capacity.json``, ``capacity.md``,
``capacity_curves.png``.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path

from kvmesh.loadtest import workload as W
from kvmesh.loadtest.eval import Workloads, model_costs
from kvmesh.loadtest.eval_cluster import ConfigCluster, Setup, budget_configs
from kvmesh.services.common import cpu_budget

RESULTS = Path(__file__).resolve().parent / "results" / "capacity"
PHASES = ("costs", "plan", "sweep", "others", "repeat")
SWEPT = ("trace", "shared")
OTHERS = ("long", "decode")
TARGET = 0.9
OVER_BUDGET = 1.05  # a node above this share of its budget makes its run invalid


class CapacityWorkloads(Workloads):
    """The evaluation's workloads (:class:`~kvmesh.loadtest.eval.Workloads`) and two more:
    ``long`` (long prompts: a few long documents, each asked many questions; short
    outputs) and ``decode`` (short prompts, long outputs)."""

    def long(self, rate: float, seed: int, n: int | None = None) -> list[W.Item]:
        a = self.a
        lo, hi = (round(x * a.long_scale) for x in (2048, 8192))
        return W.shared_prefix_items(
            n or a.probe_requests,
            rate_rps=rate,
            prefixes=a.long_documents,
            prefix_tokens=(lo, hi),
            user_tokens=(16, 64),
            output=(4, min(64, a.max_output)),
            zipf=0.6,
            seed=4000 + seed,
        )

    def decode(self, rate: float, seed: int, n: int | None = None) -> list[W.Item]:
        a = self.a
        return W.shared_prefix_items(
            n or a.probe_requests,
            rate_rps=rate,
            prefixes=4,
            prefix_tokens=(32, 96),
            user_tokens=(32, 160),
            output=(a.decode_output_min, a.decode_output_max),
            seed=5000 + seed,
        )

    def maker(self, name: str) -> Callable[..., list[W.Item]]:
        return {"trace": self._trace, "shared": self._shared, "long": self.long}.get(
            name, self.decode
        )

    def _trace(self, rate: float, seed: int, n: int | None = None) -> list[W.Item]:
        items = self.trace(rate, seed, n=n or self.a.probe_requests)
        if len(items) < (n or self.a.probe_requests):  # the sample is short: again, later
            more = self.trace(rate, seed + 50, n=(n or self.a.probe_requests) - len(items))
            span = items[-1].t_ms if items else 0.0
            items += [
                W.Item(f"{m.rid}-b", m.t_ms + span + 1000.0 / rate, m.token_ids, m.max_tokens)
                for m in more
            ]
        return items

    def _shared(self, rate: float, seed: int, n: int | None = None) -> list[W.Item]:
        return self.shared(rate, seed, n=n or self.a.probe_requests)


def search_capacity(
    probe: Callable[[float, int], float], start: float, probes: int, log=print
) -> dict:
    """The capacity search of the module docstring. ``probe(rate, k)`` offers the k-th
    probe's requests at ``rate`` and returns the share of them inside both SLOs."""
    seen: list[tuple[float, float]] = []
    rate, factor = start, 1.5
    for k in range(probes):
        att = probe(rate, k)
        seen.append((rate, att))
        ok = [r for r, a in seen if a >= TARGET]
        lo = max(ok) if ok else None
        above = [r for r, a in seen if a < TARGET and (lo is None or r > lo)]
        hi = min(above) if above else None
        if lo is not None and hi is not None:
            rate = (lo * hi) ** 0.5
        elif lo is not None:
            rate = lo * factor
        else:
            rate = min(r for r, _ in seen) / factor
    ok = [(r, a) for r, a in seen if a >= TARGET]
    lo_pt = max(ok) if ok else None
    above = [(r, a) for r, a in seen if a < TARGET and (lo_pt is None or r > lo_pt[0])]
    hi_pt = min(above) if above else None
    if lo_pt is None:
        est = 0.0
    elif hi_pt is None:
        est = lo_pt[0]
    else:  # linear in rate between the bracket's ends
        (r0, a0), (r1, a1) = lo_pt, hi_pt
        est = r0 + (a0 - TARGET) / max(1e-9, a0 - a1) * (r1 - r0)
    return {
        "capacity_rps": round(est, 3),
        "bracket": [lo_pt[0] if lo_pt else 0.0, hi_pt[0] if hi_pt else None],
        "bracketed": lo_pt is not None and hi_pt is not None,
        "probes": [{"rate": round(r, 3), "attainment": round(a, 4)} for r, a in seen],
    }


def _costs_at_budget(setup: Setup, quick: bool) -> dict:
    """The model's costs on one core with one thread, and scaled to the node budget."""
    c = model_costs(setup, [(setup.model, setup.dtype)])[0]
    scale = 1.0 / min(1.0, setup.cpus)  # a budget below a core stretches CPU time
    c["cpus"] = setup.cpus
    c["prefill_ms_per_token_at_budget"] = round(c["prefill_ms_per_token"] * scale, 3)
    c["decode_step_ms_b1_at_budget"] = round(c["decode_step_ms_b1"] * scale, 2)
    c["decode_step_ms_b8_at_budget"] = round(c["decode_step_ms_b8"] * scale, 2)
    return c


def _guess(costs: dict, items: list[W.Item], nodes: int, cpus: float, block: int) -> float:
    """A first rate to probe: the nodes' prefill throughput at the workload's ideal hits."""
    mean_in = statistics.mean(len(i.token_ids) for i in items)
    hit = W.ideal_hit_ratio(items, block)
    per_req_s = mean_in * (1 - hit) * costs["prefill_ms_per_token"] / 1000.0
    return max(0.05, 0.5 * nodes * cpus / max(1e-6, per_req_s))


def _predict(a, items: list[W.Item], setup: Setup, measured: dict) -> dict | None:
    """The planner's (:mod:`kvmesh.services.planner`) predicted capacity of every
    configuration on ``items``, and its pick. Its costs are measured once (``measured``
    keeps them) in this process with the real engine at the node budget."""
    from kvmesh.services.common.config import parse_size
    from kvmesh.services.planner import WorkloadStats, plan
    from kvmesh.services.planner.measure import measure_costs

    if "costs" not in measured:
        measured["costs"] = measure_costs(
            setup.model, setup.dtype, setup.block_size, cpus=a.cpus, kv_memory=setup.kv_memory
        )
    costs = measured["costs"]
    kv_per_token = costs.kv_bytes_per_token or 1
    stats = WorkloadStats.from_workload_items(
        items,
        block_size=setup.block_size,
        local_cache_tokens=parse_size(setup.kv_memory) // kv_per_token,
    )
    args = (costs, stats, a.nodes, a.cpus, setup.ttft_slo_ms / 1000, setup.tbt_slo_ms / 1000)
    with_store = plan(*args, step_token_budget=setup.step_token_budget)
    no_store = plan(*args, step_token_budget=setup.step_token_budget, shared_store=False)
    predicted = {"colocated": round(with_store.colocated.capacity_rps, 3)}
    for r, n in zip(with_store.ratios, no_store.ratios, strict=True):
        predicted[f"kvmesh-{r.prefill_nodes}p{r.decode_nodes}d"] = round(r.capacity_rps, 3)
        predicted[f"nostore-{n.prefill_nodes}p{n.decode_nodes}d"] = round(n.capacity_rps, 3)
    p, d = with_store.pick
    return {
        "predicted_rps": predicted,
        "pick": f"kvmesh-{p}p{d}d",
        "table": with_store.format_table(),
        "costs": costs.to_dict(),
    }


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(
        prog="python -m kvmesh.loadtest.capacity", description=__doc__.split("\n")[0]
    )
    p.add_argument("--quick", action="store_true", help="every phase, small (a few minutes)")
    p.add_argument("--phases", default=",".join(PHASES))
    p.add_argument(
        "--configs",
        default="",
        help="only these configurations (comma-separated, e.g. colocated,kvmesh-2p2d)",
    )
    p.add_argument(
        "--workloads",
        default=",".join(SWEPT + OTHERS),
        help="the workloads the sweep, others and repeat phases measure",
    )
    p.add_argument("--nodes", type=int, default=4, help="model nodes of every configuration")
    p.add_argument("--cpus", type=float, default=0.375, help="CPU budget of each node, cores")
    p.add_argument("--control-cpus", type=float, default=0.3, help="etcd+store-master+conductor")
    p.add_argument("--loadgen-cpus", type=float, default=0.2, help="the load generator")
    p.add_argument("--model", default="medium")
    p.add_argument("--dtype", default="float32")
    p.add_argument("--kv-memory", default="24MiB", help="each node's KV pool")
    p.add_argument("--segment-per-pool", type=int, default=10)
    p.add_argument("--block-size", type=int, default=16)
    p.add_argument("--ttft-slo-ms", type=float, default=2000.0)
    p.add_argument("--tbt-slo-ms", type=float, default=150.0)
    p.add_argument("--step-token-budget", type=int, default=128)
    p.add_argument("--colocate-below-tokens", type=int, default=64, help="kvmesh's")
    p.add_argument("--trace", default=str(W.DEFAULT_TRACE))
    p.add_argument("--trace-share", type=float, default=0.05, help="share of prefix groups kept")
    p.add_argument("--trace-sample", type=int, default=3)
    p.add_argument("--block-tokens", type=int, default=16, help="tokens per 512-token block")
    p.add_argument("--max-input", type=int, default=1536)
    p.add_argument("--max-output", type=int, default=32)
    p.add_argument("--output-scale", type=float, default=1 / 12)
    p.add_argument("--shared-prefixes", type=int, default=12)
    p.add_argument("--shared-prefix-tokens", type=int, default=768)
    p.add_argument("--long-documents", type=int, default=12)
    p.add_argument(
        "--long-scale",
        type=float,
        default=0.25,
        help="long-prompt documents are 2k-8k tokens x this (0.25: 512-2048 on `medium`, "
        "whose full 2k-8k prefill at 0.375 cores takes 3-11 s)",
    )
    p.add_argument("--decode-output-min", type=int, default=128)
    p.add_argument("--decode-output-max", type=int, default=512)
    p.add_argument("--sessions", type=int, default=3)
    p.add_argument("--turns", type=int, default=30)
    p.add_argument("--max-context", type=int, default=2500)
    p.add_argument("--probe-requests", type=int, default=150, help="requests per probe")
    p.add_argument("--probes", type=int, default=5, help="probes per capacity search")
    p.add_argument("--repeats", type=int, default=3, help="searches of the headline pair")
    p.add_argument("--ratios", default="", help="P:D,... (default: every split of --nodes)")
    p.add_argument("--out", default=str(RESULTS))
    a = p.parse_args(argv)
    if a.quick:  # smaller defaults; what the command line gives explicitly stays
        quick = dict(
            probe_requests=12, probes=2, repeats=1, sessions=1, turns=4, model="tiny",
            nodes=3, cpus=0.5, decode_output_min=24, decode_output_max=48,
            long_documents=3, long_scale=0.1, trace_share=0.015,
        )  # fmt: skip
        for k, v in quick.items():
            if getattr(a, k) == p.get_default(k):
                setattr(a, k, v)
    phases = a.phases.split(",")
    for ph in phases:
        if ph not in PHASES:
            p.error(f"--phases: unknown phase {ph!r}; known: {', '.join(PHASES)}")
    chosen = a.workloads.split(",")
    for w in chosen:
        if w not in SWEPT + OTHERS:
            p.error(f"--workloads: unknown workload {w!r}; known: {', '.join(SWEPT + OTHERS)}")
    if a.nodes < 2 or a.cpus <= 0 or a.probes < 1 or a.repeats < 1:
        p.error("--nodes >= 2, --cpus > 0, --probes >= 1 and --repeats >= 1")
    if not a.quick and a.probe_requests < 150:
        print(f"note: --probe-requests {a.probe_requests} < 150: probes this small cannot "
              "separate the configurations", file=sys.stderr)  # fmt: skip
    ratios = (
        [tuple(int(x) for x in r.split(":")) for r in a.ratios.split(",")]
        if a.ratios
        else [(k, a.nodes - k) for k in range(1, a.nodes)]
    )
    why = cpu_budget.support()
    if why:
        print(f"error: the evaluation needs CPU budgets: {why}", file=sys.stderr)
        return 2
    # threads 0: ceil(cpus), from the budget
    setup = Setup.from_args(a, threads=0, cpus=a.cpus, control_cpus=a.control_cpus)
    cfgs = budget_configs(setup, a.nodes, ratios)
    wl = CapacityWorkloads(a)
    out = Path(a.out)
    out.mkdir(parents=True, exist_ok=True)
    path = out / "capacity.json"
    t0 = time.monotonic()
    res: dict = {
        "args": vars(a),
        "setup": setup.to_json(),
        "created": time.strftime("%Y-%m-%dT%H:%M:%S"),
        "budgets": {
            "model node": f"{a.cpus:g} cores each, {a.nodes} nodes "
            f"({a.nodes * a.cpus:g} cores of model compute per configuration)",
            "control plane (etcd, store-master, conductor)": f"{a.control_cpus:g} cores together",
            "load generator": f"{a.loadgen_cpus:g} cores",
            "machine": f"{os.cpu_count()} cores",
        },
        "workloads": {},
        "searches": [],
    }

    def log(msg: str) -> None:
        print(f"[{time.monotonic() - t0:6.0f}s] {msg}", flush=True)

    def save() -> None:
        res["elapsed_s"] = round(time.monotonic() - t0, 1)
        path.write_text(json.dumps(res, indent=1))

    loadgen = cpu_budget.CpuBudget.create("loadgen", a.loadgen_cpus)
    try:
        costs = _costs_at_budget(setup, a.quick)
        res["costs"] = costs
        log(f"costs: {json.dumps(costs)}")
        names = list(SWEPT) + list(OTHERS)
        samples = {w: wl.maker(w)(1.0, 0) for w in names}
        for w, items in samples.items():
            res["workloads"][w] = {
                **W.summarize(items),
                "ideal_hit_ratio": round(W.ideal_hit_ratio(items, a.block_size), 3),
            }
        plans: dict[str, dict | None] = {}
        if "plan" in phases:
            measured: dict = {}
            for w in names:
                plans[w] = _predict(a, samples[w], setup, measured)
                log(f"plan for {w}:\n{plans[w]['table']}")
            res["plans"] = plans
        save()

        def measure(cfg_name: str, w: str, repeat: int = 0) -> dict | None:
            if a.configs and cfg_name not in a.configs.split(","):
                return None
            cfg = cfgs[cfg_name]
            make = wl.maker(w)
            predicted = ((plans.get(w) or {}).get("predicted_rps") or {}).get(cfg_name)
            start = predicted or _guess(costs, samples[w], a.nodes, a.cpus, a.block_size)
            runs: list[dict] = []
            with ConfigCluster(cfg_name, cfg, setup) as cc:
                log(f"{cfg_name} on {w} (repeat {repeat}): up in {cc.startup_s} s, "
                    f"first probe {start:.2f} rps")  # fmt: skip

                def probe(rate: float, k: int) -> float:
                    items = make(rate, 100 * repeat + 10 * k + 1)
                    loadgen.add()
                    try:
                        r = cc.run(items, label=f"{w}@{rate:.2f}")
                    finally:
                        loadgen.leave()
                    cpu = r["summary"].get("cpu", {})
                    over = {
                        n: v["share_of_budget"]
                        for n, v in cpu.items()
                        if n != "control-plane" and v["share_of_budget"] > OVER_BUDGET
                    }
                    s = r["summary"]
                    runs.append(
                        {
                            "rate": round(rate, 3),
                            "summary": {k: s.get(k) for k in _KEEP},
                            "cpu": cpu,
                            "invalid": bool(over),
                            "routes": _routes(r),
                            # admission's calibration: (status, estimated, actual TTFT ms)
                            "ttft": [
                                [
                                    x["status"][:2],
                                    x.get("estimated_ttft_ms") or 0.0,
                                    x.get("ttft_ms"),
                                ]
                                for x in r["records"]
                            ],  # fmt: skip
                        }
                    )
                    log(f"  {rate:7.3f} rps: inside {100 * (s['slo_attainment'] or 0):5.1f}% "
                        f"(accepted {100 * (s['slo_attainment_accepted'] or 0):5.1f}%), "
                        f"refused {s['rejected']}/{s['requests']}, TTFT p90 "
                        f"{s['ttft_ms']['p90'] or 0:.0f} ms, TBT p99 {s['tbt_ms']['p99'] or 0:.0f}"
                        f" ms, {r['wall_s']} s" + (f"  OVER BUDGET {over}" if over else ""))  # fmt: skip
                    return s["slo_attainment"] or 0.0

                found = search_capacity(probe, start, a.probes, log)
            found.update(config=cfg_name, workload=w, repeat=repeat, runs=runs,
                         predicted_rps=predicted, valid=not any(r["invalid"] for r in runs))  # fmt: skip
            log(f"{cfg_name} on {w}: capacity {found['capacity_rps']} rps, bracket "
                f"{found['bracket']}")  # fmt: skip
            res["searches"].append(found)
            save()
            return found

        best: dict[str, str] = {}
        if "sweep" in phases:
            for w in [w for w in SWEPT if w in chosen]:
                measure("colocated", w)
                kv = [f for p_, d in ratios if (f := measure(f"kvmesh-{p_}p{d}d", w))]
                if kv:
                    top = max(kv, key=lambda f: f["capacity_rps"])
                    best[w] = top["config"]
                    measure(top["config"].replace("kvmesh-", "nostore-"), w)
        if "others" in phases:
            for w in [w for w in OTHERS if w in chosen]:
                pick = (
                    (plans.get(w) or {}).get("pick")
                ) or f"kvmesh-{a.nodes // 2}p{a.nodes - a.nodes // 2}d"
                mid = f"kvmesh-{a.nodes // 2}p{a.nodes - a.nodes // 2}d"
                for name in dict.fromkeys(["colocated", pick, mid]):
                    if name in cfgs:
                        measure(name, w)
        if "repeat" in phases:
            for w in [w for w in SWEPT if w in chosen]:
                pair = [
                    "colocated",
                    best.get(w) or f"kvmesh-{a.nodes // 2}p{a.nodes - a.nodes // 2}d",
                ]
                for rep in range(1, a.repeats):
                    for name in pair:
                        measure(name, w, repeat=rep)
        res["best"] = best
        save()
    finally:
        loadgen.close()
    log(f"done in {time.monotonic() - t0:.0f} s -> {path}")
    from kvmesh.loadtest.capacity_report import write_report

    print(write_report(out))
    return 0


_KEEP = (
    "requests", "served", "rejected", "failed", "slo_attainment", "slo_attainment_accepted",
    "goodput_rps", "ttft_ms", "tbt_ms", "cache_hit_ratio", "reject_ms", "first_gap_ms",
)  # fmt: skip


def _routes(r: dict) -> dict[str, int]:
    out: dict[str, int] = {}
    for rec in r.get("records", []):
        key = rec.get("route") or "?"
        key = key if isinstance(key, str) else json.dumps(key, sort_keys=True)
        out[key] = out.get(key, 0) + 1
    return out


if __name__ == "__main__":
    with contextlib.suppress(KeyboardInterrupt):
        sys.exit(main())
