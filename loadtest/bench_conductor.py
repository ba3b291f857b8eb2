"""Conductor decision benchmark: the conductor's scheduling loop, counted whole, on one core.

Each decision runs what a conductor runs per request: ``decide``, ``commit`` of an
accepted decision, and the booking of completions (the prefill node's report feeding its
time model, ``prefill_done`` with the TTFT seen and ``request_done``) for the request
256 decisions older, with the garbage collector on (the requests to come, made before
the loop, are frozen out of its collections: a conductor does not hold them; a decision
is dropped once booked). Requests have 32 blocks (8,192 tokens
at block size 256), their prefix held by some node in 70% of them. The process is pinned
to one core (``os.sched_setaffinity``).

Headline: decisions per second of the loop's wall time, and the p50/p99 of one loop
iteration (decision plus the booking it triggers); the median of ``--runs`` runs, with 8,
64 and 256 prefill nodes and 10^4 and 10^6 indexed blocks. Goal (issues 6 and 15):
>= 20,000 decisions/s at 64 nodes and 10^6 blocks, p99 <= 1 ms. The old headline (the
sum of ``decide`` + ``commit`` latencies alone, GC off) is kept as a labelled secondary
figure for comparison.

``--baseline REV`` (a git revision, or a directory holding ``policy.py``, ``index.py``
and ``estimator.py``) runs that version of the scheduler interleaved with this one, run
for run, so a change is compared under the same machine load. A baseline always runs as
plain Python (its ``.py`` files, copied); this tree's scheduler runs compiled where
``pip install -e .`` built it (``KVMESH_PURE_PYTHON=1``: plain Python).

    python -m kvmesh.loadtest.bench_conductor [--quick] [--baseline HEAD~1]
"""

from __future__ import annotations

import argparse
import functools
import gc
import importlib
import inspect
import json
import os
import random
import re
import resource
import statistics
import subprocess
import sys
import tempfile
import time
import types
from collections import deque
from pathlib import Path

BS = 256
BLOCKS_PER_REQUEST = 32
PENDING = 256  # completions are booked for the request this many decisions older
RESULTS = Path(__file__).parent / "results"
GOAL_RATE, GOAL_P99_US = 20_000, 1000.0
_MODULES = ("estimator", "index", "policy")
_now_ns = time.perf_counter_ns  # the loop's clock (a test replaces it)


def impl_here() -> types.SimpleNamespace:
    """This tree's scheduler: compiled where setup.py built it (and it is current; see
    services/conductor/__init__.py), else plain Python; the name says which."""
    mods = {m: importlib.import_module(f"kvmesh.services.conductor.{m}") for m in _MODULES}
    compiled = not str(mods["policy"].__file__).endswith(".py")
    return types.SimpleNamespace(name="this tree (compiled)" if compiled else "this tree", **mods)


def impl_from(baseline: str) -> types.SimpleNamespace:
    """Another version of the scheduler, loaded side by side: a git revision of this
    repository, or a directory with its ``policy.py``, ``index.py`` and ``estimator.py``
    (and the conductor modules they import)."""
    pkg = f"_kvmesh_baseline_{len([k for k in sys.modules if k.startswith('_kvmesh_base')])}"
    tmp = Path(tempfile.mkdtemp(prefix="kvmesh-bench-baseline-"))
    todo, done = list(_MODULES), set()
    while todo:  # the three, and the conductor modules they import, at that version
        m = todo.pop()
        if m in done:
            continue
        done.add(m)
        if Path(baseline).is_dir():
            text = (Path(baseline) / f"{m}.py").read_text()
        else:
            root = Path(__file__).resolve().parent.parent
            text = subprocess.run(
                ["git", "-C", str(root), "show", f"{baseline}:services/conductor/{m}.py"],
                check=True,
                capture_output=True,
                text=True,
            ).stdout
        todo += re.findall(r"kvmesh\.services\.conductor\.(\w+)", text)
        # and those imported whole: from kvmesh.services.conductor import candidates
        for names in re.findall(r"^from kvmesh\.services\.conductor import ([\w, ]+)$", text, re.M):
            todo += [name.split()[0] for name in names.split(",") if name.strip()]
        text = text.replace("kvmesh.services.conductor.", f"{pkg}.")
        text = text.replace("from kvmesh.services.conductor import ", f"from {pkg} import ")
        (tmp / f"{m}.py").write_text(text)
    package = types.ModuleType(pkg)
    package.__path__ = [str(tmp)]
    sys.modules[pkg] = package
    return types.SimpleNamespace(
        name=f"baseline {baseline}",
        **{m: importlib.import_module(f"{pkg}.{m}") for m in _MODULES},
    )


def build(n_prefill: int, n_blocks: int, rng: random.Random, impl=None):
    impl = impl or impl_here()
    P, E = impl.policy, impl.estimator
    s = P.Scheduler(P.PolicyConfig(policy="kvmesh", colocate_below_tokens=512), rng=rng)
    for i in range(n_prefill):
        s.prefill[f"p{i}"] = P.PrefillNodeState(
            f"p{i}",
            BS,
            block_nbytes=20 << 20,
            layer_nbytes=(20 << 20) // 80,
            model=E.PrefillModel(20, 0.05, 2e-6),
            bandwidth=20e6,
        )
    for i in range(max(2, n_prefill // 4)):
        s.decode[f"d{i}"] = P.DecodeNodeState(
            f"d{i}",
            BS,
            100_000,
            100_000,
            model=E.DecodeModel(20, 0.2, 1e-5),
            prefill_model=E.PrefillModel(20, 0.05, 2e-6),
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


def requests(chains: list[list[bytes]], n: int, rng: random.Random, impl=None) -> list:
    Request = (impl or impl_here()).policy.Request
    out = []
    for i in range(n):
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
        out.append(Request(f"r{i}", BLOCKS_PER_REQUEST * BS + 17, hashes, 256, 1e9, 1e9))
    return out


def book(s, r, d) -> None:
    """What a conductor does when a request completes: the node's report feeds the time
    model of the node that computed the prompt, the first token is booked with its TTFT
    and the node's own slot and queue times (here: as estimated), then the request's
    end."""
    c = d.estimate
    new, cached = r.n_tokens - c.cached_blocks * BS, c.cached_blocks * BS
    if d.route == "disaggregated":
        s.prefill[d.prefill_node].model.observe(new, cached, c.prefill_ms)
    else:
        s.decode[d.decode_node].prefill_model.observe(new, cached, c.prefill_ms)
    if _takes_node_times(type(s)):
        node_ms = c.prefill_ms + c.fetch_ms + c.handoff_ms
        s.prefill_done(
            r, d, new, cached, ttft_ms=c.ttft_ms, node_ms=node_ms, node_queue_ms=c.queue_ms
        )
    else:  # a version before the measured rate (issue 15 part 2)
        s.prefill_done(r, d, new, cached, ttft_ms=c.ttft_ms)
    s.request_done(r, d, 200)


@functools.cache
def _takes_node_times(scheduler: type) -> bool:
    try:
        return "node_ms" in inspect.signature(scheduler.prefill_done).parameters
    except ValueError:  # compiled (setup.py): no signature; only this tree's is compiled
        return True


def loop(s, reqs: list) -> tuple[float, list[int], int, float]:
    """The whole loop, GC on: wall seconds, each iteration's ns, the number accepted,
    and the CPU seconds the loop itself used (what foreign load on the core cannot
    inflate). A decision is dropped once booked, as a conductor drops it (kept, the
    20,000 decisions and their candidates would be walked by every full collection)."""
    pending: deque = deque()
    lat = []
    accepted = 0
    now = _now_ns
    gc.collect()
    cpu0 = time.thread_time()
    t_all = now()
    for r in reqs:
        t = now()
        d = s.decide(r)
        if d.accepted:
            accepted += 1
            s.commit(r, d)
            pending.append((r, d))
            if len(pending) > PENDING:
                book(s, *pending.popleft())
        lat.append(now() - t)
    return (now() - t_all) / 1e9, lat, accepted, time.thread_time() - cpu0


def decide_commit_only(s, reqs: list) -> list[int]:
    """The old headline's measure: decide + commit latencies alone, GC off (booking
    runs, untimed)."""
    pending: deque = deque()
    lat = []
    gc.collect()
    gc.disable()
    try:
        for r in reqs:
            t = time.perf_counter_ns()
            d = s.decide(r)
            if d.accepted:
                s.commit(r, d)
            lat.append(time.perf_counter_ns() - t)
            if d.accepted:
                pending.append((r, d))
                if len(pending) > PENDING:
                    book(s, *pending.popleft())
    finally:
        gc.enable()
    return lat


def _pct(sorted_ns: list[int], q: float) -> float:
    return sorted_ns[min(len(sorted_ns) - 1, int(len(sorted_ns) * q))] / 1000


def run(
    n_prefill: int, n_blocks: int, n_decisions: int, seed: int = 0, impl=None, old: bool = True
) -> dict:
    """One run: a fresh scheduler and index, the whole loop timed (the headline), then,
    with ``old``, a second fresh scheduler timed the old way."""
    impl = impl or impl_here()
    t0 = time.perf_counter()
    s, chains = build(n_prefill, n_blocks, random.Random(seed), impl)
    build_s = time.perf_counter() - t0
    reqs = requests(chains, n_decisions, random.Random(seed + 1), impl)
    # the generator's own lists of every indexed chain (10^6 hashes in 31,250 lists) are
    # no part of a conductor: dropped, so that the loop's full collections walk only
    # what a conductor holds (its index, the requests in flight, the decisions). Nor is
    # the generator's list of every request to come (20,000 requests and their lists of
    # hashes, made before the loop; a conductor holds only those in flight): frozen
    # (``gc.freeze``) with the scheduler as built, its collections then walk what the
    # loop allocates (the GC stays on)
    del chains
    gc.collect()
    gc.freeze()
    try:
        total, lat, accepted, cpu = loop(s, reqs)
    finally:
        gc.unfreeze()
    lat.sort()
    row = {
        "prefill_nodes": n_prefill,
        "decode_nodes": len(s.decode),
        "blocks": n_blocks,
        "decisions": n_decisions,
        "accepted": accepted,
        "decisions_per_s": n_decisions / total,
        "cpu_decisions_per_s": n_decisions / cpu if cpu > 0 else float("nan"),
        "p50_us": _pct(lat, 0.5),
        "p99_us": _pct(lat, 0.99),
        "max_us": lat[-1] / 1000,
        "build_s": build_s,
    }
    if old:
        s, chains = build(n_prefill, n_blocks, random.Random(seed), impl)
        reqs = requests(chains, n_decisions, random.Random(seed + 1), impl)
        old_lat = decide_commit_only(s, reqs)
        old_lat.sort()
        row["old_decide_commit_per_s"] = n_decisions / sum(old_lat) * 1e9
        row["old_p50_us"], row["old_p99_us"] = _pct(old_lat, 0.5), _pct(old_lat, 0.99)
    row["peak_rss_mib"] = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
    return row


MEDIANS = (
    "decisions_per_s",
    "cpu_decisions_per_s",
    "p50_us",
    "p99_us",
    "max_us",
    "old_decide_commit_per_s",
    "old_p50_us",
    "old_p99_us",
)


def _median_row(reps: list[dict]) -> dict:
    row = dict(reps[0])
    for k in MEDIANS:
        if k in row:
            row[k] = statistics.median(r[k] for r in reps)
    row["runs"] = len(reps)
    row["runs_decisions_per_s"] = [round(r["decisions_per_s"]) for r in reps]
    return row


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--quick", action="store_true", help="10^4 blocks only, fewer decisions")
    ap.add_argument("--decisions", type=int, default=20000)
    ap.add_argument("--runs", type=int, default=3, help="runs per row (the median is shown)")
    ap.add_argument("--nodes", default="8,64,256", help="prefill node counts")
    ap.add_argument("--blocks", default="10000,1000000", help="indexed block counts")
    ap.add_argument(
        "--baseline", help="a git revision or directory: its scheduler runs interleaved"
    )
    ap.add_argument("--out", type=Path, default=RESULTS / "conductor.json")
    ap.add_argument(
        "--note", default="", help="a paragraph for the results (what the versions are)"
    )
    args = ap.parse_args()
    try:
        core = sorted(os.sched_getaffinity(0))[0]
        os.sched_setaffinity(0, {core})
    except (AttributeError, OSError):
        core = None
    sizes = [10_000] if args.quick else [int(b) for b in args.blocks.split(",")]
    n = 2000 if args.quick else args.decisions
    runs = 1 if args.quick else args.runs
    impls = [impl_here()] + ([impl_from(args.baseline)] if args.baseline else [])
    load_before = os.getloadavg()
    print(f"one core ({core}); load average {load_before[0]:.2f}; median of {runs} run(s)")
    print(
        f"{'version':>20} {'prefill':>7} {'decode':>6} {'blocks':>9} {'decisions/s':>12} "
        f"{'p50 us':>8} {'p99 us':>8} {'goal':>6} {'CPU-s rate':>10} | {'old: d+c /s':>12} "
        f"{'p99 us':>8}"
    )
    rows = []
    for blocks in sizes:
        for nodes in [int(x) for x in args.nodes.split(",")]:
            reps: dict[str, list[dict]] = {i.name: [] for i in impls}
            for seed in range(runs):  # interleaved, run for run
                for impl in impls:
                    reps[impl.name].append(run(nodes, blocks, n, seed, impl))
            for impl in impls:
                row = _median_row(reps[impl.name])
                row["version"] = impl.name
                goal = ""
                if nodes == 64 and blocks == 1_000_000:
                    ok = row["decisions_per_s"] >= GOAL_RATE and row["p99_us"] <= GOAL_P99_US
                    goal = "met" if ok else "MISSED"
                row["goal"] = goal
                rows.append(row)
                print(
                    f"{impl.name[:20]:>20} {nodes:>7} {row['decode_nodes']:>6} {blocks:>9} "
                    f"{row['decisions_per_s']:>12,.0f} {row['p50_us']:>8.1f} "
                    f"{row['p99_us']:>8.1f} {goal:>6} {row['cpu_decisions_per_s']:>10,.0f} | "
                    f"{row['old_decide_commit_per_s']:>12,.0f} "
                    f"{row['old_p99_us']:>8.1f}",
                    flush=True,
                )
    load_after = os.getloadavg()
    args.out.parent.mkdir(parents=True, exist_ok=True)
    doc = {
        "rows": rows,
        "headline": "decisions_per_s, p50_us, p99_us: the whole loop (decide, commit, "
        "booking of completions), GC on, wall time, one core; cpu_decisions_per_s: the same "
        "loop over its own CPU time (thread_time), which time slices lost to foreign load "
        "on the core do not count",
        "secondary": "old_decide_commit_per_s, old_p50_us, old_p99_us: the old "
        "headline, decide + commit latencies alone, GC off",
        "note": f"median of {runs} run(s), one core; versions interleaved run for run",
        "load_average_1m": {"before": load_before[0], "after": load_after[0]},
        "cpus": os.cpu_count(),
    }
    if args.note:
        doc["comment"] = args.note
    args.out.write_text(json.dumps(doc, indent=2))
    args.out.with_suffix(".md").write_text(markdown(doc))
    print(f"load average {load_after[0]:.2f}; wrote {args.out} and its .md")


def markdown(doc: dict) -> str:
    """The results as a Markdown table: the headline first, the old measure after."""
    load = doc.get("load_average_1m", {})
    out = [
        "# Conductor decisions per second, one core",
        "",
        f"`python -m kvmesh.loadtest.bench_conductor`; {doc['note']}; load average (1 min) "
        f"{load.get('before', float('nan')):.2f} before, {load.get('after', float('nan')):.2f} "
        f"after, on {doc.get('cpus')} shared CPUs.",
        "",
        *([doc["comment"], ""] if doc.get("comment") else []),
        f"- **Headline**: {doc['headline']}.",
        f"- Secondary (for comparison only): {doc['secondary']}.",
        "",
        "| version | prefill | decode | blocks | **decisions/s** | p50 us | p99 us | goal "
        "| per CPU-second | old: decide+commit/s, GC off | old p99 us | runs (decisions/s) |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for r in doc["rows"]:
        out.append(
            f"| {r['version']} | {r['prefill_nodes']} | {r['decode_nodes']} | {r['blocks']:,} "
            f"| **{r['decisions_per_s']:,.0f}** | {r['p50_us']:.1f} | {r['p99_us']:.1f} "
            f"| {r['goal']} | {r.get('cpu_decisions_per_s', float('nan')):,.0f} "
            f"| {r.get('old_decide_commit_per_s', float('nan')):,.0f} "
            f"| {r.get('old_p99_us', float('nan')):.1f} "
            f"| {', '.join(f'{x:,}' for x in r['runs_decisions_per_s'])} |"
        )
    return "\n".join(out) + "\n"


if __name__ == "__main__":
    main()
