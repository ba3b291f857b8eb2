"""Token sampling: greedy at temperature 0, else temperature / top-k / top-p with a
per-request generator so a seeded request is reproducible on any node."""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class Sampling:
    temperature: float = 0.0
    top_p: float = 0.0
    top_k: int = 0
    seed: int = 0
    ignore_eos: bool = False

    @classmethod
    def from_proto(cls, p) -> "Sampling":
        return cls(temperature=p.temperature, top_p=p.top_p, top_k=p.top_k, seed=p.seed,
                   ignore_eos=p.ignore_eos)

    def validate(self, vocab_size: int) -> str | None:
        """A message naming the bad field, or None."""
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


def sample(logits: torch.Tensor, s: Sampling, step: int = 0) -> int:
    """One token from ``logits`` [vocab]; ``step`` is the token's index in the output,
    which keeps seeded sampling identical whichever node samples which token."""
    if s.temperature == 0:
        return int(torch.argmax(logits).item())
    logits = logits.float() / s.temperature
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
    return int(torch.multinomial(probs, 1, generator=make_generator(s, step)).item())
