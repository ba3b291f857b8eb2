"""The fault row ``slowloris-data-port`` (issue 34, finding 5): while the closed-loop
clients run, :data:`SLOW_CLIENTS` connections to a decode node's transfer-engine data port
each send one byte a second, never finishing the handshake. The row passes when no
request is wrong or fails, every slow connection is closed by the node within the
handshake deadline (3 s) plus :data:`CLOSE_SLACK_S`, and the node's threads stay within
:data:`THREAD_SLACK` of what it ran before (a pending handshake costs no thread).

It reads the node's ``kvmesh_data_port_refused_total`` from its ``/metrics`` before and
after. :class:`SlowClients` is also what ``tests/test_data_port_limits.py`` uses."""

from __future__ import annotations

import asyncio
import re
import socket
import threading
import time
import urllib.request

import grpc

from kvmesh.loadtest.fault_harness import Load, Plan, run_fault
from kvmesh.protos import kvmesh_pb2 as pb
from kvmesh.protos import kvmesh_pb2_grpc as pbg

SLOW_CLIENTS = 200
HANDSHAKE_S = 3.0  # the data port's deadline for a whole handshake (rdma.tcp_accept)
CLOSE_SLACK_S = 3.0
THREAD_SLACK = 8  # threads a node may start meanwhile for its real peers' connections
VICTIM = "decode-0"


class SlowClients:
    """``n`` connections to ``address`` that each send one byte a second (never a whole
    handshake in time), driven by one thread; records when the server closed each,
    in seconds since they connected (:attr:`closed_at`)."""

    def __init__(self, address: str, n: int) -> None:
        host, _, port = address.rpartition(":")
        self.socks: list[socket.socket] = []
        for _ in range(n):
            s = socket.create_connection((host.strip("[]"), int(port)), timeout=5)
            s.setblocking(False)
            self.socks.append(s)
        self.t0 = time.monotonic()
        self.closed_at: dict[int, float] = {}
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True, name="slow-clients")
        self._thread.start()

    def _closed(self, i: int) -> None:
        self.closed_at[i] = time.monotonic() - self.t0

    def _run(self) -> None:
        while not self._stop.is_set():
            for i, s in enumerate(self.socks):
                if i in self.closed_at:
                    continue
                try:
                    while s.recv(4096):  # the server's hello; b"" = closed
                        pass
                    self._closed(i)
                    continue
                except BlockingIOError:
                    pass
                except OSError:
                    self._closed(i)
                    continue
                try:
                    s.send(b"x")
                except OSError:
                    self._closed(i)
            self._stop.wait(1.0)

    def held(self) -> int:
        """Connections the server has not closed yet."""
        return len(self.socks) - len(self.closed_at)

    def close(self) -> None:
        self._stop.set()
        self._thread.join(5)
        for s in self.socks:
            s.close()


def threads_of(pid: int) -> int:
    """The thread count of process ``pid`` (0 once it is gone)."""
    try:
        with open(f"/proc/{pid}/status") as f:
            for line in f:
                if line.startswith("Threads:"):
                    return int(line.split()[1])
    except OSError:
        pass
    return 0


def refused(metrics_address: str) -> dict[str, float]:
    """``kvmesh_data_port_refused_total`` by reason, from a node's ``/metrics``."""
    try:
        with urllib.request.urlopen(f"http://{metrics_address}/metrics", timeout=5) as r:
            text = r.read().decode()
    except OSError:
        return {}
    pat = re.compile(r'^kvmesh_data_port_refused_total\{.*reason="(\w+)".*\} (\S+)$', re.M)
    return {m.group(1): float(m.group(2)) for m in pat.finditer(text)}


def _node(conductor: str, node_id: str) -> pb.NodeStatus:
    with grpc.insecure_channel(conductor) as ch:
        s = pbg.ConductorStub(ch).ClusterStatus(pb.ClusterStatusRequest(), timeout=5)
    return next(n for n in s.nodes if n.node_id == node_id)


async def fault_slowloris(cluster, load: Load, plan: Plan, res: dict) -> None:
    await asyncio.sleep(plan.before_s)
    node = await asyncio.to_thread(_node, cluster.conductor, VICTIM)
    pid = cluster.procs[VICTIM].pid
    before = await asyncio.to_thread(refused, node.metrics_address)
    base = threads_of(pid)
    res["t_fault"] = load.now()
    slow = await asyncio.to_thread(SlowClients, node.data_address, SLOW_CLIENTS)
    peak, all_closed = base, None
    try:
        t0 = time.monotonic()
        while time.monotonic() - t0 < plan.after_s:
            peak = max(peak, threads_of(pid))
            if all_closed is None and slow.held() == 0:
                all_closed = time.monotonic() - t0
            await asyncio.sleep(0.2)
        held = slow.held()
        last_close = max(slow.closed_at.values(), default=None)
    finally:
        slow.close()
    after = await asyncio.to_thread(refused, node.metrics_address)
    res["victim"] = VICTIM
    res["slow_clients"] = SLOW_CLIENTS
    res["slow_held_at_end"] = held
    res["slow_last_closed_s"] = round(last_close, 2) if last_close is not None else None
    res["threads_before"], res["threads_peak"] = base, peak
    res["refused_delta"] = {k: after.get(k, 0) - before.get(k, 0) for k in after}
    res["cluster_whole_s"] = round(all_closed, 2) if all_closed is not None else None
    res["whole_means"] = "every slow connection closed by the node"
    res["passed"] = bool(
        held == 0
        and last_close is not None
        and last_close <= HANDSHAKE_S + CLOSE_SLACK_S
        and peak - base <= THREAD_SLACK
    )


def slowloris_data_port(cluster, prompts, expect, plan: Plan) -> dict:
    """The row on the suite's shared cluster (:data:`kvmesh.loadtest.faults_plain.PLAIN`)."""
    row = run_fault(
        cluster,
        "slowloris-data-port",
        prompts,
        expect,
        plan,
        lambda ld, res: fault_slowloris(cluster, ld, plan, res),
    )
    # nothing may fail or be wrong, and the row's own checks (above) must hold
    row["passed"] = bool(
        row.pop("passed", False)
        and row["wrong"] == 0
        and row["hung"] == 0
        and row["failed_retriable"] == 0
        and row["failed_other"] == 0
    )
    return row
