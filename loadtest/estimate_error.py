"""The conductor's TTFT estimate against the TTFT a client measures, on a real cluster
(2 prefill nodes, 1 decode node, tiny model, one core per node): a bounded open-loop mix
of short and long prompts, shared prefixes and fresh ones, at a few arrival rates.

Prints and writes (loadtest/results/estimate_error.json) the median and p90 of
|estimated - actual| / actual per route and overall.

    python -m kvmesh.loadtest.estimate_error [--requests 120]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import random
import statistics
import tempfile
import time
from pathlib import Path

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


def workload(n: int, seed: int) -> list[tuple[float, str]]:
    rng = random.Random(seed)
    prefixes = [
        "".join(rng.choice("abcdefgh ") for _ in range(rng.randint(300, 1500))) for _ in range(6)
    ]
    out, t = [], 0.0
    for i in range(n):
        t += rng.expovariate(8.0)  # ~8 requests/s offered
        kind = rng.random()
        if kind < 0.3:
            prompt = "".join(rng.choice("xyz ") for _ in range(rng.randint(10, 300)))
        elif kind < 0.8:
            prompt = rng.choice(prefixes) + f" question {i}: " + "w" * rng.randint(10, 400)
        else:
            prompt = "".join(rng.choice("mnop ") for _ in range(rng.randint(800, 2500)))
        out.append((t, prompt))
    return out


async def one(stub, at: float, t0: float, prompt: str, rows: list) -> None:
    await asyncio.sleep(max(0.0, at - (time.perf_counter() - t0)))
    start = time.perf_counter()
    try:
        async for r in stub.Generate(pb.GenerateRequest(prompt=prompt, max_tokens=4), timeout=60):
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
        rows.append({"rejected": e.code().name})


async def drive(conductor: str, reqs) -> list[dict]:
    rows: list[dict] = []
    async with grpc.aio.insecure_channel(conductor) as ch:
        stub = pbg.ConductorStub(ch)
        t0 = time.perf_counter()
        await asyncio.gather(*(one(stub, at, t0, p, rows) for at, p in reqs))
    return rows


def summary(rows: list[dict]) -> dict:
    errs = [abs(r["estimated_ms"] - r["actual_ms"]) / r["actual_ms"] for r in rows]
    errs.sort()
    return {
        "n": len(errs),
        "median": statistics.median(errs) if errs else None,
        "p90": errs[int(0.9 * (len(errs) - 1))] if errs else None,
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--requests", type=int, default=120)
    args = ap.parse_args()
    with (
        tempfile.TemporaryDirectory() as d,
        LocalCluster(d, prefill=2, decode=1, node_args=NODE_ARGS) as c,
    ):
        asyncio.run(drive(c.conductor, workload(20, 99)))  # warm-up: online refit starts
        rows = asyncio.run(drive(c.conductor, workload(args.requests, 1)))
    done = [r for r in rows if "actual_ms" in r]
    report = {
        "overall": summary(done),
        "by_route": {
            k: summary([r for r in done if r["route"] == k])
            for k in sorted({r["route"] for r in done})
        },
        "rejected": sum(1 for r in rows if "rejected" in r),
        "rows": rows,
    }
    for name, s in [("overall", report["overall"]), *report["by_route"].items()]:
        if s["n"]:
            print(
                f"{name:>14}: n={s['n']:>4}  median |est-actual|/actual = {s['median']:.2f}"
                f"  p90 = {s['p90']:.2f}"
            )
    print(f"      rejected: {report['rejected']}")
    RESULTS.mkdir(exist_ok=True)
    (RESULTS / "estimate_error.json").write_text(json.dumps(report, indent=1))


if __name__ == "__main__":
    main()
