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
import importlib.util
import json
import os
import platform
import resource
import socket
import statistics
import struct
import subprocess
import sys
import threading
import time
import zlib
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from kvmesh.rdma import Slice, TransferEngine  # noqa: E402

KiB, MiB = 1 << 10, 1 << 20
BLOCKS = [64 * KiB, 1 * MiB, 16 * MiB, 64 * MiB]
OPS = ("write", "read")
MODES = ("batched", "single")
STREAM_BUF = 4 * MiB
# Reference: Mooncake transfer engine, TCP transport, batched (GB/s), used
# when the wheel is not installed.
MOONCAKE = {
    "write": {64 * KiB: 1.1, MiB: 1.7, 16 * MiB: 1.8, 64 * MiB: 1.8},
    "read": {64 * KiB: 1.2, MiB: 2.0, 16 * MiB: 1.8, 64 * MiB: 1.8},
}
MOONCAKE_MAX_BATCH = 1024  # entries per Mooncake batch call (see _mooncake_client_main)
SECRET = b"bench-secret"
RESULTS = Path(__file__).resolve().parent / "results" / "transfer.json"


def _peak_rss_mib() -> float:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024  # KiB on Linux


# -- peer process ---------------------------------------------------------------
def _stream_conn(conn: socket.socket) -> None:
    """One baseline connection: per run, an 8-byte length, that many bytes received
    with recv_into into a buffer that keeps them all; a 1-byte ack (the sender's clock
    stops there), then the CRC-32 of what came, for the sender to check."""
    keep = bytearray()
    with conn:
        conn.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        while True:
            hdr = conn.recv(8, socket.MSG_WAITALL)
            if len(hdr) < 8:
                return
            size = struct.unpack("!Q", hdr)[0]
            if len(keep) != size:
                keep = bytearray(size)
            view, got = memoryview(keep), 0
            while got < size:
                n = conn.recv_into(view[got : got + min(size - got, STREAM_BUF)])
                if not n:
                    return
                got += n
            conn.sendall(b"k")
            conn.sendall(struct.pack("!I", zlib.crc32(keep)))


def _stream_sink(ls: socket.socket) -> None:
    """Plain-socket baseline server: a thread per connection (:func:`_stream_conn`)."""
    while True:
        try:
            conn, _ = ls.accept()
        except OSError:
            return
        threading.Thread(target=_stream_conn, args=(conn,), daemon=True).start()


async def _peer_main(total: int, conns: int, chunk: int) -> None:
    eng = TransferEngine(SECRET, conns_per_peer=conns, chunk_bytes=chunk)
    await eng.start()
    region = np.zeros(total, dtype=np.uint8)
    rid = eng.register(region)
    ls = socket.create_server(("127.0.0.1", 0))
    threading.Thread(target=_stream_sink, args=(ls,), daemon=True).start()
    print(
        json.dumps({"address": eng.address, "region": rid, "stream_port": ls.getsockname()[1]}),
        flush=True,
    )
    await asyncio.to_thread(sys.stdin.read)  # until the parent closes stdin
    ls.close()
    await eng.close()
    print(json.dumps({"peak_rss_mib": _peak_rss_mib()}), flush=True)


# -- Mooncake (optional wheel; child processes only) ---------------------------------
def _mooncake_engine():
    os.environ.setdefault("GLOG_minloglevel", "2")
    from mooncake.engine import TransferEngine as MooncakeEngine

    te = MooncakeEngine()
    rc = te.initialize("127.0.0.1", "P2PHANDSHAKE", "tcp", "")
    if rc != 0:
        raise RuntimeError(f"mooncake initialize failed: rc={rc}")
    return te


def _mooncake_peer_main(total: int) -> None:
    te = _mooncake_engine()
    region = np.zeros(total, dtype=np.uint8)
    if te.register_memory(region.ctypes.data, total) != 0:
        raise RuntimeError("mooncake register_memory failed")
    print(json.dumps({"port": te.get_rpc_port(), "addr": region.ctypes.data}), flush=True)
    sys.stdin.read()
    print(json.dumps({"peak_rss_mib": _peak_rss_mib()}), flush=True)


def _mooncake_client_main(total: int, max_point_s: float) -> None:
    """Spawn a Mooncake peer, then measure one repetition per stdin command
    (``{"bs", "op", "mode"}`` -> ``{"gbps"}``); EOF ends it with RSS figures."""
    peer_proc = subprocess.Popen(
        [
            sys.executable,
            os.path.abspath(__file__),
            "--mooncake-peer",
            "--total-mib",
            str(total // MiB),
        ],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        stderr=subprocess.DEVNULL,
        text=True,
    )
    res: dict = {}
    try:
        peer = json.loads(peer_proc.stdout.readline())
        te = _mooncake_engine()
        local = np.random.default_rng(0).integers(0, 256, size=total, dtype=np.uint8)
        base, rbase = local.ctypes.data, peer["addr"]
        if te.register_memory(base, total) != 0:
            raise RuntimeError("mooncake register_memory failed")
        target = f"127.0.0.1:{peer['port']}"
        if te.batch_transfer_sync_write(target, [base], [rbase], [total]) != 0:
            raise RuntimeError("mooncake warm-up write failed")
        print(json.dumps({"ready": True}), flush=True)

        def batched(op: str, offs: list[int], bs: int) -> int:
            batch = te.batch_transfer_sync_write if op == "write" else te.batch_transfer_sync_read
            # Mooncake's TCP lane rejects very large batches ("queue-full"),
            # so submit at most MOONCAKE_MAX_BATCH entries per call.
            for i in range(0, len(offs), MOONCAKE_MAX_BATCH):
                part = offs[i : i + MOONCAKE_MAX_BATCH]
                if (
                    batch(
                        target,
                        [base + o for o in part],
                        [rbase + o for o in part],
                        [bs] * len(part),
                    )
                    != 0
                ):
                    raise RuntimeError(f"mooncake batched {op} failed")
            return len(offs) * bs

        def single(op: str, offs: list[int], bs: int) -> int:
            one = te.transfer_sync_write if op == "write" else te.transfer_sync_read
            t0, done = time.perf_counter(), 0
            for o in offs:
                if one(target, base + o, rbase + o, bs) != 0:
                    raise RuntimeError(f"mooncake {op} failed")
                done += bs
                if time.perf_counter() - t0 > max_point_s:
                    break
            return done

        for line in sys.stdin:
            cmd = json.loads(line)
            bs = int(cmd["bs"])
            offs = [i * bs for i in range(max(1, total // bs))]
            fn = batched if cmd["mode"] == "batched" else single
            t0 = time.perf_counter()
            nbytes = fn(cmd["op"], offs, bs)
            print(json.dumps({"gbps": nbytes / (time.perf_counter() - t0) / 1e9}), flush=True)
        res["peak_rss_mib"] = _peak_rss_mib()
    finally:
        peer_proc.stdin.close()
        try:
            tail = peer_proc.stdout.read().strip().splitlines()
            peer_proc.wait(10)
        except subprocess.TimeoutExpired:
            peer_proc.kill()
            tail = []
    res["peer_peak_rss_mib"] = json.loads(tail[-1])["peak_rss_mib"] if tail else None
    print(json.dumps(res), flush=True)


class _Mooncake:
    """Driver of the Mooncake client child process (one repetition per call)."""

    TIMEOUT_S = 120.0

    def __init__(self, total: int, max_point_s: float) -> None:
        self.proc = subprocess.Popen(
            [
                sys.executable,
                os.path.abspath(__file__),
                "--mooncake-client",
                "--total-mib",
                str(total // MiB),
                "--max-point-s",
                str(max_point_s),
            ],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=subprocess.DEVNULL,
            text=True,
        )
        self._reply()  # {"ready": true}

    def _reply(self) -> dict:
        import select

        ready, _, _ = select.select([self.proc.stdout], [], [], self.TIMEOUT_S)
        line = self.proc.stdout.readline() if ready else ""
        if not line:
            raise RuntimeError("mooncake client died or timed out")
        return json.loads(line)

    def rep(self, bs: int, op: str, mode: str) -> float:
        self.proc.stdin.write(json.dumps({"bs": bs, "op": op, "mode": mode}) + "\n")
        self.proc.stdin.flush()
        return float(self._reply()["gbps"])

    def close(self) -> dict:
        try:
            self.proc.stdin.close()
            out = self._reply()
            self.proc.wait(10)
            return out
        except (RuntimeError, ValueError, OSError, subprocess.TimeoutExpired):
            self.proc.kill()
            return {}


def _start_mooncake(total: int, max_point_s: float) -> tuple[_Mooncake | None, str]:
    """A Mooncake driver, or (None, reason) when the wheel is missing/broken."""
    if importlib.util.find_spec("mooncake") is None:
        return None, (
            "mooncake-transfer-engine-non-cuda is not installed; using the "
            "hard-coded reference figures (batched only)"
        )
    try:
        return _Mooncake(total, max_point_s), (
            "Mooncake TransferEngine (tcp, "
            "P2PHANDSHAKE) measured in this run, "
            "interleaved with kvmesh"
        )
    except (RuntimeError, ValueError, OSError) as e:
        return None, f"Mooncake start failed ({e!r}); using the reference figures"


# -- measuring side ---------------------------------------------------------------
class _Stream:
    """The baseline: ``conns`` TCP connections, each sending its share of ``src`` at
    once (a thread each, as the engine's connections run on threads)."""

    def __init__(self, port: int, src: np.ndarray, conns: int) -> None:
        total = len(src)
        step = -(-total // conns)
        self.shares = [memoryview(src[i : i + step]) for i in range(0, total, step)]
        self.crcs = [zlib.crc32(sh) for sh in self.shares]
        self.socks = []
        for _ in self.shares:
            s = socket.create_connection(("127.0.0.1", port))
            s.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            self.socks.append(s)
        self.pool = ThreadPoolExecutor(len(self.socks))
        self.total = total

    @staticmethod
    def _send(s: socket.socket, share: memoryview) -> None:
        s.sendall(struct.pack("!Q", len(share)))
        for i in range(0, len(share), STREAM_BUF):
            s.sendall(share[i : i + STREAM_BUF])
        if s.recv(1, socket.MSG_WAITALL) != b"k":
            raise RuntimeError("stream baseline: the sink did not ack")

    def once(self) -> float:
        """GB/s of one run (all connections at once); then checks every byte's CRC."""
        t0 = time.perf_counter()
        list(self.pool.map(self._send, self.socks, self.shares))
        secs = time.perf_counter() - t0
        for s, crc in zip(self.socks, self.crcs):
            got = struct.unpack("!I", s.recv(4, socket.MSG_WAITALL))[0]
            if got != crc:
                raise RuntimeError("stream baseline: the sink received other bytes")
        return self.total / secs / 1e9

    def close(self) -> None:
        self.pool.shutdown()
        for s in self.socks:
            s.close()


async def _engine_rates(
    peer: dict,
    total: int,
    reps: int,
    conns: int,
    chunk: int,
    max_point_s: float,
    mc: _Mooncake | None,
) -> dict:
    eng = TransferEngine(SECRET, conns_per_peer=conns, chunk_bytes=chunk)
    await eng.start()
    rng = np.random.default_rng(0)
    # two sources of different bytes (write repetitions alternate), and a buffer that
    # reads land in and write repetitions are read back into, to verify every byte
    srcs = [rng.integers(0, 256, size=total, dtype=np.uint8) for _ in range(2)]
    src_ids = [eng.register(a) for a in srcs]
    check = np.zeros(total, dtype=np.uint8)
    check_id = eng.register(check)
    held = 0  # which source the peer's region holds
    verified = 0
    addr, rrid = peer["address"], peer["region"]
    out: dict = {op: {m: {} for m in MODES} for op in OPS}
    mc_out: dict = {op: {m: {} for m in MODES} for op in OPS}
    rss: dict = {}
    stream_runs: list[float] = []
    stream = _Stream(peer["stream_port"], srcs[1], conns)

    async def verify(kind: str, nbytes: int) -> None:
        """After a repetition: every byte it moved is where it should be."""
        nonlocal verified
        if kind == "write":  # read back what was written
            check[:nbytes] = 0
            await eng.read(addr, [Slice(check_id, 0, rrid, 0, nbytes)])
        if not np.array_equal(check[:nbytes], srcs[held][:nbytes]):
            raise RuntimeError(f"{kind}: the bytes moved differ from the source")
        verified += nbytes

    mc_error = None
    try:
        # warm-up: open the connections and fault in both regions
        await eng.write(addr, [Slice(src_ids[0], 0, rrid, 0, total)])
        await eng.read(addr, [Slice(check_id, 0, rrid, 0, total)])
        stream.once()
        for bs in BLOCKS:
            n = max(1, total // bs)
            for kind in OPS:
                op = eng.write if kind == "write" else eng.read

                def slices_of(src_id: int, n=n, bs=bs) -> list[Slice]:
                    return [Slice(src_id, i * bs, rrid, i * bs, bs) for i in range(n)]

                async def batched(sl):
                    await op(addr, sl)
                    return n * bs

                async def single(sl):
                    t0, done = time.perf_counter(), 0
                    for s in sl:
                        await op(addr, [s])
                        done += s.length
                        if time.perf_counter() - t0 > max_point_s:
                            break
                    return done

                for mode, fn in (("batched", batched), ("single", single)):
                    rates, mc_rates = [], []

                    async def kv_rep():
                        nonlocal held
                        if kind == "write":  # the other pattern than the peer holds
                            which = 1 - held
                            sl = slices_of(src_ids[which])
                        else:
                            check.fill(0)
                            sl = slices_of(check_id)
                        t0 = time.perf_counter()
                        nbytes = await fn(sl)
                        rates.append(nbytes / (time.perf_counter() - t0) / 1e9)
                        if kind == "write":
                            # a partial (single-mode) write leaves the old pattern past
                            # nbytes: copy it forward so the peer holds one source
                            if nbytes < total:
                                await eng.write(
                                    addr,
                                    [Slice(src_ids[which], nbytes, rrid, nbytes, total - nbytes)],
                                )
                            held = which
                        await verify(kind, nbytes)

                    for rep in range(reps):
                        if mc is not None and mc_error is None and rep % 2:
                            try:
                                mc_rates.append(await asyncio.to_thread(mc.rep, bs, kind, mode))
                            except (RuntimeError, ValueError, OSError) as e:
                                mc_error = repr(e)
                        await kv_rep()
                        if mc is not None and mc_error is None and not rep % 2:
                            try:
                                mc_rates.append(await asyncio.to_thread(mc.rep, bs, kind, mode))
                            except (RuntimeError, ValueError, OSError) as e:
                                mc_error = repr(e)
                        stream_runs.append(await asyncio.to_thread(stream.once))
                    out[kind][mode][bs] = statistics.median(rates)
                    if mc_rates:
                        mc_out[kind][mode][bs] = statistics.median(mc_rates)
                    rss[(kind, mode, bs)] = _peak_rss_mib()
        bw = eng.bandwidth(addr)
    finally:
        stream.close()
        await eng.close()
    return {
        "rates": out,
        "mooncake": mc_out,
        "mooncake_error": mc_error,
        "rss": rss,
        "bandwidth": bw,
        "stream_runs": stream_runs,
        "verified_bytes": verified,
    }


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
        asyncio.run(_peer_main(total, args.conns, chunk))
        return
    if args.mooncake_peer:
        _mooncake_peer_main(total)
        return
    if args.mooncake_client:
        _mooncake_client_main(total, args.max_point_s)
        return

    t_start = time.perf_counter()
    if args.no_mooncake:
        mc, mc_note = None, "--no-mooncake: using the hard-coded reference figures"
    else:
        mc, mc_note = _start_mooncake(total, args.max_point_s)
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
            _engine_rates(peer, total, args.reps, args.conns, chunk, args.max_point_s, mc)
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
    kv_rss = _peak_rss_mib()
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
