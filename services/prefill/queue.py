"""The prefill node's compute slot: one prompt computes at a time, the others wait in
arrival order (each at most as long as its deadline allows); ``depth`` counts the
waiters (what ``Status`` reports as the queue)."""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager


class NotInTime(Exception):
    """A request's turn did not come within the time it could wait."""


class ComputeQueue:
    """A FIFO single slot with a count of its waiters.

    A waiter that is cancelled leaves the queue without ever holding the slot; a holder
    that raises frees it for the next one.
    """

    def __init__(self) -> None:
        self._slot = asyncio.Lock()  # asyncio.Lock wakes its waiters in FIFO order
        self.depth = 0

    @property
    def busy(self) -> bool:
        """Whether a request holds the slot now."""
        return self._slot.locked()

    @asynccontextmanager
    async def turn(self, limit_s: float | None = None) -> AsyncIterator[float]:
        """Waits for this request's turn and holds the slot for the ``async with`` body;
        yields the seconds it waited. With ``limit_s``, a request whose turn has not come
        within that many seconds leaves the queue with :class:`NotInTime` (at once when it
        is not positive)."""
        t0 = time.perf_counter()
        if limit_s is not None and limit_s <= 0:
            raise NotInTime
        self.depth += 1
        try:
            async with asyncio.timeout(limit_s):
                await self._slot.acquire()
        except TimeoutError:
            raise NotInTime from None
        finally:
            self.depth -= 1
        try:
            yield time.perf_counter() - t0
        finally:
            self._slot.release()

    async def idle(self) -> None:
        """Returns once every request queued before this call has had its turn (a drain
        waits here without being counted as a queued request)."""
        async with self._slot:
            pass
