"""report.md + PNG plots from ``real.json`` (loadtest.run) and ``sim.json`` (loadtest.sim).

python -m kvmesh.loadtest.report [results-dir]
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

from kvmesh.loadtest.metrics import ratio

RESULTS = Path(__file__).resolve().parent / "results"
PAPER_TTFT_S = {"random": 19.65, "load": 5.27, "cache": 3.58, "kvmesh": 3.07}
PAPER_NAMES = {
    "random": "random",
    "load": "load-balancing",
    "cache": "local cache-aware",
    "cache-load": "(cache+load, local)",
    "kvmesh": "global cache-aware",
}


def _plt():
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def _f(x, nd=1, pct=False):
    if x is None:
        return "–"
    if pct:
        return f"{100 * x:.{nd}f}%"
    return f"{x:.{nd}f}" if isinstance(x, float) else str(x)


def _cdf(ax, xs, label):
    xs = sorted(x for x in xs if x is not None)
    if not xs:
        return
    ax.plot(xs, [(i + 1) / len(xs) for i in range(len(xs))], label=label)


def real_section(real: dict, out: Path) -> list[str]:
    runs = real["runs"]
    a = real.get("args", {})
    lines = [
        "## Real cluster: baselines side by side",
        "",
        f"`tiny` model, byte tokens, block size {a.get('block_size')}, KV pool "
        f"{a.get('kv_memory')} per node, store segment {a.get('segment_memory')} (kvmesh "
        f"only); SLOs TTFT {a.get('ttft_slo_ms'):.0f} ms, mean TBT "
        f"{a.get('tbt_slo_ms'):.0f} ms (the same client-side thresholds for every "
        f"config). Machine: {real.get('machine', {}).get('cpus')} CPU cores, shared. "
        f"Trace: first {a.get('requests')} requests of `{Path(a.get('trace', '')).name}`, "
        f"512-token blocks -> {a.get('block_tokens')} tokens, inputs capped at "
        f"{a.get('max_input')}; agentic: {a.get('sessions')} sessions of 30+ turns.",
        "",
    ]
    workloads = list(dict.fromkeys(r["workload"] for r in runs))
    configs = list(dict.fromkeys(r["config"] for r in runs))
    lines += [
        "| workload | config | served/sent | TTFT p50 / p90 / p99 ms | TBT p50 / p90 / p99 ms "
        "| SLO attained | goodput rps | cache hit | prompt tokens computed | bytes moved "
        "(handoff / store get / put) MB | transfer s | late hits | routes |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for r in runs:
        s = r["summary"]
        t, b = s["ttft_ms"], s["tbt_ms"]
        dp = s.get("data_plane", {})
        bm = dp.get("bytes_moved", {})
        late = sum(dp.get("late_hits", {}).values()) if dp.get("late_hits") else 0
        computed = (
            sum(v["computed"] for v in s.get("per_node", {}).values()) or s["computed_tokens"]
        )
        lines.append(
            f"| {r['workload']} | {r['config']} | {s['served']}/{s['requests']} | "
            f"{_f(t['p50'], 0)} / {_f(t['p90'], 0)} / {_f(t['p99'], 0)} | "
            f"{_f(b['p50'], 1)} / {_f(b['p90'], 1)} / {_f(b['p99'], 1)} | "
            f"{_f(s['slo_attainment'], 1, True)} | {_f(s['goodput_rps'], 2)} | "
            f"{_f(s['cache_hit_ratio'], 1, True)} | {computed} | "
            f"{bm.get('handoff', 0) / 1e6:.1f} / {bm.get('store_get', 0) / 1e6:.1f} / "
            f"{bm.get('store_put', 0) / 1e6:.1f} | "
            f"{sum(dp.get('transfer_seconds', {}).values()):.2f} | {late:.0f} | "
            f"{', '.join(f'{k} {v}' for k, v in s['routes'].items())} |"
        )
    # ratios
    lines += [
        "",
        "### Ratios (kvmesh / baseline; TTFT and computed tokens: lower is better, "
        "goodput and SLO attainment: higher is better)",
        "",
        "| workload | baseline | TTFT p50 | TTFT p90 | goodput | SLO attainment | "
        "prompt tokens computed |",
        "|---|---|---|---|---|---|---|",
    ]
    for w in workloads:
        by = {r["config"]: r["summary"] for r in runs if r["workload"] == w}
        k = by.get("kvmesh")
        if not k:
            continue
        for base in ("colocated", "disagg-nostore"):
            s = by.get(base)
            if not s:
                continue
            ck = sum(v["computed"] for v in k.get("per_node", {}).values())
            cb = sum(v["computed"] for v in s.get("per_node", {}).values())
            lines.append(
                f"| {w} | {base} | {_f(ratio(k['ttft_ms']['p50'], s['ttft_ms']['p50']), 2)} | "
                f"{_f(ratio(k['ttft_ms']['p90'], s['ttft_ms']['p90']), 2)} | "
                f"{_f(ratio(k['goodput_rps'], s['goodput_rps']), 2)} | "
                f"{_f(ratio(k['slo_attainment'], s['slo_attainment']), 2)} | "
                f"{_f(ratio(ck, cb), 2)} |"
            )
    # plots
    plt = _plt()
    fig, axes = plt.subplots(1, len(workloads), figsize=(4.2 * len(workloads), 3.4), squeeze=False)
    for ax, w in zip(axes[0], workloads):
        for r in runs:
            if r["workload"] == w:
                _cdf(
                    ax,
                    [x.get("ttft_ms") for x in r["records"] if x.get("status") == "OK"],
                    r["config"],
                )
        ax.set_xscale("log")
        ax.set_title(w, fontsize=9)
        ax.set_xlabel("TTFT (ms)")
        ax.axvline(a.get("ttft_slo_ms", 0), color="grey", ls=":", lw=1)
        ax.grid(alpha=0.3)
    axes[0][0].set_ylabel("CDF (served requests)")
    axes[0][0].legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(out / "ttft_cdf.png", dpi=90)
    plt.close(fig)
    lines += ["", "![TTFT CDF per configuration](ttft_cdf.png)", ""]
    trace_runs = [r for r in runs if r.get("time_scale")]
    if trace_runs:
        fig, ax = plt.subplots(figsize=(5, 3.4))
        for c in configs:
            pts = sorted(
                (r["summary"]["offered_rps"], r["summary"]["goodput_rps"])
                for r in trace_runs
                if r["config"] == c
            )
            if pts:
                ax.plot([p[0] for p in pts], [p[1] for p in pts], marker="o", label=c)
        lim = max(r["summary"]["offered_rps"] or 0 for r in trace_runs)
        ax.plot([0, lim], [0, lim], color="grey", ls=":", lw=1, label="offered")
        ax.set_xlabel("offered load (requests/s)")
        ax.set_ylabel("goodput (requests/s inside SLOs)")
        ax.set_title("scaled Mooncake trace", fontsize=9)
        ax.grid(alpha=0.3)
        ax.legend(fontsize=7)
        fig.tight_layout()
        fig.savefig(out / "goodput_vs_load.png", dpi=90)
        plt.close(fig)
        lines += ["![goodput against offered load](goodput_vs_load.png)", ""]
    return lines


def sim_section(sim: dict, out: Path) -> list[str]:
    lines = ["## Simulator: paper scale, the real policy code", "", sim.get("description", ""), ""]
    for exp in sim.get("experiments", []):
        lines += [
            f"### {exp['title']}",
            "",
            exp.get("setup", ""),
            "",
            "| policy | served/sent | rejected | TTFT mean s | TTFT p50 / p90 / p99 s | "
            "TBT mean ms | SLO attained | goodput rps | cache hit | prefill tokens avoided "
            "| store bytes read GB | paper avg TTFT s |",
            "|---|---|---|---|---|---|---|---|---|---|---|---|",
        ]
        for pol, s in exp["policies"].items():
            t = s["ttft_ms"]
            paper = PAPER_TTFT_S.get(pol) if exp.get("compare_paper") else None
            lines.append(
                f"| {pol} | {s['served']}/{s['requests']} | {s['rejected']} | "
                f"{_f(t['mean'] / 1000 if t['mean'] is not None else None, 2)} | "
                f"{_f(t['p50'] / 1000 if t['p50'] is not None else None, 2)} / "
                f"{_f(t['p90'] / 1000 if t['p90'] is not None else None, 2)} / "
                f"{_f(t['p99'] / 1000 if t['p99'] is not None else None, 2)} | "
                f"{_f(s['tbt_ms']['mean'], 1)} | {_f(s['slo_attainment'], 1, True)} | "
                f"{_f(s['goodput_rps'], 2)} | {_f(s['cache_hit_ratio'], 1, True)} | "
                f"{s['prefill_tokens_avoided']:,} | {s.get('store_bytes_read', 0) / 1e9:.0f} | "
                f"{_f(paper, 2) + ' (' + PAPER_NAMES[pol] + ')' if paper else '–'} |"
            )
        if exp.get("plot"):
            lines += ["", f"![{exp['title']}]({exp['plot']})", ""]
        if exp.get("notes"):
            lines += ["", exp["notes"], ""]
    if (out / "sim_ttft_cdf.png").exists():
        lines += ["![simulated TTFT CDF under overload](sim_ttft_cdf.png)", ""]
    if sim.get("scale"):
        sc = sim["scale"]
        lines += [
            "### Conductor decision rate at scale",
            "",
            f"{sc['prefill']} prefill + {sc['decode']} decode simulated nodes, policy "
            f"`{sc['policy']}`: {sc['decisions']} decisions (decide + commit + done) in "
            f"{sc['seconds']:.2f} s = **{sc['per_s']:.0f} decisions/s** on one core "
            f"({1000 / sc['per_s']:.2f} ms each).",
            "",
        ]
    return lines


def write_report(out: Path = RESULTS) -> str:
    out = Path(out)
    lines = [
        "# kvmesh evaluation",
        "",
        "Reproduce: `python -m kvmesh.loadtest` (the realistic evaluation, `eval.json`; "
        "`--quick` for a short one), `python -m kvmesh.loadtest.run` (the older `tiny` "
        "baselines, `real.json`, shown only without `eval.json`) and "
        "`python -m kvmesh.loadtest.sim` (simulator, `sim.json`). See `loadtest/README.md`.",
        "",
    ]
    eval_p, real_p, sim_p = out / "eval.json", out / "real.json", out / "sim.json"
    if eval_p.exists():
        from kvmesh.loadtest.eval_report import eval_section

        lines += eval_section(json.loads(eval_p.read_text()), out)
    elif real_p.exists():
        lines += real_section(json.loads(real_p.read_text()), out)
    if sim_p.exists():
        lines += sim_section(json.loads(sim_p.read_text()), out)
    path = out / "report.md"
    # the calibrated simulator's section (python -m kvmesh.loadtest.sim.paper) is kept
    from kvmesh.loadtest.sim.paper import MARK_BEGIN, MARK_END

    before = path.read_text() if path.exists() else ""
    if MARK_BEGIN in before and MARK_END in before:
        a, b = before.index(MARK_BEGIN), before.index(MARK_END) + len(MARK_END)
        lines += ["", before[a:b]]
    extra = out / "notes.md"
    if extra.exists():
        lines += ["", extra.read_text()]
    path.write_text("\n".join(lines) + "\n")
    return str(path)


if __name__ == "__main__":
    print(write_report(Path(sys.argv[1]) if len(sys.argv) > 1 else RESULTS))
