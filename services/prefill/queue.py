"""The prefill node's compute slot: one prompt computes at a time, the others wait in
arrival order (each at most as long as its deadline allows); ``depth`` counts the
waiters (what ``Status`` reports as the queue)."""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator, Callable
from contextlib import asynccontextmanager

RECHECK_S = 0.25  # a waiter with a limit looks at it again at least this often


class NotInTime(Exception):
    """A request's turn did not come within the time it could wait."""


class ComputeQueue:
    """A FIFO single slot with a count of its waiters.

    A waiter that is cancelled, or whose limit runs out, leaves the queue without ever
    holding the slot; a holder that raises frees it for the next one.
    """

    def __init__(self) -> None:
        self._slot = asyncio.Lock()  # asyncio.Lock wakes its waiters in FIFO order
        self.depth = 0
        self.waited = asyncio.Event()  # set while a request waits (a warm-up yields to it)

    @property
    def busy(self) -> bool:
        """Whether a request holds the slot now."""
        return self._slot.locked()

    @asynccontextmanager
    async def turn(self, limit: Callable[[], float] | None = None) -> AsyncIterator[float]:
        """Waits for this request's turn and holds the slot for the ``async with`` body;
        yields the seconds it waited. With ``limit`` (the seconds it may still wait, asked
        again as time passes: what it returns may change), a request whose limit runs out
        first leaves the queue with :class:`NotInTime` (at once when it is not positive);
        until then it keeps its place."""
        t0 = time.perf_counter()
        if limit is not None and limit() <= 0:
            raise NotInTime
        self.depth += 1
        self.waited.set()
        try:
            if limit is None:
                await self._slot.acquire()
            else:
                await self._acquire_within(limit)
        finally:
            self.depth -= 1
            if not self.depth:
                self.waited.clear()
        try:
            yield time.perf_counter() - t0
        finally:
            self._slot.release()

    async def _acquire_within(self, limit: Callable[[], float]) -> None:
        acquire = asyncio.ensure_future(self._slot.acquire())
        try:
            while not acquire.done():
                left = limit()
                if left <= 0:
                    break
                await asyncio.wait({acquire}, timeout=min(left, RECHECK_S))
        except BaseException:  # this request was cancelled while it waited
            await self._abandon(acquire)
            raise
        if not acquire.done():
            await self._abandon(acquire)
            raise NotInTime
        acquire.result()

    async def _abandon(self, acquire: asyncio.Future) -> None:
        """Leaves the queue: a slot the waiter got meanwhile goes to the next one."""
        acquire.cancel()  # Lock.acquire passes on a slot it was handed as it is cancelled
        await asyncio.wait({acquire})
        if not acquire.cancelled() and acquire.exception() is None:
            self._slot.release()

    async def idle(self) -> None:
        """Returns once every request queued before this call has had its turn (a drain
        waits here without being counted as a queued request)."""
        async with self._slot:
            pass
