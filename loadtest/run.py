"""Baselines side by side on a real local cluster (same model, same machine, same harness).

    python -m kvmesh.loadtest.run                       # default comparison (~6-8 min on 2 cores)
    python -m kvmesh.loadtest.run --configs kvmesh --workloads agentic --quick
    python -m kvmesh.loadtest.run report                # rebuild report.md + plots from the JSON

Configurations (each a fresh LocalCluster, ``tiny`` model, 2 serving nodes):

- ``colocated``: the classic vLLM set-up. Every request is prefilled and decoded on one of
  2 decode nodes with only its local prefix cache (``--colocate-below-tokens`` huge, no
  store segments, no admission control: SLOs set huge on the conductor). The conductor
  serves a model only when a prefill *and* a decode node of it are registered
  (``ClusterView.models()``), so one idle prefill node is registered too; with the huge
  SLOs the policy never falls back to it (checked: the routes are reported per run).
- ``disagg-nostore``: 1 prefill + 1 decode node, every request disaggregated, no store
  (``--segment-memory 0 --colocate-below-tokens 0 --direct-share 1.0``); early rejection
  on the run's SLOs.
- ``kvmesh``: 1 prefill + 1 decode node, store segments, every route, early rejection.

Workloads: a slice of the Mooncake trace, scaled (512-token blocks -> ``--block-tokens``,
inputs capped at ``--max-input``), replayed open-loop at several time scales (goodput vs
offered load); and agentic sessions (30+ turns, each prompt = previous context + output
+ ~100 new tokens). Results go to ``<out>/real.json``; the report to ``<out>/report.md``.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import shutil
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from kvmesh.loadtest import metrics as M  # noqa: E402
from kvmesh.loadtest import workload as W  # noqa: E402
from kvmesh.loadtest.driver import diff, drive, scrape  # noqa: E402

RESULTS = Path(__file__).resolve().parent / "results"
HUGE_SLO = "1000000000"


def configs(
    block_size: int, kv_memory: str, segment: str, ttft_slo: float, tbt_slo: float
) -> dict[str, dict]:
    base = ["--model", "tiny", "--block-size", str(block_size), "--kv-memory", kv_memory]
    slo = ["--ttft-slo-ms", str(ttft_slo), "--tbt-slo-ms", str(tbt_slo)]
    return {
        "colocated": dict(
            prefill=1,
            decode=2,
            node_args=base + ["--segment-memory", "0"],
            conductor_args=[
                "--colocate-below-tokens",
                HUGE_SLO,
                "--direct-share",
                "1.0",
                "--ttft-slo-ms",
                HUGE_SLO,
                "--tbt-slo-ms",
                HUGE_SLO,
            ],
            send_slo=False,
            note="2 decode nodes prefill+decode their own requests (local prefix "
            "cache only, no admission control); 1 idle prefill node registered",
        ),
        "disagg-nostore": dict(
            prefill=1,
            decode=1,
            node_args=base + ["--segment-memory", "0"],
            conductor_args=["--colocate-below-tokens", "0", "--direct-share", "1.0", *slo],
            note="1 prefill + 1 decode, no global store, early rejection",
        ),
        "kvmesh": dict(
            prefill=1,
            decode=1,
            node_args=base + ["--segment-memory", segment],
            conductor_args=slo,
            note="1 prefill + 1 decode, store segments, all routes, early rejection",
        ),
    }


def _warmup(target: str) -> None:
    items = [W.Item(f"warmup-{i}", 0.0, W.block_tokens(10**9 + i, 200), 4) for i in range(2)]
    asyncio.run(drive(target, items, timeout=60))


def run_one(name: str, cfg: dict, workload: str, items: list[W.Item], args) -> dict:
    from kvmesh.services.launcher import LocalCluster

    try:
        from tqdm import tqdm
    except ImportError:  # the progress bar is optional
        tqdm = None
    workdir = tempfile.mkdtemp(prefix=f"kvmesh-lt-{name}-")
    cluster = LocalCluster(
        workdir,
        prefill=cfg["prefill"],
        decode=cfg["decode"],
        node_args=cfg["node_args"],
        conductor_args=cfg["conductor_args"],
        http_port=-1,
        log_level="WARNING",
    )
    t_start = time.monotonic()
    cluster.start(timeout=120)
    try:
        startup_s = time.monotonic() - t_start
        _warmup(cluster.conductor)
        nodes = cluster.status().nodes
        addrs = [n.metrics_address for n in nodes if n.metrics_address and n.role != "conductor"]
        before = scrape(addrs)
        node_before = {
            n.node_id: (n.computed_tokens_total, n.cached_tokens_total, n.fetched_tokens_total)
            for n in nodes
        }
        bar = (
            tqdm(total=len(items), desc=f"{name}/{workload}", unit="req", leave=False)
            if tqdm and not args.no_progress
            else None
        )
        t0 = time.perf_counter()
        recs = asyncio.run(
            drive(
                cluster.conductor,
                items,
                timeout=args.request_timeout,
                slo=(args.ttft_slo_ms, args.tbt_slo_ms) if cfg.get("send_slo", True) else None,
                progress=bar,
            )
        )
        wall = time.perf_counter() - t0
        if bar is not None:
            bar.close()
        st = cluster.status()
        after = scrape(addrs)
        per_node = {}
        for n in st.nodes:
            b = node_before.get(n.node_id, (0, 0, 0))
            per_node[n.node_id] = {
                "role": n.role,
                "computed": n.computed_tokens_total - b[0],
                "cached": n.cached_tokens_total - b[1],
                "fetched": n.fetched_tokens_total - b[2],
            }
        summary = M.summarize(recs, ttft_slo_ms=args.ttft_slo_ms, tbt_slo_ms=args.tbt_slo_ms)
        d = diff(after, before)
        summary["data_plane"] = {
            "bytes_moved": {
                k.split("=")[1].rstrip("}"): v
                for k, v in d.items()
                if k.startswith("kvmesh_transfer_bytes_total")
            },
            "transfer_seconds": {
                k.split("=")[1].rstrip("}"): round(v, 4)
                for k, v in d.items()
                if k.startswith("kvmesh_transfer_seconds_sum")
            },
            "late_hits": {
                k.split("=", 1)[1].rstrip("}") if "=" in k else "all": v
                for k, v in d.items()
                if k.startswith("kvmesh_late_hits_total")
            },
            "prefill_tokens": {
                k.split("=")[1].rstrip("}"): v
                for k, v in d.items()
                if k.startswith("kvmesh_prefill_tokens_total")
            },
        }
        summary["per_node"] = per_node
        summary["conductor"] = {
            "requests_rejected": st.requests_rejected,
            "rejected_by_reason": dict(st.rejected_by_reason),
        }
        return {
            "config": name,
            "workload": workload,
            "note": cfg["note"],
            "startup_s": round(startup_s, 1),
            "wall_s": round(wall, 1),
            "summary": summary,
            "records": [r.to_json() for r in recs],
        }
    finally:
        cluster.stop()
        shutil.rmtree(workdir, ignore_errors=True)


def build_workloads(args) -> list[tuple[str, float | None, list[W.Item]]]:
    out = []
    if "trace" in args.workloads:
        recs = W.load_trace(args.trace)
        for ts in args.time_scales:
            items = W.trace_items(
                recs,
                block_tokens_n=args.block_tokens,
                time_scale=ts,
                max_requests=args.requests,
                offset=args.offset,
                every=args.every,
                max_input=args.max_input,
                seed=args.seed,
            )
            out.append((f"trace@x{ts:g}", ts, items))
    if "agentic" in args.workloads:
        out.append(("agentic", None, W.agentic_items(args.sessions, seed=args.seed)))
    if "chat" in args.workloads:
        out.append(("chat", None, W.chat_items(args.sessions * 3, seed=args.seed)))
    return out


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(
        prog="python -m kvmesh.loadtest.run", description=__doc__.split("\n")[0]
    )
    p.add_argument("command", nargs="?", default="run", choices=("run", "report"))
    p.add_argument("--configs", default="colocated,disagg-nostore,kvmesh")
    p.add_argument("--workloads", default="trace,agentic", help="trace, agentic, chat")
    p.add_argument("--trace", default=str(W.DEFAULT_TRACE), help="any Mooncake-format JSONL")
    p.add_argument("--requests", type=int, default=80, help="trace requests per run")
    p.add_argument("--offset", type=int, default=0)
    p.add_argument("--every", type=int, default=1)
    p.add_argument(
        "--time-scales",
        default="2,1,0.5",
        help="inter-arrival multipliers for the trace runs (2 = half the rate)",
    )
    p.add_argument("--block-tokens", type=int, default=32, help="tokens per 512-token trace block")
    p.add_argument("--max-input", type=int, default=2048)
    p.add_argument("--sessions", type=int, default=4, help="agentic sessions (chat: x3)")
    p.add_argument("--block-size", type=int, default=16)
    p.add_argument("--kv-memory", default="12MiB")
    p.add_argument("--segment-memory", default="64MiB")
    p.add_argument("--ttft-slo-ms", type=float, default=2000.0)
    p.add_argument("--tbt-slo-ms", type=float, default=100.0)
    p.add_argument("--request-timeout", type=float, default=120.0)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--quick", action="store_true", help="30 trace requests, one time scale")
    p.add_argument("--no-progress", action="store_true")
    p.add_argument("--out", default=str(RESULTS))
    p.add_argument(
        "--keep-records", action="store_true", help="keep per-request records in real.json (large)"
    )
    args = p.parse_args(argv)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    if args.command == "report":
        from kvmesh.loadtest.report import write_report

        print(write_report(out))
        return 0
    args.time_scales = [float(x) for x in args.time_scales.split(",")]
    args.workloads = args.workloads.split(",")
    if args.quick:
        args.requests, args.time_scales, args.sessions = 30, [1.0], 2
    cfgs = configs(
        args.block_size, args.kv_memory, args.segment_memory, args.ttft_slo_ms, args.tbt_slo_ms
    )
    names = args.configs.split(",")
    for n in names:
        if n not in cfgs:
            p.error(f"unknown config {n!r}; known: {', '.join(cfgs)}")
    workloads = build_workloads(args)
    runs = []
    path = out / "real.json"
    t0 = time.monotonic()
    for wname, ts, items in workloads:
        for name in names:
            r = run_one(name, cfgs[name], wname, items, args)
            r["time_scale"] = ts
            r["workload_shape"] = W.summarize(items)
            s = r["summary"]
            print(
                f"{name:15s} {wname:12s} served {s['served']}/{s['requests']} "
                f"ttft p50 {s['ttft_ms']['p50']} p90 {s['ttft_ms']['p90']} ms  "
                f"slo {s['slo_attainment']}  goodput {s['goodput_rps']} rps  "
                f"hit {s['cache_hit_ratio']}  routes {s['routes']}",
                flush=True,
            )
            if not args.keep_records:
                r["records"] = [
                    {k: v for k, v in rec.items() if k != "token_times_ms"} for rec in r["records"]
                ]
            runs.append(r)
            path.write_text(
                json.dumps(
                    {
                        "args": {k: v for k, v in vars(args).items()},
                        "created": time.strftime("%Y-%m-%dT%H:%M:%S"),
                        "machine": {"cpus": os.cpu_count(), "loadavg": os.getloadavg()},
                        "runs": runs,
                    },
                    indent=1,
                )
            )
    print(f"{len(runs)} runs in {time.monotonic() - t0:.0f}s -> {path}")
    from kvmesh.loadtest.report import write_report

    print(write_report(out))
    return 0


if __name__ == "__main__":
    sys.exit(main())
