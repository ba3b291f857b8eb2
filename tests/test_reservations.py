"""Decode-node reservations that nobody will decode must not wait for the reaper
(``reservation_timeout_s``, 60 s by default) -- issue 18:

- a conductor that dies holding a reservation: ``Reserve`` names the conductor (gRPC
  metadata), and the decode node frees that conductor's reservations once its lease ends;
- a ``Release`` that overtakes its ``Reserve`` (the client went away while the Reserve
  was in flight): the node remembers the id and refuses the late ``Reserve``.

A real cluster (etcd, services in their own processes, the tiny model, disaggregated
route, a 3 s lease); the prefill node's test hook (``KVMESH_TEST_HOLD_PREFILL``) holds a
request after its decode reservation is taken."""

from __future__ import annotations

import os
import signal
import time

import grpc
import pytest

from kvmesh.protos import kvmesh_pb2 as pb
from kvmesh.protos import kvmesh_pb2_grpc as pbg
from kvmesh.services.decode.early_release import EarlyReleases
from kvmesh.services.launcher import LocalCluster
from tests.cluster_util import DISAGG_ONLY, NODE_ARGS, start_with_hold_hook, status
from tests.test_cancel import Hold, long_prompt

TTL = 3
FENCE_S = 1.0  # blocks a prefill node might still write stay out of the pool this long


# -- the memory of early releases (no cluster) -------------------------------------------------


def test_early_releases_are_remembered_for_their_ttl_and_bounded():
    now = [100.0]
    e = EarlyReleases(ttl_s=10.0, cap=3, clock=lambda: now[0])
    assert not e.released("a")
    e.note("a")
    now[0] += 5
    e.note("b")
    assert e.released("a") and e.released("b") and not e.released("c")
    now[0] += 5.5  # a's ten seconds are over, b's are not
    assert not e.released("a") and e.released("b") and len(e) == 1
    for rid in ("c", "d", "e"):
        e.note(rid)
    assert len(e) == 3 and not e.released("b")  # past the cap: the oldest went first
    e.note("c")  # noted again: its ttl starts again, and it is now the youngest
    e.note("f")
    assert e.released("c") and not e.released("d")
    now[0] += 10
    assert not any(e.released(r) for r in "cdef") and len(e) == 0


# -- a real cluster --------------------------------------------------------------------------


@pytest.fixture(scope="module")
def hold_dir(tmp_path_factory):
    return str(tmp_path_factory.mktemp("hold"))


@pytest.fixture(scope="module")
def cluster(tmp_path_factory, hold_dir):
    c = LocalCluster(
        str(tmp_path_factory.mktemp("res")),
        conductors=2,
        lease_ttl=TTL,
        node_args=NODE_ARGS,
        conductor_args=DISAGG_ONLY,
        decode_args=["--fence-s", str(FENCE_S)],
    )
    start_with_hold_hook(c, hold_dir)
    try:
        yield c
    finally:
        c.stop()


@pytest.fixture
def hold(hold_dir):
    h = Hold.cleared(hold_dir)
    yield h
    h.at("")


def decode_status(addr: str) -> pb.NodeStatus:
    with grpc.insecure_channel(addr) as ch:
        return pbg.DecodeNodeStub(ch).Status(pb.NodeStatusRequest(), timeout=5)


def decode_address(c: LocalCluster) -> str:
    return next(n.grpc_address for n in status(c.conductors[-1]).nodes if n.role == "decode")


def test_a_release_that_overtakes_its_reserve_leaves_nothing_held(cluster):
    addr = decode_address(cluster)
    total = decode_status(addr).kv_blocks_total
    with grpc.insecure_channel(addr) as ch:
        stub = pbg.DecodeNodeStub(ch)
        # the client went away: the conductor's Release arrives first, finding nothing
        assert not stub.Release(pb.ReleaseRequest(request_id="early-1"), timeout=5).released
        with pytest.raises(grpc.RpcError) as e:
            stub.Reserve(
                pb.ReserveRequest(request_id="early-1", prompt_tokens=64, max_tokens=8), timeout=5
            )
        assert e.value.code() == grpc.StatusCode.ABORTED, e.value.details()
        assert "released before" in e.value.details()
        s = decode_status(addr)
        assert s.kv_blocks_free == total and s.queue_depth == 0  # nothing taken
        # another id is reserved as ever (and released in the usual order)
        got = stub.Reserve(
            pb.ReserveRequest(request_id="in-order", prompt_tokens=64, max_tokens=8), timeout=5
        )
        assert len(got.target.block_ids) == 64 // 16 + 1
        assert decode_status(addr).queue_depth == 1
        assert stub.Release(pb.ReleaseRequest(request_id="in-order"), timeout=5).released
    assert decode_status(addr).queue_depth == 0
    deadline = time.monotonic() + FENCE_S + 10  # its blocks come back after the fence
    while decode_status(addr).kv_blocks_free != total:
        assert time.monotonic() < deadline, "the released blocks never came back"
        time.sleep(0.1)


def test_a_conductor_killed_holding_a_reservation_frees_it_within_the_lease(cluster, hold):
    """conductor-0 reserves KV on the decode node for a request held at the prefill node
    (not decoding yet), then is SIGKILLed: no Release will come. The decode node frees
    the reservation when conductor-0's lease ends -- not after the reaper's 60 s."""
    killed_first = cluster.conductors[0]
    addr = decode_address(cluster)
    before = decode_status(addr)  # (another test's leak must not hide or fail this one)
    hold.at("prefilling")
    with grpc.insecure_channel(killed_first) as ch:
        call = pbg.ConductorStub(ch).Generate(
            pb.GenerateRequest(prompt=long_prompt(), max_tokens=8), timeout=120
        )
        hold.wait_held(1, call)
        s = decode_status(addr)
        # conductor-0's reservation
        assert s.queue_depth == before.queue_depth + 1 and s.kv_blocks_free < before.kv_blocks_free
        t_kill = time.monotonic()
        cluster.stop_process("conductor-0", signal.SIGKILL)
        with pytest.raises(grpc.RpcError) as e:
            next(call)
        assert e.value.code() == grpc.StatusCode.UNAVAILABLE
    # the reservation goes once the lease lapses; its blocks after the fence (the prefill
    # node that was asked to write them is not known to have stopped)
    deadline = t_kill + TTL + FENCE_S + 5
    while True:
        s = decode_status(addr)
        if s.queue_depth == before.queue_depth and s.kv_blocks_free >= before.kv_blocks_free:
            break
        assert time.monotonic() < deadline, (
            f"{time.monotonic() - t_kill:.1f}s after the kill: queue {s.queue_depth}, "
            f"{s.kv_blocks_free} blocks free; before: {before.queue_depth}, "
            f"{before.kv_blocks_free}"
        )
        time.sleep(0.1)
    log = open(os.path.join(cluster.workdir, "decode-0.log")).read()
    assert "conductor conductor-0 left; freeing reservation" in log
