"""Helpers for tests that drive a real store (``loadtest.store_cluster.StoreCluster``):
one started for a module's fixture, its store-master's counters, its fast-path address, a
raw frame sent to that fast path, and store clients run in a fresh event loop."""

from __future__ import annotations

import asyncio
import os
import socket
import urllib.request
from collections.abc import Iterator
from contextlib import contextmanager

import grpc
from hypothesis import HealthCheck, settings
from prometheus_client.parser import text_string_to_metric_families

from kvmesh.loadtest.store_cluster import MASTER, StoreCluster
from kvmesh.protos import kvmesh_pb2 as pb
from kvmesh.protos import kvmesh_pb2_grpc as pbg
from kvmesh.rdma import TransferEngine
from kvmesh.services.common import channels
from kvmesh.services.common.channels import TlsFiles
from kvmesh.services.common.settings import DEV_SECRET
from kvmesh.services.store.client import StoreClient
from kvmesh.services.store_master import wire

INVALID = grpc.StatusCode.INVALID_ARGUMENT.value[0]
"""The fast path's status for bad input (gRPC's INVALID_ARGUMENT code)."""

FUZZ = settings(
    max_examples=int(os.environ.get("KVMESH_FUZZ_EXAMPLES", "60")),
    deadline=None,
    derandomize=True,
    suppress_health_check=list(HealthCheck),
)
"""Hypothesis settings of the store's frame fuzz tests."""


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


def fast_address(store: StoreCluster, tls: TlsFiles | None = None) -> tuple[str, int]:
    """(host, port) of the master's raw-TCP fast path, as its StoreHello offers it to a
    client with ``tls`` (None: the process's current settings, plaintext in tests)."""
    with channels.make_sync_channel(store.master, tls) as ch:
        hello = pbg.StoreMasterStub(ch).StoreHello(pb.StoreHelloRequest(), timeout=10)
    assert hello.fast_address, "the master offers no fast path"
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


def fast_call(addr: tuple[str, int], method: int, body: bytes, rid: int = 7) -> tuple[int, bytes]:
    """Send one raw frame (``method``, ``body``) to the fast path at ``addr`` on a fresh
    connection: (status, answer body)."""
    with socket.create_connection(addr, timeout=5) as s:
        s.settimeout(5)
        s.sendall(wire.HEAD.pack(len(body), rid, method) + body)
        n, got, status = wire.HEAD.unpack(s.recv(wire.HEAD_SIZE, socket.MSG_WAITALL))
        assert got == rid
        return status, s.recv(n, socket.MSG_WAITALL) if n else b""


def run_clients(master: str, fn, *node_ids: str, rpc_timeout: float = 3):
    """``await fn(*clients)``: one StoreClient of ``master`` per node id, each on its own
    transfer engine; all closed afterwards."""

    async def main():
        tes, cls = [], []
        try:
            for node_id in node_ids:
                te = TransferEngine(DEV_SECRET.encode())
                await te.start()
                tes.append(te)
                cls.append(StoreClient(te, master, node_id, rpc_timeout=rpc_timeout))
            return await fn(*cls)
        finally:
            for cl in cls:
                await cl.close()
            for te in tes:
                await te.close()

    return asyncio.run(main())
