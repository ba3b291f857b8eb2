"""Long prompts through a real cluster (etcd, services in their own processes, gRPC, KV
over the transfer engine, the tiny model): the prefill node computes a prompt longer
than its ``--prefill-chunk-tokens`` in chunks, handing each chunk's layers off as they
finish, and greedy generation stays exactly the single-process reference, with and
without a cached prefix. A prompt past the model's maximum position is INVALID_ARGUMENT
naming the limit, at the conductor and at both model nodes."""

from __future__ import annotations

import grpc
import pytest

from kvmesh.protos import kvmesh_pb2 as pb
from kvmesh.protos import kvmesh_pb2_grpc as pbg
from kvmesh.services.common.tokenizer import ByteTokenizer
from kvmesh.services.engine.config import PRESETS
from kvmesh.services.engine.model import LlamaModel
from kvmesh.services.launcher import LocalCluster
from tests.cluster_util import DISAGG_ONLY, NODE_ARGS, generate, node, status

CHUNK = 32  # two blocks of 16
LIMIT = PRESETS["tiny"].max_position_embeddings
TOK = ByteTokenizer()
LONG = "".join(f"Line {i}: the prefill node computes long prompts in chunks. " for i in range(9))


@pytest.fixture(scope="module")
def cluster(tmp_path_factory):
    c = LocalCluster(
        str(tmp_path_factory.mktemp("long")),
        node_args=NODE_ARGS + ["--prefill-chunk-tokens", str(CHUNK)],
        conductor_args=DISAGG_ONLY,
    )
    c.start()
    yield c
    c.stop()


@pytest.fixture(scope="module")
def model():
    return LlamaModel.from_preset("tiny", seed=0)


def reference(model, text: str, max_tokens: int) -> list[int]:
    return model.reference_generate(TOK.encode(text), max_tokens, eos_id=TOK.eos_id)


def test_a_prompt_of_many_chunks_matches_the_reference(cluster, model):
    n = len(TOK.encode(LONG))
    assert n > 10 * CHUNK
    before = node(cluster.conductor, "prefill-0").computed_tokens_total
    got = generate(cluster.conductor, LONG, max_tokens=8)
    assert got.route.prefill_node == "prefill-0"  # disaggregated: the prefill node computed it
    assert got.usage.computed_tokens == n
    assert node(cluster.conductor, "prefill-0").computed_tokens_total - before == n
    assert got.tokens == reference(model, LONG, 8)


def test_cached_prefix_and_a_long_new_suffix_match_the_reference(cluster, model):
    text = LONG + "And a different question at the end: what is chunked prefill?"
    got = generate(cluster.conductor, text, max_tokens=8)
    assert got.usage.cached_tokens >= 10 * CHUNK  # LONG's full blocks, from the first test
    assert got.usage.computed_tokens > CHUNK  # the rest, in more than one chunk
    assert got.tokens == reference(model, text, 8)


def test_past_the_maximum_position_is_invalid_argument_naming_the_limit(cluster):
    nodes = {n.role: n for n in status(cluster.conductor).nodes}
    with pytest.raises(grpc.RpcError) as e:
        generate(cluster.conductor, token_ids=[1] * (LIMIT + 1), max_tokens=1)
    assert e.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert f"{LIMIT} tokens" in e.value.details()

    with grpc.insecure_channel(nodes["prefill"].grpc_address) as ch:
        with pytest.raises(grpc.RpcError) as e:
            pbg.PrefillNodeStub(ch).Prefill(
                pb.PrefillRequest(request_id="too-long", token_ids=[1] * (LIMIT + 1)),
                timeout=10,
            )
    assert e.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert f"maximum position of {LIMIT} tokens" in e.value.details()

    with grpc.insecure_channel(nodes["decode"].grpc_address) as ch:
        with pytest.raises(grpc.RpcError) as e:
            pbg.DecodeNodeStub(ch).Reserve(
                pb.ReserveRequest(request_id="too-long", prompt_tokens=LIMIT - 10, max_tokens=11),
                timeout=10,
            )
    assert e.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert f"maximum position of {LIMIT} tokens" in e.value.details()
    assert generate(cluster.conductor, "still serving", max_tokens=2).tokens
