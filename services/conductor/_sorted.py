"""Binary search and insertion in sorted lists of floats, for the conductor's hot paths
(the decode nodes' joins and ends, the rolling windows).

As plain Python these are the ``bisect`` module's own functions. Where setup.py compiled
a module that uses them, that module gets the typed inline versions in ``_sorted.pxd``
instead: the same search over the list's items read as C doubles (the same answers on
lists of floats and ints below 2**53; no NaN is ever kept in these lists)."""

from bisect import bisect_left, bisect_right, insort

__all__ = ["bisect_left", "bisect_right", "insort"]
