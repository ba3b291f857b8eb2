"""Token sampling: greedy at temperature 0, else temperature / top-k / top-p with a
per-request generator so a seeded request is reproducible on any node."""

from __future__ import annotations

import math
from collections.abc import Iterable
from dataclasses import dataclass
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    import torch
else:

    class _LazyTorch:
        """torch on first use: the conductor validates Sampling without ever sampling,
        and importing torch would add seconds to its (re)start."""

        def __getattr__(self, name):
            import torch as _torch

            globals()["torch"] = _torch
            return getattr(_torch, name)

    torch = _LazyTorch()


@dataclass(frozen=True)
class Sampling:
    temperature: float = 0.0
    top_p: float = 0.0
    top_k: int = 0
    seed: int = 0
    ignore_eos: bool = False
    stop_token_ids: frozenset[int] = frozenset()
    stop: tuple[str, ...] = ()
    logprobs: bool = False

    @classmethod
    def from_proto(cls, p) -> Sampling:
        return cls(
            temperature=p.temperature,
            top_p=p.top_p,
            top_k=p.top_k,
            seed=p.seed,
            ignore_eos=p.ignore_eos,
            stop_token_ids=frozenset(p.stop_token_ids),
            stop=tuple(p.stop),
            logprobs=p.logprobs,
        )

    def validate(self, vocab_size: int) -> str | None:
        """A message naming the bad field, or None."""
        if len(self.stop_token_ids) > 64:
            return "sampling.stop_token_ids: at most 64 ids"
        if any(t < 0 or t >= vocab_size for t in self.stop_token_ids):
            return f"sampling.stop_token_ids must be in [0, {vocab_size})"
        if len(self.stop) > 16 or any(not s or len(s) > 256 for s in self.stop):
            return "sampling.stop: at most 16 non-empty strings of at most 256 characters"
        if not self.temperature >= 0 or self.temperature > 100:
            return f"sampling.temperature must be in [0, 100], got {self.temperature}"
        if not 0 <= self.top_p <= 1:
            return f"sampling.top_p must be in [0, 1], got {self.top_p}"
        if not 0 <= self.top_k <= vocab_size:
            return f"sampling.top_k must be in [0, {vocab_size}], got {self.top_k}"
        return None


def make_generator(s: Sampling, step: int = 0) -> torch.Generator | None:
    if s.temperature == 0:
        return None
    g = torch.Generator()
    g.manual_seed((s.seed * 1_000_003 + step) & 0x7FFF_FFFF_FFFF_FFFF)
    return g


def _probs(logits: torch.Tensor, s: Sampling) -> torch.Tensor:
    """Sampling distribution after temperature, top-k and top-p (float32 [vocab])."""
    logits = logits.float().reshape(-1) / s.temperature
    if s.top_k:
        kth = torch.topk(logits, s.top_k).values[-1]
        logits = logits.masked_fill(logits < kth, float("-inf"))
    probs = torch.softmax(logits, dim=-1)
    if 0 < s.top_p < 1:
        sorted_p, idx = torch.sort(probs, descending=True)
        keep = torch.cumsum(sorted_p, 0) - sorted_p < s.top_p
        mask = torch.zeros_like(probs, dtype=torch.bool).scatter(0, idx[keep], True)
        probs = probs.masked_fill(~mask, 0)
        probs = probs / probs.sum()
    return probs


def sample(logits: torch.Tensor, s: Sampling, step: int = 0) -> int:
    """One token from ``logits`` [vocab]; ``step`` is the token's index in the output,
    which keeps seeded sampling identical whichever node samples which token (and
    whatever else is in the batch: each request has its own generator)."""
    if s.temperature == 0:
        return int(torch.argmax(logits).item())
    probs = _probs(logits, s)
    return int(torch.multinomial(probs, 1, generator=make_generator(s, step)).item())


def sample_with_logprob(logits: torch.Tensor, s: Sampling, step: int = 0) -> tuple[int, float]:
    """Like :func:`sample`, plus the chosen token's log-probability under the model's
    distribution (``log_softmax`` of the raw logits, i.e. before temperature/top-k/top-p,
    as OpenAI-style ``logprobs`` report it)."""
    tok = sample(logits, s, step)
    lp = float(torch.log_softmax(logits.float().reshape(-1), dim=-1)[tok])
    return tok, (lp if not math.isnan(lp) else float("-inf"))


def find_stop(text: str, stops: Iterable[str], start: int = 0) -> int | None:
    """Truncation point for stop strings: the index in ``text`` where the earliest
    occurrence (at or after ``start``) of any non-empty stop string begins, or None.

    Output is ``text[:find_stop(...)]``; the stop string itself is excluded. To scan
    only new text when streaming, pass ``start = max(0, old_len - max(len(stop)) + 1)``.
    """
    best: int | None = None
    for stop in stops:
        if not stop:
            continue
        i = text.find(stop, start)
        if i >= 0 and (best is None or i < best):
            best = i
    return best
