"""The realistic evaluation: colocated vs disaggregated-without-store vs kvmesh on equal
hardware (two pinned model nodes, one core and one torch thread each), a model whose
prefill costs real compute, KV pools that hold only part of the working set, a store
~10x larger.

    python -m kvmesh.loadtest            # the whole evaluation (~20 min on 2 cores)
    python -m kvmesh.loadtest --quick    # every phase, small (~5 min)
    python -m kvmesh.loadtest.eval --phases costs,trace --configs colocated,kvmesh

Phases (each bounded in requests and time; results in ``<out>/eval.json``, report in
``<out>/report.md``, figures ``eval_*.png``):

1. ``costs``: each model's compute time per prompt token and per decode step, and its KV
   bytes per token, measured in this process on one pinned core with one thread.
2. ``knee``: on ``colocated``, the highest offered rate at which it still has >= 90% of
   its requests inside both SLOs, for the trace and for the shared-prefix workload
   (each probe the mean of ``--knee-seeds`` runs; x1.6 steps until bracketed, then
   bisection; then linear interpolation of attainment between the highest rate that
   held and the lowest above it that did not).
3. ``trace``: a group sample of the Mooncake synthetic trace (whole prefix groups, so its
   reuse is the trace's), scaled, offered at ``--loads`` x the knee to every config;
   the 1x point ``--repeats`` times (medians reported).
4. ``shared``: many users behind a few long system prompts / tool schemas, the same way.
5. ``agentic``: agent sessions of 30+ turns (each prompt = previous context + output +
   tool results), closed-loop inside a session.
6. ``cache``: kvmesh with and without its store segments at several KV pool sizes, the
   trace at the knee: hit ratio and TTFT against pool size.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from pathlib import Path

from kvmesh.loadtest import workload as W
from kvmesh.loadtest.eval_cluster import CONFIGS, ConfigCluster, Setup, configs, node_cores

RESULTS = Path(__file__).resolve().parent / "results"
PHASES = ("costs", "knee", "trace", "shared", "agentic", "cache")


# -- costs ----------------------------------------------------------------------------------
def model_costs(setup: Setup, names: list[tuple[str, str]]) -> list[dict]:
    """Each (model, dtype): compute time per prompt token (a 512-token prefill, median of
    3), per decode step (batch 1 and 8, 256-token contexts) and KV bytes per token, in
    this process on the first node core with one torch thread."""
    import torch

    core = node_cores()[0]
    old_aff, old_threads = os.sched_getaffinity(0), torch.get_num_threads()
    os.sched_setaffinity(0, {core})
    torch.set_num_threads(1)
    try:
        return [_cost_of(name, dtype, setup.block_size) for name, dtype in names]
    finally:
        os.sched_setaffinity(0, old_aff)
        torch.set_num_threads(old_threads)


def _cost_of(name: str, dtype: str, bs: int, n: int = 512) -> dict:
    import torch

    from kvmesh.services.engine.config import resolve_dtype
    from kvmesh.services.engine.kv_pool import KVPool
    from kvmesh.services.engine.model import LlamaModel

    dt = resolve_dtype(dtype)
    m = LlamaModel.from_preset(name, dtype=dt)
    c = m.config
    pool = KVPool(c, n // bs * 10 + 64, bs, dtype=dt)
    g = torch.Generator().manual_seed(0)

    def prefill() -> float:
        table = pool.allocate(n // bs)
        try:
            toks = torch.randint(0, c.vocab_size, (n,), generator=g)
            t0 = time.perf_counter()
            m.forward_prefill(toks, 0, pool, table)
            return time.perf_counter() - t0
        finally:
            pool.free(table)

    def step(batch: int, ctx: int = 256) -> float:
        tables = [pool.allocate(ctx // bs + 1) for _ in range(batch)]
        try:
            toks = torch.randint(0, c.vocab_size, (batch,), generator=g)
            t0 = time.perf_counter()
            m.forward_decode(toks, [ctx] * batch, tables, pool)
            return time.perf_counter() - t0
        finally:
            for t in tables:
                pool.free(t)

    prefill()  # warm-up
    pf = statistics.median(prefill() for _ in range(3))
    step(1)
    d1 = statistics.median(step(1) for _ in range(3))
    d8 = statistics.median(step(8) for _ in range(3))
    kv = c.num_layers * 2 * c.num_kv_heads * c.head_dim * torch.finfo(dt).bits // 8
    return {
        "model": name,
        "dtype": dtype,
        "params_m": round(sum(p.numel() for p in m.parameters()) / 1e6, 2),
        "prefill_ms_per_token": round(pf * 1000 / n, 3),
        "decode_step_ms_b1": round(d1 * 1000, 2),
        "decode_step_ms_b8": round(d8 * 1000, 2),
        "kv_bytes_per_token": kv,
        # the bandwidth above which moving a token's KV is faster than recomputing it
        "breakeven_gbps": round(kv / (pf / n) / 1e9, 4),
    }


# -- workloads ------------------------------------------------------------------------------
class Workloads:
    """The evaluation's workloads; every ``seed`` gives the same shape with other tokens."""

    def __init__(self, a: argparse.Namespace) -> None:
        self.a = a
        self.trace_recs = W.sample_groups(W.load_trace(a.trace), a.trace_share, a.trace_sample)

    def trace(self, rate: float, seed: int, n: int | None = None) -> list[W.Item]:
        a = self.a
        n = n or self.count(rate)
        items = W.trace_items(
            self.trace_recs[:n],
            block_tokens_n=a.block_tokens,
            max_input=a.max_input,
            max_output=a.max_output,
            output_scale=a.output_scale,
            seed=1000 + seed,
        )
        return W.at_rate(items, rate)

    def shared(self, rate: float, seed: int, n: int | None = None) -> list[W.Item]:
        a = self.a
        items = W.shared_prefix_items(
            n or self.count(rate),
            rate_rps=rate,
            prefixes=a.shared_prefixes,
            prefix_tokens=(a.shared_prefix_tokens // 2, a.shared_prefix_tokens),
            seed=2000 + seed,
        )
        return items

    def agentic(self, seed: int) -> list[W.Item]:
        a = self.a
        return W.agentic_items(
            a.sessions, seed=3000 + seed, turns=(a.turns, a.turns + 2), max_context=a.max_context
        )

    def count(self, rate: float) -> int:
        """Requests of one run: ``--requests`` at every load (a shorter run would see less
        of the workload's reuse), so a run at rate r lasts ``--requests`` / r seconds;
        fewer (down to 16) where that would exceed ``--max-run-s`` (a bound on the time
        of the whole evaluation: the report lists each run's count)."""
        a = self.a
        return max(min(16, a.requests), min(a.requests, int(rate * a.max_run_s)))


def _brief(r: dict) -> str:
    s = r["summary"]
    return (
        f"{r['config']:15s} {r['label']:18s} served {s['served']}/{s['requests']} "
        f"rej {s['rejected']} fail {s['failed']}  TTFT p50/p90 {s['ttft_ms']['p50'] or 0:.0f}/"
        f"{s['ttft_ms']['p90'] or 0:.0f} ms  TBT p99 {s['tbt_ms']['p99'] or 0:.0f} ms  "
        f"SLO {100 * (s['slo_attainment'] or 0):.0f}% (accepted "
        f"{100 * (s['slo_attainment_accepted'] or 0):.0f}%)  goodput {s['goodput_rps']} rps  "
        f"hit {100 * (s['cache_hit_ratio'] or 0):.0f}%  {r['wall_s']} s"
        + (
            "  kv waits {waits_admitted}+{waits_after_refused_reserve}, Reserves refused "
            "{reserves_refused}".format(**s["kv_room"])
            if s.get("kv_room")
            else ""
        )
    )


def find_knee(cc: ConfigCluster, make, start: float, probes: int, log, seeds: int = 2) -> dict:
    """Highest rate with SLO attainment >= 0.9 on ``cc`` (see the module's docstring).
    Each probe is the mean attainment of ``seeds`` runs with workloads of their own (one
    64-request run swings by 20 points: three evaluations 7 minutes apart once put the
    trace's knee at 21.8, 10.9 and 19.9 rps); x1.6 steps until a rate that holds lies
    below one that does not, then the probes left bisect that bracket (geometric
    midpoint); the knee is linear in rate between its ends. A probe that misses below
    one that holds (noise) bounds nothing."""
    seen: list[tuple[float, float]] = []
    rate, factor = start, 1.6

    def bracket() -> tuple[tuple[float, float], tuple[float, float] | None] | None:
        ok = [x for x in seen if x[1] >= 0.9]
        if not ok:
            return None
        lo = max(ok)
        above = [b for b in seen if b[1] < 0.9 and b[0] > lo[0]]
        return lo, (min(above) if above else None)

    for k in range(probes):
        atts = []
        for j in range(seeds):
            r = cc.run(make(rate, 900 + 100 * k + j), label=f"probe@{rate:.2f}rps")
            atts.append(r["summary"]["slo_attainment"] or 0.0)
            log(_brief(r))
        seen.append((rate, statistics.mean(atts)))
        b = bracket()
        if b is not None and b[1] is not None:
            rate = (b[0][0] * b[1][0]) ** 0.5  # bisect the bracket
        elif b is not None:
            rate = b[0][0] * factor  # every rate tried holds: higher
        else:
            rate = min(x[0] for x in seen) / factor  # none holds: lower
    b = bracket()
    if b is None:  # never held: below the lowest rate probed, not measured
        knee = min(x[0] for x in seen) / factor
    elif b[1] is None:
        knee = b[0][0]
    else:  # linear in rate between the two
        (r0, a0), (r1, a1) = b
        knee = r0 + (a0 - 0.9) / max(1e-9, a0 - a1) * (r1 - r0)
    return {
        "knee_rps": round(knee, 3),
        "bracketed": bool(b is not None and b[1] is not None),
        "seeds": seeds,
        "probes": [{"rate": round(r, 3), "attainment": round(a, 4)} for r, a in seen],
    }


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(
        prog="python -m kvmesh.loadtest", description=__doc__.split("\n")[0]
    )
    p.add_argument("--quick", action="store_true", help="every phase, small (a few minutes)")
    p.add_argument("--phases", default=",".join(PHASES))
    p.add_argument("--configs", default=",".join(CONFIGS))
    p.add_argument("--model", default="medium")
    p.add_argument("--dtype", default="float32")
    p.add_argument("--kv-memory", default="24MiB", help="each node's KV pool")
    p.add_argument("--segment-per-pool", type=int, default=10)
    p.add_argument("--block-size", type=int, default=16)
    p.add_argument("--ttft-slo-ms", type=float, default=2000.0)
    p.add_argument("--tbt-slo-ms", type=float, default=150.0)
    p.add_argument("--step-token-budget", type=int, default=128)
    p.add_argument("--trace", default=str(W.DEFAULT_TRACE))
    p.add_argument("--trace-share", type=float, default=0.015, help="share of prefix groups kept")
    p.add_argument("--trace-sample", type=int, default=3, help="seed of the group sample")
    p.add_argument("--block-tokens", type=int, default=16, help="tokens per 512-token block")
    p.add_argument("--max-input", type=int, default=1536)
    p.add_argument("--max-output", type=int, default=32)
    p.add_argument("--output-scale", type=float, default=1 / 12, help="trace outputs x this")
    p.add_argument("--colocate-below-tokens", type=int, default=64, help="kvmesh's")
    p.add_argument("--shared-prefixes", type=int, default=12)
    p.add_argument("--shared-prefix-tokens", type=int, default=768)
    p.add_argument("--sessions", type=int, default=3)
    p.add_argument("--turns", type=int, default=30)
    p.add_argument("--max-context", type=int, default=2500)
    p.add_argument("--loads", default="0.5,1,2,3", help="multiples of the colocated knee")
    p.add_argument("--repeats", type=int, default=3, help="runs at 1x the knee (median)")
    p.add_argument("--requests", type=int, default=64, help="per run, at every load")
    p.add_argument("--max-run-s", type=float, default=30.0, help="arrival span cap of a run")
    p.add_argument("--knee-probes", type=int, default=5, help="rates probed for the knee")
    p.add_argument("--knee-seeds", type=int, default=2, help="runs per knee probe (mean)")
    p.add_argument("--knee-start", type=float, default=0.0, help="rps; 0 = from the costs")
    p.add_argument("--pool-sizes", default="12MiB,24MiB,64MiB", help="cache-size sweep")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out", default=str(RESULTS))
    p.add_argument(
        "--runs",
        type=int,
        default=1,
        help="whole evaluations in a row, each in OUT/run<i> (its own knee; the same "
        "--seed, so the same workloads: the runs measure the machine's and the method's "
        "noise); OUT/runs.md and runs.json: the goals' figures per run and their medians "
        "(eval_runs.py)",
    )
    a = p.parse_args(argv)
    if a.knee_probes < 1 or a.knee_seeds < 1 or not 1 <= a.knee_seeds <= 100 or a.runs < 1:
        p.error("--knee-probes, --knee-seeds (at most 100) and --runs must be >= 1")
    if a.runs > 1:
        args = list(sys.argv[1:] if argv is None else argv)
        dirs = [Path(a.out) / f"run{i}" for i in range(1, a.runs + 1)]
        for d in dirs:
            rc = main([*args, "--runs", "1", "--out", str(d)])
            if rc:
                return rc
        from kvmesh.loadtest.eval_runs import write

        print(write(dirs, Path(a.out)))
        return 0
    if a.quick:  # smaller defaults; what the command line gives explicitly stays
        quick = dict(
            loads="1,3", repeats=1, requests=16, knee_probes=2, knee_seeds=1, sessions=1,
            turns=6, pool_sizes="12MiB,48MiB",
        )  # fmt: skip
        for k, v in quick.items():
            if getattr(a, k) == p.get_default(k):
                setattr(a, k, v)
    out = Path(a.out)
    out.mkdir(parents=True, exist_ok=True)
    phases = a.phases.split(",")
    names = a.configs.split(",")
    for n in names:
        if n not in CONFIGS:
            p.error(f"--configs: unknown config {n!r}; known: {', '.join(CONFIGS)}")
    for ph in phases:
        if ph not in PHASES:
            p.error(f"--phases: unknown phase {ph!r}; known: {', '.join(PHASES)}")
    loads = [float(x) for x in a.loads.split(",")]
    setup = Setup.from_args(a)
    wl = Workloads(a)
    t_start = time.monotonic()
    res: dict = {
        "args": vars(a),
        "setup": setup.to_json(),
        "created": time.strftime("%Y-%m-%dT%H:%M:%S"),
        "machine": {
            "cpus": os.cpu_count(),
            "node_cores": list(node_cores()),
            "loadavg_start": os.getloadavg(),
        },
        "placement": {
            "model nodes": "each pinned to its own core (os.sched_setaffinity at spawn, every "
            "thread), 1 torch thread",
            "conductor, store-master, etcd, load generator": "not pinned: they share both "
            "cores with the model nodes",
        },
        "workloads": {},
        "runs": [],
        "knee": {},
    }
    path = out / "eval.json"

    def log(msg: str) -> None:
        print(f"[{time.monotonic() - t_start:6.0f}s] {msg}", flush=True)

    def save() -> None:
        res["elapsed_s"] = round(time.monotonic() - t_start, 1)
        res["machine"]["loadavg_end"] = os.getloadavg()
        path.write_text(json.dumps(res, indent=1))

    if "costs" in phases:
        # the model used first; then, for reference, the others the issue names
        ref = [("medium", "bfloat16"), ("small", "bfloat16"), ("tiny", "float32")]
        if a.quick:
            ref = [("medium", "bfloat16")]
        todo = [(a.model, a.dtype), *[m for m in ref if m != (a.model, a.dtype)]]
        res["costs"] = model_costs(setup, todo)
        for i, c in enumerate(res["costs"]):
            c["used"] = i == 0
        for c in res["costs"]:
            log(
                f"model {c['model']} ({c['dtype']}, {c['params_m']} M params): "
                f"{c['prefill_ms_per_token']} ms per prompt token, decode step "
                f"{c['decode_step_ms_b1']} ms (batch 1) / {c['decode_step_ms_b8']} ms (batch 8), "
                f"{c['kv_bytes_per_token']} KV bytes per token (fetching beats recomputing "
                f"above {c['breakeven_gbps']} GB/s)"
            )
        save()
    ms_tok = (res.get("costs") or [{}])[0].get("prefill_ms_per_token", 0.5)
    # shapes of the workloads (at a nominal rate of 1 rps)
    t_items = wl.trace(1.0, 0, n=a.requests)
    s_items = wl.shared(1.0, 0, n=a.requests)
    res["workloads"] = {
        "trace": {
            **W.summarize(t_items),
            "ideal_hit_ratio": round(W.ideal_hit_ratio(t_items, a.block_size), 3),
            "groups_kept": a.trace_share,
            "kv_working_set_mib": _working_set_mib(t_items, a.block_size, res),
        },
        "shared": {
            **W.summarize(s_items),
            "ideal_hit_ratio": round(W.ideal_hit_ratio(s_items, a.block_size), 3),
            "kv_working_set_mib": _working_set_mib(s_items, a.block_size, res),
        },
        "agentic": W.summarize(wl.agentic(0)),
    }
    save()
    makers = {"trace": wl.trace, "shared": wl.shared}
    knees: dict[str, float] = {}
    # colocated first (its knee sets every load), then kvmesh, then the other baseline
    order = sorted(set(names) | {"colocated"}, key=("colocated", "kvmesh", "disagg-nostore").index)
    for name in order:
        if name not in names and not ("knee" in phases and name == "colocated"):
            continue
        want = [ph for ph in ("trace", "shared", "agentic") if ph in phases]
        need_knee = "knee" in phases and name == "colocated"
        if not want and not need_knee:
            continue
        cfg = configs(setup)[name]
        log(f"starting {name}: {cfg['note']}")
        with ConfigCluster(name, cfg, setup) as cc:
            log(f"{name} up in {cc.startup_s} s; pinned {cc.affinity}")
            res.setdefault("clusters", {})[name] = {
                "startup_s": cc.startup_s,
                "affinity": cc.affinity,
                "note": cfg["note"],
            }
            for w in ("trace", "shared"):
                if need_knee:
                    items = makers[w](1.0, 0, n=a.requests)
                    mean_in = statistics.mean(len(i.token_ids) for i in items)
                    # 2 cores at the measured cost, 40% of the prompt cached, x0.6
                    start = a.knee_start or 0.6 * 2.0 / (mean_in * 0.6 * ms_tok / 1000.0)
                    k = find_knee(cc, makers[w], start, a.knee_probes, log, a.knee_seeds)
                    res["knee"][w] = k
                    log(f"colocated knee on {w}: {k['knee_rps']} rps")
                    save()
                knees[w] = res["knee"].get(w, {}).get("knee_rps") or a.knee_start or 1.0
            if name not in names:
                continue
            for w in ("trace", "shared"):
                if w not in phases:
                    continue
                for x in loads:
                    for rep in range(a.repeats if x == 1.0 else 1):
                        rate = knees[w] * x
                        seed = 10 * (1 + loads.index(x)) + rep  # new tokens every run
                        items = makers[w](rate, seed)
                        r = cc.run(items, label=f"{w}@{x:g}x")
                        r.update(workload=w, load_x=x, rate_rps=round(rate, 3), repeat=rep)
                        r["ideal_hit_ratio"] = round(W.ideal_hit_ratio(items, a.block_size), 4)
                        log(_brief(r))
                        res["runs"].append(r)
                        save()
            if "agentic" in phases:
                r = cc.run(wl.agentic(0), label="agentic")
                r.update(workload="agentic", load_x=None, rate_rps=None, repeat=0)
                log(_brief(r))
                res["runs"].append(r)
                save()
    if "cache" in phases and "kvmesh" in names:
        rate = (
            knees.get("trace") or res["knee"].get("trace", {}).get("knee_rps") or a.knee_start
        ) or 1.0
        for pool in a.pool_sizes.split(","):
            for store in (True, False):
                s2 = Setup(**{**setup.__dict__, "kv_memory": pool})
                cfg = configs(s2, store=store)["kvmesh"]
                label = f"pool {pool} {'store' if store else 'no store'}"
                items = wl.trace(rate, 0)
                with ConfigCluster("kvmesh", cfg, s2) as cc:
                    r = cc.run(items, label=label)
                r.update(workload="cache", pool=pool, store=store, rate_rps=round(rate, 3))
                r["ideal_hit_ratio"] = round(W.ideal_hit_ratio(items, a.block_size), 4)
                log(_brief(r))
                res["runs"].append(r)
                save()
    save()
    log(f"done in {time.monotonic() - t_start:.0f} s -> {path}")
    from kvmesh.loadtest.report import write_report

    print(write_report(out))
    return 0


def _working_set_mib(items: list[W.Item], block: int, res: dict) -> float | None:
    """KV of the distinct full blocks of a workload, in MiB (the model's KV per token)."""
    kv = (res.get("costs") or [{}])[0].get("kv_bytes_per_token")
    if not kv:
        return None
    keys = set()
    for it in items:
        t = it.token_ids
        for k in range(len(t) // block):
            keys.add(hash(tuple(t[: (k + 1) * block])))
    return round(len(keys) * block * kv / (1 << 20), 1)


if __name__ == "__main__":
    sys.exit(main())
