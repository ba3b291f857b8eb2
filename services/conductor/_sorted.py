"""Binary search and insertion in sorted lists of floats, for the conductor's hot paths
(the decode nodes' joins and ends, the rolling windows, the least-queued order).

As plain Python these are the ``bisect`` module's own functions. Where setup.py compiled
a module that uses them, that module gets the typed inline versions in ``_sorted.pxd``
instead: the same search over the list's items read as C doubles (the same answers on
lists of floats and ints below 2**53; no NaN is ever kept in these lists)."""

from bisect import bisect_left, bisect_right, insort

# the least-queued order's keys, (queue ms, node id) tuples (queue_order.py)
bisect_left_key = bisect_left
insort_key = insort

__all__ = ["bisect_left", "bisect_left_key", "bisect_right", "insort", "insort_key"]
