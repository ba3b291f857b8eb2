"""A remote get that reads where the key was while it asks the master (issue 13,
``services/store/located.py``), as real processes: a client that put a key reads it
ahead and uses the bytes; the bytes of a remembered place the master's answer does not
name (another place, another generation, a key removed and put again by another client,
a removed key) are never returned; GET answers carry one generation per replica; and
the GET frame, garbled, lying or truncated, gets a clear status."""

from __future__ import annotations

import os
import struct

import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st

from kvmesh.services.store.client import StoreClient
from kvmesh.services.store.located import SPEC_BYTES, SPEC_KEYS
from kvmesh.services.store_master import wire
from tests.store_util import FUZZ, INVALID, fast_address, fast_call, run_clients, running_store


@pytest.fixture(scope="module")
def store(tmp_path_factory):
    with running_store(str(tmp_path_factory.mktemp("ahead")), nodes=1, segment="64MiB") as c:
        yield c


@pytest.fixture(scope="module")
def fast(store):
    return fast_address(store)


def run_two(master: str, fn):
    """``await fn(a, b)``: two clients (each on its own engine) of ``master``."""
    return run_clients(master, fn, "ahead-a", "ahead-b")


def used(cl: StoreClient) -> tuple[int, int]:
    return cl.stats["read_ahead_used"], cl.stats["read_ahead_wasted"]


def test_a_key_the_client_put_is_read_ahead_and_comes_back(store):
    """4 and 64 KiB values, bytes and zero-copy: the put remembers where each went,
    the get reads there while it asks and uses what it read; a get of more than
    SPEC_BYTES is not read ahead."""
    vals = [os.urandom(4096) for _ in range(4)] + [os.urandom(64 << 10)]
    keys = [f"ahead-own-{i}".encode() for i in range(len(vals))]
    big = os.urandom(SPEC_BYTES + 4096)

    async def body(a: StoreClient, _b: StoreClient):
        assert all(await a.batch_put(keys[:4], vals[:4]))  # one size a batch: pooled slots
        assert await a.put(keys[4], vals[4])
        assert len(a._where) == len(keys)
        for k, v in zip(keys, vals):
            assert await a.get(k) == v
        assert used(a) == (len(keys), 0)
        assert await a.batch_get(keys) == vals
        assert used(a) == (2 * len(keys), 0)
        dst = np.zeros(64 << 10, np.uint8)
        rid = a.te.register(dst)
        try:
            assert await a.get_into([keys[-1]], rid, [0]) == [64 << 10]
            assert dst.tobytes() == vals[-1]
        finally:
            a.te.unregister(rid)
        assert used(a) == (2 * len(keys) + 1, 0)
        assert await a.put(b"ahead-own-big", big)
        assert b"ahead-own-big" in a._where.map
        assert await a.get(b"ahead-own-big") == big
        assert used(a) == (2 * len(keys) + 1, 0)  # over the budget: asked first
        await a.remove([*keys, b"ahead-own-big"])
        assert len(a._where) == 0

    run_two(store.master, body)


def test_a_256_kib_value_is_read_ahead_and_a_batch_past_the_key_limit_is_not(store):
    """A single 256 KiB get reads ahead (within ``SPEC_BYTES``) and returns the value;
    a batch of more than ``SPEC_KEYS`` small keys asks first, reading nothing ahead,
    and still returns every value."""
    big = os.urandom(256 << 10)
    small = [os.urandom(4096) for _ in range(SPEC_KEYS + 1)]
    skeys = [f"ahead-many-{i}".encode() for i in range(len(small))]
    assert len(big) <= SPEC_BYTES and len(small) * 4096 <= SPEC_BYTES

    async def body(a: StoreClient, _b: StoreClient):
        assert await a.put(b"ahead-256k", big)
        dst = np.zeros(len(big), np.uint8)
        rid = a.te.register(dst)
        try:
            assert await a.get_into([b"ahead-256k"], rid, [0]) == [len(big)]
            assert dst.tobytes() == big
        finally:
            a.te.unregister(rid)
        assert used(a) == (1, 0)
        assert await a.get(b"ahead-256k") == big
        assert used(a) == (2, 0)
        assert all(await a.batch_put(skeys, small))
        assert await a.batch_get(skeys) == small
        assert used(a) == (2, 0)  # over the key limit: asked first
        assert await a.batch_get(skeys[:SPEC_KEYS]) == small[:SPEC_KEYS]
        assert used(a) == (2 + SPEC_KEYS, 0)
        await a.remove([b"ahead-256k", *skeys])

    run_two(store.master, body)


def test_bytes_read_at_a_place_the_answer_does_not_name_are_never_returned(store):
    """The remembered place of a key pointed at another key's bytes (same generation),
    or at the key's own place with another generation: the read ahead is thrown away
    and the value read where the master says."""
    vals = [os.urandom(4096), os.urandom(4096)]
    keys = [b"ahead-wrong-0000", b"ahead-wrong-0001"]

    async def body(a: StoreClient, _b: StoreClient):
        assert all(await a.batch_put(keys, vals))
        k, j = (a._where.map[x] for x in keys)
        a._where.note(keys[0], (*j[:4], k[4]))  # the other key's place, k's generation
        assert await a.get(keys[0]) == vals[0]
        assert used(a) == (0, 1)
        a._where.note(keys[0], (*k[:4], k[4] ^ 1))  # the right place, another generation
        dst = np.zeros(4096, np.uint8)
        rid = a.te.register(dst)
        try:
            assert await a.get_into([keys[0]], rid, [0]) == [4096]
            assert dst.tobytes() == vals[0]
        finally:
            a.te.unregister(rid)
        assert used(a) == (0, 2)
        # the answer taught it the right place: the next get uses its read
        assert a._where.map[keys[0]] == k
        assert await a.get(keys[0]) == vals[0]
        assert used(a) == (1, 2)
        await a.remove(keys)

    run_two(store.master, body)


def test_a_key_removed_and_put_again_elsewhere_gives_the_new_value(store):
    """Client A remembers where its key was; client B removes it and puts another
    value under it (into B's own slots); A's next get returns B's value, and a get of
    a removed key is a miss, whatever A remembered."""
    key, gone = b"ahead-again-0000", b"ahead-gone-00000"
    old, new = os.urandom(4096), os.urandom(4096)

    async def body(a: StoreClient, b: StoreClient):
        assert all(await a.batch_put([key, gone], [old, old]))
        assert await b.remove([key, gone]) == 2
        assert await b.put(key, new)
        assert await a.get(key) == new
        assert await a.batch_get([gone]) == [None]
        assert used(a) == (0, 2)
        assert gone not in a._where.map
        await b.remove([key])

    run_two(store.master, body)


def test_get_answers_carry_one_generation_per_replica_when_asked(store, fast):
    """GET with flag 2: one generation per placement after them (none for an unknown
    key); without it the answer is as before; unknown flags are INVALID_ARGUMENT."""
    key = b"ahead-frame-0001"

    async def body(a: StoreClient, _b: StoreClient):
        assert await a.put(key, b"x" * 4096)
        return a._where.map[key]

    where = run_two(store.master, body)
    status, got = fast_call(
        fast, wire.GET, wire.pack_get([b"never-put-000000", key], "t", True, True)
    )
    assert status == 0
    lease, locs, gens = wire.unpack_get_resp_gens(got)
    assert [loc[0] for loc in locs] == [1] and gens == [where[4]]
    assert (locs[0][1], locs[0][2], locs[0][4], locs[0][5]) == where[:4]
    status, plain = fast_call(fast, wire.GET, wire.pack_get([key], "t", True))
    assert status == 0 and wire.unpack_get_resp_gens(plain)[2] is None
    status, none = fast_call(fast, wire.GET, wire.pack_get([b"never-put-000000"], "t", True, True))
    assert status == 0 and wire.unpack_get_resp_gens(none)[1:] == ([], [])
    bad = bytearray(wire.pack_get([key], "t", True, True))
    bad[0] |= 0x80
    status, msg = fast_call(fast, wire.GET, bytes(bad))
    assert status == INVALID and b"flags" in msg
    assert fast_call(fast, wire.REMOVE, wire.pack_keys([key]))[0] == 0


@FUZZ
@given(
    flags=st.integers(0, 255),
    nkeys=st.integers(0, 3),
    lie=st.integers(-2, 40),
    cut=st.integers(0, 12),
)
def test_fuzz_get_frame(store, fast, flags, nkeys, lie, cut):
    """A GET frame with any flags, a key count that lies, or cut short: status 0 with an
    answer that parses, or INVALID_ARGUMENT with a message; the connection's master
    answers a valid call afterwards."""
    keys = [f"fuzz-get-{i:07d}".encode() for i in range(nkeys)]
    ok = bytearray(wire.pack_get(keys, "fuzzer", True, True))
    ok[0] = flags
    at = 1 + 1 + len("fuzzer")
    body = bytes(ok)
    if lie:
        body = body[:at] + struct.pack("<I", max(0, nkeys + lie)) + body[at + 4 :]
    body = body[: len(body) - cut] if cut < len(body) else b""
    status, got = fast_call(fast, wire.GET, body)
    if status == 0:
        lease, locs, gens = wire.unpack_get_resp_gens(got)
        assert locs == [] and gens == []  # no placement: none to name either way
    else:
        assert status == INVALID and got, (flags, nkeys, lie, cut)
    status, _ = fast_call(fast, wire.EXISTS, wire.pack_exists([b"k" * 16], True))
    assert status == 0
