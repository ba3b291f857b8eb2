"""Tests for the rdma/ transfer engine (TCP transport) over real loopback sockets."""

from __future__ import annotations

import asyncio
import os
import socket
import subprocess
import sys
import textwrap
import threading
import time
from pathlib import Path

import numpy as np
import pytest
import torch

from kvmesh.rdma import RegionTable, Slice, TransferEngine, TransferError, TransferStatus
from kvmesh.rdma.tcp import TcpTransport
from kvmesh.rdma.wire import MAGIC, NONCE_BYTES, recv_exact, recv_spin

pytestmark = pytest.mark.timeout(60)

SECRET = b"cluster-secret-for-tests"
REPO = Path(__file__).resolve().parents[1]
MiB = 1 << 20


@pytest.fixture
async def pair():
    a = TransferEngine(SECRET, chunk_bytes=2 * MiB)
    b = TransferEngine(SECRET, chunk_bytes=2 * MiB)
    await a.start()
    await b.start()
    yield a, b
    await a.close()
    await b.close()


def _layout(sizes: list[int], gap: int = 3) -> tuple[list[int], int]:
    offs, pos = [], 0
    for s in sizes:
        offs.append(pos)
        pos += s + gap
    return offs, pos


async def test_batched_write_and_read_mixed_sizes(pair):
    a, b = pair
    rng = np.random.default_rng(1)
    sizes = [1, 2, 7, 4096, 65536 + 3, MiB, 5 * MiB + 11, 20 * MiB]
    sizes += [int(x) for x in rng.integers(1, 20000, size=300)]
    rng.shuffle(sizes)
    src_offs, src_total = _layout(sizes, gap=5)
    dst_offs, dst_total = _layout(sizes, gap=17)
    src = torch.from_numpy(rng.integers(0, 256, size=src_total, dtype=np.uint8))
    dst = np.zeros(dst_total, dtype=np.uint8)
    back = bytearray(src_total)
    r_src, r_dst, r_back = a.register(src), b.register(dst), a.register(back)
    assert a.region_size(r_src) == src_total and b.region_size(r_dst) == dst_total

    slices = [Slice(r_src, so, r_dst, do, n) for so, do, n in zip(src_offs, dst_offs, sizes)]
    t = a.write(b.address, slices)
    await t
    assert t.status is TransferStatus.DONE and t.done() and t.error is None
    assert t.bytes == sum(sizes)
    expect = np.zeros(dst_total, dtype=np.uint8)
    s_np = src.numpy()
    for so, do, n in zip(src_offs, dst_offs, sizes):
        expect[do : do + n] = s_np[so : so + n]
    assert np.array_equal(dst, expect)  # incl. untouched gaps

    # read everything back into a bytearray region, different layout
    rslices = [Slice(r_back, so, r_dst, do, n) for so, do, n in zip(src_offs, dst_offs, sizes)]
    await a.read(b.address, rslices)
    got = np.frombuffer(back, dtype=np.uint8)
    for so, n in zip(src_offs, sizes):
        assert np.array_equal(got[so : so + n], s_np[so : so + n])
    assert a.stats["bytes_written"] == sum(sizes)
    assert a.stats["bytes_read"] == sum(sizes)
    assert b.stats["bytes_served_in"] == sum(sizes)


async def test_a_small_batch_goes_on_one_connection_a_large_one_spreads():
    """A batch is spread over one channel per ``SPREAD_BYTES`` of it: 128 values of
    4 KiB travel on one connection (one server thread takes them back to back; the
    next small batch takes the next idle channel), a batch of 8 MiB on all four; every
    byte lands either way."""
    from kvmesh.rdma import tcp

    a = TransferEngine(SECRET, conns_per_peer=4, chunk_bytes=MiB)
    b = TransferEngine(SECRET)
    await a.start()
    await b.start()
    try:
        rng = np.random.default_rng(7)
        src = rng.integers(0, 256, size=8 * MiB, dtype=np.uint8)
        dst = np.zeros(8 * MiB, dtype=np.uint8)
        r_src, r_dst = a.register(src), b.register(dst)
        small = [Slice(r_src, i * 4096, r_dst, i * 4096, 4096) for i in range(128)]
        assert 128 * 4096 < tcp.SPREAD_BYTES
        await a.write(b.address, small)
        assert a.stats["connects"] == 1
        await a.read(b.address, small)
        assert a.stats["connects"] == 2  # the next idle channel, not the same one
        assert np.array_equal(dst[: 128 * 4096], src[: 128 * 4096])
        await a.write(b.address, [Slice(r_src, 0, r_dst, 0, 8 * MiB)])  # 8 chunks
        assert a.stats["connects"] == 4
        assert np.array_equal(dst, src)
    finally:
        await a.close()
        await b.close()


async def test_bfloat16_and_float32_tensors(pair):
    a, b = pair
    src = torch.randn(3, 1024, 257, dtype=torch.bfloat16)
    dst = torch.zeros_like(src)
    n = src.numel() * src.element_size()
    r_src, r_dst = a.register(src), b.register(dst)
    assert b.region_size(r_dst) == n
    await a.write(b.address, [Slice(r_src, 0, r_dst, 0, n)])
    assert torch.equal(src, dst)

    f_remote = torch.randn(100_000, dtype=torch.float32)
    f_local = torch.zeros(50_000, dtype=torch.float32)
    r_remote, r_local = b.register(f_remote), a.register(f_local)
    # read the second half of the remote tensor into the local one
    await a.read(b.address, [Slice(r_local, 0, r_remote, 200_000, 200_000)])
    assert torch.equal(f_local, f_remote[50_000:])


async def test_notify_arrives_after_preceding_writes(pair):
    a, b = pair
    n_rounds, size = 6, 3 * MiB + 5
    src = np.random.default_rng(2).integers(0, 256, size=n_rounds * size, dtype=np.uint8)
    dst = np.zeros_like(src)
    r_src, r_dst = a.register(src), b.register(dst)
    seen: list[tuple[int, bool]] = []
    all_seen = asyncio.Event()
    loop_thread = threading.get_ident()

    def handler(payload: bytes) -> None:
        assert threading.get_ident() == loop_thread
        k = int(payload)
        end = (k + 1) * size
        seen.append((k, bool(np.array_equal(dst[:end], src[:end]))))
        if len(seen) == n_rounds:
            all_seen.set()

    b.add_notify_handler(handler)
    writes, notes = [], []
    for k in range(n_rounds):  # never await between write and notify
        writes.append(a.write(b.address, [Slice(r_src, k * size, r_dst, k * size, size)]))
        notes.append(a.notify(b.address, str(k).encode()))
    await asyncio.gather(*writes, *notes)
    await asyncio.wait_for(all_seen.wait(), 10)
    assert [k for k, _ in seen] == list(range(n_rounds))  # in order
    assert all(ok for _, ok in seen), seen  # memory was complete at each notify
    assert b.stats["notifies_received"] == n_rounds


async def test_notify_fails_if_preceding_write_failed(pair):
    a, b = pair
    src = bytearray(100)
    r = a.register(src)
    w = a.write(b.address, [Slice(r, 0, 999, 0, 100)])
    n = a.notify(b.address, b"x")
    with pytest.raises(TransferError):
        await w
    with pytest.raises(TransferError, match="preceding write"):
        await n


async def test_wrong_secret_refused_and_server_keeps_serving(pair):
    a, b = pair
    dst = bytearray(1024)
    r_dst = b.register(dst)
    bad = TransferEngine(b"not-the-secret")
    await bad.start()
    try:
        src = bytearray(b"z" * 1024)
        r = bad.register(src)
        t0 = time.monotonic()
        with pytest.raises(TransferError, match="secret"):
            await bad.write(b.address, [Slice(r, 0, r_dst, 0, 1024)])
        assert time.monotonic() - t0 < 5
        assert dst == bytearray(1024)
        assert b.stats.get("auth_rejected", 0) >= 1
        # a raw client that sends a wrong MAC learns nothing: server just closes
        with socket.create_connection(tuple(_hostport(b.address)), timeout=5) as s:
            hello = _recv_n(s, len(MAGIC) + NONCE_BYTES)
            assert hello.startswith(MAGIC)
            s.sendall(os.urandom(64))
            assert s.recv(100) == b""
    finally:
        await bad.close()
    # good peer still served
    src = bytearray(b"ok" * 512)
    await a.write(b.address, [Slice(a.register(src), 0, r_dst, 0, 1024)])
    assert dst == src


async def test_bad_region_and_bounds_fail_and_engine_keeps_working(pair):
    a, b = pair
    src = bytearray(os.urandom(4096))
    dst = bytearray(4096)
    r_src, r_dst = a.register(src), b.register(dst)
    with pytest.raises(TransferError, match="unknown region 4242"):
        await a.write(b.address, [Slice(r_src, 0, 4242, 0, 16)])
    with pytest.raises(TransferError, match="out of bounds"):
        await a.write(b.address, [Slice(r_src, 0, r_dst, 4000, 200)])  # payload drained
    with pytest.raises(TransferError, match="out of bounds"):
        await a.read(b.address, [Slice(r_src, 0, r_dst, 4090, 100)])
    t = a.write(b.address, [Slice(r_src, 4000, r_dst, 0, 200)])  # local OOB
    with pytest.raises(TransferError, match="local out of bounds"):
        await t
    assert t.status is TransferStatus.FAILED and "local" in t.error
    with pytest.raises(TransferError, match="local unknown region"):
        await a.read(b.address, [Slice(777, 0, r_dst, 0, 1)])
    # a batch with one bad slice fails as a whole, good slices still land
    bad_batch = [Slice(r_src, 0, r_dst, 0, 100), Slice(r_src, 0, r_dst, 5000, 10)]
    with pytest.raises(TransferError):
        await a.write(b.address, bad_batch)
    # same connections keep working
    await a.write(b.address, [Slice(r_src, 0, r_dst, 0, 4096)])
    assert dst == src
    b.unregister(r_dst)
    with pytest.raises(TransferError, match="unknown region"):
        await a.write(b.address, [Slice(r_src, 0, r_dst, 0, 1)])


async def test_checksum_mismatch_detected():
    a = TransferEngine(SECRET, checksum=True)
    b = TransferEngine(SECRET, checksum=True)
    await a.start()
    await b.start()
    try:
        src = np.random.default_rng(3).integers(0, 256, size=MiB, dtype=np.uint8)
        dst = np.zeros_like(src)
        r_src, r_dst = a.register(src), b.register(dst)
        await a.write(b.address, [Slice(r_src, 0, r_dst, 0, MiB)])  # clean
        assert np.array_equal(src, dst)
        a._corrupt_next = True  # client flips a WRITE byte after computing crc
        with pytest.raises(TransferError, match="checksum mismatch"):
            await a.write(b.address, [Slice(r_src, 0, r_dst, 0, MiB)])
        b._corrupt_next = True  # server flips a READ byte after computing crc
        back = np.zeros_like(src)
        with pytest.raises(TransferError, match="checksum mismatch"):
            await a.read(b.address, [Slice(a.register(back), 0, r_dst, 0, MiB)])
        assert a.stats["checksum_failures"] == 2  # one reported by b, one seen locally
        assert b.stats["checksum_failures"] == 1
        await a.write(b.address, [Slice(r_src, 0, r_dst, 0, MiB)])  # works again
        assert np.array_equal(src, dst)
    finally:
        await a.close()
        await b.close()


async def test_peer_dies_mid_transfer_fails_not_hangs():
    """A peer that authenticates, swallows some bytes and drops the connection."""
    from kvmesh.rdma.wire import server_handshake

    ls = socket.create_server(("127.0.0.1", 0))
    ls.settimeout(10)
    addr = f"127.0.0.1:{ls.getsockname()[1]}"
    stop = threading.Event()

    def swallow_and_drop(s: socket.socket) -> None:
        with s:
            s.settimeout(5)
            try:
                server_handshake(s, SECRET)
                s.recv(100_000)
            except OSError:
                pass

    def fake_peer() -> None:
        while not stop.is_set():
            try:
                s, _ = ls.accept()
            except OSError:
                return
            threading.Thread(target=swallow_and_drop, args=(s,), daemon=True).start()

    th = threading.Thread(target=fake_peer, daemon=True)
    th.start()
    a = TransferEngine(SECRET, conns_per_peer=2)
    await a.start()
    try:
        src = bytearray(8 * MiB)
        r = a.register(src)
        t0 = time.monotonic()
        with pytest.raises(TransferError, match="attempts"):
            await asyncio.wait_for(a.write(addr, [Slice(r, 0, 1, 0, 8 * MiB)]), 10)
        assert a.stats["retries"] >= 1
        stop.set()
        ls.shutdown(socket.SHUT_RDWR)  # wakes the blocked accept()
        ls.close()
        th.join(5)
        # nothing listening any more: fails fast too
        with pytest.raises(TransferError, match="cannot connect"):
            await asyncio.wait_for(a.read(addr, [Slice(r, 0, 1, 0, 10)]), 10)
        assert time.monotonic() - t0 < 10
    finally:
        stop.set()
        ls.close()
        await a.close()


async def test_unresponsive_peer_times_out():
    """A host that accepts TCP but never speaks (hung or black-holed peer)."""
    ls = socket.create_server(("127.0.0.1", 0), backlog=16)  # never accept()ed
    try:
        a = TransferEngine(SECRET, conns_per_peer=2, connect_timeout=0.5)
        await a.start()
        r = a.register(bytearray(1000))
        t0 = time.monotonic()
        with pytest.raises(TransferError, match="cannot connect"):
            await asyncio.wait_for(
                a.write(f"127.0.0.1:{ls.getsockname()[1]}", [Slice(r, 0, 1, 0, 1000)]), 10
            )
        assert time.monotonic() - t0 < 3  # two connect attempts of 0.5 s
        await a.close()
    finally:
        ls.close()


async def test_closed_engine_peer_fails_fast(pair):
    a, b = pair
    dst = bytearray(1000)
    r_dst = b.register(dst)
    r_src = a.register(bytearray(1000))
    await a.write(b.address, [Slice(r_src, 0, r_dst, 0, 1000)])
    await b.close()
    with pytest.raises(TransferError):
        await asyncio.wait_for(a.write(b.address, [Slice(r_src, 0, r_dst, 0, 1000)]), 10)


async def _warm_fast_lane(a: TransferEngine, peer: str, region: int, remote: int) -> None:
    """Issue single small reads until the loop-driven fast lane carries them."""
    deadline = time.monotonic() + 10
    while a.stats.get("fast_lane_requests", 0) == 0:
        assert time.monotonic() < deadline, "fast lane never came up"
        await a.read(peer, [Slice(region, 0, remote, 0, 1)])
        await asyncio.sleep(0.01)


async def test_single_small_ops_fast_lane_keeps_semantics(pair):
    a, b = pair
    rng = np.random.default_rng(7)
    size = 4 * MiB
    src = rng.integers(0, 256, size=size, dtype=np.uint8)
    dst = np.zeros(size, dtype=np.uint8)
    back = np.zeros(size, dtype=np.uint8)
    r_src, r_dst, r_back = a.register(src), b.register(dst), a.register(back)
    await _warm_fast_lane(a, b.address, r_back, r_dst)
    before = a.stats["fast_lane_requests"]
    # one slice per call, awaited one at a time, sizes around the lane limit
    for _i in range(150):
        n = int(rng.choice([1, 100, 4096, 65536, 65537, 256 << 10, 700_000, MiB, MiB + 1]))
        off = int(rng.integers(0, size - n))
        await a.write(b.address, [Slice(r_src, off, r_dst, off, n)])
        assert np.array_equal(dst[off : off + n], src[off : off + n])
        roff = int(rng.integers(0, size - n))
        await a.read(b.address, [Slice(r_back, roff, r_dst, off, n)])
        assert np.array_equal(back[roff : roff + n], src[off : off + n])
    assert a.stats["fast_lane_requests"] - before >= 150  # most went over the lane
    # error statuses come back over the lane; the lane keeps working
    with pytest.raises(TransferError, match="unknown region 4242"):
        await a.write(b.address, [Slice(r_src, 0, 4242, 0, 16)])
    with pytest.raises(TransferError, match="out of bounds"):
        await a.write(b.address, [Slice(r_src, 0, r_dst, size - 10, 100)])
    with pytest.raises(TransferError, match="out of bounds"):
        await a.read(b.address, [Slice(r_back, 0, r_dst, size - 10, 100)])
    n0 = a.stats["fast_lane_requests"]
    await a.write(b.address, [Slice(r_src, 0, r_dst, 0, 1000)])
    assert a.stats["fast_lane_requests"] == n0 + 1
    # notify after a lane write still sees the data
    got: list[bool] = []
    seen = asyncio.Event()

    def handler(payload: bytes) -> None:
        got.append(bool(np.array_equal(dst[:5000], src[5000:10000])))
        seen.set()

    b.add_notify_handler(handler)
    a.write(b.address, [Slice(r_src, 5000, r_dst, 0, 5000)])  # not awaited
    await a.notify(b.address, b"n")
    await asyncio.wait_for(seen.wait(), 10)
    assert got == [True]
    # many concurrent small ops (lane + channels) and a call from another thread
    ws = [a.write(b.address, [Slice(r_src, k * 9000, r_dst, k * 9000, 9000)]) for k in range(60)]
    await asyncio.gather(*ws)
    assert np.array_equal(dst[:540_000], src[:540_000])
    t = await asyncio.to_thread(a.read, b.address, [Slice(r_back, 0, r_dst, 0, 3000)])
    await t
    assert np.array_equal(back[:3000], src[:3000])
    assert a.stats["transfers_failed"] == 3


async def test_fast_lane_checksum_and_corruption():
    a = TransferEngine(SECRET, checksum=True)
    b = TransferEngine(SECRET, checksum=True)
    await a.start()
    await b.start()
    try:
        src = np.random.default_rng(8).integers(0, 256, size=MiB, dtype=np.uint8)
        dst, back = np.zeros_like(src), np.zeros_like(src)
        r_src, r_dst, r_back = a.register(src), b.register(dst), a.register(back)
        await _warm_fast_lane(a, b.address, r_back, r_dst)
        await a.write(b.address, [Slice(r_src, 0, r_dst, 0, 60_000)])
        await a.read(b.address, [Slice(r_back, 0, r_dst, 0, 60_000)])
        assert np.array_equal(back[:60_000], src[:60_000])
        n0 = a.stats["fast_lane_requests"]
        b._corrupt_next = True  # server flips a READ byte after its crc
        with pytest.raises(TransferError, match="checksum mismatch"):
            await a.read(b.address, [Slice(r_back, 0, r_dst, 0, 60_000)])
        assert a.stats["fast_lane_requests"] == n0 + 1  # detected on the lane
        a._corrupt_next = True  # client flips a WRITE byte after its crc
        with pytest.raises(TransferError, match="checksum mismatch"):
            await a.write(b.address, [Slice(r_src, 0, r_dst, 0, 60_000)])
        assert a.stats["checksum_failures"] == 2
        await a.write(b.address, [Slice(r_src, 0, r_dst, 0, 60_000)])
        await a.read(b.address, [Slice(r_back, 0, r_dst, 0, 60_000)])
        assert np.array_equal(back[:60_000], src[:60_000])
    finally:
        await a.close()
        await b.close()


async def test_fast_lane_lost_connection_retries_then_peer_gone_fails(pair, monkeypatch):
    import kvmesh.rdma.tcp_lane as tcp_lane

    monkeypatch.setattr(tcp_lane, "FAST_RETRY_S", 0.0)
    a, b = pair
    src = np.random.default_rng(9).integers(0, 256, size=MiB, dtype=np.uint8)
    dst = np.zeros_like(src)
    r_src, r_dst = a.register(src), b.register(dst)
    await _warm_fast_lane(a, b.address, r_src, r_dst)
    lane = a._transport._lanes[b.address]
    n0, retries0 = a.stats["fast_lane_requests"], a.stats.get("retries", 0)
    lane.sock.shutdown(socket.SHUT_WR)  # the lane breaks; the loop has not noticed
    t = a.write(b.address, [Slice(r_src, 0, r_dst, 0, 50_000)])
    assert a.stats["fast_lane_requests"] == n0 + 1  # tried on the lane...
    await asyncio.wait_for(t, 10)  # ...and retried on a channel
    assert np.array_equal(dst[:50_000], src[:50_000])
    assert a.stats["retries"] == retries0 + 1
    await _warm_fast_lane(a, b.address, r_src, r_dst)  # reconnects
    await b.close()
    with pytest.raises(TransferError):
        await asyncio.wait_for(a.write(b.address, [Slice(r_src, 0, r_dst, 0, 1000)]), 10)
    with pytest.raises(TransferError):
        await asyncio.wait_for(a.read(b.address, [Slice(r_src, 0, r_dst, 0, 1000)]), 10)


async def test_cancelled_awaiter_does_not_disturb_others(pair):
    a, b = pair
    src = np.random.default_rng(11).integers(0, 256, size=32 * MiB, dtype=np.uint8)
    dst = np.zeros_like(src)
    r_src, r_dst = a.register(src), b.register(dst)
    t = a.write(b.address, [Slice(r_src, 0, r_dst, 0, 32 * MiB)])
    assert t.wait(0) is False or t.done()
    other = asyncio.ensure_future(asyncio.wait_for(t, 20))
    with pytest.raises(asyncio.TimeoutError):
        await asyncio.wait_for(t, 0.0001)  # cancels only this awaiter
    assert await other is t
    assert await t is t and t.status is TransferStatus.DONE
    assert await asyncio.to_thread(t.wait, 5) is True and t.wait(0) is True
    assert np.array_equal(src, dst)


PEER_SCRIPT = textwrap.dedent("""
    import asyncio, sys
    import numpy as np
    from kvmesh.rdma import TransferEngine

    async def main():
        eng = TransferEngine(sys.argv[1].encode())
        await eng.start()
        region = np.arange(16 << 20, dtype=np.uint32)  # 64 MiB, known pattern
        rid = eng.register(region)
        print(eng.address, rid, flush=True)
        await asyncio.to_thread(sys.stdin.read)  # run until stdin closes
        await eng.close()

    asyncio.run(main())
""")


async def test_peer_in_separate_process():
    env = dict(os.environ, PYTHONPATH=str(REPO) + os.pathsep + os.environ.get("PYTHONPATH", ""))
    proc = subprocess.Popen(
        [sys.executable, "-c", PEER_SCRIPT, SECRET.decode()],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        env=env,
        cwd=REPO,
    )
    a = TransferEngine(SECRET)
    await a.start()
    try:
        line = await asyncio.wait_for(asyncio.to_thread(proc.stdout.readline), 30)
        peer, rid = line.decode().split()
        rid = int(rid)
        nbytes = 64 * MiB
        local = torch.zeros(nbytes, dtype=torch.uint8)
        r_local = a.register(local)
        # read the peer's pattern with mixed slice sizes
        sl = [
            Slice(r_local, 0, rid, 0, 12 * MiB + 4),
            Slice(r_local, 20 * MiB, rid, 20 * MiB, 4096),
        ]
        await a.read(peer, sl)
        want = np.arange(16 << 20, dtype=np.uint32).view(np.uint8)
        got = local.numpy()
        assert np.array_equal(got[: 12 * MiB + 4], want[: 12 * MiB + 4])
        assert np.array_equal(got[20 * MiB : 20 * MiB + 4096], want[20 * MiB : 20 * MiB + 4096])
        # write random bytes there, read them back elsewhere
        payload = np.random.default_rng(4).integers(0, 256, size=3 * MiB, dtype=np.uint8)
        r_pay = a.register(payload)
        await a.write(peer, [Slice(r_pay, 0, rid, 5 * MiB, 3 * MiB)])
        await a.read(peer, [Slice(r_local, 40 * MiB, rid, 5 * MiB, 3 * MiB)])
        assert np.array_equal(got[40 * MiB : 43 * MiB], payload)

        # kill the peer while lots of writes are in flight: they fail, never hang
        big = [a.write(peer, [Slice(r_local, 0, rid, 0, nbytes)]) for _ in range(40)]
        await asyncio.sleep(0.05)
        proc.kill()
        results = await asyncio.wait_for(asyncio.gather(*big, return_exceptions=True), 15)
        errors = [r for r in results if isinstance(r, Exception)]
        assert errors and all(isinstance(e, TransferError) for e in errors)
        assert all(t.done() for t in big)
    finally:
        if proc.poll() is None:
            proc.kill()
        proc.wait()
        await a.close()


def test_register_rejects_bad_buffers():
    e = TransferEngine(SECRET)
    with pytest.raises(ValueError):
        e.register(bytes(10))  # read-only
    with pytest.raises(ValueError):
        e.register(torch.zeros(4, 4).t())  # non-contiguous
    with pytest.raises(ValueError):
        e.register(np.zeros((4, 4))[:, 1])
    rid = e.register(memoryview(bytearray(10)))
    assert e.region_size(rid) == 10
    e.unregister(rid)
    with pytest.raises(KeyError):
        e.region_size(rid)


def _hostport(address: str) -> tuple[str, int]:
    host, port = address.rsplit(":", 1)
    return host, int(port)


def _recv_n(s: socket.socket, n: int) -> bytes:
    buf = b""
    while len(buf) < n:
        chunk = s.recv(n - len(buf))
        if not chunk:
            break
        buf += chunk
    return buf


def recv_polled(sock, view, poll_s):
    """The servers' pattern: spin for up to ``poll_s``, then block for the rest."""
    got = recv_spin(sock, view, poll_s) if poll_s else 0
    if got < len(view):
        recv_exact(sock, view[got:])
    return len(view)


@pytest.mark.parametrize("poll_s", [0.0, 0.0001, 0.05])
def test_recv_spin_then_block_fills_exactly_whether_data_comes_inside_or_after_the_window(poll_s):
    a, b = socket.socketpair()
    try:
        payload = os.urandom(300_000)

        def send_late() -> None:
            b.sendall(payload[:1000])  # inside any window
            time.sleep(0.01)  # past the 100 us window
            b.sendall(payload[1000:])
            b.sendall(b"next")

        t = threading.Thread(target=send_late)
        t.start()
        buf = bytearray(len(payload))
        assert recv_polled(a, memoryview(buf), poll_s) == len(payload)
        t.join()
        assert bytes(buf) == payload
        tail = bytearray(4)
        recv_polled(a, memoryview(tail), poll_s)
        assert tail == b"next"  # nothing of the next message was consumed early
        assert recv_spin(a, memoryview(bytearray(8)), 0.001) == 0  # nothing there: no block
        b.sendall(b"abc")
        part = bytearray(8)
        assert recv_spin(a, memoryview(part), 0.05) == 3 and part[:3] == b"abc"
        b.close()
        with pytest.raises(ConnectionError):
            recv_polled(a, memoryview(bytearray(1)), poll_s)
    finally:
        a.close()
        b.close()


async def test_engines_without_busy_polling_move_the_same_bytes():
    with pytest.raises(ValueError, match="poll_us"):
        TcpTransport(SECRET, poll_us=-1)
    a = TransferEngine(SECRET, poll_us=0, transport="tcp")
    b = TransferEngine(SECRET, poll_us=0, transport="tcp")
    await a.start()
    await b.start()
    try:
        src = np.arange(3 * MiB, dtype=np.uint8) * 7
        dst = np.zeros_like(src)
        back = np.zeros_like(src)
        r_src, r_dst, r_back = a.register(src), b.register(dst), a.register(back)
        for off, n in ((0, 1), (10, 65536), (70_000, MiB), (5, 3 * MiB - 5)):
            await a.write(b.address, [Slice(r_src, off, r_dst, off, n)])
            await a.read(b.address, [Slice(r_back, off, r_dst, off, n)])
        assert np.array_equal(dst[5:], src[5:]) and np.array_equal(back[5:], src[5:])
    finally:
        await a.close()
        await b.close()


def test_poll_backoff_doubles_while_windows_run_out_and_resets_on_a_catch():
    from kvmesh.rdma.wire import PollBackoff

    b = PollBackoff(cap=4)
    assert b.should_poll()
    skipped = []
    for _ in range(5):  # every window runs out
        b.missed()
        n = 0
        while not b.should_poll():
            n += 1
        skipped.append(n)
    assert skipped == [1, 2, 4, 4, 4]
    b.caught()
    b.missed()
    assert not b.should_poll() and b.should_poll()  # back to skipping one


# -- package structure ---------------------------------------------------------------
RDMA = REPO / "rdma"


def _rdma_import_graph() -> dict[str, set[str]]:
    """kvmesh.rdma module -> the kvmesh modules it imports, wherever the import sits
    (top level, inside functions, under ``if TYPE_CHECKING:``)."""
    import ast

    names = {
        "kvmesh.rdma" if p.stem == "__init__" else f"kvmesh.rdma.{p.stem}": p
        for p in RDMA.glob("*.py")
    }
    graph: dict[str, set[str]] = {}
    for name, path in names.items():
        package = name if path.stem == "__init__" else name.rpartition(".")[0]
        deps: set[str] = set()
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Import):
                deps.update(a.name for a in node.names)
            elif isinstance(node, ast.ImportFrom):
                if node.level:
                    base = ".".join(package.split(".")[: len(package.split(".")) - node.level + 1])
                    mod = f"{base}.{node.module}" if node.module else base
                else:
                    mod = node.module or ""
                deps.add(mod)
                deps.update(f"{mod}.{a.name}" for a in node.names if f"{mod}.{a.name}" in names)
        graph[name] = {d for d in deps if d == "kvmesh" or d.startswith("kvmesh.")}
    return graph


def test_split_tcp_modules_never_import_the_transport_module():
    """tcp.py imports them, so none may import it back, not even under TYPE_CHECKING
    (they see the transport as tcp_proto.TcpEndpoint).  The cycle check over every
    kvmesh module, and the rule that rdma never imports services, are in test_layers."""
    graph = _rdma_import_graph()
    assert {
        "kvmesh.rdma.tcp_channel",
        "kvmesh.rdma.tcp_server",
        "kvmesh.rdma.tcp_accept",
    } <= graph["kvmesh.rdma.tcp"]
    for mod in ("tcp_channel", "tcp_lane", "tcp_server", "tcp_proto", "tcp_accept"):
        assert "kvmesh.rdma.tcp" not in graph[f"kvmesh.rdma.{mod}"], mod


def test_rdma_modules_share_no_private_names():
    """No module imports another's underscore names, and the split transport modules
    touch underscore attributes of ``self`` only."""
    import ast

    for path in sorted(RDMA.glob("*.py")):
        tree = ast.parse(path.read_text())
        for node in ast.walk(tree):
            if isinstance(node, ast.ImportFrom) and node.level:
                private = [a.name for a in node.names if a.name.startswith("_")]
                assert not private, f"{path.name} imports {private} from .{node.module}"
            if (
                path.stem.startswith(("tcp", "verbs"))
                and isinstance(node, ast.Attribute)
                and node.attr.startswith("_")
                and not node.attr.startswith("__")
            ):
                owner = node.value.id if isinstance(node.value, ast.Name) else ast.unparse(node)
                assert owner == "self", f"{path.name}:{node.lineno} reads {ast.unparse(node)}"


async def test_region_view_is_a_bounds_checked_zero_copy_view():
    from kvmesh.rdma.transport import RemoteAccessError

    e = TransferEngine(SECRET, transport="tcp")
    buf = bytearray(b"0123456789")
    rid = e.register(buf)
    view = e.region_view(rid, 2, 5)
    assert bytes(view) == b"23456"
    buf[2] = ord("x")
    assert bytes(view[:1]) == b"x"  # no copy
    with pytest.raises(RemoteAccessError, match="out of bounds"):
        e.region_view(rid, 8, 5)
    with pytest.raises(RemoteAccessError, match="unknown region"):
        e.region_view(rid + 1, 0, 1)


def test_server_state_refuses_connections_once_shut():
    from kvmesh.rdma.tcp_server import ServerState

    a, b = socket.socketpair()
    try:
        state = ServerState(a, RegionTable(), lambda payload: None)
        t = threading.current_thread()
        assert state.add(a, t)
        assert state.shut() == ([a], [t])
        assert not state.add(b, t)  # the accept loop closes it instead
        assert state.shut() == ([a], [t])
        state.discard(a, t)
        assert state.shut() == ([], [])
    finally:
        a.close()
        b.close()


async def test_bandwidth_is_not_sampled_from_the_first_busy_period(pair):
    """The first busy period to a peer includes connecting to it (the transport connects
    on first use): it gives no sample, however many bytes it moves; the next one does."""
    a, b = pair
    n = 4 * MiB
    src, dst = np.ones(n, dtype=np.uint8), np.zeros(n, dtype=np.uint8)
    rs, rd = a.register(src), b.register(dst)
    await a.write(b.address, [Slice(rs, 0, rd, 0, n)])
    assert dst.all()
    assert a.bandwidth(b.address) is None
    await a.write(b.address, [Slice(rs, 0, rd, 0, n)])
    assert a.bandwidth(b.address) is not None and a.bandwidth(b.address) > 0
