"""A model node's start-up profile: measured prefill times over (new, cached) token counts
and decode step times over batch sizes, so the conductor's time models start calibrated
(sent with the node's etcd registration)."""

from __future__ import annotations

import time

import torch


def _ms(fn) -> float:
    t0 = time.perf_counter()
    fn()
    return (time.perf_counter() - t0) * 1000


def profile(model, pool, block_size: int, max_tokens: int) -> dict[str, list[list[float]]]:
    """Times a few prefills (new, cached) and decode steps (batch, kv) on scratch blocks.
    Runs once at start, before the node registers; nothing it writes is cached."""
    vocab = model.config.vocab_size
    g = torch.Generator().manual_seed(0)
    out: dict[str, list[list[float]]] = {"prefill": [], "decode": []}
    budget = min(max_tokens, (pool.num_free - 4) * block_size // 2)
    points = [(n, c) for n in (16, 64, 256, 1024) for c in (0, 256) if n + c <= budget]
    for i, (new, cached) in enumerate([points[0]] + points):  # the first run warms up
        total = new + cached
        table = pool.allocate(-(-total // block_size))
        try:
            toks = torch.randint(0, vocab, (total,), generator=g)
            if cached:
                model.forward_prefill(toks[:cached], 0, pool, table)
            ms = _ms(lambda: model.forward_prefill(toks[cached:], cached, pool, table))
        finally:
            pool.free(table)
        if i:
            out["prefill"].append([new, cached, ms])
    ctx = min(128, budget // 16) or 1
    for batch in (1, 4, 16):
        if batch * ctx > budget:
            break
        tables = [pool.allocate(-(-(ctx + 1) // block_size)) for _ in range(batch)]
        try:
            toks = torch.randint(0, vocab, (batch,), generator=g)
            ms = min(
                _ms(lambda: model.forward_decode(toks, [ctx] * batch, tables, pool))
                for _ in range(2)
            )
        finally:
            for t in tables:
                pool.free(t)
        out["decode"].append([batch, batch * ctx, ms])
    return out
