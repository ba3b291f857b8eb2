"""Mooncake's TransferEngine as a contender of :mod:`kvmesh.loadtest.bench_transfer`: the
optional ``mooncake-transfer-engine-non-cuda`` wheel, imported only in two child processes
(``--mooncake-client`` and its ``--mooncake-peer``), driven from the measuring process by
:class:`Mooncake`; :data:`MOONCAKE` holds the reference figures used without the wheel."""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys
import time

import numpy as np

from kvmesh.loadtest.bench_transfer_peer import KiB, MiB, peak_rss_mib

# Reference: Mooncake transfer engine, TCP transport, batched (GB/s), used
# when the wheel is not installed.
MOONCAKE = {
    "write": {64 * KiB: 1.1, MiB: 1.7, 16 * MiB: 1.8, 64 * MiB: 1.8},
    "read": {64 * KiB: 1.2, MiB: 2.0, 16 * MiB: 1.8, 64 * MiB: 1.8},
}
MOONCAKE_MAX_BATCH = 1024  # entries per Mooncake batch call (see mooncake_client_main)
# the benchmark's script: the Mooncake child processes are started as it is
BENCH = os.path.join(os.path.dirname(os.path.abspath(__file__)), "bench_transfer.py")


def _mooncake_engine():
    os.environ.setdefault("GLOG_minloglevel", "2")
    from mooncake.engine import TransferEngine as MooncakeEngine

    te = MooncakeEngine()
    rc = te.initialize("127.0.0.1", "P2PHANDSHAKE", "tcp", "")
    if rc != 0:
        raise RuntimeError(f"mooncake initialize failed: rc={rc}")
    return te


def mooncake_peer_main(total: int) -> None:
    te = _mooncake_engine()
    region = np.zeros(total, dtype=np.uint8)
    if te.register_memory(region.ctypes.data, total) != 0:
        raise RuntimeError("mooncake register_memory failed")
    print(json.dumps({"port": te.get_rpc_port(), "addr": region.ctypes.data}), flush=True)
    sys.stdin.read()
    print(json.dumps({"peak_rss_mib": peak_rss_mib()}), flush=True)


def mooncake_client_main(total: int, max_point_s: float) -> None:
    """Spawn a Mooncake peer, then measure one repetition per stdin command
    (``{"bs", "op", "mode"}`` -> ``{"gbps"}``); EOF ends it with RSS figures."""
    peer_proc = subprocess.Popen(
        [
            sys.executable,
            BENCH,
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
        res["peak_rss_mib"] = peak_rss_mib()
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


class Mooncake:
    """Driver of the Mooncake client child process (one repetition per call)."""

    TIMEOUT_S = 120.0

    def __init__(self, total: int, max_point_s: float) -> None:
        self.proc = subprocess.Popen(
            [
                sys.executable,
                BENCH,
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


def start_mooncake(total: int, max_point_s: float) -> tuple[Mooncake | None, str]:
    """A Mooncake driver, or (None, reason) when the wheel is missing/broken."""
    if importlib.util.find_spec("mooncake") is None:
        return None, (
            "mooncake-transfer-engine-non-cuda is not installed; using the "
            "hard-coded reference figures (batched only)"
        )
    try:
        return Mooncake(total, max_point_s), (
            "Mooncake TransferEngine (tcp, "
            "P2PHANDSHAKE) measured in this run, "
            "interleaved with kvmesh"
        )
    except (RuntimeError, ValueError, OSError) as e:
        return None, f"Mooncake start failed ({e!r}); using the reference figures"
