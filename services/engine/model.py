"""Llama-family decoder running on a paged KV pool.

Two code paths share the weights:

* the serving path (:meth:`LlamaModel.forward_prefill`, :meth:`LlamaModel.forward_decode`)
  reads and writes K/V in a :class:`~services.engine.kv_pool.KVPool` by block index;
* the oracle path (:meth:`LlamaModel.reference_logits`, :meth:`LlamaModel.reference_generate`)
  recomputes the full sequence with no cache at all, with its own explicit attention.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence

import torch
import torch.nn.functional as F
from torch import nn

from kvmesh.services.common.hashing import model_fingerprint, preset_weights_digest

from .config import PRESETS, ModelConfig, dtype_name, resolve_dtype, rope_inv_freq
from .kv_pool import KVPool


class RMSNorm(nn.Module):
    """Root-mean-square layer norm (HF Llama convention: normalize in float32)."""

    def __init__(self, dim: int, eps: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        xf = x.float()
        xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * xf.to(x.dtype)


def _rotate_half(x: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    return torch.cat((-x[..., half:], x[..., :half]), dim=-1)


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate-half RoPE. ``x``: [N, heads, head_dim]; ``cos``/``sin``: [N, head_dim]."""
    return x * cos[:, None, :] + _rotate_half(x) * sin[:, None, :]


def _linear(in_f: int, out_f: int, bias: bool = False) -> nn.Linear:
    return torch.nn.utils.skip_init(nn.Linear, in_f, out_f, bias=bias)


class DecoderLayer(nn.Module):
    """One pre-norm transformer block: GQA self-attention + SwiGLU MLP."""

    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        h, q, kv = cfg.hidden_size, cfg.num_heads * cfg.head_dim, cfg.num_kv_heads * cfg.head_dim
        self.cfg = cfg
        self.input_layernorm = RMSNorm(h, cfg.rms_norm_eps)
        qb, ob, mb = cfg.attention_bias, cfg.attention_out_bias, cfg.mlp_bias
        self.q_proj, self.k_proj, self.v_proj = (
            _linear(h, q, qb),
            _linear(h, kv, qb),
            _linear(h, kv, qb),
        )
        self.o_proj = _linear(q, h, ob)
        self.post_attention_layernorm = RMSNorm(h, cfg.rms_norm_eps)
        i = cfg.intermediate_size
        self.gate_proj, self.up_proj, self.down_proj = (
            _linear(h, i, mb),
            _linear(h, i, mb),
            _linear(i, h, mb),
        )

    def qkv(self, h: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor):
        """Normalized, projected, rotated q [N, H, D] and k, v [N, KVH, D] for hidden ``h`` [N, hidden]."""
        c, n = self.cfg, h.shape[0]
        x = self.input_layernorm(h)
        q = self.q_proj(x).view(n, c.num_heads, c.head_dim)
        k = self.k_proj(x).view(n, c.num_kv_heads, c.head_dim)
        v = self.v_proj(x).view(n, c.num_kv_heads, c.head_dim)
        return apply_rope(q, cos, sin), apply_rope(k, cos, sin), v

    def finish(self, h: torch.Tensor, attn: torch.Tensor) -> torch.Tensor:
        """Residual add of attention output ``attn`` [N, heads*dim], then the MLP block."""
        h = h + self.o_proj(attn)
        x = self.post_attention_layernorm(h)
        return h + self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


class LlamaModel(nn.Module):
    """Llama-family decoder (RMSNorm, RoPE, GQA, SwiGLU) working on a paged :class:`KVPool`."""

    def __init__(self, config: ModelConfig, dtype: torch.dtype | str = torch.float32) -> None:
        super().__init__()
        self.config = config
        self.embed_tokens = torch.nn.utils.skip_init(
            nn.Embedding, config.vocab_size, config.hidden_size
        )
        self.layers = nn.ModuleList(DecoderLayer(config) for _ in range(config.num_layers))
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.lm_head = (
            None if config.tie_word_embeddings else _linear(config.hidden_size, config.vocab_size)
        )
        self.inv_freq = rope_inv_freq(
            config
        )  # plain attribute: RoPE frequencies stay float32 under .to()
        self.preset: str | None = None
        self.seed: int | None = None
        self.weights_digest: bytes = b""
        self.to(resolve_dtype(dtype))
        self.eval()

    # -------------------------------------------------------------- creation
    @classmethod
    def from_preset(
        cls, name: str, seed: int = 0, dtype: torch.dtype | str = torch.float32
    ) -> LlamaModel:
        """Model of preset ``name`` with deterministic random weights derived from ``seed``."""
        if name not in PRESETS:
            raise KeyError(f"unknown preset {name!r}; known: {sorted(PRESETS)}")
        model = cls(PRESETS[name], dtype=torch.float32)
        model.init_weights(seed)
        model.to(resolve_dtype(dtype))
        model.preset, model.seed = name, int(seed)
        model.weights_digest = preset_weights_digest(name, seed)
        return model

    @torch.no_grad()
    def init_weights(self, seed: int) -> None:
        """Fill all weights from a seeded CPU generator (bit-identical across processes).

        Scales keep activations O(1) and logits non-degenerate: projections use
        std 1/sqrt(fan_in), residual outputs are further scaled by 1/sqrt(2L).
        """
        cfg = self.config
        g = torch.Generator(device="cpu").manual_seed(int(seed))
        resid = 1.0 / math.sqrt(2 * cfg.num_layers)
        for name, p in self.named_parameters():
            buf = torch.empty(p.shape, dtype=torch.float32)
            if name.endswith("layernorm.weight") or name == "norm.weight":
                buf.fill_(1.0)
            elif name.endswith(".bias"):
                buf.zero_()
            elif name == "embed_tokens.weight":
                std = 2.0 / math.sqrt(cfg.hidden_size) if cfg.tie_word_embeddings else 1.0
                buf.normal_(0.0, std, generator=g)
            else:
                std = 1.0 / math.sqrt(p.shape[1])
                if name.endswith(("o_proj.weight", "down_proj.weight")):
                    std *= resid
                buf.normal_(0.0, std, generator=g)
            p.copy_(buf)

    @property
    def dtype(self) -> torch.dtype:
        """Compute dtype of the weights."""
        return self.embed_tokens.weight.dtype

    def fingerprint(self, tokenizer_name: str, block_size: int, kv_layout_version: int = 1) -> str:
        """Model fingerprint (see :func:`kvmesh.services.common.hashing.model_fingerprint`)."""
        return model_fingerprint(
            self.config,
            self.weights_digest,
            dtype_name(self.dtype),
            tokenizer_name,
            block_size,
            kv_layout_version,
        )

    # --------------------------------------------------------------- helpers
    def _rope(self, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        freqs = positions.to(torch.float32)[:, None] * self.inv_freq[None, :]
        emb = torch.cat((freqs, freqs), dim=-1)
        return emb.cos().to(self.dtype), emb.sin().to(self.dtype)

    def _logits(self, h: torch.Tensor) -> torch.Tensor:
        w = self.embed_tokens.weight if self.lm_head is None else self.lm_head.weight
        return F.linear(self.norm(h), w).float()

    def _check_pool(self, pool: KVPool) -> None:
        if pool.config != self.config or pool.dtype != self.dtype:
            raise ValueError("KV pool config/dtype does not match the model")

    def _groups(self) -> int:
        return self.config.num_heads // self.config.num_kv_heads

    # ---------------------------------------------------------- serving path
    @torch.inference_mode()
    def forward_prefill(
        self,
        token_ids: torch.Tensor | Sequence[int],
        start_pos: int,
        pool: KVPool,
        block_table: Sequence[int],
        on_layer_done: Callable[[int], None] | None = None,
    ) -> torch.Tensor:
        """Prefill ``n`` new tokens at positions ``start_pos..start_pos+n-1``.

        K/V of positions < ``start_pos`` must already be in ``block_table``'s blocks
        (cached prefix). New K/V is written into the pool by index, then
        ``on_layer_done(l)`` is called, then layer ``l`` attends causally over
        cached + new keys. Returns float32 logits [vocab] of the last position.
        """
        self._check_pool(pool)
        ids = torch.as_tensor(token_ids, dtype=torch.long).reshape(-1)
        n, bs = ids.numel(), pool.block_size
        total = start_pos + n
        if n == 0 or start_pos < 0:
            raise ValueError("prefill needs at least one new token and start_pos >= 0")
        if total > self.config.max_position_embeddings:
            raise ValueError(f"sequence length {total} exceeds max_position_embeddings")
        if len(block_table) * bs < total:
            raise ValueError(f"block_table of {len(block_table)} blocks cannot hold {total} tokens")
        table = torch.as_tensor(list(block_table), dtype=torch.long)
        pos = torch.arange(start_pos, total)
        new_blk, new_off = table[pos // bs], pos % bs
        kpos = torch.arange(total)
        key_blk, key_off = table[kpos // bs], kpos % bs
        mask = (kpos[None, :] <= pos[:, None])[None]  # [1, n, total]
        cos, sin = self._rope(pos)
        g = self._groups()

        h = self.embed_tokens(ids)
        for l, layer in enumerate(self.layers):
            q, k, v = layer.qkv(h, cos, sin)
            kv_l = pool.kv[:, l]  # [blocks, 2, block_size, kv_heads, head_dim] view
            kv_l[new_blk, 0, new_off] = k
            kv_l[new_blk, 1, new_off] = v
            if on_layer_done is not None:
                on_layer_done(l)
            keys = kv_l[key_blk, 0, key_off].transpose(0, 1).repeat_interleave(g, dim=0)
            vals = kv_l[key_blk, 1, key_off].transpose(0, 1).repeat_interleave(g, dim=0)
            o = F.scaled_dot_product_attention(q.transpose(0, 1), keys, vals, attn_mask=mask)
            h = layer.finish(h, o.transpose(0, 1).reshape(n, -1))
        return self._logits(h[-1:])[0]

    @torch.inference_mode()
    def forward_decode(
        self,
        token_ids: torch.Tensor | Sequence[int],
        positions: Sequence[int],
        block_tables: Sequence[Sequence[int]],
        pool: KVPool,
    ) -> torch.Tensor:
        """One decode step for a batch of requests of different lengths.

        Request ``i`` feeds ``token_ids[i]`` at position ``positions[i]``; its K/V
        for positions <= ``positions[i]`` lives in ``block_tables[i]``. Projections
        and MLP run batched; attention gathers each request's keys from its
        blocks into a padded, masked batch. Returns float32 logits [B, vocab].
        """
        self._check_pool(pool)
        ids = torch.as_tensor(token_ids, dtype=torch.long).reshape(-1)
        b, bs = ids.numel(), pool.block_size
        if not (b == len(positions) == len(block_tables)) or b == 0:
            raise ValueError(
                "token_ids, positions and block_tables must have the same non-zero length"
            )
        pos = torch.as_tensor(list(positions), dtype=torch.long)
        if int(pos.min()) < 0 or int(pos.max()) >= self.config.max_position_embeddings:
            raise ValueError("decode position out of range")
        width = max(len(t) for t in block_tables)
        table = torch.zeros((b, width), dtype=torch.long)
        for i, t in enumerate(block_tables):
            if len(t) * bs <= int(pos[i]):
                raise ValueError(f"block_table {i} cannot hold position {int(pos[i])}")
            table[i, : len(t)] = torch.as_tensor(list(t), dtype=torch.long)
        rows = torch.arange(b)
        new_blk, new_off = table[rows, pos // bs], pos % bs
        kpos = torch.arange(int(pos.max()) + 1)[None, :]
        valid = kpos <= pos[:, None]  # [B, Tmax]
        kpos = torch.minimum(kpos, pos[:, None])  # padding re-reads a valid slot
        key_blk, key_off = table[rows[:, None], kpos // bs], kpos % bs
        mask = valid[:, None, None, :]  # [B, 1, 1, Tmax]
        cos, sin = self._rope(pos)
        g = self._groups()

        h = self.embed_tokens(ids)
        for l, layer in enumerate(self.layers):
            q, k, v = layer.qkv(h, cos, sin)
            kv_l = pool.kv[:, l]
            kv_l[new_blk, 0, new_off] = k
            kv_l[new_blk, 1, new_off] = v
            keys = kv_l[key_blk, 0, key_off].transpose(1, 2).repeat_interleave(g, dim=1)
            vals = kv_l[key_blk, 1, key_off].transpose(1, 2).repeat_interleave(g, dim=1)
            o = F.scaled_dot_product_attention(q[:, :, None, :], keys, vals, attn_mask=mask)
            h = layer.finish(h, o.reshape(b, -1))
        return self._logits(h)

    # ------------------------------------------------------------ oracle path
    @torch.inference_mode()
    def reference_logits(self, token_ids: torch.Tensor | Sequence[int]) -> torch.Tensor:
        """Full causal forward with no KV cache; float32 logits [T, vocab] for every position."""
        ids = torch.as_tensor(token_ids, dtype=torch.long).reshape(-1)
        t, c = ids.numel(), self.config
        cos, sin = self._rope(torch.arange(t))
        causal = torch.ones(t, t, dtype=torch.bool).tril()
        scale = 1.0 / math.sqrt(c.head_dim)
        h = self.embed_tokens(ids)
        for layer in self.layers:
            q, k, v = layer.qkv(h, cos, sin)
            q, k, v = q.transpose(0, 1), k.transpose(0, 1), v.transpose(0, 1)
            k = k.repeat_interleave(self._groups(), dim=0)
            v = v.repeat_interleave(self._groups(), dim=0)
            scores = (q @ k.transpose(-1, -2)) * scale
            probs = scores.float().masked_fill(~causal, float("-inf")).softmax(-1).to(v.dtype)
            h = layer.finish(h, (probs @ v).transpose(0, 1).reshape(t, -1))
        return self._logits(h)

    def reference_generate(
        self, token_ids: Sequence[int], max_new_tokens: int, eos_id: int | None = None
    ) -> list[int]:
        """Greedy generation from scratch, recomputing the full sequence each step (no cache).

        Returns only the generated tokens; stops after emitting ``eos_id`` (included)
        or at ``max_new_tokens`` / ``max_position_embeddings``.
        """
        seq = [int(t) for t in token_ids]
        out: list[int] = []
        while len(out) < max_new_tokens and len(seq) < self.config.max_position_embeddings:
            nxt = int(self.reference_logits(seq)[-1].argmax())
            out.append(nxt)
            seq.append(nxt)
            if eos_id is not None and nxt == eos_id:
                break
        return out
