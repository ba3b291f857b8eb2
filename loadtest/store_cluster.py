"""A store-only local cluster as real processes (etcd, one store-master, N store-nodes):
test and benchmark scaffolding for the store's integration tests and
:mod:`kvmesh.loadtest.bench_store`, not part of the services.

The store-master and the nodes bind port 0 (any free port); the cluster learns the
master's address from its etcd registration (``node_key(cluster, "store-master", id)``,
whose value holds ``"grpc"``), so no port is chosen here and bound later by another
process. Call it from synchronous code (it runs its etcd look-ups with ``asyncio.run``).
"""

from __future__ import annotations

import asyncio
import json
import os
import signal
import subprocess
import sys
import time
import urllib.request
from typing import Any

import grpc
from prometheus_client.parser import text_string_to_metric_families

from kvmesh.protos import kvmesh_pb2 as pb
from kvmesh.protos import kvmesh_pb2_grpc as pbg
from kvmesh.services.children import spawn_tied
from kvmesh.services.common.channels import TlsFiles, make_sync_channel
from kvmesh.services.common.etcd import EtcdClient, EtcdError
from kvmesh.services.common.registry import node_key
from kvmesh.services.launcher import Etcd

MASTER = "store-master-0"
NODE_PREFIX = "store-node-"
INDEXED_METRIC = "kvmesh_store_node_indexed_blocks"


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
        netns: str | None = None,
        etcd_host: str = "127.0.0.1",
        tls: TlsFiles | None = None,
    ) -> None:
        """``netns``: run the master and the nodes in that network namespace (etcd
        stays in this one, on the veth address ``etcd_host`` they reach it by).
        ``tls``: every process serves and calls with these files (``--tls-cert``,
        ``--tls-key``, ``--tls-ca``: mutual TLS with a CA), and so does :meth:`stats`."""
        self.workdir = workdir
        os.makedirs(workdir, exist_ok=True)
        self.n_nodes, self.segment = nodes, segment
        self.master_args = master_args or []
        self.node_args = node_args or []
        self.lease_ttl, self.cluster = lease_ttl, cluster
        self.netns = netns
        self.tls = tls or TlsFiles()
        self.etcd = Etcd(
            os.path.join(workdir, "etcd"),
            log_path=os.path.join(workdir, "etcd.log"),
            host=etcd_host,
        )
        self.procs: dict[str, subprocess.Popen] = {}
        self._master = ""

    @property
    def master(self) -> str:
        """The store-master's gRPC address, as it registered when it last started."""
        if not self._master:
            raise RuntimeError("the store-master has not started")
        return self._master

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
            "--port",
            "0",
        ]
        for opt, path in (("--tls-cert", self.tls.cert), ("--tls-key", self.tls.key)):
            common += [opt, path] if path else []
        common += ["--tls-ca", self.tls.ca] if self.tls.ca else []
        prefix = ["ip", "netns", "exec", self.netns] if self.netns else []
        # tied to this process: a SIGKILLed benchmark or test leaves no store behind
        p = spawn_tied(
            [*prefix, sys.executable, *argv, *common],
            [],
            stdout=log,
            stderr=subprocess.STDOUT,
            env={**os.environ, "PYTHONUNBUFFERED": "1"},
        )
        self.procs[name] = p
        return p

    def _check_procs(self) -> None:
        for name, p in self.procs.items():
            if p.poll() is not None and p.returncode not in (0, -9, -15):
                raise RuntimeError(f"{name} exited with {p.returncode}; see {self.workdir}")

    # -- etcd registrations ------------------------------------------------------------
    def _key(self, name: str) -> str:
        role = "store-master" if name.startswith("store-master") else "store-node"
        return node_key(self.cluster, role, name)

    def registrations(self, role: str) -> dict[str, dict[str, Any]]:
        """What the processes of ``role`` registered in etcd, by node id (each one's
        ``node_info``: ``grpc``, ``metrics``, ...)."""
        prefix = node_key(self.cluster, role, "")

        async def get() -> list[tuple[str, bytes]]:
            async with EtcdClient(self.etcd.endpoint) as etcd:
                return (await etcd.get_prefix(prefix))[0]

        return {k[len(prefix) :]: json.loads(v) for k, v in asyncio.run(get())}

    def _forget_registration(self, name: str) -> None:
        async def delete() -> None:
            async with EtcdClient(self.etcd.endpoint) as etcd:
                await etcd.delete(self._key(name))

        asyncio.run(delete())

    def _await_registration(self, name: str, timeout: float) -> dict[str, Any]:
        async def poll() -> dict[str, Any]:
            deadline = time.monotonic() + timeout
            async with EtcdClient(self.etcd.endpoint) as etcd:
                while time.monotonic() < deadline:
                    self._check_procs()
                    p = self.procs[name]
                    if p.poll() is not None:
                        raise RuntimeError(f"{name} exited with {p.returncode}; see {self.workdir}")
                    try:
                        raw = await etcd.get(self._key(name))
                    except EtcdError:
                        raw = None
                    if raw is not None:
                        return json.loads(raw)
                    await asyncio.sleep(0.1)
            raise TimeoutError(f"store cluster: {name} not registered in {timeout}s")

        return asyncio.run(poll())

    # -- processes -----------------------------------------------------------------------
    def _spawn_master(self) -> None:
        old = self.procs.get(MASTER)
        if old is not None and old.poll() is None:
            raise RuntimeError(f"{MASTER} is still running")
        if old is not None:
            # a killed master's registration lives on until its lease ends: drop it, so
            # that the address read next is the new master's
            self._forget_registration(MASTER)
        self._master = ""
        self._spawn(MASTER, ["-m", "kvmesh.services.cli", "store-master", *self.master_args])

    def start_master(self, timeout: float = 30) -> None:
        """(Re)starts the store-master; returns once it is registered, with
        :attr:`master` set to its address (a restarted master listens elsewhere)."""
        self._spawn_master()
        self._master = self._await_registration(MASTER, timeout)["grpc"]

    def start_standby_master(self, name: str = "store-master-1") -> None:
        """One more store-master, ``name``: it stands by while another leads (the
        election of :mod:`kvmesh.services.common.election`) and takes over when that
        one's lease lapses; it registers its node key only once it leads."""
        self._spawn(name, ["-m", "kvmesh.services.cli", "store-master", *self.master_args])

    def start_node(self, i: int, extra: list[str] | None = None) -> None:
        self._spawn(
            f"{NODE_PREFIX}{i}",
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
        self._spawn_master()
        for i in range(self.n_nodes):
            self.start_node(i)
        self._master = self._await_registration(MASTER, timeout)["grpc"]
        self.wait_segments(self.n_nodes, timeout)
        return self

    # -- observing -----------------------------------------------------------------------
    def stats(self, timeout: float = 2) -> pb.StoreStatsResponse:
        with make_sync_channel(self.master, self.tls) as ch:
            return pbg.StoreMasterStub(ch).Stats(pb.StoreStatsRequest(), timeout=timeout)

    @staticmethod
    def scrape(metrics_address: str, metric: str) -> float:
        """The sum of ``metric``'s samples on a process's ``/metrics`` (0 if absent)."""
        with urllib.request.urlopen(f"http://{metrics_address}/metrics", timeout=2) as r:
            text = r.read().decode()
        return sum(
            sample.value
            for family in text_string_to_metric_families(text)
            for sample in family.samples
            if sample.name == metric
        )

    def wait(self, pred, timeout: float = 30, what: str = "condition") -> pb.StoreStatsResponse:
        deadline = time.monotonic() + timeout
        last = None
        while time.monotonic() < deadline:
            self._check_procs()
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

    def wait_indexed(self, timeout: float = 30) -> None:
        """Waits until the running store-nodes' indexes (what they re-report to a
        restarted master) hold as many DRAM replicas as the master knows of. Only for
        clusters whose every DRAM segment is a store-node's (no lending clients)."""
        deadline = time.monotonic() + timeout
        regs: dict[str, dict[str, Any]] = {}
        last: tuple[float, int] | None = None
        while time.monotonic() < deadline:
            self._check_procs()
            nodes = [
                n for n, p in self.procs.items() if n.startswith(NODE_PREFIX) and p.poll() is None
            ]
            try:
                if any(n not in regs for n in nodes):
                    regs = self.registrations("store-node")
                if all(n in regs for n in nodes):
                    s = self.stats()
                    indexed = sum(self.scrape(regs[n]["metrics"], INDEXED_METRIC) for n in nodes)
                    last = (indexed, s.replicas - s.ssd_blocks)
                    if last[0] == last[1]:
                        return
            except (grpc.RpcError, OSError, EtcdError):
                pass
            time.sleep(0.1)
        raise TimeoutError(
            f"store cluster: the nodes' indexes did not catch up in {timeout}s "
            f"(last: indexed, DRAM replicas = {last})"
        )

    # -- stopping ------------------------------------------------------------------------
    def kill(self, name: str, sig: int = signal.SIGKILL) -> None:
        p = self.procs[name]
        if p.poll() is None:
            p.send_signal(sig)
            p.wait(30)

    def stop(self) -> None:
        for p in self.procs.values():
            if p.poll() is None:
                p.send_signal(signal.SIGTERM)
        for p in self.procs.values():
            try:
                p.wait(10)
            except subprocess.TimeoutExpired:
                p.kill()
                p.wait()
        self.etcd.stop()
