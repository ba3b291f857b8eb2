"""The transfer engine's data port defends itself (issue 34, finding 5), over real
loopback sockets against a real engine in a process of its own:

- 200 clients that send one byte per second are closed once the handshake deadline
  passes (a deadline for the whole handshake, not for each receive), the server
  process's threads stay where they were (a handshake costs no thread), and a
  legitimate transfer to the same port succeeds meanwhile;
- at most ``max_conns`` connections at once: a pending handshake makes room for a new
  connection (the oldest is closed), an authenticated one never does; each refusal is
  counted, and the node's ``/metrics`` shows the counts.
"""

from __future__ import annotations

import asyncio
import os
import socket
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest
import torch

from kvmesh.loadtest.faults_slowloris import SlowClients, threads_of
from kvmesh.rdma import Slice, TransferEngine
from kvmesh.rdma.tcp import TcpTransport
from kvmesh.rdma.wire import client_handshake, split_address

pytestmark = pytest.mark.timeout(120)

SECRET = b"data-port-limits-secret"
REPO = Path(__file__).resolve().parents[1]

PEER = textwrap.dedent("""
    import asyncio, sys, torch
    from kvmesh.rdma import TransferEngine

    async def main():
        eng = TransferEngine(sys.argv[1].encode(), transport="tcp")
        await eng.start()
        buf = torch.zeros(1 << 20, dtype=torch.uint8)
        rid = eng.register(buf)
        print(eng.address, rid, flush=True)
        await asyncio.to_thread(sys.stdin.read)  # until stdin closes
        await eng.close()

    asyncio.run(main())
""")


@pytest.fixture
def peer():
    env = dict(os.environ, PYTHONPATH=os.environ.get("PYTHONPATH", ""))
    proc = subprocess.Popen(
        [sys.executable, "-c", PEER, SECRET.decode()],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        env=env,
    )
    try:
        line = proc.stdout.readline().decode().split()
        assert line, "the peer did not start"
        yield proc.pid, line[0], int(line[1])
    finally:
        proc.stdin.close()
        try:
            proc.wait(15)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()


async def test_slow_clients_are_closed_at_the_deadline_and_cost_no_threads(peer):
    pid, address, rid = peer
    base = threads_of(pid)
    slow = await asyncio.to_thread(SlowClients, address, 200)
    eng = TransferEngine(SECRET, transport="tcp")
    await eng.start()
    try:
        local = torch.arange(1 << 16, dtype=torch.int32).view(torch.uint8)
        back = torch.zeros_like(local)
        r_local, r_back = eng.register(local), eng.register(back)
        peak, t0 = base, time.monotonic()
        wrote = False
        while time.monotonic() - t0 < 8.0:
            peak = max(peak, threads_of(pid))
            if not wrote and time.monotonic() - t0 > 1.0:
                # a legitimate peer, while the slow clients hold their connections
                n = local.numel()
                await asyncio.wait_for(eng.write(address, [Slice(r_local, 0, rid, 0, n)]), 10)
                await asyncio.wait_for(eng.read(address, [Slice(r_back, 0, rid, 0, n)]), 10)
                assert torch.equal(back, local)
                wrote = True
            await asyncio.sleep(0.2)
        held = slow.held()
        closed = sorted(slow.closed_at.values())
    finally:
        slow.close()
        await eng.close()
    print(
        f"slow clients: {len(slow.socks)}, held after 8 s: {held}; server threads "
        f"{base} -> peak {peak}; closed at {closed[:1]}..{closed[-1:]} s"
    )
    assert wrote
    # the deadline is for the whole handshake (3 s); one byte a second never makes it
    assert held == 0, f"{held} of 200 slow clients still held after 8 s"
    assert closed[-1] < 6.0, closed[-5:]
    # the legitimate engine adds a handful of serving threads; the slow ones add none
    assert peak <= base + 12, f"server threads {base} -> {peak}"


def _authenticated(address: str) -> socket.socket:
    s = socket.create_connection(split_address(address), timeout=5)
    client_handshake(s, SECRET)
    return s


def _closed_by_server(s: socket.socket, timeout: float = 3.0) -> bool:
    s.settimeout(timeout)
    try:
        while True:
            data = s.recv(4096)
            if not data:
                return True
    except TimeoutError:
        return False
    except OSError:
        return True


async def test_connection_cap_evicts_pending_handshakes_never_authenticated_peers():
    server = TcpTransport(SECRET, max_conns=4, poll_us=0)
    from kvmesh.rdma.transport import RegionTable

    await server.start(RegionTable(), lambda _: None)
    held: list[socket.socket] = []
    try:
        address = server.address
        # 4 idle connections that never authenticate fill the cap...
        idle = [socket.create_connection(split_address(address), timeout=5) for _ in range(4)]
        held += idle
        await asyncio.sleep(0.3)
        # ...and a legitimate peer still gets in: the oldest pending handshake makes room
        peers = [await asyncio.to_thread(_authenticated, address) for _ in range(4)]
        held += peers
        assert await asyncio.to_thread(_closed_by_server, idle[0], 1.0)
        # the cap is now all authenticated peers: a fifth is refused at once, and none
        # of the four is dropped for it
        extra = socket.create_connection(split_address(address), timeout=5)
        held.append(extra)
        assert await asyncio.to_thread(_closed_by_server, extra, 2.0)
        for p in peers:
            p.setblocking(False)
            with pytest.raises(BlockingIOError):
                p.recv(1)  # still open, nothing to read
        stats = server.stats()
        assert stats.get("conns_over_limit", 0) >= 5, stats  # 4 evicted + 1 refused
    finally:
        for s in held:
            s.close()
        await server.close()


async def test_handshake_deadline_and_refusals_are_counted():
    server = TcpTransport(SECRET, poll_us=0, connect_timeout=1.0)
    from kvmesh.rdma.transport import RegionTable

    await server.start(RegionTable(), lambda _: None)
    try:
        s = socket.create_connection(split_address(server.address), timeout=5)
        t = time.monotonic()
        assert await asyncio.to_thread(_closed_by_server, s, 5.0)
        took = time.monotonic() - t
        s.close()
        assert 0.8 <= took <= 2.5, took
        stats = server.stats()
        assert stats.get("handshake_timeouts") == 1, stats
    finally:
        await server.close()


def test_max_conns_must_be_positive():
    with pytest.raises(ValueError, match="max_conns"):
        TcpTransport(SECRET, max_conns=0)


async def test_refusals_show_on_the_nodes_metrics():
    """What a node's ``/metrics`` reads: its transfer engine's refusals by reason."""
    from prometheus_client import generate_latest

    from kvmesh.services.common import metrics

    class Node:  # what the collector reads of a node service: its id and engine
        node_id, role = "decode-refusals", "decode"

        def __init__(self, te: TransferEngine) -> None:
            self.te = te

    eng = TransferEngine(SECRET, transport="tcp", connect_timeout=1.0)
    await eng.start()
    node = Node(eng)
    metrics.track(node)
    try:
        stranger = socket.create_connection(split_address(eng.address), timeout=5)
        assert await asyncio.to_thread(_closed_by_server, stranger, 5.0)
        stranger.close()
        text = generate_latest(metrics.REGISTRY).decode()
        line = 'kvmesh_data_port_refused_total{node="decode-refusals",reason="deadline"} 1.0'
        assert line in text, [x for x in text.splitlines() if "data_port" in x]
    finally:
        await eng.close()
