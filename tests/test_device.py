"""Device choice, GPU staging logic and CUDA-graph buckets, all on the CPU (issue 14 part 2).

The staging component runs here with CPU tensors (a separate host mirror, plain copies),
so which blocks move, at which offsets, in which order, and which blocks are uploaded
before a forward reads them are checked without a GPU; tests/test_cuda.py runs the same
on a GPU where there is one."""

from __future__ import annotations

import pytest
import torch

from kvmesh.services.common.config import ConfigError
from kvmesh.services.engine.device import (
    graph_bucket,
    graph_buckets,
    kv_memory_bytes,
    resolve_device,
)
from kvmesh.services.engine.kv_pool import KVPool
from kvmesh.services.engine.model import LlamaModel
from kvmesh.services.engine.staging import KVStaging, block_runs, layer_spans


def test_resolve_device():
    assert resolve_device("cpu").type == "cpu"
    assert resolve_device("auto", cuda=False).type == "cpu"
    assert resolve_device("auto", cuda=True).type == "cuda"
    assert resolve_device("cuda:1", cuda=True) == torch.device("cuda:1")
    with pytest.raises(ValueError, match="no CUDA device"):
        resolve_device("cuda", cuda=False)
    with pytest.raises(ValueError, match="expected one of cpu, cuda, auto"):
        resolve_device("tpu")


def test_kv_memory_share_of_free_device_memory():
    gib = 1 << 30
    cuda = torch.device("cuda")
    assert kv_memory_bytes("80%", cuda, free=10 * gib) == 8 * gib
    assert kv_memory_bytes("2GiB", cuda, free=10 * gib) == 2 * gib
    with pytest.raises(ConfigError, match="in \\(0%, 90%\\]"):
        kv_memory_bytes("95%", cuda, free=10 * gib)
    with pytest.raises(ConfigError, match="percentage"):
        kv_memory_bytes("x%", cuda, free=10 * gib)
    assert kv_memory_bytes("1MiB", torch.device("cpu")) == 1 << 20


def test_graph_buckets():
    assert [graph_bucket(b) for b in (1, 2, 3, 5, 32, 33, 64)] == [1, 2, 4, 8, 32, 64, 64]
    assert graph_bucket(65) is None  # past the largest: eager
    assert graph_bucket(3, (8, 2)) == 8
    assert graph_buckets(5) == [1, 2, 4, 8]
    assert graph_buckets(1000) == [1, 2, 4, 8, 16, 32, 64]
    with pytest.raises(ValueError):
        graph_bucket(0)


def test_block_runs_and_layer_spans():
    assert block_runs([9, 3, 4, 5, 10, 3, 0]) == [(0, 1), (3, 6), (9, 11)]
    assert block_runs([]) == []
    # block 2 and 3, layer 1 of 4: block_nbytes 400, layer_nbytes 100
    assert layer_spans([3, 2], 1, 400, 100) == [(900, 100), (1300, 100)]


class _Delayed:
    """Ops whose copies land only when the test says so (ordering of callbacks)."""

    def __init__(self):
        self.landed: set[int] = set()
        self.n = 0

    def begin(self):
        pass

    def copy_to_host(self, dst, src):
        dst.copy_(src)

    copy_to_device = copy_to_host

    def end(self):
        self.n += 1
        return self.n

    def done(self, token):
        return token in self.landed

    def wait(self, token):
        self.landed.add(token)


def test_staging_callbacks_run_in_order_once_landed():
    kv = torch.arange(4 * 3 * 2 * 2, dtype=torch.float32).reshape(4, 3, 2, 2)
    ops = _Delayed()
    st = KVStaging(kv, host=torch.zeros_like(kv), ops=ops)
    ran = []
    for layer in range(3):
        st.stage_layer(layer, [1, 2], lambda layer=layer: ran.append(layer))
    ops.landed.add(2)  # layer 1's copy landed before layer 0's: it must wait
    assert st.poll() == 0 and ran == []
    ops.landed.add(1)
    assert st.poll() == 2 and ran == [0, 1]
    st.flush()
    assert ran == [0, 1, 2] and st.pending == 0
    assert torch.equal(st.host[1:3], kv[1:3]) and not st.host[0].any() and not st.host[3].any()


def _pool_with_mirror(model, blocks, bs):
    pool = KVPool(model.config, blocks, bs, model.dtype)
    pool.staging = KVStaging(pool.kv, host=torch.zeros_like(pool.kv))  # what a GPU pool has
    return pool


def test_prefill_stages_every_layer_and_decode_uploads_the_handoff():
    """The whole hand-off path with a staged pool on CPU tensors: a prefill's layers reach
    the host mirror (callback after each), bytes equal to the device pool; a decode node's
    mirror receives them (the transfer engine's part) and its first decode step uploads
    them; tokens match the unstaged path."""
    torch.manual_seed(0)
    m = LlamaModel.from_preset("tiny", seed=3)
    bs, prompt = 16, list(range(1, 41))  # 3 blocks, the last one partial
    ref_pool = KVPool(m.config, 8, bs)
    ref_logits = m.forward_prefill(prompt, 0, ref_pool, [0, 1, 2])
    ref_next = m.forward_decode([7], [40], [[0, 1, 2]], ref_pool)

    pre = _pool_with_mirror(m, 8, bs)
    ids = pre.allocate(3)
    assert all(pre.staging.is_host_newer(b) for b in ids)
    seen = []

    def on_layer(layer):  # the handoff's send_layer: the layer must be in the mirror now
        seen.append(layer)
        assert torch.equal(pre.staging.host[ids, layer], pre.kv[ids, layer])

    logits = m.forward_prefill(prompt, 0, pre, ids, on_layer)
    assert seen == list(range(m.config.num_layers))
    assert torch.allclose(logits, ref_logits)
    assert not any(pre.staging.is_host_newer(b) for b in ids)  # computed on the device
    assert torch.equal(pre.staging.host[ids], pre.kv[ids])

    dec = _pool_with_mirror(m, 8, bs)
    did = dec.allocate(3)
    dec.staging.host[did] = pre.staging.host[ids]  # the transfer engine writes the mirror
    assert not dec.kv[did].any()
    nxt = m.forward_decode([7], [40], [did], dec)
    assert dec.staging.stats["uploaded_blocks"] == 3
    assert torch.allclose(nxt, ref_next)
    m.forward_decode([int(nxt.argmax())], [41], [did], dec)
    assert dec.staging.stats["uploaded_blocks"] == 3  # uploaded once, not per step


def test_prefill_on_a_fetched_prefix_uploads_it_first():
    m = LlamaModel.from_preset("tiny", seed=3)
    bs, prompt = 16, list(range(1, 50))
    ref_pool = KVPool(m.config, 8, bs)
    ref = m.forward_prefill(prompt, 0, ref_pool, [0, 1, 2, 3])
    pool = _pool_with_mirror(m, 8, bs)
    ids = pool.allocate(4)
    pool.staging.host[ids[:2]] = ref_pool.kv[:2]  # a store fetch of two blocks lands
    out = m.forward_prefill(prompt[32:], 32, pool, ids)
    assert torch.allclose(out, ref, atol=1e-5)
    assert pool.staging.stats["uploaded_blocks"] == 2


def test_cpu_pool_has_no_staging_and_registers_itself():
    m = LlamaModel.from_preset("tiny")
    pool = KVPool(m.config, 2, 16)
    assert pool.staging is None and pool.transfer_kv is pool.kv


def test_node_config_device_is_validated():
    from kvmesh.services.node_config import NodeConfig

    NodeConfig(device="auto").validate()
    NodeConfig(device="cpu").validate()
    if not torch.cuda.is_available():
        with pytest.raises(ConfigError, match="device: 'cuda': torch sees no CUDA device"):
            NodeConfig(device="cuda").validate()
    with pytest.raises(ConfigError, match="unknown device 'gpu'"):
        NodeConfig(device="gpu").validate()
