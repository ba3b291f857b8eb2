"""Paged, pre-allocated KV-cache pool with reference-counted blocks."""

from __future__ import annotations

from collections.abc import Callable, Sequence

import torch

from .config import ModelConfig, resolve_dtype
from .prefix_cache import BlockEvent, PrefixCache
from .staging import KVStaging, make_staging


class OutOfBlocks(RuntimeError):
    """Raised when the pool cannot supply the requested number of blocks."""


class KVPool:
    """One pre-allocated KV tensor split into fixed-size blocks.

    ``kv`` has shape ``[num_blocks, num_layers, 2, block_size, num_kv_heads, head_dim]``
    (index 0 of dim 2 is K, 1 is V), so one block's KV for all layers is one
    contiguous byte span and one layer of one block is a contiguous span
    inside it. Blocks are reference counted; unreferenced blocks that hold a
    cached prefix stay in the owned :class:`PrefixCache` until evicted.
    """

    def __init__(
        self,
        config: ModelConfig,
        num_blocks: int,
        block_size: int,
        dtype: torch.dtype | str = torch.float32,
        on_event: Callable[[BlockEvent], None] | None = None,
        device: torch.device | str = "cpu",
    ) -> None:
        if num_blocks <= 0 or block_size <= 0:
            raise ValueError("num_blocks and block_size must be positive")
        self.config = config
        self.num_blocks = int(num_blocks)
        self.block_size = int(block_size)
        self.dtype = resolve_dtype(dtype)
        self.kv = torch.zeros(
            (
                self.num_blocks,
                config.num_layers,
                2,
                self.block_size,
                config.num_kv_heads,
                config.head_dim,
            ),
            dtype=self.dtype,
            device=device,
        )
        # On a GPU: a pinned host mirror the transfer engine registers, and the copies to
        # and from it (see staging.py); None on the CPU, where the pool is registered.
        self.staging: KVStaging | None = make_staging(self.kv)
        self._refcount = [0] * self.num_blocks
        self._free: list[int] = list(range(self.num_blocks - 1, -1, -1))  # pop() yields 0, 1, ...
        self._num_used = 0
        self.prefix_cache = PrefixCache(ref_blocks=self.ref, on_event=on_event)

    @classmethod
    def from_memory(
        cls,
        config: ModelConfig,
        memory_bytes: int,
        block_size: int,
        dtype: torch.dtype | str = torch.float32,
        **kwargs,
    ) -> KVPool:
        """Pool with as many blocks as fit in ``memory_bytes``."""
        nbytes = cls.block_bytes(config, block_size, resolve_dtype(dtype))
        num_blocks = int(memory_bytes) // nbytes
        if num_blocks < 1:
            raise ValueError(f"{memory_bytes} bytes is less than one block ({nbytes} bytes)")
        return cls(config, num_blocks, block_size, dtype, **kwargs)

    @staticmethod
    def block_bytes(config: ModelConfig, block_size: int, dtype: torch.dtype) -> int:
        """Bytes of one block (all layers, K and V)."""
        elem = torch.empty((), dtype=dtype).element_size()
        return config.num_layers * 2 * block_size * config.num_kv_heads * config.head_dim * elem

    # ------------------------------------------------------------ byte layout
    @property
    def layer_nbytes(self) -> int:
        """Bytes of one layer (K and V) of one block."""
        return self.block_nbytes // self.config.num_layers

    @property
    def block_nbytes(self) -> int:
        """Bytes of one block (all layers, K and V)."""
        return self.block_bytes(self.config, self.block_size, self.dtype)

    @property
    def nbytes(self) -> int:
        """Bytes of the whole pool tensor."""
        return self.num_blocks * self.block_nbytes

    def block_offset(self, block_id: int) -> int:
        """Byte offset of ``block_id`` inside the pool storage."""
        self._check_id(block_id)
        return block_id * self.block_nbytes

    def layer_offset(self, block_id: int, layer: int) -> int:
        """Byte offset of layer ``layer`` of ``block_id`` inside the pool storage."""
        if not 0 <= layer < self.config.num_layers:
            raise IndexError(f"layer {layer} out of range")
        return self.block_offset(block_id) + layer * self.layer_nbytes

    @property
    def transfer_kv(self) -> torch.Tensor:
        """The host tensor the transfer engine registers: the pool itself on the CPU, its
        pinned host mirror (same layout, same offsets) on a GPU."""
        return self.kv if self.staging is None else self.staging.host

    def bytes_view(self) -> memoryview:
        """Writable flat byte view of :attr:`transfer_kv` (shares memory)."""
        return memoryview(self.transfer_kv.view(torch.uint8).numpy().reshape(-1))

    # ------------------------------------------------------------- allocation
    @property
    def num_free(self) -> int:
        """Blocks allocatable now (free list plus evictable cached blocks)."""
        return len(self._free) + self.prefix_cache.num_evictable

    @property
    def num_used(self) -> int:
        """Blocks with a non-zero reference count."""
        return self._num_used

    @property
    def num_cached(self) -> int:
        """Blocks holding a cached prefix (referenced or not)."""
        return len(self.prefix_cache)

    def refcount(self, block_id: int) -> int:
        """Current reference count of ``block_id``."""
        self._check_id(block_id)
        return self._refcount[block_id]

    def allocate(self, n: int) -> list[int]:
        """Allocate ``n`` blocks with refcount 1, evicting unreferenced cached blocks if needed.

        Raises :class:`OutOfBlocks` (leaving the pool unchanged) if not enough
        blocks are free or evictable.
        """
        if n < 0:
            raise ValueError("n must be >= 0")
        if n > self.num_free:
            raise OutOfBlocks(
                f"need {n} KV blocks, only {len(self._free)} free + "
                f"{self.prefix_cache.num_evictable} evictable of {self.num_blocks}"
            )
        take = min(n, len(self._free))
        out = [self._free.pop() for _ in range(take)]
        out += self.prefix_cache.evict(n - take)
        for b in out:
            self._refcount[b] = 1
        self._num_used += n
        if self.staging is not None:  # new contents land in the mirror or are computed
            self.staging.mark_host_newer(out)
        return out

    def ref(self, block_ids: Sequence[int]) -> None:
        """Take one more reference on each block (must be allocated or cached)."""
        for b in block_ids:
            self._check_id(b)
            if self._refcount[b] == 0:
                if not self.prefix_cache.is_cached(b):
                    raise ValueError(f"block {b} is free; allocate it instead of ref")
                self.prefix_cache.acquire(b)
                self._num_used += 1
            self._refcount[b] += 1

    def free(self, block_ids: Sequence[int]) -> None:
        """Drop one reference on each block.

        A block reaching 0 stays cached (evictable) if it holds a cached
        prefix, otherwise it returns to the free list.
        """
        for b in block_ids:
            self._check_id(b)
            if self._refcount[b] <= 0:
                raise ValueError(f"block {b} freed more times than referenced")
            self._refcount[b] -= 1
            if self._refcount[b] == 0:
                self._num_used -= 1
                if not self.prefix_cache.release(b):
                    self._free.append(b)

    # ----------------------------------------------------------- prefix cache
    def match_prefix(
        self, block_hashes: Sequence[bytes], token_ids_per_block: Sequence[Sequence[int]]
    ) -> list[int]:
        """Longest cached prefix (block ids); each hit gets one reference."""
        return self.prefix_cache.match(block_hashes, token_ids_per_block)

    match = match_prefix

    def pin_prefix(self, block_hashes: Sequence[bytes]) -> list[int]:
        """Longest cached prefix named by ``block_hashes`` (block ids), each taking one
        reference so that no allocation evicts it; tokens unchecked (see
        :meth:`PrefixCache.lookup`)."""
        hits = self.prefix_cache.lookup(block_hashes)
        self.ref(hits)
        return hits

    def insert(
        self,
        block_hash: bytes,
        block_id: int,
        token_ids: Sequence[int],
        parent_hash: bytes | None = None,
    ) -> bool:
        """Cache one computed, referenced block under ``block_hash``.

        Pass ``parent_hash`` (the previous block's hash in the chain, None for the
        first block) so eviction takes tails before heads. Returns False if the
        hash is already cached in another block (this block then stays uncached).
        """
        self._check_id(block_id)
        if self._refcount[block_id] <= 0:
            raise ValueError(f"block {block_id} must be referenced to be cached")
        return self.prefix_cache.insert(
            block_hash, block_id, tuple(token_ids), parent_hash=parent_hash
        )

    def cache_blocks(
        self,
        block_hashes: Sequence[bytes],
        block_ids: Sequence[int],
        token_ids_per_block: Sequence[Sequence[int]],
    ) -> int:
        """Register full, computed blocks of one chain in the prefix cache.

        ``block_hashes[i]`` / ``token_ids_per_block[i]`` describe ``block_ids[i]``;
        the chain starts at the first block of the sequence. Returns the number
        of newly cached blocks.
        """
        inserted = 0
        parent: bytes | None = None
        for h, b, toks in zip(block_hashes, block_ids, token_ids_per_block):
            if self.prefix_cache.block_for(h) != b:
                inserted += self.insert(h, b, toks, parent_hash=parent)
            parent = h
        return inserted

    def drain_events(self) -> list[BlockEvent]:
        """Block events ("stored"/"removed", hash) since the last drain."""
        return self.prefix_cache.drain_events()

    def _check_id(self, block_id: int) -> None:
        if not 0 <= block_id < self.num_blocks:
            raise IndexError(f"block id {block_id} out of range [0, {self.num_blocks})")
