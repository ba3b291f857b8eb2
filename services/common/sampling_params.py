"""Sampling parameters: what a request asks of the sampler, validated where it enters
(the conductor) without the engine. The sampler itself is
:mod:`kvmesh.services.engine.sampling`."""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass

from kvmesh.services.common import limits

# The proto fields' wire types (protos/kvmesh.proto): what a value must fit before it is
# set on a message (protobuf raises ValueError on anything wider). Front ends that take
# numbers in a wider type (JSON) range-check against these, with a message to the caller.
INT32_MAX = 2**31 - 1
UINT64_MAX = 2**64 - 1
FLOAT32_MAX = 3.4028234663852886e38


@dataclass(frozen=True)
class Sampling:
    """A request's sampling parameters (``SamplingParams`` in ``protos/kvmesh.proto``
    says what each does)."""

    temperature: float = 0.0
    top_p: float = 0.0
    top_k: int = 0
    seed: int = 0
    ignore_eos: bool = False
    stop_token_ids: frozenset[int] = frozenset()
    stop: tuple[str, ...] = ()
    logprobs: bool = False
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0  # 1 = off (the proto's 0 reads as 1)
    min_p: float = 0.0
    logit_bias: tuple[tuple[int, float], ...] = ()  # (token id, bias), by id
    min_tokens: int = 0
    top_logprobs: int = 0  # alternatives reported per token (with logprobs)

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
            presence_penalty=p.presence_penalty,
            frequency_penalty=p.frequency_penalty,
            repetition_penalty=p.repetition_penalty or 1.0,
            min_p=p.min_p,
            logit_bias=tuple(sorted(p.logit_bias.items())),
            min_tokens=p.min_tokens,
            top_logprobs=p.top_logprobs,
        )

    @property
    def processes_logits(self) -> bool:
        """Whether the logits change before sampling (penalties, bias, min_tokens)."""
        return bool(
            self.presence_penalty
            or self.frequency_penalty
            or self.repetition_penalty != 1.0
            or self.logit_bias
            or self.min_tokens
        )

    def validate(self, vocab_size: int) -> str | None:
        """A message naming the bad field, or None (the limits: ``common.limits``)."""
        lim = limits
        if len(self.stop_token_ids) > lim.MAX_STOP_TOKEN_IDS:
            return f"sampling.stop_token_ids: at most {lim.MAX_STOP_TOKEN_IDS} ids"
        if any(t < 0 or t >= vocab_size for t in self.stop_token_ids):
            return f"sampling.stop_token_ids must be in [0, {vocab_size})"
        if len(self.stop) > lim.MAX_STOP_STRINGS or any(
            not s or len(s) > lim.MAX_STOP_CHARS for s in self.stop
        ):
            return (
                f"sampling.stop: at most {lim.MAX_STOP_STRINGS} non-empty strings of at "
                f"most {lim.MAX_STOP_CHARS} characters"
            )
        if not 0 <= self.temperature <= lim.TEMPERATURE_MAX:
            return (
                f"sampling.temperature must be in [0, {lim.TEMPERATURE_MAX:g}], "
                f"got {self.temperature:g}"
            )
        if not 0 <= self.top_p <= 1:
            return f"sampling.top_p must be in [0, 1], got {self.top_p:g}"
        if not 0 <= self.top_k <= vocab_size:
            return (
                f"sampling.top_k must be an integer from 0 (off) to the vocabulary size "
                f"{vocab_size}, got {self.top_k}"
            )
        for name in ("presence_penalty", "frequency_penalty"):
            v = getattr(self, name)
            if not -lim.PENALTY_MAX <= v <= lim.PENALTY_MAX:
                return f"sampling.{name} must be in [-{lim.PENALTY_MAX:g}, {lim.PENALTY_MAX:g}], got {v:g}"
        if not 0 < self.repetition_penalty <= lim.REPETITION_PENALTY_MAX:
            return (
                f"sampling.repetition_penalty must be in (0, {lim.REPETITION_PENALTY_MAX:g}] "
                f"(1 or 0 = off), got {self.repetition_penalty:g}"
            )
        if not 0 <= self.min_p <= 1:
            return f"sampling.min_p must be in [0, 1], got {self.min_p:g}"
        if self.top_logprobs > lim.MAX_TOP_LOGPROBS:
            return (
                f"sampling.top_logprobs must be an integer from 0 to {lim.MAX_TOP_LOGPROBS}, "
                f"got {self.top_logprobs}"
            )
        if len(self.logit_bias) > lim.MAX_LOGIT_BIAS_ENTRIES:
            return f"sampling.logit_bias: at most {lim.MAX_LOGIT_BIAS_ENTRIES} token ids"
        for t, b in self.logit_bias:
            if not 0 <= t < vocab_size:
                return f"sampling.logit_bias: token id {t} is not in [0, {vocab_size})"
            if not -lim.LOGIT_BIAS_MAX <= b <= lim.LOGIT_BIAS_MAX:
                return (
                    f"sampling.logit_bias[{t}] must be in [-{lim.LOGIT_BIAS_MAX:g}, "
                    f"{lim.LOGIT_BIAS_MAX:g}], got {b:g}"
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
