"""What every row of the fault suite (:mod:`kvmesh.loadtest.faults`) builds on: prompts
whose exact outputs are known beforehand, a local cluster to break (:func:`new_cluster`),
and what to read off it (process RSS, log lines, which node holds the most store blocks)."""

from __future__ import annotations

import asyncio
import os
import random
from pathlib import Path

import grpc

from kvmesh.loadtest.fault_harness import DISAGG_ONLY, EOS, NODE_ARGS, TTL
from kvmesh.protos import kvmesh_pb2 as pb
from kvmesh.protos import kvmesh_pb2_grpc as pbg


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
        stream = pbg.StoreMasterStub(ch).WatchBlocks(
            pb.WatchBlocksRequest(snapshot=True, coalesce=True)
        )
        try:
            async with asyncio.timeout(seconds):
                async for msg in stream:
                    for ev in (msg, *msg.more):  # coalesced events
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
