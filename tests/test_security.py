"""Security: each refusal shown against real processes.

* mutual TLS on every gRPC channel (``LocalCluster(tls=True)``, as ``kvmesh up --tls``):
  plaintext, TLS without a client certificate and a certificate from another CA are
  refused, at the conductor and at the nodes;
* roles of certificates: the ``client`` certificate is refused the nodes' internal RPCs
  (PERMISSION_DENIED) and still generates and reads the status;
* API keys (gRPC metadata and HTTP bearer): missing or wrong -> UNAUTHENTICATED / 401;
* tenant isolation: tenant A's repeated prefix hits, tenant B's equal prompt does not;
  two tenants in one shared namespace do hit;
* etcd with TLS and auth: the registry works with credentials, refuses without;
* the data plane refuses a peer with a wrong cluster secret and keeps serving.
"""

from __future__ import annotations

import asyncio
import http.client
import json
import os
import shutil
import ssl
import subprocess
import sys
import time
import urllib.error
import urllib.request
from concurrent.futures import ThreadPoolExecutor

import grpc
import pytest

from kvmesh.protos import kvmesh_pb2 as pb
from kvmesh.protos import kvmesh_pb2_grpc as pbg
from kvmesh.services.common.auth import (
    ANONYMOUS,
    ApiKeyInterceptor,
    ApiKeys,
    Principal,
    Unauthenticated,
    bearer_metadata,
    current_principal,
    parse_entry,
    tenant_seed,
)
from kvmesh.services.common.channels import TlsFiles, channel_credentials
from kvmesh.services.common.config import ConfigError
from kvmesh.services.common.settings import DEV_SECRET, KNOWN_SECRETS
from kvmesh.services.launcher import LocalCluster, listening_ports
from tests.cluster_util import DISAGG_ONLY, NODE_ARGS, start_with_hold_hook
from tests.etcd_server import free_port
from tests.grpc_util import KINDS, call, in_thread, probe_handler, refusal, serving

pytestmark = pytest.mark.timeout(180)

KEYS = "ka:alice,kb:bob,kc:carol:shared=team,kd:dave:shared=team,kopen"
PROMPT = (
    "Tenant isolation: a cached prefix belongs to the tenant that computed it, and "
    "nobody else may hit it or time it. "
)


# ------------------------------------------------------------------ units


def test_api_key_entries():
    assert parse_entry("k") == ("k", ANONYMOUS)
    assert parse_entry("k:t") == ("k", Principal("t", "tenant t"))
    assert parse_entry("k:t:shared=ns") == ("k", Principal("t", "shared ns"))
    for bad in ("", ":t", "k:", "k:t:x", "k:t:shared=", "a b:t"):
        with pytest.raises(ConfigError):
            parse_entry(bad)
    keys = ApiKeys.from_config(KEYS)
    assert keys.authenticate("Bearer ka") == Principal("alice", "tenant alice")
    assert keys.authenticate("bearer  kopen ") == ANONYMOUS
    for bad in (None, "", "ka", "Basic ka", "Bearer", "Bearer nope"):
        with pytest.raises(Unauthenticated):
            keys.authenticate(bad)
    assert ApiKeys().authenticate(None) == ANONYMOUS  # open cluster


def test_api_keys_file(tmp_path):
    f = tmp_path / "keys"
    f.write_text("# tenants\nka:alice\n\nkb:bob  # comment\n")
    keys = ApiKeys.from_config("kc", str(f))
    assert keys.authenticate("Bearer kb").tenant == "bob"
    assert keys.authenticate("Bearer kc") == ANONYMOUS
    (tmp_path / "empty").write_text("# nothing\n")
    with pytest.raises(ConfigError):
        ApiKeys.from_config("", str(tmp_path / "empty"))
    with pytest.raises(ConfigError):
        ApiKeys.from_config("", str(tmp_path / "missing"))


def test_tenant_seed_cannot_be_forged_by_a_salt():
    assert tenant_seed(ANONYMOUS) == b""  # an open cluster's hashes are unchanged
    a, b = tenant_seed(Principal("a", "tenant a")), tenant_seed(Principal("b", "tenant b"))
    assert a != b and a.startswith(b"\xff")
    # a default-namespace request's seed is fp + utf8(salt): it never holds 0xFF
    for salt in ("\xff", "\uffff", "tenant a", "\x00\xff"):
        assert b"\xff" not in salt.encode()
    # namespaces are length-prefixed: "tenant a" + salt "b" != "tenant ab" + salt ""
    assert tenant_seed(Principal("x", "tenant a")) + b"b" != tenant_seed(
        Principal("x", "tenant ab")
    )


def test_tls_config_validation(tmp_path):
    from kvmesh.services.common.settings import ServiceConfig

    cert = tmp_path / "c.pem"
    cert.write_text("x")
    with pytest.raises(ConfigError, match="both"):
        ServiceConfig(tls_cert=str(cert)).validate()
    with pytest.raises(ConfigError, match="readable"):
        ServiceConfig(tls_cert=str(cert), tls_key=str(tmp_path / "nope")).validate()
    with pytest.raises(ConfigError, match="tls_ca"):
        ServiceConfig(tls_ca=str(cert)).validate()
    with pytest.raises(ConfigError, match="etcd"):
        ServiceConfig(etcd_cert=str(cert)).validate()


@pytest.mark.parametrize("kind", KINDS)
def test_api_key_check_covers_every_rpc_kind(kind):
    """A real server: the key check refuses a call of each kind to the client API without
    a key (a client-streaming one too) and runs the handler as the key's tenant otherwise;
    the nodes' internal services are not its business."""
    tenant = lambda: current_principal.get().tenant.encode()  # noqa: E731
    handlers = [probe_handler(s, tenant) for s in ("kvmesh.v1.Conductor", "kvmesh.v1.DecodeNode")]

    async def main():
        async with serving(handlers, [ApiKeyInterceptor(ApiKeys.from_config("ka:alice"))]) as ch:
            code, details = await refusal(ch, "kvmesh.v1.Conductor", kind)
            assert code == grpc.StatusCode.UNAUTHENTICATED
            assert "API key" in details
            ok = await call(ch, "kvmesh.v1.Conductor", kind, bearer_metadata("ka"))
            internal = await call(ch, "kvmesh.v1.DecodeNode", kind)
            return ok, internal

    ok, internal = in_thread(main())
    assert ok and set(ok) == {b"alice"}
    assert internal and set(internal) == {b""}


def test_default_secret_refused_off_loopback(caplog):
    """A node refuses a well-known data-plane secret when it binds a non-loopback
    address, and says to set KVMESH_SECRET; on loopback it only warns."""
    from kvmesh.services.common.config import load
    from kvmesh.services.decode.server import DecodeConfig
    from kvmesh.services.prefill.server import PrefillConfig
    from kvmesh.services.store.node import StoreNodeConfig

    for cls in (PrefillConfig, DecodeConfig, StoreNodeConfig):
        for host in ("10.0.0.21", "0.0.0.0", "decode-1.example", "fd00::5"):
            for env in ({}, {"KVMESH_SECRET": "change-me"}):
                with pytest.raises(ConfigError, match="KVMESH_SECRET") as e:
                    load(cls, ["--host", host], env=env)
                assert host in str(e.value) and "not a loopback address" in str(e.value)
            assert load(cls, ["--host", host], env={"KVMESH_SECRET": "x" * 64}).host == host
        for host in ("127.0.0.1", "127.0.0.2", "::1", "localhost"):
            caplog.clear()
            assert load(cls, ["--host", host], env={}).secret == DEV_SECRET
            assert "well-known secret" in caplog.text


def test_node_process_with_default_secret_off_loopback_exits_with_the_reason():
    env = {k: v for k, v in os.environ.items() if not k.startswith("KVMESH_")}
    out = subprocess.run(
        [sys.executable, "-m", "kvmesh.services.cli", "prefill", "--host", "10.255.0.7"],
        capture_output=True,
        text=True,
        timeout=120,
        env=env,
    )
    assert out.returncode != 0
    assert "KVMESH_SECRET" in out.stderr and "Traceback" not in out.stderr, out.stderr


# ------------------------------------------------------------------ a mutual-TLS cluster


@pytest.fixture(scope="module")
def hold_dir(tmp_path_factory):
    return str(tmp_path_factory.mktemp("hold"))


@pytest.fixture(scope="module")
def cluster(tmp_path_factory, hold_dir):
    c = LocalCluster(
        str(tmp_path_factory.mktemp("secure")),
        node_args=NODE_ARGS,
        conductor_args=[*DISAGG_ONLY, "--api-keys", KEYS],
        tls=True,
        api_key="kopen",
        http_port=0,  # any free port; start() reads it into cluster.http_port
    )
    start_with_hold_hook(c, hold_dir)
    try:
        yield c
    finally:
        c.stop()


def _secure(addr: str, tls: TlsFiles | None) -> grpc.Channel:
    if tls is None:
        return grpc.insecure_channel(addr)
    return grpc.secure_channel(addr, channel_credentials(tls))


def _generate(
    c: LocalCluster, key: str | None, prompt: str = PROMPT, tls="client", max_tokens: int = 2
) -> pb.Usage:
    ident = c.client_tls() if tls == "client" else tls
    with _secure(c.conductor, ident) as ch:
        last = None
        for r in pbg.ConductorStub(ch).Generate(
            pb.GenerateRequest(prompt=prompt, max_tokens=max_tokens),
            timeout=30,
            metadata=bearer_metadata(key) if key else None,
        ):
            last = r
    return last.usage


def _in_thread(coro):
    """Runs ``coro`` on its own loop in its own thread (the transfer engine's I/O threads
    and loop state stay out of this process's later grpc.aio loops)."""
    import concurrent.futures

    with concurrent.futures.ThreadPoolExecutor(1) as ex:
        return ex.submit(asyncio.run, coro).result(60)


def _status_code(fn) -> grpc.StatusCode:
    with pytest.raises(grpc.RpcError) as e:
        fn()
    return e.value.code()


def test_mtls_refuses_plaintext_and_strangers(cluster, tmp_path):
    from kvmesh.services.common.pki import DevCA

    ok = cluster.client_tls()
    stranger = DevCA(str(tmp_path / "other")).issue("client")
    no_cert = TlsFiles(ca=ok.ca)
    status = cluster.status(timeout=5)
    nodes = [n for n in status.nodes if n.role in ("prefill", "decode")]
    targets = [cluster.conductor] + [n.grpc_address for n in nodes]
    assert len(targets) == 3
    refused = [
        (addr, ident)
        for addr in targets
        for ident in (None, no_cert, TlsFiles(stranger.cert, stranger.key, ok.ca))
    ]
    # a server certificate from another CA is refused by our client, too
    refused.append((cluster.conductor, TlsFiles(ok.cert, ok.key, stranger.ca)))

    def never_ready(case) -> bool:
        addr, ident = case
        with _secure(addr, ident) as ch:
            try:
                grpc.channel_ready_future(ch).result(timeout=3)
            except grpc.FutureTimeoutError:
                return True
        return False

    # each case waits its own 3 s for a connection that must never come; all at once
    with ThreadPoolExecutor(len(refused)) as pool:
        connected = [c for c, no in zip(refused, pool.map(never_ready, refused)) if not no]
    assert not connected, connected
    for addr in targets:
        # the right identity connects (the node then wants nothing more than mTLS)
        with _secure(addr, ok) as ch:
            grpc.channel_ready_future(ch).result(timeout=5)
    # and the cluster works end to end over mTLS (every internal hop)
    assert _generate(cluster, "ka", "mTLS all the way: " * 3, max_tokens=4).completion_tokens == 4


def test_api_key_grpc(cluster):
    assert _status_code(lambda: _generate(cluster, None)) == grpc.StatusCode.UNAUTHENTICATED
    assert _status_code(lambda: _generate(cluster, "wrong")) == grpc.StatusCode.UNAUTHENTICATED
    with _secure(cluster.conductor, cluster.client_tls()) as ch:
        stub = pbg.ConductorStub(ch)
        with pytest.raises(grpc.RpcError) as e:
            stub.ClusterStatus(pb.ClusterStatusRequest(), timeout=5)
        assert e.value.code() == grpc.StatusCode.UNAUTHENTICATED
        assert "API key" in e.value.details()
        with pytest.raises(grpc.RpcError) as e:
            stub.ClusterStatus(
                pb.ClusterStatusRequest(), timeout=5, metadata=(("authorization", "Basic a2E="),)
            )
        assert e.value.code() == grpc.StatusCode.UNAUTHENTICATED
        assert (
            stub.ClusterStatus(
                pb.ClusterStatusRequest(), timeout=5, metadata=bearer_metadata("kb")
            ).cluster
            == "default"
        )


def test_api_key_http(cluster):
    """Under --tls the HTTP face speaks HTTPS only, so bearer keys never cross in clear."""
    base = f"127.0.0.1:{cluster.http_port}"
    url = f"https://{base}/v1/completions"
    ctx = ssl.create_default_context(cafile=cluster.client_tls().ca)
    body = json.dumps({"prompt": "hi there", "max_tokens": 2}).encode()

    def post(headers):
        req = urllib.request.Request(url, body, {"Content-Type": "application/json", **headers})
        try:
            with urllib.request.urlopen(req, timeout=30, context=ctx) as r:
                return r.status, json.loads(r.read())
        except urllib.error.HTTPError as e:
            return e.code, json.loads(e.read())

    for headers in ({}, {"Authorization": "Bearer nope"}, {"Authorization": "ka"}):
        code, out = post(headers)
        assert code == 401, (headers, out)
        assert out["error"]["type"] == "authentication_error"
        assert "nope" not in out["error"]["message"]
    code, out = post({"Authorization": "Bearer ka"})
    assert code == 200 and out["usage"]["completion_tokens"] == 2
    req = urllib.request.Request(f"https://{base}/v1/models")
    with pytest.raises(urllib.error.HTTPError) as e:
        urllib.request.urlopen(req, timeout=10, context=ctx)
    assert e.value.code == 401
    # plaintext HTTP gets no answer at all: the key in its header never reaches a handler
    plain = urllib.request.Request(
        f"http://{base}/v1/completions", body, {"Authorization": "Bearer ka"}
    )
    with pytest.raises((urllib.error.URLError, ConnectionError, http.client.HTTPException)):
        urllib.request.urlopen(plain, timeout=10)


def test_tenant_isolation(cluster):
    prompt = PROMPT * 2  # several full 16-token blocks
    assert _generate(cluster, "ka", prompt).cached_tokens == 0
    assert _generate(cluster, "ka", prompt).cached_tokens > 0  # alice hits her own prefix
    assert _generate(cluster, "kb", prompt).cached_tokens == 0  # bob cannot
    assert _generate(cluster, "kopen", prompt).cached_tokens == 0  # nor the default tenant
    # carol and dave share the namespace "team": dave hits what carol computed
    assert _generate(cluster, "kc", prompt).cached_tokens == 0
    assert _generate(cluster, "kd", prompt).cached_tokens > 0


def test_request_ids_are_scoped_per_tenant(cluster, hold_dir):
    """Issue 18: a request_id is unique among its own tenant's requests in flight only.
    alice's request "job-1" is held at the prefill node (in flight); bob's "job-1" and
    dave's (another tenant, sharing carol's cache namespace) are accepted beside it
    (queued behind it, their decode KV reserved), while a second "job-1" of alice is
    refused: ALREADY_EXISTS on gRPC, 409 on HTTP."""
    from tests.test_cancel import Hold

    hold = Hold(hold_dir)
    hold.at("prefilling")
    ident = cluster.client_tls()
    calls = {}

    def reserved() -> int:  # requests holding decode KV: each passed the id check
        return sum(n.queue_depth for n in cluster.status(timeout=5).nodes if n.role == "decode")

    base = reserved()
    try:
        with _secure(cluster.conductor, ident) as ch:
            stub = pbg.ConductorStub(ch)
            for n, key in enumerate(("ka", "kb", "kd"), 1):
                calls[key] = stub.Generate(
                    pb.GenerateRequest(prompt=f"{key}: {PROMPT}", max_tokens=2, request_id="job-1"),
                    timeout=60,
                    metadata=bearer_metadata(key),
                )
                if n == 1:
                    hold.wait_held(1, calls[key])  # alice's holds the prefill node
                deadline = time.monotonic() + 30  # the others queue behind it, reserved
                while reserved() < base + n:
                    assert not calls[key].done(), (key, calls[key].code(), calls[key].details())
                    assert time.monotonic() < deadline, f"{key}'s request was not accepted"
                    time.sleep(0.05)
            with pytest.raises(grpc.RpcError) as e:
                _generate_id(stub, "ka", "job-1")
            assert e.value.code() == grpc.StatusCode.ALREADY_EXISTS, e.value.details()
            assert "job-1" in e.value.details()
            # the HTTP face: the same rule, as a 409
            ctx = ssl.create_default_context(cafile=ident.ca)
            body = {"prompt": "hi", "max_tokens": 2, "request_id": "job-1"}
            req = urllib.request.Request(
                f"https://127.0.0.1:{cluster.http_port}/v1/completions",
                json.dumps(body).encode(),
                {"Content-Type": "application/json", "Authorization": "Bearer ka"},
            )
            with pytest.raises(urllib.error.HTTPError) as h:
                urllib.request.urlopen(req, timeout=30, context=ctx)
            assert h.value.code == 409
            assert json.loads(h.value.read())["error"]["param"] == "request_id"
            # alice's held request is cancelled (a held one waits for that); bob's and
            # dave's job-1, queued behind it, are served to their end
            hold.at("")
            calls.pop("ka").cancel()
            for key, call in calls.items():
                assert [r.finish_reason for r in call][-1] == "length", key
    finally:
        hold.at("")
        for call in calls.values():
            call.cancel()


def _generate_id(stub, key: str, request_id: str) -> str:
    last = None
    for r in stub.Generate(
        pb.GenerateRequest(prompt=PROMPT, max_tokens=2, request_id=request_id),
        timeout=30,
        metadata=bearer_metadata(key),
    ):
        last = r
    return last.finish_reason


def test_cli_against_tls_cluster(cluster):
    client = cluster.tls_args("client")
    env = {**os.environ, "KVMESH_API_KEY": "ka"}
    out = subprocess.run(
        [
            sys.executable,
            "-m",
            "kvmesh.services.cli",
            "generate",
            "hello tls",
            "--conductor",
            cluster.conductor,
            "--max-tokens",
            "3",
            "-v",
            *client,
        ],
        capture_output=True,
        text=True,
        timeout=60,
        env=env,
    )
    assert out.returncode == 0, out.stderr
    assert "completion=3" in out.stderr
    out = subprocess.run(
        [
            sys.executable,
            "-m",
            "kvmesh.services.cli",
            "status",
            "--once",
            "--json",
            "--conductor",
            cluster.conductor,
            *client,
            "--api-key",
            "kb",
        ],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert out.returncode == 0, out.stderr
    assert len(json.loads(out.stdout)["nodes"]) >= 3
    # without the client certificate the CLI is refused
    out = subprocess.run(
        [
            sys.executable,
            "-m",
            "kvmesh.services.cli",
            "status",
            "--once",
            "--conductor",
            cluster.conductor,
            "--tls-ca",
            client[5],
            "--api-key",
            "kb",
        ],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert out.returncode == 1
    out = subprocess.run(
        [sys.executable, "-m", "kvmesh.services.cli", "health", cluster.conductor, *client],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert out.returncode == 0, out.stderr


def _ident(c: LocalCluster, name: str) -> TlsFiles:
    """The cluster CA's identity ``name`` (its role: the one the name starts with)."""
    a = c.tls_args(name)
    return TlsFiles(a[1], a[3], a[5])


def _denied(fn) -> str:
    with pytest.raises(grpc.RpcError) as e:
        fn()
    assert e.value.code() == grpc.StatusCode.PERMISSION_DENIED, e.value
    return e.value.details()


def test_client_certificate_reaches_the_public_api_only(cluster):
    """Roles under mutual TLS: the CLI's ``client`` certificate is refused the nodes'
    internal RPCs (PERMISSION_DENIED naming its role and the RPC) and still generates
    (greedy, the single-process reference's tokens) and reads the status; a peer that
    has no business with an RPC is refused too, and the conductor's role is served."""
    from kvmesh.services.common.tokenizer import ByteTokenizer
    from kvmesh.services.engine.model import LlamaModel

    st = cluster.status(timeout=5)
    decode = next(n.grpc_address for n in st.nodes if n.role == "decode")
    prefill = next(n.grpc_address for n in st.nodes if n.role == "prefill")
    master = next(n.grpc_address for n in st.nodes if n.role == "store-master")
    client = cluster.client_tls()
    reserve = pb.ReserveRequest(request_id="roles-probe", prompt_tokens=8, max_tokens=8)
    with _secure(decode, client) as ch:
        stub = pbg.DecodeNodeStub(ch)
        msg = _denied(lambda: stub.Reserve(reserve, timeout=5))
        assert "'client'" in msg and "/kvmesh.v1.DecodeNode/Reserve" in msg, msg
        msg = _denied(lambda: stub.Release(pb.ReleaseRequest(request_id="x"), timeout=5))
        assert "'client'" in msg and "/kvmesh.v1.DecodeNode/Release" in msg, msg
        _denied(lambda: stub.Status(pb.NodeStatusRequest(), timeout=5))
    with _secure(prefill, client) as ch:
        msg = _denied(
            lambda: pbg.PrefillNodeStub(ch).Prefill(
                pb.PrefillRequest(request_id="x", token_ids=[1, 2, 3]), timeout=5
            )
        )
        assert "/kvmesh.v1.PrefillNode/Prefill" in msg
    with _secure(master, client) as ch:
        _denied(
            lambda: pbg.StoreMasterStub(ch).PutStart(
                pb.PutStartRequest(node_id="x", hashes=[b"k" * 16], sizes=[64]), timeout=5
            )
        )
    # a certificate of the cluster's CA that names no role is a client's
    with _secure(decode, _ident(cluster, "nameless")) as ch:
        msg = _denied(lambda: pbg.DecodeNodeStub(ch).Reserve(reserve, timeout=5))
        assert "names no role" in msg, msg
    # a peer that never calls Reserve may not either; the conductor's role may
    with _secure(decode, _ident(cluster, "prefill-0")) as ch:
        msg = _denied(lambda: pbg.DecodeNodeStub(ch).Reserve(reserve, timeout=5))
        assert "'prefill'" in msg and "allowed: conductor" in msg, msg
    with _secure(decode, _ident(cluster, "conductor-0")) as ch:
        assert pbg.DecodeNodeStub(ch).Status(pb.NodeStatusRequest(), timeout=5).node_id
    # the client API still serves the client certificate, end to end over mTLS
    with _secure(cluster.conductor, client) as ch:
        st = pbg.ConductorStub(ch).ClusterStatus(
            pb.ClusterStatusRequest(), timeout=5, metadata=bearer_metadata("kopen")
        )
    assert {n.role for n in st.nodes} >= {"prefill", "decode", "store-master"}
    prompt = "Roles: who may call what. "
    tokens: list[int] = []
    with _secure(cluster.conductor, client) as ch:
        for r in pbg.ConductorStub(ch).Generate(
            pb.GenerateRequest(prompt=prompt, max_tokens=12),
            timeout=60,
            metadata=bearer_metadata("kopen"),
        ):
            tokens.extend(r.token_ids)
    model = LlamaModel.from_preset("tiny", seed=0)
    tok = ByteTokenizer()
    assert tokens == model.reference_generate(tok.encode(prompt), 12, eos_id=tok.eos_id)
    # and a service certificate may not use the public API
    with _secure(cluster.conductor, _ident(cluster, "decode-0")) as ch:
        msg = _denied(
            lambda: pbg.ConductorStub(ch).ClusterStatus(
                pb.ClusterStatusRequest(), timeout=5, metadata=bearer_metadata("kopen")
            )
        )
        assert "'decode'" in msg and "/kvmesh.v1.Conductor/ClusterStatus" in msg, msg
    # every refusal is counted, and the cluster's own calls (the conductor's to the nodes
    # and the store, the nodes' to the store, over gRPC and the fast path) met none
    want = {
        "decode": {
            ("/kvmesh.v1.DecodeNode/Reserve", "client"),
            ("/kvmesh.v1.DecodeNode/Release", "client"),
            ("/kvmesh.v1.DecodeNode/Status", "client"),
            ("/kvmesh.v1.DecodeNode/Reserve", "none"),
            ("/kvmesh.v1.DecodeNode/Reserve", "prefill"),
        },
        "prefill": {("/kvmesh.v1.PrefillNode/Prefill", "client")},
        "store-master": {("/kvmesh.v1.StoreMaster/PutStart", "client")},
        "conductor": {("/kvmesh.v1.Conductor/ClusterStatus", "decode")},
    }
    for n in st.nodes:
        assert _denials(n.metrics_address) == want[n.role], n.role


def _denials(metrics_address: str) -> set[tuple[str, str]]:
    from prometheus_client.parser import text_string_to_metric_families

    with urllib.request.urlopen(f"http://{metrics_address}/metrics", timeout=5) as r:
        text = r.read().decode()
    return {
        (s.labels["method"], s.labels["role"])
        for f in text_string_to_metric_families(text)
        for s in f.samples
        if s.name == "kvmesh_rpc_denied_total" and s.value > 0
    }


def test_data_plane_refuses_wrong_secret(cluster):
    from kvmesh.rdma import Slice, TransferEngine, TransferError

    node = next(n for n in cluster.status(timeout=5).nodes if n.role == "decode")
    assert node.data_address

    async def attempt(secret: bytes) -> bytes:
        te = TransferEngine(secret, transport="tcp")
        await te.start()
        try:
            buf = bytearray(64)
            await te.read(
                node.data_address, [Slice(te.register(buf), 0, 1, 0, 64)]
            )  # its first region
            return bytes(buf)
        finally:
            await te.close()

    with pytest.raises(TransferError, match="secret"):
        _in_thread(attempt(b"a-wrong-secret"))
    # a local cluster (kvmesh up) runs on a random secret of its own, not the default
    assert cluster.secret not in KNOWN_SECRETS and len(cluster.secret) >= 32
    with pytest.raises(TransferError, match="secret"):
        _in_thread(attempt(DEV_SECRET.encode()))
    _in_thread(attempt(cluster.secret.encode()))  # the control: the right secret reads
    # the node keeps serving
    assert _generate(cluster, "ka", "still serving? " * 3, max_tokens=3).completion_tokens == 3
    assert all(p.poll() is None for p in cluster.procs.values())


# ------------------------------------------------------------------ etcd with TLS and auth


@pytest.fixture
def secure_etcd(tmp_path):
    """etcd with TLS and client-certificate auth on free ports. etcd cannot bind port 0,
    so the ports are guessed: until our etcd is seen listening on its client port
    (another process may have taken one meanwhile), it is started again on others."""
    from kvmesh.services.common.pki import DevCA

    if shutil.which("etcd") is None:
        pytest.skip("etcd is not installed")
    ca = DevCA(str(tmp_path / "pki"))
    server, client = ca.issue("etcd"), ca.issue("client")
    proc = None
    for attempt in range(5):
        port, peer = free_port(), free_port()
        proc = _start_secure_etcd(tmp_path / f"try{attempt}", server, port, peer)
        deadline, listening = time.monotonic() + 20, False
        while not listening and proc.poll() is None and time.monotonic() < deadline:
            ports = listening_ports(proc.pid)
            listening = ports is None or port in ports  # None: no /proc to tell, trust it
            time.sleep(0.05)
        if listening and proc.poll() is None:
            break
        proc.kill()
        proc.wait()
    else:
        pytest.fail(f"etcd did not listen in 5 tries; see {tmp_path}/try*/etcd.log")
    try:
        yield f"127.0.0.1:{port}", client, proc
    finally:
        proc.terminate()
        proc.wait(10)


def _start_secure_etcd(root, server, port: int, peer: int) -> subprocess.Popen:
    root.mkdir()
    url = f"https://127.0.0.1:{port}"
    with open(root / "etcd.log", "wb") as log:
        return subprocess.Popen(
            [
                "etcd",
                "--name",
                "s",
                "--data-dir",
                str(root / "data"),
                "--listen-client-urls",
                url,
                "--advertise-client-urls",
                url,
                "--listen-peer-urls",
                f"http://127.0.0.1:{peer}",
                "--initial-advertise-peer-urls",
                f"http://127.0.0.1:{peer}",
                "--initial-cluster",
                f"s=http://127.0.0.1:{peer}",
                "--cert-file",
                server.cert,
                "--key-file",
                server.key,
                "--trusted-ca-file",
                server.ca,
                "--client-cert-auth",
                "--log-level",
                "error",
            ],
            stdout=log,
            stderr=subprocess.STDOUT,
            start_new_session=True,
        )


def test_etcd_tls_and_auth(secure_etcd):
    from kvmesh.protos.etcd import rpc_pb2 as epb
    from kvmesh.protos.etcd import rpc_pb2_grpc as epbg
    from kvmesh.services.common.etcd import EtcdClient, EtcdError, etcd_credentials
    from kvmesh.services.common.registry import Membership, Registration

    endpoint, ident, proc = secure_etcd
    creds = etcd_credentials(ident.ca, ident.cert, ident.key)

    async def main():
        # bootstrap: root user + auth on, through our client's channel (mTLS)
        admin = EtcdClient(endpoint, credentials=creds, timeout=10)
        ch = admin._ensure_channel()
        auth = epbg.AuthStub(ch)
        await auth.UserAdd(
            epb.AuthUserAddRequest(name="root", password="s3cret"), timeout=15, wait_for_ready=True
        )
        await auth.UserGrantRole(epb.AuthUserGrantRoleRequest(user="root", role="root"), timeout=5)
        await auth.AuthEnable(epb.AuthEnableRequest(), timeout=5)
        await admin.close()

        # with the certificate and the password: the registry works
        good = EtcdClient(endpoint, user="root", password="s3cret", credentials=creds)
        reg = Registration(good, "/kvmesh/t/nodes/prefill/p0", b'{"grpc": "x"}', ttl=5)
        await reg.start()
        members = Membership(good, "/kvmesh/t/nodes/")
        await members.start()
        assert "/kvmesh/t/nodes/prefill/p0" in members.nodes
        await members.stop()
        await reg.stop()

        # right certificate, no password: refused by etcd's auth
        nouser = EtcdClient(endpoint, credentials=creds, timeout=3)
        with pytest.raises(EtcdError) as e:
            await nouser.put("/kvmesh/t/x", b"1")
        assert e.value.code in (
            grpc.StatusCode.INVALID_ARGUMENT,
            grpc.StatusCode.PERMISSION_DENIED,
            grpc.StatusCode.UNAUTHENTICATED,
        )
        await nouser.close()
        # wrong password
        wrong = EtcdClient(endpoint, user="root", password="nope", credentials=creds, timeout=3)
        with pytest.raises(EtcdError):
            await wrong.put("/kvmesh/t/x", b"1")
        await wrong.close()
        # password but no client certificate / plaintext: the TLS handshake fails
        for c in (etcd_credentials(ident.ca), None):
            bad = EtcdClient(endpoint, user="root", password="s3cret", credentials=c, timeout=2)
            with pytest.raises(EtcdError):
                await bad.get("/kvmesh/t/x")
            await bad.close()
        await good.close()

    asyncio.run(main())
    assert proc.poll() is None


def test_nodes_store_calls_take_the_tls_fast_path(cluster):
    """In a mutual-TLS cluster the prefill node's store puts go over the store-master's
    raw-TCP control path, which speaks TLS (``kvmesh_store_fast_calls_total{tls="true"}``
    on the master), never plaintext and never refused."""
    from prometheus_client.parser import text_string_to_metric_families

    _generate(cluster, "kopen", PROMPT * 3 + "fast path")
    with _secure(cluster.conductor, cluster.client_tls()) as ch:
        st = pbg.ConductorStub(ch).ClusterStatus(
            pb.ClusterStatusRequest(), timeout=10, metadata=bearer_metadata("kopen")
        )
    master = next(n for n in st.nodes if n.role == "store-master")

    def fast() -> dict[str, float]:
        with urllib.request.urlopen(f"http://{master.metrics_address}/metrics", timeout=5) as r:
            text = r.read().decode()
        out: dict[str, float] = {}
        for f in text_string_to_metric_families(text):
            for s in f.samples:
                if s.name == "kvmesh_store_fast_calls_total":
                    out[s.labels["tls"]] = s.value
                elif s.name == "kvmesh_store_fast_refused_total":
                    out["refused"] = s.value
        return out

    deadline = time.monotonic() + 30  # the put follows the prefill asynchronously
    got = fast()
    while got.get("true", 0) == 0 and time.monotonic() < deadline:
        time.sleep(0.2)
        got = fast()
    assert got.get("true", 0) > 0, got
    assert got.get("false", 0) == 0 and got.get("refused", 0) == 0, got
