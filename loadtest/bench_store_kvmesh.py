"""The store benchmark's kvmesh side (:mod:`kvmesh.loadtest.bench_store` runs it against
Mooncake's, :mod:`kvmesh.loadtest.bench_store_mooncake`): a store cluster of its own
(etcd, store-master and, in the remote and netns topologies, a store-node holding the
segment; with ``--tls`` every process and the client speak mutual TLS) and a
:class:`~kvmesh.services.store.client.StoreClient` in the benchmark's process.
"""

from __future__ import annotations

import os
import time

import numpy as np

from kvmesh.loadtest.bench_store_common import NETNS_IPS, SECRET, Values, _put_tag, pct

_TLS_SANS = ("127.0.0.1", "::1", "localhost", *NETNS_IPS)  # the addresses services advertise


class KvSide:
    """A kvmesh store cluster (etcd, store-master, and in remote/netns a store-node) and
    a :class:`StoreClient` in this process, with polling window ``poll_us``."""

    def __init__(
        self, topology: str, segment: str, poll_us: int, work: str, tls: bool = False
    ) -> None:
        self.name = f"kvmesh poll {poll_us}us" if poll_us else "kvmesh"
        if tls:
            self.name = "kvmesh tls" + (f" poll {poll_us}us" if poll_us else "")
        self.topology, self.segment, self.poll_us = topology, segment, poll_us
        self.work = work
        self.tls = None
        if tls:  # one DevCA identity for the processes, one for this client
            from kvmesh.services.common.channels import TlsFiles
            from kvmesh.services.common.pki import generate_dev_pki
            from kvmesh.services.common.roles import PREFILL, STORE_MASTER, STORE_NODE

            # this client calls the store as a model node does (a store client's role)
            roles = {"store": [STORE_MASTER, STORE_NODE], "bench": [PREFILL]}
            ids = generate_dev_pki(os.path.join(work, "pki"), roles, sans=_TLS_SANS)
            self.tls = TlsFiles(ids["store"].cert, ids["store"].key, ids["store"].ca)
            c = ids["bench"]
            self.client_tls = TlsFiles(c.cert, c.key, c.ca)
        self.cluster = None
        self.te = self.cl = None
        self.regions: dict[int, int] = {}

    def start_cluster(self, ns: str | None) -> None:
        from kvmesh.loadtest.store_cluster import StoreCluster

        host = NETNS_IPS[1] if ns else "127.0.0.1"
        self.cluster = StoreCluster(
            self.work,
            nodes=0 if self.topology == "local" else 1,
            segment=self.segment,
            lease_ttl=10,
            # 5 s read leases: the benchmark's removed keys free their space sooner (a
            # lease's length costs no time on the read path)
            master_args=["--fast-poll-us", str(self.poll_us), "--host", host, "--lease-ms", "5000"],
            node_args=["--te-poll-us", str(self.poll_us), "--host", host, "--secret", SECRET],
            cluster=f"bench{self.poll_us}{'tls' if self.tls else ''}",
            netns=ns,
            etcd_host=NETNS_IPS[0] if ns else "127.0.0.1",
            tls=self.tls,
        )
        self.cluster.start(timeout=60)  # a failed start leaves self.cluster to stop

    def pids(self) -> list[int]:
        return [p.pid for p in self.cluster.procs.values()] if self.cluster else []

    async def open(self, host: str) -> None:
        from kvmesh.rdma import TransferEngine
        from kvmesh.services.common.config import parse_size
        from kvmesh.services.store.client import StoreClient

        self.te = TransferEngine(SECRET.encode(), host=host, poll_us=self.poll_us)
        await self.te.start()
        self.cl = StoreClient(
            self.te,
            self.cluster.master,
            f"bench-{self.poll_us}",
            tls=self.client_tls if self.tls else None,
        )
        if self.topology == "local":
            await self.cl.lend(parse_size(self.segment), timeout=30)

    def region(self, buf: np.ndarray) -> int:
        rid = self.regions.get(id(buf))
        if rid is None:
            rid = self.regions[id(buf)] = self.te.register(buf)
        return rid

    async def forget(self) -> None:
        for rid in self.regions.values():
            self.te.unregister(rid)
        self.regions.clear()

    async def close(self) -> None:
        if self.cl is not None:
            await self.forget()
            await self.cl.close()
            await self.te.close()
        if self.cluster is not None:
            self.cluster.stop()

    async def run(self, api: str, v: Values, batch: int, tag: str) -> tuple[dict, list[float]]:
        """Runs one API over all of ``v``'s values; -> (row, per-call latencies)."""
        cl, size, n = self.cl, v.size, v.ops
        keys = [f"{tag}-{i}".encode() for i in range(n)]
        lat: list[float] = []
        got: list = [None] * n
        bad = 0
        if api in ("get", "batch_get", "get_into", "batch_get_into"):
            # read back what the matching put stored under the same tag
            keys = [f"{_put_tag(tag, api)}-{i}".encode() for i in range(n)]
        src = self.region(v.src) if api.endswith(("_from", "_into")) else -1
        dst = self.region(v.dst) if api.endswith("_into") else -1
        step = batch if api.startswith("batch") else 1
        t0 = time.perf_counter()
        for i in range(0, n, step):
            ks = keys[i : i + step]
            t = time.perf_counter()
            if api in ("put", "batch_put"):
                ok = await cl.batch_put(ks, v.values[i : i + step])
                bad += ok.count(False)
            elif api in ("get", "batch_get"):
                got[i : i + step] = await cl.batch_get(ks)
            elif api in ("put_from", "batch_put_from"):
                offs = [j * size for j in range(i, i + len(ks))]
                ok = await cl.put_from(ks, src, offs, [size] * len(ks))
                bad += ok.count(False)
            else:
                offs = [j * size for j in range(i, i + len(ks))]
                r = await cl.get_into(ks, dst, offs)
                bad += sum(1 for x in r if x != size)
            lat.append(time.perf_counter() - t)
        secs = time.perf_counter() - t0
        if api in ("get", "batch_get"):
            bad += v.check_bytes(got)
        elif api.endswith("_into"):
            bad = max(bad, v.check_dst())
        return {"secs": secs, "bad": bad}, lat

    async def remove(self, tags: list[str], n: int) -> None:
        for tag in tags:
            await self.cl.remove([f"{tag}-{i}".encode() for i in range(n)])

    async def rtt(self, count: int = 200) -> float:
        """p50 of one control round trip (``exists`` of one absent key), seconds."""
        lat = []
        for _ in range(count):
            t = time.perf_counter()
            await self.cl.exists(b"absent-key")
            lat.append(time.perf_counter() - t)
        return pct(lat, 50)
