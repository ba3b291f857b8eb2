"""A put whose size no store segment can hold is refused with INVALID_ARGUMENT, on the
gRPC path and on the raw-TCP fast path (``PUT_START`` frame) alike -- it used to make
the store-master evict every block to make room for it (review of issue 18). A real
store-master and store node, real sockets."""

from __future__ import annotations

import asyncio

import grpc
import pytest

from kvmesh.loadtest.store_cluster import StoreCluster
from kvmesh.protos import kvmesh_pb2 as pb
from kvmesh.protos import kvmesh_pb2_grpc as pbg
from kvmesh.services.store.fastconn import CallError, FastConn
from kvmesh.services.store_master import wire

pytestmark = pytest.mark.timeout(180)

MiB = 1 << 20
SEGMENT = 16 * MiB
HUGE = (1 << 64) - 1  # the largest u64 a client can send


@pytest.fixture(scope="module")
def store(tmp_path_factory):
    c = StoreCluster(str(tmp_path_factory.mktemp("put-size")), nodes=1, segment="16MiB")
    try:
        c.start()
        yield c
    finally:
        c.stop()


def key(i: int) -> bytes:
    return i.to_bytes(16, "big")


@pytest.fixture(scope="module")
def stub(store):
    with grpc.insecure_channel(store.master) as ch:
        stub = pbg.StoreMasterStub(ch)
        keys = [key(i) for i in range(4)]  # four unpinned blocks the store holds
        placed = stub.PutStart(pb.PutStartRequest(node_id="t", hashes=keys, size=MiB), timeout=5)
        assert len(placed.placements) == 4
        assert stub.PutEnd(pb.PutEndRequest(hashes=keys), timeout=5).committed == 4
        yield stub


def held(store: StoreCluster) -> tuple[int, int]:
    s = store.stats()
    return s.blocks, s.evictions


def test_grpc_put_start_refuses_a_size_no_segment_holds(store, stub):
    for req in (
        pb.PutStartRequest(node_id="t", hashes=[key(10)], size=HUGE),
        pb.PutStartRequest(node_id="t", hashes=[key(10), key(11)], sizes=[MiB, SEGMENT + 1]),
    ):
        with pytest.raises(grpc.RpcError) as e:
            stub.PutStart(req, timeout=5)
        assert e.value.code() == grpc.StatusCode.INVALID_ARGUMENT
        assert f"larger than the biggest store segment ({SEGMENT} bytes)" in e.value.details()
        assert held(store) == (4, 0)  # nothing evicted


def test_fast_path_put_start_refuses_a_size_no_segment_holds(store, stub):
    addr = stub.StoreHello(pb.StoreHelloRequest(), timeout=5).fast_address
    assert addr

    async def put_start(sizes: list[int]) -> bytes:
        conn = await FastConn.connect(addr)
        try:
            keys = [key(20 + i) for i in range(len(sizes))]
            return await conn.call(wire.PUT_START, wire.pack_put_start("t", keys, sizes), 5)
        finally:
            conn.close()

    for sizes in ([HUGE], [MiB, HUGE]):
        with pytest.raises(CallError) as e:
            asyncio.run(put_start(sizes))
        assert e.value.status == grpc.StatusCode.INVALID_ARGUMENT.value[0]
        assert f"larger than the biggest store segment ({SEGMENT} bytes)" in e.value.details
        assert held(store) == (4, 0)


def test_a_value_as_big_as_a_segment_is_not_refused(store, stub):
    """The bound is the biggest segment: a value that would fill one is a valid request
    (placed when the store can make room, else not placed), not INVALID_ARGUMENT."""
    got = stub.PutStart(pb.PutStartRequest(node_id="t", hashes=[key(30)], size=SEGMENT), timeout=5)
    if got.placements:
        stub.PutEnd(pb.PutEndRequest(hashes=[key(30)], abort=True), timeout=5)
