"""Two conductors serving one cluster at once (issue 17, part 3): real etcd, real
services in real processes. Both serve token-exact (gRPC and the OpenAI face), and a
client given both addresses survives the SIGKILL of one, even with its request in flight
(held at the prefill node by the test hook) when the conductor dies."""

from __future__ import annotations

import asyncio
import io
import json
import os
import signal
import threading
import time
import urllib.request

import pytest

from kvmesh.protos import kvmesh_pb2 as pb
from kvmesh.services.client import conductor_addresses, stream_completion
from kvmesh.services.common.tokenizer import ByteTokenizer
from kvmesh.services.engine.model import LlamaModel
from kvmesh.services.launcher import LocalCluster
from tests.cluster_util import DISAGG_ONLY, NODE_ARGS, generate, start_with_hold_hook, status


@pytest.fixture(scope="module")
def expected():
    model, tok = LlamaModel.from_preset("tiny", seed=0), ByteTokenizer()
    return lambda p, n=8: tok.decode(model.reference_generate(tok.encode(p), n, eos_id=tok.eos_id))


@pytest.fixture(scope="module")
def hold_dir(tmp_path_factory):
    return str(tmp_path_factory.mktemp("hold"))


@pytest.fixture(scope="module")
def cluster(tmp_path_factory, hold_dir):
    c = LocalCluster(
        str(tmp_path_factory.mktemp("two")),
        prefill=1,
        decode=1,
        conductors=2,
        node_args=NODE_ARGS,
        conductor_args=DISAGG_ONLY,
    )
    start_with_hold_hook(c, hold_dir)
    try:
        yield c
    finally:
        c.stop()


def test_conductor_addresses():
    assert conductor_addresses(" a:1, b:2,") == ["a:1", "b:2"]
    assert conductor_addresses(["a:1"]) == ["a:1"]
    with pytest.raises(ValueError, match="HOST:PORT"):
        conductor_addresses(" , ")


def test_both_conductors_serve_token_exact(cluster, expected):
    a, b = cluster.conductors
    assert a != b
    for addr in (a, b):
        # each keeps its own view of the nodes from the same etcd and event streams
        deadline = time.monotonic() + 30
        while not {"prefill", "decode"} <= {n.role for n in status(addr).nodes}:
            assert time.monotonic() < deadline, f"{addr} does not see both nodes"
            time.sleep(0.1)
        for i in range(3):
            prompt = f"two conductors, {addr}, request {i}"
            r = generate(addr, prompt, max_tokens=8)
            assert r.text == expected(prompt)


def test_openai_face_on_each_conductor(cluster, expected):
    assert len(cluster.http_ports) == 2 and all(p > 0 for p in cluster.http_ports)
    for port in cluster.http_ports:
        prompt = f"openai face on {port}"
        body = json.dumps({"model": "tiny", "prompt": prompt, "max_tokens": 8, "temperature": 0})
        req = urllib.request.Request(
            f"http://127.0.0.1:{port}/v1/completions",
            data=body.encode(),
            headers={"Content-Type": "application/json"},
        )
        with urllib.request.urlopen(req, timeout=60) as resp:
            out = json.load(resp)
        assert out["choices"][0]["text"] == expected(prompt)


def test_client_survives_sigkill_of_its_conductor_mid_request(cluster, expected, hold_dir):
    """The request is held at the prefill node (accepted by conductor-0, no token back)
    when conductor-0 is SIGKILLed: the client's call fails UNAVAILABLE before any token,
    so it is sent again to conductor-1, which serves it exactly once."""
    a, b = cluster.conductors
    prompt = "survive the conductor's death"
    with open(os.path.join(hold_dir, "hold"), "w") as f:
        f.write("prefilling")
    out, err = io.StringIO(), io.StringIO()
    rc: list[int] = []
    req = pb.GenerateRequest(prompt=prompt, max_tokens=8)
    t = threading.Thread(
        target=lambda: rc.append(
            asyncio.run(stream_completion(f"{a},{b}", req, timeout=60, out=out, err=err))
        )
    )
    t.start()
    try:
        deadline = time.monotonic() + 60
        held = os.path.join(hold_dir, "held")
        while not (os.path.exists(held) and open(held).read().strip()):
            assert time.monotonic() < deadline, "the request never reached the prefill node"
            time.sleep(0.05)
    finally:
        os.unlink(os.path.join(hold_dir, "hold"))  # the retry goes through
    cluster.stop_process("conductor-0", signal.SIGKILL)
    t.join(90)
    assert not t.is_alive()
    assert rc == [0], err.getvalue()
    assert out.getvalue() == expected(prompt) + "\n"
    assert f"conductor {a}: UNAVAILABLE; retrying on {b}" in err.getvalue()
    # conductor-0 is gone: a client naming it first still gets served
    out2, err2 = io.StringIO(), io.StringIO()
    p2 = "after the kill"
    req2 = pb.GenerateRequest(prompt=p2, max_tokens=8)
    assert asyncio.run(stream_completion([a, b], req2, timeout=60, out=out2, err=err2)) == 0
    assert out2.getvalue() == expected(p2) + "\n"
