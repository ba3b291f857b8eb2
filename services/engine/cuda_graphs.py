"""The decode step in fixed shapes, and CUDA graphs of it for batch-size buckets.

:func:`decode_static` is the paged decode attention by block table (a gather of each
request's blocks plus one grouped-query SDPA call, as :meth:`LlamaModel.forward_decode`)
with every shape fixed by its inputs' shapes and no value read back to the host, so a
CUDA graph can capture it.

:class:`DecodeRunner` is what a decode node steps its batch with:

* on the CPU (the default) it calls :meth:`LlamaModel.forward_decode`, unchanged;
* on CUDA a batch of ``b`` requests runs in the smallest batch bucket ``nb >= b``
  (:func:`~services.engine.device.graph_bucket`) and the smallest width bucket
  (:func:`width_bucket`: at most 25% more blocks) holding its longest request: the
  inputs are padded (rows ``b..nb-1`` repeat row 0, so they write row 0's K/V, the same
  bytes, to the same slot: no block of another request is touched), written by index
  into that bucket's
  static input buffers, and the bucket's graph is replayed (captured on first use, after a
  warm-up, into one memory pool shared by all graphs). ``cuda_graphs=False`` (the decode
  node's ``--no-cuda-graphs``) runs :func:`decode_static` eagerly instead; a batch past the
  largest bucket runs :meth:`LlamaModel.forward_decode` eagerly.

The padding and the buffers are plain tensor logic: tests/test_cuda_graphs.py runs them on
CPU tensors (``static=True``) against ``forward_decode``; capture and replay need CUDA
(tests/test_cuda.py).
"""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F

from .device import DEFAULT_GRAPH_BUCKETS, graph_bucket, graph_buckets


def width_bucket(reach: int, max_blocks: int) -> int:
    """Blocks of the block-table width a step runs with: ``reach`` (the blocks its
    longest request reads) rounded up to a multiple of a quarter of the largest power of
    two not above it, so a step reads at most 25% padding and there are at most four
    widths per octave (1, 2, 3, 4, 5, 6, 7, 8, 10, 12, 14, 16, 20, ...); at most
    ``max_blocks``."""
    if not 1 <= reach <= max_blocks:
        raise ValueError(f"reach must be in [1, {max_blocks}] blocks, got {reach}")
    step = max(1, (1 << (reach.bit_length() - 1)) // 4)
    return min(-(-reach // step) * step, max_blocks)


@torch.inference_mode()
def decode_static(
    model, pool, ids: torch.Tensor, pos: torch.Tensor, table: torch.Tensor
) -> torch.Tensor:
    """One decode step for ``ids`` [B] at ``pos`` [B] with block tables ``table`` [B, W],
    all on the pool's device: K/V of the new tokens is written into the pool by index,
    then each row attends over its table's ``W * block_size`` slots, those past its
    position masked out. Returns float32 logits [B, vocab]. No host sync; every shape
    is fixed by ``B`` and ``W`` (CUDA-graph capturable)."""
    bs = pool.block_size
    b, w = table.shape
    new_blk = table.gather(1, (pos // bs)[:, None])[:, 0]
    new_off = pos % bs
    slots = torch.arange(w * bs, device=pos.device)
    mask = (slots[None, :] <= pos[:, None])[:, None, None, :]  # [B, 1, 1, W*bs]
    cos, sin = rope(model, pos)
    h = model.embed_tokens(ids)
    for layer_idx, layer in enumerate(model.layers):
        q, k, v = layer.qkv(h, cos, sin)
        kv_l = pool.kv[:, layer_idx]
        kv_l[new_blk, 0, new_off] = k
        kv_l[new_blk, 1, new_off] = v
        keys = kv_l[table, 0].flatten(1, 2).transpose(1, 2)  # [B, KVH, W*bs, D]
        vals = kv_l[table, 1].flatten(1, 2).transpose(1, 2)
        o = F.scaled_dot_product_attention(
            q[:, :, None, :], keys, vals, attn_mask=mask, enable_gqa=True
        )
        h = layer.finish(h, o.reshape(b, -1))
    head = model.embed_tokens if model.lm_head is None else model.lm_head
    return F.linear(model.norm(h), head.weight).float()


def rope(model, pos: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """cos, sin [B, head_dim] in the model's dtype for positions ``pos`` (as the model's
    own RoPE: float32 angles from ``model.inv_freq``, moved to the device once)."""
    if model.inv_freq.device != pos.device:
        model.inv_freq = model.inv_freq.to(pos.device)
    freqs = pos.to(torch.float32)[:, None] * model.inv_freq[None, :]
    emb = torch.cat((freqs, freqs), dim=-1)
    return emb.cos().to(model.dtype), emb.sin().to(model.dtype)


@dataclass
class PaddedInputs:
    """One step's inputs padded to a bucket: ``ids`` [nb], ``pos`` [nb], ``table``
    [nb, width], on the host; rows past ``batch`` repeat row 0."""

    ids: torch.Tensor
    pos: torch.Tensor
    table: torch.Tensor
    batch: int


def pad_inputs(
    token_ids: Sequence[int],
    positions: Sequence[int],
    block_tables: Sequence[Sequence[int]],
    nb: int,
    width: int,
) -> PaddedInputs:
    """The host tensors of a step of ``len(positions)`` requests padded to ``nb`` rows and
    ``width`` blocks. A table shorter than ``width`` is padded with its first block (those
    slots are past the row's position: masked)."""
    b = len(positions)
    if not 1 <= b <= nb:
        raise ValueError(f"a batch of {b} does not fit bucket {nb}")
    ids = torch.empty(nb, dtype=torch.long)
    pos = torch.empty(nb, dtype=torch.long)
    table = torch.empty((nb, width), dtype=torch.long)
    for i in range(b):
        t = list(block_tables[i])[:width]
        ids[i], pos[i] = int(token_ids[i]), int(positions[i])
        table[i, : len(t)] = torch.as_tensor(t, dtype=torch.long)
        table[i, len(t) :] = t[0]
    ids[b:], pos[b:], table[b:] = ids[0], pos[0], table[0]
    return PaddedInputs(ids, pos, table, b)


class _Bucket:
    """Static input buffers of one (batch, width) bucket on the device, and its graph."""

    def __init__(self, nb: int, width: int, device: torch.device) -> None:
        self.ids = torch.zeros(nb, dtype=torch.long, device=device)
        self.pos = torch.zeros(nb, dtype=torch.long, device=device)
        self.table = torch.zeros((nb, width), dtype=torch.long, device=device)
        self.graph: Any = None
        self.out: torch.Tensor | None = None

    def write(self, p: PaddedInputs) -> None:
        """Inputs into the static buffers, in place (the graph reads these addresses)."""
        pin = self.ids.device.type == "cuda"
        for dst, src in ((self.ids, p.ids), (self.pos, p.pos), (self.table, p.table)):
            dst.copy_(src.pin_memory() if pin else src, non_blocking=pin)


class DecodeRunner:
    """Steps a decode batch: ``forward_decode`` on the CPU, padded buckets and CUDA graphs
    on CUDA (see the module's docstring). ``static`` forces (True) or forbids (False) the
    padded fixed-shape path whatever the device; ``cuda_graphs`` allows capture (CUDA
    only)."""

    def __init__(
        self,
        model,
        pool,
        max_batch: int,
        cuda_graphs: bool = True,
        buckets: Sequence[int] = DEFAULT_GRAPH_BUCKETS,
        static: bool | None = None,
    ) -> None:
        self.model, self.pool = model, pool
        device = pool.kv.device
        self.static = device.type == "cuda" if static is None else static
        self.cuda_graphs = bool(cuda_graphs)  # asked for; taken only on CUDA
        self.graphs = self.cuda_graphs and self.static and device.type == "cuda"
        self.buckets = graph_buckets(max_batch, buckets)
        bs = pool.block_size
        self.max_blocks = min(pool.num_blocks, -(-model.config.max_position_embeddings // bs))
        self._buckets: dict[tuple[int, int], _Bucket] = {}
        self._mempool: Any = None
        self._lock = threading.Lock()  # one step at a time (the scheduler's lock does too)
        self.replays = 0  # steps run from a captured graph
        self.captures = 0

    def bucket_of(self, positions: Sequence[int]) -> tuple[int, int] | None:
        """(batch bucket, width bucket) a step of these positions runs in, or None for
        an eager step (batch past the largest bucket)."""
        nb = graph_bucket(len(positions), self.buckets)
        if nb is None:
            return None
        reach = max(positions) // self.pool.block_size + 1
        return nb, width_bucket(min(reach, self.max_blocks), self.max_blocks)

    def step(
        self,
        token_ids: Sequence[int] | torch.Tensor,
        positions: Sequence[int],
        block_tables: Sequence[Sequence[int]],
    ) -> torch.Tensor:
        """Logits [B, vocab] (float32, on the pool's device) of one decode step. On the
        padded path they are a view of the bucket's output: read them before the next
        step."""
        ids = [int(t) for t in torch.as_tensor(token_ids).reshape(-1).tolist()]
        if not self.static:
            return self.model.forward_decode(ids, positions, block_tables, self.pool)
        self._check(ids, positions, block_tables)
        key = self.bucket_of(positions)
        if key is None:
            return self.model.forward_decode(ids, positions, block_tables, self.pool)
        nb, width = key
        padded = pad_inputs(ids, positions, block_tables, nb, width)
        st = self.pool.staging
        if st is not None:  # KV handed off into the mirror goes up before the step
            st.ensure_device(int(x) for t in block_tables for x in t[:width])
        dev = self.pool.kv.device
        on = torch.cuda.device(dev) if dev.type == "cuda" else contextlib.nullcontext()
        with self._lock, on:  # the pool's device current in this (worker) thread
            bucket = self._buckets.get(key)
            if bucket is None:
                bucket = self._buckets[key] = _Bucket(nb, width, self.pool.kv.device)
            bucket.write(padded)
            out: torch.Tensor | None
            if not self.graphs:
                out = decode_static(self.model, self.pool, bucket.ids, bucket.pos, bucket.table)
            else:
                if bucket.graph is None:
                    self._capture(bucket)
                else:
                    bucket.graph.replay()
                self.replays += 1
                out = bucket.out
        assert out is not None
        return out[: padded.batch]

    def _check(self, ids, positions, block_tables) -> None:
        """What forward_decode refuses, refused the same way (host values only)."""
        b, bs = len(ids), self.pool.block_size
        if not (b == len(positions) == len(block_tables)) or b == 0:
            raise ValueError(
                "token_ids, positions and block_tables must have the same non-zero length"
            )
        limit = self.model.config.max_position_embeddings
        if min(positions) < 0 or max(positions) >= limit:
            raise ValueError(f"decode position out of range [0, {limit})")
        for i, t in enumerate(block_tables):
            if len(t) * bs <= positions[i]:
                raise ValueError(f"block_table {i} cannot hold position {positions[i]}")

    def _capture(self, bucket: _Bucket) -> None:  # pragma: no cover - needs CUDA
        """Warm-up on a side stream, then capture (tests/test_cuda.py). The warm-up and
        the captured run write the very K/V the step writes anyway (the real inputs)."""
        model, pool = self.model, self.pool
        if self._mempool is None:
            self._mempool = torch.cuda.graph_pool_handle()
        side = torch.cuda.Stream(device=pool.kv.device)
        side.wait_stream(torch.cuda.current_stream(pool.kv.device))
        with torch.cuda.stream(side):
            for _ in range(2):
                decode_static(model, pool, bucket.ids, bucket.pos, bucket.table)
        torch.cuda.current_stream(pool.kv.device).wait_stream(side)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, pool=self._mempool, capture_error_mode="thread_local"):
            bucket.out = decode_static(model, pool, bucket.ids, bucket.pos, bucket.table)
        graph.replay()  # capture records the work; this runs it for this step
        bucket.graph = graph
        self.captures += 1
