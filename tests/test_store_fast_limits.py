"""The store-master's raw-TCP control path caps its connections and its pending TLS
handshakes (``--fast-max-conns``, ``--fast-max-handshakes``): with a real store-master
process under mutual TLS and real sockets, a connection beyond either cap is closed at
once (counted in ``kvmesh_store_fast_over_limit_total{limit}``), and a legitimate client
is served again once slots free."""

from __future__ import annotations

import socket
import ssl
import time

import pytest

from kvmesh.loadtest.store_cluster import StoreCluster
from kvmesh.services.common.channels import TlsFiles
from kvmesh.services.common.pki import DevCA
from kvmesh.services.common.roles import PREFILL, STORE_MASTER, STORE_NODE
from kvmesh.services.store_master import wire
from kvmesh.services.store_master.fastpath import HANDSHAKE_S
from tests.store_util import fast_address, master_counter, running_store

pytestmark = pytest.mark.timeout(180)

MAX_CONNS, MAX_HANDSHAKES = 3, 2


@pytest.fixture(scope="module")
def pki(tmp_path_factory):
    ca = DevCA(str(tmp_path_factory.mktemp("pki") / "ca"))
    roles = {"s": [STORE_MASTER, STORE_NODE], "c": [PREFILL]}  # the store; a store client
    return {
        n: TlsFiles(i.cert, i.key, i.ca)
        for n, i in ((n, ca.issue(n, roles=r)) for n, r in roles.items())
    }


@pytest.fixture(scope="module")
def store(tmp_path_factory, pki):
    master_args = ["--fast-max-conns", str(MAX_CONNS), "--fast-max-handshakes", str(MAX_HANDSHAKES)]
    workdir = str(tmp_path_factory.mktemp("store-limits"))
    with running_store(
        workdir, nodes=1, segment="16MiB", tls=pki["s"], master_args=master_args
    ) as c:
        yield c


def over_limit(store: StoreCluster) -> dict[str, float]:
    return master_counter(store, "kvmesh_store_fast_over_limit_total", "limit")


def connect(addr: tuple[str, int], tls: TlsFiles) -> ssl.SSLSocket:
    """A TLS connection with a finished handshake (raises when the master closed it)."""
    ctx = ssl.SSLContext(ssl.PROTOCOL_TLS_CLIENT)
    ctx.load_verify_locations(tls.ca)
    ctx.load_cert_chain(tls.cert, tls.key)
    raw = socket.create_connection(addr, timeout=10)
    raw.settimeout(10)
    try:
        return ctx.wrap_socket(raw, server_hostname=addr[0])
    except BaseException:
        raw.close()
        raise


def exists_call(s: socket.socket) -> bytes:
    """A valid EXISTS call; what came back (b"" when the master closed the connection)."""
    body = wire.pack_exists([b"limit-probe"], False)
    try:
        s.sendall(wire.HEAD.pack(len(body), 7, wire.EXISTS) + body)
        return s.recv(1 << 16)
    except (OSError, ssl.SSLError):  # a reset, an alert
        return b""


def served(addr: tuple[str, int], tls: TlsFiles) -> bool:
    try:
        with connect(addr, tls) as s:
            got = exists_call(s)
    except OSError:  # closed in the handshake: over a limit
        return False
    return got[: wire.HEAD_SIZE] != b"" and wire.HEAD.unpack(got[: wire.HEAD_SIZE])[1:] == (7, 0)


def closed_at_once(s: socket.socket) -> bool:
    """The master closed ``s`` without a word: EOF or a reset well inside HANDSHAKE_S
    (a connection it kept would instead wait out its handshake timeout)."""
    s.settimeout(HANDSHAKE_S / 2)
    try:
        return s.recv(1) == b""
    except ConnectionResetError:
        return True
    except TimeoutError:
        return False


def served_eventually(addr, tls, tries: int = 100) -> bool:
    for _ in range(tries):  # the master sees the freed slots' EOF on its next loop turn
        if served(addr, tls):
            return True
        time.sleep(0.1)
    return False


def test_pending_handshakes_and_connections_are_capped(store, pki):
    addr = fast_address(store, pki["c"])
    assert served(addr, pki["c"])
    before = over_limit(store)

    # MAX_HANDSHAKES clients that never start their handshake hold every handshake slot
    # (the master accepts in arrival order, so it takes them before the next one)
    stalled = [socket.create_connection(addr, timeout=10) for _ in range(MAX_HANDSHAKES)]
    try:
        extra = socket.create_connection(addr, timeout=10)
        with extra:
            assert closed_at_once(extra)
        after = over_limit(store)
        assert after.get("handshakes", 0) - before.get("handshakes", 0) >= 1, after
    finally:
        for s in stalled:
            s.close()
    assert served_eventually(addr, pki["c"])

    # MAX_CONNS served connections hold every connection slot
    held: list[ssl.SSLSocket] = []
    try:
        for _ in range(MAX_CONNS):
            s = connect(addr, pki["c"])
            held.append(s)
            got = exists_call(s)  # served: the master counts it among its connections
            assert wire.HEAD.unpack(got[: wire.HEAD_SIZE])[1:] == (7, 0)
        extra = socket.create_connection(addr, timeout=10)
        with extra:
            assert closed_at_once(extra)
        assert not served(addr, pki["c"])
        after2 = over_limit(store)
        assert after2.get("connections", 0) - after.get("connections", 0) >= 2, after2
        # the held connections are still served
        assert all(wire.HEAD.unpack(exists_call(s)[: wire.HEAD_SIZE])[2] == 0 for s in held)
    finally:
        for s in held:
            s.close()
    assert served_eventually(addr, pki["c"])
