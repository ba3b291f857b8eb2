"""The engine on a CUDA device against transformers on the same GPU (issue 14 part 2):
what ``python -m kvmesh.loadtest.bench_engine --device cuda`` runs (scripts/gpu-check.sh).

For one preset (default ``llama-1b``: hidden 2048, 16 layers, 32/8 heads, intermediate
8192, vocab 32000, ~1.1 B parameters) in bfloat16 with random weights, in one process:

* the card's copy bandwidth, device-to-device and pinned host-to-device (1 GiB, median);
* prefill tok/s of one prompt at each length (kvmesh ``forward_prefill`` on a pool in
  device memory; transformers ``LlamaForCausalLM`` forward with SDPA, no cache, the same
  weights), medians of ``--runs`` after a warm-up, ``torch.cuda.synchronize`` around each;
* the KV hand-off's cost: the same prefill with the pool's pinned host mirror (per-layer
  D2H on a copy stream, as a prefill node runs) against the pool alone;
* decode ms per step at batch 1 and 32 at context ``--context``: kvmesh as a decode node
  steps (``DecodeRunner``: the padded bucket's CUDA graph, then the batch sampler on the
  device with one host sync), and ``forward_decode`` eagerly with the same sampler;
  transformers ``generate`` with a static cache (the step from the difference of two
  lengths); and the step's memory floor: weight bytes plus KV bytes read, divided by
  the measured device-to-device bandwidth.

transformers is optional: without it those columns are ``null`` with a note. Figures are
measured, never estimated; on a machine without CUDA this refuses to run.
"""

from __future__ import annotations

import gc
import statistics
import time


def _sync() -> None:
    import torch

    torch.cuda.synchronize()


def _median_s(fn, runs: int) -> float:
    times = []
    for _ in range(runs):
        _sync()
        t0 = time.perf_counter()
        fn()
        _sync()
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def bandwidth(runs: int = 5) -> dict:
    import torch

    n = 1 << 30
    a = torch.empty(n, dtype=torch.uint8, device="cuda")
    b = torch.empty_like(a)
    h = torch.empty(n, dtype=torch.uint8, pin_memory=True)
    b.copy_(a)
    d2d = _median_s(lambda: b.copy_(a), runs)
    h2d = _median_s(lambda: b.copy_(h, non_blocking=True), runs)
    # a copy reads n and writes n bytes: the floor below counts bytes read
    return {"d2d_GBps": 2 * n / d2d / 1e9, "h2d_pinned_GBps": n / h2d / 1e9}


def run(
    model_name: str = "llama-1b",
    dtype: str = "bfloat16",
    lengths=(512, 4096),
    batches=(1, 32),
    context: int = 1024,
    runs: int = 5,
    steps: int = 16,
    with_transformers: bool = True,
) -> dict:
    import torch

    from kvmesh.services.common.sampling_params import Sampling
    from kvmesh.services.engine.cuda_graphs import DecodeRunner
    from kvmesh.services.engine.kv_pool import KVPool
    from kvmesh.services.engine.model import LlamaModel
    from kvmesh.services.engine.sampler_device import sample_batch

    bs = 16
    out: dict = {
        "model": model_name,
        "dtype": dtype,
        "device": torch.cuda.get_device_name(0),
        "torch": torch.__version__,
        "cuda": torch.version.cuda,
        "runs": runs,
        "bandwidth": bandwidth(),  # its 3 GiB are freed on return
        "prefill": {},
        "handoff": {},
        "decode": {},
    }
    torch.cuda.empty_cache()
    t0 = time.perf_counter()
    m = LlamaModel.from_preset(model_name, seed=0, dtype=dtype)
    cfg = m.config
    out["params"] = cfg.num_params()
    weights_bytes = sum(p.numel() * p.element_size() for p in m.parameters())
    out["weights_bytes"] = weights_bytes
    hf = None
    if with_transformers:
        try:
            import transformers

            from kvmesh.loadtest.bench_long import build

            _m2, hf = build(model_name, dtype, "transformers")
            del _m2
            hf = hf.to("cuda")
            out["transformers"] = transformers.__version__
        except ImportError as e:
            out["transformers_note"] = f"transformers not installed ({e}): its columns skipped"
    else:
        out["transformers_note"] = "transformers skipped (--no-transformers)"
    m = m.to("cuda")
    gc.collect()
    out["load_s"] = time.perf_counter() - t0
    g = torch.Generator().manual_seed(0)
    vocab = cfg.vocab_size

    with torch.inference_mode():
        for n in lengths:
            toks = torch.randint(0, vocab, (n,), generator=g)
            nb = -(-n // bs)
            pool = KVPool(cfg, nb, bs, dtype=m.dtype, device="cuda")
            table = list(range(nb))
            staging = pool.staging

            def kv_run(pool=pool, toks=toks, table=table) -> None:
                m.forward_prefill(toks, 0, pool, table)

            kv_run()  # warm-up
            with_mirror = _median_s(kv_run, runs)
            pool.staging = None  # the pool alone: no D2H to the pinned mirror
            kv_run()
            alone = _median_s(kv_run, runs)
            pool.staging = staging
            row = {"kvmesh_tok_s": n / alone, "kvmesh_s": alone}
            out["handoff"][str(n)] = {
                "prefill_s": alone,
                "prefill_with_d2h_s": with_mirror,
                "added": with_mirror / alone - 1,
            }
            if hf is not None:
                ids = toks[None].to("cuda")

                def hf_run(ids=ids) -> None:
                    hf(input_ids=ids, use_cache=False, logits_to_keep=1)

                hf_run()
                hs = _median_s(hf_run, runs)
                row |= {"transformers_tok_s": n / hs, "transformers_s": hs, "ratio": hs / alone}
            out["prefill"][str(n)] = row
            del pool, staging
            torch.cuda.empty_cache()

        for b in batches:
            per = -(-(context + steps + 2) // bs)
            pool = KVPool(cfg, b * per, bs, dtype=m.dtype, device="cuda")
            pool.staging = None  # decode reads device blocks only
            tables = [list(range(i * per, (i + 1) * per)) for i in range(b)]
            m.forward_prefill(torch.randint(0, vocab, (context,), generator=g), 0, pool, tables[0])
            for i in range(1, b):
                pool.kv[i * per : (i + 1) * per] = pool.kv[:per]
            first = torch.randint(0, vocab, (b,), generator=g).tolist()
            greedy = [Sampling()] * b

            def decode_ms(step_fn, first=first, b=b, greedy=greedy) -> float:
                cur = list(first)
                step_fn(cur, context)  # warm-up (the graph path captures here)
                times = []
                for s in range(steps):
                    _sync()
                    t1 = time.perf_counter()
                    logits = step_fn(cur, context + s)
                    # the serving sampler: on the device, the step's one host sync
                    cur = [t for t, _ in sample_batch(logits, greedy, [s] * b)]
                    times.append(time.perf_counter() - t1)
                return statistics.median(times)

            eager = decode_ms(
                lambda cur, p, b=b, tables=tables, pool=pool: m.forward_decode(
                    cur, [p] * b, tables, pool
                )
            )
            runner = DecodeRunner(m, pool, max_batch=b, cuda_graphs=True)
            step = decode_ms(
                lambda cur, p, b=b, tables=tables, runner=runner: runner.step(cur, [p] * b, tables)
            )
            kv_read = b * (context + steps // 2) * cfg.num_layers * 2 * cfg.num_kv_heads
            kv_read *= cfg.head_dim * pool.kv.element_size()
            floor = (weights_bytes + kv_read) / (out["bandwidth"]["d2d_GBps"] * 1e9)
            row = {
                "kvmesh_ms_per_step": step * 1e3,
                "eager_ms_per_step": eager * 1e3,
                "graph_captures": runner.captures,
                "memory_floor_ms": floor * 1e3,
                "over_floor": step / floor,
                "context": context,
            }
            del pool, runner
            torch.cuda.empty_cache()
            if hf is not None:
                prompts = torch.randint(0, vocab, (b, context), generator=g).to("cuda")
                kw = dict(do_sample=False, cache_implementation="static", pad_token_id=0)

                def gen(new: int, prompts=prompts) -> float:
                    _sync()
                    t2 = time.perf_counter()
                    hf.generate(prompts, max_new_tokens=new, min_new_tokens=new, **kw)
                    _sync()
                    return time.perf_counter() - t2

                gen(2)
                hsteps = [(gen(1 + steps) - gen(1)) / steps for _ in range(max(1, runs // 2))]
                hstep = statistics.median(hsteps)
                row |= {"transformers_ms_per_step": hstep * 1e3, "ratio": hstep / step}
            out["decode"][str(b)] = row
    out["seconds"] = time.perf_counter() - t0
    return out


def render(r: dict) -> str:
    def f(x, k, d=0):
        return "-" if x is None or x.get(k) is None else f"{x[k]:,.{d}f}"

    bw = r["bandwidth"]
    lines = [
        f"# kvmesh on {r['device']} (torch {r['torch']}, CUDA {r['cuda']}), "
        f"{r['model']} ({r['params'] / 1e9:.2f} B params) in {r['dtype']}, medians of {r['runs']}",
        f"copy bandwidth: device-to-device {bw['d2d_GBps']:,.0f} GB/s, "
        f"host-to-device pinned {bw['h2d_pinned_GBps']:,.1f} GB/s",
    ]
    if r.get("transformers_note"):
        lines.append(r["transformers_note"])
    lines += [
        "",
        "| tokens | kvmesh tok/s | transformers tok/s | kvmesh / transformers | hand-off adds |",
        "|---|---|---|---|---|",
    ]
    for n, p in r["prefill"].items():
        h = r["handoff"][n]
        lines.append(
            f"| {n} | {f(p, 'kvmesh_tok_s')} | {f(p, 'transformers_tok_s')} | "
            f"{f(p, 'ratio', 2)} | {h['added'] * 100:.1f}% |"
        )
    lines += [
        "",
        "| batch | kvmesh ms/step (graphs) | eager ms/step | memory floor ms | over floor | "
        "transformers ms/step | kvmesh / transformers (speed) |",
        "|---|---|---|---|---|---|---|",
    ]
    for b, d in r["decode"].items():
        lines.append(
            f"| {b} | {f(d, 'kvmesh_ms_per_step', 2)} | {f(d, 'eager_ms_per_step', 2)} | "
            f"{f(d, 'memory_floor_ms', 2)} | "
            f"{f(d, 'over_floor', 2)} | {f(d, 'transformers_ms_per_step', 2)} | {f(d, 'ratio', 2)} |"
        )
    return "\n".join(lines)
