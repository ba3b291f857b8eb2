"""Chained block hashing for prefix caching and model fingerprints."""

from __future__ import annotations

import dataclasses
import hashlib
import json
import struct
from collections.abc import Sequence
from typing import TYPE_CHECKING

if TYPE_CHECKING:  # pragma: no cover
    from _typeshed import DataclassInstance

HASH_BYTES = 16


def prefix_hashes(seed: bytes, token_ids: Sequence[int], block_size: int) -> list[bytes]:
    """One 16-byte chained hash per FULL block of ``token_ids``.

    h_i = blake2b(h_{i-1} + int32-LE(tokens of block i)), with h_{-1} = seed.
    A trailing partial block is not hashed.
    """
    if block_size <= 0:
        raise ValueError("block_size must be positive")
    out: list[bytes] = []
    prev = bytes(seed)
    for b in range(len(token_ids) // block_size):
        chunk = token_ids[b * block_size : (b + 1) * block_size]
        h = hashlib.blake2b(prev, digest_size=HASH_BYTES)
        h.update(struct.pack(f"<{block_size}i", *(int(t) for t in chunk)))
        prev = h.digest()
        out.append(prev)
    return out


def preset_weights_digest(preset: str, seed: int) -> bytes:
    """Digest identifying the deterministic random weights of a preset."""
    return hashlib.blake2b(
        f"preset:{preset}:seed:{int(seed)}".encode(), digest_size=HASH_BYTES
    ).digest()


def model_fingerprint(
    config: DataclassInstance,
    weights_digest: bytes,
    dtype: str,
    tokenizer_name: str,
    block_size: int,
    kv_layout_version: int = 1,
) -> str:
    """Hex fingerprint of everything that must match for two nodes to share KV blocks
    (``config``: the model's config dataclass, e.g. the engine's ``ModelConfig``)."""
    payload = {
        "config": dataclasses.asdict(config),
        "weights": bytes(weights_digest).hex(),
        "dtype": str(dtype),
        "tokenizer": tokenizer_name,
        "block_size": int(block_size),
        "kv_layout_version": int(kv_layout_version),
    }
    blob = json.dumps(payload, sort_keys=True, separators=(",", ":")).encode()
    return hashlib.blake2b(blob, digest_size=HASH_BYTES).hexdigest()
