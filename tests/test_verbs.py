"""Tests for the RDMA verbs transport (rdma/verbs.py).

Everything but the last test runs against ``FakeVerbs``: an in-memory
implementation of the :class:`kvmesh.rdma.verbs_layer.VerbsLayer` seam that enforces
the RC queue-pair state machine, checks lkeys/rkeys and bounds like a NIC, and
performs RDMA WRITE/READ with memmove when the completion queue is polled.
The real-device test runs wherever libibverbs lists a device and skips here.
"""

from __future__ import annotations

import asyncio
import ctypes
import itertools
import logging
import threading

import numpy as np
import pytest

import kvmesh.rdma.factory as factory
import kvmesh.rdma.verbs as verbs
import kvmesh.rdma.verbs_layer as verbs_layer
from kvmesh.rdma import Slice, TcpTransport, TransferEngine, TransferError, make_transport
from kvmesh.rdma.verbs import VerbsTransport
from kvmesh.rdma.verbs_layer import Completion, DeviceInfo, PortInfo, VerbsLayer, memory_numa_node

pytestmark = pytest.mark.timeout(60)

SECRET = b"verbs-test-secret"
KiB, MiB = 1 << 10, 1 << 20
IBV_WC_REM_ACCESS_ERR, IBV_WC_WR_FLUSH_ERR = 10, 5
LEGAL = {("RESET", "INIT"), ("INIT", "RTR"), ("RTR", "RTS")}


class _Obj:
    def __init__(self, **kw):
        self.__dict__.update(kw)


class FakeFabric:
    """Shared 'wire' between fake NICs: QPs by number, MRs by rkey."""

    def __init__(self):
        self.lock = threading.RLock()
        self.qps: dict[int, _Obj] = {}
        self.mrs: dict[int, _Obj] = {}
        self.keys = itertools.count(0x100)
        self.qpns = itertools.count(0x40)
        self.transitions: list[tuple[int, str, str]] = []
        self.posted: dict[str, int] = {}  # device -> pieces posted
        self.piece_sizes: list[int] = []
        self.fail_next_rkey = False


class FakeVerbs(VerbsLayer):
    def __init__(self, fabric: FakeFabric, devices: list[tuple[str, int]]):
        self.f = fabric
        self.devices = [DeviceInfo(n, numa) for n, numa in devices]

    def list_devices(self):
        return list(self.devices)

    def open_device(self, name):
        return _Obj(name=name, closed=False)

    def query_port(self, ctx, port, gid_index):
        assert port == 1
        n = abs(hash(ctx.name)) & 0xFFFF
        return PortInfo(
            lid=n, gid=f"fe80:0000:0000:0000:0000:0000:0000:{n:04x}", active=True, mtu=5
        )

    def alloc_pd(self, ctx):
        return _Obj(ctx=ctx)

    def reg_mr(self, pd, addr, length):
        with self.f.lock:
            mr = _Obj(
                pd=pd,
                addr=addr,
                length=length,
                lkey=next(self.f.keys),
                rkey=next(self.f.keys),
                valid=True,
            )
            self.f.mrs[mr.lkey] = self.f.mrs[mr.rkey] = mr
        return mr

    def create_cq(self, ctx, depth):
        return _Obj(ctx=ctx, depth=depth, queue=[])

    def create_qp(self, pd, cq, max_send_wr):
        with self.f.lock:
            qp = _Obj(
                pd=pd,
                cq=cq,
                qp_num=next(self.f.qpns),
                state="RESET",
                attrs={},
                depth=max_send_wr,
                outstanding=0,
            )
            self.f.qps[qp.qp_num] = qp
        return qp

    def modify_qp(self, qp, state, **attrs):
        if state != "ERR" and (qp.state, state) not in LEGAL:
            raise RuntimeError(f"fake verbs: illegal transition {qp.state}->{state}")
        if state == "RTR":
            assert {"dest_qp_num", "rq_psn", "dlid", "dgid", "port"} <= set(attrs)
        if state == "RTS":
            assert "sq_psn" in attrs
        self.f.transitions.append((qp.qp_num, qp.state, state))
        qp.attrs.update(attrs)
        qp.state = state

    def post_send(self, qp, wr_id, op, local_addr, length, lkey, remote_addr, rkey):
        if qp.state != "RTS":
            raise RuntimeError(f"post_send on a QP in state {qp.state}")
        if qp.outstanding >= qp.depth:
            raise RuntimeError("send queue overflow")
        qp.outstanding += 1
        with self.f.lock:
            self.f.posted[qp.pd.ctx.name] = self.f.posted.get(qp.pd.ctx.name, 0) + 1
            self.f.piece_sizes.append(length)
            if self.f.fail_next_rkey:
                self.f.fail_next_rkey = False
                rkey ^= 0xFFFF
        qp.cq.queue.append((qp, wr_id, op, local_addr, length, lkey, remote_addr, rkey))

    def _execute(self, qp, op, laddr, length, lkey, raddr, rkey) -> int:
        if qp.state == "ERR":
            return IBV_WC_WR_FLUSH_ERR
        with self.f.lock:
            lmr = self.f.mrs.get(lkey)
            peer = self.f.qps.get(qp.attrs.get("dest_qp_num"))
            rmr = self.f.mrs.get(rkey)
        if (
            lmr is None
            or lmr.pd is not qp.pd
            or not lmr.valid
            or not lmr.addr <= laddr <= laddr + length <= lmr.addr + lmr.length
        ):
            return 4  # IBV_WC_LOC_PROT_ERR
        if (
            peer is None
            or peer.state not in ("RTR", "RTS")
            or peer.attrs.get("dest_qp_num") != qp.qp_num
        ):
            return 12  # IBV_WC_RETRY_EXC_ERR
        if (
            rmr is None
            or rmr.rkey != rkey
            or rmr.pd is not peer.pd
            or not rmr.valid
            or not rmr.addr <= raddr <= raddr + length <= rmr.addr + rmr.length
        ):
            return IBV_WC_REM_ACCESS_ERR
        if op == "WRITE":
            ctypes.memmove(raddr, laddr, length)
        else:
            ctypes.memmove(laddr, raddr, length)
        return 0

    def poll_cq(self, cq, max_entries):
        out = []
        while cq.queue and len(out) < max_entries:
            qp, wr_id, op, laddr, length, lkey, raddr, rkey = cq.queue.pop(0)
            qp.outstanding -= 1
            status = self._execute(qp, op, laddr, length, lkey, raddr, rkey)
            if status and qp.state != "ERR":
                qp.state = "ERR"
            out.append(Completion(wr_id, status, "" if not status else f"status {status}"))
        return out

    def destroy(self, obj):
        if hasattr(obj, "rkey"):
            obj.valid = False
        if hasattr(obj, "qp_num"):
            obj.state = "DESTROYED"


def _engine(fabric, devices, **kw):
    tr = VerbsTransport(SECRET, layer=FakeVerbs(fabric, devices), **kw)
    return TransferEngine(SECRET, transport=tr, chunk_bytes=4 * MiB)


@pytest.fixture
async def fake_pair():
    fabric = FakeFabric()
    a = _engine(fabric, [("a_nic0", 0), ("a_nic1", 1)], piece_bytes=MiB)
    b = _engine(fabric, [("b_nic0", 0), ("b_nic1", 1)], piece_bytes=MiB)
    await a.start()
    await b.start()
    yield fabric, a, b
    await a.close()
    await b.close()


async def test_batched_write_read_sliced_and_striped(fake_pair, monkeypatch):
    monkeypatch.setattr(verbs, "memory_numa_node", lambda addr: -1)  # no preference
    fabric, a, b = fake_pair
    rng = np.random.default_rng(3)
    sizes = [1, 7, 4096, 65536 + 3, MiB, 5 * MiB + 11, 9 * MiB] + [
        int(x) for x in rng.integers(1, 20000, size=50)
    ]
    total = sum(sizes) + 10 * len(sizes)
    src = rng.integers(0, 256, size=total, dtype=np.uint8)
    dst = np.zeros(total + 100, dtype=np.uint8)
    back = np.zeros(total, dtype=np.uint8)
    rs, rd, rb = a.register(src), b.register(dst), a.register(back)
    slices, pos = [], 0
    for n in sizes:
        slices.append(Slice(rs, pos, rd, pos + 50, n))
        pos += n + 10
    await a.write(b.address, slices)
    for s in slices:
        assert np.array_equal(
            dst[s.remote_offset : s.remote_offset + s.length],
            src[s.local_offset : s.local_offset + s.length],
        )
    assert not dst[:50].any()
    await a.read(
        b.address, [Slice(rb, s.local_offset, rd, s.remote_offset, s.length) for s in slices]
    )
    for s in slices:
        assert np.array_equal(
            back[s.local_offset : s.local_offset + s.length],
            src[s.local_offset : s.local_offset + s.length],
        )

    # slicing: 4 MiB engine chunks cut into <= 1 MiB pieces
    assert max(fabric.piece_sizes) == MiB
    expect = 0
    for n in sizes:
        for off in range(0, n, 4 * MiB):
            expect += -(-min(4 * MiB, n - off) // MiB)
    assert len(fabric.piece_sizes) == 2 * expect
    # striping: both of a's NICs carried a fair share
    pa0, pa1 = fabric.posted["a_nic0"], fabric.posted["a_nic1"]
    assert abs(pa0 - pa1) <= 0.2 * (pa0 + pa1)
    # every QP walked RESET -> INIT -> RTR -> RTS exactly once, in order
    by_qp: dict[int, list] = {}
    for qpn, old, new in fabric.transitions:
        by_qp.setdefault(qpn, []).append((old, new))
    assert len(by_qp) == 4  # 2 client-side + 2 server-side
    for steps in by_qp.values():
        assert steps == [("RESET", "INIT"), ("INIT", "RTR"), ("RTR", "RTS")]
    st = a.stats
    assert st["rdma_bytes_out"] == sum(sizes) == st["rdma_bytes_in"]
    assert st["rdma_handshakes"] == 1 and st["mr_registrations"] == 4
    assert b.stats["mr_registrations"] == 2  # once per region per NIC
    assert a.bandwidth(b.address) is not None and a.bandwidth(b.address) > 0


async def test_numa_preference_picks_near_nic(fake_pair, monkeypatch):
    fabric, a, b = fake_pair
    monkeypatch.setattr(verbs, "memory_numa_node", lambda addr: 1)  # memory on node 1
    src = np.arange(8 * MiB, dtype=np.uint8)
    dst = np.zeros(8 * MiB, dtype=np.uint8)
    rs, rd = a.register(src), b.register(dst)
    await a.write(b.address, [Slice(rs, 0, rd, 0, 8 * MiB)])
    assert np.array_equal(src, dst)
    assert fabric.posted.get("a_nic1", 0) == 8 and fabric.posted.get("a_nic0", 0) == 0


async def test_numa_unknown_falls_back_to_device_order():
    fabric = FakeFabric()
    a = _engine(fabric, [("x0", 3), ("x1", 4)])
    b = _engine(fabric, [("y0", -1)])
    async with a, b:
        src = np.ones(4 * MiB, dtype=np.uint8)
        dst = np.zeros(4 * MiB, dtype=np.uint8)
        rs, rd = a.register(src), b.register(dst)
        await a.write(b.address, [Slice(rs, 0, rd, 0, 4 * MiB)])
        assert dst.all()
        # memory is on node 0 (or unknown): no near NIC -> stripe over both
        assert fabric.posted["x0"] == fabric.posted["x1"] == 2


async def test_errors_bounds_unknown_region_and_late_registration(fake_pair):
    fabric, a, b = fake_pair
    src = np.full(MiB, 7, dtype=np.uint8)
    dst = np.zeros(MiB, dtype=np.uint8)
    rs, rd = a.register(src), b.register(dst)
    await a.write(b.address, [Slice(rs, 0, rd, 0, 1000)])
    with pytest.raises(TransferError, match="out of bounds"):
        await a.write(b.address, [Slice(rs, 0, rd, MiB - 10, 100)])
    with pytest.raises(TransferError, match="unknown region"):
        await a.read(b.address, [Slice(rs, 0, 999, 0, 10)])
    # a region the peer registers after the QPs are up is found via "mrs?"
    late = np.zeros(2 * MiB, dtype=np.uint8)
    rl = b.register(late)
    await a.write(b.address, [Slice(rs, 0, rl, MiB, MiB)])
    assert (late[MiB:] == 7).all() and not late[:MiB].any()


async def test_completion_error_fails_transfer_then_reconnects(fake_pair):
    fabric, a, b = fake_pair
    src = np.full(2 * MiB, 9, dtype=np.uint8)
    dst = np.zeros(2 * MiB, dtype=np.uint8)
    rs, rd = a.register(src), b.register(dst)
    await a.write(b.address, [Slice(rs, 0, rd, 0, 10)])
    fabric.fail_next_rkey = True
    with pytest.raises(TransferError, match="RDMA WRITE .* failed"):
        await a.write(b.address, [Slice(rs, 0, rd, 0, 2 * MiB)])
    assert a.stats["rdma_errors"] >= 1
    await a.write(b.address, [Slice(rs, 0, rd, 0, 2 * MiB)])  # fresh QPs
    assert (dst == 9).all()
    assert a.stats["rdma_handshakes"] == 2


async def test_notify_after_writes_and_many_pieces_backpressure():
    fabric = FakeFabric()
    a = _engine(fabric, [("a0", -1)], piece_bytes=4 * KiB, qp_depth=8)
    b = _engine(fabric, [("b0", -1)])
    async with a, b:
        got: list[bytes] = []
        ev = asyncio.Event()
        dst = np.zeros(MiB, dtype=np.uint8)
        src = np.random.default_rng(0).integers(0, 256, size=MiB, dtype=np.uint8)
        rs, rd = a.register(src), b.register(dst)

        def on_notify(p: bytes) -> None:
            got.append(p)
            got.append(bytes(dst[:4]) == bytes(src[:4]) and b"landed" or b"missing")
            ev.set()

        b.add_notify_handler(on_notify)
        a.write(b.address, [Slice(rs, i * 64 * KiB, rd, i * 64 * KiB, 64 * KiB) for i in range(16)])
        await a.notify(b.address, b"done")
        await asyncio.wait_for(ev.wait(), 5)
        assert got == [b"done", b"landed"]
        assert np.array_equal(src, dst)
        assert len(fabric.piece_sizes) == MiB // (4 * KiB)  # 256 pieces, depth 8


async def test_peer_without_rdma_fails_cleanly():
    fabric = FakeFabric()
    a = _engine(fabric, [("a0", -1)], connect_timeout=0.5)
    b = TransferEngine(SECRET, transport="tcp")  # TCP-only peer ignores hello
    async with a, b:
        src = np.ones(1000, dtype=np.uint8)
        rs, rd = a.register(src), b.register(np.zeros(1000, dtype=np.uint8))
        with pytest.raises(TransferError, match="RDMA"):
            await a.write(b.address, [Slice(rs, 0, rd, 0, 1000)])


def test_illegal_qp_transition_rejected():
    fabric = FakeFabric()
    layer = FakeVerbs(fabric, [("d", 0)])
    tr = VerbsTransport(SECRET, layer=layer)
    nic = verbs._Nic(0, "d", 0)
    nic.ctx = layer.open_device("d")
    nic.pd, nic.cq = layer.alloc_pd(nic.ctx), layer.create_cq(nic.ctx, 16)
    qp = verbs._QP(tr, nic, "peer:1")
    with pytest.raises(RuntimeError, match="illegal QP transition RESET -> RTS"):
        qp.move("RTS", sq_psn=1)
    qp.move("INIT", port=1)
    with pytest.raises(RuntimeError, match="INIT -> RTS"):
        qp.move("RTS", sq_psn=1)
    with pytest.raises(RuntimeError):  # the layer refuses posts before RTS
        layer.post_send(qp.handle, 1, "WRITE", 0, 1, 0, 0, 0)


# -- factory / engine wiring ------------------------------------------------------
def test_factory_auto_falls_back_to_tcp_with_one_log_line(caplog, monkeypatch):
    monkeypatch.delenv("KVMESH_TRANSPORT", raising=False)
    monkeypatch.setattr(factory, "_fallback_logged", False)
    monkeypatch.setattr(factory, "_probe_result", (False, "no RDMA device (test)"))
    with caplog.at_level(logging.INFO, logger="kvmesh.rdma.factory"):
        t1 = make_transport("auto", secret=SECRET)
        t2 = make_transport(secret=SECRET)
        e = TransferEngine(SECRET)
    assert isinstance(t1, TcpTransport) and isinstance(t2, TcpTransport)
    assert e.transport_kind == "TcpTransport"
    lines = [r.getMessage() for r in caplog.records if r.name == "kvmesh.rdma.factory"]
    assert len(lines) == 1 and "no RDMA device (test)" in lines[0]
    with pytest.raises(RuntimeError, match="no RDMA device"):
        make_transport("rdma", secret=SECRET)
    with pytest.raises(ValueError):
        make_transport("carrier-pigeon", secret=SECRET)
    assert isinstance(TransferEngine(SECRET, transport="tcp")._transport, TcpTransport)
    monkeypatch.setenv("KVMESH_TRANSPORT", "tcp")
    assert isinstance(make_transport(secret=SECRET), TcpTransport)


def test_factory_builds_verbs_with_layer_and_checksum_forces_tcp():
    tr = make_transport("rdma", secret=SECRET, layer=FakeVerbs(FakeFabric(), [("d", 0)]))
    assert isinstance(tr, VerbsTransport)
    assert isinstance(make_transport("auto", secret=SECRET, checksum=True), TcpTransport)
    e = TransferEngine(
        SECRET, transport="rdma", transport_options={"layer": FakeVerbs(FakeFabric(), [("d", 0)])}
    )
    assert e.transport_kind == "rdma"


def test_probe_failure_means_no_rdma_and_an_unexpected_one_is_logged(caplog, monkeypatch):
    monkeypatch.setattr(factory, "_probe_result", None)  # restored afterwards

    def missing():
        raise RuntimeError("pyverbs is not installed (test)")

    def broken():
        raise AttributeError("module 'pyverbs' has no attribute 'device' (test)")

    monkeypatch.setattr(verbs_layer, "probe_devices", missing)
    with caplog.at_level(logging.ERROR, logger="kvmesh.rdma.factory"):
        assert factory.rdma_unavailable_reason(refresh=True) == "pyverbs is not installed (test)"
        assert not caplog.records
        monkeypatch.setattr(verbs_layer, "probe_devices", broken)
        assert "no attribute" in (factory.rdma_unavailable_reason(refresh=True) or "")
    assert [r.getMessage() for r in caplog.records] == ["RDMA probe failed unexpectedly"]


def test_malformed_peer_region_table_is_a_transfer_error():
    assert VerbsTransport._parse_mrs({"3": [10, 20, [7, "8"]]}) == {3: (10, 20, [7, 8])}
    for raw in (None, {"3": [10]}, {"x": [1, 2, [3]]}, {"3": 5}):
        with pytest.raises(TransferError, match="malformed RDMA region table"):
            VerbsTransport._parse_mrs(raw)


async def test_post_send_failure_fails_the_transfer():
    class RefusingVerbs(FakeVerbs):
        def post_send(self, *args):
            raise RuntimeError("post refused (test)")

    fabric = FakeFabric()
    a = TransferEngine(
        SECRET, transport=VerbsTransport(SECRET, layer=RefusingVerbs(fabric, [("a0", 0)]))
    )
    b = _engine(fabric, [("b0", 0)])
    async with a, b:
        rs = a.register(np.ones(4096, dtype=np.uint8))
        rd = b.register(np.zeros(4096, dtype=np.uint8))
        with pytest.raises(TransferError, match="post_send failed: post refused"):
            await asyncio.wait_for(a.write(b.address, [Slice(rs, 0, rd, 0, 4096)]), 10)


async def test_connect_bug_fails_waiting_transfers_instead_of_hanging(caplog):
    class BuggyVerbs(FakeVerbs):
        def create_qp(self, pd, cq, max_send_wr):
            raise ZeroDivisionError("a bug (test)")

    fabric = FakeFabric()
    a = TransferEngine(
        SECRET, transport=VerbsTransport(SECRET, layer=BuggyVerbs(fabric, [("a0", 0)]))
    )
    b = _engine(fabric, [("b0", 0)])
    async with a, b:
        rs = a.register(np.ones(4096, dtype=np.uint8))
        rd = b.register(np.zeros(4096, dtype=np.uint8))
        with caplog.at_level(logging.ERROR, logger="kvmesh.rdma.verbs"):
            with pytest.raises(TransferError, match="ZeroDivisionError"):
                await asyncio.wait_for(a.write(b.address, [Slice(rs, 0, rd, 0, 4096)]), 10)
    assert any("crashed" in r.getMessage() for r in caplog.records)


def test_probe_reason_here():
    why = factory.rdma_unavailable_reason()
    assert why is None or isinstance(why, str)
    arr = np.ones(1 << 16, dtype=np.uint8)
    assert memory_numa_node(arr.ctypes.data) >= -1


# -- real device ------------------------------------------------------------------
_REAL_WHY = factory.rdma_unavailable_reason()


@pytest.mark.skipif(_REAL_WHY is not None, reason=f"no usable RDMA device: {_REAL_WHY}")
async def test_real_device_write_read_loopback():
    a = TransferEngine(SECRET, transport="rdma")
    b = TransferEngine(SECRET, transport="rdma")
    async with a, b:
        src = np.random.default_rng(5).integers(0, 256, size=24 * MiB, dtype=np.uint8)
        dst = np.zeros(24 * MiB, dtype=np.uint8)
        back = np.zeros(24 * MiB, dtype=np.uint8)
        rs, rd, rb = a.register(src), b.register(dst), a.register(back)
        await a.write(b.address, [Slice(rs, 0, rd, 0, 24 * MiB), Slice(rs, 5, rd, 3, 65536 + 1)])
        assert np.array_equal(src[5:65541], dst[3:65539])
        await a.read(b.address, [Slice(rb, 0, rd, 0, 24 * MiB)])
        assert np.array_equal(back, dst)
        assert a.stats["rdma_bytes_out"] >= 24 * MiB
