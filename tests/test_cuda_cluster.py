"""One real cluster on one GPU (issue 14 part 2, scripts/gpu-check.sh): etcd, a
prefill node and a decode node started with ``--device cuda`` in their own processes,
sharing the GPU, the KV handed off through the prefill node's pinned host mirror over
the transfer engine; greedy generation is token-exact against the single-process
reference. Skipped, with its reason, where torch sees no CUDA device."""

from __future__ import annotations

import pytest
import torch

from kvmesh.services.common.tokenizer import ByteTokenizer
from kvmesh.services.engine.model import LlamaModel
from kvmesh.services.launcher import LocalCluster
from tests.cluster_util import DISAGG_ONLY, NODE_ARGS, generate, node

pytestmark = [
    pytest.mark.cuda,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device"),
]

TOK = ByteTokenizer()
PROMPT = "".join(
    f"Sentence {i}: the KV cache crosses from one GPU process to another. " for i in range(4)
)


@pytest.fixture(scope="module")
def cluster(tmp_path_factory):
    c = LocalCluster(
        str(tmp_path_factory.mktemp("cuda")),
        node_args=NODE_ARGS + ["--device", "cuda"],
        conductor_args=DISAGG_ONLY,
    )
    c.start()
    yield c
    c.stop()


def test_disaggregated_request_on_the_gpu_matches_the_reference(cluster):
    ref = LlamaModel.from_preset("tiny", seed=0).reference_generate(
        TOK.encode(PROMPT), 12, eos_id=TOK.eos_id
    )
    before = node(cluster.conductor, "prefill-0").computed_tokens_total
    got = generate(cluster.conductor, PROMPT, max_tokens=12)
    assert got.route.prefill_node == "prefill-0"  # the prefill node computed it, on the GPU
    assert node(cluster.conductor, "prefill-0").computed_tokens_total - before == len(
        TOK.encode(PROMPT)
    )
    assert got.tokens == ref
    # the same prompt again, its prefix now cached in the cluster
    again = generate(cluster.conductor, PROMPT, max_tokens=12)
    assert again.tokens == ref
