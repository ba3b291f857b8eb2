"""Issue 33: the sampler's logits processing (logit_bias, min_tokens, repetition,
frequency and presence penalties) and min_p, on CPU tensors: each does what OpenAI's and
vLLM's definitions say, from the request's own tokens only, and the batched device
sampler draws the same tokens and log-probabilities as the row sampler, bit for bit."""

from __future__ import annotations

import pytest
import torch

from kvmesh.protos import kvmesh_pb2 as pb
from kvmesh.services.common.sampling_params import Sampling
from kvmesh.services.engine.sampler_device import (
    History,
    process_logits,
    sample_batch,
    top_alternatives,
)
from kvmesh.services.engine.sampling import sample, sample_with_logprob

VOCAB = 64


def _row(seed: int = 0) -> torch.Tensor:
    return torch.randn(VOCAB, generator=torch.Generator().manual_seed(seed)) * 2


def test_logit_bias_forces_or_bars_a_token():
    x = _row()
    top = int(torch.argmax(x))
    assert sample(x, Sampling(logit_bias=((5, 100.0),))) == 5
    assert sample(x, Sampling(logit_bias=((top, -100.0),))) != top
    # sampled too: +100 leaves no other token any mass
    s = Sampling(temperature=1.0, seed=3, logit_bias=((9, 100.0),))
    assert {sample(x, s, step) for step in range(20)} == {9}


def test_min_tokens_bars_eos_and_stop_ids_until_reached():
    x = _row()
    eos = int(torch.argmax(x))
    s = Sampling(min_tokens=2, stop_token_ids=frozenset({3}), logit_bias=((3, 50.0),))
    hist = History(prompt=[1, 2], output=[7], eos_ids=frozenset({eos}))
    got = process_logits(x, s, hist)
    assert got[eos] == float("-inf") and got[3] == float("-inf")
    assert sample(x, s, 1, hist) not in (eos, 3)
    # two tokens out: no longer barred (the bias makes 3 the greedy choice)
    assert sample(x, s, 2, History([1, 2], [7, 8], frozenset({eos}))) == 3


def test_penalties_follow_their_definitions():
    x = _row(1)
    hist = History(prompt=[1, 2], output=[2, 4, 4, 4])
    rep = process_logits(x, Sampling(repetition_penalty=2.0), hist)
    for t in range(VOCAB):
        if t in (1, 2, 4):
            want = x[t] / 2 if x[t] > 0 else x[t] * 2
        else:
            want = x[t]
        assert torch.isclose(rep[t], want), t
    fp = process_logits(x, Sampling(frequency_penalty=0.5, presence_penalty=0.25), hist)
    assert torch.isclose(fp[4], x[4] - 0.5 * 3 - 0.25)
    assert torch.isclose(fp[2], x[2] - 0.5 - 0.25)
    assert torch.equal(fp[1], x[1])  # in the prompt only: output penalties leave it
    # greedy follows the processed logits: a penalized top token loses its place
    top = int(torch.argmax(x))
    assert sample(x, Sampling(frequency_penalty=2.0), 1, History([], [top] * 5)) != top


def test_logprobs_are_the_raw_models():
    x = _row(2)
    tok, lp = sample_with_logprob(x, Sampling(logit_bias=((5, 100.0),)))
    assert tok == 5
    assert lp == float(torch.log_softmax(x, -1)[5])


def test_top_alternatives_are_the_most_likely_raw_tokens():
    x = torch.stack([_row(3), _row(4)])
    got = top_alternatives(x, [3, 0])
    lsm = torch.log_softmax(x[0], -1)
    want = torch.topk(lsm, 3)
    assert [t for t, _ in got[0]] == want.indices.tolist()
    assert [lp for _, lp in got[0]] == pytest.approx(want.values.tolist())
    assert got[1] == [] and top_alternatives(x, [0, 0]) == [[], []]


def test_min_p_keeps_only_tokens_near_the_top():
    x = torch.full((VOCAB,), -5.0)
    x[10], x[11] = 5.0, 4.9  # the rest have p < 1e-4 x the top
    s = Sampling(temperature=1.0, seed=1, min_p=0.5)
    assert {sample(x, s, step) for step in range(40)} == {10, 11}
    wide = {sample(x, Sampling(temperature=1.0, seed=1), step) for step in range(400)}
    assert wide - {10, 11}  # without min_p the tail gets drawn sometimes


def test_batch_sampler_matches_the_row_sampler_with_processing():
    logits = torch.stack([_row(s) for s in range(6)]).to(torch.bfloat16)
    samplings = [
        Sampling(repetition_penalty=1.3),
        Sampling(temperature=0.9, seed=4, frequency_penalty=0.7, presence_penalty=0.3),
        Sampling(temperature=1.1, seed=5, min_p=0.2, logit_bias=((2, 3.0),)),
        Sampling(temperature=0.8, seed=6, top_k=9, min_tokens=3),
        Sampling(temperature=0.7, seed=7, min_p=0.1, top_p=0.8),
        Sampling(),
    ]
    hists = [History([1, 2, 3], [4, 4, 5], frozenset({0})) for _ in samplings]
    steps = [3] * 6
    want = [sample_with_logprob(logits[i], s, steps[i], hists[i]) for i, s in enumerate(samplings)]
    assert sample_batch(logits, samplings, steps, hists) == want


def test_the_proto_carries_every_feature():
    p = pb.SamplingParams(
        presence_penalty=0.5,
        frequency_penalty=-0.5,
        repetition_penalty=0,  # 0: off, read as 1
        min_p=0.1,
        min_tokens=4,
    )
    p.logit_bias[7] = -3.0
    s = Sampling.from_proto(p)
    assert s.repetition_penalty == 1.0 and s.logit_bias == ((7, -3.0),) and s.min_tokens == 4
    assert s.processes_logits and not Sampling().processes_logits
    assert not p.HasField("seed")  # unset: the conductor draws one
    assert "repetition_penalty" in (Sampling(repetition_penalty=20).validate(VOCAB) or "")
    assert "logit_bias" in (Sampling(logit_bias=((VOCAB, 1.0),)).validate(VOCAB) or "")
    assert Sampling(temperature=3.0).validate(VOCAB)  # the shared limit: 2


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_processing_on_a_gpu_does_not_sync_and_matches_the_cpu():
    logits = torch.stack([_row(s) for s in range(4)]) * 2
    samplings = [
        Sampling(repetition_penalty=1.3, logit_bias=((3, 2.0),)),
        Sampling(temperature=0.9, seed=4, frequency_penalty=0.7, presence_penalty=0.3),
        Sampling(temperature=1.1, seed=5, min_p=0.2, min_tokens=9),
        Sampling(temperature=0.8, seed=6, top_k=9),
    ]
    hists = [History([1, 2, 3], [4, 4, 5], frozenset({0})) for _ in samplings]
    dev = logits.cuda()
    sample_batch(dev, samplings, [3] * 4, hists)  # warm-up: first-use allocations
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")  # any sync but the fetch raises
    try:
        processed = torch.stack(
            [process_logits(dev[i], s, hists[i]) for i, s in enumerate(samplings)]
        )
    finally:
        torch.cuda.set_sync_debug_mode("default")
    assert torch.allclose(
        processed.cpu(),
        torch.stack([process_logits(logits[i], s, hists[i]) for i, s in enumerate(samplings)]),
    )
    got = sample_batch(dev, samplings, [3] * 4, hists)
    want = sample_batch(logits, samplings, [3] * 4, hists)
    assert [t for t, _ in got] == [t for t, _ in want]
