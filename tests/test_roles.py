"""Roles of mutual-TLS identities (``services/common/roles.py``): the one role x RPC table
covers every RPC of the proto and is the one ``docs/operations.md`` shows; its rules
(clients reach the public API only, a certificate without a role is a client's, an
unknown role grants nothing, several roles add up); and the interceptor on a real
mutual-TLS gRPC server, with DevCA certificates, refusing what a certificate's role may
not call with PERMISSION_DENIED naming the role and the RPC. The same rules on a whole
``kvmesh up --tls`` cluster are in ``tests/test_security.py``."""

from __future__ import annotations

import os

import grpc
import pytest

from kvmesh.protos import kvmesh_pb2 as pb
from kvmesh.services.common import roles
from kvmesh.services.common.channels import (
    TlsFiles,
    channel_credentials,
    make_server,
    server_credentials,
)
from kvmesh.services.common.pki import DevCA
from kvmesh.services.common.roles import (
    CLIENT,
    CONDUCTOR,
    DECODE,
    PREFILL,
    RPC_ROLES,
    STORE_MASTER,
    RoleInterceptor,
    may_call,
    refusal_message,
    role_of_name,
)
from tests.grpc_util import in_thread

pytestmark = pytest.mark.timeout(120)

RESERVE = "/kvmesh.v1.DecodeNode/Reserve"
GENERATE = "/kvmesh.v1.Conductor/Generate"
DOCS = os.path.join(os.path.dirname(__file__), "..", "docs", "operations.md")


def test_the_table_covers_every_rpc_of_the_proto():
    rpcs = {
        f"/{s.full_name}/{m.name}"
        for s in pb.DESCRIPTOR.services_by_name.values()
        for m in s.methods
    }
    assert set(RPC_ROLES) == rpcs
    assert all(RPC_ROLES[m] and RPC_ROLES[m] <= set(roles.ROLES) for m in rpcs)


def test_clients_reach_the_public_api_only():
    client = frozenset({CLIENT})
    public = {m for m in RPC_ROLES if m.startswith("/kvmesh.v1.Conductor/")}
    assert public == {GENERATE, "/kvmesh.v1.Conductor/ClusterStatus"}
    for m in RPC_ROLES:
        assert may_call(m, client) == (m in public), m
    # no service role needs the public API, and every internal RPC has a service caller
    for m in public:
        assert RPC_ROLES[m] == {CLIENT}
    # the call graph: the conductor drives the nodes, the store-master their segments,
    # model nodes use the store; nobody else reaches a node's reservations
    assert RPC_ROLES[RESERVE] == RPC_ROLES["/kvmesh.v1.DecodeNode/Release"] == {CONDUCTOR}
    assert RPC_ROLES["/kvmesh.v1.PrefillNode/Prefill"] == {CONDUCTOR}
    assert RPC_ROLES["/kvmesh.v1.StoreSegment/Replicate"] == {STORE_MASTER}
    assert {PREFILL, DECODE} <= RPC_ROLES["/kvmesh.v1.StoreMaster/PutStart"]
    assert CONDUCTOR in RPC_ROLES["/kvmesh.v1.StoreMaster/Exists"]
    assert not may_call(RESERVE, frozenset({PREFILL}))  # a peer that does not need it
    # health and reflection answer every certificate
    assert may_call("/grpc.health.v1.Health/Check", client)
    assert may_call("/grpc.reflection.v1alpha.ServerReflection/ServerReflectionInfo", client)
    # an RPC missing from the table is refused (default deny)
    assert not may_call("/kvmesh.v1.DecodeNode/Other", frozenset(roles.ROLES))


def test_no_role_unknown_roles_and_several_roles():
    none: frozenset[str] = frozenset()
    assert may_call(GENERATE, none) and not may_call(RESERVE, none)  # a client's
    assert "names no role" in refusal_message(RESERVE, none)
    assert "'client'" in refusal_message(RESERVE, none)
    typo = frozenset({"decoder"})
    assert not may_call(GENERATE, typo) and not may_call(RESERVE, typo)
    both = frozenset({CONDUCTOR, CLIENT})
    assert may_call(RESERVE, both) and may_call(GENERATE, both)
    msg = refusal_message(RESERVE, frozenset({PREFILL}))
    assert "'prefill'" in msg and RESERVE in msg and "allowed: conductor" in msg
    assert roles.roles_from_uris(["kvmesh://role/decode", "spiffe://x/y", "kvmesh://role/ab"]) == {
        DECODE,
        "ab",
    }
    peercert = {"subjectAltName": (("DNS", "localhost"), ("URI", "kvmesh://role/prefill"))}
    assert roles.roles_of_peercert(peercert) == {PREFILL}
    with pytest.raises(ValueError, match="unknown kvmesh role"):
        roles.role_uri("admin")


def test_a_service_certificate_without_its_role_is_reported(tmp_path):
    ca = DevCA(str(tmp_path / "ca"))
    good = ca.issue("decode-0", roles=[DECODE])
    shared = ca.issue("shared", roles=[CONDUCTOR, DECODE, PREFILL, STORE_MASTER])
    bare = ca.issue("bare")
    assert roles.roles_of_cert_file(shared.cert) == {CONDUCTOR, DECODE, PREFILL, STORE_MASTER}
    assert roles.check_own_role(good.cert, DECODE) == ""
    assert roles.check_own_role(shared.cert, PREFILL) == ""
    assert roles.check_own_role(bare.cert, CLIENT) == ""  # not a service
    msg = roles.check_own_role(bare.cert, DECODE)
    assert "no role" in msg and "kvmesh://role/decode" in msg
    assert "names prefill" in roles.check_own_role(
        ca.issue("p", roles=[PREFILL]).cert, STORE_MASTER
    )


def test_launcher_names_map_to_roles():
    assert role_of_name("store-master-0") == STORE_MASTER
    assert role_of_name("decode-1") == DECODE
    assert role_of_name("prefill-ns") == PREFILL
    assert role_of_name("conductor-0") == CONDUCTOR
    assert role_of_name("client") == CLIENT
    assert role_of_name("etcd") is None and role_of_name("decoder") is None


def test_operations_doc_shows_the_table():
    with open(DOCS) as f:
        doc = f.read()
    assert roles.matrix_markdown() in doc, (
        "docs/operations.md's role table is stale: paste the output of "
        "`python -m kvmesh.services.common.roles`"
    )


def _echo(method: str) -> grpc.GenericRpcHandler:
    service, name = method.split("/")[1:]

    async def unary(request: bytes, ctx) -> bytes:
        return b"served"

    async def stream(request: bytes, ctx):
        yield b"served"

    kind = grpc.unary_stream_rpc_method_handler if "Generate" in name else None
    handler = (kind or grpc.unary_unary_rpc_method_handler)(stream if kind else unary)
    return grpc.method_handlers_generic_handler(service, {name: handler})


def test_interceptor_on_a_real_mtls_server(tmp_path):
    """Real certificates over a real TLS connection: the role comes from the peer's
    certificate as gRPC's auth context shows it."""
    ca = DevCA(str(tmp_path / "ca"))
    server_id = ca.issue("decode-0", roles=[DECODE])
    idents = {
        "client": ca.issue("client", roles=[CLIENT]),
        "conductor": ca.issue("conductor-0", roles=[CONDUCTOR]),
        "prefill": ca.issue("prefill-0", roles=[PREFILL]),
        "none": ca.issue("nameless"),
    }

    async def main():
        server = make_server([RoleInterceptor()])
        server.add_generic_rpc_handlers((_echo(RESERVE), _echo(GENERATE)))
        tls = TlsFiles(server_id.cert, server_id.key, server_id.ca)
        port = server.add_secure_port("127.0.0.1:0", server_credentials(tls))
        await server.start()
        out = {}
        try:
            for who, i in idents.items():
                creds = channel_credentials(TlsFiles(i.cert, i.key, i.ca))
                async with grpc.aio.secure_channel(f"127.0.0.1:{port}", creds) as ch:
                    for method in (RESERVE, GENERATE):
                        try:
                            if method == GENERATE:
                                got = [r async for r in ch.unary_stream(method)(b"", timeout=5)]
                                out[who, method] = got[0]
                            else:
                                out[who, method] = await ch.unary_unary(method)(b"", timeout=5)
                        except grpc.aio.AioRpcError as e:
                            out[who, method] = (e.code(), e.details())
        finally:
            await server.stop(None)
        return out

    out = in_thread(main())
    assert out["conductor", RESERVE] == b"served"
    assert out["client", GENERATE] == b"served"
    assert out["none", GENERATE] == b"served"  # no role: a client
    for who, method in (
        ("client", RESERVE),
        ("prefill", RESERVE),
        ("none", RESERVE),
        ("conductor", GENERATE),
        ("prefill", GENERATE),
    ):
        code, details = out[who, method]
        assert code == grpc.StatusCode.PERMISSION_DENIED, (who, method)
        assert method in details and f"'{'client' if who == 'none' else who}'" in details
    assert "names no role" in out["none", RESERVE][1]
