"""Who owns a decode reservation (review of issue 18): the conductor's owner key
``/kvmesh/<cluster>/owners/conductor/<id>`` = its incarnation id, apart from its
registration key (services/common/ownership.py).

- a conductor stopping gracefully (SIGTERM) deregisters first and then drains: the
  reservations of the requests it still serves stay until its owner key goes, after the
  drain, and those requests finish;
- a conductor restarted under the same node id before its lease ran out: its dead
  incarnation's reservations are freed when the new one puts the owner key;
- the reaper (``--reservation-timeout-s``) leaves a reservation of a live conductor
  process alone (a long prefill), and frees one nobody owns.

A real cluster (etcd, each service in its own process, the tiny model, disaggregated
route); the prefill node's test hook holds a request after its decode reservation is
taken."""

from __future__ import annotations

import os
import signal
import time
from types import SimpleNamespace

import grpc
import pytest

from kvmesh.protos import kvmesh_pb2 as pb
from kvmesh.protos import kvmesh_pb2_grpc as pbg
from kvmesh.services.common.ownership import Owners, owner_key
from kvmesh.services.common.registry import node_key
from kvmesh.services.decode.batch import Reservation
from kvmesh.services.decode.server import DecodeNode
from kvmesh.services.launcher import LocalCluster
from tests.cluster_util import DISAGG_ONLY, NODE_ARGS, start_with_hold_hook, status
from tests.test_cancel import Hold, long_prompt

TTL = 20  # long: a restarted conductor is back well before its old lease ends
REAP_S = 3.0  # the reaper's timeout for a reservation nobody (alive) owns
FENCE_S = 1.0

# -- the owner view and the reaper's rule (no cluster) --------------------------------------


def test_an_incarnation_ends_when_its_key_goes_or_is_put_again_by_another():
    ended: list[tuple[str, str]] = []
    o = Owners(None, "c", lambda owner, inc: ended.append((owner, inc)))  # type: ignore[arg-type]
    key = owner_key("c", "conductor", "conductor-0")
    o._on_event("join", key, b"inc-a")
    assert o.alive("conductor-0", "inc-a") and not o.alive("conductor-0", "inc-b")
    assert not o.alive("conductor-0", "") and ended == []
    o._on_event("update", key, b"inc-b")  # restarted under the same id
    assert ended == [("conductor-0", "inc-a")] and o.alive("conductor-0", "inc-b")
    o._on_event("leave", key, None)  # stopped (after its drain), or its lease expired
    assert ended == [("conductor-0", "inc-a"), ("conductor-0", "inc-b")]
    assert not o.alive("conductor-0", "inc-b")
    o._on_event("join", node_key("c", "conductor", "x"), b"{}")  # not an owner key
    assert o.current == {} and len(ended) == 2


def test_the_reaper_gives_a_live_owner_longer_but_not_forever():
    o = Owners(None, "c", lambda *_: None)  # type: ignore[arg-type]
    o._on_event("join", owner_key("c", "conductor", "k"), b"live")
    node = SimpleNamespace(
        owners=o, cfg=SimpleNamespace(reservation_timeout_s=60.0, reservation_owned_timeout_s=600.0)
    )

    def due(conductor: str, inc: str, age: float, decoding: bool = False) -> bool:
        res = Reservation("r", 16, [], created=0.0, conductor=conductor, incarnation=inc)
        res.decoding = decoding
        return DecodeNode.reap_due(node, res, age)  # type: ignore[arg-type]

    assert not due("k", "live", 59) and not due("", "", 59)
    assert due("", "", 61) and due("k", "dead", 61)  # nobody alive owns these
    assert not due("k", "live", 61) and not due("k", "live", 599)  # a long prefill
    assert due("k", "live", 601)  # a bound: leaks still end
    assert not due("", "", 10_000, decoding=True)  # its Decode call frees it


def test_the_metadata_names_are_defined_once_in_common():
    """The conductor sends and the decode node reads the same names: one definition, in
    services/common/ownership.py (torch-free), which both import."""
    import pathlib

    import kvmesh.services.conductor.node_calls as conductor  # sends Reserve, Release
    import kvmesh.services.decode.server as decode
    from kvmesh.services.common import ownership

    for mod in (conductor, decode):
        src = pathlib.Path(mod.__file__).read_text()
        for name in ("CONDUCTOR_MD", "WRITERS_MD", "INCARNATION_MD"):
            assert f"\n{name} = " not in src, f"{mod.__name__} defines {name} again"
    assert decode.CONDUCTOR_MD is ownership.CONDUCTOR_MD
    assert decode.WRITERS_MD is conductor.WRITERS_MD is ownership.WRITERS_MD


# -- a real cluster --------------------------------------------------------------------------


@pytest.fixture(scope="module")
def hold_dir(tmp_path_factory):
    return str(tmp_path_factory.mktemp("hold"))


@pytest.fixture(scope="module")
def cluster(tmp_path_factory, hold_dir):
    c = LocalCluster(
        str(tmp_path_factory.mktemp("owners")),
        conductors=2,
        lease_ttl=TTL,
        node_args=NODE_ARGS,
        conductor_args=DISAGG_ONLY,
        decode_args=["--fence-s", str(FENCE_S), "--reservation-timeout-s", str(REAP_S)],
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


def etcd_value(c: LocalCluster, key: str) -> bytes | None:
    return c._etcd_call(lambda etcd: etcd.get(key))


def decode_log(c: LocalCluster) -> str:
    with open(os.path.join(c.workdir, "decode-0.log")) as f:
        return f.read()


def wait_depth(addr: str, depth: int, what: str, timeout: float = 60) -> None:
    deadline = time.monotonic() + timeout
    while (got := decode_status(addr).queue_depth) != depth:
        assert time.monotonic() < deadline, f"{what}: queue depth {got}, want {depth}"
        time.sleep(0.1)


def read_all(call) -> tuple[int, str]:
    """(tokens, finish reason) of a whole Generate stream."""
    n, reason = 0, ""
    for msg in call:
        n += len(msg.token_ids)
        reason = msg.finish_reason or reason
    return n, reason


@pytest.fixture
def conductor_0(cluster):
    """conductor-0 serving (respawned if an earlier test stopped it), and again after."""
    wait_conductor_0(cluster)
    yield cluster
    if cluster.procs["conductor-0"].poll() is not None:
        cluster.respawn("conductor-0")


def wait_conductor_0(c: LocalCluster) -> None:
    """conductor-0 (respawned by an earlier test) serves again and owns its key."""
    deadline = time.monotonic() + 60
    key = owner_key(c.cluster, "conductor", "conductor-0")
    while True:
        try:
            status(c.conductors[0])
            if etcd_value(c, key):
                return
        except grpc.RpcError:
            pass
        assert time.monotonic() < deadline, "conductor-0 did not come back"
        time.sleep(0.2)


def test_the_reaper_spares_a_live_conductors_long_prefill_and_frees_an_orphan(cluster, hold):
    """A request of conductor-1 held at the prefill node (a long prefill) outlives the
    reaper's timeout; a reservation nobody owns, made later, is reaped meanwhile."""
    addr = decode_address(cluster)
    base = decode_status(addr).queue_depth
    hold.at("prefilling")
    with grpc.insecure_channel(cluster.conductors[1]) as ch:
        call = pbg.ConductorStub(ch).Generate(
            pb.GenerateRequest(prompt=long_prompt(), max_tokens=8), timeout=120
        )
        hold.wait_held(1, call)
        with grpc.insecure_channel(addr) as dch:  # no owner: the reaper's to free
            pbg.DecodeNodeStub(dch).Reserve(
                pb.ReserveRequest(request_id="orphan-1", prompt_tokens=64, max_tokens=8),
                timeout=5,
            )
        wait_depth(addr, base + 2, "both reserved")
        # the orphan, younger than the held request's reservation, is reaped ...
        wait_depth(addr, base + 1, "the orphan is reaped")
        assert "reservation orphan-1 never decoded; freeing it" in decode_log(cluster)
        # ... and the live conductor's request still holds its KV and finishes
        assert decode_status(addr).queue_depth == base + 1
        hold.at("")
        assert read_all(call) == (8, "length")
    wait_depth(addr, base, "all freed")


def test_a_conductor_stopping_gracefully_keeps_its_reservations_while_it_drains(conductor_0, hold):
    """SIGTERM to conductor-0 holding a request at prefilling: it deregisters at once,
    then drains. The decode node keeps the reservation (the owner key stays until after
    the drain), and the request finishes with all its tokens, not UNAVAILABLE."""
    cluster = conductor_0
    addr = decode_address(cluster)
    base = decode_status(addr).queue_depth
    reg = node_key(cluster.cluster, "conductor", "conductor-0")
    own = owner_key(cluster.cluster, "conductor", "conductor-0")
    hold.at("prefilling")
    with grpc.insecure_channel(cluster.conductors[0]) as ch:
        call = pbg.ConductorStub(ch).Generate(
            pb.GenerateRequest(prompt=long_prompt(), max_tokens=8), timeout=120
        )
        hold.wait_held(1, call)
        wait_depth(addr, base + 1, "reserved")
        proc = cluster.procs["conductor-0"]
        proc.send_signal(signal.SIGTERM)
        deadline = time.monotonic() + 30
        while etcd_value(cluster, reg) is not None:  # deregistered: draining now
            assert time.monotonic() < deadline, "conductor-0 never deregistered"
            time.sleep(0.05)
        assert etcd_value(cluster, own) is not None  # still owns its reservations
        # the decode node sees the deregistration well within this (it used to free the
        # reservation 0.1 s after SIGTERM) and the reaper's timeout passes: still held
        time.sleep(REAP_S + 1.5)
        assert proc.poll() is None, "conductor-0 did not drain"
        assert decode_status(addr).queue_depth == base + 1
        hold.at("")
        assert read_all(call) == (8, "length")
    cluster.stop_process("conductor-0")  # it exits after the drain
    assert proc.returncode == 0
    assert etcd_value(cluster, own) is None  # deleted in its teardown
    wait_depth(addr, base, "all freed")
    assert "conductor conductor-0 left; freeing" not in decode_log(cluster)


def test_a_conductor_restarted_under_its_id_frees_its_dead_incarnations_reservation(
    conductor_0, hold
):
    """conductor-0 holding a reservation is SIGKILLed and started again at once with the
    same node id, well inside its old lease: the new process puts the owner key with a
    new incarnation, and the decode node frees the dead one's reservation then -- not
    when the old lease would end, nor (with the default 60 s) by the reaper."""
    cluster = conductor_0
    addr = decode_address(cluster)
    base = decode_status(addr).queue_depth
    own = owner_key(cluster.cluster, "conductor", "conductor-0")
    first = etcd_value(cluster, own)
    hold.at("prefilling")
    with grpc.insecure_channel(cluster.conductors[0]) as ch:
        call = pbg.ConductorStub(ch).Generate(
            pb.GenerateRequest(prompt=long_prompt(), max_tokens=8), timeout=120
        )
        hold.wait_held(1, call)
        wait_depth(addr, base + 1, "reserved")
        cluster.restart_process("conductor-0", signal.SIGKILL)
        with pytest.raises(grpc.RpcError) as e:
            read_all(call)
        assert e.value.code() == grpc.StatusCode.UNAVAILABLE
    wait_depth(addr, base, "the dead incarnation's reservation is freed", timeout=TTL + 30)
    assert etcd_value(cluster, own) not in (None, first)  # a new incarnation owns the key
    assert "conductor conductor-0 restarted; freeing reservation" in decode_log(cluster)
