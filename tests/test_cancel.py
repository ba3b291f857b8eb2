"""A client that goes away frees the decode node's KV at once, at every stage of its
request: queued on the prefill node, prefilling, transferring its KV, decoding.

A real cluster (etcd, services in their own processes, the tiny model, disaggregated
route). The prefill node holds a request at a chosen stage through its test-only hook
(``KVMESH_TEST_HOLD_PREFILL``, off unless set), so each stage is reached
deterministically; the client then cancels its call, and the decode node's free KV blocks
(its Status) must come back to where they were. The decode node's fence (how long a
released reservation sits out whatever its prefill node might still write) is an hour
here, so only an explicit release can pass."""

from __future__ import annotations

import os
import time
import uuid

import grpc
import pytest

from kvmesh.protos import kvmesh_pb2 as pb
from kvmesh.protos import kvmesh_pb2_grpc as pbg
from kvmesh.services.launcher import LocalCluster
from tests.cluster_util import DISAGG_ONLY, NODE_ARGS, generate, node, start_with_hold_hook

_LETTERS = "".join(chr(97 + i % 26) for i in range(2992))


def long_prompt() -> str:
    """3,001 tokens (188 blocks of 16), none of them cached anywhere: each prompt starts
    with its own 8 characters, so the cluster cannot serve it from a cached prefix (nor
    take the decode-direct route, which would not reach the prefill node)."""
    return uuid.uuid4().hex[:8] + _LETTERS


FREED_WITHIN_S = 30.0  # generous for a loaded machine; the fence below is an hour


@pytest.fixture(scope="module")
def hold_dir(tmp_path_factory):
    return str(tmp_path_factory.mktemp("hold"))


@pytest.fixture(scope="module")
def cluster(tmp_path_factory, hold_dir):
    c = LocalCluster(
        str(tmp_path_factory.mktemp("cluster")),
        node_args=NODE_ARGS,
        conductor_args=DISAGG_ONLY,
        # a fence the test outlives many times over: only an explicit release (the prefill
        # node's drop, or the reservation's own release) can free the blocks in time
        decode_args=["--fence-s", "3600"],
    )
    start_with_hold_hook(c, hold_dir)
    yield c
    c.stop()


class Hold:
    """The prefill node's test hook: which stage holds requests, and who is held."""

    def __init__(self, path: str) -> None:
        self.path = path

    @classmethod
    def cleared(cls, path: str) -> Hold:
        """The hook with nothing held and no stage set (what an earlier test left)."""
        for name in ("hold", "held"):
            try:
                os.remove(os.path.join(path, name))
            except FileNotFoundError:
                pass
        return cls(path)

    def at(self, stage: str) -> None:
        with open(os.path.join(self.path, "hold"), "w") as f:
            f.write(stage)

    def held(self) -> list[str]:
        try:
            with open(os.path.join(self.path, "held")) as f:
                return f.read().split("\n")[:-1]
        except FileNotFoundError:
            return []

    def wait_held(self, n: int, call, timeout: float = 60) -> None:
        """Until ``n`` requests have been held, the last being ``call`` (still running)."""
        deadline = time.monotonic() + timeout
        while len(self.held()) < n:
            assert not call.done(), f"{call.code()}: {call.details()}"
            assert time.monotonic() < deadline, f"{len(self.held())} of {n} requests held"
            time.sleep(0.02)


@pytest.fixture
def hold(hold_dir):
    h = Hold.cleared(hold_dir)
    yield h
    h.at("")


def free_blocks(c: LocalCluster) -> int:
    return node(c.conductor, "decode-0").kv_blocks_free


def wait_free(c: LocalCluster, want: int, within: float = FREED_WITHIN_S) -> int:
    """Polls the decode node's free blocks until they are ``want`` (bounded)."""
    deadline = time.monotonic() + within
    got = free_blocks(c)
    while got != want and time.monotonic() < deadline:
        time.sleep(0.05)
        got = free_blocks(c)
    return got


def wait_until(pred, timeout: float = 30) -> None:
    deadline = time.monotonic() + timeout
    while not pred():
        assert time.monotonic() < deadline, "condition not reached"
        time.sleep(0.02)


def start(channel: grpc.Channel, max_tokens: int = 8, **kw):
    """A Generate call of a long prompt running in the background (cancel() ends it, as a
    client would)."""
    req = pb.GenerateRequest(prompt=long_prompt(), max_tokens=max_tokens, **kw)
    return pbg.ConductorStub(channel).Generate(req, timeout=120)


def test_cancel_while_prefilling_and_while_queued_frees_the_reservation(cluster, hold):
    before = free_blocks(cluster)
    hold.at("prefilling")
    with grpc.insecure_channel(cluster.conductor) as ch:
        a = start(ch)  # holds the prefill node's compute slot
        hold.wait_held(1, a)
        with_a = free_blocks(cluster)
        assert with_a < before  # a's reservation on the decode node
        b = start(ch)  # waits behind a: queued
        wait_until(lambda: node(cluster.conductor, "prefill-0").queue_depth == 1)
        assert free_blocks(cluster) < with_a
        b.cancel()
        assert wait_free(cluster, with_a) == with_a  # queued: b's blocks are back
        a.cancel()
        assert wait_free(cluster, before) == before  # prefilling: a's too
        with pytest.raises(grpc.RpcError) as e:
            next(a)
        assert e.value.code() == grpc.StatusCode.CANCELLED


def test_cancel_while_transferring_frees_the_reservation(cluster, hold):
    before = free_blocks(cluster)
    hold.at("transferring")  # every layer's KV write issued, not yet marked complete
    with grpc.insecure_channel(cluster.conductor) as ch:
        a = start(ch)
        hold.wait_held(1, a)
        assert free_blocks(cluster) < before
        a.cancel()
        assert wait_free(cluster, before) == before


def test_cancel_while_decoding_frees_the_blocks(cluster, hold):
    before = free_blocks(cluster)
    with grpc.insecure_channel(cluster.conductor) as ch:
        a = start(ch, max_tokens=1000, sampling=pb.SamplingParams(ignore_eos=True))
        first = next(a)  # the first token: the request is decoding now
        assert first.token_ids
        a.cancel()
    assert wait_free(cluster, before) == before


def test_start_cancel_loop_leaves_room_for_others(cluster, hold):
    """More start+cancel rounds of long prompts than the decode node's KV holds at once:
    none is refused, the KV comes back, and another client's long prompt is served."""
    before = free_blocks(cluster)
    total = node(cluster.conductor, "decode-0").kv_blocks_total
    rounds = total // 188 + 3
    hold.at("prefilling")
    with grpc.insecure_channel(cluster.conductor) as ch:
        for i in range(rounds):
            call = start(ch)
            hold.wait_held(i + 1, call)  # a refused round would never be held
            call.cancel()
    assert wait_free(cluster, before) == before
    hold.at("")
    got = generate(cluster.conductor, long_prompt(), max_tokens=4)
    assert got.finish_reason == "length" and len(got.tokens) == 4


def test_a_request_id_in_flight_is_already_exists_and_free_again_once_it_ends(cluster, hold):
    """Issue 18 item 9: a colliding request_id was refused with UNAVAILABLE "retry" (the
    decode node's reservation clashed); now ALREADY_EXISTS at once, and the id is free
    again when the first request ends."""
    hold.at("prefilling")
    with grpc.insecure_channel(cluster.conductor) as ch:
        a = start(ch, request_id="same-id")
        hold.wait_held(1, a)
        with pytest.raises(grpc.RpcError) as e:
            generate(cluster.conductor, "hello", max_tokens=2, request_id="same-id")
        assert e.value.code() == grpc.StatusCode.ALREADY_EXISTS, e.value.details()
        assert "same-id" in e.value.details() and "in flight" in e.value.details()
        a.cancel()
    hold.at("")
    deadline = time.monotonic() + 10
    while True:  # the conductor sees the cancellation a moment after the client
        try:
            got = generate(cluster.conductor, "hello", max_tokens=2, request_id="same-id")
            break
        except grpc.RpcError as err:
            assert err.code() == grpc.StatusCode.ALREADY_EXISTS
            assert time.monotonic() < deadline
            time.sleep(0.05)
    assert got.finish_reason == "length"


def test_an_http_client_that_closes_a_non_streamed_completion_frees_the_reservation(cluster, hold):
    """A non-streamed completion runs in the handler until its last token; a client that
    closes its connection must cancel it (the handler is cancelled), not let it run on
    holding decode KV."""
    import json
    import socket

    before = free_blocks(cluster)
    hold.at("prefilling")
    body = json.dumps({"prompt": long_prompt(), "max_tokens": 8}).encode()
    head = (
        f"POST /v1/completions HTTP/1.1\r\nHost: 127.0.0.1\r\n"
        f"Content-Type: application/json\r\nContent-Length: {len(body)}\r\n\r\n"
    ).encode()
    with socket.create_connection(("127.0.0.1", cluster.http_port), timeout=30) as s:
        s.sendall(head + body)
        wait_until(lambda: len(hold.held()) >= 1, timeout=60)
        assert free_blocks(cluster) < before
    # the socket is closed
    assert wait_free(cluster, before) == before


def test_a_queued_request_that_can_no_longer_meet_its_ttft_slo_is_refused_before_any_work(
    cluster, hold
):
    """Admission accepted b on an estimate; then the request ahead of it (a, held here)
    ran far longer than estimated. Rather than compute b late, the prefill node refuses it
    while it waits: RESOURCE_EXHAUSTED with reason ``deadline``, before a ends, with none of
    b's tokens computed and its reservation freed; a itself is served in full."""
    before = free_blocks(cluster)
    computed = node(cluster.conductor, "prefill-0").computed_tokens_total
    hold.at("prefilling")
    with grpc.insecure_channel(cluster.conductor) as ch:
        a = start(ch, max_tokens=2)  # holds the compute slot
        hold.wait_held(1, a)
        with_a = free_blocks(cluster)
        # a short prompt, so admission's estimate (a's remaining time, then b's) fits
        b = pbg.ConductorStub(ch).Generate(
            pb.GenerateRequest(prompt=long_prompt()[:300], max_tokens=2, slo=pb.SLO(ttft_ms=5000)),
            timeout=120,
        )
        with pytest.raises(grpc.RpcError) as e:
            next(b)
        err = e.value
        assert err.code() == grpc.StatusCode.RESOURCE_EXHAUSTED, err.details()
        assert dict(err.trailing_metadata())["kvmesh-reject-reason"] == "deadline"
        assert "TTFT SLO of 5000 ms" in err.details() and "before any work" in err.details()
        assert not a.done() and len(hold.held()) == 1  # b never reached the compute
        assert wait_free(cluster, with_a) == with_a  # b's reservation is back
        hold.at("")
        got = list(a)
    assert sum(len(r.token_ids) for r in got) == 2
    assert wait_free(cluster, before) == before
    # only a's 3,001 prompt tokens were computed
    assert node(cluster.conductor, "prefill-0").computed_tokens_total - computed == 3001
