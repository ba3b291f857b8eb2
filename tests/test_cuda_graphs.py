"""The fixed-shape decode step and its batch/width buckets (services/engine/cuda_graphs.py)
on CPU tensors: the padded step computes what ``forward_decode`` computes for the real
rows, writes the same KV, and leaves every other block alone; capture itself needs CUDA
(tests/test_cuda.py)."""

from __future__ import annotations

import pytest
import torch

from kvmesh.services.engine.cuda_graphs import (
    DecodeRunner,
    decode_static,
    pad_inputs,
    width_bucket,
)
from kvmesh.services.engine.kv_pool import KVPool
from kvmesh.services.engine.model import LlamaModel

BS = 16


def test_width_buckets():
    assert [width_bucket(r, 4096) for r in range(1, 18)] == [
        *range(1, 9),
        10,
        10,
        12,
        12,
        14,
        14,
        16,
        16,
        20,
    ]
    assert [width_bucket(r, 4096) for r in (64, 65, 80, 81, 127, 128, 2049)] == [
        64,
        80,
        80,
        96,
        128,
        128,
        2560,
    ]
    for r in range(1, 3000):  # never under the reach, never more than 25% over it
        assert r <= width_bucket(r, 4096) <= max(r, r * 1.25)
    assert width_bucket(2049, 2100) == 2100  # capped at the most a request can reach
    with pytest.raises(ValueError, match="reach"):
        width_bucket(0, 8)


def test_pad_inputs_repeats_row_zero_and_pads_tables_with_their_first_block():
    p = pad_inputs([5, 6, 7], [3, 20, 40], [[4], [8, 9], [1, 2, 3]], nb=4, width=4)
    assert p.batch == 3
    assert p.ids.tolist() == [5, 6, 7, 5] and p.pos.tolist() == [3, 20, 40, 3]
    assert p.table.tolist() == [[4, 4, 4, 4], [8, 9, 8, 8], [1, 2, 3, 1], [4, 4, 4, 4]]
    with pytest.raises(ValueError, match="does not fit bucket 2"):
        pad_inputs([1, 2, 3], [0, 0, 0], [[0], [1], [2]], nb=2, width=1)


@pytest.fixture(scope="module")
def model():
    return LlamaModel.from_preset("tiny", seed=4)


def _prefilled(model, prompts):
    """A pool with each prompt's KV in its own blocks, and the tables."""
    pool = KVPool(model.config, 32, BS)
    tables = []
    for p in prompts:
        t = pool.allocate(-(-(len(p) + 4) // BS))
        model.forward_prefill(p, 0, pool, t)
        tables.append(t)
    return pool, tables


def test_padded_static_step_matches_forward_decode(model):
    prompts = [list(range(1, 20)), list(range(3, 50)), list(range(7, 40))]
    ref_pool, tables = _prefilled(model, prompts)
    pool, _ = _prefilled(model, prompts)
    runner = DecodeRunner(model, pool, max_batch=8, static=True)
    assert not runner.graphs  # no CUDA: the static path runs eagerly
    toks = [11, 12, 13]
    for step in range(4):
        pos = [len(p) + step for p in prompts]
        assert runner.bucket_of(pos)[0] == 4  # 3 requests padded to bucket 4
        ref = model.forward_decode(toks, pos, tables, ref_pool)
        got = runner.step(torch.tensor(toks), pos, tables)
        assert got.shape == ref.shape
        assert torch.allclose(got, ref, atol=1e-4, rtol=1e-4)
        assert got.argmax(-1).tolist() == ref.argmax(-1).tolist()
        toks = ref.argmax(-1).tolist()
    # the same KV in every block, padding wrote nothing anywhere else
    assert torch.allclose(pool.kv, ref_pool.kv, atol=1e-5)
    free = [b for b in range(32) if b not in {x for t in tables for x in t}]
    assert not pool.kv[free].any()


def test_decode_static_has_fixed_shapes_and_reads_no_value_back(model, monkeypatch):
    pool, tables = _prefilled(model, [list(range(1, 10))])
    p = pad_inputs([3], [9], tables, nb=2, width=2)
    read = []
    for name in ("item", "tolist", "cpu", "__int__", "__bool__", "__index__", "__float__"):
        orig = getattr(torch.Tensor, name)
        monkeypatch.setattr(
            torch.Tensor,
            name,
            lambda t, *a, _o=orig, _n=name, **k: read.append(_n) or _o(t, *a, **k),
        )
    out = decode_static(model, pool, p.ids, p.pos, p.table)
    monkeypatch.undo()
    assert read == []  # a graph can capture it: nothing decided on the host from a value
    assert out.shape == (2, model.config.vocab_size)


def test_the_cpu_runner_is_forward_decode_and_large_batches_run_eagerly(model, monkeypatch):
    pool, tables = _prefilled(model, [list(range(1, 10))])
    calls = []
    orig = model.forward_decode
    monkeypatch.setattr(model, "forward_decode", lambda *a: calls.append(1) or orig(*a))
    DecodeRunner(model, pool, max_batch=4).step([1], [9], tables)  # CPU default: not static
    assert calls == [1]
    r = DecodeRunner(model, pool, max_batch=4, static=True, buckets=(1, 2))
    assert r.bucket_of([9, 9, 9]) is None  # past bucket 2: eager
    r.step([1, 1, 1], [9, 9, 9], tables * 3)
    assert calls == [1, 1]


def test_bad_steps_are_refused_like_forward_decode(model):
    pool, tables = _prefilled(model, [list(range(1, 10))])
    r = DecodeRunner(model, pool, max_batch=4, static=True)
    with pytest.raises(ValueError, match="cannot hold position 40"):
        r.step([1], [40], tables)
    with pytest.raises(ValueError, match="out of range"):
        r.step([1], [-1], tables)


def test_the_decode_scheduler_steps_a_gpu_pool_through_the_runner(model):
    """Which path BatchScheduler takes is decided by the pool's device (a meta-device
    pool stands in for a non-CPU one here; nothing is computed on it), and
    --no-cuda-graphs reaches the runner."""
    from kvmesh.services.decode.batch import BatchScheduler

    class GpuPool:
        kv = torch.empty((4, 1), device="meta")
        block_size, num_blocks, staging = BS, 4, None

    def sched(pool, **kw):
        return BatchScheduler(
            model, pool, BS, 8, 64, frozenset(), lambda *a: None, lambda *a: None, {}, **kw
        )

    assert sched(KVPool(model.config, 4, BS)).decoder is None  # CPU: forward_decode
    d = sched(GpuPool()).decoder
    assert isinstance(d, DecodeRunner) and d.cuda_graphs
    # the padded graph path is CUDA's: another device runs forward_decode eagerly
    assert not d.static and not d.graphs
    assert d.buckets == [1, 2, 4, 8]  # up to max_batch 8
    assert not sched(GpuPool(), cuda_graphs=False).decoder.cuda_graphs
