"""Network cut and heal for :mod:`kvmesh.loadtest.faults` (on its harness,
:mod:`kvmesh.loadtest.fault_harness`): one prefill node runs in its own network
namespace joined to the host's by a veth pair; everything else (etcd, store-master, the
decode nodes and one more prefill node) binds the host-side veth address, the conductor
stays on loopback. Mid-load the veth goes down (the namespaced node loses etcd, the
store and the decode nodes at once, with no RST: packets simply vanish), then comes back.

Requests routed to the cut node must fail over to the other prefill node (the conductor
drops a node whose lease expired) and nothing may hang; after the heal the node
re-registers and serves again. Needs root and iproute2; skips with the reason otherwise.
"""

from __future__ import annotations

import asyncio
import os
import shutil
import subprocess
import sys
import time

from kvmesh.loadtest.fault_harness import (
    DISAGG_ONLY,
    NODE_ARGS,
    TTL,
    Plan,
    live_nodes,
    run_fault,
    wait_for,
)
from kvmesh.services.launcher import Etcd, LocalCluster


def _run(*cmd: str, check: bool = True) -> subprocess.CompletedProcess:
    return subprocess.run(cmd, capture_output=True, text=True, check=check, timeout=20)


def why_not() -> str | None:
    if os.geteuid() != 0:
        return "network namespaces need root"
    if shutil.which("ip") is None:
        return "iproute2 tool 'ip' not found"
    if shutil.which("etcd") is None:
        return "etcd is not on PATH"
    probe = f"kvmfprobe{os.getpid()}"
    r = _run("ip", "netns", "add", probe, check=False)
    if r.returncode != 0:
        return f"cannot create a network namespace: {r.stderr.strip()}"
    _run("ip", "netns", "del", probe, check=False)
    return None


class Netns:
    """A namespace ``ns`` with ``veth_ns`` (``ip_ns``) paired to ``veth_host`` (``ip_host``)."""

    def __init__(self) -> None:
        pid = os.getpid()
        self.ns = f"kvmf{pid}"
        self.veth_host, self.veth_ns = f"kvfh{pid}"[:15], f"kvfn{pid}"[:15]
        net = f"10.214.{pid % 250}"
        self.ip_host, self.ip_ns = f"{net}.1", f"{net}.2"

    def up(self) -> None:
        _run("ip", "netns", "add", self.ns)
        _run("ip", "link", "add", self.veth_host, "type", "veth", "peer", "name", self.veth_ns)
        _run("ip", "link", "set", self.veth_ns, "netns", self.ns)
        _run("ip", "addr", "add", f"{self.ip_host}/30", "dev", self.veth_host)
        _run("ip", "link", "set", self.veth_host, "up")
        _run("ip", "-n", self.ns, "addr", "add", f"{self.ip_ns}/30", "dev", self.veth_ns)
        _run("ip", "-n", self.ns, "link", "set", self.veth_ns, "up")
        _run("ip", "-n", self.ns, "link", "set", "lo", "up")

    def cut(self) -> None:
        _run("ip", "-n", self.ns, "link", "set", self.veth_ns, "down")

    def heal(self) -> None:
        _run("ip", "-n", self.ns, "link", "set", self.veth_ns, "up")

    def down(self) -> None:
        _run("ip", "netns", "del", self.ns, check=False)
        _run("ip", "link", "del", self.veth_host, check=False)


def net_cut(workdir: str, prompts, expect, plan: Plan, cut_s: float = 0.0) -> dict:
    why = why_not()
    if why is not None:
        return {"fault": "net-cut", "skipped": why}
    os.makedirs(workdir, exist_ok=True)
    net = Netns()
    etcd = cluster = None
    try:
        net.up()
        # etcd on the host side of the veth, reachable from the namespace until the cut
        etcd = Etcd(
            os.path.join(workdir, "etcd"),
            log_path=os.path.join(workdir, "etcd.log"),
            host=net.ip_host,
        )
        etcd.start()
        host = ["--host", net.ip_host]
        cluster = LocalCluster(
            workdir,
            prefill=1,
            decode=2,
            lease_ttl=TTL,
            etcd_endpoint=etcd.endpoint,
            node_args=NODE_ARGS + host,
            store_args=host,
            conductor_args=DISAGG_ONLY,
            log_level="WARNING",
        )
        cluster.start(120)
        name = "prefill-ns"
        log = open(os.path.join(workdir, f"{name}.log"), "ab")
        cluster.procs[name] = subprocess.Popen(
            [
                "ip",
                "netns",
                "exec",
                net.ns,
                sys.executable,
                "-m",
                "kvmesh.services.cli",
                "prefill",
                *cluster.common_args(name),
                *NODE_ARGS,
                "--host",
                net.ip_ns,
            ],
            stdout=log,
            stderr=subprocess.STDOUT,
            start_new_session=True,
            env=cluster.env(),  # the cluster's data-plane secret
        )
        cluster.n_prefill = 2
        cluster.wait_ready(120)
        cut_s = cut_s or TTL + 12.0  # long enough that a stuck request would show

        async def act(ld, res):
            await asyncio.sleep(plan.before_s)
            res["t_fault"] = ld.now()
            await asyncio.to_thread(net.cut)
            gone = await asyncio.to_thread(
                wait_for, lambda: name not in live_nodes(cluster.conductor), TTL + 10
            )
            res["left_view_s"] = round(gone, 2) if gone is not None else None
            await asyncio.sleep(max(0.0, cut_s - (ld.now() - res["t_fault"])))
            t_heal = time.monotonic()
            res["t_heal"] = ld.now()
            await asyncio.to_thread(net.heal)
            res["cut_s"] = round(ld.now() - res["t_fault"], 2)
            back = await asyncio.to_thread(
                wait_for, lambda: name in live_nodes(cluster.conductor, reachable_only=True), 30
            )
            res["rejoined_after_heal_s"] = (
                round(time.monotonic() - t_heal, 2) if back is not None else None
            )
            res["cluster_whole_s"] = (
                round(ld.now() - res["t_fault"], 2) if back is not None else None
            )
            res["whole_means"] = (
                "cut node left the view within the TTL, then rejoined after "
                "the heal (cluster_whole_s counts from the cut)"
            )
            await asyncio.sleep(plan.after_s)

        row = run_fault(cluster, "net-cut", prompts, expect, plan, act)
        # recovery from the cut is bounded by the TTL (the node must leave the view);
        # after the heal it must rejoin within the TTL + 5 s
        row["recovered_in_ttl_plus_5"] = (
            max(row["last_failure_s"], row["max_gap_s"]) <= TTL + 5
            and (row.get("left_view_s") or 1e9) <= TTL + 5
            and (row.get("rejoined_after_heal_s") or 1e9) <= TTL + 5
        )
        return row
    finally:
        if cluster is not None:
            cluster.stop()
        if etcd is not None:
            etcd.stop()
        net.down()
