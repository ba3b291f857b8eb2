"""Float32 copies of running requests' KV, contiguous per KV head, for CPU decode.

The paged pool keeps each block as ``[layers, 2, block_size, kv_heads, head_dim]``, the
layout that moves between nodes. A CPU decode step that reads it gathers every request's
blocks for every layer, permutes them to ``[kv_heads, tokens, head_dim]`` and widens them
to float32 (bfloat16 products run in float32 on a CPU without native bfloat16): at batch
32 x 512 tokens that copy was about 60% of the step. It produces the same tensor, step
after step, growing by one token.

A :class:`KVMirror` keeps that tensor per request instead, as a static cache does:
``[layers, 2, kv_heads, capacity, head_dim]`` float32, filled from the pool once when the
request first decodes here (or after its blocks change) and appended by each step with
the token it writes. The values are the pool's (a bfloat16 pool's values widened), so
attention over the mirror reads exactly what attention over the pool reads.

Memory: float32 of what it mirrors (2x a bfloat16 pool's bytes for the same tokens) plus
a headroom of 1/:data:`HEADROOM` (a request grows into it; outgrowing it copies the rows
once), allocated as requests decode. ``budget_bytes`` caps
it: a request that does not fit (or whose allocation fails) is not mirrored, and the step
gathers that request's blocks from the pool as before (:meth:`KVMirror.prepare` gives
None for it). Nothing is evicted to make room: an entry goes only when its request's
blocks go back to the pool (:meth:`KVMirror.drop`), so a batch that round-robins over
more requests than fit does not refill them step after step.

Threads: a decode step runs :meth:`KVMirror.prepare` in a worker thread while the event
loop may :meth:`KVMirror.drop` requests that ended; drops are queued and applied by the
next ``prepare``, in the step's thread.
"""

from __future__ import annotations

import collections
import logging
from collections.abc import Hashable, Sequence
from dataclasses import dataclass

import torch

from kvmesh.services.engine.config import ModelConfig

HEADROOM = 8  # capacity is a request's tokens plus 1/HEADROOM of them (>= one block)
log = logging.getLogger(__name__)


@dataclass(eq=False)
class _Entry:
    kv: torch.Tensor  # [layers, 2, kv_heads, capacity, head_dim] float32
    blocks: list[int]  # the pool blocks the rows [0, rows) came from, in order
    rows: int  # positions [0, rows) hold valid K/V


class KVMirror:
    """Per-request float32 K/V, contiguous per KV head, kept in step with the pool.

    Keys are the caller's (the decode batch uses its reservation objects); the caller
    must :meth:`drop` a key whenever that request's blocks go back to the pool. An entry
    is also checked against the block table on every step and rebuilt if it changed.
    """

    def __init__(self, config: ModelConfig, block_size: int, budget_bytes: int) -> None:
        self.config, self.bs, self.budget = config, block_size, int(budget_bytes)
        self._entries: dict[Hashable, _Entry] = {}
        self._drops: collections.deque[Hashable] = collections.deque()  # thread-safe appends
        self._held = 0  # bytes of all entries
        self.bytes_per_token = _bytes_per_token(config)  # float32, one token's K/V
        self.rebuilt_tokens = 0  # tokens copied from the pool (fills), for tests and stats
        self.gathered = 0  # requests a step gathered instead (no room), for tests and stats

    @classmethod
    def for_pool(cls, config: ModelConfig, num_blocks: int, block_size: int) -> KVMirror:
        """A mirror with room for as many tokens as a pool of ``num_blocks`` holds, with
        their headroom (float32: 2.25x a bfloat16 pool's bytes at most); past it, requests
        are gathered from the pool."""
        per = _bytes_per_token(config)
        tokens = num_blocks * block_size
        return cls(config, block_size, (tokens + tokens // HEADROOM + block_size) * per)

    @property
    def nbytes(self) -> int:
        """Bytes held by all mirrored requests."""
        return self._held

    def __len__(self) -> int:
        return len(self._entries)

    def __contains__(self, key: Hashable) -> bool:
        return key in self._entries and key not in self._drops

    def drop(self, key: Hashable, at_once: bool = False) -> None:
        """Forget ``key``'s rows (its blocks went back to the pool). Safe to call from
        another thread than the one stepping: applied at the next :meth:`prepare`, or now
        with ``at_once`` (the caller knows no step is running)."""
        if at_once:
            self._forget(key)
        else:
            self._drops.append(key)

    def prepare(
        self,
        keys: Sequence[Hashable],
        positions: Sequence[int],
        tables: Sequence[Sequence[int]],
        kv: torch.Tensor,
    ) -> list[torch.Tensor | None]:
        """Each request's mirror covering positions ``[0, positions[i])`` and with room
        for ``positions[i]`` (the step writes it), or None for a request that does not fit
        the budget (the step gathers it from the pool). ``kv`` is the pool's tensor."""
        while self._drops:
            self._forget(self._drops.popleft())
        out: list[torch.Tensor | None] = []
        for key, p, table in zip(keys, positions, tables, strict=True):
            e = self._entries.get(key)
            if e is not None:
                held = list(table[: len(e.blocks)])
                if e.blocks != held:
                    self._forget(key)  # its blocks changed: rebuild
                    e = None
            cap = _round_up(p + 1 + max(self.bs, (p + 1) // HEADROOM), self.bs)
            if e is None:
                kvm = self._alloc(cap)
                if kvm is None:
                    out.append(None)
                    continue
                e = self._entries[key] = _Entry(kvm, [], 0)
            elif e.kv.shape[3] < p + 1:
                grown = self._alloc(cap, e.kv.shape[3])
                if grown is None:
                    self._forget(key)
                    out.append(None)
                    continue
                grown[:, :, :, : e.rows].copy_(e.kv[:, :, :, : e.rows])
                e.kv = grown
            if e.rows < p:
                self._fill(e, table, p, kv)
            e.blocks = list(table[: -(-(p + 1) // self.bs)])
            e.rows = p + 1  # the step writes row p
            out.append(e.kv)
        self.gathered += sum(m is None for m in out)
        return out

    # -- internals --------------------------------------------------------------------------
    def _alloc(self, cap: int, replaces: int = 0) -> torch.Tensor | None:
        """A [layers, 2, kv_heads, cap, D] float32 tensor if the budget has room for it
        (``replaces`` tokens of capacity are given back), else None."""
        c = self.config
        grow = (cap - replaces) * self.bytes_per_token
        if self._held + grow > self.budget:
            return None
        try:
            t = torch.empty(c.num_layers, 2, c.num_kv_heads, cap, c.head_dim)
        except RuntimeError as e:  # out of host memory: this request is gathered instead
            log.warning("KV mirror: cannot allocate %d tokens (%s)", cap, e)
            return None
        self._held += grow
        return t

    def _forget(self, key: Hashable) -> None:
        e = self._entries.pop(key, None)
        if e is not None:
            self._held -= e.kv.shape[3] * self.bytes_per_token

    def _fill(self, e: _Entry, table: Sequence[int], p: int, kv: torch.Tensor) -> None:
        """Rows [e.rows, p) from the pool's blocks."""
        bs = self.bs
        first, last = e.rows // bs, -(-p // bs)
        idx = torch.as_tensor(list(table[first:last]), dtype=torch.long)
        got = kv.index_select(0, idx)  # [n, layers, 2, bs, kv_heads, D]
        got = got.permute(1, 2, 4, 0, 3, 5).flatten(3, 4)  # [layers, 2, kv_heads, n*bs, D]
        lo = e.rows - first * bs
        e.kv[:, :, :, e.rows : p].copy_(got[:, :, :, lo : lo + p - e.rows])
        self.rebuilt_tokens += p - e.rows


def _bytes_per_token(config: ModelConfig) -> int:
    return config.num_layers * 2 * config.num_kv_heads * config.head_dim * 4


def _round_up(n: int, m: int) -> int:
    return -(-n // m) * m
