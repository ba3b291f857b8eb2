"""A port in use is refused, with a message naming it (issue 18, item 1).

grpc sets SO_REUSEPORT on its listening sockets by default: a second service (or a
second ``kvmesh up``) on the port of a running one would bind it too, and the kernel
would then split new connections between two unrelated clusters. Every kvmesh gRPC
server is made by ``channels.make_server`` with ``grpc.so_reuseport`` off; the data-plane
listeners (transfer engine, the store-master's raw-TCP path) never set it."""

from __future__ import annotations

import asyncio
import contextlib
import socket
import subprocess
import sys
from collections.abc import Iterator

import pytest

from kvmesh.services.common.health import wait_serving
from tests.etcd_server import etcd_server, leader_port

pytestmark = pytest.mark.timeout(300)


def _cli(*args: str) -> list[str]:
    return [sys.executable, "-m", "kvmesh.services.cli", *args]


def _finish(p: subprocess.Popen, timeout: float = 90) -> tuple[int | None, str]:
    """The exit status and output of ``p``; None when it was still running after
    ``timeout`` seconds (it is then stopped)."""
    try:
        out, _ = p.communicate(timeout=timeout)
        return p.returncode, out
    except subprocess.TimeoutExpired:
        p.terminate()
        try:
            out, _ = p.communicate(timeout=20)
        except subprocess.TimeoutExpired:
            p.kill()
            out, _ = p.communicate()
        return None, out


@pytest.fixture(scope="module")
def running() -> Iterator[tuple[str, int]]:
    """A real etcd and a real store-master listening on a known gRPC port."""
    with etcd_server() as etcd:
        # port 0, then the port it bound read from etcd: a port picked here could be
        # taken by another process before the store-master binds it
        p = subprocess.Popen(
            _cli("store-master", "--etcd", etcd.endpoint, "--port", "0"),
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
            start_new_session=True,
        )
        try:
            port = leader_port(etcd.endpoint, "store-master", p)
            ok, last = asyncio.run(wait_serving(f"127.0.0.1:{port}", timeout=60, interval=0.2))
            assert ok, f"the first store-master did not serve: {last}"
            yield etcd.endpoint, port
        finally:
            p.terminate()
            _finish(p, 30)


def _assert_refused(rc: int | None, out: str, addr: str) -> None:
    assert rc is not None, f"the second service bound {addr}, already in use:\n{out[-2000:]}"
    assert rc != 0, out[-2000:]
    assert addr in out and "already in use" in out, out[-2000:]
    assert "Traceback" not in out, out[-4000:]


@pytest.mark.parametrize("role", ["store-master", "conductor", "decode"])
def test_a_second_service_on_a_used_grpc_port_exits_naming_it(running, role):
    etcd, port = running
    extra = ["--block-size", "16", "--kv-memory", "16MiB"] if role == "decode" else []
    p = subprocess.Popen(
        _cli(role, "--etcd", etcd, "--port", str(port), "--metrics-port", "-1", *extra),
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        start_new_session=True,
    )
    rc, out = _finish(p)
    _assert_refused(rc, out, f"127.0.0.1:{port}")
    # the first one is not disturbed
    ok, last = asyncio.run(wait_serving(f"127.0.0.1:{port}", timeout=10))
    assert ok, last


@contextlib.contextmanager
def _held_port() -> Iterator[int]:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        s.listen(1)
        yield s.getsockname()[1]


@pytest.mark.parametrize("flag", ["--http-port", "--metrics-port"])
def test_conductor_refuses_a_used_http_or_metrics_port(running, flag):
    etcd, _ = running
    with _held_port() as held:
        args = ["--http-port", "-1", "--metrics-port", "-1"]
        args[args.index(flag) + 1] = str(held)
        p = subprocess.Popen(
            _cli("conductor", "--etcd", etcd, *args),
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
            start_new_session=True,
        )
        rc, out = _finish(p)
    _assert_refused(rc, out, f"127.0.0.1:{held}")
    assert flag in out, out[-2000:]


def test_kvmesh_up_on_a_used_conductor_port_fails_clearly(running, tmp_path):
    _, port = running
    p = subprocess.Popen(
        _cli("up", "--port", str(port), "--block-size", "16", "--workdir", str(tmp_path))
        + ["--demo", "hi", "--max-tokens", "2"],
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        start_new_session=True,
    )
    rc, out = _finish(p, 180)
    assert "cluster ready" not in out, out[-2000:]
    _assert_refused(rc, out, f"127.0.0.1:{port}")


async def test_data_plane_listeners_do_not_share_their_port():
    """A socket with SO_REUSEPORT binds beside a listener only when that listener set it
    too: the transfer engine's and the store-master's raw-TCP listeners must not."""
    from kvmesh.rdma import TransferEngine
    from kvmesh.services.store_master.fastpath import serve_fast_path

    def try_share(port: int) -> None:
        with socket.socket() as s:
            s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEPORT, 1)
            with pytest.raises(OSError):
                s.bind(("127.0.0.1", port))

    te = TransferEngine(b"ports-test-secret")
    await te.start()
    try:
        try_share(int(te.address.rsplit(":", 1)[1]))
    finally:
        await te.close()
    fast, addr = await serve_fast_path(object(), "127.0.0.1", 0, 0)
    try:
        try_share(int(addr.rsplit(":", 1)[1]))
    finally:
        fast.close()


@pytest.mark.parametrize("role", ["decode", "prefill"])
def test_a_node_on_a_used_data_port_exits_naming_it(running, role):
    """The transfer engine's --data-port in use: exit 1 with the port named and the
    option to change, before the model loads; not an OSError traceback."""
    etcd, _ = running
    with _held_port() as held:
        p = subprocess.Popen(
            _cli(role, "--etcd", etcd, "--port", "0", "--metrics-port", "-1")
            + ["--data-port", str(held), "--block-size", "16", "--kv-memory", "16MiB"],
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
            start_new_session=True,
        )
        rc, out = _finish(p)
    _assert_refused(rc, out, f"127.0.0.1:{held}")
    assert rc == 1 and "--data-port" in out and "KV data plane" in out, out[-2000:]
