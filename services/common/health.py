"""Standard gRPC health checking (grpc.health.v1) and server reflection for every service,
plus the client side of ``kvmesh health HOST:PORT``.

Readiness: every service name (``""`` = the whole server, and the role's kvmesh service,
e.g. ``kvmesh.v1.PrefillNode``) is NOT_SERVING until the node is registered in etcd and
its model is loaded (``Service.start`` sets SERVING last), and NOT_SERVING again as soon
as shutdown begins (before deregistering), so load balancers and compose stop routing
to it first.
"""

from __future__ import annotations

import asyncio

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc
from grpc_health.v1.health import aio as health_aio
from grpc_reflection.v1alpha import reflection

from kvmesh.protos import kvmesh_pb2 as pb
from kvmesh.services.common.channels import make_channel

ROLE_SERVICES = {
    "conductor": "Conductor",
    "store-master": "StoreMaster",
    "prefill": "PrefillNode",
    "decode": "DecodeNode",
}


def service_names(role: str) -> list[str]:
    """Fully qualified gRPC service names a ``role`` serves."""
    short = ROLE_SERVICES.get(role)
    if short and short in pb.DESCRIPTOR.services_by_name:
        return [pb.DESCRIPTOR.services_by_name[short].full_name]
    return []


class Health:
    """The health servicer of one service, with its readiness switch."""

    def __init__(self, server: grpc.aio.Server, role: str) -> None:
        self.servicer = health_aio.HealthServicer()
        self.names = ["", *service_names(role)]
        health_pb2_grpc.add_HealthServicer_to_server(self.servicer, server)
        reflection.enable_server_reflection(
            [
                *service_names(role),
                health_pb2.DESCRIPTOR.services_by_name["Health"].full_name,
                reflection.SERVICE_NAME,
            ],
            server,
        )
        self.serving = False

    async def set_serving(self, serving: bool) -> None:
        status = (
            health_pb2.HealthCheckResponse.SERVING
            if serving
            else health_pb2.HealthCheckResponse.NOT_SERVING
        )
        self.serving = serving
        for name in self.names:
            await self.servicer.set(name, status)

    async def shutdown(self) -> None:
        self.serving = False
        await self.servicer.enter_graceful_shutdown()


async def check(address: str, service: str = "", timeout: float = 3.0) -> str:
    """The health status name of ``service`` at ``address`` (SERVING, NOT_SERVING, ...);
    raises grpc.aio.AioRpcError when unreachable."""
    async with make_channel(address) as ch:
        resp = await health_pb2_grpc.HealthStub(ch).Check(
            health_pb2.HealthCheckRequest(service=service), timeout=timeout
        )
    return health_pb2.HealthCheckResponse.ServingStatus.Name(resp.status)


async def wait_serving(
    address: str, service: str = "", timeout: float = 0.0, interval: float = 0.5
) -> tuple[bool, str]:
    """Checks once (``timeout`` 0) or until SERVING or ``timeout`` seconds pass; returns
    (serving, last status or error)."""
    loop = asyncio.get_running_loop()
    deadline = loop.time() + timeout
    while True:
        try:
            last = await check(address, service, timeout=max(1.0, min(3.0, timeout or 3.0)))
        except grpc.aio.AioRpcError as e:
            last = f"{e.code().name}: {e.details()}"
        if last == "SERVING":
            return True, last
        if loop.time() >= deadline:
            return False, last
        await asyncio.sleep(interval)
