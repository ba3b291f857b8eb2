"""The decode step's sampler on the CPU: today's row-by-row sampler
(``sampling.sample_with_logprob`` per request) against the batch sampler the decode node
now runs (``sampler_device.sample_batch``: one call, one host read), same tokens
(checked), for greedy and seeded top-p batches, median ms of ``--runs``.

    python -m kvmesh.loadtest.bench_sampler [--vocab 32000] [--batches 1,32] [--threads 2]

Writes ``loadtest/results/sampler.json``; the GPU side is measured by bench_gpu.py.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import time
from pathlib import Path

import torch

from kvmesh.services.common.sampling_params import Sampling
from kvmesh.services.engine.sampler_device import sample_batch
from kvmesh.services.engine.sampling import sample_with_logprob

RESULTS = Path(__file__).resolve().parent / "results" / "sampler.json"


def _median_ms(fn, runs: int) -> float:
    fn()
    times = []
    for _ in range(runs):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return statistics.median(times) * 1e3


def run(vocab: int, batches: list[int], runs: int) -> list[dict]:
    rows = []
    g = torch.Generator().manual_seed(0)
    for b in batches:
        logits = torch.randn((b, vocab), generator=g) * 3
        kinds = {
            "greedy": [Sampling()] * b,
            "t0.8_top_p0.9": [Sampling(temperature=0.8, top_p=0.9, seed=i) for i in range(b)],
        }
        for kind, ss in kinds.items():
            steps = [5] * b

            def rows_fn(ss=ss, logits=logits, b=b, steps=steps):
                return [sample_with_logprob(logits[i], ss[i], steps[i]) for i in range(b)]

            def batch_fn(ss=ss, logits=logits, steps=steps):
                return sample_batch(logits, ss, steps)

            assert rows_fn() == batch_fn(), "the batch sampler drew other tokens"
            a, c = _median_ms(rows_fn, runs), _median_ms(batch_fn, runs)
            rows.append(
                {"batch": b, "kind": kind, "row_by_row_ms": a, "batch_ms": c, "speedup": a / c}
            )
            print(
                f"batch {b:>3} {kind:<14} row-by-row {a:8.2f} ms  batch {c:8.2f} ms  "
                f"speed-up {a / c:5.2f}x",
                flush=True,
            )
    return rows


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--vocab", type=int, default=32000)
    ap.add_argument("--batches", default="1,32")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--runs", type=int, default=9)
    ap.add_argument("--out", default=str(RESULTS))
    a = ap.parse_args()
    torch.set_num_threads(a.threads)
    batches = [int(x) for x in a.batches.split(",")]
    doc = {
        "benchmark": "sampler",
        "vocab": a.vocab,
        "threads": a.threads,
        "runs": a.runs,
        "created": time.strftime("%Y-%m-%dT%H:%M:%S"),
        "cpus": os.cpu_count(),
        "loadavg_before": os.getloadavg()[0],  # other work on the machine skews these
        "results": run(a.vocab, batches, a.runs),
    }
    Path(a.out).write_text(json.dumps(doc, indent=2))
    print(f"wrote {a.out}")


if __name__ == "__main__":
    main()
