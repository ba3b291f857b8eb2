"""The fault rows on a real ``kvmesh up`` process (:class:`Up`, :data:`LAUNCHER`): SIGKILL of
the launcher itself (``launcher-killed``) and of its decode node
(``node-killed-in-local-cluster``)."""

from __future__ import annotations

import asyncio
import os
import re
import signal
import socket
import statistics
import subprocess
import sys
import time
from pathlib import Path

import grpc

from kvmesh.loadtest.fault_harness import Load, Plan, run_fault, wait_for
from kvmesh.protos import kvmesh_pb2 as pb
from kvmesh.protos import kvmesh_pb2_grpc as pbg
from kvmesh.services.launcher import listening_ports

UP_LEASE_TTL = 10  # kvmesh up's services use the default lease TTL
LAUNCHER_GOAL_S = 5.0


class Up:
    """``kvmesh up`` (1 prefill + 1 decode node, tiny model, block size 16) as a real
    process; its children are found through /proc."""

    def __init__(self, workdir: str, timeout: float = 180) -> None:
        Path(workdir).mkdir(parents=True, exist_ok=True)
        self.workdir, self.log = workdir, os.path.join(workdir, "up.log")
        cmd = [sys.executable, "-m", "kvmesh.services.cli", "up", "--port", "0"]
        cmd += ["--http-port", "-1", "--block-size", "16", "--workdir", workdir]
        with open(self.log, "wb") as out:
            self.proc = subprocess.Popen(cmd, stdout=out, stderr=subprocess.STDOUT)
        deadline = time.monotonic() + timeout
        text = ""
        while "Ctrl-C stops the cluster" not in text:
            if self.proc.poll() is not None or time.monotonic() > deadline:
                self.stop()
                raise RuntimeError(f"kvmesh up did not start:\n{text[-2000:]}")
            time.sleep(0.2)
            text = Path(self.log).read_text(errors="replace")
        m = re.search(r"conductor at (127\.0\.0\.1:\d+)", text)
        assert m, text
        self.conductor = m.group(1)
        self.port = int(self.conductor.rsplit(":", 1)[1])

    def children(self) -> dict[str, int]:
        """name (``etcd`` or the service's node id) -> pid of each live child."""
        out = subprocess.run(
            ["ps", "-o", "pid=", "--ppid", str(self.proc.pid)], capture_output=True, text=True
        )
        named = {}
        for pid in map(int, out.stdout.split()):
            try:
                argv = Path(f"/proc/{pid}/cmdline").read_bytes().decode().split("\0")
            except OSError:
                continue
            name = argv[argv.index("--node-id") + 1] if "--node-id" in argv else "etcd"
            named[name] = pid
        return named

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(60)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()


def alive(pid: int) -> bool:
    """Running (a zombie left for a reaper that is not ours counts as gone)."""
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] != "Z"
    except OSError:
        return False


def port_free(port: int) -> bool:
    """Nothing listens on ``port`` any more, and a new listener can bind it as a new
    conductor would (SO_REUSEADDR, no SO_REUSEPORT)."""
    with socket.socket() as c:
        c.settimeout(1)
        if c.connect_ex(("127.0.0.1", port)) == 0:
            return False
    with socket.socket(socket.AF_INET6) as s:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            s.bind(("::", port))  # the wildcard (dual-stack): taken by any listener
            return True
        except OSError:
            return False


def launcher_killed(workdir: str, prompts, expect, plan: Plan, repeat: int = 3) -> dict:
    """SIGKILL of ``kvmesh up`` (``repeat`` times, a fresh cluster each): the seconds
    until every child has exited and until the conductor's port can be bound again."""
    runs: list[dict] = []
    for i in range(repeat):
        up = Up(os.path.join(workdir, f"run{i}"))
        kids = up.children()
        try:
            t = time.monotonic()
            up.proc.kill()
            up.proc.wait()
            gone = wait_for(lambda: not any(map(alive, kids.values())), 30, 0.02)
            free = wait_for(lambda: port_free(up.port), 30, 0.02)
            left = [n for n, pid in kids.items() if alive(pid)]
            runs.append(
                {
                    "children": len(kids),
                    "all_gone_s": round(gone, 2) if gone is not None else None,
                    "port_free_s": round(free, 2) if free is not None else None,
                    "orphans": left,
                    "took_s": round(time.monotonic() - t, 2),
                }
            )
        finally:
            for pid in kids.values():  # only should one have survived
                if alive(pid):
                    os.kill(pid, signal.SIGKILL)

    def worst(key: str) -> float | None:
        vals = [r[key] for r in runs]
        return None if None in vals else max(vals)

    def median(key: str) -> float | None:
        vals = [r[key] for r in runs]
        return None if None in vals else statistics.median(vals)

    gone_s, free_s = worst("all_gone_s"), worst("port_free_s")
    met = (
        all(not r["orphans"] and r["children"] == 5 for r in runs)
        and gone_s is not None
        and free_s is not None
        and max(gone_s, free_s) <= LAUNCHER_GOAL_S
    )
    return {
        "fault": "launcher-killed",
        "requests": 0,
        "cluster_whole_s": gone_s,
        "recovered_in_ttl_plus_5": met,
        "goal": f"no child of kvmesh up survives and its conductor port is free within "
        f"{LAUNCHER_GOAL_S:g} s of its SIGKILL (worst of {repeat} runs)",
        "all_gone_s_median": median("all_gone_s"),
        "port_free_s_median": median("port_free_s"),
        "all_gone_s_max": gone_s,
        "port_free_s_max": free_s,
        "runs": runs,
        "whole_means": "every child of kvmesh up exited (worst run)",
        "wrong": 0,
        "hung": 0,
        "failed_other": 0,
    }


def node_killed_in_local_cluster(workdir: str, prompts, expect, plan: Plan) -> dict:
    """SIGKILL of the decode node of a ``kvmesh up`` cluster (its only one) under load:
    the launcher restarts it and the clients' retries succeed again. The load goes on
    for at least the lease TTL + 8 s after the kill (past the goal, so that requests
    after the recovery are seen)."""
    plan = Plan(**{**plan.__dict__, "after_s": max(plan.after_s, UP_LEASE_TTL + 8.0)})
    up = Up(workdir)
    try:

        async def act(ld: Load, res: dict) -> None:
            await asyncio.sleep(plan.before_s)
            victim = up.children()["decode-0"]
            res["t_fault"] = ld.now()
            os.kill(victim, signal.SIGKILL)

            def back() -> bool:  # a new decode-0, registered with its own address
                pid = up.children().get("decode-0")
                if pid in (None, victim):
                    return False
                try:
                    with grpc.insecure_channel(up.conductor) as ch:
                        s = pbg.ConductorStub(ch).ClusterStatus(
                            pb.ClusterStatusRequest(), timeout=2
                        )
                except grpc.RpcError:
                    return False
                addr = next((n.grpc_address for n in s.nodes if n.node_id == "decode-0"), ":0")
                return int(addr.rsplit(":", 1)[1]) in (listening_ports(pid) or ())

            whole = await asyncio.to_thread(wait_for, back, 60, 0.1)
            res["cluster_whole_s"] = round(whole, 2) if whole is not None else None
            res["victim"] = "decode-0"
            res["whole_means"] = "a new decode-0 process registered its address in etcd"
            res["restart_logged"] = "decode-0 exited with -9; restarting" in Path(up.log).read_text(
                errors="replace"
            )
            await asyncio.sleep(max(0.0, plan.after_s - (ld.now() - res["t_fault"])))

        row = run_fault(up, "node-killed-in-local-cluster", prompts, expect, plan, act)
    finally:
        up.stop()
    # kvmesh up runs its services with the default lease TTL, not the suite's
    row["ttl_s"] = UP_LEASE_TTL
    whole = row.get("cluster_whole_s")
    row["recovered_in_ttl_plus_5"] = (
        max(row["last_failure_s"], row["max_gap_s"]) <= UP_LEASE_TTL + 5
        and whole is not None
        and whole <= UP_LEASE_TTL + 5
        and row["failed_retriable"] == 0
    )
    row["launcher_exit_code"] = up.proc.returncode
    return row


LAUNCHER = {
    "launcher-killed": launcher_killed,
    "node-killed-in-local-cluster": node_killed_in_local_cluster,
}
