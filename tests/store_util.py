"""Helpers for tests that drive a real store (``loadtest.store_cluster.StoreCluster``):
one started for a module's fixture, its store-master's counters, its fast-path address, and
a store client run in a fresh event loop."""

from __future__ import annotations

import asyncio
import urllib.request
from collections.abc import Iterator
from contextlib import contextmanager

from prometheus_client.parser import text_string_to_metric_families

from kvmesh.loadtest.store_cluster import MASTER, StoreCluster
from kvmesh.protos import kvmesh_pb2 as pb
from kvmesh.protos import kvmesh_pb2_grpc as pbg
from kvmesh.rdma import TransferEngine
from kvmesh.services.common import channels
from kvmesh.services.common.channels import TlsFiles
from kvmesh.services.common.settings import DEV_SECRET
from kvmesh.services.store.client import StoreClient


@contextmanager
def running_store(workdir: str, **kw) -> Iterator[StoreCluster]:
    """A started ``StoreCluster(workdir, **kw)``, stopped on the way out (a failed start
    too)."""
    c = StoreCluster(workdir, **kw)
    try:
        c.start()
        yield c
    finally:
        c.stop()


def master_counter(store: StoreCluster, sample: str, label: str) -> dict[str, float]:
    """The store-master's ``sample`` (e.g. ``kvmesh_store_fast_calls_total``) read from its
    /metrics, by the value of its ``label``."""
    addr = store.registrations("store-master")[MASTER]["metrics"]
    with urllib.request.urlopen(f"http://{addr}/metrics", timeout=10) as r:
        text = r.read().decode()
    return {
        s.labels[label]: s.value
        for f in text_string_to_metric_families(text)
        for s in f.samples
        if s.name == sample
    }


def fast_address(store: StoreCluster, tls: TlsFiles) -> tuple[str, int]:
    """(host, port) of the master's raw-TCP fast path, as its StoreHello offers it to a
    client with ``tls``."""
    with channels.make_sync_channel(store.master, tls) as ch:
        hello = pbg.StoreMasterStub(ch).StoreHello(pb.StoreHelloRequest(), timeout=10)
    assert hello.fast_address, "a TLS master must still offer its fast path"
    host, port = hello.fast_address.rsplit(":", 1)
    return host, int(port)


def run_client(master: str, fn, node_id: str, rpc_timeout: float = 5, **kw):
    """``await fn(client, engine)`` with a StoreClient ``node_id`` of ``master`` on its own
    transfer engine (options ``kw``); both closed afterwards."""

    async def main():
        te = TransferEngine(DEV_SECRET.encode())
        await te.start()
        cl = StoreClient(te, master, node_id, rpc_timeout=rpc_timeout, **kw)
        try:
            return await fn(cl, te)
        finally:
            await cl.close()
            await te.close()

    return asyncio.run(main())
