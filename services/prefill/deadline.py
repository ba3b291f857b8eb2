"""The prefill node's side of admission: a request that can no longer meet its TTFT SLO is
refused before any work, rather than computed late.

The conductor admits a request on an estimate made at admission time. When the node then
runs slower than that estimate (other processes take its CPU, a long prompt ahead ran
long), the requests queued behind are late before they start. Each carries the time left
for its first token (``deadline_ms``) and the conductor's estimate of the node's time on
it (``expected_ms``); the node scales that estimate by how much slower than estimated its
recent requests ran (:class:`Slowdown`) and refuses a request once the scaled time no
longer fits: while it waits (re-checked as the node's speed changes, keeping its place in
the queue) or when its turn comes.
"""

from __future__ import annotations

import time
from collections import deque
from dataclasses import dataclass


class TooLate(Exception):
    """A request refused because it can no longer finish inside its deadline; the message
    says by how much."""


class Slowdown:
    """How much slower than the conductor's estimates this node runs now, from the last
    ``window`` requests that ended within the last ``horizon_s`` seconds: the larger of the
    latest one's measured / estimated slot time and the window's total measured / total
    estimated, at most ``cap``. A node that has just slowed down counts as slow at once;
    one that recovers, once its recent requests agree. 1.0 without a recent sample.

    A sample counts only when it says something about speed: an estimate of at least
    ``min_expected_ms`` (fixed per-request costs swamp smaller ones), and a request that
    computed no more tokens than its estimate assumed (one whose cached prefix was gone
    took longer for another reason). The horizon and the cap keep one stall from keeping
    the node refusing work: the conductor's own estimate catches up with a lasting change
    of speed, since it scales by the node's measured rate."""

    def __init__(
        self,
        window: int = 4,
        horizon_s: float = 3.0,
        cap: float = 3.0,
        min_expected_ms: float = 5.0,
    ) -> None:
        self.horizon_s, self.cap, self.min_expected_ms = horizon_s, cap, min_expected_ms
        # (ended, estimated ms, measured ms)
        self._samples: deque[tuple[float, float, float]] = deque(maxlen=window)

    def observe(
        self,
        expected_ms: float,
        actual_ms: float,
        now: float | None = None,
        expected_tokens: int = 0,
        computed_tokens: int = 0,
    ) -> None:
        if expected_ms < self.min_expected_ms or actual_ms < 0:
            return
        if expected_tokens and computed_tokens > expected_tokens:
            return
        now = time.perf_counter() if now is None else now
        self._samples.append((now, expected_ms, actual_ms))

    def factor(self, now: float | None = None) -> float:
        now = time.perf_counter() if now is None else now
        recent = [(e, a) for t, e, a in self._samples if now - t <= self.horizon_s]
        if not recent:
            return 1.0
        latest = recent[-1][1] / recent[-1][0]
        total = sum(a for _, a in recent) / sum(e for e, _ in recent)
        return min(self.cap, max(latest, total))


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
        if self.expected_ms * slowdown.factor(now) / 1000 > self.at - now:
            raise self.too_late(slowdown, waited_s, now)

    def too_late(self, slowdown: Slowdown, waited_s: float, now: float | None = None) -> TooLate:
        """The refusal, saying by how much the request would miss."""
        now = time.perf_counter() if now is None else now
        f = slowdown.factor(now)
        need = self.expected_ms * f / 1000
        return TooLate(
            f"it waited {waited_s * 1000:.0f} ms for the compute slot and needs "
            f"~{need * 1000:.0f} ms more (the estimate of {self.expected_ms:.0f} ms x "
            f"{f:.2f}, how much slower than estimated this node runs now), "
            f"{max(0.0, now + need - self.at) * 1000:.0f} ms past its TTFT deadline"
        )
