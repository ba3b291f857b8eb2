"""The evaluation's section of report.md and its figures, from ``eval.json`` (loadtest.eval).

Headline numbers are taken at 1x the colocated knee (the load where colocated still has
90% of its requests inside both SLOs), medians over the repeats of that point.
"""

from __future__ import annotations

import statistics
from pathlib import Path

from kvmesh.loadtest.metrics import quantile, ratio

CONFIG_ORDER = ("colocated", "disagg-nostore", "kvmesh")
GOALS = {"goodput_x": 1.4, "tbt_p99_x": 0.5, "accepted_ok": 0.99}


# refusals that come after admission, by design: a prefill node's deadline, a request
# admitted to wait for KV room whose room did not free in time, a decode node that no
# longer held the prefix the estimate counted on
_LATE = ("deadline", "wait", "evicted")


def _plt():
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def _f(x, nd: int = 1, pct: bool = False) -> str:
    if x is None:
        return "–"
    if pct:
        return f"{100 * x:.{nd}f}%"
    return f"{x:.{nd}f}"


def _med(xs: list) -> float | None:
    xs = [x for x in xs if x is not None]
    return statistics.median(xs) if xs else None


def point(runs: list[dict]) -> dict:
    """Median over repeated runs of one (config, workload, load) point."""
    s = [r["summary"] for r in runs]
    return {
        "n": len(runs),
        # the rate the load generator offered (arrivals), not served / duration
        "offered_rps": _med([r.get("rate_rps") for r in runs]),
        "goodput_rps": _med([x["goodput_rps"] for x in s]),
        "ttft_p50": _med([x["ttft_ms"]["p50"] for x in s]),
        "ttft_p90": _med([x["ttft_ms"]["p90"] for x in s]),
        "ttft_p99": _med([x["ttft_ms"]["p99"] for x in s]),
        "tbt_p50": _med([x["tbt_ms"]["p50"] for x in s]),
        "tbt_p99": _med([x["tbt_ms"]["p99"] for x in s]),
        "attained": _med([x["slo_attainment"] for x in s]),
        "accepted_ok": _med([x["slo_attainment_accepted"] for x in s]),
        "acceptance": _med([x["acceptance_rate"] for x in s]),
        "hit": _med([x["cache_hit_ratio"] for x in s]),
        "served": _med([x["served"] for x in s]),
        "requests": _med([x["requests"] for x in s]),
        "rejected": _med([x["rejected"] for x in s]),
        "failed": _med([x["failed"] for x in s]),
        "routes": s[0].get("routes", {}),
        "computed": _med([x.get("node_tokens", {}).get("computed") for x in s]),
        "fetched": _med([x.get("node_tokens", {}).get("fetched_store") for x in s]),
    }


def points(ev: dict, workload: str) -> dict[tuple[str, float], dict]:
    by: dict[tuple[str, float], list[dict]] = {}
    for r in ev["runs"]:
        if r.get("workload") == workload:
            by.setdefault((r["config"], r.get("load_x")), []).append(r)
    return {k: point(v) for k, v in by.items()}


def headline(ev: dict, workload: str) -> list[dict]:
    """kvmesh and disagg-nostore against colocated at 1x its knee."""
    pts = points(ev, workload)
    base = pts.get(("colocated", 1.0))
    out = []
    for c in CONFIG_ORDER:
        p = pts.get((c, 1.0))
        if not p:
            continue
        out.append(
            {
                "config": c,
                **p,
                "goodput_x": ratio(p["goodput_rps"], base["goodput_rps"]) if base else None,
                "ttft_p90_x": ratio(p["ttft_p90"], base["ttft_p90"]) if base else None,
                "tbt_p99_x": ratio(p["tbt_p99"], base["tbt_p99"]) if base else None,
            }
        )
    return out


def capacity(ev: dict, workload: str, config: str, target: float = 0.9) -> dict | None:
    """The highest offered rate at which ``target`` of all requests (rejected ones
    included) meet both SLOs: DistServe's *goodput* and Mooncake's *effective request
    capacity*. Linear between the two sweep points that straddle ``target``; when every
    point attains it, the highest load is a lower bound (``bracketed`` False)."""
    pts = sorted(
        (x, p)
        for (c, x), p in points(ev, workload).items()
        if c == config and x is not None and p["attained"] is not None and p["offered_rps"]
    )
    if not pts or pts[0][1]["attained"] < target:
        return None
    lo = pts[0]
    for hi in pts[1:]:
        if hi[1]["attained"] < target:
            (x0, p0), (x1, p1) = lo, hi
            a0, a1 = p0["attained"], p1["attained"]
            f = (a0 - target) / (a0 - a1)
            r0, r1 = p0["offered_rps"], p1["offered_rps"]
            return {"rps": r0 + f * (r1 - r0), "load_x": x0 + f * (x1 - x0), "bracketed": True}
        lo = hi
    return {"rps": lo[1]["offered_rps"], "load_x": lo[0], "bracketed": False}


def _capacity_lines(ev: dict) -> list[str]:
    lines = []
    for w in ("trace", "shared"):
        c = capacity(ev, w, "colocated")
        k = capacity(ev, w, "kvmesh")
        if not (c and k):
            continue
        x = k["rps"] / c["rps"]
        bound = "" if k["bracketed"] else ">= "
        met = x >= GOALS["goodput_x"]
        lines.append(
            f"- {w}, capacity at 90% of requests inside both SLOs (the goodput of DistServe "
            f"and Mooncake's effective request capacity, read off the load sweep): kvmesh "
            f"{bound}{_f(k['rps'], 2)} rps ({bound}{k['load_x']:.2f}x the knee"
            f"{'' if k['bracketed'] else ', every point swept attains it'}) vs colocated "
            f"{_f(c['rps'], 2)} rps ({c['load_x']:.2f}x) = {bound}{x:.2f}x "
            f"(goal >= {GOALS['goodput_x']}x: {'**wins**' if met else '**loses**'})."
        )
    return lines


def accepted_inside(ev: dict) -> list[tuple[float, str]]:
    """(share of accepted requests inside both SLOs, label) of each kvmesh run of the
    workloads (the cache sweep apart): admission's word."""
    return [
        (r["summary"]["slo_attainment_accepted"], r["label"])
        for r in ev["runs"]
        if r["config"] == "kvmesh"
        and r.get("workload") in ("trace", "shared", "agentic")
        and r["summary"]["slo_attainment_accepted"] is not None
    ]


def kvmesh_refusals(ev: dict) -> list[dict]:
    """The records of every kvmesh run's refused requests (RESOURCE_EXHAUSTED, timed)."""
    return [
        x
        for r in ev["runs"]
        if r["config"] == "kvmesh"
        for x in r["records"]
        if x.get("status") == "RESOURCE_EXHAUSTED" and x.get("error_ms")
    ]


def _verdicts(ev: dict) -> list[str]:
    """Plain sentences: each goal, met or not, with the numbers."""
    lines = []
    for w in ("trace", "shared"):
        hl = {h["config"]: h for h in headline(ev, w)}
        k, c = hl.get("kvmesh"), hl.get("colocated")
        if not (k and c):
            continue
        name = {"trace": "Mooncake trace", "shared": "shared prefix"}[w]
        gx, tx, bx = k["goodput_x"], k["ttft_p90_x"], k["tbt_p99_x"]

        def verdict(ok: bool | None) -> str:
            return "–" if ok is None else ("**wins**" if ok else "**loses**")

        lines.append(
            f"- {name}, at colocated's 90% load ({_f(c['offered_rps'], 2)} rps offered): "
            f"goodput {_f(k['goodput_rps'], 2)} vs {_f(c['goodput_rps'], 2)} rps = "
            f"{_f(gx, 2)}x (goal >= {GOALS['goodput_x']}x: "
            f"{verdict(None if gx is None else gx >= GOALS['goodput_x'])}); "
            f"TTFT p90 {_f(k['ttft_p90'], 0)} vs {_f(c['ttft_p90'], 0)} ms = {_f(tx, 2)}x "
            f"(goal <= 1: {verdict(None if tx is None else tx <= 1.0)}); "
            f"TBT p99 {_f(k['tbt_p99'], 0)} vs {_f(c['tbt_p99'], 0)} ms = {_f(bx, 2)}x "
            f"(goal <= {GOALS['tbt_p99_x']}x: "
            f"{verdict(None if bx is None else bx <= GOALS['tbt_p99_x'])}); "
            f"kvmesh accepted {_f(k['acceptance'], 0, True)} and "
            f"{_f(k['accepted_ok'], 1, True)} of those met both SLOs."
        )
    lines += _capacity_lines(ev)
    worst = accepted_inside(ev)
    if worst:
        lo = min(worst)
        n_ok = sum(1 for x, _ in worst if x >= GOALS["accepted_ok"])
        lines.append(
            f"- Admission: {n_ok} of {len(worst)} kvmesh runs kept >= 99% of accepted "
            f"requests inside both SLOs; the worst was {_f(lo[0], 1, True)} ({lo[1]})."
        )
    refusals = kvmesh_refusals(ev)
    # refused by admission, at once; a prefill node's refusal of a queued request that
    # could no longer make its deadline (reason "deadline") comes later by design, as do
    # those of requests admitted to wait for KV room whose room did not free in time
    # ("wait") and those whose decode node, at Reserve, no longer held the prefix their
    # estimate counted on ("evicted"; after a wait for room, as late as that)
    refused = [x["error_ms"] for x in refusals if x.get("reject_reason") not in _LATE]
    late = [x["error_ms"] for x in refusals if x.get("reject_reason") == "deadline"]
    after = [x for x in refusals if x.get("reject_reason") in ("wait", "evicted")]
    if refused:
        p99 = quantile(refused, 0.99)
        lines.append(
            f"- Refusals by admission: {len(refused)} in all kvmesh runs, answered in "
            f"{_f(quantile(refused, 0.5), 1)} ms at p50 and {_f(p99, 1)} ms at p99 (goal: "
            f"within 50 ms at p99: {'met' if p99 is not None and p99 <= 50 else 'not met'})."
        )
    if late:
        lines.append(
            f"- Refused from a prefill queue (reason deadline: the node ran slower than "
            f"estimated and the request could no longer meet its TTFT SLO; nothing computed): "
            f"{len(late)}, answered in {_f(quantile(late, 0.5), 0)} ms at p50 and "
            f"{_f(quantile(late, 0.99), 0)} ms at p99."
        )
    if after:
        ms = [x["error_ms"] for x in after]
        waits = sum(1 for x in after if x.get("reject_reason") == "wait")
        lines.append(
            f"- Refused after admission, at the decode node: {len(after)} ({waits} admitted to "
            f"wait for KV room that did not free within the wait their TTFT SLO left, reason "
            f"wait; {len(after) - waits} whose decode node no longer held the prefix their "
            f"estimate counted on, reason evicted), answered in {_f(quantile(ms, 0.5), 0)} ms "
            f"at p50 and {_f(quantile(ms, 0.99), 0)} ms at p99."
        )
    return lines


def _dtype_note(ev: dict) -> str:
    """Why the dtype used, from the measured costs."""
    by = {(c["model"], c["dtype"]): c for c in ev.get("costs", [])}
    f32, b16 = by.get(("medium", "float32")), by.get(("medium", "bfloat16"))
    small = by.get(("small", "bfloat16"))
    out = []
    if f32 and b16:
        x = b16["prefill_ms_per_token"] / f32["prefill_ms_per_token"]
        out.append(
            f"This CPU has no native bfloat16 (AVX2). In this run `medium` in bfloat16 "
            f"prefilled in {x:.2f}x the float32 time (the engine widens bfloat16 products to "
            "float32 on such CPUs, `KVMESH_BF16_UPCAST`); the evaluation was set up in "
            "float32 when bfloat16 measured 1.8-6x slower here, and keeps it (never "
            "float16). bfloat16 would halve the KV bytes per token, so a pool of the same "
            "size would hold twice the tokens."
        )
    if small:
        out.append(
            f"`small` in bfloat16 costs {small['prefill_ms_per_token']} ms per prompt token "
            "here: on two cores it would leave time for only a handful of requests."
        )
    return " ".join(out)


def _table_costs(ev: dict) -> list[str]:
    lines = [
        "| model | dtype | parameters | compute per prompt token | decode step, batch 1 / 8 "
        "| KV bytes per token | fetching beats recomputing above |",
        "|---|---|---|---|---|---|---|",
    ]
    for c in ev.get("costs", []):
        lines.append(
            f"| `{c['model']}`{' (used)' if c.get('used') else ''} | {c['dtype']} | "
            f"{c['params_m']} M | "
            f"{c['prefill_ms_per_token']} ms | {c['decode_step_ms_b1']} / "
            f"{c['decode_step_ms_b8']} ms | {c['kv_bytes_per_token']:,} B | "
            f"{c['breakeven_gbps'] * 1000:.1f} MB/s |"
        )
    return lines


def _sweep_rows(ev: dict, w: str) -> list[str]:
    pts = points(ev, w)
    lines = [
        "| load (x knee) | config | offered rps | served/sent | rejected | TTFT p50 / p90 / "
        "p99 ms | TBT p50 / p99 ms | inside SLO (all) | inside SLO (accepted) | goodput rps "
        "| hit | prompt tokens computed | runs |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for x in sorted({k[1] for k in pts if k[1] is not None}):
        for c in CONFIG_ORDER:
            p = pts.get((c, x))
            if not p:
                continue
            lines.append(
                f"| {x:g} | {c} | {_f(p['offered_rps'], 2)} | {_f(p['served'], 0)}/"
                f"{_f(p['requests'], 0)} | {_f(p['rejected'], 0)} | {_f(p['ttft_p50'], 0)} / "
                f"{_f(p['ttft_p90'], 0)} / {_f(p['ttft_p99'], 0)} | {_f(p['tbt_p50'], 0)} / "
                f"{_f(p['tbt_p99'], 0)} | {_f(p['attained'], 1, True)} | "
                f"{_f(p['accepted_ok'], 1, True)} | {_f(p['goodput_rps'], 2)} | "
                f"{_f(p['hit'], 0, True)} | {_f(p['computed'], 0)} | {p['n']} |"
            )
    return lines


def _plot_sweep(ev: dict, out: Path, plt) -> list[str]:
    ws = [w for w in ("trace", "shared") if points(ev, w)]
    if not ws:
        return []
    fig, axes = plt.subplots(3, len(ws), figsize=(4.6 * len(ws), 9), squeeze=False)
    for j, w in enumerate(ws):
        pts = points(ev, w)
        for c in CONFIG_ORDER:
            xs = sorted(x for (cc, x) in pts if cc == c and x is not None)
            if not xs:
                continue
            off = [pts[(c, x)]["offered_rps"] for x in xs]
            for i, key in enumerate(("goodput_rps", "ttft_p90", "tbt_p99")):
                axes[i][j].plot(off, [pts[(c, x)][key] for x in xs], marker="o", label=c)
        a = ev["setup"]
        axes[0][j].set_title({"trace": "Mooncake trace", "shared": "shared prefix"}[w])
        axes[0][j].set_ylabel("goodput (req/s inside both SLOs)")
        axes[1][j].set_ylabel("TTFT p90 (ms)")
        axes[1][j].axhline(a["ttft_slo_ms"], color="grey", ls=":", lw=1)
        axes[2][j].set_ylabel("TBT p99 (ms)")
        axes[2][j].axhline(a["tbt_slo_ms"], color="grey", ls=":", lw=1)
        knee = ev.get("knee", {}).get(w, {}).get("knee_rps")
        for i in range(3):
            axes[i][j].set_xlabel("offered load (req/s)")
            axes[i][j].grid(alpha=0.3)
            if knee:
                axes[i][j].axvline(knee, color="k", ls="--", lw=0.8)
        axes[1][j].set_yscale("log")
        axes[2][j].set_yscale("log")
        axes[0][j].legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(out / "eval_goodput_vs_load.png", dpi=90)
    plt.close(fig)
    return [
        "![goodput, TTFT p90 and TBT p99 against offered load (dashed: colocated's knee)]"
        "(eval_goodput_vs_load.png)",
        "",
    ]


def _cache_section(ev: dict, out: Path, plt) -> list[str]:
    runs = [r for r in ev["runs"] if r.get("workload") == "cache"]
    if not runs:
        return []
    lines = [
        "### Cache size: hit ratio and TTFT against the local KV pool, with and without the store",
        "",
        f"kvmesh (1 prefill + 1 decode), the trace at colocated's knee "
        f"({runs[0].get('rate_rps')} rps), one run per point; with the store each node "
        f"lends {ev['setup']['segment_per_pool']}x its pool to it.",
        "",
        "| KV pool per node | store | hit ratio | of which from the store (tokens) | TTFT p50 "
        "/ p90 ms | inside SLO (all) | goodput rps | rejected |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for r in runs:
        s = r["summary"]
        nt = s.get("node_tokens", {})
        lines.append(
            f"| {r['pool']} | {'yes' if r['store'] else 'no'} | "
            f"{_f(s['cache_hit_ratio'], 1, True)} | {nt.get('fetched_store', 0):,} | "
            f"{_f(s['ttft_ms']['p50'], 0)} / {_f(s['ttft_ms']['p90'], 0)} | "
            f"{_f(s['slo_attainment'], 1, True)} | {_f(s['goodput_rps'], 2)} | {s['rejected']} |"
        )
    fig, (a1, a2) = plt.subplots(1, 2, figsize=(9, 3.4))
    for store in (True, False):
        rs = [r for r in runs if r["store"] == store]
        if not rs:
            continue
        xs = [_mib(r["pool"]) for r in rs]
        lab = "with store" if store else "without store"
        a1.plot(xs, [r["summary"]["cache_hit_ratio"] for r in rs], marker="o", label=lab)
        a2.plot(xs, [r["summary"]["ttft_ms"]["p90"] for r in rs], marker="o", label=lab)
    ideal = ev.get("workloads", {}).get("trace", {}).get("ideal_hit_ratio")
    if ideal:
        a1.axhline(ideal, color="grey", ls=":", lw=1, label="ideal (infinite cache)")
    for ax, yl in ((a1, "prompt-token hit ratio"), (a2, "TTFT p90 (ms)")):
        ax.set_xscale("log", base=2)
        ax.set_xlabel("KV pool per node (MiB)")
        ax.set_ylabel(yl)
        ax.grid(alpha=0.3)
        ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(out / "eval_cache_size.png", dpi=90)
    plt.close(fig)
    return [*lines, "", "![hit ratio and TTFT against pool size](eval_cache_size.png)", ""]


def _mib(s: str) -> float:
    from kvmesh.services.common.config import parse_size

    return parse_size(s) / (1 << 20)


def eval_section(ev: dict, out: Path) -> list[str]:
    a, st = ev["args"], ev["setup"]
    m = ev.get("machine", {})
    wl = ev.get("workloads", {})
    lines = [
        "## Realistic evaluation: colocated vs disaggregated vs kvmesh on equal hardware",
        "",
        f"`python -m kvmesh.loadtest{' --quick' if a.get('quick') else ''}` "
        f"({ev.get('created')}, {ev.get('elapsed_s', 0) / 60:.1f} min; "
        f"{m.get('cpus')} CPU cores; load average {m.get('loadavg_start', [0])[0]:.1f} at "
        f"the start, {m.get('loadavg_end', [0])[0]:.1f} at the end). Raw data: "
        "`eval.json`.",
        "",
        "### Set-up",
        "",
        f"- **Model:** `{st['model']}` in {st['dtype']}, block size {st['block_size']}; "
        f"the other rows are measured for reference only. {_dtype_note(ev)}",
        "",
        *_table_costs(ev),
        "",
        "- **Equal hardware:** every configuration has two working model nodes, each pinned "
        f"to its own core (cores {m.get('node_cores')}; `os.sched_setaffinity` on the child "
        "at spawn, inherited by every thread it starts, read back from /proc per thread), "
        f"{st['threads']} torch thread each. colocated = 2 nodes that prefill and decode "
        "(plus an idle prefill node the conductor requires, pinned beside decode-0, which "
        "no request reaches); disagg-nostore and kvmesh = 1 prefill + 1 decode node. "
        "**The conductor, the store-master, etcd and the load generator are not pinned**: "
        "they run on the same two cores, in every configuration alike.",
        f"- **Memory:** each node's KV pool is {st['kv_memory']}; the workloads' KV working "
        f"sets are {wl.get('trace', {}).get('kv_working_set_mib')} MiB (trace run) and "
        f"{wl.get('shared', {}).get('kv_working_set_mib')} MiB (shared prefix), so a pool "
        f"holds only part of it. kvmesh's nodes each lend {st['segment_memory']} "
        f"({st['segment_per_pool']}x the pool) to the store; the baselines have no store.",
        f"- **SLOs:** TTFT {st['ttft_slo_ms']:.0f} ms, mean TBT per request "
        f"{st['tbt_slo_ms']:.0f} ms, judged client-side the same way for every configuration "
        "(colocated has no admission control: it serves everything). Decode nodes step at "
        f"most {st['step_token_budget']} tokens (running batch + a chunk of a prompt "
        "computed there: chunked prefill, as vLLM). kvmesh prefills prompts under "
        f"{st['colocate_below_tokens']} tokens on the decode node (512 by default, scaled "
        "down with the prompts).",
        "",
        "| workload | requests per run | mean input / output tokens | ideal hit ratio | what |",
        "|---|---|---|---|---|",
        f"| trace | {wl.get('trace', {}).get('requests')} | "
        f"{wl.get('trace', {}).get('input_mean')} / {wl.get('trace', {}).get('output_mean')} | "
        f"{_f(wl.get('trace', {}).get('ideal_hit_ratio'), 0, True)} | Mooncake FAST'25 synthetic "
        f"trace (vendored in `loadtest/traces/`): whole prefix groups kept with probability "
        f"{a.get('trace_share')} (the trace-wide ideal hit ratio is 64%; a plain slice of "
        f"consecutive requests shares ~5%), 512-token blocks -> {a.get('block_tokens')} "
        f"tokens, inputs capped at {a.get('max_input')}, outputs x{a.get('output_scale'):.3g} "
        f"(clamped to 1..{a.get('max_output')}); arrivals keep the trace's shape, scaled to "
        "the offered rate |",
        f"| shared | {wl.get('shared', {}).get('requests')} | "
        f"{wl.get('shared', {}).get('input_mean')} / {wl.get('shared', {}).get('output_mean')} "
        f"| {_f(wl.get('shared', {}).get('ideal_hit_ratio'), 0, True)} | "
        f"{a.get('shared_prefixes')} system prompts / tool schemas of "
        f"{a.get('shared_prefix_tokens') // 2}..{a.get('shared_prefix_tokens')} tokens "
        "(Zipf 0.8 popularity) + each user's own 32..160 tokens; Poisson arrivals |",
        f"| agentic | {wl.get('agentic', {}).get('requests')} | "
        f"{wl.get('agentic', {}).get('input_mean')} / "
        f"{wl.get('agentic', {}).get('output_mean')} | – | {a.get('sessions')} agent "
        f"sessions of {a.get('turns')}+ turns: each prompt = the previous context + its real "
        "output + ~100 tokens of tool results; closed loop inside a session (100 ms think), "
        "open loop across |",
        "",
        "Every run of a configuration goes to the same running cluster with tokens of its "
        "own (no run can hit another's blocks); what earlier runs left in the pools and the "
        "store is evicted like any cold block. Every run is bounded: a fixed request count, "
        f"each request at most {st['request_timeout_s']:.0f} s.",
        "",
    ]
    kn = ev.get("knee", {})
    if kn:
        lines += ["### Colocated's knee", "", "| workload | knee rps | probes (rps: inside SLO) |"]
        lines += ["|---|---|---|"]
        for w, k in kn.items():
            pr = ", ".join(f"{p['rate']}: {_f(p['attainment'], 0, True)}" for p in k["probes"])
            lines.append(
                f"| {w} | {k['knee_rps']}{'' if k.get('bracketed') else ' (not bracketed)'} "
                f"| {pr} |"
            )
        lines.append("")
    lines += ["### Where kvmesh wins and where it loses", "", *_verdicts(ev), ""]
    for w in ("trace", "shared"):
        hl = headline(ev, w)
        if not hl:
            continue
        lines += [
            f"#### {w}: at 1x colocated's knee (median of {hl[0]['n']} runs)",
            "",
            "| config | goodput rps | x colocated | TTFT p90 ms | x colocated | TBT p99 ms | "
            "x colocated | accepted | accepted inside SLO | hit |",
            "|---|---|---|---|---|---|---|---|---|---|",
        ]
        for h in hl:
            lines.append(
                f"| {h['config']} | {_f(h['goodput_rps'], 2)} | {_f(h['goodput_x'], 2)} | "
                f"{_f(h['ttft_p90'], 0)} | {_f(h['ttft_p90_x'], 2)} | {_f(h['tbt_p99'], 0)} | "
                f"{_f(h['tbt_p99_x'], 2)} | {_f(h['acceptance'], 0, True)} | "
                f"{_f(h['accepted_ok'], 1, True)} | {_f(h['hit'], 0, True)} |"
            )
        lines.append("")
    plt = _plt()
    for w in ("trace", "shared"):
        if points(ev, w):
            lines += [f"### Goodput against offered load: {w}", "", *_sweep_rows(ev, w), ""]
    lines += _plot_sweep(ev, out, plt)
    ag = [r for r in ev["runs"] if r.get("workload") == "agentic"]
    if ag:
        lines += [
            "### Agentic sessions",
            "",
            "| config | served/sent | TTFT p50 / p90 ms | TBT p50 / p99 ms | inside SLO (all) "
            "| goodput rps | hit | prompt tokens computed | routes |",
            "|---|---|---|---|---|---|---|---|---|",
        ]
        for r in ag:
            s = r["summary"]
            lines.append(
                f"| {r['config']} | {s['served']}/{s['requests']} | {_f(s['ttft_ms']['p50'], 0)}"
                f" / {_f(s['ttft_ms']['p90'], 0)} | {_f(s['tbt_ms']['p50'], 0)} / "
                f"{_f(s['tbt_ms']['p99'], 0)} | {_f(s['slo_attainment'], 1, True)} | "
                f"{_f(s['goodput_rps'], 2)} | {_f(s['cache_hit_ratio'], 0, True)} | "
                f"{s.get('node_tokens', {}).get('computed')} | "
                f"{', '.join(f'{k} {v}' for k, v in s['routes'].items())} |"
            )
        lines.append("")
    lines += _cache_section(ev, out, plt)
    notes = out / "eval_notes.md"
    if notes.exists():
        lines += [notes.read_text(), ""]
    return lines
