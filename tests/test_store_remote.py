"""The store's remote path (a client that lends nothing, a store-node that holds the
segment), as real processes: puts take one compact PUT_START and one PUT_END frame on
the master's raw-TCP control path, big batches copy and send at once, small puts go
through the client's pool of remote slots (one PUT_SLOTS commit each), every byte comes
back; and the new frames, garbled, lying about lengths, truncated or naming unknown
keys, get a clear status while what was stored stays readable."""

from __future__ import annotations

import asyncio
import os
import struct
import time

import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st

from kvmesh.rdma import TransferEngine
from kvmesh.services.store import limits
from kvmesh.services.store.client import StoreClient
from kvmesh.services.store.remote_pool import REMOTE_POOL_MIN
from kvmesh.services.store_master import wire
from tests.store_util import FUZZ, INVALID, fast_address, fast_call, run_client, running_store


@pytest.fixture(scope="module")
def store(tmp_path_factory):
    with running_store(str(tmp_path_factory.mktemp("remote")), nodes=1, segment="96MiB") as c:
        yield c


def run(master: str, fn):
    return run_client(master, fn, "remote-tester", rpc_timeout=3)


@pytest.fixture(scope="module")
def fast(store):
    return fast_address(store)


def rpool(cl: StoreClient, size: int = 4096) -> list:
    """The client's held remote slots of ``size`` on its current fast connection."""
    return cl._rslots.of(size, cl._fast)


def test_remote_put_is_two_compact_calls_and_every_byte_comes_back(store, monkeypatch):
    """Mixed sizes and multi-MiB values (copied and sent in pipelined runs), put_from
    and get_into: the master is asked twice per put whatever the batch, never by gRPC."""
    monkeypatch.setattr(limits, "PIPELINE_BYTES", 1 << 20)  # several runs per batch
    sizes = [4096, 4096, 300_000, 3 << 20, 5000, 2 << 20]
    keys = [f"remote-{i}".encode() for i in range(len(sizes))]
    vals = [os.urandom(n) for n in sizes]

    async def body(cl: StoreClient, te: TransferEngine):
        sent: list[int] = []
        real = cl._fast_call

        async def spy(method, payload):
            sent.append(method)
            return await real(method, payload)

        cl._fast_call = spy
        assert await cl.batch_put(keys, vals) == [True] * len(keys)
        assert sent == [wire.PUT_START, wire.PUT_END]
        assert await cl.batch_get(keys) == vals
        # present keys are neither copied nor written again, and still report True
        assert await cl.batch_put(keys[:2], vals[:2]) == [True, True]
        src = np.frombuffer(os.urandom(8 << 20), dtype=np.uint8).copy()
        dst = np.zeros_like(src)
        rs, rd = te.register(src), te.register(dst)
        zk = [f"zc-{i}".encode() for i in range(4)]
        offs = [0, 1 << 20, 3 << 20, 7 << 20]
        lens = [1 << 20, 2 << 20, 4 << 20, 1 << 20]
        assert await cl.put_from(zk, rs, offs, lens) == [True] * 4
        assert await cl.get_into(zk, rd, offs) == lens
        assert np.array_equal(src, dst)
        await cl.remove(keys + zk)
        return cl.stats

    stats = run(store.master, body)
    assert stats["master_errors"] == 0 and stats["put_failed"] == 0


def test_large_gets_land_in_the_returned_bytes_without_staging(store):
    """A get of values of DIRECT_GET_MIN bytes or more reads each straight into the bytes
    it returns: every byte comes back, no staging buffer is made for them, the transient
    regions are gone afterwards, and small values in the same batch still come back
    through the staging path. A value whose holder is unreachable is a miss (None)."""
    big = limits.DIRECT_GET_MIN
    sizes = [big, 4096, 3 * big + 7, 5000, 5 << 20]
    keys = [f"direct-{i}".encode() for i in range(len(sizes))]
    vals = [os.urandom(n) for n in sizes]

    async def body(cl: StoreClient, te: TransferEngine):
        assert await cl.batch_put(keys, vals) == [True] * len(keys)
        cl._staging, cl._staging_region = None, -1  # forget the put's staging
        before = te._regions.ids()
        got = await cl.batch_get([keys[0], keys[2], keys[4]])
        assert got == [vals[0], vals[2], vals[4]] and all(type(v) is bytes for v in got)
        assert cl._staging is None  # nothing staged, nothing copied
        assert te._regions.ids() == before
        assert await cl.batch_get(keys) == vals  # mixed: small ones staged
        assert await cl.get(keys[4]) == vals[4]
        before = te._regions.ids()  # now with the small values' staging region
        # a holder that refuses the read (an unknown region): a miss, no region left over
        loc = await cl._get_replicas([keys[0]], True)
        assert loc is not None
        bad = [(0, loc[1][0][1], 10**6, "", 0, big)]
        out: list = [None]
        await cl._get_direct(bad, out)
        assert out == [None] and te._regions.ids() == before
        await cl.remove(keys)

    run(store.master, body)


def test_small_puts_are_one_commit_each_through_held_slots(store, monkeypatch):
    """After one PUT_RESERVE, each small put (bytes or zero-copy) is a transfer-engine
    write and ONE PUT_SLOTS call; the pool refills inside that call; a present key
    keeps its slot; every byte comes back."""
    vals = [os.urandom(4096) for _ in range(40)]
    keys = [f"pooled-{i}".encode() for i in range(len(vals))]

    async def body(cl: StoreClient, te: TransferEngine):
        assert await cl.exists(b"warm-up") is False  # opens the fast connection
        frames = _spy_conns(cl, monkeypatch)
        sent = _Methods(frames)
        for k, v in zip(keys, vals):
            assert await cl.put(k, v)
        assert sent.count(wire.PUT_RESERVE) == 1 and sent[0] == wire.PUT_RESERVE
        assert len(rpool(cl)) <= REMOTE_POOL_MIN  # one value at a time: a small pool
        assert sent.count(wire.PUT_SLOTS) == len(keys)
        assert wire.PUT_START not in sent and wire.PUT_END not in sent
        assert await cl.batch_get(keys) == vals
        sent.clear()
        pool = len(rpool(cl))
        assert await cl.put(keys[0], vals[0])  # present: True, the slot comes back
        assert sent == [wire.PUT_SLOTS] and len(rpool(cl)) == pool
        src = np.frombuffer(os.urandom(8 * 5000), dtype=np.uint8).copy()
        dst = np.zeros_like(src)
        rs, rd = te.register(src), te.register(dst)
        zk = [f"pooled-zc-{i}".encode() for i in range(8)]
        offs = [i * 5000 for i in range(8)]
        for i in range(0, 8, 2):  # pairs: a small batch through the pool
            assert await cl.put_from(zk[i : i + 2], rs, offs[i : i + 2], [5000, 5000]) == [
                True,
                True,
            ]
        assert await cl.get_into(zk, rd, offs) == [5000] * 8
        assert np.array_equal(src, dst)
        await cl.remove(keys + zk)
        return cl.stats

    stats = run(store.master, body)
    assert stats["master_errors"] == 0 and stats["put_failed"] == 0


def test_a_batch_of_128_small_values_goes_through_held_slots(store, monkeypatch):
    """The pool holds enough slots for the benchmarks' (and Mooncake's tools') batch of
    128: such a batch_put is one PUT_RESERVE, one write and one PUT_SLOTS, the next one
    a write and a PUT_SLOTS (its slots came with the first commit), never
    PUT_START/PUT_END; every byte comes back."""
    vals = [os.urandom(4096) for _ in range(256)]
    keys = [f"pooled-batch-{i}".encode() for i in range(len(vals))]

    async def body(cl: StoreClient, te: TransferEngine):
        assert await cl.exists(b"warm-up") is False  # opens the fast connection
        sent = _Methods(_spy_conns(cl, monkeypatch))
        assert await cl.batch_put(keys[:128], vals[:128]) == [True] * 128
        assert await cl.batch_put(keys[128:], vals[128:]) == [True] * 128
        assert sent.count(wire.PUT_SLOTS) == 2 and sent.count(wire.PUT_RESERVE) == 1
        assert wire.PUT_START not in sent and wire.PUT_END not in sent
        assert await cl.batch_get(keys) == vals
        await cl.remove(keys)
        return cl.stats

    stats = run(store.master, body)
    assert stats["master_errors"] == 0 and stats["put_failed"] == 0


def test_a_failed_slot_write_is_never_committed_and_a_lost_slot_is_put_again(store, monkeypatch):
    """The commit point of a pooled put is its PUT_SLOTS call, sent only for writes the
    holder acknowledged: a write that fails is never committed (its slot, and every
    other pooled slot on that holder, is dropped) and the key is put again through
    PUT_START/PUT_END; a slot the master does not hold (expired, a restarted master) is
    put again that way too, and the bytes read back are the new ones."""
    val = os.urandom(4096)

    async def body(cl: StoreClient, te: TransferEngine):
        assert await cl.exists(b"warm-up") is False  # opens the fast connection
        assert await cl.put(b"slot-first", val)
        pool = rpool(cl)
        assert pool
        use_by, addr, region, node, off, tok = pool[-1]
        stray = max(s[4] for s in pool) + (1 << 20)
        # a slot naming a region the holder does not have: the write fails
        pool.append((use_by, addr, region + 1000, node, off, tok))
        sent = _Methods(_spy_conns(cl, monkeypatch))
        assert await cl.put(b"slot-bad-write", val)
        assert wire.PUT_SLOTS not in sent._list() and sent[-2:] == [wire.PUT_START, wire.PUT_END]
        assert not [s for s in rpool(cl) if s[1] == addr]  # the holder's slots dropped
        assert await cl.get(b"slot-bad-write") == val
        monkeypatch.undo()
        # a slot the master never reserved (a writable offset, though): status 0, put again
        sent = _Methods(_spy_conns(cl, monkeypatch))
        rpool(cl).append((use_by, addr, region, node, stray, tok))
        other = os.urandom(4096)
        assert await cl.put(b"slot-not-held", other)
        assert sent == [wire.PUT_SLOTS, wire.PUT_START, wire.PUT_END]
        assert await cl.get(b"slot-not-held") == other
        assert await cl.get(b"slot-first") == val
        await cl.remove([b"slot-first", b"slot-not-held", b"slot-bad-write"])

    run(store.master, body)


class _Methods:
    """The methods of the frames ``_spy_conns`` records, compared as a list."""

    def __init__(self, frames: list) -> None:
        self.frames = frames

    def _list(self) -> list[int]:
        return [m for _, m, _ in self.frames]

    def __eq__(self, other) -> bool:
        return self._list() == other

    def __repr__(self) -> str:
        return repr(self._list())

    def __getitem__(self, i):
        return self._list()[i]

    def __contains__(self, m) -> bool:
        return m in self._list()

    def count(self, m: int) -> int:
        return self._list().count(m)

    def clear(self) -> None:
        self.frames.clear()


def _spy_conns(cl: StoreClient, monkeypatch) -> list[tuple[object, int, bytes]]:
    """Every fast-path frame the client sends, as (connection, method, body)."""
    from kvmesh.services.store.fastconn import FastConn

    sent: list[tuple[object, int, bytes]] = []
    real = FastConn.call

    def spy(self, method, body, timeout):
        sent.append((self, method, bytes(body)))
        return real(self, method, body, timeout)

    monkeypatch.setattr(FastConn, "call", spy)
    return sent


def test_an_expired_slot_anywhere_in_the_pool_is_never_used(store, monkeypatch):
    """Review finding 4 (issue 13): the pool is not in use-by order (a slot whose key
    was present goes back at the end with its old use-by time), so each slot taken is
    checked: an expired one at the end is dropped, never written nor committed."""
    val = os.urandom(4096)

    async def body(cl: StoreClient, te: TransferEngine):
        assert await cl.put(b"expired-first", val)
        pool = rpool(cl)
        assert len(pool) >= 2 and pool[0][0] > time.monotonic()
        stale = pool.pop()
        pool.append((time.monotonic() - 1.0, *stale[1:]))  # next to be taken
        sent = _spy_conns(cl, monkeypatch)
        assert await cl.put(b"expired-second", val)
        commits = [wire.unpack_put_slots(b) for _, m, b in sent if m == wire.PUT_SLOTS]
        assert len(commits) == 1 and stale[4] not in commits[0][4]
        assert stale not in rpool(cl) and all(s[4] != stale[4] for s in rpool(cl))
        assert await cl.get(b"expired-second") == val
        await cl.remove([b"expired-first", b"expired-second"])

    run(store.master, body)


def test_a_write_acknowledged_after_its_slots_use_by_time_is_put_again(store, monkeypatch):
    """Review finding 1, client side (issue 13): a pooled write is awaited only until
    its slot's use-by time; one that is not acknowledged by then is never committed
    (the master's hold may have ended and the slot gone to another writer): the key is
    put again through PUT_START/PUT_END, and reads back; the pool's other slots on that
    holder are given back (PUT_RELEASE) first."""
    val = os.urandom(4096)

    async def body(cl: StoreClient, te: TransferEngine):
        assert await cl.put(b"late-first", val)
        pool = rpool(cl)
        soon = time.monotonic() + 0.2
        pool[:] = [(soon, *s[1:]) for s in pool]
        real = cl._write
        slow = []

        async def slow_write(peer, slices):
            if not slow:  # only the pooled write: the put again goes at once
                slow.append(peer)
                await asyncio.sleep(0.5)
            return await real(peer, slices)

        cl._write = slow_write
        sent = _spy_conns(cl, monkeypatch)
        assert await cl.put(b"late-second", val)
        # the holder's other slots are given back (it may hang: no put waits on it again)
        assert [m for _, m, _ in sent] == [wire.PUT_RELEASE, wire.PUT_START, wire.PUT_END]
        assert not any(s[1] == slow[0] for p in cl._rslots.slots.values() for s in p)
        assert slow and await cl.get(b"late-second") == val
        await cl.remove([b"late-first", b"late-second"])

    run(store.master, body)


def test_slots_are_committed_only_on_the_connection_that_reserved_them(store, monkeypatch):
    """Review finding 3 (issue 13): slots belong to the fast connection they were
    reserved on (a new one may be a restarted or failed-over master that never reserved
    them); if it closes between the write and the commit, the commit is not sent on a
    new connection: the key is put again (PUT_START/PUT_END) and reads back."""
    val = os.urandom(4096)

    async def body(cl: StoreClient, te: TransferEngine):
        assert await cl.put(b"conn-first", val)
        first = cl._fast
        assert first is not None and rpool(cl)
        real = cl._write

        async def write_then_drop(peer, slices):
            ok = await real(peer, slices)
            first.close()  # the master's connection is gone before the commit
            cl._fast_retry = 0.0  # and a new one may be opened at once
            return ok

        cl._write = write_then_drop
        sent = _spy_conns(cl, monkeypatch)
        assert await cl.put(b"conn-second", val)
        assert all(c is not first for c, _, _ in sent)
        assert wire.PUT_SLOTS not in [m for _, m, _ in sent]
        assert [m for _, m, _ in sent][-2:] == [wire.PUT_START, wire.PUT_END]
        cl._write = real
        assert cl._fast is not first and await cl.get(b"conn-second") == val
        await cl.remove([b"conn-first", b"conn-second"])

    run(store.master, body)


def test_a_commit_must_present_its_reservations_token(store, fast):
    """Review finding 1, master side (issue 13): PUT_SLOTS with another token (an expired
    slot reserved again for someone else looks just like this) is status 0 and stores
    nothing; with the token PUT_RESERVE returned it stores the key."""
    status, body = fast_call(
        fast, wire.PUT_RESERVE, wire.pack_put_reserve("tok-writer", 4096, 1, 0)
    )
    assert status == 0
    _, region, _, node, token, offs = wire.unpack_put_reserve_resp(body)
    assert token != 0 and len(offs) == 1
    key = b"token-key-000001"

    def commit(tok: int) -> list[int]:
        st, b = fast_call(
            fast, wire.PUT_SLOTS, wire.pack_put_slots(node, region, [key], 4096, offs, [tok], 0)
        )
        assert st == 0
        return wire.unpack_put_slots_resp(b, 1)[0]

    assert commit(token ^ 1) == [0] and commit(0) == [0]
    assert fast_call(fast, wire.EXISTS, wire.pack_exists([key], True))[1] == wire.pack_exists_resp(
        0, [False]
    )
    assert commit(token) == [1]
    status, body = fast_call(fast, wire.REMOVE, wire.pack_keys([key]))
    assert status == 0


def _valid_put_start(keys: list[bytes], sizes: list[int]) -> bytes:
    return wire.pack_put_start("fuzzer", keys, sizes)


def test_put_frames_bad_input_gets_a_clear_status(store, fast):
    """A lying key count, a truncated size list, trailing bytes, a size of 0: each is
    INVALID_ARGUMENT with a message; a PUT_END of an unknown key is that key failed."""
    ok = _valid_put_start([b"a" * 16, b"b" * 16], [10, 20])
    at = 1 + len("fuzzer") + 8  # node id, u64 size (0: sizes follow), then the key list
    assert struct.unpack_from("<IH", ok, at) == (2, 16)
    cases = {
        "lying count": ok[:at] + struct.pack("<IH", 9, 16) + ok[at + 6 :],
        "truncated sizes": ok[:-4],
        "trailing bytes": ok + b"\0",
        "zero size": wire.pack_put_start("fuzzer", [b"c" * 16], [0]),
    }
    for what, body in cases.items():
        status, msg = fast_call(fast, wire.PUT_START, body)
        assert status == INVALID, (what, status, msg)
        assert msg, what
    status, msg = fast_call(fast, wire.PUT_END, wire.pack_put_end([b"x" * 16], False)[:-3])
    assert status == INVALID and msg
    status, body = fast_call(fast, wire.PUT_END, wire.pack_put_end([b"never-put" * 2], False))
    assert status == 0 and wire.unpack_put_end_resp(body) == (0, [0])


def test_slot_frames_bad_input_gets_a_clear_status(store, fast):
    """PUT_RESERVE / PUT_SLOTS: truncated, trailing bytes, a lying key count, a size of 0
    or larger than any segment, too many slots: INVALID_ARGUMENT with a message; a
    commit into a slot nobody holds (an unknown key, offset or segment) is status 0 and
    stores nothing."""
    res = wire.pack_put_reserve("fuzzer", 4096, 1, 0)
    slots = wire.pack_put_slots("nobody", 0, [b"a" * 16, b"b" * 16], 4096, [0, 4096], [1, 1], 0)
    at = 1 + len("nobody") + 4
    assert struct.unpack_from("<IH", slots, at) == (2, 16)
    cases = {
        (wire.PUT_RESERVE, "truncated"): res[:-1],
        (wire.PUT_RESERVE, "trailing"): res + b"\0",
        (wire.PUT_RESERVE, "zero size"): wire.pack_put_reserve("fuzzer", 0, 1, 0),
        (wire.PUT_RESERVE, "huge size"): wire.pack_put_reserve("fuzzer", 1 << 40, 1, 0),
        (wire.PUT_RESERVE, "too many"): wire.pack_put_reserve("fuzzer", 4096, 1 << 20, 0),
        (wire.PUT_RESERVE, "count 0"): wire.pack_put_reserve("fuzzer", 4096, 0, 3),
        (wire.PUT_SLOTS, "truncated"): slots[:-3],
        (wire.PUT_SLOTS, "trailing"): slots + b"\0",
        (wire.PUT_SLOTS, "lying count"): slots[:at] + struct.pack("<IH", 9, 16) + slots[at + 6 :],
        (wire.PUT_SLOTS, "no tokens"): slots[: -4 - 16] + slots[-4:],
        (wire.PUT_SLOTS, "zero size"): wire.pack_put_slots("n", 0, [b"c" * 16], 0, [0], [1], 0),
        (wire.PUT_SLOTS, "too many"): wire.pack_put_slots(
            "n", 0, [b"c" * 16], 1, [0], [1], 1 << 20
        ),
    }
    for (method, what), body in cases.items():
        status, msg = fast_call(fast, method, body)
        assert status == INVALID, (what, status, msg)
        assert msg, what
    status, msg = fast_call(fast, wire.PUT_RESERVE, cases[(wire.PUT_RESERVE, "count 0")])
    assert b"count" in msg
    status, body = fast_call(fast, wire.PUT_SLOTS, slots)
    assert status == 0 and wire.unpack_put_slots_resp(body, 2) == ([0, 0], 0, [])
    status, body = fast_call(fast, wire.EXISTS, wire.pack_exists([b"a" * 16, b"b" * 16], True))
    assert status == 0 and wire.unpack_exists_resp(body) == (0, [False, False])


@FUZZ
@given(
    which=st.sampled_from(
        [wire.PUT_START, wire.PUT_END, wire.PUT_RESERVE, wire.PUT_SLOTS, wire.PUT_RELEASE]
    ),
    nkeys=st.integers(1, 4),
    flips=st.lists(st.tuples(st.integers(0, 200), st.integers(0, 255)), max_size=4),
    cut=st.integers(0, 12),
    extra=st.binary(max_size=8),
)
def test_fuzz_put_frames(store, fast, stored, which, nkeys, flips, cut, extra):
    """Mutated PUT_START / PUT_END / PUT_RESERVE / PUT_SLOTS / PUT_RELEASE frames: a clean status
    (never a dropped connection, never INTERNAL), and the value stored before still
    reads back byte for byte (the ``stored`` fixture checks it at the end)."""
    keys = [os.urandom(16) for _ in range(nkeys)]
    offs = [i * 4096 for i in range(nkeys)]
    body = bytearray(
        {
            wire.PUT_START: lambda: _valid_put_start(keys, [4096] * nkeys),
            wire.PUT_END: lambda: wire.pack_put_end(keys, False),
            wire.PUT_RESERVE: lambda: wire.pack_put_reserve("fuzzer", 4096, nkeys, 0),
            wire.PUT_SLOTS: lambda: wire.pack_put_slots(
                "fuzzer", 0, keys, 4096, offs, [1] * nkeys, 1
            ),
            wire.PUT_RELEASE: lambda: wire.pack_put_release(
                "fuzzer", 0, 4096, [(o, 1) for o in offs]
            ),
        }[which]()
    )
    # the u64 size stays as it is: a huge one is a legal request that makes the master
    # evict (LRU) to fit it, and would evict the value this test checks (so do the
    # slot counts of PUT_RESERVE: only the writer's name is mutated there)
    start = {wire.PUT_START: 1 + len("fuzzer") + 8, wire.PUT_RESERVE: 0}.get(which, 0)
    if which == wire.PUT_RESERVE:  # the name mutated; cut, but nothing appended
        flips = [(p % (1 + len("fuzzer")), b) for p, b in flips]
        extra = b""
    for pos, b in flips:
        if start + pos < len(body):
            body[start + pos] = b
    body = bytes(body[: max(0, len(body) - cut)]) + extra
    status, _ = fast_call(fast, which, body)
    assert status in (0, INVALID), status


@pytest.fixture(scope="module")
def stored(store):
    key, val = b"kept-across-fuzz", os.urandom(70_000)

    async def put(cl, te):
        assert await cl.put(key, val)

    run(store.master, put)
    yield key, val

    async def check(cl, te):
        return await cl.get(key)

    assert run(store.master, check) == val


def test_put_start_of_a_stored_key_says_present(store, fast, stored):
    key, val = stored
    status, body = fast_call(fast, wire.PUT_START, _valid_put_start([key], [len(val)]))
    assert status == 0
    assert wire.unpack_put_start_resp(body) == ([], [0])
