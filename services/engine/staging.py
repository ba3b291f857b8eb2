"""KV staging between a KV pool in GPU memory and the host memory the transfer engine
registers (issue 14, part 2).

The transfer engine moves host memory only (TCP, or verbs on host buffers; see
``rdma/verbs.py`` for the off-by-default GPU-memory hook). A node whose pool lives on a
GPU therefore registers a *host mirror* of its pool instead of the pool itself: one
pinned buffer, allocated once at start and reused by every request, with the pool's
layout ``[num_blocks, layers, 2, block_size, kv_heads, head_dim]``, so every byte offset
the nodes compute (``KVPool.block_offset`` / ``layer_offset``) means the same in both
and the handoff and store code does not change:

* the prefill side copies each layer's new blocks device-to-host into the mirror on a
  copy stream that waits (an event) for the layer's KV write, so the copy overlaps the
  next layer's compute; the layer's callback (the handoff's ``send_layer``) runs once
  that copy has landed, in layer order;
* whatever lands in the mirror from outside (a handoff written by a prefill node, a store
  fetch) makes its blocks *host-newer*: a block is host-newer from the moment it is
  allocated until it is uploaded, and :meth:`KVStaging.ensure_device` copies such
  blocks host-to-device on the compute stream before the first forward that reads them
  (the decode node's first step, a prefill on top of a fetched prefix). No host sync.

On the CPU the pool is registered as it is and no staging happens (:func:`make_staging`
returns None): today's zero-copy path. The logic (runs of blocks, offsets, ordering,
which blocks to upload) runs on CPU tensors with :class:`SyncOps` and is tested there.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Callable, Iterable, Sequence
from typing import Any, Protocol

import torch


def block_runs(block_ids: Iterable[int]) -> list[tuple[int, int]]:
    """Distinct block ids as ``[start, stop)`` runs of consecutive ids, ascending, so one
    slice copy moves each run (the pool's blocks are contiguous in memory)."""
    runs: list[tuple[int, int]] = []
    for b in sorted(set(int(x) for x in block_ids)):
        if runs and runs[-1][1] == b:
            runs[-1] = (runs[-1][0], b + 1)
        else:
            runs.append((b, b + 1))
    return runs


def layer_spans(
    block_ids: Iterable[int], layer: int, block_nbytes: int, layer_nbytes: int
) -> list[tuple[int, int]]:
    """(byte offset, length) of layer ``layer`` of each run of ``block_ids`` in the pool's
    storage: a run of blocks holds one layer as one span per block (layers interleave)."""
    return [
        (b * block_nbytes + layer * layer_nbytes, layer_nbytes)
        for start, stop in block_runs(block_ids)
        for b in range(start, stop)
    ]


class StagingOps(Protocol):
    """How copies are issued and waited for: CUDA streams and events, or plain copies."""

    def copy_to_host(self, dst: torch.Tensor, src: torch.Tensor) -> None: ...
    def copy_to_device(self, dst: torch.Tensor, src: torch.Tensor) -> None: ...
    def begin(self) -> None: ...
    def end(self) -> Any: ...
    def done(self, token: Any) -> bool: ...
    def wait(self, token: Any) -> None: ...


class SyncOps:
    """Copies at once on the calling thread (CPU tensors, tests): every token is done."""

    def copy_to_host(self, dst: torch.Tensor, src: torch.Tensor) -> None:
        dst.copy_(src)

    def copy_to_device(self, dst: torch.Tensor, src: torch.Tensor) -> None:
        dst.copy_(src)

    def begin(self) -> None:
        pass

    def end(self) -> Any:
        return None

    def done(self, token: Any) -> bool:
        return True

    def wait(self, token: Any) -> None:
        pass


class CudaOps:  # pragma: no cover - needs a GPU (tests/test_cuda.py)
    """Device-to-host copies on a side stream ordered after the compute stream by an
    event; host-to-device uploads on the compute stream itself (ordered before the
    kernels that read them, with no host sync)."""

    def __init__(self, device: torch.device) -> None:
        self.device = device
        self.copy_stream = torch.cuda.Stream(device)

    def begin(self) -> None:
        written = torch.cuda.Event()
        written.record(torch.cuda.current_stream(self.device))
        self.copy_stream.wait_event(written)

    def copy_to_host(self, dst: torch.Tensor, src: torch.Tensor) -> None:
        with torch.cuda.stream(self.copy_stream):
            dst.copy_(src, non_blocking=True)
            # the pool's memory is the caching allocator's for good; record the use anyway
            src.record_stream(self.copy_stream)

    def copy_to_device(self, dst: torch.Tensor, src: torch.Tensor) -> None:
        dst.copy_(src, non_blocking=True)

    def end(self) -> Any:
        ev = torch.cuda.Event()
        ev.record(self.copy_stream)
        return ev

    def done(self, token: Any) -> bool:
        return token.query()

    def wait(self, token: Any) -> None:
        token.synchronize()


class KVStaging:
    """A pinned host mirror of a device KV pool, and the copies between them.

    ``stage_layer`` queues a layer's D2H copy and its callback; ``poll`` runs the
    callbacks of the copies that have landed, in the order they were queued (a later
    copy that finished first waits for the earlier one); ``flush`` waits for all.
    """

    def __init__(
        self, pool_kv: torch.Tensor, host: torch.Tensor | None = None, ops: StagingOps | None = None
    ) -> None:
        self.device_kv = pool_kv
        if host is None:
            host = torch.empty(
                pool_kv.shape,
                dtype=pool_kv.dtype,
                pin_memory=pool_kv.device.type == "cuda",
            )
        if host.shape != pool_kv.shape or host.dtype != pool_kv.dtype:
            raise ValueError("the host mirror must have the pool's shape and dtype")
        if host.device.type != "cpu" or not host.is_contiguous():
            raise ValueError("the host mirror must be one contiguous CPU tensor")
        self.host = host
        self.ops: StagingOps = ops or (
            CudaOps(pool_kv.device) if pool_kv.device.type == "cuda" else SyncOps()
        )
        self._pending: deque[tuple[Any, Callable[[], None] | None]] = deque()
        self._host_newer: set[int] = set()
        self.stats = {"staged_blocks": 0, "uploaded_blocks": 0}

    # ---------------------------------------------------------------- device -> host
    def stage_layer(
        self, layer: int, block_ids: Sequence[int], callback: Callable[[], None] | None = None
    ) -> None:
        """Copy layer ``layer`` of ``block_ids`` to the mirror once the compute that wrote
        it is done (without waiting for it here); ``callback`` runs from :meth:`poll` or
        :meth:`flush` once the copy has landed."""
        self.ops.begin()
        for start, stop in block_runs(block_ids):
            self.ops.copy_to_host(self.host[start:stop, layer], self.device_kv[start:stop, layer])
            self.stats["staged_blocks"] += stop - start
        self._pending.append((self.ops.end(), callback))

    def poll(self) -> int:
        """Runs the callbacks of the landed copies at the head of the queue, in order;
        returns how many ran."""
        ran = 0
        while self._pending and self.ops.done(self._pending[0][0]):
            _, cb = self._pending.popleft()
            ran += 1
            if cb is not None:
                cb()
        return ran

    def flush(self) -> None:
        """Waits for every queued copy, running the callbacks in order."""
        while self._pending:
            token, cb = self._pending.popleft()
            self.ops.wait(token)
            if cb is not None:
                cb()

    @property
    def pending(self) -> int:
        return len(self._pending)

    def sync_to_host(self, block_ids: Sequence[int]) -> None:
        """Whole blocks to the mirror now (blocks the device wrote outside a prefill,
        e.g. decode steps, before something reads them from the mirror)."""
        self.ops.begin()
        for start, stop in block_runs(block_ids):
            self.ops.copy_to_host(self.host[start:stop], self.device_kv[start:stop])
        self.ops.wait(self.ops.end())

    # ---------------------------------------------------------------- host -> device
    def mark_host_newer(self, block_ids: Iterable[int]) -> None:
        """Blocks whose next contents arrive in the mirror (just allocated: a handoff or
        a store fetch will land there) and must be uploaded before the device reads them."""
        self._host_newer.update(int(b) for b in block_ids)

    def mark_device_newer(self, block_ids: Iterable[int]) -> None:
        """Blocks the device has just written whole (no upload needed any more)."""
        self._host_newer.difference_update(int(b) for b in block_ids)

    def is_host_newer(self, block_id: int) -> bool:
        return block_id in self._host_newer

    def ensure_device(self, block_ids: Iterable[int]) -> int:
        """Uploads the host-newer ones of ``block_ids`` (whole blocks, ordered before the
        compute that follows on the same stream); returns how many were uploaded."""
        todo = [b for b in set(int(x) for x in block_ids) if b in self._host_newer]
        if not todo:
            return 0
        for start, stop in block_runs(todo):
            self.ops.copy_to_device(self.device_kv[start:stop], self.host[start:stop])
        self._host_newer.difference_update(todo)
        self.stats["uploaded_blocks"] += len(todo)
        return len(todo)


def make_staging(pool_kv: torch.Tensor) -> KVStaging | None:
    """The staging of a pool on a GPU; None on the CPU (the pool itself is registered)."""
    return None if pool_kv.device.type == "cpu" else KVStaging(pool_kv)
