"""Fault suite and overload run on a real local cluster (issue 9).

    python -m kvmesh.loadtest.faults              # every fault, ~6-8 min on 2 cores
    python -m kvmesh.loadtest.faults --quick      # shorter phases
    python -m kvmesh.loadtest.faults --only kill-decode,conductor-restart
    python -m kvmesh.loadtest.faults --overload   # 3x capacity for a minute (capacity measured first)

Each fault runs under a steady, bounded load: ``--concurrency`` closed-loop clients send
greedy requests whose exact outputs are known beforehand (``LlamaModel.reference_generate``
of the ``tiny`` preset, computed here from scratch). A client retries a request on
UNAVAILABLE, DEADLINE_EXCEEDED and RESOURCE_EXHAUSTED (after its ``retry-after-ms``) until
the request's deadline. For each fault we check:

- zero wrong tokens: every finished output equals the reference, and every partial output
  of a failed attempt is a prefix of it;
- every request ends with its full output or a retriable status within its deadline, and
  none hangs (each attempt has a gRPC deadline; a request still open ``HANG_SLACK_S`` after
  its deadline counts as hung);
- recovery: the time from the fault until the last failed attempt ended (after which every
  attempt succeeded), and the time until the cluster is whole again (the victim left the
  conductor's view, or the restarted service is back), both against the lease TTL + 5 s.

Faults: SIGKILL of a prefill node, of a decode node, of the node holding the most store
blocks; conductor, store-master and etcd restarts; a network cut and heal between a prefill
node in its own network namespace (joined by a veth pair) and the rest of the cluster; KV
bytes flipped on the data plane (``KVMESH_FAULT_CORRUPT_EVERY``, nodes run ``--checksum``).
Two rows run a real ``kvmesh up`` process instead: SIGKILL of the launcher itself
(``launcher-killed``: no child may survive it and the conductor's port must be free within
5 s) and SIGKILL of its decode node (``node-killed-in-local-cluster``: the launcher restarts
it, and a retried request succeeds within the lease TTL + 5 s). Two more start clusters
of their own: ``store-master-failover`` (the leading store-master SIGKILLed, a standby
takes over) and ``conductor-killed`` (:mod:`kvmesh.loadtest.faults_conductor`: one of two
conductors SIGKILLed; accepted requests judged against 4x the solo TTFT and TPOT measured
on the same cluster first).

Results: ``loadtest/results/faults.md`` and ``faults.json`` (``overload.md/json``).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import re
import shutil
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import grpc

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from kvmesh.loadtest.fault_harness import (  # noqa: E402
    DISAGG_ONLY,
    EOS,
    NODE_ARGS,
    TTL,
    Load,
    Plan,
    Req,
    live_nodes,
    run_fault,
    run_request,
    wait_for,
)
from kvmesh.loadtest.faults_conductor import conductor_killed  # noqa: E402
from kvmesh.loadtest.faults_netns import net_cut  # noqa: E402
from kvmesh.protos import kvmesh_pb2 as pb  # noqa: E402
from kvmesh.protos import kvmesh_pb2_grpc as pbg  # noqa: E402
from kvmesh.services.launcher import listening_ports  # noqa: E402

RESULTS = Path(__file__).resolve().parent / "results"


# -- requests with known outputs ------------------------------------------------------------
def make_prompts(n: int = 24, seed: int = 7) -> list[list[int]]:
    """``n`` prompts of byte tokens: 3 shared 32-token "system prompts" (two full blocks of
    16, so the prefix cache and the store are used) + a distinct 12..44-token suffix."""
    rng = random.Random(seed)
    systems = [[rng.randrange(32, 127) for _ in range(32)] for _ in range(3)]
    return [
        systems[i % 3] + [rng.randrange(32, 127) for _ in range(rng.randrange(12, 45))]
        for i in range(n)
    ]


def expected_outputs(prompts: list[list[int]], max_tokens: int) -> list[list[int]]:
    import torch

    from kvmesh.services.engine.model import LlamaModel

    torch.set_num_threads(1)  # the cluster shares these cores
    model = LlamaModel.from_preset("tiny", seed=0)
    return [model.reference_generate(p, max_tokens, eos_id=EOS) for p in prompts]


# -- cluster helpers --------------------------------------------------------------------------
def rss_mib(pid: int) -> float:
    try:
        with open(f"/proc/{pid}/status") as f:
            for line in f:
                if line.startswith("VmRSS:"):
                    return int(line.split()[1]) / 1024
    except OSError:
        pass
    return 0.0


def proc_pids(cluster) -> dict[str, int]:
    out = {n: p.pid for n, p in cluster.procs.items() if p.poll() is None}
    if cluster.etcd and cluster.etcd.proc and cluster.etcd.proc.poll() is None:
        out["etcd"] = cluster.etcd.proc.pid
    return out


def count_in_logs(workdir: str, needle: str) -> int:
    n = 0
    for p in Path(workdir).glob("*.log"):
        try:
            n += p.read_text(errors="replace").count(needle)
        except OSError:
            pass
    return n


async def store_holders(master_addr: str, seconds: float = 1.0) -> dict[str, int]:
    """Replicas per node: the store-master's snapshot (+ events for ``seconds``)."""
    held: dict[str, int] = {}
    async with grpc.aio.insecure_channel(master_addr) as ch:
        stream = pbg.StoreMasterStub(ch).WatchBlocks(pb.WatchBlocksRequest(snapshot=True))
        try:
            async with asyncio.timeout(seconds):
                async for ev in stream:
                    d = 1 if ev.type == "stored" else -1 if ev.type == "removed" else 0
                    held[ev.node_id] = held.get(ev.node_id, 0) + d
        except (TimeoutError, grpc.aio.AioRpcError):
            pass
        stream.cancel()
    return held


def master_address(cluster) -> str:
    with grpc.insecure_channel(cluster.conductor) as ch:
        s = pbg.ConductorStub(ch).ClusterStatus(pb.ClusterStatusRequest(), timeout=2)
    return next(n.grpc_address for n in s.nodes if n.role == "store-master")


# -- the faults -------------------------------------------------------------------------------
async def fault_kill(cluster, load: Load, plan: Plan, victim: str, res: dict) -> None:
    await asyncio.sleep(plan.before_s)
    res["t_fault"] = load.now()
    await asyncio.to_thread(cluster.stop_process, victim, signal.SIGKILL)
    left = await asyncio.to_thread(
        wait_for, lambda: victim not in live_nodes(cluster.conductor), TTL + 10
    )
    res["victim"] = victim
    res["cluster_whole_s"] = round(left, 2) if left is not None else None
    res["whole_means"] = f"{victim} left the conductor's view"
    await asyncio.sleep(max(0.0, plan.after_s - (load.now() - res["t_fault"])))


async def fault_kill_store(cluster, load: Load, plan: Plan, res: dict) -> None:
    await asyncio.sleep(plan.before_s)
    held = await store_holders(await asyncio.to_thread(master_address, cluster), 1.0)
    nodes = {k: v for k, v in held.items() if k.startswith(("prefill", "decode"))}
    victim = max(nodes, key=nodes.get) if nodes else "decode-1"
    res["store_blocks_on_victim"] = nodes.get(victim, 0)
    await fault_kill(cluster, load, Plan(0.0, plan.after_s), victim, res)


async def fault_restart(
    cluster, load: Load, plan: Plan, name: str, res: dict, sig: int = signal.SIGKILL
) -> None:
    await asyncio.sleep(plan.before_s)
    before = await asyncio.to_thread(live_nodes, cluster.conductor, True)
    res["t_fault"] = load.now()
    t = time.monotonic()
    if name == "etcd":
        await asyncio.to_thread(cluster.etcd.stop)
        await asyncio.sleep(TTL + 1)  # every lease expires meanwhile
        await asyncio.to_thread(cluster.etcd.start)
    else:
        await asyncio.to_thread(cluster.restart_process, name, sig)
    res["down_s"] = round(time.monotonic() - t, 2)

    def whole() -> bool:  # every service live before the fault is back and reachable,
        # and the store answers (a dead store-master stays in the view until its lease ends)
        try:
            with grpc.insecure_channel(cluster.conductor) as ch:
                s = pbg.ConductorStub(ch).ClusterStatus(pb.ClusterStatusRequest(), timeout=2)
        except grpc.RpcError:
            return False
        return {n.node_id for n in s.nodes if n.reachable} >= before and s.store_bytes_total > 0

    back = await asyncio.to_thread(wait_for, whole, 40, 0.2)
    res["cluster_whole_s"] = round(time.monotonic() - t, 2) if back is not None else None
    res["whole_means"] = "every service registered and reachable again"
    await asyncio.sleep(max(0.0, plan.after_s - (load.now() - res["t_fault"])))


async def respawn(cluster, name: str) -> None:
    cluster.respawn(name)
    await asyncio.to_thread(cluster.wait_ready, 60)


def new_cluster(workdir: str, node_args=None, env: dict | None = None, **kw):
    from kvmesh.services.launcher import LocalCluster

    old = dict(os.environ)
    os.environ.update(env or {})
    try:
        c = LocalCluster(
            workdir,
            prefill=kw.pop("prefill", 2),
            decode=kw.pop("decode", 2),
            lease_ttl=TTL,
            node_args=node_args or NODE_ARGS,
            conductor_args=kw.pop("conductor_args", DISAGG_ONLY),
            log_level="WARNING",
            **kw,
        )
        c.start(120)
    finally:
        os.environ.clear()
        os.environ.update(old)
    return c


def main_faults(faults: list[str], plan: Plan, workdir: str) -> list[dict]:
    prompts = make_prompts()
    expect = expected_outputs(prompts, plan.max_tokens)
    rows: list[dict] = []
    plain = [f for f in faults if f in PLAIN]
    if plain:
        cluster = new_cluster(os.path.join(workdir, "plain"))
        try:
            for f in plain:
                print(f"-- {f}", flush=True)
                row = PLAIN[f](cluster, prompts, expect, plan)
                rows.append(row)
                print(fmt_row(row), flush=True)
        finally:
            cluster.stop()
    for f in [f for f in faults if f in LAUNCHER]:
        print(f"-- {f}", flush=True)
        rows.append(LAUNCHER[f](os.path.join(workdir, f), prompts, expect, plan))
        print(fmt_row(rows[-1]), flush=True)
    if "byte-flip" in faults:
        print("-- byte-flip", flush=True)
        rows.append(byte_flip(os.path.join(workdir, "flip"), prompts, expect, plan))
        print(fmt_row(rows[-1]), flush=True)
    if "net-cut" in faults:
        print("-- net-cut", flush=True)
        rows.append(net_cut(os.path.join(workdir, "netns"), prompts, expect, plan))
        print(fmt_row(rows[-1]), flush=True)
    if "store-master-failover" in faults:
        print("-- store-master-failover", flush=True)
        rows.append(store_master_failover(os.path.join(workdir, "failover"), prompts, expect, plan))
        print(fmt_row(rows[-1]), flush=True)
    if "conductor-killed" in faults:
        print("-- conductor-killed", flush=True)
        rows.append(conductor_killed(os.path.join(workdir, "conductors"), prompts, expect, plan))
        print(fmt_row(rows[-1]), flush=True)
    return rows


def _kill(victim: str):
    def go(cluster, prompts, expect, plan):
        row = run_fault(
            cluster,
            f"sigkill-{victim.split('-')[0]}",
            prompts,
            expect,
            plan,
            lambda ld, res: fault_kill(cluster, ld, plan, victim, res),
        )
        asyncio.run(respawn(cluster, victim))
        return row

    return go


def _kill_store(cluster, prompts, expect, plan):
    res_holder: dict = {}

    async def act(ld, res):
        await fault_kill_store(cluster, ld, plan, res)
        res_holder.update(res)

    row = run_fault(cluster, "sigkill-store-holder", prompts, expect, plan, act)
    asyncio.run(respawn(cluster, res_holder["victim"]))
    return row


def _restart(name: str, label: str):
    def go(cluster, prompts, expect, plan):
        return run_fault(
            cluster,
            label,
            prompts,
            expect,
            plan,
            lambda ld, res: fault_restart(cluster, ld, plan, name, res),
        )

    return go


PLAIN = {
    "kill-prefill": _kill("prefill-1"),
    "kill-decode": _kill("decode-1"),
    "kill-store-holder": _kill_store,
    "conductor-restart": _restart("conductor-0", "conductor-restart"),
    "store-master-restart": _restart("store-master-0", "store-master-restart"),
    "etcd-restart": _restart("etcd", "etcd-restart"),
}

# -- `kvmesh up` as a real process ------------------------------------------------------------
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
ALL = [*PLAIN, *LAUNCHER, "byte-flip", "net-cut", "store-master-failover", "conductor-killed"]
TAKEOVER_SLACK_S = 2.0  # issue 17's goal: a standby leads within the lease TTL + 2 s


async def store_leader(endpoint: str, cluster: str = "default") -> str:
    """The node id of the elected store-master ("" while none leads)."""
    from kvmesh.services.common.election import current_leader
    from kvmesh.services.common.etcd import EtcdClient

    async with EtcdClient(endpoint) as etcd:
        return ((await current_leader(etcd, cluster, "store-master")) or {}).get("id", "")


def store_master_failover(workdir: str, prompts, expect, plan: Plan) -> dict:
    """Two store-masters (one leads, one stands by); the leader is SIGKILLed under load.
    Takeover: from the kill until the standby holds the campaign key; the store is whole
    again once the conductor sees store capacity on the new leader (the nodes re-mounted
    and re-reported there)."""
    cluster = new_cluster(workdir, store_masters=2)
    try:

        async def act(ld: Load, res: dict) -> None:
            await asyncio.sleep(plan.before_s)
            old = await store_leader(cluster.etcd_endpoint, cluster.cluster)
            res["victim"] = old
            res["t_fault"] = ld.now()
            t = time.monotonic()
            await asyncio.to_thread(cluster.stop_process, old, signal.SIGKILL)

            async def led_by_other() -> bool:
                return (await store_leader(cluster.etcd_endpoint, cluster.cluster)) not in ("", old)

            took = None
            while time.monotonic() - t < TTL + 15:
                if await led_by_other():
                    took = time.monotonic() - t
                    break
                await asyncio.sleep(0.05)
            res["takeover_s"] = round(took, 2) if took is not None else None
            res["new_leader"] = await store_leader(cluster.etcd_endpoint, cluster.cluster)

            def whole() -> bool:
                try:
                    with grpc.insecure_channel(cluster.conductor) as ch:
                        s = pbg.ConductorStub(ch).ClusterStatus(
                            pb.ClusterStatusRequest(), timeout=2
                        )
                except grpc.RpcError:
                    return False
                masters = [n for n in s.nodes if n.role == "store-master" and n.reachable]
                return [n.node_id for n in masters] == [
                    res["new_leader"]
                ] and s.store_bytes_total > 0

            back = await asyncio.to_thread(wait_for, whole, 40, 0.2)
            res["cluster_whole_s"] = round(time.monotonic() - t, 2) if back is not None else None
            res["whole_means"] = "the standby leads and the nodes' segments are mounted on it"
            await asyncio.sleep(max(0.0, plan.after_s - (ld.now() - res["t_fault"])))

        row = run_fault(cluster, "store-master-failover", prompts, expect, plan, act)
        took = row.get("takeover_s")
        row["takeover_goal_s"] = TTL + TAKEOVER_SLACK_S
        row["takeover_in_ttl_plus_2"] = took is not None and took <= TTL + TAKEOVER_SLACK_S
        return row
    finally:
        cluster.stop()


def byte_flip(workdir: str, prompts, expect, plan: Plan, every: int = 30) -> dict:
    """Nodes with ``--checksum`` and ``KVMESH_FAULT_CORRUPT_EVERY``: one transfer in
    ``every`` has a byte flipped after its crc; a damaged handoff fails the prefill (the
    conductor retries it on the next node, else the client retries), a damaged store read
    is a miss (recompute), a damaged put is dropped."""
    cluster = new_cluster(
        workdir, NODE_ARGS + ["--checksum"], env={"KVMESH_FAULT_CORRUPT_EVERY": str(every)}
    )
    try:
        res: dict = {}

        async def act(ld, r):
            r["t_fault"] = 0.0
            await asyncio.sleep(plan.before_s + plan.after_s)

        row = run_fault(cluster, "byte-flip", prompts, expect, plan, act)
        row["corrupt_every"] = every
        row["checksum_failures_logged"] = count_in_logs(workdir, "checksum mismatch")
        row["cluster_whole_s"] = 0.0
        row["whole_means"] = "no service left; damaged transfers are retried/recomputed"
        row["recovered_in_ttl_plus_5"] = row["failed_retriable"] == 0
        row.update(res)
        return row
    finally:
        cluster.stop()


# -- overload -----------------------------------------------------------------------------------
def overload(workdir: str, seconds: float, factor: float, quick: bool) -> dict:
    """Capacity (closed loop, SLO-free) first, then ``factor`` x that rate open-loop for
    ``seconds`` with SLOs; RSS of every process sampled each second."""
    prompts = make_prompts(48)
    max_tokens = 16
    expect = expected_outputs(prompts, max_tokens)
    ttft_slo, tbt_slo = 2000.0, 400.0
    cluster = new_cluster(
        workdir,
        prefill=1,
        decode=1,
        conductor_args=[
            "--ttft-slo-ms",
            str(ttft_slo),
            "--tbt-slo-ms",
            str(tbt_slo),
            "--slo-margin",
            "0.7",
        ],
    )
    out: dict = {
        "ttft_slo_ms": ttft_slo,
        "tbt_slo_ms": tbt_slo,
        "slo_margin": 0.7,
        "factor": factor,
        "seconds": seconds,
        "max_tokens": max_tokens,
    }
    try:

        async def capacity():
            # closed loop at increasing concurrency; capacity = best rate whose p90 TTFT
            # stays within the SLO
            best = 0.0
            for conc in (1, 2, 4, 8, 16):
                load = Load(cluster.conductor, prompts, expect, max_tokens, conc, 60, 0.0)
                t = [0.0]

                async def body(ld, t=t):
                    await asyncio.sleep(5 if quick else 8)
                    t[0] = ld.now()

                await load.run(body)
                ok = [r for r in load.reqs if r.outcome == "ok"]
                rate = len(ok) / max(t[0], 1e-9)
                ttfts = sorted(r.ttft_s for r in ok if r.ttft_s is not None)
                p90 = ttfts[int(0.9 * (len(ttfts) - 1))] * 1000 if ttfts else 1e9
                out.setdefault("capacity_probe", []).append(
                    {
                        "concurrency": conc,
                        "rate_rps": round(rate, 2),
                        "p90_ttft_ms": round(p90, 1),
                        "wrong": sum(1 for r in load.reqs if r.outcome == "wrong"),
                    }
                )
                if p90 <= ttft_slo * 0.7:
                    best = max(best, rate)
                if rate < 1.05 * best and p90 > ttft_slo * 0.25:
                    break  # throughput has plateaued
            return best

        cap = asyncio.run(capacity())
        out["capacity_rps"] = round(cap, 2)
        rate = factor * cap
        out["offered_rps"] = round(rate, 2)
        samples: dict[str, list[float]] = {}
        died: list[str] = []

        async def offered():
            reqs: list[Req] = []
            async with grpc.aio.insecure_channel(cluster.conductor) as ch:
                stub = pbg.ConductorStub(ch)
                t0 = time.perf_counter()
                tasks = []

                async def sample_rss():
                    while True:
                        for n, pid in proc_pids(cluster).items():
                            samples.setdefault(n, []).append(rss_mib(pid))
                        await asyncio.sleep(1.0)

                sampler = asyncio.create_task(sample_rss())
                rng = random.Random(1)
                t_next, i = 0.0, 0

                async def one(idx, salt):
                    reqs.append(
                        await run_request(
                            stub,
                            idx,
                            prompts[idx],
                            expect[idx],
                            max_tokens,
                            t0,
                            30.0,
                            slo=(ttft_slo, tbt_slo),
                            retry=False,
                            salt=salt,
                        )
                    )

                while t_next < seconds:
                    delay = t_next - (time.perf_counter() - t0)
                    if delay > 0:
                        await asyncio.sleep(delay)
                    idx = i % len(prompts)
                    salt = f"o{i}" if i % 2 == 0 else ""  # half uncached, as in Load
                    tasks.append(asyncio.create_task(one(idx, salt)))
                    i += 1
                    t_next += rng.expovariate(rate)
                await asyncio.gather(*tasks)
                sampler.cancel()
            return reqs

        reqs = asyncio.run(offered())
        for n, p in cluster.procs.items():
            if p.poll() is not None:
                died.append(f"{n} ({p.returncode})")
        acc = [r for r in reqs if r.outcome in ("ok", "wrong")]
        rej = [r for r in reqs if r.last_code == "RESOURCE_EXHAUSTED"]
        other = [r for r in reqs if r not in acc and r not in rej]

        def meets(r: Req) -> bool:
            tbt = statistics.mean(r.tbt_s) if r.tbt_s else 0.0
            return r.ttft_s is not None and r.ttft_s * 1000 <= ttft_slo and tbt * 1000 <= tbt_slo

        rej_lat = sorted((r.attempts[0].t_end - r.attempts[0].t_start) * 1000 for r in rej)
        ttfts = sorted(r.ttft_s * 1000 for r in acc if r.ttft_s is not None)
        out.update(
            {
                "sent": len(reqs),
                "accepted": len(acc),
                "rejected": len(rej),
                "other_failures": len(other),
                "other_codes": sorted({r.last_code for r in other}),
                "wrong": sum(1 for r in acc if r.outcome == "wrong"),
                "slo_met_share": round(sum(map(meets, acc)) / max(1, len(acc)), 4),
                "goodput_rps": round(sum(map(meets, acc)) / seconds, 2),
                "accepted_p50_ttft_ms": round(ttfts[len(ttfts) // 2], 1) if ttfts else None,
                "accepted_p99_ttft_ms": round(ttfts[int(0.99 * (len(ttfts) - 1))], 1)
                if ttfts
                else None,
                "rejection_latency_ms_p50": round(rej_lat[len(rej_lat) // 2], 1)
                if rej_lat
                else None,
                "rejection_latency_ms_p99": round(rej_lat[int(0.99 * (len(rej_lat) - 1))], 1)
                if rej_lat
                else None,
                "rss_mib": {
                    n: {"first": round(v[0], 1), "max": round(max(v), 1), "last": round(v[-1], 1)}
                    for n, v in samples.items()
                    if v
                },
                "died": died,
            }
        )
        return out
    finally:
        cluster.stop()


# -- report ---------------------------------------------------------------------------------------
COLS = [
    "fault",
    "requests",
    "completed",
    "retried",
    "completed_after_retry",
    "failed_retriable",
    "failed_other",
    "wrong",
    "hung",
    "last_failure_s",
    "max_gap_s",
    "slowest_attempt_s",
    "cluster_whole_s",
    "recovered_in_ttl_plus_5",
]


def fmt_row(r: dict) -> str:
    return " | ".join(f"{c}={r.get(c)}" for c in COLS)


def write_report(rows: list[dict], plan: Plan, name: str = "faults") -> str:
    """Writes ``<name>.md/json``. A run of some faults (``--only``) replaces their rows
    in the last report and keeps the others."""
    RESULTS.mkdir(exist_ok=True)
    try:
        old = json.loads((RESULTS / f"{name}.json").read_text())
    except (OSError, ValueError):
        old = []
    new = {r["fault"]: r for r in rows}
    rows = [new.pop(r["fault"], r) for r in old if isinstance(r, dict) and "fault" in r]
    rows += list(new.values())
    lines = [
        f"# Fault suite (lease TTL {TTL} s; {plan.concurrency} closed-loop clients, "
        f"{plan.max_tokens} greedy tokens, request deadline {plan.deadline_s:.0f} s; "
        f"{plan.before_s:.0f} s of load before each fault, {plan.after_s:.0f} s after)",
        "",
        "| " + " | ".join(COLS) + " |",
        "|" + "---|" * len(COLS),
    ]
    for r in rows:
        lines.append("| " + " | ".join(str(r.get(c, "")) for c in COLS) + " |")
    lines += [
        "",
        "- last_failure_s: seconds from the fault to the end of the last failed "
        "attempt (every later attempt succeeded); max_gap_s: longest stretch after the "
        "fault with no request completing; slowest_attempt_s: the slowest attempt in "
        "flight at or after the fault; cluster_whole_s: seconds until the victim left "
        "the view (kills), every service was back (restarts), or the cut node rejoined "
        "(net-cut, counted from the cut).",
        "- failed attempt codes per fault: "
        + "; ".join(f"{r['fault']}: {r.get('failed_codes')}" for r in rows),
    ]
    for r in rows:
        extra = {k: v for k, v in r.items() if k not in COLS and k not in ("failed_codes",)}
        lines.append(f"- {r['fault']}: {json.dumps(extra)}")
    text = "\n".join(lines) + "\n"
    (RESULTS / f"{name}.md").write_text(text)
    (RESULTS / f"{name}.json").write_text(json.dumps(rows, indent=1))
    return text


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(
        prog="python -m kvmesh.loadtest.faults",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    ap.add_argument("--quick", action="store_true", help="shorter phases")
    ap.add_argument("--only", default="", help=f"comma-separated subset of {','.join(ALL)}")
    ap.add_argument("--overload", action="store_true", help="the overload run instead")
    ap.add_argument("--seconds", type=float, default=60.0, help="overload: offered-load phase")
    ap.add_argument("--factor", type=float, default=3.0, help="overload: x measured capacity")
    ap.add_argument("--workdir", default=None, help="logs (default: a temp dir, removed)")
    args = ap.parse_args(argv)
    workdir = args.workdir or tempfile.mkdtemp(prefix="kvmesh-faults-")
    try:
        if args.overload:
            res = overload(
                os.path.join(workdir, "overload"),
                args.seconds if not args.quick else min(args.seconds, 20),
                args.factor,
                args.quick,
            )
            RESULTS.mkdir(exist_ok=True)
            (RESULTS / "overload.json").write_text(json.dumps(res, indent=1))
            (RESULTS / "overload.md").write_text(
                "# Overload\n\n```json\n" + json.dumps(res, indent=1) + "\n```\n"
            )
            print(json.dumps(res, indent=1))
            ok = res["slo_met_share"] >= 0.99 and not res["died"] and res["wrong"] == 0
            return 0 if ok else 1
        plan = Plan(3.0, 9.0) if args.quick else Plan()
        faults = [f for f in (args.only.split(",") if args.only else ALL) if f]
        unknown = set(faults) - set(ALL)
        if unknown:
            ap.error(f"unknown fault(s) {sorted(unknown)}; known: {ALL}")
        rows = main_faults(faults, plan, workdir)
        print(write_report(rows, plan))
        bad = [
            r["fault"]
            for r in rows
            if r.get("skipped") is None and (r["wrong"] or r["hung"] or r["failed_other"])
        ]
        return 1 if bad else 0
    finally:
        if args.workdir is None:
            shutil.rmtree(workdir, ignore_errors=True)


if __name__ == "__main__":
    sys.exit(main())
