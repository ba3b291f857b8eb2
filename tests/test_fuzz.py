"""Bad input, property-based (hypothesis), against a real cluster: every client-facing
gRPC call (``Conductor.Generate``, ``Conductor.ClusterStatus``), the HTTP API
(``/v1/completions``, ``/v1/chat/completions``) and the data-plane handshake get
malformed, oversized, negative, non-UTF-8, wrong-type and truncated input.

Properties: only clean status codes come back (gRPC: INVALID_ARGUMENT, RESOURCE_EXHAUSTED,
UNAUTHENTICATED, plus OK/UNAVAILABLE/DEADLINE_EXCEEDED for requests that are valid; HTTP:
no 5xx other than a 503 for "no node"); and after each test (``everyone_alive_and_logs_clean``)
every process is alive, the cluster still serves, and nothing the services logged during
the test is above WARNING or a stack trace.

Cases per call are bounded (``EXAMPLES``) so the file runs in about a minute; raise
``KVMESH_FUZZ_EXAMPLES`` for a longer soak.
"""

from __future__ import annotations

import json
import os
import re
import socket
import urllib.error
import urllib.request

import grpc
import pytest

hypothesis = pytest.importorskip("hypothesis")
from hypothesis import HealthCheck, given, settings  # noqa: E402
from hypothesis import strategies as st  # noqa: E402

from kvmesh.protos import kvmesh_pb2 as pb  # noqa: E402
from kvmesh.services.common.auth import bearer_metadata  # noqa: E402
from kvmesh.services.launcher import LocalCluster  # noqa: E402
from tests.cluster_util import NODE_ARGS  # noqa: E402
from tests.etcd_server import free_port  # noqa: E402

pytestmark = pytest.mark.timeout(240)

EXAMPLES = int(os.environ.get("KVMESH_FUZZ_EXAMPLES", "25"))
KEY = "fuzz-key"
GENERATE = "/kvmesh.v1.Conductor/Generate"
STATUS = "/kvmesh.v1.Conductor/ClusterStatus"
CLIENT_ERRORS = {
    grpc.StatusCode.INVALID_ARGUMENT,
    grpc.StatusCode.NOT_FOUND,  # a model the cluster does not serve
    grpc.StatusCode.RESOURCE_EXHAUSTED,
    grpc.StatusCode.UNAUTHENTICATED,
}
# a request that happens to be valid may also be served, or time out on our short deadline
SERVED = {grpc.StatusCode.OK, grpc.StatusCode.DEADLINE_EXCEEDED}
COUNTS: dict[str, int] = {}
FUZZ = settings(
    max_examples=EXAMPLES, deadline=None, derandomize=True, suppress_health_check=list(HealthCheck)
)


def _count(name: str) -> None:
    COUNTS[name] = COUNTS.get(name, 0) + 1


@pytest.fixture(scope="module")
def cluster(tmp_path_factory):
    c = LocalCluster(
        str(tmp_path_factory.mktemp("fuzz")),
        node_args=NODE_ARGS,
        conductor_args=["--api-keys", KEY],
        api_key=KEY,
        http_port=free_port(),
        # the tiny model's 1-token requests still get admitted under load
        lease_ttl=10,
    )
    c.start()
    try:
        yield c
    finally:
        print("\nfuzz cases per call:", json.dumps(COUNTS, sort_keys=True))
        c.stop()


@pytest.fixture(scope="module")
def channel(cluster):
    ch = grpc.insecure_channel(
        cluster.conductor, options=[("grpc.max_send_message_length", 80 << 20)]
    )
    yield ch
    ch.close()


TRACE = re.compile(r"Traceback \(most recent call last\)")
ABOVE_WARNING = re.compile(r" (ERROR|CRITICAL) ")


@pytest.fixture(scope="module")
def log_marks() -> dict[str, tuple[int, int]]:
    """Per service log: (byte offset, line number) up to which it has been checked."""
    return {}


def _new_bad_lines(workdir: str, marks: dict[str, tuple[int, int]]) -> list[str]:
    """Complete lines logged since the last check (the first check reads from the start,
    so startup is covered too) that are above WARNING or start a stack trace."""
    bad = []
    for f in sorted(os.listdir(workdir)):
        if not f.endswith(".log") or f == "etcd.log":
            continue
        offset, line_no = marks.get(f, (0, 0))
        with open(os.path.join(workdir, f), "rb") as fh:
            fh.seek(offset)
            data = fh.read()
        data = data[: data.rfind(b"\n") + 1]  # a line still being written waits
        for line in data.decode(errors="replace").split("\n")[:-1]:
            line_no += 1
            if TRACE.search(line) or ABOVE_WARNING.search(line):
                bad.append(f"{f}:{line_no}: {line.rstrip()[:300]}")
        marks[f] = (offset + len(data), line_no)
    return bad


@pytest.fixture(autouse=True)
def everyone_alive_and_logs_clean(cluster, channel, log_marks):
    """After every test: nobody died, the cluster still serves, and nothing above
    WARNING or with a stack trace was logged meanwhile."""
    yield
    for name, p in cluster.procs.items():
        assert p.poll() is None, f"{name} died with {p.returncode}"
    req = pb.GenerateRequest(prompt="still alive after the fuzzing?", max_tokens=2)
    assert _call(channel, GENERATE, req.SerializeToString(), timeout=60) == grpc.StatusCode.OK
    bad = _new_bad_lines(cluster.workdir, log_marks)
    assert not bad, "\n".join(bad[:40])


def _raw(channel, method: str, stream: bool):
    ident = lambda b: b  # noqa: E731
    if stream:
        return channel.unary_stream(method, request_serializer=ident, response_deserializer=ident)
    return channel.unary_unary(method, request_serializer=ident, response_deserializer=ident)


def _call(
    channel, method: str, payload: bytes, metadata=None, timeout: float = 10
) -> grpc.StatusCode:
    md = bearer_metadata(KEY) if metadata is None else metadata
    try:
        if method == GENERATE:
            for _ in _raw(channel, method, True)(payload, timeout=timeout, metadata=md):
                pass
        else:
            _raw(channel, method, False)(payload, timeout=timeout, metadata=md)
    except grpc.RpcError as e:
        return e.code()
    return grpc.StatusCode.OK


# ------------------------------------------------------------------ protobuf by hand


def _varint(n: int) -> bytes:
    n &= (1 << 64) - 1
    out = bytearray()
    while True:
        b = n & 0x7F
        n >>= 7
        if n:
            out.append(b | 0x80)
        else:
            out.append(b)
            return bytes(out)


def _field(num: int, wire: int, payload: bytes | int) -> bytes:
    key = _varint((num << 3) | wire)
    if wire == 0:
        return key + _varint(int(payload))
    if wire == 2:
        return key + _varint(len(payload)) + payload
    if wire == 5:
        return key + bytes(payload)[:4].ljust(4, b"\0")
    return key + bytes(payload)[:8].ljust(8, b"\0")


raw_fields = st.lists(
    st.tuples(
        st.integers(1, 12),  # known and unknown field numbers of GenerateRequest
        st.sampled_from([0, 1, 2, 5]),  # every wire type, mostly the wrong one for the field
        st.one_of(st.integers(-(2**63), 2**64 - 1), st.binary(max_size=64)),
    ),
    max_size=8,
)


def _encode(fields) -> bytes:
    out = b""
    for num, wire, val in fields:
        if wire == 0:
            out += _field(num, 0, val if isinstance(val, int) else len(val))
        else:
            out += _field(num, wire, val if isinstance(val, bytes) else str(val).encode())
    return out


# ------------------------------------------------------------------ strategies

texts = st.one_of(
    st.text(max_size=200),
    st.just(""),
    st.just("   "),
    st.text(alphabet=st.characters(codec="utf-8"), min_size=1, max_size=50),
)
ints32 = st.one_of(
    st.integers(-(2**31), 2**31 - 1),
    st.integers(-3, 5),
    st.sampled_from([0, 1, 255, 256, 257, 2**31 - 1]),
)
floats = st.one_of(
    st.floats(allow_nan=True, allow_infinity=True, width=32),
    st.sampled_from([0.0, -1.0, 1.0, 2.0, 1e30]),
)


@st.composite
def generate_requests(draw) -> pb.GenerateRequest:
    req = pb.GenerateRequest(
        model=draw(st.one_of(st.just(""), st.just("tiny"), texts)),
        prompt=draw(texts),
        max_tokens=draw(st.one_of(ints32, st.integers(1, 3))),
        cache_salt=draw(st.one_of(st.just(""), texts)),
        request_id=draw(st.one_of(st.just(""), texts)),
    )
    if draw(st.booleans()):
        req.token_ids.extend(draw(st.lists(ints32, max_size=40)))
    s = req.sampling
    s.temperature, s.top_p = draw(floats), draw(floats)
    s.top_k = draw(ints32)
    s.seed = draw(st.integers(0, 2**64 - 1))
    s.ignore_eos = draw(st.booleans())
    s.stop_token_ids.extend(draw(st.lists(ints32, max_size=3)))
    s.stop.extend(draw(st.lists(texts, max_size=3)))
    s.logprobs = draw(st.booleans())
    s.presence_penalty, s.frequency_penalty = draw(floats), draw(floats)
    s.repetition_penalty, s.min_p = draw(floats), draw(floats)
    for t, b in draw(st.dictionaries(ints32, floats, max_size=3)).items():
        s.logit_bias[t] = b
    s.min_tokens = draw(st.integers(0, 2**32 - 1))
    req.slo.ttft_ms, req.slo.tbt_ms = draw(floats), draw(floats)
    return req


# ------------------------------------------------------------------ gRPC


@FUZZ
@given(req=generate_requests())
def test_fuzz_generate_fields(cluster, channel, req):
    _count("grpc Generate (typed fields)")
    # a valid request may run: keep it short
    if req.max_tokens > 4 and not req.token_ids and len(req.prompt) < 100:
        req.max_tokens = req.max_tokens % 5
    code = _call(channel, GENERATE, req.SerializeToString(), timeout=20)
    assert code in CLIENT_ERRORS | SERVED, code


@FUZZ
@given(fields=raw_fields, cut=st.integers(0, 64), garble=st.binary(max_size=16))
def test_fuzz_generate_raw_bytes(cluster, channel, fields, cut, garble):
    """Hand-built frames: wrong wire types, non-UTF-8 strings, unknown fields, truncated."""
    _count("grpc Generate (raw bytes)")
    payload = _encode(fields)
    variants = [
        payload,
        payload[: max(0, len(payload) - cut)],
        garble + payload,
        # prompt (field 2) and model (field 1) with invalid UTF-8
        _field(2, 2, b"\xff\xfe hi \xc3") + _field(4, 0, 2),
        _field(1, 2, b"\x80") + _field(2, 2, b"ok"),
    ]
    for p in variants:
        code = _call(channel, GENERATE, p, timeout=20)
        assert code in CLIENT_ERRORS | SERVED, (code, p)


@FUZZ
@given(
    payload=st.binary(max_size=128),
    auth=st.one_of(
        st.none(),
        st.just(""),
        st.text(alphabet=st.characters(min_codepoint=32, max_codepoint=126), max_size=40),
    ),
)
def test_fuzz_cluster_status_and_auth(cluster, channel, payload, auth):
    _count("grpc ClusterStatus (raw bytes, keys)")
    code = _call(channel, STATUS, payload)
    assert code in {grpc.StatusCode.OK, grpc.StatusCode.INVALID_ARGUMENT}, code
    md = () if auth is None else (("authorization", auth),)
    code = _call(channel, STATUS, b"", metadata=md)
    expect_ok = (
        auth is not None
        and auth.strip().lower().startswith("bearer")
        and auth.split(None, 1)[-1].strip() == KEY
    )
    assert code == (grpc.StatusCode.OK if expect_ok else grpc.StatusCode.UNAUTHENTICATED)
    code = _call(channel, GENERATE, payload, metadata=md)
    assert code in CLIENT_ERRORS | SERVED


def test_oversized_messages(cluster, channel):
    _count("grpc oversized")
    # beyond the server's 64 MiB receive limit: refused by gRPC itself
    code = _call(channel, GENERATE, _field(2, 2, b"a" * (65 << 20)), timeout=60)
    assert code == grpc.StatusCode.RESOURCE_EXHAUSTED
    # a 4 MiB prompt: refused by the context check, never tokenized into work
    req = pb.GenerateRequest(prompt="x" * (4 << 20), max_tokens=1)
    assert (
        _call(channel, GENERATE, req.SerializeToString(), timeout=60)
        == grpc.StatusCode.INVALID_ARGUMENT
    )
    req = pb.GenerateRequest(token_ids=[1] * 200_000, max_tokens=1)
    assert (
        _call(channel, GENERATE, req.SerializeToString(), timeout=60)
        == grpc.StatusCode.INVALID_ARGUMENT
    )


# ------------------------------------------------------------------ HTTP

# integers beyond every wire type (int32, uint32, int64, uint64) and strings holding lone
# surrogates (legal JSON escapes, not UTF-8): each was a 500 once
huge_ints = st.sampled_from([2**31, 2**32, 2**40, 2**63, 2**64, 2**70, 10**20, -(2**63) - 1])
surrogates = st.text(alphabet=st.characters(categories=["Cs"]), min_size=1, max_size=3)
json_values = st.recursive(
    st.none()
    | st.booleans()
    | st.integers(-(2**70), 2**70)
    | huge_ints
    | st.floats(allow_nan=False)
    | st.text(max_size=40)
    | st.builds(lambda a, b: a + b, st.text(max_size=10), surrogates),
    lambda inner: (
        st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=10), inner, max_size=4)
    ),
    max_leaves=12,
)
KNOWN = [
    "model",
    "prompt",
    "messages",
    "max_tokens",
    "max_completion_tokens",
    "temperature",
    "top_p",
    "top_k",
    "seed",
    "stop",
    "stream",
    "stream_options",
    "n",
    "best_of",
    "logprobs",
    "echo",
    "ignore_eos",
    "cache_salt",
    "request_id",
    "ttft_slo_ms",
    "tbt_slo_ms",
    "user",
    "tools",
    "tool_choice",
    "response_format",
    "presence_penalty",
    "frequency_penalty",
    "repetition_penalty",
    "min_p",
    "logit_bias",
    "stop_token_ids",
    "min_tokens",
    "top_logprobs",
    "no_such_field",
]


@st.composite
def http_bodies(draw) -> bytes:
    kind = draw(st.sampled_from(["fields", "json", "bytes", "truncated", "nested", "huge"]))
    if kind == "bytes":
        return draw(st.binary(max_size=200))
    if kind == "nested":  # deeper than any parser's recursion, inside a field or bare
        depth = draw(st.sampled_from([2_000, 100_000]))
        nest = draw(st.sampled_from(["[", '{"a":']))
        head = draw(st.sampled_from([b"", b'{"prompt": "hi", "messages": ']))
        return head + nest.encode() * depth
    body = draw(st.dictionaries(st.sampled_from(KNOWN), json_values, max_size=8))
    if kind == "huge":  # a known integer field far past its wire type
        field = draw(st.sampled_from(["max_tokens", "top_k", "seed", "n", "ttft_slo_ms"]))
        body[field] = draw(huge_ints)
        body.setdefault("prompt", draw(st.one_of(st.text(max_size=20), st.lists(huge_ints))))
    if kind == "fields" and draw(st.booleans()):
        body.setdefault("prompt", draw(st.one_of(st.text(max_size=50), surrogates)))
        body["max_tokens"] = draw(st.integers(-5, 3))
    if kind == "json":
        body = draw(json_values)
    raw = json.dumps(body).encode()
    if kind == "truncated":
        raw = raw[: draw(st.integers(0, max(0, len(raw) - 1)))]
    return raw


def _post(port: int, path: str, body: bytes, headers=None) -> int:
    req = urllib.request.Request(
        f"http://127.0.0.1:{port}{path}",
        body,
        {"Content-Type": "application/json", "Authorization": f"Bearer {KEY}", **(headers or {})},
    )
    try:
        with urllib.request.urlopen(req, timeout=30) as r:
            r.read()
            return r.status
    except urllib.error.HTTPError as e:
        e.read()
        return e.code


@FUZZ
@given(body=http_bodies(), chat=st.booleans())
def test_fuzz_http(cluster, body, chat):
    _count("http " + ("/v1/chat/completions" if chat else "/v1/completions"))
    path = "/v1/chat/completions" if chat else "/v1/completions"
    try:
        parsed = json.loads(body)
    except (ValueError, RecursionError):
        parsed = None
    if isinstance(parsed, dict):  # a valid request may run: keep it short
        for k in ("max_tokens", "max_completion_tokens"):
            v = parsed.get(k)
            if isinstance(v, int) and not isinstance(v, bool) and 3 < v < 2**31:
                parsed[k] = 3  # (values past int32 stay: they must be refused)
        parsed.setdefault("max_tokens", 3)
        parsed.setdefault("max_completion_tokens", parsed["max_tokens"])
        body = json.dumps(parsed).encode()
    code = _post(cluster.http_port, path, body)
    assert code in (200, 400, 401, 404, 413, 429), (code, body[:200])


@FUZZ
@given(
    body=http_bodies(),
    lie=st.one_of(st.integers(-64, -1), st.integers(1, 64), st.sampled_from([2**31, 2**70])),
)
def test_fuzz_http_lying_content_length(cluster, body, lie):
    """A Content-Length that says more (the client then stops sending) or less than the
    body holds, or more than any body may: a clean 4xx, or the connection closed."""
    _count("http lying Content-Length")
    declared = max(0, len(body) + lie)
    head = (
        f"POST /v1/completions HTTP/1.1\r\nHost: 127.0.0.1\r\n"
        f"Content-Type: application/json\r\nAuthorization: Bearer {KEY}\r\n"
        f"Content-Length: {declared}\r\n\r\n"
    ).encode()
    with socket.create_connection(("127.0.0.1", cluster.http_port), timeout=30) as s:
        s.settimeout(30)
        try:
            s.sendall(head + body)
            s.shutdown(socket.SHUT_WR)
            answer = b""
            while len(answer) < 1 << 16:
                chunk = s.recv(4096)
                if not chunk:
                    break
                answer += chunk
        except OSError:
            return  # reset: the server dropped the connection
    for status in re.findall(rb"HTTP/1\.1 (\d{3})", answer):
        assert int(status) < 500 or int(status) == 503, answer[:300]


def test_http_oversized_and_unauthenticated(cluster):
    _count("http oversized/auth")
    assert _post(cluster.http_port, "/v1/completions", b"{" + b" " * (17 << 20)) == 413
    assert _post(cluster.http_port, "/v1/completions", b"\xff\xfe\x00garbage") == 400
    assert _post(cluster.http_port, "/v1/completions", b"{}", {"Authorization": "Bearer x"}) == 401


# ------------------------------------------------------------------ data plane


@FUZZ
@given(data=st.lists(st.binary(max_size=300), min_size=1, max_size=4))
def test_fuzz_data_plane_handshake(cluster, data):
    _count("data-plane handshake")
    addr = next(n.data_address for n in cluster.status(timeout=5).nodes if n.role == "decode")
    host, port = addr.rsplit(":", 1)
    with socket.create_connection((host, int(port)), timeout=5) as s:
        s.settimeout(2)
        try:
            s.recv(64)  # the server's hello
            for chunk in data:
                s.sendall(chunk)
            # then EOF, as the close after a 2 s wait did: the server reads a short
            # handshake to its end at once instead of the client idling out each case
            s.shutdown(socket.SHUT_WR)
            s.recv(100)
        except OSError:
            pass  # the server may close or reset at once: that is the point


# ------------------------------------------------------------------ store control path


@pytest.fixture(scope="module")
def store_fast(cluster):
    """The store-master's raw-TCP control path (advertised in StoreHello)."""
    from kvmesh.protos import kvmesh_pb2_grpc as pbg

    addr = next(n.grpc_address for n in cluster.status(timeout=5).nodes if n.role == "store-master")
    with grpc.insecure_channel(addr) as ch:
        hello = pbg.StoreMasterStub(ch).StoreHello(pb.StoreHelloRequest(), timeout=10)
    assert hello.fast_address
    host, port = hello.fast_address.rsplit(":", 1)
    return host, int(port)


@FUZZ
@given(
    method=st.integers(0, 255),
    body=st.binary(max_size=600),
    declared=st.one_of(st.none(), st.integers(0, (1 << 32) - 1)),
    cut=st.integers(0, 8),
)
def test_fuzz_store_control_path(store_fast, method, body, declared, cut):
    """Any frame - garbage bodies for every method byte, lying lengths, truncation - gets
    a clean status or a closed connection; the master then still answers a valid call."""
    import struct

    from kvmesh.services.store_master import wire

    _count("store control path")
    n = len(body) if declared is None else declared
    frame = wire.HEAD.pack(n, 7, method) + body
    with socket.create_connection(store_fast, timeout=5) as s:
        s.settimeout(2)
        try:
            s.sendall(frame[: len(frame) - cut] if cut < len(frame) else frame)
            if declared is None and cut == 0:
                head = s.recv(wire.HEAD_SIZE, socket.MSG_WAITALL)
                if len(head) == wire.HEAD_SIZE:
                    _, rid, status = wire.HEAD.unpack(head)
                    assert rid == 7
                    assert status in (
                        0,
                        grpc.StatusCode.INVALID_ARGUMENT.value[0],
                        grpc.StatusCode.UNIMPLEMENTED.value[0],
                        grpc.StatusCode.NOT_FOUND.value[0],
                        grpc.StatusCode.FAILED_PRECONDITION.value[0],
                    ), status
        except OSError:
            pass  # the master may close a connection that lies about lengths
    with socket.create_connection(store_fast, timeout=5) as s:
        s.settimeout(5)
        probe = wire.pack_exists([b"k" * 16], True)
        s.sendall(wire.HEAD.pack(len(probe), 9, wire.EXISTS) + probe)
        n, rid, status = wire.HEAD.unpack(s.recv(wire.HEAD_SIZE, socket.MSG_WAITALL))
        assert (rid, status) == (9, 0)
        assert struct.unpack("<I", s.recv(4, socket.MSG_WAITALL))[0] == 0
