"""The store client's copies (GIL released above PARALLEL_MIN, plain below, same bytes) and the
framing its control path shares with the store-master."""

from __future__ import annotations

import os

import pytest

from kvmesh.services.store import copy as C


@pytest.mark.parametrize("n", [1, 4096, C.PARALLEL_MIN - 1, C.PARALLEL_MIN, 3 * C.PARALLEL_MIN + 5])
def test_fresh_bytes_and_copy_into_give_the_same_bytes(n):
    src = os.urandom(n + 3)
    view = memoryview(src)[3:]
    out = C.fresh_bytes(view)
    assert type(out) is bytes and out == src[3:] and hash(out) == hash(src[3:])
    dst = bytearray(n + 10)
    C.copy_into(memoryview(dst)[5 : 5 + n], view)
    assert dst[5 : 5 + n] == src[3:] and dst[:5] == bytes(5) and dst[5 + n :] == bytes(5)


def test_copy_into_refuses_a_length_mismatch():
    with pytest.raises(ValueError):
        C.copy_into(memoryview(bytearray(2 * C.PARALLEL_MIN)), b"x" * (2 * C.PARALLEL_MIN - 1))


SIZES = [[10], [300_000] * 7, [5, 2 << 20, 17, 1 << 20], [3 << 20, 1]]


@pytest.mark.parametrize("sizes", SIZES)
def test_fresh_bytes_many_gives_each_value(sizes):
    vals = [os.urandom(s) for s in sizes]
    whole = memoryview(b"".join(vals))
    views, pos = [], 0
    for v in vals:
        views.append(whole[pos : pos + len(v)])
        pos += len(v)
    out = C.fresh_bytes_many(views)
    assert out == vals and all(type(o) is bytes for o in out)


@pytest.mark.parametrize("sizes", SIZES)
def test_copy_many_fills_every_slot_and_nothing_else(sizes):
    vals = [os.urandom(s) for s in sizes]
    seg = bytearray(sum(sizes) + 16 * len(sizes))
    view, pairs, pos = memoryview(seg), [], 8
    for v in vals:
        pairs.append((view[pos : pos + len(v)], memoryview(v)))
        pos += len(v) + 16
    C.copy_many(pairs)
    pos = 8
    for v in vals:
        assert seg[pos : pos + len(v)] == v
        assert seg[pos - 8 : pos] == bytes(8)
        pos += len(v) + 16


def test_split_frames_keeps_partial_frames_and_stops_at_an_oversized_one():
    from kvmesh.services.store_master.wire import HEAD, MAX_FRAME, split_frames

    wire_bytes = HEAD.pack(3, 1, 7) + b"abc" + HEAD.pack(0, 2, 0) + HEAD.pack(5, 3, 1) + b"hello"
    buf = bytearray()
    got = []
    for i in range(0, len(wire_bytes), 4):  # arrives in 4-byte pieces
        frames, oversized = split_frames(buf, wire_bytes[i : i + 4])
        assert not oversized
        got += frames
    assert got == [(1, 7, b"abc"), (2, 0, b""), (3, 1, b"hello")] and not buf
    frames, oversized = split_frames(
        buf, HEAD.pack(1, 4, 0) + b"x" + HEAD.pack(MAX_FRAME + 1, 5, 0)
    )
    assert frames == [(4, 0, b"x")] and oversized
