"""bfloat16 products on a CPU without native bfloat16 (issue 14): ``linear`` widens them to
float32 and rounds back; weights and KV stay bfloat16."""

from __future__ import annotations

import os
import platform

import pytest
import torch
import torch.nn.functional as F

from kvmesh.services.engine import model as engine_model
from kvmesh.services.engine.kv_pool import KVPool
from kvmesh.services.engine.model import LlamaModel, linear, upcast_bf16


@pytest.fixture
def upcast(monkeypatch):
    """``set(flag)`` forces the detection one way; the cache is cleared before and after."""

    def set_(flag: bool) -> None:
        monkeypatch.setenv("KVMESH_BF16_UPCAST", "1" if flag else "0")
        upcast_bf16.cache_clear()

    yield set_
    monkeypatch.delenv("KVMESH_BF16_UPCAST", raising=False)
    upcast_bf16.cache_clear()


def _bf16(*shape: int, seed: int) -> torch.Tensor:
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed)).bfloat16()


def test_the_override_and_the_detection(upcast):
    upcast(True)
    assert upcast_bf16() is True
    upcast(False)
    assert upcast_bf16() is False
    upcast_bf16.cache_clear()
    os.environ.pop("KVMESH_BF16_UPCAST", None)
    try:
        with open("/proc/cpuinfo") as f:
            flags = f.read()
    except OSError:
        pytest.skip("no /proc/cpuinfo")
    native = "avx512_bf16" in flags or "amx_bf16" in flags
    x86 = platform.machine().lower() in ("x86_64", "amd64")
    assert upcast_bf16() is (x86 and not native)


@pytest.mark.parametrize("rows", [8, 33])
@pytest.mark.parametrize("out_f", [96, engine_model._UPCAST_WEIGHT_ROWS + 100])
@pytest.mark.parametrize("bias", [False, True])
def test_upcast_linear_is_the_float32_product_rounded_once(upcast, rows, out_f, bias):
    upcast(True)
    x, w = _bf16(rows, 64, seed=1), _bf16(out_f, 64, seed=2)
    b = _bf16(out_f, seed=3) if bias else None
    got = linear(x, w, b)
    assert got.dtype == torch.bfloat16 and got.shape == (rows, out_f)
    want = F.linear(x.float(), w.float(), None if b is None else b.float()).bfloat16()
    torch.testing.assert_close(got, want, atol=0, rtol=0)
    # and within bfloat16 rounding of the native bfloat16 product
    torch.testing.assert_close(got.float(), F.linear(x, w, b).float(), atol=0.1, rtol=0.02)


def test_few_rows_and_float32_take_the_plain_product(upcast):
    upcast(True)
    w = _bf16(96, 64, seed=2)
    x = _bf16(engine_model._UPCAST_MIN_ROWS - 1, 64, seed=1)
    assert torch.equal(linear(x, w), F.linear(x, w))
    xf, wf = x.float(), w.float()
    assert torch.equal(linear(xf, wf), F.linear(xf, wf))
    x3 = _bf16(2, 5, 64, seed=4)  # leading dims count as rows
    torch.testing.assert_close(
        linear(x3, w), F.linear(x3.float(), w.float()).bfloat16(), atol=0, rtol=0
    )


def test_a_bfloat16_model_upcast_tracks_the_native_one(upcast):
    """Prefill and decode logits of the tiny preset in bfloat16, upcast against native:
    the same up to bfloat16 rounding, and the same greedy tokens."""
    out = {}
    for flag in (False, True):
        upcast(flag)
        m = LlamaModel.from_preset("tiny", seed=0, dtype="bfloat16")
        pool = KVPool(m.config, num_blocks=8, block_size=16, dtype=torch.bfloat16)
        toks = torch.randint(
            0, m.config.vocab_size, (40,), generator=torch.Generator().manual_seed(0)
        )
        table = list(range(4))
        first = m.forward_prefill(toks, 0, pool, table)
        step = m.forward_decode([int(first.argmax())], [40], [table], pool)[0]
        out[flag] = (first, step, m.reference_logits(toks)[-1])
    for a, b in zip(out[False], out[True]):
        assert a.dtype == b.dtype == torch.float32
        torch.testing.assert_close(a, b, atol=0.05, rtol=0)
    assert int(out[True][0].argmax()) == int(out[True][2].argmax())


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_decode_attention_matches_masked_sdpa(dtype):
    """The CPU decode kernel against SDPA with the same mask, over blocks of uneven reach."""
    from kvmesh.services.engine.cpu_attention import decode_attention

    g = torch.Generator().manual_seed(7)
    b, blocks, bs, kvh, heads, d = 3, 4, 8, 2, 6, 16
    kv = torch.randn(b, blocks, 2, bs, kvh, d, generator=g).to(dtype)
    q = torch.randn(b, heads, d, generator=g).to(dtype)
    pos = torch.tensor([0, 13, 31])
    mask = (torch.arange(blocks * bs) <= pos[:, None])[:, None, None, :]
    got = decode_attention(q, kv, mask)
    assert got.dtype == dtype and got.shape == (b, heads * d)
    keys = kv[:, :, 0].flatten(1, 2).transpose(1, 2).float()
    vals = kv[:, :, 1].flatten(1, 2).transpose(1, 2).float()
    want = F.scaled_dot_product_attention(
        q.float()[:, :, None, :], keys, vals, attn_mask=mask, enable_gqa=True
    ).reshape(b, -1)
    atol = 1e-5 if dtype == torch.float32 else 1e-2
    torch.testing.assert_close(got.float(), want, atol=atol, rtol=0)
    # request 0 sees only its first key: its output is that value row, per KV head
    torch.testing.assert_close(
        got[0].float().view(kvh, heads // kvh, d),
        kv[0, 0, 1, 0].float()[:, None, :].expand(kvh, heads // kvh, d),
        atol=atol,
        rtol=0,
    )
