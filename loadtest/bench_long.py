"""Long prompts on CPU (issue 14): kvmesh's engine against transformers' LlamaForCausalLM
with the same weights, dtype and threads, in the same run.

Every point runs in a fresh child process (one engine, one length), so its peak memory
belongs to it alone: the peak resident set is reset once the model is loaded
(``/proc/self/clear_refs``), and the prefill's peak is what the prefill adds on top
(``VmHWM`` minus the resident set then): activations, and for kvmesh the KV pool of the
prompt (allocated then; its pages count once written). Figures are medians of ``--runs``
runs (never best-of); the 1-minute load average is recorded with each point, since the
box is shared, and so is the CPU time of each run (``time.process_time``, all threads),
which other processes on the box disturb far less than the wall-clock time.

* prefill tok/s of one prompt of each ``--lengths`` (kvmesh: ``forward_prefill_chunked``
  with the nodes' default ``--prefill-chunk-tokens`` of 2048, transformers: one SDPA
  forward of the whole prompt, logits of the last position only), with the ratio to 512;
* decode: a step at batch 1 and 32, every request at context ``--context`` (kvmesh:
  ``forward_decode`` on the paged pool with its float32 mirror of each request's KV, as a
  decode node runs it (``--kv-mirror``, the default on the CPU; the first step, which
  fills the mirror from the pool, is the warm-up left out); transformers: ``generate`` with a static cache,
  greedy, one call: the step time is the interval between two consecutive calls of a
  logits processor, i.e. one decode forward plus its greedy pick, the first left out);
* a float32 check: last-position logits of kvmesh against transformers at 512 tokens.

    python -m kvmesh.loadtest.bench_long [--lengths 512,4096,16384,32768] [--runs 3]

writes ``loadtest/results/engine_long.json`` and ``engine_long.md``.
"""

from __future__ import annotations

import argparse
import ctypes
import gc
import json
import os
import platform
import statistics
import subprocess
import sys
import time
from pathlib import Path

RESULTS = Path(__file__).resolve().parent / "results"
BS = 256  # the nodes' default block size
CHUNK = 2048  # the nodes' default --prefill-chunk-tokens


def _status_kib(field: str) -> int:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(field + ":"):
            return int(line.split()[1])
    raise KeyError(field)


def reset_peak() -> int:
    """Resets the peak resident set to the current one; returns it (KiB)."""
    Path("/proc/self/clear_refs").write_text("5")
    return _status_kib("VmRSS")


def peak_kib() -> int:
    return _status_kib("VmHWM")


def build(model_name: str, dtype: str, engine: str):
    """(kvmesh model, transformers model or None) with the same weights."""
    import torch

    from kvmesh.services.engine.model import LlamaModel

    m = LlamaModel.from_preset(model_name, seed=0, dtype=dtype)
    if engine == "kvmesh":
        return m, None
    import transformers

    c = m.config
    cfg = transformers.LlamaConfig(
        vocab_size=c.vocab_size,
        hidden_size=c.hidden_size,
        intermediate_size=c.intermediate_size,
        num_hidden_layers=c.num_layers,
        num_attention_heads=c.num_heads,
        num_key_value_heads=c.num_kv_heads,
        head_dim=c.head_dim,
        max_position_embeddings=c.max_position_embeddings,
        rope_theta=c.rope_theta,
        rms_norm_eps=c.rms_norm_eps,
        tie_word_embeddings=False,
        attn_implementation="sdpa",
    )
    hf = transformers.LlamaForCausalLM(cfg).to(m.dtype).eval()
    sd = {"model.embed_tokens.weight": m.embed_tokens.weight, "model.norm.weight": m.norm.weight}
    sd["lm_head.weight"] = m.lm_head.weight
    for i, layer in enumerate(m.layers):
        p = f"model.layers.{i}."
        for name in ("q_proj", "k_proj", "v_proj", "o_proj"):
            sd[p + f"self_attn.{name}.weight"] = getattr(layer, name).weight
        for name in ("gate_proj", "up_proj", "down_proj"):
            sd[p + f"mlp.{name}.weight"] = getattr(layer, name).weight
        sd[p + "input_layernorm.weight"] = layer.input_layernorm.weight
        sd[p + "post_attention_layernorm.weight"] = layer.post_attention_layernorm.weight
    with torch.no_grad():
        missing, unexpected = hf.load_state_dict(
            {k: v.detach().clone() for k, v in sd.items()}, strict=False
        )
    assert not unexpected and all("rotary" in k for k in missing), (missing, unexpected)
    return m, hf


def child_prefill(engine: str, model_name: str, dtype: str, n: int, runs: int) -> dict:
    import torch

    from kvmesh.services.engine.kv_pool import KVPool

    m, hf = build(model_name, dtype, engine)
    g = torch.Generator().manual_seed(n)
    toks = torch.randint(0, m.config.vocab_size, (n,), generator=g)
    pool = table = None
    if engine != "kvmesh":
        del m
    gc.collect()
    ctypes.CDLL("libc.so.6").malloc_trim(0)  # freed weights must not host the prefill
    # the peak counts from here: the model is loaded, the KV pool (kvmesh) is not
    base = reset_peak()
    if engine == "kvmesh":
        hf = None
        pool = KVPool(m.config, -(-n // BS), BS, dtype=m.dtype)
        table = list(range(pool.num_blocks))

        def run() -> None:
            m.forward_prefill_chunked(toks, 0, pool, table, CHUNK)
    else:

        def run() -> None:
            with torch.inference_mode():
                hf(input_ids=toks[None], use_cache=False, logits_to_keep=1)

    warm = min(n, CHUNK)
    with torch.inference_mode():  # warm-up: twice the shapes of one chunk
        for _ in range(2):
            if engine == "kvmesh":
                m.forward_prefill(toks[:warm], 0, pool, table)
            else:
                hf(input_ids=toks[None, :warm], use_cache=False, logits_to_keep=1)
    times, cpu = [], []
    for _ in range(runs):
        t0, c0 = time.perf_counter(), time.process_time()
        run()
        times.append(time.perf_counter() - t0)
        cpu.append(time.process_time() - c0)
    s = statistics.median(times)
    return {
        "cpu_seconds": cpu,
        "median_cpu_s": statistics.median(cpu),
        "tokens_per_cpu_s": n / statistics.median(cpu),
        "engine": engine,
        "tokens": n,
        "runs": runs,
        "seconds": times,
        "median_s": s,
        "tokens_per_s": n / s,
        "rss_before_mib": base / 1024,
        "peak_rss_mib": peak_kib() / 1024,
        "prefill_peak_mib": (peak_kib() - base) / 1024,
        "kv_pool_mib": pool.nbytes / 2**20 if pool is not None else None,
        "loadavg_1m": os.getloadavg()[0],
    }


def child_decode(
    engine: str, model_name: str, dtype: str, batch: int, ctx: int, steps: int, runs: int
) -> dict:
    import torch

    from kvmesh.services.engine.kv_mirror import KVMirror
    from kvmesh.services.engine.kv_pool import KVPool

    m, hf = build(model_name, dtype, engine)
    g = torch.Generator().manual_seed(batch)
    vocab = m.config.vocab_size
    prompts = torch.randint(0, vocab, (batch, ctx), generator=g)
    times: list[float] = []
    cpu: list[float] = []
    if engine == "kvmesh":
        bs = 16
        per = -(-(ctx + steps + 2) // bs)
        pool = KVPool(m.config, batch * per, bs, dtype=m.dtype)
        tables = [list(range(i * per, (i + 1) * per)) for i in range(batch)]
        keys = list(range(batch))  # one mirror entry per request, as a decode node keeps
        firsts = [
            int(m.forward_prefill(prompts[i], 0, pool, tables[i]).argmax()) for i in range(batch)
        ]
        for _ in range(runs):
            cur = list(firsts)
            mirror = KVMirror.for_pool(m.config, pool.num_blocks, bs)  # fresh per run
            # warm-up (rewritten below); it fills the mirror from the pool, as a request's
            # first step on a decode node does
            m.forward_decode(cur, [ctx] * batch, tables, pool, mirror, keys)
            for s in range(steps):
                t0, c0 = time.perf_counter(), time.process_time()
                logits = m.forward_decode(cur, [ctx + s] * batch, tables, pool, mirror, keys)
                cur = logits.argmax(-1).tolist()
                times.append(time.perf_counter() - t0)
                cpu.append(time.process_time() - c0)
    else:
        del m
        import transformers

        stamps: list[tuple[float, float]] = []

        class Stamp(transformers.LogitsProcessor):
            """Called once per new token, on its logits: consecutive calls are one step."""

            def __call__(self, input_ids, scores):
                stamps.append((time.perf_counter(), time.process_time()))
                return scores

        # one generate (one prefill of the batch, the costly part in bfloat16 here): the
        # first interval is a warm-up, the next steps * runs are the decode steps timed
        new = 2 + steps * runs
        kw = dict(do_sample=False, cache_implementation="static", pad_token_id=0)
        with torch.inference_mode():
            out = hf.generate(
                prompts,
                max_new_tokens=new,
                min_new_tokens=new,
                logits_processor=transformers.LogitsProcessorList([Stamp()]),
                **kw,
            )
        assert out.shape[1] == ctx + new and len(stamps) == new
        for (t_a, c_a), (t_b, c_b) in zip(stamps[1:], stamps[2:]):
            times.append(t_b - t_a)
            cpu.append(c_b - c_a)
    step = statistics.median(times)
    return {
        "engine": engine,
        "batch": batch,
        "context": ctx,
        "steps": steps,
        "runs": runs,
        "median_ms_per_step": step * 1e3,
        "median_cpu_ms_per_step": statistics.median(cpu) * 1e3,
        "tokens_per_s": batch / step,
        "loadavg_1m": os.getloadavg()[0],
    }


def child_f32_check(model_name: str, n: int) -> dict:
    import torch

    from kvmesh.services.engine.kv_pool import KVPool

    m, hf = build(model_name, "float32", "transformers")
    toks = torch.randint(0, m.config.vocab_size, (n,), generator=torch.Generator().manual_seed(5))
    pool = KVPool(m.config, -(-n // 16), 16)
    table = list(range(pool.num_blocks))
    half = n // 2 // 16 * 16
    ours = m.forward_prefill_chunked(toks, 0, pool, table, 128)
    ours_cached = m.forward_prefill(toks[half:], half, pool, table)  # cached prefix + suffix
    with torch.inference_mode():
        theirs = hf(input_ids=toks[None], use_cache=False).logits[0, -1].float()
    return {
        "tokens": n,
        "max_abs_diff": float((ours - theirs).abs().max()),
        "max_abs_diff_cached_prefix": float((ours_cached - theirs).abs().max()),
    }


def spawn(args: list[str], threads: int) -> dict:
    env = {**os.environ, "OMP_NUM_THREADS": str(threads)}
    cmd = [sys.executable, "-m", "kvmesh.loadtest.bench_long", "--threads", str(threads), *args]
    proc = subprocess.run(cmd, capture_output=True, text=True, env=env)
    if proc.returncode != 0:
        sys.stderr.write(proc.stderr[-4000:])
        raise SystemExit(f"benchmark child {' '.join(args)} failed")
    return json.loads(proc.stdout.strip().splitlines()[-1])


def merge_processes(rs: list[dict]) -> dict:
    """One decode point from several fresh processes: the median of their medians. A
    process's speed is bimodal on this VM (the same code runs a b=1 step at ~25 or ~33 ms,
    process by process), so one process is one draw."""
    out = dict(rs[0])
    for key in ("median_ms_per_step", "median_cpu_ms_per_step", "loadavg_1m"):
        out[key] = statistics.median(r[key] for r in rs)
    out["processes"] = len(rs)
    out["per_process_ms_per_step"] = [r["median_ms_per_step"] for r in rs]
    return out


def render(doc: dict) -> str:
    a = doc["args"]
    pre = doc["prefill"]
    lines = [
        "# Long prompts on CPU: kvmesh vs transformers",
        "",
        f"`{doc['command']}` — {doc['created']}, {doc['machine']['cpus']} CPUs "
        f"({doc['machine']['cpu']}), torch {doc['machine']['torch']}, transformers "
        f"{doc['machine']['transformers']}; model `{a['model']}` in {a['dtype']}, "
        f"{a['threads']} threads, medians of {a['runs']} runs, each point in a fresh process. "
        f"kvmesh prefills in chunks of {CHUNK} tokens (block size {BS}); transformers runs "
        f"one SDPA forward. The box is shared: the 1-minute load average is in each row.",
        "",
        *(
            [
                "This CPU has no native bfloat16 (no AVX512-BF16 or AMX): kvmesh widens "
                "its bfloat16 products of 8 rows or more to float32 (weights and KV stay "
                "bfloat16); transformers runs oneDNN's emulated bfloat16 kernels.",
                "",
            ]
            if doc["machine"].get("bf16_upcast")
            else []
        ),
        "## Prefill",
        "",
        "| tokens | kvmesh tok/s | ratio to 512 | transformers tok/s | ratio to 512 | kvmesh / transformers | kvmesh prefill peak MiB (KV pool) | transformers peak MiB | load |",
        "| ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: |",
    ]
    k512 = pre.get("kvmesh:512", {}).get("tokens_per_s")
    h512 = pre.get("transformers:512", {}).get("tokens_per_s")
    for n in a["lengths"]:
        k, h = pre.get(f"kvmesh:{n}"), pre.get(f"transformers:{n}")
        if not k:
            continue
        hs = f"{h['tokens_per_s']:,.0f}" if h else "–"
        hr = f"{h['tokens_per_s'] / h512:.2f}" if h and h512 else "–"
        vs = f"{k['tokens_per_s'] / h['tokens_per_s']:.2f}x" if h else "–"
        hm = f"{h['prefill_peak_mib']:,.0f}" if h else "–"
        lines.append(
            f"| {n:,} | {k['tokens_per_s']:,.0f} | {k['tokens_per_s'] / k512:.2f} | {hs} | {hr} | {vs} "
            f"| {k['prefill_peak_mib']:,.0f} (+{k['kv_pool_mib']:,.0f}) | {hm} | {k['loadavg_1m']:.1f} |"
        )
    lines += [
        "",
        "The same runs by CPU time (all threads; the box was shared, and CPU time is what "
        "its other processes disturb least):",
        "",
        "| tokens | kvmesh tok per CPU-s | ratio to 512 | transformers tok per CPU-s | ratio to 512 | kvmesh / transformers |",
        "| ---: | ---: | ---: | ---: | ---: | ---: |",
    ]
    kc = pre.get("kvmesh:512", {}).get("tokens_per_cpu_s")
    hc = pre.get("transformers:512", {}).get("tokens_per_cpu_s")
    for n in a["lengths"]:
        k, h = pre.get(f"kvmesh:{n}"), pre.get(f"transformers:{n}")
        if not k or "tokens_per_cpu_s" not in k:
            continue
        hs = f"{h['tokens_per_cpu_s']:,.0f}" if h else "–"
        hr = f"{h['tokens_per_cpu_s'] / hc:.2f}" if h and hc else "–"
        vs = f"{k['tokens_per_cpu_s'] / h['tokens_per_cpu_s']:.2f}x" if h else "–"
        lines.append(
            f"| {n:,} | {k['tokens_per_cpu_s']:,.0f} | {k['tokens_per_cpu_s'] / kc:.2f} | {hs} | {hr} | {vs} |"
        )
    lines += [
        "",
        "Prefill peak: what the prefill adds to the resident set of the loaded model (VmHWM "
        "after a reset): activations and, for kvmesh, the KV of the prompt in its pool (the "
        "pool's size in brackets; transformers runs without a cache).",
        "",
        "## Decode",
        "",
        f"Context {a['context']} tokens per request; kvmesh: `forward_decode` on the paged pool with the KV mirror "
        "(`--kv-mirror`, a decode node's default on the CPU); "
        'transformers: `generate` with `cache_implementation="static"`, greedy. '
        f"Batches up to {a.get('decode_procs_max_batch', 0)}: the median over "
        f"{a.get('decode_procs', 1)} fresh processes per engine, interleaved (each process "
        "the median of its steps); larger batches: one process.",
        "",
        "| batch | kvmesh ms/step | transformers ms/step | kvmesh / transformers (speed) "
        "| kvmesh CPU-ms/step | transformers CPU-ms/step | by CPU time | load |",
        "| ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: |",
    ]
    if not doc["decode"]:
        lines = lines[: lines.index("## Decode")]
    for b in a["batches"]:
        k, h = doc["decode"].get(f"kvmesh:{b}"), doc["decode"].get(f"transformers:{b}")
        if not k:
            continue
        hs = f"{h['median_ms_per_step']:.1f}" if h else "–"
        vs = f"{h['median_ms_per_step'] / k['median_ms_per_step']:.2f}x" if h else "–"
        kc = k["median_cpu_ms_per_step"]
        hc = f"{h['median_cpu_ms_per_step']:.1f}" if h else "–"
        vc = f"{h['median_cpu_ms_per_step'] / kc:.2f}x" if h else "–"
        lines.append(
            f"| {b} | {k['median_ms_per_step']:.1f} | {hs} | {vs} | {kc:.1f} | {hc} | {vc} "
            f"| {k['loadavg_1m']:.1f} |"
        )
    if doc.get("f32_check"):
        c = doc["f32_check"]
        lines += [
            "",
            f"float32 logits at {c['tokens']} tokens, kvmesh (chunks of 128) vs transformers: "
            f"max |diff| {c['max_abs_diff']:.2e}; after a cached prefix of half the prompt: "
            f"{c['max_abs_diff_cached_prefix']:.2e}.",
        ]
    return "\n".join(lines) + "\n"


def main() -> None:
    ap = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    ap.add_argument("--model", default="small")
    ap.add_argument("--dtype", default="bfloat16")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--lengths", default="512,4096,16384")
    ap.add_argument("--batches", default="1,32")
    ap.add_argument("--context", type=int, default=512)
    ap.add_argument("--steps", type=int, default=8)
    ap.add_argument("--runs", type=int, default=3)
    ap.add_argument("--engines", default="kvmesh,transformers")
    ap.add_argument("--no-decode", action="store_true")
    ap.add_argument(
        "--decode-procs",
        type=int,
        default=5,
        help="fresh processes per engine for a decode point (a process's speed is bimodal "
        "on a VM; the median over processes is reported)",
    )
    ap.add_argument(
        "--decode-procs-max-batch",
        type=int,
        default=8,
        help="only batches up to this size get --decode-procs processes (transformers' "
        "batched prefill before a large batch's decode takes minutes per process)",
    )
    ap.add_argument(
        "--transformers-max",
        type=int,
        default=1 << 30,
        help="prefill transformers only up to this many tokens (on a CPU without native "
        "bfloat16 its 16k-token forward takes minutes per run)",
    )
    ap.add_argument("--child", nargs="+", help=argparse.SUPPRESS)
    ap.add_argument("--out", default=str(RESULTS / "engine_long"))
    a = ap.parse_args()
    import torch

    torch.set_num_threads(a.threads)
    if a.child:
        kind, *rest = a.child
        if kind == "prefill":
            r = child_prefill(rest[0], a.model, a.dtype, int(rest[1]), a.runs)
        elif kind == "decode":
            r = child_decode(rest[0], a.model, a.dtype, int(rest[1]), a.context, a.steps, a.runs)
        else:
            r = child_f32_check(a.model, int(rest[0]))
        print(json.dumps(r))
        return
    import transformers

    from kvmesh.services.engine.model import upcast_bf16

    lengths = [int(x) for x in a.lengths.split(",")]
    batches = [int(x) for x in a.batches.split(",")]
    engines = a.engines.split(",")
    common = ["--model", a.model, "--dtype", a.dtype, "--runs", str(a.runs)]
    common += ["--context", str(a.context), "--steps", str(a.steps)]
    t0 = time.perf_counter()
    doc: dict = {
        "benchmark": "engine_long",
        "created": time.strftime("%Y-%m-%dT%H:%M:%S"),
        "command": "python -m kvmesh.loadtest.bench_long " + " ".join(sys.argv[1:]),
        "machine": {
            "platform": platform.platform(),
            "cpu": platform.processor() or platform.machine(),
            "cpus": os.cpu_count(),
            "python": platform.python_version(),
            "torch": torch.__version__,
            "transformers": transformers.__version__,
            "bf16_upcast": upcast_bf16(),
        },
        "args": {**vars(a), "lengths": lengths, "batches": batches},
        "prefill": {},
        "decode": {},
    }
    for n in lengths:
        for e in engines:
            if e == "transformers" and n > a.transformers_max:
                continue
            r = doc["prefill"][f"{e}:{n}"] = spawn(
                [*common, "--child", "prefill", e, str(n)], a.threads
            )
            print(
                f"[{time.perf_counter() - t0:5.0f}s] prefill {e:12} {n:6}: {r['tokens_per_s']:8,.0f} tok/s, "
                f"peak +{r['prefill_peak_mib']:,.0f} MiB (load {r['loadavg_1m']:.1f})",
                flush=True,
            )
    if not a.no_decode:
        for b in batches:
            procs = a.decode_procs if b <= a.decode_procs_max_batch else 1
            got: dict[str, list[dict]] = {e: [] for e in engines}
            for _ in range(procs):  # fresh processes, the engines interleaved
                for e in engines:
                    r = spawn([*common, "--child", "decode", e, str(b)], a.threads)
                    got[e].append(r)
                    print(
                        f"[{time.perf_counter() - t0:5.0f}s] decode  {e:12} b={b:3}: {r['median_ms_per_step']:8.1f} ms/step "
                        f"(load {r['loadavg_1m']:.1f})",
                        flush=True,
                    )
            for e, rs in got.items():
                doc["decode"][f"{e}:{b}"] = merge_processes(rs)
    if "transformers" in engines:
        doc["f32_check"] = spawn(["--model", a.model, "--child", "f32", "512"], a.threads)
    doc["total_s"] = time.perf_counter() - t0
    md = render(doc)
    print("\n" + md)
    Path(a.out + ".json").parent.mkdir(parents=True, exist_ok=True)
    Path(a.out + ".json").write_text(json.dumps(doc, indent=2))
    Path(a.out + ".md").write_text(md)
    print(f"wrote {a.out}.json and {a.out}.md ({doc['total_s']:.0f}s)")


if __name__ == "__main__":
    main()
