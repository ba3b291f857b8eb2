"""Model configuration, presets and dtype handling for the kvmesh engine.

Importing it does not load torch (the functions that need it import it): the launcher
reads the presets' names (:mod:`.model_spec`) without paying seconds for torch."""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    import torch

ROPE_SCALING_TYPES = ("linear", "llama3")


@dataclass(frozen=True)
class RopeScaling:
    """RoPE frequency scaling (Hugging Face ``rope_scaling`` / ``rope_parameters``).

    ``linear`` divides every frequency by ``factor``; ``llama3`` divides the low
    frequencies by ``factor``, keeps the high ones and interpolates in between
    (``low_freq_factor``, ``high_freq_factor``, ``original_max_position_embeddings``).
    Position-dependent schemes (``dynamic``, ``yarn``, ``longrope``) are not supported:
    with a paged KV cache the rotation of a cached key must not depend on the
    length of the request that later reads it.
    """

    rope_type: str
    factor: float
    low_freq_factor: float = 1.0
    high_freq_factor: float = 4.0
    original_max_position_embeddings: int = 0

    def __post_init__(self) -> None:
        if self.rope_type not in ROPE_SCALING_TYPES:
            raise ValueError(
                f"unsupported rope scaling type {self.rope_type!r}; "
                f"supported: {', '.join(ROPE_SCALING_TYPES)}"
            )
        if not self.factor > 0:
            raise ValueError(f"rope scaling factor must be > 0, got {self.factor}")
        if self.rope_type == "llama3":
            if self.original_max_position_embeddings <= 0:
                raise ValueError("llama3 rope scaling needs original_max_position_embeddings > 0")
            if not self.high_freq_factor > self.low_freq_factor > 0:
                raise ValueError("llama3 rope scaling needs high_freq_factor > low_freq_factor > 0")


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
    attention_bias: bool = False  # bias on q/k/v projections (Qwen2; Llama attention_bias)
    attention_out_bias: bool = False  # bias on o_proj (Llama attention_bias)
    mlp_bias: bool = False  # bias on gate/up/down projections (Llama mlp_bias)
    rope_scaling: RopeScaling | None = None

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
        per_layer += (q + 2 * kv) * self.attention_bias + h * self.attention_out_bias
        per_layer += (2 * i + h) * self.mlp_bias
        embed = self.vocab_size * h
        head = 0 if self.tie_word_embeddings else self.vocab_size * h
        return embed + head + self.num_layers * per_layer + h


def rope_inv_freq(config: ModelConfig) -> torch.Tensor:
    """float32 RoPE inverse frequencies [head_dim // 2], scaled per ``config.rope_scaling``

    (bit-for-bit the computation of transformers' ``modeling_rope_utils``)."""
    import torch

    d = config.head_dim
    inv = 1.0 / (config.rope_theta ** (torch.arange(0, d, 2, dtype=torch.int64).float() / d))
    rs = config.rope_scaling
    if rs is None:
        return inv
    if rs.rope_type == "linear":
        return inv / rs.factor
    # llama3
    low_wavelen = rs.original_max_position_embeddings / rs.low_freq_factor
    high_wavelen = rs.original_max_position_embeddings / rs.high_freq_factor
    wavelen = 2 * math.pi / inv
    out = torch.where(wavelen > low_wavelen, inv / rs.factor, inv)
    smooth = (rs.original_max_position_embeddings / wavelen - rs.low_freq_factor) / (
        rs.high_freq_factor - rs.low_freq_factor
    )
    smoothed = (1 - smooth) * out / rs.factor + smooth * out
    medium = ~(wavelen < high_wavelen) * ~(wavelen > low_wavelen)
    return torch.where(medium, smoothed, out)


def _untied_llama(
    vocab_size: int,
    hidden_size: int,
    num_layers: int,
    num_heads: int,
    num_kv_heads: int,
    head_dim: int,
    intermediate_size: int,
    max_position_embeddings: int,
) -> ModelConfig:
    """A preset's shape: a Llama with an untied lm_head (with random weights a tied head
    makes greedy decoding repeat its input), RoPE theta 10000, RMSNorm eps 1e-5."""
    return ModelConfig(
        vocab_size=vocab_size,
        hidden_size=hidden_size,
        num_layers=num_layers,
        num_heads=num_heads,
        num_kv_heads=num_kv_heads,
        head_dim=head_dim,
        intermediate_size=intermediate_size,
        max_position_embeddings=max_position_embeddings,
        rope_theta=10000.0,
        rms_norm_eps=1e-5,
        tie_word_embeddings=False,
    )


# The presets' weights are random (from --seed); RoPE has no learned limit, so long
# prompts run on them up to max_position_embeddings.
# fmt: off
PRESETS: dict[str, ModelConfig] = {
    #                        vocab  hidden layers heads kv_heads head_dim intermediate positions
    # Fast on two CPU cores; used by tests and local clusters.
    "tiny":     _untied_llama(  320,    64,     4,    4,       2,      16,         172,     4096),
    # Llama-like shape, ~125M parameters (~100M without the untied lm_head). 32k
    # positions: long prompts (Mooncake's trace averages ~12k input tokens) run on it.
    "small":    _untied_llama(32000,   768,    12,   12,       4,      64,        2048,    32768),
    # ~11M parameters, byte vocabulary: the evaluation's model (python -m kvmesh.loadtest).
    # Its prefill costs real compute next to its KV bytes on one CPU core (~0.5 ms per
    # prompt token in float32, 6 KiB of KV per token) while a decode step stays ~10 ms.
    "medium":   _untied_llama(  320,   384,     6,    6,       2,      64,        1024,     8192),
    # A Llama shape of ~1.1B parameters (2.2 GB in bfloat16): the GPU check's model
    # (scripts/gpu-check.sh). Too large for the CPU tests.
    "llama-1b": _untied_llama(32000,  2048,    16,   32,       8,      64,        8192,    32768),
}
# fmt: on

# Trained models shipped inside kvmesh, by name -> folder beside this module (package
# data). Unlike PRESETS (random weights from --seed) they load like a checkpoint
# directory, tokenizer included (see checkpoint.resolve_model).
# demo: a 1.3 M-parameter Llama that writes English, trained by scripts/train_demo.py on
# The Devil's Dictionary (public domain); what `kvmesh up --demo` serves.
SHIPPED_MODELS: dict[str, str] = {"demo": "demo"}

# accepted names -> torch's attribute
_DTYPES: dict[str, str] = {
    "float32": "float32",
    "fp32": "float32",
    "bfloat16": "bfloat16",
    "bf16": "bfloat16",
    "float16": "float16",
    "fp16": "float16",
    "half": "float16",
}
# what --dtype takes, as vllm serve's --dtype
DTYPE_CHOICES = ("auto", "bfloat16", "float16", "float32")
FLOAT16_ON_CPU = (
    "dtype float16 runs on CUDA only: a CPU has no native half-precision matrix kernels, "
    "so float16 computes many times slower than float32 there (5x in a 256x768x768 "
    "product on a 2-core AVX2 host, far more at batch 1); use float32 (the fastest on most "
    "CPUs), bfloat16 (half the memory) or auto"
)


def resolve_dtype(name: str | torch.dtype, cuda: bool | None = None) -> torch.dtype:
    """Map a dtype name to a torch dtype: ``float32``, ``bfloat16``, ``float16`` (CUDA
    only) or ``auto`` (bfloat16 on CUDA, float32 on a CPU).

    ``cuda``: whether the model computes on a CUDA device (None: whether torch sees one).
    float16 without CUDA is a ValueError that says why (:data:`FLOAT16_ON_CPU`)."""
    import torch

    if cuda is None:
        cuda = torch.cuda.is_available()
    if isinstance(name, torch.dtype):
        if name in (torch.float32, torch.bfloat16) or (name == torch.float16 and cuda):
            return name
        name = str(name).removeprefix("torch.")
    key = str(name).strip().lower()
    if key == "auto":
        return torch.bfloat16 if cuda else torch.float32
    if key not in _DTYPES:
        raise ValueError(f"unknown dtype {name!r}; expected one of {', '.join(DTYPE_CHOICES)}")
    if _DTYPES[key] == "float16" and not cuda:
        raise ValueError(FLOAT16_ON_CPU)
    return getattr(torch, _DTYPES[key])


def dtype_name(dtype: torch.dtype) -> str:
    """Canonical name of a supported torch dtype ("float32", "bfloat16" or "float16")."""
    import torch

    return {torch.float32: "float32", torch.bfloat16: "bfloat16", torch.float16: "float16"}[
        resolve_dtype(dtype)
    ]
