"""Sampling a whole decode batch where its logits are (the GPU, or the CPU), with one
host sync per step: the sampled ids and their log-probabilities come back in a single
device-to-host copy (:func:`fetch`).

It draws the same tokens as :func:`kvmesh.services.engine.sampling.sample` row by row,
on the CPU bit for bit (tests/test_sampler_device.py compares):

* greedy rows (temperature 0): ``argmax`` of the logits;
* sampled rows: temperature, top-k and top-p as ``sampling._probs`` computes them,
  batched (each row's own parameters as a column of values), then the draw
  ``torch.multinomial(probs, 1, generator=g)`` makes for one sample: ``argmax(probs / q)``
  with ``q ~ Exp(1)`` per vocabulary entry, drawn from the request's own seeded CPU
  generator (``make_generator(s, step)``). The noise is drawn on the host, where it does
  not depend on any device value, and goes to the device in one non-blocking copy, so a
  seeded request draws the same numbers on a CPU node and on a GPU node; the GPU's own
  softmax may round differently, so across devices tokens are equal where no two
  candidates are within rounding of each other.

A row whose distribution is not a distribution (NaN or inf after a temperature close to
0, which :func:`sampling.sample` refuses with an error) takes the greedy token: the
limit of a temperature going to 0.

Nothing in :func:`sample_on_device` reads a device value on the host: the choices of
code path depend only on the requests' parameters.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

import torch

from kvmesh.services.common.sampling_params import Sampling


@dataclass(frozen=True)
class History:
    """A request's own tokens, all its logits processing reads: the same on any node, so
    a request moved or retried elsewhere samples the same tokens."""

    prompt: Sequence[int] = ()
    output: Sequence[int] = ()  # its output so far (the token being drawn is next)
    eos_ids: frozenset[int] = frozenset()  # barred, with stop_token_ids, before min_tokens


def process_logits(row: torch.Tensor, s: Sampling, hist: History) -> torch.Tensor:
    """Request ``s``'s logits [vocab] before sampling, as float32 on ``row``'s device (the
    order vLLM applies them): ``logit_bias`` added; EOS and ``stop_token_ids`` at -inf
    while the output is shorter than ``min_tokens``; ``repetition_penalty`` over the
    tokens of the prompt and the output (a positive logit divided by it, a negative one
    multiplied); ``frequency_penalty`` times each token's count in the output and
    ``presence_penalty`` for each token in it, subtracted. Reads no device value, and
    its host tensors go over in non-blocking copies: no sync."""
    dev = row.device
    x = row.float().reshape(-1).clone()
    vocab = x.shape[0]
    if s.logit_bias:
        ids = torch.tensor([t for t, _ in s.logit_bias], dtype=torch.long)
        vals = torch.tensor([b for _, b in s.logit_bias], dtype=torch.float32)
        x.index_add_(0, _to(ids, dev), _to(vals, dev))
    if s.min_tokens and len(hist.output) < s.min_tokens:
        banned = sorted(t for t in hist.eos_ids | s.stop_token_ids if 0 <= t < vocab)
        if banned:
            x.index_fill_(0, _to(torch.tensor(banned, dtype=torch.long), dev), float("-inf"))
    if s.repetition_penalty != 1.0 and (hist.prompt or hist.output):
        ids = torch.tensor([*hist.prompt, *hist.output], dtype=torch.long)
        seen = _to(torch.zeros(vocab, dtype=torch.bool).index_fill_(0, ids, True), dev)
        p = s.repetition_penalty
        x = torch.where(seen, torch.where(x > 0, x / p, x * p), x)
    if hist.output and (s.frequency_penalty or s.presence_penalty):
        counts = torch.bincount(torch.tensor(list(hist.output), dtype=torch.long), minlength=vocab)
        counts = _to(counts[:vocab].float(), dev)
        x = x - s.frequency_penalty * counts - s.presence_penalty * (counts > 0).float()
    return x


def make_generator(s: Sampling, step: int = 0) -> torch.Generator | None:
    """The CPU generator of request ``s``'s token ``step`` (None when greedy): seeded
    from the request's seed and the token's index, so a seeded request draws the same
    numbers on any node, whatever else is in the batch."""
    if s.temperature == 0:
        return None
    g = torch.Generator()
    g.manual_seed((s.seed * 1_000_003 + step) & 0x7FFF_FFFF_FFFF_FFFF)
    return g


def _to(t: torch.Tensor, device: torch.device) -> torch.Tensor:
    """A host tensor on ``device`` without a sync: pinned and non-blocking on CUDA."""
    if device.type == "cpu":
        return t
    return t.pin_memory().to(device, non_blocking=True)


def _noise(samplings: Sequence[Sampling], steps: Sequence[int], rows: list[int], vocab: int):
    """``Exp(1)`` noise [len(rows), vocab] float32 on the host, row ``j`` from request
    ``rows[j]``'s generator: the numbers ``torch.multinomial`` would draw for it."""
    q = torch.empty((len(rows), vocab), dtype=torch.float32)
    for j, i in enumerate(rows):
        q[j].exponential_(1, generator=make_generator(samplings[i], steps[i]))
    return q


def _sampled_probs(
    logits: torch.Tensor, samplings: Sequence[Sampling], rows: list[int]
) -> torch.Tensor:
    """``sampling._probs`` of each row of ``logits`` [n, vocab] (float32), request
    ``rows[j]``'s parameters for row ``j``."""
    dev = logits.device
    params = [samplings[i] for i in rows]
    temps = _to(torch.tensor([[s.temperature] for s in params], dtype=torch.float32), dev)
    x = logits.float() / temps
    ks = [s.top_k for s in params]
    kmax = max(ks)
    if kmax:
        kth = torch.topk(x, kmax, dim=-1).values
        k = _to(torch.tensor([[max(v, 1) - 1] for v in ks], dtype=torch.long), dev)
        on = _to(torch.tensor([[v > 0] for v in ks]), dev)
        kth = torch.where(on, kth.gather(1, k), float("-inf"))
        x = x.masked_fill(x < kth, float("-inf"))
    probs = torch.softmax(x, dim=-1)
    mj = [j for j, s in enumerate(params) if s.min_p > 0]
    if mj:  # (rows without min_p untouched: the same bits as sampling._probs)
        idx = _to(torch.tensor(mj, dtype=torch.long), dev)
        sub = probs.index_select(0, idx)
        mp = _to(torch.tensor([[params[j].min_p] for j in mj], dtype=torch.float32), dev)
        sub = sub.masked_fill(sub < mp * sub.max(dim=-1, keepdim=True).values, 0)
        sub = sub / sub.sum(dim=-1, keepdim=True)
        probs = probs.index_copy(0, idx, sub)
    pj = [j for j, s in enumerate(params) if 0 < s.top_p < 1]
    if pj:
        idx = _to(torch.tensor(pj, dtype=torch.long), dev)
        sub = probs.index_select(0, idx)
        top_p = _to(torch.tensor([[params[j].top_p] for j in pj], dtype=torch.float32), dev)
        sorted_p, order = torch.sort(sub, dim=-1, descending=True)
        keep = torch.cumsum(sorted_p, dim=-1) - sorted_p < top_p
        mask = torch.zeros_like(sub, dtype=torch.bool).scatter(1, order, keep)
        sub = sub.masked_fill(~mask, 0)
        sub = sub / sub.sum(dim=-1, keepdim=True)
        probs = probs.index_copy(0, idx, sub)
    return probs


def sample_on_device(
    logits: torch.Tensor,
    samplings: Sequence[Sampling],
    steps: Sequence[int],
    raw: torch.Tensor | None = None,
) -> torch.Tensor:
    """Tokens and log-probabilities for a batch, left on ``logits``' device.

    ``logits`` [B, vocab] (any float dtype); ``samplings[i]`` and ``steps[i]`` (the
    token's index in request ``i``'s output, as :func:`sampling.sample` takes it) for
    row ``i``. Returns float64 [B, 2]: the token id (exact in float64) and its
    log-probability under the raw logits (``log_softmax`` before temperature, top-k and
    top-p, as :func:`sampling.sample_with_logprob` reports it; of ``raw`` when given: the
    logits before :func:`process_logits`). No host sync."""
    b, vocab = logits.shape
    if not (b == len(samplings) == len(steps)):
        raise ValueError(
            f"logits has {b} rows for {len(samplings)} samplings and {len(steps)} steps"
        )
    dev = logits.device
    tok = torch.argmax(logits, dim=-1)
    rows = [i for i, s in enumerate(samplings) if s.temperature != 0]
    if rows:
        idx = _to(torch.tensor(rows, dtype=torch.long), dev)
        probs = _sampled_probs(logits.index_select(0, idx), samplings, rows)
        q = _to(_noise(samplings, steps, rows, vocab), dev)
        drawn = torch.argmax(probs / q, dim=-1)
        ok = torch.isfinite(probs).all(dim=-1) & (probs >= 0).all(dim=-1)
        tok = tok.index_copy(0, idx, torch.where(ok, drawn, tok.index_select(0, idx)))
    src = logits if raw is None else raw
    lp = torch.log_softmax(src.float(), dim=-1).gather(1, tok[:, None])[:, 0]
    return torch.stack((tok.double(), lp.double()), dim=1)


def fetch(packed: torch.Tensor) -> list[tuple[int, float]]:
    """The one host sync of a step: ``(token, logprob)`` per row of
    :func:`sample_on_device`'s result (a NaN log-probability reads as ``-inf``)."""
    out = []
    for t, lp in packed.cpu().tolist():
        out.append((int(t), lp if not math.isnan(lp) else float("-inf")))
    return out


def top_alternatives(logits: torch.Tensor, ks: Sequence[int]) -> list[list[tuple[int, float]]]:
    """Row ``i``'s ``ks[i]`` most likely tokens and their log-probabilities under the raw
    logits [B, vocab] (most likely first; ``[]`` where ``ks[i]`` is 0): what ``logprobs``
    with ``top_logprobs`` report. One host copy, only for a batch that asks."""
    k = max(ks, default=0)
    if k <= 0:
        return [[] for _ in ks]
    vals, idx = torch.topk(torch.log_softmax(logits.float(), dim=-1), k, dim=-1)
    packed = torch.stack((idx.double(), vals.double()), dim=-1).cpu().tolist()
    return [
        [(int(t), lp if math.isfinite(lp) else float("-inf")) for t, lp in row[:n]]
        for row, n in zip(packed, ks, strict=True)
    ]


def sample_batch(
    logits: torch.Tensor,
    samplings: Sequence[Sampling],
    steps: Sequence[int],
    hists: Sequence[History] | None = None,
) -> list[tuple[int, float]]:
    """:func:`sample_on_device` then :func:`fetch`: a batch's ``(token, logprob)``s;
    rows whose request processes its logits do so first, from ``hists[i]``."""
    rows = [i for i, s in enumerate(samplings) if s.processes_logits]
    if not rows:
        return fetch(sample_on_device(logits, samplings, steps))
    processed = logits.float().clone()
    for i in rows:
        processed[i] = process_logits(logits[i], samplings[i], hists[i] if hists else History())
    return fetch(sample_on_device(processed, samplings, steps, raw=logits))
