"""Store-master leader election (issue 17, part 2) on real processes and a real etcd:
the campaign transaction, two store-masters of which exactly one leads, and a SIGKILL of
the leader under which the standby takes over (how fast is measured by the fault suite's
store-master-failover row, loadtest/faults_own_cluster.py, not asserted here) while a store
client follows it and a put/get round-trips."""

from __future__ import annotations

import asyncio
import json
import os
import signal
import socket
import time

import grpc
import pytest

from kvmesh.loadtest.store_cluster import MASTER, StoreCluster
from kvmesh.protos import kvmesh_pb2 as pb
from kvmesh.protos import kvmesh_pb2_grpc as pbg
from kvmesh.rdma import TransferEngine
from kvmesh.services.common.election import LeaderElection, current_leader, leader_key
from kvmesh.services.common.etcd import EtcdClient
from kvmesh.services.common.registry import Membership, nodes_prefix
from kvmesh.services.common.settings import DEV_SECRET
from kvmesh.services.store.client import StoreClient
from kvmesh.services.store_master import wire
from tests.etcd_server import etcd_server
from tests.test_etcd import TcpProxy

TTL = 2
STANDBY = "store-master-1"


def test_etcd_create_is_one_transaction():
    """create(): the first caller creates the key and its companions under its lease;
    a second one gets the current value back and writes nothing; revoking the lease
    deletes them all."""

    async def body(endpoint: str):
        async with EtcdClient(endpoint) as c:
            lease = await c.lease_grant(5)
            won, cur, rev = await c.create("/t/leader", b"a", lease, also={"/t/node/a": b"a"})
            assert (won, cur) == (True, b"a") and rev > 0
            other = await c.lease_grant(5)
            won, cur, rev2 = await c.create("/t/leader", b"b", other, also={"/t/node/b": b"b"})
            assert (won, cur) == (False, b"a") and rev2 >= rev
            assert await c.get("/t/node/b") is None
            assert await c.get("/t/node/a") == b"a"
            await c.lease_revoke(lease)
            assert await c.get("/t/leader") is None and await c.get("/t/node/a") is None
            won, cur, _ = await c.create("/t/leader", b"b", other)
            assert (won, cur) == (True, b"b")

    with etcd_server() as srv:
        asyncio.run(body(srv.endpoint))


def test_election_stop_hands_over_at_once():
    """Two candidates in one process against real etcd: one leads; when it stops (its
    lease revoked) the other leads without waiting for the TTL."""

    async def body(endpoint: str):
        async with EtcdClient(endpoint) as c:
            a = LeaderElection(c, "/t/leader/x", "/t/nodes/x/a", b'{"id": "a"}', ttl=30)
            b = LeaderElection(c, "/t/leader/x", "/t/nodes/x/b", b'{"id": "b"}', ttl=30)
            await a.start()
            async with asyncio.timeout(10):
                await a.leading.wait()
            await b.start()
            async with asyncio.timeout(10):  # b sees a lead and stands by
                while b.leader is None:
                    await asyncio.sleep(0.05)
            assert not b.leading.is_set()
            assert [k for k, _ in (await c.get_prefix("/t/nodes/x/"))[0]] == ["/t/nodes/x/a"]
            await a.stop()
            async with asyncio.timeout(10):  # well under the 30 s TTL
                await b.leading.wait()
            assert [k for k, _ in (await c.get_prefix("/t/nodes/x/"))[0]] == ["/t/nodes/x/b"]
            await b.stop()
            assert await c.get("/t/leader/x") is None

    with etcd_server() as srv:
        asyncio.run(body(srv.endpoint))


def test_update_after_the_lease_lapsed_does_not_raise():
    """update() on a leader whose lease has just gone (revoked here, as a lapse would)
    logs the failed put and leaves recovery to the keepalive loop instead of raising
    into the caller."""

    async def body(endpoint: str):
        async with EtcdClient(endpoint) as c:
            a = LeaderElection(c, "/t/leader/u", "/t/nodes/u/a", b'{"id": "a"}', ttl=30)
            await a.start()
            try:
                async with asyncio.timeout(10):
                    await a.leading.wait()
                await c.lease_revoke(a.lease_id)
                await a.update(b'{"id": "a", "v": 2}')
                assert a.value == b'{"id": "a", "v": 2}'
            finally:
                await a.stop()

    with etcd_server() as srv:
        asyncio.run(body(srv.endpoint))


def test_a_leader_cut_off_from_etcd_stands_down_before_a_standby_leads():
    """A leader whose keepalives no longer reach etcd (a partition: its link to etcd
    goes through a real TCP proxy that is cut) must stop leading by the time its lease
    can have lapsed, so that when the standby takes over there are never two leaders
    (a store-master's StandbyGate then refuses store calls). Once the link is back it
    finds the key taken and has lost."""

    async def body(endpoint: str):
        proxy = TcpProxy(int(endpoint.rsplit(":", 1)[1]))
        await proxy.start()
        lost = asyncio.Event()
        async with (
            EtcdClient(endpoint) as c,
            EtcdClient(f"127.0.0.1:{proxy.port}", timeout=0.5) as cut_off,
        ):
            a = LeaderElection(
                cut_off, "/t/leader/y", "/t/nodes/y/a", b'{"id": "a"}', ttl=TTL, on_lost=lost.set
            )
            b = LeaderElection(c, "/t/leader/y", "/t/nodes/y/b", b'{"id": "b"}', ttl=TTL)
            try:
                await a.start()
                async with asyncio.timeout(10):
                    await a.leading.wait()
                await b.start()
                async with asyncio.timeout(10):  # b stands by
                    while b.leader is None:
                        await asyncio.sleep(0.05)
                await proxy.cut()
                async with asyncio.timeout(TTL + 20):  # a's lease lapses, b campaigns
                    await b.leading.wait()
                assert not a.leading.is_set(), "two leaders: the cut-off one still leads"
                await proxy.start()
                async with asyncio.timeout(20):
                    await lost.wait()
                assert not a.leading.is_set() and b.leading.is_set()
            finally:
                await a.stop()
                await b.stop()
                await proxy.cut()

    with etcd_server() as srv:
        asyncio.run(body(srv.endpoint))


@pytest.fixture
def pair(tmp_path):
    """etcd, two store-masters (store-master-0 starts first and leads) and one
    store-node, all real processes, lease TTL 2 s."""
    c = StoreCluster(str(tmp_path), nodes=1, segment="16MiB", lease_ttl=TTL)
    try:
        c.start()
        c.start_standby_master(STANDBY)
        yield c
    finally:
        c.stop()


def _leader(c: StoreCluster) -> dict | None:
    async def get():
        async with EtcdClient(c.etcd.endpoint) as e:
            return await current_leader(e, c.cluster, "store-master")

    return asyncio.run(get())


def _wait_standby_up(c: StoreCluster, timeout: float = 30) -> None:
    """The standby's log says it stands by (it campaigned and lost)."""
    path = os.path.join(c.workdir, f"{STANDBY}.log")
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if c.procs[STANDBY].poll() is not None:
            raise RuntimeError(f"{STANDBY} exited with {c.procs[STANDBY].returncode}")
        with open(path, "rb") as f:
            if b"standing by" in f.read():
                return
        time.sleep(0.1)
    raise TimeoutError(f"{STANDBY} did not stand by in {timeout}s")


def test_two_store_masters_one_leads_and_the_standby_takes_over(pair):
    c = pair
    _wait_standby_up(c)
    # exactly one leads: only its node key exists, and the campaign key names it
    assert list(c.registrations("store-master")) == [MASTER]
    assert _leader(c)["id"] == MASTER

    async def body() -> float:
        te = TransferEngine(DEV_SECRET.encode())
        await te.start()
        async with EtcdClient(c.etcd.endpoint) as etcd:
            view = Membership(etcd, nodes_prefix(c.cluster))
            await view.start()
            cl = StoreClient(te, view, "tester", rpc_timeout=2)
            try:
                # the standby refuses store calls, naming the leader
                standby_addr = None
                async with asyncio.timeout(10):
                    while standby_addr is None:
                        standby_addr = await _standby_address(c)
                async with grpc.aio.insecure_channel(standby_addr) as ch:
                    with pytest.raises(grpc.aio.AioRpcError) as e:
                        await pbg.StoreMasterStub(ch).StoreHello(pb.StoreHelloRequest(), timeout=5)
                assert e.value.code() == grpc.StatusCode.UNAVAILABLE
                assert "standby" in e.value.details() and c.master in e.value.details()
                # and so does its raw-TCP control path (not advertised, but listening)
                status, why = await asyncio.to_thread(_fast_exists_on_standby, c)
                assert status == grpc.StatusCode.UNAVAILABLE.value[0], (status, why)
                assert b"standby" in why and c.master.encode() in why

                keys = [os.urandom(16) for _ in range(8)]
                vals = [k * 64 for k in keys]
                assert all(await cl.batch_put(keys, vals))
                await asyncio.to_thread(c.wait_indexed, 15)

                await asyncio.to_thread(c.kill, MASTER, signal.SIGKILL)
                t0 = time.monotonic()
                async with asyncio.timeout(TTL + 30):  # bounded, generous on a loaded machine
                    while (await current_leader(etcd, c.cluster, "store-master") or {}).get(
                        "id"
                    ) != STANDBY:
                        await asyncio.sleep(0.05)
                took = time.monotonic() - t0
                # the client follows the new leader: the node re-mounts and re-reports
                # there, so what was put before the kill reads back, and a new put works
                async with asyncio.timeout(20):
                    while (got := await cl.batch_get(keys)) != vals:
                        await asyncio.sleep(0.1)
                assert cl.master_address() == json.loads(view.nodes[_node_key(c, STANDBY)])["grpc"]
                k2 = os.urandom(16)
                async with asyncio.timeout(10):
                    while not await cl.put(k2, b"after takeover" * 100):
                        await asyncio.sleep(0.1)
                assert await cl.get(k2) == b"after takeover" * 100
                assert got == vals
                return took
            finally:
                await cl.close()
                await view.stop()
                await te.close()

    took = asyncio.run(body())
    print(f"takeover {took:.2f}s after the SIGKILL (lease TTL {TTL}s)")
    assert list(c.registrations("store-master")) == [STANDBY]


def _fast_exists_on_standby(c: StoreCluster) -> tuple[int, bytes]:
    """An EXISTS call on the standby's raw-TCP control path (its address from its log):
    (status, body)."""
    path = os.path.join(c.workdir, f"{STANDBY}.log")
    with open(path, encoding="utf-8", errors="replace") as f:
        line = next(ln for ln in f if "raw-TCP control path on " in ln)
    host, port = line.split("raw-TCP control path on ", 1)[1].split()[0].rsplit(":", 1)
    body = wire.pack_exists([b"k" * 16], False)
    with socket.create_connection((host, int(port)), timeout=10) as s:
        s.settimeout(10)
        s.sendall(wire.HEAD.pack(len(body), 9, wire.EXISTS) + body)
        n, rid, status = wire.HEAD.unpack(s.recv(wire.HEAD_SIZE, socket.MSG_WAITALL))
        assert rid == 9
        return status, s.recv(n, socket.MSG_WAITALL) if n else b""


def _node_key(c: StoreCluster, name: str) -> str:
    return f"{nodes_prefix(c.cluster)}store-master/{name}"


async def _standby_address(c: StoreCluster) -> str | None:
    """The standby is not registered: find its gRPC port in its log line."""
    path = os.path.join(c.workdir, f"{STANDBY}.log")
    with open(path, encoding="utf-8", errors="replace") as f:
        for line in f:
            if "serving on " in line:
                return line.split("serving on ", 1)[1].split()[0]
    await asyncio.sleep(0.1)
    return None


def test_leader_key_is_outside_the_node_prefix():
    """The campaign key must not look like a node to Membership watchers."""
    assert not leader_key("c", "store-master").startswith(nodes_prefix("c"))
