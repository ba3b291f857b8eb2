"""Warm-ups (conductor/warm.py, PrefillRequest.warm): a refused prompt that shares its
start with an earlier refused one is computed into the store by the idle prefill node,
so that the next request sharing that prefix is accepted and computes only its own
tokens, and its tokens are still exactly the single-process reference's."""

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

    # a unique prompt refused is not warmed (nothing computes it)
    refused(cluster, text(1500), slo_ms)
    # the first of the group: not warmed yet (nothing says its start is shared)
    refused(cluster, prompts[0], slo_ms)
    time.sleep(1.0)
    assert warms(cluster, "done") == done_before
    # the second refused with the same start: warmed on the idle prefill node
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
