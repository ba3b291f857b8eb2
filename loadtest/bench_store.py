"""Store benchmark: kvmesh's store against Mooncake Store, like for like.

Sizes 4 KiB .. 16 MiB; for each, eight rows: the bytes APIs (``put``, ``get``,
``batch_put``, ``batch_get``) and the zero-copy ones (kvmesh ``put_from``/``get_into``
with one key and with a batch, against Mooncake's ``put_from``/``get_into`` and
``batch_put_from``/``batch_get_into``). Both sides use the same batch size (128, as
Mooncake's own tools, fewer only where 128 values would not fit the segment), the same
keys count and the same values; every byte read back is compared with what was put, on
both sides, outside the timed loops.

Topology (``--topology``):
  * ``local``: each client lends its OWN segment (``MooncakeDistributedStore.setup``
    with a global segment; kvmesh ``StoreClient.lend``), so bytes move by memory copy;
    every operation still goes through the master. A table of its own;
  * ``remote`` (default): neither client lends anything; a separate process holds the
    segment (a kvmesh store-node; a second ``MooncakeDistributedStore`` that mounts the
    segment and waits), and bytes cross the transfer engine (TCP, loopback);
  * ``netns``: as ``remote``, but the segment holders, masters and the transfer-engine
    peer live in a network namespace joined to the client's by a veth pair, so the bytes
    cross a real (virtual) link. The benchmark builds and removes the namespace itself
    and skips with its reason where it cannot (not root, no ``ip``).

kvmesh runs once per ``--poll-us`` value (default ``0,200``), each a cluster of its own:
polling off is the like-for-like row, polling on a second row with the CPU it burns.
``--tls`` adds a ``kvmesh tls`` row: one more cluster (polling as the first row) whose
processes and client speak mutual TLS with throwaway DevCA certificates, gRPC and the
store's raw-TCP control path alike, interleaved with the others: what TLS costs.
Mooncake is run with its defaults. The CPU columns add the client's, the masters' and
the segment holders' CPU time: ms of CPU per operation (= CPU-seconds per 1,000 ops).

The transfer engine's own rate for the same size (one slice per call, and a batch of
the same size as the store's batches) is measured in the same run between the client's
engine and a peer process's, and each size prints where the time of a single put and
get goes: control round trips to the master (an ``exists`` round trip each), the bytes
on the wire (the engine alone), and memory copies (``bytes`` <-> buffer). The host's
floor is measured in the same run too: a raw round trip between the client and the
peer process over blocking sockets (no event loop, no framework; a 4 KiB reply), and
each store's single 4 KiB get and put are given in such round trips.

Rounds interleave the stores per size (kvmesh variants, then Mooncake, the order
swapping each round); each figure is the median over ``--rounds`` (>= 5 for reports).

    python -m kvmesh.loadtest.bench_store [--topology remote|local|netns] [--rounds 5]
        [--quick] [--poll-us 0,200] [--no-mooncake] [--tls]

Writes ``loadtest/results/store_<topology>.json``. Every loop is bounded by an
operation count. The Mooncake wheel (``mooncake-transfer-engine-non-cuda``) is never a
kvmesh dependency: without it, its columns say why they are empty.

This module plans and runs the rounds (and the engine peer); the two sides are
:mod:`kvmesh.loadtest.bench_store_kvmesh` and :mod:`kvmesh.loadtest.bench_store_mooncake`,
what they share :mod:`kvmesh.loadtest.bench_store_common`, the tables
:mod:`kvmesh.loadtest.bench_store_report`.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import shutil
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import threading
import time

import numpy as np

from kvmesh.loadtest.bench_store_common import (
    NETNS,
    NETNS_IPS,
    SECRET,
    Values,
    _in_ns,
    echo_serve,
    netns_down,
    netns_up,
    pct,
    raw_round_trips,
)
from kvmesh.loadtest.bench_store_kvmesh import KvSide
from kvmesh.loadtest.bench_store_mooncake import McSide, _mooncake_holder_main
from kvmesh.loadtest.bench_store_report import APIS, SIZES, breakdown, goals, table

MC_NAME = {"batch_put": "put_batch", "batch_get": "get_batch"}
MOONCAKE_BATCH = 128
_TICK = os.sysconf("SC_CLK_TCK")


def plan(size: int, quick: bool) -> tuple[int, int]:
    """(ops, batch) per size: bounded by count and by bytes moved; the batch is 128
    where 128 values fit in 256 MiB, else what does (the same on both sides)."""
    # four put APIs per round: 4 x 64 MiB per round and side fits a segment even while
    # the reads' leases hold the space of earlier rounds
    budget = (32 if quick else 64) << 20
    ops = max(8, min(512 if quick else 2048, budget // size))
    batch = min(MOONCAKE_BATCH, ops, max(2, (256 << 20) // size))
    return ops, batch


def proc_cpu(pids: list[int]) -> float:
    """CPU seconds used so far by this process and ``pids`` (0 for a gone one)."""
    t = os.times()
    total = t.user + t.system
    for pid in pids:
        try:
            with open(f"/proc/{pid}/stat") as f:
                fields = f.read().rsplit(")", 1)[1].split()
            total += (int(fields[11]) + int(fields[12])) / _TICK
        except (OSError, IndexError, ValueError):
            pass
    return total


# ------------------------------------------------------------------------------ engine
async def _te_peer_main(host: str, nbytes: int, poll_us: int) -> None:
    from kvmesh.rdma import TransferEngine

    te = TransferEngine(SECRET.encode(), host=host, poll_us=poll_us)
    await te.start()
    rid = te.register(np.zeros(nbytes, dtype=np.uint8))
    echo = socket.create_server((host, 0))  # the host's floor (raw round trips)
    threading.Thread(target=echo_serve, args=(echo,), daemon=True).start()
    info = {"address": te.address, "region": rid, "echo": echo.getsockname()[1]}
    print(json.dumps(info), flush=True)
    await asyncio.to_thread(sys.stdin.read)
    await te.close()


class EnginePeer:
    """The transfer engine alone, client engine -> a peer process's region: the wire
    rate the store's remote path is measured against."""

    def __init__(self, ns: str | None, nbytes: int, poll_us: int) -> None:
        host = NETNS_IPS[1] if ns else "127.0.0.1"
        self.proc = subprocess.Popen(
            [
                *_in_ns(ns),
                sys.executable,
                "-m",
                "kvmesh.loadtest.bench_store",
                "--te-peer",
                f"{host},{nbytes},{poll_us}",
            ],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            start_new_session=True,
        )
        info = json.loads(self.proc.stdout.readline())
        self.address, self.region = info["address"], info["region"]
        self.host, self.echo = host, info["echo"]

    def floor(self, count: int = 2000) -> dict:
        """The host's floor: p50/p99 (us) of a raw round trip to the peer process
        (blocking sockets, an 8-byte request, a 4 KiB reply, every reply checked)."""
        lat = raw_round_trips(self.host, self.echo, count)
        return {"p50_us": pct(lat, 50) * 1e6, "p99_us": pct(lat, 99) * 1e6, "count": count}

    async def run(self, te, v: Values, batch: int) -> dict:
        """Single-slice and batched write and read of ``v``'s bytes; seconds each,
        verifying what comes back."""
        from kvmesh.rdma import Slice

        size, n = v.size, v.ops
        src, dst = te.register(v.src), te.register(v.dst)
        out = {}
        try:
            for op, fn, rid in (("write", te.write, src), ("read", te.read, dst)):
                for mode, step in (("single", 1), ("batch", batch)):
                    lat = []
                    t0 = time.perf_counter()
                    for i in range(0, n, step):
                        t = time.perf_counter()
                        await fn(
                            self.address,
                            [
                                Slice(rid, j * size, self.region, j * size, size)
                                for j in range(i, min(n, i + step))
                            ],
                        )
                        lat.append(time.perf_counter() - t)
                    out[f"{op}_{mode}"] = {"secs": time.perf_counter() - t0}
                    out[f"{op}_{mode}_p50_us"] = pct(lat, 50) * 1e6
            out["bad"] = v.check_dst()
        finally:
            te.unregister(src)
            te.unregister(dst)
        return out

    def close(self) -> None:
        self.proc.stdin.close()
        try:
            self.proc.wait(10)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()


# ------------------------------------------------------------------------------ run
def _row(runs: list[dict], size: int, n: int) -> dict:
    secs = statistics.median(r["secs"] for r in runs)
    out = {"ops_s": n / secs, "gb_s": n * size / secs / 1e9, "bad": sum(r["bad"] for r in runs)}
    for k in runs[0]:
        if k not in ("secs", "bad"):
            out[k] = statistics.median(r[k] for r in runs)
    return out


def _copy_us(size: int) -> float:
    """p50 of one ``bytes`` <-> buffer copy of ``size`` bytes in this process."""
    buf = bytearray(size)
    lat = []
    for _ in range(max(5, min(200, (64 << 20) // size))):
        t = time.perf_counter()
        bytes(buf)
        lat.append(time.perf_counter() - t)
    return pct(lat, 50) * 1e6


async def run_all(
    topology: str,
    segment: str,
    quick: bool,
    rounds: int,
    polls: list[int],
    mooncake: bool,
    tls: bool = False,
) -> dict:
    from kvmesh.services.common.config import parse_size

    ns = None
    result: dict = {"topology": topology, "sides": [], "sizes": {}, "skipped": {}}
    if topology == "netns":
        why = netns_up()
        if why is not None:
            result["skipped"]["netns"] = why
            print(f"netns: skipped: {why}", flush=True)
            return result
        ns = NETNS
    host = NETNS_IPS[0] if ns else "127.0.0.1"
    work = tempfile.mkdtemp(prefix="kvmesh-bench-store-")
    sides: list = []
    peer = None
    try:
        variants = [(p, False) for p in polls] + ([(polls[0], True)] if tls else [])
        for p, secure in variants:
            path = os.path.join(work, f"kv{p}{'tls' if secure else ''}")
            side = KvSide(topology, segment, p, path, tls=secure)
            sides.append(side)  # closed in ``finally`` even when it fails to start
            await asyncio.to_thread(side.start_cluster, ns)
            await side.open(host)
        if mooncake:
            mc = McSide(topology, parse_size(segment), work)
            why = mc.start(ns)
            if why is None:
                sides.append(mc)
            else:
                result["skipped"]["mooncake"] = why
                print(f"mooncake: skipped: {why}", flush=True)
                await mc.close()
        result["sides"] = [s.name for s in sides]
        if topology != "local":
            peer = EnginePeer(ns, 256 << 20, polls[0])
        for s in sides:
            result.setdefault("rtt_us", {})[s.name] = await s.rtt() * 1e6
        if peer is not None:
            try:
                result["floor"] = await asyncio.to_thread(peer.floor)
            except (OSError, ValueError) as e:  # the floor is context, not a result
                result["floor"] = {"error": str(e)}
        for label, size in SIZES:
            ops, batch = plan(size, quick)
            v = Values(size, ops)
            runs: dict = {s.name: {a: [] for a in APIS} for s in sides}
            lats: dict = {s.name: {} for s in sides}
            te_runs = []
            for rnd in range(rounds):
                order = sides if rnd % 2 == 0 else sides[::-1]
                for s in order:
                    tags = []
                    for api in APIS:
                        tag = f"{label}-{rnd}-{api}"
                        c0 = proc_cpu(s.pids())
                        r, lat = await s.run(api, v, batch, tag)
                        r["cpu_ms_op"] = (proc_cpu(s.pids()) - c0) / ops * 1e3
                        r["cores"] = (proc_cpu(s.pids()) - c0) / r["secs"]
                        runs[s.name][api].append(r)
                        lats[s.name].setdefault(api, []).extend(lat)
                        if "put" in api:
                            tags.append(tag)
                    await s.remove(tags, ops)
                if peer is not None:
                    te_runs.append(await peer.run(sides[0].te, v, batch))
            row: dict = {"ops": ops, "batch": batch, "copy_us": _copy_us(size)}
            for s in sides:
                row[s.name] = {a: _row(runs[s.name][a], size, ops) for a in APIS}
                for a in ("put", "get", "put_from", "get_into"):
                    row[s.name][a]["p50_us"] = pct(lats[s.name][a], 50) * 1e6
                    row[s.name][a]["p99_us"] = pct(lats[s.name][a], 99) * 1e6
            if te_runs:
                row["engine"] = {
                    k: (
                        {
                            "gb_s": ops
                            * size
                            / statistics.median(r[k]["secs"] for r in te_runs)
                            / 1e9
                        }
                        if isinstance(te_runs[0][k], dict)
                        else statistics.median(r[k] for r in te_runs)
                    )
                    for k in te_runs[0]
                    if k != "bad"
                }
                row["engine"]["bad"] = sum(r["bad"] for r in te_runs)
            result["sizes"][label] = row
            print(f"  {label} done", flush=True)
            for s in sides:
                await s.forget()
    finally:
        for s in sides:
            await s.close()
        if peer is not None:
            peer.close()
        shutil.rmtree(work, ignore_errors=True)
        if ns:
            netns_down()
    return result


def tune_malloc() -> str:
    """Both stores return each value as a fresh ``bytes``; glibc serves big ones with a
    new mmap every time (page faults on every byte, costly in VMs). A fixed mmap
    threshold and no trimming let freed values be reused. Process-wide, so it applies
    to the kvmesh and the Mooncake client alike (they share this process)."""
    try:
        import ctypes

        libc = ctypes.CDLL("libc.so.6")
        ok = libc.mallopt(-3, 64 << 20) and libc.mallopt(-1, 1 << 30)  # MMAP_/TRIM_THRESHOLD
        return "glibc mmap threshold 64 MiB, no trim" if ok else "malloc untuned"
    except OSError:
        return "malloc untuned"


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument(
        "--segment",
        default="1536MiB",
        help="segment each store lends (<= 2GiB; reads hold 10 s leases, so space frees late)",
    )
    ap.add_argument("--quick", action="store_true", help="fewer operations")
    ap.add_argument("--no-mooncake", action="store_true")
    ap.add_argument("--no-tune-malloc", action="store_true", help="keep glibc's defaults")
    ap.add_argument("--rounds", type=int, default=5, help="interleaved rounds per size")
    ap.add_argument(
        "--poll-us",
        default="0,200",
        help="kvmesh busy-poll windows, one cluster each (the first is the compared row)",
    )
    ap.add_argument("--topology", choices=("local", "remote", "netns"), default="remote")
    ap.add_argument(
        "--tls",
        action="store_true",
        help="also a kvmesh row with mutual TLS (gRPC and the raw-TCP control path)",
    )
    ap.add_argument(
        "--sizes",
        default="",
        help="comma-separated subset of " + ",".join(lb for lb, _ in SIZES) + " (default all)",
    )
    ap.add_argument("--out", default="")
    ap.add_argument("--mooncake-holder", default="", help=argparse.SUPPRESS)
    ap.add_argument("--te-peer", default="", help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    if args.mooncake_holder:
        master, host, seg = args.mooncake_holder.split(",")
        _mooncake_holder_main(master, host, int(seg))
        return
    if args.te_peer:
        host, nbytes, poll = args.te_peer.split(",")
        asyncio.run(_te_peer_main(host, int(nbytes), int(poll)))
        return
    polls = [int(p) for p in args.poll_us.split(",") if p.strip()]
    if args.sizes:
        want = [x.strip() for x in args.sizes.split(",") if x.strip()]
        known = {lb for lb, _ in SIZES}
        if bad := [x for x in want if x not in known]:
            ap.error(f"--sizes: unknown {bad}; choose from {sorted(known)}")
        SIZES[:] = [(lb, z) for lb, z in SIZES if lb in want]
    malloc = tune_malloc() if not args.no_tune_malloc else "malloc untuned"
    print(f"topology {args.topology}; one client process for every store; {malloc}", flush=True)
    coro = run_all(
        args.topology,
        args.segment,
        args.quick,
        args.rounds,
        polls,
        not args.no_mooncake,
        args.tls,
    )
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(1))  # run the clean-up
    try:
        import uvloop  # kvmesh's services all run on uvloop

        res = uvloop.run(coro)
    except ImportError:
        res = asyncio.run(coro)
    res.update(
        quick=args.quick,
        segment=args.segment,
        rounds=args.rounds,
        unix_time=time.time(),
        malloc=malloc,
        note="ratio = first kvmesh row / mooncake (ops/s); cpu = client + masters + holders",
    )
    print(table(res))
    for extra in (breakdown(res), goals(res)):
        if extra:
            print(extra)
    out = args.out or os.path.join(
        os.path.dirname(__file__), "results", f"store_{args.topology}.json"
    )
    os.makedirs(os.path.dirname(out), exist_ok=True)
    with open(out, "w") as f:
        json.dump(res, f, indent=2)
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
