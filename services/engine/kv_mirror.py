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

Memory: 2x the pool bytes of the requests it mirrors (float32 of bfloat16), in capacity
steps of :data:`GROW` tokens. ``budget_bytes`` caps it; a step whose batch does not fit
falls back to the gather path (:meth:`KVMirror.prepare` returns None).
"""

from __future__ import annotations

import math
from collections.abc import Hashable, Sequence
from dataclasses import dataclass

import torch

from kvmesh.services.engine.config import ModelConfig

GROW = 256  # capacity grows in steps of this many tokens


@dataclass(eq=False)
class _Entry:
    kv: torch.Tensor  # [layers, 2, kv_heads, capacity, head_dim] float32
    blocks: list[int]  # the pool blocks the rows [0, rows) came from, in order
    rows: int  # positions [0, rows) hold valid K/V
    used: int  # the step that last used it (for eviction)


class KVMirror:
    """Per-request float32 K/V, contiguous per KV head, kept in step with the pool.

    Keys are the caller's (the decode batch uses its reservation objects); the caller
    must :meth:`drop` a key whenever that request's blocks go back to the pool. An entry
    is also checked against the block table on every step and rebuilt if it changed.
    """

    def __init__(self, config: ModelConfig, block_size: int, budget_bytes: int) -> None:
        self.config, self.bs, self.budget = config, block_size, int(budget_bytes)
        self._entries: dict[Hashable, _Entry] = {}
        self._step = 0
        per = config.num_layers * 2 * config.num_kv_heads * config.head_dim * 4
        self.bytes_per_token = per  # float32 bytes one token's mirrored K/V takes
        self.rebuilt_tokens = 0  # tokens copied from the pool (fills), for tests and stats

    @classmethod
    def for_pool(
        cls, config: ModelConfig, num_blocks: int, block_size: int, max_batch: int
    ) -> KVMirror:
        """A mirror with room for a whole pool of ``num_blocks`` plus the capacity
        rounding of ``max_batch`` requests: a decode batch always fits it."""
        per = config.num_layers * 2 * config.num_kv_heads * config.head_dim * 4
        return cls(config, block_size, (num_blocks * block_size + max_batch * GROW) * per)

    @property
    def nbytes(self) -> int:
        """Bytes held by all mirrored requests."""
        return sum(e.kv.numel() * 4 for e in self._entries.values())

    def __len__(self) -> int:
        return len(self._entries)

    def __contains__(self, key: Hashable) -> bool:
        return key in self._entries

    def drop(self, key: Hashable) -> None:
        """Forget ``key``'s rows (its blocks went back to the pool)."""
        self._entries.pop(key, None)

    def prepare(
        self,
        keys: Sequence[Hashable],
        positions: Sequence[int],
        tables: Sequence[Sequence[int]],
        kv: torch.Tensor,
    ) -> list[torch.Tensor] | None:
        """Each request's mirror covering positions ``[0, positions[i])`` and with room
        for ``positions[i]`` (the step writes it); None if the batch does not fit the
        budget (the step then gathers from the pool). ``kv`` is the pool's tensor."""
        self._step += 1
        caps = [_round_up(p + 1, GROW) for p in positions]
        need = 0
        for key, cap in zip(keys, caps, strict=True):
            e = self._entries.get(key)
            have = e.kv.shape[3] if e is not None else 0
            need += max(cap, have) * self.bytes_per_token
        if need > self.budget:
            return None
        self._evict(self.budget - need, set(keys))
        out = []
        for key, p, cap, table in zip(keys, positions, caps, tables, strict=True):
            e = self._entries.get(key)
            if e is not None and (p < e.rows or e.blocks != list(table[: len(e.blocks)])):
                e.rows = min(e.rows, p)  # rewound: rows past p are stale
                if e.blocks != list(table[: len(e.blocks)]):
                    e = None  # its blocks changed: rebuild
            if e is None:
                e = self._entries[key] = _Entry(self._alloc(cap), [], 0, 0)
            elif e.kv.shape[3] < p + 1:
                grown = self._alloc(cap)
                grown[:, :, :, : e.rows].copy_(e.kv[:, :, :, : e.rows])
                e.kv = grown
            if e.rows < p:
                self._fill(e, table, p, kv)
            e.blocks = list(table[: -(-(p + 1) // self.bs)])
            e.rows, e.used = p + 1, self._step  # the step writes row p
            out.append(e.kv)
        return out

    # -- internals --------------------------------------------------------------------------
    def _alloc(self, cap: int) -> torch.Tensor:
        c = self.config
        return torch.empty(c.num_layers, 2, c.num_kv_heads, cap, c.head_dim)

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

    def _evict(self, room: int, keep: set) -> None:
        """Drops the least recently used entries outside ``keep`` until the others fit."""
        held = self.nbytes - sum(e.kv.numel() * 4 for k, e in self._entries.items() if k in keep)
        if held <= room:
            return
        for key, _ in sorted(
            ((k, e) for k, e in self._entries.items() if k not in keep), key=lambda x: x[1].used
        ):
            held -= self._entries.pop(key).kv.numel() * 4
            if held <= room:
                return


def mirror_attention(
    q: torch.Tensor, mirrors: Sequence[torch.Tensor], layer: int, lengths: Sequence[int]
) -> torch.Tensor:
    """Decode attention of ``q`` [B, heads, D] over each request's mirrored keys and values
    (rows [0, lengths[i])) of ``layer``: two float32 products per request, the g query heads
    of a KV head as g rows against its keys. Returns [B, heads*D] in ``q``'s dtype."""
    b, heads, d = q.shape
    kvh = mirrors[0].shape[2]
    qg = q.float().view(b, kvh, heads // kvh, d)
    out = torch.empty(b, kvh, heads // kvh, d)
    scale = 1.0 / math.sqrt(d)
    for i, m in enumerate(mirrors):
        t = lengths[i]
        scores = torch.bmm(qg[i], m[layer, 0, :, :t].transpose(1, 2)).mul_(scale)
        torch.bmm(scores.softmax(-1), m[layer, 1, :, :t], out=out[i])
    return out.to(q.dtype).reshape(b, heads * d)


def _round_up(n: int, m: int) -> int:
    return -(-n // m) * m
