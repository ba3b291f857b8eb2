"""What the store benchmark's sides share (:mod:`kvmesh.loadtest.bench_store`, the
kvmesh side and the engine peer; :mod:`kvmesh.loadtest.bench_store_mooncake`): the
values put and read back and their checks, the read -> put tag mapping, percentiles,
free ports, the run's data-plane secret, and the network namespace the ``netns``
topology builds (its names and addresses, running a command in it, waiting for a port).
"""

from __future__ import annotations

import os
import shutil
import socket
import subprocess
import time

import numpy as np

NETNS = "kvmesh-bench"
VETH = ("kvb-host", "kvb-peer")
NETNS_IPS = ("10.231.7.1", "10.231.7.2")
# the data-plane secret of this run (the well-known dev secret is refused off loopback)
SECRET = os.environ.setdefault("KVMESH_BENCH_SECRET", os.urandom(16).hex())
READS = {
    "get": "put",
    "batch_get": "batch_put",
    "get_into": "put_from",
    "batch_get_into": "batch_put_from",
}


def _put_tag(tag: str, api: str) -> str:
    """The tag of the put whose keys a read of ``api`` reads back."""
    return tag[: -len(api)] + READS[api]


def pct(xs: list[float], p: float) -> float:
    xs = sorted(xs)
    return xs[min(len(xs) - 1, int(p / 100 * len(xs)))] if xs else 0.0


def _free_port(host: str = "127.0.0.1") -> int:
    with socket.socket() as s:
        s.bind((host, 0))
        return s.getsockname()[1]


class Values:
    """``ops`` distinct values of ``size`` bytes: one random buffer (the zero-copy
    source), its slices as ``bytes`` (the bytes APIs' values), and a destination buffer
    for the zero-copy gets, zeroed before each read-back."""

    def __init__(self, size: int, ops: int) -> None:
        self.size, self.ops = size, ops
        self.src = np.frombuffer(os.urandom(size * ops), dtype=np.uint8).copy()
        self.dst = np.zeros(size * ops, dtype=np.uint8)
        self.values = [self.src[i * size : (i + 1) * size].tobytes() for i in range(ops)]

    def check_bytes(self, got: list) -> int:
        """How many values read back differ from the ones put (None counts)."""
        return sum(1 for i, v in enumerate(got) if v is None or v != self.values[i])

    def check_dst(self) -> int:
        bad = self.dst.reshape(self.ops, self.size) != self.src.reshape(self.ops, self.size)
        n = int(bad.any(axis=1).sum())
        self.dst[:] = 0
        return n


# ------------------------------------------------------------------------------ floor
FLOOR_REQ = 8  # bytes of a floor request (a counter)
FLOOR_REPLY = 4096  # bytes of its reply: the request repeated


def echo_serve(ls: socket.socket) -> None:
    """The host's floor, server side: for each connection accepted on ``ls``, answers
    every ``FLOOR_REQ``-byte request with ``FLOOR_REPLY`` bytes (the request repeated),
    with blocking sockets and nothing else, until the peer closes."""
    while True:
        try:
            s, _ = ls.accept()
        except OSError:
            return
        with s:
            try:
                _echo(s)
            except OSError:
                pass  # that client went away: serve the next one


def _echo(s: socket.socket) -> None:
    s.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    req = bytearray(FLOOR_REQ)
    while True:
        got = 0
        while got < FLOOR_REQ:
            n = s.recv_into(memoryview(req)[got:])
            if not n:
                return
            got += n
        s.sendall(bytes(req) * (FLOOR_REPLY // FLOOR_REQ))


def raw_round_trips(host: str, port: int, count: int) -> list[float]:
    """The host's floor, client side: ``count`` request/reply round trips with an
    :func:`echo_serve` peer over blocking sockets (no event loop, no framework: what one
    round trip between two processes costs here); every reply is checked. -> seconds
    each; ValueError on a wrong reply."""
    lat: list[float] = []
    reply = bytearray(FLOOR_REPLY)
    view = memoryview(reply)
    with socket.create_connection((host, port), timeout=10) as s:
        s.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        for i in range(count):
            req = i.to_bytes(FLOOR_REQ, "little")
            t = time.perf_counter()
            s.sendall(req)
            got = 0
            while got < FLOOR_REPLY:
                n = s.recv_into(view[got:])
                if not n:
                    raise ValueError("floor peer closed the connection")
                got += n
            lat.append(time.perf_counter() - t)
            if reply != req * (FLOOR_REPLY // FLOOR_REQ):
                raise ValueError(f"floor peer answered round trip {i} wrongly")
    return lat


# ------------------------------------------------------------------------------ netns
def _in_ns(ns: str | None) -> list[str]:
    return ["ip", "netns", "exec", ns] if ns else []


def _sh(*cmd: str) -> None:
    subprocess.run(cmd, check=True, capture_output=True, timeout=30)


def netns_up() -> str | None:
    """Builds the namespace and the veth pair; None when done, else why not."""
    if os.geteuid() != 0:
        return "netns topology needs root"
    if shutil.which("ip") is None:
        return "netns topology needs iproute2 (ip)"
    netns_down()
    try:
        _sh("ip", "netns", "add", NETNS)
        _sh("ip", "link", "add", VETH[0], "type", "veth", "peer", "name", VETH[1])
        _sh("ip", "link", "set", VETH[1], "netns", NETNS)
        _sh("ip", "addr", "add", f"{NETNS_IPS[0]}/24", "dev", VETH[0])
        _sh("ip", "link", "set", VETH[0], "up")
        _sh("ip", "netns", "exec", NETNS, "ip", "addr", "add", f"{NETNS_IPS[1]}/24", "dev", VETH[1])
        _sh("ip", "netns", "exec", NETNS, "ip", "link", "set", VETH[1], "up")
        _sh("ip", "netns", "exec", NETNS, "ip", "link", "set", "lo", "up")
    except (subprocess.CalledProcessError, subprocess.TimeoutExpired, OSError) as e:
        netns_down()
        err = getattr(e, "stderr", b"") or b""
        return f"cannot build a network namespace: {e} {err.decode(errors='replace').strip()}"
    return None


def netns_down() -> None:
    for cmd in (("ip", "link", "del", VETH[0]), ("ip", "netns", "del", NETNS)):
        subprocess.run(cmd, capture_output=True, timeout=30)


def _wait_port(host: str, port: int, timeout: float) -> bool:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        try:
            socket.create_connection((host, port), timeout=1).close()
            return True
        except OSError:
            time.sleep(0.1)
    return False
