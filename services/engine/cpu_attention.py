"""Decode attention on the CPU: one new query per request, over its mirror or its blocks.

A decode step gives each request one query row per head. :class:`CpuDecodeAttention`
is built once per step and called once per layer: requests the :mod:`kv_mirror` holds
read their float32 K/V rows in place (the step's new K/V appended first); any other
request's blocks are gathered from the pool, permuted and widened
(:func:`decode_attention`), as every request's were before the mirror.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import torch

from .kv_pool import KVPool


def decode_attention(q: torch.Tensor, kv: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """Attention of one new query per request over its gathered blocks, on the CPU.

    ``q`` [B, heads, D]; ``kv`` [B, blocks, 2, block_size, kv_heads, D] (one gather for K
    and V); ``mask`` [B, 1, 1, T] is True where a key is visible. Two batched products in
    float32, the g query heads of a KV head as g rows against its keys (no copy of the
    keys per query head). SDPA's CPU kernels take 4x (bfloat16 at batch 1) to 1.5x
    longer for this shape of one query row. Returns [B, heads*D] in ``q``'s dtype.
    """
    b, heads, d = q.shape
    kvh = kv.shape[4]
    # [B, KVH, blocks, block_size, D] -> [B, KVH, T, D]: one copy each, widened on the way
    keys, vals = (
        kv[:, :, i]
        .permute(0, 3, 1, 2, 4)
        .to(torch.float32, memory_format=torch.contiguous_format)
        .flatten(2, 3)
        for i in (0, 1)
    )
    qg = q.float().view(b, kvh, heads // kvh, d)  # [B, KVH, g, D]
    scores = torch.matmul(qg, keys.transpose(-1, -2)).mul_(1.0 / math.sqrt(d))  # [B,KVH,g,T]
    scores.masked_fill_(~mask, float("-inf"))
    o = torch.matmul(scores.softmax(-1), vals)  # [B, KVH, g, D]
    return o.to(q.dtype).reshape(b, heads * d)


def mirror_attention(
    q: torch.Tensor, mirrors: Sequence[torch.Tensor], layer: int, lengths: Sequence[int]
) -> torch.Tensor:
    """Decode attention of ``q`` [B, heads, D] over each request's mirrored keys and values
    (rows [0, lengths[i])) of ``layer``: two float32 products per request, the g query heads
    of a KV head as g rows against its keys. Returns [B, heads*D] in ``q``'s dtype."""
    b, heads, d = q.shape
    kvh = mirrors[0].shape[2] if mirrors else 1
    qg = q.float().view(b, kvh, heads // kvh, d)
    out = torch.empty(b, kvh, heads // kvh, d)
    scale = 1.0 / math.sqrt(d)
    for i, m in enumerate(mirrors):
        t = lengths[i]
        scores = torch.bmm(qg[i], m[layer, 0, :, :t].transpose(1, 2)).mul_(scale)
        torch.bmm(scores.softmax(-1), m[layer, 1, :, :t], out=out[i])
    return out.to(q.dtype).reshape(b, heads * d)


class CpuDecodeAttention:
    """One step's attention, layer by layer: ``mirrors[i]`` is request i's mirror (from
    :meth:`KVMirror.prepare`) or None (gathered); ``mirrors`` None gathers them all.
    ``table`` [B, blocks] and ``mask`` [B, 1, 1, T] are the step's padded block tables and
    visibility mask, ``positions`` each request's new position."""

    def __init__(
        self,
        pool: KVPool,
        table: torch.Tensor,
        mask: torch.Tensor,
        positions: Sequence[int],
        mirrors: Sequence[torch.Tensor | None] | None,
    ) -> None:
        b = table.shape[0]
        got = list(mirrors) if mirrors is not None else [None] * b
        self.pool = pool
        self.mi = [i for i in range(b) if got[i] is not None]  # read from their mirror
        self.gi = [i for i in range(b) if got[i] is None]  # gathered from the pool
        self.mats = [m for m in got if m is not None]
        self.at = [int(positions[i]) for i in self.mi]
        self.lengths = [p + 1 for p in self.at]
        if self.gi:
            sub, self.mask = table, mask
            if self.mi:  # only the gathered rows, as far as the longest of them reaches
                reach = max(int(positions[i]) for i in self.gi) // pool.block_size + 1
                sub = table[self.gi, :reach]
                self.mask = mask[self.gi, ..., : reach * pool.block_size]
            # the pool as one row per (block, layer), a view (never a copy: the step writes
            # its new K/V through pool.kv): a layer's blocks are gathered from a contiguous
            # tensor by index_select (~4x faster than from the strided view of one layer,
            # ~6x faster than advanced indexing)
            self.rows = pool.kv.view(-1, *pool.kv.shape[2:])
            self.flat = sub.flatten() * pool.kv.shape[1]
            self.shape = sub.shape

    def __call__(
        self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, layer: int
    ) -> torch.Tensor:
        """Attention of ``q`` [B, heads, D] for ``layer``, whose new ``k``/``v`` [B, KVH, D]
        the step has written to the pool. Returns [B, heads*D] in ``q``'s dtype."""
        om = og = None
        q_all = q
        if self.mats:
            if self.gi:
                q, k, v = q[self.mi], k[self.mi], v[self.mi]
            # the pool's values (rounded to its dtype), widened
            new = torch.stack((k, v), 1).to(self.pool.kv.dtype).float()
            for j, m in enumerate(self.mats):
                m[layer, :, :, self.at[j]] = new[j]
            om = mirror_attention(q, self.mats, layer, self.lengths)
        if self.gi:
            kv = self.rows.index_select(0, self.flat + layer).unflatten(0, self.shape)
            og = decode_attention(q_all[self.gi] if self.mats else q_all, kv, self.mask)
        if og is None:
            return om
        if om is None:
            return og
        o = q_all.new_empty(q_all.shape[0], om.shape[1])
        o[self.mi], o[self.gi] = om, og
        return o
