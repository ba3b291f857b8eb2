"""Token sampling (torch): greedy at temperature 0, else temperature / top-k / min-p /
top-p with a per-request generator so a seeded request is reproducible on any node. One
row on the CPU here; a batch, or a row on a GPU, in :mod:`.sampler_device` (the same
tokens). Before either, :func:`~.sampler_device.process_logits` applies the request's
logit bias, min_tokens and penalties from its own tokens (:class:`~.sampler_device.History`)."""

from __future__ import annotations

import math

import torch

from kvmesh.services.common.sampling_params import Sampling

from .sampler_device import History, make_generator, process_logits, sample_batch


def _probs(logits: torch.Tensor, s: Sampling) -> torch.Tensor:
    """Sampling distribution after temperature, top-k, min-p and top-p (float32 [vocab])."""
    logits = logits.float().reshape(-1) / s.temperature
    if s.top_k:
        kth = torch.topk(logits, s.top_k).values[-1]
        logits = logits.masked_fill(logits < kth, float("-inf"))
    probs = torch.softmax(logits, dim=-1)
    if s.min_p > 0:
        probs = probs.masked_fill(probs < s.min_p * probs.max(), 0)
        probs = probs / probs.sum()
    if 0 < s.top_p < 1:
        sorted_p, idx = torch.sort(probs, descending=True)
        keep = torch.cumsum(sorted_p, 0) - sorted_p < s.top_p
        mask = torch.zeros_like(probs, dtype=torch.bool).scatter(0, idx[keep], True)
        probs = probs.masked_fill(~mask, 0)
        probs = probs / probs.sum()
    return probs


def sample(logits: torch.Tensor, s: Sampling, step: int = 0, hist: History | None = None) -> int:
    """One token from ``logits`` [vocab]; ``step`` is the token's index in the output,
    which keeps seeded sampling identical whichever node samples which token (and
    whatever else is in the batch: each request has its own generator). ``hist``: the
    request's tokens, for its logits processing (needed when ``s.processes_logits``)."""
    if s.processes_logits:
        logits = process_logits(logits.reshape(-1), s, hist or History())
    if s.temperature == 0:
        return int(torch.argmax(logits).item())
    probs = _probs(logits, s)
    return int(torch.multinomial(probs, 1, generator=make_generator(s, step)).item())


def sample_with_logprob(
    logits: torch.Tensor, s: Sampling, step: int = 0, hist: History | None = None
) -> tuple[int, float]:
    """Like :func:`sample`, plus the chosen token's log-probability under the model's
    distribution (``log_softmax`` of the raw logits, i.e. before any processing and
    temperature/top-k/top-p, as OpenAI-style ``logprobs`` report it)."""
    if logits.device.type != "cpu":  # one sync, and a CPU generator's noise (not CUDA's)
        return sample_batch(logits.reshape(1, -1), [s], [step], [hist or History()])[0]
    tok = sample(logits, s, step, hist)
    lp = float(torch.log_softmax(logits.float().reshape(-1), dim=-1)[tok])
    return tok, (lp if not math.isnan(lp) else float("-inf"))
