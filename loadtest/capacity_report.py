"""The report of :mod:`kvmesh.loadtest.capacity`: ``capacity.md`` and ``capacity_curves.png``
from ``capacity.json`` (``python -m kvmesh.loadtest.capacity_report DIR`` rebuilds them)."""

from __future__ import annotations

import json
import statistics
import sys
from pathlib import Path


def _fmt(x: float | None, nd: int = 2) -> str:
    return "-" if x is None else f"{x:.{nd}f}"


def headline(res: dict, workload: str) -> dict | None:
    """kvmesh's headline configuration (the one searched most often, then the best
    median) against colocated on ``workload``: the medians of
    their searches, the ratio, and whether kvmesh's lowest search beats colocated's
    highest (None without both)."""
    by: dict[str, list[float]] = {}
    for s in res["searches"]:
        if s["workload"] == workload:
            by.setdefault(s["config"], []).append(s["capacity_rps"])
    colo = by.get("colocated")
    kv = {k: v for k, v in by.items() if k.startswith("kvmesh-")}
    if not colo or not kv:
        return None
    # the pair that was searched again (the headline pair), else the best single search
    best = max(kv, key=lambda k: (len(kv[k]), statistics.median(kv[k])))
    c, k = statistics.median(colo), statistics.median(kv[best])
    return {
        "workload": workload,
        "kvmesh": best,
        "kvmesh_rps": k,
        "colocated_rps": c,
        "ratio": k / c if c else None,
        "searches": (len(kv[best]), len(colo)),
        "lowest_above_highest": min(kv[best]) > max(colo),
    }


def _cpu_rows(res: dict) -> list[str]:
    rows = [
        "| config | workload | node | CPU s (all probes) | budget s | max share of budget in a probe |",
        "|---|---|---|---|---|---|",
    ]
    for s in res["searches"]:
        tot: dict[str, list[float]] = {}
        for r in s["runs"]:
            for node, v in r.get("cpu", {}).items():
                t = tot.setdefault(node, [0.0, 0.0, 0.0])
                t[0] += v["seconds"]
                t[1] += v["budget_seconds"]
                t[2] = max(t[2], v["share_of_budget"])
        for node, (sec, bud, mx) in sorted(tot.items()):
            rows.append(
                f"| {s['config']} | {s['workload']} (rep {s['repeat']}) | {node} | "
                f"{sec:.1f} | {bud:.1f} | {100 * mx:.0f}% |"
            )
    return rows


def _q(xs: list[float], q: float) -> float | None:
    if not xs:
        return None
    xs = sorted(xs)
    return xs[min(len(xs) - 1, int(q * len(xs)))]


def _calibration(run: dict) -> str:
    """``ratio p50 / p90 / max | refused estimate p50 / min`` of one probe's records."""
    rows = run.get("ttft") or []
    ratios = [a / e for st, e, a in rows if st == "OK" and e and a]
    refused = [e for st, e, _ in rows if st == "RE" and e]
    return (
        f"{_fmt(_q(ratios, 0.5))} / {_fmt(_q(ratios, 0.9))} / "
        f"{_fmt(max(ratios) if ratios else None)} | "
        f"{_fmt(_q(refused, 0.5), 0)} / {_fmt(min(refused) if refused else None, 0)}"
    )


def render(res: dict) -> str:
    a = res["args"]
    out = [
        "# kvmesh capacity at equal compute",
        "",
        f"Created {res['created']}, {res.get('elapsed_s', 0) / 60:.0f} min. Command: "
        f"`python -m kvmesh.loadtest.capacity {_flags(a)}`.",
        "",
        "Budgets: "
        + "; ".join(f"{k}: {v}" for k, v in res["budgets"].items())
        + f". Model `{a['model']}` ({a['dtype']}), block {a['block_size']}, KV pool "
        f"{a['kv_memory']} per node, SLOs TTFT {a['ttft_slo_ms']:g} ms / TBT "
        f"{a['tbt_slo_ms']:g} ms. Capacity: the highest offered rate with >= 90% of the "
        f"offered requests inside both SLOs (refusals are misses); {a['probes']} probes "
        f"of {a['probe_requests']} requests per search.",
        "",
    ]
    if res.get("cut") or res.get("code"):
        out += [f"Where this run was cut: {res.get('cut', '-')} Code: {res.get('code', '-')}.", ""]
    c = res.get("costs") or {}
    if c:
        out += [
            f"Costs (one core, one thread; x1/{a['cpus']:g} at the budget): prefill "
            f"{c['prefill_ms_per_token']} ms per prompt token "
            f"({c.get('prefill_ms_per_token_at_budget')} at the budget), decode step "
            f"{c['decode_step_ms_b1']} ms at batch 1 / {c['decode_step_ms_b8']} ms at batch 8, "
            f"{c['kv_bytes_per_token']} KV bytes per token.",
            "",
        ]
    out += ["## Headline", ""]
    for w in ("trace", "shared", "long", "decode"):
        h = headline(res, w)
        if h is None:
            continue
        out.append(
            f"- **{w}**: {h['kvmesh']} {h['kvmesh_rps']:.2f} rps against colocated "
            f"{h['colocated_rps']:.2f} rps: **{_fmt(h['ratio'])}x** (medians of "
            f"{h['searches'][0]} and {h['searches'][1]} searches; kvmesh's lowest "
            f"{'above' if h['lowest_above_highest'] else 'NOT above'} colocated's highest)"
        )
    out += [
        "",
        "## Capacity by workload and configuration",
        "",
        "| workload | config | repeat | capacity rps | bracket (holds, misses) | predicted rps | probes (rate: inside) | first-gap p99 ms (max over probes) | valid |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for s in res["searches"]:
        probes = ", ".join(f"{p['rate']:.2f}: {100 * p['attainment']:.0f}%" for p in s["probes"])
        gaps = [
            (r["summary"].get("first_gap_ms") or {}).get("p99")
            for r in s["runs"]
            if (r["summary"].get("first_gap_ms") or {}).get("p99") is not None
        ]
        lo, hi = s["bracket"]
        out.append(
            f"| {s['workload']} | {s['config']} | {s['repeat']} | {s['capacity_rps']:.2f} | "
            f"{_fmt(lo)} - {_fmt(hi)} | {_fmt(s.get('predicted_rps'))} | {probes} | "
            f"{_fmt(max(gaps) if gaps else None, 0)} | {'yes' if s['valid'] else 'NO'} |"
        )
    refusals = []
    for s in res["searches"]:
        if not s["config"].startswith("kvmesh-"):
            continue
        for r in s["runs"]:
            sm = r["summary"]
            refusals.append(
                f"| {s['workload']} | {s['config']} | {r['rate']:.2f} | "
                f"{sm['rejected']}/{sm['requests']} | "
                f"{100 * (sm['slo_attainment_accepted'] or 0):.1f}% | "
                f"{_fmt((sm.get('reject_ms') or {}).get('p99'), 1)} | {_calibration(r)} |"
            )
    out += [
        "",
        "## Admission (kvmesh probes)",
        "",
        "The estimate's calibration per probe: actual / estimated TTFT of the accepted "
        "requests (p50, p90, max) and the estimates the refused ones were refused on "
        "(p50, min), against the TTFT SLO.",
        "",
        "| workload | config | rate | refused | accepted inside both SLOs | refusal p99 ms "
        "| accepted actual/estimate p50 / p90 / max | refused estimate p50 / min ms |",
        "|---|---|---|---|---|---|---|---|",
        *refusals,
        "",
        "## CPU against budget",
        "",
        *_cpu_rows(res),
        "",
        "Attainment curves: `capacity_curves.png`.",
    ]
    plans = res.get("plans") or {}
    if any(plans.values()):
        out += ["", "## Planner: predicted against measured", ""]
        out += ["| workload | config | predicted rps | measured rps |", "|---|---|---|---|"]
        for w, pl in plans.items():
            if not pl:
                continue
            for cfg, pred in (pl.get("predicted_rps") or {}).items():
                got = [
                    s["capacity_rps"]
                    for s in res["searches"]
                    if s["workload"] == w and s["config"] == cfg
                ]
                out.append(
                    f"| {w} | {cfg} | {_fmt(pred)} | "
                    f"{_fmt(statistics.median(got) if got else None)} |"
                )
            out.append(f"| {w} | **pick** | {pl.get('pick')} | |")
    return "\n".join(out) + "\n"


def plot(res: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    ws = sorted({s["workload"] for s in res["searches"]})
    if not ws:
        return
    fig, axes = plt.subplots(1, len(ws), figsize=(5 * len(ws), 4), squeeze=False)
    for ax, w in zip(axes[0], ws, strict=True):
        for s in res["searches"]:
            if s["workload"] != w:
                continue
            pts = sorted((p["rate"], p["attainment"]) for p in s["probes"])
            ax.plot(
                [x for x, _ in pts],
                [100 * y for _, y in pts],
                marker="o",
                label=f"{s['config']} r{s['repeat']}",
            )
        ax.axhline(90, color="grey", linestyle="--", linewidth=0.8)
        ax.set_title(w)
        ax.set_xlabel("offered rate (rps)")
        ax.set_ylabel("offered requests inside both SLOs (%)")
        ax.set_xscale("log")
        ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def write_report(out: Path) -> str:
    res = json.loads((out / "capacity.json").read_text())
    text = render(res)
    (out / "capacity.md").write_text(text)
    try:
        plot(res, out / "capacity_curves.png")
    except ImportError:  # matplotlib is the loadtest extra
        pass
    return text


if __name__ == "__main__":
    print(write_report(Path(sys.argv[1] if len(sys.argv) > 1 else ".")))


def _flags(a: dict) -> str:
    """The command line's flags that select what ran (the rest: the report's figures)."""
    out = ["--quick"] if a.get("quick") else []
    for k in ("phases", "workloads", "configs"):
        if a.get(k) and (k != "phases" or a[k] != "costs,plan,sweep,others,repeat"):
            out.append(f"--{k} {a[k]}")
    return " ".join([*out, f"--out {a['out']}"])
