"""Hand-off benchmark: the gap between a request's first and second token under a burst.

The first token of a disaggregated request is sampled by the prefill node, the second by
the decode node; the client sees the gap between them as a time between tokens (aiperf's
``time_to_second_token``), so it must stay inside the TBT SLO, bursts included (the
hand-off is a TBT, not a TTFT; issue 31).

The run: a local cluster as ``kvmesh up`` starts it (1 prefill + 1 decode node, etcd,
store-master, conductor; ``--model``, block size 64, every other option at its default),
a few warm-up requests one at a time, then ``--bursts`` bursts of ``--burst`` streaming
``Generate`` calls sent at once (prompts of ``--min-prompt`` to ``--max-prompt`` random
token ids, ``--max-tokens`` output tokens each, greedy, EOS ignored, the TBT SLO asked for
as ``--tbt-slo-ms``), each burst after the last has ended. The default model is ``demo``
(the 1.3 M-parameter Llama kvmesh ships, a real 4,096-id tokenizer; its context is 1,024
tokens, hence prompts of 100 to 1,000); ``--model medium --max-prompt 1200`` gives the
prompts more compute (~0.5 ms per token). Per request the client records when each token came;
reported per configuration: the first-to-second-token gap (p50/p99/max), by how much it
exceeds the same request's next gap (the hand-off's own share, less sensitive to a
machine that other work slows), the later gaps and the TTFT (p50/p99/max), and how many
requests were refused.

``--compare`` runs the same bursts against each configuration in ``CONFIGS`` (one
cluster each, same prompts), so a behaviour that a config field switches is compared in
one run; ``--baseline REV`` adds the cluster of git revision ``REV`` (its files, from
``git archive``, imported instead of this tree's: ``PYTHONPATH`` and the working directory
of its processes) as the
configuration ``baseline``. With ``--rounds N`` every configuration runs N times, in
turn (a cluster each time), so that a machine shared with other work slows them alike;
the figures pool the rounds. Results go to ``loadtest/results/handoff.json``.

    python -m kvmesh.loadtest.bench_handoff [--model medium] [--compare] [--baseline REV]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import grpc

from kvmesh.protos import kvmesh_pb2 as pb
from kvmesh.protos import kvmesh_pb2_grpc as pbg

RESULTS = Path(__file__).parent / "results"
REPO = Path(__file__).resolve().parent.parent

# name -> (conductor args, decode node args); the first is the default configuration
CONFIGS: dict[str, tuple[list[str], list[str]]] = {
    "default": ([], []),
    # the conductor sends the prefill node's first token at once (the decode node still
    # steps between the chunks of the prompts it computes, cut to leave the running
    # requests' TBT SLO room)
    "no-hold": (["--no-hold-first-token"], []),
    # ... and the decode node's prompt chunks are bounded by tokens only (512)
    "no-hold-tokens-only": (["--no-hold-first-token"], ["--prefill-chunk-tbt-share", "0"]),
}


def baseline_tree(rev: str) -> tuple[str, str]:
    """(a temporary directory, a ``PYTHONPATH`` entry under it) whose ``kvmesh`` package
    is git revision ``rev`` of this repository (its layout staged as the installed
    package's, as scripts/lint.sh does); the caller removes the directory."""
    top = tempfile.mkdtemp(prefix="kvmesh-baseline-")
    src = Path(top, "src")
    src.mkdir()
    archive = subprocess.run(
        ["git", "archive", rev], cwd=REPO, check=True, capture_output=True
    ).stdout
    subprocess.run(["tar", "-x", "-C", str(src)], input=archive, check=True)
    pkg = Path(top, "stage", "kvmesh")
    pkg.mkdir(parents=True)
    (pkg / "__init__.py").symlink_to(src / "kvmesh" / "__init__.py")
    for d in ("services", "rdma", "protos", "loadtest"):
        (pkg / d).symlink_to(src / d)
    return top, str(pkg.parent)


def pct(xs: list[float], q: float) -> float | None:
    """The ``q`` quantile (0..1) of ``xs`` by nearest rank, or None when empty."""
    if not xs:
        return None
    s = sorted(xs)
    return s[min(len(s) - 1, max(0, round(q * len(s) + 0.5) - 1))]


def summary(xs: list[float]) -> dict:
    r = lambda v: None if v is None else round(v, 1)  # noqa: E731
    return {
        "n": len(xs),
        "p50": r(pct(xs, 0.5)),
        "p99": r(pct(xs, 0.99)),
        "max": r(max(xs) if xs else None),
        "mean": r(statistics.fmean(xs) if xs else None),
    }


async def one(stub, prompt: list[int], max_tokens: int, tbt_slo_ms: float, rid: str) -> dict:
    req = pb.GenerateRequest(
        token_ids=prompt,
        max_tokens=max_tokens,
        request_id=rid,
        sampling=pb.SamplingParams(temperature=0.0, ignore_eos=True),
        slo=pb.SLO(tbt_ms=tbt_slo_ms),
    )
    t0 = time.perf_counter()
    times: list[float] = []
    out = {"prompt_tokens": len(prompt), "status": "OK", "route": "", "tokens": []}
    try:
        async for resp in stub.Generate(req, timeout=120):
            now = (time.perf_counter() - t0) * 1000
            if resp.HasField("route"):
                out["route"] = "disaggregated" if resp.route.prefill_node else "colocated"
            for t in resp.token_ids:
                times.append(now)
                out["tokens"].append(t)
    except grpc.aio.AioRpcError as e:
        out["status"] = e.code().name
        out["error"] = e.details()
    out["token_times_ms"] = [round(t, 2) for t in times]
    return out


async def bursts(address: str, prompts: list[list[list[int]]], args) -> list[dict]:
    recs: list[dict] = []
    async with grpc.aio.insecure_channel(address) as ch:
        stub = pbg.ConductorStub(ch)
        for i in range(args.warmup):  # one at a time: the nodes' time models settle
            await one(
                stub, prompts[0][i % len(prompts[0])], args.max_tokens, args.tbt_slo_ms, f"w{i}"
            )
        for b, burst in enumerate(prompts):
            got = await asyncio.gather(
                *(
                    one(stub, p, args.max_tokens, args.tbt_slo_ms, f"b{b}r{i}")
                    for i, p in enumerate(burst)
                )
            )
            for g in got:
                g["burst"] = b
            recs.extend(got)
            await asyncio.sleep(0.5)
    return recs


def report(recs: list[dict]) -> dict:
    ok = [r for r in recs if r["status"] == "OK" and len(r["token_times_ms"]) >= 2]
    gap = [r["token_times_ms"][1] - r["token_times_ms"][0] for r in ok]
    later = [b - a for r in ok for a, b in zip(r["token_times_ms"][1:], r["token_times_ms"][2:])]
    ttft = [r["token_times_ms"][0] for r in ok]
    # the hand-off's own share: how much longer the first gap was than the same request's
    # next one (a step of the same batch, as slow as the machine was then)
    excess = [
        (t[1] - t[0]) - (t[2] - t[1]) for t in (r["token_times_ms"] for r in ok) if len(t) >= 3
    ]
    # each burst's last first token (how long the cluster took to start all of it), so a
    # burst that a busy machine slowed shows as one sample, not as thirty
    drained: dict[tuple, float] = {}
    for r in ok:
        key = (r.get("round", 0), r.get("burst", 0))
        drained[key] = max(drained.get(key, 0.0), r["token_times_ms"][0])
    by_route: dict[str, list[float]] = {}
    for r, g in zip(ok, gap):
        by_route.setdefault(r["route"], []).append(g)
    return {
        "requests": len(recs),
        "ok": len(ok),
        "refused": sum(r["status"] == "RESOURCE_EXHAUSTED" for r in recs),
        "failed": sum(r["status"] not in ("OK", "RESOURCE_EXHAUSTED") for r in recs),
        "gap_ms": summary(gap),
        "gap_ms_by_route": {k: summary(v) for k, v in sorted(by_route.items())},
        "gap_over_next_gap_ms": summary(excess),
        "later_gaps_ms": summary(later),
        "ttft_ms": summary(ttft),
        "burst_last_ttft_ms": summary(list(drained.values())),
    }


def run_config(conductor_args, decode_args, prompts, args, pythonpath: str = "") -> list[dict]:
    """The bursts against one fresh cluster: its records. ``pythonpath``: where the
    cluster's processes import kvmesh from (a baseline's tree), else this tree."""
    from kvmesh.services.launcher import LocalCluster

    node_args = ["--model", args.model, "--block-size", str(args.block_size)]
    old = os.environ.get("PYTHONPATH")
    with tempfile.TemporaryDirectory(prefix="kvmesh-handoff-") as wd:
        c = LocalCluster(
            wd,
            node_args=node_args,
            conductor_args=conductor_args,
            decode_args=decode_args,
            http_port=-1,
        )
        cwd = os.getcwd()
        if pythonpath:
            # the processes take the environment and the working directory as they start;
            # ``python -m`` puts the latter first on their path (this tree's ``kvmesh``
            # would win from its top), so they start where the baseline's is
            os.environ["PYTHONPATH"] = pythonpath
            os.chdir(pythonpath)
        try:
            c.start()
        finally:
            if pythonpath:
                os.chdir(cwd)
                if old is None:
                    del os.environ["PYTHONPATH"]
                else:
                    os.environ["PYTHONPATH"] = old
        try:
            return asyncio.run(bursts(c.conductor, prompts, args))
        finally:
            c.stop()


def fmt(v) -> str:
    return "-" if v is None else f"{v:.1f}"


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default="demo", help="preset or shipped model (demo, tiny, medium)")
    ap.add_argument("--block-size", type=int, default=64)
    ap.add_argument("--burst", type=int, default=30, help="requests sent at once")
    ap.add_argument("--bursts", type=int, default=3)
    ap.add_argument("--warmup", type=int, default=4)
    ap.add_argument("--max-tokens", type=int, default=8)
    ap.add_argument("--min-prompt", type=int, default=100)
    ap.add_argument("--max-prompt", type=int, default=1000)
    ap.add_argument("--tbt-slo-ms", type=float, default=200.0)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--compare", action="store_true", help="every configuration in CONFIGS")
    ap.add_argument("--baseline", default="", help="also the cluster of this git revision")
    ap.add_argument("--rounds", type=int, default=1, help="each configuration this many times")
    ap.add_argument("--config", action="append", help="run these configurations only")
    ap.add_argument("--keep-records", action="store_true", help="per-request records in the JSON")
    ap.add_argument("--records", default="", help="per-request records to this JSON file")
    ap.add_argument(
        "--from-records",
        default="",
        help="report the records of an earlier run (a --records file) instead of running",
    )
    ap.add_argument("--tree", default="", help="with --from-records: the tree they were run on")
    ap.add_argument("--out", default=str(RESULTS / "handoff.json"))
    args = ap.parse_args(argv)
    rng = random.Random(args.seed)
    from kvmesh.services.engine.config import PRESETS

    # a preset's vocabulary; a checkpoint's (demo: 4,096 ids) holds at least these
    vocab = PRESETS[args.model].vocab_size if args.model in PRESETS else 256
    prompts = [
        [
            [rng.randrange(3, vocab) for _ in range(rng.randint(args.min_prompt, args.max_prompt))]
            for _ in range(args.burst)
        ]
        for _ in range(args.bursts)
    ]
    names = args.config or (list(CONFIGS) if args.compare else ["default"])
    runs: dict[str, tuple[list[str], list[str], str]] = {}
    tree = ""
    if args.baseline and not args.from_records:
        tree, path = baseline_tree(args.baseline)
        runs["baseline"] = ([], [], path)
    runs.update({n: (*CONFIGS[n], "") for n in names})
    recs: dict[str, list[dict]] = {n: [] for n in runs}
    if args.from_records:
        recs = json.loads(Path(args.from_records).read_text())
        runs = {n: (*CONFIGS.get(n, ([], [])), "") for n in recs}
        args.rounds = 1 + max((r.get("round", 0) for v in recs.values() for r in v), default=0)
    try:
        for k in range(0 if args.from_records else args.rounds):
            for name, (cargs, dargs, path) in runs.items():
                print(
                    f"[round {k + 1}/{args.rounds}: {name}] conductor {cargs} decode {dargs}",
                    file=sys.stderr,
                    flush=True,
                )
                load1 = os.getloadavg()[0]  # (the machine may be shared: said per round)
                got = run_config(cargs, dargs, prompts, args, path)
                for g in got:
                    g["round"], g["load1"] = k, round(load1, 2)
                recs[name].extend(got)
    finally:
        if tree:
            shutil.rmtree(tree, ignore_errors=True)
    results = {}
    for name, (cargs, dargs, _) in runs.items():
        rep = report(recs[name])
        rep["conductor_args"], rep["decode_args"] = cargs, dargs
        rep["by_round"] = []
        for k in range(args.rounds):
            mine = [r for r in recs[name] if r.get("round", 0) == k]
            if not mine:
                continue
            rk = report(mine)
            rep["by_round"].append(
                {
                    "round": k,
                    "load1_at_start": mine[0].get("load1"),
                    "gap_ms": rk["gap_ms"],
                    "ttft_ms": rk["ttft_ms"],
                    "later_gaps_ms": rk["later_gaps_ms"],
                }
            )
        if name == "baseline" and args.baseline:  # (the revision, as this repository names it)
            rep["revision"] = subprocess.run(
                ["git", "rev-parse", "--short", args.baseline],
                cwd=REPO,
                capture_output=True,
                text=True,
            ).stdout.strip()
        if args.keep_records:
            rep["records"] = recs[name]
        results[name] = rep
    if args.records:
        Path(args.records).write_text(json.dumps(recs) + "\n")
    print(
        f"{args.rounds} x {args.bursts} bursts of {args.burst} at once, prompts {args.min_prompt}-"
        f"{args.max_prompt} tokens, {args.max_tokens} output tokens, model {args.model}, "
        f"TBT SLO {args.tbt_slo_ms:.0f} ms"
    )
    print(
        f"{'config':<22}{'ok':>5}{'refused':>8}  {'gap p50':>8}{'p99':>8}{'max':>8}  "
        f"{'excess p99':>10}  {'later p99':>9}  {'TTFT p50':>9}{'p99':>8}{'max':>8}  "
        f"{'burst last TTFT p50':>19}"
    )
    for name, r in results.items():
        g, t, later, ex = r["gap_ms"], r["ttft_ms"], r["later_gaps_ms"], r["gap_over_next_gap_ms"]
        print(
            f"{name:<22}{r['ok']:>5}{r['refused']:>8}  {fmt(g['p50']):>8}{fmt(g['p99']):>8}"
            f"{fmt(g['max']):>8}  {fmt(ex['p99']):>10}  {fmt(later['p99']):>9}  {fmt(t['p50']):>9}{fmt(t['p99']):>8}"
            f"{fmt(t['max']):>8}  {fmt(r['burst_last_ttft_ms']['p50']):>19}"
        )
    out = {
        "setup": {
            k: v for k, v in vars(args).items() if k not in ("out", "config", "records", "tree")
        },
        # (1, 5, 15 min, as the run ended; 2 cores; unknown for --from-records)
        "load_average": None if args.from_records else os.getloadavg(),
        "tree": args.tree
        or subprocess.run(
            ["git", "describe", "--always", "--dirty"], cwd=REPO, capture_output=True, text=True
        ).stdout.strip(),
        "results": results,
    }
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(out, indent=1) + "\n")
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
