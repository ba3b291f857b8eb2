"""Per-request and per-client limits, and the conductor's graceful drain on SIGTERM: an
in-flight stream finishes with all its tokens; nothing is cut without a status."""

from __future__ import annotations

import signal
import threading

import grpc
import pytest

from kvmesh.protos import kvmesh_pb2 as pb
from kvmesh.protos import kvmesh_pb2_grpc as pbg
from kvmesh.services.launcher import LocalCluster
from tests.cluster_util import NODE_ARGS, Result, generate

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


class Stream(threading.Thread):
    """One Generate streamed in a thread; ``running`` is set once its first token has
    arrived (the conductor holds the stream open then), or once the call has ended."""

    def __init__(self, conductor: str, prompt: str, **kw) -> None:
        super().__init__(daemon=True)
        self.conductor, self.req = conductor, pb.GenerateRequest(prompt=prompt, **kw)
        self.running = threading.Event()
        self.result = Result()
        self.error: grpc.RpcError | None = None

    def run(self) -> None:
        try:
            with grpc.insecure_channel(self.conductor) as ch:
                for r in pbg.ConductorStub(ch).Generate(self.req, timeout=60):
                    self.result.tokens.extend(r.token_ids)
                    if r.token_ids:
                        self.running.set()
                    if r.finish_reason:
                        self.result.finish_reason = r.finish_reason
        except grpc.RpcError as e:
            self.error = e
        finally:
            self.running.set()

    def wait_running(self, timeout: float = 30) -> None:
        assert self.running.wait(timeout), f"no token within {timeout}s"
        assert self.error is None, self.error.details()


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

    streams = [Stream(cluster.conductor, f"stream {i}", **LONG) for i in range(2)]
    for s in streams:
        s.start()
    for s in streams:
        s.wait_running()
    with pytest.raises(grpc.RpcError) as e:  # a third stream of the same client
        generate(cluster.conductor, "one too many", **LONG)
    for s in streams:
        s.join(60)
    assert e.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
    assert "streams open (limit 2)" in e.value.details()
    assert [s.error for s in streams] == [None, None]
    assert [len(s.result.tokens) for s in streams] == [300, 300]
    assert generate(cluster.conductor, "after them", max_tokens=3).tokens  # slots freed


def test_sigterm_drains_in_flight_streams(cluster):
    """The stream outlasts the gRPC server's own stop grace (2 s): only the drain keeps it."""
    s = Stream(
        cluster.conductor,
        "draining",
        max_tokens=2000,
        sampling=pb.SamplingParams(ignore_eos=True),
    )
    s.start()
    s.wait_running()
    cluster.stop_process("conductor-0", signal.SIGTERM)
    s.join(60)
    assert s.error is None, s.error.details()
    assert len(s.result.tokens) == 2000 and s.result.finish_reason == "length"
