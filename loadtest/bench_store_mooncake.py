"""The store benchmark's Mooncake Store side (:mod:`kvmesh.loadtest.bench_store` runs
it against kvmesh's): ``mooncake_master``, a ``MooncakeDistributedStore`` client in the
benchmark's process and, in the remote and netns topologies, a process that only holds
the segment. Mooncake's wheel is optional, never a kvmesh dependency: without it (or
without ``mooncake_master`` on PATH) :meth:`McSide.start` says why the side is skipped.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import time

import numpy as np

from kvmesh.loadtest.bench_store_common import (
    NETNS_IPS,
    Values,
    _free_port,
    _in_ns,
    _put_tag,
    _wait_port,
    pct,
)


def _mooncake_holder_main(master: str, host: str, segment: int) -> None:
    """A process that only mounts a segment on Mooncake's master and waits (stdin)."""
    os.environ.setdefault("GLOG_minloglevel", "2")
    from mooncake.store import MooncakeDistributedStore

    s = MooncakeDistributedStore()
    rc = s.setup(host, "P2PHANDSHAKE", segment, 16 << 20, "tcp", "", master)
    print(json.dumps({"rc": rc}), flush=True)
    sys.stdin.read()
    s.close()


class McSide:
    """``mooncake_master`` and a ``MooncakeDistributedStore`` client in this process;
    in remote/netns topology the client mounts no segment and a holder process does."""

    name = "mooncake"

    def __init__(self, topology: str, segment: int, work: str) -> None:
        self.topology, self.segment, self.work = topology, segment, work
        self.master: subprocess.Popen | None = None
        self.holder: subprocess.Popen | None = None
        self.store = None
        self.buffers: set[int] = set()

    def pids(self) -> list[int]:
        return [p.pid for p in (self.master, self.holder) if p is not None]

    def start(self, ns: str | None) -> str | None:
        """None when ready, else why Mooncake is skipped."""
        os.environ.setdefault("GLOG_minloglevel", "2")
        try:
            from mooncake.store import MooncakeDistributedStore
        except Exception as e:  # optional: never a dependency
            return f"mooncake wheel not usable: {e}"
        binary = shutil.which("mooncake_master")
        if binary is None:
            return "mooncake_master not on PATH"
        peer_host = NETNS_IPS[1] if ns else "127.0.0.1"
        my_host = NETNS_IPS[0] if ns else "127.0.0.1"
        port = _free_port()
        log = open(os.path.join(self.work, "mooncake_master.log"), "ab")
        self.master = subprocess.Popen(
            [
                *_in_ns(ns),
                binary,
                f"--rpc_address={peer_host}",
                f"--rpc_port={port}",
                "--enable_http_metadata_server=false",
                f"--metrics_port={_free_port()}",
            ],
            stdout=log,
            stderr=subprocess.STDOUT,
            start_new_session=True,
        )
        addr = f"{peer_host}:{port}"
        if not _wait_port(peer_host, port, 15):
            return "mooncake_master did not listen in 15 s"
        remote = self.topology != "local"
        if remote:
            self.holder = subprocess.Popen(
                [
                    *_in_ns(ns),
                    sys.executable,
                    "-m",
                    "kvmesh.loadtest.bench_store",
                    "--mooncake-holder",
                    f"{addr},{peer_host},{self.segment}",
                ],
                stdin=subprocess.PIPE,
                stdout=subprocess.PIPE,
                stderr=log,
                start_new_session=True,
            )
            line = self.holder.stdout.readline()
            if not line or json.loads(line)["rc"] != 0:
                return f"mooncake segment holder failed: {line!r}"
        self.store = MooncakeDistributedStore()
        rc = self.store.setup(
            my_host,
            "P2PHANDSHAKE",
            0 if remote else self.segment,
            512 << 20,
            "tcp",
            "",
            addr,
        )
        return None if rc == 0 else f"mooncake setup failed: {rc}"

    def _reg(self, buf: np.ndarray) -> int:
        ptr = buf.ctypes.data
        if ptr not in self.buffers:
            if self.store.register_buffer(ptr, buf.nbytes) != 0:
                raise RuntimeError("mooncake register_buffer failed")
            self.buffers.add(ptr)
        return ptr

    async def forget(self) -> None:
        for ptr in self.buffers:
            self.store.unregister_buffer(ptr)
        self.buffers.clear()

    async def run(self, api: str, v: Values, batch: int, tag: str) -> tuple[dict, list[float]]:
        s, size, n = self.store, v.size, v.ops
        keys = [f"{tag}-{i}" for i in range(n)]
        if api in ("get", "batch_get", "get_into", "batch_get_into"):
            keys = [f"{_put_tag(tag, api)}-{i}" for i in range(n)]
        lat: list[float] = []
        got: list = [None] * n
        bad = 0
        src = self._reg(v.src) if api.endswith(("_from", "_into")) else 0
        dst = self._reg(v.dst) if api.endswith("_into") else 0
        step = batch if api.startswith("batch") else 1
        t0 = time.perf_counter()
        for i in range(0, n, step):
            ks = keys[i : i + step]
            t = time.perf_counter()
            if api == "put":
                bad += s.put(ks[0], v.values[i]) != 0
            elif api == "get":
                got[i] = s.get(ks[0])
            elif api == "batch_put":
                bad += len(ks) * (s.put_batch(ks, v.values[i : i + step]) != 0)
            elif api == "batch_get":
                got[i : i + step] = s.get_batch(ks)
            elif api == "put_from":
                bad += s.put_from(ks[0], src + i * size, size) != 0
            elif api == "get_into":
                bad += s.get_into(ks[0], dst + i * size, size) != size
            elif api == "batch_put_from":
                ptrs = [src + j * size for j in range(i, i + len(ks))]
                bad += sum(1 for r in s.batch_put_from(ks, ptrs, [size] * len(ks)) if r != 0)
            else:
                ptrs = [dst + j * size for j in range(i, i + len(ks))]
                bad += sum(1 for r in s.batch_get_into(ks, ptrs, [size] * len(ks)) if r != size)
            lat.append(time.perf_counter() - t)
        secs = time.perf_counter() - t0
        if api in ("get", "batch_get"):
            bad += v.check_bytes(got)
        elif api.endswith("_into"):
            bad = max(bad, v.check_dst())
        return {"secs": secs, "bad": bad}, lat

    async def remove(self, tags: list[str], n: int) -> None:
        """Mooncake refuses to remove a key under its read lease: forced (the benchmark
        owns these keys), so the next size starts with free space."""
        for tag in tags:
            for i in range(n):
                self.store.remove(f"{tag}-{i}", True)

    async def rtt(self, count: int = 200) -> float:
        lat = []
        for _ in range(count):
            t = time.perf_counter()
            self.store.is_exist("absent-key")
            lat.append(time.perf_counter() - t)
        return pct(lat, 50)

    async def close(self) -> None:
        if self.store is not None:
            await self.forget()
            self.store.close()
        for p in (self.holder, self.master):
            if p is None:
                continue
            if p is self.holder and p.stdin:
                p.stdin.close()
            else:
                p.terminate()
            try:
                p.wait(10)
            except subprocess.TimeoutExpired:
                p.kill()
                p.wait()
