"""A store client in a fresh event loop, for tests that drive a real store cluster."""

from __future__ import annotations

import asyncio

from kvmesh.rdma import TransferEngine
from kvmesh.services.common.settings import DEV_SECRET
from kvmesh.services.store.client import StoreClient


def run_client(master: str, fn, node_id: str, rpc_timeout: float = 5, **kw):
    """``await fn(client, engine)`` with a StoreClient ``node_id`` of ``master`` on its own
    transfer engine (options ``kw``); both closed afterwards."""

    async def main():
        te = TransferEngine(DEV_SECRET.encode())
        await te.start()
        cl = StoreClient(te, master, node_id, rpc_timeout=rpc_timeout, **kw)
        try:
            return await fn(cl, te)
        finally:
            await cl.close()
            await te.close()

    return asyncio.run(main())
