"""Store benchmark: put/get throughput and ops/s for 4 KiB .. 16 MiB values, single and
batched, and small-get / exists latency (p50/p99), for the kvmesh store (a real
store-master process, over loopback) and, when the optional
``mooncake-transfer-engine-non-cuda`` wheel is installed, Mooncake Store side by side
(``mooncake_master`` + ``MooncakeDistributedStore`` over TCP).

Topology (``--topology``):
  * ``local`` (default, the same as Mooncake's side here): the benchmark client lends
    its OWN segment, as the ``MooncakeDistributedStore`` client does in ``setup()``, so
    placements are local-first and the bytes move by memory copy; every operation still
    goes through the master (PutLocal commit / GetReplicas under a lease / Exists);
  * ``remote``: the client lends nothing and a separate store-node process holds the
    segment; bytes cross the transfer engine (TCP on loopback).

    python -m kvmesh.loadtest.bench_store [--segment 1536MiB] [--quick] [--topology remote]

Prints a table and writes ``loadtest/results/store.json``. Every loop is bounded by an
operation count. The Mooncake wheel is never a kvmesh dependency.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import shutil
import socket
import statistics
import subprocess
import tempfile
import time

SIZES = [("4KiB", 4 << 10), ("256KiB", 256 << 10), ("4MiB", 4 << 20), ("16MiB", 16 << 20)]


def plan(size: int, quick: bool) -> tuple[int, int]:
    """(ops, batch) per size: bounded by count and by bytes moved."""
    budget = (64 if quick else 256) << 20
    ops = max(8, min(1000 if quick else 3000, budget // size))
    batch = max(2, min(32, (32 << 20) // size))
    return ops, batch


def pct(xs: list[float], p: float) -> float:
    xs = sorted(xs)
    return xs[min(len(xs) - 1, int(p / 100 * len(xs)))] if xs else 0.0


def record(out: dict, name: str, size: int, n: int, secs: float) -> None:
    out[name] = {"ops_s": n / secs, "gb_s": n * size / secs / 1e9}


# ------------------------------------------------------------------------------ kvmesh
async def kvmesh_size(cl, label: str, size: int, quick: bool) -> dict:
    ops, batch = plan(size, quick)
    val = os.urandom(size)
    r: dict = {}
    keys = [os.urandom(16) for _ in range(ops)]
    lat = []
    t0 = time.perf_counter()
    for k in keys:
        ok = await cl.put(k, val)
        assert ok, "kvmesh put failed"
    record(r, "put", size, ops, time.perf_counter() - t0)
    t0 = time.perf_counter()
    for k in keys:
        t = time.perf_counter()
        v = await cl.get(k)
        lat.append(time.perf_counter() - t)
        assert v is not None and len(v) == size
    record(r, "get", size, ops, time.perf_counter() - t0)
    r["get_p50_us"], r["get_p99_us"] = pct(lat, 50) * 1e6, pct(lat, 99) * 1e6
    await cl.remove(keys)
    bkeys = [os.urandom(16) for _ in range(ops)]
    t0 = time.perf_counter()
    for i in range(0, ops, batch):
        ok = await cl.batch_put(bkeys[i : i + batch], [val] * len(bkeys[i : i + batch]))
        assert all(ok), "kvmesh batch put failed"
    record(r, "batch_put", size, ops, time.perf_counter() - t0)
    t0 = time.perf_counter()
    for i in range(0, ops, batch):
        vs = await cl.batch_get(bkeys[i : i + batch])
        assert all(v is not None for v in vs)
    record(r, "batch_get", size, ops, time.perf_counter() - t0)
    if size == SIZES[0][1]:
        el = []
        for k in bkeys[: min(1000, ops)]:
            t = time.perf_counter()
            assert await cl.exists(k)
            el.append(time.perf_counter() - t)
        r["exists_p50_us"], r["exists_p99_us"] = pct(el, 50) * 1e6, pct(el, 99) * 1e6
    await cl.remove(bkeys)
    return r


# ------------------------------------------------------------------------------ mooncake
def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class Mooncake:
    """``mooncake_master`` + one ``MooncakeDistributedStore`` lending its own segment."""

    def __init__(self, segment_bytes: int) -> None:
        self.segment_bytes = segment_bytes
        self.master: subprocess.Popen | None = None
        self.store = None

    def start(self) -> str | None:
        """None when ready, else why Mooncake is skipped."""
        try:
            from mooncake.store import MooncakeDistributedStore
        except Exception as e:  # optional: never a dependency
            return f"mooncake wheel not usable: {e}"
        binary = shutil.which("mooncake_master")
        if binary is None:
            return "mooncake_master not on PATH"
        port = _free_port()
        log = open(os.path.join(tempfile.gettempdir(), "mooncake_master.log"), "ab")
        self.master = subprocess.Popen(
            [
                binary,
                "--rpc_address=127.0.0.1",
                f"--rpc_port={port}",
                "--enable_http_metadata_server=false",
                f"--metrics_port={_free_port()}",
            ],
            stdout=log,
            stderr=subprocess.STDOUT,
            start_new_session=True,
        )
        time.sleep(1.0)
        self.store = MooncakeDistributedStore()
        rc = self.store.setup(
            "127.0.0.1",
            "P2PHANDSHAKE",
            self.segment_bytes,
            512 << 20,
            "tcp",
            "",
            f"127.0.0.1:{port}",
        )
        if rc != 0:
            return f"mooncake setup failed: {rc}"
        return None

    def size(self, label: str, size: int, quick: bool, rnd: int) -> dict:
        store = self.store
        ops, batch = plan(size, quick)
        val = os.urandom(size)
        r: dict = {}
        keys = [f"s{label}-{rnd}-{i}" for i in range(ops)]
        t0 = time.perf_counter()
        for k in keys:
            assert store.put(k, val) == 0, "mooncake put failed"
        record(r, "put", size, ops, time.perf_counter() - t0)
        lat = []
        t0 = time.perf_counter()
        for k in keys:
            t = time.perf_counter()
            v = store.get(k)
            lat.append(time.perf_counter() - t)
            r["misses"] = r.get("misses", 0) + (len(v) != size)
        record(r, "get", size, ops, time.perf_counter() - t0)
        r["get_p50_us"], r["get_p99_us"] = pct(lat, 50) * 1e6, pct(lat, 99) * 1e6
        self._remove(keys)
        bkeys = [f"b{label}-{rnd}-{i}" for i in range(ops)]
        t0 = time.perf_counter()
        for i in range(0, ops, batch):
            ks = bkeys[i : i + batch]
            assert store.put_batch(ks, [val] * len(ks)) == 0, "mooncake put_batch failed"
        record(r, "batch_put", size, ops, time.perf_counter() - t0)
        t0 = time.perf_counter()
        for i in range(0, ops, batch):
            vs = store.get_batch(bkeys[i : i + batch])
            r["misses"] = r.get("misses", 0) + sum(1 for v in vs if len(v) != size)
        record(r, "batch_get", size, ops, time.perf_counter() - t0)
        if size == SIZES[0][1]:
            el = []
            for k in bkeys[: min(1000, ops)]:
                t = time.perf_counter()
                assert store.is_exist(k) == 1
                el.append(time.perf_counter() - t)
            r["exists_p50_us"], r["exists_p99_us"] = pct(el, 50) * 1e6, pct(el, 99) * 1e6
        self._remove(bkeys)
        return r

    def _remove(self, keys: list[str]) -> None:
        """Mooncake refuses to remove a key under its read lease (10 s by default); the
        benchmark owns these keys, so it forces removal and the next size starts with
        free space."""
        for k in keys:
            self.store.remove(k, True)

    def stop(self) -> None:
        if self.store is not None:
            self.store.close()
        if self.master is not None:
            self.master.terminate()
            try:
                self.master.wait(10)
            except subprocess.TimeoutExpired:
                self.master.kill()


# ------------------------------------------------------------------------------ both
def _median(runs: list[dict]) -> dict:
    """Per-metric median over rounds (throughput rows and latency rows alike)."""
    out: dict = {}
    for key in runs[0]:
        vals = [r[key] for r in runs if key in r]
        if isinstance(vals[0], dict):
            out[key] = {m: statistics.median(v[m] for v in vals) for m in vals[0]}
        else:
            out[key] = statistics.median(vals)
    return out


async def run_both(
    master: str, quick: bool, lend: int, mc: Mooncake | None, rounds: int, poll_us: int = 200
) -> tuple[dict, dict]:
    """Per size, kvmesh then Mooncake, for ``rounds`` rounds, so both see the same
    background load; each metric is the median over rounds."""
    from kvmesh.rdma import TransferEngine
    from kvmesh.services.common.settings import DEV_SECRET
    from kvmesh.services.store.client import StoreClient

    te = TransferEngine(DEV_SECRET.encode(), poll_us=poll_us)
    await te.start()
    cl = StoreClient(te, master, "bench-client", staging_bytes=64 << 20)
    kv: dict = {}
    mcr: dict = {}
    try:
        if lend:
            await cl.lend(lend, timeout=30)
        for label, size in SIZES:
            kruns, mruns = [], []
            for rnd in range(rounds):
                kruns.append(await kvmesh_size(cl, label, size, quick))
                if mc is not None:
                    mruns.append(mc.size(label, size, quick, rnd))
            kv[label] = _median(kruns)
            if mruns:
                mcr[label] = _median(mruns)
            print(f"  {label} done", flush=True)
        kv["client_stats"] = dict(cl.stats)
    finally:
        await cl.close()
        await te.close()
    return kv, mcr


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


def bench(
    segment: str, quick: bool, topology: str, mooncake: bool, rounds: int, poll_us: int = 200
) -> tuple[dict, dict | str]:
    from kvmesh.loadtest.store_cluster import StoreCluster
    from kvmesh.services.common.config import parse_size

    mc: Mooncake | None = None
    why: str | None = "skipped"
    if mooncake:
        mc = Mooncake(parse_size(segment))
        why = mc.start()
        if why is not None:
            mc.stop()
            mc = None
    work = tempfile.mkdtemp(prefix="kvmesh-bench-store-")
    local = topology == "local"
    c = StoreCluster(
        work,
        nodes=0 if local else 1,
        segment=segment,
        lease_ttl=10,
        master_args=["--fast-poll-us", str(poll_us)],
        node_args=["--te-poll-us", str(poll_us)],
    )
    try:
        c.start(timeout=60)
        coro = run_both(c.master, quick, parse_size(segment) if local else 0, mc, rounds, poll_us)
        try:
            import uvloop  # kvmesh's services all run on uvloop

            kv, mcr = uvloop.run(coro)
        except ImportError:
            kv, mcr = asyncio.run(coro)
        return kv, (mcr if mc is not None else why)
    finally:
        c.stop()
        shutil.rmtree(work, ignore_errors=True)
        if mc is not None:
            mc.stop()


# ------------------------------------------------------------------------------ report
def table(kv: dict, mc: dict | str) -> str:
    rows = [f"{'size':>7} {'metric':<10} {'kvmesh':>14} {'mooncake':>14} {'ratio':>7}"]
    for label, _ in SIZES:
        for m in ("put", "get", "batch_put", "batch_get"):
            a = kv[label][m]
            b = mc[label][m] if isinstance(mc, dict) else None
            unit = "ops_s" if label == "4KiB" else "gb_s"
            fa = f"{a[unit]:,.0f} op/s" if unit == "ops_s" else f"{a[unit]:.2f} GB/s"
            fb = (
                "-"
                if b is None
                else (f"{b[unit]:,.0f} op/s" if unit == "ops_s" else f"{b[unit]:.2f} GB/s")
            )
            ratio = "-" if b is None else f"{a[unit] / b[unit]:.2f}x"
            rows.append(f"{label:>7} {m:<10} {fa:>14} {fb:>14} {ratio:>7}")
    k4 = kv["4KiB"]
    m4 = mc["4KiB"] if isinstance(mc, dict) else {}
    for m in ("get_p50_us", "get_p99_us", "exists_p50_us", "exists_p99_us"):
        b = m4.get(m)
        rows.append(
            f"{'4KiB':>7} {m:<10} {k4[m]:>11.0f} us "
            f"{'-' if b is None else f'{b:>11.0f} us':>14} "
            f"{'-' if b is None else f'{b / k4[m]:.2f}x':>7}"
        )
    return "\n".join(rows)


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--segment", default="1536MiB", help="segment each side lends (<= 2GiB)")
    ap.add_argument("--quick", action="store_true", help="fewer operations")
    ap.add_argument("--no-mooncake", action="store_true")
    ap.add_argument(
        "--no-tune-malloc",
        action="store_true",
        help="keep glibc's default (dynamic) mmap threshold",
    )
    ap.add_argument(
        "--rounds",
        type=int,
        default=1,
        help="rounds per size (kvmesh and mooncake alternate); medians reported",
    )
    ap.add_argument(
        "--poll-us",
        type=int,
        default=200,
        help="busy-poll window of kvmesh's client, master and store node (0 = off)",
    )
    ap.add_argument(
        "--topology",
        choices=("local", "remote"),
        default="local",
        help="local: the kvmesh client lends its own segment (as Mooncake's "
        "does); remote: a store-node process lends it",
    )
    ap.add_argument(
        "--out", default=os.path.join(os.path.dirname(__file__), "results", "store.json")
    )
    args = ap.parse_args(argv)
    topo = (
        "kvmesh client lends its own segment (local-first puts, local-copy gets), "
        "store-master in another process"
        if args.topology == "local"
        else "kvmesh client lends nothing; one store-node process lends the segment "
        "(transfer engine over loopback TCP)"
    )
    topo_mc = "mooncake client lends its own segment (setup), mooncake_master in another process"
    print(f"topology: kvmesh: {topo}\n          mooncake: {topo_mc}", flush=True)
    malloc = tune_malloc() if not args.no_tune_malloc else "malloc untuned"
    print(f"one client process for both stores: {malloc}", flush=True)
    print("kvmesh and mooncake stores, interleaved per size ...", flush=True)
    kv, mc = bench(
        args.segment, args.quick, args.topology, not args.no_mooncake, args.rounds, args.poll_us
    )
    print(f"topology: kvmesh: {topo}; mooncake: {topo_mc}; {malloc}")
    print(table(kv, mc))
    if isinstance(mc, str):
        print(f"mooncake: {mc}")
    os.makedirs(os.path.dirname(args.out), exist_ok=True)
    with open(args.out, "w") as f:
        json.dump(
            {
                "kvmesh": kv,
                "mooncake": mc,
                "quick": args.quick,
                "segment": args.segment,
                "unix_time": time.time(),
                "rounds": args.rounds,
                "topology": {"kvmesh": topo, "mooncake": topo_mc},
                "malloc": malloc,
                "note": "ratio = kvmesh / mooncake (latency rows: mooncake / kvmesh)",
            },
            f,
            indent=2,
        )
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
