"""A sliding window of numbers kept sorted as it slides, for the conductor's medians and
quantiles over recent requests: each new number costs a binary search and a move of
pointers, not a sort of the window (the learned overheads, the error tail and the
nodes' measured rates are read after every booked request)."""

from __future__ import annotations

import statistics
from collections import deque
from collections.abc import Iterable, Iterator

from kvmesh.services.conductor import _sorted


class RollingWindow:
    """The last ``maxlen`` numbers in arrival order and in sorted order.

    ``median()`` and ``sorted()`` equal ``statistics.median`` and ``sorted`` of the
    window. A NaN is kept in arrival order only; while one is in the window they fall
    back to those functions themselves (a NaN has no place in a sorted order)."""

    __slots__ = ("_items", "_sorted", "_nans", "_maxlen")

    def __init__(self, maxlen: int, items: Iterable[float] = ()) -> None:
        self._items: deque[float] = deque(items, maxlen=maxlen)
        self._maxlen = maxlen
        kept = [x for x in self._items if x == x]
        self._nans = len(self._items) - len(kept)
        kept.sort()
        self._sorted: list[float] = kept

    def refill(self, items: Iterable[float]) -> None:
        """Replaces the window's numbers with ``items`` (as a new window of the same
        length would hold them; no new objects for a list that is not this window's)."""
        if type(items) is not list:  # (this window itself, a generator over it, ...)
            items = list(items)
        self._items.clear()
        self._items.extend(items)
        kept = [x for x in self._items if x == x]
        self._nans = len(self._items) - len(kept)
        kept.sort()
        self._sorted = kept

    def append(self, x: float) -> None:
        items = self._items
        if len(items) == self._maxlen:
            old = items[0]
            if old != old:
                self._nans -= 1
            else:
                s = self._sorted
                del s[_sorted.bisect_left(s, old)]
        items.append(x)
        if x != x:
            self._nans += 1
        else:
            _sorted.insort(self._sorted, x)

    def sorted(self) -> list[float]:
        """The window sorted (the caller must not change the list)."""
        return self._sorted if not self._nans else sorted(self._items)

    def tail(self, k: int) -> list[float]:
        """The last ``k`` numbers (or all, if fewer), newest first."""
        items = self._items
        return [items[-i] for i in range(1, min(k, len(items)) + 1)]

    def median(self) -> float:
        if self._nans or not self._sorted:
            return statistics.median(self._items)
        s = self._sorted
        n = len(s)
        if n % 2:
            return s[n // 2]
        return (s[n // 2 - 1] + s[n // 2]) / 2

    def clear(self) -> None:
        self._items.clear()
        self._sorted.clear()
        self._nans = 0

    def __len__(self) -> int:
        return len(self._items)

    def __iter__(self) -> Iterator[float]:
        return iter(self._items)

    def __getitem__(self, i: int) -> float:
        return self._items[i]
