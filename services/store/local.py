"""A store-only local cluster as real processes (etcd, one store-master, N store-nodes),
for the store's integration tests and ``loadtest/bench_store.py``."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time

import grpc

from kvmesh.protos import kvmesh_pb2 as pb
from kvmesh.protos import kvmesh_pb2_grpc as pbg
from kvmesh.services.launcher import Etcd, free_port


class StoreCluster:
    def __init__(
        self,
        workdir: str,
        nodes: int = 1,
        segment: str = "64MiB",
        master_args: list[str] | None = None,
        node_args: list[str] | None = None,
        lease_ttl: int = 3,
        cluster: str = "store",
    ) -> None:
        self.workdir = workdir
        os.makedirs(workdir, exist_ok=True)
        self.n_nodes, self.segment = nodes, segment
        self.master_args = master_args or []
        self.node_args = node_args or []
        self.lease_ttl, self.cluster = lease_ttl, cluster
        self.etcd = Etcd(os.path.join(workdir, "etcd"), log_path=os.path.join(workdir, "etcd.log"))
        self.master_port = free_port()
        self.procs: dict[str, subprocess.Popen] = {}

    @property
    def master(self) -> str:
        return f"127.0.0.1:{self.master_port}"

    def _spawn(self, name: str, argv: list[str]) -> subprocess.Popen:
        log = open(os.path.join(self.workdir, f"{name}.log"), "ab")
        common = [
            "--cluster",
            self.cluster,
            "--etcd",
            self.etcd.endpoint,
            "--node-id",
            name,
            "--lease-ttl",
            str(self.lease_ttl),
            "--grace-s",
            "0",
        ]
        p = subprocess.Popen(
            [sys.executable, *argv, *common],
            stdout=log,
            stderr=subprocess.STDOUT,
            start_new_session=True,
            env={**os.environ, "PYTHONUNBUFFERED": "1"},
        )
        self.procs[name] = p
        return p

    def start_master(self) -> None:
        self._spawn(
            "store-master-0",
            [
                "-m",
                "kvmesh.services.cli",
                "store-master",
                "--port",
                str(self.master_port),
                *self.master_args,
            ],
        )

    def start_node(self, i: int, extra: list[str] | None = None) -> None:
        self._spawn(
            f"store-node-{i}",
            [
                "-m",
                "kvmesh.services.store.node",
                "--segment-memory",
                self.segment,
                *self.node_args,
                *(extra or []),
            ],
        )

    def start(self, timeout: float = 30) -> StoreCluster:
        self.etcd.start()
        self.start_master()
        for i in range(self.n_nodes):
            self.start_node(i)
        self.wait_segments(self.n_nodes, timeout)
        return self

    def stats(self, timeout: float = 2) -> pb.StoreStatsResponse:
        with grpc.insecure_channel(self.master) as ch:
            return pbg.StoreMasterStub(ch).Stats(pb.StoreStatsRequest(), timeout=timeout)

    def wait(self, pred, timeout: float = 30, what: str = "condition") -> pb.StoreStatsResponse:
        deadline = time.monotonic() + timeout
        last = None
        while time.monotonic() < deadline:
            for name, p in self.procs.items():
                if p.poll() is not None and p.returncode not in (0, -9, -15):
                    raise RuntimeError(f"{name} exited with {p.returncode}; see {self.workdir}")
            try:
                last = self.stats()
                if pred(last):
                    return last
            except grpc.RpcError:
                pass
            time.sleep(0.1)
        raise TimeoutError(f"store cluster: {what} not reached in {timeout}s (last: {last})")

    def wait_segments(self, n: int, timeout: float = 30) -> None:
        self.wait(lambda s: s.segments == n, timeout, f"{n} segment(s) mounted")

    def kill(self, name: str, sig: int = signal.SIGKILL) -> None:
        p = self.procs[name]
        if p.poll() is None:
            p.send_signal(sig)
            p.wait(30)

    def stop(self) -> None:
        for _name, p in self.procs.items():
            if p.poll() is None:
                p.send_signal(signal.SIGTERM)
        for p in self.procs.values():
            try:
                p.wait(10)
            except subprocess.TimeoutExpired:
                p.kill()
                p.wait()
        self.etcd.stop()
