"""Request ids whose ``Release`` reached the decode node before their ``Reserve``.

A conductor whose client goes away while its ``Reserve`` is in flight sends ``Release``
at once, on a call of its own: the two race, and the node may see the ``Release`` first
(nothing to free yet) and the ``Reserve`` after it. Without a memory of the release, that
late ``Reserve`` would take KV blocks that nobody will ever decode or release (the reaper
frees them only after ``reservation_timeout_s``). The node remembers each id released
before it was reserved for ``ttl_s`` (the reaper's own bound: a ``Reserve`` later than that
would be reaped anyway), at most ``cap`` of them, and refuses a ``Reserve`` of one."""

from __future__ import annotations

import collections
import time
from collections.abc import Callable


class EarlyReleases:
    def __init__(
        self, ttl_s: float, cap: int = 100_000, clock: Callable[[], float] = time.monotonic
    ) -> None:
        self.ttl_s, self.cap, self._clock = ttl_s, cap, clock
        # id -> when it is forgotten; in the order noted (so expiry pops from the front)
        self._ids: collections.OrderedDict[str, float] = collections.OrderedDict()

    def note(self, request_id: str) -> None:
        """``request_id`` was released while the node held no reservation for it."""
        now = self._clock()
        self._expire(now)
        self._ids[request_id] = now + self.ttl_s
        self._ids.move_to_end(request_id)
        while len(self._ids) > self.cap:  # the oldest go first
            self._ids.popitem(last=False)

    def released(self, request_id: str) -> bool:
        """Whether a ``Reserve`` of ``request_id`` comes after its ``Release``."""
        self._expire(self._clock())
        return request_id in self._ids

    def _expire(self, now: float) -> None:
        while self._ids:
            rid, until = next(iter(self._ids.items()))
            if until > now:
                return
            del self._ids[rid]

    def __len__(self) -> int:
        return len(self._ids)
