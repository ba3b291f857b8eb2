"""Loading a model: a random preset, a shipped model, a checkpoint directory or a hub id.

:func:`load_model` takes a *spec* and returns a :class:`LoadedModel` (model, config,
tokenizer, weights digest, name). :func:`resolve_model` says where a spec lives, in this
order (that of ``vllm serve``: a local path or a preset name wins over the hub):

1. a random preset (``tiny``, ``small``: weights drawn from ``--seed``);
2. a model shipped inside kvmesh (``demo``: a small Llama trained on public-domain
   English by ``scripts/train_demo.py``, in ``services/engine/demo/``);
3. a local Hugging Face model directory;
4. a Hugging Face hub id (``org/name``, e.g. ``Qwen/Qwen2.5-0.5B-Instruct``), resolved by
   ``huggingface_hub``: its snapshot in the hub cache (``HF_HOME``, ``HF_HUB_CACHE``),
   downloaded first when missing unless ``HF_HUB_OFFLINE=1``, where only the cache is
   read and a missing id is a :class:`CheckpointError` that says so.

Supported directories:

* ``config.json`` of a ``LlamaForCausalLM``, ``MistralForCausalLM`` or
  ``Qwen2ForCausalLM`` (``architectures``, else ``model_type``); transformers 4.x
  (``rope_theta`` + ``rope_scaling``) and 5.x (``rope_parameters``) layouts;
* weights in ``model.safetensors`` or sharded per ``model.safetensors.index.json``
  (any tensor dtype is converted to the compute dtype);
* ``tokenizer.json`` (see :class:`~services.common.tokenizer.HFTokenizer`).

Features: q/k/v biases (Qwen2, Llama ``attention_bias``), o_proj and MLP biases
(Llama ``attention_bias`` / ``mlp_bias``), tied embeddings (``tie_word_embeddings``;
``lm_head.weight`` may then be absent), ``head_dim``, ``rope_theta``, rope scaling
``linear`` and ``llama3``. ``dynamic``/``yarn``/``longrope`` scaling is rejected: it makes
a key's rotation depend on the length of the request reading it, which a shared paged
KV cache cannot honour.

Sliding-window attention (Mistral ``sliding_window``, Qwen2 ``use_sliding_window``) is
not implemented; instead the served context (``max_position_embeddings``) is capped at
the window, where full and windowed attention are identical, so a longer prompt fails
with the usual "exceeds max_position_embeddings" error rather than silently differing.

Every problem with a checkpoint raises :class:`CheckpointError` at load time with the
offending file and what is wrong with it.
"""

from __future__ import annotations

import hashlib
import logging
import os
from dataclasses import dataclass
from typing import Any

import torch

from kvmesh.services.common.hashing import model_fingerprint
from kvmesh.services.common.tokenizer import ByteTokenizer, HFTokenizer, TokenizerError, read_json

from .config import PRESETS, ModelConfig, RopeScaling, dtype_name, resolve_dtype
from .model import LlamaModel

# where a spec lives, torch-free (the launcher checks --model with it before etcd starts)
from .model_spec import CheckpointError, resolve_model
from .model_spec import shipped_model_dir as shipped_model_dir

log = logging.getLogger(__name__)

KV_LAYOUT_VERSION = 1
SUPPORTED_ARCHITECTURES = {
    "LlamaForCausalLM": "llama",
    "MistralForCausalLM": "mistral",
    "Qwen2ForCausalLM": "qwen2",
}
_CHUNK = 1 << 22


@dataclass
class LoadedModel:
    """A ready-to-serve model and everything that identifies it."""

    model: LlamaModel
    config: ModelConfig
    tokenizer: ByteTokenizer | HFTokenizer
    weights_digest: bytes
    name: str  # preset or shipped model name, hub id, or the directory's base name
    path: (
        str  # preset name or absolute directory path (what the conductor loads the tokenizer from)
    )

    @property
    def dtype(self) -> torch.dtype:
        return self.model.dtype

    def fingerprint(
        self, dtype_name_: str | torch.dtype | None = None, block_size: int = 256
    ) -> str:
        """Fingerprint of weights digest, config, dtype, tokenizer, block size and KV layout.

        The device (``--device cpu|cuda``) is deliberately not in it: a pool on a GPU has
        the same layout and dtype as one on the CPU, and its bytes travel through a host
        mirror of that same layout, so a CPU node and a GPU node of one dtype exchange KV
        (handoffs, store blocks) byte for byte. Only what changes the KV bytes enters."""
        dt = dtype_name(resolve_dtype(dtype_name_ if dtype_name_ is not None else self.dtype))
        return model_fingerprint(
            self.config, self.weights_digest, dt, self.tokenizer.name, block_size, KV_LAYOUT_VERSION
        )


def load_model(spec: str, dtype: torch.dtype | str = torch.float32, seed: int = 0) -> LoadedModel:
    """Load a preset (random weights from ``seed``), a shipped model, a Hugging Face model
    directory or a hub id (see :func:`resolve_model`)."""
    dt = resolve_dtype(dtype)  # ValueError for float16 / unknown names
    if spec in PRESETS:
        model = LlamaModel.from_preset(spec, seed=seed, dtype=dt)
        return LoadedModel(model, model.config, ByteTokenizer(), model.weights_digest, spec, spec)
    path = resolve_model(spec)
    assert path is not None  # download=True: a path or an error
    config = config_from_hf(path)
    try:
        tokenizer = HFTokenizer(path)
    except TokenizerError as e:
        raise CheckpointError(str(e)) from None
    files = weight_files(path)
    digest = weights_digest(files)
    model = LlamaModel(config, dtype=dt)
    load_weights(model, files)
    model.weights_digest = digest
    model.eval()
    # a name or hub id is the model's name; a directory, its base name
    name = os.path.basename(path) if os.path.isdir(spec) else spec
    return LoadedModel(model, config, tokenizer, digest, name, path)


# ------------------------------------------------------------------ config
def _get(cfg: dict, key: str, where: str, typ=int, default: Any = ..., positive: bool = True):
    if key not in cfg or cfg[key] is None:
        if default is ...:
            raise CheckpointError(f"{where}: missing required key {key!r}")
        return default
    v = cfg[key]
    ok = (
        isinstance(v, (int, float)) and not isinstance(v, bool)
        if typ is float
        else (isinstance(v, typ) and not isinstance(v, bool) if typ is int else isinstance(v, typ))
    )
    if not ok:
        raise CheckpointError(f"{where}: {key} must be {typ.__name__}, got {v!r}")
    if positive and typ in (int, float) and not v > 0:
        raise CheckpointError(f"{where}: {key} must be > 0, got {v!r}")
    return typ(v)


def _rope(cfg: dict, where: str) -> tuple[float, RopeScaling | None]:
    params = cfg.get("rope_parameters")
    if isinstance(params, dict) and params and all(isinstance(v, dict) for v in params.values()):
        raise CheckpointError(f"{where}: per-layer-type rope_parameters are not supported")
    if isinstance(params, dict):  # transformers 5.x
        theta = _get(
            params,
            "rope_theta",
            where + " rope_parameters",
            float,
            cfg.get("rope_theta") or 10000.0,
        )
        scaling = params
    else:  # transformers 4.x
        theta = _get(cfg, "rope_theta", where, float, 10000.0)
        scaling = cfg.get("rope_scaling") or {}
    if not isinstance(scaling, dict):
        raise CheckpointError(f"{where}: rope_scaling must be an object or null, got {scaling!r}")
    rtype = scaling.get("rope_type", scaling.get("type", "default")) or "default"
    if scaling.get("partial_rotary_factor", 1.0) != 1.0:
        raise CheckpointError(f"{where}: partial_rotary_factor != 1 is not supported")
    if rtype == "default":
        return theta, None
    if rtype not in ("linear", "llama3"):
        raise CheckpointError(
            f"{where}: unsupported rope scaling type {rtype!r} (supported: linear, llama3)"
        )
    w = f"{where} rope scaling"
    try:
        rs = RopeScaling(
            rope_type=rtype,
            factor=_get(scaling, "factor", w, float),
            low_freq_factor=_get(
                scaling, "low_freq_factor", w, float, 1.0 if rtype == "linear" else ...
            ),
            high_freq_factor=_get(
                scaling, "high_freq_factor", w, float, 4.0 if rtype == "linear" else ...
            ),
            original_max_position_embeddings=_get(
                scaling, "original_max_position_embeddings", w, int, 0 if rtype == "linear" else ...
            ),
        )
    except ValueError as e:
        if isinstance(e, CheckpointError):
            raise
        raise CheckpointError(f"{w}: {e}") from None
    return theta, rs


def config_from_hf(path: str) -> ModelConfig:
    """:class:`ModelConfig` of the ``config.json`` in ``path`` (clear errors naming the file)."""
    where = os.path.join(path, "config.json")
    try:
        cfg = read_json(where)
    except TokenizerError as e:
        raise CheckpointError(str(e)) from None
    archs = cfg.get("architectures") or []
    if archs:
        if (
            not isinstance(archs, list)
            or len(archs) != 1
            or archs[0] not in SUPPORTED_ARCHITECTURES
        ):
            raise CheckpointError(
                f"{where}: unsupported architecture {archs!r}; supported: "
                f"{', '.join(SUPPORTED_ARCHITECTURES)}"
            )
        family = SUPPORTED_ARCHITECTURES[archs[0]]
    else:
        family = cfg.get("model_type")
        if family not in SUPPORTED_ARCHITECTURES.values():
            raise CheckpointError(
                f"{where}: unsupported model_type {family!r} and no architectures; "
                f"supported: {', '.join(SUPPORTED_ARCHITECTURES)}"
            )
    act = cfg.get("hidden_act", "silu")
    if act != "silu":
        raise CheckpointError(f"{where}: unsupported hidden_act {act!r} (only silu)")
    if cfg.get("pretraining_tp", 1) not in (1, None):
        raise CheckpointError(f"{where}: pretraining_tp != 1 is not supported")
    hidden = _get(cfg, "hidden_size", where)
    heads = _get(cfg, "num_attention_heads", where)
    kv_heads = _get(cfg, "num_key_value_heads", where, int, heads)
    head_dim = _get(cfg, "head_dim", where, int, None)
    if head_dim is None:
        if hidden % heads:
            raise CheckpointError(
                f"{where}: hidden_size {hidden} is not a multiple of "
                f"num_attention_heads {heads} and no head_dim is given"
            )
        head_dim = hidden // heads
    default_ctx = {"llama": 2048, "mistral": 4096 * 32, "qwen2": 32768}[family]
    max_pos = _get(cfg, "max_position_embeddings", where, int, default_ctx)
    window = None
    if family == "mistral" or (family == "qwen2" and cfg.get("use_sliding_window")):
        window = _get(cfg, "sliding_window", where, int, None)
    if window is not None and window < max_pos:
        log.warning(
            "%s: sliding-window attention is not implemented; serving context capped "
            "at the window (%d tokens instead of %d)",
            where,
            window,
            max_pos,
        )
        max_pos = window
    theta, scaling = _rope(cfg, where)
    if family == "qwen2":
        qkv_bias, out_bias, mlp_bias = True, False, False
    else:
        bias = bool(cfg.get("attention_bias", False))
        qkv_bias, out_bias, mlp_bias = bias, bias, bool(cfg.get("mlp_bias", False))
    try:
        return ModelConfig(
            vocab_size=_get(cfg, "vocab_size", where),
            hidden_size=hidden,
            num_layers=_get(cfg, "num_hidden_layers", where),
            num_heads=heads,
            num_kv_heads=kv_heads,
            head_dim=head_dim,
            intermediate_size=_get(cfg, "intermediate_size", where),
            max_position_embeddings=max_pos,
            rope_theta=theta,
            rms_norm_eps=_get(cfg, "rms_norm_eps", where, float, 1e-6),
            tie_word_embeddings=bool(cfg.get("tie_word_embeddings", False)),
            attention_bias=qkv_bias,
            attention_out_bias=out_bias,
            mlp_bias=mlp_bias,
            rope_scaling=scaling,
        )
    except ValueError as e:
        raise CheckpointError(f"{where}: {e}") from None


# ----------------------------------------------------------------- weights
def weight_files(path: str) -> list[str]:
    """The safetensors files of ``path``: those listed by the index, else ``model.safetensors``."""
    index = os.path.join(path, "model.safetensors.index.json")
    single = os.path.join(path, "model.safetensors")
    if os.path.isfile(index):
        try:
            data = read_json(index)
        except TokenizerError as e:
            raise CheckpointError(str(e)) from None
        wmap = data.get("weight_map")
        if (
            not isinstance(wmap, dict)
            or not wmap
            or not all(isinstance(v, str) for v in wmap.values())
        ):
            raise CheckpointError(f"{index}: missing or malformed 'weight_map'")
        files = []
        for name in sorted(set(wmap.values())):
            f = os.path.join(path, name)
            if os.path.basename(name) != name or not os.path.isfile(f):
                raise CheckpointError(
                    f"{index}: shard {name!r} listed in the index is missing ({f})"
                )
            files.append(f)
        return files
    if os.path.isfile(single):
        return [single]
    others = sorted(n for n in os.listdir(path) if n.endswith(".safetensors"))
    if others:
        raise CheckpointError(
            f"{path}: found {others} but neither model.safetensors nor model.safetensors.index.json"
        )
    raise CheckpointError(
        f"{single}: file not found (and no model.safetensors.index.json); "
        f"only safetensors weights are supported"
    )


def weights_digest(files: list[str]) -> bytes:
    """sha256 over (file name, sha256 of contents) of each weight file, streamed in chunks."""
    outer = hashlib.sha256()
    for f in sorted(files, key=os.path.basename):
        h = hashlib.sha256()
        with open(f, "rb") as fh:
            while chunk := fh.read(_CHUNK):
                h.update(chunk)
        outer.update(os.path.basename(f).encode() + b"\0" + h.digest())
    return outer.digest()


def hf_name(param: str) -> str:
    """Hugging Face tensor name of one of our parameter names."""
    if param.startswith("layers."):
        _, i, rest = param.split(".", 2)
        sub = (
            "self_attn."
            if rest.split(".")[0] in ("q_proj", "k_proj", "v_proj", "o_proj")
            else ("mlp." if rest.split(".")[0] in ("gate_proj", "up_proj", "down_proj") else "")
        )
        return f"model.layers.{i}.{sub}{rest}"
    if param == "lm_head.weight":
        return param
    return "model." + param


@torch.no_grad()
def load_weights(model: LlamaModel, files: list[str]) -> None:
    """Copy every parameter of ``model`` from the safetensors ``files`` (converting dtype).

    Fails on a missing tensor, a shape mismatch, a non-float tensor, a duplicate or an
    unexpected tensor (``rotary_emb.inv_freq`` buffers and a tied ``lm_head.weight`` are
    ignored).
    """
    from safetensors import SafetensorError, safe_open

    params = {hf_name(n): (n, p) for n, p in model.named_parameters()}
    tied = model.config.tie_word_embeddings
    loaded: dict[str, str] = {}
    for f in files:
        try:
            with safe_open(f, framework="pt") as st:
                for key in st.keys():
                    if key.endswith("rotary_emb.inv_freq") or (tied and key == "lm_head.weight"):
                        continue
                    if key not in params:
                        raise CheckpointError(
                            f"{f}: unexpected tensor {key!r} (not part of a "
                            f"{model.config.num_layers}-layer model with this config)"
                        )
                    if key in loaded:
                        raise CheckpointError(f"{f}: tensor {key!r} also present in {loaded[key]}")
                    name, p = params[key]
                    t = st.get_tensor(key)
                    if not t.is_floating_point():
                        raise CheckpointError(
                            f"{f}: tensor {key!r} has dtype {t.dtype}; "
                            f"expected a floating-point dtype"
                        )
                    if tuple(t.shape) != tuple(p.shape):
                        raise CheckpointError(
                            f"{f}: tensor {key!r} has shape {list(t.shape)}, "
                            f"expected {list(p.shape)} from config.json"
                        )
                    p.copy_(t)  # converts to the compute dtype
                    loaded[key] = f
        except SafetensorError as e:
            raise CheckpointError(f"{f}: malformed safetensors file ({e})") from None
        except (OSError, RuntimeError) as e:
            if isinstance(e, CheckpointError):
                raise
            raise CheckpointError(f"{f}: cannot read tensors ({e})") from None
    missing = [k for k in params if k not in loaded]
    if missing:
        where = (
            files[0] if len(files) == 1 else f"{len(files)} shards in {os.path.dirname(files[0])}"
        )
        more = f" (and {len(missing) - 1} more)" if len(missing) > 1 else ""
        raise CheckpointError(f"{where}: missing tensor {missing[0]!r}{more}")
