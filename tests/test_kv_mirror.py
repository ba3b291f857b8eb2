"""The CPU decode mirror (services/engine/kv_mirror.py): a decode step over the mirror gives
the logits of the step that gathers from the pool (to float32 rounding), as batches change, requests
come and go, blocks are swapped under a key, positions rewind and the budget runs out."""

from __future__ import annotations

import pytest
import torch

from kvmesh.services.engine.kv_mirror import GROW, KVMirror
from kvmesh.services.engine.kv_pool import KVPool
from kvmesh.services.engine.model import LlamaModel

BS = 16


def _setup(dtype: str, blocks: int = 64, seed: int = 0):
    torch.manual_seed(seed)
    m = LlamaModel.from_preset("tiny", dtype=dtype)
    a = KVPool(m.config, blocks, BS, dtype=m.dtype)
    a.kv.normal_()
    b = KVPool(m.config, blocks, BS, dtype=m.dtype)
    b.kv.copy_(a.kv)
    return m, a, b


def _both(m, mirror, keys, toks, pos, tables, a, b):
    got = m.forward_decode(toks, pos, tables, a, mirror, keys)
    want = m.forward_decode(toks, pos, tables, b)
    # the same values, summed over each request's own length rather than the padded
    # batch's: float32 rounding may differ in the last bits
    torch.testing.assert_close(got, want, rtol=0, atol=1e-5)
    assert torch.equal(got.argmax(-1), want.argmax(-1))
    torch.testing.assert_close(a.kv, b.kv, rtol=0, atol=1e-5)  # the same K/V written
    return got


@pytest.mark.parametrize("dtype", ["bfloat16", "float32"])
def test_steps_match_the_gather_path_as_the_batch_changes(dtype):
    m, a, b = _setup(dtype)
    mirror = KVMirror(m.config, BS, 1 << 30)
    tables = {k: list(range(k * 8, k * 8 + 8)) for k in range(5)}
    pos = {0: 40, 1: 17, 2: 3, 3: 90, 4: 63}
    batches = [[0, 1, 2], [0, 1, 2], [2, 0], [3, 0, 1, 2], [4, 3, 1], [0, 4, 3, 2, 1]]
    for step, batch in enumerate(batches):
        toks = [(7 * step + k) % m.config.vocab_size for k in batch]
        _both(m, mirror, batch, toks, [pos[k] for k in batch], [tables[k] for k in batch], a, b)
        for k in batch:
            pos[k] += 1
    assert set(mirror._entries) == {0, 1, 2, 3, 4}
    # each request was read from the pool once: its rows before its first step here
    assert mirror.rebuilt_tokens == 40 + 17 + 3 + 90 + 63


def test_a_key_whose_blocks_changed_is_rebuilt_from_the_pool():
    m, a, b = _setup("bfloat16")
    mirror = KVMirror(m.config, BS, 1 << 30)
    _both(m, mirror, ["r"], [5], [40], [[0, 1, 2, 3]], a, b)
    # the same key over other blocks (different contents): rows must come from those
    _both(m, mirror, ["r"], [5], [41], [[10, 11, 12, 13]], a, b)
    assert mirror.rebuilt_tokens == 40 + 41


def test_a_rewound_position_reads_the_rows_it_still_has():
    m, a, b = _setup("float32")
    mirror = KVMirror(m.config, BS, 1 << 30)
    for p in (30, 31, 32):
        _both(m, mirror, ["r"], [p % 11], [p], [[0, 1, 2]], a, b)
    _both(m, mirror, ["r"], [9], [20], [[0, 1, 2]], a, b)  # back to position 20
    _both(m, mirror, ["r"], [9], [21], [[0, 1, 2]], a, b)
    assert mirror.rebuilt_tokens == 30


def test_capacity_grows_past_its_rounding():
    m, a, b = _setup("bfloat16", blocks=40)
    mirror = KVMirror(m.config, BS, 1 << 30)
    table = list(range(40))
    for p in range(GROW - 2, GROW + 2):
        _both(m, mirror, ["r"], [p % 50], [p], [table], a, b)
    assert mirror._entries["r"].kv.shape[3] == 2 * GROW
    assert mirror.rebuilt_tokens == GROW - 2  # growing copies the rows, not re-reads them


def test_over_budget_the_step_gathers_and_other_entries_are_evicted_first():
    m, a, b = _setup("bfloat16")
    one = GROW * KVMirror(m.config, BS, 0).bytes_per_token  # a request of < GROW tokens
    mirror = KVMirror(m.config, BS, 2 * one)
    _both(m, mirror, ["x"], [1], [10], [[0]], a, b)
    _both(m, mirror, ["y"], [1], [10], [[1]], a, b)
    assert set(mirror._entries) == {"x", "y"}
    _both(m, mirror, ["z"], [1], [10], [[2]], a, b)  # evicts the least recently used, x
    assert set(mirror._entries) == {"y", "z"}
    # three at once cannot fit: None, and the step still matches (gathered)
    assert mirror.prepare(["x", "y", "z"], [10, 10, 10], [[0], [1], [2]], a.kv) is None
    _both(m, mirror, ["x", "y", "z"], [1, 2, 3], [11, 11, 11], [[0], [1], [2]], a, b)
    mirror.drop("y")
    assert "y" not in mirror and len(mirror) == 1
    assert mirror.nbytes == one


def test_the_decode_batch_drops_a_freed_request():
    import asyncio

    from kvmesh.services.decode.batch import BatchScheduler, Reservation

    m, a, _ = _setup("bfloat16")

    async def go():
        s = BatchScheduler(m, a, BS, 4, 512, frozenset(), lambda *x: None, lambda *x: None, {})
        assert s.mirror is not None
        res = Reservation("r1", 20, a.allocate(2))
        m.forward_decode([3], [20], [res.blocks], a, s.mirror, [res])
        assert res in s.mirror
        s.free(res)
        assert res not in s.mirror
        off = BatchScheduler(
            m, a, BS, 4, 512, frozenset(), lambda *x: None, lambda *x: None, {}, kv_mirror=False
        )
        assert off.mirror is None

    asyncio.run(go())
