"""A real Hugging Face checkpoint (tiny Qwen2 with q/k/v biases, a trained BPE tokenizer
and two EOS ids) served by a whole cluster with ``--model DIR``: the conductor tokenizes
with the checkpoint's tokenizer, and greedy output equals transformers' own greedy
generation, token for token, including a request whose prefix comes from the cache."""

from __future__ import annotations

import pytest
import torch

transformers = pytest.importorskip("transformers")

from kvmesh.protos import kvmesh_pb2 as pb  # noqa: E402
from kvmesh.services.common.tokenizer import load_tokenizer  # noqa: E402
from kvmesh.services.launcher import LocalCluster  # noqa: E402
from tests.cluster_util import DISAGG_ONLY, generate  # noqa: E402
from tests.test_checkpoint import build, train_tokenizer  # noqa: E402

PROMPTS = [
    "the cluster keeps every block of the shared prefix once, and then",
    "the cluster keeps every block of the shared prefix once, but sometimes",
]


def hf_greedy(hf, ids: list[int], n: int) -> list[int]:
    ids = list(ids)
    out = []
    with torch.no_grad():
        for _ in range(n):
            logits = hf(torch.tensor([ids])).logits[0, -1]
            t = int(torch.argmax(logits))
            out.append(t)
            ids.append(t)
    return out


@pytest.fixture(scope="module")
def served(tmp_path_factory):
    d = tmp_path_factory.mktemp("qwen2")
    hf = build(d, "qwen2", seed=3, tok=train_tokenizer())
    c = LocalCluster(
        str(tmp_path_factory.mktemp("ckpt-cluster")),
        node_args=[
            "--model",
            str(d),
            "--block-size",
            "8",
            "--kv-memory",
            "8MiB",
            "--segment-memory",
            "8MiB",
        ],
        conductor_args=DISAGG_ONLY,
    )
    c.start()
    yield c, hf, load_tokenizer(str(d))
    c.stop()


def test_cluster_serves_checkpoint_like_transformers(served):
    cluster, hf, tok = served
    results = []
    for prompt in PROMPTS:
        ids = tok.encode(prompt)
        got = generate(
            cluster.conductor, prompt, max_tokens=12, sampling=pb.SamplingParams(ignore_eos=True)
        )
        assert got.usage.prompt_tokens == len(ids)
        assert got.tokens == hf_greedy(hf, ids, 12), prompt
        assert got.text == tok.decode(got.tokens)
        results.append(got)
    assert results[1].usage.cached_tokens > 0  # the shared prefix came from the cache
