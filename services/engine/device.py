"""Where a model node computes: ``--device cpu|cuda|auto``, the KV pool's size on that
device, and the batch-size buckets CUDA graphs are captured for.

Everything here but :func:`cuda_available` is plain logic that runs (and is tested) on a
machine without a GPU.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

DEVICES = ("cpu", "cuda", "auto")

# Decode batch sizes a CUDA graph is captured for; a batch runs in the smallest bucket
# that holds it (padded), a batch past the largest runs eagerly.
DEFAULT_GRAPH_BUCKETS = (1, 2, 4, 8, 16, 32, 64)


def cuda_available() -> bool:
    return torch.cuda.is_available()


def resolve_device(name: str, cuda: bool | None = None) -> torch.device:
    """``cpu``, ``cuda`` (``cuda:N``) or ``auto`` (CUDA where torch sees it, else the CPU).

    ``cuda`` without a CUDA device is a ValueError that says so, so a node fails at start
    rather than at its first request. ``cuda`` overrides the probe (tests)."""
    text = str(name).strip().lower()
    have = cuda_available() if cuda is None else cuda
    if text == "auto":
        return torch.device("cuda" if have else "cpu")
    if text == "cpu":
        return torch.device("cpu")
    if text == "cuda" or text.startswith("cuda:"):
        if not have:
            raise ValueError(
                f"{name!r}: torch sees no CUDA device (torch {torch.__version__}); "
                "use --device cpu, or auto to take CUDA only where present"
            )
        dev = torch.device(text)
        if cuda is None and dev.index is not None and dev.index >= torch.cuda.device_count():
            raise ValueError(
                f"{name!r}: only {torch.cuda.device_count()} CUDA device(s) are visible"
            )
        return dev
    raise ValueError(f"unknown device {name!r}; expected one of {', '.join(DEVICES)}")


def device_free_memory(device: torch.device) -> int:
    """Free bytes on a CUDA device now (``cudaMemGetInfo``)."""
    free, _total = torch.cuda.mem_get_info(device)
    return int(free)


def kv_memory_bytes(spec: str, device: torch.device, free: int | None = None) -> int:
    """Bytes of the KV pool for ``--kv-memory``: a size (``2GiB``) anywhere; a share
    (``80%``) of the memory available at start: host MemAvailable on the CPU, free device
    memory (after the weights are loaded) on CUDA. ``free`` overrides the probe (tests)."""
    from kvmesh.services.common.config import parse_memory

    text = str(spec).strip()
    if device.type != "cuda" or not text.endswith("%"):
        return parse_memory(text)
    from kvmesh.services.common.config import ConfigError

    try:
        pct = float(text[:-1])
    except ValueError:
        raise ConfigError(f"cannot read {spec!r} as a percentage; write e.g. 80%") from None
    if not 0 < pct <= 90:
        raise ConfigError(f"{spec!r}: a memory share must be in (0%, 90%]")
    avail = device_free_memory(device) if free is None else free
    return int(avail * pct / 100)


def graph_bucket(batch: int, buckets: Sequence[int] = DEFAULT_GRAPH_BUCKETS) -> int | None:
    """The smallest captured batch size that holds ``batch`` (the batch is padded to it),
    or None when ``batch`` is past the largest bucket (that step runs eagerly)."""
    if batch < 1:
        raise ValueError(f"batch must be >= 1, got {batch}")
    for b in sorted(buckets):
        if b >= batch:
            return b
    return None


def graph_buckets(max_batch: int, buckets: Sequence[int] = DEFAULT_GRAPH_BUCKETS) -> list[int]:
    """Buckets worth capturing for batches of at most ``max_batch``: those up to the first
    that holds ``max_batch`` (capturing larger ones only costs memory)."""
    top = graph_bucket(max(1, max_batch), buckets)
    return sorted(b for b in set(buckets) if top is None or b <= top)
