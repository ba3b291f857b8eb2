"""The CPU decode mirror (services/engine/kv_mirror.py): a decode step over the mirror gives
the logits of the step that gathers from the pool (to float32 rounding), as batches change, requests
come and go, blocks are swapped under a key, positions rewind and the budget runs out."""

from __future__ import annotations

import pytest
import torch

from kvmesh.services.engine.kv_mirror import KVMirror
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
    with pytest.raises(ValueError, match="2 mirror keys for a batch of 1"):
        m.forward_decode([1], [22], [[0, 1, 2]], a, mirror, ["r", "x"])
    mirror.drop("r", at_once=True)  # no step running: the memory goes now
    assert len(mirror) == 0 and mirror.nbytes == 0


def test_capacity_grows_past_its_headroom_by_copying_not_rereading():
    m, a, b = _setup("bfloat16", blocks=40)
    mirror = KVMirror(m.config, BS, 1 << 30)
    table = list(range(40))
    _both(m, mirror, ["r"], [1], [100], [table], a, b)
    cap = mirror._entries["r"].kv.shape[3]
    assert 101 < cap <= 101 + 101 // 8 + 2 * BS
    for p in range(101, cap + 2):
        _both(m, mirror, ["r"], [p % 50], [p], [table], a, b)
    assert mirror._entries["r"].kv.shape[3] > cap
    assert mirror.rebuilt_tokens == 100  # growing copies the rows, not re-reads them
    assert mirror.nbytes == mirror._entries["r"].kv.shape[3] * mirror.bytes_per_token


def test_requests_past_the_budget_are_gathered_in_the_same_step_and_nothing_is_evicted():
    m, a, b = _setup("bfloat16")
    per = KVMirror(m.config, BS, 0).bytes_per_token
    mirror = KVMirror(m.config, BS, 2 * 32 * per)  # two requests of < 16 tokens
    _both(m, mirror, ["x"], [1], [10], [[0]], a, b)
    _both(m, mirror, ["y"], [1], [10], [[1]], a, b)
    assert set(mirror._entries) == {"x", "y"}
    # z does not fit: x and y stay (a round-robin batch would refill them otherwise) and
    # z is gathered from the pool, in a step that reads x and y from their mirrors
    _both(m, mirror, ["x", "z", "y"], [1, 2, 3], [11, 10, 11], [[0], [2], [1]], a, b)
    assert set(mirror._entries) == {"x", "y"} and mirror.gathered == 1
    mirror.drop("y")
    assert "y" not in mirror  # at once for readers; applied by the next step
    _both(m, mirror, ["z", "x"], [4, 5], [11, 12], [[2], [0]], a, b)
    assert set(mirror._entries) == {"x", "z"} and mirror.gathered == 1
    assert mirror.nbytes == 2 * 32 * per


def test_a_gathered_short_request_next_to_a_mirrored_long_one():
    m, a, b = _setup("float32")
    per = KVMirror(m.config, BS, 0).bytes_per_token
    mirror = KVMirror(m.config, BS, 200 * per)  # room for the long one only
    long_t, short_t = list(range(10)), [20, 21]
    _both(m, mirror, ["long"], [3], [150], [long_t], a, b)
    for s in range(3):  # the short one reads 2 blocks, not the long one's 10
        _both(m, mirror, ["s", "long"], [4, 5], [20 + s, 151 + s], [short_t, long_t], a, b)
    assert set(mirror._entries) == {"long"} and mirror.gathered == 3


def test_a_drop_from_another_thread_waits_for_the_next_step():
    m, a, b = _setup("bfloat16")
    mirror = KVMirror(m.config, BS, 1 << 30)
    _both(m, mirror, ["x", "y"], [1, 2], [10, 20], [[0], [1, 2]], a, b)
    import threading

    t = threading.Thread(target=mirror.drop, args=("x",))
    t.start()
    t.join()
    assert set(mirror._entries) == {"x", "y"}  # the step's dict is not touched
    got = mirror.prepare(["y"], [21], [[1, 2]], a.kv)
    assert set(mirror._entries) == {"y"} and got[0] is not None


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
