"""CPU throughput of the model engine: prefill and batched decode on the paged KV pool.

For each preset (``tiny``, ``small``) and dtype (float32, bfloat16), in a fresh child
process (so the peak RSS it reports belongs to that configuration alone):

* prefill tokens/s of one prompt of 512 and of 4096 tokens (median of ``reps``; one rep
  for ``small``, after a short warm-up prefill);
* decode tokens/s at batch 1, 8 and 32, every request at context ``--context`` (KV
  filled with random values instead of a real prefill: decode cost does not depend on
  the values), median step time over ``--steps`` steps;
* peak RSS (``resource.getrusage``) and the bytes of the weights and of the KV pool.

Time is bounded: a configuration skips the remaining points once ``--budget-s`` is spent
(reported as ``null``); the default run takes about 2-3 minutes on 2 cores.

    python -m loadtest.bench_engine [--models tiny,small] [--dtypes float32,bfloat16]
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import resource
import statistics
import subprocess
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

RESULTS = Path(__file__).resolve().parent / "results" / "engine.json"
PROMPTS = (512, 4096)
BATCHES = (1, 8, 32)
BS = 16


def run_one(model_name: str, dtype: str, context: int, budget_s: float) -> dict:
    import torch

    from services.engine.checkpoint import load_model
    from services.engine.kv_pool import KVPool

    t_start = time.perf_counter()
    lm = load_model(model_name, dtype, seed=0)
    m, cfg = lm.model, lm.config
    load_s = time.perf_counter() - t_start
    small = cfg.num_params() > 10_000_000
    steps = 8 if small else 16
    per_req = -(-(context + steps + 1) // BS)
    pool = KVPool(cfg, num_blocks=max(-(-max(PROMPTS) // BS), max(BATCHES) * per_req),
                  block_size=BS, dtype=m.dtype)
    weights_bytes = sum(p.numel() * p.element_size() for p in m.parameters())
    g = torch.Generator().manual_seed(0)
    vocab = min(cfg.vocab_size, 258)
    out: dict = {"model": model_name, "dtype": dtype, "threads": torch.get_num_threads(),
                 "params": cfg.num_params(), "weights_mib": weights_bytes / 2**20,
                 "kv_pool_mib": pool.nbytes / 2**20, "load_s": load_s, "prefill": {}, "decode": {}}

    def over() -> bool:
        return time.perf_counter() - t_start > budget_s

    m.forward_prefill(torch.randint(0, vocab, (64,), generator=g), 0, pool, list(range(4)))  # warm-up

    def prefill(prompts) -> None:
        for n in prompts:
            if over():
                out["prefill"][str(n)] = None
                continue
            reps = 1 if (small or n > 1024) else 3
            toks = torch.randint(0, vocab, (n,), generator=g)
            table = list(range(-(-n // BS)))
            times = []
            for _ in range(reps):
                t0 = time.perf_counter()
                m.forward_prefill(toks, 0, pool, table)
                times.append(time.perf_counter() - t0)
            s = statistics.median(times)
            out["prefill"][str(n)] = {"tokens_per_s": n / s, "seconds": s, "reps": reps}

    prefill(PROMPTS[:1])  # 512 first, the costly 4096 last so the time budget cuts it first
    with torch.no_grad():  # decode reads the pool only: random KV will do
        pool.kv.normal_(0, 1, generator=g) if pool.kv.dtype == torch.float32 else pool.kv.copy_(
            torch.randn(pool.kv.shape, generator=g).to(pool.kv.dtype))
    for b in BATCHES:
        if over():
            out["decode"][str(b)] = None
            continue
        tables = [list(range(i * per_req, (i + 1) * per_req)) for i in range(b)]
        cur = torch.randint(0, vocab, (b,), generator=g).tolist()
        m.forward_decode(cur, [context] * b, tables, pool)  # warm-up
        times = []
        for s in range(steps):
            t0 = time.perf_counter()
            logits = m.forward_decode(cur, [context + s] * b, tables, pool)
            times.append(time.perf_counter() - t0)
            cur = logits.argmax(-1).tolist()
        step = statistics.median(times)
        out["decode"][str(b)] = {"tokens_per_s": b / step, "ms_per_step": step * 1e3,
                                 "steps": steps, "context": context}
    prefill(PROMPTS[1:])
    out["loadavg_1m"] = os.getloadavg()[0]  # other processes on the box skew the figures
    out["peak_rss_mib"] = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
    out["seconds"] = time.perf_counter() - t_start
    return out


def fmt(x, key, digits=0):
    return "skipped" if x is None else f"{x[key]:,.{digits}f}"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--models", default="tiny,small")
    ap.add_argument("--dtypes", default="float32,bfloat16")
    ap.add_argument("--context", type=int, default=256, help="decode context length per request")
    ap.add_argument("--budget-s", type=float, default=55.0, help="time budget per model/dtype")
    ap.add_argument("--child", nargs=2, metavar=("MODEL", "DTYPE"), help=argparse.SUPPRESS)
    ap.add_argument("--out", default=str(RESULTS))
    a = ap.parse_args()
    if a.child:
        print(json.dumps(run_one(a.child[0], a.child[1], a.context, a.budget_s)))
        return
    results = []
    load0 = os.getloadavg()
    t0 = time.perf_counter()
    for model in a.models.split(","):
        for dtype in a.dtypes.split(","):
            cmd = [sys.executable, "-m", "loadtest.bench_engine", "--child", model, dtype,
                   "--context", str(a.context), "--budget-s", str(a.budget_s)]
            proc = subprocess.run(cmd, capture_output=True, text=True,
                                  cwd=Path(__file__).resolve().parents[1])
            if proc.returncode != 0:
                sys.stderr.write(proc.stderr)
                raise SystemExit(f"benchmark child {model}/{dtype} failed")
            r = json.loads(proc.stdout.strip().splitlines()[-1])
            results.append(r)
            print(f"[{time.perf_counter() - t0:5.0f}s] {model}/{dtype} done in {r['seconds']:.1f}s", flush=True)

    hdr = (f"{'model':6} {'dtype':9} {'prefill512 tok/s':>17} {'prefill4096 tok/s':>18} "
           f"{'dec b1 tok/s':>13} {'dec b8 tok/s':>13} {'dec b32 tok/s':>14} {'peak RSS MiB':>13}")
    print("\n" + hdr + "\n" + "-" * len(hdr))
    for r in results:
        p, d = r["prefill"], r["decode"]
        print(f"{r['model']:6} {r['dtype']:9} {fmt(p['512'], 'tokens_per_s'):>17} "
              f"{fmt(p['4096'], 'tokens_per_s'):>18} {fmt(d['1'], 'tokens_per_s', 1):>13} "
              f"{fmt(d['8'], 'tokens_per_s', 1):>13} {fmt(d['32'], 'tokens_per_s', 1):>14} "
              f"{r['peak_rss_mib']:>13,.0f}")
    doc = {"benchmark": "engine", "created": time.strftime("%Y-%m-%dT%H:%M:%S"),
           "machine": {"platform": platform.platform(), "cpus": os.cpu_count(),
                       "loadavg_at_start": load0,
                       "python": platform.python_version()},
           "block_size": BS, "context": a.context, "results": results,
           "total_s": time.perf_counter() - t0}
    Path(a.out).parent.mkdir(parents=True, exist_ok=True)
    Path(a.out).write_text(json.dumps(doc, indent=2))
    print(f"\nwrote {a.out} ({doc['total_s']:.0f}s)")


if __name__ == "__main__":
    main()
