"""Fault rows that start a cluster of their own: ``store-master-failover`` (the leading
store-master SIGKILLed, a standby takes over) and ``byte-flip`` (KV bytes flipped on the
data plane, nodes run ``--checksum``)."""

from __future__ import annotations

import asyncio
import signal
import time

import grpc

from kvmesh.loadtest.fault_harness import NODE_ARGS, TTL, Load, Plan, run_fault, wait_for
from kvmesh.loadtest.faults_cluster import count_in_logs, new_cluster
from kvmesh.protos import kvmesh_pb2 as pb
from kvmesh.protos import kvmesh_pb2_grpc as pbg

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
