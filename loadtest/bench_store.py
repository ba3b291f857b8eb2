"""Store benchmark: put/get throughput and ops/s for 4 KiB .. 16 MiB values, single and
batched, and small-get / exists latency (p50/p99), for the kvmesh store (a real
store-master process + one store-node process lending a segment, over loopback) and,
when the optional ``mooncake-transfer-engine-non-cuda`` wheel is installed, Mooncake
Store side by side (``mooncake_master`` + ``MooncakeDistributedStore`` over TCP).

    python -m loadtest.bench_store [--segment 1536MiB] [--quick]

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
async def bench_kvmesh_async(master: str, quick: bool) -> dict:
    from rdma import TransferEngine
    from services.common.settings import DEV_SECRET
    from services.store.client import StoreClient

    te = TransferEngine(DEV_SECRET.encode())
    await te.start()
    cl = StoreClient(te, master, "bench-client", staging_bytes=64 << 20)
    res: dict = {}
    try:
        for label, size in SIZES:
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
                ok = await cl.batch_put(bkeys[i:i + batch], [val] * len(bkeys[i:i + batch]))
                assert all(ok), "kvmesh batch put failed"
            record(r, "batch_put", size, ops, time.perf_counter() - t0)
            t0 = time.perf_counter()
            for i in range(0, ops, batch):
                vs = await cl.batch_get(bkeys[i:i + batch])
                assert all(v is not None for v in vs)
            record(r, "batch_get", size, ops, time.perf_counter() - t0)
            if size == SIZES[0][1]:
                el = []
                for k in bkeys[:min(1000, ops)]:
                    t = time.perf_counter()
                    assert await cl.exists(k)
                    el.append(time.perf_counter() - t)
                r["exists_p50_us"], r["exists_p99_us"] = pct(el, 50) * 1e6, pct(el, 99) * 1e6
            await cl.remove(bkeys)
            res[label] = r
            print(f"  kvmesh {label} done", flush=True)
    finally:
        await cl.close()
        await te.close()
    return res


def bench_kvmesh(segment: str, quick: bool) -> dict:
    from services.store.local import StoreCluster

    work = tempfile.mkdtemp(prefix="kvmesh-bench-store-")
    c = StoreCluster(work, nodes=1, segment=segment, lease_ttl=10)
    try:
        c.start(timeout=60)
        return asyncio.run(bench_kvmesh_async(c.master, quick))
    finally:
        c.stop()
        shutil.rmtree(work, ignore_errors=True)


# ------------------------------------------------------------------------------ mooncake
def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def bench_mooncake(segment_bytes: int, quick: bool) -> dict | str:
    try:
        from mooncake.store import MooncakeDistributedStore
    except Exception as e:  # optional: never a dependency
        return f"mooncake wheel not usable: {e}"
    binary = shutil.which("mooncake_master")
    if binary is None:
        return "mooncake_master not on PATH"
    port = _free_port()
    log = open(os.path.join(tempfile.gettempdir(), "mooncake_master.log"), "ab")
    master = subprocess.Popen([binary, "--rpc_address=127.0.0.1", f"--rpc_port={port}",
                               "--enable_http_metadata_server=false",
                               f"--metrics_port={_free_port()}"],
                              stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
    try:
        time.sleep(1.0)
        store = MooncakeDistributedStore()
        rc = store.setup("127.0.0.1", "P2PHANDSHAKE", segment_bytes, 512 << 20, "tcp", "",
                         f"127.0.0.1:{port}")
        if rc != 0:
            return f"mooncake setup failed: {rc}"
        res: dict = {}
        for label, size in SIZES:
            ops, batch = plan(size, quick)
            val = os.urandom(size)
            r: dict = {}
            keys = [f"s{label}-{i}" for i in range(ops)]
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
            for k in keys:
                store.remove(k)
            bkeys = [f"b{label}-{i}" for i in range(ops)]
            t0 = time.perf_counter()
            for i in range(0, ops, batch):
                ks = bkeys[i:i + batch]
                assert store.put_batch(ks, [val] * len(ks)) == 0, "mooncake put_batch failed"
            record(r, "batch_put", size, ops, time.perf_counter() - t0)
            t0 = time.perf_counter()
            for i in range(0, ops, batch):
                vs = store.get_batch(bkeys[i:i + batch])
                r["misses"] = r.get("misses", 0) + sum(1 for v in vs if len(v) != size)
            record(r, "batch_get", size, ops, time.perf_counter() - t0)
            if size == SIZES[0][1]:
                el = []
                for k in bkeys[:min(1000, ops)]:
                    t = time.perf_counter()
                    assert store.is_exist(k) == 1
                    el.append(time.perf_counter() - t)
                r["exists_p50_us"], r["exists_p99_us"] = pct(el, 50) * 1e6, pct(el, 99) * 1e6
            for k in bkeys:
                store.remove(k)
            res[label] = r
            print(f"  mooncake {label} done", flush=True)
        store.close()
        return res
    finally:
        master.terminate()
        try:
            master.wait(10)
        except subprocess.TimeoutExpired:
            master.kill()


# ------------------------------------------------------------------------------ report
def table(kv: dict, mc: dict | str) -> str:
    rows = [f"{'size':>7} {'metric':<10} {'kvmesh':>14} {'mooncake':>14} {'ratio':>7}"]
    for label, _ in SIZES:
        for m in ("put", "get", "batch_put", "batch_get"):
            a = kv[label][m]
            b = mc[label][m] if isinstance(mc, dict) else None
            unit = "ops_s" if label == "4KiB" else "gb_s"
            fa = f"{a[unit]:,.0f} op/s" if unit == "ops_s" else f"{a[unit]:.2f} GB/s"
            fb = "-" if b is None else (f"{b[unit]:,.0f} op/s" if unit == "ops_s"
                                        else f"{b[unit]:.2f} GB/s")
            ratio = "-" if b is None else f"{a[unit] / b[unit]:.2f}x"
            rows.append(f"{label:>7} {m:<10} {fa:>14} {fb:>14} {ratio:>7}")
    k4 = kv["4KiB"]
    m4 = mc["4KiB"] if isinstance(mc, dict) else {}
    for m in ("get_p50_us", "get_p99_us", "exists_p50_us", "exists_p99_us"):
        b = m4.get(m)
        rows.append(f"{'4KiB':>7} {m:<10} {k4[m]:>11.0f} us "
                    f"{'-' if b is None else f'{b:>11.0f} us':>14} "
                    f"{'-' if b is None else f'{b / k4[m]:.2f}x':>7}")
    return "\n".join(rows)


def main(argv: list[str] | None = None) -> None:
    from services.common.config import parse_size

    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--segment", default="1536MiB", help="segment each side lends (<= 2GiB)")
    ap.add_argument("--quick", action="store_true", help="fewer operations")
    ap.add_argument("--no-mooncake", action="store_true")
    ap.add_argument("--out", default=os.path.join(os.path.dirname(__file__), "results",
                                                  "store.json"))
    args = ap.parse_args(argv)
    print("kvmesh store ...", flush=True)
    kv = bench_kvmesh(args.segment, args.quick)
    mc: dict | str = "skipped"
    if not args.no_mooncake:
        print("mooncake store ...", flush=True)
        mc = bench_mooncake(parse_size(args.segment), args.quick)
    print(table(kv, mc))
    if isinstance(mc, str):
        print(f"mooncake: {mc}")
    os.makedirs(os.path.dirname(args.out), exist_ok=True)
    with open(args.out, "w") as f:
        json.dump({"kvmesh": kv, "mooncake": mc, "quick": args.quick,
                   "segment": args.segment, "unix_time": time.time(),
                   "note": "ratio = kvmesh / mooncake (latency rows: mooncake / kvmesh)"},
                  f, indent=2)
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
