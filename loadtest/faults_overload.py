"""The overload run (``python -m kvmesh.loadtest.faults --overload``): capacity measured
closed-loop first, then ``factor`` x that rate offered open-loop with SLOs."""

from __future__ import annotations

import asyncio
import random
import statistics
import time

import grpc

from kvmesh.loadtest.fault_harness import Load, Req, run_request
from kvmesh.loadtest.faults_cluster import (
    expected_outputs,
    make_prompts,
    new_cluster,
    proc_pids,
    rss_mib,
)
from kvmesh.protos import kvmesh_pb2_grpc as pbg


def overload(workdir: str, seconds: float, factor: float, quick: bool) -> dict:
    """Capacity (closed loop, SLO-free) first, then ``factor`` x that rate open-loop for
    ``seconds`` with SLOs; RSS of every process sampled each second."""
    prompts = make_prompts(48)
    max_tokens = 16
    expect = expected_outputs(prompts, max_tokens)
    ttft_slo, tbt_slo = 2000.0, 400.0
    cluster = new_cluster(
        workdir,
        prefill=1,
        decode=1,
        conductor_args=[
            "--ttft-slo-ms",
            str(ttft_slo),
            "--tbt-slo-ms",
            str(tbt_slo),
            "--slo-margin",
            "0.7",
        ],
    )
    out: dict = {
        "ttft_slo_ms": ttft_slo,
        "tbt_slo_ms": tbt_slo,
        "slo_margin": 0.7,
        "factor": factor,
        "seconds": seconds,
        "max_tokens": max_tokens,
    }
    try:

        async def capacity():
            # closed loop at increasing concurrency; capacity = best rate whose p90 TTFT
            # stays within the SLO
            best = 0.0
            for conc in (1, 2, 4, 8, 16):
                load = Load(cluster.conductor, prompts, expect, max_tokens, conc, 60, 0.0)
                t = [0.0]

                async def body(ld, t=t):
                    await asyncio.sleep(5 if quick else 8)
                    t[0] = ld.now()

                await load.run(body)
                ok = [r for r in load.reqs if r.outcome == "ok"]
                rate = len(ok) / max(t[0], 1e-9)
                ttfts = sorted(r.ttft_s for r in ok if r.ttft_s is not None)
                p90 = ttfts[int(0.9 * (len(ttfts) - 1))] * 1000 if ttfts else 1e9
                out.setdefault("capacity_probe", []).append(
                    {
                        "concurrency": conc,
                        "rate_rps": round(rate, 2),
                        "p90_ttft_ms": round(p90, 1),
                        "wrong": sum(1 for r in load.reqs if r.outcome == "wrong"),
                    }
                )
                if p90 <= ttft_slo * 0.7:
                    best = max(best, rate)
                if rate < 1.05 * best and p90 > ttft_slo * 0.25:
                    break  # throughput has plateaued
            return best

        cap = asyncio.run(capacity())
        out["capacity_rps"] = round(cap, 2)
        rate = factor * cap
        out["offered_rps"] = round(rate, 2)
        samples: dict[str, list[float]] = {}
        died: list[str] = []

        async def offered():
            reqs: list[Req] = []
            async with grpc.aio.insecure_channel(cluster.conductor) as ch:
                stub = pbg.ConductorStub(ch)
                t0 = time.perf_counter()
                tasks = []

                async def sample_rss():
                    while True:
                        for n, pid in proc_pids(cluster).items():
                            samples.setdefault(n, []).append(rss_mib(pid))
                        await asyncio.sleep(1.0)

                sampler = asyncio.create_task(sample_rss())
                rng = random.Random(1)
                t_next, i = 0.0, 0

                async def one(idx, salt):
                    reqs.append(
                        await run_request(
                            stub,
                            idx,
                            prompts[idx],
                            expect[idx],
                            max_tokens,
                            t0,
                            30.0,
                            slo=(ttft_slo, tbt_slo),
                            retry=False,
                            salt=salt,
                        )
                    )

                while t_next < seconds:
                    delay = t_next - (time.perf_counter() - t0)
                    if delay > 0:
                        await asyncio.sleep(delay)
                    idx = i % len(prompts)
                    salt = f"o{i}" if i % 2 == 0 else ""  # half uncached, as in Load
                    tasks.append(asyncio.create_task(one(idx, salt)))
                    i += 1
                    t_next += rng.expovariate(rate)
                await asyncio.gather(*tasks)
                sampler.cancel()
            return reqs

        reqs = asyncio.run(offered())
        for n, p in cluster.procs.items():
            if p.poll() is not None:
                died.append(f"{n} ({p.returncode})")
        acc = [r for r in reqs if r.outcome in ("ok", "wrong")]
        rej = [r for r in reqs if r.last_code == "RESOURCE_EXHAUSTED"]
        other = [r for r in reqs if r not in acc and r not in rej]

        def meets(r: Req) -> bool:
            tbt = statistics.mean(r.tbt_s) if r.tbt_s else 0.0
            return r.ttft_s is not None and r.ttft_s * 1000 <= ttft_slo and tbt * 1000 <= tbt_slo

        rej_lat = sorted((r.attempts[0].t_end - r.attempts[0].t_start) * 1000 for r in rej)
        ttfts = sorted(r.ttft_s * 1000 for r in acc if r.ttft_s is not None)
        out.update(
            {
                "sent": len(reqs),
                "accepted": len(acc),
                "rejected": len(rej),
                "other_failures": len(other),
                "other_codes": sorted({r.last_code for r in other}),
                "wrong": sum(1 for r in acc if r.outcome == "wrong"),
                "slo_met_share": round(sum(map(meets, acc)) / max(1, len(acc)), 4),
                "goodput_rps": round(sum(map(meets, acc)) / seconds, 2),
                "accepted_p50_ttft_ms": round(ttfts[len(ttfts) // 2], 1) if ttfts else None,
                "accepted_p99_ttft_ms": round(ttfts[int(0.99 * (len(ttfts) - 1))], 1)
                if ttfts
                else None,
                "rejection_latency_ms_p50": round(rej_lat[len(rej_lat) // 2], 1)
                if rej_lat
                else None,
                "rejection_latency_ms_p99": round(rej_lat[int(0.99 * (len(rej_lat) - 1))], 1)
                if rej_lat
                else None,
                "rss_mib": {
                    n: {"first": round(v[0], 1), "max": round(max(v), 1), "last": round(v[-1], 1)}
                    for n, v in samples.items()
                    if v
                },
                "died": died,
            }
        )
        return out
    finally:
        cluster.stop()
