"""Limits on the store-master's calls and the key check every path applies (gRPC in
:mod:`kvmesh.services.store_master.server`, raw TCP in
:mod:`kvmesh.services.store_master.fastcalls`)."""

from __future__ import annotations

from collections.abc import Iterable, Sequence

MAX_HASHES = 65536  # keys (and reserved slots) per call
MAX_KEY_LEN = 256
HASH_LEN = 16  # KV block hashes; generic keys may be 1..MAX_KEY_LEN bytes


def check_keys(keys: Sequence[bytes], call: str) -> str | None:
    """The error text for a key list ``call`` must refuse (too many keys, a key empty or
    longer than ``MAX_KEY_LEN``), or None when it is acceptable."""
    if len(keys) > MAX_HASHES:
        return f"{call}: at most {MAX_HASHES} keys per call, got {len(keys)}"
    for k in keys:
        if not 1 <= len(k) <= MAX_KEY_LEN:
            return f"{call}: every key must be 1..{MAX_KEY_LEN} bytes, got {len(k)}"
    return None


def biggest_segment(segments: Iterable) -> int:
    """The size in bytes of the biggest mounted DRAM segment (0: none)."""
    return max((seg.size for seg in segments), default=0)


def check_put_sizes(sizes: Sequence[int], biggest: int, call: str) -> str | None:
    """The error text for put sizes ``call`` must refuse: a size of 0, or one larger than
    the biggest segment (``biggest``; 0 = none mounted yet, not checked), which could
    never be placed and would only evict every block to make room for it."""
    for z in sizes:
        if z <= 0:
            return f"{call}: size must be > 0"
        if biggest and z > biggest:
            return (
                f"{call}: a value of {z} bytes is larger than the biggest store segment "
                f"({biggest} bytes) and can never be placed; split it or mount a bigger "
                f"segment (--segment-memory)"
            )
    return None
