"""The store-master's fast port under a huge frame (issue 34, finding 3), on a real
store-master process over real sockets: one connection sending a single 63 MiB frame (just
under the protocol's 64 MiB maximum) no longer stalls the loop - another client's calls
keep being answered promptly and the master keeps leading (no call is refused as a
standby's) - and a header declaring more than the maximum is refused at the header: that
connection is closed before any body arrives, with a log line saying why, and the others
are served on."""

from __future__ import annotations

import socket
import threading
import time
from pathlib import Path

import pytest

from kvmesh.services.store_master import wire
from tests.store_util import fast_address, running_store

pytestmark = pytest.mark.timeout(180)

FRAME = 63 << 20


@pytest.fixture(scope="module")
def store(tmp_path_factory):
    with running_store(str(tmp_path_factory.mktemp("frames")), nodes=1, segment="16MiB") as c:
        yield c


def _exists(s: socket.socket, rid: int) -> int:
    """One EXISTS call on ``s``; its status."""
    body = wire.pack_exists([b"probe-key"], False)
    s.sendall(wire.HEAD.pack(len(body), rid, wire.EXISTS) + body)
    n, got, status = wire.HEAD.unpack(s.recv(wire.HEAD_SIZE, socket.MSG_WAITALL))
    assert got == rid
    if n:
        s.recv(n, socket.MSG_WAITALL)
    return status


def test_a_63_mib_frame_does_not_stall_the_others_and_an_over_max_header_is_refused(store):
    addr = fast_address(store)
    # the big frame: an EXISTS call of no keys, padded to 63 MiB (its answer proves it was read)
    body = wire.pack_exists([], False)
    big = wire.HEAD.pack(FRAME, 99, wire.EXISTS) + body + bytes(FRAME - len(body))
    latencies: list[float] = []
    statuses: set[int] = set()
    stop = threading.Event()

    def probe() -> None:
        with socket.create_connection(addr, timeout=30) as s:
            s.settimeout(30)
            rid = 0
            while not stop.is_set():
                rid += 1
                t = time.perf_counter()
                statuses.add(_exists(s, rid))
                latencies.append(time.perf_counter() - t)
                time.sleep(0.002)

    prober = threading.Thread(target=probe)
    prober.start()
    try:
        time.sleep(0.3)
        baseline = len(latencies)
        t0 = time.perf_counter()
        with socket.create_connection(addr, timeout=60) as s:
            s.settimeout(60)
            s.sendall(big)
            n, rid, status = wire.HEAD.unpack(s.recv(wire.HEAD_SIZE, socket.MSG_WAITALL))
        sent_s = time.perf_counter() - t0
        time.sleep(0.2)
    finally:
        stop.set()
        prober.join(60)
    during = latencies[baseline:]
    worst = max(during)
    print(
        f"63 MiB frame read and answered in {sent_s:.3f} s; probe calls meanwhile: "
        f"{len(during)}, worst latency {worst * 1000:.1f} ms"
    )
    assert (rid, status) == (99, 0)
    assert statuses == {0}, statuses  # every probe served: the master kept leading
    # the old parser copied the whole buffer on each 256 KiB read: ~8 s of stalled loop
    assert worst < 1.0, f"a probe call waited {worst:.3f} s behind the 63 MiB frame"
    assert len(during) >= 10

    # a header past the maximum: refused at the header (no body follows), the connection
    # closed at once; the master serves the others on and says why in its log
    with socket.create_connection(addr, timeout=10) as s:
        s.settimeout(10)
        s.sendall(wire.HEAD.pack(wire.MAX_FRAME + 1, 5, wire.EXISTS))
        t = time.perf_counter()
        assert s.recv(1 << 16) == b""
        assert time.perf_counter() - t < 5
    with socket.create_connection(addr, timeout=10) as s:
        s.settimeout(10)
        assert _exists(s, 1) == 0
    log = Path(store.workdir, "store-master-0.log").read_text(errors="replace")
    assert f"declares {wire.MAX_FRAME + 1} bytes, past the protocol's maximum" in log
