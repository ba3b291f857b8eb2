"""The prefill node's side of admission: a request that can no longer meet its TTFT SLO is
refused before any work, rather than computed late.

The conductor admits a request on an estimate made at admission time. When the node then
runs slower than that estimate (other processes take its CPU, a long prompt ahead ran
long), the requests queued behind are late before they start. Each carries the time left
for its first token (``deadline_ms``) and the conductor's estimate of the node's time on
it (``expected_ms``); the node scales that estimate by how much slower than estimated its
recent requests ran (:class:`Slowdown`) and refuses a request once the scaled time no
longer fits: while it waits (at the latest start that still fits) or when its turn comes.
"""

from __future__ import annotations

import time
from collections import deque
from dataclasses import dataclass


class TooLate(Exception):
    """A request refused because it can no longer finish inside its deadline; the message
    says by how much."""


class Slowdown:
    """How much slower than the conductor's estimates this node runs now: the ratio of
    measured to estimated slot time of the last ``window`` requests that carried an
    estimate and ended within the last ``horizon_s`` seconds. The factor is the larger of
    the latest ratio and their mean, so a node that has just slowed down counts as slow
    at once, and one that recovers counts as recovered once its recent requests agree.
    1.0 without a recent sample: one stall (a request held up for seconds) must not keep
    the node refusing work after it, and the conductor's own estimate catches up with a
    lasting change of speed (it scales by the node's measured rate)."""

    def __init__(self, window: int = 4, horizon_s: float = 3.0) -> None:
        self.horizon_s = horizon_s
        self._samples: deque[tuple[float, float]] = deque(maxlen=window)  # (ended, ratio)

    def observe(self, expected_ms: float, actual_ms: float, now: float | None = None) -> None:
        if expected_ms > 0 and actual_ms >= 0:
            now = time.perf_counter() if now is None else now
            self._samples.append((now, actual_ms / expected_ms))

    def factor(self, now: float | None = None) -> float:
        now = time.perf_counter() if now is None else now
        recent = [r for t, r in self._samples if now - t <= self.horizon_s]
        if not recent:
            return 1.0
        return max(recent[-1], sum(recent) / len(recent))


@dataclass
class Deadline:
    """One request's deadline on this node: ``at`` (``time.perf_counter`` seconds) is when
    its first token is due back at the conductor, ``expected_ms`` the conductor's estimate
    of the node's time on it."""

    at: float
    expected_ms: float

    @classmethod
    def of(cls, deadline_ms: float, expected_ms: float, now: float | None = None):
        """The request's deadline, or None when it carries none (``deadline_ms`` 0)."""
        if deadline_ms <= 0:
            return None
        now = time.perf_counter() if now is None else now
        return cls(now + deadline_ms / 1000, max(0.0, expected_ms))

    def wait_limit_s(self, slowdown: Slowdown, now: float | None = None) -> float:
        """How long the request may still wait for the compute slot (<= 0: not at all)."""
        now = time.perf_counter() if now is None else now
        return self.at - now - self.expected_ms * slowdown.factor(now) / 1000

    def check(self, slowdown: Slowdown, waited_s: float, now: float | None = None) -> None:
        """Raises :class:`TooLate` when the request, starting now, would finish after its
        deadline: its estimate scaled by how much slower than estimated the node runs."""
        now = time.perf_counter() if now is None else now
        f = slowdown.factor(now)
        need = self.expected_ms * f / 1000
        if now + need > self.at:
            raise TooLate(
                f"it waited {waited_s * 1000:.0f} ms for the compute slot and needs "
                f"~{need * 1000:.0f} ms more (the estimate of {self.expected_ms:.0f} ms x "
                f"{f:.2f}, how much slower than estimated this node runs now), "
                f"{(now + need - self.at) * 1000:.0f} ms past its TTFT deadline"
            )
