"""The conductor's TTFT estimate against the TTFT a client measures, on a real cluster
(2 prefill nodes, 1 decode node, tiny model, one core per node): a bounded open-loop mix
of short and long prompts, shared prefixes and fresh ones.

Two phases on one cluster, after a warm-up:
  * ``light``: ~8 requests/s and the cluster's default SLO (nothing is refused): how
    good the estimate is;
  * ``overload``: ``--overload-rate`` requests/s (default 40, past what the cluster
    serves) with a TTFT SLO of ``--slo-ms`` each: what admission accepts, whether the
    accepted meet the SLO, and how fast a refusal comes back (client-side, from the
    call to its RESOURCE_EXHAUSTED).

Prints and writes (loadtest/results/estimate_error.json), per phase, overall and per
route: actual / estimated TTFT (median, p90, p99), |estimated - actual| / actual (median,
p90); the accepted-within-SLO share; the rejection latency (p50, p99).

    python -m kvmesh.loadtest.estimate_error [--requests 120] [--slo-ms 400]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import statistics
import tempfile
import time
from pathlib import Path
from typing import Any

import grpc

from kvmesh.protos import kvmesh_pb2 as pb
from kvmesh.protos import kvmesh_pb2_grpc as pbg
from kvmesh.services.launcher import LocalCluster

RESULTS = Path(__file__).parent / "results"
NODE_ARGS = [
    "--block-size",
    "16",
    "--kv-memory",
    "64MiB",
    "--segment-memory",
    "64MiB",
    "--threads",
    "1",
]


def workload(n: int, seed: int, rate: float = 8.0) -> list[tuple[float, str]]:
    rng = random.Random(seed)
    prefixes = [
        "".join(rng.choice("abcdefgh ") for _ in range(rng.randint(300, 1500))) for _ in range(6)
    ]
    out, t = [], 0.0
    for i in range(n):
        t += rng.expovariate(rate)  # requests/s offered
        kind = rng.random()
        if kind < 0.3:
            prompt = "".join(rng.choice("xyz ") for _ in range(rng.randint(10, 300)))
        elif kind < 0.8:
            prompt = rng.choice(prefixes) + f" question {i}: " + "w" * rng.randint(10, 400)
        else:
            prompt = "".join(rng.choice("mnop ") for _ in range(rng.randint(800, 2500)))
        out.append((t, prompt))
    return out


async def one(stub, at: float, t0: float, prompt: str, rows: list, slo_ms: float) -> None:
    await asyncio.sleep(max(0.0, at - (time.perf_counter() - t0)))
    start = time.perf_counter()
    req = pb.GenerateRequest(prompt=prompt, max_tokens=4, slo=pb.SLO(ttft_ms=slo_ms))
    try:
        async for r in stub.Generate(req, timeout=60):
            actual = (time.perf_counter() - start) * 1000
            route = "disaggregated" if r.route.prefill_node else "fast path"
            rows.append(
                {
                    "estimated_ms": r.route.estimated_ttft_ms,
                    "actual_ms": actual,
                    "route": route,
                    "tokens": len(prompt),
                }
            )
            break
    except grpc.aio.AioRpcError as e:
        rows.append({"rejected": e.code().name, "reject_ms": (time.perf_counter() - start) * 1000})


async def drive(conductor: str, reqs, slo_ms: float = 0.0) -> list[dict]:
    rows: list[dict] = []
    async with grpc.aio.insecure_channel(conductor) as ch:
        stub = pbg.ConductorStub(ch)
        t0 = time.perf_counter()
        await asyncio.gather(*(one(stub, at, t0, p, rows, slo_ms) for at, p in reqs))
    return rows


def _q(xs: list[float], q: float) -> float | None:
    return xs[min(len(xs) - 1, int(q * len(xs)))] if xs else None


def summary(rows: list[dict], slo_ms: float = 0.0) -> dict:
    errs = sorted(abs(r["estimated_ms"] - r["actual_ms"]) / r["actual_ms"] for r in rows)
    ratios = sorted(r["actual_ms"] / r["estimated_ms"] for r in rows if r["estimated_ms"] > 0)
    out = {
        "n": len(errs),
        "median": statistics.median(errs) if errs else None,
        "p90": _q(errs, 0.9),
        "ratio_median": _q(ratios, 0.5),
        "ratio_p90": _q(ratios, 0.9),
        "ratio_p99": _q(ratios, 0.99),
    }
    if slo_ms:
        out["within_slo"] = (
            sum(r["actual_ms"] <= slo_ms for r in rows) / len(rows) if rows else None
        )
    return out


def phase(rows: list[dict], slo_ms: float = 0.0) -> dict:
    done = [r for r in rows if "actual_ms" in r]
    refused = sorted(r["reject_ms"] for r in rows if r.get("rejected") == "RESOURCE_EXHAUSTED")
    return {
        "slo_ms": slo_ms or None,
        "overall": summary(done, slo_ms),
        "by_route": {
            k: summary([r for r in done if r["route"] == k], slo_ms)
            for k in sorted({r["route"] for r in done})
        },
        "rejected": sum(1 for r in rows if "rejected" in r),
        "rejected_by_code": {
            c: sum(1 for r in rows if r.get("rejected") == c)
            for c in sorted({r["rejected"] for r in rows if "rejected" in r})
        },
        "reject_ms_p50": _q(refused, 0.5),
        "reject_ms_p99": _q(refused, 0.99),
        "rows": rows,
    }


def _f(x: float | None) -> str:
    return "-" if x is None else f"{x:.2f}"


def show(name: str, ph: dict) -> None:
    print(f"{name}:" + (f" TTFT SLO {ph['slo_ms']:.0f} ms" if ph["slo_ms"] else ""))
    for route, s in [("overall", ph["overall"]), *ph["by_route"].items()]:
        if s["n"]:
            line = (
                f"  {route:>14}: n={s['n']:>4}  actual/estimated median {_f(s['ratio_median'])}"
                f" p90 {_f(s['ratio_p90'])} p99 {_f(s['ratio_p99'])}"
                f"  |est-actual|/actual median {_f(s['median'])} p90 {_f(s['p90'])}"
            )
            if "within_slo" in s:
                line += f"  within SLO {100 * s['within_slo']:.1f}%"
            print(line)
    print(
        f"  rejected: {ph['rejected']} {ph['rejected_by_code']}"
        + (
            f"  rejection latency p50 {ph['reject_ms_p50']:.1f} ms p99 {ph['reject_ms_p99']:.1f} ms"
            if ph["reject_ms_p99"] is not None
            else ""
        )
    )


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--requests", type=int, default=120, help="requests per phase")
    ap.add_argument("--slo-ms", type=float, default=400.0, help="TTFT SLO of the overload")
    ap.add_argument("--overload-rate", type=float, default=40.0, help="requests/s offered")
    args = ap.parse_args()
    load_before = os.getloadavg()[0]
    with (
        tempfile.TemporaryDirectory() as d,
        LocalCluster(d, prefill=2, decode=1, node_args=NODE_ARGS) as c,
    ):
        asyncio.run(drive(c.conductor, workload(20, 99)))  # warm-up: online refit starts
        light = asyncio.run(drive(c.conductor, workload(args.requests, 1)))
        over = asyncio.run(
            drive(c.conductor, workload(args.requests, 2, args.overload_rate), args.slo_ms)
        )
    report: dict[str, Any] = {
        "topology": "2 prefill + 1 decode, tiny, --threads 1, loopback, one machine",
        # other work on the machine skews every figure here: say how much there was
        "load_average_1m_before_after": [load_before, os.getloadavg()[0]],
        "light": phase(light),
        "overload": phase(over, args.slo_ms),
    }
    show("light", report["light"])
    show("overload", report["overload"])
    RESULTS.mkdir(exist_ok=True)
    (RESULTS / "estimate_error.json").write_text(json.dumps(report, indent=1))


if __name__ == "__main__":
    main()
