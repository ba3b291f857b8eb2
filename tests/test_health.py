"""Standard gRPC health checking and server reflection on every service; readiness flips to
NOT_SERVING as soon as a node starts shutting down; ``kvmesh health`` as a healthcheck."""

from __future__ import annotations

import asyncio
import signal
import subprocess
import sys
import time

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection_pb2, reflection_pb2_grpc

from kvmesh.services.common.health import check
from kvmesh.services.launcher import LocalCluster
from tests.cluster_util import NODE_ARGS, status

pytestmark = pytest.mark.timeout(120)

WANT = {
    "conductor": "kvmesh.v1.Conductor",
    "prefill": "kvmesh.v1.PrefillNode",
    "decode": "kvmesh.v1.DecodeNode",
    "store-master": "kvmesh.v1.StoreMaster",
}


def _reflected_services(address: str) -> set[str]:
    with grpc.insecure_channel(address) as ch:
        stub = reflection_pb2_grpc.ServerReflectionStub(ch)
        resp = next(
            iter(
                stub.ServerReflectionInfo(
                    iter([reflection_pb2.ServerReflectionRequest(list_services="")]), timeout=5
                )
            )
        )
    return {s.name for s in resp.list_services_response.service}


def test_health_reflection_and_shutdown(tmp_path):
    # A long grace period keeps a stopping node in its NOT_SERVING window long enough to see.
    with LocalCluster(
        str(tmp_path), node_args=[*NODE_ARGS, "--grace-s", "3"], http_port=-1
    ) as cluster:
        nodes = {n.role: n for n in status(cluster.conductor).nodes}
        assert set(nodes) == set(WANT)
        for role, n in nodes.items():
            assert asyncio.run(check(n.grpc_address)) == "SERVING", role
            assert asyncio.run(check(n.grpc_address, WANT[role])) == "SERVING", role
            services = _reflected_services(n.grpc_address)
            assert {
                WANT[role],
                "grpc.health.v1.Health",
                "grpc.reflection.v1alpha.ServerReflection",
            } <= services, (role, services)

        # The CLI healthcheck: 0 when SERVING, 1 otherwise.
        ok = subprocess.run(
            [
                sys.executable,
                "-m",
                "kvmesh.services.cli",
                "health",
                nodes["conductor"].grpc_address,
            ],
            capture_output=True,
            text=True,
            timeout=30,
        )
        assert ok.returncode == 0 and "SERVING" in ok.stdout, ok.stderr
        unknown = asyncio.run(_check_code(nodes["conductor"].grpc_address, "no.such.Service"))
        assert unknown == grpc.StatusCode.NOT_FOUND

        # Shutdown: NOT_SERVING before the port closes.
        addr = nodes["decode"].grpc_address
        cluster.procs["decode-0"].send_signal(signal.SIGTERM)
        cluster._stopped.add("decode-0")
        seen = set()
        deadline = time.monotonic() + 20
        while time.monotonic() < deadline:
            try:
                seen.add(asyncio.run(check(addr, timeout=1)))
            except grpc.RpcError:
                seen.add("gone")
                break
            if "NOT_SERVING" in seen:
                break
            time.sleep(0.05)
        assert "NOT_SERVING" in seen, seen
        bad = subprocess.run(
            [sys.executable, "-m", "kvmesh.services.cli", "health", addr],
            capture_output=True,
            text=True,
            timeout=30,
        )
        assert bad.returncode == 1
        cluster.procs["decode-0"].wait(30)


async def _check_code(address: str, service: str):
    async with grpc.aio.insecure_channel(address) as ch:
        try:
            await health_pb2_grpc.HealthStub(ch).Check(
                health_pb2.HealthCheckRequest(service=service), timeout=3
            )
        except grpc.aio.AioRpcError as e:
            return e.code()
    return grpc.StatusCode.OK
