"""The fault rows that share one cluster (:data:`PLAIN`): SIGKILL of a prefill node, of a
decode node, of the node holding the most store blocks (each respawned after its row);
conductor, store-master and etcd restarts; slow clients on a decode node's data port
(:mod:`kvmesh.loadtest.faults_slowloris`)."""

from __future__ import annotations

import asyncio
import signal
import time

import grpc

from kvmesh.loadtest.fault_harness import TTL, Load, Plan, live_nodes, run_fault, wait_for
from kvmesh.loadtest.faults_cluster import master_address, respawn, store_holders
from kvmesh.loadtest.faults_slowloris import slowloris_data_port
from kvmesh.protos import kvmesh_pb2 as pb
from kvmesh.protos import kvmesh_pb2_grpc as pbg


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
    "slowloris-data-port": slowloris_data_port,
}
