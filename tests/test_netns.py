"""Multi-host on one machine: two network namespaces joined by a veth pair,
a ``tbf`` rate limit on the sender side, one engine process per namespace.
Checks that ``TransferEngine.bandwidth(peer)`` tracks the configured rate
and roughly doubles when the rate doubles.  Needs root and iproute2
(``ip``, ``tc``); skips with the reason otherwise.  Namespaces are unique per
run (pid) and always removed.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

pytestmark = pytest.mark.timeout(60)

REPO = Path(__file__).resolve().parents[1]
SECRET = "netns-test-secret"
MiB = 1 << 20
TOTAL = 48 * MiB

SINK = textwrap.dedent("""
    import asyncio, json, sys
    import numpy as np
    from kvmesh.rdma import TransferEngine
    async def main():
        eng = TransferEngine(sys.argv[1].encode(), host=sys.argv[2], transport="tcp")
        await eng.start()
        rid = eng.register(np.zeros(int(sys.argv[3]), dtype=np.uint8))
        print(json.dumps({"address": eng.address, "region": rid}), flush=True)
        await asyncio.to_thread(sys.stdin.read)
        await eng.close()
    asyncio.run(main())
""")

SENDER = textwrap.dedent("""
    import asyncio, json, sys, time
    import numpy as np
    from kvmesh.rdma import Slice, TransferEngine
    async def main():
        secret, host, peer, rrid, total = sys.argv[1:6]
        total, rrid, MiB = int(total), int(rrid), 1 << 20
        eng = TransferEngine(secret.encode(), host=host, transport="tcp")
        await eng.start()
        rid = eng.register(np.ones(total, dtype=np.uint8))
        await eng.write(peer, [Slice(rid, 0, rrid, 0, 64 << 10)])  # connect; < 256 KiB
        assert eng.bandwidth(peer) is None
        t0 = time.perf_counter()
        await eng.write(peer, [Slice(rid, i, rrid, i, MiB) for i in range(0, total, MiB)])
        dt = time.perf_counter() - t0
        print(json.dumps({"bw": eng.bandwidth(peer), "elapsed": dt,
                          "stats_bw": eng.stats["bandwidth"].get(peer)}), flush=True)
        await eng.close()
    asyncio.run(main())
""")


def _run(*cmd: str, check: bool = True) -> subprocess.CompletedProcess:
    return subprocess.run(cmd, capture_output=True, text=True, check=check, timeout=20)


def _why_not() -> str | None:
    if os.geteuid() != 0:
        return "network namespaces need root"
    for tool in ("ip", "tc"):
        if shutil.which(tool) is None:
            return f"iproute2 tool {tool!r} not found"
    probe = f"kvmprobe{os.getpid()}"
    r = _run("ip", "netns", "add", probe, check=False)
    if r.returncode != 0:
        return f"cannot create a network namespace: {r.stderr.strip()}"
    _run("ip", "netns", "del", probe, check=False)
    return None


@pytest.fixture
def netns_pair():
    why = _why_not()
    if why is not None:
        pytest.skip(why)
    pid = os.getpid()
    ns_a, ns_b = f"kvm{pid}a", f"kvm{pid}b"
    veth_a, veth_b = f"kva{pid}"[:15], f"kvb{pid}"[:15]
    net = f"10.213.{pid % 250}"
    ip_a, ip_b = f"{net}.1", f"{net}.2"
    try:
        _run("ip", "netns", "add", ns_a)
        _run("ip", "netns", "add", ns_b)
        _run("ip", "link", "add", veth_a, "type", "veth", "peer", "name", veth_b)
        _run("ip", "link", "set", veth_a, "netns", ns_a)
        _run("ip", "link", "set", veth_b, "netns", ns_b)
        for ns, dev, addr in ((ns_a, veth_a, ip_a), (ns_b, veth_b, ip_b)):
            _run("ip", "-n", ns, "addr", "add", f"{addr}/30", "dev", dev)
            _run("ip", "-n", ns, "link", "set", dev, "up")
            _run("ip", "-n", ns, "link", "set", "lo", "up")
        yield {"ns_a": ns_a, "ns_b": ns_b, "veth_a": veth_a, "ip_a": ip_a, "ip_b": ip_b}
    finally:
        for ns in (ns_a, ns_b):
            _run("ip", "netns", "del", ns, check=False)
        _run("ip", "link", "del", veth_a, check=False)  # in case it never moved


def _set_rate(env: dict, mbit: int, first: bool) -> None:
    _run(
        "ip",
        "netns",
        "exec",
        env["ns_a"],
        "tc",
        "qdisc",
        "add" if first else "change",
        "dev",
        env["veth_a"],
        "root",
        "tbf",
        "rate",
        f"{mbit}mbit",
        "burst",
        "256kb",
        "latency",
        "50ms",
    )


def test_measured_bandwidth_tracks_tbf_rate(netns_pair):
    env = netns_pair
    penv = dict(os.environ, PYTHONPATH=str(REPO))
    sink = subprocess.Popen(
        [
            "ip",
            "netns",
            "exec",
            env["ns_b"],
            sys.executable,
            "-c",
            SINK,
            SECRET,
            env["ip_b"],
            str(TOTAL),
        ],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        text=True,
        cwd=REPO,
        env=penv,
    )
    try:
        peer = json.loads(sink.stdout.readline())
        results = {}
        for i, mbit in enumerate((200, 400)):
            _set_rate(env, mbit, first=(i == 0))
            out = subprocess.run(
                [
                    "ip",
                    "netns",
                    "exec",
                    env["ns_a"],
                    sys.executable,
                    "-c",
                    SENDER,
                    SECRET,
                    env["ip_a"],
                    peer["address"],
                    str(peer["region"]),
                    str(TOTAL),
                ],
                capture_output=True,
                text=True,
                cwd=REPO,
                env=penv,
                timeout=25,
            )
            assert out.returncode == 0, out.stderr[-2000:]
            res = json.loads(out.stdout.strip().splitlines()[-1])
            results[mbit] = res
            limit = mbit * 1e6 / 8
            assert res["stats_bw"] == res["bw"]
            assert 0.65 * limit <= res["bw"] <= 1.35 * limit, (mbit, res)
        print({m: round(r["bw"] / 1e6, 1) for m, r in results.items()}, "MB/s")
        ratio = results[400]["bw"] / results[200]["bw"]
        assert 1.5 <= ratio <= 2.6, results
    finally:
        sink.stdin.close()
        try:
            sink.wait(5)
        except subprocess.TimeoutExpired:
            sink.kill()
