"""Warm-ups (conductor/warm.py, PrefillRequest.warm): a refused prompt that shares its
start with an earlier refused one, or that no node could compute in time, is computed
into the store by the idle prefill node, so that the next request sharing that prefix
is accepted and computes only its own tokens, and its tokens are still exactly the
single-process reference's."""

from __future__ import annotations

import random
import time
import urllib.request

import grpc
import pytest

from kvmesh.services.common.tokenizer import ByteTokenizer
from kvmesh.services.engine.model import LlamaModel
from kvmesh.services.launcher import LocalCluster
from tests.cluster_util import generate, node, status

NODE_ARGS = ["--block-size", "16", "--kv-memory", "32MiB", "--threads", "1"]
TOK = ByteTokenizer()


@pytest.fixture(scope="module")
def cluster(tmp_path_factory):
    c = LocalCluster(
        str(tmp_path_factory.mktemp("warm")),
        prefill=1,
        decode=1,
        node_args=NODE_ARGS,
        conductor_args=["--report-interval-ms", "50", "--colocate-below-tokens", "0"],
    )
    c.start()
    yield c
    c.stop()


def warms(cluster: LocalCluster, outcome: str) -> float:
    n = node(cluster.conductor, "prefill-0")
    text = urllib.request.urlopen(f"http://{n.metrics_address}/metrics", timeout=5).read()
    for line in text.decode().splitlines():
        if line.startswith(f'kvmesh_prefill_warms_total{{outcome="{outcome}"}}'):
            return float(line.rsplit(" ", 1)[1])
    return 0.0


def refused(cluster: LocalCluster, prompt: str, slo_ms: float) -> str:
    with pytest.raises(grpc.RpcError) as e:
        generate(cluster.conductor, prompt, max_tokens=4, slo={"ttft_ms": slo_ms})
    reason = dict(e.value.trailing_metadata() or ()).get("kvmesh-reject-reason", "")
    assert reason in ("ttft", "infeasible"), (e.value.code(), e.value.details())
    return reason


def test_a_refused_shared_prefix_is_warmed_for_the_next_request(cluster):
    rng = random.Random(11)
    text = lambda n: "".join(rng.choice("abcdefgh ijklmnop") for _ in range(n))  # noqa: E731
    # the time models learn this machine's speed from a few lone prompts
    alone = []
    for i in range(4):
        t0 = time.perf_counter()
        generate(cluster.conductor, text(1500), max_tokens=1, cache_salt=f"fit{i}")
        alone.append((time.perf_counter() - t0) * 1000)
    slo_ms = 0.4 * sorted(alone)[1]  # below a whole 1,500-token prompt, above its tail
    prefix = text(1440)
    prompts = [prefix + text(60) for _ in range(4)]
    done_before = warms(cluster, "done")
    computed_before = node(cluster.conductor, "prefill-0").computed_tokens_total

    # the first of the group: warmed on the idle prefill node if refused as infeasible,
    # else (refused for the load of the moment) once a second one with its start is
    if refused(cluster, prompts[0], slo_ms) == "ttft":
        time.sleep(1.0)
        assert warms(cluster, "done") == done_before  # nothing says its start is shared
        refused(cluster, prompts[1], slo_ms)
    deadline = time.monotonic() + 30
    while warms(cluster, "done") == done_before:
        assert time.monotonic() < deadline, "no warm-up done"
        time.sleep(0.1)
    # refusals still did no work a request asked for
    assert node(cluster.conductor, "prefill-0").computed_tokens_total == computed_before

    # the next one sharing the prefix is accepted and computes only what follows it
    deadline = time.monotonic() + 10
    while True:
        try:
            got = generate(cluster.conductor, prompts[2], max_tokens=8, slo={"ttft_ms": slo_ms})
            break
        except grpc.RpcError:  # (the index may not have heard of the blocks yet)
            assert time.monotonic() < deadline, "still refused after the warm-up"
            time.sleep(0.2)
    computed = node(cluster.conductor, "prefill-0").computed_tokens_total - computed_before
    assert 0 < computed <= len(TOK.encode(prompts[2])) - len(prefix) + 2 * 16, computed
    model = LlamaModel.from_preset("tiny", seed=0)
    ids = TOK.encode(prompts[2])
    assert got.tokens == model.reference_generate(ids, 8, eos_id=TOK.eos_id)
    assert any(n.role == "prefill" for n in status(cluster.conductor).nodes)


def test_which_refusals_are_warmed():
    """The rule alone (a unit test of logic): a prompt refused for load is warmed only
    once its start is shared (part of it cached, or a refused prompt began with it); one
    refused as infeasible at once; one all cached, or one already being warmed, never; at
    most one warm-up per idle prefill node."""
    from kvmesh.services.conductor.candidates import Candidate, Decision, Request
    from kvmesh.services.conductor.nodes import PrefillNodeState
    from kvmesh.services.conductor.policy import DISAGG, INFEASIBLE, Scheduler
    from kvmesh.services.conductor.warm import Warmer

    class Calls:
        def __init__(self):
            self.sent = []

        def spawn(self, coro):
            coro.close()  # (not run: no node to call)
            self.sent.append(coro)

    sched = Scheduler()
    for i in range(2):
        sched.prefill[f"p{i}"] = PrefillNodeState(f"p{i}", 16, 1000, 10)
    calls = Calls()
    warmer = Warmer(sched, None, calls)  # type: ignore[arg-type]
    tokens = list(range(160))

    def refusal(start: int, reason: str = "ttft", held: int = 0) -> tuple[Request, Decision]:
        hashes = [bytes([start, i]) for i in range(10)]
        r = Request(f"r{start}-{reason}-{held}", 160, hashes, 4, 100.0, 100.0)
        best = Candidate(DISAGG, "p0", 500.0, cached_blocks=held)
        return r, Decision(False, estimate=best, reason=reason)

    assert not warmer.refused(*refusal(1), tokens, 16)  # unique, refused for load
    r, d = refusal(1)
    r.hashes = [bytes([1, 0]), *[bytes([1, 9, i]) for i in range(9)]]  # same start
    assert warmer.refused(r, d, tokens, 16)  # a refused prompt began with it
    assert warmer.refused(*refusal(3, held=2), tokens, 16)  # part of it cached
    assert not warmer.refused(*refusal(4, INFEASIBLE), tokens, 16)  # both nodes warming
    warmer.pending.clear()
    assert not warmer.refused(*refusal(3, held=2), tokens, 16)  # warmed lately
    assert not warmer.refused(*refusal(5, held=9), tokens, 16)  # all it can use cached
    assert not warmer.refused(*refusal(6, "tbt"), tokens, 16)  # not refused for its TTFT
    assert warmer.refused(*refusal(7, INFEASIBLE), tokens, 16)  # infeasible: at once
    assert len(calls.sent) == warmer.sent == 3


def test_a_warm_up_yields_the_prefill_node_to_a_request(cluster):
    """A warm-up holds the compute slot only while no request waits for it: a request
    that comes while a long prompt is being warmed takes the slot at the warm-up's next
    chunk (the warm-up stops, ``yielded``), and its tokens are the reference's."""
    rng = random.Random(5)
    long_prompt = "".join(rng.choice("qrstuvwxyz ") for _ in range(3500))
    yielded, done = warms(cluster, "yielded"), warms(cluster, "done")
    # an SLO no node can meet: refused as infeasible, warmed at once
    assert refused(cluster, long_prompt, 1.0) == "infeasible"
    time.sleep(0.3)  # (the warm-up on its way to the node)
    prompt = "".join(rng.choice("abc ") for _ in range(200))
    t0 = time.perf_counter()
    got = generate(cluster.conductor, prompt, max_tokens=4, cache_salt="yield")
    ttft_s = time.perf_counter() - t0
    deadline = time.monotonic() + 30
    while warms(cluster, "yielded") == yielded:
        assert time.monotonic() < deadline, "the warm-up did not yield"
        time.sleep(0.1)
    assert warms(cluster, "done") == done  # it stopped, not finished
    model = LlamaModel.from_preset("tiny", seed=0)
    assert got.tokens == model.reference_generate(TOK.encode(prompt), 4, eos_id=TOK.eos_id)
    assert ttft_s < 30, ttft_s
