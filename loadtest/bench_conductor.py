"""Conductor decision benchmark: decisions per second and decision latency (p50, p99) of
the real scheduler (services/conductor/policy.py) on one core, with 8, 64 and 256
prefill nodes and 10^4 and 10^6 indexed blocks.

Each decision is ``decide`` + ``commit`` for a request of 32 blocks (8,192 tokens at block
size 256) whose prefix is held by some node in 70% of requests; completions are booked
for requests 256 decisions old, so queues stay realistic. Goal (issue 6): >= 20,000
decisions/s at 64 nodes and 10^6 blocks, p99 <= 1 ms.

    python -m kvmesh.loadtest.bench_conductor [--quick]
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import random
import resource
import statistics
import time
from collections import deque
from pathlib import Path

from kvmesh.services.conductor.estimator import DecodeModel, PrefillModel
from kvmesh.services.conductor.policy import (
    DecodeNodeState,
    PolicyConfig,
    PrefillNodeState,
    Request,
    Scheduler,
)

BS = 256
BLOCKS_PER_REQUEST = 32
RESULTS = Path(__file__).parent / "results"


def build(n_prefill: int, n_blocks: int, rng: random.Random) -> tuple[Scheduler, list[list[bytes]]]:
    s = Scheduler(PolicyConfig(policy="kvmesh", colocate_below_tokens=512), rng=rng)
    for i in range(n_prefill):
        s.prefill[f"p{i}"] = PrefillNodeState(
            f"p{i}",
            BS,
            block_nbytes=20 << 20,
            layer_nbytes=(20 << 20) // 80,
            model=PrefillModel(20, 0.05, 2e-6),
            bandwidth=20e6,
        )
    for i in range(max(2, n_prefill // 4)):
        s.decode[f"d{i}"] = DecodeNodeState(
            f"d{i}",
            BS,
            100_000,
            100_000,
            model=DecodeModel(20, 0.2, 1e-5),
            prefill_model=PrefillModel(20, 0.05, 2e-6),
        )
    chains = []
    names = list(s.prefill)
    for c in range(n_blocks // BLOCKS_PER_REQUEST):
        chain = [rng.getrandbits(128).to_bytes(16, "little") for _ in range(BLOCKS_PER_REQUEST)]
        s.index.stored(names[c % len(names)], chain)
        if c % 2 == 0:
            s.index.store_stored(chain)
        chains.append(chain)
    return s, chains


def run(n_prefill: int, n_blocks: int, n_decisions: int, seed: int = 0) -> dict:
    rng = random.Random(seed)
    t0 = time.perf_counter()
    s, chains = build(n_prefill, n_blocks, rng)
    build_s = time.perf_counter() - t0
    reqs = []
    for i in range(n_decisions):
        if rng.random() < 0.7:
            chain = rng.choice(chains)
            k = rng.randint(BLOCKS_PER_REQUEST // 2, BLOCKS_PER_REQUEST)
            hashes = chain[:k] + [
                rng.getrandbits(128).to_bytes(16, "little") for _ in range(BLOCKS_PER_REQUEST - k)
            ]
        else:
            hashes = [
                rng.getrandbits(128).to_bytes(16, "little") for _ in range(BLOCKS_PER_REQUEST)
            ]
        reqs.append(Request(f"r{i}", BLOCKS_PER_REQUEST * BS + 17, hashes, 256, 1e9, 1e9))
    pending: deque = deque()
    lat = []
    accepted = 0
    gc.collect()
    gc.disable()
    try:
        t_all = time.perf_counter()
        for r in reqs:
            t = time.perf_counter_ns()
            d = s.decide(r)
            if d.accepted:
                s.commit(r, d)
            lat.append(time.perf_counter_ns() - t)
            if d.accepted:
                accepted += 1
                pending.append((r, d))
                if len(pending) > 256:
                    old_r, old_d = pending.popleft()
                    s.prefill_done(old_r, old_d, old_r.n_tokens, 0, old_d.estimate.prefill_ms)
                    s.request_done(old_r, old_d, 200)
        total = time.perf_counter() - t_all
    finally:
        gc.enable()
    lat.sort()
    return {
        "prefill_nodes": n_prefill,
        "decode_nodes": len(s.decode),
        "blocks": n_blocks,
        "decisions": n_decisions,
        "accepted": accepted,
        "decisions_per_s": n_decisions / sum(lat) * 1e9,
        "loop_decisions_per_s": n_decisions / total,
        "p50_us": lat[len(lat) // 2] / 1000,
        "p99_us": lat[int(len(lat) * 0.99)] / 1000,
        "build_s": build_s,
        "peak_rss_mib": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024,
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--quick", action="store_true", help="10^4 blocks only, fewer decisions")
    ap.add_argument("--decisions", type=int, default=20000)
    args = ap.parse_args()
    try:
        os.sched_setaffinity(0, {sorted(os.sched_getaffinity(0))[0]})  # one core
    except (AttributeError, OSError):
        pass
    sizes = [10_000] if args.quick else [10_000, 1_000_000]
    n = 2000 if args.quick else args.decisions
    rows = []
    print(
        f"{'prefill':>7} {'decode':>6} {'blocks':>9} {'decisions/s':>12} {'p50 us':>8} "
        f"{'p99 us':>8} {'goal':>6} {'rss MiB':>8}"
    )
    for blocks in sizes:
        for nodes in (8, 64, 256):
            reps = [run(nodes, blocks, n, seed) for seed in range(3 if not args.quick else 1)]
            row = dict(reps[0])
            for k in ("decisions_per_s", "loop_decisions_per_s", "p50_us", "p99_us"):
                row[k] = statistics.median(r[k] for r in reps)
            goal = ""
            if nodes == 64 and blocks == 1_000_000:
                goal = (
                    "met" if row["decisions_per_s"] >= 20000 and row["p99_us"] <= 1000 else "MISSED"
                )
            row["goal"] = goal
            rows.append(row)
            print(
                f"{nodes:>7} {row['decode_nodes']:>6} {blocks:>9} {row['decisions_per_s']:>12,.0f} "
                f"{row['p50_us']:>8.1f} {row['p99_us']:>8.1f} {goal:>6} {row['peak_rss_mib']:>8.0f}",
                flush=True,
            )
    RESULTS.mkdir(exist_ok=True)
    out = RESULTS / "conductor.json"
    out.write_text(json.dumps({"rows": rows, "note": "median of 3 runs, one core"}, indent=2))
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
