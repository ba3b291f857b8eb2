"""Several whole evaluations side by side: ``python -m kvmesh.loadtest --runs 3`` (or
``python -m kvmesh.loadtest.eval_runs DIR DIR ...`` over runs already made).

One evaluation's headline rests on one knee: colocated's, found by a few single-run
probes, and on a machine whose speed moves between runs more than most changes do. Each
run here is a whole evaluation (its own knee, its own repeats at 1x); this module reads
their ``eval.json`` files and writes ``runs.md`` and ``runs.json``: per run and as the
median over runs, the goals' figures (kvmesh against colocated at colocated's knee, the
capacity at 90% inside both SLOs, admission's word and speed, the agentic sessions).
"""

from __future__ import annotations

import argparse
import json
import statistics
from pathlib import Path

from kvmesh.loadtest.eval_report import (
    _LATE,
    GOALS,
    accepted_inside,
    capacity,
    headline,
    kvmesh_refusals,
)
from kvmesh.loadtest.metrics import quantile, ratio

WORKLOADS = ("trace", "shared")


def figures(ev: dict) -> dict:
    """The goals' figures of one evaluation (``eval.json``)."""
    out: dict = {"created": ev.get("created"), "knee": {}}
    for w in WORKLOADS:
        out["knee"][w] = (ev.get("knee", {}).get(w) or {}).get("knee_rps")
        h = {r["config"]: r for r in headline(ev, w)}
        k = h.get("kvmesh")
        if k is not None:
            out[w] = {
                "goodput_x": k["goodput_x"],
                "ttft_p90_x": k["ttft_p90_x"],
                "tbt_p99_x": k["tbt_p99_x"],
            }
            ck, cc = capacity(ev, w, "kvmesh"), capacity(ev, w, "colocated")
            out[w]["capacity_x"] = ratio(ck["rps"], cc["rps"]) if ck and cc else None
    out["accepted_ok_min"] = min((x for x, _ in accepted_inside(ev)), default=None)
    # admission's own refusals, as the report counts them (the later ones apart)
    refused = [x["error_ms"] for x in kvmesh_refusals(ev) if x.get("reject_reason") not in _LATE]
    out["reject_p99_ms"] = quantile(refused, 0.99) if refused else None
    for r in ev["runs"]:
        if r.get("workload") == "agentic":
            s = r["summary"]
            out.setdefault("agentic_served", {})[r["config"]] = (s["served"], s["requests"])
    return out


def _med(xs: list) -> float | None:
    xs = [x for x in xs if x is not None]
    return statistics.median(xs) if xs else None


def summarize(runs: list[dict]) -> dict:
    """Per-run figures and their medians over runs."""
    figs = [figures(ev) for ev in runs]
    med: dict = {}
    for w in WORKLOADS:
        med[w] = {
            k: _med([f.get(w, {}).get(k) for f in figs])
            for k in ("goodput_x", "ttft_p90_x", "tbt_p99_x", "capacity_x")
        }
    med["accepted_ok_min"] = min(
        (f["accepted_ok_min"] for f in figs if f["accepted_ok_min"] is not None), default=None
    )
    med["reject_p99_ms"] = _med([f["reject_p99_ms"] for f in figs])
    return {"runs": figs, "median": med}


def _x(v: float | None) -> str:
    return "–" if v is None else f"{v:.2f}x"


def markdown(summary: dict) -> str:
    figs, med = summary["runs"], summary["median"]
    lines = [
        "# kvmesh evaluation: whole runs side by side",
        "",
        f"{len(figs)} whole evaluations (`python -m kvmesh.loadtest`), each with its own "
        "colocated knee and its own repeats at 1x; kvmesh against colocated at "
        "colocated's knee, and the capacity at 90% of all requests inside both SLOs. The "
        "last row is the median over runs.",
        "",
    ]
    for w in WORKLOADS:
        lines += [
            f"## {w}",
            "",
            "| run | knee rps | goodput x | TTFT p90 x | TBT p99 x | capacity x |",
            "|---|---|---|---|---|---|",
        ]
        for i, f in enumerate(figs, 1):
            g = f.get(w, {})
            knee = f["knee"].get(w)
            lines.append(
                f"| {i} ({f['created']}) | {knee if knee is not None else '–'} | "
                f"{_x(g.get('goodput_x'))} | {_x(g.get('ttft_p90_x'))} | "
                f"{_x(g.get('tbt_p99_x'))} | {_x(g.get('capacity_x'))} |"
            )
        m = med[w]
        lines.append(
            f"| median | | {_x(m['goodput_x'])} | {_x(m['ttft_p90_x'])} | "
            f"{_x(m['tbt_p99_x'])} | {_x(m['capacity_x'])} |"
        )
        lines.append("")
    lines += [
        f"Goals: goodput and capacity >= {GOALS['goodput_x']}x, TTFT p90 <= 1x, TBT p99 <= "
        f"{GOALS['tbt_p99_x']}x, >= {100 * GOALS['accepted_ok']:.0f}% of accepted requests "
        "inside both SLOs in every kvmesh run, admission's refusals within 50 ms at p99.",
        "",
        "| run | worst kvmesh run: accepted inside both SLOs | admission refusals p99 ms | "
        "agentic served (kvmesh / colocated) |",
        "|---|---|---|---|",
    ]
    for i, f in enumerate(figs, 1):
        ag = f.get("agentic_served", {})
        k, c = ag.get("kvmesh"), ag.get("colocated")
        ok, p99 = f["accepted_ok_min"], f["reject_p99_ms"]
        lines.append(
            f"| {i} | {'–' if ok is None else format(100 * ok, '.1f') + '%'} | "
            f"{'–' if p99 is None else format(p99, '.1f')} | "
            f"{'–' if not k else f'{k[0]}/{k[1]}'} / {'–' if not c else f'{c[0]}/{c[1]}'} |"
        )
    return "\n".join(lines) + "\n"


def write(dirs: list[Path], out: Path) -> str:
    runs = [json.loads((d / "eval.json").read_text()) for d in dirs]
    summary = summarize(runs)
    out.mkdir(parents=True, exist_ok=True)
    (out / "runs.json").write_text(json.dumps(summary, indent=1) + "\n")
    text = markdown(summary)
    (out / "runs.md").write_text(text)
    return text


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(
        prog="python -m kvmesh.loadtest.eval_runs",
        description="medians over whole evaluations (directories holding eval.json)",
    )
    p.add_argument("dirs", nargs="+")
    p.add_argument(
        "--out", default="", help="where runs.md/runs.json go (default: the first dir's parent)"
    )
    a = p.parse_args(argv)
    dirs = [Path(d) for d in a.dirs]
    print(write(dirs, Path(a.out) if a.out else dirs[0].parent))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
