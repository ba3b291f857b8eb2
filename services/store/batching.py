"""Small helpers of the store client's batched calls: awaiting one coroutine per peer
without a task when there is only one (the common case), and one source region per key."""

from __future__ import annotations

import asyncio
from collections.abc import Sequence


async def run_all(coros) -> None:
    """``asyncio.gather`` of coroutines returning None, without its task per coroutine
    when there is only one (a single-peer call: the common case)."""
    cs = list(coros)
    if len(cs) == 1:
        await cs[0]
    elif cs:
        await asyncio.gather(*cs)


async def gather_results(coros: list) -> list:
    """The results of ``coros`` in order; a single one awaited directly (no task)."""
    if len(coros) == 1:
        return [await coros[0]]
    return list(await asyncio.gather(*coros)) if coros else []


def per_key(region_id: int | Sequence[int], n: int) -> Sequence[int]:
    """One source region per key: ``region_id`` for all, or the sequence given."""
    return [region_id] * n if isinstance(region_id, int) else region_id
