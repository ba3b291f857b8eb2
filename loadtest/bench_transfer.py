"""Throughput benchmark for the rdma/ transfer engine over loopback.

Two engines in separate processes (this one issues batched WRITE/READ; a
child process owns the remote region), block sizes 64 KiB .. 64 MiB, about
``--total-mib`` moved per point, median of ``--reps``.  A plain Python socket
stream (``sendall`` / ``recv_into`` with 4 MiB buffers) between the same two
processes is measured in the same run as the baseline.  GB/s = 1e9 bytes/s.

    python -m loadtest.bench_transfer [--total-mib 256] [--reps 3]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import platform
import socket
import statistics
import struct
import subprocess
import sys
import threading
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from rdma import Slice, TransferEngine  # noqa: E402

KiB, MiB = 1 << 10, 1 << 20
BLOCKS = [64 * KiB, 1 * MiB, 16 * MiB, 64 * MiB]
STREAM_BUF = 4 * MiB
# Mooncake transfer engine, TCP transport, batched (GB/s)
MOONCAKE = {"write": {64 * KiB: 1.1, MiB: 1.7, 16 * MiB: 1.8, 64 * MiB: 1.8},
            "read": {64 * KiB: 1.2, MiB: 2.0, 16 * MiB: 1.8, 64 * MiB: 1.8}}
SECRET = b"bench-secret"
RESULTS = Path(__file__).resolve().parent / "results" / "transfer.json"


# -- peer process ---------------------------------------------------------------
def _stream_sink(ls: socket.socket) -> None:
    """Plain-socket baseline server: receive N bytes with recv_into, ack 1 byte."""
    buf = memoryview(bytearray(STREAM_BUF))
    while True:
        try:
            conn, _ = ls.accept()
        except OSError:
            return
        with conn:
            conn.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            while True:
                hdr = conn.recv(8, socket.MSG_WAITALL)
                if len(hdr) < 8:
                    break
                left = struct.unpack("!Q", hdr)[0]
                while left:
                    n = conn.recv_into(buf[:min(left, STREAM_BUF)])
                    if not n:
                        return
                    left -= n
                conn.sendall(b"k")


async def _peer_main(total: int, conns: int, chunk: int) -> None:
    eng = TransferEngine(SECRET, conns_per_peer=conns, chunk_bytes=chunk)
    await eng.start()
    region = np.zeros(total, dtype=np.uint8)
    rid = eng.register(region)
    ls = socket.create_server(("127.0.0.1", 0))
    threading.Thread(target=_stream_sink, args=(ls,), daemon=True).start()
    print(json.dumps({"address": eng.address, "region": rid,
                      "stream_port": ls.getsockname()[1]}), flush=True)
    await asyncio.to_thread(sys.stdin.read)  # until the parent closes stdin
    ls.close()
    await eng.close()


# -- measuring side ---------------------------------------------------------------
def _stream_rate(port: int, total: int, reps: int) -> float:
    """Median GB/s of ``reps`` single-connection sendall -> recv_into runs."""
    src = memoryview(os.urandom(STREAM_BUF))
    rates = []
    with socket.create_connection(("127.0.0.1", port)) as s:
        s.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        for _ in range(reps + 1):  # first rep warms up
            t0 = time.perf_counter()
            s.sendall(struct.pack("!Q", total))
            left = total
            while left:
                n = min(left, STREAM_BUF)
                s.sendall(src[:n])
                left -= n
            assert s.recv(1) == b"k"
            rates.append(total / (time.perf_counter() - t0) / 1e9)
    return statistics.median(rates[1:])


async def _engine_rates(peer: dict, total: int, reps: int, conns: int,
                        chunk: int) -> dict:
    eng = TransferEngine(SECRET, conns_per_peer=conns, chunk_bytes=chunk)
    await eng.start()
    local = np.random.default_rng(0).integers(0, 256, size=total, dtype=np.uint8)
    rid = eng.register(local)
    addr, rrid = peer["address"], peer["region"]
    out: dict = {"write": {}, "read": {}}
    try:
        # warm-up: open the connections and fault in both regions
        await eng.write(addr, [Slice(rid, 0, rrid, 0, total)])
        for bs in BLOCKS:
            n = max(1, total // bs)
            slices = [Slice(rid, i * bs, rrid, i * bs, bs) for i in range(n)]
            for kind, op in (("write", eng.write), ("read", eng.read)):
                rates = []
                for _ in range(reps):
                    t0 = time.perf_counter()
                    await op(addr, slices)
                    rates.append(n * bs / (time.perf_counter() - t0) / 1e9)
                out[kind][bs] = statistics.median(rates)
        # sanity: what we read back is what we wrote
        check = np.zeros(MiB, dtype=np.uint8)
        await eng.read(addr, [Slice(eng.register(check), 0, rrid, 5 * MiB, MiB)])
        assert np.array_equal(check, local[5 * MiB:6 * MiB]), "data mismatch"
    finally:
        await eng.close()
    return out


def _label(bs: int) -> str:
    return f"{bs // MiB} MiB" if bs >= MiB else f"{bs // KiB} KiB"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--total-mib", type=int, default=256)
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--conns", type=int, default=4)
    ap.add_argument("--chunk-mib", type=int, default=4)
    ap.add_argument("--out", type=Path, default=RESULTS)
    ap.add_argument("--peer", action="store_true", help=argparse.SUPPRESS)
    args = ap.parse_args()
    total, chunk = args.total_mib * MiB, args.chunk_mib * MiB
    if args.peer:
        asyncio.run(_peer_main(total, args.conns, chunk))
        return

    proc = subprocess.Popen(
        [sys.executable, os.path.abspath(__file__), "--peer", "--total-mib",
         str(args.total_mib), "--conns", str(args.conns), "--chunk-mib", str(args.chunk_mib)],
        stdin=subprocess.PIPE, stdout=subprocess.PIPE)
    try:
        peer = json.loads(proc.stdout.readline())
        # baseline before and after the engine runs (the host may be noisy)
        stream_runs = [_stream_rate(peer["stream_port"], total, args.reps)]
        rates = asyncio.run(_engine_rates(peer, total, args.reps, args.conns, chunk))
        stream_runs.append(_stream_rate(peer["stream_port"], total, args.reps))
        stream = statistics.median(stream_runs)
    finally:
        proc.stdin.close()
        try:
            proc.wait(10)
        except subprocess.TimeoutExpired:
            proc.kill()

    rows = []
    print(f"plain python socket stream (1 conn, {STREAM_BUF // MiB} MiB buffers): "
          f"{stream:.2f} GB/s (before/after: "
          f"{' / '.join(f'{x:.2f}' for x in stream_runs)})")
    print(f"{'block':>8} | {'op':5} | {'GB/s':>6} | {'/stream':>7} | "
          f"{'mooncake':>8} | {'/mooncake':>9}")
    print("-" * 60)
    for kind in ("write", "read"):
        for bs in BLOCKS:
            r, ref = rates[kind][bs], MOONCAKE[kind][bs]
            rows.append({"op": kind, "block_bytes": bs, "gbps": round(r, 3),
                         "ratio_stream": round(r / stream, 3),
                         "mooncake_gbps": ref, "ratio_mooncake": round(r / ref, 3)})
            print(f"{_label(bs):>8} | {kind:5} | {r:6.2f} | {r / stream:6.2f}x | "
                  f"{ref:8.2f} | {r / ref:8.2f}x")
    result = {"bench": "transfer", "transport": "tcp-loopback",
              "total_bytes_per_point": total, "reps": args.reps,
              "conns_per_peer": args.conns, "chunk_bytes": chunk,
              "stream_gbps": round(stream, 3),
              "stream_runs_gbps": [round(x, 3) for x in stream_runs], "points": rows,
              "host": {"python": platform.python_version(), "cpus": os.cpu_count(),
                       "machine": platform.machine()},
              "timestamp": time.time()}
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(result, indent=2))
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
