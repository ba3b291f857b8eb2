"""A store-master's gRPC server listens before it joins the leader election (Service.start:
server.start() then register()). In that window it does not know whether it leads: a
standby-to-be would serve store calls from its own empty metadata. A real server on a real
port, held in that window, refuses store calls with UNAVAILABLE saying why; health still
answers."""

from __future__ import annotations

import asyncio

import grpc
import pytest

from kvmesh.protos import kvmesh_pb2 as pb
from kvmesh.protos import kvmesh_pb2_grpc as pbg
from kvmesh.services.common.config import load
from kvmesh.services.store_master.server import StoreMaster, StoreMasterConfig

pytestmark = pytest.mark.timeout(60)


class HeldBeforeElection(StoreMaster):
    """register() (the campaign) waits until released: the server listens meanwhile."""

    def __init__(self, cfg: StoreMasterConfig) -> None:
        super().__init__(cfg)
        self.listening = asyncio.Event()
        self.release = asyncio.Event()

    async def register(self) -> None:
        self.listening.set()
        await self.release.wait()


def test_store_calls_are_refused_until_the_master_has_joined_the_election():
    async def main() -> None:
        # etcd is never reached: the campaign is held back
        cfg = load(
            StoreMasterConfig,
            ["--host", "127.0.0.1", "--port", "0", "--metrics-port", "-1", "--etcd", "127.0.0.1:9"],
        )
        m = HeldBeforeElection(cfg)
        start = asyncio.create_task(m.start())
        try:
            async with asyncio.timeout(30):
                await m.listening.wait()
            async with grpc.aio.insecure_channel(m.grpc_address) as ch:
                with pytest.raises(grpc.aio.AioRpcError) as e:
                    await pbg.StoreMasterStub(ch).StoreHello(pb.StoreHelloRequest(), timeout=10)
                assert e.value.code() == grpc.StatusCode.UNAVAILABLE
                assert "has not joined the leader election" in e.value.details()
        finally:
            m.release.set()
            start.cancel()
            await asyncio.gather(start, return_exceptions=True)
            await m.server.stop(None)

    asyncio.run(main())
