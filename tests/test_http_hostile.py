"""The conductor's HTTP API under hostile bodies (issue 34, findings 1 and 2, and the
keep-alive idle timeout), on a real cluster over real sockets: a live stream's token gaps
stay within the issue's bound - 100 ms, or 5x the same stream's worst gap just before -
while a 15.6 MB body of 7.8 million token ids, an object of a million keys, or three
gzip bombs (1 MB, inflating to 1 GiB each) to paths that answer 401, 404 and 405 are
sent. On the code before, the conductor parsed the JSON on its event loop (gaps of
0.4-1.5 s) and inflated the unread bombs after its replies (seconds of CPU).

Also: compressed bodies are inflated when read, up to the limit (413 past it, 415 for an
encoding that is not supported); a reply that leaves the body unread closes the
connection; an idle connection is closed after ``--http-idle-timeout-s``."""

from __future__ import annotations

import gzip
import http.client
import json
import socket
import time
import zlib

import pytest

from kvmesh.loadtest.hostile_body import KINDS, gzip_bomb, measure
from kvmesh.services.launcher import LocalCluster
from tests.cluster_util import NODE_ARGS
from tests.etcd_server import free_port

pytestmark = pytest.mark.timeout(240)

KEY = "hostile-body-test-key"
IDLE_S = 1.0


@pytest.fixture(scope="module")
def api(tmp_path_factory):
    port = free_port()
    cluster = LocalCluster(
        str(tmp_path_factory.mktemp("hostile")),
        node_args=NODE_ARGS,
        http_port=port,
        api_key=KEY,
        conductor_args=["--api-keys", KEY, "--http-idle-timeout-s", str(IDLE_S)],
    )
    try:
        cluster.start()
        yield cluster, f"127.0.0.1:{port}"
    finally:
        cluster.stop()


@pytest.mark.parametrize("kind", KINDS)
def test_a_live_streams_token_gaps_stay_bounded_under_hostile_bodies(api, kind):
    cluster, addr = api
    res = measure(addr, kind, KEY, pid=cluster.procs["conductor-0"].pid)
    print(json.dumps(res))
    assert res["gaps_counted"] >= 5 and res["stream_ran_through"], res
    assert res["worst_gap_s"] <= res["bound_s"], res
    # and the work they cost the conductor is bounded (CPU time: robust to a busy machine)
    assert res["cpu_s_extra"] < 0.3, res
    if kind == "int-array":  # refused unparsed, saying what to fix
        (reply,) = res["replies"]
        assert reply.startswith("400: the request body holds 7800001 JSON values"), reply
        assert "context, 4096 tokens" in reply, reply
    elif kind == "many-keys":
        (reply,) = res["replies"]
        assert reply.startswith("400: the request body holds 1000000 JSON strings"), reply
    else:  # answered without reading the body, or the connection closed unread
        codes = [r.split(":")[0] for r in res["replies"]]
        assert all(c in ("401", "404", "405") or c.startswith("closed") for c in codes), res
        # three 1 GiB inflations cost the old code seconds of CPU; unread, they cost none


def _post(addr: str, body: bytes, headers: dict[str, str], path: str = "/v1/completions"):
    host, port = addr.rsplit(":", 1)
    conn = http.client.HTTPConnection(host, int(port), timeout=60)
    try:
        conn.request("POST", path, body, {"Authorization": f"Bearer {KEY}", **headers})
        r = conn.getresponse()
        return r.status, json.loads(r.read())
    finally:
        conn.close()


def test_compressed_bodies_are_inflated_up_to_the_limit(api):
    _, addr = api
    req = json.dumps({"prompt": "Once upon a time", "max_tokens": 3, "temperature": 0}).encode()
    z = zlib.compressobj(wbits=-zlib.MAX_WBITS)  # raw deflate, as some clients send it
    for enc, data in (
        ("gzip", gzip.compress(req)),
        ("deflate", zlib.compress(req)),
        ("deflate", z.compress(req) + z.flush()),
    ):
        code, out = _post(addr, data, {"Content-Encoding": enc})
        assert code == 200 and len(out["choices"][0]["token_ids"]) == 3, (enc, out)
    # a bomb to a path that reads its body: inflated up to the limit, then refused
    t = time.perf_counter()
    code, out = _post(addr, gzip_bomb(64 << 20), {"Content-Encoding": "gzip"})
    assert code == 413 and "inflates (gzip) past the 16 MiB limit" in out["error"]["message"]
    assert time.perf_counter() - t < 10
    code, out = _post(addr, b"not gzip", {"Content-Encoding": "gzip"})
    assert code == 400 and "not valid gzip" in out["error"]["message"], out
    code, out = _post(addr, req, {"Content-Encoding": "br"})
    assert code == 415 and "gzip or deflate" in out["error"]["message"], out
    code, out = _post(addr, b"{" + b'"k": 1,' * 2000 + b'"k": 1}', {})
    assert code == 400 and "2001 keys; at most 1024" in out["error"]["message"], out
    # a 404 leaves its body unread (here: not even all sent): the reply says the
    # connection closes, and it does, with no wait for (or inflation of) the rest
    bomb = gzip_bomb()
    host, port = addr.rsplit(":", 1)
    with socket.create_connection((host, int(port)), timeout=30) as s:
        s.sendall(
            b"POST /v1/x HTTP/1.1\r\nHost: x\r\nContent-Encoding: gzip\r\n"
            b"Content-Length: %d\r\n\r\n" % len(bomb) + bomb[: 256 << 10]
        )
        reply = b""
        try:
            while chunk := s.recv(65536):
                reply += chunk
        except ConnectionResetError:
            pass
    assert reply.startswith(b"HTTP/1.1 404"), reply[:200]
    assert b"\r\nConnection: close\r\n" in reply, reply[:400]


def test_idle_connections_are_closed_after_the_idle_timeout(api):
    _, addr = api
    host, port = addr.rsplit(":", 1)
    with socket.create_connection((host, int(port)), timeout=30) as s:
        t = time.perf_counter()
        s.sendall(b"GET /health HTTP/1.1\r\nHost: x\r\n")  # headers never finished
        assert s.recv(1024) == b""
        waited = time.perf_counter() - t
    assert IDLE_S * 0.8 <= waited < IDLE_S + 2, waited
    with socket.create_connection((host, int(port)), timeout=30) as s:
        s.sendall(b"GET /health HTTP/1.1\r\nHost: x\r\n\r\n")
        assert s.recv(4096).startswith(b"HTTP/1.1 200")
        t = time.perf_counter()  # kept alive after the reply, then closed once idle
        assert s.recv(1024) == b""
        waited = time.perf_counter() - t
    assert IDLE_S * 0.8 <= waited < IDLE_S + 2, waited
