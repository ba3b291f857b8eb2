"""Per-request and per-client limits, and the conductor's graceful drain on SIGTERM: an
in-flight stream finishes with all its tokens; nothing is cut without a status."""

from __future__ import annotations

import signal
import threading
import time

import grpc
import pytest

from kvmesh.protos import kvmesh_pb2 as pb
from kvmesh.services.launcher import LocalCluster
from tests.cluster_util import NODE_ARGS, generate

LIMITS = [
    "--max-tokens-limit",
    "2000",
    "--max-prompt-tokens",
    "100",
    "--max-streams-per-client",
    "2",
    "--grace-s",
    "0.2",
]
LONG = dict(max_tokens=300, sampling=pb.SamplingParams(ignore_eos=True))


@pytest.fixture
def cluster(tmp_path):
    c = LocalCluster(str(tmp_path), node_args=NODE_ARGS, conductor_args=LIMITS, http_port=-1)
    c.start()
    yield c
    c.stop()


def test_request_bounds_and_stream_limit(cluster):
    for kw, fragment in [
        (dict(prompt="hi", max_tokens=2001), "allows at most 2000"),
        (dict(prompt="x" * 120, max_tokens=4), "accepts at most 100"),
    ]:
        with pytest.raises(grpc.RpcError) as e:
            generate(cluster.conductor, **kw)
        assert e.value.code() == grpc.StatusCode.INVALID_ARGUMENT
        assert fragment in e.value.details()

    results, errors = [], []

    def long_stream(i: int) -> None:
        try:
            results.append(generate(cluster.conductor, f"stream {i}", **LONG))
        except grpc.RpcError as e:
            errors.append(e)

    threads = [threading.Thread(target=long_stream, args=(i,)) for i in range(2)]
    for t in threads:
        t.start()
    time.sleep(0.3)
    with pytest.raises(grpc.RpcError) as e:  # a third stream of the same client
        generate(cluster.conductor, "one too many", **LONG)
    for t in threads:
        t.join(60)
    assert e.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
    assert "streams open (limit 2)" in e.value.details()
    assert not errors and [len(r.tokens) for r in results] == [300, 300]
    assert generate(cluster.conductor, "after them", max_tokens=3).tokens  # slots freed


def test_sigterm_drains_in_flight_streams(cluster):
    """The stream outlasts the gRPC server's own stop grace (2 s): only the drain keeps it."""
    got, errors = [], []

    def stream() -> None:
        try:
            got.append(
                generate(
                    cluster.conductor,
                    "draining",
                    max_tokens=2000,
                    sampling=pb.SamplingParams(ignore_eos=True),
                )
            )
        except grpc.RpcError as e:
            errors.append(e)

    t = threading.Thread(target=stream)
    t.start()
    time.sleep(0.3)  # the stream is running
    cluster.stop_process("conductor-0", signal.SIGTERM)
    t.join(60)
    assert not errors, errors[0].details()
    assert len(got[0].tokens) == 2000 and got[0].finish_reason == "length"
