"""The batched device sampler (issue 14 part 2) against today's row-by-row sampler, on
CPU tensors: the same token and the same log-probability, bit for bit, for greedy,
temperature, top-k, top-p and their mixes in one batch, seeded; and one host sync."""

from __future__ import annotations

import math
import random

import pytest
import torch

from kvmesh.services.common.sampling_params import Sampling
from kvmesh.services.engine import sampler_device
from kvmesh.services.engine.sampler_device import fetch, sample_batch, sample_on_device
from kvmesh.services.engine.sampling import sample_with_logprob

VOCAB = 512


def _rows(b: int, seed: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    x = torch.randn((b, VOCAB), generator=g) * 3
    x[0, 7] = x[0, 9] = x[0].max() + 1  # a tie: the first index wins in both
    return x


def _reference(logits, samplings, steps):
    return [sample_with_logprob(logits[i], s, steps[i]) for i, s in enumerate(samplings)]


MIXES = [
    Sampling(),
    Sampling(temperature=0.8, seed=11),
    Sampling(temperature=1.3, top_k=5, seed=12),
    Sampling(temperature=0.7, top_p=0.9, seed=13),
    Sampling(temperature=1.0, top_k=40, top_p=0.5, seed=14),
    Sampling(temperature=2.0, top_k=1, seed=15),
    Sampling(temperature=1.0, top_p=1.0, seed=16),  # top_p 1: off
    Sampling(temperature=0.5, top_k=VOCAB, seed=17),
    Sampling(temperature=1e-3, seed=18),
]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_mixed_batch_matches_the_row_sampler_bit_for_bit(dtype):
    logits = _rows(len(MIXES), 1).to(dtype)
    for steps in ([0] * len(MIXES), list(range(3, 3 + len(MIXES)))):
        assert sample_batch(logits, MIXES, steps) == _reference(logits, MIXES, steps)


def test_random_batches_match_over_many_steps():
    rnd = random.Random(5)
    for trial in range(40):
        b = rnd.randint(1, 12)
        samplings = [
            Sampling()
            if rnd.random() < 0.3
            else Sampling(
                temperature=rnd.choice([0.3, 0.7, 1.0, 1.7]),
                top_k=rnd.choice([0, 0, 1, 3, 50]),
                top_p=rnd.choice([0.0, 0.0, 0.2, 0.8, 0.95]),
                seed=rnd.randrange(2**40),
            )
            for _ in range(b)
        ]
        steps = [rnd.randrange(1000) for _ in range(b)]
        logits = _rows(b, 100 + trial)
        assert sample_batch(logits, samplings, steps) == _reference(logits, samplings, steps)


def test_a_seeded_request_draws_the_same_whatever_else_is_in_the_batch():
    s = Sampling(temperature=1.0, top_p=0.9, seed=7)
    logits = _rows(6, 2)
    alone = [sample_batch(logits[i : i + 1], [s], [4])[0] for i in range(6)]
    together = sample_batch(logits, [s] * 6, [4] * 6)
    assert alone == together
    # and not one fixed token: different steps draw differently somewhere
    assert len({sample_batch(logits[1:2], [s], [k])[0][0] for k in range(20)}) > 1


def test_a_degenerate_distribution_takes_the_greedy_token():
    logits = _rows(2, 3)
    logits[1] = float("inf")  # softmax of inf: NaN; multinomial refuses it
    out = sample_batch(logits, [Sampling(temperature=1.0, seed=1)] * 2, [0, 0])
    assert out[0] == sample_with_logprob(logits[0], Sampling(temperature=1.0, seed=1), 0)
    assert out[1][0] == int(torch.argmax(logits[1]))
    assert out[1][1] == -math.inf  # its log_softmax is NaN: read as -inf, as today


def test_bad_shapes_are_refused():
    with pytest.raises(ValueError, match="2 rows for 1 samplings"):
        sample_on_device(_rows(2, 4), [Sampling()], [0])


class _Syncs:
    """Counts the host reads of tensor values (the CPU's stand-in for a device sync)."""

    NAMES = ("item", "tolist", "cpu", "numpy", "__int__", "__float__", "__bool__", "__index__")

    def __init__(self, monkeypatch):
        self.calls: list[str] = []
        for name in self.NAMES:
            orig = getattr(torch.Tensor, name)

            def wrapper(t, *a, _o=orig, _n=name, **k):
                self.calls.append(_n)
                return _o(t, *a, **k)

            monkeypatch.setattr(torch.Tensor, name, wrapper)


def test_one_host_read_per_step(monkeypatch):
    logits = _rows(len(MIXES), 6)
    syncs = _Syncs(monkeypatch)
    packed = sample_on_device(logits, MIXES, list(range(len(MIXES))))
    assert syncs.calls == []  # nothing read back while sampling
    fetch(packed)
    assert syncs.calls == ["cpu", "tolist"]  # one copy to the host, read once there


def test_greedy_only_batch_skips_the_sampling_work(monkeypatch):
    called = []
    monkeypatch.setattr(sampler_device, "_noise", lambda *a: called.append(a))
    logits = _rows(4, 7)
    assert [t for t, _ in sample_batch(logits, [Sampling()] * 4, [0] * 4)] == (
        torch.argmax(logits, -1).tolist()
    )
    assert called == []
