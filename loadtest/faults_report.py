"""The fault suite's report: one row per fault, ``loadtest/results/faults.md`` and
``faults.json`` (a run of some faults replaces their rows and keeps the others)."""

from __future__ import annotations

import json
from pathlib import Path

from kvmesh.loadtest.fault_harness import TTL, Plan

RESULTS = Path(__file__).resolve().parent / "results"


COLS = [
    "fault",
    "requests",
    "completed",
    "retried",
    "completed_after_retry",
    "failed_retriable",
    "failed_other",
    "wrong",
    "hung",
    "last_failure_s",
    "max_gap_s",
    "slowest_attempt_s",
    "cluster_whole_s",
    "recovered_in_ttl_plus_5",
]


def fmt_row(r: dict) -> str:
    return " | ".join(f"{c}={r.get(c)}" for c in COLS)


def write_report(rows: list[dict], plan: Plan, name: str = "faults") -> str:
    """Writes ``<name>.md/json``. A run of some faults (``--only``) replaces their rows
    in the last report and keeps the others."""
    RESULTS.mkdir(exist_ok=True)
    try:
        old = json.loads((RESULTS / f"{name}.json").read_text())
    except (OSError, ValueError):
        old = []
    new = {r["fault"]: r for r in rows}
    rows = [new.pop(r["fault"], r) for r in old if isinstance(r, dict) and "fault" in r]
    rows += list(new.values())
    lines = [
        f"# Fault suite (lease TTL {TTL} s; {plan.concurrency} closed-loop clients, "
        f"{plan.max_tokens} greedy tokens, request deadline {plan.deadline_s:.0f} s; "
        f"{plan.before_s:.0f} s of load before each fault, {plan.after_s:.0f} s after)",
        "",
        "| " + " | ".join(COLS) + " |",
        "|" + "---|" * len(COLS),
    ]
    for r in rows:
        lines.append("| " + " | ".join(str(r.get(c, "")) for c in COLS) + " |")
    lines += [
        "",
        "- last_failure_s: seconds from the fault to the end of the last failed "
        "attempt (every later attempt succeeded); max_gap_s: longest stretch after the "
        "fault with no request completing; slowest_attempt_s: the slowest attempt in "
        "flight at or after the fault; cluster_whole_s: seconds until the victim left "
        "the view (kills), every service was back (restarts), or the cut node rejoined "
        "(net-cut, counted from the cut).",
        "- failed attempt codes per fault: "
        + "; ".join(f"{r['fault']}: {r.get('failed_codes')}" for r in rows),
    ]
    for r in rows:
        extra = {k: v for k, v in r.items() if k not in COLS and k not in ("failed_codes",)}
        lines.append(f"- {r['fault']}: {json.dumps(extra)}")
    text = "\n".join(lines) + "\n"
    (RESULTS / f"{name}.md").write_text(text)
    (RESULTS / f"{name}.json").write_text(json.dumps(rows, indent=1))
    return text
