"""A real single-node etcd on free loopback ports for tests (services.launcher.Etcd with
a private temporary data dir), and :func:`free_port` for the tests' own fixtures.

    with etcd_server() as srv:
        client = EtcdClient(srv.endpoint)
        ...
        srv.restart(down_for=3.0)   # SIGTERM, wait, (sleep), start again on same ports/data dir
"""

from __future__ import annotations

import asyncio
import contextlib
import shutil
import socket
import subprocess
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path

from kvmesh.services.launcher import Etcd

__all__ = ["EtcdServer", "etcd_server", "free_port", "leader_port"]


def free_port(host: str = "127.0.0.1") -> int:
    """A loopback port that is free now, for a test's own fixture (a dead endpoint, a
    proxy, an explicit port under test). Another process may take it before the test
    binds it: the services themselves bind port 0 and report their port."""
    with socket.socket() as s:
        s.bind((host, 0))
        return s.getsockname()[1]


def leader_port(
    endpoint: str,
    role: str,
    proc: subprocess.Popen,
    cluster: str = "default",
    timeout: float = 60,
) -> int:
    """The gRPC port of ``role``'s leader (a store-master started with ``--port 0``), read
    from its campaign key in etcd once it is elected; fails if ``proc`` exits first."""
    from kvmesh.services.common.election import current_leader
    from kvmesh.services.common.etcd import EtcdClient

    async def poll() -> int:
        async with EtcdClient(endpoint) as c, asyncio.timeout(timeout):
            while True:  # bounded by the timeout
                info = await current_leader(c, cluster, role)
                if info and info.get("grpc"):
                    return int(info["grpc"].rsplit(":", 1)[1])
                if proc.poll() is not None:
                    raise RuntimeError(f"{role} exited with {proc.returncode} before leading")
                await asyncio.sleep(0.1)

    return asyncio.run(poll())


class EtcdServer(Etcd):
    def __init__(self, data_dir: Path | None = None) -> None:
        self._tmp = None if data_dir else tempfile.mkdtemp(prefix="kvmesh-etcd-")
        root = Path(data_dir or self._tmp)
        super().__init__(str(root / "etcd"), log_path=str(root / "etcd.log"))

    def restart(self, down_for: float = 0.0) -> None:
        """Stop, stay down ``down_for`` seconds, start again on the same ports and data dir."""
        self.stop()
        time.sleep(down_for)
        self.start()

    def cleanup(self) -> None:
        self.stop()
        if self._tmp:
            shutil.rmtree(self._tmp, ignore_errors=True)


@contextlib.contextmanager
def etcd_server() -> Iterator[EtcdServer]:
    """Start an etcd, yield it, and always stop it and delete its data."""
    srv = EtcdServer()
    try:
        srv.start()
        yield srv
    finally:
        srv.cleanup()
