"""Sampling parameters: what a request asks of the sampler, validated where it enters
(the conductor) without the engine. The sampler itself is
:mod:`kvmesh.services.engine.sampling`."""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass

# The proto fields' wire types (protos/kvmesh.proto): what a value must fit before it is
# set on a message (protobuf raises ValueError on anything wider). Front ends that take
# numbers in a wider type (JSON) range-check against these, with a message to the caller.
INT32_MAX = 2**31 - 1
UINT64_MAX = 2**64 - 1
FLOAT32_MAX = 3.4028234663852886e38


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
            return (
                f"sampling.top_k must be an integer from 0 (off) to the vocabulary size "
                f"{vocab_size}, got {self.top_k}"
            )
        return None


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
