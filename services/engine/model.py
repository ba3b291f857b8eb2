"""Llama-family decoder running on a paged KV pool.

Two code paths share the weights:

* the serving path (:meth:`LlamaModel.forward_prefill`, :meth:`LlamaModel.forward_decode`)
  reads and writes K/V in a :class:`~services.engine.kv_pool.KVPool` by block index;
* the oracle path (:meth:`LlamaModel.reference_logits`, :meth:`LlamaModel.reference_generate`)
  recomputes the full sequence with no cache at all, with its own explicit attention.
"""

from __future__ import annotations

import functools
import math
import os
import platform
from collections.abc import Callable, Hashable, Sequence
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import nn

from kvmesh.services.common.hashing import model_fingerprint, preset_weights_digest

from .config import PRESETS, ModelConfig, dtype_name, resolve_dtype, rope_inv_freq
from .cpu_attention import CpuDecodeAttention
from .kv_mirror import KVMirror
from .kv_pool import KVPool


class PrefillStopped(RuntimeError):
    """A chunked prefill stopped between two chunks because its caller asked it to."""


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


@functools.cache
def upcast_bf16() -> bool:
    """Whether bfloat16 matrix products run in float32 here: True on an x86 CPU without
    AVX512-BF16 or AMX, where oneDNN emulates bfloat16 about 7x slower than float32 (an
    AVX2 box: 2048x768x2048 took 657 ms in bfloat16, 79 ms upcast). Weights and KV stay
    bfloat16, only the product widens: the inputs are exact in float32 and the result is
    rounded back, as a native bfloat16 kernel (float32 accumulation) does, so only the
    order of the sums differs. ``KVMESH_BF16_UPCAST=0|1`` overrides the detection."""
    env = os.environ.get("KVMESH_BF16_UPCAST", "").strip()
    if env in ("0", "1"):
        return env == "1"
    if platform.machine().lower() not in ("x86_64", "amd64"):
        return False
    try:
        flags = Path("/proc/cpuinfo").read_text()
    except OSError:
        return False
    return "avx512_bf16" not in flags and "amx_bf16" not in flags


_UPCAST_MIN_ROWS = 8  # below, the bfloat16 GEMV is as fast (memory-bound on the weights)
_UPCAST_WEIGHT_ROWS = 4096  # a wide weight (the LM head) is widened this many rows at a time


def linear(x: torch.Tensor, w: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """``F.linear``; a bfloat16 product of ``>= 8`` rows on a CPU without native bfloat16
    (:func:`upcast_bf16`) runs in float32 and is rounded back to bfloat16, the weight
    widened a slice of rows at a time (no float32 copy of it is kept)."""
    if (
        x.dtype is not torch.bfloat16
        or x.device.type != "cpu"
        or x.numel() < _UPCAST_MIN_ROWS * x.shape[-1]
        or not upcast_bf16()
    ):
        return F.linear(x, w, bias)
    xf = x.float()
    if w.shape[0] <= _UPCAST_WEIGHT_ROWS:
        b = None if bias is None else bias.float()
        return F.linear(xf, w.float(), b).to(torch.bfloat16)
    out = x.new_empty((*x.shape[:-1], w.shape[0]))
    for lo in range(0, w.shape[0], _UPCAST_WEIGHT_ROWS):
        hi = min(w.shape[0], lo + _UPCAST_WEIGHT_ROWS)
        b = None if bias is None else bias[lo:hi].float()
        out[..., lo:hi] = F.linear(xf, w[lo:hi].float(), b)
    return out


def _linear(in_f: int, out_f: int, bias: bool = False) -> nn.Linear:
    """An ``nn.Linear`` with uninitialized weights (``init_weights`` or a checkpoint fills
    them). Made on the CPU without running its initializer, not by ``skip_init``: that
    goes through the meta device, whose first use imports sympy and torch._dynamo, 3-5 s
    of CPU at every node's start."""
    m = nn.Linear.__new__(nn.Linear)
    nn.Module.__init__(m)
    m.in_features, m.out_features = in_f, out_f
    m.weight = nn.Parameter(torch.empty(out_f, in_f))
    m.register_parameter("bias", nn.Parameter(torch.empty(out_f)) if bias else None)
    return m


def _apply(proj: nn.Linear, x: torch.Tensor) -> torch.Tensor:
    return linear(x, proj.weight, proj.bias)


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
        q = _apply(self.q_proj, x).view(n, c.num_heads, c.head_dim)
        k = _apply(self.k_proj, x).view(n, c.num_kv_heads, c.head_dim)
        v = _apply(self.v_proj, x).view(n, c.num_kv_heads, c.head_dim)
        return apply_rope(q, cos, sin), apply_rope(k, cos, sin), v

    def finish(self, h: torch.Tensor, attn: torch.Tensor) -> torch.Tensor:
        """Residual add of attention output ``attn`` [N, heads*dim], then the MLP block."""
        h = h + _apply(self.o_proj, attn)
        x = self.post_attention_layernorm(h)
        return h + _apply(
            self.down_proj, F.silu(_apply(self.gate_proj, x)) * _apply(self.up_proj, x)
        )


def prefill_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    k_prefix: torch.Tensor | None = None,
    v_prefix: torch.Tensor | None = None,
) -> torch.Tensor:
    """Causal GQA attention of ``n`` new queries, without a mask tensor.

    ``q`` [n, heads, D]; ``k``, ``v`` [n, kv_heads, D] are the new tokens' keys (query
    ``i`` sees new keys ``0..i``); ``k_prefix``, ``v_prefix`` [P, kv_heads, D] (or None)
    are the cached positions before them, which every query sees. Returns [n, heads*D].

    Without a prefix: SDPA with ``is_causal`` (its flash kernel on CPU). With one, the
    prefix part (no mask at all) and the causal part are two flash calls, merged by
    their log-sum-exp; on devices other than the CPU, where that kernel is not exposed,
    one SDPA call with a lower-right causal bias. Memory is linear in ``n`` and ``P``.
    """
    n, heads, d = q.shape
    kvh = k.shape[1]
    g = heads // kvh
    qh = q.transpose(0, 1)  # [H, n, D]
    kh, vh = k.transpose(0, 1), v.transpose(0, 1)  # [KVH, n, D]
    if k_prefix is None or k_prefix.shape[0] == 0:
        o = F.scaled_dot_product_attention(
            qh[None], kh[None], vh[None], is_causal=True, enable_gqa=True
        )[0]
    elif q.device.type == "cpu":
        flash = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu
        # prefix: the g query heads of one KV head read the same keys with no mask, so
        # they are one batch row of g*n queries (no copy of the keys per query head)
        o_pre, lse_pre = flash(
            qh.reshape(kvh, g * n, d)[None],
            k_prefix.transpose(0, 1)[None],
            v_prefix.transpose(0, 1)[None],
        )
        o_pre, lse_pre = o_pre.reshape(heads, n, d), lse_pre.reshape(heads, n)
        # causal part: batch = KV head, heads = its g query heads (keys broadcast)
        o_new, lse_new = flash(
            qh.reshape(kvh, g, n, d),
            kh[:, None].expand(kvh, g, n, d),
            vh[:, None].expand(kvh, g, n, d),
            is_causal=True,
        )
        o_new, lse_new = o_new.reshape(heads, n, d), lse_new.reshape(heads, n)
        lse = torch.logaddexp(lse_pre, lse_new)
        o = (
            o_pre.float() * (lse_pre - lse).exp()[..., None]
            + o_new.float() * (lse_new - lse).exp()[..., None]
        ).to(q.dtype)
    else:
        from torch.nn.attention.bias import causal_lower_right

        keys = torch.cat((k_prefix, k)).transpose(0, 1)
        vals = torch.cat((v_prefix, v)).transpose(0, 1)
        o = F.scaled_dot_product_attention(
            qh[None],
            keys[None].repeat_interleave(g, dim=1),
            vals[None].repeat_interleave(g, dim=1),
            attn_mask=causal_lower_right(n, keys.shape[1]),
        )[0]
    return o.transpose(0, 1).reshape(n, heads * d)


class LlamaModel(nn.Module):
    """Llama-family decoder (RMSNorm, RoPE, GQA, SwiGLU) working on a paged :class:`KVPool`."""

    def __init__(self, config: ModelConfig, dtype: torch.dtype | str = torch.float32) -> None:
        super().__init__()
        self.config = config
        # uninitialized like _linear's (no meta device): _weight skips its initializer
        self.embed_tokens = nn.Embedding(
            config.vocab_size,
            config.hidden_size,
            _weight=torch.empty(config.vocab_size, config.hidden_size),
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
        if self.inv_freq.device != positions.device:  # once per device, not per step
            self.inv_freq = self.inv_freq.to(positions.device)
        inv_freq = self.inv_freq
        freqs = positions.to(torch.float32)[:, None] * inv_freq[None, :]
        emb = torch.cat((freqs, freqs), dim=-1)
        return emb.cos().to(self.dtype), emb.sin().to(self.dtype)

    def _logits(self, h: torch.Tensor) -> torch.Tensor:
        w = self.embed_tokens.weight if self.lm_head is None else self.lm_head.weight
        return linear(self.norm(h), w).float()

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
        """Prefill ``n`` new tokens at positions ``start_pos..start_pos+n-1``, in one pass.

        K/V of positions < ``start_pos`` must already be in ``block_table``'s blocks
        (cached prefix). New K/V is written into the pool by index, then
        ``on_layer_done(l)`` is called, then layer ``l`` attends causally over
        cached + new keys (:func:`prefill_attention`: no mask is built, nothing grows
        with the square of the length). Returns float32 logits [vocab] of the last
        position. Activations grow with ``n``: :meth:`forward_prefill_chunked` bounds them.
        """
        self._check_pool(pool)
        ids = torch.as_tensor(token_ids, dtype=torch.long).reshape(-1)
        n, bs = ids.numel(), pool.block_size
        total = start_pos + n
        if n == 0 or start_pos < 0:
            raise ValueError("prefill needs at least one new token and start_pos >= 0")
        self._check_length(total)
        if len(block_table) * bs < total:
            raise ValueError(f"block_table of {len(block_table)} blocks cannot hold {total} tokens")
        dev = pool.kv.device
        ids = ids.to(dev)
        table = torch.as_tensor(list(block_table), dtype=torch.long, device=dev)
        pos = torch.arange(start_pos, total, device=dev)
        new_blk, new_off = table[pos // bs], pos % bs
        prefix_blocks = table[: -(-start_pos // bs)]  # the blocks holding positions < start_pos
        cos, sin = self._rope(pos)

        st = pool.staging  # a pool on a GPU: its host mirror is what the handoff reads
        written = [int(b) for b in block_table[start_pos // bs : -(-total // bs)]]
        if st is not None:
            st.ensure_device(int(b) for b in block_table[: -(-start_pos // bs)])
        h = self.embed_tokens(ids)
        for l, layer in enumerate(self.layers):
            q, k, v = layer.qkv(h, cos, sin)
            kv_l = pool.kv[:, l]  # [blocks, 2, block_size, kv_heads, head_dim] view
            kv_l[new_blk, 0, new_off] = k
            kv_l[new_blk, 1, new_off] = v
            if st is not None:  # D2H of this layer overlaps the next layer's compute
                cb = None if on_layer_done is None else (lambda l=l: on_layer_done(l))
                st.stage_layer(l, written, cb)
                st.poll()
            elif on_layer_done is not None:
                on_layer_done(l)
            k_pre = v_pre = None
            if start_pos:  # whole blocks, gathered once per layer, cut to the prefix
                k_pre = kv_l[prefix_blocks, 0].flatten(0, 1)[:start_pos]
                v_pre = kv_l[prefix_blocks, 1].flatten(0, 1)[:start_pos]
            h = layer.finish(h, prefill_attention(q, k, v, k_pre, v_pre))
        if st is not None:
            st.flush()  # every layer is in the mirror (and its callback ran) on return
            st.mark_device_newer(written)
        return self._logits(h[-1:])[0]

    def forward_prefill_chunked(
        self,
        token_ids: torch.Tensor | Sequence[int],
        start_pos: int,
        pool: KVPool,
        block_table: Sequence[int],
        chunk_tokens: int,
        on_layer_done: Callable[[int, int, int], None] | None = None,
        should_stop: Callable[[], bool] | None = None,
    ) -> torch.Tensor:
        """:meth:`forward_prefill` of the new tokens in chunks of at most ``chunk_tokens``,
        each on top of the KV the chunks before it wrote, so a long prompt's activations
        stay bounded by the chunk (its attention reads the cached prefix, linear in the
        length). ``on_layer_done(l, lo, hi)`` is called once layer ``l`` of positions
        ``lo..hi-1`` is in the pool. With ``chunk_tokens`` a multiple of the block size and
        ``start_pos`` on a block boundary, every chunk fills whole blocks (the last one
        excepted), so no block is written by two chunks. ``should_stop()`` is asked before
        every chunk but the first: True raises :class:`PrefillStopped` (a cancelled request
        need not wait for the rest of a long prompt). Returns the last logits.
        """
        if chunk_tokens < 1:
            raise ValueError(f"chunk_tokens must be >= 1, got {chunk_tokens}")
        ids = torch.as_tensor(token_ids, dtype=torch.long).reshape(-1)
        n = ids.numel()
        if n == 0:
            raise ValueError("prefill needs at least one new token and start_pos >= 0")
        self._check_length(start_pos + n)  # before any chunk writes the pool
        logits = None
        for lo in range(0, n, chunk_tokens):
            if lo and should_stop is not None and should_stop():
                raise PrefillStopped(f"prefill stopped after {lo} of {n} new tokens")
            hi = min(n, lo + chunk_tokens)
            a, b = start_pos + lo, start_pos + hi
            cb = None if on_layer_done is None else (lambda l, a=a, b=b: on_layer_done(l, a, b))
            logits = self.forward_prefill(ids[lo:hi], a, pool, block_table, cb)
        return logits

    def _check_length(self, total: int) -> None:
        limit = self.config.max_position_embeddings
        if total > limit:
            raise ValueError(
                f"sequence length {total} exceeds max_position_embeddings ({limit} tokens)"
            )

    @torch.inference_mode()
    def forward_decode(
        self,
        token_ids: torch.Tensor | Sequence[int],
        positions: Sequence[int],
        block_tables: Sequence[Sequence[int]],
        pool: KVPool,
        mirror: KVMirror | None = None,
        keys: Sequence[Hashable] | None = None,
    ) -> torch.Tensor:
        """One decode step for a batch of requests of different lengths.

        Request ``i`` feeds ``token_ids[i]`` at position ``positions[i]``; its K/V
        for positions <= ``positions[i]`` lives in ``block_tables[i]``. Projections
        and MLP run batched; attention gathers each request's blocks (whole, as far
        as the longest request reaches) into a padded, masked batch and runs grouped-query
        SDPA on it (no copy of the keys per query head). Returns float32 logits [B, vocab].

        On the CPU, with a ``mirror`` and one key per request (:mod:`kv_mirror`), attention
        reads each request's float32 copy of its KV instead of gathering from the pool
        (the same values; the step appends its new K/V to both).
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
            raise ValueError(
                f"decode position out of range [0, {self.config.max_position_embeddings})"
            )
        width = max(len(t) for t in block_tables)
        table = torch.zeros((b, width), dtype=torch.long)
        for i, t in enumerate(block_tables):
            if len(t) * bs <= int(pos[i]):
                raise ValueError(f"block_table {i} cannot hold position {int(pos[i])}")
            table[i, : len(t)] = torch.as_tensor(list(t), dtype=torch.long)
        dev = pool.kv.device
        ids, pos, table = ids.to(dev), pos.to(dev), table.to(dev)
        new_blk, new_off = table[torch.arange(b, device=dev), pos // bs], pos % bs
        reach = int(pos.max()) // bs + 1  # blocks the longest request reads
        table = table[:, :reach]  # padding entries (block 0) are masked out
        mask = (torch.arange(reach * bs, device=dev) <= pos[:, None])[:, None, None, :]
        cos, sin = self._rope(pos)
        if pool.staging is not None:  # KV handed off or fetched into host staging: upload
            pool.staging.ensure_device(int(x) for t in block_tables for x in t[:reach])

        h = self.embed_tokens(ids)
        if dev.type == "cpu":  # the mirror's rows, or the pool's blocks gathered
            keyed = mirror is not None and keys is not None
            if keyed and len(keys) != b:
                raise ValueError(f"{len(keys)} mirror keys for a batch of {b} requests")
            at = pos.tolist()
            got = mirror.prepare(keys, at, block_tables, pool.kv) if keyed else None
            cpu = CpuDecodeAttention(pool, table, mask, at, got)
        for l, layer in enumerate(self.layers):
            q, k, v = layer.qkv(h, cos, sin)
            kv_l = pool.kv[:, l]
            kv_l[new_blk, 0, new_off] = k
            kv_l[new_blk, 1, new_off] = v
            if dev.type == "cpu":
                o = cpu(q, k, v, l)
            else:
                k_all = kv_l[table, 0].flatten(1, 2).transpose(1, 2)  # [B, KVH, T, D]
                v_all = kv_l[table, 1].flatten(1, 2).transpose(1, 2)
                o = F.scaled_dot_product_attention(
                    q[:, :, None, :], k_all, v_all, attn_mask=mask, enable_gqa=True
                )
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
