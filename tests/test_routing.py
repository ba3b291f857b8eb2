"""Routing and admission in a real cluster (two prefill nodes, one decode node, the
kvmesh policy): a repeated prefix goes to the node that holds it; short prompts take
the colocated route; a conversation's next turn goes decode-direct; an overloaded
cluster rejects up front while every accepted request meets its TTFT SLO. Every output
is checked against the single-process reference."""

from __future__ import annotations

import collections
import random
import threading
import time
import urllib.request

import grpc
import pytest

from kvmesh.protos import kvmesh_pb2 as pb
from kvmesh.protos import kvmesh_pb2_grpc as pbg
from kvmesh.services.common.tokenizer import ByteTokenizer
from kvmesh.services.engine.model import LlamaModel
from kvmesh.services.launcher import LocalCluster
from tests.cluster_util import generate, node, status

# no store segments: a prefix lives only in the pool of the node that computed it
NODE_ARGS = [
    "--block-size",
    "16",
    "--kv-memory",
    "32MiB",
    "--segment-memory",
    "0",
    "--threads",
    "1",
]
TOK = ByteTokenizer()
SHARED = "".join(random.Random(7).choice("abcdefghij klmnop") for _ in range(600))


@pytest.fixture(scope="module")
def cluster(tmp_path_factory):
    c = LocalCluster(
        str(tmp_path_factory.mktemp("routing")),
        prefill=2,
        decode=1,
        node_args=NODE_ARGS,
        # admit within 75% of the SLO: the estimate's error on two cores shared
        # by five processes and the load generator (see the conductor's slo_margin)
        conductor_args=["--report-interval-ms", "50", "--slo-margin", "0.75"],
    )
    c.start()
    yield c
    c.stop()


def index_blocks(cluster: LocalCluster) -> dict[str, float]:
    """The blocks the conductor's cache index knows each node holds (from its metrics)."""
    conductor = next(n for n in status(cluster.conductor).nodes if n.role == "conductor")
    url = f"http://{conductor.metrics_address}/metrics"
    text = urllib.request.urlopen(url, timeout=5).read().decode()
    out = {}
    for line in text.splitlines():
        if line.startswith("kvmesh_conductor_index_blocks{"):
            labels, value = line.rsplit(" ", 1)
            out[labels.split('node="', 1)[1].split('"', 1)[0]] = float(value)
    return out


def wait_indexed(cluster: LocalCluster, node_id: str, blocks: float, timeout: float = 10.0):
    """Waits until the conductor's cache index knows ``node_id`` holds ``blocks`` blocks
    (its cache events arrive on the node's report stream)."""
    deadline = time.monotonic() + timeout
    while (held := index_blocks(cluster).get(node_id, 0)) < blocks:
        assert time.monotonic() < deadline, f"the conductor knows {held} blocks of {node_id}"
        time.sleep(0.05)


@pytest.fixture(scope="module")
def reference():
    model = LlamaModel.from_preset("tiny", seed=0)
    return lambda ids, n: model.reference_generate(ids, n, eos_id=TOK.eos_id)


def test_repeated_prefix_goes_to_the_node_holding_it(cluster, reference):
    before = index_blocks(cluster)
    a = generate(cluster.conductor, SHARED + "A" * 200, max_tokens=2)
    holder = a.route.prefill_node
    assert holder
    # the holder's cache events reach the conductor
    wait_indexed(cluster, holder, before.get(holder, 0) + len(TOK.encode(SHARED)) // 16)
    for tail in ("B" * 200, "C" * 200):
        got = generate(cluster.conductor, SHARED + tail, max_tokens=6)
        assert got.route.prefill_node == holder
        assert got.usage.cached_tokens >= (len(TOK.encode(SHARED)) // 16) * 16
        assert got.tokens == reference(TOK.encode(SHARED + tail), 6)


def test_short_prompt_takes_the_colocated_route(cluster, reference):
    before = node(cluster.conductor, "decode-0").computed_tokens_total
    got = generate(cluster.conductor, "a short question", max_tokens=8)
    assert got.route.prefill_node == "" and got.route.decode_node == "decode-0"
    assert node(cluster.conductor, "decode-0").computed_tokens_total - before == len(
        TOK.encode("a short question")
    )
    assert got.tokens == reference(TOK.encode("a short question"), 8)


def test_next_turn_goes_decode_direct(cluster, reference):
    turn1 = TOK.encode("Z" + SHARED[::-1])
    before = index_blocks(cluster).get("decode-0", 0)
    first = generate(
        cluster.conductor,
        token_ids=turn1,
        max_tokens=24,
        timeout=60,
        sampling=pb.SamplingParams(ignore_eos=True),
    )
    assert first.tokens == reference(turn1, 24)[:24]
    wait_indexed(cluster, "decode-0", before + len(turn1) // 16)  # its cache events
    turn2 = turn1 + first.tokens + TOK.encode(" and then?", add_bos=False)
    got = generate(cluster.conductor, token_ids=turn2, max_tokens=8)
    assert got.route.prefill_node == "" and got.route.decode_node == "decode-0"
    assert got.usage.cached_tokens >= (len(turn1) // 16) * 16
    assert got.usage.computed_tokens == len(turn2) - got.usage.cached_tokens
    assert got.tokens == reference(turn2, 8)


@pytest.fixture(scope="module")
def one_pair(tmp_path_factory):
    """One prefill and one decode node, one core each: on a 2-core test machine two prefill
    nodes would slow each other down in a way no production estimate has to foresee."""
    c = LocalCluster(
        str(tmp_path_factory.mktemp("overload")),
        prefill=1,
        decode=1,
        node_args=NODE_ARGS,
        # the estimate itself must be right (its queue term at the node's measured rate,
        # the credit for the prefill in flight, its recent error); the margin is 0.85
        # (production's default is 0.95): more headroom for the load generator and six
        # processes sharing two cores with the node
        conductor_args=["--report-interval-ms", "50", "--slo-margin", "0.85"],
    )
    c.start()
    yield c
    c.stop()


def test_overload_rejects_early_and_accepted_requests_meet_ttft(one_pair):
    """A burst of 24 long prompts at once, then 200 more arriving at twice the rate the
    prefill node serves them: admission accepts what it can serve inside the TTFT SLO and
    refuses the rest before any work, at once (reason ``ttft``), or, where the node then
    runs slower than estimated (other processes on the two cores), from the prefill queue
    once a request can no longer make it (reason ``deadline``). Every request served meets
    the SLO (at most 1% of them over), measured at the client with 5% of the SLO for that
    measurement; no refused request was computed."""
    cluster = one_pair
    # about half the stream is accepted: over 100 requests, so that the 1% allowed over
    # the SLO is one request, not zero
    burst, stream = 24, 200
    results: list[tuple[str, float, int]] = []
    lock = threading.Lock()
    rng = random.Random(3)
    prompts = [
        "".join(rng.choice("qrstuvwxyz ") for _ in range(1500)) for _ in range(burst + stream)
    ]
    channel = grpc.insecure_channel(cluster.conductor)
    stub = pbg.ConductorStub(channel)
    # the SLO scales with this machine's speed: 4x the TTFT of one request on an idle
    # cluster, while 24 at once need ~24x; the warm-up also refits the time models
    alone = []
    for i in range(5):
        t0 = time.perf_counter()
        req = pb.GenerateRequest(prompt=prompts[i][::-1], max_tokens=1, cache_salt=f"warm{i}")
        for _r in stub.Generate(req, timeout=60):
            pass
        alone.append((time.perf_counter() - t0) * 1000)
    slo_ms = max(300.0, 4 * sorted(alone)[2])
    computed_before = node(cluster.conductor, "prefill-0").computed_tokens_total

    def one(i: int) -> None:
        req = pb.GenerateRequest(
            prompt=prompts[i], max_tokens=4, cache_salt=f"t{i}", slo=pb.SLO(ttft_ms=slo_ms)
        )
        t0 = time.perf_counter()
        try:
            for _r in stub.Generate(req, timeout=60):
                with lock:
                    results.append(("ok", (time.perf_counter() - t0) * 1000, i))
                break
        except grpc.RpcError as e:
            assert e.code() == grpc.StatusCode.RESOURCE_EXHAUSTED, e.details()
            reason = dict(e.trailing_metadata() or ()).get("kvmesh-reject-reason", "")
            with lock:
                results.append((f"rejected {reason}", (time.perf_counter() - t0) * 1000, i))

    threads = [threading.Thread(target=one, args=(i,)) for i in range(burst)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(120)
    # the stream: one request every half lone TTFT, twice what the node serves
    gap_s = sorted(alone)[2] / 2000
    t_start = time.perf_counter()
    threads = []
    for k in range(stream):
        time.sleep(max(0.0, t_start + k * gap_s - time.perf_counter()))
        threads.append(threading.Thread(target=one, args=(burst + k,)))
        threads[-1].start()
    for t in threads:
        t.join(120)
    channel.close()
    ok = sorted(ms for kind, ms, _ in results if kind == "ok")
    rejected = collections.Counter(kind.split()[-1] for kind, _, _ in results if kind != "ok")
    assert len(results) == burst + stream
    assert ok and rejected, (len(ok), rejected)
    assert set(rejected) <= {"ttft", "deadline"}, rejected
    # measured at the client, whose threads share the two cores with the cluster: 5% of
    # the SLO is allowed for that measurement, not for the admission's estimate
    over = [ms for ms in ok if ms > 1.05 * slo_ms]
    assert len(over) <= len(ok) // 100, (slo_ms, over, ok, rejected)
    # a rejected request did no work: the prefill node computed the accepted prompts only
    accepted = [i for kind, _, i in results if kind == "ok"]
    computed = node(cluster.conductor, "prefill-0").computed_tokens_total - computed_before
    assert computed == sum(len(TOK.encode(prompts[i])) for i in accepted)


def test_time_models_report_their_prediction_error(cluster):
    import urllib.request

    from tests.cluster_util import status

    conductor = next(n for n in status(cluster.conductor).nodes if n.role == "conductor")
    text = urllib.request.urlopen(f"http://{conductor.metrics_address}/metrics", timeout=5).read()
    text = text.decode()
    assert (
        'kvmesh_model_prediction_error_ratio{model="prefill",node="prefill-0",quantile="0.5"}'
        in text
        or 'kvmesh_model_prediction_error_ratio{model="prefill",node="prefill-1"' in text
    )
    assert 'kvmesh_route_overhead_seconds{route="disaggregated"}' in text
