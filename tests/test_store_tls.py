"""The store's raw-TCP control path under TLS, as real processes with DevCA certificates:
a store-master and a store-node with mutual TLS keep the fast path (it speaks TLS with
the gRPC certificate and CA), a client with the right certificate is served on it
(the master's ``kvmesh_store_fast_calls_total{tls="true"}`` counts its calls) and every
byte comes back; plaintext, no client certificate and a certificate from another CA
are refused in the handshake, and the master keeps serving."""

from __future__ import annotations

import asyncio
import os
import socket
import ssl

import grpc
import numpy as np
import pytest

from kvmesh.loadtest.store_cluster import StoreCluster
from kvmesh.protos import kvmesh_pb2 as pb
from kvmesh.protos import kvmesh_pb2_grpc as pbg
from kvmesh.rdma import TransferEngine
from kvmesh.services.common import channels
from kvmesh.services.common.channels import TlsFiles
from kvmesh.services.common.pki import DevCA
from kvmesh.services.common.roles import CLIENT, PREFILL, STORE_MASTER, STORE_NODE
from kvmesh.services.common.settings import DEV_SECRET
from kvmesh.services.store.client import StoreClient
from kvmesh.services.store_master import wire
from tests.store_util import fast_address, master_counter, running_store

pytestmark = pytest.mark.timeout(180)


@pytest.fixture(scope="module")
def pki(tmp_path_factory):
    root = tmp_path_factory.mktemp("pki")
    ca = DevCA(str(root / "ca"))
    other = DevCA(str(root / "other"), name="another CA")
    # the processes hold the store's roles; the client is a model node's store client
    ident = {
        "store": ca.issue("store", roles=[STORE_MASTER, STORE_NODE]),
        "client": ca.issue("client", roles=[PREFILL]),
        "cli": ca.issue("cli", roles=[CLIENT]),  # the command line's role
    }
    stranger = other.issue("stranger")
    as_files = {k: TlsFiles(v.cert, v.key, v.ca) for k, v in ident.items()}
    as_files["stranger"] = TlsFiles(stranger.cert, stranger.key, ca.ca_path)
    return as_files


@pytest.fixture(scope="module")
def store(tmp_path_factory, pki):
    workdir = str(tmp_path_factory.mktemp("store-tls"))
    with running_store(workdir, nodes=1, segment="64MiB", tls=pki["store"]) as c:
        yield c


def fast_calls(store: StoreCluster) -> dict[str, float]:
    """The master's ``kvmesh_store_fast_calls_total`` by its ``tls`` label."""
    return master_counter(store, "kvmesh_store_fast_calls_total", "tls")


def run_client(store: StoreCluster, tls: TlsFiles, fn):
    async def main():
        channels.configure(tls)
        te = TransferEngine(DEV_SECRET.encode())
        await te.start()
        cl = StoreClient(te, store.master, "tls-tester", rpc_timeout=5)
        try:
            return await fn(cl, te)
        finally:
            await cl.close()
            await te.close()

    try:
        return asyncio.run(main())
    finally:
        channels.configure(TlsFiles())


def test_fast_path_under_mutual_tls_round_trips_every_byte(store, pki):
    before = fast_calls(store).get("true", 0.0)
    sizes = [4096, 4096, 300_000, 3 << 20, 5000]
    keys = [f"tls-{i}".encode() for i in range(len(sizes))]
    vals = [os.urandom(n) for n in sizes]

    async def body(cl: StoreClient, te: TransferEngine):
        assert await cl.batch_put(keys, vals) == [True] * len(keys)
        assert await cl.batch_get(keys) == vals
        assert await cl.get(keys[2]) == vals[2]
        src = np.frombuffer(os.urandom(6 << 20), dtype=np.uint8).copy()
        dst = np.zeros_like(src)
        rs, rd = te.register(src), te.register(dst)
        zk = [f"tls-zc-{i}".encode() for i in range(3)]
        offs, lens = [0, 1 << 20, 3 << 20], [1 << 20, 2 << 20, 3 << 20]
        assert await cl.put_from(zk, rs, offs, lens) == [True] * 3
        assert await cl.get_into(zk, rd, offs) == lens
        assert np.array_equal(src, dst)
        await cl.remove(keys + zk)
        return dict(cl.stats)

    stats = run_client(store, pki["client"], body)
    assert stats["master_errors"] == 0 and stats["put_failed"] == 0
    after = fast_calls(store)
    # two puts (PUT_START + PUT_END each), three gets and a remove at least, all on the
    # TLS fast path; nothing was ever served on a plaintext one
    assert after.get("true", 0.0) - before >= 8
    assert after.get("false", 0.0) == 0


def _tls_attempt(addr: tuple[str, int], tls: TlsFiles | None) -> bytes:
    """Connects to the fast path (TLS with ``tls``'s certificate, none without a cert,
    plaintext for None), sends a valid EXISTS call and returns what came back (b""
    when the master closed the connection)."""
    body = wire.pack_exists([b"tls-probe"], False)
    frame = wire.HEAD.pack(len(body), 9, wire.EXISTS) + body
    raw = socket.create_connection(addr, timeout=10)
    raw.settimeout(10)
    if tls is None:
        s: socket.socket = raw
    else:
        ctx = ssl.SSLContext(ssl.PROTOCOL_TLS_CLIENT)
        ctx.load_verify_locations(tls.ca)
        if tls.cert:
            ctx.load_cert_chain(tls.cert, tls.key)
        s = ctx.wrap_socket(raw, server_hostname=addr[0])
    with s:
        try:
            s.sendall(frame)
            return s.recv(1 << 16)
        except (ssl.SSLError, ConnectionError):
            return b""  # refused: an alert, or a reset


def test_fast_path_refuses_plaintext_and_strangers(store, pki):
    addr = fast_address(store, pki["client"])
    # the right certificate gets an answer: (status 0, "none of the keys present")
    ok = _tls_attempt(addr, pki["client"])
    n, rid, status = wire.HEAD.unpack(ok[: wire.HEAD_SIZE])
    assert (rid, status) == (9, 0)
    no_cert = TlsFiles(ca=pki["client"].ca)
    for who in (None, no_cert, pki["stranger"]):
        try:
            got = _tls_attempt(addr, who)
        except ssl.SSLError:
            got = b""  # TLS 1.2: the handshake itself fails
        assert got == b"", f"{who} must be refused"
    # the master still serves the right client afterwards
    n, rid, status = wire.HEAD.unpack(_tls_attempt(addr, pki["client"])[: wire.HEAD_SIZE])
    assert (rid, status) == (9, 0)


def test_a_client_role_certificate_is_refused_the_store(store, pki):
    """Roles (services/common/roles.py): a certificate of the cluster's CA whose role is
    ``client`` completes its TLS handshake but the fast path closes it unserved, and its
    gRPC store calls get PERMISSION_DENIED naming its role and the RPC; a store client's
    role (``prefill``) is served on both."""
    addr = fast_address(store, pki["client"])
    assert _tls_attempt(addr, pki["cli"]) == b""
    n, rid, status = wire.HEAD.unpack(_tls_attempt(addr, pki["client"])[: wire.HEAD_SIZE])
    assert (rid, status) == (9, 0)
    with channels.make_sync_channel(store.master, pki["cli"]) as ch:
        stub = pbg.StoreMasterStub(ch)
        for call, req in (
            (stub.StoreHello, pb.StoreHelloRequest()),
            (stub.Exists, pb.ExistsRequest(hashes=[b"k" * 16])),
            (stub.PutStart, pb.PutStartRequest(node_id="cli", hashes=[b"k" * 16], size=64)),
        ):
            with pytest.raises(grpc.RpcError) as e:
                call(req, timeout=10)
            assert e.value.code() == grpc.StatusCode.PERMISSION_DENIED
            assert (
                "'client'" in e.value.details() and "/kvmesh.v1.StoreMaster/" in e.value.details()
            )
