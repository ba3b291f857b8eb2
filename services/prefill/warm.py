"""A prefill node's warm-ups (``PrefillRequest.warm``): a prompt's full blocks computed
into its prefix cache and the store for the requests that will share them, only while
no request holds or waits for the compute slot, and stopped, at the next chunk of at
most ``WARM_CHUNK_TOKENS``, for the first request that comes to wait."""

from __future__ import annotations

import asyncio
import time
from typing import Any

from kvmesh.protos import kvmesh_pb2 as pb
from kvmesh.services.common import metrics as kvm
from kvmesh.services.prefill.prompt import Prompt

# a warm-up computes in chunks of at most this many tokens (whole blocks, at least one):
# the longest a request that comes to wait for the slot waits for it
WARM_CHUNK_TOKENS = 128


class WarmYielded(Exception):
    """A warm-up did not run, or stopped, for a request that needed the compute slot."""


async def warm_up(node: Any, req: pb.PrefillRequest) -> pb.PrefillResponse:
    """The warm-up of ``req``'s full blocks on ``node`` (a ``PrefillNode``; not imported
    here, which imports this module) (module docstring): only with the compute
    slot free and no one waiting, given up (:class:`WarmYielded`) for the first
    request that comes to wait."""
    if node.compute.busy or node.compute.depth:
        kvm.PREFILL_WARMS.labels("busy").inc()
        raise WarmYielded("the node is busy")
    task = asyncio.current_task()
    assert task is not None
    yielded = False

    async def watch() -> None:
        nonlocal yielded
        await node.compute.waited.wait()
        yielded = True
        task.cancel()

    async with node.compute.turn():
        watcher = asyncio.create_task(watch())
        try:
            return await _warm_locked(node, req)
        except asyncio.CancelledError:
            if not yielded or task.uncancel():
                raise  # (the caller's own cancellation)
            kvm.PREFILL_WARMS.labels("yielded").inc()
            raise WarmYielded("a request came to wait for the compute slot") from None
        finally:
            watcher.cancel()


async def _warm_locked(node: Any, req: pb.PrefillRequest) -> pb.PrefillResponse:
    """``_prefill_locked`` for a warm-up: the full blocks only, nothing handed off."""
    bs = node.cfg.block_size
    n = len(req.block_hashes) * bs
    p = Prompt.of(pb.PrefillRequest(token_ids=req.token_ids[:n], block_hashes=req.block_hashes), bs)
    t0 = time.perf_counter()
    local, fetched = await node.load_prefix(p)
    prefix = local + fetched
    table = node.allocate_table(n, prefix)
    start = len(prefix) * bs
    try:
        if start < n:  # in short chunks: a request that comes waits for one at most
            chunk = max(bs, min(WARM_CHUNK_TOKENS, node.cfg.prefill_chunk) // bs * bs)
            await node.compute_kv(p.tokens, start, table, lambda layer, lo, hi: None, chunk)
    except BaseException:
        node.pool.free(table)
        raise
    node.keep_new_blocks(p, table, len(prefix))
    node.counters["warmed"] += n - start
    kvm.PREFILL_WARMS.labels("done").inc()
    node.put_new_blocks(p, table, len(prefix))
    node.pool.free(table)
    return pb.PrefillResponse(
        computed_tokens=n - start,
        cached_tokens=len(local) * bs,
        fetched_tokens=len(fetched) * bs,
        prefill_ms=(time.perf_counter() - t0) * 1000,
    )
