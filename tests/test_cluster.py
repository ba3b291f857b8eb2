"""End to end through a real cluster: etcd, four services in their own processes, gRPC,
KV over the transfer engine, the tiny model. The oracle: greedy generation through the
cluster equals the same model generating from scratch in this process."""

from __future__ import annotations

import grpc
import pytest

from kvmesh.services.common.tokenizer import ByteTokenizer
from kvmesh.services.engine.model import LlamaModel
from kvmesh.services.launcher import LocalCluster
from tests.cluster_util import DISAGG_ONLY, NODE_ARGS, generate, node, status

SHARED = (
    "You are kvmesh, a serving cluster that keeps every token's KV state once "
    "computed and moves it faster than it could be recomputed. "
)
PROMPTS = [
    "Hello, world!",
    "The quick brown fox jumps over the lazy dog.",
    SHARED + "First question: what is a prefix cache?",
    SHARED + "Second question: why disaggregate prefill and decode?",
]
MAX_TOKENS = 20


@pytest.fixture(scope="module")
def cluster(tmp_path_factory):
    c = LocalCluster(
        str(tmp_path_factory.mktemp("cluster")), node_args=NODE_ARGS, conductor_args=DISAGG_ONLY
    )
    c.start()
    yield c
    c.stop()


@pytest.fixture(scope="module")
def reference():
    model = LlamaModel.from_preset("tiny", seed=0)
    tok = ByteTokenizer()

    def run(prompt: str, max_tokens: int = MAX_TOKENS) -> list[int]:
        return model.reference_generate(tok.encode(prompt), max_tokens, eos_id=tok.eos_id)

    return run


def test_greedy_matches_single_process_reference(cluster, reference):
    for prompt in PROMPTS:
        got = generate(cluster.conductor, prompt, max_tokens=MAX_TOKENS)
        assert got.tokens == reference(prompt), prompt
        assert got.finish_reason in ("length", "stop")
        assert got.usage.completion_tokens == len(got.tokens)
        assert got.usage.prompt_tokens == len(ByteTokenizer().encode(prompt))


def test_shared_prefix_computes_only_new_tokens(cluster, reference):
    prefill = "prefill-0"
    tok = ByteTokenizer()
    a = SHARED + "Third question: what does the conductor do?"
    b = SHARED + "Fourth question: how is a block hash chained?"
    generate(cluster.conductor, a, max_tokens=4)
    before = node(cluster.conductor, prefill).computed_tokens_total
    got = generate(cluster.conductor, b, max_tokens=MAX_TOKENS)
    after = node(cluster.conductor, prefill).computed_tokens_total
    n = len(tok.encode(b))
    shared_blocks = len(tok.encode(SHARED)) // 16  # tokens of SHARED (with BOS) in full blocks
    assert got.usage.cached_tokens >= shared_blocks * 16 > 0
    assert got.usage.computed_tokens == n - got.usage.cached_tokens
    assert after - before == n - got.usage.cached_tokens
    assert got.tokens == reference(b)


@pytest.mark.parametrize(
    "kw, fragment",
    [
        (dict(prompt="", max_tokens=8), "prompt is empty"),
        (dict(prompt="   ", max_tokens=8), "prompt is empty"),
        (dict(prompt="hi", max_tokens=0), "max_tokens must be > 0"),
        (dict(prompt="hi", max_tokens=-3), "max_tokens must be > 0"),
        (dict(prompt="x" * 5000, max_tokens=8), "exceed the model's context"),
        (dict(token_ids=[1, 2, 99999], max_tokens=8), "token_ids must be in"),
    ],
)
def test_bad_input_is_invalid_argument(cluster, kw, fragment):
    with pytest.raises(grpc.RpcError) as e:
        generate(cluster.conductor, **kw)
    assert e.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert fragment in e.value.details()
    assert generate(cluster.conductor, "still serving", max_tokens=2).tokens  # unharmed


def test_a_ttft_slo_below_the_floor_is_invalid_before_any_work(cluster):
    """No node could ever meet 0.01 ms: INVALID_ARGUMENT naming the floor, no retry."""
    from kvmesh.protos import kvmesh_pb2 as pb

    before = {n.node_id: n for n in status(cluster.conductor).nodes}
    with pytest.raises(grpc.RpcError) as e:
        generate(
            cluster.conductor,
            "a request that cannot meet its SLO " * 4,
            max_tokens=8,
            slo=pb.SLO(ttft_ms=0.01),
        )
    assert e.value.code() == grpc.StatusCode.INVALID_ARGUMENT, e.value.details()
    assert "TTFT SLO of 0.01 ms is below the floor" in e.value.details()
    assert "ask for a TTFT SLO of at least" in e.value.details()
    trailing = dict(e.value.trailing_metadata() or ())
    assert "retry-after-ms" not in trailing
    assert trailing["kvmesh-reject-reason"] == "infeasible"
    after = {n.node_id: n for n in status(cluster.conductor).nodes}
    assert after["prefill-0"].computed_tokens_total == before["prefill-0"].computed_tokens_total
    assert after["decode-0"].kv_blocks_free == before["decode-0"].kv_blocks_free


def test_stop_tokens_stop_strings_and_logprobs(cluster, reference):
    import torch

    from kvmesh.protos import kvmesh_pb2 as pb

    prompt = "Stop conditions are checked on every token."
    ref = reference(prompt, 24)
    k = 6  # stop at the first occurrence of the reference's 7th token
    stop_tok = ref[k]
    got = generate(
        cluster.conductor,
        prompt,
        max_tokens=24,
        sampling=pb.SamplingParams(stop_token_ids=[stop_tok]),
    )
    assert got.tokens == ref[: ref.index(stop_tok) + 1] and got.finish_reason == "stop"

    text = ByteTokenizer().decode(ref)
    printable = [i for i in range(2, len(text) - 2) if text[i : i + 2].isprintable()]
    if printable:  # a stop string taken from the reference text cuts the text before it
        i = printable[len(printable) // 2]
        stop = text[i : i + 2]
        got = generate(
            cluster.conductor, prompt, max_tokens=24, sampling=pb.SamplingParams(stop=[stop])
        )
        assert got.finish_reason == "stop" and got.text == text[: text.index(stop)]

    req = pb.GenerateRequest(prompt=prompt, max_tokens=5, sampling=pb.SamplingParams(logprobs=True))
    import grpc as _grpc

    from kvmesh.protos import kvmesh_pb2_grpc as pbg

    with _grpc.insecure_channel(cluster.conductor) as ch:
        msgs = list(pbg.ConductorStub(ch).Generate(req, timeout=30))
    tokens = [t for m in msgs for t in m.token_ids]
    lps = [lp for m in msgs for lp in m.logprobs]
    assert tokens == ref[:5] and len(lps) == 5 and all(lp <= 0 for lp in lps)
    model = LlamaModel.from_preset("tiny", seed=0)
    ids = ByteTokenizer().encode(prompt)
    want = torch.log_softmax(model.reference_logits(ids)[-1].float(), -1)[ref[0]].item()
    assert abs(lps[0] - want) < 1e-4


def test_bad_sampling_fields_name_the_field(cluster):
    from kvmesh.protos import kvmesh_pb2 as pb

    for sampling, field in [
        (pb.SamplingParams(temperature=-1), "sampling.temperature"),
        (pb.SamplingParams(top_p=2), "sampling.top_p"),
        (pb.SamplingParams(stop_token_ids=[10**6]), "sampling.stop_token_ids"),
        (pb.SamplingParams(stop=[""]), "sampling.stop"),
    ]:
        with pytest.raises(grpc.RpcError) as e:
            generate(cluster.conductor, "hi", max_tokens=3, sampling=sampling)
        assert e.value.code() == grpc.StatusCode.INVALID_ARGUMENT and field in e.value.details()


def test_seeded_sampling_with_every_feature_matches_the_single_process_sampler(cluster):
    """Issue 33: penalties, logit_bias, min_p and min_tokens read only the request's own
    tokens, so the prefill node (the first token) and the decode node (the rest) sample
    what one process sampling from scratch does, for a seeded request."""
    from kvmesh.protos import kvmesh_pb2 as pb
    from kvmesh.services.common.sampling_params import Sampling
    from kvmesh.services.engine.sampler_device import History
    from kvmesh.services.engine.sampling import sample

    params = pb.SamplingParams(
        temperature=0.9,
        seed=2024,
        top_k=50,
        min_p=0.05,
        presence_penalty=0.5,
        frequency_penalty=0.3,
        repetition_penalty=1.2,
        min_tokens=4,
    )
    params.logit_bias[ord("e")] = 2.0
    prompt = "Reproducible on any node: "
    got = generate(cluster.conductor, prompt, max_tokens=16, sampling=params)
    assert got.route.prefill_node and got.route.decode_node  # two nodes sampled it
    model, tok = LlamaModel.from_preset("tiny", seed=0), ByteTokenizer()
    ids, out, s = tok.encode(prompt), [], Sampling.from_proto(params)
    while len(out) < 16:
        logits = model.reference_logits(ids + out)[-1]
        out.append(sample(logits, s, len(out), History(ids, out, frozenset({tok.eos_id}))))
        if out[-1] == tok.eos_id:
            break
    assert got.tokens == out
    # top alternatives come from both nodes too: one per token, the first from the prefill
    import grpc as _grpc

    from kvmesh.protos import kvmesh_pb2_grpc as pbg

    params.logprobs, params.top_logprobs = True, 2
    req = pb.GenerateRequest(prompt=prompt, max_tokens=16, sampling=params)
    with _grpc.insecure_channel(cluster.conductor) as ch:
        msgs = list(pbg.ConductorStub(ch).Generate(req, timeout=30))
    assert [t for m in msgs for t in m.token_ids] == out  # (asking for them changes nothing)
    tops = [t for m in msgs for t in m.top_logprobs]
    assert len(tops) == len(out) and all(len(t.token_ids) == 2 for t in tops)
    assert all(t.logprobs[0] >= t.logprobs[1] for t in tops)
