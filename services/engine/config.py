"""Model configuration, presets and dtype handling for the kvmesh engine."""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class ModelConfig:
    """Hyper-parameters of a Llama-family decoder-only transformer."""

    vocab_size: int
    hidden_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    intermediate_size: int
    max_position_embeddings: int
    rope_theta: float = 10000.0
    rms_norm_eps: float = 1e-5
    tie_word_embeddings: bool = False

    def __post_init__(self) -> None:
        if self.num_heads % self.num_kv_heads != 0:
            raise ValueError("num_heads must be a multiple of num_kv_heads")
        if self.head_dim % 2 != 0:
            raise ValueError("head_dim must be even for rotary embeddings")

    def num_params(self) -> int:
        """Total number of weights (tied embeddings counted once)."""
        h, i = self.hidden_size, self.intermediate_size
        q = self.num_heads * self.head_dim
        kv = self.num_kv_heads * self.head_dim
        per_layer = h * q + 2 * h * kv + q * h + 3 * h * i + 2 * h
        embed = self.vocab_size * h
        head = 0 if self.tie_word_embeddings else self.vocab_size * h
        return embed + head + self.num_layers * per_layer + h


PRESETS: dict[str, ModelConfig] = {
    # Fast on two CPU cores; used by tests and local clusters.
    "tiny": ModelConfig(
        vocab_size=320, hidden_size=64, num_layers=4, num_heads=4, num_kv_heads=2,
        head_dim=16, intermediate_size=172, max_position_embeddings=4096,
        rope_theta=10000.0, rms_norm_eps=1e-5, tie_word_embeddings=False,
    ),
    # Llama-like shape, ~125M parameters (~100M without the untied lm_head).
    # Untied: with random weights a tied head makes greedy decoding repeat its input.
    "small": ModelConfig(
        vocab_size=32000, hidden_size=768, num_layers=12, num_heads=12, num_kv_heads=4,
        head_dim=64, intermediate_size=2048, max_position_embeddings=4096,
        rope_theta=10000.0, rms_norm_eps=1e-5, tie_word_embeddings=False,
    ),
}

_DTYPES: dict[str, torch.dtype] = {
    "float32": torch.float32, "fp32": torch.float32,
    "bfloat16": torch.bfloat16, "bf16": torch.bfloat16,
}


def resolve_dtype(name: str | torch.dtype) -> torch.dtype:
    """Map a dtype name ("float32"/"bfloat16") to a torch dtype.

    float16 is rejected: it is extremely slow on CPU and not supported by the engine.
    """
    if isinstance(name, torch.dtype):
        if name in (torch.float32, torch.bfloat16):
            return name
        name = str(name).removeprefix("torch.")
    key = str(name).strip().lower()
    if key in ("float16", "fp16", "half"):
        raise ValueError("dtype float16 is not supported (very slow on CPU); use 'float32' or 'bfloat16'")
    if key not in _DTYPES:
        raise ValueError(f"unknown dtype {name!r}; expected 'float32' or 'bfloat16'")
    return _DTYPES[key]


def dtype_name(dtype: torch.dtype) -> str:
    """Canonical name of a supported torch dtype ("float32" or "bfloat16")."""
    return {torch.float32: "float32", torch.bfloat16: "bfloat16"}[resolve_dtype(dtype)]
