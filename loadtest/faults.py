"""Fault suite and overload run on a real local cluster (issue 9).

    python -m kvmesh.loadtest.faults              # every fault, ~6-8 min on 2 cores
    python -m kvmesh.loadtest.faults --quick      # shorter phases
    python -m kvmesh.loadtest.faults --only kill-decode,conductor-restart
    python -m kvmesh.loadtest.faults --overload   # 3x capacity for a minute (capacity measured first)

Each fault runs under a steady, bounded load: ``--concurrency`` closed-loop clients send
greedy requests whose exact outputs are known beforehand (``LlamaModel.reference_generate``
of the ``tiny`` preset, computed here from scratch). A client retries a request on
UNAVAILABLE, DEADLINE_EXCEEDED and RESOURCE_EXHAUSTED (after its ``retry-after-ms``) until
the request's deadline. For each fault we check:

- zero wrong tokens: every finished output equals the reference, and every partial output
  of a failed attempt is a prefix of it;
- every request ends with its full output or a retriable status within its deadline, and
  none hangs (each attempt has a gRPC deadline; a request still open ``HANG_SLACK_S`` after
  its deadline counts as hung);
- recovery: the time from the fault until the last failed attempt ended (after which every
  attempt succeeded), and the time until the cluster is whole again (the victim left the
  conductor's view, or the restarted service is back), both against the lease TTL + 5 s.

Faults: SIGKILL of a prefill node, of a decode node, of the node holding the most store
blocks; conductor, store-master and etcd restarts; a network cut and heal between a prefill
node in its own network namespace (joined by a veth pair) and the rest of the cluster; KV
bytes flipped on the data plane (``KVMESH_FAULT_CORRUPT_EVERY``, nodes run ``--checksum``);
hostile HTTP bodies (``hostile-body``, :mod:`kvmesh.loadtest.faults_hostile`: a live
stream's token gaps stay bounded while they are sent, and nothing fails).
Two rows run a real ``kvmesh up`` process instead: SIGKILL of the launcher itself
(``launcher-killed``: no child may survive it and the conductor's port must be free within
5 s) and SIGKILL of its decode node (``node-killed-in-local-cluster``: the launcher restarts
it, and a retried request succeeds within the lease TTL + 5 s). Two more start clusters
of their own: ``store-master-failover`` (the leading store-master SIGKILLed, a standby
takes over) and ``conductor-killed`` (:mod:`kvmesh.loadtest.faults_conductor`: one of two
conductors SIGKILLed; accepted requests judged against 4x the solo TTFT and TPOT measured
on the same cluster first). ``slowloris-data-port``
(:mod:`kvmesh.loadtest.faults_slowloris`): 200 connections to a decode node's data port
send one byte a second; nothing may fail, each must be closed at the handshake deadline
and the node's threads stay bounded (a row with checks of its own sets ``passed``).

Results: ``loadtest/results/faults.md`` and ``faults.json`` (``overload.md/json``).
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from kvmesh.loadtest.fault_harness import (  # noqa: E402
    DISAGG_ONLY,
    NODE_ARGS,
    TTL,
    Plan,
    run_fault,
)
from kvmesh.loadtest.faults_cluster import (  # noqa: E402
    expected_outputs,
    make_prompts,
    new_cluster,
)
from kvmesh.loadtest.faults_conductor import conductor_killed  # noqa: E402
from kvmesh.loadtest.faults_hostile import hostile_body  # noqa: E402
from kvmesh.loadtest.faults_netns import net_cut  # noqa: E402
from kvmesh.loadtest.faults_overload import overload  # noqa: E402
from kvmesh.loadtest.faults_own_cluster import byte_flip, store_master_failover  # noqa: E402
from kvmesh.loadtest.faults_plain import PLAIN, fault_kill, fault_restart  # noqa: E402
from kvmesh.loadtest.faults_report import RESULTS, fmt_row, write_report  # noqa: E402
from kvmesh.loadtest.faults_up import LAUNCHER  # noqa: E402

# the fault rows live in faults_plain (one shared cluster), faults_up (a real `kvmesh up`),
# faults_own_cluster, faults_netns, faults_conductor; the overload run in faults_overload;
# the report in faults_report. tests/test_faults.py reaches what it uses through here.
__all__ = [
    "ALL",
    "DISAGG_ONLY",
    "LAUNCHER",
    "NODE_ARGS",
    "PLAIN",
    "Plan",
    "RESULTS",
    "TTL",
    "byte_flip",
    "expected_outputs",
    "fault_kill",
    "fault_restart",
    "fmt_row",
    "main",
    "main_faults",
    "make_prompts",
    "new_cluster",
    "run_fault",
    "write_report",
]

# rows run on the one shared cluster: the plain faults, then hostile bodies over HTTP
SHARED = {**PLAIN, "hostile-body": hostile_body}
ALL = [*SHARED, *LAUNCHER, "byte-flip", "net-cut", "store-master-failover", "conductor-killed"]


def main_faults(faults: list[str], plan: Plan, workdir: str) -> list[dict]:
    prompts = make_prompts()
    expect = expected_outputs(prompts, plan.max_tokens)
    rows: list[dict] = []
    plain = [f for f in faults if f in SHARED]
    if plain:
        cluster = new_cluster(os.path.join(workdir, "plain"))
        try:
            for f in plain:
                print(f"-- {f}", flush=True)
                row = SHARED[f](cluster, prompts, expect, plan)
                rows.append(row)
                print(fmt_row(row), flush=True)
        finally:
            cluster.stop()
    for f in [f for f in faults if f in LAUNCHER]:
        print(f"-- {f}", flush=True)
        rows.append(LAUNCHER[f](os.path.join(workdir, f), prompts, expect, plan))
        print(fmt_row(rows[-1]), flush=True)
    if "byte-flip" in faults:
        print("-- byte-flip", flush=True)
        rows.append(byte_flip(os.path.join(workdir, "flip"), prompts, expect, plan))
        print(fmt_row(rows[-1]), flush=True)
    if "net-cut" in faults:
        print("-- net-cut", flush=True)
        rows.append(net_cut(os.path.join(workdir, "netns"), prompts, expect, plan))
        print(fmt_row(rows[-1]), flush=True)
    if "store-master-failover" in faults:
        print("-- store-master-failover", flush=True)
        rows.append(store_master_failover(os.path.join(workdir, "failover"), prompts, expect, plan))
        print(fmt_row(rows[-1]), flush=True)
    if "conductor-killed" in faults:
        print("-- conductor-killed", flush=True)
        rows.append(conductor_killed(os.path.join(workdir, "conductors"), prompts, expect, plan))
        print(fmt_row(rows[-1]), flush=True)
    return rows


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(
        prog="python -m kvmesh.loadtest.faults",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    ap.add_argument("--quick", action="store_true", help="shorter phases")
    ap.add_argument("--only", default="", help=f"comma-separated subset of {','.join(ALL)}")
    ap.add_argument("--overload", action="store_true", help="the overload run instead")
    ap.add_argument("--seconds", type=float, default=60.0, help="overload: offered-load phase")
    ap.add_argument("--factor", type=float, default=3.0, help="overload: x measured capacity")
    ap.add_argument("--workdir", default=None, help="logs (default: a temp dir, removed)")
    args = ap.parse_args(argv)
    workdir = args.workdir or tempfile.mkdtemp(prefix="kvmesh-faults-")
    try:
        if args.overload:
            res = overload(
                os.path.join(workdir, "overload"),
                args.seconds if not args.quick else min(args.seconds, 20),
                args.factor,
                args.quick,
            )
            RESULTS.mkdir(exist_ok=True)
            (RESULTS / "overload.json").write_text(json.dumps(res, indent=1))
            (RESULTS / "overload.md").write_text(
                "# Overload\n\n```json\n" + json.dumps(res, indent=1) + "\n```\n"
            )
            print(json.dumps(res, indent=1))
            ok = res["slo_met_share"] >= 0.99 and not res["died"] and res["wrong"] == 0
            return 0 if ok else 1
        plan = Plan(3.0, 9.0) if args.quick else Plan()
        faults = [f for f in (args.only.split(",") if args.only else ALL) if f]
        unknown = set(faults) - set(ALL)
        if unknown:
            ap.error(f"unknown fault(s) {sorted(unknown)}; known: {ALL}")
        rows = main_faults(faults, plan, workdir)
        print(write_report(rows, plan))
        bad = [
            r["fault"]
            for r in rows
            if r.get("skipped") is None
            and (r["wrong"] or r["hung"] or r["failed_other"] or r.get("passed") is False)
        ]
        return 1 if bad else 0
    finally:
        if args.workdir is None:
            shutil.rmtree(workdir, ignore_errors=True)


if __name__ == "__main__":
    sys.exit(main())
