"""The Mooncake paper's prefill-scheduling experiment (FAST'25, §5.2 / arXiv §6), calibrated.

A small, exact model of what the paper's experiment measures, the TTFT of every request
of the trace under four prefill schedulers, implemented as the paper describes them:

- ``random``: a prefill instance drawn at random;
- ``load``: load balancing, the instance with the least queued prefill work;
- ``local``: local cache-aware, Algorithm 1 without transfers: for every instance
  ``TTFT = T_queue + T_prefill(new, own prefix)``, the minimum wins;
- ``global``: global cache-aware (KVCache-centric, Algorithm 1 with cache balancing):
  an instance may first pull the longest prefix held anywhere in the cluster
  (``T_transfer``) when that beats computing it; the pulled blocks stay in its cache
  (hot prefixes replicate).

Every instance has an LRU prefix cache of ``cache_blocks`` blocks of ``block_size`` tokens
(automatic prefix caching: every policy reuses the blocks on its own node). Decode does not
enter the TTFT (layer-wise streaming hides the KV handoff; SLOs off, nothing is rejected).

Model, with exact estimates (the conductor's view is the truth):
- instance: FIFO, one prefill at a time; ``prefill_ms(new, cached) = base + a*new +
  b*new*(new+cached)`` (linear layers, plus attention of the new tokens over the whole
  prefix, cached part included);
- a transfer runs on the NICs while the request waits in the queue: compute starts at
  ``max(instance free, now + transfer)``;
- a block computed by a request counts as cached for requests queued behind it on the
  same instance (FIFO: it is there when they start), for a transfer only once computed.

``python -m kvmesh.loadtest.sim.paper`` prints the calibrated table, the sensitivity sweeps
and kvmesh's own policy (the real ``Scheduler`` in ``core.Simulation``) on the same model,
and writes ``results/sim_paper.json`` and the simulator section of ``results/report.md``.
"""

from __future__ import annotations

import json
import random
from collections import OrderedDict
from dataclasses import dataclass, field
from pathlib import Path

PAPER_TTFT_S = {"random": 19.65, "load": 5.27, "local": 3.58, "global": 3.07}
PAPER_POLICIES = tuple(PAPER_TTFT_S)


@dataclass
class PaperCost:
    """Cost of one prefill instance: dummy LLaMA3-70B on 8 x A800-80GB, TP8, bf16.

    See ``CALIBRATION`` in ``__main__`` of this module (and the report) for where each
    number comes from; the defaults are the calibrated ones.
    """

    prefill_base_ms: float = 30.0
    prefill_per_token_ms: float = 0.11
    prefill_pair_ms: float = 1.5e-6
    kv_bytes_per_token: int = 327_680  # 80 layers x 8 KV heads x 128 x K,V x bf16
    bandwidth_gbps: float = 50.0  # GB/s per instance (4 x 200 Gb/s = 100 GB/s line rate)

    def prefill_ms(self, new: int, cached: int) -> float:
        return (
            self.prefill_base_ms
            + self.prefill_per_token_ms * new
            + self.prefill_pair_ms * new * (new + cached)
        )

    def transfer_ms(self, tokens: int) -> float:
        return tokens * self.kv_bytes_per_token / (self.bandwidth_gbps * 1e6)


@dataclass
class PaperConfig:
    policy: str = "global"
    prefill_nodes: int = 8
    block_size: int = 256
    cache_blocks: int = 3_000  # per instance, of block_size tokens
    load_metric: str = "work"  # "work": queued ms; "requests": queued request count
    time_scale: float = 1.0  # multiplies the trace's timestamps
    max_requests: int | None = None
    seed: int = 0
    cost: PaperCost = field(default_factory=PaperCost)


def split_blocks(trace: list[dict], block_size: int, trace_block: int = 512) -> list[dict]:
    """The trace's prefix hashes at ``block_size`` tokens: each 512-token block id becomes
    ``trace_block // block_size`` sub-block ids (a prefix hash stays a prefix hash: the
    sub-block ids of a block follow from its own id), the last block only as many as the
    prompt covers. A ``block_size`` of 512 returns the trace unchanged."""
    if block_size == trace_block:
        return trace
    if trace_block % block_size:
        raise ValueError(f"block size {block_size} must divide {trace_block}")
    k = trace_block // block_size
    out = []
    for rec in trace:
        n = int(rec["input_length"])
        ids = [h * k + j for h in rec["hash_ids"] for j in range(k)]
        out.append({**rec, "hash_ids": ids[: -(-n // block_size)]})
    return out


class _Node:
    def __init__(self, cap: int) -> None:
        self.cap = cap
        self.blocks: OrderedDict[int, float] = OrderedDict()  # id -> time it is computed
        self.free = 0.0  # when the queue drains
        self.queued: list[float] = []  # completion times of queued/running prefills

    def prefix(self, ids: list[int], ready_by: float | None = None) -> int:
        k = 0
        for h in ids:
            t = self.blocks.get(h)
            if t is None or (ready_by is not None and t > ready_by):
                break
            k += 1
        return k

    def add(self, ids: list[int], ready: float) -> None:
        b = self.blocks
        for h in ids:
            if h in b:
                b[h] = min(b[h], ready)
                b.move_to_end(h)
            else:
                b[h] = ready
        while len(b) > self.cap:
            b.popitem(last=False)


@dataclass
class PaperResult:
    policy: str
    ttft_ms: list[float]
    prompt_tokens: int
    cached_tokens: int
    transferred_tokens: int

    @property
    def mean_ttft_s(self) -> float:
        return sum(self.ttft_ms) / len(self.ttft_ms) / 1000.0

    @property
    def hit_ratio(self) -> float:
        return self.cached_tokens / self.prompt_tokens if self.prompt_tokens else 0.0

    def summary(self) -> dict:
        xs = sorted(self.ttft_ms)
        return {
            "requests": len(xs),
            "ttft_mean_s": round(self.mean_ttft_s, 3),
            "ttft_p50_s": round(xs[len(xs) // 2] / 1000, 3),
            "ttft_p90_s": round(xs[int(len(xs) * 0.9)] / 1000, 3),
            "hit_ratio": round(self.hit_ratio, 4),
            "transferred_share": round(self.transferred_tokens / self.prompt_tokens, 4),
        }


def simulate_paper(trace: list[dict], cfg: PaperConfig) -> PaperResult:
    """Replays ``trace`` (already at ``cfg.block_size``: see :func:`split_blocks`) under
    ``cfg.policy``; deterministic for a given seed."""
    if cfg.policy not in PAPER_POLICIES:
        raise ValueError(f"policy {cfg.policy!r} is not one of {PAPER_POLICIES}")
    c, bs = cfg.cost, cfg.block_size
    rng = random.Random(cfg.seed)
    nodes = [_Node(cfg.cache_blocks) for _ in range(cfg.prefill_nodes)]
    recs = trace[: cfg.max_requests] if cfg.max_requests else trace
    ttfts: list[float] = []
    hit = moved = total = 0
    for rec in sorted(recs, key=lambda r: r["timestamp"]):
        now = rec["timestamp"] * cfg.time_scale
        n = int(rec["input_length"])
        ids = rec["hash_ids"]
        usable = ids[: min(len(ids), (n - 1) // bs)]  # the last token is always computed
        for nd in nodes:
            nd.queued = [t for t in nd.queued if t > now]
        if cfg.policy == "random":
            choice = [rng.randrange(len(nodes))]
        elif cfg.policy == "load":
            if cfg.load_metric == "requests":
                key = [(len(nd.queued), i) for i, nd in enumerate(nodes)]
            else:
                key = [(max(0.0, nd.free - now), i) for i, nd in enumerate(nodes)]
            choice = [min(key)[1]]
        else:
            choice = list(range(len(nodes)))
        best_remote, best_src = 0, -1
        if cfg.policy == "global":
            for i, nd in enumerate(nodes):
                k = nd.prefix(usable, ready_by=now)
                if k > best_remote:
                    best_remote, best_src = k, i
        best = None
        for i in choice:
            nd = nodes[i]
            local = nd.prefix(usable)
            queue = max(0.0, nd.free - now)
            opt = (queue + c.prefill_ms(n - local * bs, local * bs), i, local, 0, 0.0)
            if best_remote > local and best_src != i:
                k = best_remote - local
                xfer = c.transfer_ms(k * bs)
                cached = best_remote * bs
                start = max(queue, xfer)
                alt = start + c.prefill_ms(n - cached, cached)
                if alt < opt[0]:
                    opt = (alt, i, local, k, xfer)
            if best is None or opt[0] < best[0]:
                best = opt
        assert best is not None
        _, i, local, k, xfer = best
        nd = nodes[i]
        cached = (local + k) * bs
        start = max(nd.free, now + xfer)
        end = start + c.prefill_ms(n - cached, cached)
        nd.free = end
        nd.queued.append(end)
        # the reused and pulled blocks are touched/held; the computed ones are ready at end
        nd.add(usable[: local + k], start)
        nd.add(ids[: n // bs], end)
        ttfts.append(end - now)
        hit += cached
        moved += k * bs
        total += n
    return PaperResult(cfg.policy, ttfts, total, hit, moved)


# -- calibration, sensitivity, kvmesh on the same model --------------------------------------

CALIBRATION = [
    "Trace: the vendored FAST'25 `synthetic_trace.jsonl` (3,993 requests, 17 min), split "
    "to 256-token blocks; the paper's scheduling section does not name its trace, and the "
    "23,608-request arXiv trace is not in this repository.",
    "Cluster: 8 prefill instances (the arXiv 8P+8D setup); decode does not enter the TTFT.",
    "Replay: timestamps x `time_scale` (the paper does not say how fast it replayed); fitted.",
    "Prefill cost: `base + a*new + b*new*(new+cached)`; `a` fitted (0.3 ms/token = 3.3k "
    "tokens/s per 8 x A800 node, 2 x 70e9 FLOP/token -> ~19% MFU of 8 x 312 TFLOP/s); "
    "`b` = 1.5e-6 ms per (query, key) pair (4 x 8192 FLOP x 80 layers, causal half, ~50% "
    "attention efficiency), charged over the cached prefix too.",
    "Prefix cache: LRU per instance, `cache_blocks` blocks of 256 tokens (80 MiB each for "
    "LLaMA3-70B's 320 KiB/token): 3,000 blocks = 240 GB of each node's DRAM; fitted.",
    "Transfer: 50 GB/s per instance (half of 4 x 200 Gb/s line rate), overlapped with the "
    "queue wait.",
    "A hit is a block of the prompt's prefix (all but the last token) present on the "
    "instance at start; `local` uses only its own instance's cache, `global` also pulls "
    "the longest prefix in the cluster (threshold: only when it is faster).",
    "Estimates are exact (the paper's predictor is taken as perfect); load balancing "
    "balances queued work (ms); ties to the lowest instance index; `random` seeded.",
]
CALIBRATED = {
    "prefill_per_token_ms": 0.3,
    "prefill_pair_ms": 1.5e-6,
    "cache_blocks": 3000,
    "time_scale": 4.0,
}


def calibrated_config(policy: str = "global", **over) -> PaperConfig:
    """The calibrated setup (``CALIBRATED``), with overrides of any PaperConfig or PaperCost
    field."""
    vals = {**CALIBRATED, **over}
    cost = PaperCost(**{k: v for k, v in vals.items() if k in PaperCost.__dataclass_fields__})
    cfg = {k: v for k, v in vals.items() if k in PaperConfig.__dataclass_fields__}
    return PaperConfig(policy=policy, cost=cost, **cfg)


def paper_table(trace: list[dict], **over) -> dict:
    """Mean TTFT (s) of the four paper policies on the calibrated setup with overrides;
    ``trace`` at 512-token blocks (split here to the config's block size)."""
    cfg0 = calibrated_config(**over)
    tr = split_blocks(trace, cfg0.block_size)
    return {
        pol: simulate_paper(tr, calibrated_config(pol, **over)).summary() for pol in PAPER_POLICIES
    }


def _kvmesh_on_model(
    trace: list[dict],
    policies,
    ttft_slo_ms=1e12,
    tbt_slo_ms=1e12,
    time_scale=None,
    max_requests=None,
) -> dict:
    """The real conductor ``Scheduler`` (core.Simulation) on the calibrated model: the
    same prefill cost, cache capacity, block size, bandwidth and replay speed."""
    from dataclasses import replace

    from kvmesh.loadtest.metrics import summarize
    from kvmesh.loadtest.sim.core import CostModel, SimConfig, simulate

    cal = calibrated_config()
    c = cal.cost
    cost = CostModel(
        prefill_base_ms=c.prefill_base_ms,
        prefill_per_token_ms=c.prefill_per_token_ms,
        prefill_pair_ms=c.prefill_pair_ms,
        kv_bytes_per_token=c.kv_bytes_per_token,
        bandwidth_gbps=c.bandwidth_gbps,
        cache_blocks=cal.cache_blocks,
    )
    base = SimConfig(
        prefill_nodes=cal.prefill_nodes,
        decode_nodes=cal.prefill_nodes,
        block_size=cal.block_size,
        ttft_slo_ms=ttft_slo_ms,
        tbt_slo_ms=tbt_slo_ms,
        time_scale=cal.time_scale if time_scale is None else time_scale,
        max_requests=max_requests,
        cost=cost,
    )
    tr = split_blocks(trace, cal.block_size)
    out = {}
    for pol in policies:
        s = simulate(tr, replace(base, policy=pol))
        m = summarize(s.records(), ttft_slo_ms=ttft_slo_ms, tbt_slo_ms=tbt_slo_ms)
        out[pol] = {
            "served": m["served"],
            "rejected": m["rejected"],
            "ttft_mean_s": round(m["ttft_ms"]["mean"] / 1000, 3),
            "ttft_p90_s": round(m["ttft_ms"]["p90"] / 1000, 3),
            "hit_ratio": round(m["cache_hit_ratio"], 4),
            "slo_attainment": round(m["slo_attainment"], 4),
        }
    return out


def early_rejection(trace: list[dict], max_requests: int | None = None) -> dict:
    """The early-rejection experiment: the real ``Scheduler`` under plain early rejection
    (``cache-load``) and prediction-based (``kvmesh``) on the calibrated model, the trace
    (512-token blocks; its first ``max_requests``) at 4x the calibrated rate, the paper's
    30 s TTFT SLO; the counts, and kvmesh's rejections over cache-load's (``ratio``)."""
    er = _kvmesh_on_model(
        trace,
        ("cache-load", "kvmesh"),
        ttft_slo_ms=30_000,
        tbt_slo_ms=100.0,
        time_scale=CALIBRATED["time_scale"] / 4,
        max_requests=max_requests,
    )
    ratio = er["kvmesh"]["rejected"] / max(1, er["cache-load"]["rejected"])
    return {
        "setup": "Real `Scheduler`, calibrated model, the trace at 4x the calibrated rate "
        "(its own timestamps), TTFT SLO 30 s, TBT SLO 100 ms, 8 prefill + 8 decode. "
        "`cache-load` rejects on the decode load now (the paper's early rejection), "
        "`kvmesh` on the load predicted at the end of the prefill (plus its other paths). "
        "The paper's counts (4,183 without prediction, 3,589 with, 0.86x) come from the "
        "23,608-request arXiv trace, which is not vendored: compare ratios, not counts.",
        "policies": er,
        "ratio": round(ratio, 3),
        "verdict": f"kvmesh / cache-load rejections: {ratio:.2f}x (paper: 0.86x).",
    }


SWEEPS = {
    "prefill_per_token_ms": [0.2, 0.25, 0.3, 0.35, 0.4],
    "time_scale": [3.0, 3.5, 4.0, 5.0, 6.0],
    "cache_blocks": [1000, 2000, 3000, 4000, 8000, 1_000_000],
    "prefill_pair_ms": [0.0, 0.75e-6, 1.5e-6, 3e-6],
    "bandwidth_gbps": [12.5, 25.0, 50.0, 100.0],
    "block_size": [256, 512],
    "load_metric": ["work", "requests"],
    "seed": [0, 1, 2, 3],
}
MARK_BEGIN, MARK_END = "<!-- sim-paper:begin -->", "<!-- sim-paper:end -->"


def _err(t: dict) -> float:
    return max(abs(t[p]["ttft_mean_s"] / PAPER_TTFT_S[p] - 1) for p in PAPER_POLICIES)


def markdown(res: dict) -> str:
    cal = res["calibrated"]
    L = [
        MARK_BEGIN,
        "## Simulator calibrated to the paper's scheduling experiment",
        "",
        "`python -m kvmesh.loadtest.sim.paper` (`loadtest/sim/paper.py`, results in "
        "`sim_paper.json`). The four prefill schedulers as the Mooncake paper describes them, "
        "on a model of its testbed (8 prefill instances, dummy LLaMA3-70B on 8 x A800, block "
        "size 256), TTFT only (SLOs off). Calibrated: "
        f"`{json.dumps(CALIBRATED)}`.",
        "",
        "| policy | sim mean TTFT s | paper mean TTFT s | sim / paper | p50 s | p90 s | "
        "prefix hit | pulled from other nodes |",
        "|---|---|---|---|---|---|---|---|",
    ]
    names = {
        "random": "random",
        "load": "load-balancing",
        "local": "local cache-aware",
        "global": "global cache-aware",
    }
    for p in PAPER_POLICIES:
        s = cal[p]
        L.append(
            f"| {names[p]} | {s['ttft_mean_s']:.2f} | {PAPER_TTFT_S[p]:.2f} | "
            f"{s['ttft_mean_s'] / PAPER_TTFT_S[p]:.2f} | {s['ttft_p50_s']:.2f} | "
            f"{s['ttft_p90_s']:.2f} | {s['hit_ratio']:.1%} | {s['transferred_share']:.1%} |"
        )
    L += [
        "",
        f"Largest deviation: {_err(cal):.0%} (goal: 25% each).",
        "",
        "Assumptions where the paper is silent:",
        "",
    ]
    L += [f"- {a}" for a in CALIBRATION]
    L += [
        "",
        "### Sensitivity (one parameter varied, the rest calibrated)",
        "",
        "| parameter | value | random | load | local | global | max deviation |",
        "|---|---|---|---|---|---|---|",
    ]
    for name, rows in res["sensitivity"].items():
        for v, t in rows:
            L.append(
                f"| {name} | {v} | "
                + " | ".join(f"{t[p]['ttft_mean_s']:.2f}" for p in PAPER_POLICIES)
                + f" | {_err(t):.0%} |"
            )
    L += [
        "",
        "Reading: the fit rests on two parameters the paper does not give, the prefill speed "
        "and the replay rate; together they set the load, and random and load-balancing sit "
        "near saturation, so 15% on either moves them by up to 1.6x and 25-33% by 2-3x (the "
        "cache-aware pair move far less). At the trace's own rate and a 50%-MFU prefill (0.11 ms/token) the same "
        "policies give random 71 s, load 50 s, local 2.2 s, global 1.9 s: no cost alone "
        "fits all four there, because the cache-aware TTFT is mostly service time (it needs "
        "a slow prefill) while the blind policies are mostly queueing (they need a light "
        "load). The transfer bandwidth does not matter here (pulls hide behind the queue); "
        "the prefix-cache size does (it sets the local/global hit ratio).",
    ]
    k = res["kvmesh"]
    L += [
        "",
        "### The real conductor policy on the same calibrated model",
        "",
        "`core.Simulation` with the real `Scheduler` (policy.py), same cost, cache, block "
        "size, bandwidth and replay speed; decode nodes simulated too (8).",
        "",
        "| policy (policy.py) | mean TTFT s | p90 s | prefix hit |",
        "|---|---|---|---|",
    ]
    for p, s in k.items():
        L.append(f"| {p} | {s['ttft_mean_s']:.2f} | {s['ttft_p90_s']:.2f} | {s['hit_ratio']:.1%} |")
    er = res.get("early_rejection")
    if er:
        L += [
            "",
            "### Early rejection",
            "",
            er["setup"],
            "",
            "| policy | rejected | served | SLO attained |",
            "|---|---|---|---|",
        ]
        for p, s in er["policies"].items():
            L.append(f"| {p} | {s['rejected']} | {s['served']} | {s['slo_attainment']:.1%} |")
        L += ["", er["verdict"]]
    L += [
        "",
        "(This section is written by `python -m kvmesh.loadtest.sim.paper`; rerun it after "
        "`python -m kvmesh.loadtest.report` rebuilds this file.)",
        "",
        MARK_END,
    ]
    return "\n".join(L)


def splice(report: Path, section: str) -> None:
    text = report.read_text() if report.exists() else ""
    if MARK_BEGIN in text and MARK_END in text:
        a, rest = text.split(MARK_BEGIN, 1)
        _, b = rest.split(MARK_END, 1)
        text = a + section + b
    else:
        anchor = "\n## Caveats"
        text = (
            text.replace(anchor, "\n" + section + "\n" + anchor, 1)
            if anchor in text
            else text + "\n" + section + "\n"
        )
    report.write_text(text)


def main(argv: list[str] | None = None) -> int:
    import argparse

    from kvmesh.loadtest.workload import DEFAULT_TRACE, load_trace

    p = argparse.ArgumentParser(
        prog="python -m kvmesh.loadtest.sim.paper", description=__doc__.split("\n")[0]
    )
    p.add_argument("--trace", default=str(DEFAULT_TRACE))
    p.add_argument("--out", default=str(Path(__file__).resolve().parents[1] / "results"))
    p.add_argument("--no-sweeps", action="store_true")
    p.add_argument("--no-report", action="store_true")
    a = p.parse_args(argv)
    trace = load_trace(a.trace)
    res: dict = {
        "paper_ttft_s": PAPER_TTFT_S,
        "calibrated_params": CALIBRATED,
        "assumptions": CALIBRATION,
    }
    res["calibrated"] = paper_table(trace)
    for pol, s in res["calibrated"].items():
        print(
            f"{pol:7s} {s['ttft_mean_s']:7.2f} s (paper {PAPER_TTFT_S[pol]:5.2f})  "
            f"hit {s['hit_ratio']:.3f}",
            flush=True,
        )
    res["sensitivity"] = {}
    if not a.no_sweeps:
        for name, vals in SWEEPS.items():
            res["sensitivity"][name] = [(v, paper_table(trace, **{name: v})) for v in vals]
            print(name, [(v, _err(t)) for v, t in res["sensitivity"][name]], flush=True)
    res["kvmesh"] = _kvmesh_on_model(trace, ("random", "load", "cache-load", "kvmesh"))
    print("real scheduler:", res["kvmesh"], flush=True)
    res["early_rejection"] = early_rejection(trace)
    print(res["early_rejection"]["verdict"], flush=True)
    out = Path(a.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "sim_paper.json").write_text(json.dumps(res, indent=1))
    if not a.no_report:
        splice(out / "report.md", markdown(res))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
