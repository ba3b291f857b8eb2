"""The GPU path on a real CUDA device (issue 14 part 2): skipped, with its reason, where
torch sees no CUDA device; the suite never needs a GPU to pass. The same logic runs on
CPU tensors in tests/test_device.py."""

from __future__ import annotations

import pytest
import torch

from kvmesh.services.engine.kv_pool import KVPool
from kvmesh.services.engine.model import LlamaModel

pytestmark = [
    pytest.mark.cuda,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device"),
]


def test_handoff_through_pinned_mirrors_matches_cpu():
    cpu = LlamaModel.from_preset("tiny", seed=3)
    gpu = LlamaModel.from_preset("tiny", seed=3).to("cuda")
    prompt, bs = list(range(1, 41)), 16
    ref_pool = KVPool(cpu.config, 8, bs)
    ref = cpu.forward_prefill(prompt, 0, ref_pool, [0, 1, 2])
    pre = KVPool(gpu.config, 8, bs, device="cuda")
    assert pre.staging is not None and pre.transfer_kv.is_pinned()
    ids = pre.allocate(3)
    seen = []
    out = gpu.forward_prefill(prompt, 0, pre, ids, seen.append)
    assert seen == list(range(gpu.config.num_layers))
    assert torch.allclose(out.cpu(), ref, atol=1e-4)
    assert torch.equal(pre.transfer_kv[ids], pre.kv[ids].cpu())
    dec = KVPool(gpu.config, 8, bs, device="cuda")
    did = dec.allocate(3)
    dec.transfer_kv[did] = pre.transfer_kv[ids]  # what the transfer engine does
    nxt = gpu.forward_decode([7], [40], [did], dec)
    ref_next = cpu.forward_decode([7], [40], [[0, 1, 2]], ref_pool)
    assert torch.allclose(nxt.cpu(), ref_next, atol=1e-4)
