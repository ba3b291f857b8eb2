"""The decode step's GPU pieces on a real CUDA device (issue 14 part 2): the batch
sampler with no sync but its one fetch, the same tokens as the CPU sampler, and CUDA
graphs of the padded decode step replaying what the eager step computes. Skipped, with
its reason, where torch sees no CUDA device; tests/test_sampler_device.py and
tests/test_cuda_graphs.py run the same logic on CPU tensors."""

from __future__ import annotations

import pytest
import torch

from kvmesh.services.common.sampling_params import Sampling
from kvmesh.services.engine.cuda_graphs import DecodeRunner
from kvmesh.services.engine.kv_pool import KVPool
from kvmesh.services.engine.model import LlamaModel
from kvmesh.services.engine.sampler_device import fetch, sample_batch, sample_on_device
from kvmesh.services.engine.sampling import sample_with_logprob

pytestmark = [
    pytest.mark.cuda,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device"),
]

BS = 16
MIX = [
    Sampling(),
    Sampling(temperature=0.8, seed=1),
    Sampling(temperature=1.0, top_k=20, top_p=0.9, seed=2),
    Sampling(temperature=0.6, top_p=0.5, seed=3),
]


def test_sampler_reads_back_once_and_matches_the_cpu():
    g = torch.Generator().manual_seed(0)
    logits = torch.randn((len(MIX), 32000), generator=g) * 4
    dev = logits.cuda()
    sample_on_device(dev, MIX, [0] * 4)  # warm-up: first-use allocations
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")  # any sync in here raises
    try:
        packed = sample_on_device(dev, MIX, [5, 6, 7, 8])
    finally:
        torch.cuda.set_sync_debug_mode("default")
    got = fetch(packed)  # the one sync
    want = sample_batch(logits, MIX, [5, 6, 7, 8])
    # the same host noise: tokens equal (these logits have no near-ties), logprobs close
    assert [t for t, _ in got] == [t for t, _ in want]
    assert all(abs(a - b) < 1e-4 for (_, a), (_, b) in zip(got, want))
    # the first token (prefill, decode-direct) of a seeded request on a GPU node
    tok, _ = sample_with_logprob(dev[2], MIX[2], 7)
    assert tok == want[2][0]


def _prefilled(model, prompts, device):
    pool = KVPool(model.config, 64, BS, dtype=model.dtype, device=device)
    tables = []
    for p in prompts:
        t = pool.allocate(-(-(len(p) + 8) // BS))
        model.forward_prefill(p, 0, pool, t)
        tables.append(t)
    return pool, tables


@pytest.mark.parametrize("graphs", [True, False])
def test_graph_replay_matches_the_eager_decode(graphs):
    model = LlamaModel.from_preset("tiny", seed=5).to("cuda")
    prompts = [list(range(1, 30)), list(range(2, 70)), list(range(5, 21))]
    ref_pool, tables = _prefilled(model, prompts, "cuda")
    pool, _ = _prefilled(model, prompts, "cuda")
    runner = DecodeRunner(model, pool, max_batch=8, cuda_graphs=graphs)
    assert runner.static and runner.graphs == graphs
    toks = [3, 4, 5]
    for step in range(6):
        pos = [len(p) + step for p in prompts]
        ref = model.forward_decode(toks, pos, tables, ref_pool)
        got = runner.step(torch.tensor(toks), pos, tables)
        assert torch.allclose(got, ref, atol=1e-3, rtol=1e-3)
        toks = ref.argmax(-1).tolist()
        assert got.argmax(-1).tolist() == toks
    if graphs:  # one bucket (4 rows, 5 blocks wide) captured once, replayed after
        assert runner.captures == 1 and runner.replays == 6
    assert torch.allclose(pool.kv, ref_pool.kv, atol=1e-3)


def test_replay_does_not_sync():
    model = LlamaModel.from_preset("tiny", seed=5).to("cuda")
    pool, tables = _prefilled(model, [list(range(1, 30))], "cuda")
    runner = DecodeRunner(model, pool, max_batch=4)
    runner.step([1], [29], tables)  # captures
    torch.cuda.synchronize()
    bucket = next(iter(runner._buckets.values()))
    torch.cuda.set_sync_debug_mode("error")
    try:
        bucket.graph.replay()
    finally:
        torch.cuda.set_sync_debug_mode("default")
    torch.cuda.synchronize()
