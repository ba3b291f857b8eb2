"""Throughput benchmark for the rdma/ transfer engine over loopback.

Two engines in separate processes (this one issues WRITE/READ; a child
process owns the remote region), block sizes 64 KiB .. 64 MiB, about
``--total-mib`` moved per point (fewer if a point exceeds ``--max-point-s``),
median of ``--reps``.  Two modes: *batched* (all blocks in one call) and
*single* (one block per call, each awaited before the next).  A plain Python
socket stream (``sendall`` / ``recv_into`` with 4 MiB buffers) between the
same two processes is measured in the same run as the baseline, over as many
TCP connections as the engine uses (``--conns``), each carrying its share in
parallel.

Every byte moved is verified, outside the timed region: a write repetition
alternates between two sources of different random bytes and is read back and
compared (a write that moved nothing would leave the other pattern there); a read
repetition lands in a zeroed buffer compared with what the peer holds; the stream's
sink keeps what each connection received and answers, after its timed ack, with a
CRC-32 that must match the sender's.

When the optional ``mooncake-transfer-engine-non-cuda`` wheel is installed,
Mooncake's TransferEngine (TCP transport, P2P handshake) runs the same points
side by side in two more processes (a client and its peer); otherwise its
rows fall back to the reference figures below (batched only).  The wheel is
never a kvmesh dependency and is imported only in those child processes.

The three contenders are interleaved repetition by repetition (kvmesh, then
Mooncake, then one plain-stream run, the first two swapping order every
repetition), so load from other processes on a shared host hits them alike;
the stream baseline is the median of all its runs spread over the benchmark.
GB/s = 1e9 bytes/s; RSS is the measuring process's peak (ru_maxrss).

    python -m kvmesh.loadtest.bench_transfer [--total-mib 256] [--reps 3] [--no-mooncake]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import platform
import statistics
import subprocess
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from kvmesh.loadtest.bench_transfer_measure import BLOCKS, MODES, OPS, engine_rates  # noqa: E402
from kvmesh.loadtest.bench_transfer_mooncake import (  # noqa: E402
    MOONCAKE,
    mooncake_client_main,
    mooncake_peer_main,
    start_mooncake,
)
from kvmesh.loadtest.bench_transfer_peer import (  # noqa: E402
    STREAM_BUF,
    KiB,
    MiB,
    peak_rss_mib,
    peer_main,
)

RESULTS = Path(__file__).resolve().parent / "results" / "transfer.json"
# the parts: bench_transfer_peer (the --peer process, shared sizes), bench_transfer_measure
# (every point, interleaved, verified), bench_transfer_mooncake (the Mooncake contender)


def _label(bs: int) -> str:
    return f"{bs // MiB} MiB" if bs >= MiB else f"{bs // KiB} KiB"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--total-mib", type=int, default=256)
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--conns", type=int, default=4)
    ap.add_argument(
        "--chunk-mib",
        type=int,
        default=2,
        help="slices larger than this are cut into pieces (the engine default)",
    )
    ap.add_argument(
        "--max-point-s",
        type=float,
        default=3.0,
        help="cap on one single-mode repetition (bounds slow points)",
    )
    ap.add_argument("--no-mooncake", action="store_true")
    ap.add_argument("--out", type=Path, default=RESULTS)
    ap.add_argument("--peer", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--mooncake-peer", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--mooncake-client", action="store_true", help=argparse.SUPPRESS)
    args = ap.parse_args()
    total, chunk = args.total_mib * MiB, args.chunk_mib * MiB
    if args.peer:
        asyncio.run(peer_main(total, args.conns, chunk))
        return
    if args.mooncake_peer:
        mooncake_peer_main(total)
        return
    if args.mooncake_client:
        mooncake_client_main(total, args.max_point_s)
        return

    t_start = time.perf_counter()
    if args.no_mooncake:
        mc, mc_note = None, "--no-mooncake: using the hard-coded reference figures"
    else:
        mc, mc_note = start_mooncake(total, args.max_point_s)
    proc = subprocess.Popen(
        [
            sys.executable,
            os.path.abspath(__file__),
            "--peer",
            "--total-mib",
            str(args.total_mib),
            "--conns",
            str(args.conns),
            "--chunk-mib",
            str(args.chunk_mib),
        ],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
    )
    peer_rss = None
    try:
        peer = json.loads(proc.stdout.readline())
        kv = asyncio.run(
            engine_rates(peer, total, args.reps, args.conns, chunk, args.max_point_s, mc)
        )
    finally:
        mc_rss = mc.close() if mc is not None else {}
        proc.stdin.close()
        try:
            tail = proc.stdout.read().strip().splitlines()
            proc.wait(10)
            peer_rss = json.loads(tail[-1])["peak_rss_mib"] if tail else None
        except (subprocess.TimeoutExpired, ValueError):
            proc.kill()
    kv_rss = peak_rss_mib()
    stream_runs = kv["stream_runs"]
    stream = statistics.median(stream_runs)
    if kv["mooncake_error"] is not None:
        mc_note = (
            f"Mooncake failed mid-run ({kv['mooncake_error']}); points without "
            "a Mooncake figure use the reference figures"
        )
    mc_rates = {op: {m: dict(kv["mooncake"][op][m]) for m in MODES} for op in OPS}
    measured = mc is not None and kv["mooncake_error"] is None
    if not measured:
        for op in OPS:
            for bs, ref in MOONCAKE[op].items():
                mc_rates[op]["batched"].setdefault(bs, ref)

    rows = []
    print(
        f"plain python socket stream ({args.conns} conns as the engine, "
        f"{STREAM_BUF // MiB} MiB buffers): "
        f"{stream:.2f} GB/s (median of {len(stream_runs)} runs interleaved with the "
        f"points; min {min(stream_runs):.2f}, max {max(stream_runs):.2f})"
    )
    print(f"verified: every byte moved, {kv['verified_bytes'] / 1e9:.2f} GB in all")
    print(f"mooncake: {mc_note}")
    hdr = (
        f"{'block':>8} | {'op':5} | {'mode':7} | {'kvmesh':>6} | {'mooncake':>8} | "
        f"{'/mooncake':>9} | {'/stream':>7} | {'RSS MiB':>7}"
    )
    print(hdr)
    print("-" * len(hdr))
    for kind in OPS:
        for mode in MODES:
            for bs in BLOCKS:
                r = kv["rates"][kind][mode][bs]
                ref = mc_rates[kind][mode].get(bs)
                rss = kv["rss"][(kind, mode, bs)]
                rows.append(
                    {
                        "op": kind,
                        "mode": mode,
                        "block_bytes": bs,
                        "gbps": round(r, 3),
                        "ratio_stream": round(r / stream, 3),
                        "mooncake_gbps": None if ref is None else round(ref, 3),
                        "mooncake_measured": bs in kv["mooncake"][kind][mode],
                        "ratio_mooncake": None if not ref else round(r / ref, 3),
                        "peak_rss_mib": round(rss, 1),
                    }
                )
                print(
                    f"{_label(bs):>8} | {kind:5} | {mode:7} | {r:6.2f} | "
                    + (f"{ref:8.2f} | {r / ref:8.2f}x" if ref else f"{'-':>8} | {'-':>9}")
                    + f" | {r / stream:6.2f}x | {rss:7.0f}"
                )
    rss_line = {
        "kvmesh_client": round(kv_rss, 1),
        "kvmesh_peer": None if peer_rss is None else round(peer_rss, 1),
    }
    if mc_rss.get("peak_rss_mib") is not None:
        rss_line["mooncake_client"] = round(mc_rss["peak_rss_mib"], 1)
        rss_line["mooncake_peer"] = (
            None
            if mc_rss.get("peer_peak_rss_mib") is None
            else round(mc_rss["peer_peak_rss_mib"], 1)
        )
    print("peak RSS MiB: " + ", ".join(f"{k} {v}" for k, v in rss_line.items()))
    elapsed = time.perf_counter() - t_start
    print(f"total benchmark time {elapsed:.1f} s")
    result = {
        "bench": "transfer",
        "transport": "tcp-loopback",
        "total_bytes_per_point": total,
        "reps": args.reps,
        "max_point_s": args.max_point_s,
        "conns_per_peer": args.conns,
        "chunk_bytes": chunk,
        "stream_conns": args.conns,
        "verified_bytes": kv["verified_bytes"],
        "stream_gbps": round(stream, 3),
        "stream_runs_gbps": [round(x, 3) for x in stream_runs],
        "mooncake": mc_note,
        "peak_rss_mib": rss_line,
        "measured_bandwidth_bps": kv["bandwidth"],
        "points": rows,
        "host": {
            "python": platform.python_version(),
            "cpus": os.cpu_count(),
            "machine": platform.machine(),
        },
        "elapsed_s": round(elapsed, 1),
        "timestamp": time.time(),
    }
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(result, indent=2))
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
